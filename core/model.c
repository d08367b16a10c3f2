/* model.c — the parameter table, loading a checkpoint into the flat buffer, random initialisation. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "internal.h"
#include "shape_limits.h"
#include "lora.h"
#include "model.h"
#include "ds4_gen.h"
#include "ops.h"
#include "quant.h"
#include "sched.h"

/* ------------------------------------------------------------------------------------------------ table */

/* One walk over every tensor of the model (walk_model), in table order. Recording (bind NULL) appends a table
 * entry per tensor and counts offsets; binding re-walks the same calls and points each view of `w` at the
 * memory bind() gives for the entry with that index, so any backend's copy gets the same views. */
typedef struct builder {
    ds4_model *m;
    ds4_weights *w;
    size_t cap, next;
    int64_t f32_off, i32_off, q4_off;
    void *(*bind)(struct builder *b, const ds4_param *p, size_t i);
    char *base;
    int32_t *i32_base;
    int64_t (*byte_offset)(const ds4_model *m, size_t i, void *ctx);
    void *ctx;
    ds4_status st;
    ds4_error *err;
} builder;

static void add(builder *b, ds4_dtype dt, void **slot, int32_t ndim, const int64_t *shape,
                const char *fmt, ...) DS4_PRINTF(6, 7);

static void add(builder *b, ds4_dtype dt, void **slot, int32_t ndim, const int64_t *shape,
                const char *fmt, ...) {
    if (b->st) return;
    ds4_model *m = b->m;
    if (b->bind) {
        const size_t i = b->next++;
        if (slot) *slot = b->bind(b, &m->table[i], i);
        return;
    }
    if (m->n_table == b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        ds4_param *t = realloc(m->table, nc * sizeof *t);
        if (!t) {
            b->st = ds4_fail(b->err, DS4_ERR_OOM, "model alloc: parameter table of %zu entries", nc);
            return;
        }
        m->table = t;
        b->cap = nc;
    }
    ds4_param *p = &m->table[m->n_table];
    memset(p, 0, sizeof *p);
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    p->name = strdup(name);
    if (!p->name) {
        b->st = ds4_fail(b->err, DS4_ERR_OOM, "model alloc: name %s", name);
        return;
    }
    p->ndim = ndim;
    p->numel = 1;
    for (int32_t i = 0; i < ndim; i++) {
        p->shape[i] = shape[i];
        p->numel *= shape[i];
    }
    p->dtype = dt;
    p->lowp = dt == DS4_F32 && ds4_param_lowp(name, ndim);
    p->follows = slot == NULL; /* routed experts e > 0: reached as expert 0's view + e·stride */
    if (dt == DS4_F32) {
        p->offset = p->goff = b->f32_off;
        b->f32_off += p->numel;
    } else if (dt == DS4_FP4_PACKED) { /* its bytes; the scales are placed by add_experts */
        p->offset = b->q4_off;
        b->q4_off += p->numel / 2;
    } else {
        p->offset = b->i32_off;
        b->i32_off += p->numel;
    }
    if (slot) *slot = NULL; /* bound once the buffer exists */
    m->n_table++;
}

int ds4_param_lowp(const char *name, int32_t ndim) {
    static const char *const fp32[] = {"_fn", ".ape", "ffn.gate.weight", "tid2eid", NULL};
    if (ndim != 2) return 0;
    const size_t n = strlen(name);
    for (int i = 0; fp32[i]; i++) {
        const size_t k = strlen(fp32[i]);
        if (n >= k && strcmp(name + n - k, fp32[i]) == 0) return 0;
    }
    return 1;
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int32_t)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define ADD(b, slot, pre, fmt, ...) add((b), DS4_F32, (void **)(slot), NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), "%s" fmt, pre)

static void add_compressor(builder *b, ds4_compressor_w *c, const char *pre, const char *part, int64_t D,
                           int64_t dd, int64_t rate, int overlap) {
    c->dd = dd;
    c->rate = rate;
    c->width = overlap ? 2 * dd : dd;
    char p[160];
    snprintf(p, sizeof p, "%s%s", pre, part);
    ADD(b, &c->wkv, p, "wkv.weight", c->width, D);
    ADD(b, &c->wgate, p, "wgate.weight", c->width, D);
    ADD(b, &c->ape, p, "ape", rate, c->width);
    ADD(b, &c->norm, p, "norm.weight", dd);
}

/* The E routed experts of one kind (0 w1, 1 w2, 2 w3) of block li, [rows, cols] each, contiguous: in the flat fp32
 * buffer, or FP4-resident in q4 (their bytes, then their scales) where m->fp4_kinds says so. Binding points the
 * kind's view at expert 0 and records what it holds (edt, escale). */
static void add_experts(builder *b, ds4_layer_w *l, int64_t li, int kind, int64_t E, int64_t rows, int64_t cols,
                        const char *pre) {
    static const char *const names[3] = {"w1", "w2", "w3"};
    float **slot = kind == 0 ? &l->w1 : kind == 1 ? &l->w2 : &l->w3;
    const ds4_model *m = b->m;
    const size_t first = b->bind ? b->next : m->n_table;
    const int packed = b->bind ? b->next < m->n_table && m->table[b->next].dtype == DS4_FP4_PACKED
                               : m->fp4_kinds && m->fp4_kinds[li * 3 + kind];
    for (int64_t e = 0; e < E; e++) {
        add(b, packed ? DS4_FP4_PACKED : DS4_F32, e ? NULL : (void **)slot, 2, SHAPE(rows, cols),
            "%sffn.experts.%lld.%s.weight", pre, (long long)e, names[kind]);
        if (!b->st && !b->bind) m->table[m->n_table - 1].routed = (int32_t)(e + 1);
    }
    if (b->st) return;
    if (b->bind && m->table[first].elsewhere) { /* sharded experts: the view starts at this rank's first expert */
        *slot = NULL;
        for (int64_t e = 0; e < E && !*slot; e++)
            if (!m->table[first + (size_t)e].elsewhere) *slot = b->bind(b, &m->table[first + (size_t)e], first + (size_t)e);
    }
    if (b->bind) { /* the scales lie as far from expert 0's bytes in the backend's copy as in q4 (backend.c) */
        l->edt[kind] = packed ? DS4_FP4_PACKED : b->w->mdt;
        l->escale[kind] = packed && *slot ? (const uint8_t *)*slot + (m->table[first].qscale - m->table[first].offset)
                                          : NULL;
        return;
    }
    if (!packed) return;
    for (int64_t e = 0; e < E; e++) /* the scales after the E experts' bytes */
        b->m->table[first + (size_t)e].qscale = b->q4_off + e * (rows * cols / DS4_FP4_BLOCK);
    b->q4_off += E * (rows * cols / DS4_FP4_BLOCK);
}

