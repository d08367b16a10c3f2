/* sched.h — the model schedule's internal state, shared by forward.c, step.c, backward.c and plan.c (not
 * installed). docs/design.md describes the schedule, the op table and memory planning.
 *
 * A pass runs T rows through the model on the model's backend. Every buffer it uses is planned from its shape
 * (B, S) or (T, Smax) before it starts, in one workspace of backend memory kept in the model and reused while it
 * is large enough; nothing is allocated per token or per layer. A training forward also fills a tape: per block,
 * the activations the backward pass needs (copies taken at the points noted below, because the pass's buffers
 * are reused by the next layer). */
#ifndef DS4_SCHED_H
#define DS4_SCHED_H

#include <stdint.h>

#include "cache.h"
#include "model.h"
#include "ops.h"

/* Activations of one block saved by a training forward (T = B·S rows). */
typedef struct ds4_layer_tape {
    float *X_in;                  /* [T, n, D] streams entering the block (those after the attention site, X_mid,
                                     are recomputed from X_in, a_attn and the two below) */
    float *post_attn, *comb_attn; /* [T, n], [T, n, n] the attention site's mixing weights */
    float *mix_attn, *mix_ffn;    /* [T, (2 + n)·n] the mixing logits of the two mHC sites (hc_pre's mix) */
    /* h_attn, qr, o and y are read by the backward only as inputs of bf16 products (their weights' gradients): in
     * the bf16 mode without LoRA (ds4_tape.x16) they are kept as those products round them, in bf16 (uint16_t),
     * half the bytes and the same bits; else in fp32 */
    float *u_attn;                /* [T, D] collapsed input */
    void *h_attn;                 /* [T, D] after attn_norm */
    float *qa;                    /* [T, q_lora] before q_norm */
    void *qr;                     /* [T, q_lora] after q_norm */
    float *q_pre, *q;             /* [T, H·d] before the per-head RMS / after RoPE */
    float *kv_pre, *kv;           /* [T, d] before kv_norm / after RoPE */
    float *cC, *cZ;               /* [T, width] compressor projections */
    float *pool, *cK;             /* [B·S, d] pooled entries before norm / final entries */
    int64_t nwin;                 /* compressed entries per row */
    int32_t *sel, *nsel;          /* [T, sel_stride], [T]: indexer picks (CSA) */
    void *o;                      /* [T, H·d] attention output after de-rotation */
    void *y;                      /* [T, g·o_lora] */
    float *a_attn;                /* [T, D] attention sub-layer output */
    float *u_ffn, *h_ffn;         /* [T, D] */
    float *rlog, *rsc;            /* [T, E] router logits / scores */
    int32_t *eidx;                /* [T, K] */
    float *ew;                    /* [T, K] routing weights */
    float *eg1, *eg3;             /* [T·K, I] expert pre-activations, rows in expert order (moe_sort's perm) */
    float *ye;                    /* [T·K, D] expert outputs per (token, slot), before weighting */
    float *sg1, *sg3;             /* [T, I] shared expert pre-activations */
    float *a_ffn;                 /* [T, D] MoE output (routed + shared) */
    /* indexer KL loss (CSA layers, indexer_kl > 0) */
    float *iq;                    /* [T, n_I·c_I] indexer queries after RoPE */
    float *iw;                    /* [T, n_I] head weights (scaled by n_I^-1/2) */
    float *iK;                    /* [B·S, c_I] indexer keys */
    float *iC, *iZ;               /* [T, 2·c_I] indexer compressor projections */
    float *ipool;                 /* [B·S, c_I] indexer entries before norm */
    float *itgt;                  /* [T, sel_stride] attention mass on each pick, summed over heads */
} ds4_layer_tape;

enum { DS4_HEAD_MAIN = 1, DS4_HEAD_MTP = 2 }; /* ds4_tape.logits_head */

