// cuda_bwd_linear.cu — the backward of the linear layers on the GPU and of what sits around them: the
// log-probabilities' gradient, dx = dy·W and dW += dyᵀ·x (plain and by expert), the RMSNorm backward, column sums,
// stream sums and the embedding gradient.
//
// Every result is the same bits run after run: no floating-point atomics; each output element is reduced by one
// thread (or one fixed tree of a block) in an order fixed by the shapes. Where the CPU reference adds in an order
// that a GPU can follow cheaply (column sums, stream sums, the embedding rows in token order) the kernels follow it
// and give the CPU's bits; the products and the double sums of the row ops follow their own fixed orders.
//
// The products. One family of tiled kernels computes y(m, n) (+)= Σ_r A(m, r)·B(n, r) for operands read through
// strides, A(m, r) = a[m·a_rs + r·a_ks] and B(n, r) = b[n·b_rs + r·b_ks], so that dx = dy·W reads W across its rows
// and dW = dyᵀ·x reads dy and x down their columns where they lie: no transposed copies. The reduction runs over r
// in chunks (16 fp32 / 32 bf16) in r order; slices of 256 r's are summed apart and added in slice order (as the
// forward GEMM does: shorter fp32 chains). fp32: fmaf in registers; bf16: A and B rounded to bf16 (round to nearest
// even; a bf16 weight as it is) and multiplied on the tensor cores (mma.sync m16n8k16, fp32 accumulation) through
// the forward GEMM's steps (cuda_tile.cuh). Groups: rows [off[e], off[e+1]) of dy / dx use expert e's W
// (linear_bwd_x_grouped: each block finds its expert tile from off, as the forward's grouped GEMM), or the reduction
// runs over those rows into expert e's dW (linear_bwd_w_grouped: grid z = expert); off is read on the device, nothing
// synchronises; with bf16 weights linear_bwd_x_grouped goes through the forward's pipelined grouped GEMM on a
// transposed copy of the layer's experts instead (ds4_cuda_grouped_dx_bf16: the same sums, so the same bits, at the
// forward's rate). A plain product whose output has few tiles (a long reduction into a small dW) cuts r into a number of
// chunks fixed by the shapes, writes per-chunk partials and adds them in chunk order. An fp32 dx by a weight of at most
// 32 rows (the mHC mixing matrix, the router gate) keeps W in registers instead (prod_f32_skinny: the tiles' bits).
//
// In bf16 the plain (not grouped) products go to cuBLAS instead: the backward needs no batch invariance (only the
// forward must give a sequence the same bits whatever shares its batch: the rollout's log-probabilities), only
// determinism, and cuBLAS gives the same bits at every run for the same shapes on the same GPU with one stream and
// its own workspace (its documented reproducibility), about twice as fast as the tiles on training shapes. The fp32
// operands are first rounded to bf16 (nearest even, as the tiles round them) into scratch slot 1; the products
// accumulate in fp32 (CUBLAS_COMPUTE_32F on the tensor cores). dx's rounded dy stays at the start of slot 1 for the
// dW of the same y = x Wᵀ that the schedule issues right after it (dy_kept, ops.h): rounding it is a pass over
// [T, O] fp32 as long as a small product itself, and the same values either way. A dW off a 16-byte boundary (the
// flat gradient buffer's) is formed in aligned scratch and added (add_bcast): cuBLAS's fast kernels need it.
// The head's logits gradient comes to its two products already rounded (logp_bwd's dl16). DS4_CUDA_BWD_REF=1 rounds it
// again and sends the expert products and the fp32 dx by a weight of few rows to the tiles: the reference paths whose
// bytes the tests compare. fp32 mode keeps the tiles: it is the reference mode, and its
// 10-step trajectory check (tests/test_cuda_train.c, tiny_a) holds with their order; tiny_a is chaotic under AdamW
// (a ~1e-7 change in step 0's gradients, as cuBLAS's fp32 order gives, moves step 1's loss by 1.5e-5 and the
// trajectory ends 1e-3 from torch; with the tiles it stays within 1.5e-7). The tiles also keep the
// grouped products, whose row groups live on the device (cuBLAS would need them on the host: a synchronisation
// per layer).
#include <cstdio>

#include <cublas_v2.h>

#include "cuda_dev.cuh"
#include "fp4.h"
#include "cuda_fp4.cuh"
#include "cuda_tile.cuh"

namespace {

constexpr int RSLICE = 256;        // r's per slice of a product's reduction (the forward GEMM's KSLICE)
constexpr int SPLIT_BLOCKS = 256;  // a plain product with fewer output tiles splits r to reach about this many blocks
constexpr int NORM_CHUNK = 256;    // rows per partial of the norm weight gradient

// ------------------------------------------------------------------------------------------ products

struct prod_args {
    float *y;
    int64_t ldy;                  // y(m, n) at y[m·ldy + n]
    const float *a;
    int64_t a_rs, a_ks;           // A(m, r) = a[m·a_rs + r·a_ks]
    const void *b;
    int64_t b_rs, b_ks;           // B(n, r) = b[n·b_rs + r·b_ks]: fp32, or bf16 bits (a bf16 weight)
    int64_t M, N, R;
    const int64_t *off;           // NULL: plain; else E + 1 group bounds (device memory)
    int64_t E;
    int rgroup;                   // with off: 0 rows m of group e use b + e·bstride; 1 block z sums r over group z
    int64_t bstride, ystride;     //   into y + z·ystride
    float *part;                  // split: block z sums r over [z·chunk, +chunk) into part [splits, M, N]
    int64_t chunk;
    int acc;                      // y += Σ (1) or y = Σ (0); the sum is formed first, then added once
    const uint8_t *bs;            // B an FP4-resident weight (b: its codes): its scales (cuda_fp4.cuh)
};

struct out_t {
    float *y;
    int64_t ld;
    int add;
};

__device__ __forceinline__ void emit(const out_t &o, int64_t m, int64_t n, float v) {
    float *q = o.y + m * o.ld + n;
    *q = o.add ? *q + v : v;
}

// The rows [m0, m1) of tile `tile` and the offset of its B; false when the block has no tile (row groups).
template <int BM>
__device__ __forceinline__ bool tile_rows(const prod_args &p, int64_t tile, int64_t &m0, int64_t &m1, int64_t &boff) {
    if (!p.off || p.rgroup) {
        m0 = tile * BM;
        m1 = p.M;
        boff = 0;
        return m0 < p.M;
    }
    return ds4d_group_tile<BM>(p.off, p.E, p.bstride, tile, m0, m1, boff);
}

// The reduction range [r0, r1) of grid slice z and where its sums go; false for an empty group (its dW untouched,
// as on the CPU: adding a sum of nothing would turn -0 into +0).
__device__ __forceinline__ bool red_range(const prod_args &p, int64_t z, int64_t &r0, int64_t &r1, out_t &o) {
    if (p.off && p.rgroup) {
        r0 = p.off[z];
        r1 = p.off[z + 1];
        o = {p.y + z * p.ystride, p.ldy, p.acc};
        return r1 > r0;
    }
    if (p.part) {
        r0 = z * p.chunk;
        r1 = r0 + p.chunk < p.R ? r0 + p.chunk : p.R;
        o = {p.part + z * p.M * p.N, p.N, 0};
        return true;
    }
    r0 = 0;
    r1 = p.R;
    o = {p.y, p.ldy, p.acc};
    return true;
}

// Loads into shared memory: consecutive threads take consecutive n of B (its n stride is 1 in every use: W read
// across its rows, x down its columns) and, with AM, consecutive m of A (dy down its columns, for dW), else
// consecutive r of A (dy along its rows, for dx); so every warp reads contiguous memory. The mapping only decides
// which thread loads what, never a sum.

// fp32: BM × BN per block of (BM/TM)·(BN/TN) threads, TM × TN outputs each; chunks of 16 r's staged in shared memory.
// BP: how B is read (const float *, or an FP4-resident weight decoded to fp32).
template <int BM, int BN, int TM, int TN, bool AM, typename BP>
__global__ void __launch_bounds__((BM / TM) * (BN / TN)) prod_f32(prod_args p) {
    constexpr int BK = 16, NTH = (BM / TM) * (BN / TN);
    static_assert(RSLICE % BK == 0, "slices hold whole chunks");
    __shared__ float sA[BK][BM + 1], sB[BK][BN + 1];
    int64_t m0, m1, boff, r0, r1;
    out_t o;
    if (!tile_rows<BM>(p, blockIdx.x, m0, m1, boff) || !red_range(p, blockIdx.z, r0, r1, o)) return;
    const BP B = ds4d_weight<BP>(p.b, p.bs) + boff;
    const int64_t n0 = (int64_t)blockIdx.y * BN, mend = m1 < m0 + BM ? m1 : m0 + BM;
    const int tid = threadIdx.x, ty = tid / (BN / TN), tx = tid % (BN / TN);
    float tot[TM][TN], acc[TM][TN];
    ds4d_fma_zero(tot);
    ds4d_fma_zero(acc);
    for (int64_t k0 = r0; k0 < r1; k0 += BK) {
        for (int i = tid; i < BM * BK; i += NTH) {
            const int m = AM ? i % BM : i / BK, kk = AM ? i / BM : i % BK;
            const int64_t r = m0 + m, k = k0 + kk;
            sA[kk][m] = r < mend && k < r1 ? p.a[r * p.a_rs + k * p.a_ks] : 0.0f;
        }
        for (int i = tid; i < BN * BK; i += NTH) {
            const int n = i % BN, kk = i / BN;
            const int64_t c = n0 + n, k = k0 + kk;
            sB[kk][n] = c < p.N && k < r1 ? B[c * p.b_rs + k * p.b_ks] : 0.0f;
        }
        __syncthreads();
        ds4d_fma_chunk(acc, sA, sB, ty, tx);
        __syncthreads();
        if ((k0 - r0 + BK) % RSLICE == 0 || k0 + BK >= r1) // a slice ends: its partial joins the total
            ds4d_fma_fold(tot, acc);
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t m = m0 + ty * TM + i;
        if (m >= mend) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t n = n0 + tx * TN + j;
            if (n < p.N) emit(o, m, n, tot[i][j]);
        }
    }
}

