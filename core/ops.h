/* ops.h — the backend operation table that the model schedule (forward.c, step.c, backward.c) is written against.
 *
 * The schedule decides what runs in which order and where every tensor lives; an operation does one piece of
 * arithmetic over memory of its backend (host memory for the CPU backend, device memory for CUDA). An operation
 * is about one kernel launch or one GEMM, and takes one argument struct that names every input and output.
 * The CPU backend (cpu_*.c) is the fp32 reference and the definition of what each operation computes; the CUDA
 * backend (cuda/) implements the same table. docs/design.md explains the split.
 *
 * Errors: an operation does not return a status. A backend records the first failure (a kernel that failed to
 * launch, an invalid sampling parameter, ...) in dev->st / dev->err, and every later operation is skipped until
 * the schedule reads it with ds4_dev_check, which it does before anything leaves the backend (a download) and
 * at the end of every entry point. The message names the operation and its shapes.
 *
 * Pointers inside the argument structs are backend memory unless a field says "host". Weight structs
 * (ds4_layer_w, ds4_compressor_w, ds4_hc_w) are host structs whose pointers are backend memory. Matrices are
 * row-major; W [O, K] is the nn.Linear layout, y = x Wᵀ. A weight matrix has its own dtype (wdt): F32 on the
 * CPU, F32 or BF16 on CUDA; everything else (activations, norms, biases, scores) is fp32. The routed experts'
 * products (matmul_grouped, linear_bwd_x_grouped) also take DS4_FP4_PACKED (fp4.h) on the CPU: W is then the packed
 * bytes and Ws the e8m0 scales of expert 0, expert e's at W + e·wstride/2 and Ws + e·wstride/32 bytes. */
#ifndef DS4_OPS_H
#define DS4_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "ds4.h"
#include "fake_quant.h"
#include "internal.h"
#include "model.h"
#include "optim.h"
#include "threadpool.h"

typedef struct ds4_layer_tape ds4_layer_tape; /* sched.h */

/* ------------------------------------------------------------------------------------------------ shared types */

typedef struct ds4_rope_table {
    const float *cs;              /* [positions, 2·half] interleaved (cos, sin), scaled by the attention factor */
    int64_t half;                 /* rotated pairs: the trailing 2·half channels of a vector */
} ds4_rope_table;

/* One sequence of a step, as the kernels see it: tokens [p0, p0 + n) at rows [r0, r0 + n) of the step. */
typedef struct ds4_seq_desc {
    int64_t p0, n, r0;
    int64_t ring;                 /* ring slots R of its cache */
    int64_t w0[2];                /* first compressor job of its newly completed windows: [0] CSA rate, [1] HCA */
    const ds4_layer_cache *layers; /* [L] its cache, backend memory */
} ds4_seq_desc;

/* Where each row's absolute position and cached state come from. Full forward: row t is position t % S of
 * sequence t / S and nothing is cached; with a query window (qn > 0: context parallelism split by query, cp.c) row t
 * is position q0 + t % qn of sequence t / qn, while the key-side buffers (window keys, entries) still hold every
 * sequence's S rows. Step: pos, rowseq and seqs say it, and layer li's caches are read. */
typedef struct ds4_rows {
    int64_t T, S;                 /* rows; full forward: positions per sequence; step: largest position + 1 */
    const int64_t *pos;           /* step: [T] absolute positions; NULL in a full forward */
    const int32_t *rowseq;        /* step: [T] the sequence of each row */
    const ds4_seq_desc *seqs;     /* step: [nseq] */
    int64_t nseq, li;
    int64_t cap;                  /* step: the largest capacity among the sequences' caches, a bound of S that stays
                                     fixed while they decode (a backend sizes per-pass resources from it) */
    const int64_t *njobs;         /* step: [2] the compressor jobs of the step per rate class (backend memory) */
    int64_t q0, qn;               /* full forward: the query window (0, 0: none, every position of each sequence) */
} ds4_rows;

/* Full forward: the query rows per sequence, the sequence of row t (its keys start at row seq·S of the key
 * buffers) and row t's position. */
static inline int64_t ds4_rows_qn(const ds4_rows *r) { return r->qn ? r->qn : r->S; }
static inline int64_t ds4_rows_seq(const ds4_rows *r, int64_t t) { return t / ds4_rows_qn(r); }
static inline int64_t ds4_rows_pos(const ds4_rows *r, int64_t t) {
    return r->pos ? r->pos[t] : r->q0 + t % ds4_rows_qn(r);
}

/* ------------------------------------------------------------------------------------------------ arguments */

/* X[t, i, :] = E[ids[t], :] for i < n  (X [T, n, D], E [V, D] of dtype edt) */
typedef struct { float *X; const void *E; ds4_dtype edt; const int64_t *ids; int64_t T, n, D; } ds4_a_embed;

/* mHC pre of one site per token (docs/architecture.md, "Hyper-connections"): x̂ = RMS(vec X), mix = fn·x̂; pre = σ(mix·s0 + b) + eps,
 * post = 2σ(mix·s1 + b), comb = Sinkhorn(mix·s2 + b); u = Σ pre_i X_i.  X [T, n, D] → pre, post [T, n],
 * comb [T, n, n], u [T, D]; mix (NULL: not kept) [T, (2 + n)·n] the mixing logits, for the site's backward */
