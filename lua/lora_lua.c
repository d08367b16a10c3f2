/* lora_lua.c — LoRA from Lua (docs/lora.md):
 *
 *   model:lora{rank = 16, alpha = 32, dropout = 0, targets = {...}, seed = 0, rslora = false}
 *                                     attach fresh adapters (A random, B = 0: the model's outputs are unchanged);
 *                                     from then on only they train (ds4.adamw(model) steps them alone)
 *   model:save_lora(dir [, {overwrite = bool, base = "name"}])   PEFT's adapter_config.json + adapter_model.safetensors
 *   model:load_lora(dir)              attach a PEFT adapter (ds4.load(dir, {lora = adapter_dir}) does it at load)
 *   model:merge_lora()                fold s·B A into the weights and drop the adapters
 *   model:drop_lora()                 drop them unmerged
 *   model:lora_info()                 {rank, scale, numel} or nil
 *   model:lora_tensors() / model:lora_grads()   {PEFT key = F32 tensor} copies in PEFT's layout
 *   model:set_lora(tbl)               the inverse of lora_tensors (every adapter tensor, PEFT layout)
 *   model:lora_layout()               {rank, alpha, rslora, masks = {per layer: adapted weights as site bits}} or nil
 *   model:lora_from_layout(layout)    attach zero adapters of that layout (a rollout worker: the trainer's buffer)
 *   model:lora_layout_numel(layout)   their element count, without attaching them (the layout checked)
 *   model:lora_params() / model:set_lora_params(t)   the adapters' flat F32 buffer [numel] (ds4's order) out / in
 *
 * targets: any of "wq_a", "wq_b", "wkv", "wo_a", "wo_b", "attention" (those five), "indexer", "shared", "experts",
 * "all"; the default is {"attention", "shared", "experts"}. */
#include <math.h>
#include <string.h>

#include "ds4lua.h"

static const struct {
    const char *name;
    uint32_t bits;
} TARGETS[] = {
    {"wq_a", DS4_LORA_WQ_A},
    {"wq_b", DS4_LORA_WQ_B},
    {"wkv", DS4_LORA_WKV},
    {"wo_a", DS4_LORA_WO_A},
    {"wo_b", DS4_LORA_WO_B},
    {"attention", DS4_LORA_WQ_A | DS4_LORA_WQ_B | DS4_LORA_WKV | DS4_LORA_WO_A | DS4_LORA_WO_B},
    {"indexer", DS4_LORA_INDEXER},
    {"shared", DS4_LORA_SHARED},
    {"experts", DS4_LORA_EXPERTS},
    {"all", DS4_LORA_ALL},
};

static void check_not_busy(lua_State *L, const char *fname) {
    if (ds4l_model_busy(L, 1))
        ds4l_raise(L, "%s: the model is generating (called from an on_token callback?)", fname);
}

static uint32_t parse_targets(lua_State *L, int idx, const char *fname) {
    if (lua_isnil(L, idx)) return DS4_LORA_ALL & ~(uint32_t)DS4_LORA_INDEXER;
    if (!lua_istable(L, idx)) ds4l_raise(L, "%s: opts.targets must be a list of names, got %s", fname, luaL_typename(L, idx));
    uint32_t bits = 0;
    const size_t n = lua_objlen(L, idx);
    for (size_t i = 1; i <= n; i++) {
        lua_rawgeti(L, idx, (int)i);
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        size_t k = 0;
        for (; s && k < sizeof TARGETS / sizeof TARGETS[0]; k++)
            if (!strcmp(s, TARGETS[k].name)) break;
        if (!s || k == sizeof TARGETS / sizeof TARGETS[0])
            ds4l_raise(L, "%s: opts.targets[%zu] = %s: expected one of wq_a, wq_b, wkv, wo_a, wo_b, attention, indexer, "
                          "shared, experts, all", fname, i, s ? s : luaL_typename(L, -1));
        bits |= TARGETS[k].bits;
        lua_pop(L, 1);
    }
    if (!bits) ds4l_raise(L, "%s: opts.targets is empty", fname);
    return bits;
}

