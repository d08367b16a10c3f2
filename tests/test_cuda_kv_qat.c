/* test_cuda_kv_qat.c — the FP8 KV quantisation-aware option (docs/architecture.md, "FP8 KV quantisation-aware
 * training") on the CUDA backend, against the CPU backend (core/fake_quant.c is the reference) and closed forms.
 *
 * Exit 77 (skipped) without a CUDA build or device; scripts/gpu.sh runs it on a GPU machine.
 *
 *  1. The fake_quant operation on the device against hand-computed values: the scale choice (amax 448 -> 1, 449 ->
 *     2, 224 -> 1/2, 6 -> 1 for e2m1, zeros -> the floor), roundings to the nearest e4m3 / e2m1 value with ties to the
 *     even mantissa (1.0625 -> 1, 1.1875 -> 1.25, 432 -> 448, 2^-10 -> 0, 1.5·2^-9 -> 2^-8, 2.5 -> 2, 5 -> 4, ...),
 *     the top of the range (447 -> 448, -447 -> -448, 448 stays), zeros, a NaN or an infinity turning its own block
 *     (only) into NaN, the RoPE channels after nq untouched, the rotation (H·1/sqrt(16) = 4·e0, H·e0/sqrt(4) = 1/2
 *     everywhere) and groups addressed through gstride with the gaps untouched. (The ±448 clamp is never reached from
 *     a finite block: amax/s <= 448 because s >= fl(amax/448) >= amax/448 — fl(q) could fall to a power of two below
 *     q only if q exceeded it by at most 2^-24 relative, and amax's own spacing near 448·2^k is 2^-23/1.75 relative;
 *     a value of 447 at scale 1 shows the rounding up to the top.)
 *  2. The same operation on random vectors (log-uniform magnitudes from 2^-140 to 2^20, both signs, exact ties,
 *     zeros, NaNs and infinities in some blocks), in every shape the schedule uses (e4m3 with RoPE channels left, e2m1
 *     after the rotation, the rotation alone over groups), on both backends from the same bits: the outputs must be
 *     the same bits (NaN: both NaN). The arithmetic is elementwise with power-of-two scales; its only rounding
 *     operations (the scale's division, the butterflies, 1/sqrt(n)) are correctly rounded on both sides
 *     (cuda/cuda_kv_qat.cuh), so no tolerance is needed.
 *  3. The compressor with the option (attention: e4m3 after RoPE; indexer: rotation then e2m1), CSA and HCA windows:
 *     the device's entries are exactly the CPU's fake_quant_row applied to the device's own entries without the option
 *     (the pooling before it is compared with the CPU in test_cuda_ops; here the rounding step is checked bitwise).
 *  4. The models (the fixtures tiny_a, tiny_b, tiny_hf; their indexer widths are powers of two) with the option on:
 *     - fp32 logits against the CPU's with the option on. Without it the bound is test_cuda_model's
 *       1e-4·max(1, max|ref|) (two fp32 summation orders). With it, a value that the CPU's order puts on one side of
 *       a rounding boundary of e4m3 or e2m1 can land on the other side on the GPU (a discrete change of one quantum,
 *       which an FP4 rounding can turn into another indexer pick). How much such events move this model is measured
 *       as test_cuda_train.c measures a tensor's sensitivity: the CPU again with every weight moved by 2^-20 relative
 *       (8 ulps, the size of a sum's order noise, so more such events than the GPU's ~1 ulp differences) in random
 *       directions, the largest logit change es over 8 draws; the GPU must lie within max(1e-4·max(1, max|ref|),
 *       8·es). The option itself must show: the GPU is closer to the CPU with the option than the option moves the
 *       CPU's logits (max|GPU - CPU_on| < max|CPU_on - CPU_off| / 2), so a device that skipped the rounding fails.
 *     - decoding equals the full forward bit for bit on the device (1 by 1 and in irregular chunks);
 *     - rollout log-probabilities (generation at temperature 1) equal the training forward's bit for bit;
 *     - the option turned off and on again on the device: generation, which replays recorded decoding steps (CUDA
 *       graphs), still equals each setting's own training forward bitwise (the option is part of a step's key);
 *     - gradients of one training step (cross-entropy, and the indexer-KL loss where the model has CSA layers, whose
 *       backward rotates the indexer's gradients on the device): per tensor within max(1e-4, 8·es_t) relative
 *       (Frobenius, floor 1e-7·sqrt(numel)) of the CPU's with the option on, es_t the tensor's own sensitivity from the
 *       same disturbed draws (test_cuda_train.c's bound for fp32, with its measured-sensitivity term);
 *     - bf16 mode: decoding == full forward and rollout == training bitwise; logits within 2·e_w + 1e-2 (relative
 *       Frobenius) of the CPU with the option on, e_w the distance bf16 weights alone move the CPU with the option on
 *       (test_cuda_model.c's bound; bf16's roundings are far larger than the option's boundary events, which e_w then
 *       includes). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"
#include "fake_quant.h"
#include "model.h"

static const ds4_device_options CUDA_F32 = {DS4_DEVICE_CUDA, 0, DS4_F32};
static const ds4_device_options CUDA_BF16 = {DS4_DEVICE_CUDA, 0, DS4_BF16};
static const ds4_device_options CPU_DEV = {DS4_DEVICE_CPU, 0, DS4_F32};

/* same bits, or both NaN (NaN bit patterns differ between the CPU's and the GPU's arithmetic) */
static int same_bits(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

/* ------------------------------------------------------------------------------------------------ 1. closed form */

/* Run fake_quant on the device over `rows` vectors of width w (groups 0) and check every output against want. */
static void dev_fq(const char *what, const float *in, const float *want, int64_t rows, int64_t w, int64_t groups,
                   int64_t gstride, ds4_fq q) {
    const int64_t n = (groups > 0 ? groups : 1) * (groups > 0 ? gstride : rows * w);
    twin x = tw_new((size_t)n * 4);
    memcpy(x.h, in, (size_t)n * 4);
    tw_push(&x);
    OP(gpu, fake_quant, .x = x.d, .rows = rows, .width = w, .groups = groups, .gstride = gstride, .q = q);
    check_dev(gpu, what);
    float *g = fetch(&x);
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(isnan(want[i]) ? isnan(g[i]) : g[i] == want[i])) {
            if (bad++ < 5)
                fprintf(stderr, "%s: [%lld] %.9g -> %.9g, want %.9g\n", what, (long long)i, (double)in[i], (double)g[i],
                        (double)want[i]);
        }
    CHECK(bad == 0, "%s: %d of %lld values differ from the closed form", what, bad, (long long)n);
    free(g);
    tw_free(&x);
}

