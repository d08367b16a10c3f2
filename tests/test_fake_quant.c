/* test_fake_quant.c — the QAT option's arithmetic (core/fake_quant.c) against references written from the formats'
 * definitions, not from the code under test:
 *   - rounding: every finite value of FP8 e4m3 (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
 *     subnormal; S.1111.111 is NaN, so 448 is the largest) and of FP4 e2m1 (2 exponent bits, bias 1, 1 mantissa
 *     bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) is decoded from its bit pattern; ds4_fq_round must give the nearest such value,
 *     ties to the code with an even mantissa, clamped at the largest, for every midpoint, every code value and
 *     20,000 random inputs, with the hand-computed cases below as a second witness;
 *   - scales: 2^ceil(log2(max(amax, floor) / top)) for hand-computed amax;
 *   - the Hadamard rotation: against the matrix H[i][j] = (-1)^popcount(i & j) / sqrt(n) written out, and applied
 *     twice it is the identity;
 *   - a vector: blocks of 64 (e4m3) with a shorter last one, RoPE channels untouched, a NaN or an infinity turning
 *     its own block (only) into NaN.
 * Exact equality everywhere except the rotation, whose fp32 butterflies differ from the matrix product's order by
 * rounding (bound 4 ulps of the vector's norm: log2(32) = 5 levels of one rounding each, over an orthonormal map). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fake_quant.h"
#include "testlib.h"

/* the value of an e4m3 code (NaN for S.1111.111) */
static double e4m3_value(int code) {
    const int s = code >> 7 & 1, e = code >> 3 & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

/* the value of an e2m1 code */
static double e2m1_value(int code) {
    const int s = code >> 3 & 1, e = code >> 1 & 3, m = code & 1;
    const double v = e == 0 ? m * 0.5 : ldexp(1.0 + m / 2.0, e - 1);
    return s ? -v : v;
}

/* nearest finite code value to v (ties to the even mantissa; beyond the largest: the largest) */
static double nearest(double v, int fmt) {
    const int ncode = fmt == DS4_FQ_E4M3 ? 256 : 16, mmask = fmt == DS4_FQ_E4M3 ? 7 : 1;
    double best = NAN, bd = INFINITY;
    int best_code = -1;
    for (int c = 0; c < ncode; c++) {
        const double x = fmt == DS4_FQ_E4M3 ? e4m3_value(c) : e2m1_value(c);
        if (isnan(x)) continue;
        if ((v < 0) != (x < 0) && x != 0) continue; /* keep the sign: -0 and +0 both count as 0 */
        const double d = fabs(v - x);
        if (d < bd || (d == bd && (c & mmask) % 2 == 0 && (best_code & mmask) % 2 == 1)) {
            bd = d;
            best = x;
            best_code = c;
        }
    }
    return best;
}

static int same(float a, double b) { return (isnan(a) && isnan(b)) || (double)a == b || (a == 0 && b == 0); }

static void check_rounding(int fmt, const char *name) {
    const int ncode = fmt == DS4_FQ_E4M3 ? 256 : 16;
    double vals[256];
    int nv = 0;
    for (int c = 0; c < ncode; c++) {
        const double x = fmt == DS4_FQ_E4M3 ? e4m3_value(c) : e2m1_value(c);
        if (!isnan(x) && x >= 0) vals[nv++] = x;
    }
    int bad = 0, n = 0;
    for (int i = 0; i < nv; i++)
        for (int j = 0; j < nv; j++) {
            if (vals[j] <= vals[i]) continue;
            /* the code values and the midpoints between each value and every larger one (the nearest pairs are
             * the ties; the others are ordinary inputs), both signs */
            const double mid = (vals[i] + vals[j]) / 2;
            const double in[4] = {vals[i], -vals[i], mid, -mid};
            for (int k = 0; k < 4; k++, n++)
                if (!same(ds4_fq_round((float)in[k], fmt), nearest((float)in[k], fmt))) {
                    if (bad++ < 5)
                        fprintf(stderr, "%s: round(%.9g) = %.9g, want %.9g\n", name, in[k],
                                (double)ds4_fq_round((float)in[k], fmt), nearest((float)in[k], fmt));
                }
        }
    uint64_t st = 0x9E3779B97F4A7C15ull;
    const double top = fmt == DS4_FQ_E4M3 ? 448 : 6;
    for (int i = 0; i < 20000; i++, n++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const double u = (double)(st >> 11) / 9007199254740992.0;
        /* log-uniform magnitudes from far below the smallest subnormal to past the largest value */
        const float v = (float)((i & 1 ? -1 : 1) * top * 1.3 * exp2(-20.0 * u));
        if (!same(ds4_fq_round(v, fmt), nearest(v, fmt)) && bad++ < 5)
            fprintf(stderr, "%s: round(%.9g) = %.9g, want %.9g\n", name, (double)v, (double)ds4_fq_round(v, fmt),
                    nearest(v, fmt));
    }
    CHECK(bad == 0, "%s: %d of %d roundings differ from the nearest code value", name, bad, n);
    printf("%s: %d inputs rounded to the nearest of the format's %d finite values (ties to even), %d differ\n", name, n,
           fmt == DS4_FQ_E4M3 ? 253 : 15, bad);
}

static void check_cases(void) {
    /* e4m3 by hand: spacing 1/8 on [1, 2), 2 on [16, 32), 16 on [128, 256), 32 on [256, 448] */
    const float e4[][2] = {{1.0625f, 1.0f},   {1.1875f, 1.25f},  {1.0626f, 1.125f}, {17, 16},  {19, 20},
                           {248, 256},        {447, 448},        {448, 448},        {500, 448}, {-500, -448},
                           {0x1p-9f, 0x1p-9f}, {0x1p-10f, 0},     {0x1.8p-9f, 0x1p-8f}};
    for (size_t i = 0; i < sizeof e4 / sizeof e4[0]; i++)
        CHECK(ds4_fq_round(e4[i][0], DS4_FQ_E4M3) == e4[i][1], "e4m3 round(%g) = %g, want %g", (double)e4[i][0],
              (double)ds4_fq_round(e4[i][0], DS4_FQ_E4M3), (double)e4[i][1]);
    const float e2[][2] = {{0.25f, 0},   {0.26f, 0.5f}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2},
                           {3.5f, 4},    {5, 4},        {5.5f, 6},  {7, 6},     {-0.75f, -1}};
    for (size_t i = 0; i < sizeof e2 / sizeof e2[0]; i++)
        CHECK(ds4_fq_round(e2[i][0], DS4_FQ_E2M1) == e2[i][1], "e2m1 round(%g) = %g, want %g", (double)e2[i][0],
              (double)ds4_fq_round(e2[i][0], DS4_FQ_E2M1), (double)e2[i][1]);
    CHECK(isnan(ds4_fq_round(NAN, DS4_FQ_E4M3)), "NaN rounds to NaN");
    /* scales: 448 -> 1, just above -> 2, 224 -> 1/2, 1 -> 2^ceil(log2(1/448)) = 2^-8, 0 -> the floor 1e-4/448
     * (log2 = -22.1) -> 2^-22; e2m1: 6 -> 1, 6.01 -> 2, 3 -> 1/2, 0 -> 2^-126 */
    const float sc[][3] = {{448, DS4_FQ_E4M3, 1},        {449, DS4_FQ_E4M3, 2},      {224, DS4_FQ_E4M3, 0.5f},
                           {1, DS4_FQ_E4M3, 0x1p-8f},    {0, DS4_FQ_E4M3, 0x1p-22f}, {6, DS4_FQ_E2M1, 1},
                           {6.01f, DS4_FQ_E2M1, 2},      {3, DS4_FQ_E2M1, 0.5f},     {0, DS4_FQ_E2M1, 0x1p-126f}};
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++)
        CHECK(ds4_fq_scale(sc[i][0], (int32_t)sc[i][1]) == sc[i][2], "scale(%g, fmt %d) = %g, want %g",
              (double)sc[i][0], (int)sc[i][1], (double)ds4_fq_scale(sc[i][0], (int32_t)sc[i][1]), (double)sc[i][2]);
    CHECK(isnan(ds4_fq_scale(NAN, DS4_FQ_E4M3)), "a NaN amax gives a NaN scale");
    CHECK(isnan(ds4_fq_scale(INFINITY, DS4_FQ_E4M3)) && isnan(ds4_fq_scale(INFINITY, DS4_FQ_E2M1)),
          "an infinite amax gives a NaN scale (an overflow does not hide as the largest value)");
}

