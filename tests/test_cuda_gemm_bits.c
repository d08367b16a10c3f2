/* test_cuda_gemm_bits.c — the bf16 product's bits do not depend on which kernel forms them (cuda/cuda_gemm.cu).
 *
 * A row of y = x Wᵀ computed inside a product that fills the GPU (the pipelined kernels: every tile shape
 * DS4_CUDA_GEMM_PIPE can pick, each on a backend of its own, and on an H100 or H200 the wgmma kernel of
 * cuda/cuda_gemm_wgmma.cu), inside a medium batch (the tiled kernel) and alone or
 * with a few rows (the skinny kernels, which spread K over warps and add the slices' partials at the end) must be the
 * same bytes: that is the batch invariance that makes a rollout's log-probabilities equal training's. So the
 * reference here is another kernel of the same contract, not the kernel under test: every output is the sum over K in
 * the order cuda_gemm.cu's header fixes (slices of 256, chunks of 32 in the tensor cores' k-slots), and a kernel that
 * folds a slice early, skips a chunk or adds a zero-padded one differs in the last bits of some output.
 *
 * Shapes: K = 904 (three whole slices, a ragged fourth, its last chunk of 32 only 8 deep), 2056 columns (not a
 * multiple of any tile), 2304 rows: at least 153 tiles of every shape, more than the 132 SMs of an H100 or H200, so
 * every pipelined shape runs (a product with fewer tiles than SMs takes the tiled kernel). And the same grouped by
 * expert (five groups, one empty), whose rows are checked one at a time against a one-row product with the group's W,
 * and batched (two column groups of x, each with its own W, as the attention output's grouped product).
 * The CPU's side of these products is test_cuda_ops' (within 1e-5); here only bitwise equality counts, and NaN
 * poison left behind fails it.
 * The chain of ops.h's y16_only (the attention output's two products): a column-grouped product that may leave its y
 * unwritten and hand its bf16 copy to the product after it, told x_kept, must give that product's result and the
 * tape's copy (y16) in the bytes of the same two products run plainly (y written, the copy made by a pass of its
 * own), and the copy the bytes of y rounded on the host; on a device with wgmma the epilogue must have made them (y
 * left as poisoned); and a product on that y without x_kept is an error, not a read of unwritten memory.
 * Exit 77 without a CUDA build or device. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda_backend.h"
#include "engine.h"
#include "ops.h"

#define M_ROWS 2304
#define K_DIM 904
#define N_COLS 2056

static uint64_t rs = 0x243f6a8885a308d3ull;
static float frand(void) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (float)((rs * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0f * 2.0f - 1.0f;
}

static void *dev_buf(ds4_dev *d, size_t bytes, const void *host) {
    void *p = NULL;
    ds4_error err = {0};
    CHECK_OK(d->ops->alloc(d, bytes, &p, &err), &err);
    if (p && host) CHECK_OK(d->ops->upload(d, p, host, bytes, &err), &err);
    return p;
}

static void download(ds4_dev *d, void *host, const void *src, size_t bytes) {
    ds4_error err = {0};
    CHECK_OK(ds4_dev_check(d, "gemm bits", &err), &err);
    CHECK_OK(d->ops->download(d, host, src, bytes, &err), &err);
}

/* rows [r, r + n) of y (row stride N_COLS) computed on their own: n <= 16 takes a skinny kernel, n = 300 (more than
 * DS4_CUDA_SKINNY_ROWS' 256, fewer tiles than SMs) the tiled one */
static void rows_alone(ds4_dev *d, float *y, const float *x, const void *W, int64_t r, int64_t n, float *host) {
    memset(host, 0xff, (size_t)(n * N_COLS) * 4);
    ds4_error err = {0};
    CHECK_OK(d->ops->upload(d, y, host, (size_t)(n * N_COLS) * 4, &err), &err);
    OP(d, matmul, .y = y, .ldy = N_COLS, .x = x + r * K_DIM, .ldx = K_DIM, .W = W, .wdt = DS4_BF16, .T = n,
       .K = K_DIM, .O = N_COLS, .groups = 1, .bf16_in = 1);
    download(d, host, y, (size_t)(n * N_COLS) * 4);
}

/* Bytes that differ between two stretches of floats, or a NaN in either */
static int64_t differ(const float *a, const float *b, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) || a[i] != a[i]) bad++;
    return bad;
}

/* The y16_only chain: y [R, G·N1] = G column groups of x1 [R, G·K1] times W1 group by group, then z [R, N2] = y W2ᵀ.
 * R = 2304 rows, G = 4, N1 = 256 (2·18·4 = 144 output tiles: the wgmma kernel runs), K1 = 200, N2 = 520. */
