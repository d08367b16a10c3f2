/* test_gemm.c — the CPU matrix products (core/cpu_gemm.c) and the attention's pointer-row kernels against a plain scalar reference of the summation order
 * they promise: eight fp32 lanes over r < R & ~7 (lane l takes r ≡ l mod 8, in order, each product fused into the
 * lane with fmaf), the lanes combined as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the last R % 8
 * products fused in one by one. Bit for bit, for
 * operands read along and across r, strides, accumulation, edge tiles, several chunks of r, several products in one
 * run, 1 and 3 threads, with every register tile the CPU runs. The same for
 * the backward's order (ds4_gemm.seq: one running sum of fused products in increasing r). Also the double sums of the norms (ds4_dot_f64). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_cpu.h"
#include "testlib.h"
#include "threadpool.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* the promised order, written out directly */
static float ref_dot(const ds4_gemm *g, int64_t i, int64_t j) {
    float lane[8] = {0};
    const int64_t R8 = g->R & ~(int64_t)7;
    for (int64_t r = 0; r < R8; r++)
        lane[r % 8] = fmaf(g->a[i * g->a_rs + r * g->a_ks], g->b[j * g->b_rs + r * g->b_ks], lane[r % 8]);
    float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (int64_t r = R8; r < g->R; r++) s = fmaf(g->a[i * g->a_rs + r * g->a_ks], g->b[j * g->b_rs + r * g->b_ks], s);
    return s;
}

/* seq: every product fused into one running sum, in increasing r */
static float ref_seq(const ds4_gemm *g, int64_t i, int64_t j) {
    float s = 0.0f;
    for (int64_t r = 0; r < g->R; r++) s = fmaf(g->a[i * g->a_rs + r * g->a_ks], g->b[j * g->b_rs + r * g->b_ks], s);
    return s;
}

typedef struct {
    ds4_gemm g;
    float *a, *b, *y, *want;
    int64_t ysize;
} prob;

/* A [M, R] or its transpose [R, M] (ta), padded strides; B likewise (tb); y [M, ldy]; seq: the backward's order */
static void make(prob *p, int64_t M, int64_t N, int64_t R, int ta, int tb, int acc, int seq) {
    const int64_t pad = 3, lda = (ta ? M : R) + pad, ldb = (tb ? N : R) + pad, ldy = N + 5;
    p->a = malloc((size_t)((ta ? R : M) * lda + 1) * sizeof(float));
    p->b = malloc((size_t)((tb ? R : N) * ldb + 1) * sizeof(float));
    p->ysize = M * ldy + 1;
    p->y = malloc((size_t)p->ysize * sizeof(float));
    p->want = malloc((size_t)p->ysize * sizeof(float));
    for (int64_t i = 0; i < (ta ? R : M) * lda; i++) p->a[i] = frand();
    for (int64_t i = 0; i < (tb ? R : N) * ldb; i++) p->b[i] = frand() * 1e3f;
    for (int64_t i = 0; i < p->ysize; i++) p->y[i] = i % 7 == 0 ? -0.0f : frand();
    p->g = (ds4_gemm){.y = p->y, .ldy = ldy, .a = p->a, .a_rs = ta ? 1 : lda, .a_ks = ta ? lda : 1, .b = p->b,
                      .b_rs = tb ? 1 : ldb, .b_ks = tb ? ldb : 1, .M = M, .N = N, .R = R, .acc = acc, .seq = seq};
    memcpy(p->want, p->y, (size_t)p->ysize * sizeof(float));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            const float s = seq ? ref_seq(&p->g, i, j) : ref_dot(&p->g, i, j);
            p->want[i * ldy + j] = acc ? p->want[i * ldy + j] + s : s;
        }
}

static void drop(prob *p) { free(p->a), free(p->b), free(p->y), free(p->want); }

