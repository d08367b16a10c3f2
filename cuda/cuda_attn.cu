// cuda_attn.cu — the attention sub-layer on the GPU: the KV compressor's pooling (entries, with RMSNorm and RoPE),
// the lightning indexer with its top-k, attention with sink over the window and the compressed entries, the step's
// cache commit and the record of indexer picks.
//
// A query row's keys are listed in the same order as on the CPU (window keys oldest first, then entries in entry or
// pick order) and reduced in a fixed order that depends on the key count only, so a row computes the same bits in a
// full forward (keys from this pass) and in a decoding step (keys from the cache ring and entries).
#include "cuda_dev.cuh"
#include "shape_limits.h"

namespace {

// Row t's position, and its sequence's descriptor in a step.
__device__ __forceinline__ int64_t row_pos(const ds4_rows &r, int64_t t) { return r.pos ? r.pos[t] : t % r.S; }

__device__ __forceinline__ const float *comp_row(const ds4_comp_cache *cc, const float *buf, const float *X, int64_t p0,
                                                 int64_t q) {
    if (q >= p0) return X + (q - p0) * cc->width;
    const int64_t m = cc->m;
    return buf + ((q / m == p0 / m ? m : 0) + q % m) * cc->width;
}

// The last sequence whose first job w0[cls] is <= job (the sequences' job ranges are consecutive).
__device__ int64_t seq_of_job(const ds4_rows &r, int cls, int64_t job) {
    int64_t lo = 0, hi = r.nseq - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (r.seqs[mid].w0[cls] <= job) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// ------------------------------------------------------------------------------------------ compressor

struct comp_args {
    const float *C, *Z, *ape, *norm;
    float *out, *pool;
    int64_t m, dd, width, S, nwin;
    int overlap, which, cls;
    ds4_rows rows;
    const float *cs;
    int64_t half;
    double eps;
};

// One entry per block: gated softmax pooling of each channel over its slots (fp32 gates, double denominator, as the
// CPU), then RMSNorm over the entry and RoPE at the window's first position.
__global__ void compress_kernel(comp_args a) {
    extern __shared__ float pooled[]; // [dd]
    __shared__ double sh[8];
    __shared__ const float *Cr[2 * DS4_MAX_RATE], *Zr[2 * DS4_MAX_RATE];
    __shared__ float *dst;
    __shared__ int64_t win_s, nprev_s;
    const int64_t job = blockIdx.x, m = a.m, dd = a.dd;
    if (threadIdx.x == 0) {
        int64_t win, nprev;
        if (!a.rows.pos) {
            const int64_t row = job / a.nwin;
            win = job % a.nwin;
            nprev = a.overlap && win > 0 ? m : 0;
            const int64_t t0 = row * a.S + win * m - nprev;
            for (int64_t j = 0; j < nprev + m; j++) {
                Cr[j] = a.C + (t0 + j) * a.width;
                Zr[j] = a.Z + (t0 + j) * a.width;
            }
            dst = a.out + (row * a.S + win) * dd;
        } else {
            const ds4_seq_desc *sq = &a.rows.seqs[seq_of_job(a.rows, a.cls, job)];
            const ds4_layer_cache *lc = &sq->layers[a.rows.li];
            const ds4_comp_cache *cc = a.which ? &lc->idx : &lc->comp;
            win = sq->p0 / m + (job - sq->w0[a.cls]);
            nprev = a.overlap && win > 0 ? m : 0;
            const float *C = a.C + sq->r0 * cc->width, *Z = a.Z + sq->r0 * cc->width;
            for (int64_t j = 0; j < nprev + m; j++) {
                const int64_t q = win * m - nprev + j;
                Cr[j] = comp_row(cc, cc->C, C, sq->p0, q);
                Zr[j] = comp_row(cc, cc->Z, Z, sq->p0, q);
            }
            dst = cc->ent + win * cc->dd;
        }
        win_s = win;
        nprev_s = nprev;
    }
    __syncthreads();
    const int64_t win = win_s, nprev = nprev_s, off = a.overlap ? dd : 0, ns = nprev + m;
    for (int64_t ch = threadIdx.x; ch < dd; ch += blockDim.x) {
        // slot k: previous-window rows first (their first halves), then this window's (second halves with overlap)
#define GATE(k) ((k) < nprev ? Zr[k][ch] + a.ape[(k) * a.width + ch] \
                             : Zr[k][off + ch] + a.ape[((k) - nprev) * a.width + off + ch])
#define VAL(k) ((k) < nprev ? Cr[k][ch] : Cr[k][off + ch])
        float mx = -INFINITY;
        for (int64_t k = 0; k < ns; k++) mx = fmaxf(mx, GATE(k));
        double den = 0;
        for (int64_t k = 0; k < ns; k++) den += (double)(float)exp((double)(GATE(k) - mx));
        float acc = 0;
        for (int64_t k = 0; k < ns; k++) acc += VAL(k) * (float)((double)(float)exp((double)(GATE(k) - mx)) / den);
#undef GATE
#undef VAL
        pooled[ch] = acc;
        if (a.pool && !a.rows.pos) a.pool[(job / a.nwin * a.S + win) * dd + ch] = acc;
    }
    __syncthreads();
    double ss = 0;
    for (int64_t ch = threadIdx.x; ch < dd; ch += blockDim.x) ss += (double)pooled[ch] * pooled[ch];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, dd, a.eps);
    for (int64_t ch = threadIdx.x; ch < dd; ch += blockDim.x) pooled[ch] = a.norm[ch] * (pooled[ch] * inv);
    __syncthreads();
    const float *cs = a.cs + win * m * 2 * a.half;
    for (int64_t j = threadIdx.x; j < a.half; j += blockDim.x) ds4d_rope_pair(pooled + dd - 2 * a.half, cs, j, 1);
    __syncthreads();
    for (int64_t ch = threadIdx.x; ch < dd; ch += blockDim.x) dst[ch] = pooled[ch];
}