static void check_hadamard(void) {
    enum { N = 32 };
    float x[N], y[N], ref[N];
    double worst = 0, worst2 = 0, norm = 0;
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < N; i++) x[i] = y[i] = (float)sin(1.7 * i + 0.3 * trial) * (float)(1 + trial);
        for (int i = 0; i < N; i++) {
            double s = 0;
            for (int j = 0; j < N; j++) s += (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) * x[j];
            ref[i] = (float)(s / sqrt((double)N));
        }
        ds4_hadamard(y, N);
        norm = 0;
        for (int i = 0; i < N; i++) norm += (double)x[i] * x[i];
        norm = sqrt(norm);
        for (int i = 0; i < N; i++) worst = fmax(worst, fabs((double)y[i] - ref[i]) / norm);
        ds4_hadamard(y, N);
        for (int i = 0; i < N; i++) worst2 = fmax(worst2, fabs((double)y[i] - x[i]) / norm);
    }
    CHECK(worst <= 4 * 0x1p-23, "hadamard vs the matrix: %.3g of the norm", worst);
    CHECK(worst2 <= 8 * 0x1p-23, "hadamard twice vs identity: %.3g of the norm", worst2);
    float e[4] = {1, 0, 0, 0};
    ds4_hadamard(e, 4);
    CHECK(e[0] == 0.5f && e[1] == 0.5f && e[2] == 0.5f && e[3] == 0.5f, "H e0 = (1/2, 1/2, 1/2, 1/2)");
    printf("hadamard (32): vs the matrix %.3g, twice vs identity %.3g (of the norm)\n", worst, worst2);
}

