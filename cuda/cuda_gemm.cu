// cuda_gemm.cu — y = x Wᵀ on the GPU (matmul, column-grouped / batched, row-grouped by expert), batch-invariant.
//
// Every output element is reduced over K in ONE fixed order that depends on K alone, never on M, the tile it falls
// in, or which kernel variant runs; so a row gives the same bits alone, in a batch, in a prefill or in a decoding
// step. There is no split-K.
//   fp32 weights: each output is fmaf-accumulated sequentially over k = 0, 1, .., K-1 from 0 (chunks of 16 padded
//     with zeros), by one thread. Tile shapes vary with M; the arithmetic per element does not.
//   bf16 weights: x is rounded to bf16 (round-to-nearest-even) and the products accumulate in fp32 on the tensor
//     cores (mma.sync m16n8k16), over K in chunks of 32 in increasing order (zero padded). Within a chunk, thread
//     (g, t) of a warp holds the 8 consecutive k's 8t..8t+7 of its row and column; the first mma takes 8t..8t+3
//     into its k-slots (2t, 2t+1, 2t+8, 2t+9), the second 8t+4..8t+7. Every kernel below feeds the tensor cores
//     through mma_k32 with that mapping, so the sums they do are the same sums.
// Kernels: a tiled one through shared memory for many rows, a "skinny" one that streams W straight from global
// memory with several chunks in flight for few rows (decoding: the rows are tiny, W is everything).
#include <cstdio>
#include <cstring>

#include "cuda_dev.cuh"

namespace {

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
};

// The rows [r0, r1) a block works on, and its W; false when the block has no tile (row groups are data-dependent).
template <int BM>
__device__ __forceinline__ bool block_rows(const gemm_args &a, int64_t &r0, int64_t &r1, int64_t &woff) {
    if (!a.off) {
        r0 = (int64_t)blockIdx.y * BM;
        r1 = a.M;
        woff = 0;
        return r0 < a.M;
    }
    int64_t t = blockIdx.y;
    for (int64_t e = 0; e < a.E; e++) {
        const int64_t b = a.off[e], n = a.off[e + 1] - b, tiles = (n + BM - 1) / BM;
        if (t < tiles) {
            r0 = b + t * BM;
            r1 = a.off[e + 1];
            woff = e * a.wstride;
            return true;
        }
        t -= tiles;
    }
    return false;
}

// ------------------------------------------------------------------------------------------ fp32

template <int BM, int BN, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN)) gemm_f32_kernel(gemm_args a) {
    constexpr int BK = 16, NTH = (BM / TM) * (BN / TN);
    __shared__ float sA[BK][BM + 1], sB[BK][BN + 1];
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const float *W = (const float *)a.W + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int tid = threadIdx.x, ty = tid / (BN / TN), tx = tid % (BN / TN);
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
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
#pragma unroll
        for (int kk = 0; kk < BK; kk++)
#pragma unroll
            for (int i = 0; i < TM; i++) {
                const float av = sA[kk][ty * TM + i];
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] = fmaf(av, sB[kk][tx * TN + j], acc[i][j]);
            }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t r = r0 + ty * TM + i;
        if (r >= r1 || r - r0 >= BM) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t c = n0 + tx * TN + j;
            if (c < a.N) y[r * a.ldy + c] = acc[i][j];
        }
    }
}

// ------------------------------------------------------------------------------------------ bf16

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One chunk of 32 k's: ag / ag8 are the 8 bf16 of rows g and g+8 at k = 8t..8t+7 (4 words), b those of column g.
__device__ __forceinline__ void mma_k32(float (&c)[4], const uint32_t (&ag)[4], const uint32_t (&ag8)[4],
                                        const uint32_t (&b)[4]) {
    mma_bf16(c, ag[0], ag8[0], ag[1], ag8[1], b[0], b[1]);
    mma_bf16(c, ag[2], ag8[2], ag[3], ag8[3], b[2], b[3]);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

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
    for (int i = 0; i < 4; i++) w[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
}

// 8 consecutive bf16 of row c of W at k0; zero outside [0, N) × [0, K).
__device__ __forceinline__ void load_b8(const __nv_bfloat16 *W, int64_t ldw, int64_t c, int64_t N, int64_t k0,
                                        int64_t K, bool vec, uint32_t (&w)[4]) {
    if (c < N && vec && k0 + 8 <= K) {
        const uint4 p = *reinterpret_cast<const uint4 *>(W + c * ldw + k0);
        w[0] = p.x, w[1] = p.y, w[2] = p.z, w[3] = p.w;
        return;
    }
    unsigned short h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) h[i] = c < N && k0 + i < K ? __bfloat16_as_ushort(W[c * ldw + k0 + i]) : 0;
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
}

