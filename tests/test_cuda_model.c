/* test_cuda_model.c — the whole model on the CUDA backend against independent references.
 *
 * Exit 77 (skipped) without a CUDA build or without a GPU (every CI machine); scripts/gpu.sh runs it on one.
 *
 *  1. The committed fixtures (transformers' DeepseekV4ForCausalLM in fp32, tests/gen_fixtures.py) through CUDA:
 *     fp32 logits within the CPU test's bound (max |Δ| <= 1e-4·max(1, max|ref|), loss 1e-5 relative): the CUDA
 *     kernels are fp32 with their own summation orders, so they sit ~1e-6 from the reference like the CPU.
 *     bf16 (bf16 weight matrices and matmul inputs, fp32 accumulation, everything else fp32) is judged against
 *     what bf16 does to the model itself, measured here: e_w = the relative Frobenius distance from transformers of
 *     the CPU reference run with its weight matrices rounded to bf16 (0.5% to 4% on these tiny random models, whose
 *     small logits make them sensitive). bf16 mode rounds the matmul inputs too, an error of the same size and
 *     kind, so its logits must be within 2·e_w + 1e-2 of transformers and of that CPU reference; a wrong operation
 *     moves logits by O(1) relative and fails.
 *  2. Decoding equals the full forward bit for bit on the device (fp32 and bf16): one token at a time and in
 *     irregular chunks, several sequences per step.
 *  3. Greedy continuations in fp32 equal transformers' argmax loop (greedy.safetensors) and the CPU's.
 *  4. Batch invariance on a larger random model, fp32 and bf16: one sequence alone, as row 0 of a full-forward
 *     batch of 8, inside one step with 7 other sequences of other lengths, and decoded one token at a time beside
 *     other sequences: its logits are bitwise equal in all four.
 *  5. Rollout log-probabilities (generation at temperature 1) equal the training forward's log-probabilities
 *     bit for bit on the device.
 *  6. Errors are values: a device that does not exist, a cache of the CPU used after the move, an allocation larger
 *     than the GPU, and the model works after each. The per-op profile lists the device's operations. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#include "model.h" /* ds4_param_lowp: which tensors bf16 mode holds in bf16 */

static const ds4_device_options CUDA_F32 = {DS4_DEVICE_CUDA, 0, DS4_F32};
static const ds4_device_options CUDA_BF16 = {DS4_DEVICE_CUDA, 0, DS4_BF16};
static const ds4_device_options CPU = {DS4_DEVICE_CPU, 0, DS4_F32};

static const char *dname(const ds4_device_options *o) { return o->dtype == DS4_BF16 ? "bf16" : "fp32"; }

static double max_abs(const float *x, int64_t n) {
    double r = 0;
    for (int64_t i = 0; i < n; i++) r = fabs((double)x[i]) > r ? fabs((double)x[i]) : r;
    return r;
}

