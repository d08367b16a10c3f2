/* test_cuda_row_bits.c — the row ops' fast kernels give the reference kernels' bits: logprobs (the cross-entropy in
 * the same kernel, the row's max and its id by shuffle trees; cuda/cuda_head.cu), ce_rows and sample (the same trees),
 * rmsnorm (the row in registers, a warp per row below 256 wide; cuda/cuda_rows.cu). colsum_add, norm_bwd, comp_bwd and
 * cast_params run the same kernels on both backends (their faster forms were slower on an H200's step and were
 * dropped; docs/design.md): their bytes are still compared, run to run and across the backends.
 *
 * The reference is a second CUDA backend made with DS4_CUDA_ROW_REF=1: the kernels whose bits the training losses, the
 * rollouts' log-probabilities and the weights have been made of. Equal bytes are required: these kernels change where
 * and when values are read, never the order of an operation, so a single differing bit is a bug (a sum reordered, a
 * tie resolved to another id, a value left unwritten). Every output is NaN-poisoned (0xff bytes) on both sides; outputs
 * meant to be written must hold no NaN where their inputs have none. colsum_add and cast_params must moreover equal the
 * CPU backend's bytes (the same fp32 adds in ops.h's order: chunks of 256 rows, each from 0 in row order, added into
 * dst in chunk order; the same rounding to nearest even). The forward ops (logprobs,
 * rmsnorm) must also give a row's bits with the row alone (a decoding step) or among a few. ce_rows and logprobs also
 * keep each row's max and Σ exp for the backward (ops.h), the same bytes from both, and logp_bwd from them (its
 * elementwise kernel) must give the bytes of logp_bwd without them. All of them with the exponentials in double (the
 * fp32 mode's) and in fp32 (exp32, the bf16 mode's).
 * logprobs, ce_rows (and logp_bwd, which ignores it) also run with DS4_CUDA_ROW_BLOCKS=1 (each block looping over rows: a tuning knob
 * that must not change a bit).
 * Shapes: the training head [1024 x 32000], vocabularies below and around the block's 256 threads, logits on a coarse
 * grid (ties between threads for the max, -0 against +0), rows holding NaN (first element or later) or all -inf,
 * targets -100; rmsnorm and norm_bwd at widths that take each of their kernels (norm_bwd in place, apart and added,
 * with groups); colsum over dense and strided rows of lengths around the tiles; cast entries of 1 to 100k values,
 * misaligned, fp32 and bf16. Exit 77 without a CUDA build or device. */
#define _POSIX_C_SOURCE 200809L /* setenv: the reference backend */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"

static ds4_dev *gpu_ref;  /* DS4_CUDA_ROW_REF=1 */
static ds4_dev *gpu_loop; /* DS4_CUDA_ROW_BLOCKS=1: the vocabulary row kernels' blocks each loop over rows */
static int e32;         /* the head ops' exp32 (ops.h): the exponentials in fp32, as the bf16 mode forms them */

/* The uploads (inputs, poisoned outputs) run on gpu's stream: they have landed before another backend's stream (or
 * gpu's own, trivially) runs an operation on them. */
static void landed(void) { check_dev(gpu, "uploads"); }

/* the device bytes of a and b are equal */
static void same_bytes(const char *what, const twin *a, const twin *b) {
    void *ga = fetch(a), *gb = fetch(b);
    CHECK(a->bytes == b->bytes && memcmp(ga, gb, a->bytes) == 0, "%s: bits differ from the reference", what);
    free(ga), free(gb);
}

/* ------------------------------------------------------------------------------------------------ logprobs */

enum { LG_PLAIN, LG_TIES, LG_SPECIAL };

/* logits [rows, V]: random (plain), on a grid of 1/4 in [-2, 2] (many ties for the max, zeros of both signs), or that
 * grid with special rows: NaN at element 0, NaN later, all -inf, one +inf */
