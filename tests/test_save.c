/* test_save.c — ds4_model_save: the tensor names transformers' save_pretrained writes, exact round trips, the
 * config, the options, and atomicity under a killed writer.
 *
 * References, none of them produced by the code under test:
 *   - tests/fixtures/<name>/names.txt: the names, shapes and dtypes save_pretrained (transformers 5.17) wrote
 *     for the fixture (tiny_a with MTP appended, tiny_b sharded); the saved file must hold exactly that set.
 *   - the loaded fixture model itself: the saved directory must load to bit-identical parameters and logits,
 *     and its logits must stay within the forward test's bound of transformers' reference logits.
 *   - BF16 saves are compared with a rounding written here (round to nearest even on the top 16 bits).
 * A forked child that is SIGKILLed at spread-out moments during a save must leave either no directory or a
 * complete one. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testlib.h"


static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b) b[n] = 0;
    fclose(f);
    return b;
}

static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs(s, f);
        fclose(f);
    }
}

/* Entries of a directory other than . and .., as a count. */
static int count_entries(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", dir);
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (p) {
        if (fscanf(p, "%d", &n) != 1) n = -1;
        pclose(p);
    }
    return n;
}

static int cmp_strp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* names.txt lines "file\tname\t[a, b]\ttorch.float32" -> "name [a, b] F32", sorted. */
static char **reference_names(const char *dir, size_t *n) {
    char *text = slurp(ds4t_path(dir, "names.txt"));
    *n = 0;
    if (!text) return NULL;
    size_t cap = 1024;
    char **out = malloc(cap * sizeof *out);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char *f1 = strchr(line, '\t');
        char *f2 = f1 ? strchr(f1 + 1, '\t') : NULL;
        char *f3 = f2 ? strchr(f2 + 1, '\t') : NULL;
        if (!f3) continue;
        *f2 = *f3 = 0;
        const char *dt = !strcmp(f3 + 1, "torch.float32") ? "F32" : !strcmp(f3 + 1, "torch.int64") ? "I64" : f3 + 1;
        char buf[512];
        snprintf(buf, sizeof buf, "%s %s %s", f1 + 1, f2 + 1, dt);
        if (*n == cap) out = realloc(out, (cap *= 2) * sizeof *out);
        out[(*n)++] = strdup(buf);
    }
    free(text);
    qsort(out, *n, sizeof *out, cmp_strp);
    return out;
}

/* The same form for every tensor of a saved model.safetensors. */
static char **saved_names(const char *dir, size_t *n) {
    ds4_st_file *f = NULL;
    ds4_error err = {0};
    *n = 0;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "model.safetensors"), &f, &err), &err);
    if (!f) return NULL;
    size_t c = ds4_st_count(f);
    char **out = malloc((c ? c : 1) * sizeof *out);
    for (size_t i = 0; i < c; i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        char buf[512];
        int o = snprintf(buf, sizeof buf, "%s [", e->name);
        for (int32_t d = 0; d < e->ndim; d++) o += snprintf(buf + o, sizeof buf - (size_t)o, d ? ", %lld" : "%lld", (long long)e->shape[d]);
        snprintf(buf + o, sizeof buf - (size_t)o, "] %s", ds4_dtype_name(e->dtype));
        out[i] = strdup(buf);
    }
    *n = c;
    ds4_st_close(f);
    qsort(out, *n, sizeof *out, cmp_strp);
    return out;
}

static void free_list(char **v, size_t n) {
    for (size_t i = 0; i < n; i++) free(v[i]);
    free(v);
}

static void check_names(const char *fixture_dir, const char *saved, const char *fx) {
    size_t nr, ns;
    char **ref = reference_names(fixture_dir, &nr), **got = saved_names(saved, &ns);
    CHECK(nr > 0, "%s: names.txt is empty or missing", fx);
    CHECK(nr == ns, "%s: saved %zu tensors, save_pretrained wrote %zu", fx, ns, nr);
    size_t i = 0, j = 0, shown = 0;
    while ((i < nr || j < ns) && shown < 10) {
        int c = i == nr ? 1 : j == ns ? -1 : strcmp(ref[i], got[j]);
        if (c == 0) {
            i++, j++;
            continue;
        }
        CHECK(0, "%s: %s '%s'", fx, c < 0 ? "missing (save_pretrained has it)" : "unexpected (save_pretrained lacks it)",
              c < 0 ? ref[i] : got[j]);
        if (c < 0) i++;
        else j++;
        shown++;
    }
    printf("  %-8s names: %zu tensors, %s save_pretrained's\n", fx, ns, nr == ns && shown == 0 ? "identical to" : "DIFFERENT from");
    free_list(ref, nr);
    free_list(got, ns);
}

