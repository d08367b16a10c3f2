// cuda_gemm_wgmma.cu — y (+)= x Wᵀ in bf16 on Hopper's wgmma, every output the same bits as cuda_gemm.cu's mma.sync
// kernels give it (batch invariance: a rollout's decoding and training's forward stay bit-identical).
//
// The sum (cuda_gemm.cu's header): slices of 256 k, each a partial from 0 in chunks of 32 on the tensor cores, the
// partials added in slice order in fp32; in a chunk, the products of k = 8t..8t+3 in the k-slots (2t, 2t+1, 2t+8, 2t+9)
// of a first 16-deep step and of 8t+4..8t+7 in the same slots of a second. Which k lands in which slot decides the
// rounding (bench/probe_wgmma_bits.cu: wgmma adds the slots exactly as mma.sync does when each product takes the same
// slot; the same products in other slots differ in the last bits of ~half the outputs).
//
// So the roles are swapped: the block computes yᵀ = W·xᵀ. W is wgmma's A operand, in registers: a warp's fragment of
// rows g and g + 8 is the 16-byte load of k = 8t..8t+7 that the mma.sync kernels read, whose words are already the
// slots above (A's register layout is mma.sync's). x is the B operand, read by the tensor cores from shared memory in
// slot order: position 16j + s of a chunk must hold the k that step j puts in slot s. The bf16 copy of x that the
// product makes anyway (ds4_cuda_rows_to_bf16_k32) is written in that order (position 16j + 8h + 2t + e holds
// k = 8t + 4j + 2h + e), so its tiles land as they are. The products are exact in fp32 whichever operand holds which
// factor, so the sums are the mma.sync kernels' sums (tests/test_cuda_gemm_bits).
//
// Shape: 384 threads, one block per SM looping over the output tiles. Warps 0-7 are two warpgroups of consumers:
// warpgroup w owns W rows 64w..64w+63 of the block's 128 and all 128 rows of x (one m64n128k16 per 16 k), its slice
// partials (64 fp32), totals (64 more) and two sets of W fragments in registers; a slice is four stages, unrolled.
// Warps 8-11 are the producer warpgroup, which gives its registers to the consumers (setmaxnreg) and in which one
// thread issues the bulk tensor copies (TMA) of each stage of 64 k, ST stages deep, each
// stage's arrival counted on a "full" barrier and its release by the 8 consumer warps on an "empty" one, so that no
// thread of the block computes an address or waits at a block barrier inside the loop (the cp.async version of this
// kernel spent ~400 instructions a warp per stage on them and ran slower than the mma.sync pipeline). Shared memory per
// stage: x as 128 rows of 64 values (128 bytes, the copy engine's 128-byte swizzle, which the tensor cores undo), W as
// two chunks of 128 rows of 32 values (64-byte rows: conflict-free 16-byte fragment reads). Rows past the operands'
// ends and k past K arrive as zeros (the copy engine fills them); a chunk wholly past K multiplies those zeros (its
// products add +0, which changes no partial but a -0 one, and a -0 partial never changes the total).
#include <cuda.h>

#include "cuda_gemm_wgmma.cuh"
#include "cuda_tile.cuh"