typedef struct ds4_tape {
    int64_t B, S, T;              /* of the main forward; the MTP block runs over S-1 positions */
    int valid;                    /* a training forward filled it and no backward consumed it */
    int with_mtp;
    int x16;                      /* the layers' h_attn, qr, o and y are in bf16 (ds4_layer_tape) */
    ds4_layer_tape *layers;       /* [L] main blocks, then [1] the MTP block (host structs, backend pointers) */
    float *X_L;                   /* [T, n, D] final streams */
    float *u_fin, *y_fin;         /* [T, D] HyperHead output / after the final norm */
    int64_t head_rows;            /* rows per chunk of the LM head (ds4_head_rows at the forward) */
    float *logits;                /* [head_rows, V] one chunk of logits (main head, then the MTP head) */
    int logits_head;              /* the head (DS4_HEAD_MAIN / DS4_HEAD_MTP) whose logits `logits` holds for all its
                                     rows (one chunk), so its backward need not compute them again; 0: none */
    float *rmx;                   /* [2, T] each head's rows' softmax statistics (ops.h: ce_rows), written by its */
    double *rse;                  /* forward for every row, read by its backward's logp_bwd (row 0 main, 1 MTP) */
    int stats_heads;              /* the heads (DS4_HEAD_MAIN | DS4_HEAD_MTP bits) whose statistics are whole */
    int64_t *ids, *labels;        /* [T] backend copies */
    int64_t *hids, *hlabels;      /* [T] host copies (the schedule derives targets and MTP rows from them) */
    int64_t *hlen;                /* [B] each row's real length (ds4_forward_args.lengths; S when not given) */
    int64_t *tgt;                 /* [T] targets of the rows of logits (backend) */
    float *lp;                    /* [2, T] log-probabilities and entropies (backend) */
    int64_t *loads;               /* [(L + 1), E] expert loads of this forward, off the host (then added to the
                                     model's host counters); NULL on a host-visible backend, which counts in place */
    /* MTP (positions i < S-1): inputs and its head */
    float *mtp_e, *mtp_en;        /* [T1, D] embedding of token i+1 / after enorm */
    float *mtp_hn;                /* [T1, n, D] hnorm of X^L_i */
    float *mtp_u, *mtp_y;         /* [T1, D] MTP HyperHead output / after mtp norm */
    float *mtp_X;                 /* [T1, n, D] MTP block output */
    int64_t loss_tokens, mtp_tokens; /* scored tokens of the main and MTP losses */
    int64_t ep_rows;              /* the forward ran with expert parallelism: its ds4_pass.ep_rows (else 0) */
    int64_t cp_S, cp_off;         /* context parallelism: the whole sequence's S and this rank's first position (B, S
                                     and T above are this rank's slice; the tape was planned for [B, cp_S]); cp_S 0:
                                     off */
    int with_ikl;                 /* indexer KL loss: the indexer activations are kept */
    int recompute;                /* per-block recomputation: the main blocks share one set of activation slots;
                                     each keeps its own X_in, sel / nsel, rsc, eidx and ew */
    int64_t sel_stride;
    void *mem;                    /* backend memory */
    size_t bytes;
    void *bmem;                   /* backward workspace, planned from (B, S) */
    size_t bbytes;
} ds4_tape;

