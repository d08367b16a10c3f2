// cuda_bwd_hc_moe.cu — the backward of the residual streams and of the MoE on the GPU: mHC pre (the Sinkhorn
// iterations replayed in fp64 from a tape of their states, as core/cpu_hc.c does), mHC post, the HyperHead, SwiGLU
// with clamps, the routing weights' and the experts' output gradients, the per-token slot sums, and the router through
// its score function. core/cpu_hc.c and core/cpu_moe.c are the definitions.
//
// Determinism: no atomics. Every output element is computed by one thread in the CPU's order, or reduced in an order
// fixed by the shapes alone (the dot products over D: lane-strided partial sums, then a fixed butterfly; the mixing
// logits: the batch-invariant GEMM of the forward), so two runs give the same bits and a token's result does not
// depend on the batch. The weight-side sums over tokens are not done here: the per-token parts (dzb, dzs) are summed
// in row order by colsum_add.
//
// Rounding: where the CPU's order is followed, a multiply-add is rounded twice as the CPU rounds it (it is built
// without FMA contraction; nvcc would fuse a·b + c), so equal inputs give equal bits there up to the libm functions
// (expf, exp). The long dot products and the mixing GEMM sum in another order and differ from the CPU by fp32
// rounding. (The forward in cuda_hc.cu lets nvcc fuse mix·scale + base, so the coefficients recomputed here can
// differ from the ones it used in the last bit.)
//
// Speed: the per-token work runs a token per warp where the shapes allow (n <= 8; the norm and dots, the coefficients,
// mHC post; the coefficients and mHC post two tokens a warp where n·n <= 16, so that the fp64 Sinkhorn replay of n·n
// elements leaves no lane idle), each reading a token's rows once with many loads in flight; mHC post's mixing GEMM, with many tokens,
// reads X scaled by the norm factors instead of a normalised copy written and read back; where the schedule passes the
// mixing logits its forward kept (mix), neither site runs its mixing GEMM again. The block-per-token kernels
// stay as the definition of the bits (and for wide n); DS4_CUDA_HC_REF=1 selects them, and the tests require equal
// bytes.
#include <type_traits>

#include "cuda_dev.cuh"
#include "shape_limits.h"

namespace {

// f(std::integral_constant<int, n>{}) for a run-time stream count n in 1..MAXN (the token-per-warp kernels hold a
// token's n streams in registers, so n is a template argument); false, having called nothing, for any other n.
template <int MAXN, int N = 1, typename F>
bool with_streams(int64_t n, F &&f) {
    if (n == N) {
        f(std::integral_constant<int, N>{});
        return true;
    }
    if constexpr (N < MAXN) return with_streams<MAXN, N + 1>(n, f);
    return false;
}

constexpr int BT = 256;                       // threads of a per-token block; the norm's tree is the forward's
constexpr size_t TAPE_SMEM = 32768;           // a Sinkhorn tape up to this size stays in shared memory
constexpr size_t TAPE_GLOBAL = (size_t)64 << 20; // else in scratch, at most this much per launch (tokens in chunks)
constexpr int ROUTER_WARPS = 4;

// a·b + c rounded twice, as the CPU computes it
__device__ __forceinline__ float madd(float a, float b, float c) { return __fadd_rn(__fmul_rn(a, b), c); }
__device__ __forceinline__ double madd(double a, double b, double c) { return __dadd_rn(__dmul_rn(a, b), c); }

// <p, r> over D by one warp: lane l sums elements l, l + 32, .. in order, then a fixed butterfly. Every lane gets it.
__device__ __forceinline__ float warp_dot(const float *p, const float *r, int64_t D) {
    float s = 0.0f;
    for (int64_t c = threadIdx.x & 31; c < D; c += 32) s = fmaf(p[c], r[c], s);
    return ds4d_warp_sumf(s);
}

// ------------------------------------------------------------------------------------------ mHC and HyperHead

// Per token (one block): the normalised streams xn = X / rms(X) over its n·D values (the forward's hc_norm_kernel:
// same block size and tree, so the same bits and then the same mixing logits), and the dot products over D that do
// not depend on the coefficients, one warp each:
//   post == 0: out0[t·ld0 + i] = <G_t, X_t,i> for i < n          (G = du [T, D]: the collapse's dpre before σ')
//   post == 1: out0[t·n + k] = <G_t,k, A_t>, out1[t·n² + j·n + k] = <G_t,k, X_t,j>   (G = dXo [T, n, D], A = a [T, D])
__global__ void __launch_bounds__(BT) norm_dots_kernel(const float *X, float *xn, int64_t n, int64_t D, double eps,
                                                       const float *G, const float *A, float *out0, int64_t ld0,
                                                       float *out1, int post) {
    __shared__ double sh[BT / 32];
    const int64_t t = blockIdx.x, nD = n * D;
    const float *x = X + t * nD;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < nD; i += blockDim.x) ss += (double)x[i] * x[i];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, nD, eps);
    for (int64_t i = threadIdx.x; i < nD; i += blockDim.x) xn[t * nD + i] = x[i] * inv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int64_t ndots = post ? n + n * n : n;
    for (int64_t q = warp; q < ndots; q += nw) {
        if (!post) {
            const float v = warp_dot(G + t * D, x + q * D, D);
            if (lane == 0) out0[t * ld0 + q] = v;
        } else if (q < n) {
            const float v = warp_dot(G + t * nD + q * D, A + t * D, D);
            if (lane == 0) out0[t * n + q] = v;
        } else {
            const int64_t jk = q - n, j = jk / n, k = jk % n;
            const float v = warp_dot(G + t * nD + k * D, x + j * D, D);
            if (lane == 0) out1[t * n * n + jk] = v;
        }
    }
}

// The same results with a token per WARP (ND_WARPS tokens a block) for n = N <= ND_MAXN, known at compile time so that
// the dots' accumulators stay in registers. norm_dots_kernel is the definition; every sum keeps its order, so the
// same bits:
//   - the RMS: virtual thread τ = 32w + l (w < 8) of that kernel's 256-thread block sums x[τ + 256m] over m in order
//     in fp64; here lane l holds its 8 virtual threads in ss[w], each fed in m order. Then each virtual warp's
//     butterfly (ds4d_warp_sum; every lane ends with the same bits, as an addition commutes) and ds4d_block_sum's
//     second stage: lane w < 8 takes virtual warp w's sum, the others 0, and the same butterfly;
//   - each dot over D: lane l sums c = l, l + 32, .. in order with fmaf, then the butterfly (warp_dot). One warp runs
//     all of a token's dots at once, so G, A and X are read once for all of them (there: once per dot, n + 1 times);
//   - xn = x·inv is elementwise: written as the dots read X; or, xn NULL, the factor inv itself into rinv[t], for a
//     GEMM that scales X's rows as it reads them (the same xn values, not written and read back).
// The loads are __restrict__ (X, G, A are inputs only, xn and the dots outputs of their own) so that the compiler
// may issue the next elements' loads before this element's stores.
constexpr int ND_WARPS = 4, ND_MAXN = 8;

