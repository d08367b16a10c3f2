/* test_batcher.c — the continuous batcher (ds4_batcher_*) against a reference decoder written here.
 *
 * The reference generates one sequence alone: ds4_model_step over the prompt, then one token at a time, each
 * drawn on the host with ds4_sample at ds4_sample_uniform(seed, prompt << 32 | sample, k), stopping by the rules
 * of ds4_gen.h (eos unless ignored, stop ids, max_new_tokens). Nothing of the batcher runs in it.
 *
 * The batcher runs 14 tasks of mixed prompt lengths (1..23 tokens), sample counts (1..7, one larger than the
 * batcher), lengths (1..30 new tokens), sampling settings (greedy, temperature, top-k, top-p, min-p), stops and
 * seeds, in 5 sequence slots with prefill pieces of 6 tokens (prompts span steps; prefill shares steps with
 * decoding), half of them submitted while the others run, one recording its routed experts and one cancelled
 * half-way. Every task that was not cancelled must equal the reference bit for bit (ids, log-probabilities,
 * sampling log-probabilities, finish reason, stop index; the experts of the recording task against the
 * reference's step records): batch invariance of the step plus per-sequence streams. Also: the stats, tags and
 * take order, a cancelled task keeps what it generated, and bad arguments. */
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

enum { NTASK = 14, MAXLEN = 64 };

typedef struct ref_seq {
    int64_t n_ids, ids[MAXLEN];
    float lp[MAXLEN], slp[MAXLEN];
    ds4_finish finish;
    int64_t stop_index;
    int64_t n_rows;
    int32_t *experts; /* [n_rows, L, K] */
} ref_seq;

/* Sequence (p = 0, sample s) of a one-prompt task, alone. */
static void reference(ds4_model *m, const ds4_gen_args *a, int64_t s, ref_seq *out) {
    ds4_error err = {0};
    const ds4_config *c = ds4_model_config(m);
    const int64_t V = c->vocab_size, LK = c->num_hidden_layers * c->num_experts_per_tok;
    const int64_t plen = a->prompt_lens[0];
    memset(out, 0, sizeof *out);
    out->stop_index = -1;
    ds4_cache *cache = NULL;
    CHECK_OK(ds4_cache_create(m, plen + a->max_new_tokens, &cache, &err), &err);
    float *logits = malloc((size_t)V * sizeof *logits);
    void *scratch = malloc(ds4_sample_scratch_bytes(V));
    int32_t *ex = malloc((size_t)(plen * LK) * sizeof *ex);
    if (a->record_experts) out->experts = malloc((size_t)((plen + a->max_new_tokens) * LK) * sizeof(int32_t));
    const int64_t *ids = a->prompts[0];
    int64_t count = plen, last;
    for (;;) {
        ds4_step_args sa = {.nseq = 1, .caches = &cache, .counts = &count, .ids = ids, .last_logits = logits,
                            .experts = a->record_experts ? ex : NULL};
        CHECK_OK(ds4_model_step(m, &sa, &err), &err);
        if (a->record_experts) {
            memcpy(out->experts + out->n_rows * LK, ex, (size_t)(count * LK) * sizeof *ex);
            out->n_rows += count;
        }
        double lpm = 0, lps = 0;
        const double u = ds4_sample_uniform(a->seed, (uint64_t)s, (uint64_t)out->n_ids);
        last = ds4_sample(logits, V, &a->sampling, u, &lpm, &lps, scratch, &err);
        CHECK(last >= 0, "reference sample: %s", err.msg);
        out->ids[out->n_ids] = last;
        out->lp[out->n_ids] = (float)lpm;
        out->slp[out->n_ids] = (float)lps;
        out->n_ids++;
        if (last == c->eos_token_id && !a->ignore_eos) out->finish = DS4_FINISH_EOS;
        for (int64_t k = 0; k < a->n_stop_ids && !out->finish; k++)
            if (a->stop_ids[k] == last) out->finish = DS4_FINISH_STOP_TOKEN, out->stop_index = k;
        if (!out->finish && out->n_ids >= a->max_new_tokens) out->finish = DS4_FINISH_LENGTH;
        if (out->finish || last < 0) break;
        ids = &out->ids[out->n_ids - 1];
        count = 1;
    }
    free(ex);
    free(scratch);
    free(logits);
    ds4_cache_free(cache);
}

typedef struct task {
    int64_t prompt[32];
    int64_t plen;
    const int64_t *pp[1];
    int64_t stop[2];
    ds4_gen_args a;
} task;

