/* comm.c — the communicator value: launch detection, argument checks, the choice of the host backend (a world of
 * one, which needs nothing; MPI under mpirun / srun; the TCP star under torchrun-style variables) and, when asked
 * for, the NCCL communicator for device buffers. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"
#include "ds4_train.h"
#include "internal.h"

enum { DEFAULT_TIMEOUT_S = 300 };

int ds4_dist_have_mpi(void) { return dist_mpi_built(); }
int ds4_dist_have_nccl(void) { return dist_nccl_built(); }

void ds4_comm_options_default(ds4_comm_options *o) {
    memset(o, 0, sizeof *o);
    o->device = -1;
    o->bucket_mb = DS4_DEFAULT_BUCKET_MB;
}

ds4_status ds4_comm_set_bucket_mb(ds4_comm *c, double mb, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist bucket_mb: communicator is NULL");
    if (!(mb >= 0) || mb > 1e6)
        return ds4_fail(err, DS4_ERR_ARG, "dist bucket_mb: %g MiB (0: one reduction after the backward, up to 1e6)", mb);
    const int64_t elems = (int64_t)(mb * 1048576.0 / sizeof(float));
    c->bucket = mb > 0 && elems < 1 ? 1 : elems;
    return DS4_OK;
}

double ds4_comm_bucket_mb(const ds4_comm *c) { return c ? (double)c->bucket * sizeof(float) / 1048576.0 : 0; }

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

static ds4_status timeout_from(const ds4_comm_options *o, double *out, ds4_error *err) {
    *out = DEFAULT_TIMEOUT_S;
    if (o->timeout_s > 0) {
        *out = o->timeout_s;
        return DS4_OK;
    }
    const char *s = getenv("DS4_DIST_TIMEOUT");
    if (!s || !*s) return DS4_OK;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v > 0) || v > 1e7)
        return ds4_fail(err, DS4_ERR_ARG, "dist init: DS4_DIST_TIMEOUT=\"%s\" is not a number of seconds in (0, 1e7]",
                        s);
    *out = v;
    return DS4_OK;
}

/* The host broadcast as the NCCL backend wants it (the unique id). */
static ds4_status bcast_for_nccl(void *ctx, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    return ds4_comm_broadcast(ctx, buf, nbytes, root, err);
}

/* The CUDA device of this rank's NCCL communicator. */
static ds4_status pick_device(const ds4_comm *c, const ds4_comm_options *o, int32_t *out, ds4_error *err) {
    int32_t n = 0;
    ds4_status st = ds4_cuda_devices(&n, err);
    if (st) return st;
    if (n <= 0)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist init: NCCL was asked for on rank %d, but this process sees no "
                                                  "CUDA device", c->rank);
    if (o->device >= n)
        return ds4_fail(err, DS4_ERR_ARG, "dist init: device cuda:%d asked for, this process sees %d", o->device, n);
    /* CUDA_VISIBLE_DEVICES may leave one device per process: then the local rank's device is that one */
    *out = o->device >= 0 ? o->device : c->local_rank % n;
    return DS4_OK;
}

void ds4_shard_range(int64_t count, int32_t world, int32_t rank, int64_t *off, int64_t *len) {
    const int64_t q = count / world, r = count % world;
    *len = q + (rank < r);
    *off = rank * q + (rank < r ? rank : r);
}

ds4_status ds4_comm_init(ds4_comm **out, ds4_error *err) { return ds4_comm_init_with(NULL, out, err); }