static void y16_chain(void) {
    enum { R = 2304, G = 4, K1 = 200, N1 = 256, N2 = 520, KY = G * N1 };
    ds4_error err = {0};
    ds4_dev *d = NULL;
    CHECK_OK(ds4_cuda_dev_create(0, &d, &err), &err);
    if (!d) return;
    float *hx = malloc((size_t)R * G * K1 * 4), *hy = malloc((size_t)R * KY * 4), *hz[2];
    uint16_t *hw1 = malloc((size_t)G * N1 * K1 * 2), *hw2 = malloc((size_t)N2 * KY * 2), *h16[2];
    for (int64_t i = 0; i < (int64_t)R * G * K1; i++) hx[i] = frand();
    for (int64_t i = 0; i < (int64_t)G * N1 * K1; i++) hw1[i] = ds4_f32_to_bf16(0.1f * frand());
    for (int64_t i = 0; i < (int64_t)N2 * KY; i++) hw2[i] = ds4_f32_to_bf16(0.05f * frand());
    float *x = dev_buf(d, (size_t)R * G * K1 * 4, hx), *y = dev_buf(d, (size_t)R * KY * 4, NULL);
    float *z = dev_buf(d, (size_t)R * N2 * 4, NULL);
    void *w1 = dev_buf(d, (size_t)G * N1 * K1 * 2, hw1), *w2 = dev_buf(d, (size_t)N2 * KY * 2, hw2);
    uint16_t *y16 = dev_buf(d, (size_t)R * KY * 2, NULL);
    int poisoned = 1; /* y as left by the fused run: every value still the poison */
    for (int fused = 1; fused >= 0; fused--) {
        memset(hy, 0xff, (size_t)R * KY * 4);
        CHECK_OK(d->ops->upload(d, y, hy, (size_t)R * KY * 4, &err), &err);
        d->ops->fill(d, y16, 0xff, (size_t)R * KY * 2);
        d->ops->fill(d, z, 0xff, (size_t)R * N2 * 4);
        OP(d, matmul, .y = y, .ldy = KY, .x = x, .ldx = G * K1, .W = w1, .wdt = DS4_BF16, .T = R, .K = K1, .O = N1,
           .groups = G, .gx = K1, .gy = N1, .gw = N1 * K1, .bf16_in = 1, .y16 = y16, .y16_only = fused);
        OP(d, matmul, .y = z, .ldy = N2, .x = y, .ldx = KY, .W = w2, .wdt = DS4_BF16, .T = R, .K = KY, .O = N2,
           .groups = 1, .bf16_in = 1, .x_kept = fused);
        hz[fused] = malloc((size_t)R * N2 * 4), h16[fused] = malloc((size_t)R * KY * 2);
        download(d, hz[fused], z, (size_t)R * N2 * 4);
        download(d, h16[fused], y16, (size_t)R * KY * 2);
        download(d, hy, y, (size_t)R * KY * 4);
        if (fused)
            for (int64_t i = 0; i < (int64_t)R * KY && poisoned; i++) poisoned = hy[i] != hy[i];
    }
    /* hy: the plain run's y; its rounding on the host is what the copies must hold */
    int64_t bad16 = 0, nan = 0;
    for (int64_t i = 0; i < (int64_t)R * KY; i++) bad16 += h16[0][i] != ds4_f32_to_bf16(hy[i]) || h16[1][i] != h16[0][i];
    for (int64_t i = 0; i < (int64_t)R * N2; i++) nan += hz[1][i] != hz[1][i];
    CHECK(bad16 == 0, "y16_only: %lld of %lld bf16 copies of y differ from y rounded on the host", (long long)bad16,
          (long long)R * KY);
    CHECK(nan == 0 && memcmp(hz[0], hz[1], (size_t)R * N2 * 4) == 0,
          "y16_only: the product on the handed copy differs from the plain chain (%lld NaN)", (long long)nan);
    struct cudaDeviceProp p;
    const int hopper = cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.major == 9 && p.minor == 0;
    CHECK(!hopper || poisoned, "y16_only on compute capability 9.0: the wgmma product wrote y instead of its copies");
    /* a product on the unwritten y that does not take the copy: refused */
    if (hopper) {
        OP(d, matmul, .y = y, .ldy = KY, .x = x, .ldx = G * K1, .W = w1, .wdt = DS4_BF16, .T = R, .K = K1, .O = N1,
           .groups = G, .gx = K1, .gy = N1, .gw = N1 * K1, .bf16_in = 1, .y16_only = 1);
        OP(d, matmul, .y = z, .ldy = N2, .x = y, .ldx = KY, .W = w2, .wdt = DS4_BF16, .T = R, .K = KY, .O = N2,
           .groups = 1, .bf16_in = 1);
        const ds4_status s = ds4_dev_check(d, "y16 chain", &err);
        CHECK(s == DS4_ERR_INTERNAL && strstr(err.msg, "unwritten"), "y16_only then a product without x_kept: %s '%s'",
              ds4_status_name(s), err.msg);
    }
    printf("test_cuda_gemm_bits: y16_only chain [%d x %d x %d] -> [%d x %d]: %s\n", R, G, N1, R, N2,
           hopper ? "y left unwritten, its copies from the wgmma epilogue, bitwise as the plain chain"
                  : "no wgmma here: y written, bitwise as the plain chain");
    for (int f = 0; f < 2; f++) free(hz[f]), free(h16[f]);
    free(hx), free(hy), free(hw1), free(hw2);
    void *bufs[6] = {x, y, z, w1, w2, y16};
    for (int i = 0; i < 6; i++) d->ops->free(d, bufs[i]);
    ds4_dev_release(d);
}

