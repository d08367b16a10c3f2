/* ds4_dist.h — the communicator: which rank this process is, how many there are, and the collectives that data
 * parallelism needs, on host buffers and (with NCCL) on device buffers (docs/distributed.md).
 *
 * A communicator is a value: ds4_comm_init makes one, ds4_comm_finalize ends it; nothing is kept in globals by ds4
 * (MPI itself is process-wide: MPI_Init may run once per process, so a second communicator after the first one
 * finalized MPI is refused with a message saying so).
 *
 * Launch detection (dist/launch.c): a process started by mpirun (Open MPI, MPICH) or srun is a rank of an MPI job;
 * torchrun-style variables (RANK, WORLD_SIZE > 1, MASTER_ADDR, MASTER_PORT) without an MPI launcher make the ranks
 * meet over TCP at rank 0 (dist/tcp_backend.c), which then carries the host collectives; a process with none of
 * those variables and WORLD_SIZE unset or 1 is a world of one, which needs neither. Under mpirun, RANK / WORLD_SIZE,
 * when set, must agree with MPI's.
 *
 * Device buffers: with ds4_comm_options.nccl, the communicator also holds an NCCL communicator on one CUDA device per
 * process (by default the local rank's), whose unique id rank 0 hands out through the host collectives. Its calls
 * wait with a deadline (DS4_DIST_TIMEOUT, default 300 s): a rank that dies or hangs makes the others fail with
 * DS4_ERR_COMM naming the collective, not hang. */
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

/* The contiguous shard of `count` elements that rank `rank` of `world` owns (ZeRO-1's shards, the reduce-scatter's):
 * count / world elements each, the first count % world ranks one more; *off its first element. */
void ds4_shard_range(int64_t count, int32_t world, int32_t rank, int64_t *off, int64_t *len);

/* ---------------------------------------------------------------------------------------------- communicator */

typedef struct ds4_comm ds4_comm;

/* 1 when this build has the MPI backend (CMake found MPI), else 0: then mpirun / srun launches are refused. */
int ds4_dist_have_mpi(void);
/* 1 when this build has the NCCL backend (CMake found NCCL next to the CUDA toolkit), else 0. */
int ds4_dist_have_nccl(void);

typedef struct ds4_comm_options {
    int32_t nccl;      /* 1: also an NCCL communicator for device buffers (ds4_comm_device_*) */
    int32_t device;    /* its CUDA device; -1: the local rank modulo the visible devices */
    double bucket_mb;  /* MiB of gradients per bucket of the reduction overlapped with the backward
                          (ds4_comm_overlap_backward); 0: one reduction after the backward */
    double timeout_s;  /* deadline of the TCP rendezvous and of every TCP and NCCL collective (not of MPI's: mpirun
                          ends a job whose rank died); <= 0: DS4_DIST_TIMEOUT from the environment, else 300 */
} ds4_comm_options;
#define DS4_DEFAULT_BUCKET_MB 25.0
/* nccl 0, device -1, bucket_mb DS4_DEFAULT_BUCKET_MB (as torch's DDP), timeout_s 0 */
void ds4_comm_options_default(ds4_comm_options *o);

/* Make the communicator the environment describes (ds4_launch_detect on the process environment). Under an MPI
 * launcher this calls MPI_Init (unless the host already did) on a private duplicate of MPI_COMM_WORLD whose errors
 * are returned, not fatal. */
ds4_status ds4_comm_init(ds4_comm **out, ds4_error *err);
/* The same with options (NULL: the defaults). A torchrun-style launch runs the TCP rendezvous here (every rank
 * must call it); with o->nccl, every rank also creates its NCCL communicator here. */
ds4_status ds4_comm_init_with(const ds4_comm_options *o, ds4_comm **out, ds4_error *err);
/* End the communicator: MPI_Finalize when ds4_comm_init initialized MPI (a collective step: every rank must call
 * it). NULL is allowed. */
ds4_status ds4_comm_finalize(ds4_comm *c, ds4_error *err);
/* Free without finalizing MPI (and aborting NCCL): for a rank that is failing; the launcher then ends the job, and
 * the TCP and NCCL peers see the closed connections (docs/distributed.md). */
void ds4_comm_abandon(ds4_comm *c);