/* ||a - b|| / ||b||; +inf when a holds a non-finite value */
static double rel_frob(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        const double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* ------------------------------------------------------------------------------------------------ fixtures */

static void fixture_on(ds4_model *m, const char *name, const ds4_device_options *dev, const ds4_st_file *io,
                       const ds4_forward_args *a0, const float *cpu_logits, const float *cpu_bf16w) {
    ds4_error err = {0};
    const ds4_config *c = ds4_model_config(m);
    const int64_t B = a0->batch, S = a0->seq, V = c->vocab_size, T = B * S;
    CHECK_OK(ds4_model_to(m, dev, &err), &err);
    CHECK(strncmp(ds4_model_device_name(m), "cuda:0", 6) == 0, "%s: device name %s", name, ds4_model_device_name(m));
    float *lg = malloc((size_t)(T * V) * 4), *st = malloc((size_t)(T * V) * 4);
    float *mtp = ds4_model_has_mtp(m) ? malloc((size_t)(B * (S - 1) * V) * 4) : NULL;
    for (int64_t i = 0; i < T * V; i++) lg[i] = st[i] = NAN; /* poison: every element must be written */
    ds4_forward_args a = *a0;
    a.logits = lg;
    a.mtp_logits = mtp;
    ds4_forward_result r;
    CHECK_OK(ds4_model_forward(m, &a, &r, &err), &err);
    const ds4_st_entry *ref = ds4_st_find(io, "logits"), *lref = ds4_st_find(io, "loss");
    float hf_loss;
    memcpy(&hf_loss, lref->data, 4);
    const double mref = max_abs(ref->data, T * V), dcpu = ds4t_max_abs_diff(lg, cpu_logits, T * V);
    if (dev->dtype == DS4_F32) {
        const double d = ds4t_max_abs_diff(lg, ref->data, T * V), tol = 1e-4 * (mref > 1 ? mref : 1);
        printf("  %-8s fp32 logits max|d| vs transformers %.3g (tol %.3g), vs CPU %.3g; loss %.7f ref %.7f\n", name, d,
               tol, dcpu, r.loss, (double)hf_loss);
        CHECK(d <= tol, "%s fp32: logits differ from transformers by %g > %g", name, d, tol);
        CHECK(fabs(r.loss - hf_loss) <= 1e-5 * fabs(hf_loss), "%s fp32: loss %.8f vs %.8f", name, r.loss,
              (double)hf_loss);
        const ds4_st_entry *mt = ds4_st_find(io, "mtp_logits");
        if (mt && mtp) {
            const double dm = ds4t_max_abs_diff(mtp, mt->data, B * (S - 1) * V);
            CHECK(dm <= 1e-4 * (max_abs(mt->data, B * (S - 1) * V) > 1 ? max_abs(mt->data, B * (S - 1) * V) : 1),
                  "%s fp32: MTP logits differ by %g", name, dm);
        }
    } else {
        const double ew = rel_frob(cpu_bf16w, ref->data, T * V), tol = 2 * ew + 1e-2;
        const double rf = rel_frob(lg, ref->data, T * V), rc = rel_frob(lg, cpu_bf16w, T * V);
        printf("  %-8s bf16 logits rel. Frobenius vs transformers %.3g, vs the CPU with bf16 weights %.3g (bf16 weights "
               "alone: %.3g; tol %.3g); loss %.6f ref %.6f\n", name, rf, rc, ew, tol, r.loss, (double)hf_loss);
        CHECK(rf <= tol && rc <= tol, "%s bf16: logits rel. Frobenius %g / %g > %g", name, rf, rc, tol);
        CHECK(fabs(r.loss - hf_loss) <= 1e-2 * fabs(hf_loss), "%s bf16: loss %.6f vs %.6f", name, r.loss, (double)hf_loss);
    }
    /* decoding == full forward, bit for bit: 1 by 1, and irregular chunks */
    const int64_t ones[1] = {1}, odd[4] = {3, 2, 5, 1};
    for (int64_t b = 0; b < B; b++) {
        ds4t_step_logits(m, a.ids + b * S, S, ones, 1, st);
        CHECK(memcmp(st, lg + b * S * V, (size_t)(S * V) * 4) == 0, "%s %s row %lld: 1-by-1 decoding differs from the "
              "full forward (max |d| %g)", name, dname(dev), (long long)b, ds4t_max_abs_diff(st, lg + b * S * V, S * V));
        ds4t_step_logits(m, a.ids + b * S, S, odd, 4, st);
        CHECK(memcmp(st, lg + b * S * V, (size_t)(S * V) * 4) == 0, "%s %s row %lld: chunked decoding differs", name,
              dname(dev), (long long)b);
    }
    free(lg);
    free(st);
    free(mtp);
}

static void greedy_on_cuda(ds4_model *m, const char *dir, const char *name) {
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "greedy.safetensors"), &f, &err), &err);
    if (!f) return;
    const ds4_st_entry *p0 = ds4_st_find(f, "prompt_0"), *p1 = ds4_st_find(f, "prompt_1");
    const ds4_st_entry *g0 = ds4_st_find(f, "greedy_0"), *g1 = ds4_st_find(f, "greedy_1");
    CHECK(p0 && p1 && g0 && g1, "%s: greedy.safetensors", name);
    if (p0 && p1 && g0 && g1) {
        const int64_t *prompts[2] = {p0->data, p1->data}, lens[2] = {p0->shape[0], p1->shape[0]};
        const int64_t *want[2] = {g0->data, g1->data};
        ds4_gen_args ga = {.nprompts = 2, .prompts = prompts, .prompt_lens = lens, .n = 1,
                           .max_new_tokens = g0->shape[0], .ignore_eos = 1};
        ds4_gen_result *r = NULL;
        CHECK_OK(ds4_generate(m, &ga, &r, &err), &err);
        for (int k = 0; r && k < 2; k++) {
            CHECK(r->seqs[k].n_ids == g0->shape[0], "%s: %lld greedy tokens", name, (long long)r->seqs[k].n_ids);
            CHECK(memcmp(r->seqs[k].ids, want[k], (size_t)g0->shape[0] * 8) == 0,
                  "%s: CUDA fp32 greedy continuation %d differs from transformers'", name, k);
        }
        printf("  %-8s fp32 greedy continuations (2 x %lld tokens) %s transformers'\n", name, (long long)g0->shape[0],
               r && !memcmp(r->seqs[0].ids, want[0], (size_t)g0->shape[0] * 8) ? "equal" : "DIFFER from");
        ds4_gen_result_free(r);
    }
    ds4_st_close(f);
}

