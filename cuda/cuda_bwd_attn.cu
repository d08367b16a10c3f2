// cuda_bwd_attn.cu — the attention sub-layer's backward on the GPU, from a full forward's tape: attention with sink
// in three phases (per query, per window key, per compressed entry), the inverse of the CSA picks, RoPE of the
// entries, the compressor's pooling, and the indexer-KL loss (the `ikl` op, also used by the training forward) with
// its backward. core/cpu_attn_bwd.c and core/cpu_attn.c are the definitions; each kernel mirrors their arithmetic
// (fp32 products, double where they use double).
//
// Determinism: no floating-point atomics. A gradient that several queries feed is gathered by its owner over its
// contributors in query order: a window key over the queries j .. j+win-1, an HCA entry over the queries that see
// it, a CSA entry (main or indexer) over the inverse pick lists, which pick_inverse builds exactly as the CPU
// (queries in order; integer counts only). The attention's key gradients cut those lists into chunks of 64 queries
// added in parallel and folded in chunk order (an order fixed by the shapes, not the CPU's). The compressor's position-bias gradient is summed per element over
// (sequence, window) in order from the dZ the pooling backward wrote. Block reductions use fixed trees
// (ds4d_block_sum), so every launch gives the same bits.
#include <cstdio>

#include "cuda_attn_tc.cuh"
#include "cuda_dev.cuh"
#include "shape_limits.h"
extern "C" {
#include "sched.h" // ds4_layer_tape: a host struct of device pointers, read here and passed to kernels by value
}

namespace {

constexpr int BWD_THREADS = 128;

// Threads for a kernel whose block walks `width` channels: a multiple of 32, at most 256.
static int channel_threads(int64_t width) {
    const int64_t t = (width + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : (t > 256 ? 256 : t));
}

// Raise a kernel's dynamic shared memory limit when it needs more than the default 48 KiB (per device, so asked at
// every launch that needs it: the call is cheap and not a stream operation).
template <typename K> static bool smem_fits(ds4_dev *d, K kernel, size_t smem, const char *op, const char *what) {
    if (smem > cdev(d)->smem_optin) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %s need %zu bytes of shared memory, more than the %zu a block may have",
                     op, what, smem, cdev(d)->smem_optin);
        return false;
    }
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            ds4_dev_fail(d, DS4_ERR_CUDA, "%s: %s: shared memory limit %zu: %s", op, what, smem, cudaGetErrorString(e));
            return false;
        }
    }
    return true;
}

__device__ __forceinline__ int64_t clamp_picks(int32_t n, int64_t stride) {
    return n < 0 ? 0 : (n > stride ? stride : (int64_t)n);
}

// ------------------------------------------------------------------------------------------ attention

// T = B·qn query rows (q, dout, sel, P, DS, dq: query row t is position q0 + t % qn of sequence t / qn; without a
// query window q0 = 0 and qn = S); the key side (kv, dkv, cK, dK, inv_off) holds every sequence's S rows.
struct abwd_args {
    const float *q, *kv, *cK, *sink, *dout; // q, dout [T, H, d]; kv [B·S, d]; cK [B·S, d]; sink [H]
    const int32_t *sel, *nsel;              // [T, sel_stride], [T]
    float *P, *DS;                          // [T, H, maxk]
    float *dsink_t, *dq, *dkv, *dK;         // [T, H], [T, H, d], [B·S, d], [B·S, d]
    const int64_t *inv_off;                 // [B·S + 1]
    const int32_t *inv_t, *inv_i;           // [T·sel_stride]
    int64_t S, H, d, win, m, nwin, sel_stride, maxk, kmax;
    int64_t q0, qn;                         // the query window: positions [q0, q0 + qn) of each sequence
    int type;
    int bf16;                               // bf16_in: the products' operands rounded to bf16 (ops.h)
};

static abwd_args abwd_of(const ds4_a_attn_bwd *a) {
    const ds4_config *c = a->c;
    const ds4_layer_tape *lt = a->lt;
    abwd_args g;
    g.q = lt->q, g.kv = lt->kv, g.cK = lt->cK, g.sink = a->l->sink, g.dout = a->dout;
    g.sel = lt->sel, g.nsel = lt->nsel;
    g.P = a->P, g.DS = a->DS, g.dsink_t = a->dsink_t, g.dq = a->dq, g.dkv = a->dkv, g.dK = a->dK;
    g.inv_off = a->inv_off, g.inv_t = a->inv_t, g.inv_i = a->inv_i;
    g.S = a->S, g.H = c->num_attention_heads, g.d = c->head_dim, g.win = c->sliding_window;
    g.q0 = a->qn ? a->q0 : 0, g.qn = a->qn ? a->qn : a->S;
    g.m = a->l->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
    g.nwin = lt->nwin, g.sel_stride = a->sel_stride, g.maxk = a->maxk;
    // the longest key list: the window (at most S keys) and every causal entry (HCA) or every pick (CSA)
    const int64_t w = g.win < g.S ? g.win : g.S;
    g.kmax = w + (a->l->type == DS4_ATTN_HCA ? g.nwin : (a->l->type == DS4_ATTN_CSA ? g.sel_stride : 0));
    g.type = (int)a->l->type;
    g.bf16 = a->bf16_in;
    return g;
}

// Query t's key count and the address of its key k, in the forward's order: window keys j0..s (oldest first), then
// the compressed entries (HCA: every causal one; CSA: the picks in pick order).
struct bwd_keys {
    int64_t j0, nwk, nk;
};

// Query row t's position and sequence; the query row of position s of sequence row (s inside the window).
__device__ __forceinline__ int64_t q_pos(const abwd_args &a, int64_t t) { return a.q0 + t % a.qn; }
__device__ __forceinline__ int64_t q_seq(const abwd_args &a, int64_t t) { return t / a.qn; }
__device__ __forceinline__ int64_t q_row(const abwd_args &a, int64_t row, int64_t s) { return row * a.qn + s - a.q0; }
// The positions [lo, hi) clipped to the query window (lo >= hi: none)
__device__ __forceinline__ void q_clip(const abwd_args &a, int64_t *lo, int64_t *hi) {
    if (*lo < a.q0) *lo = a.q0;
    if (*hi > a.q0 + a.qn) *hi = a.q0 + a.qn;
}

__device__ __forceinline__ bwd_keys bwd_keys_of(const abwd_args &a, int64_t t) {
    const int64_t s = q_pos(a, t);
    bwd_keys L;
    L.j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
    L.nwk = s - L.j0 + 1;
    int64_t ne = 0;
    if (a.type == DS4_ATTN_HCA) {
        ne = (s + 1) / a.m;
        if (ne > a.nwin) ne = a.nwin;
    } else if (a.type == DS4_ATTN_CSA) {
        ne = clamp_picks(a.nsel[t], a.sel_stride);
    }
    L.nk = L.nwk + ne;
    return L;
}

__device__ __forceinline__ const float *bwd_key_at(const abwd_args &a, const bwd_keys &L, int64_t t, int64_t k) {
    const int64_t row = q_seq(a, t);
    if (k < L.nwk) return a.kv + (row * a.S + L.j0 + k) * a.d;
    const int64_t e = k - L.nwk;
    const int64_t w = a.type == DS4_ATTN_CSA ? (int64_t)a.sel[t * a.sel_stride + e] : e;
    return a.cK + (row * a.S + w) * a.d;
}

// Phase A, one block per (query, head). Logits and dout·key: warp w takes keys w, w+4, .., four at a time
// (lane-strided channels, a fixed butterfly; the same arithmetic as the forward kernel, so P is the forward's). Max,
// the denominator and Σ P·dp (double) over the block in a fixed tree. dq: thread c owns channel c and adds the keys in order.
__global__ void __launch_bounds__(BWD_THREADS) attn_bwd_q_kernel(abwd_args a) {
    extern __shared__ char smem[];
    const float **kp = (const float **)smem;  // [kmax] key pointers, resolved once
    float *lg = (float *)(kp + a.kmax);       // [kmax] logits, then probabilities
    float *dp = lg + a.kmax;                  // [kmax] dout·key, then logit gradients
    __shared__ double shd[BWD_THREADS / 32];
    __shared__ float shf[BWD_THREADS / 32];
    const int64_t t = blockIdx.x / a.H, h = blockIdx.x % a.H, d = a.d;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bwd_keys L = bwd_keys_of(a, t);
    const int64_t nk = L.nk;
    for (int64_t k = threadIdx.x; k < nk; k += BWD_THREADS) kp[k] = bwd_key_at(a, L, t, k);
    __syncthreads();
    const float *q = a.q + (t * a.H + h) * d, *g = a.dout + (t * a.H + h) * d;
    const float scale = 1.0f / sqrtf((float)d), sink = a.sink[h];
    float mx = sink;
    constexpr int NWARP = BWD_THREADS / 32, U = 4; // a warp's keys U at a time: independent chains and butterflies
    for (int64_t k0 = warp; k0 < nk; k0 += U * NWARP) {
        const float *key[U];
        float dot[U], dg[U];
#pragma unroll
        for (int u = 0; u < U; u++) key[u] = k0 + u * NWARP < nk ? kp[k0 + u * NWARP] : nullptr, dot[u] = dg[u] = 0;
        for (int64_t c = lane; c < d; c += 32) {
            const float qc = q[c], gc = g[c];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (key[u]) {
                    const float kc = key[u][c];
                    dot[u] = fmaf(qc, kc, dot[u]);
                    dg[u] = fmaf(gc, kc, dg[u]);
                }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (!key[u]) continue;
            dot[u] = ds4d_warp_sumf(dot[u]) * scale;
            dg[u] = ds4d_warp_sumf(dg[u]);
            if (lane == 0) lg[k0 + u * NWARP] = dot[u], dp[k0 + u * NWARP] = dg[u];
            mx = fmaxf(mx, dot[u]);
        }
    }
    if (lane == 0) shf[warp] = mx;
    __syncthreads();
    mx = shf[0];
    for (int w = 1; w < BWD_THREADS / 32; w++) mx = fmaxf(mx, shf[w]);
    // each thread revisits the keys it owns below (k ≡ threadIdx.x), so lg / dp need no barrier until dq
    double den = 0;
    for (int64_t k = threadIdx.x; k < nk; k += BWD_THREADS) den += (double)(lg[k] = (float)exp((double)(lg[k] - mx)));
    const double psink = exp((double)(sink - mx));
    den = ds4d_block_sum(den, shd) + psink;
    float *P = a.P + (t * a.H + h) * a.maxk, *DS = a.DS + (t * a.H + h) * a.maxk;
    double pdp = 0;
    for (int64_t k = threadIdx.x; k < nk; k += BWD_THREADS) {
        const float p = (float)(lg[k] / den);
        lg[k] = p;
        P[k] = p;
        pdp += (double)p * dp[k];
    }
    pdp = ds4d_block_sum(pdp, shd);
    if (threadIdx.x == 0) a.dsink_t[t * a.H + h] = (float)(-(psink / den) * pdp);
    for (int64_t k = threadIdx.x; k < nk; k += BWD_THREADS) {
        const float ds = (float)(lg[k] * ((double)dp[k] - pdp)) * scale;
        dp[k] = ds;
        DS[k] = ds;
    }
    __syncthreads();
    float *dq = a.dq + (t * a.H + h) * d;
    for (int64_t c = threadIdx.x; c < d; c += BWD_THREADS) {
        float acc = 0;
        for (int64_t k = 0; k < nk; k++) acc = fmaf(dp[k], kp[k][c], acc);
        dq[c] = acc;
    }
}

