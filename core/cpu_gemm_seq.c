/* cpu_gemm_seq.c — the matrix products of the linear backward (ds4_gemm.seq): y[i, j] = s (or y + s) with
 * s = fma(A(i, R-1), B(j, R-1), ... fma(A(i, 1), B(j, 1), fma(A(i, 0), B(j, 0), +0))): the products of increasing r,
 * each fused into one running sum. The backward needs determinism and independence from the thread count, not the
 * forward's batch invariance (docs/design.md), so it need not keep the forward's 8 lanes along r; summing along r one
 * product at a time lets a register tile hold outputs side by side along j, read B where it lies (B(j..j+W, r) is
 * contiguous in every backward product: W's rows for dx = dy W, x's rows for dW += dyᵀ x) and A one value at a
 * time, with no transposed copies and no lane sums to finish.
 *
 * Work: a task owns a run of rows × a group of columns (2D blocks, cut by seq_cost: each task streams its rows of A
 * and its columns of B over all of r, so thin tasks re-read the large operand many times); it walks r in chunks of
 * SKC, and within a chunk its columns SC at a time (B's block of the chunk stays in cache for all its rows, the rows'
 * chunk of A for all its column blocks); each register tile (SR rows × W columns) carries its running sums across
 * chunks in the worker's scratch. Every output's sum is one chain in one task, so tiles, chunks and threads never change its
 * bits. Where B's block cannot be read in place (columns past N in a tile, B read along r, FP4-resident B) the chunk
 * is copied into a zero-padded panel first; padded columns and rows give sums that are never written. */
#include <math.h>
#include <string.h>

#include "fp4.h"
#include "kernels_cpu.h"
#include "lanes8.h"

enum {
    SR = 6,                      /* rows per register tile */
    SC = DS4_GEMM_NC,            /* columns per task */
    SKC = 256,                   /* values of r per chunk */
    SROWS = 64 * SR,             /* rows per task at most */
    ST_FLOATS = DS4_GEMM_WS_FLOATS - SKC * SC, /* a task's running sums at most: rows × columns */
};

/* The worker's scratch: a task's running sums [rows][columns], then B's panel [SKC][SC]. */
_Static_assert(SROWS * SC <= ST_FLOATS, "gemm scratch too small for the sequential products");

/* One register tile: rows q < SR (row q's value of step k at a[q][k·aks]) × W columns of B (b[k·bks + c]), over nr
 * steps; the running sums of row q at st + q·ldst (read unless first, written back). */
typedef void (*seq_tile_fn)(const float *const *a, int64_t aks, const float *b, int64_t bks, int64_t nr, int first,
                            float *st, int64_t ldst);

/* 6 rows × 16 columns in 12 vectors of 8: 2 loads of B and 6 of A per 12 fused multiply-adds. */
#define SEQ_ROW16(q, FMA8)                                                                                          \
    {                                                                                                              \
        const float x = a##q[o];                                                                                   \
        const v8f v = BCAST8(x);                                                                                   \
        c##q##0 = FMA8(c##q##0, v, u0), c##q##1 = FMA8(c##q##1, v, u1);                                            \
    }
#define SEQ_TILE16(FMA8)                                                                                            \
    v8f c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;                                                \
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = (v8f){0};                              \
    if (!first) {                                                                                                  \
        c00 = ld8(st), c01 = ld8(st + 8), c10 = ld8(st + ldst), c11 = ld8(st + ldst + 8);                          \
        c20 = ld8(st + 2 * ldst), c21 = ld8(st + 2 * ldst + 8), c30 = ld8(st + 3 * ldst);                          \
        c31 = ld8(st + 3 * ldst + 8), c40 = ld8(st + 4 * ldst), c41 = ld8(st + 4 * ldst + 8);                      \
        c50 = ld8(st + 5 * ldst), c51 = ld8(st + 5 * ldst + 8);                                                    \
    }                                                                                                              \
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];                            \
    for (int64_t k = 0, o = 0; k < nr; k++, o += aks, b += bks) {                                                  \
        const v8f u0 = ld8(b), u1 = ld8(b + 8);                                                                    \
        SEQ_ROW16(0, FMA8) SEQ_ROW16(1, FMA8) SEQ_ROW16(2, FMA8) SEQ_ROW16(3, FMA8) SEQ_ROW16(4, FMA8)              \
        SEQ_ROW16(5, FMA8)                                                                                         \
    }                                                                                                              \
    st8(st, c00), st8(st + 8, c01), st8(st + ldst, c10), st8(st + ldst + 8, c11), st8(st + 2 * ldst, c20);         \
    st8(st + 2 * ldst + 8, c21), st8(st + 3 * ldst, c30), st8(st + 3 * ldst + 8, c31), st8(st + 4 * ldst, c40);    \
    st8(st + 4 * ldst + 8, c41), st8(st + 5 * ldst, c50), st8(st + 5 * ldst + 8, c51);

