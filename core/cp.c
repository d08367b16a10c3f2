/* cp.c — context parallelism (docs/distributed.md, "Context parallelism"): one sequence split over the ranks. Every
 * per-token layer (embedding, mHC sites, norms, MoE, heads, losses) runs on this rank's contiguous slice of each
 * sequence; an attention sub-layer all-gathers its input rows in rank order and runs its key side (window keys,
 * compressors, indexer entries) over the whole sequence, so the window ring, the compressor windows that straddle two
 * ranks' slices and the indexer see exactly the rows one process would. Its query side runs over this rank's
 * positions only (split by query, the default: a query window of the whole sequences' rows), or over the whole
 * sequence, the rank then keeping its own rows of the output (whole_attention). Every value a rank computes for its
 * rows in the forward is therefore the same computation on the same bits as in one process holding the whole
 * sequence (the kernels are batch invariant: docs/architecture.md, "Numerical choices"). In the backward, split by
 * query, each rank's queries give their part of the key side's gradients, summed over the ranks in rank order
 * (ds4_cp_sum_floats); whole, every rank runs the whole backward on the gathered output gradients. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sched.h"

/* A model whose memory the host cannot read (CUDA) gathers through the device hook, on the device it was set up for
 * (the model may have moved since). */
static ds4_status device_check(const ds4_model *m, const ds4_context_parallel *cp, const char *what, ds4_error *err) {
    if (m->dev->host_visible) return DS4_OK;
    const ds4_device_options d = ds4_model_device(m);
    const int32_t at = d.type == DS4_DEVICE_CUDA ? d.index : -1;
    if (!cp->device_all_gather)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "%s: the model computes on %s, whose memory the host cannot read, "
                                                  "and no device_all_gather hook was given (from Lua: "
                                                  "ds4.dist.init{device = \"cuda\"}, the model on ds4.dist.device())",
                        what, ds4_model_device_name(m));
    if (at != cp->device)
        return ds4_fail(err, DS4_ERR_ARG, "%s: the model computes on %s but its gathers were set up for %s memory (set "
                                          "context parallelism up again after moving the model)", what,
                        ds4_model_device_name(m), cp->device < 0 ? "host" : "another CUDA device's");
    return DS4_OK;
}

ds4_status ds4_model_set_context_parallel(ds4_model *m, const ds4_context_parallel *cp, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "context parallel: model is NULL");
    if (m->tape) m->tape->valid = 0; /* a tape of the other mode cannot be differentiated in this one */
    if (!cp) {
        m->cp_on = 0;
        memset(&m->cp, 0, sizeof m->cp);
        return DS4_OK;
    }
    if (cp->world < 1 || cp->rank < 0 || cp->rank >= cp->world)
        return ds4_fail(err, DS4_ERR_ARG, "context parallel: rank %d of a world of %d", cp->rank, cp->world);
    if (!cp->all_gather) return ds4_fail(err, DS4_ERR_ARG, "context parallel: the all_gather hook is required");
    ds4_status s = device_check(m, cp, "context parallel", err);
    if (s) return s;
    if (m->ep_on)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "context parallel: expert parallelism is on; the two together are "
                                                  "not supported yet");
    if (m->lora)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "context parallel: the model has LoRA adapters, which context "
                                                  "parallelism does not support yet");
    m->cp = *cp;
    m->cp_on = 1;
    return DS4_OK;
}

const ds4_context_parallel *ds4_model_context_parallel(const ds4_model *m) { return m && m->cp_on ? &m->cp : NULL; }

void ds4_cp_range(int64_t S, int mtp, int32_t world, int32_t q, int64_t *off, int64_t *len) {
    const int64_t base = S / world, extra = S % world;
    int64_t o = q * base + (q < extra ? q : extra), e = o + base + (q < extra);
    if (mtp) { /* the MTP block runs over positions 0 .. S - 2: the last rank's slice loses its last position */
        o = o < S - 1 ? o : S - 1;
        e = e < S - 1 ? e : S - 1;
    }
    *off = o;
    *len = e - o;
}

