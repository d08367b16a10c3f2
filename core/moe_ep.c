/* moe_ep.c — expert parallelism: the routed experts of a MoE layer computed by the ranks that own them
 * (docs/distributed.md, "Expert parallelism"). The core only moves rows through the two collectives the caller
 * installed (ds4_expert_parallel); dist/ implements them over MPI, the TCP star and NCCL.
 *
 * Rank r of P owns experts [r·El, (r+1)·El), El = E / P. A pass's (token, slot) rows are grouped by expert in
 * ascending order (moe_sort), so the rows for rank q are one contiguous range. Per layer:
 *   1. the per-expert row counts go to the owners (host_all_to_all: El counts to each rank);
 *   2. the rows go to their owners (all_to_all_v); the owner holds them in (source rank, expert) order and puts them
 *      in (expert, source rank) order: each expert's rows are then the rows one process holding the whole global
 *      batch (the ranks' tokens one after another in rank order) would group for it, in the same order;
 *   3. the owner runs the same grouped kernels on its experts, puts the results back in received order and returns
 *      them (all_to_all_v), so each origin gets back exactly the rows it sent, computed.
 * Every row's arithmetic is the single-process arithmetic (the grouped kernels are batch invariant: a row's result
 * does not depend on the other rows), so the outputs are the same bits; in the backward each expert's weight gradient
 * sums the same rows in the same order as the single process, so it is the same bits too. The routing weights'
 * gradient <da, ye> is computed where the token lives, from the ye the forward brought back (kept in the tape): the
 * router's gradient never crosses ranks. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sched.h"

/* ------------------------------------------------------------------------------------------------ setup */

static int has_routed_lora(const ds4_model *m) {
    if (!m->lora) return 0;
    const int64_t L = m->cfg.num_hidden_layers;
    for (int64_t l = 0; l <= L; l++) {
        const ds4_layer_w *lw = l < L ? &m->w.layers[l] : (m->has_mtp ? &m->w.mtp.block : NULL);
        const ds4_lora_layer *lo = lw ? lw->lora : NULL;
        if (lo && (lo->e13.A || lo->e2.A)) return 1;
    }
    return 0;
}

ds4_status ds4_model_set_expert_parallel(ds4_model *m, const ds4_expert_parallel *ep, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "expert parallel: model is NULL");
    if (m->tape) m->tape->valid = 0; /* a tape of the other mode cannot be differentiated in this one */
    ds4_ep_saved_free(m);            /* its plans were made for the hooks in place (their world's size) */
    if (!ep) {
        m->ep_on = 0;
        memset(&m->ep, 0, sizeof m->ep);
        return DS4_OK;
    }
    const int64_t E = m->cfg.n_routed_experts;
    if (ep->world < 1 || ep->rank < 0 || ep->rank >= ep->world)
        return ds4_fail(err, DS4_ERR_ARG, "expert parallel: rank %d of a world of %d", ep->rank, ep->world);
    if (!ep->all_to_all_v || !ep->host_all_to_all)
        return ds4_fail(err, DS4_ERR_ARG, "expert parallel: the all_to_all_v and host_all_to_all hooks are required");
    if (E % ep->world != 0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: %lld routed experts cannot be split evenly over "
                                                  "%d ranks (E must be a multiple of the world size)", (long long)E,
                        ep->world);
    if (ds4_model_has_fp4(m))
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: the model holds FP4-resident routed experts "
                                                  "(ds4.load{fp4_experts = true}), which expert parallelism does not "
                                                  "support yet (load them expanded to fp32)");
    if (has_routed_lora(m))
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: the model has LoRA adapters on its routed experts, "
                                                  "which expert parallelism does not support yet (adapt other "
                                                  "weights, or train without expert parallelism)");
    if (m->cp_on)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: context parallelism is on; the two together are "
                                                  "not supported yet");
    if (m->q4)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "expert parallel: the model keeps FP4-resident routed experts "
                                                  "(fp4_experts), which expert parallelism does not support yet (load "
                                                  "them dequantised)");
    if (m->ep_shard && !ep->shard)
        return ds4_fail(err, DS4_ERR_ARG, "expert parallel: the routed experts are sharded over %d ranks: turn "
                                          "expert parallelism on sharded (or load the model again)",
                        m->ep_shard_world);
    if (ep->shard) {
        ds4_status s = ds4_ep_shard(m, ep->rank, ep->world, err);
        if (s) return s;
    }
    m->ep = *ep;
    m->ep_on = 1;
    return DS4_OK;
}

