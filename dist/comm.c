/* comm.c — the communicator value: launch detection, argument checks, and the choice between a world of one
 * (no MPI needed: every collective is the identity or a copy) and the MPI backend. */
#include <stdlib.h>
#include <string.h>

#include "ds4_dist.h"
#include "internal.h"
#include "mpi_backend.h"

struct ds4_comm {
    ds4_launch launch;
    int32_t rank, world_size, local_rank;
    dist_mpi *mpi; /* NULL for a world of one */
};

int ds4_dist_have_mpi(void) { return dist_mpi_built(); }

/* Under mpirun, torchrun-style RANK / WORLD_SIZE (set by a wrapper script, say) must not contradict MPI's. */
static ds4_status check_agrees(const char *name, int32_t mpi_value, ds4_error *err) {
    const char *s = getenv(name);
    if (!s || !*s) return DS4_OK;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (*end || v != mpi_value)
        return ds4_fail(err, DS4_ERR_ARG, "dist init: %s=\"%s\" but MPI says %d (unset it, or launch one way only)",
                        name, s, mpi_value);
    return DS4_OK;
}

ds4_status ds4_comm_init(ds4_comm **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "dist init: out is NULL");
    *out = NULL;
    ds4_launch l;
    ds4_status st = ds4_launch_detect(NULL, NULL, &l, err);
    if (st != DS4_OK) return st;
    if (l.launcher == DS4_LAUNCH_TORCHRUN)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                        "dist init: torchrun-style launch (RANK=%d WORLD_SIZE=%d MASTER_ADDR=%s MASTER_PORT=%d) needs "
                        "the NCCL rendezvous, which ds4 does not have yet; launch CPU ranks with mpirun or srun",
                        l.rank, l.world_size, l.master_addr[0] ? l.master_addr : "(unset)", l.master_port);
    ds4_comm *c = calloc(1, sizeof *c);
    if (!c) return ds4_fail(err, DS4_ERR_OOM, "dist init: allocating the communicator (%zu bytes)", sizeof *c);
    c->launch = l;
    c->rank = 0, c->world_size = 1, c->local_rank = 0;
    if (l.launcher == DS4_LAUNCH_MPI || l.launcher == DS4_LAUNCH_SLURM) {
        st = dist_mpi_open(&c->mpi, &c->rank, &c->world_size, &c->local_rank, err);
        if (st == DS4_OK && (st = check_agrees("RANK", c->rank, err)) == DS4_OK)
            st = check_agrees("WORLD_SIZE", c->world_size, err);
        if (st != DS4_OK) {
            ds4_comm_abandon(c);
            return st;
        }
    }
    *out = c;
    return DS4_OK;
}

ds4_status ds4_comm_finalize(ds4_comm *c, ds4_error *err) {
    if (!c) return DS4_OK;
    ds4_status st = dist_mpi_close(c->mpi, 1, err);
    free(c);
    return st;
}

void ds4_comm_abandon(ds4_comm *c) {
    if (!c) return;
    dist_mpi_close(c->mpi, 0, NULL); /* the duplicate is freed; MPI itself is left for the launcher to end */
    free(c);
}

int32_t ds4_comm_rank(const ds4_comm *c) { return c->rank; }
int32_t ds4_comm_world_size(const ds4_comm *c) { return c->world_size; }
int32_t ds4_comm_local_rank(const ds4_comm *c) { return c->local_rank; }
const char *ds4_comm_backend(const ds4_comm *c) { return c->mpi ? "mpi" : "single"; }
ds4_launcher ds4_comm_launcher(const ds4_comm *c) { return c->launch.launcher; }

ds4_status ds4_comm_barrier(ds4_comm *c, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist barrier: communicator is NULL");
    return c->mpi ? dist_mpi_barrier(c->mpi, err) : DS4_OK;
}

ds4_status ds4_comm_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce: communicator is NULL");
    if (dtype != DS4_F32 && dtype != DS4_F64)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist all_reduce: sum of %s (F32 and F64 only)",
                        ds4_dtype_name(dtype) ? ds4_dtype_name(dtype) : "an invalid dtype");
    if (count < 0 || (count > 0 && !buf))
        return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce: %lld elements at %p", (long long)count, buf);
    if (count == 0 || !c->mpi) return DS4_OK;
    return dist_mpi_all_reduce_sum(c->mpi, dtype, buf, count, err);
}

ds4_status ds4_comm_all_gather(ds4_comm *c, const void *send, void *recv, size_t nbytes, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist all_gather: communicator is NULL");
    if (nbytes > 0 && (!send || !recv))
        return ds4_fail(err, DS4_ERR_ARG, "dist all_gather: %zu bytes per rank, send %p, recv %p", nbytes, send, recv);
    if (nbytes == 0) return DS4_OK;
    if (!c->mpi) {
        memmove(recv, send, nbytes);
        return DS4_OK;
    }
    return dist_mpi_all_gather(c->mpi, send, recv, nbytes, err);
}

ds4_status ds4_comm_broadcast(ds4_comm *c, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: communicator is NULL");
    if (root < 0 || root >= c->world_size)
        return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: root %d outside ranks [0, %d)", root, c->world_size);
    if (nbytes > 0 && !buf) return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: %zu bytes at NULL", nbytes);
    if (nbytes == 0 || !c->mpi) return DS4_OK;
    return dist_mpi_broadcast(c->mpi, buf, nbytes, root, err);
}
