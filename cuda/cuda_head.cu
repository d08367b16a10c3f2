// cuda_head.cu — the vocabulary end on the GPU: per-row cross-entropy and log-probabilities, and sampling.
//
// One block of ROW_THREADS per row. The log-sum-exp of a row is computed by one function (row_stats) in every
// kernel here, so the log-probability a generation reports for a token and the one a training forward computes
// for it are the same bits (the rollout / training mismatch is exactly 0 on the GPU as on the CPU). A training
// forward's logprobs computes the cross-entropy in the same kernel (the reference, DS4_CUDA_ROW_REF=1, ran ce_rows'
// kernel after it: a second read of [rows, V] fp32 logits and a second Σ exp in double per row).
//
// Sampling follows ds4_sample (core/sample.c) step by step, in double: temperature, top-k, top-p, min-p in HF's
// order, then the inverse CDF at the uniform u over the kept tokens in ascending id order. Its sums run over 256
// contiguous chunks (each chunk sequential, then the chunk sums sequential), so a draw is deterministic and does
// not depend on the batch; it equals the CPU's draw from the same logits unless u·total falls within rounding
// (~1e-16 relative) of a boundary between two tokens.
#include <cstring>

#include "cuda_dev.cuh"

namespace {

constexpr int ROW_THREADS = 256;
constexpr int ROW_ILP = 8; // loads in flight per thread in a row's passes (ds4d_row_visit)

struct row_stats_t {
    float mx;
    int64_t arg;                  // lowest id of the maximum
    double se, ez;                // Σ e^{z - mx}, Σ e^{z - mx}·(z - mx)
};

// The (max, lowest id of the max) of a row from each thread's own (mx, arg) (arg -1: a thread past V), as thread 0
// of the reference folded them in thread order: taking thread i where a < 0, shf[i] > m, or shf[i] == m with a lower
// id. That fold keeps the first valid thread's state when its mx is NaN (nothing compares above NaN); otherwise it
// skips every NaN state and ends on the lexicographic maximum (value by >, ties (-0 == +0 too) to the lower id) over
// the others, which is one element whatever the order of the comparisons (the ids are distinct). So warps may find it
// by shuffle trees, and warp 0 over the warps' winners, with thread 0's own NaN state put back at the end: the same
// (mx, arg), a few shuffle levels instead of 256 dependent steps of one thread.
__device__ __forceinline__ bool beats(float m, int64_t a, float bm, int64_t ba) { // (m, a) wins over (bm, ba)
    return a >= 0 && m == m && (ba < 0 || m > bm || (m == bm && a < ba));
}
__device__ __forceinline__ void warp_argmax(float &m, int64_t &a) {
    if (!(m == m)) a = -1; // a NaN state never wins the tree
    for (int o = 16; o > 0; o >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, m, o);
        const int64_t oa = __shfl_xor_sync(0xffffffffu, a, o);
        if (beats(om, oa, m, a)) m = om, a = oa;
    }
}

// Max (and its lowest id), Σ exp and Σ exp·(z - mx) of one row; every thread gets them. REF: the max and its id
// folded by thread 0 (the reference kernels); else by the shuffle trees (the same values, above).
// e32 (ops.h's exp32): the exponentials in fp32 (ds4d_row_exp), their sums double. A double exp per logit (32000 a
// row) made the row kernels of a bf16 training step's LM head bound by Hopper's fp64 rate, not by memory.
template <bool REF>
__device__ row_stats_t row_stats(const float *z, int64_t V, bool want_ez, double *shd, float *shf, int64_t *shi,
                                 bool e32) {
    static_assert(ROW_THREADS == 256 && ROW_ILP == 8, "logp_bwd_kernel (cuda_bwd_linear.cu) sums Σ exp as here");
    const int tid = threadIdx.x;
    float mx = -INFINITY;
    int64_t arg = -1;
    ds4d_row_visit<ROW_THREADS, ROW_ILP>(z, V, [&](int64_t v, float zv) {
        if (arg < 0 || zv > mx) mx = zv, arg = v;
    });
    if constexpr (REF) {
        shf[tid] = mx;
        shi[tid] = arg;
        __syncthreads();
        if (tid == 0) {
            float m = -INFINITY;
            int64_t a = -1;
            for (int i = 0; i < ROW_THREADS; i++)
                if (shi[i] >= 0 && (a < 0 || shf[i] > m || (shf[i] == m && shi[i] < a))) m = shf[i], a = shi[i];
            shf[0] = m;
            shi[0] = a;
        }
    } else {
        const float own_m = mx;
        const int64_t own_a = arg;
        warp_argmax(mx, arg);
        if ((tid & 31) == 0) shf[tid >> 5] = mx, shi[tid >> 5] = arg;
        __syncthreads();
        if (tid < 32) {
            float m = tid < ROW_THREADS / 32 ? shf[tid] : -INFINITY;
            int64_t a = tid < ROW_THREADS / 32 ? shi[tid] : -1;
            warp_argmax(m, a);
            if (tid == 0) {
                if (own_a >= 0 && !(own_m == own_m)) m = own_m, a = own_a; // thread 0 first and NaN: the fold kept it
                shf[0] = m;
                shi[0] = a;
            }
        }
    }
    __syncthreads();
    row_stats_t r;
    r.mx = shf[0];
    r.arg = shi[0];
    __syncthreads();
    double se = 0, ez = 0;
    ds4d_row_visit<ROW_THREADS, ROW_ILP>(z, V, [&](int64_t, float zv) {
        const double e = ds4d_row_exp(zv, r.mx, e32);
        se += e;
        if (want_ez) ez += e * ((double)zv - r.mx);
    });
    r.se = ds4d_block_sum(se, shd);
    r.ez = want_ez ? ds4d_block_sum(ez, shd) : 0;
    return r;
}

