/* save_lua.c — model:save and the ds4.checkpoints table (core/save.c, core/ckptdir.c).
 *
 *   model:save(dir [, {dtype = "F32"|"BF16"|"F16", overwrite = false, files = {name = text},
 *                      expand_quantised = false}]) -> dir
 *       opts.files: more *.json files (tokenizer.json, ...) written with the weights, published with them
 *       opts.expand_quantised: write loaded-FP8/FP4 tensors in dtype too (else kept quantised while unchanged)
 *   ds4.checkpoints.save(root, step, model [, opts]) -> path of ROOT/step_NNNNNN
 *       a model with LoRA adapters: adapter_config.json + adapter_model.safetensors (PEFT, F32) beside the weights
 *       opts.extra = {name = tensor}, opts.meta = {JSON-able table}  -> extra.safetensors / extra.json
 *       opts.states = {name = {tensors = {...}, meta = {...}}}         -> <name>.safetensors / <name>.json
 *       opts.dtype, opts.files (as model:save), and opts.keep_last / keep_every / clean: prune after the commit
 *   ds4.checkpoints.load(root [, step]) -> dir, extra, meta, step   (nil when root has no complete checkpoint)
 *   ds4.checkpoints.list / latest / scan / check / prune / path / begin / commit / abort / write_state /
 *       read_state: the C API one to one (see the comment at the top of lua/ds4/init.lua).
 *
 * Metadata tables travel as JSON: Lua tables with string keys become objects (keys sorted, so the same table
 * gives the same bytes), tables with keys 1..n become arrays; JSON comes back through the core's strict parser.
 * Every malloc'd result of the C API is boxed in a userdata with __gc before anything can raise (ds4lua.h). */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"

/* The core's strict JSON parser (not part of the public API; the host links libds4 statically). */
#include "../core/json.h"

#define RES_MT "ds4.ckpt_resource"

/* ------------------------------------------------------------------------------------------------ boxes */

typedef enum { RES_MEM, RES_JSON, RES_ST } res_kind;

typedef struct res_box {
    res_kind kind;
    void *p;
    size_t len, cap; /* RES_MEM used as a growable buffer */
    int oom;
} res_box;

static int res_gc(lua_State *L) {
    res_box *b = lua_touserdata(L, 1);
    if (!b || !b->p) return 0;
    if (b->kind == RES_JSON) ds4_json_free(b->p);
    else if (b->kind == RES_ST) ds4_st_close(b->p);
    else free(b->p);
    b->p = NULL;
    return 0;
}

static res_box *push_res(lua_State *L, res_kind kind) {
    res_box *b = lua_newuserdata(L, sizeof *b);
    memset(b, 0, sizeof *b);
    b->kind = kind;
    luaL_getmetatable(L, RES_MT);
    lua_setmetatable(L, -2);
    return b;
}

static void release_res(res_box *b) {
    if (!b->p) return;
    if (b->kind == RES_JSON) ds4_json_free(b->p);
    else if (b->kind == RES_ST) ds4_st_close(b->p);
    else free(b->p);
    b->p = NULL;
}

static void buf_add(res_box *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
    memcpy((char *)b->p + b->len, s, n);
    b->len += n;
    ((char *)b->p)[b->len] = 0;
}

static void buf_str(res_box *b, const char *s) { buf_add(b, s, strlen(s)); }

/* ------------------------------------------------------------------------------------------------ arguments */