int32_t ds4_comm_rank(const ds4_comm *c);
int32_t ds4_comm_world_size(const ds4_comm *c);
int32_t ds4_comm_local_rank(const ds4_comm *c); /* rank among the processes of this machine */
const char *ds4_comm_backend(const ds4_comm *c); /* host collectives: "mpi", "tcp" or "single" */
ds4_launcher ds4_comm_launcher(const ds4_comm *c);
int32_t ds4_comm_device(const ds4_comm *c);      /* the NCCL communicator's CUDA device; -1 without one */
double ds4_comm_timeout(const ds4_comm *c);      /* seconds */

ds4_status ds4_comm_barrier(ds4_comm *c, ds4_error *err);
/* In place: buf[i] = sum over ranks of buf[i]. dtype DS4_F32 or DS4_F64; count elements. The summation order is
 * fixed, rank 0's value + rank 1's + rank 2's + ... one addition at a time, over MPI (a reduce-scatter by hand, then
 * an all-gather) and over the TCP star alike: the sum one process forms accumulating the ranks' values in order. */
ds4_status ds4_comm_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err);
/* recv (world_size * nbytes) = every rank's send (nbytes each), in rank order. */
ds4_status ds4_comm_all_gather(ds4_comm *c, const void *send, void *recv, size_t nbytes, ds4_error *err);
/* In place: every rank's buf becomes rank root's. */
ds4_status ds4_comm_broadcast(ds4_comm *c, void *buf, size_t nbytes, int32_t root, ds4_error *err);

/* Rows to every rank: send_rows[q] rows of row_bytes bytes go to rank q (the q-th consecutive block of send); recv
 * gets recv_rows[s] rows from rank s, blocks in rank order. Every rank's send_rows[q] must equal rank q's
 * recv_rows[s = this rank] (the TCP star checks; MPI's behaviour otherwise is undefined). Bytes move unchanged. */
ds4_status ds4_comm_all_to_all_v(ds4_comm *c, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err);

/* The same three on buffers in the memory of the communicator's CUDA device (ds4_comm_device), through NCCL; each
 * returns once the collective has completed on the device. DS4_ERR_ARG without an NCCL communicator. The sum's
 * order is NCCL's (with 2 ranks every element is one fp32 addition, so the result does not depend on it). */
ds4_status ds4_comm_device_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *dev_buf, int64_t count, ds4_error *err);
ds4_status ds4_comm_device_all_gather(ds4_comm *c, const void *dev_send, void *dev_recv, size_t nbytes,
                                      ds4_error *err);
ds4_status ds4_comm_device_broadcast(ds4_comm *c, void *dev_buf, size_t nbytes, int32_t root, ds4_error *err);
/* ds4_comm_all_to_all_v on device buffers (ncclSend / ncclRecv in one group). */
ds4_status ds4_comm_device_all_to_all_v(ds4_comm *c, const void *dev_send, const int64_t *send_rows, void *dev_recv,
                                        const int64_t *recv_rows, size_t row_bytes, ds4_error *err);

/* In place: buf's bytes [off[r]·esz, (off[r] + len[r])·esz) come from rank r, for every rank r (disjoint regions, the
 * same off / len on every rank): the all-gather of a sharded buffer (ZeRO-1's updated parameters). */
ds4_status ds4_comm_all_gather_regions(ds4_comm *c, void *buf, size_t esz, const int64_t *off, const int64_t *len,
                                       ds4_error *err);
/* The same on a buffer in the memory of the communicator's CUDA device (NCCL: one in-place broadcast per rank, rooted
 * at it); returns once complete there. DS4_ERR_ARG without an NCCL communicator. */
ds4_status ds4_comm_device_all_gather_regions(ds4_comm *c, void *dev_buf, size_t esz, const int64_t *off,
                                              const int64_t *len, ds4_error *err);
/* ZeRO-1 over this communicator (ds4_adamw_set_shard): the optimizer keeps the moments of this rank's shard and
 * updates its parameters only; its steps then sum the norm's partials and gather the parameters here, so the
 * communicator must outlive its steps. A CUDA model's (on the communicator's device) needs the NCCL communicator: its
 * updated fp32 master weights are gathered through it. */
ds4_status ds4_comm_shard_optimizer(ds4_comm *c, ds4_adamw *a, ds4_error *err);
/* ZeRO-1 with a reduce-scatter (on = 1; 0: off again): from now on ds4_comm_all_reduce_grads (and the overlapped
 * buckets) of a's model sum each rank's region of a's shard only (MPI_Alltoallv and the rank-order sum; the TCP star
 * sending each rank its region; NCCL one ncclReduce per region), which is all a's sharded step reads: the norm, the
 * clip coefficient and the weights are the all-reduce's bits. The rest of each rank's gradient buffer keeps its own
 * unsummed values (the model's gradients are the sum in its region only). a must be sharded over c (any means).
 * The regions are the model's (ds4_model_set_grad_regions): they stay with it. */
