/* wire.c — the rollout wire codec (rollout/protocol.md; API in wire.h).
 *
 * Decoding untrusted headers with msgpack-c: msgpack-c allocates n · sizeof(msgpack_object) for an array or
 * map the moment it reads the container's declared length, before any element arrives (msgpack-c issue
 * #1013: five bytes can ask for ~96 GB), and its C API has no limit parameter. So the header is first walked
 * by prescan(), which allocates nothing: every length is checked against the bytes that remain, every declared
 * element must actually be present (the walk consumes at least one byte per object), nesting is bounded, ext
 * types are refused and the object must end exactly at the end of the frame. Only a header that passed is
 * handed to msgpack_unpack_next; its allocations are then at most one msgpack_object (24 bytes) per byte of
 * the header plus the zone's chunk overhead, and the header is at most max_header_bytes.
 *
 * Every header field of every message is declared once, in the field table (ds4_wire_fields: key, nested map,
 * kind, range, where in the struct, its Lua name and default): the decoder reads, the encoder writes and the
 * equality compares by walking it, as the Lua binding (lua/wire_lua.c) fills and pushes. A nested map may be
 * optional as a whole (DS4_WIRE_F_OPT_MAP: weight_announce.adapter, there exactly when its first field is not 0).
 * What a table row cannot say stays per type: arrays and shapes (its OTHER rows), raw frames and cross-field rules
 * (check_*). */
#define _POSIX_C_SOURCE 200809L /* strnlen */
#include <stdarg.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "internal.h"
#include "wire.h"

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the rollout wire codec reads and writes little-endian frames in place: little-endian hosts only"
#endif

#define MAP_MAX 32       /* entries in any map of a header */
#define DEPTH_MAX 8      /* container nesting of a header */
#define WORKER_ID_MAX 64 /* bytes of hello.worker */
#define REF_T_MAX 32     /* bytes of error.ref_t */
#define U32_MAX 0xffffffffull
#define I32_MAX 0x7fffffffll

/* ------------------------------------------------------------------------------------------------ names */

static const char *const TYPE_NAMES[DS4_WIRE_TYPE_COUNT] = {
    "none", "hello", "credit", "task", "samples", "weight_announce", "weight_request", "weight_chunk",
    "heartbeat", "error", "bye", "partial",
};

const char *ds4_wire_type_name(ds4_wire_type t) {
    return (unsigned)t < DS4_WIRE_TYPE_COUNT ? TYPE_NAMES[t] : "none";
}

const char *ds4_wire_error_name(uint32_t code) {
    switch (code) {
    case DS4_WIRE_OK: return "ok";
    case DS4_WIRE_EARG: return "bad_argument";
    case DS4_WIRE_ENOMEM: return "no_memory";
    case DS4_WIRE_ELIMIT: return "limit";
    case DS4_WIRE_EPARSE: return "parse";
    case DS4_WIRE_ETRAILING: return "trailing";
    case DS4_WIRE_ENOTMAP: return "not_map";
    case DS4_WIRE_EVERSION: return "version";
    case DS4_WIRE_ETYPE: return "type";
    case DS4_WIRE_EMISSING: return "missing";
    case DS4_WIRE_EKEY: return "key";
    case DS4_WIRE_EDUP: return "duplicate";
    case DS4_WIRE_EVALTYPE: return "value_type";
    case DS4_WIRE_ERANGE: return "range";
    case DS4_WIRE_EFRAME: return "frame";
    case DS4_WIRE_ECOUNT: return "count";
    case DS4_WIRE_ECRC: return "crc";
    case DS4_WIRE_ESTATE: return "state";
    case DS4_WIRE_ESTALE: return "stale";
    case DS4_WIRE_EREFUSED: return "refused";
    case DS4_WIRE_EINTERNAL: return "internal";
    }
    return "unknown";
}

/* ------------------------------------------------------------------------------------------------ limits */

ds4_wire_limits ds4_wire_default_limits(void) {
    ds4_wire_limits l;
    l.max_header_bytes = 65536;
    l.max_frame_bytes = (size_t)1 << 30;
    l.max_frames = 16;
    l.max_str_bytes = 256;
    l.max_prompt_tokens = 4096;
    l.max_samples = 64;
    l.max_stop_ids = 64;
    l.max_gen_tokens = (uint64_t)1 << 20;
    l.max_chunk_bytes = 16u << 20;
    l.max_weight_bytes = (uint64_t)1 << 44;
    return l;
}

/* The capacities: the most any limit may be set to. The encoder validates against these. */
static ds4_wire_limits cap_limits(void) {
    ds4_wire_limits l;
    l.max_header_bytes = (size_t)1 << 20;
#if SIZE_MAX > 0xffffffffu
    l.max_frame_bytes = (size_t)1 << 40;
#else
    l.max_frame_bytes = SIZE_MAX / 2;
#endif
    l.max_frames = DS4_WIRE_FRAMES_CAP;
    l.max_str_bytes = DS4_WIRE_STR_CAP;
    l.max_prompt_tokens = (uint32_t)I32_MAX;
    l.max_samples = DS4_WIRE_SAMPLES_CAP;
    l.max_stop_ids = DS4_WIRE_STOP_CAP;
    l.max_gen_tokens = (uint64_t)1 << 31;
    l.max_chunk_bytes = 1u << 30;
    l.max_weight_bytes = DS4_WIRE_MAX_ID;
    return l;
}

/* 1 when every limit is in [1, cap]; else 0 with the offending field in why. */
static int limits_ok(const ds4_wire_limits *l, char *why, size_t cap) {
    ds4_wire_limits c = cap_limits();
#define LIM(f)                                                                                          \
    if (l->f < 1 || l->f > c.f) {                                                                       \
        snprintf(why, cap, "limit " #f " = %llu is outside [1, %llu]", (unsigned long long)l->f,        \
                 (unsigned long long)c.f);                                                              \
        return 0;                                                                                       \
    }
    LIM(max_header_bytes) LIM(max_frame_bytes) LIM(max_frames) LIM(max_str_bytes) LIM(max_prompt_tokens)
    LIM(max_samples) LIM(max_stop_ids) LIM(max_gen_tokens) LIM(max_chunk_bytes) LIM(max_weight_bytes)
#undef LIM
    return 1;
}

/* ------------------------------------------------------------------------------------------------ decode ctx */

typedef struct dx {
    const ds4_wire_limits *lim;
    ds4_error *err;
    const char *tn; /* the message type for error messages; "header" until "t" is known */
} dx;

static ds4_wire_code dfail(dx *d, ds4_wire_code c, const char *fmt, ...) DS4_PRINTF(3, 4);
static ds4_wire_code dfail(dx *d, ds4_wire_code c, const char *fmt, ...) {
    if (d->err) {
        char buf[800];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        ds4_status s = c == DS4_WIRE_EARG ? DS4_ERR_ARG : c == DS4_WIRE_ENOMEM ? DS4_ERR_OOM : DS4_ERR_FORMAT;
        ds4_fail(d->err, s, "wire decode: %s: %s", d->tn, buf);
    }
    return c;
}

/* Untrusted bytes for a message: at most 40 of them, non-printable ones as '?', "..." when cut. */
static const char *san(const char *p, size_t n, char *buf, size_t cap) {
    size_t k = 0, max = cap > 4 ? cap - 4 : 0;
    if (max > 40) max = 40;
    for (; k < n && k < max; k++) buf[k] = (p[k] >= 0x20 && p[k] < 0x7f) ? p[k] : '?';
    if (k < n) {
        memcpy(buf + k, "...", 3);
        k += 3;
    }
    buf[k] = 0;
    return buf;
}

static const char *otype(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "unsigned integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "float";
    case MSGPACK_OBJECT_STR: return "str";
    case MSGPACK_OBJECT_ARRAY: return "array";
    case MSGPACK_OBJECT_MAP: return "map";
    case MSGPACK_OBJECT_BIN: return "bin";
    case MSGPACK_OBJECT_EXT: return "ext";
    }
    return "?";
}

/* ------------------------------------------------------------------------------------------------ prescan */

/* Walk one msgpack object spanning exactly p[0..n) without allocating (see the top of this file). */
static ds4_wire_code prescan(dx *d, const unsigned char *p, size_t n) {
    uint64_t left[DEPTH_MAX + 1]; /* objects still to read at each nesting level */
    int depth = 0;
    size_t i = 0;
    left[0] = 1;
    for (;;) {
        while (depth >= 0 && left[depth] == 0) depth--;
        if (depth < 0) break;
        left[depth]--;
        if (i >= n) return dfail(d, DS4_WIRE_EPARSE, "truncated: its %zu bytes end inside an object", n);
        size_t at = i;
        unsigned b = p[i++];
        uint64_t len = 0, cnt = 0;
        unsigned lenbytes = 0;
        int container = 0; /* 1 array, 2 map */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, bool: the type byte is the object */
        } else if (b <= 0x8f) {
            container = 2;
            cnt = 2 * (uint64_t)(b & 0x0f);
        } else if (b <= 0x9f) {
            container = 1;
            cnt = b & 0x0f;
        } else if (b <= 0xbf) {
            len = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4: case 0xd9: lenbytes = 1; break; /* bin8, str8 */
            case 0xc5: case 0xda: lenbytes = 2; break; /* bin16, str16 */
            case 0xc6: case 0xdb: lenbytes = 4; break; /* bin32, str32 */
            case 0xca: len = 4; break;                 /* float32 */
            case 0xcb: len = 8; break;                 /* float64 */
            case 0xcc: case 0xd0: len = 1; break;      /* (u)int8 */
            case 0xcd: case 0xd1: len = 2; break;      /* (u)int16 */
            case 0xce: case 0xd2: len = 4; break;      /* (u)int32 */
            case 0xcf: case 0xd3: len = 8; break;      /* (u)int64 */
            case 0xdc: lenbytes = 2; container = 1; break;
            case 0xdd: lenbytes = 4; container = 1; break;
            case 0xde: lenbytes = 2; container = 2; break;
            case 0xdf: lenbytes = 4; container = 2; break;
            case 0xc1:
                return dfail(d, DS4_WIRE_EPARSE, "byte 0x%02x at header offset %zu is not a msgpack type", b, at);
            default: /* 0xc7-0xc9 ext8/16/32, 0xd4-0xd8 fixext */
                return dfail(d, DS4_WIRE_EPARSE, "ext type (byte 0x%02x) at header offset %zu: not used by the protocol",
                             b, at);
            }
        }
        if (lenbytes) {
            if (n - i < lenbytes)
                return dfail(d, DS4_WIRE_EPARSE, "truncated: the length of the object at offset %zu is cut", at);
            uint64_t v = 0;
            for (unsigned k = 0; k < lenbytes; k++) v = v << 8 | p[i++];
            if (container == 2) cnt = 2 * v;
            else if (container == 1) cnt = v;
            else len = v;
        }
        if (len > n - i)
            return dfail(d, DS4_WIRE_EPARSE,
                         "truncated: the object at offset %zu needs %llu more bytes, %zu remain", at,
                         (unsigned long long)len, n - i);
        i += (size_t)len;
        if (container && cnt) {
            /* every element takes at least one byte: a count larger than what remains cannot be honest */
            if (cnt > n - i)
                return dfail(d, DS4_WIRE_EPARSE,
                             "truncated: the %s at offset %zu declares %llu entries, %zu bytes remain",
                             container == 2 ? "map" : "array", at,
                             (unsigned long long)(container == 2 ? cnt / 2 : cnt), n - i);
            if (depth + 1 > DEPTH_MAX)
                return dfail(d, DS4_WIRE_ELIMIT, "containers nested deeper than %d (at header offset %zu)", DEPTH_MAX,
                             at);
            left[++depth] = cnt;
        }
    }
    if (i != n)
        return dfail(d, DS4_WIRE_ETRAILING, "%zu trailing bytes after the %zu-byte header object", n - i, i);
    return DS4_WIRE_OK;
}

