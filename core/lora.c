/* lora.c — the LoRA adapter set of a model: its table and flat buffers, initialisation, attaching it to a model
 * (only adapters train while it is there), gradients, merging into the weights. PEFT files: lora_peft.c; backend
 * copies: lora_dev.c; the schedule's part: lora_sched.c. docs/lora.md. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lora.h"
#include "sched.h"

/* ------------------------------------------------------------------------------------------------ sites */

static const struct {
    const char *name;                    /* the adapted weight's canonical name, less "layers.N." and ".weight" */
    uint32_t target;                     /* the public target bit */
} SITES[DS4_LS_COUNT] = {
    {"attn.wq_a", DS4_LORA_WQ_A},
    {"attn.wq_b", DS4_LORA_WQ_B},
    {"attn.wkv", DS4_LORA_WKV},
    {"attn.wo_a", DS4_LORA_WO_A},
    {"attn.wo_b", DS4_LORA_WO_B},
    {"attn.indexer.wq_b", DS4_LORA_INDEXER},
    {"attn.indexer.weights_proj", DS4_LORA_INDEXER},
    {"ffn.shared_experts.w1", DS4_LORA_SHARED},
    {"ffn.shared_experts.w2", DS4_LORA_SHARED},
    {"ffn.shared_experts.w3", DS4_LORA_SHARED},
    {"ffn.experts.gate_up", DS4_LORA_EXPERTS},
    {"ffn.experts.down", DS4_LORA_EXPERTS},
};

uint32_t ds4_lora_sites(uint32_t targets, ds4_attn_type type) {
    uint32_t m = 0;
    for (int s = 0; s < DS4_LS_COUNT; s++) {
        if (!(targets & SITES[s].target)) continue;
        if ((s == DS4_LS_IDX_Q || s == DS4_LS_IDX_W) && type != DS4_ATTN_CSA) continue; /* only CSA has an indexer */
        m |= 1u << s;
    }
    return m;
}

/* The slot of table part `part` of site s in a view set. */
static float **slot_of(ds4_lora_layer *v, int32_t site, int32_t part) {
    ds4_lora_ab *ab[DS4_LS_COUNT] = {&v->wq_a, &v->wq_b, &v->wkv, &v->wo_a, &v->wo_b, &v->idx_wq_b, &v->idx_weights,
                                     &v->sw1, &v->sw2, &v->sw3, &v->e13, &v->e2};
    if (part == 2) return &v->e3B;
    return part == 0 ? &ab[site]->A : &ab[site]->B;
}

/* The parts of site s for rank r: shapes of A, B (and the gate_up's w3 half). Returns the number of parts. */
static int site_parts(const ds4_config *c, int32_t s, int64_t r, int32_t ndim[3], int64_t shape[3][3]) {
    const int64_t D = c->hidden_size, H = c->num_attention_heads, d = c->head_dim, qr = c->q_lora_rank;
    const int64_t G = c->o_groups, ol = c->o_lora_rank, E = c->n_routed_experts, I = c->moe_intermediate_size;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim;
    int64_t K = 0, O = 0;
    switch (s) {
    case DS4_LS_WQ_A: K = D, O = qr; break;
    case DS4_LS_WQ_B: K = qr, O = H * d; break;
    case DS4_LS_WKV: K = D, O = d; break;
    case DS4_LS_WO_B: K = G * ol, O = D; break;
    case DS4_LS_IDX_Q: K = qr, O = nI * cI; break;
    case DS4_LS_IDX_W: K = D, O = nI; break;
    case DS4_LS_SW1: case DS4_LS_SW3: K = D, O = I; break;
    case DS4_LS_SW2: K = I, O = D; break;
    case DS4_LS_WO_A: /* A shared by the groups, one B block [r, o_lora] per group */
        ndim[0] = 2, shape[0][0] = r, shape[0][1] = H * d / G;
        ndim[1] = 3, shape[1][0] = G, shape[1][1] = r, shape[1][2] = ol;
        return 2;
    case DS4_LS_EGU:
        ndim[0] = ndim[1] = ndim[2] = 3;
        shape[0][0] = shape[1][0] = shape[2][0] = E;
        shape[0][1] = shape[1][1] = shape[2][1] = r;
        shape[0][2] = D, shape[1][2] = shape[2][2] = I;
        return 3;
    case DS4_LS_EDOWN:
        ndim[0] = ndim[1] = 3;
        shape[0][0] = shape[1][0] = E, shape[0][1] = shape[1][1] = r;
        shape[0][2] = I, shape[1][2] = D;
        return 2;
    default: return 0;
    }
    ndim[0] = ndim[1] = 2;
    shape[0][0] = r, shape[0][1] = K;
    shape[1][0] = r, shape[1][1] = O;
    return 2;
}