static twin logits_new(int64_t rows, int64_t V, int kind) {
    twin z = tw_new((size_t)(rows * V) * 4);
    float *h = z.h;
    for (int64_t i = 0; i < rows * V; i++) {
        if (kind == LG_PLAIN) h[i] = frand(-8, 8);
        else {
            const float q = floorf(frand(0, 17)) * 0.25f - 2.0f;
            h[i] = q == 0 && urand() < 0.5 ? -0.0f : q;
        }
    }
    if (kind == LG_SPECIAL && rows >= 5) {
        h[0 * V] = NAN;
        h[1 * V + V / 2] = NAN;
        for (int64_t v = 0; v < V; v++) h[2 * V + v] = -INFINITY;
        h[3 * V + V - 1] = INFINITY;
        h[4 * V + V / 3] = -INFINITY;
    }
    tw_push(&z);
    return z;
}

typedef struct lp_outs {
    twin logp, ent, nll, nll_ce;
} lp_outs;

static lp_outs lp_run(ds4_dev *d, const twin *z, const twin *tgt, int64_t r0, int64_t rows, int64_t V) {
    lp_outs o = {tw_out((size_t)rows * 4), tw_out((size_t)rows * 4), tw_out((size_t)rows * 8),
                 tw_out((size_t)rows * 8)};
    const float *zz = (const float *)z->d + r0 * V;
    const int64_t *tt = (const int64_t *)tgt->d + r0;
    landed();
    OP(d, logprobs, .logits = zz, .rows = rows, .V = V, .tgt = tt, .logp = o.logp.d, .entropy = o.ent.d,
       .nll = o.nll.d, .exp32 = e32);
    OP(d, ce_rows, .logits = zz, .rows = rows, .V = V, .tgt = tt, .nll = o.nll_ce.d, .exp32 = e32);
    check_dev(d, "logprobs");
    return o;
}

static void lp_free(lp_outs *o) { tw_free(&o->logp), tw_free(&o->ent), tw_free(&o->nll), tw_free(&o->nll_ce); }

/* rows [0, rows) of got equal rows [r0, r0 + rows) of want (`size` bytes a row) */
static void same_rows(const char *what, const twin *got, const twin *want, int64_t r0, int64_t rows, size_t size) {
    char *g = fetch(got), *w = fetch(want);
    CHECK(memcmp(g, w + r0 * size, rows * size) == 0, "%s: bits differ", what);
    free(g), free(w);
}

static void t_logprobs(int64_t rows, int64_t V, int kind) {
    char what[160];
    snprintf(what, sizeof what, "logprobs [%lld x %lld]%s%s", (long long)rows, (long long)V,
             kind == LG_PLAIN ? "" : (kind == LG_TIES ? " (ties)" : " (NaN, -inf, +inf rows)"), e32 ? ", exp32" : "");
    twin z = logits_new(rows, V, kind);
    int64_t *t = malloc((size_t)rows * 8);
    for (int64_t r = 0; r < rows; r++) t[r] = r % 7 == 5 ? -100 : (int64_t)(urand() * (double)V) % V;
    twin tgt = tw_i64(rows, t);
    lp_outs fast = lp_run(gpu, &z, &tgt, 0, rows, V), ref = lp_run(gpu_ref, &z, &tgt, 0, rows, V);
    lp_outs loop = lp_run(gpu_loop, &z, &tgt, 0, rows, V);
    char w2[200];
    for (int i = 0; i < 2; i++) {
        const lp_outs *o = i ? &loop : &fast;
        const char *how = i ? " (rows looped over)" : "";
        snprintf(w2, sizeof w2, "%s%s: log p", what, how), same_bytes(w2, &o->logp, &ref.logp);
        snprintf(w2, sizeof w2, "%s%s: entropy", what, how), same_bytes(w2, &o->ent, &ref.ent);
        snprintf(w2, sizeof w2, "%s%s: nll", what, how), same_bytes(w2, &o->nll, &ref.nll);
        snprintf(w2, sizeof w2, "%s%s: ce_rows", what, how), same_bytes(w2, &o->nll_ce, &ref.nll_ce);
    }
    lp_free(&loop);
    snprintf(w2, sizeof w2, "%s: logprobs' nll against ce_rows'", what), same_bytes(w2, &fast.nll, &fast.nll_ce);
    /* written where meant: no NaN in the rows without special values, none in nll but at targets of -100 */
    float *lp = fetch(&fast.logp), *en = fetch(&fast.ent);
    double *nl = fetch(&fast.nll);
    int64_t bad = 0;
    for (int64_t r = kind == LG_SPECIAL ? 5 : 0; r < rows; r++)
        bad += isnan(lp[r]) || isnan(en[r]) || (t[r] != -100 && isnan(nl[r])) || (t[r] == -100 && !isnan(nl[r]));
    CHECK(bad == 0, "%s: %lld rows with NaN (unwritten) or a nll written at a target of -100", what, (long long)bad);
    free(lp), free(en), free(nl);
    /* batch invariance: the last row alone (a decoding step) and the last 3 rows */
    const int64_t parts[2] = {1, rows < 3 ? rows : 3};
    for (int i = 0; i < 2; i++) {
        lp_outs p = lp_run(gpu, &z, &tgt, rows - parts[i], parts[i], V);
        snprintf(w2, sizeof w2, "%s: the last %lld rows alone", what, (long long)parts[i]);
        same_rows(w2, &p.logp, &fast.logp, rows - parts[i], parts[i], 4);
        same_rows(w2, &p.ent, &fast.ent, rows - parts[i], parts[i], 4);
        same_rows(w2, &p.nll, &fast.nll, rows - parts[i], parts[i], 8);
        lp_free(&p);
    }
    lp_free(&fast), lp_free(&ref);
    tw_free(&z), tw_free(&tgt);
    free(t);
}