/* ds4_dots_ptr against ds4_dot, ds4_wsum_ptr against a zeroed row and ds4_axpy per k (the attention's kernels) */
static void check_ptr_kernels(void) {
    static const int64_t shapes[][3] = {{1, 1, 1},    {8, 130, 128}, {5, 7, 37},  {4, 3, 16},
                                        {9, 200, 64}, {3, 2, 15},    {1, 300, 128}, {2, 9, 71}};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int64_t nh = shapes[si][0], nk = shapes[si][1], n = shapes[si][2];
        float *q = malloc((size_t)(nh * n) * sizeof(float)), *rows = malloc((size_t)(nk * n) * sizeof(float));
        float *p = malloc((size_t)(nh * nk) * sizeof(float)), *y = malloc((size_t)(nh * nk) * sizeof(float));
        float *o = malloc((size_t)(nh * n) * sizeof(float)), *want = malloc((size_t)(nh * n) * sizeof(float));
        const float **v = malloc((size_t)nk * sizeof(float *));
        for (int64_t i = 0; i < nh * n; i++) q[i] = frand();
        for (int64_t i = 0; i < nk * n; i++) rows[i] = frand();
        for (int64_t i = 0; i < nh * nk; i++) p[i] = i % 5 == 0 ? -0.0f : frand();
        for (int64_t k = 0; k < nk; k++) v[k] = rows + ((k * 7) % nk) * n; /* pointers in no particular order */
        ds4_dots_ptr(y, nk, q, n, nh, v, nk, n);
        int same = 1;
        for (int64_t h = 0; h < nh; h++)
            for (int64_t k = 0; k < nk; k++) {
                const float w = ds4_dot(q + h * n, v[k], n);
                same &= !memcmp(&w, &y[h * nk + k], sizeof w);
            }
        CHECK(same, "ds4_dots_ptr %lld x %lld x %lld differs from ds4_dot", (long long)nh, (long long)nk, (long long)n);
        ds4_wsum_ptr(o, n, p, nk, nh, v, nk, n, 0);
        memset(want, 0, (size_t)(nh * n) * sizeof(float));
        for (int64_t h = 0; h < nh; h++)
            for (int64_t k = 0; k < nk; k++) ds4_axpy(want + h * n, p[h * nk + k], v[k], n);
        CHECK(!memcmp(o, want, (size_t)(nh * n) * sizeof(float)), "ds4_wsum_ptr %lld x %lld x %lld differs from ds4_axpy",
              (long long)nh, (long long)nk, (long long)n);
        /* accumulating onto o: the sums continue where they were (here a second pass over the same rows) */
        ds4_wsum_ptr(o, n, p, nk, nh, v, nk, n, 1);
        for (int64_t h = 0; h < nh; h++)
            for (int64_t k = 0; k < nk; k++) ds4_axpy(want + h * n, p[h * nk + k], v[k], n);
        CHECK(!memcmp(o, want, (size_t)(nh * n) * sizeof(float)), "ds4_wsum_ptr (acc) %lld x %lld x %lld differs",
              (long long)nh, (long long)nk, (long long)n);
        free(q), free(rows), free(p), free(y), free(o), free(want), free(v);
    }
}

/* ds4_dot_f64 (the norms' double sums) against its promised order written out: 8 double lanes, the lane tree, the
 * tail in order; (w·a) rounded to fp32 first. Values of very different sizes, so another order would round
 * differently. */
