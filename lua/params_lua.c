/* params_lua.c — the model's flat fp32 parameter buffer from Lua, for weight synchronisation (rollout workers,
 * lua/ds4/rollout/): the trainer snapshots it, ships it in chunks, and a worker replaces its own in one copy.
 *
 *   model:params()           -> F32 tensor [n_params]: a copy of ds4_model_params (every fp32 parameter, in ds4's
 *                               canonical order: the order of model:tensors() / ds4_model_tensor_at). With sharded
 *                               experts (expert parallelism) the whole model's, every rank's experts gathered: a
 *                               collective, every rank calls it; set_params then takes the whole layout too
 *   model:set_params(src)    src: an F32 tensor of n_params elements (any shape) or a string of 4 · n_params bytes
 *                               (little-endian f32): copied into the parameter buffer in one memcpy -> model
 *   model:tables_crc()       -> CRC-32 (ds4_crc32) of the non-fp32 tensors (the hash-routing tid2eid tables), in
 *                               tensor order; 0 when the model has none. They are fixed at creation and not part of
 *                               the parameter buffer, so two models agree on every output only if these agree too.
 *   model:tables()           -> those tables' bytes (int32 little-endian, tensor order): what protocol v2's
 *                               weight_announce carries, so that a worker without local files routes as the trainer
 *   model:set_tables(bytes)  replaces them (the same length; every id in [0, n_routed_experts)) -> model
 *   model:config_json()      -> the canonical config JSON (ds4_config_to_json): what a worker builds its model from,
 *                               and whose CRC says whether two models have one architecture
 *
 * set_params replaces the weights only: gradients and optimizer state (train_lua.c) are left alone. Call it between
 * generations: from an on_token callback it raises (gen_lua.c guards it), since the rest of that generation would
 * mix two sets of weights. */
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"