/* Every parameter bit-identical (same canonical names, same order: same config). */
static int same_params(const ds4_model *a, const ds4_model *b, const char *fx) {
    size_t n = ds4_model_tensor_count(a);
    if (n != ds4_model_tensor_count(b)) {
        CHECK(0, "%s: %zu vs %zu tensors", fx, n, ds4_model_tensor_count(b));
        return 0;
    }
    ds4_error err = {0};
    for (size_t i = 0; i < n; i++) {
        const char *na, *nb;
        ds4_tensor va, vb;
        ds4_model_tensor_at(a, i, &na, &va, &err);
        ds4_model_tensor_at(b, i, &nb, &vb, &err);
        if (strcmp(na, nb) || va.nbytes != vb.nbytes || memcmp(va.data, vb.data, va.nbytes)) {
            CHECK(0, "%s: tensor %s differs after the round trip", fx, na);
            return 0;
        }
    }
    return 1;
}

static float ref_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return x; /* inf / nan kept */
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float y;
    memcpy(&y, &u, 4);
    return y;
}

typedef struct io_data {
    int64_t B, S, V;
    int64_t *ids;
    const float *ref;
    ds4_st_file *f;
} io_data;

static int load_io(const char *dir, int64_t V, io_data *io) {
    ds4_error err = {0};
    memset(io, 0, sizeof *io);
    CHECK_OK(ds4_st_open(ds4t_path(dir, "io.safetensors"), &io->f, &err), &err);
    if (!io->f) return 0;
    const ds4_st_entry *ids = ds4_st_find(io->f, "input_ids"), *lg = ds4_st_find(io->f, "logits");
    CHECK(ids && lg && ids->dtype == DS4_I64 && lg->dtype == DS4_F32, "io.safetensors: input_ids / logits");
    if (!ids || !lg) return 0;
    io->B = ids->shape[0], io->S = ids->shape[1], io->V = V;
    io->ids = malloc((size_t)(io->B * io->S) * 8);
    memcpy(io->ids, ids->data, (size_t)(io->B * io->S) * 8);
    io->ref = lg->data;
    return 1;
}

static float *run_logits(ds4_model *m, const io_data *io, float **mtp) {
    ds4_error err = {0};
    float *out = malloc((size_t)(io->B * io->S * io->V) * 4);
    if (mtp) *mtp = ds4_model_has_mtp(m) ? malloc((size_t)(io->B * (io->S - 1) * io->V) * 4) : NULL;
    ds4_forward_args a = {.ids = io->ids, .batch = io->B, .seq = io->S, .logits = out, .mtp_logits = mtp ? *mtp : NULL};
    CHECK_OK(ds4_model_forward(m, &a, NULL, &err), &err);
    return out;
}