int main(void) {
    int ndev = 0;
    ds4_error err = {0};
    if (ds4_cuda_device_count(&ndev, &err) || ndev == 0) {
        printf("test_cuda_gemm_bits: skipped (no CUDA device)\n");
        return 77;
    }
    const int nv = ds4_cuda_gemm_pipe_count();
    ds4_dev *base = NULL;
    CHECK_OK(ds4_cuda_dev_create(0, &base, &err), &err);
    if (!base) return ds4t_finish("test_cuda_gemm_bits");
    const int64_t nx = (int64_t)M_ROWS * K_DIM, nw = (int64_t)N_COLS * K_DIM, ny = (int64_t)M_ROWS * N_COLS;
    const int64_t E = 5, counts[5] = {700, 0, 900, 13, 691}; /* 2304 rows */
    float *hx = malloc((size_t)nx * 4), *full = malloc((size_t)ny * 4);
    uint16_t *hw = malloc((size_t)(nw * E) * 2);
    for (int64_t i = 0; i < nx; i++) hx[i] = frand();
    for (int64_t i = 0; i < nw * E; i++) hw[i] = ds4_f32_to_bf16(0.05f * frand());
    int64_t off[6] = {0};
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
    float *x = dev_buf(base, (size_t)nx * 4, hx), *y = dev_buf(base, (size_t)ny * 4, NULL);
    void *W = dev_buf(base, (size_t)(nw * E) * 2, hw);
    int64_t *doff = dev_buf(base, sizeof off, off);
    float *yalone = dev_buf(base, (size_t)300 * N_COLS * 4, NULL);
    /* the references, once: skinny (1, 16 and the last 16 rows) and tiled (300 rows) from the base backend */
    static const int64_t blocks[4][2] = {{0, 16}, {1001, 1}, {M_ROWS - 16, 16}, {1700, 300}};
    float *ref[4];
    for (int b = 0; b < 4; b++) {
        ref[b] = malloc((size_t)(blocks[b][1] * N_COLS) * 4);
        rows_alone(base, yalone, x, W, blocks[b][0], blocks[b][1], ref[b]);
    }
    /* grouped references: one row per group (its first, and the last row of the last group), W of its group */
    static const int64_t grow[4] = {0, 700, 1600, M_ROWS - 1};
    static const int64_t gexp[4] = {0, 2, 3, 4};
    float *gref = malloc((size_t)(4 * N_COLS) * 4);
    for (int i = 0; i < 4; i++) {
        OP(base, matmul, .y = yalone, .ldy = N_COLS, .x = x + grow[i] * K_DIM, .ldx = K_DIM,
           .W = (const uint16_t *)W + gexp[i] * nw, .wdt = DS4_BF16, .T = 1, .K = K_DIM, .O = N_COLS, .groups = 1,
           .bf16_in = 1);
        download(base, gref + i * N_COLS, yalone, (size_t)N_COLS * 4);
    }
    /* batched references: x viewed as [M_ROWS / 2, 2·K_DIM] rows, group z its columns z·K_DIM.. with W group z (the
     * column-grouped products, e.g. the attention output's groups); one row of each group at three rows */
    static const int64_t brow[3] = {0, 577, M_ROWS / 2 - 1};
    float *bref = malloc((size_t)(6 * N_COLS) * 4);
    for (int i = 0; i < 6; i++) {
        OP(base, matmul, .y = yalone, .ldy = N_COLS, .x = x + brow[i / 2] * 2 * K_DIM + (i % 2) * K_DIM,
           .ldx = 2 * K_DIM, .W = (const uint16_t *)W + (i % 2) * nw, .wdt = DS4_BF16, .T = 1, .K = K_DIM,
           .O = N_COLS, .groups = 1, .bf16_in = 1);
        download(base, bref + i * N_COLS, yalone, (size_t)N_COLS * 4);
    }
    /* v < nv: the mma.sync pipeline's shape v (wgmma off); v = nv: the default, the wgmma kernel where the device has
     * it (compute capability 9.0; elsewhere the pipeline's first shape again) */
    for (int v = 0; v <= nv && ds4t_failures == 0; v++) {
        char val[16];
        snprintf(val, sizeof val, "%d", v < nv ? v : 0);
        setenv("DS4_CUDA_GEMM_PIPE", val, 1); /* both read when the backend is created */
        setenv("DS4_CUDA_GEMM_WGMMA", v < nv ? "0" : "1", 1);
        ds4_dev *d = NULL;
        CHECK_OK(ds4_cuda_dev_create(0, &d, &err), &err);
        if (!d) break;
        for (int grouped = 0; grouped < 3; grouped++) { /* plain, by expert, batched */
            memset(full, 0xff, (size_t)ny * 4);
            CHECK_OK(d->ops->upload(d, y, full, (size_t)ny * 4, &err), &err);
            if (grouped == 2) /* y [M_ROWS / 2, 2·N_COLS]: as many values as the plain product's */
                OP(d, matmul, .y = y, .ldy = 2 * N_COLS, .x = x, .ldx = 2 * K_DIM, .W = W, .wdt = DS4_BF16,
                   .T = M_ROWS / 2, .K = K_DIM, .O = N_COLS, .groups = 2, .gx = K_DIM, .gy = N_COLS, .gw = nw,
                   .bf16_in = 1);
            else if (grouped)
                OP(d, matmul_grouped, .y = y, .x = x, .W = W, .wdt = DS4_BF16, .wstride = nw, .off = doff, .E = E,
                   .rows = M_ROWS, .K = K_DIM, .O = N_COLS, .bf16_in = 1);
            else
                OP(d, matmul, .y = y, .ldy = N_COLS, .x = x, .ldx = K_DIM, .W = W, .wdt = DS4_BF16, .T = M_ROWS,
                   .K = K_DIM, .O = N_COLS, .groups = 1, .bf16_in = 1);
            download(d, full, y, (size_t)ny * 4);
            for (int b = 0; b < 4 && !grouped; b++) {
                const int64_t bad = differ(full + blocks[b][0] * N_COLS, ref[b], blocks[b][1] * N_COLS);
                CHECK(bad == 0, "pipe shape %d (%d: wgmma): rows [%lld, %lld) of the [%d x %d] x [%d x %d]^T "
                      "product differ from the same rows alone in %lld of %lld values", v, nv, (long long)blocks[b][0],
                      (long long)(blocks[b][0] + blocks[b][1]), M_ROWS, K_DIM, N_COLS, K_DIM, (long long)bad,
                      (long long)(blocks[b][1] * N_COLS));
            }
            for (int i = 0; i < 6 && grouped == 2; i++) {
                const int64_t bad = differ(full + brow[i / 2] * 2 * N_COLS + (i % 2) * N_COLS, bref + i * N_COLS,
                                           N_COLS);
                CHECK(bad == 0, "pipe shape %d (%d: wgmma): row %lld of group %d of the batched product differs from "
                      "the row alone in %lld of %d values", v, nv, (long long)brow[i / 2], i % 2, (long long)bad,
                      N_COLS);
            }
            for (int i = 0; i < 4 && grouped == 1; i++) {
                const int64_t bad = differ(full + grow[i] * N_COLS, gref + i * N_COLS, N_COLS);
                CHECK(bad == 0, "pipe shape %d (%d: wgmma): row %lld (expert %lld) of the grouped product differs "
                      "from the row alone in %lld of %d values", v, nv, (long long)grow[i], (long long)gexp[i],
                      (long long)bad, N_COLS);
            }
        }
        ds4_dev_release(d);
    }
    unsetenv("DS4_CUDA_GEMM_PIPE");
    unsetenv("DS4_CUDA_GEMM_WGMMA");
    if (ds4t_failures == 0) y16_chain();
    printf("test_cuda_gemm_bits: %d pipelined tile shapes and the wgmma kernel against the skinny and tiled kernels\n",
           nv);
    for (int b = 0; b < 4; b++) free(ref[b]);
    free(gref), free(bref), free(hx), free(hw), free(full);
    base->ops->free(base, x), base->ops->free(base, y), base->ops->free(base, W), base->ops->free(base, doff);
    base->ops->free(base, yalone);
    ds4_dev_release(base);
    return ds4t_finish("test_cuda_gemm_bits");
}
#else
int main(void) {
    printf("test_cuda_gemm_bits: skipped (built without CUDA)\n");
    return 77;
}
#endif
