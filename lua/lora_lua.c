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

static double opt_number(lua_State *L, int opts, const char *key, double def, const char *fname) {
    lua_getfield(L, opts, key);
    double v = def;
    if (lua_type(L, -1) == LUA_TNUMBER) v = lua_tonumber(L, -1);
    else if (!lua_isnil(L, -1)) ds4l_raise(L, "%s: opts.%s must be a number, got %s", fname, key, luaL_typename(L, -1));
    lua_pop(L, 1);
    return v;
}

static int m_lora(lua_State *L) {
    const char *fname = "ds4.model:lora";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    check_not_busy(L, fname);
    luaL_checktype(L, 2, LUA_TTABLE);
    static const char *const known[] = {"rank", "alpha", "dropout", "targets", "seed", "rslora", NULL};
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        lua_pop(L, 1);
        const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        int ok = 0;
        for (int i = 0; k && known[i]; i++) ok |= !strcmp(k, known[i]);
        if (!ok) ds4l_raise(L, "%s: unknown option %s (known: rank, alpha, dropout, targets, seed, rslora)", fname,
                            k ? k : "(not a string)");
    }
    ds4_lora_options o = {0};
    const double r = opt_number(L, 2, "rank", 16, fname);
    if (!(r >= 1 && r <= 65536 && r == floor(r))) ds4l_raise(L, "%s: opts.rank must be an integer in [1, 65536]", fname);
    o.rank = (int64_t)r;
    o.alpha = opt_number(L, 2, "alpha", 2 * r, fname);
    o.dropout = opt_number(L, 2, "dropout", 0, fname);
    const double seed = opt_number(L, 2, "seed", 0, fname);
    if (!(seed >= 0 && seed < 9.0e15 && seed == floor(seed))) ds4l_raise(L, "%s: opts.seed must be an integer >= 0", fname);
    o.seed = (uint64_t)seed;
    lua_getfield(L, 2, "rslora");
    o.rslora = lua_toboolean(L, -1);
    lua_pop(L, 1);
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
    lua_pushnumber(L, (lua_Number)r);
    lua_setfield(L, -2, "rank");
    lua_pushnumber(L, s);
    lua_setfield(L, -2, "scale");
    lua_pushnumber(L, (lua_Number)n);
    lua_setfield(L, -2, "numel");
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

static const luaL_Reg lora_methods[] = {
    {"lora", m_lora},           {"save_lora", m_save_lora},       {"load_lora", m_load_lora},
    {"merge_lora", m_merge_lora}, {"drop_lora", m_drop_lora},     {"lora_info", m_lora_info},
    {"lora_tensors", m_lora_tensors}, {"lora_grads", m_lora_grads}, {"set_lora", m_set_lora},
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
