/* bench_collectives.c — the bandwidth of ds4's communicator (dist/ds4_dist.h): all-reduce and all-to-all over a range
 * of message sizes, in nccl-tests' columns, so that bench/nccl_torch_bw.py (NCCL through torch.distributed, the same
 * sizes) can stand beside it. One process per rank, launched as the other distributed programs are (torchrun-style
 * variables, mpirun; docs/distributed.md, "Launching"); bench/collectives_bench.sh launches both and compares.
 *
 *   bench_collectives [--device cuda|cpu] [--sizes 1M,4M,...] [--iters 20] [--warmup 5]
 *
 * --device cuda: buffers on each rank's GPU, NCCL (ds4_comm_device_all_reduce_sum, ds4_comm_device_all_to_all_v);
 * default sizes 1 MiB ... 1 GiB, times 4. --device cpu: host buffers, the host collectives (the TCP star or MPI:
 * ds4_comm_all_reduce_sum, ds4_comm_all_to_all_v); default sizes 64 KiB ... 64 MiB, times 4. Sizes take K, M, G
 * (binary) suffixes.
 *
 *   all_reduce: `size` bytes of fp32, summed in place. all_to_all: `size` bytes sent by every rank, size / n to each
 *   rank (rows of 8 bytes; size rounded down to a multiple of 8n), as equal rows to every rank.
 *
 * The bandwidths are nccl-tests' (its doc/PERFORMANCE.md): algbw = bytes / time; busbw = algbw · 2(n − 1)/n for
 * all-reduce (a ring moves each byte 2(n − 1)/n times through the slowest link) and algbw · (n − 1)/n for all-to-all
 * (the share of the buffer that leaves the rank), so busbw compares with the link's bandwidth whatever n is. GB is
 * 10^9 bytes, as there.
 *
 * Before any timing each size's result is checked once against a closed form, on every rank: all_reduce of
 * (r + 1)·(i mod 1000 + 1) is (i mod 1000 + 1)·n(n + 1)/2 (integers below 2^24: exact in any summation order);
 * all_to_all rows carry (source rank, destination rank, index) tags and must arrive in rank order. The buffers are
 * poisoned first (NaN, 0xff bytes). A wrong value anywhere makes every rank exit 1 (the ranks agree on it first, so
 * none is left waiting): bandwidth of wrong results is not reported.
 *
 * Rank 0 prints the tables and, for scripts, one line per measurement:
 *   coll OP SIZE BYTES TIME_US ALGBW BUSBW     (OP all_reduce or all_to_all; SIZE as asked, BYTES as moved)
 * and "coll ranks N", "coll device cuda|cpu", "coll backend tcp|mpi|single". Exit 77: --device cuda in a build
 * without NCCL or on a machine without a GPU. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ds4.h"
#include "ds4_dist.h"
#ifdef DS4_HAVE_CUDA
#include "cuda_backend.h"
#endif

#define MAX_SIZES 32
#define ROW_BYTES 8 /* one all-to-all row: a uint64 tag */

typedef struct bench {
    ds4_comm *c;
    struct ds4_cuda *cu; /* --device cuda: buffers in its device's memory; NULL: host memory */
    int32_t rank, world;
    int64_t iters, warmup;
} bench;

/* A ds4 call that failed: this rank cannot go on. Its peers then fail too (the TCP star sees the closed sockets;
 * NCCL's watchdog at DS4_DIST_TIMEOUT). */
static void must(ds4_status st, const bench *b, const char *what, const ds4_error *err) {
    if (st) DIE("bench_collectives: rank %d: %s: %s", b->rank, what, err->msg);
}

/* ---------------------------------------------------------------------------------------------- buffers */

static void *buf_alloc(bench *b, size_t bytes) {
    void *p = NULL;
    ds4_error err = {0};
#ifdef DS4_HAVE_CUDA
    if (b->cu) {
        must(ds4_cuda_alloc(b->cu, bytes, &p, &err), b, "cuda alloc", &err);
        return p;
    }
#endif
    (void)err;
    if (!(p = malloc(bytes))) DIE("bench_collectives: rank %d: out of memory (%zu bytes)", b->rank, bytes);
    return p;
}

static void buf_free(bench *b, void *p) {
#ifdef DS4_HAVE_CUDA
    if (b->cu) {
        ds4_cuda_free(b->cu, p);
        return;
    }
#endif
    free(p);
}

/* host -> buffer (to_buf = 1) or buffer -> host */
static void buf_copy(bench *b, void *dst, const void *src, size_t bytes, int to_buf) {
    ds4_error err = {0};
#ifdef DS4_HAVE_CUDA
    if (b->cu) {
        must(to_buf ? ds4_cuda_upload(b->cu, dst, src, bytes, &err) : ds4_cuda_download(b->cu, dst, src, bytes, &err),
             b, to_buf ? "upload" : "download", &err);
        return;
    }
#endif
    (void)err, (void)to_buf;
    memcpy(dst, src, bytes);
}

