/* test_ep_shard_twin.c — sharded experts on a device model, end to end, without a GPU: 2 ranks (threads) each move a
 * replicated expert-parallel model and a sharded one onto a host-invisible twin of the CPU backend through
 * ds4_model_to's own device half (ds4_model_to_backend: backend.c's layout, upload and bindings; the sharded model's
 * device copy laid out from its compacted table), and train both on the rank's rows for 2 steps: training forward,
 * backward with the global normalisation, the gradient sum over the ranks (rank order; the sharded model's replicated
 * runs only, as all_reduce_grads does), the device optimizer step. Rank 0 shards its model on the host before the
 * move, rank 1 on the device (ds4_ep_shard of a device model: through the host and back onto the same backend). The
 * expert-parallel hooks move rows over shared memory and say they work on device 0's memory, as NCCL's do.
 *
 * Reference: the replicated expert-parallel model on the same twin (tests/lua/dist_expert_parallel.lua shows it equal
 * to one process on the whole batch). What must hold, bit for bit, and why: sharding moves no arithmetic — each
 * expert's rows are computed by the same owner with the same kernels from the same weights (now read from the
 * compacted copy), the replicated tensors' sums are the same rank-order sums, and the device step's norm adds the
 * same per-tensor sums in the same order. So: the logits and losses of every row, the expert loads, every gradient
 * the rank holds (router gates and MTP included), every step's gradient norm (clip active), the weights after every
 * step (gathered from the owners) and the gathered moments. And each rank's device memory is the compacted layout's:
 * the gradients, master and moments exactly the replicated model's less the other rank's experts, the working copy so
 * to the 16-byte alignment of each tensor. On tiny_a (8 experts), tiny_b (6) and tiny_hf (4, HF-packed). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_train.h"
#include "engine.h"
#include "internal.h"
#include "model.h"
#include "testlib.h"
#include "twin_device.h"

enum { WORLD = TWIN_WORLD, SEQ = 13, STEPS = 2 };

/* ---------------------------------------------------------------------------------------------- the exchanges */


typedef struct rank_ctx {
    twin_world *sh;
    int32_t rank;
    ds4_model *rep, *shm;      /* replicated and sharded expert parallelism */
    ds4_adamw *rep_opt, *sh_opt;
    const int64_t *ids;        /* [B, SEQ] this rank's rows */
    int64_t B;
    int failed;
    char msg[sizeof(((ds4_error *)0)->msg)];
    int64_t logits_differ, grads_differ, grads_compared, expert_nonzero, gate_nonzero, weights_differ, moments_differ;
    int loads_differ, loss_differ, norms_differ, clipped;
    int64_t held, whole;       /* parameters the sharded model holds, of the whole model's */
} rank_ctx;

static ds4_status rows_a2a(void *ctx, const void *send, const int64_t *send_rows, void *recv, const int64_t *recv_rows,
                           size_t row_bytes, ds4_error *err) {
    rank_ctx *c = ctx;
    twin_world *sh = c->sh;
    sh->send[c->rank] = send, sh->send_rows[c->rank] = send_rows;
    pthread_barrier_wait(&sh->bar);
    ds4_status s = DS4_OK;
    size_t at = 0;
    for (int q = 0; q < WORLD; q++) { /* source q's block for this rank: after its blocks for the ranks before */
        size_t from = 0;
        for (int p = 0; p < c->rank; p++) from += (size_t)sh->send_rows[q][p];
        if (sh->send_rows[q][c->rank] != recv_rows[q]) {
            s = ds4_fail(err, DS4_ERR_COMM, "test exchange: rank %d sends %lld rows to rank %d, which expects %lld", q,
                         (long long)sh->send_rows[q][c->rank], c->rank, (long long)recv_rows[q]);
            break;
        }
        memcpy((char *)recv + at * row_bytes, sh->send[q] + from * row_bytes, (size_t)recv_rows[q] * row_bytes);
        at += (size_t)recv_rows[q];
    }
    pthread_barrier_wait(&sh->bar); /* everyone has read every buffer */
    return s;
}

static ds4_status host_blocks(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    (void)err;
    rank_ctx *c = ctx;
    twin_blocks(c->sh, c->rank, send, recv, bytes);
    return DS4_OK;
}