static void check_vector(void) {
    /* width 80: 72 quantised channels (a block of 64, then one of 8), 8 RoPE channels left alone */
    enum { W = 80, NQ = 72 };
    float x[W], orig[W];
    for (int i = 0; i < W; i++) x[i] = orig[i] = (float)(cos(0.37 * i) * (i < 64 ? 100.0 : 0.01));
    ds4_fq q = {.fmt = DS4_FQ_E4M3, .nq = NQ};
    ds4_fake_quant_row(x, W, &q);
    for (int b = 0; b < 2; b++) {
        const int b0 = b * 64, b1 = b ? NQ : 64;
        float amax = 0;
        for (int i = b0; i < b1; i++) amax = fmaxf(amax, fabsf(orig[i]));
        /* the scale by the definition: the smallest power of two s with amax / s <= 448 */
        double s = 1;
        while (amax / s > 448) s *= 2;
        while (amax / (s / 2) <= 448 && s / 2 >= 1e-4 / 448) s /= 2;
        int bad = 0;
        for (int i = b0; i < b1; i++) bad += !same(x[i], nearest(orig[i] / s, DS4_FQ_E4M3) * s);
        CHECK(bad == 0, "block %d: %d values differ from nearest(x / s) * s", b, bad);
    }
    int moved = 0;
    for (int i = NQ; i < W; i++) moved += x[i] != orig[i];
    CHECK(moved == 0, "the %d RoPE channels are left alone (%d moved)", W - NQ, moved);
    for (int i = 0; i < W; i++) x[i] = orig[i];
    x[70] = NAN;
    ds4_fake_quant_row(x, W, &q);
    int nan0 = 0, nan1 = 0;
    for (int i = 0; i < 64; i++) nan0 += isnan(x[i]);
    for (int i = 64; i < NQ; i++) nan1 += isnan(x[i]);
    CHECK(nan0 == 0 && nan1 == NQ - 64, "a NaN spreads over its own block only (%d, %d)", nan0, nan1);
    for (int i = 0; i < W; i++) x[i] = orig[i];
    x[3] = -INFINITY;
    ds4_fake_quant_row(x, W, &q);
    nan0 = nan1 = 0;
    for (int i = 0; i < 64; i++) nan0 += isnan(x[i]);
    for (int i = 64; i < W; i++) nan1 += isnan(x[i]);
    CHECK(nan0 == 64 && nan1 == 0, "an infinity makes its own block NaN, and only it (%d, %d)", nan0, nan1);
}

int main(void) {
    check_cases();
    check_rounding(DS4_FQ_E4M3, "e4m3");
    check_rounding(DS4_FQ_E2M1, "e2m1");
    check_hadamard();
    check_vector();
    return ds4t_finish("test_fake_quant");
}
