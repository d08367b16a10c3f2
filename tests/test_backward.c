/* test_backward.c — every parameter's gradient against torch autograd on transformers' model (fp32).
 *
 * grads.safetensors (tests/gen_fixtures.py) holds, under the canonical names, d(loss)/d(param) for the
 * fixture batch ("main.*") and, for tiny_a, d(loss + 0.3·mtp_loss)/d(param) ("mtp.*").
 *
 * Criterion: ‖g − g_ref‖ / max(‖g_ref‖, floor) ≤ 1e-3 per tensor (Frobenius norms). Both sides are fp32 with
 * different summation orders; measured ratios are ~1e-6..1e-5, so 1e-3 leaves a wide margin while any
 * wrong term (a missing clamp mask, a transposed mix, a wrong softmax Jacobian) moves a tensor's gradient by
 * far more. The floor 1e-7·sqrt(numel) only matters for tensors whose true gradient is (near) zero: a mean
 * per-element error of 1e-7 is below fp32 resolution of the surrounding values. Tensors torch gives no
 * gradient (indexer, router bias, the MTP block without the MTP loss) must be exactly zero.
 *
 * Then layouts that must not change a bit (same_bits): per-block recomputation, and the bf16 mode's tape keeping
 * the inputs of its bf16 products in bf16. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#include "model.h"
#include "sched.h"

static int zero_expected(const char *name, int mtp_on) {
    if (strstr(name, ".attn.indexer.") || strstr(name, ".ffn.gate.bias")) return 1;
    return !mtp_on && strncmp(name, "mtp.", 4) == 0;
}

static void check_grads(ds4_model *m, const ds4_st_file *gf, const char *prefix, const char *fx, int mtp_on) {
    ds4_error err = {0};
    const float *G = ds4_model_grads(m);
    double worst = 0;
    const char *worst_name = "";
    size_t checked = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *name;
        ds4_tensor view;
        ds4_tensor_info info;
        CHECK_OK(ds4_model_tensor_at(m, i, &name, &view, &err), &err);
        CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
        if (!info.is_param) continue;
        const float *g = G + info.offset;
        if (zero_expected(name, mtp_on)) {
            int64_t nz = 0;
            for (int64_t k = 0; k < info.numel; k++) nz += g[k] != 0.0f;
            CHECK(nz == 0, "%s %s: %lld non-zero gradient elements where none may flow", fx, name, (long long)nz);
            CHECK(!info.trainable, "%s %s: reported trainable", fx, name);
            continue;
        }
        char key[300];
        snprintf(key, sizeof key, "%s%s", prefix, name);
        const ds4_st_entry *e = ds4_st_find(gf, key);
        CHECK(e != NULL, "%s: fixture lacks %s", fx, key);
        if (!e) continue;
        int64_t numel = 1;
        for (int32_t k = 0; k < e->ndim; k++) numel *= e->shape[k];
        CHECK(numel == info.numel, "%s %s: %lld elements vs fixture %lld", fx, name, (long long)info.numel,
              (long long)numel);
        if (numel != info.numel) continue;
        double dd = 0, rr = 0;
        for (int64_t k = 0; k < numel; k++) {
            float r;
            memcpy(&r, (const char *)e->data + 4 * k, 4);
            dd += ((double)g[k] - r) * ((double)g[k] - r);
            rr += (double)r * r;
        }
        const double floor = 1e-7 * sqrt((double)numel);
        const double rel = sqrt(dd) / fmax(sqrt(rr), floor);
        if (!(rel <= worst)) worst = rel, worst_name = name;
        CHECK(rel <= 1e-3, "%s %s%s: relative gradient error %.3g (|ref| %.3g)", fx, prefix, name, rel, sqrt(rr));
        checked++;
    }
    printf("  %-8s %-6s %zu tensors, worst relative error %.3g (%s)\n", fx, prefix, checked, worst, worst_name);
}

static void run(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_error err = {0};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    ds4_model *m = NULL;
    ds4_st_file *io = NULL, *gf = NULL;
    CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
    CHECK_OK(ds4_st_open(ds4t_path(dir, "io.safetensors"), &io, &err), &err);
    CHECK_OK(ds4_st_open(ds4t_path(dir, "grads.safetensors"), &gf, &err), &err);
    if (!m || !io || !gf) goto out;
    const ds4_st_entry *ids = ds4_st_find(io, "input_ids"), *labels = ds4_st_find(io, "labels");
    const int64_t B = ids->shape[0], S = ids->shape[1];
    int64_t *idv = malloc((size_t)(B * S) * 8), *lbv = malloc((size_t)(B * S) * 8);
    memcpy(idv, ids->data, (size_t)(B * S) * 8);
    memcpy(lbv, labels->data, (size_t)(B * S) * 8);
    ds4_forward_args a = {.ids = idv, .batch = B, .seq = S, .labels = lbv};
    ds4_forward_result r;
    /* backward before any training forward is an error, not a crash */
    CHECK_STATUS(ds4_model_backward(m, 1.0, &err), DS4_ERR_ARG, &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    CHECK_STATUS(ds4_model_backward(m, 1.0, &err), DS4_ERR_ARG, &err);
    CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    check_grads(m, gf, "main.", name, 0);
    /* the tape is consumed: a second backward needs a new forward */
    CHECK_STATUS(ds4_model_backward(m, 1.0, &err), DS4_ERR_ARG, &err);
    /* The head in chunks of 7 rows (head_chunk): per-row losses and log-probabilities come from the same per-row
     * operations on the same logits, so they are the same bits; the head's weight gradient adds the chunks in order
     * (another summation order), so every gradient is held to the torch bound again. */
    {
        const int64_t T = B * S;
        float *lp0 = malloc((size_t)T * 8), *lp1 = lp0 + T;
        ds4_forward_result r0 = r, r1;
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
        CHECK_OK(ds4_model_logprobs(m, lp0, NULL, &err), &err);
        ds4_train_options chunked = {.head_chunk = 7};
        CHECK_OK(ds4_model_set_train_options(m, &chunked, &err), &err);
        CHECK_OK(ds4_model_forward_train(m, &a, &r1, &err), &err);
        CHECK_OK(ds4_model_logprobs(m, lp1, NULL, &err), &err);
        CHECK(r1.loss == r0.loss && r.loss == r0.loss, "%s: loss with the head in chunks %.17g vs %.17g", name, r1.loss,
              r0.loss);
        CHECK(memcmp(lp0, lp1, (size_t)T * 4) == 0, "%s: log-probabilities with the head in chunks differ", name);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)r1.loss_tokens, &err), &err);
        check_grads(m, gf, "main.", name, 0);
        ds4_train_options plain = {0};
        CHECK_OK(ds4_model_set_train_options(m, &plain, &err), &err);
        free(lp0);
    }
    /* Per-token log-probabilities against an independent log-softmax of the inference logits. */
    {
        const int64_t T = B * S, V = ds4_model_config(m)->vocab_size;
        float *logits = malloc((size_t)(T * V) * 4), *lp = malloc((size_t)T * 4), *ent = malloc((size_t)T * 4);
        float *dlp = malloc((size_t)T * 4);
        ds4_forward_args ai = {.ids = idv, .batch = B, .seq = S, .logits = logits};
        CHECK_OK(ds4_model_forward(m, &ai, NULL, &err), &err);
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
        CHECK_OK(ds4_model_logprobs(m, lp, ent, &err), &err);
        double maxd = 0, maxe = 0, sum = 0;
        int64_t cnt = 0;
        for (int64_t t = 0; t < T; t++) {
            const float *z = logits + t * V;
            double mx = -INFINITY, se = 0, ez = 0;
            for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
            for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx);
            for (int64_t v = 0; v < V; v++) ez += exp(z[v] - mx) / se * (z[v] - mx - log(se));
            maxe = fmax(maxe, fabs(ent[t] + ez)); /* H = -Σ p log p */
            const int64_t y = t % S + 1 < S ? lbv[t + 1] : -100;
            if (y == -100) {
                CHECK(lp[t] == 0.0f, "%s: logp at unscored position %lld is %g", name, (long long)t, lp[t]);
                dlp[t] = 0;
                continue;
            }
            maxd = fmax(maxd, fabs(lp[t] - (z[y] - mx - log(se))));
            sum -= lp[t];
            cnt++;
            dlp[t] = (float)(-1.0 / (double)r.loss_tokens);
        }
        /* fp32 logits, log-softmax in double on both sides: agreement to ~1e-6 */
        CHECK(maxd < 1e-5 && maxe < 1e-5, "%s: logprobs max|d| %g, entropy max|d| %g", name, maxd, maxe);
        CHECK(cnt == r.loss_tokens && fabs(sum / cnt - r.loss) < 1e-6 * r.loss, "%s: mean -logp %g vs loss %g",
              name, sum / cnt, r.loss);
        /* d(mean CE) = Σ (−1/N) d logp: backward_logprobs with that per-token gradient reproduces torch's */
        CHECK_OK(ds4_model_backward_logprobs(m, dlp, &err), &err);
        check_grads(m, gf, "main.", name, 0);
        /* micro-batches: each row alone, scaled by 1 / (scored tokens of the whole batch), add up to the
         * one-batch gradient (token-mean over the global batch) */
        if (B > 1) {
            ds4_model_zero_grad(m);
            for (int64_t row = 0; row < B; row++) {
                ds4_forward_args ar = {.ids = idv + row * S, .batch = 1, .seq = S, .labels = lbv + row * S};
                ds4_forward_result rr;
                CHECK_OK(ds4_model_forward_train(m, &ar, &rr, &err), &err);
                CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
            }
            check_grads(m, gf, "main.", name, 0);
        }
        free(logits);
        free(lp);
        free(ent);
        free(dlp);
    }
    if (ds4_model_has_mtp(m)) {
        ds4_train_options o = {.mtp_lambda = 0.3};
        CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
        check_grads(m, gf, "mtp.", name, 1);
    }
    free(idv);
    free(lbv);
