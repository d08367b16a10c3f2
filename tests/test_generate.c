/* test_generate.c — ds4_generate against independent references.
 *
 *  - greedy continuations equal transformers' argmax loop over full forwards (greedy.safetensors from
 *    tests/gen_greedy_fixtures.py; prompts were drawn so no step has a top-2 gap below 1e-3), with their
 *    log-probabilities within 1e-4 (the forward test's logit bound; measured ~1e-6);
 *  - teacher forcing: the log-probabilities returned while sampling equal those of one full forward over the
 *    finished sequence (≤ 1e-5, the bound; the same kernels run, so ~0 is expected), and the sampling
 *    log-probabilities equal the filtered, tempered distribution recomputed from those full-forward logits;
 *  - the result does not depend on batching, prefill chunking or max_batch (counter-based draws);
 *  - stop reasons (length, eos, stop ids, stop strings through the byte-level tokenizer, cancel);
 *  - routing records: hash layers reproduce the checkpoint's tid2eid table, indexer picks are causal and
 *    number min(index_topk, causal entries). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

enum { MAXP = 2 };

typedef struct greedy_fx {
    int64_t plen[MAXP], n;
    int64_t prompt[MAXP][64], cont[MAXP][64];
    double lp[MAXP][64];
} greedy_fx;

static int read_i64(const ds4_st_file *f, const char *name, int64_t *out, int64_t *n) {
    const ds4_st_entry *e = ds4_st_find(f, name);
    CHECK(e && e->dtype == DS4_I64 && e->ndim == 1 && e->shape[0] <= 64, "greedy.safetensors: %s", name);
    if (!e || e->dtype != DS4_I64 || e->shape[0] > 64) return 0;
    memcpy(out, e->data, e->nbytes);
    *n = e->shape[0];
    return 1;
}

static int load_greedy(const char *dir, greedy_fx *g) {
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "greedy.safetensors"), &f, &err), &err);
    if (!f) return 0;
    int ok = 1;
    for (int k = 0; k < MAXP && ok; k++) {
        char name[64];
        snprintf(name, sizeof name, "prompt_%d", k);
        ok &= read_i64(f, name, g->prompt[k], &g->plen[k]);
        snprintf(name, sizeof name, "greedy_%d", k);
        ok &= read_i64(f, name, g->cont[k], &g->n);
        snprintf(name, sizeof name, "logprob_%d", k);
        const ds4_st_entry *e = ds4_st_find(f, name);
        ok &= e && e->dtype == DS4_F64 && e->shape[0] == g->n;
        if (ok) memcpy(g->lp[k], e->data, e->nbytes);
    }
    ds4_st_close(f);
    return ok;
}

/* Full-forward log-softmax rows [S, V] (double) of one sequence. */
static double *full_logsoftmax(ds4_model *m, const int64_t *ids, int64_t S, float **raw) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    float *lg = malloc((size_t)(S * V) * sizeof(float));
    double *out = malloc((size_t)(S * V) * sizeof(double));
    ds4_error err = {0};
    ds4_forward_args a = {.ids = ids, .batch = 1, .seq = S, .logits = lg};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    for (int64_t s = 0; s < S; s++) {
        const float *z = lg + s * V;
        double mx = -INFINITY, se = 0;
        for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int64_t v = 0; v < V; v++) se += exp((double)z[v] - mx);
        for (int64_t v = 0; v < V; v++) out[s * V + v] = (double)z[v] - mx - log(se);
    }
    if (raw) *raw = lg;
    else free(lg);
    return out;
}

