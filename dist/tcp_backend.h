/* tcp_backend.h — the host collectives of a torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
 * no MPI launcher) over TCP: a star around rank 0, which listens on MASTER_ADDR:MASTER_PORT (docs/distributed.md,
 * "The TCP rendezvous"). Needs no MPI, so CPU ranks started as plain processes work, and it hands out the NCCL
 * unique id on a GPU host without MPI. Not installed. */
#ifndef DS4_DIST_TCP_BACKEND_H
#define DS4_DIST_TCP_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"
#include "ds4_dist.h"

typedef struct dist_tcp dist_tcp;

/* The rendezvous: rank 0 accepts world_size - 1 connections, the others connect (retrying until rank 0 listens).
 * Everything, the rendezvous and every later collective, has a deadline of timeout_s seconds. *local_rank:
 * LOCAL_RANK, or (unset) the number of lower ranks on a machine of the same host name. */
ds4_status dist_tcp_open(const ds4_launch *l, double timeout_s, dist_tcp **out, int32_t *local_rank, ds4_error *err);
/* Close every connection. NULL is allowed. */
void dist_tcp_close(dist_tcp *t);
/* Shut every connection down without closing it (a collective waiting on another thread fails at once; the
 * communicator stays allocated, for dist_tcp_close after that thread has returned). */
void dist_tcp_shutdown(dist_tcp *t);

/* The collectives of ds4_dist.h. All go through rank 0, which sums in rank order (rank 0's values, plus rank 1's,
 * plus rank 2's, ...), so a result depends on nothing but the inputs. */
ds4_status dist_tcp_barrier(dist_tcp *t, ds4_error *err);
ds4_status dist_tcp_all_reduce_sum(dist_tcp *t, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err);
/* ds4_comm's reduce-scatter: rank r's region [off[r], off[r] + len[r]) of buf becomes the sum (rank order); every
 * rank still sends rank 0 its whole buffer, rank 0 sends back each rank's region only. The regions must be the same
 * on every rank (not checked: the caller's, ZeRO-1's). */
ds4_status dist_tcp_reduce_scatter_sum(dist_tcp *t, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                                       const int64_t *len, ds4_error *err);
ds4_status dist_tcp_all_gather(dist_tcp *t, const void *send, void *recv, size_t nbytes, ds4_error *err);
ds4_status dist_tcp_broadcast(dist_tcp *t, void *buf, size_t nbytes, int32_t root, ds4_error *err);
/* ds4_comm_all_to_all_v: rows through rank 0, which checks that the ranks' counts agree before reading any row. */
ds4_status dist_tcp_all_to_all_v(dist_tcp *t, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err);

#endif
