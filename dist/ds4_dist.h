/* ds4_dist.h — the communicator: which rank this process is, how many there are, and the collectives that data
 * parallelism needs on host buffers (docs/distributed.md).
 *
 * A communicator is a value: ds4_comm_init makes one, ds4_comm_free ends it; nothing is kept in globals by ds4
 * (MPI itself is process-wide: MPI_Init may run once per process, so a second communicator after the first one
 * finalized MPI is refused with a message saying so).
 *
 * Launch detection (dist/launch.c): a process started by mpirun (Open MPI, MPICH) or srun is a rank of an MPI job;
 * a process with none of those variables and WORLD_SIZE unset or 1 is a world of one, which needs no MPI at all;
 * torchrun-style variables with WORLD_SIZE > 1 and no MPI launcher are refused (DS4_ERR_UNSUPPORTED): they need
 * the NCCL rendezvous, which is not built yet. Under mpirun, RANK / WORLD_SIZE, when set, must agree with MPI's. */
#ifndef DS4_DIST_H
#define DS4_DIST_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- launch */

typedef enum ds4_launcher {
    DS4_LAUNCH_SINGLE = 0, /* no launcher: a world of one */
    DS4_LAUNCH_MPI,        /* mpirun / mpiexec (OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK) */
    DS4_LAUNCH_SLURM,      /* srun (SLURM_PROCID, SLURM_NTASKS): MPI through Slurm's PMI */
    DS4_LAUNCH_TORCHRUN    /* RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT without an MPI launcher */
} ds4_launcher;

/* What the environment says about this process. rank / world_size / local_rank are -1 where the launcher does
 * not say (MPI tells them after init). */
typedef struct ds4_launch {
    ds4_launcher launcher;
    int32_t rank, world_size, local_rank;
    char master_addr[256];
    int32_t master_port; /* 0 when unset */
} ds4_launch;

/* Look a variable up: returns its value or NULL. `ctx` is passed through (tests give a fake environment). */
typedef const char *(*ds4_getenv_fn)(const char *name, void *ctx);

/* Read the launch description from the environment `get` gives (NULL: the process environment). Fails with
 * DS4_ERR_ARG on a malformed number (RANK=abc, WORLD_SIZE=0, RANK >= WORLD_SIZE, a port out of 1..65535). */
ds4_status ds4_launch_detect(ds4_getenv_fn get, void *ctx, ds4_launch *out, ds4_error *err);
const char *ds4_launcher_name(ds4_launcher l); /* "single", "mpi", "slurm", "torchrun" */

/* ---------------------------------------------------------------------------------------------- communicator */

typedef struct ds4_comm ds4_comm;

/* 1 when this build has the MPI backend (CMake found MPI), else 0: then only a world of one can be made. */
int ds4_dist_have_mpi(void);

/* Make the communicator the environment describes (ds4_launch_detect on the process environment). Under an MPI
 * launcher this calls MPI_Init (unless the host already did) on a private duplicate of MPI_COMM_WORLD whose errors
 * are returned, not fatal. */
ds4_status ds4_comm_init(ds4_comm **out, ds4_error *err);
/* End the communicator: MPI_Finalize when ds4_comm_init initialized MPI (a collective step: every rank must call
 * it). NULL is allowed. */
ds4_status ds4_comm_finalize(ds4_comm *c, ds4_error *err);
/* Free without finalizing MPI: for a rank that is failing; the launcher then ends the job (docs/distributed.md). */
void ds4_comm_abandon(ds4_comm *c);

int32_t ds4_comm_rank(const ds4_comm *c);
int32_t ds4_comm_world_size(const ds4_comm *c);
int32_t ds4_comm_local_rank(const ds4_comm *c); /* rank among the processes of this machine */
const char *ds4_comm_backend(const ds4_comm *c); /* "mpi" or "single" */
ds4_launcher ds4_comm_launcher(const ds4_comm *c);

ds4_status ds4_comm_barrier(ds4_comm *c, ds4_error *err);
/* In place: buf[i] = sum over ranks of buf[i]. dtype DS4_F32 or DS4_F64; count elements. The summation order is
 * MPI's (for a given world size and count, the same on every run with Open MPI's default tuned algorithms). */
ds4_status ds4_comm_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err);
/* recv (world_size * nbytes) = every rank's send (nbytes each), in rank order. */
ds4_status ds4_comm_all_gather(ds4_comm *c, const void *send, void *recv, size_t nbytes, ds4_error *err);
/* In place: every rank's buf becomes rank root's. */
ds4_status ds4_comm_broadcast(ds4_comm *c, void *buf, size_t nbytes, int32_t root, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif
