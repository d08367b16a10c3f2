// cuda_dev.cu — the CUDA backend instance: device memory, transfers, scratch, launch checking, per-op device
// timers for the profile, and the operation table (cuda_dev.cuh for the contract).
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_dev.cuh"

#define CK(call, ...)                                                                                          \
    do {                                                                                                       \
        const cudaError_t e_ = (call);                                                                         \
        if (e_ != cudaSuccess) {                                                                               \
            (void)cudaGetLastError();                                                                          \
            char ctx_[512];                                                                                    \
            snprintf(ctx_, sizeof ctx_, __VA_ARGS__);                                                          \
            return ds4_fail(err, DS4_ERR_CUDA, "%s: %s: %s (%s)", ctx_, #call, cudaGetErrorString(e_),        \
                            cudaGetErrorName(e_));                                                             \
        }                                                                                                      \
    } while (0)

static void note_shapes(ds4_dev *d, const char *fmt, va_list ap);

bool ds4_cuda_launched(ds4_dev *d, const char *op, const char *fmt, ...) {
    cudaError_t e = cudaGetLastError();
    cuda_dev *cd = cdev(d);
    if (e == cudaSuccess && cd->sync_each_op) e = cudaStreamSynchronize(cd->stream);
    if (e == cudaSuccess) {
        if (d->prof && d->prof->timer_detail) {
            va_list ap;
            va_start(ap, fmt);
            note_shapes(d, fmt, ap);
            va_end(ap);
        }
        return true;
    }
    (void)cudaGetLastError();
    char shapes[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(shapes, sizeof shapes, fmt, ap);
    va_end(ap);
    ds4_dev_fail(d, DS4_ERR_CUDA, "%s %s: kernel %s: %s (%s)", op, shapes, cd->sync_each_op ? "failed" : "launch",
                 cudaGetErrorString(e), cudaGetErrorName(e));
    return false;
}

// ------------------------------------------------------------------------------------------ memory

static ds4_status c_alloc(ds4_dev *d, size_t bytes, void **out, ds4_error *err) {
    cuda_dev *cd = cdev(d);
    *out = NULL;
    CK(cudaSetDevice(cd->device), "cuda alloc %zu bytes", bytes);
    void *p = NULL;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        (void)cudaMemGetInfo(&fr, &tot);
        (void)cudaGetLastError();
        return ds4_fail(err, e == cudaErrorMemoryAllocation ? DS4_ERR_OOM : DS4_ERR_CUDA,
                        "cuda alloc on device %d: asked for %.1f MiB, %.1f MiB free of %.1f MiB: %s", cd->device,
                        bytes / 1048576.0, fr / 1048576.0, tot / 1048576.0, cudaGetErrorString(e));
    }
    *out = p;
    return DS4_OK;
}

static void c_free(ds4_dev *d, void *p) {
    if (!p) return;
    (void)cudaSetDevice(cdev(d)->device);
    (void)cudaFree(p);
    (void)cudaGetLastError();
}

static ds4_status c_upload(ds4_dev *d, void *dst, const void *src, size_t bytes, ds4_error *err) {
    cuda_dev *cd = cdev(d);
    if (!bytes) return DS4_OK;
    // from pageable memory: the call returns once the source is staged, so the caller may reuse it at once
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cd->stream), "cuda upload %zu bytes", bytes);
    return DS4_OK;
}

static ds4_status c_download(ds4_dev *d, void *dst, const void *src, size_t bytes, ds4_error *err) {
    cuda_dev *cd = cdev(d);
    if (!bytes) return DS4_OK;
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cd->stream), "cuda download %zu bytes", bytes);
    CK(cudaStreamSynchronize(cd->stream), "cuda download %zu bytes (or an earlier operation on the stream)", bytes);
    return DS4_OK;
}

static void c_copy(ds4_dev *d, void *dst, const void *src, size_t bytes) {
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cdev(d)->stream);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        ds4_dev_fail(d, DS4_ERR_CUDA, "copy %zu bytes: cudaMemcpyAsync: %s", bytes, cudaGetErrorString(e));
    }
}

static void c_fill(ds4_dev *d, void *dst, int byte, size_t bytes) {
    const cudaError_t e = cudaMemsetAsync(dst, byte, bytes, cdev(d)->stream);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        ds4_dev_fail(d, DS4_ERR_CUDA, "fill %zu bytes: cudaMemsetAsync: %s", bytes, cudaGetErrorString(e));
    }
}

