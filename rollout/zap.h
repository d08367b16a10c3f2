/* zap.h — a ZAP handler (ZeroMQ RFC 27) that authenticates CURVE clients against an allow-list of public keys.
 *
 * libzmq asks the socket bound at inproc://zeromq.zap.01 in a context about every CURVE handshake made by a
 * CURVE server socket of that context (ZMQ_CURVE_SERVER = 1). ds4_zap_start binds that endpoint with a REP
 * socket and answers from a thread of its own:
 *   - CURVE, client key in the allow-list: 200, user id = the key in Z85;
 *   - CURVE, any other key: 400 "unknown CURVE key", counted, remembered (the last DS4_ZAP_REFUSED_KEEP distinct
 *     keys) and logged to stderr: "ds4 zap: refused CURVE key <z85> from <address>" (repeats of one key within
 *     10 s are folded into the next line's count);
 *   - NULL (asked only for sockets that set a ZAP domain): 200, user id ""; PLAIN and anything else: 400;
 *   - a request that is not ZAP 1.0: 500.
 * The domain is not looked at: one handler, one allow-list for every CURVE server of the context.
 *
 * Order: start the handler BEFORE a CURVE server socket binds, or early handshakes are not authenticated
 * (libzmq then accepts every client, the "Stonehouse" pattern). Stop it (ds4_zap_stop) before zmq_ctx_term:
 * the handler's socket belongs to the context, and terminating a context with a running handler blocks.
 * After ds4_zap_stop, new CURVE handshakes are no longer authenticated.
 *
 * Threads: the allow-list and the statistics are shared between the caller and the handler thread under a
 * mutex; every function here may be called from any one thread (not concurrently with ds4_zap_stop). No global
 * state: a handler is tied to the context it was started in (at most one per context). */
#ifndef DS4_ZAP_H
#define DS4_ZAP_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define DS4_ZAP_REFUSED_KEEP 64 /* distinct refused keys remembered */
#define DS4_ZAP_KEY_Z85 40      /* characters of a Z85 CURVE key (32 bytes) */

typedef struct ds4_zap ds4_zap;

typedef struct ds4_zap_options {
    int quiet; /* nonzero: no stderr line per refusal */
} ds4_zap_options;

typedef struct ds4_zap_stats {
    uint64_t accepted;                                            /* handshakes answered 200 */
    uint64_t refused;                                             /* handshakes answered 400 or 500 */
    uint32_t n_refused_keys;                                      /* entries of refused_keys */
    char refused_keys[DS4_ZAP_REFUSED_KEEP][DS4_ZAP_KEY_Z85 + 1]; /* distinct refused CURVE keys in Z85, the least
                                                                   recently refused first */
    uint32_t n_allowed;                                           /* keys in the allow-list */
} ds4_zap_stats;

/* Start a handler in zmq_ctx (a void * from zmq_ctx_new). opt may be NULL. DS4_ERR_ARG when the endpoint is
 * already bound in this context (another handler), DS4_ERR_IO for other ZeroMQ / thread failures. */
ds4_status ds4_zap_start(void *zmq_ctx, const ds4_zap_options *opt, ds4_zap **out, ds4_error *err);

/* Add a key (40 Z85 characters) to the allow-list (adding a present key is a no-op). DS4_ERR_ARG for a key that
 * is not Z85, DS4_ERR_OOM. */
ds4_status ds4_zap_allow(ds4_zap *z, const char *key_z85, ds4_error *err);

/* Remove a key from the allow-list: 1 when it was there, 0 when not, -1 when key_z85 is not a Z85 key. Already
 * established connections are not affected. */
int ds4_zap_deny(ds4_zap *z, const char *key_z85);

/* Counters, remembered refused keys and the allow-list size, as one consistent snapshot. */
void ds4_zap_get_stats(ds4_zap *z, ds4_zap_stats *out);

/* Copy up to cap allowed keys (Z85, NUL-terminated) into keys; returns how many there are in all. */
size_t ds4_zap_allowed(ds4_zap *z, char (*keys)[DS4_ZAP_KEY_Z85 + 1], size_t cap);

/* 1 when key_z85 is in the allow-list. */
int ds4_zap_is_allowed(ds4_zap *z, const char *key_z85);

/* Stop the thread, join it, close the socket and free the handler. NULL is a no-op. */
void ds4_zap_stop(ds4_zap *z);

#ifdef __cplusplus
}
#endif
#endif
