/* test_zero_device.c — the optimizer's device step (core/optim.c, the path a CUDA model takes) on a machine without a
 * GPU: a twin of the CPU backend that declares its memory host-invisible stands in for the device, so the step goes
 * through the backend's optim_sumsq / adamw / cast_params operations, the device moments buffer, the read-backs and,
 * sharded (ZeRO-1, ds4_adamw_set_shard), the per-piece sums and refusal counts summed over the ranks, the fp32 master
 * of the rank's region only, its cast into the working copy and the working copy's regions gathered through
 * gather_dev_f32, and the read-backs (weights, a save) gathering the master's regions from their owners. The CPU
 * backend's operations are the host optimizer's own functions, so the reference is the host optimizer on a CPU model
 * given the same gradients (its SSE update and chunk order are the host step's, not the device step's): after every
 * step the gradient norm, the weights and the (gathered) moments must be the same bits, and at the end the working
 * copy the reference weights' cast, for the unsharded device step and for 2 ranks (threads, with collectives over
 * shared memory), with a working copy in fp32 and in bf16 (laid out as a CUDA model's: 2-byte M matrices, 16-byte
 * aligned tensors, so the gather moves their bytes). Clipping is active and weight decay on. The sharded twin's
 * moments and master must hold its shard only. Then a save on every rank is the reference's weights, a sharded resume
 * from that save and the gathered state goes on as the reference does, and rank 0's model resumes unsharded. On
 * tiny_a, tiny_b and tiny_hf. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "internal.h"
#include "model.h"
#include "ops.h"
#include "testlib.h"
#include "twin_device.h"

enum { STEPS = 4, MORE = 2, TOTAL = STEPS + MORE, WORLD = TWIN_WORLD };

/* The reference after each of TOTAL steps: gradient norm, weights and moments. */
typedef struct snaps {
    int64_t P;
    double norm[TOTAL];
    float *p[TOTAL], *m[TOTAL], *v[TOTAL];
} snaps;