ds4_status ds4_comm_init_with(const ds4_comm_options *opts, ds4_comm **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "dist init: out is NULL");
    *out = NULL;
    ds4_comm_options o;
    ds4_comm_options_default(&o);
    if (opts) o = *opts;
    if (o.nccl && !dist_nccl_built()) {
        dist_nccl *none = NULL;
        return dist_nccl_open(0, 1, 0, 0, NULL, NULL, &none, err); /* the refusal, naming the reason */
    }
    ds4_launch l;
    ds4_status st = ds4_launch_detect(NULL, NULL, &l, err);
    double timeout = 0;
    if (!st) st = timeout_from(&o, &timeout, err);
    if (st) return st;
    ds4_comm *c = calloc(1, sizeof *c);
    if (!c) return ds4_fail(err, DS4_ERR_OOM, "dist init: allocating the communicator (%zu bytes)", sizeof *c);
    c->launch = l;
    c->rank = 0, c->world_size = 1, c->local_rank = 0;
    c->timeout_s = timeout;
    if (!st) st = ds4_comm_set_bucket_mb(c, o.bucket_mb, err);
    if (st) {
        free(c);
        return st;
    }
    if (l.launcher == DS4_LAUNCH_MPI || l.launcher == DS4_LAUNCH_SLURM) {
        st = dist_mpi_open(timeout, &c->mpi, &c->rank, &c->world_size, &c->local_rank, err);
        if (st == DS4_OK && (st = check_agrees("RANK", c->rank, err)) == DS4_OK)
            st = check_agrees("WORLD_SIZE", c->world_size, err);
    } else if (l.launcher == DS4_LAUNCH_TORCHRUN) {
        c->rank = l.rank, c->world_size = l.world_size;
        st = dist_tcp_open(&l, timeout, &c->tcp, &c->local_rank, err);
    }
    int32_t device = -1;
    if (!st && o.nccl) st = pick_device(c, &o, &device, err);
    if (!st && o.nccl) st = dist_nccl_open(c->rank, c->world_size, device, timeout, bcast_for_nccl, c, &c->nccl, err);
    if (st) {
        ds4_comm_abandon(c);
        return st;
    }
    *out = c;
    return DS4_OK;
}

static void free_comm(ds4_comm *c) { free(c); }

ds4_status ds4_comm_finalize(ds4_comm *c, ds4_error *err) {
    if (!c) return DS4_OK;
    dist_buckets_drain(c);
    dist_buckets_close(c);
    ds4_status st = dist_nccl_close(c->nccl, 1, err);
    dist_tcp_close(c->tcp);
    ds4_status s2 = dist_mpi_close(c->mpi, 1, st ? NULL : err);
    free_comm(c);
    return st ? st : s2;
}

void ds4_comm_abandon(ds4_comm *c) {
    if (!c) return;
    if (dist_buckets_busy(c)) { /* the communication thread is in a collective whose peers may never come */
        if (!c->tcp) return; /* MPI: left as it is, unfreed (this process is failing; the launcher ends the job) */
        dist_tcp_shutdown(c->tcp); /* its waits fail at once */
    }
    dist_buckets_close(c);
    dist_nccl_close(c->nccl, 0, NULL); /* aborted: the peers' watchdogs see it */
    dist_tcp_close(c->tcp);
    dist_mpi_close(c->mpi, 0, NULL); /* the duplicate is freed; MPI itself is left for the launcher to end */
    free_comm(c);
}

int32_t ds4_comm_rank(const ds4_comm *c) { return c->rank; }
int32_t ds4_comm_world_size(const ds4_comm *c) { return c->world_size; }
int32_t ds4_comm_local_rank(const ds4_comm *c) { return c->local_rank; }
const char *ds4_comm_backend(const ds4_comm *c) { return c->mpi ? "mpi" : c->tcp ? "tcp" : "single"; }
ds4_launcher ds4_comm_launcher(const ds4_comm *c) { return c->launch.launcher; }
int32_t ds4_comm_device(const ds4_comm *c) { return c->nccl ? dist_nccl_device(c->nccl) : -1; }
double ds4_comm_timeout(const ds4_comm *c) { return c->timeout_s; }

ds4_status ds4_comm_barrier(ds4_comm *c, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist barrier: communicator is NULL");
    dist_buckets_drain(c);
    if (c->mpi) return dist_mpi_barrier(c->mpi, err);
    if (c->tcp) return dist_tcp_barrier(c->tcp, err);
    return DS4_OK;
}

