/* test_safetensors.c — the safetensors reader against files written by Python's safetensors (names.txt is
 * the independent reference), sharded checkpoints, writer round trips of every dtype, a table of malformed
 * headers (one per validation rule) and sharded-index errors. Run as `test_safetensors <fixtures_dir>`. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "testlib.h"

/* ------------------------------------------------------------------------------------------------ helpers */

static char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

static char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(p, 1, n, f);
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

static int write_text(const char *dir, const char *name, const char *text) {
    char *p = join(dir, name);
    int rc = p ? write_bytes(p, text, strlen(text)) : -1;
    free(p);
    return rc;
}

/* Flat temporary directories: unlink every entry, then the directory. */
static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char *p = join(dir, de->d_name);
            if (p) unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static char *make_tmpdir(void) {
    const char *base = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof tmpl, "%s/ds4_st_XXXXXX", base && *base ? base : "/tmp");
    char *d = mkdtemp(tmpl);
    CHECK(d != NULL, "mkdtemp %s: %s", tmpl, strerror(errno));
    return d ? xstrdup(d) : NULL;
}

static size_t count_dir_entries(const char *dir) {
    size_t n = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

static const char *torch_to_st(const char *t) {
    static const char *map[][2] = {
        {"torch.float32", "F32"},         {"torch.float16", "F16"},     {"torch.bfloat16", "BF16"},
        {"torch.float64", "F64"},         {"torch.int64", "I64"},       {"torch.int32", "I32"},
        {"torch.int16", "I16"},           {"torch.int8", "I8"},         {"torch.uint8", "U8"},
        {"torch.bool", "BOOL"},           {"torch.float8_e4m3fn", "F8_E4M3"},
        {"torch.float8_e5m2", "F8_E5M2"}, {"torch.float8_e8m0fnu", "F8_E8M0"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(map[i][0], t)) return map[i][1];
    return NULL;
}

/* One line of names.txt: "<file>\t<name>\t[d0, d1]\ttorch.<dtype>" (written by tests/gen_fixtures.py from
 * safetensors.torch.load_file). */
typedef struct {
    char file[256], name[256];
    int ndim;
    int64_t shape[DS4_MAX_DIMS];
    const char *dtype;
} ref_line;

static size_t load_names(const char *path, ref_line **out) {
    char *text = NULL;
    size_t len = 0, n = 0, cap = 0;
    ds4_error err;
    *out = NULL;
    CHECK_OK(ds4_read_file(path, 1 << 24, &text, &len, &err), &err);
    if (!text) return 0;
    ref_line *v = NULL;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *f[4];
        int nf = 0;
        char *s2 = NULL;
        for (char *tok = strtok_r(line, "\t", &s2); tok && nf < 4; tok = strtok_r(NULL, "\t", &s2)) f[nf++] = tok;
        CHECK(nf == 4, "names.txt line has %d fields", nf);
        if (nf != 4) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            ref_line *nv = realloc(v, cap * sizeof *v);
            if (!nv) break;
            v = nv;
        }
        ref_line *r = &v[n];
        memset(r, 0, sizeof *r);
        snprintf(r->file, sizeof r->file, "%s", f[0]);
        snprintf(r->name, sizeof r->name, "%s", f[1]);
        r->dtype = torch_to_st(f[3]);
        CHECK(r->dtype != NULL, "names.txt: unknown torch dtype %s", f[3]);
        const char *p = f[2];
        CHECK(*p == '[', "names.txt shape %s", f[2]);
        p++;
        while (*p && *p != ']' && r->ndim < DS4_MAX_DIMS) {
            char *end;
            r->shape[r->ndim++] = strtoll(p, &end, 10);
            p = end;
            while (*p == ',' || *p == ' ') p++;
        }
        n++;
    }
    free(text);
    *out = v;
    return n;
}

static int entry_matches(const ds4_st_entry *e, const ref_line *r) {
    if (!e || !r->dtype || strcmp(ds4_dtype_name(e->dtype), r->dtype) || e->ndim != r->ndim) return 0;
    for (int i = 0; i < r->ndim; i++)
        if (e->shape[i] != r->shape[i]) return 0;
    int64_t numel = 1;
    for (int i = 0; i < e->ndim; i++) numel *= e->shape[i];
    return e->nbytes == (size_t)numel * ds4_dtype_size(e->dtype);
}

/* Offset order: consecutive entries tile the data area. */
static void check_offset_order(const ds4_st_file *f, const char *what) {
    size_t n = ds4_st_count(f);
    int ok = 1;
    for (size_t i = 1; i < n; i++) {
        const ds4_st_entry *a = ds4_st_entry_at(f, i - 1), *b = ds4_st_entry_at(f, i);
        if ((const char *)a->data + a->nbytes != (const char *)b->data) ok = 0;
    }
    CHECK(ok, "%s: entries are in offset order and contiguous", what);
    CHECK(ds4_st_entry_at(f, n) == NULL, "%s: entry_at(count) is NULL", what);
}

/* ------------------------------------------------------------------------------------------------ (a) fixtures */

