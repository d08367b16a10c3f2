// cuda_gemm.cu — y = x Wᵀ on the GPU (matmul, column-grouped / batched, row-grouped by expert), batch-invariant.
//
// Every output element is reduced over K in ONE fixed order that depends on K alone, never on M, the tile it falls
// in, or which kernel variant runs; so a row gives the same bits alone, in a batch, in a prefill or in a decoding
// step. The order: K is cut into slices of KSLICE = 256; each slice's partial sum starts from 0 and is accumulated
// in k order; the output is 0 + P0 + P1 + ... in slice order (fp32 adds). Within a slice:
//   fp32 weights: fmaf over k = s·256 .. s·256+255 sequentially (chunks of 16 padded with zeros past K).
//   bf16 weights: x is rounded to bf16 (round-to-nearest-even) and the products accumulate in fp32 on the tensor
//     cores (mma.sync m16n8k16) over the slice's chunks of 32 in order (zero padded). Within a chunk, thread (g, t)
//     of a warp holds the 8 consecutive k's 8t..8t+7 of its row and column; the first mma takes 8t..8t+3 into its
//     k-slots (2t, 2t+1, 2t+8, 2t+9), the second 8t+4..8t+7. Every kernel feeds the tensor cores through
//     ds4d_mma_k32 (cuda_tile.cuh) with that mapping, so the sums they do are the same sums.
// The fixed slices are what lets few-row products (decoding) spread one output's K over many warps — each computes
// the partials of its slices, the last to finish adds them in slice order — without changing a bit.
// Kernels: tiled ones through shared memory for many rows (fp32 outputs of at most 32 columns: a narrow one, which
// may scale x's rows as it reads them, and at most 24 over aligned rows its cp.async-staged twin); for bf16
// products that fill the GPU, a pipelined one (cp.async stages) over a bf16 copy of x made first (rows_to_bf16: the
// same rounding every kernel applies as it reads x); "skinny" ones for at most 16 rows, one warp (bf16) or one block
// (fp32) per (column tile, slice), streaming W from global memory; on a device of compute capability 9.0 the products
// the pipelined kernel would take go to Hopper's wgmma instead (cuda_gemm_wgmma.cu: the same k-slots, so the same
// bits). bench/bench_gemm_gpu times them against cuBLAS.
#include <cstdio>
#include <cstring>

#include "cuda_dev.cuh"
#include "fp4.h"
#include "cuda_fp4.cuh"
#include "cuda_tile.cuh"
#include "cuda_gemm_wgmma.cuh"

namespace {

constexpr int KSLICE = 256;

struct gemm_args {
    float *y;
    int64_t ldy;
    const float *x;
    int64_t ldx;
    const void *W;
    int64_t ldw;                  // = K
    int64_t M, N, K;
    int64_t gx, gy, gw;           // batched: group z reads x + z·gx, W + z·gw, writes y + z·gy (elements)
    const int64_t *off;           // row groups: rows [off[e], off[e+1]) use W + e·wstride; NULL: plain
    int64_t E, wstride;
    float *part;                  // skinny kernels with several slices: partials [groups, S, M, N]
    int64_t S;                    // slices: ceil(K / KSLICE)
    int *count;                   // skinny kernels: per output tile, the slices done (kept at 0 between uses)
    const uint8_t *ws;            // an FP4-resident W (W: its codes): its scales (cuda_fp4.cuh)
    int acc;                      // the tiled and pipelined kernels: y += the sum (formed first, added once), not y =
    const int64_t *koff;          // the pipelined kernel only: group z reduces over the koff[z+1] - koff[z] columns of
                                  // x and W from group_start(koff, z) (row-grouped reductions, transposed operands)
    const __nv_bfloat16 *xh;      // the pipelined kernel's x: x rounded to bf16 (rows_to_bf16), row stride ldxh,
    int64_t ldxh, gxh;            // group z at xh + z·gxh
    const float *rs;              // the narrow fp32 kernel only: x's row r is read as x·rs[r] rounded to fp32, the
                                  // values of a row-scaled copy of x, so the product of that copy, without the copy
    int x_kept;                   // x as the product just before had it (ops.h): its bf16 copy may be reused
    uint16_t *keep16;             // the wgmma path: x's bf16 copy in x's layout too (ops.h's keep16), written by the
                                  // k32 rounding pass; launch_wgmma clears it once written
    uint16_t *y16;                // y rounded to bf16 in y's layout too (ops.h's y16); launch_wgmma clears it once its
                                  // epilogue wrote it
    int y16_only;                 // ops.h's y16_only: y may be left unwritten, its rounded copy handed to the next
                                  // product (launch_wgmma)
};

// Where reduction group e starts in a transposed operand: 8-aligned (cp.async copies 16-byte pieces of bf16), each
// group at least its length past the previous one's start. Rows past a group's end up to the next start are never read.
__host__ __device__ __forceinline__ int64_t group_start(const int64_t *off, int64_t e) {
    return (off[e] + 7) / 8 * 8 + 8 * e;
}

// The rows [r0, r1) a block works on, and its W; false when the block has no tile (row groups are data-dependent).
template <int BM>
__device__ __forceinline__ bool block_rows(const gemm_args &a, int64_t tile, int64_t &r0, int64_t &r1, int64_t &woff) {
    if (!a.off) {
        r0 = tile * BM;
        r1 = a.M;
        woff = 0;
        return r0 < a.M;
    }
    return ds4d_group_tile<BM>(a.off, a.E, a.wstride, tile, r0, r1, woff);
}

// A skinny kernel's result for (group z, slice s, row r, column c): the partial, or y itself when K is one slice.
__device__ __forceinline__ void put(const gemm_args &a, int z, int64_t s, int64_t r, int64_t c, float v) {
    if (a.S == 1) a.y[z * a.gy + r * a.ldy + c] = v;
    else a.part[((z * a.S + s) * a.M + r) * a.N + c] = v;
}

// After a skinny block wrote its slice's partials of the output tile rows [r0, r1) x columns [c0, c1): the last block
// of the tile to finish (a counter per tile) adds the tile's partials in slice order, y = 0 + P0 + P1 + .., and resets
// the counter. Which block does it does not matter: the order of the sum is fixed.
__device__ void finish_tile(const gemm_args &a, int z, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    if (a.S == 1) return;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    int *cnt = a.count + ((int64_t)z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) last = atomicAdd(cnt, 1) == (int)a.S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int64_t nc = c1 - c0;
    for (int64_t i = threadIdx.x; i < (r1 - r0) * nc; i += blockDim.x) {
        const int64_t r = r0 + i / nc, c = c0 + i % nc;
        float v = 0;
        for (int64_t s = 0; s < a.S; s++) v += __ldcg(&a.part[((z * a.S + s) * a.M + r) * a.N + c]);
        a.y[z * a.gy + r * a.ldy + c] = v;
    }
    if (threadIdx.x == 0) *cnt = 0;
}

// ------------------------------------------------------------------------------------------ fp32

template <int BM, int BN, int TM, int TN, typename WT>
__global__ void __launch_bounds__((BM / TM) * (BN / TN)) gemm_f32_kernel(gemm_args a) {
    constexpr int BK = 16, NTH = (BM / TM) * (BN / TN);
    static_assert(KSLICE % BK == 0, "slices hold whole chunks");
    __shared__ float sA[BK][BM + 1], sB[BK][BN + 1];
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const WT W = ds4d_weight<WT>(a.W, a.ws) + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int tid = threadIdx.x, ty = tid / (BN / TN), tx = tid % (BN / TN);
    float tot[TM][TN], acc[TM][TN];
    ds4d_fma_zero(tot);
    ds4d_fma_zero(acc);
    for (int64_t k0 = 0; k0 < a.K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += NTH) {
            const int m = i / BK, kk = i % BK;
            const int64_t r = r0 + m, k = k0 + kk;
            sA[kk][m] = r < r1 && k < a.K ? x[r * a.ldx + k] : 0.0f;
        }
        for (int i = tid; i < BN * BK; i += NTH) {
            const int n = i / BK, kk = i % BK;
            const int64_t c = n0 + n, k = k0 + kk;
            sB[kk][n] = c < a.N && k < a.K ? W[c * a.ldw + k] : 0.0f;
        }
        __syncthreads();
        ds4d_fma_chunk(acc, sA, sB, ty, tx);
        __syncthreads();
        if ((k0 + BK) % KSLICE == 0 || k0 + BK >= a.K) // a slice ends: its partial joins the total
            ds4d_fma_fold(tot, acc);
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t r = r0 + ty * TM + i;
        if (r >= r1 || r - r0 >= BM) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t c = n0 + tx * TN + j;
            if (c < a.N) y[r * a.ldy + c] = tot[i][j];
        }
    }
}

// fp32, narrow outputs (N <= 32: the hyper-connections' mixing logits, T rows of n·D into (2 + n)·n columns), many
// rows. The tiled kernel's 64 x 64 tile would leave most of its columns empty and its grid one block per 64 rows; here
// 128 threads take 32 rows and all the columns: thread (ty, tx) owns rows 2ty, 2ty + 1 and columns tx + 8j (j < TN),
// x and W staged by chunks of 64 k as rows [m][k] / [n][k] (68 apart: 16-byte aligned, conflict-free float4 reads)
// in two buffers, the next chunk's loads issued before the current chunk is multiplied.
// Each output is the tiled kernel's sum: fmaf in k order within a slice, zero padded, slices added in order (a chunk
// of 64 never straddles a slice; extra zero-padded steps only turn a -0 partial into +0, which the fold's 0 + P0
// does anyway).
constexpr int NARROW_BM = 32, NARROW_BK = 64, NARROW_LD = NARROW_BK + 4;

// One staged chunk of 64 k into thread (ty, tx)'s accumulators: rows 2ty, 2ty + 1 of cA [32][LD], columns tx + 8j of
// cB [8·TN][LD], fmaf in k order.
// SCALE: each staged x value times its row's scale sc[i] first (rounded to fp32: the value the narrow kernel stages).
template <int TN, bool SCALE = false>
__device__ __forceinline__ void narrow_chunk(float (&acc)[2][TN], const float *cA, const float *cB, int ty, int tx,
                                             const float (&sc)[2] = {1.0f, 1.0f}) {
    constexpr int BK = NARROW_BK, LD = NARROW_LD;
#pragma unroll 4
    for (int kk = 0; kk < BK; kk += 4) {
        const float4 p0 = *reinterpret_cast<const float4 *>(&cA[(2 * ty) * LD + kk]);
        const float4 p1 = *reinterpret_cast<const float4 *>(&cA[(2 * ty + 1) * LD + kk]);
        float av[2][4] = {{p0.x, p0.y, p0.z, p0.w}, {p1.x, p1.y, p1.z, p1.w}};
        if (SCALE)
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int u = 0; u < 4; u++) av[i][u] = __fmul_rn(av[i][u], sc[i]);
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const float4 q = *reinterpret_cast<const float4 *>(&cB[(tx + 8 * j) * LD + kk]);
            const float bv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int i = 0; i < 2; i++) acc[i][j] = fmaf(av[i][u], bv[u], acc[i][j]);
        }
    }
}