static void greedy_vs_transformers(ds4_model *m, const char *name, const greedy_fx *g) {
    ds4_error err = {0};
    const int64_t *prompts[MAXP] = {g->prompt[0], g->prompt[1]};
    const int64_t chunks[3] = {0, 3, 1}, batches[3] = {0, 1, 2};
    int64_t first_ids[MAXP][64];
    for (int v = 0; v < 3; v++) {
        ds4_gen_args a = {.nprompts = MAXP, .prompts = prompts, .prompt_lens = g->plen, .n = 1,
                          .max_new_tokens = g->n, .ignore_eos = 1, .prefill_chunk = chunks[v], .max_batch = batches[v]};
        ds4_gen_result *r = NULL;
        CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
        if (!r) continue;
        double dlp = 0;
        for (int k = 0; k < MAXP; k++) {
            const ds4_gen_seq *s = &r->seqs[k];
            CHECK(s->n_ids == g->n && s->finish == DS4_FINISH_LENGTH, "%s prompt %d: %lld ids, finish %s", name, k,
                  (long long)s->n_ids, ds4_finish_name(s->finish));
            int64_t same = 0;
            for (int64_t i = 0; i < s->n_ids && i < g->n; i++) {
                same += s->ids[i] == g->cont[k][i];
                const double d = fabs((double)s->logprobs[i] - g->lp[k][i]);
                dlp = d > dlp ? d : dlp;
                CHECK(s->sample_logprobs[i] == 0.0f, "greedy sample log-probability %g", s->sample_logprobs[i]);
                if (v == 0) first_ids[k][i] = s->ids[i];
                else CHECK(s->ids[i] == first_ids[k][i], "chunk %lld / batch %lld changed the ids", (long long)chunks[v], (long long)batches[v]);
            }
            CHECK(same == g->n, "%s prompt %d: %lld of %lld greedy tokens equal transformers'", name, k, (long long)same,
                  (long long)g->n);
        }
        if (v == 0) printf("  %-8s greedy: %lld + %lld tokens equal transformers', max |dlogprob| %.3g\n", name,
                           (long long)r->seqs[0].n_ids, (long long)r->seqs[1].n_ids, dlp);
        CHECK(dlp <= 1e-4, "%s greedy log-probabilities differ from transformers' by %g", name, dlp);
        ds4_gen_result_free(r);
    }
}

/* The distribution ds4_sample promises, recomputed plainly from full-forward logits: tempered softmax, top-k. */
static double tempered_topk_logprob(const float *z, int64_t V, double T, int64_t topk, int64_t id) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
    double num = 0, den = 0;
    for (int64_t v = 0; v < V; v++) {
        int64_t above = 0; /* rank: tokens strictly more probable, or equal with a lower id */
        for (int64_t u = 0; u < V; u++) above += z[u] > z[v] || (z[u] == z[v] && u < v);
        if (above >= topk) continue;
        const double w = exp(((double)z[v] - mx) / T);
        den += w;
        if (v == id) num = w;
    }
    return num > 0 ? log(num / den) : -INFINITY;
}

static void teacher_forcing(ds4_model *m, const char *name, const greedy_fx *g) {
    ds4_error err = {0};
    const int64_t V = ds4_model_config(m)->vocab_size;
    const int64_t *prompts[MAXP] = {g->prompt[0], g->prompt[1]};
    const struct {
        double T;
        int64_t topk;
    } modes[2] = {{1.0, 0}, {0.7, 5}};
    for (int md = 0; md < 2; md++) {
        ds4_gen_args a = {.nprompts = MAXP, .prompts = prompts, .prompt_lens = g->plen, .n = 3, .max_new_tokens = 29,
                          .ignore_eos = 1, .seed = 7, .sampling = {.temperature = modes[md].T, .top_k = modes[md].topk, .top_p = 1}};
        ds4_gen_result *r = NULL, *r2 = NULL, *r3 = NULL;
        CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
        ds4_gen_args b = a;
        b.max_batch = 1;
        b.prefill_chunk = 2;
        CHECK_OK(ds4_generate(m, &b, &r2, &err), &err);
        ds4_gen_args c = a;
        c.seed = 8;
        CHECK_OK(ds4_generate(m, &c, &r3, &err), &err);
        if (!r || !r2 || !r3) goto next;
        CHECK(r->nseq == 6, "nseq %lld", (long long)r->nseq);
        double dm = 0, ds = 0;
        int64_t differ_seed = 0, differ_samples = 0;
        for (int64_t i = 0; i < r->nseq; i++) {
            const ds4_gen_seq *s = &r->seqs[i];
            CHECK(s->prompt_index == i / 3 && s->sample_index == i % 3, "seq %lld indices", (long long)i);
            const int64_t P = s->prompt_len, S = P + s->n_ids;
            int64_t *full = malloc((size_t)S * sizeof *full);
            memcpy(full, prompts[s->prompt_index], (size_t)P * sizeof *full);
            memcpy(full + P, s->ids, (size_t)s->n_ids * sizeof *full);
            float *raw = NULL;
            double *ls = full_logsoftmax(m, full, S - 1, &raw);
            for (int64_t j = 0; j < s->n_ids; j++) {
                const double d = fabs((double)s->logprobs[j] - ls[(P - 1 + j) * V + s->ids[j]]);
                dm = d > dm ? d : dm;
                const double want = tempered_topk_logprob(raw + (P - 1 + j) * V, V, modes[md].T,
                                                          modes[md].topk ? modes[md].topk : V, s->ids[j]);
                const double e = fabs((double)s->sample_logprobs[j] - want);
                ds = e > ds ? e : ds;
            }
            free(raw);
            free(ls);
            free(full);
            const ds4_gen_seq *s2 = &r2->seqs[i], *s3 = &r3->seqs[i];
            CHECK(s2->n_ids == s->n_ids && memcmp(s2->ids, s->ids, (size_t)s->n_ids * sizeof(int64_t)) == 0 &&
                      memcmp(s2->logprobs, s->logprobs, (size_t)s->n_ids * sizeof(float)) == 0,
                  "%s seq %lld: max_batch 1 / prefill_chunk 2 changed the result", name, (long long)i);
            differ_seed += memcmp(s3->ids, s->ids, (size_t)s->n_ids * sizeof(int64_t)) != 0;
            if (i % 3) differ_samples += memcmp(r->seqs[i - 1].ids, s->ids, (size_t)s->n_ids * sizeof(int64_t)) != 0;
        }
        printf("  %-8s T=%.1f top_k=%lld: teacher-forced max |dlogprob| %.3g, sampling log-prob max |d| %.3g\n", name,
               modes[md].T, (long long)modes[md].topk, dm, ds);
        CHECK(dm <= 1e-5, "%s: generation log-probabilities differ from a full forward by %g", name, dm);
        /* fp32 logits, the rest in double on both sides with different summation orders */
        CHECK(ds <= 1e-5, "%s: sampling log-probabilities differ from the recomputed distribution by %g", name, ds);
        CHECK(differ_seed >= 5, "%s: another seed changed only %lld of 6 sequences", name, (long long)differ_seed);
        CHECK(differ_samples >= 3, "%s: only %lld of 4 sample pairs differ", name, (long long)differ_samples);
    next:
        ds4_gen_result_free(r);
        ds4_gen_result_free(r2);
        ds4_gen_result_free(r3);
    }
}

