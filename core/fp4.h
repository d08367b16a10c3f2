/* fp4.h — decoding the FP4-resident form of a weight (docs/checkpoints.md, "FP4-resident experts"): the packed
 * e2m1 pairs and e8m0 scales of an FP4 checkpoint tensor, kept as they were stored.
 *
 * A matrix of n elements (row-major, rows a multiple of 32 values long) is n/2 bytes q and n/32 scale bytes s;
 * element i is the e2m1 code in nibble (i & 1) of q[i >> 1] (element 2j low, 2j+1 high) times 2^(s[i >> 5] - 127).
 * Because a row's length is a multiple of 32, this flat indexing is the same as the [rows, cols/2] / [rows, cols/32]
 * layout of the checkpoint, and the matrices of consecutive experts continue it.
 *
 * Every decoded value is the fp32 product quant.c's dequantisation computes (e2m1 value times the e8m0 scale, one
 * fp32 multiply, exact), so a product over decoded tiles has the bits of the same product over the dequantised
 * fp32 matrix. */
#ifndef DS4_FP4_H
#define DS4_FP4_H

#include <stdint.h>
#include <string.h>

#include "ds4.h"
#include "quant.h" /* DS4_FP4_BLOCK: values per scale, 32 (the shifts by 5 below) */

/* The dtype of an FP4-resident weight: a table entry's (ds4_param.dtype) and an operation's wdt, never a tensor's
 * (safetensors has no such dtype; its bytes are saved as U8 with an F8_E8M0 scale tensor). */
#define DS4_FP4_PACKED ((ds4_dtype)(DS4_DTYPE_COUNT + 1))

/* A weight dtype's name for messages (ds4_dtype_name knows only the tensor dtypes). */
static inline const char *ds4_wdt_name(ds4_dtype t) {
    return t == DS4_FP4_PACKED ? "FP4 (packed e2m1 + e8m0 scales)" : ds4_dtype_name(t);
}

/* e2m1 codes 0..15 as floats; code 8 is -0.0 (docs/checkpoints.md) */
static const float ds4_fp4_lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(b - 127) for an e8m0 byte b < 255, built from its bits: b >= 1 is the normal float with exponent field b, and
 * b = 0 is 2^-127, the subnormal with only mantissa bit 22 set. The same value as ldexpf(1, b - 127). */
static inline float ds4_e8m0_value(uint8_t b) {
    const uint32_t bits = b ? (uint32_t)b << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float ds4_fp4_at(const uint8_t *q, const uint8_t *s, int64_t i) {
    const uint8_t byte = q[i >> 1];
    return ds4_fp4_lut[(i & 1) ? byte >> 4 : byte & 15u] * ds4_e8m0_value(s[i >> 5]);
}

/* out[k] = element e0 + k of the packed matrix (q, s), k < n. Whole bytes (two values) at a time under one scale per
 * 32-value block; an odd first or last element alone. */
static inline void ds4_fp4_decode(float *out, const uint8_t *q, const uint8_t *s, int64_t e0, int64_t n) {
    int64_t k = 0;
    if (n > 0 && (e0 & 1)) out[k++] = ds4_fp4_at(q, s, e0);
    while (k + 1 < n) { /* e0 + k is even here, and so is every block's end */
        const int64_t e = e0 + k, end = (((e >> 5) + 1) << 5) - e0, stop = end < n ? end : n;
        const float sc = ds4_e8m0_value(s[e >> 5]);
        const uint8_t *b = q + (e >> 1);
        for (; k + 1 < stop; k += 2, b++) {
            out[k] = ds4_fp4_lut[*b & 15u] * sc;
            out[k + 1] = ds4_fp4_lut[*b >> 4] * sc;
        }
        if (k + 1 == stop) break; /* one value left, the last: below */
    }
    if (k < n) out[k] = ds4_fp4_at(q, s, e0 + k);
}


#endif