template <int N, bool POST>
__global__ void __launch_bounds__(ND_WARPS * 32) norm_dots_warp_kernel(const float *__restrict__ X,
                                                                       float *__restrict__ xn, int64_t T, int64_t D,
                                                                       double eps, const float *__restrict__ G,
                                                                       const float *__restrict__ A,
                                                                       float *__restrict__ out0, int64_t ld0,
                                                                       float *__restrict__ out1,
                                                                       float *__restrict__ rinv) {
    constexpr int VW = BT / 32; // the virtual warps of norm_dots_kernel's block
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * ND_WARPS + (threadIdx.x >> 5), nD = N * D;
    if (t >= T) return; // a whole warp; nothing below synchronises the block
    const float *x = X + t * nD;
    double ss[VW];
#pragma unroll
    for (int w = 0; w < VW; w++) ss[w] = 0;
#pragma unroll 2
    for (int64_t i0 = lane; i0 < nD; i0 += BT) { // one m: element i0 + 32w belongs to virtual thread 32w + lane
        float v[VW];
#pragma unroll
        for (int w = 0; w < VW; w++) v[w] = i0 + 32 * w < nD ? x[i0 + 32 * w] : 0.0f;
#pragma unroll
        for (int w = 0; w < VW; w++)
            if (i0 + 32 * w < nD) ss[w] += (double)v[w] * v[w];
    }
    double tot = 0.0;
#pragma unroll
    for (int w = 0; w < VW; w++) {
        const double s = ds4d_warp_sum(ss[w]);
        if (lane == w) tot = s;
    }
    const float inv = ds4d_rms_inv(ds4d_warp_sum(tot), nD, eps);
    if (!xn && lane == 0) rinv[t] = inv;

    float acc0[N], acc1[POST ? N * N : 1]; // the dots: [i] / [k] (out0), [j·N + k] (out1)
#pragma unroll
    for (int i = 0; i < N; i++) acc0[i] = 0.0f;
#pragma unroll
    for (int e = 0; e < (POST ? N * N : 1); e++) acc1[e] = 0.0f;
    const float *g = G + t * (POST ? nD : D);
    float *xo = xn ? xn + t * nD : nullptr;
#pragma unroll 2
    for (int64_t c = lane; c < D; c += 32) {
        float xv[N];
#pragma unroll
        for (int j = 0; j < N; j++) xv[j] = x[j * D + c];
        if (!POST) {
            const float gv = g[c];
#pragma unroll
            for (int i = 0; i < N; i++) acc0[i] = fmaf(gv, xv[i], acc0[i]);
        } else {
            const float av = A[t * D + c];
#pragma unroll
            for (int k = 0; k < N; k++) {
                const float gk = g[k * D + c];
                acc0[k] = fmaf(gk, av, acc0[k]);
#pragma unroll
                for (int j = 0; j < N; j++) acc1[POST ? j * N + k : 0] = fmaf(gk, xv[j], acc1[POST ? j * N + k : 0]);
            }
        }
        if (xo)
#pragma unroll
            for (int j = 0; j < N; j++) xo[j * D + c] = xv[j] * inv;
    }
#pragma unroll
    for (int i = 0; i < N; i++) {
        const float v = ds4d_warp_sumf(acc0[i]);
        if (lane == 0) out0[POST ? t * N + i : t * ld0 + i] = v;
    }
    if (POST) {
#pragma unroll
        for (int e = 0; e < N * N; e++) {
            const float v = ds4d_warp_sumf(acc1[POST ? e : 0]);
            if (lane == 0) out1[t * N * N + e] = v;
        }
    }
}

// Sinkhorn of one token by one warp, in fp64 and in the CPU's order (ds4_hc_sinkhorn): row softmax of the comb
// logits (·sc2 + base, rounded in fp32 as the CPU does) + eps, column-normalise, then (iters − 1) × (row, column).
// Lane l owns elements l, l + 32, .. of the n×n matrix; each element sums its row or column itself, sequentially in
// index order, so all elements of a line divide by the same bits. State s (0: softmax + eps; s >= 1: after
// normalisation s, odd s over columns) goes to st + (s % keep)·n²: keep = 2·iters keeps every state (the backward's
// tape), keep = 2 only the last two. P (or NULL) receives the plain softmax. Returns the final state. Called by all W
// lanes of the token (W = 32: a warp; W = 16: a half-warp, both halves of the warp in step, `mask` the lanes that take
// part); each element's arithmetic depends on n and iters alone, so every W gives the same bits. keep >= 2.
template <int W = 32>
__device__ const double *sinkhorn(const float *cl, float sc2, const float *cb, int64_t n, int64_t iters,
                                  double hc_eps, double *st, int64_t keep, double *P, unsigned mask = 0xffffffffu) {
    const int lane = threadIdx.x & (W - 1);
    const int64_t nn = n * n;
    double *R = st + nn; // the logits wait in state 1's slot, which the first normalisation overwrites
    for (int64_t e = lane; e < nn; e += W) R[e] = (double)madd(cl[e], sc2, cb[e]);
    __syncwarp(mask);
    for (int64_t e = lane; e < nn; e += W) {
        const int64_t j = e / n;
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k < n; k++) mx = R[j * n + k] > mx ? R[j * n + k] : mx;
        for (int64_t k = 0; k < n; k++) sum += exp(R[j * n + k] - mx);
        const double v = exp(R[e] - mx);
        if (P) P[e] = v / sum;
        st[e] = v / sum + hc_eps;
    }
    for (int64_t s = 1; s < 2 * iters; s++) {
        __syncwarp(mask); // state s - 1 complete, and nobody still reads the slot that state s overwrites
        const double *x0 = st + ((s - 1) % keep) * nn;
        double *x1 = st + (s % keep) * nn;
        const bool col = s % 2 == 1;
        for (int64_t e = lane; e < nn; e += W) {
            const int64_t a = col ? e % n : e / n;
            double sum = 0;
            for (int64_t q = 0; q < n; q++) sum += col ? x0[q * n + a] : x0[a * n + q];
            x1[e] = x0[e] / (sum + hc_eps);
        }
    }
    __syncwarp(mask);
    return st + ((2 * iters - 1) % keep) * nn;
}

