/* backward.c — the model schedule of the explicit backward pass, over the flat gradient buffer, from the activations
 * a training forward saved on the tape (sched.h); and the per-token log-probabilities of that forward.
 *
 * Every operation of the forward has its mirror here, in reverse block order. Gradients ACCUMULATE into the model's
 * gradient buffer, addressed through a view set (m->gw) parallel to the weights. Reductions that many tokens feed
 * (weight gradients, shared keys, router bias, embedding rows) are GEMMs or fixed-order loops in the operations,
 * never racing atomics, so the result does not depend on the number of threads. Parameters the active losses do
 * not reach (indexer, router bias, MTP without its loss) receive exactly zero. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lora.h"
#include "sched.h"

typedef struct bwd {
    ds4_pass f;                   /* backend, config, RoPE tables, B / S / T of the current pass */
    ds4_model *m;
    ds4_tape *tp;
    const ds4_weights *gw;        /* gradient views */
    ds4_dtype mdt;
    /* planned workspace (backend memory) */
    float *dX, *dXt;              /* [T, n, D] */
    float *xmid;                  /* [T, n, D] the current block's X_mid, recomputed (block_bwd); NULL with per-block
                                     recomputation, whose replay leaves it in f.Xt */
    float *du, *dh, *da;          /* [T, D] */
    float *dpost, *dcomb;         /* [T, n], [T, n, n] */
    float *dmix, *xn, *dxn;       /* [T, mix], [T, n·D], [T, n·D] */
    float *dzb, *dzs;             /* [T, mix], [T, 3] per-token base / scale gradients */
    float *dq, *dkv, *dqa;        /* [T, H·d], [T, d], [T, q_lora] */
    float *do_, *dy;              /* [T, H·d], [T, g·o_lora] */
    float *dK, *dpool;            /* [B·S, d] */
    float *dC, *dZ;               /* [T, 2d] */
    float *P, *DS;                /* [T, H, maxk] attention probabilities / logit gradients */
    int64_t maxk;
    float *dsink_t;               /* [T, H] */
    int32_t *inv_t, *inv_i;       /* [T·topk] CSA inverse selection lists */
    int64_t *inv_off;             /* [B·S + 1] */
    float *dlog;                  /* [T, max(V, E)] */
    float *dsc;                   /* [T, E] */
    float *dws;                   /* [T·K] */
    float *xs, *dys, *dxs;        /* [T·K, D] expert rows: inputs, output gradients, input gradients */
    float *dxslot;                /* [T·K, D] input gradients filed by (token, slot) */
    float *act, *dact;            /* [T·K, I]; [T, I] with expert parallelism (bplan) */
    float *ex;                    /* as act: swiglu_bwd's exps, from its act pass to its gradient pass; NULL on a
                                     backend not in host memory (ops.h: a GPU's pass is bound by memory, not exp) */
    int32_t *perm;                /* [T·K] */
    int64_t *ecount;              /* [E + 1] */
    float *dmtp;                  /* [T, n, D] MTP input gradient */
    float *dI, *diq, *diw, *dsi;  /* indexer KL: [T, sel], [T, n_I·c_I], [T, n_I], [T, n_I, sel] */
    double *kl;                   /* [T] */
    int32_t *has, *rowmap;        /* [T] */
    int64_t *mids;                /* [T] MTP next-token ids */
    float *dlogp;                 /* [T] the caller's per-token gradient */
    double ikl_scale;             /* > 0: the indexer KL's per-query factor (its weight / the global query count);
                                     else the weight / this forward's own count, layer by layer */
    ds4_lora_bwd_ctx lc;          /* LoRA scratch u, v [T·max(K, 1), r] (lora_sched.c) */
} bwd;

/* ------------------------------------------------------------------------------------------------ planning */

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }

static void bplan(bwd *b, ds4_arena *a) {
    const ds4_config *c = &b->m->cfg;
    /* T rows for the attention sub-layer's buffers, Tt for the per-token ones: with context parallelism the tape holds
     * this rank's rows, but attention runs over the whole sequence */
    const size_t B = (size_t)b->tp->B, S = (size_t)(b->tp->cp_S ? b->tp->cp_S : b->tp->S), T = B * S;
    const size_t Tt = (size_t)b->tp->T;
    /* split by query (cp.c): the attention's query side has this rank's rows too */
    const size_t Tq = b->tp->cp_S && ds4_cp_model_by_query(b->m) ? Tt : T;
    const size_t n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, qr = (size_t)c->q_lora_rank;
    const size_t mix = (2 + n) * n, GO = (size_t)(c->o_groups * c->o_lora_rank), nD = n * D;
    const size_t win = (size_t)c->sliding_window < S ? (size_t)c->sliding_window : S;
    const size_t topk = (size_t)(c->index_topk < (int64_t)S ? c->index_topk : (int64_t)S);
    b->dX = ds4_arena_take(a, Tt * nD, 4);
    b->dXt = ds4_arena_take(a, Tt * nD, 4);
    b->xmid = b->tp->recompute ? NULL : ds4_arena_take(a, Tt * nD, 4); /* recomputation: the replay's Xt */
    b->du = ds4_arena_take(a, Tt * D, 4);
    b->dh = ds4_arena_take(a, T * D, 4);
    b->da = ds4_arena_take(a, Tq * D, 4);
    b->dpost = ds4_arena_take(a, Tt * n, 4);
    b->dcomb = ds4_arena_take(a, Tt * n * n, 4);
    b->dmix = ds4_arena_take(a, Tt * mix, 4);
    b->xn = ds4_arena_take(a, Tt * nD, 4);
    b->dxn = ds4_arena_take(a, Tt * nD, 4);
    b->dzb = ds4_arena_take(a, Tt * mix, 4);
    b->dzs = ds4_arena_take(a, Tt * 3, 4);
    b->dq = ds4_arena_take(a, Tq * H * d, 4);
    b->dkv = ds4_arena_take(a, T * d, 4);
    b->dqa = ds4_arena_take(a, Tq * qr, 4);
    b->do_ = ds4_arena_take(a, Tq * H * d, 4);
    b->dy = ds4_arena_take(a, Tq * GO, 4);
    const size_t dk = zmax(d, (size_t)c->index_head_dim); /* main or indexer compressor entries */
    b->dK = ds4_arena_take(a, B * S * dk, 4);
    b->dpool = ds4_arena_take(a, B * S * dk, 4);
    b->dC = ds4_arena_take(a, T * 2 * dk, 4);
    b->dZ = ds4_arena_take(a, T * 2 * dk, 4);
    /* P and DS rows hold the longest key list of any block: the window, then every causal entry (HCA) or every
     * pick (CSA); at most win + S, but the picks and the heavily compressed entries are far fewer (599M config, S
     * 1024: 384 keys instead of 1152, 0.8 GiB less at 8 × 1024) */
    size_t ents = 0;
    for (int64_t li = 0; li < c->num_hidden_layers; li++) {
        const ds4_attn_type ty = c->layer_types[li];
        ents = zmax(ents, ty == DS4_ATTN_HCA ? S / (size_t)c->compress_rate_hca
                          : ty == DS4_ATTN_CSA ? (size_t)b->tp->sel_stride : 0);
    }
    b->maxk = (int64_t)(win + ents);
    b->P = ds4_arena_take(a, Tq * H * (size_t)b->maxk, 4);
    b->DS = ds4_arena_take(a, Tq * H * (size_t)b->maxk, 4);
    b->dsink_t = ds4_arena_take(a, Tq * H, 4);
    b->inv_t = ds4_arena_take(a, Tq * (topk ? topk : 1), 4);
    b->inv_i = ds4_arena_take(a, Tq * (topk ? topk : 1), 4);
    b->inv_off = ds4_arena_take(a, B * S + 1, 8);
    b->dlog = ds4_arena_take(a, zmax((size_t)b->tp->head_rows * V, Tt * E), 4); /* a head chunk's, or the routers' */
    b->dsc = ds4_arena_take(a, Tt * E, 4);
    b->dws = ds4_arena_take(a, Tt * K, 4);
    b->xs = ds4_arena_take(a, Tt * K * D, 4);
    b->dys = ds4_arena_take(a, Tt * K * D, 4);
    b->dxs = ds4_arena_take(a, Tt * K * D, 4);
    b->dxslot = ds4_arena_take(a, Tt * K * D, 4);
    /* the routed experts' activations and their gradients, [T·K, I], and the shared expert's, [T, I]; with expert
     * parallelism the owners' rows live in the pass's ep_h (moe_ep.c), so only the shared expert's are here */
    const size_t act_rows = b->m->ep_on && b->tp->ep_rows ? Tt : Tt * K;
    b->act = ds4_arena_take(a, act_rows * I, 4);
    b->dact = ds4_arena_take(a, act_rows * I, 4);
    b->ex = b->m->dev->host_visible ? ds4_arena_take(a, act_rows * I, 4) : NULL;
    b->perm = ds4_arena_take(a, Tt * K, 4);
    b->ecount = ds4_arena_take(a, E + 1, 8);
    b->dmtp = ds4_arena_take(a, Tt * nD, 4);
    const size_t nI = (size_t)c->index_n_heads, cI = (size_t)c->index_head_dim, sel = topk ? topk : 1;
    const int ikl = b->tp->with_ikl;
    b->dI = ikl ? ds4_arena_take(a, T * sel, 4) : NULL;
    b->diq = ikl ? ds4_arena_take(a, T * nI * cI, 4) : NULL;
    b->diw = ikl ? ds4_arena_take(a, T * nI, 4) : NULL;
    b->dsi = ikl ? ds4_arena_take(a, T * nI * sel, 4) : NULL;
    b->kl = ds4_arena_take(a, T, 8);
    b->has = ds4_arena_take(a, T, 4);
    b->rowmap = ds4_arena_take(a, Tt, 4);
    b->mids = ds4_arena_take(a, Tt, 8);
    b->dlogp = ds4_arena_take(a, Tt, 4);
    const size_t lr = b->m->lora ? (size_t)b->m->lora->r : 0, rows = T * (K > 1 ? K : 1);
    b->lc.u = lr ? ds4_arena_take(a, rows * lr, 4) : NULL;
    b->lc.v = lr ? ds4_arena_take(a, rows * lr, 4) : NULL;
}