/* In place: the rank-order sum over the ranks (rank 0's + rank 1's), as MPI and the TCP star sum. */
static void sum_f32(rank_ctx *c, float *x, int64_t n, float *tmp) {
    twin_world *sh = c->sh;
    sh->buf[c->rank] = x;
    pthread_barrier_wait(&sh->bar);
    for (int64_t i = 0; i < n; i++) {
        float t = ((const float *)sh->buf[0])[i];
        for (int q = 1; q < WORLD; q++) t += ((const float *)sh->buf[q])[i];
        tmp[i] = t;
    }
    pthread_barrier_wait(&sh->bar);
    memcpy(x, tmp, (size_t)n * sizeof *x);
}

static double sum_f64(rank_ctx *c, double v) {
    double out = 0;
    c->sh->buf[c->rank] = &v;
    pthread_barrier_wait(&c->sh->bar);
    for (int q = 0; q < WORLD; q++) out += *(const double *)c->sh->buf[q];
    pthread_barrier_wait(&c->sh->bar);
    return out;
}

/* all_reduce_grads on the twin's memory (host memory underneath): the whole buffer, or the sharded model's replicated
 * runs only (each rank's experts are its own) */
static int reduce_grads(rank_ctx *c, ds4_model *m, float *tmp, ds4_error *err) {
    float *g = NULL;
    int64_t n = 0;
    if (ds4_model_grad_buffer(m, &g, &n, err)) return 0;
    const size_t runs = ds4_model_replicated_runs(m, NULL, NULL, 0);
    if (!runs) {
        sum_f32(c, g, n, tmp);
    } else {
        int64_t off[256], len[256];
        if (runs > 256) return 0;
        ds4_model_replicated_runs(m, off, len, runs);
        for (size_t k = 0; k < runs; k++) sum_f32(c, g + off[k], len[k], tmp);
    }
    ds4_model_grads_changed(m);
    return 1;
}

/* ---------------------------------------------------------------------------------------------- one rank */

static int64_t differ(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += memcmp(a + i, b + i, sizeof *a) != 0;
    return d;
}

