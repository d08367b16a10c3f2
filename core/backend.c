/* backend.c — which backend a model computes on, and the backend-side copy of its weights.
 *
 * A model is created on the CPU backend of its engine: its weights are the host fp32 master copy, used in place.
 * ds4_model_to moves it to another backend: the weights are copied there once, each tensor in its working dtype
 * (the "M" matrices, ds4_param_lowp, in the device's dtype; everything else fp32), in table order, each tensor
 * 16-byte aligned except routed experts after the first, which must follow expert 0 contiguously (sharded experts,
 * ep_shard.c: only this rank's, following its first; the others' have no place); then the tid2eid tables; then the
 * FP4-resident experts' bytes and scales exactly as the host holds them (never expanded: the kernels decode them as
 * they read them). Host parameter changes mark the copy dirty; the next pass refreshes it (the FP4-resident experts
 * never change). docs/design.md. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "internal.h"
#include "lora.h"
#include "profile.h"
#include "sched.h"
#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#endif

/* Free what the model's passes keep on its backend: workspace, tape, RoPE copies. */
static void free_pass_memory(ds4_model *m) {
    ds4_dev *d = m->dev;
    if (!d) return;
    if (m->tape) {
        ds4_tape_free(m, m->tape);
        m->tape = NULL;
    }
    d->ops->free(d, m->ws);
    m->ws = NULL;
    m->ws_bytes = 0;
    for (int k = 0; k < 2; k++) {
        if (!d->host_visible) d->ops->free(d, m->rope_dev[k]);
        m->rope_dev[k] = NULL;
    }
}

static void print_profile(ds4_model *m, ds4_dev *d) {
    if (!d || !d->prof || !m->engine || !m->engine->profile_env) return;
    char buf[8192];
    ds4_profile_format(d, buf, sizeof buf);
    fprintf(stderr, "ds4 profile (DS4_PROFILE=1), model of %lld parameters:\n%s", (long long)m->n_params, buf);
}

/* Free the training state kept on a device (the host mirrors must have been brought up to date first, when they
 * are to survive) and point the gradient views back at the host buffer. */
static void free_train_state(ds4_model *m) {
    ds4_dev *d = m->dev;
    if (d && m->gsaved) d->ops->free(d, m->gsaved); /* on the CPU backend too: it is the backend's memory */
    m->gsaved = NULL;
    if (d && d != m->cpu) {
        d->ops->free(d, m->dgrads);
        d->ops->free(d, m->dmaster);
        d->ops->free(d, m->dmoments);
        d->ops->free(d, m->dscratch);
        d->ops->free(d, m->dcast);
    }
    free(m->hcast);
    m->hcast = NULL;
    m->dgrads = m->dmaster = m->dmoments = NULL;
    m->master_lo = m->master_n = 0;
    m->master_gather = NULL;
    m->master_gather_ctx = NULL;
    m->moments_n = 0;
    m->dscratch = NULL;
    m->dscratch_bytes = 0;
    m->dcast = NULL;
    m->n_cast = 0;
    m->moments_owner = NULL;
    m->moments_home[0] = m->moments_home[1] = NULL;
    m->host_stale = m->grads_stale = 0;
    if (m->grads) ds4_weights_bind(m, &m->gw, DS4_F32, (char *)m->grads, ds4_f32_byte_offset, NULL, NULL);
}

ds4_status ds4_model_drop_train_state(ds4_model *m, ds4_error *err) {
    ds4_model_grads_unguard(m);
    m->params_gen++; /* the moments may come back from the device below */
    ds4_status s = ds4_model_host_sync(m, err);
    if (s) return s;
    if (m->moments_owner && m->dmoments) {
        const size_t bytes = (size_t)m->moments_n * sizeof(float);
        for (int k = 0; k < 2 && !s; k++)
            s = m->dev->ops->download(m->dev, m->moments_home[k], m->dmoments + k * ds4_moments_stride(m->moments_n),
                                      bytes, err);
        if (s) return s;
    }
    free(m->grads);
    m->grads = NULL;
    free_train_state(m);
    if (m->tape) {
        ds4_tape_free(m, m->tape);
        m->tape = NULL;
    }
    ds4_weights_clear(m, &m->gw);
    return DS4_OK;
}

/* Give the non-CPU backend back (the CPU one stays). */
static void drop_device(ds4_model *m) {
    (void)ds4_lora_release_backend(m, NULL); /* callers that must not lose a device-side update synced first */
    free_pass_memory(m);
    free_train_state(m);
    if (m->dev && m->dev != m->cpu) {
        print_profile(m, m->dev);
        m->dev->ops->free(m->dev, m->dev_mem);
        ds4_dev_release(m->dev);
    }
    m->dev_mem = NULL;
    free(m->dev_off);
    m->dev_off = NULL;
    m->dev = m->cpu;
    m->dw = &m->w;
    m->dev_opt = (ds4_device_options){0};
}

void ds4_model_release_backend(ds4_model *m) {
    drop_device(m);
    print_profile(m, m->cpu);
    ds4_dev_release(m->cpu);
    m->dev = m->cpu = NULL;
}