// The bf16 mode's middle of phase A, a warp per head row: the softmax of the logits lg (P), Σ P·dp against dout·key
// (dpv), the sink's gradient, P and DS to the tape and DS in bf16 into sP (dq's product takes it so).
__device__ __forceinline__ void tc_softmax_ds(const abwd_args &a, int64_t t, float *lg, const float *dpv,
                                              __nv_bfloat16 *sP, int64_t nk, float scale, const tca_layout &S) {
    const int lane = threadIdx.x & 31;
    const int64_t H = a.H, nkp = tca_up(nk, TCA_KC);
    for (int64_t h = threadIdx.x >> 5; h < H; h += TCA_WARPS) {
        float *l = lg + h * S.nkp, mx;
        const float *dp = dpv + h * S.nkp;
        __nv_bfloat16 *sd = sP + h * S.LP;
        const float sink = a.sink[h];
        const double den = tca_softmax_row(l, sd, nk, nkp, sink, &mx);
        double pdp = 0;
        for (int64_t k = lane; k < nk; k += 32) pdp += (double)l[k] * dp[k];
        pdp = ds4d_warp_sum(pdp);
        if (lane == 0) a.dsink_t[t * H + h] = (float)(-(exp((double)(sink - mx)) / den) * pdp);
        float *P = a.P + (t * H + h) * a.maxk, *DS = a.DS + (t * H + h) * a.maxk;
        for (int64_t k = lane; k < nkp; k += 32) {
            const float ds = k < nk ? (float)(l[k] * ((double)dp[k] - pdp)) * scale : 0.0f;
            if (k < nk) P[k] = l[k], DS[k] = ds;
            sd[k] = __float2bfloat16_rn(ds); // dq's product takes DS in bf16
        }
    }
}

// Phase A in the bf16 mode (bf16_in): one block per query, every head (cuda_attn_tc.cuh): the logits and dout·key
// from the forward's tensor-core product (so P is the forward's, bit for bit), the softmax, Σ P·dp and DS per head
// row (a warp each, double sums in a fixed butterfly), then dq = DS (bf16) · keys on the tensor cores.
// REF: the reference staging (DS4_CUDA_ATTN_REF=1), the same bits. At most 128 registers, so that
// 4 blocks fit an SM (the pipelined staging holds a chunk's loads in registers; 5 blocks would spill heavily).
template <bool REF>
__global__ void __launch_bounds__(TCA_THREADS, 4) attn_bwd_q_tc_kernel(abwd_args a) {
    extern __shared__ __align__(16) char smem[];
    const tca_layout S = tca_layout_of(a.H, a.d, a.kmax, 1);
    const float **kp = (const float **)(smem + S.kp);
    float *lg = (float *)(smem + S.lg), *dpv = (float *)(smem + S.dp_); // [Hp, nkp] each
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem + S.sP), *sQ = (__nv_bfloat16 *)(smem + S.sQ);
    __nv_bfloat16 *sG = (__nv_bfloat16 *)(smem + S.sG), *sK = (__nv_bfloat16 *)(smem + S.sK);
    __nv_bfloat16 *sKT = (__nv_bfloat16 *)(smem + S.sKT);
    const int64_t t = blockIdx.x, d = a.d, H = a.H;
    const bwd_keys L = bwd_keys_of(a, t);
    const int64_t nk = L.nk;
    for (int64_t k = threadIdx.x; k < nk; k += TCA_THREADS) kp[k] = bwd_key_at(a, L, t, k);
    tca_stage_rows(sQ, a.q + t * H * d, H, d, S);
    tca_stage_rows(sG, a.dout + t * H * d, H, d, S);
    __syncthreads();
    const float scale = 1.0f / sqrtf((float)d);
    tca_scores_sel<REF>(lg, dpv, sQ, sG, sK, kp, nk, d, scale, S);
    tc_softmax_ds(a, t, lg, dpv, sP, nk, scale, S);
    __syncthreads();
    tca_weighted_sum_sel<REF>(a.dq + t * H * d, H, d, sP, sKT, kp, nk, S);
}

// The same at d = 128, keys from bf16 copies (cuda_attn_tc.cuh's ring): keys [B·S + B·nwin, 128], kv's rows then
// each sequence's nwin entries. dq's first chunks are copied while the softmax and DS run. 2 blocks an SM (shared
// memory: about 88 KiB each at 16 heads and 384 keys).
__global__ void __launch_bounds__(TCA_THREADS, 2) attn_bwd_q_tcb_kernel(abwd_args a, const __nv_bfloat16 *keys) {
    extern __shared__ __align__(128) char smem[];
    const tca_layout S = tcb_layout_of(a.H, a.kmax, 1);
    uint32_t *kr = (uint32_t *)(smem + S.kp);
    float *lg = (float *)(smem + S.lg), *dpv = (float *)(smem + S.dp_); // [Hp, nkp] each
    __nv_bfloat16 *sP = (__nv_bfloat16 *)(smem + S.sP), *sQ = (__nv_bfloat16 *)(smem + S.sQ);
    __nv_bfloat16 *sG = (__nv_bfloat16 *)(smem + S.sG);
    char *ring = smem + S.sK;
    const int64_t t = blockIdx.x, d = TCB_D, H = a.H;
    const bwd_keys L = bwd_keys_of(a, t);
    const int64_t nk = L.nk, row = q_seq(a, t), B = gridDim.x / a.qn;
    const int64_t win = row * a.S + L.j0, ent = B * a.S + row * a.nwin;
    for (int64_t k = threadIdx.x; k < nk; k += TCA_THREADS) {
        const int64_t e = k - L.nwk;
        kr[k] = (uint32_t)(k < L.nwk ? win + k
                                     : ent + (a.type == DS4_ATTN_CSA ? (int64_t)a.sel[t * a.sel_stride + e] : e));
    }
    tca_stage_rows(sQ, a.q + t * H * d, H, d, S);
    tca_stage_rows(sG, a.dout + t * H * d, H, d, S);
    __syncthreads();
    const float scale = 1.0f / sqrtf((float)d);
    tcb_scores(lg, dpv, sQ, sG, ring, keys, kr, nk, scale, S);
    tcb_prime(ring, keys, kr, nk);
    tc_softmax_ds(a, t, lg, dpv, sP, nk, scale, S);
    __syncthreads();
    tcb_weighted_sum(a.dq + t * H * d, H, sP, ring, keys, kr, nk, true, S);
}

// v rounded to bf16 (nearest even) where the bf16 mode rounds a product's operands, else v
__device__ __forceinline__ float kg_op(const abwd_args &a, float v) {
    return a.bf16 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
}

// acc += Σ_h (DS·q_h + P·dout_h)[c] of query t at its key-list position kidx, heads in order (the CPU's key_grad_from)
__device__ __forceinline__ float key_grad(const abwd_args &a, int64_t t, int64_t kidx, int64_t c, float acc) {
    const float *DS = a.DS + t * a.H * a.maxk + kidx, *P = a.P + t * a.H * a.maxk + kidx;
    const float *q = a.q + t * a.H * a.d + c, *g = a.dout + t * a.H * a.d + c;
    for (int64_t h = 0; h < a.H; h++) {
        acc = fmaf(kg_op(a, DS[h * a.maxk]), kg_op(a, q[h * a.d]), acc);
        acc = fmaf(kg_op(a, P[h * a.maxk]), kg_op(a, g[h * a.d]), acc);
    }
    return acc;
}

