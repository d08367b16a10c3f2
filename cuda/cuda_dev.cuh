// cuda_dev.cuh — the CUDA backend's internals, shared by its operation files (cuda_*.cu).
//
// The backend implements the operation table of core/ops.h over device memory on one stream. Contract with the
// schedule (docs/design.md):
//   - Every launch is checked; a failure is recorded in the backend's sticky error with the operation's name, its
//     shapes and the CUDA error string (ds4_dev_fail). Errors of a kernel that faults while running surface at the
//     next synchronising call (a download); DS4_CUDA_SYNC=1 synchronises after every operation so that the message
//     names the operation that faulted.
//   - Batch invariance: no kernel chooses its reduction order by the number of rows. Each output element is
//     reduced in a fixed order that depends only on the model's shapes (the GEMMs sum K in slices of 256, whose
//     partials are added in slice order whichever warp or block formed them; row reductions use a fixed block size
//     and a fixed tree), so a row's result is the same bits alone or in any batch, in a full forward or a decoding
//     step.
//   - Activations are fp32; a weight matrix is fp32 or bf16 (its wdt), accumulated in fp32.
#ifndef DS4_CUDA_DEV_CUH
#define DS4_CUDA_DEV_CUH

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

extern "C" {
#include "internal.h"
#include "ops.h"
#include "profile.h"
}
#include "cuda_backend.h"