static ds4_status c_sync(ds4_dev *d, ds4_error *err) {
    CK(cudaStreamSynchronize(cdev(d)->stream), "cuda synchronize (an operation enqueued on the stream failed)");
    return DS4_OK;
}

void *ds4_cuda_scratch(ds4_dev *d, size_t bytes, const char *op, int slot) {
    cuda_dev *cd = cdev(d);
    if (slot == 2) cd->slot2_uses++; // whoever asks may write it: a kept copy of x there is no longer known
    if (bytes <= cd->scratch_bytes[slot]) return cd->scratch[slot];
    if (cd->recording) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: scratch would grow while a pass is recorded", op);
        return NULL;
    }
    cd->generation++;
    cd->scratch_gen[slot]++;
    // growing frees the old block: wait for the operations that may still read it
    (void)cudaStreamSynchronize(cd->stream);
    c_free(d, cd->scratch[slot]);
    cd->scratch[slot] = NULL;
    cd->scratch_bytes[slot] = 0;
    ds4_error e;
    if (c_alloc(d, bytes, &cd->scratch[slot], &e)) {
        ds4_dev_fail(d, e.code, "%s: scratch: %s", op, e.msg);
        return NULL;
    }
    cd->scratch_bytes[slot] = bytes;
    return cd->scratch[slot];
}

int *ds4_cuda_counters(ds4_dev *d, size_t n, const char *op) {
    cuda_dev *cd = cdev(d);
    if (n <= cd->ncounters) return cd->counters;
    if (cd->recording) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "%s: counters would grow while a pass is recorded", op);
        return NULL;
    }
    cd->generation++;
    (void)cudaStreamSynchronize(cd->stream);
    c_free(d, cd->counters);
    cd->counters = NULL;
    cd->ncounters = 0;
    ds4_error e;
    void *p = NULL;
    if (c_alloc(d, n * sizeof(int), &p, &e)) {
        ds4_dev_fail(d, e.code, "%s: counters: %s", op, e.msg);
        return NULL;
    }
    // zeroed on the backend's stream, ahead of the kernels that count on it: a plain cudaMemset runs on the legacy
    // default stream, which a non-blocking stream does not wait for, so the first kernels could count from garbage
    // (a skinny product summing its tile before every slice's partial had landed; seen once as test_cuda_hc_bits
    // failing under a loaded GPU)
    const cudaError_t me = cudaMemsetAsync(p, 0, n * sizeof(int), cd->stream);
    if (me != cudaSuccess) {
        (void)cudaGetLastError();
        (void)cudaStreamSynchronize(cd->stream);
        c_free(d, p);
        ds4_dev_fail(d, DS4_ERR_CUDA, "%s: counters: cudaMemsetAsync: %s", op, cudaGetErrorString(me));
        return NULL;
    }
    cd->counters = (int *)p;
    cd->ncounters = n;
    return cd->counters;
}

// Nothing to size ahead: the operations that need scratch (sampling, sorting experts) take it from ds4_cuda_scratch,
// which generation and the schedule size before their loops through the first pass.
static ds4_status c_reserve(ds4_dev *d, const ds4_config *c, int64_t T, int64_t S, int training, ds4_error *err) {
    (void)d, (void)c, (void)T, (void)S, (void)training, (void)err;
    return DS4_OK;
}

// ------------------------------------------------------------------------------------------ recorded passes

