/* binding.c — the ds4.core Lua module: engine, model loading, forward pass, configs.
 *
 * Engine: one per lua_State, created on first use from the thread count chosen with ds4.set_threads. Models
 * belong to the engine that loaded them and must be freed before it, but Lua's finalizer order is only
 * "reverse order of creation" and an explicit model:free() can come at any time, so the engine lives in a
 * small reference-counted C record: the registry holder owns one reference and every model one more; the
 * last release frees the engine.
 *
 * Errors: every ds4 failure becomes a Lua error "<lua function>: <ds4 message>" raised after the C resource
 * under construction is owned by a Lua box (see ds4lua.h). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <luajit.h>

#include "ds4lua.h"

#define ENGINE_KEY "ds4.engine"

/* ------------------------------------------------------------------------------------------------ errors */

void ds4l_raise(lua_State *L, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    luaL_where(L, 1);
    lua_pushstring(L, buf);
    lua_concat(L, 2);
    lua_error(L);
#if defined(__GNUC__)
    __builtin_unreachable();
#endif
}

void ds4l_raise_ds4(lua_State *L, const char *fname, const ds4_error *err) {
    ds4l_raise(L, "%s: %s", fname, err->msg[0] ? err->msg : ds4_status_name(err->code));
}

void ds4l_format_shape(char *buf, size_t cap, int32_t ndim, const int64_t *shape) {
    size_t o = 0;
    int w = snprintf(buf, cap, "[");
    o = w > 0 ? (size_t)w : 0;
    for (int32_t d = 0; d < ndim && o < cap; d++) {
        w = snprintf(buf + o, cap - o, d ? ", %lld" : "%lld", (long long)shape[d]);
        if (w < 0) break;
        o += (size_t)w;
    }
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* ------------------------------------------------------------------------------------------------ engine */

typedef struct engine_ref {
    ds4_engine *e;
    int32_t refs;
} engine_ref;

static void engine_ref_release(engine_ref *r) {
    if (r && --r->refs == 0) {
        ds4_engine_free(r->e);
        free(r);
    }
}

/* The registry value ENGINE_KEY: created with the module, engine made lazily. */
typedef struct engine_holder {
    engine_ref *ref;
    int32_t n_threads; /* for the next engine; 0 = the default (one per physical core, at most 16) */
    int32_t profile;   /* ds4.profile before the engine exists: applied when it is made */
    ds4_device_options device; /* where ds4.load / new_model / random_model put a model without a device option:
                                  ds4.set_device, `ds4 ... --device` (DS4L_DEVICE_KEY) */
} engine_holder;

static int holder_gc(lua_State *L) {
    engine_holder *h = lua_touserdata(L, 1);
    if (h) {
        engine_ref_release(h->ref);
        h->ref = NULL;
    }
    return 0;
}

static engine_holder *get_holder(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, ENGINE_KEY);
    engine_holder *h = lua_touserdata(L, -1);
    lua_pop(L, 1); /* the registry keeps it alive */
    if (!h) ds4l_raise(L, "ds4: internal error: the engine holder is missing from the registry");
    return h;
}

static engine_ref *get_engine(lua_State *L, const char *fname) {
    engine_holder *h = get_holder(L);
    if (h->ref) return h->ref;
    /* No Lua call between malloc and handing the record to the holder: nothing can raise there. */
    engine_ref *r = malloc(sizeof *r);
    if (!r) ds4l_raise(L, "%s: engine create: out of memory", fname);
    ds4_engine_options opt = {.n_threads = h->n_threads, .profile = h->profile};
    ds4_error err = {0};
    if (ds4_engine_create(&opt, &r->e, &err) != DS4_OK) {
        free(r);
        ds4l_raise_ds4(L, fname, &err);
    }
    r->refs = 1;
    h->ref = r;
    return r;
}

static int l_set_threads(lua_State *L) {
    const char *fname = "ds4.set_threads";
    int64_t n;
    if (lua_type(L, 1) != LUA_TNUMBER || !ds4l_number_to_i64(lua_tonumber(L, 1), &n) || n < 0 || n > 4096)
        ds4l_raise(L, "%s: bad argument #1 (thread count 0..4096 expected, 0 = one per physical core, at most 16; got %s)", fname,
                   lua_isnumber(L, 1) ? lua_tostring(L, 1) : luaL_typename(L, 1));
    engine_holder *h = get_holder(L);
    /* Unreachable models not yet finalized still hold the engine: collect them first. */
    if (h->ref && h->ref->refs > 1) lua_gc(L, LUA_GCCOLLECT, 0);
    if (h->ref && h->ref->refs > 1)
        ds4l_raise(L,
                   "%s: the engine (%d threads) is in use by %d loaded model(s); free them with model:free() "
                   "before changing the thread count",
                   fname, (int)ds4_engine_threads(h->ref->e), (int)(h->ref->refs - 1));
    /* No model uses the current engine: drop it; the next use creates one with the new count. */
    engine_ref_release(h->ref);
    h->ref = NULL;
    h->n_threads = (int32_t)n;
    return 0;
}

static int l_threads(lua_State *L) {
    lua_pushinteger(L, ds4_engine_threads(get_engine(L, "ds4.threads")->e));
    return 1;
}

/* ------------------------------------------------------------------------------------------------ devices */

