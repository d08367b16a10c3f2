/* test_step.c — incremental decoding (ds4_model_step with per-sequence caches) against one full forward.
 *
 * The reference is ds4_model_forward over the whole sequence, itself checked against transformers in
 * test_forward.c. Every fixture model is decoded with chunk patterns that cross the sliding window, the CSA
 * rate (4) and the HCA rate (8 / 16) at irregular offsets, several sequences of different lengths in one step,
 * a cache copied mid-sequence, and a cache whose capacity is below the sliding window (a smaller ring).
 * Tolerance: the bound of 1e-5 on logits' log-probabilities is applied to the logits themselves; the
 * same kernels run on the same rows, so the measured difference is expected to be 0 (printed). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

enum { SEQ = 53 };

/* Full-forward logits [S, V] of ids. */
static float *full_logits(ds4_model *m, const int64_t *ids, int64_t S) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    float *lg = malloc((size_t)(S * V) * sizeof(float));
    ds4_error err = {0};
    ds4_forward_args a = {.ids = ids, .batch = 1, .seq = S, .logits = lg};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    return lg;
}

/* Decode ids into a fresh cache in the given chunks (pattern repeats), collecting every row's logits. */
static double decode_chunks(ds4_model *m, const int64_t *ids, int64_t S, const int64_t *pat, int64_t npat,
                            const float *ref) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    ds4_error err = {0};
    ds4_cache *c = NULL;
    CHECK_OK(ds4_cache_create(m, S, &c, &err), &err);
    if (!c) return INFINITY;
    float *lg = malloc((size_t)(S * V) * sizeof(float));
    int64_t done = 0, k = 0;
    while (done < S) {
        int64_t n = pat[k++ % npat];
        if (n > S - done) n = S - done;
        ds4_step_args a = {.nseq = 1, .caches = &c, .counts = &n, .ids = ids + done, .logits = lg + done * V};
        CHECK_OK(ds4_model_step(m, &a, &err), &err);
        done += n;
    }
    CHECK(ds4_cache_len(c) == S, "cache length %lld, wanted %lld", (long long)ds4_cache_len(c), (long long)S);
    double d = ds4t_max_abs_diff(lg, ref, S * V);
    free(lg);
    ds4_cache_free(c);
    return d;
}

