/* nccl_backend.c — collectives on device buffers through NCCL, with a watchdog (nccl_backend.h).
 *
 * Why non-blocking and polled: a blocking NCCL communicator whose peer died leaves this rank's kernel spinning
 * forever, and the host thread in cudaStreamSynchronize with it. Here every call is enqueued on a stream of our
 * own, and the host polls: ncclCommGetAsyncError (NCCL's own view: a network error, a remote failure) and
 * cudaStreamQuery (done?), until the deadline. Past it, or on an error, ncclCommAbort stops the kernels and the
 * call returns DS4_ERR_COMM; the communicator is then dead (NCCL cannot resume an aborted one). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "internal.h"
#include "nccl_backend.h"

struct dist_nccl {
    ncclComm_t comm;     /* NULL once aborted */
    cudaStream_t stream; /* ours: NCCL's kernels run here, the model's stream is idle meanwhile */
    int32_t rank, world, device;
    double timeout_s;
    char why[400];       /* why the communicator was aborted */
};

int dist_nccl_built(void) { return 1; }

const char *dist_nccl_version(char *buf, size_t len) {
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess) snprintf(buf, len, "unknown");
    else snprintf(buf, len, "%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
    return buf;
}

int32_t dist_nccl_device(const dist_nccl *n) { return n->device; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Abort the communicator and fail with "dist <op> (NCCL): <what> (<detail>; rank r of w on cuda:d)"; later calls
 * are refused with the same text. */
static ds4_status die(dist_nccl *n, const char *op, const char *detail, ds4_error *err, const char *fmt, ...)
    DS4_PRINTF(5, 6);
static ds4_status die(dist_nccl *n, const char *op, const char *detail, ds4_error *err, const char *fmt, ...) {
    char what[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (n->comm) {
        (void)ncclCommAbort(n->comm);
        n->comm = NULL;
    }
    snprintf(n->why, sizeof n->why, "dist %s (NCCL): %s (%s; rank %d of %d on cuda:%d); the communicator was "
                                    "aborted", op, what, detail, n->rank, n->world, n->device);
    return ds4_fail(err, DS4_ERR_COMM, "%s", n->why);
}

static const char *last_error(dist_nccl *n) {
    const char *s = n->comm ? ncclGetLastError(n->comm) : NULL;
    return s && *s ? s : "no further detail from NCCL";
}

/* Wait until NCCL has taken the call (the communicator's state leaves ncclInProgress) and, when `stream_too`, until
 * the stream has run it, polling both with the deadline. */
static ds4_status wait_done(dist_nccl *n, const char *op, const char *detail, int stream_too, ds4_error *err) {
    const double deadline = now_s() + n->timeout_s;
    for (long spins = 0;; spins++) {
        ncclResult_t a = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &a);
        if (r != ncclSuccess)
            return die(n, op, detail, err, "ncclCommGetAsyncError failed: %s", ncclGetErrorString(r));
        if (a != ncclSuccess && a != ncclInProgress)
            return die(n, op, detail, err, "%s: %s (a peer failed, or the network did)", ncclGetErrorString(a),
                       last_error(n));
        if (a == ncclSuccess) {
            if (!stream_too) return DS4_OK;
            cudaError_t q = cudaStreamQuery(n->stream);
            if (q == cudaSuccess) return DS4_OK;
            if (q != cudaErrorNotReady) {
                (void)cudaGetLastError();
                return die(n, op, detail, err, "cudaStreamQuery: %s", cudaGetErrorString(q));
            }
        }
        if (now_s() > deadline)
            return die(n, op, detail, err, "not complete after %g s (the timeout, DS4_DIST_TIMEOUT): a peer rank died, "
                                           "hangs, or called another collective", n->timeout_s);
        /* spin briefly (a collective of a few KiB takes microseconds), then sleep between polls */
        if (spins > 1000) nanosleep(&(struct timespec){.tv_nsec = 50 * 1000}, NULL);
    }
}

/* Before a collective: refuse an aborted communicator; make the communicator's device current. */
static ds4_status begin(dist_nccl *n, const char *op, ds4_error *err) {
    if (!n->comm)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s (NCCL): refused: the communicator failed earlier: %s", op, n->why);
    cudaError_t e = cudaSetDevice(n->device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return ds4_fail(err, DS4_ERR_CUDA, "dist %s (NCCL): cudaSetDevice(%d): %s", op, n->device,
                        cudaGetErrorString(e));
    }
    return DS4_OK;
}

/* The result of an enqueueing call: ncclSuccess or ncclInProgress go on to the wait, anything else aborts. */
static ds4_status issued(dist_nccl *n, ncclResult_t r, const char *op, const char *call, const char *detail,
                         ds4_error *err) {
    if (r != ncclSuccess && r != ncclInProgress)
        return die(n, op, detail, err, "%s failed: %s: %s", call, ncclGetErrorString(r), last_error(n));
    return wait_done(n, op, detail, 1, err);
}

ds4_status dist_nccl_open(int32_t rank, int32_t world, int32_t device, double timeout_s, dist_bcast_fn bcast,
                          void *bcast_ctx, dist_nccl **out, ds4_error *err) {
    *out = NULL;
    dist_nccl *n = calloc(1, sizeof *n);
    if (!n) return ds4_fail(err, DS4_ERR_OOM, "dist init (NCCL): allocating the communicator");
    n->rank = rank, n->world = world, n->device = device, n->timeout_s = timeout_s;
    char detail[96];
    snprintf(detail, sizeof detail, "unique id from rank 0");
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        free(n);
        return ds4_fail(err, DS4_ERR_CUDA, "dist init (NCCL): cuda:%d (rank %d of %d): %s", device, rank, world,
                        cudaGetErrorString(e));
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t r = rank == 0 ? ncclGetUniqueId(&id) : ncclSuccess;
    ds4_status st = DS4_OK;
    if (r != ncclSuccess)
        st = ds4_fail(err, DS4_ERR_COMM, "dist init (NCCL): ncclGetUniqueId failed: %s", ncclGetErrorString(r));
    /* every rank takes part in the broadcast, even after rank 0 failed, so that nobody waits for it in vain: a
     * failed rank 0 sends zeros, which the others refuse below */
    ds4_status bst = bcast(bcast_ctx, &id, sizeof id, 0, st ? NULL : err);
    if (!st && bst) st = bst;
    static const ncclUniqueId zero;
    if (!st && memcmp(&id, &zero, sizeof id) == 0)
        st = ds4_fail(err, DS4_ERR_COMM, "dist init (NCCL): rank 0 sent no unique id (ncclGetUniqueId failed there)");
    if (st) {
        dist_nccl_close(n, 0, NULL);
        return st;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    r = ncclCommInitRankConfig(&n->comm, world, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = die(n, "init", detail, err, "ncclCommInitRankConfig failed: %s: %s", ncclGetErrorString(r), last_error(n));
    } else {
        snprintf(detail, sizeof detail, "ncclCommInitRankConfig, %d ranks", world);
        st = wait_done(n, "init", detail, 0, err);
    }
    if (st) {
        dist_nccl_close(n, 0, NULL);
        return st;
    }
    *out = n;
    return DS4_OK;
}

ds4_status dist_nccl_close(dist_nccl *n, int finalize, ds4_error *err) {
    if (!n) return DS4_OK;
    ds4_status st = DS4_OK;
    (void)cudaSetDevice(n->device);
    if (n->comm && finalize) {
        ncclResult_t r = ncclCommFinalize(n->comm);
        if (r != ncclSuccess && r != ncclInProgress)
            st = die(n, "finalize", "ncclCommFinalize", err, "%s: %s", ncclGetErrorString(r), last_error(n));
        else
            st = wait_done(n, "finalize", "ncclCommFinalize", 0, err);
        if (!st && (r = ncclCommDestroy(n->comm)) != ncclSuccess)
            st = ds4_fail(err, DS4_ERR_COMM, "dist finalize (NCCL): ncclCommDestroy failed: %s", ncclGetErrorString(r));
        n->comm = NULL;
    }
    if (n->comm) (void)ncclCommAbort(n->comm);
    if (n->stream) (void)cudaStreamDestroy(n->stream);
    (void)cudaGetLastError();
    free(n);
    return st;
}

ds4_status dist_nccl_all_reduce_sum(dist_nccl *n, ds4_dtype dtype, void *dev_buf, int64_t count, ds4_error *err) {
    ds4_status st = begin(n, "all_reduce", err);
    if (st) return st;
    char detail[96];
    snprintf(detail, sizeof detail, "%s, %lld elements", ds4_dtype_name(dtype), (long long)count);
    ncclResult_t r = ncclAllReduce(dev_buf, dev_buf, (size_t)count, dtype == DS4_F64 ? ncclFloat64 : ncclFloat32,
                                   ncclSum, n->comm, n->stream);
    return issued(n, r, "all_reduce", "ncclAllReduce", detail, err);
}

/* The bucketed reduction's calls (dist/grad_buckets.c): NCCL's stream waits on an event recorded on the model's
 * stream after the kernels that produced the bucket, so the backward goes on while the bucket is summed. */
ds4_status dist_nccl_enqueue_sum(dist_nccl *n, float *dev_buf, int64_t count, const int64_t *off, const int64_t *len,
                                 void *after, ds4_error *err) {
    const char *op = off ? "reduce_scatter" : "all_reduce";
    ds4_status st = begin(n, op, err);
    if (st) return st;
    char detail[96];
    snprintf(detail, sizeof detail, "F32, %lld elements, enqueued after the backward's kernels", (long long)count);
    if (after) {
        cudaEvent_t ev = NULL;
        cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventRecord(ev, (cudaStream_t)after);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(n->stream, ev, 0);
        if (ev) (void)cudaEventDestroy(ev); /* released once the wait has happened */
        if (e != cudaSuccess) return die(n, op, detail, err, "ordering after the model's stream: %s", cudaGetErrorString(e));
    }
    ncclResult_t r = ncclSuccess;
    if (!off) {
        r = ncclAllReduce(dev_buf, dev_buf, (size_t)count, ncclFloat32, ncclSum, n->comm, n->stream);
    } else { /* ncclReduceScatter wants equal parts; ZeRO-1's regions are not */
        r = ncclGroupStart();
        if (r != ncclSuccess) return die(n, op, detail, err, "ncclGroupStart failed: %s", ncclGetErrorString(r));
        for (int32_t q = 0; q < n->world && (r == ncclSuccess || r == ncclInProgress); q++)
            if (len[q] > 0)
                r = ncclReduce(dev_buf + off[q], dev_buf + off[q], (size_t)len[q], ncclFloat32, ncclSum, q, n->comm,
                               n->stream);
        const ncclResult_t g = ncclGroupEnd();
        if (r == ncclSuccess || r == ncclInProgress) r = g;
    }
    if (r != ncclSuccess && r != ncclInProgress)
        return die(n, op, detail, err, "%s failed: %s: %s", off ? "ncclReduce" : "ncclAllReduce",
                   ncclGetErrorString(r), last_error(n));
    return wait_done(n, op, detail, 0, err);
}

ds4_status dist_nccl_wait(dist_nccl *n, const char *op, ds4_error *err) {
    ds4_status st = begin(n, op, err);
    return st ? st : wait_done(n, op, "the enqueued buckets", 1, err);
}

ds4_status dist_nccl_all_gather(dist_nccl *n, const void *dev_send, void *dev_recv, size_t nbytes, ds4_error *err) {
    ds4_status st = begin(n, "all_gather", err);
    if (st) return st;
    char detail[96];
    snprintf(detail, sizeof detail, "%zu bytes per rank", nbytes);
    ncclResult_t r = ncclAllGather(dev_send, dev_recv, nbytes, ncclUint8, n->comm, n->stream);
    return issued(n, r, "all_gather", "ncclAllGather", detail, err);
}

ds4_status dist_nccl_broadcast(dist_nccl *n, void *dev_buf, size_t nbytes, int32_t root, ds4_error *err) {
    ds4_status st = begin(n, "broadcast", err);
    if (st) return st;
    char detail[96];
    snprintf(detail, sizeof detail, "%zu bytes from rank %d", nbytes, root);
    ncclResult_t r = ncclBroadcast(dev_buf, dev_buf, nbytes, ncclUint8, root, n->comm, n->stream);
    return issued(n, r, "broadcast", "ncclBroadcast", detail, err);
}

/* Point-to-point in one group (NCCL has no all-to-all-v): every pair's send and receive are enqueued together, so no
 * order of peers can deadlock; the group is one collective for the watchdog. The rank's own block is a device copy
 * on the same stream instead of a send to itself: NCCL would move it through its buffers at a fraction of the copy
 * engine's rate, and it is the whole exchange on a world of one and 1 / P of it on P ranks. Data movement only. */
ds4_status dist_nccl_all_to_all_v(dist_nccl *n, const void *dev_send, const int64_t *send_rows, void *dev_recv,
                                  const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    ds4_status st = begin(n, "all_to_all_v", err);
    if (st) return st;
    size_t so = 0, ro = 0, self_so = 0, self_ro = 0;
    for (int32_t q = 0; q < n->world; q++) {
        if (q == n->rank) self_so = so, self_ro = ro;
        so += (size_t)send_rows[q] * row_bytes, ro += (size_t)recv_rows[q] * row_bytes;
    }
    char detail[96];
    snprintf(detail, sizeof detail, "%zu bytes out, %zu in, rows of %zu bytes", so, ro, row_bytes);
    const size_t self = (size_t)send_rows[n->rank] * row_bytes;
    if (recv_rows[n->rank] != send_rows[n->rank])
        return die(n, "all_to_all_v", detail, err, "rank %d sends itself %lld rows but expects %lld", n->rank,
                   (long long)send_rows[n->rank], (long long)recv_rows[n->rank]);
    if (self) {
        cudaError_t e = cudaMemcpyAsync((char *)dev_recv + self_ro, (const char *)dev_send + self_so, self,
                                        cudaMemcpyDeviceToDevice, n->stream);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return die(n, "all_to_all_v", detail, err, "cudaMemcpyAsync of the rank's own %zu bytes: %s", self,
                       cudaGetErrorString(e));
        }
    }
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return die(n, "all_to_all_v", detail, err, "ncclGroupStart failed: %s", ncclGetErrorString(r));
    so = ro = 0;
    for (int32_t q = 0; q < n->world && (r == ncclSuccess || r == ncclInProgress); q++) {
        const size_t sb = (size_t)send_rows[q] * row_bytes, rb = (size_t)recv_rows[q] * row_bytes;
        if (sb && q != n->rank) r = ncclSend((const char *)dev_send + so, sb, ncclUint8, q, n->comm, n->stream);
        if (rb && q != n->rank && (r == ncclSuccess || r == ncclInProgress))
            r = ncclRecv((char *)dev_recv + ro, rb, ncclUint8, q, n->comm, n->stream);
        so += sb, ro += rb;
    }
    const ncclResult_t g = ncclGroupEnd(); /* always closes the group, even after a failed enqueue */
    if (r != ncclSuccess && r != ncclInProgress)
        return die(n, "all_to_all_v", detail, err, "ncclSend / ncclRecv failed: %s: %s", ncclGetErrorString(r),
                   last_error(n));
    return issued(n, g, "all_to_all_v", "ncclGroupEnd", detail, err);
}