const ds4_expert_parallel *ds4_model_expert_parallel(const ds4_model *m) { return m && m->ep_on ? &m->ep : NULL; }

/* Host scratch of a pass with `rows` received rows at most: the expert offsets [E + 1], the counts received [E],
 * send / receive rows per rank [2P], the local offsets [El + 1], then the order [rows] (int32). */
static size_t scratch_bytes(const ds4_model *m, int64_t rows) {
    const size_t E = (size_t)m->cfg.n_routed_experts, P = (size_t)m->ep.world;
    return (E + 1 + E + 2 * P + E / P + 1) * sizeof(int64_t) + (size_t)rows * sizeof(int32_t);
}

/* The hooks take the memory the model computes in (it may have moved since they were installed). */
static ds4_status ep_device_check(const ds4_model *m, ds4_error *err) {
    const ds4_device_options d = ds4_model_device(m);
    const int32_t at = d.type == DS4_DEVICE_CUDA ? d.index : -1;
    if (at == m->ep.device) return DS4_OK;
    return ds4_fail(err, DS4_ERR_ARG, "expert parallel: the model computes on %s but its expert-parallel exchange was "
                                      "set up for %s memory (set expert parallelism up again after moving the model)",
                    ds4_model_device_name(m), m->ep.device < 0 ? "host" : "a CUDA device's");
}

ds4_status ds4_ep_reserve(ds4_model *m, int64_t rows, ds4_error *err) {
    if (!m->ep_on || rows <= 0) return DS4_OK;
    ds4_status s = ep_device_check(m, err);
    if (s) return s;
    const size_t need = scratch_bytes(m, rows);
    if (need <= m->ep_host_bytes) return DS4_OK;
    int64_t *p = realloc(m->ep_host, need);
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "expert parallel: host scratch for %lld rows", (long long)rows);
    m->ep_host = p;
    m->ep_host_bytes = need;
    return DS4_OK;
}

ds4_status ds4_ep_pass_rows(ds4_model *m, int64_t T, int64_t *rows, ds4_error *err) {
    *rows = 0;
    ds4_status s = ds4_ep_refuse(m, "forward", err);
    if (s || !m->ep_on) return s;
    s = ep_device_check(m, err); /* before the collective: every rank refuses alike */
    if (s) return s;
    const int32_t P = m->ep.world;
    int64_t *t = calloc((size_t)P * 2, sizeof(int64_t));
    if (!t) return ds4_fail(err, DS4_ERR_OOM, "expert parallel: %d row counts", P);
    for (int32_t q = 0; q < P; q++) t[q] = T; /* this rank's T to every rank */
    s = m->ep.host_all_to_all(m->ep.ctx, t, t + P, sizeof(int64_t), err);
    int64_t sum = 0;
    for (int32_t q = 0; q < P && !s; q++) {
        if (t[P + q] <= 0 || t[P + q] > INT32_MAX / m->cfg.num_experts_per_tok - sum)
            s = ds4_fail(err, DS4_ERR_COMM, "expert parallel: rank %d reports %lld rows (with this rank's %lld: more "
                                            "than the int32 row indices hold)", q, (long long)t[P + q], (long long)T);
        else
            sum += t[P + q];
    }
    free(t);
    if (s) {
        ds4_error_prefix(err, "forward: ");
        return s;
    }
    *rows = sum * m->cfg.num_experts_per_tok;
    return ds4_ep_reserve(m, *rows, err);
}