namespace {

constexpr int KSLICE = 256, KC = 64, BW = DS4_WG_TILE_N, BT = DS4_WG_TILE_M, NCONS = 256, NTH = NCONS + 128, ST = 5;
// registers a thread: the producer warpgroup hands its registers to the consumers (setmaxnreg; the hardware allocates
// for whole warpgroups: 384 · 168 at launch = 128 · 40 + 256 · 232 after, <= 64 K)
constexpr int PROD_REGS = 40, CONS_REGS = 232;
constexpr int A_CHUNK = BW * 32 * 2;        // bytes of W per chunk of 32 k: [BW rows][32] bf16
constexpr int A_STAGE = 2 * A_CHUNK;
constexpr int B_STAGE = BT * KC * 2;        // bytes of x per stage: [BT rows][64] bf16, 128-byte swizzle
constexpr size_t SMEM = (size_t)ST * (A_STAGE + B_STAGE) + 2 * ST * 8 + 1024; // + barriers, + alignment slack
static_assert(KSLICE % KC == 0, "a stage never straddles a slice");
static_assert(KSLICE / KC == 4, "the consumers' loop takes a slice as four stages");

// Shared-memory matrix descriptor of x's stage: K-major, 128-byte swizzle (layout type 1), 8-row groups 1024 bytes
// apart; the 16-k steps of a stage start 32 bytes apart inside the swizzled rows.
__device__ __forceinline__ uint64_t b_desc(uint32_t saddr) {
    return (uint64_t)((saddr >> 4) & 0x3fff) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d (64 fp32: the m64n128 accumulators) += A (registers: a0..a3) · B (shared memory, desc), 16 k; with add = 0,
// d = A · B (the values d held are not read).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t desc, uint32_t add = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,"
                 "%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,"
                 "%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                   "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
                   "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
                   "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(add));
}

// The compiler must neither move these registers' uses across the asynchronous products nor reuse a fragment's
// registers before the products that read it are done: an empty asm that reads and writes them pins them there.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4}], [%5];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

// tmx: x in k32 order [G·M rows, ldxk] (box 64 × 128, swizzled); tmw: W [Z, N, K] (box 32 × 128 × 1), Z the groups
// of W (row groups' experts, or the batched products' groups). KOFF: reduction groups (a.koff: each product's own
// columns of one x and one W); ACC: y += the sum (a.acc); OUT16: y rounded to bf16 into a.yk (and a.y16) instead of
// y (the products are the same, the epilogue differs). Each an instantiation of its own, so that the forward's
// products keep a loop bound fixed for the whole kernel and no y values live across the epilogue: with KOFF or ACC in
// every product they ran 5-10% slower.
template <bool KOFF, bool ACC, bool OUT16>
__global__ void __launch_bounds__(NTH, 1) gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tmx,
                                                            const __grid_constant__ CUtensorMap tmw,
                                                            const ds4d_wg_args a) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) char smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u; // the swizzle's alignment
    const uint32_t sB = base, sA = base + ST * B_STAGE, bars = sA + ST * A_STAGE; // full[ST], then empty[ST]
    const char *sAp = smem_raw + (sA - raw);
    // warp: read from lane 0, so that the compiler knows it is the same across the warp (the role branch below is then
    // not divergent, which would serialise the products)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
    // Persistent: block b takes tiles b, b + gridDim.x, ...; within a group, the tiles of the larger operand's rows
    // change slowest (a.rows_fast), so the blocks at work at once share its rows and the smaller operand stays in L2:
    // W's column tiles fastest where x is the larger (W then read from memory once, x once), x's row tiles fastest
    // where W is (the LM head: its 32000 rows are 65 MB, more than the L2; 247 -> 203 us on an H100). Both roles walk
    // the same tiles, and the stages' ring runs on across them, so the producer copies the next tile's first stages
    // while the consumers store this tile's outputs.
    const int64_t tiles_x = (a.N + BW - 1) / BW, tiles_y = a.off ? (a.M + BT - 1) / BT + a.E : (a.M + BT - 1) / BT;
    const int64_t ntiles = tiles_x * tiles_y * a.groups;
    int64_t r0, r1, woff, n0, K = a.K, k0 = 0, nst = (K + KC - 1) / KC; // the reduction: K columns from k0, nst stages
    int z;
    auto tile_at = [&](int64_t tile) { // false: a row tile past its group's rows, or an empty reduction (no work)
        const int64_t in = tile % (tiles_x * tiles_y);
        const int64_t xt = a.rows_fast ? in / tiles_y : in % tiles_x, yt = a.rows_fast ? in % tiles_y : in / tiles_x;
        z = (int)(tile / (tiles_x * tiles_y));
        n0 = xt * BW;
        if constexpr (KOFF) {
            K = a.koff[z + 1] - a.koff[z];
            k0 = ds4d_wg_kstart(a.koff, z);
            nst = (K + KC - 1) / KC;
        }
        if (!a.off) {
            r0 = yt * BT, r1 = a.M, woff = 0;
            return r0 < a.M && K > 0;
        }
        return ds4d_group_tile<BT>(a.off, a.E, a.wstride, yt, r0, r1, woff);
    };
    if (tid == 0) {
        for (int s = 0; s < ST; s++) bar_init(bars + 8 * s, 1), bar_init(bars + 8 * (ST + s), NCONS / 32);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp >= NCONS / 32) { // the producer warpgroup: one thread issues the copies
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PROD_REGS));
        if (warp != NCONS / 32 || lane != 0) return;
        // the ring's place (all tiles): slot s of round r, the round's parity, and whether a round has passed
        // (the empty barriers are waited for from the second round on, for the parity of the round before)
        int s = 0;
        uint32_t par = 0;
        bool again = false;
        for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            if (!tile_at(tile)) continue;
            // koff: one x and one W for every group, at the group's columns
            const int zw = KOFF ? 0 : (a.off ? (int)(woff / a.wstride) : z);
            const int xrow = (int)(KOFF ? r0 : z * a.M + r0);
            for (int64_t kc = 0; kc < nst; kc++, s = s + 1 == ST ? 0 : s + 1, par ^= s == 0, again |= s == 0) {
                if (again) bar_wait(bars + 8 * (ST + s), par ^ 1u);
                const uint32_t full = bars + 8 * s;
                bar_expect(full, A_STAGE + B_STAGE);
                tma_2d(sB + s * B_STAGE, &tmx, (int)(k0 + kc * KC), xrow, full);
                tma_3d(sA + s * A_STAGE, &tmw, (int)(k0 + kc * KC), (int)n0, zw, full);
                tma_3d(sA + s * A_STAGE + A_CHUNK, &tmw, (int)(k0 + kc * KC + 32), (int)n0, zw, full);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONS_REGS));
    const int wg = warp >> 2, g = lane >> 2, t = lane & 3, rowA = wg * 64 + (warp & 3) * 16 + g;
    float acc[64], tot[64];
    // The W fragments of the even and the odd stages of a slice. A stage's products read its set from registers while
    // they run, and the stage's own wait (wait_group 1, after its commit) covers only the stage before: with one set
    // for every stage (as before), the next stage's loads overwrote registers that the products just committed still
    // read, and ptxas made each warpgroup wait for all of its products (WARPGROUP.DEPBAR.LE 0, its info C7517) before
    // every stage, its tensor work drained each time. Alternating, a set is loaded again only after a wait has
    // covered its readers (tests/test_wgmma_ptxas.sh checks that ptxas injects no wait).
    uint32_t f0[16], f1[16];
