/* grad_buckets.c — data parallelism's gradient reduction overlapped with the backward (docs/distributed.md,
 * "Bucketed all-reduce"). The backward reports the regions of the flat gradient buffer that become final, from the
 * top of the buffer down (ds4_model_on_grads_final: the head and the MTP block, then each block from the last to
 * the first, then the embedding); the buffer is cut into buckets of c->bucket elements from its top, [n - (k+1)·B,
 * n - k·B), the same on every rank whatever the parameters' sizes, and bucket k is summed over ranks as soon as
 * everything in it is final, while the backward goes on with earlier blocks.
 *
 * Host buffers (a CPU model over MPI or the TCP star): the buckets are queued for a communication thread that
 * belongs to the communicator and makes the host collectives one at a time; every other collective of the
 * communicator first waits until the queue is empty (dist_buckets_drain), so the two threads never call MPI or the
 * sockets at once (MPI is initialised MPI_THREAD_SERIALIZED) and every rank issues its collectives in the same
 * order. Device buffers (a CUDA model with NCCL): the hook enqueues each bucket's NCCL call on NCCL's stream after
 * an event recorded on the model's stream; no thread.
 *
 * The bits: every element's sum is formed whole inside one bucket, in the order of the unbucketed path (rank order
 * on MPI and TCP for any number of ranks; NCCL: one addition for 2 ranks, NCCL's own order beyond), so the result
 * is the unbucketed reduction's. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"
#include "ds4_train.h"
#include "internal.h"

struct dist_buckets {
    ds4_comm *c;
    pthread_mutex_t mu;
    pthread_cond_t wake, idle; /* wake: a bucket queued or stop; idle: a bucket done */
    pthread_t th;
    int thread_on, stop;
    /* the armed reduction */
    ds4_model *m;         /* its model, NULL when none is armed */
    int device;           /* 1: NCCL on the model's device, 0: the host path */
    int reported;         /* the backward has reported at least one region */
    int whole;            /* no queue could be allocated: the whole buffer is reduced when the reduction finishes */
    float *g;             /* the gradient buffer [n] */
    int64_t n, next_hi;   /* next_hi: the top of the first bucket not queued yet */
    int64_t B;            /* elements per bucket, as when armed */
    int64_t *jobs;        /* [cap][2] the buckets queued, [lo, hi) */
    int64_t cap, queued, done;
    const int64_t *roff, *rlen; /* the model's ZeRO-1 regions ([world] each), or NULL: the buckets are all-reduced */
    int64_t *toff, *tlen; /* [world] a bucket's ZeRO-1 regions: the thread's, the hook's (toff + 2·world) */
    ds4_status st;        /* the first failure of this reduction */
    ds4_error err;
};

static void fail_once(dist_buckets *b, ds4_status st, const ds4_error *e) {
    if (st && !b->st) {
        b->st = st;
        b->err = *e;
    }
}

/* The ZeRO-1 regions clipped to the bucket [lo, hi), relative to lo; 0 when the gradients are all-reduced. */
static int clip_regions(const dist_buckets *b, int64_t lo, int64_t hi, int64_t *off, int64_t *len) {
    if (!b->roff) return 0;
    for (int32_t r = 0; r < b->c->world_size; r++) {
        const int64_t a = b->roff[r] > lo ? b->roff[r] : lo;
        const int64_t e = b->roff[r] + b->rlen[r] < hi ? b->roff[r] + b->rlen[r] : hi;
        off[r] = e > a ? a - lo : 0;
        len[r] = e > a ? e - a : 0;
    }
    return 1;
}

static void *comm_thread(void *arg) {
    dist_buckets *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->stop && b->done == b->queued) pthread_cond_wait(&b->wake, &b->mu);
        if (b->stop) break;
        const int64_t lo = b->jobs[2 * b->done], hi = b->jobs[2 * b->done + 1];
        const int skip = b->st != DS4_OK; /* after a failure the rest is not sent (the peers fail too) */
        pthread_mutex_unlock(&b->mu);
        ds4_error e = {0};
        ds4_status st = DS4_OK;
        if (!skip) {
            const int rs = clip_regions(b, lo, hi, b->toff, b->tlen);
            st = dist_host_sum(b->c, b->g + lo, hi - lo, rs ? b->toff : NULL, rs ? b->tlen : NULL, &e);
        }
        pthread_mutex_lock(&b->mu);
        fail_once(b, st, &e);
        b->done++;
        pthread_cond_broadcast(&b->idle);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* ds4_model_guard_grads' wait: the model is going away while armed or summing: the buckets queued finish (a
 * backward never ran or ran whole: nothing more comes), and the reduction forgets the model. */
