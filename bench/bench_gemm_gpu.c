/* bench_gemm_gpu.c — ds4's batch-invariant bf16 products on a CUDA GPU against cuBLAS on the same shapes: the
 * matmul and matmul_grouped operations of one training step of the 599M bench config (batch 8 x 1024; the shapes
 * the per-op profile lists, DS4_PROFILE_SHAPES=1), x fp32 [M, K] (rounded to bf16 inside the operation, as the model
 * runs it), W bf16 [N, K], y fp32 [M, N]. cuBLAS gets x already in bf16 (cublasGemmEx, bf16 in, fp32 accumulate and
 * out, its default algorithm), which is what a user would call; it is not batch-invariant (its algorithm and
 * K-split change with M), which is why ds4 has its own kernels.
 *
 *   build/bench_gemm_gpu [--reps 20] [--variants K] [--bwd]
 * Prints per shape: microseconds (median of reps), TFLOP/s, and ds4 / cuBLAS time (the default kernels: on an H100 or
 * H200 the wgmma one, cuda/cuda_gemm_wgmma.cu). --variants K also times the mma.sync pipeline's shapes 0..K-2
 * (DS4_CUDA_GEMM_WGMMA=0 with DS4_CUDA_GEMM_PIPE, cuda_gemm.cu: each gives the same bits), one column each, and says
 * whether every shape's y was bitwise the same (--variants 0: all of them).
 * --bwd times the backward's products instead (linear_bwd_x / _w and their grouped forms, bf16 mode) on the same
 * step's shapes, as backward.c issues them: per dense shape dx alone, dW alone, the pair with dW reusing dx's bf16 dy
 * (dy_kept), the pair on a DS4_CUDA_BWD_REF=1 backend (dy rounded twice: the path before), and cuBLAS's two GEMMs
 * on operands given in bf16 (what the products cost without the roundings); per expert shape dx and dW against the
 * reference tiles (DS4_CUDA_BWD_REF=1), whose bits they must give. Then the per-step sums over each shape's calls.
 * It measures, never passes or fails; without a CUDA build or device it says so and exits 0. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "ds4.h"

#ifndef DS4_HAVE_CUDA
int main(void) {
    puts("bench_gemm_gpu: built without the CUDA backend");
    return 0;
}
#else
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "cuda_backend.h"
#include "ops.h"

#define CU(call)                                                                                          \
    do {                                                                                                  \
        const cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) DIE("bench_gemm_gpu: %s: %s", #call, cudaGetErrorString(e_));              \
    } while (0)

typedef struct {
    const char *what;
    int64_t M, K, N, G, E; /* G: column groups (batched); E > 0: rows grouped evenly by E experts */
} shape;

/* The products of one step of bench/config_599m.json at batch 8 x 1024 (T = 8192 tokens; top-4 of 32 experts:
 * 32768 expert rows; the LM head in chunks of 1024 rows). */
static const shape shapes[] = {
    {"LM head chunk", 1024, 1024, 32000, 1, 0},
    {"attention output (grouped)", 8192, 8192, 1024, 1, 0},
    {"query up-projection", 8192, 1024, 2048, 1, 0},
    {"hidden -> 1024", 8192, 1024, 1024, 1, 0},
    {"hidden -> 512", 8192, 1024, 512, 1, 0},
    {"512 -> hidden", 8192, 512, 1024, 1, 0},
    {"hidden -> 128", 8192, 1024, 128, 1, 0},
    {"8 groups 256 -> 1024", 8192, 256, 1024, 8, 0},
    {"experts gate/up (by expert)", 32768, 1024, 512, 1, 32},
    {"experts down (by expert)", 32768, 512, 1024, 1, 32},
};

static int cmp_f(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_f);
    return v[n / 2];
}

/* ------------------------------------------------------------------------------------------------ --bwd */

/* A dense product of the backward: dx [T, K] = dy [T, O]·W, dW [O, K] += dyᵀ·x, row strides ldy, ldx (0: dense);
 * calls: per step. fp32: an fp32 weight of the bf16 mode (dx through ds4's tiles, dW through cuBLAS's fp32 GEMM). */
