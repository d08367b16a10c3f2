/* tcp_backend.c — host collectives over TCP for torchrun-style launches: a star around rank 0.
 *
 * Rendezvous: rank 0 listens on MASTER_ADDR:MASTER_PORT and accepts one connection from every other rank; a rank
 * connects, retrying while rank 0 is not listening yet, and says who it is (hello); rank 0 checks every hello
 * (magic, protocol version, world size, rank in range and not seen before) and answers each with a welcome once all
 * ranks are there. A connection whose first bytes are not a ds4 hello (a port scanner, a stray client) is closed
 * and not counted.
 *
 * Messages: a 32-byte header, little-endian: magic "DS4C", op, sequence number (the collectives this rank has
 * made, so a rank that called a different collective or skipped one is named, not misread), payload bytes, an
 * op-specific word (dtype, root) and the sender's rank; then the payload. A receiver compares every field with what
 * it expects before it reads a payload byte, so nothing from the network sizes a buffer.
 *
 * Collectives go through rank 0: it receives from ranks 1, 2, ... in that order, sums in rank order (rank 0's
 * values + rank 1's + rank 2's ...) and sends the result back. Deterministic and simple; the traffic at rank 0 is
 * (world - 1) times the buffer each way, which is fine for the CPU ranks this exists for (NCCL carries device
 * buffers). Large reductions go in 1 MiB chunks, each sent and answered in turn, so that no socket buffer size can
 * deadlock the star.
 *
 * Every wait has the deadline the communicator was opened with (DS4_DIST_TIMEOUT): a rank that hangs makes the
 * others fail naming it; a rank that dies closes its connections, and its peers fail at once naming it. After a
 * failure the byte stream may be mid-message, so the communicator refuses every later collective. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "tcp_backend.h"

enum {
    MAGIC = 0x43345344u, /* "DS4C" read as little-endian bytes */
    VERSION = 1,
    HDR = 32,
    CHUNK = 1 << 20,
};
typedef enum {
    OP_HELLO = 1, OP_WELCOME, OP_BARRIER, OP_ALL_REDUCE, OP_ALL_GATHER, OP_BROADCAST, OP_ALL_TO_ALL, OP_REDUCE_SCATTER
} op_t;

static const char *op_name(uint32_t op) {
    switch (op) {
    case OP_HELLO:
    case OP_WELCOME: return "rendezvous";
    case OP_BARRIER: return "barrier";
    case OP_ALL_REDUCE: return "all_reduce";
    case OP_ALL_GATHER: return "all_gather";
    case OP_BROADCAST: return "broadcast";
    case OP_ALL_TO_ALL: return "all_to_all_v";
    case OP_REDUCE_SCATTER: return "reduce_scatter";
    }
    return "an unknown message";
}

typedef struct msg {
    uint32_t magic, op;
    uint64_t seq, bytes;
    uint32_t extra; /* all_reduce: dtype; broadcast: root; all_to_all_v: row bytes; hello / welcome: version */
    uint32_t rank;  /* the sender */
} msg;

struct dist_tcp {
    int32_t rank, world;
    double timeout_s;
    uint64_t seq;   /* collectives made so far */
    int *fd;        /* rank 0: [world] connection to each rank (fd[0] = -1); other ranks: [1] the one to rank 0 */
    int broken;     /* a collective failed: the streams may be mid-message */
    char *scratch;  /* rank 0: one chunk of a peer's values */
    char why[300];  /* what broke it */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ------------------------------------------------------------------------------------------------ byte streams */

/* Wait until fd is ready for `events` or the deadline passes: 1 ready, 0 timed out, -1 poll failed (errno). */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int ms = left > 1000.0 ? 1000000 : (int)(left * 1000.0) + 1;
        int r = poll(&p, 1, ms);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return -1;
    }
}

/* Send or receive exactly n bytes on non-blocking fd before the deadline. `peer` and `what` name the other side
 * and the collective in the error. */