void ds4_lora_rebind(const ds4_lora *l, ds4_lora_layer *views, float *base, int64_t L) {
    for (int64_t li = 0; li < L; li++) {
        memset(&views[li], 0, sizeof views[li]);
        views[li].r = l->r;
        views[li].s = l->s;
    }
    for (size_t i = 0; i < l->n_table; i++) {
        const ds4_lora_param *p = &l->table[i];
        *slot_of(&views[p->layer], p->site, p->part) = base + p->offset;
    }
}

ds4_status ds4_lora_alloc(const ds4_model *m, int64_t r, double alpha, int32_t rslora, const uint32_t *mask,
                          ds4_lora **out, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers;
    *out = NULL;
    if (r < 1 || r > 65536) return ds4_fail(err, DS4_ERR_ARG, "lora: rank %lld outside [1, 65536]", (long long)r);
    if (!isfinite(alpha)) return ds4_fail(err, DS4_ERR_ARG, "lora: alpha %g is not finite", alpha);
    ds4_lora *l = calloc(1, sizeof *l);
    if (!l) return ds4_fail(err, DS4_ERR_OOM, "lora: adapter set");
    l->r = r;
    l->alpha = alpha;
    l->rslora = rslora != 0;
    l->s = (float)(rslora ? alpha / sqrt((double)r) : alpha / (double)r);
    l->mask = calloc((size_t)L, sizeof *l->mask);
    size_t cap = (size_t)L * DS4_LS_COUNT * 3;
    l->table = calloc(cap ? cap : 1, sizeof *l->table);
    l->hw = calloc((size_t)L, sizeof *l->hw);
    l->hg = calloc((size_t)L, sizeof *l->hg);
    l->dw = calloc((size_t)L, sizeof *l->dw);
    l->dg = calloc((size_t)L, sizeof *l->dg);
    if (!l->mask || !l->table || !l->hw || !l->hg || !l->dw || !l->dg) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_OOM, "lora: tables for %lld layers", (long long)L);
    }
    memcpy(l->mask, mask, (size_t)L * sizeof *mask);
    static const char *const part_name[3] = {"lora_A", "lora_B", "lora_B_w3"};
    for (int64_t li = 0; li < L; li++)
        for (int32_t s = 0; s < DS4_LS_COUNT; s++) {
            if (!(mask[li] & (1u << s))) continue;
            int32_t nd[3];
            int64_t sh[3][3];
            const int np = site_parts(c, s, r, nd, sh);
            for (int k = 0; k < np; k++) {
                ds4_lora_param *p = &l->table[l->n_table++];
                char name[128];
                snprintf(name, sizeof name, "layers.%lld.%s.%s", (long long)li, SITES[s].name,
                         s == DS4_LS_EGU && k == 1 ? "lora_B_w1" : part_name[k]);
                p->name = strdup(name);
                p->ndim = nd[k];
                p->numel = 1;
                for (int32_t j = 0; j < nd[k]; j++) p->numel *= (p->shape[j] = sh[k][j]);
                p->offset = l->n;
                p->layer = (int32_t)li, p->site = s, p->part = k;
                l->n += p->numel;
                if (!p->name) {
                    ds4_lora_free(NULL, l);
                    return ds4_fail(err, DS4_ERR_OOM, "lora: names");
                }
            }
        }
    if (l->n == 0) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_ARG, "lora: no adapted weight (the targets select nothing in this model)");
    }
    if (!(l->params = calloc((size_t)l->n, sizeof(float)))) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_OOM, "lora: %lld fp32 adapter values", (long long)l->n);
    }
    ds4_lora_rebind(l, l->hw, l->params, L);
    *out = l;
    return DS4_OK;
}