// The comb part of the mix gradient of one token (warp 0 of its block), as hc_pre_bwd_range: the Sinkhorn forward
// again onto the tape [(2·iters + 1)·n²] (states 0 .. 2·iters − 1, then P), dcomb back through every normalisation
// y = x / (Σ x + eps) along its line (g and gx [n²]: ping-pong), then through the row softmax (the +eps passes the
// gradient). dz [n²] in fp32, as the CPU rounds it. W lanes and mask as sinkhorn's.
template <int W = 32>
__device__ void sinkhorn_bwd(const float *cl, float sc2, const float *cb, const float *dcomb, int64_t n,
                             int64_t iters, double hc_eps, double *tape, double *g, double *gx, float *dz,
                             unsigned mask = 0xffffffffu) {
    const int lane = threadIdx.x & (W - 1);
    const int64_t nn = n * n, ns = 2 * iters;
    const double *P = tape + ns * nn;
    sinkhorn<W>(cl, sc2, cb, n, iters, hc_eps, tape, ns, tape + ns * nn, mask);
    for (int64_t e = lane; e < nn; e += W) g[e] = dcomb[e];
    for (int64_t s = ns - 1; s >= 1; s--) {
        __syncwarp(mask);
        const double *x0 = tape + (s - 1) * nn;
        const bool col = s % 2 == 1;
        for (int64_t e = lane; e < nn; e += W) {
            const int64_t a = col ? e % n : e / n;
            double sum = 0, gs = 0;
            for (int64_t q = 0; q < n; q++) {
                const int64_t ix = col ? q * n + a : a * n + q;
                sum += x0[ix];
                gs = madd(g[ix], x0[ix], gs);
            }
            const double cden = sum + hc_eps;
            gx[e] = g[e] / cden - gs / (cden * cden);
        }
        double *tmp = g;
        g = gx, gx = tmp;
    }
    __syncwarp(mask);
    for (int64_t e = lane; e < nn; e += W) {
        const int64_t j = e / n;
        double dot = 0;
        for (int64_t k = 0; k < n; k++) dot = madd(P[j * n + k], g[j * n + k], dot);
        dz[e] = (float)(P[e] * (g[e] - dot));
    }
}

struct coef_args {
    const float *du;              // [T, D]
    const float *dpost, *dcomb;   // [T, n], [T, n, n] (not read by the HyperHead)
    const float *base, *sc;       // [nmix], [3]
    float *dX;                    // [T, n, D]: mHC pre adds, the HyperHead writes
    float *dmix;                  // [T, nmix]: the mixing logits on entry, their gradient on return
    float *dzb;                   // [T, nmix]: the dots <du, X_i> in columns < n on entry, the base gradient on return
    float *dzs;                   // [T, 3]: the scale gradient (the HyperHead: column 0 only)
    double *gtape;                // [tokens of a launch, (2·iters + 1)·n²] tapes in scratch, or NULL: in shared memory
    int64_t t0, n, D, iters;
    double hc_eps;
    int head;                     // the HyperHead: pre only (nmix = n), no post, no Sinkhorn
    const float *mix;             // [T, nmix]: the logits the forward kept, or NULL: dmix holds them on entry
    float *pre;                   // [T, n] or NULL: coef_bwd_warp_kernel leaves the collapse's weights pre_i here
                                  // and collapse_bwd_kernel applies them (else it applies them itself)
};

// Token t's mixing logit i (read before dmix is written).
__device__ __forceinline__ float coef_logit(const coef_args &a, int64_t t, int64_t nmix, int64_t i) {
    return (a.mix ? a.mix : a.dmix)[t * nmix + i];
}

// Token t's pre (and post) parts of dz from its logits smix, by its W lanes: spre = sigmoid(...) + eps, sdz.
__device__ __forceinline__ void coef_dz_pre_post(const coef_args &a, int64_t t, int64_t nmix, const float *smix,
                                                 float *spre, float *sdz, int lane, int W = 32) {
    const int64_t n = a.n;
    for (int64_t i = lane; i < n; i += W) {
        const float sg = ds4d_sigmoid(madd(smix[i], a.sc[0], a.base[i]));
        spre[i] = sg + (float)a.hc_eps;
        sdz[i] = a.dzb[t * nmix + i] * sg * (1.0f - sg);
        if (!a.head) {
            const float sp = ds4d_sigmoid(madd(smix[n + i], a.sc[1], a.base[n + i]));
            sdz[n + i] = a.dpost[t * n + i] * 2.0f * sp * (1.0f - sp);
        }
    }
}

// Token t's results from its complete dz (its W lanes, after a __syncwarp): dzb, dmix = dz · scale, and the scale
// sums dzs added sequentially by lane 0 in the CPU's order.
__device__ __forceinline__ void coef_finish(const coef_args &a, int64_t t, int64_t nmix, const float *smix,
                                            const float *sdz, int lane, int W = 32) {
    const int64_t n = a.n;
    for (int64_t i = lane; i < nmix; i += W) {
        a.dzb[t * nmix + i] = sdz[i];
        a.dmix[t * nmix + i] = sdz[i] * a.sc[i < n ? 0 : (i < 2 * n ? 1 : 2)];
    }
    if (lane == 0) {
        float z0 = 0.0f, z1 = 0.0f, z2 = 0.0f;
        for (int64_t i = 0; i < n; i++) z0 = madd(sdz[i], smix[i], z0);
        a.dzs[t * 3] = z0;
        if (!a.head) {
            for (int64_t i = n; i < 2 * n; i++) z1 = madd(sdz[i], smix[i], z1);
            for (int64_t i = 2 * n; i < nmix; i++) z2 = madd(sdz[i], smix[i], z2);
            a.dzs[t * 3 + 1] = z1, a.dzs[t * 3 + 2] = z2;
        }
    }
}

// The coefficients' backward of one token per block. Warp 0 computes the pre (and post) parts of dz from the
// logits; then, for mHC pre, warp 0 replays Sinkhorn and back-propagates dcomb while the other warps apply the
// collapse's gradient dX_i += pre_i · du (the HyperHead: all warps, dX written). Finally warp 0 writes dzb, dmix =
// dz · scale and the scale sums dzs, summed sequentially in the CPU's order.
__global__ void __launch_bounds__(BT) coef_bwd_kernel(coef_args a) {
    __shared__ float smix[DS4_MAX_HC_MIX], sdz[DS4_MAX_HC_MIX], spre[DS4_MAX_HC];
    extern __shared__ double dyn[]; // Sinkhorn: g, gx [n²], then the tape when it is not in scratch
    const int64_t t = a.t0 + blockIdx.x, n = a.n, D = a.D, nn = n * n, nmix = a.head ? n : (2 + n) * n;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool sink = !a.head;
    for (int64_t i = threadIdx.x; i < nmix; i += blockDim.x) smix[i] = coef_logit(a, t, nmix, i);
    __syncthreads();
    if (warp == 0) coef_dz_pre_post(a, t, nmix, smix, spre, sdz, lane);
    __syncthreads();
    if (sink && warp == 0) {
        double *tape = a.gtape ? a.gtape + (int64_t)blockIdx.x * (2 * a.iters + 1) * nn : dyn + 2 * nn;
        sinkhorn_bwd(smix + 2 * n, a.sc[2], a.base + 2 * n, a.dcomb + t * nn, n, a.iters, a.hc_eps, tape, dyn,
                     dyn + nn, sdz + 2 * n);
    } else {
        const int64_t first = threadIdx.x - (sink ? 32 : 0), stride = blockDim.x - (sink ? 32 : 0);
        const float *du = a.du + t * D;
        float *dX = a.dX + t * n * D;
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = first; c < D; c += stride)
                dX[i * D + c] = madd(spre[i], du[c], a.head ? 0.0f : dX[i * D + c]);
    }
    if (warp == 0) {
        __syncwarp();
        coef_finish(a, t, nmix, smix, sdz, lane);
    }
}