/* The sampler through both folds of the max: greedy picks (ties everywhere: the lowest id of the max) and draws, with
 * their log-probabilities (every row here finite; the sampler refuses NaN rows before it reduces). */
static void t_sample(int64_t rows, int64_t V, double temperature) {
    char what[96];
    snprintf(what, sizeof what, "sample [%lld x %lld], temperature %g%s", (long long)rows, (long long)V, temperature,
             e32 ? ", exp32" : "");
    twin z = logits_new(rows, V, LG_TIES);
    int32_t *lr = malloc((size_t)rows * 4);
    double *uu = malloc((size_t)rows * 8);
    for (int64_t r = 0; r < rows; r++) lr[r] = (int32_t)(rows - 1 - r), uu[r] = urand();
    twin lrow = tw_i32(rows, lr), u = tw_new((size_t)rows * 8);
    memcpy(u.h, uu, (size_t)rows * 8);
    tw_push(&u);
    const ds4_sampling p = {temperature, temperature > 0 ? 50 : 0, temperature > 0 ? 0.9 : 0, 0};
    twin id[2], lpm[2], lps[2];
    ds4_dev *devs[2] = {gpu, gpu_ref};
    for (int i = 0; i < 2; i++) {
        id[i] = tw_out((size_t)rows * 8), lpm[i] = tw_out((size_t)rows * 8), lps[i] = tw_out((size_t)rows * 8);
        landed();
        OP(devs[i], sample, .logits = z.d, .lrow = lrow.d, .rows = rows, .V = V, .p = p, .u = u.d, .id = id[i].d,
           .lp_model = lpm[i].d, .lp_sample = lps[i].d, .exp32 = e32);
        check_dev(devs[i], what);
    }
    char w2[160];
    snprintf(w2, sizeof w2, "%s: ids", what), same_bytes(w2, &id[0], &id[1]);
    snprintf(w2, sizeof w2, "%s: log p (model)", what), same_bytes(w2, &lpm[0], &lpm[1]);
    snprintf(w2, sizeof w2, "%s: log p (sample)", what), same_bytes(w2, &lps[0], &lps[1]);
    for (int i = 0; i < 2; i++) tw_free(&id[i]), tw_free(&lpm[i]), tw_free(&lps[i]);
    tw_free(&z), tw_free(&lrow), tw_free(&u);
    free(lr), free(uu);
}

/* logp_bwd with a block per row (the reference backend) and with blocks looping over rows: the same kernel body, so
 * the same bytes; dl apart from the logits and in place; and from the rows' statistics (below). */
