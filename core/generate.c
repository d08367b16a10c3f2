/* generate.c — generation on ds4_model_step (ds4_gen.h): the continuous batcher, and ds4_generate over it.
 *
 * A task is one ds4_gen_args (its prompts, n samples each, its sampling, seed and stops). Each prompt of a task
 * is a group of n sequences, admitted together when the batcher has room for n more sequences (FIFO over groups;
 * a group larger than the batcher is admitted when nothing else runs). Every step of the batcher appends to every
 * admitted sequence at once: one token per decoding sequence, and a piece of at most prefill_chunk prompt tokens
 * (over all prefilling groups) for the prompts still being read; it runs as ds4_model_step calls of at most
 * max_seqs sequences. When a prompt's last token has run, its cache is copied to the group's other samples and
 * every sample draws its first token from the same logits. A group leaves as soon as its n sequences have
 * finished (its caches are freed and its room goes to the next group), a task when all its groups have.
 *
 * Why results do not depend on what shares a step: ds4_model_step is batch invariant (a sequence's rows come out
 * the same bits whatever else is in the step, whatever the chunking), and a sequence's draws use the
 * counter-based uniform (task seed, stream = prompt << 32 | sample, step = tokens generated so far). So a task's
 * result equals ds4_generate of its arguments alone, bit for bit, whatever other tasks run beside it, whenever it
 * was admitted and whatever max_seqs / prefill_chunk are.
 *
 * The logits of a step stay in backend memory; the draws of the step (one per sequence that takes a token) run
 * as one sampling operation per distinct sampling setting there, and only the ids and log-probabilities come back
 * to the host. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "model.h"
#include "sched.h"

typedef struct gseq {
    ds4_cache *cache;
    int64_t cap;                    /* room in ids / logprobs / sample_logprobs */
    int64_t rows_cap;               /* room in experts / index_picks, in token rows */
    char *text;                     /* decoded output so far (stop strings only) */
    size_t text_len, text_cap;
} gseq;

struct btask;

/* One prompt of a task: its n sequences, admitted together. */
typedef struct bgroup {
    struct btask *t;
    int64_t p;                      /* prompt index in the task */
    int64_t fed;                    /* prompt tokens run so far */
    int64_t live;                   /* sequences not finished (admitted groups) */
    enum { G_QUEUED, G_PREFILL, G_DECODE, G_DONE } state;
} bgroup;

/* One submitted ds4_gen_args, with copies of everything it points at. */
typedef struct btask {
    uint64_t tag;
    int64_t nseq;
    ds4_gen_args a;                 /* prompts, prompt_lens, stop_ids, stop_strings point into the copies below */
    int64_t *ids_copy, *lens_copy, *stop_copy;
    char **strs_copy;
    size_t max_stop;                /* longest stop string */
    ds4_gen_result *r;
    gseq *gs;                       /* [nseq] */
    bgroup *groups;                 /* [nprompts] */
    int64_t next_group;             /* the first group not yet admitted */
    int64_t groups_left;            /* groups not done */
    int cancelled;
    int prefilled_this_step, ran_this_step;
    ds4_status st;                  /* a failed step's code: the task ended without a result */
    struct btask *next;
} btask;

/* One item of a step: a decoding sequence (count 1) or a piece of a group's prompt. */
typedef struct bitem {
    btask *t;
    int64_t seq;                    /* sequence index in the task (a prompt piece: the group's first) */
    bgroup *g;                      /* a prompt piece: its group; a decode row: NULL */
    int64_t count;
} bitem;

/* The draws of one model step: sequence, logits row and uniform of each (host), the same in backend memory with
 * the step's logits, and the results. */
typedef struct draws {
    int64_t n, cap;
    btask **task;                   /* [cap] host */
    int64_t *seq;
    int32_t *row;
    double *u;
    int64_t *id;                    /* results, host */
    double *lpm, *lps;
    void *mem;                      /* backend: row, u, id, lpm, lps [cap] */
    int32_t *b_row;
    double *b_u, *b_lpm, *b_lps;
    int64_t *b_id;
} draws;

