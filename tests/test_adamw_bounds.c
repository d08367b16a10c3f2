/* test_adamw_bounds.c — the optimizer's finiteness check from bounds (core/optim.c; docs/design.md, "The optimizer's
 * finiteness check"): a CPU step proves its update finite from the bounds the previous update left (max |p|, |m|, |v|)
 * and the gradient norm, and reads p, g, m, v for the exact count only when that fails or the bounds may be stale.
 *
 * 1. The proof (ds4_adamw_bounds_finite) against the exact count (ds4_adamw_count_nonfinite, the update computed
 *    element by element): on elements at the extremes the bounds allow (every sign of p, m, g at their bound, v at 0
 *    and at its bound), over magnitudes swept through the fp32 overflow, a proof never meets a non-finite element.
 * 2. Trajectories: a model trained for a few steps (forward, backward, AdamW) with the bounds and a copy with the exact
 *    pass forced every step give the same bits (gradient norms, parameters, moments), and only the first step of the
 *    bounded one runs the pass (stats.exact_check). With the router-bias update on, so its write does not count.
 * 3. Every event that writes parameters or moments outside a step makes the next step run the exact pass again, and
 *    the one after skip it: ds4_model_params_changed, set_params (ds4_model_scatter_params), the state handed out
 *    (ds4_adamw_get_state), loaded (ds4_adamw_put_moments) or declared changed (ds4_adamw_state_changed), a tensor that
 *    becomes trainable, another optimizer's step on the same model, the adapters written (ds4_model_lora_write), a
 *    ZeRO-1 shard (ds4_adamw_set_shard, one rank), a device step (the host-invisible twin of the CPU backend,
 *    twin_device.h) and the way back. A refused step leaves the bounds valid. ZeRO-1 over 2 ranks (threads): each
 *    proves or counts its own parts (one rank alone seeing a write), the weights the unsharded exact pass's, bitwise;
 *    then a sharded device step (each twin's master its region's), read back on both ranks: the next host step counts.
 * 4. Updates that would overflow are refused as before, with the same message and nothing changed (compared with the
 *    forced exact pass on a copy): a huge gradient within a finite norm, an lr whose step overflows, eps = 0 with a zero
 *    gradient, and a parameter near FLT_MAX set through set_params after the bounds were taken (which the stale bounds
 *    would have passed).
 * On tiny_a, tiny_b and tiny_hf. */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim.h"
#include "testlib.h"
#include "twin_device.h"

enum { MSG = sizeof(((ds4_error *)0)->msg) };

/* --------------------------------------------------------------------------------------------- 1. the proof */

/* Sweep: hyper-parameters, step numbers, clip coefficients and bounds scaled through 1e30 .. 1e39 (FLT_MAX 3.4e38);
 * every case where the proof holds must have no non-finite element among the extremes. */
