/* test_cuda_train.c — training on the CUDA backend: gradients, the device optimizer, determinism, resume, moves.
 *
 * Exit 77 (skipped) without a CUDA build or a GPU (every CI machine); scripts/gpu.sh runs it on one.
 *
 *  1. Gradients of the committed fixtures (grads.safetensors: torch autograd on transformers' model, fp32): every
 *     parameter's gradient from the CUDA backward in fp32 within 1e-4 relative (Frobenius, per tensor, floor
 *     1e-7·sqrt(numel) as test_backward.c) of the CPU's on the same batch — both fp32, differing only in summation
 *     orders (~1e-6) — and within test_backward.c's 1e-3 of torch. A few tensors are sums that cancel (the mHC
 *     scales: tiny_hf's hc_head_scale is 4.8e-5 from torch on the CPU, 1.1e-4 from the CPU on the GPU); there the
 *     bound is 3× the CPU's own distance from torch, two independent fp32 implementations of the same gradient.
 *     The same for the per-token log-probability path (model:logprobs / backward_logprobs), micro-batches, the MTP
 *     loss (tiny_a) and the indexer-KL option.
 *     bf16 (bf16 weight matrices, the matmuls' activation operands rounded to bf16, fp32 accumulation, gradients
 *     and everything else) against its emulation on the CPU: the same model with its M matrices rounded to bf16 and
 *     every product's operands rounded where the bf16 mode rounds them (ds4_model_emulate_bf16), so only fp32
 *     summation orders differ, as in fp32. Measured on an H100: tiny_hf agrees to 1.3e-5 (the emulation has the
 *     same rounding points). tiny_a and tiny_b are chaotic at bf16: a value near a rounding boundary, a SwiGLU clamp
 *     (tiny_a's limit is 0.25) or a top-k tie turns an fp32 order difference into a discrete change, which the
 *     layers after it amplify (tiny_a's worst tensor 0.15, tiny_b's 0.03; bf16 itself moves their gradients by up
 *     to 3.7 from fp32). Each tensor's own sensitivity es is measured: the emulation again with every fp32 weight
 *     moved by 2^-20 in random directions, the largest distance of 4 draws; a tensor must lie within
 *     max(1e-3, 8·es) of the emulation (the worst ratio seen is 6.6: tiny_a's layers.1.ffn.experts.7.w3, a clamp),
 *     and a routed expert of a learned layer also within 2/sqrt(n) for its n routed tokens (one token routed
 *     elsewhere moves it by about its share). A wrong operation moves a gradient by O(1) against es ~ 1e-2.
 *  2. The optimizer's operations against the CPU backend's: the update writes the same bits (the same fp32
 *     operations in the same order), the cast to bf16 the same bits, the per-piece sums of squares agree to 1e-12.
 *  3. The 10-step AdamW trajectory of tiny_a (train.safetensors, torch) on the device in fp32: losses within 1e-5
 *     relative and gradient norms within 1e-4, the bounds of test_train.c.
 *  4. Determinism: two runs of the same steps give bitwise equal weights and moments; resume: 4 steps == 2 steps,
 *     then the weights and the optimizer state through the host (as a checkpoint carries them) into a fresh model
 *     and optimizer, then 2 more, bitwise.
 *  5. Moves and refusals: a step that would make weights non-finite is refused with the device's weights, moments
 *     and step count unchanged; a model trained on the device, moved to the CPU, has the device's weights, its
 *     optimizer's moments come home, and training continues there; the router-bias update on the device equals the
 *     CPU's.
 *  6. Per-block recomputation (train option recompute): gradients and loss bitwise equal to keeping every block's
 *     activations, fp32 and bf16, tiny_a (MTP) and tiny_b (CSA, indexer-KL); in bf16 also the tape's inputs of bf16
 *     products kept in fp32 instead of bf16. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#include "engine.h"
#include "model.h"
#include "ops.h"

static const ds4_device_options CUDA_F32 = {DS4_DEVICE_CUDA, 0, DS4_F32};
static const ds4_device_options CUDA_BF16 = {DS4_DEVICE_CUDA, 0, DS4_BF16};
static const ds4_device_options CPU = {DS4_DEVICE_CPU, 0, DS4_F32};

static const char *dname(const ds4_device_options *o) { return o->dtype == DS4_BF16 ? "bf16" : "fp32"; }

static float *copy_f(const float *x, int64_t n) {
    float *c = malloc((size_t)(n ? n : 1) * sizeof *c);
    if (c && x) memcpy(c, x, (size_t)n * sizeof *c);
    return c;
}

/* ||a - b|| / max(||b||, floor) over one tensor; +inf when a holds a non-finite value */
static double rel_t(const float *a, const float *b, int64_t n) {
    double dd = 0, rr = 0;
    for (int64_t k = 0; k < n; k++) {
        if (!isfinite(a[k])) return INFINITY;
        dd += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
        rr += (double)b[k] * b[k];
    }
    return sqrt(dd) / fmax(sqrt(rr), 1e-7 * sqrt((double)n));
}

/* Gradients of one training pass of `m` on the fixture batch: CE (mode 0), per-token log-probs (1: dlogp = -1/N),
 * micro-batches row by row (2); mtp / ikl options. Returns a copy of the flat gradients (host). */