/* ------------------------------------------------------------------------------------------------ schema */

static int key_is(const msgpack_object *k, const char *s) {
    size_t n = strlen(s);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, s, n) == 0;
}

/* The value of key in map o (a checked map: no duplicates), or NULL. */
static const msgpack_object *mget(const msgpack_object *o, const char *key) {
    for (uint32_t i = 0; i < o->via.map.size; i++)
        if (key_is(&o->via.map.ptr[i].key, key)) return &o->via.map.ptr[i].val;
    return NULL;
}

static void fname(char *buf, size_t cap, const char *path, const char *key) {
    if (path && path[0]) snprintf(buf, cap, "%s.%s", path, key);
    else snprintf(buf, cap, "%s", key);
}

/* o must be a map of at most MAP_MAX entries whose keys are distinct strings, each one of keys[0..nkeys). */
static ds4_wire_code check_map(dx *d, const msgpack_object *o, const char *path, const char *const *keys,
                               int nkeys) {
    char sb[64];
    if (o->type != MSGPACK_OBJECT_MAP) return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be a map, got %s", path, otype(o));
    uint32_t n = o->via.map.size;
    if (n > MAP_MAX)
        return dfail(d, DS4_WIRE_ELIMIT, "%s%smap has %u entries, at most %d", path, path[0] ? " " : "", n, MAP_MAX);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *k = &o->via.map.ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return dfail(d, DS4_WIRE_EKEY, "%s%skey %u is not a string (%s)", path, path[0] ? " " : "", i, otype(k));
        for (uint32_t j = 0; j < i; j++) {
            const msgpack_object *kj = &o->via.map.ptr[j].key;
            if (kj->via.str.size == k->via.str.size && memcmp(kj->via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
                return dfail(d, DS4_WIRE_EDUP, "duplicate key '%s%s%s'", path, path[0] ? "." : "",
                             san(k->via.str.ptr, k->via.str.size, sb, sizeof sb));
        }
        int known = 0;
        for (int j = 0; j < nkeys && !known; j++) known = key_is(k, keys[j]);
        if (!known)
            return dfail(d, DS4_WIRE_EKEY, "unknown key '%s%s%s'", path, path[0] ? "." : "",
                         san(k->via.str.ptr, k->via.str.size, sb, sizeof sb));
    }
    return DS4_WIRE_OK;
}

static ds4_wire_code as_uint(dx *d, const msgpack_object *o, const char *name, uint64_t lo, uint64_t hi,
                             uint64_t *out) {
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return dfail(d, DS4_WIRE_ERANGE, "'%s' = %lld is out of range [%llu, %llu]", name, (long long)o->via.i64,
                     (unsigned long long)lo, (unsigned long long)hi);
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be an unsigned integer, got %s", name, otype(o));
    if (o->via.u64 < lo || o->via.u64 > hi)
        return dfail(d, DS4_WIRE_ERANGE, "'%s' = %llu is out of range [%llu, %llu]", name,
                     (unsigned long long)o->via.u64, (unsigned long long)lo, (unsigned long long)hi);
    *out = o->via.u64;
    return DS4_WIRE_OK;
}

static ds4_wire_code as_int(dx *d, const msgpack_object *o, const char *name, int64_t lo, int64_t hi, int64_t *out) {
    int64_t v;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) v = o->via.i64;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)hi)
            return dfail(d, DS4_WIRE_ERANGE, "'%s' = %llu is out of range [%lld, %lld]", name,
                         (unsigned long long)o->via.u64, (long long)lo, (long long)hi);
        v = (int64_t)o->via.u64;
    } else
        return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be an integer, got %s", name, otype(o));
    if (v < lo || v > hi)
        return dfail(d, DS4_WIRE_ERANGE, "'%s' = %lld is out of range [%lld, %lld]", name, (long long)v, (long long)lo,
                     (long long)hi);
    *out = v;
    return DS4_WIRE_OK;
}

/* A number: float32/float64, or an integer (Lua encoders may write 1 for 1.0). NaN fails the range check. */
static ds4_wire_code as_f64(dx *d, const msgpack_object *o, const char *name, double lo, double hi, double *out) {
    double v;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64) v = o->via.f64;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) v = (double)o->via.u64;
    else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) v = (double)o->via.i64;
    else return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be a number, got %s", name, otype(o));
    if (!(v >= lo && v <= hi)) return dfail(d, DS4_WIRE_ERANGE, "'%s' = %g is out of range [%g, %g]", name, v, lo, hi);
    *out = v;
    return DS4_WIRE_OK;
}

/* A string of minlen..maxlen bytes (over maxlen: ELIMIT), no NUL, copied into dst[cap] (cap > maxlen). */
static ds4_wire_code as_str(dx *d, const msgpack_object *o, const char *name, size_t minlen, size_t maxlen,
                            char *dst, size_t cap) {
    if (o->type != MSGPACK_OBJECT_STR) return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be a string, got %s", name, otype(o));
    size_t n = o->via.str.size;
    if (n > maxlen) return dfail(d, DS4_WIRE_ELIMIT, "string '%s' is %zu bytes, limit %zu", name, n, maxlen);
    if (n < minlen) return dfail(d, DS4_WIRE_ERANGE, "string '%s' is %zu bytes, at least %zu wanted", name, n, minlen);
    if (n && memchr(o->via.str.ptr, 0, n)) return dfail(d, DS4_WIRE_ERANGE, "string '%s' contains a NUL byte", name);
    if (n >= cap) return dfail(d, DS4_WIRE_EARG, "string '%s': %zu bytes do not fit a %zu-byte field", name, n, cap);
    if (n) memcpy(dst, o->via.str.ptr, n);
    dst[n] = 0;
    return DS4_WIRE_OK;
}

/* Key lookups: required keys fail with EMISSING, optional ones leave *out as it was (the caller's default). */
#define GET(map, path, key, req, name)                                                                 \
    const msgpack_object *o_ = mget((map), (key));                                                     \
    char name[96];                                                                                     \
    fname(name, sizeof name, (path), (key));                                                           \
    if (!o_) return (req) ? dfail(d, DS4_WIRE_EMISSING, "missing required key '%s'", name) : DS4_WIRE_OK;

static ds4_wire_code g_u64(dx *d, const msgpack_object *map, const char *path, const char *key, int req, uint64_t lo,
                           uint64_t hi, uint64_t *out) {
    GET(map, path, key, req, name)
    return as_uint(d, o_, name, lo, hi, out);
}

static ds4_wire_code g_u32(dx *d, const msgpack_object *map, const char *path, const char *key, int req, uint64_t lo,
                           uint64_t hi, uint32_t *out) {
    uint64_t v = *out;
    ds4_wire_code c = g_u64(d, map, path, key, req, lo, hi > U32_MAX ? U32_MAX : hi, &v);
    *out = (uint32_t)v;
    return c;
}

static ds4_wire_code g_f64(dx *d, const msgpack_object *map, const char *path, const char *key, int req, double lo,
                           double hi, double *out) {
    GET(map, path, key, req, name)
    return as_f64(d, o_, name, lo, hi, out);
}

static ds4_wire_code g_bool(dx *d, const msgpack_object *map, const char *path, const char *key, int req,
                            uint8_t *out) {
    GET(map, path, key, req, name)
    if (o_->type != MSGPACK_OBJECT_BOOLEAN)
        return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be a bool, got %s", name, otype(o_));
    *out = o_->via.boolean ? 1 : 0;
    return DS4_WIRE_OK;
}

static ds4_wire_code g_str(dx *d, const msgpack_object *map, const char *path, const char *key, int req,
                           size_t minlen, size_t maxlen, char *dst, size_t cap) {
    GET(map, path, key, req, name)
    return as_str(d, o_, name, minlen, maxlen, dst, cap);
}

/* An array of at most max elements (more: ELIMIT); *items NULL when optional and absent. */
static ds4_wire_code g_arr(dx *d, const msgpack_object *map, const char *path, const char *key, int req, uint32_t max,
                           const msgpack_object **items, uint32_t *n) {
    *items = NULL;
    *n = 0;
    GET(map, path, key, req, name)
    if (o_->type != MSGPACK_OBJECT_ARRAY)
        return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be an array, got %s", name, otype(o_));
    if (o_->via.array.size > max)
        return dfail(d, DS4_WIRE_ELIMIT, "'%s' has %u elements, limit %u", name, o_->via.array.size, max);
    *items = o_->via.array.ptr;
    *n = o_->via.array.size;
    if (!*items) *items = o_; /* empty array: a non-NULL marker that it was present */
    return DS4_WIRE_OK;
}

static ds4_wire_code g_map(dx *d, const msgpack_object *map, const char *key, const char *const *keys, int nkeys,
                           const msgpack_object **out) {
    const msgpack_object *o = mget(map, key);
    if (!o) return dfail(d, DS4_WIRE_EMISSING, "missing required key '%s'", key);
    *out = o;
    return check_map(d, o, key, keys, nkeys);
}

#define TRY(x)                                    \
    do {                                          \
        ds4_wire_code c_ = (x);                   \
        if (c_ != DS4_WIRE_OK) return c_;         \
    } while (0)

static int mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    if (a && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ frames */

enum { FR_I32 = 0, FR_F32 = 1, FR_U8 = 2 };
static const char *const DTYPE_NAMES[] = {"i32", "f32", "u8"};
#define ANY_COUNT UINT64_MAX /* fspec.count of a frame whose size only its declaration gives (bounded by
                                max_frame_bytes): the announce's model frames */

typedef struct fspec {
    const char *name;  /* declared name */
    uint64_t count;    /* elements the header's fields imply, or ANY_COUNT */
    const char *from;  /* what they are derived from, for messages */
    int dtype;         /* FR_I32, FR_F32, FR_U8 */
} fspec;

/* The "f" declarations against the actual frames and against the counts the header implies. */
static ds4_wire_code check_frames(dx *d, const msgpack_object *root, int nframes, const size_t *lens, const fspec *sp,
                                  int nsp) {
    const msgpack_object *items;
    uint32_t nd;
    TRY(g_arr(d, root, "", "f", nsp > 0, d->lim->max_frames, &items, &nd));
    if ((uint64_t)nd + 1 != (uint64_t)nframes)
        return dfail(d, DS4_WIRE_EFRAME, "the header declares %u raw frames, the message has %d", nd, nframes - 1);
    if ((int)nd != nsp)
        return dfail(d, DS4_WIRE_EFRAME, "%u raw frames declared and sent, a %s message with these fields has %d", nd,
                     d->tn, nsp);
    for (uint32_t k = 0; k < nd; k++) {
        const msgpack_object *e = &items[k];
        char sb[64], nm[32];
        snprintf(nm, sizeof nm, "f[%u]", k);
        if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size != 3)
            return dfail(d, DS4_WIRE_EVALTYPE, "'%s' must be a [name, dtype, count] array, got %s", nm, otype(e));
        const msgpack_object *en = &e->via.array.ptr[0], *et = &e->via.array.ptr[1], *ec = &e->via.array.ptr[2];
        const char *dt = DTYPE_NAMES[sp[k].dtype];
        size_t esz = sp[k].dtype == FR_U8 ? 1 : 4;
        if (en->type != MSGPACK_OBJECT_STR || et->type != MSGPACK_OBJECT_STR)
            return dfail(d, DS4_WIRE_EVALTYPE, "'%s': name and dtype must be strings, got %s and %s", nm, otype(en),
                         otype(et));
        if (!key_is(en, sp[k].name))
            return dfail(d, DS4_WIRE_EFRAME, "raw frame %u is declared '%s', expected '%s'", k + 1,
                         san(en->via.str.ptr, en->via.str.size, sb, sizeof sb), sp[k].name);
        if (!key_is(et, dt))
            return dfail(d, DS4_WIRE_EFRAME, "raw frame %u '%s' is declared dtype '%s', expected '%s'", k + 1,
                         sp[k].name, san(et->via.str.ptr, et->via.str.size, sb, sizeof sb), dt);
        uint64_t cnt;
        TRY(as_uint(d, ec, nm, 0, UINT64_MAX, &cnt));
        size_t len = lens[k + 1];
        if (len % esz)
            return dfail(d, DS4_WIRE_EFRAME, "raw frame %u '%s' is %zu bytes, not a multiple of 4 (%s)", k + 1,
                         sp[k].name, len, dt);
        if (cnt != len / esz)
            return dfail(d, DS4_WIRE_EFRAME, "raw frame %u '%s' is declared %llu %s elements, the frame holds %zu (%zu bytes)",
                         k + 1, sp[k].name, (unsigned long long)cnt, dt, len / esz, len);
        if (sp[k].count != ANY_COUNT && cnt != sp[k].count)
            return dfail(d, DS4_WIRE_ECOUNT, "raw frame %u '%s' holds %llu elements, %s gives %llu", k + 1, sp[k].name,
                         (unsigned long long)cnt, sp[k].from, (unsigned long long)sp[k].count);
    }
    return DS4_WIRE_OK;
}