static void model_going(void *ctx) {
    dist_buckets *b = ctx;
    if (b->device) {
        ds4_error e = {0};
        if (b->reported) (void)dist_nccl_wait(b->c->nccl, "bucketed all_reduce", &e);
    } else {
        dist_buckets_drain(b->c);
    }
    b->m = NULL;
}

/* The armed model let go: its hook and guard removed (it is alive: a model going away clears b->m first). */
static void release(dist_buckets *b) {
    ds4_model_on_grads_final(b->m, NULL, NULL);
    ds4_model_guard_grads(b->m, NULL, NULL);
    b->m = NULL;
}

/* Bucket [lo, hi) is final everywhere: to the thread, or onto NCCL's stream after the model's (`stream`). */
static void launch(dist_buckets *b, int64_t lo, int64_t hi, void *stream) {
    if (b->device) {
        if (b->st) return;
        int64_t *off = b->toff + 2 * b->c->world_size, *len = off + b->c->world_size;
        const int rs = clip_regions(b, lo, hi, off, len);
        ds4_error e = {0};
        fail_once(b, dist_nccl_enqueue_sum(b->c->nccl, b->g + lo, hi - lo, rs ? off : NULL, rs ? len : NULL, stream,
                                           &e), &e);
        b->queued++, b->done++;
        return;
    }
    pthread_mutex_lock(&b->mu);
    b->jobs[2 * b->queued] = lo, b->jobs[2 * b->queued + 1] = hi;
    b->queued++;
    pthread_cond_signal(&b->wake);
    pthread_mutex_unlock(&b->mu);
}

/* Every bucket that lies wholly in [lo, n) and is not queued yet, top first. */
static void launch_from(dist_buckets *b, int64_t lo, void *stream) {
    const int64_t B = b->B;
    while (b->next_hi > 0) {
        const int64_t blo = b->next_hi > B ? b->next_hi - B : 0;
        if (blo < lo) break;
        launch(b, blo, b->next_hi, stream);
        b->next_hi = blo;
    }
}

/* ds4_grads_final_fn: runs on the backward's thread. A model armed earlier and not since (another was armed
 * instead) is not this reduction's: ignored. */
static void on_final(void *ctx, ds4_model *m, float *grads, int64_t lo, int64_t hi, void *stream) {
    dist_buckets *b = ctx;
    if (m != b->m) return;
    if (!b->reported) { /* the first region's top is the buffer's size */
        b->reported = 1;
        b->g = grads, b->n = hi, b->next_hi = hi;
        if (!dist_grad_regions(b->c, b->m, hi, &b->roff, &b->rlen)) b->roff = b->rlen = NULL;
        const int64_t cap = hi / b->B + 2;
        if (!b->device && cap > b->cap) {
            int64_t *j = realloc(b->jobs, (size_t)cap * 2 * sizeof *j);
            if (!j) { /* the whole buffer is reduced when the reduction finishes, on the caller's thread */
                b->whole = 1;
                return;
            }
            b->jobs = j, b->cap = cap;
        }
    }
    if (!grads || b->whole) return;
    launch_from(b, lo, stream);
}

