/* test_sample.c — ds4_sample, ds4_sample_uniform and ds4_finish_name (core/sample.c) against independent
 * references:
 * 1. hand-computed cases on logits log{1,2,3,4} (p = 0.1..0.4): lp_model, greedy, each filter alone, temperature
 *    (p ∝ i^(1/T) by its own formula), and combinations whose result depends on the filter order;
 * 2. a naive O(V²) implementation written here from the definitions, against ds4_sample on random logits
 *    (V = 1, 7, 300, with ties and -inf), random parameters and random u;
 * 3. a chi-square test of 200k draws driven by ds4_sample_uniform;
 * 4. ds4_sample_uniform: determinism, range, distinct streams / steps, mean and variance;
 * 5. every error path, greedy ties, finish names. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

/* The logits are floats, so log{1,2,3,4} carry a rounding error of up to 2^-24 · |log 4| ≈ 8e-8 each; a
 * log-probability built from two of them is off by < 2e-7 from the exact value: the hand cases use 1e-6. */
#define HAND_TOL 1e-6

static void *g_scratch; /* sized for the largest V used */

static int64_t draw(const float *l, int64_t V, ds4_sampling sp, double u, double *lpm, double *lps) {
    ds4_error err = {0};
    int64_t id = ds4_sample(l, V, &sp, u, lpm, lps, g_scratch, &err);
    CHECK(id >= 0, "ds4_sample failed: %s", err.msg);
    return id;
}

static ds4_sampling plain(double T) { return (ds4_sampling){.temperature = T, .top_k = 0, .top_p = 1, .min_p = 0}; }

/* Expect id `want` with lp_sample log(q) (q = 0: lp_sample 0 expected, the greedy convention). */
static void expect(const float *l, int64_t V, ds4_sampling sp, double u, int64_t want, double q, int line) {
    double lpm, lps;
    int64_t id = draw(l, V, sp, u, &lpm, &lps);
    double want_lps = q > 0 ? log(q) : 0;
    CHECK(id == want && fabs(lps - want_lps) < HAND_TOL, "line %d (u=%g): id %lld lp_sample %.9f, want %lld %.9f",
          line, u, (long long)id, lps, (long long)want, want_lps);
}
#define EXPECT(sp, u, want, q) expect(L4, 4, (sp), (u), (want), (q), __LINE__)

static float L4[4];

