/* plan.c — memory planning of a pass (its activations, the tape of a training forward) in the model's backend
 * memory, and the RoPE tables. A pass's buffers are carved out of one workspace with a bump allocator: planning
 * runs once with no base to size it, the workspace grows when needed (the only allocation, before the pass
 * starts), then planning runs again over it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lora.h"
#include "shape_limits.h"
#include "sched.h"

/* ------------------------------------------------------------------------------------------------ RoPE */

/* Inverse frequencies exactly as transformers computes them in fp32 (default and YaRN). */
static void rope_inv_freq(const ds4_rope_params *p, float *inv) {
    const int64_t dim = p->dim, half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)dim;
        float pos_freq = powf((float)p->theta, e);
        float extrap = 1.0f / pos_freq;
        if (p->type != DS4_ROPE_YARN) {
            inv[i] = extrap;
            continue;
        }
        float interp = 1.0f / ((float)p->factor * pos_freq);
        /* correction range in double, as Python's math module computes it */
        double twopi = 6.283185307179586;
        double lo = dim * log(p->original_max_position_embeddings / (p->beta_fast * twopi)) / (2 * log(p->theta));
        double hi = dim * log(p->original_max_position_embeddings / (p->beta_slow * twopi)) / (2 * log(p->theta));
        if (p->truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = (double)(dim - 1);
        if (lo == hi) hi += 0.001;
        float ramp = ((float)i - (float)lo) / (float)(hi - lo);
        ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
        float ef = 1.0f - ramp; /* extrapolation factor */
        inv[i] = interp * (1.0f - ef) + extrap * ef;
    }
}

static void rope_table(float *cs, const ds4_rope_params *p, int64_t from, int64_t to) {
    const int64_t half = p->dim / 2;
    float inv[DS4_MAX_ROPE_DIM / 2];
    rope_inv_freq(p, inv);
    const double scale = p->type == DS4_ROPE_YARN ? p->attention_factor : 1.0;
    for (int64_t s = from; s < to; s++)
        for (int64_t i = 0; i < half; i++) {
            float ang = inv[i] * (float)s; /* fp32 product, as HF's inv_freq @ position_ids */
            cs[s * 2 * half + 2 * i] = (float)(cos((double)ang) * scale);
            cs[s * 2 * half + 2 * i + 1] = (float)(sin((double)ang) * scale);
        }
}

/* The model's RoPE tables cover positions [0, S) afterwards (grown geometrically: decoding asks for one more
 * position per step), on the host and in the backend. */
