/* zap.c — the ZAP handler of zap.h: a REP socket at inproc://zeromq.zap.01, served by one thread.
 *
 * The thread waits in zmq_poll on the REP socket and on the read end of a pipe; ds4_zap_stop writes one byte
 * to the pipe, joins the thread and only then closes the socket (a socket is used by one thread at a time:
 * created and bound by the caller, handed to the thread by pthread_create's barrier, given back by
 * pthread_join's). Signals are blocked in the thread, so SIGINT is delivered to the program's own threads.
 *
 * Request (RFC 27): version "1.0", request id, domain, address, routing id, mechanism, credentials...
 * Reply: version "1.0", the request id, status code, status text, user id, metadata (empty). */
#define _POSIX_C_SOURCE 200809L /* pipe, clock_gettime, pthread_sigmask */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "internal.h"
#include "zap.h"

#define KEY_BYTES 32
#define MAX_PARTS 8 /* CURVE requests have 7 frames; more are read and dropped (the reply is 500) */
#define LOG_FOLD_SECONDS 10.0

typedef struct refused_key {
    char z85[DS4_ZAP_KEY_Z85 + 1];
    double last_log; /* monotonic seconds of its last stderr line */
    uint64_t folded; /* refusals not logged since then */
} refused_key;

struct ds4_zap {
    void *sock;
    int pipe_rd, pipe_wr;
    pthread_t thread;
    int quiet;
    pthread_mutex_t mu; /* guards everything below */
    uint8_t (*keys)[KEY_BYTES];
    size_t n_keys, cap_keys;
    uint64_t accepted, refused;
    refused_key refused_keys[DS4_ZAP_REFUSED_KEEP]; /* least recently refused first */
    uint32_t n_refused;
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 1 when s is 40 Z85 characters that decode to a key (into out). */
static int decode_key(const char *s, uint8_t out[KEY_BYTES]) {
    if (!s || strnlen(s, DS4_ZAP_KEY_Z85 + 1) != DS4_ZAP_KEY_Z85) return 0;
    return zmq_z85_decode(out, s) != NULL;
}

static ptrdiff_t find_key(const ds4_zap *z, const uint8_t key[KEY_BYTES]) {
    for (size_t i = 0; i < z->n_keys; i++)
        if (memcmp(z->keys[i], key, KEY_BYTES) == 0) return (ptrdiff_t)i;
    return -1;
}

/* ------------------------------------------------------------------------------------------------ the thread */

/* What a refusal logs, decided under the lock, printed after it. */
typedef struct log_line {
    int print;
    uint64_t folded;
} log_line;

/* Count a refusal of key z85 and move it to the end of the remembered keys (caller holds the lock). */
static log_line note_refusal(ds4_zap *z, const char *z85) {
    log_line ll = {0, 0};
    double t = now_seconds();
    refused_key rk;
    uint32_t i = 0;
    while (i < z->n_refused && strcmp(z->refused_keys[i].z85, z85) != 0) i++;
    if (i < z->n_refused) {
        rk = z->refused_keys[i];
        memmove(&z->refused_keys[i], &z->refused_keys[i + 1], (z->n_refused - i - 1) * sizeof rk);
        z->n_refused--;
    } else {
        memset(&rk, 0, sizeof rk);
        memcpy(rk.z85, z85, DS4_ZAP_KEY_Z85 + 1);
        rk.last_log = t - 2 * LOG_FOLD_SECONDS;
        if (z->n_refused == DS4_ZAP_REFUSED_KEEP) {
            memmove(&z->refused_keys[0], &z->refused_keys[1], (DS4_ZAP_REFUSED_KEEP - 1) * sizeof rk);
            z->n_refused--;
        }
    }
    if (t - rk.last_log >= LOG_FOLD_SECONDS) {
        ll.print = 1;
        ll.folded = rk.folded;
        rk.folded = 0;
        rk.last_log = t;
    } else {
        rk.folded++;
    }
    z->refused_keys[z->n_refused++] = rk;
    return ll;
}

/* A frame as a printable C string (other bytes as '?'), cut to cap - 1 bytes. */
static void frame_text(zmq_msg_t *m, char *buf, size_t cap) {
    size_t n = zmq_msg_size(m);
    const unsigned char *p = zmq_msg_data(m);
    if (n > cap - 1) n = cap - 1;
    for (size_t i = 0; i < n; i++) buf[i] = (p[i] >= 0x20 && p[i] < 0x7f) ? (char)p[i] : '?';
    buf[n] = 0;
}

static int frame_is(zmq_msg_t *m, const char *s) {
    size_t n = strlen(s);
    return zmq_msg_size(m) == n && memcmp(zmq_msg_data(m), s, n) == 0;
}

/* Send one reply frame; 0 on failure (logged). The REP socket is blocking here: its peer is libzmq's own
 * session on an inproc pipe, which reads replies as they come. */
static int send_part(ds4_zap *z, const void *data, size_t len, int more) {
    for (;;) {
        if (zmq_send(z->sock, data, len, more ? ZMQ_SNDMORE : 0) >= 0) return 1;
        if (zmq_errno() == EINTR) continue;
        fprintf(stderr, "ds4 zap: cannot send a reply frame: %s\n", zmq_strerror(zmq_errno()));
        return 0;
    }
}

static void handle_request(ds4_zap *z) {
    zmq_msg_t parts[MAX_PARTS];
    int n = 0, extra = 0, more = 1;
    while (more) {
        zmq_msg_t *m = n < MAX_PARTS ? &parts[n] : NULL;
        zmq_msg_t spare;
        if (!m) m = &spare;
        if (zmq_msg_init(m) != 0) break; /* cannot fail for an empty message; checked all the same */
        int rc = zmq_msg_recv(m, z->sock, ZMQ_DONTWAIT);
        if (rc < 0) {
            int e = zmq_errno();
            zmq_msg_close(m);
            if (e == EINTR) continue;
            if (n == 0 && e == EAGAIN) return; /* nothing there after all: still waiting for a request */
            fprintf(stderr, "ds4 zap: cannot read a request: %s\n", zmq_strerror(e));
            break;
        }
        more = zmq_msg_more(m);
        if (m == &spare) {
            zmq_msg_close(m);
            extra++;
        } else {
            n++;
        }
    }
    if (n == 0) return; /* nothing received: no reply owed */

    const char *status = "500", *text = "malformed ZAP request";
    char user[DS4_ZAP_KEY_Z85 + 1] = "";
    char address[128] = "?";
    int curve_refused = 0;
    if (n >= 6 && !extra && frame_is(&parts[0], "1.0")) {
        frame_text(&parts[3], address, sizeof address);
        if (frame_is(&parts[5], "CURVE")) {
            if (n == 7 && zmq_msg_size(&parts[6]) == KEY_BYTES) {
                char z85[DS4_ZAP_KEY_Z85 + 1];
                if (zmq_z85_encode(z85, zmq_msg_data(&parts[6]), KEY_BYTES)) {
                    pthread_mutex_lock(&z->mu);
                    int ok = find_key(z, zmq_msg_data(&parts[6])) >= 0;
                    pthread_mutex_unlock(&z->mu);
                    if (ok) {
                        status = "200";
                        text = "OK";
                        memcpy(user, z85, sizeof user);
                    } else {
                        status = "400";
                        text = "unknown CURVE key";
                        memcpy(user, z85, sizeof user); /* for the log below; not sent */
                        curve_refused = 1;
                    }
                }
            }
        } else if (frame_is(&parts[5], "NULL") && n == 6) {
            status = "200";
            text = "OK";
        } else {
            status = "400";
            text = "only CURVE is accepted";
        }
    }

    log_line ll = {0, 0};
    pthread_mutex_lock(&z->mu);
    if (status[0] == '2') {
        z->accepted++;
    } else {
        z->refused++;
        if (curve_refused) ll = note_refusal(z, user);
    }
    pthread_mutex_unlock(&z->mu);
    if (curve_refused) {
        if (ll.print && !z->quiet) {
            if (ll.folded)
                fprintf(stderr, "ds4 zap: refused CURVE key %s from %s (%llu more refusals of it not logged)\n", user,
                        address, (unsigned long long)ll.folded);
            else
                fprintf(stderr, "ds4 zap: refused CURVE key %s from %s\n", user, address);
        }
        user[0] = 0; /* a refused client gets no user id */
    } else if (status[0] != '2' && !z->quiet) {
        fprintf(stderr, "ds4 zap: refused a handshake from %s: %s\n", address, text);
    }

    /* The reply: version, request id, status code, status text, user id, metadata. */
    int ok = send_part(z, "1.0", 3, 1);
    if (ok) ok = n >= 2 ? send_part(z, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]), 1) : send_part(z, "", 0, 1);
    if (ok) ok = send_part(z, status, 3, 1);
    if (ok) ok = send_part(z, text, strlen(text), 1);
    if (ok) ok = send_part(z, user, strlen(user), 1);
    if (ok) send_part(z, "", 0, 0);
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
}

