/* test_tensor.c — dtype table, scalar format conversions (closed-form values, round-to-nearest-even,
 * exhaustive round trips, a nearest-value property check) and host tensors (new/get/set/refcount/overflow). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "testlib.h"

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bitsf(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Exact equality that also accepts NaN == NaN and distinguishes -0 from +0. */
static int same(double a, double b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return a == b && signbit(a) == signbit(b);
}

/* xorshift64*: deterministic test inputs */
static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static void test_dtypes(void) {
    static const struct {
        ds4_dtype t;
        const char *name;
        size_t size;
        int is_float;
    } want[] = {
        {DS4_F32, "F32", 4, 1},         {DS4_F16, "F16", 2, 1},         {DS4_BF16, "BF16", 2, 1},
        {DS4_F64, "F64", 8, 1},         {DS4_I64, "I64", 8, 0},         {DS4_I32, "I32", 4, 0},
        {DS4_I16, "I16", 2, 0},         {DS4_I8, "I8", 1, 0},           {DS4_U8, "U8", 1, 0},
        {DS4_BOOL, "BOOL", 1, 0},       {DS4_F8_E4M3, "F8_E4M3", 1, 1}, {DS4_F8_E5M2, "F8_E5M2", 1, 1},
        {DS4_F8_E8M0, "F8_E8M0", 1, 1},
    };
    CHECK(sizeof want / sizeof want[0] == DS4_DTYPE_COUNT, "table covers every dtype");
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        CHECK(ds4_dtype_size(want[i].t) == want[i].size, "size of %s", want[i].name);
        CHECK(strcmp(ds4_dtype_name(want[i].t), want[i].name) == 0, "name of %d: %s", (int)want[i].t,
              ds4_dtype_name(want[i].t));
        CHECK(ds4_dtype_is_float(want[i].t) == want[i].is_float, "is_float %s", want[i].name);
        ds4_dtype d = DS4_DTYPE_COUNT;
        CHECK(ds4_dtype_from_name(want[i].name, strlen(want[i].name), &d) && d == want[i].t, "from_name %s",
              want[i].name);
    }
    ds4_dtype d;
    CHECK(ds4_dtype_size(DS4_DTYPE_COUNT) == 0, "invalid dtype size 0");
    CHECK(ds4_dtype_size((ds4_dtype)-1) == 0, "negative dtype size 0");
    CHECK(!ds4_dtype_is_float(DS4_DTYPE_COUNT), "invalid dtype not float");
    CHECK(ds4_dtype_name(DS4_DTYPE_COUNT) != NULL, "invalid dtype has a printable name");
    CHECK(!ds4_dtype_from_name("f32", 3, &d), "names are case-sensitive");
    CHECK(!ds4_dtype_from_name("F8_E4M3FN", 9, &d), "torch spelling is not a safetensors name");
    CHECK(!ds4_dtype_from_name("", 0, &d), "empty name");
    CHECK(!ds4_dtype_from_name("U16", 3, &d), "unsupported safetensors dtype");
    CHECK(!ds4_dtype_from_name("F3", 2, &d), "prefix of F32 is not F32");
    CHECK(!ds4_dtype_from_name(NULL, 0, &d), "NULL name");
    CHECK(ds4_dtype_from_name("F32X", 3, &d) && d == DS4_F32, "length-delimited (no NUL needed)");
    CHECK(!ds4_dtype_from_name("F32", 4, &d), "length counts the NUL: no match");
}