static void test_fixture_tiny_a(const char *fixtures) {
    ds4_error err;
    char *dir = join(fixtures, "tiny_a");
    char *model = join(dir, "model.safetensors"), *io = join(dir, "io.safetensors"), *names = join(dir, "names.txt");
    ref_line *ref = NULL;
    size_t nref = load_names(names, &ref);
    CHECK(nref > 200, "tiny_a/names.txt has %zu lines", nref);

    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(model, &f, &err), &err);
    if (f) {
        CHECK(ds4_st_count(f) == nref, "model.safetensors holds %zu tensors, names.txt lists %zu", ds4_st_count(f),
              nref);
        size_t bad = 0;
        for (size_t i = 0; i < nref; i++) {
            CHECK(!strcmp(ref[i].file, "model.safetensors"), "names.txt file column %s", ref[i].file);
            const ds4_st_entry *e = ds4_st_find(f, ref[i].name);
            if (!entry_matches(e, &ref[i])) {
                bad++;
                fprintf(stderr, "  mismatch for %s\n", ref[i].name);
            }
        }
        CHECK(bad == 0, "%zu of %zu tensors differ from names.txt", bad, nref);
        CHECK(ds4_st_find(f, "no.such.tensor") == NULL && ds4_st_find(f, "") == NULL && ds4_st_find(f, NULL) == NULL,
              "find of a missing name");
        CHECK(ds4_st_metadata(f, "format") && !strcmp(ds4_st_metadata(f, "format"), "pt"), "metadata format=pt");
        CHECK(ds4_st_metadata(f, "nope") == NULL, "missing metadata key");
        check_offset_order(f, "tiny_a/model.safetensors");
        /* the first tensor starts right after the (8-byte aligned) header */
        const ds4_st_entry *e0 = ds4_st_entry_at(f, 0);
        CHECK(e0 && ((uintptr_t)e0->data % 8) == 0, "data area 8-byte aligned (Python pads the header)");
        const ds4_st_entry *w = ds4_st_find(f, "model.layers.0.attn.norm.weight");
        if (w) {
            float *v = malloc(w->nbytes);
            if (v) {
                CHECK_OK(ds4_convert_to_f32(w->dtype, w->data, w->shape[0], v, &err), &err);
                int finite = 1;
                for (int64_t i = 0; i < w->shape[0]; i++) finite &= isfinite(v[i]) != 0;
                CHECK(finite, "norm weight values are finite");
                free(v);
            }
        }
        ds4_st_close(f);
    }

    /* io.safetensors: known facts of the fixture generator (B=2, S=37, vocab 256, hc_mult 4, hidden 64) */
    f = NULL;
    CHECK_OK(ds4_st_open(io, &f, &err), &err);
    if (f) {
        const ds4_st_entry *ids = ds4_st_find(f, "input_ids"), *lab = ds4_st_find(f, "labels"),
                           *h0 = ds4_st_find(f, "hidden.0");
        CHECK(ids && ids->dtype == DS4_I64 && ids->ndim == 2 && ids->shape[0] == 2 && ids->shape[1] == 37,
              "input_ids I64 [2,37]");
        CHECK(lab && lab->dtype == DS4_I64 && lab->ndim == 2 && lab->nbytes == 2 * 37 * 8, "labels I64 [2,37]");
        CHECK(h0 && h0->dtype == DS4_F32 && h0->ndim == 4 && h0->shape[2] == 4 && h0->shape[3] == 64,
              "hidden.0 F32 [2,37,4,64]");
        if (ids && ids->nbytes == 2 * 37 * 8) {
            int in_range = 1;
            for (int i = 0; i < 74; i++) {
                int64_t t;
                memcpy(&t, (const char *)ids->data + 8 * i, 8);
                in_range &= t >= 0 && t < 256;
            }
            CHECK(in_range, "input_ids in [0, 256)");
        }
        check_offset_order(f, "tiny_a/io.safetensors");
        ds4_st_close(f);
    }

    /* The same file through ds4_st_open_memory */
    char *buf = NULL;
    size_t len = 0;
    CHECK_OK(ds4_read_file(model, (size_t)1 << 30, &buf, &len, &err), &err);
    if (buf) {
        f = NULL;
        CHECK_OK(ds4_st_open_memory(buf, len, &f, &err), &err);
        CHECK(ds4_st_count(f) == nref, "open_memory count");
        const ds4_st_entry *e = f ? ds4_st_find(f, "head.weight") : NULL;
        CHECK(e && (const char *)e->data >= buf && (const char *)e->data + e->nbytes <= buf + len,
              "open_memory entries point into the caller's buffer");
        ds4_st_close(f);
        free(buf);
    }

    /* As a checkpoint: the directory (model.safetensors chosen over io.safetensors) and the file itself */
    ds4_checkpoint *c = NULL;
    CHECK_OK(ds4_checkpoint_open(dir, &c, &err), &err);
    if (c) {
        CHECK(ds4_checkpoint_count(c) == nref, "tiny_a checkpoint count %zu", ds4_checkpoint_count(c));
        CHECK(ds4_checkpoint_find(c, "input_ids") == NULL, "io.safetensors is not part of the checkpoint");
        size_t bad = 0;
        for (size_t i = 0; i < nref; i++) bad += !entry_matches(ds4_checkpoint_find(c, ref[i].name), &ref[i]);
        CHECK(bad == 0, "tiny_a checkpoint: %zu mismatches", bad);
        ds4_checkpoint_close(c);
    }
    c = NULL;
    CHECK_OK(ds4_checkpoint_open(model, &c, &err), &err);
    CHECK(ds4_checkpoint_count(c) == nref, "checkpoint from a file path");
    ds4_checkpoint_close(c);

    /* tiny_hf is another single-file checkpoint written by Python */
    char *hf = join(fixtures, "tiny_hf"), *hfnames = join(hf, "names.txt");
    ref_line *href = NULL;
    size_t nh = load_names(hfnames, &href);
    c = NULL;
    CHECK_OK(ds4_checkpoint_open(hf, &c, &err), &err);
    if (c) {
        size_t bad = 0;
        for (size_t i = 0; i < nh; i++) bad += !entry_matches(ds4_checkpoint_find(c, href[i].name), &href[i]);
        CHECK(bad == 0 && ds4_checkpoint_count(c) == nh, "tiny_hf: %zu mismatches, %zu vs %zu tensors", bad,
              ds4_checkpoint_count(c), nh);
        ds4_checkpoint_close(c);
    }
    free(href);
    free(hf);
    free(hfnames);
    free(ref);
    free(dir);
    free(model);
    free(io);
    free(names);
}

