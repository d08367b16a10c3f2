/* wire_lua.c — the rollout wire codec (rollout/wire.h, rollout/protocol.md) for Lua: ds4.wire.
 *
 *   ds4.wire.encode(msg [, frames]) -> {header, raw frames...}: an array of strings, ready for sock:send
 *   ds4.wire.decode(frames [, limits [, opts]]) -> msg | nil, code_name, message, ref_t   (never raises for a
 *                                   malformed message; raises only for a caller's mistake: frames not strings,
 *                                   an unknown or invalid limit)
 *   ds4.wire.crc32(s [, crc]) -> number        ds4.wire.error_message(code, reason, ref_t [, ref_id, ref_n])
 *   ds4.wire.default_limits() -> table         ds4.wire.codes = {name = number}   ds4.wire.code_name(n)
 *   ds4.wire.VERSION = 5
 *
 * Lua messages mirror ds4_wire_msg: msg.t is the type name ("hello", "credit", "task", "samples",
 * "weight_announce", "weight_request", "weight_chunk", "heartbeat", "error", "bye", "partial") and the other keys
 * are the fields of that type's struct in wire.h (task_id, not the header's "task"; hello's caps fields flat;
 * samples' per-sample values in msg.seq[i] = {prompt_len, n_gen, finish, stop_index, n_rows}, a partial's
 * {offset, n_gen}). Raw frames go by their protocol.md names (prompt; tokens, logprobs, sample_logprobs,
 * policy_lag, experts, index; weights; config, tokenizer,
 * tables): on encode from the `frames` table or from msg itself, as a Lua array of numbers, a string of
 * little-endian bytes, or a ds4 tensor of the frame's dtype (I32 / F32); the u8 frames config and tokenizer as
 * strings only; on decode as Lua arrays of numbers, except weights, config and tokenizer, kept as strings of
 * bytes (opts.raw = true keeps every raw frame as a string). The announce's model CRCs default to its frames'; a
 * LoRA policy's announce has lora_rank, lora_alpha, lora_rslora, lora_base_version, lora_base_chunk, lora_base_crc
 * (its "adapter" map: given one of them, the others but lora_rslora are required; a plain announce has none of them)
 * and the lora_masks frame. The full key list of every type is in lua/ds4/init.lua.
 *
 * Field names, kinds, Lua keys and defaults come from the codec's field table (ds4_wire_fields, rollout/wire.h):
 * fill_fields and push_fields walk it; each type's arrays, shapes and frames are its own code below.
 *
 * Encode checks the Lua side (unknown keys, types, integer ranges of the C fields: "ds4.wire.encode:
 * task.attempt: ...") and then ds4_wire_encode validates the message the way a receiver would (ranges, cross-
 * field rules) and raises with its message. Ownership: the encoded header (malloc'd by the codec) sits in a
 * __gc'd box while the result strings are built; converted frames live in userdata scratch buffers. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"
#include "ds4_ckpt.h" /* ds4_crc32 (after ds4.h: this header is not self-contained) */
#include "wire.h"

#define OUT_MT "ds4.wire.out"
#define MAX_EXACT 9007199254740991.0 /* 2^53 - 1 */
#define U32_MAX_D 4294967295.0

/* ------------------------------------------------------------------------------------------------ tables */

/* What the field table (ds4_wire_fields) does not give: the Lua keys of a type's arrays and shapes, which the
 * binding names its own way (samples' seq and shape sizes; error's code_name), and its raw frames. */
typedef struct type_spec {
    const char *name;
    const char *const *extra;  /* Lua keys beyond the fields', NULL-terminated */
    const char *const *frames; /* raw frame names, NULL-terminated */
} type_spec;

static const char *const X_NONE[] = {NULL};
static const char *const X_SAMPLES[] = {"seq", "experts_layers", "experts_k", "index_layers", "index_topk", NULL};
static const char *const X_ERROR[] = {"code_name", NULL};
static const char *const K_SEQ[] = {"prompt_len", "n_gen", "finish", "finish_reason", "stop_index", "n_rows", NULL};
static const char *const X_PARTIAL[] = {"seq", NULL};
static const char *const K_PSEQ[] = {"offset", "n_gen", NULL};

static const char *const F_NONE[] = {NULL};
static const char *const F_TASK[] = {"prompt", NULL};
static const char *const F_SAMPLES[] = {"tokens", "logprobs", "sample_logprobs", "policy_lag", "experts", "index",
                                        NULL};
static const char *const F_PARTIAL[] = {"tokens", "logprobs", "sample_logprobs", "policy_lag", NULL};
static const char *const F_CHUNK[] = {"weights", NULL};
static const char *const F_ANNOUNCE[] = {"config", "tokenizer", "tables", "lora_masks", NULL};

static const type_spec TYPES[DS4_WIRE_TYPE_COUNT] = {
    [DS4_WIRE_HELLO] = {"hello", X_NONE, F_NONE},
    [DS4_WIRE_CREDIT] = {"credit", X_NONE, F_NONE},
    [DS4_WIRE_TASK] = {"task", X_NONE, F_TASK},
    [DS4_WIRE_SAMPLES] = {"samples", X_SAMPLES, F_SAMPLES},
    [DS4_WIRE_WEIGHT_ANNOUNCE] = {"weight_announce", X_NONE, F_ANNOUNCE},
    [DS4_WIRE_WEIGHT_REQUEST] = {"weight_request", X_NONE, F_NONE},
    [DS4_WIRE_WEIGHT_CHUNK] = {"weight_chunk", X_NONE, F_CHUNK},
    [DS4_WIRE_HEARTBEAT] = {"heartbeat", X_NONE, F_NONE},
    [DS4_WIRE_ERROR] = {"error", X_ERROR, F_NONE},
    [DS4_WIRE_BYE] = {"bye", X_NONE, F_NONE},
    [DS4_WIRE_PARTIAL] = {"partial", X_PARTIAL, F_PARTIAL},
};

/* The Lua keys of type t (its fields' Lua names, then its extra keys), NULL-terminated in keys[cap]. */
static void lua_keys(ds4_wire_type t, const char **keys, int cap) {
    int nf, n = 0;
    const ds4_wire_field *f = ds4_wire_fields(t, &nf);
    for (int i = 0; i < nf && n + 1 < cap; i++)
        if (f[i].lua) keys[n++] = f[i].lua;
    for (const char *const *x = TYPES[t].extra; *x && n + 1 < cap; x++) keys[n++] = *x;
    keys[n] = NULL;
}

static const char *const FINISH_NAMES[] = {NULL, "length", "eos", "stop_token", "stop_string", "cancelled"};