static void closed_form(void) {
    enum { W = 160, NQ = 128 }; /* two e4m3 blocks, 32 RoPE channels */
    static float in[6][W], want[6][W];
    for (int r = 0; r < 6; r++)
        for (int i = 0; i < W; i++) in[r][i] = want[r][i] = i >= NQ ? 3.14159f * (float)(i - NQ + 1) : 0.0f;
    /* row 0, scale 1 (block 0's largest is 448) and block 1 scale 1 (447 rounds to the top) */
    const float r0[][2] = {{448, 448},          {1.0625f, 1},        {1.1875f, 1.25f},      {1.0626f, 1.125f},
                           {17, 16},            {19, 20},            {248, 256},            {432, 448},
                           {0x1p-9f, 0x1p-9f},  {0x1p-10f, 0},       {0x1.8p-9f, 0x1p-8f},  {-0.0f, 0},
                           {0x1p-30f, 0},       {-1.1875f, -1.25f},  {240, 240},            {-19, -20}};
    for (int i = 0; i < 16; i++) in[0][i] = r0[i][0], want[0][i] = r0[i][1];
    in[0][64] = 447, want[0][64] = 448;
    in[0][65] = -447, want[0][65] = -448;
    in[0][66] = 0.3f, want[0][66] = 0.3125f; /* [0.25, 0.5): spacing 2^-5 */
    /* row 1: largest 449 -> scale 2: 449 / 2 = 224.5 -> 224; 1.5·2^-8 / 2 = 1.5·2^-9, a tie -> 2^-8 -> 2^-7 (at scale
     * 1 it would stay); block 1 holds zeros only -> the floor's scale, zeros stay zeros */
    in[1][0] = 449, want[1][0] = 448;
    in[1][1] = 0x1.8p-8f, want[1][1] = 0x1p-7f;
    in[1][2] = -3, want[1][2] = -3;
    /* row 2: largest 224 -> scale 1/2: 2^-10 / (1/2) = 2^-9 is kept (at scale 1 it would round to 0) */
    in[2][0] = 224, want[2][0] = 224;
    in[2][1] = 0x1p-10f, want[2][1] = 0x1p-10f;
    in[2][2] = 0x1p-12f, want[2][2] = 0; /* 2^-11 at the scale: below half the smallest subnormal */
    /* row 3: a NaN in block 1 -> block 1 NaN, block 0 and the RoPE channels as usual */
    in[3][0] = 448, want[3][0] = 448;
    in[3][1] = 19, want[3][1] = 20;
    for (int i = 64; i < NQ; i++) in[3][i] = 1, want[3][i] = NAN;
    in[3][100] = NAN;
    /* row 4: an infinity in block 0 -> block 0 NaN (it never hides as 448) */
    for (int i = 0; i < 64; i++) in[4][i] = 2, want[4][i] = NAN;
    in[4][7] = -INFINITY;
    in[4][64] = 448, want[4][64] = 448;
    /* row 5: zeros (and a negative zero) everywhere quantised */
    in[5][3] = -0.0f;
    dev_fq("fake_quant e4m3 closed form", &in[0][0], &want[0][0], 6, W, 0, 0,
           (ds4_fq){.fmt = DS4_FQ_E4M3, .nq = NQ});
    /* e2m1, no rotation: largest 6 -> scale 1 */
    float e2[32] = {0}, e2w[32] = {0};
    const float c2[][2] = {{6, 6},   {0.25f, 0}, {0.26f, 0.5f}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2},
                           {3.5f, 4}, {5, 4},     {5.5f, 6},     {-0.75f, -1}, {-5.5f, -6}};
    for (int i = 0; i < 12; i++) e2[i] = c2[i][0], e2w[i] = c2[i][1];
    dev_fq("fake_quant e2m1 closed form", e2, e2w, 1, 32, 0, 0, (ds4_fq){.fmt = DS4_FQ_E2M1, .nq = 32});
    /* the rotation then e2m1: H·(1, ..., 1) / sqrt(16) = (4, 0, ..., 0), amax 4 -> scale 1, 4 stays */
    float h16[16], h16w[16] = {4};
    for (int i = 0; i < 16; i++) h16[i] = 1;
    dev_fq("fake_quant hadamard + e2m1 closed form", h16, h16w, 1, 16, 0, 0,
           (ds4_fq){.fmt = DS4_FQ_E2M1, .hadamard = 1, .nq = 16});
    /* the rotation alone over 2 groups of 2 rows of 4 at stride 12 (the gaps untouched): e0 -> (1/2, 1/2, 1/2, 1/2),
     * (1, 1, 1, 1) -> (2, 0, 0, 0), (1, -1, 1, -1) -> (0, 2, 0, 0) */
    float hg[24], hgw[24];
    for (int i = 0; i < 24; i++) hg[i] = hgw[i] = 7.5f;
    const float rows_in[4][4] = {{1, 0, 0, 0}, {1, 1, 1, 1}, {1, -1, 1, -1}, {0, 0, 0, 0}};
    const float rows_out[4][4] = {{0.5f, 0.5f, 0.5f, 0.5f}, {2, 0, 0, 0}, {0, 2, 0, 0}, {0, 0, 0, 0}};
    for (int g = 0; g < 2; g++)
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 4; i++) {
                hg[g * 12 + r * 4 + i] = rows_in[g * 2 + r][i];
                hgw[g * 12 + r * 4 + i] = rows_out[g * 2 + r][i];
            }
    dev_fq("fake_quant rotation over groups closed form", hg, hgw, 2, 4, 2, 12, (ds4_fq){.hadamard = 1});
    printf("  closed forms on the device: scales, ties to even, the top, zeros, NaN / inf blocks, rotation: checked\n");
}

