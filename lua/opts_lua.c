/* opts_lua.c — options tables and result tables, read and filled one way for every binding in lua/.
 *
 * A binding function takes its named arguments as an options table (`model:generate(prompts, {n = 4})`) and
 * returns records as tables of named fields. Reading an option checks it where it is read, and every refusal
 * reads the same, naming the function and the key:
 *   "<fname>: bad argument #<n> (options table expected, got <type>)"
 *   "<fname>: unknown option '<key>' (known: <every key the function reads>)"
 *   "<fname>: opts.<key> must be <what is accepted>, got <the value>"
 * Unknown keys are refused because a misspelt option (opts.weight_dacay) would otherwise be ignored and the call
 * would run with the default. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ds4lua.h"

void ds4l_set_num(lua_State *L, const char *k, double v) {
    lua_pushnumber(L, v);
    lua_setfield(L, -2, k);
}

void ds4l_set_int(lua_State *L, const char *k, int64_t v) {
    lua_pushnumber(L, (lua_Number)v);
    lua_setfield(L, -2, k);
}

void ds4l_set_bool(lua_State *L, const char *k, int v) {
    lua_pushboolean(L, v);
    lua_setfield(L, -2, k);
}

void ds4l_set_str(lua_State *L, const char *k, const char *v) {
    lua_pushstring(L, v);
    lua_setfield(L, -2, k);
}

int ds4l_number_to_i64(lua_Number v, int64_t *out) {
    if (!(v == floor(v)) || !(fabs(v) < 9223372036854775808.0)) return 0;
    *out = (int64_t)v;
    return 1;
}

const char *ds4l_value_str(lua_State *L, int idx, char *buf, size_t cap) {
    int t = lua_type(L, idx);
    if (t == LUA_TNUMBER) snprintf(buf, cap, "%.17g", (double)lua_tonumber(L, idx));
    else if (t == LUA_TSTRING)
        snprintf(buf, cap, "\"%.40s\"%s", lua_tostring(L, idx), lua_objlen(L, idx) > 40 ? "..." : "");
    else if (t == LUA_TBOOLEAN) snprintf(buf, cap, "%s", lua_toboolean(L, idx) ? "true" : "false");
    else snprintf(buf, cap, "a %s", lua_typename(L, t));
    return buf;
}

int64_t ds4l_check_int(lua_State *L, int idx, const char *fname, const char *what, double lo, double hi,
                       const char *desc) {
    char vb[96];
    lua_Number v = lua_tonumber(L, idx);
    if (lua_type(L, idx) != LUA_TNUMBER || !(v == floor(v)) || !(v >= lo) || !(v <= hi))
        ds4l_raise(L, "%s: %s must be %s, got %s", fname, what, desc, ds4l_value_str(L, idx, vb, sizeof vb));
    return (int64_t)v;
}

const int64_t *ds4l_check_int_list(lua_State *L, int idx, const char *fname, const char *what, int64_t n, double lo,
                                   double hi, const char *desc) {
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: %s must be a table of %lld integers, got %s", fname, what, (long long)n,
                   luaL_typename(L, idx));
    if ((int64_t)lua_objlen(L, idx) != n)
        ds4l_raise(L, "%s: %s has %lld values, expected %lld", fname, what, (long long)lua_objlen(L, idx), (long long)n);
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    int64_t *out = lua_newuserdata(L, (size_t)(n > 0 ? n : 1) * sizeof *out);
    char item[128];
    for (int64_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, (int)(i + 1));
        snprintf(item, sizeof item, "%s[%lld]", what, (long long)(i + 1));
        out[i] = ds4l_check_int(L, -1, fname, item, lo, hi, desc);
        lua_pop(L, 1);
    }
    return out;
}

int ds4l_opt_table(lua_State *L, int idx, const char *fname, int argn) {
    if (lua_isnoneornil(L, idx)) return 0;
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: bad argument #%d (options table expected, got %s)", fname, argn, luaL_typename(L, idx));
    return idx < 0 && idx > LUA_REGISTRYINDEX ? lua_gettop(L) + idx + 1 : idx;
}

int ds4l_check_opts(lua_State *L, int idx, const char *fname, int argn) {
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: bad argument #%d (options table expected, got %s)", fname, argn, luaL_typename(L, idx));
    return ds4l_opt_table(L, idx, fname, argn);
}

void ds4l_raise_unknown_option(lua_State *L, const char *fname, int key_idx, const char *known) {
    char vb[96];
    int t = lua_type(L, key_idx);
    /* a string key is quoted as the user spelt it; a positional value ({5}) shows its index */
    const char *key = t == LUA_TSTRING                        ? lua_pushfstring(L, "'%s'", lua_tostring(L, key_idx))
                      : t == LUA_TNUMBER || t == LUA_TBOOLEAN ? ds4l_value_str(L, key_idx, vb, sizeof vb)
                                                              : lua_pushfstring(L, "a %s key", lua_typename(L, t));
    ds4l_raise(L, "%s: unknown option %s (known: %s)", fname, key, known);
}