static void test_hand(void) {
    for (int i = 0; i < 4; i++) L4[i] = logf((float)(i + 1));
    /* unfiltered, T = 1: cumulative 0.1, 0.3, 0.6, 1.0 in id order; lp_model = lp_sample = log((i+1)/10) */
    const double us[4] = {0.05, 0.2, 0.45, 0.8};
    for (int i = 0; i < 4; i++) {
        double lpm, lps;
        int64_t id = draw(L4, 4, plain(1), us[i], &lpm, &lps);
        double want = log((i + 1) / 10.0);
        CHECK(id == i && fabs(lpm - want) < HAND_TOL && fabs(lps - want) < HAND_TOL,
              "T=1 u=%g: id %lld lp_model %.9f lp_sample %.9f, want %d %.9f", us[i], (long long)id, lpm, lps, i, want);
    }
    /* greedy: id 3, lp_sample 0, lp_model log 0.4, whatever u */
    double lpm, lps;
    CHECK(draw(L4, 4, plain(0), 0.99, &lpm, &lps) == 3 && lps == 0 && fabs(lpm - log(0.4)) < HAND_TOL,
          "greedy: lp_model %.9f lp_sample %g", lpm, lps);

    ds4_sampling s = plain(1);
    const double u_last = 1 - 0x1.0p-53; /* the largest u ds4_sample_uniform can return */
    /* top-k 2: {2, 3} with 3/7, 4/7; the boundary in u is 3/7 = 0.428571 */
    s.top_k = 2;
    EXPECT(s, 0.0, 2, 3 / 7.0);
    EXPECT(s, 0.42, 2, 3 / 7.0);
    EXPECT(s, 0.44, 3, 4 / 7.0);
    EXPECT(s, u_last, 3, 4 / 7.0);
    s.top_k = 4; /* k >= V: off */
    EXPECT(s, 0.05, 0, 0.1);
    s.top_k = 100;
    EXPECT(s, 0.05, 0, 0.1);
    /* top-p 0.65: 0.4 < 0.65 <= 0.4 + 0.3, so {3, 2}; 0.75 needs {3, 2, 1} (0.9): 2/9, 3/9, 4/9; 0.35: {3} alone
     * (0.4 itself is avoided: the float logits put the cumulative mass within rounding of it) */
    s = plain(1);
    s.top_p = 0.65;
    EXPECT(s, 0.42, 2, 3 / 7.0);
    EXPECT(s, 0.44, 3, 4 / 7.0);
    s.top_p = 0.75;
    EXPECT(s, 0.2, 1, 2 / 9.0);
    EXPECT(s, 0.3, 2, 3 / 9.0);
    EXPECT(s, 0.6, 3, 4 / 9.0);
    s.top_p = 0.35;
    EXPECT(s, 0.0, 3, 1.0);
    EXPECT(s, u_last, 3, 1.0);
    /* min-p relative to p_max = 0.4: 0.6 → p >= 0.24: {2, 3}; 0.45 → p >= 0.18: {1, 2, 3}; 0.8 → p >= 0.32: {3}.
     * (0.5 would put token 1 exactly on the threshold 0.2, decided by the rounding of the float logits.) */
    s = plain(1);
    s.min_p = 0.6;
    EXPECT(s, 0.42, 2, 3 / 7.0);
    EXPECT(s, 0.44, 3, 4 / 7.0);
    s.min_p = 0.45;
    EXPECT(s, 0.2, 1, 2 / 9.0);
    EXPECT(s, 0.6, 3, 4 / 9.0);
    s.min_p = 0.8;
    EXPECT(s, 0.1, 3, 1.0);
    s.min_p = 1; /* only the maximum (and its ties) */
    EXPECT(s, 0.1, 3, 1.0);

    /* temperature: exp(log(i+1) / T) = (i+1)^(1/T); T = 2: ∝ sqrt(i+1), T = 0.5: ∝ (i+1)^2 / 30 */
    const double Ts[2] = {2, 0.5};
    for (int t = 0; t < 2; t++) {
        double q[4], z = 0, cum = 0;
        for (int i = 0; i < 4; i++) z += q[i] = pow(i + 1, 1 / Ts[t]);
        for (int i = 0; i < 4; i++) {
            q[i] /= z;
            double u = cum + q[i] / 2; /* middle of token i's interval */
            cum += q[i];
            double m, sl;
            int64_t id = draw(L4, 4, plain(Ts[t]), u, &m, &sl);
            CHECK(id == i && fabs(sl - log(q[i])) < HAND_TOL && fabs(m - log((i + 1) / 10.0)) < HAND_TOL,
                  "T=%g u=%g: id %lld lp_sample %.9f lp_model %.9f, want %d %.9f %.9f", Ts[t], u, (long long)id, sl,
                  m, i, log(q[i]), log((i + 1) / 10.0));
        }
    }

    /* Order. top-k 2 then top-p 0.5: {2, 3} renormalised is 3/7, 4/7 and 4/7 >= 0.5 keeps {3} alone; top-p
     * first would keep {3, 2} (0.4 < 0.5) and top-k 2 would leave it so: u = 0.1 would then give id 2. */
    s = plain(1);
    s.top_k = 2;
    s.top_p = 0.5;
    EXPECT(s, 0.1, 3, 1.0);
    /* top-p 0.5 then min-p 0.6: {3, 2}, then 3/7 >= 0.6 · 4/7 keeps both; min-p first would keep {2, 3} and
     * top-p 0.5 over 3/7, 4/7 would then keep {3} alone. */
    s = plain(1);
    s.top_p = 0.5;
    s.min_p = 0.6;
    EXPECT(s, 0.1, 2, 3 / 7.0);
    EXPECT(s, 0.5, 3, 4 / 7.0);
    /* temperature before top-p: at T = 2 the probabilities are sqrt(i+1)/Σ = .163 .230 .282 .325, so top-p 0.38
     * keeps {3, 2} (at T = 1 it would keep {3} alone, 0.4 >= 0.38) */
    double r2 = sqrt(2), r3 = sqrt(3), r4 = 2;
    s = plain(2);
    s.top_p = 0.38;
    EXPECT(s, 0.1, 2, r3 / (r3 + r4));
    EXPECT(s, 0.9, 3, r4 / (r3 + r4));
    /* temperature before min-p: at T = 2, p / p_max = sqrt((i+1)/4) = .5 .707 .866 1, so min-p 0.8 keeps {2, 3}
     * (at T = 1 only {3}); with min-p 0.6, also token 1 */
    s = plain(2);
    s.min_p = 0.8;
    EXPECT(s, 0.1, 2, r3 / (r3 + r4));
    s.min_p = 0.6;
    EXPECT(s, 0.1, 1, r2 / (r2 + r3 + r4));
    /* all four: T = 0.5 (1, 4, 9, 16 / 30), top-k 3 → {1, 2, 3} = 4, 9, 16 / 29; top-p 0.6: 16/29 = .55 < .6, so
     * {3, 2}; min-p 0.5: 9 >= 0.5 · 16 keeps both: 9/25, 16/25 */
    s = (ds4_sampling){.temperature = 0.5, .top_k = 3, .top_p = 0.6, .min_p = 0.5};
    EXPECT(s, 0.3, 2, 9 / 25.0);
    EXPECT(s, 0.4, 3, 16 / 25.0);
}

