/* test_fp4_resident.c — FP4-resident routed experts (ds4_load_options.fp4_experts, docs/checkpoints.md).
 *
 * The reference is the same checkpoint loaded the ordinary way: its FP4 experts dequantised to fp32 (whose values
 * test_quant_load checks bit for bit against the numpy-dequantised fixture, and whose logits it checks against
 * transformers'). The packed kernels decode into the GEMM's panels the values that dequantisation gives and sum in
 * the same order, so everything here must be equal bit for bit: logits (whole sequences and one- or two-token
 * products, which take another GEMM path), with LoRA adapters on the experts, adapter gradients, and every other
 * gradient of a full fine-tuning step (the packed experts frozen). The packed bytes must never change.
 *
 * The guard against scales that are silently not applied (issue 14: such a model still gave a loss only ~10% off):
 * the decoded experts' statistics must be the reference's, and the same checks must fail on a decode and on a model
 * whose scales were replaced by 1 (mutation checks: the comparisons can tell). The CUDA kernels over packed experts
 * are tests/test_cuda_fp4.c's and tests/lua/test_fp4_experts.lua's (GPU machines). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_train.h"
#include "fp4.h"
#include "internal.h"
#include "kernels_cpu.h"
#include "model.h"
#include "testlib.h"

static const char *g_fixtures;
static ds4_engine *g_eng;

static ds4_model *load(const char *fx, int fp4) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", g_fixtures, fx);
    ds4_error err = {0};
    ds4_model *m = NULL;
    const ds4_load_options o = {.fp4_experts = fp4};
    CHECK_OK(ds4_model_load_opts(g_eng, dir, &o, &m, &err), &err);
    return m;
}

typedef struct {
    int64_t B, S, V;
    int64_t *ids, *labels;
} inputs;

/* Fixture file fx/file opened (NULL: a failed check), and its entry `name` in *e (NULL when absent). */
static ds4_st_file *open_entry(const char *fx, const char *file, const char *name, const ds4_st_entry **e) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s/%s", g_fixtures, fx, file);
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(p, &f, &err), &err);
    *e = f ? ds4_st_find(f, name) : NULL;
    CHECK(*e != NULL, "%s has no '%s'", p, name);
    return f;
}

/* tiny_hf's input ids; labels = ids (position t scored against t+1) */
static inputs read_inputs(void) {
    inputs in = {0};
    const ds4_st_entry *e;
    ds4_st_file *f = open_entry("tiny_hf", "io.safetensors", "input_ids", &e);
    if (e && e->dtype == DS4_I64 && e->ndim == 2) {
        in.B = e->shape[0], in.S = e->shape[1], in.V = 64;
        in.ids = malloc((size_t)(in.B * in.S) * sizeof(int64_t));
        in.labels = malloc((size_t)(in.B * in.S) * sizeof(int64_t));
        memcpy(in.ids, e->data, (size_t)(in.B * in.S) * sizeof(int64_t));
        memcpy(in.labels, e->data, (size_t)(in.B * in.S) * sizeof(int64_t));
    }
    ds4_st_close(f);
    return in;
}

/* logits [B, S, V] of the first B sequences' first S tokens (a new block) */
static float *logits(ds4_model *m, const inputs *in, int64_t B, int64_t S) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    int64_t *ids = malloc((size_t)(B * S) * sizeof(int64_t));
    for (int64_t b = 0; b < B; b++) memcpy(ids + b * S, in->ids + b * in->S, (size_t)S * sizeof(int64_t));
    float *l = malloc((size_t)(B * S * V) * sizeof(float));
    for (int64_t i = 0; i < B * S * V; i++) l[i] = NAN; /* poisoned: every logit must be written */
    ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .logits = l};
    ds4_forward_result r;
    ds4_error err = {0};
    CHECK_OK(ds4_model_forward(m, &a, &r, &err), &err);
    free(ids);
    return l;
}

static int same_bits(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * sizeof(float)) == 0; }

/* ------------------------------------------------------------------------------------------------ logits */

