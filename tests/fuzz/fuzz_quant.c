/* fuzz_quant.c — libFuzzer target for the quantised-weight validation and dequantisation (core/quant.c).
 *
 * Input: byte 0 picks the mode. Odd: the rest is a config.json text for ds4_quant_format_parse. Even: a weight and
 * a scale tensor as a checkpoint header would describe them (any dtype, rank and shape the bytes say, so that
 * shapes disagree with the model's in every way) plus the logical [rows, cols] and block size the model and config
 * would give; the remaining bytes fill the tensors' data.
 * Properties: no crash, leak or UB; a rejected pair carries a message naming the weight; an accepted pair
 * dequantises, or fails only for a non-finite scale; every value dequantised from finite scales is bounded by
 * 448 (e4m3) or 6 (e2m1) times the largest scale, or is the e4m3 NaN code. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

static const ds4_dtype DTYPES[8] = {DS4_F8_E4M3, DS4_I8, DS4_U8, DS4_F32, DS4_BF16, DS4_F8_E8M0, DS4_I64, DS4_F8_E4M3};

typedef struct {
    const uint8_t *p;
    size_t n;
} cursor;

static uint8_t take(cursor *c) {
    if (!c->n) return 0;
    c->n--;
    return *c->p++;
}

/* A tensor of the dtype, rank and shape the next bytes say (each dimension < 80), its data from the input. */
static int make_entry(cursor *c, ds4_st_entry *e, const char *name, void **buf) {
    e->name = name;
    e->dtype = DTYPES[take(c) & 7];
    e->ndim = take(c) % 4;
    int64_t numel = 1;
    for (int32_t i = 0; i < e->ndim; i++) {
        e->shape[i] = take(c) % 80;
        numel *= e->shape[i];
    }
    e->nbytes = (size_t)numel * ds4_dtype_size(e->dtype);
    *buf = malloc(e->nbytes ? e->nbytes : 1);
    if (!*buf) return -1;
    for (size_t i = 0; i < e->nbytes; i++) ((uint8_t *)*buf)[i] = take(c);
    e->data = *buf;
    return 0;
}

static void fuzz_pair(cursor *c) {
    ds4_quant_format q = {{1 + take(c) % 160, 1 + take(c) % 160}};
    const int64_t rows = take(c) % 72, cols = take(c) % 72;
    const int with_scale = take(c) & 1;
    ds4_st_entry w, s;
    void *wb = NULL, *sb = NULL;
    memset(&w, 0, sizeof w);
    memset(&s, 0, sizeof s);
    if (make_entry(c, &w, "w.weight", &wb) || make_entry(c, &s, "w.scale", &sb)) goto out;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_status st = ds4_quant_check(&w, with_scale ? &s : NULL, rows, cols, &q, &err);
    if (st) {
        if (err.code != st || (strstr(err.msg, "'w.weight'") == NULL && strncmp(err.msg, "quant check", 11) != 0))
            abort();
        goto out;
    }
    float *dst = malloc((size_t)(rows * cols) * sizeof(float));
    if (!dst) goto out;
    st = ds4_quant_dequant(dst, &w, &s, rows, cols, &q, &err);
    if (st) {
        if (st != DS4_ERR_FORMAT || strstr(err.msg, "'w.scale'") == NULL) abort();
    } else {
        float smax = 0;
        for (int64_t i = 0; i < s.shape[0] * s.shape[1]; i++) {
            float v;
            if (s.dtype == DS4_F8_E8M0) v = ds4_f8e8m0_to_f32(((const uint8_t *)s.data)[i]);
            else if (s.dtype == DS4_BF16) v = ds4_bf16_to_f32(((const uint16_t *)s.data)[i]);
            else memcpy(&v, (const char *)s.data + 4 * i, 4);
            if (!isfinite(v)) abort(); /* a non-finite scale must have been refused */
            if (fabsf(v) > smax) smax = fabsf(v);
        }
        /* the product rounds once to fp32: allow that rounding, and overflow to infinity past FLT_MAX */
        const double bound = (ds4_quant_kind(w.dtype) == DS4_Q_FP8 ? 448.0 : 6.0) * smax * (1 + 0x1p-23);
        const int fp8 = ds4_quant_kind(w.dtype) == DS4_Q_FP8;
        for (int64_t i = 0; i < rows * cols; i++) {
            if (isnan(dst[i]) && fp8 && (((const uint8_t *)w.data)[i] & 0x7F) == 0x7F) continue;
            if (!(fabs((double)dst[i]) <= bound) && !(isinf(dst[i]) && bound > FLT_MAX)) abort();
        }
    }
    free(dst);
out:
    free(wb);
    free(sb);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    cursor c = {data + 1, size - 1};
    if (data[0] & 1) {
        ds4_quant_format q;
        ds4_error err;
        memset(&err, 0, sizeof err);
        ds4_status st = ds4_quant_format_parse((const char *)c.p, c.n, &q, &err);
        if (st && (err.code != st || strncmp(err.msg, "quantization_config: ", 21) != 0)) abort();
        if (!st && (q.block[0] < 1 || q.block[1] < 1)) abort();
        return 0;
    }
    fuzz_pair(&c);
    return 0;
}