static void round_trip(ds4_engine *eng, const char *fixtures, const char *fx, const char *tmp, int names_ref) {
    ds4_error err = {0};
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s/%s", fixtures, fx);
    snprintf(dst, sizeof dst, "%s/saved_%s", tmp, fx);
    ds4_model *m = NULL, *m2 = NULL;
    CHECK_OK(ds4_model_load(eng, src, &m, &err), &err);
    if (!m) return;
    CHECK_OK(ds4_model_save(m, dst, &err), &err);
    if (names_ref) check_names(src, dst, fx);
    /* (c) the config */
    ds4_config c2;
    CHECK_OK(ds4_config_load(dst, &c2, &err), &err);
    CHECK(memcmp(&c2, ds4_model_config(m), sizeof c2) == 0, "%s: saved config.json parses to a different config", fx);
    char *cj = slurp(ds4t_path(dst, "config.json"));
    CHECK(cj && strstr(cj, "\"dtype\": \"float32\""), "%s: config.json lacks \"dtype\": \"float32\"", fx);
    free(cj);
    /* (b) weights and logits */
    CHECK_OK(ds4_model_load(eng, dst, &m2, &err), &err);
    io_data io;
    if (m2 && load_io(src, ds4_model_config(m)->vocab_size, &io)) {
        CHECK(ds4_model_has_mtp(m2) == ds4_model_has_mtp(m), "%s: MTP weights lost", fx);
        int same = same_params(m, m2, fx);
        float *mtp1 = NULL, *mtp2 = NULL;
        float *l1 = run_logits(m, &io, &mtp1), *l2 = run_logits(m2, &io, &mtp2);
        const int64_t n = io.B * io.S * io.V;
        CHECK(memcmp(l1, l2, (size_t)n * 4) == 0, "%s: logits of the saved model are not bit-identical", fx);
        if (mtp1 && mtp2)
            CHECK(memcmp(mtp1, mtp2, (size_t)(io.B * (io.S - 1) * io.V) * 4) == 0, "%s: MTP logits differ", fx);
        double d = 0, r = 0;
        for (int64_t i = 0; i < n; i++) {
            double x = fabs((double)l2[i] - (double)io.ref[i]);
            if (!(x <= d)) d = x;
            if (fabs((double)io.ref[i]) > r) r = fabs((double)io.ref[i]);
        }
        double tol = 1e-4 * (r > 1 ? r : 1);
        CHECK(d <= tol, "%s: saved model's logits differ from transformers' by %g > %g", fx, d, tol);
        printf("  %-8s params %s, logits bit-identical %s, max|d| vs transformers %.3g (tol %.3g)%s\n", fx,
               same ? "identical" : "DIFFER", memcmp(l1, l2, (size_t)n * 4) ? "NO" : "yes", d, tol,
               mtp1 ? ", MTP logits identical" : "");
        free(l1), free(l2), free(mtp1), free(mtp2), free(io.ids);
        ds4_st_close(io.f);
    }
    ds4_model_free(m2);
    ds4_model_free(m);
}

/* Options, refusals and the absence of leftovers. */
static void options(ds4_engine *eng, const char *fixtures, const char *tmp) {
    ds4_error err = {0};
    char src[4096], dir[4096], path[4200];
    snprintf(src, sizeof src, "%s/tiny_a", fixtures);
    snprintf(dir, sizeof dir, "%s/opts/nested/out", tmp); /* missing parents are created */
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, src, &m, &err), &err);
    if (!m) return;
    CHECK_OK(ds4_model_save(m, dir, &err), &err);
    snprintf(path, sizeof path, "%s/opts/nested", tmp);
    CHECK(count_entries(path) == 1, "after a save, %s holds only the saved directory (%d entries)", path,
          count_entries(path));
    /* an existing non-empty directory is refused without overwrite, and left alone */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct stat before, after;
    stat(path, &before);
    CHECK_STATUS(ds4_model_save(m, dir, &err), DS4_ERR_IO, &err);
    CHECK(strstr(err.msg, "overwrite") && strstr(err.msg, dir), "refusal names the directory and the option: %s",
          err.msg);
    stat(path, &after);
    CHECK(before.st_ino == after.st_ino && before.st_size == after.st_size, "a refused save touched %s", path);
    /* overwrite replaces it (BF16 this time, so the replacement is visible) */
    ds4_save_options o = {.dtype = DS4_BF16, .overwrite = 1};
    CHECK_OK(ds4_model_save_opts(m, dir, &o, &err), &err);
    snprintf(path, sizeof path, "%s/opts/nested", tmp);
    CHECK(count_entries(path) == 1, "after an overwrite, no .tmp-/.old- sibling is left (%d entries)",
          count_entries(path));
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "model.safetensors"), &f, &err), &err);
    if (f) {
        size_t nbf = 0, ni64 = 0, other = 0;
        for (size_t i = 0; i < ds4_st_count(f); i++) {
            const ds4_st_entry *e = ds4_st_entry_at(f, i);
            if (e->dtype == DS4_BF16) nbf++;
            else if (e->dtype == DS4_I64 && strstr(e->name, "tid2eid")) ni64++;
            else other++;
        }
        CHECK(nbf > 0 && ni64 == 2 && other == 0, "BF16 save: %zu BF16, %zu I64 tid2eid, %zu other", nbf, ni64, other);
        ds4_st_close(f);
    }
    char *cj = slurp(ds4t_path(dir, "config.json"));
    CHECK(cj && strstr(cj, "\"dtype\": \"bfloat16\""), "BF16 save: config.json says bfloat16");
    free(cj);
    ds4_model *mb = NULL;
    CHECK_OK(ds4_model_load(eng, dir, &mb, &err), &err);
    if (mb) {
        size_t bad = 0;
        for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
            ds4_tensor va, vb;
            ds4_model_tensor_at(m, i, NULL, &va, &err);
            ds4_model_tensor_at(mb, i, NULL, &vb, &err);
            int64_t k = ds4_tensor_numel(&va);
            for (int64_t j = 0; j < k; j++) {
                if (va.dtype == DS4_F32) {
                    float want = ref_bf16(((const float *)va.data)[j]), got = ((const float *)vb.data)[j];
                    if (memcmp(&want, &got, 4)) bad++;
                } else if (((const int32_t *)va.data)[j] != ((const int32_t *)vb.data)[j]) {
                    bad++;
                }
            }
        }
        CHECK(bad == 0, "BF16 save: %zu elements are not the round-to-nearest-even value", bad);
        ds4_model_free(mb);
    }
    /* a foreign file: refused even with overwrite, and kept */
    snprintf(path, sizeof path, "%s/notes.txt", dir);
    write_text(path, "mine\n");
    CHECK_STATUS(ds4_model_save_opts(m, dir, &o, &err), DS4_ERR_IO, &err);
    CHECK(strstr(err.msg, "notes.txt") != NULL, "refusal names the foreign file: %s", err.msg);
    CHECK(ds4t_exists(path), "the foreign file survived");
    /* a path that is a regular file */
    CHECK_STATUS(ds4_model_save(m, path, &err), DS4_ERR_IO, &err);
    /* an unsupported dtype */
    ds4_save_options bad = {.dtype = DS4_I8};
    snprintf(path, sizeof path, "%s/opts/i8", tmp);
    CHECK_STATUS(ds4_model_save_opts(m, path, &bad, &err), DS4_ERR_ARG, &err);
    CHECK(!ds4t_exists(path), "a refused save created %s", path);
    CHECK_STATUS(ds4_model_save(m, "/", &err), DS4_ERR_ARG, &err);
    /* an empty existing directory is simply replaced */
    snprintf(path, sizeof path, "%s/opts/empty", tmp);
    mkdir(path, 0755);
    CHECK_OK(ds4_model_save(m, path, &err), &err);
    CHECK(ds4t_exists(ds4t_path(path, "model.safetensors")), "save into an empty directory");
    ds4_model_free(m);
}

