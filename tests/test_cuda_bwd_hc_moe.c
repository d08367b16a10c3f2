/* test_cuda_bwd_hc_moe.c — the CUDA backward operations of the residual streams and the MoE (hc_pre_bwd,
 * hc_post_bwd, hyperhead_bwd, swiglu_bwd, moe_dws, moe_dy, moe_sum_slots, router_bwd) against the CPU backend's,
 * the definition, through the argument structs the schedule uses (core/ops.h, core/backward.c).
 *
 * Exit 77 (skipped) without a CUDA build or device. As in test_cuda_ops.c (cuda_twin.h): every output poisoned with
 * NaN (bytes 0xff) on both sides, in/out buffers (dX of hc_pre_bwd, dh of moe_sum_slots, dact when dg3 aliases it)
 * starting from the same random values. The GPU runs each case twice from the same start and must give the same
 * bits (no atomics, fixed reduction orders). The mHC cases run a third time on a second CUDA backend made with
 * DS4_CUDA_HC_REF=1, whose block-per-token kernels define the bits that the token-per-warp ones must give: equal
 * bytes (the training losses must not move by a bit when the kernels change). Then the CPU runs, and the GPU's
 * results are compared with it:
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
#define _POSIX_C_SOURCE 200809L /* setenv: the reference backend */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include <stdarg.h>

#include "cuda_twin.h"
#include "shape_limits.h"

static twin tw_outf(int64_t n) { return tw_out((size_t)n * 4); } /* n floats, poisoned */

/* The outputs of one case, for running the GPU twice: their start bytes (poison, or an in/out buffer's start values)
 * are kept; after the first GPU run its results are kept and the start restored; the second must give the same
 * bits. Then the CPU runs; the comparisons read the device's results. */
enum { MAXO = 6 };
static ds4_dev *gpu_ref; /* DS4_CUDA_HC_REF=1: the mHC backward's reference kernels */

typedef struct runs {
    twin *t[MAXO];
    void *init[MAXO], *first[MAXO];
    int n;
    int ref;      /* a third GPU run, on gpu_ref, must give the first's bits */
    ds4_dev *dev; /* the device of the next GPU run */
} runs;

static runs runs_of(int n, ...) {
    runs o = {.n = n, .dev = gpu};
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        o.t[i] = va_arg(ap, twin *);
        o.init[i] = malloc(o.t[i]->bytes);
        memcpy(o.init[i], o.t[i]->h, o.t[i]->bytes);
    }
    va_end(ap);
    return o;
}

/* after run `rep` (0, 1: the GPU; 2 where o->ref: the GPU's reference kernels; then the CPU); returns the side of the
 * next, o->dev its device */
static int run_done(runs *o, int rep, const char *what) {
    const int gpu_runs = 2 + o->ref;
    if (rep >= gpu_runs) return 0;
    check_dev(o->dev, what);
    for (int i = 0; i < o->n; i++) {
        twin *t = o->t[i];
        void *g = fetch(t);
        if (rep == 0) {
            o->first[i] = g;
        } else {
            CHECK(memcmp(g, o->first[i], t->bytes) == 0, "%s: output %d differs between two GPU runs%s", what, i,
                  rep == 2 ? " (the reference kernels, DS4_CUDA_HC_REF=1)" : "");
            free(g);
        }
        if (rep + 1 < gpu_runs) {
            ds4_error err;
            CHECK_OK(gpu->ops->upload(gpu, t->d, o->init[i], t->bytes, &err), &err);
        } else {
            free(o->first[i]), free(o->init[i]);
        }
    }
    /* the backends have streams of their own: the start values are in place before the other one runs */
    check_dev(gpu, what);
    o->dev = rep + 1 == 2 ? gpu_ref : gpu;
    return rep + 1 < gpu_runs;
}
#define REPS(o, what) for (int rep = 0, side = 1; rep < 3 + (o).ref; side = run_done(&(o), rep++, (what)))