#pragma unroll
    for (int i = 0; i < 16; i++) f0[i] = f1[i] = 0u;
    // The ring's place as the producer keeps it (slot s, the round's parity), counted along, never divided out (the
    // 64-bit divisions by ST took ~100 dependent instructions a stage). A stage is released to the producer once its
    // products are done: after the next stage's products are issued and the wait for all but those (wait_group 1),
    // the slice's last at the fold.
    int s = 0;
    uint32_t par = 0;
    auto release = [&](int slot) {
        __syncwarp();
        if (lane == 0) bar_arrive(bars + 8 * (ST + slot));
    };
    // One stage of 64 k at slot s: its W fragments into f, its four products (the slice's first from zero: add 0,
    // so acc is never reset), committed as one group; returns the stage's slot, the ring moved on.
    auto stage = [&](uint32_t(&f)[16], bool first) {
        bar_wait(bars + 8 * s, par);
        const char *fs = sAp + s * A_STAGE;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const uint4 v = *reinterpret_cast<const uint4 *>(fs + (u * BW + rowA) * 64 + t * 16);
            const uint4 w = *reinterpret_cast<const uint4 *>(fs + (u * BW + rowA + 8) * 64 + t * 16);
            f[u * 8 + 0] = v.x, f[u * 8 + 1] = v.y, f[u * 8 + 2] = v.z, f[u * 8 + 3] = v.w;
            f[u * 8 + 4] = w.x, f[u * 8 + 5] = w.y, f[u * 8 + 6] = w.z, f[u * 8 + 7] = w.w;
        }
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        const uint32_t sb = sB + s * B_STAGE;
        // products q = 2u + h: chunk u of 32 k, its steps h of 16 (a chunk wholly past K multiplies the zeros the
        // copy engine filled in: its products add +0)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int u = q >> 1, h = q & 1;
            wgmma_rs(acc, f[8 * u + 2 * h], f[8 * u + 4 + 2 * h], f[8 * u + 2 * h + 1], f[8 * u + 4 + 2 * h + 1],
                     b_desc(sb + 32 * q), q != 0 || !first);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        const int slot = s;
        s = s + 1 == ST ? 0 : s + 1, par ^= s == 0;
        return slot;
    };
    auto wait1 = [&] { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); };
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        if (!tile_at(tile)) continue;
#pragma unroll
        for (int i = 0; i < 64; i++) tot[i] = 0.0f;
        for (int64_t kc = 0; kc < nst; kc += KSLICE / KC) { // a slice: up to four stages
            const int64_t n = nst - kc;
            int last = stage(f0, true);
            if (n > 1) {
                const int s0 = last;
                last = stage(f1, false);
                wait1(), release(s0);
                if (n > 2) {
                    const int s1 = last;
                    last = stage(f0, false);
                    wait1(), release(s1);
                    if (n > 3) {
                        const int s2 = last;
                        last = stage(f1, false);
                        wait1(), release(s2);
                    }
                }
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            pin(acc), pin(f0), pin(f1);
            release(last);
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] += acc[i];
        }
        // tot[4i + c]: W row rowA + 8·(c >> 1), row of x 8i + 2t + (c & 1). Adding into y, its 64 values are read
        // first (into acc, free until the next tile), every load in flight before any store: in one loop the
        // compiler cannot tell that a store leaves the next load's address alone, and waited out each load in turn
        // with the SM's one block idle (the same sums, y + tot, either way)
        const int64_t rend = r1 < r0 + BT ? r1 : r0 + BT;
        if constexpr (OUT16) {
            // Pairs of adjacent columns as one bf16 word: lane g holds columns c0 + g and c0 + 8 + g of its rows (c0 =
            // n0 + rowA - g); an even g takes its neighbour's (lane + 4) column c0 + g + 1, an odd g gives it that and
            // takes the neighbour's c0 + 8 + g - 1, so each lane stores one word a row: columns cc, cc + 1 (cc even).
            // In k32 order column q = cc + e of a 32-column chunk lies at position 16j + 8h + 2t + e for
            // q = 8t + 4j + 2h + e: word 4·((q >> 1) & 3) + (q >> 3), as ds4_cuda_rows_to_bf16_k32 places it.
            const bool odd = g & 1;
            const int64_t cc = n0 + rowA + (odd ? 7 : 0); // even: c0 + g (g even) or c0 + 8 + g - 1 (g odd)
#pragma unroll
            for (int i = 0; i < 16; i++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float v0 = tot[4 * i + e], v1 = tot[4 * i + 2 + e];
                    const float got = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
                    const int64_t m = r0 + 8 * i + 2 * t + e;
                    if (m >= rend || cc >= a.N) continue;
                    const uint32_t w = odd ? ds4d_pack_bf16(got, v1) : ds4d_pack_bf16(v0, got);
                    const int64_t q = z * a.gy + cc; // the column in the next product's x
                    a.yk[m * (a.ldyk / 2) + (q >> 5) * 16 + 4 * ((q >> 1) & 3) + ((q & 31) >> 3)] = w;
                    if (a.y16) *reinterpret_cast<uint32_t *>(a.y16 + m * a.ldy + q) = w;
                }
            continue;
        }
        float *y = a.y + z * a.gy;
        if constexpr (ACC) {
#pragma unroll
            for (int i = 0; i < 16; i++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int64_t m = r0 + 8 * i + 2 * t + (c & 1), n = n0 + rowA + 8 * (c >> 1);
                    acc[4 * i + c] = m < rend && n < a.N ? __ldcg(y + m * a.ldy + n) : 0.0f;
                }
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int64_t m = r0 + 8 * i + 2 * t + (c & 1), n = n0 + rowA + 8 * (c >> 1);
                if (m < rend && n < a.N) y[m * a.ldy + n] = ACC ? acc[4 * i + c] + tot[4 * i + c] : tot[4 * i + c];
            }
    }
