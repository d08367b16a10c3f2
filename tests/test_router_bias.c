/* test_router_bias.c — the aux-loss-free balancing update, bias_e += γ·sign(mean load − load_e), applied after
 * each optimizer step when router_bias_gamma > 0 (DeepSeek-V3 technical report, arXiv 2412.19437,
 * section 2.1.2; docs/architecture.md, "MoE").
 *
 * Closed-form checks: each learned layer's counted loads sum to tokens × K (hash layers count nothing); after
 * one step every learned bias moved by exactly +γ, −γ or 0 according to its load against the mean, computed
 * here from the reported loads; the counters are reset; with γ = 0 no bias moves. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

static float *bias_of(ds4_model *m, const char *name) {
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *n;
        ds4_tensor v;
        ds4_model_tensor_at(m, i, &n, &v, NULL);
        if (!strcmp(n, name)) return v.data;
    }
    return NULL;
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_adamw *opt = NULL;
    ds4_forward_args a;
    CHECK_OK(ds4_engine_create(NULL, &eng, &err), &err);
    if (!eng || ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &a)) return ds4t_finish("test_router_bias");
    const ds4_config *c = ds4_model_config(m);
    const int64_t E = c->n_routed_experts, K = c->num_experts_per_tok, L = c->num_hidden_layers;
    const int64_t B = a.batch, S = a.seq;
    const double gamma = 0.0625; /* a power of two: bias + γ is exact, so the check below is exact */
    ds4_train_options o = {.router_bias_gamma = gamma};
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
    ds4_adamw_options ao = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .clip = 1.0};
    CHECK_OK(ds4_adamw_create(m, &ao, &opt, &err), &err);
    ds4_forward_result r;
    CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    const int64_t *loads = ds4_model_router_loads(m);
    CHECK(loads != NULL, "loads counted");
    int64_t *before_loads = calloc((size_t)((L + 1) * E), sizeof(int64_t));
    memcpy(before_loads, loads, (size_t)((L + 1) * E) * sizeof(int64_t));
    float before[16][64];
    for (int64_t l = 0; l < L; l++) {
        int64_t total = 0;
        for (int64_t e = 0; e < E; e++) total += before_loads[l * E + e];
        if (c->layer_is_hash[l]) CHECK(total == 0, "hash layer %lld counted %lld routings", (long long)l, (long long)total);
        else CHECK(total == B * S * K, "layer %lld: loads sum to %lld, want tokens x K = %lld", (long long)l,
                   (long long)total, (long long)(B * S * K));
        char name[64];
        snprintf(name, sizeof name, "layers.%lld.ffn.gate.bias", (long long)l);
        float *bias = bias_of(m, name);
        CHECK(c->layer_is_hash[l] ? bias == NULL : bias != NULL, "%s present iff learned", name);
        if (bias) memcpy(before[l], bias, (size_t)E * sizeof(float));
    }
    ds4_adamw_stats st;
    CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
    int moved = 0;
    for (int64_t l = 0; l < L; l++) {
        if (c->layer_is_hash[l]) continue;
        char name[64];
        snprintf(name, sizeof name, "layers.%lld.ffn.gate.bias", (long long)l);
        const float *bias = bias_of(m, name);
        int64_t total = 0;
        for (int64_t e = 0; e < E; e++) total += before_loads[l * E + e];
        const double mean = (double)total / (double)E;
        for (int64_t e = 0; e < E; e++) {
            const double ld = (double)before_loads[l * E + e];
            const float want = before[l][e] + (float)(gamma * (mean > ld ? 1 : (mean < ld ? -1 : 0)));
            CHECK(bias[e] == want, "%s[%lld]: %g, want %g (load %g, mean %g)", name, (long long)e, bias[e], want, ld,
                  mean);
            moved += bias[e] != before[l][e];
        }
    }
    CHECK(moved > 0, "some bias moved");
    loads = ds4_model_router_loads(m);
    int64_t left = 0;
    for (int64_t i = 0; i < (L + 1) * E; i++) left += loads[i];
    CHECK(left == 0, "counters reset after the update (%lld left)", (long long)left);
    /* γ = 0: the bias stays put */
    o.router_bias_gamma = 0;
    CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
    float keep[64];
    memcpy(keep, bias_of(m, "layers.2.ffn.gate.bias"), (size_t)E * sizeof(float));
    ds4_model_zero_grad(m);
    CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
    CHECK(memcmp(keep, bias_of(m, "layers.2.ffn.gate.bias"), (size_t)E * sizeof(float)) == 0, "gamma 0: bias unchanged");
    o.router_bias_gamma = -1;
    CHECK_STATUS(ds4_model_set_train_options(m, &o, &err), DS4_ERR_ARG, &err);
    free(before_loads);
    ds4_adamw_free(opt);
    ds4_st_close(io);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return ds4t_finish("test_router_bias");
}
