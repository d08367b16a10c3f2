// cuda_kv_qat.cuh — the quantisation-aware option's arithmetic on the GPU (docs/architecture.md, "FP8 KV
// quantisation-aware training"): the device twins of core/fake_quant.c, used by the fake_quant operation
// (cuda_kv_qat.cu) and by the compressor's pooling (cuda_attn.cu), which rounds each entry where it is made.
//
// Every function repeats its CPU definition operation for operation, in fp32, with the _rn intrinsics (round to
// nearest even, never contracted into FMAs, never replaced by approximations) and the math library's exact functions
// (frexpf, ldexpf, rintf: 0 ulp on the device, as in the C library). The only operations that round are the scale's
// division by the format's largest value, the Hadamard butterflies and its 1/sqrt(n) factor, each correctly rounded on
// both sides; everything else is exact arithmetic on powers of two. So the GPU gives the CPU's bits for the same
// input (NaN: both NaN, their bit patterns may differ).
#ifndef DS4_CUDA_KV_QAT_CUH
#define DS4_CUDA_KV_QAT_CUH

#include <cstdint>
#include <cuda_runtime.h>

extern "C" {
#include "fake_quant.h"
}

__device__ __forceinline__ float ds4d_fq_top(int32_t fmt) { return fmt == DS4_FQ_E4M3 ? 448.0f : 6.0f; }
// ds4_fq_block: channels per scale block (0: no rounding)
__device__ __forceinline__ int64_t ds4d_fq_block(int32_t fmt) { return fmt == DS4_FQ_E4M3 ? 64 : fmt == DS4_FQ_E2M1 ? 32 : 0; }

// ds4_fq_scale: 2^ceil(log2(max(amax, floor) / top)); NaN for a NaN or infinite amax.
__device__ __forceinline__ float ds4d_fq_scale(float amax, int32_t fmt) {
    if (isnan(amax) || isinf(amax)) return __int_as_float(0x7fc00000);
    const float floor_ = fmt == DS4_FQ_E4M3 ? 1e-4f : 6.0f * 0x1p-126f;
    const float s = __fdiv_rn(amax > floor_ ? amax : floor_, ds4d_fq_top(fmt));
    int e;
    const float m = frexpf(s, &e);
    return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// ds4_fq_round: v clamped to ±top and rounded to the nearest value of the format, ties to the even mantissa.
__device__ __forceinline__ float ds4d_fq_round(float v, int32_t fmt) {
    const float top = ds4d_fq_top(fmt), a = fabsf(v);
    if (isnan(v)) return v;
    if (a >= top) return v < 0 ? -top : top;
    const int mbits = fmt == DS4_FQ_E4M3 ? 3 : 1, emin = fmt == DS4_FQ_E4M3 ? -6 : 0;
    int e;
    frexpf(a, &e);
    e -= 1;
    if (e < emin) e = emin;
    const float quantum = ldexpf(1.0f, e - mbits);
    const float r = __fmul_rn(rintf(__fdiv_rn(a, quantum)), quantum);
    return v < 0 ? -r : r;
}

// ds4_fake_quant_row on one vector of `width` floats at x (shared or global memory), by every thread of the block
// together (call it from all of them; it ends with a barrier). The rotation's butterflies of one level are
// independent, so threads share them out; the levels run in the CPU's order, one barrier apart. Each scale block's
// largest magnitude is found by one thread in the CPU's order (a maximum does not depend on the order anyway, and a
// NaN wins either way), then its values rounded.
__device__ inline void ds4d_fake_quant_vec(float *x, int64_t width, const ds4_fq &q) {
    if (q.hadamard) {
        for (int64_t h = 1; h < width; h *= 2) {
            for (int64_t k = threadIdx.x; k < width / 2; k += blockDim.x) {
                const int64_t j = (k / h) * 2 * h + k % h; // butterfly k of this level: pairs (j, j + h)
                const float a = x[j], b = x[j + h];
                x[j] = __fadd_rn(a, b);
                x[j + h] = __fsub_rn(a, b);
            }
            __syncthreads();
        }
        const float s = __fdiv_rn(1.0f, __fsqrt_rn((float)width));
        for (int64_t i = threadIdx.x; i < width; i += blockDim.x) x[i] = __fmul_rn(x[i], s);
        __syncthreads();
    }
    const int64_t bs = ds4d_fq_block(q.fmt), nq = q.nq < width ? q.nq : width;
    if (!bs) return;
    for (int64_t b0 = (int64_t)threadIdx.x * bs; b0 < nq; b0 += (int64_t)blockDim.x * bs) {
        const int64_t b1 = b0 + bs < nq ? b0 + bs : nq;
        float amax = 0;
        for (int64_t i = b0; i < b1; i++) {
            const float a = fabsf(x[i]);
            amax = a > amax || isnan(a) ? a : amax;
            if (isnan(amax)) break;
        }
        const float s = ds4d_fq_scale(amax, q.fmt);
        for (int64_t i = b0; i < b1; i++) x[i] = __fmul_rn(ds4d_fq_round(__fdiv_rn(x[i], s), q.fmt), s);
    }
    __syncthreads();
}

#endif