ds4_status ds4_comm_reduce_scatter_grads(ds4_comm *c, ds4_adamw *a, int on, ds4_error *err);

/* Data parallelism's step between backward and the optimizer: the model's gradient buffer times `scale` (this
 * rank's share of the global normalisation), then summed over ranks, where the model computes: a CPU model through
 * the host collectives, a CUDA model through NCCL on its device (which must be the communicator's). A world of one
 * only scales (unless it has NCCL, which then runs too). docs/distributed.md, "Data parallelism". */
ds4_status ds4_comm_all_reduce_grads(ds4_comm *c, ds4_model *m, double scale, ds4_error *err);

/* The gradient reduction overlapped with the backward (docs/distributed.md, "Bucketed all-reduce"): the model's next
 * backward (call this before each step's last backward, after the micro-batches before it have accumulated) sums its
 * gradients over ranks bucket by bucket as they become final, while it goes on with earlier blocks: CPU models on a
 * thread of the communicator (MPI or the TCP star), CUDA models on NCCL's stream. ds4_comm_all_reduce_grads (scale
 * 1) then waits for the buckets instead of reducing the buffer. Every element's sum is the unbucketed one's (rank
 * order on MPI and TCP; NCCL's for 2 ranks). A rank that runs no backward between this and all_reduce_grads (no
 * micro-batch of its own) sends its buffer as it is, in the same buckets. A no-op with bucket_mb 0, a world of one, or an MPI whose thread level is
 * below MPI_THREAD_SERIALIZED (the host initialised it): all_reduce_grads then reduces after the backward, as
 * without it. While buckets are in flight the communicator's other collectives wait for them first. The
 * communicator must outlive the armed backward. */
ds4_status ds4_comm_overlap_backward(ds4_comm *c, ds4_model *m, ds4_error *err);
/* The bucket size in MiB (0: off; the elements are floor(mb · 2^20 / 4), at least 1). */
ds4_status ds4_comm_set_bucket_mb(ds4_comm *c, double mb, ds4_error *err);
double ds4_comm_bucket_mb(const ds4_comm *c);

/* Expert parallelism (docs/distributed.md, "Expert parallelism"): on = 1 installs the communicator's all-to-all as
 * the model's expert-parallel hooks (ds4_model_set_expert_parallel): rank r computes experts [r·E/P, (r+1)·E/P)
 * for every rank's tokens (host collectives for a CPU model; NCCL for a CUDA model, which must be on the
 * communicator's device); on = 0 removes them. The communicator must outlive the model's use of them: turn expert
 * parallelism off (or free the model) before ds4_comm_finalize. With it on, ds4_comm_all_reduce_grads takes scale 1
 * only: the backward must carry the global normalisation. on = DS4_EP_SHARDED: on, and each rank keeps only its own
 * experts' weights, gradients and moments (CPU models; ds4_expert_parallel.shard); all_reduce_grads then sums the
 * replicated tensors only. */
#define DS4_EP_SHARDED 2
ds4_status ds4_comm_expert_parallel(ds4_comm *c, ds4_model *m, int on, ds4_error *err);

/* Context parallelism (docs/distributed.md, "Context parallelism"): on = 1 installs the communicator's all-gathers
 * as the model's context-parallel hooks (ds4_model_set_context_parallel): every rank passes the whole sequence and
 * computes its contiguous slice of it; on = 0 removes them. on = DS4_CP_WHOLE_ATTENTION: on, every rank running each
 * attention sub-layer over the whole sequences (ds4_context_parallel.whole_attention). The communicator must outlive
 * the model's use of them: turn it off (or free the model) before ds4_comm_finalize. The backward takes the global
 * normalisation (the forward returns the whole sequence's losses and counts on every rank) and the gradients are then
 * summed with ds4_comm_all_reduce_grads, scale 1. */
#define DS4_CP_WHOLE_ATTENTION 2
ds4_status ds4_comm_context_parallel(ds4_comm *c, ds4_model *m, int on, ds4_error *err);

#ifdef __cplusplus
}
#endif

#endif
