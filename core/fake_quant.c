/* fake_quant.c — see fake_quant.h. Every operation here is exact arithmetic on powers of two except the rounding
 * itself (rintf, round to nearest even in the default rounding mode) and the Hadamard butterflies. */
#include "fake_quant.h"

#include <math.h>

int64_t ds4_fq_block(int32_t fmt) { return fmt == DS4_FQ_E4M3 ? 64 : fmt == DS4_FQ_E2M1 ? 32 : 0; }

static float fq_top(int32_t fmt) { return fmt == DS4_FQ_E4M3 ? 448.0f : 6.0f; }

float ds4_fq_scale(float amax, int32_t fmt) {
    /* a NaN or an infinity makes the whole block NaN (frexpf's exponent of an infinity is unspecified, and an
     * overflow must not hide as the format's largest value) */
    if (isnan(amax) || isinf(amax)) return NAN;
    const float floor_ = fmt == DS4_FQ_E4M3 ? 1e-4f : 6.0f * 0x1p-126f;
    const float s = (amax > floor_ ? amax : floor_) / fq_top(fmt);
    /* ceil(log2 s) from s = m·2^e, m in [0.5, 1): log2 s = e - 1 exactly when m = 0.5, else it lies in (e - 1, e) */
    int e;
    const float m = frexpf(s, &e);
    return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

float ds4_fq_round(float v, int32_t fmt) {
    const float top = fq_top(fmt), a = fabsf(v);
    if (isnan(v)) return v;
    if (a >= top) return v < 0 ? -top : top;
    /* the spacing of the format's values around a: 2^(e - mantissa bits) for a in [2^e, 2^(e+1)), with e no lower
     * than the smallest normal exponent (below it the subnormals keep that spacing) */
    const int mbits = fmt == DS4_FQ_E4M3 ? 3 : 1, emin = fmt == DS4_FQ_E4M3 ? -6 : 0;
    int e;
    frexpf(a, &e); /* a = m·2^e, m in [0.5, 1): a in [2^(e-1), 2^e) */
    e -= 1;
    if (e < emin) e = emin;
    const float quantum = ldexpf(1.0f, e - mbits);
    const float r = rintf(a / quantum) * quantum; /* a / quantum is exact: quantum is a power of two */
    return v < 0 ? -r : r;
}

void ds4_hadamard(float *x, int64_t n) {
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = 1.0f / sqrtf((float)n);
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

void ds4_fake_quant_row(float *x, int64_t width, const ds4_fq *q) {
    if (q->hadamard) ds4_hadamard(x, width);
    const int64_t bs = ds4_fq_block(q->fmt), nq = q->nq < width ? q->nq : width;
    if (!bs) return;
    for (int64_t b0 = 0; b0 < nq; b0 += bs) {
        const int64_t b1 = b0 + bs < nq ? b0 + bs : nq;
        float amax = 0;
        for (int64_t i = b0; i < b1; i++) {
            const float a = fabsf(x[i]);
            amax = a > amax || isnan(a) ? a : amax; /* a NaN stays the maximum: the block becomes NaN */
            if (isnan(amax)) break;
        }
        const float s = ds4_fq_scale(amax, q->fmt);
        /* s is a power of two: x / s and the product below are exact (no overflow: |x| <= 448·s) */
        for (int64_t i = b0; i < b1; i++) x[i] = ds4_fq_round(x[i] / s, q->fmt) * s;
    }
}
