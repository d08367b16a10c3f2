// cuda_hc.cu — the residual streams on the GPU: mHC pre (mixing coefficients with Sinkhorn in fp64, the collapse),
// mHC post (the expansion) and the HyperHead. The mixing logits are a GEMM of the normalised streams (n·D long) with
// the mixing matrix: the batch-invariant GEMM of cuda_gemm.cu, which spreads those long dot products over many warps
// when there are few tokens (decoding). Two sets of kernels give the same bits: the reference ones (DS4_CUDA_HC_REF=1;
// a block per token for the norm, a thread per output for hc_post) and the fast ones the schedule takes, which do the
// same operations in the same order with fewer bytes moved (X is the big operand: T·n·D floats, 134 MB at 8192
// tokens of 4 × 1024): hc_pre passes over X three times (norm factors, the GEMM that scales rows as it reads them, the
// collapse) where the reference passes four times (the norm, writing a normalised copy, the GEMM over that copy, the
// collapse); hc_post reads X once where the reference reads it n times.
#include "cuda_dev.cuh"
#include "shape_limits.h"

namespace {

constexpr int HC_THREADS = 256;

// VEC consecutive floats (VEC = 4: one 16-byte access, the address 16-byte aligned).
template <int VEC> __device__ __forceinline__ void ds4d_load_vec(float (&v)[VEC], const float *p) {
    if constexpr (VEC == 4) {
        const float4 f = *reinterpret_cast<const float4 *>(p);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
#pragma unroll
        for (int q = 0; q < VEC; q++) v[q] = p[q];
    }
}
template <int VEC> __device__ __forceinline__ void ds4d_store_vec(float *p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else {
#pragma unroll
        for (int q = 0; q < VEC; q++) p[q] = v[q];
    }
}

// Sinkhorn of one token by W lanes (docs/architecture.md, "Hyper-connections"): row softmax of the comb logits
// (·sc2 + base) + eps, column-normalise, then (iters - 1) × (row, column), in fp64. Lane l owns elements l, l + W, ..
// (at most VN of them) of the n×n matrix; each element sums its row or column itself, sequentially in index order, so
// all elements of a row divide by the same sum and the order is the CPU's. Each element's arithmetic depends on n and
// iters alone, not on W: every width gives the same bits. Called by all W lanes of the token (W = 32: a warp; W = 16:
// a half-warp, both halves of the warp in step, `mask` the lanes that take part).
template <int W, int VN>
__device__ void sinkhorn_lanes(const float *cl, float sc2, const float *cb, int64_t n, int64_t iters, double hc_eps,
                               double *M, unsigned mask) {
    const int lane = threadIdx.x & (W - 1);
    const int64_t nn = n * n;
    double v[VN];
#pragma unroll
    for (int i = 0; i < VN; i++) {
        const int64_t e = lane + i * W;
        if (e < nn) M[e] = (double)(cl[e] * sc2 + cb[e]);
    }
    __syncwarp(mask);
#pragma unroll
    for (int i = 0; i < VN; i++) {
        const int64_t e = lane + i * W, j = e / n;
        if (e >= nn) continue;
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k < n; k++) mx = M[j * n + k] > mx ? M[j * n + k] : mx;
        for (int64_t k = 0; k < n; k++) sum += exp(M[j * n + k] - mx);
        v[i] = exp(M[e] - mx) / sum + hc_eps;
    }
    __syncwarp(mask);
#pragma unroll
    for (int i = 0; i < VN; i++)
        if (lane + i * W < nn) M[lane + i * W] = v[i];
    __syncwarp(mask);
    for (int64_t step = 1; step < 2 * iters; step++) {
        const bool col = step % 2 == 1;
#pragma unroll
        for (int i = 0; i < VN; i++) {
            const int64_t e = lane + i * W, a = col ? e % n : e / n;
            if (e >= nn) continue;
            double sum = 0;
            for (int64_t q = 0; q < n; q++) sum += col ? M[q * n + a] : M[a * n + q];
            v[i] = M[e] / (sum + hc_eps);
        }
        __syncwarp(mask);
#pragma unroll
        for (int i = 0; i < VN; i++)
            if (lane + i * W < nn) M[lane + i * W] = v[i];
        __syncwarp(mask);
    }
}