// The same per token, one token per W lanes (W = 32: a warp; W = 16 where n·n <= 16: two tokens a warp, so that the
// fp64 Sinkhorn, 16 elements at n = 4, keeps every lane busy, not half of them), COEF_WARPS·32 / W tokens a block,
// for tapes that fit in shared memory: the per-token kernel above keeps 7 of its 8 warps waiting while warp 0 runs the
// Sinkhorn replay and backward (latency bound fp64 chains), and an SM holds 8 such blocks, so 8 tokens at a time.
// Here each token's lanes replay its own Sinkhorn, then apply the collapse's gradient themselves (elementwise, so in
// any order the same values); the per-token arithmetic is the kernel above's, whichever W, so the same bits. Shared
// memory per token: smix, sdz [nmix], spre [n] floats, then g, gx [n²] and the tape [(2·iters + 1)·n²] doubles
// (coef_warp_bytes).
constexpr int COEF_WARPS = 4;

__host__ __device__ inline size_t coef_warp_floats(int64_t n, int64_t nmix) { return (size_t)((2 * nmix + n + 1) / 2 * 2); }
__host__ __device__ inline size_t coef_warp_bytes(int64_t n, int64_t nmix, int64_t tape) {
    return coef_warp_floats(n, nmix) * sizeof(float) + (size_t)(2 * n * n + tape) * sizeof(double);
}

template <int W>
__global__ void __launch_bounds__(COEF_WARPS * 32) coef_bwd_warp_kernel(coef_args a, int64_t nt) {
    extern __shared__ double wdyn[];
    constexpr int TPB = COEF_WARPS * 32 / W;
    const int slot = threadIdx.x / W, lane = threadIdx.x & (W - 1);
    const int64_t k = (int64_t)blockIdx.x * TPB + slot; // the token within the launch
    // the lanes of this warp that have a token: both halves, or at the launch's end the first half alone
    const int64_t first = ((int64_t)blockIdx.x * COEF_WARPS * 32 + (threadIdx.x & ~31)) / W;
    const unsigned mask = W == 32 || first + 1 < nt ? 0xffffffffu : 0x0000ffffu;
    if (k >= nt) return; // a whole token's lanes; nothing below synchronises the block
    const int64_t t = a.t0 + k, n = a.n, D = a.D, nn = n * n, nmix = a.head ? n : (2 + n) * n;
    const int64_t tape = a.head ? 0 : (2 * a.iters + 1) * nn;
    char *mine = reinterpret_cast<char *>(wdyn) + (size_t)slot * coef_warp_bytes(n, nmix, tape);
    float *smix = reinterpret_cast<float *>(mine), *sdz = smix + nmix, *spre = sdz + nmix;
    double *dd = reinterpret_cast<double *>(smix + coef_warp_floats(n, nmix)); // g, gx, tape
    const bool sink = !a.head;
    for (int64_t i = lane; i < nmix; i += W) smix[i] = coef_logit(a, t, nmix, i);
    __syncwarp(mask);
    coef_dz_pre_post(a, t, nmix, smix, spre, sdz, lane, W);
    __syncwarp(mask);
    if (sink)
        sinkhorn_bwd<W>(smix + 2 * n, a.sc[2], a.base + 2 * n, a.dcomb + t * nn, n, a.iters, a.hc_eps, dd + 2 * nn,
                        dd, dd + nn, sdz + 2 * n, mask);
    if (a.pre) { // the collapse's gradient by collapse_bwd_kernel, which streams it with every thread of the GPU
        for (int64_t i = lane; i < n; i += W) a.pre[t * n + i] = spre[i];
        __syncwarp(mask);
        coef_finish(a, t, nmix, smix, sdz, lane, W);
        return;
    }
    // the collapse's gradient, elementwise: du[c] read once for the n streams, and the next streams' values loaded
    // before this one's is stored (__restrict__: du and dX are distinct buffers)
    const float *__restrict__ du = a.du + t * D;
    float *__restrict__ dX = a.dX + t * n * D;
#pragma unroll 2
    for (int64_t c = lane; c < D; c += W) {
        const float u = du[c];
        for (int64_t i0 = 0; i0 < n; i0 += 8) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = i0 + i < n && !a.head ? dX[(i0 + i) * D + c] : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i0 + i < n) dX[(i0 + i) * D + c] = madd(spre[i0 + i], u, v[i]);
        }
    }
    __syncwarp(mask);
    coef_finish(a, t, nmix, smix, sdz, lane, W);
}

// The collapse's gradient dX[t, i, c] = pre[t, i]·du[t, c] (+ dX[t, i, c] unless head), the same madd as the
// coefficient kernels', after coef_bwd_warp_kernel has left pre [T, n]: a thread per 4 columns of a token (one 16-byte
// load of du, then the n streams' loads issued before any store), so that the whole GPU streams dX while the
// per-token Sinkhorn chains (latency-bound fp64) ran in the kernel before, not between its loads. V: 16-byte accesses
// (D % 4 == 0, du and dX 16-byte aligned); else a column per thread.
template <bool V>
__global__ void __launch_bounds__(256) collapse_bwd_kernel(const float *__restrict__ du, const float *__restrict__ pre,
                                                           float *__restrict__ dX, int64_t T, int64_t n, int64_t D,
                                                           int head) {
    constexpr int C = V ? 4 : 1, MAXN = 8;
    const int64_t per = D / C, j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= T * per) return;
    const int64_t t = j / per, c = (j % per) * C;
    float u[C];
    if constexpr (V) {
        const float4 q = *reinterpret_cast<const float4 *>(du + t * D + c);
        u[0] = q.x, u[1] = q.y, u[2] = q.z, u[3] = q.w;
    } else {
        u[0] = du[t * D + c];
    }
    for (int64_t i0 = 0; i0 < n; i0 += MAXN) {
        float v[MAXN][C];
#pragma unroll
        for (int i = 0; i < MAXN; i++) {
            if (i0 + i >= n) break;
            float *x = dX + (t * n + i0 + i) * D + c;
            if constexpr (V) {
                const float4 q = head ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : *reinterpret_cast<const float4 *>(x);
                v[i][0] = q.x, v[i][1] = q.y, v[i][2] = q.z, v[i][3] = q.w;
            } else {
                v[i][0] = head ? 0.0f : x[0];
            }
        }
#pragma unroll
        for (int i = 0; i < MAXN; i++) {
            if (i0 + i >= n) break;
            const float p = pre[t * n + i0 + i];
            float *x = dX + (t * n + i0 + i) * D + c;
            if constexpr (V) {
                *reinterpret_cast<float4 *>(x) =
                    make_float4(madd(p, u[0], v[i][0]), madd(p, u[1], v[i][1]), madd(p, u[2], v[i][2]),
                                madd(p, u[3], v[i][3]));
            } else {
                x[0] = madd(p, u[0], v[i][0]);
            }
        }
    }
}