// bf16 ------------------------------------------------------------------------------------------

// An operand value as bf16: fp32 rounded to nearest even (as ds4d_pack_bf16, cuda_tile.cuh), bf16 bits as they are.
__device__ __forceinline__ __nv_bfloat16 to_bf16(float v) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf16(unsigned short v) { return __ushort_as_bfloat16(v); }

// bf16: BM × BN per block of (BM/WM)·(BN/WN) warps, each WM × WN of m16n8 tiles; chunks of 32 r's staged in shared
// memory as bf16 rows of 40 (sA[m][k], sB[n][k]) in two buffers, the next chunk's values loaded to registers before
// the current one is multiplied on the tensor cores as the forward GEMM does (cuda_tile.cuh) and stored into the other
// buffer after it: one barrier per chunk, as the forward's tiles. BP: how B is read; its element type TB (float:
// rounded here; unsigned short: bf16 bits, of a bf16 weight or of an FP4-resident one decoded, cuda_fp4.cuh).
template <int BM, int BN, int WM, int WN, bool AM, typename BP>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) prod_bf16(prod_args p) {
    using TB = typename ds4d_elem<BP>::type;
    constexpr int NTH = (BM / WM) * (BN / WN) * 32, MT = WM / 16, NT = WN / 8, LDS = 40, KC = 32;
    constexpr int AL = BM * KC / NTH, BL = BN * KC / NTH; // values per thread and chunk
    static_assert(AL * NTH == BM * KC && BL * NTH == BN * KC && RSLICE % KC == 0, "tile shapes");
    static_assert(NTH % BM == 0 && NTH % KC == 0 && NTH % BN == 0, "a thread keeps its row (AM) or k across l");
    __shared__ __align__(16) __nv_bfloat16 sA[2][BM * LDS], sB[2][BN * LDS];
    int64_t m0, m1, boff, r0, r1;
    out_t o;
    if (!tile_rows<BM>(p, blockIdx.x, m0, m1, boff) || !red_range(p, blockIdx.z, r0, r1, o)) return;
    const BP B = ds4d_weight<BP>(p.b, p.bs) + boff;
    const int64_t n0 = (int64_t)blockIdx.y * BN, mend = m1 < m0 + BM ? m1 : m0 + BM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
    float acc[MT][NT][4], tot[MT][NT][4];
    ds4d_mma_zero(acc);
    ds4d_mma_zero(tot);
    // This thread's elements of a chunk: A row ta (+ l·SA with !AM) at k ka (+ l·SA with AM); B row tb at k kb + l·SB.
    constexpr int SA = AM ? NTH / BM : NTH / KC, SB = NTH / BN;
    const int ta = AM ? tid % BM : tid / KC, ka = AM ? tid / BM : tid % KC, tb = tid % BN, kb = tid / BN;
    const int64_t astep = AM ? SA * p.a_ks : SA * p.a_rs, bstep = SB * p.b_ks;
    const bool brow = n0 + tb < p.N;
    float ra[AL];
    TB rb[BL];
    auto fetch = [&](int64_t k0) {
        const float *qa = p.a + (m0 + ta) * p.a_rs + (k0 + ka) * p.a_ks;
#pragma unroll
        for (int l = 0; l < AL; l++) {
            const bool in = (AM ? m0 + ta < mend : m0 + ta + l * SA < mend) && (AM ? k0 + ka + l * SA : k0 + ka) < r1;
            ra[l] = in ? qa[l * astep] : 0.0f;
        }
        const BP qb = B + (n0 + tb) * p.b_rs + (k0 + kb) * p.b_ks;
#pragma unroll
        for (int l = 0; l < BL; l++) rb[l] = brow && k0 + kb + l * SB < r1 ? qb[l * bstep] : (TB)0;
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int l = 0; l < AL; l++)
            sA[buf][(AM ? ta : ta + l * SA) * LDS + (AM ? ka + l * SA : ka)] = to_bf16(ra[l]);
#pragma unroll
        for (int l = 0; l < BL; l++) sB[buf][tb * LDS + kb + l * SB] = to_bf16(rb[l]);
    };
    fetch(r0);
    stash(0);
    __syncthreads();
    int buf = 0;
    for (int64_t k0 = r0; k0 < r1; k0 += KC, buf ^= 1) {
        const bool more = k0 + KC < r1;
        if (more) fetch(k0 + KC);
        ds4d_mma_chunk<MT, NT, LDS>(acc, sA[buf], sB[buf], wm, wn, g, t);
        if (more) stash(buf ^ 1);
        __syncthreads();
        if ((k0 - r0 + KC) % RSLICE == 0 || !more) // a slice ends: its partial joins the total
            ds4d_mma_fold(tot, acc);
    }
    // the m16n8 accumulator layout: (row g, columns 2t, 2t+1) and (row g + 8, the same columns)
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int64_t m = m0 + wm + i * 16 + g + (q >> 1) * 8, n = n0 + wn + j * 8 + 2 * t + (q & 1);
                if (m < mend && n < p.N) emit(o, m, n, tot[i][j][q]);
            }
}

// y (+)= the split partials of each output, added in chunk order.
__global__ void split_sum(float *y, int64_t ldy, const float *part, int64_t S, int64_t M, int64_t N, int acc) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M * N) return;
    float s = part[i];
    for (int64_t z = 1; z < S; z++) s += part[z * M * N + i];
    float *q = y + (i / N) * ldy + i % N;
    *q = acc ? *q + s : s;
}

// dx = dy·W where W has few rows (R <= SKINNY_R: the mHC mixing matrix, 24 rows; the router gate, 32 experts; the
// HyperHead, n rows): the tiles spend their time staging 16-r chunks of both operands for a product that is bound by
// writing dx. Here a thread keeps its SK_TN columns of W, all R rows, in registers for good and runs down SK_ROWS
// rows of dy (staged in shared memory, read as broadcasts), storing SK_TN consecutive outputs at once. The same bits
// as prod_f32, whose order for R <= RSLICE is: acc = 0, acc = fmaf(A(m, r), B(n, r), acc) for r = 0 .. ceil16(R) − 1
// with A = B = 0 past R (the chunk's padding), then one slice folds: tot = 0 + acc, and emit. Here the chain runs to
// RP (the template's bound, >= R) with the same zero padding, then 0 + acc. The padded steps fmaf(+0, +0, acc) = acc
// + (+0) change nothing but −0 into +0, and 0 + acc does that anyway, so any number of them gives the same final
// value (a NaN stays the GPU's canonical NaN either way): equal bits for every R <= RP.
constexpr int SKINNY_R = 32, SK_THREADS = 128, SK_TN = 4, SK_ROWS = 32;
static_assert(SK_ROWS % 2 == 0 && SK_TN == 4, "rows in pairs; a float4 of outputs");

