/* test_cuda_fp4.c — the CUDA expert products over FP4-resident weights (matmul_grouped and linear_bwd_x_grouped with
 * wdt DS4_FP4_PACKED, cuda/cuda_fp4.cuh; docs/checkpoints.md, "FP4-resident experts").
 *
 * Exit 77 (skipped) without a CUDA build or device. The reference for the decoding is core/fp4.h (the CPU's, the
 * definition of the format): the packed weights are decoded on the host to fp32 (exact) and to bf16 bits (exact too:
 * every FP4 value is a bf16 number), and the same CUDA operation runs on those with wdt F32 / BF16. The FP4 kernels
 * are those kernels with the decode in their loaders, so the results must be equal bit for bit, in both modes (bf16:
 * bf16_in set, the tensor cores; fp32: the FMA kernels) and through every kernel variant, which the shapes pick:
 *   bf16 forward: skinny (<= 16 rows per expert; K of one and of two 256-slices), 64 x 128 tiles (> 256 rows, few
 *   tiles), 128 x 128 tiles (a full wave: where bf16 weights take the cp.async pipeline, whose bits are the tiles');
 *   fp32 forward: skinny, narrow (<= 32 columns), 64 x 64 tiles; the input gradient in both modes.
 * Each product is also compared with the CPU's FP4 product (x rounded to bf16 on both sides in bf16 mode): rel.
 * Frobenius <= 1e-5, test_cuda_ops.c's bound for two fp32 summation orders. A missing scale is O(1).
 * The decode's edges: scales 0 and 1 (subnormal products down to 2^-128), 2, 126-128, 252-254, every code (-0.0 too),
 * through y = I·Wᵀ (each output one weight, exactly) in both modes; and a product past fp32's range (6 · 2^127) gives
 * +inf as the CPU's fp32 product does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"
#include "fp4.h"

/* E packed experts [O, K]: codes q (E·O·K/2 bytes), scales s (one per 32), and the host-decoded values as fp32 (wf)
 * and bf16 bits (wb), each held on both sides */
typedef struct {
    int64_t E, O, K;
    twin q, s, wf, wb;
} packed;

static packed pk_new(int64_t E, int64_t O, int64_t K) {
    const int64_t n = E * O * K;
    packed p = {E, O, K, tw_new((size_t)n / 2), tw_new((size_t)n / DS4_FP4_BLOCK), tw_new((size_t)n * 4),
                tw_new((size_t)n * 2)};
    return p;
}

/* decode (q, s) on the host (fp4.h) into wf and wb, and send all four to the device */
static void pk_push(packed *p) {
    const int64_t n = p->E * p->O * p->K;
    float *wf = p->wf.h;
    ds4_fp4_decode(wf, p->q.h, p->s.h, 0, n);
    for (int64_t i = 0; i < n; i++) ((uint16_t *)p->wb.h)[i] = bf(wf[i]);
    tw_push(&p->q), tw_push(&p->s), tw_push(&p->wf), tw_push(&p->wb);
}

/* random codes under random scales around 1 (2^-6 .. 2^1): products of a magnitude the sums keep */
static packed pk_random(int64_t E, int64_t O, int64_t K) {
    packed p = pk_new(E, O, K);
    for (size_t i = 0; i < p.q.bytes; i++) ((uint8_t *)p.q.h)[i] = (uint8_t)(urand() * 256);
    for (size_t i = 0; i < p.s.bytes; i++) ((uint8_t *)p.s.h)[i] = (uint8_t)(121 + urand() * 8);
    pk_push(&p);
    return p;
}

static void pk_free(packed *p) { tw_free(&p->q), tw_free(&p->s), tw_free(&p->wf), tw_free(&p->wb); }

static int same(const twin *a, const twin *b, int64_t n) {
    void *x = fetch(a), *y = fetch(b);
    const int eq = memcmp(x, y, (size_t)n * 4) == 0;
    free(x), free(y);
    return eq;
}

/* The expert groups of counts [E], in device memory; *R their rows. */
static twin groups(const int64_t *counts, int64_t E, int64_t *R) {
    int64_t off[64] = {0};
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
    *R = off[E];
    return tw_i64(E + 1, off);
}

/* y = x·W_eᵀ per group: FP4 on the GPU == the decoded weights on the GPU, bitwise; ~ the CPU's FP4 product. shift:
 * the device codes start that many bytes into their allocation (2: not 4-byte aligned, the loaders' value-by-value
 * path) */