static ds4_wire_view view_of(int k, const void *const *frames, const size_t *lens) {
    ds4_wire_view v = {frames[k], lens[k]};
    return v;
}

/* ------------------------------------------------------------------------------------------------ fields */

/* The field table of rollout/wire.h: one row per header field, in the encoder's key order. Ranges are protocol.md
 * §3's; strings marked STRLIM are also bounded by max_str_bytes. */
#define MAX_ID DS4_WIRE_MAX_ID
#define REQ DS4_WIRE_F_REQ
#define STRLIM DS4_WIRE_F_STRLIM
#define LREQ DS4_WIRE_F_LUA_REQ
#define CALC DS4_WIRE_F_LUA_CALC
#define OWN DS4_WIRE_F_LUA_OWN
#define OPTM DS4_WIRE_F_OPT_MAP
#define AT(T, f) .offset = offsetof(T, f), .size = sizeof(((T *)0)->f)
#define U64(T, name, map, key, lua, flags, lo, hi, f) {name, map, key, lua, DS4_WIRE_K_U64, flags, lo, hi, AT(T, f)}
#define U32(T, name, map, key, lua, flags, lo, hi, f) {name, map, key, lua, DS4_WIRE_K_U32, flags, lo, hi, AT(T, f)}
#define F64(T, name, map, key, flags, lo, hi, d, f)                                                                    \
    {name, map, key, key, DS4_WIRE_K_F64, flags, .flo = lo, .fhi = hi, .def = d, AT(T, f)}
#define BOOL(T, name, map, key, f) {name, map, key, key, DS4_WIRE_K_BOOL, 0, AT(T, f)}
#define STR(T, name, map, key, flags, lo, hi, sd, f) {name, map, key, key, DS4_WIRE_K_STR, flags, lo, hi, .sdef = sd, AT(T, f)}
#define OTHER(name, map, key, lua) {name, map, key, lua, DS4_WIRE_K_OTHER, .flags = 0}

static const ds4_wire_field F_HELLO[] = {
    STR(ds4_wire_hello, "hello.worker", NULL, "worker", REQ | LREQ | STRLIM, 1, WORKER_ID_MAX, NULL, worker),
    U32(ds4_wire_hello, "hello.caps.max_batch", "caps", "max_batch", "max_batch", REQ | LREQ, 1, 65536, max_batch),
    U32(ds4_wire_hello, "hello.caps.threads", "caps", "threads", "threads", REQ | LREQ, 1, 4096, threads),
    U32(ds4_wire_hello, "hello.caps.vocab_size", "caps", "vocab_size", "vocab_size", REQ | LREQ, 0, I32_MAX, vocab_size),
    U64(ds4_wire_hello, "hello.caps.n_params", "caps", "n_params", "n_params", REQ | LREQ, 0, MAX_ID, n_params),
    U32(ds4_wire_hello, "hello.caps.config_crc", "caps", "config_crc", "config_crc", REQ, 0, U32_MAX, config_crc),
    U32(ds4_wire_hello, "hello.caps.tables_crc", "caps", "tables_crc", "tables_crc", REQ, 0, U32_MAX, tables_crc),
    STR(ds4_wire_hello, "hello.caps.build", "caps", "build", REQ | STRLIM, 0, DS4_WIRE_STR_CAP, NULL, build),
    U64(ds4_wire_hello, "hello.policy", NULL, "policy", "policy", REQ, 0, MAX_ID, policy),
};
static const ds4_wire_field F_CREDIT[] = {
    U32(ds4_wire_credit, "credit.n", NULL, "n", "n", REQ | LREQ, 1, 65536, n),
};
static const ds4_wire_field F_TASK[] = {
    U64(ds4_wire_task, "task.task", NULL, "task", "task_id", REQ | LREQ, 0, MAX_ID, task_id),
    U32(ds4_wire_task, "task.attempt", NULL, "attempt", "attempt", REQ, 0, U32_MAX, attempt),
    U64(ds4_wire_task, "task.policy", NULL, "policy", "policy", REQ | LREQ, 0, MAX_ID, policy),
    U32(ds4_wire_task, "task.sampling.max_new_tokens", "sampling", "max_new_tokens", "max_new_tokens", REQ | LREQ, 1,
        U32_MAX, max_new_tokens),
    F64(ds4_wire_task, "task.sampling.temperature", "sampling", "temperature", REQ, 0.0, 1000.0, 1.0, temperature),
    U32(ds4_wire_task, "task.sampling.top_k", "sampling", "top_k", "top_k", REQ, 0, I32_MAX, top_k),
    F64(ds4_wire_task, "task.sampling.top_p", "sampling", "top_p", REQ, 0.0, 1.0, 1.0, top_p),
    F64(ds4_wire_task, "task.sampling.min_p", "sampling", "min_p", REQ, 0.0, 1.0, 0.0, min_p),
    {"task.sampling.n", "sampling", "n", "n", DS4_WIRE_K_U32, REQ, 1, U32_MAX, .def = 1, AT(ds4_wire_task, n)},
    U64(ds4_wire_task, "task.sampling.seed", "sampling", "seed", "seed", REQ, 0, UINT64_MAX, seed),
    OTHER("task.sampling.stop", "sampling", "stop", "stop"),
    OTHER("task.sampling.stop_strings", "sampling", "stop_strings", "stop_strings"),
    BOOL(ds4_wire_task, "task.sampling.ignore_eos", "sampling", "ignore_eos", ignore_eos),
    BOOL(ds4_wire_task, "task.sampling.record_experts", "sampling", "record_experts", record_experts),
    BOOL(ds4_wire_task, "task.sampling.record_index", "sampling", "record_index", record_index),
    U32(ds4_wire_task, "task.sampling.stream", "sampling", "stream", "stream", 0, 0, 1u << 20, stream),
    U32(ds4_wire_task, "task.prompt_len", NULL, "prompt_len", "prompt_len", REQ | CALC, 1, U32_MAX, prompt_len),
};
static const ds4_wire_field F_SAMPLES[] = {
    U64(ds4_wire_samples, "samples.task", NULL, "task", "task_id", REQ | LREQ, 0, MAX_ID, task_id),
    U32(ds4_wire_samples, "samples.attempt", NULL, "attempt", "attempt", REQ, 0, U32_MAX, attempt),
    U64(ds4_wire_samples, "samples.policy", NULL, "policy", "policy", REQ | LREQ, 0, MAX_ID, policy),
    U32(ds4_wire_samples, "samples.n", NULL, "n", "n", REQ | OWN, 1, U32_MAX, n),
    OTHER("samples.prompt_len[]", NULL, "prompt_len", NULL),
    OTHER("samples.gen[]", NULL, "gen", NULL),
    OTHER("samples.finish[]", NULL, "finish", NULL),
    OTHER("samples.stop_index[]", NULL, "stop_index", NULL),
    OTHER("samples.rows[]", NULL, "rows", NULL),
    OTHER("samples.experts_shape", NULL, "experts_shape", NULL),
    OTHER("samples.index_shape", NULL, "index_shape", NULL),
    BOOL(ds4_wire_samples, "samples.token_versions", NULL, "token_versions", token_versions),
};
static const ds4_wire_field F_PARTIAL[] = {
    U64(ds4_wire_samples, "partial.task", NULL, "task", "task_id", REQ | LREQ, 0, MAX_ID, task_id),
    U32(ds4_wire_samples, "partial.attempt", NULL, "attempt", "attempt", REQ, 0, U32_MAX, attempt),
    U64(ds4_wire_samples, "partial.policy", NULL, "policy", "policy", REQ | LREQ, 0, MAX_ID, policy),
    U32(ds4_wire_samples, "partial.n", NULL, "n", "n", REQ | OWN, 1, U32_MAX, n),
    OTHER("partial.offset[]", NULL, "offset", NULL),
    OTHER("partial.gen[]", NULL, "gen", NULL),
    BOOL(ds4_wire_samples, "partial.token_versions", NULL, "token_versions", token_versions),
};
static const ds4_wire_field F_ANNOUNCE[] = {
    U64(ds4_wire_weight_announce, "weight_announce.version", NULL, "version", "version", REQ | LREQ, 1, MAX_ID, version),
    U64(ds4_wire_weight_announce, "weight_announce.bytes", NULL, "bytes", "bytes", REQ | CALC, 4, MAX_ID, bytes),
    U32(ds4_wire_weight_announce, "weight_announce.chunk", NULL, "chunk", "chunk", REQ | LREQ, 4, U32_MAX, chunk),
    U32(ds4_wire_weight_announce, "weight_announce.chunks", NULL, "chunks", "chunks", REQ | CALC, 1, U32_MAX, chunks),
    U64(ds4_wire_weight_announce, "weight_announce.layout.n_params", "layout", "n_params", "n_params", REQ | LREQ, 1,
        MAX_ID, n_params),
    STR(ds4_wire_weight_announce, "weight_announce.layout.dtype", "layout", "dtype", REQ, 1,
        sizeof(((ds4_wire_weight_announce *)0)->dtype) - 1, "f32", dtype),
    U32(ds4_wire_weight_announce, "weight_announce.crc", NULL, "crc", "crc", REQ | LREQ, 0, U32_MAX, crc),
    U32(ds4_wire_weight_announce, "weight_announce.model.config_crc", "model", "config_crc", "config_crc", REQ | CALC, 0,
        U32_MAX, config_crc),
    U32(ds4_wire_weight_announce, "weight_announce.model.tokenizer_crc", "model", "tokenizer_crc", "tokenizer_crc",
        REQ | CALC, 0, U32_MAX, tokenizer_crc),
    U32(ds4_wire_weight_announce, "weight_announce.model.tables_crc", "model", "tables_crc", "tables_crc", REQ | CALC, 0,
        U32_MAX, tables_crc),
    STR(ds4_wire_weight_announce, "weight_announce.model.chat_template", "model", "chat_template", REQ | STRLIM, 0,
        DS4_WIRE_TEMPLATE_CAP, NULL, chat_template),
    /* a LoRA policy (version 4): the map is there exactly when rank is not 0; its Lua keys are flat (lora_*) */
    U32(ds4_wire_weight_announce, "weight_announce.adapter.rank", "adapter", "rank", "lora_rank", REQ | LREQ | OPTM, 1,
        65536, lora_rank),
    {"weight_announce.adapter.alpha", "adapter", "alpha", "lora_alpha", DS4_WIRE_K_F64, REQ | LREQ | OPTM, .flo = -1e30,
     .fhi = 1e30, AT(ds4_wire_weight_announce, lora_alpha)},
    {"weight_announce.adapter.rslora", "adapter", "rslora", "lora_rslora", DS4_WIRE_K_BOOL, REQ | OPTM,
     AT(ds4_wire_weight_announce, lora_rslora)},
    U64(ds4_wire_weight_announce, "weight_announce.adapter.base_version", "adapter", "base_version", "lora_base_version",
        REQ | LREQ | OPTM, 1, MAX_ID, base_version),
    U32(ds4_wire_weight_announce, "weight_announce.adapter.base_chunk", "adapter", "base_chunk", "lora_base_chunk",
        REQ | LREQ | OPTM, 4, U32_MAX, base_chunk),
    U32(ds4_wire_weight_announce, "weight_announce.adapter.base_crc", "adapter", "base_crc", "lora_base_crc",
        REQ | LREQ | OPTM, 0, U32_MAX, base_crc),
};
static const ds4_wire_field F_REQUEST[] = {
    U64(ds4_wire_weight_request, "weight_request.version", NULL, "version", "version", REQ | LREQ, 1, MAX_ID, version),
    U32(ds4_wire_weight_request, "weight_request.index", NULL, "index", "index", REQ | LREQ, 0, U32_MAX, index),
};
static const ds4_wire_field F_CHUNK[] = {
    U64(ds4_wire_weight_chunk, "weight_chunk.version", NULL, "version", "version", REQ | LREQ, 1, MAX_ID, version),
    U32(ds4_wire_weight_chunk, "weight_chunk.index", NULL, "index", "index", REQ | LREQ, 0, U32_MAX, index),
    U64(ds4_wire_weight_chunk, "weight_chunk.offset", NULL, "offset", "offset", REQ | CALC, 0, MAX_ID, offset),
    U64(ds4_wire_weight_chunk, "weight_chunk.bytes", NULL, "bytes", "bytes", REQ | LREQ, 4, MAX_ID, bytes),
    U32(ds4_wire_weight_chunk, "weight_chunk.chunk", NULL, "chunk", "chunk", REQ | LREQ, 4, U32_MAX, chunk),
    U32(ds4_wire_weight_chunk, "weight_chunk.crc", NULL, "crc", "crc", REQ | CALC, 0, U32_MAX, crc),
};
static const ds4_wire_field F_HEARTBEAT[] = {
    U64(ds4_wire_heartbeat, "heartbeat.policy", NULL, "policy", "policy", REQ | LREQ, 0, MAX_ID, policy),
    U32(ds4_wire_heartbeat, "heartbeat.active", NULL, "active", "active", REQ, 0, U32_MAX, active),
};
static const ds4_wire_field F_ERROR[] = {
    U32(ds4_wire_errmsg, "error.code", NULL, "code", "code", REQ | OWN, 1, 65535, code),
    STR(ds4_wire_errmsg, "error.reason", NULL, "reason", REQ | STRLIM, 0, DS4_WIRE_STR_CAP, NULL, reason),
    STR(ds4_wire_errmsg, "error.ref_t", NULL, "ref_t", STRLIM, 0, REF_T_MAX, NULL, ref_t),
    U64(ds4_wire_errmsg, "error.ref_id", NULL, "ref_id", "ref_id", 0, 0, MAX_ID, ref_id),
    U32(ds4_wire_errmsg, "error.ref_n", NULL, "ref_n", "ref_n", 0, 0, U32_MAX, ref_n),
};
static const ds4_wire_field F_BYE[] = {
    STR(ds4_wire_bye, "bye.reason", NULL, "reason", STRLIM, 0, DS4_WIRE_STR_CAP, NULL, reason),
};
#undef MAX_ID
#undef REQ
#undef STRLIM
#undef LREQ
#undef CALC
#undef OWN
#undef OPTM
#undef AT
#undef U64
#undef U32
#undef F64
#undef BOOL
#undef STR
#undef OTHER