static void check_dot_f64(void) {
    static const int64_t ns[] = {0, 1, 7, 8, 9, 31, 512, 2053};
    for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
        const int64_t n = ns[k];
        float *w = malloc((size_t)(n + 1) * sizeof(float)), *a = malloc((size_t)(n + 1) * sizeof(float));
        float *b = malloc((size_t)(n + 1) * sizeof(float));
        for (int64_t i = 0; i < n; i++)
            w[i] = frand(), a[i] = frand() * (i % 3 ? 1.0f : 1e6f), b[i] = frand() * (i % 5 ? 1e-3f : 1e4f);
        for (int wi = 0; wi < 2; wi++) {
            double lane[8] = {0};
            const int64_t n8 = n & ~(int64_t)7;
            for (int64_t i = 0; i < n8; i++) lane[i % 8] += (double)(wi ? w[i] * a[i] : a[i]) * (double)b[i];
            double want = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
            for (int64_t i = n8; i < n; i++) want += (double)(wi ? w[i] * a[i] : a[i]) * (double)b[i];
            const double got = ds4_dot_f64(wi ? w : NULL, a, b, n);
            CHECK(!memcmp(&got, &want, sizeof got), "ds4_dot_f64 n %lld w %d: %.17g, want %.17g", (long long)n, wi, got,
                  want);
        }
        free(w), free(a), free(b);
    }
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    check_ptr_kernels();
    check_dot_f64();
    static const int64_t shapes[][3] = {{1, 1, 0},   {1, 1, 1},    {5, 3, 7},     {6, 8, 8},    {7, 9, 17},
                                        {13, 2, 64}, {48, 64, 512}, {50, 70, 515}, {97, 131, 40}, {12, 9, 1031},
                                        {64, 96, 96}, {3, 200, 1100}, {386, 66, 257}};
    const int nsh = (int)(sizeof shapes / sizeof *shapes);
    ds4_error err;
    static const int32_t counts[] = {1, 3, 16}; /* 16: the many-thread cuts of the backward's products (cpu_gemm_seq.c) */
    for (size_t tc = 0; tc < sizeof counts / sizeof *counts; tc++) {
        const int32_t threads = counts[tc];
        ds4_pool *pool = NULL;
        CHECK_OK(ds4_pool_create(threads, &pool, &err), &err);
        float *ws = malloc((size_t)threads * DS4_GEMM_WS_FLOATS * sizeof(float));
        /* the forward's order, then the backward's (seq) */
        for (int seq = 0; seq < 2; seq++)
            for (int mode = 0; mode < 8; mode++) {
                const int ta = mode & 1, tb = (mode >> 1) & 1, acc = (mode >> 2) & 1;
                prob p[16];
                ds4_gemm g[16];
                for (int s = 0; s < nsh; s++) {
                    make(&p[s], shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, acc, seq);
                    g[s] = p[s].g;
                }
                /* one product per run, each shape with each register tile over the modes (the CPU's best where it
                 * lacks one), then all of them in one run */
                for (int s = 0; s < nsh; s++)
                    ds4_gemm_run_isa(pool, &g[s], 1, ws, (ds4_gemm_isa)((s + mode) % 3));
                for (int s = 0; s < nsh; s++) {
                    CHECK(!memcmp(p[s].y, p[s].want, (size_t)p[s].ysize * sizeof(float)),
                          "threads %d seq %d ta %d tb %d acc %d: %lld x %lld x %lld differs from the reference", threads,
                          seq, ta, tb, acc, (long long)shapes[s][0], (long long)shapes[s][1],
                          (long long)shapes[s][2]);
                    if (!acc) memset(p[s].y, 0xff, (size_t)p[s].ysize * sizeof(float)); /* NaN: must be overwritten */
                }
                if (!acc) {
                    /* the padding between rows of y was NaN-filled too: restore it from want before comparing */
                    for (int s = 0; s < nsh; s++)
                        for (int64_t i = 0; i < p[s].ysize; i++)
                            if ((i % g[s].ldy) >= g[s].N || i / g[s].ldy >= g[s].M) p[s].y[i] = p[s].want[i];
                    ds4_gemm_run(pool, g, nsh, ws);
                    for (int s = 0; s < nsh; s++)
                        CHECK(!memcmp(p[s].y, p[s].want, (size_t)p[s].ysize * sizeof(float)),
                              "threads %d seq %d ta %d tb %d: %lld x %lld x %lld in a joint run differs", threads,
                              seq, ta, tb, (long long)shapes[s][0], (long long)shapes[s][1],
                              (long long)shapes[s][2]);
                }
                for (int s = 0; s < nsh; s++) drop(&p[s]);
            }
        free(ws);
        ds4_pool_free(pool);
    }
    return ds4t_finish("test_gemm");
}
