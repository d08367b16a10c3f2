/* ep_shard.c — sharded experts under expert parallelism (docs/distributed.md, "Expert parallelism"): rank r of P keeps
 * in its flat buffers only its own routed experts [r·El, (r+1)·El) of every MoE layer (El = E / P): the weights, their
 * gradients and, since the optimizer sizes its moments from the parameter buffer, Adam's m and v. Every other tensor
 * (attention, router, shared expert, norms, ...) stays whole and replicated, as under data parallelism.
 *
 * Layout. The table keeps every entry; another rank's expert is marked `elsewhere` (offset -1) and the others are laid
 * out in table order as before with those left out. So every replicated tensor lies at the same offset on every rank
 * (the ranks hold the same number of experts), a rank's experts of one layer and kind stay contiguous (the layer's
 * view points at the first of them: moe_ep.c indexes from it), and `goff` keeps each entry's offset in the whole
 * layout, which a gather fills and checkpoints are written from. A model on a device (CUDA) lays its working copy out
 * from the same table (backend.c: another rank's expert has no place), and its gradients, fp32 master and moments are
 * flat buffers of the compacted size, so a device holds only this rank's experts' state too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sched.h"

static int64_t experts_per_rank(const ds4_model *m, int32_t world) { return m->cfg.n_routed_experts / world; }

static int held_here(const ds4_model *m, const ds4_param *p, int32_t rank, int32_t world) {
    const int64_t El = experts_per_rank(m, world), e = p->routed - 1;
    return !p->routed || (e >= rank * El && e < (rank + 1) * El);
}

/* Move the entries of a buffer in the whole layout (offset == goff) to their new offsets: they only move down (the
 * table ascends in offset and left-out entries only shrink what comes before), so one ascending pass is safe. */
static void compact(const ds4_model *m, float *buf, const int64_t *old_off) {
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype == DS4_F32 && !p->elsewhere && p->offset != old_off[i])
            memmove(buf + p->offset, buf + old_off[i], (size_t)p->numel * sizeof(float));
    }
}

/* A shrinking realloc that fails leaves the larger block, which still holds the data: keep it. */
static float *shrink(float *buf, int64_t n) {
    float *q = realloc(buf, (size_t)(n ? n : 1) * sizeof(float));
    return q ? q : buf;
}

/* A model on a device: its training state comes home (the host mirrors brought up to date, an optimizer's moments
 * back in its buffers), the host buffers are cut down, and the model goes back onto the same backend (kept across:
 * ds4_model_to_backend) with only this rank's experts — the device copy is laid out afresh from the compacted table
 * (backend.c), so nothing of the whole layout stays there. If the way back fails the model stays on the CPU, sharded,
 * and the error says so. */
static ds4_status shard_on_device(ds4_model *m, int32_t rank, int32_t world, ds4_error *err) {
    const ds4_device_options at = ds4_model_device(m), cpu = {.type = DS4_DEVICE_CPU, .dtype = DS4_F32};
    char where[32];
    snprintf(where, sizeof where, "%s", ds4_model_device_name(m));
    ds4_dev *d = m->dev;
    d->refs++; /* the backend outlives the model's hold on it */
    ds4_status s = ds4_model_to(m, &cpu, err);
    const int moved = !s;
    if (!s) s = ds4_ep_shard(m, rank, world, err);
    if (s) {
        ds4_dev_release(d);
        ds4_error_prefix(err, "expert parallel: sharding the experts of a model on %s%s: ", where,
                         moved ? " (it is on the CPU now, whole)" : "");
        return s;
    }
    if ((s = ds4_model_to_backend(m, d, &at, err))) /* which takes the backend, released on failure */
        ds4_error_prefix(err, "expert parallel: the experts were sharded on the host, but the model could not go back "
                              "to %s (it is on the CPU now): ", where);
    return s;
}