static void t_logp_bwd(int64_t rows, int64_t V, int in_place) {
    char what[96];
    snprintf(what, sizeof what, "logp_bwd [%lld x %lld]%s%s", (long long)rows, (long long)V, in_place ? " in place" : "",
             e32 ? ", exp32" : "");
    twin z = logits_new(rows, V, LG_PLAIN), dlogp = tw_f(rows, -1, 1);
    int64_t *t = malloc((size_t)rows * 8);
    for (int64_t r = 0; r < rows; r++) t[r] = r % 5 == 3 ? -100 : (int64_t)(urand() * (double)V) % V;
    ((float *)dlogp.h)[rows / 2] = 0; /* g = 0: a row of zeros */
    tw_push(&dlogp);
    twin tgt = tw_i64(rows, t), out[3];
    /* the rows' statistics as a training forward keeps them (ops.h): logprobs' and ce_rows' must be the same bytes,
     * every row (targets of -100 too), and logp_bwd from them the bytes of logp_bwd alone (its elementwise kernel) */
    twin rmx[2] = {tw_out((size_t)rows * 4), tw_out((size_t)rows * 4)};
    twin rse[2] = {tw_out((size_t)rows * 8), tw_out((size_t)rows * 8)};
    twin lpo = tw_out((size_t)rows * 8), nll = tw_out((size_t)rows * 8);
    landed();
    OP(gpu, logprobs, .logits = z.d, .rows = rows, .V = V, .tgt = tgt.d, .logp = lpo.d, .entropy = (float *)lpo.d + rows,
       .nll = nll.d, .rmx = rmx[0].d, .rse = rse[0].d, .exp32 = e32);
    OP(gpu, ce_rows, .logits = z.d, .rows = rows, .V = V, .tgt = tgt.d, .nll = nll.d, .rmx = rmx[1].d, .rse = rse[1].d,
       .exp32 = e32);
    check_dev(gpu, "logprobs / ce_rows with the rows' statistics");
    char w2[160];
    snprintf(w2, sizeof w2, "%s: the row statistics of logprobs and of ce_rows", what);
    same_bytes(w2, &rmx[0], &rmx[1]), same_bytes(w2, &rse[0], &rse[1]);
    ds4_dev *devs[3] = {gpu_loop, gpu_ref, gpu};
    for (int i = 0; i < 3; i++) {
        out[i] = in_place ? tw_copy(&z) : tw_out((size_t)(rows * V) * 4);
        landed();
        OP(devs[i], logp_bwd, .dl = out[i].d, .logits = in_place ? out[i].d : z.d, .rows = rows, .V = V, .tgt = tgt.d,
           .dlogp = dlogp.d, .g0 = 0, .rmx = i == 2 ? rmx[0].d : NULL, .rse = i == 2 ? rse[0].d : NULL, .exp32 = e32);
        check_dev(devs[i], what);
    }
    same_bytes(what, &out[0], &out[1]);
    snprintf(w2, sizeof w2, "%s: from the forward's row statistics", what);
    same_bytes(w2, &out[2], &out[1]);
    for (int i = 0; i < 2; i++) tw_free(&rmx[i]), tw_free(&rse[i]);
    tw_free(&lpo), tw_free(&nll), tw_free(&out[2]);
    float *g = fetch(&out[0]);
    int64_t nan = 0;
    for (int64_t i = 0; i < rows * V; i++) nan += isnan(g[i]);
    CHECK(nan == 0, "%s: %lld outputs NaN (unwritten)", what, (long long)nan);
    free(g);
    tw_free(&out[0]), tw_free(&out[1]), tw_free(&z), tw_free(&dlogp), tw_free(&tgt);
    free(t);
}

/* ------------------------------------------------------------------------------------------------ rmsnorm */

/* rows [r0, r0 + rows) of x through rmsnorm on d into a fresh poisoned output */
static twin rms_run(ds4_dev *d, const twin *x, const twin *w, int64_t r0, int64_t rows, int64_t width) {
    twin y = tw_out((size_t)(rows * width) * 4);
    landed();
    OP(d, rmsnorm, .y = y.d, .x = (const float *)x->d + r0 * width, .w = w ? w->d : NULL, .rows = rows, .width = width,
       .eps = 1e-6);
    check_dev(d, "rmsnorm");
    return y;
}

