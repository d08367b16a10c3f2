/* dist_lua.c — ds4.dist: the communicator (dist/ds4_dist.h) for scripts, and collectives on ds4 tensors.
 *
 *   ds4.dist.init([opts])              -> rank, world_size   (idempotent; a world of one without a launcher)
 *        opts.device = "cpu" (default) | "cuda" (NCCL on the local rank's GPU) | "cuda:N"
 *        opts.timeout = seconds         (the TCP rendezvous and the TCP and NCCL collectives; default
 *                                        DS4_DIST_TIMEOUT, else 300)
 *        opts.bucket_mb = MiB           (the buckets of overlap_backward's reduction; default 25; 0: off)
 *   ds4.dist.rank() / world_size() / local_rank() / backend() ("mpi", "tcp" or "single") / is_initialized()
 *   ds4.dist.device()                  "cuda:N" of the NCCL communicator, "cpu" without one: where to put the model
 *   ds4.dist.barrier()
 *   ds4.dist.all_reduce(t [, "sum"])   in place on an F32 / F64 tensor; returns t
 *   ds4.dist.all_gather(t)             -> a new tensor [world_size, ...t's shape], rank order
 *   ds4.dist.broadcast(t, root)        in place (any dtype): every rank's t becomes rank root's; returns t
 *   ds4.dist.all_to_all_v(t, send_rows, recv_rows)   rows of t: send_rows[q] to rank q, recv_rows[s] from rank s
 *                                      -> a new tensor of the received rows, rank order
 *   ds4.dist.all_reduce_grads(model [, scale])   the model's flat gradient buffer times scale, summed over ranks
 *                                      (a CUDA model: on its device, through NCCL; with LoRA adapters attached,
 *                                      the adapters' gradient buffer, the only one that exists then)
 *   ds4.dist.overlap_backward(model)   the model's next backward (the step's last) sums its gradients over ranks
 *                                      bucket by bucket while it runs; all_reduce_grads(model) then waits for them
 *   ds4.dist.bucket_mb([mb])           -> the bucket size in MiB (sets it first when given; 0: off)
 *   ds4.dist.shard_optimizer(opt [, {reduce_scatter = true}])   ZeRO-1: this rank keeps and steps its shard of the
 *                                      optimizer -> offset, count of its region of the flat buffer (a CUDA model:
 *                                      with NCCL, init{device}); reduce_scatter: all_reduce_grads then sums this
 *                                      rank's region only (the same weights; the rest of the buffer unsummed)
 *   ds4.dist.expert_parallel(model [, on])   routed experts split over the ranks (on = true, the default; false:
 *                                      off again); the model's forwards and backwards are then collective.
 *                                      on = {shard = true}: each rank also keeps only its experts' weights,
 *                                      gradients and moments (on its GPU too; docs/distributed.md)
 *   ds4.dist.context_parallel(model [, on])  each sequence split over the ranks (every rank passes the whole ids;
 *                                      rank r computes its slice, attention for its queries only);
 *                                      forwards and backwards collective (a GPU model gathers through NCCL:
 *                                      ds4.dist.init{device = "cuda"}). on = {whole_attention = true}: every rank
 *                                      runs attention over the whole sequences (one process's gradient bits)
 *   ds4.dist.finalize()                MPI_Finalize / NCCL finalize (every rank must call it)
 *   ds4.dist.have_mpi, have_nccl       what this build has
 *
 * Tensors are host memory (ds4 tensors have no device form), so the tensor collectives always take the host path
 * (MPI or TCP); device memory is reached through a model's gradients.
 *
 * The communicator is a box in this lua_State's registry, not a C global. Its __gc (lua_close after an error)
 * frees it without MPI_Finalize (and aborts NCCL): finalizing is collective, and a rank that fails must not wait
 * for the others there; it exits instead, and mpirun ends the job, or the TCP / NCCL peers see it gone
 * (docs/distributed.md). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ds4_dist.h"
#include "ds4_train.h"
#include "ds4lua.h"

#define COMM_MT "ds4.dist.comm"
#define COMM_KEY "ds4.dist.current" /* registry slot of the live box (not COMM_MT: that slot holds the metatable) */
#define EP_KEY "ds4.dist.ep_models"  /* registry: weak-keyed set of the models whose expert parallelism uses the box */
#define CP_KEY "ds4.dist.cp_models"  /* ... and of those whose context parallelism does */

