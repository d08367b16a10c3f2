/* cache.c — ds4_cache: one sequence's decoding state of every layer, in one allocation of the model's backend memory.
 *
 * Sizes per layer: the ring holds R = min(sliding_window, cap) vectors of d; a compressor of rate m holds cap / m
 * entries plus 2m raw rows of C and Z (the pending window, and the last complete window that CSA's overlapping pool
 * reads again). Nothing grows with the sequence beyond the entries. Off the CPU, the layer descriptors (pointers
 * into the state) are kept in backend memory too, after the state, so a step hands the kernels one pointer per
 * sequence. A cache holds a reference to its backend, so it may be freed after its model. */
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "internal.h"
#include "ops.h"

static float *take(char *base, size_t *off, int64_t n) {
    float *p = base ? (float *)(void *)(base + *off) : NULL;
    *off += (size_t)n * sizeof(float);
    return p;
}

/* Carve (base != NULL) or size (base == NULL) every layer's state; returns its bytes. */
static size_t layout(ds4_cache *c, char *base) {
    const ds4_config *cf = &c->m->cfg;
    const int64_t d = cf->head_dim, cI = cf->index_head_dim;
    size_t off = 0;
    for (int64_t li = 0; li < cf->num_hidden_layers; li++) {
        ds4_layer_cache *lc = &c->layers[li];
        const ds4_attn_type ty = cf->layer_types[li];
        lc->ring = take(base, &off, c->ring * d);
        ds4_comp_cache *cc[2] = {&lc->comp, &lc->idx};
        for (int k = 0; k < 2; k++) {
            memset(cc[k], 0, sizeof *cc[k]);
            if (ty == DS4_ATTN_SLIDING || (k == 1 && ty != DS4_ATTN_CSA)) continue;
            cc[k]->overlap = ty == DS4_ATTN_CSA;
            cc[k]->m = ty == DS4_ATTN_CSA ? cf->compress_rate_csa : cf->compress_rate_hca;
            cc[k]->dd = k == 0 ? d : cI;
            cc[k]->width = (cc[k]->overlap ? 2 : 1) * cc[k]->dd;
            cc[k]->ent = take(base, &off, c->cap / cc[k]->m * cc[k]->dd);
            cc[k]->C = take(base, &off, 2 * cc[k]->m * cc[k]->width);
            cc[k]->Z = take(base, &off, 2 * cc[k]->m * cc[k]->width);
        }
    }
    return (off + 63) & ~(size_t)63;
}

ds4_status ds4_cache_create(const ds4_model *m, int64_t max_len, ds4_cache **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "cache create: out is NULL");
    *out = NULL;
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "cache create: model is NULL");
    if (max_len < 1 || max_len > ((int64_t)1 << 30))
        return ds4_fail(err, DS4_ERR_ARG, "cache create: max_len %lld outside [1, 2^30]", (long long)max_len);
    ds4_cache *c = calloc(1, sizeof *c);
    if (!c) return ds4_fail(err, DS4_ERR_OOM, "cache create: cache struct");
    const int64_t L = m->cfg.num_hidden_layers;
    c->m = m;
    c->dev = m->dev;
    ds4_dev_retain(c->dev);
    c->cap = max_len;
    c->ring = m->cfg.sliding_window < max_len ? m->cfg.sliding_window : max_len;
    c->layers = calloc((size_t)L, sizeof *c->layers);
    if (!c->layers) {
        ds4_cache_free(c);
        return ds4_fail(err, DS4_ERR_OOM, "cache create: %lld layer states", (long long)L);
    }
    c->bytes = layout(c, NULL);
    const size_t desc = c->dev->host_visible ? 0 : (size_t)L * sizeof(ds4_layer_cache);
    ds4_status s = c->dev->ops->alloc(c->dev, c->bytes + desc, &c->mem, err);
    if (s) {
        const size_t bytes = c->bytes + desc;
        ds4_cache_free(c);
        ds4_error_prefix(err, "cache create: %zu bytes for max_len %lld: ", bytes, (long long)max_len);
        return s;
    }
    layout(c, c->mem);
    c->dlayers = c->layers;
    if (desc) {
        c->dlayers = (ds4_layer_cache *)(void *)((char *)c->mem + c->bytes);
        if ((s = c->dev->ops->upload(c->dev, c->dlayers, c->layers, desc, err))) {
            ds4_cache_free(c);
            return s;
        }
    }
    *out = c;
    return DS4_OK;
}

