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
    const int64_t nt = cpu->ntask < n ? cpu->ntask : n;
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

static ds4_status cpu_upload(ds4_dev *d, void *dst, const void *src, size_t bytes, ds4_error *err) {
    (void)d, (void)err;
    if (dst != src) memcpy(dst, src, bytes);
    return DS4_OK;
}

static void cpu_copy(ds4_dev *d, void *dst, const void *src, size_t bytes) {
    (void)d;
    if (dst != src) memmove(dst, src, bytes);
}

static void cpu_fill(ds4_dev *d, void *dst, int byte, size_t bytes) {
    (void)d;
    memset(dst, byte, bytes);
}

static ds4_status cpu_sync(ds4_dev *d, ds4_error *err) {
    (void)d, (void)err;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ scratch */

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }

/* Per-range scratch of a forward pass, the largest of: mHC / HyperHead normalised streams (n·D), compressor slots
 * (2m gates, 2m values, 4m row pointers of 2 floats each: 12m), indexer scores (<= S entries), attention logits
 * (window + <= S entries) followed by as many key pointers (2 floats each). The backward adds its Sinkhorn
 * states, RMS factors and the transposes of the linear backward (largest weight; widest activation times the most
 * rows any linear backward sees: routed-expert slots or per-stream rows). */
static ds4_status cpu_reserve(ds4_dev *d, const ds4_config *c, int64_t T, int64_t S, int training, ds4_error *err) {
    ds4_cpu *cpu = ds4_cpu_of(d);
    const size_t n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t H = (size_t)c->num_attention_heads, dh = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, qr = (size_t)c->q_lora_rank;
    const size_t mix = (2 + n) * n, GO = (size_t)(c->o_groups * c->o_lora_rank), nD = n * D, Tz = (size_t)T;
    const int64_t mmax = c->compress_rate_csa > c->compress_rate_hca ? c->compress_rate_csa : c->compress_rate_hca;
    const int64_t nkeys = (c->sliding_window < S ? c->sliding_window : S) + S;
    const int64_t key_off = (nkeys + 1) & ~(int64_t)1; /* keep the pointer array 8-byte aligned */
    int64_t stride = key_off + 2 * nkeys;
    if ((int64_t)nD > stride) stride = (int64_t)nD;
    if (12 * mmax > stride) stride = 12 * mmax;
    stride = (stride + 15) & ~(int64_t)15;
    size_t ok = 0, lin_rows = 0, sk_stride = 0;
    if (training) {
        ok = zmax(V * D, H * dh * qr);
        ok = zmax(ok, D * GO);
        ok = zmax(ok, GO * H * dh);
        ok = zmax(ok, mix * nD);
        ok = zmax(ok, I * D);
        ok = zmax(ok, 2 * dh * D);
        ok = zmax(ok, E * D);
        ok = zmax(ok, D * D);
        ok = zmax(ok, qr * D);
        size_t wmax = zmax(V, nD);
        wmax = zmax(wmax, H * dh);
        wmax = zmax(wmax, 2 * dh);
        wmax = zmax(wmax, GO);
        wmax = zmax(wmax, zmax(I, E));
        wmax = zmax(wmax, zmax(qr, mix));
        lin_rows = zmax(Tz * K, Tz * n) * wmax;
        sk_stride = (2 * (size_t)c->hc_sinkhorn_iters + 2) * n * n;
    }
    const size_t ntask = (size_t)cpu->ntask;
    ds4_arena a = {0};
    for (int pass = 0; pass < 2; pass++) {
        a.used = 0;
        float *scratch = ds4_arena_take(&a, ntask * (size_t)stride, 4);
        double *sk = training ? ds4_arena_take(&a, ntask * sk_stride, 8) : NULL;
        float *rinv = training ? ds4_arena_take(&a, Tz * zmax(n, H), 4) : NULL;
        float *lin[5];
        for (int i = 0; i < 5; i++) lin[i] = training ? ds4_arena_take(&a, i < 2 ? ok : lin_rows, 4) : NULL;
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
        cpu->lin_wt = lin[0];
        cpu->lin_dw = lin[1];
        cpu->lin_a = lin[2];
        cpu->lin_b = lin[3];
        cpu->lin_c = lin[4];
    }
    return DS4_OK;
}

static void cpu_destroy(ds4_dev *d) {
    ds4_cpu *cpu = ds4_cpu_of(d);
    if (!cpu) return;
    free(cpu->mem);
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
    *out = &cpu->dev;
    return DS4_OK;
}
