/* mpi_backend.c — the collectives on CPU ranks through MPI. Every MPI call is checked: the communicator is a
 * duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so a failure (a peer gone, a bad argument) comes back here
 * as a code, and MPI_Error_string goes into the ds4 error with the operation and sizes. Every collective is started
 * non-blocking and waited for until the communicator's deadline (DS4_DIST_TIMEOUT), as the TCP star's and NCCL's
 * are: a rank that never joins (it hangs, or called something else) fails the others instead of hanging them. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <mpi.h>

#include "ds4_dist.h"
#include "internal.h"
#include "mpi_backend.h"

struct dist_mpi {
    MPI_Comm world; /* duplicate of MPI_COMM_WORLD: our errhandler, no interference with the host's traffic */
    int we_initialized;
    int rank, size;
    int serialized; /* MPI's thread level allows calls from another thread, one at a time (the bucketed reduction's) */
    double timeout_s; /* a collective not complete after this long fails (mpi_wait) */
    int failed;       /* a collective timed out: its request is still pending, so no further MPI call on world */
};

int dist_mpi_built(void) { return 1; }
int dist_mpi_serialized(const dist_mpi *m) { return m->serialized; }

/* Fill err from MPI return code rc ("dist <op>: MPI_Xxx failed: <MPI's text> (<detail>)"). */
static ds4_status mpi_fail(ds4_error *err, int rc, const char *op, const char *call, const char *detail) {
    char text[MPI_MAX_ERROR_STRING + 1] = {0};
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error code %d", rc);
    return ds4_fail(err, DS4_ERR_COMM, "dist %s: %s failed: %s (%s)", op, call, text, detail);
}

#define MPI_TRY(op, call, detail, expr)                                                                             \
    do {                                                                                                            \
        int rc_ = (expr);                                                                                           \
        if (rc_ != MPI_SUCCESS) return mpi_fail(err, rc_, op, call, detail);                                        \
    } while (0)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Refuse a collective after one timed out: that one's request is still pending on world (MPI forbids freeing or
 * cancelling a non-blocking collective's request), so the ranks' collectives no longer match. */
static ds4_status mpi_usable(const dist_mpi *m, const char *op, ds4_error *err) {
    if (!m->failed) return DS4_OK;
    return ds4_fail(err, DS4_ERR_COMM,
                    "dist %s: refused: an earlier collective of this communicator did not complete within the timeout "
                    "(see its error); the ranks' collectives no longer match",
                    op);
}

/* Wait for the non-blocking collective *req until it completes, MPI reports an error, or the deadline passes. The first
 * millisecond is polled without pause (a collective among ready ranks completes in microseconds), then every 100 us,
 * so a rank waiting for a slow peer costs little CPU. At the deadline the communicator is marked failed and the error
 * says so, naming the operation; the buffers stay MPI's (the caller's process is expected to fail). */
static ds4_status mpi_wait(dist_mpi *m, MPI_Request *req, const char *op, const char *call, const char *detail,
                           ds4_error *err) {
    const double t0 = now_s();
    const struct timespec pause = {0, 100000};
    for (;;) {
        int done = 0;
        const int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(err, rc, op, call, detail);
        if (done) return DS4_OK;
        const double t = now_s() - t0;
        if (t > m->timeout_s) {
            m->failed = 1;
            return ds4_fail(err, DS4_ERR_COMM,
                            "dist %s (MPI): %s not complete after %.0f s (the timeout, DS4_DIST_TIMEOUT): a peer rank "
                            "died, hangs, or called another collective (%s; rank %d of %d); the communicator refuses "
                            "further collectives",
                            op, call, m->timeout_s, detail, m->rank, m->size);
        }
        if (t > 1e-3) nanosleep(&pause, NULL);
    }
}

/* Start a non-blocking collective (expr, which fills req) and wait for it (mpi_wait). */
#define MPI_COLL(op, call, detail, expr)                                                                            \
    do {                                                                                                            \
        MPI_Request req = MPI_REQUEST_NULL;                                                                         \
        int rc_ = (expr);                                                                                           \
        if (rc_ != MPI_SUCCESS) return mpi_fail(err, rc_, op, call, detail);                                        \
        ds4_status st_ = mpi_wait(m, &req, op, call, detail, err);                                                  \
        if (st_) return st_;                                                                                        \
    } while (0)

