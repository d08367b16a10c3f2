/* test_cuda_hc_bits.c — the mHC forward's fast kernels (cuda/cuda_hc.cu: the norm factors a warp per token, the mixing
 * GEMM scaling X's rows as it reads them, the coefficients two tokens a warp, hc_post a thread per channel) give the
 * reference kernels' bits, and a token's results do not depend on its batch.
 *
 * The reference is a second CUDA backend made with DS4_CUDA_HC_REF=1: the block-per-token norm that writes the
 * normalised streams, the GEMM over them, the coefficients a token per warp (a block per token for wide n) and hc_post
 * a thread per output, whose bits the training losses and the rollouts' log-probabilities have been made of. Equal bytes
 * are required (decoding must give the training forward's bits): a double sum in another order, a product rounded
 * before its scale, a stream summed out of order differs in the last bit of some output among the thousands here.
 * NaN poison (0xff bytes) in every output on both sides, so an output left unwritten fails too.
 * Shapes: the model's (n = 4, D = 1024) over 300 tokens (the GEMM that scales rows runs from 257 tokens on) and one
 * token (decoding: the skinny GEMM over a written copy); odd D (one channel a lane, no 16-byte loads), n from 2 to 12
 * (two tokens a warp up to n = 4, a token a warp up to 8, the reference kernels past it), mixing widths past the
 * narrow GEMM's 32 columns, 1 to 20 Sinkhorn iterations, token counts that are multiples of nothing, X not 16-byte
 * aligned. Batch invariance: the last token alone, and the last 17 together, against their rows of the whole batch
 * (fast kernels); with few rows the mixing GEMM runs its skinny kernel, so this also compares the narrow GEMM kernels
 * of the batch (the cp.async-staged one at 24 columns or fewer over aligned rows, the register-staged one else, each
 * scaling rows as it reads them) with another kernel of the same sum order, bit for bit.
 * The CPU's side of these ops is test_cuda_ops' (within 1e-5). Exit 77 without a CUDA build or device. */
#define _POSIX_C_SOURCE 200809L /* setenv: the reference backend */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"

static ds4_dev *gpu_ref; /* DS4_CUDA_HC_REF=1 */

/* The outputs of one run of hc_pre, hc_post and hyperhead on one device. */
typedef struct outs {
    twin pre, post, comb, u, Xo, hu;
} outs;

static outs outs_new(int64_t T, int64_t n, int64_t D) {
    outs o = {tw_out((size_t)(T * n) * 4), tw_out((size_t)(T * n) * 4), tw_out((size_t)(T * n * n) * 4),
              tw_out((size_t)(T * D) * 4), tw_out((size_t)(T * n * D) * 4), tw_out((size_t)(T * D) * 4)};
    return o;
}

static void outs_free(outs *o) {
    twin *all[] = {&o->pre, &o->post, &o->comb, &o->u, &o->Xo, &o->hu};
    for (int i = 0; i < 6; i++) tw_free(all[i]);
}

/* The inputs: streams X [T, n, D], the branch output A [T, D], hc_post's own post [T, n] and comb [T, n, n] (random,
 * so that hc_post is checked apart from hc_pre), the mixing weights of hc_pre and of the HyperHead. */
typedef struct ins {
    twin X, A, P, C, fn, base, scl, hfn, hbase, hscl;
} ins;

static const float *at(const twin *t, int64_t floats) { return (const float *)t->d + floats; }
static float *at_out(twin *t, int64_t floats) { return (float *)t->d + floats; }

/* tokens [t0, t0 + T) of the inputs through the three ops on d, into o's rows from 0 */
static void run(ds4_dev *d, const ds4_config *c, const ins *in, outs *o, int64_t t0, int64_t T) {
    const int64_t n = c->hc_mult, D = c->hidden_size;
    const ds4_hc_w w = {in->fn.d, in->base.d, in->scl.d};
    OP(d, hc_pre, .c = c, .w = &w, .X = at(&in->X, t0 * n * D), .pre = at_out(&o->pre, 0),
       .post = at_out(&o->post, 0), .comb = at_out(&o->comb, 0), .u = at_out(&o->u, 0), .T = T);
    OP(d, hc_post, .c = c, .X = at(&in->X, t0 * n * D), .a = at(&in->A, t0 * D), .post = at(&in->P, t0 * n),
       .comb = at(&in->C, t0 * n * n), .Xo = at_out(&o->Xo, 0), .T = T);
    OP(d, hyperhead, .c = c, .X = at(&in->X, t0 * n * D), .fn = (const float *)in->hfn.d,
       .base = (const float *)in->hbase.d, .scale = (const float *)in->hscl.d, .u = at_out(&o->hu, 0), .T = T);
    check_dev(d, "mHC forward");
}

/* rows [0, rows) of got equal rows [r0, r0 + rows) of want, `width` floats a row; and no poison (NaN) left in got */
static void same_rows(const char *what, const char *shape, const twin *got, const twin *want, int64_t r0, int64_t rows,
                      int64_t width) {
    float *g = fetch(got), *w = fetch(want);
    int64_t nan = 0;
    for (int64_t i = 0; i < rows * width; i++) nan += isnan(g[i]);
    CHECK(nan == 0, "%s %s: %lld outputs NaN (unwritten)", what, shape, (long long)nan);
    const int64_t bad = memcmp(g, w + r0 * width, (size_t)(rows * width) * 4);
    CHECK(bad == 0, "%s %s: bits differ from the reference", what, shape);
    free(g), free(w);
}

