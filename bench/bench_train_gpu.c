/* bench_train_gpu.c — one training step of ds4 on a CUDA GPU (training forward, backward, AdamW with global-norm
 * clipping, bf16 working weights, fp32 master weights, gradients and moments), on a V4 config with random weights and
 * random tokens, what bench/hf_train.py times transformers doing. Batch invariance and determinism are always on.
 *
 *   build/bench_train_gpu [--config bench/config_599m.json] [--batch 8] [--seq 1024] [--steps 5] [--dtype bf16|fp32]
 *                         [--peak-tflops 989] [--profile FILE] [--recompute] [--keep-grads]
 *
 * --recompute: per-block activation recomputation (ds4_train_options.recompute): the tape holds one block's
 * activations, a step runs about one more forward; the same losses.
 * The optimizer is told zero_grad (its update pass leaves the gradients zero, as torch's zero_grad(set_to_none=True),
 * which bench/hf_train.py calls, leaves them costing no pass); --keep-grads: not, so each step's zero_grad fills the
 * buffer (the same losses either way).
 * Prints tokens/s, ms per step, device memory after the steps (the workspace and tape are planned and kept, so this is
 * the step's peak; cudaMemGetInfo: everything this process holds on the device) and per token, and the model FLOPs
 * utilisation with the FLOP count stated: 6 × active parameters per token (every matrix a token passes through:
 * attention, compressors, indexer, shared expert, top-k of the routed experts, the LM head; not the embedding lookup)
 * plus attention: 12 × heads × head_dim × keys per query averaged over the sequence (QKᵀ and PV, forward and
 * backward) with keys = the window, the compressed entries and the indexer's picks a query sees. The MTP block is not
 * built (transformers builds none). Lines "ds4 KEY VALUE" are for scripts; it measures, never passes or fails. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ds4.h"
#ifdef DS4_HAVE_CUDA
#include <cuda_runtime.h>
#endif

static uint64_t rs = 88172645463325252ull;
static int64_t rnd(int64_t n) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (int64_t)(rs % (uint64_t)n);
}

/* Parameters a token's forward multiplies with: every 2-D matrix except the embedding table, routed experts counted
 * K of E. */
static double active_params(ds4_model *m) {
    const ds4_config *c = ds4_model_config(m);
    double n = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *name;
        ds4_tensor v;
        if (ds4_model_tensor_at(m, i, &name, &v, NULL) || v.ndim != 2 || v.dtype != DS4_F32) continue;
        if (!strcmp(name, "embed.weight") && !c->tie_word_embeddings) continue;
        double el = (double)ds4_tensor_numel(&v);
        if (strstr(name, ".ffn.experts.")) el *= (double)c->num_experts_per_tok / (double)c->n_routed_experts;
        n += el;
    }
    return n;
}

/* Keys a query at position p attends over, averaged over p < S, summed over layers. */
static double keys_per_query(const ds4_config *c, int64_t S) {
    double k = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; l++)
        for (int64_t p = 0; p < S; p++) {
            k += (double)(p + 1 < c->sliding_window ? p + 1 : c->sliding_window);
            if (c->layer_types[l] == DS4_ATTN_HCA) k += (double)((p + 1) / c->compress_rate_hca);
            if (c->layer_types[l] == DS4_ATTN_CSA) {
                const int64_t e = (p + 1) / c->compress_rate_csa;
                k += (double)(e < c->index_topk ? e : c->index_topk);
            }
        }
    return k / (double)S;
}

/* One optimizer step on the batch; returns its loss. */
static double train_step(ds4_model *m, ds4_adamw *opt, const ds4_forward_args *a, int64_t k) {
    ds4_error err = {0};
    ds4_forward_result r;
    ds4_model_zero_grad(m);
    if (ds4_model_forward_train(m, a, &r, &err)) DIE("bench_train_gpu: step %lld: %s", (long long)k, err.msg);
    if (ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err))
        DIE("bench_train_gpu: step %lld: %s", (long long)k, err.msg);
    if (ds4_adamw_step(opt, NULL, &err)) DIE("bench_train_gpu: step %lld: %s", (long long)k, err.msg);
    return r.loss;
}

int main(int argc, char **argv) {
    const char *cfg_path = "bench/config_599m.json";
    int64_t B = 8, S = 1024, steps = 5;
    int bf16 = 1;
    double peak_tflops = 989.0; /* H100 SXM dense bf16 tensor-core peak (NVIDIA's data sheet) */
    const char *prof_path = NULL;
    int recompute = 0, keep_grads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--seq") && i + 1 < argc) S = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) bf16 = strcmp(argv[++i], "fp32") != 0;
        else if (!strcmp(argv[i], "--peak-tflops") && i + 1 < argc) peak_tflops = atof(argv[++i]);
        else if (!strcmp(argv[i], "--profile") && i + 1 < argc) prof_path = argv[++i];
        else if (!strcmp(argv[i], "--recompute")) recompute = 1;
        else if (!strcmp(argv[i], "--keep-grads")) keep_grads = 1;
        else DIE("usage: %s [--config F] [--batch B] [--seq S] [--steps N] [--dtype bf16|fp32] [--peak-tflops X] "
                 "[--profile FILE] [--recompute] [--keep-grads]", argv[0]);
    }
    if (B < 1 || S < 2 || steps < 1) DIE("bench_train_gpu: batch >= 1, seq >= 2, steps >= 1");
    ds4_error err = {0};
    ds4_config cfg;
    if (ds4_config_load(cfg_path, &cfg, &err)) DIE("bench_train_gpu: %s", err.msg);
    cfg.num_nextn_predict_layers = 0;
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {.n_threads = 0};
    if (ds4_engine_create(&eo, &eng, &err)) DIE("bench_train_gpu: %s", err.msg);
    double t0 = now_s();
    ds4_model *m = NULL;
    if (ds4_model_create_random(eng, &cfg, 1, &m, &err)) DIE("bench_train_gpu: %s", err.msg);
    const double t_init = now_s() - t0;
    size_t free0 = 0, total = 0;
