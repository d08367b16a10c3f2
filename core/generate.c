/* generate.c — batched generation on ds4_model_step (ds4_gen.h), on the model's backend.
 *
 * Prompts are prefilled in steps of at most prefill_chunk tokens (a prompt may span steps: any chunking gives the
 * same state). When a prompt's last token has run, its cache is copied to the prompt's other samples and every
 * sample draws its first token from the same logits. Then all running sequences decode one token per step, at
 * most max_batch per step. A sequence's draws use the counter-based uniform (seed, stream = prompt << 32 | sample,
 * step = tokens generated so far), so results do not depend on batching, chunking or max_batch.
 *
 * The logits of a step stay in backend memory; the draws of the step (one per sequence that takes a token) run as
 * one sampling operation there, and only the ids and log-probabilities come back to the host. */
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

/* The draws of one step: sequence, logits row and uniform of each (host), the same in backend memory with the
 * step's logits, and the results. */
typedef struct draws {
    int64_t n;
    int64_t *seq;                   /* [nseq] host */
    int32_t *row;
    double *u;
    int64_t *id;                    /* results, host */
    double *lpm, *lps;
    void *mem;                      /* backend: logits [rows, V], row, u, id, lpm, lps */
    float *b_logits;
    int32_t *b_row;
    double *b_u, *b_lpm, *b_lps;
    int64_t *b_id;
} draws;

typedef struct gen {
    ds4_model *m;
    const ds4_gen_args *a;
    ds4_gen_result *r;
    gseq *gs;
    int64_t V, L, K, ncsa, topk;
    size_t max_stop;                /* longest stop string */
    draws d;
    int cancelled;
} gen;

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

/* Room for n_ids + 1 generated tokens and their routing rows. */
static ds4_status reserve_token(gen *g, int64_t i, ds4_error *err) {
    ds4_gen_seq *s = &g->r->seqs[i];
    gseq *q = &g->gs[i];
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

/* Routing rows for tokens [0, rows) of sequence i. */
static ds4_status reserve_rows(gen *g, int64_t i, int64_t rows, ds4_error *err) {
    ds4_gen_seq *s = &g->r->seqs[i];
    gseq *q = &g->gs[i];
    if (rows <= q->rows_cap) return DS4_OK;
    int64_t c1 = q->rows_cap, c2 = q->rows_cap;
    int ok = 1;
    if (g->a->record_experts) ok = grow((void **)&s->experts, &c1, rows, (size_t)(g->L * g->K) * sizeof(int32_t));
    if (ok && g->a->record_index && g->ncsa > 0)
        ok = grow((void **)&s->index_picks, &c2, rows, (size_t)(g->ncsa * g->topk) * sizeof(int32_t));
    if (!ok) return ds4_fail(err, DS4_ERR_OOM, "generate: routing record of sequence %lld (%lld tokens)", (long long)i, (long long)rows);
    q->rows_cap = g->a->record_experts ? c1 : c2;
    if (g->a->record_experts && g->a->record_index && g->ncsa > 0) q->rows_cap = c1 < c2 ? c1 : c2;
    return DS4_OK;
}

/* Store the routing of `count` rows of a step (from step row r0) as sequence i's token rows [at, at + count). */
static ds4_status keep_rows(gen *g, int64_t i, int64_t at, int64_t count, const int32_t *ex, const int32_t *ix,
                            int64_t r0, ds4_error *err) {
    if (!g->a->record_experts && !g->a->record_index) return DS4_OK;
    ds4_status st = reserve_rows(g, i, at + count, err);
    if (st) return st;
    ds4_gen_seq *s = &g->r->seqs[i];
    const int64_t we = g->L * g->K, wi = g->ncsa * g->topk;
    if (ex) memcpy(s->experts + at * we, ex + r0 * we, (size_t)(count * we) * sizeof(int32_t));
    if (ix && wi) memcpy(s->index_picks + at * wi, ix + r0 * wi, (size_t)(count * wi) * sizeof(int32_t));
    return DS4_OK;
}

static int64_t find_bytes(const char *hay, size_t n, const char *needle, size_t k) {
    if (k == 0 || k > n) return -1;
    for (size_t i = 0; i + k <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, k) == 0) return (int64_t)i;
    return -1;
}