// thread (ty, tx)'s totals into y: rows r0 + 2ty + i below rend, columns tx + 8j below N
template <int TN>
__device__ __forceinline__ void narrow_store(const gemm_args &a, float *y, const float (&tot)[2][TN], int64_t r0,
                                             int64_t rend, int ty, int tx) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t r = r0 + 2 * ty + i;
        if (r >= rend) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t c = tx + 8 * j;
            if (c < a.N) y[r * a.ldy + c] = tot[i][j];
        }
    }
}

template <int TN, typename WT>
__global__ void __launch_bounds__(128) gemm_f32_narrow(gemm_args a) {
    constexpr int BM = NARROW_BM, BK = NARROW_BK, LD = NARROW_LD, NC = 8 * TN, XL = BM * BK / 128, WL = NC * BK / 128;
    static_assert(KSLICE % BK == 0, "slices hold whole chunks");
    __shared__ __align__(16) float sA[2][BM * LD], sB[2][NC * LD];
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const WT W = ds4d_weight<WT>(a.W, a.ws) + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const int64_t rend = r1 < r0 + BM ? r1 : r0 + BM;
    // the next chunk's values wait in registers while the current one is multiplied; two buffers, one barrier
    float rx[XL], rw[WL], rsc[XL]; // rsc: the scales of the rows this thread loads (a.rs), read once
#pragma unroll
    for (int i = 0; i < XL; i++) {
        const int64_t r = r0 + (tid + i * 128) / BK;
        rsc[i] = a.rs && r < rend ? a.rs[r] : 1.0f;
    }
    auto fetch = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < XL; i++) {
            const int e = tid + i * 128, m = e / BK, kk = e % BK;
            const int64_t r = r0 + m, k = k0 + kk;
            rx[i] = r < rend && k < a.K ? (a.rs ? x[r * a.ldx + k] * rsc[i] : x[r * a.ldx + k]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < WL; i++) {
            const int e = tid + i * 128, n = e / BK, kk = e % BK;
            const int64_t k = k0 + kk;
            rw[i] = n < a.N && k < a.K ? W[n * a.ldw + k] : 0.0f;
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < XL; i++) sA[buf][((tid + i * 128) / BK) * LD + (tid + i * 128) % BK] = rx[i];
#pragma unroll
        for (int i = 0; i < WL; i++) sB[buf][((tid + i * 128) / BK) * LD + (tid + i * 128) % BK] = rw[i];
    };
    float tot[2][TN], acc[2][TN];
    ds4d_fma_zero(tot);
    ds4d_fma_zero(acc);
    fetch(0);
    stash(0);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = 0; k0 < a.K; k0 += BK, buf ^= 1) {
        const bool more = k0 + BK < a.K;
        if (more) fetch(k0 + BK);
        narrow_chunk<TN>(acc, sA[buf], sB[buf], ty, tx);
        if (more) stash(buf ^ 1);
        __syncthreads();
        if ((k0 + BK) % KSLICE == 0 || !more) // a slice ends: its partial joins the total
            ds4d_fma_fold(tot, acc);
    }
    narrow_store<TN>(a, y, tot, r0, rend, ty, tx);
}

// The narrow kernel with its loads further ahead: chunks copied by cp.async into NP_ST stages of shared memory (chunk
// c + NP_ST - 1 requested while chunk c is multiplied), so that a block keeps two chunks (28 KB at 24 columns) in
// flight instead of one in registers; the multiply is narrow_chunk on the same staged rows, so the same sums and the
// same bits. Needs x's and W's rows 16-byte aligned (pieces of 4 floats; a piece past K copies fewer bytes and
// zero-fills the rest, a row past the block's end none); fp32 W only (cp.async copies bytes, it cannot decode FP4).
// Row scales (a.rs): each thread multiplies the x values it reads from a stage by its two rows' scales (narrow_chunk's
// SCALE), the values the narrow kernel stages (x·rs rounded to fp32; zeros stay zeros, the scales being finite and
// positive). Scaling the staged rows in place instead (as before) took a fifth of the kernel's shared-memory
// wavefronts, its stores 4-way bank conflicted, in a kernel bound by shared memory (ncu: L1 84% busy): the mHC mixing
// logits of a 599M step (16 products of 8192 tokens) 3.92 -> 3.52 ms of hc_pre on an H200. (Forming each block's
// slices in blocks of their own, folded after, for 8 warps an SM instead of 4, gained nothing more: measured, dropped.)
constexpr int NP_ST = 3;

template <int TN>
__global__ void __launch_bounds__(128) gemm_f32_narrow_pipe(gemm_args a) {
    constexpr int BM = NARROW_BM, BK = NARROW_BK, LD = NARROW_LD, NC = 8 * TN;
    constexpr int XP = BM * BK / 4 / 128, WP = NC * BK / 4 / 128; // 16-byte pieces a thread copies per chunk
    static_assert(KSLICE % BK == 0, "slices hold whole chunks");
    __shared__ __align__(16) float sA[NP_ST][BM * LD], sB[NP_ST][NC * LD];
    const int64_t r0 = (int64_t)blockIdx.y * BM, rend = a.M < r0 + BM ? a.M : r0 + BM;
    const float *x = a.x, *W = static_cast<const float *>(a.W);
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const int64_t nch = (a.K + BK - 1) / BK;
    float sc[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t r = r0 + 2 * ty + i;
        sc[i] = a.rs && r < rend ? a.rs[r] : 1.0f;
    }
    auto request = [&](int64_t c) { // chunk c into stage c % NP_ST; one commit group either way
        if (c < nch) {
            const int64_t k0 = c * BK;
            float *dA = sA[c % NP_ST], *dB = sB[c % NP_ST];
#pragma unroll
            for (int i = 0; i < XP; i++) {
                const int p = tid + i * 128, m = p / (BK / 4), kq = (p % (BK / 4)) * 4;
                const int64_t r = r0 + m, k = k0 + kq, left = a.K - k;
                const int bytes = r < rend && left > 0 ? (left >= 4 ? 16 : (int)left * 4) : 0;
                ds4d_cp_async16(dA + m * LD + kq, bytes ? x + r * a.ldx + k : x, bytes);
            }
#pragma unroll
            for (int i = 0; i < WP; i++) {
                const int p = tid + i * 128, n = p / (BK / 4), kq = (p % (BK / 4)) * 4;
                const int64_t k = k0 + kq, left = a.K - k;
                const int bytes = n < a.N && left > 0 ? (left >= 4 ? 16 : (int)left * 4) : 0;
                ds4d_cp_async16(dB + n * LD + kq, bytes ? W + n * a.ldw + k : W, bytes);
            }
        }
        ds4d_cp_async_commit();
    };
    float tot[2][TN], acc[2][TN];
    ds4d_fma_zero(tot);
    ds4d_fma_zero(acc);
#pragma unroll
    for (int c = 0; c < NP_ST - 1; c++) request(c);
    for (int64_t c = 0; c < nch; c++) {
        ds4d_cp_async_wait<NP_ST - 2>(); // this thread's pieces of chunk c have landed
        __syncthreads(); // chunk c visible to all; everyone is done with chunk c - 1, whose stage the next request takes
        request(c + NP_ST - 1);
        if (a.rs) narrow_chunk<TN, true>(acc, sA[c % NP_ST], sB[c % NP_ST], ty, tx, sc);
        else narrow_chunk<TN>(acc, sA[c % NP_ST], sB[c % NP_ST], ty, tx);
        if (((c + 1) * BK) % KSLICE == 0 || c + 1 == nch) // a slice ends: its partial joins the total
            ds4d_fma_fold(tot, acc);
    }
    ds4d_cp_async_wait<0>();
    narrow_store<TN>(a, a.y, tot, r0, rend, ty, tx);
}

// fp32, at most 16 rows: one block of 256 threads per (32 columns, slice, row tile); the slice of W and x staged in
// shared memory, each thread two outputs accumulated over the slice in k order (chunks of 16, zero padded).
constexpr int F32S_COLS = 32, F32S_LD = KSLICE + 1;

template <typename WT>
__global__ void __launch_bounds__(256) gemm_f32_skinny(gemm_args a) {
    extern __shared__ float sm[];
    float *sW = sm, *sX = sm + F32S_COLS * F32S_LD; // [32][257], [16][257]
    int64_t r0, r1, woff;
    if (!block_rows<16>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z / (int)a.S;
    const int64_t s = blockIdx.z % a.S, k0 = s * KSLICE, n0 = (int64_t)blockIdx.x * F32S_COLS;
    const float *x = a.x + z * a.gx;
    const WT W = ds4d_weight<WT>(a.W, a.ws) + z * a.gw + woff;
    const int64_t kpad = ((a.K + 15) / 16) * 16, klen = (k0 + KSLICE < kpad ? k0 + KSLICE : kpad) - k0;
    for (int i = threadIdx.x; i < F32S_COLS * KSLICE; i += 256) {
        const int n = i / KSLICE, k = i % KSLICE;
        sW[n * F32S_LD + k] = n0 + n < a.N && k0 + k < a.K ? W[(n0 + n) * a.ldw + k0 + k] : 0.0f;
    }
    for (int i = threadIdx.x; i < 16 * KSLICE; i += 256) {
        const int r = i / KSLICE, k = i % KSLICE;
        sX[r * F32S_LD + k] = r0 + r < r1 && r < 16 && k0 + k < a.K ? x[(r0 + r) * a.ldx + k0 + k] : 0.0f;
    }
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * F32S_COLS; o += 256) {
        const int r = o / F32S_COLS, n = o % F32S_COLS;
        if (r0 + r >= r1 || n0 + n >= a.N) continue;
        float acc = 0;
        for (int64_t k = 0; k < klen; k++) acc = fmaf(sX[r * F32S_LD + k], sW[n * F32S_LD + k], acc);
        put(a, z, s, r0 + r, n0 + n, acc);
    }
    finish_tile(a, z, r0, r1 < r0 + 16 ? r1 : r0 + 16, n0, n0 + F32S_COLS < a.N ? n0 + F32S_COLS : a.N);
}

// ------------------------------------------------------------------------------------------ bf16

