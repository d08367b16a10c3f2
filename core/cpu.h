/* cpu.h — the CPU backend's internals, shared by its operation files (cpu_*.c).
 *
 * The CPU backend is the fp32 reference. Its operations split their rows (or entries, or columns) into contiguous
 * ranges run on the engine's thread pool; every output element is computed by the same scalar code whatever the
 * split, so results never depend on the thread count. Reductions that feed normalisations accumulate in double
 * (kernels_cpu.h). */
#ifndef DS4_CPU_H
#define DS4_CPU_H

#include <math.h>
#include <stdint.h>

#include "kernels_cpu.h"
#include "ops.h"
#include "sched.h"

enum {
    DS4_CPU_MAX_TASKS = 64,
    DS4_HC_TB = 8, /* tokens per block of the mHC mix logits (a small product with fn; scratch of DS4_HC_TB · n·D) */
    /* The least work of a range, in floats an item reads or writes (about a few µs): less costs less than waking a
     * thread for it and joining it again, which on many threads is most of a small op's time. */
    DS4_CPU_TASK_WORK = 16384,
};

typedef struct ds4_cpu {
    ds4_dev dev;                  /* first: a ds4_dev * of this backend is a ds4_cpu * */
    ds4_pool *pool;
    int64_t ntask;                /* ranges per parallel operation: 4 per thread, at most DS4_CPU_MAX_TASKS */
    /* private scratch, sized by reserve() */
    float *scratch;               /* [ntask, scratch_stride] per-range scratch, see cpu_dev.c */
    int64_t scratch_stride;
    int64_t key_off;              /* attention scratch: logits first, then key pointers from here */
    double *sk;                   /* [ntask, sk_stride] Sinkhorn states of the mHC backward */
    int64_t sk_stride;
    float *rinv;                  /* RMS factors of the norm backward */
    float *gemm_ws;               /* [threads, DS4_GEMM_WS_FLOATS] the matrix products' per-thread scratch */
    void *sample_ws;              /* ds4_sample's scratch, grown to the vocabulary at the first draw */
    size_t sample_bytes;
    void *mem;
    size_t bytes;
} ds4_cpu;

static inline ds4_cpu *ds4_cpu_of(ds4_dev *d) { return (ds4_cpu *)d; }

typedef void (*ds4_cpu_range_fn)(const ds4_cpu *cpu, const void *args, int64_t begin, int64_t end, int64_t task);
/* Split [0, n) into min(ntask, n) contiguous ranges on the pool; range i may use scratch slot i. */
void ds4_cpu_parallel(const ds4_cpu *cpu, int64_t n, ds4_cpu_range_fn fn, const void *args);
/* The same with ranges of at least `grain` items (one range, on the calling thread, when n < 2·grain): for cheap
 * items, where waking the pool would cost more than the work. */
void ds4_cpu_parallel_grain(const ds4_cpu *cpu, int64_t n, int64_t grain, ds4_cpu_range_fn fn, const void *args);
/* Items per range for items of `work` floats each: enough for DS4_CPU_TASK_WORK. */
static inline int64_t ds4_cpu_grain(int64_t work) {
    return work >= DS4_CPU_TASK_WORK ? 1 : DS4_CPU_TASK_WORK / (work > 0 ? work : 1);
}
/* ds4_cpu_parallel_grain with the grain of items of `work` floats: a decode step's few rows run on the calling thread
 * alone, a long sequence's on every thread. How many ranges never changes what an item computes. */
static inline void ds4_cpu_parallel_work(const ds4_cpu *cpu, int64_t n, int64_t work, ds4_cpu_range_fn fn,
                                         const void *args) {
    ds4_cpu_parallel_grain(cpu, n, ds4_cpu_grain(work), fn, args);
}
static inline float *ds4_cpu_scratch(const ds4_cpu *cpu, int64_t task) { return cpu->scratch + task * cpu->scratch_stride; }

static inline const float *ds4_rope_at(const ds4_rope_table *t, int64_t pos) { return t->cs + pos * 2 * t->half; }
static inline float ds4_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The mHC residual mix of one token: from the comb logits (mix logits 2n.., scaled by sc2, plus base), row softmax,
 * +eps, column-normalise, then (iters-1) × (row, column), in fp64 → M [n, n]. With `tape` (room for
 * (2·iters + 1)·n·n doubles) the states before each normalisation step are kept for the backward: state 0 is
 * softmax + eps, state k (k = 1 .. 2·iters-1) the result of step k (odd k: column, even k: row), and the plain
 * softmax at offset 2·iters·n·n. */
