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

__global__ void rope_kernel(float *x, int64_t T, int64_t heads, int64_t width, const float *cs, int64_t half,
                            const int64_t *pos, int64_t S, int sign) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * heads * half) return;
    const int64_t t = i / (heads * half), h = (i / half) % heads, j = i % half;
    const int64_t p = pos ? pos[t] : t % S;
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
    rmsnorm_kernel<<<g, row_threads(a->width), 0, cdev(d)->stream>>>(a->y, a->x, a->w, a->width, a->eps);
    ds4_cuda_launched(d, "rmsnorm", "[%lld x %lld]", (long long)a->rows, (long long)a->width);
}

void ds4_cuda_rope(ds4_dev *d, const ds4_a_rope *a) {
    const int64_t n = a->rows.T * a->heads * a->rt.half;
    if (n <= 0) return;
    rope_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->rows.T, a->heads, a->width, a->rt.cs,
                                                                   a->rt.half, a->rows.pos, a->rows.S, a->sign);
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
    add_bcast_kernel<<<ds4_blocks(n, 256), 256, 0, cdev(d)->stream>>>(a->x, a->h, a->T, a->n, a->D);
    ds4_cuda_launched(d, "add_bcast", "[%lld, %lld, %lld]", (long long)a->T, (long long)a->n, (long long)a->D);
}
