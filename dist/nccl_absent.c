/* nccl_absent.c — the NCCL backend of a build without NCCL (no CUDA toolkit, or no libnccl next to it): host
 * collectives (MPI, TCP) still work; asking for device collectives is refused with the reason. */
#include <stdio.h>

#include "internal.h"
#include "nccl_backend.h"

#define NO_NCCL "this ds4 was built without NCCL (CMake found no CUDA toolkit with libnccl and nccl.h)"

int dist_nccl_built(void) { return 0; }

const char *dist_nccl_version(char *buf, size_t len) {
    snprintf(buf, len, "none");
    return buf;
}

ds4_status dist_nccl_open(int32_t rank, int32_t world, int32_t device, double timeout_s, dist_bcast_fn bcast,
                          void *bcast_ctx, dist_nccl **out, ds4_error *err) {
    (void)rank, (void)world, (void)device, (void)timeout_s, (void)bcast, (void)bcast_ctx;
    *out = NULL;
    return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist init: a device communicator was asked for, but %s", NO_NCCL);
}

ds4_status dist_nccl_close(dist_nccl *n, int finalize, ds4_error *err) {
    (void)n, (void)finalize, (void)err;
    return DS4_OK;
}

/* Unreachable (no dist_nccl is ever made); kept so that comm.c links. */
int32_t dist_nccl_device(const dist_nccl *n) {
    (void)n;
    return -1;
}
ds4_status dist_nccl_all_reduce_sum(dist_nccl *n, ds4_dtype dtype, void *dev_buf, int64_t count, ds4_error *err) {
    (void)n, (void)dtype, (void)dev_buf, (void)count;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_reduce: %s", NO_NCCL);
}
ds4_status dist_nccl_enqueue_sum(dist_nccl *n, float *dev_buf, int64_t count, const int64_t *off, const int64_t *len,
                                 void *after, ds4_error *err) {
    (void)n, (void)dev_buf, (void)count, (void)off, (void)len, (void)after;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_reduce: %s", NO_NCCL);
}
ds4_status dist_nccl_wait(dist_nccl *n, const char *op, ds4_error *err) {
    (void)n;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist %s: %s", op, NO_NCCL);
}
ds4_status dist_nccl_all_gather(dist_nccl *n, const void *dev_send, void *dev_recv, size_t nbytes, ds4_error *err) {
    (void)n, (void)dev_send, (void)dev_recv, (void)nbytes;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_gather: %s", NO_NCCL);
}
ds4_status dist_nccl_broadcast(dist_nccl *n, void *dev_buf, size_t nbytes, int32_t root, ds4_error *err) {
    (void)n, (void)dev_buf, (void)nbytes, (void)root;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist broadcast: %s", NO_NCCL);
}
ds4_status dist_nccl_all_to_all_v(dist_nccl *n, const void *dev_send, const int64_t *send_rows, void *dev_recv,
                                  const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    (void)n, (void)dev_send, (void)send_rows, (void)dev_recv, (void)recv_rows, (void)row_bytes;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_to_all_v: %s", NO_NCCL);
}