// xn[t] = X[t] / rms(X[t]) over the n·D values of a token (the normalised streams the mixing matrix reads).
__global__ void __launch_bounds__(HC_THREADS) hc_norm_kernel(const float *X, float *xn, int64_t nD, double eps) {
    __shared__ double sh[HC_THREADS / 32];
    const int64_t t = blockIdx.x;
    const float *x = X + t * nD;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < nD; i += blockDim.x) ss += (double)x[i] * x[i];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, nD, eps);
    for (int64_t i = threadIdx.x; i < nD; i += blockDim.x) xn[t * nD + i] = x[i] * inv;
}

// Coefficients of one token from its mixing logits: pre, post, the Sinkhorn comb, and the collapse u = Σ pre_i X_i.
__global__ void __launch_bounds__(HC_THREADS) hc_coef_kernel(const float *X, const float *mixall, const float *base,
                                                             const float *sc, float *pre, float *post, float *comb,
                                                             float *u, int64_t n, int64_t D, int64_t iters,
                                                             double hc_eps) {
    __shared__ float spre[DS4_MAX_HC];
    __shared__ double M[DS4_MAX_HC_SQ];
    const int64_t t = blockIdx.x, nmix = (2 + n) * n;
    const float *x = X + t * n * D, *mix = mixall + t * nmix;
    if (threadIdx.x < 32) {
        for (int64_t i = threadIdx.x; i < n; i += 32) {
            spre[i] = ds4d_sigmoid(mix[i] * sc[0] + base[i]) + (float)hc_eps;
            pre[t * n + i] = spre[i];
            post[t * n + i] = 2.0f * ds4d_sigmoid(mix[n + i] * sc[1] + base[n + i]);
        }
        sinkhorn_lanes<32, DS4_MAX_HC_SQ / 32>(mix + 2 * n, sc[2], base + 2 * n, n, iters, hc_eps, M, 0xffffffffu);
        for (int64_t i = threadIdx.x; i < n * n; i += 32) comb[t * n * n + i] = (float)M[i];
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0;
        for (int64_t i = 0; i < n; i++) acc += spre[i] * x[i * D + c];
        u[t * D + c] = acc;
    }
}

// The same with a token per WARP (COEF_WARPS tokens a block; hc_n · hc_n ≤ COEF_SMALL_SQ): each warp runs its own
// token's Sinkhorn and then the collapse (each output summed over the streams in order: the same sums), instead of a
// block whose other 7 warps wait for warp 0's fp64 chains. The per-token arithmetic is hc_coef_kernel's: the same bits,
// in a full forward and in a decoding step alike.
constexpr int COEF_WARPS = 4, COEF_SMALL_SQ = 64;

__global__ void __launch_bounds__(COEF_WARPS * 32) hc_coef_warp_kernel(const float *X, const float *mixall,
                                                                       const float *base, const float *sc, float *pre,
                                                                       float *post, float *comb, float *u, int64_t T,
                                                                       int64_t n, int64_t D, int64_t iters,
                                                                       double hc_eps) {
    __shared__ double M[COEF_WARPS][COEF_SMALL_SQ];
    __shared__ float spre[COEF_WARPS][COEF_SMALL_SQ];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * COEF_WARPS + warp, nmix = (2 + n) * n;
    if (t >= T) return; // a whole warp; nothing below synchronises the block
    const float *x = X + t * n * D, *mix = mixall + t * nmix;
    for (int64_t i = lane; i < n; i += 32) {
        spre[warp][i] = ds4d_sigmoid(mix[i] * sc[0] + base[i]) + (float)hc_eps;
        pre[t * n + i] = spre[warp][i];
        post[t * n + i] = 2.0f * ds4d_sigmoid(mix[n + i] * sc[1] + base[n + i]);
    }
    sinkhorn_lanes<32, COEF_SMALL_SQ / 32>(mix + 2 * n, sc[2], base + 2 * n, n, iters, hc_eps, M[warp], 0xffffffffu);
    for (int64_t i = lane; i < n * n; i += 32) comb[t * n * n + i] = (float)M[warp][i];
    __syncwarp();
    for (int64_t c = lane; c < D; c += 32) {
        float acc = 0;
        for (int64_t i = 0; i < n; i++) acc += spre[warp][i] * x[i * D + c];
        u[t * D + c] = acc;
    }
}