/* One pass (forward or step) over T rows. */
typedef struct ds4_pass {
    ds4_model *m;
    const ds4_config *c;
    ds4_dev *dev;
    const ds4_weights *w;         /* the backend's views */
    int64_t B, S, T;              /* a step has B = 0: no [B, S] buffers are planned */
    ds4_rows rows;                /* how row t finds its position and cache */
    ds4_rope_table rmain, rcomp;
    /* planned activations */
    float *X, *Xt, *Xz;           /* [T, n, D] streams */
    float *pre, *post, *comb;     /* [T, n], [T, n], [T, n, n] */
    float *u, *h, *a;             /* [T, D] */
    float *qr;                    /* [T, q_lora] */
    float *q, *o;                 /* [T, H·d] */
    float *kv;                    /* [T, d] */
    float *y;                     /* [T, g·o_lora] */
    float *cC, *cZ;               /* [T, 2d] compressor projections */
    float *cK;                    /* [B, S, d] compressed entries (at most S/m per row used) */
    float *iC, *iZ;               /* [T, 2c_I] */
    float *iK;                    /* [B, S, c_I] */
    float *iq;                    /* [T, n_I·c_I] */
    float *iw;                    /* [T, n_I] */
    int32_t *sel;                 /* [T, sel_stride] indexer picks */
    int32_t *nsel;                /* [T] number of picks */
    int64_t sel_stride;           /* max(1, min(index_topk, S)) */
    float *rl;                    /* [T, E] router scores */
    int32_t *eidx;                /* [T, K] */
    float *ew;                    /* [T, K] */
    float *yk;                    /* [T·K, D] weighted expert outputs per (token, slot) */
    float *xg;                    /* [T·K, D] gathered expert inputs */
    float *ye;                    /* [T·K, D] expert outputs before weighting */
    float *g1, *g3;               /* [T·K, I] */
    int32_t *perm;                /* [T·K] (token·K + slot) grouped by expert */
    int64_t *ecount;              /* [E + 1] group boundaries */
    float *logits_ws;             /* [T, V] when the caller wants a loss but no logits (or cannot be written to) */
    int64_t *ids;                 /* [T] the tokens (backend) */
    int64_t *tgt;                 /* [T] the target of each row of logits (-100: none) */
    double *nll;                  /* [T] per-row losses */
    int64_t *mtp_ids;             /* [T] next-token ids for the MTP block */
    int32_t *rowmap;              /* [T] rows gathered for the MTP block / the last row of each step sequence */
    /* step: row tables (backend copies of the host tables) */
    int64_t *pos;
    int32_t *rowseq;
    ds4_seq_desc *seqs;
    int64_t *njobs_dev;           /* [2] */
    float *lu;                    /* [T·max(K, 1), r] LoRA scratch (lora_sched.c), when the model carries adapters */
    /* routing replay and records (backend; the caller's arrays on a host-visible backend) */
    const int32_t *replay_experts; /* [T, L, K], or NULL */
    const int32_t *replay_index;  /* [T, n_csa, index_topk], or NULL */
    int32_t *rec_experts;         /* [T, L, K] routed experts to record, or NULL */
    int32_t *rec_index;           /* [T, n_csa, index_topk] indexer picks to record, or NULL */
    int replay_on;                /* the block being run is a main layer (replay applies) */
    int64_t njobs[2];             /* step: compressor jobs of the step per rate class ([0] CSA, [1] HCA) */
    ds4_tape *tape;               /* training forward: where to save activations (NULL: inference) */
    ds4_layer_tape *lt;           /* the current block's slot in the tape (NULL: inference) */
    int64_t li, csa_i;            /* the main layer being run, and its rank among the CSA layers */
    int recompute;                /* the backward re-running a block (ds4_train_options.recompute): its routing and
                                     indexer picks come from lt (as the forward made them, replayed or not), nothing
                                     is counted or recorded */
    /* expert parallelism (moe_ep.c; 0 rows: off, the pass computes every expert itself). This rank's experts may
     * receive up to ep_rows = K·Σ_ranks T rows (every slot of every rank): planned for that worst case. */
    int64_t ep_rows;
    float *ep_x[4];               /* [ep_rows, D] rows received, reordered by expert, results, rows to send back */
    float *ep_h[4];               /* [ep_rows, I] the local experts' g1, g3 (forward); act, dact too (backward) */
    int32_t *ep_idx;              /* [ep_rows] for the r-th row in (expert, source rank) order, its received row */
    int64_t *ep_off;              /* [E / world + 1] local expert group boundaries of that order */
    /* context parallelism (cp.c; cp_world 0: off). Planned for [B, cp_S0]; this rank keeps positions
     * ds4_cp_range(cp_S0, cp_mtp, ...) of every sequence: S and T are that slice's (n, B·n), except inside an attention
     * sub-layer, where they are the whole sequence's (ds4_cp_gather_rows .. ds4_cp_keep_rows) */
    int32_t cp_rank, cp_world;
    int64_t cp_S0;                /* the main blocks' whole S */
    int cp_mtp;                   /* the MTP block runs: its S - 1 positions */
    float *cp_x;                  /* [P, B·ceil(S/P), D] backend scratch of the gathers (a backend whose memory the
                                     host cannot read: the device hook's receive buffer); NULL otherwise */
    int64_t cp_xn;                /* its values */
} ds4_pass;

