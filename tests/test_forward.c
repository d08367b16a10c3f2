/* test_forward.c — the CPU forward pass against transformers' DeepseekV4ForCausalLM (fp32) fixtures.
 *
 * For each fixture (tests/gen_fixtures.py): logits, loss, the residual streams after every layer, and for
 * tiny_a the MTP logits and loss (the official MTP equations of docs/architecture.md, "MTP", around transformers'
 * own decoder layer).
 *
 * Tolerances are the acceptance bounds: max |Δlogit| <= 1e-4 · max(1, max|logit|) and loss within
 * 1e-5 relative. Both implementations are fp32 with different summation orders; measured differences are
 * ~1e-6 relative, so the bounds leave two orders of magnitude while still catching any wrong operation
 * (a single mis-ordered RoPE pair or a wrong Sinkhorn step moves logits by 1e-2 or more). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

static const ds4_st_entry *need(const ds4_st_file *f, const char *name) {
    const ds4_st_entry *e = ds4_st_find(f, name);
    CHECK(e != NULL, "io.safetensors lacks '%s'", name);
    return e;
}

/* max |a - b| and max |b| over n floats */
static void diff(const float *a, const float *b, int64_t n, double *maxd, double *maxref) {
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = fabs((double)a[i] - (double)b[i]);
        if (!(x <= d)) d = x; /* NaN propagates as a failure */
        if (fabs((double)b[i]) > r) r = fabs((double)b[i]);
    }
    *maxd = d;
    *maxref = r;
}

static void check_close(const char *what, const char *fx, const float *got, const float *ref, int64_t n) {
    double d, r;
    diff(got, ref, n, &d, &r);
    double tol = 1e-4 * (r > 1 ? r : 1);
    printf("  %-8s %-12s max|d| %.3g (max|ref| %.3g, tol %.3g)\n", fx, what, d, r, tol);
    CHECK(d <= tol, "%s %s: max |diff| %g > %g", fx, what, d, tol);
}

