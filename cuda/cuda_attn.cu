// cuda_attn.cu — the attention sub-layer on the GPU: the KV compressor's pooling (entries, with RMSNorm and RoPE),
// the lightning indexer with its top-k, attention with sink over the window and the compressed entries, the step's
// cache commit and the record of indexer picks.
//
// A query row's keys are listed in the same order as on the CPU (window keys oldest first, then entries in entry or
// pick order) and reduced in a fixed order that depends on the key count only, so a row computes the same bits in a
// full forward (keys from this pass) and in a decoding step (keys from the cache ring and entries).
#include "cuda_attn_tc.cuh"
#include "cuda_dev.cuh"
#include "cuda_kv_qat.cuh"
#include "shape_limits.h"

namespace {

// Row t's position (a full forward's query window: q0 + t % qn, ops.h's ds4_rows_pos), and in a full forward its
// sequence, whose keys start at row seq·S of the key-side buffers.
__device__ __forceinline__ int64_t row_qn(const ds4_rows &r) { return r.qn ? r.qn : r.S; }
__device__ __forceinline__ int64_t row_pos(const ds4_rows &r, int64_t t) {
    return r.pos ? r.pos[t] : r.q0 + t % row_qn(r);
}
__device__ __forceinline__ int64_t row_seq(const ds4_rows &r, int64_t t) { return t / row_qn(r); }

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
    ds4_fq q;                     // the QAT option (fmt 0 and no rotation: off)
};

// One entry per block: gated softmax pooling of each channel over its slots (fp32 gates, double denominator, as the
// CPU), then RMSNorm over the entry, RoPE at the window's first position and, with the QAT option, the entry's
// fake-quantisation (cuda_kv_qat.cuh: the CPU's bits for the same entry), so a step's cache holds what a full forward
// computes.
__global__ void compress_kernel(comp_args a) {
    extern __shared__ float pooled[]; // [dd]
    __shared__ double sh[8];
    __shared__ const float *Cr[2 * DS4_MAX_RATE], *Zr[2 * DS4_MAX_RATE];
    __shared__ float *dst;
    __shared__ int64_t win_s, nprev_s;
    const int64_t job = blockIdx.x, m = a.m, dd = a.dd;
    if (a.rows.pos && job >= a.rows.njobs[a.cls]) return; // a step's grid is a bound; its job count is data
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
    if (a.q.fmt || a.q.hadamard) ds4d_fake_quant_vec(pooled, dd, a.q); // the same in every thread: a kernel argument
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
        keys = a.iK + row_seq(a.rows, t) * a.rows.S * a.cI;
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
    float *smx;                   // CSA with the indexer-KL target: [T, H] each softmax's max and denominator
    double *sden;
    ds4_rows rows;
    int64_t H, d, win, nwin, m, sel_stride, maxk;
    int type;
    const int32_t *sel, *nsel;
};

constexpr int ATT_THREADS = 128;

// Key k of query row t, in the CPU's order: window keys j0..s first (from this pass, or the cache's ring for tokens
// before a step), then the compressed entries (HCA: all causal ones; CSA: the indexer's picks in pick order).
struct key_list {
    const float *kv_row, *ring, *ent;
    const int32_t *sel;
    int64_t j0, nwk, nk, p0, r0, R, d;

    __device__ const float *at(const float *kv, int64_t k) const {
        if (k < nwk) {
            const int64_t j = j0 + k;
            if (!ring || j >= p0) return kv_row + (j - p0) * d;
            return ring + (j % R) * d;
        }
        const int64_t e = k - nwk;
        return ent + (sel ? (int64_t)sel[e] : e) * d;
    }
};

