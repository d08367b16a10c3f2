/* forward.c — the model schedule of a forward pass: the decoder block (mHC sites around attention and MoE), the
 * head, the MTP block, and the entry points ds4_model_forward / ds4_model_forward_train. The same block runs a
 * step over caches (step.c). docs/architecture.md has the equations, docs/design.md the schedule / op split.
 *
 * Token layout: T = B·S rows, row t = b·S + s; every sequence starts at absolute position 0 (compression windows
 * are aligned to position 0, so there is no left padding). Residual streams X are [T, n, D].
 * One block: attn site X → Xt, ffn site Xt → X. Every arithmetic step is an operation of the model's backend
 * (ops.h); this file decides what runs in which order and where each tensor lives. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sched.h"

/* Copy n floats into a tape slot when training (dst NULL: inference, nothing to keep). */
static void keep(ds4_pass *f, float *dst, const float *src, int64_t n) {
    if (dst) ds4_dev_copy(f->dev, dst, src, (size_t)n * sizeof(float));
}

/* M: W is an M matrix (held in the views' mdt; its product rounds x to bf16 in the bf16 mode), else an fp32 weight */
static void matmul(ds4_pass *f, float *y, const float *x, const void *W, int M, int64_t T, int64_t K, int64_t O) {
    OP(f->dev, matmul, .y = y, .ldy = O, .x = x, .ldx = K, .W = W, .wdt = M ? f->w->mdt : DS4_F32, .T = T, .K = K,
       .O = O, .bf16_in = M && f->w->bf16_in);
}

/* An M matrix's product whose x, an input of bf16 products only (sched.h), the tape keeps at `kept` (NULL: none). With
 * the tape in bf16 (x16) the copy is rounded as the products round x, and the product writes it in the pass that rounds
 * x for itself (ds4_a_matmul.keep16: one read of x, not two); else it is copied in fp32 after. */
static void *keep16_of(ds4_pass *f, void *kept) { return kept && f->tape->x16 ? kept : NULL; }
static void matmul_keep(ds4_pass *f, float *y, const float *x, const void *W, int64_t T, int64_t K, int64_t O,
                        void *kept) {
    OP(f->dev, matmul, .y = y, .ldy = O, .x = x, .ldx = K, .W = W, .wdt = f->w->mdt, .T = T, .K = K, .O = O,
       .bf16_in = f->w->bf16_in, .keep16 = keep16_of(f, kept));
    if (kept && !f->tape->x16) keep(f, kept, x, T * K);
}

/* The same with an M matrix, on the x of the product just before, unchanged since (ops.h, x_kept: the backend may
 * reuse its rounded copy of x) */
static void matmul_same_x(ds4_pass *f, float *y, const float *x, const void *W, int64_t T, int64_t K, int64_t O) {
    OP(f->dev, matmul, .y = y, .ldy = O, .x = x, .ldx = K, .W = W, .wdt = f->w->mdt, .T = T, .K = K, .O = O,
       .bf16_in = f->w->bf16_in, .x_kept = 1);
}

static void norm(ds4_pass *f, float *y, const float *x, const float *w, int64_t rows, int64_t width) {
    OP(f->dev, rmsnorm, .y = y, .x = x, .w = w, .rows = rows, .width = width, .eps = f->c->rms_norm_eps);
}

static void rope_at(ds4_pass *f, float *x, int64_t heads, int64_t width, const ds4_rope_table *rt, int sign,
                    const ds4_rows *rows) {
    OP(f->dev, rope, .x = x, .heads = heads, .width = width, .rt = *rt, .rows = *rows, .sign = sign);
}
static void rope(ds4_pass *f, float *x, int64_t heads, int64_t width, const ds4_rope_table *rt, int sign) {
    rope_at(f, x, heads, width, rt, sign, &f->rows);
}

/* The attention sub-layer's query side: its rows and their input h. The pass's own (T, f->rows, f->h), except with
 * context parallelism split by query (cp.c): there the key side (window keys, compressors, indexer entries) runs
 * over the gathered whole sequences and the query side over this rank's slice (a query window of f->rows). */
typedef struct {
    int64_t T;
    ds4_rows rows;
    const float *h;
} attn_q;

/* ------------------------------------------------------------------------------------------------ attention */

/* The QAT option (docs/architecture.md, "FP8 KV quantisation-aware training") for a key-side vector of `width`
 * channels whose last 2·half are rotated by RoPE: window keys and the attention compressor's entries get their
 * non-RoPE channels rounded to e4m3 in blocks of 64; the indexer's queries and entries (indexer != 0) the Hadamard
 * rotation, then e2m1 in blocks of 32 over the whole vector. Off (fmt 0) unless the model has kv_qat on. */
static ds4_fq qat_of(const ds4_pass *f, int indexer, int64_t width, int64_t half) {
    ds4_fq q = {0};
    if (!f->m->kv_qat) return q;
    if (indexer) {
        q.fmt = DS4_FQ_E2M1;
        q.hadamard = 1;
        q.nq = width;
    } else {
        q.fmt = DS4_FQ_E4M3;
        q.nq = width - 2 * half;
    }
    return q;
}

/* Entries of a compressor over h: returns the number of complete windows per row (0 in a step, where the entries
 * go to the caches). In training the projections and pooled entries are kept (keep_* non-NULL). */
static int64_t compress(ds4_pass *f, const ds4_compressor_w *w, int which, float *C, float *Z, float *out, int overlap,
                        float *keep_C, float *keep_Z, float *keep_pool) {
    const int64_t D = f->c->hidden_size;
    matmul(f, C, f->h, w->wkv, 1, f->T, D, w->width);
    matmul_same_x(f, Z, f->h, w->wgate, f->T, D, w->width);
    keep(f, keep_C, C, f->T * w->width);
    keep(f, keep_Z, Z, f->T * w->width);
    const int cls = overlap ? 0 : 1; /* CSA windows, or HCA windows */
    if (f->rows.pos) {
        OP(f->dev, compress, .c = f->c, .w = w, .overlap = overlap, .which = which, .cls = cls, .C = C, .Z = Z,
           .rows = f->rows, .njobs = f->njobs[cls], .rt = f->rcomp, .q = qat_of(f, which, w->dd, f->rcomp.half));
        return 0;
    }
    const int64_t nwin = f->S / w->rate;
    if (nwin == 0) return 0;
    OP(f->dev, compress, .c = f->c, .w = w, .overlap = overlap, .which = which, .cls = cls, .C = C, .Z = Z, .out = out,
       .pool = keep_pool, .rows = f->rows, .B = f->B, .nwin = nwin, .rt = f->rcomp,
       .q = qat_of(f, which, w->dd, f->rcomp.half));
    return nwin;
}