/* ------------------------------------------------------------------------------------------------ (b) sharded */

static void test_fixture_tiny_b(const char *fixtures) {
    ds4_error err;
    char *dir = join(fixtures, "tiny_b"), *names = join(dir, "names.txt");
    ref_line *ref = NULL;
    size_t nref = load_names(names, &ref);
    CHECK(nref > 200, "tiny_b/names.txt has %zu lines", nref);
    ds4_checkpoint *c = NULL;
    CHECK_OK(ds4_checkpoint_open(dir, &c, &err), &err);
    if (c) {
        CHECK(ds4_checkpoint_count(c) == nref, "union of the shards has %zu tensors, names.txt %zu",
              ds4_checkpoint_count(c), nref);
        size_t bad = 0;
        for (size_t i = 0; i < nref; i++)
            if (!entry_matches(ds4_checkpoint_find(c, ref[i].name), &ref[i])) {
                bad++;
                fprintf(stderr, "  mismatch for %s\n", ref[i].name);
            }
        CHECK(bad == 0, "tiny_b: %zu mismatches", bad);
        /* entry_at is in name order and every entry is found by its name */
        int sorted = 1, found = 1;
        for (size_t i = 0; i < ds4_checkpoint_count(c); i++) {
            const ds4_st_entry *e = ds4_checkpoint_entry_at(c, i);
            if (i > 0 && strcmp(ds4_checkpoint_entry_at(c, i - 1)->name, e->name) >= 0) sorted = 0;
            if (ds4_checkpoint_find(c, e->name) != e) found = 0;
        }
        CHECK(sorted && found, "checkpoint entries sorted by name, find consistent");
        CHECK(ds4_checkpoint_entry_at(c, nref) == NULL && ds4_checkpoint_find(c, "x") == NULL, "out of range");
        CHECK(ds4_checkpoint_find(c, "input_ids") == NULL, "io.safetensors not included");
        ds4_checkpoint_close(c);
    }
    /* One shard alone, by path */
    char *shard = join(dir, "model-00015-of-00015.safetensors");
    size_t n15 = 0;
    for (size_t i = 0; i < nref; i++) n15 += !strcmp(ref[i].file, "model-00015-of-00015.safetensors");
    c = NULL;
    CHECK_OK(ds4_checkpoint_open(shard, &c, &err), &err);
    CHECK(ds4_checkpoint_count(c) == n15 && n15 > 0, "single shard: %zu tensors", n15);
    ds4_checkpoint_close(c);
    ds4_checkpoint_close(NULL);
    CHECK(ds4_checkpoint_count(NULL) == 0 && ds4_checkpoint_find(NULL, "a") == NULL, "NULL checkpoint");
    free(shard);
    free(ref);
    free(dir);
    free(names);
}

/* ------------------------------------------------------------------------------------------------ (c) round trip */

static ds4_tensor *mk(ds4_dtype dt, int32_t ndim, const int64_t *shape, double base) {
    ds4_tensor *t = NULL;
    ds4_error err;
    CHECK_OK(ds4_tensor_new(dt, ndim, shape, &t, &err), &err);
    if (!t) return NULL;
    int64_t n = ds4_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) ds4_tensor_set(t, i, base + (double)i * (i % 2 ? -1.0 : 1.0));
    return t;
}