static const struct {
    const char *name;
    uint32_t code;
} CODES[] = {
    {"bad_argument", DS4_WIRE_EARG}, {"no_memory", DS4_WIRE_ENOMEM},   {"limit", DS4_WIRE_ELIMIT},
    {"parse", DS4_WIRE_EPARSE},      {"trailing", DS4_WIRE_ETRAILING}, {"not_map", DS4_WIRE_ENOTMAP},
    {"version", DS4_WIRE_EVERSION},  {"type", DS4_WIRE_ETYPE},         {"missing", DS4_WIRE_EMISSING},
    {"key", DS4_WIRE_EKEY},          {"duplicate", DS4_WIRE_EDUP},     {"value_type", DS4_WIRE_EVALTYPE},
    {"range", DS4_WIRE_ERANGE},      {"frame", DS4_WIRE_EFRAME},       {"count", DS4_WIRE_ECOUNT},
    {"crc", DS4_WIRE_ECRC},          {"state", DS4_WIRE_ESTATE},       {"stale", DS4_WIRE_ESTALE},
    {"refused", DS4_WIRE_EREFUSED},  {"internal", DS4_WIRE_EINTERNAL},
};
#define N_CODES (int)(sizeof CODES / sizeof CODES[0])

static int in_list(const char *const *list, const char *k) {
    for (; *list; list++)
        if (strcmp(*list, k) == 0) return 1;
    return 0;
}

static void join_list(char *buf, size_t cap, const char *const *a, const char *const *b) {
    size_t o = 0;
    buf[0] = 0;
    for (int pass = 0; pass < 2; pass++)
        for (const char *const *p = pass ? b : a; p && *p && o + 1 < cap; p++) {
            int w = snprintf(buf + o, cap - o, "%s%s", o ? ", " : "", *p);
            if (w < 0) return;
            o += (size_t)w;
        }
}

/* ------------------------------------------------------------------------------------------------ encode: fields */

typedef struct enc_ctx {
    lua_State *L;
    const char *tn;  /* type name, for messages */
    int msg;         /* stack slot of the message table (or of a seq entry while reading one) */
    int frames;      /* stack slot of the frames table, or 0 */
    const char *sub; /* "seq[3]" while reading a seq entry, else NULL */
} enc_ctx;

static const char *FN = "ds4.wire.encode";

DS4L_NORETURN static void efail(enc_ctx *e, const char *key, const char *fmt, ...) DS4L_PRINTF(3, 4);
static void efail(enc_ctx *e, const char *key, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (e->sub) ds4l_raise(e->L, "%s: %s.%s.%s: %s", FN, e->tn, e->sub, key, buf);
    ds4l_raise(e->L, "%s: %s.%s: %s", FN, e->tn, key, buf);
}

/* Push msg[key]; returns its Lua type (LUA_TNIL when absent). */
static int get(enc_ctx *e, const char *key) {
    lua_getfield(e->L, e->msg, key);
    return lua_type(e->L, -1);
}

static const char *show(lua_State *L, int idx) {
    int t = lua_type(L, idx);
    if (t == LUA_TNUMBER || t == LUA_TSTRING) return lua_tostring(L, idx);
    return luaL_typename(L, idx);
}

/* An integer field in [lo, hi]; absent: def when !req. */
static double f_int(enc_ctx *e, const char *key, double lo, double hi, int req, double def) {
    lua_State *L = e->L;
    int t = get(e, key);
    double v = def;
    if (t == LUA_TNIL) {
        if (req) efail(e, key, "missing (an integer in %.0f..%.0f)", lo, hi);
    } else {
        v = lua_tonumber(L, -1);
        if (t != LUA_TNUMBER || v != floor(v) || v < lo || v > hi)
            efail(e, key, "expected an integer in %.0f..%.0f, got %s", lo, hi, show(L, -1));
    }
    lua_pop(L, 1);
    return v;
}

static uint32_t f_u32(enc_ctx *e, const char *key, int req, uint32_t def) {
    return (uint32_t)f_int(e, key, 0, U32_MAX_D, req, def);
}
static uint64_t f_u53(enc_ctx *e, const char *key, int req, uint64_t def) {
    return (uint64_t)f_int(e, key, 0, MAX_EXACT, req, (double)def);
}

static double f_num(enc_ctx *e, const char *key, int req, double def) {
    lua_State *L = e->L;
    int t = get(e, key);
    double v = def;
    if (t == LUA_TNIL) {
        if (req) efail(e, key, "missing (a number)");
    } else {
        if (t != LUA_TNUMBER) efail(e, key, "expected a number, got %s", show(L, -1));
        v = lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
    return v;
}

static uint8_t f_bool(enc_ctx *e, const char *key) {
    lua_State *L = e->L;
    int t = get(e, key);
    if (t != LUA_TNIL && t != LUA_TBOOLEAN) efail(e, key, "expected a boolean, got %s", show(L, -1));
    uint8_t v = (uint8_t)lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

/* A string field copied into buf (cap bytes, NUL included); absent: def when !req. */
static void f_str(enc_ctx *e, const char *key, char *buf, size_t cap, int req, const char *def) {
    lua_State *L = e->L;
    int t = get(e, key);
    size_t n = 0;
    const char *s = def;
    if (t == LUA_TNIL) {
        if (req) efail(e, key, "missing (a string)");
        n = strlen(def);
    } else {
        if (t != LUA_TSTRING) efail(e, key, "expected a string, got %s", show(L, -1));
        s = lua_tolstring(L, -1, &n);
        if (n >= cap) efail(e, key, "%zu bytes; at most %zu", n, cap - 1);
        if (memchr(s, 0, n)) efail(e, key, "contains a NUL byte");
    }
    memcpy(buf, s, n);
    buf[n] = 0;
    lua_pop(L, 1);
}

/* seed: 0..2^64-1 as a number (exact up to 2^53) or a string of decimal digits. */
static uint64_t f_seed(enc_ctx *e, const char *key) {
    lua_State *L = e->L;
    int t = get(e, key);
    uint64_t v = 0;
    if (t == LUA_TNUMBER) {
        double d = lua_tonumber(L, -1);
        if (d != floor(d) || d < 0 || d >= 18446744073709551616.0)
            efail(e, key, "expected an integer in 0..2^64-1, got %s", show(L, -1));
        v = (uint64_t)d;
    } else if (t == LUA_TSTRING) {
        size_t n = 0;
        const char *s = lua_tolstring(L, -1, &n);
        if (n == 0 || n > 20) efail(e, key, "expected decimal digits of a value in 0..2^64-1, got \"%s\"", s);
        for (size_t i = 0; i < n; i++) {
            if (s[i] < '0' || s[i] > '9' || v > (UINT64_MAX - (uint64_t)(s[i] - '0')) / 10)
                efail(e, key, "expected decimal digits of a value in 0..2^64-1, got \"%s\"", s);
            v = v * 10 + (uint64_t)(s[i] - '0');
        }
    } else if (t != LUA_TNIL) {
        efail(e, key, "expected an integer (or a decimal string), got %s", show(L, -1));
    }
    lua_pop(L, 1);
    return v;
}

/* Every key of the table at idx is a string in keys or frames (or "t" / "v" when top is set). */
static void check_keys(enc_ctx *e, int idx, const char *const *keys, const char *const *frames, int top) {
    lua_State *L = e->L;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!k ||
            !((top && (!strcmp(k, "t") || !strcmp(k, "v"))) || in_list(keys, k) || (frames && in_list(frames, k)))) {
            char known[1024];
            join_list(known, sizeof known, keys, frames);
            if (e->sub)
                ds4l_raise(L, "%s: %s.%s: unknown field %s%s%s (known: %s)", FN, e->tn, e->sub, k ? "'" : "a ",
                           k ? k : luaL_typename(L, -1), k ? "'" : " key", known);
            ds4l_raise(L, "%s: %s: unknown field %s%s%s (known: t, v, %s)", FN, e->tn, k ? "'" : "a ",
                       k ? k : luaL_typename(L, -1), k ? "'" : " key", known);
        }
    }
}