static ds4_status xfer(dist_tcp *t, int fd, int send, void *p, size_t n, double deadline, int32_t peer,
                       const char *what, ds4_error *err) {
    char *b = p;
    while (n > 0) {
        ssize_t k = send ? write(fd, b, n) : read(fd, b, n);
        if (k > 0) {
            b += k, n -= (size_t)k;
            continue;
        }
        if (k == 0 && !send)
            return ds4_fail(err, DS4_ERR_COMM, "dist %s: rank %d closed its connection to rank %d (it exited or "
                                               "failed: see its output)", what, peer, t->rank);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return ds4_fail(err, DS4_ERR_COMM, "dist %s: %s rank %d (at rank %d): %s", what,
                            send ? "sending to" : "receiving from", peer, t->rank, strerror(errno));
        int r = wait_fd(fd, send ? POLLOUT : POLLIN, deadline);
        if (r < 0) return ds4_fail(err, DS4_ERR_COMM, "dist %s: poll: %s", what, strerror(errno));
        if (r == 0)
            return ds4_fail(err, DS4_ERR_COMM, "dist %s: rank %d %s rank %d for %g s (the timeout, DS4_DIST_TIMEOUT): "
                                               "it hangs, died without closing, or is in another collective", what,
                            peer, send ? "took nothing from" : "sent nothing to", t->rank, t->timeout_s);
    }
    return DS4_OK;
}

/* Add " (detail)" to a failure's message: the sizes of the collective that failed. */
static void append(ds4_error *err, const char *fmt, ...) DS4_PRINTF(2, 3);
static void append(ds4_error *err, const char *fmt, ...) {
    if (!err) return;
    size_t n = strnlen(err->msg, sizeof err->msg);
    va_list ap;
    va_start(ap, fmt);
    if (n + 1 < sizeof err->msg) vsnprintf(err->msg + n, sizeof err->msg - n, fmt, ap);
    va_end(ap);
}

static ds4_status send_msg(dist_tcp *t, int fd, int32_t peer, const msg *m, double deadline, ds4_error *err) {
    unsigned char h[HDR] = {0};
    put32(h, m->magic), put32(h + 4, m->op), put64(h + 8, m->seq), put64(h + 16, m->bytes);
    put32(h + 24, m->extra), put32(h + 28, m->rank);
    return xfer(t, fd, 1, h, HDR, deadline, peer, op_name(m->op), err);
}

/* Receive a header and check it against `want` field by field (rank: the peer we read from). */
static ds4_status recv_msg(dist_tcp *t, int fd, int32_t peer, const msg *want, double deadline, ds4_error *err) {
    unsigned char h[HDR];
    ds4_status st = xfer(t, fd, 0, h, HDR, deadline, peer, op_name(want->op), err);
    if (st) return st;
    msg m = {get32(h), get32(h + 4), get64(h + 8), get64(h + 16), get32(h + 24), get32(h + 28)};
    const char *w = op_name(want->op);
    if (m.magic != MAGIC)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s: rank %d sent a malformed message (magic 0x%08x, not a ds4 "
                                           "collective)", w, peer, m.magic);
    if (m.op != want->op || m.seq != want->seq)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s: rank %d is in %s #%llu while rank %d is in %s #%llu: the ranks "
                                           "called different collectives", w, peer, op_name(m.op),
                        (unsigned long long)m.seq, t->rank, w, (unsigned long long)want->seq);
    if (m.rank != want->rank)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s #%llu: the connection of rank %d carries a message from rank %u",
                        w, (unsigned long long)m.seq, peer, m.rank);
    if (m.bytes != want->bytes || m.extra != want->extra)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s #%llu: rank %d has %llu bytes (dtype / root %u) where rank %d has "
                                           "%llu bytes (dtype / root %u): the ranks passed different sizes, dtypes or "
                                           "roots", w, (unsigned long long)m.seq, peer, (unsigned long long)m.bytes,
                        m.extra, t->rank, (unsigned long long)want->bytes, want->extra);
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ rendezvous */

