/* test_cuda_bwd_hc_moe.c — the CUDA backward operations of the residual streams and the MoE (hc_pre_bwd,
 * hc_post_bwd, hyperhead_bwd, swiglu_bwd, moe_dws, moe_dy, moe_sum_slots, router_bwd) against the CPU backend's,
 * the definition, through the argument structs the schedule uses (core/ops.h, core/backward.c).
 *
 * Exit 77 (skipped) without a CUDA build or device. Every case builds its inputs once, poisons every output with NaN
 * (bytes 0xff) on both sides, gives in/out buffers (dX of hc_pre_bwd, dh of moe_sum_slots, dact when dg3 aliases it)
 * the same starting values on both sides, runs the CPU once and the GPU twice (outputs poisoned again and in/out
 * buffers restored in between): the two GPU runs must agree bitwise (no atomics, fixed reduction orders). Then the
 * first GPU run against the CPU:
 *   - 1e-5 relative Frobenius where a dot product over D or n·D is summed in another order (the GPU's lanes and
 *     butterflies, the mixing GEMM's K slices; the CPU's 8 fixed lanes): rounding differences grow like
 *     sqrt(K)·2^-24 (~1e-6 at the widest here), everything downstream of them (sigmoids, Sinkhorn, the dX sums) is
 *     well conditioned at these inputs, and a wrong index, stride or missing term (O(1) relative) cannot pass;
 *   - 1e-6 where the GPU follows the CPU's order and only the libm functions can differ (CUDA's expf is within 2 ulp,
 *     exp within 1 ulp of the CPU's): SwiGLU, the router's logit gradients;
 *   - bitwise where the arithmetic is the same sequence of IEEE operations (moe_dy, moe_sum_slots, the router's
 *     score gradients, the clamps' zero masks);
 *   - the Sinkhorn backward, much tighter: with "exact" inputs (streams ±0.5 and eps 0, so x̂ = ±1; a mixing matrix
 *     of multiples of 2^-10, so every order of summing the logits is exact) both sides replay Sinkhorn in fp64 from
 *     the same logits in the same order, and the comb part of the gradient (dzb, dmix, dzs column 2; dX of
 *     hc_post_bwd through M) can differ only where CUDA's exp, 1 ulp off glibc's, moves an fp64 value (~1e-15
 *     relative after 2·iters steps) across an fp32 rounding boundary: a chance of ~1e-15 / 2^-24 per element, so
 *     expected nowhere, and one such element of typical size among the N >= 150 compared adds 6e-8 / sqrt(N)
 *     <= 5e-9: bound 1e-8. The same replay in fp32 gives ~1.1e-7 (measured in a host emulation of the kernels), a
 *     state off by one normalisation ~1e-1. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#include "engine.h"
#include "ops.h"
#include "shape_limits.h"

static ds4_dev *cpu, *gpu;

/* One buffer of an operation on both sides. An output is poisoned again, an in/out buffer restored from init, before
 * the GPU's second run; g1 keeps the GPU's first result. */
typedef struct twin {
    void *h, *d, *init, *g1;
    size_t bytes;
    int out;
} twin;

static uint64_t rs = 0x2545f4914f6cdd1dull;
static double urand(void) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)urand(); }

static void push(twin *t) {
    ds4_error err;
    CHECK_OK(gpu->ops->upload(gpu, t->d, t->h, t->bytes, &err), &err);
}
static twin tw_bytes(size_t bytes, const void *src, int out) {
    twin t = {malloc(bytes ? bytes : 1), NULL, NULL, NULL, bytes, out};
    ds4_error err;
    CHECK_OK(gpu->ops->alloc(gpu, bytes, &t.d, &err), &err);
    if (src) memcpy(t.h, src, bytes);
    else memset(t.h, 0xff, bytes);
    push(&t);
    return t;
}
/* an input, uniform in [lo, hi) */
static twin tw_in(int64_t n, float lo, float hi) {
    twin t = tw_bytes((size_t)n * 4, NULL, 0);
    for (int64_t i = 0; i < n; i++) ((float *)t.h)[i] = frand(lo, hi);
    push(&t);
    return t;
}
/* an output of n floats (or bytes), NaN on both sides */
static twin tw_out(int64_t n) { return tw_bytes((size_t)n * 4, NULL, 1); }
/* an in/out buffer: the same random start on both sides */
static twin tw_io(int64_t n, float lo, float hi) {
    twin t = tw_in(n, lo, hi);
    t.out = 1;
    t.init = malloc(t.bytes);
    memcpy(t.init, t.h, t.bytes);
    return t;
}
static void tw_free(twin *t) {
    free(t->h), free(t->init), free(t->g1);
    gpu->ops->free(gpu, t->d);
}
#define S(t) (side ? (t).d : (t).h)

