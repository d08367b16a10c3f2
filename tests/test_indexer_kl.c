/* test_indexer_kl.c — the lightning-indexer KL loss (indexer_kl > 0) against central finite differences.
 *
 * No framework implements this loss for DeepSeek-V4, so the reference is the loss itself: for the indexer
 * parameters with the largest analytic gradients, (L(θ+ε) − L(θ−ε)) / 2ε of the reported indexer_loss must
 * match. ε = 1e-3: scores move by ~1e-3, below the fixture's top-k margins (seeds were chosen so no near-tie
 * sits at a top-k boundary), so the picks stay fixed and L is smooth; the loss is accumulated in double, so
 * the difference quotient carries ~1e-4 relative noise — the 2e-2 tolerance covers it and the O(ε²)
 * curvature term, and still catches a wrong factor or a missing ReLU mask.
 * Also: the option leaves every non-indexer gradient bit-identical (inputs and target are detached), and
 * without it the indexer gets exactly zero. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    CHECK_OK(ds4_engine_create(NULL, &eng, &err), &err);
    if (!eng || ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &a)) return ds4t_finish("test_indexer_kl");
    const int64_t P = ds4_model_param_count(m);
    ds4_forward_result r;
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    /* without the option */
    CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
    CHECK(isnan(r.indexer_loss), "no indexer loss without the option");
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    float *g0 = malloc((size_t)P * sizeof(float));
    memcpy(g0, ds4_model_grads(m), (size_t)P * sizeof(float));
    /* with it */
    ds4_train_options o = {.indexer_kl = 1.0};
    CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
    ds4_model_zero_grad(m);
    CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
    const double L0 = r.indexer_loss;
    CHECK(isfinite(L0) && L0 > 0, "indexer loss %g", L0);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    const float *g = ds4_model_grads(m);
    float *params = ds4_model_params(m);
    int64_t checked = 0, indexer_nonzero = 0;
    double worst = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *name;
        ds4_tensor_info ti;
        ds4_model_tensor_at(m, i, &name, NULL, &err);
        CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
        if (!ti.is_param) continue;
        const int is_indexer = strstr(name, ".attn.indexer.") != NULL;
        if (!is_indexer) {
            CHECK(memcmp(g + ti.offset, g0 + ti.offset, (size_t)ti.numel * sizeof(float)) == 0,
                  "%s: gradient changed by the indexer loss", name);
            continue;
        }
        for (int64_t k = 0; k < ti.numel; k++) {
            CHECK(g0[ti.offset + k] == 0.0f, "%s: non-zero gradient without the option", name);
            indexer_nonzero += g[ti.offset + k] != 0.0f;
        }
        CHECK(ti.trainable, "%s trainable with the option", name);
        /* the element with the largest analytic gradient, and two others spread through the tensor */
        int64_t best = 0;
        for (int64_t k = 1; k < ti.numel; k++)
            if (fabsf(g[ti.offset + k]) > fabsf(g[ti.offset + best])) best = k;
        for (int pick = 0; pick < 3; pick++) {
            const int64_t k = (best + pick * 7919) % ti.numel;
            const double an = g[ti.offset + k];
            float *p = params + ti.offset + k;
            const float keep = *p, eps = 1e-3f;
            *p = keep + eps;
            CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
            const double lp = r.indexer_loss;
            *p = keep - eps;
            CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
            const double lm = r.indexer_loss;
            *p = keep;
            const double fd = (lp - lm) / (2.0 * (double)eps);
            const double den = fmax(fmax(fabs(an), fabs(fd)), 1e-4);
            const double rel = fabs(an - fd) / den;
            worst = fmax(worst, rel);
            CHECK(rel <= 2e-2, "%s[%lld]: analytic %.6g vs finite difference %.6g", name, (long long)k, an, fd);
            checked++;
        }
    }
    printf("  indexer KL %.6f: %lld finite-difference checks, worst relative difference %.3g; %lld non-zero "
           "indexer gradient elements\n", L0, (long long)checked, worst, (long long)indexer_nonzero);
    CHECK(checked >= 20 && indexer_nonzero > 0, "checked %lld elements", (long long)checked);
    o.indexer_kl = -1;
    CHECK_STATUS(ds4_model_set_train_options(m, &o, &err), DS4_ERR_ARG, &err);
    free(g0);
    ds4_st_close(io);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return ds4t_finish("test_indexer_kl");
}
