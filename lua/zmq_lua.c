/* zmq_lua.c — ZeroMQ for Lua scripts: ds4.zmq (sockets, poll, CURVE keys, the ZAP handler) and `ds4 keygen`.
 *
 *   ds4.zmq.socket(type)          "ROUTER"|"DEALER"|"PUSH"|"PULL"|"PAIR"|"REQ"|"REP" -> socket (ZMQ_LINGER 0)
 *   sock:set{opt = value, ...}    options by name (unknown names and wrong types are errors)
 *   sock:get(name)                an option's value
 *   sock:bind(ep) -> the bound endpoint (ZMQ_LAST_ENDPOINT: "tcp://127.0.0.1:*" reports the port)
 *   sock:connect(ep) sock:disconnect(ep) sock:unbind(ep)
 *   sock:send(frames [, {timeout = ms}]) -> true | nil, "EAGAIN"|"EHOSTUNREACH"|..., message   (never blocks
 *                                 unless opts.timeout is given)
 *   sock:recv([timeout_ms]) -> {frames} | nil on timeout
 *   sock:events() -> {readable, writable}   sock:type()   sock:close([linger_ms])   tostring(sock)
 *   ds4.zmq.poll(socks, timeout_ms) -> {readable...}
 *   ds4.zmq.keypair() ds4.zmq.public_from_secret(s) ds4.zmq.read_key(path) ds4.zmq.has(cap) ds4.zmq.version()
 *   ds4.zmq.zap{allow = {keys}, quiet = bool} -> handler: allow, deny, allowed, is_allowed, stats, stop, running
 *
 * The context. One ZeroMQ context per lua_State, made on first use. It lives in a small reference-counted C
 * record: the registry holder (key "ds4.zmq.ctx") owns one reference, every open socket and the running ZAP
 * handler one more each, and the last release runs zmq_ctx_term. So whatever order lua_close runs the
 * finalizers in, the context is terminated exactly once, after every socket is closed and after the ZAP
 * thread has been stopped and joined (zmq_ctx_term would otherwise block on the handler's socket). Sockets are
 * made with ZMQ_LINGER 0 so that termination never waits on an unreachable peer (set linger before close to
 * flush, as a worker does before its last bye).
 *
 * The ZAP handler (rollout/zap.c) is kept in the registry (key "ds4.zmq.zap.running") while it runs: dropping the
 * handler object must not silently switch authentication off. handler:stop() or lua_close ends it.
 *
 * Waiting. Every wait (recv and poll without a timeout or with a long one, send with opts.timeout) is cut into
 * zmq_poll slices of at most 100 ms; between slices the host's interrupt flag (registry DS4L_INTERRUPT_KEY,
 * set by SIGINT) is read and, when set, "<fname>: interrupted" is raised. EINTR only wakes the loop.
 *
 * Ownership (ds4lua.h): every C resource is in a __gc'd box before anything can raise: sockets, the handler,
 * and each received zmq_msg_t (a reused box while the frame is copied into a Lua string). Sends use zmq_send,
 * which copies the frame before returning, so no message outlives the call. Errors: "fname: message (zmq
 * error text)". */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, open flags, fchmod, fsync */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "ds4lua.h"
#include "zap.h"

#define CTX_KEY "ds4.zmq.ctx"         /* registry: the context holder (not the metatable names below) */
#define ZAP_KEY "ds4.zmq.zap.running" /* registry: the running ZAP handler */
#define CTX_MT "ds4.zmq.context"
#define SOCK_MT "ds4.zmq.socket"
#define ZAP_MT "ds4.zmq.zap"
#define MSG_MT "ds4.zmq.msg"
#define SLICE_MS 100
#define KEY_Z85 40

/* ------------------------------------------------------------------------------------------------ errors */

/* Raise "<fname>: <message> (<zmq error text>)" for the zmq error e. */
DS4L_NORETURN static void zraise(lua_State *L, int e, const char *fname, const char *fmt, ...) DS4L_PRINTF(4, 5);
static void zraise(lua_State *L, int e, const char *fname, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    ds4l_raise(L, "%s: %s (%s)", fname, buf, zmq_strerror(e));
}

static const char *errno_name(int e) {
    switch (e) {
    case EAGAIN: return "EAGAIN";
    case EHOSTUNREACH: return "EHOSTUNREACH";
    case EFSM: return "EFSM";
    case ENOTSUP: return "ENOTSUP";
    case ETERM: return "ETERM";
    case ENOTSOCK: return "ENOTSOCK";
    case EINTR: return "EINTR";
    case EINVAL: return "EINVAL";
    case EMTHREAD: return "EMTHREAD";
    case ENOMEM: return "ENOMEM";
    case EMSGSIZE: return "EMSGSIZE";
    default: return "EZMQ";
    }
}

/* ------------------------------------------------------------------------------------------------ context */

typedef struct zctx {
    void *ctx;
    int refs;
} zctx;

static void zctx_release(zctx *c) {
    if (!c || --c->refs > 0) return;
    /* Every socket of the context is closed by now (each held a reference), the ZAP thread joined. */
    while (zmq_ctx_term(c->ctx) != 0 && zmq_errno() == EINTR) {
    }
    free(c);
}

typedef struct ctx_holder {
    zctx *c;
} ctx_holder;

static int holder_gc(lua_State *L) {
    ctx_holder *h = lua_touserdata(L, 1);
    if (h) {
        zctx_release(h->c);
        h->c = NULL;
    }
    return 0;
}

/* The state's context, made on first use. The caller takes a reference with c->refs++ when it keeps it. */
static zctx *ctx_get(lua_State *L, const char *fname) {
    lua_getfield(L, LUA_REGISTRYINDEX, CTX_KEY);
    ctx_holder *h = luaL_testudata(L, -1, CTX_MT);
    lua_pop(L, 1);
    if (!h) {
        h = lua_newuserdata(L, sizeof *h);
        h->c = NULL;
        ds4l_class(L, CTX_MT, NULL, holder_gc, NULL);
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, CTX_KEY);
    }
    if (!h->c) {
        /* nothing between malloc and h->c = c raises */
        zctx *c = malloc(sizeof *c);
        if (!c) ds4l_raise(L, "%s: cannot create the ZeroMQ context: out of memory", fname);
        c->ctx = zmq_ctx_new();
        if (!c->ctx) {
            int e = zmq_errno();
            free(c);
            zraise(L, e, fname, "cannot create the ZeroMQ context");
        }
        c->refs = 1;
        h->c = c;
    }
    return h->c;
}

/* ------------------------------------------------------------------------------------------------ waiting */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static const volatile int *interrupt_flag(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, DS4L_INTERRUPT_KEY);
    const volatile int *f = lua_type(L, -1) == LUA_TLIGHTUSERDATA ? lua_touserdata(L, -1) : NULL;
    lua_pop(L, 1);
    return f;
}

