/* quant.c — the quantised checkpoint formats (quant.h): scale/shape validation and exact dequantisation to fp32.
 *
 * The products are exact in fp32: e4m3 and e2m1 values have at most 4 significant bits and e8m0 scales are powers
 * of two, so a product only moves the exponent; the smallest, 2^-9 * 2^-127, is still on fp32's subnormal grid
 * (2^-149). Only a scale above 2^119 could overflow (448 * 2^119 > 2^127), and then to infinity, as it would for
 * any fp32 reader. An F32 or BF16 scale makes one fp32 rounding, the one any reader multiplying in fp32 makes. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "json.h"
#include "quant.h"

enum { MAX_BLOCK = 1 << 20, QCONFIG_MAX_BYTES = 16 << 20 };

/* ------------------------------------------------------------------------------------------------ config */

static ds4_status parse_block(const ds4_json *v, ds4_quant_format *q, ds4_error *err) {
    if (v->type != DS4_JSON_ARRAY || v->count != 2)
        return ds4_fail(err, DS4_ERR_FORMAT, "quantization_config: weight_block_size must be an array of 2 integers");
    for (int i = 0; i < 2; i++) {
        const ds4_json *x = &v->items[i];
        if (x->type != DS4_JSON_NUMBER || !x->is_int || x->integer < 1 || x->integer > MAX_BLOCK)
            return ds4_fail(err, DS4_ERR_FORMAT, "quantization_config: weight_block_size[%d] must be an integer in "
                            "[1, %d]", i, MAX_BLOCK);
        q->block[i] = x->integer;
    }
    return DS4_OK;
}

/* A string member equal to `want` (or absent); anything else is unsupported. */
static ds4_status expect_string(const ds4_json *qc, const char *key, const char *want, ds4_error *err) {
    const ds4_json *v = ds4_json_get(qc, key);
    if (!v) return DS4_OK;
    if (v->type != DS4_JSON_STRING)
        return ds4_fail(err, DS4_ERR_FORMAT, "quantization_config: %s must be a string", key);
    if (strcmp(v->str, want) != 0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "quantization_config: %s '%.64s' is not supported (ds4 reads "
                        "%s '%s': block-scaled FP8 weights and the official FP4 experts)", key, v->str, key, want);
    return DS4_OK;
}

ds4_status ds4_quant_format_parse(const char *json, size_t len, ds4_quant_format *q, ds4_error *err) {
    if (!json || !q) return ds4_fail(err, DS4_ERR_ARG, "quantization_config: NULL argument");
    q->block[0] = q->block[1] = DS4_FP8_BLOCK_DEFAULT;
    ds4_json *root = ds4_json_parse(json, len, NULL, err);
    if (!root) {
        ds4_error_prefix(err, "quantization_config: ");
        return err ? err->code : DS4_ERR_FORMAT;
    }
    ds4_status s = DS4_OK;
    const ds4_json *qc = ds4_json_get(root, "quantization_config");
    if (qc && qc->type != DS4_JSON_NULL) {
        if (qc->type != DS4_JSON_OBJECT) s = ds4_fail(err, DS4_ERR_FORMAT, "quantization_config: not an object");
        if (!s) s = expect_string(qc, "quant_method", "fp8", err);
        if (!s) s = expect_string(qc, "fmt", "e4m3", err);
        const ds4_json *b = s ? NULL : ds4_json_get(qc, "weight_block_size");
        if (b && b->type != DS4_JSON_NULL) s = parse_block(b, q, err);
    }
    ds4_json_free(root);
    return s;
}

ds4_status ds4_quant_format_load(const char *dir, ds4_quant_format *q, ds4_error *err) {
    if (!dir || !q) return ds4_fail(err, DS4_ERR_ARG, "quantization_config: NULL argument");
    q->block[0] = q->block[1] = DS4_FP8_BLOCK_DEFAULT;
    size_t n = strlen(dir) + sizeof "/config.json";
    char *path = malloc(n);
    if (!path) return ds4_fail(err, DS4_ERR_OOM, "quantization_config: path of %zu bytes", n);
    snprintf(path, n, "%s/config.json", dir);
    char *text = NULL;
    size_t len = 0;
    ds4_error tmp;
    /* no readable config.json: ds4_config_load, which runs first, has the error to report */
    ds4_status s = ds4_read_file(path, QCONFIG_MAX_BYTES, &text, &len, &tmp);
    free(path);
    if (s) return DS4_OK;
    s = ds4_quant_format_parse(text, len, q, err);
    free(text);
    return s;
}

/* ------------------------------------------------------------------------------------------------ names */

static int replace_suffix(const char *name, const char *suffix, char *out, size_t cap) {
    size_t n = strlen(name), k = strlen(suffix);
    if (n <= k || strcmp(name + n - k, suffix) != 0) return 0;
    int w = snprintf(out, cap, "%.*s.weight", (int)(n - k), name);
    return w > 0 && (size_t)w < cap;
}

int ds4_quant_scale_target(const char *name, char *out, size_t cap) {
    return replace_suffix(name, ".weight_scale_inv", out, cap) || replace_suffix(name, ".scale", out, cap);
}