template <int RP>
__global__ void __launch_bounds__(SK_THREADS) prod_f32_skinny(prod_args p, int vec) {
    static_assert(RP % 4 == 0, "rows of sA are read as float4s");
    __shared__ __align__(16) float sA[SK_ROWS][RP];
    const int tid = threadIdx.x;
    const int64_t n0 = ((int64_t)blockIdx.x * SK_THREADS + tid) * SK_TN, m0 = (int64_t)blockIdx.y * SK_ROWS;
    const int64_t mn = p.M - m0 < SK_ROWS ? p.M - m0 : SK_ROWS;
    const float *B = static_cast<const float *>(p.b);
    for (int i = tid; i < SK_ROWS * RP; i += SK_THREADS) {
        const int m = i / RP, r = i % RP;
        sA[m][r] = m < mn && r < p.R ? p.a[(m0 + m) * p.a_rs + r * p.a_ks] : 0.0f;
    }
    float w[RP][SK_TN];
#pragma unroll
    for (int r = 0; r < RP; r++)
#pragma unroll
        for (int j = 0; j < SK_TN; j++) w[r][j] = r < p.R && n0 + j < p.N ? B[(n0 + j) * p.b_rs + r * p.b_ks] : 0.0f;
    __syncthreads();
    if (n0 >= p.N) return;
    // two rows at a time (eight independent chains); a row past mn reads sA's zeros and is not stored
    for (int m = 0; m < mn; m += 2) {
        float acc[2][SK_TN];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < SK_TN; j++) acc[h][j] = 0.0f;
#pragma unroll
        for (int r0 = 0; r0 < RP; r0 += 4) { // dy's values four at a time (one shared load per 32 fmaf)
            const float4 q0 = *reinterpret_cast<const float4 *>(&sA[m][r0]);
            const float4 q1 = *reinterpret_cast<const float4 *>(&sA[m + 1][r0]);
            const float a0[4] = {q0.x, q0.y, q0.z, q0.w}, a1[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int j = 0; j < SK_TN; j++) {
                    acc[0][j] = fmaf(a0[u], w[r0 + u][j], acc[0][j]);
                    acc[1][j] = fmaf(a1[u], w[r0 + u][j], acc[1][j]);
                }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (m + h >= mn) break;
            float v[SK_TN];
#pragma unroll
            for (int j = 0; j < SK_TN; j++) v[j] = __fadd_rn(0.0f, acc[h][j]); // the slice's fold into tot = 0
            float *q = p.y + (m0 + m + h) * p.ldy + n0;
            if (vec) { // all SK_TN columns inside, 16-byte aligned
                float4 o = make_float4(v[0], v[1], v[2], v[3]);
                if (p.acc) {
                    const float4 y = *reinterpret_cast<const float4 *>(q);
                    o = make_float4(y.x + o.x, y.y + o.y, y.z + o.z, y.w + o.w);
                }
                *reinterpret_cast<float4 *>(q) = o;
            } else {
#pragma unroll
                for (int j = 0; j < SK_TN; j++)
                    if (n0 + j < p.N) q[j] = p.acc ? q[j] + v[j] : v[j];
            }
        }
    }
}

constexpr int F32_BM = 64, F32_BN = 64, BF_BM = 64, BF_BN = 128;

// prod_f32_skinny over the product, RP the least of 8, 16, 24, 32 that holds R.
void product_skinny(ds4_dev *d, const char *op, const prod_args &p, const char *shapes) {
    const dim3 grid((unsigned)((p.N + SK_THREADS * SK_TN - 1) / (SK_THREADS * SK_TN)),
                    (unsigned)((p.M + SK_ROWS - 1) / SK_ROWS));
    const int vec = p.N % SK_TN == 0 && p.ldy % SK_TN == 0 && ((uintptr_t)p.y & 15) == 0;
    const cudaStream_t s = cdev(d)->stream;
    if (p.R <= 8) prod_f32_skinny<8><<<grid, SK_THREADS, 0, s>>>(p, vec);
    else if (p.R <= 16) prod_f32_skinny<16><<<grid, SK_THREADS, 0, s>>>(p, vec);
    else if (p.R <= 24) prod_f32_skinny<24><<<grid, SK_THREADS, 0, s>>>(p, vec);
    else prod_f32_skinny<32><<<grid, SK_THREADS, 0, s>>>(p, vec);
    ds4_cuda_launched(d, op, "%s (F32, %lld rows of W in registers)", shapes, (long long)p.R);
}

// Run one product in the mode wdt (F32: fp32 kernel; BF16: tensor cores). weight_b: B is the weight, in wdt, and A is
// read along its rows (dx = dy·W); else B is fp32 activations (rounded in BF16) and A is read down its columns (dW).
// fp4: B is an FP4-resident weight (codes p.b, scales p.bs) that the same kernel decodes to wdt's values.
void product(ds4_dev *d, const char *op, prod_args p, ds4_dtype wdt, bool weight_b, const char *shapes,
             bool fp4 = false) {
    cuda_dev *cd = cdev(d);
    if (wdt != DS4_F32 && wdt != DS4_BF16) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s %s: weight dtype %s (F32 or BF16%s)", op, shapes, ds4_wdt_name(wdt),
                     wdt == DS4_FP4_PACKED ? "; FP4-resident weights only in the routed experts' products" : "");
        return;
    }
    /* an FP4-resident B: W [R, N] (n the column) by whole 32-value blocks of its rows (fp4.h), its scales given */
    if (fp4 && (!weight_b || p.b_rs != 1 || p.N % DS4_FP4_BLOCK || p.bstride % DS4_FP4_BLOCK || !p.bs)) {
        ds4_dev_fail(d, DS4_ERR_ARG, "%s %s: an FP4-resident weight's rows must be whole blocks of %d values, with "
                     "scales%s", op, shapes, DS4_FP4_BLOCK, p.bs ? "" : " (none given)");
        return;
    }
    // fp32 dx by a weight of few rows (not with DS4_CUDA_BWD_REF=1: the tiles define the bits)
    if (wdt == DS4_F32 && weight_b && !fp4 && !p.off && p.b_rs == 1 && p.R > 0 && p.R <= SKINNY_R &&
        !cd->bwd_ref && (p.M + SK_ROWS - 1) / SK_ROWS <= 65535 && (p.N + SK_THREADS * SK_TN - 1) / (SK_THREADS * SK_TN) <= 65535)
        return product_skinny(d, op, p, shapes);
    const int BM = wdt == DS4_F32 ? F32_BM : BF_BM, BN = wdt == DS4_F32 ? F32_BN : BF_BN;
    const int64_t gx = (p.M + BM - 1) / BM + (p.off && !p.rgroup ? p.E : 0), gy = (p.N + BN - 1) / BN;
    int64_t gz = p.off && p.rgroup ? p.E : 1;
    p.part = nullptr;
    p.chunk = p.R;
    if (!p.off && p.R > RSLICE && gx * gy < SPLIT_BLOCKS) {
        // a small output over a long reduction: chunks of whole slices, their number fixed by the shapes alone
        const int64_t slices = (p.R + RSLICE - 1) / RSLICE;
        int64_t want = (SPLIT_BLOCKS + gx * gy - 1) / (gx * gy);
        if (want > slices) want = slices;
        p.chunk = (slices + want - 1) / want * RSLICE;
        gz = (p.R + p.chunk - 1) / p.chunk;
    }
    if (gx > 0x7fffffff || gy > 65535 || gz > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s %s: a grid of %lld x %lld x %lld blocks is beyond CUDA's limits", op,
                     shapes, (long long)gx, (long long)gy, (long long)gz);
        return;
    }
    if (gz > 1 && !p.off) {
        p.part = (float *)ds4_cuda_scratch(d, (size_t)(gz * p.M * p.N) * sizeof(float), op, 0);
        if (!p.part) return;
    }
    const dim3 grid((unsigned)gx, (unsigned)gy, (unsigned)gz);
    if (wdt == DS4_F32 && fp4)
        prod_f32<F32_BM, F32_BN, 4, 4, false, ds4d_fp4w<float>><<<grid, 256, 0, cd->stream>>>(p);
    else if (wdt == DS4_F32 && weight_b)
        prod_f32<F32_BM, F32_BN, 4, 4, false, const float *><<<grid, 256, 0, cd->stream>>>(p);
    else if (wdt == DS4_F32)
        prod_f32<F32_BM, F32_BN, 4, 4, true, const float *><<<grid, 256, 0, cd->stream>>>(p);
    else if (fp4)
        prod_bf16<BF_BM, BF_BN, 32, 32, false, ds4d_fp4w<unsigned short>><<<grid, 256, 0, cd->stream>>>(p);
    else if (weight_b)
        prod_bf16<BF_BM, BF_BN, 32, 32, false, const unsigned short *><<<grid, 256, 0, cd->stream>>>(p);
    else
        prod_bf16<BF_BM, BF_BN, 32, 32, true, const float *><<<grid, 256, 0, cd->stream>>>(p);
    if (!ds4_cuda_launched(d, op, "%s (%s%s)", shapes, fp4 ? "FP4-resident, as " : "", ds4_dtype_name(wdt)) || !p.part)
        return;
    split_sum<<<ds4_blocks(p.M * p.N, 256), 256, 0, cd->stream>>>(p.y, p.ldy, p.part, gz, p.M, p.N, p.acc);
    ds4_cuda_launched(d, op, "%s (%s): the sum of %lld partials", shapes, ds4_dtype_name(wdt), (long long)gz);
}

// ------------------------------------------------------------------------------------------ row ops

// Threads of a row block for a row of `width`: the block shape (so the reduction tree) follows the width only.
int row_threads(int64_t width) { return width >= 256 ? 256 : (width >= 128 ? 128 : (width >= 64 ? 64 : 32)); }

// A logit's share of the row's gradient, −g·e/Σ (g·(onehot − softmax) without the onehot): e32 (the bf16 mode's fp32
// exponentials) as (−g/Σ)·e, one multiply; else the CPU's −g·e/Σ, a double division per logit.
__device__ __forceinline__ double logit_grad(double e, double g, double gs, double se, bool e32) {
    return e32 ? gs * e : -g * e / se;
}

// One block per row: g = dlogp[r] (or g0); dl = g·(onehot − softmax) with the max and Σ exp as row_stats forms them
// (cuda_head.cu: the exponentials ds4d_row_exp, Σ in double in the same order).
// dl may be the logits: every value of the row is read (two block sums, each ending with a barrier) before any
// is written, and each thread then reads and writes only its own elements.
constexpr int LOGP_THREADS = 256;