out:
    ds4_st_close(io);
    ds4_st_close(gf);
    ds4_model_free(m);
}

/* Two layouts of the same computation, so on the deterministic CPU they must give the same bits: losses,
 * log-probabilities and every gradient, for CE, the per-token path, the MTP loss, the indexer-KL option and the head
 * in chunks; and the second a smaller tape.
 *  - bf16 0: per-block recomputation (ds4_train_options.recompute) against keeping every block's activations;
 *  - bf16 1: in the bf16 mode's emulation (ds4_model_emulate_bf16), the tape's inputs of bf16 products kept in bf16
 *    (ds4_tape.x16) against keeping them in fp32 (model tape_f32), which the products round as they read them. */
static void same_bits(ds4_engine *eng, const char *fixtures, const char *name, int bf16) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) return;
    const int64_t T = a.batch * a.seq, P = ds4_model_param_count(m);
    const int mtp = ds4_model_has_mtp(m), csa = ds4_model_config(m)->index_topk > 0;
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    if (bf16) ds4_model_emulate_bf16(m, 1);
    const char *opt = bf16 ? "bf16 tape" : "recomputation";
    float *g[2], *lp[2];
    for (int mode = 0; mode < 4; mode++) {
        if ((mode == 2 && !mtp) || (mode == 3 && !csa)) continue;
        static const char *const what[4] = {"ce", "per-token log-probs", "mtp", "indexer-kl + head chunks of 7"};
        ds4_forward_result r[2];
        size_t bytes[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            ds4_train_options o = {.mtp_lambda = mode == 2 ? 0.3 : 0, .indexer_kl = mode == 3 ? 1.0 : 0,
                                   .head_chunk = mode == 3 ? 7 : 0, .recompute = bf16 ? 0 : k};
            CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
            m->tape_f32 = bf16 && !k;
            ds4_model_zero_grad(m);
            CHECK_OK(ds4_model_forward_train(m, &a, &r[k], &err), &err);
            bytes[k] = m->tape ? m->tape->bytes : 0;
            lp[k] = malloc((size_t)T * sizeof(float));
            CHECK_OK(ds4_model_logprobs(m, lp[k], NULL, &err), &err);
            if (mode == 1) {
                float *dlp = malloc((size_t)T * sizeof(float));
                for (int64_t t = 0; t < T; t++) dlp[t] = (float)(-1.0 / (double)(t + 1)); /* any weights */
                CHECK_OK(ds4_model_backward_logprobs(m, dlp, &err), &err);
                free(dlp);
            } else {
                CHECK_OK(ds4_model_backward(m, 1.0 / (double)r[k].loss_tokens, &err), &err);
            }
            g[k] = malloc((size_t)P * sizeof(float));
            memcpy(g[k], ds4_model_grads(m), (size_t)P * sizeof(float));
            /* the next forward plans the tape afresh: free it so that its size is this option's */
            ds4_tape_free(m, m->tape);
            m->tape = NULL;
        }
        CHECK(memcmp(&r[0].loss, &r[1].loss, sizeof r[0].loss) == 0, "%s %s: loss %.9g with %s, %.9g without", name,
              what[mode], r[1].loss, opt, r[0].loss);
        CHECK(memcmp(&r[0].indexer_loss, &r[1].indexer_loss, sizeof(double)) == 0 || (isnan(r[0].indexer_loss) &&
              isnan(r[1].indexer_loss)), "%s %s: indexer loss differs", name, what[mode]);
        CHECK(memcmp(lp[0], lp[1], (size_t)T * sizeof(float)) == 0, "%s %s: log-probabilities differ", name, what[mode]);
        int64_t diff = 0;
        for (int64_t i = 0; i < P; i++) diff += memcmp(&g[0][i], &g[1][i], sizeof(float)) != 0;
        CHECK(diff == 0, "%s %s: %lld of %lld gradient values differ with %s", name, what[mode], (long long)diff,
              (long long)P, opt);
        CHECK(bytes[1] < bytes[0], "%s %s: tape %zu bytes with %s, %zu without", name, what[mode], bytes[1], opt,
              bytes[0]);
        printf("  %-8s %-30s %s: same bits; tape %zu -> %zu bytes\n", name, what[mode], opt, bytes[0], bytes[1]);
        for (int k = 0; k < 2; k++) free(g[k]), free(lp[k]);
    }
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    CHECK_OK(ds4_engine_create(NULL, &eng, &err), &err);
    if (!eng) return ds4t_finish("test_backward");
    run(eng, fixtures, "tiny_a");
    run(eng, fixtures, "tiny_b");
    run(eng, fixtures, "tiny_hf");
    for (int bf16 = 0; bf16 < 2; bf16++) {
        same_bits(eng, fixtures, "tiny_a", bf16);
        same_bits(eng, fixtures, "tiny_b", bf16);
        same_bits(eng, fixtures, "tiny_hf", bf16);
    }
    ds4_engine_free(eng);
    return ds4t_finish("test_backward");
}