/* ------------------------------------------------------------------------------------------------ 2. vs the CPU */

/* a value for a random vector: mostly log-uniform magnitudes over 2^-140 .. 2^20, some exact ties at the vector's
 * typical scale, zeros */
static float rand_value(void) {
    const double u = urand();
    const float sign = urand() < 0.5 ? -1.0f : 1.0f;
    if (u < 0.05) return 0.0f * sign;
    if (u < 0.25) return sign * (float)(((int)(urand() * 64) * 2 + 1)) * 0x1p-4f; /* odd multiples of 1/16: ties */
    return sign * (float)exp2(-140.0 + 160.0 * urand());
}

static void vs_cpu(const char *what, int64_t rows, int64_t w, int64_t groups, int64_t gstride, ds4_fq q, int specials) {
    const int64_t n = (groups > 0 ? groups : 1) * (groups > 0 ? gstride : rows * w);
    twin x = tw_new((size_t)n * 4);
    float *h = x.h;
    for (int64_t i = 0; i < n; i++) {
        /* one vector in 4 at a narrow dynamic range (a realistic key), the others log-uniform */
        const int64_t row = i / w;
        h[i] = row % 4 == 0 ? frand(-3, 3) : rand_value();
    }
    for (int k = 0; specials && k < 6; k++) { /* NaNs and infinities in a few places */
        const int64_t i = (int64_t)(urand() * (double)n);
        h[i] = k % 3 == 0 ? NAN : (k % 3 == 1 ? INFINITY : -INFINITY);
    }
    tw_push(&x);
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, fake_quant, .x = S(x), .rows = rows, .width = w, .groups = groups, .gstride = gstride, .q = q);
    check_dev(gpu, what);
    float *g = fetch(&x);
    int64_t bad = 0, nan = 0;
    for (int64_t i = 0; i < n; i++) {
        bad += !same_bits(g[i], h[i]);
        nan += isnan(h[i]);
    }
    CHECK(bad == 0, "%s: %lld of %lld values differ from the CPU's", what, (long long)bad, (long long)n);
    printf("  %-44s %lld values (%lld NaN), %lld differ from the CPU\n", what, (long long)n, (long long)nan,
           (long long)bad);
    free(g);
    tw_free(&x);
}