__global__ void __launch_bounds__(LOGP_THREADS) logp_bwd_kernel(float *dl, const float *logits, int64_t V,
                                                                 const int64_t *tgt, const float *dlogp, double g0,
                                                                 int e32) {
    __shared__ double shd[8];
    __shared__ float shf[8];
    const int64_t r = blockIdx.x, y = tgt[r];
    const float *z = logits + r * V;
    float *o = dl + r * V;
    const double g = dlogp ? (double)dlogp[r] : g0;
    if (y == -100 || g == 0) {
        for (int64_t v = threadIdx.x; v < V; v += LOGP_THREADS) o[v] = 0.0f;
        return;
    }
    float mx = -INFINITY;
    ds4d_row_visit<LOGP_THREADS, 8>(z, V, [&](int64_t, float zv) { mx = zv > mx ? zv : mx; });
    mx = ds4d_block_maxf(mx, shf);
    double se = 0;
    ds4d_row_visit<LOGP_THREADS, 8>(z, V, [&](int64_t, float zv) { se += ds4d_row_exp(zv, mx, e32); });
    se = ds4d_block_sum(se, shd);
    const double gs = -g / se;
    ds4d_row_visit<LOGP_THREADS, 8>(z, V, [&](int64_t v, float zv) {
        float val = (float)logit_grad(ds4d_row_exp(zv, mx, e32), g, gs, se, e32);
        if (v == y) val += (float)g;
        o[v] = val;
    });
}

// logp_bwd_kernel's last pass alone, given each row's max and Σ exp as the forward's ce_rows / logprobs formed them on
// these logits (ops.h: the same values as the two passes above would give): the same expression on the same values,
// so the same bits, element by element over the whole chunk. Those two passes were most of the kernel (its double
// exps; one block a row left a partial last wave). Rows r0 + blockIdx.y; 4 values a thread, one 16-byte load and
// store where V % 4 == 0 and both buffers are 16-byte aligned (vec).
constexpr int LOGPS_THREADS = 256;

// dl16 (not NULL): the values rounded to bf16 (nearest even, as rows_to_bf16 rounds the products' operands) go there
// [rows, V] instead of to dl.
__global__ void __launch_bounds__(LOGPS_THREADS) logp_bwd_stats_kernel(float *dl, const float *logits, int64_t V,
                                                                       const int64_t *tgt, const float *dlogp,
                                                                       double g0, const float *rmx, const double *rse,
                                                                       int64_t r0, int vec, __nv_bfloat16 *dl16,
                                                                       int e32) {
    const int64_t r = r0 + blockIdx.y, v0 = ((int64_t)blockIdx.x * LOGPS_THREADS + threadIdx.x) * 4;
    if (v0 >= V) return;
    const int64_t y = tgt[r];
    const double g = dlogp ? (double)dlogp[r] : g0;
    const float *z = logits + r * V + v0;
    float *o = dl + r * V + v0;
    const int n = V - v0 < 4 ? (int)(V - v0) : 4;
    float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (y != -100 && g != 0) {
        const float mx = rmx[r];
        const double se = rse[r], gs = -g / se;
        float zv[4];
        if (vec) {
            const float4 q = *reinterpret_cast<const float4 *>(z);
            zv[0] = q.x, zv[1] = q.y, zv[2] = q.z, zv[3] = q.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) zv[j] = j < n ? z[j] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            out[j] = (float)logit_grad(ds4d_row_exp(zv[j], mx, e32), g, gs, se, e32);
            if (v0 + j == y) out[j] += (float)g;
        }
    }
    if (dl16) {
        __nv_bfloat16 *o16 = dl16 + r * V + v0;
        if (vec)
            *reinterpret_cast<uint2 *>(o16) =
                make_uint2(ds4d_pack_bf16(out[0], out[1]), ds4d_pack_bf16(out[2], out[3]));
        else
            for (int j = 0; j < n; j++) o16[j] = __float2bfloat16_rn(out[j]);
        return;
    }
    if (vec) *reinterpret_cast<float4 *>(o) = make_float4(out[0], out[1], out[2], out[3]);
    else
        for (int j = 0; j < n; j++) o[j] = out[j];
}

struct norm_args {
    float *dx;
    float *dw;
    const float *dy, *x, *w;
    float *rinv;                  // [groups, rows] (float, as the CPU keeps them)
    double *part;                 // [groups, chunks, width]
    int64_t rows, width, groups, gstride, chunks;
    double eps;
    int acc;
};

// A row's reduction order, whichever kernel runs it: the row is spread over a block of nt = row_threads(width) threads,
// thread t adding elements t, t + nt, t + 2nt, .. in that order into a double; then ds4d_block_sum's tree (each warp's
// shuffle tree, then warp 0's over the warp sums). The element arithmetic is pinned with intrinsics to what the first
// (loop) kernel compiled to: ptxas fused ss += x·x and dot += wdy·x into FMAs and dx = wdy·ri − x·k into
// fma(wdy, ri, −x·k) (wdy = w·dy in fp32, or dy), so the bits do not hang on the compiler's fusion choices.
__device__ __forceinline__ double norm_sq_acc(double s, float x) { return __fma_rn((double)x, (double)x, s); }
__device__ __forceinline__ double norm_dot_acc(double s, float wdy, float x) {
    return __fma_rn((double)wdy, (double)x, s);
}
__device__ __forceinline__ float norm_wdy(const float *w, const float *dy, int64_t i) {
    return w ? __fmul_rn(w[i], dy[i]) : dy[i];
}
__device__ __forceinline__ double norm_rinv(double ss, int64_t n, double eps) {
    return 1.0 / sqrt(__dadd_rn(__ddiv_rn(ss, (double)n), eps));
}
__device__ __forceinline__ double norm_k(double ri, double dot, int64_t n) { // ri³·dot / n
    return __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(ri, ri), ri), dot), (double)n);
}
__device__ __forceinline__ float norm_dx(float wdy, float x, double ri, double k, float dx, int acc) {
    const float gi = (float)__fma_rn((double)wdy, ri, -__dmul_rn((double)x, k));
    return acc ? __fadd_rn(dx, gi) : gi;
}

// One block per (group, row), rows wider than the register kernels take. rinv_only: the RMS factor alone (for the
// weight gradient); else dx (written or added). dx may alias dy: the row's dot is a block sum (ending with a barrier)
// before any dx is written, and each thread then reads dy[i] before it writes dx[i] for its own i.
__global__ void norm_bwd_rows(norm_args a, int rinv_only) {
    __shared__ double sh[8];
    const int64_t gr = blockIdx.x, g = gr / a.rows, r = gr % a.rows, n = a.width;
    const int64_t o = g * a.gstride + r * n;
    const float *x = a.x + o, *dy = a.dy + o, *w = a.w;
    float *dx = a.dx + o;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = norm_sq_acc(ss, x[i]);
    ss = ds4d_block_sum(ss, sh);
    const double ri = norm_rinv(ss, n, a.eps);
    if (rinv_only) {
        if (threadIdx.x == 0) a.rinv[gr] = (float)ri;
        return;
    }
    double dot = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dot = norm_dot_acc(dot, norm_wdy(w, dy, i), x[i]);
    dot = ds4d_block_sum(dot, sh);
    const double k = norm_k(ri, dot, n);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        dx[i] = norm_dx(norm_wdy(w, dy, i), x[i], ri, k, dx[i], a.acc);
}

// The same per row, the row held in registers: PER elements per thread of a 256-thread block (rows of 256 to
// 256·PER), every load of the row (x, dy, w, and dx when added) issued at once; the loop kernel waited on one load
// per element per pass and read x three times. dx may alias dy: every value is read before the first barrier. Two or
// three blocks an SM (PER 16 needs ~100 registers): one loads while another reduces.
template <int PER, bool RINV_ONLY>
__global__ void __launch_bounds__(256, PER <= 8 ? 3 : 2) norm_rows_block(norm_args a) {
    __shared__ double sh[8];
    const int64_t gr = blockIdx.x, g = gr / a.rows, r = gr % a.rows, n = a.width;
    const int64_t o = g * a.gstride + r * n;
    const float *x = a.x + o, *dy = a.dy + o;
    float *dx = a.dx + o;
    float xs[PER], wdy[PER], d0[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int64_t i = threadIdx.x + 256 * j;
        xs[j] = i < n ? x[i] : 0.0f;
        if constexpr (RINV_ONLY) continue;
        wdy[j] = i < n ? norm_wdy(a.w, dy, i) : 0.0f;
        d0[j] = i < n && a.acc ? dx[i] : 0.0f;
    }
    double ss = 0;
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (threadIdx.x + 256 * j < n) ss = norm_sq_acc(ss, xs[j]);
    ss = ds4d_block_sum(ss, sh);
    const double ri = norm_rinv(ss, n, a.eps);
    if constexpr (RINV_ONLY) {
        if (threadIdx.x == 0) a.rinv[gr] = (float)ri;
    } else {
        double dot = 0;
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (threadIdx.x + 256 * j < n) dot = norm_dot_acc(dot, wdy[j], xs[j]);
        dot = ds4d_block_sum(dot, sh);
        const double k = norm_k(ri, dot, n);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t i = threadIdx.x + 256 * j;
            if (i < n) dx[i] = norm_dx(wdy[j], xs[j], ri, k, d0[j], a.acc);
        }
    }
}