static void test_ties_and_inf(void) {
    const float g[5] = {1, 5, 5, 2, 5};
    double lpm, lps;
    CHECK(draw(g, 5, plain(0), 0.5, &lpm, &lps) == 1, "greedy tie must pick the lowest id");
    /* top-k 2 over {0, 1, 1, 1}: tokens 1 and 2 (lower ids first among the tied), 1/2 each; token 3 never */
    const float t[4] = {0, 1, 1, 1};
    ds4_sampling s = plain(1);
    s.top_k = 2;
    expect(t, 4, s, 0.25, 1, 0.5, __LINE__);
    expect(t, 4, s, 0.75, 2, 0.5, __LINE__);
    expect(t, 4, s, 1 - 0x1.0p-53, 2, 0.5, __LINE__);
    /* top-p ties: tokens 1..3 have e / (1 + 3e) = 0.297 each, token 0 has 0.109; top-p 0.5 keeps tokens 1 and 2
     * (0.297 < 0.5 <= 0.594), the lower ids among the tied */
    s = plain(1);
    s.top_p = 0.5;
    expect(t, 4, s, 0.9, 2, 0.5, __LINE__);
    /* -inf logits have probability 0 and are never drawn, even at u = 0 or at the end */
    const float ni[4] = {-INFINITY, 0, -INFINITY, -INFINITY};
    const double us[3] = {0, 0.5, 1 - 0x1.0p-53};
    for (int k = 0; k < 3; k++) {
        ds4_sampling v = plain(1);
        v.top_k = 3; /* keeps two weight-0 tokens after id 1 */
        int64_t id = draw(ni, 4, v, us[k], &lpm, &lps);
        CHECK(id == 1 && lpm == 0 && lps == 0, "-inf logits: u %g gave id %lld (lp_model %g, lp_sample %g)", us[k],
              (long long)id, lpm, lps);
    }
}

/* ------------------------------------------------------------------------------------------------ naive reference */

/* Written from the definitions, not from sample.c: full distribution without max subtraction (the random logits
 * are within [-8, 8] and T >= 0.25, so exp stays below e^32), then each filter as an O(V²) loop over a keep mask,
 * then the inverse CDF over normalised probabilities in id order. */