/* One decoder block's parameters under `pre` ("layers.3." or "mtp.0."); li its index (L: the MTP block). */
static void add_block(builder *b, ds4_layer_w *l, int64_t li, const ds4_config *c, const char *pre) {
    const int64_t D = c->hidden_size, n = c->hc_mult, mix = (2 + n) * n, H = c->num_attention_heads;
    const int64_t d = c->head_dim, E = c->n_routed_experts, I = c->moe_intermediate_size, K = c->num_experts_per_tok;
    ADD(b, &l->attn_norm, pre, "attn_norm.weight", D);
    ADD(b, &l->ffn_norm, pre, "ffn_norm.weight", D);
    ADD(b, &l->hc_attn.fn, pre, "hc_attn_fn", mix, n * D);
    ADD(b, &l->hc_attn.base, pre, "hc_attn_base", mix);
    ADD(b, &l->hc_attn.scale, pre, "hc_attn_scale", 3);
    ADD(b, &l->hc_ffn.fn, pre, "hc_ffn_fn", mix, n * D);
    ADD(b, &l->hc_ffn.base, pre, "hc_ffn_base", mix);
    ADD(b, &l->hc_ffn.scale, pre, "hc_ffn_scale", 3);
    ADD(b, &l->wq_a, pre, "attn.wq_a.weight", c->q_lora_rank, D);
    ADD(b, &l->q_norm, pre, "attn.q_norm.weight", c->q_lora_rank);
    ADD(b, &l->wq_b, pre, "attn.wq_b.weight", H * d, c->q_lora_rank);
    ADD(b, &l->wkv, pre, "attn.wkv.weight", d, D);
    ADD(b, &l->kv_norm, pre, "attn.kv_norm.weight", d);
    ADD(b, &l->wo_a, pre, "attn.wo_a.weight", c->o_groups * c->o_lora_rank, H * d / c->o_groups);
    ADD(b, &l->wo_b, pre, "attn.wo_b.weight", D, c->o_groups * c->o_lora_rank);
    ADD(b, &l->sink, pre, "attn.attn_sink", H);
    if (l->type == DS4_ATTN_CSA) {
        add_compressor(b, &l->comp, pre, "attn.compressor.", D, d, c->compress_rate_csa, 1);
        add_compressor(b, &l->idx_comp, pre, "attn.indexer.compressor.", D, c->index_head_dim, c->compress_rate_csa, 1);
        ADD(b, &l->idx_wq_b, pre, "attn.indexer.wq_b.weight", c->index_n_heads * c->index_head_dim, c->q_lora_rank);
        ADD(b, &l->idx_weights, pre, "attn.indexer.weights_proj.weight", c->index_n_heads, D);
    } else if (l->type == DS4_ATTN_HCA) {
        add_compressor(b, &l->comp, pre, "attn.compressor.", D, d, c->compress_rate_hca, 0);
    }
    ADD(b, &l->gate, pre, "ffn.gate.weight", E, D);
    if (l->is_hash)
        add(b, DS4_I32, (void **)&l->tid2eid, 2, SHAPE(c->vocab_size, K), "%sffn.gate.tid2eid", pre);
    else
        ADD(b, &l->gate_bias, pre, "ffn.gate.bias", E);
    /* experts contiguous per matrix kind: w1 [E, I, D], w2 [E, D, I], w3 [E, I, D] */
    add_experts(b, l, li, 0, E, I, D, pre);
    add_experts(b, l, li, 1, E, D, I, pre);
    add_experts(b, l, li, 2, E, I, D, pre);
    ADD(b, &l->sw1, pre, "ffn.shared_experts.w1.weight", I, D);
    ADD(b, &l->sw2, pre, "ffn.shared_experts.w2.weight", D, I);
    ADD(b, &l->sw3, pre, "ffn.shared_experts.w3.weight", I, D);
}

/* Every tensor of the model, in table order, into b->w (whose layers array holds L entries). */
static void walk_model(builder *b) {
    const ds4_config *cfg = &b->m->cfg;
    ds4_weights *w = b->w;
    const int64_t L = cfg->num_hidden_layers, D = cfg->hidden_size, V = cfg->vocab_size, n = cfg->hc_mult;
    ADD(b, &w->embed, "", "embed.weight", V, D);
    for (int64_t i = 0; i < L; i++) {
        ds4_layer_w *l = &w->layers[i];
        l->type = cfg->layer_types[i];
        l->is_hash = cfg->layer_is_hash[i];
        char pre[32];
        snprintf(pre, sizeof pre, "layers.%lld.", (long long)i);
        add_block(b, l, i, cfg, pre);
    }
    ADD(b, &w->norm, "", "norm.weight", D);
    ADD(b, &w->hc_head_fn, "", "hc_head_fn", n, n * D);
    ADD(b, &w->hc_head_base, "", "hc_head_base", n);
    ADD(b, &w->hc_head_scale, "", "hc_head_scale", 1);
    if (!cfg->tie_word_embeddings) ADD(b, &w->head, "", "head.weight", V, D);
    if (b->m->has_mtp) {
        ds4_mtp_w *t = &w->mtp;
        t->block.type = DS4_ATTN_SLIDING; /* official compress_ratios[n_layers] = 0 */
        t->block.is_hash = 0;
        add_block(b, &t->block, L, cfg, "mtp.0.");
        ADD(b, &t->e_proj, "mtp.0.", "e_proj.weight", D, D);
        ADD(b, &t->h_proj, "mtp.0.", "h_proj.weight", D, D);
        ADD(b, &t->enorm, "mtp.0.", "enorm.weight", D);
        ADD(b, &t->hnorm, "mtp.0.", "hnorm.weight", D);
        ADD(b, &t->norm, "mtp.0.", "norm.weight", D);
        ADD(b, &t->hc_head_fn, "mtp.0.", "hc_head_fn", n, n * D);
        ADD(b, &t->hc_head_base, "mtp.0.", "hc_head_base", n);
        ADD(b, &t->hc_head_scale, "mtp.0.", "hc_head_scale", 1);
    }
    if (cfg->tie_word_embeddings) w->head = w->embed;
}

static void *bind_entry(builder *b, const ds4_param *p, size_t i) {
    /* FP4-resident experts: the host's q4, or the backend's copy of it (byte offsets in dev_off, backend.c); they
     * have no gradient */
    if (p->dtype == DS4_FP4_PACKED) {
        if (b->w == &b->m->w) return b->m->q4 + p->offset;
        return b->w == &b->m->dev_w && b->m->dev_off ? b->base + b->m->dev_off[i] : NULL;
    }
    if (p->dtype != DS4_F32) return b->i32_base ? b->i32_base + p->offset : NULL; /* a gradient set has no tables */
    if (p->elsewhere) return NULL; /* sharded experts: another rank's */
    return b->base + b->byte_offset(b->m, i, b->ctx);
}

void ds4_weights_bind(const ds4_model *m, ds4_weights *w, ds4_dtype mdt, char *base,
                      int64_t (*byte_offset)(const ds4_model *m, size_t i, void *ctx), void *ctx, int32_t *i32_base) {
    ds4_layer_w *layers = w->layers;
    memset(w, 0, sizeof *w);
    w->layers = layers;
    w->mdt = mdt;
    w->bf16_in = mdt == DS4_BF16 || (w == &m->w && m->emulate_bf16);
    builder b = {.m = (ds4_model *)m, .w = w, .bind = bind_entry, .base = base, .i32_base = i32_base,
                 .byte_offset = byte_offset, .ctx = ctx};
    walk_model(&b);
}

void ds4_weights_clear(const ds4_model *m, ds4_weights *w) {
    ds4_layer_w *layers = w->layers;
    const ds4_dtype mdt = w->mdt;
    for (int64_t li = 0; li < m->cfg.num_hidden_layers; li++) {
        const ds4_lora_layer *lo = layers[li].lora;
        memset(&layers[li], 0, sizeof layers[li]);
        layers[li].type = m->cfg.layer_types[li];
        layers[li].is_hash = m->cfg.layer_is_hash[li];
        layers[li].lora = lo;
    }
    memset(w, 0, sizeof *w);
    w->layers = layers;
    w->mdt = mdt;
}