/* Raise "<fname>: interrupted". The host's SIGINT handler has also set a hook (call | return | count 1) that
 * raises "interrupted!" at the next Lua event; left in place, it would fire inside the error handler that
 * unwinding calls (`ds4 run`'s traceback) and turn this error into "error in error handling". This error is that
 * interrupt, so the hook is removed first, as the host's own hook function does before raising. Any other hook
 * (a debugger's) is left alone. */
DS4L_NORETURN static void raise_interrupted(lua_State *L, const char *fname) {
    if (lua_gethook(L) && lua_gethookmask(L) == (LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT) &&
        lua_gethookcount(L) == 1)
        lua_sethook(L, NULL, 0, 0);
    ds4l_raise(L, "%s: interrupted", fname);
}

/* A timeout argument: nil / none / -1 = forever (-1 returned), else milliseconds >= 0. */
static long opt_timeout(lua_State *L, int idx, const char *fname, const char *what) {
    if (lua_isnoneornil(L, idx)) return -1;
    if (lua_type(L, idx) != LUA_TNUMBER)
        ds4l_raise(L, "%s: %s must be a number of milliseconds (or nil: wait forever), got %s", fname, what,
                   luaL_typename(L, idx));
    double v = lua_tonumber(L, idx);
    if (v == -1) return -1;
    if (!(v >= 0) || v > 2147483647.0)
        ds4l_raise(L, "%s: %s must be >= 0 milliseconds (or nil / -1: wait forever), got %g", fname, what, v);
    return (long)ceil(v);
}

/* A deadline for opt_timeout's value: -1 forever, else now + ms (0: poll once). */
static double deadline_of(long timeout_ms) { return timeout_ms < 0 ? -1 : now_ms() + (double)timeout_ms; }

/* zmq_poll the items until one has an event (returns how many), or the deadline passes (returns 0; deadline -1:
 * never). Each slice is at most SLICE_MS; after an empty slice the interrupt flag is checked. A deadline already
 * past polls once. */
static int poll_until(lua_State *L, const char *fname, zmq_pollitem_t *items, int n, double deadline) {
    const volatile int *flag = interrupt_flag(L);
    for (;;) {
        long slice = SLICE_MS;
        if (deadline >= 0) {
            double left = deadline - now_ms();
            slice = left <= 0 ? 0 : left < SLICE_MS ? (long)ceil(left) : SLICE_MS;
        }
        int rc = zmq_poll(items, n, slice);
        if (rc < 0) {
            int e = zmq_errno();
            if (e != EINTR) zraise(L, e, fname, "zmq_poll failed");
            for (int i = 0; i < n; i++) items[i].revents = 0;
            rc = 0;
        }
        if (rc > 0) return rc;
        if (slice > 0 && flag && *flag) raise_interrupted(L, fname);
        if (deadline >= 0 && (slice == 0 || now_ms() >= deadline)) return 0;
    }
}

/* ------------------------------------------------------------------------------------------------ sockets */

typedef struct zsock {
    void *s;
    zctx *c;
    int type;
} zsock;

static const struct {
    const char *name;
    int type;
} SOCK_TYPES[] = {
    {"ROUTER", ZMQ_ROUTER}, {"DEALER", ZMQ_DEALER}, {"PUSH", ZMQ_PUSH}, {"PULL", ZMQ_PULL}, {"PAIR", ZMQ_PAIR},
    {"REQ", ZMQ_REQ},       {"REP", ZMQ_REP},       {"PUB", ZMQ_PUB},   {"SUB", ZMQ_SUB},
};
#define N_SOCK_TYPES (int)(sizeof SOCK_TYPES / sizeof SOCK_TYPES[0])

static const char *type_name(int type) {
    for (int i = 0; i < N_SOCK_TYPES; i++)
        if (SOCK_TYPES[i].type == type) return SOCK_TYPES[i].name;
    return "?";
}

static void sock_release(zsock *z) {
    if (z->s) {
        zmq_close(z->s); /* fails only for a pointer that is not a socket */
        z->s = NULL;
    }
    zctx_release(z->c);
    z->c = NULL;
}

static int sock_gc(lua_State *L) {
    zsock *z = luaL_testudata(L, 1, SOCK_MT);
    if (z) sock_release(z);
    return 0;
}

static zsock *check_sock_at(lua_State *L, int idx, const char *fname, const char *what) {
    zsock *z = luaL_testudata(L, idx, SOCK_MT);
    if (!z) ds4l_raise(L, "%s: %s must be a ds4.zmq socket, got %s", fname, what, luaL_typename(L, idx));
    if (!z->s) ds4l_raise(L, "%s: %s is closed", fname, what);
    return z;
}

static zsock *check_sock(lua_State *L, const char *fname) {
    zsock *z = luaL_testudata(L, 1, SOCK_MT);
    if (!z)
        ds4l_raise(L, "%s: self must be a ds4.zmq socket (got %s); call it as sock:method(...)", fname,
                   luaL_typename(L, 1));
    if (!z->s) ds4l_raise(L, "%s: the socket is closed", fname);
    return z;
}

/* ds4.zmq.socket(type) */
static int l_socket(lua_State *L) {
    const char *fname = "ds4.zmq.socket";
    const char *name = lua_type(L, 1) == LUA_TSTRING ? lua_tostring(L, 1) : NULL;
    int type = -1;
    for (int i = 0; name && i < N_SOCK_TYPES; i++)
        if (strcmp(name, SOCK_TYPES[i].name) == 0) type = SOCK_TYPES[i].type;
    if (type < 0)
        ds4l_raise(L,
                   "%s: bad argument #1 (socket type \"ROUTER\", \"DEALER\", \"PUSH\", \"PULL\", \"PAIR\", "
                   "\"REQ\", \"REP\", \"PUB\" or \"SUB\" expected, got %s%s%s)",
                   fname, name ? "\"" : "", name ? name : luaL_typename(L, 1), name ? "\"" : "");
    zsock *z = lua_newuserdata(L, sizeof *z);
    z->s = NULL;
    z->c = NULL;
    z->type = type;
    luaL_getmetatable(L, SOCK_MT);
    lua_setmetatable(L, -2);
    zctx *c = ctx_get(L, fname);
    z->s = zmq_socket(c->ctx, type);
    if (!z->s) zraise(L, zmq_errno(), fname, "cannot create a %s socket", name);
    z->c = c;
    c->refs++;
    int linger = 0;
    if (zmq_setsockopt(z->s, ZMQ_LINGER, &linger, sizeof linger) != 0) zraise(L, zmq_errno(), fname, "ZMQ_LINGER = 0");
    return 1;
}

/* ---------------------------------------------------------------- options */

typedef enum { OPT_INT, OPT_BOOL, OPT_I64, OPT_STR, OPT_KEY, OPT_GET_STR } opt_kind;

