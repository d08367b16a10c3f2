/* test_ckptdir.c — checkpoint directories: the marker, what is (never) listed after simulated crashes,
 * retention, leftovers, extra state, and a committer killed at spread-out moments.
 *
 * References are written here, independently of core/ckptdir.c: CRC-32 is the bitwise textbook algorithm
 * (and the standard check value of "123456789"), expected retention sets are spelled out by hand, and file
 * contents are regenerated from their seeds and compared byte for byte. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "testlib.h"


static uint32_t ref_crc32(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return ~c;
}

/* Deterministic content: byte i of a file with this seed. */
static void fill(unsigned char *buf, size_t n, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        buf[i] = (unsigned char)x;
    }
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "open %s: %s", path, strerror(errno));
    if (!f) return;
    CHECK(fwrite(data, 1, n, f) == n, "write %s", path);
    fclose(f);
}

static void write_seeded(const char *dir, const char *name, size_t n, uint32_t seed) {
    unsigned char *b = malloc(n ? n : 1);
    fill(b, n, seed);
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    write_bytes(p, b, n);
    free(b);
}

static int file_matches(const char *dir, const char *name, size_t n, uint32_t seed) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "rb");
    if (!f) return 0;
    unsigned char *want = malloc(n + 1), *got = malloc(n + 1);
    fill(want, n, seed);
    size_t r = fread(got, 1, n + 1, f);
    fclose(f);
    int ok = r == n && memcmp(want, got, n) == 0;
    free(want);
    free(got);
    return ok;
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    b[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return b;
}

/* One committed checkpoint at `step` with two seeded files. Returns 1 on success. */
static int commit_step(const char *root, int64_t step, size_t size) {
    ds4_error err = {0};
    char *tmp = NULL;
    CHECK_OK(ds4_ckpt_begin(root, step, &tmp, &err), &err);
    if (!tmp) return 0;
    write_seeded(tmp, "a.bin", size, (uint32_t)step);
    write_seeded(tmp, "b.json", 17, (uint32_t)step + 1000);
    ds4_status s = ds4_ckpt_commit(root, step, tmp, &err);
    CHECK(s == DS4_OK, "commit step %lld: %s", (long long)step, err.msg);
    free(tmp);
    return s == DS4_OK;
}

static int same_steps(const int64_t *got, size_t ng, const int64_t *want, size_t nw) {
    if (ng != nw) return 0;
    for (size_t i = 0; i < ng; i++)
        if (got[i] != want[i]) return 0;
    return 1;
}

static void show_steps(const char *what, const int64_t *v, size_t n) {
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < n; i++) fprintf(stderr, " %lld", (long long)v[i]);
    fprintf(stderr, "\n");
}

static void check_list(const char *root, const int64_t *want, size_t nw, const char *what) {
    ds4_error err = {0};
    int64_t *got = NULL;
    size_t ng = 0;
    CHECK_OK(ds4_ckpt_list(root, &got, &ng, &err), &err);
    int ok = same_steps(got, ng, want, nw);
    CHECK(ok, "%s: listed steps differ", what);
    if (!ok) {
        show_steps("got ", got, ng);
        show_steps("want", want, nw);
    }
    free(got);
}