static int same(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

static int ref_steps(ds4_model *ref, snaps *r) {
    ds4_error err = {0};
    ds4_adamw *opt = NULL;
    const int64_t P = r->P = ds4_model_param_count(ref);
    CHECK_OK(ds4_model_enable_grad(ref, &err), &err);
    CHECK_OK(ds4_adamw_create(ref, &TWIN_OPTS, &opt, &err), &err);
    int ok = opt != NULL;
    for (int k = 0; ok && k < TOTAL; k++) {
        twin_grads(ds4_model_grads(ref), P, k);
        ds4_model_grads_changed(ref);
        ds4_adamw_stats st;
        CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
        CHECK(k > 0 || st.grad_norm > TWIN_OPTS.clip, "step 1: gradient norm %g above the clip %g", st.grad_norm,
              TWIN_OPTS.clip);
        r->norm[k] = st.grad_norm;
        ds4_adamw_state s;
        ds4_adamw_get_state(opt, &s);
        r->p[k] = malloc((size_t)P * 4), r->m[k] = malloc((size_t)P * 4), r->v[k] = malloc((size_t)P * 4);
        ok = r->p[k] && r->m[k] && r->v[k];
        if (!ok) break;
        memcpy(r->p[k], ds4_model_params(ref), (size_t)P * 4);
        memcpy(r->m[k], s.m, (size_t)P * 4);
        memcpy(r->v[k], s.v, (size_t)P * 4);
    }
    ds4_adamw_free(opt);
    return ok;
}

static void snaps_free(snaps *r) {
    for (int k = 0; k < TOTAL; k++) free(r->p[k]), free(r->m[k]), free(r->v[k]);
}

/* ---------------------------------------------------------------------------------------------- collectives */

typedef struct rank_ctx {
    twin_rank tr; /* first: the collectives' ctx */
    ds4_model *m;
    ds4_adamw *opt;
    const snaps *ref;
    int k0, k1;           /* the steps run: [k0, k1) of the reference's */
    const char *save_dir; /* a save of the model after them, or NULL */
    float *mom_m, *mom_v; /* the gathered moments at the end */
    int64_t off, len, dev_moments, dev_master;
    int bad_norm, bad_w, bad_mom; /* steps whose norm, read-back weights or gathered moments differ */
    int bad_stale;                /* steps after whose gathered moments the host weights were still stale */
    int alone;                    /* this rank's next gather finds no peer (alone_gather_f32) */
    int failed;
} rank_ctx;

/* twin_gather_f32, or with c->alone set what a communicator's gather returns when the other ranks never join: its
 * timeout's error (at once here: the twin has no clock), the buffer untouched. */
static ds4_status alone_gather_f32(void *ctx, float *buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    rank_ctx *c = ctx; /* tr first: the twin's ctx is the rank's */
    if (c->alone)
        return ds4_fail(err, DS4_ERR_COMM, "twin all_gather: rank %d alone: the other rank never joined within the "
                                           "timeout", c->tr.rank);
    return twin_gather_f32(ctx, buf, off, len, err);
}

/* ---------------------------------------------------------------------------------------------- the twins */

/* The twin with a bf16 working copy laid out as a CUDA model's (backend.c, layout): each fp32 tensor 16-byte aligned,
 * M matrices in 2 bytes, the host weights cast into it. The optimizer tests run no pass, so no view is bound. */
static ds4_dev *twin_attach_bf16(ds4_engine *e, ds4_model *m) {
    ds4_dev *d = twin_attach(e, m);
    if (!d) return NULL;
    size_t at = 0;
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        m->dev_off[i] = -1;
        if (p->dtype != DS4_F32 || p->elsewhere) continue;
        at = (at + 15) & ~(size_t)15;
        m->dev_off[i] = (int64_t)at;
        at += (size_t)p->numel * (p->lowp ? 2 : 4);
    }
    m->dev_f32_bytes = (at + 15) & ~(size_t)15;
    free(m->dev_mem);
    m->dev_mem = calloc(1, m->dev_f32_bytes ? m->dev_f32_bytes : 4);
    m->dev_w.mdt = DS4_BF16;
    if (!m->dev_mem) {
        CHECK(0, "twin: the bf16 working copy");
        return d;
    }
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (m->dev_off[i] < 0) continue;
        char *dst = (char *)m->dev_mem + m->dev_off[i];
        if (p->lowp)
            for (int64_t k = 0; k < p->numel; k++) ((uint16_t *)(void *)dst)[k] = ds4_f32_to_bf16(m->params[p->offset + k]);
        else memcpy(dst, m->params + p->offset, (size_t)p->numel * 4);
    }
    return d;
}

/* How many fp32 tensors' working copies differ from weights w cast to the twin's dtype. */
static int working_diff(const ds4_model *m, const float *w) {
    int bad = 0;
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_F32 || p->elsewhere) continue;
        const char *dst = (const char *)m->dev_mem + m->dev_off[i];
        int d = 0;
        if (p->lowp && m->dev_w.mdt == DS4_BF16) {
            for (int64_t k = 0; k < p->numel && !d; k++)
                d = ((const uint16_t *)(const void *)dst)[k] != ds4_f32_to_bf16(w[p->offset + k]);
        } else {
            d = memcmp(dst, w + p->offset, (size_t)p->numel * 4) != 0;
        }
        bad += d;
    }
    return bad;
}

static ds4_dev *attach(ds4_engine *e, ds4_model *m, ds4_dtype mdt) {
    return mdt == DS4_BF16 ? twin_attach_bf16(e, m) : twin_attach(e, m);
}

/* ---------------------------------------------------------------------------------------------- the runs */

/* Steps [k0, k1) on this rank; after each the weights read back (ds4_model_params: the master's regions gathered from
 * their owners, a collective) and the moments gathered, against the reference's; then a save (a collective too). */