static void *zap_main(void *arg) {
    ds4_zap *z = arg;
    for (;;) {
        zmq_pollitem_t items[2];
        memset(items, 0, sizeof items);
        items[0].socket = z->sock;
        items[0].events = ZMQ_POLLIN;
        items[1].fd = z->pipe_rd;
        items[1].events = ZMQ_POLLIN;
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR) continue;
            /* ETERM cannot happen while the owner keeps the context; anything else stops the handler, and
             * CURVE handshakes then wait for an answer until they time out (never an unchecked accept). */
            fprintf(stderr, "ds4 zap: handler stopped: zmq_poll: %s\n", zmq_strerror(zmq_errno()));
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) break;
        if (items[0].revents & ZMQ_POLLIN) handle_request(z);
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ API */

ds4_status ds4_zap_start(void *zmq_ctx, const ds4_zap_options *opt, ds4_zap **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "zap start: out is NULL");
    *out = NULL;
    if (!zmq_ctx) return ds4_fail(err, DS4_ERR_ARG, "zap start: the ZeroMQ context is NULL");
    ds4_zap *z = calloc(1, sizeof *z);
    if (!z) return ds4_fail(err, DS4_ERR_OOM, "zap start: out of memory");
    z->pipe_rd = z->pipe_wr = -1;
    z->quiet = opt ? opt->quiet : 0;
    int e = pthread_mutex_init(&z->mu, NULL);
    if (e) {
        free(z);
        return ds4_fail(err, DS4_ERR_IO, "zap start: pthread_mutex_init: %s", strerror(e));
    }
    ds4_status st = DS4_OK;
    z->sock = zmq_socket(zmq_ctx, ZMQ_REP);
    if (!z->sock) {
        st = ds4_fail(err, DS4_ERR_IO, "zap start: cannot create the REP socket (%s)", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int linger = 0;
    if (zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "zap start: ZMQ_LINGER (%s)", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_bind(z->sock, DS4_ZAP_ENDPOINT) != 0) {
        int be = zmq_errno();
        st = ds4_fail(err, be == EADDRINUSE ? DS4_ERR_ARG : DS4_ERR_IO, "zap start: cannot bind %s%s (%s)",
                      DS4_ZAP_ENDPOINT, be == EADDRINUSE ? ": a ZAP handler already runs in this context" : "",
                      zmq_strerror(be));
        goto fail;
    }
    int fds[2];
    if (pipe(fds) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "zap start: pipe: %s", strerror(errno));
        goto fail;
    }
    z->pipe_rd = fds[0];
    z->pipe_wr = fds[1];
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the thread inherits "everything blocked" */
    e = pthread_create(&z->thread, NULL, zap_main, z);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        st = ds4_fail(err, DS4_ERR_IO, "zap start: pthread_create: %s", strerror(e));
        goto fail;
    }
    *out = z;
    return DS4_OK;