/* A model with tied embeddings has no head.weight, as save_pretrained writes it. */
static void tied(ds4_engine *eng, const char *fixtures, const char *tmp) {
    ds4_error err = {0};
    ds4_config c;
    char src[4096], dir[4096];
    snprintf(src, sizeof src, "%s/tiny_hf", fixtures);
    snprintf(dir, sizeof dir, "%s/tied", tmp);
    CHECK_OK(ds4_config_load(src, &c, &err), &err);
    c.tie_word_embeddings = 1;
    ds4_model *m = NULL, *m2 = NULL;
    CHECK_OK(ds4_model_create_random(eng, &c, 7, &m, &err), &err);
    if (!m) return;
    CHECK_OK(ds4_model_save(m, dir, &err), &err);
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(dir, "model.safetensors"), &f, &err), &err);
    if (f) {
        CHECK(!ds4_st_find(f, "head.weight") && !ds4_st_find(f, "lm_head.weight") && ds4_st_find(f, "model.embed_tokens.weight"),
              "tied: only the embedding is written");
        ds4_st_close(f);
    }
    CHECK_OK(ds4_model_load(eng, dir, &m2, &err), &err);
    if (m2) {
        CHECK(ds4_model_config(m2)->tie_word_embeddings == 1, "tied: config keeps tie_word_embeddings");
        same_params(m, m2, "tied");
    }
    ds4_model_free(m2);
    ds4_model_free(m);
}