__device__ key_list keys_of(const att_args &a, int64_t t) {
    key_list L;
    const int64_t s = row_pos(a.rows, t), d = a.d;
    L.d = d;
    L.j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
    L.nwk = s - L.j0 + 1;
    L.sel = nullptr;
    L.ent = nullptr;
    int64_t valid = 0;
    if (a.rows.pos) {
        const ds4_seq_desc *sq = &a.rows.seqs[a.rows.rowseq[t]];
        L.ring = sq->layers[a.rows.li].ring;
        L.p0 = sq->p0;
        L.R = sq->ring;
        L.kv_row = a.kv + sq->r0 * d; // key j >= p0 sits at row r0 + j - p0 of this pass
        if (a.type != DS4_ATTN_SLIDING) L.ent = sq->layers[a.rows.li].comp.ent, valid = (s + 1) / a.m;
    } else {
        L.ring = nullptr;
        L.p0 = 0;
        L.R = 1;
        L.kv_row = a.kv + row_seq(a.rows, t) * a.rows.S * d;
        if (a.type != DS4_ATTN_SLIDING) {
            valid = (s + 1) / a.m < a.nwin ? (s + 1) / a.m : a.nwin;
            L.ent = a.cK + row_seq(a.rows, t) * a.rows.S * d;
        }
    }
    int64_t ne = 0;
    if (a.type == DS4_ATTN_HCA) ne = valid;
    if (a.type == DS4_ATTN_CSA) ne = a.nsel[t], L.sel = a.sel + t * a.sel_stride;
    L.nk = L.nwk + ne;
    return L;
}

// One block per (query row, head). Scores: warp w takes keys w, w+4, .. (four at a time, so that their loads and
// butterflies overlap); each a dot product of lane-strided channels summed by a fixed butterfly. Max and denominator (double) over the block in a fixed tree. Output: thread c owns
// channel c and adds the keys in order.
__global__ void __launch_bounds__(ATT_THREADS) attention_kernel(att_args a) {
    extern __shared__ char smem[];
    const float **kp = (const float **)smem;  // [maxk] key pointers, resolved once
    float *lg = (float *)(kp + a.maxk);       // [maxk]
    __shared__ double shd[ATT_THREADS / 32];
    __shared__ float shf[ATT_THREADS / 32];
    const int64_t t = blockIdx.x / a.H, h = blockIdx.x % a.H, d = a.d;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const key_list L = keys_of(a, t);
    for (int64_t k = threadIdx.x; k < L.nk; k += ATT_THREADS) kp[k] = L.at(a.kv, k);
    __syncthreads();
    const float *q = a.q + (t * a.H + h) * d;
    const float scale = 1.0f / sqrtf((float)d);
    float mx = a.sink[h];
    constexpr int NWARP = ATT_THREADS / 32, U = 4; // a warp's keys U at a time: independent chains and butterflies
    for (int64_t k0 = warp; k0 < L.nk; k0 += U * NWARP) {
        const float *key[U];
        float dot[U];
#pragma unroll
        for (int u = 0; u < U; u++) key[u] = k0 + u * NWARP < L.nk ? kp[k0 + u * NWARP] : nullptr, dot[u] = 0;
        for (int64_t c = lane; c < d; c += 32) {
            const float qc = q[c];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (key[u]) dot[u] = fmaf(qc, key[u][c], dot[u]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (!key[u]) continue;
            dot[u] = ds4d_warp_sumf(dot[u]) * scale;
            if (lane == 0) lg[k0 + u * NWARP] = dot[u];
            mx = fmaxf(mx, dot[u]);
        }
    }
    if (lane == 0) shf[warp] = mx;
    __syncthreads();
    mx = shf[0];
    for (int w = 1; w < ATT_THREADS / 32; w++) mx = fmaxf(mx, shf[w]);
    double den = 0;
    for (int64_t k = threadIdx.x; k < L.nk; k += ATT_THREADS) den += (double)(lg[k] = (float)exp((double)(lg[k] - mx)));
    den = ds4d_block_sum(den, shd) + exp((double)(a.sink[h] - mx));
    if (a.smx && threadIdx.x == 0) a.smx[t * a.H + h] = mx, a.sden[t * a.H + h] = den;
    for (int64_t k = threadIdx.x; k < L.nk; k += ATT_THREADS) lg[k] = (float)(lg[k] / den);
    __syncthreads();
    float *o = a.o + (t * a.H + h) * d;
    for (int64_t c = threadIdx.x; c < d; c += ATT_THREADS) {
        float acc = 0;
        for (int64_t k = 0; k < L.nk; k++) acc += lg[k] * kp[k][c];
        o[c] = acc;
    }
}

// The bf16 mode (bf16_in): one block per query row, every head at once on the tensor cores (cuda_attn_tc.cuh). itgt
// (CSA with the indexer-KL target): pick i's probability summed over the heads in head order from 0, from the fp32
// probabilities in shared memory (the CPU's sums); 0 past the picks.
// REF: the reference staging (DS4_CUDA_ATTN_REF=1), the same bits. At most 128 registers, so that
// 4 blocks fit an SM (the pipelined staging holds a chunk's loads in registers; 5 blocks would spill heavily).
template <bool REF>
__global__ void __launch_bounds__(TCA_THREADS, 4) attention_tc_kernel(att_args a, float *itgt) {
    extern __shared__ __align__(16) char smem[];
    const tca_layout S = tca_layout_of(a.H, a.d, a.maxk, 0);
    const float **kp = (const float **)(smem + S.kp);
    float *lg = (float *)(smem + S.lg);                                      // [Hp, nkp] logits, then P
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem + S.sP), *sQ = (__nv_bfloat16 *)(smem + S.sQ);
    __nv_bfloat16 *sK = (__nv_bfloat16 *)(smem + S.sK), *sKT = (__nv_bfloat16 *)(smem + S.sKT);
    const int64_t t = blockIdx.x, d = a.d, H = a.H;
    const key_list L = keys_of(a, t);
    for (int64_t k = threadIdx.x; k < L.nk; k += TCA_THREADS) kp[k] = L.at(a.kv, k);
    tca_stage_rows(sQ, a.q + t * H * d, H, d, S);
    __syncthreads();
    tca_scores_sel<REF>(lg, nullptr, sQ, nullptr, sK, kp, L.nk, d, 1.0f / sqrtf((float)d), S);
    const int64_t nkp = tca_up(L.nk, TCA_KC);
    for (int64_t h = threadIdx.x >> 5; h < H; h += TCA_WARPS) {
        float mx;
        (void)tca_softmax_row(lg + h * S.nkp, sP + h * S.LP, L.nk, nkp, a.sink[h], &mx);
    }
    __syncthreads();
    if (itgt)
        for (int64_t i = threadIdx.x; i < a.sel_stride; i += TCA_THREADS) {
            float acc = 0;
            if (L.nwk + i < L.nk)
                for (int64_t h = 0; h < H; h++) acc += lg[h * S.nkp + L.nwk + i];
            itgt[t * a.sel_stride + i] = acc;
        }
    tca_weighted_sum_sel<REF>(a.o + t * H * d, H, d, sP, sKT, kp, L.nk, S);
}