/* ------------------------------------------------------------------------------------------------ encode: frames */

typedef enum { FR_I32, FR_F32, FR_U8 } frame_kind; /* FR_U8: bytes, given and returned as a string */

/* Raw frame `name`: frames[name], else msg[name]. Returns 0 when absent (view zeroed); else fills view with
 * bytes that stay alive on the Lua stack (a string, a tensor, or a scratch buffer pushed here). */
static int f_frame(enc_ctx *e, const char *name, frame_kind kind, ds4_wire_view *view) {
    lua_State *L = e->L;
    view->data = NULL;
    view->len = 0;
    int t = LUA_TNIL;
    if (e->frames) {
        lua_getfield(L, e->frames, name);
        t = lua_type(L, -1);
        if (t == LUA_TNIL) lua_pop(L, 1);
    }
    if (t == LUA_TNIL) {
        lua_getfield(L, e->msg, name);
        t = lua_type(L, -1);
    }
    if (t == LUA_TNIL) {
        lua_pop(L, 1);
        return 0;
    }
    int idx = lua_gettop(L); /* stays on the stack: keeps the bytes alive */
    if (t == LUA_TSTRING) {
        view->data = lua_tolstring(L, idx, &view->len);
        return 1;
    }
    if (kind == FR_U8) efail(e, name, "expected a string of bytes, got %s", luaL_typename(L, idx));
    ds4_tensor *tn = ds4l_tensor_test(L, idx);
    if (tn) {
        ds4_dtype want = kind == FR_I32 ? DS4_I32 : DS4_F32;
        if (tn->dtype != want)
            efail(e, name, "a tensor of dtype %s; this frame needs %s", ds4_dtype_name(tn->dtype),
                  ds4_dtype_name(want));
        view->data = tn->data;
        view->len = tn->nbytes;
        return 1;
    }
    if (t != LUA_TTABLE)
        efail(e, name, "expected an array of numbers, a string of bytes or a %s tensor, got %s",
              kind == FR_I32 ? "I32" : "F32", luaL_typename(L, idx));
    size_t n = lua_objlen(L, idx);
    if (n > ((size_t)1 << 31)) efail(e, name, "%zu elements; too many", n);
    unsigned char *buf = lua_newuserdata(L, n ? 4 * n : 1);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, (int)i + 1);
        double v = lua_tonumber(L, -1);
        if (lua_type(L, -1) != LUA_TNUMBER) efail(e, name, "element %zu is %s, expected a number", i + 1, show(L, -1));
        if (kind == FR_I32) {
            if (v != floor(v) || v < -2147483648.0 || v > 2147483647.0)
                efail(e, name, "element %zu = %s is not an int32", i + 1, show(L, -1));
            int32_t x = (int32_t)v;
            memcpy(buf + 4 * i, &x, 4);
        } else {
            float x = (float)v;
            memcpy(buf + 4 * i, &x, 4);
        }
        lua_pop(L, 1);
    }
    view->data = buf;
    view->len = 4 * n;
    return 1;
}

static void need_frame(enc_ctx *e, const char *name, frame_kind kind, ds4_wire_view *view) {
    if (!f_frame(e, name, kind, view))
        efail(e, name, "missing raw frame (an array of numbers, a string of bytes or a tensor; in msg or frames)");
}

/* ------------------------------------------------------------------------------------------------ encode */

static uint32_t finish_code(enc_ctx *e, const char *key) {
    lua_State *L = e->L;
    int t = get(e, key);
    uint32_t v = 0;
    if (t == LUA_TSTRING) {
        const char *s = lua_tostring(L, -1);
        for (uint32_t i = 1; i <= 5; i++)
            if (strcmp(s, FINISH_NAMES[i]) == 0) v = i;
        if (!v) efail(e, key, "\"%s\" is not a finish reason (length, eos, stop_token, stop_string, cancelled)", s);
    } else if (t == LUA_TNUMBER) {
        double d = lua_tonumber(L, -1);
        if (d != floor(d) || d < 0 || d > U32_MAX_D)
            efail(e, key, "expected 1..5 or a finish reason, got %s", show(L, -1));
        v = (uint32_t)d;
    } else if (t != LUA_TNIL) {
        efail(e, key, "expected 1..5 or a finish reason name, got %s", show(L, -1));
    }
    lua_pop(L, 1);
    return v;
}

/* code: a number or a code name ("state", ...); code_name, when given too, must agree. */
static uint32_t error_code(enc_ctx *e) {
    lua_State *L = e->L;
    uint32_t v = 0;
    int have = 0;
    for (int k = 0; k < 2; k++) {
        const char *key = k ? "code_name" : "code";
        int t = get(e, key);
        uint32_t c = 0;
        if (t == LUA_TNIL) {
            lua_pop(L, 1);
            continue;
        }
        if (t == LUA_TSTRING) {
            const char *s = lua_tostring(L, -1);
            int found = 0;
            for (int i = 0; i < N_CODES; i++)
                if (strcmp(s, CODES[i].name) == 0) c = CODES[i].code, found = 1;
            if (!found) efail(e, key, "\"%s\" is not an error code name (ds4.wire.codes)", s);
        } else if (t == LUA_TNUMBER && k == 0) {
            double d = lua_tonumber(L, -1);
            if (d != floor(d) || d < 0 || d > U32_MAX_D)
                efail(e, key, "expected 1..65535 or a code name, got %s", show(L, -1));
            c = (uint32_t)d;
        } else {
            efail(e, key, "expected %s, got %s", k ? "a code name" : "a number or a code name", show(L, -1));
        }
        lua_pop(L, 1);
        if (have && c != v) efail(e, "code_name", "names code %u, but code is %u", (unsigned)c, (unsigned)v);
        v = c;
        have = 1;
    }
    if (!have) efail(e, "code", "missing (a number or a code name)");
    return v;
}

/* A field absent from the message table. */
static int absent(enc_ctx *e, const char *key) {
    int t = get(e, key);
    lua_pop(e->L, 1);
    return t == LUA_TNIL;
}