static float *grads_of(ds4_model *m, const ds4_forward_args *a, int mode, double mtp, double ikl) {
    ds4_error err = {0};
    /* the per-token path and the MTP loss run the head in chunks of 5 rows (on both backends) */
    ds4_train_options to = {.mtp_lambda = mtp, .indexer_kl = ikl, .head_chunk = mode == 1 || mtp > 0 ? 5 : 0};
    CHECK_OK(ds4_model_set_train_options(m, &to, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_model_zero_grad(m);
    ds4_forward_result r;
    CHECK_OK(ds4_model_forward_train(m, a, &r, &err), &err);
    const int64_t T = a->batch * a->seq;
    if (mode == 0) {
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
    } else if (mode == 1) {
        float *lp = malloc((size_t)T * 4), *dlp = malloc((size_t)T * 4);
        CHECK_OK(ds4_model_logprobs(m, lp, NULL, &err), &err);
        for (int64_t t = 0; t < T; t++) {
            const int64_t s = t % a->seq;
            dlp[t] = s + 1 < a->seq && a->labels[t + 1] != -100 ? (float)(-1.0 / (double)r.loss_tokens) : 0.0f;
        }
        CHECK_OK(ds4_model_backward_logprobs(m, dlp, &err), &err);
        free(lp);
        free(dlp);
    } else {
        ds4_model_zero_grad(m);
        for (int64_t row = 0; row < a->batch; row++) {
            ds4_forward_args ar = {.ids = a->ids + row * a->seq, .batch = 1, .seq = a->seq,
                                   .labels = a->labels + row * a->seq};
            ds4_forward_result rr;
            CHECK_OK(ds4_model_forward_train(m, &ar, &rr, &err), &err);
            CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
        }
    }
    const float *g = ds4_model_grads(m);
    CHECK(g != NULL, "gradients readable");
    ds4_train_options off = {0};
    ds4_model_set_train_options(m, &off, &err);
    return copy_f(g, ds4_model_param_count(m));
}

static uint64_t rs = 0x243f6a8885a308d3ull;
static double urand(void) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}

/* Per tensor: the CPU's distance from torch (two independent fp32 implementations of the same gradient) under
 * `prefix` in the fixture; -1 where torch has no such tensor. */
static double *torch_distance(ds4_model *m, const float *ref, const ds4_st_file *gf, const char *prefix) {
    ds4_error err = {0};
    double *et = malloc(ds4_model_tensor_count(m) * sizeof *et);
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        ds4_tensor_info info;
        const char *name = NULL;
        et[i] = -1;
        CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
        CHECK_OK(ds4_model_tensor_at(m, i, &name, NULL, &err), &err);
        char key[300];
        snprintf(key, sizeof key, "%s%s", prefix, name);
        const ds4_st_entry *t = info.is_param && info.trainable ? ds4_st_find(gf, key) : NULL;
        if (!t) continue;
        float *tf = malloc((size_t)info.numel * 4);
        memcpy(tf, t->data, (size_t)info.numel * 4);
        et[i] = rel_t(ref + info.offset, tf, info.numel);
        free(tf);
    }
    return et;
}

/* Worst per-tensor relative distance of g from ref over the parameters; each within max(bound, k·et[i], allow[i])
 * (et, allow may be NULL); with gf also within 1e-3 of the torch fixture under `prefix`. */
static double compare_grads(ds4_model *m, const float *g, const float *ref, const double *et, const double *allow,
                            double bound, double k,
                            const ds4_st_file *gf, const char *prefix, const char *what) {
    double worst = 0, worst_ratio = 0;
    const char *worst_name = "";
    ds4_error err = {0};
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        ds4_tensor_info info;
        const char *name = NULL;
        CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
        CHECK_OK(ds4_model_tensor_at(m, i, &name, NULL, &err), &err);
        if (!info.is_param) continue;
        const float *gi = g + info.offset, *ri = ref + info.offset;
        const double e = rel_t(gi, ri, info.numel);
        double b = et && k * et[i] > bound ? k * et[i] : bound;
        if (allow && allow[i] > b) b = allow[i];
        if (et && et[i] > 0 && e / et[i] > worst_ratio) worst_ratio = e / et[i];
        CHECK(e <= b, "%s %s: relative gradient distance from the cpu %.3g > %.3g", what, name, e, b);
        if (!(e <= worst)) worst = e, worst_name = name;
        if (gf && info.trainable) {
            char key[300];
            snprintf(key, sizeof key, "%s%s", prefix, name);
            const ds4_st_entry *t = ds4_st_find(gf, key);
            if (t) {
                float *tf = malloc((size_t)info.numel * 4);
                memcpy(tf, t->data, (size_t)info.numel * 4);
                const double et_gpu = rel_t(gi, tf, info.numel);
                CHECK(et_gpu <= 1e-3, "%s %s: relative gradient distance from torch %.3g > 1e-3", what, name, et_gpu);
                free(tf);
            }
        }
    }
    printf("  %-32s worst tensor %.3g (%s); largest ratio to the tensor's own scale %.3g\n", what, worst, worst_name,
           worst_ratio);
    return worst;
}

/* bf16 against its emulation on the CPU (see the top of the file): within max(BF16_FLOOR, BF16_K·es) */
#define BF16_FLOOR 1e-3
#define BF16_K 8.0
#define ES_REL 0x1p-20 /* the disturbance of each fp32 weight: 8 ulps, of the size of a sum's order noise */
#define ES_DRAWS 4

/* ------------------------------------------------------------------------------------------------ gradients */