ds4_qkind ds4_quant_kind(ds4_dtype t) {
    if (t == DS4_F8_E4M3) return DS4_Q_FP8;
    if (t == DS4_I8 || t == DS4_U8) return DS4_Q_FP4;
    return DS4_Q_NONE;
}

/* ------------------------------------------------------------------------------------------------ checks */

static int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

static ds4_status pair_error(ds4_error *err, ds4_status code, const ds4_st_entry *w, const char *what,
                             const ds4_st_entry *s, int32_t ndim, const int64_t *want) {
    char ws[96], ss[96] = "", es[96] = "";
    ds4_shape_str(ws, sizeof ws, w->ndim, w->shape);
    if (s) ds4_shape_str(ss, sizeof ss, s->ndim, s->shape);
    if (want) ds4_shape_str(es, sizeof es, ndim, want);
    return ds4_fail(err, code, "quantised weight '%s' (%s %s): %s%s%s%s%s%s%s", w->name, ds4_dtype_name(w->dtype), ws,
                    what, s ? " '" : "", s ? s->name : "", s ? "' " : "", ss, want ? ", expected " : "", es);
}

static int scale_dtype_ok(ds4_dtype t) { return t == DS4_F32 || t == DS4_BF16 || t == DS4_F8_E8M0; }

ds4_status ds4_quant_check(const ds4_st_entry *w, const ds4_st_entry *scale, int64_t rows, int64_t cols,
                           const ds4_quant_format *q, ds4_error *err) {
    if (!w || !q) return ds4_fail(err, DS4_ERR_ARG, "quant check: NULL argument");
    const ds4_qkind kind = ds4_quant_kind(w->dtype);
    if (kind == DS4_Q_NONE) return pair_error(err, DS4_ERR_ARG, w, "not a quantised dtype", NULL, 0, NULL);
    if (rows < 1 || cols < 1) return pair_error(err, DS4_ERR_ARG, w, "empty logical shape", NULL, 0, NULL);
    if (kind == DS4_Q_FP4 && cols % DS4_FP4_BLOCK != 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "FP4 needs a column count divisible by %d, the model's is %lld", DS4_FP4_BLOCK,
                 (long long)cols);
        return pair_error(err, DS4_ERR_SHAPE, w, msg, NULL, 0, NULL);
    }
    const int64_t wshape[2] = {rows, kind == DS4_Q_FP4 ? cols / 2 : cols};
    if (w->ndim != 2 || w->shape[0] != wshape[0] || w->shape[1] != wshape[1])
        return pair_error(err, DS4_ERR_SHAPE, w, kind == DS4_Q_FP4 ? "packed FP4 shape is wrong" : "shape is wrong",
                          NULL, 2, wshape);
    if (!scale)
        return pair_error(err, DS4_ERR_FORMAT, w, "no scale tensor (looked for '.scale' and '.weight_scale_inv')",
                          NULL, 0, NULL);
    if (!scale_dtype_ok(scale->dtype)) {
        char msg[96];
        snprintf(msg, sizeof msg, "scale dtype %s is not F32, BF16 or F8_E8M0:", ds4_dtype_name(scale->dtype));
        return pair_error(err, DS4_ERR_FORMAT, w, msg, scale, 0, NULL);
    }
    int64_t sshape[2];
    if (kind == DS4_Q_FP4) {
        sshape[0] = rows;
        sshape[1] = cols / DS4_FP4_BLOCK;
    } else {
        if (q->block[0] < 1 || q->block[1] < 1) return ds4_fail(err, DS4_ERR_ARG, "quant check: block size < 1");
        sshape[0] = ceil_div(rows, q->block[0]);
        sshape[1] = ceil_div(cols, q->block[1]);
    }
    if (scale->ndim != 2 || scale->shape[0] != sshape[0] || scale->shape[1] != sshape[1]) {
        char msg[96];
        if (kind == DS4_Q_FP4) snprintf(msg, sizeof msg, "scale (one per %d values of a row)", DS4_FP4_BLOCK);
        else snprintf(msg, sizeof msg, "scale (one per %lldx%lld block)", (long long)q->block[0], (long long)q->block[1]);
        return pair_error(err, DS4_ERR_SHAPE, w, msg, scale, 2, sshape);
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ dequantise */

float ds4_fp4_e2m1_to_f32(uint8_t nibble) {
    /* e2m1: exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (0 or 0.5) */
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = mag[nibble & 7u];
    return (nibble & 8u) ? -v : v;
}

static float scale_at(const ds4_st_entry *s, int64_t i) {
    const unsigned char *p = (const unsigned char *)s->data;
    if (s->dtype == DS4_F8_E8M0) return ds4_f8e8m0_to_f32(p[i]);
    if (s->dtype == DS4_BF16) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return ds4_bf16_to_f32(h);
    }
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

/* A NaN scale (e8m0 byte 255) would turn a whole block into NaN silently; an infinite one as well. */
static ds4_status check_scales(const ds4_st_entry *w, const ds4_st_entry *s, ds4_error *err) {
    const int64_t n = s->shape[0] * s->shape[1];
    for (int64_t i = 0; i < n; i++) {
        const float v = scale_at(s, i);
        if (!isfinite(v))
            return ds4_fail(err, DS4_ERR_FORMAT, "quantised weight '%s': scale '%s' element [%lld, %lld] is %s",
                            w->name, s->name, (long long)(i / s->shape[1]), (long long)(i % s->shape[1]),
                            isnan(v) ? "NaN" : "infinite");
    }
    return DS4_OK;
}

static void dequant_fp8(float *dst, const ds4_st_entry *w, const ds4_st_entry *s, int64_t rows, int64_t cols,
                        const ds4_quant_format *q) {
    const uint8_t *b = (const uint8_t *)w->data;
    const int64_t sc = s->shape[1];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[r * cols + c] = ds4_f8e4m3_to_f32(b[r * cols + c]) * scale_at(s, (r / q->block[0]) * sc + c / q->block[1]);
}

static void dequant_fp4(float *dst, const ds4_st_entry *w, const ds4_st_entry *s, int64_t rows, int64_t cols) {
    const uint8_t *b = (const uint8_t *)w->data;
    const int64_t half = cols / 2, sc = cols / DS4_FP4_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < half; j++) {
            const uint8_t byte = b[r * half + j];
            const float scale = scale_at(s, r * sc + (2 * j) / DS4_FP4_BLOCK); /* 2j and 2j+1 share a block */
            dst[r * cols + 2 * j] = ds4_fp4_e2m1_to_f32(byte & 0x0Fu) * scale;
            dst[r * cols + 2 * j + 1] = ds4_fp4_e2m1_to_f32((uint8_t)(byte >> 4)) * scale;
        }
}