static void t_fwd(const char *name, ds4_dtype mode, int64_t O, int64_t K, const int64_t *counts, int64_t E,
                  int shift) {
    packed p = pk_random(E, O, K);
    twin qs = tw_new(p.q.bytes + (size_t)shift);
    memcpy((char *)qs.h + shift, p.q.h, p.q.bytes);
    tw_push(&qs);
    int64_t R;
    twin of = groups(counts, E, &R);
    twin x = tw_f(R * K, -1, 1), y4 = tw_out((size_t)(R * O) * 4), yr = tw_out((size_t)(R * O) * 4);
    if (mode == DS4_BF16) { /* the CPU then multiplies what the tensor cores do */
        for (int64_t i = 0; i < R * K; i++) ((float *)x.h)[i] = ds4_bf16_to_f32(bf(((float *)x.h)[i]));
        tw_push(&x);
    }
    const int b16 = mode == DS4_BF16;
    OP(gpu, matmul_grouped, .y = y4.d, .x = x.d, .W = (char *)qs.d + shift, .wdt = DS4_FP4_PACKED, .Ws = p.s.d,
       .wstride = O * K, .off = of.d, .E = E, .rows = R, .K = K, .O = O, .bf16_in = b16);
    OP(gpu, matmul_grouped, .y = yr.d, .x = x.d, .W = b16 ? p.wb.d : p.wf.d, .wdt = mode, .wstride = O * K,
       .off = of.d, .E = E, .rows = R, .K = K, .O = O, .bf16_in = b16);
    OP(cpu, matmul_grouped, .y = y4.h, .x = x.h, .W = p.q.h, .wdt = DS4_FP4_PACKED, .Ws = p.s.h, .wstride = O * K,
       .off = of.h, .E = E, .rows = R, .K = K, .O = O);
    check_dev(gpu, name);
    check_dev(cpu, name);
    char what[160];
    snprintf(what, sizeof what, "matmul_grouped FP4 as %s, %s: %lld rows, W [%lld x %lld x %lld]%s",
             ds4_dtype_name(mode), name, (long long)R, (long long)E, (long long)O, (long long)K,
             shift ? ", codes unaligned" : "");
    CHECK(same(&y4, &yr, R * O), "%s: differs from the product over the decoded weights", what);
    cmp_f(what, &y4, R * O, 1e-5);
    twin all[] = {of, x, y4, yr, qs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    pk_free(&p);
}

/* dx (+)= dy·W_e per group, likewise */
static void t_bwd(ds4_dtype mode, int64_t O, int64_t K, int acc, const int64_t *counts, int64_t E) {
    packed p = pk_random(E, O, K);
    int64_t R;
    twin of = groups(counts, E, &R);
    twin dy = tw_f(R * O, -1, 1), dx4 = acc ? tw_f(R * K, -1, 1) : tw_out((size_t)(R * K) * 4), dxr = tw_copy(&dx4);
    if (mode == DS4_BF16) {
        for (int64_t i = 0; i < R * O; i++) ((float *)dy.h)[i] = ds4_bf16_to_f32(bf(((float *)dy.h)[i]));
        tw_push(&dy);
    }
    const int b16 = mode == DS4_BF16;
    OP(gpu, linear_bwd_x_grouped, .dx = dx4.d, .acc = acc, .dy = dy.d, .W = p.q.d, .wdt = DS4_FP4_PACKED, .Ws = p.s.d,
       .wstride = O * K, .off = of.d, .E = E, .rows = R, .K = K, .O = O, .bf16_in = b16);
    OP(gpu, linear_bwd_x_grouped, .dx = dxr.d, .acc = acc, .dy = dy.d, .W = b16 ? p.wb.d : p.wf.d, .wdt = mode,
       .wstride = O * K, .off = of.d, .E = E, .rows = R, .K = K, .O = O, .bf16_in = b16);
    OP(cpu, linear_bwd_x_grouped, .dx = dx4.h, .acc = acc, .dy = dy.h, .W = p.q.h, .wdt = DS4_FP4_PACKED, .Ws = p.s.h,
       .wstride = O * K, .off = of.h, .E = E, .rows = R, .K = K, .O = O);
    check_dev(gpu, "linear_bwd_x_grouped");
    check_dev(cpu, "linear_bwd_x_grouped");
    char what[160];
    snprintf(what, sizeof what, "linear_bwd_x_grouped FP4 as %s: %lld rows, W [%lld x %lld x %lld]%s",
             ds4_dtype_name(mode), (long long)R, (long long)E, (long long)O, (long long)K, acc ? ", added" : "");
    CHECK(same(&dx4, &dxr, R * K), "%s: differs from the product over the decoded weights", what);
    cmp_f(what, &dx4, R * K, 1e-5);
    twin all[] = {of, dy, dx4, dxr};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    pk_free(&p);
}

/* One expert W [32, 32·NS]: row c, block b under scale S[b], element j of the block code (c + j + b) % 16 (every
 * code in every block); at the two largest scales the codes keep magnitudes 0 .. 1.5 (finite products). y = I·Wᵀ
 * with I the identity [K, K]: y[k, c] = W[c, k] exactly (one product by 1, the others by 0), and the product over
 * the decoded weights bit for bit. fp32: every value, subnormals too (the kernels do not flush them); bf16: every
 * normal value (how the tensor cores treat a subnormal product is theirs; the bitwise check says the FP4 path gets
 * what the dequantised weights get). */
static void t_decode_edges(ds4_dtype mode) {
    enum { NS = 10 };
    static const uint8_t S[NS] = {0, 1, 2, 126, 127, 128, 200, 252, 253, 254};
    const int64_t O = 32, K = 32 * NS;
    packed p = pk_new(1, O, K);
    uint8_t *q = p.q.h, *s = p.s.h;
    memset(q, 0, p.q.bytes);
    for (int64_t c = 0; c < O; c++)
        for (int64_t b = 0; b < NS; b++) {
            s[c * NS + b] = S[b];
            for (int64_t j = 0; j < 32; j++) {
                uint8_t code = (uint8_t)((c + j + b) % 16);
                if (S[b] >= 253) code &= 0xB; /* sign and magnitude 0 .. 3 (values up to 1.5) */
                const int64_t i = c * K + b * 32 + j;
                q[i >> 1] |= (uint8_t)(code << (4 * (i & 1)));
            }
        }
    pk_push(&p);
    const int64_t cnt = K;
    int64_t R;
    twin of = groups(&cnt, 1, &R), x = tw_new((size_t)(K * K) * 4), y = tw_out((size_t)(K * O) * 4);
    memset(x.h, 0, x.bytes);
    for (int64_t k = 0; k < K; k++) ((float *)x.h)[k * K + k] = 1.0f;
    tw_push(&x);
    const int b16 = mode == DS4_BF16;
    twin yr = tw_out(y.bytes);
    OP(gpu, matmul_grouped, .y = y.d, .x = x.d, .W = p.q.d, .wdt = DS4_FP4_PACKED, .Ws = p.s.d, .wstride = O * K,
       .off = of.d, .E = 1, .rows = K, .K = K, .O = O, .bf16_in = b16);
    OP(gpu, matmul_grouped, .y = yr.d, .x = x.d, .W = b16 ? p.wb.d : p.wf.d, .wdt = mode, .wstride = O * K,
       .off = of.d, .E = 1, .rows = K, .K = K, .O = O, .bf16_in = b16);
    check_dev(gpu, "decode edges");
    CHECK(same(&y, &yr, K * O), "decode edges (%s): differ from the product over the decoded weights",
          ds4_dtype_name(mode));
    const float *g = fetch(&y), *w = p.wf.h;
    int64_t bad = 0, sub = 0, checked = 0;
    for (int64_t k = 0; k < K; k++)
        for (int64_t c = 0; c < O; c++) {
            const float want = w[c * K + k], got = g[k * O + c];
            const int subnormal = want != 0 && fabsf(want) < 1.17549435e-38f;
            sub += subnormal;
            if (subnormal && b16) continue;
            checked++;
            bad += !(got == want); /* ±0 alike: a sum of zeros may turn -0 into +0 */
        }
    CHECK(bad == 0 && sub > 0, "decode edges (%s): %lld of %lld weights read back wrong (%lld subnormal)",
          ds4_dtype_name(mode), (long long)bad, (long long)checked, (long long)sub);
    free((void *)g);
    tw_free(&of), tw_free(&x), tw_free(&y), tw_free(&yr);
    pk_free(&p);
}

/* Code 7 (6.0) under scale 254: 6 · 2^127 is past fp32's range, so the CPU's product (core/fp4.h) is +inf; row 0 of
 * W holds it at k = 5, every other value 0, and y = e_5·Wᵀ must give +inf at column 0 in both modes. */
static void t_decode_overflow(ds4_dtype mode) {
    const int64_t O = 8, K = 32;
    packed p = pk_new(1, O, K);
    memset(p.q.h, 0, p.q.bytes);
    memset(p.s.h, 127, p.s.bytes);
    ((uint8_t *)p.s.h)[0] = 254;
    ((uint8_t *)p.q.h)[2] = 0x70; /* element 5: the high nibble of byte 2 */
    pk_push(&p);
    CHECK(isinf(((float *)p.wf.h)[5]) && ((float *)p.wf.h)[5] > 0, "core/fp4.h: 6 * 2^127 is not +inf");
    const int64_t cnt = 1;
    int64_t R;
    twin of = groups(&cnt, 1, &R), x = tw_new((size_t)K * 4), y = tw_out((size_t)O * 4);
    memset(x.h, 0, x.bytes);
    ((float *)x.h)[5] = 1.0f;
    tw_push(&x);
    OP(gpu, matmul_grouped, .y = y.d, .x = x.d, .W = p.q.d, .wdt = DS4_FP4_PACKED, .Ws = p.s.d, .wstride = O * K,
       .off = of.d, .E = 1, .rows = 1, .K = K, .O = O, .bf16_in = mode == DS4_BF16);
    check_dev(gpu, "decode overflow");
    const float *g = fetch(&y);
    CHECK(isinf(g[0]) && g[0] > 0 && g[1] == 0, "decode overflow (%s): 6 * 2^127 read as %g (want +inf)",
          ds4_dtype_name(mode), g[0]);
    free((void *)g);
    tw_free(&of), tw_free(&x), tw_free(&y);
    pk_free(&p);
}

/* A weight whose rows are not whole 32-value blocks is refused, naming the operation (the loader never makes one). */
static void t_refusal(void) {
    const int64_t cnt = 4;
    int64_t R;
    twin of = groups(&cnt, 1, &R), q = tw_new(64), s = tw_new(4), x = tw_f(4 * 40, -1, 1), y = tw_out(4 * 3 * 4);
    OP(gpu, matmul_grouped, .y = y.d, .x = x.d, .W = q.d, .wdt = DS4_FP4_PACKED, .Ws = s.d, .wstride = 120,
       .off = of.d, .E = 1, .rows = 4, .K = 40, .O = 3, .bf16_in = 1);
    ds4_error err = {0};
    CHECK(ds4_dev_check(gpu, "refusal", &err) == DS4_ERR_ARG && strstr(err.msg, "matmul_grouped") &&
          strstr(err.msg, "whole blocks"), "K = 40 with FP4-resident W: %s", err.msg);
    tw_free(&of), tw_free(&q), tw_free(&s), tw_free(&x), tw_free(&y);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    ds4_engine *eng = NULL;
    const int open = twins_open("test_cuda_fp4", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_fp4");
    static const int64_t few[6] = {3, 0, 17, 1, 0, 9};       /* 30 rows: skinny in every mode */
    static const int64_t many[2] = {300, 290};               /* > 256 rows per expert: the tiles */
    static const int64_t wave[4] = {300, 280, 260, 270};     /* with O = 2048: a full wave of 128 x 128 tiles */
    static const int64_t train[7] = {3, 0, 17, 1, 0, 70, 300}; /* the backward: short, empty and long groups */
    const ds4_dtype modes[2] = {DS4_BF16, DS4_F32};
    for (int i = 0; i < 2; i++) {
        const ds4_dtype m = modes[i];
        t_decode_edges(m);
        t_decode_overflow(m);
        t_fwd("skinny", m, 40, 96, few, 6, 0);
        t_fwd("skinny, two K slices", m, 40, 320, few, 6, 0);
        t_fwd("skinny", m, 40, 96, few, 6, 2);
        t_fwd("tiles", m, 96, 64, many, 2, 0);
        t_fwd("tiles", m, 96, 64, many, 2, 2);
        t_fwd("narrow", m, 24, 64, many, 2, 0); /* fp32: the <= 32-column kernel */
        t_bwd(m, 40, 96, 0, train, 7);
        t_bwd(m, 129, 64, 1, train, 7); /* O odd (the reduction), dx added */
    }
    t_fwd("full wave", DS4_BF16, 2048, 64, wave, 4, 0);
    t_refusal();
    twins_close(eng);
    return ds4t_finish("test_cuda_fp4");
}
#else
int main(void) {
    printf("test_cuda_fp4: skipped (built without CUDA)\n");
    return 77;
}
#endif