static void gradients(ds4_engine *eng, const char *fixtures, const char *name) {
    ds4_error err = {0};
    ds4_model *m = NULL, *mw = NULL;
    ds4_st_file *io = NULL, *gf = NULL;
    ds4_forward_args a;
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) return;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    CHECK_OK(ds4_st_open(ds4t_path(dir, "grads.safetensors"), &gf, &err), &err);
    CHECK_OK(ds4_model_load(eng, dir, &mw, &err), &err);
    if (!gf || !mw) goto out;
    const int mtp = ds4_model_has_mtp(m), csa = ds4_model_config(m)->index_topk > 0;
    /* the fp32 references: the CPU, per mode (ce, logprobs, micro-batches, mtp, indexer-kl) */
    enum { NMODE = 5 };
    static const char *const mname[NMODE] = {"ce", "logprobs", "micro-batches", "mtp", "indexer-kl"};
    const int mode_of[NMODE] = {0, 1, 2, 0, 0};
    const double mtp_of[NMODE] = {0, 0, 0, 0.3, 0}, ikl_of[NMODE] = {0, 0, 0, 0, 1.0};
    const int runs[NMODE] = {1, 1, 1, mtp, csa};
    float *ref[NMODE] = {0}, *refb[NMODE] = {0};
    for (int k = 0; k < NMODE; k++)
        if (runs[k]) ref[k] = grads_of(m, &a, mode_of[k], mtp_of[k], ikl_of[k]);
    /* how far the CPU is from torch, per tensor: the conditioning of each fp32 gradient */
    double *et = torch_distance(m, ref[0], gf, "main."), *et_mtp = mtp ? torch_distance(m, ref[3], gf, "mtp.") : NULL;
    /* the bf16 references: the CPU with its M matrices rounded to bf16 and its products' operands rounded as the
     * bf16 mode rounds them */
    {
        float *p = ds4_model_params(mw);
        for (size_t i = 0; i < ds4_model_tensor_count(mw); i++) {
            ds4_tensor_info info;
            CHECK_OK(ds4_model_tensor_info(mw, i, &info, &err), &err);
            const ds4_param *pp = &mw->table[i];
            if (!info.is_param || !pp->lowp) continue;
            for (int64_t k = 0; k < info.numel; k++)
                p[info.offset + k] = ds4_bf16_to_f32(ds4_f32_to_bf16(p[info.offset + k]));
        }
        ds4_model_params_changed(mw);
        ds4_model_emulate_bf16(mw, 1);
    }
    /* allow[k][i]: a routed expert's share of its tokens, 2/sqrt(n) for the n (token, slot) pairs the emulation routes
     * to it (infinite for none). A token whose top-k is a near tie can pick another expert when an fp32 sum comes out
     * in another order; that moves the gradients of the two experts by about that token's share, which no
     * disturbance of the whole model reproduces reliably (it is one discrete event). */
    const ds4_config *cfg = ds4_model_config(mw);
    const size_t NL = (size_t)(cfg->num_hidden_layers + 1) * (size_t)cfg->n_routed_experts;
    double *allow[NMODE] = {0};
    for (int k = 0; k < NMODE; k++) {
        if (!runs[k]) continue;
        const int64_t *ld = ds4_model_router_loads(mw);
        int64_t *before = calloc(NL, sizeof *before);
        if (ld) memcpy(before, ld, NL * sizeof *before);
        refb[k] = grads_of(mw, &a, mode_of[k], mtp_of[k], ikl_of[k]);
        ld = ds4_model_router_loads(mw);
        allow[k] = calloc(ds4_model_tensor_count(mw), sizeof(double));
        for (size_t i = 0; ld && i < ds4_model_tensor_count(mw); i++) {
            const char *tn = NULL;
            CHECK_OK(ds4_model_tensor_at(mw, i, &tn, NULL, &err), &err);
            int li, e;
            int64_t row = -1;
            if (tn && sscanf(tn, "layers.%d.ffn.experts.%d.", &li, &e) == 2) row = li;
            else if (tn && sscanf(tn, "mtp.%d.ffn.experts.%d.", &li, &e) == 2) row = cfg->num_hidden_layers;
            if (row < 0 || (row < cfg->num_hidden_layers && cfg->layer_is_hash[row])) continue; /* hash: fixed */
            const int64_t n = ld[row * cfg->n_routed_experts + e] - before[row * cfg->n_routed_experts + e];
            allow[k][i] = n > 0 ? 2 / sqrt((double)n) : INFINITY;
        }
        free(before);
    }
    /* es[k][i]: how far tensor i's bf16 gradient moves when the computation is disturbed at fp32 rounding level (what
     * the GPU's other summation orders do): the emulation again with every fp32 weight (norms, mHC, router gate, ...)
     * moved by one ulp in a random direction, two such draws, the larger distance */
    const size_t NT = ds4_model_tensor_count(mw);
    double *es[NMODE] = {0};
    {
        float *p = ds4_model_params(mw), *keep = copy_f(p, ds4_model_param_count(mw));
        for (int k = 0; k < NMODE; k++) es[k] = calloc(NT, sizeof(double));
        for (int draw = 0; draw < ES_DRAWS; draw++) {
            for (size_t i = 0; i < NT; i++) {
                ds4_tensor_info info;
                CHECK_OK(ds4_model_tensor_info(mw, i, &info, &err), &err);
                if (!info.is_param || mw->table[i].lowp) continue;
                for (int64_t k = 0; k < info.numel; k++) {
                    float *v = &p[info.offset + k];
                    *v = keep[info.offset + k] * (float)(1 + (urand() < 0.5 ? -1 : 1) * ES_REL);
                }
            }
            ds4_model_params_changed(mw);
            for (int k = 0; k < NMODE; k++) {
                if (!runs[k]) continue;
                float *gp = grads_of(mw, &a, mode_of[k], mtp_of[k], ikl_of[k]);
                for (size_t i = 0; i < NT; i++) {
                    ds4_tensor_info info;
                    CHECK_OK(ds4_model_tensor_info(mw, i, &info, &err), &err);
                    const double e = info.is_param ? rel_t(gp + info.offset, refb[k] + info.offset, info.numel) : 0;
                    es[k][i] = e > es[k][i] ? e : es[k][i];
                }
                free(gp);
            }
        }
        memcpy(p, keep, (size_t)ds4_model_param_count(mw) * sizeof(float));
        ds4_model_params_changed(mw);
        free(keep);
    }
    for (int k = 0; k < 2; k++) {
        const ds4_device_options *dev = k ? &CUDA_BF16 : &CUDA_F32;
        CHECK_OK(ds4_model_to(m, dev, &err), &err);
        for (int j = 0; j < NMODE; j++) {
            if (!runs[j]) continue;
            char what[128];
            float *g = grads_of(m, &a, mode_of[j], mtp_of[j], ikl_of[j]);
            snprintf(what, sizeof what, "%s %s %s", name, dname(dev), mname[j]);
            if (k == 0) /* torch's own gradients exist for ce and mtp (the per-token path has ce's gradient too) */
                compare_grads(m, g, ref[j], j == 3 ? et_mtp : et, NULL, 1e-4, 3.0, j == 2 || j == 4 ? NULL : gf,
                              j == 3 ? "mtp." : "main.", what);
            else
                compare_grads(m, g, refb[j], es[j], allow[j], BF16_FLOOR, BF16_K, NULL, "", what);
            free(g);
        }
        CHECK_OK(ds4_model_to(m, &CPU, &err), &err);
    }
    for (int k = 0; k < NMODE; k++) free(ref[k]), free(refb[k]), free(es[k]), free(allow[k]);
    free(et);
    free(et_mtp);
out:
    ds4_st_close(io);
    ds4_st_close(gf);
    ds4_model_free(m);
    ds4_model_free(mw);
}

/* ------------------------------------------------------------------------------------------------ ops */


/* The optimizer's device ops against the cpu's, bitwise, on three layouts of p, g, m and v (one buffer, stride N):
 * OL_ALIGNED, every tensor on a 16-byte boundary (the kernels' 16-byte path, tails of 1, 2 and 3 elements, a piece
 * shorter than 4); OL_PACKED, tensors packed as a model lays them out, N a multiple of 4 (the 16-byte path after a
 * head of 1 to 3 elements, tensors too short for a group); OL_UNEQUAL, N odd (the four buffers alike modulo 16 bytes
 * nowhere: every element one by one). */
