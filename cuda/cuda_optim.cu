// cuda_optim.cu — AdamW on the GPU: the gradient norm's per-piece sums of squares, the finiteness check and the update
// (core/optim.c decides what runs and holds the reference), and the refresh of the working weights from the fp32
// master copy: written by the update as it goes where the optimizer gives each piece its place there (wcast), which
// saves the cast pass's read of the whole master (1.8 ms of a 599M step on an H100), else by cast_params.
//
// The update repeats ds4_adamw_update's fp32 operations one by one with the _rn intrinsics, which nvcc never
// contracts into FMAs, so given the same gradients and coefficients the GPU writes the same bits as the host. The
// sums of squares reduce each piece in a fixed tree (a block per piece), so they are the same bits run after run.
#include <cuda_bf16.h>

#include "cuda_dev.cuh"

namespace {

// OPT_U elements (one by one) or OPT_V groups of four (16 bytes at a time) per thread in flight per buffer
constexpr int OPT_THREADS = 256, OPT_U = 4, OPT_V = 2;

__global__ void __launch_bounds__(OPT_THREADS) sumsq_kernel(const ds4_optim_piece *pc, const float *g, double *partial) {
    __shared__ double sh[OPT_THREADS / 32];
    const ds4_optim_piece q = pc[blockIdx.x];
    double s = 0;
    for (int64_t i = threadIdx.x; i < q.n; i += OPT_THREADS) {
        const double x = (double)g[q.off + i];
        s += x * x;
    }
    s = ds4d_block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// ds4_f32_to_bf16 (core/tensor.c): round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

struct elem_out {
    float p, m, v;
};

// adamw_elem of core/optim.c, operation for operation (no contraction: every product and sum rounds on its own).
__device__ __forceinline__ elem_out adamw_elem(const ds4_adamw_coefs &c, float p, float g, float m, float v) {
    const int small_w = fabsf(c.one_m_b1) < 0.5f;
    const float omw = __fsub_rn(1.0f, c.one_m_b1);
    elem_out o;
    const float pi = __fmul_rn(p, c.decay_mul);
    o.m = small_w ? __fadd_rn(m, __fmul_rn(c.one_m_b1, __fsub_rn(g, m))) : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), omw));
    o.v = __fadd_rn(__fmul_rn(v, c.beta2), __fmul_rn(__fmul_rn(c.one_m_b2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(o.v), c.bc2_sqrt), c.eps);
    o.p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(c.neg_step, o.m), denom));
    return o;
}

// One element of a pass: the clipped gradient, then the update (adamw_elem). UPDATE: written back through the
// references (g only when clipping: the clipped gradient stays in the buffer, as on the host; not when told skip_g);
// else a non-finite result counted in nb.
// The largest |p|, |m|, |v| and -v an update wrote (ds4_adamw_bounds): maxima, the same in any order.
struct bounds_acc {
    float p = 0, m = 0, v = 0, nv = 0;
    __device__ __forceinline__ void add(float pp, float mm, float vv) {
        p = fmaxf(p, fabsf(pp)), m = fmaxf(m, fabsf(mm)), v = fmaxf(v, fabsf(vv)), nv = fmaxf(nv, -vv);
    }
};

template <bool UPDATE>
__device__ __forceinline__ void step_elem(const ds4_adamw_coefs &c, float coef, float &p, float &g, float &m, float &v,
                                          double &nb, bounds_acc &b) {
    const float gi = coef == 1.0f ? g : __fmul_rn(g, coef);
    const elem_out o = adamw_elem(c, p, gi, m, v);
    if (UPDATE) {
        g = gi, p = o.p, m = o.m, v = o.v;
        b.add(o.p, o.m, o.v);
    } else {
        nb += !(isfinite(o.p) && isfinite(o.m) && isfinite(o.v));
    }
}

template <bool UPDATE>
__device__ __forceinline__ void step_elem4(const ds4_adamw_coefs &c, float coef, float4 &p, float4 &g, float4 &m,
                                           float4 &v, double &nb, bounds_acc &b) {
    step_elem<UPDATE>(c, coef, p.x, g.x, m.x, v.x, nb, b), step_elem<UPDATE>(c, coef, p.y, g.y, m.y, v.y, nb, b);
    step_elem<UPDATE>(c, coef, p.z, g.z, m.z, v.z, nb, b), step_elem<UPDATE>(c, coef, p.w, g.w, m.w, v.w, nb, b);
}

