/* cuda_twin.h — what the tests of CUDA operations against the CPU's (test_cuda_*.c) share: the two backends, buffers
 * held twice (host memory for the CPU backend, device memory for CUDA) from the same random values, NaN poisoning of
 * outputs, and the comparisons. Include it inside #ifdef DS4_HAVE_CUDA; every test is its own executable, so the
 * backends and the random state are per test. */
#ifndef DS4_CUDA_TWIN_H
#define DS4_CUDA_TWIN_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backend.h"
#include "engine.h"
#include "ops.h"
#include "testlib.h"

static ds4_dev *cpu, *gpu;

/* The first CUDA error (DS4_ERR_CUDA: the operation and shapes that met it, and the message; empty while none). CUDA
 * errors are sticky: once a kernel faults, every later call of the process fails too, so the buffers' calls below
 * stop there (no device calls; fetch gives poison) and a test that checks twin_broken() skips its remaining cases:
 * one failure that names the operation instead of thousands that follow from it. Other failures (unsupported
 * shapes, out of memory) leave the device usable and stop nothing. */
static char twin_dead[1400];
static inline int twin_broken(void) { return twin_dead[0] != 0; }
static inline void twin_died(const char *what, ds4_status s, const ds4_error *err) {
    if (s == DS4_ERR_CUDA && !twin_dead[0]) snprintf(twin_dead, sizeof twin_dead, "%.360s: %s", what, err->msg);
}

typedef struct twin {
    void *h, *d;
    size_t bytes;
} twin;

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static inline double urand(void) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}
static inline float frand(float lo, float hi) { return lo + (hi - lo) * (float)urand(); }

static inline twin tw_new(size_t bytes) {
    twin t = {malloc(bytes ? bytes : 1), NULL, bytes};
    if (twin_broken()) return t;
    ds4_error err;
    const ds4_status s = gpu->ops->alloc(gpu, bytes, &t.d, &err);
    CHECK_OK(s, &err);
    twin_died("cuda alloc", s, &err);
    return t;
}
static inline void tw_push(twin *t) {
    if (twin_broken()) return;
    ds4_error err;
    const ds4_status s = gpu->ops->upload(gpu, t->d, t->h, t->bytes, &err);
    CHECK_OK(s, &err);
    twin_died("cuda upload", s, &err);
}
static inline twin tw_f(int64_t n, float lo, float hi) {
    twin t = tw_new((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) ((float *)t.h)[i] = frand(lo, hi);
    tw_push(&t);
    return t;
}
static inline twin tw_i32(int64_t n, const int32_t *v) {
    twin t = tw_new((size_t)n * 4);
    memcpy(t.h, v, (size_t)n * 4);
    tw_push(&t);
    return t;
}
static inline twin tw_i64(int64_t n, const int64_t *v) {
    twin t = tw_new((size_t)n * 8);
    memcpy(t.h, v, (size_t)n * 8);
    tw_push(&t);
    return t;
}
/* an output: poisoned on both sides */
static inline twin tw_out(size_t bytes) {
    twin t = tw_new(bytes);
    memset(t.h, 0xff, bytes);
    tw_push(&t);
    return t;
}
/* an in/out buffer (both sides start from the same values) */
static inline twin tw_copy(const twin *src) {
    twin t = tw_new(src->bytes);
    memcpy(t.h, src->h, src->bytes);
    tw_push(&t);
    return t;
}
static inline void tw_free(twin *t) {
    free(t->h);
    gpu->ops->free(gpu, t->d);
}
#define S(t) (side ? (t).d : (t).h)

/* the device's copy, downloaded */
static inline void *fetch(const twin *t) {
    void *h = malloc(t->bytes ? t->bytes : 1);
    memset(h, 0xff, t->bytes ? t->bytes : 1);
    if (twin_broken()) return h;
    ds4_error err;
    const ds4_status s = gpu->ops->download(gpu, h, t->d, t->bytes, &err);
    CHECK_OK(s, &err);
    twin_died("cuda download", s, &err);
    return h;
}

static inline double rel_frob(const float *got, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(ref[i])) return INFINITY;
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static inline void cmp_f(const char *what, const twin *t, int64_t n, double tol) {
    float *g = fetch(t);
    const double e = rel_frob(g, t->h, n);
    CHECK(e <= tol, "%s: rel. Frobenius %g > %g", what, e, tol);
    free(g);
}

static inline void cmp_bytes(const char *what, const twin *t) {
    void *g = fetch(t);
    CHECK(memcmp(g, t->h, t->bytes) == 0, "%s: CUDA and CPU differ", what);
    free(g);
}

static inline void check_dev(ds4_dev *d, const char *what) {
    if (twin_broken()) return;
    ds4_error err;
    ds4_status s = ds4_dev_check(d, what, &err);
    CHECK_OK(s, &err);
    twin_died(what, s, &err);
    if (twin_broken()) return;
    s = d->ops->sync(d, &err);
    CHECK_OK(s, &err);
    twin_died(what, s, &err); /* a kernel of `what` (or queued before it) faulted while running */
}

static inline uint16_t bf(float x) { return ds4_f32_to_bf16(x); }

/* The engine and both backends of test `name`: 0 ready; 77 no CUDA device (the test is skipped); 1 a failure (counted;
 * the test ends with ds4t_finish). */
static inline int twins_open(const char *name, ds4_engine **eng) {
    int n = 0;
    ds4_error err = {0};
    if (ds4_cuda_device_count(&n, &err) || n == 0) {
        printf("%s: skipped (no CUDA device)\n", name);
        return 77;
    }
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, eng, &err), &err);
    if (!*eng) return 1;
    CHECK_OK(ds4_cpu_dev_create((*eng)->pool, &cpu, &err), &err);
    CHECK_OK(ds4_cuda_dev_create(0, &gpu, &err), &err);
    return cpu && gpu ? 0 : 1;
}

static inline void twins_close(ds4_engine *eng) {
    if (gpu) ds4_dev_release(gpu);
    if (cpu) ds4_dev_release(cpu);
    ds4_engine_free(eng);
}

#endif
