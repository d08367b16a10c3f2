/* nccl_backend.h — collectives on device buffers through NCCL, one GPU per process. Implemented by nccl_backend.c
 * (built when CMake finds NCCL next to the CUDA toolkit) or nccl_absent.c (every call refused, naming the missing
 * dependency). Not installed.
 *
 * The NCCL communicator is non-blocking (ncclConfig_t.blocking = 0) and every wait polls with a deadline: a
 * collective that has not completed within the timeout, or that NCCL reports as failed (ncclCommGetAsyncError), aborts
 * the communicator (ncclCommAbort) and returns DS4_ERR_COMM naming the collective, its sizes and this rank; after that
 * every call is refused. Each call returns once its collective has completed on the device. */
#ifndef DS4_DIST_NCCL_BACKEND_H
#define DS4_DIST_NCCL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

typedef struct dist_nccl dist_nccl;

/* The host communicator's broadcast (MPI or the TCP star): rank 0 hands out the NCCL unique id with it. */
typedef ds4_status (*dist_bcast_fn)(void *ctx, void *buf, size_t nbytes, int32_t root, ds4_error *err);

int dist_nccl_built(void);
/* The NCCL version this build links, e.g. "2.28.9" (or "none"). */
const char *dist_nccl_version(char *buf, size_t len);
/* Collective over every rank: rank `rank` of `world` on CUDA device `device`. */
ds4_status dist_nccl_open(int32_t rank, int32_t world, int32_t device, double timeout_s, dist_bcast_fn bcast,
                          void *bcast_ctx, dist_nccl **out, ds4_error *err);
/* finalize = 1: ncclCommFinalize (flushes; every rank calls it) then ncclCommDestroy; 0 (a failing rank):
 * ncclCommAbort. Frees n in every case; NULL is allowed. */
ds4_status dist_nccl_close(dist_nccl *n, int finalize, ds4_error *err);
int32_t dist_nccl_device(const dist_nccl *n);

/* In place: sum over ranks (F32 or F64). */
ds4_status dist_nccl_all_reduce_sum(dist_nccl *n, ds4_dtype dtype, void *dev_buf, int64_t count, ds4_error *err);
/* Enqueue without waiting: a sum over ranks of dev_buf [count] (F32), an all-reduce (off NULL) or a reduce-scatter
 * (rank r gets the sums of [off[r], off[r] + len[r]): one ncclReduce rooted at each rank, in a group), on NCCL's
 * stream after the work enqueued so far on `after` (a cudaStream_t: an event recorded there; NULL: nothing to wait
 * for). Returns once NCCL took the call; dist_nccl_wait then waits for everything enqueued. */
ds4_status dist_nccl_enqueue_sum(dist_nccl *n, float *dev_buf, int64_t count, const int64_t *off, const int64_t *len,
                                 void *after, ds4_error *err);
/* Until every call enqueued has completed on the device (the deadline and the abort as for every call). */
ds4_status dist_nccl_wait(dist_nccl *n, const char *op, ds4_error *err);
/* dev_recv (world * nbytes) = every rank's dev_send, in rank order. */
ds4_status dist_nccl_all_gather(dist_nccl *n, const void *dev_send, void *dev_recv, size_t nbytes, ds4_error *err);
/* In place: every rank's bytes become rank root's. */
ds4_status dist_nccl_broadcast(dist_nccl *n, void *dev_buf, size_t nbytes, int32_t root, ds4_error *err);
/* send_rows[q] rows of row_bytes to rank q (consecutive blocks of dev_send), recv_rows[s] from rank s (consecutive
 * blocks of dev_recv): one group of ncclSend / ncclRecv, the rank's own block a device copy beside it. */
ds4_status dist_nccl_all_to_all_v(dist_nccl *n, const void *dev_send, const int64_t *send_rows, void *dev_recv,
                                  const int64_t *recv_rows, size_t row_bytes, ds4_error *err);

#endif