static int cancel_after(void *ud, int64_t seq, int64_t id, double lp) {
    (void)seq, (void)id, (void)lp;
    int *left = ud;
    return --*left <= 0;
}

static void stops(ds4_model *m, const char *name, const greedy_fx *g) {
    ds4_error err = {0};
    const int64_t *prompts[1] = {g->prompt[0]};
    ds4_gen_args base = {.nprompts = 1, .prompts = prompts, .prompt_lens = g->plen, .n = 1, .max_new_tokens = g->n,
                         .ignore_eos = 1};
    ds4_gen_result *r = NULL;
    /* stop id: the first occurrence of greedy token 6 */
    int64_t sid = g->cont[0][6], first = 0;
    while (g->cont[0][first] != sid) first++;
    int64_t unused = 0; /* a first stop id that never occurs, so the match is reported as index 1 */
    for (int64_t i = 0; i < g->n; i++)
        if (g->cont[0][i] == unused) unused++, i = -1;
    const int64_t stop_ids[2] = {unused, sid};
    ds4_gen_args a = base;
    a.stop_ids = stop_ids;
    a.n_stop_ids = 2;
    CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
    if (r) {
        CHECK(r->seqs[0].finish == DS4_FINISH_STOP_TOKEN && r->seqs[0].stop_index == 1 && r->seqs[0].n_ids == first + 1,
              "%s stop id %lld: finish %s, stop_index %lld, %lld ids (want %lld)", name, (long long)sid,
              ds4_finish_name(r->seqs[0].finish), (long long)r->seqs[0].stop_index, (long long)r->seqs[0].n_ids,
              (long long)first + 1);
        ds4_gen_result_free(r);
    }
    /* eos: the config's eos_token_id (1) if greedy produces it, else max_new_tokens */
    const int64_t eos = ds4_model_config(m)->eos_token_id;
    int64_t at = -1;
    for (int64_t i = 0; i < g->n && at < 0; i++)
        if (g->cont[0][i] == eos) at = i;
    a = base;
    a.ignore_eos = 0;
    CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
    if (r) {
        const ds4_finish want = at >= 0 ? DS4_FINISH_EOS : DS4_FINISH_LENGTH;
        const int64_t n = at >= 0 ? at + 1 : g->n;
        CHECK(r->seqs[0].finish == want && r->seqs[0].n_ids == n, "%s eos: finish %s after %lld ids, want %s after %lld",
              name, ds4_finish_name(r->seqs[0].finish), (long long)r->seqs[0].n_ids, ds4_finish_name(want), (long long)n);
        if (at >= 0) printf("  %-8s eos after %lld tokens\n", name, (long long)n);
        ds4_gen_result_free(r);
    }
    /* stop string: with the byte-level tokenizer ids < 256 decode to themselves; take the bytes of greedy
     * tokens 8..9 and find by hand where that string first ends in the output */
    ds4_tokenizer *tok = NULL;
    CHECK_OK(ds4_tokenizer_byte_level(&tok, &err), &err);
    char stop[3] = {(char)g->cont[0][8], (char)g->cont[0][9], 0};
    if (tok && stop[0] && stop[1]) {
        int64_t end = -1;
        for (int64_t i = 1; i < g->n && end < 0; i++)
            if ((char)g->cont[0][i - 1] == stop[0] && (char)g->cont[0][i] == stop[1]) end = i;
        const char *ss[2] = {"\xff\xfe\xfd never", stop};
        a = base;
        a.stop_strings = ss;
        a.n_stop_strings = 2;
        a.tokenizer = tok;
        CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
        if (r) {
            CHECK(r->seqs[0].finish == DS4_FINISH_STOP_STRING && r->seqs[0].stop_index == 1 && r->seqs[0].n_ids == end + 1,
                  "%s stop string: finish %s, %lld ids, want %lld", name, ds4_finish_name(r->seqs[0].finish),
                  (long long)r->seqs[0].n_ids, (long long)end + 1);
            ds4_gen_result_free(r);
        }
        a.tokenizer = NULL;
        CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, "tokenizer") != NULL, "message: %s", err.msg);
    }
    ds4_tokenizer_free(tok);
    /* cancel from the callback after 4 tokens of 2 prompts × 2 samples; and a cancel flag already set */
    const int64_t *p2[2] = {g->prompt[0], g->prompt[1]};
    a = base;
    a.nprompts = 2;
    a.prompts = p2;
    a.n = 2;
    int left = 4;
    a.on_token = cancel_after;
    a.ud = &left;
    CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
    if (r) {
        int64_t total = 0, cancelled = 0;
        for (int64_t i = 0; i < r->nseq; i++) {
            total += r->seqs[i].n_ids;
            cancelled += r->seqs[i].finish == DS4_FINISH_CANCELLED;
        }
        CHECK(total == 4 && cancelled == 4, "cancel from on_token: %lld tokens, %lld cancelled", (long long)total,
              (long long)cancelled);
        ds4_gen_result_free(r);
    }
    volatile int flag = 1;
    a.on_token = NULL;
    a.cancel = &flag;
    CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
    if (r) {
        CHECK(r->seqs[0].n_ids == 0 && r->seqs[3].finish == DS4_FINISH_CANCELLED, "pre-set cancel flag");
        ds4_gen_result_free(r);
    }
}