__global__ void hc_post_kernel(const float *X, const float *A, const float *post, const float *comb, float *Xo,
                               int64_t T, int64_t n, int64_t D) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * n * D) return;
    const int64_t t = i / (n * D), k = (i / D) % n, c = i % D;
    const float *x = X + t * n * D, *cb = comb + t * n * n;
    float y = 0;
    for (int64_t j = 0; j < n; j++) y += cb[j * n + k] * x[j * D + c];
    y += post[t * n + k] * A[t * D + c];
    Xo[i] = y;
}

// ------------------------------------------------------------------------------------------ the fast kernels
// Each gives its reference kernel's bits (above; DS4_CUDA_HC_REF=1 selects those, tests/test_cuda_hc_bits.c compares
// the two byte for byte): the same fp32 / fp64 operations on the same values in the same order, with fewer bytes moved.

// 1 / rms(X[t]) of a token per warp. hc_norm_kernel's block of HC_THREADS threads sums in double: thread i its values
// i, i + HC_THREADS, .. in order, then each warp its threads' sums by a butterfly, then warp 0 the warp sums (zeros on
// the lanes past the last warp) by a butterfly. Lane l here plays thread 32w + l of every warp w of that block, in the
// same order, then the same two rounds of butterflies: the same sums, without the block's barriers and its one token
// per 256 threads. xn (when not NULL) = X / rms, hc_norm_kernel's output, for the GEMMs that cannot scale rows.
constexpr int RMS_VW = HC_THREADS / 32, RMS_WARPS = 4;
static_assert(RMS_VW <= 32, "warp 0 of the reference block sums one value per warp");

__global__ void __launch_bounds__(RMS_WARPS * 32) hc_rms_warp_kernel(const float *X, float *inv, float *xn, int64_t T,
                                                                     int64_t nD, double eps) {
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
    if (t >= T) return; // a whole warp
    const float *x = X + t * nD;
    double v[RMS_VW];
#pragma unroll
    for (int w = 0; w < RMS_VW; w++) v[w] = 0;
#pragma unroll 2
    for (int64_t b = 0; b < nD; b += HC_THREADS) {
        float xv[RMS_VW]; // all loads of the round first: 8 in flight a lane
#pragma unroll
        for (int w = 0; w < RMS_VW; w++) xv[w] = b + 32 * w + lane < nD ? x[b + 32 * w + lane] : 0.0f;
#pragma unroll
        for (int w = 0; w < RMS_VW; w++)
            if (b + 32 * w + lane < nD) v[w] += (double)xv[w] * xv[w];
    }
    const float r = ds4d_rms_inv(ds4d_played_block_sum(v, RMS_VW), nD, eps); // the block's tree, played by the warp
    if (lane == 0) inv[t] = r;
    if (xn)
        for (int64_t i = lane; i < nD; i += 32) xn[t * nD + i] = x[i] * r;
}

// hc_coef_warp_kernel with W lanes a token (W = 16 where n·n <= 16: two tokens a warp, so that the fp64 Sinkhorn keeps
// every lane busy, not half of them) and the collapse VEC channels a lane (VEC = 4: 16-byte loads, where D is a
// multiple of 4 and X, u are 16-byte aligned). Each u[t, c] is still 0 + pre_0·X_0c + pre_1·X_1c + .. in stream order.
constexpr int COEF_NMAX = 8; // n·n <= COEF_SMALL_SQ