// ------------------------------------------------------------------------------------------ indexer

struct idx_args {
    const float *iq, *iw, *iK;
    ds4_rows rows;
    int64_t nwin, topk, nI, cI, m, sel_stride, index_topk, pow2;
    int32_t *sel, *nsel;
    const int32_t *replay;
    int64_t replay_ld;
};

// One query row per block: scores of its causal entries, then the top-k by a bitonic sort of (score desc, index
// asc) in shared memory: largest first, ties to the lower index, as the CPU's selection.
__global__ void indexer_kernel(idx_args a) {
    extern __shared__ char smem[];
    float *key = (float *)smem;                       // [pow2]
    int32_t *idx = (int32_t *)(key + a.pow2);         // [pow2]
    const int64_t t = blockIdx.x;
    int32_t *sel = a.sel + t * a.sel_stride;
    const int32_t *rp = a.replay ? a.replay + t * a.replay_ld : nullptr;
    if (rp && rp[0] >= 0) { // replayed picks (validated causal and distinct by the forward's argument check)
        if (threadIdx.x == 0) {
            int64_t k = 0;
            for (int64_t i = 0; i < a.index_topk && k < a.sel_stride; i++)
                if (rp[i] >= 0) sel[k++] = rp[i];
            a.nsel[t] = (int32_t)k;
        }
        return;
    }
    const int64_t v = (row_pos(a.rows, t) + 1) / a.m;
    int64_t valid = v;
    const float *keys;
    if (a.rows.pos) {
        keys = a.rows.seqs[a.rows.rowseq[t]].layers[a.rows.li].idx.ent;
    } else {
        valid = v < a.nwin ? v : a.nwin;
        keys = a.iK + (t / a.rows.S) * a.rows.S * a.cI;
    }
    const int64_t k = a.topk < valid ? a.topk : valid;
    if (k == valid) {
        for (int64_t w = threadIdx.x; w < valid; w += blockDim.x) sel[w] = (int32_t)w;
        if (threadIdx.x == 0) a.nsel[t] = (int32_t)k;
        return;
    }
    const float qscale = 1.0f / sqrtf((float)a.cI);
    const float *q = a.iq + t * a.nI * a.cI, *iw = a.iw + t * a.nI;
    int64_t n2 = 1;
    while (n2 < valid) n2 <<= 1;
    for (int64_t w = threadIdx.x; w < n2; w += blockDim.x) {
        float acc = -INFINITY;
        if (w < valid) {
            acc = 0;
            const float *kw = keys + w * a.cI;
            for (int64_t h = 0; h < a.nI; h++) {
                float dot = 0;
                for (int64_t c = 0; c < a.cI; c++) dot = fmaf(q[h * a.cI + c], kw[c], dot);
                const float r = dot > 0 ? dot * qscale : 0.0f;
                acc += r * iw[h];
            }
            if (acc != acc) acc = -INFINITY; // NaN: never picked before a number
        }
        key[w] = acc;
        idx[w] = (int32_t)w;
    }
    __syncthreads();
    // bitonic sort into descending score, ascending index
    for (int64_t size = 2; size <= n2; size <<= 1)
        for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (int64_t i = threadIdx.x; i < n2; i += blockDim.x) {
                const int64_t j = i ^ stride;
                if (j <= i) continue;
                const bool desc = (i & size) == 0;
                const float ki = key[i], kj = key[j];
                const int32_t ii = idx[i], ij = idx[j];
                const bool j_first = kj > ki || (kj == ki && ij < ii); // j precedes i in the wanted order
                if (j_first == desc) {
                    key[i] = kj, key[j] = ki;
                    idx[i] = ij, idx[j] = ii;
                }
            }
            __syncthreads();
        }
    for (int64_t i = threadIdx.x; i < k; i += blockDim.x) sel[i] = idx[i];
    if (threadIdx.x == 0) a.nsel[t] = (int32_t)k;
}