/* Record sequence i's next token (drawn with log-probabilities lpm / lps) and decide whether the sequence stops. */
static ds4_status record(gen *g, int64_t i, int64_t id, double lpm, double lps, ds4_error *err) {
    const ds4_gen_args *a = g->a;
    ds4_gen_seq *s = &g->r->seqs[i];
    gseq *q = &g->gs[i];
    ds4_status st = reserve_token(g, i, err);
    if (st) return st;
    s->ids[s->n_ids] = id;
    s->logprobs[s->n_ids] = (float)lpm;
    s->sample_logprobs[s->n_ids] = (float)lps;
    s->n_ids++;
    if (id == g->m->cfg.eos_token_id && !a->ignore_eos) s->finish = DS4_FINISH_EOS;
    for (int64_t k = 0; k < a->n_stop_ids && !s->finish; k++)
        if (a->stop_ids[k] == id) {
            s->finish = DS4_FINISH_STOP_TOKEN;
            s->stop_index = k;
        }
    if (a->n_stop_strings > 0 && !s->finish) {
        size_t nb = 0;
        const char *b = ds4_tokenizer_id_bytes(a->tokenizer, (int32_t)id, &nb);
        if (b && nb) {
            int64_t need = (int64_t)(q->text_len + nb), cap = (int64_t)q->text_cap;
            if (!grow((void **)&q->text, &cap, need, 1))
                return ds4_fail(err, DS4_ERR_OOM, "generate: decoded text of sequence %lld", (long long)i);
            q->text_cap = (size_t)cap;
            memcpy(q->text + q->text_len, b, nb);
            /* only a match that ends in the new bytes is new */
            const size_t from = q->text_len + 1 > g->max_stop ? q->text_len + 1 - g->max_stop : 0;
            q->text_len += nb;
            for (int64_t k = 0; k < a->n_stop_strings && !s->finish; k++)
                if (find_bytes(q->text + from, q->text_len - from, a->stop_strings[k], strlen(a->stop_strings[k])) >= 0) {
                    s->finish = DS4_FINISH_STOP_STRING;
                    s->stop_index = k;
                }
        }
    }
    if (!s->finish && s->n_ids >= a->max_new_tokens) s->finish = DS4_FINISH_LENGTH;
    if (a->on_token && a->on_token(a->ud, i, id, lpm)) g->cancelled = 1;
    return DS4_OK;
}

/* Queue a draw of sequence i's next token from row `row` of the step's logits. */
static void queue_draw(gen *g, int64_t i, int64_t row) {
    const ds4_gen_seq *s = &g->r->seqs[i];
    const uint64_t stream = ((uint64_t)(g->a->prompt_base + s->prompt_index) << 32) | (uint64_t)s->sample_index;
    draws *d = &g->d;
    d->seq[d->n] = i;
    d->row[d->n] = (int32_t)row;
    d->u[d->n] = ds4_sample_uniform(g->a->seed, stream, (uint64_t)s->n_ids);
    d->n++;
}

/* Run the queued draws on the backend and record them in queue order. */
static ds4_status run_draws(gen *g, ds4_error *err) {
    draws *d = &g->d;
    const int64_t n = d->n;
    d->n = 0;
    if (n == 0) return DS4_OK;
    ds4_dev *dev = g->m->dev;
    const int32_t *row = ds4_dev_input(dev, d->b_row, d->row, (size_t)n * sizeof *d->row);
    const double *u = ds4_dev_input(dev, d->b_u, d->u, (size_t)n * sizeof *d->u);
    int64_t *id = dev->host_visible ? d->id : d->b_id;
    double *lpm = dev->host_visible ? d->lpm : d->b_lpm, *lps = dev->host_visible ? d->lps : d->b_lps;
    OP(dev, sample, .logits = d->b_logits, .lrow = row, .rows = n, .V = g->V, .p = g->a->sampling, .u = u, .id = id,
       .lp_model = lpm, .lp_sample = lps);
    if (!dev->host_visible) {
        ds4_dev_download(dev, d->id, id, (size_t)n * sizeof *id);
        ds4_dev_download(dev, d->lpm, lpm, (size_t)n * sizeof *lpm);
        ds4_dev_download(dev, d->lps, lps, (size_t)n * sizeof *lps);
    }
    ds4_status st = ds4_dev_check(dev, "generate", err);
    for (int64_t r = 0; r < n && !st; r++) st = record(g, d->seq[r], d->id[r], d->lpm[r], d->lps[r], err);
    return st;
}

static int poll_cancel(gen *g) {
    if (g->a->cancel && *g->a->cancel) g->cancelled = 1;
    return g->cancelled;
}

/* Scratch of one step: ids, caches, counts, last logits, routing rows. */
typedef struct step_buf {
    int64_t *ids, *counts, *who;
    ds4_cache **caches;
    int32_t *ex, *ix;
} step_buf;

