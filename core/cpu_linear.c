/* cpu_linear.c — CPU matmuls: y = x Wᵀ (plain, column-grouped, row-grouped by expert) and the linear backward.
 *
 * The backward computes dx = dy W and dW += dyᵀ x with the forward's kernel (which only does x·Wᵀ) on transposed
 * copies; transposes are cheap next to the products. Every output element is one fixed-order 8-lane dot product
 * (kernels_cpu.h), so tiles and thread splits never change a bit.
 *
 * bf16_in (ops.h) rounds the activation operands to bf16 into a copy first: the fp32 reference of the bf16 mode's
 * rounding points, for tests. That copy is allocated per call, which a test reference can afford. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* The `span` floats from x rounded to bf16 (a new block the caller frees), x itself when !on or span <= 0, NULL
 * (failure recorded on d) when the copy cannot be allocated. */
static const float *bf16_copy(ds4_dev *d, const char *op, int on, const float *x, int64_t span, float **own) {
    *own = NULL;
    if (!on || span <= 0 || !x) return x;
    float *c = malloc((size_t)span * sizeof(float));
    if (!c) {
        ds4_dev_fail(d, DS4_ERR_OOM, "%s: bf16 operand copy of %lld floats", op, (long long)span);
        return NULL;
    }
    for (int64_t i = 0; i < span; i++) c[i] = ds4_bf16_to_f32(ds4_f32_to_bf16(x[i]));
    return *own = c;
}

static void check_f32(ds4_dev *d, const char *op, ds4_dtype wdt) {
    if (wdt != DS4_F32)
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: weight dtype %s (the CPU backend holds fp32 weights)", op,
                     ds4_dtype_name(wdt));
}

void ds4_cpu_matmul(ds4_dev *d, const ds4_a_matmul *a) {
    check_f32(d, "matmul", a->wdt);
    if (d->st) return;
    const ds4_cpu *cpu = ds4_cpu_of(d);
    const int64_t G = a->groups > 1 ? a->groups : 1;
    float *own;
    const float *x = bf16_copy(d, "matmul", a->bf16_in, a->x, a->T > 0 ? (a->T - 1) * a->ldx + (G - 1) * a->gx + a->K : 0,
                               &own);
    if (d->st) return;
    for (int64_t g = 0; g < G; g++)
        ds4_matmul_nt(cpu->pool, a->y + g * a->gy, a->ldy, x + g * a->gx, a->ldx, (const float *)a->W + g * a->gw, a->T,
                      a->K, a->O);
    free(own);
}

void ds4_cpu_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a) {
    check_f32(d, "matmul_grouped", a->wdt);
    if (d->st) return;
    const ds4_cpu *cpu = ds4_cpu_of(d);
    float *own;
    const float *x = bf16_copy(d, "matmul_grouped", a->bf16_in, a->x, a->off[a->E] * a->K, &own);
    if (d->st) return;
    for (int64_t e = 0; e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        if (n > 0)
            ds4_matmul_nt(cpu->pool, a->y + r0 * a->O, a->O, x + r0 * a->K, a->K, (const float *)a->W + e * a->wstride, n,
                          a->K, a->O);
    }
    free(own);
}

/* ------------------------------------------------------------------------------------------------ backward */

typedef struct {
    float *dst;
    const float *src;
    int64_t rows, cols, lds, ldd;
} tr_ctx;

/* dst[c, r] = src[r, c] for the src rows [b, e) of this range. Column tiles of 32 keep the 32 destination rows
 * being filled (each written sequentially in r) in L1, instead of touching a new line per element. */
static void tr_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const tr_ctx *t = p;
    for (int64_t c0 = 0; c0 < t->cols; c0 += 32) {
        const int64_t c1 = c0 + 32 < t->cols ? c0 + 32 : t->cols;
        for (int64_t r = b; r < e; r++) {
            const float *s = t->src + r * t->lds;
            for (int64_t c = c0; c < c1; c++) t->dst[c * t->ldd + r] = s[c];
        }
    }
}

/* dst [cols, rows] = srcᵀ (src [rows, cols] with row stride lds). */
static void transpose(const ds4_cpu *cpu, float *dst, const float *src, int64_t rows, int64_t cols, int64_t lds) {
    tr_ctx t = {dst, src, rows, cols, lds, rows};
    ds4_cpu_parallel(cpu, rows, tr_range, &t);
}