/* ------------------------------------------------------------------------------------------------ one layer */

/* The exchange plan of one layer, in the model's host scratch. */
typedef struct ep_plan {
    const int64_t *send_rows, *recv_rows; /* [P] rows to / from each rank */
    int64_t R;                      /* rows received */
    int64_t e0, El;                 /* this rank's experts [e0, e0 + El) */
    int64_t w0;                     /* expert e0's index in the layer's weight and gradient views: e0, or 0 when the
                                       experts are sharded (the views start at this rank's first: ep_shard.c) */
} ep_plan;

/* A failed collective stops the pass like a failed operation: recorded on the backend with the layer. */
static int ep_failed(ds4_pass *f, ds4_status s, const char *what, const ds4_error *e) {
    if (!s) return 0;
    ds4_dev_fail(f->dev, s, "expert parallel %s (layer %lld, rank %d of %d): %s", what, (long long)f->li,
                 f->m->ep.rank, f->m->ep.world, e->msg);
    return 1;
}

/* A training forward's plan of each MoE layer of the tape (key: its index in tape->layers, the MTP block's last),
 * kept for that layer's backward, which groups the same routing (the tape's eidx) and so has the same plan: the
 * backward then neither waits for the backend to read the offsets back nor exchanges the counts again. Valid alike
 * on every rank: every rank makes the same forwards and backwards in the same order, and a training forward saves
 * every layer's (or fails the pass); a forward without a tape (key -1) keeps none and leaves them as they are. */
typedef struct ds4_ep_saved {
    int valid;
    int64_t R, cap;     /* rows received; idx's capacity */
    int64_t *rows;      /* [2P + El + 1] rows to / from each rank, then the local expert offsets */
    int32_t *idx;       /* [R] the received rows' order */
} ds4_ep_saved;

void ds4_ep_saved_free(ds4_model *m) {
    for (int64_t k = 0; k < m->n_ep_saved; k++) {
        free(m->ep_saved[k].rows);
        free(m->ep_saved[k].idx);
    }
    free(m->ep_saved);
    m->ep_saved = NULL;
    m->n_ep_saved = 0;
}

/* The saved plan of tape layer `key` (NULL for key < 0, or when the table cannot be had: the pass failed). */
static ds4_ep_saved *saved_slot(ds4_pass *f, int64_t key) {
    ds4_model *m = f->m;
    if (key < 0) return NULL;
    if (!m->ep_saved) {
        const int64_t n = m->cfg.num_hidden_layers + 1;
        m->ep_saved = calloc((size_t)n, sizeof *m->ep_saved);
        if (!m->ep_saved) {
            ds4_dev_fail(f->dev, DS4_ERR_OOM, "expert parallel: the plans of %lld layers", (long long)n);
            return NULL;
        }
        m->n_ep_saved = n;
    }
    if (key >= m->n_ep_saved) {
        ds4_dev_fail(f->dev, DS4_ERR_INTERNAL, "expert parallel: tape layer %lld of %lld", (long long)key,
                     (long long)m->n_ep_saved);
        return NULL;
    }
    return &m->ep_saved[key];
}

/* Keep the plan just made (sr, rr, loff [El + 1], idx [R]) for the layer's backward; 0 when out of memory (the
 * pass failed: a rank that kept no plan would exchange counts its peers do not). */