#ifdef DS4_HAVE_CUDA
    cudaMemGetInfo(&free0, &total);
#endif
    const ds4_device_options dev = {DS4_DEVICE_CUDA, 0, bf16 ? DS4_BF16 : DS4_F32};
    if (ds4_model_to(m, &dev, &err)) DIE("bench_train_gpu: %s", err.msg);
    if (ds4_model_enable_grad(m, &err)) DIE("bench_train_gpu: %s", err.msg);
    const ds4_train_options to = {.recompute = recompute};
    if (ds4_model_set_train_options(m, &to, &err)) DIE("bench_train_gpu: %s", err.msg);
    const double P = (double)ds4_model_param_count(m), A = active_params(m);
    printf("ds4 params %.0f\nds4 active_params %.0f\n", P, A);
    printf("# model: %s, %.1fM parameters (%.1fM active per token), random init %.1f s, %s, batch %lld x %lld\n",
           cfg_path, P / 1e6, A / 1e6, t_init, ds4_model_device_name(m), (long long)B, (long long)S);
    ds4_adamw_options o = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0,
                           .zero_grad = !keep_grads};
    ds4_adamw *opt = NULL;
    if (ds4_adamw_create(m, &o, &opt, &err)) DIE("bench_train_gpu: %s", err.msg);
    int64_t *ids = malloc((size_t)(B * S) * sizeof *ids);
    for (int64_t i = 0; i < B * S; i++) ids[i] = rnd(cfg.vocab_size);
    ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .labels = ids};
    double best = 1e30, loss = NAN;
    printf("# losses (all digits: two builds whose kernels give the same bits print the same line):");
    for (int64_t k = 0; k < steps + 2; k++) { /* two warm-up steps: kernels loaded, workspace and tape planned */
        const double ts = now_s();
        loss = train_step(m, opt, &a, k);
        const double t = now_s() - ts; /* the step ends by reading the per-piece counts back: it has finished */
        if (k >= 2 && t < best) best = t;
        printf(" %.9g", loss);
    }
    printf("\n");
    size_t free1 = 0;
#ifdef DS4_HAVE_CUDA
    cudaMemGetInfo(&free1, &total);
#endif
    const double used = (double)free0 - (double)free1, tok = (double)(B * S);
    const double kq = keys_per_query(&cfg, S);
    const double flops_tok = 6.0 * A + 12.0 * (double)cfg.num_attention_heads * (double)cfg.head_dim * kq;
    const double tps = tok / best, mfu = flops_tok * tps / (peak_tflops * 1e12);
    printf("ds4 train_tokens_per_s %.1f\nds4 train_ms_per_step %.2f\nds4 train_peak_gib %.2f\nds4 train_mfu %.4f\n",
           tps, 1e3 * best, used / 1073741824.0, mfu);
    printf("# best of %lld steps: %.1f ms per step, %.0f tokens/s, loss %.4f; device memory held %.2f GiB (%.1f KiB "
           "per token of the batch, weights and optimizer state included)\n",
           (long long)steps, 1e3 * best, tps, loss, used / 1073741824.0, used / tok / 1024.0);
    {
        int64_t tg = 0, tm = 0, tv = 0, tape = 0, ws = 0, bws = 0;
        const int64_t wb = ds4_model_device_bytes(m, NULL);
        ds4_model_train_device_bytes(m, &tg, &tm, &tv);
        ds4_model_pass_bytes(m, &tape, &ws, &bws);
        const double G = 1073741824.0;
        printf("# of which (GiB): working weights %.2f, gradients %.2f, fp32 master %.2f, moments %.2f, tape %.2f, "
               "forward workspace %.2f, backward workspace %.2f; the rest (%.2f): the backend's own scratch (operand "
               "copies, cuBLAS), its loaded kernels and small buffers\n", wb / G, tg / G, tm / G, tv / G, tape / G, ws / G, bws / G,
               (used - (double)(wb + tg + tm + tv + tape + ws + bws)) / G);
    }
    printf("# FLOPs per token %.3g = 6 x %.1fM active parameters + attention 12 x %lld heads x %lld x %.1f keys per "
           "query (summed over layers); MFU %.1f%% of %.0f TFLOP/s\n",
           flops_tok, A / 1e6, (long long)cfg.num_attention_heads, (long long)cfg.head_dim, kq, 100 * mfu,
           peak_tflops);
    if (prof_path) { /* the per-op table of one more step, after the timed ones (an event pair per op slows it) */
        FILE *f = fopen(prof_path, "w");
        if (!f) DIE("bench_train_gpu: cannot write %s", prof_path);
        ds4_engine_set_profile(eng, 1);
        ds4_model_profile_reset(m);
        train_step(m, opt, &a, steps + 2);
        static char buf[32768];
        ds4_model_profile_report(m, buf, sizeof buf);
        fprintf(f, "per-op profile: one training step (forward, backward, AdamW), batch %lld x %lld, %s, %s\n%s",
                (long long)B, (long long)S, bf16 ? "bf16" : "fp32", ds4_model_device_name(m), buf);
        fclose(f);
        ds4_engine_set_profile(eng, 0);
    }
    ds4_adamw_free(opt);
    free(ids);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return 0;
}