fail:
    if (z->sock) zmq_close(z->sock);
    if (z->pipe_rd >= 0) close(z->pipe_rd);
    if (z->pipe_wr >= 0) close(z->pipe_wr);
    pthread_mutex_destroy(&z->mu);
    free(z);
    return st;
}

ds4_status ds4_zap_allow(ds4_zap *z, const char *key_z85, ds4_error *err) {
    uint8_t key[KEY_BYTES];
    if (!z) return ds4_fail(err, DS4_ERR_ARG, "zap allow: handler is NULL");
    if (!decode_key(key_z85, key))
        return ds4_fail(err, DS4_ERR_ARG, "zap allow: not a CURVE public key (40 Z85 characters expected)");
    ds4_status st = DS4_OK;
    pthread_mutex_lock(&z->mu);
    if (find_key(z, key) < 0) {
        if (z->n_keys == z->cap_keys) {
            size_t cap = z->cap_keys ? 2 * z->cap_keys : 16;
            void *p = realloc(z->keys, cap * KEY_BYTES);
            if (!p) {
                st = ds4_fail(err, DS4_ERR_OOM, "zap allow: out of memory (%zu keys)", z->n_keys);
            } else {
                z->keys = p;
                z->cap_keys = cap;
            }
        }
        if (st == DS4_OK) memcpy(z->keys[z->n_keys++], key, KEY_BYTES);
    }
    pthread_mutex_unlock(&z->mu);
    return st;
}

