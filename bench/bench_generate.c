/* bench_generate.c — CPU generation throughput: prefill and decode tokens/s through ds4_generate.
 *
 *   build/bench_generate [--threads N] [--quick]
 *
 * The ~50M-parameter config of bench_forward.c (same JSON, duplicated so each benchmark stays one file), random
 * weights, random prompt ids. Cases (prompt length P, new tokens N):
 *   batch 1:  P = 512, N = 128
 *   batch 32: 32 prompts, P = 128 each, N = 64
 * (--quick: P and N / 4.) Sampling at temperature 1 with ignore_eos so every sequence runs to N. Prefill
 * tokens/s = prompt tokens / prefill time (including the first token's sampling); decode tokens/s = tokens fed
 * through decode steps / decode time (aggregate over the batch). One warm-up generation, then the median of 3.
 * Benchmarks measure and print; they never pass or fail. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

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

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int run_case(ds4_model *m, int64_t batch, int64_t P, int64_t N, int threads) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    int64_t *ids = malloc((size_t)(batch * P) * sizeof *ids), *lens = malloc((size_t)batch * sizeof *lens);
    const int64_t **prompts = malloc((size_t)batch * sizeof *prompts);
    if (!ids || !lens || !prompts) return 1;
    uint64_t r = 0x243f6a8885a308d3ull;
    for (int64_t i = 0; i < batch * P; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = 2 + (int64_t)((r >> 33) % (uint64_t)(V - 2));
    }
    for (int64_t b = 0; b < batch; b++) prompts[b] = ids + b * P, lens[b] = P;
    ds4_gen_args a = {.nprompts = batch, .prompts = prompts, .prompt_lens = lens, .n = 1, .max_new_tokens = N,
                      .sampling = {.temperature = 1.0}, .seed = 1, .ignore_eos = 1};
    double pre[3], dec[3];
    int rc = 0;
    for (int it = 0; it < 4 && rc == 0; it++) {
        ds4_gen_result *res = NULL;
        ds4_error err = {0};
        if (ds4_generate(m, &a, &res, &err) != DS4_OK) {
            fprintf(stderr, "bench_generate: %s\n", err.msg);
            rc = 1;
            break;
        }
        if (it > 0) {
            pre[it - 1] = (double)res->prefill_tokens / res->prefill_seconds;
            dec[it - 1] = (double)res->decode_tokens / res->decode_seconds;
        }
        ds4_gen_result_free(res);
    }
    if (rc == 0) {
        qsort(pre, 3, sizeof *pre, cmp_double);
        qsort(dec, 3, sizeof *dec, cmp_double);
        printf("batch %2lld  prompt %4lld  new %4lld   prefill %8.1f tokens/s (min %.1f, max %.1f)   decode %8.1f "
               "tokens/s (min %.1f, max %.1f, %.1f per sequence)   threads %d\n",
               (long long)batch, (long long)P, (long long)N, pre[1], pre[0], pre[2], dec[1], dec[0], dec[2],
               dec[1] / (double)batch, threads);
        fflush(stdout);
    }
    free(ids);
    free(lens);
    free(prompts);
    return rc;
}

int main(int argc, char **argv) {
    int threads = 0, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else {
            fprintf(stderr, "usage: bench_generate [--threads N] [--quick]\n");
            return 2;
        }
    }
    ds4_error err = {0};
    ds4_engine *e = NULL;
    ds4_engine_options o = {.n_threads = threads};
    ds4_config cfg;
    ds4_model *m = NULL;
    if (ds4_engine_create(&o, &e, &err) || ds4_config_parse(CONFIG_50M, strlen(CONFIG_50M), &cfg, &err) ||
        ds4_model_create_random(e, &cfg, 1, &m, &err)) {
        fprintf(stderr, "bench_generate: %s\n", err.msg);
        ds4_engine_free(e);
        return 1;
    }
    printf("50m config: %lld parameters, vocab %lld\n", (long long)ds4_model_param_count(m), (long long)cfg.vocab_size);
    const int q = quick ? 4 : 1;
    int rc = run_case(m, 1, 512 / q, 128 / q, ds4_engine_threads(e));
    if (rc == 0) rc = run_case(m, 32, 128 / q, 64 / q, ds4_engine_threads(e));
    ds4_model_free(m);
    ds4_engine_free(e);
    return rc;
}