const ds4_wire_field *ds4_wire_fields(ds4_wire_type t, int *n) {
#define T(F) (*n = (int)(sizeof F / sizeof F[0]), F)
    switch (t) {
    case DS4_WIRE_HELLO: return T(F_HELLO);
    case DS4_WIRE_CREDIT: return T(F_CREDIT);
    case DS4_WIRE_TASK: return T(F_TASK);
    case DS4_WIRE_SAMPLES: return T(F_SAMPLES);
    case DS4_WIRE_WEIGHT_ANNOUNCE: return T(F_ANNOUNCE);
    case DS4_WIRE_WEIGHT_REQUEST: return T(F_REQUEST);
    case DS4_WIRE_WEIGHT_CHUNK: return T(F_CHUNK);
    case DS4_WIRE_HEARTBEAT: return T(F_HEARTBEAT);
    case DS4_WIRE_ERROR: return T(F_ERROR);
    case DS4_WIRE_BYE: return T(F_BYE);
    case DS4_WIRE_PARTIAL: return T(F_PARTIAL);
    default: *n = 0; return NULL;
    }
#undef T
}

/* The fields' struct inside a message: every struct of the union starts at its address. */
static void *body(ds4_wire_msg *m) { return (char *)m + offsetof(ds4_wire_msg, hello); }
static const void *cbody(const ds4_wire_msg *m) { return (const char *)m + offsetof(ds4_wire_msg, hello); }

/* Field i opens a nested map (its first field there). */
static int opens_map(const ds4_wire_field *f, int i) {
    return f[i].map && (i == 0 || !f[i - 1].map || strcmp(f[i - 1].map, f[i].map) != 0);
}

/* The keys allowed in the header map of type t (map NULL: v, t, f, its fields' keys and its nested maps' keys)
 * or in its nested map `map`. */
static int map_keys(ds4_wire_type t, const char *map, const char **keys, int cap) {
    int nf, n = 0;
    const ds4_wire_field *f = ds4_wire_fields(t, &nf);
    if (!map) keys[n++] = "v", keys[n++] = "t", keys[n++] = "f";
    for (int i = 0; i < nf && n < cap; i++) {
        if (!map && !f[i].map) keys[n++] = f[i].key;
        else if (!map && opens_map(f, i)) keys[n++] = f[i].map;
        else if (map && f[i].map && strcmp(f[i].map, map) == 0) keys[n++] = f[i].key;
    }
    return n;
}

/* Field f's value in the struct at p is not zero. */
static int nonzero(const ds4_wire_field *f, const void *p) {
    switch (f->kind) {
    case DS4_WIRE_K_U64: return *(const uint64_t *)p != 0;
    case DS4_WIRE_K_U32: return *(const uint32_t *)p != 0;
    case DS4_WIRE_K_F64: return *(const double *)p != 0.0;
    case DS4_WIRE_K_BOOL: return *(const uint8_t *)p != 0;
    case DS4_WIRE_K_STR: return *(const char *)p != 0;
    default: return 1;
    }
}

/* The nested map holding row f (of type t's table) is in m: always, unless it is an optional map whose first field
 * is 0. */
static int map_present(const ds4_wire_msg *m, const ds4_wire_field *f) {
    if (!f->map || !(f->flags & DS4_WIRE_F_OPT_MAP)) return 1;
    int nf;
    const ds4_wire_field *t = ds4_wire_fields(m->type, &nf);
    if (!t || f < t || f >= t + nf) return 1; /* not a row of m's type: not one of its optional maps */
    int i = (int)(f - t);
    while (i > 0 && !opens_map(t, i)) i--;
    return nonzero(&t[i], (const char *)m + offsetof(ds4_wire_msg, hello) + t[i].offset);
}

/* ------------------------------------------------------------------------------------------------ per type */

typedef struct dargs {
    const msgpack_object *root;
    int nframes;
    const void *const *frames;
    const size_t *lens;
    int verify_crc;
} dargs;

/* Read field f (not OTHER) from map into p, with its range, its length and limits. */
static ds4_wire_code dec_field(dx *d, const msgpack_object *map, const ds4_wire_field *f, void *p) {
    const int req = (f->flags & DS4_WIRE_F_REQ) != 0;
    const char *path = f->map ? f->map : "";
    size_t hi = (size_t)f->hi;
    switch (f->kind) {
    case DS4_WIRE_K_U64: return g_u64(d, map, path, f->key, req, f->lo, f->hi, p);
    case DS4_WIRE_K_U32: return g_u32(d, map, path, f->key, req, f->lo, f->hi, p);
    case DS4_WIRE_K_F64: return g_f64(d, map, path, f->key, req, f->flo, f->fhi, p);
    case DS4_WIRE_K_BOOL: return g_bool(d, map, path, f->key, req, p);
    case DS4_WIRE_K_STR:
        if ((f->flags & DS4_WIRE_F_STRLIM) && d->lim->max_str_bytes < hi) hi = d->lim->max_str_bytes;
        return g_str(d, map, path, f->key, req, (size_t)f->lo, hi, p, f->size);
    default: return DS4_WIRE_OK;
    }
}

/* The header map's keys, then every field of type t (a nested map's keys when it is reached) into base. Fields of
 * kind OTHER, the cross-field rules and the frames are the type's check below. */
static ds4_wire_code dec_fields(dx *d, ds4_wire_type t, const msgpack_object *root, void *base) {
    const char *keys[MAP_MAX + 3];
    TRY(check_map(d, root, "", keys, map_keys(t, NULL, keys, MAP_MAX + 3)));
    int nf;
    const ds4_wire_field *f = ds4_wire_fields(t, &nf);
    const msgpack_object *map = root;
    for (int i = 0; i < nf; i++) {
        if (opens_map(f, i) && (f[i].flags & DS4_WIRE_F_OPT_MAP) && !mget(root, f[i].map)) {
            while (i + 1 < nf && f[i + 1].map && strcmp(f[i + 1].map, f[i].map) == 0) i++; /* absent: its fields 0 */
            continue;
        }
        if (opens_map(f, i)) {
            const char *mk[MAP_MAX];
            TRY(g_map(d, root, f[i].map, mk, map_keys(t, f[i].map, mk, MAP_MAX), &map));
        } else if (!f[i].map) {
            map = root;
        }
        TRY(dec_field(d, map, &f[i], (char *)base + f[i].offset));
    }
    return DS4_WIRE_OK;
}

static ds4_wire_code check_hello(dx *d, const dargs *a, ds4_wire_hello *m) {
    for (const char *p = m->worker; *p; p++)
        if (*p <= 0x20 || *p >= 0x7f)
            return dfail(d, DS4_WIRE_ERANGE, "'worker' must be printable ASCII without spaces (byte 0x%02x)",
                         (unsigned char)*p);
    if ((m->vocab_size == 0) != (m->n_params == 0))
        return dfail(d, DS4_WIRE_ERANGE, "caps.vocab_size = %u and caps.n_params = %llu: both 0 (no model) or neither",
                     m->vocab_size, (unsigned long long)m->n_params);
    return check_frames(d, a->root, a->nframes, a->lens, NULL, 0);
}