// Phases B1 and B2: a key's gradient is a sum over the queries that saw it (heads in order within a query). The
// list is cut into chunks of KEY_QCHUNK queries, one block per (key, chunk) adds its chunk in query order into a
// partial, and a fold adds the partials in chunk order: a fixed order set by the shapes (the same bits every run),
// instead of one thread walking up to S queries one after another.
constexpr int KEY_QCHUNK = 64;

// B1 (kind 0): window key tk = token j of its sequence, seen by the queries j .. j+win-1. B2 (kind 1): complete
// entry w of sequence `row`: HCA the queries s >= (w+1)·m - 1 in order; CSA the queries that picked it, from the
// inverse lists (query order). With a query window only its queries count (the CSA lists hold only those). key_list
// gives the list's length; key_item its i-th query row and the key's place in that query's key list.
// key_span: window keys and HCA entries, the positions [lo, lo + n) of their queries
__device__ __forceinline__ int64_t key_span(const abwd_args &a, int kind, int64_t key, int64_t *lo) {
    int64_t hi;
    if (kind == 0) {
        const int64_t j = key % a.S;
        *lo = j, hi = j + a.win < a.S ? j + a.win : a.S;
    } else {
        *lo = (key % a.nwin + 1) * a.m - 1, hi = a.S;
    }
    q_clip(a, lo, &hi);
    return hi > *lo ? hi - *lo : 0;
}

__device__ __forceinline__ int64_t key_list(const abwd_args &a, int kind, int64_t key) {
    int64_t lo;
    if (kind == 0 || a.type == DS4_ATTN_HCA) return key_span(a, kind, key, &lo);
    const int64_t row = key / a.nwin, w = key % a.nwin, x = row * a.S + w;
    return a.inv_off[x + 1] - a.inv_off[x];
}

__device__ __forceinline__ void key_item(const abwd_args &a, int kind, int64_t key, int64_t i, int64_t *t,
                                         int64_t *kidx) {
    int64_t lo;
    if (kind == 0) {
        key_span(a, kind, key, &lo);
        const int64_t row = key / a.S, j = key % a.S, s = lo + i;
        const int64_t j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
        *t = q_row(a, row, s), *kidx = j - j0;
        return;
    }
    const int64_t row = key / a.nwin, w = key % a.nwin;
    if (a.type == DS4_ATTN_HCA) {
        key_span(a, kind, key, &lo);
        const int64_t s = lo + i, j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
        *t = q_row(a, row, s), *kidx = (s - j0 + 1) + w;
        return;
    }
    const int64_t at = a.inv_off[row * a.S + w] + i, tt = a.inv_t[at], s = q_pos(a, tt);
    const int64_t j0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0;
    *t = tt, *kidx = (s - j0 + 1) + a.inv_i[at];
}

// one block per (key, chunk): part[(key·nch + chunk), c] = the chunk's queries added in order (0 for an empty chunk)
__global__ void key_grad_part_kernel(abwd_args a, int kind, int64_t nch, float *part) {
    const int64_t key = blockIdx.x / nch, ch = blockIdx.x % nch;
    const int64_t n = key_list(a, kind, key), i0 = ch * KEY_QCHUNK, i1 = i0 + KEY_QCHUNK < n ? i0 + KEY_QCHUNK : n;
    for (int64_t c = threadIdx.x; c < a.d; c += blockDim.x) {
        float acc = 0;
        for (int64_t i = i0; i < i1; i++) {
            int64_t t, kidx;
            key_item(a, kind, key, i, &t, &kidx);
            acc = key_grad(a, t, kidx, c, acc);
        }
        part[blockIdx.x * a.d + c] = acc;
    }
}

// B1 for a group of WIN_KEYS consecutive window keys j0 .. j0 + WIN_KEYS - 1 of sequence `row` and one chunk index:
// key j's chunk ch is the queries s = f + 64·ch .. (f: j, or the query window's first position if later; i = s - f in
// its list), so the group's chunks cover nearly the
// same queries, and key_grad_part_kernel read each query's q and dout rows once per key (the pass was bound by those
// reads). Here the block walks the union of the group's queries in order, reads q and dout of a (query, head) once
// and adds them into every key of the group whose chunk holds the query: each key's partial gets its queries in
// order and, per query, the heads in order (DS then P), the sums key_grad_part_kernel forms: the same bits.
constexpr int WIN_KEYS = 16;

__global__ void key_grad_win_kernel(abwd_args a, int64_t groups, int64_t nch, float *part) {
    const int64_t ch = blockIdx.x % nch, grp = blockIdx.x / nch, row = grp / groups;
    const int64_t j0 = (grp % groups) * WIN_KEYS, S = a.S;
    const int nkey = (int)(S - j0 < WIN_KEYS ? S - j0 : WIN_KEYS);
    int64_t lo[WIN_KEYS], hi[WIN_KEYS]; // key j0 + u's chunk: queries [lo, hi) (empty: lo >= hi)
    int64_t s0 = INT64_MAX, s1 = 0;
#pragma unroll
    for (int u = 0; u < WIN_KEYS; u++) {
        int64_t f = 0; // the key's first query position (the query window's first, if later)
        const int64_t n = u < nkey ? key_span(a, 0, row * S + j0 + u, &f) : 0;
        lo[u] = f + ch * KEY_QCHUNK;
        hi[u] = f + (ch * KEY_QCHUNK + KEY_QCHUNK < n ? ch * KEY_QCHUNK + KEY_QCHUNK : n);
        if (lo[u] < hi[u]) s0 = lo[u] < s0 ? lo[u] : s0, s1 = hi[u] > s1 ? hi[u] : s1;
    }
    for (int64_t c = threadIdx.x; c < a.d; c += blockDim.x) {
        float acc[WIN_KEYS];
#pragma unroll
        for (int u = 0; u < WIN_KEYS; u++) acc[u] = 0.0f;
        for (int64_t s = s0; s < s1; s++) {
            const int64_t t = q_row(a, row, s), q0 = s - a.win + 1 > 0 ? s - a.win + 1 : 0; // q0: its first key
            const float *DS = a.DS + t * a.H * a.maxk, *P = a.P + t * a.H * a.maxk;
            const float *q = a.q + t * a.H * a.d + c, *g = a.dout + t * a.H * a.d + c;
            for (int64_t h = 0; h < a.H; h++) {
                const float qv = kg_op(a, q[h * a.d]), gv = kg_op(a, g[h * a.d]);
#pragma unroll
                for (int u = 0; u < WIN_KEYS; u++)
                    if (s >= lo[u] && s < hi[u]) {
                        const int64_t kidx = j0 + u - q0;
                        acc[u] = fmaf(kg_op(a, DS[h * a.maxk + kidx]), qv, acc[u]);
                        acc[u] = fmaf(kg_op(a, P[h * a.maxk + kidx]), gv, acc[u]);
                    }
            }
        }
#pragma unroll
        for (int u = 0; u < WIN_KEYS; u++)
            if (u < nkey) part[((row * S + j0 + u) * nch + ch) * a.d + c] = acc[u];
    }
}

// B1 and B2 in the bf16 mode on the tensor cores. A block takes KGT consecutive keys of one sequence (kind 0: window
// keys j0..; kind 1: complete entries w0..), KGC channels and a chunk of qc queries of the tile's range (kind 0:
// s = j0 .. j0 + KGT - 2 + win, those that see any of the keys; kind 1: from the first query the first entry is
// complete for to S - 1), one query at a time in order:
//   dk[key, c] += Σ_h DS[s, h, kidx]·q[s, h, c], then += Σ_h P[s, h, kidx]·dout[s, h, c]
// as m16n8k16 products per 16 heads (rows: keys, k: heads, columns: channels) of DS, P, q and dout rounded to bf16,
// fp32 sums; kidx is the key's place in query s's key list, and a key the query does not see (a window key before its
// window or after s; an entry not complete yet (HCA) or not picked (CSA, through the inverse pick lists, walked in
// query order by the thread that stages that key)) has zeros there. Each key's sum takes its queries in order, per
// query DS·q then P·dout, heads 16 at a time in order; with one chunk it is the key's gradient, with several the
// chunks' partials are added in chunk order by key_grad_fold_kernel: a fixed order set by the shapes, so the same bits
// every run. 8 warps: warp w the 16 keys w & 3 and the 64 channels w >> 2. The operands of the next G queries are
// loaded to registers while the current G are multiplied, then stored into the other of two shared-memory buffers
// (G query slots each): one barrier per G queries. G = 1 (with TASKS = KG_MAXTASK) is the reference
// (DS4_CUDA_ATTN_REF=1): a query's loads then waited out one barrier each, and the pass (one block per SM at most, a
// few hundred queries in a row) was bound by that latency. G changes when a query's operands are loaded, not what is
// multiplied or in which order: the same bits. Needs H <= KG_MAXH and d a multiple of 8.
// Queries per chunk: a window tile's range is KGT - 1 + win queries (191 at win 128: one chunk of KGQ_WIN, no fold);
// an entry tile's is the rest of the sequence, and its tiles are few (HCA at m = 128: one tile a sequence of 1024
// tokens, so 8 × 1024 made 8 tiles × 4 chunks of 256 = 32 blocks for 132 SMs), so entries take chunks of KGQ_ENT:
// 128 blocks there, and one H200 step's attn_bwd_entry 5.35 → 3.26 ms. Smaller window chunks were slower (64: 4.14 →
// 4.86 ms; each block stages the same operands per query, only the blocks grow). Both depend on the shapes alone.
constexpr int KGT = 64, KGC = 128, KGQ_WIN = 256, KGQ_ENT = 64, KG_THREADS = 256, KG_MAXH = 32;
constexpr int KG_MAXTASK = (2 * KGT + 2 * KGC) * (KG_MAXH / 8) / KG_THREADS; // 8-value loads per thread and query
static_assert(KG_THREADS % KGT == 0, "a thread's A loads are all of one key (its inverse-list walk)");

