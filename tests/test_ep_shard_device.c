/* test_ep_shard_device.c — the optimizer's device step over sharded experts (expert parallelism, core/ep_shard.c; the
 * path a CUDA model's step takes, core/optim.c) on a machine without a GPU: each of 2 ranks (threads) keeps only its
 * routed experts, and a twin of the CPU backend that declares its memory host-invisible (twin_device.h) holds its
 * gradients, fp32 master, working copy and moments, so the step runs the backend's optim_sumsq / adamw / cast_params
 * over the compacted layout, with the experts' sums of squares and the refusal counts summed over the ranks. The
 * expert-parallel hooks exchange over shared memory and say they work on device memory (device 0), so the gathers of
 * the weights and moments take the host exchange as they do for a CUDA model (the row exchange must not be called).
 *
 * Reference: the host optimizer on the whole model given the same gradients (what the all-reduce leaves every rank of
 * replicated expert parallelism); test_zero_device.c shows the unsharded device step is that step's bits. What must
 * hold, bit for bit, on tiny_a, tiny_b and tiny_hf: every step's gradient norm (clipping active, so the sharded norm
 * sets the update), the weights and the moments gathered from the ranks, the working copy = the master's cast, and
 * each rank's device state the compacted layout's size (fewer than the whole model's parameters). Then an update that
 * would be non-finite in one rank's expert only (an infinite master value there) is refused by both ranks. */
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

enum { STEPS = 3, WORLD = TWIN_WORLD };

/* ---------------------------------------------------------------------------------------------- the exchange */


typedef struct rank_ctx {
    twin_world *sh;
    int32_t rank;
    ds4_model *m;
    ds4_adamw *opt;
    int64_t P;                      /* the whole model's parameters */
    double norms[STEPS];
    float *w, *mom_m, *mom_v;       /* gathered after the steps [P] */
    int64_t n_local, dev_grads, dev_master, dev_moments;
    ds4_status refused;             /* the step with an infinite master value in rank 1's expert */
    char refused_msg[sizeof(((ds4_error *)0)->msg)];
    int failed, rows_called;
} rank_ctx;

/* block q of send (bytes each) to rank q; block s of recv from rank s */
static ds4_status host_blocks(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    (void)err;
    rank_ctx *c = ctx;
    twin_blocks(c->sh, c->rank, send, recv, bytes);
    return DS4_OK;
}

/* The row exchange of "device" memory: no pass runs here, and a gather must not hand it host buffers. */
static ds4_status device_rows(void *ctx, const void *send, const int64_t *send_rows, void *recv,
                              const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    (void)send, (void)send_rows, (void)recv, (void)recv_rows, (void)row_bytes;
    ((rank_ctx *)ctx)->rows_called = 1;
    return ds4_fail(err, DS4_ERR_INTERNAL, "test: the device row exchange was called with host buffers");
}

/* ---------------------------------------------------------------------------------------------- one rank */

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    ds4_model *m = c->m;
    ds4_error err = {0};
    float *whole = malloc((size_t)c->P * sizeof *whole);
    if (!whole) c->failed = 1;
    for (int k = 0; k < STEPS && !c->failed; k++) {
        float *g = NULL;
        int64_t n = 0;
        ds4_adamw_stats st;
        if (ds4_model_grad_buffer(m, &g, &n, &err) != DS4_OK || n != m->n_params) {
            c->failed = 1;
            break;
        }
        twin_grads(whole, c->P, k);
        ds4_ep_scatter(m, whole, g); /* this rank's part: the twin's memory is host memory */
        ds4_model_grads_changed(m);
        if (ds4_adamw_step(c->opt, &st, &err) != DS4_OK) {
            fprintf(stderr, "rank %d step %d: %s\n", c->rank, k + 1, err.msg);
            c->failed = 1; /* the other rank then waits in vain: the test's timeout ends it, named by this line */
            break;
        }
        c->norms[k] = st.grad_norm;
    }
    if (!c->failed && (ds4_model_gather_params(m, c->w, &err) != DS4_OK ||
                       ds4_adamw_gather_moments(c->opt, c->mom_m, c->mom_v, &err) != DS4_OK)) {
        fprintf(stderr, "rank %d gather: %s\n", c->rank, err.msg);
        c->failed = 1;
    }
    c->n_local = m->n_params;
    ds4_model_train_device_bytes(m, &c->dev_grads, &c->dev_master, &c->dev_moments);
    if (!c->failed) { /* rank 1's first expert of the first MoE layer made infinite: its update is, on rank 1 only */
        if (c->rank == 1) {
            char name[64];
            snprintf(name, sizeof name, "layers.0.ffn.experts.%lld.w1.weight", (long long)m->cfg.n_routed_experts / 2);
            const int64_t i = ds4_model_find(m, name);
            if (i >= 0 && !m->table[i].elsewhere) m->dmaster[m->table[i].offset] = INFINITY;
            else c->failed = 1;
        }
        float *g = NULL;
        int64_t n = 0;
        if (!c->failed && ds4_model_grad_buffer(m, &g, &n, &err) == DS4_OK) {
            twin_grads(whole, c->P, STEPS);
            ds4_ep_scatter(m, whole, g);
            ds4_model_grads_changed(m);
            ds4_adamw_stats st;
            c->refused = ds4_adamw_step(c->opt, &st, &err);
            snprintf(c->refused_msg, sizeof c->refused_msg, "%s", err.msg);
        }
    }
    free(whole);
    return NULL;
}

