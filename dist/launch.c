/* launch.c — read from the environment how this process was launched (mpirun, srun, torchrun-style variables, or
 * nothing). Pure: the environment comes through a callback, so tests can give any. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_dist.h"
#include "internal.h"

static const char *process_getenv(const char *name, void *ctx) {
    (void)ctx;
    return getenv(name);
}

/* Parse a non-negative decimal int32 from variable `name`; *out = -1 when unset or empty. */
static ds4_status env_int(ds4_getenv_fn get, void *ctx, const char *name, int32_t *out, ds4_error *err) {
    const char *s = get(name, ctx);
    *out = -1;
    if (!s || !*s) return DS4_OK;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < 0 || v > INT32_MAX)
        return ds4_fail(err, DS4_ERR_ARG, "dist launch: %s=\"%s\" is not an integer in [0, %d]", name, s, INT32_MAX);
    *out = (int32_t)v;
    return DS4_OK;
}

/* The first of `names` that is set, as an int (-1 when none is). */
static ds4_status env_first_int(ds4_getenv_fn get, void *ctx, const char *const *names, int32_t *out, ds4_error *err) {
    for (; *names; names++) {
        ds4_status st = env_int(get, ctx, *names, out, err);
        if (st != DS4_OK || *out >= 0) return st;
    }
    return DS4_OK;
}

static ds4_status check_world(const ds4_launch *l, const char *what, ds4_error *err) {
    if (l->world_size == 0) return ds4_fail(err, DS4_ERR_ARG, "dist launch: %s world size is 0", what);
    if (l->rank >= 0 && l->world_size > 0 && l->rank >= l->world_size)
        return ds4_fail(err, DS4_ERR_ARG, "dist launch: %s rank %d >= world size %d", what, l->rank, l->world_size);
    return DS4_OK;
}

ds4_status ds4_launch_detect(ds4_getenv_fn get, void *ctx, ds4_launch *out, ds4_error *err) {
    static const char *const mpi_rank[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", NULL};
    static const char *const mpi_size[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", NULL};
    static const char *const mpi_local[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", NULL};
    static const char *const slurm_rank[] = {"SLURM_PROCID", NULL};
    static const char *const slurm_size[] = {"SLURM_NTASKS", NULL};
    static const char *const slurm_local[] = {"SLURM_LOCALID", NULL};
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "dist launch: out is NULL");
    if (!get) get = process_getenv;
    memset(out, 0, sizeof *out);
    out->rank = out->world_size = out->local_rank = -1;
    ds4_status st;

    /* An MPI launcher first: mpirun under Slurm sets both, and then MPI's numbering is the one that counts. */
    if ((st = env_first_int(get, ctx, mpi_rank, &out->rank, err)) != DS4_OK) return st;
    if (out->rank >= 0) {
        out->launcher = DS4_LAUNCH_MPI;
        if ((st = env_first_int(get, ctx, mpi_size, &out->world_size, err)) != DS4_OK) return st;
        if ((st = env_first_int(get, ctx, mpi_local, &out->local_rank, err)) != DS4_OK) return st;
        return check_world(out, "MPI", err);
    }
    if ((st = env_first_int(get, ctx, slurm_rank, &out->rank, err)) != DS4_OK) return st;
    if (out->rank >= 0) {
        out->launcher = DS4_LAUNCH_SLURM;
        if ((st = env_first_int(get, ctx, slurm_size, &out->world_size, err)) != DS4_OK) return st;
        if ((st = env_first_int(get, ctx, slurm_local, &out->local_rank, err)) != DS4_OK) return st;
        return check_world(out, "Slurm", err);
    }

    int32_t rank, size, local, port;
    if ((st = env_int(get, ctx, "RANK", &rank, err)) != DS4_OK) return st;
    if ((st = env_int(get, ctx, "WORLD_SIZE", &size, err)) != DS4_OK) return st;
    if ((st = env_int(get, ctx, "LOCAL_RANK", &local, err)) != DS4_OK) return st;
    if ((st = env_int(get, ctx, "MASTER_PORT", &port, err)) != DS4_OK) return st;
    if (port == 0 || port > 65535)
        return ds4_fail(err, DS4_ERR_ARG, "dist launch: MASTER_PORT=%d is not a port in [1, 65535]", port);
    const char *addr = get("MASTER_ADDR", ctx);
    if (addr && strlen(addr) >= sizeof out->master_addr)
        return ds4_fail(err, DS4_ERR_ARG, "dist launch: MASTER_ADDR is %zu bytes long (at most %zu)", strlen(addr),
                        sizeof out->master_addr - 1);
    if (addr) memcpy(out->master_addr, addr, strlen(addr) + 1);
    out->master_port = port > 0 ? port : 0;
    if (size > 1 || rank > 0) {
        out->launcher = DS4_LAUNCH_TORCHRUN;
        out->rank = rank;
        out->world_size = size;
        out->local_rank = local;
        if (rank < 0 || size < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist launch: torchrun-style launch needs both RANK and WORLD_SIZE "
                                              "(got RANK=%d WORLD_SIZE=%d; -1: unset)", rank, size);
        return check_world(out, "torchrun-style", err);
    }
    if (size == 0) return ds4_fail(err, DS4_ERR_ARG, "dist launch: WORLD_SIZE=0");
    out->launcher = DS4_LAUNCH_SINGLE;
    out->rank = 0;
    out->world_size = 1;
    out->local_rank = 0;
    return DS4_OK;
}

const char *ds4_launcher_name(ds4_launcher l) {
    switch (l) {
    case DS4_LAUNCH_SINGLE: return "single";
    case DS4_LAUNCH_MPI: return "mpi";
    case DS4_LAUNCH_SLURM: return "slurm";
    case DS4_LAUNCH_TORCHRUN: return "torchrun";
    }
    return "?";
}