// 8-value loads per thread and query for H heads (TASKS of the kernel must be at least this)
__host__ __device__ inline int kg_tasks(int64_t H) {
    const int64_t hg = (H + 15) / 16 * 2;
    return (int)(((2 * KGT + 2 * KGC) * hg + KG_THREADS - 1) / KG_THREADS);
}

struct kg_tc_layout {
    int Hp, LH;         // heads padded to 16; staged row length (Hp + 8 bf16: a quarter-warp's fragment reads of
                        // rows g = 0..7 at the same head land on distinct banks)
    int64_t na, nb;     // one query slot's A [2][KGT][LH] and B [2][KGC][LH] (bf16 elements)
    size_t bytes;       // two buffers of G slots
};

__host__ __device__ inline kg_tc_layout kg_tc_layout_of(int64_t H, int G) {
    kg_tc_layout L;
    L.Hp = (int)((H + 15) / 16 * 16), L.LH = L.Hp + 8;
    L.na = 2 * KGT * L.LH, L.nb = 2 * KGC * L.LH;
    L.bytes = (size_t)(2 * G * (L.na + L.nb)) * sizeof(__nv_bfloat16);
    return L;
}

// The keys of one sequence (kind 0: S window keys; kind 1: nwin entries) and the positions of the queries that may
// see the tile at k0 (within the query window).
__device__ __forceinline__ int64_t kg_nkeys(const abwd_args &a, int kind) { return kind == 0 ? a.S : a.nwin; }
__device__ __forceinline__ void kg_range(const abwd_args &a, int kind, int64_t k0, int64_t *lo, int64_t *hi) {
    if (kind == 0) {
        *lo = k0, *hi = k0 + KGT - 1 + a.win < a.S ? k0 + KGT - 1 + a.win : a.S;
    } else {
        const int64_t f = (k0 + 1) * a.m - 1;
        *lo = f < a.S ? f : a.S, *hi = a.S;
    }
    q_clip(a, lo, hi);
}

template <int G, int TASKS>
__global__ void __launch_bounds__(KG_THREADS) key_grad_tc_kernel(abwd_args a, int kind, int64_t tiles, int64_t qc,
                                                                  float *part) {
    extern __shared__ __align__(16) char kg_mem[];
    const kg_tc_layout L = kg_tc_layout_of(a.H, G);
    __nv_bfloat16 *buf0 = reinterpret_cast<__nv_bfloat16 *>(kg_mem);
    const int64_t slot = L.na + L.nb, nkr = kg_nkeys(a, kind), row = blockIdx.x / tiles, k0 = (blockIdx.x % tiles) * KGT;
    const int64_t c0 = (int64_t)blockIdx.y * KGC, S = a.S, H = a.H, d = a.d, win = a.win;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int mt = warp & 3, cw = (warp >> 2) * 64; // this warp's 16 keys and 64 channels
    const int HG = L.Hp / 8, na = 2 * KGT * HG, nt = na + 2 * KGC * HG; // load tasks per query: A, then B
    int64_t s_lo, s_hi;
    kg_range(a, kind, k0, &s_lo, &s_hi);
    s_lo += (int64_t)blockIdx.z * qc;
    if (s_hi > s_lo + qc) s_hi = s_lo + qc;
    // CSA entries: this thread's key (every A load of it is of key k0 + tid % KGT) and its walk of the inverse list
    const int64_t mykey = k0 + tid % KGT;
    int64_t cur = 0, end = 0;
    const bool csa = kind == 1 && a.type == DS4_ATTN_CSA;
    if (csa && mykey < nkr && s_lo < s_hi) {
        cur = a.inv_off[row * S + mykey], end = a.inv_off[row * S + mykey + 1];
        const int64_t t_lo = q_row(a, row, s_lo);
        int64_t lo = cur, hi = end; // the first pair of a query at or after s_lo (the list is in query order)
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (a.inv_t[mid] < t_lo) lo = mid + 1;
            else hi = mid;
        }
        cur = lo;
    }
    float pre[G][TASKS][8];
    // Task i of query s: A (i < na): DS or P of 8 heads at key k0 + kk; B: q or dout of 8 heads at channel c0 + cc.
    // kidx: this thread's key's place in query s's key list, or -1: not seen.
    auto load = [&](int64_t s, int64_t kidx, float (&p)[TASKS][8]) {
        const int64_t t = q_row(a, row, s);
#pragma unroll
        for (int u = 0; u < TASKS; u++) {
            const int i = tid + u * KG_THREADS;
            if (i >= nt) break;
            if (i < na) {
                const int hg = (i / KGT) % HG, op = i / (KGT * HG);
                const float *M = (op ? a.P : a.DS) + t * H * a.maxk + (kidx >= 0 ? kidx : 0);
#pragma unroll
                for (int v = 0; v < 8; v++) {
                    const int64_t h = hg * 8 + v;
                    p[u][v] = kidx >= 0 && h < H ? M[h * a.maxk] : 0.0f;
                }
            } else {
                const int k = i - na, cc = k % KGC, hg = (k / KGC) % HG, op = k / (KGC * HG);
                const int64_t c = c0 + cc;
                const float *X = (op ? a.dout : a.q) + t * H * d + (c < d ? c : 0);
#pragma unroll
                for (int v = 0; v < 8; v++) {
                    const int64_t h = hg * 8 + v;
                    p[u][v] = c < d && h < H ? X[h * d] : 0.0f;
                }
            }
        }
    };
    auto store = [&](__nv_bfloat16 *b, const float (&p)[TASKS][8]) {
#pragma unroll
        for (int u = 0; u < TASKS; u++) {
            const int i = tid + u * KG_THREADS;
            if (i >= nt) break;
            int64_t at;
            if (i < na) at = ((int64_t)(i / (KGT * HG)) * KGT + i % KGT) * L.LH + ((i / KGT) % HG) * 8;
            else {
                const int k = i - na;
                at = L.na + ((int64_t)(k / (KGC * HG)) * KGC + k % KGC) * L.LH + ((k / KGC) % HG) * 8;
            }
            const uint4 w = make_uint4(ds4d_pack_bf16(p[u][0], p[u][1]), ds4d_pack_bf16(p[u][2], p[u][3]),
                                       ds4d_pack_bf16(p[u][4], p[u][5]), ds4d_pack_bf16(p[u][6], p[u][7]));
            *reinterpret_cast<uint4 *>(b + at) = w;
        }
    };
    // the G queries from s0 (those before s_hi): load them, or store them into buffer b. Groups come in query order:
    // CSA entries take the next G pairs of the key's inverse list at once (a query picks a key at most once, so the
    // group's pairs are among them) and step past those of the group.
    auto load_group = [&](int64_t s0) {
        int64_t it[G], ii[G];
        if (csa) {
            int n = 0;
#pragma unroll
            for (int j = 0; j < G; j++) {
                const bool in = cur + j < end;
                it[j] = in ? a.inv_t[cur + j] : -1, ii[j] = in ? a.inv_i[cur + j] : 0;
            }
#pragma unroll
            for (int j = 0; j < G; j++) n += it[j] >= 0 && it[j] < q_row(a, row, s0) + G;
            cur += n;
        }
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int64_t s = s0 + q, q0 = s - win + 1 > 0 ? s - win + 1 : 0, nwk = s - q0 + 1;
            if (s >= s_hi) break;
            int64_t kidx = -1;
            if (kind == 0) {
                if (mykey >= q0 && mykey <= s && mykey < S) kidx = mykey - q0;
            } else if (!csa) {
                if (mykey < nkr && (mykey + 1) * a.m - 1 <= s) kidx = nwk + mykey;
            } else {
#pragma unroll
                for (int j = 0; j < G; j++)
                    if (it[j] == q_row(a, row, s)) kidx = nwk + ii[j];
            }
            load(s, kidx, pre[q]);
        }
    };
    auto store_group = [&](int64_t s0, __nv_bfloat16 *b) {
#pragma unroll
        for (int q = 0; q < G; q++)
            if (s0 + q < s_hi) store(b + q * slot, pre[q]);
    };
    float acc[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const int64_t kw = k0 + mt * 16; // this warp's first key
    int cb = 0;
    if (s_lo < s_hi) {
        load_group(s_lo);
        store_group(s_lo, buf0);
    }
    __syncthreads();
    for (int64_t s0 = s_lo; s0 < s_hi; s0 += G) {
        const bool more = s0 + G < s_hi;
        if (more) load_group(s0 + G);
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int64_t s = s0 + q;
            if (s >= s_hi) break;
            // whether query s may see one of the warp's keys (window: its window meets them; HCA: the first is
            // complete; CSA: any may be picked)
            const int64_t q0 = s - win + 1 > 0 ? s - win + 1 : 0;
            const bool any = kw < nkr && (kind == 0 ? kw <= s && kw + 15 >= q0 : (csa || (kw + 1) * a.m - 1 <= s));
            if (!any) continue;
            const __nv_bfloat16 *A = buf0 + (cb * G + q) * slot, *B = A + L.na;
#pragma unroll
            for (int op = 0; op < 2; op++)
                for (int hc = 0; hc < L.Hp; hc += 16) {
                    const __nv_bfloat16 *ar = A + ((int64_t)op * KGT + mt * 16 + g) * L.LH + hc + 2 * t4;
                    const uint32_t a0 = *reinterpret_cast<const uint32_t *>(ar);
                    const uint32_t a1 = *reinterpret_cast<const uint32_t *>(ar + 8 * L.LH);
                    const uint32_t a2 = *reinterpret_cast<const uint32_t *>(ar + 8);
                    const uint32_t a3 = *reinterpret_cast<const uint32_t *>(ar + 8 * L.LH + 8);
#pragma unroll
                    for (int n = 0; n < 8; n++) {
                        const __nv_bfloat16 *br = B + ((int64_t)op * KGC + cw + n * 8 + g) * L.LH + hc + 2 * t4;
                        ds4d_mma_bf16(acc[n], a0, a1, a2, a3, *reinterpret_cast<const uint32_t *>(br),
                                      *reinterpret_cast<const uint32_t *>(br + 8));
                    }
                }
        }
        if (more) store_group(s0 + G, buf0 + (cb ^ 1) * G * slot);
        __syncthreads(); // the next buffer is whole, and nobody reads this one when the next group's store takes it
        cb ^= 1;
    }
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const int64_t c = c0 + cw + n * 8 + 2 * t4;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t key = kw + g + 8 * h;
            if (key >= nkr) continue;
            float *o;
            if (part) o = part + ((row * nkr + key) * gridDim.z + blockIdx.z) * d + c;
            else o = kind == 0 ? a.dkv + (row * S + key) * d + c : a.dK + (row * S + key) * d + c;
            if (c < d) o[0] = acc[n][2 * h];
            if (c + 1 < d) o[1] = acc[n][2 * h + 1];
        }
    }
}