/* B / S / T of the pass the backward is in (the main blocks, or the MTP block over S-1 positions). */
static void set_shape(bwd *b, int64_t S, int64_t T) {
    b->f.S = S;
    b->f.T = T;
    b->f.rows.S = S;
    b->f.rows.T = T;
}

/* A matrix weight `W` of dtype dt, element `off` on. */
static const void *wat(const float *W, ds4_dtype dt, int64_t off) {
    return (const char *)W + (size_t)off * ds4_dtype_size(dt);
}

/* ------------------------------------------------------------------------------------------------ helpers */

/* x of a product: fp32, or bf16 bits (h, a tape input kept as the bf16 products round it: sched.h) */
typedef struct { const float *f; const uint16_t *h; } prod_x;

/* The tape input p (h_attn, qr, o, y; sched.h) from element k on, in the dtype the tape keeps it in. */
static prod_x tape_x(const bwd *b, const void *p, int64_t k) {
    return b->tp->x16 ? (prod_x){NULL, (const uint16_t *)p + k} : (prod_x){(const float *)p + k, NULL};
}

/* Backward of y = x Wᵀ over T rows: dx = dy W (added when acc, else written; dx may be NULL) and dW += dyᵀ x
 * (dW may be NULL). M: W is an M matrix (held in mdt; the bf16 mode rounds the products' operands), else fp32. */
static void lin_bwd_px(bwd *b, float *dx, int64_t lddx, int acc, float *dW, const float *dy, int64_t ldy, prod_x x,
                      int64_t ldx, const void *W, int M, int64_t T, int64_t K, int64_t O) {
    if (T <= 0) return;
    const ds4_dtype wdt = M ? b->mdt : DS4_F32;
    const int bf16_in = M && b->f.w->bf16_in;
    if (dx)
        OP(b->f.dev, linear_bwd_x, .dx = dx, .lddx = lddx, .acc = acc, .dy = dy, .ldy = ldy, .W = W, .wdt = wdt, .T = T,
           .K = K, .O = O, .bf16_in = bf16_in);
    if (dW && x.h && !bf16_in) { /* the tape rounds only for the bf16 products (plan.c) */
        ds4_dev_fail(b->f.dev, DS4_ERR_INTERNAL, "backward: a bf16 tape input of an fp32 product [%lld x %lld]",
                     (long long)T, (long long)K);
        return;
    }
    if (dW)
        OP(b->f.dev, linear_bwd_w, .dW = dW, .dy = dy, .ldy = ldy, .x = x.f, .x16 = x.h, .ldx = ldx, .T = T, .K = K,
           .O = O, .wdt = wdt, .bf16_in = bf16_in, .any_order = !M && b->f.w->bf16_in, .dy_kept = dx != NULL);
}

static void lin_bwd(bwd *b, float *dx, int64_t lddx, int acc, float *dW, const float *dy, int64_t ldy, const float *x,
                    int64_t ldx, const void *W, int M, int64_t T, int64_t K, int64_t O) {
    lin_bwd_px(b, dx, lddx, acc, dW, dy, ldy, (prod_x){x, NULL}, ldx, W, M, T, K, O);
}

/* dst += the column sums of src (dst NULL: a frozen weight, nothing to compute) */
static void colsum(bwd *b, float *dst, const float *src, int64_t rows, int64_t width, int64_t ld) {
    if (dst) OP(b->f.dev, colsum_add, .dst = dst, .src = src, .rows = rows, .width = width, .ld = ld);
}

static void norm_bwd(bwd *b, float *dx, int acc, float *dw, const float *dy, const float *x, const float *w,
                     int64_t rows, int64_t width) {
    OP(b->f.dev, norm_bwd, .dx = dx, .acc = acc, .dw = dw, .dy = dy, .x = x, .w = w, .rows = rows, .width = width,
       .eps = b->m->cfg.rms_norm_eps, .groups = 1);
}

/* RoPE is an orthogonal rotation: its backward is the rotation by the opposite angle. */
static void rope_bwd_at(bwd *b, float *dx, int64_t heads, int64_t width, const ds4_rope_table *rt, int fwd_sign,
                       const ds4_rows *rows) {
    OP(b->f.dev, rope, .x = dx, .heads = heads, .width = width, .rt = *rt, .rows = *rows, .sign = -fwd_sign);
}
static void rope_bwd(bwd *b, float *dx, int64_t heads, int64_t width, const ds4_rope_table *rt, int fwd_sign) {
    rope_bwd_at(b, dx, heads, width, rt, fwd_sign, &b->f.rows);
}

/* ------------------------------------------------------------------------------------------------ mHC */

/* Backward of one mHC site given du (gradient of its collapsed input) and b->dpost / b->dcomb; adds into dX and the
 * site's weight gradients. mixk: the mixing logits its forward kept (the tape's). */
static void hc_site_bwd(bwd *b, const ds4_hc_w *w, const ds4_hc_w *g, const float *X, const float *mixk,
                        const float *du, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, n = c->hc_mult, nD = n * c->hidden_size, mix = (2 + n) * n;
    OP(b->f.dev, hc_pre_bwd, .c = c, .w = w, .X = X, .du = du, .dX = dX, .dpost = b->dpost, .dcomb = b->dcomb,
       .dmix = b->dmix, .xn = b->xn, .dzb = b->dzb, .dzs = b->dzs, .mix = mixk, .T = T);
    /* mix = fn · x̂: dfn += dmixᵀ x̂, dx̂ = dmix · fn, then through the RMS over n·D */
    lin_bwd(b, b->dxn, nD, 0, g->fn, b->dmix, mix, b->xn, nD, w->fn, 0, T, nD, mix);
    norm_bwd(b, dX, 1, NULL, b->dxn, X, NULL, T, nD);
    colsum(b, g->base, b->dzb, T, mix, mix);
    colsum(b, g->scale, b->dzs, T, 3, 3);
}

