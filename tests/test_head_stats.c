/* test_head_stats.c — the head's row statistics on the CPU backend (ops.h: ce_rows, logprobs, logp_bwd). A training
 * forward keeps each row's max and Σ exp from ce_rows / logprobs so that the backward's logp_bwd over the same logits
 * need not form them again; that is only right if they are the values logp_bwd forms itself. So:
 *   - logprobs and ce_rows write the same statistics, byte for byte, for every row, targets of -100 included (the
 *     backward may score a row the loss did not: backward_logprobs after a forward with other targets);
 *   - they are what they claim independently of the backend: mx the row's maximum exactly, se within 1e-12
 *     (relative) of Σ exp(z − mx) taken in long double (the only difference is rounding order in double: ~V·2^-53);
 *   - logp_bwd given them writes the bytes logp_bwd writes without them (per-token g and g0, a row of g = 0, rows of
 *     target -100, dl apart from the logits and in place);
 *   - then the same through a training step: a model's gradients after ds4_model_backward are those of the same step
 *     with the statistics withheld from the backward (the tape's flag cleared), byte for byte.
 * Logits include ties of the maximum (so the max's sign of zero and its id do not matter) and a wide range. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "model.h"
#include "sched.h"
#include "testlib.h"

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static double urand(void) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}

static void t_ops(ds4_engine *e, int64_t R, int64_t V) {
    char what[96];
    snprintf(what, sizeof what, "head statistics [%lld x %lld]", (long long)R, (long long)V);
    ds4_config c;
    ds4_config_default(&c);
    c.vocab_size = V;
    ds4_dev *d = NULL;
    ds4_error err;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (d) CHECK_OK(d->ops->reserve(d, &c, R, 1, 1, &err), &err);
    if (!d) return;
    float *z = malloc((size_t)(R * V) * sizeof(float)), *lp = malloc((size_t)R * 2 * sizeof(float));
    float *mx[2] = {malloc((size_t)R * sizeof(float)), malloc((size_t)R * sizeof(float))};
    double *se[2] = {malloc((size_t)R * sizeof(double)), malloc((size_t)R * sizeof(double))};
    double *nll = malloc((size_t)R * sizeof(double));
    float *dl[3] = {malloc((size_t)(R * V) * sizeof(float)), malloc((size_t)(R * V) * sizeof(float)),
                    malloc((size_t)(R * V) * sizeof(float))};
    float *g = malloc((size_t)R * sizeof(float));
    int64_t *tgt = malloc((size_t)R * sizeof(int64_t));
    if (!z || !lp || !mx[0] || !mx[1] || !se[0] || !se[1] || !nll || !dl[0] || !dl[1] || !dl[2] || !g || !tgt) {
        CHECK(0, "allocation");
        goto out;
    }
    for (int64_t r = 0; r < R; r++) {
        const double spread = r % 3 == 0 ? 30.0 : 4.0;
        for (int64_t v = 0; v < V; v++) z[r * V + v] = (float)((urand() * 2 - 1) * spread);
        if (r % 4 == 1) z[r * V + V / 3] = z[r * V + V - 1] = 50.0f; /* ties of the maximum */
        tgt[r] = r % 5 == 2 ? -100 : (int64_t)(urand() * (double)V) % V;
        g[r] = (float)(urand() * 4 - 2);
    }
    g[R / 2] = 0;
    memset(mx[0], 0xff, (size_t)R * sizeof(float)), memset(mx[1], 0xff, (size_t)R * sizeof(float));
    memset(se[0], 0xff, (size_t)R * sizeof(double)), memset(se[1], 0xff, (size_t)R * sizeof(double));
    OP(d, logprobs, .logits = z, .rows = R, .V = V, .tgt = tgt, .logp = lp, .entropy = lp + R, .nll = nll,
       .rmx = mx[0], .rse = se[0]);
    OP(d, ce_rows, .logits = z, .rows = R, .V = V, .tgt = tgt, .nll = nll, .rmx = mx[1], .rse = se[1]);
    CHECK_OK(ds4_dev_check(d, what, &err), &err);
    CHECK(memcmp(mx[0], mx[1], (size_t)R * sizeof(float)) == 0 && memcmp(se[0], se[1], (size_t)R * sizeof(double)) == 0,
          "%s: logprobs and ce_rows write different statistics", what);
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++) {
        float m = -INFINITY;
        for (int64_t v = 0; v < V; v++) m = z[r * V + v] > m ? z[r * V + v] : m;
        long double s = 0;
        for (int64_t v = 0; v < V; v++) s += expl((long double)z[r * V + v] - m);
        bad += mx[0][r] != m || !(fabsl((long double)se[0][r] - s) <= 1e-12L * s);
    }
    CHECK(bad == 0, "%s: %lld rows whose max or Σ exp is not the row's (rows of target -100 included)", what,
          (long long)bad);
    for (int k = 0; k < 3; k++) { /* per-token g, apart; g0, apart; per-token g in place */
        const int in_place = k == 2;
        const float *dlogp = k == 1 ? NULL : g;
        if (in_place) memcpy(dl[0], z, (size_t)(R * V) * sizeof(float)), memcpy(dl[1], z, (size_t)(R * V) * sizeof(float));
        else memset(dl[0], 0xff, (size_t)(R * V) * sizeof(float)), memset(dl[1], 0xff, (size_t)(R * V) * sizeof(float));
        OP(d, logp_bwd, .dl = dl[0], .logits = in_place ? dl[0] : z, .rows = R, .V = V, .tgt = tgt, .dlogp = dlogp,
           .g0 = -0.37);
        OP(d, logp_bwd, .dl = dl[1], .logits = in_place ? dl[1] : z, .rows = R, .V = V, .tgt = tgt, .dlogp = dlogp,
           .g0 = -0.37, .rmx = mx[0], .rse = se[0]);
        CHECK_OK(ds4_dev_check(d, what, &err), &err);
        CHECK(memcmp(dl[0], dl[1], (size_t)(R * V) * sizeof(float)) == 0,
              "%s: logp_bwd from the statistics differs from logp_bwd alone (%s)", what,
              k == 0 ? "per-token g" : (k == 1 ? "g0" : "in place"));
        int64_t nan = 0;
        for (int64_t i = 0; i < R * V; i++) nan += isnan(dl[1][i]);
        CHECK(nan == 0, "%s: %lld gradients NaN (unwritten)", what, (long long)nan);
    }
