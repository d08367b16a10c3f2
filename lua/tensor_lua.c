/* tensor_lua.c — the ds4.tensor userdata and the safetensors functions of the ds4.core module.
 *
 * A Lua tensor is a full userdata holding one reference to a host ds4_tensor; __gc drops it. Element values
 * cross the boundary as Lua numbers (doubles) through ds4_tensor_get / ds4_tensor_set, so every rounding
 * rule (BF16/F16 round-to-nearest-even, F8 decoding) lives in the C core and nowhere here. Indices are
 * 1-based on the Lua side, as in every Lua API; they are checked before they reach C. */
#define _POSIX_C_SOURCE 200809L /* stat */
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ds4lua.h"

#define STFILE_MT "ds4.stfile"
#define CKPT_MT "ds4.checkpoint"

/* ------------------------------------------------------------------------------------------------ helpers */

ds4l_tensor *ds4l_tensor_push_box(lua_State *L) {
    ds4l_tensor *box = lua_newuserdata(L, sizeof *box);
    box->t = NULL;
    luaL_getmetatable(L, DS4L_TENSOR_MT);
    lua_setmetatable(L, -2);
    return box;
}

ds4_tensor *ds4l_tensor_push_new(lua_State *L, const char *fname, ds4_dtype dtype, int32_t ndim,
                                 const int64_t *shape) {
    ds4l_tensor *box = ds4l_tensor_push_box(L);
    ds4_error err = {0};
    if (ds4_tensor_new(dtype, ndim, shape, &box->t, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    /* The collector sees only the small box, not the tensor's bytes, so a loop making big tensors (logits
     * every step) would pile up garbage. Pay a GC step as if the bytes were Lua's own (torch7 did the same
     * with its heap tracker). Every tensor in use is anchored on the stack or in a table, so finalizers that
     * run here cannot free anything a caller still points into. */
    if (box->t->nbytes >= ((size_t)1 << 20)) {
        size_t kb = box->t->nbytes >> 10;
        lua_gc(L, LUA_GCSTEP, kb > (size_t)INT32_MAX ? INT32_MAX : (int)kb);
    }
    return box->t;
}

ds4_tensor *ds4l_tensor_test(lua_State *L, int idx) {
    ds4l_tensor *box = lua_touserdata(L, idx);
    if (!box || !lua_getmetatable(L, idx)) return NULL;
    luaL_getmetatable(L, DS4L_TENSOR_MT);
    int same = lua_rawequal(L, -1, -2);
    lua_pop(L, 2);
    return same ? box->t : NULL;
}

ds4_tensor *ds4l_tensor_check(lua_State *L, int idx, const char *fname, int argn) {
    ds4_tensor *t = ds4l_tensor_test(L, idx);
    if (!t)
        ds4l_raise(L, "%s: bad argument #%d (ds4.tensor expected, got %s)", fname, argn,
                   luaL_typename(L, idx));
    return t;
}

ds4_dtype ds4l_check_dtype(lua_State *L, int idx, const char *fname, int argn, int has_def, ds4_dtype def) {
    if (has_def && lua_isnoneornil(L, idx)) return def;
    if (lua_type(L, idx) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #%d (dtype name expected, got %s)", fname, argn, luaL_typename(L, idx));
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    char up[32];
    ds4_dtype d;
    if (len < sizeof up) {
        for (size_t i = 0; i < len; i++) up[i] = (char)toupper((unsigned char)s[i]);
        up[len] = 0;
        if (ds4_dtype_from_name(up, len, &d)) return d;
    }
    ds4l_raise(L,
               "%s: bad argument #%d (unknown dtype '%s'; expected F32, F16, BF16, F64, I64, I32, I16, I8, U8, "
               "BOOL, F8_E4M3, F8_E5M2 or F8_E8M0)",
               fname, argn, s);
}

static ds4_tensor *self_tensor(lua_State *L, const char *fname) {
    ds4_tensor *t = ds4l_tensor_test(L, 1);
    if (!t)
        ds4l_raise(L, "%s: self must be a ds4.tensor (got %s); call it as t:method(...)", fname,
                   luaL_typename(L, 1));
    return t;
}

/* Read a shape table {d1, d2, ...} of non-negative integers into shape; returns ndim. */
static int32_t check_shape_table(lua_State *L, int idx, const char *fname, int argn, int64_t *shape) {
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: bad argument #%d (shape table expected, got %s)", fname, argn, luaL_typename(L, idx));
    size_t n = lua_objlen(L, idx);
    if (n > DS4_MAX_DIMS)
        ds4l_raise(L, "%s: bad argument #%d (shape has %zu dimensions; at most %d are supported)", fname, argn, n,
                   DS4_MAX_DIMS);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, (int)i + 1);
        int64_t d;
        if (lua_type(L, -1) != LUA_TNUMBER || !ds4l_number_to_i64(lua_tonumber(L, -1), &d) || d < 0)
            ds4l_raise(L, "%s: bad argument #%d (shape[%zu] must be a non-negative integer, got %s %s)", fname,
                       argn, i + 1, luaL_typename(L, -1), lua_isnumber(L, -1) ? lua_tostring(L, -1) : "");
        lua_pop(L, 1);
        shape[i] = d;
    }
    return (int32_t)n;
}

/* Flat (row-major) offset of the 1-based per-dimension indices at stack slots first..first+ndim-1. */
static int64_t check_indices(lua_State *L, const ds4_tensor *t, int first, const char *fname) {
    int given = lua_gettop(L) - first + 1;
    char sh[256];
    if (given != t->ndim) {
        ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
        ds4l_raise(L, "%s: %d indices given for a tensor of shape %s (%d dimensions)", fname, given < 0 ? 0 : given,
                   sh, (int)t->ndim);
    }
    int64_t flat = 0;
    for (int32_t d = 0; d < t->ndim; d++) {
        int slot = first + d;
        int64_t i;
        if (lua_type(L, slot) != LUA_TNUMBER || !ds4l_number_to_i64(lua_tonumber(L, slot), &i) || i < 1 ||
            i > t->shape[d]) {
            ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
            if (lua_type(L, slot) == LUA_TNUMBER)
                ds4l_raise(L, "%s: index %d is %s, outside 1..%lld for shape %s", fname, (int)d + 1,
                           lua_tostring(L, slot), (long long)t->shape[d], sh);
            ds4l_raise(L, "%s: index %d must be an integer, got %s (shape %s)", fname, (int)d + 1,
                       luaL_typename(L, slot), sh);
        }
        flat = flat * t->shape[d] + (i - 1);
    }
    return flat;
}

/* ------------------------------------------------------------------------------------------------ methods */

static int t_shape(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:shape");
    lua_createtable(L, t->ndim, 0);
    for (int32_t d = 0; d < t->ndim; d++) {
        lua_pushnumber(L, (lua_Number)t->shape[d]);
        lua_rawseti(L, -2, (int)d + 1);
    }
    return 1;
}

static int t_dtype(lua_State *L) {
    lua_pushstring(L, ds4_dtype_name(self_tensor(L, "ds4.tensor:dtype")->dtype));
    return 1;
}

static int t_numel(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_tensor_numel(self_tensor(L, "ds4.tensor:numel")));
    return 1;
}

