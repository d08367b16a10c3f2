/* test_cuda.c — the CUDA backend against a double-precision CPU reference computed here.
 *
 * Exit codes: 0 pass, 1 fail, 77 skipped (ctest SKIP_RETURN_CODE): a build without the CUDA backend, or a
 * machine without a CUDA driver or device (every CI machine). With a device, every operation is compared with
 * a reference at several shapes, including sizes that are not multiples of 4, 32 or 128.
 *
 * Tolerance: relative Frobenius error ||y - ref||_F / ||ref||_F <= 1e-5. Both kernels accumulate in fp32.
 * For a dot product of length K with random-sign terms the rounding errors behave like a random walk:
 * ~sqrt(K) * u with u = 2^-24 ≈ 6e-8, i.e. ≈ 4e-6 at K = 4096 (the largest reduction below); cuBLAS and the
 * RMSNorm block reduction sum in trees, which is better still. TF32 (10-bit mantissa, u ≈ 5e-4) would fail
 * this bound by two orders of magnitude, so the test also proves TF32 is off.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"

#define TOL 1e-5

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rnd_unit(void) { /* xorshift64*: uniform in [0, 1) */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}
/* Non-zero values of both signs, magnitudes in [0.1, 1]. */
static float rnd_nonzero(void) {
    double m = 0.1 + 0.9 * rnd_unit();
    return (float)(rnd_unit() < 0.5 ? -m : m);
}
static void fill_random(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = rnd_nonzero();
}
static void fill_nan(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
}

/* ||got - ref|| / ||ref||; +inf when any value is not finite (poison left behind, NaN, overflow). */
static double rel_frobenius(const float *got, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void ref_rmsnorm(double *y, const float *x, const float *w, int64_t rows, int64_t dim, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        double inv = 1.0 / sqrt(ss / (double)dim + eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = (double)x[r * dim + i] * inv * (w ? (double)w[i] : 1.0);
    }
}

static void ref_matmul(double *y, const float *x, const float *w, int64_t m, int64_t k, int64_t n) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t t = 0; t < k; t++) s += (double)x[i * k + t] * w[j * k + t];
            y[i * n + j] = s;
        }
}

/* Device buffers of one case; released by free_bufs. */
typedef struct {
    ds4_cuda *c;
    void *p[3];
} bufs;
static void free_bufs(bufs *b) {
    for (int i = 0; i < 3; i++) ds4_cuda_free(b->c, b->p[i]);
    memset(b->p, 0, sizeof b->p);
}

/* One RMSNorm case. weighted: use a random weight, else w = NULL. inplace: y = x on the device. */
static void case_rmsnorm(ds4_cuda *c, int64_t rows, int64_t dim, int weighted, int inplace) {
    ds4_error err = {0};
    const float eps = 1e-6f;
    size_t nx = (size_t)(rows * dim);
    float *x = malloc(nx * sizeof *x), *w = malloc((size_t)dim * sizeof *w), *y = malloc(nx * sizeof *y);
    double *ref = malloc(nx * sizeof *ref);
    bufs b = {c, {NULL, NULL, NULL}};
    if (!x || !w || !y || !ref) {
        CHECK(0, "rmsnorm [%lld x %lld]: host allocation failed", (long long)rows, (long long)dim);
        goto done;
    }
    fill_random(x, (int64_t)nx);
    fill_random(w, dim);
    for (int64_t i = 0; i < dim; i++) w[i] = 1.0f + 0.5f * w[i]; /* weights in [0.5, 1.5], like trained norms */
    ref_rmsnorm(ref, x, weighted ? w : NULL, rows, dim, eps);

    ds4_status s = ds4_cuda_alloc(c, nx * sizeof(float), &b.p[0], &err);
    if (s == DS4_OK) s = ds4_cuda_alloc(c, (size_t)dim * sizeof(float), &b.p[1], &err);
    if (s == DS4_OK && !inplace) s = ds4_cuda_alloc(c, nx * sizeof(float), &b.p[2], &err);
    if (s == DS4_OK) s = ds4_cuda_upload(c, b.p[0], x, nx * sizeof(float), &err);
    if (s == DS4_OK) s = ds4_cuda_upload(c, b.p[1], w, (size_t)dim * sizeof(float), &err);
    float *dy = inplace ? (float *)b.p[0] : (float *)b.p[2];
    /* Poison: 0xFF bytes are NaNs, so any element the kernel fails to write shows up as non-finite. */
    if (s == DS4_OK && !inplace) s = ds4_cuda_memset(c, dy, 0xFF, nx * sizeof(float), &err);
    if (s == DS4_OK)
        s = ds4_cuda_rmsnorm_f32(c, dy, (const float *)b.p[0], weighted ? (const float *)b.p[1] : NULL, rows, dim,
                                 eps, &err);
    fill_nan(y, (int64_t)nx);
    if (s == DS4_OK) s = ds4_cuda_download(c, y, dy, nx * sizeof(float), &err);
    CHECK(s == DS4_OK, "rmsnorm [%lld x %lld]: %s", (long long)rows, (long long)dim, s ? err.msg : "");
    if (s == DS4_OK) {
        double e = rel_frobenius(y, ref, (int64_t)nx);
        CHECK(e <= TOL, "rmsnorm [%lld x %lld]%s%s: relative error %.3g > %g", (long long)rows, (long long)dim,
              weighted ? "" : " unweighted", inplace ? " in place" : "", e, TOL);
        printf("  rmsnorm [%lld x %lld]%s%s: rel err %.3g\n", (long long)rows, (long long)dim,
               weighted ? "" : " unweighted", inplace ? " in place" : "", e);
    }
done:
    free_bufs(&b);
    free(x);
    free(w);
    free(y);
    free(ref);
}