static void run_fixture(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_error err = {0};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
    if (!m) return;
    const ds4_config *cf = ds4_model_config(m);
    const int64_t V = cf->vocab_size;
    printf("%s: window %lld, CSA rate %lld, HCA rate %lld\n", name, (long long)cf->sliding_window,
           (long long)cf->compress_rate_csa, (long long)cf->compress_rate_hca);
    int64_t ids[3][SEQ];
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < SEQ; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            ids[k][i] = (int64_t)((r >> 33) % (uint64_t)V);
        }
    float *ref[3];
    const int64_t lens[3] = {SEQ, 37, 22};
    for (int k = 0; k < 3; k++) ref[k] = full_logits(m, ids[k], lens[k]);

    /* one sequence, several chunkings */
    const int64_t all[] = {SEQ}, ones[] = {1}, irregular[] = {3, 2, 1, 5, 7, 1, 4, 9, 2, 6}, prefill[] = {13, 1};
    const int64_t odd[] = {5, 11, 3};
    const struct {
        const char *what;
        const int64_t *p;
        int64_t n;
    } pats[] = {{"whole", all, 1}, {"1 by 1", ones, 1}, {"irregular", irregular, 10}, {"13 then 1s", prefill, 2},
                {"5,11,3", odd, 3}};
    for (size_t i = 0; i < sizeof pats / sizeof pats[0]; i++) {
        double d = decode_chunks(m, ids[0], SEQ, pats[i].p, pats[i].n, ref[0]);
        printf("  %-12s max|dlogit| %.3g\n", pats[i].what, d);
        CHECK(d <= 1e-5, "%s: chunks %s: max |dlogit| %g", name, pats[i].what, d);
    }

    /* three sequences of different lengths in the same steps, each with its own chunking; last_logits only */
    ds4_cache *c[3] = {0};
    for (int k = 0; k < 3; k++) CHECK_OK(ds4_cache_create(m, lens[k], &c[k], &err), &err);
    if (c[0] && c[1] && c[2]) {
        int64_t done[3] = {0, 0, 0}, step = 0;
        double d = 0;
        for (;;) {
            ds4_cache *sc[3];
            int64_t counts[3], cat[3 * SEQ], ns = 0, nt = 0, who[3];
            for (int k = 0; k < 3; k++) {
                if (done[k] == lens[k]) continue;
                int64_t n = 1 + (step * (k + 2) + k) % 6; /* 1..6, a different rhythm per sequence */
                if (n > lens[k] - done[k]) n = lens[k] - done[k];
                memcpy(cat + nt, ids[k] + done[k], (size_t)n * sizeof(int64_t));
                sc[ns] = c[k];
                counts[ns] = n;
                who[ns++] = k;
                nt += n;
            }
            if (ns == 0) break;
            float *last = malloc((size_t)(ns * V) * sizeof(float));
            ds4_step_args a = {.nseq = ns, .caches = sc, .counts = counts, .ids = cat, .last_logits = last};
            CHECK_OK(ds4_model_step(m, &a, &err), &err);
            for (int64_t s = 0; s < ns; s++) {
                const int k = (int)who[s];
                done[k] += counts[s];
                double x = ds4t_max_abs_diff(last + s * V, ref[k] + (done[k] - 1) * V, V);
                d = x > d ? x : d;
            }
            free(last);
            step++;
        }
        printf("  %-12s max|dlogit| %.3g (%lld steps)\n", "batched", d, (long long)step);
        CHECK(d <= 1e-5, "%s: batched steps: max |dlogit| %g", name, d);
    }
    for (int k = 0; k < 3; k++) ds4_cache_free(c[k]);

    /* copy mid-sequence (into a cache whose ring is smaller than the window) and continue both */
    {
        ds4_cache *a0 = NULL, *b0 = NULL, *small = NULL;
        CHECK_OK(ds4_cache_create(m, SEQ, &a0, &err), &err);
        CHECK_OK(ds4_cache_create(m, SEQ, &b0, &err), &err);
        const int64_t pre = 2, small_cap = cf->sliding_window > 3 ? cf->sliding_window - 1 : 3;
        CHECK_OK(ds4_cache_create(m, small_cap, &small, &err), &err);
        if (a0 && b0 && small) {
            int64_t n = 19;
            ds4_step_args a = {.nseq = 1, .caches = &a0, .counts = &n, .ids = ids[0]};
            CHECK_OK(ds4_model_step(m, &a, &err), &err);
            CHECK_OK(ds4_cache_copy(b0, a0, &err), &err);
            float *lg = malloc((size_t)(SEQ * V) * sizeof(float));
            int64_t rest = SEQ - 19;
            ds4_step_args bcont = {.nseq = 1, .caches = &b0, .counts = &rest, .ids = ids[0] + 19, .logits = lg};
            CHECK_OK(ds4_model_step(m, &bcont, &err), &err);
            double d = ds4t_max_abs_diff(lg, ref[0] + 19 * V, rest * V);
            printf("  %-12s max|dlogit| %.3g\n", "copied", d);
            CHECK(d <= 1e-5, "%s: continued copy: max |dlogit| %g", name, d);
            /* the small cache: prefill 2, copy into a second small one, then fill it to capacity */
            ds4_cache *small2 = NULL;
            CHECK_OK(ds4_cache_create(m, small_cap, &small2, &err), &err);
            int64_t np = pre;
            ds4_step_args sp = {.nseq = 1, .caches = &small, .counts = &np, .ids = ids[0]};
            CHECK_OK(ds4_model_step(m, &sp, &err), &err);
            CHECK_OK(ds4_cache_copy(small2, small, &err), &err);
            int64_t nrest = small_cap - pre;
            ds4_step_args sr = {.nseq = 1, .caches = &small2, .counts = &nrest, .ids = ids[0] + pre, .logits = lg};
            CHECK_OK(ds4_model_step(m, &sr, &err), &err);
            d = ds4t_max_abs_diff(lg, ref[0] + pre * V, nrest * V);
            CHECK(d <= 1e-5, "%s: small-capacity cache: max |dlogit| %g", name, d);
            /* past capacity: refused, nothing appended */
            int64_t one = 1;
            ds4_step_args over = {.nseq = 1, .caches = &small2, .counts = &one, .ids = ids[0]};
            CHECK_STATUS(ds4_model_step(m, &over, &err), DS4_ERR_SHAPE, &err);
            CHECK(strstr(err.msg, "capacity") != NULL, "message: %s", err.msg);
            CHECK(ds4_cache_len(small2) == small_cap, "length changed by a refused step");
            /* the same cache twice, an id out of range: refused, nothing appended */
            ds4_cache *twice[2] = {a0, a0};
            int64_t cnt2[2] = {1, 1};
            ds4_step_args dup = {.nseq = 2, .caches = twice, .counts = cnt2, .ids = ids[0]};
            CHECK_STATUS(ds4_model_step(m, &dup, &err), DS4_ERR_ARG, &err);
            CHECK(strstr(err.msg, "twice") != NULL, "message: %s", err.msg);
            int64_t bad = V;
            ds4_step_args badid = {.nseq = 1, .caches = &a0, .counts = &one, .ids = &bad};
            CHECK_STATUS(ds4_model_step(m, &badid, &err), DS4_ERR_ARG, &err);
            CHECK(ds4_cache_len(a0) == 19, "length changed by a refused step: %lld", (long long)ds4_cache_len(a0));
            /* copying into a cache too small for the source is refused */
            CHECK_STATUS(ds4_cache_copy(small, a0, &err), DS4_ERR_SHAPE, &err);
            ds4_cache_free(small2);
            free(lg);
        }
        ds4_cache_free(a0);
        ds4_cache_free(b0);
        ds4_cache_free(small);
    }
    for (int k = 0; k < 3; k++) free(ref[k]);
    ds4_model_free(m);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_step", run_fixture); }
