/* test_cp_device.c — context parallelism of a model whose memory the host cannot read (the path a CUDA model takes,
 * core/cp.c) on a machine without a GPU: each rank is a thread whose model sits on a host-invisible twin of the CPU
 * backend (twin_device.h), so the attention rows go through the device hook (device_all_gather) into the pass's planned
 * scratch and are placed with backend copies, the rows a rank keeps move through that scratch, and the losses, the
 * ranks' notes and their failure flags take the host hook. The hooks are collectives over shared memory. The
 * reference is one CPU model (host memory) on the whole sequences.
 *
 * tiny_a (a sliding, two CSA and an HCA layer; the MTP block on, λ = 0.3), two sequences of 19 with three labels -100,
 * split 10 + 9 over 2 ranks and 7 + 6 + 6 over 3 (slice boundaries inside compressor windows), each world split by
 * query (the default) and with whole_attention. Two steps: the loss's backward, then backward_logprobs with
 * dlogp = -1/N at this rank's scored positions. What must hold (as in tests/lua/dist_context_parallel.lua, which runs
 * the host path over real ranks): the losses and counts bitwise on every rank; log-probabilities max |Δ| = 0; whole:
 * the attention weights' gradients summed over the ranks in rank order (the all-reduce's order) bitwise, every other
 * gradient within 2e-6 per tensor, relative to Σ_r ‖rank r's part‖ (each rank sums its own rows, the sum over ranks
 * groups the same fp32 terms per rank: docs/distributed.md, "Context parallelism"; the parts can cancel, so the bound
 * is on the terms' scale, not the result's); split by query: every gradient within 1e-5 so (the key side's gradients
 * are each rank's queries' parts, summed over the ranks through the device hook and a backend colsum_add). The twin's
 * kernels are the CPU's, so every bit that differs from the reference's would be the device path moving a row
 * wrongly. The device hook must have run once per attention sub-layer of each pass (L + 1 forward) and, in the
 * backward, once per sub-layer (whole) or once per sub-layer plus once per sub-layer with entries (split), the MTP
 * block's left out in step 2. Refused: a twin model without the device hook, or with it set up for another device.
 * A device failure inside one rank's pass fails every rank's pass, none waiting on another (run_failure).
 *
 * Where there is a GPU, all of it again with every rank's model, and the reference, on GPU 0 (the CUDA kernels, their
 * query windows and the backend's colsum_add; the device hook copies between the ranks' device buffers), in fp32
 * (the same bounds: the forward kernels are batch invariant, and with whole attention the backward's products on
 * tiny_a's shapes order their sums by the reduction length alone) and in bf16 (losses, counts and log-probabilities
 * still bitwise; every gradient within 2^-8, bf16's unit roundoff: tests/lua/dist_context_parallel.lua says why).
 * Without one those runs say they are skipped. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin_device.h"
#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#endif

enum { B = 2, S = 19, MAXW = 3, STEPS = 2 };

/* Where the ranks' models compute: host-invisible twins of the CPU backend (the reference a CPU model), or a CUDA
 * device (every rank's model on GPU 0, the reference too) in fp32 or bf16. */
typedef struct cp_mode {
    const char *name;
    ds4_device_options cuda;      /* type DS4_DEVICE_CPU: the twins */
} cp_mode;

typedef struct shared {
    pthread_barrier_t bar;
    const void *buf[MAXW];
} shared;

typedef struct rank_ctx {
    const cp_mode *md;
    shared *sh;
    int32_t rank, world;
    int64_t off, n;               /* this rank's positions [off, off + n) */
    ds4_model *m;
    const int64_t *ids, *labels;  /* [B, S], the whole sequences */
    ds4_forward_result out[STEPS];
    float *lp[STEPS];             /* [B, n] */
    float *g[STEPS];              /* [params] this rank's gradients */
    int64_t dev_count;            /* device gathers so far */
    int64_t dev_calls[STEPS];     /* device gathers of each step */
    int64_t P;
    int failed;
    char msg[1024];
    /* once (run_once): one training forward and its backward, their statuses and messages */
    ds4_status fst, bst;
    char fmsg[1024], bmsg[1024];
    double loss;
} rank_ctx;