static void t_rmsnorm(int64_t rows, int64_t width, int weighted) {
    char what[96];
    snprintf(what, sizeof what, "rmsnorm [%lld x %lld]%s", (long long)rows, (long long)width,
             weighted ? "" : " (no weight)");
    twin x = tw_f(rows * width, -3, 3), w = tw_f(width, 0.5f, 1.5f);
    twin fast = rms_run(gpu, &x, weighted ? &w : NULL, 0, rows, width);
    twin ref = rms_run(gpu_ref, &x, weighted ? &w : NULL, 0, rows, width);
    same_bytes(what, &fast, &ref);
    float *g = fetch(&fast);
    int64_t nan = 0;
    for (int64_t i = 0; i < rows * width; i++) nan += isnan(g[i]);
    CHECK(nan == 0, "%s: %lld outputs NaN (unwritten)", what, (long long)nan);
    free(g);
    /* in place (the q, kv and per-head norms normalise their own rows) */
    twin ip = tw_copy(&x);
    landed();
    OP(gpu, rmsnorm, .y = ip.d, .x = ip.d, .w = weighted ? w.d : NULL, .rows = rows, .width = width, .eps = 1e-6);
    check_dev(gpu, "rmsnorm in place");
    char w1[160];
    snprintf(w1, sizeof w1, "%s: in place", what), same_bytes(w1, &ip, &fast);
    tw_free(&ip);
    /* batch invariance: the last row alone (decoding), the last 9 rows */
    const int64_t parts[2] = {1, rows < 9 ? rows : 9};
    for (int i = 0; i < 2; i++) {
        twin p = rms_run(gpu, &x, weighted ? &w : NULL, rows - parts[i], parts[i], width);
        char w2[160];
        snprintf(w2, sizeof w2, "%s: the last %lld rows alone", what, (long long)parts[i]);
        same_rows(w2, &p, &fast, rows - parts[i], parts[i], (size_t)width * 4);
        tw_free(&p);
    }
    tw_free(&x), tw_free(&w), tw_free(&fast), tw_free(&ref);
}

/* ------------------------------------------------------------------------------------------------ colsum_add */

static void t_colsum(int64_t rows, int64_t width, int64_t ld, int64_t src_off) {
    char what[128];
    snprintf(what, sizeof what, "colsum_add [%lld rows x %lld, stride %lld, +%lld]", (long long)rows, (long long)width,
             (long long)ld, (long long)src_off);
    twin src = tw_f(src_off + rows * ld, -1, 1), d0 = tw_f(width, -1, 1);
    twin fast = tw_copy(&d0), ref = tw_copy(&d0), host = tw_copy(&d0);
    const float *s = (const float *)src.d + src_off;
    landed();
    OP(gpu, colsum_add, .dst = fast.d, .src = s, .rows = rows, .width = width, .ld = ld);
    check_dev(gpu, "colsum_add");
    OP(gpu_ref, colsum_add, .dst = ref.d, .src = s, .rows = rows, .width = width, .ld = ld);
    check_dev(gpu_ref, "colsum_add (reference)");
    OP(cpu, colsum_add, .dst = host.h, .src = (const float *)src.h + src_off, .rows = rows, .width = width, .ld = ld);
    check_dev(cpu, "colsum_add (CPU)");
    same_bytes(what, &fast, &ref);
    cmp_bytes(what, &(twin){host.h, fast.d, fast.bytes}); /* the CPU's adds, in the CPU's order */
    tw_free(&src), tw_free(&d0), tw_free(&fast), tw_free(&ref), tw_free(&host);
}

/* ------------------------------------------------------------------------------------------------ norm_bwd */

enum { NB_APART, NB_ALIAS, NB_ACC };