// out row of key = 0 + part(chunk 0) + part(chunk 1) + ... (window keys: dkv[tk]; entries: dK[row·S + w])
__global__ void key_grad_fold_kernel(abwd_args a, int kind, int64_t nkeys, int64_t nch, const float *part) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nkeys * a.d) return;
    const int64_t key = i / a.d, c = i % a.d;
    float s = 0;
    for (int64_t ch = 0; ch < nch; ch++) s += part[(key * nch + ch) * a.d + c];
    if (kind == 0) a.dkv[key * a.d + c] = s;
    else a.dK[((key / a.nwin) * a.S + key % a.nwin) * a.d + c] = s;
}

// ------------------------------------------------------------------------------------------ inverse picks

// The picks of a sequence (its qn query rows: all S, or a query window's), cut into chunks of qc queries; hist
// [B, nch, S] counts, per chunk, the picks of each entry
// and then holds where the chunk's part of each entry's list starts. Counting uses integer atomics (exact in any
// order); the fill walks a chunk's queries in order with a barrier between them, so each list is in query order.
struct pinv_args {
    const int32_t *sel, *nsel;
    int32_t *hist;
    int64_t *inv_off;
    int32_t *inv_t, *inv_i;
    int64_t sel_stride, T, S, qn, nch, qc;
};

__device__ __forceinline__ bool valid_pick(int32_t w, int64_t S) { return w >= 0 && w < S; }

// Pass 0, one block per (sequence, chunk): counts. Pass 1 (fill), the same blocks: the slots, query by query.
__global__ void pick_inverse_chunk_kernel(pinv_args a, int pass) {
    const int64_t row = blockIdx.x / a.nch, ch = blockIdx.x % a.nch;
    int32_t *hc = a.hist + (int64_t)blockIdx.x * a.S;
    const int64_t s0 = ch * a.qc, s1 = s0 + a.qc < a.qn ? s0 + a.qc : a.qn;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t t = row * a.qn + s;
        if (t >= a.T) break;
        const int64_t n = clamp_picks(a.nsel[t], a.sel_stride);
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const int32_t w = a.sel[t * a.sel_stride + i];
            if (!valid_pick(w, a.S)) continue;
            if (pass == 0) {
                atomicAdd(&hc[w], 1);
            } else { // a query's picks are distinct: the atomic only guards against invalid (repeated) picks
                const int64_t slot = a.inv_off[row * a.S + w] + atomicAdd(&hc[w], 1);
                a.inv_t[slot] = (int32_t)t;
                a.inv_i[slot] = (int32_t)i;
            }
        }
        if (pass == 1) __syncthreads(); // query s's slots are taken before query s+1's
    }
}

// Per entry x = (sequence, w): the chunks' counts become their exclusive prefix (in chunk order), the total goes to
// inv_off[x + 1].
__global__ void pick_inverse_cols_kernel(pinv_args a, int64_t n) {
    const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (x == 0) a.inv_off[0] = 0;
    if (x >= n) return;
    const int64_t row = x / a.S, w = x % a.S;
    int32_t run = 0;
    for (int64_t ch = 0; ch < a.nch; ch++) {
        int32_t *h = a.hist + (row * a.nch + ch) * a.S + w;
        const int32_t v = *h;
        *h = run;
        run += v;
    }
    a.inv_off[x + 1] = run;
}

// One block: inclusive scan of inv_off[1 .. n] in place (each thread a contiguous segment; integers, so exact).
constexpr int SCAN_THREADS = 1024;
__global__ void __launch_bounds__(SCAN_THREADS) pick_inverse_scan_kernel(int64_t *v, int64_t n) {
    __shared__ int64_t part[SCAN_THREADS];
    const int64_t per = (n + SCAN_THREADS - 1) / SCAN_THREADS, b = threadIdx.x * per;
    const int64_t e = b + per < n ? b + per : n;
    int64_t sum = 0;
    for (int64_t i = b; i < e; i++) sum += v[1 + i];
    part[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t run = 0;
        for (int i = 0; i < SCAN_THREADS; i++) {
            const int64_t x = part[i];
            part[i] = run;
            run += x;
        }
    }
    __syncthreads();
    int64_t run = part[threadIdx.x];
    for (int64_t i = b; i < e; i++) v[1 + i] = (run += v[1 + i]);
}

// ------------------------------------------------------------------------------------------ entries

__global__ void entry_rope_kernel(float *x, int64_t S, int64_t nwin, int64_t dd, int64_t m, const float *cs, int64_t half,
                                  int sign, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t e = i / half, j = i % half, row = e / nwin, w = e % nwin;
    ds4d_rope_pair(x + (row * S + w) * dd + dd - 2 * half, cs + w * m * 2 * half, j, sign);
}

// ------------------------------------------------------------------------------------------ compressor pooling

struct cbwd_args {
    const float *C, *Z, *ape, *dpool; // C, Z [T, width]; ape [m, width]; dpool [B·S, dd]
    float *dC, *dZ, *gape;
    int64_t m, dd, width, S, nwin;
    int overlap;
};

// Gate of slot k of window `win`, channel ch, and the slot's token, column and position j (previous-window rows
// first, their first halves; then this window's rows, their second halves with overlap), as the CPU lists them.
__device__ __forceinline__ float comp_gate(const cbwd_args &a, int64_t row, int64_t win, int64_t ch, int64_t nprev,
                                           int64_t k, int64_t *tok, int64_t *col) {
    int64_t j;
    if (k < nprev) {
        j = k, *tok = row * a.S + (win - 1) * a.m + k, *col = ch;
    } else {
        j = k - nprev, *tok = row * a.S + win * a.m + j, *col = (a.overlap ? a.dd : 0) + ch;
    }
    return a.Z[*tok * a.width + *col] + a.ape[j * a.width + *col];
}

// One thread per (sequence, window, channel), channels fastest (coalesced columns): the slot softmax recomputed as
// the forward (fp32 gates, double denominator), then dC = α·dp and dZ = α·(dp·kv − Σ α·dp·kv) (double) per slot.
// Every (token, column) pooled belongs to exactly one (window, channel), so the writes never overlap.
__global__ void comp_bwd_kernel(cbwd_args a, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t ch = i % a.dd, e = i / a.dd, row = e / a.nwin, win = e % a.nwin;
    const int64_t nprev = a.overlap && win > 0 ? a.m : 0, ns = nprev + a.m;
    int64_t tok, col;
    float mx = -INFINITY;
    for (int64_t k = 0; k < ns; k++) mx = fmaxf(mx, comp_gate(a, row, win, ch, nprev, k, &tok, &col));
    double den = 0;
    for (int64_t k = 0; k < ns; k++)
        den += (double)(float)exp((double)(comp_gate(a, row, win, ch, nprev, k, &tok, &col) - mx));
    const float dp = a.dpool[(row * a.S + win) * a.dd + ch];
    double adot = 0;
    for (int64_t k = 0; k < ns; k++) {
        const float ek = (float)exp((double)(comp_gate(a, row, win, ch, nprev, k, &tok, &col) - mx));
        const float al = (float)(ek / den);
        adot += (double)al * dp * a.C[tok * a.width + col];
    }
    for (int64_t k = 0; k < ns; k++) {
        const float ek = (float)exp((double)(comp_gate(a, row, win, ch, nprev, k, &tok, &col) - mx));
        const float al = (float)(ek / den), kv = a.C[tok * a.width + col];
        a.dC[tok * a.width + col] = al * dp;
        a.dZ[tok * a.width + col] = (float)(al * ((double)dp * kv - adot));
    }
}