static int set_nonblocking(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* A connected socket: non-blocking, no Nagle delay (collectives are request / answer). */
static int prepare(int fd) {
    int one = 1;
    if (set_nonblocking(fd) < 0) return -1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static ds4_status resolve(const ds4_launch *l, int passive, struct addrinfo **out, ds4_error *err) {
    char port[16];
    snprintf(port, sizeof port, "%d", l->master_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
    int rc = getaddrinfo(l->master_addr, port, &hints, out);
    if (rc)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: MASTER_ADDR=%s MASTER_PORT=%d: %s", l->master_addr,
                        l->master_port, gai_strerror(rc));
    return DS4_OK;
}

static ds4_status listen_on(const ds4_launch *l, int *out, ds4_error *err) {
    struct addrinfo *ai = NULL;
    ds4_status st = resolve(l, 1, &ai, err);
    if (st) return st;
    int fd = -1, e = 0;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 || bind(fd, a->ai_addr, a->ai_addrlen) < 0 ||
            listen(fd, l->world_size) < 0 || set_nonblocking(fd) < 0) {
            e = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: rank 0 cannot listen on MASTER_ADDR=%s MASTER_PORT=%d: "
                                           "%s%s", l->master_addr, l->master_port, strerror(e),
                        e == EADDRINUSE ? " (another job on this port? choose another MASTER_PORT)"
                        : e == EADDRNOTAVAIL ? " (MASTER_ADDR must be an address of rank 0's machine)" : "");
    *out = fd;
    return DS4_OK;
}

/* One connection attempt to rank 0 that ends by `until`: a connected fd, or -1 with errno. */
static int connect_once(const struct addrinfo *ai, double until) {
    int e = ECONNREFUSED;
    for (const struct addrinfo *a = ai; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        if (set_nonblocking(fd) == 0) {
            int rc = connect(fd, a->ai_addr, a->ai_addrlen);
            if (rc < 0 && errno == EINPROGRESS) {
                int w = wait_fd(fd, POLLOUT, until);
                socklen_t len = sizeof e;
                if (w == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) == 0 && e == 0) rc = 0;
                else if (w == 0) e = ETIMEDOUT;
                else if (w < 0) e = errno;
            } else if (rc < 0) {
                e = errno;
            }
            if (rc == 0) return fd;
        } else {
            e = errno;
        }
        close(fd);
    }
    errno = e;
    return -1;
}

static ds4_status connect_to_root(dist_tcp *t, const ds4_launch *l, double deadline, ds4_error *err) {
    struct addrinfo *ai = NULL;
    int fd = -1, e = 0;
    /* a name that does not resolve yet (a starting container's DNS) is retried like a refused connection */
    while (fd < 0 && now_s() < deadline) {
        ds4_status st = ai ? DS4_OK : resolve(l, 0, &ai, err);
        if (st == DS4_OK) {
            double until = now_s() + 2.0;
            fd = connect_once(ai, until < deadline ? until : deadline);
            e = errno;
        }
        if (fd < 0) nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
    }
    if (ai) freeaddrinfo(ai);
    if (fd < 0)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: rank %d could not reach rank 0 at MASTER_ADDR=%s "
                                           "MASTER_PORT=%d within %g s (DS4_DIST_TIMEOUT): %s (is rank 0 running, "
                                           "with the same MASTER_ADDR and MASTER_PORT?)", t->rank, l->master_addr,
                        l->master_port, t->timeout_s, e ? strerror(e) : "the name did not resolve");
    t->fd[0] = fd;
    if (prepare(fd) < 0) return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: socket options: %s", strerror(errno));
    msg hello = {MAGIC, OP_HELLO, 0, (uint64_t)t->world, VERSION, (uint32_t)t->rank};
    ds4_status st = send_msg(t, fd, 0, &hello, deadline, err);
    msg welcome = {MAGIC, OP_WELCOME, 0, (uint64_t)t->world, VERSION, 0};
    if (!st) st = recv_msg(t, fd, 0, &welcome, deadline, err);
    if (st) append(err, " (rendezvous with rank 0 at %s:%d)", l->master_addr, l->master_port);
    return st;
}

/* Rank 0: read a new connection's hello. DS4_OK with *rank set: a ds4 rank; DS4_OK with *rank = -1: not a ds4 peer
 * (closed, not counted); an error: a ds4 rank of another job shape (the job cannot work). */
static ds4_status read_hello(dist_tcp *t, int fd, double deadline, int32_t *rank, ds4_error *err) {
    unsigned char h[HDR];
    ds4_error ignored = {0};
    *rank = -1;
    /* a silent connection may not hold up the others for long */
    double until = now_s() + 10.0;
    if (xfer(t, fd, 0, h, HDR, until < deadline ? until : deadline, -1, "rendezvous", &ignored)) return DS4_OK;
    if (get32(h) != MAGIC || get32(h + 4) != OP_HELLO) return DS4_OK;
    uint32_t version = get32(h + 24), r = get32(h + 28);
    uint64_t world = get64(h + 16);
    if (version != VERSION)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: a rank speaks protocol version %u, rank 0 version %d "
                                           "(different ds4 builds in one job)", version, VERSION);
    if (world != (uint64_t)t->world)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: rank %u says WORLD_SIZE=%llu, rank 0 WORLD_SIZE=%d",
                        r, (unsigned long long)world, t->world);
    if (r == 0 || r >= (uint32_t)t->world)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: a peer says it is rank %u (ranks 1..%d connect to rank 0)",
                        r, t->world - 1);
    if (t->fd[r] >= 0)
        return ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: two processes say they are rank %u (RANK must differ)", r);
    *rank = (int32_t)r;
    return DS4_OK;
}