static int t_ndim(lua_State *L) {
    lua_pushinteger(L, self_tensor(L, "ds4.tensor:ndim")->ndim);
    return 1;
}

static int t_nbytes(lua_State *L) {
    lua_pushnumber(L, (lua_Number)self_tensor(L, "ds4.tensor:nbytes")->nbytes);
    return 1;
}

static int t_get(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:get");
    lua_pushnumber(L, ds4_tensor_get(t, check_indices(L, t, 2, "ds4.tensor:get")));
    return 1;
}

static int t_set(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:set");
    if (lua_type(L, 2) != LUA_TNUMBER)
        ds4l_raise(L, "ds4.tensor:set: bad argument #1 (number expected, got %s); usage t:set(value, i1, i2, ...)",
                   luaL_typename(L, 2));
    lua_Number v = lua_tonumber(L, 2);
    ds4_tensor_set(t, check_indices(L, t, 3, "ds4.tensor:set"), v);
    return 0;
}

static int t_item(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:item");
    if (ds4_tensor_numel(t) != 1) {
        char sh[256];
        ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
        ds4l_raise(L, "ds4.tensor:item: the tensor has shape %s (%lld elements); item() needs exactly one", sh,
                   (long long)ds4_tensor_numel(t));
    }
    lua_pushnumber(L, ds4_tensor_get(t, 0));
    return 1;
}