/* The lightning indexer of a CSA layer: its entries (over the key side's rows), queries, head weights and picks (over
 * the query side's: into f->sel / f->nsel). */
static void indexer(ds4_pass *f, const ds4_layer_w *l, ds4_layer_tape *lt, const attn_q *aq) {
    const ds4_config *c = f->c;
    const int64_t T = aq->T, D = c->hidden_size, qr = c->q_lora_rank, nI = c->index_n_heads, cI = c->index_head_dim;
    const int64_t nwin = compress(f, &l->idx_comp, 1, f->iC, f->iZ, f->iK, 1, lt ? lt->iC : NULL, lt ? lt->iZ : NULL,
                                  lt ? lt->ipool : NULL);
    matmul(f, f->iq, f->qr, l->idx_wq_b, 1, T, qr, nI * cI);
    ds4_lora_fwd(f, l->lora, DS4_LORA_AB(l->lora, idx_wq_b), f->iq, nI * cI, f->qr, qr, T, qr, nI * cI);
    rope_at(f, f->iq, nI, cI, &f->rcomp, 1, &aq->rows);
    if (f->m->kv_qat) OP(f->dev, fake_quant, .x = f->iq, .rows = T * nI, .width = cI, .q = qat_of(f, 1, cI, 0));
    matmul(f, f->iw, aq->h, l->idx_weights, 1, T, D, nI);
    ds4_lora_fwd(f, l->lora, DS4_LORA_AB(l->lora, idx_weights), f->iw, nI, aq->h, D, T, D, nI);
    OP(f->dev, scale, .x = f->iw, .n = T * nI, .s = 1.0f / sqrtf((float)nI));
    if (lt && lt->iq) {
        keep(f, lt->iq, f->iq, T * nI * cI);
        keep(f, lt->iw, f->iw, T * nI);
        keep(f, lt->iK, f->iK, f->B * f->S * cI);
    }
    /* a step's rows each see their own number of entries: k = min(index_topk, causal entries) per row */
    const int64_t K = c->index_topk, ncsa = ds4_model_csa_layers(f->m);
    if (f->recompute) { /* the picks the training forward made */
        ds4_dev_copy(f->dev, f->sel, lt->sel, (size_t)(T * f->sel_stride) * sizeof(int32_t));
        ds4_dev_copy(f->dev, f->nsel, lt->nsel, (size_t)T * sizeof(int32_t));
        return;
    }
    const int replay = f->replay_index && f->replay_on;
    OP(f->dev, indexer, .c = c, .iq = f->iq, .iw = f->iw, .iK = f->iK, .rows = aq->rows, .nwin = nwin,
       .topk = f->rows.pos ? K : (K < nwin ? K : nwin), .sel = f->sel, .nsel = f->nsel, .sel_stride = f->sel_stride,
       .replay = replay ? f->replay_index + f->csa_i * K : NULL, .replay_ld = ncsa * K);
    if (f->rec_index)
        OP(f->dev, record_picks, .dst = f->rec_index + f->csa_i * K, .ld = ncsa * K, .sel = f->sel, .nsel = f->nsel,
           .sel_stride = f->sel_stride, .K = K, .T = T);
}

/* The attention sub-layer on f->h (its input after attn_norm), keys over the pass's rows and queries over aq's:
 * result in a [aq->T, D]. */
static void attention_rows(ds4_pass *f, const ds4_layer_w *l, float *a, const attn_q *aq) {
    const ds4_config *c = f->c;
    const int64_t T = f->T, D = c->hidden_size, H = c->num_attention_heads, d = c->head_dim, qr = c->q_lora_rank;
    const int64_t Tq = aq->T;
    const int split = aq->h != f->h; /* queries over a slice: the tape keeps the whole h, which the key side reads */
    const ds4_rope_table *rt = l->type == DS4_ATTN_SLIDING ? &f->rmain : &f->rcomp;
    const ds4_dtype mdt = f->w->mdt;
    const ds4_lora_layer *lo = l->lora;
    ds4_layer_tape *lt = f->lt;
    /* training: the pre-norm projections go straight to their tape slots and the norms read them from there (out of
     * place), and q and kv are formed in theirs, so that nothing is copied into the tape; else the pass's buffers */
    float *qa = lt ? lt->qa : f->qr, *qpre = lt ? lt->q_pre : f->q, *kvpre = lt ? lt->kv_pre : f->kv;
    float *q = lt ? lt->q : f->q, *kv = lt ? lt->kv : f->kv;
    matmul_keep(f, qa, aq->h, l->wq_a, Tq, D, qr, lt && !split ? lt->h_attn : NULL);
    if (split) matmul_keep(f, kvpre, f->h, l->wkv, T, D, d, lt ? lt->h_attn : NULL);
    else matmul_same_x(f, kvpre, f->h, l->wkv, T, D, d); /* the key's projection of the same h, next to the query's */
    ds4_lora_fwd(f, lo, DS4_LORA_AB(lo, wq_a), qa, qr, aq->h, D, Tq, D, qr);
    ds4_lora_fwd(f, lo, DS4_LORA_AB(lo, wkv), kvpre, d, f->h, D, T, D, d);
    norm(f, f->qr, qa, l->q_norm, Tq, qr);
    matmul_keep(f, qpre, f->qr, l->wq_b, Tq, qr, H * d, lt ? lt->qr : NULL);
    ds4_lora_fwd(f, lo, DS4_LORA_AB(lo, wq_b), qpre, H * d, f->qr, qr, Tq, qr, H * d);
    norm(f, q, qpre, NULL, Tq * H, d); /* per-head unweighted RMS */
    rope_at(f, q, H, d, rt, 1, &aq->rows);
    norm(f, kv, kvpre, l->kv_norm, T, d);
    rope(f, kv, 1, d, rt, 1);
    if (f->m->kv_qat) OP(f->dev, fake_quant, .x = kv, .rows = T, .width = d, .q = qat_of(f, 0, d, rt->half));
    int64_t nwin = 0;
    if (l->type != DS4_ATTN_SLIDING)
        nwin = compress(f, &l->comp, 0, f->cC, f->cZ, f->cK, l->type == DS4_ATTN_CSA, lt ? lt->cC : NULL,
                        lt ? lt->cZ : NULL, lt ? lt->pool : NULL);
    if (l->type == DS4_ATTN_CSA) indexer(f, l, lt, aq);
    OP(f->dev, attention, .c = c, .type = l->type, .sink = l->sink, .q = q, .kv = kv, .cK = f->cK,
       .rows = aq->rows, .nwin = nwin, .sel = f->sel, .nsel = f->nsel, .sel_stride = f->sel_stride, .o = f->o,
       .itgt = l->type == DS4_ATTN_CSA && lt ? lt->itgt : NULL, .bf16_in = f->w->bf16_in);
    if (f->rows.pos)
        OP(f->dev, cache_commit, .c = c, .type = l->type, .kv = kv, .cC = f->cC, .cZ = f->cZ, .iC = f->iC,
           .iZ = f->iZ, .rows = f->rows);
    rope_at(f, f->o, H, d, rt, -1, &aq->rows); /* de-rotate the output at the query position */
    if (lt) {
        lt->nwin = nwin;
        if (nwin) keep(f, lt->cK, f->cK, f->B * f->S * d);
        if (l->type == DS4_ATTN_CSA && !f->recompute) {
            ds4_dev_copy(f->dev, lt->sel, f->sel, (size_t)(Tq * f->sel_stride) * sizeof(int32_t));
            ds4_dev_copy(f->dev, lt->nsel, f->nsel, (size_t)Tq * sizeof(int32_t));
        }
        if (!f->tape->x16) keep(f, lt->o, f->o, Tq * H * d); /* else the product below writes it (keep16) */
    }
    /* grouped output projection: group g = heads [g·H/G, (g+1)·H/G) → o_lora values */
    const int64_t G = c->o_groups, ol = c->o_lora_rank, gw = H * d / G;
    /* bf16 without adapters on this layer: y is read next only by wo_b's product, as its bf16 copy (and the tape keeps
     * that copy): ops.h's y16_only lets the backend write the copies from the product instead of y */
    const int y16 = f->w->bf16_in && !lo && (!lt || f->tape->x16);
    OP(f->dev, matmul, .y = f->y, .ldy = G * ol, .x = f->o, .ldx = H * d, .W = l->wo_a, .wdt = mdt, .T = Tq, .K = gw,
       .O = ol, .groups = G, .gx = gw, .gy = ol, .gw = ol * gw, .bf16_in = f->w->bf16_in,
       .keep16 = keep16_of(f, lt ? lt->o : NULL), .y16 = y16 && lt ? (uint16_t *)(void *)lt->y : NULL,
       .y16_only = y16);
    ds4_lora_fwd_wo_a(f, lo, f->y, f->o, Tq);
    if (y16) matmul_same_x(f, a, f->y, l->wo_b, Tq, G * ol, D); /* the tape's copy already made by wo_a's product */
    else matmul_keep(f, a, f->y, l->wo_b, Tq, G * ol, D, lt ? lt->y : NULL);
    ds4_lora_fwd(f, lo, DS4_LORA_AB(lo, wo_b), a, D, f->y, G * ol, Tq, G * ol, D);
}

