/* test_zero_device.c — the optimizer's device step (core/optim.c, the path a CUDA model takes) on a machine without a
 * GPU: a twin of the CPU backend that declares its memory host-invisible stands in for the device, so the step goes
 * through the backend's optim_sumsq / adamw / cast_params operations, the device moments buffer, the read-backs and,
 * sharded (ZeRO-1, ds4_adamw_set_shard), the per-piece sums and refusal counts summed over the ranks and the master
 * gathered through gather_dev_f32. The CPU backend's operations are the host optimizer's own functions, so the
 * reference is the host optimizer on a CPU model given the same gradients (its SSE update and chunk order are the host
 * step's, not the device step's): every step's gradient norm, the final weights, the working copy and the moments
 * must be the same bits, for the unsharded device step and for 2 ranks (threads, with collectives over shared
 * memory). Clipping is active and weight decay on. The sharded twin's moments buffer must hold its shard only. On
 * tiny_a, tiny_b and tiny_hf. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "internal.h"
#include "model.h"
#include "ops.h"
#include "testlib.h"
#include "twin_device.h"

enum { STEPS = 4, WORLD = TWIN_WORLD };

/* ---------------------------------------------------------------------------------------------- collectives */

typedef struct rank_ctx {
    twin_rank tr; /* first: the collectives' ctx */
    ds4_model *m;
    ds4_adamw *opt;
    double norms[STEPS];
    float *mom_m, *mom_v; /* the gathered moments at the end */
    int64_t off, len, dev_moments;
    int failed;
} rank_ctx;

/* ---------------------------------------------------------------------------------------------- the runs */

static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    ds4_error err = {0};
    for (int k = 0; k < STEPS && !c->failed; k++) {
        float *g = NULL;
        int64_t n = 0;
        ds4_adamw_stats st;
        if (ds4_model_grad_buffer(c->m, &g, &n, &err) != DS4_OK) { /* the twin's: host memory underneath */
            c->failed = 1;
            break;
        }
        twin_grads(g, n, k);
        ds4_model_grads_changed(c->m);
        if (ds4_adamw_step(c->opt, &st, &err) != DS4_OK) {
            fprintf(stderr, "rank %d step %d: %s\n", c->tr.rank, k + 1, err.msg);
            c->failed = 1; /* the other rank then waits in vain: the test's timeout ends it, named by this line */
            break;
        }
        c->norms[k] = st.grad_norm;
    }
    if (!c->failed && ds4_adamw_gather_moments(c->opt, c->mom_m, c->mom_v, &err) != DS4_OK) c->failed = 1;
    int64_t gb = 0, mb = 0;
    ds4_model_train_device_bytes(c->m, &gb, &mb, &c->dev_moments);
    ds4_adamw_shard_region(c->opt, &c->off, &c->len);
    return NULL;
}

