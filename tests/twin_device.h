/* twin_device.h — a "device" for the device-path tests on machines without a GPU (test_zero_device.c,
 * test_ep_shard_device.c): a twin of the CPU backend that declares its memory host-invisible, so a model's training
 * state goes through the paths a CUDA model takes (the gradients, fp32 master and moments in backend memory, the
 * optimizer's device step, the read-backs, the device hooks of the distributed modes), while its operations stay the
 * CPU backend's. Also used by test_ep_shard_twin.c and test_cp_device.c. Include after testlib.h;
 * every test is its own executable. */
#ifndef DS4_TWIN_DEVICE_H
#define DS4_TWIN_DEVICE_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_train.h"
#include "engine.h"
#include "internal.h"
#include "model.h"
#include "ops.h"
#include "testlib.h"

/* The ranks of the device-path tests: TWIN_WORLD threads meeting at a barrier, each publishing its buffer, then
 * reading the others'. */
enum { TWIN_WORLD = 2 };
typedef struct twin_world {
    pthread_barrier_t bar;
    const char *send[TWIN_WORLD];
    const int64_t *send_rows[TWIN_WORLD];
    const void *buf[TWIN_WORLD];
} twin_world;

/* The expert-parallel host exchange (ds4_expert_parallel.host_all_to_all): block q (bytes each) of send to rank q,
 * block s of recv from rank s. */
static inline void twin_blocks(twin_world *w, int32_t rank, const void *send, void *recv, size_t bytes) {
    w->send[rank] = send;
    pthread_barrier_wait(&w->bar);
    for (int s = 0; s < TWIN_WORLD; s++) memcpy((char *)recv + (size_t)s * bytes, w->send[s] + (size_t)rank * bytes, bytes);
    pthread_barrier_wait(&w->bar); /* everyone has read every buffer */
}

/* fn on every rank's thread, ctx the first of TWIN_WORLD contexts of ctx_size bytes; returns when all have ended */
static inline void twin_run(void *(*fn)(void *), void *ctx, size_t ctx_size) {
    pthread_t th[TWIN_WORLD];
    for (int r = 0; r < TWIN_WORLD; r++) pthread_create(&th[r], NULL, fn, (char *)ctx + (size_t)r * ctx_size);
    for (int r = 0; r < TWIN_WORLD; r++) pthread_join(th[r], NULL);
}

/* ZeRO-1's collectives (ds4_adamw_shard) among TWIN_WORLD threads meeting at a barrier: each publishes its buffer,
 * then reads the others'. The ctx of each rank is its twin_rank. */
typedef struct twin_coll {
    pthread_barrier_t bar;
    double *dbuf[TWIN_WORLD];
    float *fbuf[TWIN_WORLD];
} twin_coll;
typedef struct twin_rank {
    twin_coll *sh;
    int32_t rank;
} twin_rank;

static inline ds4_status twin_sum_f64(void *ctx, double *buf, int64_t n, ds4_error *err) {
    twin_rank *c = ctx;
    double *sum = malloc((size_t)(n ? n : 1) * sizeof *sum);
    if (!sum) return ds4_fail(err, DS4_ERR_OOM, "test sum_f64");
    c->sh->dbuf[c->rank] = buf;
    pthread_barrier_wait(&c->sh->bar);
    for (int64_t i = 0; i < n; i++) { /* rank order */
        double s = c->sh->dbuf[0][i];
        for (int r = 1; r < TWIN_WORLD; r++) s += c->sh->dbuf[r][i];
        sum[i] = s;
    }
    pthread_barrier_wait(&c->sh->bar); /* everyone has read every buffer */
    memcpy(buf, sum, (size_t)n * sizeof *sum);
    free(sum);
    return DS4_OK;
}

static inline ds4_status twin_gather_f32(void *ctx, float *buf, const int64_t *off, const int64_t *len,
                                         ds4_error *err) {
    (void)err;
    twin_rank *c = ctx;
    c->sh->fbuf[c->rank] = buf;
    pthread_barrier_wait(&c->sh->bar);
    for (int r = 0; r < TWIN_WORLD; r++) /* each rank reads the others' own regions, which nobody writes meanwhile */
        if (r != c->rank) memcpy(buf + off[r], c->sh->fbuf[r] + off[r], (size_t)len[r] * sizeof *buf);
    pthread_barrier_wait(&c->sh->bar);
    return DS4_OK;
}