static void hyperhead_bwd(bwd *b, const float *X, const float *fn, const float *base, const float *scale, float *gfn,
                          float *gbase, float *gscale, const float *du, float *dX) {
    const int64_t T = b->f.T, n = b->m->cfg.hc_mult, nD = n * b->m->cfg.hidden_size;
    OP(b->f.dev, hyperhead_bwd, .c = &b->m->cfg, .X = X, .fn = fn, .base = base, .scale = scale, .du = du, .dX = dX,
       .dmix = b->dmix, .xn = b->xn, .dzb = b->dzb, .dzs = b->dzs, .T = T);
    lin_bwd(b, b->dxn, nD, 0, gfn, b->dmix, n, b->xn, nD, fn, 0, T, nD, n);
    norm_bwd(b, dX, 1, NULL, b->dxn, X, NULL, T, nD);
    colsum(b, gbase, b->dzb, T, n, n);
    colsum(b, gscale, b->dzs, T, 1, 3);
}

/* ------------------------------------------------------------------------------------------------ attention */

/* Compressor backward from b->dK (entry gradients): through RoPE, the norm and the pooling into its projections
 * (C, Z, pool: what the forward kept); adds to b->dh unless the input is detached (want_dh 0). */
static void comp_bwd(bwd *b, const ds4_compressor_w *w, const ds4_compressor_w *g, const ds4_layer_tape *lt,
                     const float *C, const float *Z, const float *pool, int overlap, int want_dh) {
    const ds4_config *c = &b->m->cfg;
    const int64_t S = b->f.S, B = b->f.B, T = b->f.T, dd = w->dd, D = c->hidden_size, nwin = lt->nwin;
    ds4_dev *dev = b->f.dev;
    OP(dev, entry_rope, .x = b->dK, .B = B, .S = S, .nwin = nwin, .dd = dd, .m = w->rate, .rt = b->f.rcomp, .sign = -1);
    /* norm over the complete entries only: rows (row, win < nwin) of each sequence */
    OP(dev, norm_bwd, .dx = b->dpool, .dw = g->norm, .dy = b->dK, .x = pool, .w = w->norm, .rows = nwin, .width = dd,
       .eps = c->rms_norm_eps, .groups = B, .gstride = S * dd);
    ds4_dev_fill(dev, b->dC, 0, (size_t)(T * w->width) * sizeof(float)); /* tokens of incomplete windows: none */
    ds4_dev_fill(dev, b->dZ, 0, (size_t)(T * w->width) * sizeof(float));
    OP(dev, comp_bwd, .c = c, .w = w, .overlap = overlap, .C = C, .Z = Z, .dpool = b->dpool, .dC = b->dC, .dZ = b->dZ,
       .gape = g->ape, .B = B, .S = S, .nwin = nwin);
    const prod_x h = tape_x(b, lt->h_attn, 0);
    lin_bwd_px(b, want_dh ? b->dh : NULL, D, 1, g->wkv, b->dC, w->width, h, D, w->wkv, 1, T, D, w->width);
    lin_bwd_px(b, want_dh ? b->dh : NULL, D, 1, g->wgate, b->dZ, w->width, h, D, w->wgate, 1, T, D, w->width);
}

/* The indexer KL loss's backward for one CSA layer (after the attention backward built the inverse pick lists):
 * into the indexer's wq_b, weights_proj and compressor only; its inputs (q_residual, h) are detached. */
static void indexer_kl_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, nI = c->index_n_heads, cI = c->index_head_dim, qr = c->q_lora_rank, D = c->hidden_size;
    ds4_dev *dev = b->f.dev;
    const int64_t stride = b->tp->sel_stride;
    /* the loss is the mean over the real queries that have picks, as the forward counted them (ds4_ikl_counts) */
    const int64_t S = b->f.S, *len = b->tp->hlen;
    int32_t *nsel = malloc((size_t)T * sizeof *nsel);
    if (!nsel) {
        ds4_dev_fail(dev, DS4_ERR_OOM, "indexer KL backward: host pick counts of %lld queries", (long long)T);
        return;
    }
    ds4_dev_download(dev, nsel, lt->nsel, (size_t)T * sizeof *nsel);
    int64_t nq = 0;
    for (int64_t t = 0; t < T && !dev->st; t++) nq += ds4_ikl_counts(nsel, len, S, t);
    free(nsel);
    if (nq == 0) return;
    OP(dev, ikl, .c = c, .lt = lt, .T = T, .S = S, .sel_stride = stride, .kl = b->kl, .has = b->has, .dI = b->dI,
       .scale = b->ikl_scale > 0 ? b->ikl_scale : b->m->topt.indexer_kl / (double)nq);
    /* padded queries (the rows' tails) take no part: their dI rows are zeroed, so nothing below sees them */
    for (int64_t r = 0; r < b->f.B; r++)
        ds4_dev_fill(dev, b->dI + (r * S + len[r]) * stride, 0, (size_t)((S - len[r]) * stride) * sizeof(float));
    OP(dev, ikl_bwd_q, .c = c, .lt = lt, .B = b->f.B, .S = b->f.S, .T = T, .sel_stride = stride, .dI = b->dI,
       .diq = b->diq, .diw = b->diw, .dsi = b->dsi);
    OP(dev, ikl_bwd_k, .c = c, .lt = lt, .B = b->f.B, .S = b->f.S, .T = T, .sel_stride = stride, .dsi = b->dsi,
       .inv_off = b->inv_off, .inv_t = b->inv_t, .inv_i = b->inv_i, .dK = b->dK);
    if (b->m->kv_qat) { /* the QAT option: straight through the rounding, back through the (symmetric) rotation */
        const ds4_fq rot = {.hadamard = 1};
        OP(dev, fake_quant, .x = b->diq, .rows = T * nI, .width = cI, .q = rot);
        OP(dev, fake_quant, .x = b->dK, .rows = lt->nwin, .width = cI, .groups = b->f.B, .gstride = b->f.S * cI,
           .q = rot);
    }
    rope_bwd(b, b->diq, nI, cI, &b->f.rcomp, 1);
    lin_bwd_px(b, NULL, qr, 0, g->idx_wq_b, b->diq, nI * cI, tape_x(b, lt->qr, 0), qr, l->idx_wq_b, 1, T, qr, nI * cI);
    ds4_lora_bwd(&b->lc, l->lora, DS4_LORA_AB(l->lora, idx_wq_b), DS4_LORA_AB(g->lora, idx_wq_b), NULL, 0, b->diq,
                 nI * cI, (const float *)lt->qr, qr, T, qr, nI * cI);
    OP(dev, scale, .x = b->diw, .n = T * nI, .s = 1.0f / sqrtf((float)nI)); /* ω = weights_proj(h) · n_I^-1/2 */
    lin_bwd_px(b, NULL, D, 0, g->idx_weights, b->diw, nI, tape_x(b, lt->h_attn, 0), D, l->idx_weights, 1, T, D, nI);
    ds4_lora_bwd(&b->lc, l->lora, DS4_LORA_AB(l->lora, idx_weights), DS4_LORA_AB(g->lora, idx_weights), NULL, 0,
                 b->diw, nI, (const float *)lt->h_attn, D, T, D, nI);
    comp_bwd(b, &l->idx_comp, &g->idx_comp, lt, lt->iC, lt->iZ, lt->ipool, 1, 0);
}

/* Attention sub-layer backward: b->da (gradient of its output) → b->dh (gradient of h_attn, written). Keys over the
 * pass's rows; queries over the same rows, or (qw, context parallelism split by query) over a query window of them:
 * this rank's positions of each sequence, whose rows of da and of the query side's tape are its own. There the key
 * side's gradients (window keys, entries) are this rank's queries' parts, summed over the ranks (cp.c) before the
 * key side's backward, which every rank then runs alike over the whole sequences; dh ends as this rank's rows. */