static void test_names(void) {
    static const struct {
        const char *name;
        int ok;
        int64_t step;
    } cases[] = {
        {"step_000000", 1, 0},         {"step_000020", 1, 20},        {"step_123456", 1, 123456},
        {"step_1234567", 1, 1234567},  {"step_20", 0, 0},             {"step_00020", 0, 0},
        {"step_0000020", 0, 0},        {"step_000020x", 0, 0},        {"xstep_000020", 0, 0},
        {"step_000020.tmp-12", 0, 0},  {"Step_000020", 0, 0},         {"step_", 0, 0},
        {"step_-00020", 0, 0},         {"step_+00020", 0, 0},         {"step_ 00020", 0, 0},
        {"step_000020/", 0, 0},        {"step__000020", 0, 0},        {"step_1234567890123456789", 0, 0},
        {"step_000020 ", 0, 0},        {"", 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t s = -1;
        int ok = ds4_ckpt_parse_name(cases[i].name, &s);
        CHECK(ok == cases[i].ok && (!ok || s == cases[i].step), "parse '%s': %d (%lld), want %d (%lld)", cases[i].name,
              ok, (long long)s, cases[i].ok, (long long)cases[i].step);
    }
    char p[64];
    CHECK(ds4_ckpt_step_path("/r/", 20, p, sizeof p) && !strcmp(p, "/r/step_000020"), "step path: %s", p);
    CHECK(ds4_ckpt_step_path("r", 1234567, p, sizeof p) && !strcmp(p, "r/step_1234567"), "step path: %s", p);
    CHECK(!ds4_ckpt_step_path("r", -1, p, sizeof p), "negative step refused");
    CHECK(!ds4_ckpt_step_path("r", 20, p, 8), "short buffer refused");
}

static void test_crc(void) {
    CHECK(ds4_crc32(0, "123456789", 9) == 0xCBF43926u, "CRC-32 check value: %08x", ds4_crc32(0, "123456789", 9));
    CHECK(ds4_crc32(0, "", 0) == 0, "CRC-32 of nothing");
    unsigned char b[10007];
    fill(b, sizeof b, 5);
    for (size_t n = 0; n < 40; n++)
        CHECK(ds4_crc32(0, b, n) == ref_crc32(b, n), "CRC-32 of %zu bytes", n);
    CHECK(ds4_crc32(0, b, sizeof b) == ref_crc32(b, sizeof b), "CRC-32 of 10007 bytes");
    CHECK(ds4_crc32(ds4_crc32(0, b, 1001), b + 1001, sizeof b - 1001) == ref_crc32(b, sizeof b), "CRC-32 continued");
}

/* The marker of a fresh commit, read with the JSON parser and checked against sizes and CRCs computed here. */
static void test_commit_marker(const char *base) {
    ds4_error err = {0};
    char root[4096];
    snprintf(root, sizeof root, "%s/basic/runs", base); /* parents are created */
    char *tmp = NULL;
    CHECK_OK(ds4_ckpt_begin(root, 20, &tmp, &err), &err);
    if (!tmp) return;
    char want_prefix[64];
    snprintf(want_prefix, sizeof want_prefix, "/step_000020.tmp-%ld", (long)getpid());
    CHECK(strstr(tmp, want_prefix) != NULL, "tmp path %s has %s", tmp, want_prefix);
    write_seeded(tmp, "a.bin", 100000, 1);
    write_seeded(tmp, "meta.json", 33, 2);
    /* before the commit nothing is listed, and the temporary directory is reported as active */
    check_list(root, NULL, 0, "before commit");
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    CHECK_OK(ds4_ckpt_scan(root, DS4_CKPT_VERIFY_FULL, &en, &n, &err), &err);
    CHECK(n == 1 && en && en[0].kind == DS4_CKPT_ACTIVE && en[0].step == 20 && en[0].pid == (int64_t)getpid(),
          "scan shows our temporary directory as active");
    free(en);
    CHECK_OK(ds4_ckpt_commit(root, 20, tmp, &err), &err);
    CHECK(!ds4t_exists(tmp), "the temporary directory is gone after commit");
    free(tmp);
    char dir[4200], mpath[4300];
    snprintf(dir, sizeof dir, "%s/step_000020", root);
    snprintf(mpath, sizeof mpath, "%s/COMPLETE", dir);
    size_t mlen = 0;
    char *text = slurp(mpath, &mlen);
    CHECK(text != NULL, "marker written");
    ds4_json *doc = text ? ds4_json_parse(text, mlen, NULL, &err) : NULL;
    CHECK(doc != NULL, "marker parses: %s", err.msg);
    if (doc) {
        const ds4_json *st = ds4_json_get(doc, "step"), *files = ds4_json_get(doc, "files"), *t = ds4_json_get(doc, "time");
        CHECK(st && st->is_int && st->integer == 20, "marker step");
        CHECK(t && t->is_int && t->integer > 1600000000, "marker time");
        CHECK(files && files->type == DS4_JSON_ARRAY && files->count == 2, "marker lists the two files");
        const char *names[2] = {"a.bin", "meta.json"};
        const size_t sizes[2] = {100000, 33};
        for (size_t i = 0; files && i < files->count && i < 2; i++) {
            const ds4_json *f = &files->items[i];
            const ds4_json *nm = ds4_json_get(f, "name"), *sz = ds4_json_get(f, "size"), *cr = ds4_json_get(f, "crc32");
            unsigned char *b = malloc(sizes[i]);
            fill(b, sizes[i], (uint32_t)i + 1);
            char want[16];
            snprintf(want, sizeof want, "%08x", ref_crc32(b, sizes[i]));
            free(b);
            CHECK(nm && !strcmp(nm->str, names[i]) && sz && sz->integer == (int64_t)sizes[i] && cr && !strcmp(cr->str, want),
                  "marker entry %zu: %s %lld %s, want %s %zu %s", i, nm ? nm->str : "?", sz ? (long long)sz->integer : -1LL,
                  cr ? cr->str : "?", names[i], sizes[i], want);
        }
        ds4_json_free(doc);
    }
    free(text);
    int64_t want[] = {20}, latest = -1;
    check_list(root, want, 1, "after commit");
    CHECK_OK(ds4_ckpt_latest(root, &latest, &err), &err);
    CHECK(latest == 20, "latest %lld", (long long)latest);
    /* a commit of the same step again replaces it, leaving nothing aside */
    CHECK_OK(ds4_ckpt_begin(root, 20, &tmp, &err), &err);
    if (tmp) {
        write_seeded(tmp, "a.bin", 500, 99);
        CHECK_OK(ds4_ckpt_commit(root, 20, tmp, &err), &err);
        free(tmp);
    }
    CHECK(file_matches(dir, "a.bin", 500, 99), "re-commit replaced the content");
    CHECK(!ds4t_exists(ds4t_path(dir, "meta.json")), "re-commit replaced the whole directory");
    CHECK_OK(ds4_ckpt_scan(root, DS4_CKPT_VERIFY_FULL, &en, &n, &err), &err);
    CHECK(n == 1 && en && en[0].kind == DS4_CKPT_COMPLETE, "no .old- leftover after re-commit (%zu entries)", n);
    free(en);
    /* commit refuses a subdirectory, and a temporary directory of another step */
    CHECK_OK(ds4_ckpt_begin(root, 30, &tmp, &err), &err);
    if (tmp) {
        char sub[4200];
        snprintf(sub, sizeof sub, "%s/sub", tmp);
        mkdir(sub, 0755);
        CHECK_STATUS(ds4_ckpt_commit(root, 30, tmp, &err), DS4_ERR_ARG, &err);
        CHECK(strstr(err.msg, "sub") != NULL, "message names the subdirectory: %s", err.msg);
        rmdir(sub);
        CHECK_STATUS(ds4_ckpt_commit(root, 31, tmp, &err), DS4_ERR_ARG, &err);
        CHECK_OK(ds4_ckpt_abort(tmp, &err), &err);
        CHECK(!ds4t_exists(tmp), "abort removed the temporary directory");
        free(tmp);
    }
    CHECK_STATUS(ds4_ckpt_abort(dir, &err), DS4_ERR_ARG, &err);
    CHECK(ds4t_exists(dir), "abort refuses a complete checkpoint");
    CHECK_STATUS(ds4_ckpt_begin(root, -1, &tmp, &err), DS4_ERR_ARG, &err);
}

static void truncate_file(const char *dir, const char *name, off_t len) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    CHECK(truncate(p, len) == 0, "truncate %s", p);
}