typedef enum { OL_ALIGNED, OL_PACKED, OL_UNEQUAL } opt_layout;
static void optimizer_ops(ds4_engine *eng, opt_layout lay) {
    const int aligned = lay == OL_ALIGNED;
    ds4_error err = {0};
    ds4_dev *gpu = NULL, *cpu = NULL;
    CHECK_OK(ds4_cuda_dev_create(0, &gpu, &err), &err);
    CHECK_OK(ds4_cpu_dev_create(eng->pool, &cpu, &err), &err);
    if (!gpu || !cpu) return;
    enum { NT = 4 };
    /* four tensors of odd sizes (n mod 4 = 1, 2, 3, 3), pieces of at most DS4_OPTIM_CHUNK */
    const int64_t sizes[NT] = {DS4_OPTIM_CHUNK + 77, 6, 3, 2 * DS4_OPTIM_CHUNK + 1003};
    int64_t off[NT], N = 0, np = 0; /* N: the stride of p, g, m and v in buf */
    for (int i = 0; i < NT; i++) {
        off[i] = aligned ? (N + 3) / 4 * 4 : N;
        N = off[i] + sizes[i];
        np += (sizes[i] + DS4_OPTIM_CHUNK - 1) / DS4_OPTIM_CHUNK;
    }
    if (lay != OL_UNEQUAL) N = (N + 3) / 4 * 4;
    ds4_optim_piece *pc = malloc((size_t)np * sizeof *pc);
    for (int i = 0, k = 0; i < NT; i++)
        for (int64_t b = 0; b < sizes[i]; b += DS4_OPTIM_CHUNK)
            pc[k++] = (ds4_optim_piece){off[i] + b, sizes[i] - b < DS4_OPTIM_CHUNK ? sizes[i] - b : DS4_OPTIM_CHUNK, i};
    ds4_adamw_hparams h = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    ds4_adamw_coefs cf[NT];
    for (int i = 0; i < NT; i++) cf[i] = ds4_adamw_coefs_at(&h, 3 + i, 1e-3, i != 1);
    float *buf = malloc((size_t)(4 * N) * 4); /* p, g, m, v; the elements between tensors must stay as they are */
    for (int64_t i = 0; i < 4 * N; i++) buf[i] = (float)(urand() * 2 - 1) * (i >= 3 * N ? 0.01f : 1.0f);
    for (int64_t i = 3 * N; i < 4 * N; i++) buf[i] = fabsf(buf[i]);
    void *d_buf = NULL, *d_pc = NULL, *d_cf = NULL, *d_part = NULL, *d_bad = NULL;
    CHECK_OK(gpu->ops->alloc(gpu, (size_t)(4 * N) * 4, &d_buf, &err), &err);
    CHECK_OK(gpu->ops->alloc(gpu, (size_t)np * sizeof *pc, &d_pc, &err), &err);
    CHECK_OK(gpu->ops->alloc(gpu, sizeof cf, &d_cf, &err), &err);
    CHECK_OK(gpu->ops->alloc(gpu, (size_t)np * 8, &d_part, &err), &err);
    CHECK_OK(gpu->ops->alloc(gpu, (size_t)np * 8, &d_bad, &err), &err);
    CHECK_OK(gpu->ops->upload(gpu, d_pc, pc, (size_t)np * sizeof *pc, &err), &err);
    CHECK_OK(gpu->ops->upload(gpu, d_cf, cf, sizeof cf, &err), &err);
    float *dp = d_buf, *dg = dp + N, *dm = dg + N, *dv = dm + N;
    double *hp = calloc((size_t)np, 8), *gp = calloc((size_t)np, 8);
    OP(cpu, optim_sumsq, .pieces = pc, .n = np, .g = buf + N, .partial = hp);
    CHECK_OK(gpu->ops->upload(gpu, d_buf, buf, (size_t)(4 * N) * 4, &err), &err);
    OP(gpu, optim_sumsq, .pieces = d_pc, .n = np, .g = dg, .partial = d_part);
    ds4_dev_download(gpu, gp, d_part, (size_t)np * 8);
    CHECK_OK(ds4_dev_check(gpu, "sumsq", &err), &err);
    for (int64_t k = 0; k < np; k++)
        CHECK(fabs(gp[k] - hp[k]) <= 1e-12 * hp[k], "optim_sumsq piece %lld: %.17g vs cpu %.17g", (long long)k, gp[k],
              hp[k]);
    /* the check, with an infinite gradient at each piece's last element (a tail where the piece goes by 16 bytes)
     * and, in pieces longer than 8, at its middle: counts of 1 and 2 to find; then the gradients as they were */
    float *g0 = malloc((size_t)N * 4);
    memcpy(g0, buf + N, (size_t)N * 4);
    for (int64_t k = 0; k < np; k++) {
        buf[N + pc[k].off + pc[k].n - 1] = INFINITY;
        if (pc[k].n > 8) buf[N + pc[k].off + pc[k].n / 2] = INFINITY;
    }
    CHECK_OK(gpu->ops->upload(gpu, dg, buf + N, (size_t)N * 4, &err), &err);
    int64_t hb[8] = {0}, gb[8] = {0}; /* np = 7 */
    OP(cpu, adamw, .pieces = pc, .n = np, .coefs = cf, .coef = 0.5f, .p = buf, .g = buf + N, .m = buf + 2 * N,
       .v = buf + 3 * N, .bad = hb, .update = 0);
    OP(gpu, adamw, .pieces = d_pc, .n = np, .coefs = d_cf, .coef = 0.5f, .p = dp, .g = dg, .m = dm, .v = dv,
       .bad = d_bad, .update = 0);
    ds4_dev_download(gpu, gb, d_bad, (size_t)np * 8);
    CHECK_OK(ds4_dev_check(gpu, "adamw check", &err), &err);
    for (int64_t k = 0; k < np; k++)
        CHECK(hb[k] == 1 + (pc[k].n > 8) && gb[k] == hb[k], "adamw check: piece %lld counts %lld, the cpu %lld",
              (long long)k, (long long)gb[k], (long long)hb[k]);
    memcpy(buf + N, g0, (size_t)N * 4);
    CHECK_OK(gpu->ops->upload(gpu, dg, buf + N, (size_t)N * 4, &err), &err);
    free(g0);
    OP(cpu, adamw, .pieces = pc, .n = np, .coefs = cf, .coef = 0.5f, .p = buf, .g = buf + N, .m = buf + 2 * N,
       .v = buf + 3 * N, .update = 1);
    OP(gpu, adamw, .pieces = d_pc, .n = np, .coefs = d_cf, .coef = 0.5f, .p = dp, .g = dg, .m = dm, .v = dv,
       .update = 1);
    float *back = malloc((size_t)(4 * N) * 4);
    ds4_dev_download(gpu, back, d_buf, (size_t)(4 * N) * 4);
    CHECK_OK(ds4_dev_check(gpu, "adamw", &err), &err);
    CHECK(memcmp(back, buf, (size_t)(4 * N) * 4) == 0, "adamw update: the device's p, g, m, v differ from the cpu's");
    {
        /* a ZeRO-1 shard: the last tensor's pieces, their moments alone in a buffer of their own (mo = its offset),
         * against the cpu's update of the whole buffers over the same pieces; coef 1 (no clipping: g only read).
         * OL_ALIGNED: the region starts on a multiple of 4 and v 16-byte aligned after m (the 16-byte path); else the
         * region starts off a multiple of 4 (m, v unlike p, g modulo 16 bytes) and v = m + len (odd) */
        const int64_t k0 = np - 3, mo = off[NT - 1], len = sizes[NT - 1], vo = aligned ? (len + 3) / 4 * 4 : len;
        float *ms = malloc((size_t)(2 * vo) * 4), *mback = malloc((size_t)(2 * vo) * 4);
        memcpy(ms, buf + 2 * N + mo, (size_t)len * 4);
        memcpy(ms + vo, buf + 3 * N + mo, (size_t)len * 4);
        void *d_ms = NULL;
        CHECK_OK(gpu->ops->alloc(gpu, (size_t)(2 * vo) * 4, &d_ms, &err), &err);
        CHECK_OK(gpu->ops->upload(gpu, d_ms, ms, (size_t)(2 * vo) * 4, &err), &err);
        const ds4_optim_piece *d_own = (const ds4_optim_piece *)d_pc + k0;
        OP(cpu, adamw, .pieces = pc + k0, .n = 3, .coefs = cf, .coef = 1.0f, .p = buf, .g = buf + N, .m = buf + 2 * N,
           .v = buf + 3 * N, .update = 1);
        OP(gpu, adamw, .pieces = d_own, .n = 3, .coefs = d_cf, .coef = 1.0f, .p = dp, .g = dg, .m = d_ms,
           .v = (float *)d_ms + vo, .update = 1, .mo = mo);
        ds4_dev_download(gpu, back, d_buf, (size_t)(2 * N) * 4);
        ds4_dev_download(gpu, mback, d_ms, (size_t)(2 * vo) * 4);
        CHECK_OK(ds4_dev_check(gpu, "adamw (shard)", &err), &err);
        CHECK(memcmp(back, buf, (size_t)(2 * N) * 4) == 0, "adamw update of a shard: p, g differ from the cpu's");
        CHECK(memcmp(mback, buf + 2 * N + mo, (size_t)len * 4) == 0 &&
                  memcmp(mback + vo, buf + 3 * N + mo, (size_t)len * 4) == 0,
              "adamw update of a shard: its moments differ from the cpu's");
        gpu->ops->free(gpu, d_ms);
        free(ms);
        free(mback);
    }
    /* cast: bf16 of the first tensor, fp32 of the rest, into a packed destination */
    ds4_cast_entry ce[3] = {{off[0], 0, sizes[0], 1}, {off[1], 2 * sizes[0] + 2, sizes[1], 0},
                            {off[NT - 1], 2 * sizes[0] + 2 + 4 * sizes[1] + 4, sizes[NT - 1], 1}};
    const size_t cbytes = (size_t)(2 * sizes[0] + 2 + 4 * sizes[1] + 4 + 2 * sizes[NT - 1]);
    char *hc = malloc(cbytes), *gc = malloc(cbytes);
    memset(hc, 0x5a, cbytes);
    void *d_c = NULL, *d_ce = NULL;
    CHECK_OK(gpu->ops->alloc(gpu, cbytes, &d_c, &err), &err);
    CHECK_OK(gpu->ops->alloc(gpu, sizeof ce, &d_ce, &err), &err);
    CHECK_OK(gpu->ops->upload(gpu, d_c, hc, cbytes, &err), &err);
    CHECK_OK(gpu->ops->upload(gpu, d_ce, ce, sizeof ce, &err), &err);
    OP(cpu, cast_params, .dst = hc, .src = buf, .e = ce, .n = 3, .mdt = DS4_BF16);
    OP(gpu, cast_params, .dst = d_c, .src = dp, .e = d_ce, .n = 3, .mdt = DS4_BF16);
    ds4_dev_download(gpu, gc, d_c, cbytes);
    CHECK_OK(ds4_dev_check(gpu, "cast", &err), &err);
    CHECK(memcmp(hc, gc, cbytes) == 0, "cast_params: the device's working copy differs from the cpu's");
    {
        /* the update writing the working copy itself (wcast), on the device and on the cpu, against the cpu's
         * update followed by its cast_params (the reference): p, g, m, v and the copy bitwise. Tensor 2 has no copy
         * (dst -1: its bytes stay 0x5a). The bf16 tensors' places are ce's moved by sh bytes: with sh 2, 4, 6 their
         * groups of four land 1, 2, 3 values off 8-byte boundaries (the kernel's element-by-element stores), with sh 0
         * on them */
        for (int sh = 0; sh <= 6; sh += 2) {
            ds4_cast_entry cs[3];
            for (int j = 0; j < 3; j++) /* the fp32 tensor (1) moved by 4 bytes: 4-aligned, 16-aligned nowhere */
                cs[j] = ce[j], cs[j].dst += j == 0 ? sh : j == 1 ? 4 : sh + 4;
            const size_t wb = cbytes + 12;
            ds4_optim_wcast *wc = malloc((size_t)np * sizeof *wc);
            for (int64_t k = 0; k < np; k++) {
                wc[k] = (ds4_optim_wcast){-1, 0};
                for (int j = 0; j < 3; j++)
                    if (pc[k].off >= cs[j].src && pc[k].off < cs[j].src + cs[j].n)
                        wc[k] = (ds4_optim_wcast){cs[j].dst + (pc[k].off - cs[j].src) * (cs[j].lowp ? 2 : 4),
                                                  cs[j].lowp};
            }
            char *ref = malloc(wb), *hw = malloc(wb), *gw = malloc(wb);
            memset(ref, 0x5a, wb), memset(hw, 0x5a, wb);
            float *hb2 = malloc((size_t)(4 * N) * 4);
            memcpy(hb2, buf, (size_t)(4 * N) * 4);
            CHECK_OK(gpu->ops->upload(gpu, d_buf, buf, (size_t)(4 * N) * 4, &err), &err);
            OP(cpu, adamw, .pieces = pc, .n = np, .coefs = cf, .coef = 0.5f, .p = buf, .g = buf + N, .m = buf + 2 * N,
               .v = buf + 3 * N, .update = 1);
            OP(cpu, cast_params, .dst = ref, .src = buf, .e = cs, .n = 3, .mdt = DS4_BF16);
            OP(cpu, adamw, .pieces = pc, .n = np, .coefs = cf, .coef = 0.5f, .p = hb2, .g = hb2 + N,
               .m = hb2 + 2 * N, .v = hb2 + 3 * N, .update = 1, .wdst = hw, .wcast = wc, .wdt = DS4_BF16);
            void *d_w = NULL, *d_wc = NULL;
            CHECK_OK(gpu->ops->alloc(gpu, wb, &d_w, &err), &err);
            CHECK_OK(gpu->ops->alloc(gpu, (size_t)np * sizeof *wc, &d_wc, &err), &err);
            memset(gw, 0x5a, wb);
            CHECK_OK(gpu->ops->upload(gpu, d_w, gw, wb, &err), &err);
            CHECK_OK(gpu->ops->upload(gpu, d_wc, wc, (size_t)np * sizeof *wc, &err), &err);
            OP(gpu, adamw, .pieces = d_pc, .n = np, .coefs = d_cf, .coef = 0.5f, .p = dp, .g = dg, .m = dm, .v = dv,
               .update = 1, .wdst = d_w, .wcast = d_wc, .wdt = DS4_BF16);
            ds4_dev_download(gpu, back, d_buf, (size_t)(4 * N) * 4);
            ds4_dev_download(gpu, gw, d_w, wb);
            CHECK_OK(ds4_dev_check(gpu, "adamw with the working copy", &err), &err);
            CHECK(memcmp(back, buf, (size_t)(4 * N) * 4) == 0 && memcmp(hb2, buf, (size_t)(4 * N) * 4) == 0,
                  "adamw with the working copy (shift %d): p, g, m, v differ from the update without it", sh);
            CHECK(memcmp(hw, ref, wb) == 0, "adamw with the working copy (shift %d): the cpu's copy differs from "
                  "cast_params after the update", sh);
            CHECK(memcmp(gw, ref, wb) == 0, "adamw with the working copy (shift %d): the device's copy differs from "
                  "the cpu's cast_params after the update", sh);
            gpu->ops->free(gpu, d_w);
            gpu->ops->free(gpu, d_wc);
            free(wc), free(ref), free(hw), free(gw), free(hb2);
        }
    }
    printf("  optimizer ops (%s): %lld pieces, check, update, cast and the update writing the copy bitwise equal to "
           "the cpu\n",
           lay == OL_ALIGNED ? "16-byte aligned" : lay == OL_PACKED ? "packed" : "unequally aligned", (long long)np);
    gpu->ops->free(gpu, d_buf);
    gpu->ops->free(gpu, d_pc);
    gpu->ops->free(gpu, d_cf);
    gpu->ops->free(gpu, d_part);
    gpu->ops->free(gpu, d_bad);
    gpu->ops->free(gpu, d_c);
    gpu->ops->free(gpu, d_ce);
    ds4_dev_release(gpu);
    ds4_dev_release(cpu);
    free(pc);
    free(buf);
    free(back);
    free(hp);
    free(gp);
    free(hc);
    free(gc);
}

