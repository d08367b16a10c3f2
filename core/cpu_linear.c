/* cpu_linear.c — CPU matmuls: y = x Wᵀ (plain, column-grouped, row-grouped by expert) and the linear backward.
 *
 * All of them are products of ds4_gemm_run. The forward's outputs are each one fixed-order 8-lane dot product
 * (kernels_cpu.h, cpu_gemm.c), the same whatever rows are batched together. The backward's dx = dy W and dW += dyᵀ x
 * sum their products in increasing order onto one running sum (ds4_gemm.seq, cpu_gemm_seq.c), which reads W, dy and x
 * where they lie, with no transposed copies: the backward needs determinism, not batch invariance. Either way tiles
 * and thread splits never change a bit. A grouped operation (output groups, routed experts) runs all its groups as
 * one parallel job.
 *
 * bf16_in (ops.h) rounds the activation operands to bf16 into a copy first: the fp32 reference of the bf16 mode's
 * rounding points, for tests. That copy is allocated per call, which a test reference can afford. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "fp4.h"

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

/* The `span` bf16 values from x16 as floats (a new block the caller frees; NULL, failure recorded on d, when it
 * cannot be allocated): the values bf16_copy gives for the floats x16 was rounded from. */
static const float *bf16_expand(ds4_dev *d, const char *op, const uint16_t *x16, int64_t span, float **own) {
    float *c = malloc((size_t)(span > 0 ? span : 1) * sizeof(float));
    if (!c) {
        ds4_dev_fail(d, DS4_ERR_OOM, "%s: bf16 operand copy of %lld floats", op, (long long)span);
        return *own = NULL;
    }
    for (int64_t i = 0; i < span; i++) c[i] = ds4_bf16_to_f32(x16[i]);
    return *own = c;
}

/* fp4: the operation also takes FP4-resident weights (the routed experts' forward and input gradient) */
static void check_wdt(ds4_dev *d, const char *op, ds4_dtype wdt, int fp4) {
    if (wdt != DS4_F32 && !(fp4 && wdt == DS4_FP4_PACKED))
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: weight dtype %s (the CPU backend holds fp32 weights%s)", op,
                     ds4_wdt_name(wdt), fp4 ? ", or FP4-resident experts" : "");
}

static void check_f32(ds4_dev *d, const char *op, ds4_dtype wdt) { check_wdt(d, op, wdt, 0); }

/* Group e's B as the FP4-resident expert e (fp4.h): the packed bytes and scales instead of fp32 values. */
static ds4_gemm packed_b(ds4_gemm g, ds4_dtype wdt, const void *W, const uint8_t *Ws, int64_t e, int64_t wstride) {
    if (wdt != DS4_FP4_PACKED) return g;
    g.b = NULL;
    g.bq = (const uint8_t *)W + e * wstride / 2;
    g.bs = Ws + e * wstride / DS4_FP4_BLOCK;
    return g;
}

/* At most this many groups per job (the output groups and the routed experts are far fewer). */
enum { MAX_GROUPS = 256 };

static void run(const ds4_cpu *cpu, const ds4_gemm *g, int64_t n) {
    ds4_gemm_run(cpu->pool, g, n, cpu->gemm_ws);
}

/* y[t, o] = Σ_k x[t, k]·W[o, k]: A = x, B = W, both read along k. */
static ds4_gemm fwd(float *y, int64_t ldy, const float *x, int64_t ldx, const float *W, int64_t T, int64_t K, int64_t O) {
    return (ds4_gemm){.y = y, .ldy = ldy, .a = x, .a_rs = ldx, .a_ks = 1, .b = W, .b_rs = K, .b_ks = 1, .M = T, .N = O, .R = K};
}

/* dx[t, k] (+)= Σ_o dy[t, o]·W[o, k]: A = dy along o, B(k, o) = W[o, k] read across. */
static ds4_gemm bwd_x(float *dx, int64_t lddx, int acc, const float *dy, int64_t ldy, const float *W, int64_t T, int64_t K,
                      int64_t O) {
    return (ds4_gemm){.y = dx, .ldy = lddx, .a = dy, .a_rs = ldy, .a_ks = 1, .b = W, .b_rs = 1, .b_ks = K,
                      .M = T, .N = K, .R = O, .acc = acc, .seq = 1};
}