static ds4_status check_sum(const char *op, ds4_dtype dtype, const void *buf, int64_t count, ds4_error *err) {
    if (dtype != DS4_F32 && dtype != DS4_F64)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist %s: sum of %s (F32 and F64 only)", op,
                        ds4_dtype_name(dtype) ? ds4_dtype_name(dtype) : "an invalid dtype");
    if (count < 0 || (count > 0 && !buf))
        return ds4_fail(err, DS4_ERR_ARG, "dist %s: %lld elements at %p", op, (long long)count, buf);
    return DS4_OK;
}

ds4_status ds4_comm_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce: communicator is NULL");
    ds4_status st = check_sum("all_reduce", dtype, buf, count, err);
    if (st || count == 0) return st;
    dist_buckets_drain(c);
    if (c->mpi) return dist_mpi_all_reduce_sum(c->mpi, dtype, buf, count, err);
    if (c->tcp) return dist_tcp_all_reduce_sum(c->tcp, dtype, buf, count, err);
    return DS4_OK;
}

ds4_status ds4_comm_all_gather(ds4_comm *c, const void *send, void *recv, size_t nbytes, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist all_gather: communicator is NULL");
    if (nbytes > 0 && (!send || !recv))
        return ds4_fail(err, DS4_ERR_ARG, "dist all_gather: %zu bytes per rank, send %p, recv %p", nbytes, send, recv);
    if (nbytes == 0) return DS4_OK;
    dist_buckets_drain(c);
    if (c->mpi) return dist_mpi_all_gather(c->mpi, send, recv, nbytes, err);
    if (c->tcp) return dist_tcp_all_gather(c->tcp, send, recv, nbytes, err);
    memmove(recv, send, nbytes);
    return DS4_OK;
}

ds4_status ds4_comm_broadcast(ds4_comm *c, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: communicator is NULL");
    if (root < 0 || root >= c->world_size)
        return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: root %d outside ranks [0, %d)", root, c->world_size);
    if (nbytes > 0 && !buf) return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: %zu bytes at NULL", nbytes);
    if (nbytes == 0) return DS4_OK;
    dist_buckets_drain(c);
    if (c->mpi) return dist_mpi_broadcast(c->mpi, buf, nbytes, root, err);
    if (c->tcp) return dist_tcp_broadcast(c->tcp, buf, nbytes, root, err);
    return DS4_OK;
}

/* Argument checks of an all_to_all_v (every count >= 0, buffers present where rows are) */
static ds4_status check_a2a(const ds4_comm *c, const char *op, const void *send, const int64_t *send_rows,
                            const void *recv, const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist %s: communicator is NULL", op);
    if (!send_rows || !recv_rows || row_bytes == 0)
        return ds4_fail(err, DS4_ERR_ARG, "dist %s: row counts %p / %p, rows of %zu bytes", op, (const void *)send_rows,
                        (const void *)recv_rows, row_bytes);
    int64_t so = 0, ro = 0;
    for (int32_t q = 0; q < c->world_size; q++) {
        if (send_rows[q] < 0 || recv_rows[q] < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist %s: %lld rows to / %lld rows from rank %d", op,
                            (long long)send_rows[q], (long long)recv_rows[q], q);
        so += send_rows[q], ro += recv_rows[q];
    }
    if ((so && !send) || (ro && !recv))
        return ds4_fail(err, DS4_ERR_ARG, "dist %s: %lld rows out of %p, %lld into %p", op, (long long)so, send,
                        (long long)ro, recv);
    return DS4_OK;
}