static void test_logits(const char *fx, int64_t want_packed_kinds) {
    ds4_model *p = load(fx, 1), *r = load(fx, 0);
    const inputs in = read_inputs();
    if (!p || !r || !in.ids) goto out;
    int64_t kinds = 0, packed_numel = 0;
    for (int64_t i = 0; i < (ds4_model_config(p)->num_hidden_layers + 1) * 3; i++) kinds += p->fp4_kinds[i];
    for (size_t i = 0; i < p->n_table; i++)
        if (p->table[i].dtype == DS4_FP4_PACKED) packed_numel += p->table[i].numel;
    CHECK(kinds == want_packed_kinds, "%s: %lld expert kinds FP4-resident, want %lld", fx, (long long)kinds,
          (long long)want_packed_kinds);
    /* 4.25 bits per value: half a byte and one scale byte per 32 */
    CHECK(ds4_model_fp4_bytes(p) == packed_numel / 2 + packed_numel / 32, "%s: %lld packed bytes for %lld values", fx,
          (long long)ds4_model_fp4_bytes(p), (long long)packed_numel);
    CHECK(ds4_model_param_count(p) == ds4_model_param_count(r) - packed_numel,
          "%s: the packed experts are not fp32 parameters", fx);
    const int64_t shapes[3][2] = {{in.B, in.S}, {1, 1}, {1, 2}}; /* whole; one- and two-row products (direct path) */
    for (int k = 0; k < 3; k++) {
        const int64_t B = shapes[k][0], S = shapes[k][1], n = B * S * ds4_model_config(p)->vocab_size;
        float *lp = logits(p, &in, B, S), *lr = logits(r, &in, B, S);
        CHECK(same_bits(lp, lr, n), "%s [%lld, %lld]: FP4-resident logits differ from the dequantised model's by %g",
              fx, (long long)B, (long long)S, ds4t_max_abs_diff(lp, lr, n));
        free(lp);
        free(lr);
    }
    printf("%s: %lld expert kinds FP4-resident, %lld bytes (fp32: %lld); logits equal the dequantised model's bit for "
           "bit\n", fx, (long long)kinds, (long long)ds4_model_fp4_bytes(p), (long long)(packed_numel * 4));
out:
    free(in.ids);
    free(in.labels);
    ds4_model_free(p);
    ds4_model_free(r);
}

/* ------------------------------------------------------------------------------------------------ the guard */

typedef struct { double mean, std, amax; } stats;

static stats stats_of(const float *x, int64_t n) {
    double s = 0, s2 = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        s += x[i];
        s2 += (double)x[i] * x[i];
        mx = fabs(x[i]) > mx ? fabs(x[i]) : mx;
    }
    const double mean = s / (double)n;
    return (stats){mean, sqrt(s2 / (double)n - mean * mean), mx};
}

/* The decoded values are the reference's exactly, so their statistics agree to the last bit; 1e-6 relative only
 * allows another summation order. Scales of 1 instead of 2^-3 .. 2^-6 move std and max by 8x or more. */
static int stats_match(stats a, stats b) {
    const double t = 1e-6;
    return fabs(a.mean - b.mean) <= t * (b.std + 1e-30) && fabs(a.std - b.std) <= t * b.std &&
           fabs(a.amax - b.amax) <= t * b.amax;
}

/* Expert matrix W [O, K] decoded by the GEMM from (q, s) both ways it reads a weight: y = I Wᵀ (the forward's
 * reading, along K) and dx = I W (the input gradient's, across O); both must be W. out [O, K]. */
static int decode_by_gemm(const uint8_t *q, const uint8_t *s, int64_t O, int64_t K, float *out) {
    float *eye = calloc((size_t)(O > K ? O : K) * (size_t)(O > K ? O : K), sizeof(float));
    float *yt = malloc((size_t)(O * K) * sizeof(float)), *ws = malloc(DS4_GEMM_WS_FLOATS * sizeof(float));
    const int64_t n = O > K ? O : K;
    for (int64_t i = 0; i < n; i++) eye[i * n + i] = 1.0f;
    /* forward: y[k, o] = Σ_r I[k, r] W[o, r] */
    const ds4_gemm f = {.y = yt, .ldy = O, .a = eye, .a_rs = n, .a_ks = 1, .b_rs = K, .b_ks = 1, .M = K, .N = O, .R = K,
                        .bq = q, .bs = s};
    ds4_gemm_run(NULL, &f, 1, ws);
    /* input gradient: dx[o, k] = Σ_r I[o, r] W[r, k], in the backward's order (ds4_gemm.seq) as the backend runs it */
    const ds4_gemm b = {.y = out, .ldy = K, .a = eye, .a_rs = n, .a_ks = 1, .b_rs = 1, .b_ks = K, .M = O, .N = K, .R = O,
                        .bq = q, .bs = s, .seq = 1};
    ds4_gemm_run(NULL, &b, 1, ws);
    int same = 1;
    for (int64_t o = 0; o < O; o++)
        for (int64_t k = 0; k < K; k++) same &= yt[k * O + o] == out[o * K + k];
    free(eye);
    free(yt);
    free(ws);
    return same;
}