/* The attention sub-layer on u (the collapsed input): returns where its result lies, [T, D] — the tape's a_attn when
 * training (written there, not copied), else f->a. With context parallelism the ranks' inputs are gathered first
 * (cp.c). Split by query (the default): the rank's own rows of h are kept for its queries (in f->a, free until the
 * output projection writes it), the key side runs over the gathered whole sequences, and the output is this rank's
 * rows as they are. Otherwise every rank runs the whole sequence's attention and keeps its own rows of f->a. */
static float *attention(ds4_pass *f, const ds4_layer_w *l, const float *u) {
    const int64_t D = f->c->hidden_size;
    ds4_layer_tape *lt = f->lt;
    norm(f, f->h, u, l->attn_norm, f->T, D);
    if (ds4_cp_by_query(f)) {
        ds4_dev_copy(f->dev, f->a, f->h, (size_t)(f->T * D) * sizeof(float));
        ds4_cp_gather_rows(f, f->h, D);
        const ds4_rows qw = ds4_cp_query_rows(f);
        const attn_q aq = {qw.T, qw, f->a};
        float *a = lt ? lt->a_attn : f->a;
        attention_rows(f, l, a, &aq);
        ds4_cp_slice_shape(f);
        return a;
    }
    if (f->cp_world) ds4_cp_gather_rows(f, f->h, D);
    const attn_q aq = {f->T, f->rows, f->h};
    float *a = lt && !f->cp_world ? lt->a_attn : f->a;
    attention_rows(f, l, a, &aq);
    if (f->cp_world) ds4_cp_keep_rows(f, f->a, D);
    if (lt && f->cp_world) keep(f, lt->a_attn, f->a, f->T * D);
    return a;
}

/* ------------------------------------------------------------------------------------------------ MoE */

/* act [rows, I] = silu(min(g1, λ)) ⊙ clamp(g3, ±λ): in place into g1 (act NULL), or into act leaving g1 and g3 as
 * they are — the backward's own recomputation (swiglu_bwd without gradients), the same expression — so that the
 * training forward's products can write the pre-activations straight into their tape slots, with no copy. */
static void swiglu(ds4_pass *f, float *g1, const float *g3, float *act, int64_t rows, int64_t I) {
    const float lim = (float)f->c->swiglu_limit;
    if (act) OP(f->dev, swiglu_bwd, .g1 = g1, .g3 = g3, .act = act, .rows = rows, .I = I, .lim = lim);
    else OP(f->dev, swiglu, .g1 = g1, .g3 = g3, .rows = rows, .I = I, .lim = lim);
}

/* out = W2 (silu(min(x W1ᵀ, λ)) ⊙ clamp(x W3ᵀ, ±λ)) over `rows` rows (the shared expert); with g1_keep / g3_keep
 * (training) the pre-activations are kept: the products write them there. */
static void shared_expert(ds4_pass *f, const ds4_layer_w *l, const float *h, int64_t rows, float *out, float *g1_keep,
                          float *g3_keep) {
    const int64_t D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    const int kept = g1_keep && g3_keep;
    float *g1 = kept ? g1_keep : f->g1, *g3 = kept ? g3_keep : f->g3;
    matmul(f, g1, h, l->sw1, 1, rows, D, I);
    ds4_lora_fwd(f, l->lora, DS4_LORA_AB(l->lora, sw1), g1, I, h, D, rows, D, I);
    matmul_same_x(f, g3, h, l->sw3, rows, D, I);
    ds4_lora_fwd(f, l->lora, DS4_LORA_AB(l->lora, sw3), g3, I, h, D, rows, D, I);
    swiglu(f, g1, g3, kept ? f->g1 : NULL, rows, I);
    matmul(f, out, f->g1, l->sw2, 1, rows, I, D);
    ds4_lora_fwd(f, l->lora, DS4_LORA_AB(l->lora, sw2), out, D, f->g1, I, rows, I, D);
}

/* The MoE sub-layer on u (the collapsed input) with token ids `ids` (hash routing): returns where its result lies,
 * [T, D] — the tape's a_ffn when training (written there, not copied), else f->a. */