static const struct sockopt {
    const char *name;
    int opt;
    opt_kind kind;
} SOCKOPTS[] = {
    {"linger", ZMQ_LINGER, OPT_INT},
    {"sndhwm", ZMQ_SNDHWM, OPT_INT},
    {"rcvhwm", ZMQ_RCVHWM, OPT_INT},
    {"routing_id", ZMQ_ROUTING_ID, OPT_STR},
    {"heartbeat_ivl", ZMQ_HEARTBEAT_IVL, OPT_INT},
    {"heartbeat_timeout", ZMQ_HEARTBEAT_TIMEOUT, OPT_INT},
    {"heartbeat_ttl", ZMQ_HEARTBEAT_TTL, OPT_INT},
    {"reconnect_ivl", ZMQ_RECONNECT_IVL, OPT_INT},
    {"reconnect_ivl_max", ZMQ_RECONNECT_IVL_MAX, OPT_INT},
    {"router_mandatory", ZMQ_ROUTER_MANDATORY, OPT_BOOL},
    {"router_handover", ZMQ_ROUTER_HANDOVER, OPT_BOOL},
    {"immediate", ZMQ_IMMEDIATE, OPT_BOOL},
    {"handshake_ivl", ZMQ_HANDSHAKE_IVL, OPT_INT},
    {"maxmsgsize", ZMQ_MAXMSGSIZE, OPT_I64},
    {"connect_timeout", ZMQ_CONNECT_TIMEOUT, OPT_INT},
    {"tcp_keepalive", ZMQ_TCP_KEEPALIVE, OPT_INT},
    {"ipv6", ZMQ_IPV6, OPT_BOOL},
    {"subscribe", ZMQ_SUBSCRIBE, OPT_STR},
    {"unsubscribe", ZMQ_UNSUBSCRIBE, OPT_STR},
    {"curve_server", ZMQ_CURVE_SERVER, OPT_BOOL},
    {"curve_publickey", ZMQ_CURVE_PUBLICKEY, OPT_KEY},
    {"curve_secretkey", ZMQ_CURVE_SECRETKEY, OPT_KEY},
    {"curve_serverkey", ZMQ_CURVE_SERVERKEY, OPT_KEY},
    {"zap_domain", ZMQ_ZAP_DOMAIN, OPT_STR},
    {"last_endpoint", ZMQ_LAST_ENDPOINT, OPT_GET_STR},
};
#define N_SOCKOPTS (int)(sizeof SOCKOPTS / sizeof SOCKOPTS[0])

static const struct sockopt *find_opt(const char *name) {
    for (int i = 0; name && i < N_SOCKOPTS; i++)
        if (strcmp(name, SOCKOPTS[i].name) == 0) return &SOCKOPTS[i];
    return NULL;
}

/* The option names, for error messages. */
static void opt_names(char *buf, size_t cap, int settable) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < N_SOCKOPTS && o + 1 < cap; i++) {
        if (settable && SOCKOPTS[i].kind == OPT_GET_STR) continue;
        int w = snprintf(buf + o, cap - o, "%s%s", o ? ", " : "", SOCKOPTS[i].name);
        if (w < 0) break;
        o += (size_t)w;
    }
}

/* 1 when the string is a CURVE key zmq_setsockopt takes: 40 Z85 characters (or the 32 raw bytes). */
static int valid_key(const char *s, size_t n) {
    if (n == 32) return 1;
    if (n != KEY_Z85 || strlen(s) != KEY_Z85) return 0;
    uint8_t bin[32];
    return zmq_z85_decode(bin, s) != NULL;
}

/* Check the value at the top of the stack for option o; raises with the option's name. */
static void check_opt_value(lua_State *L, const char *fname, const struct sockopt *o) {
    int t = lua_type(L, -1);
    switch (o->kind) {
    case OPT_INT:
    case OPT_I64: {
        double v = lua_tonumber(L, -1);
        double hi = o->kind == OPT_INT ? 2147483647.0 : 9007199254740992.0;
        if (t != LUA_TNUMBER || v != floor(v) || v < -1 || v > hi)
            ds4l_raise(L, "%s: %s must be an integer in -1..%.0f, got %s %s", fname, o->name, hi, luaL_typename(L, -1),
                       t == LUA_TNUMBER || t == LUA_TSTRING ? lua_tostring(L, -1) : "");
        break;
    }
    case OPT_BOOL: /* true / false, or libzmq's own 1 / 0 */
        if (t != LUA_TBOOLEAN && !(t == LUA_TNUMBER && (lua_tonumber(L, -1) == 0 || lua_tonumber(L, -1) == 1)))
            ds4l_raise(L, "%s: %s must be a boolean (or 0 / 1), got %s %s", fname, o->name, luaL_typename(L, -1),
                       t == LUA_TNUMBER || t == LUA_TSTRING ? lua_tostring(L, -1) : "");
        break;
    case OPT_STR:
        if (t != LUA_TSTRING) ds4l_raise(L, "%s: %s must be a string, got %s", fname, o->name, luaL_typename(L, -1));
        break;
    case OPT_KEY: {
        size_t n = 0;
        const char *s = t == LUA_TSTRING ? lua_tolstring(L, -1, &n) : NULL;
        if (!s || !valid_key(s, n))
            ds4l_raise(L, "%s: %s must be a CURVE key of 40 Z85 characters, got %s", fname, o->name,
                       s ? "a string that is not one" : luaL_typename(L, -1));
        break;
    }
    case OPT_GET_STR: ds4l_raise(L, "%s: %s can be read (sock:get), not set", fname, o->name);
    }
}

static void apply_opt(lua_State *L, zsock *z, const char *fname, const struct sockopt *o) {
    int rc;
    switch (o->kind) {
    case OPT_INT:
    case OPT_BOOL: {
        int v = o->kind == OPT_INT || lua_type(L, -1) == LUA_TNUMBER ? (int)lua_tonumber(L, -1) : lua_toboolean(L, -1);
        rc = zmq_setsockopt(z->s, o->opt, &v, sizeof v);
        break;
    }
    case OPT_I64: {
        int64_t v = (int64_t)lua_tonumber(L, -1);
        rc = zmq_setsockopt(z->s, o->opt, &v, sizeof v);
        break;
    }
    default: {
        size_t n = 0;
        const char *s = lua_tolstring(L, -1, &n);
        rc = zmq_setsockopt(z->s, o->opt, s, n);
        break;
    }
    }
    if (rc != 0) {
        int e = zmq_errno();
        if (o->kind == OPT_INT || o->kind == OPT_I64)
            zraise(L, e, fname, "cannot set %s = %.0f", o->name, lua_tonumber(L, -1));
        if (o->kind == OPT_BOOL)
            zraise(L, e, fname, "cannot set %s = %s", o->name,
                   lua_type(L, -1) == LUA_TNUMBER ? lua_tostring(L, -1)
                   : lua_toboolean(L, -1)         ? "true"
                                                  : "false");
        zraise(L, e, fname, "cannot set %s", o->name);
    }
}

