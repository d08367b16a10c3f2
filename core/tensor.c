/* tensor.c — dtypes, scalar format conversions and reference-counted host tensors.
 *
 * All conversions are exact bit-level definitions, not whatever the host's float hardware does with
 * out-of-range values: C leaves float->int and double->float conversion of out-of-range values undefined,
 * so every narrowing goes through explicit range checks or a software rounding routine.
 *
 * Byte order: element data is little-endian (the safetensors convention) and is read with memcpy, so
 * unaligned pointers (tensors inside an mmap'd file) are fine. ds4 only targets little-endian hosts. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------------------------------------ dtypes */

static const struct {
    const char *name;
    size_t size;
    int is_float;
} dtype_info[DS4_DTYPE_COUNT] = {
    [DS4_F32] = {"F32", 4, 1},         [DS4_F16] = {"F16", 2, 1},         [DS4_BF16] = {"BF16", 2, 1},
    [DS4_F64] = {"F64", 8, 1},         [DS4_I64] = {"I64", 8, 0},         [DS4_I32] = {"I32", 4, 0},
    [DS4_I16] = {"I16", 2, 0},         [DS4_I8] = {"I8", 1, 0},           [DS4_U8] = {"U8", 1, 0},
    [DS4_BOOL] = {"BOOL", 1, 0},       [DS4_F8_E4M3] = {"F8_E4M3", 1, 1}, [DS4_F8_E5M2] = {"F8_E5M2", 1, 1},
    [DS4_F8_E8M0] = {"F8_E8M0", 1, 1},
};

static int dtype_valid(ds4_dtype t) { return (unsigned)t < (unsigned)DS4_DTYPE_COUNT; }

size_t ds4_dtype_size(ds4_dtype t) { return dtype_valid(t) ? dtype_info[t].size : 0; }

const char *ds4_dtype_name(ds4_dtype t) { return dtype_valid(t) ? dtype_info[t].name : "invalid-dtype"; }

int ds4_dtype_from_name(const char *name, size_t len, ds4_dtype *out) {
    if (!name) return 0;
    for (int i = 0; i < DS4_DTYPE_COUNT; i++) {
        const char *n = dtype_info[i].name;
        /* `name` need not be NUL-terminated (it may point into a JSON header): compare exactly len bytes. */
        if (strlen(n) == len && memcmp(n, name, len) == 0) {
            if (out) *out = (ds4_dtype)i;
            return 1;
        }
    }
    return 0;
}

/* F8_E8M0 counts as a float: it is the exponent-only scale format of MX block quantisation. */
int ds4_dtype_is_float(ds4_dtype t) { return dtype_valid(t) && dtype_info[t].is_float; }

/* ------------------------------------------------------------------------------------------------ scalar formats */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Decode an IEEE-754-style binary format (all-ones exponent = inf/NaN) with `ebits` exponent bits and
 * `mbits` fraction bits. Every value of the formats used here (<= 16 bits) is exact in a double. */
static double decode_ieee(uint32_t bits, int ebits, int mbits) {
    uint32_t emask = (1u << ebits) - 1u;
    int bias = (int)(emask >> 1);
    uint32_t exp = (bits >> mbits) & emask;
    uint32_t frac = bits & ((1u << mbits) - 1u);
    double sign = (bits >> (ebits + mbits)) & 1u ? -1.0 : 1.0;
    if (exp == emask) return frac ? (double)NAN : sign * (double)INFINITY;
    if (exp == 0) return sign * ldexp((double)frac, 1 - bias - mbits);
    return sign * ldexp((double)(frac | (1u << mbits)), (int)exp - bias - mbits);
}

/* Round a finite a > 0 to a binary format with `mbits` fraction bits and exponent bias `bias`, ties to even,
 * directly from the double (no double rounding through f32). Returns the unsigned magnitude bit pattern
 * (biased exponent << mbits | fraction); a result above the format's largest finite pattern means overflow
 * and is left to the caller (inf, NaN or saturation differ per format). Subnormals fall out naturally: below
 * the minimum normal exponent the quantum is fixed, and a subnormal that rounds up to 2^mbits carries into
 * the smallest normal pattern. */