ds4_status ds4_ep_shard(ds4_model *m, int32_t rank, int32_t world, ds4_error *err) {
    if (m->ep_shard) {
        if (m->ep_shard_rank == rank && m->ep_shard_world == world) return DS4_OK;
        return ds4_fail(err, DS4_ERR_ARG, "expert parallel: the routed experts are sharded for rank %d of %d; this is "
                                          "rank %d of %d (load the model again)", m->ep_shard_rank, m->ep_shard_world,
                        rank, world);
    }
    if (world < 1 || rank < 0 || rank >= world || m->cfg.n_routed_experts % world != 0)
        return ds4_fail(err, DS4_ERR_ARG, "expert parallel: sharding %lld experts for rank %d of %d",
                        (long long)m->cfg.n_routed_experts, rank, world);
    if (m->lora)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: sharded experts with LoRA adapters are not "
                                                  "supported (drop or merge them first)");
    if (m->q4)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: sharded experts with FP4-resident experts are not "
                                                  "supported (load them expanded to fp32)");
    m->params_gen++; /* the flat buffers are laid out anew: no optimizer's bounds carry over */
    if (m->dev != m->cpu) return shard_on_device(m, rank, world, err);
    int64_t *old_off = calloc(m->n_table ? m->n_table : 1, sizeof *old_off);
    if (!old_off) return ds4_fail(err, DS4_ERR_OOM, "expert parallel: sharding %zu tensors", m->n_table);
    int64_t at = 0;
    for (size_t i = 0; i < m->n_table; i++) {
        ds4_param *p = &m->table[i];
        old_off[i] = p->offset;
        if (p->dtype != DS4_F32) continue;
        if (!held_here(m, p, rank, world)) {
            p->elsewhere = 1;
            p->offset = -1;
            continue;
        }
        p->offset = at;
        at += p->numel;
    }
    compact(m, m->params, old_off);
    if (m->grads) compact(m, m->grads, old_off);
    free(old_off);
    m->n_full = m->n_params;
    m->n_params = at;
    m->params = shrink(m->params, at);
    if (m->grads) m->grads = shrink(m->grads, at);
    m->ep_shard = 1, m->ep_shard_rank = rank, m->ep_shard_world = world;
    ds4_weights_bind(m, &m->w, DS4_F32, (char *)m->params, ds4_f32_byte_offset, NULL, m->tid2eid_all);
    if (m->grads) ds4_weights_bind(m, &m->gw, DS4_F32, (char *)m->grads, ds4_f32_byte_offset, NULL, NULL);
    if (m->tape) m->tape->valid = 0;
    return DS4_OK;
}

void ds4_ep_scatter(const ds4_model *m, const float *full, float *local) {
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype == DS4_F32 && !p->elsewhere)
            memcpy(local + p->offset, full + p->goff, (size_t)p->numel * sizeof(float));
    }
}

ds4_status ds4_ep_gather(ds4_model *m, const float *local, float *full, int32_t root, ds4_error *err) {
    if (!m->ep_shard) {
        memcpy(full, local, (size_t)m->n_params * sizeof(float));
        return DS4_OK;
    }
    ds4_status s = ds4_ep_refuse(m, "gathering the sharded experts", err);
    if (s) return s;
    const int64_t P = m->ep_shard_world, El = experts_per_rank(m, m->ep_shard_world), r = m->ep_shard_rank;
    const int here = root < 0 || root == r; /* this rank receives the whole layout */
    for (size_t i = 0; i < m->n_table && here; i++) { /* what this rank holds, in place */
        const ds4_param *p = &m->table[i];
        if (p->dtype == DS4_F32 && !p->elsewhere)
            memcpy(full + p->goff, local + p->offset, (size_t)p->numel * sizeof(float));
    }
    int64_t big = 0;
    for (size_t i = 0; i < m->n_table; i++)
        if (m->table[i].routed && m->table[i].numel > big) big = m->table[i].numel;
    /* The installed row exchange works on the memory the model computes in: a device model's (NCCL) cannot take these
     * host buffers, so there every expert goes to every rank through the fixed-block host exchange (root or not; only
     * the root keeps them). To every rank: P copies of the expert out, P received; to the root through the row
     * exchange: one out (to it), P received there. */
    const int blocks = m->ep.device >= 0;
    const int64_t outs = root < 0 || blocks ? P : 1;
    float *buf = malloc((size_t)((outs + P) * (big ? big : 1)) * sizeof(float));
    int64_t *rows = malloc((size_t)(2 * P) * sizeof *rows);
    if (!buf || !rows) {
        free(buf);
        free(rows);
        return ds4_fail(err, DS4_ERR_OOM, "expert parallel: gathering experts of %lld values", (long long)big);
    }
    for (int64_t q = 0; q < P; q++) rows[q] = root < 0 || q == root, rows[P + q] = here;
    float *in = buf + outs * (big ? big : 1);
    /* one expert at a time: rank q's j-th expert of a layer and kind is the entry of expert q·El + j; every rank walks
     * the same entries in the same order, so the exchanges pair up */
    for (size_t i = 0; i < m->n_table && !s; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_F32 || p->routed != r * El + 1) continue;
        const size_t e0 = i - (size_t)(r * El); /* the entry of expert 0 */
        const int64_t n = p->numel;
        for (int64_t j = 0; j < El && !s; j++) {
            const float *mine = local + m->table[i + (size_t)j].offset;
            for (int64_t q = 0; q < outs; q++) memcpy(buf + q * n, mine, (size_t)n * sizeof(float));
            s = blocks ? m->ep.host_all_to_all(m->ep.ctx, buf, in, (size_t)n * sizeof(float), err)
                       : m->ep.all_to_all_v(m->ep.ctx, buf, rows, in, rows + P, (size_t)n * sizeof(float), err);
            for (int64_t q = 0; q < P && !s && here; q++)
                memcpy(full + m->table[e0 + (size_t)(q * El + j)].goff, in + q * n, (size_t)n * sizeof(float));
        }
    }
    free(buf);
    free(rows);
    if (s) ds4_error_prefix(err, "expert parallel: gathering the sharded experts: ");
    return s;
}