int ds4_zap_deny(ds4_zap *z, const char *key_z85) {
    uint8_t key[KEY_BYTES];
    if (!z || !decode_key(key_z85, key)) return -1;
    pthread_mutex_lock(&z->mu);
    ptrdiff_t i = find_key(z, key);
    if (i >= 0) {
        memmove(z->keys[i], z->keys[i + 1], (z->n_keys - (size_t)i - 1) * KEY_BYTES);
        z->n_keys--;
    }
    pthread_mutex_unlock(&z->mu);
    return i >= 0;
}

int ds4_zap_is_allowed(ds4_zap *z, const char *key_z85) {
    uint8_t key[KEY_BYTES];
    if (!z || !decode_key(key_z85, key)) return 0;
    pthread_mutex_lock(&z->mu);
    int ok = find_key(z, key) >= 0;
    pthread_mutex_unlock(&z->mu);
    return ok;
}

void ds4_zap_get_stats(ds4_zap *z, ds4_zap_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!z) return;
    pthread_mutex_lock(&z->mu);
    out->accepted = z->accepted;
    out->refused = z->refused;
    out->n_refused_keys = z->n_refused;
    for (uint32_t i = 0; i < z->n_refused; i++)
        memcpy(out->refused_keys[i], z->refused_keys[i].z85, DS4_ZAP_KEY_Z85 + 1);
    out->n_allowed = (uint32_t)z->n_keys;
    pthread_mutex_unlock(&z->mu);
}

size_t ds4_zap_allowed(ds4_zap *z, char (*keys)[DS4_ZAP_KEY_Z85 + 1], size_t cap) {
    if (!z) return 0;
    pthread_mutex_lock(&z->mu);
    size_t n = z->n_keys;
    for (size_t i = 0; i < n && i < cap; i++)
        if (!zmq_z85_encode(keys[i], z->keys[i], KEY_BYTES)) keys[i][0] = 0;
    pthread_mutex_unlock(&z->mu);
    return n;
}

void ds4_zap_stop(ds4_zap *z) {
    if (!z) return;
    char b = 1;
    while (write(z->pipe_wr, &b, 1) < 0 && errno == EINTR) {
    }
    pthread_join(z->thread, NULL);
    /* Unbind first: zmq_close releases an inproc endpoint later, in libzmq's reaper thread, and a handler started
     * right after this one would find the endpoint still taken. zmq_unbind of inproc is synchronous. */
    if (zmq_unbind(z->sock, DS4_ZAP_ENDPOINT) != 0 && zmq_errno() != ENOENT)
        fprintf(stderr, "ds4 zap: cannot unbind %s: %s\n", DS4_ZAP_ENDPOINT, zmq_strerror(zmq_errno()));
    if (zmq_close(z->sock) != 0) /* only for a pointer that is not a socket */
        fprintf(stderr, "ds4 zap: zmq_close: %s\n", zmq_strerror(zmq_errno()));
    close(z->pipe_rd);
    close(z->pipe_wr);
    pthread_mutex_destroy(&z->mu);
    free(z->keys);
    free(z);
}