// A key seen the first time runs as usual (which also grows whatever scratch its operations need); the second time
// its operations are recorded (recording does not run them) and graph_end launches the record; from then on it is
// replayed. Not while profiling (per-op timers) or with DS4_CUDA_SYNC=1.
static int c_graph_begin(ds4_dev *d, uint64_t key) {
    cuda_dev *cd = cdev(d);
    cd->bwd_dy.src = nullptr; // a kept bf16 operand never crosses a pass's boundary (a replay skips the host's ops)
    cd->bwd_xT.x = nullptr;
    cd->y_unwritten = nullptr;
    if (!cd->graphs_on || d->prof || cd->sync_each_op || d->st) return 0;
    cuda_dev::graph_entry *e = NULL, *lru = &cd->graphs[0];
    for (auto &g : cd->graphs) {
        if (g.key == key) e = &g;
        if (g.used < lru->used) lru = &g;
    }
    cd->clock++;
    if (e && e->exec && e->generation == cd->generation) {
        e->used = cd->clock;
        const cudaError_t err = cudaGraphLaunch(e->exec, cd->stream);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            ds4_dev_fail(d, DS4_ERR_CUDA, "recorded step: cudaGraphLaunch: %s", cudaGetErrorString(err));
        }
        return 1;
    }
    if (!e) { // first sighting: remember it, run as usual
        if (lru->exec) (void)cudaGraphExecDestroy(lru->exec);
        *lru = cuda_dev::graph_entry{key, cd->generation, cd->clock, NULL};
        return 0;
    }
    if (e->exec) { // recorded over scratch that has moved since
        (void)cudaGraphExecDestroy(e->exec);
        e->exec = NULL;
    }
    e->used = cd->clock;
    if (cudaStreamBeginCapture(cd->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    cd->recording = e;
    return 0;
}

static void c_graph_end(ds4_dev *d, uint64_t key) {
    cuda_dev *cd = cdev(d);
    cuda_dev::graph_entry *e = cd->recording;
    if (!e) return;
    cd->recording = NULL;
    cudaGraph_t g = NULL;
    cudaError_t err = cudaStreamEndCapture(cd->stream, &g);
    if (err == cudaSuccess && !d->st) err = cudaGraphInstantiate(&e->exec, g, 0);
    if (g) (void)cudaGraphDestroy(g);
    if (err == cudaSuccess && !d->st) {
        e->generation = cd->generation;
        err = cudaGraphLaunch(e->exec, cd->stream);
    }
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        if (e->exec) (void)cudaGraphExecDestroy(e->exec);
        e->exec = NULL;
        e->key = 0;
        ds4_dev_fail(d, DS4_ERR_CUDA, "recording a step (key %llx): %s", (unsigned long long)key, cudaGetErrorString(err));
    } else if (d->st) { // an operation failed while recording: nothing ran; the failure stands
        if (e->exec) (void)cudaGraphExecDestroy(e->exec);
        e->exec = NULL;
        e->key = 0;
    }
}

static void c_destroy(ds4_dev *d) {
    cuda_dev *cd = cdev(d);
    if (!cd) return;
    (void)cudaSetDevice(cd->device);
    (void)cudaStreamSynchronize(cd->stream);
    for (auto &g : cd->graphs)
        if (g.exec) (void)cudaGraphExecDestroy(g.exec);
    for (void *p : cd->scratch) c_free(d, p);
    c_free(d, cd->counters);
    if (cd->host_err) (void)cudaFreeHost(cd->host_err);
    ds4_cuda_close(cd->cu);
    free(cd);
}

// ------------------------------------------------------------------------------------------ profile timers

// Event pairs recorded around each operation; their times are read (one synchronisation) when the table is printed
// or the pool is full, so profiling does not serialise the stream op by op.
namespace {
struct timer_state {
    enum { N = 4096, SHAPE = 112, ROWS = 1024 };
    cudaEvent_t ev[2 * N];
    int op[N];
    int used;
    // DS4_PROFILE_SHAPES=1: the shapes of each timed op's first launch (ds4_cuda_launched), and the times gathered by
    // (op, shapes) — which GEMM or attention shape the time goes to, not only which op
    int detail;
    char shape[N][SHAPE];
    struct row {
        int op;
        int64_t calls;
        double seconds;
        char shape[SHAPE];
    } rows[ROWS];
    int nrows;
};
}

static void note_shapes(ds4_dev *d, const char *fmt, va_list ap) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (!s || !s->detail || d->prof->op_now < 0 || !s->used || s->shape[s->used - 1][0])
        return; // a launch outside an op, or not the op's first launch
    vsnprintf(s->shape[s->used - 1], timer_state::SHAPE, fmt, ap);
}

static void t_flush(ds4_dev *d) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (!s || !s->used) return;
    (void)cudaEventSynchronize(s->ev[2 * s->used - 1]);
    for (int i = 0; i < s->used; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, s->ev[2 * i], s->ev[2 * i + 1]) != cudaSuccess) ms = 0;
        d->prof->seconds[s->op[i]] += 1e-3 * (double)ms;
        if (!s->detail) continue;
        int r = 0;
        while (r < s->nrows && (s->rows[r].op != s->op[i] || strcmp(s->rows[r].shape, s->shape[i]))) r++;
        if (r == s->nrows && s->nrows < timer_state::ROWS) { // past ROWS distinct shapes, the rest go uncounted here
            s->rows[r].op = s->op[i];
            s->rows[r].calls = 0;
            s->rows[r].seconds = 0;
            memcpy(s->rows[r].shape, s->shape[i], sizeof s->rows[r].shape);
            s->nrows++;
        }
        if (r < s->nrows) {
            s->rows[r].calls++;
            s->rows[r].seconds += 1e-3 * (double)ms;
        }
        s->shape[i][0] = 0;
    }
    (void)cudaGetLastError();
    s->used = 0;
}