static void t_norm_bwd(int64_t rows, int64_t width, int64_t groups, int64_t slots, int kind, int weighted) {
    char what[160];
    snprintf(what, sizeof what, "norm_bwd [%lld groups x %lld (of %lld) x %lld]%s%s", (long long)groups,
             (long long)rows, (long long)slots, (long long)width,
             kind == NB_ALIAS ? " in place" : (kind == NB_ACC ? " added" : ""), weighted ? "" : " (no weight)");
    const int64_t n = groups * slots * width;
    twin x = tw_f(n, -2, 2), dy = tw_f(n, -1, 1), w = tw_f(width, 0.5f, 1.5f), dw0 = tw_f(width, -1, 1);
    twin dx0 = kind == NB_ACC ? tw_f(n, -1, 1) : tw_out((size_t)n * 4);
    twin dx[2], dw[2];
    ds4_dev *devs[2] = {gpu, gpu_ref};
    for (int i = 0; i < 2; i++) {
        dx[i] = kind == NB_ALIAS ? tw_copy(&dy) : tw_copy(&dx0);
        dw[i] = tw_copy(&dw0);
        landed();
        OP(devs[i], norm_bwd, .dx = dx[i].d, .acc = kind == NB_ACC, .dw = weighted ? dw[i].d : NULL,
           .dy = kind == NB_ALIAS ? dx[i].d : dy.d, .x = x.d, .w = weighted ? w.d : NULL, .rows = rows, .width = width,
           .eps = 1e-6, .groups = groups, .gstride = slots * width);
        check_dev(devs[i], what);
    }
    char w2[200];
    snprintf(w2, sizeof w2, "%s: dw", what), same_bytes(w2, &dw[0], &dw[1]);
    snprintf(w2, sizeof w2, "%s: dx", what), same_bytes(w2, &dx[0], &dx[1]);
    float *g = fetch(&dx[0]), *gw = fetch(&dw[0]);
    int64_t nan = 0;
    for (int64_t gr = 0; gr < groups; gr++)
        for (int64_t i = 0; i < rows * width; i++) nan += isnan(g[gr * slots * width + i]);
    for (int64_t i = 0; i < width; i++) nan += isnan(gw[i]);
    CHECK(nan == 0, "%s: %lld outputs NaN (unwritten)", what, (long long)nan);
    free(g), free(gw);
    for (int i = 0; i < 2; i++) tw_free(&dx[i]), tw_free(&dw[i]);
    tw_free(&x), tw_free(&dy), tw_free(&w), tw_free(&dw0), tw_free(&dx0);
}

/* ------------------------------------------------------------------------------------------------ comp_bwd */

/* The compressor pooling's backward over B sequences of S tokens, windows of m, entries of dd (overlap: CSA's windows
 * reading the previous window's first halves): dC, dZ and the position bias gradient. dC and dZ keep their poison
 * where no window pools (alike on both sides); the columns every complete window writes itself must hold no NaN. */
static void t_comp_bwd(int64_t B, int64_t S, int64_t m, int64_t dd, int overlap) {
    char what[128];
    snprintf(what, sizeof what, "comp_bwd [%lld x %lld tokens, windows of %lld, entries of %lld%s]", (long long)B,
             (long long)S, (long long)m, (long long)dd, overlap ? ", overlap" : "");
    const int64_t width = (overlap ? 2 : 1) * dd, T = B * S, nwin = S / m;
    ds4_config c;
    ds4_config_default(&c);
    twin C = tw_f(T * width, -1, 1), Z = tw_f(T * width, -2, 2), ape = tw_f(m * width, -0.5f, 0.5f);
    twin dpool = tw_f(T * dd, -1, 1), gape0 = tw_f(m * width, -1, 1);
    twin dC[2], dZ[2], gape[2];
    ds4_dev *devs[2] = {gpu, gpu_ref};
    for (int i = 0; i < 2; i++) {
        dC[i] = tw_out((size_t)(T * width) * 4), dZ[i] = tw_out((size_t)(T * width) * 4), gape[i] = tw_copy(&gape0);
        const ds4_compressor_w w = {.width = width, .dd = dd, .rate = m, .ape = ape.d};
        landed();
        OP(devs[i], comp_bwd, .c = &c, .w = &w, .overlap = overlap, .C = C.d, .Z = Z.d, .dpool = dpool.d, .dC = dC[i].d,
           .dZ = dZ[i].d, .gape = gape[i].d, .B = B, .S = S, .nwin = nwin);
        check_dev(devs[i], what);
    }
    char w2[192];
    snprintf(w2, sizeof w2, "%s: dC", what), same_bytes(w2, &dC[0], &dC[1]);
    snprintf(w2, sizeof w2, "%s: dZ", what), same_bytes(w2, &dZ[0], &dZ[1]);
    snprintf(w2, sizeof w2, "%s: position bias", what), same_bytes(w2, &gape[0], &gape[1]);
    float *g = fetch(&dZ[0]), *ga = fetch(&gape[0]);
    int64_t nan = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < nwin * m; t++)
            for (int64_t k = width - dd; k < width; k++) nan += isnan(g[(b * S + t) * width + k]);
    for (int64_t i = 0; i < m * width; i++) nan += isnan(ga[i]);
    CHECK(nan == 0, "%s: %lld outputs NaN (unwritten)", what, (long long)nan);
    free(g), free(ga);
    for (int i = 0; i < 2; i++) tw_free(&dC[i]), tw_free(&dZ[i]), tw_free(&gape[i]);
    tw_free(&C), tw_free(&Z), tw_free(&ape), tw_free(&dpool), tw_free(&gape0);
}

