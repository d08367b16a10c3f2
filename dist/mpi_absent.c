/* mpi_absent.c — the MPI backend of a build without MPI: a world of one still works (dist/comm.c needs no MPI for
 * it); anything launched by mpirun or srun is refused with the reason. */
#include "internal.h"
#include "mpi_backend.h"

#define NO_MPI "this ds4 was built without MPI (CMake found no MPI: install openmpi-bin libopenmpi-dev and rebuild)"

int dist_mpi_built(void) { return 0; }
int dist_mpi_serialized(const dist_mpi *m) {
    (void)m;
    return 0;
}

ds4_status dist_mpi_open(double timeout_s, dist_mpi **out, int32_t *rank, int32_t *size, int32_t *local_rank,
                         ds4_error *err) {
    (void)timeout_s, (void)rank, (void)size, (void)local_rank;
    *out = NULL;
    return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist init: launched by an MPI launcher, but %s", NO_MPI);
}

ds4_status dist_mpi_close(dist_mpi *m, int finalize, ds4_error *err) {
    (void)m, (void)finalize, (void)err;
    return DS4_OK;
}

/* Unreachable (no dist_mpi is ever made); kept so that comm.c links. */
ds4_status dist_mpi_barrier(dist_mpi *m, ds4_error *err) {
    (void)m;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist barrier: %s", NO_MPI);
}
ds4_status dist_mpi_all_reduce_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err) {
    (void)m, (void)dtype, (void)buf, (void)count;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_reduce: %s", NO_MPI);
}
ds4_status dist_mpi_reduce_scatter_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                                       const int64_t *len, ds4_error *err) {
    (void)m, (void)dtype, (void)buf, (void)count, (void)off, (void)len;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist reduce_scatter: %s", NO_MPI);
}
ds4_status dist_mpi_all_gather(dist_mpi *m, const void *send, void *recv, size_t nbytes, ds4_error *err) {
    (void)m, (void)send, (void)recv, (void)nbytes;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_gather: %s", NO_MPI);
}
ds4_status dist_mpi_broadcast(dist_mpi *m, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    (void)m, (void)buf, (void)nbytes, (void)root;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist broadcast: %s", NO_MPI);
}
ds4_status dist_mpi_all_to_all_v(dist_mpi *m, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    (void)m, (void)send, (void)send_rows, (void)recv, (void)recv_rows, (void)row_bytes;
    return ds4_fail(err, DS4_ERR_INTERNAL, "dist all_to_all_v: %s", NO_MPI);
}