void ds4_cache_free(ds4_cache *c) {
    if (!c) return;
    if (c->mem) c->dev->ops->free(c->dev, c->mem);
    ds4_dev_release(c->dev); /* the backend outlives the model while a cache still holds it */
    free(c->layers);
    free(c);
}

void ds4_cache_reset(ds4_cache *c) {
    if (c) c->len = 0;
}

int64_t ds4_cache_len(const ds4_cache *c) { return c ? c->len : 0; }
int64_t ds4_cache_capacity(const ds4_cache *c) { return c ? c->cap : 0; }
size_t ds4_cache_bytes(const ds4_cache *c) {
    return c ? c->bytes + sizeof *c + (size_t)c->m->cfg.num_hidden_layers * sizeof *c->layers : 0;
}

ds4_status ds4_cache_copy(ds4_cache *dst, const ds4_cache *src, ds4_error *err) {
    if (!dst || !src) return ds4_fail(err, DS4_ERR_ARG, "cache copy: NULL cache");
    if (dst == src) return DS4_OK;
    if (dst->m != src->m) return ds4_fail(err, DS4_ERR_ARG, "cache copy: the caches belong to different models");
    if (dst->dev != src->dev) return ds4_fail(err, DS4_ERR_ARG, "cache copy: the caches live on different backends");
    if (src->len > dst->cap)
        return ds4_fail(err, DS4_ERR_SHAPE, "cache copy: source length %lld exceeds the destination's capacity %lld",
                        (long long)src->len, (long long)dst->cap);
    const ds4_config *cf = &src->m->cfg;
    ds4_dev *dev = dst->dev;
    const int64_t d = cf->head_dim, len = src->len;
    const size_t fs = sizeof(float);
    if (dst->cap == src->cap) { /* the same layout: one copy of the whole state */
        ds4_dev_copy(dev, dst->mem, src->mem, src->bytes);
    } else {
        for (int64_t li = 0; li < cf->num_hidden_layers; li++) {
            const ds4_layer_cache *s = &src->layers[li];
            ds4_layer_cache *t = &dst->layers[li];
            /* rings of different sizes keep token q at different slots: copy the live tokens one by one */
            const int64_t lo = len - src->ring > 0 ? len - src->ring : 0;
            for (int64_t q = (len - dst->ring > lo ? len - dst->ring : lo); q < len; q++)
                ds4_dev_copy(dev, t->ring + (q % dst->ring) * d, s->ring + (q % src->ring) * d, (size_t)d * fs);
            const ds4_comp_cache *sc[2] = {&s->comp, &s->idx};
            ds4_comp_cache *tc[2] = {&t->comp, &t->idx};
            for (int k = 0; k < 2; k++) {
                if (!sc[k]->ent) continue;
                ds4_dev_copy(dev, tc[k]->ent, sc[k]->ent, (size_t)(len / sc[k]->m * sc[k]->dd) * fs);
                ds4_dev_copy(dev, tc[k]->C, sc[k]->C, (size_t)(2 * sc[k]->m * sc[k]->width) * fs);
                ds4_dev_copy(dev, tc[k]->Z, sc[k]->Z, (size_t)(2 * sc[k]->m * sc[k]->width) * fs);
            }
        }
    }
    ds4_status s = ds4_dev_check(dev, "cache copy", err);
    if (s) return s;
    dst->len = len;
    return DS4_OK;
}

int64_t ds4_model_csa_layers(const ds4_model *m) {
    int64_t n = 0;
    for (int64_t li = 0; m && li < m->cfg.num_hidden_layers; li++) n += m->cfg.layer_types[li] == DS4_ATTN_CSA;
    return n;
}
