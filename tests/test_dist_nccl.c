/* test_dist_nccl.c — the NCCL communicator (dist/nccl_backend.c) on device buffers, against closed forms, on however
 * many ranks it was launched as: alone (ctest: a world of one, NCCL still runs), or as N processes with torchrun-style
 * variables or under mpirun (tests/test_dist_nccl.sh). Every rank checks its own results.
 *
 *   all_reduce F32 of (r + 1)·(i mod 1000 + 1) over 2^20 + 3 elements: (i mod 1000 + 1)·n(n + 1)/2, integers below
 *   2^24, exact in any summation order; F64 of 1 + r·2^-40: n + 2^-40·n(n - 1)/2, exact in fp64.
 *   all_gather of each rank's (r, 10r + 1, -r): rank order. broadcast from the last rank: its bytes everywhere.
 *   all_reduce_grads of a model on this rank's GPU (fp32), every rank on the same batch (so the same gradient G —
 *   the CUDA backend is deterministic): with scale 1/2 the result is n/2·G; exact for n = 1 (one product) and n = 2
 *   (G/2 + G/2), within 2 ulp for more ranks (partial sums of equal values round). The host mirror must follow.
 *   Argument errors; a device-buffer call without NCCL.
 *
 * Exit 77 (skip): a build without NCCL, or no CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_dist.h"
#include "testlib.h"
#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#endif

#ifdef DS4_HAVE_CUDA
static void collectives(ds4_comm *c, ds4_cuda *cu) {
    ds4_error err = {0};
    const int32_t r = ds4_comm_rank(c), n = ds4_comm_world_size(c);
    const int64_t m = (1 << 20) + 3; /* more than one NCCL chunk */
    float *h = malloc((size_t)m * sizeof *h);
    void *d = NULL;
    CHECK_OK(ds4_cuda_alloc(cu, (size_t)m * sizeof(float), &d, &err), &err);
    if (!h || !d) goto out;
    for (int64_t i = 0; i < m; i++) h[i] = (float)((r + 1) * (i % 1000 + 1));
    CHECK_OK(ds4_cuda_upload(cu, d, h, (size_t)m * sizeof(float), &err), &err);
    for (int64_t i = 0; i < m; i++) h[i] = NAN; /* poisoned: the download must overwrite every element */
    CHECK_OK(ds4_comm_device_all_reduce_sum(c, DS4_F32, d, m, &err), &err);
    CHECK_OK(ds4_cuda_download(cu, h, d, (size_t)m * sizeof(float), &err), &err);
    int64_t bad = 0;
    for (int64_t i = 0; i < m; i++) bad += h[i] != (float)((i % 1000 + 1) * n * (n + 1) / 2);
    CHECK(bad == 0, "F32 all_reduce: %lld of %lld elements off the closed form", (long long)bad, (long long)m);

    double dv[2] = {1 + r * ldexp(1, -40), -r * ldexp(1, 600)};
    CHECK_OK(ds4_cuda_upload(cu, d, dv, sizeof dv, &err), &err);
    CHECK_OK(ds4_comm_device_all_reduce_sum(c, DS4_F64, d, 2, &err), &err);
    CHECK_OK(ds4_cuda_download(cu, dv, d, sizeof dv, &err), &err);
    CHECK(dv[0] == n + ldexp(1, -40) * n * (n - 1) / 2 && dv[1] == -ldexp(1, 600) * n * (n - 1) / 2,
          "F64 all_reduce: %.17g %.17g", dv[0], dv[1]);

    /* all_gather: send at d, receive after it */
    int32_t mine[3] = {r, 10 * r + 1, -r};
    char *recv = (char *)d + 64;
    CHECK_OK(ds4_cuda_upload(cu, d, mine, sizeof mine, &err), &err);
    CHECK_OK(ds4_comm_device_all_gather(c, d, recv, sizeof mine, &err), &err);
    int32_t *all = malloc((size_t)n * sizeof mine);
    if (all) {
        CHECK_OK(ds4_cuda_download(cu, all, recv, (size_t)n * sizeof mine, &err), &err);
        bad = 0;
        for (int32_t k = 0; k < n; k++) bad += all[3 * k] != k || all[3 * k + 1] != 10 * k + 1 || all[3 * k + 2] != -k;
        CHECK(bad == 0, "all_gather: %lld ranks' blocks out of rank order", (long long)bad);
        free(all);
    }

    const int32_t root = n - 1;
    CHECK_OK(ds4_cuda_upload(cu, d, mine, sizeof mine, &err), &err);
    CHECK_OK(ds4_comm_device_broadcast(c, d, sizeof mine, root, &err), &err);
    CHECK_OK(ds4_cuda_download(cu, mine, d, sizeof mine, &err), &err);
    CHECK(mine[0] == root && mine[1] == 10 * root + 1 && mine[2] == -root, "broadcast from rank %d: %d %d %d", root,
          mine[0], mine[1], mine[2]);

    CHECK_STATUS(ds4_comm_device_all_reduce_sum(c, DS4_BF16, d, 4, &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK_STATUS(ds4_comm_device_all_reduce_sum(c, DS4_F32, NULL, 4, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_comm_device_broadcast(c, d, 4, n, &err), DS4_ERR_ARG, &err);
out:
    ds4_cuda_free(cu, d);
    free(h);
}

static void gradients(ds4_comm *c, ds4_engine *eng, const char *fixtures) {
    ds4_error err = {0};
    const int32_t n = ds4_comm_world_size(c);
    ds4_model *m = NULL;
    ds4_st_file *io = NULL;
    ds4_forward_args args;
    if (ds4t_load_fixture(eng, fixtures, "tiny_a", &m, &io, &args)) return;
    const ds4_device_options dev = {DS4_DEVICE_CUDA, ds4_comm_device(c), DS4_F32};
    CHECK_OK(ds4_model_to(m, &dev, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_forward_result res;
    memset(&res, 0, sizeof res);
    CHECK_OK(ds4_model_forward_train(m, &args, &res, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err), &err);
    const int64_t P = ds4_model_param_count(m);
    float *g = malloc((size_t)P * sizeof *g), *h = ds4_model_grads(m);
    CHECK(g && h, "host gradients");
    if (!g || !h) goto out;
    memcpy(g, h, (size_t)P * sizeof *g);
    double gmax = 0;
    for (int64_t i = 0; i < P; i++) gmax = fmax(gmax, fabs(g[i]));
    CHECK(gmax > 0 && isfinite(gmax), "the fixture's gradient is nonzero and finite (max |g| %g)", gmax);
    CHECK_OK(ds4_comm_all_reduce_grads(c, m, 0.5, &err), &err);
    h = ds4_model_grads(m); /* the mirror must be downloaded again */
    CHECK(h != NULL, "host gradients after all_reduce_grads");
    if (!h) goto out;
    int64_t off = 0;
    double worst = 0;
    for (int64_t i = 0; i < P; i++) {
        const double want = 0.5 * n * (double)g[i], e = fabs(h[i] - want);
        /* n = 1, 2: exact; more ranks: partial sums k·g/2 of equal values round, 2 ulp of the result */
        const double tol = n <= 2 ? 0 : 2 * ldexp(fabs(want), -23);
        off += !(e <= tol);
        worst = e > worst || isnan(e) ? e : worst;
    }
    CHECK(off == 0, "all_reduce_grads(0.5) on %d ranks: %lld of %lld gradients off n/2·G (worst |Δ| %g)", n,
          (long long)off, (long long)P, worst);
    if (ds4_comm_rank(c) == 0)
        printf("test_dist_nccl: all_reduce_grads of %lld fp32 gradients on %d ranks: worst |Δ| vs n/2·G %g\n",
               (long long)P, n, worst);
out:
    free(g);
    ds4_st_close(io);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    int32_t ndev = 0;
    if (!ds4_dist_have_nccl()) {
        printf("test_dist_nccl: SKIP: this build has no NCCL\n");
        return 77;
    }
    if (ds4_cuda_devices(&ndev, &err) || ndev == 0) {
        printf("test_dist_nccl: SKIP: no CUDA device\n");
        return 77;
    }
    ds4_comm *c = NULL;
    ds4_launch l;
    CHECK_OK(ds4_launch_detect(NULL, NULL, &l, &err), &err);
    if (l.launcher == DS4_LAUNCH_SINGLE) { /* (a launched rank may make one communicator only: MPI_Init once) */
        /* without NCCL the device calls are refused, naming the option */
        CHECK_OK(ds4_comm_init(&c, &err), &err);
        float *p = (float *)(uintptr_t)16; /* never dereferenced: refused before */
        CHECK_STATUS(ds4_comm_device_all_reduce_sum(c, DS4_F32, p, 1, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, "ds4.dist.init{device = \"cuda\"}") != NULL, "refusal names the option: %s", err.msg);
        CHECK_OK(ds4_comm_finalize(c, &err), &err);
        c = NULL;
    }
    ds4_comm_options o;
    ds4_comm_options_default(&o);
    o.nccl = 1;
    CHECK_OK(ds4_comm_init_with(&o, &c, &err), &err);
    if (!c) return ds4t_finish("test_dist_nccl");
    const int32_t r = ds4_comm_rank(c), n = ds4_comm_world_size(c);
    CHECK(ds4_comm_device(c) == ds4_comm_local_rank(c) % ndev, "rank %d (local %d): device cuda:%d of %d", r,
          ds4_comm_local_rank(c), ds4_comm_device(c), ndev);
    ds4_cuda *cu = NULL;
    CHECK_OK(ds4_cuda_open(ds4_comm_device(c), &cu, &err), &err);
    if (cu) collectives(c, cu);
    ds4_cuda_close(cu);
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&eo, &eng, &err), &err);
    if (eng) gradients(c, eng, fixtures);
    ds4_engine_free(eng);
    CHECK_OK(ds4_comm_barrier(c, &err), &err);
    CHECK_OK(ds4_comm_finalize(c, &err), &err);
    char name[64];
    snprintf(name, sizeof name, "test_dist_nccl rank %d of %d", r, n);
    return ds4t_finish(name);
}
#else
int main(void) {
    printf("test_dist_nccl: SKIP: built without CUDA\n");
    return 77;
}
#endif