// Rows narrower than 256 (a block of nt = 32·nw ≤ 128 threads, PER ≤ 2 elements each): a warp per row, 8 rows per
// block, no barrier. Lane l plays the block's threads l + 32v (v < nw) and adds each one's elements in their order;
// then each played warp's shuffle tree, and the tree over their sums that warp 0 of the block would run (lanes past
// nw adding 0): ds4d_block_sum's bits (ds4d_played_block_sum). A block per row waited on its barriers with 1 KB in
// flight.
constexpr int NORM_NW = 4, NORM_WROWS = 8;

template <int PER, bool RINV_ONLY>
__global__ void __launch_bounds__(32 * NORM_WROWS, PER == 1 ? 4 : 3) norm_rows_warp(norm_args a, int nw) {
    const int lane = (int)(threadIdx.x & 31);
    const int64_t gr = (int64_t)blockIdx.x * NORM_WROWS + (threadIdx.x >> 5), n = a.width, nt = 32 * nw;
    if (gr >= a.groups * a.rows) return; // a whole warp: no barrier below
    const int64_t g = gr / a.rows, r = gr % a.rows, o = g * a.gstride + r * n;
    const float *x = a.x + o, *dy = a.dy + o;
    float *dx = a.dx + o;
    float xs[NORM_NW][PER], wdy[NORM_NW][PER], d0[NORM_NW][PER];
#pragma unroll
    for (int v = 0; v < NORM_NW; v++)
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t i = lane + 32 * v + nt * j;
            const bool in = v < nw && i < n;
            xs[v][j] = in ? x[i] : 0.0f;
            if constexpr (RINV_ONLY) continue;
            wdy[v][j] = in ? norm_wdy(a.w, dy, i) : 0.0f;
            d0[v][j] = in && a.acc ? dx[i] : 0.0f;
        }
    double part[NORM_NW];
#pragma unroll
    for (int v = 0; v < NORM_NW; v++) {
        part[v] = 0;
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (v < nw && lane + 32 * v + nt * j < n) part[v] = norm_sq_acc(part[v], xs[v][j]);
    }
    const double ri = norm_rinv(ds4d_played_block_sum(part, nw), n, a.eps);
    if constexpr (RINV_ONLY) {
        if (lane == 0) a.rinv[gr] = (float)ri;
    } else {
#pragma unroll
        for (int v = 0; v < NORM_NW; v++) {
            part[v] = 0;
#pragma unroll
            for (int j = 0; j < PER; j++)
                if (v < nw && lane + 32 * v + nt * j < n) part[v] = norm_dot_acc(part[v], wdy[v][j], xs[v][j]);
        }
        const double k = norm_k(ri, ds4d_played_block_sum(part, nw), n);
#pragma unroll
        for (int v = 0; v < NORM_NW; v++)
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int64_t i = lane + 32 * v + nt * j;
                if (v < nw && i < n) dx[i] = norm_dx(wdy[v][j], xs[v][j], ri, k, d0[v][j], a.acc);
            }
    }
}

// The rows pass of norm_bwd (rinv_only: the RMS factors) in the kernel that fits the width; each gives the loop
// kernel's bits.
template <bool RINV_ONLY>
void launch_norm_rows(const norm_args &n, cudaStream_t st) {
    const int64_t R = n.groups * n.rows, w = n.width;
    if (w < 256) {
        const int nt = row_threads(w);
        const unsigned blocks = (unsigned)((R + NORM_WROWS - 1) / NORM_WROWS);
        if (w <= nt)
            norm_rows_warp<1, RINV_ONLY><<<blocks, 32 * NORM_WROWS, 0, st>>>(n, nt / 32);
        else
            norm_rows_warp<2, RINV_ONLY><<<blocks, 32 * NORM_WROWS, 0, st>>>(n, nt / 32);
    } else if (w <= 256 * 4) {
        norm_rows_block<4, RINV_ONLY><<<(unsigned)R, 256, 0, st>>>(n);
    } else if (w <= 256 * 8) {
        norm_rows_block<8, RINV_ONLY><<<(unsigned)R, 256, 0, st>>>(n);
    } else if (w <= 256 * 16) {
        norm_rows_block<16, RINV_ONLY><<<(unsigned)R, 256, 0, st>>>(n);
    } else {
        norm_bwd_rows<<<(unsigned)R, 256, 0, st>>>(n, RINV_ONLY);
    }
}

// The weight gradient's partial of (column tile, row chunk, group): 8 row lanes per column, each over every 8th row
// of the chunk (s = fma(dy·x, rinv, s), pinned as ptxas had fused it), then the lanes added in lane order.
__global__ void __launch_bounds__(256) norm_dw_part(norm_args a) {
    __shared__ double sh[8][33];
    const int64_t i = (int64_t)blockIdx.x * 32 + threadIdx.x, c = blockIdx.y, g = blockIdx.z;
    const int64_t rb = c * NORM_CHUNK, re = rb + NORM_CHUNK < a.rows ? rb + NORM_CHUNK : a.rows;
    double s = 0;
    if (i < a.width)
        for (int64_t r = rb + threadIdx.y; r < re; r += 8) {
            const int64_t o = g * a.gstride + r * a.width + i;
            s = __fma_rn(__dmul_rn((double)a.dy[o], (double)a.x[o]), (double)a.rinv[g * a.rows + r], s);
        }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y || i >= a.width) return;
    double t = sh[0][threadIdx.x];
    for (int l = 1; l < 8; l++) t += sh[l][threadIdx.x];
    a.part[(g * a.chunks + c) * a.width + i] = t;
}

// dw[i] += each group's sum (chunks in order, in double) rounded to fp32, group by group as the CPU adds them.
__global__ void norm_dw_finish(norm_args a) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.width) return;
    float w = a.dw[i];
    for (int64_t g = 0; g < a.groups; g++) {
        double s = 0;
        for (int64_t c = 0; c < a.chunks; c++) s += a.part[(g * a.chunks + c) * a.width + i];
        w += (float)s;
    }
    a.dw[i] = w;
}

// ops.h's colsum order: a chunk of DS4_COLSUM_CHUNK rows summed from 0 in row order, the chunks then added into dst
// in order (the CPU's bits). Block (group of 32 columns, chunk): all threads stage the chunk's piece into shared
// memory with coalesced loads, COLSUM_U in flight each, then warp 0 (a lane a column) adds its column's rows; the
// chunk's sum goes to part [chunks, width], or straight into dst when there is one chunk. colsum_fold adds the parts.
// The column groups are grid x: context parallelism sums a few rows of millions of columns.
constexpr int COLSUM_COLS = 32, COLSUM_U = 8;
__global__ void __launch_bounds__(256) colsum_chunk_kernel(float *part, float *dst, const float *src, int64_t rows,
                                                           int64_t width, int64_t ld) {
    __shared__ float tile[DS4_COLSUM_CHUNK][COLSUM_COLS + 1];
    const int64_t r0 = (int64_t)blockIdx.y * DS4_COLSUM_CHUNK, c0 = (int64_t)blockIdx.x * COLSUM_COLS;
    const int rn = (int)(rows - r0 < DS4_COLSUM_CHUNK ? rows - r0 : DS4_COLSUM_CHUNK);
    const int cw = (int)(width - c0 < COLSUM_COLS ? width - c0 : COLSUM_COLS), n = rn * cw;
    for (int e0 = (int)threadIdx.x; e0 < n; e0 += COLSUM_U * (int)blockDim.x) {
        float v[COLSUM_U];
#pragma unroll
        for (int u = 0; u < COLSUM_U; u++) {
            const int e = e0 + u * (int)blockDim.x;
            v[u] = e < n ? src[(r0 + e / cw) * ld + c0 + e % cw] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < COLSUM_U; u++) {
            const int e = e0 + u * (int)blockDim.x;
            if (e < n) tile[e / cw][e % cw] = v[u];
        }
    }
    __syncthreads();
    if ((int)threadIdx.x >= cw) return;
    float s = 0.0f;
    int r = 0;
    for (; r + 8 <= rn; r += 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = tile[r + u][threadIdx.x];
#pragma unroll
        for (int u = 0; u < 8; u++) s += v[u];
    }
    for (; r < rn; r++) s += tile[r][threadIdx.x];
    if (part) part[blockIdx.y * width + c0 + threadIdx.x] = s;
    else dst[c0 + threadIdx.x] += s;
}

// dst[c] += part[0, c], then part[1, c], .. in chunk order
__global__ void colsum_fold(float *dst, const float *part, int64_t chunks, int64_t width) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float s = dst[c];
    for (int64_t k = 0; k < chunks; k++) s += part[k * width + c];
    dst[c] = s;
}

// du[t, c] = 0 + dX[t, 0, c] + dX[t, 1, c] + ... in stream order (the CPU's adds onto a zeroed row).
__global__ void sum_streams_kernel(float *du, const float *dX, int64_t T, int64_t n, int64_t D) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * D) return;
    const int64_t t = i / D, c = i % D;
    float s = 0.0f;
    for (int64_t k = 0; k < n; k++) s += dX[(t * n + k) * D + c];
    du[i] = s;
}

