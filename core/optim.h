/* optim.h — AdamW and gradient clipping on raw fp32 buffers (internal; the public optimizer is the ds4_adamw
 * part of ds4_train.h, built on these).
 *
 * The arithmetic reproduces torch.optim.AdamW (single-tensor path, the one torch takes for CPU tensors) and
 * torch.nn.utils.clip_grad_norm_ operation by operation, with fp32 elementwise math and the scalar
 * coefficients computed in double and rounded to fp32 where torch does, so that a replay of torch's steps
 * agrees to a few ulps (tests/test_adamw.c).
 *
 * Threading: every function that takes a pool splits its buffers into fixed chunks of DS4_OPTIM_CHUNK
 * elements; each element is written by exactly one task, and reductions add per-chunk partial sums in chunk
 * order, so results are bit-identical whatever the thread count (and with pool == NULL: serial). */
#ifndef DS4_OPTIM_H
#define DS4_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"
#include "threadpool.h"

/* Elements per task. Fixed (never derived from the thread count) because the chunking decides the order of the
 * norm's partial sums. 16 Ki fp32 = 64 KiB per buffer: large enough to amortise a task hand-out, small
 * enough to balance a 50M-parameter model over 16 threads. */
#define DS4_OPTIM_CHUNK ((int64_t)1 << 14)

typedef struct ds4_adamw_hparams {
    double beta1, beta2, eps, weight_decay;
} ds4_adamw_hparams;

/* Per-tensor coefficients of one update, from (hparams, t, lr). Kept separate so that a threaded step computes
 * them once per tensor, not once per chunk. */
typedef struct ds4_adamw_coefs {
    float decay_mul;   /* 1 - lr·wd (fp32, as torch's param.mul_(1 - lr * weight_decay)); 1 when not decayed */
    float one_m_b1;    /* lerp weight 1 - beta1 */
    float beta2, one_m_b2;
    float neg_step;    /* -lr / (1 - beta1^t) */
    float bc2_sqrt;    /* sqrt(1 - beta2^t) */
    float eps;
    int decay;
} ds4_adamw_coefs;

/* t: the update number of this tensor, 1-based (torch's state["step"] after its increment). */
ds4_adamw_coefs ds4_adamw_coefs_at(const ds4_adamw_hparams *h, int64_t t, double lr, int decay);
/* One AdamW update of n elements (serial): p, m, v updated in place from g. */
void ds4_adamw_update(const ds4_adamw_coefs *c, float *p, const float *g, float *m, float *v, int64_t n);
/* How many of n elements an update would leave with a non-finite p, m or v, the gradient first multiplied by coef
 * (as ds4_grad_scale does; 1: unscaled). Writes nothing: ds4_adamw_step checks with it before it updates. */
int64_t ds4_adamw_count_nonfinite(const ds4_adamw_coefs *c, float coef, const float *p, const float *g,
                                  const float *m, const float *v, int64_t n);
/* ds4_adamw_coefs_at + ds4_adamw_update. decay: apply hparams.weight_decay to this range. */
void ds4_adamw_update_range(const ds4_adamw_hparams *h, int64_t t, double lr, float *p, const float *g, float *m,
                            float *v, int64_t n, int decay);

/* One tensor for the multi-tensor functions below: its gradient (always), and for ds4_adamw_update_ranges its
 * parameters, moments and update coefficients. */
typedef struct ds4_optim_range {
    float *g;
    float *p, *m, *v;
    int64_t n;
    ds4_adamw_coefs c;
} ds4_optim_range;

/* A piece of at most DS4_OPTIM_CHUNK elements of one range: the unit of work of one task. */
typedef struct ds4_optim_chunk {
    size_t range;
    int64_t begin, n;
} ds4_optim_chunk;

/* Σ g[i]² over n elements in double (the per-chunk sum of ds4_grad_global_norm). */
double ds4_optim_sumsq(const float *g, int64_t n);

/* Number of chunks the ranges split into, and the split itself (chunks: that many entries). Empty ranges give
 * no chunk. */
int64_t ds4_optim_chunk_count(const ds4_optim_range *r, size_t n);
void ds4_optim_make_chunks(const ds4_optim_range *r, size_t n, ds4_optim_chunk *chunks);

/* A device step's working copy (ops.h's ds4_a_adamw wcast, cast_params): where each of the n pieces it steps writes
 * its copy, through the cast table e [ne] of the master's region (elements counted from po; the copy in mdt), into w
 * [n], and the table's runs that no piece steps into rest (at most cap; their count in *nrest), which a cast_params
 * pass writes. 0: the update cannot write its pieces' copy (a piece across two entries, a byte offset off its element
 * size, a dtype other than fp32 / bf16, rest too small); the whole table is then cast after the update. Pieces and
 * entries ascend. optim.c. */
