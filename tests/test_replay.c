/* test_replay.c — routing replay in the forward (ds4_forward_args.replay_experts / replay_index).
 *
 * Independent reference: the model's own forward before its selection-only parameters change. The learned
 * routers' selection bias (ffn.gate.bias) and the lightning indexer (attn.indexer.*) influence only WHICH experts
 * and entries are used, never the values computed from them. So: record the routing of model M (through
 * ds4_model_step's records), perturb those selection parameters until the plain forward's logits move, and
 * replay the recorded routing: the logits must be M's original ones, bit for bit (same kernels, same selection).
 * Rows marked -1 must route normally, and invalid replays must be refused. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

enum { B = 2, S = 37 };

static float *tensor(ds4_model *m, const char *name, int64_t *n) {
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *nm;
        ds4_tensor v;
        ds4_error err = {0};
        if (ds4_model_tensor_at(m, i, &nm, &v, &err) == DS4_OK && strcmp(nm, name) == 0) {
            *n = ds4_tensor_numel(&v);
            return v.data;
        }
    }
    return NULL;
}

static void run(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_error err = {0};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    const int64_t V = c->vocab_size, L = c->num_hidden_layers, K = c->num_experts_per_tok, T = B * S;
    const int64_t nc = ds4_model_csa_layers(m), topk = c->index_topk;
    int64_t ids[B * S];
    uint64_t r = 12345;
    for (int64_t i = 0; i < T; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int64_t)((r >> 33) % (uint64_t)V);
    }
    float *l0 = malloc((size_t)(T * V) * sizeof(float)), *l1 = malloc((size_t)(T * V) * sizeof(float));
    int32_t *ex = malloc((size_t)(T * L * K) * sizeof(int32_t));
    int32_t *ix = malloc((size_t)(T * (nc ? nc : 1) * topk) * sizeof(int32_t));
    ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .logits = l0};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    /* the routing the model chose, as a rollout records it: both rows in one step, rows sequence after sequence,
     * which is the [B, S, ...] layout */
    ds4_cache *cs[B] = {0};
    for (int b = 0; b < B; b++) CHECK_OK(ds4_cache_create(m, S, &cs[b], &err), &err);
    int64_t counts[B] = {S, S};
    ds4_step_args st = {.nseq = B, .caches = cs, .counts = counts, .ids = ids, .experts = ex, .index_picks = nc ? ix : NULL};
    CHECK_OK(ds4_model_step(m, &st, &err), &err);
    for (int b = 0; b < B; b++) ds4_cache_free(cs[b]);

    a.logits = l1;
    a.replay_experts = ex;
    a.replay_index = nc ? ix : NULL;
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    CHECK(ds4t_max_abs_diff(l1, l0, T * V) == 0, "%s: replaying the model's own routing changed the logits", name);

    /* perturb every selection-only parameter */
    int64_t changed = 0;
    for (int64_t li = 0; li < L; li++) {
        char nm[128];
        int64_t n = 0;
        snprintf(nm, sizeof nm, "layers.%lld.ffn.gate.bias", (long long)li);
        float *bias = tensor(m, nm, &n);
        for (int64_t e = 0; bias && e < n; e++) bias[e] += (float)((e * 7 + li * 3) % 5) * 0.7f;
        changed += bias != NULL;
        snprintf(nm, sizeof nm, "layers.%lld.attn.indexer.weights_proj.weight", (long long)li);
        float *w = tensor(m, nm, &n);
        for (int64_t e = 0; w && e < n; e++) w[e] = -w[e] * 3.0f + 0.01f * (float)(e % 13);
        changed += w != NULL;
    }
    CHECK(changed > 0, "%s: no selection parameter found", name);
    a.replay_experts = NULL;
    a.replay_index = NULL;
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    const double moved = ds4t_max_abs_diff(l1, l0, T * V);
    CHECK(moved > 1e-3, "%s: perturbing the selection moved the logits only by %g", name, moved);
    a.replay_experts = ex;
    a.replay_index = nc ? ix : NULL;
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    const double back = ds4t_max_abs_diff(l1, l0, T * V);
    printf("  %-8s perturbed selection moves logits by %.3g; replayed routing: max|d| %.3g\n", name, moved, back);
    CHECK(back == 0, "%s: the replayed routing does not reproduce the recorded logits (max |d| %g)", name, back);

    /* -1 rows route normally: an all -1 replay is the plain (perturbed) forward */
    float *l2 = malloc((size_t)(T * V) * sizeof(float));
    int32_t *none = malloc((size_t)(T * L * K) * sizeof(int32_t));
    for (int64_t i = 0; i < T * L * K; i++) none[i] = -1;
    ds4_forward_args p = {.ids = ids, .batch = B, .seq = S, .logits = l2};
    CHECK_OK(ds4_model_forward(m, &p, NULL, &err), &err);
    p.logits = l1;
    p.replay_experts = none;
    CHECK_OK(ds4_model_forward(m, &p, NULL, &err), &err);
    CHECK(ds4t_max_abs_diff(l1, l2, T * V) == 0, "%s: rows marked -1 must route normally", name);

    /* invalid replays are refused */
    for (int64_t li = 0; li < L; li++)
        if (!c->layer_is_hash[li] && K >= 2) {
            int32_t *bad = malloc((size_t)(T * L * K) * sizeof(int32_t));
            memcpy(bad, ex, (size_t)(T * L * K) * sizeof(int32_t));
            bad[(5 * L + li) * K + 1] = bad[(5 * L + li) * K]; /* a duplicate expert */
            p.replay_experts = bad;
            CHECK_STATUS(ds4_model_forward(m, &p, NULL, &err), DS4_ERR_ARG, &err);
            CHECK(strstr(err.msg, "replay_experts") != NULL, "message: %s", err.msg);
            bad[(5 * L + li) * K + 1] = (int32_t)c->n_routed_experts; /* out of range */
            CHECK_STATUS(ds4_model_forward(m, &p, NULL, &err), DS4_ERR_ARG, &err);
            free(bad);
            break;
        }
    if (nc) {
        int32_t *bad = malloc((size_t)(T * nc * topk) * sizeof(int32_t));
        memcpy(bad, ix, (size_t)(T * nc * topk) * sizeof(int32_t));
        bad[(4 * nc) * topk] = 5; /* position 4 has (4+1)/4 = 1 causal entry: entry 5 is in the future */
        p.replay_experts = NULL;
        p.replay_index = bad;
        CHECK_STATUS(ds4_model_forward(m, &p, NULL, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, "replay_index") != NULL, "message: %s", err.msg);
        free(bad);
    }
    free(l0), free(l1), free(l2), free(ex), free(ix), free(none);
    ds4_model_free(m);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_replay", run); }