typedef struct {
    const ds4_config *c; const ds4_hc_w *w; const float *X; float *pre, *post, *comb, *u, *mix; int64_t T;
} ds4_a_hc_pre;
/* Xo[t, k] = post_k · a[t] + Σ_j comb[j][k] · X[t, j]  (X, Xo [T, n, D], a [T, D]) */
typedef struct { const ds4_config *c; const float *X, *a, *post, *comb; float *Xo; int64_t T; } ds4_a_hc_post;
/* HyperHead: p_i = σ(s·(fn RMS(vec X))_i + b_i) + eps; u = Σ p_i X_i  (fn [n, n·D]) */
typedef struct { const ds4_config *c; const float *X, *fn, *base, *scale; float *u; int64_t T; } ds4_a_hyperhead;

/* y = w ⊙ x / sqrt(mean(x²) + eps) per row (w NULL: unweighted); y may equal x */
typedef struct { float *y; const float *x, *w; int64_t rows, width; double eps; } ds4_a_rmsnorm;

/* bf16_in (in every product below): the activation operands (x; dy; dy and x for dW) are rounded to bf16 before
 * the product, which then accumulates in fp32. The bf16 mode sets it on every product with an M matrix (its weight
 * in bf16); the CPU backend honours it on fp32 weights too, which makes the fp32 reference an emulation of the bf16
 * mode's rounding points (ds4_model_emulate_bf16: the reference the bf16 tests compare with). */

/* y[t, o] = Σ_k x[t, k]·W[o, k] for t < T, o < O; with groups > 1, group g reads x + g·gx, W + g·gw (elements)
 * and writes y + g·gy (the grouped output projection). x_kept (here and in matmul_grouped; the schedule's word, never
 * a change of the result): x holds the values it held at the product just before on the same x (the compressor's
 * two projections, the shared expert's and the routed experts' gate and up), so a backend that rounded that x into
 * a copy of its own may read the copy again where it still has it.
 * keep16 (NULL: none): x rounded to bf16 (to nearest even, as to_bf16 rounds) is also stored there, in x's layout
 * (keep16[t·ldx + g·gx + k]): the tape's copy of an input that only bf16 products read, which a backend that rounds
 * x for the product anyway writes in the same pass.
 * y16 (NULL: none): y rounded to bf16 the same way is also stored there, in y's layout (y16[t·ldy + g·gy + o]): the
 * tape's copy of a result that only bf16 products read.
 * y16_only (with bf16_in; the schedule's word, never a change of the result): y is read next only by the product
 * right after this one, on x = y with x_kept set (the grouped output projection's result, wo_b's input), and by
 * nothing else in fp32; a backend may then leave y unwritten and hand that product its own bf16 copy of y (which is
 * all that product reads of it), written by this product's epilogue instead of a rounding pass over y. */
typedef struct {
    float *y; int64_t ldy; const float *x; int64_t ldx; const void *W; ds4_dtype wdt;
    int64_t T, K, O, groups, gx, gy, gw; int bf16_in; int x_kept; uint16_t *keep16; uint16_t *y16; int y16_only;
} ds4_a_matmul;
/* Row groups: rows [off[e], off[e+1]) of x use W + e·wstride (the routed experts). off [E + 1] in backend memory;
 * rows is the largest off[E] can be (the kernels read the real extent from off). x [rows, K], y [rows, O]. */
typedef struct {
    float *y; const float *x; const void *W; ds4_dtype wdt; int64_t wstride; const int64_t *off;
    int64_t E, rows, K, O; int bf16_in; const uint8_t *Ws; int x_kept;
} ds4_a_matmul_grouped;

/* Rotate the trailing 2·half channels of each of `heads` vectors of width `width` of row t by its position
 * (sign -1: the inverse rotation). x [rows.T, heads, width] */
typedef struct { float *x; int64_t heads, width; ds4_rope_table rt; ds4_rows rows; int sign; } ds4_a_rope;

/* Pool compressed entries (gated softmax pooling with position bias over each window, overlap of the previous
 * window for CSA), then RMSNorm and RoPE at the window's first position. Full forward: every complete window of
 * every sequence, entry w of sequence b at out + (b·S + w)·dd (pool keeps the entry before norm when non-NULL).
 * Step: the njobs windows completed by the step (numbered across sequences from seqs[s].w0[cls]), rows from the
 * chunk or the cache (which = 0 the attention's compressor, 1 the indexer's), entries into the cache. */
typedef struct {
    const ds4_config *c; const ds4_compressor_w *w; int overlap, which, cls;
    const float *C, *Z;           /* [T, width] projections of this pass (Z without the position bias) */
    float *out, *pool;            /* full forward: [B, S, dd] */
    ds4_rows rows; int64_t B, nwin, njobs; ds4_rope_table rt;
    ds4_fq q;                     /* the QAT option: each entry fake-quantised after its RoPE (fmt 0: off) */
} ds4_a_compress;

