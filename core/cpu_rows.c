/* cpu_rows.c — CPU operations that work row by row on activations: RMSNorm and its backward, RoPE, scaling,
 * row copies / gathers / scatters, stream sums, column sums. */
#include <string.h>

#include "cpu.h"

static void rmsnorm_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_rmsnorm *a = p;
    ds4_rmsnorm_rows(a->y + b * a->width, a->x + b * a->width, a->w, e - b, a->width, a->eps);
}

void ds4_cpu_rmsnorm(ds4_dev *d, const ds4_a_rmsnorm *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->rows, rmsnorm_range, a);
}

static void rope_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_rope *a = p;
    for (int64_t t = b; t < e; t++) {
        const float *cs = ds4_rope_at(&a->rt, ds4_rows_pos(&a->rows, t));
        for (int64_t hh = 0; hh < a->heads; hh++)
            ds4_rope_apply(a->x + (t * a->heads + hh) * a->width, a->width, a->rt.half, cs, a->sign);
    }
}

void ds4_cpu_rope(ds4_dev *d, const ds4_a_rope *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->rows.T, rope_range, a); }

void ds4_cpu_scale(ds4_dev *d, const ds4_a_scale *a) {
    (void)d;
    for (int64_t i = 0; i < a->n; i++) a->x[i] *= a->s;
}

void ds4_cpu_copy_rows(ds4_dev *d, const ds4_a_copy_rows *a) {
    (void)d;
    for (int64_t r = 0; r < a->rows; r++)
        memcpy((char *)a->dst + r * a->ldd, (const char *)a->src + r * a->lds, (size_t)a->row_bytes);
}

void ds4_cpu_gather_rows(ds4_dev *d, const ds4_a_gather_rows *a) {
    (void)d;
    for (int64_t r = 0; r < a->rows; r++)
        memcpy(a->dst + r * a->width, a->src + (a->idx[r] / a->div) * a->width, (size_t)a->width * sizeof(float));
}

void ds4_cpu_scatter_rows(ds4_dev *d, const ds4_a_scatter_rows *a) {
    (void)d;
    for (int64_t r = 0; r < a->rows; r++)
        memcpy(a->dst + (int64_t)a->idx[r] * a->width, a->src + r * a->width, (size_t)a->width * sizeof(float));
}

void ds4_cpu_add_rows(ds4_dev *d, const ds4_a_add_rows *a) {
    (void)d;
    for (int64_t r = 0; r < a->rows; r++) {
        float *y = a->dst + (int64_t)a->idx[r] * a->width;
        const float *x = a->src + r * a->width;
        for (int64_t i = 0; i < a->width; i++) y[i] += x[i];
    }
}

void ds4_cpu_add_bcast(ds4_dev *d, const ds4_a_add_bcast *a) {
    (void)d;
    for (int64_t t = 0; t < a->T; t++)
        for (int64_t i = 0; i < a->n; i++) ds4_axpy(a->x + (t * a->n + i) * a->D, 1.0f, a->h + t * a->D, a->D);
}

void ds4_cpu_sum_streams(ds4_dev *d, const ds4_a_sum_streams *a) {
    (void)d;
    memset(a->du, 0, (size_t)(a->T * a->D) * sizeof(float));
    for (int64_t t = 0; t < a->T; t++)
        for (int64_t k = 0; k < a->n; k++) ds4_axpy(a->du + t * a->D, 1.0f, a->dX + (t * a->n + k) * a->D, a->D);
}

void ds4_cpu_colsum_add(ds4_dev *d, const ds4_a_colsum_add *a) {
    (void)d;
    for (int64_t r = 0; r < a->rows; r++) /* row order: deterministic */
        for (int64_t i = 0; i < a->width; i++) a->dst[i] += a->src[r * a->ld + i];
}

/* ------------------------------------------------------------------------------------------------ norm backward */

typedef struct {
    float *dx;
    const float *dy, *x, *w;
    float *rinv;
    int64_t width;
    double eps;
    int acc;
    int rinv_only; /* first pass: the RMS factors alone */
} nb_ctx;

static void nb_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const nb_ctx *c = p;
    const int64_t n = c->width;
    for (int64_t r = b; r < e; r++) {
        const float *x = c->x + r * n, *dy = c->dy + r * n;
        double ss = 0, dot = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
        const double ri = 1.0 / sqrt(ss / (double)n + c->eps);
        c->rinv[r] = (float)ri;
        if (c->rinv_only) continue;
        for (int64_t i = 0; i < n; i++) dot += (double)(c->w ? c->w[i] * dy[i] : dy[i]) * x[i];
        const double k = ri * ri * ri * dot / (double)n;
        float *dx = c->dx + r * n;
        for (int64_t i = 0; i < n; i++) {
            double g = (double)(c->w ? c->w[i] * dy[i] : dy[i]) * ri - (double)x[i] * k;
            dx[i] = c->acc ? dx[i] + (float)g : (float)g;
        }
    }
}

typedef struct {
    float *dw;
    const float *dy, *x, *rinv;
    int64_t rows, width;
} nw_ctx;

static void nw_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const nw_ctx *c = p;
    for (int64_t i = b; i < e; i++) { /* a column per range item: a fixed-order sum over rows */
        double s = 0;
        for (int64_t r = 0; r < c->rows; r++) s += (double)c->dy[r * c->width + i] * c->x[r * c->width + i] * c->rinv[r];
        c->dw[i] += (float)s;
    }
}

/* y = w ⊙ x / rms(x) over each group's rows: dx (written, or added when acc) and dw += (w may be NULL). dx may
 * alias dy: the weight gradient, which reads dy, is taken before dx overwrites it. */
void ds4_cpu_norm_bwd(ds4_dev *d, const ds4_a_norm_bwd *a) {
    const ds4_cpu *cpu = ds4_cpu_of(d);
    const int64_t groups = a->groups > 0 ? a->groups : 1;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o = g * a->gstride;
        nb_ctx c = {a->dx + o, a->dy + o, a->x + o, a->w, cpu->rinv, a->width, a->eps, a->acc, 1};
        if (a->dw) {
            ds4_cpu_parallel(cpu, a->rows, nb_range, &c);
            nw_ctx cw = {a->dw, a->dy + o, a->x + o, cpu->rinv, a->rows, a->width};
            ds4_cpu_parallel(cpu, a->width, nw_range, &cw);
        }
        c.rinv_only = 0;
        ds4_cpu_parallel(cpu, a->rows, nb_range, &c);
    }
}
