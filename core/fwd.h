/* fwd.h — the forward pass's internal state, shared by forward.c and backward.c (not installed).
 *
 * A training forward fills a tape: per block, the activations the backward pass needs (copies taken at the
 * points noted below, because the forward's scratch is reused by the next layer). Everything is planned
 * from (B, S) once per call; nothing is allocated per token or per layer. */
#ifndef DS4_FWD_H
#define DS4_FWD_H

#include <math.h>
#include <stdint.h>

#include "kernels_cpu.h"
#include "model.h"

enum { MAX_TASKS = 64 };

typedef struct rope_tab {
    int64_t half;     /* r/2 rotated pairs */
    float *cs;        /* [S, r] interleaved (cos, sin) per pair, already scaled by attention_factor */
} rope_tab;

/* Activations of one block saved by a training forward (T = B·S rows). */
typedef struct ds4_layer_tape {
    float *X_in, *X_mid;          /* [T, n, D] streams entering the block / after the attention site */
    float *u_attn, *h_attn;       /* [T, D] collapsed input, after attn_norm */
    float *qa, *qr;               /* [T, q_lora] before / after q_norm */
    float *q_pre, *q;             /* [T, H·d] before the per-head RMS / after RoPE */
    float *kv_pre, *kv;           /* [T, d] before kv_norm / after RoPE */
    float *cC, *cZ;               /* [T, width] compressor projections */
    float *pool, *cK;             /* [B·S, d] pooled entries before norm / final entries */
    int64_t nwin;                 /* compressed entries per row */
    int32_t *sel, *nsel;          /* [T, sel_stride], [T]: indexer picks (CSA) */
    float *o;                     /* [T, H·d] attention output after de-rotation */
    float *y;                     /* [T, g·o_lora] */
    float *a_attn;                /* [T, D] attention sub-layer output */
    float *u_ffn, *h_ffn;         /* [T, D] */
    float *rlog, *rsc;            /* [T, E] router logits / scores */
    int32_t *eidx;                /* [T, K] */
    float *ew;                    /* [T, K] routing weights */
    float *eg1, *eg3;             /* [T·K, I] expert pre-activations per (token, slot) */
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

typedef struct ds4_tape {
    int64_t B, S, T;              /* of the main forward; the MTP block runs over S-1 positions */
    int valid;                    /* a training forward filled it and no backward consumed it */
    int with_mtp;
    ds4_layer_tape *layers;       /* [L] main blocks, then [1] the MTP block */
    float *X_L;                   /* [T, n, D] final streams */
    float *u_fin, *y_fin;         /* [T, D] HyperHead output / after the final norm */
    float *logits;                /* [T, V] */
    int64_t *ids, *labels;        /* [T] */
    /* MTP (positions i < S-1): inputs and its head */
    float *mtp_e, *mtp_en;        /* [T1, D] embedding of token i+1 / after enorm */
    float *mtp_hn;                /* [T1, n, D] hnorm of X^L_i */
    float *mtp_u, *mtp_y;         /* [T1, D] MTP HyperHead output / after mtp norm */
    float *mtp_logits;            /* [T1, V] */
    float *mtp_X;                 /* [T1, n, D] MTP block output */
    int64_t loss_tokens, mtp_tokens; /* scored tokens of the main and MTP losses */
    int with_ikl;                 /* indexer KL loss: the indexer activations are kept */
    int64_t sel_stride;
    char *mem;
    size_t bytes;
    char *bmem;                   /* backward workspace, planned from (B, S) */
    size_t bbytes;
} ds4_tape;

typedef struct fwd {
    ds4_model *m;
    const ds4_config *c;
    ds4_pool *pool;
    int64_t B, S, T, ntask;
    rope_tab rmain, rcomp;
    /* planned scratch */
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
    float *scratch;               /* [ntask, scratch_stride] per-task scratch, see plan() */
    int64_t scratch_stride;
    int64_t key_off;              /* attention scratch: logits first, then key pointers from here */
    float *rl;                    /* [T, E] router scores */
    int32_t *eidx;                /* [T, K] */
    float *ew;                    /* [T, K] */
    float *yk;                    /* [T·K, D] weighted expert outputs per (token, slot) */
    float *xg;                    /* [T·K, D] gathered expert inputs */
    float *ye;                    /* [T·K, D] expert outputs before weighting */
    float *g1, *g3;               /* [T·K, I] */
    int32_t *perm;                /* [T·K] (token·K + slot) grouped by expert */
    int64_t *ecount;              /* [E + 1] */
    float *logits_ws;             /* [T, V] when the caller wants a loss but no logits */
    int64_t *mtp_ids;             /* [T] next-token ids for the MTP block */
    ds4_tape *tape;               /* training forward: where to save activations (NULL: inference) */
    ds4_layer_tape *lt;           /* the current block's slot in the tape (NULL: inference) */
    /* ds4_model_step: the T rows are the new tokens of nseq sequences, each appended to its cache (S is then the
     * largest position + 1, B is 0: no [B, S] buffers are planned) */
    const int64_t *pos;           /* [T] absolute position of each row; NULL in a full forward (row t at t % S) */
    const int32_t *rowseq;        /* [T] the sequence of each row */
    struct ds4_step_seq *seqs;    /* [nseq] */
    int64_t nseq;
    int64_t li, csa_i;            /* the main layer being run, and its rank among the CSA layers */
    const int32_t *replay_experts; /* [T, L, K] routing replay (ds4_forward_args), or NULL */
    const int32_t *replay_index;  /* [T, n_csa, index_topk], or NULL */
    int replay_on;                /* the block being run is a main layer (replay applies) */
    int32_t *rec_experts;         /* [T, L, K] routed experts to record, or NULL */
    int32_t *rec_index;           /* [T, n_csa, index_topk] indexer picks to record, or NULL */
} fwd;

/* One sequence of a step: tokens [p0, p0 + n) at rows [r0, r0 + n). */
typedef struct ds4_step_seq {
    struct ds4_cache *cache;
    int64_t p0, n, r0;
    int64_t w0[2];                /* first compressor-job index of its new windows (main, indexer) */
} ds4_step_seq;

static inline int64_t ds4_row_pos(const fwd *f, int64_t t) { return f->pos ? f->pos[t] : t % f->S; }


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

/* The mHC residual mix of one token (§2.2): from the comb logits (mix logits 2n.., scaled by sc2, plus base),
 * row softmax, +eps, column-normalise, then (iters-1) × (row, column), in fp64 → M [n, n]. With `tape` (room
 * for (2·iters + 1)·n·n doubles) the states before each normalisation step are kept for the backward: state 0
 * is softmax + eps, state k (k = 1 .. 2·iters-1) the result of step k (odd k: column, even k: row), and the
 * plain softmax at offset 2·iters·n·n. */
void ds4_hc_sinkhorn(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base, double *M,
                     double *tape);

static inline const float *rope_at(const rope_tab *t, int64_t pos) { return t->cs + pos * 2 * t->half; }
static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

typedef void (*range_fn)(fwd *f, void *ctx, int64_t begin, int64_t end, int64_t task);
/* Split [0, n) into f->ntask contiguous ranges; task i may use scratch slot i. */
void ds4_fwd_parallel_range(fwd *f, int64_t n, range_fn fn, void *ctx);
void ds4_fwd_norm_rows(fwd *f, float *x, const float *w, int64_t rows, int64_t width);
void ds4_fwd_rope_rows(fwd *f, float *x, int64_t heads, int64_t width, const rope_tab *rt, int sign);

/* Per-call setup shared by forward and backward: the fwd state for (B, S) with its scratch planned in the
 * model's workspace and the RoPE tables filled. */
ds4_status ds4_fwd_setup(ds4_model *m, fwd *f, int64_t B, int64_t S, int need_logits_ws, ds4_error *err);

/* The forward of ds4_model_forward; with a tape it also saves what the backward needs. */
ds4_status ds4_fwd_run(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_tape *tape,
                       ds4_error *err);
/* The indexer KL loss of one CSA layer from its tape (T = B·S queries): returns Σ_t KL_t over the queries with
 * picks and attention mass on them, their count in *nq. With dI (T × sel_stride, may be NULL) it also writes
 * d(weight · mean_t KL_t)/d(score) = weight/nq · (q − p) for every pick (0 elsewhere). */
double ds4_ikl_eval(const ds4_config *c, const ds4_layer_tape *lt, int64_t T, int64_t S, int64_t sel_stride,
                    float *dI, double weight, int64_t *nq);

/* Router score s(x) for one logit and its derivative ds/dx (sqrt-softplus, sigmoid; softmax is per row). */
float ds4_fwd_score(ds4_score_func sf, float x);

#endif