static void *rank_main(void *arg) {
    rank_ctx *c = arg;
    ds4_error err = {0};
    const int64_t P = c->ref->P;
    for (int k = c->k0; k < c->k1 && !c->failed; k++) {
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
        int64_t gb = 0;
        ds4_model_train_device_bytes(c->m, &gb, &c->dev_master, &c->dev_moments); /* before a read-back */
        c->bad_norm += st.grad_norm != c->ref->norm[k];
        /* the moments' gather reads the sharded master back too (a checkpoint saved on one rank after it) */
        const int stale = c->m->host_stale;
        if (ds4_adamw_gather_moments(c->opt, c->mom_m, c->mom_v, &err) != DS4_OK) {
            fprintf(stderr, "rank %d step %d: gathering the moments: %s\n", c->tr.rank, k + 1, err.msg);
            c->failed = 1;
            break;
        }
        c->bad_stale += !stale || c->m->host_stale;
        const float *w = ds4_model_params(c->m);
        if (!w) {
            c->failed = 1;
            break;
        }
        c->bad_w += !same(w, c->ref->p[k], P);
        c->bad_mom += !(same(c->mom_m, c->ref->m[k], P) && same(c->mom_v, c->ref->v[k], P));
    }
    if (!c->failed && c->save_dir && ds4_model_save(c->m, c->save_dir, &err) != DS4_OK) {
        fprintf(stderr, "rank %d: save: %s\n", c->tr.rank, err.msg);
        c->failed = 1;
    }
    ds4_adamw_shard_region(c->opt, &c->off, &c->len);
    return NULL;
}

/* One more step, not read back (its weights are not compared). */
static void *rank_last_step(void *arg) {
    rank_ctx *c = arg;
    ds4_error err = {0};
    float *g = NULL;
    int64_t n = 0;
    if (ds4_model_grad_buffer(c->m, &g, &n, &err) != DS4_OK) {
        c->failed = 1;
        return NULL;
    }
    twin_grads(g, n, c->k1);
    ds4_model_grads_changed(c->m);
    if (ds4_adamw_step(c->opt, NULL, &err) != DS4_OK) {
        fprintf(stderr, "rank %d: the last step: %s\n", c->tr.rank, err.msg);
        c->failed = 1;
    }
    return NULL;
}

/* The checks of a sharded run of steps [k0, k1) on every rank, named by what. */
static void check_ranks(rank_ctx *ctx, const snaps *ref, const char *what) {
    const int64_t P = ref->P, steps = ctx[0].k1 - ctx[0].k0;
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        CHECK(!c->failed, "%s, rank %d: a step failed", what, r);
        if (c->failed) continue;
        CHECK(c->bad_norm == 0, "%s, rank %d: %d of %lld gradient norms differ from the host step's", what, r,
              c->bad_norm, (long long)steps);
        CHECK(c->bad_w == 0, "%s, rank %d: after %d of %lld steps the weights read back differ from the host step's",
              what, r, c->bad_w, (long long)steps);
        CHECK(c->bad_mom == 0, "%s, rank %d: after %d of %lld steps the gathered moments differ from the host step's",
              what, r, c->bad_mom, (long long)steps);
        CHECK(c->bad_stale == 0, "%s, rank %d: after %d of %lld steps the moments' gather left the weights stale", what,
              r, c->bad_stale, (long long)steps);
        CHECK(c->len > 0 && c->len < P, "%s, rank %d: a shard of %lld of %lld parameters", what, r, (long long)c->len,
              (long long)P);
        CHECK(c->dev_moments == 2 * c->len * 4, "%s, rank %d: %lld bytes of moments on the twin, want its shard's %lld",
              what, r, (long long)c->dev_moments, (long long)(2 * c->len * 4));
        CHECK(c->dev_master == c->len * 4 && c->m->master_lo == c->off && c->m->master_n == c->len,
              "%s, rank %d: %lld bytes of fp32 master on the twin, want its shard's %lld", what, r,
              (long long)c->dev_master, (long long)(c->len * 4));
        const int wd = working_diff(c->m, ref->p[c->k1 - 1]);
        CHECK(wd == 0, "%s, rank %d: the working copies of %d tensors differ from the host step's weights' cast", what,
              r, wd);
    }
    CHECK(ctx[0].off + ctx[0].len == ctx[1].off, "%s: the shards are adjacent, in rank order", what);
}