__global__ void record_picks_kernel(int32_t *dst, int64_t ld, const int32_t *sel, const int32_t *nsel,
                                    int64_t sel_stride, int64_t K, int64_t T) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * K) return;
    const int64_t t = i / K, j = i % K;
    dst[t * ld + j] = j < nsel[t] ? sel[t * sel_stride + j] : -1;
}

// ------------------------------------------------------------------------------------------ attention

struct att_args {
    const float *sink, *q, *kv, *cK;
    float *o;
    ds4_rows rows;
    int64_t H, d, win, nwin, m, sel_stride, maxk;
    int type;
    const int32_t *sel, *nsel;
};

constexpr int ATT_WARPS = 4;

// One query row per block, its heads one warp at a time. Scores: lane l takes keys l, l+32, ..; max and the
// denominator (double) over lanes by butterfly; output: lane l owns channels l, l+32, .., summing keys in order.
__global__ void __launch_bounds__(ATT_WARPS * 32) attention_kernel(att_args a) {
    extern __shared__ char smem[];
    const float **keys = (const float **)smem;                  // [maxk]
    float *lg = (float *)(keys + a.maxk);                       // [ATT_WARPS][maxk]
    float *qs = lg + ATT_WARPS * a.maxk;                        // [ATT_WARPS][d]
    __shared__ int64_t nk_s;
    const int64_t t = blockIdx.x, d = a.d;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        const int64_t s = row_pos(a.rows, t);
        const int64_t j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
        int64_t nk = 0;
        const ds4_seq_desc *sq = a.rows.pos ? &a.rows.seqs[a.rows.rowseq[t]] : nullptr;
        for (int64_t j = j0; j <= s; j++) {
            if (!sq) keys[nk++] = a.kv + ((t / a.rows.S) * a.rows.S + j) * d;
            else if (j >= sq->p0) keys[nk++] = a.kv + (sq->r0 + j - sq->p0) * d;
            else keys[nk++] = sq->layers[a.rows.li].ring + (j % sq->ring) * d;
        }
        if (a.type != DS4_ATTN_SLIDING) {
            const int64_t v = (s + 1) / a.m;
            int64_t valid;
            const float *ent;
            if (sq) {
                valid = v;
                ent = sq->layers[a.rows.li].comp.ent;
            } else {
                valid = v < a.nwin ? v : a.nwin;
                ent = a.cK + (t / a.rows.S) * a.rows.S * d;
            }
            if (a.type == DS4_ATTN_HCA)
                for (int64_t w = 0; w < valid; w++) keys[nk++] = ent + w * d;
            else
                for (int64_t i = 0; i < a.nsel[t]; i++) keys[nk++] = ent + a.sel[t * a.sel_stride + i] * d;
        }
        nk_s = nk;
    }
    __syncthreads();
    const int64_t nk = nk_s;
    const float scale = 1.0f / sqrtf((float)d);
    float *l = lg + warp * a.maxk, *qw = qs + warp * d;
    for (int64_t h = warp; h < a.H; h += ATT_WARPS) {
        const float *q = a.q + (t * a.H + h) * d;
        for (int64_t c = lane; c < d; c += 32) qw[c] = q[c];
        __syncwarp();
        float mx = a.sink[h];
        for (int64_t k = lane; k < nk; k += 32) {
            const float *kk = keys[k];
            float dot = 0;
            for (int64_t c = 0; c < d; c++) dot = fmaf(qw[c], kk[c], dot);
            l[k] = dot * scale;
            mx = fmaxf(mx, l[k]);
        }
        mx = ds4d_warp_maxf(mx);
        double den = 0;
        for (int64_t k = lane; k < nk; k += 32) den += (double)(l[k] = (float)exp((double)(l[k] - mx)));
        den = ds4d_warp_sum(den) + exp((double)(a.sink[h] - mx));
        for (int64_t k = lane; k < nk; k += 32) l[k] = (float)(l[k] / den);
        __syncwarp();
        float *o = a.o + (t * a.H + h) * d;
        for (int64_t c = lane; c < d; c += 32) {
            float acc = 0;
            for (int64_t k = 0; k < nk; k++) acc += l[k] * keys[k][c];
            o[c] = acc;
        }
        __syncwarp();
    }
}