void ds4_model_emulate_bf16(ds4_model *m, int on) {
    m->emulate_bf16 = on != 0;
    m->w.bf16_in = on != 0;
}

ds4_status ds4_model_set_kv_qat(ds4_model *m, int on, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "kv_qat: NULL model");
    const int64_t cI = m->cfg.index_head_dim;
    if (on && ds4_model_csa_layers(m) > 0 && (cI < 1 || (cI & (cI - 1))))
        return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                        "kv_qat: the indexer's Hadamard rotation needs index_head_dim to be a power of two, got %lld",
                        (long long)cI);
    m->kv_qat = on != 0;
    return DS4_OK;
}

int ds4_model_kv_qat(const ds4_model *m) { return m && m->kv_qat; }

ds4_status ds4_model_set_bf16_emulation(ds4_model *m, int on, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "bf16 emulation: NULL model");
    if (m->dev_opt.type != DS4_DEVICE_CPU)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "bf16 emulation: a model on the CPU only (this one is on %s)",
                        ds4_model_device_name(m));
    ds4_model_emulate_bf16(m, on);
    return DS4_OK;
}

int ds4_model_bf16_emulation(const ds4_model *m) { return m && m->emulate_bf16; }

int64_t ds4_f32_byte_offset(const ds4_model *m, size_t i, void *ctx) {
    (void)ctx;
    return m->table[i].offset * (int64_t)sizeof(float);
}

typedef struct {
    const char *name;
    size_t idx;
} name_idx;

static int cmp_name_idx(const void *a, const void *b) {
    return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

ds4_status ds4_model_alloc(ds4_engine *e, const ds4_config *cfg, int with_mtp, ds4_model **out, ds4_error *err) {
    return ds4_model_alloc_fp4(e, cfg, with_mtp, NULL, out, err);
}

int ds4_model_has_fp4(const ds4_model *m) { return m && m->q4 != NULL; }
int64_t ds4_model_fp4_bytes(const ds4_model *m) { return m ? m->n_q4 : 0; }

ds4_status ds4_model_alloc_fp4(ds4_engine *e, const ds4_config *cfg, int with_mtp, const uint8_t *fp4_kinds,
                               ds4_model **out, ds4_error *err) {
    ds4_status s = ds4_config_validate(cfg, err);
    if (s) return s;
    /* the shape limits every backend's kernels rely on (shape_limits.h) */
    if (cfg->hc_mult > DS4_MAX_HC)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model alloc: hc_mult %lld > %d", (long long)cfg->hc_mult, DS4_MAX_HC);
    if (cfg->num_experts_per_tok > DS4_MAX_TOPK_EXPERTS)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model alloc: num_experts_per_tok %lld > %d",
                        (long long)cfg->num_experts_per_tok, DS4_MAX_TOPK_EXPERTS);
    if (cfg->rope_main.dim > DS4_MAX_ROPE_DIM || cfg->rope_compress.dim > DS4_MAX_ROPE_DIM)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model alloc: rotary width %lld / %lld > %d",
                        (long long)cfg->rope_main.dim, (long long)cfg->rope_compress.dim, DS4_MAX_ROPE_DIM);
    if (cfg->compress_rate_csa > DS4_MAX_RATE || cfg->compress_rate_hca > DS4_MAX_RATE)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model alloc: compress rates %lld / %lld > %d",
                        (long long)cfg->compress_rate_csa, (long long)cfg->compress_rate_hca, DS4_MAX_RATE);
    if (cfg->n_routed_experts > DS4_MAX_EXPERTS)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model alloc: n_routed_experts %lld > %d",
                        (long long)cfg->n_routed_experts, DS4_MAX_EXPERTS);
    ds4_model *m = calloc(1, sizeof *m);
    if (!m) return ds4_fail(err, DS4_ERR_OOM, "model alloc: model struct");
    m->engine = e;
    m->cfg = *cfg;
    m->has_mtp = with_mtp;
    const int64_t L = cfg->num_hidden_layers;
    m->w.layers = calloc((size_t)L, sizeof *m->w.layers);
    m->dev_w.layers = calloc((size_t)L, sizeof *m->dev_w.layers);
    m->gw.layers = calloc((size_t)L, sizeof *m->gw.layers);
    if (!m->w.layers || !m->dev_w.layers || !m->gw.layers) {
        ds4_model_free(m);
        return ds4_fail(err, DS4_ERR_OOM, "model alloc: %lld layers", (long long)L);
    }
    if (fp4_kinds) {
        if (!(m->fp4_kinds = malloc((size_t)(L + 1) * 3))) {
            ds4_model_free(m);
            return ds4_fail(err, DS4_ERR_OOM, "model alloc: FP4 flags");
        }
        memcpy(m->fp4_kinds, fp4_kinds, (size_t)(L + 1) * 3);
    }
    builder b = {.m = m, .w = &m->w, .err = err};
    walk_model(&b);
    if (b.st) {
        ds4_model_free(m);
        return b.st;
    }
    m->n_params = b.f32_off;
    m->n_tid2eid = b.i32_off;
    m->n_q4 = b.q4_off;
    if (m->n_q4 > 0 && !(m->q4 = malloc((size_t)m->n_q4))) {
        ds4_model_free(m);
        return ds4_fail(err, DS4_ERR_OOM, "model alloc: %lld bytes of FP4-resident experts", (long long)m->n_q4);
    }
    size_t bytes;
    if (!ds4_mul_size((size_t)m->n_params, sizeof(float), &bytes) || !(m->params = calloc(1, bytes ? bytes : 1))) {
        ds4_model_free(m);
        return ds4_fail(err, DS4_ERR_OOM, "model alloc: %lld fp32 parameters", (long long)b.f32_off);
    }
    m->tid2eid_all = calloc((size_t)(m->n_tid2eid ? m->n_tid2eid : 1), sizeof(int32_t));
    m->sorted = malloc(m->n_table * sizeof *m->sorted);
    if (!m->tid2eid_all || !m->sorted) {
        ds4_model_free(m);
        return ds4_fail(err, DS4_ERR_OOM, "model alloc: tables");
    }
    name_idx *byname = malloc(m->n_table * sizeof *byname);
    if (!byname) {
        ds4_model_free(m);
        return ds4_fail(err, DS4_ERR_OOM, "model alloc: name index");
    }
    for (size_t i = 0; i < m->n_table; i++) {
        byname[i].name = m->table[i].name;
        byname[i].idx = i;
    }
    qsort(byname, m->n_table, sizeof *byname, cmp_name_idx);
    for (size_t i = 0; i < m->n_table; i++) m->sorted[i] = byname[i].idx;
    free(byname);
    ds4_weights_bind(m, &m->w, DS4_F32, (char *)m->params, ds4_f32_byte_offset, NULL, m->tid2eid_all);
    if ((s = ds4_cpu_dev_create(e->pool, &m->cpu, err))) {
        ds4_model_free(m);
        return s;
    }
    m->dev = m->cpu;
    m->dw = &m->w;
    *out = m;
    return DS4_OK;
}

