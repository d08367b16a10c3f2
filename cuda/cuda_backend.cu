// cuda_backend.cu — device discovery, the CUDA context, memory helpers, RMSNorm and the fp32 matmul.
// See cuda_backend.h for the contract. Every CUDA runtime and cuBLAS call is checked; failures become
// DS4_ERR_CUDA errors naming the operation, the shapes, the call and the CUDA error string.

#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#ifdef DS4_HAVE_NCCL
#include <nccl.h>
#endif

#include <ds4.h>

// internal.h is a C header without its own extern "C" guard: give its declarations C linkage here.
extern "C" {
#include "internal.h"
}

#include "cuda_backend.h"

struct ds4_cuda {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;                // cuBLAS's workspace (BLAS_WORKSPACE bytes)
};

// cuBLAS's own recommendation for Hopper is 32 MiB; with a workspace of our own it never allocates one itself.
constexpr size_t BLAS_WORKSPACE = (size_t)32 << 20;

// ------------------------------------------------------------------------------------------ error helpers

// Format "<context>: <call>: <cuda error string>" into err and return DS4_ERR_CUDA. Clears the
// (non-sticky) last-error state so that a later unrelated check does not see this error again.
static ds4_status cuda_fail(ds4_error *err, cudaError_t e, const char *call, const char *fmt, ...) DS4_PRINTF(4, 5);
static ds4_status cuda_fail(ds4_error *err, cudaError_t e, const char *call, const char *fmt, ...) {
    char ctx[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    (void)cudaGetLastError();
    return ds4_fail(err, DS4_ERR_CUDA, "%s: %s: %s (%s)", ctx, call, cudaGetErrorString(e), cudaGetErrorName(e));
}

static ds4_status blas_fail(ds4_error *err, cublasStatus_t s, const char *call, const char *fmt, ...) DS4_PRINTF(4, 5);
static ds4_status blas_fail(ds4_error *err, cublasStatus_t s, const char *call, const char *fmt, ...) {
    char ctx[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    return ds4_fail(err, DS4_ERR_CUDA, "%s: %s: %s (%s)", ctx, call, cublasGetStatusString(s), cublasGetStatusName(s));
}

// CUDA_CHECK(call, "context fmt", args...) — return a DS4_ERR_CUDA error from the enclosing function.
#define CUDA_CHECK(call, ...)                                                 \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) return cuda_fail(err, e_, #call, __VA_ARGS__); \
    } while (0)

#define BLAS_CHECK(call, ...)                                                           \
    do {                                                                                \
        cublasStatus_t s_ = (call);                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS) return blas_fail(err, s_, #call, __VA_ARGS__); \
    } while (0)

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

// ------------------------------------------------------------------------------------------ discovery

extern "C" ds4_status ds4_cuda_device_count(int *n, ds4_error *err) {
    if (!n) return ds4_fail(err, DS4_ERR_ARG, "cuda device count: n is NULL");
    *n = 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        (void)cudaGetLastError();
        return DS4_OK;  // no driver or no GPU: a CPU-only machine, not an error
    }
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaGetDeviceCount", "cuda device count");
    *n = count;
    return DS4_OK;
}

// Append to buf at *pos (truncating safely).
static void appendf(char *buf, size_t len, size_t *pos, const char *fmt, ...) DS4_PRINTF(4, 5);
static void appendf(char *buf, size_t len, size_t *pos, const char *fmt, ...) {
    if (*pos >= len) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *pos, len - *pos, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    *pos = ((size_t)k >= len - *pos) ? len : *pos + (size_t)k;
}