/* sock:set{name = value, ...}: every key and value is checked before any is applied. */
static int s_set(lua_State *L) {
    const char *fname = "ds4.zmq.socket:set";
    zsock *z = check_sock(L, fname);
    if (!lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #1 (options table expected, got %s)", fname, luaL_typename(L, 2));
    lua_settop(L, 2);
    for (int pass = 0; pass < 2; pass++) {
        lua_pushnil(L);
        while (lua_next(L, 2)) {
            const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
            const struct sockopt *o = find_opt(k);
            if (!o || o->kind == OPT_GET_STR) {
                char names[1024];
                opt_names(names, sizeof names, 1);
                ds4l_raise_unknown_option(L, fname, -2, names);
            }
            if (pass == 0)
                check_opt_value(L, fname, o);
            else
                apply_opt(L, z, fname, o);
            lua_pop(L, 1);
        }
    }
    lua_settop(L, 1);
    return 1; /* the socket, for chaining */
}

/* sock:get(name) */
static int s_get(lua_State *L) {
    const char *fname = "ds4.zmq.socket:get";
    zsock *z = check_sock(L, fname);
    const char *k = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : NULL;
    const struct sockopt *o = find_opt(k);
    if (!o || o->opt == ZMQ_SUBSCRIBE || o->opt == ZMQ_UNSUBSCRIBE) {
        char names[1024];
        opt_names(names, sizeof names, 0);
        ds4l_raise(L, "%s: unknown option %s (known: %s; not subscribe / unsubscribe)", fname,
                   k ? k : luaL_typename(L, 2), names);
    }
    int rc;
    switch (o->kind) {
    case OPT_INT:
    case OPT_BOOL: {
        int v = 0;
        size_t n = sizeof v;
        rc = zmq_getsockopt(z->s, o->opt, &v, &n);
        if (rc == 0) {
            if (o->kind == OPT_BOOL)
                lua_pushboolean(L, v);
            else
                lua_pushinteger(L, v);
        }
        break;
    }
    case OPT_I64: {
        int64_t v = 0;
        size_t n = sizeof v;
        rc = zmq_getsockopt(z->s, o->opt, &v, &n);
        if (rc == 0) lua_pushnumber(L, (lua_Number)v);
        break;
    }
    default: {
        char buf[1024];
        size_t n = o->kind == OPT_KEY ? KEY_Z85 + 1 : sizeof buf; /* keys: asking for 41 bytes returns Z85 */
        rc = zmq_getsockopt(z->s, o->opt, buf, &n);
        if (rc == 0) {
            /* string options come back NUL-terminated (except the routing id, which is bytes) */
            if (o->opt != ZMQ_ROUTING_ID && n > 0 && buf[n - 1] == 0) n--;
            lua_pushlstring(L, buf, n);
        }
        break;
    }
    }
    if (rc != 0) zraise(L, zmq_errno(), fname, "cannot read %s", o->name);
    return 1;
}

static const char *check_endpoint(lua_State *L, const char *fname) {
    if (lua_type(L, 2) != LUA_TSTRING)
        ds4l_raise(L, "%s: bad argument #1 (endpoint string expected, e.g. \"tcp://127.0.0.1:5555\", got %s)", fname,
                   luaL_typename(L, 2));
    return lua_tostring(L, 2);
}

static int s_bind(lua_State *L) {
    const char *fname = "ds4.zmq.socket:bind";
    zsock *z = check_sock(L, fname);
    const char *ep = check_endpoint(L, fname);
    if (zmq_bind(z->s, ep) != 0) zraise(L, zmq_errno(), fname, "cannot bind %s", ep);
    char buf[1024];
    size_t n = sizeof buf;
    if (zmq_getsockopt(z->s, ZMQ_LAST_ENDPOINT, buf, &n) != 0)
        zraise(L, zmq_errno(), fname, "bound %s, but cannot read ZMQ_LAST_ENDPOINT", ep);
    if (n > 0 && buf[n - 1] == 0) n--;
    lua_pushlstring(L, buf, n);
    return 1;
}

static int endpoint_call(lua_State *L, const char *fname, int (*fn)(void *, const char *), const char *verb) {
    zsock *z = check_sock(L, fname);
    const char *ep = check_endpoint(L, fname);
    if (fn(z->s, ep) != 0) zraise(L, zmq_errno(), fname, "cannot %s %s", verb, ep);
    lua_pushboolean(L, 1);
    return 1;
}

static int s_connect(lua_State *L) { return endpoint_call(L, "ds4.zmq.socket:connect", zmq_connect, "connect to"); }
static int s_disconnect(lua_State *L) {
    return endpoint_call(L, "ds4.zmq.socket:disconnect", zmq_disconnect, "disconnect from");
}
static int s_unbind(lua_State *L) { return endpoint_call(L, "ds4.zmq.socket:unbind", zmq_unbind, "unbind"); }

/* ---------------------------------------------------------------- send */

typedef struct frame_ref {
    const void *p;
    size_t n;
} frame_ref;

/* sock:send(frames [, {timeout = ms}]): frames is an array of strings or ds4 tensors (their bytes). */
static int s_send(lua_State *L) {
    const char *fname = "ds4.zmq.socket:send";
    zsock *z = check_sock(L, fname);
    if (!lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #1 (array of frames expected: strings or ds4 tensors, got %s)", fname,
                   luaL_typename(L, 2));
    long timeout = 0;
    const int opts = ds4l_opt_table(L, 3, fname, 2);
    if (opts) {
        static const char *const known[] = {"timeout", NULL};
        ds4l_check_keys(L, opts, fname, known);
        lua_getfield(L, 3, "timeout");
        if (!lua_isnil(L, -1)) timeout = opt_timeout(L, lua_gettop(L), fname, "opts.timeout");
        lua_pop(L, 1);
    }
    lua_settop(L, 3);
    size_t n = lua_objlen(L, 2);
    if (n == 0) ds4l_raise(L, "%s: no frames to send (an empty array)", fname);
    if (n > 1024) ds4l_raise(L, "%s: %zu frames; at most 1024 per message", fname, n);
    frame_ref *f = lua_newuserdata(L, n * sizeof *f); /* slot 4; the frames stay referenced by the table */
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, 2, (int)i + 1);
        if (lua_type(L, -1) == LUA_TSTRING) {
            f[i].p = lua_tolstring(L, -1, &f[i].n);
        } else {
            ds4_tensor *t = ds4l_tensor_test(L, -1);
            if (!t)
                ds4l_raise(L, "%s: frame %zu is a %s; expected a string or a ds4 tensor", fname, i + 1,
                           luaL_typename(L, -1));
            f[i].p = t->data;
            f[i].n = t->nbytes;
        }
        lua_pop(L, 1);
    }
    /* No Lua call below can raise until the message is complete or refused as a whole (poll_until raises only
     * "interrupted", before anything of this message is queued). zmq_send copies each frame. */
    double deadline = deadline_of(timeout);
    for (;;) {
        int flags = ZMQ_DONTWAIT | (n > 1 ? ZMQ_SNDMORE : 0);
        if (zmq_send(z->s, f[0].p, f[0].n, flags) >= 0) break;
        int e = zmq_errno();
        if (e == EINTR) continue;
        if (e == EAGAIN && timeout != 0 && (deadline < 0 || now_ms() < deadline)) {
            /* A ROUTER always polls writable, so pause a millisecond before each retry: no busy loop. */
            struct timespec ms1 = {0, 1000000};
            nanosleep(&ms1, NULL);
            zmq_pollitem_t it = {z->s, 0, ZMQ_POLLOUT, 0};
            poll_until(L, fname, &it, 1, deadline);
            continue;
        }
        lua_pushnil(L);
        lua_pushstring(L, errno_name(e));
        lua_pushfstring(L, "%s: cannot send (%s)", fname, zmq_strerror(e));
        return 3;
    }
    /* The first frame is queued: libzmq checks the high-water mark and the peer only there, so the rest of a
     * multipart message goes through; a failure here would leave a cut message, which is raised. */
    for (size_t i = 1; i < n; i++) {
        int flags = ZMQ_DONTWAIT | (i + 1 < n ? ZMQ_SNDMORE : 0);
        int tries = 0;
        while (zmq_send(z->s, f[i].p, f[i].n, flags) < 0) {
            int e = zmq_errno();
            if (e == EINTR) continue;
            if (e == EAGAIN && tries++ < 100) {
                zmq_pollitem_t it = {z->s, 0, ZMQ_POLLOUT, 0};
                if (zmq_poll(&it, 1, 10) >= 0 || zmq_errno() == EINTR) continue;
            }
            zraise(L, e, fname, "frame %zu of %zu refused after the first was queued: the message is cut", i + 1, n);
        }
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* ---------------------------------------------------------------- recv */

typedef struct msg_box {
    zmq_msg_t msg;
    int live;
} msg_box;

static int msg_gc(lua_State *L) {
    msg_box *b = lua_touserdata(L, 1);
    if (b && b->live) {
        zmq_msg_close(&b->msg);
        b->live = 0;
    }
    return 0;
}

static msg_box *push_msg_box(lua_State *L) {
    msg_box *b = lua_newuserdata(L, sizeof *b);
    b->live = 0;
    luaL_getmetatable(L, MSG_MT);
    lua_setmetatable(L, -2);
    return b;
}

/* zmq_msg_recv into the box (initialised here); 0 on success, else the zmq errno (box empty again). */
static int recv_part(msg_box *b, void *s) {
    if (zmq_msg_init(&b->msg) != 0) return zmq_errno();
    b->live = 1;
    for (;;) {
        if (zmq_msg_recv(&b->msg, s, ZMQ_DONTWAIT) >= 0) return 0;
        int e = zmq_errno();
        if (e == EINTR) continue;
        zmq_msg_close(&b->msg);
        b->live = 0;
        return e;
    }
}

/* sock:recv([timeout_ms]) -> array of frame strings, or nil when nothing arrived in time */
static int s_recv(lua_State *L) {
    const char *fname = "ds4.zmq.socket:recv";
    zsock *z = check_sock(L, fname);
    long timeout = opt_timeout(L, 2, fname, "bad argument #1 (timeout)");
    lua_settop(L, 1);
    double deadline = deadline_of(timeout);
    msg_box *b = push_msg_box(L); /* slot 2 */
    for (;;) {
        int e = recv_part(b, z->s);
        if (e == 0) break;
        if (e != EAGAIN) zraise(L, e, fname, "cannot receive");
        if (timeout == 0) break;
        zmq_pollitem_t it = {z->s, 0, ZMQ_POLLIN, 0};
        if (poll_until(L, fname, &it, 1, deadline) == 0) {
            /* timed out: one last look, so that a message that came with the deadline is not missed */
            e = recv_part(b, z->s);
            if (e == 0) break;
            if (e != EAGAIN) zraise(L, e, fname, "cannot receive");
            break;
        }
    }
    if (!b->live) { /* nothing in time */
        lua_pushnil(L);
        return 1;
    }
    lua_createtable(L, 4, 0); /* slot 3 */
    for (int i = 1;; i++) {
        int more = zmq_msg_more(&b->msg);
        lua_pushlstring(L, zmq_msg_data(&b->msg), zmq_msg_size(&b->msg)); /* may raise: the box closes the msg */
        lua_rawseti(L, 3, i);
        zmq_msg_close(&b->msg);
        b->live = 0;
        if (!more) break;
        int e = recv_part(b, z->s); /* the rest of a multipart message is there (atomic delivery) */
        if (e != 0) zraise(L, e, fname, "frame %d of a multipart message is missing", i + 1);
    }
    return 1;
}

static int s_events(lua_State *L) {
    const char *fname = "ds4.zmq.socket:events";
    zsock *z = check_sock(L, fname);
    int ev = 0;
    size_t n = sizeof ev;
    if (zmq_getsockopt(z->s, ZMQ_EVENTS, &ev, &n) != 0) zraise(L, zmq_errno(), fname, "cannot read ZMQ_EVENTS");
    lua_createtable(L, 0, 2);
    ds4l_set_bool(L, "readable", (ev & ZMQ_POLLIN) != 0);
    ds4l_set_bool(L, "writable", (ev & ZMQ_POLLOUT) != 0);
    return 1;
}

static int s_type(lua_State *L) {
    zsock *z = luaL_testudata(L, 1, SOCK_MT);
    if (!z) ds4l_raise(L, "ds4.zmq.socket:type: self must be a ds4.zmq socket (got %s)", luaL_typename(L, 1));
    lua_pushstring(L, type_name(z->type));
    return 1;
}

/* sock:close([linger_ms]): closing twice is harmless. */
static int s_close(lua_State *L) {
    const char *fname = "ds4.zmq.socket:close";
    zsock *z = luaL_testudata(L, 1, SOCK_MT);
    if (!z) ds4l_raise(L, "%s: self must be a ds4.zmq socket (got %s)", fname, luaL_typename(L, 1));
    if (z->s && !lua_isnoneornil(L, 2)) {
        double v = lua_type(L, 2) == LUA_TNUMBER ? lua_tonumber(L, 2) : -2;
        if (v != floor(v) || v < -1 || v > 2147483647.0)
            ds4l_raise(L, "%s: bad argument #1 (linger in milliseconds expected, -1 = until sent)", fname);
        int linger = (int)v;
        if (zmq_setsockopt(z->s, ZMQ_LINGER, &linger, sizeof linger) != 0)
            zraise(L, zmq_errno(), fname, "cannot set linger = %d", linger);
    }
    sock_release(z);
    return 0;
}

static int s_tostring(lua_State *L) {
    zsock *z = luaL_testudata(L, 1, SOCK_MT);
    if (!z) return 0;
    if (!z->s) {
        lua_pushfstring(L, "ds4.zmq.socket %s (closed)", type_name(z->type));
        return 1;
    }
    char buf[512];
    size_t n = sizeof buf;
    if (zmq_getsockopt(z->s, ZMQ_LAST_ENDPOINT, buf, &n) != 0 || n <= 1)
        lua_pushfstring(L, "ds4.zmq.socket %s (%p)", type_name(z->type), z->s);
    else
        lua_pushfstring(L, "ds4.zmq.socket %s %s", type_name(z->type), buf);
    return 1;
}

/* ds4.zmq.poll(socks, timeout_ms) -> array of booleans: readable */
static int l_poll(lua_State *L) {
    const char *fname = "ds4.zmq.poll";
    if (!lua_istable(L, 1))
        ds4l_raise(L, "%s: bad argument #1 (array of sockets expected, got %s)", fname, luaL_typename(L, 1));
    long timeout = opt_timeout(L, 2, fname, "bad argument #2 (timeout)");
    lua_settop(L, 2);
    size_t n = lua_objlen(L, 1);
    if (n > 4096) ds4l_raise(L, "%s: %zu sockets; at most 4096", fname, n);
    zmq_pollitem_t *items = lua_newuserdata(L, (n ? n : 1) * sizeof *items);
    char what[64];
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, 1, (int)i + 1);
        snprintf(what, sizeof what, "socks[%zu]", i + 1);
        zsock *z = check_sock_at(L, -1, fname, what);
        memset(&items[i], 0, sizeof items[i]);
        items[i].socket = z->s;
        items[i].events = ZMQ_POLLIN;
        lua_pop(L, 1);
    }
    if (n) poll_until(L, fname, items, (int)n, deadline_of(timeout));
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_pushboolean(L, (items[i].revents & ZMQ_POLLIN) != 0);
        lua_rawseti(L, -2, (int)i + 1);
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------------ keys */