static void same_outs(const char *shape, const outs *got, const outs *want, int64_t r0, int64_t rows, int64_t n,
                      int64_t D) {
    same_rows("hc_pre pre", shape, &got->pre, &want->pre, r0, rows, n);
    same_rows("hc_pre post", shape, &got->post, &want->post, r0, rows, n);
    same_rows("hc_pre comb", shape, &got->comb, &want->comb, r0, rows, n * n);
    same_rows("hc_pre u", shape, &got->u, &want->u, r0, rows, D);
    same_rows("hc_post", shape, &got->Xo, &want->Xo, r0, rows, n * D);
    same_rows("hyperhead", shape, &got->hu, &want->hu, r0, rows, D);
}

/* tokens [t0, T) of random inputs: the fast kernels against the reference, then the last tokens alone */
static void t_hc_bits(int64_t n, int64_t D, int64_t T, int64_t iters, int64_t t0) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = n, c.hidden_size = D, c.hc_sinkhorn_iters = iters;
    const int64_t nD = n * D, nmix = (2 + n) * n;
    ins in = {tw_f(T * nD, -2, 2), tw_f(T * D, -1, 1), tw_f(T * n, 0, 2), tw_f(T * n * n, 0, 1),
              tw_f(nmix * nD, -0.1f, 0.1f), tw_f(nmix, -1, 1), tw_f(3, 0.5f, 1.5f), tw_f(n * nD, -0.1f, 0.1f),
              tw_f(n, -1, 1), tw_f(1, 0.5f, 1.5f)};
    char shape[96];
    snprintf(shape, sizeof shape, "(n = %lld, D = %lld, tokens %lld .. %lld, %lld iterations)", (long long)n,
             (long long)D, (long long)t0, (long long)T, (long long)iters);
    const int64_t nt = T - t0;
    outs fast = outs_new(nt, n, D), ref = outs_new(nt, n, D);
    run(gpu, &c, &in, &fast, t0, nt);
    check_dev(gpu, "inputs"); /* the uploads (gpu's stream) have landed before the other backend's stream reads them */
    run(gpu_ref, &c, &in, &ref, t0, nt);
    same_outs(shape, &fast, &ref, 0, nt, n, D);
    /* batch invariance: the last token alone, the last min(17, nt) tokens together */
    const int64_t parts[2] = {1, nt < 17 ? nt : 17};
    for (int i = 0; i < 2; i++) {
        outs part = outs_new(parts[i], n, D);
        run(gpu, &c, &in, &part, T - parts[i], parts[i]);
        char what[160];
        snprintf(what, sizeof what, "%s, the last %lld tokens alone", shape, (long long)parts[i]);
        same_outs(what, &part, &fast, nt - parts[i], parts[i], n, D);
        outs_free(&part);
    }
    outs_free(&fast), outs_free(&ref);
    twin *all[] = {&in.X, &in.A, &in.P, &in.C, &in.fn, &in.base, &in.scl, &in.hfn, &in.hbase, &in.hscl};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(all[i]);
}

int main(void) {
    ds4_engine *eng = NULL;
    unsetenv("DS4_CUDA_HC_REF"); /* gpu: the kernels the schedule takes */
    const int open = twins_open("test_cuda_hc_bits", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_hc_bits");
    ds4_error err = {0};
    setenv("DS4_CUDA_HC_REF", "1", 1); /* read when a backend is made */
    CHECK_OK(ds4_cuda_dev_create(0, &gpu_ref, &err), &err);
    unsetenv("DS4_CUDA_HC_REF");
    if (gpu_ref) {
        t_hc_bits(4, 1024, 300, 20, 0); /* the model's streams, a batch: the GEMM that scales rows, cp.async staged */
        t_hc_bits(4, 1024, 1, 20, 0);   /* decoding */
        t_hc_bits(4, 64, 261, 20, 0);
        t_hc_bits(2, 37, 259, 20, 0);   /* odd D: a channel a lane, rows not 16-byte aligned: the narrow GEMM */
        t_hc_bits(3, 37, 301, 20, 1);   /* X itself not 16-byte aligned */
        t_hc_bits(3, 50, 17, 20, 0);    /* the skinny GEMM over the written copy */
        t_hc_bits(3, 52, 1000, 7, 0);
        t_hc_bits(4, 8, 5, 1, 0);       /* one iteration; fewer channels than lanes */
        t_hc_bits(5, 64, 300, 20, 0);   /* 35 mixing columns: the tiled GEMM over the written copy */
        t_hc_bits(6, 33, 5, 3, 0);      /* a token a warp */
        t_hc_bits(8, 40, 263, 20, 0);   /* a token a warp, 8 streams in registers */
        t_hc_bits(12, 16, 3, 20, 0);    /* the reference kernels themselves (n·n > 64, n > 8) */
        ds4_dev_release(gpu_ref);
    }
    twins_close(eng);
    return ds4t_finish("test_cuda_hc_bits");
}
#else
int main(void) {
    printf("test_cuda_hc_bits: skipped (built without CUDA)\n");
    return 77;
}
#endif
