/* bench_fp4_experts.c — FP4-resident routed experts (docs/checkpoints.md, "FP4-resident experts"): resident expert
 * bytes, peak memory while loading, and the step-time overhead of decoding the packed experts inside the expert
 * GEMMs, against the same checkpoint loaded with its experts dequantised to fp32; on the CPU, or with --device on a
 * GPU (both ways moved there: "cuda" is bf16, "cuda fp32"; the weights' device bytes are printed too).
 *
 *   build/bench_fp4_experts [--threads N] [--runs N] [--seq S] [--dir DIR] [--device SPEC]
 *
 * The model: a config with many experts (defined below: 64 routed experts of width 128, top-4, hidden 512, 4 layers),
 * random weights (ds4_model_create_random) written as a checkpoint whose routed experts are FP4 (e2m1 + e8m0 per 32,
 * the official format: each block's scale is the smallest power of two >= amax / 6) and everything else F32, into
 * DIR (default: a temporary directory, removed at the end). Then:
 *   - peak memory of loading it, each way, in a fresh process (this program re-run with --load-rss: VmHWM and VmRSS
 *     after the load, from /proc/self/status; the checkpoint's mapped pages that the load touched count too);
 *   - ms per forward of 1 x S tokens and of 1 token (logits computed), and per LoRA training step (rank 8 on the attention, shared
 *     and routed experts: forward, backward, AdamW), best of --runs after one warm-up, the two ways alternating run
 *     by run; and whether the two ways' logits are the same bits (they must be: test_fp4_resident checks it).
 * Benchmarks measure and print; they never pass or fail. Results are collected in bench/RESULTS.md. */
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
#include "ds4_ckpt.h"
#include "ds4_train.h"
#include "quant.h"

static const char CONFIG[] =
    "{\n"
    "  \"model_type\": \"deepseek_v4\",\n"
    "  \"vocab_size\": 8000, \"hidden_size\": 512, \"num_hidden_layers\": 4,\n"
    "  \"num_attention_heads\": 8, \"num_key_value_heads\": 1, \"head_dim\": 64, \"qk_rope_head_dim\": 32,\n"
    "  \"partial_rotary_factor\": 0.5, \"q_lora_rank\": 128, \"o_groups\": 2, \"o_lora_rank\": 64,\n"
    "  \"sliding_window\": 64,\n"
    "  \"layer_types\": [\"sliding_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\",\n"
    "                  \"compressed_sparse_attention\"],\n"
    "  \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 32},\n"
    "  \"mlp_layer_types\": [\"hash_moe\", \"moe\", \"moe\", \"moe\"],\n"
    "  \"index_n_heads\": 4, \"index_head_dim\": 32, \"index_topk\": 32,\n"
    "  \"n_routed_experts\": 64, \"num_experts_per_tok\": 4, \"n_shared_experts\": 1, \"moe_intermediate_size\": 128,\n"
    "  \"scoring_func\": \"sqrtsoftplus\", \"norm_topk_prob\": true, \"routed_scaling_factor\": 1.5,\n"
    "  \"swiglu_limit\": 10.0, \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-06, \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0,\n"
    "  \"rope_parameters\": {\n"
    "    \"main\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.5},\n"
    "    \"compress\": {\"rope_type\": \"yarn\", \"rope_theta\": 160000.0, \"partial_rotary_factor\": 0.5,\n"
    "                 \"factor\": 16, \"original_max_position_embeddings\": 65536, \"beta_fast\": 32,\n"
    "                 \"beta_slow\": 1, \"attention_factor\": 1.0}\n"
    "  },\n"
    "  \"max_position_embeddings\": 1048576, \"num_nextn_predict_layers\": 0, \"tie_word_embeddings\": false,\n"
    "  \"bos_token_id\": 0, \"eos_token_id\": 1, \"initializer_range\": 0.02\n"
    "}\n";

static int fail(const char *what, const ds4_error *err) {
    fprintf(stderr, "bench_fp4_experts: %s: %s\n", what, err->msg);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ checkpoint */

static int is_expert(const char *name) { return strstr(name, ".ffn.experts.") != NULL; }

/* W [rows, cols] as FP4: scales[r][b] = the e8m0 byte of the smallest power of two >= amax(block) / 6, codes the
 * nearest e2m1 values (ds4_quant_encode). */
static int quantise(const float *w, int64_t rows, int64_t cols, uint8_t *codes, uint8_t *scales, ds4_error *err) {
    const int64_t nb = cols / DS4_FP4_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0;
            for (int64_t k = 0; k < DS4_FP4_BLOCK; k++) amax = fmaxf(amax, fabsf(w[r * cols + b * DS4_FP4_BLOCK + k]));
            int e = amax > 0 ? (int)ceil(log2((double)amax / 6.0)) : -127;
            e = e < -127 ? -127 : e > 127 ? 127 : e;
            scales[r * nb + b] = (uint8_t)(e + 127);
        }
    const ds4_st_entry se = {.name = "scale", .dtype = DS4_F8_E8M0, .ndim = 2, .shape = {rows, nb}, .data = scales,
                             .nbytes = (size_t)(rows * nb)};
    const ds4_quant_format qf = {{128, 128}};
    return ds4_quant_encode(codes, w, &se, rows, cols, DS4_Q_FP4, &qf, err) != DS4_OK;
}