static int m_params(lua_State *L) {
    const char *fname = "ds4.model:params";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int64_t n = ds4_model_whole_param_count(m);
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_F32, 1, &n);
    ds4_error err = {0};
    /* a model training on a device comes back first; sharded experts come from their owners (a collective) */
    if (n > 0 && ds4_model_gather_params(m, t->data, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int m_set_params(lua_State *L) {
    const char *fname = "ds4.model:set_params";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int64_t n = ds4_model_whole_param_count(m);
    const void *src = NULL;
    size_t bytes = 0;
    if (lua_type(L, 2) == LUA_TSTRING) {
        src = lua_tolstring(L, 2, &bytes);
        if (bytes != (size_t)n * sizeof(float))
            ds4l_raise(L, "%s: the string holds %zu bytes, the model has %lld parameters (%lld bytes)", fname, bytes,
                       (long long)n, (long long)n * 4);
    } else {
        ds4_tensor *t = ds4l_tensor_test(L, 2);
        if (!t)
            ds4l_raise(L, "%s: bad argument #1 (F32 tensor or string of little-endian f32 expected, got %s)", fname,
                       luaL_typename(L, 2));
        if (t->dtype != DS4_F32 || ds4_tensor_numel(t) != n)
            ds4l_raise(L, "%s: need an F32 tensor of %lld elements (the model's parameters), got %s with %lld", fname,
                       (long long)n, ds4_dtype_name(t->dtype), (long long)ds4_tensor_numel(t));
        src = t->data;
        bytes = (size_t)n * sizeof(float);
    }
    ds4_error err = {0};
    if (bytes && ds4_model_scatter_params(m, src, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, 1);
    return 1;
}

/* The hash-routing tables are the model's non-fp32 tensors: calls fn on each, in tensor order (the order their CRC,
 * the wire's tables frame and set_tables all use); raises on an error. */
static void each_table(lua_State *L, ds4_model *m, const char *fname, void (*fn)(void *ctx, ds4_tensor *view),
                       void *ctx) {
    size_t count = ds4_model_tensor_count(m);
    for (size_t i = 0; i < count; i++) {
        ds4_tensor_info info;
        ds4_tensor view;
        const char *name = NULL;
        ds4_error err = {0};
        if (ds4_model_tensor_info(m, i, &info, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        if (info.is_param) continue;
        if (ds4_model_tensor_at(m, i, &name, &view, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        fn(ctx, &view);
    }
}

static void crc_one(void *ctx, ds4_tensor *v) { *(uint32_t *)ctx = ds4_crc32(*(uint32_t *)ctx, v->data, v->nbytes); }
static void size_one(void *ctx, ds4_tensor *v) { *(size_t *)ctx += v->nbytes; }
static void add_one(void *ctx, ds4_tensor *v) { luaL_addlstring(ctx, v->data, v->nbytes); }

typedef struct copy_ctx {
    const char *src;
    size_t off;
} copy_ctx;
static void copy_one(void *ctx, ds4_tensor *v) {
    copy_ctx *c = ctx;
    memcpy(v->data, c->src + c->off, v->nbytes);
    c->off += v->nbytes;
}

static int m_tables_crc(lua_State *L) {
    const char *fname = "ds4.model:tables_crc";
    uint32_t crc = 0;
    each_table(L, ds4l_model_check(L, 1, fname), fname, crc_one, &crc);
    lua_pushnumber(L, (lua_Number)crc);
    return 1;
}

static int m_tables(lua_State *L) {
    const char *fname = "ds4.model:tables";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    each_table(L, m, fname, add_one, &b);
    luaL_pushresult(&b);
    return 1;
}

static int m_set_tables(lua_State *L) {
    const char *fname = "ds4.model:set_tables";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    size_t len = 0, want = 0;
    if (lua_type(L, 2) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (string of little-endian int32 expected, got %s)", fname,
                   luaL_typename(L, 2));
    const char *src = lua_tolstring(L, 2, &len);
    each_table(L, m, fname, size_one, &want);
    if (len != want)
        ds4l_raise(L, "%s: %zu bytes, the model's hash-routing tables hold %zu", fname, len, want);
    /* ids out of range would index past the expert arrays in the forward pass: refuse before writing any */
    const int64_t E = ds4_model_config(m)->n_routed_experts;
    for (size_t k = 0; k < len / 4; k++) {
        int32_t v;
        memcpy(&v, src + 4 * k, 4);
        if (v < 0 || v >= E) ds4l_raise(L, "%s: element %zu = %d is not an expert id in [0, %lld)", fname, k, (int)v,
                                        (long long)E);
    }
    ds4_error err = {0};
    if (ds4_model_host_sync(m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    copy_ctx c = {src, 0};
    each_table(L, m, fname, copy_one, &c);
    ds4_model_params_changed(m); /* the device copy (weights and tables) is uploaded again before the next use */
    lua_settop(L, 1);
    return 1;
}

static int m_config_json(lua_State *L) {
    const char *fname = "ds4.model:config_json";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    char *json = ds4_config_to_json(ds4_model_config(m));
    if (!json) ds4l_raise(L, "%s: out of memory", fname);
    lua_pushstring(L, json); /* only an out-of-memory raise here could leak json (a few hundred bytes) */
    free(json);
    return 1;
}

/* Add params / set_params / tables_crc to the model methods (module table at the top of the stack). */
void ds4l_params_open(lua_State *L) {
    static const luaL_Reg methods[] = {
        {"params", m_params},         {"set_params", m_set_params},   {"tables_crc", m_tables_crc},
        {"tables", m_tables},         {"set_tables", m_set_tables},   {"config_json", m_config_json},
        {NULL, NULL}};
    int mod = lua_gettop(L);
    lua_getfield(L, mod, "model_methods");
    if (!lua_istable(L, -1)) ds4l_raise(L, "ds4.core: internal error: model_methods missing when adding params");
    for (const luaL_Reg *r = methods; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_settop(L, mod);
}
