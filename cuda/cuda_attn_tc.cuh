// cuda_attn_tc.cuh — the bf16 mode's attention products on the tensor cores, shared by the forward
// (cuda_attn.cu) and the backward's per-query phase (cuda_bwd_attn.cu), so that the backward recomputes the
// forward's probabilities bit for bit.
//
// V4 attention has one KV head: every head of query row t attends over the same key list (window keys, then
// compressed entries), with values = keys. One block of TCA_THREADS takes row t and all its heads: the heads are
// the rows of an m16n8k16 bf16 product (padded to Hp, a multiple of 16, with zero rows), so the keys are read once
// per row instead of once per (row, head).
//   1. logits [Hp, nk] = q [Hp, d] · keysᵀ, keys staged 32 at a time as bf16 rows; warp w takes keys w·8.. of a
//      chunk, every m-tile, the channels in chunks of 32 (ds4d_mma_k32's k-slots), one fp32 accumulator per output;
//      then × 1/sqrt(d) (after the sum, as the fp32 kernels and the CPU).
//   2. softmax with sink per head row (fp32 values, double denominator), a warp per row: lanes take keys lane,
//      lane+32, .. in order, fixed butterflies (the same bits at every launch, whatever else runs).
//   3. out [Hp, d] = P (bf16) · keys (bf16), keys staged 32 at a time transposed ([channel][key]); warp w takes 32
//      channels of the pass, every m-tile; the keys of a chunk in the mma's k-slots, chunks added in order into one
//      fp32 accumulator per output.
// The operands are rounded to bf16 to nearest even (ds4_f32_to_bf16 on the CPU); the sums are fp32. Which keys a
// row sees, and where they live (this pass's rows, the cache's ring, the compressed entries), only changes the
// pointers kp: a decoding step and the full forward give the same bits.
#ifndef DS4_CUDA_ATTN_TC_CUH
#define DS4_CUDA_ATTN_TC_CUH

#include <cstdint>
#include <cuda_bf16.h>

#include "cuda_dev.cuh"
#include "cuda_tile.cuh"

constexpr int TCA_THREADS = 128, TCA_WARPS = TCA_THREADS / 32;
constexpr int TCA_KC = 32;           // keys per staged chunk
constexpr int TCA_MT = 2;            // m-tiles (16 heads each) per pass of the output product
constexpr int TCA_NW = 4;            // n-tiles (8 channels) per warp per pass: 128 channels a pass
constexpr int TCA_LT = TCA_KC + 8;   // row length of the transposed key chunk (bf16; 80 bytes, 16-byte aligned rows)

// The block's shared memory, carved from one dynamic allocation (byte offsets 16-aligned).
struct tca_layout {
    int64_t Hp, dp, LQ, nkp, LP;     // padded heads; padded channels; q row length; padded keys; P row length
    size_t kp, lg, dp_, sP, sQ, sG, sK, sKT, bytes;
};

__host__ __device__ inline int64_t tca_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// maxk: the longest key list; grad: the backward's extra operand (dout) and logit-gradient rows.
__host__ __device__ inline tca_layout tca_layout_of(int64_t H, int64_t d, int64_t maxk, int grad) {
    tca_layout L;
    L.Hp = tca_up(H, 16), L.dp = tca_up(d, 32), L.nkp = tca_up(maxk > 0 ? maxk : 1, TCA_KC);
    // rows of q, dout and keys: a length of 32 mod 64 bf16 (64 bytes mod 128) keeps a quarter-warp's fragment reads
    // (rows r and r + 1, 16-byte pieces 0..3) on distinct banks
    L.LQ = L.dp % 64 == 0 ? L.dp + 32 : L.dp;
    L.LP = L.nkp + 8;
    size_t o = 0;
    auto take = [&o](size_t bytes) { const size_t at = o; o += (bytes + 15) / 16 * 16; return at; };
    L.kp = take((size_t)L.nkp * sizeof(void *));
    L.lg = take((size_t)(L.Hp * L.nkp) * sizeof(float));
    L.dp_ = grad ? take((size_t)(L.Hp * L.nkp) * sizeof(float)) : 0;
    // the rows of q (and dout) and the key chunks serve product 1 only, P (or DS) and the transposed key chunks the
    // softmax and product 3, which begin after product 1's last barrier: the two sets share their bytes (fewer bytes a
    // block, more blocks an SM: the backward's CSA shapes go from two to three)
    const size_t phase = o;
    L.sQ = take((size_t)(L.Hp * L.LQ) * 2);
    L.sG = grad ? take((size_t)(L.Hp * L.LQ) * 2) : 0;
    L.sK = take((size_t)(TCA_KC * L.LQ) * 2);
    const size_t end1 = o;
    o = phase;
    L.sP = take((size_t)(L.Hp * L.LP) * 2);
    L.sKT = take((size_t)(TCA_NW * TCA_WARPS * 8 * TCA_LT) * 2);
    L.bytes = o > end1 ? o : end1;
    return L;
}