static ds4_status accept_ranks(dist_tcp *t, const ds4_launch *l, double deadline, ds4_error *err) {
    int lfd = -1;
    ds4_status st = listen_on(l, &lfd, err);
    if (st) return st;
    int32_t joined = 1, strays = 0;
    while (!st && joined < t->world) {
        int w = wait_fd(lfd, POLLIN, deadline);
        if (w <= 0) {
            st = ds4_fail(err, DS4_ERR_COMM, "dist rendezvous: %d of %d ranks joined rank 0 on %s:%d within %g s "
                                             "(DS4_DIST_TIMEOUT)%s; missing:", joined, t->world, l->master_addr,
                          l->master_port, t->timeout_s, strays ? " (and non-ds4 connections were closed)" : "");
            for (int32_t r = 1; r < t->world && err; r++) {
                size_t n = strlen(err->msg);
                if (t->fd[r] < 0 && n + 12 < sizeof err->msg) snprintf(err->msg + n, sizeof err->msg - n, " %d", r);
            }
            break;
        }
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) continue; /* the peer went away between poll and accept */
        int32_t r = -1;
        if (prepare(fd) == 0) st = read_hello(t, fd, deadline, &r, err);
        if (r < 0) {
            close(fd);
            strays += !st;
            continue;
        }
        t->fd[r] = fd;
        joined++;
    }
    close(lfd);
    for (int32_t r = 1; r < t->world && !st; r++) {
        msg welcome = {MAGIC, OP_WELCOME, 0, (uint64_t)t->world, VERSION, 0};
        st = send_msg(t, t->fd[r], r, &welcome, deadline, err);
    }
    return st;
}

/* The local rank: LOCAL_RANK when the launcher set it, else the number of lower ranks on a machine of the same
 * name (what MPI's shared-memory split gives). */
static ds4_status local_rank_of(dist_tcp *t, const ds4_launch *l, int32_t *out, ds4_error *err) {
    *out = l->local_rank;
    if (l->local_rank >= 0) return DS4_OK;
    enum { NAME = 256 };
    char mine[NAME] = {0};
    if (gethostname(mine, NAME - 1) < 0) return ds4_fail(err, DS4_ERR_COMM, "dist init: gethostname: %s", strerror(errno));
    char *all = calloc((size_t)t->world, NAME);
    if (!all) return ds4_fail(err, DS4_ERR_OOM, "dist init: %d host names", t->world);
    ds4_status st = dist_tcp_all_gather(t, mine, all, NAME, err);
    int32_t lr = 0;
    for (int32_t r = 0; r < t->rank && !st; r++) lr += strncmp(all + (size_t)r * NAME, mine, NAME) == 0;
    free(all);
    *out = lr;
    return st;
}

ds4_status dist_tcp_open(const ds4_launch *l, double timeout_s, dist_tcp **out, int32_t *local_rank, ds4_error *err) {
    *out = NULL;
    if (!l->master_addr[0] || l->master_port <= 0)
        return ds4_fail(err, DS4_ERR_ARG, "dist init: a torchrun-style launch (RANK=%d WORLD_SIZE=%d) needs "
                                          "MASTER_ADDR and MASTER_PORT (rank 0's address and a free port)", l->rank,
                        l->world_size);
    dist_tcp *t = calloc(1, sizeof *t);
    int nfd = l->rank == 0 ? l->world_size : 1;
    if (t) t->fd = malloc((size_t)nfd * sizeof *t->fd);
    if (t && l->rank == 0) t->scratch = malloc(CHUNK);
    if (!t || !t->fd || (l->rank == 0 && !t->scratch)) {
        dist_tcp_close(t);
        return ds4_fail(err, DS4_ERR_OOM, "dist init: the TCP communicator of %d ranks", l->world_size);
    }
    for (int i = 0; i < nfd; i++) t->fd[i] = -1;
    t->rank = l->rank, t->world = l->world_size, t->timeout_s = timeout_s;
    const double deadline = now_s() + timeout_s;
    ds4_status st = l->rank == 0 ? accept_ranks(t, l, deadline, err) : connect_to_root(t, l, deadline, err);
    if (!st) st = local_rank_of(t, l, local_rank, err);
    t->seq = 0; /* the caller's collectives are numbered from 1 */
    if (st) {
        dist_tcp_close(t);
        return st;
    }
    *out = t;
    return DS4_OK;
}