extern "C" const char *ds4_cuda_describe(char *buf, size_t len) {
    if (!buf || len == 0) return buf;
    buf[0] = 0;
    size_t pos = 0;
    int rt = 0, drv = 0;
    if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
    if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
    appendf(buf, len, &pos, "CUDA runtime %d.%d", rt / 1000, (rt % 1000) / 10);
    if (drv) appendf(buf, len, &pos, ", driver %d.%d", drv / 1000, (drv % 1000) / 10);
    else appendf(buf, len, &pos, ", no driver");
#ifdef __CUDA_ARCH_LIST__
    {
        // __CUDA_ARCH_LIST__ is e.g. "900" or "800,900": print it as "sm_90" / "sm_80 sm_90".
        const char *list = STRINGIFY(__CUDA_ARCH_LIST__);
        appendf(buf, len, &pos, ", code for");
        for (const char *q = list; *q;) {
            int a = (int)strtol(q, NULL, 10);
            appendf(buf, len, &pos, " sm_%d", a / 10);
            while (*q && *q != ',') q++;
            if (*q == ',') q++;
        }
    }
#endif
#ifdef DS4_HAVE_NCCL
    int nccl = 0;
    if (ncclGetVersion(&nccl) == ncclSuccess) {
        // Since NCCL 2.9 the code is major*10000 + minor*100 + patch; before, major*1000 + minor*100 + patch.
        if (nccl >= 10000) appendf(buf, len, &pos, ", NCCL %d.%d.%d", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
        else appendf(buf, len, &pos, ", NCCL %d.%d.%d", nccl / 1000, (nccl % 1000) / 100, nccl % 100);
    } else {
        appendf(buf, len, &pos, ", NCCL (version unavailable)");
    }
#else
    appendf(buf, len, &pos, ", no NCCL");
#endif
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        appendf(buf, len, &pos, "; no CUDA device (%s)", cudaGetErrorString(e));
        return buf;
    }
    appendf(buf, len, &pos, "; %d device%s", count, count == 1 ? "" : "s");
    for (int i = 0; i < count; i++) {
        cudaDeviceProp p;
        e = cudaGetDeviceProperties(&p, i);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            appendf(buf, len, &pos, "; [%d] properties unavailable (%s)", i, cudaGetErrorString(e));
            continue;
        }
        appendf(buf, len, &pos, "; [%d] %s, sm_%d%d, %d SMs, %.1f GiB", i, p.name, p.major, p.minor,
                p.multiProcessorCount, (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    }
    return buf;
}

// ------------------------------------------------------------------------------------------ context

extern "C" ds4_status ds4_cuda_open(int device, ds4_cuda **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "cuda open: out is NULL");
    *out = NULL;
    int count = 0;
    ds4_status st = ds4_cuda_device_count(&count, err);
    if (st != DS4_OK) return st;
    if (device < 0 || device >= count)
        return ds4_fail(err, DS4_ERR_ARG, "cuda open: device %d out of range (%d CUDA device%s)", device, count,
                        count == 1 ? "" : "s");
    ds4_cuda *c = (ds4_cuda *)calloc(1, sizeof *c);
    if (!c) return ds4_fail(err, DS4_ERR_OOM, "cuda open: cannot allocate the context");
    c->device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        free(c);
        return cuda_fail(err, e, "cudaSetDevice", "cuda open device %d", device);
    }
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(c);
        return cuda_fail(err, e, "cudaStreamCreateWithFlags", "cuda open device %d", device);
    }
    cublasStatus_t s = cublasCreate(&c->blas);
    if (s != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        ds4_cuda_close(c);
        return blas_fail(err, s, "cublasCreate", "cuda open device %d", device);
    }
    s = cublasSetStream(c->blas, c->stream);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(c->blas, CUBLAS_PEDANTIC_MATH);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetPointerMode(c->blas, CUBLAS_POINTER_MODE_HOST);
    if (s == CUBLAS_STATUS_SUCCESS) {
        e = cudaMalloc(&c->blas_ws, BLAS_WORKSPACE);
        if (e != cudaSuccess) {
            c->blas_ws = NULL;
            ds4_cuda_close(c);
            return cuda_fail(err, e, "cudaMalloc", "cuda open device %d: cuBLAS workspace of %zu bytes", device,
                             BLAS_WORKSPACE);
        }
        s = cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WORKSPACE);
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
        ds4_cuda_close(c);
        return blas_fail(err, s, "cublasSetStream/SetMathMode/SetPointerMode/SetWorkspace", "cuda open device %d",
                         device);
    }
    *out = c;
    return DS4_OK;
}

extern "C" void ds4_cuda_close(ds4_cuda *c) {
    if (!c) return;
    // Teardown errors cannot be acted on; the calls are still made in order so nothing leaks.
    if (cudaSetDevice(c->device) == cudaSuccess) {
        if (c->stream) (void)cudaStreamSynchronize(c->stream);
        if (c->blas) (void)cublasDestroy(c->blas);
        if (c->blas_ws) (void)cudaFree(c->blas_ws);
        if (c->stream) (void)cudaStreamDestroy(c->stream);
    }
    (void)cudaGetLastError();
    free(c);
}

extern "C" int ds4_cuda_device_index(const ds4_cuda *c) { return c ? c->device : -1; }
extern "C" cudaStream_t ds4_cuda_stream(const ds4_cuda *c) { return c ? c->stream : (cudaStream_t)0; }
extern "C" void *ds4_cuda_blas(const ds4_cuda *c) { return c ? (void *)c->blas : NULL; }

// ------------------------------------------------------------------------------------------ memory

#define CTX_CHECK(op)                                                                 \
    do {                                                                              \
        if (!c) return ds4_fail(err, DS4_ERR_ARG, "cuda %s: context is NULL", (op)); \
        CUDA_CHECK(cudaSetDevice(c->device), "cuda %s", (op));                       \
    } while (0)