__device__ __forceinline__ void store_tile(float *y, int64_t ldy, int64_t r, int64_t r1, int64_t c, int64_t N,
                                           const float (&acc)[4]) {
    if (r < r1) {
        if (c < N) y[r * ldy + c] = acc[0];
        if (c + 1 < N) y[r * ldy + c + 1] = acc[1];
    }
    if (r + 8 < r1) {
        if (c < N) y[(r + 8) * ldy + c] = acc[2];
        if (c + 1 < N) y[(r + 8) * ldy + c + 1] = acc[3];
    }
}

// Tiled: BM × BN per block of (BM/WM)·(BN/WN) warps, each WM × WN; chunks of 32 k staged in shared memory (bf16,
// rows padded to 40 elements), the next chunk's loads in registers while the current one is multiplied.
template <int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) gemm_bf16_tiled(gemm_args a, int vec_a, int vec_b) {
    constexpr int NW = (BM / WM) * (BN / WN), NTH = NW * 32, MT = WM / 16, NT = WN / 8, LDS = 40;
    constexpr int AL = BM * 4 / NTH, BL = BN * 4 / NTH; // 8-value loads per thread and chunk
    static_assert(AL >= 1 && BL >= 1, "tile too small for the block");
    __shared__ __align__(16) __nv_bfloat16 sA[BM * LDS], sB[BN * LDS];
    int64_t r0, r1, woff;
    if (!block_rows<BM>(a, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const __nv_bfloat16 *W = (const __nv_bfloat16 *)a.W + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
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
    auto stash = [&]() {
#pragma unroll
        for (int i = 0; i < AL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            *reinterpret_cast<uint4 *>(&sA[row * LDS + part * 8]) = make_uint4(ra[i][0], ra[i][1], ra[i][2], ra[i][3]);
        }
#pragma unroll
        for (int i = 0; i < BL; i++) {
            const int s = tid + i * NTH, row = s >> 2, part = s & 3;
            *reinterpret_cast<uint4 *>(&sB[row * LDS + part * 8]) = make_uint4(rb[i][0], rb[i][1], rb[i][2], rb[i][3]);
        }
    };
    fetch(0);
    for (int64_t k0 = 0; k0 < a.K; k0 += 32) {
        stash();
        __syncthreads();
        if (k0 + 32 < a.K) fetch(k0 + 32);
        uint32_t af[MT][2][4];
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 v = *reinterpret_cast<const uint4 *>(&sA[(wm + i * 16 + g + h * 8) * LDS + t * 8]);
                af[i][h][0] = v.x, af[i][h][1] = v.y, af[i][h][2] = v.z, af[i][h][3] = v.w;
            }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 v = *reinterpret_cast<const uint4 *>(&sB[(wn + j * 8 + g) * LDS + t * 8]);
            const uint32_t bf[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < MT; i++) mma_k32(acc[i][j], af[i][0], af[i][1], bf);
        }
        __syncthreads();
    }
    const int64_t rend = r1 < r0 + BM ? r1 : r0 + BM;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
            store_tile(y, a.ldy, r0 + wm + i * 16 + g, rend, n0 + wn + j * 8 + 2 * t, a.N, acc[i][j]);
}

// Skinny: 16 rows per block; each warp streams NT column tiles of W straight from global memory, U chunks in
// flight. For decoding, where W is all the traffic.
template <int NT, int U, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) gemm_bf16_skinny(gemm_args a, int vec_a, int vec_b) {
    int64_t r0, r1, woff;
    if (!block_rows<16>(a, r0, r1, woff)) return;
    const int z = blockIdx.z;
    const float *x = a.x + z * a.gx;
    const __nv_bfloat16 *W = (const __nv_bfloat16 *)a.W + z * a.gw + woff;
    float *y = a.y + z * a.gy;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t n0 = ((int64_t)blockIdx.x * WARPS + warp) * NT * 8;
    if (n0 >= a.N) return;
    const int64_t rend = r1 < r0 + 16 ? r1 : r0 + 16;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int64_t k0 = 0; k0 < a.K; k0 += 32 * U) {
        uint32_t ag[U][4], ag8[U][4], bw[U][NT][4];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t k = k0 + u * 32 + t * 8;
#pragma unroll
            for (int j = 0; j < NT; j++) load_b8(W, a.ldw, n0 + j * 8 + g, a.N, k, a.K, vec_b, bw[u][j]);
            load_a8(x, a.ldx, r0 + g, rend, k, a.K, vec_a, ag[u]);
            load_a8(x, a.ldx, r0 + g + 8, rend, k, a.K, vec_a, ag8[u]);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
            if (k0 + u * 32 < a.K)
#pragma unroll
                for (int j = 0; j < NT; j++) mma_k32(acc[j], ag[u], ag8[u], bw[u][j]);
    }