static int64_t dev_byte_offset(const ds4_model *m, size_t i, void *ctx) {
    (void)ctx;
    return m->dev_off[i];
}

/* Lay the weights out for a backend with matrix dtype mdt: byte offsets into m->dev_off, sizes into m->dev_*. An
 * FP4-resident expert kind's block of q4 (its E experts' bytes, then their scales: model.c) is placed whole from a
 * 16-byte boundary (the kernels read the codes a 32-bit word at a time), so each expert's scales lie as far from its
 * bytes as on the host; dev_off holds the bytes' offset. */
static ds4_status layout(ds4_model *m, ds4_dtype mdt, ds4_error *err) {
    int64_t *off = malloc((m->n_table ? m->n_table : 1) * sizeof *off);
    if (!off) return ds4_fail(err, DS4_ERR_OOM, "model to device: %zu offsets", m->n_table);
    size_t at = 0;
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        off[i] = -1;
        if (p->dtype != DS4_F32 || p->elsewhere) continue; /* sharded experts: another rank's has no place here */
        /* the first expert this rank holds (expert 0, or its first under sharding) starts aligned; the rest follow */
        if (!p->follows || m->table[i - 1].elsewhere) at = (at + 15) & ~(size_t)15;
        off[i] = (int64_t)at;
        at += (size_t)p->numel * ds4_dtype_size(p->lowp ? mdt : DS4_F32);
    }
    m->dev_f32_bytes = (at + 15) & ~(size_t)15;
    m->dev_bytes = m->dev_f32_bytes + (size_t)m->n_tid2eid * sizeof(int32_t);
    m->dev_q4_bytes = 0;
    if (m->q4) {
        const size_t q0 = (m->dev_bytes + 15) & ~(size_t)15;
        size_t q = q0;
        int64_t shift = 0; /* a kind's device offset minus its q4 offset */
        for (size_t i = 0; i < m->n_table; i++) {
            const ds4_param *p = &m->table[i];
            if (p->dtype != DS4_FP4_PACKED) continue;
            if (!p->follows) {
                q = (q + 15) & ~(size_t)15;
                shift = (int64_t)q - p->offset;
            }
            off[i] = p->offset + shift;
            const size_t end = (size_t)(p->qscale + p->numel / DS4_FP4_BLOCK + shift);
            if (end > q) q = end;
        }
        m->dev_q4_bytes = q - q0;
        m->dev_bytes = q;
    }
    free(m->dev_off);
    m->dev_off = off;
    return DS4_OK;
}

/* Write the host weights into the backend copy (converting the matrices to mdt), through a bounded staging buffer. */
static ds4_status upload_weights(ds4_model *m, ds4_dev *d, void *mem, ds4_dtype mdt, ds4_error *err) {
    enum { STAGE = 1 << 24 };
    char *stage = malloc(STAGE);
    if (!stage) return ds4_fail(err, DS4_ERR_OOM, "model to device: staging buffer");
    ds4_status st = DS4_OK;
    for (size_t i = 0; i < m->n_table && !st; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_F32 || p->elsewhere) continue;
        const float *src = m->params + p->offset;
        const ds4_dtype dt = p->lowp ? mdt : DS4_F32;
        const size_t es = ds4_dtype_size(dt), per = STAGE / es;
        for (int64_t k = 0; k < p->numel && !st; k += (int64_t)per) {
            const int64_t n = p->numel - k < (int64_t)per ? p->numel - k : (int64_t)per;
            if (dt == DS4_BF16) {
                uint16_t *h = (uint16_t *)(void *)stage;
                for (int64_t j = 0; j < n; j++) h[j] = ds4_f32_to_bf16(src[k + j]);
            } else {
                memcpy(stage, src + k, (size_t)n * sizeof(float));
            }
            st = d->ops->upload(d, (char *)mem + m->dev_off[i] + (size_t)k * es, stage, (size_t)n * es, err);
        }
    }
    if (!st && m->n_tid2eid)
        st = d->ops->upload(d, (char *)mem + m->dev_f32_bytes, m->tid2eid_all, (size_t)m->n_tid2eid * sizeof(int32_t),
                            err);
    if (!st) st = d->ops->sync(d, err);
    free(stage);
    if (st) ds4_error_prefix(err, "model to device: uploading the weights: ");
    return st;
}

/* The FP4-resident experts into the backend copy: each kind's block of q4 as it is, where layout() placed it. */
static ds4_status upload_q4(ds4_model *m, ds4_dev *d, void *mem, ds4_error *err) {
    ds4_status st = DS4_OK;
    for (size_t i = 0; i < m->n_table && !st; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_FP4_PACKED || p->follows) continue;
        size_t j = i; /* the kind's last expert: its scales end the block */
        while (j + 1 < m->n_table && m->table[j + 1].dtype == DS4_FP4_PACKED && m->table[j + 1].follows) j++;
        const int64_t end = m->table[j].qscale + m->table[j].numel / DS4_FP4_BLOCK;
        st = d->ops->upload(d, (char *)mem + m->dev_off[i], m->q4 + p->offset, (size_t)(end - p->offset), err);
    }
    if (!st) st = d->ops->sync(d, err);
    if (st) ds4_error_prefix(err, "model to device: uploading the FP4-resident experts (%lld bytes): ",
                             (long long)m->n_q4);
    return st;
}