static ds4_status prefill(gen *g, step_buf *b, int64_t chunk, ds4_error *err) {
    const ds4_gen_args *a = g->a;
    const int64_t n = a->n;
    int64_t p = 0, off = 0;
    while (p < a->nprompts) {
        if (poll_cancel(g)) return DS4_OK;
        int64_t ns = 0, nt = 0;
        while (p < a->nprompts && nt < chunk) {
            const int64_t take = a->prompt_lens[p] - off < chunk - nt ? a->prompt_lens[p] - off : chunk - nt;
            memcpy(b->ids + nt, a->prompts[p] + off, (size_t)take * sizeof(int64_t));
            b->caches[ns] = g->gs[p * n].cache;
            b->counts[ns] = take;
            b->who[ns++] = p;
            nt += take;
            off += take;
            if (off == a->prompt_lens[p]) p++, off = 0;
        }
        ds4_step_args sa = {.nseq = ns, .caches = b->caches, .counts = b->counts, .ids = b->ids, .experts = b->ex,
                            .index_picks = b->ix};
        ds4_status st = ds4_step_run(g->m, &sa, g->d.b_logits, err);
        if (st) return st;
        for (int64_t k = 0, r0 = 0; k < ns; r0 += b->counts[k], k++) {
            const int64_t pk = b->who[k], first = pk * n, len = ds4_cache_len(b->caches[k]);
            if ((st = keep_rows(g, first, len - b->counts[k], b->counts[k], b->ex, b->ix, r0, err))) return st;
            if (len < a->prompt_lens[pk]) continue; /* the prompt goes on in the next step */
            for (int64_t j = 1; j < n; j++) {
                if ((st = ds4_cache_copy(g->gs[first + j].cache, g->gs[first].cache, err))) return st;
                ds4_gen_seq *src = &g->r->seqs[first];
                if (src->experts || src->index_picks) {
                    if ((st = keep_rows(g, first + j, 0, len, src->experts, src->index_picks, 0, err))) return st;
                }
            }
            for (int64_t j = 0; j < n; j++) queue_draw(g, first + j, k);
        }
        if ((st = run_draws(g, err))) return st;
        g->r->prefill_tokens += nt;
    }
    return DS4_OK;
}

static ds4_status decode(gen *g, step_buf *b, int64_t maxb, ds4_error *err) {
    const int64_t nseq = g->r->nseq;
    for (;;) {
        int64_t i = 0, any = 0;
        while (i < nseq) {
            if (poll_cancel(g)) return DS4_OK;
            int64_t ns = 0;
            for (; i < nseq && ns < maxb; i++) {
                ds4_gen_seq *s = &g->r->seqs[i];
                if (s->finish) continue;
                b->caches[ns] = g->gs[i].cache;
                b->counts[ns] = 1;
                b->ids[ns] = s->ids[s->n_ids - 1];
                b->who[ns++] = i;
            }
            if (ns == 0) break;
            any = 1;
            ds4_step_args sa = {.nseq = ns, .caches = b->caches, .counts = b->counts, .ids = b->ids, .experts = b->ex,
                                .index_picks = b->ix};
            ds4_status st = ds4_step_run(g->m, &sa, g->d.b_logits, err);
            if (st) return st;
            g->r->decode_tokens += ns;
            for (int64_t k = 0; k < ns; k++) {
                const int64_t si = b->who[k];
                if ((st = keep_rows(g, si, ds4_cache_len(b->caches[k]) - 1, 1, b->ex, b->ix, k, err))) return st;
                queue_draw(g, si, k);
            }
            if ((st = run_draws(g, err))) return st;
        }
        if (!any) return DS4_OK;
    }
}

