/* ep.c — the communicator as a model's expert-parallel hooks (ds4_expert_parallel, core/include/ds4_train.h): the
 * rows of the routed experts move between ranks through ds4_comm_all_to_all_v (MPI, the TCP star, or a world of
 * one) for a CPU model, through NCCL for a CUDA model; the per-expert counts always take the host path. */
#include <stdlib.h>

#include "ds4_dist.h"
#include "internal.h"

static ds4_status host_a2a_v(void *ctx, const void *send, const int64_t *send_rows, void *recv,
                             const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    return ds4_comm_all_to_all_v(ctx, send, send_rows, recv, recv_rows, row_bytes, err);
}

static ds4_status device_a2a_v(void *ctx, const void *send, const int64_t *send_rows, void *recv,
                               const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    return ds4_comm_device_all_to_all_v(ctx, send, send_rows, recv, recv_rows, row_bytes, err);
}

/* Fixed blocks: one row of `bytes` to and from every rank. */
static ds4_status host_blocks(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    ds4_comm *c = ctx;
    enum { SMALL = 64 };
    const int32_t P = ds4_comm_world_size(c);
    int64_t small[SMALL], *ones = P <= SMALL ? small : malloc((size_t)P * sizeof *ones);
    if (!ones) return ds4_fail(err, DS4_ERR_OOM, "dist all_to_all: counts of %d ranks", P);
    for (int32_t q = 0; q < P; q++) ones[q] = 1;
    ds4_status st = ds4_comm_all_to_all_v(c, send, ones, recv, ones, bytes, err);
    if (ones != small) free(ones);
    return st;
}

ds4_status ds4_comm_expert_parallel(ds4_comm *c, ds4_model *m, int on, ds4_error *err) {
    if (!c || !m) return ds4_fail(err, DS4_ERR_ARG, "dist expert_parallel: communicator or model is NULL");
    if (!on) return ds4_model_set_expert_parallel(m, NULL, err);
    const ds4_device_options dev = ds4_model_device(m);
    const int on_gpu = dev.type == DS4_DEVICE_CUDA;
    if (on_gpu && ds4_comm_device(c) != dev.index) {
        if (ds4_comm_device(c) < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist expert_parallel: the model is on %s: a device model exchanges its "
                                              "expert rows through NCCL (Lua: ds4.dist.init{device = \"cuda\"})",
                            ds4_model_device_name(m));
        return ds4_fail(err, DS4_ERR_ARG, "dist expert_parallel: the model is on %s, the communicator's NCCL on cuda:%d "
                                          "(move the model to ds4.dist.device())", ds4_model_device_name(m),
                        ds4_comm_device(c));
    }
    const ds4_expert_parallel ep = {
        .rank = ds4_comm_rank(c),
        .world = ds4_comm_world_size(c),
        .device = on_gpu ? dev.index : -1,
        .shard = on == DS4_EP_SHARDED,
        .ctx = c,
        .all_to_all_v = on_gpu ? device_a2a_v : host_a2a_v,
        .host_all_to_all = host_blocks,
    };
    ds4_status st = ds4_model_set_expert_parallel(m, &ep, err);
    if (st) ds4_error_prefix(err, "dist expert_parallel: ");
    return st;
}