static void need_curve(lua_State *L, const char *fname) {
    if (!zmq_has("curve"))
        ds4l_raise(L, "%s: this libzmq has no CURVE support (zmq_has(\"curve\") is false: built without libsodium)",
                   fname);
}

static int l_keypair(lua_State *L) {
    const char *fname = "ds4.zmq.keypair";
    need_curve(L, fname);
    char pub[KEY_Z85 + 1], sec[KEY_Z85 + 1];
    if (zmq_curve_keypair(pub, sec) != 0) zraise(L, zmq_errno(), fname, "zmq_curve_keypair failed");
    lua_pushstring(L, pub);
    lua_pushstring(L, sec);
    return 2;
}

static int l_public_from_secret(lua_State *L) {
    const char *fname = "ds4.zmq.public_from_secret";
    need_curve(L, fname);
    size_t n = 0;
    const char *sec = lua_type(L, 1) == LUA_TSTRING ? lua_tolstring(L, 1, &n) : NULL;
    uint8_t bin[32];
    if (!sec || n != KEY_Z85 || strlen(sec) != KEY_Z85 || !zmq_z85_decode(bin, sec))
        ds4l_raise(L, "%s: bad argument #1 (a secret key of 40 Z85 characters expected, got %s)", fname,
                   sec ? "a string that is not one" : luaL_typename(L, 1));
    char pub[KEY_Z85 + 1];
    if (zmq_curve_public(pub, sec) != 0) zraise(L, zmq_errno(), fname, "zmq_curve_public failed");
    lua_pushstring(L, pub);
    return 1;
}