ds4_status ds4_cp_check(const ds4_model *m, const ds4_forward_args *a, int train, ds4_error *err) {
    if (!m->cp_on) return DS4_OK;
    ds4_status s = device_check(m, &m->cp, "forward: context parallel", err);
    if (s) return s;
    const char *why = m->lora                                     ? "LoRA adapters"
                      : m->ep_on                                  ? "expert parallelism"
                      : a->logits || a->mtp_logits || a->hidden   ? "logits, MTP logits or hidden streams as outputs "
                                                                    "(use the losses, or logprobs after a training forward)"
                      : a->replay_experts || a->replay_index      ? "routing replay"
                      : train && m->topt.indexer_kl > 0           ? "the indexer KL loss"
                      : train && m->topt.recompute                ? "per-block recomputation"
                                                                  : NULL;
    if (why) return ds4_fail(err, DS4_ERR_UNSUPPORTED, "forward: context parallel: %s not supported yet", why);
    if (a->seq < 2 * (int64_t)m->cp.world)
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: context parallel: ids [%lld, %lld] over %d ranks: every rank "
                                            "needs at least 2 positions (S >= %d)", (long long)a->batch,
                        (long long)a->seq, m->cp.world, 2 * m->cp.world);
    return DS4_OK;
}

/* FNV-1a over n int64 values (0 for none): the ranks compare their inputs without sending them. */
static uint64_t hash_i64(const int64_t *x, int64_t n) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p = (const unsigned char *)x;
    for (int64_t i = 0; x && i < n * (int64_t)sizeof *x; i++) h = (h ^ p[i]) * 1099511628211ull;
    return x ? h : 0;
}

typedef struct {
    int64_t st, B, S;             /* this rank's checks (0: passed) and shape */
    uint64_t ids, labels;         /* hashes of its ids and labels */
} cp_note;

ds4_status ds4_cp_agree(ds4_model *m, const char *what, int64_t B, int64_t S, const int64_t *ids,
                        const int64_t *labels, ds4_status st, ds4_error *err) {
    const int32_t P = m->cp.world;
    const cp_note mine = {st, B, S, st ? 0 : hash_i64(ids, B * S), st ? 0 : hash_i64(labels, B * S)};
    cp_note *all = malloc((size_t)P * sizeof *all);
    if (!all) return ds4_fail(err, DS4_ERR_OOM, "%s: context parallel: notes of %d ranks", what, P);
    ds4_error e = {0};
    ds4_status gs = m->cp.all_gather(m->cp.ctx, &mine, all, sizeof mine, &e);
    if (gs) {
        free(all);
        if (st) return st; /* this rank's own failure says more */
        return ds4_fail(err, gs, "%s: context parallel: the ranks' notes (rank %d of %d): %s", what, m->cp.rank, P, e.msg);
    }
    ds4_status out = st;
    for (int32_t q = 0; q < P && !out; q++) {
        if (all[q].st)
            out = ds4_fail(err, DS4_ERR_ARG, "%s: context parallel: rank %d refused its %s (its output says why); every "
                                             "rank makes the same calls", what, q, what);
        else if (all[q].B != all[0].B || all[q].S != all[0].S || all[q].ids != all[0].ids ||
                 all[q].labels != all[0].labels)
            out = ds4_fail(err, DS4_ERR_ARG, "%s: context parallel: rank %d passed ids [%lld, %lld] and labels that differ "
                                             "from rank 0's (ids [%lld, %lld]): every rank passes the same whole "
                                             "sequences", what, q, (long long)all[q].B, (long long)all[q].S,
                           (long long)all[0].B, (long long)all[0].S);
    }
    free(all);
    return out;
}

static void set_shape(ds4_pass *f, int64_t S) {
    f->S = S;
    f->T = f->B * S;
    f->rows.S = S;
    f->rows.T = f->T;
}