// The position-bias gradient: gape[(j, col)] += the dZ of the slot (j, col) of every window, the windows listed
// sequence by sequence (p = row·nw + the window's place, nw windows a row). Columns below dd with overlap are
// previous-window slots: windows 1.. read the rows of window win-1. One thread per element walking all B·nw windows
// left 1024 threads (CSA at rate 4: 8 blocks) each adding 2048 values one after another; so the windows go in runs
// of APE_RUN, each run summed from 0 in order by a block row of its own (comp_bwd_ape_kernel, into part
// [runs, m·width]), then the runs added onto gape in run order (comp_bwd_ape_fold_kernel): a fixed order given the
// shapes (the CPU adds the windows one by one onto gape: within the rounding of test_cuda_bwd_attn's bound).
constexpr int64_t APE_RUN = 32;

__device__ __forceinline__ int64_t ape_windows(const cbwd_args &a, int64_t col, int64_t *w0) { // per row
    *w0 = a.overlap && col < a.dd ? 1 : 0;
    return a.nwin > *w0 ? a.nwin - *w0 : 0;
}

__global__ void comp_bwd_ape_kernel(cbwd_args a, int64_t B, float *part) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, mw = a.m * a.width;
    if (i >= mw) return;
    const int64_t j = i / a.width, col = i % a.width;
    int64_t w0;
    const int64_t nw = ape_windows(a, col, &w0), n = B * nw, p0 = blockIdx.y * APE_RUN;
    if (p0 >= n) return; // no run here (fewer windows in this column's rows): the fold stops before it
    const int64_t p1 = p0 + APE_RUN < n ? p0 + APE_RUN : n;
    float acc = 0.0f;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t row = p / nw, win = w0 + p % nw;
        acc += a.dZ[(row * a.S + (win - w0) * a.m + j) * a.width + col];
    }
    part[blockIdx.y * mw + i] = acc;
}

__global__ void comp_bwd_ape_fold_kernel(cbwd_args a, int64_t B, const float *part) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, mw = a.m * a.width;
    if (i >= mw) return;
    int64_t w0;
    const int64_t runs = (B * ape_windows(a, i % a.width, &w0) + APE_RUN - 1) / APE_RUN;
    float acc = a.gape[i];
    for (int64_t r = 0; r < runs; r++) acc += part[r * mw + i];
    a.gape[i] = acc;
}

// ------------------------------------------------------------------------------------------ indexer KL

struct ikl_args {
    const float *iq, *iw, *iK, *itgt;  // iq [T, nI, cI]; iw [T, nI]; iK [B·S, cI]; itgt [T, stride]
    const int32_t *sel, *nsel;         // [T, stride], [T]
    const float *dI;                   // [T, stride]
    float *dIo, *diq, *diw, *dsi, *dK; // [T, stride], [T, nI, cI], [T, nI], [T, nI, stride], [B·S, cI]
    double *kl;
    int32_t *has;
    const int64_t *inv_off;
    const int32_t *inv_t, *inv_i;
    int64_t S, nI, cI, stride, nwin;
    double scale;
};

static ikl_args ikl_of(const ds4_config *c, const ds4_layer_tape *lt, int64_t S, int64_t stride) {
    ikl_args g{};
    g.iq = lt->iq, g.iw = lt->iw, g.iK = lt->iK, g.itgt = lt->itgt, g.sel = lt->sel, g.nsel = lt->nsel;
    g.S = S, g.nI = c->index_n_heads, g.cI = c->index_head_dim, g.stride = stride, g.nwin = lt->nwin;
    return g;
}

// Indexer score of query t on the pick whose key is `key`, for a warp: Σ_h relu(q_h·key)·c^-1/2·ω_h in head order
// (lane-strided dot products, fixed butterfly). Every lane gets the result.
__device__ __forceinline__ float ikl_score(const ikl_args &a, int64_t t, const float *key, float qscale) {
    const int lane = threadIdx.x & 31;
    float acc = 0;
    for (int64_t h = 0; h < a.nI; h++) {
        const float *q = a.iq + (t * a.nI + h) * a.cI;
        float dot = 0;
        for (int64_t c = lane; c < a.cI; c += 32) dot = fmaf(q[c], key[c], dot);
        dot = ds4d_warp_sumf(dot);
        acc += (dot > 0 ? dot * qscale : 0.0f) * a.iw[t * a.nI + h];
    }
    return acc;
}

// One block per query: KL(p || q) over its picks; dI = scale·(q − p) when asked. Mass, max, denominator and the KL in
// double over fixed trees.
__global__ void __launch_bounds__(BWD_THREADS) ikl_kernel(ikl_args a) {
    extern __shared__ float sc[]; // [stride] the picks' scores (fp32, as the CPU computes them)
    __shared__ double shd[BWD_THREADS / 32];
    __shared__ float shf[BWD_THREADS / 32];
    const int64_t t = blockIdx.x, row = t / a.S, k = clamp_picks(a.nsel[t], a.stride);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *tg = a.itgt + t * a.stride;
    if (a.dIo)
        for (int64_t i = threadIdx.x; i < a.stride; i += BWD_THREADS) a.dIo[t * a.stride + i] = 0;
    double mass = 0;
    for (int64_t i = threadIdx.x; i < k; i += BWD_THREADS) mass += tg[i];
    mass = ds4d_block_sum(mass, shd);
    const int has = k > 0 && mass > 0;
    if (threadIdx.x == 0) {
        a.has[t] = has;
        a.kl[t] = 0;
    }
    if (!has) return;
    const float qscale = 1.0f / sqrtf((float)a.cI);
    for (int64_t i = warp; i < k; i += BWD_THREADS / 32) {
        const float s = ikl_score(a, t, a.iK + (row * a.S + a.sel[t * a.stride + i]) * a.cI, qscale);
        if (lane == 0) sc[i] = s;
    }
    __syncthreads();
    float mxf = -INFINITY;
    for (int64_t i = threadIdx.x; i < k; i += BWD_THREADS) mxf = fmaxf(mxf, sc[i]);
    const double mx = ds4d_block_maxf(mxf, shf);
    double den = 0;
    for (int64_t i = threadIdx.x; i < k; i += BWD_THREADS) den += exp((double)sc[i] - mx);
    den = ds4d_block_sum(den, shd);
    const double lden = log(den);
    double kl = 0;
    // the same i ↦ thread map as the zeroing above: dI[i] is written by one thread, in program order
    for (int64_t i = threadIdx.x; i < k; i += BWD_THREADS) {
        const double p = tg[i] / mass, lq = (double)sc[i] - mx - lden;
        if (p > 0) kl += p * (log(p) - lq);
        if (a.dIo) a.dIo[t * a.stride + i] = (float)(a.scale * (exp(lq) - p));
    }
    kl = ds4d_block_sum(kl, shd);
    if (threadIdx.x == 0) a.kl[t] = kl;
}

// One block per (query, indexer head): the picks' dot products (warp per pick), dsi = dI·ω·c^-1/2 where the dot is
// positive; dω summed by one thread in pick order (fp32, as the CPU); dq: thread c owns channel c, picks in order.
__global__ void __launch_bounds__(BWD_THREADS) ikl_bwd_q_kernel(ikl_args a) {
    extern __shared__ float ikl_sh[];
    float *dots = ikl_sh, *dsv = ikl_sh + a.stride; // [stride] each
    const int64_t t = blockIdx.x / a.nI, h = blockIdx.x % a.nI, row = t / a.S, k = clamp_picks(a.nsel[t], a.stride);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float qscale = 1.0f / sqrtf((float)a.cI), om = a.iw[t * a.nI + h];
    const float *q = a.iq + (t * a.nI + h) * a.cI;
    const int32_t *sel = a.sel + t * a.stride;
    for (int64_t i = warp; i < k; i += BWD_THREADS / 32) {
        const float *key = a.iK + (row * a.S + sel[i]) * a.cI;
        float dot = 0;
        for (int64_t c = lane; c < a.cI; c += 32) dot = fmaf(q[c], key[c], dot);
        dot = ds4d_warp_sumf(dot);
        if (lane == 0) {
            const float ds = dot > 0 ? a.dI[t * a.stride + i] * om * qscale : 0.0f;
            dots[i] = dot;
            dsv[i] = ds;
            a.dsi[(t * a.nI + h) * a.stride + i] = ds;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float dw = 0;
        for (int64_t i = 0; i < k; i++) dw += a.dI[t * a.stride + i] * (dots[i] > 0 ? dots[i] * qscale : 0.0f);
        a.diw[t * a.nI + h] = dw;
    }
    float *dq = a.diq + (t * a.nI + h) * a.cI;
    for (int64_t c = threadIdx.x; c < a.cI; c += BWD_THREADS) {
        float acc = 0;
        for (int64_t i = 0; i < k; i++)
            if (dsv[i] != 0) acc = fmaf(dsv[i], a.iK[(row * a.S + sel[i]) * a.cI + c], acc);
        dq[c] = acc;
    }
}

// One block per complete indexer entry (sequence, w): Σ over the queries that picked it (inverse lists, query order)
// of Σ_h dsi·q_h.
__global__ void ikl_bwd_k_kernel(ikl_args a) {
    const int64_t row = blockIdx.x / a.nwin, w = blockIdx.x % a.nwin, x = row * a.S + w;
    for (int64_t c = threadIdx.x; c < a.cI; c += blockDim.x) {
        float acc = 0;
        for (int64_t i = a.inv_off[x]; i < a.inv_off[x + 1]; i++) {
            const int64_t t = a.inv_t[i], p = a.inv_i[i];
            for (int64_t h = 0; h < a.nI; h++)
                acc = fmaf(a.dsi[(t * a.nI + h) * a.stride + p], a.iq[(t * a.nI + h) * a.cI + c], acc);
        }
        a.dK[x * a.cI + c] = acc;
    }
}

} // namespace