static void ep_off(ds4_model *m) { ds4_model_set_expert_parallel(m, NULL, NULL); }
static void cp_off(ds4_model *m) { ds4_model_set_context_parallel(m, NULL, NULL); }

/* Turn expert (or context) parallelism off on every model of the registry set `key` (they use the communicator and
 * keep pointers to it: before it goes). Leaves the stack as it was; never raises. */
static void detach_all(lua_State *L, const char *key, void (*off)(ds4_model *)) {
    lua_getfield(L, LUA_REGISTRYINDEX, key);
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        return;
    }
    for (lua_pushnil(L); lua_next(L, -2); lua_pop(L, 1)) {
        ds4_model **pm = luaL_testudata(L, -2, DS4L_MODEL_MT); /* the model box's first field */
        if (pm && *pm) off(*pm);
    }
    lua_pop(L, 1);
    lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, key);
}

static void ep_detach_all(lua_State *L) {
    detach_all(L, EP_KEY, ep_off);
    detach_all(L, CP_KEY, cp_off);
}

typedef struct comm_box {
    ds4_comm *c;
} comm_box;

static int comm_gc(lua_State *L) {
    comm_box *b = luaL_checkudata(L, 1, COMM_MT);
    if (b->c) ep_detach_all(L);
    ds4_comm_abandon(b->c);
    b->c = NULL;
    return 0;
}

/* The live box in the registry, or NULL. Leaves the stack as it was. */
static comm_box *current(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, COMM_KEY);
    comm_box *b = luaL_testudata(L, -1, COMM_MT);
    lua_pop(L, 1); /* the registry keeps the box alive */
    return b && b->c ? b : NULL;
}

static ds4_comm *need(lua_State *L, const char *fname) {
    comm_box *b = current(L);
    if (!b) ds4l_raise(L, "%s: the communicator is not initialized (call ds4.dist.init() first)", fname);
    return b->c;
}