// 4 fp32 values at p (c .. c+3 of a row of d; zeros past d or for no row): one 16-byte load where the row allows it.
__device__ __forceinline__ float4 tca_get4(const float *p, int c, int d) {
    if (p && c + 4 <= d && ((reinterpret_cast<uintptr_t>(p + c) & 15) == 0))
        return *reinterpret_cast<const float4 *>(p + c);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = p && c + i < d ? p[c + i] : 0.0f;
    return make_float4(v[0], v[1], v[2], v[3]);
}

// 4 values -> 4 bf16 at s + c (rounded to nearest even)
__device__ __forceinline__ void tca_set4(__nv_bfloat16 *s, int c, float4 v) {
    *reinterpret_cast<uint2 *>(s + c) = make_uint2(ds4d_pack_bf16(v.x, v.y), ds4d_pack_bf16(v.z, v.w));
}

// 4 fp32 values at p (c .. c+3 of a row of d) -> 4 bf16 at s, zeros past d.
__device__ __forceinline__ void tca_put4(__nv_bfloat16 *s, const float *p, int c, int d) {
    tca_set4(s, c, tca_get4(p, c, d));
}

// rows [H, d] fp32 (row stride d) -> s [Hp, LQ] bf16, zeros past H and d: a warp per row, 4 values per lane
__device__ __forceinline__ void tca_stage_rows(__nv_bfloat16 *s, const float *x, int64_t H, int64_t d,
                                               const tca_layout &L) {
    const int lane = threadIdx.x & 31, dp = (int)L.dp;
    for (int h = threadIdx.x >> 5; h < (int)L.Hp; h += TCA_WARPS)
        for (int c = lane * 4; c < dp; c += 128) tca_put4(s + h * L.LQ, h < H ? x + h * d : nullptr, c, (int)d);
}

// keys k0 .. k0+31 -> sK [32, LQ] bf16 (zero rows past nk, zero channels past d): a warp per key row
__device__ __forceinline__ void tca_stage_keys(__nv_bfloat16 *sK, const float *const *kp, int64_t k0, int64_t nk,
                                               int64_t d, const tca_layout &L) {
    const int lane = threadIdx.x & 31, dp = (int)L.dp;
    for (int j = threadIdx.x >> 5; j < TCA_KC; j += TCA_WARPS) {
        const float *p = k0 + j < nk ? kp[k0 + j] : nullptr;
        for (int c = lane * 4; c < dp; c += 128) tca_put4(sK + j * L.LQ, p, c, (int)d);
    }
}