static void my_range(const ds4_pass *f, int64_t *off, int64_t *len) {
    ds4_cp_range(f->cp_S0, f->cp_mtp, f->cp_world, f->cp_rank, off, len);
}

void ds4_cp_begin(ds4_pass *f, int64_t S) {
    f->cp_world = f->m->cp.world;
    f->cp_rank = f->m->cp.rank;
    f->cp_S0 = S;
    ds4_cp_set_mtp(f, 0);
}

void ds4_cp_set_mtp(ds4_pass *f, int mtp) {
    int64_t off, n;
    f->cp_mtp = mtp;
    my_range(f, &off, &n);
    set_shape(f, n);
}

/* The model's host scratch for a gather, grown when needed (NULL: out of memory, the pass failed). */
static void *scratch(ds4_pass *f, size_t bytes) {
    ds4_model *m = f->m;
    if (bytes <= m->cp_host_bytes) return m->cp_host;
    void *p = realloc(m->cp_host, bytes);
    if (!p) {
        ds4_dev_fail(f->dev, DS4_ERR_OOM, "context parallel: %zu bytes of gather scratch", bytes);
        return NULL;
    }
    m->cp_host = p;
    m->cp_host_bytes = bytes;
    return p;
}

enum { GATHER_HDR = 16 }; /* a block's header: whether its rank's pass has failed (int64), keeping 8-byte alignment */

/* All-gather the `mine_bytes` this rank holds, in blocks of `blk` payload bytes (rank 0's slice is the longest, so
 * blocks of its row count, the tail of shorter slices zero) behind a header: returns rank 0's payload, rank q's at
 * q·(*stride) from it, or NULL when this pass failed. A rank whose pass has already failed still takes part (with
 * the header saying so), so that the others fail with it instead of waiting. */
static char *gather(ds4_pass *f, const void *mine, size_t mine_bytes, size_t blk, const char *what, size_t *stride) {
    const int32_t P = f->cp_world;
    const size_t sz = GATHER_HDR + blk;
    char *buf = scratch(f, sz * (size_t)(P + 1));
    if (!buf) return NULL;
    const int64_t failed = f->dev->st != 0;
    memset(buf, 0, sz);
    memcpy(buf, &failed, sizeof failed);
    if (!failed && mine_bytes) memcpy(buf + GATHER_HDR, mine, mine_bytes);
    ds4_error e = {0};
    ds4_status st = f->m->cp.all_gather(f->m->cp.ctx, buf, buf + sz, sz, &e);
    if (st) {
        ds4_dev_fail(f->dev, st, "context parallel %s (layer %lld, rank %d of %d): %s", what, (long long)f->li,
                     f->cp_rank, P, e.msg);
        return NULL;
    }
    for (int32_t q = 0; q < P && !failed; q++) {
        int64_t other;
        memcpy(&other, buf + sz * (size_t)(q + 1), sizeof other);
        if (other) {
            ds4_dev_fail(f->dev, DS4_ERR_COMM, "context parallel %s (layer %lld): rank %d failed earlier in this pass "
                                               "(its output says why)", what, (long long)f->li, q);
            return NULL;
        }
    }
    *stride = sz;
    return failed ? NULL : buf + sz + GATHER_HDR;
}

/* Backend memory (a CUDA model): the ranks first tell each other over the host whether their passes have failed (a
 * failed rank joins that gather, not the device one, so nobody waits on it); then x's first `count` values (every
 * rank sends the same count) are gathered into the pass's scratch f->cp_x [P, count] through the device hook, once
 * the backend's work on x has finished. Returns rank 0's block, or NULL when the pass failed. */