/* The device named by the string at idx (with the optional dtype string at dtype_idx, 0 = none). */
static ds4_device_options check_device(lua_State *L, int idx, int dtype_idx, const char *fname) {
    if (lua_type(L, idx) != LUA_TSTRING)
        ds4l_raise(L, "%s: device expected as a string (\"cpu\", \"cuda\", \"cuda:N\"), got %s", fname,
                   luaL_typename(L, idx));
    const char *dt = NULL;
    if (dtype_idx && !lua_isnoneornil(L, dtype_idx)) {
        if (lua_type(L, dtype_idx) != LUA_TSTRING)
            ds4l_raise(L, "%s: dtype expected as a string (\"fp32\" or \"bf16\"), got %s", fname,
                       luaL_typename(L, dtype_idx));
        dt = lua_tostring(L, dtype_idx);
    }
    ds4_device_options o;
    ds4_error err = {0};
    if (ds4_device_parse(lua_tostring(L, idx), dt, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return o;
}

/* The device of an options table at idx ({device = ..., dtype = ...}): *given = 0 when it names neither. */
static ds4_device_options opts_device(lua_State *L, int idx, const char *fname, int *given) {
    *given = 0;
    ds4_device_options o = {0};
    if (!lua_istable(L, idx)) return o;
    lua_getfield(L, idx, "device");
    lua_getfield(L, idx, "dtype");
    const int dev = lua_gettop(L) - 1;
    if (!lua_isnil(L, dev) || !lua_isnil(L, dev + 1)) {
        if (lua_isnil(L, dev)) lua_pushliteral(L, "cuda"), lua_replace(L, dev); /* a dtype alone: the GPU's */
        o = check_device(L, dev, dev + 1, fname);
        *given = 1;
    }
    lua_pop(L, 2);
    return o;
}

static const char *device_spelling(const ds4_device_options *o, char *buf, size_t cap) {
    if (o->type != DS4_DEVICE_CUDA) return "cpu";
    snprintf(buf, cap, "cuda:%d %s", (int)o->index, o->dtype == DS4_BF16 ? "bf16" : "fp32");
    return buf;
}

/* Put the new model at the device asked for (opts at idx, else the default of ds4.set_device). */
static void place_model(lua_State *L, ds4_model *m, int opts_idx, const char *fname) {
    int given = 0;
    ds4_device_options o = opts_device(L, opts_idx, fname, &given);
    if (!given) o = get_holder(L)->device;
    if (o.type == DS4_DEVICE_CPU) return;
    ds4_error err = {0};
    if (ds4_model_to(m, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
}

/* ds4.set_device(device [, dtype]): where models made from now on compute ("cpu", "cuda", "cuda:N"; dtype "bf16"
 * (the GPU's default) or "fp32"). Models that exist stay where they are (model:to moves one). */
static int l_set_device(lua_State *L) {
    ds4_device_options o = check_device(L, 1, 2, "ds4.set_device");
    get_holder(L)->device = o;
    return 0;
}

/* ds4.device() -> "cpu" or "cuda:N bf16": the default of ds4.set_device. */
static int l_device(lua_State *L) {
    char buf[64];
    lua_pushstring(L, device_spelling(&get_holder(L)->device, buf, sizeof buf));
    return 1;
}

/* ds4.cuda_devices() -> the number of usable CUDA devices (0 without a GPU, a driver or a CUDA build). */
static int l_cuda_devices(lua_State *L) {
    int32_t n = 0;
    ds4_error err = {0};
    if (ds4_cuda_devices(&n, &err) != DS4_OK) ds4l_raise_ds4(L, "ds4.cuda_devices", &err);
    lua_pushinteger(L, n);
    return 1;
}

/* ds4.profile([on]) -> whether the per-op profile is on (before the change). With an argument: switch it for every
 * model of this state, from their next pass (model:profile() reads it). */
static int l_profile(lua_State *L) {
    engine_holder *h = get_holder(L);
    const int was = h->ref ? ds4_engine_profile(h->ref->e) : h->profile;
    if (!lua_isnoneornil(L, 1)) {
        if (lua_type(L, 1) != LUA_TBOOLEAN)
            ds4l_raise(L, "ds4.profile: bad argument #1 (boolean expected, got %s)", luaL_typename(L, 1));
        h->profile = lua_toboolean(L, 1);
        if (h->ref) ds4_engine_set_profile(h->ref->e, h->profile);
    }
    lua_pushboolean(L, was);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ config */

static const char *attn_name(ds4_attn_type t) {
    switch (t) {
    case DS4_ATTN_SLIDING: return "sliding_attention";
    case DS4_ATTN_CSA: return "compressed_sparse_attention";
    case DS4_ATTN_HCA: return "heavily_compressed_attention";
    }
    return "unknown";
}

static const char *score_name(ds4_score_func s) {
    switch (s) {
    case DS4_SCORE_SQRTSOFTPLUS: return "sqrtsoftplus";
    case DS4_SCORE_SIGMOID: return "sigmoid";
    case DS4_SCORE_SOFTMAX: return "softmax";
    }
    return "unknown";
}

static void push_rope(lua_State *L, const ds4_rope_params *r) {
    lua_createtable(L, 0, 10);
    ds4l_set_str(L, "rope_type", r->type == DS4_ROPE_YARN ? "yarn" : "default");
    ds4l_set_num(L, "rope_theta", r->theta);
    ds4l_set_num(L, "partial_rotary_factor", r->partial_rotary_factor);
    ds4l_set_int(L, "dim", r->dim);
    if (r->type == DS4_ROPE_YARN) {
        ds4l_set_num(L, "factor", r->factor);
        ds4l_set_num(L, "original_max_position_embeddings", r->original_max_position_embeddings);
        ds4l_set_num(L, "beta_fast", r->beta_fast);
        ds4l_set_num(L, "beta_slow", r->beta_slow);
        ds4l_set_num(L, "attention_factor", r->attention_factor);
        ds4l_set_bool(L, "truncate", r->truncate);
    }
}

/* Every ds4_config field, spelled as in config.json where the field has an HF name. */
static void push_config(lua_State *L, const ds4_config *c) {
    lua_createtable(L, 0, 48);
    ds4l_set_int(L, "vocab_size", c->vocab_size);
    ds4l_set_int(L, "hidden_size", c->hidden_size);
    ds4l_set_int(L, "num_hidden_layers", c->num_hidden_layers);
    ds4l_set_int(L, "num_attention_heads", c->num_attention_heads);
    ds4l_set_int(L, "num_key_value_heads", c->num_key_value_heads);
    ds4l_set_int(L, "head_dim", c->head_dim);
    ds4l_set_int(L, "qk_rope_head_dim", c->rope_head_dim);
    ds4l_set_int(L, "q_lora_rank", c->q_lora_rank);
    ds4l_set_int(L, "o_groups", c->o_groups);
    ds4l_set_int(L, "o_lora_rank", c->o_lora_rank);
    ds4l_set_int(L, "sliding_window", c->sliding_window);
    lua_createtable(L, 0, 2);
    ds4l_set_int(L, "compressed_sparse_attention", c->compress_rate_csa);
    ds4l_set_int(L, "heavily_compressed_attention", c->compress_rate_hca);
    lua_setfield(L, -2, "compress_rates");
    int64_t nl = c->num_hidden_layers;
    if (nl < 0) nl = 0;
    if (nl > DS4_MAX_LAYERS) nl = DS4_MAX_LAYERS;
    lua_createtable(L, (int)nl, 0);
    for (int64_t i = 0; i < nl; i++) {
        lua_pushstring(L, attn_name(c->layer_types[i]));
        lua_rawseti(L, -2, (int)i + 1);
    }
    lua_setfield(L, -2, "layer_types");
    lua_createtable(L, (int)nl, 0);
    for (int64_t i = 0; i < nl; i++) {
        lua_pushstring(L, c->layer_is_hash[i] ? "hash_moe" : "moe");
        lua_rawseti(L, -2, (int)i + 1);
    }
    lua_setfield(L, -2, "mlp_layer_types");
    ds4l_set_int(L, "index_n_heads", c->index_n_heads);
    ds4l_set_int(L, "index_head_dim", c->index_head_dim);
    ds4l_set_int(L, "index_topk", c->index_topk);
    ds4l_set_int(L, "n_routed_experts", c->n_routed_experts);
    ds4l_set_int(L, "num_experts_per_tok", c->num_experts_per_tok);
    ds4l_set_int(L, "n_shared_experts", c->n_shared_experts);
    ds4l_set_int(L, "moe_intermediate_size", c->moe_intermediate_size);
    ds4l_set_str(L, "scoring_func", score_name(c->scoring_func));
    ds4l_set_bool(L, "norm_topk_prob", c->norm_topk_prob);
    ds4l_set_num(L, "routed_scaling_factor", c->routed_scaling_factor);
    ds4l_set_num(L, "swiglu_limit", c->swiglu_limit);
    ds4l_set_int(L, "hc_mult", c->hc_mult);
    ds4l_set_int(L, "hc_sinkhorn_iters", c->hc_sinkhorn_iters);
    ds4l_set_num(L, "hc_eps", c->hc_eps);
    ds4l_set_num(L, "rms_norm_eps", c->rms_norm_eps);
    lua_createtable(L, 0, 2);
    push_rope(L, &c->rope_main);
    lua_setfield(L, -2, "main");
    push_rope(L, &c->rope_compress);
    lua_setfield(L, -2, "compress");
    lua_setfield(L, -2, "rope_parameters");
    ds4l_set_int(L, "max_position_embeddings", c->max_position_embeddings);
    ds4l_set_int(L, "num_nextn_predict_layers", c->num_nextn_predict_layers);
    ds4l_set_bool(L, "tie_word_embeddings", c->tie_word_embeddings);
    ds4l_set_int(L, "bos_token_id", c->bos_token_id);
    ds4l_set_int(L, "eos_token_id", c->eos_token_id);
    ds4l_set_num(L, "initializer_range", c->initializer_range);
}

static const char *check_path(lua_State *L, int idx, const char *fname) {
    if (lua_type(L, idx) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #%d (path string expected, got %s)", fname, idx, luaL_typename(L, idx));
    return lua_tostring(L, idx);
}

/* ds4.config(path): path is a config.json or a checkpoint directory; no weights are read. */
static int l_config(lua_State *L) {
    const char *path = check_path(L, 1, "ds4.config");
    ds4_config cfg;
    ds4_error err = {0};
    if (ds4_config_load(path, &cfg, &err) != DS4_OK) ds4l_raise_ds4(L, "ds4.config", &err);
    push_config(L, &cfg);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ model */

typedef struct model_box {
    ds4_model *m;
    engine_ref *eref;
} model_box;

static void model_release(model_box *b) {
    if (b->m) ds4_model_free(b->m);
    b->m = NULL;
    engine_ref_release(b->eref);
    b->eref = NULL;
}

static int model_gc(lua_State *L) {
    model_box *b = lua_touserdata(L, 1);
    if (b) model_release(b);
    return 0;
}

static model_box *push_model_box(lua_State *L) {
    model_box *b = lua_newuserdata(L, sizeof *b);
    b->m = NULL;
    b->eref = NULL;
    luaL_getmetatable(L, DS4L_MODEL_MT);
    lua_setmetatable(L, -2);
    return b;
}

/* Give the freshly made model in b a reference to its engine (nothing here can raise). */
static void model_adopt(model_box *b, engine_ref *r) {
    b->eref = r;
    r->refs++;
}

/* The model box at stack slot 1, freed or not. */
static model_box *self_model(lua_State *L, const char *fname) {
    model_box *b = lua_touserdata(L, 1);
    int ok = 0;
    if (b && lua_getmetatable(L, 1)) {
        luaL_getmetatable(L, DS4L_MODEL_MT);
        ok = lua_rawequal(L, -1, -2);
        lua_pop(L, 2);
    }
    if (!ok)
        ds4l_raise(L, "%s: self must be a ds4.model (got %s); call it as model:method(...)", fname,
                   luaL_typename(L, 1));
    return b;
}

static model_box *check_model(lua_State *L, const char *fname) {
    model_box *b = self_model(L, fname);
    if (!b->m) ds4l_raise(L, "%s: model has been freed", fname);
    return b;
}

ds4_model *ds4l_model_check(lua_State *L, int idx, const char *fname) {
    model_box *b = luaL_testudata(L, idx, DS4L_MODEL_MT);
    if (!b) ds4l_raise(L, "%s: ds4.model expected, got %s", fname, luaL_typename(L, idx));
    if (!b->m) ds4l_raise(L, "%s: model has been freed", fname);
    return b->m;
}

/* ds4.load(dir [, {device = "cuda[:N]" | "cpu", dtype = "bf16" | "fp32", lora = adapter_dir, fp4_experts = bool,
 *                 expert_shard = {rank = r, world = n}}])
 * fp4_experts: keep the routed experts stored in FP4 packed in memory (docs/checkpoints.md); expert_shard: keep only
 * rank r of n's routed experts (sharded experts, docs/distributed.md: then ds4.dist.expert_parallel(m, {shard = true})) */
static int l_load(lua_State *L) {
    const char *fname = "ds4.load";
    const char *dir = check_path(L, 1, fname);
    const int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"device", "dtype", "lora", "fp4_experts", "expert_shard", NULL};
    ds4l_check_keys(L, opts, fname, known);
    int given = 0;
    (void)opts_device(L, 2, fname, &given); /* a misspelt device fails before the checkpoint is read */
    ds4_load_options lo = {.fp4_experts = ds4l_opt_bool(L, opts, "fp4_experts", 0, fname)};
    if (opts) {
        lua_getfield(L, 2, "expert_shard"); /* {rank = r, world = n}: only rank r's routed experts are kept */
        if (!lua_isnil(L, -1)) {
            lua_Number rk = -1, w = 0;
            if (lua_istable(L, -1)) {
                lua_getfield(L, -1, "rank");
                lua_getfield(L, -2, "world");
                rk = lua_type(L, -2) == LUA_TNUMBER ? lua_tonumber(L, -2) : -1;
                w = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : 0;
                lua_pop(L, 2);
            }
            if (!(w >= 1 && w <= INT32_MAX && rk >= 0 && rk < w && rk == (int32_t)rk && w == (int32_t)w))
                ds4l_raise(L, "%s: opts.expert_shard must be {rank = r, world = n} with integers 0 <= r < n", fname);
            lo.expert_shard_rank = (int32_t)rk;
            lo.expert_shard_world = (int32_t)w;
        }
        lua_pop(L, 1);
    }
    model_box *b = push_model_box(L);
    engine_ref *r = get_engine(L, fname);
    ds4_error err = {0};
    if (ds4_model_load_opts(r->e, dir, &lo, &b->m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    model_adopt(b, r);
    place_model(L, b->m, 2, fname);
    if (lua_istable(L, 2)) { /* {lora = adapter_dir}: a PEFT adapter on top (docs/lora.md) */
        lua_getfield(L, 2, "lora");
        if (!lua_isnil(L, -1)) {
            if (lua_type(L, -1) != LUA_TSTRING)
                ds4l_raise(L, "%s: opts.lora must be an adapter directory, got %s", fname, luaL_typename(L, -1));
            if (ds4_model_lora_load(b->m, lua_tostring(L, -1), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        }
        lua_pop(L, 1);
    }
    return 1;
}

/* Push a model with random weights (HF's initialisation) for `cfg`; argument 2 is the seed or an options table
 * {seed = ..., device = ..., dtype = ...}. */
static int push_random_model(lua_State *L, const char *fname, const ds4_config *cfg) {
    int64_t seed = 0;
    int opts = 0;
    if (lua_istable(L, 2)) {
        opts = 2;
        static const char *const known[] = {"seed", "device", "dtype", NULL};
        ds4l_check_keys(L, opts, fname, known);
        lua_getfield(L, 2, "seed");
    } else {
        lua_pushvalue(L, 2);
    }
    if (!lua_isnil(L, -1) &&
        (lua_type(L, -1) != LUA_TNUMBER || !ds4l_number_to_i64(lua_tonumber(L, -1), &seed) || seed < 0))
        ds4l_raise(L, "%s: bad argument #2 (non-negative integer seed, or a table {seed, device, dtype}, expected; "
                   "got %s)", fname, lua_isnumber(L, -1) ? lua_tostring(L, -1) : luaL_typename(L, -1));
    lua_pop(L, 1);
    int given = 0;
    (void)opts_device(L, opts, fname, &given);
    ds4_error err = {0};
    model_box *b = push_model_box(L);
    engine_ref *r = get_engine(L, fname);
    if (ds4_model_create_random(r->e, cfg, (uint64_t)seed, &b->m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    model_adopt(b, r);
    place_model(L, b->m, opts, fname);
    return 1;
}

/* ds4.random_model(config_path [, seed]) */
static int l_random_model(lua_State *L) {
    const char *fname = "ds4.random_model";
    const char *path = check_path(L, 1, fname);
    ds4_config cfg;
    ds4_error err = {0};
    if (ds4_config_load(path, &cfg, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return push_random_model(L, fname, &cfg);
}

/* ds4.core.random_model_json(json_text [, seed]): from config JSON text (ds4.new_model encodes a Lua table to it). */
static int l_random_model_json(lua_State *L) {
    const char *fname = "ds4.new_model";
    size_t len = 0;
    const char *text = luaL_checklstring(L, 1, &len);
    ds4_config cfg;
    ds4_error err = {0};
    if (ds4_config_parse(text, len, &cfg, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return push_random_model(L, fname, &cfg);
}

/* model:to(device [, dtype]) or model:to{device = ..., dtype = ...} -> model. Copies the weights to the device (the
 * host fp32 parameters stay the master copy); on failure the model stays where it was. Caches made before belong to
 * the old device. */
static int m_to(lua_State *L) {
    const char *fname = "ds4.model:to";
    model_box *b = check_model(L, fname);
    ds4_device_options o;
    if (lua_istable(L, 2)) {
        static const char *const known[] = {"device", "dtype", NULL};
        ds4l_check_keys(L, 2, fname, known);
        int given = 0;
        o = opts_device(L, 2, fname, &given);
        if (!given) ds4l_raise(L, "%s: the options table names no device", fname);
    } else {
        o = check_device(L, 2, 3, fname);
    }
    ds4_error err = {0};
    if (ds4_model_to(b->m, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, 1);
    return 1;
}

/* model:device() -> "cpu" or "cuda:N", and the dtype its matmuls read ("fp32" or "bf16"). */
static int m_device(lua_State *L) {
    model_box *b = check_model(L, "ds4.model:device");
    const ds4_device_options o = ds4_model_device(b->m);
    if (o.type == DS4_DEVICE_CUDA) lua_pushfstring(L, "cuda:%d", (int)o.index);
    else lua_pushliteral(L, "cpu");
    lua_pushstring(L, o.type == DS4_DEVICE_CUDA && o.dtype == DS4_BF16 ? "bf16" : "fp32");
    return 2;
}

/* model:profile([reset]) -> the per-op profile since the last reset, as a table sorted by time (ds4.profile(true)
 * switches it on); with reset = true, starts a new one after reading. */
static int m_profile(lua_State *L) {
    const char *fname = "ds4.model:profile";
    model_box *b = check_model(L, fname);
    enum { CAP = 1 << 16 }; /* one line per op of the table: a few kB */
    char *buf = lua_newuserdata(L, CAP);
    const size_t n = ds4_model_profile_report(b->m, buf, CAP);
    lua_pushlstring(L, buf, n < CAP ? n : CAP - 1);
    if (lua_toboolean(L, 2)) ds4_model_profile_reset(b->m);
    return 1;
}

static int m_free(lua_State *L) {
    model_release(self_model(L, "ds4.model:free")); /* freeing twice is harmless */
    return 0;
}

static int m_config(lua_State *L) {
    push_config(L, ds4_model_config(check_model(L, "ds4.model:config")->m));
    return 1;
}

static int m_n_params(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_model_param_count(check_model(L, "ds4.model:n_params")->m));
    return 1;
}

/* model:memory() -> {params = fp32 parameter bytes (host), fp4_experts = FP4-resident expert bytes (host),
 * device = the weights' bytes on the model's backend (0 on the CPU), device_fp4_experts = of those, the FP4-resident
 * experts', device_grads / device_master / device_moments = the training state's bytes there (the gradients, the
 * fp32 master weights, the optimizer's two moments: a ZeRO-1 shard's only when sharded; 0 on the CPU), tape /
 * workspace / backward_workspace = what the model keeps on its backend for its passes (ds4_model_pass_bytes)} */
static int m_memory(lua_State *L) {
    const ds4_model *m = check_model(L, "ds4.model:memory")->m;
    int64_t dev_fp4 = 0, tg = 0, tm = 0, tv = 0, tape = 0, ws = 0, bws = 0;
    const int64_t dev = ds4_model_device_bytes(m, &dev_fp4);
    ds4_model_train_device_bytes(m, &tg, &tm, &tv);
    ds4_model_pass_bytes(m, &tape, &ws, &bws);
    lua_createtable(L, 0, 10);
    ds4l_set_int(L, "tape", tape);
    ds4l_set_int(L, "workspace", ws);
    ds4l_set_int(L, "backward_workspace", bws);
    ds4l_set_int(L, "device_grads", tg);
    ds4l_set_int(L, "device_master", tm);
    ds4l_set_int(L, "device_moments", tv);
    ds4l_set_int(L, "params", ds4_model_param_count(m) * 4);
    ds4l_set_int(L, "fp4_experts", ds4_model_fp4_bytes(m));
    ds4l_set_int(L, "device", dev);
    ds4l_set_int(L, "device_fp4_experts", dev_fp4);
    return 1;
}

static int m_has_mtp(lua_State *L) {
    lua_pushboolean(L, ds4_model_has_mtp(check_model(L, "ds4.model:has_mtp")->m));
    return 1;
}

/* model:set_NAME(on) for a boolean option of the model: `on` must be a boolean; the setter's refusal raises. */
static int set_model_flag(lua_State *L, const char *fname, ds4_status (*set)(ds4_model *, int, ds4_error *)) {
    ds4_model *m = check_model(L, fname)->m;
    if (lua_type(L, 2) != LUA_TBOOLEAN) ds4l_raise(L, "%s: on must be a boolean, got %s", fname, luaL_typename(L, 2));
    ds4_error err = {0};
    if (set(m, lua_toboolean(L, 2), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* model:set_kv_qat(on): the FP8 KV quantisation-aware option (ds4_model_set_kv_qat); model:kv_qat() reads it. */
static int m_set_kv_qat(lua_State *L) { return set_model_flag(L, "ds4.model:set_kv_qat", ds4_model_set_kv_qat); }

static int m_kv_qat(lua_State *L) {
    lua_pushboolean(L, ds4_model_kv_qat(check_model(L, "ds4.model:kv_qat")->m));
    return 1;
}

/* model:set_bf16_emulation(on): the CPU's emulation of the CUDA bf16 mode (ds4_model_set_bf16_emulation);
 * model:bf16_emulation() reads it. */
static int m_set_bf16_emulation(lua_State *L) {
    return set_model_flag(L, "ds4.model:set_bf16_emulation", ds4_model_set_bf16_emulation);
}

static int m_bf16_emulation(lua_State *L) {
    lua_pushboolean(L, ds4_model_bf16_emulation(check_model(L, "ds4.model:bf16_emulation")->m));
    return 1;
}

/* model:tensors() -> {name = tensor}: copies of the parameters (canonical official names). With sharded experts
 * (expert parallelism) the routed experts other ranks hold are left out. */
static int m_tensors(lua_State *L) {
    const char *fname = "ds4.model:tensors";
    model_box *b = check_model(L, fname);
    size_t n = ds4_model_tensor_count(b->m);
    lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
    int tbl = lua_gettop(L);
    for (size_t i = 0; i < n; i++) {
        const char *name = NULL;
        ds4_tensor view;
        ds4_tensor_info ti;
        ds4_error err = {0};
        if (ds4_model_tensor_info(b->m, i, &ti, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        if (ti.elsewhere) continue;
        if (ds4_model_tensor_at(b->m, i, &name, &view, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        ds4_tensor *t = ds4l_tensor_push_new(L, fname, view.dtype, view.ndim, view.shape);
        if (t->nbytes != view.nbytes)
            ds4l_raise(L, "%s: tensor %s: view has %zu bytes, %zu expected from its dtype and shape", fname, name,
                       view.nbytes, t->nbytes);
        if (view.nbytes) memcpy(t->data, view.data, view.nbytes);
        lua_setfield(L, tbl, name);
    }
    return 1;
}

static int m_tostring(lua_State *L) {
    model_box *b = lua_touserdata(L, 1);
    if (!b || !b->m) {
        lua_pushliteral(L, "ds4.model (freed)");
        return 1;
    }
    const ds4_config *c = ds4_model_config(b->m);
    char buf[256];
    snprintf(buf, sizeof buf, "ds4.model (%lld layers, hidden %lld, vocab %lld, %lld parameters%s)",
             (long long)c->num_hidden_layers, (long long)c->hidden_size, (long long)c->vocab_size,
             (long long)ds4_model_param_count(b->m), ds4_model_has_mtp(b->m) ? ", MTP" : "");
    lua_pushstring(L, buf);
    return 1;
}

/* Token ids ([B, S]) from the value at idx: an integer-valued tensor of 1 or 2 dimensions (1-D = one row)
 * or a Lua table of equal-length rows (a flat table of numbers = one row). Returns int64 data: the tensor's
 * own buffer for a 2-D/1-D I64 tensor, else a scratch userdata left on the stack. */
static const int64_t *check_ids(lua_State *L, int idx, const char *fname, const char *what, int64_t *B,
                                int64_t *S) {
    ds4_tensor *t = ds4l_tensor_test(L, idx);
    char sh[256];
    if (t) {
        if (t->ndim != 1 && t->ndim != 2) {
            ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
            ds4l_raise(L, "%s: %s must be a [batch, seq] tensor, got shape %s", fname, what, sh);
        }
        if (t->dtype == DS4_BOOL)
            ds4l_raise(L, "%s: %s must hold integer token ids, got dtype BOOL", fname, what);
        *B = t->ndim == 2 ? t->shape[0] : 1;
        *S = t->shape[t->ndim - 1];
        if (*B < 1 || *S < 1) {
            ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
            ds4l_raise(L, "%s: %s is empty (shape %s)", fname, what, sh);
        }
        if (t->dtype == DS4_I64) return t->data;
        int64_t n = *B * *S;
        int64_t *out = lua_newuserdata(L, (size_t)n * sizeof *out);
        for (int64_t i = 0; i < n; i++) {
            double v = ds4_tensor_get(t, i);
            if (!ds4l_number_to_i64(v, &out[i]))
                ds4l_raise(L, "%s: %s[%lld][%lld] = %.17g is not an integer token id", fname, what,
                           (long long)(i / *S + 1), (long long)(i % *S + 1), v);
        }
        return out;
    }
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: %s must be an integer tensor [batch, seq] or a table of rows, got %s", fname, what,
                   luaL_typename(L, idx));
    int64_t rows = (int64_t)lua_objlen(L, idx);
    if (rows < 1) ds4l_raise(L, "%s: %s is an empty table", fname, what);
    lua_rawgeti(L, idx, 1);
    int flat = lua_type(L, -1) == LUA_TNUMBER;
    if (!flat && !lua_istable(L, -1))
        ds4l_raise(L, "%s: %s[1] is a %s; expected a row table (or numbers for a single row)", fname, what,
                   luaL_typename(L, -1));
    int64_t cols = flat ? rows : (int64_t)lua_objlen(L, -1);
    lua_pop(L, 1);
    if (flat) rows = 1;
    if (cols < 1) ds4l_raise(L, "%s: %s[1] is an empty row", fname, what);
    int64_t *out = lua_newuserdata(L, (size_t)(rows * cols) * sizeof *out);
    for (int64_t r = 0; r < rows; r++) {
        int row_idx = idx;
        if (!flat) {
            lua_rawgeti(L, idx, (int)r + 1);
            if (!lua_istable(L, -1))
                ds4l_raise(L, "%s: %s[%lld] is a %s; expected a row table", fname, what, (long long)r + 1,
                           luaL_typename(L, -1));
            if ((int64_t)lua_objlen(L, -1) != cols)
                ds4l_raise(L, "%s: %s rows differ in length: row %lld has %lld elements, row 1 has %lld", fname, what,
                           (long long)r + 1, (long long)lua_objlen(L, -1), (long long)cols);
            row_idx = lua_gettop(L);
        }
        for (int64_t c = 0; c < cols; c++) {
            lua_rawgeti(L, row_idx, (int)c + 1);
            if (lua_type(L, -1) != LUA_TNUMBER || !ds4l_number_to_i64(lua_tonumber(L, -1), &out[r * cols + c])) {
                if (flat)
                    ds4l_raise(L, "%s: %s[%lld] is %s %s, expected an integer token id", fname, what,
                               (long long)c + 1, luaL_typename(L, -1), lua_isnumber(L, -1) ? lua_tostring(L, -1) : "");
                ds4l_raise(L, "%s: %s[%lld][%lld] is %s %s, expected an integer token id", fname, what,
                           (long long)r + 1, (long long)c + 1, luaL_typename(L, -1),
                           lua_isnumber(L, -1) ? lua_tostring(L, -1) : "");
            }
            lua_pop(L, 1);
        }
        if (!flat) lua_pop(L, 1);
    }
    *B = rows;
    *S = cols;
    return out;
}

/* model:forward(ids [, opts]) -> {logits, loss, loss_tokens, mtp_logits, mtp_loss, mtp_loss_tokens, hidden,
 * indexer_loss (training forward with the indexer KL option)} */
static int m_forward(lua_State *L) {
    const char *fname = "ds4.model:forward";
    model_box *b = check_model(L, fname);
    const ds4_config *cfg = ds4_model_config(b->m);
    int opts = ds4l_opt_table(L, 3, fname, 2);
    static const char *const known[] = {"labels", "mtp", "hidden", "logits", "train", "replay", "lengths", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 3); /* fixed slots: 1 model, 2 ids, 3 opts; temporaries go above */
    int want_logits = ds4l_opt_bool(L, opts, "logits", 1, fname);
    int want_mtp = ds4l_opt_bool(L, opts, "mtp", 0, fname);
    int want_hidden = ds4l_opt_bool(L, opts, "hidden", 0, fname);
    if (lua_isnoneornil(L, 2)) ds4l_raise(L, "%s: bad argument #1 (token ids expected, got nil)", fname);

    int64_t B, S;
    const int64_t *ids = check_ids(L, 2, fname, "ids", &B, &S);
    const int64_t *labels = NULL;
    if (opts) {
        lua_getfield(L, opts, "labels");
        int lidx = lua_gettop(L);
        if (!lua_isnil(L, lidx)) {
            int64_t LB, LS;
            labels = check_ids(L, lidx, fname, "opts.labels", &LB, &LS);
            if (LB != B || LS != S)
                ds4l_raise(L, "%s: opts.labels has shape [%lld, %lld], ids have [%lld, %lld]", fname, (long long)LB,
                           (long long)LS, (long long)B, (long long)S);
        }
    }
    if (want_mtp && !ds4_model_has_mtp(b->m))
        ds4l_raise(L, "%s: opts.mtp = true, but the model has no MTP weights (num_nextn_predict_layers = %lld)",
                   fname, (long long)cfg->num_nextn_predict_layers);
    if (want_mtp && S < 2)
        ds4l_raise(L, "%s: opts.mtp needs at least 2 positions per row, ids have [%lld, %lld]", fname, (long long)B,
                   (long long)S);

    const int32_t *replay_experts = NULL, *replay_index = NULL;
    if (opts) {
        lua_getfield(L, opts, "replay");
        int ridx = lua_gettop(L);
        if (!lua_isnil(L, ridx)) {
            if (!lua_istable(L, ridx))
                ds4l_raise(L, "%s: opts.replay must be a table {experts = I32 [B, S, L, K], index = I32 [B, S, n_csa, "
                              "index_topk]}, got %s", fname, luaL_typename(L, ridx));
            const int64_t ncsa = ds4_model_csa_layers(b->m);
            const struct {
                const char *key;
                int64_t inner;
                const int32_t **out;
            } parts[2] = {{"experts", cfg->num_hidden_layers * cfg->num_experts_per_tok, &replay_experts},
                          {"index", ncsa * cfg->index_topk, &replay_index}};
            for (int k = 0; k < 2; k++) {
                lua_getfield(L, ridx, parts[k].key);
                if (lua_isnil(L, -1)) continue;
                ds4_tensor *t = ds4l_tensor_check(L, lua_gettop(L), fname, 2);
                if (t->dtype != DS4_I32 || ds4_tensor_numel(t) != B * S * parts[k].inner)
                    ds4l_raise(L, "%s: opts.replay.%s must be an I32 tensor of %lld x %lld x %lld values, got %s with %lld",
                               fname, parts[k].key, (long long)B, (long long)S, (long long)parts[k].inner,
                               ds4_dtype_name(t->dtype), (long long)ds4_tensor_numel(t));
                *parts[k].out = t->data; /* the tensor stays on the stack (a slot above opts) for the call */
            }
        }
    }

    const int64_t *lengths = NULL; /* right padding: the indexer KL loss leaves it out */
    if (opts) {
        lua_getfield(L, opts, "lengths");
        if (!lua_isnil(L, -1))
            lengths = ds4l_check_int_list(L, lua_gettop(L), fname, "opts.lengths", B, 0, (double)S,
                                          "an integer in [0, seq] (each row's real length)");
    }

    lua_createtable(L, 0, 8);
    int res = lua_gettop(L);
    ds4_forward_args args = {.ids = ids, .batch = B, .seq = S, .labels = labels, .replay_experts = replay_experts,
                             .replay_index = replay_index, .lengths = lengths};
    if (want_logits) {
        int64_t shape[3] = {B, S, cfg->vocab_size};
        args.logits = ds4l_tensor_push_new(L, fname, DS4_F32, 3, shape)->data;
        lua_setfield(L, res, "logits");
    }
    if (want_mtp) {
        int64_t shape[3] = {B, S - 1, cfg->vocab_size};
        args.mtp_logits = ds4l_tensor_push_new(L, fname, DS4_F32, 3, shape)->data;
        lua_setfield(L, res, "mtp_logits");
    }
    if (want_hidden) {
        int64_t shape[5] = {cfg->num_hidden_layers, B, S, cfg->hc_mult, cfg->hidden_size};
        args.hidden = ds4l_tensor_push_new(L, fname, DS4_F32, 5, shape)->data;
        lua_setfield(L, res, "hidden");
    }
    ds4_forward_result out;
    memset(&out, 0, sizeof out);
    ds4_error err = {0};
    if (ds4l_train_forward(L, 1, opts, b->m, &args, &out, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    /* nil only when nothing was scored, so `if r.loss then` reads naturally; a scored loss is always a number, NaN
     * or infinite included (the core's NaN also means "nothing scored": the token count tells them apart). */
    if (out.loss_tokens > 0) ds4l_set_num(L, "loss", out.loss);
    ds4l_set_int(L, "loss_tokens", out.loss_tokens);
    if (!isnan(out.indexer_loss)) { /* training, indexer_kl > 0 */
        ds4l_set_num(L, "indexer_loss", out.indexer_loss);
        ds4l_set_int(L, "indexer_queries", out.indexer_queries);
    }
    if (want_mtp || out.mtp_loss_tokens > 0) { /* asked for, or trained (mtp_lambda > 0) */
        if (out.mtp_loss_tokens > 0) ds4l_set_num(L, "mtp_loss", out.mtp_loss);
        ds4l_set_int(L, "mtp_loss_tokens", out.mtp_loss_tokens);
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------------ module */

static const luaL_Reg model_methods[] = {
    {"forward", m_forward}, {"config", m_config}, {"n_params", m_n_params}, {"has_mtp", m_has_mtp},
    {"tensors", m_tensors}, {"free", m_free},     {"to", m_to},           {"device", m_device},
    {"profile", m_profile}, {"set_kv_qat", m_set_kv_qat}, {"kv_qat", m_kv_qat},
    {"set_bf16_emulation", m_set_bf16_emulation}, {"bf16_emulation", m_bf16_emulation}, {"memory", m_memory},
    {NULL, NULL},
};

static const luaL_Reg module_functions[] = {
    {"load", l_load},
    {"random_model", l_random_model},
    {"random_model_json", l_random_model_json},
    {"config", l_config},
    {"set_threads", l_set_threads},
    {"threads", l_threads},
    {"set_device", l_set_device},
    {"device", l_device},
    {"cuda_devices", l_cuda_devices},
    {"profile", l_profile},
    {NULL, NULL},
};

int ds4l_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction tostring) {
    if (!luaL_newmetatable(L, mt)) return 0;
    lua_newtable(L);
    for (const luaL_Reg *r = methods; r && r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_setfield(L, -2, "__index");
    if (gc) {
        lua_pushcfunction(L, gc);
        lua_setfield(L, -2, "__gc");
    }
    if (tostring) {
        lua_pushcfunction(L, tostring);
        lua_setfield(L, -2, "__tostring");
    }
    ds4l_set_str(L, "__name", mt);
    return 1;
}

void *ds4l_push_model_owned(lua_State *L, size_t size, const char *mt, int model_idx) {
    model_idx = model_idx < 0 ? lua_gettop(L) + model_idx + 1 : model_idx;
    void *p = lua_newuserdata(L, size);
    memset(p, 0, size);
    luaL_getmetatable(L, mt);
    lua_setmetatable(L, -2);
    lua_createtable(L, 0, 1);
    lua_pushvalue(L, model_idx);
    lua_setfield(L, -2, "model");
    lua_setfenv(L, -2);
    return p;
}

void ds4l_weak_registry_table(lua_State *L, const char *key, const char *mode) {
    lua_getfield(L, LUA_REGISTRYINDEX, key);
    if (!lua_istable(L, -1)) {
        lua_newtable(L);
        lua_createtable(L, 0, 1);
        ds4l_set_str(L, "__mode", mode);
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, key);
    }
    lua_pop(L, 1);
}

int luaopen_ds4_core(lua_State *L) {
    lua_newtable(L);
    int mod = lua_gettop(L);

    /* One engine holder per lua_State; a second require of ds4.core (package.loaded cleared) reuses it. */
    lua_getfield(L, LUA_REGISTRYINDEX, ENGINE_KEY);
    int have = lua_isuserdata(L, -1);
    lua_pop(L, 1);
    if (!have) {
        engine_holder *h = lua_newuserdata(L, sizeof *h);
        memset(h, 0, sizeof *h);
        lua_newtable(L);
        lua_pushcfunction(L, holder_gc);
        lua_setfield(L, -2, "__gc");
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, ENGINE_KEY);
    }

    ds4l_class(L, DS4L_MODEL_MT, model_methods, model_gc, m_tostring);
    lua_getfield(L, -1, "__index");
    lua_setfield(L, mod, "model_methods"); /* so ds4.lua can add pure-Lua methods */
    lua_pop(L, 1);

    for (const luaL_Reg *r = module_functions; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, mod, r->name);
    }
    lua_settop(L, mod);
    ds4l_tensor_open(L);
    ds4l_tokenizer_open(L);
    ds4l_train_open(L); /* lua/train_lua.c */
    ds4l_lora_open(L);  /* lua/lora_lua.c */
    ds4l_save_open(L);  /* lua/save_lua.c */
    ds4l_params_open(L); /* lua/params_lua.c */
    ds4l_gen_open(L);   /* lua/gen_lua.c (after the others: it guards some of their model methods) */
    ds4l_zmq_open(L);   /* lua/zmq_lua.c: ds4.zmq */
    ds4l_wire_open(L);  /* lua/wire_lua.c: ds4.wire */
    ds4l_dist_open(L);  /* lua/dist_lua.c: ds4.dist */
#ifdef DS4_HAVE_TENSORBOARD
    ds4l_tb_open(L); /* lua/tb_lua.c: ds4.core.tb, TensorBoard event records (when built with protobuf-c) */
#endif

    lua_pushliteral(L, DS4_VERSION_STRING);
    lua_setfield(L, mod, "version");
    lua_pushstring(L, ds4_build_info());
    lua_setfield(L, mod, "build_info");
    lua_pushliteral(L, LUAJIT_VERSION);
    lua_setfield(L, mod, "luajit_version");
    lua_settop(L, mod);
    return 1;
}