/* init's options table at idx (absent: the defaults) */
static void init_options(lua_State *L, int idx, ds4_comm_options *o) {
    const char *fname = "ds4.dist.init";
    ds4_comm_options_default(o);
    const int opts = ds4l_opt_table(L, idx, fname, 1);
    if (!opts) return;
    static const char *const known[] = {"device", "timeout", "bucket_mb", NULL};
    ds4l_check_keys(L, opts, fname, known);
    const char *spec = ds4l_opt_str(L, opts, "device", NULL, fname);
    if (spec) {
        ds4_device_options d;
        ds4_error err = {0};
        if (ds4_device_parse(spec, NULL, &d, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        o->nccl = d.type == DS4_DEVICE_CUDA;
        /* "cuda" alone: the local rank's GPU; "cuda:N": that one */
        o->device = o->nccl && strchr(spec, ':') ? d.index : -1;
    }
    /* (0, inf]: the least positive double is the open bound at 0 */
    o->timeout_s = ds4l_opt_num(L, opts, "timeout", o->timeout_s, nextafter(0.0, 1.0), HUGE_VAL,
                                "a positive number of seconds", fname);
    o->bucket_mb = ds4l_opt_num(L, opts, "bucket_mb", o->bucket_mb, 0, HUGE_VAL,
                                "a number of MiB >= 0 (0: one reduction after the backward)", fname);
}

static int d_init(lua_State *L) {
    comm_box *b = current(L);
    if (!b) {
        ds4_comm_options o;
        init_options(L, 1, &o);
        b = lua_newuserdata(L, sizeof *b); /* boxed before anything can raise */
        b->c = NULL;
        luaL_getmetatable(L, COMM_MT);
        lua_setmetatable(L, -2);
        ds4_error err = {0};
        if (ds4_comm_init_with(&o, &b->c, &err) != DS4_OK) ds4l_raise_ds4(L, "ds4.dist.init", &err);
        lua_setfield(L, LUA_REGISTRYINDEX, COMM_KEY);
    }
    lua_pushinteger(L, ds4_comm_rank(b->c));
    lua_pushinteger(L, ds4_comm_world_size(b->c));
    return 2;
}

static int d_finalize(lua_State *L) {
    comm_box *b = current(L);
    if (!b) return 0;
    ep_detach_all(L);
    ds4_comm *c = b->c;
    b->c = NULL;
    lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, COMM_KEY);
    ds4_error err = {0};
    if (ds4_comm_finalize(c, &err) != DS4_OK) ds4l_raise_ds4(L, "ds4.dist.finalize", &err);
    return 0;
}

static int d_is_initialized(lua_State *L) {
    lua_pushboolean(L, current(L) != NULL);
    return 1;
}
static int d_rank(lua_State *L) {
    lua_pushinteger(L, ds4_comm_rank(need(L, "ds4.dist.rank")));
    return 1;
}
static int d_world_size(lua_State *L) {
    lua_pushinteger(L, ds4_comm_world_size(need(L, "ds4.dist.world_size")));
    return 1;
}
static int d_local_rank(lua_State *L) {
    lua_pushinteger(L, ds4_comm_local_rank(need(L, "ds4.dist.local_rank")));
    return 1;
}
static int d_backend(lua_State *L) {
    lua_pushstring(L, ds4_comm_backend(need(L, "ds4.dist.backend")));
    return 1;
}

static int d_device(lua_State *L) {
    int32_t d = ds4_comm_device(need(L, "ds4.dist.device"));
    if (d < 0) lua_pushliteral(L, "cpu");
    else lua_pushfstring(L, "cuda:%d", (int)d);
    return 1;
}

static int d_barrier(lua_State *L) {
    ds4_error err = {0};
    if (ds4_comm_barrier(need(L, "ds4.dist.barrier"), &err) != DS4_OK) ds4l_raise_ds4(L, "ds4.dist.barrier", &err);
    return 0;
}

static int d_all_reduce(lua_State *L) {
    const char *fname = "ds4.dist.all_reduce";
    ds4_comm *c = need(L, fname);
    ds4_tensor *t = ds4l_tensor_check(L, 1, fname, 1);
    const char *op = luaL_optstring(L, 2, "sum");
    if (strcmp(op, "sum") != 0) ds4l_raise(L, "%s: op \"%s\" is not supported (\"sum\" only)", fname, op);
    if (t->dtype != DS4_F32 && t->dtype != DS4_F64) {
        char shape[128];
        ds4l_format_shape(shape, sizeof shape, t->ndim, t->shape);
        ds4l_raise(L, "%s: tensor %s %s: F32 or F64 only", fname, ds4_dtype_name(t->dtype), shape);
    }
    ds4_error err = {0};
    if (ds4_comm_all_reduce_sum(c, t->dtype, t->data, ds4_tensor_numel(t), &err) != DS4_OK)
        ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, 1);
    return 1;
}