void dist_tcp_shutdown(dist_tcp *t) {
    int nfd = t && t->fd ? (t->rank == 0 ? t->world : 1) : 0;
    for (int i = 0; i < nfd; i++)
        if (t->fd[i] >= 0) (void)shutdown(t->fd[i], SHUT_RDWR);
}

void dist_tcp_close(dist_tcp *t) {
    if (!t) return;
    int nfd = t->rank == 0 ? t->world : 1;
    for (int i = 0; t->fd && i < nfd; i++)
        if (t->fd[i] >= 0) close(t->fd[i]);
    free(t->fd);
    free(t->scratch);
    free(t);
}

/* ------------------------------------------------------------------------------------------------ collectives */

/* Start collective `op`: refuse a broken communicator; the header this rank sends and expects (its own rank as
 * sender: the caller sets the peer's). */
static ds4_status begin(dist_tcp *t, uint32_t op, uint64_t bytes, uint32_t extra, msg *m, double *deadline,
                        ds4_error *err) {
    if (t->broken)
        return ds4_fail(err, DS4_ERR_COMM, "dist %s: the TCP communicator failed earlier (%s); nothing more can be "
                                           "exchanged", op_name(op), t->why);
    *m = (msg){MAGIC, op, ++t->seq, bytes, extra, (uint32_t)t->rank};
    *deadline = now_s() + t->timeout_s;
    return DS4_OK;
}

static ds4_status end(dist_tcp *t, ds4_status st, ds4_error *err) {
    if (st && !t->broken) {
        t->broken = 1;
        snprintf(t->why, sizeof t->why, "%.290s", err ? err->msg : "an error");
    }
    return st;
}

/* Rank 0 reads rank r's header for the current collective (sent as `m`, with the peer's rank). */
static ds4_status hub_recv_hdr(dist_tcp *t, int32_t r, const msg *m, double deadline, ds4_error *err) {
    msg want = *m;
    want.rank = (uint32_t)r;
    return recv_msg(t, t->fd[r], r, &want, deadline, err);
}

ds4_status dist_tcp_barrier(dist_tcp *t, ds4_error *err) {
    msg m;
    double dl = 0;
    ds4_status st = begin(t, OP_BARRIER, 0, 0, &m, &dl, err);
    if (st) return st;
    if (t->rank == 0) {
        for (int32_t r = 1; r < t->world && !st; r++) st = hub_recv_hdr(t, r, &m, dl, err);
        for (int32_t r = 1; r < t->world && !st; r++) st = send_msg(t, t->fd[r], r, &m, dl, err);
    } else {
        st = send_msg(t, t->fd[0], 0, &m, dl, err);
        msg want = m;
        want.rank = 0;
        if (!st) st = recv_msg(t, t->fd[0], 0, &want, dl, err);
    }
    return end(t, st, err);
}

static void add_chunk(ds4_dtype dtype, void *acc, const void *x, size_t bytes) {
    if (dtype == DS4_F64) {
        double *a = acc;
        const double *b = x;
        for (size_t i = 0; i < bytes / 8; i++) a[i] += b[i];
    } else {
        float *a = acc;
        const float *b = x;
        for (size_t i = 0; i < bytes / 4; i++) a[i] += b[i];
    }
}

/* The bytes of [a, a + n) that fall in rank r's region (all of them without regions): *at, returns the count. */
static size_t part_of(const int64_t *off, const int64_t *len, int32_t r, size_t esz, size_t a, size_t n, size_t *at) {
    *at = a;
    if (!off) return n;
    const size_t lo = (size_t)off[r] * esz, hi = (size_t)(off[r] + len[r]) * esz;
    const size_t b = a > lo ? a : lo, e = a + n < hi ? a + n : hi;
    *at = b;
    return e > b ? e - b : 0;
}

/* Every rank sends its values to rank 0 chunk by chunk; rank 0 adds them in rank order and sends each rank the sums
 * of its region (off, len: every rank's, in elements; NULL: everything, the all-reduce). */
