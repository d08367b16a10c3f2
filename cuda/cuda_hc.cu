// cuda_hc.cu — the residual streams on the GPU: mHC pre (mixing coefficients with Sinkhorn in fp64, the collapse),
// mHC post (the expansion) and the HyperHead. One block per token; the dot products of the mixing matrix with the
// normalised streams are one warp each, lanes striding k and summing in a fixed butterfly.
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

// mix[j] = fn_j · (x / rms(x)) for j < nmix, into shared memory; returns the RMS factor.
__device__ void mix_logits(const float *x, const float *fn, int64_t nD, int64_t nmix, double eps, float *mix,
                           double *sh) {
    double ss = 0;
    for (int64_t i = threadIdx.x; i < nD; i += blockDim.x) ss += (double)x[i] * x[i];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, nD, eps);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t j = warp; j < nmix; j += nw) {
        const float *f = fn + j * nD;
        float acc = 0;
        for (int64_t k = lane; k < nD; k += 32) acc = fmaf(f[k], x[k] * inv, acc);
        acc = ds4d_warp_sumf(acc);
        if (lane == 0) mix[j] = acc;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(HC_THREADS) hc_pre_kernel(const float *X, const float *fn, const float *base,
                                                            const float *sc, float *pre, float *post, float *comb,
                                                            float *u, int64_t n, int64_t D, int64_t iters, double eps,
                                                            double hc_eps) {
    __shared__ double sh[HC_THREADS / 32];
    __shared__ float mix[DS4_MAX_HC_MIX], spre[DS4_MAX_HC];
    __shared__ double M[DS4_MAX_HC_SQ];
    const int64_t t = blockIdx.x, nD = n * D, nmix = (2 + n) * n;
    const float *x = X + t * nD;
    mix_logits(x, fn, nD, nmix, eps, mix, sh);
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

__global__ void __launch_bounds__(HC_THREADS) hyperhead_kernel(const float *X, const float *fn, const float *base,
                                                               const float *sc, float *u, int64_t n, int64_t D,
                                                               double eps, double hc_eps) {
    __shared__ double sh[HC_THREADS / 32];
    __shared__ float mix[DS4_MAX_HC], spre[DS4_MAX_HC];
    const int64_t t = blockIdx.x, nD = n * D;
    const float *x = X + t * nD;
    mix_logits(x, fn, nD, n, eps, mix, sh);
    if (threadIdx.x < n) spre[threadIdx.x] = ds4d_sigmoid(mix[threadIdx.x] * sc[0] + base[threadIdx.x]) + (float)hc_eps;
    __syncthreads();
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0;
        for (int64_t i = 0; i < n; i++) acc += spre[i] * x[i * D + c];
        u[t * D + c] = acc;
    }
}

} // namespace

void ds4_cuda_hc_pre(ds4_dev *d, const ds4_a_hc_pre *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    hc_pre_kernel<<<(unsigned)a->T, HC_THREADS, 0, cdev(d)->stream>>>(
        a->X, a->w->fn, a->w->base, a->w->scale, a->pre, a->post, a->comb, a->u, c->hc_mult, c->hidden_size,
        c->hc_sinkhorn_iters, c->rms_norm_eps, c->hc_eps);
    ds4_cuda_launched(d, "hc_pre", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)c->hc_mult,
                      (long long)c->hidden_size);
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
    hyperhead_kernel<<<(unsigned)a->T, HC_THREADS, 0, cdev(d)->stream>>>(a->X, a->fn, a->base, a->scale, a->u,
                                                                          c->hc_mult, c->hidden_size, c->rms_norm_eps,
                                                                          c->hc_eps);
    ds4_cuda_launched(d, "hyperhead", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)c->hc_mult,
                      (long long)c->hidden_size);
}