// The embedding gradient's links: for each token, whether it is the first of its id (lead) and the next token of the
// same id (next, T for none), from every id compared with every other through shared-memory tiles of 256 (T² compares:
// ~70M at 8K tokens, a few microseconds; a sort would scale better for much larger batches).
__global__ void __launch_bounds__(256) embed_links(const int64_t *ids, int64_t T, int32_t *next, int32_t *lead) {
    __shared__ int64_t sid[256];
    const int64_t t = (int64_t)blockIdx.x * 256 + threadIdx.x;
    const int64_t v = t < T ? ids[t] : 0;
    int64_t nx = T;
    int first = 1;
    for (int64_t j0 = 0; j0 < T; j0 += 256) {
        __syncthreads();
        if (j0 + threadIdx.x < T) sid[threadIdx.x] = ids[j0 + threadIdx.x];
        __syncthreads();
        const int64_t jn = T - j0 < 256 ? T - j0 : 256;
        if (t < T)
            for (int64_t j = 0; j < jn; j++)
                if (sid[j] == v) {
                    const int64_t q = j0 + j;
                    if (q < t) first = 0;
                    else if (q > t && q < nx) nx = q;
                }
    }
    if (t < T) {
        next[t] = (int32_t)nx;
        lead[t] = first;
    }
}

// The block of the first token of each id adds, column by column, every token of that id in token order (following
// the links) and each token's streams in order onto the embedding row: the CPU's sequence of fp32 adds. The blocks of
// the other tokens have nothing to do.
__global__ void embed_bwd_kernel(float *ge, const int64_t *ids, const int32_t *next, const int32_t *lead,
                                 const float *dx, int64_t T, int64_t n, int64_t D) {
    const int64_t t = blockIdx.x;
    if (!lead[t]) return;
    const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    float *row = ge + ids[t] * D + c;
    float s = *row;
    for (int64_t q = t; q < T; q = next[q]) {
        const float *src = dx + q * n * D + c;
        for (int64_t i = 0; i < n; i++) s += src[i * D];
    }
    *row = s;
}

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

} // namespace

// ------------------------------------------------------------------------------------------ operations

void ds4_cuda_logp_bwd(ds4_dev *d, const ds4_a_logp_bwd *a) {
    if (a->rows <= 0 || a->V <= 0) return;
    if (a->rows > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "logp_bwd: %lld rows x %lld", (long long)a->rows, (long long)a->V);
        return;
    }
    cuda_dev *cd = cdev(d);
    cd->bwd_dy.src = nullptr;
    if (a->rmx && a->rse) { // the forward's statistics: one elementwise pass, rows in launches of at most 65535
        // dl16: dl rounded to bf16 in scratch slot 4 (row stride V) for the linear_bwd_x that follows (dy_kept), as
        // it would have rounded it; dl is not written (the reference backend writes it and rounds again)
        __nv_bfloat16 *d16 = nullptr;
        if (a->dl16 && !cd->bwd_ref) {
            d16 = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(a->rows * a->V) * sizeof(__nv_bfloat16), "logp_bwd", 4);
            if (!d16) return;
        }
        const int vec = a->V % 4 == 0 && ((uintptr_t)a->logits & 15) == 0 && ((uintptr_t)a->dl & 15) == 0;
        const int64_t per = (a->V + 4 * LOGPS_THREADS - 1) / (4 * LOGPS_THREADS);
        if (per > 0x7fffffff) {
            ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "logp_bwd: a vocabulary of %lld", (long long)a->V);
            return;
        }
        for (int64_t r0 = 0; r0 < a->rows; r0 += 65535) {
            const int64_t nr = a->rows - r0 < 65535 ? a->rows - r0 : 65535;
            logp_bwd_stats_kernel<<<dim3((unsigned)per, (unsigned)nr), LOGPS_THREADS, 0, cd->stream>>>(
                a->dl, a->logits, a->V, a->tgt, a->dlogp, a->g0, a->rmx, a->rse, r0, vec, d16, a->exp32);
            if (!ds4_cuda_launched(d, "logp_bwd", "[%lld x %lld], the forward's row statistics%s", (long long)a->rows,
                                   (long long)a->V, d16 ? ", kept in bf16" : ""))
                return;
        }
        if (d16) cd->bwd_dy = {a->dl, a->rows, a->V, a->V, 4, cd->scratch_gen[4], true};
        return;
    }
    logp_bwd_kernel<<<(unsigned)a->rows, LOGP_THREADS, 0, cdev(d)->stream>>>(a->dl, a->logits, a->V, a->tgt, a->dlogp,
                                                                              a->g0, a->exp32);
    ds4_cuda_launched(d, "logp_bwd", "[%lld x %lld]", (long long)a->rows, (long long)a->V);
}

// One past the last float of rows [0, rows) of cols values at row stride ld.
static const float *rows_end(const float *p, int64_t rows, int64_t cols, int64_t ld) { return p + (rows - 1) * ld + cols; }
static bool overlaps(const float *a0, const float *a1, const float *b0, const float *b1) { return a0 < b1 && b0 < a1; }

// dst [rows, cols] (dense) = src [rows, cols] (row stride ld) rounded to bf16, nearest even
static bool to_bf16(ds4_dev *d, const char *op, __nv_bfloat16 *dst, const float *src, int64_t rows, int64_t cols,
                    int64_t ld) {
    return ds4_cuda_rows_to_bf16(d, op, dst, cols, src, ld, 0, 1, rows, cols);
}

// C (col-major [m x n], ldc) = alpha·op(A)·op(B) + beta·C through cuBLAS, A and B in `dt` (fp32 or bf16), C fp32.
static void blas_gemm(ds4_dev *d, const char *op, const char *shapes, cublasOperation_t ta, cublasOperation_t tb,
                      int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B, int64_t ldb, float beta,
                      float *C, int64_t ldc, cudaDataType_t dt) {
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s %s: a dimension past 2^31 (cuBLAS)", op, shapes);
        return;
    }
    cublasHandle_t h = (cublasHandle_t)ds4_cuda_blas(cdev(d)->cu);
    const float one = 1.0f;
    // default math: tensor cores for bf16 with fp32 accumulation, never TF32 for fp32 (that needs the TF32 mode);
    // the handle's pedantic mode comes back after the call
    cublasStatus_t s = cublasSetMathMode(h, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasGemmEx(h, ta, tb, (int)m, (int)n, (int)k, &one, A, dt, (int)lda, B, dt, (int)ldb, &beta, C, CUDA_R_32F,
                         (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    const cublasStatus_t s2 = cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH);
    if (s == CUBLAS_STATUS_SUCCESS) s = s2;
    if (s != CUBLAS_STATUS_SUCCESS)
        ds4_dev_fail(d, DS4_ERR_CUDA, "%s %s: cublasGemmEx: %s (%s)", op, shapes, cublasGetStatusString(s),
                     cublasGetStatusName(s));
    else
        ds4_cuda_launched(d, op, "%s (cuBLAS)", shapes);
}

// bf16_in with fp32 weights is the CPU reference's emulation of the bf16 mode (ops.h); here bf16 weights imply it.
static void fp32_bf16_in(ds4_dev *d, const char *op) {
    ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: bf16_in with fp32 weights (the CPU's emulation of the bf16 mode)", op);
}

// The kept bf16 copy k (cuda_dev::kept_bf16) is of this product's dy [rows, cols] (row stride ld), and the product
// was told it may take it (dy_kept). fresh: the copy's slot has not moved since it was made.
static bool kept_match(const cuda_dev::kept_bf16 &k, bool asked, const float *dy, int64_t rows, int64_t cols,
                       int64_t ld) {
    return asked && k.src == dy && k.rows == rows && k.cols == cols && k.ld == ld;
}
static bool kept_fresh(const cuda_dev *cd, const cuda_dev::kept_bf16 &k) { return k.sgen == cd->scratch_gen[k.slot]; }
// A dy that logp_bwd never wrote (dl16) exists only as its kept copy: a product of that dy that cannot take the copy
// fails (true, the failure set) rather than read the buffer's stale values.
static bool kept_lost(ds4_dev *d, const cuda_dev::kept_bf16 &k, const float *dy, bool kept, const char *op,
                      const char *shapes) {
    if (!k.unwritten || k.src != dy || kept) return false;
    ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s %s: dy was kept in bf16 by logp_bwd and never written, but this product "
                 "cannot take the kept copy", op, shapes);
    return true;
}

// dx [T, K] (row stride lddx) (+)= dy [T, O] (row stride ldy) · W [O, K]: A(t, o) = dy[t, o], B(k, o) = W[o, k].
void ds4_cuda_linear_bwd_x(ds4_dev *d, const ds4_a_linear_bwd_x *a) {
    if (a->T <= 0 || a->K <= 0) return;
    prod_args p = {};
    p.y = a->dx, p.ldy = a->lddx, p.a = a->dy, p.a_rs = a->ldy, p.a_ks = 1, p.b = a->W, p.b_rs = 1, p.b_ks = a->K;
    p.M = a->T, p.N = a->K, p.R = a->O, p.acc = a->acc;
    char s[160];
    snprintf(s, sizeof s, "dx [%lld x %lld]%s = dy [%lld x %lld] x W [%lld x %lld]", (long long)a->T, (long long)a->K,
             a->acc ? " +" : "", (long long)a->T, (long long)a->O, (long long)a->O, (long long)a->K);
    cuda_dev *cd = cdev(d);
    const cuda_dev::kept_bf16 k = cd->bwd_dy; // what the logp_bwd just before left (dy_kept)
    cd->bwd_dy.src = nullptr;
    const bool kept = kept_match(k, a->dy_kept, a->dy, a->T, a->O, a->ldy) && kept_fresh(cd, k) &&
                      a->wdt == DS4_BF16 && a->O > 0;
    if (kept_lost(d, k, a->dy, kept, "linear_bwd_x", s)) return;
    if (a->bf16_in && a->wdt != DS4_BF16) return fp32_bf16_in(d, "linear_bwd_x");
    // fp32 (the reference mode, and LoRA's forward y += u·B, which must be batch-invariant: cuBLAS is not), another
    // dtype (the tiles' error), no reduction (O = 0: the tiles write the zeros)
    if (a->wdt != DS4_BF16 || a->O <= 0) return product(d, "linear_bwd_x", p, a->wdt, true, s);
    // column-major: dxᵀ [K x T] (+)= Wᵀ [K x O] · dyᵀ [O x T]; W row-major [O, K] is column-major [K x O]
    const int slot = kept ? k.slot : 1;
    auto *dy = kept ? (__nv_bfloat16 *)cd->scratch[slot]
                    : (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(a->T * a->O) * sizeof(__nv_bfloat16),
                                                        "linear_bwd_x", 1);
    if (!dy || (!kept && !to_bf16(d, "linear_bwd_x", dy, a->dy, a->T, a->O, a->ldy))) return;
    blas_gemm(d, "linear_bwd_x", s, CUBLAS_OP_N, CUBLAS_OP_N, a->K, a->T, a->O, a->W, a->K, dy, a->O,
              a->acc ? 1.0f : 0.0f, a->dx, a->lddx, CUDA_R_16BF);
    // the copy stays for the linear_bwd_w of the same dy that may follow, unless dx was written over dy
    if (!d->st && !overlaps(a->dx, rows_end(a->dx, a->T, a->K, a->lddx), a->dy, rows_end(a->dy, a->T, a->O, a->ldy)))
        cd->bwd_dy = {a->dy, a->T, a->O, a->ldy, slot, cd->scratch_gen[slot], kept && k.unwritten};
    else if (kept && k.unwritten)
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "linear_bwd_x %s: dx written over a dy that was never written", s);
}