static const char *arg_string(lua_State *L, int idx, const char *fname, const char *what) {
    if (lua_type(L, idx) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #%d (%s string expected, got %s)", fname, idx, what, luaL_typename(L, idx));
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    if (strlen(s) != len) ds4l_raise(L, "%s: bad argument #%d (%s contains a NUL byte)", fname, idx, what);
    return s;
}

static int64_t to_count(lua_State *L, int idx, const char *fname, const char *what) {
    return ds4l_check_int(L, idx, fname, what, 0, DS4L_MAX_EXACT, "a non-negative integer");
}

/* opts.key as a count, or -1 when absent. */
static int64_t opt_count(lua_State *L, int opts, const char *key, const char *fname) {
    return ds4l_opt_int(L, opts, key, -1, 0, DS4L_MAX_EXACT, "a non-negative integer", fname);
}

static ds4_dtype opt_dtype(lua_State *L, int opts, const char *fname) {
    if (!opts) return DS4_F32;
    lua_getfield(L, opts, "dtype");
    ds4_dtype d = DS4_F32;
    if (!lua_isnil(L, -1)) {
        size_t len = 0;
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
        char up[8] = "";
        for (size_t i = 0; s && i < len && i + 1 < sizeof up; i++) up[i] = (char)toupper((unsigned char)s[i]);
        if (!s || len >= sizeof up || !ds4_dtype_from_name(up, len, &d) || (d != DS4_F32 && d != DS4_BF16 && d != DS4_F16))
            ds4l_raise(L, "%s: opts.dtype must be \"F32\", \"BF16\" or \"F16\", got %s", fname,
                       s ? s : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    return d;
}

/* opts.files = {name = string, ...} -> o->files / n_files, in a scratch userdata pushed on the stack (pointing into
 * the strings of opts.files, which the caller's opts keeps alive). The names are checked by the save itself. */
static void opt_files(lua_State *L, int opts, const char *fname, ds4_save_options *o) {
    size_t n = 0;
    if (opts) lua_getfield(L, opts, "files");
    else lua_pushnil(L);
    int files = lua_gettop(L);
    if (!lua_isnil(L, files) && !lua_istable(L, files))
        ds4l_raise(L, "%s: opts.files must be a table {name = text}, got %s", fname, luaL_typename(L, files));
    if (lua_istable(L, files)) {
        lua_pushnil(L);
        while (lua_next(L, files)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING)
                ds4l_raise(L, "%s: opts.files entries must be name = text (strings), got %s = %s", fname,
                           luaL_typename(L, -2), luaL_typename(L, -1));
            lua_pop(L, 1);
            n++;
        }
    }
    ds4_save_file *f = lua_newuserdata(L, (n ? n : 1) * sizeof *f);
    size_t k = 0;
    if (n) {
        lua_pushnil(L);
        while (lua_next(L, files)) {
            f[k].name = lua_tostring(L, -2);
            f[k].data = lua_tolstring(L, -1, &f[k].len);
            k++;
            lua_pop(L, 1);
        }
    }
    lua_remove(L, files);
    o->files = f;
    o->n_files = n;
}

/* ------------------------------------------------------------------------------------------------ tensors */

typedef struct named {
    const char *name;
    const ds4_tensor *t;
} named;

static int cmp_named(const void *a, const void *b) { return strcmp(((const named *)a)->name, ((const named *)b)->name); }

/* {name = tensor} at idx (nil: empty) -> sorted parallel arrays in a scratch userdata left on the stack. */
static size_t collect_tensors(lua_State *L, int idx, const char *fname, const char *what, const char ***names,
                              const ds4_tensor ***tensors) {
    size_t n = 0;
    if (!lua_isnil(L, idx)) {
        if (!lua_istable(L, idx))
            ds4l_raise(L, "%s: %s must be a table of name = tensor, got %s", fname, what, luaL_typename(L, idx));
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            if (lua_type(L, -2) != LUA_TSTRING)
                ds4l_raise(L, "%s: %s has a %s key; tensor names must be strings", fname, what, luaL_typename(L, -2));
            if (!ds4l_tensor_test(L, -1))
                ds4l_raise(L, "%s: %s.%s is a %s, expected a ds4.tensor", fname, what, lua_tostring(L, -2),
                           luaL_typename(L, -1));
            n++;
            lua_pop(L, 1);
        }
    }
    size_t bytes = (n ? n : 1) * (sizeof(named) + sizeof(const char *) + sizeof(const ds4_tensor *));
    named *items = lua_newuserdata(L, bytes);
    *names = (const char **)(items + n);
    *tensors = (const ds4_tensor **)(*names + n);
    size_t i = 0;
    if (n) {
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            items[i].name = lua_tostring(L, -2); /* anchored by the table */
            items[i].t = ds4l_tensor_test(L, -1);
            i++;
            lua_pop(L, 1);
        }
        qsort(items, n, sizeof *items, cmp_named);
    }
    for (i = 0; i < n; i++) {
        (*names)[i] = items[i].name;
        (*tensors)[i] = items[i].t;
    }
    return n;
}