static void test_bf16(void) {
    CHECK(ds4_bf16_to_f32(0x3F80) == 1.0f, "bf16 0x3F80 = 1");
    CHECK(ds4_bf16_to_f32(0xC000) == -2.0f, "bf16 0xC000 = -2");
    CHECK(ds4_bf16_to_f32(0x0000) == 0.0f && !signbit(ds4_bf16_to_f32(0)), "bf16 +0");
    CHECK(signbit(ds4_bf16_to_f32(0x8000)), "bf16 -0");
    CHECK(isinf(ds4_bf16_to_f32(0x7F80)) && ds4_bf16_to_f32(0x7F80) > 0, "bf16 +inf");
    CHECK(isinf(ds4_bf16_to_f32(0xFF80)) && ds4_bf16_to_f32(0xFF80) < 0, "bf16 -inf");
    CHECK(isnan(ds4_bf16_to_f32(0x7FC0)), "bf16 NaN");
    CHECK(ds4_bf16_to_f32(0x0001) == ldexpf(1.0f, -133), "bf16 smallest subnormal 2^-133");
    CHECK(ds4_bf16_to_f32(0x7F7F) == ldexpf(255.0f, 120), "bf16 max = 255 * 2^120");
    CHECK(ds4_bf16_to_f32(0x3FC0) == 1.5f, "bf16 1.5");

    CHECK(ds4_f32_to_bf16(1.0f) == 0x3F80, "1 -> 0x3F80");
    CHECK(ds4_f32_to_bf16(-1.5f) == 0xBFC0, "-1.5 -> 0xBFC0");
    /* round to nearest even on the 16 dropped bits */
    CHECK(ds4_f32_to_bf16(bitsf(0x3F808000u)) == 0x3F80, "tie 0x3F80|8000 -> even 0x3F80");
    CHECK(ds4_f32_to_bf16(bitsf(0x3F818000u)) == 0x3F82, "tie 0x3F81|8000 -> even 0x3F82");
    CHECK(ds4_f32_to_bf16(bitsf(0x3F808001u)) == 0x3F81, "above tie rounds up");
    CHECK(ds4_f32_to_bf16(bitsf(0x3F807FFFu)) == 0x3F80, "below tie rounds down");
    CHECK(ds4_f32_to_bf16(bitsf(0xBF818000u)) == 0xBF82, "negative tie -> even");
    CHECK(ds4_f32_to_bf16(bitsf(0x7F7FFFFFu)) == 0x7F80, "FLT_MAX rounds to inf");
    CHECK(ds4_f32_to_bf16(INFINITY) == 0x7F80 && ds4_f32_to_bf16(-INFINITY) == 0xFF80, "inf stays inf");
    CHECK(ds4_f32_to_bf16(-0.0f) == 0x8000, "-0 keeps its sign");
    CHECK(ds4_f32_to_bf16(bitsf(0x00008000u)) == 0x0000, "subnormal tie -> even 0");
    CHECK(ds4_f32_to_bf16(bitsf(0x00018000u)) == 0x0002, "subnormal tie -> even 2");
    /* NaN must stay NaN even when only low payload bits are set (truncation would give inf) */
    uint16_t n1 = ds4_f32_to_bf16(bitsf(0x7F800001u)), n2 = ds4_f32_to_bf16(bitsf(0xFF800001u));
    CHECK((n1 & 0x7F80) == 0x7F80 && (n1 & 0x7F), "NaN payload 1 -> NaN (0x%04x)", n1);
    CHECK((n2 & 0x7F80) == 0x7F80 && (n2 & 0x7F) && (n2 & 0x8000), "-NaN -> -NaN (0x%04x)", n2);
    CHECK(isnan(ds4_bf16_to_f32(ds4_f32_to_bf16(NAN))), "NaN round trip");

    /* exhaustive: every non-NaN bf16 survives bf16 -> f32 -> bf16 */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ds4_bf16_to_f32((uint16_t)h);
        if (isnan(f)) {
            if (!isnan(ds4_bf16_to_f32(ds4_f32_to_bf16(f)))) bad++;
        } else if (ds4_f32_to_bf16(f) != h) bad++;
    }
    CHECK(bad == 0, "bf16 exhaustive round trip: %d mismatches", bad);
}