// 8 consecutive values of row r of x at k0 as bf16 words; zero outside [0, rows) × [0, K).
__device__ __forceinline__ void load_a8(const float *x, int64_t ldx, int64_t r, int64_t r1, int64_t k0, int64_t K,
                                        bool vec, uint32_t (&w)[4]) {
    float v[8];
    if (r < r1 && vec && k0 + 8 <= K) {
        const float4 p = *reinterpret_cast<const float4 *>(x + r * ldx + k0);
        const float4 q = *reinterpret_cast<const float4 *>(x + r * ldx + k0 + 4);
        v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = q.x, v[5] = q.y, v[6] = q.z, v[7] = q.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = r < r1 && k0 + i < K ? x[r * ldx + k0 + i] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = ds4d_pack_bf16(v[2 * i], v[2 * i + 1]);
}

// 8 consecutive bf16 of row c of W at k0; zero outside [0, N) × [0, K).
__device__ __forceinline__ void load_b8(const __nv_bfloat16 *W, int64_t ldw, int64_t c, int64_t N, int64_t k0,
                                        int64_t K, bool vec, uint32_t (&w)[4]) {
    if (c < N && vec && k0 + 8 <= K) {
        const uint4 p = __ldg(reinterpret_cast<const uint4 *>(W + c * ldw + k0));
        w[0] = p.x, w[1] = p.y, w[2] = p.z, w[3] = p.w;
        return;
    }
    unsigned short h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) h[i] = c < N && k0 + i < K ? __bfloat16_as_ushort(W[c * ldw + k0 + i]) : 0;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
}

// The same from an FP4-resident W, decoded (cuda_fp4.cuh); vec: the element index c·ldw + k0 is a multiple of 8 and
// the codes 4-byte aligned, so the 8 values are one word of codes under one scale.
__device__ __forceinline__ void load_b8(const ds4d_fp4w<__nv_bfloat16> &W, int64_t ldw, int64_t c, int64_t N,
                                        int64_t k0, int64_t K, bool vec, uint32_t (&w)[4]) {
    if (c < N && vec && k0 + 8 <= K) {
        ds4d_fp4_bf16x8(W, c * ldw + k0, w);
        return;
    }
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) h[i] = c < N && k0 + i < K ? W.bits(c * ldw + k0 + i) : 0u;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = h[2 * i] | (h[2 * i + 1] << 16);
}

__device__ __forceinline__ void store_tile(float *y, int64_t ldy, int64_t r, int64_t r1, int64_t c, int64_t N,
                                           const float (&acc)[4], int add) {
    const auto put1 = [&](int64_t row, int64_t col, float v) {
        float *q = y + row * ldy + col;
        *q = add ? *q + v : v;
    };
    if (r < r1) {
        if (c < N) put1(r, c, acc[0]);
        if (c + 1 < N) put1(r, c + 1, acc[1]);
    }
    if (r + 8 < r1) {
        if (c < N) put1(r + 8, c, acc[2]);
        if (c + 1 < N) put1(r + 8, c + 1, acc[3]);
    }
}

// Tiled: BM × BN per block of (BM/WM)·(BN/WN) warps, each WM × WN; chunks of 32 k staged in shared memory (bf16
// rows of 32, unpadded: free of bank conflicts, as the pipelined kernel's below) in two buffers: while the warps
// multiply the chunk in one, the next chunk's loads (issued to registers before the multiply) are stored into the
// other, so one barrier per chunk suffices (the barrier that ends chunk i also tells that nobody reads chunk i - 1's
// buffer, which chunk i + 1 overwrites).
template <int BM, int BN, int WM, int WN, typename WT>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) gemm_bf16_tiled(gemm_args a, int vec_a, int vec_b) {
    constexpr int NW = (BM / WM) * (BN / WN), NTH = NW * 32, MT = WM / 16, NT = WN / 8, LDS = 32;
    constexpr int AL = BM * 4 / NTH, BL = BN * 4 / NTH; // 8-value loads per thread and chunk
    static_assert(AL >= 1 && BL >= 1, "tile too small for the block");
    __shared__ __align__(16) __nv_bfloat16 sA[2][BM * LDS], sB[2][BN * LDS];
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const WT W = ds4d_weight<WT>(a.W, a.ws) + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    float acc[MT][NT][4], tot[MT][NT][4];
    ds4d_mma_zero(acc);
    ds4d_mma_zero(tot);
    uint32_t ra[AL][4], rb[BL][4];
    auto fetch = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < AL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            load_a8(x, a.ldx, r0 + row, r1 < r0 + BM ? r1 : r0 + BM, k0 + part * 8, a.K, vec_a, ra[i]);
        }
#pragma unroll
        for (int i = 0; i < BL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            load_b8(W, a.ldw, n0 + row, a.N, k0 + part * 8, a.K, vec_b, rb[i]);
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < AL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            *reinterpret_cast<uint4 *>(&sA[buf][row * LDS + part * 8]) =
                make_uint4(ra[i][0], ra[i][1], ra[i][2], ra[i][3]);
        }
#pragma unroll
        for (int i = 0; i < BL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            *reinterpret_cast<uint4 *>(&sB[buf][row * LDS + part * 8]) =
                make_uint4(rb[i][0], rb[i][1], rb[i][2], rb[i][3]);
        }
    };
    fetch(0);
    stash(0);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = 0; k0 < a.K; k0 += 32, buf ^= 1) {
        const bool more = k0 + 32 < a.K;
        if (more) fetch(k0 + 32);
        ds4d_mma_chunk<MT, NT, LDS>(acc, sA[buf], sB[buf], wm, wn, g, t);
        if (more) stash(buf ^ 1);
        __syncthreads();
        if ((k0 + 32) % KSLICE == 0 || !more) // a slice ends: its partial joins the total
            ds4d_mma_fold(tot, acc);
    }
    const int64_t rend = r1 < r0 + BM ? r1 : r0 + BM;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
            store_tile(y, a.ldy, r0 + wm + i * 16 + g, rend, n0 + wn + j * 8 + 2 * t, a.N, tot[i][j], a.acc);
}

// Bytes of a 16-byte piece starting at element k of a row of K bf16 values that lie inside the row.
__device__ __forceinline__ int piece_bytes(int64_t k, int64_t K) {
    const int64_t b = (K - k) * 2;
    return b <= 0 ? 0 : (b >= 16 ? 16 : (int)b);
}

// Pipelined: the tiled kernel's sums with the loads in flight several stages ahead. x comes rounded to bf16 (xh:
// rows_to_bf16, the rounding ds4d_pack_bf16 applies as the other kernels read x, so the same values), which halves
// what the stages hold and copy and takes the rounding out of the inner loop. x and W are copied by cp.async into ST
// stages of shared memory; stage c + ST - 1 is requested while stage c is multiplied, so the multiply rarely waits for
// memory. The fragments feed the tensor cores in the tiled kernel's k-slots (ds4d_mma_chunk), so every output has its
// bits. Needs 16-byte aligned rows of xh and W; a copy past K or past the rows reads fewer bytes (or none) and
// zero-fills the rest, as the tiled kernel's loads do.
// A stage holds SUB chunks of 32 k of x and W as bf16 rows of 32 ([SUB][BM][32], [SUB][BN][32]): 64-byte rows keep
// both the copies in and the fragment reads free of bank conflicts (the 8 threads of a quarter-warp touch rows r and
// r + 1 at 16-byte pieces 0..3, which 64-byte rows put in distinct banks). Each thread's copies are the same rows and
// pieces at every stage, so their addresses are formed once and advance by the stage's k; only the last stage (past
// K) works out how many bytes each copy has. SUB = 2 halves the barriers and copy issues per product.
// TS (totals in shared memory): warp tiles of 64 x 64 (4 x 8 mma tiles) read half the shared memory per product that
// 32 x 64 tiles do (each staged fragment feeds 8 or 4 products instead of 8 or 2), and a 128-row tile shares each
// staged column between two warps; but 64 x 64 accumulators take 128 registers, so the slices' totals (128 more) live
// in shared memory, each thread's in a private, conflict-free column [MT·NT float4][threads]: at a slice's end the
// thread adds its accumulators into them (0 + P0 at the first, the same fp32 adds in the same order as the register
// totals) and the last slice's sums go from the registers straight to y.
template <int BM, int BN, int WM, int WN, int ST, int SUB, bool TS>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) gemm_bf16_pipe(gemm_args a) {
    constexpr int NTH = (BM / WM) * (BN / WN) * 32, MT = WM / 16, NT = WN / 8, L = 32, KC = 32 * SUB;
    static_assert(BM * 4 % NTH == 0 && BN * 4 % NTH == 0 && ST >= 2, "each thread copies whole rows' pieces");
    static_assert(KSLICE % KC == 0, "a stage never straddles a slice");
    extern __shared__ __align__(16) char pipe_mem[];
    float4 *sT = reinterpret_cast<float4 *>(pipe_mem);                      // TS: [MT·NT][NTH], the slices' totals
    __nv_bfloat16 *sA = reinterpret_cast<__nv_bfloat16 *>(pipe_mem + (TS ? MT * NT * NTH * 16 : 0)); // [ST][SUB][BM][L]
    __nv_bfloat16 *sB = sA + ST * SUB * BM * L;                                                        // [ST][SUB][BN][L]
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const __nv_bfloat16 *x = a.xh + z * a.gxh;
    const __nv_bfloat16 *W = (const __nv_bfloat16 *)a.W + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    int64_t K = a.K;
    if (a.koff) {
        K = a.koff[z + 1] - a.koff[z];
        if (K <= 0) return; // an empty group leaves its output untouched (a sum of nothing would turn -0 into +0)
        x += group_start(a.koff, z), W += group_start(a.koff, z);
    }
    const int64_t n0 = (int64_t)blockIdx.x * BN, rend = r1 < r0 + BM ? r1 : r0 + BM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    // This thread copies piece tid & 3 (8 values) of rows tid / 4 + j·NTH/4 of each sub-chunk: their sources at
    // k = 0 and their bytes while a stage lies inside K (16, or 0 past the rows), formed once.
    constexpr int RA = BM * 4 / NTH, RB = BN * 4 / NTH, RS = NTH / 4;
    const int row0 = tid >> 2, kp = (tid & 3) * 8, soff = row0 * L + kp; // soff: within a sub-chunk's rows
    const __nv_bfloat16 *pA[RA], *pB[RB];
    int nA[RA], nB[RB];
#pragma unroll
    for (int j = 0; j < RA; j++) {
        const int64_t r = r0 + row0 + j * RS;
        nA[j] = r < rend ? 16 : 0;
        pA[j] = nA[j] ? x + r * a.ldxh + kp : x;
    }
#pragma unroll
    for (int j = 0; j < RB; j++) {
        const int64_t c = n0 + row0 + j * RS;
        nB[j] = c < a.N ? 16 : 0;
        pB[j] = nB[j] ? W + c * a.ldw + kp : W;
    }
    auto issue = [&](int st, int64_t k0) {
        __nv_bfloat16 *dA = sA + st * SUB * BM * L + soff, *dB = sB + st * SUB * BN * L + soff;
        if (k0 + KC <= K) { // the stage lies inside K: every copy whole (or none, past the rows)
#pragma unroll
            for (int u = 0; u < SUB; u++) {
#pragma unroll
                for (int j = 0; j < RA; j++)
                    ds4d_cp_async16(dA + (u * BM + j * RS) * L, pA[j] + k0 + u * 32, nA[j]);
#pragma unroll
                for (int j = 0; j < RB; j++)
                    ds4d_cp_async16(dB + (u * BN + j * RS) * L, pB[j] + k0 + u * 32, nB[j]);
            }
            return;
        }
#pragma unroll
        for (int u = 0; u < SUB; u++) { // the last stage: what lies inside K, zeros past it
            const int n = piece_bytes(k0 + u * 32 + kp, K);
#pragma unroll
            for (int j = 0; j < RA; j++) {
                const int m = nA[j] ? n : 0;
                ds4d_cp_async16(dA + (u * BM + j * RS) * L, m ? pA[j] + k0 + u * 32 : x, m);
            }
#pragma unroll
            for (int j = 0; j < RB; j++) {
                const int m = nB[j] ? n : 0;
                ds4d_cp_async16(dB + (u * BN + j * RS) * L, m ? pB[j] + k0 + u * 32 : W, m);
            }
        }
    };
    float acc[MT][NT][4], tot[TS ? 1 : MT][TS ? 1 : NT][4];
    ds4d_mma_zero(acc);
    ds4d_mma_zero(tot);
    bool folded = false; // TS: whether sT holds the totals of earlier slices
    const int64_t nst = (K + KC - 1) / KC;
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (st < nst) issue(st, (int64_t)st * KC);
        ds4d_cp_async_commit();
    }
    int cur = 0, nxt = ST - 1; // the stages of chunks kc and kc + ST - 1
    for (int64_t kc = 0; kc < nst; kc++) {
        ds4d_cp_async_wait<ST - 2>(); // this thread's copies of stage kc have landed
        __syncthreads();         // everyone's have, and nobody still reads the stage that kc + ST - 1 takes
        if (kc + ST - 1 < nst) issue(nxt, (kc + ST - 1) * KC);
        ds4d_cp_async_commit();       // (an empty group past the end keeps wait_group's count)
#pragma unroll
        for (int u = 0; u < SUB; u++)
            if (u == 0 || kc * KC + u * 32 < K) // the tiles' chunks of 32: none wholly past K
                ds4d_mma_chunk<MT, NT, L>(acc, sA + (cur * SUB + u) * BM * L, sB + (cur * SUB + u) * BN * L, wm, wn,
                                          g, t);
        if constexpr (!TS) {
            if (((kc + 1) * KC) % KSLICE == 0 || kc + 1 == nst) // a slice ends: its partial joins the total
                ds4d_mma_fold(tot, acc);
        } else if (((kc + 1) * KC) % KSLICE == 0 && kc + 1 < nst) { // a slice ends (not the last): into sT
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    float4 *q = &sT[(i * NT + j) * NTH + tid];
                    float4 v = folded ? *q : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    v.x += acc[i][j][0], v.y += acc[i][j][1], v.z += acc[i][j][2], v.w += acc[i][j][3];
                    *q = v;
                    acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
                }
            folded = true;
        }
        cur = cur + 1 == ST ? 0 : cur + 1;
        nxt = nxt + 1 == ST ? 0 : nxt + 1;
    }
    ds4d_cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int64_t r = r0 + wm + i * 16 + g, c = n0 + wn + j * 8 + 2 * t;
            if constexpr (TS) { // the last slice's sums: its partial added to the earlier totals here
                const float4 v = folded ? sT[(i * NT + j) * NTH + tid] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const float s4[4] = {v.x + acc[i][j][0], v.y + acc[i][j][1], v.z + acc[i][j][2], v.w + acc[i][j][3]};
                store_tile(y, a.ldy, r, rend, c, a.N, s4, a.acc);
            } else {
                store_tile(y, a.ldy, r, rend, c, a.N, tot[i][j], a.acc);
            }
        }
}