/* An optional map (DS4_WIRE_F_OPT_MAP) is given in a Lua message when one of its fields' Lua keys is. */
static int opt_map_given(enc_ctx *e, const ds4_wire_field *f, int nf, const char *map) {
    for (int i = 0; i < nf; i++)
        if (f[i].map && strcmp(f[i].map, map) == 0 && f[i].lua && !absent(e, f[i].lua)) return 1;
    return 0;
}

/* The fields of m's type that the table describes whole (not OTHER, not the binding's OWN; a CALC one when given),
 * each from its Lua key with its Lua default; an optional map's required fields only when the map is given. */
static void fill_fields(enc_ctx *e, ds4_wire_msg *m) {
    int nf;
    const ds4_wire_field *f = ds4_wire_fields(m->type, &nf);
    char *base = (char *)m + offsetof(ds4_wire_msg, hello);
    for (int i = 0; i < nf; i++) {
        const ds4_wire_field *x = &f[i];
        if (!x->lua || x->kind == DS4_WIRE_K_OTHER || (x->flags & DS4_WIRE_F_LUA_OWN)) continue;
        if ((x->flags & DS4_WIRE_F_LUA_CALC) && absent(e, x->lua)) continue; /* the type's fill derives it */
        void *p = base + x->offset;
        const int req = (x->flags & DS4_WIRE_F_LUA_REQ) != 0 &&
                        (!(x->flags & DS4_WIRE_F_OPT_MAP) || opt_map_given(e, f, nf, x->map));
        switch (x->kind) {
        case DS4_WIRE_K_U32: *(uint32_t *)p = (uint32_t)f_int(e, x->lua, 0, U32_MAX_D, req, x->def); break;
        case DS4_WIRE_K_U64: /* a seed may exceed 2^53: given as a decimal string */
            *(uint64_t *)p = x->hi > (uint64_t)MAX_EXACT ? f_seed(e, x->lua) : f_u53(e, x->lua, req, (uint64_t)x->def);
            break;
        case DS4_WIRE_K_F64: *(double *)p = f_num(e, x->lua, req, x->def); break;
        case DS4_WIRE_K_BOOL: *(uint8_t *)p = f_bool(e, x->lua); break;
        case DS4_WIRE_K_STR: f_str(e, x->lua, p, x->size, req, x->sdef ? x->sdef : ""); break;
        default: break;
        }
    }
}

/* One entry of samples' seq: {prompt_len, n_gen, finish or finish_reason, stop_index, n_rows}. */
static void enc_sample_seq(enc_ctx *e, ds4_wire_seq *q) {
    q->prompt_len = f_u32(e, "prompt_len", 1, 0);
    q->n_gen = f_u32(e, "n_gen", 1, 0);
    q->finish = finish_code(e, "finish");
    uint32_t fr = finish_code(e, "finish_reason");
    if (!q->finish && !fr) efail(e, "finish", "missing (1..5 or a finish reason name)");
    if (q->finish && fr && q->finish != fr) efail(e, "finish_reason", "disagrees with finish = %u", (unsigned)q->finish);
    if (!q->finish) q->finish = fr;
    q->stop_index = (int32_t)f_int(e, "stop_index", -1, 2147483647.0, 0, -1);
    q->n_rows = f_u32(e, "n_rows", 0, 0);
}

/* One entry of a partial message's seq (version 5): {offset, n_gen}. */
static void enc_partial_seq(enc_ctx *e, ds4_wire_seq *q) {
    q->offset = f_u32(e, "offset", 1, 0);
    q->n_gen = f_u32(e, "n_gen", 1, 0);
}

/* msg.seq, an array of per-sample tables with the keys `keys` (read by `one`), msg.n its length when given, then the
 * three token frames: what samples and partial messages share. */
static void enc_seqs(enc_ctx *e, ds4_wire_samples *s, const char *const *keys, const char *shape,
                     void (*one)(enc_ctx *, ds4_wire_seq *)) {
    lua_State *L = e->L;
    if (get(e, "seq") != LUA_TTABLE) efail(e, "seq", "expected an array of %s, got %s", shape, show(L, -1));
    int seq = lua_gettop(L);
    size_t n = lua_objlen(L, seq);
    if (n < 1 || n > DS4_WIRE_SAMPLES_CAP) efail(e, "seq", "%zu entries; 1..%d expected", n, DS4_WIRE_SAMPLES_CAP);
    s->n = (uint32_t)f_int(e, "n", 1, DS4_WIRE_SAMPLES_CAP, 0, (double)n);
    if (s->n != n) efail(e, "n", "%u, but seq has %zu entries", (unsigned)s->n, n);
    int msg = e->msg;
    char sub[32];
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, seq, (int)i + 1);
        snprintf(sub, sizeof sub, "seq[%zu]", i + 1);
        if (!lua_istable(L, -1)) efail(e, sub, "expected a table %s, got %s", shape, show(L, -1));
        e->msg = lua_gettop(L);
        e->sub = sub;
        check_keys(e, e->msg, keys, NULL, 0);
        one(e, &s->seq[i]);
        e->sub = NULL;
        e->msg = msg;
        lua_pop(L, 1);
    }
    lua_pop(L, 1); /* seq */
    need_frame(e, "tokens", FR_I32, &s->tokens);
    need_frame(e, "logprobs", FR_F32, &s->logprobs);
    need_frame(e, "sample_logprobs", FR_F32, &s->sample_logprobs);
}

/* the policy_lag frame, present exactly when token_versions is set (samples; partial from version 6) */
static void enc_policy_lag(enc_ctx *e, ds4_wire_samples *s) {
    if (f_frame(e, "policy_lag", FR_I32, &s->policy_lag) != (s->token_versions != 0))
        efail(e, "policy_lag", s->token_versions ? "missing raw frame (token_versions is set)"
                                                 : "given, but token_versions is not set");
}

static void enc_samples(enc_ctx *e, ds4_wire_samples *s) {
    s->experts_layers = f_u32(e, "experts_layers", 0, 0);
    s->experts_k = f_u32(e, "experts_k", 0, 0);
    s->index_layers = f_u32(e, "index_layers", 0, 0);
    s->index_topk = f_u32(e, "index_topk", 0, 0);
    enc_seqs(e, s, K_SEQ, "{prompt_len, n_gen, finish, ...}", enc_sample_seq);
    enc_policy_lag(e, s);
    int ex = s->experts_layers || s->experts_k, ix = s->index_layers || s->index_topk;
    if (f_frame(e, "experts", FR_I32, &s->experts) != ex)
        efail(e, "experts",
              ex ? "missing raw frame (experts_layers / experts_k are set)"
                 : "given, but experts_layers and experts_k are 0");
    if (f_frame(e, "index", FR_I32, &s->index) != ix)
        efail(e, "index",
              ix ? "missing raw frame (index_layers / index_topk are set)"
                 : "given, but index_layers and index_topk are 0");
}

