/* tokenizer_lua.c — the tokenizer in the ds4.core module: ds4.tokenizer([path]) and its methods.
 *
 *   local tok = ds4.tokenizer(path)        tokenizer.json; ds4.tokenizer() is the built-in byte-level one
 *   ds4.tokenizer_from_json(text)          the same from tokenizer.json's text
 *   tok:encode(text [, {bos = true}])      -> Lua array of ids (no BOS unless asked)
 *   tok:decode(ids [, {skip_special = true}])   ids: Lua array or integer tensor -> string (exact bytes)
 *   tok:vocab_size()  tok:token_to_id(s)  tok:id_to_token(id)  tok:special(name)  tok:is_special(id)
 *   tok:to_json()                          the tokenizer.json text it was loaded from
 *
 * Ownership (see ds4lua.h): the tokenizer lives in a userdata box with __gc, pushed before loading; encode's id
 * array lives in a second boxed buffer while the Lua table is built, so an allocation error raised by Lua
 * leaks nothing. decode builds its string with a luaL_Buffer: no C allocation at all. */
#include <math.h>
#include <string.h>

#include "ds4lua.h"

#define TOK_MT "ds4.tokenizer"
#define IDS_MT "ds4.tokenizer_ids"

typedef struct tok_box {
    ds4_tokenizer *t;
} tok_box;

typedef struct ids_box {
    ds4_tokens v;
} ids_box;

static int tok_gc(lua_State *L) {
    tok_box *b = lua_touserdata(L, 1);
    if (b) {
        ds4_tokenizer_free(b->t);
        b->t = NULL;
    }
    return 0;
}

static int ids_gc(lua_State *L) {
    ids_box *b = lua_touserdata(L, 1);
    if (b) ds4_tokens_free(&b->v);
    return 0;
}

static const ds4_tokenizer *check_tok(lua_State *L, const char *fname) {
    tok_box *b = luaL_testudata(L, 1, TOK_MT);
    if (!b)
        ds4l_raise(L, "%s: self must be a ds4.tokenizer (got %s); call it as tok:method(...)", fname,
                   luaL_typename(L, 1));
    if (!b->t) ds4l_raise(L, "%s: the tokenizer has been freed", fname);
    return b->t;
}

const ds4_tokenizer *ds4l_tokenizer_test(lua_State *L, int idx, int *freed) {
    tok_box *b = luaL_testudata(L, idx, TOK_MT);
    *freed = b && !b->t;
    return b ? b->t : NULL;
}

/* The options table at idx (nil: none) with only the one key a method reads; opts.key as a boolean (absent: false). */
static int opt_flag(lua_State *L, int idx, const char *key, const char *fname) {
    const int opts = ds4l_opt_table(L, idx, fname, idx - 1);
    const char *const known[] = {key, NULL};
    ds4l_check_keys(L, opts, fname, known);
    return ds4l_opt_bool(L, opts, key, 0, fname);
}

