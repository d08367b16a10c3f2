/* lanes8.h — 8 fp32 lanes for the CPU kernels (kernels_cpu.c, cpu_gemm.c, cpu_gemm_seq.c): loads, stores and the
 * fused multiply-add c + a·b rounded once, portable (fmaf lane by lane, slow, the same bits) or the AVX2 + FMA
 * instruction (fma8_hw, only inside functions compiled for that target: DS4_FMA_TARGET).
 *
 * GCC lowers the vector type to one AVX register or two SSE registers; ISO C mode (-std=c11) keeps fp-contract off,
 * so a plain a * b + c is never fused behind the code's back. Only fma8_hw is a function (always inlined, and only
 * called from functions of its own target); the rest are macros, so no 32-byte vector is ever passed by value
 * between functions of different targets. */
#ifndef DS4_LANES8_H
#define DS4_LANES8_H

#pragma GCC diagnostic ignored "-Wpsabi"

#include <math.h>
#include <string.h>

#include "kernels_cpu.h"

typedef float v8f __attribute__((vector_size(32)));

/* Loads, stores and the portable multiply-add are statement-expression macros, not functions: clang refuses any call
 * that returns or takes a 32-byte vector in a function compiled without AVX (the baseline tiles), inlined or not
 * ("AVX vector return ... changes the ABI"); a macro makes no call. */
#define ld8(p)                                                                                                       \
    ({                                                                                                             \
        v8f ld8_v_;                                                                                                \
        memcpy(&ld8_v_, (p), sizeof ld8_v_);                                                                       \
        ld8_v_;                                                                                                    \
    })

#define st8(p, v)                                                                                                    \
    ({                                                                                                             \
        const v8f st8_v_ = (v);                                                                                    \
        memcpy((p), &st8_v_, sizeof st8_v_);                                                                       \
        (void)0;                                                                                                   \
    })

/* x in every lane; a macro, not an inline function: inlined into an AVX2 function GCC builds such a helper's result
 * lane by lane instead of with one broadcast */
#define BCAST8(x) ((v8f){(x), (x), (x), (x), (x), (x), (x), (x)})

/* c + a·b lane by lane, each rounded once (fmaf): the FMA instruction's bits on any CPU */
#define fma8_soft(c, a, b)                                                                                           \
    ({                                                                                                             \
        const v8f f8c_ = (c), f8a_ = (a), f8b_ = (b);                                                              \
        v8f f8r_;                                                                                                  \
        for (int f8l_ = 0; f8l_ < 8; f8l_++) f8r_[f8l_] = fmaf(f8a_[f8l_], f8b_[f8l_], f8c_[f8l_]);                \
        f8r_;                                                                                                      \
    })

#ifdef DS4_X86_FMA
#include <immintrin.h>
#define DS4_FMA_TARGET __attribute__((target("avx2,fma")))
DS4_FMA_TARGET __attribute__((always_inline)) static inline v8f fma8_hw(v8f c, v8f a, v8f b) {
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#endif

#endif