/* A new table {name = tensor} with copies of every entry of f. */
static void push_st_tensors(lua_State *L, const ds4_st_file *f, const char *fname) {
    size_t n = ds4_st_count(f);
    lua_createtable(L, 0, n > 1000000 ? 0 : (int)n);
    int tbl = lua_gettop(L);
    for (size_t i = 0; i < n; i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        ds4_tensor *t = ds4l_tensor_push_new(L, fname, e->dtype, e->ndim, e->shape);
        if (t->nbytes != e->nbytes)
            ds4l_raise(L, "%s: tensor %s: %zu bytes in the file, %zu expected", fname, e->name, e->nbytes, t->nbytes);
        if (e->nbytes) memcpy(t->data, e->data, e->nbytes);
        lua_setfield(L, tbl, e->name);
    }
}

/* ------------------------------------------------------------------------------------------------ JSON */

static void json_string(res_box *b, const char *s, size_t n) {
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            buf_add(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            buf_add(b, esc, 6);
        } else {
            buf_add(b, (const char *)&s[i], 1);
        }
    }
    buf_add(b, "\"", 1);
}

static int cmp_cstr(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* Encode the value at idx. `path` names it in errors ("opts.meta.lr"). */
static void json_encode(lua_State *L, int idx, res_box *b, int depth, const char *fname, const char *path) {
    if (depth > 64) ds4l_raise(L, "%s: %s nests deeper than 64 levels (a cycle?)", fname, path);
    luaL_checkstack(L, 6, "json_encode");
    switch (lua_type(L, idx)) {
    case LUA_TNIL: buf_str(b, "null"); return;
    case LUA_TBOOLEAN: buf_str(b, lua_toboolean(L, idx) ? "true" : "false"); return;
    case LUA_TNUMBER: {
        double v = lua_tonumber(L, idx);
        char num[40];
        if (!isfinite(v)) ds4l_raise(L, "%s: %s is %g, which JSON cannot hold", fname, path, v);
        if (v == floor(v) && fabs(v) < 9007199254740992.0) snprintf(num, sizeof num, "%.0f", v);
        else snprintf(num, sizeof num, "%.17g", v);
        buf_str(b, num);
        return;
    }
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        json_string(b, s, n);
        return;
    }
    case LUA_TTABLE: break;
    default:
        ds4l_raise(L, "%s: %s is a %s; metadata holds only nil, booleans, numbers, strings and tables (tensors go "
                      "into extra)", fname, path, luaL_typename(L, idx));
    }
    /* array (keys exactly 1..n) or object (string keys only) */
    size_t n_str = 0, n_int = 0;
    lua_Number max_int = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) == LUA_TSTRING) n_str++;
        else if (lua_type(L, -1) == LUA_TNUMBER && lua_tonumber(L, -1) >= 1 &&
                 lua_tonumber(L, -1) == floor(lua_tonumber(L, -1))) {
            n_int++;
            if (lua_tonumber(L, -1) > max_int) max_int = lua_tonumber(L, -1);
        } else {
            ds4l_raise(L, "%s: %s has a %s key; JSON objects need string keys, arrays keys 1..n", fname, path,
                       luaL_typename(L, -1));
        }
    }
    if (n_str && n_int) ds4l_raise(L, "%s: %s mixes string and integer keys", fname, path);
    char sub[256];
    if (n_int) {
        if (max_int != (lua_Number)n_int) ds4l_raise(L, "%s: %s is an array with holes (keys up to %.0f, %zu of them)",
                                                     fname, path, max_int, n_int);
        buf_add(b, "[", 1);
        for (size_t i = 1; i <= n_int; i++) {
            if (i > 1) buf_add(b, ",", 1);
            lua_rawgeti(L, idx, (int)i);
            snprintf(sub, sizeof sub, "%s[%zu]", path, i);
            json_encode(L, lua_gettop(L), b, depth + 1, fname, sub);
            lua_pop(L, 1);
        }
        buf_add(b, "]", 1);
        return;
    }
    /* keys sorted: the same table always gives the same text */
    const char **keys = lua_newuserdata(L, (n_str ? n_str : 1) * sizeof *keys);
    int keys_idx = lua_gettop(L);
    size_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        keys[k++] = lua_tostring(L, -1); /* anchored by the table */
    }
    qsort(keys, n_str, sizeof *keys, cmp_cstr);
    buf_add(b, "{", 1);
    for (size_t i = 0; i < n_str; i++) {
        if (i) buf_add(b, ",", 1);
        json_string(b, keys[i], strlen(keys[i]));
        buf_add(b, ":", 1);
        lua_getfield(L, idx, keys[i]);
        snprintf(sub, sizeof sub, "%s.%s", path, keys[i]);
        json_encode(L, lua_gettop(L), b, depth + 1, fname, sub);
        lua_pop(L, 1);
    }
    buf_add(b, "}", 1);
    lua_remove(L, keys_idx);
}