static void run_fixture(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    ds4_error err = {0};
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) goto out;
    const int64_t T = a.batch * a.seq, V = ds4_model_config(m)->vocab_size;
    float *cpu = malloc((size_t)(T * V) * 4), *back = malloc((size_t)(T * V) * 4), *cbw = malloc((size_t)(T * V) * 4);
    ds4_forward_args ac = a;
    ac.logits = cpu;
    CHECK_OK(ds4_model_forward(m, &ac, NULL, &err), &err);
    /* the CPU reference with its weight matrices (what bf16 mode holds in bf16) rounded to bf16 */
    {
        float *p = ds4_model_params(m), *keep = malloc((size_t)ds4_model_param_count(m) * 4);
        memcpy(keep, p, (size_t)ds4_model_param_count(m) * 4);
        for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
            const char *tn;
            ds4_tensor view;
            ds4_tensor_info ti;
            CHECK_OK(ds4_model_tensor_at(m, i, &tn, &view, &err), &err);
            CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
            if (!ti.is_param || !ds4_param_lowp(tn, view.ndim)) continue;
            for (int64_t k = 0; k < ti.numel; k++) p[ti.offset + k] = ds4_bf16_to_f32(ds4_f32_to_bf16(p[ti.offset + k]));
        }
        ac.logits = cbw;
        CHECK_OK(ds4_model_forward(m, &ac, NULL, &err), &err);
        memcpy(p, keep, (size_t)ds4_model_param_count(m) * 4);
        free(keep);
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    fixture_on(m, name, &CUDA_F32, io, &a, cpu, cbw);
    greedy_on_cuda(m, dir, name);
    fixture_on(m, name, &CUDA_BF16, io, &a, cpu, cbw);
    /* and back: the CPU computes exactly what it computed before the round trip */
    CHECK_OK(ds4_model_to(m, &CPU, &err), &err);
    ac.logits = back;
    CHECK_OK(ds4_model_forward(m, &ac, NULL, &err), &err);
    CHECK(memcmp(back, cpu, (size_t)(T * V) * 4) == 0, "%s: CPU logits changed after a round trip to the GPU", name);
    free(cpu);
    free(back);
    free(cbw);
out:
    ds4_st_close(io);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------------------------------------ invariance */

/* Every layer type, windows and compression crossed many times within the test lengths, the indexer choosing among
 * more entries than its top-k, hash and learned routing, 4 streams. head_dim 128: the bf16 full forward's attention
 * takes its keys from bf16 copies there (cuda_attn_tc.cuh), decoding from the cache's fp32 rows. */
static const char CONFIG[] =
    "{\"vocab_size\": 512, \"hidden_size\": 256, \"num_hidden_layers\": 4, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 1, \"head_dim\": 128, \"qk_rope_head_dim\": 64, \"partial_rotary_factor\": 0.5,"
    " \"q_lora_rank\": 128, \"o_groups\": 2, \"o_lora_rank\": 64, \"sliding_window\": 16,"
    " \"layer_types\": [\"sliding_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\","
    " \"compressed_sparse_attention\"],"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 16},"
    " \"mlp_layer_types\": [\"hash_moe\", \"moe\", \"moe\", \"moe\"],"
    " \"index_n_heads\": 4, \"index_head_dim\": 64, \"index_topk\": 6, \"n_routed_experts\": 16,"
    " \"num_experts_per_tok\": 4, \"n_shared_experts\": 1, \"moe_intermediate_size\": 128, \"hc_mult\": 4,"
    " \"num_nextn_predict_layers\": 1, \"initializer_range\": 0.05, \"swiglu_limit\": 7.0}";