static void attention_bwd_rows(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt,
                               const ds4_rows *qw) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, S = b->f.S, D = c->hidden_size, H = c->num_attention_heads, d = c->head_dim;
    const int64_t qr = c->q_lora_rank, G = c->o_groups, ol = c->o_lora_rank, gw = H * d / G;
    const int64_t Tq = qw ? qw->T : T; /* the query rows */
    const ds4_rows *rq = qw ? qw : &b->f.rows;
    const ds4_rope_table *rt = l->type == DS4_ATTN_SLIDING ? &b->f.rmain : &b->f.rcomp;
    ds4_dev *dev = b->f.dev;
    const ds4_lora_layer *lo = l->lora, *go = g->lora;
    lin_bwd_px(b, b->dy, G * ol, 0, g->wo_b, b->da, D, tape_x(b, lt->y, 0), G * ol, l->wo_b, 1, Tq, G * ol, D);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, wo_b), DS4_LORA_AB(go, wo_b), b->dy, G * ol, b->da, D,
                 (const float *)lt->y, G * ol, Tq, G * ol, D);
    for (int64_t k = 0; k < G; k++)
        lin_bwd_px(b, b->do_ + k * gw, H * d, 0, g->wo_a ? g->wo_a + k * ol * gw : NULL, b->dy + k * ol, G * ol,
                   tape_x(b, lt->o, k * gw), H * d, wat(l->wo_a, b->mdt, k * ol * gw), 1, Tq, gw, ol);
    ds4_lora_bwd_wo_a(&b->lc, c, lo, go, b->do_, b->dy, (const float *)lt->o, Tq);
    rope_bwd_at(b, b->do_, H, d, rt, -1, rq); /* the output was de-rotated */
    const ds4_a_attn_bwd ab = {.c = c, .l = l, .lt = lt, .B = b->f.B, .S = S, .sel_stride = b->tp->sel_stride,
                               .dout = b->do_, .P = b->P, .DS = b->DS, .maxk = b->maxk, .dsink_t = b->dsink_t,
                               .dq = b->dq, .dkv = b->dkv, .dK = b->dK, .inv_off = b->inv_off, .inv_t = b->inv_t,
                               .inv_i = b->inv_i, .bf16_in = b->f.w->bf16_in, .q0 = rq->q0, .qn = rq->qn};
    ds4_op_attn_bwd_q(dev, &ab);
    ds4_op_attn_bwd_kv(dev, &ab);
    colsum(b, g->sink, b->dsink_t, Tq, H, H);
    ds4_dev_fill(dev, b->dh, 0, (size_t)(T * D) * sizeof(float));
    const int entries = l->type != DS4_ATTN_SLIDING && lt->nwin > 0;
    if (entries) {
        if (l->type == DS4_ATTN_CSA) /* inverse of the indexer picks: (query, position) per entry */
            OP(dev, pick_inverse, .sel = lt->sel, .nsel = lt->nsel, .sel_stride = b->tp->sel_stride, .T = Tq, .S = S,
               .B = b->f.B, .inv_off = b->inv_off, .inv_t = b->inv_t, .inv_i = b->inv_i, .qn = rq->qn);
        ds4_op_attn_bwd_entry(dev, &ab);
    }
    if (qw) { /* every rank's queries' parts of the key side's gradients, summed in rank order */
        ds4_cp_sum_floats(&b->f, b->dkv, T * d, "sum of the window keys' gradients");
        if (entries) ds4_cp_sum_floats(&b->f, b->dK, T * d, "sum of the compressed entries' gradients");
    }
    if (entries) {
        comp_bwd(b, &l->comp, &g->comp, lt, lt->cC, lt->cZ, lt->pool, l->type == DS4_ATTN_CSA, 1);
        if (l->type == DS4_ATTN_CSA && lt->iq) indexer_kl_bwd(b, l, g, lt);
    }
    /* window keys: RoPE, kv_norm, wkv */
    rope_bwd(b, b->dkv, 1, d, rt, 1);
    norm_bwd(b, b->dkv, 0, g->kv_norm, b->dkv, lt->kv_pre, l->kv_norm, T, d);
    lin_bwd_px(b, b->dh, D, 1, g->wkv, b->dkv, d, tape_x(b, lt->h_attn, 0), D, l->wkv, 1, T, D, d);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, wkv), DS4_LORA_AB(go, wkv), b->dh, D, b->dkv, d,
                 (const float *)lt->h_attn, D, T, D, d);
    /* queries: RoPE, per-head RMS, wq_b, q_norm, wq_a */
    rope_bwd_at(b, b->dq, H, d, rt, 1, rq);
    norm_bwd(b, b->dq, 0, NULL, b->dq, lt->q_pre, NULL, Tq * H, d);
    lin_bwd_px(b, b->dqa, qr, 0, g->wq_b, b->dq, H * d, tape_x(b, lt->qr, 0), qr, l->wq_b, 1, Tq, qr, H * d);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, wq_b), DS4_LORA_AB(go, wq_b), b->dqa, qr, b->dq, H * d,
                 (const float *)lt->qr, qr, Tq, qr, H * d);
    norm_bwd(b, b->dqa, 0, g->q_norm, b->dqa, lt->qa, l->q_norm, Tq, qr);
    if (qw) { /* this rank's rows of dh (the pass back to its slice); wq_a over them, reading h's rows per sequence */
        ds4_cp_keep_rows(&b->f, b->dh, D);
        const int64_t n = qw->qn;
        for (int64_t s = 0; s < b->f.B; s++)
            lin_bwd_px(b, b->dh + s * n * D, D, 1, g->wq_a, b->dqa + s * n * qr, qr,
                       tape_x(b, lt->h_attn, (s * S + qw->q0) * D), D, l->wq_a, 1, n, D, qr);
        return; /* no LoRA with context parallelism (cp.c) */
    }
    lin_bwd_px(b, b->dh, D, 1, g->wq_a, b->dqa, qr, tape_x(b, lt->h_attn, 0), D, l->wq_a, 1, T, D, qr);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, wq_a), DS4_LORA_AB(go, wq_a), b->dh, D, b->dqa, qr,
                 (const float *)lt->h_attn, D, T, D, qr);
}

/* Attention sub-layer backward. With context parallelism (cp.c) the ranks' output gradients are gathered, every rank
 * runs the whole sequence's attention backward (the same computation on the same bits as one process) and keeps its
 * rows of dh; the attention weights' gradients, the same on every rank, are added on rank 0 only, so that the
 * all-reduce of the gradients (a sum over ranks) counts them once. */
static void attention_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt) {
    if (!b->f.cp_world) {
        attention_bwd_rows(b, l, g, lt, NULL);
        return;
    }
    const int64_t D = b->m->cfg.hidden_size;
    const int by_query = ds4_cp_by_query(&b->f);
    ds4_layer_w gr = *g;
    if (b->f.cp_rank != 0) { /* the key side's weights (split by query), or all of them: rank 0 adds them */
        if (!by_query) {
            gr.wq_a = gr.q_norm = gr.wq_b = gr.wo_a = gr.wo_b = gr.sink = NULL;
            gr.idx_wq_b = gr.idx_weights = NULL;
        }
        gr.wkv = gr.kv_norm = NULL;
        gr.comp.wkv = gr.comp.wgate = gr.comp.ape = gr.comp.norm = NULL;
        gr.idx_comp.wkv = gr.idx_comp.wgate = gr.idx_comp.ape = gr.idx_comp.norm = NULL;
    }
    if (by_query) {
        ds4_cp_whole_shape(&b->f);
        const ds4_rows qw = ds4_cp_query_rows(&b->f);
        attention_bwd_rows(b, l, &gr, lt, &qw); /* ends with this rank's rows of dh and the pass's slice shape */
        return;
    }
    ds4_cp_gather_rows(&b->f, b->da, D);
    attention_bwd_rows(b, l, &gr, lt, NULL);
    ds4_cp_keep_rows(&b->f, b->dh, D);
}

/* ------------------------------------------------------------------------------------------------ MoE */

/* Backward of the shared expert out = W2·act(x W1ᵀ, x W3ᵀ) over T rows: dx written (row stride D), weight grads added. */
static void shared_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, I = c->moe_intermediate_size;
    const float lim = (float)c->swiglu_limit;
    OP(b->f.dev, swiglu_bwd, .g1 = lt->sg1, .g3 = lt->sg3, .act = b->act, .rows = T, .I = I, .lim = lim, .ex = b->ex);
    const ds4_lora_layer *lo = l->lora, *go = g->lora;
    lin_bwd(b, b->dact, I, 0, g->sw2, b->da, D, b->act, I, l->sw2, 1, T, I, D);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, sw2), DS4_LORA_AB(go, sw2), b->dact, I, b->da, D, b->act, I, T, I, D);
    /* act is no longer needed: dg1 goes there; dg3 overwrites dact element by element, each element read (for both)
     * before it is written */
    OP(b->f.dev, swiglu_bwd, .g1 = lt->sg1, .g3 = lt->sg3, .dact = b->dact, .dg1 = b->act, .dg3 = b->dact, .rows = T,
       .I = I, .lim = lim, .grads = 1, .ex = b->ex);
    lin_bwd(b, b->dh, D, 0, g->sw1, b->act, I, lt->h_ffn, D, l->sw1, 1, T, D, I);
    lin_bwd(b, b->dh, D, 1, g->sw3, b->dact, I, lt->h_ffn, D, l->sw3, 1, T, D, I);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, sw1), DS4_LORA_AB(go, sw1), b->dh, D, b->act, I, lt->h_ffn, D, T, D, I);
    ds4_lora_bwd(&b->lc, lo, DS4_LORA_AB(lo, sw3), DS4_LORA_AB(go, sw3), b->dh, D, b->dact, I, lt->h_ffn, D, T, D, I);
}