static int t_start(ds4_dev *d, ds4_op_id op) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (s->used == timer_state::N) t_flush(d);
    const int i = s->used++;
    s->op[i] = (int)op;
    s->shape[i][0] = 0;
    (void)cudaEventRecord(s->ev[2 * i], cdev(d)->stream);
    return i;
}

static void t_stop(ds4_dev *d, ds4_op_id op, int token) {
    (void)op;
    timer_state *s = (timer_state *)d->prof->timer_state;
    (void)cudaEventRecord(s->ev[2 * token + 1], cdev(d)->stream);
}

static void t_reset(ds4_dev *d) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (s) s->nrows = 0;
}

// The (op, shapes) rows by time, descending: the 60 longest.
static size_t t_detail(ds4_dev *d, char *buf, size_t len) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (!s || !s->detail || !len) return 0;
    t_flush(d);
    static_assert(timer_state::ROWS <= 1024, "order below");
    int order[timer_state::ROWS], n = s->nrows;
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && s->rows[order[j]].seconds > s->rows[order[j - 1]].seconds; j--) {
            const int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    size_t pos = 0;
    auto put = [&](const char *fmt, auto... v) {
        if (pos >= len) return;
        const int k = snprintf(buf + pos, len - pos, fmt, v...);
        pos = k < 0 ? len : ((size_t)k >= len - pos ? len : pos + (size_t)k);
    };
    put("\nby shape (DS4_PROFILE_SHAPES=1; an op's first launch names it): %d distinct\n%-22s %7s %10s %10s  %s\n",
        n, "op", "calls", "ms", "us/call", "shapes");
    for (int k = 0; k < n && k < 60; k++) {
        const timer_state::row &r = s->rows[order[k]];
        put("%-22s %7lld %10.3f %10.2f  %s\n", ds4_op_name((ds4_op_id)r.op), (long long)r.calls, 1e3 * r.seconds,
            1e6 * r.seconds / (double)r.calls, r.shape);
    }
    return pos < len ? pos : len - 1;
}

static void t_free(ds4_dev *d) {
    timer_state *s = (timer_state *)d->prof->timer_state;
    if (!s) return;
    for (int i = 0; i < 2 * timer_state::N; i++) (void)cudaEventDestroy(s->ev[i]);
    (void)cudaGetLastError();
    free(s);
    d->prof->timer_state = NULL;
}

static ds4_status c_profile_init(ds4_dev *d, ds4_error *err) {
    timer_state *s = (timer_state *)calloc(1, sizeof *s);
    if (!s) return ds4_fail(err, DS4_ERR_OOM, "cuda profile: timer pool");
    for (int i = 0; i < 2 * timer_state::N; i++) {
        const cudaError_t e = cudaEventCreate(&s->ev[i]);
        if (e != cudaSuccess) {
            for (int j = 0; j < i; j++) (void)cudaEventDestroy(s->ev[j]);
            free(s);
            (void)cudaGetLastError();
            return ds4_fail(err, DS4_ERR_CUDA, "cuda profile: cudaEventCreate: %s", cudaGetErrorString(e));
        }
    }
    const char *env = getenv("DS4_PROFILE_SHAPES");
    s->detail = env && env[0] == '1';
    d->prof->timer_state = s;
    d->prof->timer_start = t_start;
    d->prof->timer_stop = t_stop;
    d->prof->timer_flush = t_flush;
    d->prof->timer_free = t_free;
    if (s->detail) {
        d->prof->timer_detail = t_detail;
        d->prof->timer_reset = t_reset;
    }
    return DS4_OK;
}

static void *c_native_stream(ds4_dev *d) { return (void *)cdev(d)->stream; }

// ------------------------------------------------------------------------------------------ table