/* The optimizer of the device-step tests: clipping active (their gradients' norms are above 0.05), weight decay on. */
static const ds4_adamw_options TWIN_OPTS = {.lr = 2e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                                            .clip = 0.05, .schedule = DS4_LR_CONSTANT};

/* step k's gradient (the same on every rank: what the all-reduce leaves): a fixed pseudo-random pattern, |g| < 1e-3 */
static inline void twin_grads(float *g, int64_t n, int k) {
    uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(k + 1);
    for (int64_t i = 0; i < n; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        g[i] = (float)((double)((s * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0) * 2e-3 - 1e-3);
    }
}

/* The reference of the device-step tests: the host optimizer on the CPU model ref, `steps` steps of twin_grads, each
 * gradient norm into norms[k] (clipping checked active at the first). The optimizer, or NULL after a failed check. */
static inline ds4_adamw *twin_reference(ds4_model *ref, int steps, double *norms) {
    ds4_error err = {0};
    ds4_adamw *opt = NULL;
    const int64_t P = ds4_model_param_count(ref);
    CHECK_OK(ds4_model_enable_grad(ref, &err), &err);
    CHECK_OK(ds4_adamw_create(ref, &TWIN_OPTS, &opt, &err), &err);
    for (int k = 0; opt && k < steps; k++) {
        twin_grads(ds4_model_grads(ref), P, k);
        ds4_model_grads_changed(ref);
        ds4_adamw_stats st;
        CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
        norms[k] = st.grad_norm;
        CHECK(k > 0 || st.grad_norm > TWIN_OPTS.clip, "step 1: gradient norm %g above the clip %g", st.grad_norm,
              TWIN_OPTS.clip);
    }
    return opt;
}

/* Give a CPU model a "device": a CPU backend marked host-invisible, with a working copy laid out flat (fp32). The
 * backend runs its large copies on e's pool: each rank's twin gets an engine of its own, as a pool serves one caller
 * at a time (ranks are processes of their own in a real job). */
static inline ds4_dev *twin_attach(ds4_engine *e, ds4_model *m) {
    ds4_error err = {0};
    ds4_dev *d = NULL;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (!d) return NULL;
    d->host_visible = 0;
    m->dev_off = malloc(m->n_table * sizeof *m->dev_off);
    m->dev_mem = malloc((size_t)m->n_params * sizeof(float));
    if (!m->dev_off || !m->dev_mem) {
        CHECK(0, "twin: allocating the working copy");
        return NULL;
    }
    for (size_t i = 0; i < m->n_table; i++)
        m->dev_off[i] = m->table[i].dtype == DS4_F32 && !m->table[i].elsewhere
                            ? m->table[i].offset * (int64_t)sizeof(float) : -1; /* elsewhere: another rank's expert */
    memcpy(m->dev_mem, m->params, (size_t)m->n_params * sizeof(float));
    m->dev_f32_bytes = (size_t)m->n_params * sizeof(float);
    m->dev_w.mdt = DS4_F32;
    m->dev = d;
    CHECK_OK(ds4_model_train_bind(m, &err), &err); /* the gradients on the twin */
    return d;
}

/* Back to the CPU backend: the training state read back and freed through the twin, the RoPE tables a pass copied
 * onto it freed (the CPU backend uses the host's in place, so it would not free them), then the twin released. */
static inline void twin_detach(ds4_model *m, ds4_dev *d) {
    ds4_error err = {0};
    CHECK_OK(ds4_model_drop_train_state(m, &err), &err);
    for (int k = 0; k < 2; k++) {
        if (m->rope_dev[k] != m->rope_cs[k]) d->ops->free(d, m->rope_dev[k]);
        m->rope_dev[k] = NULL;
    }
    free(m->dev_mem);
    free(m->dev_off);
    m->dev_mem = NULL;
    m->dev_off = NULL;
    m->dev_f32_bytes = 0;
    m->dev = m->cpu;
    ds4_dev_release(d);
}

#endif
