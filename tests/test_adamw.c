/* test_adamw.c — the raw AdamW / clipping functions (core/optim.h) and ds4_lr_at against torch.
 *
 * 1. tests/fixtures/adamw.safetensors (tests/gen_fixtures.py adamw_fixture): torch.optim.AdamW (lr 1e-2,
 *    betas 0.9/0.95, eps 1e-8, weight decay 0.1 on w [7,13], none on v [13]) after
 *    torch.nn.utils.clip_grad_norm_([w, v], 1.0), 10 steps with recorded gradients. Replayed here through the
 *    multi-tensor path (norm, clip, update). Bound: 1e-6 relative per element for the parameters and for the
 *    norm (per element relative to max(|ref|, lr), see max_rel). Both sides are fp32 with the same operations in the same order, so the expected difference is a few
 *    ulps (1 ulp = 6e-8 relative) from the places where ATen fuses a multiply-add (its vectorised lerp) and
 *    from torch's fp32 norm reduction against our double one; 1e-6 is ~16 ulps, while any wrong formula
 *    (bias correction off by one step, decay after the update, eps inside the sqrt, clipping without the 1e-6)
 *    moves the parameters by 1e-4 relative or more within the 10 steps.
 * 2. The same replay on a thread pool, and a multi-chunk synthetic problem on 1 vs 4 threads: bit-identical.
 * 3. ds4_lr_at: the fixture's cosine schedule as recorded by torch's LambdaLR (tiny_a/train.safetensors "lr"),
 *    and closed-form values of every schedule worked out by hand below. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "optim.h"
#include "testlib.h"

static const ds4_st_entry *need(const ds4_st_file *f, const char *name, ds4_dtype dt, int64_t numel) {
    const ds4_st_entry *e = ds4_st_find(f, name);
    CHECK(e != NULL, "fixture lacks '%s'", name);
    if (!e) return NULL;
    int64_t n = 1;
    for (int32_t d = 0; d < e->ndim; d++) n *= e->shape[d];
    CHECK(e->dtype == dt && n == numel, "'%s': dtype %s, %lld elements; expected %s, %lld", name,
          ds4_dtype_name(e->dtype), (long long)n, ds4_dtype_name(dt), (long long)numel);
    return e->dtype == dt && n == numel ? e : NULL;
}

static void load_f32(const ds4_st_entry *e, float *dst, int64_t n) { memcpy(dst, e->data, (size_t)n * 4); }

/* max_i |a_i - b_i| / max(|b_i|, floor). The floor is the learning rate: an element that has moved close to zero
 * still carries the absolute rounding error of the larger values it passed through and of its updates, which
 * are ~lr in size (Adam's step is normalised), so relative to itself it can be many ulps off after a single
 * 1-ulp difference upstream (measured: one element of w crosses zero at step 9 with a 1.4e-9 difference, 1 ulp
 * of its value two steps earlier). */
static double max_rel(const float *a, const float *b, int64_t n, double floor) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double r = d / fmax(fabs((double)b[i]), floor);
        if (!(r <= worst)) worst = r; /* NaN sticks */
    }
    return worst;
}

enum { WR = 7, WC = 13, NW = WR * WC, NV = 13, STEPS = 10 };