static void run_fixture(ds4_engine *eng, ds4_engine *eng1, const char *fixtures, const char *name) {
    ds4_error err = {0};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
    if (!m) return;
    ds4_st_file *io = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "io.safetensors"), &io, &err), &err);
    if (!io) {
        ds4_model_free(m);
        return;
    }
    const ds4_config *c = ds4_model_config(m);
    const ds4_st_entry *ids = need(io, "input_ids"), *labels = need(io, "labels"), *logits = need(io, "logits"),
                       *loss = need(io, "loss");
    if (!ids || !labels || !logits || !loss) goto out;
    const int64_t B = ids->shape[0], S = ids->shape[1], V = c->vocab_size, n = c->hc_mult, D = c->hidden_size;
    const int64_t L = c->num_hidden_layers, T = B * S;
    CHECK(ids->dtype == DS4_I64 && logits->shape[2] == V, "%s: fixture shapes", name);
    int64_t *idv = malloc((size_t)T * 8), *lbv = malloc((size_t)T * 8);
    memcpy(idv, ids->data, (size_t)T * 8);
    memcpy(lbv, labels->data, (size_t)T * 8);
    float *out = malloc((size_t)(T * V) * 4), *hid = malloc((size_t)(L * T * n * D) * 4);
    float *mtp = ds4_model_has_mtp(m) ? malloc((size_t)(B * (S - 1) * V) * 4) : NULL;
    ds4_forward_args a = {.ids = idv, .batch = B, .seq = S, .labels = lbv, .logits = out, .hidden = hid, .mtp_logits = mtp};
    ds4_forward_result r;
    CHECK_OK(ds4_model_forward(m, &a, &r, &err), &err);
    check_close("logits", name, out, logits->data, T * V);
    float lref;
    memcpy(&lref, loss->data, 4);
    printf("  %-8s loss %.7f ref %.7f (%lld tokens)\n", name, r.loss, (double)lref, (long long)r.loss_tokens);
    CHECK(fabs(r.loss - lref) <= 1e-5 * fabs(lref), "%s: loss %.8f vs %.8f", name, r.loss, (double)lref);
    for (int64_t l = 0; l < L; l++) {
        char key[32];
        snprintf(key, sizeof key, "hidden.%lld", (long long)l);
        const ds4_st_entry *h = need(io, key);
        if (h) check_close(key, name, hid + l * T * n * D, h->data, T * n * D);
    }
    const ds4_st_entry *mref = ds4_st_find(io, "mtp_logits");
    CHECK((mref != NULL) == (mtp != NULL), "%s: MTP weights present iff the fixture has MTP logits", name);
    if (mref && mtp) {
        check_close("mtp", name, mtp, mref->data, B * (S - 1) * V);
        float mlref;
        memcpy(&mlref, need(io, "mtp_loss")->data, 4);
        printf("  %-8s mtp loss %.7f ref %.7f\n", name, r.mtp_loss, (double)mlref);
        CHECK(fabs(r.mtp_loss - mlref) <= 1e-5 * fabs(mlref), "%s: mtp loss %.8f vs %.8f", name, r.mtp_loss,
              (double)mlref);
    }
    /* Determinism: one thread and all threads give bit-identical logits (every output element is computed
     * by exactly one task in a fixed order). */
    {
        ds4_model *m1 = NULL;
        CHECK_OK(ds4_model_load(eng1, dir, &m1, &err), &err);
        if (m1) {
            float *out1 = malloc((size_t)(T * V) * 4);
            ds4_forward_args a1 = {.ids = idv, .batch = B, .seq = S, .logits = out1};
            CHECK_OK(ds4_model_forward(m1, &a1, NULL, &err), &err);
            CHECK(memcmp(out1, out, (size_t)(T * V) * 4) == 0, "%s: 1-thread logits differ from threaded", name);
            /* a shorter prefix of row 0 gives the prefix of its logits (causality), computed alone */
            const int64_t P = S / 2 + 1;
            ds4_forward_args ap = {.ids = idv, .batch = 1, .seq = P, .logits = out1};
            CHECK_OK(ds4_model_forward(m1, &ap, NULL, &err), &err);
            double d, rr;
            diff(out1, out, P * V, &d, &rr);
            CHECK(d <= 1e-5 * (rr > 1 ? rr : 1), "%s: prefix [1, %lld] logits differ by %g", name, (long long)P, d);
            free(out1);
            ds4_model_free(m1);
        }
    }
    /* bad input is an error that names the position, not a crash */
    idv[1] = V;
    ds4_forward_args bad = {.ids = idv, .batch = B, .seq = S, .logits = out};
    CHECK_STATUS(ds4_model_forward(m, &bad, NULL, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "ids[0, 1]") != NULL, "message names the position: %s", err.msg);
    idv[1] = 0;
    lbv[2] = -5;
    ds4_forward_args badl = {.ids = idv, .batch = B, .seq = S, .labels = lbv, .logits = out};
    CHECK_STATUS(ds4_model_forward(m, &badl, NULL, &err), DS4_ERR_ARG, &err);
    if (!mtp) {
        float tmp[1];
        ds4_forward_args am = {.ids = idv, .batch = 1, .seq = 2, .mtp_logits = tmp};
        CHECK_STATUS(ds4_model_forward(m, &am, NULL, &err), DS4_ERR_ARG, &err);
    }
    free(idv);
    free(lbv);
    free(out);
    free(hid);
    free(mtp);
out:
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_engine *eng = NULL, *eng1 = NULL;
    ds4_engine_options o = {0}, o1 = {.n_threads = 1};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    CHECK_OK(ds4_engine_create(&o1, &eng1, &err), &err);
    if (!eng || !eng1) return ds4t_finish("test_forward");
    run_fixture(eng, eng1, fixtures, "tiny_a");
    run_fixture(eng, eng1, fixtures, "tiny_b");
    run_fixture(eng, eng1, fixtures, "tiny_hf");
    ds4_engine_free(eng);
    ds4_engine_free(eng1);
    return ds4t_finish("test_forward");
}
