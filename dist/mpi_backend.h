/* mpi_backend.h — what dist/comm.c asks of MPI. Implemented by mpi_backend.c (built when CMake finds MPI) or by
 * mpi_absent.c (every call refused, naming the missing dependency). Not installed. */
#ifndef DS4_DIST_MPI_BACKEND_H
#define DS4_DIST_MPI_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

typedef struct dist_mpi dist_mpi;

int dist_mpi_built(void);
/* 1 when MPI may be called from a thread other than the one that initialised it (one call at a time): MPI's thread
 * level is MPI_THREAD_SERIALIZED or more. */
int dist_mpi_serialized(const dist_mpi *m);
/* MPI_Init (when not yet initialized), a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, and a split by shared
 * memory node for the local rank. Every collective below fails (DS4_ERR_COMM) when not complete after timeout_s
 * seconds, and the communicator then refuses further collectives. */
ds4_status dist_mpi_open(double timeout_s, dist_mpi **out, int32_t *rank, int32_t *size, int32_t *local_rank,
                         ds4_error *err);
/* Free the duplicates; MPI_Finalize when `finalize` and dist_mpi_open initialized MPI (neither after a collective
 * timed out: its request is still pending; with `finalize` that is an error). Frees `m` in every case. */
ds4_status dist_mpi_close(dist_mpi *m, int finalize, ds4_error *err);
ds4_status dist_mpi_barrier(dist_mpi *m, ds4_error *err);
ds4_status dist_mpi_all_reduce_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err);
/* In place: rank r's elements [off[r], off[r] + len[r]) of buf [count] become the sum over ranks, in rank order
 * (the regions are disjoint and the same on every rank; the rest of buf is left as it was). */
ds4_status dist_mpi_reduce_scatter_sum(dist_mpi *m, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                                       const int64_t *len, ds4_error *err);
ds4_status dist_mpi_all_gather(dist_mpi *m, const void *send, void *recv, size_t nbytes, ds4_error *err);
ds4_status dist_mpi_broadcast(dist_mpi *m, void *buf, size_t nbytes, int32_t root, ds4_error *err);
/* send_rows[q] rows of row_bytes to rank q (consecutive blocks of send), recv_rows[s] from rank s (consecutive blocks
 * of recv, rank order): MPI_Alltoallv over a row datatype. */
ds4_status dist_mpi_all_to_all_v(dist_mpi *m, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err);

#endif