// The same at d = 128 in a full forward, keys from bf16 copies (cuda_attn_tc.cuh's ring): keys [B·S + B·nwin, 128],
// kv's rows then each sequence's nwin entries. At most 128 registers: 4 blocks an SM (55 KiB of shared memory each at
// 16 heads and 384 keys).
__global__ void __launch_bounds__(TCA_THREADS, 4) attention_tcb_kernel(att_args a, const __nv_bfloat16 *keys,
                                                                       float *itgt) {
    extern __shared__ __align__(128) char smem[];
    const tca_layout S = tcb_layout_of(a.H, a.maxk, 0);
    uint32_t *kr = (uint32_t *)(smem + S.kp);
    float *lg = (float *)(smem + S.lg);                                      // [Hp, nkp] logits, then P
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem + S.sP), *sQ = (__nv_bfloat16 *)(smem + S.sQ);
    const int64_t t = blockIdx.x, H = a.H, d = TCB_D;
    const key_list L = keys_of(a, t);
    const int64_t row = row_seq(a.rows, t), B = a.rows.T / row_qn(a.rows);
    const int64_t win = row * a.rows.S + L.j0, ent = B * a.rows.S + row * a.nwin;
    for (int64_t k = threadIdx.x; k < L.nk; k += TCA_THREADS)
        kr[k] = (uint32_t)(k < L.nwk ? win + k : ent + (L.sel ? (int64_t)L.sel[k - L.nwk] : k - L.nwk));
    tca_stage_rows(sQ, a.q + t * H * d, H, d, S);
    __syncthreads();
    tcb_scores(lg, nullptr, sQ, nullptr, smem + S.sK, keys, kr, L.nk, 1.0f / sqrtf((float)d), S);
    const int64_t nkp = tca_up(L.nk, TCA_KC);
    for (int64_t h = threadIdx.x >> 5; h < H; h += TCA_WARPS) {
        float mx;
        (void)tca_softmax_row(lg + h * S.nkp, sP + h * S.LP, L.nk, nkp, a.sink[h], &mx);
    }
    __syncthreads();
    if (itgt) {
        for (int64_t i = threadIdx.x; i < a.sel_stride; i += TCA_THREADS) {
            float acc = 0;
            if (L.nwk + i < L.nk)
                for (int64_t h = 0; h < H; h++) acc += lg[h * S.nkp + L.nwk + i];
            itgt[t * a.sel_stride + i] = acc;
        }
        __syncthreads(); // product 3's ring may take the logits' bytes
    }
    tcb_weighted_sum(a.o + t * H * d, H, sP, smem + S.sKT, keys, kr, L.nk, false, S);
}