static float *moe(ds4_pass *f, const ds4_layer_w *l, const float *u, const int64_t *ids) {
    const ds4_config *c = f->c;
    const int64_t T = f->T, D = c->hidden_size, E = c->n_routed_experts, K = c->num_experts_per_tok;
    const int64_t I = c->moe_intermediate_size, L = c->num_hidden_layers, TK = T * K;
    ds4_dev *dev = f->dev;
    ds4_layer_tape *lt = f->lt;
    float *h = lt ? lt->h_ffn : f->h; /* training: normalised in its tape slot */
    norm(f, h, u, l->ffn_norm, T, D);
    matmul(f, f->rl, h, l->gate, 0, T, D, E);
    if (lt) keep(f, lt->rlog, f->rl, T * E);
    const int replay = f->replay_experts && f->replay_on;
    if (f->recompute) { /* the experts and weights the training forward chose (its scores are kept too) */
        ds4_dev_copy(dev, f->eidx, lt->eidx, (size_t)TK * sizeof(int32_t));
        ds4_dev_copy(dev, f->ew, lt->ew, (size_t)TK * sizeof(float));
    } else {
        OP(dev, route, .c = c, .l = l, .ids = ids, .s = f->rl, .eidx = f->eidx, .ew = f->ew,
           .replay = replay ? f->replay_experts + f->li * K : NULL, .replay_ld = L * K, .T = T);
    }
    if (f->rec_experts)
        OP(dev, copy_rows, .dst = f->rec_experts + f->li * K, .ldd = L * K * 4, .src = f->eidx, .lds = K * 4, .rows = T,
           .row_bytes = K * 4);
    if (lt && !f->recompute) {
        keep(f, lt->rsc, f->rl, T * E);
        ds4_dev_copy(dev, lt->eidx, f->eidx, (size_t)TK * sizeof(int32_t));
        keep(f, lt->ew, f->ew, TK);
        if (f->m->router_loads && !l->is_hash) /* expert loads for the aux-loss-free bias update */
            OP(dev, count_loads, .loads = (f->tape->loads ? f->tape->loads : f->m->router_loads) + (lt - f->tape->layers) * E,
               .eidx = f->eidx, .n = TK);
    }
    /* routed experts: (token, slot) pairs grouped by expert, one GEMM per expert group */
    OP(dev, moe_sort, .eidx = f->eidx, .n = TK, .E = E, .perm = f->perm, .off = f->ecount);
    OP(dev, gather_rows, .dst = f->xg, .src = h, .idx = f->perm, .div = K, .rows = TK, .width = D);
    if (f->ep_rows) { /* expert parallelism: each row computed by its expert's rank (moe_ep.c) */
        ds4_ep_experts_fwd(f, l, f->xg, f->ecount, f->ye);
    } else {
        /* training: the pre-activations go straight to the tape, in expert order (the backward sorts the same eidx
         * into the same perm: routed_bwd), and the activation into f->g1 */
        const int kept = lt && lt->eg1 && lt->eg3;
        float *g1 = kept ? lt->eg1 : f->g1, *g3 = kept ? lt->eg3 : f->g3;
        OP(dev, matmul_grouped, .y = g1, .x = f->xg, .W = l->w1, .wdt = l->edt[0], .Ws = l->escale[0],
           .wstride = I * D, .off = f->ecount, .E = E, .rows = TK, .K = D, .O = I, .bf16_in = f->w->bf16_in);
        OP(dev, matmul_grouped, .y = g3, .x = f->xg, .W = l->w3, .wdt = l->edt[2], .Ws = l->escale[2],
           .wstride = I * D, .off = f->ecount, .E = E, .rows = TK, .K = D, .O = I, .bf16_in = f->w->bf16_in,
           .x_kept = 1);
        ds4_lora_fwd_gate_up(f, l->lora, g1, g3, f->xg, f->ecount, TK);
        swiglu(f, g1, g3, kept ? f->g1 : NULL, TK, I);
        OP(dev, matmul_grouped, .y = f->ye, .x = f->g1, .W = l->w2, .wdt = l->edt[1], .Ws = l->escale[1],
           .wstride = D * I, .off = f->ecount, .E = E, .rows = TK, .K = I, .O = D, .bf16_in = f->w->bf16_in);
        ds4_lora_fwd_down(f, l->lora, f->ye, f->g1, f->ecount, TK);
    }
    if (lt) OP(dev, scatter_rows, .dst = lt->ye, .src = f->ye, .idx = f->perm, .rows = TK, .width = D);
    OP(dev, moe_weigh, .yk = f->yk, .ye = f->ye, .perm = f->perm, .ew = f->ew, .rows = TK, .D = D);
    float *a = lt ? lt->a_ffn : f->a;
    shared_expert(f, l, h, T, a, lt ? lt->sg1 : NULL, lt ? lt->sg3 : NULL); /* every token */
    OP(dev, moe_combine, .a = a, .yk = f->yk, .eidx = f->eidx, .T = T, .K = K, .D = D);
    return a;
}

/* ------------------------------------------------------------------------------------------------ block / head */

/* ds4_block_to (sched.h). Training keeps X as the block's input, unless X is that tape slot already (the block before
 * wrote its output there, or the backward replays the block from it). */
void ds4_block_to(ds4_pass *f, const ds4_layer_w *l, float *X, float *Xo, const int64_t *ids) {
    const ds4_config *c = f->c;
    const int64_t nD = c->hc_mult * c->hidden_size;
    ds4_layer_tape *lt = f->lt;
    if (lt && lt->X_in != X) keep(f, lt->X_in, X, f->T * nD);
    /* training: the collapsed inputs and the attention site's post and comb weights are formed in their tape slots
     * (the backward recomputes X_mid from X_in, a_attn and these: block_bwd), and the sub-layers return theirs */
    float *u = lt ? lt->u_attn : f->u, *post = lt ? lt->post_attn : f->post, *comb = lt ? lt->comb_attn : f->comb;
    OP(f->dev, hc_pre, .c = c, .w = &l->hc_attn, .X = X, .pre = f->pre, .post = post, .comb = comb, .u = u,
       .mix = lt ? lt->mix_attn : NULL, .T = f->T);
    const float *a = attention(f, l, u);
    OP(f->dev, hc_post, .c = c, .X = X, .a = a, .post = post, .comb = comb, .Xo = f->Xt, .T = f->T);
    u = lt ? lt->u_ffn : f->u;
    OP(f->dev, hc_pre, .c = c, .w = &l->hc_ffn, .X = f->Xt, .pre = f->pre, .post = f->post, .comb = f->comb, .u = u,
       .mix = lt ? lt->mix_ffn : NULL, .T = f->T);
    a = moe(f, l, u, ids);
    OP(f->dev, hc_post, .c = c, .X = f->Xt, .a = a, .post = f->post, .comb = f->comb, .Xo = Xo, .T = f->T);
}