static ds4_wire_code check_task(dx *d, const dargs *a, ds4_wire_task *m) {
    const ds4_wire_limits *L = d->lim;
    const msgpack_object *s = mget(a->root, "sampling"), *stop = NULL, *strs = NULL;
    if (m->max_new_tokens > L->max_gen_tokens)
        return dfail(d, DS4_WIRE_ELIMIT, "sampling.max_new_tokens = %u, limit %llu", m->max_new_tokens,
                     (unsigned long long)L->max_gen_tokens);
    if (m->n > L->max_samples)
        return dfail(d, DS4_WIRE_ELIMIT, "sampling.n = %u samples, limit %u", m->n, L->max_samples);
    if ((uint64_t)m->n * m->max_new_tokens > L->max_gen_tokens)
        return dfail(d, DS4_WIRE_ELIMIT,
                     "sampling.n * max_new_tokens = %u * %u tokens could not be returned in one samples message "
                     "(limit %llu generated tokens)",
                     m->n, m->max_new_tokens, (unsigned long long)L->max_gen_tokens);
    TRY(g_arr(d, s, "sampling", "stop", 0, L->max_stop_ids, &stop, &m->n_stop));
    for (uint32_t i = 0; i < m->n_stop; i++) {
        char nm[32];
        int64_t v;
        snprintf(nm, sizeof nm, "sampling.stop[%u]", i);
        TRY(as_int(d, &stop[i], nm, 0, I32_MAX, &v));
        m->stop[i] = (int32_t)v;
    }
    TRY(g_arr(d, s, "sampling", "stop_strings", 0, DS4_WIRE_STOP_STR_CAP, &strs, &m->n_stop_str));
    for (uint32_t i = 0; i < m->n_stop_str; i++) {
        char nm[40];
        snprintf(nm, sizeof nm, "sampling.stop_strings[%u]", i);
        TRY(as_str(d, &strs[i], nm, 1, DS4_WIRE_STOP_STR_BYTES, m->stop_str[i], sizeof m->stop_str[i]));
    }
    if (m->prompt_len > L->max_prompt_tokens)
        return dfail(d, DS4_WIRE_ELIMIT, "prompt_len = %u tokens, limit %u", m->prompt_len, L->max_prompt_tokens);
    fspec sp[1] = {{"prompt", m->prompt_len, "prompt_len", 0}};
    TRY(check_frames(d, a->root, a->nframes, a->lens, sp, 1));
    m->prompt = view_of(1, a->frames, a->lens);
    return DS4_WIRE_OK;
}

/* A per-sample array of exactly n elements. */
static ds4_wire_code g_per_sample(dx *d, const msgpack_object *root, const char *key, int req, uint32_t n,
                                  const msgpack_object **items) {
    uint32_t k;
    TRY(g_arr(d, root, "", key, req, d->lim->max_samples, items, &k));
    if (*items && k != n) return dfail(d, DS4_WIRE_ECOUNT, "'%s' has %u elements, n = %u samples", key, k, n);
    return DS4_WIRE_OK;
}

/* The policy_lag frame (token_versions) of a samples or partial message: each token's version policy - lag is in
 * [1, policy]. */
static ds4_wire_code check_lags(dx *d, const ds4_wire_samples *m, uint64_t sum_gen) {
    for (uint64_t j = 0; j < sum_gen; j++) {
        const int32_t lag = ds4_wire_i32(m->policy_lag, j);
        if (lag < 0 || (uint64_t)lag >= m->policy)
            return dfail(d, DS4_WIRE_ERANGE, "policy_lag[%llu] = %d: a token's version policy - lag must be in "
                         "[1, policy = %llu]", (unsigned long long)j, lag, (unsigned long long)m->policy);
    }
    return DS4_WIRE_OK;
}

/* An optional [a, b] shape with a in 1..amax, b in 1..bmax. */
static ds4_wire_code g_shape(dx *d, const msgpack_object *root, const char *key, uint64_t amax, uint64_t bmax,
                             uint32_t *a, uint32_t *b) {
    const msgpack_object *it;
    uint32_t k;
    uint64_t x, y;
    char nm[48];
    TRY(g_arr(d, root, "", key, 0, 2, &it, &k));
    if (!it) return DS4_WIRE_OK;
    if (k != 2) return dfail(d, DS4_WIRE_ECOUNT, "'%s' has %u elements, wanted 2", key, k);
    snprintf(nm, sizeof nm, "%s[0]", key);
    TRY(as_uint(d, &it[0], nm, 1, amax, &x));
    snprintf(nm, sizeof nm, "%s[1]", key);
    TRY(as_uint(d, &it[1], nm, 1, bmax, &y));
    *a = (uint32_t)x;
    *b = (uint32_t)y;
    return DS4_WIRE_OK;
}

static ds4_wire_code check_samples(dx *d, const dargs *a, ds4_wire_samples *m) {
    const ds4_wire_limits *L = d->lim;
    const msgpack_object *pl, *gen, *fin, *si, *rows;
    char nm[48];
    if (m->n > L->max_samples)
        return dfail(d, DS4_WIRE_ELIMIT, "n = %u samples in one message, limit %u", m->n, L->max_samples);
    TRY(g_shape(d, a->root, "experts_shape", 256, 256, &m->experts_layers, &m->experts_k));
    TRY(g_shape(d, a->root, "index_shape", 256, 65536, &m->index_layers, &m->index_topk));
    int routed = m->experts_layers || m->index_layers;
    TRY(g_per_sample(d, a->root, "prompt_len", 1, m->n, &pl));
    TRY(g_per_sample(d, a->root, "gen", 1, m->n, &gen));
    TRY(g_per_sample(d, a->root, "finish", 1, m->n, &fin));
    TRY(g_per_sample(d, a->root, "stop_index", 1, m->n, &si));
    TRY(g_per_sample(d, a->root, "rows", routed, m->n, &rows));
    if (rows && !routed)
        return dfail(d, DS4_WIRE_ERANGE, "'rows' without experts_shape or index_shape (no routing frames)");
    uint64_t sum_gen = 0, sum_rows = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        ds4_wire_seq *q = &m->seq[i];
        uint64_t v;
        int64_t iv;
        snprintf(nm, sizeof nm, "prompt_len[%u]", i);
        TRY(as_uint(d, &pl[i], nm, 1, U32_MAX, &v));
        if (v > L->max_prompt_tokens)
            return dfail(d, DS4_WIRE_ELIMIT, "prompt_len[%u] = %llu tokens, limit %u", i, (unsigned long long)v,
                         L->max_prompt_tokens);
        q->prompt_len = (uint32_t)v;
        snprintf(nm, sizeof nm, "gen[%u]", i);
        TRY(as_uint(d, &gen[i], nm, 0, U32_MAX, &v));
        sum_gen += v;
        if (sum_gen > L->max_gen_tokens)
            return dfail(d, DS4_WIRE_ELIMIT, "gen[0..%u] add up to %llu generated tokens, limit %llu per message", i,
                         (unsigned long long)sum_gen, (unsigned long long)L->max_gen_tokens);
        q->n_gen = (uint32_t)v;
        snprintf(nm, sizeof nm, "finish[%u]", i);
        TRY(as_uint(d, &fin[i], nm, DS4_FINISH_LENGTH, DS4_FINISH_CANCELLED, &v));
        q->finish = (uint32_t)v;
        snprintf(nm, sizeof nm, "stop_index[%u]", i);
        TRY(as_int(d, &si[i], nm, -1, I32_MAX, &iv));
        q->stop_index = (int32_t)iv;
        int stopped = q->finish == DS4_FINISH_STOP_TOKEN || q->finish == DS4_FINISH_STOP_STRING;
        if (stopped != (q->stop_index >= 0))
            return dfail(d, DS4_WIRE_ERANGE, "stop_index[%u] = %d with finish[%u] = %s (>= 0 exactly for stop_token "
                         "and stop_string)", i, q->stop_index, i, ds4_finish_name((ds4_finish)q->finish));
        if (rows) {
            snprintf(nm, sizeof nm, "rows[%u]", i);
            TRY(as_uint(d, &rows[i], nm, 0, (uint64_t)q->prompt_len + q->n_gen, &v));
            q->n_rows = (uint32_t)v;
            sum_rows += v;
        }
    }
    fspec sp[6] = {
        {"tokens", sum_gen, "the sum of gen", 0},
        {"logprobs", sum_gen, "the sum of gen", 1},
        {"sample_logprobs", sum_gen, "the sum of gen", 1},
    };
    int nsp = 3;
    if (m->token_versions) sp[nsp++] = (fspec){"policy_lag", sum_gen, "the sum of gen", 0};
    uint64_t c;
    if (m->experts_layers) {
        if (!mul_u64(sum_rows, (uint64_t)m->experts_layers * m->experts_k, &c))
            return dfail(d, DS4_WIRE_ELIMIT, "experts frame of %llu rows x %u x %u elements overflows",
                         (unsigned long long)sum_rows, m->experts_layers, m->experts_k);
        sp[nsp++] = (fspec){"experts", c, "sum(rows) * L * K", 0};
    }
    if (m->index_layers) {
        if (!mul_u64(sum_rows, (uint64_t)m->index_layers * m->index_topk, &c))
            return dfail(d, DS4_WIRE_ELIMIT, "index frame of %llu rows x %u x %u elements overflows",
                         (unsigned long long)sum_rows, m->index_layers, m->index_topk);
        sp[nsp++] = (fspec){"index", c, "sum(rows) * n_csa * topk", 0};
    }
    TRY(check_frames(d, a->root, a->nframes, a->lens, sp, nsp));
    m->tokens = view_of(1, a->frames, a->lens);
    m->logprobs = view_of(2, a->frames, a->lens);
    m->sample_logprobs = view_of(3, a->frames, a->lens);
    int k = 4;
    if (m->token_versions) {
        m->policy_lag = view_of(k++, a->frames, a->lens);
        TRY(check_lags(d, m, sum_gen));
    }
    if (m->experts_layers) m->experts = view_of(k++, a->frames, a->lens);
    if (m->index_layers) m->index = view_of(k++, a->frames, a->lens);
    return DS4_WIRE_OK;
}

/* A running task's newest tokens (version 5): per sample, how many were sent before (offset) and how many follow;
 * with token_versions (version 6) each token's version as in samples. */
static ds4_wire_code check_partial(dx *d, const dargs *a, ds4_wire_samples *m) {
    const ds4_wire_limits *L = d->lim;
    const msgpack_object *off, *gen;
    char nm[48];
    if (m->n > L->max_samples)
        return dfail(d, DS4_WIRE_ELIMIT, "n = %u samples in one message, limit %u", m->n, L->max_samples);
    TRY(g_per_sample(d, a->root, "offset", 1, m->n, &off));
    TRY(g_per_sample(d, a->root, "gen", 1, m->n, &gen));
    uint64_t sum_gen = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        uint64_t v;
        snprintf(nm, sizeof nm, "offset[%u]", i);
        TRY(as_uint(d, &off[i], nm, 0, L->max_gen_tokens, &v));
        m->seq[i].offset = (uint32_t)v;
        snprintf(nm, sizeof nm, "gen[%u]", i);
        TRY(as_uint(d, &gen[i], nm, 0, U32_MAX, &v));
        sum_gen += v;
        if (sum_gen > L->max_gen_tokens)
            return dfail(d, DS4_WIRE_ELIMIT, "gen[0..%u] add up to %llu tokens, limit %llu per message", i,
                         (unsigned long long)sum_gen, (unsigned long long)L->max_gen_tokens);
        m->seq[i].n_gen = (uint32_t)v;
    }
    fspec sp[4] = {
        {"tokens", sum_gen, "the sum of gen", 0},
        {"logprobs", sum_gen, "the sum of gen", 1},
        {"sample_logprobs", sum_gen, "the sum of gen", 1},
        {"policy_lag", sum_gen, "the sum of gen", 0},
    };
    TRY(check_frames(d, a->root, a->nframes, a->lens, sp, m->token_versions ? 4 : 3));
    m->tokens = view_of(1, a->frames, a->lens);
    m->logprobs = view_of(2, a->frames, a->lens);
    m->sample_logprobs = view_of(3, a->frames, a->lens);
    if (m->token_versions) {
        m->policy_lag = view_of(4, a->frames, a->lens);
        TRY(check_lags(d, m, sum_gen));
    }
    return DS4_WIRE_OK;
}