/* What a pass needs planned beyond its activations. */
typedef struct ds4_pass_opts {
    int logits_ws;                /* plan logits_ws */
    int replay_experts, replay_index, rec_experts, rec_index;
    int64_t nseq;                 /* step: sequences (for the row tables) */
    int64_t ep_rows;              /* expert parallelism: ds4_pass.ep_rows (0: off) */
    int64_t tok_rows;             /* context parallelism: this rank's rows, what the per-token buffers hold (the
                                     attention buffers hold T); 0: T */
} ds4_pass_opts;

/* A bump allocator for planned workspaces: planning runs it once with base NULL to size the block, then
 * again over the allocated block to hand out 64-byte-aligned slices. */
typedef struct ds4_arena {
    char *base;
    size_t used;
} ds4_arena;

static inline void *ds4_arena_take(ds4_arena *a, size_t n, size_t elem) {
    size_t bytes = (n * elem + 63) & ~(size_t)63;
    void *p = a->base ? a->base + a->used : NULL;
    a->used += bytes;
    return p;
}

/* plan.c: set up a pass of T rows at positions < S (B sequences of S in a full forward, B = 0 in a step) on the
 * model's backend: plan its buffers in the model's workspace (grown when needed), reserve the backend's scratch
 * and make the RoPE tables cover positions < S. */
ds4_status ds4_pass_setup(ds4_model *m, ds4_pass *p, int64_t B, int64_t S, int64_t T, const ds4_pass_opts *o,
                          int training, ds4_error *err);
/* Size (and grow) a tape for (B, S) in backend memory; its per-token slots for tok_rows rows (context parallelism:
 * this rank's; 0: B·S), its attention slots for B·S. */
/* Whether query t of a pass of rows of S positions counts in the indexer KL loss: it has picks (nsel [T], host) and
 * is no padding (hlen [B], the tape's real lengths). The forward's count and the backward's agree through this. */
static inline int ds4_ikl_counts(const int32_t *nsel, const int64_t *hlen, int64_t S, int64_t t) {
    return nsel[t] > 0 && t % S < hlen[t / S];
}
ds4_status ds4_tape_reserve(ds4_model *m, ds4_tape *tp, int64_t B, int64_t S, int64_t tok_rows, int with_mtp,
                            ds4_error *err);

/* A host input of a pass: used in place on a host-visible backend, else uploaded into its planned buffer. */
static inline const void *ds4_pass_input(ds4_pass *p, void *planned, const void *host, size_t bytes) {
    return ds4_dev_input(p->dev, planned, host, bytes);
}

/* forward.c: one decoder block over streams X (result back in X; Xt is scratch), with token ids `ids` for hash
 * routing; the head of a pass (logits = head(norm(HyperHead(X))) for p->T rows). */
void ds4_block(ds4_pass *p, const ds4_layer_w *l, float *X, const int64_t *ids);
/* The same from the streams X to Xo, X left as it was (Xo == X: ds4_block) */
void ds4_block_to(ds4_pass *p, const ds4_layer_w *l, float *X, float *Xo, const int64_t *ids);
/* logits NULL: only the head's input y = norm(HyperHead(X)), left in p->u (a training pass then runs the head in
 * chunks of ds4_head_rows). */
void ds4_lm_head(ds4_pass *p, const float *X, const float *fn, const float *base, const float *scale, const float *norm,
                 float *logits, float *u_keep, float *y_keep);
/* Rows per chunk of the LM head in a training pass of T rows (ds4_train_options.head_chunk; 0: all rows on a
 * host-visible backend, 1024 elsewhere). */