/* Replay the fixture; pool == NULL: serial. Returns the worst parameter / norm errors through the pointers. */
static void replay(const ds4_st_file *f, ds4_pool *pool, double *worst_p, double *worst_norm, float *final_w,
                   float *final_v) {
    const ds4_st_entry *w0 = need(f, "w.0", DS4_F32, NW), *v0 = need(f, "v.0", DS4_F32, NV);
    if (!w0 || !v0) return;
    float w[NW], v[NV], gw[NW], gv[NV], mw[NW] = {0}, vw[NW] = {0}, mv[NV] = {0}, vv[NV] = {0}, ref[NW];
    load_f32(w0, w, NW);
    load_f32(v0, v, NV);
    const ds4_adamw_hparams h = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    const double lr = 1e-2, clip = 1.0;
    *worst_p = 0;
    *worst_norm = 0;
    for (int k = 0; k < STEPS; k++) {
        char name[32];
        snprintf(name, sizeof name, "gw.%d", k);
        const ds4_st_entry *egw = need(f, name, DS4_F32, NW);
        snprintf(name, sizeof name, "gv.%d", k);
        const ds4_st_entry *egv = need(f, name, DS4_F32, NV);
        snprintf(name, sizeof name, "norm.%d", k);
        const ds4_st_entry *enorm = need(f, name, DS4_F32, 1);
        if (!egw || !egv || !enorm) return;
        load_f32(egw, gw, NW);
        load_f32(egv, gv, NV);
        ds4_optim_range r[2] = {
            {.g = gw, .p = w, .m = mw, .v = vw, .n = NW},
            {.g = gv, .p = v, .m = mv, .v = vv, .n = NV},
        };
        ds4_optim_chunk chunks[2];
        double partial[2];
        int64_t nc = ds4_optim_chunk_count(r, 2);
        CHECK(nc == 2, "chunk count %lld, expected 2", (long long)nc);
        ds4_optim_make_chunks(r, 2, chunks);
        float coef = 0;
        double norm = ds4_grad_clip(r, 2, clip, chunks, nc, partial, pool, &coef);
        float ref_norm;
        memcpy(&ref_norm, enorm->data, 4);
        double en = fabs(norm - ref_norm) / ref_norm;
        if (!(en <= *worst_norm)) *worst_norm = en;
        CHECK(en <= 1e-6, "step %d: grad norm %.9g vs torch %.9g (rel %.3g)", k, norm, (double)ref_norm, en);
        /* The fixture's gradients have norms from ~3 up (scale 0.2 + k): clipping engages at every step. */
        CHECK(norm > 1 && coef < 1.0f, "step %d: clip coefficient %.9g with norm %.6g", k, (double)coef, norm);
        r[0].c = ds4_adamw_coefs_at(&h, k + 1, lr, 1);
        r[1].c = ds4_adamw_coefs_at(&h, k + 1, lr, 0);
        ds4_adamw_update_ranges(r, 2, chunks, nc, pool);

        snprintf(name, sizeof name, "w.%d", k + 1);
        const ds4_st_entry *ew = need(f, name, DS4_F32, NW);
        snprintf(name, sizeof name, "v.%d", k + 1);
        const ds4_st_entry *ev = need(f, name, DS4_F32, NV);
        if (!ew || !ev) return;
        load_f32(ew, ref, NW);
        double e1 = max_rel(w, ref, NW, lr);
        load_f32(ev, ref, NV);
        double e2 = max_rel(v, ref, NV, lr);
        CHECK(e1 <= 1e-6 && e2 <= 1e-6, "step %d: w max rel err %.3g, v max rel err %.3g (bound 1e-6)", k + 1, e1,
              e2);
        if (!(e1 <= *worst_p)) *worst_p = e1;
        if (!(e2 <= *worst_p)) *worst_p = e2;
    }
    memcpy(final_w, w, sizeof w);
    memcpy(final_v, v, sizeof v);
}

static void test_fixture(const char *fixtures) {
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(fixtures, "adamw.safetensors"), &f, &err), &err);
    if (!f) return;
    /* The hyper-parameters hard-coded in replay() are the ones the fixture was recorded with. */
    const char *keys[] = {"lr", "betas", "eps", "weight_decay", "clip", "steps"};
    const char *vals[] = {"0.01", "0.9,0.95", "1e-8", "0.1", "1.0", "10"};
    for (int i = 0; i < 6; i++) {
        const char *got = ds4_st_metadata(f, keys[i]);
        CHECK(got && strcmp(got, vals[i]) == 0, "fixture metadata %s = %s, expected %s", keys[i], got ? got : "(none)",
              vals[i]);
    }
    double ep, en;
    float w1[NW], v1[NV], w4[NW], v4[NV];
    replay(f, NULL, &ep, &en, w1, v1);
    printf("  adamw fixture, serial:    params max rel err %.3g, norm max rel err %.3g\n", ep, en);
    ds4_pool *pool = NULL;
    CHECK_OK(ds4_pool_create(4, &pool, &err), &err);
    if (pool) {
        replay(f, pool, &ep, &en, w4, v4);
        printf("  adamw fixture, 4 threads: params max rel err %.3g, norm max rel err %.3g\n", ep, en);
        CHECK(memcmp(w1, w4, sizeof w1) == 0 && memcmp(v1, v4, sizeof v1) == 0,
              "serial and 4-thread replays differ");
        ds4_pool_free(pool);
    }
    ds4_st_close(f);
}