typedef struct {
    const char *what;
    int64_t T, K, O, ldy, ldx, calls;
    int fp32;
} bwd_shape;

static const bwd_shape bwd_shapes[] = {
    {"LM head chunk", 1024, 1024, 32000, 0, 0, 8, 0},
    {"attention output wo_b", 8192, 8192, 1024, 0, 0, 8, 0},
    {"wo_a group (of 8)", 8192, 256, 1024, 8192, 2048, 64, 0},
    {"query up wq_b", 8192, 1024, 2048, 0, 0, 8, 0},
    {"query down wq_a", 8192, 1024, 1024, 0, 0, 8, 0},
    {"shared sw1 / sw3", 8192, 1024, 512, 0, 0, 16, 0},
    {"shared sw2", 8192, 512, 1024, 0, 0, 8, 0},
    {"compressor CSA", 8192, 1024, 256, 0, 0, 8, 0},
    {"wkv, compressor HCA", 8192, 1024, 128, 0, 0, 16, 0},
    {"mHC fn (fp32)", 8192, 4096, 24, 0, 0, 16, 1},
    {"router gate (fp32)", 8192, 1024, 32, 0, 0, 8, 1},
};

/* An expert product: rows by E experts (evenly), dx [rows, K] = dy [rows, O]·W_e, dW_e [O, K] += dyᵀ·x; calls per
 * step. */
static const bwd_shape bwd_grouped[] = {
    {"experts w2 (dy 1024 -> 512)", 32768, 512, 1024, 0, 0, 8, 0},
    {"experts w1 / w3 (512 -> 1024)", 32768, 1024, 512, 0, 0, 16, 0},
};