ds4_status ds4_generate(ds4_model *m, const ds4_gen_args *a, ds4_gen_result **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "generate: out is NULL");
    *out = NULL;
    ds4_status st = check_args(m, a, err);
    if (st) return st;
    const ds4_config *c = &m->cfg;
    gen g = {.m = m, .a = a, .V = c->vocab_size, .L = c->num_hidden_layers, .K = c->num_experts_per_tok,
             .ncsa = ds4_model_csa_layers(m), .topk = c->index_topk};
    for (int64_t k = 0; k < a->n_stop_strings; k++)
        if (strlen(a->stop_strings[k]) > g.max_stop) g.max_stop = strlen(a->stop_strings[k]);
    const int64_t nseq = a->nprompts * a->n;
    const int64_t chunk = a->prefill_chunk > 0 ? a->prefill_chunk : 2048;
    const int64_t maxb = a->max_batch > 0 && a->max_batch < nseq ? a->max_batch : nseq;
    /* rows of a step: prefill steps hold at most min(nprompts, chunk) sequences and chunk tokens */
    int64_t total = 0;
    for (int64_t p = 0; p < a->nprompts; p++) total += a->prompt_lens[p];
    const int64_t tok_rows = (chunk < total ? chunk : total) > maxb ? (chunk < total ? chunk : total) : maxb;
    const int64_t seq_rows = (a->nprompts < chunk ? a->nprompts : chunk) > maxb ? (a->nprompts < chunk ? a->nprompts : chunk) : maxb;
    ds4_gen_result *r = calloc(1, sizeof *r);
    step_buf b = {0};
    if (r) {
        r->nseq = nseq;
        r->seqs = calloc((size_t)nseq, sizeof *r->seqs);
    }
    g.r = r;
    g.gs = calloc((size_t)nseq, sizeof *g.gs);
    b.ids = malloc((size_t)tok_rows * sizeof *b.ids);
    b.counts = malloc((size_t)seq_rows * sizeof *b.counts);
    b.who = malloc((size_t)seq_rows * sizeof *b.who);
    b.caches = malloc((size_t)seq_rows * sizeof *b.caches);
    if (a->record_experts) b.ex = malloc((size_t)(tok_rows * g.L * g.K) * sizeof *b.ex);
    if (a->record_index && g.ncsa) b.ix = malloc((size_t)(tok_rows * g.ncsa * g.topk) * sizeof *b.ix);
    /* a step draws at most one token per sequence */
    g.d.seq = malloc((size_t)nseq * (2 * sizeof(int64_t) + 3 * sizeof(double) + sizeof(int32_t)));
    if (!r || !r->seqs || !g.gs || !b.ids || !b.counts || !b.who || !b.caches || !g.d.seq ||
        (a->record_experts && !b.ex) || (a->record_index && g.ncsa && !b.ix)) {
        st = ds4_fail(err, DS4_ERR_OOM, "generate: buffers for %lld sequences (vocabulary %lld)", (long long)nseq,
                      (long long)g.V);
        goto done;
    }
    g.d.id = g.d.seq + nseq;
    g.d.u = (double *)(g.d.id + nseq);
    g.d.lpm = g.d.u + nseq;
    g.d.lps = g.d.lpm + nseq;
    g.d.row = (int32_t *)(g.d.lps + nseq);
    {
        ds4_dev *dev = m->dev;
        const size_t lbytes = ((size_t)(seq_rows * g.V) * sizeof(float) + 63) & ~(size_t)63;
        if ((st = dev->ops->alloc(dev, lbytes + (size_t)nseq * (sizeof(int64_t) + 3 * sizeof(double) + sizeof(int32_t)),
                                  &g.d.mem, err))) {
            ds4_error_prefix(err, "generate: logits of %lld sequences (vocabulary %lld): ", (long long)seq_rows,
                             (long long)g.V);
            goto done;
        }
        g.d.b_logits = g.d.mem;
        g.d.b_id = (int64_t *)(void *)((char *)g.d.mem + lbytes);
        g.d.b_u = (double *)(g.d.b_id + nseq);
        g.d.b_lpm = g.d.b_u + nseq;
        g.d.b_lps = g.d.b_lpm + nseq;
        g.d.b_row = (int32_t *)(g.d.b_lps + nseq);
    }
    for (int64_t i = 0; i < nseq; i++) {
        ds4_gen_seq *s = &r->seqs[i];
        s->prompt_index = i / a->n;
        s->sample_index = i % a->n;
        s->prompt_len = a->prompt_lens[s->prompt_index];
        s->stop_index = -1;
        /* the last generated token never runs through the model */
        if ((st = ds4_cache_create(m, s->prompt_len + a->max_new_tokens - 1, &g.gs[i].cache, err))) goto done;
    }
    double t0 = now_s();
    st = prefill(&g, &b, chunk, err);
    double t1 = now_s();
    r->prefill_seconds = t1 - t0;
    if (st) goto done;
    st = decode(&g, &b, maxb, err);
    r->decode_seconds = now_s() - t1;
    if (st) goto done;
    for (int64_t i = 0; i < nseq; i++) {
        ds4_gen_seq *s = &r->seqs[i];
        if (!s->finish) s->finish = DS4_FINISH_CANCELLED;
        s->n_rows = ds4_cache_len(g.gs[i].cache);
        if ((a->record_experts || (a->record_index && g.ncsa)) && (st = reserve_rows(&g, i, s->n_rows > 0 ? s->n_rows : 1, err)))
            goto done;
    }
done:
    for (int64_t i = 0; g.gs && i < nseq; i++) {
        ds4_cache_free(g.gs[i].cache);
        free(g.gs[i].text);
    }
    free(g.gs);
    free(g.d.seq);
    if (g.d.mem) m->dev->ops->free(m->dev, g.d.mem);
    free(b.ids);
    free(b.counts);
    free(b.who);
    free(b.caches);
    free(b.ex);
    free(b.ix);
    if (st) {
        ds4_gen_result_free(r);
        return st;
    }
    *out = r;
    return DS4_OK;
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
