// cuda_moe.cu — the MoE sub-layer on the GPU: the router (one warp per token: scores, top-K with ties to the lower
// expert, or the hash table, or a replayed routing; weights), the stable grouping of (token, slot) pairs by
// expert, SwiGLU with clamps, weighting, and the combine in ascending expert order. The expert GEMMs are
// matmul_grouped (cuda_gemm.cu).
#include "cuda_dev.cuh"
#include "shape_limits.h"

namespace {

__device__ __forceinline__ float score(int sf, float x) {
    if (sf == DS4_SCORE_SIGMOID) return ds4d_sigmoid(x);
    const double sp = x > 20.0f ? (double)x : log1p(exp((double)x)); // torch softplus, threshold 20
    return (float)sqrt(sp);
}

struct route_args {
    const int64_t *ids;
    float *s;
    int32_t *eidx;
    float *ew;
    const float *bias;
    const int32_t *tid2eid;
    const int32_t *replay;
    int64_t replay_ld, T, E, K;
    int sf, is_hash;
    float rsf;
};

constexpr int ROUTE_WARPS = 4;

__global__ void __launch_bounds__(ROUTE_WARPS * 32) route_kernel(route_args a) {
    __shared__ int32_t picked[ROUTE_WARPS][DS4_MAX_TOPK_EXPERTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * ROUTE_WARPS + warp;
    if (t >= a.T) return;
    float *s = a.s + t * a.E;
    if (a.sf == DS4_SCORE_SOFTMAX) {
        float mx = -INFINITY;
        for (int64_t x = lane; x < a.E; x += 32) mx = fmaxf(mx, s[x]);
        mx = ds4d_warp_maxf(mx);
        double den = 0;
        for (int64_t x = lane; x < a.E; x += 32) den += exp((double)(s[x] - mx));
        den = ds4d_warp_sum(den);
        for (int64_t x = lane; x < a.E; x += 32) s[x] = (float)(exp((double)(s[x] - mx)) / den);
    } else {
        for (int64_t x = lane; x < a.E; x += 32) s[x] = score(a.sf, s[x]);
    }
    __syncwarp();
    int32_t *idx = picked[warp];
    const int32_t *rp = a.replay ? a.replay + t * a.replay_ld : nullptr;
    if (a.is_hash) {
        for (int64_t k = lane; k < a.K; k += 32) idx[k] = a.tid2eid[a.ids[t] * a.K + k];
    } else if (rp && rp[0] >= 0) {
        for (int64_t k = lane; k < a.K; k += 32) idx[k] = rp[k];
    } else {
        // top-K of score + correction bias (selection only): K rounds of a warp argmax, ties to the lower expert
        for (int64_t k = 0; k < a.K; k++) {
            float bv = -INFINITY;
            int64_t best = -1;
            for (int64_t x = lane; x < a.E; x += 32) {
                bool taken = false;
                for (int64_t j = 0; j < k; j++) taken |= idx[j] == x;
                if (taken) continue;
                const float v = s[x] + a.bias[x];
                if (best < 0 || v > bv) best = x, bv = v;
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int64_t ob = __shfl_xor_sync(0xffffffffu, best, o);
                if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) bv = ov, best = ob;
            }
            if (lane == 0) idx[k] = (int32_t)best;
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0;
        for (int64_t k = 0; k < a.K; k++) sum += s[idx[k]];
        for (int64_t k = 0; k < a.K; k++) {
            a.eidx[t * a.K + k] = idx[k];
            a.ew[t * a.K + k] = s[idx[k]] / (sum + 1e-20f) * a.rsf;
        }
    }
}

__global__ void count_loads_kernel(int64_t *loads, const int32_t *eidx, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd((unsigned long long *)&loads[eidx[i]], 1ull); // integer counts: order does not matter
}

// One block of SORT_THREADS per expert: its count (pass 0); its offset from the counts of the experts before it and
// the stable compaction of its pairs in slot order (pass 1). In pass 1 warp w owns the w-th run of the pairs: it
// counts its run's pairs of the expert, a prefix over the warps places each run, then each warp compacts its run 32
// pairs a ballot, with no barrier in the loop (a block-wide barrier per 256 pairs made the sort latency-bound).
// The order of perm is the same: slots ascending within the expert.
constexpr int SORT_THREADS = 1024;

__global__ void __launch_bounds__(SORT_THREADS) moe_sort_kernel(const int32_t *eidx, int64_t n, int64_t E,
                                                                int64_t *cnt, int32_t *perm, int64_t *off, int pass) {
    __shared__ int64_t wsum[32];
    __shared__ int64_t base_s;
    const int64_t e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = SORT_THREADS >> 5;
    if (pass == 0) {
        int64_t c = 0;
        for (int64_t i = threadIdx.x; i < n; i += SORT_THREADS) c += eidx[i] == e;
        for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
        if (lane == 0) wsum[warp] = c;
        __syncthreads();
        if (threadIdx.x == 0) {
            int64_t tot = 0;
            for (int w = 0; w < nw; w++) tot += wsum[w];
            cnt[e] = tot;
        }
        return;
    }
    const int64_t run = (n + nw - 1) / nw, lo = warp * run < n ? warp * run : n, hi = lo + run < n ? lo + run : n;
    int64_t c = 0;
    for (int64_t i = lo + lane; i < hi; i += 32) c += eidx[i] == e;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) wsum[warp] = c;
    if (threadIdx.x == 0) {
        int64_t b = 0;
        for (int64_t x = 0; x < e; x++) b += cnt[x];
        off[e] = b;
        if (e == E - 1) off[E] = b + cnt[e];
        base_s = b;
    }
    __syncthreads();
    int64_t pos = base_s;
    for (int w = 0; w < warp; w++) pos += wsum[w];
    for (int64_t i0 = lo; i0 < hi; i0 += 32) {
        const int64_t i = i0 + lane;
        const bool f = i < hi && eidx[i] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, f);
        if (f) perm[pos + __popc(ballot & ((1u << lane) - 1u))] = (int32_t)i;
        pos += __popc(ballot);
    }
}