// The working copy (ds4_a_adamw's wcast): piece element i's new p to w.d + i·(2 or 4) bytes, as cast_params writes it.
// d NULL: none. vec: the piece's groups of four land on 8-byte (bf16) or 16-byte (fp32) boundaries there.
struct wcopy {
    char *d = nullptr;
    bool low = false, vec = false;
    __device__ __forceinline__ void one(int64_t i, float p) const {
        if (low) reinterpret_cast<uint16_t *>(d)[i] = f32_to_bf16(p);
        else reinterpret_cast<float *>(d)[i] = p;
    }
    __device__ __forceinline__ void four(int64_t i, const float4 &p) const { // elements i..i+3
        if (!vec) {
            one(i, p.x), one(i + 1, p.y), one(i + 2, p.z), one(i + 3, p.w);
        } else if (low) {
            ushort4 h;
            h.x = f32_to_bf16(p.x), h.y = f32_to_bf16(p.y), h.z = f32_to_bf16(p.z), h.w = f32_to_bf16(p.w);
            *reinterpret_cast<ushort4 *>(d + 2 * i) = h;
        } else {
            *reinterpret_cast<float4 *>(d + 4 * i) = p;
        }
    }
};

// The pass over piece q (UPDATE: the update; else the finiteness check, its count in nb). m and v hold elements
// [mo, ...) of the flat buffer and p elements [po, ...) (a ZeRO-1 shard's moments and master; 0: all of it): element
// k's moments are m[k - mo], v[k - mo], its master weight p[k - po]. The passes are bound by memory. Where the piece
// lies alike modulo 16 bytes in all four buffers (a model's: the buffers are cudaMalloc'd and v is placed as m,
// model.h's ds4_moments_stride; not a shard whose region starts off a multiple of 4), each thread moves groups of four elements as one 16-byte load or store per buffer,
// OPT_V groups in flight, and the h < 4 elements before the first 16-byte boundary and the few after the last group
// go one by one; elsewhere every element goes one by one, OPT_U in flight per thread. All loads of a round are issued
// before any use; past the end the first group (element) stands in, never used. Each element's arithmetic is the
// same whichever way it is loaded, and the check's count is exact in any order.
template <bool UPDATE>
__device__ __forceinline__ void piece_pass(const ds4_optim_piece &q, const ds4_adamw_coefs &c, float coef, float *p,
                                           float *g, float *m, float *v, int64_t mo, int64_t po, double &nb,
                                           bounds_acc &b, wcopy w = {}, bool skip_g = false) {
    p += q.off - po, g += q.off, m += q.off - mo, v += q.off - mo; // the piece's elements, [0, q.n)
    const uintptr_t mis = (uintptr_t)p & 15;
    const bool write_g = UPDATE && coef != 1.0f && !skip_g; // skip_g: the buffer is zeroed after (ops.h)
    int64_t h = q.n, n4 = 0; // elements [h, h + 4·n4) go as groups of four
    if (((uintptr_t)g & 15) == mis && ((uintptr_t)m & 15) == mis && ((uintptr_t)v & 15) == mis) {
        h = (int64_t)((16 - mis) & 15) / 4 < q.n ? (int64_t)((16 - mis) & 15) / 4 : q.n;
        n4 = (q.n - h) / 4;
    }
    if (w.d) w.vec = ((uintptr_t)(w.d + (w.low ? 2 : 4) * h) & (w.low ? 7 : 15)) == 0;
    float4 *p4 = (float4 *)(p + h), *g4 = (float4 *)(g + h), *m4 = (float4 *)(m + h), *v4 = (float4 *)(v + h);
    for (int64_t j0 = threadIdx.x; j0 < n4; j0 += OPT_V * OPT_THREADS) {
        float4 pp[OPT_V], gg[OPT_V], mm[OPT_V], vv[OPT_V];
#pragma unroll
        for (int u = 0; u < OPT_V; u++) {
            const int64_t j = j0 + u * OPT_THREADS, k = j < n4 ? j : 0;
            pp[u] = p4[k], gg[u] = g4[k], mm[u] = m4[k], vv[u] = v4[k];
        }
#pragma unroll
        for (int u = 0; u < OPT_V; u++) {
            const int64_t j = j0 + u * OPT_THREADS;
            if (j >= n4) break;
            step_elem4<UPDATE>(c, coef, pp[u], gg[u], mm[u], vv[u], nb, b);
            if (!UPDATE) continue;
            if (write_g) g4[j] = gg[u];
            p4[j] = pp[u], m4[j] = mm[u], v4[j] = vv[u];
            if (w.d) w.four(h + 4 * j, pp[u]);
        }
    }
    // the rest one by one: scalar s is element s before the groups, s + 4·n4 after them
    const int64_t ns = q.n - 4 * n4;
    auto at = [&](int64_t s) { return s < h ? s : s + 4 * n4; };
    for (int64_t s0 = threadIdx.x; s0 < ns; s0 += OPT_U * OPT_THREADS) {
        float pp[OPT_U], gg[OPT_U], mm[OPT_U], vv[OPT_U];
#pragma unroll
        for (int u = 0; u < OPT_U; u++) {
            const int64_t s = s0 + u * OPT_THREADS, k = at(s < ns ? s : 0);
            pp[u] = p[k], gg[u] = g[k], mm[u] = m[k], vv[u] = v[k];
        }
#pragma unroll
        for (int u = 0; u < OPT_U; u++) {
            const int64_t s = s0 + u * OPT_THREADS, i = at(s);
            if (s >= ns) break;
            step_elem<UPDATE>(c, coef, pp[u], gg[u], mm[u], vv[u], nb, b);
            if (!UPDATE) continue;
            if (write_g) g[i] = gg[u];
            p[i] = pp[u], m[i] = mm[u], v[i] = vv[u];
            if (w.d) w.one(i, pp[u]);
        }
    }
}

