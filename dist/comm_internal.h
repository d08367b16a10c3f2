/* comm_internal.h — the communicator's fields and what dist/grad_buckets.c (the bucketed gradient reduction) needs
 * from dist/comm.c. Not installed. */
#ifndef DS4_DIST_COMM_INTERNAL_H
#define DS4_DIST_COMM_INTERNAL_H

#include <stdint.h>

#include "ds4_dist.h"
#include "mpi_backend.h"
#include "nccl_backend.h"
#include "tcp_backend.h"

typedef struct dist_buckets dist_buckets;

struct ds4_comm {
    ds4_launch launch;
    int32_t rank, world_size, local_rank;
    double timeout_s;
    dist_mpi *mpi;      /* host collectives under an MPI launcher */
    dist_tcp *tcp;      /* host collectives under a torchrun-style launch */
    dist_nccl *nccl;    /* device collectives, when asked for */
    int64_t bucket;     /* elements per bucket of the overlapped gradient reduction; 0: one reduction after */
    dist_buckets *bk;   /* that reduction's state and thread, once armed the first time */
};

/* The model's ZeRO-1 regions (ds4_model_set_grad_regions) when they are this communicator's ranks' and lie inside
 * its n gradients: 1 and *off / *len; else 0 (the gradients are all-reduced). */
int dist_grad_regions(const ds4_comm *c, const ds4_model *m, int64_t n, const int64_t **off, const int64_t **len);

/* The sum over ranks, rank order, of buf [count] on the host path (MPI or the TCP star): an all-reduce, or with
 * regions (off, len: every rank's, relative to buf) a reduce-scatter. Does not wait for the bucketed reduction: its
 * thread calls it. */
ds4_status dist_host_sum(ds4_comm *c, float *buf, int64_t count, const int64_t *off, const int64_t *len,
                         ds4_error *err);

/* The bucketed reduction (grad_buckets.c). arm: the model's next backward reduces its gradients bucket by bucket
 * as they become final (*armed 0 when it does not: buckets off, a world of one, MPI without thread support);
 * finish: the armed reduction of m completed (every bucket; armed without a backward since, the buffer as it is),
 * 1 when there was one (its status in *st); drain: the
 * host buckets queued so far are done (before any other collective); close: the thread stopped, state freed. */
ds4_status dist_buckets_arm(ds4_comm *c, ds4_model *m, int *armed, ds4_error *err);
int dist_buckets_finish(ds4_comm *c, ds4_model *m, ds4_status *st, ds4_error *err);
void dist_buckets_drain(ds4_comm *c);
int dist_buckets_busy(ds4_comm *c); /* 1 while the thread has buckets queued or in a collective */
void dist_buckets_close(ds4_comm *c);

#endif