extern "C" ds4_status ds4_cuda_alloc(ds4_cuda *c, size_t bytes, void **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "cuda alloc: out is NULL");
    *out = NULL;
    CTX_CHECK("alloc");
    if (bytes == 0) return DS4_OK;
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes), "cuda alloc %zu bytes on device %d", bytes, c->device);
    *out = p;
    return DS4_OK;
}

extern "C" void ds4_cuda_free(ds4_cuda *c, void *dev_ptr) {
    if (!dev_ptr) return;
    if (c) (void)cudaSetDevice(c->device);
    (void)cudaFree(dev_ptr);
    (void)cudaGetLastError();
}

extern "C" ds4_status ds4_cuda_upload(ds4_cuda *c, void *dev_dst, const void *host_src, size_t bytes,
                                      ds4_error *err) {
    CTX_CHECK("upload");
    if (bytes == 0) return DS4_OK;
    if (!dev_dst || !host_src) return ds4_fail(err, DS4_ERR_ARG, "cuda upload %zu bytes: NULL pointer", bytes);
    CUDA_CHECK(cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice, c->stream),
               "cuda upload %zu bytes", bytes);
    CUDA_CHECK(cudaStreamSynchronize(c->stream), "cuda upload %zu bytes (or an earlier operation on the stream)",
               bytes);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_download(ds4_cuda *c, void *host_dst, const void *dev_src, size_t bytes,
                                        ds4_error *err) {
    CTX_CHECK("download");
    if (bytes == 0) return DS4_OK;
    if (!host_dst || !dev_src) return ds4_fail(err, DS4_ERR_ARG, "cuda download %zu bytes: NULL pointer", bytes);
    CUDA_CHECK(cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost, c->stream),
               "cuda download %zu bytes", bytes);
    CUDA_CHECK(cudaStreamSynchronize(c->stream),
               "cuda download %zu bytes (or an earlier operation on the stream)", bytes);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_memset(ds4_cuda *c, void *dev_dst, int value, size_t bytes, ds4_error *err) {
    CTX_CHECK("memset");
    if (bytes == 0) return DS4_OK;
    if (!dev_dst) return ds4_fail(err, DS4_ERR_ARG, "cuda memset %zu bytes: NULL pointer", bytes);
    CUDA_CHECK(cudaMemsetAsync(dev_dst, value, bytes, c->stream), "cuda memset %zu bytes", bytes);
    return DS4_OK;
}

extern "C" ds4_status ds4_cuda_synchronize(ds4_cuda *c, ds4_error *err) {
    CTX_CHECK("synchronize");
    CUDA_CHECK(cudaStreamSynchronize(c->stream), "cuda synchronize (an operation enqueued on the stream failed)");
    return DS4_OK;
}

// ------------------------------------------------------------------------------------------ RMSNorm

static constexpr int RMS_THREADS = 256;