/* bytes / chunk / chunks consistency shared by announce and chunk. */
static ds4_wire_code weight_geometry(dx *d, uint64_t bytes, uint32_t chunk, uint64_t *chunks) {
    if (bytes > d->lim->max_weight_bytes)
        return dfail(d, DS4_WIRE_ELIMIT, "weights of %llu bytes, limit %llu", (unsigned long long)bytes,
                     (unsigned long long)d->lim->max_weight_bytes);
    if (chunk > d->lim->max_chunk_bytes)
        return dfail(d, DS4_WIRE_ELIMIT, "weight chunk size %u bytes, limit %u", chunk, d->lim->max_chunk_bytes);
    if (chunk % 4 || bytes % 4)
        return dfail(d, DS4_WIRE_ERANGE, "bytes = %llu and chunk = %u must be multiples of 4 (f32)",
                     (unsigned long long)bytes, chunk);
    *chunks = bytes / chunk + (bytes % chunk != 0);
    if (*chunks > U32_MAX)
        return dfail(d, DS4_WIRE_ERANGE, "%llu bytes in chunks of %u make %llu chunks, at most 2^32 - 1",
                     (unsigned long long)bytes, chunk, (unsigned long long)*chunks);
    return DS4_WIRE_OK;
}

/* A LoRA policy's "adapter" map against the rest (version 4): its base is an older version of n_params f32. */
static ds4_wire_code check_adapter(dx *d, const ds4_wire_weight_announce *m) {
    uint64_t chunks;
    if (m->base_version >= m->version)
        return dfail(d, DS4_WIRE_ERANGE, "adapter.base_version = %llu is not older than the version %llu",
                     (unsigned long long)m->base_version, (unsigned long long)m->version);
    if (m->n_params > DS4_WIRE_MAX_ID / 4)
        return dfail(d, DS4_WIRE_ERANGE, "layout.n_params = %llu is too large for f32 bytes",
                     (unsigned long long)m->n_params);
    return weight_geometry(d, 4 * m->n_params, m->base_chunk, &chunks); /* the base: n_params f32 */
}

static ds4_wire_code check_announce(dx *d, const dargs *a, ds4_wire_weight_announce *m) {
    uint64_t chunks;
    if (strcmp(m->dtype, "f32") != 0)
        return dfail(d, DS4_WIRE_ERANGE, "layout.dtype '%s' is not supported (only \"f32\")", m->dtype);
    TRY(weight_geometry(d, m->bytes, m->chunk, &chunks));
    if (m->chunks != chunks)
        return dfail(d, DS4_WIRE_ERANGE, "chunks = %u, but %llu bytes in chunks of %u make %llu", m->chunks,
                     (unsigned long long)m->bytes, m->chunk, (unsigned long long)chunks);
    if (m->lora_rank) TRY(check_adapter(d, m)); /* bytes: the adapters', whose count the layout gives */
    else if (m->bytes / 4 != m->n_params)
        return dfail(d, DS4_WIRE_ERANGE, "bytes = %llu is not layout.n_params = %llu times 4 (f32)",
                     (unsigned long long)m->bytes, (unsigned long long)m->n_params);
    fspec sp[4] = {{"config", ANY_COUNT, "", FR_U8}, {"tokenizer", ANY_COUNT, "", FR_U8},
                   {"tables", ANY_COUNT, "", FR_I32}, {"lora_masks", ANY_COUNT, "", FR_I32}};
    TRY(check_frames(d, a->root, a->nframes, a->lens, sp, m->lora_rank ? 4 : 3));
    m->config = view_of(1, a->frames, a->lens);
    m->tokenizer = view_of(2, a->frames, a->lens);
    m->tables = view_of(3, a->frames, a->lens);
    if (m->lora_rank) {
        m->lora_masks = view_of(4, a->frames, a->lens);
        if (m->lora_masks.len < 4)
            return dfail(d, DS4_WIRE_ERANGE, "the lora_masks frame is empty: a LoRA policy adapts at least one layer");
    }
    if (m->config.len < 2) /* "{}" at least: a worker without local files builds its model from it */
        return dfail(d, DS4_WIRE_ERANGE, "the config frame is %zu bytes, a JSON object needs at least 2",
                     m->config.len);
    if (a->verify_crc) {
        /* a worker builds its model from these: a corrupted table would route tokens to other experts silently */
        const struct { const char *name; ds4_wire_view v; uint32_t want; } f[3] = {
            {"config", m->config, m->config_crc}, {"tokenizer", m->tokenizer, m->tokenizer_crc},
            {"tables", m->tables, m->tables_crc}};
        for (int k = 0; k < 3; k++) {
            uint32_t crc = ds4_crc32(0, f[k].v.data, f[k].v.len);
            if (crc != f[k].want)
                return dfail(d, DS4_WIRE_ECRC, "the %s frame (%zu bytes): CRC-32 %08x, model.%s_crc says %08x",
                             f[k].name, f[k].v.len, crc, f[k].name, f[k].want);
        }
    }
    return DS4_WIRE_OK;
}

/* The chunk limit is tighter than the frame limit: an oversized payload is refused before anything else. */
static ds4_wire_code precheck_chunk(dx *d, int nframes, const size_t *lens) {
    for (int k = 1; k < nframes; k++)
        if (lens[k] > d->lim->max_chunk_bytes)
            return dfail(d, DS4_WIRE_ELIMIT, "raw frame %d is %zu bytes, over the weight chunk limit of %u bytes", k,
                         lens[k], d->lim->max_chunk_bytes);
    return DS4_WIRE_OK;
}

static ds4_wire_code check_chunk(dx *d, const dargs *a, ds4_wire_weight_chunk *m) {
    uint64_t chunks;
    TRY(weight_geometry(d, m->bytes, m->chunk, &chunks));
    if (m->offset >= m->bytes)
        return dfail(d, DS4_WIRE_ERANGE, "chunk offset %llu is beyond the announced size of %llu bytes",
                     (unsigned long long)m->offset, (unsigned long long)m->bytes);
    if (m->index >= chunks)
        return dfail(d, DS4_WIRE_ERANGE, "chunk index %u, but the weights have %llu chunks", m->index,
                     (unsigned long long)chunks);
    if (m->offset != (uint64_t)m->index * m->chunk)
        return dfail(d, DS4_WIRE_ERANGE, "chunk %u starts at byte %llu, not index * chunk = %llu", m->index,
                     (unsigned long long)m->offset, (unsigned long long)m->index * m->chunk);
    uint64_t want = m->bytes - m->offset < m->chunk ? m->bytes - m->offset : m->chunk;
    fspec sp[1] = {{"weights", want / 4, "min(chunk, bytes - offset) / 4", 1}};
    TRY(check_frames(d, a->root, a->nframes, a->lens, sp, 1));
    m->data = view_of(1, a->frames, a->lens);
    if (a->verify_crc) {
        uint32_t crc = ds4_crc32(0, m->data.data, m->data.len);
        if (crc != m->crc)
            return dfail(d, DS4_WIRE_ECRC, "chunk %u (%zu bytes at offset %llu): CRC-32 %08x, the header says %08x",
                         m->index, m->data.len, (unsigned long long)m->offset, crc, m->crc);
    }
    return DS4_WIRE_OK;
}

/* ------------------------------------------------------------------------------------------------ decode */

static ds4_wire_code decode_impl(const ds4_wire_limits *lim, int nframes, const void *const *frames,
                                 const size_t *lens, ds4_wire_msg *out, ds4_error *err, int verify_crc) {
    ds4_wire_limits deflim = ds4_wire_default_limits();
    dx d = {lim ? lim : &deflim, err, "header"};
    char why[160];
    if (!out) return dfail(&d, DS4_WIRE_EARG, "out is NULL");
    memset(out, 0, sizeof *out);
    if (lim && !limits_ok(lim, why, sizeof why)) return dfail(&d, DS4_WIRE_EARG, "%s", why);
    lim = d.lim;
    /* 1. frame count and every frame length against the limits, before reading any of them */
    if (nframes < 1) return dfail(&d, DS4_WIRE_EFRAME, "a message of %d frames (the header frame is missing)", nframes);
    if ((uint32_t)nframes > lim->max_frames)
        return dfail(&d, DS4_WIRE_ELIMIT, "%d frames in one message, limit %u (header included)", nframes,
                     lim->max_frames);
    if (!frames || !lens) return dfail(&d, DS4_WIRE_EARG, "frames or lens is NULL");
    if (lens[0] > lim->max_header_bytes)
        return dfail(&d, DS4_WIRE_ELIMIT, "header frame of %zu bytes, limit %zu", lens[0], lim->max_header_bytes);
    for (int k = 1; k < nframes; k++)
        if (lens[k] > lim->max_frame_bytes)
            return dfail(&d, DS4_WIRE_ELIMIT, "raw frame %d is %zu bytes, limit %zu", k, lens[k], lim->max_frame_bytes);
    for (int k = 0; k < nframes; k++)
        if (!frames[k] && lens[k]) return dfail(&d, DS4_WIRE_EARG, "frame %d: NULL data of %zu bytes", k, lens[k]);
    /* 2. the header: a map, then the allocation-free walk, then msgpack-c */
    const unsigned char *h = frames[0];
    size_t hn = lens[0];
    if (hn == 0) return dfail(&d, DS4_WIRE_EPARSE, "empty header frame");
    if (!((h[0] >= 0x80 && h[0] <= 0x8f) || h[0] == 0xde || h[0] == 0xdf))
        return dfail(&d, DS4_WIRE_ENOTMAP, "the header must be a msgpack map, its first byte is 0x%02x", h[0]);
    ds4_wire_code c = prescan(&d, h, hn);
    if (c != DS4_WIRE_OK) return c;
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    msgpack_unpack_return r = msgpack_unpack_next(&up, (const char *)h, hn, &off);
    if (r == MSGPACK_UNPACK_NOMEM_ERROR) {
        c = dfail(&d, DS4_WIRE_ENOMEM, "msgpack-c ran out of memory on a %zu-byte header", hn);
        goto done;
    }
    if (r != MSGPACK_UNPACK_SUCCESS || off != hn || up.data.type != MSGPACK_OBJECT_MAP) {
        c = dfail(&d, DS4_WIRE_EPARSE, "msgpack-c rejected the %zu-byte header (result %d, %zu bytes used)", hn, (int)r,
                  off);
        goto done;
    }
    const msgpack_object *root = &up.data;
    if (root->via.map.size > MAP_MAX) {
        c = dfail(&d, DS4_WIRE_ELIMIT, "header map has %u entries, at most %d", root->via.map.size, MAP_MAX);
        goto done;
    }
    /* 3. version, then type: a peer speaking another version may use other keys and types altogether */
    const msgpack_object *v = mget(root, "v"), *t = mget(root, "t");
    if (!v) {
        c = dfail(&d, DS4_WIRE_EMISSING, "missing required key 'v' (protocol version)");
        goto done;
    }
    if (v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ||
        (v->type == MSGPACK_OBJECT_POSITIVE_INTEGER && v->via.u64 != DS4_WIRE_VERSION)) {
        if (v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
            c = dfail(&d, DS4_WIRE_EVERSION, "protocol version %lld, this build speaks version %d",
                      (long long)v->via.i64, DS4_WIRE_VERSION);
        else
            c = dfail(&d, DS4_WIRE_EVERSION, "protocol version %llu, this build speaks version %d",
                      (unsigned long long)v->via.u64, DS4_WIRE_VERSION);
        goto done;
    }
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
        c = dfail(&d, DS4_WIRE_EVALTYPE, "'v' must be an unsigned integer, got %s", otype(v));
        goto done;
    }
    if (!t) {
        c = dfail(&d, DS4_WIRE_EMISSING, "missing required key 't' (message type)");
        goto done;
    }
    if (t->type != MSGPACK_OBJECT_STR) {
        c = dfail(&d, DS4_WIRE_EVALTYPE, "'t' must be a string, got %s", otype(t));
        goto done;
    }
    ds4_wire_type ty = DS4_WIRE_NONE;
    for (int k = 1; k < DS4_WIRE_TYPE_COUNT; k++)
        if (key_is(t, TYPE_NAMES[k])) ty = (ds4_wire_type)k;
    if (ty == DS4_WIRE_NONE) {
        char sb[64];
        c = dfail(&d, DS4_WIRE_ETYPE, "unknown message type '%s'", san(t->via.str.ptr, t->via.str.size, sb, sizeof sb));
        goto done;
    }
    d.tn = TYPE_NAMES[ty];
    /* 4. the type's schema (its fields, then its own rules), then its frames */
    dargs a = {root, nframes, frames, lens, verify_crc};
    c = ty == DS4_WIRE_WEIGHT_CHUNK ? precheck_chunk(&d, nframes, lens) : DS4_WIRE_OK;
    if (c == DS4_WIRE_OK) c = dec_fields(&d, ty, root, body(out));
    if (c == DS4_WIRE_OK) switch (ty) {
        case DS4_WIRE_HELLO: c = check_hello(&d, &a, &out->hello); break;
        case DS4_WIRE_TASK: c = check_task(&d, &a, &out->task); break;
        case DS4_WIRE_SAMPLES: c = check_samples(&d, &a, &out->samples); break;
        case DS4_WIRE_PARTIAL: c = check_partial(&d, &a, &out->partial); break;
        case DS4_WIRE_WEIGHT_ANNOUNCE: c = check_announce(&d, &a, &out->announce); break;
        case DS4_WIRE_WEIGHT_CHUNK: c = check_chunk(&d, &a, &out->chunk); break;
        default: c = check_frames(&d, root, nframes, lens, NULL, 0); break; /* no frames, no rules of their own */
        }
    if (c != DS4_WIRE_OK) memset(out, 0, sizeof *out);
    out->type = ty;
done:
    msgpack_unpacked_destroy(&up);
    if (c != DS4_WIRE_OK && out->type == DS4_WIRE_NONE) memset(out, 0, sizeof *out);
    return c;
}

