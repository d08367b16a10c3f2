// cuda_rows.cu — row-wise operations on the GPU: embedding, RMSNorm, RoPE, scaling, row copies / gathers /
// scatters, broadcast adds. One output element per thread, or one block per row with a fixed reduction tree whose
// shape depends on the row width only (never on the number of rows).
#include "cuda_dev.cuh"

namespace {

__global__ void embed_kernel(float *X, const void *E, int bf16, const int64_t *ids, int64_t T, int64_t n, int64_t D) {
    const int64_t t = blockIdx.x;
    const int64_t base = ids[t] * D;
    for (int64_t i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int64_t c = i % D;
        X[t * n * D + i] = bf16 ? __bfloat162float(((const __nv_bfloat16 *)E)[base + c]) : ((const float *)E)[base + c];
    }
}

// Threads of a row block for a row of `width`: the block shape (so the reduction tree) follows the width only.
int row_threads(int64_t width) { return width >= 256 ? 256 : (width >= 128 ? 128 : (width >= 64 ? 64 : 32)); }

// A row's RMSNorm: a block of nt = row_threads(width) threads, thread t adding (double)x[i]² for i = t, t + nt, .. in
// that order, then ds4d_block_sum's tree; y[i] = w[i]·(x[i]·inv). The kernels below write the same expressions (so the
// compiler fuses them alike: the test compares the bytes). rmsnorm_kernel is the reference (DS4_CUDA_ROW_REF=1) and
// takes the rows wider than the register kernels.
__device__ __forceinline__ float rms_out(const float *w, float xv, float inv, float wv) {
    return w ? wv * (xv * inv) : xv * inv;
}

__global__ void rmsnorm_kernel(float *y, const float *x, const float *w, int64_t width, double eps) {
    __shared__ double sh[8];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * width;
    float *yr = y + r * width;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) ss += (double)xr[i] * xr[i];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, width, eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) yr[i] = w ? w[i] * (xr[i] * inv) : xr[i] * inv;
}

// The same sums with the row in registers, PER elements a thread of 256 (rows of 256 to 256·PER): every load of the
// row (x and w) issued at once, x read once; the loop kernel waited on its loads one by one and read x twice.
template <int PER>
__global__ void __launch_bounds__(256) rmsnorm_block(float *y, const float *x, const float *w, int64_t width,
                                                     double eps) {
    __shared__ double sh[8];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * width;
    float *yr = y + r * width;
    float xs[PER], ws[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int64_t i = threadIdx.x + 256 * j;
        xs[j] = i < width ? xr[i] : 0.0f;
        ws[j] = w && i < width ? w[i] : 0.0f;
    }
    double ss = 0;
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (threadIdx.x + 256 * j < width) ss += (double)xs[j] * xs[j];
    ss = ds4d_block_sum(ss, sh);
    const float inv = ds4d_rms_inv(ss, width, eps);
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int64_t i = threadIdx.x + 256 * j;
        if (i < width) yr[i] = rms_out(w, xs[j], inv, ws[j]);
    }
}

// Rows narrower than 256 (nt = 32·nw <= 128 threads, at most 2 elements each): a warp per row, RMS_WROWS rows a block.
// Lane l plays the block's threads l + 32v and adds each one's elements in their order; ds4d_played_block_sum gives
// the block tree's bits. A block per row of 32 to 128 threads was mostly waiting on its barriers and its launch.
constexpr int RMS_NW = 4, RMS_WROWS = 8;
template <int PER>
__global__ void __launch_bounds__(32 * RMS_WROWS) rmsnorm_warp(float *y, const float *x, const float *w, int64_t rows,
                                                               int64_t width, int nw, double eps) {
    const int lane = (int)(threadIdx.x & 31);
    const int64_t r = (int64_t)blockIdx.x * RMS_WROWS + (threadIdx.x >> 5), nt = 32 * nw;
    if (r >= rows) return; // a whole warp: no barrier below
    const float *xr = x + r * width;
    float *yr = y + r * width;
    float xs[RMS_NW][PER], ws[RMS_NW][PER];
#pragma unroll
    for (int v = 0; v < RMS_NW; v++)
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t i = lane + 32 * v + nt * j;
            const bool in = v < nw && i < width;
            xs[v][j] = in ? xr[i] : 0.0f;
            ws[v][j] = in && w ? w[i] : 0.0f;
        }
    double part[RMS_NW];
#pragma unroll
    for (int v = 0; v < RMS_NW; v++) {
        part[v] = 0;
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (v < nw && lane + 32 * v + nt * j < width) part[v] += (double)xs[v][j] * xs[v][j];
    }
    const float inv = ds4d_rms_inv(ds4d_played_block_sum(part, nw), width, eps);
#pragma unroll
    for (int v = 0; v < RMS_NW; v++)
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t i = lane + 32 * v + nt * j;
            if (v < nw && i < width) yr[i] = rms_out(w, xs[v][j], inv, ws[v][j]);
        }
}