/* Rank 0's model goes on with an unsharded optimizer loaded from the gathered state (a checkpoint resumed on one
 * rank), while the sharded one still holds its moments on the twin: the moments buffer must change size, handing the
 * shard's moments back to their optimizer first, and the master (read back already: no collective) becomes whole.
 * MORE steps, against the reference's. */
static void resume_unsharded(ds4_model *m, rank_ctx *c, const snaps *ref) {
    ds4_error err = {0};
    const int64_t P = ref->P;
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
    for (int k = STEPS; k < TOTAL; k++) {
        float *g = NULL;
        int64_t n = 0;
        ds4_adamw_stats st;
        CHECK_OK(ds4_model_grad_buffer(m, &g, &n, &err), &err);
        if (!g) break;
        twin_grads(g, n, k);
        ds4_model_grads_changed(m);
        CHECK_OK(ds4_adamw_step(u, &st, &err), &err);
        diff += st.grad_norm != ref->norm[k];
        if (k == STEPS) /* the shard's moments came back to its optimizer when the buffer changed size */
            CHECK(same(ss.m, c->mom_m + c->off, c->len) && same(ss.v, c->mom_v + c->off, c->len),
                  "the sharded optimizer's moments handed back to it");
    }
    CHECK(diff == 0, "resumed unsharded: %d gradient norms differ from the host step's", diff);
    int64_t gb = 0, mb = 0, vb = 0;
    ds4_model_train_device_bytes(m, &gb, &mb, &vb);
    CHECK(vb == 2 * P * 4 && mb == P * 4, "resumed unsharded: %lld bytes of moments and %lld of master on the twin",
          (long long)vb, (long long)mb);
    CHECK(same(ds4_model_params(m), ref->p[TOTAL - 1], P), "resumed unsharded: weights = the host step's");
    CHECK(working_diff(m, ref->p[TOTAL - 1]) == 0, "resumed unsharded: the working copy is the weights' cast");
    ds4_adamw_free(u);
}

/* A sharded run: STEPS steps on WORLD twins with working copies in mdt, a save on every rank; the saves against the
 * reference; a sharded resume from them and the gathered state for MORE steps; with fp32, rank 0's model resumed
 * unsharded. */