// The reference's cross-entropy of a row: ce_rows, and logprobs' nll under DS4_CUDA_ROW_REF.
// Rows r = blockIdx.x, + gridDim.x, .. (ds4_vocab_grid): one each by default. rmx / rse (NULL: not asked for): every
// row's max and Σ exp (ops.h), the rows without a target too.
__global__ void __launch_bounds__(ROW_THREADS) ce_kernel(const float *logits, int64_t rows, int64_t V,
                                                         const int64_t *tgt, double *nll, int ref, float *rmx,
                                                         double *rse, int e32) {
    __shared__ double shd[ROW_THREADS / 32];
    __shared__ float shf[ROW_THREADS];
    __shared__ int64_t shi[ROW_THREADS];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t y = tgt[r];
        if (y == -100 && !rmx) continue;
        const float *z = logits + r * V;
        const row_stats_t s =
            ref ? row_stats<true>(z, V, false, shd, shf, shi, e32) : row_stats<false>(z, V, false, shd, shf, shi, e32);
        if (threadIdx.x == 0) {
            if (rmx) rmx[r] = s.mx, rse[r] = s.se;
            if (y != -100) nll[r] = log(s.se) + s.mx - z[y];
        }
    }
}

// Log-probability and entropy of a row, and with nll its cross-entropy as ce_kernel writes it (nothing for a target of
// -100): Σ exp is the same sum with or without the entropy's (se never depends on ez), so one pass over the row gives
// ce_kernel's bits where the reference ran a second kernel over the logits.
template <bool REF>
__global__ void __launch_bounds__(ROW_THREADS, REF ? 1 : 8)
    logprobs_kernel(const float *logits, int64_t rows, int64_t V, const int64_t *tgt, float *logp, float *entropy,
                    double *nll, float *rmx, double *rse, int e32) {
    __shared__ double shd[ROW_THREADS / 32];
    __shared__ float shf[ROW_THREADS];
    __shared__ int64_t shi[ROW_THREADS];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *z = logits + r * V;
        const row_stats_t s = row_stats<REF>(z, V, entropy != nullptr, shd, shf, shi, e32);
        if (threadIdx.x == 0) {
            if (rmx) rmx[r] = s.mx, rse[r] = s.se;
            const double lse = log(s.se);
            const int64_t y = tgt[r];
            if (logp) logp[r] = y == -100 ? 0.0f : (float)((double)z[y] - s.mx - lse);
            if (entropy) entropy[r] = (float)(lse - s.ez / s.se);
            if (nll && y != -100) nll[r] = log(s.se) + s.mx - z[y];
        }
    }
}

// ------------------------------------------------------------------------------------------ sampling

struct sample_args {
    const float *logits;
    const int32_t *lrow;
    int64_t V, pow2;
    double temperature, top_p, min_p;
    int64_t top_k;
    const double *u;
    int64_t *id;
    double *lpm, *lps;
    double *w;                    // [rows, pow2] scratch weights
    int32_t *wid;                 // [rows, pow2] their ids
    int32_t *status;              // [rows, 2]: code (0 ok, 1 NaN, 2 +inf, 3 all -inf), index
    int ref;                      // DS4_CUDA_ROW_REF: row_stats' reference fold for the max
    int e32;                      // ops.h's exp32: row_stats' exponentials in fp32
};