// Product 1 over one staged chunk of keys (columns k0..k0+31 of the outputs): out[h, k] = scale · Σ_c a[h, c]·key[c]
// for every head row; with a second operand (the backward's dout), out2 likewise without the scale. key(j, c) gives
// the 16 bytes of channels c..c+7 of the chunk's key j (the staging's layout).
template <typename KeyPiece>
__device__ __forceinline__ void tca_scores_chunk_of(float *out, float *out2, const __nv_bfloat16 *sA,
                                                    const __nv_bfloat16 *sA2, KeyPiece key, int64_t k0, float scale,
                                                    const tca_layout &L) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int64_t col = k0 + warp * 8 + 2 * t;
    for (int64_t mt = 0; mt < L.Hp / 16; mt++) {
        float acc[4] = {0, 0, 0, 0}, acc2[4] = {0, 0, 0, 0};
        for (int64_t kc = 0; kc < L.dp; kc += 32) {
            uint32_t ag[4], ag8[4], b[4];
            const uint4 vb = key(warp * 8 + g, (int)kc + t * 8);
            b[0] = vb.x, b[1] = vb.y, b[2] = vb.z, b[3] = vb.w;
            const uint4 va = *reinterpret_cast<const uint4 *>(&sA[(mt * 16 + g) * L.LQ + kc + t * 8]);
            const uint4 va8 = *reinterpret_cast<const uint4 *>(&sA[(mt * 16 + g + 8) * L.LQ + kc + t * 8]);
            ag[0] = va.x, ag[1] = va.y, ag[2] = va.z, ag[3] = va.w;
            ag8[0] = va8.x, ag8[1] = va8.y, ag8[2] = va8.z, ag8[3] = va8.w;
            ds4d_mma_k32(acc, ag, ag8, b);
            if (sA2) {
                const uint4 vc = *reinterpret_cast<const uint4 *>(&sA2[(mt * 16 + g) * L.LQ + kc + t * 8]);
                const uint4 vc8 = *reinterpret_cast<const uint4 *>(&sA2[(mt * 16 + g + 8) * L.LQ + kc + t * 8]);
                ag[0] = vc.x, ag[1] = vc.y, ag[2] = vc.z, ag[3] = vc.w;
                ag8[0] = vc8.x, ag8[1] = vc8.y, ag8[2] = vc8.z, ag8[3] = vc8.w;
                ds4d_mma_k32(acc2, ag, ag8, b);
            }
        }
        const int64_t r = mt * 16 + g;
        out[r * L.nkp + col] = acc[0] * scale, out[r * L.nkp + col + 1] = acc[1] * scale;
        out[(r + 8) * L.nkp + col] = acc[2] * scale, out[(r + 8) * L.nkp + col + 1] = acc[3] * scale;
        if (out2) {
            out2[r * L.nkp + col] = acc2[0], out2[r * L.nkp + col + 1] = acc2[1];
            out2[(r + 8) * L.nkp + col] = acc2[2], out2[(r + 8) * L.nkp + col + 1] = acc2[3];
        }
    }
}

// ... from sK [32, LQ] (tca_stage_keys' rows)
__device__ __forceinline__ void tca_scores_chunk(float *out, float *out2, const __nv_bfloat16 *sA,
                                                 const __nv_bfloat16 *sA2, const __nv_bfloat16 *sK, int64_t k0,
                                                 float scale, const tca_layout &L) {
    tca_scores_chunk_of(
        out, out2, sA, sA2,
        [&](int j, int c) { return *reinterpret_cast<const uint4 *>(&sK[j * L.LQ + c]); }, k0, scale, L);
}

// Product 1 over every key of the row: stages the keys chunk by chunk (sK), logits into lg (and dout·key into dpv).
__device__ __forceinline__ void tca_scores(float *lg, float *dpv, const __nv_bfloat16 *sQ, const __nv_bfloat16 *sG,
                                           __nv_bfloat16 *sK, const float *const *kp, int64_t nk, int64_t d,
                                           float scale, const tca_layout &L) {
    for (int64_t k0 = 0; k0 < nk; k0 += TCA_KC) {
        tca_stage_keys(sK, kp, k0, nk, d, L);
        __syncthreads();
        tca_scores_chunk(lg, dpv, sQ, sG, sK, k0, scale, L);
        __syncthreads();
    }
}

// Softmax with sink of head row h's logits l[0..nk) in place (a warp each): l = P (fp32), sP = P in bf16, zero from
// nk to the padded end. Returns the denominator (double, the sink's term included) and sets *mx_out. The exponentials
// are fp32 (expf, within 2 ulp) and P = e · (1/den); the sums stay double. With a double exp and a double division
// per element an H200 training step's attention took 3.44 ms instead of 2.88 and attn_bwd_q 5.83 instead of 5.08.
// The fp32 path and the CPU keep the double exp and the division: a few ulp of P apart, inside the tests' bounds.
// Decoding and the full forward both come here, so they keep each other's bits.
__device__ __forceinline__ double tca_softmax_row(float *l, __nv_bfloat16 *sP, int64_t nk, int64_t nkp, float sink,
                                                  float *mx_out) {
    const int lane = threadIdx.x & 31;
    float mx = sink;
    for (int64_t k = lane; k < nk; k += 32) mx = fmaxf(mx, l[k]);
    mx = ds4d_warp_maxf(mx);
    double den = 0;
    for (int64_t k = lane; k < nk; k += 32) den += (double)(l[k] = expf(l[k] - mx));
    den = ds4d_warp_sum(den) + exp((double)(sink - mx));
    const double rden = 1.0 / den;
    for (int64_t k = lane; k < nkp; k += 32) {
        const float p = k < nk ? (float)(l[k] * rden) : 0.0f;
        l[k] = p;
        sP[k] = __float2bfloat16_rn(p);
    }
    *mx_out = mx;
    return den;
}