/* SIGKILL a child at spread-out moments of a save: the directory is absent or complete, never partial. */
static void killed_writer(ds4_engine *eng, const char *fixtures, const char *tmp) {
    ds4_error err = {0};
    char src[4096], base[4096], dir[4200];
    snprintf(src, sizeof src, "%s/tiny_a", fixtures);
    snprintf(base, sizeof base, "%s/kill", tmp);
    mkdir(base, 0755);
    ds4_model *m = NULL;
    CHECK_OK(ds4_model_load(eng, src, &m, &err), &err);
    if (!m) return;
    /* How long a save takes in a freshly forked child (copy-on-write faults, sanitizers and disks vary): the
     * kills below are timed from the moment the child says it starts saving. */
    double dt = 0;
    enum { TRIES = 24 };
    int absent = 0, complete = 0;
    for (int k = -1; k < TRIES; k++) {
        snprintf(dir, sizeof dir, "%s/run%02d", base, k + 1);
        int fds[2];
        if (pipe(fds) != 0) break;
        pid_t pid = fork();
        if (pid == 0) {
            ds4_error e2 = {0};
            close(fds[0]);
            if (write(fds[1], "s", 1) != 1) _exit(4);
            _exit(ds4_model_save(m, dir, &e2) == DS4_OK ? 0 : 3);
        }
        close(fds[1]);
        CHECK(pid > 0, "fork: %s", strerror(errno));
        if (pid < 0) {
            close(fds[0]);
            break;
        }
        char byte;
        struct timespec t0, t1;
        CHECK(read(fds[0], &byte, 1) == 1, "child start");
        clock_gettime(CLOCK_MONOTONIC, &t0);
        close(fds[0]);
        int status;
        if (k < 0) { /* the timing run: not killed */
            waitpid(pid, &status, 0);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the timing child's save failed");
            ds4t_rm_rf(dir);
            continue;
        }
        /* from "at once" to "about when it finishes"; the last two wait long enough to finish for sure */
        double wait_s = k >= TRIES - 2 ? 4 * dt + 0.02 : dt * 1.2 * k / (TRIES - 3);
        struct timespec ts = {(time_t)wait_s, (long)((wait_s - (double)(time_t)wait_s) * 1e9)};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        if (!ds4t_exists(dir)) {
            absent++;
            continue;
        }
        ds4_model *m2 = NULL;
        CHECK_OK(ds4_model_load(eng, dir, &m2, &err), &err);
        if (m2 && same_params(m, m2, "killed writer")) complete++;
        ds4_model_free(m2);
    }
    printf("  killed writer: %d of %d runs left no directory, %d a complete one (one save: %.1f ms)\n", absent, TRIES,
           complete, dt * 1e3);
    CHECK(absent + complete == TRIES, "a killed save left a partial directory");
    /* the spread must have covered both outcomes, or the test proved nothing */
    CHECK(absent > 0 && complete > 0, "kills were not spread over the save (%d absent, %d complete)", absent, complete);
    ds4_model_free(m);
}

static void names_unit(void) {
    /* hand-written from names.txt */
    static const char *const pairs[][2] = {
        {"embed.weight", "model.embed_tokens.weight"},
        {"head.weight", "head.weight"},
        {"norm.weight", "model.norm.weight"},
        {"hc_head_fn", "model.hc_head.hc_fn"},
        {"layers.12.attn.kv_norm.weight", "model.layers.12.attn.norm.weight"},
        {"layers.1.attn.compressor.norm.weight", "model.layers.1.attn.compressor.norm.weight"},
        {"layers.0.ffn.gate.tid2eid", "model.layers.0.ffn.gate.tid2eid"},
        {"mtp.0.attn.kv_norm.weight", "mtp.0.attn.kv_norm.weight"},
        {"mtp.0.hc_head_base", "mtp.0.hc_head_base"},
    };
    char out[128];
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        int ok = ds4_hf_save_name(pairs[i][0], out, sizeof out);
        CHECK(ok && !strcmp(out, pairs[i][1]), "save name of %s: %s, want %s", pairs[i][0], ok ? out : "(none)",
              pairs[i][1]);
    }
    CHECK(!ds4_hf_save_name("model.norm.weight", out, sizeof out), "non-canonical names are refused");
    CHECK(!ds4_hf_save_name("layers.x.attn.wq_a.weight", out, sizeof out), "bad layer index refused");
    CHECK(!ds4_hf_save_name("layers.0.attn.kv_norm.weight", out, 10), "too small a buffer is refused");
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    char tmp[] = "/tmp/ds4_test_save_XXXXXX";
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    ds4_engine *eng = NULL;
    ds4_error err = {0};
    ds4_engine_options eo = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&eo, &eng, &err), &err);
    if (eng) {
        names_unit();
        round_trip(eng, fixtures, "tiny_a", tmp, 1);
        round_trip(eng, fixtures, "tiny_b", tmp, 1);
        round_trip(eng, fixtures, "tiny_hf", tmp, 0);
        options(eng, fixtures, tmp);
        tied(eng, fixtures, tmp);
        killed_writer(eng, fixtures, tmp);
        ds4_engine_free(eng);
    }
    if (getenv("DS4_KEEP_SAVED")) printf("kept %s\n", tmp);
    else ds4t_rm_rf(tmp);
    return ds4t_finish("test_save");
}