static void test_proof(void) {
    static const double lrs[] = {1e-3, 1.0, 1e30, 1e34, 3e38}, epss[] = {1e-8, 1.0, 0.0}, wds[] = {0.0, 0.1, 1e30};
    static const double b1s[] = {0.9, 0.0, 0.7}, scales[] = {1.0, 1e30, 1e33, 1e35, 1e36, 1e37, 1e38, 3e38};
    static const int64_t ts[] = {1, 2, 1000};
    int64_t cases = 0, proved = 0, proved_large = 0, unsound = 0;
    enum { N = 3 * 3 * 2 * 3 };
    float p[N], g[N], m[N], v[N];
    for (size_t il = 0; il < sizeof lrs / sizeof *lrs; il++)
        for (size_t ie = 0; ie < sizeof epss / sizeof *epss; ie++)
            for (size_t iw = 0; iw < sizeof wds / sizeof *wds; iw++)
                for (size_t ib = 0; ib < sizeof b1s / sizeof *b1s; ib++)
                    for (size_t it = 0; it < sizeof ts / sizeof *ts; it++)
                        for (size_t sp = 0; sp < sizeof scales / sizeof *scales; sp++)
                            for (size_t sg = 0; sg < sizeof scales / sizeof *scales; sg += 2)
                                for (int coef_k = 0; coef_k < 2; coef_k++) {
                                    ds4_adamw_hparams h = {.beta1 = b1s[ib], .beta2 = 0.95, .eps = epss[ie],
                                                           .weight_decay = wds[iw]};
                                    ds4_adamw_coefs c = ds4_adamw_coefs_at(&h, ts[it], lrs[il], 1);
                                    const float coef = coef_k ? 0.25f : 1.0f;
                                    const double P = 0.5 * scales[sp], G = 0.3 * scales[sg];
                                    const ds4_adamw_bounds b = {(float)P, (float)(0.1 * scales[sg]),
                                                                (float)fmin(1e-3 * scales[sg] * scales[sg], 3e38), 0};
                                    const float gv = (float)G, pv = b.p, mv = b.m, vv = b.v;
                                    int k = 0;
                                    for (int a = 0; a < 3; a++)
                                        for (int d = 0; d < 3; d++)
                                            for (int e = 0; e < 2; e++)
                                                for (int f = 0; f < 3; f++, k++) {
                                                    p[k] = a == 0 ? pv : a == 1 ? -pv : 0;
                                                    m[k] = d == 0 ? mv : d == 1 ? -mv : 0;
                                                    v[k] = e == 0 ? vv : 0;
                                                    g[k] = f == 0 ? gv : f == 1 ? -gv : 0;
                                                }
                                    const int ok = ds4_adamw_bounds_finite(&c, coef, G, &b);
                                    const int64_t bad = ds4_adamw_count_nonfinite(&c, coef, p, g, m, v, N);
                                    cases++;
                                    proved += ok;
                                    proved_large += ok && (P >= 1e36 || b.v >= 1e36f);
                                    if (ok && bad > 0 && unsound++ < 5)
                                        CHECK(0, "proof holds but %lld of %d elements are non-finite: lr %g eps %g wd %g "
                                                 "beta1 %g t %lld coef %g P %g G %g",
                                              (long long)bad, N, lrs[il], epss[ie], wds[iw], b1s[ib], (long long)ts[it],
                                              (double)coef, P, G);
                                }
    CHECK(unsound == 0, "%lld unsound proofs", (long long)unsound);
    /* the sweep reaches the proof's edge: proofs with bounds near the limit, and failures (the exact count runs) */
    CHECK(proved > cases / 50 && proved < cases && proved_large > 0, "proofs %lld of %lld (%lld with bounds >= 1e36)",
          (long long)proved, (long long)cases, (long long)proved_large);
    /* what no proof may pass: eps 0, a negative v, non-finite coefficients, an overflowing gradient square */
    ds4_adamw_hparams h = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    ds4_adamw_coefs c = ds4_adamw_coefs_at(&h, 2, 1e-3, 1);
    const ds4_adamw_bounds fine = {1, 0.01f, 1e-4f, 0}, negv = {1, 0.01f, 1e-4f, 1e-30f};
    CHECK(ds4_adamw_bounds_finite(&c, 1.0f, 1.0, &fine), "ordinary training not proved");
    CHECK(!ds4_adamw_bounds_finite(&c, 1.0f, 1.0, &negv), "a negative v proved");
    CHECK(!ds4_adamw_bounds_finite(&c, 1.0f, 1e20, &fine), "(1-b2) g^2 = 5e38 proved");
    CHECK(!ds4_adamw_bounds_finite(&c, 1.0f, NAN, &fine), "a NaN gradient bound proved");
    h.eps = 0;
    ds4_adamw_coefs c0 = ds4_adamw_coefs_at(&h, 2, 1e-3, 1);
    CHECK(!ds4_adamw_bounds_finite(&c0, 1.0f, 1.0, &fine), "eps 0 proved");
    h.eps = 1e-8;
    ds4_adamw_coefs ci = ds4_adamw_coefs_at(&h, 1, 1e38, 0); /* -lr / (1 - 0.9) overflows fp32 */
    CHECK(!isfinite(ci.neg_step) && !ds4_adamw_bounds_finite(&ci, 1.0f, 1.0, &fine), "an infinite step size proved");
    printf("  proof vs exact count: %lld cases, %lld proved (%lld near the limit), none unsound\n", (long long)cases,
           (long long)proved, (long long)proved_large);
}

/* --------------------------------------------------------------------------------------------- helpers */

static ds4_adamw_options opts(void) {
    return (ds4_adamw_options){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0,
                               .schedule = DS4_LR_CONSTANT};
}

/* The trained gradient buffer (the model's, or its adapters') filled with a pseudo-random pattern of amplitude amp,
 * never an exact zero when amp > 0. */
static void fill_grads(ds4_model *m, uint64_t seed, float amp) {
    ds4_error err = {0};
    float *g = NULL;
    int64_t n = 0;
    CHECK_OK(ds4_model_grad_buffer(m, &g, &n, &err), &err);
    for (int64_t i = 0; g && i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (float)(((double)(seed >> 40) + 0.5) / 16777216.0 - 0.5) * amp;
    }
    ds4_model_grads_changed(m);
}

/* An element of a trainable (and decayed) tensor, in the middle of the largest such: where the refusal tests put
 * their extreme values. */
static int64_t trainable_element(ds4_model *m) {
    ds4_error err = {0};
    int64_t at = -1, best = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        ds4_tensor_info ti;
        CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
        if (ti.is_param && ti.trainable && ti.decay && !ti.elsewhere && ti.numel > best)
            best = ti.numel, at = ti.offset + ti.numel / 2;
    }
    CHECK(at >= 0, "no trainable tensor");
    return at < 0 ? 0 : at;
}