// mHC post backward of one token per block, from dpost / dcomb already in place (norm_dots_kernel): warp 0
// recomputes post (first) and M (Sinkhorn, the last two states in st [2·n²]) from the logits mixp = [post | comb]
// (n + n² of them a token, row stride ldm); meanwhile the other warps form da = Σ_k post_k dXo_k; then all form dX_j = Σ_k M[j][k] dXo_k. Sums in
// k order from 0, as the CPU's axpys.
__global__ void __launch_bounds__(BT) post_bwd_kernel(const float *dXo, const float *mixp, int64_t ldm,
                                                      const float *base, const float *sc, float *dX, float *da,
                                                      int64_t n, int64_t D, int64_t iters, double hc_eps) {
    __shared__ float spost[DS4_MAX_HC], sM[DS4_MAX_HC_SQ];
    extern __shared__ double st[];
    const int64_t t = blockIdx.x, nn = n * n;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *m = mixp + t * ldm, *dxo = dXo + t * n * D;
    if (warp == 0)
        for (int64_t i = lane; i < n; i += 32) spost[i] = 2.0f * ds4d_sigmoid(madd(m[i], sc[1], base[n + i]));
    __syncthreads();
    if (warp == 0) {
        const double *M = sinkhorn(m + n, sc[2], base + 2 * n, n, iters, hc_eps, st, 2, nullptr);
        for (int64_t e = lane; e < nn; e += 32) sM[e] = (float)M[e];
    } else {
        for (int64_t c = threadIdx.x - 32; c < D; c += blockDim.x - 32) {
            float acc = 0.0f;
            for (int64_t k = 0; k < n; k++) acc = madd(spost[k], dxo[k * D + c], acc);
            da[t * D + c] = acc;
        }
    }
    __syncthreads();
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
            float acc = 0.0f;
            for (int64_t k = 0; k < n; k++) acc = madd(sM[j * n + k], dxo[k * D + c], acc);
            dX[(t * n + j) * D + c] = acc;
        }
}

// The same with a token per warp (COEF_WARPS tokens a block) for n = N <= POST_SMALL_N, two tokens a warp (a
// half-warp each, so that the fp64 Sinkhorn keeps every lane busy) where N·N <= 16: each token's lanes recompute its
// post and Sinkhorn (every width gives the same bits: sinkhorn), then form da and dX themselves with
// post_bwd_kernel's expressions (each output's madd chain over k from 0: the same bits). A lane reads its N values
// dXo_k[c] once, into registers, and forms da[c] and every dX_j[c] from them (read N + 1 times, each read behind the
// previous output's store, they made the kernel wait on memory); post and M wait in registers too.
constexpr int POST_SMALL_N = 8;

template <int N> __host__ __device__ constexpr int post_lanes() { return N * N <= 16 ? 16 : 32; }

template <int N>
__global__ void __launch_bounds__(COEF_WARPS * 32) post_bwd_warp_kernel(const float *__restrict__ dXo,
                                                                        const float *__restrict__ mixp, int64_t ldm,
                                                                        const float *base, const float *sc,
                                                                        float *__restrict__ dX, float *__restrict__ da,
                                                                        int64_t T, int64_t D, int64_t iters,
                                                                        double hc_eps) {
    constexpr int NN = N * N, W = post_lanes<N>(), TPB = COEF_WARPS * 32 / W;
    __shared__ double st[TPB][2 * NN];
    __shared__ float spost[TPB][N], sM[TPB][NN];
    const int slot = threadIdx.x / W, lane = threadIdx.x & (W - 1);
    const int64_t t = (int64_t)blockIdx.x * TPB + slot;
    // the lanes of this warp that have a token: both halves, or at the batch's end the first half alone
    const int64_t first = ((int64_t)blockIdx.x * COEF_WARPS * 32 + (threadIdx.x & ~31)) / W;
    const unsigned mask = W == 32 || first + 1 < T ? 0xffffffffu : 0x0000ffffu;
    if (t >= T) return; // a whole token's lanes; nothing below synchronises the block
    const float *m = mixp + t * ldm, *dxo = dXo + t * N * D;
    for (int64_t i = lane; i < N; i += W) spost[slot][i] = 2.0f * ds4d_sigmoid(madd(m[i], sc[1], base[N + i]));
    const double *M = sinkhorn<W>(m + N, sc[2], base + 2 * N, N, iters, hc_eps, st[slot], 2, nullptr, mask);
    for (int64_t e = lane; e < NN; e += W) sM[slot][e] = (float)M[e];
    __syncwarp(mask);
    float p[N], w[NN];
#pragma unroll
    for (int k = 0; k < N; k++) p[k] = spost[slot][k];
#pragma unroll
    for (int e = 0; e < NN; e++) w[e] = sM[slot][e];
#pragma unroll 2
    for (int64_t c = lane; c < D; c += W) {
        float v[N];
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = dxo[k * D + c];
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < N; k++) acc = madd(p[k], v[k], acc);
        da[t * D + c] = acc;
#pragma unroll
        for (int j = 0; j < N; j++) {
            acc = 0.0f;
#pragma unroll
            for (int k = 0; k < N; k++) acc = madd(w[j * N + k], v[k], acc);
            dX[(t * N + j) * D + c] = acc;
        }
    }
}

template <int N>
void post_bwd_warps(cudaStream_t s, const float *dXo, const float *mixp, int64_t ldm, const float *base, const float *sc,
                    float *dX, float *da, int64_t T, int64_t D, int64_t iters, double hc_eps) {
    constexpr int TPB = COEF_WARPS * 32 / post_lanes<N>();
    post_bwd_warp_kernel<N><<<(unsigned)((T + TPB - 1) / TPB), COEF_WARPS * 32, 0, s>>>(dXo, mixp, ldm, base, sc, dX,
                                                                                        da, T, D, iters, hc_eps);
}

// The shapes the per-token kernels take: one block per token, a token's mixing values in shared arrays sized by
// DS4_MAX_HC, at least one Sinkhorn iteration (the CPU's tape layout assumes it; configs require it).
bool hc_shapes_ok(ds4_dev *d, const char *op, int64_t T, int64_t n, int64_t D, int64_t iters, bool sink) {
    if (n < 1 || n > DS4_MAX_HC) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: hc_mult %lld (1 .. %d)", op, (long long)n, DS4_MAX_HC);
        return false;
    }
    if (D < 1) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: hidden size %lld", op, (long long)D);
        return false;
    }
    if (sink && iters < 1) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: hc_sinkhorn_iters %lld (at least 1)", op, (long long)iters);
        return false;
    }
    if (T > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld tokens (one block each: at most 2^31 - 1)", op, (long long)T);
        return false;
    }
    return true;
}