static void test_round_trip(void) {
    ds4_error err;
    char *dir = make_tmpdir();
    if (!dir) return;
    char *path = join(dir, "rt.safetensors");
    enum { MAXT = 32 };
    const char *names[MAXT];
    ds4_tensor *ts[MAXT];
    char namebuf[MAXT][64];
    size_t n = 0;
    int64_t s23[2] = {2, 3}, s0[2] = {0, 4}, s30[3] = {3, 0, 2}, s1[1] = {5};
    for (int d = 0; d < DS4_DTYPE_COUNT; d++) {
        snprintf(namebuf[n], sizeof namebuf[n], "t.%s", ds4_dtype_name((ds4_dtype)d));
        names[n] = namebuf[n];
        ts[n++] = mk((ds4_dtype)d, 2, s23, 1 + d);
        snprintf(namebuf[n], sizeof namebuf[n], "scalar.%s", ds4_dtype_name((ds4_dtype)d));
        names[n] = namebuf[n];
        ts[n++] = mk((ds4_dtype)d, 0, NULL, 2);
    }
    names[n] = "empty.bf16";
    ts[n++] = mk(DS4_BF16, 2, s0, 0);
    names[n] = "empty.i64";
    ts[n++] = mk(DS4_I64, 3, s30, 0);
    /* names needing JSON escapes, non-ASCII UTF-8 and an odd byte count (unaligned following tensor) */
    names[n] = "we\"ird\\name\n\t\x01 é €";
    ts[n++] = mk(DS4_U8, 1, s1, 3);
    names[n] = "after.odd";
    ts[n++] = mk(DS4_F32, 1, s1, 0.25);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= ts[i] != NULL;
    CHECK(ok, "tensors created");
    if (!ok) goto done;

    CHECK_OK(ds4_st_write(path, n, names, (const ds4_tensor *const *)ts, &err), &err);
    CHECK(count_dir_entries(dir) == 1, "no temporary file left behind");
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(path, &f, &err), &err);
    if (f) {
        CHECK(ds4_st_count(f) == n, "count %zu of %zu", ds4_st_count(f), n);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            const ds4_st_entry *e = ds4_st_find(f, names[i]);
            int good = e && e->dtype == ts[i]->dtype && e->ndim == ts[i]->ndim && e->nbytes == ts[i]->nbytes &&
                       !memcmp(e->shape, ts[i]->shape, sizeof(int64_t) * (size_t)ts[i]->ndim) &&
                       (e->nbytes == 0 || !memcmp(e->data, ts[i]->data, e->nbytes));
            if (!good) {
                bad++;
                fprintf(stderr, "  round trip mismatch for %s\n", names[i]);
            }
        }
        CHECK(bad == 0, "%zu tensors differ after the round trip", bad);
        CHECK(ds4_st_metadata(f, "format") && !strcmp(ds4_st_metadata(f, "format"), "pt"), "writer metadata");
        check_offset_order(f, "round trip");
        /* the given order is the file order for non-empty tensors */
        const ds4_st_entry *first = ds4_st_entry_at(f, 0);
        CHECK(first && !strcmp(first->name, names[0]), "first tensor in file order is %s",
              first ? first->name : "(none)");
        CHECK(first && (uintptr_t)first->data % 8 == 0, "writer pads the header to 8 bytes");
        ds4_st_close(f);
    }
    /* header length is a multiple of 8 and the JSON is what Python expects to read */
    {
        char *buf = NULL;
        size_t len = 0;
        CHECK_OK(ds4_read_file(path, 1 << 20, &buf, &len, &err), &err);
        if (buf && len >= 8) {
            uint64_t hl = 0;
            for (int i = 7; i >= 0; i--) hl = (hl << 8) | (unsigned char)buf[i];
            CHECK(hl % 8 == 0 && hl + 8 <= len, "header length %llu", (unsigned long long)hl);
            CHECK(!memcmp(buf + 8, "{\"__metadata__\":{\"format\":\"pt\"}", 31), "header starts with metadata");
            CHECK(buf[8 + hl - 1] == ' ' || buf[8 + hl - 1] == '}', "header padded with spaces");
        }
        free(buf);
    }
    /* overwrite in place (rename over an existing file), then an empty file */
    CHECK_OK(ds4_st_write(path, 1, names, (const ds4_tensor *const *)ts, &err), &err);
    ds4_st_file *f1 = NULL;
    CHECK_OK(ds4_st_open(path, &f1, &err), &err);
    CHECK(ds4_st_count(f1) == 1, "overwritten file has 1 tensor");
    ds4_st_close(f1);
    CHECK_OK(ds4_st_write(path, 0, NULL, NULL, &err), &err);
    f1 = NULL;
    CHECK_OK(ds4_st_open(path, &f1, &err), &err);
    CHECK(f1 && ds4_st_count(f1) == 0 && ds4_st_entry_at(f1, 0) == NULL, "zero tensors");
    ds4_st_close(f1);

    /* writer argument errors */
    {
        const char *dup[2] = {"a", "a"};
        const ds4_tensor *two[2] = {ts[0], ts[1]};
        CHECK_STATUS(ds4_st_write(path, 2, dup, two, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, "'a'") != NULL, "duplicate name named: %s", err.msg);
        const char *meta[1] = {"__metadata__"};
        CHECK_STATUS(ds4_st_write(path, 1, meta, two, &err), DS4_ERR_ARG, &err);
        const char *badutf[1] = {"\xff\xfe"};
        CHECK_STATUS(ds4_st_write(path, 1, badutf, two, &err), DS4_ERR_ARG, &err);
        const char *surrogate[1] = {"\xed\xa0\x80"};
        CHECK_STATUS(ds4_st_write(path, 1, surrogate, two, &err), DS4_ERR_ARG, &err);
        const char *nul1[1] = {NULL};
        CHECK_STATUS(ds4_st_write(path, 1, nul1, two, &err), DS4_ERR_ARG, &err);
        const ds4_tensor *nult[1] = {NULL};
        CHECK_STATUS(ds4_st_write(path, 1, names, nult, &err), DS4_ERR_ARG, &err);
        ds4_tensor lie = *ts[0];
        lie.nbytes = 1; /* inconsistent with shape */
        const ds4_tensor *liep[1] = {&lie};
        CHECK_STATUS(ds4_st_write(path, 1, names, liep, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, names[0]) != NULL, "size mismatch names the tensor: %s", err.msg);
        char *nodir = join(dir, "missing/sub/x.safetensors");
        CHECK_STATUS(ds4_st_write(nodir, 1, names, (const ds4_tensor *const *)ts, &err), DS4_ERR_IO, &err);
        free(nodir);
        CHECK(count_dir_entries(dir) == 1, "failed writes leave nothing behind");
        f1 = NULL;
        CHECK_OK(ds4_st_open(path, &f1, &err), &err);
        CHECK(f1 && ds4_st_count(f1) == 0, "failed writes did not touch the existing file");
        ds4_st_close(f1);
    }
done:
    for (size_t i = 0; i < n; i++) ds4_tensor_release(ts[i]);
    free(path);
    rm_tree(dir);
    free(dir);
}

/* ------------------------------------------------------------------------------------------------ (d) malformed */