static void flip_byte(const char *dir, const char *name, long at) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "r+b");
    if (!f) return;
    fseek(f, at, SEEK_SET);
    int c = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(c ^ 0x40, f);
    fclose(f);
}

static pid_t dead_pid(void) {
    pid_t p = fork();
    if (p == 0) _exit(0);
    int st;
    waitpid(p, &st, 0);
    return p;
}

/* Crash leftovers and damaged checkpoints are never listed; prune leaves them (except stale leftovers, and
 * only when asked). */
static void test_crashes(const char *base) {
    ds4_error err = {0};
    char root[4096], d[4300];
    snprintf(root, sizeof root, "%s/crash", base);
    commit_step(root, 20, 5000);
    /* a final-named directory without a marker */
    snprintf(d, sizeof d, "%s/step_000040", root);
    mkdir(d, 0755);
    write_seeded(d, "a.bin", 5000, 40);
    /* truncated file */
    commit_step(root, 50, 5000);
    snprintf(d, sizeof d, "%s/step_000050", root);
    truncate_file(d, "a.bin", 4000);
    /* missing file */
    commit_step(root, 60, 5000);
    snprintf(d, sizeof d, "%s/step_000060", root);
    CHECK(unlink(ds4t_path(d, "b.json")) == 0, "unlink");
    /* same size, one byte changed: only the checksum can tell */
    commit_step(root, 70, 5000);
    snprintf(d, sizeof d, "%s/step_000070", root);
    flip_byte(d, "a.bin", 1234);
    /* a marker with a wrong checksum */
    commit_step(root, 80, 5000);
    snprintf(d, sizeof d, "%s/step_000080/COMPLETE", root);
    {
        size_t len;
        char *m = slurp(d, &len);
        char *c = m ? strstr(m, "\"crc32\": \"") : NULL;
        CHECK(c != NULL, "marker has a crc32 field");
        if (c) c[10] = c[10] == '0' ? '1' : '0';
        if (m) write_bytes(d, m, len);
        free(m);
    }
    /* a marker that is not JSON, and one whose step differs from the directory name */
    commit_step(root, 90, 100);
    snprintf(d, sizeof d, "%s/step_000090/COMPLETE", root);
    write_bytes(d, "{\"format\": \"ds4-checkpoint\", \"ver", 33);
    commit_step(root, 95, 100);
    {
        char from[4300], to[4300];
        snprintf(from, sizeof from, "%s/step_000095", root);
        snprintf(to, sizeof to, "%s/step_000096", root);
        CHECK(rename(from, to) == 0, "rename");
    }
    /* a .tmp dir with files but no marker, of a live writer (this process; made after the commits above, which
     * remove leftovers of older steps) */
    char *tmp = NULL;
    CHECK_OK(ds4_ckpt_begin(root, 30, &tmp, &err), &err);
    if (tmp) write_seeded(tmp, "a.bin", 5000, 30);
    /* leftovers: a dead process of this host, a process of another host, a dead replaced/removed checkpoint */
    pid_t dp = dead_pid();
    snprintf(d, sizeof d, "%s/step_000100.tmp-%ld", root, (long)dp);
    mkdir(d, 0755);
    write_seeded(d, "a.bin", 10, 1);
    snprintf(d, sizeof d, "%s/step_000110.tmp-%ld@elsewhere.invalid", root, (long)dp);
    mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/step_000020.del-%ld", root, (long)dp);
    mkdir(d, 0755);
    /* names that are not checkpoints at all, with valid-looking contents */
    snprintf(d, sizeof d, "%s/step_20", root);
    mkdir(d, 0755);
    snprintf(d, sizeof d, "%s/notes.txt", root);
    write_bytes(d, "x", 1);

    int64_t want[] = {20};
    check_list(root, want, 1, "after simulated crashes");
    int64_t latest = -1;
    CHECK_OK(ds4_ckpt_latest(root, &latest, &err), &err);
    CHECK(latest == 20, "latest skips damaged newer checkpoints: %lld", (long long)latest);

    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    CHECK_OK(ds4_ckpt_scan(root, DS4_CKPT_VERIFY_FULL, &en, &n, &err), &err);
    /* expected by hand: name -> kind and a word of the reason */
    static const struct {
        const char *name_prefix;
        ds4_ckpt_kind kind;
        const char *reason;
    } exp[] = {
        {"step_000020", DS4_CKPT_COMPLETE, ""},
        {"step_000020.del-", DS4_CKPT_STALE, "gone"},
        {"step_000030.tmp-", DS4_CKPT_ACTIVE, "alive"},
        {"step_000040", DS4_CKPT_INCOMPLETE, "COMPLETE"},
        {"step_000050", DS4_CKPT_INCOMPLETE, "truncated"},
        {"step_000060", DS4_CKPT_INCOMPLETE, "missing"},
        {"step_000070", DS4_CKPT_INCOMPLETE, "CRC"},
        {"step_000080", DS4_CKPT_INCOMPLETE, "CRC"},
        {"step_000090", DS4_CKPT_INCOMPLETE, "JSON"},
        {"step_000096", DS4_CKPT_INCOMPLETE, "step 95"},
        {"step_000100.tmp-", DS4_CKPT_STALE, "gone"},
        {"step_000110.tmp-", DS4_CKPT_ACTIVE, "another host"},
    };
    const size_t ne = sizeof exp / sizeof exp[0];
    CHECK(n == ne, "scan found %zu entries, want %zu", n, ne);
    for (size_t i = 0; i < n && i < ne; i++) {
        size_t pl = strlen(exp[i].name_prefix);
        int name_ok = !strncmp(en[i].name, exp[i].name_prefix, pl) && (exp[i].name_prefix[pl - 1] == '-' || !en[i].name[pl]);
        CHECK(name_ok && en[i].kind == exp[i].kind && strstr(en[i].reason, exp[i].reason),
              "scan entry %zu: %s kind %d (%s); want %s kind %d with '%s'", i, en[i].name, (int)en[i].kind, en[i].reason,
              exp[i].name_prefix, (int)exp[i].kind, exp[i].reason);
    }
    free(en);
    /* size-only verification misses the flipped byte, by design */
    CHECK_OK(ds4_ckpt_check(ds4t_path(root, "step_000070"), DS4_CKPT_VERIFY_SIZES, NULL, &err), &err);
    CHECK_STATUS(ds4_ckpt_check(ds4t_path(root, "step_000070"), DS4_CKPT_VERIFY_FULL, NULL, &err), DS4_ERR_FORMAT, &err);
    CHECK_STATUS(ds4_ckpt_check(ds4t_path(root, "step_000040"), DS4_CKPT_VERIFY_FULL, NULL, &err), DS4_ERR_NOT_FOUND,
                 &err);

    /* prune never touches incomplete or active directories; stale leftovers go only when asked */
    ds4_ckpt_prune_options po = {.keep_last = 0, .keep_every = 0};
    ds4_ckpt_prune_result pr;
    CHECK_OK(ds4_ckpt_prune(root, &po, &pr, &err), &err);
    CHECK(pr.n_removed == 0 && pr.n_kept == 1 && pr.n_cleaned == 0, "prune: %zu removed, %zu kept, %zu cleaned",
          pr.n_removed, pr.n_kept, pr.n_cleaned);
    free(pr.removed);
    snprintf(d, sizeof d, "%s/step_000100.tmp-%ld", root, (long)dp);
    CHECK(ds4t_exists(d), "stale leftover kept without clean_stale");
    po.clean_stale = 1;
    CHECK_OK(ds4_ckpt_prune(root, &po, &pr, &err), &err);
    CHECK(pr.n_cleaned == 2, "prune cleaned %zu stale leftovers, want 2", pr.n_cleaned);
    free(pr.removed);
    CHECK(!ds4t_exists(d), "stale leftover removed with clean_stale");
    snprintf(d, sizeof d, "%s/step_000110.tmp-%ld@elsewhere.invalid", root, (long)dp);
    CHECK(ds4t_exists(d), "another host's leftover is never removed");
    CHECK(tmp && ds4t_exists(tmp), "a live writer's temporary directory is never removed");
    const char *kept[] = {"step_000040", "step_000050", "step_000060", "step_000070", "step_000080", "step_000090",
                          "step_000096", "step_20", "notes.txt"};
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++)
        CHECK(ds4t_exists(ds4t_path(root, kept[i])), "prune left %s alone", kept[i]);
    if (tmp) {
        CHECK_OK(ds4_ckpt_abort(tmp, &err), &err);
        free(tmp);
    }
}