__global__ void rope_kernel(float *x, int64_t T, int64_t heads, int64_t width, const float *cs, int64_t half,
                            const int64_t *pos, int64_t q0, int64_t qn, int sign) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * heads * half) return;
    const int64_t t = i / (heads * half), h = (i / half) % heads, j = i % half;
    const int64_t p = pos ? pos[t] : q0 + t % qn; // a full forward: the query window's (qn = S: none)
    ds4d_rope_pair(x + (t * heads + h) * width + width - 2 * half, cs + p * 2 * half, j, sign);
}

__global__ void scale_kernel(float *x, int64_t n, float s) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

__global__ void copy_rows_kernel(char *dst, int64_t ldd, const char *src, int64_t lds, int64_t row_bytes) {
    const int64_t r = blockIdx.x;
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[r * ldd + i] = src[r * lds + i];
}

// mode 0: dst[r] = src[idx[r] / div]; 1: dst[idx[r]] = src[r]; 2: dst[idx[r]] += src[r]
__global__ void rows_kernel(float *dst, const float *src, const int32_t *idx, int64_t div, int64_t width, int mode) {
    const int64_t r = blockIdx.x;
    const int64_t j = idx[r];
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
        if (mode == 0) dst[r * width + i] = src[(j / div) * width + i];
        else if (mode == 1) dst[j * width + i] = src[r * width + i];
        else dst[j * width + i] += src[r * width + i];
    }
}

// The same, four values at a time (width % 4 == 0, dst and src 16-byte aligned): a row of 1024 is one 16-byte load
// and store per thread; the scalar loop issued each store before the next load (dst may alias src for the compiler),
// four memory round trips a thread. The same values land, and add_rows adds each element once, the same fp32 add.
__global__ void rows4_kernel(float4 *dst, const float4 *src, const int32_t *idx, int64_t div, int64_t width4, int mode) {
    const int64_t r = blockIdx.x;
    const int64_t j = idx[r];
    for (int64_t i = threadIdx.x; i < width4; i += blockDim.x) {
        if (mode == 0) {
            dst[r * width4 + i] = src[(j / div) * width4 + i];
        } else if (mode == 1) {
            dst[j * width4 + i] = src[r * width4 + i];
        } else {
            const float4 s = src[r * width4 + i];
            float4 v = dst[j * width4 + i];
            v.x += s.x, v.y += s.y, v.z += s.z, v.w += s.w;
            dst[j * width4 + i] = v;
        }
    }
}

// x [n] += h [n], with n = 1 stream (a plain add: backward.c's gradient sums in rows, linear_bwd_w's aligned dW). The
// operands may lie anywhere modulo 16 bytes (a gradient's place in the flat buffer), so the accesses are 4-byte
// ones, coalesced, four in flight a thread, over a grid that strides.
__global__ void __launch_bounds__(256) add_flat_kernel(float *x, const float *h, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += 4 * stride) {
        float a[4], b[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int64_t i = i0 + u * stride;
            a[u] = i < n ? x[i] : 0.0f, b[u] = i < n ? h[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int64_t i = i0 + u * stride;
            if (i < n) x[i] = a[u] + b[u];
        }
    }
}

__global__ void add_bcast_kernel(float *x, const float *h, int64_t T, int64_t n, int64_t D) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * n * D) return;
    const int64_t t = i / (n * D), c = i % D;
    x[i] += h[t * D + c];
}

unsigned rows_grid(ds4_dev *d, int64_t rows, const char *op) {
    if (rows > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: %lld rows", op, (long long)rows);
        return 0;
    }
    return (unsigned)rows;
}

} // namespace

void ds4_cuda_embed(ds4_dev *d, const ds4_a_embed *a) {
    if (a->T <= 0) return;
    if (a->edt != DS4_F32 && a->edt != DS4_BF16) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "embed: table dtype %s", ds4_dtype_name(a->edt));
        return;
    }
    const unsigned g = rows_grid(d, a->T, "embed");
    if (!g) return;
    embed_kernel<<<g, 256, 0, cdev(d)->stream>>>(a->X, a->E, a->edt == DS4_BF16, a->ids, a->T, a->n, a->D);
    ds4_cuda_launched(d, "embed", "[%lld tokens, %lld streams, %lld]", (long long)a->T, (long long)a->n, (long long)a->D);
}