static int rank_steps(rank_ctx *c, ds4_error *err) {
    ds4_model *rep = c->rep, *shm = c->shm;
    const ds4_config *cfg = ds4_model_config(rep);
    const int64_t V = cfg->vocab_size, T = c->B * SEQ, P = ds4_model_param_count(rep);
    const int64_t nl = (cfg->num_hidden_layers + 1) * cfg->n_routed_experts;
    float *lr = malloc((size_t)(T * V) * sizeof *lr), *ls = malloc((size_t)(T * V) * sizeof *ls);
    float *tmp = malloc((size_t)P * sizeof *tmp), *full = malloc((size_t)P * sizeof *full);
    float *fm = malloc((size_t)P * sizeof *fm), *fv = malloc((size_t)P * sizeof *fv);
    int ok = lr && ls && tmp && full && fm && fv;
    for (int k = 0; k < STEPS && ok; k++) {
        ds4_forward_result rr, rs;
        ds4_model_zero_grad(rep);
        ds4_model_zero_grad(shm);
        const ds4_forward_args ar = {.ids = c->ids, .batch = c->B, .seq = SEQ, .labels = c->ids, .logits = lr};
        ds4_forward_args as = ar;
        as.logits = ls;
        ok = !ds4_model_forward_train(rep, &ar, &rr, err) && !ds4_model_forward_train(shm, &as, &rs, err);
        if (!ok) break;
        c->logits_differ += differ(ls, lr, T * V);
        c->loss_differ += rs.loss != rr.loss;
        c->loads_differ += memcmp(ds4_model_router_loads(shm), ds4_model_router_loads(rep), (size_t)nl * 8) != 0;
        const double N = sum_f64(c, (double)rr.loss_tokens); /* the global count: each backward's 1 / N */
        ok = !ds4_model_backward(rep, 1.0 / N, err) && !ds4_model_backward(shm, 1.0 / N, err) &&
             reduce_grads(c, rep, tmp, err) && reduce_grads(c, shm, tmp, err);
        if (!ok) break;
        const float *gr = ds4_model_grads(rep), *gs = ds4_model_grads(shm);
        for (size_t i = 0; gr && gs && i < rep->n_table; i++) { /* what the sharded rank holds, at its place in each */
            const ds4_param *pr = &rep->table[i], *ps = &shm->table[i];
            if (pr->dtype != DS4_F32 || ps->elsewhere) continue;
            c->grads_compared++;
            c->grads_differ += differ(gs + ps->offset, gr + pr->offset, pr->numel);
            int64_t nz = 0;
            for (int64_t j = 0; j < pr->numel; j++) nz += gr[pr->offset + j] != 0;
            if (pr->routed) c->expert_nonzero += nz;
            else if (strstr(pr->name, "ffn.gate.weight")) c->gate_nonzero += nz > 0;
        }
        ds4_adamw_stats sr, ss;
        ok = !ds4_adamw_step(c->rep_opt, &sr, err) && !ds4_adamw_step(c->sh_opt, &ss, err);
        if (!ok) break;
        c->norms_differ += sr.grad_norm != ss.grad_norm;
        c->clipped += sr.grad_norm > ds4_adamw_get_options(c->rep_opt)->clip;
        ok = !ds4_model_gather_params(shm, full, err);
        if (ok) c->weights_differ += differ(full, ds4_model_params(rep), P);
    }
    if (ok) ok = !ds4_adamw_gather_moments(c->sh_opt, fm, fv, err) && !ds4_adamw_sync_state(c->rep_opt, err);
    if (ok) { /* the replicated optimizer's moments, brought back from its device */
        ds4_adamw_state st;
        ds4_adamw_get_state(c->rep_opt, &st);
        c->moments_differ = differ(fm, st.m, P) + differ(fv, st.v, P);
    }
    free(lr), free(ls), free(tmp), free(full), free(fm), free(fv);
    return ok;
}

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    ds4_error err = {0};
    if (!rank_steps(c, &err)) {
        snprintf(c->msg, sizeof c->msg, "%s", err.msg);
        c->failed = 1; /* the other rank may then wait in vain: the test's timeout ends it, named by the message */
        fprintf(stderr, "rank %d: %s\n", c->rank, c->msg);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- the run */

/* The model onto a twin of e's CPU backend, as ds4_model_to puts it on a GPU (fp32 working copy) */
static ds4_dev *twin_move(ds4_engine *e, ds4_model *m) {
    ds4_error err = {0};
    ds4_dev *d = NULL;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (!d) return NULL;
    d->host_visible = 0;
    const ds4_device_options o = {.type = DS4_DEVICE_CUDA, .index = 0, .dtype = DS4_F32};
    const ds4_status st = ds4_model_to_backend(m, d, &o, &err); /* on failure the model released it */
    CHECK_OK(st, &err);
    return st ? NULL : d;
}

static void run(ds4_engine *e0, const char *fixtures, const char *fixture) {
    (void)e0;
    ds4_error err = {0};
    const char *dir = ds4t_path(fixtures, fixture);
    twin_world sh;
    pthread_barrier_init(&sh.bar, NULL, WORLD);
    rank_ctx ctx[WORLD];
    memset(ctx, 0, sizeof ctx);
    ds4_engine *te[WORLD] = {NULL};
    const ds4_engine_options teo = {.n_threads = 1};
    const ds4_adamw_options ao = {.lr = 2e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                                  .clip = 0.05, .schedule = DS4_LR_CONSTANT};
    ds4_train_options topt = {.mtp_lambda = 0.3, .router_bias_gamma = 1e-3}; /* MTP's loss where there is the block */
    int64_t ids[3 * SEQ];
    uint64_t s = 0x9e3779b97f4a7c15ull;
    int ready = 1;
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        c->sh = &sh, c->rank = r;
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        if (!te[r]) {
            ready = 0;
            continue;
        }
        CHECK_OK(ds4_model_load(te[r], dir, &c->rep, &err), &err);
        CHECK_OK(ds4_model_load(te[r], dir, &c->shm, &err), &err);
        if (!c->rep || !c->shm) {
            ready = 0;
            continue;
        }
        const int64_t V = ds4_model_config(c->rep)->vocab_size;
        c->B = r == 0 ? 1 : 2; /* unequal shares on purpose */
        c->ids = ids + (r == 0 ? 0 : SEQ);
        for (int64_t i = r == 0 ? 0 : SEQ; i < (r == 0 ? SEQ : 3 * SEQ); i++) {
            s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
            ids[i] = (int64_t)((s * 0x2545f4914f6cdd1dull) >> 33) % V;
        }
        ds4_expert_parallel ep = {.rank = r, .world = WORLD, .device = 0, .ctx = c, .all_to_all_v = rows_a2a,
                                  .host_all_to_all = host_blocks};
        CHECK_OK(ds4_model_set_expert_parallel(c->rep, &ep, &err), &err);
        ep.shard = 1;
        /* rank 0 cuts its model down on the host before the move; rank 1 shards it on the device (through the host
         * and back onto the same backend, its gradients with it): the same layout either way */
        if (r == 0) CHECK_OK(ds4_model_set_expert_parallel(c->shm, &ep, &err), &err);
        ds4_model *both[2] = {c->rep, c->shm};
        if (!ds4_model_has_mtp(c->rep)) topt.mtp_lambda = 0;
        for (int k = 0; k < 2; k++) {
            CHECK_OK(ds4_model_set_train_options(both[k], &topt, &err), &err);
            CHECK_OK(ds4_model_enable_grad(both[k], &err), &err);
            if (!twin_move(te[r], both[k])) ready = 0;
        }
        if (r == 1) {
            const ds4_dev *d = c->shm->dev;
            CHECK_OK(ds4_model_set_expert_parallel(c->shm, &ep, &err), &err);
            CHECK(c->shm->dev == d && c->shm->dev_opt.type == DS4_DEVICE_CUDA && c->shm->dgrads,
                  "%s: sharded on the device: back on the same backend, its gradients there", fixture);
        }
        CHECK_OK(ds4_adamw_create(c->rep, &ao, &c->rep_opt, &err), &err);
        CHECK_OK(ds4_adamw_create(c->shm, &ao, &c->sh_opt, &err), &err);
        ready = ready && c->rep_opt && c->sh_opt;
        c->held = ds4_model_param_count(c->shm);
        c->whole = ds4_model_whole_param_count(c->shm);
    }
    if (ready) {
        twin_run(rank_main, ctx, sizeof ctx[0]);
        for (int r = 0; r < WORLD; r++) {
            rank_ctx *c = &ctx[r];
            CHECK(!c->failed, "%s rank %d: %s", fixture, r, c->msg);
            if (c->failed) continue;
            CHECK(c->logits_differ == 0 && c->loss_differ == 0 && c->loads_differ == 0,
                  "%s rank %d: sharded vs replicated: %lld logits, %d losses, %d load tables differ", fixture, r,
                  (long long)c->logits_differ, c->loss_differ, c->loads_differ);
            CHECK(c->grads_compared > 0 && c->grads_differ == 0,
                  "%s rank %d: %lld gradients differ in the %lld tensors held", fixture, r, (long long)c->grads_differ,
                  (long long)c->grads_compared);
            CHECK(c->expert_nonzero > 0 && c->gate_nonzero > 0, "%s rank %d: expert (%lld) and router-gate (%lld) "
                  "gradients non-zero", fixture, r, (long long)c->expert_nonzero, (long long)c->gate_nonzero);
            CHECK(c->norms_differ == 0 && c->clipped == STEPS, "%s rank %d: %d gradient norms differ, %d of %d steps "
                  "clipped", fixture, r, c->norms_differ, c->clipped, STEPS);
            CHECK(c->weights_differ == 0 && c->moments_differ == 0,
                  "%s rank %d: after the steps %lld weights, %lld moments differ", fixture, r,
                  (long long)c->weights_differ, (long long)c->moments_differ);
            int64_t gr, mr, vr, gs, ms, vs;
            ds4_model_train_device_bytes(c->rep, &gr, &mr, &vr);
            ds4_model_train_device_bytes(c->shm, &gs, &ms, &vs);
            const int64_t less = (c->whole - c->held) * 4, dw = ds4_model_device_bytes(c->rep, NULL) -
                                                              ds4_model_device_bytes(c->shm, NULL);
            CHECK(c->held < c->whole && gr - gs == less && mr - ms == less && vr - vs == 2 * less && gs == c->held * 4,
                  "%s rank %d: device gradients %lld / %lld, master %lld / %lld, moments %lld / %lld bytes (sharded / "
                  "replicated): want %lld fewer", fixture, r, (long long)gs, (long long)gr, (long long)ms,
                  (long long)mr, (long long)vs, (long long)vr, (long long)less);
            CHECK(dw > less - 16 * (int64_t)c->rep->n_table && dw < less + 16 * (int64_t)c->rep->n_table,
                  "%s rank %d: the working copy %lld bytes smaller, want %lld to each tensor's alignment", fixture, r,
                  (long long)dw, (long long)less);
        }
        printf("  %s, %d steps on %d ranks (clip active): the sharded device model (%lld and %lld of %lld parameters "
               "held) = the replicated one: logits, losses, loads, gradients, norms, weights, moments, bitwise\n",
               fixture, STEPS, WORLD, (long long)ctx[0].held, (long long)ctx[1].held, (long long)ctx[0].whole);
    }
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        ds4_adamw_free(c->rep_opt);
        ds4_adamw_free(c->sh_opt);
        ds4_model_free(c->rep); /* its twin with it */
        ds4_model_free(c->shm);
        ds4_engine_free(te[r]);
    }
    pthread_barrier_destroy(&sh.bar);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_ep_shard_twin", run); }