static void test_f16(void) {
    CHECK(ds4_f16_to_f32(0x3C00) == 1.0f, "f16 0x3C00 = 1");
    CHECK(ds4_f16_to_f32(0xC000) == -2.0f, "f16 0xC000 = -2");
    CHECK(ds4_f16_to_f32(0x0001) == ldexpf(1.0f, -24), "f16 0x0001 = 2^-24");
    CHECK(ds4_f16_to_f32(0x03FF) == ldexpf(1023.0f, -24), "f16 largest subnormal");
    CHECK(ds4_f16_to_f32(0x0400) == ldexpf(1.0f, -14), "f16 smallest normal 2^-14");
    CHECK(ds4_f16_to_f32(0x7BFF) == 65504.0f, "f16 max 65504");
    CHECK(isinf(ds4_f16_to_f32(0x7C00)) && ds4_f16_to_f32(0x7C00) > 0, "f16 0x7C00 = +inf");
    CHECK(isinf(ds4_f16_to_f32(0xFC00)) && ds4_f16_to_f32(0xFC00) < 0, "f16 0xFC00 = -inf");
    CHECK(isnan(ds4_f16_to_f32(0x7E00)) && isnan(ds4_f16_to_f32(0x7C01)), "f16 NaN");
    CHECK(signbit(ds4_f16_to_f32(0x8000)) && ds4_f16_to_f32(0x8000) == 0.0f, "f16 -0");
    CHECK(ds4_f16_to_f32(0x3555) == 0.333251953125f, "f16 0x3555 = 0.333251953125");

    CHECK(ds4_f32_to_f16(1.0f) == 0x3C00, "1 -> 0x3C00");
    CHECK(ds4_f32_to_f16(65504.0f) == 0x7BFF, "65504 -> max");
    CHECK(ds4_f32_to_f16(65519.0f) == 0x7BFF, "65519 (below tie) -> max");
    CHECK(ds4_f32_to_f16(65520.0f) == 0x7C00, "65520 (tie, odd max) -> inf");
    CHECK(ds4_f32_to_f16(1e10f) == 0x7C00 && ds4_f32_to_f16(-1e10f) == 0xFC00, "overflow -> inf");
    CHECK(ds4_f32_to_f16(INFINITY) == 0x7C00, "inf -> inf");
    CHECK(ds4_f32_to_f16(ldexpf(1, -24)) == 0x0001, "2^-24 -> 0x0001");
    CHECK(ds4_f32_to_f16(ldexpf(1, -25)) == 0x0000, "2^-25 (tie) -> even 0");
    CHECK(ds4_f32_to_f16(-ldexpf(1, -25)) == 0x8000, "-2^-25 (tie) -> -0");
    CHECK(ds4_f32_to_f16(ldexpf(3, -26)) == 0x0001, "0.75 * 2^-24 -> 0x0001");
    CHECK(ds4_f32_to_f16(ldexpf(3, -25)) == 0x0002, "1.5 * 2^-24 (tie) -> even 0x0002");
    CHECK(ds4_f32_to_f16(ldexpf(2047, -25)) == 0x0400, "1023.5 * 2^-24 (tie) -> smallest normal");
    CHECK(ds4_f32_to_f16(1.0f + ldexpf(1, -11)) == 0x3C00, "1 + 2^-11 (tie) -> even 0x3C00");
    CHECK(ds4_f32_to_f16(1.0f + ldexpf(3, -11)) == 0x3C02, "1 + 3*2^-11 (tie) -> even 0x3C02");
    CHECK(ds4_f32_to_f16(1.0f + ldexpf(1, -11) + ldexpf(1, -20)) == 0x3C01, "just above tie rounds up");
    CHECK(ds4_f32_to_f16(ldexpf(1, -30)) == 0x0000, "underflow -> 0");
    CHECK(ds4_f32_to_f16(-0.0f) == 0x8000, "-0 keeps its sign");
    uint16_t n = ds4_f32_to_f16(NAN);
    CHECK((n & 0x7C00) == 0x7C00 && (n & 0x3FF), "NaN -> NaN (0x%04x)", n);
    n = ds4_f32_to_f16(bitsf(0x7F800001u));
    CHECK((n & 0x7C00) == 0x7C00 && (n & 0x3FF), "NaN with low payload -> NaN (0x%04x)", n);

    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ds4_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            if (!isnan(ds4_f16_to_f32(ds4_f32_to_f16(f)))) bad++;
        } else if (ds4_f32_to_f16(f) != h) bad++;
    }
    CHECK(bad == 0, "f16 exhaustive round trip: %d mismatches", bad);
}

/* Property check of round-to-nearest-even against the decoders, on random f32 bit patterns: the result r is
 * at least as close to x as its neighbours, and on a tie it has an even mantissa. Independent of the rounding
 * code's construction (it only uses the decoders, which the closed-form values above pin down). */
static void test_nearest_property(void) {
    uint64_t s = 0x9E3779B97F4A7C15ULL;
    int bad16 = 0, badbf = 0;
    for (int it = 0; it < 200000; it++) {
        float x = bitsf((uint32_t)rng_next(&s));
        if (isnan(x) || isinf(x)) continue;
        double xd = fabs((double)x);
        /* f16: only where the result is finite */
        if (xd < 65504.0) {
            uint16_t r = ds4_f32_to_f16(x) & 0x7FFF;
            double v = ds4_f16_to_f32(r), dv = fabs(v - xd);
            double lo = r > 0 ? ds4_f16_to_f32((uint16_t)(r - 1)) : -1.0;
            double hi = r < 0x7BFF ? ds4_f16_to_f32((uint16_t)(r + 1)) : INFINITY;
            if (fabs(lo - xd) < dv || fabs(hi - xd) < dv) bad16++;
            if ((fabs(lo - xd) == dv || fabs(hi - xd) == dv) && (r & 1)) bad16++;
        }
        if (xd < 3.0e38) {
            uint16_t r = ds4_f32_to_bf16(x) & 0x7FFF;
            double v = ds4_bf16_to_f32(r), dv = fabs(v - xd);
            double lo = r > 0 ? ds4_bf16_to_f32((uint16_t)(r - 1)) : -1.0;
            double hi = r < 0x7F7F ? ds4_bf16_to_f32((uint16_t)(r + 1)) : INFINITY;
            if (fabs(lo - xd) < dv || fabs(hi - xd) < dv) badbf++;
            if ((fabs(lo - xd) == dv || fabs(hi - xd) == dv) && (r & 1)) badbf++;
        }
    }
    CHECK(bad16 == 0, "f16 nearest-even property: %d violations", bad16);
    CHECK(badbf == 0, "bf16 nearest-even property: %d violations", badbf);
}