static int d_all_gather(lua_State *L) {
    const char *fname = "ds4.dist.all_gather";
    ds4_comm *c = need(L, fname);
    ds4_tensor *t = ds4l_tensor_check(L, 1, fname, 1);
    if (t->ndim + 1 > DS4_MAX_DIMS)
        ds4l_raise(L, "%s: tensor of %d dims: the result would have %d (at most %d)", fname, t->ndim, t->ndim + 1,
                   DS4_MAX_DIMS);
    int64_t shape[DS4_MAX_DIMS];
    shape[0] = ds4_comm_world_size(c);
    for (int32_t i = 0; i < t->ndim; i++) shape[i + 1] = t->shape[i];
    ds4_tensor *out = ds4l_tensor_push_new(L, fname, t->dtype, t->ndim + 1, shape);
    ds4_error err = {0};
    if (ds4_comm_all_gather(c, t->data, out->data, t->nbytes, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

/* The per-rank row counts at idx: a table of world_size non-negative integers. */
static void row_counts(lua_State *L, int idx, int32_t P, int64_t *out, const char *fname, const char *what) {
    luaL_checktype(L, idx, LUA_TTABLE);
    if ((int64_t)lua_objlen(L, idx) != P)
        ds4l_raise(L, "%s: %s has %d entries, one per rank (%d) expected", fname, what, (int)lua_objlen(L, idx), P);
    for (int32_t q = 0; q < P; q++) {
        lua_rawgeti(L, idx, q + 1);
        const double v = lua_tonumber(L, -1);
        if (lua_type(L, -1) != LUA_TNUMBER || v < 0 || v != (double)(int64_t)v || v > 9e15)
            ds4l_raise(L, "%s: %s[%d] must be a non-negative integer", fname, what, q + 1);
        out[q] = (int64_t)v;
        lua_pop(L, 1);
    }
}

/* ds4.dist.all_to_all_v(t, send_rows, recv_rows) -> a new tensor [sum(recv_rows), ...t's other dims]: rows of t (its
 * first dimension) in consecutive blocks, send_rows[q] of them to rank q; recv_rows[s] rows come from rank s, in rank
 * order. Every rank's send_rows[q] must be rank q's recv_rows[s] (the TCP star checks). */
static int d_all_to_all_v(lua_State *L) {
    const char *fname = "ds4.dist.all_to_all_v";
    ds4_comm *c = need(L, fname);
    ds4_tensor *t = ds4l_tensor_check(L, 1, fname, 1);
    const int32_t P = ds4_comm_world_size(c);
    int64_t *cnt = lua_newuserdata(L, (size_t)P * 2 * sizeof(int64_t)); /* owned by Lua: nothing leaks on a raise */
    row_counts(L, 2, P, cnt, fname, "send_rows");
    row_counts(L, 3, P, cnt + P, fname, "recv_rows");
    int64_t row = (int64_t)ds4_dtype_size(t->dtype), out_rows = 0, in_rows = 0;
    for (int32_t i = 1; i < t->ndim; i++) row *= t->shape[i];
    for (int32_t q = 0; q < P; q++) out_rows += cnt[q], in_rows += cnt[P + q];
    if (t->ndim < 1 || row <= 0 || out_rows != t->shape[0])
        ds4l_raise(L, "%s: sends %lld rows of a tensor of %d dims with %lld rows", fname, (long long)out_rows, t->ndim,
                   (long long)(t->ndim ? t->shape[0] : 0));
    int64_t shape[DS4_MAX_DIMS];
    for (int32_t i = 0; i < t->ndim; i++) shape[i] = t->shape[i];
    shape[0] = in_rows;
    ds4_tensor *out = ds4l_tensor_push_new(L, fname, t->dtype, t->ndim, shape);
    ds4_error err = {0};
    if (ds4_comm_all_to_all_v(c, t->data, cnt, out->data, cnt + P, (size_t)row, &err) != DS4_OK)
        ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int d_broadcast(lua_State *L) {
    const char *fname = "ds4.dist.broadcast";
    ds4_comm *c = need(L, fname);
    ds4_tensor *t = ds4l_tensor_check(L, 1, fname, 1);
    lua_Integer root = luaL_optinteger(L, 2, 0);
    if (root < 0 || root >= ds4_comm_world_size(c))
        ds4l_raise(L, "%s: root %lld outside ranks [0, %d)", fname, (long long)root, ds4_comm_world_size(c));
    ds4_error err = {0};
    if (ds4_comm_broadcast(c, t->data, t->nbytes, (int32_t)root, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, 1);
    return 1;
}

/* Data parallelism's one step between backward and the optimizer (ds4_comm_all_reduce_grads): every rank multiplies
 * its gradient buffer by scale (its share of the global normalisation: a rank whose loss was the mean over its n_r
 * tokens passes n_r / N, N the global count), then the buffers are summed over ranks: sum_r (n_r / N) g_r, the
 * gradient of the global token mean, for equal and unequal shards alike (docs/distributed.md). */
static int d_all_reduce_grads(lua_State *L) {
    const char *fname = "ds4.dist.all_reduce_grads";
    ds4_comm *c = need(L, fname);
    ds4_model *m = ds4l_model_check(L, 1, fname);
    double scale = luaL_optnumber(L, 2, 1.0);
    ds4_error err = {0};
    if (ds4_comm_all_reduce_grads(c, m, scale, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* ds4.dist.overlap_backward(model): ds4_comm_overlap_backward (docs/distributed.md, "Bucketed all-reduce"). */
static int d_overlap_backward(lua_State *L) {
    const char *fname = "ds4.dist.overlap_backward";
    ds4_comm *c = need(L, fname);
    ds4_model *m = ds4l_model_check(L, 1, fname);
    ds4_error err = {0};
    if (ds4_comm_overlap_backward(c, m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* ds4.dist.bucket_mb([mb]) -> the bucket size in MiB, after setting it when mb is given. */
static int d_bucket_mb(lua_State *L) {
    const char *fname = "ds4.dist.bucket_mb";
    ds4_comm *c = need(L, fname);
    if (!lua_isnoneornil(L, 1)) {
        ds4_error err = {0};
        if (ds4_comm_set_bucket_mb(c, luaL_checknumber(L, 1), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    }
    lua_pushnumber(L, ds4_comm_bucket_mb(c));
    return 1;
}

/* ZeRO-1's collectives for an optimizer sharded from Lua: through the communicator box, which the optimizer's
 * environment keeps alive; after ds4.dist.finalize() (the box emptied) a step fails instead of touching a freed
 * communicator. */
static ds4_status finalized(ds4_error *err) {
    if (err) {
        err->code = DS4_ERR_ARG;
        snprintf(err->msg, sizeof err->msg, "the communicator was finalized (ds4.dist.finalize) before this step");
    }
    return DS4_ERR_ARG;
}

static ds4_status zero_sum(void *ctx, double *buf, int64_t n, ds4_error *err) {
    comm_box *b = ctx;
    return b->c ? ds4_comm_all_reduce_sum(b->c, DS4_F64, buf, n, err) : finalized(err);
}

static ds4_status zero_gather(void *ctx, float *buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    comm_box *b = ctx;
    return b->c ? ds4_comm_all_gather_regions(b->c, buf, sizeof *buf, off, len, err) : finalized(err);
}

static ds4_status zero_gather_dev(void *ctx, float *dev_buf, const int64_t *off, const int64_t *len, ds4_error *err) {
    comm_box *b = ctx;
    return b->c ? ds4_comm_device_all_gather_regions(b->c, dev_buf, sizeof *dev_buf, off, len, err) : finalized(err);
}

/* ds4.dist.shard_optimizer(opt): ZeRO-1 (ds4_adamw_set_shard): this rank keeps the Adam moments of its shard of the
 * flat buffer and updates those parameters only; each step sums the norm's partial sums over ranks and gathers the
 * updated parameters, so every rank ends each step with the unsharded optimizer's weights, bit for bit. opt:state()
 * then gathers (call it on every rank); opt:load_state takes a whole state (from any number of ranks). */
static int d_shard_optimizer(lua_State *L) {
    const char *fname = "ds4.dist.shard_optimizer";
    comm_box *b = current(L);
    if (!b) ds4l_raise(L, "%s: the communicator is not initialized (call ds4.dist.init() first)", fname);
    ds4_adamw *a = ds4l_adamw_check(L, 1, fname);
    const int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"reduce_scatter", NULL};
    ds4l_check_keys(L, opts, fname, known);
    const int rs = ds4l_opt_bool(L, opts, "reduce_scatter", 0, fname);
    /* with NCCL (ds4.dist.init{device = "cuda"}) a CUDA model's master weights are gathered on its GPU */
    const ds4_adamw_shard sh = {.rank = ds4_comm_rank(b->c), .world = ds4_comm_world_size(b->c), .ctx = b,
                                .sum_f64 = zero_sum, .gather_f32 = zero_gather,
                                .gather_dev_f32 = ds4_comm_device(b->c) >= 0 ? zero_gather_dev : NULL};
    ds4_error err = {0};
    if (ds4_adamw_set_shard(a, &sh, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (rs && ds4_comm_reduce_scatter_grads(b->c, a, 1, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_getfenv(L, 1); /* the optimizer keeps the box (and so the ctx above) alive */
    lua_getfield(L, LUA_REGISTRYINDEX, COMM_KEY);
    lua_setfield(L, -2, "dist_comm");
    lua_pop(L, 1);
    int64_t off = 0, len = 0;
    ds4_adamw_shard_region(a, &off, &len);
    lua_pushinteger(L, (lua_Integer)off);
    lua_pushinteger(L, (lua_Integer)len);
    return 2;
}

/* Expert parallelism (ds4_comm_expert_parallel): rank r computes routed experts [r·E/P, (r+1)·E/P) for every rank's
 * tokens; every rank runs the rest of the model on its own tokens. The model remembers the communicator, so it is
 * recorded here and detached when the communicator is finalized. */
/* model(, on) of expert_parallel / context_parallel: `set` installs or removes the communicator's hooks; the model
 * is then noted in (or dropped from) the registry set `key`, which finalize turns off. */
static int parallel_mode(lua_State *L, const char *fname, const char *key,
                         ds4_status (*set)(ds4_comm *, ds4_model *, int, ds4_error *)) {
    ds4_comm *c = need(L, fname);
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int on = lua_isnoneornil(L, 2) ? 1 : lua_toboolean(L, 2);
    const int ep = set == ds4_comm_expert_parallel;
    if (lua_istable(L, 2)) { /* {shard = true}: on, with sharded experts; {whole_attention = true}: on, attention whole */
        static const char *const ep_known[] = {"shard", NULL}, *const cp_known[] = {"whole_attention", NULL};
        ds4l_check_keys(L, 2, fname, ep ? ep_known : cp_known);
        on = ep ? (ds4l_opt_bool(L, 2, "shard", 0, fname) ? DS4_EP_SHARDED : 1)
                : (ds4l_opt_bool(L, 2, "whole_attention", 0, fname) ? DS4_CP_WHOLE_ATTENTION : 1);
    } else if (!lua_isnoneornil(L, 2) && !lua_isboolean(L, 2)) {
        ds4l_raise(L, "%s: bad argument #2 (boolean expected, or {%s = boolean}, got %s)", fname,
                   ep ? "shard" : "whole_attention", luaL_typename(L, 2));
    }
    ds4_error err = {0};
    if (set(c, m, on, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    ds4l_weak_registry_table(L, key, "k");
    lua_getfield(L, LUA_REGISTRYINDEX, key);
    lua_pushvalue(L, 1);
    if (on) lua_pushboolean(L, 1);
    else lua_pushnil(L);
    lua_rawset(L, -3);
    lua_pop(L, 1);
    return 0;
}

static int d_expert_parallel(lua_State *L) {
    return parallel_mode(L, "ds4.dist.expert_parallel", EP_KEY, ds4_comm_expert_parallel);
}

/* Context parallelism (ds4_comm_context_parallel): each sequence split over the ranks, attention's keys over the
 * gathered whole sequence (docs/distributed.md); {whole_attention = true}: its queries too, on every rank. */
static int d_context_parallel(lua_State *L) {
    return parallel_mode(L, "ds4.dist.context_parallel", CP_KEY, ds4_comm_context_parallel);
}

void ds4l_dist_open(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"init", d_init},
        {"finalize", d_finalize},
        {"is_initialized", d_is_initialized},
        {"rank", d_rank},
        {"world_size", d_world_size},
        {"local_rank", d_local_rank},
        {"backend", d_backend},
        {"device", d_device},
        {"barrier", d_barrier},
        {"all_reduce", d_all_reduce},
        {"all_gather", d_all_gather},
        {"broadcast", d_broadcast},
        {"all_to_all_v", d_all_to_all_v},
        {"all_reduce_grads", d_all_reduce_grads},
        {"shard_optimizer", d_shard_optimizer},
        {"overlap_backward", d_overlap_backward},
        {"bucket_mb", d_bucket_mb},
        {"expert_parallel", d_expert_parallel},
        {"context_parallel", d_context_parallel},
        {NULL, NULL},
    };
    ds4l_class(L, COMM_MT, NULL, comm_gc, NULL);
    lua_pop(L, 1);
    lua_newtable(L);
    for (const luaL_Reg *r = fns; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    ds4l_set_bool(L, "have_mpi", ds4_dist_have_mpi());
    ds4l_set_bool(L, "have_nccl", ds4_dist_have_nccl());
    lua_setfield(L, -2, "dist");
}