void ds4_block(ds4_pass *f, const ds4_layer_w *l, float *X, const int64_t *ids) { ds4_block_to(f, l, X, X, ids); }

void ds4_lm_head(ds4_pass *f, const float *X, const float *fn, const float *base, const float *scale, const float *nw,
                 float *logits, float *u_keep, float *y_keep) {
    const int64_t D = f->c->hidden_size;
    OP(f->dev, hyperhead, .c = f->c, .X = X, .fn = fn, .base = base, .scale = scale, .u = f->u, .T = f->T);
    keep(f, u_keep, f->u, f->T * D);
    norm(f, f->u, f->u, nw, f->T, D);
    keep(f, y_keep, f->u, f->T * D);
    if (logits) matmul(f, logits, f->u, f->w->head, 1, f->T, D, f->c->vocab_size);
}

int64_t ds4_head_rows(const ds4_model *m, int64_t T) {
    int64_t r = m->topt.head_chunk > 0 ? m->topt.head_chunk : (m->dev->host_visible ? T : 1024);
    return r < T ? (r > 0 ? r : 1) : (T > 0 ? T : 1);
}

/* The head of a training pass over its input y [rows, D] (f->u), in chunks of the tape's head_rows: per row the
 * cross-entropy against tgt (backend, -100: none) into nll, and with lp non-NULL the log-probability and entropy
 * (lp [rows], lp + lp_ld [rows]); out (host, may be NULL): the logits for a caller who asked for them. Only one chunk
 * of logits exists on the backend at a time; when one chunk holds all the rows, the tape notes that they are `head`'s
 * (the backward then reads them instead of computing the same product again). Every row's softmax statistics go to
 * the tape (the MTP head's after the main head's T rows) for the backward's logp_bwd over the same logits. */
static void head_chunks(ds4_pass *f, ds4_tape *tp, int head, int64_t rows, const int64_t *tgt, double *nll, float *lp,
                        int64_t lp_ld, float *out) {
    const int64_t D = f->c->hidden_size, V = f->c->vocab_size, R = tp->head_rows;
    const int64_t so = head == DS4_HEAD_MTP ? tp->T : 0; /* the head's statistics rows */
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        const int64_t n = rows - r0 < R ? rows - r0 : R;
        matmul(f, tp->logits, f->u + r0 * D, f->w->head, 1, n, D, V);
        if (out) ds4_dev_download(f->dev, out + r0 * V, tp->logits, (size_t)(n * V) * sizeof(float));
        if (lp)
            OP(f->dev, logprobs, .logits = tp->logits, .rows = n, .V = V, .tgt = tgt + r0, .logp = lp + r0,
               .entropy = lp + lp_ld + r0, .nll = nll + r0, .rmx = tp->rmx + so + r0, .rse = tp->rse + so + r0,
               .exp32 = f->w->bf16_in);
        else
            OP(f->dev, ce_rows, .logits = tp->logits, .rows = n, .V = V, .tgt = tgt + r0, .nll = nll + r0,
               .rmx = tp->rmx + so + r0, .rse = tp->rse + so + r0, .exp32 = f->w->bf16_in);
    }
    tp->logits_head = rows <= R ? head : 0;
    tp->stats_heads |= head;
}

/* Mean cross-entropy of the rows of logits [B, Sl, V], row (b, s) at position off + s, against labels[b, off + s +
 * shift] (off + s + shift < S; -100 ignored): per-row losses on the backend, summed here in row order (with context
 * parallelism every rank's rows, in the order of the whole sequence). htgt / hnll are host scratch of B·Sl entries.
 * logits NULL: a training pass, whose head runs in chunks here (head_chunks; lp: also its log-probabilities). */
static void cross_entropy(ds4_pass *f, const float *logits, int64_t B, int64_t Sl, const int64_t *labels, int64_t S,
                          int64_t off, int64_t shift, int64_t *htgt, double *hnll, double *loss, int64_t *count,
                          float *lp, float *out) {
    const int64_t rows = B * Sl;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < Sl; s++)
            htgt[b * Sl + s] = off + s + shift < S ? labels[b * S + off + s + shift] : -100;
    ds4_dev_upload(f->dev, f->tgt, htgt, (size_t)rows * sizeof(int64_t));
    if (logits)
        OP(f->dev, ce_rows, .logits = logits, .rows = rows, .V = f->c->vocab_size, .tgt = f->tgt, .nll = f->nll,
           .exp32 = f->w->bf16_in);
    else head_chunks(f, f->tape, shift == 1 ? DS4_HEAD_MAIN : DS4_HEAD_MTP, rows, f->tgt, f->nll, lp, rows, out);
    ds4_dev_download(f->dev, hnll, f->nll, (size_t)rows * sizeof(double));
    double sum = 0;
    int64_t cnt = 0;
    if (f->cp_world) ds4_cp_sum_rows(f, htgt, hnll, &sum, &cnt);
    else if (!f->dev->st)
        for (int64_t r = 0; r < rows; r++)
            if (htgt[r] != -100) {
                sum += hnll[r];
                cnt++;
            }
    *count = cnt;
    *loss = cnt ? sum / (double)cnt : NAN;
}

/* ------------------------------------------------------------------------------------------------ entry point */

