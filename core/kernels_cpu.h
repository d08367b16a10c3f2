/* kernels_cpu.h — the fp32 CPU kernels of the reference backend.
 *
 * Numerics: inputs and outputs are fp32; reductions that feed normalisations (RMSNorm statistics, softmax
 * sums, log-sum-exp) accumulate in double, which is at least as accurate as the fp32 reference they are
 * compared against. Matmul dot products accumulate in fp32 over 8 fixed lanes combined in a fixed order, so
 * a result does not depend on the instruction set or the thread count. No -ffast-math anywhere. */
#ifndef DS4_KERNELS_CPU_H
#define DS4_KERNELS_CPU_H

#include <stdint.h>
#include <math.h>

#include "threadpool.h"

/* y[t, o] = Σ_k x[t, k] · W[o, k]   (x: [T, K] row stride ldx; W: [O, K] contiguous; y: [T, O] row stride ldy).
 * Threaded over (token block, output block) tiles of the pool. */
void ds4_matmul_nt(ds4_pool *pool, float *y, int64_t ldy, const float *x, int64_t ldx, const float *W, int64_t T,
                   int64_t K, int64_t O);
/* Same on the calling thread only (for use inside a pool task). */
void ds4_matmul_nt_serial(float *y, int64_t ldy, const float *x, int64_t ldx, const float *W, int64_t T,
                          int64_t K, int64_t O);

/* Σ_k a[k]·b[k] with the same 8-lane accumulation as the matmul. */
float ds4_dot(const float *a, const float *b, int64_t n);

/* y[i] += a · x[i]. Vectorised across i only, so each element's arithmetic is the plain scalar one. */
void ds4_axpy(float *y, float a, const float *x, int64_t n);

/* y = w ⊙ x / sqrt(mean(x²) + eps) for each of `rows` rows of width n (w may be NULL: unweighted).
 * y may alias x. */
void ds4_rmsnorm_rows(float *y, const float *x, const float *w, int64_t rows, int64_t n, double eps);

/* Interleaved RoPE on the trailing 2*half channels of a vector of width `width`: pair (x[a], x[a+1]) with
 * a = width - 2*half + 2i is rotated by the angle whose cos/sin are cs[2i], cs[2i+1]; sign = -1 applies
 * the inverse rotation (used to de-rotate the attention output). */
void ds4_rope_apply(float *x, int64_t width, int64_t half, const float *cs, int sign);

static inline float ds4_silu(float x) { return x / (1.0f + expf(-x)); }

#endif