// dst [groups, rows, cols] (row stride ldd, group z at dst + z·rows·ldd) = src (row stride lds, group z at src + z·gs)
// rounded to bf16 to nearest even: the rounding ds4d_pack_bf16 applies as the tiles read x, so a product over the copy
// has their bits. A thread per 8 values of a row: two float4 loads and one 16-byte store where the rows are aligned
// (vs, vd), single values at a row's ragged end.
__global__ void rows_to_bf16_kernel(__nv_bfloat16 *dst, int64_t ldd, const float *src, int64_t lds, int64_t gs,
                                    int64_t rows, int64_t cols, int64_t n, int vs, int vd) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t nch = (cols + 7) / 8, zr = i / nch, c = (i - zr * nch) * 8, z = zr / rows, r = zr - z * rows;
    const float *s = src + z * gs + r * lds + c;
    __nv_bfloat16 *o = dst + zr * ldd + c;
    if (c + 8 <= cols && vs && vd) {
        const float4 p = *reinterpret_cast<const float4 *>(s), q = *reinterpret_cast<const float4 *>(s + 4);
        *reinterpret_cast<uint4 *>(o) = make_uint4(ds4d_pack_bf16(p.x, p.y), ds4d_pack_bf16(p.z, p.w),
                                                   ds4d_pack_bf16(q.x, q.y), ds4d_pack_bf16(q.z, q.w));
        return;
    }
    for (int j = 0; j < 8 && c + j < cols; j++) o[j] = __float2bfloat16_rn(s[j]);
}

// The same rounding into wgmma's k-slot order (cuda_gemm_wgmma.cu): dst's rows hold ldd = cols rounded up to 32
// values, chunk c's position 16j + 8h + 2t + e the value of column 32c + 8t + 4j + 2h + e (0 past cols). A thread per
// 8 consecutive columns 8t..8t+7 of a chunk: the 4 words it forms are words t, 4 + t, 8 + t and 12 + t of the chunk.
// keep (NULL: none): the same values also in src's layout (keep16, ops.h), where vs they go as one 16-byte store.
__global__ void rows_to_bf16_k32_kernel(uint32_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t gs,
                                        int64_t rows, int64_t cols, int64_t n, int vs, uint16_t *keep) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t nq = ldd / 8, zr = i / nq, q = i - zr * nq, c = q * 8, z = zr / rows, r = zr - z * rows;
    const float *s = src + z * gs + r * lds + c;
    float v[8];
    if (c + 8 <= cols && vs) {
        const float4 p = *reinterpret_cast<const float4 *>(s), u = *reinterpret_cast<const float4 *>(s + 4);
        v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = u.x, v[5] = u.y, v[6] = u.z, v[7] = u.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = c + j < cols ? s[j] : 0.0f;
    }
    uint32_t *o = dst + zr * (ldd / 2) + (q >> 2) * 16 + (q & 3);
    const uint32_t w0 = ds4d_pack_bf16(v[0], v[1]), w1 = ds4d_pack_bf16(v[2], v[3]);
    const uint32_t w2 = ds4d_pack_bf16(v[4], v[5]), w3 = ds4d_pack_bf16(v[6], v[7]);
    o[0] = w0, o[4] = w1, o[8] = w2, o[12] = w3;
    if (!keep || c >= cols) return;
    uint16_t *k = keep + z * gs + r * lds + c;
    if (c + 8 <= cols && vs) {
        *reinterpret_cast<uint4 *>(k) = make_uint4(w0, w1, w2, w3);
    } else {
        const uint32_t w[4] = {w0, w1, w2, w3};
        for (int j = 0; j < 8 && c + j < cols; j++) k[j] = (uint16_t)(w[j >> 1] >> (16 * (j & 1)));
    }
}

// keep16 (ops.h) where the product did not write it: element (z, r, c) of x, rounded as rows_to_bf16 rounds, at
// z·gs + r·lds + c.
__global__ void keep16_kernel(uint16_t *keep, const float *src, int64_t lds, int64_t gs, int64_t G, int64_t rows,
                              int64_t cols, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t c = i % cols, zr = i / cols, r = zr % rows, z = zr / rows, at = z * gs + r * lds + c;
    keep[at] = __bfloat16_as_ushort(__float2bfloat16_rn(src[at]));
}

// The pipelined kernel's shapes (tile, warp tile, stages, staged row length). Each gives every output the same sum
// (the same k-slots, chunks and slices), so which runs never changes a bit; the first is the default and
// DS4_CUDA_GEMM_PIPE=i picks another (bench_gemm_gpu --variants compares them).
struct pipe_cfg {
    int BM, BN, threads;
    size_t smem;
    void (*kernel)(gemm_args);
    const char *name;
};

template <int BM, int BN, int WM, int WN, int ST, int SUB, bool TS = false>
pipe_cfg pipe_of(const char *name) {
    constexpr int NTH = (BM / WM) * (BN / WN) * 32;
    return {BM, BN, NTH,
            (size_t)ST * SUB * (BM + BN) * 32 * sizeof(__nv_bfloat16) +
                (TS ? (size_t)NTH * (WM / 16) * (WN / 8) * 4 * sizeof(float) : 0),
            gemm_bf16_pipe<BM, BN, WM, WN, ST, SUB, TS>, name};
}

const pipe_cfg *pipe_cfgs(int *n) {
    static const pipe_cfg cfgs[] = {
        // the default: 64 x 64 warp tiles with the slices' totals in shared memory, two blocks per SM (255 registers
        // x 128 threads, 112 KiB each): 11-18% faster than the 64 x 128 tile of 32 x 64 warps on every
        // bench_gemm_gpu shape of 512 columns and more on an H200, the same bits (bench/RESULTS.md)
        pipe_of<128, 128, 64, 64, 3, 1, true>("128x128, 4 warps of 64x64, 3 stages of 32 k, totals in shared memory"),
        // the default before: two blocks per SM (206 registers x 128 threads, 96 KiB each), 5-10% faster than one
        // block of 8 or 16 warps
        pipe_of<64, 128, 32, 64, 4, 2>("64x128, 4 warps of 32x64, 4 stages of 64 k"),
        pipe_of<128, 128, 64, 32, 4, 2>("128x128, 8 warps of 64x32, 4 stages of 64 k"),
        pipe_of<128, 128, 32, 32, 4, 2>("128x128, 16 warps of 32x32, 4 stages of 64 k"),
        pipe_of<64, 64, 32, 32, 4, 2>("64x64, 4 warps of 32x32, 4 stages of 64 k"), // ~120 registers: 3 blocks
        pipe_of<128, 128, 64, 64, 4, 1, true>("128x128, 4 warps of 64x64, 4 stages of 32 k, totals in shared memory"),
        pipe_of<128, 256, 64, 64, 3, 1, true>("128x256, 8 warps of 64x64, 3 stages of 32 k, totals in shared memory"),
        pipe_of<256, 128, 64, 64, 3, 1, true>("256x128, 8 warps of 64x64, 3 stages of 32 k, totals in shared memory"),
    };
    *n = (int)(sizeof cfgs / sizeof *cfgs);
    return cfgs;
}