int64_t ds4_model_device_bytes(const ds4_model *m, int64_t *fp4_bytes) {
    const int on_dev = m && m->dev != m->cpu && m->dev_mem;
    if (fp4_bytes) *fp4_bytes = on_dev ? (int64_t)m->dev_q4_bytes : 0;
    return on_dev ? (int64_t)m->dev_bytes : 0;
}

/* ------------------------------------------------------------------------------------------------ training state */

void ds4_model_train_device_bytes(const ds4_model *m, int64_t *grads, int64_t *master, int64_t *moments) {
    const int on_dev = m && m->dev != m->cpu;
    *grads = on_dev && m->dgrads ? m->n_params * (int64_t)sizeof(float) : 0;
    *master = on_dev && m->dmaster ? m->master_n * (int64_t)sizeof(float) : 0; /* a ZeRO-1 region's, or all */
    /* the moments' bytes (their buffer pads v's start by up to 3 values: ds4_moments_stride) */
    *moments = on_dev && m->dmoments ? 2 * m->moments_n * (int64_t)sizeof(float) : 0;
}

void ds4_model_pass_bytes(const ds4_model *m, int64_t *tape, int64_t *workspace, int64_t *backward_workspace) {
    *tape = m && m->tape ? (int64_t)m->tape->bytes : 0;
    *workspace = m ? (int64_t)m->ws_bytes : 0;
    *backward_workspace = m && m->tape ? (int64_t)m->tape->bbytes : 0;
}

ds4_status ds4_model_train_bind(ds4_model *m, ds4_error *err) {
    if (m->lora) return ds4_lora_train_bind(m, err);
    ds4_dev *d = m->dev;
    if (!m->grads || d == m->cpu || m->dgrads) return DS4_OK;
    const size_t bytes = (size_t)m->n_params * sizeof(float);
    void *g = NULL;
    ds4_status s = d->ops->alloc(d, bytes ? bytes : 4, &g, err);
    if (!s) s = d->ops->upload(d, g, m->grads, bytes, err);
    if (s) {
        d->ops->free(d, g);
        ds4_error_prefix(err, "gradients on %s (%lld fp32 values): ", ds4_model_device_name(m), (long long)m->n_params);
        return s;
    }
    m->dgrads = g;
    m->grads_stale = 0;
    ds4_weights_bind(m, &m->gw, DS4_F32, (char *)m->dgrads, ds4_f32_byte_offset, NULL, NULL);
    return DS4_OK;
}

/* The moments buffer for two moments of n floats (v at ds4_moments_stride(n)): kept when it has that size; else the
 * moments it holds go back to their optimizer's host buffers (the only copy of them) and the buffer is made anew. */
static ds4_status moments_ready(ds4_model *m, int64_t n, ds4_error *err) {
    ds4_dev *d = m->dev;
    if (m->dmoments && m->moments_n == n) return DS4_OK;
    ds4_status s = DS4_OK;
    if (m->moments_owner && m->dmoments) {
        const size_t held = (size_t)m->moments_n * sizeof(float);
        for (int k = 0; k < 2 && !s; k++)
            s = d->ops->download(d, m->moments_home[k], m->dmoments + k * ds4_moments_stride(m->moments_n), held, err);
        if (s) {
            ds4_error_prefix(err, "device optimizer: handing the moments back from %s: ", ds4_model_device_name(m));
            return s;
        }
    }
    d->ops->free(d, m->dmoments);
    m->dmoments = NULL;
    m->moments_n = 0;
    m->moments_owner = NULL;
    void *mem = NULL;
    const size_t bytes = 2 * (size_t)ds4_moments_stride(n) * sizeof(float);
    if ((s = d->ops->alloc(d, bytes ? bytes : 4, &mem, err))) {
        ds4_error_prefix(err, "device optimizer on %s (two moments of %lld values): ", ds4_model_device_name(m),
                         (long long)n);
        return s;
    }
    m->dmoments = mem;
    m->moments_n = n;
    return DS4_OK;
}

/* The working-copy byte of flat element x of fp32 table entry i (x in it, or its end). */
static int64_t working_byte(const ds4_model *m, size_t i, int64_t x) {
    const ds4_param *p = &m->table[i];
    return m->dev_off[i] + (x - p->offset) * (int64_t)ds4_dtype_size(p->lowp ? m->dev_w.mdt : DS4_F32);
}