static void buf_set(bench *b, void *dst, int byte, size_t bytes) {
    ds4_error err = {0};
#ifdef DS4_HAVE_CUDA
    if (b->cu) {
        must(ds4_cuda_memset(b->cu, dst, byte, bytes, &err), b, "memset", &err);
        must(ds4_cuda_synchronize(b->cu, &err), b, "memset", &err);
        return;
    }
#endif
    (void)err;
    memset(dst, byte, bytes);
}

/* ---------------------------------------------------------------------------------------------- collectives */

static void all_reduce(bench *b, float *buf, int64_t count) {
    ds4_error err = {0};
    const ds4_status st = b->cu ? ds4_comm_device_all_reduce_sum(b->c, DS4_F32, buf, count, &err)
                                : ds4_comm_all_reduce_sum(b->c, DS4_F32, buf, count, &err);
    must(st, b, "all_reduce", &err);
}

/* rows rows of ROW_BYTES to every rank, rows from every rank */
static void all_to_all(bench *b, const void *send, void *recv, const int64_t *rows) {
    ds4_error err = {0};
    const ds4_status st = b->cu ? ds4_comm_device_all_to_all_v(b->c, send, rows, recv, rows, ROW_BYTES, &err)
                                : ds4_comm_all_to_all_v(b->c, send, rows, recv, rows, ROW_BYTES, &err);
    must(st, b, "all_to_all", &err);
}

/* The ranks agree: every rank's count of wrong values summed; nonzero anywhere ends every rank with exit 1. */
static void agree_correct(bench *b, const char *op, int64_t bytes, int64_t bad, int64_t total, const char *first) {
    ds4_error err = {0};
    double sum = (double)bad;
    must(ds4_comm_all_reduce_sum(b->c, DS4_F64, &sum, 1, &err), b, "agreeing on the check", &err);
    if (bad) fprintf(stderr, "bench_collectives: rank %d: %s of %lld bytes: %lld of %lld values wrong (%s)\n", b->rank,
                     op, (long long)bytes, (long long)bad, (long long)total, first);
    if (sum > 0) {
        if (b->rank == 0) fprintf(stderr, "bench_collectives: FAIL: %s of %lld bytes gave wrong values on some rank: "
                                          "no bandwidth reported\n", op, (long long)bytes);
        (void)ds4_comm_finalize(b->c, &err);
        exit(1);
    }
}

static void check_all_reduce(bench *b, float *h, float *d, int64_t count) {
    const int32_t r = b->rank, n = b->world;
    for (int64_t i = 0; i < count; i++) h[i] = (float)((r + 1) * (i % 1000 + 1));
    buf_copy(b, d, h, (size_t)count * sizeof *h, 1);
    for (int64_t i = 0; i < count; i++) h[i] = NAN; /* the copy back must overwrite every element */
    all_reduce(b, d, count);
    buf_copy(b, h, d, (size_t)count * sizeof *h, 0);
    int64_t bad = 0, at = -1;
    for (int64_t i = 0; i < count; i++) {
        const int ok = h[i] == (float)((i % 1000 + 1) * n * (n + 1) / 2); /* NaN fails */
        if (!ok && at < 0) at = i;
        bad += !ok;
    }
    char first[128] = "";
    if (at >= 0)
        snprintf(first, sizeof first, "first at %lld: %g, want %g", (long long)at, (double)h[at],
                 (double)((at % 1000 + 1) * n * (n + 1) / 2));
    agree_correct(b, "all_reduce", count * (int64_t)sizeof *h, bad, count, first);
}

/* rank s's j-th row for rank d */
static uint64_t tag(int32_t s, int32_t d, int64_t j) { return (uint64_t)s << 48 | (uint64_t)d << 32 | (uint64_t)j; }

static void check_all_to_all(bench *b, uint64_t *h, void *send, void *recv, const int64_t *rows) {
    const int32_t r = b->rank, n = b->world;
    const int64_t m = rows[0], total = m * n;
    for (int32_t d = 0; d < n; d++)
        for (int64_t j = 0; j < m; j++) h[d * m + j] = tag(r, d, j);
    buf_copy(b, send, h, (size_t)total * ROW_BYTES, 1);
    buf_set(b, recv, 0xff, (size_t)total * ROW_BYTES); /* no tag is all ones: ranks < 2^16 */
    memset(h, 0xff, (size_t)total * ROW_BYTES);
    all_to_all(b, send, recv, rows);
    buf_copy(b, h, recv, (size_t)total * ROW_BYTES, 0);
    int64_t bad = 0, at = -1;
    for (int32_t s = 0; s < n; s++)
        for (int64_t j = 0; j < m; j++) {
            const int ok = h[s * m + j] == tag(s, r, j);
            if (!ok && at < 0) at = s * m + j;
            bad += !ok;
        }
    char first[160] = "";
    if (at >= 0)
        snprintf(first, sizeof first, "first at row %lld: tag %#llx, want (src %lld, dst %d, row %lld)", (long long)at,
                 (unsigned long long)h[at], (long long)(at / m), r, (long long)(at % m));
    agree_correct(b, "all_to_all", total * ROW_BYTES, bad, total, first);
}