/* DIR/config.json and DIR/model.safetensors: the model's tensors, its routed experts FP4. */
static int write_checkpoint(ds4_model *m, const char *dir) {
    ds4_error err = {0};
    const ds4_save_options so = {.overwrite = 1};
    if (ds4_model_save_opts(m, dir, &so, &err)) return fail("save", &err);
    const size_t n = ds4_model_tensor_count(m);
    const char **names = calloc(2 * n, sizeof *names);
    char **own = calloc(3 * n, sizeof *own); /* codes and scales at [k], [k + 1]; scale names at [k + 1 + n] */
    ds4_tensor *t = calloc(2 * n, sizeof *t);
    const ds4_tensor **tp = calloc(2 * n, sizeof *tp);
    size_t k = 0;
    int rc = !names || !own || !t || !tp;
    for (size_t i = 0; !rc && i < n; i++) {
        const char *name;
        ds4_tensor v;
        if (ds4_model_tensor_at(m, i, &name, &v, &err)) {
            rc = fail("tensor", &err);
            break;
        }
        if (!is_expert(name) || v.dtype != DS4_F32) {
            t[k] = v;
            names[k++] = name;
            continue;
        }
        const int64_t rows = v.shape[0], cols = v.shape[1];
        uint8_t *codes = malloc((size_t)(rows * cols / 2)), *scales = malloc((size_t)(rows * cols / DS4_FP4_BLOCK));
        char *sname = malloc(strlen(name) + 8);
        own[k] = (char *)codes, own[k + 1] = (char *)scales;
        if (!codes || !scales || !sname || quantise(v.data, rows, cols, codes, scales, &err)) {
            free(sname);
            rc = fail("quantise", &err);
            break;
        }
        snprintf(sname, strlen(name) + 8, "%.*s.scale", (int)(strlen(name) - 7), name);
        t[k] = (ds4_tensor){.dtype = DS4_U8, .ndim = 2, .shape = {rows, cols / 2}, .data = codes,
                            .nbytes = (size_t)(rows * cols / 2)};
        names[k++] = name;
        t[k] = (ds4_tensor){.dtype = DS4_F8_E8M0, .ndim = 2, .shape = {rows, cols / DS4_FP4_BLOCK}, .data = scales,
                            .nbytes = (size_t)(rows * cols / DS4_FP4_BLOCK)};
        names[k] = sname;
        own[k + n] = sname; /* k already advanced past the codes */
        k++;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    for (size_t i = 0; i < k; i++) tp[i] = &t[i];
    if (!rc && ds4_st_write(path, k, names, tp, &err)) rc = fail("write", &err);
    for (size_t i = 0; own && i < 3 * n; i++) free(own[i]);
    free(names), free(own), free(t), free(tp);
    return rc;
}

/* ------------------------------------------------------------------------------------------------ memory */

static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, strlen(key))) v = atol(line + strlen(key) + 1);
    if (f) fclose(f);
    return v;
}

/* --load-rss DIR fp4|fp32: load, print "expert_bytes hwm_kb rss_kb" */
static int load_rss(const char *dir, int fp4) {
    ds4_engine *e = NULL;
    ds4_error err = {0};
    const ds4_engine_options eo = {.n_threads = 1};
    if (ds4_engine_create(&eo, &e, &err)) return fail("engine", &err);
    ds4_model *m = NULL;
    const ds4_load_options lo = {.fp4_experts = fp4};
    const long before = status_kb("VmRSS");
    if (ds4_model_load_opts(e, dir, &lo, &m, &err)) return fail("load", &err);
    int64_t experts = ds4_model_fp4_bytes(m);
    if (!fp4)
        for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
            const char *name;
            ds4_tensor v;
            if (!ds4_model_tensor_at(m, i, &name, &v, &err) && is_expert(name)) experts += (int64_t)v.nbytes;
        }
    printf("%lld %ld %ld %ld\n", (long long)experts, status_kb("VmHWM"), status_kb("VmRSS"), before);
    ds4_model_free(m);
    ds4_engine_free(e);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ time */