// Sort e[0, n) (padded to n2, a power of two) by (w desc, id asc), or by id asc.
__device__ void bitonic(double *w, int32_t *id, int64_t n2, bool by_id) {
    for (int64_t size = 2; size <= n2; size <<= 1)
        for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (int64_t i = threadIdx.x; i < n2; i += ROW_THREADS) {
                const int64_t j = i ^ stride;
                if (j <= i) continue;
                const bool asc = (i & size) == 0;
                const bool j_first = by_id ? id[j] < id[i] : (w[j] > w[i] || (w[j] == w[i] && id[j] < id[i]));
                if (j_first == asc) {
                    const double tw = w[i];
                    w[i] = w[j], w[j] = tw;
                    const int32_t ti = id[i];
                    id[i] = id[j], id[j] = ti;
                }
            }
            __syncthreads();
        }
}

// Chunked sums over w[0, n): thread c owns chunk [c·L, min(n, (c+1)·L)); pre[c] = Σ of the chunks before c (pre[P]
// the total), each chunk summed in order and the chunk sums in order.
__device__ void chunk_prefix(const double *w, int64_t n, double *pre, int64_t *L_out) {
    const int64_t L = (n + ROW_THREADS - 1) / ROW_THREADS, c = threadIdx.x;
    double part = 0;
    for (int64_t j = c * L; j < n && j < (c + 1) * L; j++) part += w[j];
    pre[c + 1] = part;
    __syncthreads();
    if (c == 0) {
        double acc = 0;
        pre[0] = 0;
        for (int i = 1; i <= ROW_THREADS; i++) {
            acc += pre[i];
            pre[i] = acc;
        }
    }
    __syncthreads();
    *L_out = L;
}

// The first j in [0, n) whose running sum pre[c] + (within its chunk) passes `limit` (sum > limit, or, with
// ratio, sum / tot >= limit); n when none does.
__device__ int64_t first_past(const double *w, int64_t n, const double *pre, int64_t L, double limit, bool ratio,
                              double tot, int64_t *shi) {
    const int64_t c = threadIdx.x;
    int64_t found = n;
    double cum = pre[c];
    for (int64_t j = c * L; j < n && j < (c + 1) * L; j++) {
        cum += w[j];
        if (ratio ? cum / tot >= limit : cum > limit) {
            found = j;
            break;
        }
    }
    shi[c] = found;
    __syncthreads();
    if (c == 0) {
        int64_t f = n;
        for (int i = 0; i < ROW_THREADS; i++) f = shi[i] < f ? shi[i] : f;
        shi[0] = f;
    }
    __syncthreads();
    const int64_t f = shi[0];
    __syncthreads();
    return f;
}