static int m_lora(lua_State *L) {
    const char *fname = "ds4.model:lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    const int opts = ds4l_check_opts(L, 2, fname, 1);
    static const char *const known[] = {"rank", "alpha", "dropout", "targets", "seed", "rslora", NULL};
    ds4l_check_keys(L, opts, fname, known);
    ds4_lora_options o = {0};
    o.rank = ds4l_opt_int(L, opts, "rank", 16, 1, 65536, "an integer in [1, 65536]", fname);
    o.alpha = ds4l_opt_num(L, opts, "alpha", 2.0 * (double)o.rank, -HUGE_VAL, HUGE_VAL, "a number", fname);
    o.dropout = ds4l_opt_num(L, opts, "dropout", 0, -HUGE_VAL, HUGE_VAL, "a number", fname);
    o.seed = (uint64_t)ds4l_opt_int(L, opts, "seed", 0, 0, DS4L_MAX_EXACT, "an integer >= 0", fname);
    o.rslora = ds4l_opt_bool(L, opts, "rslora", 0, fname);
    lua_getfield(L, 2, "targets");
    o.targets = parse_targets(L, lua_gettop(L), fname);
    lua_pop(L, 1);
    ds4_error err = {0};
    if (ds4_model_lora(m, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_save_lora(lua_State *L) {
    const char *fname = "ds4.model:save_lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    const char *dir = luaL_checkstring(L, 2);
    int overwrite = 0;
    const char *base = NULL;
    if (lua_istable(L, 3)) {
        lua_getfield(L, 3, "overwrite");
        overwrite = lua_toboolean(L, -1);
        lua_getfield(L, 3, "base");
        base = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL; /* kept alive by the options table */
        lua_pop(L, 2);
    }
    ds4_error err = {0};
    if (ds4_model_lora_save(m, dir, base, overwrite, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_load_lora(lua_State *L) {
    const char *fname = "ds4.model:load_lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    ds4_error err = {0};
    if (ds4_model_lora_load(m, luaL_checkstring(L, 2), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_merge_lora(lua_State *L) {
    const char *fname = "ds4.model:merge_lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    ds4_error err = {0};
    if (ds4_model_merge_lora(m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_drop_lora(lua_State *L) {
    ds4_model *m = ds4l_model_check(L, 1, "ds4.model:drop_lora");
    check_not_busy(L, "ds4.model:drop_lora");
    ds4_model_drop_lora(m);
    return 0;
}

static int m_lora_info(lua_State *L) {
    const char *fname = "ds4.model:lora_info";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int64_t r, n;
    double s;
    ds4_error err = {0};
    if (ds4_model_lora_info(m, &r, &s, &n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (!r) {
        lua_pushnil(L);
        return 1;
    }
    lua_createtable(L, 0, 3);
    ds4l_set_int(L, "rank", r);
    ds4l_set_num(L, "scale", s);
    ds4l_set_int(L, "numel", n);
    return 1;
}

/* The C tensors become Lua tensors one by one; each is boxed before the next step can raise. */
static int push_tensors(lua_State *L, const char *fname, int grads) {
    ds4_model *m = ds4l_model_check(L, 1, fname);
    ds4_lora_tensors t;
    ds4_error err = {0};
    if (ds4_model_lora_tensors(m, grads, &t, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_createtable(L, 0, (int)t.n);
    for (size_t i = 0; i < t.n; i++) {
        ds4l_tensor *box = ds4l_tensor_push_box(L);
        box->t = t.tensors[i];
        t.tensors[i] = NULL;
        lua_setfield(L, -2, t.names[i]);
    }
    ds4_lora_tensors_free(&t);
    return 1;
}

static int m_lora_tensors(lua_State *L) { return push_tensors(L, "ds4.model:lora_tensors", 0); }
static int m_lora_grads(lua_State *L) { return push_tensors(L, "ds4.model:lora_grads", 1); }

static int m_set_lora(lua_State *L) {
    const char *fname = "ds4.model:set_lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    luaL_checktype(L, 2, LUA_TTABLE);
    size_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        lua_pop(L, 1);
        n++;
    }
    /* borrowed names and tensors: the table keeps them alive while the call runs */
    const char **names = lua_newuserdata(L, (n ? n : 1) * sizeof *names);
    ds4_tensor **tensors = lua_newuserdata(L, (n ? n : 1) * sizeof *tensors);
    size_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        if (lua_type(L, -2) != LUA_TSTRING) ds4l_raise(L, "%s: keys must be PEFT tensor names", fname);
        names[k] = lua_tostring(L, -2);
        tensors[k] = ds4l_tensor_check(L, -1, fname, 1);
        k++;
        lua_pop(L, 1);
    }
    ds4_lora_tensors in = {n, (char **)names, tensors};
    ds4_error err = {0};
    if (ds4_model_lora_set(m, &in, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_lora_layout(lua_State *L) {
    const char *fname = "ds4.model:lora_layout";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    if (!ds4_model_has_lora(m)) {
        lua_pushnil(L);
        return 1;
    }
    const int64_t n = ds4_model_config(m)->num_hidden_layers;
    uint32_t *masks = lua_newuserdata(L, (size_t)(n ? n : 1) * sizeof *masks);
    int64_t r;
    double alpha;
    int32_t rslora;
    ds4_error err = {0};
    if (ds4_model_lora_layout(m, &r, &alpha, &rslora, masks, n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_createtable(L, 0, 4);
    ds4l_set_int(L, "rank", r);
    ds4l_set_num(L, "alpha", alpha);
    ds4l_set_bool(L, "rslora", rslora);
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
        lua_pushnumber(L, masks[i]);
        lua_rawseti(L, -2, (int)i + 1);
    }
    lua_setfield(L, -2, "masks");
    return 1;
}

/* A layout table's fields (masks: a userdata left on the stack); raises naming what is wrong. */
typedef struct layout_arg {
    double rank, alpha;
    int rslora;
    uint32_t *masks;
    size_t n;
} layout_arg;

static layout_arg check_layout(lua_State *L, int idx, const char *fname) {
    luaL_checktype(L, idx, LUA_TTABLE);
    layout_arg a;
    lua_getfield(L, idx, "rank");
    a.rank = (double)ds4l_check_int(L, -1, fname, "layout.rank", 1, 65536, "an integer in [1, 65536]");
    lua_getfield(L, idx, "alpha");
    if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TNUMBER)
        ds4l_raise(L, "%s: layout.alpha must be a number, got %s", fname, luaL_typename(L, -1));
    a.alpha = lua_isnil(L, -1) ? NAN : lua_tonumber(L, -1);
    lua_pop(L, 2);
    lua_getfield(L, idx, "rslora");
    a.rslora = lua_toboolean(L, -1);
    lua_pop(L, 1);
    lua_getfield(L, idx, "masks");
    if (!lua_istable(L, -1)) ds4l_raise(L, "%s: layout.masks must be a list of per-layer site bits", fname);
    a.n = lua_objlen(L, -1);
    a.masks = lua_newuserdata(L, (a.n ? a.n : 1) * sizeof *a.masks);
    for (size_t i = 0; i < a.n; i++) {
        lua_rawgeti(L, -2, (int)i + 1);
        const double v = lua_tonumber(L, -1);
        if (lua_type(L, -1) != LUA_TNUMBER || !(v >= 0 && v < 4294967296.0 && v == floor(v)))
            ds4l_raise(L, "%s: layout.masks[%zu] must be an integer in [0, 2^32)", fname, i + 1);
        a.masks[i] = (uint32_t)v;
        lua_pop(L, 1);
    }
    return a;
}

static int m_lora_layout_numel(lua_State *L) {
    const char *fname = "ds4.model:lora_layout_numel";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    layout_arg a = check_layout(L, 2, fname);
    int64_t n = 0;
    ds4_error err = {0};
    if (ds4_model_lora_layout_numel(m, (int64_t)a.rank, a.masks, (int64_t)a.n, &n, &err) != DS4_OK)
        ds4l_raise_ds4(L, fname, &err);
    lua_pushnumber(L, (lua_Number)n);
    return 1;
}

static int m_lora_from_layout(lua_State *L) {
    const char *fname = "ds4.model:lora_from_layout";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    layout_arg a = check_layout(L, 2, fname);
    ds4_error err = {0};
    if (ds4_model_lora_attach_layout(m, (int64_t)a.rank, a.alpha, a.rslora, a.masks, (int64_t)a.n, &err) != DS4_OK)
        ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static int m_lora_params(lua_State *L) {
    const char *fname = "ds4.model:lora_params";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int64_t n = 0;
    ds4_error err = {0};
    if (ds4_model_lora_info(m, NULL, NULL, &n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (!n) ds4l_raise(L, "%s: the model has no adapters", fname);
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_F32, 1, &n);
    if (ds4_model_lora_read(m, t->data, n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int m_set_lora_params(lua_State *L) {
    const char *fname = "ds4.model:set_lora_params";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    ds4_tensor *t = ds4l_tensor_check(L, 2, fname, 1);
    if (t->dtype != DS4_F32) ds4l_raise(L, "%s: need an F32 tensor, got %s", fname, ds4_dtype_name(t->dtype));
    ds4_error err = {0};
    if (ds4_model_lora_write(m, t->data, ds4_tensor_numel(t), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

static const luaL_Reg lora_methods[] = {
    {"lora", m_lora},           {"save_lora", m_save_lora},       {"load_lora", m_load_lora},
    {"merge_lora", m_merge_lora}, {"drop_lora", m_drop_lora},     {"lora_info", m_lora_info},
    {"lora_tensors", m_lora_tensors}, {"lora_grads", m_lora_grads}, {"set_lora", m_set_lora},
    {"lora_layout", m_lora_layout}, {"lora_from_layout", m_lora_from_layout}, {"lora_params", m_lora_params},
    {"set_lora_params", m_set_lora_params}, {"lora_layout_numel", m_lora_layout_numel},
    {NULL, NULL},
};

void ds4l_lora_open(lua_State *L) {
    lua_getfield(L, -1, "model_methods");
    if (!lua_istable(L, -1)) ds4l_raise(L, "ds4.core: internal error: model_methods missing when adding LoRA");
    for (const luaL_Reg *r = lora_methods; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_pop(L, 1);
}