// Product 3's multiply-adds over one staged chunk (keys k0.. of sP's rows, transposed keys in sKT) for the m-tiles
// m0.. of a pass: a warp's TCA_NW n-tiles of 8 channels, the chunk's 32 keys in ds4d_mma_k32's k-slots.
// b[j]: n-tile j's key fragments (lane (g, t): keys k0 + 8t .. 8t+7 of channel g of the tile).
__device__ __forceinline__ void tca_ws_mma(float (&acc)[TCA_MT][TCA_NW][4], const __nv_bfloat16 *sP,
                                           const uint32_t (&b)[TCA_NW][4], int64_t m0, int64_t k0,
                                           const tca_layout &L) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t nmt = L.Hp / 16;
#pragma unroll
    for (int i = 0; i < TCA_MT; i++) {
        if (m0 + i >= nmt) break;
        const int64_t r = (m0 + i) * 16 + g;
        uint32_t ag[4], ag8[4];
        const uint4 va = *reinterpret_cast<const uint4 *>(&sP[r * L.LP + k0 + t * 8]);
        const uint4 va8 = *reinterpret_cast<const uint4 *>(&sP[(r + 8) * L.LP + k0 + t * 8]);
        ag[0] = va.x, ag[1] = va.y, ag[2] = va.z, ag[3] = va.w;
        ag8[0] = va8.x, ag8[1] = va8.y, ag8[2] = va8.z, ag8[3] = va8.w;
#pragma unroll
        for (int j = 0; j < TCA_NW; j++) ds4d_mma_k32(acc[i][j], ag, ag8, b[j]);
    }
}

__device__ __forceinline__ void tca_ws_chunk(float (&acc)[TCA_MT][TCA_NW][4], const __nv_bfloat16 *sP,
                                             const __nv_bfloat16 *sKT, int64_t m0, int64_t k0, const tca_layout &L) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    uint32_t b[TCA_NW][4];
#pragma unroll
    for (int j = 0; j < TCA_NW; j++) {
        const uint4 v = *reinterpret_cast<const uint4 *>(&sKT[(warp * TCA_NW * 8 + j * 8 + g) * TCA_LT + t * 8]);
        b[j][0] = v.x, b[j][1] = v.y, b[j][2] = v.z, b[j][3] = v.w;
    }
    tca_ws_mma(acc, sP, b, m0, k0, L);
}

// A pass's outputs (head rows m0·16.., channels c0..) into out [H, d], nothing past H and d.
__device__ __forceinline__ void tca_ws_out(float *out, const float (&acc)[TCA_MT][TCA_NW][4], int64_t m0, int64_t c0,
                                           int64_t H, int64_t d) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < TCA_MT; i++)
#pragma unroll
        for (int j = 0; j < TCA_NW; j++) {
            const int64_t h = (m0 + i) * 16 + g, c = c0 + warp * TCA_NW * 8 + j * 8 + 2 * t;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int64_t hh = h + (q >> 1) * 8, cc = c + (q & 1);
                if (hh < H && cc < d) out[hh * d + cc] = acc[i][j][q];
            }
        }
}