static ds4_status check_args(const ds4_model *m, const ds4_forward_args *a, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    if (!a || !a->ids) return ds4_fail(err, DS4_ERR_ARG, "forward: ids is NULL");
    if (a->batch < 1 || a->seq < 1)
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: ids shape [%lld, %lld] must be at least [1, 1]",
                        (long long)a->batch, (long long)a->seq);
    if (a->batch > (1 << 20) || a->seq > (1 << 24) || a->batch * a->seq > (1 << 24))
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: ids shape [%lld, %lld] too large", (long long)a->batch,
                        (long long)a->seq);
    const int64_t T = a->batch * a->seq;
    for (int64_t i = 0; i < T; i++)
        if (a->ids[i] < 0 || a->ids[i] >= c->vocab_size)
            return ds4_fail(err, DS4_ERR_ARG, "forward: ids[%lld, %lld] = %lld outside [0, %lld) (ids [%lld, %lld])",
                            (long long)(i / a->seq), (long long)(i % a->seq), (long long)a->ids[i],
                            (long long)c->vocab_size, (long long)a->batch, (long long)a->seq);
    if (a->labels)
        for (int64_t i = 0; i < T; i++)
            if (a->labels[i] != -100 && (a->labels[i] < 0 || a->labels[i] >= c->vocab_size))
                return ds4_fail(err, DS4_ERR_ARG,
                                "forward: labels[%lld, %lld] = %lld is neither -100 nor in [0, %lld) (labels [%lld, %lld])",
                                (long long)(i / a->seq), (long long)(i % a->seq), (long long)a->labels[i],
                                (long long)c->vocab_size, (long long)a->batch, (long long)a->seq);
    if (a->replay_experts) {
        const int64_t L = c->num_hidden_layers, K = c->num_experts_per_tok, E = c->n_routed_experts;
        for (int64_t t = 0; t < T; t++)
            for (int64_t li = 0; li < L; li++) {
                const int32_t *r = a->replay_experts + (t * L + li) * K;
                if (r[0] < 0) continue;
                for (int64_t k = 0; k < K; k++) {
                    int dup = 0;
                    for (int64_t j = 0; j < k; j++) dup |= r[j] == r[k];
                    if (r[k] < 0 || r[k] >= E || dup)
                        return ds4_fail(err, DS4_ERR_ARG,
                                        "forward: replay_experts[%lld, %lld, layer %lld] slot %lld = %d is not a distinct "
                                        "expert in [0, %lld)", (long long)(t / a->seq), (long long)(t % a->seq),
                                        (long long)li, (long long)k, r[k], (long long)E);
                }
            }
    }
    if (a->replay_index) {
        const int64_t nc = ds4_model_csa_layers(m), K = c->index_topk, mr = c->compress_rate_csa;
        for (int64_t t = 0; t < T; t++)
            for (int64_t ci = 0; ci < nc; ci++) {
                const int32_t *r = a->replay_index + (t * nc + ci) * K;
                if (r[0] < 0) continue;
                const int64_t valid = (t % a->seq + 1) / mr;
                for (int64_t k = 0; k < K; k++) {
                    int dup = 0;
                    for (int64_t j = 0; j < k; j++) dup |= r[k] >= 0 && r[j] == r[k];
                    if (r[k] < -1 || r[k] >= valid || dup)
                        return ds4_fail(err, DS4_ERR_ARG,
                                        "forward: replay_index[%lld, %lld, CSA layer %lld] slot %lld = %d is not a distinct "
                                        "causal entry in [0, %lld) or -1", (long long)(t / a->seq), (long long)(t % a->seq),
                                        (long long)ci, (long long)k, r[k], (long long)valid);
                }
            }
    }
    if (a->lengths)
        for (int64_t b = 0; b < a->batch; b++)
            if (a->lengths[b] < 0 || a->lengths[b] > a->seq)
                return ds4_fail(err, DS4_ERR_ARG, "forward: lengths[%lld] = %lld outside [0, %lld] (ids [%lld, %lld])",
                                (long long)b, (long long)a->lengths[b], (long long)a->seq, (long long)a->batch,
                                (long long)a->seq);
    if (a->mtp_logits && !m->has_mtp)
        return ds4_fail(err, DS4_ERR_ARG, "forward: MTP logits requested but the checkpoint has no mtp.0.* weights");
    if (a->mtp_logits && a->seq < 2)
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: MTP needs seq >= 2 (ids [%lld, %lld])", (long long)a->batch,
                        (long long)a->seq);
    return DS4_OK;
}

ds4_status ds4_model_forward(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_error *err) {
    return ds4_forward_run(m, args, res, NULL, err);
}

ds4_status ds4_model_forward_train(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res,
                                   ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "training forward: model is NULL");
    if (!ds4_model_grad_enabled(m))
        return ds4_fail(err, DS4_ERR_ARG, "training forward: gradients are not enabled (enable_grad)");
    ds4_status s = ds4_model_train_bind(m, err); /* on a device: gradients there before anything runs */
    if (s) return s;
    if (!m->tape && !(m->tape = calloc(1, sizeof *m->tape)))
        return ds4_fail(err, DS4_ERR_OOM, "training forward: tape");
    if (!m->router_loads &&
        !(m->router_loads = calloc((size_t)((m->cfg.num_hidden_layers + 1) * m->cfg.n_routed_experts), sizeof(int64_t))))
        return ds4_fail(err, DS4_ERR_OOM, "training forward: router load counters");
    return ds4_forward_run(m, args, res, m->tape, err);
}

/* The MTP block (positions i < S-1 combine the final streams X^L_i with the embedding of token i+1 and run one more
 * block over the S-1 positions; its logits predict token i+2) on the pass's final streams f->X, whose rows are
 * positions off .. off + f->S - 1 of each sequence of ids [B, S] (with context parallelism this rank's slice: the
 * token after its last position is read from the whole ids, so the next-token roll is global). */
static void mtp_forward(ds4_pass *f, const int64_t *ids, int64_t S, int64_t off, float *mtp_logits, ds4_tape *tape,
                        int64_t *hidx, int32_t *rows) { /* with a tape, mtp_logits is NULL: the head runs in chunks */
    const ds4_config *c = f->c;
    const ds4_mtp_w *mt = &f->w->mtp;
    const int64_t n = c->hc_mult, D = c->hidden_size, Sx = f->S, B = f->B; /* Sx: rows per sequence of f->X */
    if (f->cp_world) ds4_cp_set_mtp(f, 1);
    else {
        f->S = S - 1;
        f->T = B * f->S;
        f->rows.S = f->S;
        f->rows.T = f->T;
    }
    const int64_t S1 = f->S, T1 = f->T;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < S1; i++) {
            hidx[b * S1 + i] = ids[b * S + off + i + 1];
            rows[b * S1 + i] = (int32_t)(b * Sx + i);
        }
    ds4_dev_upload(f->dev, f->mtp_ids, hidx, (size_t)T1 * sizeof(int64_t));
    ds4_dev_upload(f->dev, f->rowmap, rows, (size_t)T1 * sizeof(int32_t));
    /* e-term per token into a ([T1, D]); h-term per stream into Xt */
    OP(f->dev, embed, .X = f->a, .E = f->w->embed, .edt = f->w->mdt, .ids = f->mtp_ids, .T = T1, .n = 1, .D = D);
    OP(f->dev, gather_rows, .dst = f->Xt, .src = f->X, .idx = f->rowmap, .div = 1, .rows = T1, .width = n * D);
    if (tape) keep(f, tape->mtp_e, f->a, T1 * D);
    norm(f, f->a, f->a, mt->enorm, T1, D);
    matmul(f, f->h, f->a, mt->e_proj, 1, T1, D, D);
    norm(f, f->Xt, f->Xt, mt->hnorm, T1 * n, D);
    if (tape) {
        keep(f, tape->mtp_en, f->a, T1 * D);
        keep(f, tape->mtp_hn, f->Xt, T1 * n * D);
    }
    matmul(f, f->Xz, f->Xt, mt->h_proj, 1, T1 * n, D, D);
    OP(f->dev, add_bcast, .x = f->Xz, .h = f->h, .T = T1, .n = n, .D = D);
    f->lt = tape ? &tape->layers[c->num_hidden_layers] : NULL;
    f->replay_on = 0; /* the MTP block routes itself */
    ds4_block(f, &mt->block, f->Xz, f->mtp_ids);
    f->lt = NULL;
    if (tape) keep(f, tape->mtp_X, f->Xz, T1 * n * D);
    ds4_lm_head(f, f->Xz, mt->hc_head_fn, mt->hc_head_base, mt->hc_head_scale, mt->norm, mtp_logits,
                tape ? tape->mtp_u : NULL, tape ? tape->mtp_y : NULL);
}