// Skinny: at most 16 rows; one warp per (8 columns, slice): the slice's 8 chunks of W loaded at once straight from
// global memory (128 bytes per lane in flight), then multiplied. WARPS warps per block side by side in N.
template <int WARPS, typename WT>
__global__ void __launch_bounds__(WARPS * 32) gemm_bf16_skinny(gemm_args a, int vec_a, int vec_b) {
    constexpr int U = KSLICE / 32;
    int64_t r0, r1, woff;
    if (!block_rows<16>(a, blockIdx.y, r0, r1, woff)) return;
    const int z = blockIdx.z / (int)a.S;
    const int64_t s = blockIdx.z % a.S;
    const float *x = a.x + z * a.gx;
    const WT W = ds4d_weight<WT>(a.W, a.ws) + z * a.gw + woff;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t nb = (int64_t)blockIdx.x * WARPS * 8, n0 = nb + warp * 8;
    const int64_t rend = r1 < r0 + 16 ? r1 : r0 + 16, k0 = s * KSLICE;
    if (n0 < a.N) { // a warp past N has no columns, but still takes part in the block's barriers below
        uint32_t ag[U][4], ag8[U][4], bw[U][4];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t k = k0 + u * 32 + t * 8;
            load_b8(W, a.ldw, n0 + g, a.N, k, a.K, vec_b, bw[u]);
            load_a8(x, a.ldx, r0 + g, rend, k, a.K, vec_a, ag[u]);
            load_a8(x, a.ldx, r0 + g + 8, rend, k, a.K, vec_a, ag8[u]);
        }
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int u = 0; u < U; u++)
            if (k0 + u * 32 < a.K) ds4d_mma_k32(acc, ag[u], ag8[u], bw[u]);
        const int64_t c = n0 + 2 * t;
        const int64_t rr[2] = {r0 + g, r0 + g + 8};
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int q = 0; q < 2; q++)
                if (rr[h] < rend && c + q < a.N) put(a, z, s, rr[h], c + q, acc[2 * h + q]);
    }
    finish_tile(a, z, r0, rend, nb, nb + WARPS * 8 < a.N ? nb + WARPS * 8 : a.N);
}

bool aligned(const void *p, size_t to) { return ((uintptr_t)p % to) == 0; }

// How a product runs, once gemm() has chosen: the skinny kernels or not, x's and W's rows 16-byte aligned (va, vb;
// for an FP4-resident W: 8-element groups of one word of codes), the grid's tiles per group of W.
struct pipe_cfg;
struct plan {
    bool skinny;
    const pipe_cfg *pipe; // the pipelined kernel's shape, or NULL
    int va, vb;
    int64_t G, cols;
};

unsigned grid_rows(const gemm_args &a, int BM) {
    const int64_t t = a.off ? (a.M + BM - 1) / BM + a.E : (a.M + BM - 1) / BM;
    return (unsigned)(t < 1 ? 1 : t);
}

// Launch the kernels of `mode` (F32: fp32 FMAs; BF16: tensor cores) reading W as FP4 ? an FP4-resident weight decoded
// to the mode's type (cuda_fp4.cuh): the same kernels, so the same sums as over the decoded values.
// Whether the pipelined 128 x 128 kernel may run: its shared memory limit is raised once per backend (a property of
// the kernel); a GPU that refuses it (less shared memory) takes the tiles.
const pipe_cfg *pipe_ready(cuda_dev *cd) {
    int n;
    const pipe_cfg *cfgs = pipe_cfgs(&n);
    const int v = cd->gemm_pipe >= 0 && cd->gemm_pipe < n ? cd->gemm_pipe : 0;
    if (!cd->smem_set[1]) {
        const cudaError_t e = cudaFuncSetAttribute(cfgs[v].kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)cfgs[v].smem);
        cd->smem_set[1] = e == cudaSuccess ? 1 : -1;
        if (e != cudaSuccess) (void)cudaGetLastError();
    }
    return cd->smem_set[1] == 1 ? &cfgs[v] : nullptr;
}

// Whether the wgmma kernel may run: a device of compute capability 9.0 (its code is sm_90a's alone), not switched
// off, its shared memory limit raised (once per backend).
bool wgmma_ready(cuda_dev *cd) {
    if (cd->gemm_wgmma == 1) {
        cudaError_t e = cudaErrorNotSupported;
        if (cd->cc == 90 && cd->smem_optin >= ds4_cuda_wgmma_smem()) e = ds4_cuda_wgmma_prepare(&cd->tmap_encode);
        if (e != cudaSuccess) (void)cudaGetLastError();
        cd->gemm_wgmma = e == cudaSuccess ? 2 : -1;
    }
    return cd->gemm_wgmma == 2;
}

// Whether BM x BN tiles fill every SM at least once.
bool full_wave(const cuda_dev *cd, const gemm_args &a, int64_t G, int BM = 128, int BN = 128) {
    return G * (int64_t)grid_rows(a, BM) * ((a.N + BN - 1) / BN) >= (int64_t)cd->sm_count;
}

template <bool FP4>
void launch(cuda_dev *cd, const gemm_args &a, ds4_dtype mode, const plan &p) {
    using WF = typename std::conditional<FP4, ds4d_fp4w<float>, const float *>::type;
    using WB = typename std::conditional<FP4, ds4d_fp4w<__nv_bfloat16>, const __nv_bfloat16 *>::type;
    const int64_t G = p.G;
    if (mode == DS4_F32 && p.skinny) {
        const size_t smem = (size_t)(F32S_COLS + 16) * F32S_LD * sizeof(float);
        int &set = cd->smem_set[FP4 ? 2 : 0];
        if (!set) /* once per backend: the limit is a property of the kernel */
            set = cudaFuncSetAttribute(gemm_f32_skinny<WF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) ==
                  cudaSuccess;
        dim3 grid(ds4_blocks(a.N, (int)p.cols), grid_rows(a, 16), (unsigned)(G * a.S));
        gemm_f32_skinny<WF><<<grid, 256, smem, cd->stream>>>(a);
    } else if (mode == DS4_F32 && a.N <= 24 && !FP4 && G == 1 && !a.off && p.va && aligned(a.W, 16) &&
               a.ldw % 4 == 0) { /* the narrow product with its loads in flight further ahead (48 KB of stages at most) */
        dim3 grid(1, grid_rows(a, NARROW_BM), 1);
        if (a.N <= 8) gemm_f32_narrow_pipe<1><<<grid, 128, 0, cd->stream>>>(a);
        else if (a.N <= 16) gemm_f32_narrow_pipe<2><<<grid, 128, 0, cd->stream>>>(a);
        else gemm_f32_narrow_pipe<3><<<grid, 128, 0, cd->stream>>>(a);
    } else if (mode == DS4_F32 && a.N <= 32) {
        dim3 grid(1, grid_rows(a, 32), (unsigned)G);
        if (a.N <= 8) gemm_f32_narrow<1, WF><<<grid, 128, 0, cd->stream>>>(a);
        else if (a.N <= 16) gemm_f32_narrow<2, WF><<<grid, 128, 0, cd->stream>>>(a);
        else if (a.N <= 24) gemm_f32_narrow<3, WF><<<grid, 128, 0, cd->stream>>>(a);
        else gemm_f32_narrow<4, WF><<<grid, 128, 0, cd->stream>>>(a);
    } else if (mode == DS4_F32) {
        dim3 grid(ds4_blocks(a.N, 64), grid_rows(a, 64), (unsigned)G);
        gemm_f32_kernel<64, 64, 4, 4, WF><<<grid, 256, 0, cd->stream>>>(a);
    } else if (p.skinny) {
        dim3 grid(ds4_blocks(a.N, (int)p.cols), grid_rows(a, 16), (unsigned)(G * a.S));
        gemm_bf16_skinny<4, WB><<<grid, 128, 0, cd->stream>>>(a, p.va, p.vb);
    } else if (p.pipe) { /* x in bf16, loads in flight several stages ahead (pipe_cfgs) */
        const dim3 grid(ds4_blocks(a.N, p.pipe->BN), grid_rows(a, p.pipe->BM), (unsigned)G);
        p.pipe->kernel<<<grid, p.pipe->threads, p.pipe->smem, cd->stream>>>(a);
    } else if (full_wave(cd, a, G)) {
        /* a full wave of 128 x 128 tiles: eight warps of 64 x 32 (twice the products per barrier and per staged
         * row of W of the 64 x 128 tile); fewer tiles than SMs: the 64 x 128 tile, twice the blocks. An
         * FP4-resident W takes the tiles: cp.async copies bytes and cannot decode them (the tiles give the
         * pipeline's bits). */
        dim3 grid(ds4_blocks(a.N, 128), grid_rows(a, 128), (unsigned)G);
        gemm_bf16_tiled<128, 128, 64, 32, WB><<<grid, 256, 0, cd->stream>>>(a, p.va, p.vb);
    } else {
        dim3 grid(ds4_blocks(a.N, 128), grid_rows(a, 64), (unsigned)G);
        gemm_bf16_tiled<64, 128, 32, 32, WB><<<grid, 256, 0, cd->stream>>>(a, p.va, p.vb);
    }
}

// x [G, M, K] (row stride ldx, group stride gx) rounded to bf16 into scratch slot 2: a.xh [G, M, ldxh], ldxh = K
// rounded up to 8 (16-byte rows).
// The copy of x that the product just before left in slot 2 (cuda_dev::fwd_x), if this product was told x_kept and it
// is the same x, shape and layout (k32: launch_wgmma's) and slot 2 has not been asked for since; else NULL.
void *kept_x(cuda_dev *cd, const gemm_args &a, int64_t G, int64_t ld, int k32) {
    const cuda_dev::kept_x &k = cd->fwd_x;
    return a.x_kept && k.x == a.x && k.ldx == a.ldx && k.gx == a.gx && k.M == a.M && k.K == a.K && k.G == G &&
                   k.ld == ld && k.k32 == k32 && k.uses == cd->slot2_uses
               ? k.buf
               : nullptr;
}

bool x_to_bf16(ds4_dev *d, const char *op, gemm_args &a, int64_t G) {
    cuda_dev *cd = cdev(d);
    const int64_t ld = (a.K + 7) / 8 * 8;
    auto *xh = (__nv_bfloat16 *)kept_x(cd, a, G, ld, 0);
    if (!xh) {
        xh = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(G * a.M * ld) * sizeof(__nv_bfloat16), op, 2);
        if (!xh || !ds4_cuda_rows_to_bf16(d, op, xh, ld, a.x, a.ldx, a.gx, G, a.M, a.K)) return false;
        cd->fwd_x = {a.x, a.ldx, a.gx, a.M, a.K, G, ld, 0, cd->slot2_uses, xh};
    }
    a.xh = xh, a.ldxh = ld, a.gxh = a.M * ld;
    return true;
}