void ds4_lora_point_views(ds4_model *m, const ds4_lora *l) {
    const int64_t L = m->cfg.num_hidden_layers;
    for (int64_t li = 0; li < L; li++) {
        m->w.layers[li].lora = l ? &l->hw[li] : NULL;
        m->dev_w.layers[li].lora = l && l->dparams ? &l->dw[li] : NULL;
        m->gw.layers[li].lora = l && (l->dgrads || l->grads) ? (l->dgrads ? &l->dg[li] : &l->hg[li]) : NULL;
    }
}

void ds4_lora_free(ds4_model *m, ds4_lora *l) {
    if (!l) return;
    if (m && m->lora == l) {
        (void)ds4_lora_release_backend(m, NULL);
        m->lora = NULL;
        ds4_lora_point_views(m, NULL);
    }
    for (size_t i = 0; i < l->n_table; i++) free(l->table[i].name);
    free(l->table);
    free(l->mask);
    free(l->params);
    free(l->grads);
    free(l->hw);
    free(l->hg);
    free(l->dw);
    free(l->dg);
    free(l);
}

/* The training forward on the tape was made with other adapters (or none): it must not be differentiated. */
static void drop_tape(ds4_model *m) {
    if (m->tape) m->tape->valid = 0;
}

ds4_status ds4_lora_attach(ds4_model *m, ds4_lora *l, ds4_error *err) {
    int routed = 0; /* adapters on the routed experts in some layer */
    for (int64_t li = 0; li < m->cfg.num_hidden_layers; li++) routed |= (l->mask[li] & (1u << DS4_LS_EGU | 1u << DS4_LS_EDOWN)) != 0;
    if (m->ep_on && routed) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "lora: adapters on the routed experts are not supported with expert "
                                                  "parallelism (turn it off first, or leave the experts out of the "
                                                  "targets)");
    }
    if (m->ep_shard) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "lora: adapters are not supported on a model whose routed experts "
                                                  "are sharded (expert parallelism, shard = true)");
    }
    if (m->cp_on) {
        ds4_lora_free(NULL, l);
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "lora: adapters are not supported with context parallelism (turn it "
                                                  "off first)");
    }
    ds4_status s = ds4_model_drop_train_state(m, err); /* no frozen weight keeps a gradient */
    if (s) {
        ds4_lora_free(NULL, l);
        return s;
    }
    ds4_model_drop_lora(m);
    drop_tape(m);
    m->lora = l;
    ds4_lora_point_views(m, l);
    s = ds4_lora_to_backend(m, err);
    if (s) {
        ds4_model_drop_lora(m);
        return s;
    }
    ds4_lora_point_views(m, l);
    return DS4_OK;
}

ds4_status ds4_lora_enable_grad(ds4_model *m, ds4_error *err) {
    ds4_lora *l = m->lora;
    if (!l->grads) {
        if (!(l->grads = calloc((size_t)l->n, sizeof(float))))
            return ds4_fail(err, DS4_ERR_OOM, "enable_grad: %lld fp32 adapter gradients", (long long)l->n);
        ds4_lora_rebind(l, l->hg, l->grads, m->cfg.num_hidden_layers);
    }
    ds4_lora_point_views(m, l);
    ds4_status s = ds4_lora_train_bind(m, err);
    ds4_lora_point_views(m, l);
    return s;
}

int ds4_lora_trainable(const ds4_model *m, const ds4_lora_param *p) {
    if ((p->site == DS4_LS_IDX_Q || p->site == DS4_LS_IDX_W) && !(m->topt.indexer_kl > 0)) return 0;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ public */

static ds4_status check_model(const ds4_model *m, const char *what, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "%s: model is NULL", what);
    return DS4_OK;
}