static void bwd_x(const ds4_cpu *cpu, float *dx, int64_t lddx, int acc, const float *dy, int64_t ldy, const float *W,
                  int64_t T, int64_t K, int64_t O) {
    if (T <= 0) return;
    transpose(cpu, cpu->lin_wt, W, O, K, K); /* Wᵀ [K, O] */
    ds4_matmul_nt(cpu->pool, cpu->lin_a, K, dy, ldy, cpu->lin_wt, T, O, K);
    for (int64_t t = 0; t < T; t++) {
        if (acc) ds4_axpy(dx + t * lddx, 1.0f, cpu->lin_a + t * K, K);
        else memcpy(dx + t * lddx, cpu->lin_a + t * K, (size_t)K * sizeof(float));
    }
}

static void bwd_w(const ds4_cpu *cpu, float *dW, const float *dy, int64_t ldy, const float *x, int64_t ldx, int64_t T,
                  int64_t K, int64_t O) {
    if (T <= 0) return;
    transpose(cpu, cpu->lin_b, dy, T, O, ldy); /* dyᵀ [O, T] */
    transpose(cpu, cpu->lin_c, x, T, K, ldx);  /* xᵀ [K, T] */
    ds4_matmul_nt(cpu->pool, cpu->lin_dw, K, cpu->lin_b, T, cpu->lin_c, O, T, K);
    ds4_axpy(dW, 1.0f, cpu->lin_dw, O * K);
}

void ds4_cpu_linear_bwd_x(ds4_dev *d, const ds4_a_linear_bwd_x *a) {
    check_f32(d, "linear_bwd_x", a->wdt);
    if (d->st) return;
    float *own;
    const float *dy = bf16_copy(d, "linear_bwd_x", a->bf16_in, a->dy, a->T > 0 ? (a->T - 1) * a->ldy + a->O : 0, &own);
    if (!d->st) bwd_x(ds4_cpu_of(d), a->dx, a->lddx, a->acc, dy, a->ldy, a->W, a->T, a->K, a->O);
    free(own);
}

/* wdt BF16 asks for the rounded operands as bf16_in does (ops.h) */
void ds4_cpu_linear_bwd_w(ds4_dev *d, const ds4_a_linear_bwd_w *a) {
    const int on = a->bf16_in || a->wdt == DS4_BF16;
    float *own_dy, *own_x = NULL;
    const float *dy = bf16_copy(d, "linear_bwd_w", on, a->dy, a->T > 0 ? (a->T - 1) * a->ldy + a->O : 0, &own_dy);
    const float *x = d->st ? NULL : bf16_copy(d, "linear_bwd_w", on, a->x, a->T > 0 ? (a->T - 1) * a->ldx + a->K : 0, &own_x);
    if (!d->st) bwd_w(ds4_cpu_of(d), a->dW, dy, a->ldy, x, a->ldx, a->T, a->K, a->O);
    free(own_dy);
    free(own_x);
}

void ds4_cpu_linear_bwd_x_grouped(ds4_dev *d, const ds4_a_linear_bwd_x_grouped *a) {
    check_f32(d, "linear_bwd_x_grouped", a->wdt);
    if (d->st) return;
    float *own;
    const float *dy = bf16_copy(d, "linear_bwd_x_grouped", a->bf16_in, a->dy, a->off[a->E] * a->O, &own);
    for (int64_t e = 0; !d->st && e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        bwd_x(ds4_cpu_of(d), a->dx + r0 * a->K, a->K, a->acc, dy + r0 * a->O, a->O,
              (const float *)a->W + e * a->wstride, n, a->K, a->O);
    }
    free(own);
}

void ds4_cpu_linear_bwd_w_grouped(ds4_dev *d, const ds4_a_linear_bwd_w_grouped *a) {
    const int on = a->bf16_in || a->wdt == DS4_BF16;
    float *own_dy, *own_x = NULL;
    const float *dy = bf16_copy(d, "linear_bwd_w_grouped", on, a->dy, a->off[a->E] * a->O, &own_dy);
    const float *x = d->st ? NULL : bf16_copy(d, "linear_bwd_w_grouped", on, a->x, a->off[a->E] * a->K, &own_x);
    for (int64_t e = 0; !d->st && e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        bwd_w(ds4_cpu_of(d), a->dW + e * a->wstride, dy + r0 * a->O, a->O, x + r0 * a->K, a->K, n, a->K, a->O);
    }
    free(own_dy);
    free(own_x);
}