out:
    free(z), free(lp), free(mx[0]), free(mx[1]), free(se[0]), free(se[1]), free(nll), free(dl[0]), free(dl[1]);
    free(dl[2]), free(g), free(tgt);
    ds4_dev_release(d);
}

/* A training step's gradients with the statistics the forward kept against the same step with them withheld from
 * the backward (the tape's flag cleared after the forward): CE, per-token log-probabilities, the MTP loss (its head's
 * statistics after the main head's rows) and the head in chunks of 7 rows (the statistics at each chunk's offset). */
static void t_model(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) return;
    const int64_t T = a.batch * a.seq, P = ds4_model_param_count(m);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    static const char *const what[4] = {"ce", "per-token log-probs", "mtp", "head chunks of 7"};
    for (int mode = 0; mode < 4; mode++) {
        if (mode == 2 && !ds4_model_has_mtp(m)) continue;
        float *g[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            ds4_train_options o = {.mtp_lambda = mode == 2 ? 0.3 : 0, .head_chunk = mode == 3 ? 7 : 0};
            CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
            ds4_model_zero_grad(m);
            ds4_forward_result r;
            CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
            if (!m->tape) break;
            CHECK(m->tape->stats_heads == (mode == 2 ? DS4_HEAD_MAIN | DS4_HEAD_MTP : DS4_HEAD_MAIN),
                  "%s %s: the forward kept the statistics of heads %d", name, what[mode], m->tape->stats_heads);
            if (k) m->tape->stats_heads = 0; /* the backward forms them itself */
            if (mode == 1) {
                float *dlp = malloc((size_t)T * sizeof(float));
                for (int64_t t = 0; t < T; t++) dlp[t] = (float)(-1.0 / (double)(t + 1));
                CHECK_OK(ds4_model_backward_logprobs(m, dlp, &err), &err);
                free(dlp);
            } else {
                CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
            }
            g[k] = malloc((size_t)P * sizeof(float));
            if (g[k]) memcpy(g[k], ds4_model_grads(m), (size_t)P * sizeof(float));
        }
        if (g[0] && g[1]) {
            int64_t diff = 0;
            for (int64_t i = 0; i < P; i++) diff += memcmp(&g[0][i], &g[1][i], sizeof(float)) != 0;
            CHECK(diff == 0, "%s %s: %lld of %lld gradient values differ with the kept statistics", name, what[mode],
                  (long long)diff, (long long)P);
        } else {
            CHECK(0, "%s %s: no gradients", name, what[mode]);
        }
        free(g[0]), free(g[1]);
    }
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_engine *e = NULL;
    ds4_error err;
    const ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &e, &err), &err);
    if (e) {
        t_ops(e, 13, 1003);
        t_ops(e, 1, 7);
        t_ops(e, 40, 280);
        t_model(e, fixtures, "tiny_a");
        t_model(e, fixtures, "tiny_b");
        ds4_engine_free(e);
    }
    return ds4t_finish("test_head_stats");
}