static uint64_t round_magnitude(double a, int mbits, int bias) {
    int e;
    (void)frexp(a, &e); /* a = m * 2^e, m in [0.5, 1): unbiased exponent of 1.f form is e - 1 */
    int E = e - 1;
    const int emin = 1 - bias;
    if (E < emin) E = emin;
    if (E > 2 * bias + 2) return UINT64_MAX; /* far beyond any finite value: avoid shifting huge exponents */
    double q = ldexp(a, mbits - E);          /* exact (power-of-two scaling, no underflow for our formats) */
    /* Ties to even by hand rather than nearbyint(), so the result does not depend on the caller's fenv
     * rounding mode. q < 2^(mbits+1) <= 2^24, so floor and the subtraction are exact. */
    double fl = floor(q), frac = q - fl;
    uint64_t r = (uint64_t)fl;
    if (frac > 0.5 || (frac == 0.5 && (r & 1u))) r++;
    return ((uint64_t)(E + bias - 1) << mbits) + r;
}

float ds4_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t ds4_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    /* NaN: truncating could clear every fraction bit and turn it into inf; force the quiet bit instead. */
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even on the dropped 16 bits; a carry into the exponent correctly yields inf. */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float ds4_f16_to_f32(uint16_t h) { return (float)decode_ieee(h, 5, 10); }

static uint16_t f16_from_double(double v) {
    uint16_t sign = signbit(v) ? 0x8000u : 0;
    if (isnan(v)) return (uint16_t)(sign | 0x7E00u);
    double a = fabs(v);
    if (a == 0) return sign;
    if (isinf(a)) return (uint16_t)(sign | 0x7C00u);
    uint64_t m = round_magnitude(a, 10, 15);
    if (m > 0x7BFFu) m = 0x7C00u; /* overflow -> inf (IEEE round to nearest) */
    return (uint16_t)(sign | m);
}

uint16_t ds4_f32_to_f16(float f) { return f16_from_double((double)f); }

static uint16_t bf16_from_double(double v) {
    uint16_t sign = signbit(v) ? 0x8000u : 0;
    if (isnan(v)) return (uint16_t)(sign | 0x7FC0u);
    double a = fabs(v);
    if (a == 0) return sign;
    if (isinf(a)) return (uint16_t)(sign | 0x7F80u);
    uint64_t m = round_magnitude(a, 7, 127);
    if (m > 0x7F7Fu) m = 0x7F80u;
    return (uint16_t)(sign | m);
}

static float f32_from_double(double v) {
    uint32_t sign = signbit(v) ? 0x80000000u : 0;
    if (isnan(v)) return bits_f32(sign | 0x7FC00000u);
    double a = fabs(v);
    if (a == 0) return bits_f32(sign);
    if (isinf(a)) return bits_f32(sign | 0x7F800000u);
    uint64_t m = round_magnitude(a, 23, 127);
    if (m > 0x7F7FFFFFu) m = 0x7F800000u;
    return bits_f32(sign | (uint32_t)m);
}

/* F8_E4M3 is the "fn" variant (torch.float8_e4m3fn): bias 7, no infinities, S.1111.111 is NaN, max 448. */
float ds4_f8e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xFu, frac = b & 7u;
    float sign = (b & 0x80u) ? -1.0f : 1.0f;
    if (exp == 15 && frac == 7) return NAN;
    if (exp == 0) return sign * ldexpf((float)frac, -9); /* subnormal: 2^-6 * frac/8 */
    return sign * ldexpf((float)(frac | 8u), (int)exp - 10);
}

/* As torch: values that round past 448 become NaN (the format has no infinity; torch does not saturate). */
static uint8_t f8e4m3_from_double(double v) {
    uint8_t sign = signbit(v) ? 0x80u : 0;
    if (isnan(v) || isinf(v)) return (uint8_t)(sign | 0x7Fu);
    double a = fabs(v);
    if (a == 0) return sign;
    uint64_t m = round_magnitude(a, 3, 7);
    if (m > 0x7Eu) m = 0x7Fu;
    return (uint8_t)(sign | m);
}

float ds4_f8e5m2_to_f32(uint8_t b) { return (float)decode_ieee(b, 5, 2); }

static uint8_t f8e5m2_from_double(double v) {
    uint8_t sign = signbit(v) ? 0x80u : 0;
    if (isnan(v)) return (uint8_t)(sign | 0x7Fu);
    double a = fabs(v);
    if (a == 0) return sign;
    if (isinf(a)) return (uint8_t)(sign | 0x7Cu);
    uint64_t m = round_magnitude(a, 2, 15);
    if (m > 0x7Bu) m = 0x7Cu; /* overflow -> inf, as IEEE and torch */
    return (uint8_t)(sign | m);
}