ds4_status ds4_model_lora(ds4_model *m, const ds4_lora_options *o, ds4_error *err) {
    ds4_status s = check_model(m, "lora", err);
    if (s) return s;
    if (!o) return ds4_fail(err, DS4_ERR_ARG, "lora: options are NULL");
    if (o->dropout != 0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                        "lora: dropout %g; only 0 is supported (a dropout mask would make the rollout's and the "
                        "trainer's log-probabilities differ)", o->dropout);
    if (!o->targets || (o->targets & ~(uint32_t)DS4_LORA_ALL))
        return ds4_fail(err, DS4_ERR_ARG, "lora: targets 0x%x (expected a non-empty set of DS4_LORA_* bits)",
                        (unsigned)o->targets);
    const int64_t L = m->cfg.num_hidden_layers;
    uint32_t *mask = calloc((size_t)L, sizeof *mask);
    if (!mask) return ds4_fail(err, DS4_ERR_OOM, "lora: masks");
    for (int64_t li = 0; li < L; li++) mask[li] = ds4_lora_sites(o->targets, m->cfg.layer_types[li]);
    ds4_lora *l = NULL;
    s = ds4_lora_alloc(m, o->rank, o->alpha, o->rslora, mask, &l, err);
    free(mask);
    if (s) return s;
    /* PEFT's default: A ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)), B = 0 */
    uint64_t st = o->seed;
    for (size_t i = 0; i < l->n_table; i++) {
        const ds4_lora_param *p = &l->table[i];
        if (p->part != 0) continue;
        const double bound = 1.0 / sqrt((double)p->shape[p->ndim - 1]);
        float *a = l->params + p->offset;
        for (int64_t k = 0; k < p->numel; k++) a[k] = (float)((2.0 * ds4_uniform01(&st) - 1.0) * bound);
    }
    return ds4_lora_attach(m, l, err);
}

void ds4_model_drop_lora(ds4_model *m) {
    if (!m || !m->lora) return;
    m->params_gen++; /* adapters attached later may sit at the same address: no optimizer's bounds carry over */
    drop_tape(m);
    ds4_lora_free(m, m->lora);
}

int ds4_model_has_lora(const ds4_model *m) { return m && m->lora; }

ds4_status ds4_model_lora_info(const ds4_model *m, int64_t *rank, double *scale, int64_t *numel, ds4_error *err) {
    ds4_status s = check_model(m, "lora info", err);
    if (s) return s;
    if (rank) *rank = m->lora ? m->lora->r : 0;
    if (scale) *scale = m->lora ? m->lora->s : 0;
    if (numel) *numel = m->lora ? m->lora->n : 0;
    return DS4_OK;
}

ds4_status ds4_model_lora_layout(const ds4_model *m, int64_t *rank, double *alpha, int32_t *rslora, uint32_t *masks,
                                 int64_t cap, ds4_error *err) {
    ds4_status s = check_model(m, "lora layout", err);
    if (s) return s;
    if (!m->lora) return ds4_fail(err, DS4_ERR_ARG, "lora layout: the model has no adapters");
    const int64_t L = m->cfg.num_hidden_layers;
    if (masks && cap < L) return ds4_fail(err, DS4_ERR_ARG, "lora layout: room for %lld masks, the model has %lld layers",
                                          (long long)cap, (long long)L);
    if (rank) *rank = m->lora->r;
    if (alpha) *alpha = m->lora->alpha;
    if (rslora) *rslora = m->lora->rslora;
    if (masks) memcpy(masks, m->lora->mask, (size_t)L * sizeof *masks);
    return DS4_OK;
}