static void test_guard(void) {
    ds4_model *p = load("quant_fp4", 1), *r = load("quant_fp4_ref", 0);
    const inputs in = read_inputs();
    if (!p || !r || !in.ids) goto out;
    int64_t checked = 0, ok = 0, caught = 0, both_ways = 0;
    double worst_std = 0;
    for (size_t i = 0; i < p->n_table; i++) {
        const ds4_param *e = &p->table[i];
        if (e->dtype != DS4_FP4_PACKED) continue;
        const int64_t j = ds4_model_find(r, e->name), O = e->shape[0], K = e->shape[1], n = O * K;
        CHECK(j >= 0, "%s not in the reference", e->name);
        if (j < 0) continue;
        const float *ref = r->params + r->table[j].offset;
        float *dec = malloc((size_t)n * sizeof(float));
        uint8_t *ones = malloc((size_t)(n / DS4_FP4_BLOCK));
        memset(ones, 127, (size_t)(n / DS4_FP4_BLOCK)); /* e8m0 127 = 1.0: the scales ignored */
        both_ways += decode_by_gemm(p->q4 + e->offset, p->q4 + e->qscale, O, K, dec);
        const stats sr = stats_of(ref, n), sd = stats_of(dec, n);
        ok += stats_match(sd, sr);
        if (fabs(sd.std - sr.std) / sr.std > worst_std) worst_std = fabs(sd.std - sr.std) / sr.std;
        decode_by_gemm(p->q4 + e->offset, ones, O, K, dec);
        caught += !stats_match(stats_of(dec, n), sr);
        checked++;
        free(dec);
        free(ones);
    }
    CHECK(checked == 48 && ok == checked && both_ways == checked,
          "decoded experts: %lld checked, %lld with the reference's statistics, %lld decoded alike both ways",
          (long long)checked, (long long)ok, (long long)both_ways);
    CHECK(caught == checked, "scales ignored: only %lld of %lld experts' statistics were told apart", (long long)caught,
          (long long)checked);
    printf("guard: %lld decoded experts with the reference's mean/std/max (std within %.2g); with the scales ignored "
           "all %lld differ\n", (long long)checked, worst_std, (long long)caught);

    /* the logits check of test_quant_load (transformers' on the dequantised weights, 1e-5 of the largest logit)
     * passes on the packed model and fails once its scales are replaced by 1 */
    const ds4_st_entry *hl;
    ds4_st_file *hf = open_entry("quant_fp4_ref", "hf_logits.safetensors", "logits", &hl);
    const int64_t nl = in.B * in.S * in.V;
    if (hl && hl->dtype == DS4_F32 && hl->shape[0] * hl->shape[1] * hl->shape[2] == nl) {
        double mx = 0;
        const float *hv = hl->data;
        for (int64_t i = 0; i < nl; i++) mx = fabs(hv[i]) > mx ? fabs(hv[i]) : mx;
        const double tol = 1e-5 * (mx > 1 ? mx : 1);
        float *good = logits(p, &in, in.B, in.S);
        for (size_t i = 0; i < p->n_table; i++) /* every scale of every packed expert set to 1 */
            if (p->table[i].dtype == DS4_FP4_PACKED)
                memset(p->q4 + p->table[i].qscale, 127, (size_t)(p->table[i].numel / DS4_FP4_BLOCK));
        float *bad = logits(p, &in, in.B, in.S);
        const double dg = ds4t_max_abs_diff(good, hl->data, nl), db = ds4t_max_abs_diff(bad, hl->data, nl);
        CHECK(dg <= tol, "FP4-resident logits %g from transformers' (bound %g)", dg, tol);
        CHECK(db > tol, "with the scales ignored the logits are only %g from transformers' (bound %g): the check "
              "cannot tell", db, tol);
        printf("guard: logits %.3g from transformers' (bound %.3g); with the scales ignored %.3g\n", dg, tol, db);
        free(good);
        free(bad);
    } else {
        CHECK(0, "quant_fp4_ref/hf_logits.safetensors: logits F32 [%lld] expected", (long long)nl);
    }
    ds4_st_close(hf);
out:
    free(in.ids);
    free(in.labels);
    ds4_model_free(p);
    ds4_model_free(r);
}

/* ds4_fp4_decode's runs (pairs of values per byte, a scale per 32) against decoding each value on its own (ds4_fp4_at,
 * the definition), from every start and length up to past a few blocks: odd starts and ends included. */