/* Commit steps from..to by `by` into a fresh root. */
static void make_run(const char *root, int64_t from, int64_t to, int64_t by) {
    for (int64_t s = from; s <= to; s += by) commit_step(root, s, 64);
}

static void test_retention(const char *base) {
    ds4_error err = {0};
    char root[4096];
    snprintf(root, sizeof root, "%s/ret1", base);
    make_run(root, 10, 200, 10);
    ds4_ckpt_prune_options po = {.keep_last = 3, .keep_every = 50, .dry_run = 1};
    ds4_ckpt_prune_result pr;
    const int64_t want_removed[] = {10, 20, 30, 40, 60, 70, 80, 90, 110, 120, 130, 140, 160, 170};
    CHECK_OK(ds4_ckpt_prune(root, &po, &pr, &err), &err);
    CHECK(same_steps(pr.removed, pr.n_removed, want_removed, 14), "dry run reports the removals");
    free(pr.removed);
    int64_t all[20];
    for (int i = 0; i < 20; i++) all[i] = 10 * (i + 1);
    check_list(root, all, 20, "dry run removes nothing");
    po.dry_run = 0;
    CHECK_OK(ds4_ckpt_prune(root, &po, &pr, &err), &err);
    CHECK(same_steps(pr.removed, pr.n_removed, want_removed, 14) && pr.n_kept == 6, "removed list (kept %zu)", pr.n_kept);
    free(pr.removed);
    const int64_t want1[] = {50, 100, 150, 180, 190, 200}; /* keep_every 50 + the last 3 */
    check_list(root, want1, 6, "keep_last 3, keep_every 50");
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    CHECK_OK(ds4_ckpt_scan(root, DS4_CKPT_VERIFY_SIZES, &en, &n, &err), &err);
    CHECK(n == 6, "no .del- leftovers after prune (%zu entries)", n);
    free(en);
    /* the newest survives even with keep_last 0 */
    ds4_ckpt_prune_options p0 = {0};
    CHECK_OK(ds4_ckpt_prune(root, &p0, NULL, &err), &err);
    const int64_t want2[] = {200};
    check_list(root, want2, 1, "keep_last 0");

    /* a newest step that is no multiple of keep_every */
    snprintf(root, sizeof root, "%s/ret2", base);
    make_run(root, 10, 210, 10);
    ds4_ckpt_prune_options p1 = {.keep_last = 0, .keep_every = 50};
    CHECK_OK(ds4_ckpt_prune(root, &p1, NULL, &err), &err);
    const int64_t want3[] = {50, 100, 150, 200, 210};
    check_list(root, want3, 5, "keep_last 0, keep_every 50, newest 210");
    /* keep_last larger than the number of checkpoints removes nothing */
    ds4_ckpt_prune_options p2 = {.keep_last = 100};
    CHECK_OK(ds4_ckpt_prune(root, &p2, NULL, &err), &err);
    check_list(root, want3, 5, "keep_last 100");

    /* the newest *complete* checkpoint is protected when the newest directory is damaged */
    snprintf(root, sizeof root, "%s/ret3", base);
    make_run(root, 10, 30, 10);
    char d[4300];
    snprintf(d, sizeof d, "%s/step_000030", root);
    flip_byte(d, "a.bin", 3);
    CHECK_OK(ds4_ckpt_prune(root, &p0, NULL, &err), &err);
    const int64_t want4[] = {20};
    check_list(root, want4, 1, "damaged newest");
    CHECK(ds4t_exists(d), "the damaged newest directory is left for inspection");
    CHECK(!ds4t_exists(ds4t_path(root, "step_000010")), "step 10 removed");

    ds4_ckpt_prune_options bad = {.keep_last = -1};
    CHECK_STATUS(ds4_ckpt_prune(root, &bad, NULL, &err), DS4_ERR_ARG, &err);
    /* a root that does not exist: empty, not an error; latest says not found */
    snprintf(root, sizeof root, "%s/none", base);
    check_list(root, NULL, 0, "missing root");
    int64_t latest;
    CHECK_STATUS(ds4_ckpt_latest(root, &latest, &err), DS4_ERR_NOT_FOUND, &err);
}