void ds4l_check_keys(lua_State *L, int opts, const char *fname, const char *const *known) {
    if (!opts) return;
    for (lua_pushnil(L); lua_next(L, opts); lua_pop(L, 1)) {
        const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        int ok = 0;
        for (int i = 0; k && known[i] && !ok; i++) ok = strcmp(k, known[i]) == 0;
        if (ok) continue;
        luaL_Buffer b; /* "a, b, c": the stack is discarded by the raise that follows */
        luaL_buffinit(L, &b);
        for (int i = 0; known[i]; i++) {
            if (i) luaL_addstring(&b, ", ");
            luaL_addstring(&b, known[i]);
        }
        luaL_pushresult(&b);
        ds4l_raise_unknown_option(L, fname, -3, lua_tostring(L, -1));
    }
}

/* Push opts[key]; 1 when it is given (not nil). opts == 0: nothing given (a nil is pushed). */
static int push_opt(lua_State *L, int opts, const char *key) {
    if (opts) lua_getfield(L, opts, key);
    else lua_pushnil(L);
    return !lua_isnil(L, -1);
}

DS4L_NORETURN static void raise_opt(lua_State *L, const char *fname, const char *key, const char *what) {
    char vb[96];
    ds4l_raise(L, "%s: opts.%s must be %s, got %s", fname, key, what, ds4l_value_str(L, -1, vb, sizeof vb));
}

int ds4l_opt_bool(lua_State *L, int opts, const char *key, int def, const char *fname) {
    int v = def;
    if (push_opt(L, opts, key)) {
        if (!lua_isboolean(L, -1)) raise_opt(L, fname, key, "a boolean");
        v = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    return v;
}

/* opts.key as a number in [lo, hi] (integral when asked); def when absent. */
static double opt_number(lua_State *L, int opts, const char *key, double def, double lo, double hi, int integral,
                         const char *desc, const char *fname) {
    double v = def;
    if (push_opt(L, opts, key)) {
        v = lua_tonumber(L, -1);
        /* written so that NaN fails every bound */
        if (lua_type(L, -1) != LUA_TNUMBER || !(v >= lo) || !(v <= hi) || (integral && v != floor(v)))
            raise_opt(L, fname, key, desc);
    }
    lua_pop(L, 1);
    return v;
}

int64_t ds4l_opt_int(lua_State *L, int opts, const char *key, int64_t def, double lo, double hi, const char *desc,
                     const char *fname) {
    /* def and every accepted value are integers of at most 2^53 (the callers' bounds): exact as doubles */
    return (int64_t)opt_number(L, opts, key, (double)def, lo, hi, 1, desc, fname);
}

double ds4l_opt_num(lua_State *L, int opts, const char *key, double def, double lo, double hi, const char *desc,
                    const char *fname) {
    return opt_number(L, opts, key, def, lo, hi, 0, desc, fname);
}

const char *ds4l_opt_str(lua_State *L, int opts, const char *key, const char *def, const char *fname) {
    const char *v = def;
    if (push_opt(L, opts, key)) {
        if (lua_type(L, -1) != LUA_TSTRING) raise_opt(L, fname, key, "a string");
        v = lua_tostring(L, -1); /* the options table holds the string */
    }
    lua_pop(L, 1);
    return v;
}