struct ds4_batcher {
    ds4_model *m;
    ds4_dev *dev;                   /* the model's backend at creation, retained: it holds the buffers below */
    int64_t max_seqs, chunk;
    int64_t V, L, K, ncsa, topk;
    btask *head, *tail;             /* unfinished tasks, in submission order */
    btask *done_head, *done_tail;   /* finished tasks not yet taken */
    int64_t alive;                  /* sequences of admitted groups that are not done */
    int64_t nqueued, nrunning, ndone;
    int64_t steps, prefill_tokens, decode_tokens;
    /* step scratch */
    bitem *items;                   /* [icap] */
    int64_t icap;
    int64_t *ids, *counts;          /* [chunk + max_seqs], [max_seqs] */
    ds4_cache **caches;             /* [max_seqs] */
    int32_t *ex, *ix;               /* [chunk + max_seqs, L, K], [.., n_csa, topk] when a task records them */
    int64_t rec_rows;               /* rows ex / ix hold (0: not allocated yet) */
    float *b_logits;                /* backend [max_seqs, V] */
    draws d;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static ds4_status check_args(const ds4_model *m, const ds4_gen_args *a, ds4_error *err) {
    if (!m || !a) return ds4_fail(err, DS4_ERR_ARG, "generate: model or args is NULL");
    if (a->nprompts < 1 || a->nprompts > (1 << 20) || a->n < 1 || a->n > (1 << 16) ||
        a->nprompts * (int64_t)a->n > (1 << 20))
        return ds4_fail(err, DS4_ERR_ARG, "generate: %lld prompts × n = %d samples outside [1, 2^20]",
                        (long long)a->nprompts, (int)a->n);
    if (!a->prompts || !a->prompt_lens) return ds4_fail(err, DS4_ERR_ARG, "generate: prompts or prompt_lens is NULL");
    if (a->max_new_tokens < 1 || a->max_new_tokens > ((int64_t)1 << 28))
        return ds4_fail(err, DS4_ERR_ARG, "generate: max_new_tokens %lld outside [1, 2^28]", (long long)a->max_new_tokens);
    const int64_t V = m->cfg.vocab_size;
    for (int64_t p = 0; p < a->nprompts; p++) {
        if (!a->prompts[p] || a->prompt_lens[p] < 1 || a->prompt_lens[p] > ((int64_t)1 << 28))
            return ds4_fail(err, DS4_ERR_ARG, "generate: prompt %lld is empty or longer than 2^28 tokens (length %lld)",
                            (long long)p, (long long)a->prompt_lens[p]);
        for (int64_t i = 0; i < a->prompt_lens[p]; i++)
            if (a->prompts[p][i] < 0 || a->prompts[p][i] >= V)
                return ds4_fail(err, DS4_ERR_ARG, "generate: prompt %lld token %lld = %lld outside the vocabulary [0, %lld)",
                                (long long)p, (long long)i, (long long)a->prompts[p][i], (long long)V);
    }
    const ds4_sampling *s = &a->sampling;
    if (!(s->temperature >= 0) || s->temperature > 1e30 || s->top_k < 0 || !(s->top_p >= 0 && s->top_p <= 1) ||
        !(s->min_p >= 0 && s->min_p <= 1))
        return ds4_fail(err, DS4_ERR_ARG,
                        "generate: sampling temperature %g (>= 0), top_k %lld (>= 0), top_p %g (in [0, 1]), min_p %g (in [0, 1])",
                        s->temperature, (long long)s->top_k, s->top_p, s->min_p);
    if (a->n_stop_ids < 0 || (a->n_stop_ids > 0 && !a->stop_ids))
        return ds4_fail(err, DS4_ERR_ARG, "generate: %lld stop ids but no array", (long long)a->n_stop_ids);
    if (a->n_stop_strings < 0 || (a->n_stop_strings > 0 && !a->stop_strings))
        return ds4_fail(err, DS4_ERR_ARG, "generate: %lld stop strings but no array", (long long)a->n_stop_strings);
    if (a->n_stop_strings > 0 && !a->tokenizer)
        return ds4_fail(err, DS4_ERR_ARG, "generate: stop strings need a tokenizer to decode the output");
    for (int64_t i = 0; i < a->n_stop_strings; i++)
        if (!a->stop_strings[i] || !a->stop_strings[i][0])
            return ds4_fail(err, DS4_ERR_ARG, "generate: stop string %lld is NULL or empty", (long long)i);
    if (a->max_batch < 0 || a->prefill_chunk < 0)
        return ds4_fail(err, DS4_ERR_ARG, "generate: max_batch %lld and prefill_chunk %lld must be >= 0",
                        (long long)a->max_batch, (long long)a->prefill_chunk);
    return DS4_OK;
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return 1;
    int64_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return 0;
    *p = q;
    *cap = n;
    return 1;
}

/* Room for n_ids + 1 generated tokens of sequence i of task t. */
static ds4_status reserve_token(btask *t, int64_t i, ds4_error *err) {
    ds4_gen_seq *s = &t->r->seqs[i];
    gseq *q = &t->gs[i];
    const int64_t need = s->n_ids + 1;
    if (need > q->cap) {
        int64_t c1 = q->cap, c2 = q->cap, c3 = q->cap;
        if (!grow((void **)&s->ids, &c1, need, sizeof *s->ids) || !grow((void **)&s->logprobs, &c2, need, sizeof(float)) ||
            !grow((void **)&s->sample_logprobs, &c3, need, sizeof(float)))
            return ds4_fail(err, DS4_ERR_OOM, "generate: output of sequence %lld (%lld tokens)", (long long)i, (long long)need);
        q->cap = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    }
    return DS4_OK;
}

/* Routing rows for tokens [0, rows) of sequence i of task t. */
static ds4_status reserve_rows(const ds4_batcher *b, btask *t, int64_t i, int64_t rows, ds4_error *err) {
    ds4_gen_seq *s = &t->r->seqs[i];
    gseq *q = &t->gs[i];
    if (rows <= q->rows_cap) return DS4_OK;
    const int rec_ix = t->a.record_index && b->ncsa > 0;
    int64_t c1 = q->rows_cap, c2 = q->rows_cap;
    int ok = 1;
    if (t->a.record_experts) ok = grow((void **)&s->experts, &c1, rows, (size_t)(b->L * b->K) * sizeof(int32_t));
    if (ok && rec_ix) ok = grow((void **)&s->index_picks, &c2, rows, (size_t)(b->ncsa * b->topk) * sizeof(int32_t));
    if (!ok) return ds4_fail(err, DS4_ERR_OOM, "generate: routing record of sequence %lld (%lld tokens)", (long long)i, (long long)rows);
    q->rows_cap = t->a.record_experts ? c1 : c2;
    if (t->a.record_experts && rec_ix) q->rows_cap = c1 < c2 ? c1 : c2;
    return DS4_OK;
}

/* Store the routing of `count` rows of a step (from step row r0) as sequence i's token rows [at, at + count). */
static ds4_status keep_rows(const ds4_batcher *b, btask *t, int64_t i, int64_t at, int64_t count, const int32_t *ex,
                            const int32_t *ix, int64_t r0, ds4_error *err) {
    if (!t->a.record_experts && !t->a.record_index) return DS4_OK;
    ds4_status st = reserve_rows(b, t, i, at + count, err);
    if (st) return st;
    ds4_gen_seq *s = &t->r->seqs[i];
    const int64_t we = b->L * b->K, wi = b->ncsa * b->topk;
    if (t->a.record_experts) memcpy(s->experts + at * we, ex + r0 * we, (size_t)(count * we) * sizeof(int32_t));
    if (t->a.record_index && wi) memcpy(s->index_picks + at * wi, ix + r0 * wi, (size_t)(count * wi) * sizeof(int32_t));
    return DS4_OK;
}

static int64_t find_bytes(const char *hay, size_t n, const char *needle, size_t k) {
    if (k == 0 || k > n) return -1;
    for (size_t i = 0; i + k <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, k) == 0) return (int64_t)i;
    return -1;
}