// ------------------------------------------------------------------------------------------ cache commit

struct commit_args {
    const float *kv, *cC, *cZ, *iC, *iZ;
    ds4_rows rows;
    int64_t d;
    int type;
};

// Phase 0: the ring, and (CSA) the window that just completed into the last-window rows, read from the old pending
// rows and the chunk. Phase 1 (a second launch, so that phase 0 has read the old pending rows): the pending rows.
__global__ void commit_kernel(commit_args a, int phase) {
    const ds4_seq_desc *sq = &a.rows.seqs[blockIdx.x];
    const ds4_layer_cache *lc = &sq->layers[a.rows.li];
    const int64_t p0 = sq->p0, p1 = p0 + sq->n;
    if (phase == 0) {
        const int64_t R = sq->ring, q0 = p1 - R > p0 ? p1 - R : p0;
        for (int64_t i = threadIdx.x; i < (p1 - q0) * a.d; i += blockDim.x) {
            const int64_t q = q0 + i / a.d, c = i % a.d;
            lc->ring[(q % R) * a.d + c] = a.kv[(sq->r0 + q - p0) * a.d + c];
        }
    }
    if (a.type == DS4_ATTN_SLIDING) return;
    for (int which = 0; which < (a.type == DS4_ATTN_CSA ? 2 : 1); which++) {
        const ds4_comp_cache *cc = which ? &lc->idx : &lc->comp;
        const float *C = (which ? a.iC : a.cC) + sq->r0 * cc->width, *Z = (which ? a.iZ : a.cZ) + sq->r0 * cc->width;
        const int64_t m = cc->m, w = cc->width;
        if (phase == 0) {
            if (!cc->overlap || p1 / m <= p0 / m) continue;
            const int64_t base = (p1 / m - 1) * m;
            for (int64_t i = threadIdx.x; i < m * w; i += blockDim.x) {
                const int64_t j = i / w, c = i % w;
                cc->C[j * w + c] = comp_row(cc, cc->C, C, p0, base + j)[c];
                cc->Z[j * w + c] = comp_row(cc, cc->Z, Z, p0, base + j)[c];
            }
        } else {
            const int64_t q0 = p1 / m * m > p0 ? p1 / m * m : p0;
            for (int64_t i = threadIdx.x; i < (p1 - q0) * w; i += blockDim.x) {
                const int64_t q = q0 + i / w, c = i % w;
                cc->C[(m + q % m) * w + c] = C[(q - p0) * w + c];
                cc->Z[(m + q % m) * w + c] = Z[(q - p0) * w + c];
            }
        }
    }
}

} // namespace

void ds4_cuda_compress(ds4_dev *d, const ds4_a_compress *a) {
    const int64_t jobs = a->rows.pos ? a->njobs : a->B * a->nwin;
    if (jobs <= 0) return;
    const ds4_compressor_w *w = a->w;
    if (w->rate > DS4_MAX_RATE) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "compress: rate %lld > %d", (long long)w->rate, DS4_MAX_RATE);
        return;
    }
    comp_args g = {a->C, a->Z, w->ape, w->norm, a->out, a->pool, w->rate, w->dd, w->width, a->rows.S, a->nwin,
                   a->overlap, a->which, a->cls, a->rows, a->rt.cs, a->rt.half, a->c->rms_norm_eps};
    compress_kernel<<<(unsigned)jobs, 128, (size_t)w->dd * sizeof(float), cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "compress", "[%lld entries of %lld, rate %lld%s]", (long long)jobs, (long long)w->dd,
                      (long long)w->rate, a->rows.pos ? ", step" : "");
}