/* ------------------------------------------------------------------------------------------------ trajectory */

static ds4_adamw_options fixture_opts(void) {
    return (ds4_adamw_options){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                               .clip = 1.0, .schedule = DS4_LR_COSINE, .warmup_steps = 3, .total_steps = 10,
                               .min_lr_ratio = 0.1};
}

static void trajectory(ds4_engine *eng, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_st_file *io = NULL, *tr = NULL;
    ds4_adamw *opt = NULL;
    ds4_forward_args args;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &args)) return;
    CHECK_OK(ds4_st_open(ds4t_path(fixtures, "tiny_a/train.safetensors"), &tr, &err), &err);
    const ds4_st_entry *rl = tr ? ds4_st_find(tr, "loss") : NULL, *rn = tr ? ds4_st_find(tr, "grad_norm") : NULL;
    CHECK(rl && rn && rl->dtype == DS4_F64 && rl->shape[0] == 11 && rn->shape[0] == 10, "train.safetensors");
    if (!rl || !rn || rl->dtype != DS4_F64 || rl->shape[0] != 11 || rn->shape[0] != 10) goto out;
    double ref_loss[11], ref_norm[10];
    memcpy(ref_loss, rl->data, sizeof ref_loss);
    memcpy(ref_norm, rn->data, sizeof ref_norm);
    CHECK_OK(ds4_model_to(m, &CUDA_F32, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_adamw_options o = fixture_opts();
    CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
    double worst_loss = 0, worst_norm = 0;
    for (int k = 0; opt && k <= 10; k++) {
        ds4_forward_result res;
        memset(&res, 0, sizeof res);
        if (k == 10) {
            CHECK_OK(ds4_model_forward(m, &args, &res, &err), &err);
        } else {
            ds4_model_zero_grad(m);
            ds4_status s = ds4_model_forward_train(m, &args, &res, &err);
            CHECK(s == DS4_OK, "step %d: forward_train: %s", k, err.msg);
            if (s) break;
        }
        const double el = fabs(res.loss - ref_loss[k]) / fabs(ref_loss[k]);
        worst_loss = el > worst_loss || isnan(el) ? el : worst_loss;
        CHECK(el <= 1e-5, "cuda loss %d: %.9g vs torch %.9g (rel %.3g > 1e-5)", k, res.loss, ref_loss[k], el);
        if (k == 10) break;
        ds4_status s = ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err);
        CHECK(s == DS4_OK, "step %d: backward: %s", k, err.msg);
        if (s) break;
        ds4_adamw_stats st;
        CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
        const double en = fabs(st.grad_norm - ref_norm[k]) / ref_norm[k];
        worst_norm = en > worst_norm || isnan(en) ? en : worst_norm;
        CHECK(en <= 1e-4, "cuda step %d: grad norm %.9g vs torch %.9g (rel %.3g > 1e-4)", k, st.grad_norm,
              ref_norm[k], en);
    }
    printf("  cuda fp32 trajectory: losses max rel err %.3g (bound 1e-5), grad norms %.3g (bound 1e-4)\n", worst_loss,
           worst_norm);
out:
    ds4_adamw_free(opt);
    ds4_st_close(io);
    ds4_st_close(tr);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------------------------------------ determinism */

/* `steps` updates of tiny_a on `dev` from the checkpoint's weights with the fixture batch; weights and moments out
 * (host copies). start: weights / moments / tensor steps / step count to resume from (NULL: fresh). zero_grad: the
 * optimizer told so (ds4_adamw_options.zero_grad: its update pass zeroes the gradients it reads, and the frozen
 * tensors' after it); every step then leaves the whole gradient buffer zero (checked). */
typedef struct train_state {
    float *p, *m, *v;
    int64_t *tsteps, steps;
    size_t nt;
} train_state;

static void state_free(train_state *s) {
    free(s->p);
    free(s->m);
    free(s->v);
    free(s->tsteps);
    memset(s, 0, sizeof *s);
}

static train_state run_steps(ds4_engine *eng, const char *fixtures, const ds4_device_options *dev, int steps,
                             const train_state *start, int zero_grad) {
    train_state out = {0};
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_adamw *opt = NULL;
    ds4_forward_args args;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &args)) return out;
    const int64_t P = ds4_model_param_count(m);
    if (start) { /* what a checkpoint restores: the weights through the host, then the optimizer's state */
        memcpy(ds4_model_params(m), start->p, (size_t)P * 4);
        ds4_model_params_changed(m);
    }
    CHECK_OK(ds4_model_to(m, dev, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_adamw_options o = fixture_opts();
    o.zero_grad = zero_grad;
    CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
    if (!opt) goto out;
    ds4_adamw_state st;
    if (start) {
        ds4_adamw_get_state(opt, &st);
        memcpy(st.m, start->m, (size_t)P * 4);
        memcpy(st.v, start->v, (size_t)P * 4);
        memcpy(st.tensor_steps, start->tsteps, start->nt * sizeof *st.tensor_steps);
        *st.steps = start->steps;
        ds4_adamw_state_changed(opt);
    }
    for (int k = 0; k < steps; k++) {
        ds4_forward_result res;
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
        CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
        if (!zero_grad) continue;
        const float *g = ds4_model_grads(m); /* read back from the device */
        int64_t nz = 0;
        for (int64_t i = 0; g && i < P; i++) nz += g[i] != 0 || signbit(g[i]);
        CHECK(g && nz == 0, "%s, zero_grad: %lld of %lld gradients not +0 after step %d", dname(dev), (long long)nz,
              (long long)P, k);
    }
    CHECK_OK(ds4_adamw_sync_state(opt, &err), &err);
    ds4_adamw_get_state(opt, &st);
    out.p = copy_f(ds4_model_params(m), P);
    out.m = copy_f(st.m, P);
    out.v = copy_f(st.v, P);
    out.nt = st.n_tensors;
    out.tsteps = malloc(st.n_tensors * sizeof *out.tsteps);
    memcpy(out.tsteps, st.tensor_steps, st.n_tensors * sizeof *out.tsteps);
    out.steps = *st.steps;
out:
    ds4_adamw_free(opt);
    ds4_st_close(io);
    ds4_model_free(m);
    return out;
}

static int same_state(const train_state *a, const train_state *b, int64_t P) {
    return a->p && b->p && memcmp(a->p, b->p, (size_t)P * 4) == 0 && memcmp(a->m, b->m, (size_t)P * 4) == 0 &&
           memcmp(a->v, b->v, (size_t)P * 4) == 0 && a->steps == b->steps && a->nt == b->nt &&
           memcmp(a->tsteps, b->tsteps, a->nt * sizeof *a->tsteps) == 0;
}

static void determinism(ds4_engine *eng, const char *fixtures, const ds4_device_options *dev) {
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args args;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &args)) return;
    const int64_t P = ds4_model_param_count(m);
    ds4_st_close(io);
    ds4_model_free(m);
    train_state a = run_steps(eng, fixtures, dev, 4, NULL, 0), b = run_steps(eng, fixtures, dev, 4, NULL, 0);
    CHECK(same_state(&a, &b, P), "%s: two runs of 4 steps differ", dname(dev));
    train_state h = run_steps(eng, fixtures, dev, 2, NULL, 0);
    train_state r = run_steps(eng, fixtures, dev, 2, &h, 0);
    CHECK(same_state(&a, &r, P), "%s: 2 steps + resume + 2 steps differ from 4 steps", dname(dev));
    /* the optimizer zeroing the gradients in its pass: the same steps (zero_grad before each forward then finds the
     * buffer zero and skips its fill) */
    train_state z = run_steps(eng, fixtures, dev, 4, NULL, 1);
    CHECK(same_state(&a, &z, P), "%s: 4 steps with the optimizer's zero_grad differ from 4 steps", dname(dev));
    printf("  %s: two runs bitwise equal: %s; resume bitwise equal: %s; zero_grad in the update: %s\n", dname(dev),
           same_state(&a, &b, P) ? "yes" : "NO", same_state(&a, &r, P) ? "yes" : "NO",
           same_state(&a, &z, P) ? "yes" : "NO");
    state_free(&a);
    state_free(&z);
    state_free(&b);
    state_free(&h);
    state_free(&r);
}

