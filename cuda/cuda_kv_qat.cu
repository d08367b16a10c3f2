// cuda_kv_qat.cu — the fake_quant operation on the GPU (core/ops.h): the quantisation-aware option's rounding of
// window keys and indexer queries in the forward, and the Hadamard rotation of the indexer's gradients in the
// backward. One block per vector, the vector rounded in place by the arithmetic of cuda_kv_qat.cuh, which gives the
// CPU's bits (core/fake_quant.c); a vector's result does not depend on how many there are.
#include "cuda_dev.cuh"
#include "cuda_kv_qat.cuh"

namespace {

constexpr int FQ_THREADS = 128;

// rows of every group, numbered group-major (group g at x + g·gstride), as the CPU's fake_quant_range
__global__ void __launch_bounds__(FQ_THREADS) fake_quant_kernel(float *x, int64_t rows, int64_t width, int64_t gstride,
                                                                 ds4_fq q) {
    const int64_t i = blockIdx.x;
    ds4d_fake_quant_vec(x + (i / rows) * gstride + (i % rows) * width, width, q);
}

} // namespace

// The rotation's butterflies pair channel j with j + h for every power of two h < width: a width that is not a power
// of two would pair channels past the vector (the model refuses such an indexer width before it gets here).
bool ds4_cuda_fq_shape_ok(ds4_dev *d, const char *op, int64_t width, const ds4_fq &q) {
    if (q.fmt != DS4_FQ_OFF && q.fmt != DS4_FQ_E4M3 && q.fmt != DS4_FQ_E2M1) {
        ds4_dev_fail(d, DS4_ERR_ARG, "%s: unknown fake-quantisation format %d", op, (int)q.fmt);
        return false;
    }
    if (q.hadamard && (width < 1 || (width & (width - 1)))) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "%s: the Hadamard rotation needs a power-of-two width, got %lld", op,
                     (long long)width);
        return false;
    }
    return true;
}

void ds4_cuda_fake_quant(ds4_dev *d, const ds4_a_fake_quant *a) {
    const int64_t n = (a->groups > 0 ? a->groups : 1) * a->rows;
    if (a->rows <= 0 || a->width <= 0) return;
    if (!ds4_cuda_fq_shape_ok(d, "fake_quant", a->width, a->q)) return;
    if (n > 0x7fffffff) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "fake_quant: %lld vectors (one block each; at most 2^31 - 1)", (long long)n);
        return;
    }
    fake_quant_kernel<<<(unsigned)n, FQ_THREADS, 0, cdev(d)->stream>>>(a->x, a->rows, a->width, a->gstride, a->q);
    ds4_cuda_launched(d, "fake_quant", "[%lld groups x %lld rows x %lld, fmt %d, %lld rounded, hadamard %d]",
                      (long long)(a->groups > 0 ? a->groups : 1), (long long)a->rows, (long long)a->width, (int)a->q.fmt,
                      (long long)a->q.nq, (int)a->q.hadamard);
}