ds4_status ds4_comm_all_to_all_v(ds4_comm *c, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    ds4_status st = check_a2a(c, "all_to_all_v", send, send_rows, recv, recv_rows, row_bytes, err);
    if (st) return st;
    dist_buckets_drain(c);
    if (c->mpi) return dist_mpi_all_to_all_v(c->mpi, send, send_rows, recv, recv_rows, row_bytes, err);
    if (c->tcp) return dist_tcp_all_to_all_v(c->tcp, send, send_rows, recv, recv_rows, row_bytes, err);
    if (send_rows[0] != recv_rows[0])
        return ds4_fail(err, DS4_ERR_ARG, "dist all_to_all_v: a world of one sends %lld rows to itself and receives "
                                          "%lld", (long long)send_rows[0], (long long)recv_rows[0]);
    if (send_rows[0]) memmove(recv, send, (size_t)send_rows[0] * row_bytes);
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ device buffers */

static ds4_status need_nccl(const ds4_comm *c, const char *op, ds4_error *err) {
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "dist %s: communicator is NULL", op);
    if (!c->nccl)
        return ds4_fail(err, DS4_ERR_ARG, "dist %s: device buffers need the NCCL communicator (ds4_comm_options.nccl; "
                                          "Lua: ds4.dist.init{device = \"cuda\"})", op);
    return DS4_OK;
}

ds4_status ds4_comm_device_all_reduce_sum(ds4_comm *c, ds4_dtype dtype, void *dev_buf, int64_t count, ds4_error *err) {
    ds4_status st = need_nccl(c, "all_reduce", err);
    if (!st) st = check_sum("all_reduce", dtype, dev_buf, count, err);
    if (st || count == 0) return st;
    return dist_nccl_all_reduce_sum(c->nccl, dtype, dev_buf, count, err);
}

ds4_status ds4_comm_device_all_gather(ds4_comm *c, const void *dev_send, void *dev_recv, size_t nbytes,
                                      ds4_error *err) {
    ds4_status st = need_nccl(c, "all_gather", err);
    if (st) return st;
    if (nbytes > 0 && (!dev_send || !dev_recv))
        return ds4_fail(err, DS4_ERR_ARG, "dist all_gather: %zu bytes per rank, send %p, recv %p", nbytes, dev_send,
                        dev_recv);
    return nbytes ? dist_nccl_all_gather(c->nccl, dev_send, dev_recv, nbytes, err) : DS4_OK;
}

ds4_status ds4_comm_device_broadcast(ds4_comm *c, void *dev_buf, size_t nbytes, int32_t root, ds4_error *err) {
    ds4_status st = need_nccl(c, "broadcast", err);
    if (st) return st;
    if (root < 0 || root >= c->world_size)
        return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: root %d outside ranks [0, %d)", root, c->world_size);
    if (nbytes > 0 && !dev_buf) return ds4_fail(err, DS4_ERR_ARG, "dist broadcast: %zu bytes at NULL", nbytes);
    return nbytes ? dist_nccl_broadcast(c->nccl, dev_buf, nbytes, root, err) : DS4_OK;
}

ds4_status ds4_comm_device_all_to_all_v(ds4_comm *c, const void *dev_send, const int64_t *send_rows, void *dev_recv,
                                        const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    ds4_status st = need_nccl(c, "all_to_all_v", err);
    if (!st) st = check_a2a(c, "all_to_all_v", dev_send, send_rows, dev_recv, recv_rows, row_bytes, err);
    return st ? st : dist_nccl_all_to_all_v(c->nccl, dev_send, send_rows, dev_recv, recv_rows, row_bytes, err);
}

/* ------------------------------------------------------------------------------------------------ gradients */

static ds4_status sum_loads(void *ctx, double *buf, int64_t n, ds4_error *err) {
    return ds4_comm_all_reduce_sum((ds4_comm *)ctx, DS4_F64, buf, n, err);
}

ds4_status dist_host_sum(ds4_comm *c, float *buf, int64_t count, const int64_t *off, const int64_t *len,
                         ds4_error *err) {
    if (count == 0) return DS4_OK;
    if (c->mpi)
        return off ? dist_mpi_reduce_scatter_sum(c->mpi, DS4_F32, buf, count, off, len, err)
                   : dist_mpi_all_reduce_sum(c->mpi, DS4_F32, buf, count, err);
    if (c->tcp)
        return off ? dist_tcp_reduce_scatter_sum(c->tcp, DS4_F32, buf, count, off, len, err)
                   : dist_tcp_all_reduce_sum(c->tcp, DS4_F32, buf, count, err);
    return DS4_OK;
}