void ds4_hc_sinkhorn(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base, double *M,
                     double *tape);
/* The same for DS4_HC_SB tokens at once, without tape: token s's comb logits at logits[s], its M into M[s] [n, n]
 * (M NULL: not kept) and rounded to fp32 into comb[s] (comb NULL: not kept). Each token's operations are
 * ds4_hc_sinkhorn's in its order (the normalisation steps run on the tokens side by side as vector lanes, one IEEE
 * operation per lane), so the same bits; the steps of one token form a chain of dependent divisions, which the
 * lanes overlap. For n·n <= DS4_HC_LANES_SQ (n <= 8; its arrays live on the caller's stack, a few kB: callers take
 * ds4_hc_sinkhorn beyond). */
enum { DS4_HC_SB = 4, DS4_HC_LANES_SQ = 64 };
void ds4_hc_sinkhorn_lanes(const ds4_config *c, const float *const logits[DS4_HC_SB], float sc2, const float *comb_base,
                           double *const M[DS4_HC_SB], float *const comb[DS4_HC_SB]);
/* The comb part of hc_pre's backward for one token: the Sinkhorn again onto `tape` ((2·iters + 1)·n·n doubles), the
 * gradient of the comb dcomb [n, n] back through every normalisation and the row softmax, into dz [n, n]: the
 * gradient of the scaled comb logits (the +eps passes it), rounded to fp32; dz64 (NULL: not kept) the same before
 * the rounding (the tests compare those bits). */
void ds4_hc_sinkhorn_bwd(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base,
                         const float *dcomb, float *dz, double *dz64, double *tape);
/* The same for DS4_HC_SB tokens side by side as vector lanes (n·n <= DS4_HC_LANES_SQ), each lane the one-token
 * code's IEEE operations in its order, so the same bits. tape: DS4_HC_SB·(2·iters + 1)·n·n doubles, 32-byte
 * aligned. */
void ds4_hc_sinkhorn_bwd_lanes(const ds4_config *c, const float *const logits[DS4_HC_SB], float sc2,
                               const float *comb_base, const float *const dcomb[DS4_HC_SB], float *const dz[DS4_HC_SB],
                               double *const dz64[DS4_HC_SB], double *tape);
/* Router score s(x) for one logit (sqrt-softplus, sigmoid; softmax is per row). */
float ds4_score(ds4_score_func sf, float x);

/* The operations, by file. */
void ds4_cpu_embed(ds4_dev *d, const ds4_a_embed *a);
void ds4_cpu_hc_pre(ds4_dev *d, const ds4_a_hc_pre *a);
void ds4_cpu_hc_post(ds4_dev *d, const ds4_a_hc_post *a);
void ds4_cpu_hyperhead(ds4_dev *d, const ds4_a_hyperhead *a);
void ds4_cpu_hc_pre_bwd(ds4_dev *d, const ds4_a_hc_pre_bwd *a);
void ds4_cpu_hc_post_bwd(ds4_dev *d, const ds4_a_hc_post_bwd *a);
void ds4_cpu_hyperhead_bwd(ds4_dev *d, const ds4_a_hyperhead_bwd *a);

void ds4_cpu_rmsnorm(ds4_dev *d, const ds4_a_rmsnorm *a);
void ds4_cpu_rope(ds4_dev *d, const ds4_a_rope *a);
void ds4_cpu_scale(ds4_dev *d, const ds4_a_scale *a);
void ds4_cpu_fake_quant(ds4_dev *d, const ds4_a_fake_quant *a);
void ds4_cpu_copy_rows(ds4_dev *d, const ds4_a_copy_rows *a);
void ds4_cpu_gather_rows(ds4_dev *d, const ds4_a_gather_rows *a);
void ds4_cpu_scatter_rows(ds4_dev *d, const ds4_a_scatter_rows *a);
void ds4_cpu_add_rows(ds4_dev *d, const ds4_a_add_rows *a);
void ds4_cpu_add_bcast(ds4_dev *d, const ds4_a_add_bcast *a);
void ds4_cpu_norm_bwd(ds4_dev *d, const ds4_a_norm_bwd *a);
void ds4_cpu_colsum_add(ds4_dev *d, const ds4_a_colsum_add *a);
void ds4_cpu_sum_streams(ds4_dev *d, const ds4_a_sum_streams *a);

