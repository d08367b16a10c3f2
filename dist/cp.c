/* cp.c — the communicator as a model's context-parallel hooks (ds4_context_parallel, core/include/ds4_train.h): the
 * attention rows of the ranks' slices of a sequence are all-gathered in rank order through ds4_comm_all_gather (MPI,
 * the TCP star, or a world of one) for a CPU model, through NCCL for a CUDA model; the per-row losses, the ranks'
 * notes and their failure flags always take the host path. */
#include "ds4_dist.h"
#include "internal.h"

static ds4_status host_all_gather(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    return ds4_comm_all_gather(ctx, send, recv, bytes, err);
}

static ds4_status device_all_gather(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err) {
    return ds4_comm_device_all_gather(ctx, send, recv, bytes, err);
}

ds4_status ds4_comm_context_parallel(ds4_comm *c, ds4_model *m, int on, ds4_error *err) {
    if (!c || !m) return ds4_fail(err, DS4_ERR_ARG, "dist context_parallel: communicator or model is NULL");
    if (!on) return ds4_model_set_context_parallel(m, NULL, err);
    const ds4_device_options dev = ds4_model_device(m);
    const int on_gpu = dev.type == DS4_DEVICE_CUDA;
    if (on_gpu && ds4_comm_device(c) != dev.index) {
        if (ds4_comm_device(c) < 0)
            return ds4_fail(err, DS4_ERR_ARG, "dist context_parallel: the model is on %s: a device model gathers its "
                                              "attention rows through NCCL (Lua: ds4.dist.init{device = \"cuda\"})",
                            ds4_model_device_name(m));
        return ds4_fail(err, DS4_ERR_ARG, "dist context_parallel: the model is on %s, the communicator's NCCL on "
                                          "cuda:%d (move the model to ds4.dist.device())", ds4_model_device_name(m),
                        ds4_comm_device(c));
    }
    const ds4_context_parallel cp = {
        .rank = ds4_comm_rank(c),
        .world = ds4_comm_world_size(c),
        .device = on_gpu ? dev.index : -1,
        .ctx = c,
        .all_gather = host_all_gather,
        .device_all_gather = on_gpu ? device_all_gather : NULL,
        .whole_attention = on == DS4_CP_WHOLE_ATTENTION,
    };
    ds4_status st = ds4_model_set_context_parallel(m, &cp, err);
    if (st) ds4_error_prefix(err, "dist context_parallel: ");
    return st;
}