// yk[perm[r]] = ye[r] · ew[perm[r]], a block per row r
__global__ void moe_weigh_kernel(float *yk, const float *ye, const int32_t *perm, const float *ew, int64_t D) {
    const int64_t r = blockIdx.x, slot = perm[r];
    const float w = ew[slot];
    ds4d_row_map(yk + slot * D, ye + r * D, D, [w](float x) { return x * w; });
}

__global__ void swiglu_kernel(float *g1, const float *g3, int64_t n, float lim) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = g1[i] > lim ? lim : g1[i];
    const float u = g3[i] < -lim ? -lim : (g3[i] > lim ? lim : g3[i]);
    g1[i] = ds4d_silu(g) * u;
}

__global__ void moe_combine_kernel(float *A, const float *yk, const int32_t *eidx, int64_t K, int64_t D) {
    __shared__ int32_t order[DS4_MAX_TOPK_EXPERTS];
    const int64_t t = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int64_t k = 0; k < K; k++) order[k] = (int32_t)k;
        for (int64_t i = 1; i < K; i++) // slots by expert id, stable
            for (int64_t j = i; j > 0 && eidx[t * K + order[j]] < eidx[t * K + order[j - 1]]; j--) {
                const int32_t tmp = order[j];
                order[j] = order[j - 1];
                order[j - 1] = tmp;
            }
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0;
        for (int64_t k = 0; k < K; k++) acc += yk[(t * K + order[k]) * D + c];
        A[t * D + c] += acc;
    }
}

} // namespace

void ds4_cuda_route(ds4_dev *d, const ds4_a_route *a) {
    if (a->T <= 0) return;
    const ds4_config *c = a->c;
    route_args g = {a->ids, a->s, a->eidx, a->ew, a->l->gate_bias, a->l->tid2eid, a->replay, a->replay_ld, a->T,
                    c->n_routed_experts, c->num_experts_per_tok, (int)c->scoring_func, a->l->is_hash,
                    (float)c->routed_scaling_factor};
    route_kernel<<<ds4_blocks(a->T, ROUTE_WARPS), ROUTE_WARPS * 32, 0, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "route", "[%lld tokens, %lld experts, top %lld%s]", (long long)a->T,
                      (long long)c->n_routed_experts, (long long)c->num_experts_per_tok, a->l->is_hash ? ", hash" : "");
}

void ds4_cuda_count_loads(ds4_dev *d, const ds4_a_count_loads *a) {
    if (a->n <= 0) return;
    count_loads_kernel<<<ds4_blocks(a->n, 256), 256, 0, cdev(d)->stream>>>(a->loads, a->eidx, a->n);
    ds4_cuda_launched(d, "count_loads", "[%lld]", (long long)a->n);
}

void ds4_cuda_moe_sort(ds4_dev *d, const ds4_a_moe_sort *a) {
    if (a->E <= 0) return;
    int64_t *cnt = (int64_t *)ds4_cuda_scratch(d, (size_t)a->E * sizeof(int64_t), "moe_sort", 1);
    if (!cnt) return;
    for (int pass = 0; pass < 2; pass++) {
        moe_sort_kernel<<<(unsigned)a->E, SORT_THREADS, 0, cdev(d)->stream>>>(a->eidx, a->n, a->E, cnt, a->perm, a->off, pass);
        if (!ds4_cuda_launched(d, "moe_sort", "[%lld pairs, %lld experts, pass %d]", (long long)a->n, (long long)a->E,
                               pass))
            return;
    }
}

void ds4_cuda_moe_weigh(ds4_dev *d, const ds4_a_moe_weigh *a) {
    if (a->rows <= 0 || a->D <= 0) return;
    if (a->rows > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "moe_weigh: %lld rows", (long long)a->rows);
        return;
    }
    moe_weigh_kernel<<<(unsigned)a->rows, 256, 0, cdev(d)->stream>>>(a->yk, a->ye, a->perm, a->ew, a->D);
    ds4_cuda_launched(d, "moe_weigh", "[%lld x %lld]", (long long)a->rows, (long long)a->D);
}

void ds4_cuda_swiglu(ds4_dev *d, const ds4_a_swiglu *a) {
    const int64_t n = a->rows * a->I;
    if (n <= 0) return;
    swiglu_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->g1, a->g3, n, a->lim);
    ds4_cuda_launched(d, "swiglu", "[%lld x %lld]", (long long)a->rows, (long long)a->I);
}

void ds4_cuda_moe_combine(ds4_dev *d, const ds4_a_moe_combine *a) {
    if (a->T <= 0) return;
    moe_combine_kernel<<<(unsigned)a->T, 256, 0, cdev(d)->stream>>>(a->a, a->yk, a->eidx, a->K, a->D);
    ds4_cuda_launched(d, "moe_combine", "[%lld tokens, top %lld, %lld]", (long long)a->T, (long long)a->K,
                      (long long)a->D);
}