static void test_f8(void) {
    /* E4M3 (fn): bias 7, no inf, S.1111.111 NaN */
    CHECK(ds4_f8e4m3_to_f32(0x38) == 1.0f, "e4m3 0x38 = 1");
    CHECK(ds4_f8e4m3_to_f32(0xB8) == -1.0f, "e4m3 0xB8 = -1");
    CHECK(ds4_f8e4m3_to_f32(0x7E) == 448.0f, "e4m3 0x7E = 448");
    CHECK(ds4_f8e4m3_to_f32(0xFE) == -448.0f, "e4m3 0xFE = -448");
    CHECK(ds4_f8e4m3_to_f32(0x78) == 256.0f, "e4m3 0x78 = 256 (exponent 15 is finite)");
    CHECK(ds4_f8e4m3_to_f32(0x01) == ldexpf(1, -9), "e4m3 0x01 = 2^-9");
    CHECK(ds4_f8e4m3_to_f32(0x07) == ldexpf(7, -9), "e4m3 0x07 = 7 * 2^-9");
    CHECK(ds4_f8e4m3_to_f32(0x08) == ldexpf(1, -6), "e4m3 0x08 = 2^-6");
    CHECK(isnan(ds4_f8e4m3_to_f32(0x7F)) && isnan(ds4_f8e4m3_to_f32(0xFF)), "e4m3 NaN");
    CHECK(signbit(ds4_f8e4m3_to_f32(0x80)), "e4m3 -0");
    int nan_count = 0;
    for (int b = 0; b < 256; b++) nan_count += isnan(ds4_f8e4m3_to_f32((uint8_t)b)) != 0;
    CHECK(nan_count == 2, "e4m3 has exactly two NaN patterns, got %d", nan_count);
    /* E5M2: bias 15, IEEE-like */
    CHECK(ds4_f8e5m2_to_f32(0x3C) == 1.0f, "e5m2 0x3C = 1");
    CHECK(ds4_f8e5m2_to_f32(0xC0) == -2.0f, "e5m2 0xC0 = -2");
    CHECK(ds4_f8e5m2_to_f32(0x7B) == 57344.0f, "e5m2 max 57344");
    CHECK(ds4_f8e5m2_to_f32(0x01) == ldexpf(1, -16), "e5m2 0x01 = 2^-16");
    CHECK(ds4_f8e5m2_to_f32(0x04) == ldexpf(1, -14), "e5m2 0x04 = 2^-14");
    CHECK(isinf(ds4_f8e5m2_to_f32(0x7C)) && ds4_f8e5m2_to_f32(0xFC) < 0, "e5m2 inf");
    CHECK(isnan(ds4_f8e5m2_to_f32(0x7D)) && isnan(ds4_f8e5m2_to_f32(0x7E)) && isnan(ds4_f8e5m2_to_f32(0x7F)),
          "e5m2 NaN");
    /* E8M0: 2^(b-127), 255 NaN */
    CHECK(ds4_f8e8m0_to_f32(127) == 1.0f, "e8m0 127 = 1");
    CHECK(ds4_f8e8m0_to_f32(128) == 2.0f, "e8m0 128 = 2");
    CHECK(ds4_f8e8m0_to_f32(0) == ldexpf(1, -127), "e8m0 0 = 2^-127");
    CHECK(ds4_f8e8m0_to_f32(254) == ldexpf(1, 127), "e8m0 254 = 2^127");
    CHECK(isnan(ds4_f8e8m0_to_f32(255)), "e8m0 255 NaN");
}

static ds4_tensor *new1(ds4_dtype dt, int64_t n) {
    ds4_tensor *t = NULL;
    ds4_error err;
    ds4_status s = ds4_tensor_new(dt, 1, &n, &t, &err);
    CHECK(s == DS4_OK && t, "new %s [%lld]: %s", ds4_dtype_name(dt), (long long)n, s ? err.msg : "");
    return t;
}

/* set then get through a 1-element tensor of dtype dt */
static double via(ds4_dtype dt, double v) {
    ds4_tensor *t = new1(dt, 1);
    if (!t) return NAN;
    ds4_tensor_set(t, 0, v);
    double r = ds4_tensor_get(t, 0);
    ds4_tensor_release(t);
    return r;
}