// The indexer-KL target of row t's pick i (one warp each): every head's probability of the pick, recomputed with the
// attention kernel's arithmetic from its max and denominator (so the same bits), added in head order from 0 as the
// CPU; 0 past the picks. Recomputing one logit per (pick, head) costs far less memory than keeping [T, H, picks].
__global__ void __launch_bounds__(ATT_THREADS) itgt_kernel(att_args a, float *itgt) {
    const int64_t x = (int64_t)blockIdx.x * (ATT_THREADS / 32) + (threadIdx.x >> 5), T = a.rows.T;
    const int lane = threadIdx.x & 31;
    if (x >= T * a.sel_stride) return; // whole warps
    const int64_t t = x / a.sel_stride, i = x % a.sel_stride, d = a.d;
    float acc = 0;
    if (i < a.nsel[t]) {
        const key_list L = keys_of(a, t);
        const float *key = L.at(a.kv, L.nwk + i);
        const float scale = 1.0f / sqrtf((float)d);
        for (int64_t h = 0; h < a.H; h++) {
            const float *q = a.q + (t * a.H + h) * d;
            float dot = 0;
            for (int64_t c = lane; c < d; c += 32) dot = fmaf(q[c], key[c], dot);
            dot = ds4d_warp_sumf(dot) * scale;
            const float e = (float)exp((double)(dot - a.smx[t * a.H + h]));
            acc += (float)(e / a.sden[t * a.H + h]);
        }
    }
    if (lane == 0) itgt[x] = acc;
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
    /* a step launches a bound of its jobs (each sequence completes at most n/m + 1 windows; blocks past the real count,
     * read on the device, exit), so that the launch does not depend on the step's positions */
    const int64_t jobs = a->rows.pos ? a->rows.T / a->w->rate + a->rows.nseq : a->B * a->nwin;
    if (jobs <= 0) return;
    const ds4_compressor_w *w = a->w;
    if (!ds4_cuda_fq_shape_ok(d, "compress", w->dd, a->q)) return;
    if (w->rate > DS4_MAX_RATE) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "compress: rate %lld > %d", (long long)w->rate, DS4_MAX_RATE);
        return;
    }
    comp_args g = {a->C, a->Z, w->ape, w->norm, a->out, a->pool, w->rate, w->dd, w->width, a->rows.S, a->nwin,
                   a->overlap, a->which, a->cls, a->rows, a->rt.cs, a->rt.half, a->c->rms_norm_eps, a->q};
    compress_kernel<<<(unsigned)jobs, 128, (size_t)w->dd * sizeof(float), cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "compress", "[%lld entries of %lld, rate %lld%s%s]", (long long)jobs, (long long)w->dd,
                      (long long)w->rate, a->rows.pos ? ", step" : "", a->q.fmt || a->q.hadamard ? ", kv_qat" : "");
}