template <int W, int VEC>
__global__ void __launch_bounds__(128) hc_coef_lanes_kernel(const float *X, const float *mixall, const float *base,
                                                            const float *sc, float *pre, float *post, float *comb,
                                                            float *u, int64_t T, int64_t n, int64_t D, int64_t iters,
                                                            double hc_eps) {
    constexpr int TPB = 128 / W, NNMAX = W == 16 ? 16 : COEF_SMALL_SQ;
    __shared__ double M[TPB][NNMAX];
    __shared__ float spre[TPB][COEF_NMAX];
    const int slot = threadIdx.x / W, lane = threadIdx.x & (W - 1);
    const int64_t t = (int64_t)blockIdx.x * TPB + slot, nmix = (2 + n) * n;
    // the lanes of this warp that have a token: both halves, or at the batch's end the first half alone
    const int64_t first = ((int64_t)blockIdx.x * 128 + (threadIdx.x & ~31)) / W;
    const unsigned mask = W == 32 || first + 1 < T ? 0xffffffffu : 0x0000ffffu;
    if (t >= T) return;
    const float *x = X + t * n * D, *mix = mixall + t * nmix;
    for (int64_t i = lane; i < n; i += W) {
        spre[slot][i] = ds4d_sigmoid(mix[i] * sc[0] + base[i]) + (float)hc_eps;
        pre[t * n + i] = spre[slot][i];
        post[t * n + i] = 2.0f * ds4d_sigmoid(mix[n + i] * sc[1] + base[n + i]);
    }
    sinkhorn_lanes<W, NNMAX / W>(mix + 2 * n, sc[2], base + 2 * n, n, iters, hc_eps, M[slot], mask);
    for (int64_t i = lane; i < n * n; i += W) comb[t * n * n + i] = (float)M[slot][i];
    __syncwarp(mask);
    float p[COEF_NMAX];
#pragma unroll
    for (int i = 0; i < COEF_NMAX; i++) p[i] = i < n ? spre[slot][i] : 0.0f;
    for (int64_t c = (int64_t)lane * VEC; c < D; c += (int64_t)W * VEC) {
        float acc[VEC], xv[VEC];
#pragma unroll
        for (int q = 0; q < VEC; q++) acc[q] = 0;
#pragma unroll
        for (int i = 0; i < COEF_NMAX; i++) {
            if (i >= n) break;
            ds4d_load_vec<VEC>(xv, x + i * D + c);
#pragma unroll
            for (int q = 0; q < VEC; q++) acc[q] += p[i] * xv[q];
        }
        ds4d_store_vec<VEC>(u + t * D + c, acc);
    }
}

// hc_post_kernel's outputs with a thread per (token, VEC channels) for n <= NMAX streams: X[t, :, c] and A[t, c] read
// once (16-byte loads where VEC = 4) and the token's n outputs formed in registers, where a thread per output re-reads
// all n streams. Each Xo[t, k, c] is still 0 + comb[t, 0, k]·X[t, 0, c] + .. in stream order, then + post[t, k]·A[t, c].
template <int NMAX, int VEC>
__global__ void __launch_bounds__(256) hc_post_vec_kernel(const float *X, const float *A, const float *post,
                                                          const float *comb, float *Xo, int64_t T, int64_t n,
                                                          int64_t D) {
    const int64_t Dv = D / VEC, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * Dv) return;
    const int64_t t = i / Dv, c = (i - t * Dv) * VEC;
    const float *x = X + t * n * D + c, *cb = comb + t * n * n, *pt = post + t * n;
    float xv[NMAX][VEC], av[VEC];
#pragma unroll
    for (int j = 0; j < NMAX; j++)
        if (j < n) ds4d_load_vec<VEC>(xv[j], x + j * D);
    ds4d_load_vec<VEC>(av, A + t * D + c);