/* Record sequence i's next token (drawn with log-probabilities lpm / lps) and decide whether the sequence stops. */
static ds4_status record(const ds4_batcher *b, btask *t, int64_t i, int64_t id, double lpm, double lps, ds4_error *err) {
    const ds4_gen_args *a = &t->a;
    ds4_gen_seq *s = &t->r->seqs[i];
    gseq *q = &t->gs[i];
    ds4_status st = reserve_token(t, i, err);
    if (st) return st;
    s->ids[s->n_ids] = id;
    s->logprobs[s->n_ids] = (float)lpm;
    s->sample_logprobs[s->n_ids] = (float)lps;
    s->n_ids++;
    if (id == b->m->cfg.eos_token_id && !a->ignore_eos) s->finish = DS4_FINISH_EOS;
    for (int64_t k = 0; k < a->n_stop_ids && !s->finish; k++)
        if (a->stop_ids[k] == id) {
            s->finish = DS4_FINISH_STOP_TOKEN;
            s->stop_index = k;
        }
    if (a->n_stop_strings > 0 && !s->finish) {
        size_t nb = 0;
        const char *bytes = ds4_tokenizer_id_bytes(a->tokenizer, (int32_t)id, &nb);
        if (bytes && nb) {
            int64_t need = (int64_t)(q->text_len + nb), cap = (int64_t)q->text_cap;
            if (!grow((void **)&q->text, &cap, need, 1))
                return ds4_fail(err, DS4_ERR_OOM, "generate: decoded text of sequence %lld", (long long)i);
            q->text_cap = (size_t)cap;
            memcpy(q->text + q->text_len, bytes, nb);
            /* only a match that ends in the new bytes is new */
            const size_t from = q->text_len + 1 > t->max_stop ? q->text_len + 1 - t->max_stop : 0;
            q->text_len += nb;
            for (int64_t k = 0; k < a->n_stop_strings && !s->finish; k++)
                if (find_bytes(q->text + from, q->text_len - from, a->stop_strings[k], strlen(a->stop_strings[k])) >= 0) {
                    s->finish = DS4_FINISH_STOP_STRING;
                    s->stop_index = k;
                }
        }
    }
    if (!s->finish && s->n_ids >= a->max_new_tokens) s->finish = DS4_FINISH_LENGTH;
    if (a->on_token && a->on_token(a->ud, i, id, lpm)) t->cancelled = 1;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ draws */

static ds4_status reserve_draws(ds4_batcher *b, int64_t need, ds4_error *err) {
    draws *d = &b->d;
    if (need <= d->cap) return DS4_OK;
    int64_t cap = d->cap ? d->cap : 64;
    while (cap < need) cap *= 2;
    const size_t per = sizeof(btask *) + 2 * sizeof(int64_t) + 3 * sizeof(double) + sizeof(int32_t);
    void *host = realloc(d->task, (size_t)cap * per);
    if (!host) return ds4_fail(err, DS4_ERR_OOM, "generate: draw buffers for %lld draws", (long long)cap);
    d->task = host;
    d->seq = (int64_t *)(void *)(d->task + cap);
    d->id = d->seq + cap;
    d->u = (double *)(d->id + cap);
    d->lpm = d->u + cap;
    d->lps = d->lpm + cap;
    d->row = (int32_t *)(d->lps + cap);
    ds4_dev *dev = b->dev;
    if (d->mem) dev->ops->free(dev, d->mem);
    d->mem = NULL;
    d->cap = 0;
    ds4_status st = dev->ops->alloc(dev, (size_t)cap * (sizeof(int64_t) + 3 * sizeof(double) + sizeof(int32_t)), &d->mem, err);
    if (st) return st;
    d->b_id = d->mem;
    d->b_u = (double *)(d->b_id + cap);
    d->b_lpm = d->b_u + cap;
    d->b_lps = d->b_lpm + cap;
    d->b_row = (int32_t *)(d->b_lps + cap);
    d->cap = cap;
    return DS4_OK;
}

/* Queue a draw of sequence i of task t's next token from row `row` of the step's logits. */
static void queue_draw(ds4_batcher *b, btask *t, int64_t i, int64_t row) {
    const ds4_gen_seq *s = &t->r->seqs[i];
    const uint64_t stream = ((uint64_t)(t->a.prompt_base + s->prompt_index) << 32) | (uint64_t)s->sample_index;
    draws *d = &b->d;
    d->task[d->n] = t;
    d->seq[d->n] = i;
    d->row[d->n] = (int32_t)row;
    d->u[d->n] = ds4_sample_uniform(t->a.seed, stream, (uint64_t)s->n_ids);
    d->n++;
}

static int same_sampling(const ds4_sampling *x, const ds4_sampling *y) {
    return x->temperature == y->temperature && x->top_k == y->top_k && x->top_p == y->top_p && x->min_p == y->min_p;
}

static void swap_draws(draws *d, int64_t i, int64_t j) {
#define SWAP(T, arr)                                                                                                   \
    do {                                                                                                               \
        T tmp = d->arr[i];                                                                                             \
        d->arr[i] = d->arr[j];                                                                                         \
        d->arr[j] = tmp;                                                                                               \
    } while (0)
    SWAP(btask *, task);
    SWAP(int64_t, seq);
    SWAP(int32_t, row);
    SWAP(double, u);
#undef SWAP
}

/* Draws [lo, hi) with one sampling setting, as one backend operation. */
static ds4_status run_range(ds4_batcher *b, int64_t lo, int64_t hi, ds4_error *err) {
    draws *d = &b->d;
    const int64_t n = hi - lo;
    ds4_dev *dev = b->dev;
    const int32_t *row = ds4_dev_input(dev, d->b_row + lo, d->row + lo, (size_t)n * sizeof *d->row);
    const double *u = ds4_dev_input(dev, d->b_u + lo, d->u + lo, (size_t)n * sizeof *d->u);
    int64_t *id = dev->host_visible ? d->id + lo : d->b_id + lo;
    double *lpm = dev->host_visible ? d->lpm + lo : d->b_lpm + lo, *lps = dev->host_visible ? d->lps + lo : d->b_lps + lo;
    OP(dev, sample, .logits = b->b_logits, .lrow = row, .rows = n, .V = b->V, .p = d->task[lo]->a.sampling, .u = u,
       .id = id, .lp_model = lpm, .lp_sample = lps, .exp32 = b->m->dw->bf16_in); /* as the step's pass (plan.c) */
    if (!dev->host_visible) {
        ds4_dev_download(dev, d->id + lo, id, (size_t)n * sizeof *id);
        ds4_dev_download(dev, d->lpm + lo, lpm, (size_t)n * sizeof *lpm);
        ds4_dev_download(dev, d->lps + lo, lps, (size_t)n * sizeof *lps);
    }
    return ds4_dev_check(dev, "generate", err);
}

/* Run the queued draws, grouped by sampling setting (stable), and record them in that order. */
static ds4_status run_draws(ds4_batcher *b, ds4_error *err) {
    draws *d = &b->d;
    const int64_t n = d->n;
    d->n = 0;
    ds4_status st = DS4_OK;
    for (int64_t lo = 0; lo < n && !st;) {
        int64_t hi = lo + 1;
        for (int64_t j = lo + 1; j < n; j++)
            if (same_sampling(&d->task[j]->a.sampling, &d->task[lo]->a.sampling)) {
                for (int64_t k = j; k > hi; k--) swap_draws(d, k, k - 1); /* keeps the others in order */
                hi++;
            }
        st = run_range(b, lo, hi, err);
        lo = hi;
    }
    for (int64_t r = 0; r < n && !st; r++) st = record(b, d->task[r], d->seq[r], d->id[r], d->lpm[r], d->lps[r], err);
    return st;
}

/* ------------------------------------------------------------------------------------------------ tasks */

static void free_task(btask *t) {
    if (!t) return;
    for (int64_t i = 0; t->gs && i < t->nseq; i++) {
        ds4_cache_free(t->gs[i].cache);
        free(t->gs[i].text);
    }
    free(t->gs);
    free(t->groups);
    ds4_gen_result_free(t->r);
    free(t->ids_copy);
    free(t->lens_copy);
    free(t->stop_copy);
    free(t->strs_copy);
    free(t);
}

/* A copy of a's arrays, so that the caller may free them after ds4_batcher_submit. */
static ds4_status copy_task_args(btask *t, const ds4_gen_args *a, ds4_error *err) {
    t->a = *a;
    int64_t total = 0;
    for (int64_t p = 0; p < a->nprompts; p++) total += a->prompt_lens[p];
    size_t sbytes = 0;
    for (int64_t k = 0; k < a->n_stop_strings; k++) {
        sbytes += strlen(a->stop_strings[k]) + 1;
        if (strlen(a->stop_strings[k]) > t->max_stop) t->max_stop = strlen(a->stop_strings[k]);
    }
    t->ids_copy = malloc((size_t)total * sizeof(int64_t));
    t->lens_copy = malloc((size_t)a->nprompts * (sizeof(int64_t) + sizeof(int64_t *)));
    t->stop_copy = malloc((size_t)(a->n_stop_ids + 1) * sizeof(int64_t));
    t->strs_copy = malloc((size_t)(a->n_stop_strings + 1) * sizeof(char *) + sbytes);
    if (!t->ids_copy || !t->lens_copy || !t->stop_copy || !t->strs_copy)
        return ds4_fail(err, DS4_ERR_OOM, "generate: copies of %lld prompt tokens", (long long)total);
    const int64_t **prompts = (const int64_t **)(void *)(t->lens_copy + a->nprompts);
    for (int64_t p = 0, off = 0; p < a->nprompts; p++) {
        memcpy(t->ids_copy + off, a->prompts[p], (size_t)a->prompt_lens[p] * sizeof(int64_t));
        prompts[p] = t->ids_copy + off;
        t->lens_copy[p] = a->prompt_lens[p];
        off += a->prompt_lens[p];
    }
    if (a->n_stop_ids) memcpy(t->stop_copy, a->stop_ids, (size_t)a->n_stop_ids * sizeof(int64_t));
    char *sb = (char *)(t->strs_copy + a->n_stop_strings + 1);
    for (int64_t k = 0; k < a->n_stop_strings; k++) {
        const size_t len = strlen(a->stop_strings[k]) + 1;
        memcpy(sb, a->stop_strings[k], len);
        t->strs_copy[k] = sb;
        sb += len;
    }
    t->a.prompts = prompts;
    t->a.prompt_lens = t->lens_copy;
    t->a.stop_ids = a->n_stop_ids ? t->stop_copy : NULL;
    t->a.stop_strings = a->n_stop_strings ? (const char *const *)t->strs_copy : NULL;
    return DS4_OK;
}

/* Group g leaves: its caches are freed (its sequences' routing rows are complete) and its room is given back. */
static ds4_status finish_group(ds4_batcher *b, bgroup *g, ds4_error *err) {
    btask *t = g->t;
    const int64_t n = t->a.n, first = g->p * n;
    ds4_status st = DS4_OK;
    for (int64_t j = first; j < first + n; j++) {
        ds4_gen_seq *s = &t->r->seqs[j];
        if (!s->finish) s->finish = DS4_FINISH_CANCELLED;
        s->n_rows = t->gs[j].cache ? ds4_cache_len(t->gs[j].cache) : 0;
        if (!st && (t->a.record_experts || (t->a.record_index && b->ncsa)))
            st = reserve_rows(b, t, j, s->n_rows > 0 ? s->n_rows : 1, err);
        ds4_cache_free(t->gs[j].cache);
        t->gs[j].cache = NULL;
    }
    if (g->state != G_QUEUED) b->alive -= g->live;
    g->live = 0;
    g->state = G_DONE;
    t->groups_left--;
    return st;
}

/* Move a task whose groups are all done from the running list to the finished list. */
static void retire(ds4_batcher *b, btask *t) {
    btask **pp = &b->head, *prev = NULL;
    while (*pp && *pp != t) prev = *pp, pp = &(*pp)->next;
    if (!*pp) return;
    *pp = t->next;
    if (b->tail == t) b->tail = prev;
    if (t->next_group > 0) b->nrunning--;
    else b->nqueued--;
    t->next = NULL;
    if (b->done_tail) b->done_tail->next = t;
    else b->done_head = t;
    b->done_tail = t;
    b->ndone++;
}

/* End every group of t that is still queued or running (cancel, or a failed step). */
static ds4_status end_task(ds4_batcher *b, btask *t, ds4_error *err) {
    ds4_status st = DS4_OK;
    for (int64_t p = 0; p < t->a.nprompts; p++) {
        ds4_status s2 = t->groups[p].state == G_DONE ? DS4_OK : finish_group(b, &t->groups[p], err);
        if (!st) st = s2;
    }
    retire(b, t);
    return st;
}

/* Admit queued groups, in submission order, while they fit (a group larger than max_seqs when nothing runs). */
static ds4_status admit(ds4_batcher *b, ds4_error *err) {
    for (btask *t = b->head; t; t = t->next) {
        while (t->next_group < t->a.nprompts) {
            const int64_t n = t->a.n;
            if (b->alive > 0 && b->alive + n > b->max_seqs) return DS4_OK;
            bgroup *g = &t->groups[t->next_group];
            const int64_t len = t->a.prompt_lens[g->p];
            for (int64_t j = g->p * n; j < (g->p + 1) * n; j++) {
                /* the last generated token never runs through the model */
                ds4_status st = ds4_cache_create(b->m, len + t->a.max_new_tokens - 1, &t->gs[j].cache, err);
                if (st) {
                    for (int64_t k = g->p * n; k < j; k++) ds4_cache_free(t->gs[k].cache), t->gs[k].cache = NULL;
                    return st;
                }
            }
            if (t->next_group == 0) b->nqueued--, b->nrunning++;
            t->next_group++;
            g->state = G_PREFILL;
            g->live = n;
            b->alive += n;
        }
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ steps */

/* The work of one batcher step: every decoding sequence, and prompt pieces of at most chunk tokens in all. */
static ds4_status plan_items(ds4_batcher *b, int64_t *nitems, ds4_error *err) {
    int64_t n = 0, budget = b->chunk;
    for (btask *t = b->head; t; t = t->next)
        for (int64_t p = 0; p < t->next_group; p++) {
            bgroup *g = &t->groups[p];
            if (g->state == G_DECODE) {
                for (int64_t j = p * t->a.n; j < (p + 1) * t->a.n; j++) {
                    if (t->r->seqs[j].finish) continue;
                    if (!grow((void **)&b->items, &b->icap, n + 1, sizeof *b->items)) goto oom;
                    b->items[n++] = (bitem){.t = t, .seq = j, .g = NULL, .count = 1};
                }
            } else if (g->state == G_PREFILL && budget > 0) {
                const int64_t left = t->a.prompt_lens[p] - g->fed, take = left < budget ? left : budget;
                if (!grow((void **)&b->items, &b->icap, n + 1, sizeof *b->items)) goto oom;
                b->items[n++] = (bitem){.t = t, .seq = p * t->a.n, .g = g, .count = take};
                budget -= take;
            }
        }
    *nitems = n;
    return DS4_OK;
oom:
    return ds4_fail(err, DS4_ERR_OOM, "generate: the work list of a step (%lld items)", (long long)n + 1);
}

/* Routing-record rows for steps of up to `rows` tokens, when a running task records them. */
static ds4_status reserve_records(ds4_batcher *b, int64_t rows, ds4_error *err) {
    if (rows <= b->rec_rows) return DS4_OK;
    int32_t *ex = realloc(b->ex, (size_t)(rows * b->L * b->K) * sizeof *ex);
    if (ex) b->ex = ex;
    int32_t *ix = b->ncsa ? realloc(b->ix, (size_t)(rows * b->ncsa * b->topk) * sizeof *ix) : NULL;
    if (ix) b->ix = ix;
    if (!ex || (b->ncsa && !ix)) return ds4_fail(err, DS4_ERR_OOM, "generate: routing records of %lld rows", (long long)rows);
    b->rec_rows = rows;
    return DS4_OK;
}

/* One ds4_model_step over items [lo, hi) (at most max_seqs sequences), then their draws. */
static ds4_status run_items(ds4_batcher *b, int64_t lo, int64_t hi, int record, ds4_error *err) {
    int64_t ns = 0, nt = 0, ndraw = 0;
    for (int64_t k = lo; k < hi; k++) {
        const bitem *it = &b->items[k];
        btask *t = it->t;
        memcpy(b->ids + nt, it->g ? t->a.prompts[it->g->p] + it->g->fed : &t->r->seqs[it->seq].ids[t->r->seqs[it->seq].n_ids - 1],
               (size_t)it->count * sizeof(int64_t));
        b->caches[ns] = t->gs[it->seq].cache;
        b->counts[ns++] = it->count;
        nt += it->count;
        ndraw += it->g ? t->a.n : 1;
    }
    ds4_status st = reserve_draws(b, ndraw, err);
    if (!st && record) st = reserve_records(b, nt, err);
    if (st) return st;
    ds4_step_args sa = {.nseq = ns, .caches = b->caches, .counts = b->counts, .ids = b->ids,
                        .experts = record ? b->ex : NULL, .index_picks = record && b->ncsa ? b->ix : NULL};
    if ((st = ds4_step_run(b->m, &sa, b->b_logits, err))) return st;
    b->steps++;
    for (int64_t k = lo, r0 = 0; k < hi; r0 += b->items[k].count, k++) {
        const bitem *it = &b->items[k];
        btask *t = it->t;
        const int64_t len = ds4_cache_len(t->gs[it->seq].cache), row = k - lo;
        t->ran_this_step = 1;
        if ((st = keep_rows(b, t, it->seq, len - it->count, it->count, b->ex, b->ix, r0, err))) return st;
        if (!it->g) {
            t->r->decode_tokens++;
            b->decode_tokens++;
            queue_draw(b, t, it->seq, row);
            continue;
        }
        bgroup *g = it->g;
        g->fed += it->count;
        t->r->prefill_tokens += it->count;
        b->prefill_tokens += it->count;
        t->prefilled_this_step = 1;
        if (g->fed < t->a.prompt_lens[g->p]) continue; /* the prompt goes on in the next step */
        const int64_t first = it->seq;
        for (int64_t j = first + 1; j < first + t->a.n; j++) {
            if ((st = ds4_cache_copy(t->gs[j].cache, t->gs[first].cache, err))) return st;
            const ds4_gen_seq *src = &t->r->seqs[first];
            if ((src->experts || src->index_picks) && (st = keep_rows(b, t, j, 0, len, src->experts, src->index_picks, 0, err)))
                return st;
        }
        g->state = G_DECODE;
        for (int64_t j = first; j < first + t->a.n; j++) queue_draw(b, t, j, row);
    }
    return run_draws(b, err);
}

/* After draws: groups whose sequences have all finished leave; tasks that are done (or cancelled) retire. */
static ds4_status sweep(ds4_batcher *b, ds4_error *err) {
    ds4_status st = DS4_OK;
    for (btask *t = b->head, *next; t; t = next) {
        next = t->next;
        if (t->a.cancel && *t->a.cancel) t->cancelled = 1;
        if (t->cancelled) {
            ds4_status s2 = end_task(b, t, err);
            if (!st) st = s2;
            continue;
        }
        for (int64_t p = 0; p < t->next_group; p++) {
            bgroup *g = &t->groups[p];
            if (g->state != G_DECODE) continue;
            int64_t live = 0;
            for (int64_t j = p * t->a.n; j < (p + 1) * t->a.n; j++) live += !t->r->seqs[j].finish;
            b->alive -= g->live - live;
            g->live = live;
            if (live == 0) {
                ds4_status s2 = finish_group(b, g, err);
                if (!st) st = s2;
            }
        }
        if (t->groups_left == 0) retire(b, t);
    }
    return st;
}

/* A failed step: every admitted task ends without a result, carrying the step's code. */
static void fail_running(ds4_batcher *b, ds4_status code) {
    ds4_error ignore = {0};
    for (btask *t = b->head, *next; t; t = next) {
        next = t->next;
        if (t->next_group == 0) continue;
        t->st = code;
        end_task(b, t, &ignore);
    }
}

ds4_status ds4_batcher_step(ds4_batcher *b, ds4_error *err) {
    if (!b) return ds4_fail(err, DS4_ERR_ARG, "batcher step: batcher is NULL");
    if (b->m->dev != b->dev)
        return ds4_fail(err, DS4_ERR_ARG, "batcher step: the model moved to the %s backend after the batcher was made on %s "
                        "(make the batcher after moving the model)", b->m->dev->ops->name, b->dev->ops->name);
    const double t0 = now_s();
    ds4_status st = sweep(b, err); /* cancellations since the last step */
    if (!st) st = admit(b, err);
    int64_t nitems = 0;
    if (!st) st = plan_items(b, &nitems, err);
    for (btask *t = b->head; t; t = t->next) t->prefilled_this_step = t->ran_this_step = 0;
    int record = 0;
    for (btask *t = b->head; t && !record; t = t->next) record = t->next_group > 0 && (t->a.record_experts || t->a.record_index);
    /* model steps of at most max_seqs sequences; items of a task cancelled by on_token meanwhile are dropped */
    for (int64_t lo = 0; lo < nitems && !st;) {
        int64_t hi = lo, keep = lo;
        while (hi < nitems && keep - lo < b->max_seqs) {
            btask *t = b->items[hi].t;
            if (!t->cancelled && !(t->a.cancel && *t->a.cancel)) b->items[keep++] = b->items[hi];
            hi++;
        }
        if (keep > lo) st = run_items(b, lo, keep, record, err);
        lo = hi;
    }
    const double dt = now_s() - t0;
    for (btask *t = b->head; t; t = t->next) {
        if (t->prefilled_this_step) t->r->prefill_seconds += dt;
        else if (t->ran_this_step) t->r->decode_seconds += dt;
    }
    if (!st) st = sweep(b, err);
    if (st) fail_running(b, st);
    return st;
}

/* ------------------------------------------------------------------------------------------------ API */

ds4_status ds4_batcher_create(ds4_model *m, const ds4_batcher_options *o, ds4_batcher **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "batcher: out is NULL");
    *out = NULL;
    if (!m || !o) return ds4_fail(err, DS4_ERR_ARG, "batcher: model or options is NULL");
    if (o->max_seqs < 1 || o->max_seqs > (1 << 20) || o->prefill_chunk < 0 || o->prefill_chunk > (1 << 24))
        return ds4_fail(err, DS4_ERR_ARG, "batcher: max_seqs %lld outside [1, 2^20] or prefill_chunk %lld outside [0, 2^24]",
                        (long long)o->max_seqs, (long long)o->prefill_chunk);
    ds4_batcher *b = calloc(1, sizeof *b);
    if (!b) return ds4_fail(err, DS4_ERR_OOM, "batcher: state");
    const ds4_config *c = &m->cfg;
    b->m = m;
    b->dev = m->dev;
    ds4_dev_retain(b->dev);
    b->max_seqs = o->max_seqs;
    b->chunk = o->prefill_chunk > 0 ? o->prefill_chunk : 2048;
    b->V = c->vocab_size;
    b->L = c->num_hidden_layers;
    b->K = c->num_experts_per_tok;
    b->ncsa = ds4_model_csa_layers(m);
    b->topk = c->index_topk;
    /* a step holds at most max_seqs sequences: chunk prompt tokens and one token of every other sequence */
    b->ids = malloc((size_t)(b->chunk + b->max_seqs) * sizeof *b->ids);
    b->counts = malloc((size_t)b->max_seqs * sizeof *b->counts);
    b->caches = malloc((size_t)b->max_seqs * sizeof *b->caches);
    ds4_status st = DS4_OK;
    if (!b->ids || !b->counts || !b->caches) st = ds4_fail(err, DS4_ERR_OOM, "batcher: step buffers for %lld sequences", (long long)b->max_seqs);
    if (!st && (st = b->dev->ops->alloc(b->dev, (size_t)(b->max_seqs * b->V) * sizeof(float), (void **)&b->b_logits, err)))
        ds4_error_prefix(err, "batcher: logits of %lld sequences (vocabulary %lld): ", (long long)b->max_seqs, (long long)b->V);
    if (!st) st = reserve_draws(b, b->max_seqs, err);
    if (st) {
        ds4_batcher_free(b);
        return st;
    }
    *out = b;
    return DS4_OK;
}

ds4_status ds4_batcher_submit(ds4_batcher *b, const ds4_gen_args *a, uint64_t tag, ds4_error *err) {
    if (!b) return ds4_fail(err, DS4_ERR_ARG, "batcher submit: batcher is NULL");
    ds4_status st = check_args(b->m, a, err);
    if (st) return st;
    btask *t = calloc(1, sizeof *t);
    if (!t) return ds4_fail(err, DS4_ERR_OOM, "batcher submit: task");
    t->tag = tag;
    const int64_t nseq = a->nprompts * a->n;
    t->nseq = nseq;
    if ((st = copy_task_args(t, a, err))) goto fail;
    t->r = calloc(1, sizeof *t->r);
    if (t->r) {
        t->r->nseq = nseq;
        t->r->seqs = calloc((size_t)nseq, sizeof *t->r->seqs);
    }
    t->gs = calloc((size_t)nseq, sizeof *t->gs);
    t->groups = calloc((size_t)a->nprompts, sizeof *t->groups);
    if (!t->r || !t->r->seqs || !t->gs || !t->groups) {
        st = ds4_fail(err, DS4_ERR_OOM, "batcher submit: %lld sequences", (long long)nseq);
        goto fail;
    }
    for (int64_t i = 0; i < nseq; i++) {
        ds4_gen_seq *s = &t->r->seqs[i];
        s->prompt_index = i / a->n;
        s->sample_index = i % a->n;
        s->prompt_len = a->prompt_lens[s->prompt_index];
        s->stop_index = -1;
    }
    for (int64_t p = 0; p < a->nprompts; p++) t->groups[p] = (bgroup){.t = t, .p = p, .state = G_QUEUED};
    t->groups_left = a->nprompts;
    if (b->tail) b->tail->next = t;
    else b->head = t;
    b->tail = t;
    b->nqueued++;
    return DS4_OK;
fail:
    free_task(t);
    return st;
}

int ds4_batcher_take(ds4_batcher *b, uint64_t *tag, ds4_gen_result **res, ds4_status *st) {
    if (!b || !b->done_head) return 0;
    btask *t = b->done_head;
    b->done_head = t->next;
    if (!b->done_head) b->done_tail = NULL;
    b->ndone--;
    if (tag) *tag = t->tag;
    if (st) *st = t->st;
    if (res) {
        *res = t->st ? NULL : t->r;
        if (!t->st) t->r = NULL;
    }
    free_task(t);
    return 1;
}

int ds4_batcher_cancel(ds4_batcher *b, uint64_t tag) {
    if (!b) return 0;
    for (btask *t = b->head; t; t = t->next)
        if (t->tag == tag) {
            ds4_error ignore = {0};
            t->cancelled = 1;
            end_task(b, t, &ignore);
            return 1;
        }
    return 0;
}

const ds4_gen_result *ds4_batcher_peek(const ds4_batcher *b, uint64_t tag) {
    if (!b) return NULL;
    for (const btask *t = b->head; t; t = t->next)
        if (t->tag == tag) return t->r;
    return NULL;
}

void ds4_batcher_get_stats(const ds4_batcher *b, ds4_batcher_stats *s) {
    if (!s) return;
    memset(s, 0, sizeof *s);
    if (!b) return;
    s->queued = b->nqueued;
    s->running = b->nrunning;
    s->finished = b->ndone;
    s->seqs = b->alive;
    s->free_seqs = b->alive < b->max_seqs ? b->max_seqs - b->alive : 0;
    s->steps = b->steps;
    s->prefill_tokens = b->prefill_tokens;
    s->decode_tokens = b->decode_tokens;
}

void ds4_batcher_free(ds4_batcher *b) {
    if (!b) return;
    for (btask *t = b->head, *next; t; t = next) next = t->next, free_task(t);
    for (btask *t = b->done_head, *next; t; t = next) next = t->next, free_task(t);
    ds4_dev *dev = b->dev;
    if (b->b_logits) dev->ops->free(dev, b->b_logits);
    if (b->d.mem) dev->ops->free(dev, b->d.mem);
    ds4_dev_release(dev); /* the backend outlives the model while a batcher still holds it */
    free(b->d.task);
    free(b->items);
    free(b->ids);
    free(b->counts);
    free(b->caches);
    free(b->ex);
    free(b->ix);
    free(b);
}

/* ------------------------------------------------------------------------------------------------ generate */

ds4_status ds4_generate(ds4_model *m, const ds4_gen_args *a, ds4_gen_result **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "generate: out is NULL");
    *out = NULL;
    ds4_status st = check_args(m, a, err);
    if (st) return st;
    const int64_t nseq = a->nprompts * a->n;
    ds4_batcher_options o = {.max_seqs = a->max_batch > 0 && a->max_batch < nseq ? a->max_batch : nseq,
                             .prefill_chunk = a->prefill_chunk};
    ds4_batcher *b = NULL;
    if ((st = ds4_batcher_create(m, &o, &b, err))) return st;
    if (!(st = ds4_batcher_submit(b, a, 0, err)))
        while (b->head && !(st = ds4_batcher_step(b, err))) {}
    ds4_status task_st = DS4_OK;
    if (!st && !ds4_batcher_take(b, NULL, out, &task_st))
        st = ds4_fail(err, DS4_ERR_ARG, "generate: internal error: the batcher finished without the task");
    ds4_batcher_free(b);
    return st ? st : task_st;
}

void ds4_gen_result_free(ds4_gen_result *r) {
    if (!r) return;
    for (int64_t i = 0; r->seqs && i < r->nseq; i++) {
        free(r->seqs[i].ids);
        free(r->seqs[i].logprobs);
        free(r->seqs[i].sample_logprobs);
        free(r->seqs[i].experts);
        free(r->seqs[i].index_picks);
    }
    free(r->seqs);
    free(r);
}
