/* test_cuda_bwd_linear.c — the CUDA backward operations of the linear family (logp_bwd, linear_bwd_x / _w and their
 * expert-grouped forms, norm_bwd, colsum_add, sum_streams, embed_bwd) against the CPU backend's, on random inputs with
 * odd shapes, through the argument structs the schedule uses (core/ops.h), with the flags and aliasing it uses.
 *
 * Exit 77 (skipped) without a CUDA build or device. As in test_cuda_ops.c (cuda_twin.h): every output poisoned with
 * NaN (bytes 0xff) on both sides, in/out accumulators starting from the same random values. Each CUDA operation runs
 * twice from the same start and must give the same bits (determinism: no atomics, fixed reduction orders). Bounds:
 *   - column sums, stream sums and the embedding gradient: exactly the CPU's bits (the GPU adds in the CPU's order,
 *     one fp32 add at a time);
 *   - logp_bwd and norm_bwd: rel. Frobenius <= 1e-6. Both sides form every value in double (sums of exp, sums of
 *     squares and dots) and round it to fp32 once; the double sums differ in order only (~1e-16 relative), so an
 *     fp32 result differs at most by one rounding (2^-24 ~ 6e-8) and rarely; the norm weight gradient adds the RMS
 *     factors as fp32 (as the CPU keeps them), which can flip by one rounding too. norm_bwd must moreover give
 *     exactly the bits of the order cuda_bwd_linear.cu documents, written out on the host (norm_bwd_cuda_order),
 *     whichever of its kernels the width picks;
 *   - the products (dx = dy·W, dW += dyᵀ·x): rel. Frobenius <= 1e-5, the bound of test_cuda_ops.c: fp32 sums of R
 *     terms in another order differ like sqrt(R)·2^-24 (~2e-6 at R = 1000, the longest here). bf16: the CPU gets the
 *     same bf16-rounded operands (dy, W, and x for dW), so the products are exact on both sides and only the fp32
 *     accumulation order differs: the same bound. A wrong index, a missing term or a wrong group is O(1).
 * The bf16 products' fast paths (the expert products through the pipelined or wgmma GEMM, a dense dW reusing the bf16
 * dy its linear_bwd_x made), and the fp32 dx by a weight of few rows (W kept in registers), must moreover give the
 * bytes of the reference paths that DS4_CUDA_BWD_REF=1 selects (t_fast_vs_ref): the tiles define the expert products'
 * and the fp32 products' bits; the dense bf16 products round their operands the same way either way. On Hopper the
 * experts' dW runs on wgmma by default; a third backend with DS4_CUDA_DW_WGMMA=0 checks the pipelined kernel too. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"

static void *memdup(const void *p, size_t n) {
    void *q = malloc(n ? n : 1);
    memcpy(q, p, n);
    return q;
}

/* The outputs of one check, for running its CUDA operations twice: their start bytes (poison, or an accumulator's
 * start values) are kept; after the first run its results are kept and the start restored; the second run must give
 * the same bits. Then the CPU runs, and the comparisons read the second run. */
enum { MAXO = 2 };
typedef struct outs {
    twin *t[MAXO];
    int n;
    void *init[MAXO], *first[MAXO];
} outs;

/* the outputs a, b (b may be NULL), their start bytes kept */
static outs outs_of(twin *a, twin *b) {
    outs o = {.t = {a, b}, .n = b ? 2 : 1};
    for (int i = 0; i < o.n; i++) o.init[i] = memdup(o.t[i]->h, o.t[i]->bytes);
    return o;
}

/* after CUDA run `run` (0, 1) of check `what` */
static void outs_gpu_done(outs *o, int run, const char *what) {
    check_dev(gpu, what);
    for (int i = 0; i < o->n; i++) {
        twin *t = o->t[i];
        void *g = fetch(t);
        if (run == 0) {
            o->first[i] = g;
            ds4_error err;
            CHECK_OK(gpu->ops->upload(gpu, t->d, o->init[i], t->bytes, &err), &err);
            continue;
        }
        CHECK(memcmp(g, o->first[i], t->bytes) == 0, "%s: output %d differs between two CUDA runs", what, i);
        free(g);
        free(o->first[i]);
        free(o->init[i]);
    }
}

/* The runs of a check, two on the GPU (side 1) and then the CPU (side 0):
 *     for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) OP(side ? gpu : cpu, ...); */
static int next_run(outs *o, int *run, const char *what) {
    if (*run < 2) outs_gpu_done(o, *run, what);
    return ++*run < 2;
}

/* Rows of cols elements at row stride ld, where row i counts when i % period < rows (period: rows of a group, or
 * INT64_MAX for one block), against the CPU by rel. Frobenius; every other element (row gaps, rows outside: poison
 * or untouched start values) must be the CPU's bits. */
static void cmp_block(const char *what, const twin *t, int64_t rows, int64_t period, int64_t cols, int64_t ld,
                      double tol) {
    const float *g = fetch(t), *h = t->h;
    const int64_t n = (int64_t)(t->bytes / 4);
    float *gb = malloc((size_t)n * 4 + 4), *hb = malloc((size_t)n * 4 + 4);
    int64_t m = 0, outside = 0;
    for (int64_t i = 0; i < n; i++) {
        if ((i / ld) % period < rows && i % ld < cols) gb[m] = g[i], hb[m++] = h[i];
        else outside += memcmp(&g[i], &h[i], 4) != 0;
    }
    const double e = rel_frob(gb, hb, m);
    CHECK(e <= tol, "%s: rel. Frobenius %g > %g", what, e, tol);
    CHECK(outside == 0, "%s: %lld elements outside the rows changed", what, (long long)outside);
    free((void *)g), free(gb), free(hb);
}

/* The CPU's copy of x rounded to bf16 (and the device's, which the GPU would round to the same values). */
static void round_bf16(twin *x) {
    float *v = x->h;
    for (size_t i = 0; i < x->bytes / 4; i++) v[i] = ds4_bf16_to_f32(bf(v[i]));
    tw_push(x);
}