// The wgmma kernel over `tiles` output tiles, at most a block per SM (persistent blocks). The larger operand's tiles
// change slowest (rows_fast where W's rows outnumber x's: x's tiles change fastest, and each W tile is read once,
// from L2). False, with the failure set and nothing launched, where the copy engine refused the operands'
// description; a launch error is left for the caller's ds4_cuda_launched.
bool wgmma_go(ds4_dev *d, const char *op, ds4d_wg_args &w, int64_t tiles, const char *shapes) {
    cuda_dev *cd = cdev(d);
    w.rows_fast = w.N > w.M;
    const int blocks = (int)(tiles < cd->sm_count ? tiles : cd->sm_count);
    const cudaError_t e = ds4_cuda_wgmma_launch(w, blocks, cd->stream, cd->tmap_encode);
    if (e == cudaErrorInvalidValue && cudaPeekAtLastError() == cudaSuccess) {
        ds4_dev_fail(d, DS4_ERR_CUDA, "%s: %s on wgmma: the copy engine refused the operands' description "
                     "(cuTensorMapEncodeTiled)", op, shapes);
        return false;
    }
    return true;
}

// The wgmma product (cuda_gemm_wgmma.cu): x rounded to bf16 in k32 order into scratch slot 2, then the kernel.
// y16_only (ops.h), where y is a dense [M, G·N] (groups side by side) of whole 32-column chunks and x is not a kept
// copy: the kernel writes y rounded to bf16 in k32 order into slot 2 after x's copy, as the next product's x (kept_x
// finds it there: cd->fwd_x), and y16 if asked, instead of y; cd->y_unwritten = y until that product (gemm's check).
// Saves the next product's rounding pass, which read y's fp32 values back (wo_b's over wo_a's [8192 × 8192]: 129 µs).
void launch_wgmma(ds4_dev *d, const char *op, gemm_args &a, int64_t G) {
    cuda_dev *cd = cdev(d);
    const int64_t ld = (a.K + 31) / 32 * 32, Ky = G * a.N; // Ky: the next product's K where y is its x
    auto *xk = (__nv_bfloat16 *)kept_x(cd, a, G, ld, 1);
    const size_t xbytes = ((size_t)(G * a.M * ld) * sizeof(__nv_bfloat16) + 255) / 256 * 256;
    const bool out16 = a.y16_only && !xk && !a.acc && !a.off && !a.koff && a.N % 2 == 0 && Ky % 32 == 0 &&
                       (G == 1 ? a.ldy == a.N : a.gy == a.N && a.ldy == Ky) && aligned(a.y16, 4);
    if (!xk) {
        const size_t bytes = out16 ? xbytes + (size_t)(a.M * Ky) * sizeof(__nv_bfloat16)
                                   : (size_t)(G * a.M * ld) * sizeof(__nv_bfloat16);
        xk = (__nv_bfloat16 *)ds4_cuda_scratch(d, bytes, op, 2);
        if (!xk) return;
        const int64_t n = G * a.M * (ld / 8);
        const int vs = aligned(a.x, 16) && a.ldx % 4 == 0 && a.gx % 4 == 0;
        // keep16 in x's layout: 16-byte stores where x's 8-value pieces are 16-byte aligned there too
        const int vk = vs && aligned(a.keep16, 16) && a.ldx % 8 == 0 && a.gx % 8 == 0;
        rows_to_bf16_k32_kernel<<<ds4_blocks(n, 256), 256, 0, cd->stream>>>((uint32_t *)xk, ld, a.x, a.ldx, a.gx,
                                                                             a.M, a.K, n, a.keep16 ? vk : vs, a.keep16);
        if (!ds4_cuda_launched(d, op, "operand [%lld x %lld x %lld] to bf16 in k32 order%s", (long long)G,
                               (long long)a.M, (long long)a.K, a.keep16 ? " (and kept)" : ""))
            return;
        a.keep16 = nullptr;
        cd->fwd_x = {a.x, a.ldx, a.gx, a.M, a.K, G, ld, 1, cd->slot2_uses, xk};
    }
    ds4d_wg_args w = {a.y, a.ldy, a.gy, xk, ld, a.M * ld, (const __nv_bfloat16 *)a.W, a.ldw, a.gw,
                      a.M, a.N, a.K, a.off, a.E, a.wstride, a.acc, G, 0};
    if (out16) {
        w.yk = (uint32_t *)((char *)xk + xbytes);
        w.ldyk = Ky;
        w.y16 = a.y16;
    }
    const int64_t tiles = (int64_t)ds4_blocks(a.N, DS4_WG_TILE_N) * grid_rows(a, DS4_WG_TILE_M) * G;
    char shapes[96];
    snprintf(shapes, sizeof shapes, "[%lld x %lld] x [%lld x %lld]^T", (long long)a.M, (long long)a.K, (long long)a.N,
             (long long)a.K);
    if (!wgmma_go(d, op, w, tiles, shapes)) return;
    if (!ds4_cuda_launched(d, op, "[%lld x %lld] x [%lld x %lld]^T (bf16 on wgmma, %lld groups%s%s)", (long long)a.M,
                           (long long)a.K, (long long)a.N, (long long)a.K, (long long)G, a.off ? ", by expert" : "",
                           out16 ? ", y to bf16" : ""))
        return;
    if (out16) { // y's copy is the next product's x, as launch_wgmma would have rounded it (x = y, one group)
        cd->fwd_x = {a.y, a.ldy, 0, a.M, Ky, 1, Ky, 1, cd->slot2_uses, w.yk};
        cd->y_unwritten = a.y;
        a.y16 = nullptr;
    }
}

// The skinny kernels (16 rows per block, parallel over K slices) when the tiled ones would leave most of the GPU idle:
// few rows (per group of W), or so few output tiles that the tiled grid (every expert's tiles, for grouped GEMMs) has
// fewer blocks than two per SM. Measured on an H100 (bench/RESULTS.md): at 128-256 rows the skinny kernels win 2-3x;
// at 512 and more rows they lose (they read W once per 16 rows and write K-slice partials).
bool takes_skinny(const cuda_dev *cd, const gemm_args &a, int64_t G, int64_t rows_hint) {
    const int64_t tiled_blocks = G * (int64_t)grid_rows(a, 64) * ((a.N + 127) / 128);
    return rows_hint <= 16 || (tiled_blocks < 2 * (int64_t)cd->sm_count && rows_hint <= cd->skinny_rows);
}

// Launch the variant for `rows_hint` rows per (group of) W. Which variant runs never changes the result. mode: the
// arithmetic (F32 or BF16); wdt: how W is held, mode's dtype or DS4_FP4_PACKED (codes W, scales a.ws).
void gemm(ds4_dev *d, const char *op, gemm_args &a, ds4_dtype wdt, ds4_dtype mode, int64_t groups, int64_t rows_hint) {
    cuda_dev *cd = cdev(d);
    // x16: x is the last product's y, which it left unwritten (launch_wgmma, y16_only): only its bf16 copy exists, in
    // k32 order, so this product must be the wgmma kernel's on that copy, whatever its tile count or rows (any kernel
    // gives the same bits); else it fails rather than read values never written
    const bool x16 = cd->y_unwritten && a.x == cd->y_unwritten;
    cd->y_unwritten = nullptr;
    if (a.M <= 0 || a.N <= 0) return;
    if (a.K <= 0) {
        ds4_dev_fail(d, DS4_ERR_ARG, "%s: K = %lld", op, (long long)a.K);
        return;
    }
    const bool fp4 = wdt == DS4_FP4_PACKED;
    if ((mode != DS4_F32 && mode != DS4_BF16) || (wdt != mode && !fp4)) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: weight dtype %s (F32 or BF16, or FP4-resident experts)", op,
                     ds4_wdt_name(wdt));
        return;
    }
    /* an FP4-resident W: whole 32-value blocks per row and per group (fp4.h), its scales given */
    if (fp4 && (a.K % DS4_FP4_BLOCK || a.wstride % DS4_FP4_BLOCK || a.gw % DS4_FP4_BLOCK || !a.ws)) {
        ds4_dev_fail(d, DS4_ERR_ARG, "%s: FP4-resident W [%lld x %lld] (group stride %lld): rows must be whole blocks "
                     "of %d values, with scales%s", op, (long long)a.N, (long long)a.K, (long long)a.wstride,
                     DS4_FP4_BLOCK, a.ws ? "" : " (none given)");
        return;
    }
    plan p;
    p.G = groups > 0 ? groups : 1;
    a.S = (a.K + KSLICE - 1) / KSLICE;
    p.skinny = takes_skinny(cd, a, p.G, rows_hint);
    if (a.acc && (mode != DS4_BF16 || fp4)) { /* only the bf16 tiles and the pipeline add into y */
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: y += x Wᵀ in %s mode%s", op, ds4_dtype_name(mode), fp4 ? ", FP4" : "");
        return;
    }
    p.skinny = p.skinny && !a.acc && !x16;
    if (a.rs && (mode != DS4_F32 || fp4 || p.skinny || a.N > 32)) { /* only the narrow fp32 kernel scales rows */
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: row-scaled x for [%lld x %lld] x [%lld x %lld]^T", op, (long long)a.M,
                     (long long)a.K, (long long)a.N, (long long)a.K);
        return;
    }
    if (p.G * (p.skinny ? a.S : 1) > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld groups x %lld slices > 65535", op, (long long)p.G,
                     (long long)a.S);
        return;
    }
    p.cols = mode == DS4_F32 ? F32S_COLS : 4 * 8; // a skinny block's columns
    if (p.skinny && a.S > 1) {
        a.part = (float *)ds4_cuda_scratch(d, (size_t)(p.G * a.S * a.M * a.N) * sizeof(float), op, 0);
        a.count = ds4_cuda_counters(d, (size_t)(p.G * grid_rows(a, 16)) * ds4_blocks(a.N, (int)p.cols), op);
        if (!a.part || !a.count) return;
    }
    p.va = (int)(aligned(a.x, 16) && a.ldx % 4 == 0 && a.gx % 4 == 0);
    p.vb = fp4 ? (int)(aligned(a.W, 4) && a.ldw % 8 == 0 && a.gw % 8 == 0 && a.wstride % 8 == 0)
               : (int)(aligned(a.W, 16) && a.ldw % 8 == 0 && a.gw % 8 == 0 && a.wstride % 8 == 0);
    /* on Hopper: the wgmma kernel over x rounded to bf16 in its k-slot order (scratch slot 2, rows of K rounded up to
     * 32 values, zeros past K); the copy engine's coordinates are 32-bit */
    if (!fp4 && mode == DS4_BF16 && !p.skinny && p.vb && p.G * a.M < INT32_MAX && a.K < INT32_MAX - 64 &&
        a.N < INT32_MAX && (x16 || full_wave(cd, a, p.G, DS4_WG_TILE_M, DS4_WG_TILE_N)) && wgmma_ready(cd) &&
        (!x16 || kept_x(cd, a, p.G, (a.K + 31) / 32 * 32, 1))) {
        launch_wgmma(d, op, a, p.G);
        return;
    }
    if (x16) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: x [%lld x %lld] is the last product's y, which it left unwritten "
                     "(y16_only) for a product that cannot take its bf16 copy (not told x_kept, or not on wgmma)", op,
                     (long long)a.M, (long long)a.K);
        return;
    }
    /* the pipelined kernel reads x rounded to bf16 once, here, into scratch slot 2 (rows padded to 8 values: 16-byte
     * aligned rows for cp.async; the padding is never read) */
    p.pipe = !fp4 && mode == DS4_BF16 && !p.skinny && p.vb ? pipe_ready(cd) : nullptr;
    if (p.pipe && !full_wave(cd, a, p.G, p.pipe->BM, p.pipe->BN)) p.pipe = nullptr; // too few tiles: the tiled kernel
    if (p.pipe && !x_to_bf16(d, op, a, p.G)) return;
    if (fp4) launch<true>(cd, a, mode, p);
    else launch<false>(cd, a, mode, p);
    ds4_cuda_launched(d, op, "[%lld x %lld] x [%lld x %lld]^T (%s%s%s, %lld groups%s)", (long long)a.M, (long long)a.K,
                      (long long)a.N, (long long)a.K, ds4_wdt_name(wdt), fp4 ? " as " : "",
                      fp4 ? ds4_dtype_name(mode) : "", (long long)p.G, a.off ? ", by expert" : "");
}

} // namespace