/* ds4.tokenizer_from_json(text): a tokenizer.json's text (a rollout worker gets its tokenizer over the wire). */
static int l_tokenizer_from_json(lua_State *L) {
    const char *fname = "ds4.tokenizer_from_json";
    size_t len = 0;
    if (lua_type(L, 1) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (tokenizer.json text expected, got %s)", fname, luaL_typename(L, 1));
    const char *text = lua_tolstring(L, 1, &len);
    tok_box *b = lua_newuserdata(L, sizeof *b);
    b->t = NULL;
    luaL_getmetatable(L, TOK_MT);
    lua_setmetatable(L, -2);
    ds4_error err = {0};
    if (ds4_tokenizer_load_json(text, len, &b->t, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int l_tokenizer(lua_State *L) {
    const char *fname = "ds4.tokenizer";
    const char *path = NULL;
    if (!lua_isnoneornil(L, 1)) {
        if (lua_type(L, 1) != LUA_TSTRING)
            ds4l_raise(L, "%s: bad argument #1 (path to a tokenizer.json expected, or nothing for the built-in "
                          "byte-level tokenizer; got %s)",
                       fname, luaL_typename(L, 1));
        path = lua_tostring(L, 1);
    }
    tok_box *b = lua_newuserdata(L, sizeof *b);
    b->t = NULL;
    luaL_getmetatable(L, TOK_MT);
    lua_setmetatable(L, -2);
    ds4_error err = {0};
    ds4_status st = path ? ds4_tokenizer_load(path, &b->t, &err) : ds4_tokenizer_byte_level(&b->t, &err);
    if (st != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int m_encode(lua_State *L) {
    const char *fname = "tokenizer:encode";
    const ds4_tokenizer *t = check_tok(L, fname);
    if (lua_type(L, 2) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (string expected, got %s)", fname, luaL_typename(L, 2));
    size_t len = 0;
    const char *text = lua_tolstring(L, 2, &len);
    uint32_t flags = opt_flag(L, 3, "bos", fname) ? DS4_TOK_ADD_BOS : 0;
    ids_box *box = lua_newuserdata(L, sizeof *box);
    memset(box, 0, sizeof *box);
    luaL_getmetatable(L, IDS_MT);
    lua_setmetatable(L, -2);
    ds4_error err = {0};
    if (ds4_tokenizer_encode(t, text, len, flags, &box->v, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (box->v.n > (size_t)INT32_MAX) ds4l_raise(L, "%s: %zu ids do not fit a Lua array", fname, box->v.n);
    lua_createtable(L, (int)box->v.n, 0);
    for (size_t i = 0; i < box->v.n; i++) {
        lua_pushinteger(L, box->v.ids[i]);
        lua_rawseti(L, -2, (int)(i + 1));
    }
    ds4_tokens_free(&box->v); /* now rather than at the next collection */
    return 1;
}

static void add_id(lua_State *L, luaL_Buffer *buf, const ds4_tokenizer *t, int64_t id, size_t pos, int skip,
                   const char *fname) {
    size_t n = 0;
    const char *bytes = id >= 0 && id <= INT32_MAX ? ds4_tokenizer_id_bytes(t, (int32_t)id, &n) : NULL;
    if (!bytes)
        ds4l_raise(L, "%s: ids[%zu] = %lld is not a token id (vocabulary size %ld)", fname, pos, (long long)id,
                   (long)ds4_tokenizer_vocab_size(t));
    if (skip && ds4_tokenizer_is_special(t, (int32_t)id)) return;
    luaL_addlstring(buf, bytes, n);
}

static int m_decode(lua_State *L) {
    const char *fname = "tokenizer:decode";
    const ds4_tokenizer *t = check_tok(L, fname);
    int skip = opt_flag(L, 3, "skip_special", fname);
    ds4_tensor *ten = ds4l_tensor_test(L, 2);
    if (!ten && !lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #1 (array of ids or integer ds4.tensor expected, got %s)", fname,
                   luaL_typename(L, 2));
    luaL_Buffer buf;
    if (ten) {
        int64_t n = ds4_tensor_numel(ten);
        luaL_buffinit(L, &buf);
        for (int64_t i = 0; i < n; i++) {
            double v = ds4_tensor_get(ten, i);
            if (!(v == floor(v)) || fabs(v) > 2147483647.0)
                ds4l_raise(L, "%s: ids[%lld] = %.17g is not a token id (vocabulary size %ld)", fname,
                           (long long)(i + 1), v, (long)ds4_tokenizer_vocab_size(t));
            add_id(L, &buf, t, (int64_t)v, (size_t)(i + 1), skip, fname);
        }
    } else {
        size_t n = lua_objlen(L, 2);
        luaL_buffinit(L, &buf);
        for (size_t i = 1; i <= n; i++) {
            lua_rawgeti(L, 2, (int)i);
            /* the buffer may hold a pending part on the stack top: read the value and pop it first */
            int ty = lua_type(L, -1);
            lua_Number v = lua_tonumber(L, -1);
            lua_pop(L, 1);
            if (ty != LUA_TNUMBER || !(v == floor(v)) || fabs(v) > 2147483647.0)
                ds4l_raise(L, "%s: ids[%zu] is not a token id (got %s)", fname, i,
                           ty == LUA_TNUMBER ? "a non-integral or out-of-range number" : lua_typename(L, ty));
            add_id(L, &buf, t, (int64_t)v, i, skip, fname);
        }
    }
    luaL_pushresult(&buf);
    return 1;
}

static int m_vocab_size(lua_State *L) {
    lua_pushinteger(L, ds4_tokenizer_vocab_size(check_tok(L, "tokenizer:vocab_size")));
    return 1;
}

static int m_token_to_id(lua_State *L) {
    const char *fname = "tokenizer:token_to_id";
    const ds4_tokenizer *t = check_tok(L, fname);
    if (lua_type(L, 2) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (string expected, got %s)", fname, luaL_typename(L, 2));
    size_t len = 0;
    const char *s = lua_tolstring(L, 2, &len);
    int32_t id = ds4_tokenizer_token_to_id(t, s, len);
    if (id < 0) lua_pushnil(L);
    else lua_pushinteger(L, id);
    return 1;
}

static int m_id_to_token(lua_State *L) {
    const char *fname = "tokenizer:id_to_token";
    const ds4_tokenizer *t = check_tok(L, fname);
    int64_t id = ds4l_check_int(L, 2, fname, "id", INT32_MIN, INT32_MAX, "an integer in [-2^31, 2^31)");
    size_t len = 0;
    const char *s = ds4_tokenizer_id_to_token(t, (int32_t)id, &len);
    if (s) lua_pushlstring(L, s, len);
    else lua_pushnil(L);
    return 1;
}

static int m_special(lua_State *L) {
    const char *fname = "tokenizer:special";
    const ds4_tokenizer *t = check_tok(L, fname);
    if (lua_type(L, 2) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (special token name such as \"bos\" expected, got %s)", fname,
                   luaL_typename(L, 2));
    int32_t id = ds4_tokenizer_special_id(t, lua_tostring(L, 2));
    if (id < 0) lua_pushnil(L);
    else lua_pushinteger(L, id);
    return 1;
}

static int m_is_special(lua_State *L) {
    const char *fname = "tokenizer:is_special";
    const ds4_tokenizer *t = check_tok(L, fname);
    int64_t id = ds4l_check_int(L, 2, fname, "id", INT32_MIN, INT32_MAX, "an integer in [-2^31, 2^31)");
    lua_pushboolean(L, ds4_tokenizer_is_special(t, (int32_t)id));
    return 1;
}

/* tok:to_json() -> the tokenizer.json text it was loaded from (what model:save writes next to the weights). */
static int m_to_json(lua_State *L) {
    const ds4_tokenizer *t = check_tok(L, "tokenizer:to_json");
    size_t len = 0;
    const char *s = ds4_tokenizer_json(t, &len);
    lua_pushlstring(L, s ? s : "", len);
    return 1;
}

static int m_tostring(lua_State *L) {
    tok_box *b = luaL_testudata(L, 1, TOK_MT);
    if (b && b->t) lua_pushfstring(L, "ds4.tokenizer (vocabulary size %d)", (int)ds4_tokenizer_vocab_size(b->t));
    else lua_pushliteral(L, "ds4.tokenizer (freed)");
    return 1;
}

/* The DeepSeek special-token names and texts: {bos = "<｜begin▁of▁sentence｜>", ...}. */
static int l_special_tokens(lua_State *L) {
    lua_newtable(L);
    for (size_t i = 0;; i++) {
        const char *name = ds4_tokenizer_special_name_at(i);
        if (!name) break;
        lua_pushstring(L, ds4_tokenizer_special_content(name));
        lua_setfield(L, -2, name);
    }
    return 1;
}

static int l_is_tokenizer(lua_State *L) {
    lua_pushboolean(L, luaL_testudata(L, 1, TOK_MT) != NULL);
    return 1;
}

static const luaL_Reg tok_methods[] = {
    {"encode", m_encode},           {"decode", m_decode},   {"vocab_size", m_vocab_size},
    {"token_to_id", m_token_to_id}, {"id_to_token", m_id_to_token}, {"special", m_special},
    {"is_special", m_is_special},   {"to_json", m_to_json},         {NULL, NULL},
};

void ds4l_tokenizer_open(lua_State *L) {
    int mod = lua_gettop(L);
    ds4l_class(L, TOK_MT, tok_methods, tok_gc, m_tostring);
    lua_getfield(L, -1, "__index");
    lua_setfield(L, mod, "tokenizer_methods"); /* so ds4.lua can add pure-Lua methods */
    lua_pop(L, 1);
    luaL_newmetatable(L, IDS_MT);
    lua_pushcfunction(L, ids_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    lua_pushcfunction(L, l_tokenizer);
    lua_setfield(L, mod, "tokenizer");
    lua_pushcfunction(L, l_tokenizer_from_json);
    lua_setfield(L, mod, "tokenizer_from_json");
    lua_pushcfunction(L, l_is_tokenizer);
    lua_setfield(L, mod, "is_tokenizer");
    lua_pushcfunction(L, l_special_tokens);
    lua_setfield(L, mod, "special_tokens");
    lua_settop(L, mod);
}