static int64_t naive_sample(const float *l, int64_t V, ds4_sampling sp, double u, double *lpm, double *lps) {
    double z1 = 0;
    for (int64_t i = 0; i < V; i++) z1 += exp((double)l[i]);
    int64_t id = -1;
    if (sp.temperature == 0) {
        for (int64_t i = 0; i < V; i++)
            if (id < 0 || l[i] > l[id]) id = i;
        *lpm = log(exp((double)l[id]) / z1);
        *lps = 0;
        return id;
    }
    double *p = malloc((size_t)V * sizeof *p), zt = 0;
    char *keep = malloc((size_t)V);
    for (int64_t i = 0; i < V; i++) zt += p[i] = exp((double)l[i] / sp.temperature);
    for (int64_t i = 0; i < V; i++) p[i] /= zt, keep[i] = 1;
#define AHEAD(j, i) (p[j] > p[i] || (p[j] == p[i] && (j) < (i))) /* j sorts before i */
    if (sp.top_k > 0)
        for (int64_t i = 0; i < V; i++) {
            int64_t rank = 0;
            for (int64_t j = 0; j < V; j++) rank += AHEAD(j, i);
            keep[i] = rank < sp.top_k;
        }
    if (sp.top_p < 1) {
        double tot = 0;
        for (int64_t i = 0; i < V; i++) tot += keep[i] ? p[i] : 0;
        char *k2 = malloc((size_t)V);
        for (int64_t i = 0; i < V; i++) { /* in the prefix iff the mass strictly ahead of it is < top_p */
            double before = 0;
            for (int64_t j = 0; j < V; j++)
                if (keep[j] && AHEAD(j, i)) before += p[j] / tot;
            k2[i] = keep[i] && before < sp.top_p;
        }
        memcpy(keep, k2, (size_t)V);
        free(k2);
    }
    if (sp.min_p > 0) {
        double tot = 0, mx = 0;
        for (int64_t i = 0; i < V; i++)
            if (keep[i]) tot += p[i], mx = fmax(mx, p[i]);
        for (int64_t i = 0; i < V; i++) keep[i] = keep[i] && p[i] / tot >= sp.min_p * (mx / tot);
    }
    double tot = 0, cum = 0;
    for (int64_t i = 0; i < V; i++) tot += keep[i] ? p[i] : 0;
    for (int64_t i = 0; i < V && id < 0; i++) {
        if (!keep[i]) continue;
        cum += p[i] / tot;
        if (cum > u) id = i;
    }
    if (id < 0) /* rounding at the very end: the last kept token of nonzero probability */
        for (int64_t i = 0; i < V; i++)
            if (keep[i] && p[i] > 0) id = i;
    *lpm = log(exp((double)l[id]) / z1);
    *lps = log(p[id] / tot);
    free(p);
    free(keep);
    return id;
#undef AHEAD
}