static int same(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

/* Rank 0's model goes on with an unsharded optimizer loaded from the gathered state (a checkpoint resumed on one
 * rank), while the sharded one still holds its moments on the twin: the moments buffer must change size, handing the
 * shard's moments back to their optimizer first. Two more steps, against the reference's two more. */
static void resume_unsharded(ds4_model *m, rank_ctx *c, ds4_model *ref, ds4_adamw *ropt, int64_t P) {
    ds4_error err = {0};
    ds4_adamw *u = NULL;
    CHECK_OK(ds4_adamw_create(m, &TWIN_OPTS, &u, &err), &err);
    if (!u) return;
    ds4_adamw_state us, ss;
    ds4_adamw_get_state(u, &us);
    ds4_adamw_get_state(c->opt, &ss);
    memcpy(us.m, c->mom_m, (size_t)P * sizeof(float));
    memcpy(us.v, c->mom_v, (size_t)P * sizeof(float));
    memcpy(us.tensor_steps, ss.tensor_steps, ss.n_tensors * sizeof *ss.tensor_steps);
    *us.steps = *ss.steps;
    ds4_adamw_state_changed(u);
    /* the sharded optimizer's host copy is stale while its moments live on the twin (here: zeros, so that only the
     * hand-back can restore it) */
    memset(ss.m, 0, (size_t)c->len * sizeof(float));
    memset(ss.v, 0, (size_t)c->len * sizeof(float));
    int diff = 0;
    for (int k = STEPS; k < STEPS + 2; k++) {
        float *g = NULL;
        int64_t n = 0;
        ds4_adamw_stats st, rst;
        CHECK_OK(ds4_model_grad_buffer(m, &g, &n, &err), &err);
        if (!g) break;
        twin_grads(g, n, k);
        ds4_model_grads_changed(m);
        CHECK_OK(ds4_adamw_step(u, &st, &err), &err);
        twin_grads(ds4_model_grads(ref), P, k);
        ds4_model_grads_changed(ref);
        CHECK_OK(ds4_adamw_step(ropt, &rst, &err), &err);
        diff += st.grad_norm != rst.grad_norm;
        if (k == STEPS) /* the shard's moments came back to its optimizer when the buffer changed size */
            CHECK(same(ss.m, c->mom_m + c->off, c->len) && same(ss.v, c->mom_v + c->off, c->len),
                  "the sharded optimizer's moments handed back to it");
    }
    CHECK(diff == 0, "resumed unsharded: %d gradient norms differ from the host step's", diff);
    int64_t gb = 0, mb = 0, vb = 0;
    ds4_model_train_device_bytes(m, &gb, &mb, &vb);
    CHECK(vb == 2 * P * 4, "resumed unsharded: %lld bytes of moments on the twin", (long long)vb);
    CHECK(same(ds4_model_params(m), ds4_model_params(ref), P), "resumed unsharded: weights = the host step's");
    ds4_adamw_free(u);
}

static void run(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    const char *dir = ds4t_path(fixtures, fixture);
    ds4_model *ref = NULL, *one = NULL, *rk[WORLD] = {NULL};
    CHECK_OK(ds4_model_load(e, dir, &ref, &err), &err);
    CHECK_OK(ds4_model_load(e, dir, &one, &err), &err);
    for (int r = 0; r < WORLD; r++) CHECK_OK(ds4_model_load(e, dir, &rk[r], &err), &err);
    if (!ref || !one || !rk[0] || !rk[1]) goto out;
    const int64_t P = ds4_model_param_count(ref);

    /* the reference: the host optimizer on the whole model */
    double ref_norms[STEPS];
    ds4_adamw *ropt = twin_reference(ref, STEPS, ref_norms);
    ds4_adamw_state rs;
    ds4_adamw_get_state(ropt, &rs);

    /* the unsharded device step */
    CHECK_OK(ds4_model_enable_grad(one, &err), &err);
    ds4_dev *d1 = twin_attach(e, one); /* the main thread alone: the models' engine */
    ds4_adamw *o1 = NULL;
    CHECK_OK(ds4_adamw_create(one, &TWIN_OPTS, &o1, &err), &err);
    int diff_norm = 0;
    for (int k = 0; d1 && o1 && k < STEPS; k++) {
        float *g = NULL;
        int64_t n = 0;
        ds4_adamw_stats st;
        CHECK_OK(ds4_model_grad_buffer(one, &g, &n, &err), &err);
        CHECK(g != one->grads, "the gradients live on the twin");
        if (!g) break;
        twin_grads(g, n, k);
        ds4_model_grads_changed(one);
        CHECK_OK(ds4_adamw_step(o1, &st, &err), &err);
        diff_norm += st.grad_norm != ref_norms[k];
    }
    CHECK(diff_norm == 0, "unsharded device step: %d of %d gradient norms differ from the host step's", diff_norm, STEPS);
    if (d1 && o1) {
        int64_t gb = 0, mb = 0, vb = 0;
        ds4_model_train_device_bytes(one, &gb, &mb, &vb);
        CHECK(vb == 2 * P * 4 && mb == P * 4, "unsharded: moments %lld and master %lld bytes on the twin",
              (long long)vb, (long long)mb);
        CHECK(same((const float *)one->dev_mem, one->dmaster, P), "unsharded: the working copy is the master's cast");
        float *m1 = malloc((size_t)P * 4), *v1 = malloc((size_t)P * 4);
        CHECK_OK(ds4_adamw_gather_moments(o1, m1, v1, &err), &err);
        CHECK(same(m1, rs.m, P) && same(v1, rs.v, P), "unsharded device step: the moments = the host step's");
        CHECK(same(ds4_model_params(one), ds4_model_params(ref), P), "unsharded device step: weights = the host step's");
        free(m1);
        free(v1);
    }
    ds4_adamw_free(o1);
    if (d1) twin_detach(one, d1);

    /* ZeRO-1 over 2 ranks on twins */
    twin_coll sh;
    pthread_barrier_init(&sh.bar, NULL, WORLD);
    rank_ctx ctx[WORLD];
    ds4_dev *dv[WORLD] = {NULL};
    ds4_engine *te[WORLD] = {NULL};
    const ds4_engine_options teo = {.n_threads = 2};
    memset(ctx, 0, sizeof ctx);
    int ready = 1;
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        c->tr = (twin_rank){&sh, r}, c->m = rk[r];
        c->mom_m = malloc((size_t)P * 4), c->mom_v = malloc((size_t)P * 4);
        CHECK_OK(ds4_model_enable_grad(rk[r], &err), &err);
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        dv[r] = te[r] ? twin_attach(te[r], rk[r]) : NULL;
        CHECK_OK(ds4_adamw_create(rk[r], &TWIN_OPTS, &c->opt, &err), &err);
        if (!dv[r] || !c->opt || !c->mom_m || !c->mom_v) {
            ready = 0;
            continue;
        }
        /* without a device gather a device model is refused */
        ds4_adamw_shard no_dev = {.rank = r, .world = WORLD, .ctx = &c->tr, .sum_f64 = twin_sum_f64,
                                  .gather_f32 = twin_gather_f32};
        CHECK_STATUS(ds4_adamw_set_shard(c->opt, &no_dev, &err), DS4_ERR_UNSUPPORTED, &err);
        ds4_adamw_shard s = no_dev;
        s.gather_dev_f32 = twin_gather_f32; /* the twin's memory is host memory */
        CHECK_OK(ds4_adamw_set_shard(c->opt, &s, &err), &err);
    }
    if (ready) {
        twin_run(rank_main, ctx, sizeof ctx[0]);
        for (int r = 0; r < WORLD; r++) {
            rank_ctx *c = &ctx[r];
            CHECK(!c->failed, "rank %d: a step failed", r);
            if (c->failed) continue;
            int dn = 0;
            for (int k = 0; k < STEPS; k++) dn += c->norms[k] != ref_norms[k];
            CHECK(dn == 0, "rank %d: %d of %d gradient norms differ from the host step's", r, dn, STEPS);
            CHECK(c->len > 0 && c->len < P, "rank %d: a shard of %lld of %lld parameters", r, (long long)c->len,
                  (long long)P);
            CHECK(c->dev_moments == 2 * c->len * 4, "rank %d: %lld bytes of moments on the twin, want its shard's %lld",
                  r, (long long)c->dev_moments, (long long)(2 * c->len * 4));
            CHECK(same(c->mom_m, rs.m, P) && same(c->mom_v, rs.v, P), "rank %d: gathered moments = the host step's", r);
            CHECK(same((const float *)rk[r]->dev_mem, rk[r]->dmaster, P),
                  "rank %d: the working copy is the gathered master's cast", r);
            CHECK(same(ds4_model_params(rk[r]), ds4_model_params(ref), P), "rank %d: weights = the host step's", r);
        }
        CHECK(ctx[0].off + ctx[0].len == ctx[1].off, "the shards are adjacent, in rank order");
        if (!ctx[0].failed) resume_unsharded(rk[0], &ctx[0], ref, ropt, P);
        printf("  %s, %d steps, clip active: the device step, unsharded and sharded over %d ranks (shards of %lld and "
               "%lld of %lld parameters), = the host optimizer, bitwise; the sharded state resumed unsharded on the "
               "same device model\n",
               fixture, STEPS, WORLD, (long long)ctx[0].len, (long long)ctx[1].len, (long long)P);
    }
    for (int r = 0; r < WORLD; r++) {
        ds4_adamw_free(ctx[r].opt);
        if (dv[r]) twin_detach(rk[r], dv[r]);
        free(ctx[r].mom_m);
        free(ctx[r].mom_v);
        ds4_engine_free(te[r]); /* after its twin: the backend holds the engine's pool */
    }
    pthread_barrier_destroy(&sh.bar);
    ds4_adamw_free(ropt);
out:
    ds4_model_free(ref);
    ds4_model_free(one);
    for (int r = 0; r < WORLD; r++) ds4_model_free(rk[r]);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_zero_device", run); }