ds4_status ds4_comm_overlap_backward(ds4_comm *c, ds4_model *m, ds4_error *err) {
    if (!c || !m) return ds4_fail(err, DS4_ERR_ARG, "dist overlap_backward: communicator or model is NULL");
    const ds4_device_options dev = ds4_model_device(m);
    if (dev.type == DS4_DEVICE_CUDA && c->nccl && ds4_comm_device(c) != dev.index)
        return ds4_fail(err, DS4_ERR_ARG, "dist overlap_backward: the model is on %s, the communicator's NCCL on "
                                          "cuda:%d (move the model to ds4.dist.device())", ds4_model_device_name(m),
                        ds4_comm_device(c));
    int armed = 0;
    return dist_buckets_arm(c, m, &armed, err);
}

/* The gradient runs every rank holds alike (ds4_model_replicated_runs), each summed over the ranks in place: the same
 * rank-order sum per element as the whole buffer's (on the host; through NCCL, on a device buffer, NCCL's sum: the
 * same bits as the whole buffer's for 2 ranks, one addition per element). On a device the runs are enqueued one after
 * another on NCCL's stream (the backend has finished the gradients: ds4_model_grad_buffer synchronised it) and waited
 * for once. */
static ds4_status all_reduce_runs(ds4_comm *c, const ds4_model *m, float *g, size_t runs, int device, ds4_error *err) {
    int64_t *off = malloc(2 * runs * sizeof *off), *len = off ? off + runs : NULL;
    if (!off) return ds4_fail(err, DS4_ERR_OOM, "dist all_reduce_grads: %zu runs", runs);
    ds4_model_replicated_runs(m, off, len, runs);
    ds4_status st = DS4_OK;
    for (size_t k = 0; k < runs && !st; k++)
        st = device ? dist_nccl_enqueue_sum(c->nccl, g + off[k], len[k], NULL, NULL, NULL, err)
                    : ds4_comm_all_reduce_sum(c, DS4_F32, g + off[k], len[k], err);
    if (!st && device) st = dist_nccl_wait(c->nccl, "all_reduce", err);
    free(off);
    return st;
}