/* Lightning-indexer scores of row t over its causal entries w < (pos + 1)/m, and their top-k (largest first,
 * ties to the lower index); replayed picks where replay is given and its first value is >= 0. */
typedef struct {
    const ds4_config *c; const float *iq, *iw, *iK; ds4_rows rows; int64_t nwin, topk;
    int32_t *sel, *nsel; int64_t sel_stride; const int32_t *replay; int64_t replay_ld;
} ds4_a_indexer;

/* Attention with sink of every head of row t over its window keys (kv, or the cache's ring) and its compressed
 * entries (HCA: every causal one; CSA: the indexer's picks), values = keys. itgt (CSA, training with the indexer
 * KL loss): the attention mass on each pick, summed over heads in head order from the fp32 probabilities.
 * bf16_in: the attention's two products take bf16 operands with fp32 sums, as the bf16 mode's other products do —
 * the logits q·k from q and the keys rounded to bf16, the output Σ P·v from the probabilities and the keys rounded
 * to bf16 (the softmax itself stays fp32 / double). The CPU honours it as the emulation of the bf16 mode. */
typedef struct {
    const ds4_config *c; ds4_attn_type type; const float *sink, *q, *kv, *cK; ds4_rows rows; int64_t nwin;
    const int32_t *sel, *nsel; int64_t sel_stride; float *o, *itgt; int bf16_in;
} ds4_a_attention;

/* Step: the new tokens of every sequence join layer rows.li's caches (window vectors into the ring, raw compressor
 * projections into the pending / last-window rows) once every query of the layer has read the old state. */
typedef struct { const ds4_config *c; ds4_attn_type type; const float *kv, *cC, *cZ, *iC, *iZ; ds4_rows rows; } ds4_a_cache_commit;

/* x[i] *= s */
typedef struct { float *x; int64_t n; float s; } ds4_a_scale;
/* The QAT option (fake_quant.h): each of `rows` vectors of `width` floats of each of `groups` groups (group g at
 * x + g·gstride; groups 0 counts as 1) rotated and / or fake-quantised in place as q says. */
typedef struct { float *x; int64_t rows, width, groups, gstride; ds4_fq q; } ds4_a_fake_quant;
/* dst[t·ld + i] = i < nsel[t] ? sel[t·sel_stride + i] : -1 for i < K */
typedef struct { int32_t *dst; int64_t ld; const int32_t *sel, *nsel; int64_t sel_stride, K, T; } ds4_a_record_picks;
/* row r of dst (byte stride ldd) = row r of src (byte stride lds), row_bytes each */
typedef struct { void *dst; int64_t ldd; const void *src; int64_t lds, rows, row_bytes; } ds4_a_copy_rows;

/* Router: scores s = score_func(logits) in place, top-K of s + bias (hash layers: tid2eid[ids[t]]; replay rows
 * whose first value is >= 0), weights w_k = rsf · s_k / (Σ s + 1e-20).  s [T, E], eidx / ew [T, K] */
typedef struct {
    const ds4_config *c; const ds4_layer_w *l; const int64_t *ids; float *s; int32_t *eidx; float *ew;
    const int32_t *replay; int64_t replay_ld, T;
} ds4_a_route;
/* loads[eidx[i]] += 1 for i < n */
typedef struct { int64_t *loads; const int32_t *eidx; int64_t n; } ds4_a_count_loads;
/* Stable counting sort of the n (token, slot) pairs by expert: perm lists them grouped by expert, in slot order
 * within an expert; off [E + 1] the group boundaries. */
typedef struct { const int32_t *eidx; int64_t n, E; int32_t *perm; int64_t *off; } ds4_a_moe_sort;
/* dst[r] = src[idx[r] / div] (rows of width floats) */
typedef struct { float *dst; const float *src; const int32_t *idx; int64_t div, rows, width; } ds4_a_gather_rows;
/* dst[idx[r]] = src[r] */
typedef struct { float *dst; const float *src; const int32_t *idx; int64_t rows, width; } ds4_a_scatter_rows;
/* dst[idx[r]] += src[r] */
typedef struct { float *dst; const float *src; const int32_t *idx; int64_t rows, width; } ds4_a_add_rows;
/* yk[perm[r]] = ye[r] · ew[perm[r]] */
typedef struct { float *yk; const float *ye; const int32_t *perm; const float *ew; int64_t rows, D; } ds4_a_moe_weigh;
/* g1 = silu(min(g1, λ)) · clamp(g3, ±λ), in place */
typedef struct { float *g1; const float *g3; int64_t rows, I; float lim; } ds4_a_swiglu;
/* a[t] += Σ_k yk[t, k] summed in ascending expert order (the shared expert's output is already in a) */
typedef struct { float *a; const float *yk; const int32_t *eidx; int64_t T, K, D; } ds4_a_moe_combine;
/* x[t, i, :] += h[t, :] for i < n */
typedef struct { float *x; const float *h; int64_t T, n, D; } ds4_a_add_bcast;