/* ------------------------------------------------------------------------------------------------ 3. compressor */

static void compress_qat(int overlap, int indexer) {
    ds4_config c;
    ds4_config_default(&c);
    c.rms_norm_eps = 1e-6;
    const int64_t B = 2, S = 37, T = B * S, dd = indexer ? 32 : 64, half = 8, m = overlap ? 4 : 8;
    const int64_t width = (overlap ? 2 : 1) * dd, nwin = S / m;
    twin C = tw_f(T * width, -1, 1), Z = tw_f(T * width, -1, 1), ape = tw_f(m * width, -0.5f, 0.5f);
    twin nw = tw_f(dd, 0.5f, 1.5f), cs = tw_f(S * 2 * half, -1, 1);
    twin plain = tw_out((size_t)(B * S * dd) * 4), qat = tw_out((size_t)(B * S * dd) * 4);
    const ds4_fq q = indexer ? (ds4_fq){.fmt = DS4_FQ_E2M1, .hadamard = 1, .nq = dd}
                             : (ds4_fq){.fmt = DS4_FQ_E4M3, .nq = dd - 2 * half};
    const ds4_compressor_w cw = {.width = width, .dd = dd, .rate = m, .ape = ape.d, .norm = nw.d};
    const ds4_rope_table rt = {cs.d, half};
    const ds4_rows rows = {.T = T, .S = S};
    OP(gpu, compress, .c = &c, .w = &cw, .overlap = overlap, .which = indexer, .C = C.d, .Z = Z.d, .out = plain.d,
       .rows = rows, .B = B, .nwin = nwin, .rt = rt);
    OP(gpu, compress, .c = &c, .w = &cw, .overlap = overlap, .which = indexer, .C = C.d, .Z = Z.d, .out = qat.d,
       .rows = rows, .B = B, .nwin = nwin, .rt = rt, .q = q);
    check_dev(gpu, "compress with the option");
    float *gp = fetch(&plain), *gq = fetch(&qat);
    int64_t bad = 0, moved = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t w = 0; w < nwin; w++) {
            float *e = gp + (b * S + w) * dd;
            const float *got = gq + (b * S + w) * dd;
            float before[64];
            memcpy(before, e, (size_t)dd * 4);
            ds4_fake_quant_row(e, dd, &q); /* the CPU's rounding of the device's own entry */
            for (int64_t i = 0; i < dd; i++) {
                bad += !same_bits(got[i], e[i]);
                moved += e[i] != before[i];
            }
        }
    char what[96];
    snprintf(what, sizeof what, "compress %s %s", overlap ? "CSA" : "HCA", indexer ? "indexer (rotation, e2m1)" : "(e4m3)");
    CHECK(bad == 0 && moved > 0, "%s: %lld values differ from the CPU's rounding of the device's entries (%lld rounded)",
          what, (long long)bad, (long long)moved);
    printf("  %-44s %lld entries: %lld values differ from the CPU's rounding (%lld moved by it)\n", what,
           (long long)(B * nwin), (long long)bad, (long long)moved);
    free(gp), free(gq);
    twin all[] = {C, Z, ape, nw, cs, plain, qat};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ 4. models */