static int64_t count_trainable(ds4_model *m) {
    ds4_error err = {0};
    int64_t k = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        ds4_tensor_info ti;
        CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
        k += ti.is_param && ti.trainable;
    }
    return k;
}

/* One step on synthetic gradients; returns stats.exact_check (-1 on an error, counted). */
static int step(ds4_model *m, ds4_adamw *o, uint64_t seed) {
    ds4_error err = {0};
    ds4_adamw_stats st;
    fill_grads(m, seed, 0.01f);
    ds4_status s = ds4_adamw_step(o, &st, &err);
    CHECK(s == DS4_OK, "step: %s", err.msg);
    return s ? -1 : st.exact_check;
}

static ds4_model *load(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(e, ds4t_path(fixtures, fixture), &m, &err), &err);
    if (m) CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    return m;
}

/* The whole moments of o (read without handing them out: ds4_adamw_gather_moments leaves the bounds alone). */
static void moments(ds4_adamw *o, int64_t n, float **mm, float **vv) {
    ds4_error err = {0};
    *mm = malloc((size_t)n * sizeof **mm);
    *vv = malloc((size_t)n * sizeof **vv);
    if (*mm && *vv) CHECK_OK(ds4_adamw_gather_moments(o, *mm, *vv, &err), &err);
}

static int same_state(ds4_model *a, ds4_adamw *oa, ds4_model *b, ds4_adamw *ob) {
    const int64_t n = ds4_model_param_count(a);
    float *ma, *va, *mb, *vb;
    moments(oa, n, &ma, &va);
    moments(ob, n, &mb, &vb);
    const size_t bytes = (size_t)n * sizeof(float);
    const int same = ma && va && mb && vb && !memcmp(ds4_model_params(a), ds4_model_params(b), bytes) &&
                     !memcmp(ma, mb, bytes) && !memcmp(va, vb, bytes);
    free(ma), free(va), free(mb), free(vb);
    return same;
}

/* --------------------------------------------------------------------------------------------- 2. trajectories */

static void test_trajectory(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m[2] = {NULL, NULL};
    ds4_st_file *io[2] = {NULL, NULL};
    ds4_forward_args args[2];
    ds4_adamw *o[2] = {NULL, NULL};
    enum { STEPS = 5 };
    int pattern[2][STEPS];
    double norms[2][STEPS];
    for (int k = 0; k < 2; k++) {
        if (ds4t_load_fixture(e, fixtures, fixture, &m[k], &io[k], &args[k])) goto out;
        CHECK_OK(ds4_model_enable_grad(m[k], &err), &err);
        ds4_train_options to = ds4_model_train_options(m[k]);
        to.router_bias_gamma = 1e-3; /* its write after each update leaves the bounds valid */
        CHECK_OK(ds4_model_set_train_options(m[k], &to, &err), &err);
        ds4_adamw_options oo = opts();
        CHECK_OK(ds4_adamw_create(m[k], &oo, &o[k], &err), &err);
        if (!o[k]) goto out;
    }
    ds4_adamw_set_exact_check(o[1], 1);
    int same = 1;
    for (int s = 0; s < STEPS; s++) {
        for (int k = 0; k < 2; k++) {
            ds4_forward_result res;
            ds4_adamw_stats st = {0};
            ds4_model_zero_grad(m[k]);
            CHECK_OK(ds4_model_forward_train(m[k], &args[k], &res, &err), &err);
            CHECK_OK(ds4_model_backward(m[k], 1.0 / (double)res.loss_tokens, &err), &err);
            CHECK_OK(ds4_adamw_step(o[k], &st, &err), &err);
            pattern[k][s] = st.exact_check;
            norms[k][s] = st.grad_norm;
        }
        same &= norms[0][s] == norms[1][s] && same_state(m[0], o[0], m[1], o[1]);
    }
    CHECK(same, "%s: bounds vs exact pass: the trajectories differ", fixture);
    for (int s = 0; s < STEPS; s++) {
        CHECK(pattern[0][s] == (s == 0), "%s step %d: exact pass %d with bounds (expected only at the first)", fixture,
              s + 1, pattern[0][s]);
        CHECK(pattern[1][s] == 1, "%s step %d: forced exact pass did not run", fixture, s + 1);
    }
    printf("  %s: %d training steps with bounds = forced exact pass, bitwise; exact pass at step 1 only\n", fixture,
           STEPS);
out:
    for (int k = 0; k < 2; k++) {
        ds4_adamw_free(o[k]);
        ds4_model_free(m[k]);
        ds4_st_close(io[k]);
    }
}

/* --------------------------------------------------------------------------------------------- 3. invalidation */

static ds4_status sum_one(void *ctx, double *buf, int64_t n, ds4_error *err) {
    (void)ctx, (void)buf, (void)n, (void)err;
    return DS4_OK; /* one rank: the sum is its own */
}
static ds4_status gather_one(void *ctx, float *buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    (void)ctx, (void)buf, (void)off, (void)len, (void)err;
    return DS4_OK;
}