static void test_set_get(void) {
    /* F32/F64 */
    CHECK(via(DS4_F32, 0.1) == (double)0.1f, "F32 rounds like a cast");
    CHECK(via(DS4_F64, 0.1) == 0.1, "F64 exact");
    CHECK(isinf(via(DS4_F32, 1e300)) && via(DS4_F32, -1e300) < 0, "F32 overflow -> inf");
    CHECK(same(via(DS4_F32, 1e-300), 0.0), "F32 underflow -> 0");
    CHECK(via(DS4_F32, ldexp(1, -149)) == ldexp(1, -149), "F32 smallest subnormal");
    CHECK(same(via(DS4_F32, ldexp(1, -150)), 0.0), "F32 2^-150 tie -> 0");
    CHECK(isnan(via(DS4_F32, NAN)) && isnan(via(DS4_F64, NAN)), "NaN kept");
    CHECK(same(via(DS4_F32, -0.0), -0.0), "F32 -0");
    /* BF16/F16 round directly from the double: no double rounding through f32 */
    CHECK(via(DS4_BF16, 1.0 + ldexp(1, -8)) == 1.0, "BF16 tie -> even");
    CHECK(via(DS4_BF16, 1.0 + ldexp(3, -8)) == 1.0 + ldexp(1, -6), "BF16 tie -> even (up)");
    CHECK(via(DS4_BF16, 1.0 + ldexp(1, -8) + ldexp(1, -40)) == 1.0 + ldexp(1, -7),
          "BF16 just above a tie rounds up (a detour through f32 would round down)");
    CHECK(via(DS4_F16, 1.0 + ldexp(1, -11) + ldexp(1, -40)) == 1.0 + ldexp(1, -10), "F16 just above a tie");
    CHECK(via(DS4_F16, 65520.0) == INFINITY, "F16 overflow tie -> inf");
    CHECK(via(DS4_BF16, -2.0) == -2.0 && via(DS4_F16, -2.0) == -2.0, "negative exact");
    CHECK(isnan(via(DS4_BF16, NAN)) && isnan(via(DS4_F16, NAN)), "NaN -> NaN");
    CHECK(via(DS4_BF16, 1e300) == INFINITY, "BF16 overflow -> inf");
    /* F8 */
    CHECK(via(DS4_F8_E4M3, 1.0) == 1.0 && via(DS4_F8_E4M3, 448.0) == 448.0, "E4M3 exact");
    CHECK(via(DS4_F8_E4M3, 464.0) == 448.0, "E4M3 464 (tie) -> 448");
    CHECK(isnan(via(DS4_F8_E4M3, 465.0)) && isnan(via(DS4_F8_E4M3, 1e6)), "E4M3 overflow -> NaN (no inf)");
    CHECK(isnan(via(DS4_F8_E4M3, INFINITY)), "E4M3 inf -> NaN");
    CHECK(via(DS4_F8_E4M3, ldexp(1, -10)) == 0.0, "E4M3 2^-10 (tie) -> 0");
    CHECK(via(DS4_F8_E4M3, ldexp(3, -10)) == ldexp(1, -8), "E4M3 3*2^-10 (tie) -> even 2^-8");
    CHECK(via(DS4_F8_E4M3, 0.001) == ldexp(1, -9), "E4M3 0.001 -> 2^-9");
    CHECK(via(DS4_F8_E4M3, -1.0625) == -1.0, "E4M3 -1.0625 (tie) -> -1");
    CHECK(via(DS4_F8_E5M2, 1.0) == 1.0 && via(DS4_F8_E5M2, 57344.0) == 57344.0, "E5M2 exact");
    CHECK(via(DS4_F8_E5M2, 60000.0) == 57344.0, "E5M2 below the tie -> max");
    CHECK(via(DS4_F8_E5M2, 61440.0) == INFINITY, "E5M2 tie above max -> inf");
    CHECK(via(DS4_F8_E5M2, -1e9) == -INFINITY, "E5M2 overflow -> -inf");
    CHECK(isnan(via(DS4_F8_E5M2, NAN)), "E5M2 NaN");
    CHECK(via(DS4_F8_E8M0, 1.0) == 1.0 && via(DS4_F8_E8M0, 0.25) == 0.25, "E8M0 powers of two");
    CHECK(via(DS4_F8_E8M0, 3.0) == 4.0, "E8M0 1.5*2 (tie) -> up");
    CHECK(via(DS4_F8_E8M0, 2.9) == 2.0, "E8M0 2.9 -> 2");
    CHECK(via(DS4_F8_E8M0, -4.0) == 4.0, "E8M0 ignores the sign");
    CHECK(via(DS4_F8_E8M0, 0.0) == ldexp(1, -127), "E8M0 0 -> 2^-127");
    CHECK(isnan(via(DS4_F8_E8M0, INFINITY)) && isnan(via(DS4_F8_E8M0, NAN)), "E8M0 inf/NaN -> NaN");
    CHECK(isnan(via(DS4_F8_E8M0, ldexp(1.75, 127))), "E8M0 round up past 2^127 -> NaN");
    /* every F8 pattern survives get -> set */
    ds4_dtype f8[3] = {DS4_F8_E4M3, DS4_F8_E5M2, DS4_F8_E8M0};
    for (int k = 0; k < 3; k++) {
        ds4_tensor *t = new1(f8[k], 256);
        if (!t) continue;
        unsigned char *d = t->data;
        int bad = 0;
        for (int b = 0; b < 256; b++) d[b] = (unsigned char)b;
        for (int b = 0; b < 256; b++) {
            double v = ds4_tensor_get(t, b);
            ds4_tensor_set(t, b, v);
            if (isnan(v) ? !isnan(ds4_tensor_get(t, b)) : d[b] != b) bad++;
        }
        CHECK(bad == 0, "%s: %d patterns do not round trip", ds4_dtype_name(f8[k]), bad);
        ds4_tensor_release(t);
    }
    /* integers: truncation toward zero, saturation, NaN -> 0 */
    CHECK(via(DS4_I8, 2.7) == 2 && via(DS4_I8, -2.7) == -2, "I8 truncates");
    CHECK(via(DS4_I8, 300) == 127 && via(DS4_I8, -300) == -128, "I8 saturates");
    CHECK(via(DS4_I8, NAN) == 0, "I8 NaN -> 0");
    CHECK(via(DS4_U8, -5) == 0 && via(DS4_U8, 255.9) == 255 && via(DS4_U8, 1e9) == 255, "U8 saturates");
    CHECK(via(DS4_I16, -32768) == -32768 && via(DS4_I16, 40000) == 32767, "I16");
    CHECK(via(DS4_I32, 2147483647.0) == 2147483647.0 && via(DS4_I32, -3e9) == -2147483648.0, "I32");
    CHECK(via(DS4_I64, 1e30) == 9223372036854775807.0 && via(DS4_I64, -1e30) == -9223372036854775808.0,
          "I64 saturates");
    CHECK(via(DS4_I64, INFINITY) == 9223372036854775807.0 && via(DS4_I64, NAN) == 0, "I64 inf/NaN");
    CHECK(via(DS4_I64, -123456789012.0) == -123456789012.0, "I64 exact");
    CHECK(via(DS4_BOOL, 0.5) == 1 && via(DS4_BOOL, 0) == 0 && via(DS4_BOOL, -0.0) == 0 && via(DS4_BOOL, NAN) == 1,
          "BOOL");
    {
        ds4_tensor *t = new1(DS4_BOOL, 1);
        if (t) {
            *(unsigned char *)t->data = 7;
            CHECK(ds4_tensor_get(t, 0) == 1.0, "BOOL byte 7 reads as 1");
            ds4_tensor_release(t);
        }
        t = new1(DS4_I64, 1);
        if (t) {
            int64_t big = INT64_C(9007199254740993); /* 2^53 + 1: exact in memory, rounded by get */
            memcpy(t->data, &big, 8);
            CHECK(ds4_tensor_get(t, 0) == 9007199254740992.0, "I64 get rounds to a double");
            ds4_tensor_release(t);
        }
    }
}