static void make_task(task *t, int i, int64_t V) {
    memset(t, 0, sizeof *t);
    t->plen = 1 + (i * 7) % 23;
    for (int64_t j = 0; j < t->plen; j++) t->prompt[j] = (i * 31 + j * 17 + 3) % V;
    t->pp[0] = t->prompt;
    ds4_gen_args *a = &t->a;
    a->nprompts = 1;
    a->prompts = t->pp;
    a->prompt_lens = &t->plen;
    a->n = i == 5 ? 7 : 1 + i % 3; /* task 5: more samples than the batcher's slots */
    a->max_new_tokens = 1 + (i * 11) % 30;
    a->seed = 1000 + (uint64_t)i * 7919;
    a->ignore_eos = i % 2;
    static const ds4_sampling kinds[5] = {{0, 0, 0, 0}, {1.0, 0, 1, 0}, {0.8, 5, 1, 0}, {1.2, 0, 0.9, 0}, {1.0, 0, 1, 0.05}};
    a->sampling = kinds[i % 5];
    if (i % 4 == 3) {
        t->stop[0] = (i * 13) % V;
        t->stop[1] = (i * 5 + 1) % V;
        a->stop_ids = t->stop;
        a->n_stop_ids = 2;
    }
    a->record_experts = i == 8;
}

static void same(const ds4_gen_result *r, const ds4_model *m, const ds4_gen_args *a, int i, const ref_seq *refs) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t LK = c->num_hidden_layers * c->num_experts_per_tok;
    CHECK(r && r->nseq == a->n, "task %d: %lld sequences, want %d", i, r ? (long long)r->nseq : -1LL, (int)a->n);
    for (int64_t s = 0; r && s < r->nseq; s++) {
        const ds4_gen_seq *q = &r->seqs[s];
        const ref_seq *f = &refs[s];
        int eq = q->n_ids == f->n_ids && q->finish == f->finish && q->stop_index == f->stop_index &&
                 q->sample_index == s && q->prompt_index == 0 && q->prompt_len == a->prompt_lens[0];
        for (int64_t k = 0; eq && k < f->n_ids; k++)
            eq = q->ids[k] == f->ids[k] && memcmp(&q->logprobs[k], &f->lp[k], sizeof(float)) == 0 &&
                 memcmp(&q->sample_logprobs[k], &f->slp[k], sizeof(float)) == 0;
        CHECK(eq, "task %d sample %lld: %lld ids (%s) vs the reference's %lld (%s)", i, (long long)s, (long long)q->n_ids,
              ds4_finish_name(q->finish), (long long)f->n_ids, ds4_finish_name(f->finish));
        if (a->record_experts) {
            /* the reference ran every token it drew except the last: the batcher's rows are its first n_rows */
            CHECK(q->n_rows == a->prompt_lens[0] + q->n_ids - 1 && q->experts &&
                      memcmp(q->experts, f->experts, (size_t)(q->n_rows * LK) * sizeof(int32_t)) == 0,
                  "task %d sample %lld: routed experts of %lld rows differ from the reference's", i, (long long)s,
                  (long long)q->n_rows);
        }
    }
}