/* xorshift64*: the test's own random numbers, independent of ds4_sample_uniform */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}
static double rng_unif(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

/* Tolerance 1e-9 on lp_model / lp_sample: both sides are double throughout and differ only in the order of
 * summation and in max subtraction, a few ulps (~1e-15 relative) on log-probabilities of magnitude < 100 over at
 * most 300 terms; any wrong filter or normalisation moves them by far more. The chosen ids can only differ when u
 * or top_p / min_p lands within rounding (~1e-15) of a boundary, which continuous random draws do not. */
static void test_random(void) {
    const int64_t Vs[3] = {1, 7, 300};
    uint64_t st = 0x5EED5A3B1E5ull;
    float l[300];
    int mism = 0, cases = 0, filtered = 0;
    for (int v = 0; v < 3; v++) {
        const int64_t V = Vs[v];
        for (int c = 0; c < 2000; c++) {
            double mode = rng_unif(&st);
            for (int64_t i = 0; i < V; i++) {
                double x = -8 + 16 * rng_unif(&st);
                if (mode < 0.3) x = floor(x * 2) / 2; /* coarse grid: many ties */
                if (mode > 0.8 && rng_unif(&st) < 0.2) x = -INFINITY;
                l[i] = (float)x;
            }
            l[rng_next(&st) % (uint64_t)V] = (float)(-8 + 16 * rng_unif(&st)); /* at least one finite */
            ds4_sampling sp = plain(rng_unif(&st) < 0.1 ? 0 : 0.25 + 2.75 * rng_unif(&st));
            if (rng_unif(&st) < 0.5) sp.top_k = 1 + (int64_t)(rng_next(&st) % (uint64_t)(V + 2));
            if (rng_unif(&st) < 0.5) sp.top_p = 0.02 + 0.98 * rng_unif(&st);
            if (rng_unif(&st) < 0.5) sp.min_p = rng_unif(&st) < 0.1 ? 1.0 : rng_unif(&st);
            filtered += sp.top_k > 0 || sp.top_p < 1 || sp.min_p > 0;
            double u = rng_unif(&st), am, as, bm, bs;
            int64_t a = draw(l, V, sp, u, &am, &as);
            int64_t b = naive_sample(l, V, sp, u, &bm, &bs);
            cases++;
            if (a != b || !(fabs(am - bm) < 1e-9) || !(fabs(as - bs) < 1e-9)) {
                if (mism++ < 5)
                    CHECK(0, "V=%lld case %d (T %g k %lld p %g min_p %g u %.17g): ds4 %lld (%.12f, %.12f), naive %lld "
                          "(%.12f, %.12f)", (long long)V, c, sp.temperature, (long long)sp.top_k, sp.top_p, sp.min_p,
                          u, (long long)a, am, as, (long long)b, bm, bs);
            }
        }
    }
    CHECK(mism == 0, "%d of %d random cases differ from the naive reference", mism, cases);
    CHECK(filtered > cases / 2, "only %d of %d cases exercised a filter", filtered, cases);
}

/* 200k draws from a 5-token distribution with u = ds4_sample_uniform over streams and steps; chi-square against
 * the exact probabilities of the float logits. The survival function at 4 degrees of freedom is
 * e^(-x/2)·(1 + x/2): 33.4 gives p ≈ 1e-6. Deterministic given the seed, so it cannot flake: it fails only if the
 * draw or the generator is biased. Also with top-k 3 (tokens 2..4 renormalised, 0 and 1 never drawn): 2 degrees
 * of freedom there, where the same threshold is p ≈ 6e-8. */
static void test_chi_square(void) {
    const float l[5] = {logf(0.1f), logf(0.15f), logf(0.2f), logf(0.25f), logf(0.3f)};
    for (int pass = 0; pass < 2; pass++) {
        ds4_sampling s = plain(1);
        if (pass) s.top_k = 3;
        double q[5], z = 0;
        for (int i = 0; i < 5; i++) z += q[i] = (pass && i < 2) ? 0 : exp((double)l[i]);
        int64_t obs[5] = {0};
        const int N = 200000;
        for (int k = 0; k < N; k++) {
            double lpm, lps;
            int64_t id = draw(l, 5, s, ds4_sample_uniform(42, (uint64_t)k / 1000, (uint64_t)k % 1000), &lpm, &lps);
            if (id >= 0 && id < 5) obs[id]++;
        }
        double chi = 0;
        for (int i = 0; i < 5; i++) {
            if (q[i] == 0) {
                CHECK(obs[i] == 0, "top-k 3 drew excluded token %d %lld times", i, (long long)obs[i]);
                continue;
            }
            double e = N * q[i] / z;
            chi += (obs[i] - e) * (obs[i] - e) / e;
        }
        CHECK(chi < 33.4, "pass %d: chi-square %.2f >= 33.4 (counts %lld %lld %lld %lld %lld)", pass, chi,
              (long long)obs[0], (long long)obs[1], (long long)obs[2], (long long)obs[3], (long long)obs[4]);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void test_uniform(void) {
    CHECK(ds4_sample_uniform(7, 3, 9) == ds4_sample_uniform(7, 3, 9), "not deterministic");
    const double base = ds4_sample_uniform(7, 3, 9);
    CHECK(base != ds4_sample_uniform(8, 3, 9) && base != ds4_sample_uniform(7, 4, 9) &&
              base != ds4_sample_uniform(7, 3, 10) && base != ds4_sample_uniform(7, 9, 3),
          "seed, stream and step must all change the draw");
    CHECK(ds4_sample_uniform(0, 0, 0) != ds4_sample_uniform(0, 0, 1), "zero inputs");
    enum { N = 100000 };
    double *d = malloc(N * sizeof *d), sum = 0, sq = 0;
    int in_range = 1;
    for (int k = 0; k < N; k++) {
        d[k] = ds4_sample_uniform(1234, (uint64_t)k % 100, (uint64_t)k / 100);
        in_range &= d[k] >= 0 && d[k] < 1;
        sum += d[k];
        sq += (d[k] - 0.5) * (d[k] - 0.5);
    }
    CHECK(in_range, "a draw outside [0, 1)");
    /* the mean's standard deviation is sqrt(1/12 / 1e5) = 9.1e-4: 0.005 is 5.5 sigma (and deterministic) */
    CHECK(fabs(sum / N - 0.5) < 0.005, "mean %.5f", sum / N);
    CHECK(fabs(sq / N - 1 / 12.0) < 0.003, "variance %.5f, want 1/12", sq / N);
    qsort(d, N, sizeof *d, cmp_double);
    int dup = 0;
    for (int k = 1; k < N; k++) dup += d[k] == d[k - 1];
    CHECK(dup == 0, "%d repeated draws among 1e5 distinct (stream, step)", dup);
    free(d);
}

static void bad(const float *l, int64_t V, ds4_sampling sp, double u, int use_nulls, const char *what,
                const char *needle) {
    ds4_error err;
    memset(&err, 0, sizeof err);
    double lpm, lps;
    void *scr = g_scratch;
    int64_t id = ds4_sample(use_nulls == 1 ? NULL : l, V, use_nulls == 2 ? NULL : &sp, u,
                            use_nulls == 3 ? NULL : &lpm, use_nulls == 4 ? NULL : &lps, use_nulls == 5 ? NULL : scr,
                            &err);
    CHECK(id == -1 && err.msg[0] && err.code == DS4_ERR_ARG, "%s: returned %lld, message '%s'", what, (long long)id,
          err.msg);
    if (needle) CHECK(strstr(err.msg, needle) != NULL, "%s: message '%s' lacks '%s'", what, err.msg, needle);
    /* a NULL error pointer is allowed */
    CHECK(ds4_sample(use_nulls == 1 ? NULL : l, V, use_nulls == 2 ? NULL : &sp, u, use_nulls == 3 ? NULL : &lpm,
                     use_nulls == 4 ? NULL : &lps, use_nulls == 5 ? NULL : scr, NULL) == -1,
          "%s with err NULL", what);
}

static void test_errors(void) {
    const float ok[3] = {0, 1, 2};
    ds4_sampling s = plain(1);
    for (int k = 1; k <= 5; k++) bad(ok, 3, s, 0.5, k, "NULL pointer", "NULL");
    bad(ok, 0, s, 0.5, 0, "V = 0", "V = 0");
    bad(ok, -3, s, 0.5, 0, "V < 0", "V = -3");
    bad(ok, INT64_MAX, s, 0.5, 0, "V too large for scratch", NULL);
    const float nan_l[3] = {0, 1, NAN};
    bad(nan_l, 3, s, 0.5, 0, "NaN logit", "logits[2]");
    const float pinf[3] = {0, INFINITY, 1};
    bad(pinf, 3, s, 0.5, 0, "+inf logit", "logits[1]");
    const float ninf[3] = {-INFINITY, -INFINITY, -INFINITY};
    bad(ninf, 3, s, 0.5, 0, "all -inf", "-inf");
    bad(ninf, 3, plain(0), 0.5, 0, "all -inf, greedy", "-inf");
    const double badT[3] = {-1, NAN, INFINITY};
    for (int k = 0; k < 3; k++) bad(ok, 3, plain(badT[k]), 0.5, 0, "temperature", "temperature");
    s.top_k = -1;
    bad(ok, 3, s, 0.5, 0, "top_k < 0", "top_k");
    const double badP[3] = {-0.5, 1.5, NAN}; /* 0 is valid: off, so a zero-initialised ds4_sampling is greedy */
    for (int k = 0; k < 3; k++) {
        s = plain(1);
        s.top_p = badP[k];
        bad(ok, 3, s, 0.5, 0, "top_p", "top_p");
    }
    const double badM[3] = {-0.1, 1.1, NAN};
    for (int k = 0; k < 3; k++) {
        s = plain(1);
        s.min_p = badM[k];
        bad(ok, 3, s, 0.5, 0, "min_p", "min_p");
    }
    const double badU[4] = {-0.1, 1, 2, NAN};
    for (int k = 0; k < 4; k++) bad(ok, 3, plain(1), badU[k], 0, "u", "u ");
    CHECK(ds4_sample_scratch_bytes(0) == 0 && ds4_sample_scratch_bytes(-1) == 0, "scratch for V < 1");
    CHECK(ds4_sample_scratch_bytes(INT64_MAX) == 0, "scratch size overflow must give 0");
    CHECK(ds4_sample_scratch_bytes(300) >= 300 * 12, "scratch too small to hold a weight and an id per token");
}

static void test_finish_names(void) {
    const char *want[6] = {"none", "length", "eos", "stop_token", "stop_string", "cancelled"};
    const ds4_finish f[6] = {DS4_FINISH_NONE, DS4_FINISH_LENGTH, DS4_FINISH_EOS, DS4_FINISH_STOP_TOKEN,
                             DS4_FINISH_STOP_STRING, DS4_FINISH_CANCELLED};
    for (int i = 0; i < 6; i++)
        CHECK(strcmp(ds4_finish_name(f[i]), want[i]) == 0, "finish %d: '%s'", i, ds4_finish_name(f[i]));
    CHECK(strcmp(ds4_finish_name((ds4_finish)99), "unknown") == 0, "unknown finish");
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    g_scratch = malloc(ds4_sample_scratch_bytes(300));
    test_hand();
    test_ties_and_inf();
    test_random();
    test_chi_square();
    test_uniform();
    test_errors();
    test_finish_names();
    free(g_scratch);
    return ds4t_finish("test_sample");
}