/* ---------------------------------------------------------------------------------------------- timing */

/* Seconds per call: warm-up calls, a barrier, then a wall clock around `iters` calls, the slowest rank's.
 *
 * Why a wall clock, not CUDA events: ds4's device collectives return only once the collective has completed on the
 * device (the host polls NCCL's stream, with the watchdog: dist/nccl_backend.c), so every call is synchronous and the
 * clock measures what a ds4 caller waits, polling included; events would time the kernels alone. nccl-tests (and
 * bench/nccl_torch_bw.py) also use a host clock, around N calls enqueued back to back and one synchronisation; the
 * difference is that NCCL's back-to-back calls overlap their launch latencies and ds4's do not, which shows at small
 * sizes only. The host collectives are synchronous too. */
static double time_op(bench *b, int op, void *x, void *y, int64_t count, const int64_t *rows) {
    ds4_error err = {0};
    double t0 = 0;
    for (int64_t k = 0; k < b->warmup + b->iters; k++) {
        if (k == b->warmup) { /* the ranks start the timed calls together */
            must(ds4_comm_barrier(b->c, &err), b, "barrier", &err);
            t0 = now_s();
        }
        if (op) all_to_all(b, x, y, rows);
        else all_reduce(b, x, count);
    }
    const double mine = (now_s() - t0) / (double)b->iters;
    double *all = malloc((size_t)b->world * sizeof *all), worst = 0;
    if (!all) DIE("bench_collectives: out of memory");
    must(ds4_comm_all_gather(b->c, &mine, all, sizeof mine, &err), b, "gathering the times", &err);
    for (int32_t q = 0; q < b->world; q++) worst = fmax(worst, all[q]);
    free(all);
    return worst;
}

/* nccl-tests' bus-bandwidth factors (the file's comment) */
static double bus_factor(int op, int32_t n) { return op ? (double)(n - 1) / n : 2.0 * (n - 1) / n; }

typedef struct result {
    int op; /* 0 all_reduce, 1 all_to_all */
    int64_t size, bytes;
    double t; /* seconds per call */
} result;

static const char *op_name(int op) { return op ? "all_to_all" : "all_reduce"; }

/* a row of rank 0's table */
static void report(const bench *b, const result *x) {
    if (b->rank) return;
    const double algbw = (double)x->bytes / x->t / 1e9;
    printf("%14lld %14lld %12.2f %12.2f %12.2f  %s\n", (long long)x->size, (long long)x->bytes, x->t * 1e6, algbw,
           algbw * bus_factor(x->op, b->world), op_name(x->op));
    fflush(stdout);
}

/* the lines for scripts, after the table */
static void report_lines(const bench *b, const result *xs, int n) {
    if (b->rank) return;
    for (int k = 0; k < n; k++) {
        const double algbw = (double)xs[k].bytes / xs[k].t / 1e9;
        printf("coll %s %lld %lld %.2f %.3f %.3f\n", op_name(xs[k].op), (long long)xs[k].size,
               (long long)xs[k].bytes, xs[k].t * 1e6, algbw, algbw * bus_factor(xs[k].op, b->world));
    }
}

/* ---------------------------------------------------------------------------------------------- options */

/* "64K" -> 65536; 0 on a malformed size */
static int64_t parse_size(const char *s, const char **end) {
    char *e = NULL;
    const long long v = strtoll(s, &e, 10);
    if (e == s || v <= 0) return 0;
    int64_t mul = 1;
    switch (toupper((unsigned char)*e)) {
    case 'K': mul = 1LL << 10, e++; break;
    case 'M': mul = 1LL << 20, e++; break;
    case 'G': mul = 1LL << 30, e++; break;
    default: break;
    }
    *end = e;
    return v > INT64_MAX / mul ? 0 : v * mul;
}

static int parse_sizes(const char *s, int64_t *out) {
    int k = 0;
    while (*s) {
        const char *e = s;
        if (k == MAX_SIZES || !(out[k++] = parse_size(s, &e)) || (*e && *e != ',')) return 0;
        s = *e ? e + 1 : e;
    }
    return k;
}

