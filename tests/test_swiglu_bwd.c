/* test_swiglu_bwd.c — the CPU's SwiGLU backward (ops.h: swiglu_bwd) with and without the exps its act pass hands to
 * its gradient pass (ex). The backward runs the op twice over the same pre-activations: act = silu(min(g1, λ)) ·
 * clamp(g3, ±λ) for the down projection's weight gradient, then dg1 / dg3. Given ex, the act pass leaves exp(−g)
 * there and the gradient pass takes its sigmoid from it instead of a second expf, which is only right if every byte
 * stays what it was:
 *   - act, dg1 and dg3 with ex equal those without, byte for byte (dg3 apart from dact and written over it, as the
 *     schedule does), and ex holds expf(−min(g1, λ)) exactly;
 *   - against a closed form in double (an independent reference): silu(g)·u, and dg1 = dact·u·σ(g)(1 + g(1 − σ(g)))
 *     where g1 <= λ (else 0), dg3 = dact·silu(g) where |g3| <= λ (else 0), within 1e-5 relative to the largest
 *     value (fp32 expressions of a few roundings each: ~1e-7; a wrong clamp, factor or sign is O(1)).
 * Inputs straddle the clamps (λ = 3, values in ±6) and include 0 and ±λ exactly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "testlib.h"

static uint64_t rs = 0xd1b54a32d192ed03ull;
static float frand(float lo, float hi) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return lo + (hi - lo) * (float)((double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0));
}

static void t_swiglu(ds4_engine *e, int64_t rows, int64_t I) {
    const int64_t n = rows * I;
    const float lim = 3.0f;
    char what[64];
    snprintf(what, sizeof what, "swiglu_bwd [%lld x %lld]", (long long)rows, (long long)I);
    ds4_dev *d = NULL;
    ds4_error err;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (!d) return;
    float *buf = malloc((size_t)n * 12 * sizeof(float));
    if (!buf) {
        CHECK(0, "allocation");
        ds4_dev_release(d);
        return;
    }
    float *g1 = buf, *g3 = buf + n, *dact = buf + 2 * n, *act0 = buf + 3 * n, *act1 = buf + 4 * n, *ex = buf + 5 * n;
    float *dg1a = buf + 6 * n, *dg3a = buf + 7 * n, *dg1b = buf + 8 * n, *dg3b = buf + 9 * n, *dexb = buf + 10 * n;
    for (int64_t i = 0; i < n; i++) g1[i] = frand(-6, 6), g3[i] = frand(-6, 6), dact[i] = frand(-1, 1);
    g1[0] = 0, g1[1 % n] = lim, g3[2 % n] = -lim, g3[3 % n] = lim; /* the clamps' edges */
    memset(act0, 0xff, (size_t)n * 2 * sizeof(float)), memset(ex, 0xff, (size_t)n * sizeof(float));
    OP(d, swiglu_bwd, .g1 = g1, .g3 = g3, .act = act0, .rows = rows, .I = I, .lim = lim);
    OP(d, swiglu_bwd, .g1 = g1, .g3 = g3, .act = act1, .rows = rows, .I = I, .lim = lim, .ex = ex);
    /* the gradient pass apart (dg3 its own buffer) without and with ex, then with dg3 over a copy of dact */
    OP(d, swiglu_bwd, .g1 = g1, .g3 = g3, .dact = dact, .dg1 = dg1a, .dg3 = dg3a, .rows = rows, .I = I, .lim = lim,
       .grads = 1);
    OP(d, swiglu_bwd, .g1 = g1, .g3 = g3, .dact = dact, .dg1 = dg1b, .dg3 = dg3b, .rows = rows, .I = I, .lim = lim,
       .grads = 1, .ex = ex);
    memcpy(dexb, dact, (size_t)n * sizeof(float));
    float *dg1c = buf + 11 * n;
    OP(d, swiglu_bwd, .g1 = g1, .g3 = g3, .dact = dexb, .dg1 = dg1c, .dg3 = dexb, .rows = rows, .I = I, .lim = lim,
       .grads = 1, .ex = ex);
    CHECK_OK(ds4_dev_check(d, what, &err), &err);
    CHECK(memcmp(act0, act1, (size_t)n * sizeof(float)) == 0, "%s: act differs when the exps are kept", what);
    int64_t badex = 0;
    for (int64_t i = 0; i < n; i++) {
        const float want = expf(-(g1[i] > lim ? lim : g1[i]));
        badex += memcmp(&want, &ex[i], sizeof want) != 0;
    }
    CHECK(badex == 0, "%s: %lld kept exps are not expf(-min(g1, lim))", what, (long long)badex);
    CHECK(memcmp(dg1a, dg1b, (size_t)n * sizeof(float)) == 0 && memcmp(dg3a, dg3b, (size_t)n * sizeof(float)) == 0,
          "%s: dg1 / dg3 differ when the sigmoid comes from the kept exps", what);
    CHECK(memcmp(dg1a, dg1c, (size_t)n * sizeof(float)) == 0 && memcmp(dg3a, dexb, (size_t)n * sizeof(float)) == 0,
          "%s: dg1 / dg3 differ with dg3 written over dact", what);
    double emax = 0, vmax = 0;
    int64_t nan = 0;
    for (int64_t i = 0; i < n; i++) {
        const double g = g1[i] > lim ? lim : g1[i], u = g3[i] < -lim ? -lim : (g3[i] > lim ? lim : g3[i]);
        const double s = 1.0 / (1.0 + exp(-g)), silu = g * s;
        const double w1 = g1[i] <= lim ? dact[i] * u * s * (1.0 + g * (1.0 - s)) : 0.0;
        const double w3 = g3[i] >= -lim && g3[i] <= lim ? dact[i] * silu : 0.0;
        const double wa = silu * u;
        emax = fmax(emax, fmax(fabs(act0[i] - wa), fmax(fabs(dg1a[i] - w1), fabs(dg3a[i] - w3))));
        vmax = fmax(vmax, fmax(fabs(wa), fmax(fabs(w1), fabs(w3))));
        nan += isnan(act0[i]) || isnan(dg1a[i]) || isnan(dg3a[i]);
    }
    CHECK(nan == 0 && emax <= 1e-5 * vmax, "%s: max |error| %g against the closed form (largest value %g), %lld NaN",
          what, emax, vmax, (long long)nan);
    free(buf);
    ds4_dev_release(d);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    ds4_engine *e = NULL;
    ds4_error err;
    const ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &e, &err), &err);
    if (e) {
        t_swiglu(e, 37, 64);
        t_swiglu(e, 1, 5);
        t_swiglu(e, 300, 33);
        ds4_engine_free(e);
    }
    return ds4t_finish("test_swiglu_bwd");
}
