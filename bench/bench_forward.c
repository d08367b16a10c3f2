/* bench_forward.c — CPU forward throughput (tokens/s) of the fp32 reference forward pass.
 *
 *   build/bench_forward [--threads N] [--config PATH] [--runs N] [--quick] [--only fixture|50m]
 *   build/bench_forward --print-config 50m     (the 50m config.json, for bench/cpu_vs_torch.sh)
 *
 * Two models, both with random weights (ds4_model_create_random):
 *   fixture  the tiny_a test fixture's config (tests/fixtures/tiny_a/config.json, or --config PATH: a
 *            config.json or a checkpoint directory holding one)
 *   50m      a ~50M-parameter DeepSeek-V4-architecture config defined below, every feature on (sliding, CSA
 *            and HCA layers with the compressor and the lightning indexer, hash-routed and learned MoE, mHC
 *            with 4 streams, an MTP block)
 * For each model and each batch x sequence shape (1x512, 4x128, 8x64; --quick: 1x128, 4x32) it runs warm-up
 * forwards, then --runs timed forwards (default 5, at least 5), and prints the median, min and max time per
 * forward, tokens/s at the median, the thread count and the machine. Each forward computes the logits
 * [B, S, V] (what rollout scoring needs); MTP is not run. Benchmarks measure and print; they never pass or
 * fail (the exit status is non-zero only when the model cannot be built or a forward returns an error).
 * Results are collected in bench/RESULTS.md.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "ds4.h"

/* ~50M parameters, all V4 features on. Parameter count from the shapes (docs/architecture.md, "Checkpoint names";
 * D=512, H=8, d=128, q_lora 256, 4 output groups x o_lora 128, n=4 streams, E=16 routed + 1 shared expert of
 * width I=96, indexer 8 x 64):
 *   embed + head          2 x 16000 x 512                            = 16,384,000
 *   attention, sliding    wq_a, wq_b, wkv, wo_a, wo_b, q/kv norms, sink =    852,360 per layer (x2)
 *              CSA        + compressor 263,296 + indexer 266,816       =  1,382,472 per layer (x3)
 *              HCA        + compressor 135,296                         =    987,656 per layer (x3)
 *   MoE                   17 x 3 x 96 x 512 + gate 16 x 512            =  2,514,944 per layer (x8)
 *                         (+ a 16-entry router bias on the 5 learned-routing layers)
 *   mHC + block norms     2 x (24 + 24 x 2048 + 3) + 2 x 512           =     99,382 per layer (x8)
 *   final norm + hc_head  512 + 4 + 4 x 2048 + 1                       =      8,709
 *   main model                                                         = 46,122,501
 *   MTP block (sliding attention, learned MoE, e/h_proj, norms, hc_head) =  4,000,723
 *   total                                                              = 50,123,224
 * Layer schedule follows V4-Flash in miniature: 2 sliding layers, then CSA/HCA alternating; the first 3
 * layers hash-routed. HCA rate 32 so HCA entries exist from S = 32; index_topk 64 < S/4 at S = 512, so the
 * indexer's top-k selection is exercised. */
static const char CONFIG_50M[] =
    "{\n"
    "  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n"
    "  \"model_type\": \"deepseek_v4\",\n"
    "  \"vocab_size\": 16000,\n"
    "  \"hidden_size\": 512,\n"
    "  \"num_hidden_layers\": 8,\n"
    "  \"num_attention_heads\": 8,\n"
    "  \"num_key_value_heads\": 1,\n"
    "  \"head_dim\": 128,\n"
    "  \"qk_rope_head_dim\": 64,\n"
    "  \"partial_rotary_factor\": 0.5,\n"
    "  \"q_lora_rank\": 256,\n"
    "  \"o_groups\": 4,\n"
    "  \"o_lora_rank\": 128,\n"
    "  \"sliding_window\": 128,\n"
    "  \"layer_types\": [\"sliding_attention\", \"sliding_attention\",\n"
    "                  \"compressed_sparse_attention\", \"heavily_compressed_attention\",\n"
    "                  \"compressed_sparse_attention\", \"heavily_compressed_attention\",\n"
    "                  \"compressed_sparse_attention\", \"heavily_compressed_attention\"],\n"
    "  \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 32},\n"
    "  \"mlp_layer_types\": [\"hash_moe\", \"hash_moe\", \"hash_moe\", \"moe\", \"moe\", \"moe\", \"moe\", \"moe\"],\n"
    "  \"index_n_heads\": 8,\n"
    "  \"index_head_dim\": 64,\n"
    "  \"index_topk\": 64,\n"
    "  \"n_routed_experts\": 16,\n"
    "  \"num_experts_per_tok\": 2,\n"
    "  \"n_shared_experts\": 1,\n"
    "  \"moe_intermediate_size\": 96,\n"
    "  \"scoring_func\": \"sqrtsoftplus\",\n"
    "  \"norm_topk_prob\": true,\n"
    "  \"routed_scaling_factor\": 1.5,\n"
    "  \"swiglu_limit\": 10.0,\n"
    "  \"hc_mult\": 4,\n"
    "  \"hc_sinkhorn_iters\": 20,\n"
    "  \"hc_eps\": 1e-06,\n"
    "  \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_theta\": 10000.0,\n"
    "  \"compress_rope_theta\": 160000.0,\n"
    "  \"rope_parameters\": {\n"
    "    \"main\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.5},\n"
    "    \"compress\": {\"rope_type\": \"yarn\", \"rope_theta\": 160000.0, \"partial_rotary_factor\": 0.5,\n"
    "                 \"factor\": 16, \"original_max_position_embeddings\": 65536, \"beta_fast\": 32,\n"
    "                 \"beta_slow\": 1, \"attention_factor\": 1.0}\n"
    "  },\n"
    "  \"max_position_embeddings\": 1048576,\n"
    "  \"num_nextn_predict_layers\": 1,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"bos_token_id\": 0,\n"
    "  \"eos_token_id\": 1,\n"
    "  \"initializer_range\": 0.02\n"
    "}\n";