#pragma unroll
    for (int k = 0; k < NMAX; k++) {
        if (k >= n) break;
        float y[VEC];
#pragma unroll
        for (int q = 0; q < VEC; q++) y[q] = 0;
#pragma unroll
        for (int j = 0; j < NMAX; j++) {
            if (j >= n) break;
            const float w = cb[j * n + k];
#pragma unroll
            for (int q = 0; q < VEC; q++) y[q] += w * xv[j][q];
        }
        const float pk = pt[k];
#pragma unroll
        for (int q = 0; q < VEC; q++) y[q] += pk * av[q];
        ds4d_store_vec<VEC>(Xo + (t * n + k) * D + c, y);
    }
}

__global__ void __launch_bounds__(HC_THREADS) hyperhead_coef_kernel(const float *X, const float *mixall,
                                                                    const float *base, const float *sc, float *u,
                                                                    int64_t n, int64_t D, double hc_eps) {
    __shared__ float spre[DS4_MAX_HC];
    const int64_t t = blockIdx.x;
    const float *x = X + t * n * D;
    if (threadIdx.x < n) spre[threadIdx.x] = ds4d_sigmoid(mixall[t * n + threadIdx.x] * sc[0] + base[threadIdx.x]) + (float)hc_eps;
    __syncthreads();
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0;
        for (int64_t i = 0; i < n; i++) acc += spre[i] * x[i * D + c];
        u[t * D + c] = acc;
    }
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The mixing logits [T, nmix] of the normalised streams (in scratch slot 1), or NULL after a failure. The logits are
// xn·fnᵀ with xn = X·(1/rms) rounded to fp32, whatever the path: the reference (DS4_CUDA_HC_REF=1) writes xn [T, n·D]
// and multiplies it; the fast path computes the T factors a warp per token and, where the narrow GEMM runs (many
// tokens), lets it scale X's rows as it reads them (the same xn values, without writing and re-reading 2·T·n·D
// floats); with few tokens the skinny GEMM reads an xn the factors' kernel writes. keep (or NULL): where the logits go
// instead of scratch (the site's tape, for its backward).
float *mix_logits(ds4_dev *d, const char *op, const float *X, const float *fn, int64_t T, int64_t nD, int64_t nmix,
                  double eps, float *keep = nullptr) {
    const bool ref = cdev(d)->hc_ref, scaled = !ref && ds4_cuda_gemm_f32_rowscale_ok(d, T, nmix);
    const int64_t nxn = scaled ? 0 : T * nD; // [xn][mix][inv]: xn first, 16-byte aligned for the GEMMs' loads
    float *xn = (float *)ds4_cuda_scratch(d, (size_t)(nxn + T * nmix + T) * sizeof(float), op, 1);
    if (!xn) return NULL;
    float *mix = keep ? keep : xn + nxn, *inv = xn + nxn + T * nmix;
    if (ref)
        hc_norm_kernel<<<(unsigned)T, HC_THREADS, 0, cdev(d)->stream>>>(X, xn, nD, eps);
    else
        hc_rms_warp_kernel<<<ds4_blocks(T, RMS_WARPS), RMS_WARPS * 32, 0, cdev(d)->stream>>>(X, inv, nxn ? xn : nullptr,
                                                                                            T, nD, eps);
    if (!ds4_cuda_launched(d, op, "norm [%lld tokens x %lld]", (long long)T, (long long)nD)) return NULL;
    if (scaled) ds4_cuda_gemm_f32_rowscaled(d, op, mix, nmix, X, nD, inv, fn, T, nD, nmix);
    else ds4_cuda_gemm_f32(d, op, mix, nmix, xn, nD, fn, T, nD, nmix);
    return d->st ? NULL : mix;
}

template <int W>
void coef_lanes(cudaStream_t st, bool vec, const ds4_a_hc_pre *a, const float *mix, int64_t n, int64_t D) {
    const unsigned grid = ds4_blocks(a->T, 128 / W);
    const ds4_config *c = a->c;
    if (vec)
        hc_coef_lanes_kernel<W, 4><<<grid, 128, 0, st>>>(a->X, mix, a->w->base, a->w->scale, a->pre, a->post, a->comb,
                                                         a->u, a->T, n, D, c->hc_sinkhorn_iters, c->hc_eps);
    else
        hc_coef_lanes_kernel<W, 1><<<grid, 128, 0, st>>>(a->X, mix, a->w->base, a->w->scale, a->pre, a->post, a->comb,
                                                         a->u, a->T, n, D, c->hc_sinkhorn_iters, c->hc_eps);
}