static int save_plan(ds4_pass *f, ds4_ep_saved *sv, const int64_t *sr, const int64_t *rr, const int64_t *loff,
                     const int32_t *idx, int64_t R) {
    const int64_t P = f->m->ep.world, El = f->c->n_routed_experts / P;
    sv->valid = 0;
    if (!sv->rows && !(sv->rows = malloc((size_t)(2 * P + El + 1) * sizeof *sv->rows))) {
        ds4_dev_fail(f->dev, DS4_ERR_OOM, "expert parallel (layer %lld): keeping its plan", (long long)f->li);
        return 0;
    }
    if (R > sv->cap) {
        int32_t *q = realloc(sv->idx, (size_t)R * sizeof *q);
        if (!q) {
            ds4_dev_fail(f->dev, DS4_ERR_OOM, "expert parallel (layer %lld): keeping the order of %lld rows",
                         (long long)f->li, (long long)R);
            return 0;
        }
        sv->idx = q, sv->cap = R;
    }
    memcpy(sv->rows, sr, (size_t)P * sizeof *sr);
    memcpy(sv->rows + P, rr, (size_t)P * sizeof *rr);
    memcpy(sv->rows + 2 * P, loff, (size_t)(El + 1) * sizeof *loff);
    if (R) memcpy(sv->idx, idx, (size_t)R * sizeof *idx);
    sv->R = R;
    sv->valid = 1;
    return 1;
}

/* A plan made now or kept from the forward: the local expert offsets loff [El + 1] and the received rows' order idx
 * [R] uploaded to f->ep_off / f->ep_idx, the rows per rank sr / rr [P] referenced by *p. 0 when the pass failed. */
static int install_plan(ds4_pass *f, const int64_t *sr, const int64_t *rr, const int64_t *loff, const int32_t *idx,
                        int64_t R, ep_plan *p) {
    ds4_model *m = f->m;
    const int64_t El = f->c->n_routed_experts / m->ep.world;
    ds4_dev_upload(f->dev, f->ep_off, loff, (size_t)(El + 1) * sizeof(int64_t));
    if (R) ds4_dev_upload(f->dev, f->ep_idx, idx, (size_t)R * sizeof(int32_t));
    *p = (ep_plan){.send_rows = sr, .recv_rows = rr, .R = R, .e0 = m->ep.rank * El, .El = El,
                   .w0 = m->ep_shard ? 0 : m->ep.rank * El};
    return !f->dev->st;
}

/* Counts, exchange plan and the received rows' order (uploaded to f->ep_idx / f->ep_off) from the expert offsets
 * `off` [E + 1] of this rank's grouped rows; `key`: the tape layer whose plan a training forward keeps and its
 * backward takes (-1: none). 0 when the pass has failed. */
static int make_plan(ds4_pass *f, const int64_t *off, int64_t key, int bwd, ep_plan *p) {
    ds4_model *m = f->m;
    ds4_dev *dev = f->dev;
    const int64_t E = f->c->n_routed_experts, P = m->ep.world, El = E / P;
    ds4_ep_saved *sv = saved_slot(f, key);
    if (dev->st) return 0;
    if (bwd && sv && sv->valid) { /* the forward's plan: nothing to read back or exchange */
        if (sv->R > f->ep_rows) {
            ds4_dev_fail(dev, DS4_ERR_INTERNAL, "expert parallel (layer %lld): the forward's plan receives %lld rows, "
                                                "more than the %lld planned", (long long)f->li, (long long)sv->R,
                         (long long)f->ep_rows);
            return 0;
        }
        return install_plan(f, sv->rows, sv->rows + P, sv->rows + 2 * P, sv->idx, sv->R, p);
    }
    int64_t *eoff = m->ep_host, *cnt_in = eoff + E + 1, *sr = cnt_in + E, *rr = sr + P, *loff = rr + P;
    int32_t *idx = (int32_t *)(loff + El + 1);
    ds4_dev_download(dev, eoff, off, (size_t)(E + 1) * sizeof(int64_t)); /* waits for the backend */
    if (dev->st) return 0;
    /* per-expert counts, block q (El counts) to rank q; kept in eoff's place after the rows per rank are read */
    for (int64_t q = 0; q < P; q++) sr[q] = eoff[(q + 1) * El] - eoff[q * El];
    for (int64_t e = 0; e < E; e++) eoff[e] = eoff[e + 1] - eoff[e];
    ds4_error e = {0};
    if (ep_failed(f, m->ep.host_all_to_all(m->ep.ctx, eoff, cnt_in, (size_t)El * sizeof(int64_t), &e), "counts", &e))
        return 0;
    int64_t R = 0;
    for (int64_t s = 0; s < P; s++) {
        rr[s] = 0;
        for (int64_t j = 0; j < El; j++) {
            const int64_t c = cnt_in[s * El + j];
            if (c < 0 || c > f->ep_rows - R - rr[s]) {
                ds4_dev_fail(dev, DS4_ERR_COMM, "expert parallel counts (layer %lld): rank %lld sends %lld rows to "
                                                "expert %lld, more than the %lld planned", (long long)f->li,
                             (long long)s, (long long)c, (long long)(m->ep.rank * El + j), (long long)f->ep_rows);
                return 0;
            }
            rr[s] += c;
        }
        R += rr[s];
    }
    /* received: block s holds source s's rows, its experts in order; wanted: expert j's rows, sources in order */
    int64_t t = 0;
    for (int64_t j = 0; j < El; j++) {
        loff[j] = t;
        int64_t src0 = 0; /* first received row of source s */
        for (int64_t s = 0; s < P; s++) {
            int64_t at = src0;
            for (int64_t jj = 0; jj < j; jj++) at += cnt_in[s * El + jj];
            for (int64_t i = 0; i < cnt_in[s * El + j]; i++) idx[t++] = (int32_t)(at + i);
            src0 += rr[s];
        }
    }
    loff[El] = t;
    if (sv && !bwd && !save_plan(f, sv, sr, rr, loff, idx, R)) return 0;
    return install_plan(f, sr, rr, loff, idx, R, p);
}