ds4_status ds4_model_working_regions(const ds4_model *m, int32_t world, const int64_t *off, const int64_t *len,
                                     int64_t *woff, int64_t *wlen, ds4_error *err) {
    /* the fp32 tensors lie in the copy in table order, as in the flat buffer (layout), so a run of elements is a run of
     * bytes; each region runs from its first element's byte to the next region's first (its tail's padding included),
     * the last to the end of the fp32 section */
    int64_t next = (int64_t)m->dev_f32_bytes;
    for (int32_t r = world - 1; r >= 0; r--) {
        woff[r] = next / 4, wlen[r] = 0;
        if (len[r] <= 0) continue;
        size_t i = 0;
        while (i < m->n_table && (m->table[i].dtype != DS4_F32 || m->table[i].elsewhere ||
                                  off[r] < m->table[i].offset || off[r] >= m->table[i].offset + m->table[i].numel))
            i++;
        const int64_t b = i < m->n_table ? working_byte(m, i, off[r]) : -1;
        if (b < 0 || b > next || b % 4 || next % 4)
            return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                            "ZeRO-1 working copy: rank %d's region starts at element %lld, byte %lld of the %s copy "
                            "(the next region at byte %lld): the all-gather moves 4-byte units",
                            r, (long long)off[r], (long long)b, ds4_dtype_name(m->dev_w.mdt), (long long)next);
        woff[r] = b / 4, wlen[r] = (next - b) / 4;
        next = b;
    }
    return DS4_OK;
}

/* The cast table of the master's region [lo, lo + n): every fp32 table entry's elements there, from the region's
 * buffer (src counted from lo) to their place in the working copy (the backend's layout and dtype). A ZeRO-1 region
 * may start or end inside a tensor (at a piece's start). */
static ds4_cast_entry *cast_table(const ds4_model *m, int64_t lo, int64_t n, int64_t *count) {
    int64_t k = 0;
    for (size_t i = 0; i < m->n_table; i++) k += m->table[i].dtype == DS4_F32 && !m->table[i].elsewhere;
    ds4_cast_entry *e = malloc((size_t)(k ? k : 1) * sizeof *e);
    if (!e) return NULL;
    k = 0;
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_F32 || p->elsewhere) continue;
        const int64_t b = p->offset > lo ? p->offset : lo;
        const int64_t end = p->offset + p->numel < lo + n ? p->offset + p->numel : lo + n;
        if (b < end) e[k++] = (ds4_cast_entry){.src = b - lo, .dst = working_byte(m, i, b), .n = end - b, .lowp = p->lowp};
    }
    *count = k;
    return e;
}

ds4_status ds4_model_master_ready(ds4_model *m, size_t scratch_bytes, int64_t moments_n, int64_t master_lo,
                                  int64_t master_n, ds4_error *err) {
    ds4_dev *d = m->dev;
    if (d == m->cpu) return ds4_fail(err, DS4_ERR_INTERNAL, "device optimizer state on the cpu backend");
    if (!m->lora && (master_lo < 0 || master_n < 0 || master_n > m->n_params - master_lo))
        return ds4_fail(err, DS4_ERR_INTERNAL, "device optimizer: master region [%lld, +%lld) of %lld parameters",
                        (long long)master_lo, (long long)master_n, (long long)m->n_params);
    const size_t bytes = (size_t)master_n * sizeof(float);
    ds4_status s = DS4_OK;
    if (m->dmaster && !m->lora && (m->master_lo != master_lo || m->master_n != master_n)) {
        /* another region (sharded, unsharded, re-sharded): the host first brought up to date (a sharded master's
         * regions from their owners: a collective), then the master made anew from it */
        if ((s = ds4_model_host_sync(m, err))) {
            ds4_error_prefix(err, "device optimizer: the master weights of another region: ");
            return s;
        }
        d->ops->free(d, m->dmaster);
        d->ops->free(d, m->dcast);
        free(m->hcast);
        m->dmaster = NULL, m->dcast = NULL, m->hcast = NULL, m->n_cast = 0;
        m->master_gather = NULL, m->master_gather_ctx = NULL;
    }
    if (!m->dmaster && !m->lora) { /* adapters are stepped in place: no master or moments of the frozen weights */
        int64_t n = 0;
        ds4_cast_entry *e = cast_table(m, master_lo, master_n, &n);
        if (!e) return ds4_fail(err, DS4_ERR_OOM, "device optimizer: cast table of %zu tensors", m->n_table);
        void *master = NULL, *cast = NULL;
        s = d->ops->alloc(d, bytes ? bytes : 4, &master, err);
        if (!s) s = d->ops->alloc(d, (size_t)(n ? n : 1) * sizeof *e, &cast, err);
        if (!s) s = d->ops->upload(d, master, m->params + master_lo, bytes, err);
        if (!s) s = d->ops->upload(d, cast, e, (size_t)n * sizeof *e, err);
        if (s) {
            free(e);
            d->ops->free(d, master);
            d->ops->free(d, cast);
            ds4_error_prefix(err, "device optimizer on %s (fp32 master weights, %lld of %lld parameters): ",
                             ds4_model_device_name(m), (long long)master_n, (long long)m->n_params);
            return s;
        }
        m->dmaster = master;
        m->dcast = cast;
        m->hcast = e;
        m->n_cast = n;
        m->master_lo = master_lo, m->master_n = master_n;
        m->host_stale = 0;
    }
    if (!m->lora && (s = moments_ready(m, moments_n, err))) return s;
    if (m->dscratch_bytes < scratch_bytes) {
        void *p = NULL;
        if ((s = d->ops->alloc(d, scratch_bytes, &p, err))) {
            ds4_error_prefix(err, "device optimizer scratch: ");
            return s;
        }
        d->ops->free(d, m->dscratch);
        m->dscratch = p;
        m->dscratch_bytes = scratch_bytes;
    }
    return DS4_OK;
}