/* dW[o, k] += Σ_t dy[t, o]·x[t, k]: A(o, t) = dy[t, o] and B(k, t) = x[t, k], both read across t. */
static ds4_gemm bwd_w(float *dW, const float *dy, int64_t ldy, const float *x, int64_t ldx, int64_t T, int64_t K, int64_t O) {
    return (ds4_gemm){.y = dW, .ldy = K, .a = dy, .a_rs = 1, .a_ks = ldy, .b = x, .b_rs = 1, .b_ks = ldx,
                      .M = O, .N = K, .R = T, .acc = 1, .seq = 1};
}

/* dst = src rounded to bf16 (the rounding to_bf16 applies) over rows t < T of G groups of n values each, element
 * (t, k, i) at t·ld + k·gs + i in both: the matmul's keep16 (x's layout) and y16 (y's) copies. */
static void keep_bf16(uint16_t *dst, const float *src, int64_t T, int64_t G, int64_t n, int64_t ld, int64_t gs) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < G; k++)
            for (int64_t i = 0; i < n; i++) dst[t * ld + k * gs + i] = ds4_f32_to_bf16(src[t * ld + k * gs + i]);
}

void ds4_cpu_matmul(ds4_dev *d, const ds4_a_matmul *a) {
    check_f32(d, "matmul", a->wdt);
    if (d->st) return;
    const int64_t G = a->groups > 1 ? a->groups : 1;
    if (G > MAX_GROUPS) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "matmul: %lld groups (at most %d)", (long long)G, MAX_GROUPS);
        return;
    }
    float *own;
    const float *x = bf16_copy(d, "matmul", a->bf16_in, a->x, a->T > 0 ? (a->T - 1) * a->ldx + (G - 1) * a->gx + a->K : 0,
                               &own);
    if (d->st) return;
    ds4_gemm g[MAX_GROUPS];
    for (int64_t k = 0; k < G; k++)
        g[k] = fwd(a->y + k * a->gy, a->ldy, x + k * a->gx, a->ldx, (const float *)a->W + k * a->gw, a->T, a->K, a->O);
    run(ds4_cpu_of(d), g, G);
    free(own);
    if (a->keep16) keep_bf16(a->keep16, a->x, a->T, G, a->K, a->ldx, a->gx);
    /* y16_only asks nothing of this backend: it writes y anyway */
    if (a->y16) keep_bf16(a->y16, a->y, a->T, G, a->O, a->ldy, a->gy);
}

/* One product per row group of off that has rows (the routed experts that got tokens), in expert order, run as one
 * job. make(a, in, e, r0, rows) is group e's product over rows [r0, r0 + rows); in holds the operation's activation
 * operands (as rounded for bf16_in). */
typedef ds4_gemm (*group_fn)(const void *a, const float *const in[2], int64_t e, int64_t r0, int64_t rows);

static void run_groups(ds4_dev *d, const char *op, const int64_t *off, int64_t E, group_fn make, const void *a,
                       const float *const in[2]) {
    if (d->st) return;
    if (E > MAX_GROUPS) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld row groups (at most %d)", op, (long long)E, MAX_GROUPS);
        return;
    }
    ds4_gemm g[MAX_GROUPS];
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], rows = off[e + 1] - r0;
        if (rows > 0) g[n++] = make(a, in, e, r0, rows);
    }
    run(ds4_cpu_of(d), g, n);
}

static ds4_gemm fwd_group(const void *p, const float *const in[2], int64_t e, int64_t r0, int64_t rows) {
    const ds4_a_matmul_grouped *a = p;
    const float *W = a->wdt == DS4_F32 ? (const float *)a->W + e * a->wstride : NULL;
    return packed_b(fwd(a->y + r0 * a->O, a->O, in[0] + r0 * a->K, a->K, W, rows, a->K, a->O), a->wdt, a->W, a->Ws, e,
                    a->wstride);
}

void ds4_cpu_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a) {
    check_wdt(d, "matmul_grouped", a->wdt, 1);
    if (d->st) return;
    float *own;
    const float *x = bf16_copy(d, "matmul_grouped", a->bf16_in, a->x, a->off[a->E] * a->K, &own);
    run_groups(d, "matmul_grouped", a->off, a->E, fwd_group, a, (const float *const[2]){x, NULL});
    free(own);
}