static void records(ds4_model *m, const char *name, const char *dir, const greedy_fx *g) {
    ds4_error err = {0};
    const ds4_config *c = ds4_model_config(m);
    const int64_t L = c->num_hidden_layers, K = c->num_experts_per_tok, E = c->n_routed_experts;
    const int64_t ncsa = ds4_model_csa_layers(m), topk = c->index_topk;
    const int64_t *prompts[MAXP] = {g->prompt[0], g->prompt[1]};
    ds4_gen_args a = {.nprompts = MAXP, .prompts = prompts, .prompt_lens = g->plen, .n = 2, .max_new_tokens = 25,
                      .ignore_eos = 1, .seed = 3, .sampling = {.temperature = 1, .top_p = 1},
                      .record_experts = 1, .record_index = 1, .prefill_chunk = 4};
    ds4_gen_result *r = NULL;
    CHECK_OK(ds4_generate(m, &a, &r, &err), &err);
    ds4_checkpoint *ck = NULL;
    CHECK_OK(ds4_checkpoint_open(dir, &ck, &err), &err);
    if (!r || !ck) goto out;
    int64_t hash_checked = 0, picks_checked = 0;
    for (int64_t i = 0; i < r->nseq; i++) {
        const ds4_gen_seq *s = &r->seqs[i];
        CHECK(s->n_rows == s->prompt_len + s->n_ids - 1, "n_rows %lld", (long long)s->n_rows);
        CHECK(s->experts && (ncsa == 0 || s->index_picks), "records missing");
        if (!s->experts) continue;
        for (int64_t t = 0; t < s->n_rows; t++) {
            const int64_t tokid = t < s->prompt_len ? prompts[s->prompt_index][t] : s->ids[t - s->prompt_len];
            for (int64_t li = 0; li < L; li++) {
                const int32_t *ex = s->experts + (t * L + li) * K;
                for (int64_t k = 0; k < K; k++) CHECK(ex[k] >= 0 && ex[k] < E, "expert %d", ex[k]);
                if (!c->layer_is_hash[li]) continue;
                char tn[128];
                const ds4_st_entry *e = NULL; /* official (ffn) or HF module (mlp) spelling */
                for (int sp = 0; sp < 2 && !e; sp++) {
                    snprintf(tn, sizeof tn, "layers.%lld.%s.gate.tid2eid", (long long)li, sp ? "mlp" : "ffn");
                    for (size_t q = 0; q < ds4_checkpoint_count(ck) && !e; q++) {
                        const ds4_st_entry *x = ds4_checkpoint_entry_at(ck, q);
                        const size_t nl = strlen(x->name), tl = strlen(tn);
                        if (nl >= tl && strcmp(x->name + nl - tl, tn) == 0) e = x;
                    }
                }
                CHECK(e && e->dtype == DS4_I64, "%s: no I64 tensor ending in %s", name, tn);
                if (!e) continue;
                for (int64_t k = 0; k < K; k++) {
                    int64_t want;
                    memcpy(&want, (const char *)e->data + (size_t)(tokid * K + k) * 8, 8);
                    CHECK(ex[k] == want, "%s layer %lld token %lld slot %lld: expert %d, tid2eid %lld", name,
                          (long long)li, (long long)tokid, (long long)k, ex[k], (long long)want);
                    hash_checked++;
                }
            }
            for (int64_t ci = 0; ci < ncsa; ci++) {
                const int32_t *p = s->index_picks + (t * ncsa + ci) * topk;
                const int64_t valid = (t + 1) / c->compress_rate_csa, want = valid < topk ? valid : topk;
                int64_t got = 0;
                for (int64_t k = 0; k < topk; k++) {
                    if (p[k] < 0) continue;
                    got++;
                    CHECK(p[k] < valid, "pick %d not causal at position %lld", p[k], (long long)t);
                    for (int64_t q = 0; q < k; q++) CHECK(p[q] != p[k], "pick %d twice", p[k]);
                }
                CHECK(got == want, "position %lld: %lld picks, want %lld", (long long)t, (long long)got, (long long)want);
                picks_checked++;
            }
        }
        if (s->sample_index == 1) /* samples share the prompt's prefill: identical prompt rows */
            CHECK(memcmp(s->experts, r->seqs[i - 1].experts, (size_t)(s->prompt_len * L * K) * sizeof(int32_t)) == 0,
                  "samples' prompt routing differs");
    }
    printf("  %-8s routing records: %lld hash slots equal tid2eid, %lld indexer rows checked\n", name,
           (long long)hash_checked, (long long)picks_checked);
out:
    ds4_checkpoint_close(ck);
    ds4_gen_result_free(r);
}