ds4_status dist_mpi_open(double timeout_s, dist_mpi **out, int32_t *rank, int32_t *size, int32_t *local_rank,
                         ds4_error *err) {
    *out = NULL;
    int inited = 0, finalized = 0, rc;
    /* These two may be called at any time, before MPI_Init too (when errors would still be fatal by default). */
    if ((rc = MPI_Finalized(&finalized)) != MPI_SUCCESS) return mpi_fail(err, rc, "init", "MPI_Finalized", "process");
    if ((rc = MPI_Initialized(&inited)) != MPI_SUCCESS) return mpi_fail(err, rc, "init", "MPI_Initialized", "process");
    if (finalized)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist init: MPI was already finalized in this process (MPI allows "
                                                  "one MPI_Init per process: init once, finalize at the end)");
    dist_mpi *m = calloc(1, sizeof *m);
    if (!m) return ds4_fail(err, DS4_ERR_OOM, "dist init: allocating the communicator (%zu bytes)", sizeof *m);
    m->world = MPI_COMM_NULL;
    m->timeout_s = timeout_s;
    int level = MPI_THREAD_SINGLE;
    if (!inited) {
        /* SERIALIZED: the bucketed gradient reduction calls MPI from its communication thread while the main thread
         * waits (dist/grad_buckets.c); never two calls at once */
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &level);
        if (rc != MPI_SUCCESS) {
            free(m);
            return mpi_fail(err, rc, "init", "MPI_Init_thread", "MPI_COMM_WORLD");
        }
        m->we_initialized = 1;
    } else if ((rc = MPI_Query_thread(&level)) != MPI_SUCCESS) {
        free(m);
        return mpi_fail(err, rc, "init", "MPI_Query_thread", "process");
    }
    m->serialized = level >= MPI_THREAD_SERIALIZED;
    ds4_status st = DS4_OK;
    int r = 0, n = 0, lr = 0;
    MPI_Comm node = MPI_COMM_NULL;
    /* MPI_COMM_WORLD still has MPI_ERRORS_ARE_FATAL here: set ours on it for the dup, which inherits it. */
    if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->world)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_dup", "MPI_COMM_WORLD");
    else if ((rc = MPI_Comm_set_errhandler(m->world, MPI_ERRORS_RETURN)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_set_errhandler", "MPI_ERRORS_RETURN");
    else if ((rc = MPI_Comm_rank(m->world, &r)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_rank", "world");
    else if ((rc = MPI_Comm_size(m->world, &n)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_size", "world");
    else if ((rc = MPI_Comm_split_type(m->world, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &node)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_split_type", "MPI_COMM_TYPE_SHARED");
    else if ((rc = MPI_Comm_rank(node, &lr)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "init", "MPI_Comm_rank", "node communicator");
    if (node != MPI_COMM_NULL && (rc = MPI_Comm_free(&node)) != MPI_SUCCESS && st == DS4_OK)
        st = mpi_fail(err, rc, "init", "MPI_Comm_free", "node communicator");
    if (st != DS4_OK) {
        dist_mpi_close(m, 0, NULL);
        return st;
    }
    *rank = r, *size = n, *local_rank = lr;
    m->rank = r, m->size = n;
    *out = m;
    return DS4_OK;
}

ds4_status dist_mpi_close(dist_mpi *m, int finalize, ds4_error *err) {
    if (!m) return DS4_OK;
    ds4_status st = DS4_OK;
    int rc;
    if (m->failed) { /* a collective's request is pending on world: neither freed nor finalized (MPI would wait) */
        free(m);
        return finalize ? ds4_fail(err, DS4_ERR_COMM, "dist finalize: not done: a collective did not complete within "
                                                      "the timeout (see its error)")
                        : DS4_OK;
    }
    if (m->world != MPI_COMM_NULL && (rc = MPI_Comm_free(&m->world)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "finalize", "MPI_Comm_free", "world duplicate");
    if (finalize && m->we_initialized && (rc = MPI_Finalize()) != MPI_SUCCESS && st == DS4_OK)
        st = mpi_fail(err, rc, "finalize", "MPI_Finalize", "MPI_COMM_WORLD");
    free(m);
    return st;
}

ds4_status dist_mpi_barrier(dist_mpi *m, ds4_error *err) {
    ds4_status st = mpi_usable(m, "barrier", err);
    if (st) return st;
    MPI_COLL("barrier", "MPI_Ibarrier", "world", MPI_Ibarrier(m->world, &req));
    return DS4_OK;
}

/* MPI counts are int: large buffers go in chunks of at most INT_MAX / 2 elements (every element's sum is formed
 * whole inside one chunk, so chunking does not change it). */
#define CHUNK ((int64_t)(INT_MAX / 2))

/* The chunk's shard s (of n elements over `size` ranks) sums into buf + displs[s] on rank s: acc = rank 0's value,
 * then + rank 1's, + rank 2's, ... in fp32 (or fp64), the TCP star's order. */
static void sum_in_rank_order(ds4_dtype dtype, void *dst, const void *recv, int64_t len, int size) {
    if (dtype == DS4_F64) {
        double *d = dst;
        const double *r = recv;
        for (int64_t i = 0; i < len; i++) {
            double a = r[i];
            for (int k = 1; k < size; k++) a += r[k * len + i];
            d[i] = a;
        }
    } else {
        float *d = dst;
        const float *r = recv;
        for (int64_t i = 0; i < len; i++) {
            float a = r[i];
            for (int k = 1; k < size; k++) a += r[k * len + i];
            d[i] = a;
        }
    }
}

/* Each rank receives every rank's copy of its region of the chunk (MPI_Alltoallv) and adds them in rank order;
 * cnt / displs: the regions, in elements from b. recv holds the world's copies of the largest region. */
static ds4_status scatter_sum(dist_mpi *m, ds4_dtype dtype, char *b, const int *cnt, const int *displs, void *recv,
                              int *rcnt, int *rdispls, const char *op, const char *detail, ds4_error *err) {
    MPI_Datatype t = dtype == DS4_F64 ? MPI_DOUBLE : MPI_FLOAT;
    const size_t esz = dtype == DS4_F64 ? 8 : 4;
    const int W = m->size, mine = cnt[m->rank];
    for (int r = 0; r < W; r++) rcnt[r] = mine, rdispls[r] = r * mine;
    MPI_COLL(op, "MPI_Ialltoallv", detail, MPI_Ialltoallv(b, cnt, displs, t, recv, rcnt, rdispls, t, m->world, &req));
    sum_in_rank_order(dtype, b + (size_t)displs[m->rank] * esz, recv, mine, W);
    return DS4_OK;
}

/* The sum in rank order of every element (rank 0's value + rank 1's + ...) over the chunks of CHUNK elements of
 * buf [count]; with regions (off, len: every rank's, in elements), each rank gets its region's sums only (a
 * reduce-scatter); without, every rank gets all of them (the reduce-scatter over ds4_shard_range's shards, then
 * MPI_Allgatherv). MPI_Allreduce's order depends on the implementation's algorithm (recursive doubling, rings:
 * (a + b) + (c + d) for 4 ranks), and data parallelism wants the sum that one process accumulating the ranks'
 * micro-batches forms: ((a + b) + c) + d (docs/distributed.md, "Bitwise data parallelism"). The all-reduce moves
 * as many bytes as a ring. */
static ds4_status sum_regions(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                              const int64_t *len, const char *op, ds4_error *err) {
    MPI_Datatype t = dtype == DS4_F64 ? MPI_DOUBLE : MPI_FLOAT;
    const size_t esz = dtype == DS4_F64 ? 8 : 4;
    const int W = m->size;
    const int64_t most = count < CHUNK ? count : CHUNK;
    ds4_status st = mpi_usable(m, op, err);
    if (st) return st;
    int *cnt = malloc((size_t)W * 4 * sizeof(int));
    void *recv = malloc((size_t)(off ? most : (most + W - 1) / W) * (size_t)W * esz + esz);
    if (!cnt || !recv) {
        free(cnt);
        free(recv);
        return ds4_fail(err, DS4_ERR_OOM, "dist %s: scratch for %lld elements over %d ranks", op, (long long)most, W);
    }
    int *displs = cnt + W, *rcnt = cnt + 2 * W, *rdispls = cnt + 3 * W;
    char detail[96];
    snprintf(detail, sizeof detail, "%s, %lld elements", ds4_dtype_name(dtype), (long long)count);
    for (int64_t co = 0; co < count && !st; co += CHUNK) {
        const int64_t n = count - co < CHUNK ? count - co : CHUNK;
        for (int r = 0; r < W; r++) {
            int64_t o = 0, l = 0;
            if (off) { /* the region's part inside this chunk */
                const int64_t lo = off[r] > co ? off[r] : co, hi = off[r] + len[r] < co + n ? off[r] + len[r] : co + n;
                o = lo - co, l = hi > lo ? hi - lo : 0;
                if (l == 0) o = 0;
            } else {
                ds4_shard_range(n, W, r, &o, &l);
            }
            cnt[r] = (int)l, displs[r] = (int)o;
        }
        char *b = (char *)buf + (size_t)co * esz;
        st = scatter_sum(m, dtype, b, cnt, displs, recv, rcnt, rdispls, op, detail, err);
        if (st || off) continue;
        MPI_Request req = MPI_REQUEST_NULL;
        int rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, b, cnt, displs, t, m->world, &req);
        st = rc != MPI_SUCCESS ? mpi_fail(err, rc, op, "MPI_Iallgatherv", detail)
                               : mpi_wait(m, &req, op, "MPI_Iallgatherv", detail, err);
    }
    if (!m->failed) { /* else a timed-out request may still read them: left to MPI (the process is failing) */
        free(cnt);
        free(recv);
    }
    return st;
}

ds4_status dist_mpi_all_reduce_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err) {
    return sum_regions(m, dtype, buf, count, NULL, NULL, "all_reduce", err);
}

ds4_status dist_mpi_reduce_scatter_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                                       const int64_t *len, ds4_error *err) {
    return sum_regions(m, dtype, buf, count, off, len, "reduce_scatter", err);
}

ds4_status dist_mpi_all_gather(dist_mpi *m, const void *send, void *recv, size_t nbytes, ds4_error *err) {
    ds4_status st = mpi_usable(m, "all_gather", err);
    if (st) return st;
    if (nbytes > (size_t)INT_MAX)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist all_gather: %zu bytes per rank (MPI counts stop at %d)",
                        nbytes, INT_MAX);
    char detail[64];
    snprintf(detail, sizeof detail, "%zu bytes per rank", nbytes);
    MPI_COLL("all_gather", "MPI_Iallgather", detail,
             MPI_Iallgather(send, (int)nbytes, MPI_BYTE, recv, (int)nbytes, MPI_BYTE, m->world, &req));
    return DS4_OK;
}

ds4_status dist_mpi_broadcast(dist_mpi *m, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    ds4_status st = mpi_usable(m, "broadcast", err);
    if (st) return st;
    char detail[64];
    for (size_t off = 0; off < nbytes; off += (size_t)CHUNK) {
        int n = (int)(nbytes - off < (size_t)CHUNK ? nbytes - off : (size_t)CHUNK);
        snprintf(detail, sizeof detail, "%zu bytes from rank %d", nbytes, root);
        MPI_COLL("broadcast", "MPI_Ibcast", detail, MPI_Ibcast((char *)buf + off, n, MPI_BYTE, root, m->world, &req));
    }
    return DS4_OK;
}

/* MPI's counts and displacements are int: they count rows of a contiguous row datatype (so a row of any size is one
 * unit), and a job whose rows per rank or total rows pass INT_MAX is refused rather than chunked (an exchange of
 * 2^31 rows is far beyond what a layer's experts receive). Pure data movement: the bytes arrive unchanged. */
ds4_status dist_mpi_all_to_all_v(dist_mpi *m, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    int P = 0, rc;
    ds4_status st = mpi_usable(m, "all_to_all_v", err);
    if (st) return st;
    MPI_TRY("all_to_all_v", "MPI_Comm_size", "world", MPI_Comm_size(m->world, &P));
    if (row_bytes == 0 || row_bytes > (size_t)INT_MAX)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist all_to_all_v: rows of %zu bytes (1 .. %d)", row_bytes, INT_MAX);
    int *v = malloc((size_t)P * 4 * sizeof(int));
    if (!v) return ds4_fail(err, DS4_ERR_OOM, "dist all_to_all_v: counts of %d ranks", P);
    int *sc = v, *sd = v + P, *rcn = v + 2 * P, *rd = v + 3 * P;
    int64_t so = 0, ro = 0;
    for (int q = 0; q < P; q++) {
        if (send_rows[q] < 0 || recv_rows[q] < 0 || send_rows[q] > INT_MAX - so || recv_rows[q] > INT_MAX - ro) {
            free(v);
            return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist all_to_all_v: %lld rows to / %lld from rank %d after %lld / "
                                                      "%lld (MPI counts stop at %d rows)", (long long)send_rows[q],
                            (long long)recv_rows[q], q, (long long)so, (long long)ro, INT_MAX);
        }
        sc[q] = (int)send_rows[q], sd[q] = (int)so, rcn[q] = (int)recv_rows[q], rd[q] = (int)ro;
        so += send_rows[q], ro += recv_rows[q];
    }
    char detail[96];
    snprintf(detail, sizeof detail, "%lld rows out, %lld in, %zu bytes each", (long long)so, (long long)ro, row_bytes);
    MPI_Datatype row = MPI_DATATYPE_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    if ((rc = MPI_Type_contiguous((int)row_bytes, MPI_BYTE, &row)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "all_to_all_v", "MPI_Type_contiguous", detail);
    else if ((rc = MPI_Type_commit(&row)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "all_to_all_v", "MPI_Type_commit", detail);
    else if ((rc = MPI_Ialltoallv(send, sc, sd, row, recv, rcn, rd, row, m->world, &req)) != MPI_SUCCESS)
        st = mpi_fail(err, rc, "all_to_all_v", "MPI_Ialltoallv", detail);
    else
        st = mpi_wait(m, &req, "all_to_all_v", "MPI_Ialltoallv", detail, err);
    if (row != MPI_DATATYPE_NULL && !m->failed && (rc = MPI_Type_free(&row)) != MPI_SUCCESS && !st)
        st = mpi_fail(err, rc, "all_to_all_v", "MPI_Type_free", detail);
    if (!m->failed) free(v); /* else the timed-out request may still read the counts (as in sum_regions) */
    return st;
}