static void case_matmul(ds4_cuda *c, int64_t m, int64_t k, int64_t n) {
    ds4_error err = {0};
    size_t nx = (size_t)(m * k), nw = (size_t)(n * k), ny = (size_t)(m * n);
    float *x = malloc(nx * sizeof *x), *w = malloc(nw * sizeof *w), *y = malloc(ny * sizeof *y);
    double *ref = malloc(ny * sizeof *ref);
    bufs b = {c, {NULL, NULL, NULL}};
    if (!x || !w || !y || !ref) {
        CHECK(0, "matmul [%lld x %lld x %lld]: host allocation failed", (long long)m, (long long)k, (long long)n);
        goto done;
    }
    fill_random(x, (int64_t)nx);
    fill_random(w, (int64_t)nw);
    ref_matmul(ref, x, w, m, k, n);

    ds4_status s = ds4_cuda_alloc(c, nx * sizeof(float), &b.p[0], &err);
    if (s == DS4_OK) s = ds4_cuda_alloc(c, nw * sizeof(float), &b.p[1], &err);
    if (s == DS4_OK) s = ds4_cuda_alloc(c, ny * sizeof(float), &b.p[2], &err);
    if (s == DS4_OK) s = ds4_cuda_upload(c, b.p[0], x, nx * sizeof(float), &err);
    if (s == DS4_OK) s = ds4_cuda_upload(c, b.p[1], w, nw * sizeof(float), &err);
    if (s == DS4_OK) s = ds4_cuda_memset(c, b.p[2], 0xFF, ny * sizeof(float), &err); /* NaN poison */
    if (s == DS4_OK)
        s = ds4_cuda_matmul_f32(c, (float *)b.p[2], (const float *)b.p[0], (const float *)b.p[1], m, k, n, &err);
    fill_nan(y, (int64_t)ny);
    if (s == DS4_OK) s = ds4_cuda_download(c, y, b.p[2], ny * sizeof(float), &err);
    CHECK(s == DS4_OK, "matmul [%lld x %lld] x [%lld x %lld]^T: %s", (long long)m, (long long)k, (long long)n,
          (long long)k, s ? err.msg : "");
    if (s == DS4_OK) {
        double e = rel_frobenius(y, ref, (int64_t)ny);
        CHECK(e <= TOL, "matmul [%lld x %lld] x [%lld x %lld]^T: relative error %.3g > %g", (long long)m,
              (long long)k, (long long)n, (long long)k, e, TOL);
        printf("  matmul [%lld x %lld] x [%lld x %lld]^T: rel err %.3g\n", (long long)m, (long long)k, (long long)n,
               (long long)k, e);
    }
done:
    free_bufs(&b);
    free(x);
    free(w);
    free(y);
    free(ref);
}

/* k == 0: y must be exactly zero (poisoned first). */
static void case_matmul_k0(ds4_cuda *c) {
    ds4_error err = {0};
    void *dy = NULL;
    float y[6];
    fill_nan(y, 6);
    ds4_status s = ds4_cuda_alloc(c, sizeof y, &dy, &err);
    if (s == DS4_OK) s = ds4_cuda_memset(c, dy, 0xFF, sizeof y, &err);
    if (s == DS4_OK) s = ds4_cuda_matmul_f32(c, (float *)dy, NULL, NULL, 2, 0, 3, &err);
    if (s == DS4_OK) s = ds4_cuda_download(c, y, dy, sizeof y, &err);
    CHECK(s == DS4_OK, "matmul k = 0: %s", s ? err.msg : "");
    for (int i = 0; s == DS4_OK && i < 6; i++) CHECK(y[i] == 0.0f, "matmul k = 0: y[%d] = %g, want 0", i, y[i]);
    ds4_cuda_free(c, dy);
}

