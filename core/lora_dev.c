/* lora_dev.c — the adapters' copies on a backend the host cannot read (docs/design.md, "Training on a device"): the
 * parameters, gradients and AdamW moments live there while the model does, and the host buffers are mirrors brought
 * up to date on demand (lora.h), as the model's own training state is (backend.c). On the CPU backend the host
 * buffers are used in place and nothing here allocates. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lora.h"
#include "sched.h"

static int on_device(const ds4_model *m) { return m->lora && m->dev != m->cpu; }

static ds4_status upload_new(ds4_dev *d, const float *src, int64_t n, float **out, ds4_error *err) {
    const size_t bytes = (size_t)n * sizeof(float);
    void *p = NULL;
    ds4_status s = d->ops->alloc(d, bytes ? bytes : 4, &p, err);
    if (!s && src) s = d->ops->upload(d, p, src, bytes, err);
    if (!s && !src) d->ops->fill(d, p, 0, bytes);
    if (s) {
        d->ops->free(d, p);
        return s;
    }
    *out = p;
    return DS4_OK;
}

ds4_status ds4_lora_to_backend(ds4_model *m, ds4_error *err) {
    if (!on_device(m)) return DS4_OK;
    ds4_lora *l = m->lora;
    ds4_dev *d = m->dev;
    const int64_t L = m->cfg.num_hidden_layers;
    ds4_status s = DS4_OK;
    if (!l->dparams) {
        if ((s = upload_new(d, l->params, l->n, &l->dparams, err))) goto fail;
        ds4_lora_rebind(l, l->dw, l->dparams, L);
        l->dirty = 0;
        l->host_stale = 0;
    }
    if ((s = ds4_lora_train_bind(m, err))) goto fail;
    ds4_lora_point_views(m, l);
    return DS4_OK;
fail:
    ds4_error_prefix(err, "lora adapters to %s (%lld fp32 values): ", ds4_model_device_name(m), (long long)l->n);
    return s;
}

ds4_status ds4_lora_train_bind(ds4_model *m, ds4_error *err) {
    ds4_lora *l = m->lora;
    if (!on_device(m) || !l->grads || l->dgrads) {
        if (l) ds4_lora_point_views(m, l);
        return DS4_OK;
    }
    ds4_status s = upload_new(m->dev, l->grads, l->n, &l->dgrads, err);
    if (s) {
        ds4_error_prefix(err, "lora gradients on %s (%lld fp32 values): ", ds4_model_device_name(m), (long long)l->n);
        return s;
    }
    ds4_lora_rebind(l, l->dg, l->dgrads, m->cfg.num_hidden_layers);
    l->grads_stale = 0;
    ds4_lora_point_views(m, l);
    return DS4_OK;
}

ds4_status ds4_lora_host_sync(ds4_model *m, ds4_error *err) {
    ds4_lora *l = m ? m->lora : NULL;
    if (!l || !l->dparams) return DS4_OK;
    ds4_dev *d = m->dev;
    const size_t bytes = (size_t)l->n * sizeof(float);
    ds4_status s = DS4_OK;
    if (l->host_stale) m->params_gen++; /* the host adapters take the device's values */
    if (l->host_stale && (s = d->ops->download(d, l->params, l->dparams, bytes, err))) {
        ds4_error_prefix(err, "reading the adapters back from %s: ", ds4_model_device_name(m));
        return s;
    }
    l->host_stale = 0;
    if (l->grads_stale && l->dgrads && l->grads && (s = d->ops->download(d, l->grads, l->dgrads, bytes, err))) {
        ds4_error_prefix(err, "reading the adapter gradients back from %s: ", ds4_model_device_name(m));
        return s;
    }
    l->grads_stale = 0;
    return DS4_OK;
}

void ds4_lora_params_changed(ds4_model *m) {
    if (!m || !m->lora) return;
    m->lora->dirty = 1;
    m->params_gen++;
}

ds4_status ds4_lora_sync(ds4_model *m, ds4_error *err) {
    ds4_lora *l = m->lora;
    if (!l || !l->dparams || !l->dirty) return DS4_OK;
    ds4_status s = m->dev->ops->upload(m->dev, l->dparams, l->params, (size_t)l->n * sizeof(float), err);
    if (s) ds4_error_prefix(err, "uploading the adapters to %s: ", ds4_model_device_name(m));
    else l->dirty = 0;
    return s;
}

ds4_status ds4_lora_release_backend(ds4_model *m, ds4_error *err) {
    ds4_lora *l = m ? m->lora : NULL;
    if (!l || !l->dparams) return DS4_OK;
    ds4_status s = ds4_lora_host_sync(m, err);
    ds4_dev *d = m->dev;
    if (!s && l->moments_owner && l->dmoments) {
        const size_t bytes = (size_t)l->n * sizeof(float);
        for (int k = 0; k < 2 && !s; k++)
            s = d->ops->download(d, l->moments_home[k], l->dmoments + k * ds4_moments_stride(l->n), bytes, err);
        if (s) ds4_error_prefix(err, "reading the optimizer's adapter moments back from %s: ", ds4_model_device_name(m));
    }
    d->ops->free(d, l->dparams);
    d->ops->free(d, l->dgrads);
    d->ops->free(d, l->dmoments);
    l->dparams = l->dgrads = l->dmoments = NULL;
    l->moments_owner = NULL;
    l->dirty = l->host_stale = l->grads_stale = 0;
    ds4_lora_point_views(m, l);
    return s;
}

void ds4_lora_zero_grad(ds4_model *m) {
    ds4_lora *l = m->lora;
    if (!l || !l->grads) return;
    if (l->dgrads) {
        m->dev->ops->fill(m->dev, l->dgrads, 0, (size_t)l->n * sizeof(float));
        l->grads_stale = 1;
        return;
    }
    memset(l->grads, 0, (size_t)l->n * sizeof(float));
}