void ds4_cuda_indexer(ds4_dev *d, const ds4_a_indexer *a) {
    const int64_t T = a->rows.T;
    if (T <= 0) return;
    const ds4_config *c = a->c;
    if (a->nwin == 0 && !a->rows.pos) {
        ds4_dev_fill(d, a->nsel, 0, (size_t)T * sizeof(int32_t));
        return;
    }
    const int64_t maxv = a->rows.pos ? a->rows.cap / c->compress_rate_csa : a->nwin; /* a step: from the capacity */
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
    if (smem > 48 * 1024 && smem > cdev(d)->smem_idx) { /* raised once per size, not per launch */
        cudaFuncSetAttribute(indexer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        cdev(d)->smem_idx = smem;
    }
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

// The bf16 mode's attention of a full forward at d = 128: bf16 copies of the keys and the entries (scratch), then
// attention_tcb_kernel.
static void attention_tcb(ds4_dev *d, const ds4_a_attention *a, int64_t maxk, int64_t m) {
    const ds4_config *c = a->c;
    const int64_t T = a->rows.T, H = c->num_attention_heads, B = a->rows.T / (a->rows.qn ? a->rows.qn : a->rows.S);
    const int64_t S = a->rows.S, nwin = a->type == DS4_ATTN_SLIDING ? 0 : a->nwin;
    const size_t smem = tcb_layout_of(H, maxk, 0).bytes;
    if (smem > cdev(d)->smem_optin || T > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED,
                     "attention (bf16): %lld queries, %lld keys per query x %lld heads x %d need %zu bytes of shared "
                     "memory (<= %zu)",
                     (long long)T, (long long)maxk, (long long)H, TCB_D, smem, cdev(d)->smem_optin);
        return;
    }
    if (smem > 48 * 1024 && smem > cdev(d)->smem_attn_tcb) {
        const cudaError_t e =
            cudaFuncSetAttribute(attention_tcb_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            ds4_dev_fail(d, DS4_ERR_CUDA, "attention (bf16): shared memory limit %zu: %s", smem, cudaGetErrorString(e));
            return;
        }
        cdev(d)->smem_attn_tcb = smem;
    }
    // [B·S, 128] keys, then [B, nwin, 128] entries; row numbers are uint32
    if (B * S + B * nwin > 0xffffffffll) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention (bf16): %lld key rows", (long long)(B * S + B * nwin));
        return;
    }
    auto *kv16 = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)((B * S + B * nwin) * TCB_D) * 2, "attention", 0);
    if (!kv16) return;
    __nv_bfloat16 *cK16 = kv16 + B * S * TCB_D;
    if (!ds4_cuda_rows_to_bf16(d, "attention", kv16, TCB_D, a->kv, TCB_D, 0, 1, B * S, TCB_D) ||
        (nwin && !ds4_cuda_rows_to_bf16(d, "attention", cK16, TCB_D, a->cK, TCB_D, S * TCB_D, B, nwin, TCB_D)))
        return;
    att_args g = {a->sink, a->q, a->kv, a->cK, a->o, NULL, NULL, a->rows, H, TCB_D, c->sliding_window, nwin, m,
                  a->sel_stride, maxk, (int)a->type, a->sel, a->nsel};
    attention_tcb_kernel<<<(unsigned)T, TCA_THREADS, smem, cdev(d)->stream>>>(g, kv16,
                                                                              a->type == DS4_ATTN_CSA ? a->itgt : NULL);
    ds4_cuda_launched(d, "attention", "[%lld queries, %lld heads x %d, <= %lld keys, %s, bf16 tensor cores, bf16 keys%s]",
                      (long long)T, (long long)H, TCB_D, (long long)maxk, ds4_attn_type_name(a->type),
                      a->type == DS4_ATTN_CSA && a->itgt ? ", indexer-KL target" : "");
}

// The bf16 mode's attention: every head of a row in one block (the indexer-KL target from the same block).
static void attention_tc(ds4_dev *d, const ds4_a_attention *a, int64_t maxk) {
    const ds4_config *c = a->c;
    const int64_t T = a->rows.T, H = c->num_attention_heads, dh = c->head_dim;
    const int64_t m = a->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
    const size_t smem = tca_layout_of(H, dh, maxk, 0).bytes;
    if (smem > cdev(d)->smem_optin) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED,
                     "attention (bf16): %lld keys per query x %lld heads x %lld need %zu bytes of shared memory (> %zu)",
                     (long long)maxk, (long long)H, (long long)dh, smem, cdev(d)->smem_optin);
        return;
    }
    if (T > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention (bf16): %lld queries", (long long)T);
        return;
    }
    const bool ref = cdev(d)->attn_ref;
    if (!ref && dh == TCB_D && !a->rows.pos) {
        attention_tcb(d, a, maxk, m);
        return;
    }
    auto kernel = ref ? attention_tc_kernel<true> : attention_tc_kernel<false>;
    if (smem > 48 * 1024 && smem > cdev(d)->smem_attn_tc) { /* raised once per size, not per launch */
        const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            ds4_dev_fail(d, DS4_ERR_CUDA, "attention (bf16): shared memory limit %zu: %s", smem, cudaGetErrorString(e));
            return;
        }
        cdev(d)->smem_attn_tc = smem;
    }
    att_args g = {a->sink, a->q, a->kv, a->cK, a->o, NULL, NULL, a->rows, H, dh, c->sliding_window, a->nwin, m,
                  a->sel_stride, maxk, (int)a->type, a->sel, a->nsel};
    kernel<<<(unsigned)T, TCA_THREADS, smem, cdev(d)->stream>>>(g, a->type == DS4_ATTN_CSA ? a->itgt : NULL);
    ds4_cuda_launched(d, "attention", "[%lld queries, %lld heads x %lld, <= %lld keys, %s, bf16 tensor cores%s%s]",
                      (long long)T, (long long)H, (long long)dh, (long long)maxk, ds4_attn_type_name(a->type),
                      a->type == DS4_ATTN_CSA && a->itgt ? ", indexer-KL target" : "", ref ? ", reference" : "");
}