/* Every layer's mask names only weights the layer has (the indexer's on CSA layers). */
static ds4_status check_masks(const ds4_model *m, const uint32_t *masks, int64_t n, const char *what, ds4_error *err) {
    const int64_t L = m->cfg.num_hidden_layers;
    if (!masks || n != L)
        return ds4_fail(err, DS4_ERR_ARG, "%s: %lld layer masks for a model of %lld layers", what, (long long)n,
                        (long long)L);
    for (int64_t li = 0; li < L; li++)
        if (masks[li] & ~ds4_lora_sites(DS4_LORA_ALL, m->cfg.layer_types[li]))
            return ds4_fail(err, DS4_ERR_ARG, "%s: layer %lld's mask 0x%x names weights the layer does not have (its "
                            "possible sites: 0x%x)", what, (long long)li, (unsigned)masks[li],
                            (unsigned)ds4_lora_sites(DS4_LORA_ALL, m->cfg.layer_types[li]));
    return DS4_OK;
}

ds4_status ds4_model_lora_layout_numel(const ds4_model *m, int64_t rank, const uint32_t *masks, int64_t n,
                                       int64_t *numel, ds4_error *err) {
    ds4_status s = check_model(m, "lora layout numel", err);
    if (!s) s = check_masks(m, masks, n, "lora layout numel", err);
    if (s) return s;
    if (rank < 1 || rank > 65536)
        return ds4_fail(err, DS4_ERR_ARG, "lora layout numel: rank %lld outside [1, 65536]", (long long)rank);
    int64_t total = 0;
    for (int64_t li = 0; li < n; li++)
        for (int32_t site = 0; site < DS4_LS_COUNT; site++) {
            if (!(masks[li] & (1u << site))) continue;
            int32_t nd[3];
            int64_t sh[3][3];
            const int np = site_parts(&m->cfg, site, rank, nd, sh);
            for (int k = 0; k < np; k++) {
                int64_t e = 1;
                for (int32_t j = 0; j < nd[k]; j++) e *= sh[k][j];
                total += e;
            }
        }
    *numel = total;
    return DS4_OK;
}

ds4_status ds4_model_lora_attach_layout(ds4_model *m, int64_t rank, double alpha, int32_t rslora, const uint32_t *masks,
                                        int64_t n, ds4_error *err) {
    ds4_status s = check_model(m, "lora attach layout", err);
    if (s) return s;
    if ((s = check_masks(m, masks, n, "lora attach layout", err))) return s;
    ds4_lora *l = NULL;
    if ((s = ds4_lora_alloc(m, rank, alpha, rslora, masks, &l, err))) return s;
    return ds4_lora_attach(m, l, err);
}

/* The host copy, brought up to date, and the element count n checked against the adapters'. */
static ds4_status flat_access(ds4_model *m, int64_t n, const char *what, ds4_error *err) {
    ds4_status s = check_model(m, what, err);
    if (s) return s;
    if (!m->lora) return ds4_fail(err, DS4_ERR_ARG, "%s: the model has no adapters", what);
    if (n != m->lora->n)
        return ds4_fail(err, DS4_ERR_SHAPE, "%s: %lld values given, the adapters have %lld", what, (long long)n,
                        (long long)m->lora->n);
    return ds4_lora_host_sync(m, err);
}

ds4_status ds4_model_lora_read(ds4_model *m, float *dst, int64_t n, ds4_error *err) {
    ds4_status s = flat_access(m, n, "lora read", err);
    if (!s) memcpy(dst, m->lora->params, (size_t)n * sizeof *dst);
    return s;
}

ds4_status ds4_model_lora_write(ds4_model *m, const float *src, int64_t n, ds4_error *err) {
    ds4_status s = flat_access(m, n, "lora write", err);
    if (s) return s;
    memcpy(m->lora->params, src, (size_t)n * sizeof *src);
    ds4_lora_params_changed(m);
    drop_tape(m);
    return DS4_OK;
}

int ds4_model_grad_enabled(const ds4_model *m) {
    if (!m) return 0;
    return m->lora ? m->lora->grads != NULL : m->grads != NULL;
}