#define EXPECTED_50M_PARAMS 50123224LL

typedef struct {
    int64_t batch, seq;
} shape;

static const shape FULL_SHAPES[] = {{1, 512}, {4, 128}, {8, 64}};
static const shape QUICK_SHAPES[] = {{1, 128}, {4, 32}};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void cpu_model(char *out, size_t len) {
    snprintf(out, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                p++;
                while (*p == ' ' || *p == '\t') p++;
                p[strcspn(p, "\n")] = 0;
                snprintf(out, len, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t next_u64(void) {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545f4914f6cdd1dull;
}

/* Time `runs` forwards of shape sh (after `warmup` untimed ones). Returns 0 on success. */
static int bench_shape(ds4_engine *e, ds4_model *m, const char *label, shape sh, int warmup, int runs) {
    const ds4_config *cfg = ds4_model_config(m);
    const int64_t ntok = sh.batch * sh.seq, V = cfg->vocab_size;
    int64_t *ids = malloc((size_t)ntok * sizeof *ids);
    float *logits = malloc((size_t)ntok * (size_t)V * sizeof *logits);
    double *t = malloc((size_t)runs * sizeof *t);
    if (!ids || !logits || !t) {
        fprintf(stderr, "bench_forward: %s %lldx%lld: out of memory\n", label, (long long)sh.batch, (long long)sh.seq);
        free(ids), free(logits), free(t);
        return 1;
    }
    /* Random ids, avoiding bos/eos so nothing special-cases them. */
    for (int64_t i = 0; i < ntok; i++) ids[i] = 2 + (int64_t)(next_u64() % (uint64_t)(V > 2 ? V - 2 : 1));
    ds4_forward_args a;
    memset(&a, 0, sizeof a);
    a.ids = ids;
    a.batch = sh.batch;
    a.seq = sh.seq;
    a.logits = logits;
    ds4_forward_result r;
    ds4_error err;
    memset(&err, 0, sizeof err);
    int rc = 0;
    for (int i = 0; i < warmup + runs; i++) {
        double t0 = now_s();
        ds4_status s = ds4_model_forward(m, &a, &r, &err);
        double dt = now_s() - t0;
        if (s != DS4_OK) {
            fprintf(stderr, "bench_forward: %s %lldx%lld: forward failed: %s: %s\n", label, (long long)sh.batch,
                    (long long)sh.seq, ds4_status_name(s), err.msg);
            rc = 1;
            break;
        }
        if (i >= warmup) t[i - warmup] = dt;
    }
    if (rc == 0) {
        double lsum = 0; /* touch the output so the work cannot be skipped, and catch NaN */
        for (int64_t i = 0; i < ntok * V; i += 97) lsum += logits[i];
        qsort(t, (size_t)runs, sizeof *t, cmp_double);
        double med = runs % 2 ? t[runs / 2] : 0.5 * (t[runs / 2 - 1] + t[runs / 2]);
        printf("%-8s B x S = %2lld x %-4lld  %10.1f tokens/s  %9.2f ms/forward (min %.2f, max %.2f, %d runs)  "
               "threads %d%s\n",
               label, (long long)sh.batch, (long long)sh.seq, (double)ntok / med, 1e3 * med, 1e3 * t[0],
               1e3 * t[runs - 1], runs, (int)ds4_engine_threads(e), isfinite(lsum) ? "" : "  [non-finite logits!]");
        fflush(stdout);
    }
    free(ids);
    free(logits);
    free(t);
    return rc;
}

static int bench_model(ds4_engine *e, const char *label, const ds4_config *cfg, const shape *shapes, size_t nshapes,
                       int warmup, int runs, long long expected_params) {
    ds4_model *m = NULL;
    ds4_error err;
    memset(&err, 0, sizeof err);
    double t0 = now_s();
    ds4_status s = ds4_model_create_random(e, cfg, 1234, &m, &err);
    if (s != DS4_OK) {
        fprintf(stderr, "bench_forward: %s: model create failed: %s: %s\n", label, ds4_status_name(s), err.msg);
        return 1;
    }
    long long np = (long long)ds4_model_param_count(m);
    printf("\n%s: %lld parameters (%.2f M)%s, hidden %lld, %lld layers, vocab %lld, %lld experts top-%lld, "
           "hc_mult %lld; created in %.2f s\n",
           label, np, np / 1e6, ds4_model_has_mtp(m) ? " incl. MTP" : "", (long long)cfg->hidden_size,
           (long long)cfg->num_hidden_layers, (long long)cfg->vocab_size, (long long)cfg->n_routed_experts,
           (long long)cfg->num_experts_per_tok, (long long)cfg->hc_mult, now_s() - t0);
    if (expected_params > 0 && np != expected_params)
        printf("note: %s parameter count %lld differs from the count computed from the shapes (%lld)\n", label, np,
               expected_params);
    int rc = 0;
    for (size_t i = 0; i < nshapes && rc == 0; i++) rc = bench_shape(e, m, label, shapes[i], warmup, runs);
    ds4_model_free(m);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_forward [--threads N] [--config PATH] [--runs N] [--quick] [--only fixture|50m]\n"
            "  --threads N    engine threads (default 0: one per physical core, at most 16)\n"
            "  --config PATH  config.json (or checkpoint dir) for the fixture-sized model\n"
            "                 (default tests/fixtures/tiny_a/config.json, looked up from . and ..)\n"
            "  --runs N       timed forwards per shape, at least 5 (default 5)\n"
            "  --quick        smaller shapes (1x128, 4x32), one warm-up\n"
            "  --only NAME    run only the fixture or the 50m model\n"
            "  --print-config 50m  print the 50m model's config.json and exit\n");
}

int main(int argc, char **argv) {
    int threads = 0, runs = 5, quick = 0;
    const char *config_path = NULL, *only = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--config") && i + 1 < argc) config_path = argv[++i];
        else if (!strcmp(a, "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(a, "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(a, "--quick")) quick = 1;
        else if (!strcmp(a, "--print-config") && i + 1 < argc && !strcmp(argv[i + 1], "50m")) {
            fputs(CONFIG_50M, stdout); /* the same model for another engine (bench/cpu_vs_torch.sh) */
            return 0;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (a[0] != '-' && !config_path) config_path = a;
        else {
            usage(stderr);
            return 2;
        }
    }
    if (runs < 5) runs = 5;
    if (threads < 0) threads = 0;
    if (only && strcmp(only, "fixture") && strcmp(only, "50m")) {
        usage(stderr);
        return 2;
    }
    const shape *shapes = quick ? QUICK_SHAPES : FULL_SHAPES;
    size_t nshapes = quick ? sizeof QUICK_SHAPES / sizeof *QUICK_SHAPES : sizeof FULL_SHAPES / sizeof *FULL_SHAPES;
    int warmup = quick ? 1 : 2;

    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);

    ds4_engine_options opt;
    memset(&opt, 0, sizeof opt);
    opt.n_threads = threads;
    ds4_engine *e = NULL;
    ds4_error err;
    memset(&err, 0, sizeof err);
    if (ds4_engine_create(&opt, &e, &err) != DS4_OK) {
        fprintf(stderr, "bench_forward: engine: %s\n", err.msg);
        return 1;
    }
    printf("bench_forward: ds4 %s (%s), machine: %s, %ld online cores, engine threads %d\n", DS4_VERSION_STRING,
           ds4_build_info(), cpu, cores, (int)ds4_engine_threads(e));
    printf("fp32 CPU forward with logits [B, S, V]; median of %d timed runs after %d warm-up%s\n", runs, warmup,
           warmup == 1 ? "" : "s");

    int rc = 0;
    if (!only || !strcmp(only, "fixture")) {
        static const char *const defaults[] = {"tests/fixtures/tiny_a/config.json",
                                               "../tests/fixtures/tiny_a/config.json"};
        ds4_config cfg;
        ds4_status s = DS4_ERR_NOT_FOUND;
        const char *used = config_path;
        if (config_path) {
            s = ds4_config_load(config_path, &cfg, &err);
        } else {
            for (size_t i = 0; i < 2 && s != DS4_OK; i++) {
                if (access(defaults[i], R_OK) != 0) continue;
                used = defaults[i];
                s = ds4_config_load(used, &cfg, &err);
            }
            if (!used) snprintf(err.msg, sizeof err.msg, "tests/fixtures/tiny_a/config.json not found from . or ..");
        }
        if (s != DS4_OK) {
            fprintf(stderr, "bench_forward: fixture config: %s (use --config PATH)\n", err.msg);
            rc = 1;
        } else {
            printf("\nfixture config: %s\n", used);
            rc |= bench_model(e, "fixture", &cfg, shapes, nshapes, warmup, runs, 0);
        }
    }
    if (!only || !strcmp(only, "50m")) {
        ds4_config cfg;
        if (ds4_config_parse(CONFIG_50M, sizeof CONFIG_50M - 1, &cfg, &err) != DS4_OK) {
            fprintf(stderr, "bench_forward: 50m config: %s\n", err.msg);
            rc = 1;
        } else {
            rc |= bench_model(e, "50m", &cfg, shapes, nshapes, warmup, runs, EXPECTED_50M_PARAMS);
        }
    }
    ds4_engine_free(e);
    return rc;
}