/* Metadata table at idx (nil: "{}") -> JSON text in a buffer box left on the stack. */
static const char *encode_meta(lua_State *L, int idx, const char *fname, const char *path) {
    res_box *b = push_res(L, RES_MEM);
    if (lua_isnil(L, idx)) {
        buf_str(b, "{}");
    } else {
        if (!lua_istable(L, idx)) ds4l_raise(L, "%s: %s must be a table, got %s", fname, path, luaL_typename(L, idx));
        json_encode(L, idx, b, 0, fname, path);
    }
    if (b->oom) ds4l_raise(L, "%s: %s: out of memory encoding JSON", fname, path);
    return b->p;
}

static void push_json(lua_State *L, const ds4_json *v, int depth) {
    luaL_checkstack(L, 4, "push_json");
    switch (v->type) {
    case DS4_JSON_NULL: lua_pushnil(L); return;
    case DS4_JSON_BOOL: lua_pushboolean(L, v->boolean); return;
    case DS4_JSON_NUMBER: lua_pushnumber(L, v->is_int ? (lua_Number)v->integer : v->number); return;
    case DS4_JSON_STRING: lua_pushlstring(L, v->str, v->str_len); return;
    case DS4_JSON_ARRAY:
        lua_createtable(L, v->count > 1000000 ? 0 : (int)v->count, 0);
        for (size_t i = 0; i < v->count; i++) {
            push_json(L, &v->items[i], depth + 1);
            lua_rawseti(L, -2, (int)i + 1); /* null leaves a hole */
        }
        return;
    case DS4_JSON_OBJECT:
        lua_createtable(L, 0, v->count > 1000000 ? 0 : (int)v->count);
        for (size_t i = 0; i < v->count; i++) {
            push_json(L, &v->items[i], depth + 1);
            lua_setfield(L, -2, v->keys[i]);
        }
        return;
    }
    lua_pushnil(L);
}

/* Decode JSON text into a Lua value pushed on the stack. */
static void push_decoded(lua_State *L, const char *text, const char *fname, const char *what) {
    res_box *b = push_res(L, RES_JSON);
    int box = lua_gettop(L);
    ds4_error err = {0};
    b->p = ds4_json_parse(text, strlen(text), NULL, &err);
    if (!b->p) ds4l_raise(L, "%s: %s: %s", fname, what, err.msg);
    push_json(L, b->p, 0);
    release_res(b);
    lua_remove(L, box);
}

/* ------------------------------------------------------------------------------------------------ model:save */

