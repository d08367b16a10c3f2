/* test_dist.c — the communicator without a launcher: launch detection from fake environments (mpirun, srun,
 * torchrun-style variables, malformed values) and a world of one, whose collectives are the identity / a copy.
 * The multi-rank collectives are tested under mpirun by tests/dist/ (tests/test_dist_mpi.sh). */
#include <stdlib.h>
#include <string.h>

#include "ds4_dist.h"
#include "testlib.h"

/* A fake environment: NULL-terminated name, value pairs. */
static const char *fake_get(const char *name, void *ctx) {
    const char *const *kv = ctx;
    for (; kv[0]; kv += 2)
        if (!strcmp(kv[0], name)) return kv[1];
    return NULL;
}

static ds4_status detect(const char *const *env, ds4_launch *l, ds4_error *err) {
    return ds4_launch_detect(fake_get, (void *)env, l, err);
}

static void test_detect(void) {
    ds4_error err = {0};
    ds4_launch l;
    const char *none[] = {NULL};
    CHECK_OK(detect(none, &l, &err), &err);
    CHECK(l.launcher == DS4_LAUNCH_SINGLE && l.rank == 0 && l.world_size == 1, "empty env: %s %d/%d",
          ds4_launcher_name(l.launcher), l.rank, l.world_size);

    const char *ompi[] = {"OMPI_COMM_WORLD_RANK", "3", "OMPI_COMM_WORLD_SIZE", "4", "OMPI_COMM_WORLD_LOCAL_RANK", "1",
                          "SLURM_PROCID", "7", NULL};
    CHECK_OK(detect(ompi, &l, &err), &err);
    CHECK(l.launcher == DS4_LAUNCH_MPI && l.rank == 3 && l.world_size == 4 && l.local_rank == 1,
          "mpirun (MPI wins over Slurm): %s %d/%d local %d", ds4_launcher_name(l.launcher), l.rank, l.world_size,
          l.local_rank);

    const char *slurm[] = {"SLURM_PROCID", "5", "SLURM_NTASKS", "8", "SLURM_LOCALID", "1", NULL};
    CHECK_OK(detect(slurm, &l, &err), &err);
    CHECK(l.launcher == DS4_LAUNCH_SLURM && l.rank == 5 && l.world_size == 8 && l.local_rank == 1, "srun: %s %d/%d",
          ds4_launcher_name(l.launcher), l.rank, l.world_size);

    const char *torch[] = {"RANK", "2", "WORLD_SIZE", "4", "LOCAL_RANK", "0", "MASTER_ADDR", "10.0.0.1",
                           "MASTER_PORT", "29500", NULL};
    CHECK_OK(detect(torch, &l, &err), &err);
    CHECK(l.launcher == DS4_LAUNCH_TORCHRUN && l.rank == 2 && l.world_size == 4 && l.master_port == 29500 &&
              !strcmp(l.master_addr, "10.0.0.1"),
          "torchrun: %s %d/%d %s:%d", ds4_launcher_name(l.launcher), l.rank, l.world_size, l.master_addr,
          l.master_port);

    const char *torch1[] = {"RANK", "0", "WORLD_SIZE", "1", NULL};
    CHECK_OK(detect(torch1, &l, &err), &err);
    CHECK(l.launcher == DS4_LAUNCH_SINGLE, "WORLD_SIZE=1 is a world of one, got %s", ds4_launcher_name(l.launcher));

    struct {
        const char *env[7];
        const char *want;
    } bad[] = {
        {{"RANK", "abc", "WORLD_SIZE", "2", NULL}, "RANK=\"abc\""},
        {{"RANK", "2", "WORLD_SIZE", "2", NULL}, "rank 2 >= world size 2"},
        {{"RANK", "1", NULL}, "needs both RANK and WORLD_SIZE"},
        {{"WORLD_SIZE", "0", NULL}, "WORLD_SIZE=0"},
        {{"MASTER_PORT", "70000", NULL}, "MASTER_PORT=70000"},
        {{"OMPI_COMM_WORLD_RANK", "4", "OMPI_COMM_WORLD_SIZE", "4", NULL}, "MPI rank 4 >= world size 4"},
        {{"OMPI_COMM_WORLD_RANK", "-1", NULL}, "OMPI_COMM_WORLD_RANK=\"-1\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&err, 0, sizeof err);
        ds4_status st = detect(bad[i].env, &l, &err);
        CHECK(st == DS4_ERR_ARG && strstr(err.msg, bad[i].want) && strstr(err.msg, "dist launch"),
              "bad env %zu: %s \"%s\", wanted ARG with \"%s\"", i, ds4_status_name(st), err.msg, bad[i].want);
    }
}

/* A world of one from the real environment (ctest sets no launcher variables). */
static void test_single(void) {
    ds4_error err = {0};
    ds4_comm *c = NULL;
    CHECK_OK(ds4_comm_init(&c, &err), &err);
    if (!c) return;
    CHECK(ds4_comm_rank(c) == 0 && ds4_comm_world_size(c) == 1 && !strcmp(ds4_comm_backend(c), "single"),
          "single: rank %d of %d, backend %s", ds4_comm_rank(c), ds4_comm_world_size(c), ds4_comm_backend(c));
    CHECK_OK(ds4_comm_barrier(c, &err), &err);
    float f[3] = {1.5f, -2.0f, 3.25f};
    CHECK_OK(ds4_comm_all_reduce_sum(c, DS4_F32, f, 3, &err), &err);
    CHECK(f[0] == 1.5f && f[1] == -2.0f && f[2] == 3.25f, "all_reduce of one rank is the identity");
    double d[2] = {0.1, 1e300};
    CHECK_OK(ds4_comm_all_reduce_sum(c, DS4_F64, d, 2, &err), &err);
    CHECK(d[0] == 0.1 && d[1] == 1e300, "F64 all_reduce of one rank is the identity");
    CHECK_STATUS(ds4_comm_all_reduce_sum(c, DS4_BF16, f, 3, &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK(strstr(err.msg, "dist all_reduce: sum of BF16") != NULL, "message: %s", err.msg);
    CHECK_STATUS(ds4_comm_all_reduce_sum(c, DS4_F32, NULL, 3, &err), DS4_ERR_ARG, &err);
    int32_t s[2] = {7, 9}, r[2] = {0, 0};
    CHECK_OK(ds4_comm_all_gather(c, s, r, sizeof s, &err), &err);
    CHECK(r[0] == 7 && r[1] == 9, "all_gather of one rank copies");
    CHECK_OK(ds4_comm_broadcast(c, s, sizeof s, 0, &err), &err);
    CHECK_STATUS(ds4_comm_broadcast(c, s, sizeof s, 1, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "root 1 outside ranks [0, 1)") != NULL, "message: %s", err.msg);
    CHECK_OK(ds4_comm_finalize(c, &err), &err);
    CHECK_OK(ds4_comm_finalize(NULL, &err), &err);
}

int main(void) {
    test_detect();
    test_single();
    return ds4t_finish("test_dist");
}