/* ------------------------------------------------------------------------------------------------ cast_params */

static void t_cast(ds4_dtype mdt, int64_t src_shift) {
    static const int64_t sizes[] = {1, 3, 4, 5, 4095, 4096, 4097, 100000, 7, 8192, 12289, 2, 33333, 1024};
    enum { NE = sizeof sizes / sizeof sizes[0] };
    const size_t el = mdt == DS4_BF16 ? 2 : 4;
    ds4_cast_entry e[NE];
    int64_t so = src_shift, dof = 0;
    for (int k = 0; k < NE; k++) {
        e[k].src = so, e[k].n = sizes[k], e[k].lowp = k % 4 != 3;
        /* entry 5 and 9 start off their alignment (one value on); the rest at 16 bytes */
        const size_t es = e[k].lowp ? el : 4;
        dof = (dof + 15) & ~(int64_t)15;
        if (k == 5 || k == 9) dof += (int64_t)es;
        e[k].dst = dof;
        so += sizes[k] + (k == 2 ? 1 : 0);
        dof += sizes[k] * (int64_t)es;
    }
    const size_t dbytes = (size_t)dof + 16;
    twin src = tw_f(so, -3, 3), ent = tw_new(sizeof e);
    memcpy(ent.h, e, sizeof e);
    tw_push(&ent);
    twin out[3] = {tw_out(dbytes), tw_out(dbytes), tw_out(dbytes)};
    landed();
    OP(gpu, cast_params, .dst = out[0].d, .src = src.d, .e = ent.d, .n = NE, .mdt = mdt);
    check_dev(gpu, "cast_params");
    OP(gpu_ref, cast_params, .dst = out[1].d, .src = src.d, .e = ent.d, .n = NE, .mdt = mdt);
    check_dev(gpu_ref, "cast_params (reference)");
    OP(cpu, cast_params, .dst = out[2].h, .src = src.h, .e = ent.h, .n = NE, .mdt = mdt);
    check_dev(cpu, "cast_params (CPU)");
    char what[96];
    snprintf(what, sizeof what, "cast_params (%s, sources +%lld)", ds4_dtype_name(mdt), (long long)src_shift);
    same_bytes(what, &out[0], &out[1]);
    cmp_bytes(what, &(twin){out[2].h, out[0].d, dbytes}); /* the CPU's rounding, the gaps left poisoned alike */
    for (int i = 0; i < 3; i++) tw_free(&out[i]);
    tw_free(&src), tw_free(&ent);
}