/* ---------------------------------------------------------------------------------------- determinism */

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_f(uint64_t *s) { return (float)((double)(rng_next(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

/* Three tensors spanning several chunks each (and an empty one), 3 steps; the buffers of a run are in `buf`. */
enum { N0 = 3 * 16384 + 77, N1 = 5, N2 = 0, N3 = 70001, NT = N0 + N1 + N2 + N3 };

static double run_synthetic(ds4_pool *pool, float *buf /* [4 · NT]: p, g, m, v */) {
    uint64_t s = 1234;
    for (int64_t i = 0; i < NT; i++) {
        buf[i] = rng_f(&s);
        buf[NT + i] = 0;
        buf[2 * NT + i] = 0;
        buf[3 * NT + i] = 0;
    }
    const int64_t sizes[4] = {N0, N1, N2, N3};
    ds4_optim_range r[4];
    int64_t off = 0;
    for (int i = 0; i < 4; i++) {
        r[i] = (ds4_optim_range){.p = buf + off, .g = buf + NT + off, .m = buf + 2 * NT + off,
                                 .v = buf + 3 * NT + off, .n = sizes[i]};
        off += sizes[i];
    }
    int64_t nc = ds4_optim_chunk_count(r, 4);
    CHECK(nc == 4 + 1 + 0 + 5, "synthetic chunk count %lld, expected 10", (long long)nc);
    ds4_optim_chunk *chunks = calloc((size_t)nc, sizeof *chunks);
    double *partial = calloc((size_t)nc, sizeof *partial);
    if (!chunks || !partial) {
        CHECK(0, "out of memory");
        free(chunks);
        free(partial);
        return 0;
    }
    ds4_optim_make_chunks(r, 4, chunks);
    const ds4_adamw_hparams h = {.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    double norm_sum = 0;
    for (int k = 0; k < 3; k++) {
        for (int64_t i = 0; i < NT; i++) buf[NT + i] = rng_f(&s) * (float)(1 + 2 * k);
        double sumsq[4];
        double norm = ds4_grad_global_norm(r, 4, chunks, nc, partial, sumsq, pool);
        /* An independent check of the value: a plain double sum over all elements. */
        double ref = 0;
        for (int64_t i = 0; i < NT; i++) ref += (double)buf[NT + i] * buf[NT + i];
        CHECK(fabs(norm - sqrt(ref)) <= 1e-12 * sqrt(ref), "step %d: norm %.17g vs plain sum %.17g", k, norm,
              sqrt(ref));
        CHECK(sumsq[2] == 0, "empty range has sum of squares %g", sumsq[2]);
        float coef = ds4_grad_clip_coef(norm, 100.0);
        ds4_grad_scale(r, 4, coef, chunks, nc, pool);
        for (int i = 0; i < 4; i++) r[i].c = ds4_adamw_coefs_at(&h, k + 1, 1e-3, i != 1);
        ds4_adamw_update_ranges(r, 4, chunks, nc, pool);
        norm_sum += norm;
    }
    free(chunks);
    free(partial);
    return norm_sum;
}

static void test_determinism(void) {
    ds4_error err = {0};
    float *a = malloc(sizeof(float) * 4 * NT), *b = malloc(sizeof(float) * 4 * NT);
    ds4_pool *pool = NULL;
    CHECK_OK(ds4_pool_create(4, &pool, &err), &err);
    if (a && b && pool) {
        double n1 = run_synthetic(NULL, a);
        double n4 = run_synthetic(pool, b);
        CHECK(n1 == n4, "norms differ between serial (%.17g) and 4 threads (%.17g)", n1, n4);
        CHECK(memcmp(a, b, sizeof(float) * 4 * NT) == 0, "p/g/m/v differ between serial and 4 threads");
        /* The norm grows past 100 at some step, so clipping ran on both paths. */
        printf("  synthetic %d elements: serial == 4 threads (bitwise)\n", (int)NT);
    }
    ds4_pool_free(pool);
    free(a);
    free(b);
}

/* The vectorised body of ds4_adamw_update and its scalar tail compute the same bits: update 1027 elements in
 * one call (vector body + 3-element tail where SSE2 exists) and one element per call (tail only). Both β1 > 0.5
 * (ATen's "small weight" lerp branch) and β1 < 0.5 (the other branch), with and without decay. */
static void test_vector_tail(void) {
    enum { N = 1027 };
    static float p1[N], m1[N], v1[N], p2[N], m2[N], v2[N], g[N];
    const double beta1s[2] = {0.9, 0.3};
    for (int b = 0; b < 2; b++)
        for (int decay = 0; decay < 2; decay++) {
            uint64_t s = 99;
            for (int i = 0; i < N; i++) {
                p1[i] = p2[i] = rng_f(&s);
                m1[i] = m2[i] = rng_f(&s) * 0.1f;
                v1[i] = v2[i] = fabsf(rng_f(&s)) * 0.01f;
                g[i] = rng_f(&s) * (i % 7 == 0 ? 1e-6f : 1.0f);
            }
            const ds4_adamw_hparams h = {.beta1 = beta1s[b], .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
            ds4_adamw_coefs c = ds4_adamw_coefs_at(&h, 3, 1e-2, decay);
            ds4_adamw_update(&c, p1, g, m1, v1, N);
            for (int i = 0; i < N; i++) ds4_adamw_update(&c, p2 + i, g + i, m2 + i, v2 + i, 1);
            CHECK(memcmp(p1, p2, sizeof p1) == 0 && memcmp(m1, m2, sizeof m1) == 0 && memcmp(v1, v2, sizeof v1) == 0,
                  "beta1 %g decay %d: one call over %d elements differs from per-element calls", beta1s[b], decay, N);
        }
}

/* ds4_adamw_count_nonfinite (what opt:step checks before it writes) counts exactly the elements to which
 * ds4_adamw_update, run on copies after the gradient scale, writes a NaN or an infinity in p, m or v: ordinary
 * updates (0), an lr that overflows the step, a gradient whose square overflows v, NaN / Inf already in p or g,
 * eps = 0 with zero moments (0 / 0), both lerp branches, lengths with and without a scalar tail. */
static void test_nonfinite_count(void) {
    enum { N = 1031 };
    static float p[N], g[N], m[N], v[N], p2[N], g2[N], m2[N], v2[N];
    struct {
        const char *what;
        double lr, eps, beta1;
        float coef, g_at_100, p_at_7;
        int zero;
    } cases[] = {
        {"ordinary", 1e-3, 1e-8, 0.9, 1.0f, 0, 0, 0},
        {"ordinary, clipped", 1e-3, 1e-8, 0.9, 0.25f, 0, 0, 0},
        {"lerp branch for beta1 < 0.5", 1e-3, 1e-8, 0.3, 1.0f, 0, 0, 0},
        {"lr 1e38", 1e38, 1e-8, 0.9, 1.0f, 0, 0, 0},
        {"lr 1e30", 1e30, 1e-8, 0.9, 1.0f, 0, 0, 0},
        {"a gradient of 1e20 (v overflows)", 1e-3, 1e-8, 0.9, 1.0f, 1e20f, 0, 0},
        {"a NaN gradient", 1e-3, 1e-8, 0.9, 1.0f, NAN, 0, 0},
        {"an infinite parameter", 1e-3, 1e-8, 0.9, 1.0f, 0, INFINITY, 0},
        {"eps 0 with zero moments and gradients", 1e-3, 0, 0.9, 1.0f, 0, 0, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int len = N - 3; len <= N; len += 3) {
            uint64_t s = 7 + k;
            for (int i = 0; i < len; i++) {
                p[i] = rng_f(&s);
                g[i] = cases[k].zero ? 0 : rng_f(&s);
                m[i] = cases[k].zero ? 0 : rng_f(&s) * 0.1f;
                v[i] = cases[k].zero ? 0 : fabsf(rng_f(&s)) * 0.01f;
            }
            if (cases[k].g_at_100 != 0 || isnan(cases[k].g_at_100)) g[100] = cases[k].g_at_100;
            if (cases[k].p_at_7 != 0) p[7] = cases[k].p_at_7;
            const ds4_adamw_hparams h = {.beta1 = cases[k].beta1, .beta2 = 0.999, .eps = cases[k].eps,
                                         .weight_decay = 0.01};
            ds4_adamw_coefs c = ds4_adamw_coefs_at(&h, 2, cases[k].lr, 1);
            memcpy(p2, p, sizeof p);
            memcpy(m2, m, sizeof m);
            memcpy(v2, v, sizeof v);
            for (int i = 0; i < len; i++) g2[i] = cases[k].coef == 1.0f ? g[i] : g[i] * cases[k].coef;
            ds4_adamw_update(&c, p2, g2, m2, v2, len);
            int64_t want = 0;
            for (int i = 0; i < len; i++) want += !(isfinite(p2[i]) && isfinite(m2[i]) && isfinite(v2[i]));
            const int64_t got = ds4_adamw_count_nonfinite(&c, cases[k].coef, p, g, m, v, len);
            CHECK(got == want, "%s, %d elements: counted %lld non-finite, the update writes %lld", cases[k].what, len,
                  (long long)got, (long long)want);
            if (k == 0) CHECK(want == 0, "the ordinary case is finite");
            if (k == 3) CHECK(want > 0, "lr 1e38 overflows");
        }
}

/* ---------------------------------------------------------------------------------------- clip coefficient */

static void test_clip_coef(void) {
    CHECK(ds4_grad_clip_coef(5.0, 0.0) == 1.0f, "clip 0 must disable clipping");
    CHECK(ds4_grad_clip_coef(5.0, -1.0) == 1.0f, "negative clip must disable clipping");
    CHECK(ds4_grad_clip_coef(0.5, 1.0) == 1.0f, "norm below the clip: coefficient 1");
    /* Exactly at the clip the 1e-6 makes the coefficient just below 1, as in torch. */
    float c = ds4_grad_clip_coef(1.0, 1.0);
    CHECK(c < 1.0f && c > 0.999998f, "norm == clip: coefficient %.9g", (double)c);
    c = ds4_grad_clip_coef(4.0, 2.0);
    CHECK(fabs(c - 2.0 / (4.0 + 1e-6)) <= 1e-7, "coef(4, 2) = %.9g", (double)c);
    /* Zero gradients: no division by zero (the 1e-6). */
    CHECK(ds4_grad_clip_coef(0.0, 1.0) == 1.0f, "zero norm");
}

/* ---------------------------------------------------------------------------------------- schedules */

static void check_lr(const ds4_adamw_options *o, const double *want, int n, const char *what) {
    for (int k = 0; k < n; k++) {
        double got = ds4_lr_at(o, k);
        CHECK(fabs(got - want[k]) <= 1e-15 * fabs(want[k]) + 1e-300, "%s: lr_at(%d) = %.17g, expected %.17g", what, k,
              got, want[k]);
    }
}

static void test_schedules(const char *fixtures) {
    /* The training fixture's schedule, recorded from torch's LambdaLR: lr 1e-3, 3 warm-up steps, cosine to 0.1·lr
     * at 10. */
    ds4_adamw_options o = {.lr = 1e-3, .schedule = DS4_LR_COSINE, .warmup_steps = 3, .total_steps = 10,
                           .min_lr_ratio = 0.1};
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(fixtures, "tiny_a/train.safetensors"), &f, &err), &err);
    if (f) {
        const ds4_st_entry *e = need(f, "lr", DS4_F64, 10);
        if (e) {
            double rec[10], worst = 0;
            memcpy(rec, e->data, sizeof rec);
            for (int k = 0; k < 10; k++) {
                double got = ds4_lr_at(&o, k), r = fabs(got - rec[k]) / rec[k];
                if (r > worst) worst = r;
                CHECK(r <= 1e-15, "cosine lr_at(%d) = %.17g, torch LambdaLR %.17g", k, got, rec[k]);
            }
            printf("  cosine schedule vs torch LambdaLR: max rel err %.3g\n", worst);
        }
        ds4_st_close(f);
    }
    /* The same schedule in closed form: warm-up 1/3, 2/3, 1 (k = 0..2), the peak at k = 3, cosine with progress
     * (k-3)/7, and the floor 0.1 from k = 10 on (the schedule is clamped, not continued). */
    double cos_want[13] = {1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 0, 0, 0, 0, 0, 0, 1e-4, 1e-4, 1e-4};
    for (int k = 4; k < 10; k++) cos_want[k] = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + cos(3.14159265358979323846 * (k - 3) / 7.0)));
    check_lr(&o, cos_want, 13, "cosine W=3 T=10");
    /* Cosine without warm-up, W=0, T=4, floor 0.2: progress k/4, so k = 1 and 3 sit at cos = ±sqrt(1/2) and k = 2 is
     * the midpoint 0.2 + 0.8·0.5 = 0.6; from k = 4 on the floor. */
    ds4_adamw_options c2 = {.lr = 2.0, .schedule = DS4_LR_COSINE, .total_steps = 4, .min_lr_ratio = 0.2};
    const double c2_want[6] = {2.0, 2.0 * (0.2 + 0.4 * (1 + sqrt(0.5))), 1.2, 2.0 * (0.2 + 0.4 * (1 - sqrt(0.5))),
                               0.4, 0.4};
    for (int k = 0; k < 6; k++) {
        double got = ds4_lr_at(&c2, k);
        CHECK(fabs(got - c2_want[k]) <= 1e-14, "cosine W=0 T=4: lr_at(%d) = %.17g, expected %.17g", k, got,
              c2_want[k]);
    }
    /* Linear: W=2, T=6, floor 0: 0.5, 1, then 1 - (k-2)/4 → 1, 0.75, 0.5, 0.25, 0, 0. */
    ds4_adamw_options lin = {.lr = 4.0, .schedule = DS4_LR_LINEAR, .warmup_steps = 2, .total_steps = 6};
    const double lin_want[8] = {2.0, 4.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0};
    check_lr(&lin, lin_want, 8, "linear W=2 T=6");
    /* Linear with a floor of 0.5: halfway (k = 4 of W=2, T=6) → 0.5 + 0.5·0.5 = 0.75. */
    lin.min_lr_ratio = 0.5;
    const double lin2_want[8] = {2.0, 4.0, 4.0, 3.5, 3.0, 2.5, 2.0, 2.0};
    check_lr(&lin, lin2_want, 8, "linear W=2 T=6 min 0.5");
    /* Constant, with and without warm-up (total_steps ignored). */
    ds4_adamw_options con = {.lr = 0.3, .schedule = DS4_LR_CONSTANT, .warmup_steps = 4, .total_steps = 1};
    const double con_want[6] = {0.075, 0.15, 0.225, 0.3, 0.3, 0.3};
    for (int k = 0; k < 6; k++)
        CHECK(fabs(ds4_lr_at(&con, k) - con_want[k]) <= 1e-16, "constant W=4: lr_at(%d) = %.17g", k,
              ds4_lr_at(&con, k));
    con.warmup_steps = 0;
    CHECK(ds4_lr_at(&con, 0) == 0.3 && ds4_lr_at(&con, 1000000) == 0.3, "constant without warm-up");
    CHECK(ds4_lr_at(&con, -5) == 0.3, "a negative step counts as step 0");
    CHECK(ds4_lr_at(NULL, 3) == 0.0, "NULL options");
}

/* ---------------------------------------------------------------------------------------- single range */

/* ds4_adamw_update_range against one step computed by hand in double (values where fp32 rounding cannot
 * matter at the 1e-6 level): p = 2, g = 0.5, zero moments, t = 1, lr 0.1, wd 0.5. */
static void test_one_step(void) {
    const ds4_adamw_hparams h = {.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.5};
    float p = 2, g = 0.5f, m = 0, v = 0;
    ds4_adamw_update_range(&h, 1, 0.1, &p, &g, &m, &v, 1, 1);
    /* decay: 2·(1 - 0.05) = 1.9; m = 0.05, v = 0.0025; m̂ = 0.5, v̂ = 0.25 → update -0.1·0.5/(0.5 + 1e-8). */
    double want_p = 1.9 - 0.1 * 0.5 / (0.5 + 1e-8);
    CHECK(fabs(p - want_p) <= 1e-6 * fabs(want_p), "p = %.9g, expected %.9g", (double)p, want_p);
    CHECK(fabs(m - 0.05) <= 1e-8 && fabs(v - 0.0025) <= 1e-9, "m = %.9g, v = %.9g", (double)m, (double)v);
    /* Without decay, second step with the same gradient: m = 0.095, v = 0.004975, m̂ = 0.5, v̂ = 0.25. */
    float p2 = 2, m2 = 0.05f, v2 = 0.0025f;
    ds4_adamw_update_range(&h, 2, 0.1, &p2, &g, &m2, &v2, 1, 0);
    double want2 = 2 - 0.1 * (0.095 / 0.19) / (sqrt(0.004975 / (1 - 0.99 * 0.99)) + 1e-8);
    CHECK(fabs(p2 - want2) <= 1e-6 * fabs(want2), "step 2: p = %.9g, expected %.9g", (double)p2, want2);
    /* weight_decay applies only to ranges flagged for decay; wd = 0 never touches p beyond the update. */
    ds4_adamw_coefs c = ds4_adamw_coefs_at(&h, 1, 0.1, 0);
    CHECK(c.decay == 0 && c.decay_mul == 1.0f, "no-decay coefficients: decay %d, mul %.9g", c.decay,
          (double)c.decay_mul);
}

/* ds4_optim_piece_casts (the device step's working copy written by the update) against a brute-force count on
 * random layouts: tensors in the table (fp32, some kept fp32 in the copy, some rounded) or not, trainable (stepped in
 * pieces of at most 5) or frozen, the whole buffer or a ZeRO-1 region [lo, hi) that starts and ends at piece
 * boundaries. Every element of the table must be written exactly once, by its piece (at the entry's byte plus its
 * offset times the element size, with the entry's lowp) or by a run of rest, and a piece outside the table not at
 * all. A copy placed off its element size must be refused (0), so that the caller casts the whole table. */
static void test_piece_casts(void) {
    uint64_t st = 12345;
    int refused = 0, with_rest = 0, sharded = 0;
    for (int round = 0; round < 400; round++) {
        enum { NTS = 12, MAXE = 64 * NTS };
        int64_t off[NTS + 1], n = 0;
        int inT[NTS], lowp[NTS], train[NTS];
        for (int i = 0; i < NTS; i++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            const uint64_t r = st >> 33;
            off[i] = n, n += 1 + (int64_t)(r % 23);
            inT[i] = r % 5 != 0, lowp[i] = (r >> 4) % 3 != 0, train[i] = (r >> 8) % 4 != 0;
        }
        off[NTS] = n;
        const ds4_dtype mdt = round % 2 ? DS4_BF16 : DS4_F32;
        const int misplace = round % 10 == 9; /* one bf16-sized entry of an fp32 copy off a 4-byte boundary */
        /* pieces of the trainable tensors (chunks of 5 from the tensor's start) */
        ds4_optim_piece pc[MAXE];
        int64_t np = 0;
        for (int i = 0; i < NTS; i++)
            for (int64_t b = 0; train[i] && b < off[i + 1] - off[i]; b += 5)
                pc[np++] = (ds4_optim_piece){off[i] + b, off[i + 1] - off[i] - b < 5 ? off[i + 1] - off[i] - b : 5, i};
        /* the region: all, or pieces [p0, p1) of them (a shard starts and ends at piece boundaries) */
        int64_t p0 = 0, p1 = np, lo = 0, hi = n;
        if (round % 3 == 1 && np > 2) {
            p0 = np / 3, p1 = 2 * np / 3 + 1;
            lo = pc[p0].off, hi = pc[p1 - 1].off + pc[p1 - 1].n;
        }
        /* the cast table of the region, the copy's bytes in table order, each tensor on its element size */
        ds4_cast_entry e[NTS];
        int64_t ne = 0, byte = 0;
        for (int i = 0; i < NTS; i++) {
            if (!inT[i]) continue;
            const int64_t size = lowp[i] && mdt == DS4_BF16 ? 2 : 4;
            byte = (byte + size - 1) / size * size + (misplace && ne == 1 && size == 4 ? 2 : 0);
            const int64_t b = off[i] > lo ? off[i] : lo, end = off[i + 1] < hi ? off[i + 1] : hi;
            if (b < end) e[ne++] = (ds4_cast_entry){b - lo, byte + (b - off[i]) * size, end - b, lowp[i]};
            byte += (off[i + 1] - off[i]) * size;
        }
        ds4_optim_wcast w[MAXE];
        ds4_cast_entry rest[MAXE + NTS + 1];
        int64_t nrest = -1;
        const int ok = ds4_optim_piece_casts(e, ne, mdt, pc + p0, p1 - p0, lo, w, rest, MAXE + NTS + 1, &nrest);
        int bad_place = 0;
        for (int64_t k = 0; k < ne; k++) bad_place |= e[k].dst % (e[k].lowp && mdt == DS4_BF16 ? 2 : 4) != 0;
        /* a misplaced entry refuses only where a piece steps it */
        if (!ok) {
            CHECK(bad_place, "round %d: refused a layout it can write", round);
            refused++;
            continue;
        }
        int64_t seen[MAXE * 23];
        memset(seen, 0, sizeof seen);
        int right = 1;
        for (int64_t c = p0; c < p1; c++) {
            const ds4_optim_wcast *q = &w[c - p0];
            int64_t k = 0;
            while (k < ne && !(pc[c].off - lo >= e[k].src && pc[c].off - lo < e[k].src + e[k].n)) k++;
            if (k == ne) {
                right &= q->dst == -1;
                continue;
            }
            const int64_t size = e[k].lowp && mdt == DS4_BF16 ? 2 : 4;
            right &= q->dst == e[k].dst + (pc[c].off - lo - e[k].src) * size && q->lowp == e[k].lowp &&
                     q->dst % size == 0;
            for (int64_t i = 0; i < pc[c].n; i++) seen[pc[c].off - lo + i]++;
        }
        for (int64_t r = 0; r < nrest; r++) {
            int64_t k = 0;
            while (k < ne && !(rest[r].src >= e[k].src && rest[r].src + rest[r].n <= e[k].src + e[k].n)) k++;
            right &= k < ne && rest[r].n > 0;
            if (k == ne) continue;
            const int64_t size = e[k].lowp && mdt == DS4_BF16 ? 2 : 4;
            right &= rest[r].dst == e[k].dst + (rest[r].src - e[k].src) * size && rest[r].lowp == e[k].lowp;
            for (int64_t i = 0; i < rest[r].n; i++) seen[rest[r].src + i]++;
        }
        for (int64_t k = 0; k < ne; k++)
            for (int64_t i = 0; i < e[k].n; i++) right &= seen[e[k].src + i] == 1;
        with_rest += nrest > 0, sharded += lo > 0;
        CHECK(right, "round %d: the pieces' places and the runs of rest do not write every element of the table once "
              "at its place (%lld pieces, %lld entries, %lld runs)", round, (long long)(p1 - p0), (long long)ne,
              (long long)nrest);
    }
    CHECK(refused > 0 && with_rest > 0 && sharded > 0, "the rounds missed a case: %d refused, %d with runs of rest, "
          "%d of a region", refused, with_rest, sharded);
    printf("  working copy through the update's pieces: 400 layouts (%d refused, %d with runs of rest, %d of a "
           "ZeRO-1 region), every element once\n", refused, with_rest, sharded);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    test_fixture(fixtures);
    test_determinism();
    test_vector_tail();
    test_nonfinite_count();
    test_clip_coef();
    test_schedules(fixtures);
    test_one_step();
    test_piece_casts();
    return ds4t_finish("test_adamw");
}