// dW [O, K] += dyᵀ · x over T rows: A(o, t) = dy[t, o], B(k, t) = x[t, k] (both read down their columns).
void ds4_cuda_linear_bwd_w(ds4_dev *d, const ds4_a_linear_bwd_w *a) {
    cuda_dev *cd = cdev(d);
    const cuda_dev::kept_bf16 k = cd->bwd_dy; // what the linear_bwd_x just before left (dy_kept); used once at most
    cd->bwd_dy.src = nullptr;
    if (a->T <= 0 || a->K <= 0 || a->O <= 0) return; // no rows: dW stays as it is (the CPU's too)
    prod_args p = {};
    p.y = a->dW, p.ldy = a->K, p.a = a->dy, p.a_rs = 1, p.a_ks = a->ldy, p.b = a->x, p.b_rs = 1, p.b_ks = a->ldx;
    p.M = a->O, p.N = a->K, p.R = a->T, p.acc = 1;
    char s[160];
    snprintf(s, sizeof s, "dW [%lld x %lld] += dy^T [%lld x %lld] x x [%lld x %lld]", (long long)a->O, (long long)a->K,
             (long long)a->O, (long long)a->T, (long long)a->T, (long long)a->K);
    const ds4_dtype mode = a->bf16_in ? DS4_BF16 : a->wdt;
    // fp32 through cuBLAS only where the op allows another summation order (any_order: the bf16 mode's fp32 weights;
    // CUBLAS_COMPUTE_32F: fp32 products and sums, no TF32; no atomics: the same bits every run); the fp32 mode keeps
    // the tiles' order, which the trajectory against torch and LoRA's bitwise checks rely on
    if (mode != DS4_BF16 && !(mode == DS4_F32 && a->any_order)) return product(d, "linear_bwd_w", p, mode, false, s);
    // column-major: dWᵀ [K x O] += xᵀ [K x T] · dy [T x O]; x row-major [T, K] is column-major [K x T] (ld ldx), dy
    // row-major [T, O] is column-major [O x T], transposed
    const void *x = a->x, *dy = a->dy;
    int64_t ldx = a->ldx, ldy = a->ldy;
    if (mode == DS4_BF16) {
        // dy [T, O] then x [T, K] in bf16 in slot 1; dy's copy is there already when the linear_bwd_x just before
        // made it (dy_kept: the schedule's word that nothing wrote dy since) and slot 1 has not moved; x is read
        // where it lies when the caller has it rounded already (x16)
        // (a dy kept elsewhere, slot 4, leaves slot 1 to x alone). Slot 1 may grow here: whether a copy there is
        // still there is asked after.
        const bool match = kept_match(k, a->dy_kept && !cd->bwd_ref, a->dy, a->T, a->O, a->ldy);
        const bool other = match && k.slot != 1 && kept_fresh(cd, k);
        const int64_t dn = other ? 0 : a->T * a->O, xn = a->x16 ? 0 : a->T * a->K;
        auto *c = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(dn + xn) * sizeof(__nv_bfloat16), "linear_bwd_w", 1);
        if (!c) return;
        const bool kept = match && kept_fresh(cd, k);
        if (kept_lost(d, k, a->dy, kept, "linear_bwd_w", s)) return;
        if ((!kept && !to_bf16(d, "linear_bwd_w", c, a->dy, a->T, a->O, a->ldy)) ||
            (!a->x16 && !to_bf16(d, "linear_bwd_w", c + dn, a->x, a->T, a->K, a->ldx)))
            return;
        dy = kept ? cd->scratch[k.slot] : c, ldy = a->O;
        if (a->x16) x = a->x16;
        else x = c + dn, ldx = a->K;
    }
    const cudaDataType_t dt = mode == DS4_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    // A gradient in the flat fp32 buffer starts wherever the tensors before it end (a 3-value mHC scale puts most
    // weights 4, 8 or 12 bytes off a 16-byte boundary), and cuBLAS then takes its sm80 kernels for 4-byte-aligned
    // operands (Nsight Compute, H200: 494 against 183 µs for the same 1024 x 8192 x 8192 dW, 2.5x): such a dW is
    // formed in aligned scratch (slot 0, free here: the copies above are in slot 1) and added in one pass.
    // A run of such products into one dW (the head's row chunks) is summed in slot 3 and added once, at its last.
    if (((uintptr_t)a->dW & 15) != 0) {
        const int64_t n = a->O * a->K;
        const bool run = a->run & DS4_DW_RUN, first = !run || (a->run & DS4_DW_FIRST),
                   last = !run || (a->run & DS4_DW_LAST);
        cuda_dev::dw_run_state &r = cd->dw_run;
        if (run && !first && (r.dW != a->dW || r.O != a->O || r.K != a->K || r.sum != cd->scratch[3])) {
            r.dW = nullptr;
            ds4_dev_fail(d, DS4_ERR_INTERNAL, "linear_bwd_w %s: a run's product without the run's first", s);
            return;
        }
        auto *t = (float *)ds4_cuda_scratch(d, (size_t)n * sizeof(float), "linear_bwd_w", run ? 3 : 0);
        if (!t) return;
        r = run && !last ? cuda_dev::dw_run_state{a->dW, a->O, a->K, t} : cuda_dev::dw_run_state{};
        blas_gemm(d, "linear_bwd_w", s, CUBLAS_OP_N, CUBLAS_OP_T, a->K, a->O, a->T, x, ldx, dy, ldy,
                  first ? 0.0f : 1.0f, t, a->K, dt);
        if (d->st || !last) return;
        // one fp32 add an element, as cuBLAS's epilogue with beta 1 does it (alpha·acc + beta·C with alpha = beta = 1
        // rounds acc + C once): the same values as the product added in place would give with the same algorithm
        const ds4_a_add_bcast add = {a->dW, t, 1, 1, n};
        ds4_cuda_add_bcast(d, &add);
        return;
    }
    blas_gemm(d, "linear_bwd_w", s, CUBLAS_OP_N, CUBLAS_OP_T, a->K, a->O, a->T, x, ldx, dy, ldy, 1.0f, a->dW, a->K, dt);
}