void ds4_cuda_attention(ds4_dev *d, const ds4_a_attention *a) {
    const int64_t T = a->rows.T;
    if (T <= 0) return;
    const ds4_config *c = a->c;
    const int64_t S = a->rows.pos ? a->rows.cap : a->rows.S; /* a step: sized from the capacity, fixed while decoding */
    const int64_t win = c->sliding_window < S ? c->sliding_window : S, H = c->num_attention_heads;
    const int64_t m = a->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
    const int64_t maxk = win + (a->type == DS4_ATTN_HCA ? S / m : (a->type == DS4_ATTN_CSA ? a->sel_stride : 0));
    if (a->bf16_in) {
        attention_tc(d, a, maxk);
        return;
    }
    const size_t smem = (size_t)maxk * (sizeof(float) + sizeof(float *));
    if (smem > cdev(d)->smem_optin) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention: %lld keys per query need %zu bytes of shared memory (> %zu)",
                     (long long)maxk, smem, cdev(d)->smem_optin);
        return;
    }
    if (T * H > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attention: %lld queries x %lld heads", (long long)T, (long long)H);
        return;
    }
    if (smem > 48 * 1024 && smem > cdev(d)->smem_attn) { /* raised once per size, not per launch */
        cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        cdev(d)->smem_attn = smem;
    }
    /* the indexer-KL target sums the heads' masses on each pick: the (row, head) blocks keep their softmax's max and
     * denominator, and a second kernel adds the heads' probabilities of each pick in head order, so that no two
     * blocks add into one value */
    const int tgt = a->type == DS4_ATTN_CSA && a->itgt;
    float *smx = NULL;
    double *sden = NULL;
    if (tgt) {
        sden = (double *)ds4_cuda_scratch(d, (size_t)(T * H) * (sizeof(double) + sizeof(float)), "attention", 1);
        if (!sden) return;
        smx = (float *)(sden + T * H);
    }
    att_args g = {a->sink, a->q, a->kv, a->cK, a->o, smx, sden, a->rows, H, c->head_dim, c->sliding_window, a->nwin, m,
                  a->sel_stride, maxk, (int)a->type, a->sel, a->nsel};
    attention_kernel<<<(unsigned)(T * H), ATT_THREADS, smem, cdev(d)->stream>>>(g);
    if (!ds4_cuda_launched(d, "attention", "[%lld queries, %lld heads x %lld, <= %lld keys, %s]", (long long)T,
                           (long long)H, (long long)c->head_dim, (long long)maxk, ds4_attn_type_name(a->type)) ||
        !tgt)
        return;
    itgt_kernel<<<ds4_blocks(T * a->sel_stride, ATT_THREADS / 32), ATT_THREADS, 0, cdev(d)->stream>>>(g, a->itgt);
    ds4_cuda_launched(d, "attention", "[indexer-KL target of %lld queries x %lld picks, %lld heads]", (long long)T,
                      (long long)a->sel_stride, (long long)H);
}

void ds4_cuda_cache_commit(ds4_dev *d, const ds4_a_cache_commit *a) {
    if (a->rows.nseq <= 0) return;
    commit_args g = {a->kv, a->cC, a->cZ, a->iC, a->iZ, a->rows, a->c->head_dim, (int)a->type};
    for (int phase = 0; phase < 2; phase++) {
        commit_kernel<<<(unsigned)a->rows.nseq, 256, 0, cdev(d)->stream>>>(g, phase);
        if (!ds4_cuda_launched(d, "cache_commit", "[%lld sequences, phase %d]", (long long)a->rows.nseq, phase)) return;
    }
}