/* F8_E8M0 (torch.float8_e8m0fnu): an unsigned power of two 2^(b-127); 255 is NaN; no zero, no sign. */
float ds4_f8e8m0_to_f32(uint8_t b) { return b == 255 ? NAN : ldexpf(1.0f, (int)b - 127); }

/* Mirrors torch's fp8e8m0fnu_from_fp32_value: the sign is ignored, inf/NaN give NaN, the f32 mantissa is
 * rounded to nearest with ties up (ties to even with an implicit 1), zero and tiny values give 2^-127, and a
 * round-up past 2^127 gives NaN. */
static uint8_t f8e8m0_from_double(double v) {
    if (isnan(v) || isinf(v)) return 255;
    double a = fabs(v);
    if (a < 0x1p-126) return a > 0x1p-127 ? 1 : 0; /* the f32 subnormal range: implicit bit 0, tie goes down */
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1): 1.f form has exponent e-1, f = 2m - 1 */
    int biased = (e - 1) + 127 + (m >= 0.75 ? 1 : 0);
    return biased >= 255 ? 255 : (uint8_t)biased;
}

/* ------------------------------------------------------------------------------------------------ tensors */

static int64_t numel_of(int32_t ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > DS4_MAX_DIMS) return -1;
    int64_t n = 1;
    for (int32_t i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] != 0 && n > INT64_MAX / shape[i]) return -1;
        n *= shape[i];
    }
    return n;
}

void ds4_shape_str(char *buf, size_t cap, int32_t ndim, const int64_t *shape) {
    size_t used = 0;
    int w = snprintf(buf, cap, "[");
    if (w > 0) used = (size_t)w;
    for (int32_t i = 0; i < ndim && used < cap; i++) {
        w = snprintf(buf + used, cap - used, "%s%lld", i ? "," : "", (long long)shape[i]);
        if (w < 0) break;
        used += (size_t)w;
    }
    if (used < cap) snprintf(buf + used, cap - used, "]");
}

ds4_status ds4_tensor_new(ds4_dtype dtype, int32_t ndim, const int64_t *shape, ds4_tensor **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "tensor new: out is NULL");
    *out = NULL;
    if (!dtype_valid(dtype)) return ds4_fail(err, DS4_ERR_ARG, "tensor new: invalid dtype %d", (int)dtype);
    if (ndim < 0 || ndim > DS4_MAX_DIMS)
        return ds4_fail(err, DS4_ERR_ARG, "tensor new: ndim %d outside [0, %d]", (int)ndim, DS4_MAX_DIMS);
    if (ndim > 0 && !shape) return ds4_fail(err, DS4_ERR_ARG, "tensor new: ndim %d but shape is NULL", (int)ndim);
    char sbuf[256];
    size_t numel = 1, nbytes;
    for (int32_t i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            ds4_shape_str(sbuf, sizeof sbuf, ndim, shape);
            return ds4_fail(err, DS4_ERR_ARG, "tensor new: %s %s: negative dimension %d", ds4_dtype_name(dtype),
                            sbuf, (int)i);
        }
        if ((uint64_t)shape[i] > SIZE_MAX || !ds4_mul_size(numel, (size_t)shape[i], &numel)) {
            ds4_shape_str(sbuf, sizeof sbuf, ndim, shape);
            return ds4_fail(err, DS4_ERR_ARG, "tensor new: %s %s: element count overflows", ds4_dtype_name(dtype),
                            sbuf);
        }
    }
    /* numel must also fit int64_t (ds4_tensor_numel, get/set indices) */
    if (numel > (size_t)INT64_MAX || !ds4_mul_size(numel, ds4_dtype_size(dtype), &nbytes) ||
        nbytes > (size_t)INT64_MAX) {
        ds4_shape_str(sbuf, sizeof sbuf, ndim, shape);
        return ds4_fail(err, DS4_ERR_ARG, "tensor new: %s %s: byte size overflows", ds4_dtype_name(dtype), sbuf);
    }
    ds4_tensor *t = calloc(1, sizeof *t);
    if (!t) return ds4_fail(err, DS4_ERR_OOM, "tensor new: cannot allocate tensor header");
    /* calloc: zero-filled and its own overflow-safe size; at least one byte so data is never NULL. */
    t->data = calloc(nbytes ? nbytes : 1, 1);
    if (!t->data) {
        free(t);
        ds4_shape_str(sbuf, sizeof sbuf, ndim, shape);
        return ds4_fail(err, DS4_ERR_OOM, "tensor new: %s %s: cannot allocate %zu bytes", ds4_dtype_name(dtype),
                        sbuf, nbytes);
    }
    t->dtype = dtype;
    t->ndim = ndim;
    for (int32_t i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = nbytes;
    t->refcount = 1;
    *out = t;
    return DS4_OK;
}