template <int NMAX> void post_vec(cudaStream_t st, bool vec, const ds4_a_hc_post *a, int64_t n, int64_t D) {
    if (vec)
        hc_post_vec_kernel<NMAX, 4><<<ds4_blocks(a->T * D / 4, 256), 256, 0, st>>>(a->X, a->a, a->post, a->comb,
                                                                                  a->Xo, a->T, n, D);
    else
        hc_post_vec_kernel<NMAX, 1><<<ds4_blocks(a->T * D, 256), 256, 0, st>>>(a->X, a->a, a->post, a->comb, a->Xo,
                                                                              a->T, n, D);
}

} // namespace

void ds4_cuda_hc_pre(ds4_dev *d, const ds4_a_hc_pre *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nmix = (2 + n) * n, T = a->T, it = c->hc_sinkhorn_iters;
    const float *mix = mix_logits(d, "hc_pre", a->X, a->w->fn, T, n * D, nmix, c->rms_norm_eps, a->mix);
    if (!mix) return;
    const float *base = a->w->base, *sc = a->w->scale;
    cudaStream_t st = cdev(d)->stream;
    const bool vec = D % 4 == 0 && aligned16(a->X) && aligned16(a->u);
    if (!cdev(d)->hc_ref && n * n <= 16) /* two tokens a warp */
        coef_lanes<16>(st, vec, a, mix, n, D);
    else if (!cdev(d)->hc_ref && n * n <= COEF_SMALL_SQ)
        coef_lanes<32>(st, vec, a, mix, n, D);
    else if (n * n <= COEF_SMALL_SQ)
        hc_coef_warp_kernel<<<ds4_blocks(T, COEF_WARPS), COEF_WARPS * 32, 0, st>>>(
            a->X, mix, base, sc, a->pre, a->post, a->comb, a->u, T, n, D, it, c->hc_eps);
    else
        hc_coef_kernel<<<(unsigned)T, HC_THREADS, 0, st>>>(a->X, mix, base, sc, a->pre, a->post, a->comb, a->u, n, D,
                                                          it, c->hc_eps);
    ds4_cuda_launched(d, "hc_pre", "[%lld tokens, %lld streams, %lld]", (long long)T, (long long)n, (long long)D);
}

void ds4_cuda_hc_post(ds4_dev *d, const ds4_a_hc_post *a) {
    const int64_t T = a->T, n = a->c->hc_mult, D = a->c->hidden_size;
    if (T * n * D <= 0) return;
    cudaStream_t st = cdev(d)->stream;
    const bool vec = D % 4 == 0 && aligned16(a->X) && aligned16(a->a) && aligned16(a->Xo);
    if (cdev(d)->hc_ref || n > 8) /* DS4_CUDA_HC_REF=1 (the reference), or too many streams for registers */
        hc_post_kernel<<<ds4_blocks(T * n * D, 256), 256, 0, st>>>(a->X, a->a, a->post, a->comb, a->Xo, T, n, D);
    else if (n <= 4)
        post_vec<4>(st, vec, a, n, D);
    else
        post_vec<8>(st, vec, a, n, D);
    ds4_cuda_launched(d, "hc_post", "[%lld tokens, %lld streams, %lld]", (long long)T, (long long)n, (long long)D);
}

void ds4_cuda_hyperhead(ds4_dev *d, const ds4_a_hyperhead *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size;
    const float *mix = mix_logits(d, "hyperhead", a->X, a->fn, a->T, n * D, n, c->rms_norm_eps);
    if (!mix) return;
    hyperhead_coef_kernel<<<(unsigned)a->T, HC_THREADS, 0, cdev(d)->stream>>>(a->X, mix, a->base, a->scale, a->u, n, D,
                                                                                c->hc_eps);
    ds4_cuda_launched(d, "hyperhead", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)n, (long long)D);
}
