#define _XOPEN_SOURCE 700 /* nftw */
#include "testlib.h"

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int ds4t_failures = 0;
int ds4t_checks = 0;

int ds4t_finish(const char *name) {
    printf("%s: %d passed, %d failed\n", name, ds4t_checks - ds4t_failures, ds4t_failures);
    return ds4t_failures ? 1 : 0;
}

const char *ds4t_path(const char *dir, const char *file) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", dir, file);
    return buf;
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *f) {
    (void)sb, (void)flag, (void)f;
    return remove(p);
}

void ds4t_rm_rf(const char *path) { nftw(path, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

int ds4t_exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

int ds4t_load_fixture(ds4_engine *eng, const char *fixtures, const char *name, ds4_model **m, ds4_st_file **io,
                      ds4_forward_args *args) {
    ds4_error err = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", fixtures, name);
    CHECK_OK(ds4_model_load(eng, path, m, &err), &err);
    snprintf(path, sizeof path, "%s/%s/io.safetensors", fixtures, name);
    CHECK_OK(ds4_st_open(path, io, &err), &err);
    if (!*m || !*io) return 1;
    const ds4_st_entry *ids = ds4_st_find(*io, "input_ids"), *labels = ds4_st_find(*io, "labels");
    CHECK(ids && labels && ids->dtype == DS4_I64 && ids->ndim == 2, "%s: io.safetensors input_ids/labels", name);
    if (!ids || !labels) return 1;
    *args = (ds4_forward_args){.ids = ids->data, .batch = ids->shape[0], .seq = ids->shape[1], .labels = labels->data};
    return 0;
}

double ds4t_max_abs_diff(const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = fabs((double)a[i] - (double)b[i]);
        if (!(x <= d)) d = x; /* NaN sticks */
    }
    return d;
}

void ds4t_step_logits(ds4_model *m, const int64_t *ids, int64_t S, const int64_t *chunks, int nchunks, float *out) {
    const int64_t V = ds4_model_config(m)->vocab_size;
    ds4_error err = {0};
    ds4_cache *c = NULL;
    CHECK_OK(ds4_cache_create(m, S, &c, &err), &err);
    if (!c) return;
    for (int64_t p = 0, k = 0; p < S; k++) {
        int64_t n = chunks[k % nchunks] < S - p ? chunks[k % nchunks] : S - p;
        ds4_step_args sa = {.nseq = 1, .caches = &c, .counts = &n, .ids = ids + p, .logits = out + p * V};
        CHECK_OK(ds4_model_step(m, &sa, &err), &err);
        p += n;
    }
    ds4_cache_free(c);
}

int64_t ds4t_rollout_mismatch(ds4_model *m, const ds4_gen_result *r, const int64_t *const *prompts, int64_t *scored) {
    ds4_error err = {0};
    int64_t mism = 0;
    *scored = 0;
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    for (int64_t i = 0; r && i < r->nseq; i++) {
        const ds4_gen_seq *q = &r->seqs[i];
        const int64_t L = q->prompt_len + q->n_ids;
        int64_t seq[128], lab[128];
        float lp[128];
        CHECK(L <= 128, "rollout_mismatch: sequence %lld has %lld tokens, more than 128", (long long)i, (long long)L);
        if (L > 128) continue;
        memcpy(seq, prompts[q->prompt_index], (size_t)q->prompt_len * 8);
        memcpy(seq + q->prompt_len, q->ids, (size_t)q->n_ids * 8);
        for (int64_t t = 0; t < L; t++) lab[t] = t < q->prompt_len ? -100 : seq[t];
        ds4_forward_args at = {.ids = seq, .batch = 1, .seq = L, .labels = lab};
        CHECK_OK(ds4_model_forward_train(m, &at, NULL, &err), &err);
        CHECK_OK(ds4_model_logprobs(m, lp, NULL, &err), &err);
        for (int64_t j = 0; j < q->n_ids; j++, (*scored)++) mism += lp[q->prompt_len - 1 + j] != q->logprobs[j];
    }
    return mism;
}

int ds4t_main_fixtures(int argc, char **argv, const char *name,
                       void (*run)(ds4_engine *eng, const char *fixtures, const char *fixture)) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", name);
        return 2;
    }
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &eng, &err), &err);
    if (!eng) return ds4t_finish(name);
    static const char *const fixtures[] = {"tiny_a", "tiny_b", "tiny_hf"};
    for (int k = 0; k < 3; k++) run(eng, argv[1], fixtures[k]);
    ds4_engine_free(eng);
    return ds4t_finish(name);
}