ds4_status ds4_model_host_sync(ds4_model *m, ds4_error *err) {
    ds4_dev *d = m->dev;
    const size_t bytes = (size_t)m->n_params * sizeof(float);
    ds4_status s = ds4_lora_host_sync(m, err);
    if (s) return s;
    if (m->host_stale && m->dmaster) {
        /* a sharded master (ZeRO-1): this rank's region from its device, the others' from their owners, whose fp32
         * values no rank can rebuild from its working copy (bf16) */
        const int sharded = ds4_model_master_sharded(m);
        if (sharded && !m->master_gather)
            return ds4_fail(err, DS4_ERR_ARG,
                            "reading the weights back from %s: the fp32 master weights are sharded over the ranks "
                            "(ZeRO-1) and the optimizer that holds them was freed before they were read back (read "
                            "the weights on every rank, e.g. model:params(), before freeing a sharded optimizer)",
                            ds4_model_device_name(m));
        m->params_gen++; /* the host copy takes the device's values (even a failed read may have written some) */
        s = d->ops->download(d, m->params + m->master_lo, m->dmaster, (size_t)m->master_n * sizeof(float), err);
        if (s) {
            ds4_error_prefix(err, "reading the weights back from %s: ", ds4_model_device_name(m));
            return s;
        }
        if (sharded && (s = m->master_gather(m->master_gather_ctx, m->params, err))) return s;
        m->host_stale = 0;
    }
    if (m->grads_stale && m->dgrads && m->grads) {
        if ((s = d->ops->download(d, m->grads, m->dgrads, bytes, err))) {
            ds4_error_prefix(err, "reading the gradients back from %s: ", ds4_model_device_name(m));
            return s;
        }
        m->grads_stale = 0;
    }
    return DS4_OK;
}

/* The gradients that train: the model's, or with adapters attached the adapters' (the model's buffer is not
 * allocated then). host: the host buffer (NULL before gradients are enabled), dev: the backend's copy or NULL. */
static int64_t trained_grads(ds4_model *m, float **host, float **dev) {
    if (m->lora) {
        *host = m->lora->grads;
        *dev = m->lora->dgrads;
        return m->lora->n;
    }
    *host = m->grads;
    *dev = m->dgrads;
    return m->n_params;
}

ds4_status ds4_model_grad_buffer(ds4_model *m, float **out, int64_t *count, ds4_error *err) {
    if (!m || !out || !count) return ds4_fail(err, DS4_ERR_ARG, "grad_buffer: model, out or count is NULL");
    *out = NULL;
    *count = 0;
    float *host, *dev;
    const int64_t n = trained_grads(m, &host, &dev);
    if (!host)
        return ds4_fail(err, DS4_ERR_ARG, "grad_buffer: gradients are not enabled (ds4_model_enable_grad first)");
    if (dev) {
        ds4_status s = ds4_dev_check(m->dev, "grad_buffer", err);
        if (!s) s = m->dev->ops->sync(m->dev, err);
        if (s) return s;
    }
    *out = dev ? dev : host;
    *count = n;
    m->grads_zero = 0; /* the caller may write it */
    return DS4_OK;
}

ds4_status ds4_model_set_grad_regions(ds4_model *m, int32_t world, const int64_t *off, const int64_t *len,
                                      ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "set_grad_regions: model is NULL");
    int64_t *copy = NULL;
    if (world > 0) {
        if (!off || !len) return ds4_fail(err, DS4_ERR_ARG, "set_grad_regions: %d regions without offsets", world);
        float *host, *dev;
        const int64_t n = trained_grads(m, &host, &dev);
        int64_t end = 0;
        for (int32_t r = 0; r < world; r++) {
            if (off[r] < 0 || len[r] < 0 || (len[r] > 0 && off[r] < end) || off[r] + len[r] > n)
                return ds4_fail(err, DS4_ERR_ARG, "set_grad_regions: rank %d's region [%lld, +%lld) is not after the "
                                                  "previous ones inside the %lld gradients", r, (long long)off[r],
                                (long long)len[r], (long long)n);
            if (len[r] > 0) end = off[r] + len[r];
        }
        if (!(copy = malloc((size_t)world * 2 * sizeof *copy)))
            return ds4_fail(err, DS4_ERR_OOM, "set_grad_regions: %d regions", world);
        memcpy(copy, off, (size_t)world * sizeof *copy);
        memcpy(copy + world, len, (size_t)world * sizeof *copy);
    }
    free(m->grad_regions);
    m->grad_regions = copy;
    m->grad_world = copy ? world : 0;
    return DS4_OK;
}