static void *fetch(const twin *t) {
    void *h = malloc(t->bytes ? t->bytes : 1);
    ds4_error err;
    CHECK_OK(gpu->ops->download(gpu, h, t->d, t->bytes, &err), &err);
    return h;
}

static void check_dev(ds4_dev *d, const char *what) {
    ds4_error err;
    CHECK_OK(ds4_dev_check(d, what, &err), &err);
    CHECK_OK(d->ops->sync(d, &err), &err);
}

/* Between the GPU's two runs: keep the first results, poison the outputs again, restore the in/out buffers. */
static void again(twin *const *t, int nt, const char *what) {
    check_dev(gpu, what);
    for (int i = 0; i < nt; i++) {
        if (!t[i]->out) continue;
        t[i]->g1 = fetch(t[i]);
        if (t[i]->init) {
            ds4_error err;
            CHECK_OK(gpu->ops->upload(gpu, t[i]->d, t[i]->init, t[i]->bytes, &err), &err);
        } else {
            gpu->ops->fill(gpu, t[i]->d, 0xff, t[i]->bytes);
        }
    }
}
/* After the second run: it must equal the first bit for bit. */
static void twice(twin *const *t, int nt, const char *what) {
    check_dev(gpu, what);
    for (int i = 0; i < nt; i++) {
        if (!t[i]->out) continue;
        void *g2 = fetch(t[i]);
        CHECK(memcmp(g2, t[i]->g1, t[i]->bytes) == 0, "%s: output %d differs between two GPU runs", what, i);
        free(g2);
    }
}
/* rep 0: the CPU; reps 1 and 2: the GPU, with `again` before the second. */
#define REPS(outs, what)                                                                                        \
    for (int rep = 0, side = 0; rep < 3; rep++, side = 1)                                                       \
        if (rep == 2 ? (again(outs, (int)(sizeof outs / sizeof outs[0]), what), 1) : 1)

/* rel. Frobenius error of the GPU's first run over rows [r0, r1) and columns [c0, c1) of a matrix of row stride ld;
 * NaN anywhere is +inf */
static double rel_frob(const twin *t, int64_t r0, int64_t r1, int64_t ld, int64_t c0, int64_t c1) {
    const float *g = t->g1, *r = t->h;
    double num = 0, den = 0;
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = c0; j < c1; j++) {
            const float a = g[i * ld + j], b = r[i * ld + j];
            if (!isfinite(a) || !isfinite(b)) return INFINITY;
            num += ((double)a - b) * ((double)a - b);
            den += (double)b * b;
        }
    return sqrt(num / (den > 0 ? den : 1));
}
static void cmp_cols(const char *what, const twin *t, int64_t rows, int64_t ld, int64_t c0, int64_t c1, double tol) {
    const double e = rel_frob(t, 0, rows, ld, c0, c1);
    CHECK(e <= tol, "%s: rel. Frobenius %g > %g", what, e, tol);
}
/* each row on its own scale */
static void cmp_rows(const char *what, const twin *t, int64_t rows, int64_t ld, double tol) {
    double e = 0;
    for (int64_t r = 0; r < rows; r++) e = fmax(e, rel_frob(t, r, r + 1, ld, 0, ld));
    CHECK(e <= tol, "%s: rel. Frobenius of a row %g > %g", what, e, tol);
}
/* where the CPU has exact zeros (masks, skipped terms), so must the GPU, and only there */
static void same_zeros(const char *what, const twin *t) {
    const float *g = t->g1, *r = t->h;
    int same = 1;
    for (size_t k = 0; k < t->bytes / 4; k++) same &= (g[k] == 0) == (r[k] == 0);
    CHECK(same, "%s: zeros differ from the CPU's", what);
}
static void cmp_f(const char *what, const twin *t, double tol) {
    cmp_cols(what, t, 1, (int64_t)(t->bytes / 4), 0, (int64_t)(t->bytes / 4), tol);
}
static void cmp_bits(const char *what, const twin *t) {
    CHECK(memcmp(t->g1, t->h, t->bytes) == 0, "%s: CUDA and CPU differ", what);
}