static void seq_tile16(const float *const *a, int64_t aks, const float *b, int64_t bks, int64_t nr, int first,
                       float *st, int64_t ldst) {
    SEQ_TILE16(fma8_soft)
}

#ifdef DS4_X86_FMA
DS4_FMA_TARGET static void seq_tile16_fma(const float *const *a, int64_t aks, const float *b, int64_t bks, int64_t nr,
                                          int first, float *st, int64_t ldst) {
    SEQ_TILE16(fma8_hw)
}

/* 6 rows × 64 columns in 24 registers of 16: 4 loads of B and 6 broadcasts of A per 24 fused multiply-adds. */
#define SEQ_ROW64(q)                                                                                                \
    {                                                                                                              \
        const __m512 v = _mm512_set1_ps(a##q[o]);                                                                  \
        c##q##0 = _mm512_fmadd_ps(v, u0, c##q##0), c##q##1 = _mm512_fmadd_ps(v, u1, c##q##1);                      \
        c##q##2 = _mm512_fmadd_ps(v, u2, c##q##2), c##q##3 = _mm512_fmadd_ps(v, u3, c##q##3);                      \
    }
#define SEQ_IO(X, q) X(q, 0), X(q, 1), X(q, 2), X(q, 3)
#define SEQ_LOAD(q, p) c##q##p = first ? _mm512_setzero_ps() : _mm512_loadu_ps(st + (q) * ldst + 16 * (p))
#define SEQ_STORE(q, p) _mm512_storeu_ps(st + (q) * ldst + 16 * (p), c##q##p)
__attribute__((target("avx512f,avx2,fma"))) static void seq_tile64_avx512(const float *const *a, int64_t aks,
                                                                         const float *b, int64_t bks, int64_t nr,
                                                                         int first, float *st, int64_t ldst) {
    __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23;
    __m512 c30, c31, c32, c33, c40, c41, c42, c43, c50, c51, c52, c53;
    SEQ_IO(SEQ_LOAD, 0), SEQ_IO(SEQ_LOAD, 1), SEQ_IO(SEQ_LOAD, 2);
    SEQ_IO(SEQ_LOAD, 3), SEQ_IO(SEQ_LOAD, 4), SEQ_IO(SEQ_LOAD, 5);
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0, o = 0; k < nr; k++, o += aks, b += bks) {
        const __m512 u0 = _mm512_loadu_ps(b), u1 = _mm512_loadu_ps(b + 16);
        const __m512 u2 = _mm512_loadu_ps(b + 32), u3 = _mm512_loadu_ps(b + 48);
        SEQ_ROW64(0) SEQ_ROW64(1) SEQ_ROW64(2) SEQ_ROW64(3) SEQ_ROW64(4) SEQ_ROW64(5)
    }
    SEQ_IO(SEQ_STORE, 0), SEQ_IO(SEQ_STORE, 1), SEQ_IO(SEQ_STORE, 2);
    SEQ_IO(SEQ_STORE, 3), SEQ_IO(SEQ_STORE, 4), SEQ_IO(SEQ_STORE, 5);
}
#endif

typedef struct {
    seq_tile_fn tile;
    int64_t width; /* W: columns per register tile */
} seq_kernel;

static seq_kernel pick(ds4_gemm_isa isa) {
#ifdef DS4_X86_FMA
    if (isa >= DS4_GEMM_AVX2_FMA && ds4_cpu_fma()) {
        __builtin_cpu_init();
        if (isa >= DS4_GEMM_AVX512 && __builtin_cpu_supports("avx512f")) return (seq_kernel){seq_tile64_avx512, 64};
        return (seq_kernel){seq_tile16_fma, 16};
    }
#endif
    (void)isa;
    return (seq_kernel){seq_tile16, 16};
}