int ds4_cuda_gemm_pipe_count(void) {
    int n;
    (void)pipe_cfgs(&n);
    return n;
}

bool ds4_cuda_rows_to_bf16(ds4_dev *d, const char *op, __nv_bfloat16 *dst, int64_t ldd, const float *src, int64_t lds,
                           int64_t gs, int64_t groups, int64_t rows, int64_t cols) {
    const int64_t n = groups * rows * ((cols + 7) / 8);
    if (n <= 0) return true;
    const int vs = aligned(src, 16) && lds % 4 == 0 && gs % 4 == 0, vd = aligned(dst, 16) && ldd % 8 == 0;
    rows_to_bf16_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(dst, ldd, src, lds, gs, rows, cols, n, vs, vd);
    return ds4_cuda_launched(d, op, "operand [%lld x %lld x %lld] to bf16", (long long)groups, (long long)rows,
                             (long long)cols);
}

void ds4_cuda_gemm_f32(ds4_dev *d, const char *op, float *y, int64_t ldy, const float *x, int64_t ldx, const float *W,
                       int64_t M, int64_t K, int64_t N) {
    gemm_args g = {y, ldy, x, ldx, W, K, M, N, K, 0, 0, 0, nullptr, 0, 0, nullptr, 0, nullptr};
    gemm(d, op, g, DS4_F32, DS4_F32, 1, M);
}

// The same with O, K and wstride even (the experts' shapes): tiles of 64 × 64 moved as pairs of bf16, 4-byte words,
// so that a warp reads and writes 128 bytes at a time (the 32 × 32 kernel below: 64 bytes of 2-byte accesses).
constexpr int TP = 64;
static __global__ void __launch_bounds__(256) transpose_bf16_pairs(unsigned short *Wt, const unsigned short *W, int64_t O,
                                                                   int64_t K, int64_t wstride) {
    __shared__ unsigned short tile[TP][TP + 2]; // [o][k]: a thread's pair is one word; rows 33 words apart
    const int64_t e = blockIdx.z, o0 = (int64_t)blockIdx.y * TP, k0 = (int64_t)blockIdx.x * TP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned short *src = W + e * wstride;
    uint32_t v[TP / 8];
#pragma unroll
    for (int i = 0; i < TP / 8; i++) { // every load of the thread issued before any store
        const int64_t o = o0 + warp + 8 * i, k = k0 + 2 * lane;
        v[i] = o < O && k < K ? *reinterpret_cast<const uint32_t *>(src + o * K + k) : 0u;
    }
#pragma unroll
    for (int i = 0; i < TP / 8; i++) {
        tile[warp + 8 * i][2 * lane] = (unsigned short)(v[i] & 0xffffu);
        tile[warp + 8 * i][2 * lane + 1] = (unsigned short)(v[i] >> 16);
    }
    __syncthreads();
    unsigned short *dst = Wt + e * K * O;
    const int64_t o = o0 + 2 * lane;
    if (o >= O) return;
#pragma unroll
    for (int j = warp; j < TP; j += 8) {
        const int64_t k = k0 + j;
        if (k < K)
            *reinterpret_cast<uint32_t *>(dst + k * O + o) = (uint32_t)tile[2 * lane][j] |
                                                              ((uint32_t)tile[2 * lane + 1][j] << 16);
    }
}

bool ds4_cuda_gemm_f32_rowscale_ok(ds4_dev *d, int64_t M, int64_t N) {
    gemm_args g = {};
    g.M = M, g.N = N;
    return N > 0 && N <= 32 && M > 0 && !takes_skinny(cdev(d), g, 1, M);
}

void ds4_cuda_gemm_f32_rowscaled(ds4_dev *d, const char *op, float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const float *rs, const float *W, int64_t M, int64_t K, int64_t N) {
    gemm_args g = {y, ldy, x, ldx, W, K, M, N, K, 0, 0, 0, nullptr, 0, 0, nullptr, 0, nullptr};
    g.rs = rs;
    gemm(d, op, g, DS4_F32, DS4_F32, 1, M);
}

// Wt [E, K, O] = W_e [O, K] transposed, bf16 bits; 32 × 32 tiles through shared memory (coalesced both ways).
static __global__ void transpose_bf16_kernel(unsigned short *Wt, const unsigned short *W, int64_t O, int64_t K,
                                      int64_t wstride) {
    __shared__ unsigned short tile[32][33];
    const int64_t e = blockIdx.z, o0 = (int64_t)blockIdx.y * 32, k0 = (int64_t)blockIdx.x * 32;
    const unsigned short *src = W + e * wstride;
    unsigned short *dst = Wt + e * K * O;
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        if (o0 + i < O && k0 + threadIdx.x < K) tile[i][threadIdx.x] = src[(o0 + i) * K + k0 + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        if (k0 + i < K && o0 + threadIdx.x < O) dst[(k0 + i) * O + o0 + threadIdx.x] = tile[threadIdx.x][i];
}

// dx [rows, K] (+)= dy [rows, O]·W_e for the rows [off[e], off[e+1]) of expert e, W [E, O, K] bf16 (W_e = W +
// e·wstride). The backward's product is the forward's grouped y = x·Wᵀ with x = dy and W_eᵀ, which is transposed
// into scratch first ([E, K, O], slot 1: the GEMM takes slot 0; E·O·K·2 bytes, the layer's experts only). Each output
// is the same sum as the backward's tiles form (prod_bf16 in cuda_bwd_linear.cu): dy rounded to bf16 to nearest
// even, the same mma k-slots over chunks of 32 in order, slices of 256 folded in order; so the same bits, with the
// forward's pipelined loads (the backward's tiles stage through registers and ran at half the forward's rate).
void ds4_cuda_grouped_dx_bf16(ds4_dev *d, const char *op, float *dx, int acc, const float *dy, const void *W,
                              int64_t rows, int64_t O, int64_t K, const int64_t *off, int64_t E, int64_t wstride) {
    if (rows <= 0 || O <= 0 || K <= 0 || E <= 0) return;
    if (E > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld experts (a grid's z is at most 65535)", op, (long long)E);
        return;
    }
    unsigned short *Wt = (unsigned short *)ds4_cuda_scratch(d, (size_t)(E * O * K) * sizeof(unsigned short), op, 1);
    if (!Wt) return;
    if (O % 2 == 0 && K % 2 == 0 && wstride % 2 == 0 && aligned(W, 4))
        transpose_bf16_pairs<<<dim3(ds4_blocks(K, TP), ds4_blocks(O, TP), (unsigned)E), 256, 0, cdev(d)->stream>>>(
            Wt, (const unsigned short *)W, O, K, wstride);
    else
        transpose_bf16_kernel<<<dim3(ds4_blocks(K, 32), ds4_blocks(O, 32), (unsigned)E), dim3(32, 8), 0,
                                cdev(d)->stream>>>(Wt, (const unsigned short *)W, O, K, wstride);
    if (!ds4_cuda_launched(d, op, "[%lld experts x %lld x %lld] transposed (bf16)", (long long)E, (long long)O,
                           (long long)K))
        return;
    gemm_args g = {dx, K, dy, O, Wt, O, rows, K, O, 0, 0, 0, off, E, K * O, nullptr, 0, nullptr, nullptr, acc};
    gemm(d, op, g, DS4_BF16, DS4_BF16, 1, (rows + E - 1) / E);
}

// Where group e starts in a transposed operand: the pipelined kernel's layout (group_start) or the wgmma kernel's
// (ds4d_wg_kstart: 64-aligned).
__host__ __device__ __forceinline__ int64_t columns_start(const int64_t *off, int64_t e, int wg) {
    return wg ? ds4d_wg_kstart(off, e) : group_start(off, e);
}

// The reduction position each column of the transposed operands holds: src[w] = the row of dy and x that column w
// takes (group e's rows [off[e], off[e+1]) at columns columns_start(off, e, wg) on), -1 for the padding between
// groups. k32: within each 32 columns from the group's start, in the wgmma kernel's k-slot order (cuda_gemm_wgmma.cu:
// position 16j + 8h + 2t + e holds k = 8t + 4j + 2h + e), the order its shared-memory operand must hold.
static __global__ void group_columns_kernel(int64_t *src, int64_t width, const int64_t *off, int64_t E, int wg,
                                            int k32) {
    const int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= width) return;
    int64_t lo = 0, hi = E - 1; // the last group starting at or before w: the one whose columns may hold it
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (columns_start(off, mid, wg) <= w) lo = mid;
        else hi = mid - 1;
    }
    int64_t q = w - columns_start(off, lo, wg);
    if (k32) {
        const int p = (int)(q & 31);
        q = (q & ~(int64_t)31) + 8 * ((p >> 1) & 3) + 4 * (p >> 4) + 2 * ((p >> 3) & 1) + (p & 1);
    }
    const int64_t r = off[lo] + q;
    src[w] = r < off[lo + 1] ? r : -1;
}