/* The routed experts' backward, per expert group (the same arithmetic as shared_bwd on each group's rows). */
static void routed_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, E = c->n_routed_experts, K = c->num_experts_per_tok, TK = T * K;
    const int64_t I = c->moe_intermediate_size;
    const float lim = (float)c->swiglu_limit;
    ds4_dev *dev = b->f.dev;
    OP(dev, moe_sort, .eidx = lt->eidx, .n = TK, .E = E, .perm = b->perm, .off = b->ecount);
    OP(dev, gather_rows, .dst = b->xs, .src = lt->h_ffn, .idx = b->perm, .div = K, .rows = TK, .width = D);
    if (b->f.ep_rows) { /* expert parallelism: the owners compute each row's expert backward (moe_ep.c) */
        OP(dev, moe_dy, .dys = b->dys, .da = b->da, .ew = lt->ew, .perm = b->perm, .rows = TK, .K = K, .D = D);
        ds4_ep_experts_bwd(&b->f, l, g, b->xs, b->dys, b->ecount, lt - b->tp->layers, b->dxs);
        OP(dev, scatter_rows, .dst = b->dxslot, .src = b->dxs, .idx = b->perm, .rows = TK, .width = D);
        OP(dev, moe_sum_slots, .dh = b->dh, .dxslot = b->dxslot, .T = T, .K = K, .D = D);
        return;
    }
    OP(dev, moe_dy, .dys = b->dys, .da = b->da, .ew = lt->ew, .perm = b->perm, .rows = TK, .K = K, .D = D);
    OP(dev, swiglu_bwd, .g1 = lt->eg1, .g3 = lt->eg3, .act = b->act, .rows = TK, .I = I, .lim = lim, .ex = b->ex);
    OP(dev, linear_bwd_x_grouped, .dx = b->dact, .dy = b->dys, .W = l->w2, .wdt = l->edt[1], .Ws = l->escale[1],
       .wstride = D * I, .off = b->ecount, .E = E, .rows = TK, .K = I, .O = D, .bf16_in = b->f.w->bf16_in);
    if (g->w2)
        OP(dev, linear_bwd_w_grouped, .dW = g->w2, .wstride = D * I, .dy = b->dys, .x = b->act, .off = b->ecount,
           .E = E, .rows = TK, .K = I, .O = D, .wdt = b->mdt, .bf16_in = b->f.w->bf16_in);
    ds4_lora_bwd_down(&b->lc, c, l->lora, g->lora, b->dact, b->dys, b->act, b->ecount, TK);
    OP(dev, swiglu_bwd, .g1 = lt->eg1, .g3 = lt->eg3, .dact = b->dact, .dg1 = b->act, .dg3 = b->dact, .rows = TK,
       .I = I, .lim = lim, .grads = 1, .ex = b->ex);
    OP(dev, linear_bwd_x_grouped, .dx = b->dxs, .dy = b->act, .W = l->w1, .wdt = l->edt[0], .Ws = l->escale[0],
       .wstride = I * D, .off = b->ecount, .E = E, .rows = TK, .K = D, .O = I, .bf16_in = b->f.w->bf16_in);
    OP(dev, linear_bwd_x_grouped, .dx = b->dxs, .acc = 1, .dy = b->dact, .W = l->w3, .wdt = l->edt[2],
       .Ws = l->escale[2], .wstride = I * D, .off = b->ecount, .E = E, .rows = TK, .K = D, .O = I, .bf16_in = b->f.w->bf16_in);
    /* the two weight gradients of the same x one after the other: a backend may keep what it made of x (x_kept) */
    if (g->w1)
        OP(dev, linear_bwd_w_grouped, .dW = g->w1, .wstride = I * D, .dy = b->act, .x = b->xs, .off = b->ecount,
           .E = E, .rows = TK, .K = D, .O = I, .wdt = b->mdt, .bf16_in = b->f.w->bf16_in);
    if (g->w3)
        OP(dev, linear_bwd_w_grouped, .dW = g->w3, .wstride = I * D, .dy = b->dact, .x = b->xs, .off = b->ecount,
           .E = E, .rows = TK, .K = D, .O = I, .wdt = b->mdt, .bf16_in = b->f.w->bf16_in, .x_kept = g->w1 != NULL);
    ds4_lora_bwd_gate_up(&b->lc, c, l->lora, g->lora, b->dxs, b->act, b->dact, b->xs, b->ecount, TK);
    /* the input gradients are in expert order: file them by slot, then sum each token's slots in slot order */
    OP(dev, scatter_rows, .dst = b->dxslot, .src = b->dxs, .idx = b->perm, .rows = TK, .width = D);
    OP(dev, moe_sum_slots, .dh = b->dh, .dxslot = b->dxslot, .T = T, .K = K, .D = D);
}

/* MoE backward: b->da (gradient of routed + shared output) → b->dh (written). */
static void moe_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, E = c->n_routed_experts, K = c->num_experts_per_tok;
    shared_bwd(b, l, g, lt);
    /* routed: d(weight) = <da, y_slot>, dy_slot = weight · da */
    OP(b->f.dev, moe_dws, .dws = b->dws, .da = b->da, .ye = lt->ye, .T = T, .K = K, .D = D);
    routed_bwd(b, l, g, lt);
    OP(b->f.dev, router_bwd, .c = c, .eidx = lt->eidx, .rsc = lt->rsc, .rlog = lt->rlog, .dws = b->dws, .dsc = b->dsc,
       .dlog = b->dlog, .T = T);
    lin_bwd(b, b->dh, D, 1, g->gate, b->dlog, E, lt->h_ffn, D, l->gate, 0, T, D, E);
}

/* ------------------------------------------------------------------------------------------------ block / head */

/* One block backward: dX holds the gradient of the block output on entry, of its input on return. */
static void block_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_w *g, const ds4_layer_tape *lt, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size;
    /* X_mid, the streams between the two sites, is not on the tape (n·D floats a token, as much as X_in): the
     * forward's hc_post again, on the same X_in, a_attn and mixing weights, gives it bit for bit. With recomputation
     * the block's replay just left it in the pass's Xt (its attention site's output), which nothing has written since */
    float *X_mid = b->tp->recompute ? b->f.Xt : b->xmid;
    if (!b->tp->recompute)
        OP(b->f.dev, hc_post, .c = c, .X = lt->X_in, .a = lt->a_attn, .post = lt->post_attn, .comb = lt->comb_attn,
           .Xo = X_mid, .T = T);
    /* ffn site: X = post ⊗ a_ffn + combᵀ X_mid */
    OP(b->f.dev, hc_post_bwd, .c = c, .w = &l->hc_ffn, .dXo = dX, .a = lt->a_ffn, .X = X_mid, .dX = b->dXt,
       .da = b->da, .dpost = b->dpost, .dcomb = b->dcomb, .mix = lt->mix_ffn, .T = T);
    moe_bwd(b, l, g, lt);
    norm_bwd(b, b->du, 0, g->ffn_norm, b->dh, lt->u_ffn, l->ffn_norm, T, D);
    hc_site_bwd(b, &l->hc_ffn, &g->hc_ffn, X_mid, lt->mix_ffn, b->du, b->dXt);
    /* attention site: X_mid = post ⊗ a_attn + combᵀ X_in */
    OP(b->f.dev, hc_post_bwd, .c = c, .w = &l->hc_attn, .dXo = b->dXt, .a = lt->a_attn, .X = lt->X_in, .dX = dX,
       .da = b->da, .dpost = b->dpost, .dcomb = b->dcomb, .mix = lt->mix_attn, .T = T);
    attention_bwd(b, l, g, lt);
    norm_bwd(b, b->du, 0, g->attn_norm, b->dh, lt->u_attn, l->attn_norm, T, D);
    hc_site_bwd(b, &l->hc_attn, &g->hc_attn, lt->X_in, lt->mix_attn, b->du, dX);
}