static ds4_status tcp_sum(dist_tcp *t, uint32_t op, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                          const int64_t *len, ds4_error *err) {
    const size_t esz = dtype == DS4_F64 ? 8 : 4, total = (size_t)count * esz;
    const char *name = op_name(op);
    msg m;
    double dl = 0;
    ds4_status st = begin(t, op, total, (uint32_t)dtype, &m, &dl, err);
    if (st) return st;
    char *b = buf;
    size_t at = 0, k = 0;
    if (t->rank == 0) {
        for (int32_t r = 1; r < t->world && !st; r++) st = hub_recv_hdr(t, r, &m, dl, err);
        for (int32_t r = 1; r < t->world && !st; r++) st = send_msg(t, t->fd[r], r, &m, dl, err);
        for (size_t o = 0; o < total && !st; o += CHUNK) {
            size_t n = total - o < CHUNK ? total - o : CHUNK;
            for (int32_t r = 1; r < t->world && !st; r++) { /* rank order: the sum's order is fixed */
                st = xfer(t, t->fd[r], 0, t->scratch, n, dl, r, name, err);
                if (!st) add_chunk(dtype, b + o, t->scratch, n);
            }
            for (int32_t r = 1; r < t->world && !st; r++)
                if ((k = part_of(off, len, r, esz, o, n, &at)) > 0) st = xfer(t, t->fd[r], 1, b + at, k, dl, r, name, err);
        }
    } else {
        msg want = m;
        want.rank = 0;
        st = send_msg(t, t->fd[0], 0, &m, dl, err);
        if (!st) st = recv_msg(t, t->fd[0], 0, &want, dl, err);
        for (size_t o = 0; o < total && !st; o += CHUNK) {
            size_t n = total - o < CHUNK ? total - o : CHUNK;
            st = xfer(t, t->fd[0], 1, b + o, n, dl, 0, name, err);
            if (!st && (k = part_of(off, len, t->rank, esz, o, n, &at)) > 0)
                st = xfer(t, t->fd[0], 0, b + at, k, dl, 0, name, err);
        }
    }
    if (st) append(err, " (%s, %lld elements; rank %d of %d)", ds4_dtype_name(dtype), (long long)count, t->rank, t->world);
    return end(t, st, err);
}

ds4_status dist_tcp_all_reduce_sum(dist_tcp *t, ds4_dtype dtype, void *buf, int64_t count, ds4_error *err) {
    return tcp_sum(t, OP_ALL_REDUCE, dtype, buf, count, NULL, NULL, err);
}

ds4_status dist_tcp_reduce_scatter_sum(dist_tcp *t, ds4_dtype dtype, void *buf, int64_t count, const int64_t *off,
                                       const int64_t *len, ds4_error *err) {
    return tcp_sum(t, OP_REDUCE_SCATTER, dtype, buf, count, off, len, err);
}

ds4_status dist_tcp_all_gather(dist_tcp *t, const void *send, void *recv, size_t nbytes, ds4_error *err) {
    msg m;
    double dl = 0;
    ds4_status st = begin(t, OP_ALL_GATHER, nbytes, 0, &m, &dl, err);
    if (st) return st;
    char *out = recv;
    const size_t all = nbytes * (size_t)t->world;
    if (t->rank == 0) {
        memmove(out, send, nbytes);
        for (int32_t r = 1; r < t->world && !st; r++) {
            st = hub_recv_hdr(t, r, &m, dl, err);
            if (!st) st = xfer(t, t->fd[r], 0, out + (size_t)r * nbytes, nbytes, dl, r, "all_gather", err);
        }
        for (int32_t r = 1; r < t->world && !st; r++) {
            st = send_msg(t, t->fd[r], r, &m, dl, err);
            if (!st) st = xfer(t, t->fd[r], 1, out, all, dl, r, "all_gather", err);
        }
    } else {
        msg want = m;
        want.rank = 0;
        st = send_msg(t, t->fd[0], 0, &m, dl, err);
        if (!st) st = xfer(t, t->fd[0], 1, (void *)(uintptr_t)send, nbytes, dl, 0, "all_gather", err);
        if (!st) st = recv_msg(t, t->fd[0], 0, &want, dl, err);
        if (!st) st = xfer(t, t->fd[0], 0, out, all, dl, 0, "all_gather", err);
    }
    if (st) append(err, " (%zu bytes per rank; rank %d of %d)", nbytes, t->rank, t->world);
    return end(t, st, err);
}