/* ------------------------------------------------------------------------------------------------ moves */

static void moves(ds4_engine *eng, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = NULL, *c = NULL;
    ds4_st_file *io = NULL, *io2 = NULL;
    ds4_adamw *opt = NULL, *copt = NULL;
    ds4_forward_args args, args2;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &args)) return;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &c, &io2, &args2)) goto out;
    const int64_t P = ds4_model_param_count(m);
    /* the router-bias update on the device against the CPU's: one step each with gamma on */
    ds4_train_options to = {.router_bias_gamma = 1e-3};
    ds4_adamw_options o = fixture_opts();
    for (int side = 0; side < 2; side++) {
        ds4_model *x = side ? m : c;
        if (side) CHECK_OK(ds4_model_to(x, &CUDA_F32, &err), &err);
        CHECK_OK(ds4_model_set_train_options(x, &to, &err), &err);
        CHECK_OK(ds4_model_enable_grad(x, &err), &err);
        CHECK_OK(ds4_adamw_create(x, &o, side ? &opt : &copt, &err), &err);
        ds4_forward_result res;
        CHECK_OK(ds4_model_forward_train(x, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(x, 1.0 / (double)res.loss_tokens, &err), &err);
        CHECK_OK(ds4_adamw_step(side ? opt : copt, NULL, &err), &err);
    }
    if (!opt || !copt) goto out;
    const float *pc = ds4_model_params(c), *pm = ds4_model_params(m);
    CHECK(pm != NULL, "params of a device-trained model readable");
    double worst = 0, worst_bias = 0;
    for (size_t i = 0; pm && i < ds4_model_tensor_count(m); i++) {
        ds4_tensor_info info;
        const char *name;
        CHECK_OK(ds4_model_tensor_info(m, i, &info, &err), &err);
        CHECK_OK(ds4_model_tensor_at(m, i, &name, NULL, &err), &err);
        if (!info.is_param) continue;
        const double e = rel_t(pm + info.offset, pc + info.offset, info.numel);
        if (strstr(name, "gate.bias")) worst_bias = fmax(worst_bias, e);
        else worst = fmax(worst, e);
    }
    /* one update of lr <= 1e-3 from gradients 1e-4 apart moves weights by far less than that relative; the biases
     * move by ±gamma from counts of routed tokens, which must agree exactly unless a routing tie flipped */
    CHECK(worst <= 1e-4 && worst_bias <= 1e-6, "one step on cuda vs cpu: weights %.3g, router biases %.3g", worst,
          worst_bias);
    printf("  one step with the router-bias update, cuda vs cpu: weights %.3g, biases %.3g\n", worst, worst_bias);
    /* a refused step leaves the device's state alone */
    {
        float *before = copy_f(ds4_model_params(m), P);
        ds4_adamw_options huge = fixture_opts();
        huge.lr = 1e38;
        huge.schedule = DS4_LR_CONSTANT;
        huge.warmup_steps = 0;
        ds4_adamw *bad = NULL;
        CHECK_OK(ds4_adamw_create(m, &huge, &bad, &err), &err);
        ds4_forward_result res;
        CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
        ds4_status s = ds4_adamw_step(bad, NULL, &err);
        CHECK(s == DS4_ERR_ARG && strstr(err.msg, "non-finite"), "lr 1e38 on the device: %s (%s)", ds4_status_name(s),
              err.msg);
        CHECK(ds4_adamw_steps(bad) == 0, "refused step counted");
        const float *after = ds4_model_params(m);
        CHECK(after && memcmp(before, after, (size_t)P * 4) == 0, "a refused device step changed the weights");
        ds4_adamw_free(bad);
        free(before);
    }
    /* train on, then move to the CPU: the weights and the moments come home, and training continues there */
    {
        ds4_forward_result res;
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
        CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
        ds4_adamw_state st;
        CHECK_OK(ds4_adamw_sync_state(opt, &err), &err);
        ds4_adamw_get_state(opt, &st);
        float *pd = copy_f(ds4_model_params(m), P), *md = copy_f(st.m, P);
        CHECK_OK(ds4_model_to(m, &CPU, &err), &err);
        CHECK(memcmp(pd, ds4_model_params(m), (size_t)P * 4) == 0, "weights after the move to the cpu");
        ds4_adamw_get_state(opt, &st);
        CHECK(memcmp(md, st.m, (size_t)P * 4) == 0, "moments after the move to the cpu");
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
        CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
        CHECK(ds4_adamw_steps(opt) == 3, "steps after the move: %lld", (long long)ds4_adamw_steps(opt));
        CHECK_OK(ds4_model_to(m, &CUDA_BF16, &err), &err); /* and back, in bf16 */
        ds4_model_zero_grad(m);
        CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
        CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
        CHECK(isfinite(res.loss), "bf16 loss after moves %g", res.loss);
        free(pd);
        free(md);
    }
out:
    ds4_adamw_free(opt);
    ds4_adamw_free(copt);
    ds4_st_close(io);
    ds4_st_close(io2);
    ds4_model_free(m);
    ds4_model_free(c);
}