/* The key in a key file's text: the first line that is neither blank nor a '#' comment; its last
 * whitespace-separated word (so "public <z85>" as `ds4 keygen` prints works too). Returns its length or 0. */
static size_t key_in_text(const char *s, size_t n, const char **key) {
    size_t i = 0;
    while (i < n) {
        size_t e = i;
        while (e < n && s[e] != '\n') e++;
        size_t a = i, b = e;
        while (a < b && (s[a] == ' ' || s[a] == '\t' || s[a] == '\r')) a++;
        while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t' || s[b - 1] == '\r')) b--;
        if (a < b && s[a] != '#') {
            size_t w = b;
            while (w > a && s[w - 1] != ' ' && s[w - 1] != '\t') w--;
            *key = s + w;
            return b - w;
        }
        i = e + 1;
    }
    return 0;
}

/* ds4.zmq.read_key(path) -> the Z85 key of a `ds4 keygen` file (PREFIX.key or PREFIX.pub) */
static int l_read_key(lua_State *L) {
    const char *fname = "ds4.zmq.read_key";
    const char *path = lua_type(L, 1) == LUA_TSTRING ? lua_tostring(L, 1) : NULL;
    if (!path) ds4l_raise(L, "%s: bad argument #1 (path string expected, got %s)", fname, luaL_typename(L, 1));
    char buf[4096];
    FILE *f = fopen(path, "rb");
    if (!f) ds4l_raise(L, "%s: cannot open %s: %s", fname, path, strerror(errno));
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad) ds4l_raise(L, "%s: cannot read %s", fname, path);
    buf[n] = 0;
    const char *key = NULL;
    size_t kl = key_in_text(buf, n, &key);
    char z85[KEY_Z85 + 1];
    uint8_t bin[32];
    if (kl == KEY_Z85) {
        memcpy(z85, key, KEY_Z85);
        z85[KEY_Z85] = 0;
    }
    if (kl != KEY_Z85 || !zmq_z85_decode(bin, z85))
        ds4l_raise(L, "%s: %s holds no CURVE key (40 Z85 characters on the first line that is not a # comment)", fname,
                   path);
    lua_pushstring(L, z85);
    return 1;
}

static int l_has(lua_State *L) {
    if (lua_type(L, 1) != LUA_TSTRING)
        ds4l_raise(L, "ds4.zmq.has: bad argument #1 (capability name expected, e.g. \"curve\", got %s)",
                   luaL_typename(L, 1));
    lua_pushboolean(L, zmq_has(lua_tostring(L, 1)) != 0);
    return 1;
}