// Product 3: out [H, d] (row stride d) = A [Hp, nk] (bf16 rows of sP, zero past nk) · keys. Passes of TCA_MT m-tiles
// × 128 channels; in each, keys 32 at a time transposed into sKT (zero past nk and d).
__device__ __forceinline__ void tca_weighted_sum(float *out, int64_t H, int64_t d, const __nv_bfloat16 *sP,
                                                 __nv_bfloat16 *sKT, const float *const *kp, int64_t nk,
                                                 const tca_layout &L) {
    constexpr int PC = TCA_NW * TCA_WARPS * 8; // channels per pass
    const int64_t nmt = L.Hp / 16;
    for (int64_t m0 = 0; m0 < nmt; m0 += TCA_MT)
        for (int64_t c0 = 0; c0 < d; c0 += PC) {
            float acc[TCA_MT][TCA_NW][4];
            ds4d_mma_zero(acc);
            for (int64_t k0 = 0; k0 < nk; k0 += TCA_KC) {
                // thread i: channel i % PC of 8 consecutive keys (consecutive threads read consecutive channels of a
                // key), one 16-byte store of the 8 into sKT's row: 80-byte rows put a quarter-warp's 8 rows on
                // distinct banks
                for (int i = threadIdx.x; i < PC * (TCA_KC / 8); i += TCA_THREADS) {
                    const int cc = i % PC, j0 = (i / PC) * 8;
                    const int64_t c = c0 + cc;
                    float v[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) v[u] = k0 + j0 + u < nk && c < d ? kp[k0 + j0 + u][c] : 0.0f;
                    uint4 w;
                    w.x = ds4d_pack_bf16(v[0], v[1]), w.y = ds4d_pack_bf16(v[2], v[3]);
                    w.z = ds4d_pack_bf16(v[4], v[5]), w.w = ds4d_pack_bf16(v[6], v[7]);
                    *reinterpret_cast<uint4 *>(&sKT[cc * TCA_LT + j0]) = w;
                }
                __syncthreads();
                tca_ws_chunk(acc, sP, sKT, m0, k0, L);
                __syncthreads();
            }
            tca_ws_out(out, acc, m0, c0, H, d);
        }
}

// ------------------------------------------------------------------------------------------ pipelined staging
// The same products with the same operands in the same mma order (so the same bits), but a chunk's global loads are
// issued together into registers, and the next chunk's are in flight while this one is multiplied: the kernels above
// wait for one load after another (a warp's 8 key rows, a thread's 4 groups of 8 keys), which made the attention
// latency-bound (one block per query, a few warps per SM). DS4_CUDA_ATTN_REF=1 keeps the kernels above
// (cuda_dev.cu), and the tests compare the two byte for byte.

constexpr int TCA_KW = TCA_KC / TCA_WARPS;                 // key rows a warp stages per chunk (product 1)
constexpr int TCA_PC = TCA_NW * TCA_WARPS * 8;             // channels per pass of product 3
constexpr int TCA_TT = TCA_PC * (TCA_KC / 8) / TCA_THREADS; // a thread's groups of 8 keys per chunk (product 3)
static_assert(TCA_PC * (TCA_KC / 8) % TCA_THREADS == 0, "product 3's staging tasks split evenly");