/* W [O, K] += s·Bᵀ A over the rows `rows` of one output block: W[o, k] += s Σ_j B[j, o]·A[j, k], in double. */
static void merge_block(float *W, int64_t ldw, const float *A, const float *B, int64_t ldb, int64_t r, int64_t O,
                        int64_t K, double s) {
    for (int64_t o = 0; o < O; o++)
        for (int64_t k = 0; k < K; k++) {
            double acc = 0;
            for (int64_t j = 0; j < r; j++) acc += (double)B[j * ldb + o] * (double)A[j * K + k];
            W[o * ldw + k] = (float)((double)W[o * ldw + k] + s * acc);
        }
}

ds4_status ds4_model_merge_lora(ds4_model *m, ds4_error *err) {
    ds4_status s = check_model(m, "merge_lora", err);
    if (s) return s;
    if (!m->lora) return ds4_fail(err, DS4_ERR_ARG, "merge_lora: the model has no adapters");
    int expert_adapters = 0;
    for (int64_t li = 0; li < m->cfg.num_hidden_layers; li++)
        expert_adapters |= m->lora->hw[li].e13.A || m->lora->hw[li].e2.A;
    if (ds4_model_has_fp4(m) && expert_adapters)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "merge_lora: the routed experts are FP4-resident (packed as loaded); "
                        "merging their adapters would re-quantise them: load without fp4_experts to merge");
    if ((s = ds4_lora_host_sync(m, err)) || (s = ds4_model_host_sync(m, err))) return s;
    const ds4_config *c = &m->cfg;
    const ds4_lora *l = m->lora;
    const int64_t L = c->num_hidden_layers, r = l->r, E = c->n_routed_experts, I = c->moe_intermediate_size;
    const int64_t D = c->hidden_size, G = c->o_groups, ol = c->o_lora_rank, gw = c->num_attention_heads * c->head_dim / G;
    const double sc = l->s;
    for (int64_t li = 0; li < L; li++) {
        const ds4_lora_layer *a = &l->hw[li];
        const ds4_layer_w *w = &m->w.layers[li];
        const struct {
            const ds4_lora_ab *ab;
            float *W;
            int64_t O, K;
        } plain[] = {{&a->wq_a, w->wq_a, c->q_lora_rank, D}, {&a->wq_b, w->wq_b, c->num_attention_heads * c->head_dim, c->q_lora_rank},
                     {&a->wkv, w->wkv, c->head_dim, D}, {&a->wo_b, w->wo_b, D, G * ol},
                     {&a->idx_wq_b, w->idx_wq_b, c->index_n_heads * c->index_head_dim, c->q_lora_rank},
                     {&a->idx_weights, w->idx_weights, c->index_n_heads, D}, {&a->sw1, w->sw1, I, D},
                     {&a->sw2, w->sw2, D, I}, {&a->sw3, w->sw3, I, D}};
        for (size_t k = 0; k < sizeof plain / sizeof plain[0]; k++)
            if (plain[k].ab->A) merge_block(plain[k].W, plain[k].K, plain[k].ab->A, plain[k].ab->B, plain[k].O, r,
                                            plain[k].O, plain[k].K, sc);
        if (a->wo_a.A)
            for (int64_t g = 0; g < G; g++)
                merge_block(w->wo_a + g * ol * gw, gw, a->wo_a.A, a->wo_a.B + g * r * ol, ol, r, ol, gw, sc);
        for (int64_t e = 0; a->e13.A && e < E; e++) {
            merge_block(w->w1 + e * I * D, D, a->e13.A + e * r * D, a->e13.B + e * r * I, I, r, I, D, sc);
            merge_block(w->w3 + e * I * D, D, a->e13.A + e * r * D, a->e3B + e * r * I, I, r, I, D, sc);
        }
        for (int64_t e = 0; a->e2.A && e < E; e++)
            merge_block(w->w2 + e * D * I, I, a->e2.A + e * r * I, a->e2.B + e * r * D, D, r, D, I, sc);
    }
    ds4_model_drop_lora(m);
    ds4_model_params_changed(m);
    return DS4_OK;
}