// 4 blocks an SM (~60 registers): up to 128 KB of loads in flight per SM (1024 threads x 2 groups x 4 buffers x 16 B)
__global__ void __launch_bounds__(OPT_THREADS, 4)
    adamw_check_kernel(const ds4_optim_piece *pc, const ds4_adamw_coefs *cf, float coef, const float *p, const float *g,
                       const float *m, const float *v, int64_t mo, int64_t po, int64_t *bad) {
    __shared__ double sh[OPT_THREADS / 32];
    const ds4_optim_piece q = pc[blockIdx.x];
    const ds4_adamw_coefs c = cf[q.range];
    double nb = 0; // counts fit a double exactly
    bounds_acc b;  // unused
    piece_pass<false>(q, c, coef, (float *)p, (float *)g, (float *)m, (float *)v, mo, po, nb, b); // only read
    nb = ds4d_block_sum(nb, sh);
    if (threadIdx.x == 0) bad[blockIdx.x] = (int64_t)nb;
}

__global__ void __launch_bounds__(OPT_THREADS, 4)
    adamw_update_kernel(const ds4_optim_piece *pc, const ds4_adamw_coefs *cf, float coef, float *p, float *g, float *m,
                        float *v, int64_t mo, int64_t po, ds4_adamw_bounds *bnd, char *wdst,
                        const ds4_optim_wcast *wc, int bf16, int skip_g) {
    __shared__ float sh[OPT_THREADS / 32];
    const ds4_optim_piece q = pc[blockIdx.x];
    const ds4_adamw_coefs c = cf[q.range]; // a copy: through a reference the stores below would reload it
    double nb = 0;                         // unused
    bounds_acc b;
    wcopy w;
    if (wc && wc[blockIdx.x].dst >= 0) w.d = wdst + wc[blockIdx.x].dst, w.low = wc[blockIdx.x].lowp && bf16;
    piece_pass<true>(q, c, coef, p, g, m, v, mo, po, nb, b, w, skip_g != 0);
    if (!bnd) return;
    // the piece's maxima (all non-negative: the block max of each, ds4d_block_maxf's -inf never wins)
    const float bp = ds4d_block_maxf(b.p, sh), bm = ds4d_block_maxf(b.m, sh), bv = ds4d_block_maxf(b.v, sh),
                bn = ds4d_block_maxf(b.nv, sh);
    if (threadIdx.x == 0) bnd[blockIdx.x] = ds4_adamw_bounds{bp, bm, bv, bn};
}

