/* bench_train.c — CPU training throughput: tokens/s of one full step (training forward, backward, AdamW).
 *
 *   build/bench_train [--threads N] [--runs N] [--quick] [--exact-check]
 *
 * The ~50M-parameter config of bench_forward.c (same JSON, duplicated here so each benchmark stays one
 * self-contained file), random weights, random token ids, labels = ids (every position scored), shapes
 * 1×512, 4×128, 8×64. Median of --runs timed steps (default 5) after one warm-up step, and the median of the
 * optimizer step's own time within them. MTP loss off. --exact-check: every AdamW step runs its exact finiteness
 * pass over p, g, m, v (ds4_adamw_set_exact_check), as before the bounds that usually prove it; the same bits.
 * Benchmarks measure and print; they never pass or fail. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ds4.h"
#include "optim.h"

static const char CONFIG_50M[] =
    "{\"model_type\": \"deepseek_v4\", \"vocab_size\": 16000, \"hidden_size\": 512, \"num_hidden_layers\": 8,"
    " \"num_attention_heads\": 8, \"num_key_value_heads\": 1, \"head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"partial_rotary_factor\": 0.5, \"q_lora_rank\": 256, \"o_groups\": 4, \"o_lora_rank\": 128,"
    " \"sliding_window\": 128, \"layer_types\": [\"sliding_attention\", \"sliding_attention\","
    " \"compressed_sparse_attention\", \"heavily_compressed_attention\", \"compressed_sparse_attention\","
    " \"heavily_compressed_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\"],"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 32},"
    " \"mlp_layer_types\": [\"hash_moe\", \"hash_moe\", \"hash_moe\", \"moe\", \"moe\", \"moe\", \"moe\", \"moe\"],"
    " \"index_n_heads\": 8, \"index_head_dim\": 64, \"index_topk\": 64, \"n_routed_experts\": 16,"
    " \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, \"moe_intermediate_size\": 96,"
    " \"scoring_func\": \"sqrtsoftplus\", \"routed_scaling_factor\": 1.5, \"swiglu_limit\": 10.0, \"hc_mult\": 4,"
    " \"hc_sinkhorn_iters\": 20, \"rms_norm_eps\": 1e-06, \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0,"
    " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536,"
    " \"beta_fast\": 32, \"beta_slow\": 1}, \"max_position_embeddings\": 1048576, \"num_nextn_predict_layers\": 1,"
    " \"initializer_range\": 0.02}";

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void cpu_name(char *buf, size_t len) {
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *p = strchr(line, ':');
            if (p) {
                p += 2;
                p[strcspn(p, "\n")] = 0;
                snprintf(buf, len, "%s", p);
            }
            break;
        }
    fclose(f);
}

int main(int argc, char **argv) {
    int threads = 0, runs = 5, quick = 0, exact = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--exact-check")) exact = 1;
        else {
            fprintf(stderr, "usage: bench_train [--threads N] [--runs N] [--quick] [--exact-check]\n");
            return 2;
        }
    }
    if (runs < 3) runs = 3;
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {threads};
    ds4_config cfg;
    ds4_model *m = NULL;
    ds4_adamw *opt = NULL;
    if (ds4_engine_create(&eo, &eng, &err) || ds4_config_parse(CONFIG_50M, strlen(CONFIG_50M), &cfg, &err) ||
        ds4_model_create_random(eng, &cfg, 1, &m, &err) || ds4_model_enable_grad(m, &err)) {
        fprintf(stderr, "bench_train: %s\n", err.msg);
        return 1;
    }
    ds4_adamw_options ao = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0,
                            .schedule = DS4_LR_CONSTANT, .total_steps = 1000};
    if (ds4_adamw_create(m, &ao, &opt, &err)) {
        fprintf(stderr, "bench_train: %s\n", err.msg);
        return 1;
    }
    ds4_adamw_set_exact_check(opt, exact);
    char cpu[256];
    cpu_name(cpu, sizeof cpu);
    printf("bench_train: ds4 %s (%s), machine: %s, engine threads %d\n", DS4_VERSION_STRING, ds4_build_info(), cpu,
           (int)ds4_engine_threads(eng));
    printf("50m: %lld parameters (MTP block present, its loss off); one step = training forward + backward + AdamW "
           "(finiteness check: %s)\n",
           (long long)ds4_model_param_count(m), exact ? "exact pass every step" : "bounds, exact pass when they fail");
    const int64_t shapes[3][2] = {{1, 512}, {4, 128}, {8, 64}}, qshapes[2][2] = {{1, 128}, {4, 32}};
    const int nshape = quick ? 2 : 3;
    uint64_t rng = 7;
    for (int si = 0; si < nshape; si++) {
        const int64_t B = quick ? qshapes[si][0] : shapes[si][0], S = quick ? qshapes[si][1] : shapes[si][1];
        int64_t *ids = malloc((size_t)(B * S) * sizeof(int64_t));
        for (int64_t i = 0; i < B * S; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            ids[i] = (int64_t)((rng >> 33) % (uint64_t)cfg.vocab_size);
        }
        ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .labels = ids};
        double *t = malloc(2 * (size_t)runs * sizeof(double)), *to = t + runs, loss = 0;
        for (int r = -1; r < runs; r++) {
            const double t0 = now_s();
            ds4_forward_result res;
            ds4_adamw_stats st;
            ds4_model_zero_grad(m);
            if (ds4_model_forward_train(m, &a, &res, &err) || ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err)) {
                fprintf(stderr, "bench_train: %s\n", err.msg);
                return 1;
            }
            const double t1 = now_s();
            if (ds4_adamw_step(opt, &st, &err)) {
                fprintf(stderr, "bench_train: %s\n", err.msg);
                return 1;
            }
            if (r >= 0) t[r] = now_s() - t0, to[r] = now_s() - t1;
            loss = res.loss;
        }
        qsort(t, (size_t)runs, sizeof(double), cmp_d);
        qsort(to, (size_t)runs, sizeof(double), cmp_d);
        const double med = t[runs / 2];
        printf("50m      B x S = %2lld x %-4lld  %9.1f tokens/s  %9.1f ms/step (min %.1f, max %.1f, %d runs)  AdamW %.1f ms "
               "(min %.1f)  loss %.4f\n",
               (long long)B, (long long)S, (double)(B * S) / med, 1e3 * med, 1e3 * t[0], 1e3 * t[runs - 1], runs,
               1e3 * to[runs / 2], 1e3 * to[0], loss);
        free(t);
        free(ids);
    }
    ds4_adamw_free(opt);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return 0;
}