/* The targets of the rows of logits [B, Sl, V], row (b, s) at position off + s of labels [B, S]: labels[b, off + s +
 * shift] where off + s + shift < S, else -100. */
static void targets(int64_t *tgt, const int64_t *labels, int64_t B, int64_t Sl, int64_t S, int64_t off, int64_t shift) {
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t s = 0; s < Sl; s++)
            tgt[bb * Sl + s] = off + s + shift < S ? labels[bb * S + off + s + shift] : -100;
}

/* The head (DS4_HEAD_MAIN / DS4_HEAD_MTP) of a pass: logits = head(norm(HyperHead(X))) → dX (written), for the
 * objective Σ g·log p(target) with g = dlogp[row] (or g0 when dlogp is NULL) at the rows whose target (tgt, backend)
 * is not -100. In chunks of the tape's head_rows, as the forward ran it: each chunk's logits recomputed from y (the
 * same product on the same rows, so the same bits) unless the tape still holds them whole, its logit gradient (from
 * the rows' softmax statistics the forward kept, which are those of the same logits), and its share of dy and of the
 * head's weight gradient (chunks add in order). */
static void head_bwd(bwd *b, int head, const float *u, const float *y, const float *X, const float *fn, const float *base,
                     const float *scale, const float *nw, float *gfn, float *gbase, float *gscale, float *gnorm,
                     const int64_t *tgt, const float *dlogp, double g0, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, V = c->vocab_size, R = b->tp->head_rows;
    float *logits = b->tp->logits;
    const int kept = b->tp->logits_head == head && T <= R;
    b->tp->logits_head = T <= R ? head : 0;
    const int64_t so = head == DS4_HEAD_MTP ? b->tp->T : 0; /* the head's statistics rows (head_chunks) */
    const int stats = (b->tp->stats_heads & head) != 0;
    for (int64_t r0 = 0; r0 < T; r0 += R) {
        const int64_t n = T - r0 < R ? T - r0 : R;
        if (!kept)
            OP(b->f.dev, matmul, .y = logits, .ldy = V, .x = y + r0 * D, .ldx = D, .W = b->f.w->head, .wdt = b->mdt,
               .T = n, .K = D, .O = V, .bf16_in = b->f.w->bf16_in);
        /* the logits' gradient feeds only the two products below: in the bf16 mode, which rounds it for them, a
         * backend may keep it rounded instead of writing it (dl16, dy_kept; ops.h). Only when both run (a trained
         * head): with the head frozen the pair is dx alone, and an unwritten dl would outlive it in the backend's
         * notes about b->dlog, which the router's backward reuses */
        OP(b->f.dev, logp_bwd, .dl = b->dlog, .logits = logits, .rows = n, .V = V, .tgt = tgt + r0,
           .dlogp = dlogp ? dlogp + r0 : NULL, .g0 = g0, .rmx = stats ? b->tp->rmx + so + r0 : NULL,
           .rse = stats ? b->tp->rse + so + r0 : NULL, .dl16 = b->mdt == DS4_BF16 && b->gw->head != NULL,
           .exp32 = b->f.w->bf16_in);
        OP(b->f.dev, linear_bwd_x, .dx = b->dh + r0 * D, .lddx = D, .dy = b->dlog, .ldy = V, .W = b->f.w->head,
           .wdt = b->mdt, .T = n, .K = D, .O = V, .bf16_in = b->f.w->bf16_in, .dy_kept = 1);
        /* the chunks' weight gradients are one run into the head's dW (ops.h) */
        if (b->gw->head)
            OP(b->f.dev, linear_bwd_w, .dW = b->gw->head, .dy = b->dlog, .ldy = V, .x = y + r0 * D, .ldx = D, .T = n,
               .K = D, .O = V, .wdt = b->mdt, .bf16_in = b->f.w->bf16_in, .dy_kept = 1,
               .run = DS4_DW_RUN | (r0 == 0 ? DS4_DW_FIRST : 0) | (r0 + n == T ? DS4_DW_LAST : 0));
    }
    norm_bwd(b, b->du, 0, gnorm, b->dh, u, nw, T, D);
    hyperhead_bwd(b, X, fn, base, scale, gfn, gbase, gscale, b->du, dX);
}

/* The MTP block's backward (its loss λ·mean over its own scored tokens): into its weights and the embedding, and the
 * final streams' gradient b->dX of the positions i < S-1. */
static void mtp_bwd(bwd *b, double ms, int64_t *htgt, int32_t *hrows) {
    ds4_model *m = b->m;
    ds4_tape *tp = b->tp;
    const ds4_config *c = &m->cfg;
    const ds4_mtp_w *mt = &b->f.w->mtp, *gm = &b->gw->mtp;
    /* the tape's rows are positions off .. off + tp->S - 1 of ids [B, S] (with context parallelism this rank's
     * slice; the MTP block's rows are the same less the sequence's last position) */
    const int64_t B = tp->B, S = tp->cp_S ? tp->cp_S : tp->S, off = tp->cp_off, Sx = tp->S;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D;
    ds4_dev *dev = b->f.dev;
    if (b->f.cp_world) ds4_cp_set_mtp(&b->f, 1);
    else set_shape(b, S - 1, B * (S - 1));
    const int64_t S1 = b->f.S, T1 = b->f.T;
    targets(htgt, tp->hlabels, B, S1, S, off, 2);
    ds4_dev_upload(dev, tp->tgt, htgt, (size_t)T1 * sizeof(int64_t));
    /* the main gradient stays in dX; the MTP pass works in dmtp (block_bwd's scratch is dXt) */
    head_bwd(b, DS4_HEAD_MTP, tp->mtp_u, tp->mtp_y, tp->mtp_X, mt->hc_head_fn, mt->hc_head_base, mt->hc_head_scale,
             mt->norm, gm->hc_head_fn, gm->hc_head_base, gm->hc_head_scale, gm->norm, tp->tgt, NULL, -ms, b->dmtp);
    block_bwd(b, &mt->block, &gm->block, &tp->layers[c->num_hidden_layers], b->dmtp);
    /* z_i[k] = e_proj(enorm(e_{i+1})) + h_proj(hnorm(X^L_i[k])) */
    OP(dev, sum_streams, .du = b->du, .dX = b->dmtp, .T = T1, .n = n, .D = D);
    lin_bwd(b, b->dh, D, 0, gm->e_proj, b->du, D, tp->mtp_en, D, mt->e_proj, 1, T1, D, D);
    norm_bwd(b, b->da, 0, gm->enorm, b->dh, tp->mtp_e, mt->enorm, T1, D);
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t i = 0; i < S1; i++) {
            htgt[bb * S1 + i] = tp->hids[bb * S + off + i + 1];
            hrows[bb * S1 + i] = (int32_t)(bb * Sx + i);
        }
    ds4_dev_upload(dev, b->mids, htgt, (size_t)T1 * sizeof(int64_t));
    ds4_dev_upload(dev, b->rowmap, hrows, (size_t)T1 * sizeof(int32_t));
    if (b->gw->embed) OP(dev, embed_bwd, .ge = b->gw->embed, .ids = b->mids, .dx = b->da, .T = T1, .n = 1, .D = D);
    lin_bwd(b, b->dxn, D, 0, gm->h_proj, b->dmtp, D, tp->mtp_hn, D, mt->h_proj, 1, T1 * n, D, D);
    /* hnorm over the rows X^L[b, i < S-1, k]: gather them, then add the gradient back */
    OP(dev, gather_rows, .dst = b->xn, .src = tp->X_L, .idx = b->rowmap, .div = 1, .rows = T1, .width = nD);
    norm_bwd(b, b->dxn, 0, gm->hnorm, b->dxn, b->xn, mt->hnorm, T1 * n, D);
    OP(dev, add_rows, .dst = b->dX, .src = b->dxn, .idx = b->rowmap, .rows = T1, .width = nD);
    if (b->f.cp_world) ds4_cp_set_mtp(&b->f, 0);
    else set_shape(b, S, tp->T);
}

