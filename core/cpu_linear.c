/* cpu_linear.c — CPU matmuls: y = x Wᵀ (plain, column-grouped, row-grouped by expert) and the linear backward.
 *
 * The backward computes dx = dy W and dW += dyᵀ x with the forward's kernel (which only does x·Wᵀ) on transposed
 * copies; transposes are cheap next to the products. Every output element is one fixed-order 8-lane dot product
 * (kernels_cpu.h), so tiles and thread splits never change a bit. */
#include <string.h>

#include "cpu.h"

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
    for (int64_t g = 0; g < G; g++)
        ds4_matmul_nt(cpu->pool, a->y + g * a->gy, a->ldy, a->x + g * a->gx, a->ldx, (const float *)a->W + g * a->gw,
                      a->T, a->K, a->O);
}

void ds4_cpu_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a) {
    check_f32(d, "matmul_grouped", a->wdt);
    if (d->st) return;
    const ds4_cpu *cpu = ds4_cpu_of(d);
    for (int64_t e = 0; e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        if (n > 0)
            ds4_matmul_nt(cpu->pool, a->y + r0 * a->O, a->O, a->x + r0 * a->K, a->K, (const float *)a->W + e * a->wstride,
                          n, a->K, a->O);
    }
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
    if (!d->st) bwd_x(ds4_cpu_of(d), a->dx, a->lddx, a->acc, a->dy, a->ldy, a->W, a->T, a->K, a->O);
}

void ds4_cpu_linear_bwd_w(ds4_dev *d, const ds4_a_linear_bwd_w *a) {
    bwd_w(ds4_cpu_of(d), a->dW, a->dy, a->ldy, a->x, a->ldx, a->T, a->K, a->O);
}

void ds4_cpu_linear_bwd_x_grouped(ds4_dev *d, const ds4_a_linear_bwd_x_grouped *a) {
    check_f32(d, "linear_bwd_x_grouped", a->wdt);
    if (d->st) return;
    for (int64_t e = 0; e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        bwd_x(ds4_cpu_of(d), a->dx + r0 * a->K, a->K, a->acc, a->dy + r0 * a->O, a->O,
              (const float *)a->W + e * a->wstride, n, a->K, a->O);
    }
}

void ds4_cpu_linear_bwd_w_grouped(ds4_dev *d, const ds4_a_linear_bwd_w_grouped *a) {
    for (int64_t e = 0; e < a->E; e++) {
        const int64_t r0 = a->off[e], n = a->off[e + 1] - r0;
        bwd_w(ds4_cpu_of(d), a->dW + e * a->wstride, a->dy + r0 * a->O, a->O, a->x + r0 * a->K, a->K, n, a->K, a->O);
    }
}