ds4_status dist_tcp_broadcast(dist_tcp *t, void *buf, size_t nbytes, int32_t root, ds4_error *err) {
    msg m;
    double dl = 0;
    ds4_status st = begin(t, OP_BROADCAST, nbytes, (uint32_t)root, &m, &dl, err);
    if (st) return st;
    if (t->rank == 0) {
        if (root != 0) { /* the root's bytes come to rank 0 first */
            st = hub_recv_hdr(t, root, &m, dl, err);
            if (!st) st = xfer(t, t->fd[root], 0, buf, nbytes, dl, root, "broadcast", err);
        }
        for (int32_t r = 1; r < t->world && !st; r++) {
            if (r == root) continue;
            st = send_msg(t, t->fd[r], r, &m, dl, err);
            if (!st) st = xfer(t, t->fd[r], 1, buf, nbytes, dl, r, "broadcast", err);
        }
    } else if (t->rank == root) {
        st = send_msg(t, t->fd[0], 0, &m, dl, err);
        if (!st) st = xfer(t, t->fd[0], 1, buf, nbytes, dl, 0, "broadcast", err);
    } else {
        msg want = m;
        want.rank = 0;
        st = recv_msg(t, t->fd[0], 0, &want, dl, err);
        if (!st) st = xfer(t, t->fd[0], 0, buf, nbytes, dl, 0, "broadcast", err);
    }
    if (st) append(err, " (%zu bytes from rank %d; rank %d of %d)", nbytes, root, t->rank, t->world);
    return end(t, st, err);
}

/* ------------------------------------------------------------------------------------------------ all_to_all_v */

/* The rows of an all_to_all_v go through rank 0 as well. Every rank sends a header, its row counts (send_rows[P] then
 * recv_rows[P], 64-bit little-endian) and its rows; rank 0 reads every rank's counts first and checks that they
 * agree (rank s's send_rows[q] is rank q's recv_rows[s]) before it sizes anything by them, then reads the rows in
 * rank order and sends each rank its blocks, sources in rank order. Data movement only: the bytes arrive unchanged,
 * so the result is deterministic. Rank 0 holds every rank's rows at once (fine for the CPU ranks this serves). */

static ds4_status a2a_counts_check(const dist_tcp *t, const int64_t *cnt, size_t row_bytes, ds4_error *err) {
    const int32_t P = t->world;
    for (int32_t s = 0; s < P; s++) {
        int64_t sum = 0;
        for (int32_t q = 0; q < P; q++) {
            const int64_t out = cnt[(size_t)s * 2 * P + q], in = cnt[(size_t)q * 2 * P + P + s];
            if (out < 0 || out > (int64_t)(SIZE_MAX / 4 / row_bytes) / P - sum)
                return ds4_fail(err, DS4_ERR_COMM, "dist all_to_all_v: rank %d sends %lld rows of %zu bytes to rank "
                                                   "%d (not a valid count)", s, (long long)out, row_bytes, q);
            if (out != in)
                return ds4_fail(err, DS4_ERR_COMM, "dist all_to_all_v: rank %d sends %lld rows to rank %d, which "
                                                   "expects %lld from it: the ranks disagree on the counts", s,
                                (long long)out, q, (long long)in);
            sum += out;
        }
    }
    return DS4_OK;
}