/* world threads: each publishes send, then copies every rank's into recv in rank order */
static ds4_status gather_shared(rank_ctx *c, const void *send, void *recv, size_t bytes) {
    c->sh->buf[c->rank] = send;
    pthread_barrier_wait(&c->sh->bar);
    for (int32_t q = 0; q < c->world; q++) memcpy((char *)recv + (size_t)q * bytes, c->sh->buf[q], bytes);
    pthread_barrier_wait(&c->sh->bar); /* nobody's send is reused before everyone has read it */
    return DS4_OK;
}

static ds4_status host_gather(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    (void)err;
    return gather_shared(ctx, send, recv, bytes);
}

/* The device hook, counted. The twin's memory is host memory underneath, so it moves it the same way. On a GPU
 * every rank's model is on the same device: each rank copies the others' blocks with its backend's device copies
 * (every send is complete: cp.c synchronizes a rank's backend before its gather) and waits for them before the
 * barrier that lets the senders reuse their buffers. */
static ds4_status device_gather(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    rank_ctx *c = ctx;
    c->dev_count++;
    if (c->md->cuda.type != DS4_DEVICE_CUDA) return gather_shared(c, send, recv, bytes);
    c->sh->buf[c->rank] = send;
    pthread_barrier_wait(&c->sh->bar);
    ds4_dev *d = c->m->dev;
    for (int32_t q = 0; q < c->world; q++) ds4_dev_copy(d, (char *)recv + (size_t)q * bytes, c->sh->buf[q], bytes);
    const ds4_status st = d->st ? ds4_fail(err, d->st, "rank %d: copying the ranks' blocks", c->rank)
                                : d->ops->sync(d, err);
    pthread_barrier_wait(&c->sh->bar);
    return st;
}

/* The rank's model onto its device (after its training options: the twin binds its gradients there); the backend
 * whose operations run_failure replaces, or NULL. */
static ds4_dev *attach(const cp_mode *md, ds4_engine *e, ds4_model *m) {
    if (md->cuda.type != DS4_DEVICE_CUDA) return twin_attach(e, m);
    ds4_error err = {0};
    const ds4_status s = ds4_model_to(m, &md->cuda, &err);
    CHECK_OK(s, &err);
    return s ? NULL : m->dev;
}

static void detach(const cp_mode *md, ds4_model *m, ds4_dev *d) {
    if (d && md->cuda.type != DS4_DEVICE_CUDA) twin_detach(m, d);
}

/* -1/N at every scored position of rows [off, off + n) of each sequence (N: the whole batch's scored count) */
static void dlogp_slice(const int64_t *labels, int64_t N, int64_t off, int64_t n, float *g) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = off + i;
            g[b * n + i] = s + 1 < S && labels[b * S + s + 1] != -100 ? (float)(-1.0 / (double)N) : 0.0f;
        }
}

static int run_steps(ds4_model *m, const int64_t *ids, const int64_t *labels, int64_t off, int64_t n,
                     ds4_forward_result *out, float **lp, float **g, int64_t P, const int64_t *count, int64_t *calls,
                     char *msg) {
    ds4_error err = {0};
    const ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .labels = labels};
    float *dl = malloc((size_t)(B * n) * sizeof *dl);
    ds4_status s = dl ? DS4_OK : DS4_ERR_OOM;
    for (int k = 0; k < STEPS && !s; k++) {
        const int64_t before = count ? *count : 0;
        ds4_model_zero_grad(m);
        s = ds4_model_forward_train(m, &a, &out[k], &err);
        if (!s) s = ds4_model_logprobs(m, lp[k], NULL, &err);
        if (!s && k == 0) s = ds4_model_backward(m, 1.0 / (double)out[k].loss_tokens, &err);
        if (!s && k == 1) {
            dlogp_slice(labels, out[k].loss_tokens, off, n, dl);
            s = ds4_model_backward_logprobs(m, dl, &err);
        }
        const float *gh = s ? NULL : ds4_model_grads(m);
        if (!s && !gh) s = ds4_fail(&err, DS4_ERR_INTERNAL, "reading the gradients back");
        if (!s) memcpy(g[k], gh, (size_t)P * sizeof(float));
        if (calls) calls[k] = *count - before;
    }
    free(dl);
    if (s) snprintf(msg, 1024, "%s", err.msg);
    return s != DS4_OK;
}

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    c->failed = run_steps(c->m, c->ids, c->labels, c->off, c->n, c->out, c->lp, c->g, c->P, &c->dev_count, c->dev_calls,
                          c->msg);
    if (c->failed) fprintf(stderr, "rank %d of %d: %s\n", c->rank, c->world, c->msg); /* the others may then wait:
                                                                                        the test's timeout names it */
    return NULL;
}