typedef struct {
    double fwd, fwd1, step;
    float *logits;
    ds4_adamw *opt;
} timing;

/* a forward of S tokens, then one of a single token (the shape of a decoding step: one row per expert product) */
static int forward_once(ds4_model *m, const int64_t *ids, int64_t S, timing *t, int timed) {
    ds4_error err = {0};
    ds4_forward_args a = {.ids = ids, .batch = 1, .seq = S, .logits = t->logits};
    ds4_forward_result r;
    double t0 = now_s();
    if (ds4_model_forward(m, &a, &r, &err)) return fail("forward", &err);
    if (timed) t->fwd = fmin(t->fwd, now_s() - t0);
    a.seq = 1;
    t0 = now_s();
    if (ds4_model_forward(m, &a, &r, &err)) return fail("forward", &err);
    if (timed) t->fwd1 = fmin(t->fwd1, now_s() - t0);
    return 0;
}

static int lora_setup(ds4_model *m, timing *t) {
    ds4_error err = {0};
    const ds4_lora_options lo = {.rank = 8, .alpha = 16,
                                 .targets = DS4_LORA_WQ_A | DS4_LORA_WQ_B | DS4_LORA_WKV | DS4_LORA_WO_A | DS4_LORA_WO_B |
                                            DS4_LORA_SHARED | DS4_LORA_EXPERTS};
    const ds4_adamw_options oo = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    if (ds4_model_lora(m, &lo, &err) || ds4_model_enable_grad(m, &err) || ds4_adamw_create(m, &oo, &t->opt, &err))
        return fail("lora", &err);
    return 0;
}

static int step_once(ds4_model *m, const int64_t *ids, int64_t S, timing *t, int timed) {
    ds4_error err = {0};
    ds4_forward_args a = {.ids = ids, .batch = 1, .seq = S, .labels = ids};
    ds4_forward_result r;
    float *g;
    int64_t ng;
    const double t0 = now_s();
    ds4_model_zero_grad(m);
    /* the gradient buffer's call returns once the device has done what was enqueued (nothing to wait for on a CPU) */
    if (ds4_model_forward_train(m, &a, &r, &err) || ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err) ||
        ds4_adamw_step(t->opt, NULL, &err) || ds4_model_grad_buffer(m, &g, &ng, &err))
        return fail("training step", &err);
    if (timed) t->step = fmin(t->step, now_s() - t0);
    return 0;
}

/* The two ways alternate run by run, so that a change in the shared machine's load hits both alike; each keeps its
 * best time (after one warm-up). */
static int run_ways(ds4_model *const way[2], const int64_t *ids, int64_t S, int runs, timing t[2]) {
    const int64_t V = ds4_model_config(way[0])->vocab_size;
    int rc = 0;
    for (int w = 0; w < 2; w++) {
        t[w].fwd = t[w].fwd1 = t[w].step = INFINITY;
        if (!(t[w].logits = malloc((size_t)(S * V) * sizeof(float)))) return 1;
    }
    for (int i = 0; !rc && i <= runs; i++)
        for (int w = 0; !rc && w < 2; w++) rc = forward_once(way[w], ids, S, &t[w], i > 0);
    for (int w = 0; !rc && w < 2; w++) rc = lora_setup(way[w], &t[w]);
    for (int i = 0; !rc && i <= runs; i++)
        for (int w = 0; !rc && w < 2; w++) rc = step_once(way[w], ids, S, &t[w], i > 0);
    return rc;
}

