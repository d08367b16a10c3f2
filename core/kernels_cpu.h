/* kernels_cpu.h — the fp32 CPU kernels of the reference backend.
 *
 * Numerics: inputs and outputs are fp32; reductions that feed normalisations (RMSNorm statistics, softmax
 * sums, log-sum-exp) accumulate in double, which is at least as accurate as the fp32 reference they are
 * compared against. Matmul dot products accumulate in fp32 over 8 fixed lanes combined in a fixed order, each
 * lane adding its next product with a fused multiply-add (one rounding; the FMA instruction or the C library's
 * fmaf, which round alike), so a result does not depend on the instruction set or the thread count. No -ffast-math
 * anywhere: the compiler never fuses a multiply and an add by itself (ISO C mode keeps contraction off). */
#ifndef DS4_KERNELS_CPU_H
#define DS4_KERNELS_CPU_H

#include <stdint.h>
#include <math.h>

#include "threadpool.h"

/* An AVX2 clone of a function where the CPU has it, chosen once at load time (ifunc), for kernels whose clones compute
 * the same bits (elementwise IEEE operations, fixed reduction orders). Not under AddressSanitizer, whose instrumented
 * ifunc resolvers would run before it is initialised. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define DS4_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DS4_CLONES
#endif

/* x86-64 builds carry AVX2 + FMA versions of the dot-product kernels next to the portable ones. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define DS4_X86_FMA 1
#endif

/* 1 when this CPU runs the AVX2 + FMA kernels (a CPUID test, cheap enough to make per call). Either way the results
 * are the same bits: the portable kernels use fmaf. */
int ds4_cpu_fma(void);

/* y[t, o] = Σ_k x[t, k] · W[o, k]   (x: [T, K] row stride ldx; W: [O, K] contiguous; y: [T, O] row stride ldy), on
 * the calling thread (for small products inside a pool task; the backend's matmuls use ds4_gemm_run). */
void ds4_matmul_nt_serial(float *y, int64_t ldy, const float *x, int64_t ldx, const float *W, int64_t T,
                          int64_t K, int64_t O);

/* One matrix product for ds4_gemm_run: y[i·ldy + j] = s (acc: y[i·ldy + j] + s) for i < M, j < N, with
 * s = Σ_r A(i, r)·B(j, r) over r < R, A(i, r) = a[i·a_rs + r·a_ks], B(j, r) = b[j·b_rs + r·b_ks]: either operand may be
 * read along r (ks = 1) or across it (rs = 1, a transposed view). s is summed exactly as ds4_dot sums (eight lanes over
 * r < R & ~7 combined in a fixed tree, then the last R % 8 products in order), whatever the tiling and the thread count
 * (cpu_gemm.c). R = 0 gives s = 0. */
typedef struct ds4_gemm {
    float *y;
    int64_t ldy;
    const float *a;
    int64_t a_rs, a_ks;
    const float *b;
    int64_t b_rs, b_ks;
    int64_t M, N, R;
    int acc;
    /* B FP4-resident instead (b unused): B(j, r) is element j·b_rs + r·b_ks of the packed matrix with bytes bq and
     * scales bs (fp4.h), decoded into the packed panels tile by tile, never as a whole; the same sums, bit for bit, as
     * over the dequantised fp32 matrix. */
    const uint8_t *bq, *bs;
    /* seq: s summed in increasing r instead, one fused multiply-add per product onto a single running sum from +0
     * (cpu_gemm_seq.c): the linear backward's products, which need determinism and thread-count independence but
     * not the forward's batch invariance. Every problem of one run has the same seq. */
    int seq;
} ds4_gemm;

enum {
    DS4_GEMM_MR = 6,   /* A rows per register tile */
    DS4_GEMM_KC = 512, /* values of r per chunk */
    DS4_GEMM_MC = 48,  /* the largest tile: MC rows of A × NC rows of B */
    DS4_GEMM_NC = 64,
    DS4_GEMM_WS_HEAD = 16, /* floats of bookkeeping at the head of a thread's scratch */
    /* per-thread scratch: the head, packed A and B blocks, and the lane sums of a tile between chunks */
    DS4_GEMM_WS_FLOATS = DS4_GEMM_WS_HEAD + DS4_GEMM_MC * DS4_GEMM_KC + DS4_GEMM_NC * DS4_GEMM_KC +
                         DS4_GEMM_MC * DS4_GEMM_NC * 8
};