/* rel. Frobenius error of the device's result over rows [r0, r1) and columns [c0, c1) of a matrix of row stride ld */
static double err_block(const twin *t, int64_t r0, int64_t r1, int64_t ld, int64_t c0, int64_t c1) {
    const float *g = fetch(t), *h = t->h;
    float *gb = malloc((size_t)((r1 - r0) * (c1 - c0)) * 4 + 4), *hb = malloc((size_t)((r1 - r0) * (c1 - c0)) * 4 + 4);
    int64_t m = 0;
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = c0; j < c1; j++, m++) gb[m] = g[i * ld + j], hb[m] = h[i * ld + j];
    const double e = rel_frob(gb, hb, m);
    free((void *)g), free(gb), free(hb);
    return e;
}
static void cmp_cols(const char *what, const twin *t, int64_t rows, int64_t ld, int64_t c0, int64_t c1, double tol) {
    const double e = err_block(t, 0, rows, ld, c0, c1);
    CHECK(e <= tol, "%s: rel. Frobenius %g > %g", what, e, tol);
}
/* each row on its own scale */
static void cmp_rows(const char *what, const twin *t, int64_t rows, int64_t ld, double tol) {
    double e = 0;
    for (int64_t r = 0; r < rows; r++) e = fmax(e, err_block(t, r, r + 1, ld, 0, ld));
    CHECK(e <= tol, "%s: rel. Frobenius of a row %g > %g", what, e, tol);
}
/* where the CPU has exact zeros (masks, skipped terms), so must the GPU, and only there */
static void same_zeros(const char *what, const twin *t) {
    const float *g = fetch(t), *h = t->h;
    int same = 1;
    for (size_t k = 0; k < t->bytes / 4; k++) same &= (g[k] == 0) == (h[k] == 0);
    CHECK(same, "%s: zeros differ from the CPU's", what);
    free((void *)g);
}

/* The shapes of these tests: n streams of D, Sinkhorn iterations, experts. */
static ds4_config config(int64_t n, int64_t D, int64_t iters, ds4_score_func sf, int64_t E, int64_t K) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = n, c.hidden_size = D, c.hc_sinkhorn_iters = iters, c.scoring_func = sf, c.n_routed_experts = E;
    c.num_experts_per_tok = K;
    return c;
}