struct cuda_dev {
    ds4_dev dev;                  // first: a ds4_dev * of this backend is a cuda_dev *
    ds4_cuda *cu;                 // device, stream, cuBLAS handle
    cudaStream_t stream;
    int device;
    int sm_count;
    size_t smem_optin;            // the largest dynamic shared memory a block may ask for
    int sync_each_op;             // DS4_CUDA_SYNC=1
    int smem_set[4];              // kernels whose dynamic shared memory limit was raised: 1, refused: -1 (the skinny
                                  // fp32 GEMM, the pipelined bf16 GEMM, the skinny fp32 GEMM on FP4, the dense
                                  // column sum)
    size_t smem_attn, smem_idx;   // the limits raised so far for attention and the indexer
    size_t smem_attn_tc, smem_bwd_tc; // the same for the bf16 mode's attention and its backward's per-query phase
    size_t smem_attn_tcb, smem_bwd_tcb; // ... and their bf16-key kernels (d = 128)
    size_t smem_kg_tc[3];         // and for its key gradients' kernels of 1, 2 and 4 queries a barrier (cuda_bwd_attn.cu)
    // scratch owned by the backend (grown, never shrunk; allocated before a pass, never inside one)
    void *scratch[5];
    size_t scratch_bytes[5];
    uint64_t scratch_gen[5];      // how many times each slot has grown (its contents gone each time)
    int *counters;
    size_t ncounters;
    int32_t *host_err;            // pinned: per-row status words of the sampler
    size_t host_err_n;
    // recorded passes (CUDA graphs), keyed by the schedule; a record holds scratch addresses, so moving the scratch
    // (generation++) retires every record
    struct graph_entry {
        uint64_t key, generation, used;
        cudaGraphExec_t exec;
    } graphs[16];
    uint64_t generation, clock;
    int graphs_on;                // DS4_CUDA_GRAPHS=0 switches recording off
    int64_t skinny_rows;          // GEMMs of at most this many rows may take the skinny kernels (DS4_CUDA_SKINNY_ROWS)
    int gemm_pipe;                // the pipelined GEMM's shape (DS4_CUDA_GEMM_PIPE; cuda_gemm.cu): never changes a bit
    int cc;                       // compute capability, major·10 + minor (90: H100, H200)
    int gemm_wgmma;               // the bf16 products on wgmma (cuda_gemm_wgmma.cu) where the device has it: 1 (default:
                                  // on, not yet prepared), 2 (prepared), 0 with DS4_CUDA_GEMM_WGMMA=0 (the mma.sync
                                  // pipeline, whose bits it gives), -1 refused (another device, or its shared memory
                                  // limit could not be raised)
    int dw_wgmma;                 // the experts' weight gradients on wgmma where it is ready (0 with
                                  // DS4_CUDA_DW_WGMMA=0: the pipelined kernel, the same bits)
    void *tmap_encode;            // the driver's cuTensorMapEncodeTiled (the wgmma kernel's operand descriptions)
    int hc_ref;                   // DS4_CUDA_HC_REF=1: the mHC kernels whose bits the faster ones give, forward
                                  // (cuda_hc.cu) and backward (cuda_bwd_hc_moe.cu); the tests compare the two
    int bwd_ref;                  // DS4_CUDA_BWD_REF=1: the backward products' reference paths, whose bits the fast
                                  // ones give (cuda_bwd_linear.cu: the expert products through the tiles, every
                                  // dense product rounding its own operands; the tests compare the two)
    int row_ref;                  // DS4_CUDA_ROW_REF=1: the row ops' reference kernels, whose bits the faster ones give
                                  // (cuda_head.cu: logprobs as two kernels, max and argmax by one thread;
                                  // cuda_rows.cu: rmsnorm's loop); test_cuda_row_bits compares the two
    int row_blocks;               // DS4_CUDA_ROW_BLOCKS=B > 0: the vocabulary row kernels (logprobs, ce_rows)
                                  // run B blocks an SM, each looping over rows (fewer rows in flight: a
                                  // row's second and third passes may then hit L2); 0 (default): a block per row. A
                                  // tuning knob, not a numerical one: a row's arithmetic is the same whichever block
                                  // takes it
    // A bf16 copy of a product's dy [rows, cols] (row stride ld) at the start of scratch slot `slot`: the operand the
    // last linear_bwd_x rounded into slot 1, so that a linear_bwd_w told dy_kept (ops.h) need not round it again, or
    // the logits' gradient a logp_bwd told dl16 formed in slot 4 for the linear_bwd_x that follows; src NULL: none.
    // sgen: the slot's scratch_gen then (the slot has not moved while they are equal; cuda_bwd_linear.cu).
    struct kept_bf16 {
        const float *src;
        int64_t rows, cols, ld;
        int slot;
        uint64_t sgen;
        bool unwritten;           // src itself was never written (logp_bwd told dl16): the copy is all there is
    } bwd_dy;
    // The x of the last bf16 linear_bwd_w_grouped, transposed by its groups in scratch slot 1 (cuda_gemm.cu,
    // ds4_cuda_grouped_dw_bf16), for the next one told x_kept (ops.h); x NULL: none.
    struct kept_groups {
        const float *x;
        int64_t rows, K, O, E;
        const int64_t *off;
        int wg;                  // the wgmma kernel's layout (64-aligned groups), else the pipelined kernel's
        uint64_t generation;
    } bwd_xT;
    // The forward's bf16 copy of a product's x in scratch slot 2 (cuda_gemm.cu: launch_wgmma's k32 layout or
    // x_to_bf16's), for the next product told x_kept (ops.h): reused where its x, shape and layout match and nothing
    // has asked for slot 2 since (slot2_uses, counted by ds4_cuda_scratch); x NULL: none.
    struct kept_x {
        const float *x;
        int64_t ldx, gx, M, K, G, ld;
        int k32;
        uint64_t uses;
        void *buf;
    } fwd_x;
    uint64_t slot2_uses;
    const float *y_unwritten;     // the y a product left unwritten for the next product, which must take its bf16 copy
                                  // from fwd_x (cuda_gemm.cu, ops.h's y16_only); NULL: none
    // An open run of linear_bwd_w products (ops.h: run) summed apart in scratch slot 3 for a dW off a 16-byte
    // boundary (cuda_bwd_linear.cu): its dW and shape, and slot 3's block it was begun in; dW NULL: none open.
    struct dw_run_state {
        float *dW;
        int64_t O, K;
        void *sum;
    } dw_run;
    int attn_ref;                 // DS4_CUDA_ATTN_REF=1: the bf16 attention's and its backward's reference kernels
                                  // (cuda_attn_tc.cuh, cuda_bwd_attn.cu), whose bits the pipelined ones give
    graph_entry *recording;
};

static inline cuda_dev *cdev(ds4_dev *d) { return reinterpret_cast<cuda_dev *>(d); }