// Rows [off[e], off[e+1]) of dx [rows, K] (+)= the same rows of dy [rows, O] · W_e [O, K], W_e = W + e·wstride.
void ds4_cuda_linear_bwd_x_grouped(ds4_dev *d, const ds4_a_linear_bwd_x_grouped *a) {
    if (a->E <= 0 || a->rows <= 0 || a->K <= 0) return;
    prod_args p = {};
    p.y = a->dx, p.ldy = a->K, p.a = a->dy, p.a_rs = a->O, p.a_ks = 1, p.b = a->W, p.b_rs = 1, p.b_ks = a->K;
    p.M = a->rows, p.N = a->K, p.R = a->O, p.acc = a->acc, p.off = a->off, p.E = a->E, p.bstride = a->wstride;
    p.bs = a->Ws;
    char s[160];
    snprintf(s, sizeof s, "dx [%lld x %lld]%s = dy [%lld x %lld] x W [%lld x %lld x %lld] by expert",
             (long long)a->rows, (long long)a->K, a->acc ? " +" : "", (long long)a->rows, (long long)a->O,
             (long long)a->E, (long long)a->O, (long long)a->K);
    // FP4-resident experts (the routed experts of a model loaded with fp4_experts) in the model's mode, which bf16_in
    // tells: decoded to bf16 for the tensor cores, or to fp32
    if (a->wdt == DS4_FP4_PACKED)
        return product(d, "linear_bwd_x_grouped", p, a->bf16_in ? DS4_BF16 : DS4_F32, true, s, true);
    if (a->bf16_in && a->wdt != DS4_BF16) return fp32_bf16_in(d, "linear_bwd_x_grouped");
    if (a->wdt == DS4_BF16 && !cdev(d)->bwd_ref) // the tiles' bits below, through the forward's pipelined grouped GEMM
        return ds4_cuda_grouped_dx_bf16(d, "linear_bwd_x_grouped", a->dx, a->acc, a->dy, a->W, a->rows, a->O, a->K,
                                        a->off, a->E, a->wstride);
    product(d, "linear_bwd_x_grouped", p, a->wdt, true, s);
}

// dW_e [O, K] += dyᵀ · x over the rows [off[e], off[e+1]) of dy [rows, O] and x [rows, K]; dW_e = dW + e·wstride.
void ds4_cuda_linear_bwd_w_grouped(ds4_dev *d, const ds4_a_linear_bwd_w_grouped *a) {
    if (a->E <= 0 || a->K <= 0 || a->O <= 0) return;
    prod_args p = {};
    p.y = a->dW, p.ldy = a->K, p.a = a->dy, p.a_rs = 1, p.a_ks = a->O, p.b = a->x, p.b_rs = 1, p.b_ks = a->K;
    p.M = a->O, p.N = a->K, p.R = a->rows, p.acc = 1, p.off = a->off, p.E = a->E, p.rgroup = 1, p.ystride = a->wstride;
    char s[160];
    snprintf(s, sizeof s, "dW [%lld x %lld x %lld] += dy^T [%lld x %lld] x x [%lld x %lld] by expert", (long long)a->E,
             (long long)a->O, (long long)a->K, (long long)a->O, (long long)a->rows, (long long)a->rows,
             (long long)a->K);
    if ((a->bf16_in || a->wdt == DS4_BF16) && !cdev(d)->bwd_ref && // the tiles' bits, through the pipelined GEMM
        ds4_cuda_grouped_dw_bf16(d, "linear_bwd_w_grouped", a->dW, a->wstride, a->dy, a->x, a->rows, a->O, a->K, a->off,
                                 a->E, a->x_kept))
        return;
    cdev(d)->bwd_xT.x = nullptr; // the tiles leave no transposed x for a next call
    product(d, "linear_bwd_w_grouped", p, a->bf16_in ? DS4_BF16 : a->wdt, false, s);
}

void ds4_cuda_norm_bwd(ds4_dev *d, const ds4_a_norm_bwd *a) {
    const int64_t groups = a->groups > 0 ? a->groups : 1;
    if (a->rows <= 0 || a->width <= 0) return;
    cudaStream_t st = cdev(d)->stream;
    norm_args n = {a->dx, a->dw, a->dy, a->x, a->w, nullptr, nullptr, a->rows, a->width, groups, a->gstride,
                   (a->rows + NORM_CHUNK - 1) / NORM_CHUNK, a->eps, a->acc};
    if (groups * a->rows > 0x7fffffff || (a->dw && (n.chunks > 65535 || groups > 65535))) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "norm_bwd: %lld groups x %lld rows x %lld", (long long)groups,
                     (long long)a->rows, (long long)a->width);
        return;
    }
    if (a->dw) { // the weight gradient reads dy: before dx (which may be dy) is written
        const size_t rb = align256((size_t)(groups * a->rows) * sizeof(float));
        const size_t pb = (size_t)(groups * n.chunks * a->width) * sizeof(double);
        char *s = (char *)ds4_cuda_scratch(d, rb + pb, "norm_bwd", 1);
        if (!s) return;
        n.rinv = (float *)s;
        n.part = (double *)(s + rb);
        launch_norm_rows<true>(n, st);
        if (!ds4_cuda_launched(d, "norm_bwd", "[%lld groups x %lld x %lld]: RMS factors", (long long)groups,
                               (long long)a->rows, (long long)a->width))
            return;
        norm_dw_part<<<dim3(ds4_blocks(a->width, 32), (unsigned)n.chunks, (unsigned)groups), dim3(32, 8), 0, st>>>(n);
        if (!ds4_cuda_launched(d, "norm_bwd", "[%lld groups x %lld x %lld]: weight partials", (long long)groups,
                               (long long)a->rows, (long long)a->width))
            return;
        norm_dw_finish<<<ds4_blocks(a->width, 256), 256, 0, st>>>(n);
        if (!ds4_cuda_launched(d, "norm_bwd", "[%lld groups x %lld x %lld]: weight gradient", (long long)groups,
                               (long long)a->rows, (long long)a->width))
            return;
    }
    launch_norm_rows<false>(n, st);
    ds4_cuda_launched(d, "norm_bwd", "[%lld groups x %lld x %lld]%s", (long long)groups, (long long)a->rows,
                      (long long)a->width, a->acc ? " (added)" : "");
}

void ds4_cuda_colsum_add(ds4_dev *d, const ds4_a_colsum_add *a) {
    if (a->rows <= 0 || a->width <= 0) return;
    const int64_t chunks = (a->rows + DS4_COLSUM_CHUNK - 1) / DS4_COLSUM_CHUNK;
    const int64_t groups = (a->width + COLSUM_COLS - 1) / COLSUM_COLS;
    if (chunks > 65535 || groups > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "colsum_add: [%lld rows x %lld]", (long long)a->rows, (long long)a->width);
        return;
    }
    float *part = nullptr; // one chunk: its sum goes straight into dst
    if (chunks > 1) {
        part = (float *)ds4_cuda_scratch(d, (size_t)(chunks * a->width) * sizeof(float), "colsum_add", 0);
        if (!part) return;
    }
    cudaStream_t st = cdev(d)->stream;
    colsum_chunk_kernel<<<dim3((unsigned)groups, (unsigned)chunks), 256, 0, st>>>(part, a->dst, a->src, a->rows,
                                                                                  a->width, a->ld);
    if (!ds4_cuda_launched(d, "colsum_add", "[%lld rows x %lld, stride %lld], chunks", (long long)a->rows,
                           (long long)a->width, (long long)a->ld) || !part)
        return;
    colsum_fold<<<ds4_blocks(a->width, 256), 256, 0, st>>>(a->dst, part, chunks, a->width);
    ds4_cuda_launched(d, "colsum_add", "[%lld rows x %lld], fold of %lld chunks", (long long)a->rows,
                      (long long)a->width, (long long)chunks);
}

void ds4_cuda_sum_streams(ds4_dev *d, const ds4_a_sum_streams *a) {
    const int64_t n = a->T * a->D;
    if (n <= 0) return;
    sum_streams_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->du, a->dX, a->T, a->n, a->D);
    ds4_cuda_launched(d, "sum_streams", "[%lld, %lld, %lld]", (long long)a->T, (long long)a->n, (long long)a->D);
}

// Links between the tokens of each id, then one pass that adds each id's tokens in order.
void ds4_cuda_embed_bwd(ds4_dev *d, const ds4_a_embed_bwd *a) {
    if (a->T <= 0 || a->D <= 0) return;
    if (a->T >= 0x7fffffff || (a->D + 255) / 256 > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "embed_bwd: [%lld tokens, %lld streams, %lld]", (long long)a->T,
                     (long long)a->n, (long long)a->D);
        return;
    }
    cudaStream_t st = cdev(d)->stream;
    const size_t nb = align256((size_t)a->T * sizeof(int32_t));
    char *s = (char *)ds4_cuda_scratch(d, 2 * nb, "embed_bwd", 1);
    if (!s) return;
    int32_t *next = (int32_t *)s, *lead = (int32_t *)(s + nb);
    embed_links<<<ds4_blocks(a->T, 256), 256, 0, st>>>(a->ids, a->T, next, lead);
    if (!ds4_cuda_launched(d, "embed_bwd", "[%lld tokens]: links between equal ids", (long long)a->T)) return;
    embed_bwd_kernel<<<dim3((unsigned)a->T, (unsigned)((a->D + 255) / 256)), 256, 0, st>>>(a->ge, a->ids, next, lead,
                                                                                           a->dx, a->T, a->n, a->D);
    ds4_cuda_launched(d, "embed_bwd", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)a->n,
                      (long long)a->D);
}