/* The indexer KL loss of CSA layer li from its tape (training option): the mean KL over its queries (the real
 * positions with picks, ds4_ikl_counts; kl is 0 at a query whose picks got no attention mass) into *sum, the most
 * queries of any layer so far into *nq_max. With recomputation the layer's tape slots are shared, so it runs right
 * after the block. */
static void ikl_layer(ds4_pass *f, ds4_tape *tape, int64_t li, double *hnll, int32_t *hsel, double *sum,
                      int64_t *nq_max) {
    const int64_t T = f->T;
    const ds4_layer_tape *lt = &tape->layers[li];
    OP(f->dev, ikl, .c = f->c, .lt = lt, .T = T, .S = f->S, .sel_stride = tape->sel_stride, .kl = f->nll,
       .has = (int32_t *)f->rowmap);
    ds4_dev_download(f->dev, hnll, f->nll, (size_t)T * sizeof(double));
    ds4_dev_download(f->dev, hsel, lt->nsel, (size_t)T * sizeof(int32_t));
    if (f->dev->st) return;
    double kl = 0;
    int64_t nq = 0;
    for (int64_t t = 0; t < T; t++)
        if (ds4_ikl_counts(hsel, tape->hlen, f->S, t)) {
            kl += hnll[t];
            nq++;
        }
    if (nq > 0) *sum += kl / (double)nq;
    if (nq > *nq_max) *nq_max = nq;
}

int64_t ds4_model_indexer_queries(const ds4_model *m, const int64_t *lengths, int64_t B) {
    if (!m || !lengths || ds4_model_csa_layers(m) == 0) return 0;
    const int64_t first = m->cfg.compress_rate_csa - 1; /* position s has (s + 1) / m causal entries */
    int64_t q = 0;
    for (int64_t b = 0; b < B; b++) q += lengths[b] > first ? lengths[b] - first : 0;
    return q;
}