template <int N>
void norm_dots_warps(cudaStream_t s, const float *X, float *xn, int64_t T, int64_t D, double eps, const float *G,
                     const float *A, float *out0, int64_t ld0, float *out1, int post, float *rinv) {
    const unsigned blocks = (unsigned)((T + ND_WARPS - 1) / ND_WARPS);
    if (post)
        norm_dots_warp_kernel<N, true><<<blocks, ND_WARPS * 32, 0, s>>>(X, xn, T, D, eps, G, A, out0, ld0, out1, rinv);
    else
        norm_dots_warp_kernel<N, false><<<blocks, ND_WARPS * 32, 0, s>>>(X, xn, T, D, eps, G, A, out0, ld0, out1, rinv);
}

// Whether norm_dots takes the token-per-warp kernel (which can return the norm factors instead of xn).
bool norm_dots_by_warps(ds4_dev *d, int64_t n) { return n <= ND_MAXN && !cdev(d)->hc_ref; }

// The norm and the dots over T tokens, checked: a token per warp for n <= ND_MAXN, else (and with DS4_CUDA_HC_REF=1,
// the kernel that defines the bits) a block per token. xn NULL (the token-per-warp kernel only): the factors 1 / rms
// into rinv [T] instead.
bool norm_dots(ds4_dev *d, const char *op, const float *X, float *xn, int64_t T, int64_t n, int64_t D, double eps,
               const float *G, const float *A, float *out0, int64_t ld0, float *out1, int post, float *rinv = nullptr) {
    const cudaStream_t s = cdev(d)->stream;
    const bool warps = norm_dots_by_warps(d, n);
    const auto per_warp = [&](auto N) {
        norm_dots_warps<decltype(N)::value>(s, X, xn, T, D, eps, G, A, out0, ld0, out1, post, rinv);
    };
    if (!xn && !warps) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: norm factors without xn from the block-per-token kernel", op);
        return false;
    }
    if (!warps || !with_streams<ND_MAXN>(n, per_warp))
        norm_dots_kernel<<<(unsigned)T, BT, 0, s>>>(X, xn, n, D, eps, G, A, out0, ld0, out1, post);
    return ds4_cuda_launched(d, op, "norm and dots [%lld tokens, %lld streams, %lld%s]", (long long)T, (long long)n,
                             (long long)D, warps ? ", a token per warp" : "");
}

// coef_bwd_kernel over T tokens: the Sinkhorn tape in shared memory when it fits, else in scratch slot 1 (the GEMM
// before it uses slot 0), tokens in chunks so that the scratch stays bounded.
void coef_bwd(ds4_dev *d, const char *op, coef_args g, int64_t T) {
    const int64_t nn = g.n * g.n, tape = g.head ? 0 : (2 * g.iters + 1) * nn;
    const size_t tsmem = coef_warp_bytes(g.n, g.head ? g.n : (2 + g.n) * g.n, tape); // a token's
    // two tokens a warp where n·n <= 16 (the usual shapes: n = 4, 20 iterations: 46 KB a block), else a token per warp;
    // DS4_CUDA_HC_REF=1: a block per token, the kernel that defines the bits
    const int lanes = nn <= 16 && 2 * COEF_WARPS * tsmem <= 48 * 1024 ? 16 : 32;
    const int64_t tpb = COEF_WARPS * 32 / lanes;
    const size_t wsmem = (size_t)tpb * tsmem;
    if (wsmem <= 48 * 1024 && !cdev(d)->hc_ref) {
        g.gtape = nullptr, g.t0 = 0;
        // the collapse's weights [T, n] through scratch slot 1 (the GEMM before uses slot 0) to collapse_bwd_kernel
        g.pre = T * g.D <= (int64_t)INT32_MAX * 256 ? (float *)ds4_cuda_scratch(d, (size_t)(T * g.n) * sizeof(float),
                                                                                 op, 1)
                                                    : nullptr;
        if (d->st) return;
        const unsigned blocks = (unsigned)((T + tpb - 1) / tpb);
        if (lanes == 16) coef_bwd_warp_kernel<16><<<blocks, COEF_WARPS * 32, wsmem, cdev(d)->stream>>>(g, T);
        else coef_bwd_warp_kernel<32><<<blocks, COEF_WARPS * 32, wsmem, cdev(d)->stream>>>(g, T);
        if (!ds4_cuda_launched(d, op, "coefficients [%lld tokens, %lld streams, %lld, %lld iterations, %s]",
                               (long long)T, (long long)g.n, (long long)g.D, (long long)g.iters,
                               lanes == 16 ? "two tokens a warp" : "a token per warp") ||
            !g.pre)
            return;
        const bool v = g.D % 4 == 0 && ((uintptr_t)g.du & 15) == 0 && ((uintptr_t)g.dX & 15) == 0;
        const int64_t threads = T * (v ? g.D / 4 : g.D);
        if (v)
            collapse_bwd_kernel<true><<<ds4_blocks(threads, 256), 256, 0, cdev(d)->stream>>>(g.du, g.pre, g.dX, T,
                                                                                             g.n, g.D, g.head);
        else
            collapse_bwd_kernel<false><<<ds4_blocks(threads, 256), 256, 0, cdev(d)->stream>>>(g.du, g.pre, g.dX, T,
                                                                                              g.n, g.D, g.head);
        ds4_cuda_launched(d, op, "the collapse's gradient [%lld tokens, %lld streams, %lld]", (long long)T,
                          (long long)g.n, (long long)g.D);
        return;
    }
    size_t smem = g.head ? 0 : (size_t)(2 * nn + tape) * sizeof(double);
    int64_t chunk = T;
    g.gtape = nullptr;
    if (smem > TAPE_SMEM) {
        smem = (size_t)(2 * nn) * sizeof(double);
        const int64_t fit = (int64_t)(TAPE_GLOBAL / ((size_t)tape * sizeof(double)));
        chunk = fit < 1 ? 1 : (fit < T ? fit : T);
        g.gtape = (double *)ds4_cuda_scratch(d, (size_t)(chunk * tape) * sizeof(double), op, 1);
        if (!g.gtape) return;
    }
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        g.t0 = t0;
        const int64_t nt = T - t0 < chunk ? T - t0 : chunk;
        coef_bwd_kernel<<<(unsigned)nt, BT, smem, cdev(d)->stream>>>(g);
        if (!ds4_cuda_launched(d, op, "coefficients [tokens %lld .. %lld of %lld, %lld streams, %lld, %lld iterations%s]",
                               (long long)t0, (long long)(t0 + nt), (long long)T, (long long)g.n, (long long)g.D,
                               (long long)g.iters, g.gtape ? ", tape in scratch" : ""))
            return;
    }
}

// ------------------------------------------------------------------------------------------ MoE and router

// SwiGLU with clamps (cpu_moe.c, swiglu_bwd_range): grads = 0 recomputes act; grads = 1 writes dg1 / dg3, where the
// clamps pass the gradient inside [min, max] with the boundaries. dg3 may be dact: each element is read first.
__global__ void swiglu_bwd_kernel(const float *g1, const float *g3, const float *dact, float *act, float *dg1,
                                  float *dg3, int64_t N, float lim, int grads) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x) {
        const float x1 = g1[i], x3 = g3[i];
        const float g = x1 > lim ? lim : x1;
        const float u = x3 < -lim ? -lim : (x3 > lim ? lim : x3);
        if (!grads) {
            act[i] = ds4d_silu(g) * u;
            continue;
        }
        const float sgm = ds4d_sigmoid(g), silu = g * sgm;
        const float dsilu = sgm * madd(g, 1.0f - sgm, 1.0f);
        const float dy = dact[i];
        dg1[i] = x1 <= lim ? dy * u * dsilu : 0.0f;
        dg3[i] = (x3 >= -lim && x3 <= lim) ? dy * silu : 0.0f;
    }
}