static const float *gather_device(ds4_pass *f, const float *x, int64_t count, const char *what) {
    const int32_t P = f->cp_world;
    ds4_error e = {0};
    ds4_status st = f->dev->st ? DS4_OK : f->dev->ops->sync(f->dev, &e); /* x complete; an asynchronous error seen */
    if (st) ds4_dev_fail(f->dev, st, "context parallel %s: %s", what, e.msg);
    size_t stride = 0;
    if (!gather(f, NULL, 0, 0, what, &stride)) return NULL;
    if (!f->cp_x || (int64_t)P * count > f->cp_xn) {
        ds4_dev_fail(f->dev, DS4_ERR_INTERNAL, "context parallel %s: %d x %lld values do not fit the planned scratch "
                                               "(%lld values)", what, P, (long long)count, (long long)f->cp_xn);
        return NULL;
    }
    st = f->m->cp.device_all_gather(f->m->cp.ctx, x, f->cp_x, (size_t)count * sizeof(float), &e);
    if (st) {
        ds4_dev_fail(f->dev, st, "context parallel %s (layer %lld, rank %d of %d): %s", what, (long long)f->li,
                     f->cp_rank, P, e.msg);
        return NULL;
    }
    return f->cp_x;
}

void ds4_cp_gather_rows(ds4_pass *f, float *x, int64_t width) {
    const int64_t B = f->B, Sf = f->cp_mtp ? f->cp_S0 - 1 : f->cp_S0;
    const int on_host = f->dev->host_visible;
    int64_t off, n, o0, nmax;
    my_range(f, &off, &n);
    ds4_cp_range(f->cp_S0, f->cp_mtp, f->cp_world, 0, &o0, &nmax);
    const size_t row = (size_t)width * sizeof(float), blk = (size_t)(B * nmax) * row;
    size_t stride = blk;
    const char *what = "gather of attention rows";
    const char *recv = on_host ? gather(f, x, (size_t)(B * n) * row, blk, what, &stride)
                               : (const char *)gather_device(f, x, B * nmax * width, what);
    set_shape(f, Sf);
    if (!recv) return;
    /* rank q's block holds its rows b·n_q + i, position off_q + i of sequence b */
    for (int32_t q = 0; q < f->cp_world; q++) {
        int64_t oq, nq;
        ds4_cp_range(f->cp_S0, f->cp_mtp, f->cp_world, q, &oq, &nq);
        for (int64_t b = 0; b < B; b++) {
            const char *src = recv + (size_t)q * stride + (size_t)(b * nq) * row;
            if (on_host) memcpy(x + (b * Sf + oq) * width, src, (size_t)nq * row);
            else ds4_dev_copy(f->dev, x + (b * Sf + oq) * width, src, (size_t)nq * row);
        }
    }
}

void ds4_cp_keep_rows(ds4_pass *f, float *x, int64_t width) {
    const int64_t B = f->B, Sf = f->S;
    int64_t off, n;
    my_range(f, &off, &n);
    if (f->dev->host_visible) {
        /* b ascending: row b's destination ends before row b + 1's source begins */
        for (int64_t b = 0; b < B; b++)
            memmove(x + b * n * width, x + (b * Sf + off) * width, (size_t)(n * width) * sizeof(float));
    } else if (!f->dev->st) {
        /* a backend copy may not overlap itself (CUDA's does not promise memmove): through the gather scratch */
        if (!f->cp_x || B * n * width > f->cp_xn)
            ds4_dev_fail(f->dev, DS4_ERR_INTERNAL, "context parallel: keeping %lld rows of %lld values: the planned "
                                                   "scratch holds %lld values", (long long)(B * n), (long long)width,
                         (long long)f->cp_xn);
        const size_t row = (size_t)width * sizeof(float);
        for (int64_t b = 0; b < B; b++)
            ds4_dev_copy(f->dev, f->cp_x + b * n * width, x + (b * Sf + off) * width, (size_t)n * row);
        ds4_dev_copy(f->dev, x, f->cp_x, (size_t)(B * n) * row);
    }
    set_shape(f, n);
}