static uint64_t rng = 0x2545f4914f6cdd1dull;
static int64_t rnd(int64_t n) {
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (int64_t)((rng * 0x2545f4914f6cdd1dull) >> 33) % n;
}

static void invariance(ds4_engine *eng, const ds4_device_options *dev) {
    ds4_error err = {0};
    ds4_config cfg;
    CHECK_OK(ds4_config_parse(CONFIG, sizeof CONFIG - 1, &cfg, &err), &err);
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_create_random(eng, &cfg, 7, &m, &err), &err);
    if (!m) return;
    CHECK_OK(ds4_model_to(m, dev, &err), &err);
    enum { NB = 8, S0 = 70 };
    const int64_t V = cfg.vocab_size, lens[NB] = {S0, 7, 23, 70, 41, 55, 3, 64};
    int64_t ids[NB][S0];
    for (int b = 0; b < NB; b++)
        for (int s = 0; s < S0; s++) ids[b][s] = rnd(V);
    float *alone = malloc((size_t)(S0 * V) * 4), *buf = malloc((size_t)(NB * S0 * V) * 4);
    /* alone */
    ds4_forward_args a = {.ids = ids[0], .batch = 1, .seq = S0, .logits = alone};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    /* row 0 of a full-forward batch of 8 */
    ds4_forward_args ab = {.ids = &ids[0][0], .batch = NB, .seq = S0, .logits = buf};
    CHECK_OK(ds4_model_forward(m, &ab, NULL, &err), &err);
    CHECK(memcmp(buf, alone, (size_t)(S0 * V) * 4) == 0, "%s: row 0 of a batch of 8 differs from alone (max |d| %g)",
          dname(dev), ds4t_max_abs_diff(buf, alone, S0 * V));
    /* inside one step with 7 other sequences of other lengths (prefill in one step) */
    ds4_cache *cs[NB];
    int64_t flat[NB * S0], n = 0;
    for (int b = 0; b < NB; b++) {
        CHECK_OK(ds4_cache_create(m, S0 + 1, &cs[b], &err), &err);
        memcpy(flat + n, ids[b], (size_t)lens[b] * 8);
        n += lens[b];
    }
    ds4_step_args sa = {.nseq = NB, .caches = cs, .counts = lens, .ids = flat, .logits = buf};
    CHECK_OK(ds4_model_step(m, &sa, &err), &err);
    CHECK(memcmp(buf, alone, (size_t)(S0 * V) * 4) == 0, "%s: inside a step of 8 sequences differs from alone (max |d| %g)",
          dname(dev), ds4t_max_abs_diff(buf, alone, S0 * V));
    /* decoded one token at a time while a changing set of other sequences decodes beside it */
    for (int b = 0; b < NB; b++) ds4_cache_reset(cs[b]);
    int ok = 1;
    for (int64_t p = 0; p < S0; p++) {
        ds4_cache *c2[NB];
        int64_t cnt[NB], tok[NB], ns = 0;
        c2[ns] = cs[0], cnt[ns] = 1, tok[ns++] = ids[0][p];
        for (int b = 1; b < NB; b++)
            if ((p + b) % 3 != 0 && ds4_cache_len(cs[b]) < S0) c2[ns] = cs[b], cnt[ns] = 1, tok[ns++] = rnd(V);
        ds4_step_args s1 = {.nseq = ns, .caches = c2, .counts = cnt, .ids = tok, .logits = buf};
        CHECK_OK(ds4_model_step(m, &s1, &err), &err);
        ok &= memcmp(buf, alone + p * V, (size_t)V * 4) == 0;
    }
    CHECK(ok, "%s: decoding one token at a time beside other sequences differs from alone", dname(dev));
    printf("  invariance %s: alone == row 0 of 8 == inside a step of 8 == decoded 1 by 1 beside others: %s\n",
           dname(dev), ok && !memcmp(buf, alone + (S0 - 1) * V, (size_t)V * 4) ? "bitwise equal" : "DIFFERENT");
    for (int b = 0; b < NB; b++) ds4_cache_free(cs[b]);
    /* rollout log-probs == training log-probs on the device */
    const int64_t *prompts[2] = {ids[1], ids[2]}, plens[2] = {7, 23};
    ds4_gen_args ga = {.nprompts = 2, .prompts = prompts, .prompt_lens = plens, .n = 3, .max_new_tokens = 24,
                       .sampling = {.temperature = 1.0}, .seed = 11, .ignore_eos = 1};
    ds4_gen_result *r = NULL;
    CHECK_OK(ds4_generate(m, &ga, &r, &err), &err);
    int64_t scored = 0;
    const int64_t mism = ds4t_rollout_mismatch(m, r, prompts, &scored);
    printf("  rollout vs training log-probs %s: %lld of %lld tokens differ\n", dname(dev), (long long)mism,
           (long long)scored);
    CHECK(scored > 0 && mism == 0, "%s: %lld of %lld rollout log-probs differ from the training forward's", dname(dev),
          (long long)mism, (long long)scored);
    ds4_gen_result_free(r);
    free(alone);
    free(buf);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------------------------------------ errors */