/* The first n fp32 outputs of a case, named names[i], against the CPU at one bound. */
static void cmp_named(const char *what, const runs *o, const char *const *names, int n, double tol) {
    char m[192];
    for (int i = 0; i < n; i++) {
        snprintf(m, sizeof m, "%s: %s", what, names[i]);
        cmp_f(m, o->t[i], (int64_t)(o->t[i]->bytes / 4), tol);
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
    h.X = tw_f(T * h.nD, -2, 2);
    h.fn = tw_f(h.mix * h.nD, -0.1f, 0.1f);
    h.base = tw_f(h.mix, -1, 1);
    h.scl = tw_f(3, 0.5f, 1.5f);
    if (exact) {
        for (int64_t i = 0; i < T * h.nD; i++) ((float *)h.X.h)[i] = urand() < 0.5 ? -0.5f : 0.5f;
        for (int64_t i = 0; i < h.mix * h.nD; i++) ((float *)h.fn.h)[i] = (float)((int)(urand() * 129) - 64) / 1024.0f;
        tw_push(&h.X), tw_push(&h.fn);
    }
    snprintf(h.what, sizeof h.what, "%s n=%lld iters=%lld T=%lld D=%lld%s", op, (long long)n, (long long)iters,
             (long long)T, (long long)D, exact ? " exact" : "");
    return h;
}
static void hc_free(hc_case *h) { tw_free(&h->X), tw_free(&h->fn), tw_free(&h->base), tw_free(&h->scl); }

/* kept: the backward is told the mixing logits the site's forward kept (hc_pre's mix), as the schedule tells it; the
 * GPU's forward computes them here, the token-per-warp kernels read them instead of recomputing them, the reference
 * kernels (DS4_CUDA_HC_REF=1) recompute them and the CPU ignores them: equal bytes prove the kept logits are the
 * recomputed ones. Returns the device's logits [T, mix] (a twin with nothing on the host), or an empty twin. */
static twin kept_mix(hc_case *h, int kept) {
    if (!kept) return (twin){0};
    const int64_t T = h->T, n = h->n;
    twin mk = tw_outf(T * h->mix), pre = tw_outf(T * n), post = tw_outf(T * n), comb = tw_outf(T * n * n);
    twin u = tw_outf(T * h->D);
    const ds4_hc_w w = {h->fn.d, h->base.d, h->scl.d};
    OP(gpu, hc_pre, .c = &h->c, .w = &w, .X = h->X.d, .pre = pre.d, .post = post.d, .comb = comb.d, .u = u.d,
       .mix = mk.d, .T = T);
    check_dev(gpu, "hc_pre: the kept logits");
    tw_free(&pre), tw_free(&post), tw_free(&comb), tw_free(&u);
    const size_t l = strlen(h->what);
    snprintf(h->what + l, sizeof h->what - l, ", kept logits");
    return mk;
}

/* ------------------------------------------------------------------------------------------------ mHC */

static void t_hc_pre_bwd(int64_t n, int64_t iters, int64_t T, int64_t D, int exact, int kept) {
    hc_case h = hc_setup("hc_pre_bwd", n, iters, T, D, exact);
    twin mk = kept_mix(&h, kept);
    const int64_t nD = h.nD, mix = h.mix;
    twin du = tw_f(T * D, -1, 1), dX = tw_f(T * nD, -1, 1), dpost = tw_f(T * n, -1, 1), dcomb = tw_f(T * n * n, -1, 1);
    twin dmix = tw_outf(T * mix), xn = tw_outf(T * nD), dzb = tw_outf(T * mix), dzs = tw_outf(T * 3);
    runs o = runs_of(5, &dX, &dmix, &xn, &dzb, &dzs);
    o.ref = 1;
    REPS(o, h.what) {
        const ds4_hc_w w = {S(h.fn), S(h.base), S(h.scl)};
        OP(side ? o.dev : cpu, hc_pre_bwd, .c = &h.c, .w = &w, .X = S(h.X), .du = S(du), .dX = S(dX), .dpost = S(dpost),
           .dcomb = S(dcomb), .dmix = S(dmix), .xn = S(xn), .dzb = S(dzb), .dzs = S(dzs),
           .mix = side ? mk.d : NULL, .T = T);
    }
    const char *names[] = {"dX", "dmix", "xn", "dzb", "dzs"};
    cmp_named(h.what, &o, names, (int)(sizeof names / sizeof names[0]), 1e-5);
    if (exact) {
        char m[192];
        snprintf(m, sizeof m, "%s: xn (exact)", h.what);
        cmp_bytes(m, &xn);
        snprintf(m, sizeof m, "%s: comb part of dzb (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dzb, T, mix, 2 * n, mix, 1e-8);
        snprintf(m, sizeof m, "%s: comb part of dmix (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dmix, T, mix, 2 * n, mix, 1e-8);
        snprintf(m, sizeof m, "%s: comb part of dzs (fp64 Sinkhorn replay)", h.what);
        cmp_cols(m, &dzs, T, 3, 2, 3, 1e-8);
    }
    twin all[] = {du, dX, dpost, dcomb, dmix, xn, dzb, dzs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    if (kept) tw_free(&mk);
    hc_free(&h);
}

static void t_hc_post_bwd(int64_t n, int64_t iters, int64_t T, int64_t D, int exact, int kept) {
    hc_case h = hc_setup("hc_post_bwd", n, iters, T, D, exact);
    twin mk = kept_mix(&h, kept);
    const int64_t nD = h.nD;
    twin A = tw_f(T * D, -1, 1), dXo = tw_f(T * nD, -1, 1);
    twin dX = tw_outf(T * nD), da = tw_outf(T * D), dpost = tw_outf(T * n), dcomb = tw_outf(T * n * n);
    runs o = runs_of(4, &dX, &da, &dpost, &dcomb);
    o.ref = 1;
    REPS(o, h.what) {
        const ds4_hc_w w = {S(h.fn), S(h.base), S(h.scl)};
        OP(side ? o.dev : cpu, hc_post_bwd, .c = &h.c, .w = &w, .dXo = S(dXo), .a = S(A), .X = S(h.X), .dX = S(dX),
           .da = S(da), .dpost = S(dpost), .dcomb = S(dcomb), .mix = side ? mk.d : NULL, .T = T);
    }
    const char *names[] = {"dX", "da", "dpost", "dcomb"};
    cmp_named(h.what, &o, names, (int)(sizeof names / sizeof names[0]), 1e-5);
    if (exact) { /* dX = sums weighted by M in the CPU's order: only M's rounding can differ */
        char m[192];
        snprintf(m, sizeof m, "%s: dX (fp64 Sinkhorn)", h.what);
        cmp_f(m, &dX, T * nD, 1e-8);
    }
    twin all[] = {A, dXo, dX, da, dpost, dcomb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    if (kept) tw_free(&mk);
    hc_free(&h);
}

static void t_hyperhead_bwd(int64_t n, int64_t T, int64_t D) {
    const ds4_config c = config(n, D, 20, DS4_SCORE_SQRTSOFTPLUS, 8, 2);
    const int64_t nD = n * D;
    twin X = tw_f(T * nD, -2, 2), fn = tw_f(n * nD, -0.1f, 0.1f), base = tw_f(n, -1, 1), scl = tw_f(3, 0.5f, 1.5f);
    twin du = tw_f(T * D, -1, 1), dX = tw_outf(T * nD), dmix = tw_outf(T * n), xn = tw_outf(T * nD), dzb = tw_outf(T * n);
    twin dzs = tw_outf(T * 3);
    char what[96];
    snprintf(what, sizeof what, "hyperhead_bwd n=%lld T=%lld D=%lld", (long long)n, (long long)T, (long long)D);
    runs o = runs_of(5, &dX, &dmix, &xn, &dzb, &dzs);
    o.ref = 1;
    REPS(o, what)
    OP(side ? o.dev : cpu, hyperhead_bwd, .c = &c, .X = S(X), .fn = S(fn), .base = S(base), .scale = S(scl), .du = S(du),
       .dX = S(dX), .dmix = S(dmix), .xn = S(xn), .dzb = S(dzb), .dzs = S(dzs), .T = T);
    const char *names[] = {"dX", "dmix", "xn", "dzb"};
    cmp_named(what, &o, names, (int)(sizeof names / sizeof names[0]), 1e-5);
    char m[160];
    snprintf(m, sizeof m, "%s: dzs column 0", what);
    cmp_cols(m, &dzs, T, 3, 0, 1, 1e-5);
    /* columns 1 and 2 are not the HyperHead's: untouched on both sides */
    int kept = 1;
    float *gz = fetch(&dzs);
    for (int64_t t = 0; t < T; t++) kept &= memcmp(gz + t * 3 + 1, (float *)dzs.h + t * 3 + 1, 8) == 0;
    free(gz);
    CHECK(kept, "%s: dzs columns 1, 2 were written", what);
    twin all[] = {X, fn, base, scl, du, dX, dmix, xn, dzb, dzs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ MoE */

/* g1, g3 spread over ±1.5λ (both clamps hit), some exactly on the boundaries (the gradient passes there) */
static void t_swiglu_bwd(int64_t rows, int64_t I, float lim) {
    const int64_t N = rows * I;
    twin g1 = tw_f(N, -1.5f * lim, 1.5f * lim), g3 = tw_f(N, -1.5f * lim, 1.5f * lim);
    for (int64_t i = 0; i < N; i += 7) ((float *)g1.h)[i] = lim;
    for (int64_t i = 3; i < N; i += 11) ((float *)g3.h)[i] = i % 2 ? lim : -lim;
    tw_push(&g1), tw_push(&g3);
    twin dact = tw_f(N, -1, 1), act = tw_outf(N), dg1 = tw_outf(N), dg1b = tw_outf(N), dg3b = tw_outf(N);
    char what[96];
    snprintf(what, sizeof what, "swiglu_bwd [%lld x %lld] lim %g", (long long)rows, (long long)I, (double)lim);
    runs o = runs_of(5, &dact, &act, &dg1, &dg1b, &dg3b);
    REPS(o, what) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .act = S(act), .rows = rows, .I = I, .lim = lim);
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .dact = S(dact), .dg1 = S(dg1b), .dg3 = S(dg3b), .rows = rows,
           .I = I, .lim = lim, .grads = 1);
        /* as the schedule calls it: dg3 over dact */
        OP(d, swiglu_bwd, .g1 = S(g1), .g3 = S(g3), .dact = S(dact), .dg1 = S(dg1), .dg3 = S(dact), .rows = rows,
           .I = I, .lim = lim, .grads = 1);
    }
    char m[160];
    const char *names[] = {"dg3 (over dact)", "act", "dg1", "dg1 (dg3 apart)", "dg3 (apart)"};
    for (int i = 0; i < 5; i++) {
        snprintf(m, sizeof m, "%s: %s", what, names[i]);
        cmp_f(m, o.t[i], N, 1e-6);
        same_zeros(m, o.t[i]); /* the clamps' masks */
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
    twin ei = tw_i32(T * K, eidx), perm = tw_outf(T * K), off = tw_out((size_t)(E + 1) * 8);
    OP(cpu, moe_sort, .eidx = ei.h, .n = T * K, .E = E, .perm = perm.h, .off = off.h);
    tw_push(&perm);
    twin ew = tw_f(T * K, 0, 1), da = tw_f(T * D, -1, 1), ye = tw_f(T * K * D, -1, 1), dxs = tw_f(T * K * D, -1, 1);
    twin dws = tw_outf(T * K), dys = tw_outf(T * K * D), dh = tw_f(T * D, -1, 1);
    char what[96];
    snprintf(what, sizeof what, "moe slots T=%lld K=%lld E=%lld D=%lld", (long long)T, (long long)K, (long long)E,
             (long long)D);
    runs o = runs_of(3, &dws, &dys, &dh);
    REPS(o, what) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, moe_dws, .dws = S(dws), .da = S(da), .ye = S(ye), .T = T, .K = K, .D = D);
        OP(d, moe_dy, .dys = S(dys), .da = S(da), .ew = S(ew), .perm = S(perm), .rows = T * K, .K = K, .D = D);
        OP(d, moe_sum_slots, .dh = S(dh), .dxslot = S(dxs), .T = T, .K = K, .D = D);
    }
    char m[160];
    snprintf(m, sizeof m, "%s: moe_dws", what);
    cmp_f(m, &dws, T * K, 1e-5);
    snprintf(m, sizeof m, "%s: moe_dy", what);
    cmp_bytes(m, &dys);
    snprintf(m, sizeof m, "%s: moe_sum_slots", what);
    cmp_bytes(m, &dh);
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
    twin lg = tw_f(T * E, -4, 4), bias = tw_f(E, -0.1f, 0.1f);
    const float extreme[5] = {25.0f, 20.0f, -250.0f, -120.0f, -200.0f};
    int32_t *rp = malloc((size_t)(T * K) * 4);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) rp[t * K + k] = t < 7 ? (int32_t)((t + 3 * k) % E) : -1;
    for (int64_t t = 0; t < 5; t++) ((float *)lg.h)[t * E + t] = extreme[t];
    for (int64_t k = 0; k < K; k++) {
        ((float *)lg.h)[5 * E + rp[5 * K + k]] = -250.0f - 7.0f * (float)k;
        ((float *)lg.h)[6 * E + rp[6 * K + k]] = -200.0f - (float)k;
    }
    tw_push(&lg);
    twin sc = tw_copy(&lg), eidx = tw_outf(T * K), ew = tw_outf(T * K), rpl = tw_i32(T * K, rp);
    const ds4_layer_w l = {.gate_bias = bias.h};
    OP(cpu, route, .c = &c, .l = &l, .s = sc.h, .eidx = eidx.h, .ew = ew.h, .replay = rpl.h, .replay_ld = K, .T = T);
    check_dev(cpu, "route");
    tw_push(&sc), tw_push(&eidx);
    twin dws = tw_f(T * K, -1, 1), dsc = tw_outf(T * E), dlog = tw_outf(T * E);
    for (int64_t t = 0; t < T; t += 4) ((float *)dws.h)[t * K] = 0; /* some zero upstream gradients */
    tw_push(&dws);
    char what[96];
    snprintf(what, sizeof what, "router_bwd score %d K=%lld", (int)sf, (long long)K);
    runs o = runs_of(2, &dsc, &dlog);
    REPS(o, what)
    OP(side ? gpu : cpu, router_bwd, .c = &c, .eidx = S(eidx), .rsc = S(sc), .rlog = S(lg), .dws = S(dws), .dsc = S(dsc),
       .dlog = S(dlog), .T = T);
    char m[160];
    snprintf(m, sizeof m, "%s: dsc", what);
    cmp_bytes(m, &dsc);
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
    ds4_engine *eng = NULL;
    unsetenv("DS4_CUDA_HC_REF"); /* gpu: the kernels the schedule takes */
    const int open = twins_open("test_cuda_bwd_hc_moe", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_bwd_hc_moe");
    ds4_error err = {0};
    setenv("DS4_CUDA_HC_REF", "1", 1); /* read when a backend is made */
    CHECK_OK(ds4_cuda_dev_create(0, &gpu_ref, &err), &err);
    unsetenv("DS4_CUDA_HC_REF");
    if (!gpu_ref) {
        twins_close(eng);
        return ds4t_finish("test_cuda_bwd_hc_moe");
    }
    /* CPU scratch (training: the Sinkhorn tapes) for the widest case below: 32 streams of 80, 100 iterations */
    ds4_config big = config(DS4_MAX_HC, 80, 100, DS4_SCORE_SQRTSOFTPLUS, 16, 8);
    big.vocab_size = 64, big.num_attention_heads = 2, big.head_dim = 16, big.q_lora_rank = 16, big.o_groups = 1;
    big.o_lora_rank = 8, big.moe_intermediate_size = 32, big.sliding_window = 8, big.compress_rate_hca = 8;
    big.index_n_heads = 2, big.index_head_dim = 16, big.index_topk = 4;
    CHECK_OK(cpu->ops->reserve(cpu, &big, 64, 64, 1, &err), &err);

    for (int64_t n = 2; n <= 4; n++) {
        t_hc_pre_bwd(n, 20, 13, 37, 0, 0);
        t_hc_pre_bwd(n, 20, 29, 77, 1, 0);
        t_hc_post_bwd(n, 20, 13, 37, 0, 0);
        t_hc_post_bwd(n, 20, 29, 77, 1, 0);
        t_hyperhead_bwd(n, 13, 37);
    }
    /* many tokens: the mixing GEMM's narrow kernel (hc_post_bwd: over X with the norm factors, no xn written) */
    t_hc_pre_bwd(4, 20, 300, 36, 0, 0);
    t_hc_post_bwd(4, 20, 300, 36, 0, 0);
    t_hc_post_bwd(4, 20, 263, 36, 1, 0);
    t_hc_pre_bwd(4, 1, 7, 33, 0, 0);   /* one iteration: softmax, one column normalisation */
    t_hc_post_bwd(4, 1, 11, 33, 1, 0);
    t_hc_pre_bwd(3, 100, 17, 19, 1, 0); /* the most iterations a config allows */
    t_hc_pre_bwd(8, 40, 9, 21, 0, 0);  /* tape too large for shared memory: in scratch */
    t_hc_pre_bwd(8, 40, 9, 21, 1, 0);
    /* 32 streams, 100 iterations: 1.6 MB of tape per token, 40 tokens per launch, so two launches */
    t_hc_pre_bwd(DS4_MAX_HC, 100, 41, 5, 1, 0);
    t_hc_post_bwd(DS4_MAX_HC, 100, 6, 5, 0, 0);
    t_hyperhead_bwd(DS4_MAX_HC, 3, 5);
    t_hc_pre_bwd(4, 20, 1, 300, 0, 0); /* one token, wider than a block */
    t_hc_post_bwd(4, 20, 1, 300, 0, 0);
    /* the token-per-warp kernels (n <= 8) at the training shapes' alignment (D a multiple of 32, n·D of 256: every
     * lane and virtual thread has the same count) and at other n, with a last block of fewer tokens than warps */
    t_hc_pre_bwd(4, 20, 9, 256, 0, 0);
    t_hc_post_bwd(4, 20, 10, 256, 0, 0);
    t_hc_post_bwd(4, 20, 6, 512, 1, 0); /* n·D within the CPU scratch reserved above (32 · 80) */
    t_hc_pre_bwd(5, 20, 7, 64, 0, 0);
    t_hc_post_bwd(5, 20, 7, 45, 0, 0);
    t_hc_post_bwd(8, 20, 9, 21, 0, 0); /* the widest warp kernel */
    t_hc_post_bwd(8, 20, 5, 96, 1, 0);
    t_hc_post_bwd(9, 20, 5, 40, 0, 0); /* past it: a block per token */
    t_hc_pre_bwd(9, 20, 5, 40, 0, 0);
    t_hyperhead_bwd(4, 7, 256);
    /* n·n <= 16: two tokens a warp (a half-warp each) in both coefficient kernels; a batch ending in a warp's first
     * half (3, 259 tokens: the last warp's second half has no token); n = 4 with a tape too long for two tokens a warp
     * in 48 KB (40 iterations): a token per warp */
    t_hc_pre_bwd(4, 20, 3, 64, 1, 0);
    t_hc_post_bwd(4, 20, 3, 64, 1, 0);
    t_hc_pre_bwd(4, 20, 259, 36, 0, 0);
    t_hc_post_bwd(4, 20, 259, 36, 0, 0);
    t_hc_pre_bwd(4, 40, 13, 37, 1, 0);
    /* the logits the forward kept (the schedule's way), every kernel kind: two tokens a warp (a ragged last warp; the
     * narrow GEMM's row count), a token per warp, a block per token, the tape in scratch */
    for (int64_t n = 2; n <= 4; n++) {
        t_hc_pre_bwd(n, 20, 13, 37, 0, 1);
        t_hc_post_bwd(n, 20, 29, 77, 1, 1);
    }
    t_hc_pre_bwd(4, 20, 259, 36, 0, 1);
    t_hc_post_bwd(4, 20, 259, 36, 0, 1);
    t_hc_pre_bwd(4, 20, 3, 64, 1, 1);
    t_hc_post_bwd(4, 20, 1, 300, 0, 1);
    t_hc_pre_bwd(5, 20, 7, 64, 0, 1);
    t_hc_post_bwd(8, 20, 9, 21, 0, 1);
    t_hc_pre_bwd(9, 20, 5, 40, 0, 1);
    t_hc_post_bwd(9, 20, 5, 40, 0, 1);
    t_hc_pre_bwd(8, 40, 9, 21, 1, 1);

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

    ds4_dev_release(gpu_ref);
    twins_close(eng);
    return ds4t_finish("test_cuda_bwd_hc_moe");
}
#else
int main(void) {
    printf("test_cuda_bwd_hc_moe: skipped (built without CUDA)\n");
    return 77;
}
#endif