/* ------------------------------------------------------------------------------------------------ entry */

static ds4_status tape_ready(ds4_model *m, const char *op, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "%s: model is NULL", op);
    if (!ds4_model_grad_enabled(m)) return ds4_fail(err, DS4_ERR_ARG, "%s: gradients are not enabled (enable_grad)", op);
    if (!m->tape || !m->tape->valid)
        return ds4_fail(err, DS4_ERR_ARG, "%s: no training forward to differentiate (call forward_train first)", op);
    ds4_status s = ds4_model_train_bind(m, err);
    if (s) return s;
    if (m->dgrads) m->grads_stale = 1; /* the backward adds into the device's gradients */
    if (m->lora && m->lora->dgrads) m->lora->grads_stale = 1;
    return DS4_OK;
}

ds4_status ds4_model_last_batch(const ds4_model *m, int64_t *batch, int64_t *seq, ds4_error *err) {
    if (!m || !m->tape || !m->tape->valid)
        return ds4_fail(err, DS4_ERR_ARG, "last_batch: no training forward (call forward_train first)");
    if (batch) *batch = m->tape->B;
    if (seq) *seq = m->tape->S;
    return DS4_OK;
}

ds4_status ds4_model_logprobs(ds4_model *m, float *logp, float *entropy, ds4_error *err) {
    ds4_status s = tape_ready(m, "logprobs", err);
    if (s) return s;
    /* the training forward computed them with its head, chunk by chunk (forward.c, head_chunks) */
    const ds4_tape *tp = m->tape;
    const int64_t T = tp->T;
    ds4_dev *dev = m->dev;
    if (logp) ds4_dev_download(dev, logp, tp->lp, (size_t)T * sizeof(float));
    if (entropy) ds4_dev_download(dev, entropy, tp->lp + T, (size_t)T * sizeof(float));
    return ds4_dev_check(dev, "logprobs", err);
}

/* A backward adds its gradient to the buffer with one fp32 addition per element. Inside a backward some elements
 * receive many additions (a norm weight or a sink token by token, the embedding row of a repeated id, the head and
 * embedding shared by the main and the MTP losses), so accumulating onto gradients that are already there would
 * interleave them: ((g + t1) + t2) + ... instead of g + (t1 + t2 + ...). When the buffer is not known to be zero
 * it is set aside, the backward runs on zeros, and the saved values are added back: k backwards accumulated in one
 * buffer give ((G1 + G2) + G3) + ..., the same bits as the k gradients computed apart and summed in that order —
 * which is what data parallelism's rank-order sum computes (docs/distributed.md, "Bitwise data parallelism"). The
 * saved copy costs one buffer of n_params floats on the model's backend, allocated on the first accumulation. */
static ds4_status set_aside(ds4_model *m, float **saved, ds4_error *err) {
    *saved = NULL;
    /* adapters (LoRA) train in their own buffer, which accumulates as the backward adds (not set aside: data
     * parallelism of adapters is not wired) */
    if (m->lora || !m->grads || m->grads_zero || m->n_params == 0) return DS4_OK;
    ds4_dev *d = m->dev;
    const size_t bytes = (size_t)m->n_params * sizeof(float);
    if (!m->gsaved) {
        void *p = NULL;
        ds4_status s = d->ops->alloc(d, bytes, &p, err);
        if (s) {
            ds4_error_prefix(err, "backward: the accumulated gradients set aside (%lld fp32 values): ",
                             (long long)m->n_params);
            return s;
        }
        m->gsaved = p;
    }
    float *g = m->dgrads ? m->dgrads : m->grads;
    ds4_dev_copy(d, m->gsaved, g, bytes);
    ds4_dev_fill(d, g, 0, bytes);
    *saved = m->gsaved;
    return DS4_OK;
}

/* g[lo, hi) += saved[lo, hi), in rows of ADD_ROW values (add_bcast with one stream is a plain add, one fp32 addition
 * per element whatever the rows; the rows let the CPU backend spread it over its threads). */
static void add_back(ds4_model *m, const float *saved, int64_t lo, int64_t hi) {
    enum { ADD_ROW = 4096 };
    float *g = (m->dgrads ? m->dgrads : m->grads) + lo;
    saved += lo;
    const int64_t n = hi - lo, full = n / ADD_ROW, rest = n - full * ADD_ROW;
    if (full > 0) OP(m->dev, add_bcast, .x = g, .h = saved, .T = full, .n = 1, .D = ADD_ROW);
    if (rest > 0)
        OP(m->dev, add_bcast, .x = g + full * ADD_ROW, .h = saved + full * ADD_ROW, .T = 1, .n = 1, .D = rest);
}

/* The hook of ds4_model_on_grads_final for one backward: [lo, from) of the gradient buffer became final. */
typedef struct gfinal {
    ds4_grads_final_fn fn;
    void *ctx;
    float *g;             /* the trained gradient buffer (backend memory) */
    void *stream;         /* the backend's stream, or NULL */
    int64_t from;         /* [from, count) reported so far */
    int per_block;        /* 1: reported block by block (the model's own gradients, no collectives in the backward) */
} gfinal;

static void gfinal_arm(ds4_model *m, gfinal *gf) {
    memset(gf, 0, sizeof *gf);
    gf->fn = m ? m->gfinal_fn : NULL;
    if (!gf->fn) return;
    gf->ctx = m->gfinal_ctx;
    m->gfinal_fn = NULL, m->gfinal_ctx = NULL; /* one backward */
    const int lora = m->lora != NULL;
    gf->g = lora ? (m->lora->dgrads ? m->lora->dgrads : m->lora->grads) : (m->dgrads ? m->dgrads : m->grads);
    gf->from = lora ? m->lora->n : m->n_params;
    gf->stream = m->dev->ops->native_stream ? m->dev->ops->native_stream(m->dev) : NULL;
    gf->per_block = !lora && !m->ep_on && !m->cp_on && m->grads;
}

/* [lo, from) final: its set-aside values added back (when the backward accumulates), then reported. */
static void gfinal_reach(ds4_model *m, gfinal *gf, const float *saved, int64_t lo) {
    if (!gf->fn || lo >= gf->from) return;
    if (saved) add_back(m, saved, lo, gf->from);
    gf->fn(gf->ctx, m, gf->g, lo, gf->from, gf->stream);
    gf->from = lo;
}

static ds4_status backward_impl(ds4_model *m, const float *dlogp, const ds4_backward_scales *sc, gfinal *gf,
                                ds4_error *err);

/* The flat offset of block li's first parameter (the blocks lie in order between the embedding and the head). */
static int64_t block_start(const ds4_model *m, int64_t li) {
    return li < m->cfg.num_hidden_layers ? m->w.layers[li].attn_norm - m->params : m->w.norm - m->params;
}

/* The backward once this rank's checks gave s: with context parallelism the ranks agree first (every rank fails when
 * one refused, instead of leaving the others in a gather). */
static ds4_status run_backward(ds4_model *m, ds4_status s, const char *what, const float *dlogp,
                               const ds4_backward_scales *sc, ds4_error *err) {
    gfinal gf;
    gfinal_arm(m, &gf);
    if (m && m->cp_on) {
        const ds4_tape *tp = m->tape;
        const int ok = tp && tp->valid && !s;
        s = ds4_cp_agree(m, what, ok ? tp->B : 0, ok ? tp->cp_S : 0, ok ? tp->hids : NULL, ok ? tp->hlabels : NULL, s,
                         err);
    }
    if (!s) s = backward_impl(m, dlogp, sc, &gf, err);
    /* what a failed backward did not reach is reported too: every rank issues the same collectives */
    if (gf.fn && gf.from > 0) gf.fn(gf.ctx, m, gf.g, 0, gf.from, gf.stream);
    return s;
}

ds4_status ds4_model_backward(ds4_model *m, double scale, ds4_error *err) {
    ds4_status s = tape_ready(m, "backward", err);
    if (!s && !isfinite(scale)) s = ds4_fail(err, DS4_ERR_ARG, "backward: scale %g is not finite", scale);
    const ds4_backward_scales sc = {.ce = scale, .mtp = -1, .ikl = -1};
    return run_backward(m, s, "backward", NULL, &sc, err);
}