/* The shapes of these tests: n streams of D, Sinkhorn iterations, experts. */
static ds4_config config(int64_t n, int64_t D, int64_t iters, ds4_score_func sf, int64_t E, int64_t K) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = n, c.hidden_size = D, c.hc_sinkhorn_iters = iters, c.scoring_func = sf, c.n_routed_experts = E;
    c.num_experts_per_tok = K;
    return c;
}

/* The fp32 outputs outs[i], named names[i], against the CPU at one bound. */
static void cmp_named(const char *what, twin *const *outs, const char *const *names, int n, double tol) {
    char m[192];
    for (int i = 0; i < n; i++) {
        snprintf(m, sizeof m, "%s: %s", what, names[i]);
        cmp_f(m, outs[i], tol);
    }
}

/* An mHC case: its config, streams X [T, n, D], mixing matrix fn [(2+n)·n, n·D], base and scale. exact: X = ±0.5 and
 * fn multiples of 2^-10 in [-1/16, 1/16], with the norm's eps 0, so that x̂ = ±1 and the logits are exact sums on
 * both sides (see the top). */
typedef struct hc_case {
    ds4_config c;
    int64_t n, T, D, nD, mix;
    twin X, fn, base, scl;
    char what[128];
} hc_case;

static hc_case hc_setup(const char *op, int64_t n, int64_t iters, int64_t T, int64_t D, int exact) {
    hc_case h = {.c = config(n, D, iters, DS4_SCORE_SQRTSOFTPLUS, 8, 2), .n = n, .T = T, .D = D, .nD = n * D,
                 .mix = (2 + n) * n};
    if (exact) h.c.rms_norm_eps = 0;
    h.X = tw_in(T * h.nD, -2, 2);
    h.fn = tw_in(h.mix * h.nD, -0.1f, 0.1f);
    h.base = tw_in(h.mix, -1, 1);
    h.scl = tw_in(3, 0.5f, 1.5f);
    if (exact) {
        for (int64_t i = 0; i < T * h.nD; i++) ((float *)h.X.h)[i] = urand() < 0.5 ? -0.5f : 0.5f;
        for (int64_t i = 0; i < h.mix * h.nD; i++) ((float *)h.fn.h)[i] = (float)((int)(urand() * 129) - 64) / 1024.0f;
        push(&h.X), push(&h.fn);
    }
    snprintf(h.what, sizeof h.what, "%s n=%lld iters=%lld T=%lld D=%lld%s", op, (long long)n, (long long)iters,
             (long long)T, (long long)D, exact ? " exact" : "");
    return h;
}
static void hc_free(hc_case *h) { tw_free(&h->X), tw_free(&h->fn), tw_free(&h->base), tw_free(&h->scl); }

/* ------------------------------------------------------------------------------------------------ mHC */