// Check the launch just made; record a failure naming the operation and its shapes. Returns true on success.
bool ds4_cuda_launched(ds4_dev *d, const char *op, const char *fmt, ...) DS4_PRINTF(3, 4);
// Device scratch of at least `bytes`, or NULL (failure recorded) — for operations that need temporary memory. Slot
// 0 is the GEMMs' (slice partials); slot 1 an operation's own temporaries, which may then call a GEMM; slot 2 the
// GEMMs' bf16 copy of x (the pipelined kernel's operand); slot 3 a run of weight-gradient products (dw_run); slot 4
// the logits' gradient kept in bf16 for the head's products (logp_bwd's dl16, bwd_dy).
void *ds4_cuda_scratch(ds4_dev *d, size_t bytes, const char *op, int slot);
// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) · Wᵀ with fp32 W [N, K]: the batch-invariant GEMM of
// cuda_gemm.cu, for operations that contain a product (the mHC mixing logits).
void ds4_cuda_gemm_f32(ds4_dev *d, const char *op, float *y, int64_t ldy, const float *x, int64_t ldx, const float *W,
                       int64_t M, int64_t K, int64_t N);
// The same product of x with row r scaled by rs[r] (x·rs[r] rounded to fp32 as it is read: the bits of the product of a
// scaled copy of x), where the narrow fp32 kernel runs: ds4_cuda_gemm_f32_rowscale_ok (N <= 32 columns, rows enough
// for the tiled kernels; elsewhere the caller scales a copy and calls ds4_cuda_gemm_f32).
bool ds4_cuda_gemm_f32_rowscale_ok(ds4_dev *d, int64_t M, int64_t N);
void ds4_cuda_gemm_f32_rowscaled(ds4_dev *d, const char *op, float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const float *rs, const float *W, int64_t M, int64_t K, int64_t N);
// dst [groups, rows, cols] (row stride ldd, groups one after another) = src (row stride lds, group stride gs) rounded
// to bf16 to nearest even, the rounding of every bf16 product's activation operand.
bool ds4_cuda_rows_to_bf16(ds4_dev *d, const char *op, __nv_bfloat16 *dst, int64_t ldd, const float *src, int64_t lds,
                           int64_t gs, int64_t groups, int64_t rows, int64_t cols);
// dx [rows, K] (+)= dy [rows, O]·W_e over the rows [off[e], off[e+1]) of each expert e, bf16 W [E, O, K] (W_e =
// W + e·wstride): the backward tiles' bits through the forward's grouped GEMM (cuda_gemm.cu).
void ds4_cuda_grouped_dx_bf16(ds4_dev *d, const char *op, float *dx, int acc, const float *dy, const void *W,
                              int64_t rows, int64_t O, int64_t K, const int64_t *off, int64_t E, int64_t wstride);
// dW_e [O, K] += dyᵀ·x over the rows [off[e], off[e+1]) (dW_e = dW + e·wstride), bf16: the backward tiles' bits
// through the pipelined GEMM on operands transposed by groups; false (nothing done) where that kernel cannot run.
// x_kept: x as the call just before had it (ops.h); its transposed copy is reused where it is still in scratch.
bool ds4_cuda_grouped_dw_bf16(ds4_dev *d, const char *op, float *dW, int64_t wstride, const float *dy, const float *x,
                              int64_t rows, int64_t O, int64_t K, const int64_t *off, int64_t E, int x_kept);
// The fake-quantisation q of vectors of `width` floats is one the device can do (a known format; the rotation on a
// power-of-two width); else a failure naming op is recorded (cuda_kv_qat.cu).
bool ds4_cuda_fq_shape_ok(ds4_dev *d, const char *op, int64_t width, const ds4_fq &q);
// At least n int counters that are 0 on return and that their users leave at 0 (the skinny GEMMs' tile counters).
int *ds4_cuda_counters(ds4_dev *d, size_t n, const char *op);

// ------------------------------------------------------------------------------------------ device helpers

__device__ __forceinline__ float ds4d_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float ds4d_silu(float x) { return x / (1.0f + expf(-x)); }