static void *run_once(void *arg) {
    rank_ctx *c = arg;
    ds4_error err = {0};
    const ds4_forward_args a = {.ids = c->ids, .batch = B, .seq = S, .labels = c->labels};
    ds4_forward_result out = {0};
    ds4_model_zero_grad(c->m);
    c->fst = ds4_model_forward_train(c->m, &a, &out, &err);
    snprintf(c->fmsg, sizeof c->fmsg, "%s", c->fst ? err.msg : "");
    c->loss = out.loss;
    c->bst = ds4_model_backward(c->m, c->fst ? 1.0 : 1.0 / (double)out.loss_tokens, &err);
    snprintf(c->bmsg, sizeof c->bmsg, "%s", c->bst ? err.msg : "");
    return NULL;
}

/* an attention operation that fails (a device error inside a pass) */
static void failing_attention(ds4_dev *d, const ds4_a_attention *a) {
    (void)a;
    ds4_dev_fail(d, DS4_ERR_CUDA, "attention: injected failure");
}

static int has(const char *name, const char *part) { return strstr(name, part) != NULL; }

/* Rank q's positions: the contiguous shard (S / world each, the first S % world one more). */
static void shard(int32_t q, int32_t world, int64_t *off, int64_t *n) {
    const int64_t base = S / world, extra = S % world;
    *off = q * base + (q < extra ? q : extra);
    *n = base + (q < extra);
}