static void t_hc_pre_bwd(int64_t n, int64_t iters, int64_t T, int64_t D, int exact) {
    hc_case h = hc_setup("hc_pre_bwd", n, iters, T, D, exact);
    const int64_t nD = h.nD, mix = h.mix;
    twin du = tw_in(T * D, -1, 1), dX = tw_io(T * nD, -1, 1), dpost = tw_in(T * n, -1, 1), dcomb = tw_in(T * n * n, -1, 1);
    twin dmix = tw_out(T * mix), xn = tw_out(T * nD), dzb = tw_out(T * mix), dzs = tw_out(T * 3);
    twin *outs[] = {&dX, &dmix, &xn, &dzb, &dzs};
    REPS(outs, h.what) {
        const ds4_hc_w w = {S(h.fn), S(h.base), S(h.scl)};
        OP(side ? gpu : cpu, hc_pre_bwd, .c = &h.c, .w = &w, .X = S(h.X), .du = S(du), .dX = S(dX), .dpost = S(dpost),
           .dcomb = S(dcomb), .dmix = S(dmix), .xn = S(xn), .dzb = S(dzb), .dzs = S(dzs), .T = T);
    }
    twice(outs, 5, h.what);
    const char *names[] = {"dX", "dmix", "xn", "dzb", "dzs"};
    cmp_named(h.what, outs, names, 5, 1e-5);
    if (exact) {
        char m[192];
        snprintf(m, sizeof m, "%s: xn (exact)", h.what);
        cmp_bits(m, &xn);
        snprintf(m, sizeof m, "%s: comb part of dzb (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dzb, T, mix, 2 * n, mix, 1e-8);
        snprintf(m, sizeof m, "%s: comb part of dmix (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dmix, T, mix, 2 * n, mix, 1e-8);
        snprintf(m, sizeof m, "%s: comb part of dzs (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dzs, T, 3, 2, 3, 1e-8);
    }
    twin all[] = {du, dX, dpost, dcomb, dmix, xn, dzb, dzs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    hc_free(&h);
}

static void t_hc_post_bwd(int64_t n, int64_t iters, int64_t T, int64_t D, int exact) {
    hc_case h = hc_setup("hc_post_bwd", n, iters, T, D, exact);
    const int64_t nD = h.nD;
    twin A = tw_in(T * D, -1, 1), dXo = tw_in(T * nD, -1, 1);
    twin dX = tw_out(T * nD), da = tw_out(T * D), dpost = tw_out(T * n), dcomb = tw_out(T * n * n);
    twin *outs[] = {&dX, &da, &dpost, &dcomb};
    REPS(outs, h.what) {
        const ds4_hc_w w = {S(h.fn), S(h.base), S(h.scl)};
        OP(side ? gpu : cpu, hc_post_bwd, .c = &h.c, .w = &w, .dXo = S(dXo), .a = S(A), .X = S(h.X), .dX = S(dX),
           .da = S(da), .dpost = S(dpost), .dcomb = S(dcomb), .T = T);
    }
    twice(outs, 4, h.what);
    const char *names[] = {"dX", "da", "dpost", "dcomb"};
    cmp_named(h.what, outs, names, 4, 1e-5);
    if (exact) { /* dX = sums weighted by M in the CPU's order: only M's rounding can differ */
        char m[192];
        snprintf(m, sizeof m, "%s: dX (fp64 Sinkhorn)", h.what);
        cmp_f(m, &dX, 1e-8);
    }
    twin all[] = {A, dXo, dX, da, dpost, dcomb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    hc_free(&h);
}

static void t_hyperhead_bwd(int64_t n, int64_t T, int64_t D) {
    const ds4_config c = config(n, D, 20, DS4_SCORE_SQRTSOFTPLUS, 8, 2);
    const int64_t nD = n * D;
    twin X = tw_in(T * nD, -2, 2), fn = tw_in(n * nD, -0.1f, 0.1f), base = tw_in(n, -1, 1), scl = tw_in(3, 0.5f, 1.5f);
    twin du = tw_in(T * D, -1, 1), dX = tw_out(T * nD), dmix = tw_out(T * n), xn = tw_out(T * nD), dzb = tw_out(T * n);
    twin dzs = tw_out(T * 3);
    char what[96];
    snprintf(what, sizeof what, "hyperhead_bwd n=%lld T=%lld D=%lld", (long long)n, (long long)T, (long long)D);
    twin *outs[] = {&dX, &dmix, &xn, &dzb, &dzs};
    REPS(outs, what)
    OP(side ? gpu : cpu, hyperhead_bwd, .c = &c, .X = S(X), .fn = S(fn), .base = S(base), .scale = S(scl), .du = S(du),
       .dX = S(dX), .dmix = S(dmix), .xn = S(xn), .dzb = S(dzb), .dzs = S(dzs), .T = T);
    twice(outs, 5, what);
    const char *names[] = {"dX", "dmix", "xn", "dzb"};
    cmp_named(what, outs, names, 4, 1e-5);
    char m[160];
    snprintf(m, sizeof m, "%s: dzs column 0", what);
    cmp_cols(m, &dzs, T, 3, 0, 1, 1e-5);
    /* columns 1 and 2 are not the HyperHead's: untouched on both sides */
    int kept = 1;
    for (int64_t t = 0; t < T; t++) kept &= memcmp((float *)dzs.g1 + t * 3 + 1, (float *)dzs.h + t * 3 + 1, 8) == 0;
    CHECK(kept, "%s: dzs columns 1, 2 were written", what);
    twin all[] = {X, fn, base, scl, du, dX, dmix, xn, dzb, dzs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ MoE */

/* g1, g3 spread over ±1.5λ (both clamps hit), some exactly on the boundaries (the gradient passes there) */
static void t_swiglu_bwd(int64_t rows, int64_t I, float lim) {
    const int64_t N = rows * I;
    twin g1 = tw_in(N, -1.5f * lim, 1.5f * lim), g3 = tw_in(N, -1.5f * lim, 1.5f * lim);
    for (int64_t i = 0; i < N; i += 7) ((float *)g1.h)[i] = lim;
    for (int64_t i = 3; i < N; i += 11) ((float *)g3.h)[i] = i % 2 ? lim : -lim;
    push(&g1), push(&g3);
    twin dact = tw_io(N, -1, 1), act = tw_out(N), dg1 = tw_out(N), dg1b = tw_out(N), dg3b = tw_out(N);
    char what[96];
    snprintf(what, sizeof what, "swiglu_bwd [%lld x %lld] lim %g", (long long)rows, (long long)I, (double)lim);
    twin *outs[] = {&dact, &act, &dg1, &dg1b, &dg3b};
    REPS(outs, what) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .act = S(act), .rows = rows, .I = I, .lim = lim);
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .dact = S(dact), .dg1 = S(dg1b), .dg3 = S(dg3b), .rows = rows,
           .I = I, .lim = lim, .grads = 1);
        /* as the schedule calls it: dg3 over dact */
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .dact = S(dact), .dg1 = S(dg1), .dg3 = S(dact), .rows = rows,
           .I = I, .lim = lim, .grads = 1);
    }
    twice(outs, 5, what);
    char m[160];
    const char *names[] = {"dg3 (over dact)", "act", "dg1", "dg1 (dg3 apart)", "dg3 (apart)"};
    for (int i = 0; i < 5; i++) {
        snprintf(m, sizeof m, "%s: %s", what, names[i]);
        cmp_f(m, outs[i], 1e-6);
        same_zeros(m, outs[i]); /* the clamps' masks */
    }
    twin all[] = {g1, g3, dact, act, dg1, dg1b, dg3b};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* K slots per token over E experts, some experts with no token; perm from the CPU's stable sort */
static void t_moe_slots(int64_t T, int64_t K, int64_t E, int64_t D) {
    int32_t *eidx = malloc((size_t)(T * K) * 4);
    const int64_t Ev = (E + 1) / 2; /* the even experts only (the odd ones get no token), K <= Ev distinct ones */
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) eidx[t * K + k] = (int32_t)(2 * ((t + (t % 2 ? K - 1 - k : k)) % Ev));
    twin ei = tw_bytes((size_t)(T * K) * 4, eidx, 0), perm = tw_out(T * K), off = tw_bytes((size_t)(E + 1) * 8, NULL, 0);
    OP(cpu, moe_sort, .eidx = ei.h, .n = T * K, .E = E, .perm = perm.h, .off = off.h);
    push(&perm);
    perm.out = 0;
    twin ew = tw_in(T * K, 0, 1), da = tw_in(T * D, -1, 1), ye = tw_in(T * K * D, -1, 1), dxs = tw_in(T * K * D, -1, 1);
    twin dws = tw_out(T * K), dys = tw_out(T * K * D), dh = tw_io(T * D, -1, 1);
    char what[96];
    snprintf(what, sizeof what, "moe slots T=%lld K=%lld E=%lld D=%lld", (long long)T, (long long)K, (long long)E,
             (long long)D);
    twin *outs[] = {&dws, &dys, &dh};
    REPS(outs, what) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, moe_dws, .dws = S(dws), .da = S(da), .ye = S(ye), .T = T, .K = K, .D = D);
        OP(d, moe_dy, .dys = S(dys), .da = S(da), .ew = S(ew), .perm = S(perm), .rows = T * K, .K = K, .D = D);
        OP(d, moe_sum_slots, .dh = S(dh), .dxslot = S(dxs), .T = T, .K = K, .D = D);
    }
    twice(outs, 3, what);
    char m[160];
    snprintf(m, sizeof m, "%s: moe_dws", what);
    cmp_f(m, &dws, 1e-5);
    snprintf(m, sizeof m, "%s: moe_dy", what);
    cmp_bits(m, &dys);
    snprintf(m, sizeof m, "%s: moe_sum_slots", what);
    cmp_bits(m, &dh);
    free(eidx);
    twin all[] = {ei, perm, off, ew, da, ye, dxs, dws, dys, dh};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* The router's forward on the CPU gives the scores and the selection. Tokens 0..4 replay a selection that holds an
 * extreme logit in slot 0: above softplus's threshold, on it, a score that underflows to 0 (the guard), tiny and
 * denormal scores. Tokens 5 and 6 replay K experts whose scores all underflow to 0 (logits below -208: the guard's
 * limit e^{x/2}/2 for every one) or are all denormal: the sum of the weights is then ~1e-20 and the score gradients
 * ~1e20, so these tiny derivatives give logit gradients well inside fp32 (elsewhere they round to 0 either way). */
static void t_router_bwd(ds4_score_func sf, int64_t K) {
    const int64_t T = 23, E = 11;
    const ds4_config c = config(4, 16, 20, sf, E, K);
    twin lg = tw_in(T * E, -4, 4), bias = tw_in(E, -0.1f, 0.1f);
    const float extreme[5] = {25.0f, 20.0f, -250.0f, -120.0f, -200.0f};
    int32_t *rp = malloc((size_t)(T * K) * 4);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) rp[t * K + k] = t < 7 ? (int32_t)((t + 3 * k) % E) : -1;
    for (int64_t t = 0; t < 5; t++) ((float *)lg.h)[t * E + t] = extreme[t];
    for (int64_t k = 0; k < K; k++) {
        ((float *)lg.h)[5 * E + rp[5 * K + k]] = -250.0f - 7.0f * (float)k;
        ((float *)lg.h)[6 * E + rp[6 * K + k]] = -200.0f - (float)k;
    }
    push(&lg);
    twin sc = tw_bytes(lg.bytes, lg.h, 0), eidx = tw_out(T * K), ew = tw_out(T * K), rpl = tw_bytes((size_t)(T * K) * 4, rp, 0);
    const ds4_layer_w l = {.gate_bias = bias.h};
    OP(cpu, route, .c = &c, .l = &l, .s = sc.h, .eidx = eidx.h, .ew = ew.h, .replay = rpl.h, .replay_ld = K, .T = T);
    check_dev(cpu, "route");
    push(&sc), push(&eidx);
    eidx.out = 0;
    twin dws = tw_in(T * K, -1, 1), dsc = tw_out(T * E), dlog = tw_out(T * E);
    for (int64_t t = 0; t < T; t += 4) ((float *)dws.h)[t * K] = 0; /* some zero upstream gradients */
    push(&dws);
    char what[96];
    snprintf(what, sizeof what, "router_bwd score %d K=%lld", (int)sf, (long long)K);
    twin *outs[] = {&dsc, &dlog};
    REPS(outs, what)
    OP(side ? gpu : cpu, router_bwd, .c = &c, .eidx = S(eidx), .rsc = S(sc), .rlog = S(lg), .dws = S(dws), .dsc = S(dsc),
       .dlog = S(dlog), .T = T);
    twice(outs, 2, what);
    char m[160];
    snprintf(m, sizeof m, "%s: dsc", what);
    cmp_bits(m, &dsc);
    snprintf(m, sizeof m, "%s: dlog", what);
    cmp_rows(m, &dlog, T, E, 1e-6);
    same_zeros(m, &dlog);
    free(rp);
    twin all[] = {lg, bias, sc, eidx, ew, rpl, dws, dsc, dlog};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* Shapes the GPU cannot take fail the operation with a message, not a crash. */
static void t_unsupported(void) {
    ds4_error err;
    const ds4_config wide = config(DS4_MAX_HC + 1, 8, 20, DS4_SCORE_SQRTSOFTPLUS, 8, 2);
    OP(gpu, hc_pre_bwd, .c = &wide, .T = 3);
    CHECK_STATUS(ds4_dev_check(gpu, "hc_pre_bwd", &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK(strstr(err.msg, "hc_pre_bwd") && strstr(err.msg, "hc_mult"), "names the op and the size: %s", err.msg);
    const ds4_config none = config(4, 8, 0, DS4_SCORE_SQRTSOFTPLUS, 8, 2);
    OP(gpu, hc_post_bwd, .c = &none, .T = 3);
    CHECK_STATUS(ds4_dev_check(gpu, "hc_post_bwd", &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK(strstr(err.msg, "hc_post_bwd") && strstr(err.msg, "iters"), "names the op and the size: %s", err.msg);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    int ndev = 0;
    ds4_error err = {0};
    if (ds4_cuda_device_count(&ndev, &err) || ndev == 0) {
        printf("test_cuda_bwd_hc_moe: skipped (no CUDA device)\n");
        return 77;
    }
    ds4_engine *eng = NULL;
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    CHECK_OK(ds4_cpu_dev_create(eng->pool, &cpu, &err), &err);
    CHECK_OK(ds4_cuda_dev_create(0, &gpu, &err), &err);
    if (!cpu || !gpu) return ds4t_finish("test_cuda_bwd_hc_moe");
    /* CPU scratch (training: the Sinkhorn tapes) for the widest case below: 32 streams of 80, 100 iterations */
    ds4_config big = config(DS4_MAX_HC, 80, 100, DS4_SCORE_SQRTSOFTPLUS, 16, 8);
    big.vocab_size = 64, big.num_attention_heads = 2, big.head_dim = 16, big.q_lora_rank = 16, big.o_groups = 1;
    big.o_lora_rank = 8, big.moe_intermediate_size = 32, big.sliding_window = 8, big.compress_rate_hca = 8;
    big.index_n_heads = 2, big.index_head_dim = 16, big.index_topk = 4;
    CHECK_OK(cpu->ops->reserve(cpu, &big, 64, 64, 1, &err), &err);

    for (int64_t n = 2; n <= 4; n++) {
        t_hc_pre_bwd(n, 20, 13, 37, 0);
        t_hc_pre_bwd(n, 20, 29, 77, 1);
        t_hc_post_bwd(n, 20, 13, 37, 0);
        t_hc_post_bwd(n, 20, 29, 77, 1);
        t_hyperhead_bwd(n, 13, 37);
    }
    t_hc_pre_bwd(4, 1, 7, 33, 0);   /* one iteration: softmax, one column normalisation */
    t_hc_post_bwd(4, 1, 11, 33, 1);
    t_hc_pre_bwd(3, 100, 17, 19, 1); /* the most iterations a config allows */
    t_hc_pre_bwd(8, 40, 9, 21, 0);  /* tape too large for shared memory: in scratch */
    t_hc_pre_bwd(8, 40, 9, 21, 1);
    /* 32 streams, 100 iterations: 1.6 MB of tape per token, 40 tokens per launch, so two launches */
    t_hc_pre_bwd(DS4_MAX_HC, 100, 41, 5, 1);
    t_hc_post_bwd(DS4_MAX_HC, 100, 6, 5, 0);
    t_hyperhead_bwd(DS4_MAX_HC, 3, 5);
    t_hc_pre_bwd(4, 20, 1, 300, 0); /* one token, wider than a block */
    t_hc_post_bwd(4, 20, 1, 300, 0);

    t_swiglu_bwd(37, 21, 7.0f);
    t_swiglu_bwd(5, 300, 0.5f);
    const int64_t Ks[] = {1, 2, 3, 6};
    for (int i = 0; i < 4; i++) t_moe_slots(29, Ks[i], 13, 37);
    t_moe_slots(1, 6, 15, 300);
    for (int64_t K = 1; K <= 6; K += 5) {
        t_router_bwd(DS4_SCORE_SQRTSOFTPLUS, K);
        t_router_bwd(DS4_SCORE_SIGMOID, K);
        t_router_bwd(DS4_SCORE_SOFTMAX, K);
    }
    t_router_bwd(DS4_SCORE_SQRTSOFTPLUS, 3);
    t_unsupported();

    ds4_dev_release(gpu);
    ds4_dev_release(cpu);
    ds4_engine_free(eng);
    return ds4t_finish("test_cuda_bwd_hc_moe");
}
#else
int main(void) {
    printf("test_cuda_bwd_hc_moe: skipped (built without CUDA)\n");
    return 77;
}
#endif