static void push_nested(lua_State *L, const ds4_tensor *t, int32_t depth, int64_t *flat) {
    int64_t n = t->shape[depth];
    lua_createtable(L, n > INT32_MAX ? 0 : (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
        if (depth + 1 == t->ndim) {
            lua_pushnumber(L, ds4_tensor_get(t, (*flat)++));
        } else {
            luaL_checkstack(L, 4, "ds4.tensor:totable");
            push_nested(L, t, depth + 1, flat);
        }
        lua_rawseti(L, -2, (int)(i + 1));
    }
}

static int t_totable(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:totable");
    if (ds4_tensor_numel(t) > INT32_MAX)
        ds4l_raise(L, "ds4.tensor:totable: %lld elements do not fit in Lua tables", (long long)ds4_tensor_numel(t));
    if (t->ndim == 0) {
        lua_pushnumber(L, ds4_tensor_get(t, 0));
        return 1;
    }
    int64_t flat = 0;
    push_nested(L, t, 0, &flat);
    return 1;
}

/* Copy src into a new tensor of dtype `to` (pushed). */
static ds4_tensor *push_converted(lua_State *L, const char *fname, const ds4_tensor *src, ds4_dtype to) {
    ds4_tensor *dst = ds4l_tensor_push_new(L, fname, to, src->ndim, src->shape);
    int64_t n = ds4_tensor_numel(src);
    if (to == src->dtype) {
        if (src->nbytes) memcpy(dst->data, src->data, src->nbytes);
    } else if (to == DS4_F32) {
        ds4_error err = {0};
        if (ds4_convert_to_f32(src->dtype, src->data, n, dst->data, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    } else {
        /* Through double, which holds every value of every dtype below 64 bits exactly; ds4_tensor_set rounds
         * once, to the destination format. */
        for (int64_t i = 0; i < n; i++) ds4_tensor_set(dst, i, ds4_tensor_get(src, i));
    }
    return dst;
}

static int t_to(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:to");
    ds4_dtype to = ds4l_check_dtype(L, 2, "ds4.tensor:to", 1, 0, DS4_F32);
    push_converted(L, "ds4.tensor:to", t, to);
    return 1;
}

static int t_clone(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:clone");
    push_converted(L, "ds4.tensor:clone", t, t->dtype);
    return 1;
}

static int t_reshape(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:reshape");
    int64_t shape[DS4_MAX_DIMS];
    int32_t nd = check_shape_table(L, 2, "ds4.tensor:reshape", 1, shape);
    /* Element count with overflow treated as a mismatch (no tensor can be that large). */
    int64_t n = 1;
    int overflow = 0;
    for (int32_t d = 0; d < nd; d++) {
        if (shape[d] != 0 && n > INT64_MAX / shape[d]) overflow = 1;
        else n *= shape[d];
    }
    if (overflow || n != ds4_tensor_numel(t)) {
        char a[256], b[256];
        ds4l_format_shape(a, sizeof a, t->ndim, t->shape);
        ds4l_format_shape(b, sizeof b, nd, shape);
        ds4l_raise(L, "ds4.tensor:reshape: cannot reshape %s (%lld elements) to %s", a,
                   (long long)ds4_tensor_numel(t), b);
    }
    ds4_tensor *dst = ds4l_tensor_push_new(L, "ds4.tensor:reshape", t->dtype, nd, shape);
    if (t->nbytes) memcpy(dst->data, t->data, t->nbytes);
    return 1;
}

static int t_data_ptr(lua_State *L) {
    /* Valid while this tensor object is alive: keep a reference to it next to the pointer. */
    lua_pushlightuserdata(L, self_tensor(L, "ds4.tensor:data_ptr")->data);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ metamethods */

static int t_gc(lua_State *L) {
    ds4l_tensor *box = lua_touserdata(L, 1);
    if (box && box->t) {
        ds4_tensor_release(box->t);
        box->t = NULL;
    }
    return 0;
}

static int t_tostring(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:__tostring");
    char sh[256];
    ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
    lua_pushfstring(L, "ds4.tensor %s %s", ds4_dtype_name(t->dtype), sh);
    return 1;
}

static int t_len(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:__len");
    lua_pushnumber(L, t->ndim > 0 ? (lua_Number)t->shape[0] : 0);
    return 1;
}

static int64_t check_flat(lua_State *L, const ds4_tensor *t, int slot, const char *what) {
    int64_t i, n = ds4_tensor_numel(t);
    if (!ds4l_number_to_i64(lua_tonumber(L, slot), &i) || i < 1 || i > n) {
        char sh[256];
        ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
        ds4l_raise(L, "ds4.tensor: flat %s index %s outside 1..%lld (shape %s)", what, lua_tostring(L, slot),
                   (long long)n, sh);
    }
    return i - 1;
}

/* t[i] with a number key reads element i (flat, 1-based); any other key looks up a method (upvalue 1). */
static int t_index(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:__index");
    if (lua_type(L, 2) == LUA_TNUMBER) {
        lua_pushnumber(L, ds4_tensor_get(t, check_flat(L, t, 2, "read")));
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1));
    return 1;
}

static int t_newindex(lua_State *L) {
    ds4_tensor *t = self_tensor(L, "ds4.tensor:__newindex");
    if (lua_type(L, 2) != LUA_TNUMBER)
        ds4l_raise(L, "ds4.tensor: cannot assign field '%s' (only numeric flat indices can be assigned)",
                   lua_isstring(L, 2) ? lua_tostring(L, 2) : luaL_typename(L, 2));
    if (lua_type(L, 3) != LUA_TNUMBER)
        ds4l_raise(L, "ds4.tensor: cannot store a %s into element %s (number expected)", luaL_typename(L, 3),
                   lua_tostring(L, 2));
    ds4_tensor_set(t, check_flat(L, t, 2, "write"), lua_tonumber(L, 3));
    return 0;
}

/* ------------------------------------------------------------------------------------------------ constructors */

/* Path like "[2][3]" of the 1-based positions path[0..depth-1]. */
static void format_pos(char *buf, size_t cap, const int64_t *path, int32_t depth) {
    size_t o = 0;
    buf[0] = 0;
    for (int32_t i = 0; i < depth && o < cap; i++) {
        int w = snprintf(buf + o, cap - o, "[%lld]", (long long)path[i]);
        if (w < 0) break;
        o += (size_t)w;
    }
}

/* Fill t from the nested table at stack index idx (depth `depth` of the shape), checking that every level
 * has the length inferred from the first elements and that leaves are numbers. */
static void fill_nested(lua_State *L, int idx, ds4_tensor *t, int32_t depth, int64_t *path, int64_t *flat) {
    char pos[256];
    size_t len = lua_objlen(L, idx);
    if ((int64_t)len != t->shape[depth]) {
        format_pos(pos, sizeof pos, path, depth);
        ds4l_raise(L, "ds4.tensor: ragged table: the table at %s has %zu elements, expected %lld",
                   depth ? pos : "the top level", len, (long long)t->shape[depth]);
    }
    luaL_checkstack(L, 4, "ds4.tensor");
    for (int64_t i = 0; i < t->shape[depth]; i++) {
        path[depth] = i + 1;
        lua_rawgeti(L, idx, (int)(i + 1));
        if (depth + 1 < t->ndim) {
            if (!lua_istable(L, -1)) {
                format_pos(pos, sizeof pos, path, depth + 1);
                ds4l_raise(L, "ds4.tensor: ragged table: element %s is a %s, expected a table of %lld elements",
                           pos, luaL_typename(L, -1), (long long)t->shape[depth + 1]);
            }
            fill_nested(L, lua_gettop(L), t, depth + 1, path, flat);
        } else {
            if (lua_type(L, -1) != LUA_TNUMBER) {
                format_pos(pos, sizeof pos, path, depth + 1);
                ds4l_raise(L, "ds4.tensor: %s element %s is a %s, expected a number",
                           lua_istable(L, -1) ? "ragged table:" : "bad value:", pos, luaL_typename(L, -1));
            }
            ds4_tensor_set(t, (*flat)++, lua_tonumber(L, -1));
        }
        lua_pop(L, 1);
    }
}

/* ds4.tensor(values [, dtype]): values is a number (0-d tensor), a nested table of numbers, or a tensor (a
 * converted copy). */
static int l_tensor(lua_State *L) {
    const char *fname = "ds4.tensor";
    ds4_tensor *src = ds4l_tensor_test(L, 1);
    if (src) {
        ds4_dtype to = ds4l_check_dtype(L, 2, fname, 2, 1, src->dtype);
        push_converted(L, fname, src, to);
        return 1;
    }
    ds4_dtype dtype = ds4l_check_dtype(L, 2, fname, 2, 1, DS4_F32);
    if (lua_type(L, 1) == LUA_TNUMBER) {
        ds4_tensor *t = ds4l_tensor_push_new(L, fname, dtype, 0, NULL);
        ds4_tensor_set(t, 0, lua_tonumber(L, 1));
        return 1;
    }
    if (!lua_istable(L, 1))
        ds4l_raise(L, "ds4.tensor: bad argument #1 (table, number or ds4.tensor expected, got %s)",
                   luaL_typename(L, 1));
    /* The shape comes from the first element of each level; fill_nested checks every other one. */
    int64_t shape[DS4_MAX_DIMS];
    int32_t nd = 0;
    lua_pushvalue(L, 1);
    for (;;) {
        if (nd == DS4_MAX_DIMS)
            ds4l_raise(L, "ds4.tensor: the table is nested deeper than %d levels", DS4_MAX_DIMS);
        size_t len = lua_objlen(L, -1);
        shape[nd++] = (int64_t)len;
        if (len == 0) break;
        lua_rawgeti(L, -1, 1);
        lua_remove(L, -2);
        if (!lua_istable(L, -1)) break;
    }
    lua_pop(L, 1);
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, dtype, nd, shape);
    int64_t path[DS4_MAX_DIMS] = {0}, flat = 0;
    fill_nested(L, 1, t, 0, path, &flat);
    return 1;
}

static int l_zeros(lua_State *L) {
    int64_t shape[DS4_MAX_DIMS];
    int32_t nd = check_shape_table(L, 1, "ds4.zeros", 1, shape);
    ds4_dtype dtype = ds4l_check_dtype(L, 2, "ds4.zeros", 2, 1, DS4_F32);
    ds4l_tensor_push_new(L, "ds4.zeros", dtype, nd, shape); /* ds4_tensor_new zero-fills */
    return 1;
}

static int l_is_tensor(lua_State *L) {
    lua_pushboolean(L, ds4l_tensor_test(L, 1) != NULL);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ safetensors */

/* Boxes for open files: a Lua error while copying tensors out must not leak the mapping. */
typedef struct stfile_box {
    ds4_st_file *f;
} stfile_box;
typedef struct ckpt_box {
    ds4_checkpoint *c;
} ckpt_box;

static int stfile_gc(lua_State *L) {
    stfile_box *b = lua_touserdata(L, 1);
    if (b && b->f) {
        ds4_st_close(b->f);
        b->f = NULL;
    }
    return 0;
}

static int ckpt_gc(lua_State *L) {
    ckpt_box *b = lua_touserdata(L, 1);
    if (b && b->c) {
        ds4_checkpoint_close(b->c);
        b->c = NULL;
    }
    return 0;
}

/* Copy one entry into a new tensor and store it as result[name] (result table at stack index tbl). */
static void copy_entry(lua_State *L, int tbl, const ds4_st_entry *e) {
    const char *fname = "ds4.load_tensors";
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, e->dtype, e->ndim, e->shape);
    if (t->nbytes != e->nbytes)
        ds4l_raise(L, "%s: tensor %s: %zu bytes in the file, %zu expected from its dtype and shape", fname, e->name,
                   e->nbytes, t->nbytes);
    if (e->nbytes) memcpy(t->data, e->data, e->nbytes);
    lua_setfield(L, tbl, e->name);
}

/* ds4.load_tensors(path) -> {name = tensor}: a .safetensors file, or a checkpoint directory (single file or
 * sharded with an index). Tensors are copies, independent of the file. */
static int l_load_tensors(lua_State *L) {
    const char *fname = "ds4.load_tensors";
    if (lua_type(L, 1) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (path string expected, got %s)", fname, luaL_typename(L, 1));
    const char *path = lua_tostring(L, 1);
    struct stat st;
    int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    ds4_error err = {0};
    if (is_dir) {
        ckpt_box *b = lua_newuserdata(L, sizeof *b);
        b->c = NULL;
        luaL_getmetatable(L, CKPT_MT);
        lua_setmetatable(L, -2);
        if (ds4_checkpoint_open(path, &b->c, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        size_t n = ds4_checkpoint_count(b->c);
        lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
        int tbl = lua_gettop(L);
        for (size_t i = 0; i < n; i++) copy_entry(L, tbl, ds4_checkpoint_entry_at(b->c, i));
        ds4_checkpoint_close(b->c);
        b->c = NULL;
    } else {
        stfile_box *b = lua_newuserdata(L, sizeof *b);
        b->f = NULL;
        luaL_getmetatable(L, STFILE_MT);
        lua_setmetatable(L, -2);
        if (ds4_st_open(path, &b->f, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        size_t n = ds4_st_count(b->f);
        lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
        int tbl = lua_gettop(L);
        for (size_t i = 0; i < n; i++) copy_entry(L, tbl, ds4_st_entry_at(b->f, i));
        ds4_st_close(b->f);
        b->f = NULL;
    }
    return 1;
}

typedef struct named_tensor {
    const char *name;
    const ds4_tensor *t;
} named_tensor;

static int cmp_named(const void *a, const void *b) {
    return strcmp(((const named_tensor *)a)->name, ((const named_tensor *)b)->name);
}

/* ds4.save_tensors(path, {name = tensor}): names sorted so the same table always gives the same bytes. */
static int l_save_tensors(lua_State *L) {
    const char *fname = "ds4.save_tensors";
    if (lua_type(L, 1) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (path string expected, got %s)", fname, luaL_typename(L, 1));
    if (!lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #2 (table of name = tensor expected, got %s)", fname, luaL_typename(L, 2));
    const char *path = lua_tostring(L, 1);
    size_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        int kt = lua_type(L, -2);
        if (kt == LUA_TNUMBER) {
            lua_pushvalue(L, -2); /* convert a copy: converting the key in place would confuse lua_next */
            ds4l_raise(L, "%s: key %s is a number; tensor names must be strings", fname, lua_tostring(L, -1));
        }
        if (kt != LUA_TSTRING)
            ds4l_raise(L, "%s: a key is a %s; tensor names must be strings", fname, lua_typename(L, kt));
        size_t klen;
        const char *k = lua_tolstring(L, -2, &klen);
        if (strlen(k) != klen) ds4l_raise(L, "%s: tensor name '%s...' contains a NUL byte", fname, k);
        if (!ds4l_tensor_test(L, -1))
            ds4l_raise(L, "%s: value for key '%s' is a %s, expected a ds4.tensor", fname, k, luaL_typename(L, -1));
        n++;
        lua_pop(L, 1);
    }
    /* Scratch arrays owned by Lua (collected if ds4_st_write fails and we raise). */
    size_t bytes = (n ? n : 1) * (sizeof(named_tensor) + sizeof(const char *) + sizeof(const ds4_tensor *));
    named_tensor *items = lua_newuserdata(L, bytes);
    const char **names = (const char **)(items + n);
    const ds4_tensor **tensors = (const ds4_tensor **)(names + n);
    size_t i = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        items[i].name = lua_tostring(L, -2); /* anchored by the table, which outlives this call */
        items[i].t = ds4l_tensor_test(L, -1);
        i++;
        lua_pop(L, 1);
    }
    if (n > 1) qsort(items, n, sizeof *items, cmp_named);
    for (i = 0; i < n; i++) {
        names[i] = items[i].name;
        tensors[i] = items[i].t;
    }
    ds4_error err = {0};
    if (ds4_st_write(path, n, names, tensors, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ registration */

static const luaL_Reg tensor_methods[] = {
    {"shape", t_shape},     {"dtype", t_dtype},     {"numel", t_numel},   {"ndim", t_ndim},
    {"nbytes", t_nbytes},   {"get", t_get},         {"set", t_set},       {"item", t_item},
    {"totable", t_totable}, {"to", t_to},           {"clone", t_clone},   {"reshape", t_reshape},
    {"data_ptr", t_data_ptr}, {NULL, NULL},
};

static const luaL_Reg tensor_functions[] = {
    {"tensor", l_tensor},
    {"zeros", l_zeros},
    {"is_tensor", l_is_tensor},
    {"load_tensors", l_load_tensors},
    {"save_tensors", l_save_tensors},
    {NULL, NULL},
};

void ds4l_tensor_open(lua_State *L) {
    int mod = lua_gettop(L);
    if (luaL_newmetatable(L, DS4L_TENSOR_MT)) {
        int mt = lua_gettop(L);
        lua_newtable(L); /* methods */
        for (const luaL_Reg *r = tensor_methods; r->name; r++) {
            lua_pushcfunction(L, r->func);
            lua_setfield(L, -2, r->name);
        }
        /* Exposed so ds4.lua can add pure-Lua methods. */
        lua_pushvalue(L, -1);
        lua_setfield(L, mod, "tensor_methods");
        lua_pushcclosure(L, t_index, 1);
        lua_setfield(L, mt, "__index");
        lua_pushcfunction(L, t_newindex);
        lua_setfield(L, mt, "__newindex");
        lua_pushcfunction(L, t_gc);
        lua_setfield(L, mt, "__gc");
        lua_pushcfunction(L, t_tostring);
        lua_setfield(L, mt, "__tostring");
        lua_pushcfunction(L, t_len);
        lua_setfield(L, mt, "__len");
        lua_pushliteral(L, DS4L_TENSOR_MT);
        lua_setfield(L, mt, "__name");
    } else {
        /* ds4.core required again in the same state: expose the existing methods table. */
        lua_getfield(L, -1, "__index");
        lua_getupvalue(L, -1, 1);
        lua_setfield(L, mod, "tensor_methods");
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    luaL_newmetatable(L, STFILE_MT);
    lua_pushcfunction(L, stfile_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    luaL_newmetatable(L, CKPT_MT);
    lua_pushcfunction(L, ckpt_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    for (const luaL_Reg *r = tensor_functions; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, mod, r->name);
    }
}