#pragma unroll
    for (int j = 0; j < NT; j++) store_tile(y, a.ldy, r0 + g, rend, n0 + j * 8 + 2 * t, a.N, acc[j]);
}

bool aligned(const void *p, size_t to) { return ((uintptr_t)p % to) == 0; }

// Launch the variant for `rows_hint` rows per (group of) W. Which variant runs never changes the result.
void gemm(ds4_dev *d, const char *op, const gemm_args &a, ds4_dtype wdt, int64_t groups, int64_t rows_hint) {
    cuda_dev *cd = cdev(d);
    if (a.M <= 0 || a.N <= 0) return;
    if (a.K <= 0) {
        ds4_dev_fail(d, DS4_ERR_ARG, "%s: K = %lld", op, (long long)a.K);
        return;
    }
    if (groups > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld groups > 65535", op, (long long)groups);
        return;
    }
    const unsigned gz = (unsigned)(groups > 0 ? groups : 1);
    auto grid_y = [&](int BM) {
        const int64_t t = a.off ? (a.M + BM - 1) / BM + a.E : (a.M + BM - 1) / BM;
        return (unsigned)(t < 1 ? 1 : t);
    };
    if (wdt == DS4_F32) {
        if (rows_hint <= 16) {
            dim3 grid(ds4_blocks(a.N, 128), grid_y(16), gz);
            gemm_f32_kernel<16, 128, 1, 8><<<grid, 256, 0, cd->stream>>>(a);
        } else {
            dim3 grid(ds4_blocks(a.N, 64), grid_y(64), gz);
            gemm_f32_kernel<64, 64, 4, 4><<<grid, 256, 0, cd->stream>>>(a);
        }
    } else if (wdt == DS4_BF16) {
        const int va = (int)(aligned(a.x, 16) && a.ldx % 4 == 0 && a.gx % 4 == 0);
        const int vb = (int)(aligned(a.W, 16) && a.ldw % 8 == 0 && a.gw % 8 == 0 && a.wstride % 8 == 0);
        if (rows_hint <= 16) {
            // enough warps to cover the SMs: NT = 1 column tile of 8 per warp when N is small
            if (a.N >= (int64_t)cd->sm_count * 8 * 2 * 8) {
                dim3 grid(ds4_blocks(a.N, 8 * 2 * 8), grid_y(16), gz);
                gemm_bf16_skinny<2, 4, 8><<<grid, 256, 0, cd->stream>>>(a, va, vb);
            } else {
                dim3 grid(ds4_blocks(a.N, 8 * 4), grid_y(16), gz);
                gemm_bf16_skinny<1, 8, 4><<<grid, 128, 0, cd->stream>>>(a, va, vb);
            }
        } else {
            dim3 grid(ds4_blocks(a.N, 128), grid_y(64), gz);
            gemm_bf16_tiled<64, 128, 32, 32><<<grid, 256, 0, cd->stream>>>(a, va, vb);
        }
    } else {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: weight dtype %s", op, ds4_dtype_name(wdt));
        return;
    }
    ds4_cuda_launched(d, op, "[%lld x %lld] x [%lld x %lld]^T (%s, %lld groups%s)", (long long)a.M, (long long)a.K,
                      (long long)a.N, (long long)a.K, ds4_dtype_name(wdt), (long long)gz, a.off ? ", by expert" : "");
}

} // namespace

void ds4_cuda_matmul(ds4_dev *d, const ds4_a_matmul *a) {
    gemm_args g = {a->y, a->ldy, a->x, a->ldx, a->W, a->K, a->T, a->O, a->K, a->gx, a->gy, a->gw, nullptr, 0, 0};
    gemm(d, "matmul", g, a->wdt, a->groups, a->T);
}

void ds4_cuda_matmul_grouped(ds4_dev *d, const ds4_a_matmul_grouped *a) {
    gemm_args g = {a->y, a->O, a->x, a->K, a->W, a->K, a->rows, a->O, a->K, 0, 0, 0, a->off, a->E, a->wstride};
    /* rows per expert group: few when decoding (each expert streams its weights once) */
    gemm(d, "matmul_grouped", g, a->wdt, 1, a->E > 0 ? (a->rows + a->E - 1) / a->E : a->rows);
}