int32_t ds4_model_grad_regions(const ds4_model *m, const int64_t **off, const int64_t **len) {
    *off = m && m->grad_regions ? m->grad_regions : NULL;
    *len = m && m->grad_regions ? m->grad_regions + m->grad_world : NULL;
    return m && m->grad_regions ? m->grad_world : 0;
}

void ds4_model_guard_grads(ds4_model *m, void (*wait)(void *ctx), void *ctx) {
    if (!m) return;
    m->gguard = wait;
    m->gguard_ctx = wait ? ctx : NULL;
}

/* Before the gradients go away: whoever uses them is done. */
void ds4_model_grads_unguard(ds4_model *m) {
    void (*wait)(void *) = m->gguard;
    void *ctx = m->gguard_ctx;
    m->gguard = NULL, m->gguard_ctx = NULL;
    if (wait) wait(ctx);
}

void ds4_model_on_grads_final(ds4_model *m, ds4_grads_final_fn fn, void *ctx) {
    if (!m) return;
    m->gfinal_fn = fn;
    m->gfinal_ctx = fn ? ctx : NULL;
}

void ds4_model_grads_changed(ds4_model *m) {
    if (!m) return;
    m->grads_zero = 0;
    if (m->lora && m->lora->dgrads) m->lora->grads_stale = 1;
    else if (m->dgrads) m->grads_stale = 1;
}

ds4_status ds4_model_scale_grads(ds4_model *m, double scale, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "scale_grads: model is NULL");
    float *host, *dev;
    const int64_t n = trained_grads(m, &host, &dev);
    if (!host)
        return ds4_fail(err, DS4_ERR_ARG, "scale_grads: gradients are not enabled (ds4_model_enable_grad first)");
    if (!isfinite(scale)) return ds4_fail(err, DS4_ERR_ARG, "scale_grads: scale %g is not finite", scale);
    OP(m->dev, scale, .x = dev ? dev : host, .n = n, .s = (float)scale);
    ds4_model_grads_changed(m);
    return ds4_dev_check(m->dev, "scale_grads", err);
}

/* Before the training state on the device goes away: host params and gradients up to date, the optimizer's moments
 * back in its host buffers. */
static ds4_status save_train_state(ds4_model *m, ds4_error *err) {
    m->params_gen++; /* parameters, adapters and moments may come back from the device */
    ds4_status s = ds4_model_host_sync(m, err);
    if (!s) s = ds4_lora_release_backend(m, err); /* the adapters' copies and moments come home too */
    if (s || !m->moments_owner || !m->dmoments) return s;
    ds4_dev *d = m->dev;
    const size_t bytes = (size_t)m->moments_n * sizeof(float);
    for (int k = 0; k < 2 && !s; k++)
        s = d->ops->download(d, m->moments_home[k], m->dmoments + k * ds4_moments_stride(m->moments_n), bytes, err);
    if (s) ds4_error_prefix(err, "reading the optimizer's moments back from %s: ", ds4_model_device_name(m));
    else m->moments_owner = NULL;
    return s;
}

ds4_status ds4_model_sync_weights(ds4_model *m, ds4_error *err) {
    /* the profile follows the engine's switch at every pass */
    if ((m->engine->profile != 0) != (m->dev->prof != NULL)) {
        ds4_status s = ds4_profile_enable(m->dev, m->engine->profile, err);
        if (s) return s;
    }
    ds4_status s = ds4_lora_sync(m, err);
    if (s || m->dev == m->cpu || !m->params_dirty) return s;
    s = upload_weights(m, m->dev, m->dev_mem, m->dev_w.mdt, err);
    if (!s && m->dmaster) { /* the host was written (after it had been brought up to date): the master follows */
        s = m->dev->ops->upload(m->dev, m->dmaster, m->params + m->master_lo, (size_t)m->master_n * sizeof(float),
                                err);
        if (s) ds4_error_prefix(err, "model to device: uploading the master weights: ");
    }
    if (!s) m->params_dirty = 0;
    return s;
}

void ds4_model_params_changed(ds4_model *m) {
    if (!m) return;
    m->params_dirty = 1;
    m->params_gen++;
}

ds4_status ds4_cuda_devices(int32_t *n, ds4_error *err) {
    if (!n) return ds4_fail(err, DS4_ERR_ARG, "cuda devices: n is NULL");
    *n = 0;
#ifdef DS4_HAVE_CUDA
    int count = 0;
    ds4_status s = ds4_cuda_device_count(&count, err);
    if (!s) *n = count;
    return s;
#else
    (void)err;
    return DS4_OK;
#endif
}

/* a equals the first len bytes of b, ignoring ASCII case, and b has no more */
static int word_is(const char *a, size_t len, const char *b) {
    size_t i = 0;
    for (; i < len && b[i]; i++) {
        const char x = a[i] >= 'A' && a[i] <= 'Z' ? (char)(a[i] - 'A' + 'a') : a[i];
        if (x != b[i]) return 0;
    }
    return i == len && !b[i];
}