/* A row's softmax statistics as every head op takes them: mx = max over the row (fp32), se = Σ_v exp((double)z_v −
 * mx) in the backend's fixed order. rmx / rse [rows] (may be NULL) receive them for every row, whatever its target,
 * so that logp_bwd over the same logits may take them instead of two more passes (the same values: the same sums).
 * exp32 (the bf16 mode sets it on every head op: ce_rows, logprobs, sample, logp_bwd): each e^(z_v − mx) may be
 * formed in fp32 (expf of the difference rounded to fp32, then summed in double): a backend that does so does it in
 * all four, so a rollout's log-probabilities and training's stay the same bits. Without it, exp in double (the CPU's
 * form, which the fp32 reference keeps; the CPU backend always does). */
/* nll[r] = logsumexp(logits[r]) - logits[r, tgt[r]] (double) for rows with tgt[r] != -100 */
typedef struct {
    const float *logits; int64_t rows, V; const int64_t *tgt; double *nll; float *rmx; double *rse; int exp32;
} ds4_a_ce_rows;
/* logp[r] = log softmax(logits[r])[tgt[r]] (0 where tgt is -100); entropy (may be NULL) of every row; nll (may be
 * NULL): also what ce_rows writes there, the same bits (one pass over the row instead of two); rmx / rse as ce_rows */
typedef struct {
    const float *logits; int64_t rows, V; const int64_t *tgt; float *logp, *entropy; double *nll; float *rmx;
    double *rse; int exp32;
} ds4_a_logprobs;

/* Indexer-KL loss of one CSA layer (training option) from its tape: per query, KL(p || q) over its picks (p the
 * attention mass, renormalised; q the softmax of the indexer scores) into kl[t] with has[t] = 1 where the query
 * has picks and mass; with dI non-NULL also dI[t, i] = scale · (q_i − p_i) (0 elsewhere). */
typedef struct {
    const ds4_config *c; const ds4_layer_tape *lt; int64_t T, S, sel_stride; double *kl; int32_t *has;
    float *dI; double scale;
} ds4_a_ikl;

/* Sampling: draw r takes one token from logits row lrow[r] (of [*, V]) by ds4_sample's rules at uniform u[r];
 * id / lp_model / lp_sample [rows] out. An invalid row (NaN logit, ...) is an operation failure naming the row. */
typedef struct {
    const float *logits; const int32_t *lrow; int64_t rows, V; ds4_sampling p; const double *u; int64_t *id;
    double *lp_model, *lp_sample; int exp32;
} ds4_a_sample;

/* -------------------------------------------------------------------------------------- backward arguments */

/* dl[r] = g_r·(onehot(tgt[r]) − softmax(logits[r])) with g_r = dlogp[r] (or g0 when dlogp is NULL); 0 at rows
 * with tgt -100 or g_r = 0. rmx / rse (both or neither): the rows' statistics as ce_rows / logprobs wrote them for
 * these same logits, used instead of computing them again (the same values, so the same bits). dl16: the schedule's
 * word that dl is read only by the bf16 products that follow (a linear_bwd_x told dy_kept, then its linear_bwd_w),
 * which round it to bf16: a backend may keep dl so rounded for them and leave dl itself unwritten (CUDA: in the
 * products' scratch, 2 bytes a value written instead of 4, and no rounding pass); the CPU writes dl */
typedef struct {
    float *dl; const float *logits; int64_t rows, V; const int64_t *tgt; const float *dlogp; double g0;
    const float *rmx; const double *rse;
    int dl16; int exp32;
} ds4_a_logp_bwd;
/* y = x Wᵀ backward. linear_bwd_x: dx = dy·W (added when acc); linear_bwd_w: dW += dyᵀ·x. wdt is the dtype W is
 * held in; for linear_bwd_w (dW is fp32 either way) BF16 asks for the product of dy and x rounded to bf16, as the
 * bf16 forward rounds its product's input (the same as bf16_in); F32 (0, the default) is the exact fp32 product. */