struct ds4_cast_entry;
struct ds4_optim_piece;
struct ds4_optim_wcast;
int ds4_optim_piece_casts(const struct ds4_cast_entry *e, int64_t ne, ds4_dtype mdt, const struct ds4_optim_piece *pc,
                          int64_t n, int64_t po, struct ds4_optim_wcast *w, struct ds4_cast_entry *rest, int64_t cap,
                          int64_t *nrest);

/* The multi-tensor functions take the chunks of (r, n) and a pool; with pool == NULL (or chunks == NULL) they
 * run serially on the same chunking, so the results are the same bits. */

/* Global gradient 2-norm: sqrt(Σ_tensors ‖g_t‖²), accumulated in double — torch's "2-norm of the per-tensor
 * 2-norms" without its intermediate fp32 roundings. Sums of squares are added per chunk, then chunk sums in
 * chunk order. sumsq: if not NULL, each range's sum of squares. partial: n_chunks doubles of scratch (only
 * with a pool). */
double ds4_grad_global_norm(const ds4_optim_range *r, size_t n, const ds4_optim_chunk *chunks, int64_t n_chunks,
                            double *partial, double *sumsq, ds4_pool *pool);
/* torch.nn.utils.clip_grad_norm_'s coefficient: fp32 (1 / (total + 1e-6)) · clip (torch computes
 * max_norm / t as t.reciprocal() * max_norm), clamped to 1. 1 when clip <= 0 (clipping off). */
float ds4_grad_clip_coef(double total_norm, double clip);
/* g *= coef over every range (a no-op when coef == 1, as multiplying by 1 is exact). */
void ds4_grad_scale(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks, int64_t n_chunks,
                    ds4_pool *pool);
/* clip_grad_norm_: the global norm (returned), then the gradients scaled by ds4_grad_clip_coef (in *coef_out
 * when not NULL). */
double ds4_grad_clip(const ds4_optim_range *r, size_t n, double clip, const ds4_optim_chunk *chunks,
                     int64_t n_chunks, double *partial, ds4_pool *pool, float *coef_out);
/* ds4_adamw_update of every range with its own coefficients. */
void ds4_adamw_update_ranges(const ds4_optim_range *r, size_t n, const ds4_optim_chunk *chunks, int64_t n_chunks,
                             ds4_pool *pool);
/* ds4_grad_scale by coef, then ds4_adamw_update_ranges: the same bits in one pass over memory. */
void ds4_adamw_update_ranges_scaled(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                    int64_t n_chunks, ds4_pool *pool);
/* ds4_adamw_count_nonfinite over every range (gradients scaled by coef): the total, and in *first_range the
 * first range with one (n when none). partial: [n_chunks] scratch. */
int64_t ds4_adamw_count_nonfinite_ranges(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                         int64_t n_chunks, double *partial, ds4_pool *pool, size_t *first_range);

/* What an update left, for the next step's finiteness proof without a pass over p, m, v (ds4_adamw_bounds_finite):
 * the largest |p|, |m|, |v| and -v it wrote (neg_v > 0: some v < 0, which only a loaded state can give). Maxima,
 * so the same whatever the chunk order or thread count. */
typedef struct ds4_adamw_bounds {
    float p, m, v, neg_v;
} ds4_adamw_bounds;

/* ds4_adamw_update_ranges_scaled (the same bits), also returning in *out the bounds of every element it wrote.
 * scratch: [n_chunks] (only with a pool). */
void ds4_adamw_update_ranges_bounded(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                     int64_t n_chunks, ds4_adamw_bounds *scratch, ds4_pool *pool,
                                     ds4_adamw_bounds *out);
/* g *= coef (written back when coef != 1), then ds4_adamw_update on p, m, v (the same bits as the two apart), in one
 * pass; the bounds of what it wrote to *bnd when bnd is not NULL. */
void ds4_adamw_update_bounded(const ds4_adamw_coefs *c, float coef, float *p, float *g, float *m, float *v, int64_t n,
                              ds4_adamw_bounds *bnd);
/* 1 when an update with coefficients c of elements with |p| <= b->p, |m| <= b->m, 0 <= v <= b->v and a gradient of
 * |g| <= gmax multiplied by coef surely leaves every p, m and v finite (then ds4_adamw_count_nonfinite would return
 * 0); 0 when these scalars cannot show it (the count must run). Reads no element. */
int ds4_adamw_bounds_finite(const ds4_adamw_coefs *c, float coef, double gmax, const ds4_adamw_bounds *b);
/* always = 1: every step of a runs the exact finiteness pass (ds4_adamw_count_nonfinite over p, g, m, v), as
 * before the bounds existed; 0 (the default): the bounds skip it when they can. The bits of every result are the
 * same either way (tests compare the two). */
void ds4_adamw_set_exact_check(ds4_adamw *a, int always);

const ds4_adamw_options *ds4_adamw_get_options(const ds4_adamw *a);

#endif