ds4_status ds4_forward_run(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_tape *tape,
                           ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "forward: model is NULL");
    ds4_status s = check_args(m, args, err);
    if (!s) s = ds4_cp_check(m, args, tape != NULL, err);
    if (m->cp_on && args)
        s = ds4_cp_agree(m, tape ? "training forward" : "forward", args->batch, args->seq, args->ids, args->labels, s,
                         err);
    if (s) return s;
    const int train_mtp = tape && m->topt.mtp_lambda > 0;
    int64_t cp_off = 0, cp_n = args->seq; /* context parallelism: this rank's positions of every sequence */
    if (m->cp_on) ds4_cp_range(args->seq, 0, m->cp.world, m->cp.rank, &cp_off, &cp_n);
    if (tape) {
        if (!args->labels) return ds4_fail(err, DS4_ERR_ARG, "training forward: labels are required");
        if (train_mtp && !m->has_mtp)
            return ds4_fail(err, DS4_ERR_ARG, "training forward: mtp_lambda > 0 but the model has no mtp.0.* weights");
        if (train_mtp && args->seq < 3)
            return ds4_fail(err, DS4_ERR_SHAPE, "training forward: MTP loss needs seq >= 3 (ids [%lld, %lld])",
                            (long long)args->batch, (long long)args->seq);
        tape->valid = 0;
        tape->logits_head = 0;
        tape->stats_heads = 0;
        s = ds4_tape_reserve(m, tape, args->batch, args->seq, m->cp_on ? args->batch * cp_n : 0, train_mtp, err);
        if (s) return s;
        tape->cp_S = m->cp_on ? args->seq : 0; /* planned for the whole sequence, holding this rank's rows */
        tape->cp_off = cp_off;
        tape->S = cp_n;
        tape->T = args->batch * cp_n;
    }
    const ds4_config *c = &m->cfg;
    const int hv = m->dev->host_visible;
    const int64_t B = args->batch, S = args->seq, T = B * S, n = c->hc_mult, D = c->hidden_size, V = c->vocab_size;
    /* logits land in the tape, in the caller's array (host-visible backends), or in a planned buffer */
    const int want_mtp = train_mtp || args->mtp_logits;
    int64_t ep_rows = 0; /* expert parallelism: what this rank's experts may receive (a collective) */
    if ((s = ds4_ep_pass_rows(m, T, &ep_rows, err))) return s;
    const ds4_pass_opts po = {
        .logits_ws = (!tape && ((args->logits && !hv) || (!args->logits && args->labels))) ||
                     (args->mtp_logits && !train_mtp && !hv),
        .replay_experts = args->replay_experts && !hv,
        .replay_index = args->replay_index && !hv,
        .ep_rows = ep_rows,
        .tok_rows = m->cp_on ? B * cp_n : 0,
    };
    if (tape) tape->ep_rows = ep_rows;
    ds4_pass f;
    s = ds4_pass_setup(m, &f, B, S, T, &po, tape != NULL, err);
    if (s) return s;
    /* host scratch: targets (or MTP next ids), per-row losses, row indices */
    int64_t *host = malloc((size_t)T * (sizeof(int64_t) + sizeof(double) + sizeof(int32_t)));
    if (!host) return ds4_fail(err, DS4_ERR_OOM, "forward: host scratch for %lld rows", (long long)T);
    int64_t *htgt = host;
    double *hnll = (double *)(host + T);
    int32_t *hrows = (int32_t *)(hnll + T);
    f.tape = tape;
    int64_t *lids = NULL; /* context parallelism: this rank's ids, [B, cp_n] */
    if (m->cp_on) {
        ds4_cp_begin(&f, S);
        if (!(lids = malloc((size_t)(B * cp_n) * sizeof *lids))) {
            free(host);
            return ds4_fail(err, DS4_ERR_OOM, "forward: context parallel: %lld ids", (long long)(B * cp_n));
        }
        for (int64_t b = 0; b < B; b++) memcpy(lids + b * cp_n, args->ids + b * S + cp_off, (size_t)cp_n * sizeof *lids);
    }
    const int64_t Tl = f.T; /* the rows this rank computes: T, or B·cp_n */
    const int64_t *ids = ds4_pass_input(&f, f.ids, lids ? lids : args->ids, (size_t)Tl * sizeof(int64_t));
    f.replay_experts = ds4_pass_input(&f, (void *)f.replay_experts, args->replay_experts,
                             (size_t)(T * c->num_hidden_layers * c->num_experts_per_tok) * sizeof(int32_t));
    f.replay_index = ds4_pass_input(&f, (void *)f.replay_index, args->replay_index,
                           (size_t)(T * ds4_model_csa_layers(m) * c->index_topk) * sizeof(int32_t));
    f.replay_on = 1;
    f.csa_i = 0;
    const size_t nloads = (size_t)((c->num_hidden_layers + 1) * c->n_routed_experts);
    if (tape && tape->loads) ds4_dev_fill(f.dev, tape->loads, 0, nloads * sizeof(int64_t));
    OP(f.dev, embed, .X = f.X, .E = f.w->embed, .edt = f.w->mdt, .ids = ids, .T = Tl, .n = n, .D = D); /* X⁰ */
    if (tape) /* each row's real length, for the indexer KL loss (forward and backward) */
        for (int64_t b = 0; b < B; b++) tape->hlen[b] = args->lengths ? args->lengths[b] : S;
    double ikl_sum = 0; /* the indexer KL loss over the CSA layers (tape->with_ikl) */
    int64_t ikl_nq = 0;
    /* the streams: in training each block writes its output straight into the next block's kept-input slot (no
     * copy), the last one into f.X */
    float *X = f.X;
    for (int64_t li = 0; li < c->num_hidden_layers; li++) {
        f.lt = tape ? &tape->layers[li] : NULL;
        f.li = li;
        f.rows.li = li;
        float *Xo = tape && li + 1 < c->num_hidden_layers ? tape->layers[li + 1].X_in : f.X;
        ds4_block_to(&f, &f.w->layers[li], X, Xo, ids);
        X = Xo;
        f.csa_i += c->layer_types[li] == DS4_ATTN_CSA;
        if (tape && tape->with_ikl && tape->recompute && c->layer_types[li] == DS4_ATTN_CSA && !f.dev->st)
            ikl_layer(&f, tape, li, hnll, (int32_t *)hrows, &ikl_sum, &ikl_nq);
        if (args->hidden) ds4_dev_download(f.dev, args->hidden + li * T * n * D, X, (size_t)(T * n * D) * sizeof(float));
    }
    f.lt = NULL;
    float *logits = tape ? NULL : (args->logits && hv ? args->logits : f.logits_ws); /* a tape: in chunks */
    ds4_forward_result r = {NAN, 0, NAN, 0, NAN, 0};
    if (args->logits || args->labels || tape) {
        if (tape) {
            keep(&f, tape->X_L, f.X, Tl * n * D);
            memcpy(tape->hids, args->ids, (size_t)T * sizeof(int64_t));
            memcpy(tape->hlabels, args->labels, (size_t)T * sizeof(int64_t));
            ds4_dev_upload(f.dev, tape->ids, lids ? lids : args->ids, (size_t)Tl * sizeof(int64_t));
            ds4_dev_upload(f.dev, tape->labels, args->labels, (size_t)T * sizeof(int64_t));
        }
        ds4_lm_head(&f, f.X, f.w->hc_head_fn, f.w->hc_head_base, f.w->hc_head_scale, f.w->norm, logits,
                    tape ? tape->u_fin : NULL, tape ? tape->y_fin : NULL);
        if (args->logits && logits && logits != args->logits)
            ds4_dev_download(f.dev, args->logits, logits, (size_t)(T * V) * sizeof(float));
        if (args->labels)
            cross_entropy(&f, logits, B, f.S, args->labels, S, cp_off, 1, htgt, hnll, &r.loss, &r.loss_tokens,
                          tape ? tape->lp : NULL, tape ? args->logits : NULL);
    }
    if (tape && tape->with_ikl) {
        /* the indexer KL loss (training option): per CSA layer the mean KL over its queries, summed over layers;
         * before the MTP block, which leaves the pass's shapes at its S - 1 positions */
        for (int64_t li = 0; !tape->recompute && li < c->num_hidden_layers && !f.dev->st; li++)
            if (c->layer_types[li] == DS4_ATTN_CSA) ikl_layer(&f, tape, li, hnll, hrows, &ikl_sum, &ikl_nq);
        r.indexer_loss = ikl_nq ? ikl_sum : 0.0;
        r.indexer_queries = ikl_nq;
    }
    if (want_mtp) {
        const int64_t T1 = B * (S - 1);
        float *mtp_logits = train_mtp ? NULL : (hv ? args->mtp_logits : f.logits_ws);
        mtp_forward(&f, args->ids, S, cp_off, mtp_logits, train_mtp ? tape : NULL, htgt, hrows);
        if (args->mtp_logits && mtp_logits && mtp_logits != args->mtp_logits)
            ds4_dev_download(f.dev, args->mtp_logits, mtp_logits, (size_t)(T1 * V) * sizeof(float));
        if (args->labels)
            cross_entropy(&f, mtp_logits, B, f.S, args->labels, S, cp_off, 2, htgt, hnll, &r.mtp_loss, &r.mtp_loss_tokens,
                          NULL, train_mtp ? args->mtp_logits : NULL);
    }
    if (tape && tape->loads) { /* this forward's expert loads join the model's host counters */
        int64_t *ld = malloc(nloads * sizeof *ld);
        if (!ld) ds4_dev_fail(f.dev, DS4_ERR_OOM, "training forward: %zu expert loads", nloads);
        ds4_dev_download(f.dev, ld, tape->loads, nloads * sizeof *ld);
        if (ld && !f.dev->st)
            for (size_t i = 0; i < nloads; i++) m->router_loads[i] += ld[i];
        free(ld);
    }
    free(host);
    free(lids);
    if ((s = ds4_dev_check(f.dev, tape ? "training forward" : "forward", err))) return s;
    if (tape) {
        tape->valid = 1;
        tape->loss_tokens = r.loss_tokens;
        tape->mtp_tokens = train_mtp ? r.mtp_loss_tokens : 0;
        if (train_mtp && r.mtp_loss_tokens > 0) r.loss += m->topt.mtp_lambda * r.mtp_loss;
    }
    if (res) *res = r;
    return DS4_OK;
}