/* Fill m from the message table at e->msg (raw frames stay referenced on the stack): the table's fields, then
 * what each type has beyond them (arrays, frames, the values a Lua message may leave out and the binding derives). */
static void enc_fill(enc_ctx *e, ds4_wire_msg *m) {
    lua_State *L = e->L;
    fill_fields(e, m);
    switch (m->type) {
    case DS4_WIRE_TASK: {
        ds4_wire_task *t = &m->task;
        int st = get(e, "stop");
        if (st != LUA_TNIL) {
            if (st != LUA_TTABLE) efail(e, "stop", "expected an array of token ids, got %s", show(L, -1));
            size_t n = lua_objlen(L, -1);
            if (n > DS4_WIRE_STOP_CAP) efail(e, "stop", "%zu ids; at most %d", n, DS4_WIRE_STOP_CAP);
            for (size_t i = 0; i < n; i++) {
                lua_rawgeti(L, -1, (int)i + 1);
                double v = lua_tonumber(L, -1);
                if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v) || v < 0 || v > 2147483647.0)
                    efail(e, "stop", "element %zu is %s, expected a token id 0..2^31-1", i + 1, show(L, -1));
                t->stop[i] = (int32_t)v;
                lua_pop(L, 1);
            }
            t->n_stop = (uint32_t)n;
        }
        lua_pop(L, 1);
        st = get(e, "stop_strings");
        if (st != LUA_TNIL) {
            if (st != LUA_TTABLE) efail(e, "stop_strings", "expected an array of strings, got %s", show(L, -1));
            size_t n = lua_objlen(L, -1);
            if (n > DS4_WIRE_STOP_STR_CAP) efail(e, "stop_strings", "%zu strings; at most %d", n, DS4_WIRE_STOP_STR_CAP);
            for (size_t i = 0; i < n; i++) {
                lua_rawgeti(L, -1, (int)i + 1);
                size_t len = 0;
                const char *sv = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
                if (!sv || len < 1 || len > DS4_WIRE_STOP_STR_BYTES || strlen(sv) != len)
                    efail(e, "stop_strings", "element %zu is %s, expected a string of 1..%d bytes without NUL", i + 1,
                          show(L, -1), DS4_WIRE_STOP_STR_BYTES);
                memcpy(t->stop_str[i], sv, len + 1);
                lua_pop(L, 1);
            }
            t->n_stop_str = (uint32_t)n;
        }
        lua_pop(L, 1);
        need_frame(e, "prompt", FR_I32, &t->prompt);
        if (absent(e, "prompt_len")) t->prompt_len = (uint32_t)(t->prompt.len / 4);
        break;
    }
    case DS4_WIRE_SAMPLES: enc_samples(e, &m->samples); break;
    case DS4_WIRE_PARTIAL:
        enc_seqs(e, &m->partial, K_PSEQ, "{offset, n_gen}", enc_partial_seq);
        enc_policy_lag(e, &m->partial);
        break;
    case DS4_WIRE_WEIGHT_ANNOUNCE: {
        ds4_wire_weight_announce *w = &m->announce;
        if (absent(e, "bytes")) w->bytes = w->n_params <= (uint64_t)MAX_EXACT / 4 ? 4 * w->n_params : 0;
        if (absent(e, "chunks")) w->chunks = w->chunk ? (uint32_t)((w->bytes + w->chunk - 1) / w->chunk) : 0;
        /* the model's frames; their CRCs default to the bytes' own (given: sent as given, a test's corruption) */
        need_frame(e, "config", FR_U8, &w->config);
        f_frame(e, "tokenizer", FR_U8, &w->tokenizer); /* absent: 0 bytes (no tokenizer, no tables) */
        f_frame(e, "tables", FR_I32, &w->tables);
        if (absent(e, "config_crc")) w->config_crc = ds4_crc32(0, w->config.data, w->config.len);
        if (absent(e, "tokenizer_crc")) w->tokenizer_crc = ds4_crc32(0, w->tokenizer.data, w->tokenizer.len);
        if (absent(e, "tables_crc")) w->tables_crc = ds4_crc32(0, w->tables.data, w->tables.len);
        if (w->lora_rank) need_frame(e, "lora_masks", FR_I32, &w->lora_masks);
        else f_frame(e, "lora_masks", FR_I32, &w->lora_masks); /* given: the codec refuses it without the map */
        break;
    }
    case DS4_WIRE_WEIGHT_CHUNK: {
        ds4_wire_weight_chunk *w = &m->chunk;
        if (absent(e, "offset")) w->offset = (uint64_t)w->index * w->chunk;
        need_frame(e, "weights", FR_F32, &w->data);
        if (absent(e, "crc")) w->crc = ds4_crc32(0, w->data.data, w->data.len);
        break;
    }
    case DS4_WIRE_ERROR: m->error.code = error_code(e); break;
    default: break;
    }
}

typedef struct out_box {
    ds4_wire_out out;
} out_box;

static int out_gc(lua_State *L) {
    out_box *b = lua_touserdata(L, 1);
    if (b) ds4_wire_out_free(&b->out);
    return 0;
}