ds4_status ds4_ep_sum_f64(ds4_model *m, double *v, int64_t n, ds4_error *err) {
    ds4_status s = ds4_ep_refuse(m, "summing over the ranks", err); /* no exchange installed to sum with */
    if (s) return s;
    const int64_t P = m->ep.world;
    double *buf = malloc((size_t)(2 * P * (n ? n : 1)) * sizeof(double));
    if (!buf) return ds4_fail(err, DS4_ERR_OOM, "expert parallel: summing %lld values over the ranks", (long long)n);
    for (int64_t q = 0; q < P; q++) memcpy(buf + q * n, v, (size_t)n * sizeof(double)); /* to every rank */
    s = m->ep.host_all_to_all(m->ep.ctx, buf, buf + P * n, (size_t)n * sizeof(double), err);
    for (int64_t i = 0; i < n && !s; i++) { /* rank 0's + rank 1's + ...: the same order, so the same bits, everywhere */
        double t = buf[P * n + i];
        for (int64_t q = 1; q < P; q++) t += buf[(P + q) * n + i];
        v[i] = t;
    }
    free(buf);
    return s;
}

ds4_status ds4_ep_refuse(const ds4_model *m, const char *what, ds4_error *err) {
    if (!m->ep_shard || m->ep_on) return DS4_OK;
    return ds4_fail(err, DS4_ERR_UNSUPPORTED, "%s: the routed experts are sharded over %d ranks (this one holds %lld "
                                              "of %lld per layer) and expert parallelism is off: turn it on again on "
                                              "every rank (sharded, the same ranks), or load the model again",
                    what, m->ep_shard_world, (long long)experts_per_rank(m, m->ep_shard_world),
                    (long long)m->cfg.n_routed_experts);
}

/* ------------------------------------------------------------------------------------------------ public */

/* Emits the open run [*at, *end) (end < 0: none) and closes it. */
static void close_run(int64_t *at, int64_t *end, int64_t *off, int64_t *len, size_t cap, size_t *n) {
    if (*end > *at) {
        if (*n < cap) off[*n] = *at, len[*n] = *end - *at;
        (*n)++;
    }
    *end = -1;
}

size_t ds4_model_replicated_runs(const ds4_model *m, int64_t *off, int64_t *len, size_t cap) {
    if (!m || !m->ep_shard) return 0;
    size_t n = 0;
    int64_t at = 0, end = -1;
    for (size_t i = 0; i < m->n_table; i++) {
        const ds4_param *p = &m->table[i];
        if (p->dtype != DS4_F32 || p->elsewhere) continue;
        if (p->routed) {
            close_run(&at, &end, off, len, cap, &n);
        } else if (end == p->offset) {
            end += p->numel;
        } else {
            close_run(&at, &end, off, len, cap, &n);
            at = p->offset, end = at + p->numel;
        }
    }
    close_run(&at, &end, off, len, cap, &n);
    return n;
}

int64_t ds4_model_whole_param_count(const ds4_model *m) { return m->ep_shard ? m->n_full : m->n_params; }

ds4_status ds4_model_gather_params(ds4_model *m, float *out, ds4_error *err) {
    ds4_status s = ds4_model_host_sync(m, err);
    return s ? s : ds4_ep_gather(m, m->params, out, -1, err);
}

ds4_status ds4_model_scatter_params(ds4_model *m, const float *in, ds4_error *err) {
    /* the whole buffer is replaced: the device master's values would be overwritten (and a ZeRO-1 master's read-back
     * is a collective that a rank setting its weights alone would wait in) */
    if (!m->ep_shard) m->host_stale = 0;
    ds4_status s = ds4_model_host_sync(m, err);
    if (s) return s;
    if (m->ep_shard) ds4_ep_scatter(m, in, m->params);
    else memmove(m->params, in, (size_t)m->n_params * sizeof(float));
    ds4_model_params_changed(m);
    return DS4_OK;
}
