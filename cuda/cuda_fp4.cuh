// cuda_fp4.cuh — FP4-resident weights (core/fp4.h) as the device kernels read them: an element's e2m1 code and its
// block's e8m0 scale turned into the bits of the value, in registers, as a tile is loaded; nothing is expanded in
// memory.
//
// Element i of a packed weight is nibble (i & 1) of q[i >> 1] (element 2j low, 2j+1 high) times 2^(s[i >> 5] - 127).
// Every such value is a bf16 number: an e2m1 value has at most two significant bits, and the scale only moves the
// exponent; bf16 has fp32's exponent range, subnormals included, so even 0.5 · 2^-127 = 2^-128 is exact (bf16's
// smallest subnormal is 2^-133). Values past the range (2 · 2^127 and up, scale 254 or 253 with the large codes) are
// infinite, as the fp32 product core/fp4.h forms. So the bf16 bits built here are exactly the bits a dequantised fp32
// weight rounds to in bf16 (ds4_f32_to_bf16 of an exact value), and, shifted up 16 bits, exactly the fp32 value: the
// bf16 and fp32 kernels reading an FP4-resident weight compute what they compute on the dequantised weight, bit for
// bit. (Scale 255, NaN, is refused when the checkpoint is loaded.) Built from integer fields, never a float multiply,
// so no flush-to-zero mode can touch the subnormals.
#ifndef DS4_CUDA_FP4_CUH
#define DS4_CUDA_FP4_CUH

#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>

// The bf16 bits of e2m1 code c (0..15) times 2^(s - 127), s an e8m0 byte < 255.
__device__ __forceinline__ uint32_t ds4d_fp4_bf16(uint32_t c, uint32_t s) {
    const uint32_t mag = c & 7u, sign = (c & 8u) << 12;
    if (mag == 0u) return sign; // ±0 (code 8 is -0.0)
    // mag 1 is 0.5 = 1.0 · 2^-1; mag 2..7 are (1 + m/2) · 2^((mag >> 1) - 1), m = mag & 1: the biased exponent E of
    // the product and its one mantissa bit
    const int32_t E = (int32_t)s + (int32_t)(mag >> 1) - 1;
    const uint32_t m = mag > 1u ? (mag & 1u) : 0u;
    uint32_t bits;
    if (E >= 255) bits = 0x7F80u;                          // past bf16's (and fp32's) range: infinity
    else if (E >= 1) bits = ((uint32_t)E << 7) | (m << 6); // normal
    else bits = (2u + m) << (E + 5);                       // E in {-1, 0}: (2 + m) · 2^(E - 128) in units of 2^-133
    return sign | bits;
}

// A packed weight read as elements of type T (float or __nv_bfloat16), from element e0 on: it takes the place of a
// `const T *` in the kernels (W + n, W[i]), so a kernel templated on its weight's type reads either without changing
// its arithmetic.
template <typename T>
struct ds4d_fp4w {
    const uint8_t *q, *s; // the codes (two per byte) and the scales (one per 32 elements) of element 0
    int64_t e0;
    __device__ __forceinline__ ds4d_fp4w operator+(int64_t n) const { return {q, s, e0 + n}; }
    __device__ __forceinline__ uint32_t bits(int64_t i) const {
        const int64_t e = e0 + i;
        const uint32_t b = __ldg(q + (e >> 1));
        return ds4d_fp4_bf16((e & 1) ? b >> 4 : b & 15u, __ldg(s + (e >> 5)));
    }
    __device__ __forceinline__ T operator[](int64_t i) const;
};

template <>
__device__ __forceinline__ float ds4d_fp4w<float>::operator[](int64_t i) const {
    return __uint_as_float(bits(i) << 16);
}
template <>
__device__ __forceinline__ __nv_bfloat16 ds4d_fp4w<__nv_bfloat16>::operator[](int64_t i) const {
    return __ushort_as_bfloat16((unsigned short)bits(i));
}
template <>
__device__ __forceinline__ unsigned short ds4d_fp4w<unsigned short>::operator[](int64_t i) const {
    return (unsigned short)bits(i);
}

// The 8 elements i .. i+7 as 4 words of two bf16 (element 2j in the low half of word j), i a multiple of 8 and q
// 4-byte aligned: one 32-bit load of codes and one scale (the 8 lie in one block of 32).
template <typename T>
__device__ __forceinline__ void ds4d_fp4_bf16x8(const ds4d_fp4w<T> &w, int64_t i, uint32_t (&out)[4]) {
    const int64_t e = w.e0 + i;
    const uint32_t c = __ldg(reinterpret_cast<const unsigned int *>(w.q + (e >> 1)));
    const uint32_t s = __ldg(w.s + (e >> 5));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t b = c >> (8 * j);
        out[j] = ds4d_fp4_bf16(b & 15u, s) | (ds4d_fp4_bf16((b >> 4) & 15u, s) << 16);
    }
}

// A kernel's weight of type WT from an operation's (W, Ws): the pointer W (fp32 or bf16 values; Ws unused), or the
// packed weight W (codes) with scales Ws from element 0 on. ds4d_elem<WT>::type: the type an element reads as.
template <typename WT>
struct ds4d_wcast {
    static __device__ __forceinline__ WT of(const void *w, const uint8_t *) { return (WT)w; }
};
template <typename T>
struct ds4d_wcast<ds4d_fp4w<T>> {
    static __device__ __forceinline__ ds4d_fp4w<T> of(const void *w, const uint8_t *s) {
        return {(const uint8_t *)w, s, 0};
    }
};
template <typename WT>
__device__ __forceinline__ WT ds4d_weight(const void *w, const uint8_t *s) {
    return ds4d_wcast<WT>::of(w, s);
}
template <typename WT>
struct ds4d_elem {
    using type = typename std::remove_cv<typename std::remove_pointer<WT>::type>::type;
};
template <typename T>
struct ds4d_elem<ds4d_fp4w<T>> {
    using type = T;
};

#endif