ds4_wire_code ds4_wire_decode(const ds4_wire_limits *lim, int nframes, const void *const *frames, const size_t *lens,
                              ds4_wire_msg *out, ds4_error *err) {
    return decode_impl(lim, nframes, frames, lens, out, err, 1);
}

/* ------------------------------------------------------------------------------------------------ equality */

static int view_eq(ds4_wire_view a, ds4_wire_view b) { return a.len == b.len && (a.len == 0 || a.data == b.data); }
static int dbl_eq(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }
static int str_eq(const char *a, const char *b, size_t cap) { return strncmp(a, b, cap) == 0; }

static int field_eq(const ds4_wire_field *f, const void *x, const void *y) {
    switch (f->kind) {
    case DS4_WIRE_K_U64: return *(const uint64_t *)x == *(const uint64_t *)y;
    case DS4_WIRE_K_U32: return *(const uint32_t *)x == *(const uint32_t *)y;
    case DS4_WIRE_K_F64: return dbl_eq(*(const double *)x, *(const double *)y);
    case DS4_WIRE_K_BOOL: return *(const uint8_t *)x == *(const uint8_t *)y;
    case DS4_WIRE_K_STR: return str_eq(x, y, f->size);
    default: return 1;
    }
}

int ds4_wire_equal(const ds4_wire_msg *a, const ds4_wire_msg *b, const char **field) {
    const char *f = NULL;
#define EQ(cond, name)      \
    if (!f && !(cond)) f = name;
#define F(x) (a->x == b->x)
    EQ(F(type), "type")
    int nf = 0;
    const ds4_wire_field *fl = f ? NULL : ds4_wire_fields(a->type, &nf);
    for (int i = 0; i < nf && !f; i++)
        EQ(field_eq(&fl[i], (const char *)cbody(a) + fl[i].offset, (const char *)cbody(b) + fl[i].offset), fl[i].name)
    /* arrays, shapes and frames */
    if (!f) switch (a->type) {
        case DS4_WIRE_TASK: {
            const ds4_wire_task *x = &a->task, *y = &b->task;
            EQ(F(task.n_stop), "task.sampling.stop (count)")
            for (uint32_t i = 0; !f && i < x->n_stop && i < DS4_WIRE_STOP_CAP; i++)
                EQ(x->stop[i] == y->stop[i], "task.sampling.stop[]")
            EQ(F(task.n_stop_str), "task.sampling.stop_strings (count)")
            for (uint32_t i = 0; !f && i < x->n_stop_str && i < DS4_WIRE_STOP_STR_CAP; i++)
                EQ(str_eq(x->stop_str[i], y->stop_str[i], sizeof x->stop_str[i]), "task.sampling.stop_strings[]")
            EQ(view_eq(x->prompt, y->prompt), "task.prompt (frame)")
            break;
        }
        case DS4_WIRE_SAMPLES: {
            const ds4_wire_samples *x = &a->samples, *y = &b->samples;
            for (uint32_t i = 0; !f && i < x->n && i < DS4_WIRE_SAMPLES_CAP; i++) {
                const ds4_wire_seq *p = &x->seq[i], *q = &y->seq[i];
                EQ(p->prompt_len == q->prompt_len, "samples.prompt_len[]") EQ(p->n_gen == q->n_gen, "samples.gen[]")
                EQ(p->finish == q->finish, "samples.finish[]") EQ(p->stop_index == q->stop_index, "samples.stop_index[]")
                EQ(p->n_rows == q->n_rows, "samples.rows[]")
            }
            EQ(F(samples.experts_layers) && F(samples.experts_k), "samples.experts_shape")
            EQ(F(samples.index_layers) && F(samples.index_topk), "samples.index_shape")
            EQ(view_eq(x->tokens, y->tokens), "samples.tokens (frame)")
            EQ(view_eq(x->logprobs, y->logprobs), "samples.logprobs (frame)")
            EQ(view_eq(x->sample_logprobs, y->sample_logprobs), "samples.sample_logprobs (frame)")
            EQ(view_eq(x->policy_lag, y->policy_lag), "samples.policy_lag (frame)")
            EQ(view_eq(x->experts, y->experts), "samples.experts (frame)")
            EQ(view_eq(x->index, y->index), "samples.index (frame)")
            break;
        }
        case DS4_WIRE_PARTIAL: {
            const ds4_wire_samples *x = &a->partial, *y = &b->partial;
            for (uint32_t i = 0; !f && i < x->n && i < DS4_WIRE_SAMPLES_CAP; i++) {
                EQ(x->seq[i].offset == y->seq[i].offset, "partial.offset[]")
                EQ(x->seq[i].n_gen == y->seq[i].n_gen, "partial.gen[]")
            }
            EQ(view_eq(x->tokens, y->tokens), "partial.tokens (frame)")
            EQ(view_eq(x->logprobs, y->logprobs), "partial.logprobs (frame)")
            EQ(view_eq(x->sample_logprobs, y->sample_logprobs), "partial.sample_logprobs (frame)")
            EQ(view_eq(x->policy_lag, y->policy_lag), "partial.policy_lag (frame)")
            break;
        }
        case DS4_WIRE_WEIGHT_ANNOUNCE:
            EQ(view_eq(a->announce.config, b->announce.config), "weight_announce.config (frame)")
            EQ(view_eq(a->announce.tokenizer, b->announce.tokenizer), "weight_announce.tokenizer (frame)")
            EQ(view_eq(a->announce.tables, b->announce.tables), "weight_announce.tables (frame)")
            EQ(view_eq(a->announce.lora_masks, b->announce.lora_masks), "weight_announce.lora_masks (frame)")
            break;
        case DS4_WIRE_WEIGHT_CHUNK: EQ(view_eq(a->chunk.data, b->chunk.data), "weight_chunk.weights (frame)") break;
        default: break;
        }
#undef EQ
#undef F
    if (field) *field = f;
    return f == NULL;
}

/* ------------------------------------------------------------------------------------------------ encode */

typedef struct enc {
    msgpack_packer pk;
    int rc; /* nonzero once any pack call failed (out of memory) */
} enc;

static void p_key(enc *e, const char *k) {
    size_t n = strlen(k);
    e->rc |= msgpack_pack_str(&e->pk, n);
    e->rc |= msgpack_pack_str_body(&e->pk, k, n);
}
static void p_sval(enc *e, const char *s, size_t cap) {
    size_t n = strnlen(s, cap);
    e->rc |= msgpack_pack_str(&e->pk, n);
    if (n) e->rc |= msgpack_pack_str_body(&e->pk, s, n);
}
static void p_u(enc *e, const char *k, uint64_t v) {
    p_key(e, k);
    e->rc |= msgpack_pack_uint64(&e->pk, v);
}
static void p_d(enc *e, const char *k, double v) {
    p_key(e, k);
    e->rc |= msgpack_pack_double(&e->pk, v);
}
static void p_b(enc *e, const char *k, int v) {
    p_key(e, k);
    e->rc |= v ? msgpack_pack_true(&e->pk) : msgpack_pack_false(&e->pk);
}
static void p_s(enc *e, const char *k, const char *s, size_t cap) {
    p_key(e, k);
    p_sval(e, s, cap);
}
static void p_head(enc *e, uint32_t nkeys, ds4_wire_type t) {
    e->rc |= msgpack_pack_map(&e->pk, nkeys);
    p_u(e, "v", DS4_WIRE_VERSION);
    p_s(e, "t", TYPE_NAMES[t], 32);
}
/* "f": one [name, dtype, count] per raw frame, count = the view's length / the element size. */
static void p_frames(enc *e, int n, const char *const *names, const int *dtype, const ds4_wire_view *views) {
    p_key(e, "f");
    e->rc |= msgpack_pack_array(&e->pk, (size_t)n);
    for (int k = 0; k < n; k++) {
        e->rc |= msgpack_pack_array(&e->pk, 3);
        p_sval(e, names[k], 32);
        p_sval(e, DTYPE_NAMES[dtype[k]], 8);
        e->rc |= msgpack_pack_uint64(&e->pk, dtype[k] == FR_U8 ? views[k].len : views[k].len / 4);
    }
}

static int str_fits(const char *s, size_t cap) { return strnlen(s, cap) < cap; }

static void enc_field(enc *e, const ds4_wire_field *f, const void *p) {
    switch (f->kind) {
    case DS4_WIRE_K_U64: p_u(e, f->key, *(const uint64_t *)p); break;
    case DS4_WIRE_K_U32: p_u(e, f->key, *(const uint32_t *)p); break;
    case DS4_WIRE_K_F64: p_d(e, f->key, *(const double *)p); break;
    case DS4_WIRE_K_BOOL: p_b(e, f->key, *(const uint8_t *)p); break;
    case DS4_WIRE_K_STR: p_s(e, f->key, p, f->size); break;
    default: break;
    }
}

/* Field f of kind OTHER: whether m carries it (task.sampling.stop_strings only when there are some; the samples'
 * rows and shapes only with routing records), and with e its key and value packed. */