/* After `what`, the next step runs the exact pass and the one after does not. */
#define AFTER(what, m, o, seed)                                                                                     \
    do {                                                                                                            \
        const int e1_ = step(m, o, seed), e2_ = step(m, o, (seed) + 1);                                             \
        CHECK(e1_ == 1 && e2_ == 0, "%s: after %s: exact pass %d then %d (expected 1 then 0)", fixture, what, e1_,   \
              e2_);                                                                                                 \
    } while (0)

static void test_events(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m = load(e, fixtures, fixture);
    ds4_adamw *o = NULL, *o2 = NULL;
    float *buf = NULL, *mm = NULL, *vv = NULL;
    if (!m) return;
    ds4_adamw_options oo = opts();
    CHECK_OK(ds4_adamw_create(m, &oo, &o, &err), &err);
    if (!o) goto out;
    const int64_t n = ds4_model_param_count(m);
    int x1 = step(m, o, 1), x2 = step(m, o, 2), x3 = step(m, o, 3);
    CHECK(x1 == 1 && x2 == 0 && x3 == 0, "%s: exact pass %d %d %d (expected 1 0 0)", fixture, x1, x2, x3);

    ds4_model_params_changed(m);
    AFTER("ds4_model_params_changed", m, o, 10);
    buf = malloc((size_t)n * sizeof *buf);
    if (!buf) goto out;
    memcpy(buf, ds4_model_params(m), (size_t)n * sizeof *buf);
    CHECK_OK(ds4_model_scatter_params(m, buf, &err), &err);
    AFTER("set_params", m, o, 20);
    ds4_adamw_state st;
    ds4_adamw_get_state(o, &st);
    AFTER("ds4_adamw_get_state", m, o, 30);
    moments(o, n, &mm, &vv);
    if (mm && vv) ds4_adamw_put_moments(o, mm, vv);
    AFTER("ds4_adamw_put_moments", m, o, 40);
    ds4_adamw_state_changed(o);
    AFTER("ds4_adamw_state_changed", m, o, 50);

    /* a tensor that becomes trainable is not covered; once frozen again the rest still is */
    ds4_train_options to = ds4_model_train_options(m), before = to;
    const int64_t nt = count_trainable(m);
    to.indexer_kl = 1.0;
    if (ds4_model_has_mtp(m)) to.mtp_lambda = 0.3;
    CHECK_OK(ds4_model_set_train_options(m, &to, &err), &err);
    CHECK(count_trainable(m) > nt, "%s: no tensor became trainable", fixture);
    AFTER("the indexer (and MTP block) becoming trainable", m, o, 60);
    CHECK_OK(ds4_model_set_train_options(m, &before, &err), &err);
    x1 = step(m, o, 70);
    CHECK(x1 == 0, "%s: after freezing them again: exact pass %d (expected 0)", fixture, x1);

    /* another optimizer's step writes the parameters this one's bounds describe */
    CHECK_OK(ds4_adamw_create(m, &oo, &o2, &err), &err);
    if (o2) (void)step(m, o2, 80);
    AFTER("another optimizer's step", m, o, 90);

    /* a refused step writes nothing: the bounds stay */
    float *g = NULL;
    int64_t gn = 0;
    fill_grads(m, 110, 0.01f);
    CHECK_OK(ds4_model_grad_buffer(m, &g, &gn, &err), &err);
    if (g) g[gn / 2] = NAN;
    ds4_adamw_stats sst;
    CHECK(ds4_adamw_step(o, &sst, &err) == DS4_ERR_ARG, "%s: a NaN gradient was not refused", fixture);
    x1 = step(m, o, 120);
    CHECK(x1 == 0, "%s: after a refused step: exact pass %d (expected 0)", fixture, x1);

    /* ZeRO-1 over one rank: the sharded step proves its own parts the same way */
    ds4_adamw_shard sh = {.rank = 0, .world = 1, .sum_f64 = sum_one, .gather_f32 = gather_one};
    CHECK_OK(ds4_adamw_set_shard(o, &sh, &err), &err);
    AFTER("ds4_adamw_set_shard", m, o, 130);
    ds4_model_params_changed(m);
    AFTER("ds4_model_params_changed (sharded)", m, o, 140);
    printf("  %s: each event outside a step brought the exact pass back once\n", fixture);
out:
    free(buf), free(mm), free(vv);
    ds4_adamw_free(o2);
    ds4_adamw_free(o);
    ds4_model_free(m);
}