/* Rows of `width` floats: send → recv through the installed all_to_all_v, once the backend's work is done. */
static int exchange(ds4_pass *f, const float *send, const int64_t *send_rows, float *recv, const int64_t *recv_rows,
                    int64_t width, const char *what) {
    if (f->dev->st) return 0;
    ds4_error e = {0};
    ds4_status s = f->dev->ops->sync(f->dev, &e);
    if (!s) s = f->m->ep.all_to_all_v(f->m->ep.ctx, send, send_rows, recv, recv_rows, (size_t)width * sizeof(float), &e);
    return !ep_failed(f, s, what, &e);
}

/* Expert weight W [E, O, K] of dtype dt from expert e0 on. */
static const void *experts_from(const void *W, ds4_dtype dt, int64_t e0, int64_t O, int64_t K) {
    return (const char *)W + (size_t)(e0 * O * K) * ds4_dtype_size(dt);
}

/* g1 = x W1ᵀ, g3 = x W3ᵀ of the local experts over the R rows of x (expert order, groups f->ep_off). */
static void gate_up(ds4_pass *f, const ds4_layer_w *l, const ep_plan *p, const float *x, float *g1, float *g3) {
    const int64_t D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    const ds4_dtype mdt = f->w->mdt;
    OP(f->dev, matmul_grouped, .y = g1, .x = x, .W = experts_from(l->w1, mdt, p->w0, I, D), .wdt = mdt,
       .wstride = I * D, .off = f->ep_off, .E = p->El, .rows = p->R, .K = D, .O = I, .bf16_in = f->w->bf16_in);
    OP(f->dev, matmul_grouped, .y = g3, .x = x, .W = experts_from(l->w3, mdt, p->w0, I, D), .wdt = mdt,
       .wstride = I * D, .off = f->ep_off, .E = p->El, .rows = p->R, .K = D, .O = I, .bf16_in = f->w->bf16_in,
       .x_kept = 1); /* the same x as the product just before: its bf16 copy serves again (ops.h) */
}