/* B(j0 + c, r0 + k) for c < n, k < nr into panel[k·SC + c], zero up to column npad. */
static void pack_panel(float *panel, const ds4_gemm *g, int64_t j0, int64_t n, int64_t npad, int64_t r0, int64_t nr) {
    for (int64_t k = 0; k < nr; k++) {
        float *d = panel + k * SC;
        const int64_t r = r0 + k;
        if (g->bq && g->b_rs == 1) ds4_fp4_decode(d, g->bq, g->bs, r * g->b_ks + j0, n);
        else if (g->bq)
            for (int64_t c = 0; c < n; c++) d[c] = ds4_fp4_at(g->bq, g->bs, (j0 + c) * g->b_rs + r * g->b_ks);
        else if (g->b_rs == 1) memcpy(d, g->b + r * g->b_ks + j0, (size_t)n * sizeof(float));
        else
            for (int64_t c = 0; c < n; c++) d[c] = g->b[(j0 + c) * g->b_rs + r * g->b_ks];
        memset(d + n, 0, (size_t)(npad - n) * sizeof(float));
    }
}

/* y = s or y + s (elementwise fp32 adds, 8 at a time) */
DS4_CLONES
static void finish_row(float *y, const float *s, int64_t n, int acc) {
    if (!acc) {
        memcpy(y, s, (size_t)n * sizeof(float));
        return;
    }
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) st8(y + c, ld8(y + c) + ld8(s + c));
    for (; c < n; c++) y[c] = y[c] + s[c];
}

/* Rows [i0, i0 + m) × columns [j0, j0 + n) of g, their running sums ldst floats apart (m·ldst <= ST_FLOATS); ws:
 * the worker's scratch. Within a chunk of r the columns go SC at a time (B's block of the chunk stays in L1/L2 while
 * every row tile passes it), and the rows' chunk of A stays in L2 while the column blocks pass it: a task wide in
 * both directions reads each of A and B from memory once per chunk. */
static void seq_block(const ds4_gemm *g, int64_t i0, int64_t m, int64_t j0, int64_t n, int64_t ldst, float *ws,
                      seq_kernel k) {
    float *st = ws, *panel = ws + ST_FLOATS;
    const int64_t R = g->R, W = k.width;
    if (R == 0) memset(st, 0, (size_t)(m * ldst) * sizeof(float)); /* the sum of no products: +0 */
    for (int64_t r0 = 0; r0 < R; r0 += SKC) {
        const int64_t nr = R - r0 < SKC ? R - r0 : SKC;
        for (int64_t cb = 0; cb < n; cb += SC) {
            const int64_t nb = n - cb < SC ? n - cb : SC, npad = (nb + W - 1) / W * W;
            const float *b = g->b ? g->b + r0 * g->b_ks + j0 + cb : NULL;
            int64_t bks = g->b_ks;
            if (g->bq || g->b_rs != 1 || nb != npad) {
                pack_panel(panel, g, j0 + cb, nb, npad, r0, nr);
                b = panel, bks = SC;
            }
            for (int64_t it = 0; it < m; it += SR) {
                const float *a[SR];
                for (int64_t q = 0; q < SR; q++) /* rows past m read row m - 1: sums that are never written */
                    a[q] = g->a + (i0 + (it + q < m ? it + q : m - 1)) * g->a_rs + r0 * g->a_ks;
                for (int64_t c = 0; c < npad; c += W)
                    k.tile(a, g->a_ks, b + c, bks, nr, r0 == 0, st + it * ldst + cb + c, ldst);
            }
        }
    }
    for (int64_t i = 0; i < m; i++) finish_row(g->y + (i0 + i) * g->ldy + j0, st + i * ldst, n, g->acc);
}

typedef struct {
    const ds4_gemm *g;
    int64_t *first; /* [n + 1] first task of each problem */
    int64_t run;    /* rows per task */
    int64_t cols;   /* columns per task: a multiple of SC */
    float *ws;
    seq_kernel k;
} seq_job;

/* Task t: problem p, then row runs major, column groups minor (consecutive tasks share A's rows, the larger operand
 * where A is the head's logit gradient). */
static void seq_task(void *ctx, int64_t t, int32_t worker) {
    const seq_job *j = ctx;
    const int64_t p = ds4_gemm_problem_of(j->first, t);
    const ds4_gemm *g = &j->g[p];
    const int64_t nbj = ds4_cdiv(g->N, j->cols), u = t - j->first[p], i0 = (u / nbj) * j->run;
    const int64_t j0 = (u % nbj) * j->cols;
    seq_block(g, i0, g->M - i0 < j->run ? g->M - i0 : j->run, j0, g->N - j0 < j->cols ? g->N - j0 : j->cols, j->cols,
              j->ws + (int64_t)worker * DS4_GEMM_WS_FLOATS, j->k);
}

