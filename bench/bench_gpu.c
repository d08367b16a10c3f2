/* bench_gpu.c — ds4 on a CUDA GPU, the bench config (bench/config_599m.json, ~599M parameters, random
 * weights, bf16): for each batch size, greedy generation of 64 new tokens after a 128-token prompt (what
 * transformers' generate is timed doing in bench/hf_generate.py), with its decode rate (tokens/s of the decode
 * steps alone) and its end-to-end rate (new tokens over the whole call, prefill included); prefill throughput of
 * 512-token prompts; and at batch 1 the fraction of the memory-bandwidth roofline: the bytes one decode step must
 * read (every weight a token passes through, once, and its cache) over the device's measured copy bandwidth.
 *
 *   build/bench_gpu [--config bench/config_599m.json] [--batches 1,8,64,256] [--new 64] [--prompt 128]
 *                   [--dtype bf16|fp32] [--profile FILE]
 * Lines "ds4 KEY VALUE" are for bench/gpu_bench.sh; the rest is for people. It measures, never passes or fails. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ds4.h"
#ifdef DS4_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer. */
static double copy_bandwidth(void) {
#ifdef DS4_HAVE_CUDA
    const size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 0;
    cudaMemset(a, 1, n);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    const double t0 = now_s();
    for (int i = 0; i < 10; i++) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    const double t = now_s() - t0;
    cudaFree(a);
    cudaFree(b);
    return 10.0 * 2.0 * (double)n / t;
#else
    return 0;
#endif
}

/* Bytes one decode step of one sequence reads at position pos: the weights every token passes through (the embedding
 * row, not the table; K of E routed experts; not the MTP block), and the cache: window ring, compressed entries and
 * indexer keys. */
static double decode_bytes(ds4_model *m, int64_t pos, int bf16) {
    const ds4_config *c = ds4_model_config(m);
    double w = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *name;
        ds4_tensor v;
        ds4_model_tensor_at(m, i, &name, &v, NULL);
        if (strncmp(name, "mtp.", 4) == 0) continue;
        double el = (double)ds4_tensor_numel(&v);
        /* the matrices of bf16 mode (core/model.c, ds4_param_lowp: 2-D, not the mHC mixers, router or biases) */
        const size_t L = strlen(name);
        const int lowp = v.ndim == 2 && !(L > 3 && !strcmp(name + L - 3, "_fn")) && !strstr(name, ".ape") &&
                         !strstr(name, "ffn.gate.weight") && !strstr(name, "tid2eid");
        const double es = v.dtype == DS4_I32 ? 4 : (bf16 && lowp ? 2 : 4);
        if (!strcmp(name, "embed.weight") && !c->tie_word_embeddings) el = (double)c->hidden_size;
        if (strstr(name, ".ffn.experts.")) el *= (double)c->num_experts_per_tok / (double)c->n_routed_experts;
        if (strstr(name, "tid2eid")) el = (double)c->num_experts_per_tok;
        w += el * es;
    }
    double cache = 0;
    const int64_t d = c->head_dim;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        cache += (double)(pos + 1 < c->sliding_window ? pos + 1 : c->sliding_window) * d * 4;
        if (c->layer_types[l] == DS4_ATTN_HCA) cache += (double)((pos + 1) / c->compress_rate_hca) * d * 4;
        if (c->layer_types[l] == DS4_ATTN_CSA) {
            const int64_t ent = (pos + 1) / c->compress_rate_csa;
            cache += (double)ent * c->index_head_dim * 4 + (double)(ent < c->index_topk ? ent : c->index_topk) * d * 4;
        }
    }
    return w + cache;
}

static uint64_t rs = 88172645463325252ull;
static int64_t rnd(int64_t n) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (int64_t)(rs % (uint64_t)n);
}