void ds4_cpu_matmul(ds4_dev *d, const ds4_a_matmul *a);
void ds4_cpu_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a);
void ds4_cpu_linear_bwd_x(ds4_dev *d, const ds4_a_linear_bwd_x *a);
void ds4_cpu_linear_bwd_w(ds4_dev *d, const ds4_a_linear_bwd_w *a);
void ds4_cpu_linear_bwd_x_grouped(ds4_dev *d, const ds4_a_linear_bwd_x_grouped *a);
void ds4_cpu_linear_bwd_w_grouped(ds4_dev *d, const ds4_a_linear_bwd_w_grouped *a);

void ds4_cpu_compress(ds4_dev *d, const ds4_a_compress *a);
void ds4_cpu_indexer(ds4_dev *d, const ds4_a_indexer *a);
void ds4_cpu_attention(ds4_dev *d, const ds4_a_attention *a);
void ds4_cpu_cache_commit(ds4_dev *d, const ds4_a_cache_commit *a);
void ds4_cpu_record_picks(ds4_dev *d, const ds4_a_record_picks *a);
void ds4_cpu_ikl(ds4_dev *d, const ds4_a_ikl *a);
void ds4_cpu_attn_bwd_q(ds4_dev *d, const ds4_a_attn_bwd *a);
/* The bf16 mode's attention on the CPU (bf16_in, ops.h): floats per range of rounded operands for key lists of up to
 * nkeys keys, and the rounding itself (dst may be src; keys[] repointed at copies in kb [nk, d]). */
size_t ds4_cpu_attn_bf16_stride(const ds4_config *c, int64_t nkeys);
void ds4_cpu_round_bf16(float *dst, const float *src, int64_t n);
void ds4_cpu_round_keys(const float **keys, int64_t nk, int64_t d, float *kb);
void ds4_cpu_attn_bwd_kv(ds4_dev *d, const ds4_a_attn_bwd *a);
void ds4_cpu_attn_bwd_entry(ds4_dev *d, const ds4_a_attn_bwd *a);
void ds4_cpu_pick_inverse(ds4_dev *d, const ds4_a_pick_inverse *a);
void ds4_cpu_entry_rope(ds4_dev *d, const ds4_a_entry_rope *a);
void ds4_cpu_comp_bwd(ds4_dev *d, const ds4_a_comp_bwd *a);
void ds4_cpu_ikl_bwd_q(ds4_dev *d, const ds4_a_ikl_bwd *a);
void ds4_cpu_ikl_bwd_k(ds4_dev *d, const ds4_a_ikl_bwd *a);

void ds4_cpu_route(ds4_dev *d, const ds4_a_route *a);
void ds4_cpu_count_loads(ds4_dev *d, const ds4_a_count_loads *a);
void ds4_cpu_moe_sort(ds4_dev *d, const ds4_a_moe_sort *a);
void ds4_cpu_moe_weigh(ds4_dev *d, const ds4_a_moe_weigh *a);
void ds4_cpu_swiglu(ds4_dev *d, const ds4_a_swiglu *a);
void ds4_cpu_moe_combine(ds4_dev *d, const ds4_a_moe_combine *a);
void ds4_cpu_swiglu_bwd(ds4_dev *d, const ds4_a_swiglu_bwd *a);
void ds4_cpu_moe_dws(ds4_dev *d, const ds4_a_moe_dws *a);
void ds4_cpu_moe_dy(ds4_dev *d, const ds4_a_moe_dy *a);
void ds4_cpu_moe_sum_slots(ds4_dev *d, const ds4_a_moe_sum_slots *a);
void ds4_cpu_router_bwd(ds4_dev *d, const ds4_a_router_bwd *a);

void ds4_cpu_ce_rows(ds4_dev *d, const ds4_a_ce_rows *a);
void ds4_cpu_logprobs(ds4_dev *d, const ds4_a_logprobs *a);
void ds4_cpu_sample(ds4_dev *d, const ds4_a_sample *a);
void ds4_cpu_logp_bwd(ds4_dev *d, const ds4_a_logp_bwd *a);
void ds4_cpu_embed_bwd(ds4_dev *d, const ds4_a_embed_bwd *a);
/* cpu_optim.c: the optimizer's operations (optim.c runs its own threaded loops on the CPU; these are the definitions
 * the CUDA versions are tested against) */
void ds4_cpu_optim_sumsq(ds4_dev *d, const ds4_a_optim_sumsq *a);
void ds4_cpu_adamw(ds4_dev *d, const ds4_a_adamw *a);
void ds4_cpu_cast_params(ds4_dev *d, const ds4_a_cast_params *a);

#endif
