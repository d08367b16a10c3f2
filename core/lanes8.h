/* lanes8.h — 8 fp32 lanes for the CPU kernels (kernels_cpu.c, cpu_gemm.c, cpu_gemm_seq.c): loads, stores and the
 * fused multiply-add c + a·b rounded once, portable (fmaf lane by lane, slow, the same bits) or the AVX2 + FMA
 * instruction (fma8_hw, only inside functions compiled for that target: DS4_FMA_TARGET).
 *
 * GCC lowers the vector type to one AVX register or two SSE registers; ISO C mode (-std=c11) keeps fp-contract off,
 * so a plain a * b + c is never fused behind the code's back. The helpers are static inline and always inlined, so
 * the ABI note about passing 32-byte vectors by value without AVX does not apply to them (at -O0 an out-of-line
 * baseline helper called from an AVX2 function would disagree with it on how vectors are passed). */
#ifndef DS4_LANES8_H
#define DS4_LANES8_H

#pragma GCC diagnostic ignored "-Wpsabi"

#include <math.h>
#include <string.h>

#include "kernels_cpu.h"

typedef float v8f __attribute__((vector_size(32)));

__attribute__((always_inline)) static inline v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

__attribute__((always_inline)) static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* x in every lane; a macro, not an inline function: inlined into an AVX2 function GCC builds such a helper's result
 * lane by lane instead of with one broadcast */
#define BCAST8(x) ((v8f){(x), (x), (x), (x), (x), (x), (x), (x)})

__attribute__((always_inline)) static inline v8f fma8_soft(v8f c, v8f a, v8f b) {
    v8f r;
    for (int l = 0; l < 8; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
}

#ifdef DS4_X86_FMA
#include <immintrin.h>
#define DS4_FMA_TARGET __attribute__((target("avx2,fma")))
DS4_FMA_TARGET __attribute__((always_inline)) static inline v8f fma8_hw(v8f c, v8f a, v8f b) {
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#endif

#endif