void ds4_cuda_indexer(ds4_dev *d, const ds4_a_indexer *a) {
    const int64_t T = a->rows.T;
    if (T <= 0) return;
    const ds4_config *c = a->c;
    if (a->nwin == 0 && !a->rows.pos) {
        ds4_dev_fill(d, a->nsel, 0, (size_t)T * sizeof(int32_t));
        return;
    }
    const int64_t maxv = a->rows.pos ? a->rows.S / c->compress_rate_csa : a->nwin;
    int64_t pow2 = 1;
    while (pow2 < maxv) pow2 <<= 1;
    const size_t smem = (size_t)pow2 * (sizeof(float) + sizeof(int32_t));
    if (smem > cdev(d)->smem_optin) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED,
                     "indexer: %lld compressed entries per query need %zu bytes of shared memory to sort, more than the "
                     "%zu a block may have (positions up to %lld)", (long long)maxv, smem, cdev(d)->smem_optin,
                     (long long)a->rows.S);
        return;
    }
    if (smem > 48 * 1024) cudaFuncSetAttribute(indexer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    idx_args g = {a->iq, a->iw, a->iK, a->rows, a->nwin, a->topk, c->index_n_heads, c->index_head_dim,
                  c->compress_rate_csa, a->sel_stride, c->index_topk, pow2, a->sel, a->nsel, a->replay, a->replay_ld};
    indexer_kernel<<<(unsigned)T, 256, smem, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "indexer", "[%lld queries, <= %lld entries, top %lld]", (long long)T, (long long)maxv,
                      (long long)a->topk);
}

void ds4_cuda_record_picks(ds4_dev *d, const ds4_a_record_picks *a) {
    const int64_t n = a->T * a->K;
    if (n <= 0) return;
    record_picks_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->dst, a->ld, a->sel, a->nsel, a->sel_stride,
                                                                          a->K, a->T);
    ds4_cuda_launched(d, "record_picks", "[%lld x %lld]", (long long)a->T, (long long)a->K);
}

void ds4_cuda_attention(ds4_dev *d, const ds4_a_attention *a) {
    const int64_t T = a->rows.T;
    if (T <= 0) return;
    if (a->itgt) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention: the indexer-KL target (training) is not on the cuda backend yet");
        return;
    }
    const ds4_config *c = a->c;
    const int64_t S = a->rows.S, win = c->sliding_window < S ? c->sliding_window : S;
    const int64_t m = a->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
    const int64_t maxk = win + (a->type == DS4_ATTN_HCA ? S / m : (a->type == DS4_ATTN_CSA ? a->sel_stride : 0));
    const size_t smem = (size_t)maxk * sizeof(float *) + (size_t)ATT_WARPS * maxk * sizeof(float) +
                        (size_t)ATT_WARPS * c->head_dim * sizeof(float);
    if (smem > cdev(d)->smem_optin) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention: %lld keys per query need %zu bytes of shared memory (> %zu)",
                     (long long)maxk, smem, cdev(d)->smem_optin);
        return;
    }
    if (smem > 48 * 1024)
        cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    att_args g = {a->sink, a->q, a->kv, a->cK, a->o, a->rows, c->num_attention_heads, c->head_dim, c->sliding_window,
                  a->nwin, m, a->sel_stride, maxk, (int)a->type, a->sel, a->nsel};
    attention_kernel<<<(unsigned)T, ATT_WARPS * 32, smem, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "attention", "[%lld queries, %lld heads x %lld, <= %lld keys, %s]", (long long)T,
                      (long long)c->num_attention_heads, (long long)c->head_dim, (long long)maxk,
                      ds4_attn_type_name(a->type));
}

void ds4_cuda_cache_commit(ds4_dev *d, const ds4_a_cache_commit *a) {
    if (a->rows.nseq <= 0) return;
    commit_args g = {a->kv, a->cC, a->cZ, a->iC, a->iZ, a->rows, a->c->head_dim, (int)a->type};
    for (int phase = 0; phase < 2; phase++) {
        commit_kernel<<<(unsigned)a->rows.nseq, 256, 0, cdev(d)->stream>>>(g, phase);
        if (!ds4_cuda_launched(d, "cache_commit", "[%lld sequences, phase %d]", (long long)a->rows.nseq, phase)) return;
    }
}