int64_t ds4_head_rows(const ds4_model *m, int64_t T);
/* The forward of ds4_model_forward / _train; with a tape it also saves what the backward needs. */
ds4_status ds4_forward_run(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_tape *tape,
                           ds4_error *err);

/* lora_sched.c: the adapters' terms (docs/lora.md). Forward: y (row stride ldy) += s·(x Aᵀ)·B over T rows, nothing
 * when the adapter is absent; wo_a per output group; the routed experts' gate_up (g1 and g3 from one A) and down over
 * the expert row groups of off. */
/* The adapter `field` of a layer's adapters lo (NULL when lo is) */
#define DS4_LORA_AB(lo, field) ((lo) ? &(lo)->field : NULL)
void ds4_lora_fwd(ds4_pass *f, const ds4_lora_layer *lo, const ds4_lora_ab *ab, float *y, int64_t ldy, const float *x,
                  int64_t ldx, int64_t T, int64_t K, int64_t O);
void ds4_lora_fwd_wo_a(ds4_pass *f, const ds4_lora_layer *lo, float *y, const float *o, int64_t T);
void ds4_lora_fwd_gate_up(ds4_pass *f, const ds4_lora_layer *lo, float *g1, float *g3, const float *x,
                          const int64_t *off, int64_t rows);
void ds4_lora_fwd_down(ds4_pass *f, const ds4_lora_layer *lo, float *y, const float *act, const int64_t *off,
                       int64_t rows);
/* Backward: the adapter gradients (g, may be NULL) added and dx (may be NULL: a detached input) added to. u, v:
 * scratch [T·max(K, 1), r] each. */
typedef struct ds4_lora_bwd_ctx {
    ds4_dev *dev;
    float *u, *v;
} ds4_lora_bwd_ctx;
void ds4_lora_bwd(const ds4_lora_bwd_ctx *b, const ds4_lora_layer *lo, const ds4_lora_ab *ab, const ds4_lora_ab *g,
                  float *dx, int64_t lddx, const float *dy, int64_t ldy, const float *x, int64_t ldx, int64_t T,
                  int64_t K, int64_t O);
void ds4_lora_bwd_wo_a(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                       const ds4_lora_layer *go, float *dout, const float *dy, const float *o, int64_t T);
void ds4_lora_bwd_gate_up(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                          const ds4_lora_layer *go, float *dxs, const float *dg1, const float *dg3, const float *xs,
                          const int64_t *off, int64_t rows);
void ds4_lora_bwd_down(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                       const ds4_lora_layer *go, float *dact, const float *dys, const float *act, const int64_t *off,
                       int64_t rows);

/* step.c: ds4_model_step, with each sequence's last logits left in backend memory at last_dev ([nseq, V]) when
 * it is non-NULL (generation samples there). */
ds4_status ds4_step_run(ds4_model *m, const ds4_step_args *a, float *last_dev, ds4_error *err);

/* moe_ep.c: expert parallelism (docs/distributed.md). ds4_ep_pass_rows: collective over the ranks, the ep_rows of a
 * full pass of T rows on this rank (0 when the model's expert parallelism is off), host scratch reserved for it.
 * ds4_ep_reserve: the scratch for a pass of `rows` (the backward, from its tape). */
ds4_status ds4_ep_pass_rows(ds4_model *m, int64_t T, int64_t *rows, ds4_error *err);
ds4_status ds4_ep_reserve(ds4_model *m, int64_t rows, ds4_error *err);
/* The routed experts of layer l under expert parallelism. Forward: xg [T·K, D] grouped by expert (off = f->ecount)
 * → ye [T·K, D] in the same order, each row computed by its expert's rank; a training forward (f->lt) keeps the
 * layer's exchange plan for its backward. Backward: from the same grouping of the expert inputs xs and output
 * gradients dys, the input gradients dxs (written) and, on the owning rank, the expert weight gradients of g (added);
 * the pre-activations recomputed from xs; `key` the layer's index in the tape's layers (the kept plan's). */