/* The adapters' optimizer: written adapters make the next step check in full. */
static void test_lora(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_adamw *o = NULL;
    float *a = NULL;
    CHECK_OK(ds4_model_load(e, ds4t_path(fixtures, fixture), &m, &err), &err);
    if (!m) return;
    ds4_lora_options lo = {.rank = 4, .alpha = 8, .targets = DS4_LORA_ALL, .seed = 3};
    CHECK_OK(ds4_model_lora(m, &lo, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_adamw_options oo = opts();
    CHECK_OK(ds4_adamw_create(m, &oo, &o, &err), &err);
    int64_t rank = 0, n = 0;
    double scale = 0;
    CHECK_OK(ds4_model_lora_info(m, &rank, &scale, &n, &err), &err);
    if (!o || n <= 0 || !(a = malloc((size_t)n * sizeof *a))) goto out;
    const int x1 = step(m, o, 1), x2 = step(m, o, 2);
    CHECK(x1 == 1 && x2 == 0, "%s lora: exact pass %d %d (expected 1 0)", fixture, x1, x2);
    CHECK_OK(ds4_model_lora_read(m, a, n, &err), &err);
    CHECK_OK(ds4_model_lora_write(m, a, n, &err), &err);
    AFTER("ds4_model_lora_write", m, o, 3);
out:
    free(a);
    ds4_adamw_free(o);
    ds4_model_free(m);
}

/* Device steps (the twin of the CPU backend: test_zero_device.c). The first moves the moments there and counts in
 * full; the update kernel's per-piece bounds then prove the next; a write of the parameters or of the moments makes
 * the next count again. A copy with the exact pass forced every step ends with the same bits. Back on the CPU the
 * next host step checks in full. */
static void test_device_step(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m = load(e, fixtures, fixture), *m2 = load(e, fixtures, fixture);
    ds4_adamw *o = NULL, *o2 = NULL;
    ds4_dev *d = NULL, *d2 = NULL;
    if (!m || !m2) goto out;
    ds4_adamw_options oo = opts();
    CHECK_OK(ds4_adamw_create(m, &oo, &o, &err), &err);
    CHECK_OK(ds4_adamw_create(m2, &oo, &o2, &err), &err);
    if (!o || !o2) goto out;
    ds4_adamw_set_exact_check(o2, 1);
    const int x1 = step(m, o, 1), x2 = step(m, o, 2);
    CHECK(x1 == 1 && x2 == 0, "%s: exact pass %d %d (expected 1 0)", fixture, x1, x2);
    step(m2, o2, 1), step(m2, o2, 2);
    if (!(d = twin_attach(e, m)) || !(d2 = twin_attach(e, m2))) goto out;
    const int xd = step(m, o, 3), xd2 = step(m, o, 4); /* the moments move there: counted; then proved */
    CHECK(xd == 1 && xd2 == 0, "%s: device steps reported exact pass %d %d (expected 1 0)", fixture, xd, xd2);
    ds4_model_params_changed(m);
    AFTER("ds4_model_params_changed, on the device", m, o, 5);
    ds4_adamw_state_changed(o);
    AFTER("ds4_adamw_state_changed, on the device", m, o, 7);
    for (uint64_t k = 3; k <= 8; k++) {
        if (k == 5) ds4_model_params_changed(m2);
        if (k == 7) ds4_adamw_state_changed(o2);
        CHECK(step(m2, o2, k) == 1, "%s: the forced exact pass did not run on the device", fixture);
    }
    twin_detach(m, d), twin_detach(m2, d2);
    d = d2 = NULL;
    CHECK(same_state(m, o, m2, o2), "%s: device steps with bounds and with the exact pass differ", fixture);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    AFTER("device steps", m, o, 9);
out:
    if (d) twin_detach(m, d);
    if (d2) twin_detach(m2, d2);
    ds4_adamw_free(o);
    ds4_adamw_free(o2);
    ds4_model_free(m);
    ds4_model_free(m2);
}

/* ZeRO-1 over TWIN_WORLD ranks (threads on CPU models, collectives over shared memory): each rank proves or counts its
 * own parts; the weights are the unsharded optimizer's with the exact pass forced, bitwise. At step 3 rank 0 alone
 * sees a write (ds4_model_params_changed): it counts, the other proves, and they agree. Then a sharded device step
 * (twins: each rank's fp32 master its region's only), read back on every rank (the master's regions gathered) and
 * the models back on the CPU: the next host step counts (the device step voided the bounds), the one after proves. */
enum { ZSTEPS = 4, ZDEV = ZSTEPS, ZALL = ZSTEPS + 3 };
typedef struct zero_rank {
    twin_rank tr; /* first: the collectives' ctx */
    ds4_model *m;
    ds4_adamw *o;
    int k0, k1; /* the steps run: [k0, k1) */
    int exact[ZALL];
    double norms[ZALL];
    int64_t master; /* the device master's elements at the device step */
    int failed;
} zero_rank;

static void *zero_main(void *arg) {
    zero_rank *c = arg;
    for (int k = c->k0; k < c->k1 && !c->failed; k++) {
        ds4_error err = {0};
        ds4_adamw_stats st;
        if (k == 2 && c->tr.rank == 0) ds4_model_params_changed(c->m);
        fill_grads(c->m, 200 + (uint64_t)k, 0.01f); /* the same on every rank: what the all-reduce leaves */
        if (ds4_adamw_step(c->o, &st, &err) != DS4_OK) {
            fprintf(stderr, "rank %d step %d: %s\n", c->tr.rank, k + 1, err.msg);
            c->failed = 1; /* the other rank then waits in vain: the test's timeout ends it, named by this line */
            break;
        }
        c->exact[k] = st.exact_check;
        c->norms[k] = st.grad_norm;
        if (k == ZDEV) { /* on the twin: its master, then the read-back every rank joins (the weights leave it) */
            c->master = c->m->master_n;
            if (ds4_model_host_sync(c->m, &err) != DS4_OK) {
                fprintf(stderr, "rank %d: the read-back: %s\n", c->tr.rank, err.msg);
                c->failed = 1;
            }
        }
    }
    return NULL;
}

static void test_zero(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *ref = load(e, fixtures, fixture);
    ds4_adamw *ro = NULL;
    ds4_adamw_options oo = opts();
    zero_rank ctx[TWIN_WORLD];
    ds4_engine *te[TWIN_WORLD] = {NULL};
    twin_coll sh;
    pthread_barrier_init(&sh.bar, NULL, TWIN_WORLD);
    memset(ctx, 0, sizeof ctx);
    if (!ref) goto out;
    CHECK_OK(ds4_adamw_create(ref, &oo, &ro, &err), &err);
    if (!ro) goto out;
    ds4_adamw_set_exact_check(ro, 1);
    double norms[ZALL];
    for (int k = 0; k < ZALL; k++) {
        ds4_adamw_stats st;
        fill_grads(ref, 200 + (uint64_t)k, 0.01f);
        CHECK_OK(ds4_adamw_step(ro, &st, &err), &err);
        norms[k] = st.grad_norm;
    }
    const ds4_engine_options teo = {.n_threads = 1}; /* a pool serves one caller: an engine per rank */
    int ready = 1;
    for (int r = 0; r < TWIN_WORLD; r++) {
        zero_rank *c = &ctx[r];
        c->tr = (twin_rank){&sh, r};
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        c->m = te[r] ? load(te[r], fixtures, fixture) : NULL;
        if (c->m) CHECK_OK(ds4_adamw_create(c->m, &oo, &c->o, &err), &err);
        ds4_adamw_shard s = {.rank = r, .world = TWIN_WORLD, .ctx = &c->tr, .sum_f64 = twin_sum_f64,
                             .gather_f32 = twin_gather_f32, .gather_dev_f32 = twin_gather_f32};
        if (c->o) CHECK_OK(ds4_adamw_set_shard(c->o, &s, &err), &err);
        ready &= c->o != NULL;
    }
    if (!ready) goto out;
    for (int r = 0; r < TWIN_WORLD; r++) ctx[r].k0 = 0, ctx[r].k1 = ZSTEPS;
    twin_run(zero_main, ctx, sizeof ctx[0]);
    ds4_dev *dv[TWIN_WORLD] = {NULL};
    for (int r = 0; r < TWIN_WORLD; r++) {
        dv[r] = twin_attach(te[r], ctx[r].m);
        ctx[r].k0 = ZDEV, ctx[r].k1 = ZDEV + 1;
        ready &= dv[r] != NULL;
    }
    if (ready) twin_run(zero_main, ctx, sizeof ctx[0]);
    for (int r = 0; r < TWIN_WORLD; r++) {
        if (dv[r]) twin_detach(ctx[r].m, dv[r]); /* read back already: nothing gathered here */
        CHECK_OK(ds4_model_enable_grad(ctx[r].m, &err), &err);
        ctx[r].k0 = ZDEV + 1, ctx[r].k1 = ZALL;
    }
    if (!ready) goto out;
    twin_run(zero_main, ctx, sizeof ctx[0]);
    const int64_t P = ds4_model_param_count(ref);
    for (int r = 0; r < TWIN_WORLD; r++) {
        zero_rank *c = &ctx[r];
        CHECK(!c->failed, "%s rank %d: a step failed", fixture, r);
        if (c->failed) continue;
        int dn = 0;
        for (int k = 0; k < ZALL; k++) dn += c->norms[k] != norms[k];
        CHECK(dn == 0, "%s rank %d: %d gradient norms differ from the unsharded step's", fixture, r, dn);
        CHECK(!memcmp(ds4_model_params(c->m), ds4_model_params(ref), (size_t)P * sizeof(float)),
              "%s rank %d: weights differ from the unsharded optimizer's with the exact pass", fixture, r);
        const int want2 = r == 0;
        CHECK(c->exact[0] == 1 && c->exact[1] == 0 && c->exact[2] == want2 && c->exact[3] == 0,
              "%s rank %d: exact pass %d %d %d %d (expected 1 0 %d 0)", fixture, r, c->exact[0], c->exact[1],
              c->exact[2], c->exact[3], want2);
        CHECK(c->master > 0 && c->master < P, "%s rank %d: a device master of %lld of %lld parameters (its region's)",
              fixture, r, (long long)c->master, (long long)P);
        CHECK(c->exact[ZDEV] == 1 && c->exact[ZDEV + 1] == 1 && c->exact[ZDEV + 2] == 0,
              "%s rank %d: exact pass %d on the twin, then %d %d on the CPU (expected 1, 1 0)", fixture, r,
              c->exact[ZDEV], c->exact[ZDEV + 1], c->exact[ZDEV + 2]);
    }
    printf("  %s: ZeRO-1 over %d ranks with bounds = unsharded with the exact pass, bitwise (%d steps; the 5th on "
           "twins with the master sharded, read back on every rank, the next host step's bounds void)\n",
           fixture, TWIN_WORLD, ZALL);
out:
    for (int r = 0; r < TWIN_WORLD; r++) {
        ds4_adamw_free(ctx[r].o);
        ds4_model_free(ctx[r].m);
        ds4_engine_free(te[r]);
    }
    pthread_barrier_destroy(&sh.bar);
    ds4_adamw_free(ro);
    ds4_model_free(ref);
}

/* --------------------------------------------------------------------------------------------- 4. refusals */

/* Two copies of the fixture, one optimizer each with options oo (the second forced to the exact pass), driven by
 * `drive` the same way; every step's status and message must agree, and the states stay bitwise equal. */
typedef void (*drive_fn)(ds4_model *m, ds4_adamw *o, int copy, ds4_status *s, char msgs[][MSG],
                         int *exact);

static void compare_refusal(ds4_engine *e, const char *fixtures, const char *fixture, const char *what,
                            ds4_adamw_options oo, drive_fn drive) {
    enum { MAXS = 4 };
    ds4_error err = {0};
    ds4_model *m[2] = {NULL, NULL};
    ds4_adamw *o[2] = {NULL, NULL};
    ds4_status s[2][MAXS];
    static char msgs[2][MAXS][MSG];
    int exact[2][MAXS];
    memset(s, 0, sizeof s);
    memset(msgs, 0, sizeof msgs);
    memset(exact, 0, sizeof exact);
    for (int k = 0; k < 2; k++) {
        if (!(m[k] = load(e, fixtures, fixture))) goto out;
        CHECK_OK(ds4_adamw_create(m[k], &oo, &o[k], &err), &err);
        if (!o[k]) goto out;
    }
    ds4_adamw_set_exact_check(o[1], 1);
    for (int k = 0; k < 2; k++) drive(m[k], o[k], k, s[k], msgs[k], exact[k]);
    int agree = 1, refused = 0;
    for (int i = 0; i < MAXS; i++) {
        agree &= s[0][i] == s[1][i] && !strcmp(msgs[0][i], msgs[1][i]);
        refused += s[0][i] == DS4_ERR_ARG && strstr(msgs[0][i], "non-finite") && strstr(msgs[0][i], "unchanged");
    }
    CHECK(agree, "%s, %s: the steps' outcomes differ from the exact pass's ('%s' vs '%s')", fixture, what, msgs[0][1],
          msgs[1][1]);
    CHECK(refused == 1, "%s, %s: %d refusals of a non-finite update (expected 1)", fixture, what, refused);
    CHECK(same_state(m[0], o[0], m[1], o[1]), "%s, %s: states differ from the exact pass's", fixture, what);
out:
    for (int k = 0; k < 2; k++) {
        ds4_adamw_free(o[k]);
        ds4_model_free(m[k]);
    }
}

static void run_step(ds4_model *m, ds4_adamw *o, int i, ds4_status *s, char msgs[][MSG], int *exact) {
    ds4_error err = {0};
    ds4_adamw_stats st = {0};
    float *before = malloc((size_t)ds4_model_param_count(m) * sizeof *before);
    if (before) memcpy(before, ds4_model_params(m), (size_t)ds4_model_param_count(m) * sizeof *before);
    s[i] = ds4_adamw_step(o, &st, &err);
    if (s[i]) {
        snprintf(msgs[i], MSG, "%s", err.msg);
        CHECK(before && !memcmp(before, ds4_model_params(m), (size_t)ds4_model_param_count(m) * sizeof *before),
              "a refused step changed the parameters");
    }
    exact[i] = st.exact_check;
    free(before);
}

/* steps 1, 2 ordinary (bounds taken), step 3 with one gradient of 1e30 (norm finite; clipping off): v overflows */
static void drive_huge_grad(ds4_model *m, ds4_adamw *o, int copy, ds4_status *s, char msgs[][MSG],
                            int *exact) {
    ds4_error err = {0};
    for (int i = 0; i < 3; i++) {
        fill_grads(m, 5 + (uint64_t)i, 0.01f);
        if (i == 2) {
            float *g = NULL;
            int64_t n = 0;
            CHECK_OK(ds4_model_grad_buffer(m, &g, &n, &err), &err);
            if (g) g[trainable_element(m)] = 1e30f;
        }
        run_step(m, o, i, s, msgs, exact);
    }
    CHECK(copy || (exact[0] == 1 && exact[1] == 0 && exact[2] == 1), "huge gradient: exact pass %d %d %d", exact[0],
          exact[1], exact[2]);
}

/* β1 = 0, lr 3e38: a zero gradient updates nothing (finite, the bounds taken); an ordinary one overflows the step */
static void drive_huge_lr(ds4_model *m, ds4_adamw *o, int copy, ds4_status *s, char msgs[][MSG],
                          int *exact) {
    fill_grads(m, 1, 0.0f);
    run_step(m, o, 0, s, msgs, exact);
    fill_grads(m, 2, 0.01f);
    run_step(m, o, 1, s, msgs, exact);
    CHECK(copy || (exact[0] == 1 && exact[1] == 1), "huge lr: exact pass %d %d", exact[0], exact[1]);
}

/* eps = 0: never proved; the first step with an exact zero in the gradient (0/0) is refused */
static void drive_eps0(ds4_model *m, ds4_adamw *o, int copy, ds4_status *s, char msgs[][MSG],
                       int *exact) {
    ds4_error err = {0};
    float *g = NULL;
    int64_t n = 0;
    fill_grads(m, 3, 0.01f);
    CHECK_OK(ds4_model_grad_buffer(m, &g, &n, &err), &err);
    if (g) g[trainable_element(m)] = 0;
    run_step(m, o, 0, s, msgs, exact);
    for (int i = 1; i < 3; i++) {
        fill_grads(m, 3 + (uint64_t)i, 0.01f);
        run_step(m, o, i, s, msgs, exact);
    }
    CHECK(copy || (exact[1] == 1 && exact[2] == 1), "eps 0: exact pass %d %d", exact[1], exact[2]);
}

/* lr 1e32, eps 1, no decay: a zero gradient first (the bounds taken with |p| small), then one parameter set to
 * -FLT_MAX through set_params and a gradient of 1 there: the step (~3e31 downwards) overflows it. The stale bounds
 * (|p| <= 1, the step <= ~1e32) would have passed it. */
static void drive_huge_param(ds4_model *m, ds4_adamw *o, int copy, ds4_status *s, char msgs[][MSG],
                             int *exact) {
    ds4_error err = {0};
    fill_grads(m, 1, 0.0f);
    run_step(m, o, 0, s, msgs, exact);
    fill_grads(m, 2, 0.0f);
    run_step(m, o, 1, s, msgs, exact);
    const int64_t n = ds4_model_param_count(m);
    float *p = malloc((size_t)n * sizeof *p), *g = NULL;
    int64_t gn = 0;
    if (!p) return;
    memcpy(p, ds4_model_params(m), (size_t)n * sizeof *p);
    const int64_t at = trainable_element(m);
    p[at] = -FLT_MAX;
    CHECK_OK(ds4_model_scatter_params(m, p, &err), &err);
    free(p);
    fill_grads(m, 3, 0.01f);
    CHECK_OK(ds4_model_grad_buffer(m, &g, &gn, &err), &err);
    if (g) g[at] = 1.0f;
    run_step(m, o, 2, s, msgs, exact);
    CHECK(copy || (exact[0] == 1 && exact[1] == 0 && exact[2] == 1), "huge parameter: exact pass %d %d %d", exact[0],
          exact[1], exact[2]);
}

static void test_refusals(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_adamw_options oo = opts();
    oo.clip = 0;
    compare_refusal(e, fixtures, fixture, "a gradient of 1e30", oo, drive_huge_grad);
    oo = opts();
    oo.beta1 = 0, oo.lr = 3e38, oo.weight_decay = 0;
    compare_refusal(e, fixtures, fixture, "lr 3e38", oo, drive_huge_lr);
    oo = opts();
    oo.eps = 0;
    compare_refusal(e, fixtures, fixture, "eps 0", oo, drive_eps0);
    oo = opts();
    oo.lr = 1e32, oo.eps = 1, oo.weight_decay = 0, oo.clip = 0;
    compare_refusal(e, fixtures, fixture, "a parameter of -FLT_MAX set through set_params", oo, drive_huge_param);
    printf("  %s: overflowing updates refused as by the exact pass (same messages, nothing changed)\n", fixture);
}

static void run(ds4_engine *e, const char *fixtures, const char *fixture) {
    if (!strcmp(fixture, "tiny_a")) test_proof();
    test_trajectory(e, fixtures, fixture);
    test_events(e, fixtures, fixture);
    test_lora(e, fixtures, fixture);
    test_device_step(e, fixtures, fixture);
    test_zero(e, fixtures, fixture);
    test_refusals(e, fixtures, fixture);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_adamw_bounds", run); }