static void test_tensor_lifecycle(void) {
    ds4_error err;
    ds4_tensor *t = NULL;
    int64_t shape[2] = {2, 3};
    CHECK_OK(ds4_tensor_new(DS4_F32, 2, shape, &t, &err), &err);
    if (t) {
        CHECK(t->dtype == DS4_F32 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3, "header");
        CHECK(t->nbytes == 24 && t->refcount == 1 && t->data, "nbytes %zu refcount %d", t->nbytes, t->refcount);
        CHECK(ds4_tensor_numel(t) == 6, "numel");
        int zero = 1;
        for (int i = 0; i < 6; i++) zero &= ds4_tensor_get(t, i) == 0.0;
        CHECK(zero, "zero-filled");
        for (int i = 0; i < 6; i++) ds4_tensor_set(t, i, i * 1.5);
        CHECK(ds4_tensor_get(t, 5) == 7.5 && ((float *)t->data)[3] == 4.5f, "row-major flat set/get");
        CHECK(isnan(ds4_tensor_get(t, 6)) && isnan(ds4_tensor_get(t, -1)), "out-of-range get -> NaN");
        ds4_tensor_set(t, 6, 1.0);  /* ignored: ASan would catch a write past the end */
        ds4_tensor_set(t, -1, 1.0);
        ds4_tensor_retain(t);
        CHECK(t->refcount == 2, "retain");
        ds4_tensor_release(t);
        CHECK(t->refcount == 1, "release keeps it alive at 1");
        ds4_tensor_release(t); /* frees: ASan/LSan check the rest */
    }
    /* 0-dim scalar */
    t = NULL;
    CHECK_OK(ds4_tensor_new(DS4_BF16, 0, NULL, &t, &err), &err);
    if (t) {
        CHECK(ds4_tensor_numel(t) == 1 && t->nbytes == 2, "scalar numel 1, 2 bytes");
        ds4_tensor_set(t, 0, 3.0);
        CHECK(ds4_tensor_get(t, 0) == 3.0 && isnan(ds4_tensor_get(t, 1)), "scalar get/set");
        ds4_tensor_release(t);
    }
    /* zero-size */
    int64_t zs[3] = {4, 0, 5};
    t = NULL;
    CHECK_OK(ds4_tensor_new(DS4_F64, 3, zs, &t, &err), &err);
    if (t) {
        CHECK(ds4_tensor_numel(t) == 0 && t->nbytes == 0 && t->data, "zero-size tensor: numel 0, data non-NULL");
        CHECK(isnan(ds4_tensor_get(t, 0)), "zero-size get -> NaN");
        ds4_tensor_release(t);
    }
    int64_t zbig[2] = {0, INT64_MAX};
    t = NULL;
    CHECK_OK(ds4_tensor_new(DS4_F32, 2, zbig, &t, &err), &err);
    if (t) ds4_tensor_release(t);
    int64_t max8[DS4_MAX_DIMS] = {1, 2, 1, 2, 1, 2, 1, 2};
    t = NULL;
    CHECK_OK(ds4_tensor_new(DS4_I16, DS4_MAX_DIMS, max8, &t, &err), &err);
    if (t) {
        CHECK(ds4_tensor_numel(t) == 16 && t->nbytes == 32, "8 dims");
        ds4_tensor_release(t);
    }

    /* rejections: out stays NULL, nothing allocated, ARG status */
    struct {
        ds4_dtype dt;
        int32_t ndim;
        int64_t shape[DS4_MAX_DIMS + 1];
        const char *what;
    } bad[] = {
        {DS4_F32, 1, {-1}, "negative dim"},
        {DS4_F32, 3, {2, -3, 4}, "negative middle dim"},
        {DS4_F32, -1, {0}, "ndim -1"},
        {DS4_F32, DS4_MAX_DIMS + 1, {1, 1, 1, 1, 1, 1, 1, 1, 1}, "ndim 9"},
        {DS4_F32, 2, {INT64_C(1) << 62, 4}, "numel fits int64 but bytes overflow"},
        {DS4_F32, 2, {INT64_MAX, 2}, "numel overflows"},
        {DS4_U8, 3, {INT64_C(1) << 32, INT64_C(1) << 32, INT64_C(1) << 32}, "numel overflows (3 dims)"},
        {DS4_F64, 1, {INT64_C(1) << 61}, "bytes overflow"},
        {DS4_DTYPE_COUNT, 1, {1}, "invalid dtype"},
        {(ds4_dtype)-3, 1, {1}, "negative dtype"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        t = (ds4_tensor *)&err; /* poison: must be reset to NULL */
        err.msg[0] = 0;
        ds4_status s = ds4_tensor_new(bad[i].dt, bad[i].ndim, bad[i].shape, &t, &err);
        CHECK(s == DS4_ERR_ARG && t == NULL && err.code == DS4_ERR_ARG && err.msg[0], "%s: got %s (%s)",
              bad[i].what, ds4_status_name(s), err.msg);
    }
    CHECK(ds4_tensor_new(DS4_F32, 2, NULL, &t, &err) == DS4_ERR_ARG, "NULL shape with ndim 2");
    CHECK(ds4_tensor_new(DS4_F32, 0, NULL, NULL, &err) == DS4_ERR_ARG, "NULL out");
    CHECK(ds4_tensor_new(DS4_F32, 1, shape, &t, NULL) == DS4_OK, "NULL err allowed on success");
    ds4_tensor_release(t);
    CHECK(ds4_tensor_new(DS4_F32, 1, (int64_t[]){-1}, &t, NULL) == DS4_ERR_ARG, "NULL err allowed on failure");
    int64_t neg[1] = {-7};
    CHECK_STATUS(ds4_tensor_new(DS4_F32, 1, neg, &t, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "[-7]") && strstr(err.msg, "F32"), "message names dtype and shape: %s", err.msg);

    /* NULL and borrowed views are no-ops for retain/release/numel */
    ds4_tensor_release(NULL);
    ds4_tensor_retain(NULL);
    CHECK(ds4_tensor_numel(NULL) == -1, "numel(NULL) = -1");
    float buf[4] = {1, 2, 3, 4};
    ds4_tensor view = {.dtype = DS4_F32, .ndim = 1, .shape = {4}, .data = buf, .nbytes = sizeof buf, .refcount = 0};
    ds4_tensor_retain(&view);
    ds4_tensor_release(&view);
    CHECK(view.refcount == 0 && ds4_tensor_get(&view, 3) == 4.0, "view untouched by retain/release");
    view.shape[0] = 5; /* inconsistent with nbytes: get must not read past the buffer */
    CHECK(isnan(ds4_tensor_get(&view, 4)), "get checks nbytes, not only the shape");
    view.shape[0] = -1;
    CHECK(ds4_tensor_numel(&view) == -1, "numel of a negative shape = -1");
}

static void test_convert(void) {
    ds4_error err;
    float out[8];
    /* One buffer per dtype holding the same values {1, -2, 0.5, 3}: (where representable) */
    {
        uint16_t bf[4] = {0x3F80, 0xC000, 0x3F00, 0x4040};
        CHECK_OK(ds4_convert_to_f32(DS4_BF16, bf, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0.5f && out[3] == 3, "BF16");
        uint16_t h[4] = {0x3C00, 0xC000, 0x3800, 0x4200};
        CHECK_OK(ds4_convert_to_f32(DS4_F16, h, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0.5f && out[3] == 3, "F16");
        double d[4] = {1, -2, 0.5, 1e300};
        CHECK_OK(ds4_convert_to_f32(DS4_F64, d, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0.5f && isinf(out[3]), "F64 (overflow -> inf)");
        int64_t i64[4] = {1, -2, 0, INT64_MAX};
        CHECK_OK(ds4_convert_to_f32(DS4_I64, i64, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0 && out[3] == 9223372036854775808.0f, "I64");
        int32_t i32[2] = {-7, 100000};
        CHECK_OK(ds4_convert_to_f32(DS4_I32, i32, 2, out, &err), &err);
        CHECK(out[0] == -7 && out[1] == 100000, "I32");
        int16_t i16[2] = {-32768, 32767};
        CHECK_OK(ds4_convert_to_f32(DS4_I16, i16, 2, out, &err), &err);
        CHECK(out[0] == -32768 && out[1] == 32767, "I16");
        int8_t i8[2] = {-128, 127};
        CHECK_OK(ds4_convert_to_f32(DS4_I8, i8, 2, out, &err), &err);
        CHECK(out[0] == -128 && out[1] == 127, "I8");
        uint8_t u8[3] = {0, 200, 255};
        CHECK_OK(ds4_convert_to_f32(DS4_U8, u8, 3, out, &err), &err);
        CHECK(out[0] == 0 && out[1] == 200 && out[2] == 255, "U8");
        CHECK_OK(ds4_convert_to_f32(DS4_BOOL, u8, 3, out, &err), &err);
        CHECK(out[0] == 0 && out[1] == 1 && out[2] == 1, "BOOL");
        uint8_t e4[4] = {0x38, 0xC0, 0x30, 0x7F};
        CHECK_OK(ds4_convert_to_f32(DS4_F8_E4M3, e4, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0.5f && isnan(out[3]), "F8_E4M3");
        uint8_t e5[4] = {0x3C, 0xC0, 0x38, 0x7C};
        CHECK_OK(ds4_convert_to_f32(DS4_F8_E5M2, e5, 4, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == -2 && out[2] == 0.5f && isinf(out[3]), "F8_E5M2");
        uint8_t e8[3] = {127, 126, 255};
        CHECK_OK(ds4_convert_to_f32(DS4_F8_E8M0, e8, 3, out, &err), &err);
        CHECK(out[0] == 1 && out[1] == 0.5f && isnan(out[2]), "F8_E8M0");
        float f[2] = {1.25f, -0.0f};
        CHECK_OK(ds4_convert_to_f32(DS4_F32, f, 2, out, &err), &err);
        CHECK(out[0] == 1.25f && fbits(out[1]) == 0x80000000u, "F32 copy");
    }
    /* unaligned source (as inside an mmap'd safetensors file with an odd header length) */
    {
        unsigned char raw[1 + 3 * 4];
        float vals[3] = {1.5f, -3.0f, 1e-3f};
        memcpy(raw + 1, vals, sizeof vals);
        CHECK_OK(ds4_convert_to_f32(DS4_F32, raw + 1, 3, out, &err), &err);
        CHECK(memcmp(out, vals, sizeof vals) == 0, "unaligned F32");
        uint16_t bf[3] = {0x3FC0, 0xBF80, 0x0001};
        memcpy(raw + 1, bf, sizeof bf);
        CHECK_OK(ds4_convert_to_f32(DS4_BF16, raw + 1, 3, out, &err), &err);
        CHECK(out[0] == 1.5f && out[1] == -1.0f && out[2] == ldexpf(1, -133), "unaligned BF16");
    }
    CHECK_OK(ds4_convert_to_f32(DS4_F32, NULL, 0, NULL, &err), &err);
    CHECK_STATUS(ds4_convert_to_f32(DS4_F32, out, -1, out, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_convert_to_f32(DS4_F32, NULL, 2, out, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_convert_to_f32(DS4_F32, out, 2, NULL, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_convert_to_f32(DS4_DTYPE_COUNT, out, 2, out, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_convert_to_f32(DS4_F64, out, INT64_MAX, out, &err), DS4_ERR_ARG, &err);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    test_dtypes();
    test_bf16();
    test_f16();
    test_nearest_property();
    test_f8();
    test_set_get();
    test_tensor_lifecycle();
    test_convert();
    return ds4t_finish("test_tensor");
}