typedef struct {
    float *dx; int64_t lddx; int acc; const float *dy; int64_t ldy; const void *W; ds4_dtype wdt; int64_t T, K, O;
    int bf16_in;
    int dy_kept; /* the schedule's word that this op directly follows the logp_bwd (told dl16) that formed dy: a
                  * backend takes dy from what it kept there (ds4_a_logp_bwd) */
} ds4_a_linear_bwd_x;
typedef struct {
    float *dW; const float *dy; int64_t ldy; const float *x; int64_t ldx, T, K, O; ds4_dtype wdt; int bf16_in;
    const uint16_t *x16; /* bf16_in only: x already rounded (bf16 bits, row stride ldx), read instead of x */
    int any_order; /* an fp32 product (wdt F32, no bf16_in) that may sum in another fixed order than the reference's
                    * (the bf16 mode's fp32 weights, whose bits no test pins): CUDA takes cuBLAS's fp32 GEMM */
    int dy_kept;   /* the schedule's word that this op directly follows a linear_bwd_x of the same dy (dy, ldy, T, O)
                    * and nothing wrote dy since: a backend may reuse what it derived from dy there (CUDA: its bf16
                    * copy); the result is the same either way */
    int run;       /* 0: alone. Else one of a run of products into the same dW [O, K] (the head's row chunks, in
                    * order), nothing else touching dW in between: DS4_DW_RUN | DS4_DW_FIRST on the first, DS4_DW_RUN
                    * on those between, DS4_DW_RUN | DS4_DW_LAST on the last (all three on a run of one). A backend
                    * may sum the run's products apart and add their total into dW at the last (CUDA, where dW lies
                    * off a 16-byte boundary); the CPU adds each product as it comes */
} ds4_a_linear_bwd_w;
enum { DS4_DW_FIRST = 1, DS4_DW_LAST = 2, DS4_DW_RUN = 4 };
/* The same per row group of off (ds4_a_matmul_grouped): dx rows written (acc: added); dW + e·wstride added */
typedef struct {
    float *dx; int acc; const float *dy; const void *W; ds4_dtype wdt; int64_t wstride; const int64_t *off;
    int64_t E, rows, K, O; int bf16_in; const uint8_t *Ws;
} ds4_a_linear_bwd_x_grouped;
typedef struct {
    float *dW; int64_t wstride; const float *dy, *x; const int64_t *off; int64_t E, rows, K, O; ds4_dtype wdt;
    int bf16_in;
    int x_kept; /* the schedule's word that this op directly follows a linear_bwd_w_grouped of the same x and groups
                 * (x, off, E, rows, K, O) and nothing wrote x or off since: a backend may reuse what it derived from x
                 * there (CUDA: its transposed bf16 copy); the result is the same either way */
} ds4_a_linear_bwd_w_grouped;

/* RMSNorm backward over `groups` groups of `rows` rows (group g at + g·gstride elements): dx written or added
 * (acc; may alias dy), dw += (may be NULL). */
typedef struct {
    float *dx; int acc; float *dw; const float *dy, *x, *w; int64_t rows, width; double eps; int64_t groups, gstride;
} ds4_a_norm_bwd;

/* mHC pre backward per token, from du and dpost / dcomb: dX += pre_i·du; dmix (the mix gradient, scales folded
 * in), xn = the normalised streams, per-token base (dzb [T, mix]) and scale (dzs [T, 3]) gradient parts. mix (or
 * NULL): the logits the site's hc_pre kept for the same X and w; a backend may read them instead of recomputing
 * them (the same values: the results do not change) */
typedef struct {
    const ds4_config *c; const ds4_hc_w *w; const float *X, *du; float *dX; const float *dpost, *dcomb;
    float *dmix, *xn, *dzb, *dzs; const float *mix; int64_t T;
} ds4_a_hc_pre_bwd;
/* mHC post backward: da, dpost, dcomb and dX (written) from dXo; the coefficients recomputed from X, or from the
 * kept logits mix (or NULL) as in ds4_a_hc_pre_bwd */
typedef struct {
    const ds4_config *c; const ds4_hc_w *w; const float *dXo, *a, *X; float *dX, *da, *dpost, *dcomb;
    const float *mix; int64_t T;
} ds4_a_hc_post_bwd;
/* HyperHead backward per token: dX (written), dmix [T, n], xn, dzb [T, n], dzs [T, 3] (column 0) */
typedef struct {
    const ds4_config *c; const float *X, *fn, *base, *scale, *du; float *dX, *dmix, *xn, *dzb, *dzs; int64_t T;
} ds4_a_hyperhead_bwd;
/* dst[i] += the column sums of src [rows, width] (row stride ld), in chunks of DS4_COLSUM_CHUNK rows: each chunk's
 * sum p = 0 + src[r0·ld + i] + src[(r0 + 1)·ld + i] + .. in row order, then dst[i] += p chunk after chunk (fp32 adds
 * throughout). The chunks are independent sums, so a GPU forms them side by side where one chain over all the rows
 * would keep a single thread a column busy (41 launches of ~41 µs a step on the 599M config); the order depends on
 * rows alone. */
enum { DS4_COLSUM_CHUNK = 256 };
typedef struct { float *dst; const float *src; int64_t rows, width, ld; } ds4_a_colsum_add;

/* Attention backward of one layer from its tape (full forward only): attn_bwd_q computes, per query, the
 * probabilities P and logit gradients DS [T, H, maxk], dq and the per-token sink gradient; attn_bwd_kv the window
 * keys' gradient dkv [T, d]; attn_bwd_entry the entries' gradient dK [B, S, d] (CSA through the inverse pick lists).
 * bf16_in (the forward's, ds4_a_attention): P is recomputed from the bf16 logits, and attn_bwd_q's products take bf16
 * operands — dout·k from dout and the keys rounded, dq = Σ DS·k from DS and the keys rounded; P and DS stay fp32 —
 * and so do the key gradients' (Σ DS·q + P·dout): DS, q, P and dout rounded, fp32 sums. */
/* q0, qn: a query window as ds4_rows' (the tape's query rows are positions [q0, q0 + qn) of each sequence, its key
 * rows all S; qn 0: every position): the key gradients then sum the window's queries only. */
