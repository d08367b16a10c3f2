/* cpu_optim.c — the optimizer's operations of the CPU backend (core/ops.h): the definitions the CUDA versions are
 * tested against, written with the host optimizer's own functions (optim.c), which the CPU path calls directly. */
#include <math.h>
#include <string.h>

#include "cpu.h"

void ds4_cpu_optim_sumsq(ds4_dev *d, const ds4_a_optim_sumsq *a) {
    (void)d;
    for (int64_t c = 0; c < a->n; c++) a->partial[c] = ds4_optim_sumsq(a->g + a->pieces[c].off, a->pieces[c].n);
}

void ds4_cpu_adamw(ds4_dev *d, const ds4_a_adamw *a) {
    (void)d;
    for (int64_t c = 0; c < a->n; c++) {
        const ds4_optim_piece *q = &a->pieces[c];
        const ds4_adamw_coefs *cf = &a->coefs[q->range];
        float *m = a->m + (q->off - a->mo), *v = a->v + (q->off - a->mo); /* a shard's moments start at mo */
        float *p = a->p + (q->off - a->po);                                 /* and its master at po */
        if (!a->update) {
            a->bad[c] = ds4_adamw_count_nonfinite(cf, a->coef, p, a->g + q->off, m, v, q->n);
            continue;
        }
        ds4_adamw_update_bounded(cf, a->coef, p, a->g + q->off, m, v, q->n, a->bnd ? &a->bnd[c] : NULL);
        if (!a->wcast || a->wcast[c].dst < 0) continue;
        char *w = (char *)a->wdst + a->wcast[c].dst;
        if (a->wcast[c].lowp && a->wdt == DS4_BF16) {
            uint16_t *dst = (uint16_t *)(void *)w;
            for (int64_t i = 0; i < q->n; i++) dst[i] = ds4_f32_to_bf16(p[i]);
        } else {
            memcpy(w, p, (size_t)q->n * sizeof(float));
        }
    }
}

void ds4_cpu_cast_params(ds4_dev *d, const ds4_a_cast_params *a) {
    (void)d;
    for (int64_t k = 0; k < a->n; k++) {
        const ds4_cast_entry *e = &a->e[k];
        const float *src = a->src + e->src;
        if (e->lowp && a->mdt == DS4_BF16) {
            uint16_t *dst = (uint16_t *)(void *)((char *)a->dst + e->dst);
            for (int64_t i = 0; i < e->n; i++) dst[i] = ds4_f32_to_bf16(src[i]);
        } else {
            float *dst = (float *)(void *)((char *)a->dst + e->dst);
            for (int64_t i = 0; i < e->n; i++) dst[i] = src[i];
        }
    }
}
