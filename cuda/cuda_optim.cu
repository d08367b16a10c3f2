// cuda_optim.cu — AdamW on the GPU: the gradient norm's per-piece sums of squares, the finiteness check and the update
// (core/optim.c decides what runs and holds the reference), and the refresh of the working weights from the fp32
// master copy.
//
// The update repeats ds4_adamw_update's fp32 operations one by one with the _rn intrinsics, which nvcc never
// contracts into FMAs, so given the same gradients and coefficients the GPU writes the same bits as the host. The
// sums of squares reduce each piece in a fixed tree (a block per piece), so they are the same bits run after run.
#include <cuda_bf16.h>

#include "cuda_dev.cuh"

namespace {

constexpr int OPT_THREADS = 256, OPT_U = 4;

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

// Elements i0, i0 + OPT_THREADS, .. (OPT_U of them) of piece q, all loads issued before any use (the passes are bound
// by memory latency); past the piece's end, its first element stands in (never used). m and v hold elements [mo, ...)
// of the flat buffer (a ZeRO-1 shard's moments; mo = 0: all of it): element k's moments are m[k - mo], v[k - mo].
__device__ __forceinline__ void load_elems(const ds4_optim_piece &q, int64_t i0, const float *p, const float *g,
                                           const float *m, const float *v, int64_t mo, float (&pp)[OPT_U],
                                           float (&gg)[OPT_U], float (&mm)[OPT_U], float (&vv)[OPT_U]) {
#pragma unroll
    for (int u = 0; u < OPT_U; u++) {
        const int64_t i = i0 + u * OPT_THREADS, k = q.off + (i < q.n ? i : 0);
        pp[u] = p[k], gg[u] = g[k], mm[u] = m[k - mo], vv[u] = v[k - mo];
    }
}

__global__ void __launch_bounds__(OPT_THREADS) adamw_check_kernel(const ds4_optim_piece *pc, const ds4_adamw_coefs *cf,
                                                                  float coef, const float *p, const float *g,
                                                                  const float *m, const float *v, int64_t mo,
                                                                  int64_t *bad) {
    __shared__ double sh[OPT_THREADS / 32];
    const ds4_optim_piece q = pc[blockIdx.x];
    const ds4_adamw_coefs c = cf[q.range];
    double nb = 0; // counts fit a double exactly
    for (int64_t i0 = threadIdx.x; i0 < q.n; i0 += OPT_U * OPT_THREADS) {
        float pp[OPT_U], gg[OPT_U], mm[OPT_U], vv[OPT_U];
        load_elems(q, i0, p, g, m, v, mo, pp, gg, mm, vv);
#pragma unroll
        for (int u = 0; u < OPT_U; u++) {
            if (i0 + u * OPT_THREADS >= q.n) break;
            const float gi = coef == 1.0f ? gg[u] : __fmul_rn(gg[u], coef);
            const elem_out o = adamw_elem(c, pp[u], gi, mm[u], vv[u]);
            nb += !(isfinite(o.p) && isfinite(o.m) && isfinite(o.v));
        }
    }
    nb = ds4d_block_sum(nb, sh);
    if (threadIdx.x == 0) bad[blockIdx.x] = (int64_t)nb;
}

__global__ void __launch_bounds__(OPT_THREADS) adamw_update_kernel(const ds4_optim_piece *pc, const ds4_adamw_coefs *cf,
                                                                   float coef, float *p, float *g, float *m, float *v,
                                                                   int64_t mo) {
    const ds4_optim_piece q = pc[blockIdx.x];
    const ds4_adamw_coefs c = cf[q.range];
    for (int64_t i0 = threadIdx.x; i0 < q.n; i0 += OPT_U * OPT_THREADS) {
        float pp[OPT_U], gg[OPT_U], mm[OPT_U], vv[OPT_U];
        load_elems(q, i0, p, g, m, v, mo, pp, gg, mm, vv);
#pragma unroll
        for (int u = 0; u < OPT_U; u++) {
            const int64_t i = i0 + u * OPT_THREADS, k = q.off + i;
            if (i >= q.n) break;
            float gi = gg[u];
            if (coef != 1.0f) g[k] = gi = __fmul_rn(gi, coef); // the clipped gradient stays in the buffer, as on the host
            const elem_out o = adamw_elem(c, pp[u], gi, mm[u], vv[u]);
            p[k] = o.p;
            m[k - mo] = o.m;
            v[k - mo] = o.v;
        }
    }
}

// ds4_f32_to_bf16 (core/tensor.c): round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__global__ void cast_kernel(char *dst, const float *src, const ds4_cast_entry *ent, int bf16) {
    const ds4_cast_entry e = ent[blockIdx.y];
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < e.n; i += (int64_t)gridDim.x * blockDim.x) {
        const float x = src[e.src + i];
        if (e.lowp && bf16) reinterpret_cast<uint16_t *>(dst + e.dst)[i] = f32_to_bf16(x);
        else reinterpret_cast<float *>(dst + e.dst)[i] = x;
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
        adamw_update_kernel<<<(unsigned)a->n, OPT_THREADS, 0, cdev(d)->stream>>>(a->pieces, a->coefs, a->coef, a->p, a->g, a->m,
                                                                       a->v, a->mo);
    } else {
        adamw_check_kernel<<<(unsigned)a->n, OPT_THREADS, 0, cdev(d)->stream>>>(a->pieces, a->coefs, a->coef, a->p,
                                                                               a->g, a->m, a->v, a->mo, a->bad);
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