static void run_world(const cp_mode *md, const char *dir, int32_t world, int whole, const ds4_model *ref,
                      const int64_t *ids, const int64_t *labels, ds4_forward_result *rout, float **rlp, float **rg) {
    ds4_error err = {0};
    const ds4_train_options topt = {.mtp_lambda = 0.3};
    shared sh;
    pthread_barrier_init(&sh.bar, NULL, (unsigned)world);
    rank_ctx ctx[MAXW];
    ds4_engine *te[MAXW] = {NULL};
    ds4_dev *dv[MAXW] = {NULL};
    memset(ctx, 0, sizeof ctx);
    const int64_t P = ds4_model_param_count(ref);
    const int64_t L = ref->cfg.num_hidden_layers;
    int64_t with_entries = 0; /* the main blocks' compressed layers (entries at S = 19); the MTP block's is sliding */
    for (int64_t li = 0; li < L; li++) with_entries += ref->w.layers[li].type != DS4_ATTN_SLIDING;
    /* fp32 with whole attention: rank 0's attention backward on bitwise output gradients, bitwise; bf16: a GPU's
     * backward products may order their sums by the row count (a slice is not the whole sequence), so an activation
     * gradient may round to another bf16 value where it enters a product */
    const int bf16 = md->cuda.type == DS4_DEVICE_CUDA && md->cuda.dtype == DS4_BF16;
    const int attn_bitwise = whole && !bf16;
    const double tol = bf16 ? 0x1p-8 : whole ? 2e-6 : 1e-5;
    char tag[160];
    snprintf(tag, sizeof tag, "%s, %d ranks, %s", md->name, world, whole ? "whole attention" : "split by query");
    const ds4_engine_options teo = {.n_threads = 1};
    int ready = 1;
    for (int32_t r = 0; r < world; r++) {
        rank_ctx *c = &ctx[r];
        c->md = md, c->sh = &sh, c->rank = r, c->world = world, c->ids = ids, c->labels = labels, c->P = P;
        shard(r, world, &c->off, &c->n);
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err); /* a rank's own pool: ranks run at once */
        if (te[r]) CHECK_OK(ds4_model_load(te[r], dir, &c->m, &err), &err);
        if (!c->m || !te[r]) {
            ready = 0;
            continue;
        }
        CHECK_OK(ds4_model_enable_grad(c->m, &err), &err);
        CHECK_OK(ds4_model_set_train_options(c->m, &topt, &err), &err);
        dv[r] = attach(md, te[r], c->m);
        for (int k = 0; k < STEPS; k++) {
            c->lp[k] = malloc((size_t)(B * c->n) * sizeof(float));
            c->g[k] = malloc((size_t)P * sizeof(float));
            ready &= c->lp[k] && c->g[k];
        }
        if (!dv[r]) {
            ready = 0;
            continue;
        }
        const int32_t at = md->cuda.type == DS4_DEVICE_CUDA ? md->cuda.index : -1;
        ds4_context_parallel cp = {.rank = r, .world = world, .device = at, .ctx = c, .all_gather = host_gather,
                                   .whole_attention = whole};
        CHECK_STATUS(ds4_model_set_context_parallel(c->m, &cp, &err), DS4_ERR_UNSUPPORTED, &err);
        CHECK(strstr(err.msg, "device_all_gather") != NULL, "refused without the device hook: %s", err.msg);
        cp.device_all_gather = device_gather;
        cp.device = at + 1; /* the twin is no CUDA device; the GPU model is not on the next one */
        CHECK_STATUS(ds4_model_set_context_parallel(c->m, &cp, &err), DS4_ERR_ARG, &err);
        cp.device = at;
        CHECK_OK(ds4_model_set_context_parallel(c->m, &cp, &err), &err);
    }
    if (ready) {
        pthread_t th[MAXW];
        for (int32_t r = 0; r < world; r++) pthread_create(&th[r], NULL, rank_main, &ctx[r]);
        for (int32_t r = 0; r < world; r++) pthread_join(th[r], NULL);
    }
    for (int32_t r = 0; ready && r < world; r++) ready &= !ctx[r].failed;
    CHECK(ready, "%s: every rank ran its steps", tag);
    double worst = 0;
    int64_t attn_tensors = 0, other_tensors = 0;
    float *sum = malloc((size_t)P * sizeof *sum);
    for (int k = 0; ready && sum && k < STEPS; k++) {
        for (int32_t r = 0; r < world; r++) {
            const rank_ctx *c = &ctx[r];
            const ds4_forward_result *o = &c->out[k], *q = &rout[k];
            CHECK(o->loss == q->loss && o->mtp_loss == q->mtp_loss, "%s, step %d, rank %d: loss %.17g / %.17g, "
                  "MTP %.17g / %.17g: bitwise", tag, k + 1, r, o->loss, q->loss, o->mtp_loss, q->mtp_loss);
            CHECK(o->loss_tokens == q->loss_tokens && o->mtp_loss_tokens == q->mtp_loss_tokens,
                  "%s, step %d, rank %d: counts %lld, %lld (want %lld, %lld)", tag, k + 1, r,
                  (long long)o->loss_tokens, (long long)o->mtp_loss_tokens, (long long)q->loss_tokens,
                  (long long)q->mtp_loss_tokens);
            double d = 0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < c->n; i++) {
                    const double x = fabs((double)c->lp[k][b * c->n + i] - (double)rlp[k][b * S + c->off + i]);
                    if (!(x <= d)) d = x; /* NaN sticks */
                }
            CHECK(d == 0, "%s, step %d, rank %d: log-probabilities of positions %lld..%lld max |d| %g", tag,
                  k + 1, r, (long long)c->off, (long long)(c->off + c->n - 1), d);
            /* each attention sub-layer's forward (its rows) and backward (whole: its output gradients' rows; split
             * by query: the sums of the window keys' and, where there are entries, the entries' gradients); the
             * per-token path (step 2) has no MTP backward */
            const int64_t bwd = whole ? L + (k == 0) : L + with_entries + (k == 0);
            const int64_t want = (L + 1) + bwd;
            CHECK(c->dev_calls[k] == want, "%s, step %d, rank %d: %lld device gathers (want %lld)", tag,
                  k + 1, r, (long long)c->dev_calls[k], (long long)want);
        }
        /* the all-reduce's sum: rank 0's + rank 1's + ... */
        memcpy(sum, ctx[0].g[k], (size_t)P * sizeof *sum);
        for (int32_t r = 1; r < world; r++)
            for (int64_t i = 0; i < P; i++) sum[i] += ctx[r].g[k][i];
        for (size_t t = 0; t < ds4_model_tensor_count(ref); t++) {
            const char *name = NULL;
            ds4_tensor view;
            ds4_tensor_info info;
            if (ds4_model_tensor_at(ref, t, &name, &view, &err) || ds4_model_tensor_info(ref, t, &info, &err) ||
                !info.is_param || !info.trainable)
                continue;
            const float *x = sum + info.offset, *y = rg[k] + info.offset;
            double dd = 0, yy = 0, parts = 0; /* parts: Σ_r ‖rank r's gradient‖ */
            int64_t differ = 0;
            for (int64_t i = 0; i < info.numel; i++) {
                const double dlt = (double)x[i] - (double)y[i];
                dd += dlt * dlt;
                yy += (double)y[i] * (double)y[i];
                differ += memcmp(&x[i], &y[i], sizeof *x) != 0;
            }
            for (int32_t r = 0; r < world; r++) {
                double pp = 0;
                const float *gr = ctx[r].g[k] + info.offset;
                for (int64_t i = 0; i < info.numel; i++) pp += (double)gr[i] * gr[i];
                parts += sqrt(pp);
            }
            if (attn_bitwise && has(name, ".attn.")) {
                attn_tensors += yy > 0;
                CHECK(differ == 0, "%s, step %d: %s: %lld elements differ (rank 0's whole-sequence attention "
                      "backward: bitwise)", tag, k + 1, name, (long long)differ);
            } else if (yy > 0) {
                if (has(name, ".attn.")) attn_tensors++;
                else other_tensors++;
                /* relative to the ranks' parts, not to their sum: the parts may cancel (layer 0's hc_attn_scale
                 * sums ±0.0246 into 7.5e-5 on 2 ranks), and regrouping fp32 sums errs by eps-sized fractions of
                 * the terms added, not of the result. Split by query the key side's gradients are regrouped as
                 * well (each rank's queries' part, summed over the ranks), and that reaches every activation
                 * gradient below an attention sub-layer: 1e-5, tests/lua/dist_context_parallel.lua's bound (bf16:
                 * 2^-8, bf16's unit roundoff, as there) */
                const double rel = sqrt(dd) / parts;
                if (!(rel <= worst)) worst = rel;
                CHECK(rel <= tol, "%s, step %d: %s: |d| %.3g, relative to the ranks' parts %.3g (to the sum "
                      "%.3g; bound %g)", tag, k + 1, name, sqrt(dd), rel, sqrt(dd / yy), tol);
            } else {
                CHECK(differ == 0, "%s, step %d: %s: zero gradient stays zero", tag, k + 1, name);
            }
        }
    }
    CHECK(!ready || (attn_tensors > 20 && other_tensors > 20), "%s: %lld attention and %lld other non-zero "
          "gradients compared", tag, (long long)attn_tensors, (long long)other_tensors);
    if (ready)
        printf("  tiny_a, %d ranks on %s (slices of %lld..%lld positions), %s: losses, counts and log-probabilities "
               "bitwise, %s worst %.3g relative to the ranks' parts\n", world, md->name, (long long)ctx[world - 1].n,
               (long long)ctx[0].n, whole ? "whole attention" : "split by query",
               attn_bitwise ? "attention gradients bitwise, other gradients" : "every gradient", worst);
    free(sum);
    for (int32_t r = 0; r < world; r++) {
        rank_ctx *c = &ctx[r];
        if (c->m) ds4_model_set_context_parallel(c->m, NULL, NULL);
        detach(md, c->m, dv[r]);
        ds4_model_free(c->m);
        ds4_engine_free(te[r]); /* after its twin: the backend holds the engine's pool */
        for (int k = 0; k < STEPS; k++) {
            free(c->lp[k]);
            free(c->g[k]);
        }
    }
    pthread_barrier_destroy(&sh.bar);
}

