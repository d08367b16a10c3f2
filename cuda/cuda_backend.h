/* cuda_backend.h — the CUDA backend of libds4 (C API; built only when nvcc is found, which defines
 * DS4_HAVE_CUDA for everything that links ds4core).
 *
 * The CUDA backend implements the same operations as the fp32 CPU reference, over device memory. This first
 * slice holds device discovery, a context (device + stream + cuBLAS handle), memory helpers, RMSNorm and the
 * fp32 matmul y = x Wᵀ. More operations of the backend table (rope, attention-with-sink, grouped matmul,
 * compressor, indexer top-k, sinkhorn, cross-entropy, adamw, ...) join this header as they are written.
 *
 * Conventions
 *   - Every fallible function returns a ds4_status and fills `err` (may be NULL). CUDA and cuBLAS failures
 *     are DS4_ERR_CUDA with a message naming the operation, the shapes, the failing call and the CUDA error
 *     string; invalid arguments are DS4_ERR_ARG. Nothing here exits or aborts.
 *   - Operations are enqueued on the context's stream and return before the GPU has finished: an error that
 *     happens while a kernel runs is reported by the next synchronising call (ds4_cuda_synchronize,
 *     ds4_cuda_download, ds4_cuda_upload), whose message says so.
 *   - Pointers passed to operations are device pointers (ds4_cuda_alloc), row-major, contiguous, fp32.
 *   - Weights use the PyTorch nn.Linear layout W [out, in].
 *   - A context is used by one host thread at a time.
 */
#ifndef DS4_CUDA_BACKEND_H
#define DS4_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices visible to this process. A machine without a driver or without a device is not an
 * error: *n = 0 and DS4_OK (cudaErrorNoDevice, cudaErrorInsufficientDriver). Any other CUDA error is
 * DS4_ERR_CUDA. */
ds4_status ds4_cuda_device_count(int *n, ds4_error *err);

/* A one-line human description: CUDA runtime and driver versions, the architectures this build holds code
 * for, each device (name, compute capability, SMs, memory), and the NCCL version when built with NCCL.
 * Never fails: problems are described in the text. Returns buf (NUL-terminated, truncated to len). */
const char *ds4_cuda_describe(char *buf, size_t len);

/* ------------------------------------------------------------------------------------------------ context */

typedef struct ds4_cuda ds4_cuda;

/* Open device `device` (0-based): a non-blocking stream and a cuBLAS handle bound to it, with cuBLAS in
 * pedantic fp32 math (no TF32, no reduced-precision shortcuts), so the backend's matmul is a true fp32
 * reference. */
ds4_status ds4_cuda_open(int device, ds4_cuda **out, ds4_error *err);
/* Release the context (waits for its stream). NULL is allowed. */
void ds4_cuda_close(ds4_cuda *c);
int ds4_cuda_device_index(const ds4_cuda *c);
#ifdef __CUDACC__
/* The context's stream (CUDA code only). */
cudaStream_t ds4_cuda_stream(const ds4_cuda *c);
/* The context's cuBLAS handle (a cublasHandle_t) on that stream: pedantic math (no TF32), host scalars, and a
 * workspace of its own allocated at open, so that a cuBLAS call never allocates inside a pass or a recorded graph. */
void *ds4_cuda_blas(const ds4_cuda *c);
#endif

/* The model backend of core/ops.h on device `device` (cuda_dev.cu): a context of its own; *out has one reference. */
struct ds4_dev;
ds4_status ds4_cuda_dev_create(int device, struct ds4_dev **out, ds4_error *err);

/* How many tile shapes the pipelined bf16 product has (cuda_gemm.cu's pipe_cfgs): DS4_CUDA_GEMM_PIPE = 0 .. n - 1,
 * read when a backend is created, picks one; each gives the same bits (tests/test_cuda_gemm_bits.c). */
int ds4_cuda_gemm_pipe_count(void);

/* ------------------------------------------------------------------------------------------------ memory */

/* cudaMalloc on the context's device; bytes == 0 gives *out = NULL. */
ds4_status ds4_cuda_alloc(ds4_cuda *c, size_t bytes, void **out, ds4_error *err);
/* cudaFree (synchronises the device). NULL is allowed. */
void ds4_cuda_free(ds4_cuda *c, void *dev_ptr);
/* Host -> device and device -> host copies, ordered on the context's stream; they return once the copy is
 * done, so the host buffer may be reused at once (and a download sees every operation enqueued before it). */
ds4_status ds4_cuda_upload(ds4_cuda *c, void *dev_dst, const void *host_src, size_t bytes, ds4_error *err);
ds4_status ds4_cuda_download(ds4_cuda *c, void *host_dst, const void *dev_src, size_t bytes, ds4_error *err);
/* Set `bytes` bytes at dev_dst to the byte value `value` (cudaMemsetAsync on the stream). */
ds4_status ds4_cuda_memset(ds4_cuda *c, void *dev_dst, int value, size_t bytes, ds4_error *err);
/* Wait for everything enqueued on the context's stream; reports asynchronous kernel errors. */
ds4_status ds4_cuda_synchronize(ds4_cuda *c, ds4_error *err);

/* ------------------------------------------------------------------------------------------------ operations */

/* RMSNorm over the last axis: y[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) * w, for r < rows.
 * x, y [rows, dim]; w [dim], or NULL for the unweighted RMS (per-head q norm, mHC coefficient norm).
 * fp32 throughout; y may equal x (in place). rows >= 0, dim >= 1, eps >= 0. */
ds4_status ds4_cuda_rmsnorm_f32(ds4_cuda *c, float *y, const float *x, const float *w, int64_t rows, int64_t dim,
                                float eps, ds4_error *err);

/* y = x Wᵀ: x [m, k], W [n, k] (nn.Linear layout [out, in]), y [m, n], all row-major fp32, through cuBLAS
 * SGEMM in pedantic fp32 math (TF32 off). y must not overlap x or W. m, k, n in [0, INT_MAX]; k == 0 gives
 * y = 0. */
ds4_status ds4_cuda_matmul_f32(ds4_cuda *c, float *y, const float *x, const float *w, int64_t m, int64_t k,
                               int64_t n, ds4_error *err);

#ifdef __cplusplus
}
#endif
#endif /* DS4_CUDA_BACKEND_H */