static int m_save(lua_State *L) {
    const char *fname = "ds4.model:save";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    const char *dir = arg_string(L, 2, fname, "directory");
    int opts = ds4l_opt_table(L, 3, fname, 2);
    static const char *const known[] = {"dtype", "overwrite", "files", "expand_quantised", NULL};
    ds4l_check_keys(L, opts, fname, known);
    ds4_save_options o = {.dtype = opt_dtype(L, opts, fname), .overwrite = ds4l_opt_bool(L, opts, "overwrite", 0, fname),
                          .expand_quantised = ds4l_opt_bool(L, opts, "expand_quantised", 0, fname)};
    opt_files(L, opts, fname, &o);
    ds4_error err = {0};
    if (ds4_model_save_opts(m, dir, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_pushvalue(L, 2);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ checkpoints */

/* Push "ROOT/step_NNNNNN" (only the string). */
static void push_step_path(lua_State *L, const char *fname, const char *root, int64_t step) {
    size_t cap = strlen(root) + 40;
    char *buf = lua_newuserdata(L, cap);
    if (!ds4_ckpt_step_path(root, step, buf, cap)) ds4l_raise(L, "%s: step %lld", fname, (long long)step);
    lua_pushstring(L, buf);
    lua_remove(L, -2);
}

static int c_path(lua_State *L) {
    const char *fname = "ds4.checkpoints.path";
    const char *root = arg_string(L, 1, fname, "root");
    push_step_path(L, fname, root, to_count(L, 2, fname, "step"));
    return 1;
}

static int c_begin(lua_State *L) {
    const char *fname = "ds4.checkpoints.begin";
    const char *root = arg_string(L, 1, fname, "root");
    int64_t step = to_count(L, 2, fname, "step");
    res_box *b = push_res(L, RES_MEM);
    ds4_error err = {0};
    char *tmp = NULL;
    if (ds4_ckpt_begin(root, step, &tmp, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    b->p = tmp;
    lua_pushstring(L, tmp);
    release_res(b);
    return 1;
}

static int c_commit(lua_State *L) {
    const char *fname = "ds4.checkpoints.commit";
    const char *root = arg_string(L, 1, fname, "root");
    int64_t step = to_count(L, 2, fname, "step");
    const char *tmp = arg_string(L, 3, fname, "temporary directory");
    ds4_error err = {0};
    if (ds4_ckpt_commit(root, step, tmp, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    push_step_path(L, fname, root, step);
    return 1;
}

static int c_abort(lua_State *L) {
    const char *fname = "ds4.checkpoints.abort";
    const char *tmp = arg_string(L, 1, fname, "temporary directory");
    ds4_error err = {0};
    if (ds4_ckpt_abort(tmp, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* check(dir [, {sizes_only = true}]) -> step, or nil + reason */
static int c_check(lua_State *L) {
    const char *fname = "ds4.checkpoints.check";
    const char *dir = arg_string(L, 1, fname, "directory");
    int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"sizes_only", NULL};
    ds4l_check_keys(L, opts, fname, known);
    ds4_ckpt_verify how = ds4l_opt_bool(L, opts, "sizes_only", 0, fname) ? DS4_CKPT_VERIFY_SIZES : DS4_CKPT_VERIFY_FULL;
    ds4_error err = {0};
    int64_t step = 0;
    ds4_status s = ds4_ckpt_check(dir, how, &step, &err);
    if (s == DS4_OK) {
        lua_pushnumber(L, (lua_Number)step);
        return 1;
    }
    if (s != DS4_ERR_FORMAT && s != DS4_ERR_NOT_FOUND) ds4l_raise_ds4(L, fname, &err);
    lua_pushnil(L);
    lua_pushstring(L, err.msg);
    return 2;
}

static int c_list(lua_State *L) {
    const char *fname = "ds4.checkpoints.list";
    const char *root = arg_string(L, 1, fname, "root");
    res_box *b = push_res(L, RES_MEM);
    ds4_error err = {0};
    int64_t *steps = NULL;
    size_t n = 0;
    if (ds4_ckpt_list(root, &steps, &n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    b->p = steps;
    lua_createtable(L, n > 1000000 ? 0 : (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_pushnumber(L, (lua_Number)steps[i]);
        lua_rawseti(L, -2, (int)i + 1);
    }
    release_res(b);
    return 1;
}

static int c_latest(lua_State *L) {
    const char *fname = "ds4.checkpoints.latest";
    const char *root = arg_string(L, 1, fname, "root");
    ds4_error err = {0};
    int64_t step = 0;
    ds4_status s = ds4_ckpt_latest(root, &step, &err);
    if (s == DS4_ERR_NOT_FOUND) return 0;
    if (s) ds4l_raise_ds4(L, fname, &err);
    lua_pushnumber(L, (lua_Number)step);
    return 1;
}

static int c_scan(lua_State *L) {
    const char *fname = "ds4.checkpoints.scan";
    const char *root = arg_string(L, 1, fname, "root");
    int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"sizes_only", NULL};
    ds4l_check_keys(L, opts, fname, known);
    ds4_ckpt_verify how = ds4l_opt_bool(L, opts, "sizes_only", 0, fname) ? DS4_CKPT_VERIFY_SIZES : DS4_CKPT_VERIFY_FULL;
    res_box *b = push_res(L, RES_MEM);
    ds4_error err = {0};
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    if (ds4_ckpt_scan(root, how, &en, &n, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    b->p = en;
    static const char *const kinds[] = {"complete", "incomplete", "active", "stale"};
    lua_createtable(L, n > 1000000 ? 0 : (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_createtable(L, 0, 5);
        ds4l_set_str(L, "name", en[i].name);
        ds4l_set_int(L, "step", en[i].step);
        ds4l_set_str(L, "kind", kinds[en[i].kind]);
        if (en[i].pid) {
            ds4l_set_int(L, "pid", en[i].pid);
        }
        if (en[i].reason[0]) {
            ds4l_set_str(L, "reason", en[i].reason);
        }
        lua_rawseti(L, -2, (int)i + 1);
    }
    release_res(b);
    return 1;
}

/* prune(root, {keep_last, keep_every, clean, dry_run}) -> {removed = {steps}, kept, cleaned, left} */
static void push_prune(lua_State *L, const char *fname, const char *root, const ds4_ckpt_prune_options *po) {
    res_box *b = push_res(L, RES_MEM);
    int box = lua_gettop(L);
    ds4_error err = {0};
    ds4_ckpt_prune_result r;
    if (ds4_ckpt_prune(root, po, &r, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    b->p = r.removed;
    lua_createtable(L, 0, 4);
    lua_createtable(L, r.n_removed > 1000000 ? 0 : (int)r.n_removed, 0);
    for (size_t i = 0; i < r.n_removed; i++) {
        lua_pushnumber(L, (lua_Number)r.removed[i]);
        lua_rawseti(L, -2, (int)i + 1);
    }
    lua_setfield(L, -2, "removed");
    ds4l_set_int(L, "kept", r.n_kept);
    ds4l_set_int(L, "cleaned", r.n_cleaned);
    ds4l_set_int(L, "left", r.n_left);
    release_res(b);
    lua_remove(L, box);
}

static void prune_opts(lua_State *L, int opts, const char *fname, ds4_ckpt_prune_options *po) {
    memset(po, 0, sizeof *po);
    int64_t k = opt_count(L, opts, "keep_last", fname), e = opt_count(L, opts, "keep_every", fname);
    po->keep_last = k < 0 ? 0 : k;
    po->keep_every = e < 0 ? 0 : e;
    po->clean_stale = ds4l_opt_bool(L, opts, "clean", 0, fname);
}

static int c_prune(lua_State *L) {
    const char *fname = "ds4.checkpoints.prune";
    const char *root = arg_string(L, 1, fname, "root");
    int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"keep_last", "keep_every", "clean", "dry_run", NULL};
    ds4l_check_keys(L, opts, fname, known);
    ds4_ckpt_prune_options po;
    prune_opts(L, opts, fname, &po);
    po.dry_run = ds4l_opt_bool(L, opts, "dry_run", 0, fname);
    push_prune(L, fname, root, &po);
    return 1;
}

/* write_state(dir, name, tensors, meta) */
static void write_state(lua_State *L, const char *fname, const char *dir, const char *name, int tensors_idx,
                        int meta_idx, const char *tensors_path, const char *meta_path) {
    const char **names;
    const ds4_tensor **ts;
    size_t n = collect_tensors(L, tensors_idx, fname, tensors_path, &names, &ts);
    const char *meta = encode_meta(L, meta_idx, fname, meta_path);
    ds4_error err = {0};
    if (ds4_ckpt_write_state(dir, name, n, names, ts, meta, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_pop(L, 2);
}

static int c_write_state(lua_State *L) {
    const char *fname = "ds4.checkpoints.write_state";
    const char *dir = arg_string(L, 1, fname, "directory");
    const char *name = arg_string(L, 2, fname, "state name");
    lua_settop(L, 4);
    write_state(L, fname, dir, name, 3, 4, "tensors", "meta");
    return 0;
}

/* read_state(dir, name) -> tensors, meta; nil when the state was never written */
static int read_state(lua_State *L, const char *fname, const char *dir, const char *name) {
    res_box *st = push_res(L, RES_ST), *meta = push_res(L, RES_MEM);
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    char *text = NULL;
    ds4_status s = ds4_ckpt_read_state(dir, name, &f, &text, &err);
    st->p = f;
    meta->p = text;
    if (s == DS4_ERR_NOT_FOUND) return 0;
    if (s) ds4l_raise_ds4(L, fname, &err);
    push_st_tensors(L, f, fname);
    char what[200];
    snprintf(what, sizeof what, "%s/%s.json", dir, name);
    push_decoded(L, text, fname, what);
    release_res(st);
    release_res(meta);
    return 2;
}

static int c_read_state(lua_State *L) {
    const char *fname = "ds4.checkpoints.read_state";
    const char *dir = arg_string(L, 1, fname, "directory");
    const char *name = arg_string(L, 2, fname, "state name");
    return read_state(L, fname, dir, name);
}

/* The part of save that may raise after the temporary directory exists: run under lua_pcall so that the
 * directory is removed whatever fails. Arguments: model, opts (or nil), tmp path, dtype. */
static int save_work(lua_State *L) {
    const char *fname = "ds4.checkpoints.save";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    const char *tmp = lua_tostring(L, 3);
    ds4_save_options o = {.dtype = (ds4_dtype)lua_tointeger(L, 4)};
    opt_files(L, lua_istable(L, 2) ? 2 : 0, fname, &o);
    ds4_error err = {0};
    if (ds4_model_write_files(m, tmp, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    /* the adapters beside the frozen weights, always F32 (a resume restores them bitwise) */
    if (ds4_model_has_lora(m) && ds4_model_lora_write_files(m, tmp, NULL, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (lua_isnil(L, 2)) return 0;
    lua_getfield(L, 2, "extra");
    int extra = lua_gettop(L);
    lua_getfield(L, 2, "meta");
    int meta = lua_gettop(L);
    if (!lua_isnil(L, extra) || !lua_isnil(L, meta)) write_state(L, fname, tmp, "extra", extra, meta, "opts.extra", "opts.meta");
    lua_getfield(L, 2, "states");
    int states = lua_gettop(L);
    if (!lua_isnil(L, states)) {
        if (!lua_istable(L, states))
            ds4l_raise(L, "%s: opts.states must be a table of name = {tensors = ..., meta = ...}, got %s", fname,
                       luaL_typename(L, states));
        lua_pushnil(L);
        while (lua_next(L, states)) {
            if (lua_type(L, -2) != LUA_TSTRING || !lua_istable(L, -1))
                ds4l_raise(L, "%s: opts.states entries must be name = {tensors = ..., meta = ...}", fname);
            const char *name = lua_tostring(L, -2);
            if (!strcmp(name, "extra")) ds4l_raise(L, "%s: opts.states.extra: use opts.extra / opts.meta", fname);
            int ent = lua_gettop(L);
            lua_getfield(L, ent, "tensors");
            lua_getfield(L, ent, "meta");
            char tpath[128], mpath[128];
            snprintf(tpath, sizeof tpath, "opts.states.%.64s.tensors", name);
            snprintf(mpath, sizeof mpath, "opts.states.%.64s.meta", name);
            write_state(L, fname, tmp, name, ent + 1, ent + 2, tpath, mpath);
            lua_settop(L, ent - 1);
        }
    }
    return 0;
}

static int c_save(lua_State *L) {
    const char *fname = "ds4.checkpoints.save";
    const char *root = arg_string(L, 1, fname, "root");
    int64_t step = to_count(L, 2, fname, "step");
    ds4l_model_check(L, 3, fname);
    int opts = ds4l_opt_table(L, 4, fname, 4);
    static const char *const known[] = {"extra", "meta", "states", "dtype", "keep_last", "keep_every", "clean",
                                        "files", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 4);
    ds4_dtype dtype = opt_dtype(L, opts, fname);
    ds4_ckpt_prune_options po;
    prune_opts(L, opts, fname, &po);
    int prune = opts && (opt_count(L, opts, "keep_last", fname) >= 0 || opt_count(L, opts, "keep_every", fname) >= 0 ||
                         po.clean_stale);

    res_box *b = push_res(L, RES_MEM);
    ds4_error err = {0};
    char *tmp = NULL;
    if (ds4_ckpt_begin(root, step, &tmp, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    b->p = tmp;
    lua_pushstring(L, tmp); /* slot 6 */
    release_res(b);
    const int tmp_idx = 6;
    lua_pushcfunction(L, save_work);
    lua_pushvalue(L, 3);
    lua_pushvalue(L, 4);
    lua_pushvalue(L, tmp_idx);
    lua_pushinteger(L, (lua_Integer)dtype);
    if (lua_pcall(L, 4, 0, 0) != 0) {
        ds4_ckpt_abort(lua_tostring(L, tmp_idx), NULL); /* the error in flight is the one to report */
        lua_error(L);
    }
    if (ds4_ckpt_commit(root, step, lua_tostring(L, tmp_idx), &err) != DS4_OK) {
        ds4_ckpt_abort(lua_tostring(L, tmp_idx), NULL);
        ds4l_raise_ds4(L, fname, &err);
    }
    if (prune) {
        char msg[128];
        snprintf(msg, sizeof msg, "%s (step %lld was saved; pruning failed)", fname, (long long)step);
        push_prune(L, msg, root, &po);
        lua_pop(L, 1);
    }
    push_step_path(L, fname, root, step);
    return 1;
}

/* load(root [, step]) -> dir, extra, meta, step (nil when there is no complete checkpoint and no step given) */
static int c_load(lua_State *L) {
    const char *fname = "ds4.checkpoints.load";
    const char *root = arg_string(L, 1, fname, "root");
    ds4_error err = {0};
    int64_t step;
    const int explicit_step = !lua_isnoneornil(L, 2);
    if (!explicit_step) {
        ds4_status s = ds4_ckpt_latest(root, &step, &err);
        if (s == DS4_ERR_NOT_FOUND) return 0;
        if (s) ds4l_raise_ds4(L, fname, &err);
    } else {
        step = to_count(L, 2, fname, "step");
    }
    lua_settop(L, 1);
    push_step_path(L, fname, root, step); /* slot 2 */
    const char *dir = lua_tostring(L, 2);
    /* ds4_ckpt_latest verified its pick fully; an explicit step is verified here */
    if (explicit_step && ds4_ckpt_check(dir, DS4_CKPT_VERIFY_FULL, NULL, &err) != DS4_OK)
        ds4l_raise_ds4(L, fname, &err);
    int base = lua_gettop(L);
    if (read_state(L, fname, dir, "extra") == 0) {
        lua_settop(L, base);
        lua_newtable(L);
        lua_newtable(L);
    } else {
        /* read_state left its two boxes below the results */
        lua_remove(L, base + 1);
        lua_remove(L, base + 1);
    }
    lua_pushnumber(L, (lua_Number)step);
    return 4;
}

static const luaL_Reg ckpt_functions[] = {
    {"path", c_path},     {"begin", c_begin},           {"commit", c_commit},         {"abort", c_abort},
    {"check", c_check},   {"list", c_list},             {"latest", c_latest},         {"scan", c_scan},
    {"prune", c_prune},   {"write_state", c_write_state}, {"read_state", c_read_state}, {"save", c_save},
    {"load", c_load},     {NULL, NULL},
};

void ds4l_save_open(lua_State *L) {
    int mod = lua_gettop(L);
    luaL_newmetatable(L, RES_MT);
    lua_pushcfunction(L, res_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    lua_getfield(L, mod, "model_methods");
    if (lua_istable(L, -1)) {
        lua_pushcfunction(L, m_save);
        lua_setfield(L, -2, "save");
    }
    lua_pop(L, 1);
    lua_newtable(L);
    for (const luaL_Reg *r = ckpt_functions; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_setfield(L, mod, "checkpoints");
    lua_settop(L, mod);
}