// Warp sums in a fixed butterfly order: every lane gets the same bits, whatever the caller's batch.
__device__ __forceinline__ double ds4d_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float ds4d_warp_sumf(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float ds4d_warp_maxf(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block sum of per-thread doubles in a fixed order (warp butterflies, then warp 0 over the warp sums). `sh` holds
// one double per warp. Every thread gets the total; ends with a barrier.
__device__ __forceinline__ double ds4d_block_sum(double v, double *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = ds4d_warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nw ? sh[lane] : 0.0;
        t = ds4d_warp_sum(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    const double t = sh[0];
    __syncthreads();
    return t;
}

// ds4d_block_sum's bits for a block of 32·nw threads (nw <= NW) played by one warp: lane l holds part[v], the sum of
// thread l + 32v. Each played warp's shuffle tree, then the tree over their sums that warp 0 of the block would run
// (lanes past nw adding 0). Every lane gets the total.
template <int NW>
__device__ __forceinline__ double ds4d_played_block_sum(const double (&part)[NW], int nw) {
    double t = 0.0;
#pragma unroll
    for (int v = 0; v < NW; v++) {
        if (v >= nw) break;
        const double s = ds4d_warp_sum(part[v]);
        if ((int)(threadIdx.x & 31) == v) t = s;
    }
    return ds4d_warp_sum(t);
}

// Thread t of a block of NT threads visits the values z[v] of a row, v = t, t + NT, t + 2·NT, .. < V, in that order
// (the order of its share of a row reduction), calling use(v, z[v]). U loads are issued before the first use of a
// round, and the uses of a round are unrolled: a row op is otherwise one dependent load-exp-add per element, bound
// by memory latency. The order of the uses (so every sum they make) is that of the plain loop.
template <int NT, int U, class F>
__device__ __forceinline__ void ds4d_row_visit(const float *z, int64_t V, F &&use) {
    for (int64_t v0 = threadIdx.x; v0 < V; v0 += (int64_t)U * NT) {
        float zz[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t v = v0 + (int64_t)u * NT;
            zz[u] = v < V ? z[v] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t v = v0 + (int64_t)u * NT;
            if (v < V) use(v, zz[u]);
        }
    }
}

// e^(z - mx) of a row's softmax, as a double for the double sums. e32 (ops.h's exp32, the bf16 mode): expf (within 2
// ulp) of the exact difference rounded once to fp32; else exp in double (the CPU's form). Every kernel at the
// vocabulary end forms it here (cuda_head.cu's row_stats, the logits' gradient in cuda_bwd_linear.cu), so a
// rollout's log-probabilities and training's stay the same bits.
__device__ __forceinline__ double ds4d_row_exp(float z, float mx, bool e32) {
    return e32 ? (double)expf(__fsub_rn(z, mx)) : exp((double)z - mx);
}

// dst[c] = f(src[c]) for c < D by the threads of one block: 16 bytes at a time where D and both rows allow it, else
// one by one. Each element's arithmetic is f either way.
template <class F>
__device__ __forceinline__ void ds4d_row_map(float *dst, const float *src, int64_t D, F &&f) {
    if ((D & 3) == 0 && (((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
        const float4 *s4 = (const float4 *)src;
        float4 *d4 = (float4 *)dst;
        for (int64_t c = threadIdx.x; c < D / 4; c += blockDim.x) {
            float4 v = s4[c];
            v.x = f(v.x), v.y = f(v.y), v.z = f(v.z), v.w = f(v.w);
            d4[c] = v;
        }
    } else {
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x) dst[c] = f(src[c]);
    }
}

__device__ __forceinline__ float ds4d_block_maxf(float v, float *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = ds4d_warp_maxf(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? sh[lane] : -INFINITY;
        t = ds4d_warp_maxf(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    const float t = sh[0];
    __syncthreads();
    return t;
}

// RMSNorm factor 1 / sqrt(mean(x²) + eps) of `n` values computed from a sum of squares in double, as the CPU does.
__device__ __forceinline__ float ds4d_rms_inv(double ss, int64_t n, double eps) {
    return (float)(1.0 / sqrt(ss / (double)n + eps));
}

// Interleaved RoPE of the trailing 2·half channels of a vector of width `width` (sign -1: inverse rotation).
__device__ __forceinline__ void ds4d_rope_pair(float *p, const float *cs, int64_t i, int sign) {
    const float c = cs[2 * i], s = sign * cs[2 * i + 1];
    const float a = p[2 * i], b = p[2 * i + 1];
    p[2 * i] = a * c - b * s;
    p[2 * i + 1] = b * c + a * s;
}

// Launch geometry helpers.
// Blocks of a kernel that loops `for (r = blockIdx.x; r < rows; r += gridDim.x)` over the rows of a vocabulary-wide
// row op (cuda_dev.row_blocks).
static inline unsigned ds4_vocab_grid(const cuda_dev *cd, int64_t rows) {
    const int64_t b = cd->row_blocks > 0 && !cd->row_ref ? (int64_t)cd->row_blocks * cd->sm_count : rows;
    return (unsigned)(b < rows ? b : rows);
}
static inline unsigned ds4_blocks(int64_t n, int threads) {
    const int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 0x7fffffff ? 0x7fffffff : b));
}

// The operations, by file.
#define DS4_CUDA_OP(name) void ds4_cuda_##name(ds4_dev *d, const ds4_a_##name *a);
DS4_CUDA_OP(embed) DS4_CUDA_OP(hc_pre) DS4_CUDA_OP(hc_post) DS4_CUDA_OP(hyperhead)
DS4_CUDA_OP(rmsnorm) DS4_CUDA_OP(rope) DS4_CUDA_OP(scale) DS4_CUDA_OP(fake_quant) DS4_CUDA_OP(copy_rows)
DS4_CUDA_OP(gather_rows) DS4_CUDA_OP(scatter_rows) DS4_CUDA_OP(add_rows) DS4_CUDA_OP(add_bcast)
DS4_CUDA_OP(matmul) DS4_CUDA_OP(matmul_grouped)
DS4_CUDA_OP(compress) DS4_CUDA_OP(indexer) DS4_CUDA_OP(attention) DS4_CUDA_OP(cache_commit) DS4_CUDA_OP(record_picks)
DS4_CUDA_OP(route) DS4_CUDA_OP(count_loads) DS4_CUDA_OP(moe_sort) DS4_CUDA_OP(moe_weigh) DS4_CUDA_OP(swiglu)
DS4_CUDA_OP(moe_combine)
DS4_CUDA_OP(ce_rows) DS4_CUDA_OP(logprobs) DS4_CUDA_OP(sample)
DS4_CUDA_OP(optim_sumsq) DS4_CUDA_OP(adamw) DS4_CUDA_OP(cast_params)
DS4_CUDA_OP(logp_bwd) DS4_CUDA_OP(linear_bwd_x) DS4_CUDA_OP(linear_bwd_w) DS4_CUDA_OP(linear_bwd_x_grouped) DS4_CUDA_OP(linear_bwd_w_grouped) DS4_CUDA_OP(norm_bwd) DS4_CUDA_OP(colsum_add) DS4_CUDA_OP(sum_streams) DS4_CUDA_OP(embed_bwd)
DS4_CUDA_OP(hc_pre_bwd) DS4_CUDA_OP(hc_post_bwd) DS4_CUDA_OP(hyperhead_bwd) DS4_CUDA_OP(swiglu_bwd) DS4_CUDA_OP(moe_dws) DS4_CUDA_OP(moe_dy) DS4_CUDA_OP(moe_sum_slots) DS4_CUDA_OP(router_bwd)
DS4_CUDA_OP(attn_bwd_q) DS4_CUDA_OP(attn_bwd_kv) DS4_CUDA_OP(attn_bwd_entry) DS4_CUDA_OP(pick_inverse)
DS4_CUDA_OP(entry_rope) DS4_CUDA_OP(comp_bwd) DS4_CUDA_OP(ikl) DS4_CUDA_OP(ikl_bwd_q) DS4_CUDA_OP(ikl_bwd_k)
#undef DS4_CUDA_OP

#endif