ds4_status ds4_comm_all_reduce_grads(ds4_comm *c, ds4_model *m, double scale, ds4_error *err) {
    if (!c || !m) return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: communicator or model is NULL");
    const ds4_device_options dev = ds4_model_device(m);
    if (dev.type == DS4_DEVICE_CUDA && (c->nccl || c->world_size > 1) && ds4_comm_device(c) != dev.index) {
        if (!c->nccl)
            return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: the model is on %s and there are %d ranks: a "
                                              "device model needs the NCCL communicator (Lua: ds4.dist.init{device = "
                                              "\"cuda\"})", ds4_model_device_name(m), c->world_size);
        return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: the model is on %s, the communicator's NCCL on "
                                          "cuda:%d (move the model to ds4.dist.device())", ds4_model_device_name(m),
                        ds4_comm_device(c));
    }
    if (ds4_model_expert_parallel(m) && scale != 1.0)
        return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: scale %g with expert parallelism on: each expert's "
                                          "gradient already holds every rank's rows, each scaled by its own "
                                          "backward, so the global normalisation must be the backward's (backward "
                                          "with 1 / the global token count on every rank) and the scale here 1 "
                                          "(docs/distributed.md)", scale);
    if (ds4_model_context_parallel(m) && scale != 1.0)
        return ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: scale %g with context parallelism on: the forward "
                                          "returns the whole sequence's token counts, so the backward already carries "
                                          "the global normalisation (model:backward() or backward(1 / count)) and the "
                                          "scale here must be 1 (docs/distributed.md)", scale);
    ds4_status st = DS4_OK;
    if (dist_buckets_finish(c, m, &st, err)) { /* the step's last backward reduced them already */
        if (!st && scale != 1.0)
            st = ds4_fail(err, DS4_ERR_ARG, "dist all_reduce_grads: scale %g after overlap_backward: the gradients "
                                            "were summed while the backward ran, so the normalisation must be the "
                                            "backward's (backward with 1 / the global count) and the scale here 1",
                          scale);
        if (dev.type == DS4_DEVICE_CUDA) ds4_model_grads_changed(m);
        if (st) ds4_error_prefix(err, "dist all_reduce_grads: ");
        return st ? st : ds4_model_sum_router_loads(m, sum_loads, c, err);
    }
    st = scale != 1.0 ? ds4_model_scale_grads(m, scale, err) : DS4_OK;
    if (!st && dev.type == DS4_DEVICE_CUDA && !c->nccl) return DS4_OK; /* a world of one (checked above) */
    float *g = NULL;
    int64_t n = 0;
    if (!st) st = ds4_model_grad_buffer(m, &g, &n, err);
    if (st) {
        ds4_error_prefix(err, "dist all_reduce_grads: ");
        return st;
    }
    /* ZeRO-1 with the reduce-scatter: each rank's region of the sums only (its optimizer reads no other). Sharded
     * experts (never with ZeRO-1 or the overlapped sum): each rank's experts are its own, the rest summed */
    const size_t runs = ds4_model_replicated_runs(m, NULL, NULL, 0);
    const int64_t *off = NULL, *len = NULL;
    const int rs = runs ? 0 : dist_grad_regions(c, m, n, &off, &len);
    if (runs) {
        const int device = dev.type == DS4_DEVICE_CUDA && c->nccl;
        st = all_reduce_runs(c, m, g, runs, device, err);
        if (device) ds4_model_grads_changed(m);
    } else if (dev.type == DS4_DEVICE_CUDA && c->nccl && rs) {
        st = dist_nccl_enqueue_sum(c->nccl, g, n, off, len, NULL, err);
        if (!st) st = dist_nccl_wait(c->nccl, "reduce_scatter", err);
        ds4_model_grads_changed(m);
    } else if (dev.type == DS4_DEVICE_CUDA && c->nccl) {
        st = ds4_comm_device_all_reduce_sum(c, DS4_F32, g, n, err);
        ds4_model_grads_changed(m);
    } else if (rs) {
        dist_buckets_drain(c);
        st = dist_host_sum(c, g, n, off, len, err);
    } else {
        st = ds4_comm_all_reduce_sum(c, DS4_F32, g, n, err);
    }
    /* the router-bias update after the step must count the global batch's tokens, as one process would */
    return st ? st : ds4_model_sum_router_loads(m, sum_loads, c, err);
}

/* ------------------------------------------------------------------------------------------------ ZeRO-1 */

/* Through the byte all-gather (rank order) of buffers padded to the largest region: one code path for MPI and TCP. */
ds4_status ds4_comm_all_gather_regions(ds4_comm *c, void *buf, size_t esz, const int64_t *off, const int64_t *len,
                                       ds4_error *err) {
    if (!c || !buf || !off || !len || esz == 0)
        return ds4_fail(err, DS4_ERR_ARG, "dist all_gather_regions: communicator, buffer or regions missing");
    const int32_t W = c->world_size;
    int64_t most = 0;
    for (int32_t r = 0; r < W; r++) {
        if (off[r] < 0 || len[r] < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist all_gather_regions: rank %d's region [%lld, +%lld)", r,
                            (long long)off[r], (long long)len[r]);
        most = len[r] > most ? len[r] : most;
    }
    if (W == 1 || most == 0) return DS4_OK;
    const size_t slot = (size_t)most * esz;
    char *send = malloc(slot), *recv = malloc(slot * (size_t)W);
    if (!send || !recv) {
        free(send);
        free(recv);
        return ds4_fail(err, DS4_ERR_OOM, "dist all_gather_regions: %d x %zu bytes", W, slot);
    }
    char *b = buf;
    memcpy(send, b + (size_t)off[c->rank] * esz, (size_t)len[c->rank] * esz);
    ds4_status st = ds4_comm_all_gather(c, send, recv, slot, err);
    for (int32_t r = 0; r < W && !st; r++)
        if (r != c->rank) memcpy(b + (size_t)off[r] * esz, recv + (size_t)r * slot, (size_t)len[r] * esz);
    free(send);
    free(recv);
    return st;
}