static int dtype_word(const char *w, size_t len, ds4_dtype *out) {
    if (word_is(w, len, "fp32") || word_is(w, len, "f32") || word_is(w, len, "float32")) *out = DS4_F32;
    else if (word_is(w, len, "bf16") || word_is(w, len, "bfloat16")) *out = DS4_BF16;
    else return 0;
    return 1;
}

ds4_status ds4_device_parse(const char *spec, const char *dtype, ds4_device_options *out, ds4_error *err) {
    if (!spec || !out) return ds4_fail(err, DS4_ERR_ARG, "device: NULL argument");
    ds4_device_options o = {0};
    const char *p = spec;
    while (*p == ' ') p++;
    size_t n = 0;
    while (p[n] && p[n] != ' ' && p[n] != ':') n++;
    if (word_is(p, n, "cpu")) {
        o.type = DS4_DEVICE_CPU;
    } else if (word_is(p, n, "cuda") || word_is(p, n, "gpu")) {
        o.type = DS4_DEVICE_CUDA;
    } else {
        return ds4_fail(err, DS4_ERR_ARG, "device '%s': expected cpu, cuda or cuda:N (with an optional dtype: "
                        "\"cuda:0 bf16\")", spec);
    }
    p += n;
    if (*p == ':') {
        if (o.type != DS4_DEVICE_CUDA)
            return ds4_fail(err, DS4_ERR_ARG, "device '%s': only cuda takes an index", spec);
        p++;
        int64_t idx = 0;
        const char *d0 = p;
        while (*p >= '0' && *p <= '9' && idx < 1024) idx = idx * 10 + (*p++ - '0');
        if (p == d0 || idx >= 1024 || (*p && *p != ' '))
            return ds4_fail(err, DS4_ERR_ARG, "device '%s': the index after cuda: must be an integer in [0, 1023]",
                            spec);
        o.index = (int32_t)idx;
    }
    while (*p == ' ') p++;
    int have = 0;
    ds4_dtype dt = o.type == DS4_DEVICE_CUDA ? DS4_BF16 : DS4_F32; /* the CPU is fp32; CUDA defaults to bf16 */
    if (*p) {
        size_t k = strlen(p);
        while (k && p[k - 1] == ' ') k--;
        if (!dtype_word(p, k, &dt))
            return ds4_fail(err, DS4_ERR_ARG, "device '%s': unknown dtype after the device (fp32 or bf16)", spec);
        have = 1;
    }
    if (dtype) {
        ds4_dtype d2;
        if (!dtype_word(dtype, strlen(dtype), &d2))
            return ds4_fail(err, DS4_ERR_ARG, "device dtype '%s': expected fp32 or bf16", dtype);
        if (have && d2 != dt)
            return ds4_fail(err, DS4_ERR_ARG, "device '%s' with dtype '%s': two different dtypes", spec, dtype);
        dt = d2;
    }
    if (o.type == DS4_DEVICE_CPU && dt != DS4_F32)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "device '%s'%s%s: the CPU backend computes in fp32 only", spec,
                        dtype ? " dtype " : "", dtype ? dtype : "");
    o.dtype = dt;
    *out = o;
    return DS4_OK;
}

ds4_device_options ds4_model_device(const ds4_model *m) { return m->dev_opt; }

const char *ds4_model_device_name(const ds4_model *m) {
    if (m->dev_opt.type != DS4_DEVICE_CUDA) return "cpu";
    static const char *const names[2][8] = {
        {"cuda:0 fp32", "cuda:1 fp32", "cuda:2 fp32", "cuda:3 fp32", "cuda:4 fp32", "cuda:5 fp32", "cuda:6 fp32",
         "cuda:7 fp32"},
        {"cuda:0 bf16", "cuda:1 bf16", "cuda:2 bf16", "cuda:3 bf16", "cuda:4 bf16", "cuda:5 bf16", "cuda:6 bf16",
         "cuda:7 bf16"}};
    const int i = m->dev_opt.index;
    if (i < 0 || i > 7) return m->dev_opt.dtype == DS4_BF16 ? "cuda bf16" : "cuda fp32";
    return names[m->dev_opt.dtype == DS4_BF16][i];
}