static void test_state(const char *base) {
    ds4_error err = {0};
    char root[4096];
    snprintf(root, sizeof root, "%s/state", base);
    char *tmp = NULL;
    CHECK_OK(ds4_ckpt_begin(root, 7, &tmp, &err), &err);
    if (!tmp) return;
    ds4_tensor *a = NULL, *b = NULL;
    int64_t sa[2] = {3, 4}, sb[1] = {5};
    CHECK_OK(ds4_tensor_new(DS4_F32, 2, sa, &a, &err), &err);
    CHECK_OK(ds4_tensor_new(DS4_I64, 1, sb, &b, &err), &err);
    for (int i = 0; i < 12; i++) ((float *)a->data)[i] = 0.5f * (float)i - 1;
    for (int i = 0; i < 5; i++) ((int64_t *)b->data)[i] = 1000000000000ll + i;
    const char *names[2] = {"exp_avg", "position"};
    const ds4_tensor *ts[2] = {a, b};
    const char *meta = "{\"step\": 7, \"lr\": 0.001, \"note\": \"h\\u00e9\"}";
    CHECK_OK(ds4_ckpt_write_state(tmp, "optimizer", 2, names, ts, meta, &err), &err);
    CHECK_OK(ds4_ckpt_write_state(tmp, "empty", 0, NULL, NULL, NULL, &err), &err);
    CHECK_STATUS(ds4_ckpt_write_state(tmp, "model", 0, NULL, NULL, NULL, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_ckpt_write_state(tmp, "a/b", 0, NULL, NULL, NULL, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_ckpt_write_state(tmp, "", 0, NULL, NULL, NULL, &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_ckpt_write_state(tmp, "x", 0, NULL, NULL, "[1, 2]", &err), DS4_ERR_ARG, &err);
    CHECK_STATUS(ds4_ckpt_write_state(tmp, "x", 0, NULL, NULL, "{\"a\": ", &err), DS4_ERR_ARG, &err);
    CHECK(!ds4t_exists(ds4t_path(tmp, "x.json")), "refused state wrote nothing");
    CHECK_OK(ds4_ckpt_commit(root, 7, tmp, &err), &err);
    free(tmp);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/step_000007", root);
    ds4_st_file *f = NULL;
    char *m = NULL;
    CHECK_OK(ds4_ckpt_read_state(dir, "optimizer", &f, &m, &err), &err);
    if (f) {
        const ds4_st_entry *ea = ds4_st_find(f, "exp_avg"), *eb = ds4_st_find(f, "position");
        CHECK(ea && ea->dtype == DS4_F32 && ea->ndim == 2 && ea->shape[0] == 3 && !memcmp(ea->data, a->data, 48),
              "state tensor exp_avg round trip");
        CHECK(eb && eb->dtype == DS4_I64 && !memcmp(eb->data, b->data, 40), "state tensor position round trip");
        ds4_st_close(f);
    }
    CHECK(m && !strcmp(m, meta), "state metadata round trip: %s", m ? m : "(null)");
    free(m);
    CHECK_OK(ds4_ckpt_read_state(dir, "empty", &f, &m, &err), &err);
    CHECK(f && ds4_st_count(f) == 0 && m && !strcmp(m, "{}"), "empty state");
    ds4_st_close(f);
    free(m);
    CHECK_STATUS(ds4_ckpt_read_state(dir, "dataloader", &f, &m, &err), DS4_ERR_NOT_FOUND, &err);
    /* the state files are covered by the marker */
    truncate_file(dir, "optimizer.safetensors", 10);
    check_list(root, NULL, 0, "truncated state file");
    ds4_tensor_release(a);
    ds4_tensor_release(b);
}

/* A committer SIGKILLed at spread-out moments: whatever is listed has exactly the content that was written. */
static void test_killed_commit(const char *base) {
    ds4_error err = {0};
    char root[4096];
    snprintf(root, sizeof root, "%s/kill", base);
    enum { TRIES = 20, SIZE = 3 << 20 };
    double dt = 0;
    int listed = 0, absent = 0;
    for (int k = -1; k < TRIES; k++) {
        const int64_t step = 10 * (k + 2);
        int fds[2];
        if (pipe(fds) != 0) break;
        pid_t pid = fork();
        if (pid == 0) {
            ds4_error e2 = {0};
            char *tmp = NULL;
            close(fds[0]);
            if (write(fds[1], "s", 1) != 1) _exit(4);
            if (ds4_ckpt_begin(root, step, &tmp, &e2)) _exit(3);
            write_seeded(tmp, "a.bin", SIZE, (uint32_t)step);
            write_seeded(tmp, "b.bin", SIZE / 3, (uint32_t)step + 1);
            _exit(ds4_ckpt_commit(root, step, tmp, &e2) == DS4_OK ? 0 : 3);
        }
        close(fds[1]);
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
        if (k >= 0) {
            double wait_s = k >= TRIES - 2 ? 4 * dt + 0.02 : dt * 1.2 * k / (TRIES - 3);
            struct timespec ts = {(time_t)wait_s, (long)((wait_s - (double)(time_t)wait_s) * 1e9)};
            nanosleep(&ts, NULL);
            kill(pid, SIGKILL);
        }
        waitpid(pid, &status, 0);
        if (k < 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
            CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "timing child failed");
        }
        int64_t *steps = NULL;
        size_t n = 0;
        CHECK_OK(ds4_ckpt_list(root, &steps, &n, &err), &err);
        int is_listed = 0;
        for (size_t i = 0; i < n; i++) is_listed |= steps[i] == step;
        free(steps);
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/step_%06lld", root, (long long)step);
        if (is_listed) {
            CHECK(file_matches(dir, "a.bin", SIZE, (uint32_t)step) && file_matches(dir, "b.bin", SIZE / 3, (uint32_t)step + 1),
                  "listed step %lld has exactly the written content", (long long)step);
            if (k >= 0) listed++;
        } else {
            CHECK(!ds4t_exists(dir), "step %lld: a final-named directory exists but is not listed", (long long)step);
            if (k >= 0) absent++;
        }
    }
    printf("  killed committer: %d of %d listed complete, %d absent (one commit: %.1f ms)\n", listed, TRIES, absent,
           dt * 1e3);
    CHECK(listed + absent == TRIES, "every outcome is listed-and-complete or absent");
    CHECK(listed > 0 && absent > 0, "kills were not spread over the commit (%d listed, %d absent)", listed, absent);
    /* the killed writers' temporary directories are stale now, and prune cleans them */
    ds4_ckpt_prune_options po = {.keep_last = 1000, .clean_stale = 1};
    ds4_ckpt_prune_result pr;
    CHECK_OK(ds4_ckpt_prune(root, &po, &pr, &err), &err);
    free(pr.removed);
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    CHECK_OK(ds4_ckpt_scan(root, DS4_CKPT_VERIFY_SIZES, &en, &n, &err), &err);
    size_t other = 0;
    for (size_t i = 0; i < n; i++) other += en[i].kind != DS4_CKPT_COMPLETE;
    /* (a writer killed before ds4_ckpt_begin left nothing to clean) */
    CHECK(other == 0 && pr.n_cleaned <= (size_t)absent, "after cleaning: %zu non-complete entries, %zu cleaned of %d",
          other, pr.n_cleaned, absent);
    free(en);
}

/* Crash leftovers do not outlive the next successful commit: a commit of step 50 removes those of this host whose
 * process is gone and those of any step older than 50 (pid alive or not, this host or another: one writer per
 * root, and pids repeat across container restarts); a live writer's newer step and another host's newer step
 * stay. */
static void test_commit_cleans(const char *base) {
    ds4_error err = {0};
    char root[4096], d[4096 + 512], host[256] = "";
    snprintf(root, sizeof root, "%s/clean", base);
    commit_step(root, 10, 100);
    if (gethostname(host, sizeof host) != 0) host[0] = 0;
    host[64] = 0; /* as ckptdir.c writes it: at most 64 characters, [A-Za-z0-9._-] */
    for (char *c = host; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '-' ||
              *c == '.' || *c == '_'))
            *c = '_';
    pid_t dp = dead_pid();
    const long alive = (long)getppid();
    static const struct {
        const char *fmt;
        int live, stays;
    } cases[] = {
        {"step_000060.tmp-%ld@%s", 0, 0},              /* newer step, this host, process gone */
        {"step_000060.del-%ld@%s", 0, 0},              /* same, a removal interrupted */
        {"step_000020.tmp-%ld@%s", 1, 0},              /* older step: the pid is alive (reused) */
        {"step_000030.old-%ld@%s", 1, 0},              /* older step, a replaced checkpoint */
        {"step_000040.tmp-%ld@elsewhere.invalid", 0, 0}, /* older step, another host */
        {"step_000060.tmp-%ld@%s", 1, 1},              /* newer step, live writer: stays */
        {"step_000070.tmp-%ld@elsewhere.invalid", 0, 1}, /* newer step, another host: stays */
    };
    const size_t nc = sizeof cases / sizeof cases[0];
    char names[8][400];
    for (size_t i = 0; i < nc; i++) {
        snprintf(names[i], sizeof names[i], cases[i].fmt, cases[i].live ? alive : (long)dp, host);
        snprintf(d, sizeof d, "%s/%.300s", root, names[i]);
        CHECK(mkdir(d, 0755) == 0, "mkdir %s", d);
        write_seeded(d, "a.bin", 100, (uint32_t)i);
    }
    commit_step(root, 50, 100);
    for (size_t i = 0; i < nc; i++) {
        snprintf(d, sizeof d, "%s/%.300s", root, names[i]);
        CHECK(ds4t_exists(d) == cases[i].stays, "after the commit of step 50: %s %s", names[i],
              cases[i].stays ? "was removed" : "is still there");
    }
    int64_t want[] = {10, 50};
    check_list(root, want, 2, "commit with leftovers around");
    (void)err;
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    char base[] = "/tmp/ds4_test_ckptdir_XXXXXX";
    if (!mkdtemp(base)) {
        perror("mkdtemp");
        return 1;
    }
    test_names();
    test_crc();
    test_commit_marker(base);
    test_crashes(base);
    test_retention(base);
    test_state(base);
    test_killed_commit(base);
    test_commit_cleans(base);
    if (getenv("DS4_KEEP_CKPT")) printf("kept %s\n", base);
    else ds4t_rm_rf(base);
    return ds4t_finish("test_ckptdir");
}
