/* test_threads.c — results do not depend on the engine's thread count: a forward's logits, a training step (loss,
 * every gradient, the parameters after AdamW with clipping) and step-API decoding in chunks of 5, 1 and 17 tokens
 * are bit-identical on 1, 2, 3, 7 and 16 threads, for a random model a few times the fixture's width (so that its row
 * operations split into several tasks at the pool's least work per task, and its matrix products into many). The
 * reference is the 1-thread engine, which runs every task on the calling thread in order: no fork, no join. Thread
 * counts above this machine's cores are fine (the pool sleeps rather than polls there); 16 threads on a 2-core CI
 * machine is the case of a many-core default on a small job. */
#include <stdlib.h>
#include <string.h>

#include "testlib.h" /* ds4.h first: ds4_train.h builds on it */
#include "ds4_train.h"

enum { B = 2, S = 72, DEC = 40 };

typedef struct {
    float *logits, *dec, *grads, *params;
    double loss, norm;
    int64_t params_n;
} outputs;

static void run(const ds4_config *cfg, int32_t threads, outputs *o) {
    ds4_error err = {0};
    ds4_engine *e = NULL;
    ds4_model *m = NULL;
    ds4_adamw *opt = NULL;
    const ds4_engine_options eo = {.n_threads = threads};
    const ds4_adamw_options ao = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                                  .clip = 0.5, .schedule = DS4_LR_CONSTANT, .total_steps = 10};
    CHECK_OK(ds4_engine_create(&eo, &e, &err), &err);
    if (e) CHECK_OK(ds4_model_create_random(e, cfg, 3, &m, &err), &err);
    if (!m) goto out;
    const int64_t V = cfg->vocab_size, P = ds4_model_param_count(m);
    o->params_n = P;
    int64_t ids[B * S];
    uint64_t r = 11;
    for (int64_t i = 0; i < B * S; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int64_t)((r >> 33) % (uint64_t)V);
    }
    o->logits = malloc((size_t)(B * S * V) * sizeof(float));
    o->dec = malloc((size_t)(DEC * V) * sizeof(float));
    o->grads = malloc((size_t)P * sizeof(float));
    o->params = malloc((size_t)P * sizeof(float));
    if (!o->logits || !o->dec || !o->grads || !o->params) goto out;
    ds4_forward_args fa = {.ids = ids, .batch = B, .seq = S, .logits = o->logits};
    CHECK_OK(ds4_model_forward(m, &fa, NULL, &err), &err);
    const int64_t chunks[] = {5, 1, 17};
    ds4t_step_logits(m, ids, DEC, chunks, 3, o->dec);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    CHECK_OK(ds4_adamw_create(m, &ao, &opt, &err), &err);
    if (!opt) goto out;
    ds4_forward_args ta = {.ids = ids, .batch = B, .seq = S, .labels = ids};
    ds4_forward_result res = {0};
    ds4_adamw_stats st = {0};
    ds4_model_zero_grad(m);
    CHECK_OK(ds4_model_forward_train(m, &ta, &res, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)(res.loss_tokens > 0 ? res.loss_tokens : 1), &err), &err);
    memcpy(o->grads, ds4_model_grads(m), (size_t)P * sizeof(float));
    CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
    memcpy(o->params, ds4_model_params(m), (size_t)P * sizeof(float));
    o->loss = res.loss, o->norm = st.grad_norm;
out:
    ds4_adamw_free(opt);
    ds4_model_free(m);
    ds4_engine_free(e);
}

static int same(const float *a, const float *b, int64_t n) { return a && b && memcmp(a, b, (size_t)n * 4) == 0; }

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_config cfg;
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny_a/config.json", fixtures);
    CHECK_OK(ds4_config_load(path, &cfg, &err), &err);
    if (err.code) return ds4t_finish("test_threads");
    cfg.hidden_size = 192;          /* row operations of 192-wide rows over B·S = 144 tokens */
    cfg.moe_intermediate_size = 96;
    cfg.vocab_size = 512;
    const int32_t counts[] = {1, 2, 3, 7, 16};
    outputs ref = {0};
    run(&cfg, 1, &ref);
    for (size_t k = 1; k < sizeof counts / sizeof *counts; k++) {
        outputs o = {0};
        run(&cfg, counts[k], &o);
        const int64_t P = ref.params_n, V = cfg.vocab_size;
        const int32_t t = counts[k];
        CHECK(o.params_n == P, "%d threads: %lld parameters, 1 thread %lld", t, (long long)o.params_n, (long long)P);
        CHECK(same(o.logits, ref.logits, B * S * V), "%d threads: forward logits differ from 1 thread", t);
        CHECK(same(o.dec, ref.dec, DEC * V), "%d threads: decoded logits differ from 1 thread", t);
        CHECK(o.loss == ref.loss, "%d threads: loss %.17g, 1 thread %.17g", t, o.loss, ref.loss);
        CHECK(o.norm == ref.norm, "%d threads: gradient norm %.17g, 1 thread %.17g", t, o.norm, ref.norm);
        CHECK(same(o.grads, ref.grads, P), "%d threads: gradients differ from 1 thread", t);
        CHECK(same(o.params, ref.params, P), "%d threads: parameters after AdamW differ from 1 thread", t);
        printf("  %2d threads: logits, decoding, loss %.6f, gradients (norm %.6f) and parameters as on 1 thread\n", t,
               o.loss, o.norm);
        free(o.logits), free(o.dec), free(o.grads), free(o.params);
    }
    free(ref.logits), free(ref.dec), free(ref.grads), free(ref.params);
    return ds4t_finish("test_threads");
}