int main(int argc, char **argv) {
    const char *cfg_path = "bench/config_599m.json", *prof_path = NULL;
    char batches_s[128] = "1,8,64,256";
    int64_t new_tokens = 64, plen = 128;
    int bf16 = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc) snprintf(batches_s, sizeof batches_s, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--new") && i + 1 < argc) new_tokens = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) plen = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) bf16 = strcmp(argv[++i], "fp32") != 0;
        else if (!strcmp(argv[i], "--profile") && i + 1 < argc) prof_path = argv[++i];
        else DIE("usage: %s [--config F] [--batches 1,8,64] [--new N] [--prompt N] [--dtype bf16|fp32] [--profile F]", argv[0]);
    }
    ds4_error err = {0};
    ds4_config cfg;
    if (ds4_config_load(cfg_path, &cfg, &err)) DIE("bench_gpu: %s", err.msg);
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {.n_threads = 0};
    if (ds4_engine_create(&eo, &eng, &err)) DIE("bench_gpu: %s", err.msg);
    double t0 = now_s();
    ds4_model *m = NULL;
    if (ds4_model_create_random(eng, &cfg, 1, &m, &err)) DIE("bench_gpu: %s", err.msg);
    const double t_init = now_s() - t0;
    const ds4_device_options dev = {DS4_DEVICE_CUDA, 0, bf16 ? DS4_BF16 : DS4_F32};
    t0 = now_s();
    if (ds4_model_to(m, &dev, &err)) DIE("bench_gpu: %s", err.msg);
    printf("ds4 params %lld\n", (long long)ds4_model_param_count(m));
    printf("# model: %s, %.1fM parameters, random init %.1f s, to %s %.1f s\n", cfg_path,
           ds4_model_param_count(m) / 1e6, t_init, ds4_model_device_name(m), now_s() - t0);
    const double bw = copy_bandwidth();
    printf("ds4 copy_GBps %.1f\n", bw / 1e9);
    const int64_t V = cfg.vocab_size;
    int64_t batches[16], nb = 0;
    for (char *p = strtok(batches_s, ","); p && nb < 16; p = strtok(NULL, ",")) batches[nb++] = atoll(p);
    const int64_t maxb = 256;
    int64_t *prompt_mem = malloc((size_t)(maxb * plen) * sizeof(int64_t));
    const int64_t **prompts = malloc((size_t)maxb * sizeof *prompts), *lens = malloc((size_t)maxb * sizeof *lens);
    for (int64_t i = 0; i < maxb * plen; i++) prompt_mem[i] = rnd(V);
    for (int64_t b = 0; b < maxb; b++) prompts[b] = prompt_mem + b * plen, ((int64_t *)lens)[b] = plen;
    /* warm-up: kernels loaded, workspaces grown */
    ds4_gen_args warm = {.nprompts = 1, .prompts = prompts, .prompt_lens = lens, .n = 1, .max_new_tokens = 4, .ignore_eos = 1};
    ds4_gen_result *r = NULL;
    if (ds4_generate(m, &warm, &r, &err)) DIE("bench_gpu: warm-up: %s", err.msg);
    ds4_gen_result_free(r);
    printf("%-7s %14s %14s %16s\n", "batch", "decode tok/s", "prefill tok/s", "generate tok/s");
    for (int64_t k = 0; k < nb; k++) {
        const int64_t B = batches[k] < maxb ? batches[k] : maxb;
        ds4_gen_args ga = {.nprompts = B, .prompts = prompts, .prompt_lens = lens, .n = 1,
                           .max_new_tokens = new_tokens, .ignore_eos = 1};
        if (ds4_generate(m, &ga, &r, &err)) DIE("bench_gpu: batch %lld: %s", (long long)B, err.msg); /* warm */
        ds4_gen_result_free(r);
        t0 = now_s();
        if (ds4_generate(m, &ga, &r, &err)) DIE("bench_gpu: batch %lld: %s", (long long)B, err.msg);
        const double total = now_s() - t0;
        const double dec = (double)r->decode_tokens / r->decode_seconds;
        const double pre = (double)r->prefill_tokens / r->prefill_seconds;
        const double gen = (double)(B * new_tokens) / total;
        printf("%-7lld %14.1f %14.1f %16.1f\n", (long long)B, dec, pre, gen);
        printf("ds4 decode_b%lld %.1f\nds4 prefill_b%lld %.1f\nds4 generate_b%lld %.1f\n", (long long)B, dec,
               (long long)B, pre, (long long)B, gen);
        if (B == 1) {
            /* the roofline of one decode step at the middle position of the decode */
            const double bytes = decode_bytes(m, plen + new_tokens / 2, bf16);
            const double step_s = r->decode_seconds / (double)r->decode_tokens;
            printf("ds4 roofline_b1 %.3f\n", bw > 0 ? bytes / bw / step_s : 0);
            printf("# batch 1: %.1f MB per decode step, %.3f ms per step, %.0f GB/s of %.0f GB/s measured copy "
                   "bandwidth = %.1f%% of the roofline\n", bytes / 1e6, 1e3 * step_s, bytes / step_s / 1e9, bw / 1e9,
                   bw > 0 ? 100.0 * bytes / bw / step_s : 0);
        }
        ds4_gen_result_free(r);
    }
    /* prefill of 512-token prompts, 8 at a time, through the step API (what generation's prefill runs) */
    {
        enum { PB = 8, PS = 512 };
        ds4_cache *cs[PB];
        int64_t counts[PB], *ids = malloc((size_t)(PB * PS) * sizeof(int64_t));
        for (int64_t i = 0; i < PB * PS; i++) ids[i] = rnd(V);
        for (int b = 0; b < PB; b++) {
            if (ds4_cache_create(m, PS, &cs[b], &err)) DIE("bench_gpu: %s", err.msg);
            counts[b] = PS;
        }
        float *last = malloc((size_t)(PB * V) * sizeof(float));
        ds4_step_args sa = {.nseq = PB, .caches = cs, .counts = counts, .ids = ids, .last_logits = last};
        double best = 1e30;
        for (int rep = 0; rep < 4; rep++) {
            for (int b = 0; b < PB; b++) ds4_cache_reset(cs[b]);
            t0 = now_s();
            if (ds4_model_step(m, &sa, &err)) DIE("bench_gpu: prefill: %s", err.msg);
            const double t = now_s() - t0;
            best = t < best ? t : best;
        }
        printf("ds4 prefill_8x512 %.1f\n# prefill 8 x 512 tokens: %.1f ms, %.0f tokens/s\n", PB * PS / best,
               1e3 * best, PB * PS / best);
        for (int b = 0; b < PB; b++) ds4_cache_free(cs[b]);
        free(ids);
        free(last);
    }
    if (prof_path) { /* the per-op profiles of one generation at batch 1 and at batch 64 (n samples of a prompt) */
        FILE *f = fopen(prof_path, "w");
        if (!f) DIE("bench_gpu: cannot write %s", prof_path);
        ds4_engine_set_profile(eng, 1);
        static const int32_t pbatch[2] = {1, 64};
        for (int k = 0; k < 2; k++) {
            ds4_gen_args ga = {.nprompts = 1, .prompts = prompts, .prompt_lens = lens, .n = pbatch[k],
                               .max_new_tokens = new_tokens, .ignore_eos = 1};
            if (ds4_generate(m, &ga, &r, &err)) DIE("bench_gpu: %s", err.msg);
            ds4_gen_result_free(r);
            ds4_model_profile_reset(m);
            if (ds4_generate(m, &ga, &r, &err)) DIE("bench_gpu: %s", err.msg);
            ds4_gen_result_free(r);
            char buf[16384];
            ds4_model_profile_report(m, buf, sizeof buf);
            fprintf(f, "%sper-op profile: one generation, %d sample%s of one prompt, %lld + %lld tokens, %s "
                    "(profiled: no CUDA graphs, an event pair per op)\n%s", k ? "\n" : "", (int)pbatch[k],
                    pbatch[k] == 1 ? "" : "s", (long long)plen, (long long)new_tokens, ds4_model_device_name(m), buf);
        }
        fclose(f);
        ds4_engine_set_profile(eng, 0);
    }
    free(prompt_mem);
    free(prompts);
    free((void *)lens);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return 0;
}