static void sharded_run(ds4_engine *e, const char *dir, const char *fixture, ds4_dtype mdt, const snaps *ref) {
    ds4_error err = {0};
    const int64_t P = ref->P;
    ds4_model *rk[WORLD] = {NULL}, *rs[WORLD] = {NULL};
    twin_coll sh;
    pthread_barrier_init(&sh.bar, NULL, WORLD);
    rank_ctx ctx[WORLD], rctx[WORLD];
    ds4_dev *dv[WORLD] = {NULL}, *rdv[WORLD] = {NULL};
    ds4_engine *te[WORLD] = {NULL};
    const ds4_engine_options teo = {.n_threads = 2};
    char saves[WORLD][64];
    memset(ctx, 0, sizeof ctx);
    memset(rctx, 0, sizeof rctx);
    int ready = 1;
    for (int r = 0; r < WORLD; r++) {
        rank_ctx *c = &ctx[r];
        snprintf(saves[r], sizeof saves[r], "/tmp/ds4_zero_dev_XXXXXX");
        if (!mkdtemp(saves[r])) saves[r][0] = 0;
        CHECK_OK(ds4_model_load(e, dir, &rk[r], &err), &err);
        c->tr = (twin_rank){&sh, r}, c->m = rk[r], c->ref = ref, c->k0 = 0, c->k1 = STEPS, c->save_dir = saves[r];
        c->mom_m = malloc((size_t)P * 4), c->mom_v = malloc((size_t)P * 4);
        CHECK_OK(ds4_engine_create(&teo, &te[r], &err), &err);
        if (!rk[r] || !te[r] || !saves[r][0]) {
            ready = 0;
            continue;
        }
        CHECK_OK(ds4_model_enable_grad(rk[r], &err), &err);
        dv[r] = attach(te[r], rk[r], mdt);
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
    const char *dt = mdt == DS4_BF16 ? "bf16" : "fp32";
    char what[96];
    if (ready) {
        twin_run(rank_main, ctx, sizeof ctx[0]);
        snprintf(what, sizeof what, "%s, %s working copy, sharded", fixture, dt);
        check_ranks(ctx, ref, what);
        for (int r = 0; r < WORLD && !ctx[r].failed; r++) { /* the save of a sharded master: the whole weights */
            ds4_model *back = NULL;
            CHECK_OK(ds4_model_load(e, saves[r], &back, &err), &err);
            if (back)
                CHECK(same(ds4_model_params(back), ref->p[STEPS - 1], P), "%s, rank %d: the save = the host step's",
                      what, r);
            ds4_model_free(back);
        }
    }
    /* the resume: each rank's model from its save, a sharded optimizer given the gathered state */
    int rready = ready && !ctx[0].failed && !ctx[1].failed;
    for (int r = 0; rready && r < WORLD; r++) {
        rank_ctx *c = &rctx[r];
        CHECK_OK(ds4_model_load(e, saves[r], &rs[r], &err), &err);
        *c = ctx[r];
        c->m = rs[r], c->opt = NULL, c->k0 = STEPS, c->k1 = TOTAL, c->save_dir = NULL;
        c->bad_norm = c->bad_w = c->bad_mom = c->bad_stale = 0;
        c->mom_m = malloc((size_t)P * 4), c->mom_v = malloc((size_t)P * 4);
        if (!rs[r] || !c->mom_m || !c->mom_v) {
            rready = 0;
            break;
        }
        CHECK_OK(ds4_model_enable_grad(rs[r], &err), &err);
        rdv[r] = attach(te[r], rs[r], mdt);
        CHECK_OK(ds4_adamw_create(rs[r], &TWIN_OPTS, &c->opt, &err), &err);
        if (!rdv[r] || !c->opt) {
            rready = 0;
            break;
        }
        ds4_adamw_shard s = {.rank = r, .world = WORLD, .ctx = &c->tr, .sum_f64 = twin_sum_f64,
                             .gather_f32 = alone_gather_f32, .gather_dev_f32 = twin_gather_f32};
        CHECK_OK(ds4_adamw_set_shard(c->opt, &s, &err), &err);
        ds4_adamw_state ns, os;
        ds4_adamw_get_state(c->opt, &ns);
        ds4_adamw_get_state(ctx[r].opt, &os);
        ds4_adamw_put_moments(c->opt, ctx[r].mom_m, ctx[r].mom_v);
        memcpy(ns.tensor_steps, os.tensor_steps, os.n_tensors * sizeof *os.tensor_steps);
        *ns.steps = *os.steps;
    }
    if (rready) {
        twin_run(rank_main, rctx, sizeof rctx[0]);
        snprintf(what, sizeof what, "%s, %s working copy, resumed sharded from the saves", fixture, dt);
        check_ranks(rctx, ref, what);
        /* a step not read back, then its optimizer freed: the other regions of the master are out of reach, and a
         * read-back says so rather than returning part of the weights (the test then gives them up) */
        if (!rctx[0].failed && !rctx[1].failed) twin_run(rank_last_step, rctx, sizeof rctx[0]);
        /* rank 0 reads back alone: its gather fails (the communicator's timeout), and so does the read-back, naming
         * itself; the weights stay stale (no half-gathered buffer is handed out) */
        if (!rctx[0].failed) {
            rctx[0].alone = 1;
            CHECK_STATUS(ds4_model_host_sync(rs[0], &err), DS4_ERR_COMM, &err);
            CHECK(strstr(err.msg, "reading the sharded master weights back (ZeRO-1") != NULL &&
                      strstr(err.msg, "rank 0 alone") != NULL,
                  "%s: a lone read-back's error names the read-back and the gather's failure: %s", what, err.msg);
            CHECK(rs[0]->host_stale && ds4_model_params(rs[0]) == NULL,
                  "%s: after a lone read-back failed the weights are still stale and not handed out", what);
            rctx[0].alone = 0;
        }
        for (int r = 0; r < WORLD && !rctx[r].failed; r++) {
            ds4_adamw_free(rctx[r].opt);
            rctx[r].opt = NULL;
            CHECK(rs[r]->host_stale && ds4_model_master_sharded(rs[r]), "%s, rank %d: a stale sharded master", what, r);
            CHECK_STATUS(ds4_model_host_sync(rs[r], &err), DS4_ERR_ARG, &err);
            CHECK(strstr(err.msg, "freed before") != NULL, "%s: the refusal names the freed optimizer: %s", what,
                  err.msg);
            rs[r]->host_stale = 0;
        }
    }
    if (rready && mdt == DS4_F32 && !rctx[0].failed) resume_unsharded(rk[0], &ctx[0], ref);
    if (rready)
        printf("  %s, %s working copy: %d steps sharded over %d ranks (shards of %lld and %lld of %lld parameters, "
               "each rank's device master its shard's) = the host optimizer after every step, bitwise (norms, weights "
               "read back, gathered moments, working copy); the saves = its weights; %d more steps resumed sharded "
               "from them%s\n",
               fixture, dt, STEPS, WORLD, (long long)ctx[0].len, (long long)ctx[1].len, (long long)P, MORE,
               mdt == DS4_F32 ? " and unsharded on rank 0's model" : "");
    for (int r = 0; r < WORLD; r++) {
        ds4_adamw_free(rctx[r].opt);
        if (rdv[r]) twin_detach(rs[r], rdv[r]);
        free(rctx[r].mom_m);
        free(rctx[r].mom_v);
        ds4_adamw_free(ctx[r].opt);
        if (dv[r]) twin_detach(rk[r], dv[r]);
        free(ctx[r].mom_m);
        free(ctx[r].mom_v);
        ds4_engine_free(te[r]); /* after its twins: the backend holds the engine's pool */
        ds4_model_free(rk[r]);
        ds4_model_free(rs[r]);
        if (saves[r][0]) ds4t_rm_rf(saves[r]);
    }
    pthread_barrier_destroy(&sh.bar);
}

static void run(ds4_engine *e, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    const char *dir = ds4t_path(fixtures, fixture);
    ds4_model *ref = NULL, *one = NULL;
    snaps rf;
    memset(&rf, 0, sizeof rf);
    CHECK_OK(ds4_model_load(e, dir, &ref, &err), &err);
    CHECK_OK(ds4_model_load(e, dir, &one, &err), &err);
    if (!ref || !one || !ref_steps(ref, &rf)) goto out;
    const int64_t P = rf.P;

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
        diff_norm += st.grad_norm != rf.norm[k];
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
        CHECK(same(m1, rf.m[STEPS - 1], P) && same(v1, rf.v[STEPS - 1], P),
              "unsharded device step: the moments = the host step's");
        CHECK(same(ds4_model_params(one), rf.p[STEPS - 1], P), "unsharded device step: weights = the host step's");
        free(m1);
        free(v1);
    }
    ds4_adamw_free(o1);
    if (d1) twin_detach(one, d1);

    /* ZeRO-1 over 2 ranks on twins, with both working-copy dtypes */
    sharded_run(e, dir, fixture, DS4_F32, &rf);
    sharded_run(e, dir, fixture, DS4_BF16, &rf);
out:
    snaps_free(&rf);
    ds4_model_free(ref);
    ds4_model_free(one);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_zero_device", run); }