// ------------------------------------------------------------------------------------------ operations

static bool grid_fits(ds4_dev *d, int64_t blocks, const char *op, const char *what) {
    if (blocks <= 0x7fffffff) return true;
    ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld blocks (%s) exceed the grid", op, (long long)blocks, what);
    return false;
}

void ds4_cuda_attn_bwd_q(ds4_dev *d, const ds4_a_attn_bwd *a) {
    const int64_t T = a->B * (a->qn ? a->qn : a->S); /* the query rows */
    if (T <= 0) return;
    const abwd_args g = abwd_of(a);
    if (g.kmax > a->maxk) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "attn_bwd_q: %lld keys per query, the P / DS rows hold %lld",
                     (long long)g.kmax, (long long)a->maxk);
        return;
    }
    char what[96];
    snprintf(what, sizeof what, "%lld keys per query", (long long)g.kmax);
    if (a->bf16_in && g.d == TCB_D && !cdev(d)->attn_ref) { // keys from bf16 copies
        const size_t smem = tcb_layout_of(g.H, g.kmax, 1).bytes;
        if (!grid_fits(d, T, "attn_bwd_q", "queries")) return;
        if (smem > cdev(d)->smem_bwd_tcb) {
            if (!smem_fits(d, attn_bwd_q_tcb_kernel, smem, "attn_bwd_q (bf16)", what)) return;
            cdev(d)->smem_bwd_tcb = smem;
        }
        abwd_args gk = g;
        gk.nwin = g.type == DS4_ATTN_SLIDING ? 0 : g.nwin;
        const int64_t rows = a->B * g.S + a->B * gk.nwin; // [B·S, 128] keys, then [B, nwin, 128] entries
        if (rows > 0xffffffffll) {                        // row numbers are uint32
            ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "attn_bwd_q (bf16): %lld key rows", (long long)rows);
            return;
        }
        auto *kv16 = (__nv_bfloat16 *)ds4_cuda_scratch(d, (size_t)(rows * TCB_D) * 2, "attn_bwd_q", 0);
        if (!kv16) return;
        __nv_bfloat16 *cK16 = kv16 + a->B * g.S * TCB_D;
        if (!ds4_cuda_rows_to_bf16(d, "attn_bwd_q", kv16, TCB_D, g.kv, TCB_D, 0, 1, a->B * g.S, TCB_D) ||
            (gk.nwin &&
             !ds4_cuda_rows_to_bf16(d, "attn_bwd_q", cK16, TCB_D, g.cK, TCB_D, g.S * TCB_D, a->B, gk.nwin, TCB_D)))
            return;
        attn_bwd_q_tcb_kernel<<<(unsigned)T, TCA_THREADS, smem, cdev(d)->stream>>>(gk, kv16);
        ds4_cuda_launched(d, "attn_bwd_q", "[%lld queries, %lld heads x %d, <= %lld keys, %s, bf16 tensor cores, bf16 keys]",
                          (long long)T, (long long)g.H, TCB_D, (long long)g.kmax, ds4_attn_type_name(a->l->type));
        return;
    }
    if (a->bf16_in) {
        const size_t smem = tca_layout_of(g.H, g.d, g.kmax, 1).bytes;
        if (!grid_fits(d, T, "attn_bwd_q", "queries")) return;
        const bool ref = cdev(d)->attn_ref;
        auto kernel = ref ? attn_bwd_q_tc_kernel<true> : attn_bwd_q_tc_kernel<false>;
        if (smem > cdev(d)->smem_bwd_tc) {
            if (!smem_fits(d, kernel, smem, "attn_bwd_q (bf16)", what)) return;
            cdev(d)->smem_bwd_tc = smem;
        }
        kernel<<<(unsigned)T, TCA_THREADS, smem, cdev(d)->stream>>>(g);
        ds4_cuda_launched(d, "attn_bwd_q", "[%lld queries, %lld heads x %lld, <= %lld keys, %s, bf16 tensor cores%s]",
                          (long long)T, (long long)g.H, (long long)g.d, (long long)g.kmax,
                          ds4_attn_type_name(a->l->type), ref ? ", reference" : "");
        return;
    }
    const size_t smem = (size_t)g.kmax * (sizeof(float *) + 2 * sizeof(float));
    if (!smem_fits(d, attn_bwd_q_kernel, smem, "attn_bwd_q", what) ||
        !grid_fits(d, T * g.H, "attn_bwd_q", "queries x heads"))
        return;
    attn_bwd_q_kernel<<<(unsigned)(T * g.H), BWD_THREADS, smem, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "attn_bwd_q", "[%lld queries, %lld heads x %lld, <= %lld keys, %s]", (long long)T,
                      (long long)g.H, (long long)g.d, (long long)g.kmax, ds4_attn_type_name(a->l->type));
}

// The key gradients of one kind (0: window keys, 1: complete entries) through partials of KEY_QCHUNK queries.
static void key_grads(ds4_dev *d, const abwd_args &g, int kind, int64_t nkeys, int64_t longest, const char *op,
                      const char *shapes) {
    if (g.bf16 && g.H <= KG_MAXH && g.d % 8 == 0) { // the bf16 mode: tensor cores, chunks of qc queries
        const int64_t nkr = kind == 0 ? g.S : g.nwin, tiles = (nkr + KGT - 1) / KGT, rows = nkeys / nkr;
        const int64_t span = kind == 0 ? (KGT - 1 + g.win < g.S ? KGT - 1 + g.win : g.S) : g.S; // queries per tile
        const int64_t qc = kind == 0 ? KGQ_WIN : KGQ_ENT;
        const int64_t nq = (span + qc - 1) / qc > 0 ? (span + qc - 1) / qc : 1;
        // queries per barrier: 4 where H <= 16 (3 loads of 8 a thread and query), 2 up to KG_MAXH, 1 for the reference
        // (DS4_CUDA_ATTN_REF=1) or where the device's blocks cannot have 2 · G query slots of shared memory (18 KiB
        // each at H = 16, 30 KiB at 32)
        int G = cdev(d)->attn_ref ? 1 : (kg_tasks(g.H) <= KG_MAXTASK / 2 ? 4 : 2);
        while (G > 1 && kg_tc_layout_of(g.H, G).bytes > cdev(d)->smem_optin) G /= 2;
        auto kernel = G == 1 ? key_grad_tc_kernel<1, KG_MAXTASK>
                             : (G == 4 ? key_grad_tc_kernel<4, KG_MAXTASK / 2> : key_grad_tc_kernel<2, KG_MAXTASK>);
        const size_t smem = kg_tc_layout_of(g.H, G).bytes;
        if (!grid_fits(d, rows * tiles, op, "key tiles") || nq > 65535) {
            if (nq > 65535) ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld query chunks", op, (long long)nq);
            return;
        }
        size_t *raised = &cdev(d)->smem_kg_tc[G == 1 ? 0 : (G == 2 ? 1 : 2)]; // a limit per kernel
        if (smem > *raised) {
            if (!smem_fits(d, kernel, smem, op, "a tile of keys")) return;
            *raised = smem;
        }
        float *part = nullptr;
        if (nq > 1) {
            part = (float *)ds4_cuda_scratch(d, (size_t)(nkeys * nq * g.d) * sizeof(float), op, 0);
            if (!part) return;
        }
        const dim3 grid((unsigned)(rows * tiles), (unsigned)((g.d + KGC - 1) / KGC), (unsigned)nq);
        kernel<<<grid, KG_THREADS, smem, cdev(d)->stream>>>(g, kind, tiles, qc, part);
        if (!ds4_cuda_launched(d, op, "%s: bf16 tensor cores, tiles of %d keys, %lld chunks of %d queries, %d a barrier",
                               shapes, KGT, (long long)nq, (int)qc, G) ||
            nq == 1)
            return;
        key_grad_fold_kernel<<<ds4_blocks(nkeys * g.d, 256), 256, 0, cdev(d)->stream>>>(g, kind, nkeys, nq, part);
        ds4_cuda_launched(d, op, "%s: fold of %lld chunks", shapes, (long long)nq);
        return;
    }
    const int64_t nch = longest > 0 ? (longest + KEY_QCHUNK - 1) / KEY_QCHUNK : 1;
    if (!grid_fits(d, nkeys * nch, op, "keys x query chunks")) return;
    auto *part = (float *)ds4_cuda_scratch(d, (size_t)(nkeys * nch * g.d) * sizeof(float), op, 0);
    if (!part) return;
    if (kind == 0) { // window keys: the sequences' keys in groups (nkeys = B·S)
        const int64_t groups = (g.S + WIN_KEYS - 1) / WIN_KEYS, nblk = nkeys / g.S * groups * nch;
        if (!grid_fits(d, nblk, op, "key groups x query chunks")) return;
        key_grad_win_kernel<<<(unsigned)nblk, channel_threads(g.d), 0, cdev(d)->stream>>>(g, groups, nch, part);
    } else {
        key_grad_part_kernel<<<(unsigned)(nkeys * nch), channel_threads(g.d), 0, cdev(d)->stream>>>(g, kind, nch, part);
    }
    if (!ds4_cuda_launched(d, op, "%s: partials of %lld chunks", shapes, (long long)nch)) return;
    key_grad_fold_kernel<<<ds4_blocks(nkeys * g.d, 256), 256, 0, cdev(d)->stream>>>(g, kind, nkeys, nch, part);
    ds4_cuda_launched(d, op, "%s: fold", shapes);
}