__global__ void __launch_bounds__(ROW_THREADS) sample_kernel(sample_args a) {
    __shared__ double shd[ROW_THREADS / 32], pre[ROW_THREADS + 1];
    __shared__ float shf[ROW_THREADS];
    __shared__ int64_t shi[ROW_THREADS];
    __shared__ int bad;
    const int64_t r = blockIdx.x, V = a.V;
    const float *z = a.logits + (int64_t)a.lrow[r] * V;
    const int tid = threadIdx.x;
    if (tid == 0) bad = 0;
    __syncthreads();
    for (int64_t v = tid; v < V; v += ROW_THREADS)
        if (z[v] != z[v] || (isinf(z[v]) && z[v] > 0)) atomicExch(&bad, 1);
    __syncthreads();
    if (bad) { // report the lowest offending index
        int64_t first = V;
        for (int64_t v = tid; v < V; v += ROW_THREADS)
            if ((z[v] != z[v] || (isinf(z[v]) && z[v] > 0)) && v < first) first = v;
        shi[tid] = first;
        __syncthreads();
        if (tid == 0) {
            for (int i = 1; i < ROW_THREADS; i++) first = shi[i] < first ? shi[i] : first;
            first = shi[0] < first ? shi[0] : first;
            a.status[2 * r] = z[first] != z[first] ? 1 : 2;
            a.status[2 * r + 1] = (int32_t)first;
            a.id[r] = -1;
        }
        return;
    }
    const row_stats_t s =
        a.ref ? row_stats<true>(z, V, false, shd, shf, shi, a.e32) : row_stats<false>(z, V, false, shd, shf, shi, a.e32);
    if (isinf(s.mx)) {
        if (tid == 0) a.status[2 * r] = 3, a.status[2 * r + 1] = -1, a.id[r] = -1;
        return;
    }
    /* log p_model of a token, written exactly as logprobs_kernel writes it (the same association), so a rollout's
     * log-probability and the training forward's are the same bits */
    const double lse = log(s.se);
#define LOG_P(y) ((double)z[y] - s.mx - lse)
    if (a.temperature == 0) {
        if (tid == 0) a.id[r] = s.arg, a.lpm[r] = LOG_P(s.arg), a.lps[r] = 0, a.status[2 * r] = 0;
        return;
    }
    double *w = a.w + r * a.pow2;
    int32_t *id = a.wid + r * a.pow2;
    for (int64_t v = tid; v < a.pow2; v += ROW_THREADS) {
        w[v] = v < V ? exp(((double)z[v] - s.mx) / a.temperature) : -1.0; // padding sorts last
        id[v] = (int32_t)v;
    }
    __syncthreads();
    int64_t n = V, L;
    const bool topk = a.top_k > 0 && a.top_k < V, topp = a.top_p > 0 && a.top_p < 1;
    if (topk || topp) {
        bitonic(w, id, a.pow2, false);
        if (topk) n = a.top_k;
        if (topp) {
            chunk_prefix(w, n, pre, &L);
            const double tot = pre[ROW_THREADS];
            const int64_t f = first_past(w, n, pre, L, a.top_p, true, tot, shi);
            n = f < n ? f + 1 : n;
        }
    }
    // min-p (the argmax's weight is exactly 1, so p_i >= min_p·p_max is w_i >= min_p): stable compaction
    if (a.min_p > 0) {
        if (tid == 0) {
            int64_t m = 0;
            for (int64_t j = 0; j < n; j++)
                if (w[j] >= a.min_p) w[m] = w[j], id[m] = id[j], m++;
            shi[0] = m;
        }
        __syncthreads();
        n = shi[0];
        __syncthreads();
    }
    if (topk || topp) {
        int64_t n2 = 1;
        while (n2 < n) n2 <<= 1;
        for (int64_t j = n + tid; j < n2; j += ROW_THREADS) id[j] = 0x7fffffff, w[j] = 0; // padding sorts last
        __syncthreads();
        bitonic(w, id, n2, true);
    }
    chunk_prefix(w, n, pre, &L);
    const double tot = pre[ROW_THREADS];
    const double target = a.u[r] * tot;
    int64_t pick = first_past(w, n, pre, L, target, false, tot, shi);
    if (pick == n) { // rounding kept the running sum at or below the target: the last kept token of nonzero weight
        if (tid == 0) {
            pick = 0;
            for (int64_t j = 0; j < n; j++)
                if (w[j] > 0) pick = j;
            shi[0] = pick;
        }
        __syncthreads();
        pick = shi[0];
    }
    if (tid == 0) {
        a.id[r] = id[pick];
        a.lpm[r] = LOG_P(id[pick]);
        a.lps[r] = log(w[pick] / tot);
        a.status[2 * r] = 0;
    }
#undef LOG_P
}

} // namespace

void ds4_cuda_ce_rows(ds4_dev *d, const ds4_a_ce_rows *a) {
    if (a->rows <= 0) return;
    cuda_dev *cd = cdev(d);
    ce_kernel<<<ds4_vocab_grid(cd, a->rows), ROW_THREADS, 0, cd->stream>>>(a->logits, a->rows, a->V, a->tgt, a->nll,
                                                                           cd->row_ref, a->rmx, a->rse, a->exp32);
    ds4_cuda_launched(d, "ce_rows", "[%lld x %lld]", (long long)a->rows, (long long)a->V);
}