// Entry blockIdx.y. Where the entry's source is 16-byte aligned and its destination 8 (bf16) or 16 (fp32), groups of
// four values move as one load and one store (the cast is bound by memory: 2-byte stores one by one were half its
// time); the rest one by one. Each value is rounded the same either way.
__global__ void cast_kernel(char *dst, const float *src, const ds4_cast_entry *ent, int bf16) {
    const ds4_cast_entry e = ent[blockIdx.y];
    const float *s = src + e.src;
    char *o = dst + e.dst;
    const bool low = e.lowp && bf16;
    const int64_t t0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t n4 = ((uintptr_t)s & 15) == 0 && ((uintptr_t)o & (low ? 7 : 15)) == 0 ? e.n / 4 : 0;
    for (int64_t i = t0; i < n4; i += stride) {
        const float4 v = reinterpret_cast<const float4 *>(s)[i];
        if (low) {
            ushort4 h;
            h.x = f32_to_bf16(v.x), h.y = f32_to_bf16(v.y), h.z = f32_to_bf16(v.z), h.w = f32_to_bf16(v.w);
            reinterpret_cast<ushort4 *>(o)[i] = h;
        } else {
            reinterpret_cast<float4 *>(o)[i] = v;
        }
    }
    for (int64_t i = 4 * n4 + t0; i < e.n; i += stride) {
        if (low) reinterpret_cast<uint16_t *>(o)[i] = f32_to_bf16(s[i]);
        else reinterpret_cast<float *>(o)[i] = s[i];
    }
}

} // namespace

void ds4_cuda_optim_sumsq(ds4_dev *d, const ds4_a_optim_sumsq *a) {
    if (a->n <= 0) return;
    if (a->n > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "optim_sumsq: %lld pieces", (long long)a->n);
        return;
    }
    sumsq_kernel<<<(unsigned)a->n, OPT_THREADS, 0, cdev(d)->stream>>>(a->pieces, a->g, a->partial);
    ds4_cuda_launched(d, "optim_sumsq", "[%lld pieces]", (long long)a->n);
}

void ds4_cuda_adamw(ds4_dev *d, const ds4_a_adamw *a) {
    if (a->n <= 0) return;
    if (a->n > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "adamw: %lld pieces", (long long)a->n);
        return;
    }
    if (a->update) {
        adamw_update_kernel<<<(unsigned)a->n, OPT_THREADS, 0, cdev(d)->stream>>>(
            a->pieces, a->coefs, a->coef, a->p, a->g, a->m, a->v, a->mo, a->po, a->bnd, (char *)a->wdst,
            a->wdst ? a->wcast : nullptr, a->wdt == DS4_BF16, a->skip_g);
    } else {
        adamw_check_kernel<<<(unsigned)a->n, OPT_THREADS, 0, cdev(d)->stream>>>(a->pieces, a->coefs, a->coef, a->p,
                                                                               a->g, a->m, a->v, a->mo, a->po, a->bad);
    }
    ds4_cuda_launched(d, "adamw", "[%lld pieces, %s]", (long long)a->n, a->update ? "update" : "check");
}

void ds4_cuda_cast_params(ds4_dev *d, const ds4_a_cast_params *a) {
    if (a->n <= 0) return;
    if (a->n > 65535) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "cast_params: %lld tensors > 65535", (long long)a->n);
        return;
    }
    const dim3 grid(1024, (unsigned)a->n);
    cast_kernel<<<grid, 256, 0, cdev(d)->stream>>>((char *)a->dst, a->src, a->e, a->mdt == DS4_BF16);
    ds4_cuda_launched(d, "cast_params", "[%lld tensors, %s]", (long long)a->n, ds4_dtype_name(a->mdt));
}