/* Per-block recomputation on the device: the same bits as keeping every block's activations (the GPU's operations are
 * deterministic, and the recomputed blocks reuse the forward's routing and picks), for CE with MTP and the indexer-KL
 * option, in fp32 and bf16. In bf16 also the tape's inputs of bf16 products kept in fp32 (model tape_f32) instead of
 * bf16 (ds4_tape.x16, the default): the products round them as they read them, so the same bits again. */
static void recompute_gpu(ds4_engine *eng, const char *fixtures, const char *name, const ds4_device_options *dev) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args a;
    if (ds4t_load_fixture(eng, fixtures, name, &m, &io, &a)) return;
    CHECK_OK(ds4_model_to(m, dev, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    const int64_t P = ds4_model_param_count(m);
    static const char *const vname[3] = {"", "recomputation", "fp32 tape"};
    const int nv = dev->dtype == DS4_BF16 ? 3 : 2;
    float *g[3] = {0};
    double loss[3] = {0};
    for (int k = 0; k < nv; k++) {
        ds4_train_options o = {.mtp_lambda = ds4_model_has_mtp(m) ? 0.3 : 0,
                               .indexer_kl = ds4_model_config(m)->index_topk > 0 ? 1.0 : 0, .recompute = k == 1};
        CHECK_OK(ds4_model_set_train_options(m, &o, &err), &err);
        m->tape_f32 = k == 2;
        ds4_model_zero_grad(m);
        ds4_forward_result r;
        CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
        loss[k] = r.loss;
        const float *gg = ds4_model_grads(m);
        g[k] = copy_f(gg, P);
        CHECK(gg != NULL, "gradients readable");
    }
    m->tape_f32 = 0;
    for (int k = 1; k < nv; k++) {
        int64_t diff = 0;
        for (int64_t i = 0; g[0] && g[k] && i < P; i++) diff += memcmp(&g[0][i], &g[k][i], 4) != 0;
        CHECK(diff == 0 && memcmp(&loss[0], &loss[k], sizeof(double)) == 0,
              "%s %s: %s changed %lld of %lld gradient values (loss %.9g vs %.9g)", name, dname(dev), vname[k],
              (long long)diff, (long long)P, loss[k], loss[0]);
        printf("  %-8s %s %s: %lld gradient values differ, loss %s\n", name, dname(dev), vname[k], (long long)diff,
               loss[0] == loss[k] ? "equal" : "differs");
    }
    for (int k = 0; k < nv; k++) free(g[k]);
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    int n = 0;
    ds4_error err = {0};
    if (ds4_cuda_device_count(&n, &err) || n == 0) {
        printf("test_cuda_train: skipped (no CUDA device)\n");
        return 77;
    }
    ds4_engine *eng = NULL;
    ds4_engine_options o = {.n_threads = 4};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    if (!eng) return ds4t_finish("test_cuda_train");
    optimizer_ops(eng, OL_ALIGNED);
    optimizer_ops(eng, OL_PACKED);
    optimizer_ops(eng, OL_UNEQUAL);
    const char *only = getenv("DS4_TEST_ONLY"); /* a stage by name while the backward ops are being brought up */
    if (!only || strstr(only, "grads")) {
        gradients(eng, fixtures, "tiny_a");
        gradients(eng, fixtures, "tiny_b");
        gradients(eng, fixtures, "tiny_hf");
    }
    if (!only || strstr(only, "trajectory")) trajectory(eng, fixtures);
    if (!only || strstr(only, "determinism")) {
        determinism(eng, fixtures, &CUDA_F32);
        determinism(eng, fixtures, &CUDA_BF16);
    }
    if (!only || strstr(only, "moves")) moves(eng, fixtures);
    if (!only || strstr(only, "recompute"))
        for (int k = 0; k < 2; k++) {
            recompute_gpu(eng, fixtures, "tiny_a", k ? &CUDA_BF16 : &CUDA_F32);
            recompute_gpu(eng, fixtures, "tiny_b", k ? &CUDA_BF16 : &CUDA_F32);
        }
    ds4_engine_free(eng);
    return ds4t_finish("test_cuda_train");
}
#else
int main(void) {
    printf("test_cuda_train: skipped (built without CUDA)\n");
    return 77;
}
#endif