typedef struct {
    const ds4_config *c; const ds4_layer_w *l; const ds4_layer_tape *lt; int64_t B, S, sel_stride;
    const float *dout; float *P, *DS; int64_t maxk; float *dsink_t, *dq, *dkv, *dK;
    const int64_t *inv_off; const int32_t *inv_t, *inv_i; int bf16_in; int64_t q0, qn;
} ds4_a_attn_bwd;
typedef ds4_a_attn_bwd ds4_a_attn_bwd_q, ds4_a_attn_bwd_kv, ds4_a_attn_bwd_entry;
/* Inverse of the CSA picks: for entry (b, w), the (query, pick position) pairs that chose it, in query order:
 * inv_off [B·S + 1], inv_t / inv_i [T·sel_stride]; T = B·qn query rows (qn 0: S) */
typedef struct {
    const int32_t *sel, *nsel; int64_t sel_stride, T, S, B; int64_t *inv_off; int32_t *inv_t, *inv_i; int64_t qn;
} ds4_a_pick_inverse;
/* RoPE on the nwin complete entries of each of B sequences (entry w at position w·m) */
typedef struct { float *x; int64_t B, S, nwin, dd, m; ds4_rope_table rt; int sign; } ds4_a_entry_rope;
/* Pooling backward: dC / dZ of the pooled tokens (others untouched), gape += (NULL: a frozen bias, skipped) */
typedef struct {
    const ds4_config *c; const ds4_compressor_w *w; int overlap; const float *C, *Z, *dpool; float *dC, *dZ, *gape;
    int64_t B, S, nwin;
} ds4_a_comp_bwd;
/* Indexer-KL backward: per query diq, diw and the per-pick score gradient dsi [T, n_I, sel]; per entry dK */
typedef struct {
    const ds4_config *c; const ds4_layer_tape *lt; int64_t B, S, T, sel_stride; const float *dI; float *diq, *diw, *dsi;
    const int64_t *inv_off; const int32_t *inv_t, *inv_i; float *dK;
} ds4_a_ikl_bwd;
typedef ds4_a_ikl_bwd ds4_a_ikl_bwd_q, ds4_a_ikl_bwd_k;
/* SwiGLU with clamps backward: grads = 0: act = silu(min(g1, λ))·clamp(g3, ±λ); grads = 1: dg1 / dg3 from dact
 * (dg3 may alias dact: each element is read before it is written). ex [rows, I] (may be NULL; a backend may ignore
 * it, in both passes alike): grads = 0 also leaves there the exp(−min(g1, λ)) its silu takes, and grads = 1 over the
 * same g1 takes its sigmoid from them instead of evaluating the exp again (the same value) */
typedef struct {
    const float *g1, *g3, *dact; float *act, *dg1, *dg3; int64_t rows, I; float lim; int grads; float *ex;
} ds4_a_swiglu_bwd;
/* dws[slot] = <da[slot / K], ye[slot]> */
typedef struct { float *dws; const float *da, *ye; int64_t T, K, D; } ds4_a_moe_dws;
/* dys[r] = ew[perm[r]] · da[perm[r] / K] */
typedef struct { float *dys; const float *da, *ew; const int32_t *perm; int64_t rows, K, D; } ds4_a_moe_dy;
/* dh[t] += Σ_k dxslot[t·K + k] in slot order */
typedef struct { float *dh; const float *dxslot; int64_t T, K, D; } ds4_a_moe_sum_slots;
/* Router backward: the routing weights' gradient dws [T, K] → dsc [T, E] → dlog [T, E] through the score function */
typedef struct { const ds4_config *c; const int32_t *eidx; const float *rsc, *rlog, *dws; float *dsc, *dlog; int64_t T; } ds4_a_router_bwd;
/* du[t] = Σ_k dX[t, k] (written) */
typedef struct { float *du; const float *dX; int64_t T, n, D; } ds4_a_sum_streams;
/* ge[ids[t]] += Σ_i dx[t, i] for t in order (the embedding gradient; repeated ids add up deterministically) */
typedef struct { float *ge; const int64_t *ids; const float *dx; int64_t T, n, D; } ds4_a_embed_bwd;

/* -------------------------------------------------------------------------------------- optimizer arguments */

/* The optimizer on a backend whose memory the host cannot read (optim.c runs these only there; its host functions,
 * ds4_grad_global_norm and ds4_adamw_update, are the reference). A piece is at most DS4_OPTIM_CHUNK elements
 * [off, off + n) of the flat fp32 buffers, inside trainable tensor `range`. */
typedef struct ds4_optim_piece { int64_t off, n; int64_t range; } ds4_optim_piece;
/* partial[c] = Σ g[i]² over piece c, in double, in a fixed order */
typedef struct { const ds4_optim_piece *pieces; int64_t n; const float *g; double *partial; } ds4_a_optim_sumsq;
/* update = 0: bad[c] = how many elements of piece c the AdamW update would leave with a non-finite p, m or v (the
 * gradient scaled by coef first); nothing written. update = 1: g *= coef (when coef != 1), then ds4_adamw_update's
 * arithmetic on p, m, v with coefs[range] (the same fp32 operations, so the same bits as the host's), and, when bnd
 * is not NULL, bnd[c] = the bounds of what piece c's update wrote (ds4_adamw_bounds: max |p|, |m|, |v| and -v).
 * g is indexed by the pieces' flat offsets, p by the offset minus po and m and v by the offset minus mo: a ZeRO-1
 * shard's master weights and moments hold elements [po, ...) and [mo, ...) of the flat buffer only (0: the whole
 * buffer). */