static float *dev_random(size_t n, uint64_t seed, int bf16) {
    void *p;
    CU(cudaMalloc(&p, n * (bf16 ? 2 : 4)));
    float *h = malloc(n * 4);
    uint16_t *hb = bf16 ? malloc(n * 2) : NULL;
    uint64_t r = 0x9e3779b97f4a7c15ull + seed;
    for (size_t i = 0; i < n; i++) {
        r ^= r >> 12, r ^= r << 25, r ^= r >> 27;
        h[i] = (float)((r * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0f - 0.5f;
        if (bf16) hb[i] = ds4_f32_to_bf16(0.05f * h[i]);
    }
    CU(cudaMemcpy(p, bf16 ? (void *)hb : (void *)h, n * (bf16 ? 2 : 4), cudaMemcpyHostToDevice));
    free(h), free(hb);
    return p;
}

enum { B_X, B_W, B_PAIR, B_BLAS, B_GX, B_GW };

typedef struct {
    const bwd_shape *sh;
    float *dy, *x, *dx, *dW, *dyb, *xb;
    void *W;
    int64_t *off, E;
    cublasHandle_t h;
} bwd_case;

/* one run of `what` on backend d (the pair: dx then dW with dy_kept, as lin_bwd issues them) */
static void bwd_run(ds4_dev *d, const bwd_case *c, int what) {
    const bwd_shape *s = c->sh;
    const int64_t ldy = s->ldy ? s->ldy : s->O, ldx = s->ldx ? s->ldx : s->K;
    const ds4_dtype wdt = s->fp32 ? DS4_F32 : DS4_BF16;
    const int bf = !s->fp32;
    if (what == B_X || what == B_PAIR)
        OP(d, linear_bwd_x, .dx = c->dx, .lddx = s->K, .dy = c->dy, .ldy = ldy, .W = c->W, .wdt = wdt, .T = s->T,
           .K = s->K, .O = s->O, .bf16_in = bf);
    if (what == B_W || what == B_PAIR)
        OP(d, linear_bwd_w, .dW = c->dW, .dy = c->dy, .ldy = ldy, .x = c->x, .ldx = ldx, .T = s->T, .K = s->K,
           .O = s->O, .wdt = wdt, .bf16_in = bf, .any_order = s->fp32, .dy_kept = what == B_PAIR);
    if (what == B_GX)
        OP(d, linear_bwd_x_grouped, .dx = c->dx, .dy = c->dy, .W = c->W, .wdt = DS4_BF16, .wstride = s->O * s->K,
           .off = c->off, .E = c->E, .rows = s->T, .K = s->K, .O = s->O, .bf16_in = 1);
    if (what == B_GW)
        OP(d, linear_bwd_w_grouped, .dW = c->dW, .wstride = s->O * s->K, .dy = c->dy, .x = c->x, .off = c->off,
           .E = c->E, .rows = s->T, .K = s->K, .O = s->O, .wdt = DS4_BF16, .bf16_in = 1);
    if (what == B_BLAS) { /* column-major, as cuda_bwd_linear.cu calls them, on operands already in bf16 */
        const float one = 1.0f, zero = 0.0f;
        cublasStatus_t bs = cublasGemmEx(c->h, CUBLAS_OP_N, CUBLAS_OP_N, (int)s->K, (int)s->T, (int)s->O, &one, c->W,
                                         CUDA_R_16BF, (int)s->K, c->dyb, CUDA_R_16BF, (int)s->O, &zero, c->dx,
                                         CUDA_R_32F, (int)s->K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (bs == CUBLAS_STATUS_SUCCESS)
            bs = cublasGemmEx(c->h, CUBLAS_OP_N, CUBLAS_OP_T, (int)s->K, (int)s->O, (int)s->T, &one, c->xb,
                              CUDA_R_16BF, (int)s->K, c->dyb, CUDA_R_16BF, (int)s->O, &one, c->dW, CUDA_R_32F,
                              (int)s->K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (bs != CUBLAS_STATUS_SUCCESS) DIE("bench_gemm_gpu: %s: cublasGemmEx: %d", s->what, (int)bs);
    }
    if (d->st) DIE("bench_gemm_gpu: %s: %s", s->what, d->err.msg);
}

/* median microseconds of reps runs (after two warm-ups) */
static float bwd_time(ds4_dev *d, const bwd_case *c, int what, int reps, float *ts) {
    cudaStream_t st = (cudaStream_t)d->ops->native_stream(d);
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    for (int i = -2; i < reps; i++) {
        CU(cudaEventRecord(e0, st));
        bwd_run(d, c, what);
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        if (i >= 0) CU(cudaEventElapsedTime(&ts[i], e0, e1));
    }
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return 1e3f * median(ts, reps);
}

/* dW (or dx: what B_X) after one run of `what` from zeros on backend d, downloaded into host (n floats) */
static void bwd_result(ds4_dev *d, const bwd_case *c, int what, float *host, size_t n) {
    float *out = what == B_X ? c->dx : c->dW;
    CU(cudaMemset(out, 0, n * 4));
    CU(cudaDeviceSynchronize()); /* the backend's stream does not wait for the default one */
    bwd_run(d, c, what);
    CU(cudaStreamSynchronize((cudaStream_t)d->ops->native_stream(d)));
    CU(cudaMemcpy(host, out, n * 4, cudaMemcpyDeviceToHost));
}

static void bwd_bench(int reps) {
    ds4_dev *fast, *ref;
    ds4_error err;
    if (ds4_cuda_dev_create(0, &fast, &err)) DIE("bench_gemm_gpu: %s", err.msg);
    setenv("DS4_CUDA_BWD_REF", "1", 1); /* read when the backend is created */
    if (ds4_cuda_dev_create(0, &ref, &err)) DIE("bench_gemm_gpu: %s", err.msg);
    unsetenv("DS4_CUDA_BWD_REF");
    cudaStream_t st = (cudaStream_t)fast->ops->native_stream(fast);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h, st) != CUBLAS_STATUS_SUCCESS)
        DIE("bench_gemm_gpu: cuBLAS handle");
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    float *ts = malloc(sizeof(float) * (size_t)reps);
    printf("# %s, %d SMs; the backward's products (bf16 mode) as backward.c issues them; us, median of %d\n", prop.name,
           prop.multiProcessorCount, reps);
    printf("%-24s %22s %5s %9s %9s %9s %9s %9s %8s %s\n", "dense product", "T x K x O", "calls", "dx", "dW", "pair",
           "pair ref", "cuBLAS", "TFLOP/s", "bits");
    double step[5] = {0};
    for (size_t i = 0; i < sizeof bwd_shapes / sizeof *bwd_shapes; i++) {
        const bwd_shape *s = &bwd_shapes[i];
        const int64_t ldy = s->ldy ? s->ldy : s->O, ldx = s->ldx ? s->ldx : s->K;
        bwd_case c = {.sh = s, .h = h};
        c.dy = dev_random((size_t)(s->T * ldy), 3 * i, 0);
        c.x = dev_random((size_t)(s->T * ldx), 3 * i + 1, 0);
        c.W = dev_random((size_t)(s->O * s->K), 3 * i + 2, !s->fp32);
        c.dyb = s->fp32 ? NULL : dev_random((size_t)(s->T * s->O), 3 * i, 1);
        c.xb = s->fp32 ? NULL : dev_random((size_t)(s->T * s->K), 3 * i + 1, 1);
        CU(cudaMalloc((void **)&c.dx, (size_t)(s->T * s->K) * 4));
        CU(cudaMalloc((void **)&c.dW, (size_t)(s->O * s->K) * 4));
        CU(cudaMemset(c.dW, 0, (size_t)(s->O * s->K) * 4));
        const float t[5] = {bwd_time(fast, &c, B_X, reps, ts), bwd_time(fast, &c, B_W, reps, ts),
                            bwd_time(fast, &c, B_PAIR, reps, ts), bwd_time(ref, &c, B_PAIR, reps, ts),
                            s->fp32 ? 0.0f : bwd_time(fast, &c, B_BLAS, reps, ts)};
        for (int k = 0; k < 5; k++) step[k] += (double)s->calls * t[k];
        const double flop = 4.0 * (double)s->T * (double)s->K * (double)s->O;
        const size_t nx = (size_t)(s->T * s->K); /* dx of the fast path against the reference path's (the tiles) */
        float *ha = malloc(nx * 4), *hb = malloc(nx * 4);
        bwd_result(fast, &c, B_X, ha, nx);
        bwd_result(ref, &c, B_X, hb, nx);
        const int same = !memcmp(ha, hb, nx * 4);
        free(ha), free(hb);
        char dims[48];
        snprintf(dims, sizeof dims, "%lld x %lld x %lld", (long long)s->T, (long long)s->K, (long long)s->O);
        printf("%-24s %22s %5lld %9.1f %9.1f %9.1f %9.1f %9.1f %8.1f %s\n", s->what, dims, (long long)s->calls, t[0],
               t[1], t[2], t[3], t[4], flop / (1e6 * t[2]), same ? "dx same bits" : "dx BITS DIFFER");
        cudaFree(c.dy), cudaFree(c.x), cudaFree(c.W), cudaFree(c.dyb), cudaFree(c.xb), cudaFree(c.dx), cudaFree(c.dW);
    }
    printf("%-24s %22s %5s %9.2f %9.2f %9.2f %9.2f %9.2f   (ms per step)\n", "dense, per step", "", "", step[0] / 1e3,
           step[1] / 1e3, step[2] / 1e3, step[3] / 1e3, step[4] / 1e3);
    printf("ds4 bwd_dense_pair_ms %.3f\nds4 bwd_dense_pair_ref_ms %.3f\n", step[2] / 1e3, step[3] / 1e3);
    printf("%-30s %22s %5s %9s %9s %9s %9s %8s %s\n", "expert product", "rows x K x O by E", "calls", "dx", "dW",
           "dx ref", "dW ref", "TFLOP/s", "bits");
    double gstep[4] = {0};
    for (size_t i = 0; i < sizeof bwd_grouped / sizeof *bwd_grouped; i++) {
        const bwd_shape *s = &bwd_grouped[i];
        bwd_case c = {.sh = s, .h = h, .E = 32};
        c.dy = dev_random((size_t)(s->T * s->O), 7 * i, 0);
        c.x = dev_random((size_t)(s->T * s->K), 7 * i + 1, 0);
        c.W = dev_random((size_t)(c.E * s->O * s->K), 7 * i + 2, 1);
        CU(cudaMalloc((void **)&c.dx, (size_t)(s->T * s->K) * 4));
        CU(cudaMalloc((void **)&c.dW, (size_t)(c.E * s->O * s->K) * 4));
        CU(cudaMemset(c.dW, 0, (size_t)(c.E * s->O * s->K) * 4));
        int64_t ho[33];
        for (int64_t e = 0; e <= c.E; e++) ho[e] = e * s->T / c.E + (e > 0 && e < c.E ? 3 * (e % 5) - 6 : 0); /* ragged */
        CU(cudaMalloc((void **)&c.off, sizeof ho));
        CU(cudaMemcpy(c.off, ho, sizeof ho, cudaMemcpyHostToDevice));
        const float t[4] = {bwd_time(fast, &c, B_GX, reps, ts), bwd_time(fast, &c, B_GW, reps, ts),
                            bwd_time(ref, &c, B_GX, reps, ts), bwd_time(ref, &c, B_GW, reps, ts)};
        for (int k = 0; k < 4; k++) gstep[k] += (double)s->calls * t[k];
        const size_t nw = (size_t)(c.E * s->O * s->K);
        float *a = malloc(nw * 4), *b = malloc(nw * 4);
        bwd_result(fast, &c, B_GW, a, nw);
        bwd_result(ref, &c, B_GW, b, nw);
        const int same = !memcmp(a, b, nw * 4);
        free(a), free(b);
        char dims[48];
        snprintf(dims, sizeof dims, "%lld x %lld x %lld by %lld", (long long)s->T, (long long)s->K, (long long)s->O,
                 (long long)c.E);
        printf("%-30s %22s %5lld %9.1f %9.1f %9.1f %9.1f %8.1f %s\n", s->what, dims, (long long)s->calls, t[0], t[1],
               t[2], t[3], 2.0 * (double)s->T * (double)s->K * (double)s->O / (1e6 * t[1]),
               same ? "dW same bits" : "dW BITS DIFFER");
        cudaFree(c.dy), cudaFree(c.x), cudaFree(c.W), cudaFree(c.dx), cudaFree(c.dW), cudaFree(c.off);
    }
    printf("%-30s %22s %5s %9.2f %9.2f %9.2f %9.2f   (ms per step)\n", "experts, per step", "", "", gstep[0] / 1e3,
           gstep[1] / 1e3, gstep[2] / 1e3, gstep[3] / 1e3);
    printf("ds4 bwd_expert_dx_ms %.3f\nds4 bwd_expert_dw_ms %.3f\n", gstep[0] / 1e3, gstep[1] / 1e3);
    free(ts);
    cublasDestroy(h);
    ds4_dev_release(fast);
    ds4_dev_release(ref);
}

int main(int argc, char **argv) {
    int reps = 20, nv = 1, bwd = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--variants") && i + 1 < argc) nv = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bwd")) bwd = 1;
        else DIE("usage: %s [--reps N] [--variants K] [--bwd]", argv[0]);
    }
    if (reps < 1 || reps > 1000) DIE("bench_gemm_gpu: --reps %d (1..1000)", reps);
    if (nv == 0) nv = ds4_cuda_gemm_pipe_count() + 1;
    if (nv < 1 || nv > 16) DIE("bench_gemm_gpu: --variants %d (1..16)", nv);
    int ndev = 0;
    ds4_error err;
    if (ds4_cuda_device_count(&ndev, &err) || ndev == 0) {
        puts("bench_gemm_gpu: no CUDA device");
        return 0;
    }
    if (bwd) {
        bwd_bench(reps);
        return 0;
    }
    ds4_dev *devs[16];
    for (int v = 0; v < nv; v++) { /* the backend reads DS4_CUDA_GEMM_PIPE and _WGMMA when it is created */
        char val[16];
        snprintf(val, sizeof val, "%d", v > 0 ? v - 1 : 0);
        if (v > 0) setenv("DS4_CUDA_GEMM_PIPE", val, 1), setenv("DS4_CUDA_GEMM_WGMMA", "0", 1);
        if (ds4_cuda_dev_create(0, &devs[v], &err)) DIE("bench_gemm_gpu: %s", err.msg);
    }
    unsetenv("DS4_CUDA_GEMM_PIPE"), unsetenv("DS4_CUDA_GEMM_WGMMA");
    ds4_dev *d = devs[0];
    cudaStream_t st = (cudaStream_t)d->ops->native_stream(d);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h, st) != CUBLAS_STATUS_SUCCESS)
        DIE("bench_gemm_gpu: cuBLAS handle");
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("# %s, %d SMs; ds4 bf16 products (x fp32 rounded inside, batch-invariant) vs cuBLAS bf16 (x given in bf16); "
           "median of %d\n", prop.name, prop.multiProcessorCount, reps);
    printf("%-28s %26s %10s %8s %10s %8s %8s", "product", "[M x K] x [N x K]^T", "ds4 us", "TFLOP/s", "cuBLAS us",
           "TFLOP/s", "ds4/cuB");
    for (int v = 1; v < nv; v++) printf("   pipe %d us", v - 1);
    printf("\n");
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float *ts = malloc(sizeof(float) * (size_t)reps);
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        const shape sh = shapes[s];
        const int64_t M = sh.M, K = sh.K, N = sh.N, G = sh.G;
        const size_t nx = (size_t)(M * K * G), nw = (size_t)(N * K * G), ny = (size_t)(M * N * G);
        const size_t nwe = sh.E ? nw * (size_t)sh.E : nw;
        float *hx = malloc(nx * 4);
        uint16_t *hw = malloc(nwe * 2);
        uint64_t r = 0x9e3779b97f4a7c15ull + s;
        for (size_t i = 0; i < nx; i++) {
            r ^= r >> 12, r ^= r << 25, r ^= r >> 27;
            hx[i] = (float)((r * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0f - 0.5f;
        }
        for (size_t i = 0; i < nwe; i++) hw[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 20) % 0x200); /* ~±0.01 */
        float *x, *y;
        void *W;
        uint16_t *xb; /* x rounded to bf16 for cuBLAS */
        int64_t *off = NULL;
        CU(cudaMalloc((void **)&x, nx * 4));
        CU(cudaMalloc((void **)&y, ny * 4));
        CU(cudaMalloc(&W, nwe * 2));
        CU(cudaMalloc((void **)&xb, nx * 2));
        CU(cudaMemcpy(x, hx, nx * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(W, hw, nwe * 2, cudaMemcpyHostToDevice));
        uint16_t *hb = malloc(nx * 2);
        for (size_t i = 0; i < nx; i++) hb[i] = ds4_f32_to_bf16(hx[i]);
        CU(cudaMemcpy(xb, hb, nx * 2, cudaMemcpyHostToDevice));
        if (sh.E) {
            int64_t *ho = malloc(sizeof(int64_t) * (size_t)(sh.E + 1));
            for (int64_t e = 0; e <= sh.E; e++) ho[e] = e * M / sh.E;
            CU(cudaMalloc((void **)&off, sizeof(int64_t) * (size_t)(sh.E + 1)));
            CU(cudaMemcpy(off, ho, sizeof(int64_t) * (size_t)(sh.E + 1), cudaMemcpyHostToDevice));
            free(ho);
        }
        /* ds4: the operation as the schedule calls it, on each variant's backend */
        float t_var[16];
        float *yfirst = malloc(ny * 4), *yv = malloc(ny * 4);
        int differ = -1; /* a variant whose y is not the first one's, bit for bit (cuda_gemm.cu: none may be) */
        for (int v = nv - 1; v >= 0; v--) {
            ds4_dev *dv = devs[v];
            cudaStream_t sv = (cudaStream_t)dv->ops->native_stream(dv);
            for (int i = -2; i < reps; i++) {
                CU(cudaEventRecord(e0, sv));
                if (sh.E)
                    OP(dv, matmul_grouped, .y = y, .x = x, .W = W, .wdt = DS4_BF16, .rows = M, .K = K, .O = N,
                       .off = off, .E = sh.E, .wstride = N * K, .bf16_in = 1);
                else
                    OP(dv, matmul, .y = y, .ldy = N * G, .x = x, .ldx = K * G, .W = W, .wdt = DS4_BF16, .T = M,
                       .K = K, .O = N, .groups = G, .gx = K, .gy = N, .gw = N * K, .bf16_in = 1);
                CU(cudaEventRecord(e1, sv));
                CU(cudaEventSynchronize(e1));
                if (dv->st) DIE("bench_gemm_gpu: %s: %s", sh.what, dv->err.msg);
                if (i >= 0) CU(cudaEventElapsedTime(&ts[i], e0, e1));
            }
            t_var[v] = median(ts, reps);
            CU(cudaMemcpy(v == nv - 1 ? yfirst : yv, y, ny * 4, cudaMemcpyDeviceToHost));
            if (v < nv - 1 && memcmp(yfirst, yv, ny * 4)) differ = v;
        }
        free(yfirst), free(yv);
        const float t_ds4 = t_var[0];
        /* cuBLAS: y (row-major [M, N]) = column-major yᵀ [N x M] = Wᵀ... W row-major [N, K] is column-major [K x N]:
         * yᵀ = op(W)ᵀ·x with op = transpose; a grouped product is E (or G) calls */
        const float one = 1.0f, zero = 0.0f;
        for (int i = -2; i < reps; i++) {
            CU(cudaEventRecord(e0, st));
            const int64_t calls = sh.E ? sh.E : G, rows = sh.E ? M / sh.E : M;
            for (int64_t c = 0; c < calls; c++) {
                const uint16_t *A = sh.E ? xb + c * rows * K : xb + c * K;
                const uint16_t *B = (const uint16_t *)W + c * N * K;
                float *C = sh.E ? y + c * rows * N : y + c * N;
                const cublasStatus_t bs = cublasGemmEx(
                    h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)rows, (int)K, &one, B, CUDA_R_16BF, (int)K, A,
                    CUDA_R_16BF, (int)(sh.E ? K : K * G), &zero, C, CUDA_R_32F, (int)(sh.E ? N : N * G),
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                if (bs != CUBLAS_STATUS_SUCCESS) DIE("bench_gemm_gpu: %s: cublasGemmEx: %d", sh.what, (int)bs);
            }
            CU(cudaEventRecord(e1, st));
            CU(cudaEventSynchronize(e1));
            if (i >= 0) CU(cudaEventElapsedTime(&ts[i], e0, e1));
        }
        const float t_blas = median(ts, reps);
        const double flop = 2.0 * (double)M * (double)K * (double)N * (double)G;
        char dims[64];
        snprintf(dims, sizeof dims, "[%lld x %lld] x [%lld x %lld]%s", (long long)M, (long long)K, (long long)N,
                 (long long)K, G > 1 ? " x G" : (sh.E ? " by E" : ""));
        printf("%-28s %26s %10.1f %8.1f %10.1f %8.1f %8.2f", sh.what, dims, 1e3 * t_ds4, flop / (1e9 * t_ds4),
               1e3 * t_blas, flop / (1e9 * t_blas), t_ds4 / t_blas);
        for (int v = 1; v < nv; v++) printf(" %12.1f", 1e3 * t_var[v]);
        if (nv > 1 && differ == 0) printf("   BITS DIFFER: the default kernel");
        else if (nv > 1 && differ > 0) printf("   BITS DIFFER: pipe %d", differ - 1);
        else if (nv > 1) printf("   same bits");
        printf("\n");
        printf("ds4 gemm_us_%zu %.1f\nds4 cublas_us_%zu %.1f\n", s, 1e3 * t_ds4, s, 1e3 * t_blas);
        cudaFree(x), cudaFree(y), cudaFree(W), cudaFree(xb), cudaFree(off);
        free(hx), free(hw), free(hb);
    }
    free(ts);
    cublasDestroy(h);
    for (int v = 0; v < nv; v++) ds4_dev_release(devs[v]);
    return 0;
}
#endif