// Sum of v over the block; every thread gets the result. `scratch` holds one float per warp. Ends with a
// barrier, so the caller may reuse scratch right after.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
    if (warp == 0) {
        t = lane < RMS_THREADS / 32 ? scratch[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    t = scratch[0];
    __syncthreads();
    return t;
}

// One block per row (grid-stride over rows). fp32 sum of squares, 1/sqrt (correctly rounded sqrt and division,
// not the approximate rsqrtf), then x * inv * w. Each element is read and written by the same thread after
// the row's reduction, so y == x is safe. VEC: 16-byte loads/stores (dim % 4 == 0 and aligned pointers).
template <bool VEC>
__global__ void __launch_bounds__(RMS_THREADS) rmsnorm_f32_kernel(float *y, const float *x, const float *w,
                                                                    int64_t rows, int64_t dim, float eps) {
    __shared__ float scratch[RMS_THREADS / 32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float ss = 0.0f;
        if (VEC) {
            const float4 *x4 = reinterpret_cast<const float4 *>(xr);
            for (int64_t i = threadIdx.x; i < dim / 4; i += RMS_THREADS) {
                float4 v = x4[i];
                ss = fmaf(v.x, v.x, ss);
                ss = fmaf(v.y, v.y, ss);
                ss = fmaf(v.z, v.z, ss);
                ss = fmaf(v.w, v.w, ss);
            }
        } else {
            for (int64_t i = threadIdx.x; i < dim; i += RMS_THREADS) ss = fmaf(xr[i], xr[i], ss);
        }
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        if (VEC) {
            const float4 *x4 = reinterpret_cast<const float4 *>(xr);
            const float4 *w4 = reinterpret_cast<const float4 *>(w);
            float4 *y4 = reinterpret_cast<float4 *>(yr);
            for (int64_t i = threadIdx.x; i < dim / 4; i += RMS_THREADS) {
                float4 v = x4[i];
                v.x *= inv; v.y *= inv; v.z *= inv; v.w *= inv;
                if (w) {
                    float4 g = w4[i];
                    v.x *= g.x; v.y *= g.y; v.z *= g.z; v.w *= g.w;
                }
                y4[i] = v;
            }
        } else {
            for (int64_t i = threadIdx.x; i < dim; i += RMS_THREADS) {
                float v = xr[i] * inv;
                yr[i] = w ? v * w[i] : v;
            }
        }
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" ds4_status ds4_cuda_rmsnorm_f32(ds4_cuda *c, float *y, const float *x, const float *w, int64_t rows,
                                           int64_t dim, float eps, ds4_error *err) {
    const long long R = (long long)rows, Dm = (long long)dim;
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "cuda rmsnorm [%lld x %lld]: context is NULL", R, Dm);
    if (rows < 0 || dim < 1 || rows > INT64_MAX / dim)
        return ds4_fail(err, DS4_ERR_ARG, "cuda rmsnorm [%lld x %lld]: need rows >= 0 and dim >= 1", R, Dm);
    if (!(eps >= 0.0f) || !std::isfinite(eps))
        return ds4_fail(err, DS4_ERR_ARG, "cuda rmsnorm [%lld x %lld]: eps %g must be finite and >= 0", R, Dm,
                        (double)eps);
    if (rows == 0) return DS4_OK;
    if (!y || !x) return ds4_fail(err, DS4_ERR_ARG, "cuda rmsnorm [%lld x %lld]: NULL x or y", R, Dm);
    CUDA_CHECK(cudaSetDevice(c->device), "cuda rmsnorm [%lld x %lld]", R, Dm);
    const unsigned grid = (unsigned)(rows < (1 << 20) ? rows : (1 << 20));
    const bool vec = dim % 4 == 0 && aligned16(x) && aligned16(y) && (!w || aligned16(w));
    if (vec) rmsnorm_f32_kernel<true><<<grid, RMS_THREADS, 0, c->stream>>>(y, x, w, rows, dim, eps);
    else rmsnorm_f32_kernel<false><<<grid, RMS_THREADS, 0, c->stream>>>(y, x, w, rows, dim, eps);
    CUDA_CHECK(cudaGetLastError(), "cuda rmsnorm [%lld x %lld]", R, Dm);
    return DS4_OK;
}

// ------------------------------------------------------------------------------------------ matmul

extern "C" ds4_status ds4_cuda_matmul_f32(ds4_cuda *c, float *y, const float *x, const float *w, int64_t m,
                                          int64_t k, int64_t n, ds4_error *err) {
    const long long M = (long long)m, K = (long long)k, N = (long long)n;
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "cuda matmul [%lld x %lld] x [%lld x %lld]^T: context is NULL", M, K, N, K);
    if (m < 0 || k < 0 || n < 0 || m > INT_MAX || k > INT_MAX || n > INT_MAX)
        return ds4_fail(err, DS4_ERR_ARG, "cuda matmul [%lld x %lld] x [%lld x %lld]^T: sizes must be in [0, %d]", M,
                        K, N, K, INT_MAX);
    if (m == 0 || n == 0) return DS4_OK;
    if (!y || (k > 0 && (!x || !w)))
        return ds4_fail(err, DS4_ERR_ARG, "cuda matmul [%lld x %lld] x [%lld x %lld]^T: NULL pointer", M, K, N, K);
    CUDA_CHECK(cudaSetDevice(c->device), "cuda matmul [%lld x %lld] x [%lld x %lld]^T", M, K, N, K);
    if (k == 0) {
        CUDA_CHECK(cudaMemsetAsync(y, 0, (size_t)m * (size_t)n * sizeof(float), c->stream),
                   "cuda matmul [%lld x 0] x [%lld x 0]^T", M, N);
        return DS4_OK;
    }
    // Row-major y[m,n] = x[m,k] W[n,k]^T is, read column-major, y^T[n,m] = W^T... i.e. cuBLAS computes
    // C(n x m) = op(A) B with A = W seen as column-major [k x n] (lda k) transposed, B = x seen as
    // column-major [k x m] (ldb k), C = y seen as column-major [n x m] (ldc n).
    const float one = 1.0f, zero = 0.0f;
    BLAS_CHECK(cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, w, (int)k, x, (int)k,
                           &zero, y, (int)n),
               "cuda matmul [%lld x %lld] x [%lld x %lld]^T", M, K, N, K);
    CUDA_CHECK(cudaGetLastError(), "cuda matmul [%lld x %lld] x [%lld x %lld]^T", M, K, N, K);
    return DS4_OK;
}