/* wcast (update = 1 only; NULL: none): the working copy written in the same pass, so that no cast_params pass reads
 * the master again. Piece c's updated p values go to wdst + wcast[c].dst (bytes), rounded to bf16 (round to nearest
 * even) when wcast[c].lowp and wdt is DS4_BF16, else as fp32; wcast[c].dst < 0: piece c has no working copy. The same
 * bytes as cast_params over those elements after the update. */
typedef struct ds4_optim_wcast { int64_t dst, lowp; } ds4_optim_wcast;
typedef struct {
    const ds4_optim_piece *pieces; int64_t n; const ds4_adamw_coefs *coefs; float coef; float *p, *g, *m, *v;
    int64_t *bad; int update; int64_t mo, po; ds4_adamw_bounds *bnd;
    void *wdst; const ds4_optim_wcast *wcast; ds4_dtype wdt;
    int skip_g; /* update = 1: g need not be left clipped (the caller zeroes it after: ds4_adamw_options.zero_grad) */
} ds4_a_adamw;
/* The working copy of the weights from the fp32 master: entry k copies n values from src + e[k].src (elements) to
 * dst + e[k].dst (bytes), rounded to mdt (round to nearest even) when e[k].lowp, else as fp32. */
typedef struct ds4_cast_entry { int64_t src, dst, n; int64_t lowp; } ds4_cast_entry;
typedef struct { void *dst; const float *src; const ds4_cast_entry *e; int64_t n; ds4_dtype mdt; } ds4_a_cast_params;

/* ------------------------------------------------------------------------------------------------ the table */

/* X(name): the operations, in the order the profiler lists them when tied. */
#define DS4_OPS(X)                                                                                              \
    X(embed) X(hc_pre) X(hc_post) X(hyperhead) X(rmsnorm) X(matmul) X(matmul_grouped) X(rope) X(compress)        \
    X(indexer) X(attention) X(cache_commit) X(scale) X(fake_quant) X(record_picks) X(copy_rows)                   \
    X(route) X(count_loads) X(moe_sort) X(gather_rows) X(scatter_rows) X(add_rows) X(moe_weigh) X(swiglu)        \
    X(moe_combine) X(add_bcast)                                                                                  \
    X(ce_rows) X(logprobs) X(ikl) X(sample)                                                                       \
    X(logp_bwd) X(linear_bwd_x) X(linear_bwd_w) X(linear_bwd_x_grouped) X(linear_bwd_w_grouped) X(norm_bwd)      \
    X(hc_pre_bwd) X(hc_post_bwd) X(hyperhead_bwd) X(colsum_add) X(attn_bwd_q) X(attn_bwd_kv) X(attn_bwd_entry)   \
    X(pick_inverse) X(entry_rope) X(comp_bwd) X(ikl_bwd_q) X(ikl_bwd_k) X(swiglu_bwd) X(moe_dws) X(moe_dy)       \
    X(moe_sum_slots) X(router_bwd) X(sum_streams) X(embed_bwd)                                                   \
    X(optim_sumsq) X(adamw) X(cast_params)

typedef enum ds4_op_id {
#define DS4_OP_ENUM(name) DS4_OP_##name,
    DS4_OPS(DS4_OP_ENUM)
#undef DS4_OP_ENUM
    DS4_OP_COUNT
} ds4_op_id;

typedef struct ds4_dev ds4_dev;

typedef struct ds4_ops {
    const char *name;             /* "cpu", "cuda" */
    /* memory: synchronous, errors returned */
    ds4_status (*alloc)(ds4_dev *d, size_t bytes, void **out, ds4_error *err);
    void (*free)(ds4_dev *d, void *p);
    ds4_status (*upload)(ds4_dev *d, void *dst, const void *host_src, size_t bytes, ds4_error *err);
    ds4_status (*download)(ds4_dev *d, void *host_dst, const void *src, size_t bytes, ds4_error *err);
    void (*copy)(ds4_dev *d, void *dst, const void *src, size_t bytes);   /* within the backend; ordered */
    void (*fill)(ds4_dev *d, void *dst, int byte, size_t bytes);
    ds4_status (*sync)(ds4_dev *d, ds4_error *err);
    /* size the backend's private scratch for passes of up to T rows at positions < S (training: the backward's
     * too) before a pass starts, so that nothing is allocated inside it */
    ds4_status (*reserve)(ds4_dev *d, const ds4_config *c, int64_t T, int64_t S, int training, ds4_error *err);
    void (*destroy)(ds4_dev *d);
    /* optional: install device timers into d->prof (profile.h) */
    ds4_status (*profile_init)(ds4_dev *d, ds4_error *err);
    /* optional: run a pass as one recorded unit (CUDA graphs). graph_begin returns 1 when it replayed the pass
     * recorded under `key` (the caller skips the pass's operations), else 0: the caller runs them (the backend may
     * be recording them) and then calls graph_end, which launches what was recorded. A key must name everything the
     * pass's launches depend on: shapes, buffer addresses, flags; its inputs live in backend memory. */
    int (*graph_begin)(ds4_dev *d, uint64_t key);
    void (*graph_end)(ds4_dev *d, uint64_t key);
    /* optional: the stream the backend enqueues its work on (CUDA: a cudaStream_t), for another stream (NCCL's) to
     * wait on an event recorded there; NULL: work is finished when an operation returns (the CPU) */
    void *(*native_stream)(ds4_dev *d);
    /* operations; NULL: not implemented by this backend (the call fails with a message naming it) */
#define DS4_OP_FIELD(name) void (*name)(ds4_dev *d, const ds4_a_##name *a);
    DS4_OPS(DS4_OP_FIELD)
#undef DS4_OP_FIELD
} ds4_ops;