/* What ds4_model_set_expert_parallel refuses, checked again where it would be computed wrongly. */
static int refused(ds4_pass *f, const ds4_layer_w *l) {
    const ds4_dtype mdt = f->w->mdt;
    const char *why = l->lora && (l->lora->e13.A || l->lora->e2.A) ? "LoRA adapters on the routed experts"
                      : l->edt[0] != mdt || l->edt[1] != mdt || l->edt[2] != mdt ? "FP4-resident routed experts"
                                                                                   : NULL;
    if (why)
        ds4_dev_fail(f->dev, DS4_ERR_UNSUPPORTED, "expert parallel (layer %lld): %s are not supported with expert "
                                                  "parallelism", (long long)f->li, why);
    return why != NULL;
}

void ds4_ep_experts_fwd(ds4_pass *f, const ds4_layer_w *l, const float *xg, const int64_t *off, float *ye) {
    const int64_t D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    ds4_dev *dev = f->dev;
    ep_plan p;
    const int64_t key = f->tape && f->lt ? f->lt - f->tape->layers : -1;
    if (dev->st || refused(f, l) || !make_plan(f, off, key, 0, &p)) return;
    float *recv = f->ep_x[0], *xo = f->ep_x[1], *yo = f->ep_x[2], *g1 = f->ep_h[0], *g3 = f->ep_h[1];
    if (!exchange(f, xg, p.send_rows, recv, p.recv_rows, D, "dispatch")) return;
    OP(dev, gather_rows, .dst = xo, .src = recv, .idx = f->ep_idx, .div = 1, .rows = p.R, .width = D);
    gate_up(f, l, &p, xo, g1, g3);
    OP(dev, swiglu, .g1 = g1, .g3 = g3, .rows = p.R, .I = I, .lim = (float)f->c->swiglu_limit);
    OP(dev, matmul_grouped, .y = yo, .x = g1, .W = experts_from(l->w2, f->w->mdt, p.w0, D, I), .wdt = f->w->mdt,
       .wstride = D * I, .off = f->ep_off, .E = p.El, .rows = p.R, .K = I, .O = D, .bf16_in = f->w->bf16_in);
    OP(dev, scatter_rows, .dst = recv, .src = yo, .idx = f->ep_idx, .rows = p.R, .width = D); /* received order */
    exchange(f, recv, p.recv_rows, ye, p.send_rows, D, "combine");
}