static void test_decode_runs(void) {
    uint8_t q[64], s[4];
    uint64_t st = 11;
    for (int i = 0; i < 64; i++) q[i] = (uint8_t)(ds4_splitmix64(&st) & 255u);
    for (int i = 0; i < 4; i++) s[i] = (uint8_t)(100 + 9 * i);
    int64_t bad = 0, runs = 0;
    float out[128];
    for (int64_t e0 = 0; e0 < 128; e0++)
        for (int64_t n = 0; e0 + n <= 128; n++) {
            ds4_fp4_decode(out, q, s, e0, n);
            for (int64_t k = 0; k < n; k++) {
                const float want = ds4_fp4_at(q, s, e0 + k);
                bad += memcmp(&out[k], &want, sizeof want) != 0;
            }
            runs++;
        }
    CHECK(bad == 0, "ds4_fp4_decode: %lld values differ from ds4_fp4_at over %lld runs", (long long)bad, (long long)runs);
}

/* ------------------------------------------------------------------------------------------------ training */

/* The same random adapters (B too: PEFT's B = 0 would hide the B path) on both models. */
static void attach_lora(ds4_model *p, ds4_model *r) {
    ds4_error err = {0};
    const ds4_lora_options o = {.rank = 4, .alpha = 8, .targets = DS4_LORA_ALL, .seed = 3};
    CHECK_OK(ds4_model_lora(p, &o, &err), &err);
    CHECK_OK(ds4_model_lora(r, &o, &err), &err);
    ds4_lora_tensors t = {0};
    CHECK_OK(ds4_model_lora_tensors(p, 0, &t, &err), &err);
    uint64_t st = 7;
    for (size_t i = 0; i < t.n; i++) {
        float *x = t.tensors[i]->data;
        for (int64_t k = 0; k < ds4_tensor_numel(t.tensors[i]); k++) x[k] = (float)(ds4_uniform01(&st) - 0.5) * 0.4f;
    }
    CHECK_OK(ds4_model_lora_set(p, &t, &err), &err);
    CHECK_OK(ds4_model_lora_set(r, &t, &err), &err);
    ds4_lora_tensors_free(&t);
}