void ds4_cuda_logprobs(ds4_dev *d, const ds4_a_logprobs *a) {
    if (a->rows <= 0) return;
    cuda_dev *cd = cdev(d);
    const unsigned grid = ds4_vocab_grid(cd, a->rows);
    if (!cd->row_ref) {
        logprobs_kernel<false><<<grid, ROW_THREADS, 0, cd->stream>>>(a->logits, a->rows, a->V, a->tgt, a->logp,
                                                                     a->entropy, a->nll, a->rmx, a->rse, a->exp32);
        ds4_cuda_launched(d, "logprobs", "[%lld x %lld]%s", (long long)a->rows, (long long)a->V,
                          a->nll ? " with the cross-entropy" : "");
        return;
    }
    logprobs_kernel<true><<<grid, ROW_THREADS, 0, cd->stream>>>(a->logits, a->rows, a->V, a->tgt, a->logp,
                                                                a->entropy, nullptr, a->rmx, a->rse, a->exp32);
    ds4_cuda_launched(d, "logprobs", "[%lld x %lld]", (long long)a->rows, (long long)a->V);
    if (a->nll) { /* the cross-entropy as ce_rows computes it */
        const ds4_a_ce_rows ce = {a->logits, a->rows, a->V, a->tgt, a->nll, nullptr, nullptr, a->exp32};
        ds4_cuda_ce_rows(d, &ce);
    }
}

void ds4_cuda_sample(ds4_dev *d, const ds4_a_sample *a) {
    cuda_dev *cd = cdev(d);
    if (a->rows <= 0) return;
    const ds4_sampling *p = &a->p;
    if (!(p->temperature >= 0) || isinf(p->temperature) || p->top_k < 0 || !(p->top_p >= 0 && p->top_p <= 1) ||
        !(p->min_p >= 0 && p->min_p <= 1)) {
        ds4_dev_fail(d, DS4_ERR_ARG, "sample: temperature %g, top_k %lld, top_p %g, min_p %g out of range",
                     p->temperature, (long long)p->top_k, p->top_p, p->min_p);
        return;
    }
    int64_t pow2 = 1;
    while (pow2 < a->V) pow2 <<= 1;
    const size_t wbytes = p->temperature > 0 ? (size_t)a->rows * pow2 * (sizeof(double) + sizeof(int32_t)) : 0;
    char *scr = (char *)ds4_cuda_scratch(d, wbytes + (size_t)a->rows * 2 * sizeof(int32_t), "sample", 1);
    if (!scr) return;
    if ((size_t)a->rows > cd->host_err_n) {
        if (cd->host_err) (void)cudaFreeHost(cd->host_err);
        cd->host_err = NULL;
        cd->host_err_n = 0;
        if (cudaMallocHost((void **)&cd->host_err, (size_t)a->rows * 2 * sizeof(int32_t)) != cudaSuccess) {
            (void)cudaGetLastError();
            ds4_dev_fail(d, DS4_ERR_OOM, "sample: pinned status of %lld rows", (long long)a->rows);
            return;
        }
        cd->host_err_n = (size_t)a->rows;
    }
    sample_args g = {a->logits, a->lrow, a->V, pow2, p->temperature, p->top_p, p->min_p, p->top_k, a->u, a->id,
                     a->lp_model, a->lp_sample, (double *)scr, (int32_t *)(scr + (size_t)a->rows * pow2 * sizeof(double)),
                     (int32_t *)(scr + wbytes), cd->row_ref, a->exp32};
    sample_kernel<<<(unsigned)a->rows, ROW_THREADS, 0, cd->stream>>>(g);
    if (!ds4_cuda_launched(d, "sample", "[%lld draws x %lld]", (long long)a->rows, (long long)a->V)) return;
    // the status words come back now: an invalid row is an error of this operation, naming the row
    if (cudaMemcpyAsync(cd->host_err, g.status, (size_t)a->rows * 2 * sizeof(int32_t), cudaMemcpyDeviceToHost,
                        cd->stream) != cudaSuccess ||
        cudaStreamSynchronize(cd->stream) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        ds4_dev_fail(d, DS4_ERR_CUDA, "sample [%lld draws x %lld]: %s", (long long)a->rows, (long long)a->V,
                     cudaGetErrorString(e));
        return;
    }
    for (int64_t r = 0; r < a->rows; r++) {
        const int32_t code = cd->host_err[2 * r], at = cd->host_err[2 * r + 1];
        if (!code) continue;
        if (code == 3)
            ds4_dev_fail(d, DS4_ERR_ARG, "sample: row %lld of [%lld, %lld]: all logits are -inf", (long long)r,
                         (long long)a->rows, (long long)a->V);
        else
            ds4_dev_fail(d, DS4_ERR_ARG, "sample: row %lld of [%lld, %lld]: logits[%d] is %s", (long long)r,
                         (long long)a->rows, (long long)a->V, at, code == 1 ? "NaN" : "+inf (the softmax is undefined)");
        return;
    }
}