/* One in-place broadcast per rank, rooted at it (the NCCL path ds4_comm_device_broadcast already takes), each
 * complete before the next: the regions are unequal, and a few broadcasts per optimizer step cost little. */
ds4_status ds4_comm_device_all_gather_regions(ds4_comm *c, void *dev_buf, size_t esz, const int64_t *off,
                                              const int64_t *len, ds4_error *err) {
    ds4_status st = need_nccl(c, "all_gather_regions", err);
    if (st) return st;
    if (!dev_buf || !off || !len || esz == 0)
        return ds4_fail(err, DS4_ERR_ARG, "dist all_gather_regions (device): buffer or regions missing");
    for (int32_t r = 0; r < c->world_size; r++)
        if (off[r] < 0 || len[r] < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist all_gather_regions (device): rank %d's region [%lld, +%lld)", r,
                            (long long)off[r], (long long)len[r]);
    if (c->world_size == 1) return DS4_OK; /* its own region is all there is */
    for (int32_t r = 0; r < c->world_size && !st; r++)
        st = ds4_comm_device_broadcast(c, (char *)dev_buf + (size_t)off[r] * esz, (size_t)len[r] * esz, r, err);
    return st;
}

static ds4_status zero_sum(void *ctx, double *buf, int64_t n, ds4_error *err) {
    return ds4_comm_all_reduce_sum(ctx, DS4_F64, buf, n, err);
}

static ds4_status zero_gather(void *ctx, float *buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    return ds4_comm_all_gather_regions(ctx, buf, sizeof *buf, off, len, err);
}

static ds4_status zero_gather_dev(void *ctx, float *dev_buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    return ds4_comm_device_all_gather_regions(ctx, dev_buf, sizeof *dev_buf, off, len, err);
}

ds4_status ds4_comm_shard_optimizer(ds4_comm *c, ds4_adamw *a, ds4_error *err) {
    if (!c || !a) return ds4_fail(err, DS4_ERR_ARG, "dist shard_optimizer: communicator or optimizer is NULL");
    /* a device model's master weights are gathered through NCCL, when the communicator has it */
    const ds4_adamw_shard sh = {.rank = c->rank, .world = c->world_size, .ctx = c, .sum_f64 = zero_sum,
                                .gather_f32 = zero_gather, .gather_dev_f32 = c->nccl ? zero_gather_dev : NULL};
    ds4_status st = ds4_adamw_set_shard(a, &sh, err);
    if (st) ds4_error_prefix(err, "dist shard_optimizer: ");
    return st;
}

ds4_status ds4_comm_reduce_scatter_grads(ds4_comm *c, ds4_adamw *a, int on, ds4_error *err) {
    if (!c || !a) return ds4_fail(err, DS4_ERR_ARG, "dist reduce_scatter_grads: communicator or optimizer is NULL");
    ds4_model *m = ds4_adamw_model(a);
    const int64_t *off = NULL, *len = NULL;
    if (on && ds4_adamw_shard_regions(a, &off, &len) != c->world_size)
        return ds4_fail(err, DS4_ERR_ARG, "dist reduce_scatter_grads: the optimizer is not sharded over this "
                                          "communicator's %d ranks (ds4_comm_shard_optimizer first)", c->world_size);
    dist_buckets_drain(c); /* the communication thread may read the regions */
    ds4_status st = ds4_model_set_grad_regions(m, on ? c->world_size : 0, off, len, err);
    if (st) ds4_error_prefix(err, "dist reduce_scatter_grads: ");
    return st;
}

int dist_grad_regions(const ds4_comm *c, const ds4_model *m, int64_t n, const int64_t **off, const int64_t **len) {
    const int32_t W = ds4_model_grad_regions(m, off, len);
    return W == c->world_size && W > 1 && (*off)[W - 1] + (*len)[W - 1] <= n;
}