/* Encode m (filled) and push the array of frame strings. */
static int push_encoded(lua_State *L, const char *fname, const ds4_wire_msg *m) {
    out_box *b = lua_newuserdata(L, sizeof *b);
    memset(b, 0, sizeof *b);
    luaL_getmetatable(L, OUT_MT);
    lua_setmetatable(L, -2);
    ds4_error err = {0};
    if (ds4_wire_encode(m, &b->out, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_createtable(L, b->out.nframes, 0);
    for (int k = 0; k < b->out.nframes; k++) {
        lua_pushlstring(L, b->out.lens[k] ? (const char *)b->out.frames[k] : "", b->out.lens[k]);
        lua_rawseti(L, -2, k + 1);
    }
    ds4_wire_out_free(&b->out);
    return 1;
}

static ds4_wire_type type_of(const char *t) {
    for (int i = 1; t && i < DS4_WIRE_TYPE_COUNT; i++)
        if (strcmp(t, TYPES[i].name) == 0) return (ds4_wire_type)i;
    return DS4_WIRE_NONE;
}

/* ds4.wire.encode(msg [, frames]) -> array of frame strings */
static int l_encode(lua_State *L) {
    if (!lua_istable(L, 1))
        ds4l_raise(L, "%s: bad argument #1 (message table expected, got %s)", FN, luaL_typename(L, 1));
    if (!lua_isnoneornil(L, 2) && !lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #2 (table of raw frames expected, got %s)", FN, luaL_typename(L, 2));
    lua_settop(L, 2);
    luaL_checkstack(L, 40, "ds4.wire.encode");
    lua_getfield(L, 1, "t");
    const char *t = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    ds4_wire_type type = type_of(t);
    if (type == DS4_WIRE_NONE)
        ds4l_raise(L,
                   "%s: msg.t must name a message type (hello, credit, task, samples, weight_announce, "
                   "weight_request, weight_chunk, heartbeat, error, bye, partial), got %s%s%s",
                   FN, t ? "\"" : "", t ? t : luaL_typename(L, -1), t ? "\"" : "");
    lua_pop(L, 1);
    enc_ctx e = {L, TYPES[type].name, 1, lua_istable(L, 2) ? 2 : 0, NULL};
    lua_getfield(L, 1, "v");
    if (!lua_isnil(L, -1) && !(lua_type(L, -1) == LUA_TNUMBER && lua_tonumber(L, -1) == DS4_WIRE_VERSION))
        efail(&e, "v", "this build speaks protocol version %d, got %s", DS4_WIRE_VERSION, show(L, -1));
    lua_pop(L, 1);
    const char *keys[48];
    lua_keys(type, keys, 48);
    check_keys(&e, 1, keys, TYPES[type].frames, 1);
    if (e.frames) {
        lua_pushnil(L);
        while (lua_next(L, 2)) {
            lua_pop(L, 1);
            const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            if (!k || !in_list(TYPES[type].frames, k)) {
                char known[256];
                join_list(known, sizeof known, TYPES[type].frames, NULL);
                ds4l_raise(L, "%s: %s: frames has an unknown frame %s (this type has: %s)", FN, e.tn,
                           k ? k : luaL_typename(L, -1), known[0] ? known : "none");
            }
        }
    }
    ds4_wire_msg *m = lua_newuserdata(L, sizeof *m); /* slot 3 */
    memset(m, 0, sizeof *m);
    m->type = type;
    enc_fill(&e, m);
    return push_encoded(L, FN, m);
}

/* ------------------------------------------------------------------------------------------------ decode */

/* Push a raw frame: an array of numbers, or its bytes as a string when raw. */
static void push_frame(lua_State *L, ds4_wire_view v, frame_kind kind, int raw) {
    if (raw) {
        lua_pushlstring(L, v.len ? (const char *)v.data : "", v.len);
        return;
    }
    size_t n = v.len / 4;
    lua_createtable(L, n > INT32_MAX ? 0 : (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_pushnumber(L, kind == FR_I32 ? (double)ds4_wire_i32(v, i) : (double)ds4_wire_f32(v, i));
        lua_rawseti(L, -2, (int)i + 1);
    }
}

static void set_frame(lua_State *L, const char *k, ds4_wire_view v, frame_kind kind, int raw) {
    push_frame(L, v, kind, raw);
    lua_setfield(L, -2, k);
}

/* The fields of m's type that the table describes whole, each under its Lua key (a seed above 2^53 as a decimal
 * string). */
static void push_fields(lua_State *L, const ds4_wire_msg *m) {
    int nf;
    const ds4_wire_field *f = ds4_wire_fields(m->type, &nf);
    const char *base = (const char *)m + offsetof(ds4_wire_msg, hello);
    for (int i = 0; i < nf; i++) {
        const ds4_wire_field *x = &f[i];
        const void *p = base + x->offset;
        if (!x->lua || x->kind == DS4_WIRE_K_OTHER || !ds4_wire_field_present(m, x)) continue;
        switch (x->kind) {
        case DS4_WIRE_K_U32: ds4l_set_num(L, x->lua, *(const uint32_t *)p); break;
        case DS4_WIRE_K_U64: {
            const uint64_t v = *(const uint64_t *)p;
            if (v <= (uint64_t)MAX_EXACT) {
                ds4l_set_num(L, x->lua, (double)v);
            } else {
                char buf[32];
                snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
                ds4l_set_str(L, x->lua, buf);
            }
            break;
        }
        case DS4_WIRE_K_F64: ds4l_set_num(L, x->lua, *(const double *)p); break;
        case DS4_WIRE_K_BOOL: ds4l_set_bool(L, x->lua, *(const uint8_t *)p); break;
        case DS4_WIRE_K_STR: ds4l_set_str(L, x->lua, p); break;
        default: break;
        }
    }
}

/* A decoded message as a Lua table: t, v, the table's fields, then each type's arrays, shapes and frames. */
static void push_msg(lua_State *L, const ds4_wire_msg *m, int raw) {
    lua_createtable(L, 0, 16);
    ds4l_set_str(L, "t", ds4_wire_type_name(m->type));
    ds4l_set_num(L, "v", DS4_WIRE_VERSION);
    push_fields(L, m);
    switch (m->type) {
    case DS4_WIRE_TASK: {
        const ds4_wire_task *t = &m->task;
        lua_createtable(L, (int)t->n_stop, 0);
        for (uint32_t i = 0; i < t->n_stop; i++) {
            lua_pushnumber(L, t->stop[i]);
            lua_rawseti(L, -2, (int)i + 1);
        }
        lua_setfield(L, -2, "stop");
        lua_createtable(L, (int)t->n_stop_str, 0);
        for (uint32_t i = 0; i < t->n_stop_str; i++) {
            lua_pushstring(L, t->stop_str[i]);
            lua_rawseti(L, -2, (int)i + 1);
        }
        lua_setfield(L, -2, "stop_strings");
        set_frame(L, "prompt", t->prompt, FR_I32, raw);
        break;
    }
    case DS4_WIRE_SAMPLES: {
        const ds4_wire_samples *s = &m->samples;
        lua_createtable(L, (int)s->n, 0);
        for (uint32_t i = 0; i < s->n; i++) {
            const ds4_wire_seq *q = &s->seq[i];
            lua_createtable(L, 0, 6);
            ds4l_set_num(L, "prompt_len", q->prompt_len);
            ds4l_set_num(L, "n_gen", q->n_gen);
            ds4l_set_num(L, "finish", q->finish);
            ds4l_set_str(L, "finish_reason", q->finish >= 1 && q->finish <= 5 ? FINISH_NAMES[q->finish] : "unknown");
            ds4l_set_num(L, "stop_index", q->stop_index);
            ds4l_set_num(L, "n_rows", q->n_rows);
            lua_rawseti(L, -2, (int)i + 1);
        }
        lua_setfield(L, -2, "seq");
        ds4l_set_num(L, "experts_layers", s->experts_layers);
        ds4l_set_num(L, "experts_k", s->experts_k);
        ds4l_set_num(L, "index_layers", s->index_layers);
        ds4l_set_num(L, "index_topk", s->index_topk);
        set_frame(L, "tokens", s->tokens, FR_I32, raw);
        set_frame(L, "logprobs", s->logprobs, FR_F32, raw);
        set_frame(L, "sample_logprobs", s->sample_logprobs, FR_F32, raw);
        if (s->token_versions) set_frame(L, "policy_lag", s->policy_lag, FR_I32, raw);
        if (s->experts_layers) set_frame(L, "experts", s->experts, FR_I32, raw);
        if (s->index_layers) set_frame(L, "index", s->index, FR_I32, raw);
        break;
    }
    case DS4_WIRE_PARTIAL: {
        const ds4_wire_samples *s = &m->partial;
        lua_createtable(L, (int)s->n, 0);
        for (uint32_t i = 0; i < s->n; i++) {
            lua_createtable(L, 0, 2);
            ds4l_set_num(L, "offset", s->seq[i].offset);
            ds4l_set_num(L, "n_gen", s->seq[i].n_gen);
            lua_rawseti(L, -2, (int)i + 1);
        }
        lua_setfield(L, -2, "seq");
        set_frame(L, "tokens", s->tokens, FR_I32, raw);
        set_frame(L, "logprobs", s->logprobs, FR_F32, raw);
        set_frame(L, "sample_logprobs", s->sample_logprobs, FR_F32, raw);
        if (s->token_versions) set_frame(L, "policy_lag", s->policy_lag, FR_I32, raw);
        break;
    }
    case DS4_WIRE_WEIGHT_ANNOUNCE: {
        const ds4_wire_weight_announce *w = &m->announce;
        set_frame(L, "config", w->config, FR_U8, 1); /* bytes: always strings */
        set_frame(L, "tokenizer", w->tokenizer, FR_U8, 1);
        set_frame(L, "tables", w->tables, FR_I32, raw);
        if (w->lora_rank) set_frame(L, "lora_masks", w->lora_masks, FR_I32, raw);
        break;
    }
    case DS4_WIRE_WEIGHT_CHUNK:
        set_frame(L, "weights", m->chunk.data, FR_U8, 1); /* bytes: always a string */
        break;
    case DS4_WIRE_ERROR: ds4l_set_str(L, "code_name", ds4_wire_error_name(m->error.code)); break;
    default: break;
    }
}

/* ---------------------------------------------------------------- limits */

static const struct {
    const char *name;
    int is_size; /* size_t or uint64_t field */
} LIMIT_NAMES[] = {
    {"max_header_bytes", 1},  {"max_frame_bytes", 1},  {"max_frames", 0},   {"max_str_bytes", 0},
    {"max_prompt_tokens", 0}, {"max_samples", 0},      {"max_stop_ids", 0}, {"max_gen_tokens", 1},
    {"max_chunk_bytes", 0},   {"max_weight_bytes", 1},
};
#define N_LIMITS (int)(sizeof LIMIT_NAMES / sizeof LIMIT_NAMES[0])

static void set_limit(ds4_wire_limits *l, int i, double v) {
    switch (i) {
    case 0: l->max_header_bytes = (size_t)v; break;
    case 1: l->max_frame_bytes = (size_t)v; break;
    case 2: l->max_frames = (uint32_t)v; break;
    case 3: l->max_str_bytes = (uint32_t)v; break;
    case 4: l->max_prompt_tokens = (uint32_t)v; break;
    case 5: l->max_samples = (uint32_t)v; break;
    case 6: l->max_stop_ids = (uint32_t)v; break;
    case 7: l->max_gen_tokens = (uint64_t)v; break;
    case 8: l->max_chunk_bytes = (uint32_t)v; break;
    default: l->max_weight_bytes = (uint64_t)v; break;
    }
}

static double get_limit(const ds4_wire_limits *l, int i) {
    switch (i) {
    case 0: return (double)l->max_header_bytes;
    case 1: return (double)l->max_frame_bytes;
    case 2: return l->max_frames;
    case 3: return l->max_str_bytes;
    case 4: return l->max_prompt_tokens;
    case 5: return l->max_samples;
    case 6: return l->max_stop_ids;
    case 7: return (double)l->max_gen_tokens;
    case 8: return l->max_chunk_bytes;
    default: return (double)l->max_weight_bytes;
    }
}

/* The defaults overridden by the table at idx (0: none). The codec checks each against its cap. */
static ds4_wire_limits check_limits(lua_State *L, int idx, const char *fname) {
    ds4_wire_limits l = ds4_wire_default_limits();
    if (!idx) return l;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        int which = -1;
        for (int i = 0; k && i < N_LIMITS; i++)
            if (strcmp(k, LIMIT_NAMES[i].name) == 0) which = i;
        if (which < 0)
            ds4l_raise(L,
                       "%s: unknown limit %s (known: max_header_bytes, max_frame_bytes, max_frames, max_str_bytes, "
                       "max_prompt_tokens, max_samples, max_stop_ids, max_gen_tokens, max_chunk_bytes, "
                       "max_weight_bytes)",
                       fname, k ? k : luaL_typename(L, -2));
        double v = lua_tonumber(L, -1);
        double hi = LIMIT_NAMES[which].is_size ? MAX_EXACT : U32_MAX_D;
        if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v) || v < 1 || v > hi)
            ds4l_raise(L, "%s: limits.%s must be a positive integer, got %s", fname, k, show(L, -1));
        set_limit(&l, which, v);
        lua_pop(L, 1);
    }
    return l;
}

/* ds4.wire.decode(frames [, limits [, opts]]) -> msg | nil, code_name, message, ref_t
 * opts.raw = true: raw frames as strings; opts.first = i: the header is frames[i] (default 1; e.g. 2 after a
 * ROUTER's routing-id frame). */
static int l_decode(lua_State *L) {
    const char *fname = "ds4.wire.decode";
    if (!lua_istable(L, 1))
        ds4l_raise(L, "%s: bad argument #1 (array of frame strings expected, got %s)", fname, luaL_typename(L, 1));
    if (!lua_isnoneornil(L, 2) && !lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #2 (limits table expected, got %s)", fname, luaL_typename(L, 2));
    const int opts = ds4l_opt_table(L, 3, fname, 3);
    static const char *const known[] = {"raw", "first", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 3);
    const int raw = ds4l_opt_bool(L, opts, "raw", 0, fname);
    const int first = (int)ds4l_opt_int(L, opts, "first", 1, 1, 1e6, "a positive integer", fname);
    ds4_wire_limits lim = check_limits(L, lua_istable(L, 2) ? 2 : 0, fname);
    size_t total = lua_objlen(L, 1);
    size_t n = total >= (size_t)first ? total - (size_t)first + 1 : 0;
    for (size_t i = 0; i < n; i++) { /* a caller's mistake, not the peer's: raised */
        lua_rawgeti(L, 1, first + (int)i);
        if (lua_type(L, -1) != LUA_TSTRING)
            ds4l_raise(L, "%s: frames[%zu] is a %s, expected a string", fname, (size_t)first + i, luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    if (n > DS4_WIRE_FRAMES_CAP) {
        lua_pushnil(L);
        lua_pushstring(L, ds4_wire_error_name(DS4_WIRE_ELIMIT));
        lua_pushfstring(L, "wire decode: %d frames, more than max_frames (%d)", (int)n, (int)lim.max_frames);
        lua_pushliteral(L, "");
        return 4;
    }
    const void *ptrs[DS4_WIRE_FRAMES_CAP];
    size_t lens[DS4_WIRE_FRAMES_CAP];
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, 1, first + (int)i);
        ptrs[i] = lua_tolstring(L, -1, &lens[i]);
        lua_pop(L, 1); /* the table keeps the string alive */
    }
    ds4_wire_msg *m = lua_newuserdata(L, sizeof *m);
    ds4_error err = {0};
    ds4_wire_code code = ds4_wire_decode(&lim, (int)n, ptrs, lens, m, &err);
    if (code == DS4_WIRE_EARG) ds4l_raise(L, "%s: %s", fname, err.msg); /* the limits: the caller's */
    if (code != DS4_WIRE_OK) {
        lua_pushnil(L);
        lua_pushstring(L, ds4_wire_error_name(code));
        lua_pushstring(L, err.msg);
        lua_pushstring(L, m->type != DS4_WIRE_NONE ? ds4_wire_type_name(m->type) : "");
        return 4;
    }
    push_msg(L, m, raw);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ helpers */

/* ds4.wire.crc32(s [, crc]) -> number: CRC-32 (IEEE) of a string or a tensor's bytes, continuing from crc. */
static int l_crc32(lua_State *L) {
    const char *fname = "ds4.wire.crc32";
    const void *p = NULL;
    size_t n = 0;
    if (lua_type(L, 1) == LUA_TSTRING) {
        p = lua_tolstring(L, 1, &n);
    } else {
        ds4_tensor *t = ds4l_tensor_test(L, 1);
        if (!t)
            ds4l_raise(L, "%s: bad argument #1 (string or ds4 tensor expected, got %s)", fname, luaL_typename(L, 1));
        p = t->data;
        n = t->nbytes;
    }
    double c = 0;
    if (!lua_isnoneornil(L, 2)) {
        c = lua_tonumber(L, 2);
        if (lua_type(L, 2) != LUA_TNUMBER || c != floor(c) || c < 0 || c > U32_MAX_D)
            ds4l_raise(L, "%s: bad argument #2 (a CRC in 0..2^32-1 expected, got %s)", fname, show(L, 2));
    }
    lua_pushnumber(L, (lua_Number)ds4_crc32((uint32_t)c, p, n));
    return 1;
}

/* ds4.wire.error_message(code, reason, ref_t [, ref_id, ref_n]) -> frames of an error message. code: a name
 * ("state", or what decode returned) or a number. */
static int l_error_message(lua_State *L) {
    const char *fname = "ds4.wire.error_message";
    uint32_t code = 0;
    if (lua_type(L, 1) == LUA_TSTRING) {
        const char *s = lua_tostring(L, 1);
        for (int i = 0; i < N_CODES; i++)
            if (strcmp(s, CODES[i].name) == 0) code = CODES[i].code;
        if (!code)
            ds4l_raise(L, "%s: bad argument #1 (\"%s\" is not an error code name; see ds4.wire.codes)", fname, s);
    } else if (lua_type(L, 1) == LUA_TNUMBER) {
        double d = lua_tonumber(L, 1);
        if (d != floor(d) || d < 1 || d > 65535)
            ds4l_raise(L, "%s: bad argument #1 (error code 1..65535 expected, got %s)", fname, show(L, 1));
        code = (uint32_t)d;
    } else {
        ds4l_raise(L, "%s: bad argument #1 (error code name or number expected, got %s)", fname, luaL_typename(L, 1));
    }
    const char *reason = NULL, *ref_t = NULL;
    if (!lua_isnoneornil(L, 2)) {
        if (lua_type(L, 2) != LUA_TSTRING)
            ds4l_raise(L, "%s: bad argument #2 (reason string expected, got %s)", fname, luaL_typename(L, 2));
        reason = lua_tostring(L, 2);
    }
    if (!lua_isnoneornil(L, 3)) {
        if (lua_type(L, 3) != LUA_TSTRING)
            ds4l_raise(L, "%s: bad argument #3 (ref_t string expected, got %s)", fname, luaL_typename(L, 3));
        ref_t = lua_tostring(L, 3);
    }
    double ids[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        int idx = 4 + k;
        if (lua_isnoneornil(L, idx)) continue;
        double v = lua_tonumber(L, idx), hi = k ? U32_MAX_D : MAX_EXACT;
        if (lua_type(L, idx) != LUA_TNUMBER || v != floor(v) || v < 0 || v > hi)
            ds4l_raise(L, "%s: bad argument #%d (%s: an integer in 0..%.0f expected, got %s)", fname, idx,
                       k ? "ref_n" : "ref_id", hi, show(L, idx));
        ids[k] = v;
    }
    ds4_wire_msg *m = lua_newuserdata(L, sizeof *m);
    /* a reason with a NUL byte is cut there; the ref_t to its 32 bytes by ds4_wire_make_error */
    ds4_wire_make_error(m, (ds4_wire_code)code, reason, ref_t, (uint64_t)ids[0], (uint32_t)ids[1]);
    return push_encoded(L, fname, m);
}

static int l_default_limits(lua_State *L) {
    ds4_wire_limits l = ds4_wire_default_limits();
    lua_createtable(L, 0, N_LIMITS);
    for (int i = 0; i < N_LIMITS; i++) ds4l_set_num(L, LIMIT_NAMES[i].name, get_limit(&l, i));
    return 1;
}

static int l_code_name(lua_State *L) {
    double v = lua_tonumber(L, 1);
    if (lua_type(L, 1) != LUA_TNUMBER || v != floor(v) || v < 0 || v > U32_MAX_D)
        ds4l_raise(L, "ds4.wire.code_name: bad argument #1 (error code expected, got %s)", show(L, 1));
    lua_pushstring(L, ds4_wire_error_name((uint32_t)v));
    return 1;
}

static const luaL_Reg wire_functions[] = {
    {"encode", l_encode},
    {"decode", l_decode},
    {"crc32", l_crc32},
    {"error_message", l_error_message},
    {"default_limits", l_default_limits},
    {"code_name", l_code_name},
    {NULL, NULL},
};

void ds4l_wire_open(lua_State *L) {
    ds4l_class(L, OUT_MT, NULL, out_gc, NULL);
    lua_pop(L, 1);
    lua_newtable(L);
    for (const luaL_Reg *r = wire_functions; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_createtable(L, 0, N_CODES);
    for (int i = 0; i < N_CODES; i++) ds4l_set_num(L, CODES[i].name, CODES[i].code);
    lua_setfield(L, -2, "codes");
    lua_createtable(L, DS4_WIRE_TYPE_COUNT - 1, 0);
    for (int i = 1; i < DS4_WIRE_TYPE_COUNT; i++) {
        lua_pushstring(L, TYPES[i].name);
        lua_rawseti(L, -2, i);
    }
    lua_setfield(L, -2, "types");
    ds4l_set_num(L, "VERSION", DS4_WIRE_VERSION);
    lua_setfield(L, -2, "wire");
}