/* What a task's reading of its operands costs, in multiply-adds' worth per row of A or column of B and value of r:
 * each task streams its rows of A and its columns of B over all of r (a column group re-reads A's rows, a row run
 * re-reads B's columns), about 32 MB each for the LM head, far more than L2 holds. Fitted on one core (AMD EPYC,
 * Zen 4) to the head's dx, 512 × 512 outputs over r = 16000, in tasks of rows × columns (ms of CPU, the same split
 * run in order on one thread): 48 × 64 150-170, 66 × 64 132-145, 66 × 128 118-122, 132 × 128 99-106, 258 × 192 86-88;
 * an overhead of about 26·(1/rows + 1/columns) over the multiply-adds alone. 32: 16 cores share the memory. */
enum { LAMBDA = 32 };

/* The estimated time of running problems g[0..n) in tasks of run rows × cols columns on `threads` threads: each
 * task's multiply-adds plus LAMBDA·(rows + columns) per value of r, the tasks dealt evenly, plus half of the largest
 * task (the last task of a job decides when it ends); on one thread the sum of the tasks. */
static double seq_cost(const ds4_gemm *g, int64_t n, int64_t run, int64_t cols, int64_t threads, int64_t *tasks) {
    double total = 0, largest = 0;
    *tasks = 0;
    for (int64_t p = 0; p < n; p++) {
        if (g[p].M <= 0 || g[p].N <= 0) continue;
        const int64_t nbi = ds4_cdiv(g[p].M, run), nbj = ds4_cdiv(g[p].N, cols), R = g[p].R > 0 ? g[p].R : 1;
        const int64_t m = g[p].M < run ? g[p].M : run, c = g[p].N < cols ? g[p].N : cols;
        const double big = (double)R * (double)(m * c + LAMBDA * (m + c));
        total += (double)R * ((double)g[p].M * (double)g[p].N + (double)LAMBDA * (double)(g[p].M * nbj + g[p].N * nbi));
        largest = big > largest ? big : largest;
        *tasks += nbi * nbj;
    }
    if (threads <= 1) return total;
    return ((double)ds4_cdiv(*tasks, threads) + 0.5) * largest;
}

void ds4_gemm_seq_run(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws, ds4_gemm_isa isa) {
    enum { MAX_PROBLEMS = 256, MAX_RUNS = 64 };
    int64_t first[MAX_PROBLEMS + 1];
    for (int64_t p0 = 0; p0 < n; p0 += MAX_PROBLEMS) {
        const int64_t cnt = n - p0 < MAX_PROBLEMS ? n - p0 : MAX_PROBLEMS;
        const int64_t threads = ds4_gemm_threads(pool, g + p0, cnt);
        int64_t Mx = 1, Nx = 1;
        for (int64_t p = 0; p < cnt; p++) {
            Mx = g[p0 + p].M > Mx ? g[p0 + p].M : Mx;
            Nx = g[p0 + p].N > Nx ? g[p0 + p].N : Nx;
        }
        /* Tasks of run rows × cols columns: the largest problem cut into nbi even runs (multiples of SR rows) and nbj
         * even column groups (multiples of SC), the cut seq_cost rates fastest. Each task streams A's rows and B's
         * columns over all of r once, so wide tasks in both directions read least; enough of them keep the threads
         * busy. Every output's sum is one chain in one task whatever the cut, so the cut never changes a bit. */
        int64_t run = SR, cols = SC;
        double best = -1;
        for (int64_t nbj = 1; nbj <= ds4_cdiv(Nx, SC); nbj++) {
            const int64_t c = SC * ds4_cdiv(ds4_cdiv(Nx, nbj), SC);
            if (nbj > 1 && c == SC * ds4_cdiv(ds4_cdiv(Nx, nbj - 1), SC)) continue; /* the same cut */
            for (int64_t nbi = 1; nbi <= MAX_RUNS; nbi++) {
                const int64_t r = SR * ds4_cdiv(ds4_cdiv(Mx, nbi), SR);
                if (r > SROWS || r * c > ST_FLOATS) continue;
                int64_t tasks;
                const double cost = seq_cost(g + p0, cnt, r, c, threads, &tasks);
                if (best < 0 || cost < best) best = cost, run = r, cols = c;
                if (r == SR) break;
            }
        }
        first[0] = 0;
        for (int64_t p = 0; p < cnt; p++) {
            const ds4_gemm *q = &g[p0 + p];
            first[p + 1] = first[p] + (q->M > 0 && q->N > 0 ? ds4_cdiv(q->M, run) * ds4_cdiv(q->N, cols) : 0);
        }
        seq_job j = {g + p0, first, run, cols, ws, pick(isa)};
        if (pool) ds4_pool_run_worker_on(pool, first[cnt], (int32_t)threads, seq_task, &j);
        else
            for (int64_t t = 0; t < first[cnt]; t++) seq_task(&j, t, 0);
    }
}