void ds4_cuda_attn_bwd_kv(ds4_dev *d, const ds4_a_attn_bwd *a) {
    const int64_t T = a->B * a->S; /* the window keys: every position of each sequence */
    if (T <= 0) return;
    const abwd_args g = abwd_of(a);
    char shapes[128];
    snprintf(shapes, sizeof shapes, "[%lld keys of %lld, window %lld, %lld heads]", (long long)T, (long long)g.d,
             (long long)g.win, (long long)g.H);
    key_grads(d, g, 0, T, g.win < g.S ? g.win : g.S, "attn_bwd_kv", shapes);
}

void ds4_cuda_attn_bwd_entry(ds4_dev *d, const ds4_a_attn_bwd *a) {
    const abwd_args g = abwd_of(a);
    const int64_t n = a->B * g.nwin;
    if (n <= 0 || g.type == DS4_ATTN_SLIDING) return;
    char shapes[128];
    snprintf(shapes, sizeof shapes, "[%lld sequences x %lld entries of %lld, %s]", (long long)a->B, (long long)g.nwin,
             (long long)g.d, ds4_attn_type_name(a->l->type));
    // a list holds at most one query per position of the sequence
    key_grads(d, g, 1, n, g.S, "attn_bwd_entry", shapes);
}

void ds4_cuda_pick_inverse(ds4_dev *d, const ds4_a_pick_inverse *a) {
    const int64_t S = a->S, n = a->B * S, qn = a->qn ? a->qn : S; /* query row t belongs to sequence t / qn */
    if (n <= 0 || qn <= 0) return;
    // chunks of 64 queries, fewer (longer) ones when the per-chunk tables would pass 2^24 counters: the chunking
    // changes no result (integers), only the scratch and the parallelism
    int64_t nch = (qn + 63) / 64;
    const int64_t cap = ((int64_t)1 << 24) / n;
    if (nch > cap) nch = cap > 1 ? cap : 1;
    const int64_t qc = (qn + nch - 1) / nch;
    nch = (qn + qc - 1) / qc;
    if (!grid_fits(d, a->B * nch, "pick_inverse", "sequences x chunks")) return;
    const size_t hbytes = (size_t)(a->B * nch * S) * sizeof(int32_t);
    int32_t *hist = (int32_t *)ds4_cuda_scratch(d, hbytes, "pick_inverse", 1);
    if (!hist) return;
    const cudaError_t e = cudaMemsetAsync(hist, 0, hbytes, cdev(d)->stream);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        ds4_dev_fail(d, DS4_ERR_CUDA, "pick_inverse: clearing %zu bytes: %s", hbytes, cudaGetErrorString(e));
        return;
    }
    const pinv_args g = {a->sel, a->nsel, hist, a->inv_off, a->inv_t, a->inv_i, a->sel_stride, a->T, S, qn, nch, qc};
    const unsigned chunks = (unsigned)(a->B * nch);
    pick_inverse_chunk_kernel<<<chunks, 256, 0, cdev(d)->stream>>>(g, 0);
    if (!ds4_cuda_launched(d, "pick_inverse", "[%lld queries, %lld picks each, count]", (long long)a->T,
                           (long long)a->sel_stride))
        return;
    pick_inverse_cols_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(g, n);
    if (!ds4_cuda_launched(d, "pick_inverse", "[%lld entries, %lld chunks, offsets]", (long long)n, (long long)nch))
        return;
    pick_inverse_scan_kernel<<<1, SCAN_THREADS, 0, cdev(d)->stream>>>(a->inv_off, n);
    if (!ds4_cuda_launched(d, "pick_inverse", "[%lld entries, scan]", (long long)n)) return;
    pick_inverse_chunk_kernel<<<chunks, 256, 0, cdev(d)->stream>>>(g, 1);
    ds4_cuda_launched(d, "pick_inverse", "[%lld queries, %lld picks each, fill]", (long long)a->T,
                      (long long)a->sel_stride);
}

void ds4_cuda_entry_rope(ds4_dev *d, const ds4_a_entry_rope *a) {
    const int64_t n = a->B * a->nwin * a->rt.half;
    if (n <= 0) return;
    entry_rope_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->S, a->nwin, a->dd, a->m, a->rt.cs,
                                                                       a->rt.half, a->sign, n);
    ds4_cuda_launched(d, "entry_rope", "[%lld sequences x %lld entries of %lld, %lld pairs]", (long long)a->B,
                      (long long)a->nwin, (long long)a->dd, (long long)a->rt.half);
}

void ds4_cuda_comp_bwd(ds4_dev *d, const ds4_a_comp_bwd *a) {
    const ds4_compressor_w *w = a->w;
    const int64_t n = a->B * a->nwin * w->dd;
    if (n <= 0) return;
    const cbwd_args g = {a->C, a->Z, w->ape, a->dpool, a->dC, a->dZ, a->gape, w->rate, w->dd, w->width, a->S, a->nwin,
                         a->overlap};
    comp_bwd_kernel<<<ds4_blocks(n, 128), 128, 0, cdev(d)->stream>>>(g, n);
    if (!ds4_cuda_launched(d, "comp_bwd", "[%lld sequences x %lld entries of %lld, rate %lld%s]", (long long)a->B,
                           (long long)a->nwin, (long long)w->dd, (long long)w->rate, a->overlap ? ", overlap" : "") ||
        !a->gape) /* a frozen position bias (only adapters train): no gradient */
        return;
    // runs: the most a column has (the columns of previous-window slots have one window fewer a row)
    const int64_t mw = w->rate * w->width, runs = (a->B * a->nwin + APE_RUN - 1) / APE_RUN;
    if (runs > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "comp_bwd: %lld x %lld windows (%lld runs of %lld > 65535)",
                     (long long)a->B, (long long)a->nwin, (long long)runs, (long long)APE_RUN);
        return;
    }
    float *part = runs ? (float *)ds4_cuda_scratch(d, (size_t)(runs * mw) * sizeof(float), "comp_bwd", 0) : nullptr;
    if (runs && !part) return;
    if (runs)
        comp_bwd_ape_kernel<<<dim3(ds4_blocks(mw, 128), (unsigned)runs), 128, 0, cdev(d)->stream>>>(g, a->B, part);
    if (cudaPeekAtLastError() == cudaSuccess)
        comp_bwd_ape_fold_kernel<<<ds4_blocks(mw, 128), 128, 0, cdev(d)->stream>>>(g, a->B, part);
    ds4_cuda_launched(d, "comp_bwd", "[position bias %lld x %lld over %lld x %lld windows, runs of %lld]",
                      (long long)w->rate, (long long)w->width, (long long)a->B, (long long)a->nwin,
                      (long long)APE_RUN);
}

void ds4_cuda_ikl(ds4_dev *d, const ds4_a_ikl *a) {
    if (a->T <= 0) return;
    ikl_args g = ikl_of(a->c, a->lt, a->S, a->sel_stride);
    g.dIo = a->dI, g.kl = a->kl, g.has = a->has, g.scale = a->scale;
    const size_t smem = (size_t)a->sel_stride * sizeof(float);
    char what[96];
    snprintf(what, sizeof what, "%lld picks per query", (long long)a->sel_stride);
    if (!smem_fits(d, ikl_kernel, smem, "ikl", what) || !grid_fits(d, a->T, "ikl", "queries")) return;
    ikl_kernel<<<(unsigned)a->T, BWD_THREADS, smem, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "ikl", "[%lld queries, <= %lld picks, %lld heads x %lld]", (long long)a->T,
                      (long long)a->sel_stride, (long long)a->c->index_n_heads, (long long)a->c->index_head_dim);
}

void ds4_cuda_ikl_bwd_q(ds4_dev *d, const ds4_a_ikl_bwd *a) {
    if (a->T <= 0) return;
    ikl_args g = ikl_of(a->c, a->lt, a->S, a->sel_stride);
    g.dI = a->dI, g.diq = a->diq, g.diw = a->diw, g.dsi = a->dsi;
    const size_t smem = (size_t)a->sel_stride * 2 * sizeof(float);
    char what[96];
    snprintf(what, sizeof what, "%lld picks per query", (long long)a->sel_stride);
    if (!smem_fits(d, ikl_bwd_q_kernel, smem, "ikl_bwd_q", what) ||
        !grid_fits(d, a->T * g.nI, "ikl_bwd_q", "queries x indexer heads"))
        return;
    ikl_bwd_q_kernel<<<(unsigned)(a->T * g.nI), BWD_THREADS, smem, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "ikl_bwd_q", "[%lld queries, <= %lld picks, %lld heads x %lld]", (long long)a->T,
                      (long long)a->sel_stride, (long long)g.nI, (long long)g.cI);
}

void ds4_cuda_ikl_bwd_k(ds4_dev *d, const ds4_a_ikl_bwd *a) {
    ikl_args g = ikl_of(a->c, a->lt, a->S, a->sel_stride);
    const int64_t n = a->B * g.nwin;
    if (n <= 0) return;
    g.dsi = a->dsi, g.dK = a->dK, g.inv_off = a->inv_off, g.inv_t = a->inv_t, g.inv_i = a->inv_i;
    if (!grid_fits(d, n, "ikl_bwd_k", "entries")) return;
    ikl_bwd_k_kernel<<<(unsigned)n, channel_threads(g.cI), 0, cdev(d)->stream>>>(g);
    ds4_cuda_launched(d, "ikl_bwd_k", "[%lld sequences x %lld entries of %lld, %lld heads]", (long long)a->B,
                      (long long)g.nwin, (long long)g.cI, (long long)g.nI);
}