int ds4_cp_model_by_query(const ds4_model *m) { return m->cp_on && !m->cp.whole_attention; }
int ds4_cp_by_query(const ds4_pass *f) { return f->cp_world && ds4_cp_model_by_query(f->m); }

ds4_rows ds4_cp_query_rows(const ds4_pass *f) {
    int64_t off, n;
    my_range(f, &off, &n);
    ds4_rows r = f->rows; /* the whole sequences' (S = the key side's positions per sequence) */
    r.T = f->B * n;
    r.q0 = off;
    r.qn = n;
    return r;
}

void ds4_cp_whole_shape(ds4_pass *f) { set_shape(f, f->cp_mtp ? f->cp_S0 - 1 : f->cp_S0); }

void ds4_cp_slice_shape(ds4_pass *f) {
    int64_t off, n;
    my_range(f, &off, &n);
    set_shape(f, n);
}

void ds4_cp_sum_floats(ds4_pass *f, float *x, int64_t n, const char *what) {
    if (!f->dev->host_visible) {
        /* every rank's x gathered into f->cp_x [P, n], then x = block 0 + block 1 + ... on the backend: colsum_add
         * of the P blocks into a zeroed x is one chunk (P < DS4_COLSUM_CHUNK), 0 + block 0 + block 1 + .. added into
         * the zero, one fp32 add each: the host loop's sum below */
        const float *recv = gather_device(f, x, n, what);
        if (!recv) return;
        ds4_dev_fill(f->dev, x, 0, (size_t)n * sizeof(float));
        OP(f->dev, colsum_add, .dst = x, .src = recv, .rows = f->cp_world, .width = n, .ld = n);
        return;
    }
    const size_t bytes = (size_t)n * sizeof(float), blk = (bytes + 7) / 8 * 8;
    size_t stride = 0;
    const char *recv = gather(f, x, bytes, blk, what, &stride);
    if (!recv) return;
    const float *r0 = (const float *)(const void *)recv;
    for (int64_t i = 0; i < n; i++) {
        float s = r0[i];
        for (int32_t q = 1; q < f->cp_world; q++) s += ((const float *)(const void *)(recv + (size_t)q * stride))[i];
        x[i] = s;
    }
}

typedef struct {
    double nll;
    int64_t tgt;
} scored_row;

void ds4_cp_sum_rows(ds4_pass *f, const int64_t *tgt, const double *nll, double *sum, int64_t *cnt) {
    const int64_t B = f->B;
    int64_t off, n, o0, nmax;
    my_range(f, &off, &n);
    ds4_cp_range(f->cp_S0, f->cp_mtp, f->cp_world, 0, &o0, &nmax);
    *sum = 0;
    *cnt = 0;
    const size_t blk = (size_t)(B * nmax) * sizeof(scored_row);
    scored_row *mine = malloc(blk);
    if (!mine) /* still joins the gather, as a failed rank */
        ds4_dev_fail(f->dev, DS4_ERR_OOM, "context parallel: %lld rows of losses", (long long)(B * nmax));
    for (int64_t r = 0; mine && r < B * n; r++) mine[r] = (scored_row){nll[r], tgt[r]};
    size_t stride = 0;
    const char *recv = gather(f, mine, (size_t)(B * n) * sizeof(scored_row), blk, "gather of row losses", &stride);
    free(mine);
    if (!recv) return;
    double s = 0;
    int64_t c = 0;
    for (int64_t b = 0; b < B; b++) /* one process's row order: sequence b, then its positions in rank order */
        for (int32_t q = 0; q < f->cp_world; q++) {
            int64_t oq, nq;
            ds4_cp_range(f->cp_S0, f->cp_mtp, f->cp_world, q, &oq, &nq);
            const scored_row *rq = (const scored_row *)(const void *)(recv + (size_t)q * stride) + b * nq;
            for (int64_t i = 0; i < nq; i++)
                if (rq[i].tgt != -100) {
                    s += rq[i].nll;
                    c++;
                }
        }
    *sum = s;
    *cnt = c;
}