/* ------------------------------------------------------------------------------------------------ backward */

void ds4_cpu_linear_bwd_x(ds4_dev *d, const ds4_a_linear_bwd_x *a) {
    check_f32(d, "linear_bwd_x", a->wdt);
    if (d->st || a->T <= 0) return;
    float *own;
    const float *dy = bf16_copy(d, "linear_bwd_x", a->bf16_in, a->dy, (a->T - 1) * a->ldy + a->O, &own);
    if (d->st) return;
    const ds4_gemm g = bwd_x(a->dx, a->lddx, a->acc, dy, a->ldy, a->W, a->T, a->K, a->O);
    run(ds4_cpu_of(d), &g, 1);
    free(own);
}

/* wdt BF16 asks for the rounded operands as bf16_in does (ops.h) */
void ds4_cpu_linear_bwd_w(ds4_dev *d, const ds4_a_linear_bwd_w *a) {
    if (a->T <= 0) return; /* no rows: dW stays as it is (a sum of nothing added would turn -0 into +0) */
    const int on = a->bf16_in || a->wdt == DS4_BF16;
    float *own_dy, *own_x = NULL;
    const float *dy = bf16_copy(d, "linear_bwd_w", on, a->dy, (a->T - 1) * a->ldy + a->O, &own_dy);
    const int64_t xspan = (a->T - 1) * a->ldx + a->K;
    const float *x = d->st                   ? NULL
                     : a->x16 && a->bf16_in ? bf16_expand(d, "linear_bwd_w", a->x16, xspan, &own_x)
                                            : bf16_copy(d, "linear_bwd_w", on, a->x, xspan, &own_x);
    if (!d->st) {
        const ds4_gemm g = bwd_w(a->dW, dy, a->ldy, x, a->ldx, a->T, a->K, a->O);
        run(ds4_cpu_of(d), &g, 1);
    }
    free(own_dy);
    free(own_x);
}

static ds4_gemm bwd_x_group(const void *p, const float *const in[2], int64_t e, int64_t r0, int64_t rows) {
    const ds4_a_linear_bwd_x_grouped *a = p;
    const float *W = a->wdt == DS4_F32 ? (const float *)a->W + e * a->wstride : NULL;
    return packed_b(bwd_x(a->dx + r0 * a->K, a->K, a->acc, in[0] + r0 * a->O, a->O, W, rows, a->K, a->O), a->wdt, a->W,
                    a->Ws, e, a->wstride);
}

void ds4_cpu_linear_bwd_x_grouped(ds4_dev *d, const ds4_a_linear_bwd_x_grouped *a) {
    check_wdt(d, "linear_bwd_x_grouped", a->wdt, 1);
    if (d->st) return;
    float *own;
    const float *dy = bf16_copy(d, "linear_bwd_x_grouped", a->bf16_in, a->dy, a->off[a->E] * a->O, &own);
    run_groups(d, "linear_bwd_x_grouped", a->off, a->E, bwd_x_group, a, (const float *const[2]){dy, NULL});
    free(own);
}

static ds4_gemm bwd_w_group(const void *p, const float *const in[2], int64_t e, int64_t r0, int64_t rows) {
    const ds4_a_linear_bwd_w_grouped *a = p;
    return bwd_w(a->dW + e * a->wstride, in[0] + r0 * a->O, a->O, in[1] + r0 * a->K, a->K, rows, a->K, a->O);
}

/* wdt BF16 asks for the rounded operands as bf16_in does (ops.h) */
void ds4_cpu_linear_bwd_w_grouped(ds4_dev *d, const ds4_a_linear_bwd_w_grouped *a) {
    const int on = a->bf16_in || a->wdt == DS4_BF16;
    float *own_dy, *own_x = NULL;
    const float *dy = bf16_copy(d, "linear_bwd_w_grouped", on, a->dy, a->off[a->E] * a->O, &own_dy);
    const float *x = d->st ? NULL : bf16_copy(d, "linear_bwd_w_grouped", on, a->x, a->off[a->E] * a->K, &own_x);
    run_groups(d, "linear_bwd_w_grouped", a->off, a->E, bwd_w_group, a, (const float *const[2]){dy, x});
    free(own_dy);
    free(own_x);
}