/* Rank 0: every rank's counts and rows in, every rank's blocks out. cnt [P, 2P]; mine: rank 0's own. */
static ds4_status a2a_hub(dist_tcp *t, const msg *m, double dl, const char *send, char *recv, int64_t *cnt,
                          size_t rb, ds4_error *err) {
    const int32_t P = t->world;
    unsigned char *raw = (unsigned char *)t->scratch;
    ds4_status st = DS4_OK;
    for (int32_t r = 1; r < P && !st; r++) {
        st = hub_recv_hdr(t, r, m, dl, err);
        if (!st) st = xfer(t, t->fd[r], 0, raw, (size_t)P * 16, dl, r, "all_to_all_v", err);
        for (int32_t i = 0; i < 2 * P && !st; i++) cnt[(size_t)r * 2 * P + i] = (int64_t)get64(raw + 8 * i);
    }
    if (!st) st = a2a_counts_check(t, cnt, rb, err);
    char **rows = st ? NULL : calloc((size_t)P, sizeof *rows); /* rows[s]: rank s's rows (rows[0]: send) */
    if (!st && !rows) st = ds4_fail(err, DS4_ERR_OOM, "dist all_to_all_v: %d row buffers", P);
    for (int32_t s = 1; s < P && !st; s++) {
        size_t n = 0;
        for (int32_t q = 0; q < P; q++) n += (size_t)cnt[(size_t)s * 2 * P + q] * rb;
        rows[s] = malloc(n ? n : 1);
        if (!rows[s]) st = ds4_fail(err, DS4_ERR_OOM, "dist all_to_all_v: %zu bytes from rank %d", n, s);
        else st = xfer(t, t->fd[s], 0, rows[s], n, dl, s, "all_to_all_v", err);
    }
    if (rows) rows[0] = (char *)(uintptr_t)send;
    for (int32_t q = 0; q < P && !st; q++) {
        size_t total = 0;
        for (int32_t s = 0; s < P; s++) total += (size_t)cnt[(size_t)s * 2 * P + q] * rb;
        msg out = *m;
        out.bytes = total;
        if (q > 0) st = send_msg(t, t->fd[q], q, &out, dl, err);
        char *dst = recv;
        for (int32_t s = 0; s < P && !st; s++) {
            size_t at = 0; /* block q of rank s's rows */
            for (int32_t qq = 0; qq < q; qq++) at += (size_t)cnt[(size_t)s * 2 * P + qq] * rb;
            const size_t n = (size_t)cnt[(size_t)s * 2 * P + q] * rb;
            if (q == 0) {
                if (n) memmove(dst, rows[s] + at, n);
                dst += n;
            } else {
                st = xfer(t, t->fd[q], 1, rows[s] + at, n, dl, q, "all_to_all_v", err);
            }
        }
    }
    for (int32_t s = 1; rows && s < P; s++) free(rows[s]);
    free(rows);
    return st;
}

ds4_status dist_tcp_all_to_all_v(dist_tcp *t, const void *send, const int64_t *send_rows, void *recv,
                                 const int64_t *recv_rows, size_t row_bytes, ds4_error *err) {
    const int32_t P = t->world;
    if (row_bytes == 0 || row_bytes > UINT32_MAX || (size_t)P * 16 > CHUNK)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "dist all_to_all_v: rows of %zu bytes among %d ranks", row_bytes, P);
    int64_t *cnt = calloc((size_t)P * 2 * P, sizeof *cnt); /* [P, 2P] counts; rank 0 fills every rank's */
    if (!cnt) return ds4_fail(err, DS4_ERR_OOM, "dist all_to_all_v: counts of %d ranks", P);
    size_t out = 0, in = 0;
    for (int32_t q = 0; q < P; q++) {
        cnt[q] = send_rows[q], cnt[P + q] = recv_rows[q];
        out += (size_t)send_rows[q] * row_bytes, in += (size_t)recv_rows[q] * row_bytes;
    }
    msg m;
    double dl = 0;
    ds4_status st = begin(t, OP_ALL_TO_ALL, (uint64_t)P * 16, (uint32_t)row_bytes, &m, &dl, err);
    if (st) {
        free(cnt);
        return st;
    }
    if (t->rank == 0) {
        st = a2a_hub(t, &m, dl, send, recv, cnt, row_bytes, err);
    } else {
        unsigned char *raw = malloc((size_t)P * 16);
        if (!raw) st = ds4_fail(err, DS4_ERR_OOM, "dist all_to_all_v: counts of %d ranks", P);
        for (int32_t i = 0; i < 2 * P && !st; i++) put64(raw + 8 * i, (uint64_t)cnt[i]);
        if (!st) st = send_msg(t, t->fd[0], 0, &m, dl, err);
        if (!st) st = xfer(t, t->fd[0], 1, raw, (size_t)P * 16, dl, 0, "all_to_all_v", err);
        if (!st) st = xfer(t, t->fd[0], 1, (void *)(uintptr_t)send, out, dl, 0, "all_to_all_v", err);
        msg want = m;
        want.rank = 0, want.bytes = in; /* what this rank's recv_rows say: checked before a byte is read */
        if (!st) st = recv_msg(t, t->fd[0], 0, &want, dl, err);
        if (!st) st = xfer(t, t->fd[0], 0, recv, in, dl, 0, "all_to_all_v", err);
        free(raw);
    }
    free(cnt);
    if (st) append(err, " (%zu bytes out, %zu in, rows of %zu bytes; rank %d of %d)", out, in, row_bytes, t->rank, P);
    return end(t, st, err);
}
