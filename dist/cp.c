/* cp.c — the communicator as a model's context-parallel hooks (ds4_context_parallel, core/include/ds4_train.h): the
 * attention rows and the per-row losses of the ranks' slices of a sequence are all-gathered in rank order through
 * ds4_comm_all_gather (MPI, the TCP star, or a world of one). */
#include "ds4_dist.h"
#include "internal.h"

static ds4_status host_all_gather(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    return ds4_comm_all_gather(ctx, send, recv, bytes, err);
}

ds4_status ds4_comm_context_parallel(ds4_comm *c, ds4_model *m, int on, ds4_error *err) {
    if (!c || !m) return ds4_fail(err, DS4_ERR_ARG, "dist context_parallel: communicator or model is NULL");
    if (!on) return ds4_model_set_context_parallel(m, NULL, err);
    const ds4_context_parallel cp = {
        .rank = ds4_comm_rank(c),
        .world = ds4_comm_world_size(c),
        .ctx = c,
        .all_gather = host_all_gather,
    };
    ds4_status st = ds4_model_set_context_parallel(m, &cp, err);
    if (st) ds4_error_prefix(err, "dist context_parallel: ");
    return st;
}