/* Run the n products (independent outputs) as one parallel job over their tiles; ws holds DS4_GEMM_WS_FLOATS floats
 * for each thread of the pool (pool NULL: the calling thread alone, one slot). */
void ds4_gemm_run(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws);

/* The register tiles ds4_gemm_run may use, in order: the portable one (fmaf lane by lane), the AVX2 + FMA one, the
 * AVX-512 one. All give the same bits; ds4_gemm_run takes the best the CPU runs, ds4_gemm_run_isa the best up to
 * `isa` (so tests can run each one the CPU has). */
typedef enum { DS4_GEMM_PORTABLE, DS4_GEMM_AVX2_FMA, DS4_GEMM_AVX512 } ds4_gemm_isa;
void ds4_gemm_run_isa(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws, ds4_gemm_isa isa);
/* For the schedulers of both kinds of run: ceil(a / b), and the problem of task t when problem p's tasks start at
 * first[p] (first[0] = 0, ascending). */
static inline int64_t ds4_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t ds4_gemm_problem_of(const int64_t *first, int64_t t) {
    int64_t p = 0;
    while (first[p + 1] <= t) p++;
    return p;
}

/* The threads worth splitting problems g[0..n) over: at most the pool's, and few enough that each gets about
 * DS4_GEMM_THREAD_WORK multiply-adds (a small product on many threads costs more in waking and joining them than its
 * work). Tiles and splits never change a product's bits, so neither does this. */
enum { DS4_GEMM_THREAD_WORK = 1 << 17 };
int64_t ds4_gemm_threads(ds4_pool *pool, const ds4_gemm *g, int64_t n);

/* The run of problems with seq set (ds4_gemm_run_isa hands them here; ws as there). */
void ds4_gemm_seq_run(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws, ds4_gemm_isa isa);

/* Σ_k a[k]·b[k] with the same 8-lane accumulation as the matmul: lane l = fma(a[k], b[k], lane l) for k ≡ l (mod 8),
 * k < n & ~7, in increasing k from +0; the lanes combined as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); then
 * s = fma(a[k], b[k], s) for the last n % 8 values of k. */
float ds4_dot(const float *a, const float *b, int64_t n);

/* y[i·ldy + k] = Σ_j x[i·ldx + j]·w[k][j] for i < nx, k < nw: the dots of nx rows with nw rows given by pointers
 * (attention keys), each summed as ds4_dot sums. */
void ds4_dots_ptr(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t nx, const float *const *w, int64_t nw,
                  int64_t K);

/* o[h·ldo + i] (+)= Σ_k p[h·ldp + k]·v[k][i] for h < nh, i < n (rows v[k] given by pointers), each element summed
 * in increasing k with fp32 adds onto +0 (acc = 0) or onto its value in o (acc = 1): exactly what zeroing o (or not)
 * and ds4_axpy(o_h, p[h][k], v[k], n) for k = 0, 1, .. give, without re-reading o for every k. */
void ds4_wsum_ptr(float *o, int64_t ldo, const float *p, int64_t ldp, int64_t nh, const float *const *v, int64_t nk,
                  int64_t n, int acc);

/* y[i] += a · x[i]. Vectorised across i only, so each element's arithmetic is the plain scalar one. */
void ds4_axpy(float *y, float a, const float *x, int64_t n);

/* Σ (w[i]·a[i])·b[i] in double (w NULL: Σ a[i]·b[i]), w[i]·a[i] rounded to fp32 first: 8 lanes (i ≡ l mod 8) for
 * i < n & ~7 combined as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the last n % 8 terms in order. The
 * sums of squares and dot products of the norms (ds4_rmsnorm_rows, the norm backward). */
double ds4_dot_f64(const float *w, const float *a, const float *b, int64_t n);

/* y = w ⊙ x / sqrt(mean(x²) + eps) for each of `rows` rows of width n (w may be NULL: unweighted).
 * y may alias x. mean(x²) is ds4_dot_f64(NULL, x, x, n) / n. */
void ds4_rmsnorm_rows(float *y, const float *x, const float *w, int64_t rows, int64_t n, double eps);

/* Interleaved RoPE on the trailing 2*half channels of a vector of width `width`: pair (x[a], x[a+1]) with
 * a = width - 2*half + 2i is rotated by the angle whose cos/sin are cs[2i], cs[2i+1]; sign = -1 applies
 * the inverse rotation (used to de-rotate the attention output). */
void ds4_rope_apply(float *x, int64_t width, int64_t half, const float *cs, int sign);

static inline float ds4_silu(float x) { return x / (1.0f + expf(-x)); }

#endif