/* Atomic so that a tensor may be shared between threads; a tensor with refcount <= 0 is a borrowed view
 * (e.g. ds4_model_tensor_at) that retain/release leave alone. */
void ds4_tensor_retain(ds4_tensor *t) {
    if (!t || t->refcount <= 0) return;
#if defined(__GNUC__)
    __atomic_fetch_add(&t->refcount, 1, __ATOMIC_RELAXED);
#else
    t->refcount++;
#endif
}

void ds4_tensor_release(ds4_tensor *t) {
    if (!t || t->refcount <= 0) return;
#if defined(__GNUC__)
    if (__atomic_sub_fetch(&t->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
#else
    if (--t->refcount != 0) return;
#endif
    free(t->data);
    free(t);
}

/* -1 for a malformed tensor (NULL, bad ndim, negative dimension, overflow). */
int64_t ds4_tensor_numel(const ds4_tensor *t) { return t ? numel_of(t->ndim, t->shape) : -1; }

/* Element i of a dtype at p (unaligned) as a double. */
static double load_elem(ds4_dtype dt, const unsigned char *p) {
    switch (dt) {
    case DS4_F32: { float v; memcpy(&v, p, 4); return v; }
    case DS4_F64: { double v; memcpy(&v, p, 8); return v; }
    case DS4_F16: { uint16_t v; memcpy(&v, p, 2); return decode_ieee(v, 5, 10); }
    case DS4_BF16: { uint16_t v; memcpy(&v, p, 2); return ds4_bf16_to_f32(v); }
    case DS4_I64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case DS4_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case DS4_I16: { int16_t v; memcpy(&v, p, 2); return v; }
    case DS4_I8: { int8_t v; memcpy(&v, p, 1); return v; }
    case DS4_U8: return *p;
    case DS4_BOOL: return *p ? 1.0 : 0.0;
    case DS4_F8_E4M3: return ds4_f8e4m3_to_f32(*p);
    case DS4_F8_E5M2: return ds4_f8e5m2_to_f32(*p);
    case DS4_F8_E8M0: return ds4_f8e8m0_to_f32(*p);
    case DS4_DTYPE_COUNT: break;
    }
    return NAN;
}

/* Integers: truncate toward zero (C and torch semantics), saturate at the type's range, NaN -> 0. */
static int64_t to_int_sat(double v, int64_t lo, int64_t hi) {
    if (isnan(v)) return 0;
    if (v <= (double)lo) return lo; /* (double)lo is exact: lo is -2^k */
    if (v >= 0x1p63) return hi;     /* (double)INT64_MAX rounds to 2^63, so compare against 2^63 itself */
    int64_t x = (int64_t)v;         /* v in (lo, 2^63): defined */
    return x > hi ? hi : x;
}

static void store_elem(ds4_dtype dt, unsigned char *p, double v) {
    switch (dt) {
    case DS4_F32: { float f = f32_from_double(v); memcpy(p, &f, 4); return; }
    case DS4_F64: memcpy(p, &v, 8); return;
    case DS4_F16: { uint16_t h = f16_from_double(v); memcpy(p, &h, 2); return; }
    case DS4_BF16: { uint16_t h = bf16_from_double(v); memcpy(p, &h, 2); return; }
    case DS4_I64: { int64_t x = to_int_sat(v, INT64_MIN, INT64_MAX); memcpy(p, &x, 8); return; }
    case DS4_I32: { int32_t x = (int32_t)to_int_sat(v, INT32_MIN, INT32_MAX); memcpy(p, &x, 4); return; }
    case DS4_I16: { int16_t x = (int16_t)to_int_sat(v, INT16_MIN, INT16_MAX); memcpy(p, &x, 2); return; }
    case DS4_I8: { int8_t x = (int8_t)to_int_sat(v, INT8_MIN, INT8_MAX); memcpy(p, &x, 1); return; }
    case DS4_U8: *p = (unsigned char)to_int_sat(v, 0, 255); return;
    case DS4_BOOL: *p = (v != 0) ? 1 : 0; return; /* NaN is truthy, as in torch */
    case DS4_F8_E4M3: *p = f8e4m3_from_double(v); return;
    case DS4_F8_E5M2: *p = f8e5m2_from_double(v); return;
    case DS4_F8_E8M0: *p = f8e8m0_from_double(v); return;
    case DS4_DTYPE_COUNT: return;
    }
}

/* Out-of-range index, NULL or malformed tensor: get returns NaN and set does nothing (no abort in core). */
static unsigned char *elem_ptr(const ds4_tensor *t, int64_t i) {
    if (!t || !t->data || !dtype_valid(t->dtype) || i < 0) return NULL;
    int64_t n = ds4_tensor_numel(t);
    size_t sz = ds4_dtype_size(t->dtype), off;
    if (n < 0 || i >= n || !ds4_mul_size((size_t)i, sz, &off) || t->nbytes < sz || off > t->nbytes - sz)
        return NULL; /* also guards views whose nbytes disagrees with their shape */
    return (unsigned char *)t->data + off;
}

double ds4_tensor_get(const ds4_tensor *t, int64_t i) {
    const unsigned char *p = elem_ptr(t, i);
    return p ? load_elem(t->dtype, p) : (double)NAN;
}

void ds4_tensor_set(ds4_tensor *t, int64_t i, double v) {
    unsigned char *p = elem_ptr(t, i);
    if (p) store_elem(t->dtype, p, v);
}

ds4_status ds4_convert_to_f32(ds4_dtype src_dtype, const void *src, int64_t n, float *dst, ds4_error *err) {
    if (!dtype_valid(src_dtype)) return ds4_fail(err, DS4_ERR_ARG, "convert to F32: invalid dtype %d", (int)src_dtype);
    if (n < 0) return ds4_fail(err, DS4_ERR_ARG, "convert %s to F32: negative count %lld", ds4_dtype_name(src_dtype),
                               (long long)n);
    if (n == 0) return DS4_OK;
    if (!src || !dst)
        return ds4_fail(err, DS4_ERR_ARG, "convert %s to F32: %s is NULL for %lld elements",
                        ds4_dtype_name(src_dtype), src ? "dst" : "src", (long long)n);
    size_t cnt = (size_t)n, bytes;
    if ((uint64_t)n > SIZE_MAX || !ds4_mul_size(cnt, ds4_dtype_size(src_dtype), &bytes))
        return ds4_fail(err, DS4_ERR_ARG, "convert %s to F32: %lld elements overflow size_t",
                        ds4_dtype_name(src_dtype), (long long)n);
    const unsigned char *p = src;
    /* Tight loops for the dtypes checkpoints actually hold; the generic path covers the rest. */
    switch (src_dtype) {
    case DS4_F32:
        memmove(dst, src, bytes);
        return DS4_OK;
    case DS4_BF16:
        for (size_t i = 0; i < cnt; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = ds4_bf16_to_f32(h);
        }
        return DS4_OK;
    case DS4_F16:
        for (size_t i = 0; i < cnt; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = ds4_f16_to_f32(h);
        }
        return DS4_OK;
    case DS4_I64:
        for (size_t i = 0; i < cnt; i++) {
            int64_t x;
            memcpy(&x, p + 8 * i, 8);
            dst[i] = (float)x; /* always in float range: rounds to nearest */
        }
        return DS4_OK;
    case DS4_F64:
        for (size_t i = 0; i < cnt; i++) {
            double x;
            memcpy(&x, p + 8 * i, 8);
            dst[i] = f32_from_double(x); /* out-of-range doubles become inf instead of UB */
        }
        return DS4_OK;
    default: {
        size_t sz = ds4_dtype_size(src_dtype);
        /* Every remaining dtype decodes to a value exactly representable in float. */
        for (size_t i = 0; i < cnt; i++) dst[i] = (float)load_elem(src_dtype, p + sz * i);
        return DS4_OK;
    }
    }
}
