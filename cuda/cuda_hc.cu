// cuda_hc.cu — the residual streams on the GPU: mHC pre (mixing coefficients with Sinkhorn in fp64, the collapse),
// mHC post (the expansion) and the HyperHead. The mixing logits are a GEMM of the normalised streams (n·D long) with
// the mixing matrix: the batch-invariant GEMM of cuda_gemm.cu, which spreads those long dot products over many warps
// when there are few tokens (decoding); the coefficients then take one block per token.
#include "cuda_dev.cuh"
#include "shape_limits.h"

namespace {

constexpr int HC_THREADS = 256;

// Sinkhorn of one token by warp 0 (docs/architecture.md, "Hyper-connections"): row softmax of the comb logits
// (·sc2 + base) + eps, column-normalise, then (iters - 1) × (row, column), in fp64. Lane l owns elements l, l+32, ..
// of the n×n matrix; each element sums its row or column itself, sequentially in index order, so all elements of a
// row divide by the same sum and the order is the CPU's. Called by all 32 lanes of one warp.
__device__ void sinkhorn_warp(const float *cl, float sc2, const float *cb, int64_t n, int64_t iters, double hc_eps,
                              double *M) {
    const int lane = threadIdx.x & 31;
    const int64_t nn = n * n;
    double v[DS4_MAX_HC_SQ / 32];
    for (int64_t e = lane, i = 0; e < nn; e += 32, i++) M[e] = (double)(cl[e] * sc2 + cb[e]);
    __syncwarp();
    for (int64_t e = lane, i = 0; e < nn; e += 32, i++) {
        const int64_t j = e / n;
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k < n; k++) mx = M[j * n + k] > mx ? M[j * n + k] : mx;
        for (int64_t k = 0; k < n; k++) sum += exp(M[j * n + k] - mx);
        v[i] = exp(M[e] - mx) / sum + hc_eps;
    }
    __syncwarp();
    for (int64_t e = lane, i = 0; e < nn; e += 32, i++) M[e] = v[i];
    __syncwarp();
    for (int64_t step = 1; step < 2 * iters; step++) {
        const bool col = step % 2 == 1;
        for (int64_t e = lane, i = 0; e < nn; e += 32, i++) {
            const int64_t a = col ? e % n : e / n;
            double sum = 0;
            for (int64_t q = 0; q < n; q++) sum += col ? M[q * n + a] : M[a * n + q];
            v[i] = M[e] / (sum + hc_eps);
        }
        __syncwarp();
        for (int64_t e = lane, i = 0; e < nn; e += 32, i++) M[e] = v[i];
        __syncwarp();
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
        sinkhorn_warp(mix + 2 * n, sc[2], base + 2 * n, n, iters, hc_eps, M);
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
    sinkhorn_warp(mix + 2 * n, sc[2], base + 2 * n, n, iters, hc_eps, M[warp]);
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

// The normalised streams and their mixing logits [T, nmix] (in scratch slot 1), or NULL after a failure.
float *mix_logits(ds4_dev *d, const char *op, const float *X, const float *fn, int64_t T, int64_t nD, int64_t nmix,
                  double eps) {
    float *xn = (float *)ds4_cuda_scratch(d, (size_t)(T * (nD + nmix)) * sizeof(float), op, 1);
    if (!xn) return NULL;
    float *mix = xn + T * nD;
    hc_norm_kernel<<<(unsigned)T, HC_THREADS, 0, cdev(d)->stream>>>(X, xn, nD, eps);
    if (!ds4_cuda_launched(d, op, "norm [%lld tokens x %lld]", (long long)T, (long long)nD)) return NULL;
    ds4_cuda_gemm_f32(d, op, mix, nmix, xn, nD, fn, T, nD, nmix);
    return d->st ? NULL : mix;
}

} // namespace

void ds4_cuda_hc_pre(ds4_dev *d, const ds4_a_hc_pre *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nmix = (2 + n) * n;
    const float *mix = mix_logits(d, "hc_pre", a->X, a->w->fn, a->T, n * D, nmix, c->rms_norm_eps);
    if (!mix) return;
    if (n * n <= COEF_SMALL_SQ)
        hc_coef_warp_kernel<<<(unsigned)((a->T + COEF_WARPS - 1) / COEF_WARPS), COEF_WARPS * 32, 0, cdev(d)->stream>>>(
            a->X, mix, a->w->base, a->w->scale, a->pre, a->post, a->comb, a->u, a->T, n, D, c->hc_sinkhorn_iters,
            c->hc_eps);
    else
        hc_coef_kernel<<<(unsigned)a->T, HC_THREADS, 0, cdev(d)->stream>>>(a->X, mix, a->w->base, a->w->scale, a->pre,
                                                                             a->post, a->comb, a->u, n, D,
                                                                             c->hc_sinkhorn_iters, c->hc_eps);
    ds4_cuda_launched(d, "hc_pre", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)n, (long long)D);
}

void ds4_cuda_hc_post(ds4_dev *d, const ds4_a_hc_post *a) {
    const int64_t n = a->T * a->c->hc_mult * a->c->hidden_size;
    if (n <= 0) return;
    hc_post_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->X, a->a, a->post, a->comb, a->Xo, a->T,
                                                                      a->c->hc_mult, a->c->hidden_size);
    ds4_cuda_launched(d, "hc_post", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)a->c->hc_mult,
                      (long long)a->c->hidden_size);
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