// out [C, width] (bf16): column w = row src[w] of in [rows, C], rounded to bf16 to nearest even (as the backward's
// tiles round their operands); padding columns 0 (never read: cp.async copies only a group's own columns). Tiles of
// 64 columns × 32 channels through shared memory: a warp reads one row's 32 channels (128 bytes), all eight rows of a
// warp issued before any is stored, then writes 64 columns of one channel as 32 bf16 pairs (128 bytes). The map src
// is made once per product (group_columns_kernel): the kernel of 32 × 32 tiles before it searched off for every tile
// and wrote 64 bytes per warp store.
constexpr int TG_W = 64, TG_C = 32, TG_ROWS = TG_W / 8;
static __global__ void __launch_bounds__(256) transpose_columns_kernel(__nv_bfloat16 *out, int64_t width,
                                                                       const float *in, int64_t C, const int64_t *src) {
    __shared__ float tile[TG_W][TG_C + 1];
    const int64_t w0 = (int64_t)blockIdx.x * TG_W, c0 = (int64_t)blockIdx.y * TG_C;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool cin = c0 + lane < C;
    float v[TG_ROWS];
#pragma unroll
    for (int i = 0; i < TG_ROWS; i++) {
        const int64_t w = w0 + warp + 8 * i, r = w < width ? src[w] : -1;
        v[i] = r >= 0 && cin ? in[r * C + c0 + lane] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < TG_ROWS; i++) tile[warp + 8 * i][lane] = v[i];
    __syncthreads();
    const int64_t w = w0 + 2 * lane; // width is a multiple of 8: w + 1 < width with w
    if (w >= width) return;
#pragma unroll
    for (int j = warp; j < TG_C; j += 8)
        if (c0 + j < C)
            *reinterpret_cast<__nv_bfloat162 *>(out + (c0 + j) * width + w) =
                __floats2bfloat162_rn(tile[2 * lane][j], tile[2 * lane + 1][j]);
}

// dW_e [O, K] += dyᵀ·x over the rows [off[e], off[e+1]) of dy [rows, O] and x [rows, K] (dW_e = dW + e·wstride) in
// bf16: dy and x transposed by groups into scratch (dyᵀ [O, width], xᵀ [K, width], bf16; slot 1) and reduced per
// expert. The sums are the backward's tiles' (prod_bf16 in cuda_bwd_linear.cu: both operands rounded to bf16 to nearest
// even, chunks of 32 from the group's first row, slices of 256 from there, the same mma k-slots), so the same bits,
// on either kernel: on Hopper the wgmma kernel (cuda_gemm_wgmma.cu, its reduction groups: product z = expert z over
// its columns, the groups 64-aligned; dyᵀ is its shared-memory operand, whose columns go in k-slot order, xᵀ its
// register operand, in natural order), else the pipelined mma.sync kernel, block z = expert over its group's columns
// (8-aligned groups, natural order). xᵀ stays in slot 1 for a next call of the same x (x_kept: the gate and up
// projections' dW share x). Returns false, having done nothing, where neither kernel can run (the caller takes the
// tiles).
bool ds4_cuda_grouped_dw_bf16(ds4_dev *d, const char *op, float *dW, int64_t wstride, const float *dy, const float *x,
                              int64_t rows, int64_t O, int64_t K, const int64_t *off, int64_t E, int x_kept) {
    cuda_dev *cd = cdev(d);
    const cuda_dev::kept_groups k = cd->bwd_xT; // what the call just before left; used once at most
    cd->bwd_xT.x = nullptr;
    if (rows <= 0 || O <= 0 || K <= 0 || E <= 0) return true;
    // the copy engine's coordinates are 32-bit
    const int wg = cd->dw_wgmma && wgmma_ready(cd) && O < INT32_MAX && K < INT32_MAX && rows + 64 * E < INT32_MAX - 128;
    const pipe_cfg *pc = wg || E > 65535 ? nullptr : pipe_ready(cd);
    if (!wg && !pc) return false;
    // >= columns_start(off, E, wg): the pipeline's 8-aligned groups, or wgmma's 64-aligned ones
    const int64_t width = wg ? (rows + 64 * E + 63) / 64 * 64 + 64 : (rows + 7) / 8 * 8 + 8 * E + 8;
    if ((O > K ? O : K) > (int64_t)65535 * TG_C) return false; // the transposes' grid y
    // slot 1: dyᵀ [O, width], xᵀ [K, width] (bf16), the column maps [width] (int64: xᵀ's, then dyᵀ's where they
    // differ, wgmma's k32 order); each 16-byte aligned (width % 8 = 0)
    auto *dyT = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(width * (O + K) * 2 + width * 8 * (1 + wg)), op, 1);
    if (!dyT) return true;
    __nv_bfloat16 *xT = dyT + O * width;
    auto *src = (int64_t *)(xT + K * width), *src_dy = wg ? src + width : src;
    // xᵀ and the column maps as the call just before made them (the same x and groups, by the schedule's word; the
    // same layout, and slot 1 has not moved since): only dy is new
    const bool kept = x_kept && k.x == x && k.rows == rows && k.K == K && k.O == O && k.E == E && k.off == off &&
                      k.wg == wg && k.generation == cd->generation;
    if (!kept) {
        group_columns_kernel<<<ds4_blocks(width, 256), 256, 0, cd->stream>>>(src, width, off, E, wg, 0);
        if (wg) group_columns_kernel<<<ds4_blocks(width, 256), 256, 0, cd->stream>>>(src_dy, width, off, E, wg, 1);
        if (!ds4_cuda_launched(d, op, "dW [%lld x %lld x %lld] over %lld rows: the columns of the expert groups",
                               (long long)E, (long long)O, (long long)K, (long long)rows))
            return true;
        transpose_columns_kernel<<<dim3(ds4_blocks(width, TG_W), ds4_blocks(K, TG_C)), 256, 0, cd->stream>>>(
            xT, width, x, K, src);
    }
    transpose_columns_kernel<<<dim3(ds4_blocks(width, TG_W), ds4_blocks(O, TG_C)), 256, 0, cd->stream>>>(dyT, width, dy,
                                                                                                        O, src_dy);
    if (!ds4_cuda_launched(d, op, "dW [%lld x %lld x %lld] over %lld rows: dy%s transposed by groups", (long long)E,
                           (long long)O, (long long)K, (long long)rows, kept ? "" : " and x"))
        return true;
    if (wg) {
        ds4d_wg_args w = {};
        w.y = dW, w.ldy = K, w.gy = wstride, w.xk = dyT, w.ldxk = width, w.W = xT, w.ldw = width;
        w.M = O, w.N = K, w.K = width, w.acc = 1, w.groups = E, w.koff = off;
        const int64_t tiles = (int64_t)ds4_blocks(K, DS4_WG_TILE_N) * ds4_blocks(O, DS4_WG_TILE_M) * E;
        char shapes[96];
        snprintf(shapes, sizeof shapes, "dW [%lld x %lld x %lld]", (long long)E, (long long)O, (long long)K);
        if (!wgmma_go(d, op, w, tiles, shapes)) return true;
    } else {
        gemm_args g = {};
        g.y = dW, g.ldy = K, g.xh = dyT, g.ldxh = width, g.W = xT, g.ldw = width, g.M = O, g.N = K, g.K = width;
        g.gy = wstride, g.acc = 1, g.koff = off;
        const dim3 grid(ds4_blocks(K, pc->BN), ds4_blocks(O, pc->BM), (unsigned)E);
        pc->kernel<<<grid, pc->threads, pc->smem, cd->stream>>>(g);
    }
    if (ds4_cuda_launched(d, op, "dW [%lld x %lld x %lld] += dy^T x over %lld rows by expert (bf16, %s)", (long long)E,
                          (long long)O, (long long)K, (long long)rows, wg ? "wgmma" : "pipelined"))
        cd->bwd_xT = {x, rows, K, O, E, off, wg, cd->generation};
    return true;
}

// bf16_in (ops.h) with fp32 weights is the CPU reference's emulation of the bf16 mode; bf16 weights imply it here,
// and with FP4-resident weights it says which kernels decode them (bf16: the tensor cores; else fp32).
static bool fp32_bf16_in(ds4_dev *d, const char *op, int bf16_in, ds4_dtype wdt) {
    if (!bf16_in || wdt == DS4_BF16 || wdt == DS4_FP4_PACKED) return false;
    ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: bf16_in with fp32 weights (the CPU's emulation of the bf16 mode)", op);
    return true;
}

void ds4_cuda_matmul(ds4_dev *d, const ds4_a_matmul *a) {
    if (fp32_bf16_in(d, "matmul", a->bf16_in, a->wdt)) return;
    gemm_args g = {a->y, a->ldy, a->x, a->ldx, a->W, a->K, a->T, a->O, a->K, a->gx, a->gy, a->gw, nullptr, 0, 0,
                   nullptr, 0, nullptr};
    g.x_kept = a->x_kept;
    g.keep16 = a->keep16;
    g.y16 = a->y16;
    g.y16_only = a->y16_only && a->bf16_in;
    gemm(d, "matmul", g, a->wdt, a->wdt, a->groups, a->T);
    const int64_t G = a->groups > 1 ? a->groups : 1;
    if (g.keep16 && !d->st) { // else written by the product's rounding pass (launch_wgmma), or failed
        const int64_t n = G * a->T * a->K;
        keep16_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->keep16, a->x, a->ldx, a->gx, G, a->T, a->K,
                                                                      n);
        if (!ds4_cuda_launched(d, "matmul", "x [%lld x %lld x %lld] kept in bf16", (long long)G, (long long)a->T,
                               (long long)a->K))
            return;
    }
    if (g.y16 && !d->st) { // else written by the product's epilogue (launch_wgmma), or failed
        const int64_t n = G * a->T * a->O;
        keep16_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->y16, a->y, a->ldy, a->gy, G, a->T, a->O, n);
        ds4_cuda_launched(d, "matmul", "y [%lld x %lld x %lld] kept in bf16", (long long)G, (long long)a->T,
                          (long long)a->O);
    }
}

void ds4_cuda_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a) {
    if (fp32_bf16_in(d, "matmul_grouped", a->bf16_in, a->wdt)) return;
    gemm_args g = {a->y, a->O, a->x, a->K, a->W, a->K, a->rows, a->O, a->K, 0, 0, 0, a->off, a->E, a->wstride,
                   nullptr, 0, nullptr, a->Ws};
    g.x_kept = a->x_kept;
    /* rows per expert group: few when decoding (each expert streams its weights once); FP4-resident experts in the
     * mode bf16_in says (the model's dtype) */
    const ds4_dtype mode = a->wdt == DS4_FP4_PACKED ? (a->bf16_in ? DS4_BF16 : DS4_F32) : a->wdt;
    gemm(d, "matmul_grouped", g, a->wdt, mode, 1, a->E > 0 ? (a->rows + a->E - 1) / a->E : a->rows);
}
