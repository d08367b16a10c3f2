/* cpu_dev.c — the CPU backend: host memory, the parallel-range helper, private scratch, and its operation table. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "internal.h"

/* ------------------------------------------------------------------------------------------------ ranges */

typedef struct {
    const ds4_cpu *cpu;
    const void *args;
    ds4_cpu_range_fn fn;
    int64_t n, ntask;
} range_job;

static void range_task(void *p, int64_t i) {
    const range_job *j = p;
    const int64_t b = j->n * i / j->ntask, e = j->n * (i + 1) / j->ntask;
    if (b < e) j->fn(j->cpu, j->args, b, e, i);
}

void ds4_cpu_parallel(const ds4_cpu *cpu, int64_t n, ds4_cpu_range_fn fn, const void *args) {
    ds4_cpu_parallel_grain(cpu, n, 1, fn, args);
}

void ds4_cpu_parallel_grain(const ds4_cpu *cpu, int64_t n, int64_t grain, ds4_cpu_range_fn fn, const void *args) {
    int64_t nt = grain > 1 ? n / grain : n;
    if (nt > cpu->ntask) nt = cpu->ntask;
    if (nt < 1) nt = n > 0 ? 1 : 0;
    if (nt <= 0) return;
    range_job j = {cpu, args, fn, n, nt};
    ds4_pool_run(cpu->pool, nt, range_task, &j);
}

/* ------------------------------------------------------------------------------------------------ memory */

static ds4_status cpu_alloc(ds4_dev *d, size_t bytes, void **out, ds4_error *err) {
    (void)d;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64))
        return ds4_fail(err, DS4_ERR_OOM, "cpu backend: allocation of %zu bytes", bytes);
    *out = p;
    return DS4_OK;
}

static void cpu_free(ds4_dev *d, void *p) {
    (void)d;
    free(p);
}

/* Copies and fills of at least this many bytes run on the pool in pieces (a training forward keeps its activations
 * with copies, zero_grad fills the gradients): on one thread they were the serial part of a step. */
enum { PAR_BYTES = 1 << 20, PIECE_BYTES = 1 << 18 };

typedef struct {
    char *dst;
    const char *src; /* NULL: fill with byte */
    int byte;
    size_t bytes;
    int64_t pieces;
} mem_job;

static void mem_piece(void *p, int64_t i) {
    const mem_job *j = p;
    const size_t b = j->bytes * (size_t)i / (size_t)j->pieces, e = j->bytes * (size_t)(i + 1) / (size_t)j->pieces;
    if (j->src) memcpy(j->dst + b, j->src + b, e - b);
    else memset(j->dst + b, j->byte, e - b);
}

/* Pieces for a parallel copy or fill of `bytes`, 0 when it should run on the calling thread. */
static int64_t mem_pieces(const ds4_cpu *cpu, size_t bytes) {
    if (bytes < PAR_BYTES || ds4_pool_threads(cpu->pool) < 2) return 0;
    const int64_t p = (int64_t)(bytes / PIECE_BYTES);
    return p < cpu->ntask ? p : cpu->ntask;
}

static void cpu_copy(ds4_dev *d, void *dst, const void *src, size_t bytes) {
    if (dst == src) return;
    const char *a = dst, *b = src;
    const int64_t pieces = mem_pieces(ds4_cpu_of(d), bytes);
    if (pieces == 0 || (a < b + bytes && b < a + bytes)) { /* overlapping: one memmove */
        memmove(dst, src, bytes);
        return;
    }
    mem_job j = {dst, src, 0, bytes, pieces};
    ds4_pool_run(ds4_cpu_of(d)->pool, pieces, mem_piece, &j);
}

static ds4_status cpu_upload(ds4_dev *d, void *dst, const void *src, size_t bytes, ds4_error *err) {
    (void)err;
    cpu_copy(d, dst, src, bytes);
    return DS4_OK;
}

static void cpu_fill(ds4_dev *d, void *dst, int byte, size_t bytes) {
    const int64_t pieces = mem_pieces(ds4_cpu_of(d), bytes);
    if (pieces == 0) {
        memset(dst, byte, bytes);
        return;
    }
    mem_job j = {dst, NULL, byte, bytes, pieces};
    ds4_pool_run(ds4_cpu_of(d)->pool, pieces, mem_piece, &j);
}

static ds4_status cpu_sync(ds4_dev *d, ds4_error *err) {
    (void)d, (void)err;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ scratch */

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }

/* Per-range scratch of a forward pass, the largest of: mHC / HyperHead normalised streams (DS4_HC_TB tokens of
 * n·D), compressor slots (2m gates, 2m values, 4m row pointers of 2 floats each: 12m), indexer scores (<= S entries),
 * attention logits of every head (H × (window + <= S entries)) followed by as many key pointers (2 floats each); in
 * training also a vocabulary row of doubles (the log-probability backward). The backward adds its Sinkhorn states and
 * RMS factors. (The matrix products' per-thread scratch does not depend on the pass: it is made with the backend.) */