static int measure_rss(const char *self, const char *dir, int fp4, long long *bytes, long *hwm, long *rss, long *base) {
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "'%s' --load-rss '%s' %s", self, dir, fp4 ? "fp4" : "fp32");
    FILE *p = popen(cmd, "r");
    int ok = p && fscanf(p, "%lld %ld %ld %ld", bytes, hwm, rss, base) == 4;
    if (p) pclose(p);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    int threads = 0, runs = 5;
    int64_t S = 256;
    const char *dir = NULL, *device = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--load-rss") && i + 2 < argc) return load_rss(argv[i + 1], !strcmp(argv[i + 2], "fp4"));
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seq") && i + 1 < argc) S = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
        else {
            fprintf(stderr, "usage: bench_fp4_experts [--threads N] [--runs N] [--seq S] [--dir DIR] [--device SPEC]\n");
            return 2;
        }
    }
    char tmp[64] = "/tmp/ds4_fp4_bench_XXXXXX";
    if (!dir && !(dir = mkdtemp(tmp))) return perror("mkdtemp"), 1;
    char ckpt[4096];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    ds4_error err = {0};
    ds4_config cfg;
    ds4_engine *e = NULL;
    const ds4_engine_options eo = {.n_threads = threads};
    if (ds4_config_parse(CONFIG, sizeof CONFIG - 1, &cfg, &err)) return fail("config", &err);
    if (ds4_engine_create(&eo, &e, &err)) return fail("engine", &err);
    ds4_model *m = NULL;
    if (ds4_model_create_random(e, &cfg, 1, &m, &err)) return fail("random model", &err);
    const long long params = (long long)ds4_model_param_count(m);
    int rc = write_checkpoint(m, ckpt);
    ds4_model_free(m);
    long long bytes[2] = {0};
    long hwm[2] = {0}, rss[2] = {0}, base[2] = {0};
    for (int w = 0; !rc && w < 2; w++) rc = measure_rss(argv[0], ckpt, w, &bytes[w], &hwm[w], &rss[w], &base[w]);
    ds4_model *way[2] = {NULL, NULL};
    timing t[2] = {{0}};
    ds4_device_options dev = {0};
    if (!rc && device && ds4_device_parse(device, NULL, &dev, &err)) rc = fail("--device", &err);
    int64_t dev_bytes[2] = {0}, dev_fp4[2] = {0};
    for (int w = 0; !rc && w < 2; w++) {
        const ds4_load_options lo = {.fp4_experts = w};
        if (ds4_model_load_opts(e, ckpt, &lo, &way[w], &err)) rc = fail("load", &err);
        else if (device && ds4_model_to(way[w], &dev, &err)) rc = fail("to device", &err);
        else dev_bytes[w] = ds4_model_device_bytes(way[w], &dev_fp4[w]);
    }
    int64_t *ids = malloc((size_t)S * sizeof *ids);
    for (int64_t i = 0; i < S; i++) ids[i] = 2 + (i * 7919) % (cfg.vocab_size - 2);
    if (!rc) rc = run_ways(way, ids, S, runs, t);
    if (!rc) {
        const long long E = cfg.n_routed_experts, I = cfg.moe_intermediate_size, D = cfg.hidden_size;
        const long long ne = cfg.num_hidden_layers * 3 * E * I * D;
        printf("config: %lld layers, %lld routed experts (top %lld) of width %lld, hidden %lld; %lld fp32 parameters, "
               "%lld of them routed-expert values\n", (long long)cfg.num_hidden_layers, E,
               (long long)cfg.num_experts_per_tok, I, D, params, ne);
        printf("threads %d, best of %d runs, 1 x %lld tokens, on %s\n", (int)ds4_engine_threads(e), runs, (long long)S,
               ds4_model_device_name(way[0]));
        if (device)
            printf("weights on the device: dequantised %lld bytes, FP4-resident %lld bytes (%lld of them the packed "
                   "experts)\n", (long long)dev_bytes[0], (long long)dev_bytes[1], (long long)dev_fp4[1]);
        printf("resident expert bytes: fp32 %lld, bf16 %lld, FP4 %lld (%.2f bits per value)\n", bytes[0], ne * 2,
               bytes[1], 8.0 * (double)bytes[1] / (double)ne);
        printf("load, fresh process: VmRSS before %.1f MiB; peak (VmHWM) / after (VmRSS): dequantised %.1f / %.1f "
               "MiB, FP4-resident %.1f / %.1f MiB\n", base[0] / 1024.0, hwm[0] / 1024.0, rss[0] / 1024.0, hwm[1] / 1024.0,
               rss[1] / 1024.0);
        printf("forward: dequantised %.1f ms, FP4-resident %.1f ms (x%.3f)\n", 1e3 * t[0].fwd, 1e3 * t[1].fwd,
               t[1].fwd / t[0].fwd);
        printf("forward of 1 token: dequantised %.2f ms, FP4-resident %.2f ms (x%.3f)\n", 1e3 * t[0].fwd1,
               1e3 * t[1].fwd1, t[1].fwd1 / t[0].fwd1);
        printf("LoRA training step: dequantised %.1f ms, FP4-resident %.1f ms (x%.3f)\n", 1e3 * t[0].step,
               1e3 * t[1].step, t[1].step / t[0].step);
        printf("logits of the two ways: %s\n", memcmp(t[0].logits, t[1].logits, (size_t)(S * cfg.vocab_size) * 4)
                                                   ? "DIFFER"
                                                   : "the same bits");
    }
    for (int w = 0; w < 2; w++) {
        free(t[w].logits);
        ds4_adamw_free(t[w].opt);
        ds4_model_free(way[w]);
    }
    free(ids);
    ds4_engine_free(e);
    if (dir == tmp) {
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
        if (system(cmd) != 0) fprintf(stderr, "bench_fp4_experts: could not remove %s\n", tmp);
    }
    return rc;
}