static void run(ds4_model *m, const char *name) {
    ds4_error err = {0};
    const int64_t V = ds4_model_config(m)->vocab_size;
    static task tasks[NTASK];
    static ref_seq refs[NTASK][8];
    for (int i = 0; i < NTASK; i++) {
        make_task(&tasks[i], i, V);
        for (int32_t s = 0; s < tasks[i].a.n; s++) reference(m, &tasks[i].a, s, &refs[i][s]);
    }
    ds4_batcher *b = NULL;
    ds4_batcher_options o = {.max_seqs = 5, .prefill_chunk = 6};
    CHECK_OK(ds4_batcher_create(m, &o, &b, &err), &err);
    if (!b) return;
    const int cancel_tag = 9;
    int seen[NTASK] = {0}, taken = 0, steps = 0, submitted = 0;
    int64_t cancelled_ids = -1;
    for (; submitted < NTASK / 2; submitted++) CHECK_OK(ds4_batcher_submit(b, &tasks[submitted].a, 100 + submitted, &err), &err);
    ds4_batcher_stats st;
    ds4_batcher_get_stats(b, &st);
    CHECK(st.queued == NTASK / 2 && st.running == 0 && st.seqs == 0, "%s: stats before the first step", name);
    while (taken < NTASK && steps < 10000) {
        CHECK_OK(ds4_batcher_step(b, &err), &err);
        steps++;
        ds4_batcher_get_stats(b, &st);
        CHECK(st.seqs <= o.max_seqs || st.running == 1, "%s: %lld sequences running in %lld slots", name,
              (long long)st.seqs, (long long)o.max_seqs);
        if (steps % 4 == 0 && submitted < NTASK) { /* the rest join while the others decode */
            CHECK_OK(ds4_batcher_submit(b, &tasks[submitted].a, 100 + submitted, &err), &err);
            submitted++;
        }
        if (steps == 12) CHECK(ds4_batcher_cancel(b, 100 + cancel_tag) == 1, "%s: cancel a running task", name);
        uint64_t tag;
        ds4_gen_result *r;
        ds4_status ts;
        while (ds4_batcher_take(b, &tag, &r, &ts)) {
            const int i = (int)tag - 100;
            CHECK(i >= 0 && i < NTASK && !seen[i] && ts == DS4_OK, "%s: tag %llu taken once, status %d", name,
                  (unsigned long long)tag, (int)ts);
            if (i < 0 || i >= NTASK) break;
            seen[i] = 1;
            taken++;
            if (i == cancel_tag) {
                cancelled_ids = 0;
                for (int64_t s = 0; r && s < r->nseq; s++) {
                    const int64_t k = r->seqs[s].n_ids;
                    cancelled_ids += k;
                    /* what it generated before the cancel is the reference's prefix */
                    CHECK(k == refs[i][s].n_ids || r->seqs[s].finish == DS4_FINISH_CANCELLED, "cancelled task's finish");
                    CHECK(k <= refs[i][s].n_ids &&
                              (k == 0 || memcmp(r->seqs[s].ids, refs[i][s].ids, (size_t)k * sizeof(int64_t)) == 0),
                          "%s: the cancelled task's %lld ids are a prefix of the reference's", name, (long long)k);
                }
            } else {
                same(r, m, &tasks[i].a, i, refs[i]);
            }
            ds4_gen_result_free(r);
        }
    }
    CHECK(taken == NTASK, "%s: %d of %d tasks finished in %d steps", name, taken, NTASK, steps);
    CHECK(cancelled_ids >= 0, "%s: the cancelled task was taken", name);
    ds4_batcher_get_stats(b, &st);
    CHECK(st.queued == 0 && st.running == 0 && st.finished == 0 && st.seqs == 0 && st.free_seqs == o.max_seqs,
          "%s: stats after the run: %lld queued %lld running %lld finished %lld seqs", name, (long long)st.queued,
          (long long)st.running, (long long)st.finished, (long long)st.seqs);
    CHECK(ds4_batcher_cancel(b, 100 + cancel_tag) == 0, "%s: cancel of a taken task", name);
    printf("  %-8s %d tasks in %d steps (%lld model steps, %lld prefill + %lld decode tokens)\n", name, NTASK, steps,
           (long long)st.steps, (long long)st.prefill_tokens, (long long)st.decode_tokens);

    /* bad arguments: checked at submit, nothing queued */
    ds4_gen_args bad = tasks[0].a;
    bad.n = 0;
    CHECK_STATUS(ds4_batcher_submit(b, &bad, 1, &err), DS4_ERR_ARG, &err);
    ds4_batcher_get_stats(b, &st);
    CHECK(st.queued == 0, "%s: a refused task is not queued", name);
    ds4_batcher_options zero = {0};
    ds4_batcher *b2 = NULL;
    CHECK_STATUS(ds4_batcher_create(m, &zero, &b2, &err), DS4_ERR_ARG, &err);
    CHECK(b2 == NULL, "no batcher on error");
    /* a batcher freed with tasks still queued and running frees them */
    CHECK_OK(ds4_batcher_submit(b, &tasks[1].a, 1, &err), &err);
    CHECK_OK(ds4_batcher_submit(b, &tasks[2].a, 2, &err), &err);
    CHECK_OK(ds4_batcher_step(b, &err), &err);
    ds4_batcher_free(b);
    for (int i = 0; i < NTASK; i++)
        for (int s = 0; s < 8; s++) free(refs[i][s].experts), refs[i][s].experts = NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_batcher FIXTURES_DIR\n");
        return 2;
    }
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&eo, &eng, &err), &err);
    if (!eng) return ds4t_finish("test_batcher");
    const char *names[2] = {"tiny_a", "tiny_hf"};
    for (int k = 0; k < 2; k++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", argv[1], names[k]);
        ds4_model *m = NULL;
        CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
        if (m) run(m, names[k]);
        ds4_model_free(m);
    }
    ds4_engine_free(eng);
    return ds4t_finish("test_batcher");
}