static int enc_other(enc *e, const ds4_wire_msg *m, const ds4_wire_field *f) {
    if (m->type == DS4_WIRE_TASK) {
        const ds4_wire_task *t = &m->task;
        const int strs = strcmp(f->key, "stop_strings") == 0;
        const uint32_t n = strs ? t->n_stop_str : t->n_stop;
        if (strs && n == 0) return 0;
        if (!e) return 1;
        p_key(e, f->key);
        e->rc |= msgpack_pack_array(&e->pk, n);
        for (uint32_t i = 0; i < n; i++) {
            if (strs) p_sval(e, t->stop_str[i], sizeof t->stop_str[i]);
            else e->rc |= msgpack_pack_int64(&e->pk, t->stop[i]);
        }
        return 1;
    }
    const ds4_wire_samples *s = &m->samples; /* the other types with OTHER fields: samples, partial */
    const int ex = s->experts_layers || s->experts_k, ix = s->index_layers || s->index_topk;
    const int shape = f->key[strlen(f->key) - 1] == 'e'; /* experts_shape, index_shape */
    if (shape || strcmp(f->key, "rows") == 0) {
        const int on = shape ? (f->key[0] == 'e' ? ex : ix) : ex || ix;
        if (!on) return 0;
    }
    if (!e) return 1;
    p_key(e, f->key);
    if (shape) {
        e->rc |= msgpack_pack_array(&e->pk, 2);
        e->rc |= msgpack_pack_uint64(&e->pk, f->key[0] == 'e' ? s->experts_layers : s->index_layers);
        e->rc |= msgpack_pack_uint64(&e->pk, f->key[0] == 'e' ? s->experts_k : s->index_topk);
        return 1;
    }
    e->rc |= msgpack_pack_array(&e->pk, s->n);
    for (uint32_t i = 0; i < s->n; i++) {
        const ds4_wire_seq *q = &s->seq[i];
        switch (f->key[0]) {
        case 'p': e->rc |= msgpack_pack_uint64(&e->pk, q->prompt_len); break;
        case 'g': e->rc |= msgpack_pack_uint64(&e->pk, q->n_gen); break;
        case 'f': e->rc |= msgpack_pack_uint64(&e->pk, q->finish); break;
        case 'o': e->rc |= msgpack_pack_uint64(&e->pk, q->offset); break;
        case 's': e->rc |= msgpack_pack_int64(&e->pk, q->stop_index); break;
        default: e->rc |= msgpack_pack_uint64(&e->pk, q->n_rows); break; /* rows */
        }
    }
    return 1;
}

int ds4_wire_field_present(const ds4_wire_msg *m, const ds4_wire_field *f) {
    if (!m || !f) return 0;
    if (!map_present(m, f)) return 0;
    return f->kind != DS4_WIRE_K_OTHER || enc_other(NULL, m, f);
}

/* The raw frames of m in order (names, dtypes, views); how many (0: a type without frames, and no "f"). */
static int frames_of(const ds4_wire_msg *m, const char **names, int *dt, ds4_wire_view *views) {
    int n = 0;
#define FR(name, kind, view) (names[n] = (name), dt[n] = (kind), views[n] = (view), n++)
    switch (m->type) {
    case DS4_WIRE_TASK: FR("prompt", FR_I32, m->task.prompt); break;
    case DS4_WIRE_SAMPLES: {
        const ds4_wire_samples *s = &m->samples;
        FR("tokens", FR_I32, s->tokens);
        FR("logprobs", FR_F32, s->logprobs);
        FR("sample_logprobs", FR_F32, s->sample_logprobs);
        if (s->token_versions) FR("policy_lag", FR_I32, s->policy_lag);
        if (s->experts_layers || s->experts_k) FR("experts", FR_I32, s->experts);
        if (s->index_layers || s->index_topk) FR("index", FR_I32, s->index);
        break;
    }
    case DS4_WIRE_PARTIAL:
        FR("tokens", FR_I32, m->partial.tokens);
        FR("logprobs", FR_F32, m->partial.logprobs);
        FR("sample_logprobs", FR_F32, m->partial.sample_logprobs);
        if (m->partial.token_versions) FR("policy_lag", FR_I32, m->partial.policy_lag);
        break;
    case DS4_WIRE_WEIGHT_ANNOUNCE:
        FR("config", FR_U8, m->announce.config);
        FR("tokenizer", FR_U8, m->announce.tokenizer);
        FR("tables", FR_I32, m->announce.tables);
        if (m->announce.lora_rank) FR("lora_masks", FR_I32, m->announce.lora_masks);
        break;
    case DS4_WIRE_WEIGHT_CHUNK: FR("weights", FR_F32, m->chunk.data); break;
    default: break;
    }
#undef FR
    return n;
}

/* The header of m: v, t, its fields in table order (each nested map packed where its first field is), "f". */
static void enc_header(enc *e, const ds4_wire_msg *m, int nv, const char *const *names, const int *dt,
                       const ds4_wire_view *views) {
    int nf;
    const ds4_wire_field *f = ds4_wire_fields(m->type, &nf);
    uint32_t top = 2 + (nv > 0);
    for (int i = 0; i < nf; i++)
        top += f[i].map ? (uint32_t)(opens_map(f, i) && map_present(m, &f[i])) : (uint32_t)ds4_wire_field_present(m, &f[i]);
    p_head(e, top, m->type);
    for (int i = 0; i < nf; i++) {
        if (!map_present(m, &f[i])) continue; /* an absent optional map: none of its fields */
        if (opens_map(f, i)) {
            uint32_t in = 0;
            for (int j = i; j < nf && f[j].map && strcmp(f[j].map, f[i].map) == 0; j++)
                in += (uint32_t)ds4_wire_field_present(m, &f[j]);
            p_key(e, f[i].map);
            e->rc |= msgpack_pack_map(&e->pk, in);
        }
        if (f[i].kind == DS4_WIRE_K_OTHER) enc_other(e, m, &f[i]);
        else enc_field(e, &f[i], (const char *)cbody(m) + f[i].offset);
    }
    if (nv > 0) p_frames(e, nv, names, dt, views);
}

ds4_status ds4_wire_encode(const ds4_wire_msg *m, ds4_wire_out *out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "wire encode: out is NULL");
    memset(out, 0, sizeof *out);
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "wire encode: message is NULL");
    if (m->type <= DS4_WIRE_NONE || m->type >= DS4_WIRE_TYPE_COUNT)
        return ds4_fail(err, DS4_ERR_ARG, "wire encode: message type %d is not a message", (int)m->type);
    const char *tn = TYPE_NAMES[m->type];
    /* what the packing below indexes or reads as C strings must be sane before it runs */
    int nf;
    const ds4_wire_field *f = ds4_wire_fields(m->type, &nf);
    for (int i = 0; i < nf; i++)
        if (f[i].kind == DS4_WIRE_K_STR && !str_fits((const char *)cbody(m) + f[i].offset, f[i].size))
            return ds4_fail(err, DS4_ERR_ARG, "wire encode: %s: %s is not NUL-terminated", tn, f[i].name);
    const char *bad = NULL;
    if (m->type == DS4_WIRE_TASK) {
        if (m->task.n_stop > DS4_WIRE_STOP_CAP) bad = "n_stop is over DS4_WIRE_STOP_CAP";
        if (m->task.n_stop_str > DS4_WIRE_STOP_STR_CAP) bad = "n_stop_str is over DS4_WIRE_STOP_STR_CAP";
        for (uint32_t i = 0; !bad && i < m->task.n_stop_str; i++)
            if (!str_fits(m->task.stop_str[i], sizeof m->task.stop_str[i])) bad = "a stop string is not NUL-terminated";
    }
    if ((m->type == DS4_WIRE_SAMPLES || m->type == DS4_WIRE_PARTIAL) && m->samples.n > DS4_WIRE_SAMPLES_CAP)
        bad = "n is over DS4_WIRE_SAMPLES_CAP";
    if (bad) return ds4_fail(err, DS4_ERR_ARG, "wire encode: %s: %s", tn, bad);

    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    enc e;
    msgpack_packer_init(&e.pk, &sb, msgpack_sbuffer_write);
    e.rc = 0;
    const char *names[DS4_WIRE_FRAMES_CAP - 1];
    int dt[DS4_WIRE_FRAMES_CAP - 1];
    ds4_wire_view views[DS4_WIRE_FRAMES_CAP - 1];
    const int nv = frames_of(m, names, dt, views);
    enc_header(&e, m, nv, names, dt, views);
    if (e.rc) {
        msgpack_sbuffer_destroy(&sb);
        return ds4_fail(err, DS4_ERR_OOM, "wire encode: %s: out of memory packing the header", tn);
    }
    for (int k = 0; k < nv; k++)
        if (!views[k].data && views[k].len) {
            msgpack_sbuffer_destroy(&sb);
            return ds4_fail(err, DS4_ERR_ARG, "wire encode: %s: raw frame %d has NULL data of %zu bytes", tn, k + 1,
                            views[k].len);
        }
    size_t hlen = sb.size;
    char *hdr = msgpack_sbuffer_release(&sb);
    if (!hdr) return ds4_fail(err, DS4_ERR_OOM, "wire encode: %s: no header buffer", tn);
    out->nframes = 1 + nv;
    out->header = hdr;
    out->frames[0] = hdr;
    out->lens[0] = hlen;
    for (int k = 0; k < nv; k++) {
        out->frames[k + 1] = views[k].data;
        out->lens[k + 1] = views[k].len;
    }
    /* Self-check: what was written must decode (against the capacities) to exactly m. This is the one place
     * the ranges live, so the encoder cannot produce what a receiver would refuse for a reason other than its
     * configured limits. CRCs are the caller's: not recomputed here (a 16 MiB chunk would cost ~10 ms). */
    ds4_wire_limits caps = cap_limits();
    ds4_wire_msg *back = malloc(sizeof *back);
    if (!back) {
        ds4_wire_out_free(out);
        return ds4_fail(err, DS4_ERR_OOM, "wire encode: %s: self-check buffer", tn);
    }
    ds4_error derr;
    const char *field = NULL;
    ds4_status st = DS4_OK;
    if (decode_impl(&caps, out->nframes, out->frames, out->lens, back, &derr, 0) != DS4_WIRE_OK) {
        const char *msg = derr.msg;
        if (strncmp(msg, "wire decode: ", 13) == 0) msg += 13;
        st = ds4_fail(err, DS4_ERR_ARG, "wire encode: %s", msg);
    } else if (!ds4_wire_equal(m, back, &field)) {
        st = ds4_fail(err, DS4_ERR_ARG, "wire encode: %s: field %s does not survive encoding (a value outside its "
                      "domain, or set where the message has no place for it)", tn, field);
    }
    free(back);
    if (st != DS4_OK) ds4_wire_out_free(out);
    return st;
}

void ds4_wire_out_free(ds4_wire_out *out) {
    if (!out) return;
    free(out->header);
    memset(out, 0, sizeof *out);
}

void ds4_wire_make_error(ds4_wire_msg *m, ds4_wire_code code, const char *reason, const char *ref_t, uint64_t ref_id,
                         uint32_t ref_n) {
    if (!m) return;
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_ERROR;
    m->error.code = (uint32_t)code;
    if (reason) {
        size_t n = strlen(reason);
        if (n > DS4_WIRE_STR_CAP) {
            n = DS4_WIRE_STR_CAP;
            /* do not cut a UTF-8 sequence: back off while the first byte left out is a continuation byte */
            while (n > 0 && ((unsigned char)reason[n] & 0xC0) == 0x80) n--;
        }
        memcpy(m->error.reason, reason, n);
        m->error.reason[n] = 0;
    }
    if (ref_t) {
        size_t n = strnlen(ref_t, REF_T_MAX);
        memcpy(m->error.ref_t, ref_t, n);
        m->error.ref_t[n] = 0;
    }
    m->error.ref_id = ref_id;
    m->error.ref_n = ref_n;
}