void ds4_ep_experts_bwd(ds4_pass *f, const ds4_layer_w *l, const ds4_layer_w *g, const float *xs, const float *dys,
                        const int64_t *off, int64_t key, float *dxs) {
    const ds4_config *c = f->c;
    const int64_t D = c->hidden_size, I = c->moe_intermediate_size;
    const float lim = (float)c->swiglu_limit;
    const ds4_dtype mdt = f->w->mdt;
    const int bf = f->w->bf16_in;
    ds4_dev *dev = f->dev;
    ep_plan p;
    if (dev->st || refused(f, l) || !make_plan(f, off, key, 1, &p)) return;
    float *xr = f->ep_x[0], *dyr = f->ep_x[1], *xo = f->ep_x[2], *dyo = f->ep_x[3];
    float *g1 = f->ep_h[0], *g3 = f->ep_h[1], *act = f->ep_h[2], *dact = f->ep_h[3];
    if (!exchange(f, xs, p.send_rows, xr, p.recv_rows, D, "dispatch (backward, inputs)") ||
        !exchange(f, dys, p.send_rows, dyr, p.recv_rows, D, "dispatch (backward, output gradients)"))
        return;
    OP(dev, gather_rows, .dst = xo, .src = xr, .idx = f->ep_idx, .div = 1, .rows = p.R, .width = D);
    OP(dev, gather_rows, .dst = dyo, .src = dyr, .idx = f->ep_idx, .div = 1, .rows = p.R, .width = D);
    /* the forward's pre-activations again: the same kernels on the same rows, so the same bits */
    gate_up(f, l, &p, xo, g1, g3);
    /* then backward.c's routed_bwd on the local experts: same operations, same order */
    const void *W1 = experts_from(l->w1, mdt, p.w0, I, D), *W3 = experts_from(l->w3, mdt, p.w0, I, D);
    const void *W2 = experts_from(l->w2, mdt, p.w0, D, I);
    OP(dev, swiglu_bwd, .g1 = g1, .g3 = g3, .act = act, .rows = p.R, .I = I, .lim = lim);
    OP(dev, linear_bwd_x_grouped, .dx = dact, .dy = dyo, .W = W2, .wdt = mdt, .wstride = D * I, .off = f->ep_off,
       .E = p.El, .rows = p.R, .K = I, .O = D, .bf16_in = bf);
    if (g->w2)
        OP(dev, linear_bwd_w_grouped, .dW = g->w2 + p.w0 * D * I, .wstride = D * I, .dy = dyo, .x = act,
           .off = f->ep_off, .E = p.El, .rows = p.R, .K = I, .O = D, .wdt = mdt, .bf16_in = bf);
    OP(dev, swiglu_bwd, .g1 = g1, .g3 = g3, .dact = dact, .dg1 = act, .dg3 = dact, .rows = p.R, .I = I, .lim = lim,
       .grads = 1);
    float *dxo = xr; /* the received inputs are no longer needed */
    OP(dev, linear_bwd_x_grouped, .dx = dxo, .dy = act, .W = W1, .wdt = mdt, .wstride = I * D, .off = f->ep_off,
       .E = p.El, .rows = p.R, .K = D, .O = I, .bf16_in = bf);
    OP(dev, linear_bwd_x_grouped, .dx = dxo, .acc = 1, .dy = dact, .W = W3, .wdt = mdt, .wstride = I * D,
       .off = f->ep_off, .E = p.El, .rows = p.R, .K = D, .O = I, .bf16_in = bf);
    if (g->w1)
        OP(dev, linear_bwd_w_grouped, .dW = g->w1 + p.w0 * I * D, .wstride = I * D, .dy = act, .x = xo,
           .off = f->ep_off, .E = p.El, .rows = p.R, .K = D, .O = I, .wdt = mdt, .bf16_in = bf);
    if (g->w3)
        OP(dev, linear_bwd_w_grouped, .dW = g->w3 + p.w0 * I * D, .wstride = I * D, .dy = dact, .x = xo,
           .off = f->ep_off, .E = p.El, .rows = p.R, .K = D, .O = I, .wdt = mdt, .bf16_in = bf,
           .x_kept = g->w1 != NULL);
    OP(dev, scatter_rows, .dst = dyr, .src = dxo, .idx = f->ep_idx, .rows = p.R, .width = D); /* received order */
    exchange(f, dyr, p.recv_rows, dxs, p.send_rows, D, "combine (backward)");
}

/* ------------------------------------------------------------------------------------------------ loads */

ds4_status ds4_ep_sum_loads(ds4_model *m, ds4_error *err) {
    if (!m->ep_on || !m->router_loads) return DS4_OK;
    const size_t n = (size_t)((m->cfg.num_hidden_layers + 1) * m->cfg.n_routed_experts), P = (size_t)m->ep.world;
    int64_t *buf = calloc(2 * P * n, sizeof(int64_t));
    if (!buf) return ds4_fail(err, DS4_ERR_OOM, "expert parallel: summing %zu expert loads", n);
    for (size_t q = 0; q < P; q++) memcpy(buf + q * n, m->router_loads, n * sizeof(int64_t)); /* to every rank */
    ds4_status s = m->ep.host_all_to_all(m->ep.ctx, buf, buf + P * n, n * sizeof(int64_t), err);
    if (!s) {
        memset(m->router_loads, 0, n * sizeof(int64_t));
        for (size_t q = 0; q < P; q++) /* integers: exact in any order */
            for (size_t i = 0; i < n; i++) m->router_loads[i] += buf[P * n + q * n + i];
    } else {
        ds4_error_prefix(err, "expert parallel: summing the expert loads over the ranks: ");
    }
    free(buf);
    return s;
}