int main(void) {
    ds4_engine *eng = NULL;
    unsetenv("DS4_CUDA_ROW_REF"); /* gpu: the kernels the schedule takes */
    const int open = twins_open("test_cuda_row_bits", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_row_bits");
    ds4_error err = {0};
    setenv("DS4_CUDA_ROW_REF", "1", 1); /* read when a backend is made */
    CHECK_OK(ds4_cuda_dev_create(0, &gpu_ref, &err), &err);
    unsetenv("DS4_CUDA_ROW_REF");
    setenv("DS4_CUDA_ROW_BLOCKS", "1", 1); /* one block an SM: a 1024-row chunk loops ~8 rows a block */
    CHECK_OK(ds4_cuda_dev_create(0, &gpu_loop, &err), &err);
    unsetenv("DS4_CUDA_ROW_BLOCKS");
    for (e32 = 0; e32 < 2 && gpu_ref && gpu_loop; e32++) { /* the exponentials in double (fp32 mode), in fp32 (bf16) */
        t_logprobs(1024, 32000, LG_PLAIN); /* the training head's chunk; its last row alone is a decoding step */
        t_logprobs(37, 32000, LG_TIES);
        t_logprobs(9, 32000, LG_SPECIAL);
        t_logprobs(300, 1000, LG_TIES);
        t_logprobs(7, 257, LG_SPECIAL);
        t_logprobs(6, 100, LG_SPECIAL); /* fewer values than threads */
        t_logprobs(2, 1, LG_PLAIN);
        t_logp_bwd(1024, 32000, 0);
        t_logp_bwd(300, 1000, 1);
        t_logp_bwd(7, 100, 0);
        t_sample(33, 32000, 0);
        t_sample(5, 300, 0);
        t_sample(17, 5000, 1.0);
    }
    if (gpu_ref && gpu_loop) {

        t_rmsnorm(8192, 1024, 1); /* attn / ffn norms */
        t_rmsnorm(2048, 128, 0);  /* the per-head q norm: a warp per row */
        t_rmsnorm(301, 4096, 1);
        t_rmsnorm(77, 2000, 1);
        t_rmsnorm(33, 257, 1);
        t_rmsnorm(40, 255, 1);    /* a warp plays 128 threads, two elements each */
        t_rmsnorm(19, 64, 1);
        t_rmsnorm(23, 37, 0);
        t_rmsnorm(9, 7, 1);       /* fewer values than lanes */
        t_rmsnorm(5, 5000, 1);    /* wider than the register kernels: the loop kernel itself */

        t_colsum(8192, 24, 24, 0); /* the mHC sites' base and scale gradients: 32 chunks folded */
        t_colsum(8192, 3, 3, 0);
        t_colsum(8192, 1, 3, 0); /* HyperHead's scale: strided */
        t_colsum(8192, 16, 16, 0);
        t_colsum(300, 32, 32, 4); /* dense, src 16-byte aligned at an offset */
        t_colsum(4099, 24, 24, 1); /* src not 16-byte aligned, a ragged last chunk */
        t_colsum(17, 5, 5, 0);
        t_colsum(1, 3, 3, 0);
        t_colsum(31, 24, 24, 0);
        t_colsum(700, 70, 75, 0); /* wide: three column blocks */
        t_colsum(256, 24, 24, 0); /* one whole chunk: added straight into dst */
        t_colsum(257, 24, 24, 0); /* a second chunk of one row */
        t_colsum(4, 70001, 70001, 0); /* context parallelism's sum over the ranks: few rows, 2,188 column blocks */

        t_norm_bwd(300, 1024, 1, 300, NB_APART, 1); /* ffn / attn norms: dx apart, factors from the dx pass */
        t_norm_bwd(300, 1024, 1, 300, NB_ALIAS, 1); /* q / kv norms: in place */
        t_norm_bwd(37, 1024, 1, 37, NB_ACC, 1);
        t_norm_bwd(600, 7, 1, 600, NB_APART, 1);    /* a warp per row, three row chunks */
        t_norm_bwd(600, 100, 1, 600, NB_ALIAS, 1);
        t_norm_bwd(11, 64, 3, 16, NB_APART, 1);     /* compressor entries: groups with rows between them */
        t_norm_bwd(5, 4096, 1, 5, NB_ACC, 0);       /* no weight gradient */
        t_norm_bwd(3, 5000, 1, 3, NB_APART, 1);     /* wider than the register kernels */
        t_norm_bwd(513, 2000, 1, 513, NB_APART, 1);
        t_norm_bwd(1, 300, 1, 1, NB_APART, 1);

        t_comp_bwd(8, 1024, 128, 128, 0); /* the heavily compressed layers */
        t_comp_bwd(8, 1024, 4, 128, 1);   /* CSA: overlapping windows, 2048 rows a bias element */
        t_comp_bwd(3, 301, 7, 33, 1);     /* an incomplete last window, slots not a multiple of the unroll */
        t_comp_bwd(2, 50, 5, 9, 0);
        t_comp_bwd(1, 3, 4, 8, 1);        /* no complete window */

        t_cast(DS4_BF16, 0);
        t_cast(DS4_BF16, 1); /* no source 16-byte aligned */
        t_cast(DS4_F32, 0);
        t_cast(DS4_F32, 3);
    }
    if (gpu_ref) ds4_dev_release(gpu_ref);
    if (gpu_loop) ds4_dev_release(gpu_loop);
    twins_close(eng);
    return ds4t_finish("test_cuda_row_bits");
}
#else
int main(void) {
    printf("test_cuda_row_bits: skipped (built without CUDA)\n");
    return 77;
}
#endif