static int l_version(lua_State *L) {
    int a = 0, b = 0, c = 0;
    zmq_version(&a, &b, &c);
    lua_pushfstring(L, "%d.%d.%d", a, b, c);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ ZAP */

typedef struct zap_box {
    ds4_zap *z;
    zctx *c;
} zap_box;

static void zap_release(zap_box *b) {
    ds4_zap_stop(b->z); /* joins the thread and closes its socket before the context can go */
    b->z = NULL;
    zctx_release(b->c);
    b->c = NULL;
}

static int zap_gc(lua_State *L) {
    zap_box *b = luaL_testudata(L, 1, ZAP_MT);
    if (b) zap_release(b);
    return 0;
}

static zap_box *check_zap(lua_State *L, const char *fname, int running) {
    zap_box *b = luaL_testudata(L, 1, ZAP_MT);
    if (!b)
        ds4l_raise(L, "%s: self must be a ds4.zmq ZAP handler (got %s); call it as handler:method(...)", fname,
                   luaL_typename(L, 1));
    if (running && !b->z) ds4l_raise(L, "%s: the handler is stopped", fname);
    return b;
}

static const char *check_key_arg(lua_State *L, int idx, const char *fname, const char *what) {
    size_t n = 0;
    const char *k = lua_type(L, idx) == LUA_TSTRING ? lua_tolstring(L, idx, &n) : NULL;
    uint8_t bin[32];
    if (!k || n != KEY_Z85 || strlen(k) != KEY_Z85 || !zmq_z85_decode(bin, k))
        ds4l_raise(L, "%s: %s must be a CURVE public key of 40 Z85 characters, got %s", fname, what,
                   k ? "a string that is not one" : luaL_typename(L, idx));
    return k;
}

/* ds4.zmq.zap{allow = {public_z85, ...}, quiet = false} -> handler */
static int l_zap(lua_State *L) {
    const char *fname = "ds4.zmq.zap";
    const int opts = ds4l_opt_table(L, 1, fname, 1);
    lua_settop(L, 1);
    static const char *const known[] = {"allow", "quiet", NULL};
    ds4l_check_keys(L, opts, fname, known);
    const int quiet = ds4l_opt_bool(L, opts, "quiet", 0, fname);
    if (opts) {
        lua_getfield(L, 1, "allow"); /* slot 2 */
        if (!lua_isnil(L, 2) && !lua_istable(L, 2))
            ds4l_raise(L, "%s: opts.allow must be an array of Z85 public keys, got %s", fname, luaL_typename(L, 2));
    } else {
        lua_pushnil(L);
    }
    size_t nallow = lua_istable(L, 2) ? lua_objlen(L, 2) : 0;
    char what[64];
    for (size_t i = 0; i < nallow; i++) { /* check every key before anything starts */
        lua_rawgeti(L, 2, (int)i + 1);
        snprintf(what, sizeof what, "opts.allow[%zu]", i + 1);
        check_key_arg(L, -1, fname, what);
        lua_pop(L, 1);
    }
    need_curve(L, fname);
    lua_getfield(L, LUA_REGISTRYINDEX, ZAP_KEY);
    zap_box *cur = luaL_testudata(L, -1, ZAP_MT);
    if (cur && cur->z)
        ds4l_raise(L, "%s: a ZAP handler already runs in this Lua state (one per ZeroMQ context: stop it first)",
                   fname);
    lua_pop(L, 1);

    zap_box *b = lua_newuserdata(L, sizeof *b); /* slot 3 */
    b->z = NULL;
    b->c = NULL;
    luaL_getmetatable(L, ZAP_MT);
    lua_setmetatable(L, -2);
    zctx *c = ctx_get(L, fname);
    b->c = c;
    c->refs++;
    ds4_zap_options zo = {.quiet = quiet};
    ds4_error err = {0};
    if (ds4_zap_start(c->ctx, &zo, &b->z, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    for (size_t i = 0; i < nallow; i++) {
        lua_rawgeti(L, 2, (int)i + 1);
        if (ds4_zap_allow(b->z, lua_tostring(L, -1), &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        lua_pop(L, 1);
    }
    lua_pushvalue(L, 3);
    lua_setfield(L, LUA_REGISTRYINDEX, ZAP_KEY); /* runs until stopped, even when the script drops it */
    return 1;
}

static int z_allow(lua_State *L) {
    const char *fname = "ds4.zmq.zap:allow";
    zap_box *b = check_zap(L, fname, 1);
    const char *k = check_key_arg(L, 2, fname, "bad argument #1");
    ds4_error err = {0};
    if (ds4_zap_allow(b->z, k, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_pushboolean(L, 1);
    return 1;
}

static int z_deny(lua_State *L) {
    const char *fname = "ds4.zmq.zap:deny";
    zap_box *b = check_zap(L, fname, 1);
    const char *k = check_key_arg(L, 2, fname, "bad argument #1");
    lua_pushboolean(L, ds4_zap_deny(b->z, k) == 1);
    return 1;
}

static int z_is_allowed(lua_State *L) {
    const char *fname = "ds4.zmq.zap:is_allowed";
    zap_box *b = check_zap(L, fname, 1);
    const char *k = check_key_arg(L, 2, fname, "bad argument #1");
    lua_pushboolean(L, ds4_zap_is_allowed(b->z, k));
    return 1;
}

static int z_allowed(lua_State *L) {
    const char *fname = "ds4.zmq.zap:allowed";
    zap_box *b = check_zap(L, fname, 1);
    size_t n = ds4_zap_allowed(b->z, NULL, 0);
    for (;;) {
        char(*keys)[KEY_Z85 + 1] = lua_newuserdata(L, (n ? n : 1) * sizeof *keys);
        size_t m = ds4_zap_allowed(b->z, keys, n);
        if (m > n) { /* grew in between (another thread cannot add keys, but be exact) */
            lua_pop(L, 1);
            n = m;
            continue;
        }
        lua_createtable(L, (int)m, 0);
        for (size_t i = 0; i < m; i++) {
            lua_pushstring(L, keys[i]);
            lua_rawseti(L, -2, (int)i + 1);
        }
        return 1;
    }
}

static int z_stats(lua_State *L) {
    const char *fname = "ds4.zmq.zap:stats";
    zap_box *b = check_zap(L, fname, 1);
    ds4_zap_stats *st = lua_newuserdata(L, sizeof *st);
    ds4_zap_get_stats(b->z, st);
    lua_createtable(L, 0, 4);
    ds4l_set_int(L, "accepted", st->accepted);
    ds4l_set_int(L, "refused", st->refused);
    ds4l_set_int(L, "allowed", st->n_allowed);
    lua_createtable(L, (int)st->n_refused_keys, 0);
    for (uint32_t i = 0; i < st->n_refused_keys; i++) {
        lua_pushstring(L, st->refused_keys[i]);
        lua_rawseti(L, -2, (int)i + 1);
    }
    lua_setfield(L, -2, "refused_keys");
    return 1;
}

/* handler:stop(): stops and joins the thread; CURVE handshakes after it are no longer authenticated. */
static int z_stop(lua_State *L) {
    zap_box *b = check_zap(L, "ds4.zmq.zap:stop", 0);
    zap_release(b);
    lua_getfield(L, LUA_REGISTRYINDEX, ZAP_KEY);
    if (lua_rawequal(L, -1, 1)) {
        lua_pushnil(L);
        lua_setfield(L, LUA_REGISTRYINDEX, ZAP_KEY);
    }
    return 0;
}

static int z_running(lua_State *L) {
    zap_box *b = check_zap(L, "ds4.zmq.zap:running", 0);
    lua_pushboolean(L, b->z != NULL);
    return 1;
}

static int z_tostring(lua_State *L) {
    zap_box *b = luaL_testudata(L, 1, ZAP_MT);
    if (!b) return 0;
    if (!b->z) {
        lua_pushliteral(L, "ds4.zmq.zap (stopped)");
        return 1;
    }
    ds4_zap_stats *st = lua_newuserdata(L, sizeof *st);
    ds4_zap_get_stats(b->z, st);
    lua_pushfstring(L, "ds4.zmq.zap (%d keys allowed, %d accepted, %d refused)", (int)st->n_allowed, (int)st->accepted,
                    (int)st->refused);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ module */

static const luaL_Reg sock_methods[] = {
    {"set", s_set},       {"get", s_get},   {"bind", s_bind}, {"connect", s_connect}, {"disconnect", s_disconnect},
    {"unbind", s_unbind}, {"send", s_send}, {"recv", s_recv}, {"events", s_events},   {"type", s_type},
    {"close", s_close},   {NULL, NULL},
};

static const luaL_Reg zap_methods[] = {
    {"allow", z_allow}, {"deny", z_deny}, {"is_allowed", z_is_allowed}, {"allowed", z_allowed},
    {"stats", z_stats}, {"stop", z_stop}, {"running", z_running},       {NULL, NULL},
};

static const luaL_Reg zmq_functions[] = {
    {"socket", l_socket},
    {"poll", l_poll},
    {"keypair", l_keypair},
    {"public_from_secret", l_public_from_secret},
    {"read_key", l_read_key},
    {"has", l_has},
    {"version", l_version},
    {"zap", l_zap},
    {NULL, NULL},
};

void ds4l_zmq_open(lua_State *L) {
    ds4l_class(L, SOCK_MT, sock_methods, sock_gc, s_tostring);
    lua_pop(L, 1);
    ds4l_class(L, ZAP_MT, zap_methods, zap_gc, z_tostring);
    lua_pop(L, 1);
    ds4l_class(L, MSG_MT, NULL, msg_gc, NULL);
    lua_pop(L, 1);
    ds4l_class(L, CTX_MT, NULL, holder_gc, NULL);
    lua_pop(L, 1);
    lua_newtable(L);
    for (const luaL_Reg *r = zmq_functions; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_setfield(L, -2, "zmq");
}

/* ------------------------------------------------------------------------------------------------ keygen */

/* Write text to path with this mode (O_EXCL unless force). 0 on success, else errno. */
static int write_key_file(const char *path, const char *text, int force, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (force ? O_TRUNC : O_EXCL), mode);
    if (fd < 0) return errno;
    int e = 0;
    if (fchmod(fd, mode) != 0) e = errno; /* the umask, or an existing file's mode (--force), would stay */
    size_t n = strlen(text), o = 0;
    while (!e && o < n) {
        ssize_t w = write(fd, text + o, n - o);
        if (w < 0) {
            if (errno == EINTR) continue;
            e = errno;
        } else {
            o += (size_t)w;
        }
    }
    if (!e && fsync(fd) != 0) e = errno;
    if (close(fd) != 0 && !e) e = errno;
    return e;
}

static void keygen_usage(FILE *f) {
    fprintf(f, "usage: ds4 keygen [--out PREFIX] [--force]\n"
               "  makes a CURVE key pair for ZeroMQ (Z85 text). With --out: PREFIX.key (the secret key, mode 0600)\n"
               "  and PREFIX.pub (the public key), creating PREFIX's missing directories (mode 0700); existing files\n"
               "  are kept unless --force. Without --out: prints \"public <z85>\" and \"secret <z85>\" to stdout.\n");
}

/* mkdir -p of the directories above prefix ("keys/w1" -> keys), the new ones mode 0700: they hold secret keys.
 * Returns 0, or errno with the failing directory in `dir` (cap bytes). */
static int make_parents(const char *prefix, char *dir, size_t cap) {
    size_t n = strlen(prefix);
    if (n >= cap) return ENAMETOOLONG;
    memcpy(dir, prefix, n + 1);
    for (size_t i = 1; i < n; i++) {
        if (dir[i] != '/' || dir[i - 1] == '/') continue;
        dir[i] = 0;
        struct stat st;
        if (mkdir(dir, 0700) != 0 && !(errno == EEXIST && stat(dir, &st) == 0 && S_ISDIR(st.st_mode)))
            return errno == EEXIST ? ENOTDIR : errno;
        dir[i] = '/';
    }
    return 0;
}

int ds4l_keygen_main(int argc, char **argv) {
    const char *prefix = NULL;
    int force = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            keygen_usage(stdout);
            return 0;
        }
        if (strcmp(a, "--force") == 0) {
            force = 1;
        } else if (strcmp(a, "--out") == 0 || strncmp(a, "--out=", 6) == 0) {
            const char *v = a[5] == '=' ? a + 6 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v || !*v) {
                fprintf(stderr, "ds4 keygen: --out needs a path prefix\n\n");
                keygen_usage(stderr);
                return 2;
            }
            if (prefix) {
                fprintf(stderr, "ds4 keygen: --out given twice\n\n");
                keygen_usage(stderr);
                return 2;
            }
            prefix = v;
        } else {
            fprintf(stderr, "ds4 keygen: unknown argument '%s'\n\n", a);
            keygen_usage(stderr);
            return 2;
        }
    }
    if (force && !prefix) {
        fprintf(stderr, "ds4 keygen: --force goes with --out\n\n");
        keygen_usage(stderr);
        return 2;
    }
    if (!zmq_has("curve")) {
        fprintf(stderr, "ds4 keygen: this libzmq has no CURVE support (built without libsodium)\n");
        return 1;
    }
    char pub[KEY_Z85 + 1], sec[KEY_Z85 + 1];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "ds4 keygen: zmq_curve_keypair failed (%s)\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    if (!prefix) {
        printf("public %s\nsecret %s\n", pub, sec);
        memset(sec, 0, sizeof sec);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    size_t pl = strlen(prefix);
    char *kpath = malloc(pl + 5), *ppath = malloc(pl + 5);
    char text[256];
    int rc = 1;
    if (!kpath || !ppath) {
        fprintf(stderr, "ds4 keygen: out of memory\n");
        goto done;
    }
    snprintf(kpath, pl + 5, "%s.key", prefix);
    snprintf(ppath, pl + 5, "%s.pub", prefix);
    char dir[4096];
    int de = make_parents(prefix, dir, sizeof dir);
    if (de) {
        fprintf(stderr, "ds4 keygen: cannot create the directory %s: %s\n", de == ENAMETOOLONG ? prefix : dir,
                strerror(de));
        goto done;
    }
    if (!force) {
        struct stat st;
        const char *exists = stat(kpath, &st) == 0 ? kpath : stat(ppath, &st) == 0 ? ppath : NULL;
        if (exists) {
            fprintf(stderr, "ds4 keygen: %s exists (use --force to replace it)\n", exists);
            goto done;
        }
    }
    snprintf(text, sizeof text, "# ds4 CURVE secret key (Z85). Keep it private. Public key: %s\n%s\n", pub, sec);
    int e = write_key_file(kpath, text, force, 0600);
    if (e) {
        fprintf(stderr, "ds4 keygen: cannot write %s: %s\n", kpath, strerror(e));
        goto done;
    }
    snprintf(text, sizeof text, "%s\n", pub);
    e = write_key_file(ppath, text, force, 0644);
    if (e) {
        fprintf(stderr, "ds4 keygen: cannot write %s: %s\n", ppath, strerror(e));
        unlink(kpath);
        goto done;
    }
    printf("ds4 keygen: wrote %s (secret, mode 0600) and %s (public %s)\n", kpath, ppath, pub);
    rc = 0;
done:
    memset(sec, 0, sizeof sec);
    memset(text, 0, sizeof text);
    free(kpath);
    free(ppath);
    return rc;
}