#define ES_REL 0x1p-20 /* the disturbance of each weight: 8 ulps, of the size of a sum's order noise */
#define ES_DRAWS 8
#define ES_K 8.0

static double max_abs(const float *x, int64_t n) {
    double r = 0;
    for (int64_t i = 0; i < n; i++) r = fabs((double)x[i]) > r ? fabs((double)x[i]) : r;
    return r;
}

/* ||a - b|| / max(||b||, floor); +inf when a holds a non-finite value */
static double rel_t(const float *a, const float *b, int64_t n, double floor_) {
    double dd = 0, rr = 0;
    for (int64_t k = 0; k < n; k++) {
        if (!isfinite(a[k])) return INFINITY;
        dd += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
        rr += (double)b[k] * b[k];
    }
    return sqrt(dd) / fmax(sqrt(rr), floor_);
}

static void logits_of(ds4_model *m, const ds4_forward_args *a0, float *out) {
    ds4_error err = {0};
    const int64_t n = a0->batch * a0->seq * ds4_model_config(m)->vocab_size;
    for (int64_t i = 0; i < n; i++) out[i] = NAN; /* poison: every element must be written */
    ds4_forward_args a = {.ids = a0->ids, .batch = a0->batch, .seq = a0->seq, .logits = out};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
}