static ds4_status check_scales(const ds4_backward_scales *sc, const char *op, ds4_error *err) {
    if (!sc) return ds4_fail(err, DS4_ERR_ARG, "%s: scales is NULL", op);
    if (!isfinite(sc->ce) || !isfinite(sc->mtp) || !isfinite(sc->ikl))
        return ds4_fail(err, DS4_ERR_ARG, "%s: scales ce %g, mtp %g, ikl %g: each must be finite", op, sc->ce, sc->mtp,
                        sc->ikl);
    return DS4_OK;
}

ds4_status ds4_model_backward_scaled(ds4_model *m, const ds4_backward_scales *sc, ds4_error *err) {
    ds4_status s = tape_ready(m, "backward", err);
    if (!s) s = check_scales(sc, "backward", err);
    return run_backward(m, s, "backward", NULL, sc, err);
}

ds4_status ds4_model_backward_logprobs(ds4_model *m, const float *dlogp, ds4_error *err) {
    return ds4_model_backward_logprobs_scaled(m, dlogp, -1, err);
}

ds4_status ds4_model_backward_logprobs_scaled(ds4_model *m, const float *dlogp, double ikl_scale, ds4_error *err) {
    ds4_status s = tape_ready(m, "backward_logprobs", err);
    if (!s && !isfinite(ikl_scale))
        s = ds4_fail(err, DS4_ERR_ARG, "backward_logprobs: indexer KL scale %g is not finite", ikl_scale);
    if (!s && !dlogp) s = ds4_fail(err, DS4_ERR_ARG, "backward_logprobs: dlogp is NULL");
    for (int64_t t = 0; !s && t < m->tape->T; t++)
        if (!isfinite(dlogp[t]))
            s = ds4_fail(err, DS4_ERR_ARG, "backward_logprobs: dlogp[%lld, %lld] = %g is not finite (dlogp [%lld, %lld])",
                         (long long)(t / m->tape->S), (long long)(t % m->tape->S), (double)dlogp[t],
                         (long long)m->tape->B, (long long)m->tape->S);
    const ds4_backward_scales sc = {.ce = 0, .mtp = -1, .ikl = ikl_scale};
    return run_backward(m, s, "backward_logprobs", dlogp, &sc, err);
}

/* The CE path passes dlogp = NULL and scale; the per-token path passes dlogp (and the MTP term, when on, keeps its
 * own mean normalisation relative to the main loss: see below). */
static ds4_status backward_impl(ds4_model *m, const float *dlogp, const ds4_backward_scales *sc, gfinal *gf,
                                ds4_error *err) {
    ds4_tape *tp = m->tape;
    const double scale = sc->ce;
    const ds4_config *c = &m->cfg;
    bwd b;
    memset(&b, 0, sizeof b);
    /* expert parallelism: the rows the forward planned (every rank's backward makes the same exchanges) */
    const ds4_pass_opts po = {.ep_rows = m->ep_on ? tp->ep_rows : 0, .tok_rows = tp->cp_S ? tp->T : 0};
    ds4_status s = ds4_ep_reserve(m, po.ep_rows, err);
    const int64_t Sw = tp->cp_S ? tp->cp_S : tp->S; /* the whole sequence (the tape holds this rank's slice) */
    if (!s) s = ds4_pass_setup(m, &b.f, tp->B, Sw, tp->B * Sw, &po, 1, err);
    if (s) return s;
    if (tp->cp_S) ds4_cp_begin(&b.f, Sw);
    b.m = m;
    b.tp = tp;
    b.gw = &m->gw;
    b.mdt = b.f.w->mdt;
    b.ikl_scale = sc->ikl;
    ds4_arena a = {0};
    bplan(&b, &a);
    if (a.used > tp->bbytes) {
        m->dev->ops->free(m->dev, tp->bmem);
        tp->bmem = NULL;
        tp->bbytes = 0;
        if ((s = m->dev->ops->alloc(m->dev, a.used, &tp->bmem, err))) {
            ds4_error_prefix(err, "backward: workspace for ids [%lld, %lld]: ", (long long)tp->B, (long long)tp->S);
            return s;
        }
        tp->bbytes = a.used;
    }
    ds4_arena w = {tp->bmem, 0};
    bplan(&b, &w);
    b.lc.dev = b.f.dev;
    const int64_t T = tp->T, L = c->num_hidden_layers;
    int64_t *htgt = malloc((size_t)T * (sizeof(int64_t) + sizeof(int32_t)));
    if (!htgt) return ds4_fail(err, DS4_ERR_OOM, "backward: host scratch for %lld rows", (long long)T);
    int32_t *hrows = (int32_t *)(htgt + T);
    ds4_dev *dev = b.f.dev;
    targets(htgt, tp->hlabels, tp->B, tp->S, Sw, tp->cp_off, 1);
    ds4_dev_upload(dev, tp->tgt, htgt, (size_t)T * sizeof(int64_t));
    const float *dl = ds4_pass_input(&b.f, b.dlogp, dlogp, (size_t)T * sizeof(float));
    const ds4_weights *wv = b.f.w;
    float *gsaved = NULL;
    if ((s = set_aside(m, &gsaved, err))) {
        free(htgt);
        return s;
    }
    m->grads_zero = 0; /* written from here on, also if the backward fails part way (zero_grad must then fill) */
    head_bwd(&b, DS4_HEAD_MAIN, tp->u_fin, tp->y_fin, tp->X_L, wv->hc_head_fn, wv->hc_head_base, wv->hc_head_scale, wv->norm,
             b.gw->hc_head_fn, b.gw->hc_head_base, b.gw->hc_head_scale, b.gw->norm, tp->tgt, dl, -scale, b.dX);
    if (tp->with_mtp && tp->mtp_tokens > 0 && !dlogp)
        /* MTP term λ·mean over its own scored tokens: by default the per-token scale λ·scale·(main tokens / MTP
         * tokens), which is λ / mtp_tokens when scale = 1 / loss_tokens; the caller's own (λ / the global MTP count)
         * when given */
        mtp_bwd(&b, sc->mtp >= 0 ? sc->mtp : m->topt.mtp_lambda * scale * (double)tp->loss_tokens / (double)tp->mtp_tokens,
                htgt, hrows);
    /* the final norm, the head and the MTP block lie after the blocks: complete now (the embedding, which the MTP
     * term also reaches, lies before them) */
    if (gf->per_block) gfinal_reach(m, gf, gsaved, block_start(m, L));
    int64_t ncsa = 0; /* CSA layers before the block being recomputed (its indexer replay offset) */
    for (int64_t li = 0; li < L; li++) ncsa += c->layer_types[li] == DS4_ATTN_CSA;
    for (int64_t li = L - 1; li >= 0; li--) {
        ncsa -= c->layer_types[li] == DS4_ATTN_CSA;
        b.f.li = li; /* named in expert-parallel errors */
        if (tp->recompute) {
            /* refill the shared slots: block li's forward again from its kept input, with its kept decisions, on the
             * pass's activation buffers (the backward's own live in its workspace) */
            b.f.tape = tp;
            b.f.lt = &tp->layers[li];
            b.f.li = b.f.rows.li = li;
            b.f.csa_i = ncsa;
            b.f.recompute = 1;
            ds4_block_to(&b.f, &wv->layers[li], tp->layers[li].X_in, b.f.X, tp->ids); /* X_in only read */
        }
        block_bwd(&b, &wv->layers[li], &b.gw->layers[li], &tp->layers[li], b.dX);
        if (gf->per_block) gfinal_reach(m, gf, gsaved, block_start(m, li));
    }
    if (b.gw->embed)
        OP(dev, embed_bwd, .ge = b.gw->embed, .ids = tp->ids, .dx = b.dX, .T = T, .n = c->hc_mult, .D = c->hidden_size);
    if (gf->per_block) {
        gfinal_reach(m, gf, gsaved, 0); /* the embedding */
    } else {
        if (gsaved) add_back(m, gsaved, 0, m->n_params);
        gfinal_reach(m, gf, NULL, 0);
    }
    m->grads_zero = 0;
    free(htgt);
    tp->valid = 0;
    return ds4_dev_check(dev, "backward", err);
}