// dws[slot] = <da[slot / K], ye[slot]>, one warp per slot.
__global__ void moe_dws_kernel(float *dws, const float *da, const float *ye, int64_t n, int64_t K, int64_t D) {
    const int warps = blockDim.x >> 5;
    for (int64_t s = (int64_t)blockIdx.x * warps + (threadIdx.x >> 5); s < n; s += (int64_t)gridDim.x * warps) {
        const float v = warp_dot(da + (s / K) * D, ye + s * D, D);
        if ((threadIdx.x & 31) == 0) dws[s] = v;
    }
}

// dys[r] = 0 + ew[perm[r]] · da[perm[r] / K] (the CPU clears the row, then adds), a block per row r
__global__ void moe_dy_kernel(float *dys, const float *da, const float *ew, const int32_t *perm, int64_t K,
                              int64_t D) {
    const int64_t r = blockIdx.x, slot = perm[r];
    const float w = ew[slot];
    ds4d_row_map(dys + r * D, da + (slot / K) * D, D, [w](float x) { return madd(w, x, 0.0f); });
}

// dh[t] += dxslot[t·K + k] for k in slot order, one add at a time as the CPU's axpys
__global__ void moe_sum_slots_kernel(float *dh, const float *dxslot, int64_t N, int64_t K, int64_t D) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / D, c = i % D;
        float acc = dh[i];
        for (int64_t k = 0; k < K; k++) acc = __fadd_rn(acc, dxslot[(t * K + k) * D + c]);
        dh[i] = acc;
    }
}

// Router backward, one warp per token (cpu_moe.c, ds4_cpu_router_bwd): lane 0 takes the K selected slots in order
// (the renormalisation w_k = rsf·s_k / (Σ s + 1e-20), a repeated expert adding up), then every expert's logit
// gradient through the score function. The softmax's <s, dsc> is a double sum (lanes, then the butterfly).
__global__ void __launch_bounds__(ROUTER_WARPS * 32) router_bwd_kernel(const int32_t *eidx, const float *rsc,
                                                                       const float *rlog, const float *dws, float *dsc,
                                                                       float *dlog, int64_t T, int64_t E, int64_t K,
                                                                       float rsf, int sf) {
    const int lane = threadIdx.x & 31;
    for (int64_t t = (int64_t)blockIdx.x * ROUTER_WARPS + (threadIdx.x >> 5); t < T;
         t += (int64_t)gridDim.x * ROUTER_WARPS) {
        const int32_t *idx = eidx + t * K;
        const float *s = rsc + t * E, *x = rlog + t * E, *dw = dws + t * K;
        float *ds = dsc + t * E, *dl = dlog + t * E;
        for (int64_t e = lane; e < E; e += 32) ds[e] = 0.0f;
        __syncwarp();
        if (lane == 0) {
            float sum = 0.0f, wdot = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
            sum += 1e-20f;
            for (int64_t k = 0; k < K; k++) wdot = madd(dw[k], s[idx[k]], wdot);
            for (int64_t k = 0; k < K; k++) ds[idx[k]] = madd(rsf, dw[k] / sum - wdot / (sum * sum), ds[idx[k]]);
        }
        __syncwarp();
        if (sf == DS4_SCORE_SOFTMAX) {
            double dot = 0;
            for (int64_t e = lane; e < E; e += 32) dot += (double)s[e] * ds[e]; // exact products: fusing is harmless
            dot = ds4d_warp_sum(dot);
            for (int64_t e = lane; e < E; e += 32) dl[e] = (float)(s[e] * (ds[e] - dot));
        } else if (sf == DS4_SCORE_SIGMOID) {
            for (int64_t e = lane; e < E; e += 32) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
        } else {
            // d sqrt(softplus(x)) = σ(x) / (2 sqrt(softplus(x))); where the score underflowed to 0 its limit
            // e^{x/2} / 2; above torch's threshold 20 softplus is x. Zero upstream gradients are skipped.
            for (int64_t e = lane; e < E; e += 32) {
                if (ds[e] == 0.0f) {
                    dl[e] = 0.0f;
                    continue;
                }
                double der;
                if (x[e] > 20.0f) der = 0.5 / s[e];
                else if (s[e] > 0) der = (1.0 / (1.0 + exp(-(double)x[e]))) / (2.0 * s[e]);
                else der = 0.5 * exp(0.5 * (double)x[e]);
                dl[e] = (float)(ds[e] * der);
            }
        }
    }
}

} // namespace

void ds4_cuda_hc_pre_bwd(ds4_dev *d, const ds4_a_hc_pre_bwd *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t T = a->T, n = c->hc_mult, D = c->hidden_size, nD = n * D, nmix = (2 + n) * n;
    if (!hc_shapes_ok(d, "hc_pre_bwd", T, n, D, c->hc_sinkhorn_iters, true)) return;
    // xn [T, nD] (the weight gradient reads it); dzb[:, :n] = <du, X_i> (read back by coef_bwd_kernel); the mixing
    // logits: the ones the forward kept (the same GEMM of the same xn values: cuda_hc.cu), or dmix [T, nmix] =
    // recomputed (and always with DS4_CUDA_HC_REF=1, so that the tests compare the two)
    const bool kept = a->mix && !cdev(d)->hc_ref;
    if (!norm_dots(d, "hc_pre_bwd", a->X, a->xn, T, n, D, c->rms_norm_eps, a->du, nullptr, a->dzb, nmix, nullptr, 0))
        return;
    if (!kept) ds4_cuda_gemm_f32(d, "hc_pre_bwd", a->dmix, nmix, a->xn, nD, a->w->fn, T, nD, nmix);
    if (d->st) return;
    coef_args g = {a->du, a->dpost, a->dcomb, a->w->base, a->w->scale, a->dX, a->dmix, a->dzb, a->dzs, nullptr, 0, n, D,
                   c->hc_sinkhorn_iters, c->hc_eps, 0, kept ? a->mix : nullptr};
    coef_bwd(d, "hc_pre_bwd", g, T);
}