static int same(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

static void run(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    const char *dir = ds4t_path(fixtures, fixture);
    ds4_model *ref = NULL, *rk[WORLD] = {NULL};
    CHECK_OK(ds4_model_load(e, dir, &ref, &err), &err);
    for (int r = 0; r < WORLD; r++) CHECK_OK(ds4_model_load(e, dir, &rk[r], &err), &err);
    if (!ref || !rk[0] || !rk[1]) goto out;
    const int64_t P = ds4_model_param_count(ref);

    /* the reference: the host optimizer on the whole model */
    double ref_norms[STEPS];
    ds4_adamw *ropt = twin_reference(ref, STEPS, ref_norms);
    ds4_adamw_state rs;
    if (ropt) ds4_adamw_get_state(ropt, &rs);

    twin_world sh;
    pthread_barrier_init(&sh.bar, NULL, WORLD);
    rank_ctx ctx[WORLD];
    ds4_dev *dv[WORLD] = {NULL};
    ds4_engine *te[WORLD] = {NULL};
    const ds4_engine_options teo = {.n_threads = 2};
    memset(ctx, 0, sizeof ctx);
    int ready = ropt != NULL;
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        c->sh = &sh, c->rank = r, c->m = rk[r], c->P = P;
        c->w = malloc((size_t)P * 4), c->mom_m = malloc((size_t)P * 4), c->mom_v = malloc((size_t)P * 4);
        const ds4_expert_parallel ep = {.rank = r, .world = WORLD, .device = 0, .shard = 1, .ctx = c,
                                        .all_to_all_v = device_rows, .host_all_to_all = host_blocks};
        CHECK_OK(ds4_model_set_expert_parallel(rk[r], &ep, &err), &err); /* sharded on the host, then the "device" */
        CHECK_OK(ds4_model_enable_grad(rk[r], &err), &err);
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        dv[r] = te[r] ? twin_attach(te[r], rk[r]) : NULL;
        CHECK_OK(ds4_adamw_create(rk[r], &TWIN_OPTS, &c->opt, &err), &err);
        if (!dv[r] || !c->opt || !c->w || !c->mom_m || !c->mom_v) ready = 0;
    }
    if (ready) {
        twin_run(rank_main, ctx, sizeof ctx[0]);
        for (int r = 0; r < WORLD; r++) {
            rank_ctx *c = &ctx[r];
            CHECK(!c->failed, "rank %d: a step or a gather failed", r);
            CHECK(!c->rows_called, "rank %d: the gathers took the host exchange, not the device rows", r);
            if (c->failed) continue;
            int dn = 0;
            for (int k = 0; k < STEPS; k++) dn += c->norms[k] != ref_norms[k];
            CHECK(dn == 0, "rank %d: %d of %d gradient norms differ from the whole model's", r, dn, STEPS);
            CHECK(c->n_local < P, "rank %d: holds %lld of %lld parameters", r, (long long)c->n_local, (long long)P);
            CHECK(c->dev_grads == c->n_local * 4 && c->dev_master == c->n_local * 4 &&
                      c->dev_moments == 2 * c->n_local * 4,
                  "rank %d: device gradients %lld, master %lld, moments %lld bytes; want the %lld parameters held", r,
                  (long long)c->dev_grads, (long long)c->dev_master, (long long)c->dev_moments, (long long)c->n_local);
            CHECK(same(c->w, ds4_model_params(ref), P), "rank %d: gathered weights = the whole model's step", r);
            CHECK(same(c->mom_m, rs.m, P) && same(c->mom_v, rs.v, P), "rank %d: gathered moments = the host step's", r);
            CHECK(c->refused == DS4_ERR_ARG && strstr(c->refused_msg, "non-finite"),
                  "rank %d: the update non-finite in rank 1's expert only: refused here too (status %d: %s)", r,
                  (int)c->refused, c->refused_msg);
        }
        /* before the refused step the working copy was the master's cast; the refusal wrote nothing */
        for (int r = 0; r < WORLD; r++) {
            const int64_t n = rk[r]->n_params;
            int64_t differ = 0;
            for (int64_t i = 0; i < n; i++) differ += ((const float *)rk[r]->dev_mem)[i] != rk[r]->dmaster[i];
            CHECK(differ == (r == 1), "rank %d: working copy vs master: %lld differ (want only the infinity)", r,
                  (long long)differ);
        }
        printf("  %s, %d steps, clip active: the device step over experts sharded on %d ranks (%lld and %lld of %lld "
               "parameters held) = the whole model's host step, bitwise; one rank's non-finite update refused by "
               "both\n",
               fixture, STEPS, WORLD, (long long)ctx[0].n_local, (long long)ctx[1].n_local, (long long)P);
    }
    for (int r = 0; r < WORLD; r++) {
        ds4_adamw_free(ctx[r].opt);
        if (dv[r]) {
            (void)ds4_model_set_expert_parallel(rk[r], NULL, &err);
            twin_detach(rk[r], dv[r]);
        }
        free(ctx[r].w);
        free(ctx[r].mom_m);
        free(ctx[r].mom_v);
        ds4_engine_free(te[r]); /* after its twin: the backend holds the engine's pool */
    }
    pthread_barrier_destroy(&sh.bar);
    ds4_adamw_free(ropt);
out:
    ds4_model_free(ref);
    for (int r = 0; r < WORLD; r++) ds4_model_free(rk[r]);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_ep_shard_device", run); }