/* W for the device in wdt (bf16 bits, or W itself) after rounding the CPU's W to the same values */
static twin weight_for(twin *W, ds4_dtype wdt) {
    if (wdt != DS4_BF16) return *W;
    const int64_t n = (int64_t)(W->bytes / 4);
    twin Wd = tw_new((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) {
        ((uint16_t *)Wd.h)[i] = bf(((float *)W->h)[i]);
        ((float *)W->h)[i] = ds4_bf16_to_f32(((uint16_t *)Wd.h)[i]);
    }
    tw_push(W), tw_push(&Wd);
    return Wd;
}

/* ------------------------------------------------------------------------------------------------ logp_bwd */

static void t_logp_bwd(int per_token) {
    enum { R = 11 };
    const int64_t V = 3001;
    const int64_t tgt[R] = {5, -100, 3000, 0, 17, 1234, -100, 7, 2999, 1, 2};
    float g[R];
    for (int r = 0; r < R; r++) g[r] = frand(-2, 2);
    g[3] = 0; /* a scored row with no gradient: all zero */
    twin lg = tw_f(R * V, -8, 8), tg = tw_i64(R, tgt), dlp = tw_new(sizeof g), dl = tw_out((size_t)(R * V) * 4);
    memcpy(dlp.h, g, sizeof g);
    tw_push(&dlp);
    const char *what = per_token ? "logp_bwd (per-token dlogp)" : "logp_bwd (g0)";
    outs o = outs_of(&dl, NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        OP(side ? gpu : cpu, logp_bwd, .dl = S(dl), .logits = S(lg), .rows = R, .V = V, .tgt = S(tg),
           .dlogp = per_token ? S(dlp) : NULL, .g0 = -0.37);
    }
    cmp_f(what, &dl, R * V, 1e-6);
    twin all[] = {lg, tg, dlp, dl};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ products */

/* dx [T, K] (row stride K + pad) (+)= dy·W and dW += dyᵀ·x, with dy and x row strides O + pad and K + pad;
 * any_order: the GPU's dW may sum in its own order (cuBLAS for fp32; the CPU ignores the flag). dW starts dwoff floats
 * into its buffer, as a gradient in the flat buffer starts off a 16-byte boundary (the GPU then forms it in aligned
 * scratch and adds it); the floats before it must stay as they are. */
static void t_linear_off(int64_t T, int64_t K, int64_t O, int64_t pad, int acc, ds4_dtype wdt, int any_order,
                         int64_t dwoff) {
    const int64_t ldy = O + pad, ldx = K + pad, lddx = K + pad;
    twin dy = tw_f(T * ldy, -1, 1), x = tw_f(T * ldx, -1, 1), W = tw_f(O * K, -0.5f, 0.5f);
    twin dW = tw_f(O * K + dwoff, -0.1f, 0.1f), dx = acc ? tw_f(T * lddx, -1, 1) : tw_out((size_t)(T * lddx) * 4);
    if (wdt == DS4_BF16) round_bf16(&dy), round_bf16(&x);
    twin Wd = weight_for(&W, wdt);
    char what[128];
    snprintf(what, sizeof what, "linear_bwd %s T %lld K %lld O %lld pad %lld%s%s dW at +%lld", ds4_dtype_name(wdt),
             (long long)T, (long long)K, (long long)O, (long long)pad, acc ? " acc" : "", any_order ? " any_order" : "",
             (long long)dwoff);
    outs o = outs_of(&dx, &dW);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        ds4_dev *d = side ? gpu : cpu;
        const ds4_dtype dt = side ? wdt : DS4_F32;
        OP(d, linear_bwd_x, .dx = S(dx), .lddx = lddx, .acc = acc, .dy = S(dy), .ldy = ldy, .W = side ? Wd.d : W.h,
           .wdt = dt, .T = T, .K = K, .O = O);
        OP(d, linear_bwd_w, .dW = (float *)S(dW) + dwoff, .dy = S(dy), .ldy = ldy, .x = S(x), .ldx = ldx, .T = T,
           .K = K, .O = O, .wdt = dt, .any_order = any_order);
    }
    char w2[160];
    snprintf(w2, sizeof w2, "%s: dx", what);
    cmp_block(w2, &dx, T, INT64_MAX, K, lddx, 1e-5);
    snprintf(w2, sizeof w2, "%s: dW", what);
    cmp_f(w2, &dW, O * K + dwoff, 1e-5);
    if (Wd.d != W.d) tw_free(&Wd);
    twin all[] = {dy, x, W, dW, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

static void t_linear_mode(int64_t T, int64_t K, int64_t O, int64_t pad, int acc, ds4_dtype wdt, int any_order) {
    t_linear_off(T, K, O, pad, acc, wdt, any_order, 0);
}

/* A run of bf16 products into one dW off a 16-byte boundary (ops.h: run; the head's row chunks): the GPU sums the
 * run apart and adds it at the last, the CPU adds each product; fp32 sums of the same exact products (the operands
 * are bf16 values) in two orders, so within the fp32 bound of 1e-5. The floats before dW stay. Then a run's middle
 * product without its first: an internal error that names the op, nothing summed into a stale run. */
static void t_linear_run(int64_t chunk, int nchunks, int64_t K, int64_t O, int64_t dwoff) {
    const int64_t T = chunk * nchunks;
    twin dy = tw_f(T * O, -1, 1), x = tw_f(T * K, -1, 1), dW = tw_f(O * K + dwoff, -0.1f, 0.1f);
    round_bf16(&dy), round_bf16(&x);
    char what[128];
    snprintf(what, sizeof what, "linear_bwd_w run of %d chunks of %lld rows, K %lld O %lld, dW at +%lld", nchunks,
             (long long)chunk, (long long)K, (long long)O, (long long)dwoff);
    outs o = outs_of(&dW, NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        ds4_dev *d = side ? gpu : cpu;
        for (int c = 0; c < nchunks; c++)
            OP(d, linear_bwd_w, .dW = (float *)S(dW) + dwoff, .dy = (const float *)S(dy) + c * chunk * O, .ldy = O,
               .x = (const float *)S(x) + c * chunk * K, .ldx = K, .T = chunk, .K = K, .O = O,
               .wdt = side ? DS4_BF16 : DS4_F32,
               .run = DS4_DW_RUN | (c == 0 ? DS4_DW_FIRST : 0) | (c == nchunks - 1 ? DS4_DW_LAST : 0));
    }
    cmp_f(what, &dW, O * K + dwoff, 1e-5);
    OP(gpu, linear_bwd_w, .dW = (float *)dW.d + dwoff, .dy = dy.d, .ldy = O, .x = x.d, .ldx = K, .T = chunk, .K = K,
       .O = O, .wdt = DS4_BF16, .run = DS4_DW_RUN);
    ds4_error err;
    CHECK_STATUS(ds4_dev_check(gpu, "linear_bwd_w run", &err), DS4_ERR_INTERNAL, &err);
    CHECK(strstr(err.msg, "linear_bwd_w") && strstr(err.msg, "run"), "names the op and the run: %s", err.msg);
    tw_free(&dy), tw_free(&x), tw_free(&dW);
}

static void t_linear(int64_t T, int64_t K, int64_t O, int64_t pad, int acc, ds4_dtype wdt) {
    t_linear_mode(T, K, O, pad, acc, wdt, 0);
}

/* Routed-expert groups: expert e has counts[e] rows (some 0, one longer than a 256-row slice); rows past off[E]
 * belong to no group and must stay as they are. */
static void t_linear_grouped(int64_t K, int64_t O, int acc, ds4_dtype wdt) {
    enum { E = 7 };
    const int64_t counts[E] = {3, 0, 17, 1, 0, 70, 300};
    int64_t off[E + 1] = {0};
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
    const int64_t rows = off[E] + 5;
    twin of = tw_i64(E + 1, off), dy = tw_f(rows * O, -1, 1), x = tw_f(rows * K, -1, 1);
    twin W = tw_f(E * O * K, -0.5f, 0.5f);
    twin dW = tw_f(E * O * K, -0.1f, 0.1f), dx = acc ? tw_f(rows * K, -1, 1) : tw_out((size_t)(rows * K) * 4);
    if (wdt == DS4_BF16) round_bf16(&dy), round_bf16(&x);
    twin Wd = weight_for(&W, wdt);
    float *dW0 = memdup(dW.h, dW.bytes);
    char what[128];
    snprintf(what, sizeof what, "linear_bwd grouped %s K %lld O %lld%s", ds4_dtype_name(wdt), (long long)K,
             (long long)O, acc ? " acc" : "");
    outs o = outs_of(&dx, &dW);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        ds4_dev *d = side ? gpu : cpu;
        const ds4_dtype dt = side ? wdt : DS4_F32;
        OP(d, linear_bwd_x_grouped, .dx = S(dx), .acc = acc, .dy = S(dy), .W = side ? Wd.d : W.h, .wdt = dt,
           .wstride = O * K, .off = S(of), .E = E, .rows = rows, .K = K, .O = O);
        OP(d, linear_bwd_w_grouped, .dW = S(dW), .wstride = O * K, .dy = S(dy), .x = S(x), .off = S(of), .E = E,
           .rows = rows, .K = K, .O = O, .wdt = dt);
    }
    char w2[160];
    snprintf(w2, sizeof w2, "%s: dx", what);
    cmp_block(w2, &dx, off[E], INT64_MAX, K, K, 1e-5);
    snprintf(w2, sizeof w2, "%s: dW", what);
    cmp_f(w2, &dW, E * O * K, 1e-5);
    float *g = fetch(&dW);
    for (int e = 0; e < E; e++)
        if (!counts[e])
            CHECK(memcmp(g + e * O * K, dW0 + e * O * K, (size_t)(O * K) * 4) == 0,
                  "%s: expert %d has no rows: its dW changed", what, e);
    free(g), free(dW0);
    if (Wd.d != W.d) tw_free(&Wd);
    twin all[] = {of, dy, x, W, dW, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ norm_bwd */

/* One warp's shuffle tree (ds4d_warp_sum: v[l] += v[l ^ o] for o = 16, 8, 4, 2, 1; every lane ends with the same sum) */
static double warp_tree(double v[32]) {
    for (int o = 16; o > 0; o >>= 1) {
        double u[32];
        for (int l = 0; l < 32; l++) u[l] = v[l] + v[l ^ o];
        memcpy(v, u, sizeof u);
    }
    return v[0];
}

/* ds4d_block_sum over nt threads' partials: each warp's tree, then warp 0's over the warp sums (lanes past them 0) */
static double block_tree(const double *part, int nt) {
    double v[32], ws[8];
    for (int w = 0; w < nt / 32; w++) {
        memcpy(v, part + 32 * w, sizeof v);
        ws[w] = warp_tree(v);
    }
    for (int l = 0; l < 32; l++) v[l] = l < nt / 32 ? ws[l] : 0.0;
    return warp_tree(v);
}

/* The CUDA norm_bwd's order, on the host: a row spread over nt = row_threads(width) threads, thread t adding
 * elements t, t + nt, .. (ss = fma(x, x, ss), dot = fma(wdy, x, dot), wdy = w·dy in fp32), block_tree; dx =
 * fma(wdy, ri, −x·k) rounded to fp32 (then added); the weight gradient per column over chunks of 256 rows, 8 lanes
 * each over every 8th row (s = fma(dy·x, rinv, s)), lanes added in order, chunks added in double, groups as fp32.
 * Explicit fma() and no other product feeding a sum: the host compiler cannot contract anything. */
static void norm_bwd_cuda_order(float *dx, int acc, float *dw, const float *dy, const float *x, const float *w,
                                int64_t rows, int64_t width, int64_t groups, int64_t gstride, double eps) {
    const int nt = width >= 256 ? 256 : width >= 128 ? 128 : width >= 64 ? 64 : 32;
    double part[256];
    float *rinv = malloc((size_t)(groups * rows) * 4);
    float *dyc = malloc((size_t)(groups * gstride) * 4); /* dy as read (dx may be dy) */
    memcpy(dyc, dy, (size_t)(groups * gstride) * 4);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t o = g * gstride + r * width;
            const float *xr = x + o, *dr = dyc + o;
            for (int t = 0; t < nt; t++) {
                part[t] = 0;
                for (int64_t i = t; i < width; i += nt) part[t] = fma((double)xr[i], (double)xr[i], part[t]);
            }
            const double ri = 1.0 / sqrt(block_tree(part, nt) / (double)width + eps);
            rinv[g * rows + r] = (float)ri;
            for (int t = 0; t < nt; t++) {
                part[t] = 0;
                for (int64_t i = t; i < width; i += nt)
                    part[t] = fma((double)(w ? w[i] * dr[i] : dr[i]), (double)xr[i], part[t]);
            }
            const double k = ri * ri * ri * block_tree(part, nt) / (double)width;
            for (int64_t i = 0; i < width; i++) {
                const float gi = (float)fma((double)(w ? w[i] * dr[i] : dr[i]), ri, -((double)xr[i] * k));
                dx[o + i] = acc ? dx[o + i] + gi : gi;
            }
        }
    for (int64_t i = 0; dw && i < width; i++) {
        float acc_w = dw[i];
        for (int64_t g = 0; g < groups; g++) {
            double s = 0;
            for (int64_t rb = 0; rb < rows; rb += 256) {
                double lane[8] = {0};
                for (int64_t r = rb; r < rb + 256 && r < rows; r++) {
                    const int64_t o = g * gstride + r * width + i, l = (r - rb) % 8;
                    lane[l] = fma((double)dyc[o] * (double)x[o], (double)rinv[g * rows + r], lane[l]);
                }
                double t = lane[0];
                for (int l = 1; l < 8; l++) t += lane[l];
                s += t;
            }
            acc_w += (float)s;
        }
        dw[i] = acc_w;
    }
    free(rinv);
    free(dyc);
}

typedef enum { NB_PLAIN, NB_ALIAS, NB_ACC } nb_kind;

/* RMSNorm backward over `groups` groups of `rows` rows, group stride slots·width (rows < slots: the rows in between
 * stay as they are). NB_PLAIN: dx written into its own buffer; NB_ALIAS: dx = dy (the schedule's in-place use);
 * NB_ACC: dx added. weighted: w and dw (the weight gradient read before dx overwrites dy). */
static void t_norm_bwd(int64_t rows, int64_t width, int64_t groups, int64_t slots, nb_kind kind, int weighted) {
    const int64_t n = groups * slots * width;
    twin x = tw_f(n, -2, 2), dy = tw_f(n, -1, 1), w = tw_f(width, 0.5f, 1.5f), dw = tw_f(width, -0.1f, 0.1f);
    twin dx = kind == NB_ACC ? tw_f(n, -1, 1) : tw_out((size_t)n * 4);
    twin *out = kind == NB_ALIAS ? &dy : &dx;
    char what[128];
    snprintf(what, sizeof what, "norm_bwd [%lld groups x %lld (of %lld) x %lld]%s%s", (long long)groups,
             (long long)rows, (long long)slots, (long long)width,
             kind == NB_ALIAS ? " dx = dy" : kind == NB_ACC ? " acc" : "", weighted ? " weighted" : "");
    float *ref = memdup(out->h, out->bytes), *ref_dw = memdup(dw.h, dw.bytes);
    norm_bwd_cuda_order(ref, kind == NB_ACC, weighted ? ref_dw : NULL, kind == NB_ALIAS ? ref : dy.h, x.h,
                        weighted ? w.h : NULL, rows, width, groups, slots * width, 1e-6);
    outs o = outs_of(out, weighted ? &dw : NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        OP(side ? gpu : cpu, norm_bwd, .dx = S(*out), .acc = kind == NB_ACC, .dw = weighted ? S(dw) : NULL, .dy = S(dy),
           .x = S(x), .w = weighted ? S(w) : NULL, .rows = rows, .width = width, .eps = 1e-6, .groups = groups,
           .gstride = slots * width);
    }
    float *got = fetch(out), *got_dw = fetch(&dw);
    CHECK(memcmp(got, ref, out->bytes) == 0, "%s: dx differs from the documented CUDA order's bits", what);
    CHECK(memcmp(got_dw, ref_dw, dw.bytes) == 0, "%s: dw differs from the documented CUDA order's bits", what);
    free(got), free(got_dw), free(ref), free(ref_dw);
    char w2[160];
    snprintf(w2, sizeof w2, "%s: dx", what);
    cmp_block(w2, out, rows, slots, width, width, 1e-6);
    if (weighted) {
        snprintf(w2, sizeof w2, "%s: dw", what);
        cmp_f(w2, &dw, width, 1e-6);
    }
    twin all[] = {x, dy, w, dw, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ sums */

static void t_colsum(int64_t rows, int64_t width, int64_t ld) {
    twin src = tw_f(rows * ld, -1, 1), dst = tw_f(width, -1, 1);
    char what[96];
    snprintf(what, sizeof what, "colsum_add [%lld rows x %lld, stride %lld]", (long long)rows, (long long)width,
             (long long)ld);
    outs o = outs_of(&dst, NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        OP(side ? gpu : cpu, colsum_add, .dst = S(dst), .src = S(src), .rows = rows, .width = width, .ld = ld);
    }
    cmp_bytes(what, &dst);
    tw_free(&src), tw_free(&dst);
}

static void t_sum_streams(int64_t T, int64_t n, int64_t D) {
    twin dX = tw_f(T * n * D, -1, 1), du = tw_out((size_t)(T * D) * 4);
    outs o = outs_of(&du, NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, "sum_streams")) {
        OP(side ? gpu : cpu, sum_streams, .du = S(du), .dX = S(dX), .T = T, .n = n, .D = D);
    }
    cmp_bytes("sum_streams", &du);
    tw_free(&dX), tw_free(&du);
}

/* ge[ids[t]] += Σ_i dx[t, i]: ids drawn from V values (many repeats), or all equal (one long chain) */
static void t_embed_bwd(int64_t T, int64_t n, int64_t D, int64_t V, int all_same) {
    int64_t *ids = malloc((size_t)T * 8);
    for (int64_t t = 0; t < T; t++) ids[t] = all_same ? V - 1 : (int64_t)(urand() * (double)V) % V;
    twin id = tw_i64(T, ids), dx = tw_f(T * n * D, -1, 1), ge = tw_f(V * D, -1, 1);
    char what[96];
    snprintf(what, sizeof what, "embed_bwd [%lld tokens, %lld streams, %lld] of %lld ids%s", (long long)T, (long long)n,
             (long long)D, (long long)V, all_same ? " (all the same)" : "");
    outs o = outs_of(&ge, NULL);
    for (int run = 0, side = 1; run < 3; side = next_run(&o, &run, what)) {
        OP(side ? gpu : cpu, embed_bwd, .ge = S(ge), .ids = S(id), .dx = S(dx), .T = T, .n = n, .D = D);
    }
    cmp_bytes(what, &ge);
    free(ids);
    tw_free(&id), tw_free(&dx), tw_free(&ge);
}

/* ------------------------------------------------------------------------------------------------ fast vs reference */

/* A CUDA backend of its own; ref: DS4_CUDA_BWD_REF=1 (read when the backend is created), the backward products'
 * reference paths: the expert products through the tiles, which define their bits (cuda_bwd_linear.cu), and every
 * dense bf16 product rounding its own operands. */
/* ref 1: the reference paths (DS4_CUDA_BWD_REF=1); 2: the fast paths with the experts' dW on the pipelined kernel
 * (DS4_CUDA_DW_WGMMA=0; on a GPU without wgmma, the default path again) */
static ds4_dev *backend(int ref) {
    ds4_dev *d = NULL;
    ds4_error err;
    if (ref == 1) setenv("DS4_CUDA_BWD_REF", "1", 1);
    if (ref == 2) setenv("DS4_CUDA_DW_WGMMA", "0", 1);
    CHECK_OK(ds4_cuda_dev_create(0, &d, &err), &err);
    unsetenv("DS4_CUDA_BWD_REF");
    unsetenv("DS4_CUDA_DW_WGMMA");
    return d;
}

/* bf16 weights [n] on both sides (the device's bits; the host keeps the fp32 values, unused here) */
static twin bf16_weights(int64_t n) {
    twin w = tw_new((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) ((uint16_t *)w.h)[i] = bf(frand(-0.5f, 0.5f));
    tw_push(&w);
    return w;
}

/* bufs [n] start from their host bytes on the device (uploaded on gpu's stream, which is waited for: another
 * backend's stream runs the operations); after `what` ran on d, their device bytes land in got[] */
static void restart(twin *const *bufs, int n) {
    for (int i = 0; i < n; i++) tw_push(bufs[i]);
    check_dev(gpu, "upload");
}
static void collect(ds4_dev *d, const char *what, twin *const *bufs, int n, void **got) {
    check_dev(d, what);
    for (int i = 0; i < n; i++) got[i] = fetch(bufs[i]);
}

/* Two results the same bytes, and changed from the start (a path that did nothing fails) */
static void same_bytes(const char *what, const char *out, const void *fast, const void *ref, const twin *start) {
    CHECK(memcmp(fast, ref, start->bytes) == 0, "%s: %s: the fast path's bytes differ from the reference path's", what,
          out);
    CHECK(memcmp(ref, start->h, start->bytes) != 0, "%s: %s: unchanged", what, out);
}

/* The expert products in bf16: dx through the forward's pipelined grouped GEMM on a transposed W (or its tiled kernel
 * where the product has fewer tiles than SMs), dW through the pipelined kernel on dy and x transposed by groups,
 * against the tiles, byte for byte. Groups ragged (not multiples of 8 rows, which the transposed operands' columns
 * are aligned to), one empty, two longer than a 256-row slice; rows past the last group. Then as routed_bwd issues
 * the gate and up projections' dW: a second dW of the same x with x_kept (the fast path reuses the first's transposed
 * x), and a third told x_kept of another x (it must not). */
static void t_ref_grouped(ds4_dev *fast, ds4_dev *ref, int64_t K, int64_t O, int acc) {
    enum { E = 5, NO = 4 };
    const int64_t counts[E] = {700, 0, 901, 13, 690};
    int64_t off[E + 1] = {0};
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
    const int64_t rows = off[E] + 3;
    twin of = tw_i64(E + 1, off), dy = tw_f(rows * O, -1, 1), dy2 = tw_f(rows * O, -1, 1), x = tw_f(rows * K, -1, 1);
    twin x2 = tw_f(rows * K, -1, 1), W = bf16_weights(E * O * K);
    twin dx = acc ? tw_f(rows * K, -1, 1) : tw_out((size_t)(rows * K) * 4), dW = tw_f(E * O * K, -0.1f, 0.1f);
    twin dW2 = tw_f(E * O * K, -0.1f, 0.1f), dW3 = tw_f(E * O * K, -0.1f, 0.1f);
    char what[128];
    snprintf(what, sizeof what, "bf16 grouped fast vs reference K %lld O %lld%s", (long long)K, (long long)O,
             acc ? " acc" : "");
    twin *const bufs[NO] = {&dx, &dW, &dW2, &dW3};
    static const char *const names[NO] = {"dx", "dW", "dW of the same x (x_kept)", "dW of another x (x_kept)"};
    void *got[2][NO];
    ds4_dev *dv[2] = {fast, ref};
    for (int v = 0; v < 2; v++) {
        restart(bufs, NO);
        OP(dv[v], linear_bwd_x_grouped, .dx = dx.d, .acc = acc, .dy = dy.d, .W = W.d, .wdt = DS4_BF16,
           .wstride = O * K, .off = of.d, .E = E, .rows = rows, .K = K, .O = O, .bf16_in = 1);
        OP(dv[v], linear_bwd_w_grouped, .dW = dW.d, .wstride = O * K, .dy = dy.d, .x = x.d, .off = of.d, .E = E,
           .rows = rows, .K = K, .O = O, .wdt = DS4_BF16, .bf16_in = 1);
        OP(dv[v], linear_bwd_w_grouped, .dW = dW2.d, .wstride = O * K, .dy = dy2.d, .x = x.d, .off = of.d, .E = E,
           .rows = rows, .K = K, .O = O, .wdt = DS4_BF16, .bf16_in = 1, .x_kept = 1);
        OP(dv[v], linear_bwd_w_grouped, .dW = dW3.d, .wstride = O * K, .dy = dy.d, .x = x2.d, .off = of.d, .E = E,
           .rows = rows, .K = K, .O = O, .wdt = DS4_BF16, .bf16_in = 1, .x_kept = 1);
        collect(dv[v], what, bufs, NO, got[v]);
    }
    for (int i = 0; i < NO; i++) same_bytes(what, names[i], got[0][i], got[1][i], bufs[i]);
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < NO; i++) free(got[v][i]);
    twin all[] = {of, dy, dy2, x, x2, W, dW, dW2, dW3, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* The dense pair as the schedule issues it (backward.c, lin_bwd): linear_bwd_x, then linear_bwd_w of the same dy with
 * dy_kept, whose bf16 copy of dy the fast path reuses from the first; the reference rounds dy again. Three rounds on
 * the fast backend: the first grows its scratch between the two (the copy is gone: it must round dy again), the second
 * reuses it, the third names another dy than the linear_bwd_x's (it must not reuse it). Byte for byte. */
static void t_ref_dense(ds4_dev *fast, ds4_dev *ref, int64_t T, int64_t K, int64_t O, int64_t pad) {
    const int64_t ldy = O + pad, ldx = K + pad, lddx = K + pad;
    twin dy = tw_f(T * ldy, -1, 1), dy2 = tw_f(T * ldy, -1, 1), x = tw_f(T * ldx, -1, 1), W = bf16_weights(O * K);
    twin dW = tw_f(O * K, -0.1f, 0.1f), dx = tw_f(T * lddx, -1, 1);
    char what[128];
    twin *const bufs[2] = {&dx, &dW};
    for (int round = 0; round < 3; round++) {
        snprintf(what, sizeof what, "bf16 dense fast vs reference T %lld K %lld O %lld pad %lld, round %d",
                 (long long)T, (long long)K, (long long)O, (long long)pad, round);
        const float *dyw = round == 2 ? dy2.d : dy.d;
        void *got[2][2];
        ds4_dev *dv[2] = {fast, ref};
        for (int v = 0; v < 2; v++) {
            restart(bufs, 2);
            OP(dv[v], linear_bwd_x, .dx = dx.d, .lddx = lddx, .acc = 1, .dy = dy.d, .ldy = ldy, .W = W.d,
               .wdt = DS4_BF16, .T = T, .K = K, .O = O, .bf16_in = 1);
            OP(dv[v], linear_bwd_w, .dW = dW.d, .dy = dyw, .ldy = ldy, .x = x.d, .ldx = ldx, .T = T, .K = K, .O = O,
               .wdt = DS4_BF16, .bf16_in = 1, .dy_kept = 1);
            collect(dv[v], what, bufs, 2, got[v]);
        }
        same_bytes(what, "dx", got[0][0], got[1][0], &dx);
        same_bytes(what, "dW", got[0][1], got[1][1], &dW);
        for (int v = 0; v < 2; v++) free(got[v][0]), free(got[v][1]);
    }
    twin all[] = {dy, dy2, x, W, dW, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* The head's chunks as head_bwd issues them in the bf16 mode: logp_bwd told dl16 (the fast backend keeps the logits'
 * gradient in bf16 and leaves dl unwritten), linear_bwd_x and linear_bwd_w told dy_kept (they take that copy), dW a run
 * over the chunks, 4 bytes off a 16-byte boundary as the head's gradient lies; the reference backend writes dl and
 * rounds it again: dx and dW byte for byte (the same rounding of the same values). V % 4 == 0 takes the kernel's
 * 16-byte path, else its value-by-value one. Then the contract's edge: a dl kept that way and read by a product not
 * told dy_kept is an internal error, not a read of the unwritten dl. */
static void t_ref_head(ds4_dev *fast, ds4_dev *ref, int64_t rows, int64_t V, int64_t D, int chunks) {
    const int64_t T = rows * chunks;
    int64_t *tg = malloc((size_t)T * sizeof *tg);
    float *mx = malloc((size_t)T * sizeof *mx);
    double *se = malloc((size_t)T * sizeof *se);
    twin lg = tw_f(T * V, -6, 6), y = tw_f(T * D, -1, 1), W = bf16_weights(V * D), dlp = tw_f(T, -1, 1);
    for (int64_t r = 0; r < T; r++) {
        tg[r] = r % 7 == 3 ? -100 : (r * 7919) % V;
        const float *z = (const float *)lg.h + r * V;
        float m = z[0];
        for (int64_t v = 1; v < V; v++) m = z[v] > m ? z[v] : m;
        double e = 0;
        for (int64_t v = 0; v < V; v++) e += exp((double)z[v] - m);
        mx[r] = m, se[r] = e;
    }
    twin tgt = tw_i64(T, tg), rmx = tw_new((size_t)T * 4), rse = tw_new((size_t)T * 8);
    memcpy(rmx.h, mx, (size_t)T * 4), memcpy(rse.h, se, (size_t)T * 8);
    tw_push(&rmx), tw_push(&rse);
    twin dl = tw_out((size_t)(rows * V) * 4), dx = tw_out((size_t)(T * D) * 4), dW = tw_f(V * D + 1, -0.1f, 0.1f);
    char what[128];
    snprintf(what, sizeof what, "bf16 head chunks fast vs reference: %d x %lld rows, V %lld, D %lld", chunks,
             (long long)rows, (long long)V, (long long)D);
    twin *const bufs[3] = {&dl, &dx, &dW};
    void *got[2][3];
    ds4_dev *dv[2] = {fast, ref};
    for (int v = 0; v < 2; v++) {
        restart(bufs, 3);
        for (int c = 0; c < chunks; c++) {
            const int64_t r0 = c * rows;
            OP(dv[v], logp_bwd, .dl = dl.d, .logits = (const float *)lg.d + r0 * V, .rows = rows, .V = V,
               .tgt = (const int64_t *)tgt.d + r0, .dlogp = (const float *)dlp.d + r0,
               .rmx = (const float *)rmx.d + r0, .rse = (const double *)rse.d + r0, .dl16 = 1);
            OP(dv[v], linear_bwd_x, .dx = (float *)dx.d + r0 * D, .lddx = D, .dy = dl.d, .ldy = V, .W = W.d,
               .wdt = DS4_BF16, .T = rows, .K = D, .O = V, .bf16_in = 1, .dy_kept = 1);
            OP(dv[v], linear_bwd_w, .dW = (float *)dW.d + 1, .dy = dl.d, .ldy = V, .x = (const float *)y.d + r0 * D,
               .ldx = D, .T = rows, .K = D, .O = V, .wdt = DS4_BF16, .bf16_in = 1, .dy_kept = 1,
               .run = DS4_DW_RUN | (c == 0 ? DS4_DW_FIRST : 0) | (c == chunks - 1 ? DS4_DW_LAST : 0));
        }
        collect(dv[v], what, bufs, 3, got[v]);
    }
    same_bytes(what, "dx", got[0][1], got[1][1], &dx);
    same_bytes(what, "dW", got[0][2], got[1][2], &dW);
    for (int v = 0; v < 2; v++) free(got[v][0]), free(got[v][1]), free(got[v][2]);
    OP(fast, logp_bwd, .dl = dl.d, .logits = lg.d, .rows = rows, .V = V, .tgt = tgt.d, .dlogp = dlp.d, .rmx = rmx.d,
       .rse = rse.d, .dl16 = 1);
    OP(fast, linear_bwd_x, .dx = dx.d, .lddx = D, .dy = dl.d, .ldy = V, .W = W.d, .wdt = DS4_BF16, .T = rows, .K = D,
       .O = V, .bf16_in = 1);
    ds4_error err;
    CHECK_STATUS(ds4_dev_check(fast, "linear_bwd_x after logp_bwd's dl16", &err), DS4_ERR_INTERNAL, &err);
    CHECK(strstr(err.msg, "linear_bwd_x") && strstr(err.msg, "never written"), "names the op and why: %s", err.msg);
    twin all[] = {lg, y, W, dlp, tgt, rmx, rse, dl, dx, dW};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
    free(tg), free(mx), free(se);
}

/* An fp32 dx by a weight of few rows (the mHC mixing matrix: 24 rows; the router gate: 32; the HyperHead: n): the
 * fast backend keeps W in registers (prod_f32_skinny), the reference runs the tiles, whose order it follows: the same
 * bytes. Strided dy and dx (pad), dx written or added, odd T and K (the last columns not a whole float4). */
static void t_ref_skinny(ds4_dev *fast, ds4_dev *ref, int64_t T, int64_t K, int64_t O, int64_t pad, int acc) {
    const int64_t ldy = O + pad, lddx = K + pad;
    twin dy = tw_f(T * ldy, -1, 1), W = tw_f(O * K, -0.5f, 0.5f);
    twin dx = acc ? tw_f(T * lddx, -1, 1) : tw_out((size_t)(T * lddx) * 4);
    char what[128];
    snprintf(what, sizeof what, "fp32 dx fast vs reference T %lld K %lld O %lld pad %lld%s", (long long)T, (long long)K,
             (long long)O, (long long)pad, acc ? " acc" : "");
    twin *const bufs[1] = {&dx};
    void *got[2][1];
    ds4_dev *dv[2] = {fast, ref};
    for (int v = 0; v < 2; v++) {
        restart(bufs, 1);
        OP(dv[v], linear_bwd_x, .dx = dx.d, .lddx = lddx, .acc = acc, .dy = dy.d, .ldy = ldy, .W = W.d,
           .wdt = DS4_F32, .T = T, .K = K, .O = O);
        collect(dv[v], what, bufs, 1, got[v]);
    }
    same_bytes(what, "dx", got[0][0], got[1][0], &dx);
    free(got[0][0]), free(got[1][0]);
    twin all[] = {dy, W, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* The fast paths against the reference paths, each on a fresh pair of backends (empty scratch) */
static void t_fast_vs_ref(void) {
    ds4_dev *fast = backend(0), *ref = backend(1);
    if (!fast || !ref) return;
    t_ref_dense(fast, ref, 300, 520, 136, 3);
    t_ref_head(fast, ref, 256, 1000, 136, 3);
    t_ref_head(fast, ref, 100, 999, 64, 2); /* V odd: the value-by-value stores */
    t_ref_grouped(fast, ref, 1064, 200, 1); /* dx: 207 tiles of 128 x 128, the pipelined kernel; dx added */
    t_ref_grouped(fast, ref, 136, 77, 0);   /* O odd: dx takes the tiled kernel */
    ds4_dev *pipe = backend(2);             /* the experts' dW on the pipelined kernel where wgmma is the default */
    if (pipe) {
        t_ref_grouped(pipe, ref, 1064, 200, 1);
        t_ref_grouped(pipe, ref, 136, 77, 0);
        ds4_dev_release(pipe);
    }
    t_ref_skinny(fast, ref, 259, 4096, 24, 0, 0); /* the mHC fn's dx, fewer rows (not a whole 32-row tile) */
    t_ref_skinny(fast, ref, 300, 1024, 32, 0, 1); /* the router gate's, added */
    t_ref_skinny(fast, ref, 3, 1030, 4, 3, 0);    /* the HyperHead's; strided, K not a multiple of 4 */
    t_ref_skinny(fast, ref, 1, 37, 17, 0, 1);     /* one row, R padded to 24 */
    t_ref_skinny(fast, ref, 65, 520, 1, 2, 1);    /* one row of W, R padded to 8 */
    ds4_dev_release(fast);
    ds4_dev_release(ref);
}

/* A shape or dtype the operations cannot take is an error of the operation that names it, not a crash. */
static void t_errors(void) {
    twin dy = tw_f(4 * 3, -1, 1), W = tw_f(3 * 5, -1, 1), dx = tw_out(4 * 5 * 4);
    OP(gpu, linear_bwd_x, .dx = dx.d, .lddx = 5, .dy = dy.d, .ldy = 3, .W = W.d, .wdt = DS4_F16, .T = 4, .K = 5,
       .O = 3);
    ds4_error err;
    CHECK_STATUS(ds4_dev_check(gpu, "linear_bwd_x", &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK(strstr(err.msg, "linear_bwd_x") && strstr(err.msg, "F16"), "names the op and the dtype: %s", err.msg);
    tw_free(&dy), tw_free(&W), tw_free(&dx);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    ds4_engine *eng = NULL;
    const int open = twins_open("test_cuda_bwd_linear", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_bwd_linear");
    /* CPU scratch of the linear backward (transposes up to 512K floats) and the norm backward (1024 rows) */
    ds4_config c = {0};
    c.hc_mult = 4, c.hidden_size = 512, c.vocab_size = 1024, c.num_attention_heads = 16, c.head_dim = 64;
    c.sliding_window = 64, c.compress_rate_csa = 4, c.compress_rate_hca = 128, c.index_topk = 16;
    c.num_experts_per_tok = 4, c.n_routed_experts = 8, c.moe_intermediate_size = 256, c.q_lora_rank = 256;
    c.o_groups = 2, c.o_lora_rank = 128, c.index_n_heads = 4, c.index_head_dim = 64, c.hc_sinkhorn_iters = 20;
    ds4_error err;
    CHECK_OK(cpu->ops->reserve(cpu, &c, 64, 64, 1, &err), &err);
    t_logp_bwd(1);
    t_logp_bwd(0);
    const ds4_dtype dts[2] = {DS4_F32, DS4_BF16};
    for (int i = 0; i < 2; i++) {
        const ds4_dtype dt = dts[i];
        t_linear(1, 5, 3, 0, 0, dt);       /* one row, tiny */
        t_linear(37, 96, 40, 3, 1, dt);    /* strided rows, dx added */
        t_linear(300, 130, 77, 0, 0, dt);  /* dW over more than one 256-row slice: split into partials */
        t_linear(1000, 200, 50, 1, 1, dt); /* a long reduction into a small dW: four partials */
        t_linear(5, 70, 600, 0, 1, dt);    /* dx over O = 600: split too */
        t_linear(512, 512, 384, 0, 0, dt); /* many tiles in both products */
        t_linear_grouped(96, 40, 0, dt);
        t_linear_grouped(37, 129, 1, dt);  /* K, O odd; dx added */
    }
    /* the bf16 mode's fp32 weights: dW through cuBLAS; fp32 sums of the same products in another order, so within
     * the fp32 bound of the other products (1e-5) */
    t_linear_mode(37, 96, 40, 3, 1, DS4_F32, 1);
    t_linear_mode(2000, 4096, 24, 0, 0, DS4_F32, 1); /* the mHC's dW [24 x 4096] over many rows */
    /* a dW 4, 8 or 12 bytes off a 16-byte boundary (the flat gradient buffer's weights after a 3-value mHC scale) */
    for (int64_t off = 1; off <= 3; off++) t_linear_off(300, 130, 77, 0, 1, DS4_BF16, 0, off);
    t_linear_off(512, 512, 384, 3, 0, DS4_BF16, 0, 2);
    t_linear_off(2000, 4096, 24, 0, 0, DS4_F32, 1, 1);
    t_linear_run(100, 3, 64, 300, 1);
    t_linear_run(37, 1, 40, 24, 3); /* a run of one: first and last at once */
    t_linear_run(256, 4, 128, 1000, 2);
    t_norm_bwd(37, 300, 1, 37, NB_PLAIN, 1);
    t_norm_bwd(37, 300, 1, 37, NB_ALIAS, 1); /* kv_norm, q_norm: dx = dy with the weight gradient */
    t_norm_bwd(5, 4096, 1, 5, NB_ACC, 0);    /* the mHC RMS over n·D: added, unweighted */
    t_norm_bwd(600, 7, 1, 600, NB_ALIAS, 1); /* narrow rows, three row chunks of the weight gradient */
    t_norm_bwd(11, 64, 3, 16, NB_PLAIN, 1);  /* compressor entries: groups with rows between them */
    t_norm_bwd(48, 64, 1, 48, NB_ALIAS, 0);  /* per-head q RMS: in place, unweighted */
    /* every kernel the width picks: a warp per row (rows < 256 wide, 1 or 2 elements per played thread; rows not a
     * multiple of the 8 rows of a block), a block with the row in registers (256 to 4096: 4, 8, 16 per thread, ragged
     * last elements), the loop kernel past 4096 */
    t_norm_bwd(37, 40, 1, 37, NB_ACC, 1);
    t_norm_bwd(37, 100, 2, 40, NB_PLAIN, 1);
    t_norm_bwd(203, 128, 1, 203, NB_ALIAS, 0); /* the per-head q RMS of the 599M model, fewer rows */
    t_norm_bwd(19, 200, 1, 19, NB_ACC, 0);
    t_norm_bwd(9, 256, 1, 9, NB_ALIAS, 1);
    t_norm_bwd(70, 1024, 1, 70, NB_PLAIN, 1);
    t_norm_bwd(13, 1500, 2, 14, NB_ACC, 1);
    t_norm_bwd(24, 4096, 1, 24, NB_ACC, 0);
    t_norm_bwd(7, 4000, 1, 7, NB_ALIAS, 1);
    t_norm_bwd(5, 5000, 1, 5, NB_PLAIN, 1);
    t_colsum(1000, 24, 24); /* dense rows of at most 32: cp.async tiles of 256 rows, three stages */
    t_colsum(8193, 16, 16); /* ... a ragged last tile */
    t_colsum(5, 3, 3);
    t_colsum(37, 1, 3);     /* HyperHead's scale: column 0 of [T, 3]: the strided kernel */
    t_colsum(300, 40, 40);  /* ... and rows wider than 32 */
    t_sum_streams(37, 4, 300);
    t_sum_streams(3, 1, 5);
    t_embed_bwd(200, 4, 300, 50, 0);
    t_embed_bwd(64, 1, 33, 7, 1);
    t_embed_bwd(700, 1, 520, 1000, 0); /* more than one tile of 256 ids, columns over two blocks */
    t_fast_vs_ref();
    t_errors();
    twins_close(eng);
    return ds4t_finish("test_cuda_bwd_linear");
}
#else
int main(void) {
    printf("test_cuda_bwd_linear: skipped (built without CUDA)\n");
    return 77;
}
#endif