/* a training forward and backward of the mean loss */
static double train_pass(ds4_model *m, const inputs *in) {
    ds4_error err = {0};
    ds4_forward_args a = {.ids = in->ids, .batch = in->B, .seq = in->S, .labels = in->labels};
    ds4_forward_result res = {0};
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_model_zero_grad(m);
    CHECK_OK(ds4_model_forward_train(m, &a, &res, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
    return res.loss;
}

static void adamw_step(ds4_model *m) {
    ds4_error err = {0};
    ds4_adamw *opt = NULL;
    const ds4_adamw_options o = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
    if (opt) CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
    ds4_adamw_free(opt);
}

static void test_lora(const char *fx) {
    ds4_model *p = load(fx, 1), *r = load(fx, 0);
    const inputs in = read_inputs();
    if (!p || !r || !in.ids) goto out;
    attach_lora(p, r);
    const int64_t n = in.B * in.S * in.V;
    float *lp = logits(p, &in, in.B, in.S), *lr = logits(r, &in, in.B, in.S);
    CHECK(same_bits(lp, lr, n), "%s LoRA: logits differ by %g", fx, ds4t_max_abs_diff(lp, lr, n));
    free(lp);
    free(lr);
    uint8_t *before = malloc((size_t)p->n_q4);
    memcpy(before, p->q4, (size_t)p->n_q4);
    const double loss_p = train_pass(p, &in), loss_r = train_pass(r, &in);
    CHECK(loss_p == loss_r, "%s LoRA: loss %.9g vs %.9g", fx, loss_p, loss_r);
    ds4_error err = {0};
    ds4_lora_tensors gp = {0}, gr = {0};
    CHECK_OK(ds4_model_lora_tensors(p, 1, &gp, &err), &err);
    CHECK_OK(ds4_model_lora_tensors(r, 1, &gr, &err), &err);
    size_t differ = 0, experts = 0;
    double gmax = 0;
    for (size_t i = 0; i < gp.n && i < gr.n; i++) {
        const int64_t k = ds4_tensor_numel(gp.tensors[i]);
        if (strcmp(gp.names[i], gr.names[i]) || !same_bits(gp.tensors[i]->data, gr.tensors[i]->data, k)) differ++;
        if (strstr(gp.names[i], "mlp.experts")) {
            experts++;
            for (int64_t j = 0; j < k; j++) {
                const double v = fabs(((const float *)gp.tensors[i]->data)[j]);
                gmax = v > gmax ? v : gmax;
            }
        }
    }
    const size_t n_adapters = gp.n;
    CHECK(gp.n == gr.n && gp.n > 0 && differ == 0, "%s LoRA: %zu of %zu adapter gradients differ", fx, differ, gp.n);
    CHECK(experts > 0 && gmax > 0, "%s LoRA: the routed experts' adapters got no gradient", fx);
    ds4_lora_tensors_free(&gp);
    ds4_lora_tensors_free(&gr);
    adamw_step(p);
    adamw_step(r);
    CHECK(memcmp(before, p->q4, (size_t)p->n_q4) == 0, "%s LoRA: a training step changed the packed experts", fx);
    lp = logits(p, &in, in.B, in.S);
    lr = logits(r, &in, in.B, in.S);
    CHECK(same_bits(lp, lr, n), "%s LoRA: after a step the logits differ by %g", fx, ds4t_max_abs_diff(lp, lr, n));
    free(lp);
    free(lr);
    CHECK(ds4_model_merge_lora(p, &err) == DS4_ERR_UNSUPPORTED, "%s: merging into FP4-resident experts must be refused",
          fx);
    printf("%s LoRA: logits, loss %.6f and %zu adapter gradients equal the dequantised model's bit for bit; a step left "
           "the packed experts unchanged\n", fx, loss_p, n_adapters);
    free(before);
out:
    free(in.ids);
    free(in.labels);
    ds4_model_free(p);
    ds4_model_free(r);
}

/* Full fine-tuning with FP4-resident experts: they are frozen (not parameters), everything else trains; every
 * gradient the packed model has equals the dequantised model's for the same tensor. */
static void test_frozen_experts(void) {
    ds4_model *p = load("quant_fp4", 1), *r = load("quant_fp4", 0);
    const inputs in = read_inputs();
    if (!p || !r || !in.ids) goto out;
    uint8_t *before = malloc((size_t)p->n_q4);
    memcpy(before, p->q4, (size_t)p->n_q4);
    const double loss_p = train_pass(p, &in), loss_r = train_pass(r, &in);
    CHECK(loss_p == loss_r, "frozen experts: loss %.9g vs %.9g", loss_p, loss_r);
    const float *gp = ds4_model_grads(p), *gr = ds4_model_grads(r);
    size_t compared = 0, differ = 0, packed = 0;
    ds4_error err = {0};
    for (size_t i = 0; gp && gr && i < p->n_table; i++) {
        ds4_tensor_info ti;
        CHECK_OK(ds4_model_tensor_info(p, i, &ti, &err), &err);
        if (p->table[i].dtype == DS4_FP4_PACKED) {
            packed++;
            CHECK(!ti.is_param && !ti.trainable, "%s: an FP4-resident expert must not train", p->table[i].name);
            continue;
        }
        if (p->table[i].dtype != DS4_F32) continue;
        const int64_t j = ds4_model_find(r, p->table[i].name);
        compared++;
        differ += !same_bits(gp + p->table[i].offset, gr + r->table[j].offset, p->table[i].numel);
    }
    CHECK(compared > 0 && differ == 0 && packed == 48, "frozen experts: %zu of %zu gradients differ (%zu packed)",
          differ, compared, packed);
    adamw_step(p);
    CHECK(memcmp(before, p->q4, (size_t)p->n_q4) == 0, "frozen experts: a full fine-tuning step changed them");
    printf("frozen experts: %zu gradients equal the dequantised model's bit for bit; the %zu packed experts unchanged "
           "by a step\n", compared, packed);
    free(before);
out:
    free(in.ids);
    free(in.labels);
    ds4_model_free(p);
    ds4_model_free(r);
}

/* ------------------------------------------------------------------------------------------------ refusals */

static void test_refusals(void) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/tiny_hf", g_fixtures);
    ds4_error err = {0};
    ds4_model *m = NULL;
    const ds4_load_options o = {.fp4_experts = 1};
    CHECK(ds4_model_load_opts(g_eng, dir, &o, &m, &err) == DS4_ERR_ARG && strstr(err.msg, "no routed expert"),
          "fp4_experts on a float checkpoint: %s", err.msg);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    g_fixtures = argv[1];
    ds4_error err = {0};
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &g_eng, &err), &err);
    if (!g_eng) return ds4t_finish("test_fp4_resident");
    test_logits("quant_fp4", 6);      /* w1, w2, w3 of both layers */
    test_logits("quant_official", 4); /* w1 and w3 (w2's rows are 16 long: FP8, dequantised) */
    test_decode_runs();
    test_guard();
    test_lora("quant_fp4");
    test_lora("quant_official");
    test_frozen_experts();
    test_refusals();
    ds4_engine_free(g_eng);
    return ds4t_finish("test_fp4_resident");
}
