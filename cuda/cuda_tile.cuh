// cuda_tile.cuh — the inner steps of the tiled products, shared by the forward GEMM (cuda_gemm.cu) and the linear
// backward (cuda_bwd_linear.cu): one chunk of k's staged in shared memory multiplied into a thread's (fp32) or a
// warp's (bf16, tensor cores) accumulators, and the end of a slice, whose partial sums join the totals.
//
// fp32: a chunk of BK k's is staged as sA[k][m] and sB[k][n]; thread (ty, tx) owns the TM × TN outputs at rows
// ty·TM.. and columns tx·TN.. and accumulates them with fmaf in k order.
//
// bf16: a chunk of 32 k's is staged in shared memory as bf16 rows of LDS elements: sA[m][k] (rows of the output) and
// sB[n][k] (columns). Thread (g, t) = (lane / 4, lane % 4) of a warp holds the 8 consecutive k's 8t..8t+7 of its row
// and column; the first mma.sync m16n8k16 takes 8t..8t+3 into its k-slots (2t, 2t+1, 2t+8, 2t+9), the second
// 8t+4..8t+7. The accumulators are fp32, in the m16n8 layout: c[0], c[1] at (row g, columns 2t, 2t+1), c[2], c[3]
// at row g + 8.
#ifndef DS4_CUDA_TILE_CUH
#define DS4_CUDA_TILE_CUH

#include <cstdint>
#include <cuda_bf16.h>

// Row groups (the routed experts): tile `tile` of the groups' tiles of BM rows, numbered group by group; its first row
// r0, the end r1 of its group (the tile's rows are [r0, min(r1, r0 + BM))) and the group's offset e·stride. False
// for a tile past the last (a grid counts one tile more per group than the rows may need).
template <int BM>
__device__ __forceinline__ bool ds4d_group_tile(const int64_t *off, int64_t E, int64_t stride, int64_t tile,
                                                int64_t &r0, int64_t &r1, int64_t &soff) {
    int64_t t = tile;
    for (int64_t e = 0; e < E; e++) {
        const int64_t b = off[e], n = off[e + 1] - b, tiles = (n + BM - 1) / BM;
        if (t < tiles) {
            r0 = b + t * BM;
            r1 = off[e + 1];
            soff = e * stride;
            return true;
        }
        t -= tiles;
    }
    return false;
}

template <int BK, int TM, int TN, int LA, int LB>
__device__ __forceinline__ void ds4d_fma_chunk(float (&acc)[TM][TN], const float (&sA)[BK][LA],
                                               const float (&sB)[BK][LB], int ty, int tx) {
#pragma unroll
    for (int kk = 0; kk < BK; kk++)
#pragma unroll
        for (int i = 0; i < TM; i++) {
            const float av = sA[kk][ty * TM + i];
#pragma unroll
            for (int j = 0; j < TN; j++) acc[i][j] = fmaf(av, sB[kk][tx * TN + j], acc[i][j]);
        }
}

template <int TM, int TN>
__device__ __forceinline__ void ds4d_fma_zero(float (&acc)[TM][TN]) {
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
}

// A slice ends: its partial sums join the totals (tot += acc, in fp32) and the slice's accumulators restart at 0.
template <int TM, int TN>
__device__ __forceinline__ void ds4d_fma_fold(float (&tot)[TM][TN], float (&acc)[TM][TN]) {
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) tot[i][j] += acc[i][j], acc[i][j] = 0.0f;
}

// Two fp32 values rounded to bf16 (nearest even) as one word of an mma operand, lo in the low half: the rounding every
// bf16 product applies to its activation operands.
__device__ __forceinline__ uint32_t ds4d_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// Not volatile: the compiler may interleave independent products (an accumulator's products stay in program order
// through their data dependence), which hides the tensor cores' latency between a product and the next into it.
__device__ __forceinline__ void ds4d_mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One chunk of 32 k's: ag / ag8 are the 8 bf16 of rows g and g+8 at k = 8t..8t+7 (4 words), b those of column g.
__device__ __forceinline__ void ds4d_mma_k32(float (&c)[4], const uint32_t (&ag)[4], const uint32_t (&ag8)[4],
                                             const uint32_t (&b)[4]) {
    ds4d_mma_bf16(c, ag[0], ag8[0], ag[1], ag8[1], b[0], b[1]);
    ds4d_mma_bf16(c, ag[2], ag8[2], ag[3], ag8[3], b[2], b[3]);
}

// A warp's MT × NT tiles of m16n8 at rows wm.. and columns wn.. of the block over the chunk staged in sA / sB: each
// tile gets ds4d_mma_k32's two products in its order (k-slots of 8t..8t+3, then of 8t+4..8t+7), but every tile's first
// product is issued before any tile's second, so no product waits for the one just before it.
template <int MT, int NT, int LDS>
__device__ __forceinline__ void ds4d_mma_chunk(float (&acc)[MT][NT][4], const __nv_bfloat16 *sA,
                                               const __nv_bfloat16 *sB, int wm, int wn, int g, int t) {
    uint32_t af[MT][2][4], bf[NT][4];
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
        bf[j][0] = v.x, bf[j][1] = v.y, bf[j][2] = v.z, bf[j][3] = v.w;
    }
#pragma unroll
    for (int q = 0; q < 4; q += 2)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < MT; i++)
                ds4d_mma_bf16(acc[i][j], af[i][0][q], af[i][1][q], af[i][0][q + 1], af[i][1][q + 1], bf[j][q],
                              bf[j][q + 1]);
}

// Zero a warp's accumulators.
template <int MT, int NT>
__device__ __forceinline__ void ds4d_mma_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
}

// The same for a warp's tiles.
template <int MT, int NT>
__device__ __forceinline__ void ds4d_mma_fold(float (&tot)[MT][NT][4], float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) tot[i][j][q] += acc[i][j][q], acc[i][j][q] = 0.0f;
}

// cp.async: 16 bytes from global to shared memory without passing through registers; bytes < 16 copies that many
// and zero-fills the rest (0: none read). Copies are committed in groups; wait<N> waits until at most N of this
// thread's groups are in flight.
__device__ __forceinline__ void ds4d_cp_async16(void *dst, const void *src, int bytes) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void ds4d_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void ds4d_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

#endif