/* u64 LE header length + header + data_len bytes of data; `hlen_override` replaces the length field. */
static unsigned char *build(const char *header, size_t data_len, int use_override, uint64_t hlen_override,
                            size_t *out_len) {
    size_t hl = strlen(header);
    size_t len = 8 + hl + data_len;
    unsigned char *b = calloc(len ? len : 1, 1);
    if (!b) return NULL;
    uint64_t n = use_override ? hlen_override : hl;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < data_len; i++) b[8 + hl + i] = (unsigned char)i;
    *out_len = len;
    return b;
}

/* One header entry: "name":{"dtype":dt,"shape":shape,"data_offsets":[b,e]} */
#define T(name, dt, shape, b, e) \
    "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static void test_malformed(void) {
    static const struct {
        const char *what;
        const char *header;
        size_t data_len;
        int override;
        uint64_t hlen;
        size_t truncate; /* bytes removed from the end after building */
        const char *must_contain;
    } cases[] = {
        {"header length past EOF", "{}", 0, 1, 100, 0, "past the end"},
        {"huge header length", "{}", 0, 1, (uint64_t)1 << 40, 0, "limit"},
        {"header length UINT64_MAX", "{}", 0, 1, UINT64_MAX, 0, "limit"},
        {"header length 0 (empty JSON)", "{}", 0, 1, 0, 0, "JSON"},
        {"not an object", "[1,2]", 0, 0, 0, 0, "not a JSON object"},
        {"string root", "\"x\"", 0, 0, 0, 0, "not a JSON object"},
        {"invalid JSON", "{\"a\":", 0, 0, 0, 0, "JSON"},
        {"bad dtype", "{" T("w", "F31", "[1]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"dtype not a string", "{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, 0, 0, "'w'"},
        {"shape mismatch", "{" T("w", "F32", "[3,4]", 0, 40) "}", 40, 0, 0, 0, "'w'"},
        {"overlap", "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 12, 0, 0, 0, "'a'"},
        {"overlap names both", "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 12, 0, 0, 0,
         "'b'"},
        {"duplicate offsets", "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 0, 8) "}", 8, 0, 0, 0, "'b'"},
        {"gap", "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 8, 12) "}", 12, 0, 0, 0, "'a'"},
        {"gap names both", "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 8, 12) "}", 12, 0, 0, 0, "'b'"},
        {"gap at start", "{" T("a", "F32", "[1]", 4, 8) "}", 8, 0, 0, 0, "'a'"},
        {"trailing data", "{" T("a", "F32", "[1]", 0, 4) "}", 8, 0, 0, 0, "'a'"},
        {"no tensors but data", "{}", 4, 0, 0, 0, "no tensors"},
        {"offsets past end", "{" T("w", "F32", "[2]", 0, 8) "}", 4, 0, 0, 0, "'w'"},
        {"huge offsets", "{" T("w", "U8", "[1]", 9223372036854775806, 9223372036854775807) "}", 4, 0, 0, 0, "'w'"},
        {"offsets beyond int64", "{" T("w", "U8", "[1]", 0, 18446744073709551617) "}", 1, 0, 0, 0, "'w'"},
        {"begin > end", "{" T("w", "F32", "[0]", 8, 4) "}", 8, 0, 0, 0, "'w'"},
        {"negative offset", "{" T("w", "F32", "[1]", -4, 0) "}", 4, 0, 0, 0, "'w'"},
        {"fractional offset", "{" T("w", "F32", "[1]", 0, 4.0) "}", 4, 0, 0, 0, "'w'"},
        {"one offset", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4, 0, 0, 0, "'w'"},
        {"three offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,4]}}", 4, 0, 0, 0, "'w'"},
        {"negative dim", "{" T("w", "F32", "[-1]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"fractional dim", "{" T("w", "F32", "[1.5]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"dim beyond int64", "{" T("w", "U8", "[1e30]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"string dim", "{" T("w", "F32", "[\"1\"]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"too many dims", "{" T("w", "F32", "[1,1,1,1,1,1,1,1,1]", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"shape not an array", "{" T("w", "F32", "4", 0, 4) "}", 4, 0, 0, 0, "'w'"},
        {"size overflow", "{" T("w", "F64", "[4294967296,4294967296,4294967296]", 0, 8) "}", 8, 0, 0, 0, "'w'"},
        {"size overflow with zero later", "{" T("w", "F64", "[4294967296,4294967296,4294967296,0]", 0, 8) "}", 8, 0, 0,
         0, "'w'"},
        {"bytes overflow", "{" T("w", "F64", "[4611686018427387904]", 0, 8) "}", 8, 0, 0, 0, "'w'"},
        {"missing data_offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, 0, 0, 0, "'w'"},
        {"missing dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, 0, 0, "'w'"},
        {"extra key", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, 0, 0, 0, "'w'"},
        {"tensor not an object", "{\"w\":[1]}", 0, 0, 0, 0, "'w'"},
        {"non-string metadata", "{\"__metadata__\":{\"format\":1}}", 0, 0, 0, 0, "'format'"},
        {"metadata not an object", "{\"__metadata__\":\"pt\"}", 0, 0, 0, 0, "__metadata__"},
        {"truncated file", "{" T("w", "F32", "[4]", 0, 16) "}", 16, 0, 0, 1, "'w'"},
        {"truncated into the header", "{" T("w", "F32", "[4]", 0, 16) "}", 16, 0, 0, 40, "past the end"},
        {"duplicate key", "{" T("w", "F32", "[1]", 0, 4) "," T("w", "F32", "[1]", 4, 8) "}", 8, 0, 0, 0, "\"w\""},
        {"duplicate metadata", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, 0, 0, 0, "__metadata__"},
        {"nesting", "{\"w\":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}", 0, 0, 0, 0, "JSON"},
        {"invalid UTF-8 name", "{\"\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, 0, 0,
         "JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len = 0;
        unsigned char *b = build(cases[i].header, cases[i].data_len, cases[i].override, cases[i].hlen, &len);
        if (!b) continue;
        len -= cases[i].truncate < len ? cases[i].truncate : len;
        /* copy into an exact-size allocation so ASan catches any read past the end */
        unsigned char *exact = malloc(len ? len : 1);
        if (exact) memcpy(exact, b, len);
        free(b);
        if (!exact) continue;
        ds4_error err;
        memset(&err, 0, sizeof err);
        ds4_st_file *f = (ds4_st_file *)&err;
        ds4_status s = ds4_st_open_memory(exact, len, &f, &err);
        CHECK(s == DS4_ERR_FORMAT && f == NULL && err.code == DS4_ERR_FORMAT, "%s: got %s (%s)", cases[i].what,
              ds4_status_name(s), err.msg);
        CHECK(strstr(err.msg, cases[i].must_contain) != NULL, "%s: message lacks %s: %s", cases[i].what,
              cases[i].must_contain, err.msg);
        CHECK(s != DS4_OK || ds4_st_open_memory(exact, len, &f, NULL) == s, "%s: NULL err", cases[i].what);
        free(exact);
    }
    /* files too short for the length field, including via the file path */
    for (size_t len = 0; len < 8; len++) {
        unsigned char z[8] = {0};
        ds4_st_file *f = NULL;
        ds4_error err;
        CHECK_STATUS(ds4_st_open_memory(len ? z : NULL, len, &f, &err), DS4_ERR_FORMAT, &err);
    }
    char *dir = make_tmpdir();
    if (dir) {
        char *p = join(dir, "short.safetensors");
        ds4_error err;
        ds4_st_file *f = NULL;
        write_bytes(p, "abc", 0);
        CHECK_STATUS(ds4_st_open(p, &f, &err), DS4_ERR_FORMAT, &err);
        CHECK(strstr(err.msg, p) != NULL, "message names the file: %s", err.msg);
        write_bytes(p, "\x02\0\0\0\0\0\0\0{}", 10);
        CHECK_OK(ds4_st_open(p, &f, &err), &err);
        ds4_st_close(f);
        CHECK_STATUS(ds4_st_open(dir, &f, &err), DS4_ERR_IO, &err);
        char *missing = join(dir, "missing.safetensors");
        CHECK_STATUS(ds4_st_open(missing, &f, &err), DS4_ERR_NOT_FOUND, &err);
        free(missing);
        free(p);
        rm_tree(dir);
        free(dir);
    }
    /* valid edge cases */
    {
        static const struct {
            const char *what, *header;
            size_t data_len;
            size_t count;
        } good[] = {
            {"empty object, no data", "{}", 0, 0},
            {"trailing spaces", "{}        ", 0, 0},
            {"metadata only", "{\"__metadata__\":{\"a\":\"b\",\"c\":\"\"}}", 0, 0},
            {"zero-size tensors share offsets",
             "{" T("z1", "F32", "[0]", 4, 4) "," T("a", "F32", "[1]", 0, 4) "," T("z2", "BF16", "[3,0]", 4, 4) ","
             T("b", "U8", "[3]", 4, 7) "," T("z3", "I8", "[0]", 7, 7) "}",
             7, 5},
            {"scalar", "{" T("s", "F64", "[]", 0, 8) "}", 8, 1},
            {"8 dims", "{" T("s", "U8", "[1,1,1,1,1,1,1,2]", 0, 2) "}", 2, 1},
            {"huge zero-size shape", "{" T("s", "F64", "[9223372036854775807,0]", 0, 0) "}", 0, 1},
        };
        for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
            size_t len = 0;
            unsigned char *b = build(good[i].header, good[i].data_len, 0, 0, &len);
            ds4_st_file *f = NULL;
            ds4_error err;
            CHECK_OK(ds4_st_open_memory(b, len, &f, &err), &err);
            CHECK(ds4_st_count(f) == good[i].count, "%s: count %zu", good[i].what, ds4_st_count(f));
            if (f && i == 2) {
                CHECK(ds4_st_metadata(f, "a") && !strcmp(ds4_st_metadata(f, "a"), "b"), "metadata a=b");
                CHECK(ds4_st_metadata(f, "c") && !strcmp(ds4_st_metadata(f, "c"), ""), "metadata c=''");
            }
            if (f && i == 3) {
                const ds4_st_entry *e = ds4_st_find(f, "b");
                CHECK(e && e->data == b + len - 3 && e->nbytes == 3, "b points at the last 3 bytes");
                CHECK(!strcmp(ds4_st_entry_at(f, 0)->name, "z1") || !strcmp(ds4_st_entry_at(f, 0)->name, "a"),
                      "offset order");
                check_offset_order(f, good[i].what);
            }
            ds4_st_close(f);
            free(b);
        }
    }
    ds4_st_file *f = NULL;
    ds4_error err;
    CHECK_STATUS(ds4_st_open_memory("x", 1, NULL, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_st_open(NULL, &f, &err), DS4_ERR_ARG, &err);
    ds4_st_close(NULL);
    CHECK(ds4_st_count(NULL) == 0 && ds4_st_entry_at(NULL, 0) == NULL && ds4_st_find(NULL, "a") == NULL &&
              ds4_st_metadata(NULL, "a") == NULL,
          "NULL handle accessors");
}

/* ------------------------------------------------------------------------------------------------ (e) index errors */

static int write_shard(const char *dir, const char *file, size_t n, const char *const *names) {
    ds4_tensor *ts[8];
    int64_t shape[1] = {2};
    ds4_error err;
    for (size_t i = 0; i < n; i++) {
        ts[i] = NULL;
        ds4_tensor_new(DS4_F32, 1, shape, &ts[i], &err);
        if (ts[i]) ds4_tensor_set(ts[i], 0, (double)i);
    }
    char *p = join(dir, file);
    ds4_status s = ds4_st_write(p, n, names, (const ds4_tensor *const *)ts, &err);
    CHECK(s == DS4_OK, "write shard %s: %s", file, s ? err.msg : "");
    for (size_t i = 0; i < n; i++) ds4_tensor_release(ts[i]);
    free(p);
    return s == DS4_OK ? 0 : -1;
}

static void test_index(void) {
    char *dir = make_tmpdir();
    if (!dir) return;
    ds4_error err;
    ds4_checkpoint *c = NULL;
    const char *s1[2] = {"a", "b"}, *s2[2] = {"c", "d"};
    write_shard(dir, "m-1.safetensors", 2, s1);
    write_shard(dir, "m-2.safetensors", 2, s2);
    const char *idx = "model.safetensors.index.json";

    /* valid */
    write_text(dir, idx,
               "{\"metadata\":{\"total_size\":32},\"weight_map\":{\"d\":\"m-2.safetensors\",\"a\":\"m-1.safetensors\","
               "\"c\":\"m-2.safetensors\",\"b\":\"m-1.safetensors\"}}");
    CHECK_OK(ds4_checkpoint_open(dir, &c, &err), &err);
    if (c) {
        CHECK(ds4_checkpoint_count(c) == 4, "4 tensors");
        const ds4_st_entry *e = ds4_checkpoint_find(c, "c");
        float v[2];
        CHECK(e && ds4_convert_to_f32(e->dtype, e->data, 2, v, &err) == DS4_OK && v[0] == 0.0f, "c from shard 2");
        CHECK(!strcmp(ds4_checkpoint_entry_at(c, 0)->name, "a") && !strcmp(ds4_checkpoint_entry_at(c, 3)->name, "d"),
              "name order");
        ds4_checkpoint_close(c);
    }
    /* a shard tensor the index does not list is still part of the union (transformers loads whole shards) */
    write_text(dir, idx, "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"c\":\"m-2.safetensors\"}}");
    c = NULL;
    CHECK_OK(ds4_checkpoint_open(dir, &c, &err), &err);
    CHECK(ds4_checkpoint_count(c) == 4 && ds4_checkpoint_find(c, "d"), "union of listed shards");
    ds4_checkpoint_close(c);

    static const struct {
        const char *what, *index;
        ds4_status want;
        const char *must_contain;
    } bad[] = {
        {"missing shard", "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"x\":\"m-9.safetensors\"}}", DS4_ERR_NOT_FOUND,
         "m-9.safetensors"},
        {"tensor not in its shard", "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"c\":\"m-1.safetensors\"}}",
         DS4_ERR_FORMAT, "'c'"},
        {"../ shard name", "{\"weight_map\":{\"a\":\"../m-1.safetensors\"}}", DS4_ERR_FORMAT, "../m-1.safetensors"},
        {"absolute shard name", "{\"weight_map\":{\"a\":\"/etc/m-1.safetensors\"}}", DS4_ERR_FORMAT, "'a'"},
        {"subdir shard name", "{\"weight_map\":{\"a\":\"sub/m-1.safetensors\"}}", DS4_ERR_FORMAT, "'a'"},
        {"dotdot shard name", "{\"weight_map\":{\"a\":\"..safetensors\"}}", DS4_ERR_FORMAT, "'a'"},
        {"not .safetensors", "{\"weight_map\":{\"a\":\"model.bin\"}}", DS4_ERR_FORMAT, "model.bin"},
        {"bare extension", "{\"weight_map\":{\"a\":\".safetensors\"}}", DS4_ERR_FORMAT, "'a'"},
        {"shard not a string", "{\"weight_map\":{\"a\":1}}", DS4_ERR_FORMAT, "'a'"},
        {"no weight_map", "{\"metadata\":{}}", DS4_ERR_FORMAT, "weight_map"},
        {"weight_map not an object", "{\"weight_map\":[]}", DS4_ERR_FORMAT, "weight_map"},
        {"index not an object", "[]", DS4_ERR_FORMAT, "weight_map"},
        {"invalid JSON", "{\"weight_map\":{", DS4_ERR_FORMAT, "JSON"},
        {"tensor listed twice", "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"a\":\"m-2.safetensors\"}}",
         DS4_ERR_FORMAT, "\"a\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(dir, idx, bad[i].index);
        c = (ds4_checkpoint *)&err;
        memset(&err, 0, sizeof err);
        ds4_status s = ds4_checkpoint_open(dir, &c, &err);
        CHECK(s == bad[i].want && c == NULL, "%s: got %s (%s)", bad[i].what, ds4_status_name(s), err.msg);
        CHECK(strstr(err.msg, bad[i].must_contain) != NULL, "%s: message lacks %s: %s", bad[i].what,
              bad[i].must_contain, err.msg);
    }
    /* a tensor present in two opened shards */
    const char *s3[2] = {"b", "e"};
    write_shard(dir, "m-3.safetensors", 2, s3);
    write_text(dir, idx, "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"e\":\"m-3.safetensors\"}}");
    CHECK_STATUS(ds4_checkpoint_open(dir, &c, &err), DS4_ERR_FORMAT, &err);
    CHECK(strstr(err.msg, "'b'") && strstr(err.msg, "m-1.safetensors") && strstr(err.msg, "m-3.safetensors"),
          "duplicate across shards names the tensor and both shards: %s", err.msg);
    /* a corrupt shard: the error names the shard file */
    write_text(dir, "m-4.safetensors", "garbage");
    write_text(dir, idx, "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"z\":\"m-4.safetensors\"}}");
    CHECK_STATUS(ds4_checkpoint_open(dir, &c, &err), DS4_ERR_FORMAT, &err);
    CHECK(strstr(err.msg, "m-4.safetensors") != NULL, "corrupt shard named: %s", err.msg);

    /* without an index: model.safetensors, else exactly one *.safetensors */
    char *p = join(dir, idx);
    unlink(p);
    free(p);
    CHECK_STATUS(ds4_checkpoint_open(dir, &c, &err), DS4_ERR_NOT_FOUND, &err);
    CHECK(strstr(err.msg, "model.safetensors") && strstr(err.msg, "m-1.safetensors"),
          "ambiguous: names what was looked for and found: %s", err.msg);
    write_shard(dir, "model.safetensors", 1, s3);
    c = NULL;
    CHECK_OK(ds4_checkpoint_open(dir, &c, &err), &err);
    CHECK(ds4_checkpoint_count(c) == 1 && ds4_checkpoint_find(c, "b"), "model.safetensors preferred");
    ds4_checkpoint_close(c);
    rm_tree(dir);

    char *dir2 = make_tmpdir();
    if (dir2) {
        CHECK_STATUS(ds4_checkpoint_open(dir2, &c, &err), DS4_ERR_NOT_FOUND, &err);
        CHECK(strstr(err.msg, "model.safetensors.index.json") != NULL, "empty dir: %s", err.msg);
        write_text(dir2, "notes.txt", "x");
        write_shard(dir2, "weights.safetensors", 2, s1);
        c = NULL;
        CHECK_OK(ds4_checkpoint_open(dir2, &c, &err), &err);
        CHECK(ds4_checkpoint_count(c) == 2, "the single *.safetensors file");
        ds4_checkpoint_close(c);
        rm_tree(dir2);
        free(dir2);
    }
    char *nope = join(dir, "does-not-exist");
    CHECK_STATUS(ds4_checkpoint_open(nope, &c, &err), DS4_ERR_NOT_FOUND, &err);
    free(nope);
    CHECK_STATUS(ds4_checkpoint_open(NULL, &c, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_checkpoint_open("/dev/null", &c, &err), DS4_ERR_ARG, &err);
    free(dir);
}

/* A FIFO where a file is expected: open(2) without O_NONBLOCK would wait for a writer forever. Every reader of
 * caller-named files (safetensors, checkpoint directories, config.json, tokenizer.json, whole-file reads) must
 * refuse it at once. SIGALRM ends the test if any of them blocks. */
static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "test_safetensors: FAIL: a reader blocked on a FIFO for 20 s\n";
    if (write(2, msg, sizeof msg - 1) < 0) _exit(1);
    _exit(1);
}

static void test_fifos(const char *fixtures) {
    char *dir = make_tmpdir();
    if (!dir) return;
    signal(SIGALRM, on_alarm);
    alarm(20);
    char *cfg_src = join(fixtures, "tiny_a/config.json");
    char *text = NULL;
    size_t len = 0;
    ds4_error err;
    CHECK_OK(ds4_read_file(cfg_src, (size_t)1 << 20, &text, &len, &err), &err);
    if (text) write_text(dir, "config.json", text);
    free(text);
    free(cfg_src);
    char *st = join(dir, "model.safetensors");
    CHECK(mkfifo(st, 0600) == 0, "mkfifo %s: %s", st, strerror(errno));
    ds4_st_file *f = NULL;
    CHECK_STATUS(ds4_st_open(st, &f, &err), DS4_ERR_IO, &err);
    CHECK(strstr(err.msg, "not a regular file (a FIFO)") != NULL, "st_open on a FIFO: %s", err.msg);
    ds4_checkpoint *ck = NULL;
    CHECK(ds4_checkpoint_open(dir, &ck, &err) != DS4_OK, "checkpoint open of a directory with a FIFO shard");
    ds4_checkpoint_close(ck);
    ds4_engine *eng = NULL;
    CHECK_OK(ds4_engine_create(NULL, &eng, &err), &err);
    ds4_model *m = NULL;
    CHECK(ds4_model_load(eng, dir, &m, &err) != DS4_OK, "model load with a FIFO model.safetensors");
    CHECK(strstr(err.msg, "FIFO") != NULL, "model load names the FIFO: %s", err.msg);
    ds4_model_free(m);
    ds4_engine_free(eng);
    char *cfg = join(dir, "config.json");
    unlink(cfg);
    CHECK(mkfifo(cfg, 0600) == 0, "mkfifo %s: %s", cfg, strerror(errno));
    ds4_config c;
    CHECK_STATUS(ds4_config_load(dir, &c, &err), DS4_ERR_IO, &err);
    CHECK_STATUS(ds4_read_file(cfg, 100, &text, &len, &err), DS4_ERR_IO, &err);
    ds4_tokenizer *tok = NULL;
    CHECK_STATUS(ds4_tokenizer_load(cfg, &tok, &err), DS4_ERR_IO, &err);
    alarm(0);
    signal(SIGALRM, SIG_DFL);
    free(cfg);
    free(st);
    rm_tree(dir);
    free(dir);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s <fixtures_dir>\n", argv[0]);
        return 2;
    }
    test_fixture_tiny_a(argv[1]);
    test_fixture_tiny_b(argv[1]);
    test_round_trip();
    test_malformed();
    test_index();
    test_fifos(argv[1]);
    return ds4t_finish("test_safetensors");
}