static ds4_status rope_reserve(ds4_model *m, int64_t S, ds4_error *err) {
    const ds4_rope_params *p[2] = {&m->cfg.rope_main, &m->cfg.rope_compress};
    if (S > m->rope_n) {
        int64_t n = m->rope_n * 2 > S ? m->rope_n * 2 : S;
        if (n < 256) n = 256;
        for (int k = 0; k < 2; k++) {
            float *cs = realloc(m->rope_cs[k], (size_t)(n * p[k]->dim) * sizeof(float));
            if (!cs) return ds4_fail(err, DS4_ERR_OOM, "forward: RoPE table of %lld positions", (long long)n);
            m->rope_cs[k] = cs;
            rope_table(cs, p[k], m->rope_n, n);
        }
        m->rope_n = n;
        if (!m->dev->host_visible)
            for (int k = 0; k < 2; k++) {
                m->dev->ops->free(m->dev, m->rope_dev[k]);
                m->rope_dev[k] = NULL;
            }
    }
    for (int k = 0; k < 2; k++) {
        if (m->dev->host_visible) {
            m->rope_dev[k] = m->rope_cs[k];
            continue;
        }
        if (m->rope_dev[k]) continue;
        const size_t bytes = (size_t)(m->rope_n * p[k]->dim) * sizeof(float);
        ds4_status s = m->dev->ops->alloc(m->dev, bytes, (void **)&m->rope_dev[k], err);
        if (!s) s = m->dev->ops->upload(m->dev, m->rope_dev[k], m->rope_cs[k], bytes, err);
        if (s) return s;
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ pass */

/* T rows for the attention buffers; Tt (o->tok_rows, else T) for the per-token ones: with context parallelism the
 * attention sub-layers run over the whole gathered sequence, everything else over this rank's slice. Split by query
 * (cp.c) the attention's query side (queries, outputs, the indexer's queries and picks) has this rank's
 * rows too: Tq. */
static void plan(ds4_pass *f, ds4_arena *a, const ds4_pass_opts *o) {
    const ds4_config *c = f->c;
    const size_t T = (size_t)f->T, S = (size_t)f->S, B = (size_t)f->B, n = (size_t)c->hc_mult, D = (size_t)c->hidden_size;
    const size_t Tt = o->tok_rows > 0 ? (size_t)o->tok_rows : T;
    const size_t Tq = o->tok_rows > 0 && ds4_cp_model_by_query(f->m) ? Tt : T;
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, L = (size_t)c->num_hidden_layers;
    const size_t cI = (size_t)c->index_head_dim, nI = (size_t)c->index_n_heads;
    const size_t ncsa = (size_t)ds4_model_csa_layers(f->m), topk = (size_t)c->index_topk;
    /* picks per row: a full forward needs min(index_topk, S); a step keeps room for the full top-k whatever its
     * positions, so that its layout does not move while decoding goes on */
    f->sel_stride = f->B == 0 || c->index_topk < f->S ? c->index_topk : f->S;
    if (f->sel_stride < 1) f->sel_stride = 1;
    f->X = ds4_arena_take(a, Tt * n * D, 4);
    f->Xt = ds4_arena_take(a, Tt * n * D, 4);
    f->Xz = ds4_arena_take(a, Tt * n * D, 4);
    f->pre = ds4_arena_take(a, Tt * n, 4);
    f->post = ds4_arena_take(a, Tt * n, 4);
    f->comb = ds4_arena_take(a, Tt * n * n, 4);
    f->u = ds4_arena_take(a, Tt * D, 4);
    f->h = ds4_arena_take(a, T * D, 4);
    f->a = ds4_arena_take(a, Tq * D, 4);
    f->qr = ds4_arena_take(a, Tq * (size_t)c->q_lora_rank, 4);
    f->q = ds4_arena_take(a, Tq * H * d, 4);
    f->o = ds4_arena_take(a, Tq * H * d, 4);
    f->kv = ds4_arena_take(a, T * d, 4);
    f->y = ds4_arena_take(a, Tq * (size_t)(c->o_groups * c->o_lora_rank), 4);
    f->cC = ds4_arena_take(a, T * 2 * d, 4);
    f->cZ = ds4_arena_take(a, T * 2 * d, 4);
    f->cK = ds4_arena_take(a, B * S * d, 4);
    f->iC = ds4_arena_take(a, T * 2 * cI, 4);
    f->iZ = ds4_arena_take(a, T * 2 * cI, 4);
    f->iK = ds4_arena_take(a, B * S * cI, 4);
    f->iq = ds4_arena_take(a, Tq * nI * cI, 4);
    f->iw = ds4_arena_take(a, Tq * nI, 4);
    f->sel = ds4_arena_take(a, Tq * (size_t)f->sel_stride, 4);
    f->nsel = ds4_arena_take(a, Tq, 4);
    f->rl = ds4_arena_take(a, Tt * E, 4);
    f->eidx = ds4_arena_take(a, Tt * K, 4);
    f->ew = ds4_arena_take(a, Tt * K, 4);
    f->yk = ds4_arena_take(a, Tt * K * D, 4);
    f->xg = ds4_arena_take(a, Tt * K * D, 4);
    f->ye = ds4_arena_take(a, Tt * K * D, 4);
    f->g1 = ds4_arena_take(a, Tt * K * I, 4);
    f->g3 = ds4_arena_take(a, Tt * K * I, 4);
    f->perm = ds4_arena_take(a, Tt * K, 4);
    f->ecount = ds4_arena_take(a, E + 1, 8);
    f->lu = f->m->lora ? ds4_arena_take(a, Tt * (K > 1 ? K : 1) * (size_t)f->m->lora->r, 4) : NULL;
    f->logits_ws = o->logits_ws ? ds4_arena_take(a, Tt * (size_t)c->vocab_size, 4) : NULL;
    f->ids = ds4_arena_take(a, Tt, 8);
    f->tgt = ds4_arena_take(a, Tt, 8);
    f->nll = ds4_arena_take(a, Tt, 8);
    f->mtp_ids = ds4_arena_take(a, Tt, 8);
    f->rowmap = ds4_arena_take(a, Tt, 4);
    f->pos = o->nseq ? ds4_arena_take(a, T, 8) : NULL;
    f->rowseq = o->nseq ? ds4_arena_take(a, T, 4) : NULL;
    f->seqs = o->nseq ? ds4_arena_take(a, (size_t)o->nseq, sizeof(ds4_seq_desc)) : NULL;
    f->njobs_dev = o->nseq ? ds4_arena_take(a, 2, 8) : NULL;
    f->replay_experts = o->replay_experts ? ds4_arena_take(a, T * L * K, 4) : NULL;
    f->replay_index = o->replay_index ? ds4_arena_take(a, T * ncsa * topk, 4) : NULL;
    f->rec_experts = o->rec_experts ? ds4_arena_take(a, T * L * K, 4) : NULL;
    f->rec_index = o->rec_index ? ds4_arena_take(a, T * ncsa * topk, 4) : NULL;
    const size_t R = (size_t)f->ep_rows, El = f->m->ep_on ? E / (size_t)f->m->ep.world : 0;
    for (int k = 0; k < 4; k++) {
        f->ep_x[k] = R ? ds4_arena_take(a, R * D, 4) : NULL;
        f->ep_h[k] = R ? ds4_arena_take(a, R * I, 4) : NULL;
    }
    f->ep_idx = R ? ds4_arena_take(a, R, 4) : NULL;
    f->ep_off = R ? ds4_arena_take(a, El + 1, 8) : NULL;
    /* context parallelism in memory the host cannot read: every rank's block of rank 0's B·ceil(S/P) rows lands here,
     * and split by query every rank's part of the key side's gradients, [P, B·S, head_dim] */
    const size_t P = o->tok_rows > 0 && f->m->cp_on && !f->m->dev->host_visible ? (size_t)f->m->cp.world : 0;
    const size_t rows_n = P ? P * B * ((S + P - 1) / P) * D : 0, keys_n = P * B * S * (size_t)f->c->head_dim;
    f->cp_xn = P ? (int64_t)(ds4_cp_model_by_query(f->m) && keys_n > rows_n ? keys_n : rows_n) : 0;
    f->cp_x = P ? ds4_arena_take(a, (size_t)f->cp_xn, 4) : NULL;
}

ds4_status ds4_pass_setup(ds4_model *m, ds4_pass *p, int64_t B, int64_t S, int64_t T, const ds4_pass_opts *o,
                          int training, ds4_error *err) {
    static const ds4_pass_opts none = {0};
    if (!o) o = &none;
    ds4_status s = ds4_model_sync_weights(m, err);
    if (s) return s;
    *p = (ds4_pass){.m = m, .c = &m->cfg, .dev = m->dev, .w = m->dw, .B = B, .S = S, .T = T, .ep_rows = o->ep_rows};
    p->rows = (ds4_rows){.T = T, .S = S};
    ds4_arena a = {0};
    plan(p, &a, o);
    if (a.used > m->ws_bytes) {
        m->dev->ops->free(m->dev, m->ws);
        m->ws = NULL;
        m->ws_bytes = 0;
        if ((s = m->dev->ops->alloc(m->dev, a.used, &m->ws, err))) {
            ds4_error_prefix(err, "forward: workspace for %lld rows (ids [%lld, %lld]): ", (long long)T, (long long)B,
                             (long long)S);
            return s;
        }
        m->ws_bytes = a.used;
    }
    ds4_arena w = {(char *)m->ws, 0};
    plan(p, &w, o);
    /* expert parallelism: this rank's experts run grouped products over up to ep_rows = K·Σ_ranks T rows */
    const int64_t K = m->cfg.num_experts_per_tok > 0 ? m->cfg.num_experts_per_tok : 1;
    const int64_t Tres = p->ep_rows / K > T ? p->ep_rows / K : T;
    if ((s = m->dev->ops->reserve(m->dev, &m->cfg, Tres, S, training, err))) return s;
    if ((s = rope_reserve(m, S, err))) return s;
    p->rmain = (ds4_rope_table){m->rope_dev[0], m->cfg.rope_main.dim / 2};
    p->rcomp = (ds4_rope_table){m->rope_dev[1], m->cfg.rope_compress.dim / 2};
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ tape */

/* Carve the tape for (B, S) out of one arena; sizes depend on each layer's attention type. The attention slots hold
 * T = B·S rows, the per-token ones Tt (tok_rows; 0: T): with context parallelism this rank's. */
static void plan_tape(const ds4_model *m, ds4_tape *tp, ds4_arena *a, int64_t B, int64_t S, int64_t tok_rows,
                      int with_mtp) {
    const ds4_config *c = &m->cfg;
    const size_t T = (size_t)(B * S), n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t Tt = tok_rows > 0 ? (size_t)tok_rows : T;
    const size_t Tq = tok_rows > 0 && ds4_cp_model_by_query(m) ? Tt : T; /* split by query: plan()'s Tq */
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, qr = (size_t)c->q_lora_rank;
    const size_t selw = (size_t)(c->index_topk < S ? c->index_topk : S) > 0 ? (size_t)(c->index_topk < S ? c->index_topk : S) : 1;
    const int64_t L = c->num_hidden_layers;
    tp->B = B;
    tp->S = S;
    tp->T = (int64_t)T;
    tp->with_mtp = with_mtp;
    tp->with_ikl = m->topt.indexer_kl > 0;
    tp->sel_stride = (int64_t)selw;
    tp->recompute = m->topt.recompute != 0;
    /* bf16 copies of the bf16 products' inputs (sched.h); LoRA's products read them in fp32 */
    tp->x16 = m->dw->bf16_in && !m->lora && !m->tape_f32;
    const size_t xs = tp->x16 ? 2 : 4;
    /* With recomputation the main blocks share one set of activation slots (sized for the widest layer type present),
     * which the backward refills block by block; each block keeps its own input streams and decisions. The MTP block
     * keeps its own slots. */
    int any_csa = 0, any_hca = 0;
    for (int64_t li = 0; li < L; li++) any_csa |= c->layer_types[li] == DS4_ATTN_CSA, any_hca |= c->layer_types[li] == DS4_ATTN_HCA;
    ds4_layer_tape shared = {0};
    for (int64_t li = (tp->recompute ? -1 : 0); li < L + (with_mtp ? 1 : 0); li++) {
        /* li = -1: the shared slots (recomputation) */
        ds4_layer_tape *lt = li < 0 ? &shared : (a->base ? &tp->layers[li] : &(ds4_layer_tape){0});
        const ds4_attn_type ty = li < 0 ? (any_csa ? DS4_ATTN_CSA : any_hca ? DS4_ATTN_HCA : DS4_ATTN_SLIDING)
                                        : (li < L ? c->layer_types[li] : DS4_ATTN_SLIDING);
        const size_t width = ty == DS4_ATTN_CSA ? 2 * d : (ty == DS4_ATTN_HCA ? d : 0);
        const int own = li < 0 || li >= L || !tp->recompute; /* the activation slots are this block's own */
        if (!own) {
            /* the shared slots, without the kinds this layer's type does not have */
            const ds4_layer_tape keep = *lt;
            *lt = shared;
            lt->cC = width ? shared.cC : NULL, lt->cZ = width ? shared.cZ : NULL;
            lt->pool = width ? shared.pool : NULL, lt->cK = width ? shared.cK : NULL;
            const int ikl = ty == DS4_ATTN_CSA && m->topt.indexer_kl > 0;
            if (!ikl) lt->iq = lt->iw = lt->iK = lt->iC = lt->iZ = lt->ipool = lt->itgt = NULL;
            lt->nwin = keep.nwin;
        }
        if (li >= 0) { /* a block's own: its input streams and decisions */
            lt->X_in = ds4_arena_take(a, Tt * n * D, 4);
            lt->sel = ty == DS4_ATTN_CSA ? ds4_arena_take(a, Tq * selw, 4) : NULL;
            lt->nsel = ty == DS4_ATTN_CSA ? ds4_arena_take(a, Tq, 4) : NULL;
            lt->rsc = ds4_arena_take(a, Tt * E, 4);
            lt->eidx = ds4_arena_take(a, Tt * K, 4);
            lt->ew = ds4_arena_take(a, Tt * K, 4);
        }
        if (!own) continue;
        lt->post_attn = ds4_arena_take(a, Tt * n, 4);
        lt->comb_attn = ds4_arena_take(a, Tt * n * n, 4);
        lt->mix_attn = ds4_arena_take(a, Tt * (2 + n) * n, 4);
        lt->mix_ffn = ds4_arena_take(a, Tt * (2 + n) * n, 4);
        lt->u_attn = ds4_arena_take(a, Tt * D, 4);
        lt->h_attn = ds4_arena_take(a, T * D, xs);
        lt->qa = ds4_arena_take(a, Tq * qr, 4);
        lt->qr = ds4_arena_take(a, Tq * qr, xs);
        lt->q_pre = ds4_arena_take(a, Tq * H * d, 4);
        lt->q = ds4_arena_take(a, Tq * H * d, 4);
        lt->kv_pre = ds4_arena_take(a, T * d, 4);
        lt->kv = ds4_arena_take(a, T * d, 4);
        lt->cC = width ? ds4_arena_take(a, T * width, 4) : NULL;
        lt->cZ = width ? ds4_arena_take(a, T * width, 4) : NULL;
        lt->pool = width ? ds4_arena_take(a, T * d, 4) : NULL;
        lt->cK = width ? ds4_arena_take(a, T * d, 4) : NULL;
        const int ikl = ty == DS4_ATTN_CSA && m->topt.indexer_kl > 0;
        const size_t nI = (size_t)c->index_n_heads, cI = (size_t)c->index_head_dim;
        lt->iq = ikl ? ds4_arena_take(a, T * nI * cI, 4) : NULL;
        lt->iw = ikl ? ds4_arena_take(a, T * nI, 4) : NULL;
        lt->iK = ikl ? ds4_arena_take(a, T * cI, 4) : NULL;
        lt->iC = ikl ? ds4_arena_take(a, T * 2 * cI, 4) : NULL;
        lt->iZ = ikl ? ds4_arena_take(a, T * 2 * cI, 4) : NULL;
        lt->ipool = ikl ? ds4_arena_take(a, T * cI, 4) : NULL;
        lt->itgt = ikl ? ds4_arena_take(a, T * selw, 4) : NULL;
        lt->o = ds4_arena_take(a, Tq * H * d, xs);
        lt->y = ds4_arena_take(a, Tq * (size_t)(c->o_groups * c->o_lora_rank), xs);
        lt->a_attn = ds4_arena_take(a, Tt * D, 4);
        lt->u_ffn = ds4_arena_take(a, Tt * D, 4);
        lt->h_ffn = ds4_arena_take(a, Tt * D, 4);
        lt->rlog = ds4_arena_take(a, Tt * E, 4);
        /* with expert parallelism the experts' owners run their backward from the rows they receive (moe_ep.c) */
        lt->eg1 = m->ep_on ? NULL : ds4_arena_take(a, Tt * K * I, 4);
        lt->eg3 = m->ep_on ? NULL : ds4_arena_take(a, Tt * K * I, 4);
        lt->ye = ds4_arena_take(a, Tt * K * D, 4);
        lt->sg1 = ds4_arena_take(a, Tt * I, 4);
        lt->sg3 = ds4_arena_take(a, Tt * I, 4);
        lt->a_ffn = ds4_arena_take(a, Tt * D, 4);
    }
    tp->X_L = ds4_arena_take(a, Tt * n * D, 4);
    tp->u_fin = ds4_arena_take(a, Tt * D, 4);
    tp->y_fin = ds4_arena_take(a, Tt * D, 4);
    tp->head_rows = ds4_head_rows(m, (int64_t)Tt);
    tp->logits = ds4_arena_take(a, (size_t)tp->head_rows * V, 4);
    tp->ids = ds4_arena_take(a, Tt, 8);
    tp->labels = ds4_arena_take(a, T, 8);
    tp->tgt = ds4_arena_take(a, Tt, 8);
    tp->lp = ds4_arena_take(a, 2 * Tt, 4);
    tp->rmx = ds4_arena_take(a, 2 * Tt, 4);
    tp->rse = ds4_arena_take(a, 2 * Tt, 8);
    tp->loads = m->dev->host_visible ? NULL : ds4_arena_take(a, (size_t)((L + 1) * c->n_routed_experts), 8);
    tp->mtp_e = with_mtp ? ds4_arena_take(a, Tt * D, 4) : NULL;
    tp->mtp_en = with_mtp ? ds4_arena_take(a, Tt * D, 4) : NULL;
    tp->mtp_hn = with_mtp ? ds4_arena_take(a, Tt * n * D, 4) : NULL;
    tp->mtp_u = with_mtp ? ds4_arena_take(a, Tt * D, 4) : NULL;
    tp->mtp_y = with_mtp ? ds4_arena_take(a, Tt * D, 4) : NULL;
    tp->mtp_X = with_mtp ? ds4_arena_take(a, Tt * n * D, 4) : NULL;
}

ds4_status ds4_tape_reserve(ds4_model *m, ds4_tape *tp, int64_t B, int64_t S, int64_t tok_rows, int with_mtp,
                            ds4_error *err) {
    const int64_t nl = m->cfg.num_hidden_layers + 1, T = B * S;
    if (!tp->layers) {
        tp->layers = calloc((size_t)nl, sizeof *tp->layers);
        if (!tp->layers) return ds4_fail(err, DS4_ERR_OOM, "training forward: tape of %lld layers", (long long)nl);
    }
    ds4_arena a = {0};
    plan_tape(m, tp, &a, B, S, tok_rows, with_mtp);
    if (a.used > tp->bytes) {
        m->dev->ops->free(m->dev, tp->mem);
        tp->mem = NULL;
        tp->bytes = 0;
        ds4_status s = m->dev->ops->alloc(m->dev, a.used, &tp->mem, err);
        if (s) {
            ds4_error_prefix(err, "training forward: activation tape for ids [%lld, %lld]: ", (long long)B, (long long)S);
            return s;
        }
        tp->bytes = a.used;
    }
    int64_t *h = realloc(tp->hids, (size_t)(2 * T + B) * sizeof *h);
    if (!h) return ds4_fail(err, DS4_ERR_OOM, "training forward: host ids of %lld tokens", (long long)T);
    tp->hids = h;
    tp->hlabels = h + T;
    tp->hlen = h + 2 * T;
    ds4_arena w = {tp->mem, 0};
    plan_tape(m, tp, &w, B, S, tok_rows, with_mtp);
    return DS4_OK;
}

void ds4_tape_free(ds4_model *m, ds4_tape *t) {
    if (!t) return;
    free(t->layers);
    free(t->hids);
    m->dev->ops->free(m->dev, t->mem);
    m->dev->ops->free(m->dev, t->bmem);
    free(t);
}