void ds4_cuda_rmsnorm(ds4_dev *d, const ds4_a_rmsnorm *a) {
    if (a->rows <= 0) return;
    const unsigned g = rows_grid(d, a->rows, "rmsnorm");
    if (!g) return;
    cudaStream_t st = cdev(d)->stream;
    const int64_t W = a->width;
    // the kernel follows the width only (never the rows): a row's bits are the same alone or in any batch
    const int nt = row_threads(W);
    if (cdev(d)->row_ref || W > 256 * 16) {
        rmsnorm_kernel<<<g, nt, 0, st>>>(a->y, a->x, a->w, W, a->eps);
    } else if (W < 256) {
        const unsigned blocks = (unsigned)((a->rows + RMS_WROWS - 1) / RMS_WROWS);
        if (W <= nt) rmsnorm_warp<1><<<blocks, 32 * RMS_WROWS, 0, st>>>(a->y, a->x, a->w, a->rows, W, nt / 32, a->eps);
        else rmsnorm_warp<2><<<blocks, 32 * RMS_WROWS, 0, st>>>(a->y, a->x, a->w, a->rows, W, nt / 32, a->eps);
    } else if (W <= 256 * 4) {
        rmsnorm_block<4><<<g, 256, 0, st>>>(a->y, a->x, a->w, W, a->eps);
    } else if (W <= 256 * 8) {
        rmsnorm_block<8><<<g, 256, 0, st>>>(a->y, a->x, a->w, W, a->eps);
    } else {
        rmsnorm_block<16><<<g, 256, 0, st>>>(a->y, a->x, a->w, W, a->eps);
    }
    ds4_cuda_launched(d, "rmsnorm", "[%lld x %lld]", (long long)a->rows, (long long)W);
}

void ds4_cuda_rope(ds4_dev *d, const ds4_a_rope *a) {
    const int64_t n = a->rows.T * a->heads * a->rt.half;
    if (n <= 0) return;
    rope_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->rows.T, a->heads, a->width, a->rt.cs,
                                                                   a->rt.half, a->rows.pos, a->rows.q0,
                                                                   a->rows.qn ? a->rows.qn : a->rows.S, a->sign);
    ds4_cuda_launched(d, "rope", "[%lld rows, %lld heads, width %lld, %lld pairs]", (long long)a->rows.T,
                      (long long)a->heads, (long long)a->width, (long long)a->rt.half);
}

void ds4_cuda_scale(ds4_dev *d, const ds4_a_scale *a) {
    if (a->n <= 0) return;
    scale_kernel<<<ds4_blocks(a->n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->n, a->s);
    ds4_cuda_launched(d, "scale", "[%lld]", (long long)a->n);
}

void ds4_cuda_copy_rows(ds4_dev *d, const ds4_a_copy_rows *a) {
    if (a->rows <= 0) return;
    const unsigned g = rows_grid(d, a->rows, "copy_rows");
    if (!g) return;
    copy_rows_kernel<<<g, 128, 0, cdev(d)->stream>>>((char *)a->dst, a->ldd, (const char *)a->src, a->lds, a->row_bytes);
    ds4_cuda_launched(d, "copy_rows", "[%lld rows x %lld bytes]", (long long)a->rows, (long long)a->row_bytes);
}

static void rows_op(ds4_dev *d, const char *op, float *dst, const float *src, const int32_t *idx, int64_t div,
                    int64_t rows, int64_t width, int mode) {
    if (rows <= 0) return;
    const unsigned g = rows_grid(d, rows, op);
    if (!g) return;
    if (width % 4 == 0 && ((uintptr_t)dst & 15) == 0 && ((uintptr_t)src & 15) == 0)
        rows4_kernel<<<g, row_threads(width / 4), 0, cdev(d)->stream>>>((float4 *)dst, (const float4 *)src, idx, div,
                                                                         width / 4, mode);
    else
        rows_kernel<<<g, row_threads(width), 0, cdev(d)->stream>>>(dst, src, idx, div, width, mode);
    ds4_cuda_launched(d, op, "[%lld rows x %lld]", (long long)rows, (long long)width);
}

void ds4_cuda_gather_rows(ds4_dev *d, const ds4_a_gather_rows *a) {
    rows_op(d, "gather_rows", a->dst, a->src, a->idx, a->div, a->rows, a->width, 0);
}
void ds4_cuda_scatter_rows(ds4_dev *d, const ds4_a_scatter_rows *a) {
    rows_op(d, "scatter_rows", a->dst, a->src, a->idx, 1, a->rows, a->width, 1);
}
void ds4_cuda_add_rows(ds4_dev *d, const ds4_a_add_rows *a) {
    rows_op(d, "add_rows", a->dst, a->src, a->idx, 1, a->rows, a->width, 2);
}

void ds4_cuda_add_bcast(ds4_dev *d, const ds4_a_add_bcast *a) {
    const int64_t n = a->T * a->n * a->D;
    if (n <= 0) return;
    if (a->n == 1) { /* x[t·D + c] += h[t·D + c]: one flat add */
        const int64_t blocks = (n + 4 * 256 - 1) / (4 * 256);
        add_flat_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, cdev(d)->stream>>>(a->x, a->h, n);
    } else {
        add_bcast_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->h, a->T, a->n, a->D);
    }
    ds4_cuda_launched(d, "add_bcast", "[%lld, %lld, %lld]", (long long)a->T, (long long)a->n, (long long)a->D);
}