ds4_status dist_buckets_arm(ds4_comm *c, ds4_model *m, int *armed, ds4_error *err) {
    *armed = 0;
    const ds4_device_options dev = ds4_model_device(m);
    const int device = dev.type == DS4_DEVICE_CUDA;
    /* sharded experts: each rank's expert gradients are its own, so the buffer is not one sum over the ranks; the
     * sum runs after the backward over the replicated runs only (all_reduce_grads) */
    if (c->bucket <= 0 || c->world_size == 1 || (device && !c->nccl) || (c->mpi && !dist_mpi_serialized(c->mpi)) ||
        ds4_model_replicated_runs(m, NULL, NULL, 0) > 0)
        return DS4_OK;
    dist_buckets *b = c->bk;
    if (b && b->m && b->reported)
        return ds4_fail(err, DS4_ERR_ARG, "dist overlap_backward: the gradients of an earlier backward are still being "
                                          "reduced: call all_reduce_grads after each step's last backward");
    if (b && b->m) release(b); /* armed, no backward since: armed again below */
    if (!b) {
        if (!(b = calloc(1, sizeof *b)) || !(b->toff = calloc((size_t)c->world_size * 4, sizeof *b->toff))) {
            free(b);
            return ds4_fail(err, DS4_ERR_OOM, "dist overlap_backward: the bucketed reduction's state");
        }
        b->tlen = b->toff + c->world_size;
        b->c = c;
        if (pthread_mutex_init(&b->mu, NULL) || pthread_cond_init(&b->wake, NULL) || pthread_cond_init(&b->idle, NULL)) {
            free(b->toff);
            free(b);
            return ds4_fail(err, DS4_ERR_INTERNAL, "dist overlap_backward: initialising the thread's mutex");
        }
        c->bk = b;
    }
    if (!device && !b->thread_on) {
        if (pthread_create(&b->th, NULL, comm_thread, b))
            return ds4_fail(err, DS4_ERR_INTERNAL, "dist overlap_backward: starting the communication thread");
        b->thread_on = 1;
    }
    b->m = m, b->device = device, b->reported = b->whole = 0;
    b->B = c->bucket;
    b->g = NULL, b->n = b->next_hi = 0;
    b->queued = b->done = 0;
    b->st = DS4_OK;
    memset(&b->err, 0, sizeof b->err);
    ds4_model_on_grads_final(m, on_final, b);
    ds4_model_guard_grads(m, model_going, b);
    *armed = 1;
    return DS4_OK;
}

void dist_buckets_drain(ds4_comm *c) {
    dist_buckets *b = c ? c->bk : NULL;
    if (!b || !b->thread_on) return;
    pthread_mutex_lock(&b->mu);
    while (b->done < b->queued) pthread_cond_wait(&b->idle, &b->mu);
    pthread_mutex_unlock(&b->mu);
}

int dist_buckets_finish(ds4_comm *c, ds4_model *m, ds4_status *st, ds4_error *err) {
    dist_buckets *b = c->bk;
    if (!b || b->m != m) return 0;
    if (!b->reported) { /* armed, but this rank ran no backward (it had no micro-batch): its buffer is final as it
                           is, and goes in the same buckets as the other ranks' */
        float *g = NULL;
        int64_t n = 0;
        ds4_status s = ds4_model_grad_buffer(m, &g, &n, err);
        if (s) { /* the others wait in the buckets' collectives: this rank fails, and so the job */
            release(b);
            *st = s;
            return 1;
        }
        on_final(b, m, g, 0, n, NULL);
    }
    if (!b->whole) launch_from(b, 0, NULL); /* a backward reports everything; this is for safety only */
    if (b->device) {
        ds4_error e = {0};
        fail_once(b, dist_nccl_wait(c->nccl, "bucketed all_reduce", &e), &e);
    } else {
        dist_buckets_drain(c);
    }
    release(b);
    if (b->whole) { /* the whole buffer, on this thread */
        const int rs = clip_regions(b, 0, b->n, b->toff, b->tlen);
        *st = dist_host_sum(c, b->g, b->n, rs ? b->toff : NULL, rs ? b->tlen : NULL, err);
        return 1;
    }
    *st = b->st;
    if (b->st && err) *err = b->err;
    return 1;
}

int dist_buckets_busy(ds4_comm *c) {
    dist_buckets *b = c ? c->bk : NULL;
    if (!b || !b->thread_on) return 0;
    pthread_mutex_lock(&b->mu);
    const int busy = b->done < b->queued;
    pthread_mutex_unlock(&b->mu);
    return busy;
}

void dist_buckets_close(ds4_comm *c) {
    dist_buckets *b = c ? c->bk : NULL;
    if (!b) return;
    if (b->m) release(b); /* the model outlives the communicator: no hook or guard left pointing here */
    if (b->thread_on) {
        pthread_mutex_lock(&b->mu);
        b->stop = 1;
        pthread_cond_signal(&b->wake);
        pthread_mutex_unlock(&b->mu);
        pthread_join(b->th, NULL);
    }
    pthread_cond_destroy(&b->wake);
    pthread_cond_destroy(&b->idle);
    pthread_mutex_destroy(&b->mu);
    free(b->jobs);
    free(b->toff);
    free(b);
    c->bk = NULL;
}