// Product 1 over every key of the row, as tca_scores. Channels past 128 (d > 128) take tca_scores' staging.
__device__ __forceinline__ void tca_scores_pipe(float *lg, float *dpv, const __nv_bfloat16 *sQ,
                                                const __nv_bfloat16 *sG, __nv_bfloat16 *sK, const float *const *kp,
                                                int64_t nk, int64_t d, float scale, const tca_layout &L) {
    if (L.dp > 128) {
        tca_scores(lg, dpv, sQ, sG, sK, kp, nk, d, scale, L);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane * 4;
    const bool mine = c < (int)L.dp; // this lane's 4 channels are staged (zeros past d)
    float4 v[TCA_KW];                // rows warp, warp + TCA_WARPS, .. of the chunk (tca_stage_keys' rows)
    auto load = [&](int64_t k0) {
#pragma unroll
        for (int u = 0; u < TCA_KW; u++) {
            const int64_t k = k0 + warp + u * TCA_WARPS;
            if (mine) v[u] = tca_get4(k < nk ? kp[k] : nullptr, c, (int)d);
        }
    };
    load(0);
    for (int64_t k0 = 0; k0 < nk; k0 += TCA_KC) {
        if (mine)
#pragma unroll
            for (int u = 0; u < TCA_KW; u++) tca_set4(sK + (warp + u * TCA_WARPS) * L.LQ, c, v[u]);
        __syncthreads();
        if (k0 + TCA_KC < nk) load(k0 + TCA_KC);
        tca_scores_chunk(lg, dpv, sQ, sG, sK, k0, scale, L);
        __syncthreads();
    }
}

// Product 3, as tca_weighted_sum: thread i stages channel i % TCA_PC of the 8 keys (i / TCA_PC)·8.. for i = tid,
// tid + TCA_THREADS, .. (the same sKT contents), the chunk's 8·TCA_TT loads issued together, the next chunk's
// during this one's products.
__device__ __forceinline__ void tca_weighted_sum_pipe(float *out, int64_t H, int64_t d, const __nv_bfloat16 *sP,
                                                      __nv_bfloat16 *sKT, const float *const *kp, int64_t nk,
                                                      const tca_layout &L) {
    const int64_t nmt = L.Hp / 16;
    float v[TCA_TT][8]; // this thread's staged values of a chunk
    for (int64_t m0 = 0; m0 < nmt; m0 += TCA_MT)
        for (int64_t c0 = 0; c0 < d; c0 += TCA_PC) {
            auto load = [&](int64_t k0) {
#pragma unroll
                for (int r = 0; r < TCA_TT; r++) {
                    const int i = threadIdx.x + r * TCA_THREADS, cc = i % TCA_PC, j0 = (i / TCA_PC) * 8;
                    const int64_t c = c0 + cc;
#pragma unroll
                    for (int u = 0; u < 8; u++) v[r][u] = k0 + j0 + u < nk && c < d ? kp[k0 + j0 + u][c] : 0.0f;
                }
            };
            float acc[TCA_MT][TCA_NW][4];
            ds4d_mma_zero(acc);
            load(0);
            for (int64_t k0 = 0; k0 < nk; k0 += TCA_KC) {
#pragma unroll
                for (int r = 0; r < TCA_TT; r++) {
                    const int i = threadIdx.x + r * TCA_THREADS, cc = i % TCA_PC, j0 = (i / TCA_PC) * 8;
                    uint4 w;
                    w.x = ds4d_pack_bf16(v[r][0], v[r][1]), w.y = ds4d_pack_bf16(v[r][2], v[r][3]);
                    w.z = ds4d_pack_bf16(v[r][4], v[r][5]), w.w = ds4d_pack_bf16(v[r][6], v[r][7]);
                    *reinterpret_cast<uint4 *>(&sKT[cc * TCA_LT + j0]) = w;
                }
                __syncthreads();
                if (k0 + TCA_KC < nk) load(k0 + TCA_KC);
                tca_ws_chunk(acc, sP, sKT, m0, k0, L);
                __syncthreads();
            }
            tca_ws_out(out, acc, m0, c0, H, d);
        }
}

// Product 1, then (after the caller's softmax) product 3: the pipelined helpers, or with ref the ones above.
template <bool REF>
__device__ __forceinline__ void tca_scores_sel(float *lg, float *dpv, const __nv_bfloat16 *sQ, const __nv_bfloat16 *sG,
                                               __nv_bfloat16 *sK, const float *const *kp, int64_t nk, int64_t d,
                                               float scale, const tca_layout &L) {
    if (REF) tca_scores(lg, dpv, sQ, sG, sK, kp, nk, d, scale, L);
    else tca_scores_pipe(lg, dpv, sQ, sG, sK, kp, nk, d, scale, L);
}
template <bool REF>
__device__ __forceinline__ void tca_weighted_sum_sel(float *out, int64_t H, int64_t d, const __nv_bfloat16 *sP,
                                                     __nv_bfloat16 *sKT, const float *const *kp, int64_t nk,
                                                     const tca_layout &L) {
    if (REF) tca_weighted_sum(out, H, d, sP, sKT, kp, nk, L);
    else tca_weighted_sum_pipe(out, H, d, sP, sKT, kp, nk, L);
}

// ------------------------------------------------------------------------------------------ bf16 keys
// The full forward and the backward's per-query phase at d = 128 read their keys from bf16 copies of kv and the
// entries (rows_to_bf16: rounded as the staging above rounds them, so the same operands). A chunk of 32 keys is then
// 8 KiB that cp.async copies global -> shared into a ring of TCB_ST buffers, TCB_ST - 1 chunks in flight during a
// chunk's products and no registers held for them (the fp32 staging above holds one chunk in registers and converts
// it; the block waited on each chunk's loads, and product 3's were 8 single loads per key group). Both products read
// the same buffer: product 1 a key's 16-byte channel pieces (as from sK), product 3 the keys of a channel through
// ldmatrix.trans, whose row addresses put keys 8t .. 8t+7 of the chunk into lane t's registers: the k-slots that sKT's
// rows give ds4d_mma_k32. The same operands in the same products in the same order: the fp32 staging's bits
// (tests/test_cuda_bwd_attn compares the two byte for byte).
// A buffer is 32 rows of 256 bytes, row j's 16-byte piece p stored at p ^ tcb_sw(j): a quarter-warp's product-1 reads
// (rows j, j + 1, pieces 4q .. 4q+3), a matrix's eight ldmatrix rows (keys 8a + 2i + b, one piece) and a
// quarter-warp's copies (one row, 8 pieces) each fall on 8 distinct 16-byte bank groups.
constexpr int TCB_D = 128, TCB_ST = 3;
constexpr int TCB_ROW = TCB_D * 2, TCB_BUF = TCA_KC * TCB_ROW;
static_assert(TCA_NW * TCA_WARPS * 8 == TCB_D, "product 3 takes the 128 channels in one pass");

__device__ __forceinline__ int tcb_sw(int j) { return ((j & 1) << 2) | ((j >> 3) & 3); }

// The block's shared memory: tca_layout's fields with d = 128; kp holds the keys' row numbers (uint32) in the copies.
// The backward (grad): the ring at sK for both products (sKT = sK; product 3's first chunks are copied during the
// softmax), P (sP) over the bytes of q and dout (sQ, sG: product 1's operands). The forward: product 1's ring at sK
// holds P afterwards, and product 3's ring (sKT) takes the logits' bytes, free once the softmax and the indexer-KL
// target have read them (at 16 heads and 384 keys, 55 KiB a block: 4 blocks an SM instead of 3).
__host__ __device__ inline tca_layout tcb_layout_of(int64_t H, int64_t maxk, int grad) {
    tca_layout L;
    L.Hp = tca_up(H, 16), L.dp = TCB_D, L.nkp = tca_up(maxk > 0 ? maxk : 1, TCA_KC);
    L.LQ = TCB_D + 32; // as tca_layout_of
    L.LP = L.nkp + 8;
    size_t o = 0;
    auto take = [&o](size_t bytes) { const size_t at = o; o += (bytes + 127) / 128 * 128; return at; };
    const size_t ring = (size_t)TCB_ST * TCB_BUF, lgb = (size_t)(L.Hp * L.nkp) * sizeof(float);
    const size_t pb = (size_t)(L.Hp * L.LP) * 2, qb = (size_t)(L.Hp * L.LQ) * 2;
    L.kp = take((size_t)L.nkp * sizeof(uint32_t));
    L.lg = take(lgb);
    L.dp_ = grad ? take(lgb) : 0;
    L.sK = take(ring);
    if (grad) {
        L.sKT = L.sK;
        const size_t phase = o;
        L.sQ = take(qb);
        L.sG = take(qb);
        const size_t end1 = o;
        o = phase;
        L.sP = take(pb);
        if (end1 > o) o = end1;
    } else {
        L.sQ = take(qb);
        L.sG = 0;
        L.sP = pb <= ring ? L.sK : take(pb);
        L.sKT = lgb >= ring ? L.lg : take(ring);
    }
    L.bytes = o;
    return L;
}

// chunk c (keys 32c .. of the list: rows kr[] of keys; zeros past nk) -> ring buffer c % TCB_ST
__device__ __forceinline__ void tcb_issue(char *ring, const __nv_bfloat16 *keys, const uint32_t *kr, int64_t nk,
                                          int64_t c) {
    char *buf = ring + (c % TCB_ST) * TCB_BUF;
#pragma unroll
    for (int u = 0; u < TCA_KC * (TCB_ROW / 16) / TCA_THREADS; u++) {
        const int p = threadIdx.x + u * TCA_THREADS, j = p >> 4, pc = p & 15;
        const int64_t k = c * TCA_KC + j;
        const __nv_bfloat16 *src = keys + (int64_t)kr[k < nk ? k : 0] * TCB_D + pc * 8;
        ds4d_cp_async16(buf + j * TCB_ROW + ((pc ^ tcb_sw(j)) << 4), src, k < nk ? 16 : 0);
    }
}

// The first TCB_ST - 1 chunks in flight (one commit group each, empty past the list)
__device__ __forceinline__ void tcb_prime(char *ring, const __nv_bfloat16 *keys, const uint32_t *kr, int64_t nk) {
    const int64_t nch = (nk + TCA_KC - 1) / TCA_KC;
    for (int64_t c = 0; c < TCB_ST - 1; c++) {
        if (c < nch) tcb_issue(ring, keys, kr, nk, c);
        ds4d_cp_async_commit();
    }
}

// body(c, buffer) for the chunks of the list in order, each staged in the ring; primed: tcb_prime ran already. Ends
// with a barrier: the ring may be refilled, and what body wrote read, by any thread.
template <typename Body>
__device__ __forceinline__ void tcb_stream(char *ring, const __nv_bfloat16 *keys, const uint32_t *kr, int64_t nk,
                                           bool primed, Body body) {
    const int64_t nch = (nk + TCA_KC - 1) / TCA_KC;
    if (!primed) tcb_prime(ring, keys, kr, nk);
    for (int64_t c = 0; c < nch; c++) {
        ds4d_cp_async_wait<TCB_ST - 2>(); // this thread's copies of chunk c are done
        __syncthreads();                  // everyone's are; everyone is done with chunk c - 1, whose buffer is refilled
        if (c + TCB_ST - 1 < nch) tcb_issue(ring, keys, kr, nk, c + TCB_ST - 1);
        ds4d_cp_async_commit();
        body(c, (const char *)ring + (c % TCB_ST) * TCB_BUF);
    }
    __syncthreads();
}

// Product 1 from the ring, as tca_scores
__device__ __forceinline__ void tcb_scores(float *lg, float *dpv, const __nv_bfloat16 *sQ, const __nv_bfloat16 *sG,
                                           char *ring, const __nv_bfloat16 *keys, const uint32_t *kr, int64_t nk,
                                           float scale, const tca_layout &L) {
    tcb_stream(ring, keys, kr, nk, false, [&](int64_t c, const char *buf) {
        tca_scores_chunk_of(
            lg, dpv, sQ, sG,
            [&](int j, int ch) {
                return *reinterpret_cast<const uint4 *>(buf + j * TCB_ROW + (((ch >> 3) ^ tcb_sw(j)) << 4));
            },
            c * TCA_KC, scale, L);
    });
}

// Product 3 from the ring, as tca_weighted_sum (primed: the first pass's chunks are in flight already)
__device__ __forceinline__ void tcb_weighted_sum(float *out, int64_t H, const __nv_bfloat16 *sP, char *ring,
                                                 const __nv_bfloat16 *keys, const uint32_t *kr, int64_t nk,
                                                 bool primed, const tca_layout &L) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // ldmatrix: lane 8i + r gives row r of matrix i, key 8·(r >> 1) + 2i + (r & 1) of the chunk, so that matrix i's
    // rows 2t and 2t + 1 (lane t's register i after the transpose) are keys 8t + 2i and 8t + 2i + 1
    const int mi = lane >> 3, r = lane & 7, kj = 8 * (r >> 1) + 2 * mi + (r & 1);
    const int64_t nmt = L.Hp / 16;
    for (int64_t m0 = 0; m0 < nmt; m0 += TCA_MT) {
        float acc[TCA_MT][TCA_NW][4];
        ds4d_mma_zero(acc);
        tcb_stream(ring, keys, kr, nk, primed && m0 == 0, [&](int64_t c, const char *buf) {
            uint32_t b[TCA_NW][4];
            const uint32_t row = (uint32_t)__cvta_generic_to_shared(buf + kj * TCB_ROW);
#pragma unroll
            for (int j = 0; j < TCA_NW; j++) {
                const uint32_t at = row + (((warp * TCA_NW + j) ^ tcb_sw(kj)) << 4);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(b[j][0]), "=r"(b[j][1]), "=r"(b[j][2]), "=r"(b[j][3])
                             : "r"(at)
                             : "memory");
            }
            tca_ws_mma(acc, sP, b, m0, c * TCA_KC, L);
        });
        tca_ws_out(out, acc, m0, 0, H, TCB_D);
    }
}

#endif