/* Rank 1's pass fails inside its first attention operation (after the gather): rank 1 reports its own error, rank 0
 * learns of it at the next gather (the failure flags go over the host before any device gather, so neither waits on
 * the other), both backwards are refused together (the forward left no tape), and with the operation restored the
 * next step is the reference's again. */
static void run_failure(const cp_mode *md, const char *dir, const int64_t *ids, const int64_t *labels,
                        double ref_loss) {
    enum { W = 2 };
    ds4_error err = {0};
    const ds4_train_options topt = {.mtp_lambda = 0.3};
    shared sh;
    pthread_barrier_init(&sh.bar, NULL, W);
    rank_ctx ctx[W];
    ds4_engine *te[W] = {NULL};
    ds4_dev *dv[W] = {NULL};
    memset(ctx, 0, sizeof ctx);
    const ds4_engine_options teo = {.n_threads = 1};
    int ready = 1;
    for (int32_t r = 0; r < W; r++) {
        rank_ctx *c = &ctx[r];
        c->md = md, c->sh = &sh, c->rank = r, c->world = W, c->ids = ids, c->labels = labels;
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        if (te[r]) CHECK_OK(ds4_model_load(te[r], dir, &c->m, &err), &err);
        if (!c->m) {
            ready = 0;
            continue;
        }
        CHECK_OK(ds4_model_enable_grad(c->m, &err), &err);
        CHECK_OK(ds4_model_set_train_options(c->m, &topt, &err), &err);
        dv[r] = attach(md, te[r], c->m);
        const ds4_context_parallel cp = {.rank = r, .world = W,
                                         .device = md->cuda.type == DS4_DEVICE_CUDA ? md->cuda.index : -1, .ctx = c,
                                         .all_gather = host_gather, .device_all_gather = device_gather};
        CHECK_OK(ds4_model_set_context_parallel(c->m, &cp, &err), &err);
        ready &= dv[r] != NULL;
    }
    if (ready) {
        const ds4_ops *ops = dv[1]->ops;
        ds4_ops bad = *ops;
        bad.attention = failing_attention;
        for (int round = 0; round < 2; round++) {
            dv[1]->ops = round == 0 ? &bad : ops;
            pthread_t th[W];
            for (int32_t r = 0; r < W; r++) pthread_create(&th[r], NULL, run_once, &ctx[r]);
            for (int32_t r = 0; r < W; r++) pthread_join(th[r], NULL);
            if (round == 1) {
                for (int32_t r = 0; r < W; r++)
                    CHECK(!ctx[r].fst && !ctx[r].bst && ctx[r].loss == ref_loss, "after the failure, rank %d: forward "
                          "%s (%s), backward %s (%s), loss %.17g (want %.17g)", r, ds4_status_name(ctx[r].fst),
                          ctx[r].fmsg, ds4_status_name(ctx[r].bst), ctx[r].bmsg, ctx[r].loss, ref_loss);
                continue;
            }
            CHECK(ctx[1].fst == DS4_ERR_CUDA && strstr(ctx[1].fmsg, "injected failure"),
                  "rank 1's own failure: %s (%s)", ds4_status_name(ctx[1].fst), ctx[1].fmsg);
            CHECK(ctx[0].fst && strstr(ctx[0].fmsg, "rank 1 failed earlier in this pass"), "rank 0 fails with rank "
                  "1: %s (%s)", ds4_status_name(ctx[0].fst), ctx[0].fmsg);
            for (int32_t r = 0; r < W; r++)
                CHECK(ctx[r].bst != DS4_OK, "rank %d: the backward of a failed forward is refused (%s)", r,
                      ctx[r].bmsg);
            printf("  a device failure on rank 1 mid-pass: rank 1 \"%.80s\"; rank 0 \"%.90s\"\n", ctx[1].fmsg,
                   ctx[0].fmsg);
        }
    }
    for (int32_t r = 0; r < W; r++) {
        rank_ctx *c = &ctx[r];
        if (c->m) ds4_model_set_context_parallel(c->m, NULL, NULL);
        detach(md, c->m, dv[r]);
        ds4_model_free(c->m);
        ds4_engine_free(te[r]);
    }
    pthread_barrier_destroy(&sh.bar);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    ds4_error err = {0};
    ds4_engine *e = NULL;
    const ds4_engine_options eo = {.n_threads = 1};
    CHECK_OK(ds4_engine_create(&eo, &e, &err), &err);
    if (!e) return ds4t_finish("test_cp_device");
    const char *dir = ds4t_path(argv[1], "tiny_a");
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    /* the whole sequences: a fixed LCG, labels = ids with three unscored positions (one at the 2-rank boundary) */
    int64_t ids[B * S], labels[B * S];
    uint64_t st = 1313;
    for (int64_t i = 0; i < B * S; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = labels[i] = (int64_t)((st >> 33) % 256);
    }
    labels[0 * S + 6] = labels[1 * S + 11] = labels[1 * S + 10] = -100;
    const cp_mode modes[] = {{"host-invisible twins", {DS4_DEVICE_CPU, 0, DS4_F32}},
                             {"cuda:0 fp32", {DS4_DEVICE_CUDA, 0, DS4_F32}},
                             {"cuda:0 bf16", {DS4_DEVICE_CUDA, 0, DS4_BF16}}};
    int ngpu = 0;
#ifdef DS4_HAVE_CUDA
    if (ds4_cuda_device_count(&ngpu, &err)) ngpu = 0;
#endif
    for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
        const cp_mode *md = &modes[mi];
        if (md->cuda.type == DS4_DEVICE_CUDA && ngpu == 0) {
            printf("  %s: skipped (no CUDA device)\n", md->name);
            continue;
        }
        /* the reference: one model on the whole sequences (the twins': a CPU model; a GPU's: on that GPU) */
        ds4_model *ref = NULL;
        CHECK_OK(ds4_model_load(e, path, &ref, &err), &err);
        const ds4_train_options topt = {.mtp_lambda = 0.3};
        ds4_forward_result rout[STEPS];
        float *rlp[STEPS] = {NULL}, *rg[STEPS] = {NULL};
        int ok = ref != NULL;
        if (ok && md->cuda.type == DS4_DEVICE_CUDA) {
            const ds4_status ts = ds4_model_to(ref, &md->cuda, &err);
            CHECK_OK(ts, &err);
            ok = ts == DS4_OK;
        }
        if (ok) {
            CHECK_OK(ds4_model_enable_grad(ref, &err), &err);
            CHECK_OK(ds4_model_set_train_options(ref, &topt, &err), &err);
            const int64_t P = ds4_model_param_count(ref);
            for (int k = 0; k < STEPS; k++) {
                rlp[k] = malloc((size_t)(B * S) * sizeof(float));
                rg[k] = malloc((size_t)P * sizeof(float));
                ok &= rlp[k] && rg[k];
            }
            char msg[1024] = "";
            if (ok) ok = !run_steps(ref, ids, labels, 0, S, rout, rlp, rg, P, NULL, NULL, msg);
            CHECK(ok, "%s: the reference's steps: %s", md->name, msg);
        }
        if (ok)
            for (int32_t world = 2; world <= MAXW; world++)
                for (int whole = 0; whole < 2; whole++)
                    run_world(md, path, world, whole, ref, ids, labels, rout, rlp, rg);
        if (ok) run_failure(md, path, ids, labels, rout[0].loss);
        for (int k = 0; k < STEPS; k++) {
            free(rlp[k]);
            free(rg[k]);
        }
        ds4_model_free(ref);
    }
    ds4_engine_free(e);
    return ds4t_finish("test_cp_device");
}