static void errors(ds4_engine *eng, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, ds4t_path(fixtures, "tiny_a"), &m, &err), &err);
    if (!m) return;
    ds4_cache *c = NULL;
    CHECK_OK(ds4_cache_create(m, 8, &c, &err), &err);
    const ds4_device_options far = {DS4_DEVICE_CUDA, 99, DS4_F32}, badt = {DS4_DEVICE_CUDA, 0, DS4_F16};
    CHECK_STATUS(ds4_model_to(m, &far, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "cuda:99") != NULL, "names the device: %s", err.msg);
    CHECK_STATUS(ds4_model_to(m, &badt, &err), DS4_ERR_ARG, &err);
    CHECK_OK(ds4_model_to(m, &CUDA_F32, &err), &err);
    int64_t one = 1, id = 3;
    ds4_step_args sa = {.nseq = 1, .caches = &c, .counts = &one, .ids = &id};
    CHECK_STATUS(ds4_model_step(m, &sa, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "cpu") != NULL, "names the cache's backend: %s", err.msg);
    /* more device memory than there is: a clear error, and the model still works */
    CHECK_STATUS(ds4_model_reserve(m, 1 << 24, 1 << 24, 0, &err), DS4_ERR_OOM, &err);
    CHECK(strstr(err.msg, "asked for") && strstr(err.msg, "free"), "says asked and free: %s", err.msg);
    printf("  errors: %s\n", err.msg);
    ds4_engine_set_profile(eng, 1);
    int64_t ids[6] = {1, 2, 3, 4, 5, 6};
    float lg[6 * 256];
    ds4_forward_args a = {.ids = ids, .batch = 1, .seq = 6, .logits = lg};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    CHECK(isfinite(lg[0]), "forward after the OOM");
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    char rep[8192];
    ds4_model_profile_report(m, rep, sizeof rep);
    CHECK(strstr(rep, "matmul") && strstr(rep, "attention") && strstr(rep, "cuda"), "profile table:\n%s", rep);
    printf("%s", rep);
    ds4_engine_set_profile(eng, 0);
    ds4_cache_free(c);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    int n = 0;
    ds4_error err = {0};
    if (ds4_cuda_device_count(&n, &err) || n == 0) {
        printf("test_cuda_model: skipped (no CUDA device)\n");
        return 77;
    }
    ds4_engine *eng = NULL;
    ds4_engine_options o = {.n_threads = 4};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    if (!eng) return ds4t_finish("test_cuda_model");
    run_fixture(eng, fixtures, "tiny_a");
    run_fixture(eng, fixtures, "tiny_b");
    run_fixture(eng, fixtures, "tiny_hf");
    invariance(eng, &CUDA_F32);
    invariance(eng, &CUDA_BF16);
    errors(eng, fixtures);
    ds4_engine_free(eng);
    return ds4t_finish("test_cuda_model");
}
#else
int main(void) {
    printf("test_cuda_model: skipped (built without CUDA)\n");
    return 77;
}
#endif