static void case_errors(ds4_cuda *c, int ndev) {
    ds4_error err = {0};
    ds4_cuda *bad = NULL;
    /* Argument errors are DS4_ERR_ARG and name the operation and shapes. */
    CHECK_STATUS(ds4_cuda_open(ndev, &bad, &err), DS4_ERR_ARG, &err);
    CHECK(bad == NULL, "failed open left a context behind");
    CHECK_STATUS(ds4_cuda_rmsnorm_f32(c, NULL, NULL, NULL, 3, 0, 1e-6f, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "rmsnorm [3 x 0]") != NULL, "message names op and shape: %s", err.msg);
    CHECK_STATUS(ds4_cuda_rmsnorm_f32(c, NULL, NULL, NULL, 2, 4, -1.0f, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_cuda_rmsnorm_f32(c, NULL, NULL, NULL, 0, 4, 1e-6f, &err), DS4_OK, &err); /* empty: no-op */
    CHECK_STATUS(ds4_cuda_matmul_f32(c, NULL, NULL, NULL, -1, 2, 3, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "matmul [-1 x 2] x [3 x 2]") != NULL, "message names op and shape: %s", err.msg);
    CHECK_STATUS(ds4_cuda_matmul_f32(c, NULL, NULL, NULL, 2, 2, 3, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_cuda_matmul_f32(NULL, NULL, NULL, NULL, 2, 2, 3, &err), DS4_ERR_ARG, &err);
    /* A CUDA failure is DS4_ERR_CUDA with the CUDA error string: an allocation far beyond any GPU's memory. */
    void *huge = NULL;
    CHECK_STATUS(ds4_cuda_alloc(c, (size_t)1 << 60, &huge, &err), DS4_ERR_CUDA, &err);
    CHECK(huge == NULL, "failed alloc returned a pointer");
    CHECK(strstr(err.msg, "cudaMalloc") != NULL && strstr(err.msg, "memory") != NULL,
          "CUDA error message names the call and the CUDA error: %s", err.msg);
    /* ... and the context still works afterwards. */
    CHECK_STATUS(ds4_cuda_synchronize(c, &err), DS4_OK, &err);
}

static int run_cuda(void) {
    ds4_error err = {0};
    char desc[2048];
    printf("test_cuda: %s\n", ds4_cuda_describe(desc, sizeof desc));
    int n = -1;
    ds4_status s = ds4_cuda_device_count(&n, &err);
    if (s != DS4_OK) {
        /* A broken driver/runtime is a failure, not a skip: only "no device" and "no driver" are expected. */
        CHECK(0, "ds4_cuda_device_count: %s", err.msg);
        return ds4t_finish("test_cuda");
    }
    if (n == 0) {
        printf("test_cuda: SKIP: CUDA backend built, but this machine has no CUDA driver or device\n");
        return 77;
    }
    ds4_cuda *c = NULL;
    CHECK_OK(ds4_cuda_open(0, &c, &err), &err);
    if (!c) return ds4t_finish("test_cuda");
    CHECK(ds4_cuda_device_index(c) == 0, "device index");

    static const int64_t norm_shapes[][2] = {{1, 1}, {1, 7}, {37, 129}, {5, 128}, {300, 4096}, {3, 16384}, {2, 7168}};
    for (size_t i = 0; i < sizeof norm_shapes / sizeof norm_shapes[0]; i++)
        case_rmsnorm(c, norm_shapes[i][0], norm_shapes[i][1], 1, 0);
    case_rmsnorm(c, 37, 129, 0, 0);   /* unweighted, scalar path */
    case_rmsnorm(c, 64, 512, 0, 0);   /* unweighted, vector path */
    case_rmsnorm(c, 37, 129, 1, 1);   /* in place, scalar path */
    case_rmsnorm(c, 300, 4096, 1, 1); /* in place, vector path */

    /* m x k x n: y [m, n] = x [m, k] W[n, k]^T */
    static const int64_t mm_shapes[][3] = {{1, 1, 1}, {1, 7, 3}, {37, 129, 65}, {3, 64, 256}, {128, 128, 128},
                                           {300, 4096, 512}, {17, 1000, 33}};
    for (size_t i = 0; i < sizeof mm_shapes / sizeof mm_shapes[0]; i++)
        case_matmul(c, mm_shapes[i][0], mm_shapes[i][1], mm_shapes[i][2]);
    case_matmul_k0(c);
    case_errors(c, n);

    ds4_cuda_close(c);
    return ds4t_finish("test_cuda");
}
#endif /* DS4_HAVE_CUDA */

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
#ifdef DS4_HAVE_CUDA
    return run_cuda();
#else
    printf("test_cuda: SKIP: this build has no CUDA backend (nvcc was not found at configure time)\n");
    return 77;
#endif
}