ds4_status ds4_quant_dequant(float *dst, const ds4_st_entry *w, const ds4_st_entry *scale, int64_t rows,
                             int64_t cols, const ds4_quant_format *q, ds4_error *err) {
    if (!dst) return ds4_fail(err, DS4_ERR_ARG, "quant dequant: NULL destination");
    ds4_status s = ds4_quant_check(w, scale, rows, cols, q, err);
    if (!s) s = check_scales(w, scale, err);
    if (s) return s;
    if (ds4_quant_kind(w->dtype) == DS4_Q_FP8) dequant_fp8(dst, w, scale, rows, cols, q);
    else dequant_fp4(dst, w, scale, rows, cols);
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ encode */

/* The e4m3 code nearest to x (ties to even mantissa; beyond 448 the largest, 0x7E; the sign kept, so -0 gives 0x80). */
static uint8_t e4m3_code(double x) {
    const uint8_t sign = signbit(x) ? 0x80u : 0;
    const double a = fabs(x);
    if (!(a < 448.0)) return (uint8_t)(sign | 0x7Eu); /* NaN too: the check after encoding refuses it */
    if (a < 0x1p-6) return (uint8_t)(sign | (uint8_t)nearbyint(a * 512.0)); /* subnormal m/8·2^-6; m = 8 is 2^-6 */
    int k;
    (void)frexp(a, &k); /* a = f·2^k, f in [0.5, 1): exponent field k + 6 */
    int E = k + 6, mant = (int)nearbyint((ldexp(a, 1 - k) - 1.0) * 8.0);
    if (mant == 8) E++, mant = 0;
    if (E > 15 || (E == 15 && mant == 7)) return (uint8_t)(sign | 0x7Eu);
    return (uint8_t)(sign | (uint8_t)(E << 3) | (uint8_t)mant);
}

/* The e2m1 code nearest to x (midpoints to the even code), sign kept. */
static uint8_t e2m1_code(double x) {
    static const double mid[7] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
    const double a = fabs(x);
    uint8_t c = 0;
    while (c < 7 && (a > mid[c] || (a == mid[c] && (c & 1)))) c++;
    return (uint8_t)((signbit(x) ? 8u : 0u) | c);
}

ds4_status ds4_quant_encode(void *codes, const float *w, const ds4_st_entry *scale, int64_t rows, int64_t cols,
                            ds4_qkind kind, const ds4_quant_format *q, ds4_error *err) {
    if (!codes || !w || !scale || !q || (kind != DS4_Q_FP8 && kind != DS4_Q_FP4))
        return ds4_fail(err, DS4_ERR_ARG, "quant encode: bad argument");
    uint8_t *out = codes;
    const int64_t sc = scale->shape[1];
    if (kind == DS4_Q_FP8) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                out[r * cols + c] = e4m3_code((double)w[r * cols + c] /
                                              (double)scale_at(scale, (r / q->block[0]) * sc + c / q->block[1]));
        return DS4_OK;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols / 2; j++) {
            const double s = (double)scale_at(scale, r * sc + (2 * j) / DS4_FP4_BLOCK);
            out[r * (cols / 2) + j] = (uint8_t)(e2m1_code(w[r * cols + 2 * j] / s) |
                                                (e2m1_code(w[r * cols + 2 * j + 1] / s) << 4));
        }
    return DS4_OK;
}