static const ds4_ops cuda_ops = [] {
    ds4_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.alloc = c_alloc;
    o.free = c_free;
    o.upload = c_upload;
    o.download = c_download;
    o.copy = c_copy;
    o.fill = c_fill;
    o.sync = c_sync;
    o.reserve = c_reserve;
    o.destroy = c_destroy;
    o.profile_init = c_profile_init;
    o.graph_begin = c_graph_begin;
    o.graph_end = c_graph_end;
    o.native_stream = c_native_stream;
#define SET(name) o.name = ds4_cuda_##name;
    SET(embed) SET(hc_pre) SET(hc_post) SET(hyperhead) SET(rmsnorm) SET(rope) SET(scale) SET(fake_quant) SET(copy_rows)
    SET(gather_rows) SET(scatter_rows) SET(add_rows) SET(add_bcast) SET(matmul) SET(matmul_grouped)
    SET(compress)
    SET(indexer) SET(attention) SET(cache_commit) SET(record_picks) SET(route) SET(count_loads) SET(moe_sort)
    SET(moe_weigh) SET(swiglu) SET(moe_combine) SET(ce_rows) SET(logprobs) SET(sample)
    SET(optim_sumsq) SET(adamw) SET(cast_params)
    SET(logp_bwd) SET(linear_bwd_x) SET(linear_bwd_w) SET(linear_bwd_x_grouped) SET(linear_bwd_w_grouped) SET(norm_bwd) SET(colsum_add) SET(sum_streams) SET(embed_bwd)
    SET(hc_pre_bwd) SET(hc_post_bwd) SET(hyperhead_bwd) SET(swiglu_bwd) SET(moe_dws) SET(moe_dy) SET(moe_sum_slots) SET(router_bwd)
    SET(attn_bwd_q) SET(attn_bwd_kv) SET(attn_bwd_entry) SET(pick_inverse) SET(entry_rope) SET(comp_bwd) SET(ikl)
    SET(ikl_bwd_q) SET(ikl_bwd_k)
#undef SET
    return o;
}();

extern "C" ds4_status ds4_cuda_dev_create(int device, ds4_dev **out, ds4_error *err) {
    *out = NULL;
    ds4_cuda *cu = NULL;
    ds4_status st = ds4_cuda_open(device, &cu, err);
    if (st) return st;
    cuda_dev *cd = (cuda_dev *)calloc(1, sizeof *cd);
    if (!cd) {
        ds4_cuda_close(cu);
        return ds4_fail(err, DS4_ERR_OOM, "cuda backend: %zu bytes", sizeof *cd);
    }
    cd->dev.ops = &cuda_ops;
    cd->dev.kind = DS4_DEV_CUDA;
    cd->dev.host_visible = 0;
    cd->dev.refs = 1;
    cd->cu = cu;
    cd->device = device;
    cd->stream = ds4_cuda_stream(cu);
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        (void)cudaGetLastError();
        c_destroy(&cd->dev);
        return ds4_fail(err, DS4_ERR_CUDA, "cuda backend: cudaGetDeviceProperties(%d) failed", device);
    }
    cd->sm_count = p.multiProcessorCount;
    cd->smem_optin = p.sharedMemPerBlockOptin;
    const char *sync = getenv("DS4_CUDA_SYNC"), *graphs = getenv("DS4_CUDA_GRAPHS");
    cd->sync_each_op = sync && sync[0] == '1';
    cd->graphs_on = !(graphs && graphs[0] == '0');
    /* a tuning knob, not a numerical one: both GEMM variants give the same bits (cuda_gemm.cu) */
    const char *skinny = getenv("DS4_CUDA_SKINNY_ROWS");
    cd->skinny_rows = skinny && skinny[0] ? strtoll(skinny, NULL, 10) : 256;
    const char *pipe = getenv("DS4_CUDA_GEMM_PIPE");
    cd->gemm_pipe = pipe && pipe[0] ? atoi(pipe) : 0;
    cd->cc = p.major * 10 + p.minor;
    const char *wgmma = getenv("DS4_CUDA_GEMM_WGMMA"); /* a path switch, not a numerical one: the same bits */
    cd->gemm_wgmma = wgmma && wgmma[0] == '0' ? 0 : 1;
    const char *dw_wgmma = getenv("DS4_CUDA_DW_WGMMA"); /* a path switch: the same bits */
    cd->dw_wgmma = !(dw_wgmma && dw_wgmma[0] == '0');
    const char *hc_ref = getenv("DS4_CUDA_HC_REF");
    cd->hc_ref = hc_ref && hc_ref[0] == '1';
    const char *bwd_ref = getenv("DS4_CUDA_BWD_REF");
    cd->bwd_ref = bwd_ref && bwd_ref[0] == '1';
    const char *attn_ref = getenv("DS4_CUDA_ATTN_REF");
    cd->attn_ref = attn_ref && attn_ref[0] == '1';
    const char *row_ref = getenv("DS4_CUDA_ROW_REF");
    cd->row_ref = row_ref && row_ref[0] == '1';
    const char *row_blocks = getenv("DS4_CUDA_ROW_BLOCKS"); /* a tuning knob: never changes a bit */
    cd->row_blocks = row_blocks && row_blocks[0] ? atoi(row_blocks) : 0;
    *out = &cd->dev;
    return DS4_OK;
}