int main(int argc, char **argv) {
    const char *device = "cuda", *sizes_arg = NULL;
    bench b = {.iters = 20, .warmup = 5};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
        else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) sizes_arg = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) b.iters = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) b.warmup = atoll(argv[++i]);
        else DIE("usage: %s [--device cuda|cpu] [--sizes 1M,4M,...] [--iters N] [--warmup N]", argv[0]);
    }
    const int cuda = !strcmp(device, "cuda");
    if (!cuda && strcmp(device, "cpu")) DIE("bench_collectives: --device cuda or cpu, not %s", device);
    if (b.iters < 1 || b.warmup < 0) DIE("bench_collectives: --iters >= 1, --warmup >= 0");
    int64_t sizes[MAX_SIZES];
    const int ns = parse_sizes(sizes_arg ? sizes_arg : cuda ? "1M,4M,16M,64M,256M,1G" : "64K,256K,1M,4M,16M,64M", sizes);
    if (!ns) DIE("bench_collectives: --sizes wants up to %d sizes like 1M,4M,1G, got %s", MAX_SIZES, sizes_arg);
    int64_t max_size = 0;
    for (int k = 0; k < ns; k++) max_size = sizes[k] > max_size ? sizes[k] : max_size;

    ds4_error err = {0};
    int32_t ndev = 0;
    if (cuda && !ds4_dist_have_nccl()) {
        printf("bench_collectives: SKIP: --device cuda, and this build has no NCCL\n");
        return 77;
    }
    if (cuda && (ds4_cuda_devices(&ndev, &err) || ndev == 0)) {
        printf("bench_collectives: SKIP: --device cuda, and there is no CUDA device\n");
        return 77;
    }
    ds4_comm_options o;
    ds4_comm_options_default(&o);
    o.nccl = cuda;
    if (ds4_comm_init_with(&o, &b.c, &err)) DIE("bench_collectives: %s", err.msg);
    b.rank = ds4_comm_rank(b.c), b.world = ds4_comm_world_size(b.c);
#ifdef DS4_HAVE_CUDA
    if (cuda) must(ds4_cuda_open(ds4_comm_device(b.c), &b.cu, &err), &b, "cuda open", &err);
#endif
    /* the all-reduce runs in place in x; the all-to-all sends x into y */
    void *x = buf_alloc(&b, (size_t)max_size), *y = buf_alloc(&b, (size_t)max_size);
    void *h = malloc((size_t)max_size); /* host staging: fills and checks */
    if (!h) DIE("bench_collectives: out of memory (%lld bytes)", (long long)max_size);
    int64_t *rows = malloc((size_t)b.world * sizeof *rows);
    if (!rows) DIE("bench_collectives: out of memory");
    if (b.rank == 0) {
        printf("coll ranks %d\ncoll device %s\ncoll backend %s\n", b.world, device, ds4_comm_backend(b.c));
        printf("# bench_collectives: %d ranks, host collectives %s%s, %lld iterations after %lld warm-up; time: the "
               "slowest rank's, per call; busbw: nccl-tests'\n", b.world, ds4_comm_backend(b.c),
               cuda ? ", buffers on the GPUs through NCCL" : ", host buffers", (long long)b.iters,
               (long long)b.warmup);
        printf("# %12s %14s %12s %12s %12s\n", "size(B)", "moved(B)", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    result res[2 * MAX_SIZES];
    int nres = 0;
    for (int k = 0; k < ns; k++) {
        const int64_t count = sizes[k] / (int64_t)sizeof(float); /* [count] fp32 */
        if (count > 0) {
            check_all_reduce(&b, h, x, count);
            buf_set(&b, x, 0, (size_t)count * sizeof(float)); /* zeros stay zeros: no overflow over the iterations */
            res[nres] = (result){0, sizes[k], count * (int64_t)sizeof(float), time_op(&b, 0, x, NULL, count, NULL)};
            report(&b, &res[nres++]);
        }
        const int64_t m = sizes[k] / (ROW_BYTES * b.world); /* rows to each rank: [world, m] rows of ROW_BYTES */
        if (m > 0) {
            for (int32_t q = 0; q < b.world; q++) rows[q] = m;
            check_all_to_all(&b, h, x, y, rows);
            res[nres] = (result){1, sizes[k], m * b.world * ROW_BYTES, time_op(&b, 1, x, y, 0, rows)};
            report(&b, &res[nres++]);
        }
    }
    report_lines(&b, res, nres);
    buf_free(&b, x);
    buf_free(&b, y);
    free(h);
    free(rows);
#ifdef DS4_HAVE_CUDA
    ds4_cuda_close(b.cu);
#endif
    must(ds4_comm_barrier(b.c, &err), &b, "barrier", &err);
    must(ds4_comm_finalize(b.c, &err), &b, "finalize", &err);
    return 0;
}