typedef struct ds4_profile ds4_profile;

typedef enum ds4_device_kind { DS4_DEV_CPU = 0, DS4_DEV_CUDA = 1 } ds4_device_kind;

struct ds4_dev {
    const ds4_ops *ops;
    ds4_device_kind kind;
    int host_visible;             /* backend memory is host memory: host arrays may be passed directly */
    ds4_status st;                /* the first failure since the last ds4_dev_check; later ops are skipped */
    ds4_error err;
    ds4_profile *prof;            /* per-op timing, or NULL */
    int32_t refs;                 /* the model and every cache made on it hold one: a cache may outlive its model */
};

/* References to a backend instance; the last release destroys it. */
void ds4_dev_retain(ds4_dev *d);
void ds4_dev_release(ds4_dev *d);

/* Record a failure (the first one wins) from inside an operation. */
void ds4_dev_fail(ds4_dev *d, ds4_status code, const char *fmt, ...) DS4_PRINTF(3, 4);
/* The recorded failure, if any: copied into err (prefixed with `stage`) and cleared. */
ds4_status ds4_dev_check(ds4_dev *d, const char *stage, ds4_error *err);

/* Profiling hooks (ops.c): begin returns a token passed to end; bytes are what the op reads and writes. */
int ds4_prof_begin(ds4_dev *d, ds4_op_id op);
void ds4_prof_end(ds4_dev *d, ds4_op_id op, int token, const void *args);
const char *ds4_op_name(ds4_op_id op);

/* ds4_op_<name>(dev, &args): run one operation (skipped after a failure; a missing entry fails). */
#define DS4_OP_CALL(op)                                                                                    \
    static inline void ds4_op_##op(ds4_dev *d, const ds4_a_##op *a) {                                        \
        if (d->st) return;                                                                                 \
        if (!d->ops->op) {                                                                                 \
            ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "operation %s is not implemented by the %s backend", #op,  \
                         d->ops->name);                                                                    \
            return;                                                                                        \
        }                                                                                                  \
        if (d->prof) {                                                                                     \
            const int tok_ = ds4_prof_begin(d, DS4_OP_##op);                                               \
            d->ops->op(d, a);                                                                              \
            ds4_prof_end(d, DS4_OP_##op, tok_, a);                                                         \
        } else {                                                                                           \
            d->ops->op(d, a);                                                                              \
        }                                                                                                  \
    }
DS4_OPS(DS4_OP_CALL)
#undef DS4_OP_CALL

/* OP(dev, name, .field = value, ...): the schedule's spelling of one operation with its argument struct. */
#define OP(d, name, ...) ds4_op_##name((d), &(ds4_a_##name){__VA_ARGS__})

/* Memory helpers over the table (sticky-error versions for use inside a pass). */
static inline void ds4_dev_copy(ds4_dev *d, void *dst, const void *src, size_t bytes) {
    if (!d->st && bytes) d->ops->copy(d, dst, src, bytes);
}
static inline void ds4_dev_fill(ds4_dev *d, void *dst, int byte, size_t bytes) {
    if (!d->st && bytes) d->ops->fill(d, dst, byte, bytes);
}
void ds4_dev_upload(ds4_dev *d, void *dst, const void *host_src, size_t bytes);
/* A host input of an operation: used in place on a host-visible backend, else uploaded into `planned`. */
static inline const void *ds4_dev_input(ds4_dev *d, void *planned, const void *host, size_t bytes);
void ds4_dev_download(ds4_dev *d, void *host_dst, const void *src, size_t bytes);

static inline const void *ds4_dev_input(ds4_dev *d, void *planned, const void *host, size_t bytes) {
    if (!host || d->host_visible) return host;
    ds4_dev_upload(d, planned, host, bytes);
    return planned;
}

/* Backends. The CPU backend computes on the engine's thread pool. */
ds4_status ds4_cpu_dev_create(ds4_pool *pool, ds4_dev **out, ds4_error *err);

#endif