ds4_status ds4_model_to_backend(ds4_model *m, ds4_dev *nd, const ds4_device_options *o, ds4_error *err) {
    const ds4_dtype mdt = o->dtype == DS4_BF16 ? DS4_BF16 : DS4_F32;
    int64_t *old_off = m->dev_off;
    const size_t old_sizes[3] = {m->dev_f32_bytes, m->dev_bytes, m->dev_q4_bytes};
    m->dev_off = NULL;
    void *mem = NULL;
    ds4_status s = layout(m, mdt, err);
    if (!s) {
        s = nd->ops->alloc(nd, m->dev_bytes, &mem, err);
        if (s) ds4_error_prefix(err, "model to cuda:%d (%lld parameters, %s): ", (int)o->index, (long long)m->n_params,
                                ds4_dtype_name(mdt));
    }
    if (!s) s = save_train_state(m, err); /* the host copies must be current before they are uploaded */
    if (!s) s = upload_weights(m, nd, mem, mdt, err);
    if (!s && m->q4) s = upload_q4(m, nd, mem, err);
    if (s) { /* nothing changed: the model stays where it was */
        if (mem) nd->ops->free(nd, mem);
        ds4_dev_release(nd);
        free(m->dev_off);
        m->dev_off = old_off;
        m->dev_f32_bytes = old_sizes[0], m->dev_bytes = old_sizes[1], m->dev_q4_bytes = old_sizes[2];
        (void)ds4_lora_to_backend(m, NULL); /* save_train_state brought the adapters home: back where they were */
        return s;
    }
    int64_t *new_off = m->dev_off;
    const size_t f32b = m->dev_f32_bytes, bytes = m->dev_bytes, q4b = m->dev_q4_bytes;
    m->dev_off = old_off;
    drop_device(m);
    m->dev_off = new_off;
    m->dev_f32_bytes = f32b;
    m->dev_bytes = bytes;
    m->dev_q4_bytes = q4b;
    m->dev = nd;
    m->dev_mem = mem;
    ds4_weights_bind(m, &m->dev_w, mdt, mem, dev_byte_offset, NULL, (int32_t *)(void *)((char *)mem + f32b));
    m->dw = &m->dev_w;
    m->dev_opt = (ds4_device_options){DS4_DEVICE_CUDA, o->index, mdt};
    m->params_dirty = 0;
    s = ds4_lora_to_backend(m, err); /* the adapters follow the model */
    if (s) return s;
    return ds4_model_train_bind(m, err); /* gradients follow the model (a failure leaves them on the host) */
}

ds4_status ds4_model_to(ds4_model *m, const ds4_device_options *o, ds4_error *err) {
    if (!m || !o) return ds4_fail(err, DS4_ERR_ARG, "model to device: NULL argument");
    if (o->type != DS4_DEVICE_CPU && o->type != DS4_DEVICE_CUDA)
        return ds4_fail(err, DS4_ERR_ARG, "model to device: unknown device type %d", (int)o->type);
    const ds4_dtype mdt = o->dtype == DS4_BF16 ? DS4_BF16 : DS4_F32;
    if (o->dtype != DS4_F32 && o->dtype != DS4_BF16)
        return ds4_fail(err, DS4_ERR_ARG, "model to device: dtype %s (F32 or BF16)", ds4_dtype_name(o->dtype));
    if (o->type == DS4_DEVICE_CPU) {
        if (mdt != DS4_F32)
            return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model to cpu: dtype %s (the CPU backend is fp32)",
                            ds4_dtype_name(mdt));
        if (m->dev != m->cpu) {
            ds4_status s = save_train_state(m, err);
            if (s) return s;
            drop_device(m);
        }
        return DS4_OK;
    }
#ifndef DS4_HAVE_CUDA
    return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                    "model to cuda:%d: this build of ds4 has no CUDA backend (nvcc was not found when it was configured)",
                    (int)o->index);
#else
    if (m->dev != m->cpu && m->dev_opt.index == o->index && m->dev_opt.dtype == mdt) return DS4_OK;
    int count = 0;
    ds4_status s = ds4_cuda_device_count(&count, err);
    if (s) return s;
    if (count == 0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model to cuda:%d: no CUDA device here (no driver or no GPU)",
                        (int)o->index);
    if (o->index < 0 || o->index >= count)
        return ds4_fail(err, DS4_ERR_ARG, "model to cuda:%d: %d CUDA device%s", (int)o->index, count,
                        count == 1 ? "" : "s");
    ds4_dev *nd = NULL;
    if ((s = ds4_cuda_dev_create(o->index, &nd, err))) return s;
    return ds4_model_to_backend(m, nd, o, err);
#endif
}

size_t ds4_model_profile_report(ds4_model *m, char *buf, size_t len) {
    if (!m) return 0;
    return ds4_profile_format(m->dev, buf, len);
}

void ds4_model_profile_reset(ds4_model *m) {
    if (m) ds4_profile_reset(m->dev);
}

ds4_status ds4_model_reserve(ds4_model *m, int64_t tokens, int64_t max_pos, int training, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "reserve: model is NULL");
    if (tokens < 1 || max_pos < 1 || tokens > (1 << 24) || max_pos > (1 << 30))
        return ds4_fail(err, DS4_ERR_ARG, "reserve: %lld rows at positions < %lld (rows in [1, 2^24], positions in "
                        "[1, 2^30])", (long long)tokens, (long long)max_pos);
    /* a full forward of `tokens` rows in sequences of max_pos plans the [B, S] buffers too: the larger plan */
    const int64_t B = (tokens + max_pos - 1) / max_pos;
    ds4_pass p;
    return ds4_pass_setup(m, &p, B, max_pos, tokens, NULL, training, err);
}