int64_t ds4_model_find(const ds4_model *m, const char *name) {
    size_t lo = 0, hi = m->n_table;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(m->table[m->sorted[mid]].name, name);
        if (c == 0) return (int64_t)m->sorted[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

void ds4_model_free(ds4_model *m) {
    if (!m) return;
    ds4_model_grads_unguard(m); /* a reduction still writing the gradients ends first */
    /* first: giving the training state back rebinds the host gradients through m->table (free_train_state) */
    ds4_model_drop_lora(m);
    ds4_model_release_backend(m);
    for (size_t i = 0; i < m->n_table; i++) {
        free(m->table[i].name);
        free(m->table[i].src);
        free(m->table[i].src_scale);
        free(m->table[i].sbytes);
    }
    free(m->table);
    free(m->sorted);
    free(m->params);
    free(m->ep_full);
    free(m->tid2eid_all);
    free(m->q4);
    free(m->fp4_kinds);
    free(m->w.layers);
    free(m->dev_w.layers);
    free(m->gw.layers);
    free(m->rope_cs[0]);
    free(m->rope_cs[1]);
    free(m->grads);
    free(m->grad_regions);
    free(m->router_loads);
    free(m->ep_host);
    ds4_ep_saved_free(m);
    free(m->cp_host);
    free(m);
}

const ds4_config *ds4_model_config(const ds4_model *m) { return &m->cfg; }

const char *ds4_model_tensor_source(const ds4_model *m, size_t i, int32_t *part, int64_t *expert) {
    if (!m || i >= m->n_table) return NULL;
    const ds4_param *p = &m->table[i];
    if (part) *part = p->src_part;
    if (expert) *expert = p->src_expert;
    return p->src;
}

/* ------------------------------------------------------------------------------------------------ training */

ds4_status ds4_model_enable_grad(ds4_model *m, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "enable_grad: model is NULL");
    if (m->lora) return ds4_lora_enable_grad(m, err); /* only the adapters train */
    if (m->grads) return DS4_OK;
    m->grads = calloc((size_t)(m->n_params ? m->n_params : 1), sizeof(float));
    if (!m->grads) return ds4_fail(err, DS4_ERR_OOM, "enable_grad: %lld fp32 gradients", (long long)m->n_params);
    ds4_weights_bind(m, &m->gw, DS4_F32, (char *)m->grads, ds4_f32_byte_offset, NULL, NULL);
    m->grads_zero = 1;
    return ds4_model_train_bind(m, err); /* on a device: the gradients live there */
}

void ds4_model_zero_grad(ds4_model *m) {
    if (m && m->lora) ds4_lora_zero_grad(m);
    if (!m || !m->grads) return;
    if (m->dgrads) { /* on the device; the host mirror is now behind (a fill failure surfaces at the next pass) */
        /* known zero already (an optimizer step told zero_grad left it so; nothing wrote it since): no pass */
        if (!m->grads_zero) m->dev->ops->fill(m->dev, m->dgrads, 0, (size_t)m->n_params * sizeof(float));
        m->grads_zero = 1;
        m->grads_stale = 1;
        return;
    }
    m->grads_zero = 1;
    /* a host-visible backend fills on its threads (the CPU backend's pool) */
    if (m->dev && m->dev->host_visible) m->dev->ops->fill(m->dev, m->grads, 0, (size_t)m->n_params * sizeof(float));
    else memset(m->grads, 0, (size_t)m->n_params * sizeof(float));
}

float *ds4_model_params(ds4_model *m) {
    ds4_error err = {0};
    return ds4_model_host_sync(m, &err) ? NULL : m->params;
}
float *ds4_model_grads(ds4_model *m) {
    ds4_error err = {0};
    return ds4_model_host_sync(m, &err) || !m->grads ? NULL : m->grads;
}

ds4_status ds4_model_set_train_options(ds4_model *m, const ds4_train_options *o, ds4_error *err) {
    if (!m || !o) return ds4_fail(err, DS4_ERR_ARG, "set_train_options: NULL argument");
    if (!(o->mtp_lambda >= 0) || !isfinite(o->mtp_lambda))
        return ds4_fail(err, DS4_ERR_ARG, "set_train_options: mtp_lambda %g must be finite and >= 0", o->mtp_lambda);
    if (o->mtp_lambda > 0 && !m->has_mtp)
        return ds4_fail(err, DS4_ERR_ARG, "set_train_options: mtp_lambda %g but the model has no mtp.0.* weights",
                        o->mtp_lambda);
    if (!(o->indexer_kl >= 0) || !isfinite(o->indexer_kl))
        return ds4_fail(err, DS4_ERR_ARG, "set_train_options: indexer_kl %g must be finite and >= 0", o->indexer_kl);
    if (o->indexer_kl > 0 && m->cfg.index_topk > 4096)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "set_train_options: indexer_kl with index_topk %lld > 4096",
                        (long long)m->cfg.index_topk);
    if (!(o->router_bias_gamma >= 0) || !isfinite(o->router_bias_gamma))
        return ds4_fail(err, DS4_ERR_ARG, "set_train_options: router_bias_gamma %g must be finite and >= 0",
                        o->router_bias_gamma);
    if (o->recompute != 0 && o->recompute != 1)
        return ds4_fail(err, DS4_ERR_ARG, "set_train_options: recompute %d must be 0 or 1", (int)o->recompute);
    m->topt = *o;
    return DS4_OK;
}

ds4_train_options ds4_model_train_options(const ds4_model *m) {
    return m ? m->topt : (ds4_train_options){0};
}

const int64_t *ds4_model_router_loads(const ds4_model *m) { return m ? m->router_loads : NULL; }

ds4_status ds4_model_update_router_bias(ds4_model *m, double gamma, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "router bias update: model is NULL");
    if (!(gamma >= 0) || !isfinite(gamma))
        return ds4_fail(err, DS4_ERR_ARG, "router bias update: gamma %g must be finite and >= 0", gamma);
    if (!m->router_loads) return DS4_OK; /* no training forward yet: nothing counted */
    ds4_status es = ds4_ep_sum_loads(m, err); /* expert parallelism: every rank's tokens (a collective) */
    if (es) return es;
    /* With the master weights on a device the biases are updated there: each one read from the working copy (an fp32
     * vector: the master's bits, on every rank, also where a ZeRO-1 master holds another rank's region only), changed
     * on the host in the same fp32 arithmetic, written to the working copy and to the master's part of it held here,
     * so the rest of the weights need not come back. Otherwise on the host, and a device copy is refreshed before the
     * next pass. */
    ds4_dev *d = m->dmaster ? m->dev : NULL;
    if (!d) ds4_model_params_changed(m);
    const int64_t L = m->cfg.num_hidden_layers, E = m->cfg.n_routed_experts;
    float *tmp = d ? malloc((size_t)E * sizeof(float)) : NULL;
    if (d && !tmp) return ds4_fail(err, DS4_ERR_OOM, "router bias update: %lld values", (long long)E);
    ds4_status s = DS4_OK;
    for (int64_t l = 0; l <= L && !s; l++) {
        const ds4_layer_w *lw = l < L ? &m->w.layers[l] : (m->has_mtp ? &m->w.mtp.block : NULL);
        const ds4_layer_w *dw = l < L ? &m->dw->layers[l] : (m->has_mtp ? &m->dw->mtp.block : NULL);
        int64_t *load = m->router_loads + l * E, total = 0;
        for (int64_t e = 0; e < E; e++) total += load[e];
        if (lw && !lw->is_hash && lw->gate_bias && total > 0) {
            float *b = lw->gate_bias;
            if (d) {
                if ((s = d->ops->download(d, tmp, dw->gate_bias, (size_t)E * sizeof(float), err))) break;
                b = tmp;
            }
            /* sign(mean − load_e) compared exactly in integers: E·load_e vs total */
            for (int64_t e = 0; e < E; e++) {
                const int64_t diff = total - E * load[e];
                b[e] += (float)(gamma * (double)((diff > 0) - (diff < 0)));
            }
            if (d) { /* the flat offset's elements in the master's region [master_lo, master_lo + master_n) */
                const int64_t off = lw->gate_bias - m->params, hi = m->master_lo + m->master_n;
                const int64_t lo = off > m->master_lo ? off : m->master_lo, end = off + E < hi ? off + E : hi;
                if (lo < end)
                    s = d->ops->upload(d, m->dmaster + (lo - m->master_lo), tmp + (lo - off),
                                       (size_t)(end - lo) * sizeof(float), err);
                if (!s) s = d->ops->upload(d, dw->gate_bias, tmp, (size_t)E * sizeof(float), err);
            }
        }
        memset(load, 0, (size_t)E * sizeof(int64_t));
    }
    free(tmp);
    if (s) ds4_error_prefix(err, "router bias update on %s: ", ds4_model_device_name(m));
    return s;
}