void ds4_ep_experts_fwd(ds4_pass *f, const ds4_layer_w *l, const float *xg, const int64_t *off, float *ye);
void ds4_ep_experts_bwd(ds4_pass *f, const ds4_layer_w *l, const ds4_layer_w *g, const float *xs, const float *dys,
                        const int64_t *off, int64_t key, float *dxs);
/* The plans kept for the backward, freed (with the model). */
void ds4_ep_saved_free(ds4_model *m);
/* Sum the model's expert-load counters over the ranks (a collective, before the bias update). */
ds4_status ds4_ep_sum_loads(ds4_model *m, ds4_error *err);

/* cp.c: context parallelism (docs/distributed.md). ds4_cp_range: the positions [off, off + len) rank q keeps of a
 * sequence of S (mtp 1: of the MTP block's S - 1). ds4_cp_check: what a forward under it refuses. ds4_cp_begin: the
 * pass (planned for [B, S]) keeps this rank's slice (its shape set to it). ds4_cp_gather_rows: x holds this rank's
 * B·n rows of `width`; all-gathered (a collective), it holds the whole [B, cp_S] in place and the pass has that
 * shape; ds4_cp_keep_rows: back to this rank's rows of x and shape. ds4_cp_sum_rows: the sum of nll over the rows
 * whose target is not -100, over every rank's rows in the order of one process holding the whole sequence (and their
 * count). A failed collective fails the pass's backend, like a failed operation; a rank whose pass failed still
 * joins the gathers, telling the others, which then fail too. */
void ds4_cp_range(int64_t S, int mtp, int32_t world, int32_t q, int64_t *off, int64_t *len);
ds4_status ds4_cp_check(const ds4_model *m, const ds4_forward_args *a, int train, ds4_error *err);
/* Before a forward or backward under context parallelism (a collective): every rank tells the others whether its own
 * checks passed (st) and hashes of the shape, ids and labels it was given; st, or a failure naming the first rank that
 * refused or whose inputs differ from rank 0's. So a refusal or a mismatch fails every rank at once instead of leaving
 * the others waiting in a gather. */
ds4_status ds4_cp_agree(ds4_model *m, const char *what, int64_t B, int64_t S, const int64_t *ids,
                        const int64_t *labels, ds4_status st, ds4_error *err);
void ds4_cp_begin(ds4_pass *f, int64_t S);
void ds4_cp_set_mtp(ds4_pass *f, int mtp);
void ds4_cp_gather_rows(ds4_pass *f, float *x, int64_t width);
void ds4_cp_keep_rows(ds4_pass *f, float *x, int64_t width);
void ds4_cp_sum_rows(ds4_pass *f, const int64_t *tgt, const double *nll, double *sum, int64_t *cnt);
/* Split by query (unless whole_attention: the attention kernels take a query window, ds4_rows q0 / qn). Within an
 * attention sub-layer whose key side has the whole shape (after ds4_cp_gather_rows, or ds4_cp_whole_shape in the
 * backward): ds4_cp_query_rows, this rank's positions of every sequence as a query window; ds4_cp_slice_shape, the
 * pass back to this rank's slice, its rows left where they are. ds4_cp_sum_floats: x [n] (the model's memory: the
 * host's, or a backend's through the device hook and the pass's scratch) summed over the ranks in rank order, the
 * same sum on every rank (a collective). */
int ds4_cp_model_by_query(const ds4_model *m); /* the planning's question: this model's passes split by query */
int ds4_cp_by_query(const ds4_pass *f);
ds4_rows ds4_cp_query_rows(const ds4_pass *f);
void ds4_cp_whole_shape(ds4_pass *f);
void ds4_cp_slice_shape(ds4_pass *f);
void ds4_cp_sum_floats(ds4_pass *f, float *x, int64_t n, const char *what);

/* backend.c: make the backend's weights current (after the host params changed) before a pass. */
ds4_status ds4_model_sync_weights(ds4_model *m, ds4_error *err);
/* Free every backend resource of the model (workspace, tape, weights copy, RoPE copies, backends). */
void ds4_model_release_backend(ds4_model *m);

#endif