static ds4_status cpu_reserve(ds4_dev *d, const ds4_config *c, int64_t T, int64_t S, int training, ds4_error *err) {
    ds4_cpu *cpu = ds4_cpu_of(d);
    const size_t n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t H = (size_t)c->num_attention_heads, nD = n * D, Tz = (size_t)T;
    const int64_t mmax = c->compress_rate_csa > c->compress_rate_hca ? c->compress_rate_csa : c->compress_rate_hca;
    const int64_t nkeys = (c->sliding_window < S ? c->sliding_window : S) + S;
    const int64_t key_off = ((int64_t)H * nkeys + 1) & ~(int64_t)1; /* logits of every head; pointers 8-byte aligned */
    int64_t stride = key_off + 2 * nkeys;
    if (DS4_HC_TB * (int64_t)nD > stride) stride = DS4_HC_TB * (int64_t)nD;
    if (12 * mmax > stride) stride = 12 * mmax;
    if (training && 2 * (int64_t)V > stride) stride = 2 * (int64_t)V; /* logp_bwd: a row of exps in double */
    stride = (stride + 15) & ~(int64_t)15;
    /* the mHC backward's Sinkhorn tapes: DS4_HC_SB tokens' (2·iters + 1)·n·n states side by side, a multiple of 8
     * doubles so that each task's stays 64-byte aligned (the lanes are 32-byte vectors) */
    const size_t sk_stride = training ? (DS4_HC_SB * (2 * (size_t)c->hc_sinkhorn_iters + 1) * n * n + 7) / 8 * 8 : 0;
    const size_t ntask = (size_t)cpu->ntask;
    ds4_arena a = {0};
    for (int pass = 0; pass < 2; pass++) {
        a.used = 0;
        float *scratch = ds4_arena_take(&a, ntask * (size_t)stride, 4);
        double *sk = training ? ds4_arena_take(&a, ntask * sk_stride, 8) : NULL;
        float *rinv = training ? ds4_arena_take(&a, Tz * zmax(n, H), 4) : NULL;
        if (pass == 0) {
            if (a.used <= cpu->bytes) {
                a.base = cpu->mem;
                continue;
            }
            void *mem = NULL;
            if (posix_memalign(&mem, 64, a.used))
                return ds4_fail(err, DS4_ERR_OOM, "cpu backend: scratch of %zu bytes for %lld rows at positions < %lld",
                                a.used, (long long)T, (long long)S);
            free(cpu->mem);
            cpu->mem = mem;
            cpu->bytes = a.used;
            a.base = mem;
            continue;
        }
        cpu->scratch = scratch;
        cpu->scratch_stride = stride;
        cpu->key_off = key_off;
        cpu->sk = sk;
        cpu->sk_stride = (int64_t)sk_stride;
        cpu->rinv = rinv;
    }
    return DS4_OK;
}

static void cpu_destroy(ds4_dev *d) {
    ds4_cpu *cpu = ds4_cpu_of(d);
    if (!cpu) return;
    free(cpu->mem);
    free(cpu->gemm_ws);
    free(cpu->sample_ws);
    free(cpu);
}

/* ------------------------------------------------------------------------------------------------ table */

static const ds4_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_upload,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .sync = cpu_sync,
    .reserve = cpu_reserve,
    .destroy = cpu_destroy,
#define DS4_CPU_OP(name) .name = ds4_cpu_##name,
    DS4_OPS(DS4_CPU_OP)
#undef DS4_CPU_OP
};

ds4_status ds4_cpu_dev_create(ds4_pool *pool, ds4_dev **out, ds4_error *err) {
    ds4_cpu *cpu = calloc(1, sizeof *cpu);
    if (!cpu) return ds4_fail(err, DS4_ERR_OOM, "cpu backend: %zu bytes", sizeof *cpu);
    cpu->dev.ops = &cpu_ops;
    cpu->dev.kind = DS4_DEV_CPU;
    cpu->dev.host_visible = 1;
    cpu->dev.refs = 1;
    cpu->pool = pool;
    cpu->ntask = 4 * (int64_t)ds4_pool_threads(pool);
    if (cpu->ntask > DS4_CPU_MAX_TASKS) cpu->ntask = DS4_CPU_MAX_TASKS;
    void *ws = NULL;
    const size_t ws_bytes = (size_t)ds4_pool_threads(pool) * DS4_GEMM_WS_FLOATS * sizeof(float);
    if (posix_memalign(&ws, 64, ws_bytes)) {
        free(cpu);
        return ds4_fail(err, DS4_ERR_OOM, "cpu backend: matmul scratch of %zu bytes", ws_bytes);
    }
    cpu->gemm_ws = ws;
    *out = &cpu->dev;
    return DS4_OK;
}