#else
    __trap(); // built for sm_90a only: never launched elsewhere (cuda_gemm.cu checks the device)
#endif
}

using encode_fn = CUresult (*)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                               const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                               CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

} // namespace

size_t ds4_cuda_wgmma_smem(void) { return SMEM; }

cudaError_t ds4_cuda_wgmma_prepare(void **encode) {
    cudaDriverEntryPointQueryResult q;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", encode, 12000, cudaEnableDefault, &q);
    if (e == cudaSuccess && (q != cudaDriverEntryPointSuccess || !*encode)) e = cudaErrorNotSupported;
    const void *kernels[5] = {(const void *)gemm_wgmma_kernel<false, false, false>,
                              (const void *)gemm_wgmma_kernel<false, true, false>,
                              (const void *)gemm_wgmma_kernel<true, false, false>,
                              (const void *)gemm_wgmma_kernel<true, true, false>,
                              (const void *)gemm_wgmma_kernel<false, false, true>};
    for (int i = 0; i < 5 && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM);
    return e;
}

cudaError_t ds4_cuda_wgmma_launch(const ds4d_wg_args &a, int blocks, cudaStream_t stream, void *encode) {
    const auto enc = reinterpret_cast<encode_fn>(encode);
    CUtensorMap tmx, tmw;
    const cuuint64_t xdim[2] = {(cuuint64_t)a.ldxk, (cuuint64_t)(a.koff ? a.M : a.M * a.groups)};
    const cuuint64_t xstr[1] = {(cuuint64_t)a.ldxk * 2};
    const cuuint32_t xbox[2] = {KC, BT}, one[3] = {1, 1, 1};
    const int64_t Z = a.koff ? 1 : (a.off ? a.E : a.groups), zs = Z > 1 ? (a.off ? a.wstride : a.gw) : a.N * a.ldw;
    const cuuint64_t wdim[3] = {(cuuint64_t)a.K, (cuuint64_t)a.N, (cuuint64_t)Z};
    const cuuint64_t wstr[2] = {(cuuint64_t)a.ldw * 2, (cuuint64_t)zs * 2};
    const cuuint32_t wbox[3] = {32, BW, 1};
    if (enc(&tmx, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)a.xk, xdim, xstr, xbox, one,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS ||
        enc(&tmw, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)a.W, wdim, wstr, wbox, one,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    if (a.yk && (a.koff || a.acc || a.off)) return cudaErrorInvalidValue; // the rounded y of plain products only
    const auto kernel = a.yk     ? gemm_wgmma_kernel<false, false, true>
                        : a.koff ? (a.acc ? gemm_wgmma_kernel<true, true, false> : gemm_wgmma_kernel<true, false, false>)
                                 : (a.acc ? gemm_wgmma_kernel<false, true, false> : gemm_wgmma_kernel<false, false, false>);
    kernel<<<blocks, NTH, SMEM, stream>>>(tmx, tmw, a);
    return cudaPeekAtLastError(); // left set: the caller's launch check reports it with the op and shapes
}