void ds4_cuda_hc_post_bwd(ds4_dev *d, const ds4_a_hc_post_bwd *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t T = a->T, n = c->hc_mult, D = c->hidden_size, nD = n * D, np = n + n * n;
    if (!hc_shapes_ok(d, "hc_post_bwd", T, n, D, c->hc_sinkhorn_iters, true)) return;
    // The post and comb logits: columns n .. of the ones the forward's hc_pre kept (the same GEMM of the same xn
    // values: cuda_hc.cu; not with DS4_CUDA_HC_REF=1, so that the tests compare the two), or recomputed into scratch:
    // xn [T, nD], then mixp [T, n + n²] (rows n .. of fn), then the norm factors [T]. Where the narrow GEMM runs (many
    // tokens) and the token-per-warp norm, xn is neither written nor read back: the GEMM scales X's rows by the
    // factors as it reads them, the same values (cuda_gemm.cu); with kept logits no GEMM reads it.
    const bool kept = a->mix && !cdev(d)->hc_ref;
    const bool no_xn = norm_dots_by_warps(d, n) && (kept || ds4_cuda_gemm_f32_rowscale_ok(d, T, np));
    const int64_t nxn = no_xn ? 0 : T * nD, nmp = kept ? 0 : T * np, ldm = kept ? n + np : np;
    float *xn = (float *)ds4_cuda_scratch(d, (size_t)(nxn + nmp + T) * sizeof(float), "hc_post_bwd", 1);
    if (!xn) return;
    float *rinv = xn + nxn + nmp;
    const float *mixp = kept ? a->mix + n : xn + nxn;
    if (!norm_dots(d, "hc_post_bwd", a->X, no_xn ? nullptr : xn, T, n, D, c->rms_norm_eps, a->dXo, a->a, a->dpost, n,
                   a->dcomb, 1, rinv))
        return;
    if (!kept && no_xn)
        ds4_cuda_gemm_f32_rowscaled(d, "hc_post_bwd", xn + nxn, np, a->X, nD, rinv, a->w->fn + n * nD, T, nD, np);
    else if (!kept)
        ds4_cuda_gemm_f32(d, "hc_post_bwd", xn + nxn, np, xn, nD, a->w->fn + n * nD, T, nD, np);
    if (d->st) return;
    const cudaStream_t s = cdev(d)->stream;
    const bool warps = n <= POST_SMALL_N && !cdev(d)->hc_ref; // DS4_CUDA_HC_REF=1: the kernel that defines the bits
    const float *b = a->w->base, *sc = a->w->scale;
    const int64_t it = c->hc_sinkhorn_iters;
    const auto per_warp = [&](auto N) {
        post_bwd_warps<decltype(N)::value>(s, a->dXo, mixp, ldm, b, sc, a->dX, a->da, T, D, it, c->hc_eps);
    };
    if (!warps || !with_streams<POST_SMALL_N>(n, per_warp))
        post_bwd_kernel<<<(unsigned)T, BT, (size_t)(2 * n * n) * sizeof(double), s>>>(a->dXo, mixp, ldm, b, sc, a->dX,
                                                                                      a->da, n, D, it, c->hc_eps);
    ds4_cuda_launched(d, "hc_post_bwd", "[%lld tokens, %lld streams, %lld, %lld iterations%s]", (long long)T,
                      (long long)n, (long long)D, (long long)it,
                      warps ? (n * n <= 16 ? ", two tokens a warp" : ", a token per warp") : "");
}

void ds4_cuda_hyperhead_bwd(ds4_dev *d, const ds4_a_hyperhead_bwd *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t T = a->T, n = c->hc_mult, D = c->hidden_size, nD = n * D;
    if (!hc_shapes_ok(d, "hyperhead_bwd", T, n, D, 0, false)) return;
    // xn [T, nD]; dzb [T, n] = <du, X_i>; dmix [T, n] = the logits
    if (!norm_dots(d, "hyperhead_bwd", a->X, a->xn, T, n, D, c->rms_norm_eps, a->du, nullptr, a->dzb, n, nullptr, 0))
        return;
    ds4_cuda_gemm_f32(d, "hyperhead_bwd", a->dmix, n, a->xn, nD, a->fn, T, nD, n);
    if (d->st) return;
    coef_args g = {a->du, nullptr, nullptr, a->base, a->scale, a->dX, a->dmix, a->dzb, a->dzs, nullptr, 0, n, D, 0,
                   c->hc_eps, 1};
    coef_bwd(d, "hyperhead_bwd", g, T);
}

void ds4_cuda_swiglu_bwd(ds4_dev *d, const ds4_a_swiglu_bwd *a) {
    const int64_t N = a->rows * a->I;
    if (N <= 0) return;
    swiglu_bwd_kernel<<<ds4_blocks(N, 256), 256, 0, cdev(d)->stream>>>(a->g1, a->g3, a->dact, a->act, a->dg1, a->dg3,
                                                                         N, a->lim, a->grads);
    ds4_cuda_launched(d, "swiglu_bwd", "[%lld x %lld%s]", (long long)a->rows, (long long)a->I,
                      a->grads ? ", gradients" : ", activation");
}

void ds4_cuda_moe_dws(ds4_dev *d, const ds4_a_moe_dws *a) {
    const int64_t n = a->T * a->K;
    if (n <= 0) return;
    moe_dws_kernel<<<ds4_blocks(n, 8), 256, 0, cdev(d)->stream>>>(a->dws, a->da, a->ye, n, a->K, a->D);
    ds4_cuda_launched(d, "moe_dws", "[%lld tokens, top %lld, %lld]", (long long)a->T, (long long)a->K, (long long)a->D);
}

void ds4_cuda_moe_dy(ds4_dev *d, const ds4_a_moe_dy *a) {
    if (a->rows <= 0 || a->D <= 0) return;
    if (a->rows > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "moe_dy: %lld rows", (long long)a->rows);
        return;
    }
    moe_dy_kernel<<<(unsigned)a->rows, 256, 0, cdev(d)->stream>>>(a->dys, a->da, a->ew, a->perm, a->K, a->D);
    ds4_cuda_launched(d, "moe_dy", "[%lld rows, top %lld, %lld]", (long long)a->rows, (long long)a->K, (long long)a->D);
}

void ds4_cuda_moe_sum_slots(ds4_dev *d, const ds4_a_moe_sum_slots *a) {
    const int64_t N = a->T * a->D;
    if (N <= 0) return;
    moe_sum_slots_kernel<<<ds4_blocks(N, 256), 256, 0, cdev(d)->stream>>>(a->dh, a->dxslot, N, a->K, a->D);
    ds4_cuda_launched(d, "moe_sum_slots", "[%lld tokens, top %lld, %lld]", (long long)a->T, (long long)a->K,
                      (long long)a->D);
}

void ds4_cuda_router_bwd(ds4_dev *d, const ds4_a_router_bwd *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t E = c->n_routed_experts, K = c->num_experts_per_tok;
    router_bwd_kernel<<<ds4_blocks(a->T, ROUTER_WARPS), ROUTER_WARPS * 32, 0, cdev(d)->stream>>>(
        a->eidx, a->rsc, a->rlog, a->dws, a->dsc, a->dlog, a->T, E, K, (float)c->routed_scaling_factor,
        (int)c->scoring_func);
    ds4_cuda_launched(d, "router_bwd", "[%lld tokens, %lld experts, top %lld, score %d]", (long long)a->T, (long long)E,
                      (long long)K, (int)c->scoring_func);
}