ds4_status ds4_model_sum_router_loads(ds4_model *m,
                                      ds4_status (*sum)(void *ctx, double *buf, int64_t n, ds4_error *err), void *ctx,
                                      ds4_error *err) {
    if (!m || !sum) return ds4_fail(err, DS4_ERR_ARG, "summing the router loads over ranks: model or sum is NULL");
    if (!(m->topt.router_bias_gamma > 0) || !m->router_loads || m->ep_on) return DS4_OK;
    const int64_t n = (m->cfg.num_hidden_layers + 1) * m->cfg.n_routed_experts;
    double *buf = malloc((size_t)n * sizeof(double));
    if (!buf) return ds4_fail(err, DS4_ERR_OOM, "summing the router loads over ranks: %lld values", (long long)n);
    for (int64_t i = 0; i < n; i++) buf[i] = (double)m->router_loads[i];
    ds4_status s = sum(ctx, buf, n, err);
    if (!s)
        for (int64_t i = 0; i < n; i++) m->router_loads[i] = (int64_t)buf[i];
    else
        ds4_error_prefix(err, "summing the router loads over ranks: ");
    free(buf);
    return s;
}

/* AdamW weight decay applies to matrices only: not to norms, biases (router bias, compressor position bias
 * 'ape'), attention sinks, or the mHC base/scale vectors. */
static int decays(const char *name) {
    static const char *const no[] = {"norm.weight", "_base", "_scale", "attn_sink", ".ape", "gate.bias", NULL};
    size_t n = strlen(name);
    for (int i = 0; no[i]; i++) {
        size_t k = strlen(no[i]);
        if (n >= k && strcmp(name + n - k, no[i]) == 0) return 0;
    }
    return 1;
}

/* Which tensors the active losses reach: the indexer only through its own loss, the router bias never
 * (it only shifts selection), the MTP block only through the MTP loss. */
static int trainable(const ds4_model *m, const char *name) {
    if (strstr(name, ".attn.indexer.") && !(m->topt.indexer_kl > 0)) return 0;
    if (strstr(name, ".ffn.gate.bias")) return 0;
    if (strncmp(name, "mtp.", 4) == 0 && !(m->topt.mtp_lambda > 0)) return 0;
    return 1;
}

ds4_status ds4_model_tensor_info(const ds4_model *m, size_t i, ds4_tensor_info *out, ds4_error *err) {
    if (!m || !out) return ds4_fail(err, DS4_ERR_ARG, "tensor_info: NULL argument");
    if (i >= m->n_table) return ds4_fail(err, DS4_ERR_ARG, "tensor_info: index %zu >= %zu", i, m->n_table);
    const ds4_param *p = &m->table[i];
    out->offset = p->offset;
    out->numel = p->numel;
    out->elsewhere = p->elsewhere;
    out->is_param = p->dtype == DS4_F32;
    out->trainable = out->is_param && trainable(m, p->name);
    out->decay = out->trainable && decays(p->name);
    return DS4_OK;
}
int ds4_model_has_mtp(const ds4_model *m) { return m->has_mtp; }
int64_t ds4_model_param_count(const ds4_model *m) { return m->n_params; }
size_t ds4_model_tensor_count(const ds4_model *m) { return m->n_table; }