static void bad_args(ds4_model *m) {
    ds4_error err = {0};
    ds4_gen_result *r = NULL;
    const int64_t p[3] = {1, 2, 3}, bad[2] = {1, 1 << 20}, *ps[1] = {p}, *pb[1] = {bad}, len3 = 3, len0 = 0, len2 = 2;
    const ds4_gen_args ok = {.nprompts = 1, .prompts = ps, .prompt_lens = &len3, .n = 1, .max_new_tokens = 2, .sampling = {.top_p = 1}};
    ds4_gen_args a = ok;
    a.prompt_lens = &len0;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    a = ok;
    a.prompts = pb;
    a.prompt_lens = &len2;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "vocabulary") != NULL, "message: %s", err.msg);
    a = ok;
    a.sampling.temperature = -1;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    a = ok;
    a.sampling.top_p = 1.5;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    a = ok;
    a.n = 0;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    a = ok;
    a.max_new_tokens = 0;
    CHECK_STATUS(ds4_generate(m, &a, &r, &err), DS4_ERR_ARG, &err);
    CHECK(r == NULL, "no result on error");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: test_generate FIXTURES_DIR\n");
        return 2;
    }
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    if (!eng) return ds4t_finish("test_generate");
    const char *names[3] = {"tiny_a", "tiny_b", "tiny_hf"};
    for (int k = 0; k < 3; k++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", argv[1], names[k]);
        ds4_model *m = NULL;
        CHECK_OK(ds4_model_load(eng, dir, &m, &err), &err);
        greedy_fx g;
        if (m && load_greedy(dir, &g)) {
            greedy_vs_transformers(m, names[k], &g);
            teacher_forcing(m, names[k], &g);
            stops(m, names[k], &g);
            records(m, names[k], dir, &g);
            if (k == 0) bad_args(m);
        }
        ds4_model_free(m);
    }
    ds4_engine_free(eng);
    return ds4t_finish("test_generate");
}