/* Gradients of one training pass (cross-entropy; with ikl > 0 the indexer-KL loss too): a host copy. */
static float *grads_of(ds4_model *m, const ds4_forward_args *a, double ikl) {
    ds4_error err = {0};
    ds4_train_options to = {.indexer_kl = ikl};
    CHECK_OK(ds4_model_set_train_options(m, &to, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_model_zero_grad(m);
    ds4_forward_result r;
    CHECK_OK(ds4_model_forward_train(m, a, &r, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    const float *g = ds4_model_grads(m);
    const int64_t P = ds4_model_param_count(m);
    float *c = malloc((size_t)P * 4);
    if (g) memcpy(c, g, (size_t)P * 4);
    else for (int64_t i = 0; i < P; i++) c[i] = NAN;
    ds4_train_options off = {0};
    ds4_model_set_train_options(m, &off, &err);
    return c;
}

/* Decoding == the full forward, bitwise, on the model's device (row 0 of the batch). */
static void decode_equals_forward(ds4_model *m, const ds4_forward_args *a, const float *full, const char *what) {
    const int64_t S = a->seq, V = ds4_model_config(m)->vocab_size;
    float *st = malloc((size_t)(S * V) * 4);
    const int64_t ones[1] = {1}, odd[4] = {3, 2, 5, 1};
    for (int k = 0; k < 2; k++) {
        for (int64_t i = 0; i < S * V; i++) st[i] = NAN;
        ds4t_step_logits(m, a->ids, S, k ? odd : ones, k ? 4 : 1, st);
        CHECK(memcmp(st, full, (size_t)(S * V) * 4) == 0, "%s: %s decoding differs from the full forward (max |d| %g)",
              what, k ? "chunked" : "1-by-1", ds4t_max_abs_diff(st, full, S * V));
    }
    free(st);
}

/* Rollout log-probabilities (temperature 1) == the training forward's, bitwise, on the model's device. */
static void rollout_equals_training(ds4_model *m, const ds4_forward_args *a, const char *what) {
    ds4_error err = {0};
    const int64_t *prompts[2] = {a->ids, a->ids + a->seq / 2}, plens[2] = {3, a->seq / 3};
    ds4_gen_args ga = {.nprompts = 2, .prompts = prompts, .prompt_lens = plens, .n = 2, .max_new_tokens = 12,
                       .sampling = {.temperature = 1.0}, .seed = 13, .ignore_eos = 1};
    ds4_gen_result *r = NULL;
    CHECK_OK(ds4_generate(m, &ga, &r, &err), &err);
    int64_t scored = 0;
    const int64_t mism = ds4t_rollout_mismatch(m, r, prompts, &scored);
    printf("  %-32s rollout vs training log-probs: %lld of %lld tokens differ\n", what, (long long)mism,
           (long long)scored);
    CHECK(scored > 0 && mism == 0, "%s: %lld of %lld rollout log-probs differ from the training forward's", what,
          (long long)mism, (long long)scored);
    ds4_gen_result_free(r);
}

/* The option off, then on again, on the device: generation decodes through recorded steps (CUDA graphs) keyed by
 * the schedule; the option must be part of the key, else a step recorded with it would replay without it. Each
 * setting's rollout log-probabilities equal its own training forward's. */
static void toggle(ds4_model *m, const ds4_forward_args *a, const char *what) {
    ds4_error err = {0};
    char w[96];
    CHECK_OK(ds4_model_set_kv_qat(m, 0, &err), &err);
    snprintf(w, sizeof w, "%s, turned off", what);
    rollout_equals_training(m, a, w);
    CHECK_OK(ds4_model_set_kv_qat(m, 1, &err), &err);
    snprintf(w, sizeof w, "%s, on again", what);
    rollout_equals_training(m, a, w);
}

/* The CPU reference with the option on, and its sensitivity to fp32-level disturbances: es (the largest logit
 * change) and es_t[i] (each tensor's gradient), over ES_DRAWS draws of every weight moved by ES_REL. */
static void cpu_sensitivity(ds4_model *m, const ds4_forward_args *a, const float *lg_ref, float *const *g_ref,
                            const double *ikl, int nmode, double *es, double **es_t) {
    ds4_error err = {0};
    const int64_t P = ds4_model_param_count(m), n = a->batch * a->seq * ds4_model_config(m)->vocab_size;
    const size_t NT = ds4_model_tensor_count(m);
    float *p = ds4_model_params(m), *keep = malloc((size_t)P * 4), *lg = malloc((size_t)n * 4);
    memcpy(keep, p, (size_t)P * 4);
    *es = 0;
    for (int draw = 0; draw < ES_DRAWS; draw++) {
        for (size_t i = 0; i < NT; i++) { /* the trainable weights (not the hash layers' integer tables) */
            ds4_tensor_info info;
            CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
            if (!info.is_param || !info.trainable) continue;
            for (int64_t k = info.offset; k < info.offset + info.numel; k++)
                p[k] = keep[k] * (float)(1 + (urand() < 0.5 ? -1 : 1) * ES_REL);
        }
        ds4_model_params_changed(m);
        logits_of(m, a, lg);
        const double d = ds4t_max_abs_diff(lg, lg_ref, n);
        *es = d > *es ? d : *es;
        for (int k = 0; k < nmode; k++) {
            float *g = grads_of(m, a, ikl[k]);
            for (size_t i = 0; i < NT; i++) {
                ds4_tensor_info info;
                CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
                if (!info.is_param) continue;
                const double e = rel_t(g + info.offset, g_ref[k] + info.offset, info.numel, 1e-7 * sqrt((double)info.numel));
                es_t[k][i] = e > es_t[k][i] ? e : es_t[k][i];
            }
            free(g);
        }
    }
    memcpy(p, keep, (size_t)P * 4);
    ds4_model_params_changed(m);
    free(keep);
    free(lg);
}

static void model_fixture(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    ds4_error err = {0};
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) goto out;
    {
        const ds4_config *c = ds4_model_config(m);
        const int64_t V = c->vocab_size, n = a.batch * a.seq * V, P = ds4_model_param_count(m);
        const size_t NT = ds4_model_tensor_count(m);
        const int csa = ds4_model_csa_layers(m) > 0;
        const double ikl[2] = {0, 1.0};
        const int nmode = csa ? 2 : 1;
        float *off = malloc((size_t)n * 4), *on = malloc((size_t)n * 4), *bw = malloc((size_t)n * 4);
        float *dev = malloc((size_t)n * 4), *gref[2] = {0};
        double *es_t[2] = {calloc(NT, sizeof(double)), calloc(NT, sizeof(double))}, es = 0;
        /* the CPU references */
        logits_of(m, &a, off);
        CHECK_OK(ds4_model_set_kv_qat(m, 1, &err), &err);
        logits_of(m, &a, on);
        for (int k = 0; k < nmode; k++) gref[k] = grads_of(m, &a, ikl[k]);
        cpu_sensitivity(m, &a, on, gref, ikl, nmode, &es, es_t);
        /* e_w: the CPU with the option on and the weights bf16 mode holds in bf16 rounded to bf16 */
        {
            float *p = ds4_model_params(m), *keep = malloc((size_t)P * 4);
            memcpy(keep, p, (size_t)P * 4);
            for (size_t i = 0; i < NT; i++) {
                ds4_tensor_info info;
                CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
                if (!info.is_param || !m->table[i].lowp) continue;
                for (int64_t k = 0; k < info.numel; k++)
                    p[info.offset + k] = ds4_bf16_to_f32(ds4_f32_to_bf16(p[info.offset + k]));
            }
            ds4_model_params_changed(m);
            logits_of(m, &a, bw);
            memcpy(p, keep, (size_t)P * 4);
            ds4_model_params_changed(m);
            free(keep);
        }
        const double mref = max_abs(on, n), moved = ds4t_max_abs_diff(on, off, n);
        const double tol = fmax(1e-4 * (mref > 1 ? mref : 1), ES_K * es);
        /* fp32 on the device */
        CHECK_OK(ds4_model_to(m, &CUDA_F32, &err), &err);
        CHECK(ds4_model_kv_qat(m), "%s: the option stays on through the move", name);
        logits_of(m, &a, dev);
        const double d = ds4t_max_abs_diff(dev, on, n);
        printf("  %-8s fp32 logits with the option: max|GPU - CPU| %.3g (tol %.3g: es %.3g); the option moves the CPU "
               "by %.3g\n", name, d, tol, es, moved);
        CHECK(d <= tol, "%s fp32: logits with the option differ from the CPU's by %g > %g", name, d, tol);
        CHECK(d < moved / 2, "%s fp32: the GPU (%g from the CPU) is not clearly closer to the CPU with the option than "
              "the option's own effect (%g)", name, d, moved);
        char what[64];
        snprintf(what, sizeof what, "%s fp32", name);
        decode_equals_forward(m, &a, dev, what);
        rollout_equals_training(m, &a, what);
        toggle(m, &a, what);
        for (int k = 0; k < nmode; k++) {
            float *g = grads_of(m, &a, ikl[k]);
            double worst = 0, worst_ratio = 0;
            const char *worst_name = "";
            for (size_t i = 0; i < NT; i++) {
                ds4_tensor_info info;
                const char *tn = NULL;
                CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
                CHECK_OK(ds4_model_tensor_at(m, i, &tn, NULL, &err), &err);
                if (!info.is_param) continue;
                const double e = rel_t(g + info.offset, gref[k] + info.offset, info.numel,
                                       1e-7 * sqrt((double)info.numel));
                const double b = fmax(1e-4, ES_K * es_t[k][i]);
                CHECK(e <= b, "%s fp32 %s: %s gradient %.3g from the CPU's > %.3g", name, k ? "indexer-kl" : "ce", tn, e, b);
                if (!(e <= worst)) worst = e, worst_name = tn;
                if (es_t[k][i] > 0 && e / es_t[k][i] > worst_ratio) worst_ratio = e / es_t[k][i];
            }
            printf("  %-8s fp32 %-10s gradients with the option: worst tensor %.3g (%s); largest ratio to its own "
                   "sensitivity %.3g\n", name, k ? "indexer-kl" : "ce", worst, worst_name, worst_ratio);
            free(g);
        }
        /* bf16 on the device (through the host, as test_cuda_train moves a model that has trained) */
        CHECK_OK(ds4_model_to(m, &CPU_DEV, &err), &err);
        CHECK_OK(ds4_model_to(m, &CUDA_BF16, &err), &err);
        logits_of(m, &a, dev);
        const double ew = rel_t(bw, on, n, 0), tb = 2 * ew + 1e-2, rb = rel_t(dev, on, n, 0);
        printf("  %-8s bf16 logits with the option: rel. Frobenius from the CPU %.3g (tol %.3g: bf16 weights alone "
               "%.3g)\n", name, rb, tb, ew);
        CHECK(rb <= tb, "%s bf16: logits with the option %g from the CPU's > %g", name, rb, tb);
        snprintf(what, sizeof what, "%s bf16", name);
        decode_equals_forward(m, &a, dev, what);
        rollout_equals_training(m, &a, what);
        CHECK_OK(ds4_model_to(m, &CPU_DEV, &err), &err);
        for (int k = 0; k < 2; k++) free(gref[k]), free(es_t[k]);
        free(off), free(on), free(bw), free(dev);
    }
out:
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    ds4_engine *eng = NULL;
    const int open = twins_open("test_cuda_kv_qat", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_kv_qat");
    closed_form();
    vs_cpu("fake_quant e4m3, 448 of 512 (head_dim 512)", 37, 512, 0, 0, (ds4_fq){.fmt = DS4_FQ_E4M3, .nq = 448}, 1);
    vs_cpu("fake_quant e4m3, 160 of 192", 101, 192, 0, 0, (ds4_fq){.fmt = DS4_FQ_E4M3, .nq = 160}, 1);
    vs_cpu("fake_quant rotation + e2m1, width 128", 77, 128, 0, 0,
           (ds4_fq){.fmt = DS4_FQ_E2M1, .hadamard = 1, .nq = 128}, 1);
    vs_cpu("fake_quant rotation + e2m1, width 32", 64, 32, 0, 0, (ds4_fq){.fmt = DS4_FQ_E2M1, .hadamard = 1, .nq = 32},
           0);
    vs_cpu("fake_quant rotation alone, 3 groups", 9, 64, 3, 9 * 64 + 5, (ds4_fq){.hadamard = 1}, 0);
    for (int ov = 0; ov < 2; ov++)
        for (int ix = 0; ix < 2; ix++) compress_qat(ov, ix);
    /* the device refuses what it cannot do, naming the operation */
    {
        twin x = tw_f(12, -1, 1);
        ds4_error err;
        OP(gpu, fake_quant, .x = x.d, .rows = 1, .width = 12, .q = (ds4_fq){.hadamard = 1});
        CHECK_STATUS(ds4_dev_check(gpu, "fake_quant", &err), DS4_ERR_UNSUPPORTED, &err);
        CHECK(strstr(err.msg, "fake_quant") && strstr(err.msg, "power-of-two"), "names it: %s", err.msg);
        tw_free(&x);
    }
    const char *names[3] = {"tiny_a", "tiny_b", "tiny_hf"};
    for (int i = 0; i < 3; i++) model_fixture(eng, argv[1], names[i]);
    twins_close(eng);
    return ds4t_finish("test_cuda_kv_qat");
}
#else
int main(void) {
    printf("test_cuda_kv_qat: skipped (built without CUDA)\n");
    return 77;
}
#endif