ds4_status ds4_model_tensor_at(const ds4_model *m, size_t i, const char **name, ds4_tensor *view, ds4_error *err) {
    if (i >= m->n_table) return ds4_fail(err, DS4_ERR_ARG, "model tensor_at: index %zu >= %zu", i, m->n_table);
    const ds4_param *p = &m->table[i];
    if (name) *name = p->name;
    if (view) {
        /* the view reads the host copy: bring it up to date first (a mirror refresh, so the model stays "const") */
        ds4_status s = ds4_model_host_sync((ds4_model *)(uintptr_t)m, err);
        if (s) return s;
        memset(view, 0, sizeof *view);
        view->dtype = p->dtype;
        view->ndim = p->ndim;
        for (int32_t k = 0; k < p->ndim; k++) view->shape[k] = p->shape[k];
        if (p->dtype == DS4_FP4_PACKED) { /* its packed bytes as stored: U8 [rows, cols/2] (the scales apart) */
            view->dtype = DS4_U8;
            view->shape[1] = p->shape[1] / 2;
            view->data = m->q4 + p->offset;
            view->nbytes = (size_t)p->numel / 2;
        } else if (p->dtype == DS4_F32) {
            if (p->elsewhere && !m->ep_full)
                return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model tensor_at: %s is held by rank %lld (the routed "
                                                          "experts are sharded over %d ranks: gather them with "
                                                          "model:params() or a save on every rank)", p->name,
                                (long long)((p->routed - 1) / (m->cfg.n_routed_experts / m->ep_shard_world)),
                                m->ep_shard_world);
            view->data = (void *)ds4_param_host(m, p);
            view->nbytes = (size_t)p->numel * 4;
        } else {
            view->data = (void *)(m->tid2eid_all + p->offset);
            view->nbytes = (size_t)p->numel * 4;
        }
        view->refcount = 0; /* a borrowed view: never released */
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ loading */

/* Bounded list of names for an error message ("a, b, c and 12 more"). */
typedef struct {
    char buf[700];
    size_t used;
    int64_t count, shown;
} namelist;

static void namelist_add(namelist *l, const char *name) {
    l->count++;
    size_t len = strlen(name);
    if (l->used + len + 3 >= sizeof l->buf) return;
    l->used += (size_t)snprintf(l->buf + l->used, sizeof l->buf - l->used, "%s%s", l->shown ? ", " : "", name);
    l->shown++;
}

static int same_shape(const ds4_param *p, const ds4_st_entry *e) {
    if (p->ndim != e->ndim) return 0;
    for (int32_t i = 0; i < p->ndim; i++)
        if (p->shape[i] != e->shape[i]) return 0;
    return 1;
}

static ds4_status shape_error(ds4_error *err, const char *src, const ds4_st_entry *e, int32_t ndim,
                              const int64_t *want) {
    char a[96], b[96];
    ds4_shape_str(a, sizeof a, e->ndim, e->shape);
    ds4_shape_str(b, sizeof b, ndim, want);
    return ds4_fail(err, DS4_ERR_SHAPE, "model load: tensor '%s' has shape %s %s, expected %s", src, a,
                    ds4_dtype_name(e->dtype), b);
}

static ds4_status load_f32(float *dst, const ds4_st_entry *e, const char *src, ds4_error *err) {
    if (!ds4_dtype_is_float(e->dtype) || e->dtype == DS4_F8_E4M3 || e->dtype == DS4_F8_E5M2 || e->dtype == DS4_F8_E8M0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                        "model load: tensor '%s' is %s; this tensor must be F32, BF16 or F16 (FP8 e4m3 and packed "
                        "FP4 are read for 2-D weights with a scale tensor, docs/checkpoints.md)",
                        src, ds4_dtype_name(e->dtype));
    int64_t n = 1;
    for (int32_t i = 0; i < e->ndim; i++) n *= e->shape[i];
    ds4_status s = ds4_convert_to_f32(e->dtype, e->data, n, dst, err);
    if (s) ds4_error_prefix(err, "model load: tensor '%s': ", src);
    return s;
}

static ds4_status load_tid2eid(int32_t *dst, const ds4_st_entry *e, const char *src, int64_t E, ds4_error *err) {
    if (e->dtype != DS4_I64 && e->dtype != DS4_I32)
        return ds4_fail(err, DS4_ERR_FORMAT, "model load: tensor '%s' is %s, expected I64 or I32", src,
                        ds4_dtype_name(e->dtype));
    int64_t n = e->shape[0] * e->shape[1];
    for (int64_t i = 0; i < n; i++) {
        int64_t v;
        if (e->dtype == DS4_I64) memcpy(&v, (const char *)e->data + 8 * i, 8);
        else {
            int32_t v32;
            memcpy(&v32, (const char *)e->data + 4 * i, 4);
            v = v32;
        }
        if (v < 0 || v >= E)
            return ds4_fail(err, DS4_ERR_FORMAT, "model load: tensor '%s' element %lld = %lld outside [0, %lld)", src,
                            (long long)i, (long long)v, (long long)E);
        dst[i] = (int32_t)v;
    }
    return DS4_OK;
}

/* Packed HF experts: gate_up_proj [E, 2I, D] (w1 rows first, then w3), down_proj [E, D, I]. */
static ds4_status load_packed(ds4_model *m, const char *canon, const ds4_st_entry *e, const char *src,
                              unsigned char *loaded, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    const int64_t E = c->n_routed_experts, I = c->moe_intermediate_size, D = c->hidden_size;
    char prefix[128];
    const char *tail = strstr(canon, ".ffn.experts.");
    size_t plen = (size_t)(tail - canon);
    memcpy(prefix, canon, plen);
    prefix[plen] = 0;
    int gate_up = strstr(canon, "gate_up_proj") != NULL;
    const int64_t want[3] = {E, gate_up ? 2 * I : D, gate_up ? D : I};
    if (e->ndim != 3 || e->shape[0] != want[0] || e->shape[1] != want[1] || e->shape[2] != want[2])
        return shape_error(err, src, e, 3, want);
    float *tmp = malloc((size_t)(E * want[1] * want[2]) * sizeof(float));
    if (!tmp) return ds4_fail(err, DS4_ERR_OOM, "model load: tensor '%s': staging buffer", src);
    ds4_status s = load_f32(tmp, e, src, err);
    for (int64_t x = 0; x < E && !s; x++) {
        const char *kinds[2] = {gate_up ? "w1" : "w2", "w3"};
        for (int k = 0; k < (gate_up ? 2 : 1) && !s; k++) {
            char name[192];
            snprintf(name, sizeof name, "%s.ffn.experts.%lld.%s.weight", prefix, (long long)x, kinds[k]);
            int64_t idx = ds4_model_find(m, name);
            if (idx < 0) {
                s = ds4_fail(err, DS4_ERR_INTERNAL, "model load: packed '%s' maps to unknown '%s'", src, name);
                break;
            }
            if (loaded[idx]) {
                s = ds4_fail(err, DS4_ERR_FORMAT, "model load: '%s' is given twice (second time by '%s')", name, src);
                break;
            }
            ds4_param *p = &m->table[idx];
            /* gate_up: expert x rows [0, I) are w1, [I, 2I) are w3 */
            const float *from = tmp + x * want[1] * want[2] + (gate_up ? k * I * D : 0);
            if (!p->elsewhere) memcpy(m->params + p->offset, from, (size_t)p->numel * sizeof(float));
            loaded[idx] = 1;
            if (!(p->src = strdup(src))) {
                s = ds4_fail(err, DS4_ERR_OOM, "model load: name '%s'", src);
                break;
            }
            p->src_part = gate_up ? (k == 0 ? 1 : 3) : 2;
            p->src_expert = x;
        }
    }
    free(tmp);
    return s;
}

static int is_mtp_name(const char *canon) { return strncmp(canon, "mtp.", 4) == 0; }

/* The scale stored beside weight `src` ("X.weight"): "X.scale" (official) or "X.weight_scale_inv" (transformers). */
static ds4_status find_scale(const ds4_checkpoint *ck, const char *src, const ds4_st_entry **out, ds4_error *err) {
    *out = NULL;
    size_t n = strlen(src);
    const size_t k = sizeof ".weight" - 1;
    if (n <= k || strcmp(src + n - k, ".weight") != 0) return DS4_OK;
    char a[544], b[544];
    snprintf(a, sizeof a, "%.*s.scale", (int)(n - k), src);
    snprintf(b, sizeof b, "%s_scale_inv", src);
    const ds4_st_entry *sa = ds4_checkpoint_find(ck, a), *sb = ds4_checkpoint_find(ck, b);
    if (sa && sb)
        return ds4_fail(err, DS4_ERR_FORMAT, "model load: weight '%s' has two scales, '%s' and '%s'", src, a, b);
    *out = sa ? sa : sb;
    return DS4_OK;
}

/* A checkpoint tensor that is the scale of a weight (its name does not name a parameter, but with ".weight" in
 * place of ".scale" / ".weight_scale_inv" it does). 1 if so; *s is set when its weight is missing. */
static int is_scale(const ds4_checkpoint *ck, const ds4_st_entry *en, ds4_status *s, ds4_error *err) {
    char target[544], canon[512];
    if (!ds4_quant_scale_target(en->name, target, sizeof target) || !ds4_canonical_name(target, canon, sizeof canon))
        return 0;
    if (!ds4_checkpoint_find(ck, target))
        *s = ds4_fail(err, DS4_ERR_FORMAT, "model load: scale '%s' (%s) has no weight: '%s' is not in the checkpoint",
                      en->name, ds4_dtype_name(en->dtype), target);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ FP4-resident */

/* A routed expert's canonical name ("layers.N.ffn.experts.X.wK.weight", "mtp.0.ffn.experts.X.wK.weight"): its block
 * (L: the MTP block), expert and kind (0, 1, 2 for w1, w2, w3). 0 when the name is not one. */
static int expert_name(const char *canon, int64_t L, int64_t *li, int64_t *x, int *kind) {
    long long a = 0, b = 0;
    int k = 0, n = 0;
    if (sscanf(canon, "layers.%lld.ffn.experts.%lld.w%d.weight%n", &a, &b, &k, &n) == 3 && canon[n] == 0) *li = a;
    else if (sscanf(canon, "mtp.0.ffn.experts.%lld.w%d.weight%n", &b, &k, &n) == 2 && canon[n] == 0) *li = L;
    else return 0;
    if (*li < 0 || *li > L || k < 1 || k > 3) return 0;
    *x = b;
    *kind = k - 1;
    return 1;
}

/* Which expert kinds of which blocks are FP4-resident (kinds [(L + 1)·3]): those whose expert 0 the checkpoint
 * stores in FP4. The others of a kind must then be FP4 too (load_resident says so when one is not). */
static int scan_fp4(const ds4_checkpoint *ck, int64_t L, uint8_t *kinds) {
    int any = 0;
    char canon[512];
    for (size_t i = 0; i < ds4_checkpoint_count(ck); i++) {
        const ds4_st_entry *en = ds4_checkpoint_entry_at(ck, i);
        int64_t li, x;
        int kind;
        if (ds4_canonical_name(en->name, canon, sizeof canon) && expert_name(canon, L, &li, &x, &kind) && x == 0 &&
            ds4_quant_kind(en->dtype) == DS4_Q_FP4)
            any = kinds[li * 3 + kind] = 1;
    }
    return any;
}

/* Remember how parameter p was stored (quantised weight en with `scale`), so that saving can write it so again;
 * keep: a copy of the scale's bytes (an FP4-resident expert's are in q4 already). */
static ds4_status note_quantised(ds4_param *p, const ds4_st_entry *en, const ds4_st_entry *scale, int keep,
                                 ds4_error *err) {
    p->qkind = (int32_t)ds4_quant_kind(en->dtype);
    p->qdt = en->dtype;
    p->sdt = scale->dtype;
    p->sshape[0] = scale->shape[0];
    p->sshape[1] = scale->shape[1];
    const size_t nb = (size_t)(scale->shape[0] * scale->shape[1]) * ds4_dtype_size(scale->dtype);
    if (!(p->src_scale = strdup(scale->name)) || (keep && !(p->sbytes = malloc(nb ? nb : 1))))
        return ds4_fail(err, DS4_ERR_OOM, "model load: scale '%s'", scale->name);
    if (keep) memcpy(p->sbytes, scale->data, nb);
    return DS4_OK;
}

/* An FP4-resident expert: the checkpoint's packed bytes and e8m0 scales copied as they are (checked first, like a
 * dequantised weight's; a NaN scale refused), never expanded. */
static ds4_status load_resident(ds4_model *m, ds4_param *p, const ds4_st_entry *en, const ds4_st_entry *scale,
                                const ds4_quant_format *qf, ds4_error *err) {
    if (ds4_quant_kind(en->dtype) != DS4_Q_FP4)
        return ds4_fail(err, DS4_ERR_FORMAT, "model load (fp4_experts): '%s' is %s, but expert 0 of its block and kind "
                        "is FP4: FP4-resident experts of one block and kind must all be FP4", en->name,
                        ds4_dtype_name(en->dtype));
    ds4_status s = ds4_quant_check(en, scale, p->shape[0], p->shape[1], qf, err);
    if (s) {
        ds4_error_prefix(err, "model load (fp4_experts): ");
        return s;
    }
    if (scale->dtype != DS4_F8_E8M0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model load (fp4_experts): '%s' has %s scales ('%s'); FP4-resident "
                        "experts keep F8_E8M0 scales (load without fp4_experts to dequantise it)", en->name,
                        ds4_dtype_name(scale->dtype), scale->name);
    const uint8_t *sc = scale->data;
    const int64_t ns = p->numel / DS4_FP4_BLOCK, cols = p->shape[1] / DS4_FP4_BLOCK;
    for (int64_t i = 0; i < ns; i++)
        if (sc[i] == 255)
            return ds4_fail(err, DS4_ERR_FORMAT, "model load (fp4_experts): quantised weight '%s': scale '%s' element "
                            "[%lld, %lld] is NaN", en->name, scale->name, (long long)(i / cols), (long long)(i % cols));
    memcpy(m->q4 + p->offset, en->data, (size_t)p->numel / 2);
    memcpy(m->q4 + p->qscale, sc, (size_t)ns);
    return note_quantised(p, en, scale, 0, err);
}

/* One checkpoint tensor into parameter p: float as is, FP8 / FP4 dequantised with the scale stored beside it (or an
 * FP4-resident expert's bytes and scales as they are). */
static ds4_status load_param(ds4_model *m, const ds4_checkpoint *ck, const ds4_quant_format *qf, ds4_param *p,
                             const ds4_st_entry *en, float *scratch, ds4_error *err) {
    const ds4_st_entry *scale;
    ds4_status s = find_scale(ck, en->name, &scale, err);
    if (s) return s;
    if (p->dtype == DS4_FP4_PACKED) return load_resident(m, p, en, scale, qf, err);
    /* another rank's expert (sharded at load): read and checked like the others, into scratch, and not kept */
    float *dst = p->elsewhere ? scratch : m->params + p->offset;
    if (ds4_quant_kind(en->dtype) != DS4_Q_NONE && p->dtype == DS4_F32 && p->ndim == 2) {
        s = ds4_quant_dequant(dst, en, scale, p->shape[0], p->shape[1], qf, err);
        if (s) ds4_error_prefix(err, "model load: ");
        return s ? s : note_quantised(p, en, scale, 1, err);
    }
    if (scale)
        return ds4_fail(err, DS4_ERR_FORMAT, "model load: scale '%s' belongs to '%s', which is %s, not a quantised "
                        "weight (F8_E4M3, or FP4 packed in I8 / U8)", scale->name, en->name, ds4_dtype_name(en->dtype));
    if (!same_shape(p, en)) return shape_error(err, en->name, en, p->ndim, p->shape);
    if (p->dtype == DS4_I32) return load_tid2eid(m->tid2eid_all + p->offset, en, en->name, m->cfg.n_routed_experts, err);
    return load_f32(dst, en, en->name, err);
}

/* ds4_load_options.expert_shard_*: the model cut down to one rank's experts before anything is read (its buffer is
 * still untouched zeros, so nothing of the whole size becomes resident), and scratch for one expert's values. */
static ds4_status shard_at_load(ds4_model *m, const ds4_load_options *opt, float **scratch, ds4_error *err) {
    const int32_t P = opt->expert_shard_world, r = opt->expert_shard_rank;
    if (P < 1 || r < 0 || r >= P || m->cfg.n_routed_experts % P != 0)
        return ds4_fail(err, DS4_ERR_ARG, "model load: expert_shard rank %d of %d (the rank must be in [0, world) and "
                                          "the %lld routed experts a multiple of the world)", r, P,
                        (long long)m->cfg.n_routed_experts);
    ds4_status s = ds4_ep_shard(m, r, P, err);
    if (s) return s;
    int64_t big = 1;
    for (size_t i = 0; i < m->n_table; i++)
        if (m->table[i].routed && m->table[i].numel > big) big = m->table[i].numel;
    if (!(*scratch = malloc((size_t)big * sizeof(float))))
        return ds4_fail(err, DS4_ERR_OOM, "model load: scratch for one expert of %lld values", (long long)big);
    return DS4_OK;
}

ds4_status ds4_model_load(ds4_engine *e, const char *dir, ds4_model **out, ds4_error *err) {
    return ds4_model_load_opts(e, dir, NULL, out, err);
}

ds4_status ds4_model_load_opts(ds4_engine *e, const char *dir, const ds4_load_options *opt, ds4_model **out,
                               ds4_error *err) {
    if (!e || !dir || !out) return ds4_fail(err, DS4_ERR_ARG, "model load: NULL argument");
    ds4_config cfg;
    ds4_status s = ds4_config_load(dir, &cfg, err);
    if (s) {
        ds4_error_prefix(err, "model load %s: ", dir);
        return s;
    }
    ds4_quant_format qf;
    s = ds4_quant_format_load(dir, &qf, err);
    if (s) {
        ds4_error_prefix(err, "model load %s: ", dir);
        return s;
    }
    ds4_checkpoint *ck = NULL;
    s = ds4_checkpoint_open(dir, &ck, err);
    if (s) {
        ds4_error_prefix(err, "model load %s: ", dir);
        return s;
    }
    const size_t nt = ds4_checkpoint_count(ck);
    /* MTP is loaded when the checkpoint carries mtp.0.* weights (transformers ignores them; we do not). */
    int with_mtp = 0;
    char canon[512];
    for (size_t i = 0; i < nt; i++) {
        const ds4_st_entry *en = ds4_checkpoint_entry_at(ck, i);
        if (ds4_canonical_name(en->name, canon, sizeof canon) && is_mtp_name(canon)) {
            if (strncmp(canon, "mtp.0.", 6) != 0) {
                ds4_checkpoint_close(ck);
                return ds4_fail(err, DS4_ERR_UNSUPPORTED, "model load %s: tensor '%s': only one MTP block (mtp.0) is supported",
                                dir, en->name);
            }
            with_mtp = 1;
        }
    }
    uint8_t *kinds = NULL;
    if (opt && opt->fp4_experts) {
        if (!(kinds = calloc((size_t)(cfg.num_hidden_layers + 1) * 3, 1))) {
            ds4_checkpoint_close(ck);
            return ds4_fail(err, DS4_ERR_OOM, "model load %s: FP4 flags", dir);
        }
        if (!scan_fp4(ck, cfg.num_hidden_layers, kinds)) {
            free(kinds);
            ds4_checkpoint_close(ck);
            return ds4_fail(err, DS4_ERR_ARG, "model load %s: fp4_experts, but the checkpoint stores no routed expert in "
                            "FP4 (packed e2m1, I8 or U8, with a scale)", dir);
        }
    }
    ds4_model *m = NULL;
    s = ds4_model_alloc_fp4(e, &cfg, with_mtp, kinds, &m, err);
    free(kinds);
    if (s) {
        ds4_checkpoint_close(ck);
        ds4_error_prefix(err, "model load %s: ", dir);
        return s;
    }
    m->qblock[0] = qf.block[0];
    m->qblock[1] = qf.block[1];
    float *scratch = NULL;
    unsigned char *loaded = calloc(m->n_table ? m->n_table : 1, 1);
    if (!loaded) {
        s = ds4_fail(err, DS4_ERR_OOM, "model load: flags");
        goto done;
    }
    if (opt && opt->expert_shard_world > 0 && (s = shard_at_load(m, opt, &scratch, err))) goto done;
    namelist unexpected = {0}, missing = {0};
    for (size_t i = 0; i < nt && !s; i++) {
        const ds4_st_entry *en = ds4_checkpoint_entry_at(ck, i);
        if (!ds4_canonical_name(en->name, canon, sizeof canon)) {
            if (!is_scale(ck, en, &s, err)) namelist_add(&unexpected, en->name); /* a scale is read with its weight */
            continue;
        }
        if (strstr(canon, ".ffn.experts.gate_up_proj") || strstr(canon, ".ffn.experts.down_proj")) {
            s = load_packed(m, canon, en, en->name, loaded, err);
            continue;
        }
        if (cfg.tie_word_embeddings && strcmp(canon, "head.weight") == 0) continue; /* tied: embed wins, as in HF */
        int64_t idx = ds4_model_find(m, canon);
        if (idx < 0) {
            namelist_add(&unexpected, en->name);
            continue;
        }
        ds4_param *p = &m->table[idx];
        if (loaded[idx]) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "model load: '%s' is given twice (second time as '%s')", p->name, en->name);
            break;
        }
        s = load_param(m, ck, &qf, p, en, scratch, err);
        loaded[idx] = 1;
        if (!s && !(p->src = strdup(en->name))) s = ds4_fail(err, DS4_ERR_OOM, "model load: name '%s'", en->name);
    }
    if (!s) {
        for (size_t i = 0; i < m->n_table; i++)
            if (!loaded[i]) namelist_add(&missing, m->table[i].name);
        if (missing.count || unexpected.count) {
            char mbuf[800] = "", ubuf[800] = "";
            if (missing.count)
                snprintf(mbuf, sizeof mbuf, "%lld missing (%s%s)", (long long)missing.count, missing.buf,
                         missing.shown < missing.count ? ", ..." : "");
            if (unexpected.count)
                snprintf(ubuf, sizeof ubuf, "%s%lld unexpected (%s%s)", missing.count ? "; " : "",
                         (long long)unexpected.count, unexpected.buf, unexpected.shown < unexpected.count ? ", ..." : "");
            s = ds4_fail(err, DS4_ERR_FORMAT, "model load %s: checkpoint does not match config: %s%s", dir, mbuf, ubuf);
        }
    } else {
        ds4_error_prefix(err, "model load %s: ", dir);
    }
done:
    free(loaded);
    free(scratch);
    ds4_checkpoint_close(ck);
    if (!s && e->device.type != DS4_DEVICE_CPU) s = ds4_model_to(m, &e->device, err);
    if (s) {
        ds4_model_free(m);
        return s;
    }
    *out = m;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ random init */

/* The model owns no RNG state: the seed determines everything. */
static double normal(uint64_t *s) {
    double u = ds4_uniform01(s), v = ds4_uniform01(s);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

ds4_status ds4_model_create_random(ds4_engine *e, const ds4_config *cfg, uint64_t seed, ds4_model **out,
                                   ds4_error *err) {
    if (!e || !cfg || !out) return ds4_fail(err, DS4_ERR_ARG, "model create_random: NULL argument");
    ds4_model *m = NULL;
    ds4_status s = ds4_model_alloc(e, cfg, cfg->num_nextn_predict_layers > 0, &m, err);
    if (s) return s;
    uint64_t st = seed;
    const double std = cfg->initializer_range;
    for (size_t i = 0; i < m->n_table; i++) {
        ds4_param *p = &m->table[i];
        if (p->dtype == DS4_I32) {
            /* tid2eid: K distinct experts per token (HF's all-zero placeholder would route every token to
             * expert 0 K times): a partial Fisher-Yates shuffle per row. */
            int32_t *t = m->tid2eid_all + p->offset;
            const int64_t E = cfg->n_routed_experts, K = cfg->num_experts_per_tok;
            int32_t perm[DS4_MAX_EXPERTS]; /* E <= DS4_MAX_EXPERTS, checked in ds4_model_alloc */
            for (int64_t r = 0; r < p->shape[0]; r++) {
                const int64_t En = E;
                for (int64_t x = 0; x < En; x++) perm[x] = (int32_t)x;
                for (int64_t k = 0; k < K; k++) {
                    int64_t j = k + (int64_t)(ds4_splitmix64(&st) % (uint64_t)(En - k));
                    int32_t tmp = perm[k];
                    perm[k] = perm[j];
                    perm[j] = tmp;
                    t[r * K + k] = perm[k];
                }
            }
            continue;
        }
        float *w = m->params + p->offset;
        double fill = NAN;
        if (ends_with(p->name, "norm.weight") || ends_with(p->name, "_scale")) fill = 1.0;
        else if (ends_with(p->name, "attn_sink") || ends_with(p->name, "_base") || ends_with(p->name, ".ape") ||
                 ends_with(p->name, "gate.bias"))
            fill = 0.0;
        for (int64_t k = 0; k < p->numel; k++) w[k] = isnan(fill) ? (float)(normal(&st) * std) : (float)fill;
    }
    if (e->device.type != DS4_DEVICE_CPU && (s = ds4_model_to(m, &e->device, err))) {
        ds4_model_free(m);
        return s;
    }
    *out = m;
    return DS4_OK;
}
