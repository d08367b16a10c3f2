/* ckptdir.c — training checkpoint directories: atomic commit with a checksummed marker, listing that trusts
 * only complete checkpoints, retention, named extra state; and the file-system helpers of ckpt_fs.h.
 *
 * The layout and the guarantees are described at the top of ds4_ckpt.h. Two choices worth a note:
 *   - The marker records a CRC-32 per file rather than a cryptographic hash: it is there to catch truncated,
 *     torn or bit-rotted files, not tampering, and CRC-32 (slicing-by-8) reads at memory speed.
 *   - Leftover names carry pid@host so that a cleaner never removes the directory of a live writer: the pid
 *     is only meaningful on the host that wrote it, so other hosts' leftovers are never removed. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_fs.h"
#include "internal.h"
#include "json.h"

enum {
    MAX_STEP_DIGITS = 18,            /* every 18-digit number fits int64 */
    MAX_FILE_NAME = 200,             /* names inside a checkpoint directory */
    MAX_MARKER = 16 << 20,           /* a marker listing thousands of shards is still far below this */
    RMTREE_DEPTH = 32
};

/* ------------------------------------------------------------------------------------------------ file system */

static ds4_status write_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return DS4_ERR_IO;
        }
        p += w;
        len -= (size_t)w;
    }
    return DS4_OK;
}

ds4_status ds4_fs_mkdirs(const char *what, const char *path, ds4_error *err) {
    size_t len = strlen(path);
    char *p = malloc(len + 1);
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "%s: mkdir %s: path", what, path);
    memcpy(p, path, len + 1);
    for (size_t i = 1; i <= len; i++) {
        if (p[i] != '/' && p[i] != 0) continue;
        char c = p[i];
        p[i] = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            ds4_status st = ds4_fail(err, DS4_ERR_IO, "%s: mkdir %s: %s", what, p, strerror(e));
            free(p);
            return st;
        }
        p[i] = c;
    }
    free(p);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return ds4_fail(err, DS4_ERR_IO, "%s: %s is not a directory", what, path);
    return DS4_OK;
}

ds4_status ds4_fs_write_file(const char *what, const char *path, const void *data, size_t len, ds4_error *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ds4_fail(err, DS4_ERR_IO, "%s: create %s: %s", what, path, strerror(errno));
    if (write_all(fd, data, len) != DS4_OK) {
        int e = errno;
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "%s: write %s (%zu bytes): %s", what, path, len, strerror(e));
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "%s: fsync %s: %s", what, path, strerror(e));
    }
    if (close(fd) != 0) return ds4_fail(err, DS4_ERR_IO, "%s: close %s: %s", what, path, strerror(errno));
    return DS4_OK;
}

ds4_status ds4_fs_sync_dir(const char *what, const char *path, ds4_error *err) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ds4_fail(err, DS4_ERR_IO, "%s: open directory %s: %s", what, path, strerror(errno));
    int rc = fsync(fd), e = errno;
    close(fd);
    /* Some file systems cannot sync a directory; the files themselves were synced already. */
    if (rc != 0 && e != EINVAL && e != ENOTSUP && e != EROFS)
        return ds4_fail(err, DS4_ERR_IO, "%s: fsync directory %s: %s", what, path, strerror(e));
    return DS4_OK;
}

typedef struct name_list {
    char **v;
    size_t n, cap;
} name_list;

static void names_free(name_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->v[i]);
    free(l->v);
    memset(l, 0, sizeof *l);
}

static int names_add(name_list *l, const char *s) {
    if (l->n == l->cap) {
        size_t nc = l->cap ? 2 * l->cap : 16;
        char **v = realloc(l->v, nc * sizeof *v);
        if (!v) return 0;
        l->v = v;
        l->cap = nc;
    }
    size_t len = strlen(s);
    char *c = malloc(len + 1);
    if (!c) return 0;
    memcpy(c, s, len + 1);
    l->v[l->n++] = c;
    return 1;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Entry names of the open directory dfd (without . and ..). The directory is read completely before anything
 * is removed: removing entries while readdir walks the directory may skip others. */
static int read_names(int dfd, name_list *out) {
    int fd2 = dup(dfd);
    if (fd2 < 0) return -1;
    DIR *d = fdopendir(fd2);
    if (!d) {
        close(fd2);
        return -1;
    }
    rewinddir(d);
    struct dirent *e;
    errno = 0;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (!names_add(out, e->d_name)) {
            closedir(d);
            errno = ENOMEM;
            return -1;
        }
    }
    int e2 = errno;
    closedir(d);
    errno = e2;
    return e2 ? -1 : 0;
}

/* Remove everything inside the directory dfd. Returns 0, or -1 with errno and the failing name in bad. */
static int rm_contents(int dfd, int depth, char *bad, size_t cap) {
    if (depth > RMTREE_DEPTH) {
        snprintf(bad, cap, "(nesting deeper than %d)", RMTREE_DEPTH);
        errno = ELOOP;
        return -1;
    }
    name_list l = {0};
    if (read_names(dfd, &l) != 0) {
        int e = errno;
        names_free(&l);
        snprintf(bad, cap, "(reading the directory)");
        errno = e;
        return -1;
    }
    int rc = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        const char *nm = l.v[i];
        struct stat st;
        if (fstatat(dfd, nm, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            if (errno == ENOENT) continue;
            rc = -1;
        } else if (S_ISDIR(st.st_mode)) {
            int sub = openat(dfd, nm, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub < 0) rc = -1;
            else {
                rc = rm_contents(sub, depth + 1, bad, cap);
                int e = errno;
                close(sub);
                errno = e;
                if (rc == 0 && unlinkat(dfd, nm, AT_REMOVEDIR) != 0 && errno != ENOENT) rc = -1;
            }
        } else if (unlinkat(dfd, nm, 0) != 0 && errno != ENOENT) {
            rc = -1;
        }
        if (rc != 0 && !bad[0]) snprintf(bad, cap, "%s", nm);
    }
    int e = errno;
    names_free(&l);
    errno = e;
    return rc;
}

ds4_status ds4_fs_rmtree(const char *what, const char *path, ds4_error *err) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return DS4_OK;
        return ds4_fail(err, DS4_ERR_IO, "%s: stat %s: %s", what, path, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) {
        if (unlink(path) != 0 && errno != ENOENT)
            return ds4_fail(err, DS4_ERR_IO, "%s: remove %s: %s", what, path, strerror(errno));
        return DS4_OK;
    }
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return ds4_fail(err, DS4_ERR_IO, "%s: open %s: %s", what, path, strerror(errno));
    char bad[300] = "";
    int rc = rm_contents(fd, 0, bad, sizeof bad);
    int e = errno;
    close(fd);
    if (rc != 0) return ds4_fail(err, DS4_ERR_IO, "%s: remove %s/%s: %s", what, path, bad, strerror(e));
    if (rmdir(path) != 0 && errno != ENOENT)
        return ds4_fail(err, DS4_ERR_IO, "%s: rmdir %s: %s", what, path, strerror(errno));
    return DS4_OK;
}

int ds4_fs_split(const char *path, char *parent, size_t pcap, char *base, size_t bcap) {
    if (!path) return 0;
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    if (len == 0 || (len == 1 && path[0] == '/')) return 0;
    size_t slash = len;
    while (slash > 0 && path[slash - 1] != '/') slash--;
    /* path[slash .. len) is the last component; path[0 .. slash) its parent with trailing slashes */
    size_t blen = len - slash;
    if (blen + 1 > bcap) return 0;
    memcpy(base, path + slash, blen);
    base[blen] = 0;
    if (!strcmp(base, ".") || !strcmp(base, "..")) return 0;
    if (slash == 0) {
        if (pcap < 2) return 0;
        strcpy(parent, ".");
        return 1;
    }
    size_t plen = slash;
    while (plen > 1 && path[plen - 1] == '/') plen--;
    if (plen + 1 > pcap) return 0;
    memcpy(parent, path, plen);
    parent[plen] = 0;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ CRC-32 */

typedef struct crc_tables {
    uint32_t t[8][256];
} crc_tables;

/* Slicing-by-8 tables, built per call: a few microseconds, and no global state. */
static void crc_init(crc_tables *ct) {
    uint32_t (*t)[256] = ct->t;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
}

static uint32_t crc_update(const crc_tables *ct, uint32_t crc, const unsigned char *p, size_t n) {
    const uint32_t (*t)[256] = ct->t;
    crc = ~crc;
    while (n >= 8) {
        uint32_t a = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t b = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^ t[4][a >> 24] ^ t[3][b & 0xFF] ^
              t[2][(b >> 8) & 0xFF] ^ t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

uint32_t ds4_crc32(uint32_t crc, const void *data, size_t n) {
    crc_tables t;
    crc_init(&t);
    return crc_update(&t, crc, data, n);
}

/* Size (and CRC-32, and fsync) of the regular file `path`. */
static ds4_status file_digest(const char *what, const char *path, const crc_tables *t, int want_crc, int want_sync,
                              int64_t *size, uint32_t *crc, ds4_error *err) {
    int fd;
    ds4_status s = ds4_open_regular(path, O_NOFOLLOW, DS4_ERR_FORMAT, &fd, size, err); /* never blocks on a FIFO */
    if (s) {
        ds4_error_prefix(err, "%s: ", what);
        return s;
    }
    unsigned char *buf = NULL;
    if (want_crc) {
        enum { CHUNK = 1 << 20 };
        buf = malloc(CHUNK);
        if (!buf) {
            s = ds4_fail(err, DS4_ERR_OOM, "%s: read buffer for %s", what, path);
            goto out;
        }
        uint32_t c = 0;
        int64_t total = 0;
        for (;;) {
            ssize_t r = read(fd, buf, CHUNK);
            if (r < 0) {
                if (errno == EINTR) continue;
                s = ds4_fail(err, DS4_ERR_IO, "%s: read %s: %s", what, path, strerror(errno));
                goto out;
            }
            if (r == 0) break;
            c = crc_update(t, c, buf, (size_t)r);
            total += r;
        }
        if (total != *size) {
            s = ds4_fail(err, DS4_ERR_IO, "%s: %s changed while being read (%lld bytes read, %lld in stat)", what,
                         path, (long long)total, (long long)*size);
            goto out;
        }
        *crc = c;
    }
    if (want_sync && fsync(fd) != 0) s = ds4_fail(err, DS4_ERR_IO, "%s: fsync %s: %s", what, path, strerror(errno));
out:
    free(buf);
    close(fd);
    return s;
}

/* ------------------------------------------------------------------------------------------------ names */

/* Parse n >= 1 decimal digits at *p (at most MAX_STEP_DIGITS), advancing *p. */
static int parse_digits(const char **p, int64_t *v, size_t *nd) {
    int64_t x = 0;
    size_t k = 0;
    const char *s = *p;
    while (*s >= '0' && *s <= '9') {
        if (k == MAX_STEP_DIGITS) return 0;
        x = x * 10 + (*s - '0');
        k++;
        s++;
    }
    if (k == 0) return 0;
    *p = s;
    *v = x;
    *nd = k;
    return 1;
}

/* "step_" + canonical digits, ending at *end. */
static int parse_step_prefix(const char *name, int64_t *step, const char **end) {
    if (strncmp(name, "step_", 5) != 0) return 0;
    const char *p = name + 5;
    int64_t v;
    size_t nd;
    if (!parse_digits(&p, &v, &nd)) return 0;
    /* exactly what "%06lld" prints: 6 digits, or more without a leading zero (so no two names share a step) */
    if (nd < 6 || (nd > 6 && name[5] == '0')) return 0;
    *step = v;
    *end = p;
    return 1;
}

int ds4_ckpt_parse_name(const char *name, int64_t *step) {
    int64_t v;
    const char *end;
    if (!name || !parse_step_prefix(name, &v, &end) || *end != 0) return 0;
    if (step) *step = v;
    return 1;
}

static int host_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
           c == '_';
}

typedef enum { LEFT_TMP, LEFT_OLD, LEFT_DEL } left_kind;

/* "step_NNNNNN.{tmp,old,del}-PID[@HOST]". host receives HOST ("" when absent). */
static int parse_leftover(const char *name, int64_t *step, left_kind *kind, int64_t *pid, char *host, size_t hcap) {
    const char *p;
    if (!parse_step_prefix(name, step, &p)) return 0;
    if (!strncmp(p, ".tmp-", 5)) *kind = LEFT_TMP;
    else if (!strncmp(p, ".old-", 5)) *kind = LEFT_OLD;
    else if (!strncmp(p, ".del-", 5)) *kind = LEFT_DEL;
    else return 0;
    p += 5;
    size_t nd;
    if (!parse_digits(&p, pid, &nd) || *pid <= 0) return 0;
    host[0] = 0;
    if (*p == 0) return 1;
    if (*p != '@' || !p[1]) return 0;
    size_t hl = strlen(p + 1);
    if (hl + 1 > hcap) return 0;
    for (size_t i = 0; i < hl; i++)
        if (!host_char(p[1 + i])) return 0;
    memcpy(host, p + 1, hl + 1);
    return 1;
}

/* This host's name, reduced to characters that are safe in a file name. */
static void this_host(char *out, size_t cap) {
    char h[256];
    out[0] = 0;
    if (gethostname(h, sizeof h) != 0) return;
    h[sizeof h - 1] = 0;
    size_t k = 0;
    for (size_t i = 0; h[i] && k + 1 < cap && k < 64; i++) out[k++] = host_char(h[i]) ? h[i] : '_';
    out[k] = 0;
}

static int pid_alive(int64_t pid) {
    if (pid <= 0 || pid > 0x7fffffff) return 0;
    if (kill((pid_t)pid, 0) == 0) return 1;
    return errno == EPERM; /* exists, owned by someone else */
}

/* root + "/" + name, without doubling the slash. */
static char *join(const char *root, const char *name) {
    size_t rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/') rl--;
    size_t nl = strlen(name);
    char *p = malloc(rl + nl + 2);
    if (!p) return NULL;
    memcpy(p, root, rl);
    size_t o = rl;
    if (!(rl == 1 && root[0] == '/')) p[o++] = '/';
    memcpy(p + o, name, nl + 1);
    return p;
}

/* "step_NNNNNN.KIND-PID@HOST" for this process. */
static void leftover_name(char *out, size_t cap, int64_t step, const char *kind) {
    char host[80];
    this_host(host, sizeof host);
    snprintf(out, cap, "step_%06lld.%s-%ld%s%s", (long long)step, kind, (long)getpid(), host[0] ? "@" : "", host);
}

int ds4_ckpt_step_path(const char *root, int64_t step, char *out, size_t cap) {
    if (!root || !out || step < 0 || step >= 1000000000000000000ll) return 0;
    char name[40];
    snprintf(name, sizeof name, "step_%06lld", (long long)step);
    char *p = join(root, name);
    if (!p) return 0;
    size_t l = strlen(p);
    int ok = l + 1 <= cap;
    if (ok) memcpy(out, p, l + 1);
    free(p);
    return ok;
}

/* Names allowed inside a checkpoint directory: they go into the marker's JSON unescaped. */
static int safe_file_name(const char *n) {
    size_t l = strlen(n);
    if (l == 0 || l > MAX_FILE_NAME || !strcmp(n, ".") || !strcmp(n, "..")) return 0;
    for (size_t i = 0; i < l; i++) {
        char c = n[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-'))
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------------ begin / commit */

static ds4_status check_step(const char *what, int64_t step, ds4_error *err) {
    if (step < 0 || step >= 1000000000000000000ll)
        return ds4_fail(err, DS4_ERR_ARG, "%s: step %lld outside [0, 10^18)", what, (long long)step);
    return DS4_OK;
}

ds4_status ds4_ckpt_begin(const char *root, int64_t step, char **tmp_path, ds4_error *err) {
    const char *what = "checkpoint begin";
    if (!root || !root[0] || !tmp_path) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL or empty argument", what);
    *tmp_path = NULL;
    ds4_status s = check_step(what, step, err);
    if (s) return s;
    s = ds4_fs_mkdirs(what, root, err);
    if (s) return s;
    char name[200];
    leftover_name(name, sizeof name, step, "tmp");
    char *path = join(root, name);
    if (!path) return ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
    /* Our own leftover (an earlier failed attempt of this process): discard it. */
    s = ds4_fs_rmtree(what, path, err);
    if (!s && mkdir(path, 0755) != 0) s = ds4_fail(err, DS4_ERR_IO, "%s: mkdir %s: %s", what, path, strerror(errno));
    if (s) {
        free(path);
        return s;
    }
    *tmp_path = path;
    return DS4_OK;
}

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) DS4_PRINTF(2, 3);
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int w = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (w < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && (size_t)w < b->cap - b->len) {
            b->len += (size_t)w;
            return;
        }
        size_t nc = b->cap ? b->cap : 1024;
        while (nc < b->len + (size_t)w + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

/* After a commit of step `step`: remove crash leftovers (".tmp-", ".old-", ".del-" + pid@host) that can no longer
 * belong to a running writer. Those of this host whose process is gone, and those of an older step than the one
 * just committed, whatever their pid or host: one writer per root (ds4_ckpt.h) means nobody is still writing an
 * older step, and the pid test alone keeps a leftover forever where pids repeat across restarts (a container's
 * trainer is often pid 1 again) or the host name changes with each container. Best effort: a leftover that
 * cannot be removed now is tried again after the next commit. */
static void clean_leftovers(const char *root, int64_t step) {
    int dfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;
    name_list names = {0};
    int rc = read_names(dfd, &names);
    char me[80];
    this_host(me, sizeof me);
    for (size_t i = 0; rc == 0 && i < names.n; i++) {
        int64_t lstep, pid;
        left_kind kind;
        char host[256];
        if (!parse_leftover(names.v[i], &lstep, &kind, &pid, host, sizeof host)) continue;
        int mine = !host[0] || !strcmp(host, me);
        if (lstep >= step && !(mine && !pid_alive(pid))) continue;
        struct stat st;
        if (fstatat(dfd, names.v[i], &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
        char *p = join(root, names.v[i]);
        if (p) ds4_fs_rmtree("checkpoint commit", p, NULL);
        free(p);
    }
    names_free(&names);
    close(dfd);
}

ds4_status ds4_ckpt_commit(const char *root, int64_t step, const char *tmp_path, ds4_error *err) {
    const char *what = "checkpoint commit";
    if (!root || !root[0] || !tmp_path) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL or empty argument", what);
    ds4_status s = check_step(what, step, err);
    if (s) return s;
    /* The temporary directory must be one of step `step`: committing another step's files under this name
     * would be a silent mix-up. */
    {
        char parent[4096], base[256], host[256];
        int64_t tstep, pid;
        left_kind kind;
        if (!ds4_fs_split(tmp_path, parent, sizeof parent, base, sizeof base) ||
            !parse_leftover(base, &tstep, &kind, &pid, host, sizeof host) || kind != LEFT_TMP || tstep != step)
            return ds4_fail(err, DS4_ERR_ARG, "%s: %s is not a temporary directory of step %lld (from ds4_ckpt_begin)",
                            what, tmp_path, (long long)step);
    }
    name_list files = {0};
    sbuf mk = {0};
    char *final = NULL, *old = NULL, *path = NULL;
    int64_t *sizes = NULL;
    uint32_t *crcs = NULL;
    crc_tables *tab = malloc(sizeof *tab);
    int dfd = open(tmp_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        s = ds4_fail(err, errno == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO, "%s: open %s: %s", what, tmp_path,
                     strerror(errno));
        goto out;
    }
    if (!tab) {
        s = ds4_fail(err, DS4_ERR_OOM, "%s: CRC tables", what);
        goto out;
    }
    crc_init(tab);
    name_list all = {0};
    if (read_names(dfd, &all) != 0) {
        s = ds4_fail(err, DS4_ERR_IO, "%s: read directory %s: %s", what, tmp_path, strerror(errno));
        names_free(&all);
        goto out;
    }
    for (size_t i = 0; i < all.n && !s; i++) {
        const char *nm = all.v[i];
        if (!strcmp(nm, DS4_CKPT_MARKER)) continue; /* a marker of an earlier failed commit: rewritten below */
        struct stat st;
        if (fstatat(dfd, nm, &st, AT_SYMLINK_NOFOLLOW) != 0)
            s = ds4_fail(err, DS4_ERR_IO, "%s: stat %s/%s: %s", what, tmp_path, nm, strerror(errno));
        else if (!S_ISREG(st.st_mode))
            s = ds4_fail(err, DS4_ERR_ARG, "%s: %s/%s is not a regular file (a checkpoint holds regular files only)",
                         what, tmp_path, nm);
        else if (!safe_file_name(nm))
            s = ds4_fail(err, DS4_ERR_ARG, "%s: file name '%s' in %s: use 1-%d characters of [A-Za-z0-9._-]", what, nm,
                         tmp_path, MAX_FILE_NAME);
        else if (!names_add(&files, nm))
            s = ds4_fail(err, DS4_ERR_OOM, "%s: file list", what);
    }
    names_free(&all);
    if (s) goto out;
    if (files.n > 1) qsort(files.v, files.n, sizeof *files.v, cmp_str);
    sizes = calloc(files.n ? files.n : 1, sizeof *sizes);
    crcs = calloc(files.n ? files.n : 1, sizeof *crcs);
    if (!sizes || !crcs) {
        s = ds4_fail(err, DS4_ERR_OOM, "%s: file table", what);
        goto out;
    }
    for (size_t i = 0; i < files.n && !s; i++) {
        free(path);
        path = join(tmp_path, files.v[i]);
        if (!path) s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
        else s = file_digest(what, path, tab, 1, 1, &sizes[i], &crcs[i], err);
    }
    if (s) goto out;

    /* The marker: written, fsynced, and the directory fsynced, before the rename publishes anything. */
    time_t now = time(NULL);
    struct tm utc;
    char iso[40] = "";
    if (gmtime_r(&now, &utc)) strftime(iso, sizeof iso, "%Y-%m-%dT%H:%M:%SZ", &utc);
    sb_printf(&mk, "{\n  \"format\": \"ds4-checkpoint\",\n  \"version\": 1,\n  \"step\": %lld,\n", (long long)step);
    sb_printf(&mk, "  \"time\": %lld,\n  \"time_utc\": \"%s\",\n  \"files\": [", (long long)now, iso);
    for (size_t i = 0; i < files.n; i++)
        sb_printf(&mk, "%s\n    {\"name\": \"%s\", \"size\": %lld, \"crc32\": \"%08x\"}", i ? "," : "", files.v[i],
                  (long long)sizes[i], (unsigned)crcs[i]);
    sb_printf(&mk, "%s]\n}\n", files.n ? "\n  " : "");
    if (mk.oom) {
        s = ds4_fail(err, DS4_ERR_OOM, "%s: marker text", what);
        goto out;
    }
    free(path);
    path = join(tmp_path, DS4_CKPT_MARKER);
    if (!path) {
        s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
        goto out;
    }
    s = ds4_fs_write_file(what, path, mk.p, mk.len, err);
    if (!s) s = ds4_fs_sync_dir(what, tmp_path, err);
    if (s) goto out;

    char name[200];
    snprintf(name, sizeof name, "step_%06lld", (long long)step);
    final = join(root, name);
    leftover_name(name, sizeof name, step, "old");
    old = join(root, name);
    if (!final || !old) {
        s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
        goto out;
    }
    struct stat st;
    int had_old = 0;
    if (lstat(final, &st) == 0) {
        /* Re-saving a step (say after resuming from it): rename cannot replace a non-empty directory, so the old
         * one moves aside first. A crash in between leaves it as an ".old-" leftover, never a damaged step. */
        if (rename(final, old) != 0) {
            s = ds4_fail(err, DS4_ERR_IO, "%s: move the existing %s aside to %s: %s", what, final, old, strerror(errno));
            goto out;
        }
        had_old = 1;
    }
    if (rename(tmp_path, final) != 0) {
        s = ds4_fail(err, DS4_ERR_IO, "%s: rename %s to %s: %s", what, tmp_path, final, strerror(errno));
        if (had_old) (void)rename(old, final);
        goto out;
    }
    s = ds4_fs_sync_dir(what, root, err);
    if (had_old) ds4_fs_rmtree(what, old, NULL); /* best effort: at worst an ".old-" leftover remains */
    if (!s) clean_leftovers(root, step);
out:
    if (dfd >= 0) close(dfd);
    names_free(&files);
    free(mk.p);
    free(final);
    free(old);
    free(path);
    free(sizes);
    free(crcs);
    free(tab);
    return s;
}

ds4_status ds4_ckpt_abort(const char *tmp_path, ds4_error *err) {
    const char *what = "checkpoint abort";
    if (!tmp_path) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL path", what);
    char parent[4096], base[256], host[256];
    int64_t step, pid;
    left_kind kind;
    if (!ds4_fs_split(tmp_path, parent, sizeof parent, base, sizeof base) ||
        !parse_leftover(base, &step, &kind, &pid, host, sizeof host) || kind != LEFT_TMP)
        return ds4_fail(err, DS4_ERR_ARG, "%s: refusing to remove %s: not a step_NNNNNN.tmp-* directory", what,
                        tmp_path);
    return ds4_fs_rmtree(what, tmp_path, err);
}

/* ------------------------------------------------------------------------------------------------ verification */

static int hex8(const char *s, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 8; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return 0;
        v = v << 4 | (uint32_t)d;
    }
    if (s[8]) return 0;
    *out = v;
    return 1;
}

ds4_status ds4_ckpt_check(const char *dir, ds4_ckpt_verify how, int64_t *step_out, ds4_error *err) {
    const char *what = "checkpoint check";
    if (!dir) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL path", what);
    if (how != DS4_CKPT_VERIFY_FULL && how != DS4_CKPT_VERIFY_SIZES)
        return ds4_fail(err, DS4_ERR_ARG, "%s %s: unknown verification level %d", what, dir, (int)how);
    struct stat st;
    if (stat(dir, &st) != 0)
        return ds4_fail(err, errno == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO, "%s %s: %s", what, dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return ds4_fail(err, DS4_ERR_FORMAT, "%s %s: not a directory", what, dir);
    char *mpath = join(dir, DS4_CKPT_MARKER), *text = NULL, *path = NULL;
    ds4_json *doc = NULL;
    crc_tables *tab = NULL;
    ds4_status s = DS4_OK;
    if (!mpath) return ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
    if (lstat(mpath, &st) != 0) {
        s = ds4_fail(err, errno == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO,
                     "%s %s: no %s marker (%s): an unfinished or interrupted save", what, dir, DS4_CKPT_MARKER,
                     strerror(errno));
        goto out;
    }
    size_t len = 0;
    s = ds4_read_file(mpath, MAX_MARKER, &text, &len, err);
    if (s) {
        ds4_error_prefix(err, "%s %s: marker: ", what, dir);
        goto out;
    }
    doc = ds4_json_parse(text, len, NULL, err);
    if (!doc) {
        ds4_error_prefix(err, "%s %s: marker is not valid JSON: ", what, dir);
        s = DS4_ERR_FORMAT;
        goto out;
    }
    const ds4_json *fmt = ds4_json_get(doc, "format"), *ver = ds4_json_get(doc, "version"),
                   *stp = ds4_json_get(doc, "step"), *files = ds4_json_get(doc, "files");
    if (!fmt || fmt->type != DS4_JSON_STRING || strcmp(fmt->str, "ds4-checkpoint") != 0 || !ver ||
        ver->type != DS4_JSON_NUMBER || !ver->is_int || ver->integer != 1 || !stp || stp->type != DS4_JSON_NUMBER ||
        !stp->is_int || stp->integer < 0 || !files || files->type != DS4_JSON_ARRAY) {
        s = ds4_fail(err, DS4_ERR_FORMAT,
                     "%s %s: marker lacks format \"ds4-checkpoint\", version 1, an integer step or a files array", what,
                     dir);
        goto out;
    }
    {
        char parent[4096], base[256];
        int64_t dstep;
        if (ds4_fs_split(dir, parent, sizeof parent, base, sizeof base) && ds4_ckpt_parse_name(base, &dstep) &&
            dstep != stp->integer) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: the marker says step %lld, the directory name step %lld", what,
                         dir, (long long)stp->integer, (long long)dstep);
            goto out;
        }
    }
    if (how == DS4_CKPT_VERIFY_FULL) {
        tab = malloc(sizeof *tab);
        if (!tab) {
            s = ds4_fail(err, DS4_ERR_OOM, "%s: CRC tables", what);
            goto out;
        }
        crc_init(tab);
    }
    for (size_t i = 0; i < files->count; i++) {
        const ds4_json *f = &files->items[i];
        const ds4_json *nm = ds4_json_get(f, "name"), *sz = ds4_json_get(f, "size"), *cr = ds4_json_get(f, "crc32");
        uint32_t want_crc = 0;
        if (!nm || nm->type != DS4_JSON_STRING || !safe_file_name(nm->str) || !strcmp(nm->str, DS4_CKPT_MARKER) ||
            !sz || sz->type != DS4_JSON_NUMBER || !sz->is_int || sz->integer < 0 || !cr || cr->type != DS4_JSON_STRING ||
            !hex8(cr->str, &want_crc)) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: marker file entry %zu is not {name, size, crc32 (8 hex digits)}",
                         what, dir, i);
            goto out;
        }
        for (size_t j = 0; j < i; j++) {
            const ds4_json *o = ds4_json_get(&files->items[j], "name");
            if (!strcmp(o->str, nm->str)) {
                s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: marker lists %s twice", what, dir, nm->str);
                goto out;
            }
        }
        free(path);
        path = join(dir, nm->str);
        if (!path) {
            s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
            goto out;
        }
        int64_t size = -1;
        uint32_t crc = 0;
        s = file_digest(what, path, tab, how == DS4_CKPT_VERIFY_FULL, 0, &size, &crc, err);
        if (s) {
            if (s == DS4_ERR_NOT_FOUND)
                s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: file %s listed in the marker is missing", what, dir, nm->str);
            goto out;
        }
        if (size != sz->integer) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: file %s has %lld bytes, the marker says %lld (truncated or "
                         "rewritten)", what, dir, nm->str, (long long)size, (long long)sz->integer);
            goto out;
        }
        if (how == DS4_CKPT_VERIFY_FULL && crc != want_crc) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "%s %s: file %s has CRC-32 %08x, the marker says %08x (corrupted)", what,
                         dir, nm->str, (unsigned)crc, (unsigned)want_crc);
            goto out;
        }
    }
    if (step_out) *step_out = stp->integer;
out:
    ds4_json_free(doc);
    free(text);
    free(mpath);
    free(path);
    free(tab);
    return s;
}

/* ------------------------------------------------------------------------------------------------ scan / list */

static int cmp_entry(const void *a, const void *b) {
    const ds4_ckpt_entry *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    return strcmp(x->name, y->name);
}

ds4_status ds4_ckpt_scan(const char *root, ds4_ckpt_verify how, ds4_ckpt_entry **entries, size_t *n_out,
                         ds4_error *err) {
    const char *what = "checkpoint scan";
    if (!root || !entries || !n_out) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL argument", what);
    *entries = NULL;
    *n_out = 0;
    int dfd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        if (errno == ENOENT) return DS4_OK;
        return ds4_fail(err, DS4_ERR_IO, "%s: open %s: %s", what, root, strerror(errno));
    }
    name_list names = {0};
    int rc = read_names(dfd, &names);
    int e = errno;
    ds4_status s = DS4_OK;
    if (rc != 0) {
        close(dfd);
        names_free(&names);
        return ds4_fail(err, DS4_ERR_IO, "%s: read directory %s: %s", what, root, strerror(e));
    }
    ds4_ckpt_entry *out = calloc(names.n ? names.n : 1, sizeof *out);
    if (!out) {
        close(dfd);
        names_free(&names);
        return ds4_fail(err, DS4_ERR_OOM, "%s: %zu entries", what, names.n);
    }
    char me[80];
    this_host(me, sizeof me);
    size_t n = 0;
    for (size_t i = 0; i < names.n && !s; i++) {
        const char *nm = names.v[i];
        int64_t step, pid;
        left_kind kind;
        char host[256];
        int is_final = ds4_ckpt_parse_name(nm, &step);
        if (!is_final && !parse_leftover(nm, &step, &kind, &pid, host, sizeof host)) continue;
        if (strlen(nm) >= sizeof out[n].name) continue;
        struct stat st;
        if (fstatat(dfd, nm, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
        ds4_ckpt_entry *en = &out[n];
        memset(en, 0, sizeof *en);
        snprintf(en->name, sizeof en->name, "%s", nm);
        en->step = step;
        if (is_final) {
            char *dir = join(root, nm);
            if (!dir) {
                s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
                break;
            }
            ds4_error ce = {0};
            ds4_status cs = ds4_ckpt_check(dir, how, NULL, &ce);
            free(dir);
            if (cs == DS4_ERR_OOM) {
                s = ds4_fail(err, DS4_ERR_OOM, "%s", ce.msg);
                break;
            }
            en->kind = cs == DS4_OK ? DS4_CKPT_COMPLETE : DS4_CKPT_INCOMPLETE;
            if (cs) snprintf(en->reason, sizeof en->reason, "%.*s", (int)sizeof en->reason - 1, ce.msg);
        } else {
            static const char *const kinds[] = {"temporary directory", "replaced checkpoint", "checkpoint being removed"};
            /* A leftover without a host part is of the old "tmp-<pid>" form: taken to be this host's. */
            int mine = !host[0] || !strcmp(host, me);
            en->pid = pid;
            en->kind = (!mine || pid_alive(pid)) ? DS4_CKPT_ACTIVE : DS4_CKPT_STALE;
            snprintf(en->reason, sizeof en->reason, "%s of pid %lld on %s (%s)", kinds[kind], (long long)pid,
                     host[0] ? host : "this host",
                     !mine ? "another host: never removed from here"
                           : en->kind == DS4_CKPT_ACTIVE ? "process alive" : "process gone");
        }
        n++;
    }
    close(dfd);
    names_free(&names);
    if (s) {
        free(out);
        return s;
    }
    qsort(out, n, sizeof *out, cmp_entry);
    *entries = out;
    *n_out = n;
    return DS4_OK;
}

ds4_status ds4_ckpt_list(const char *root, int64_t **steps, size_t *n, ds4_error *err) {
    if (!steps || !n) return ds4_fail(err, DS4_ERR_ARG, "checkpoint list: NULL argument");
    *steps = NULL;
    *n = 0;
    ds4_ckpt_entry *en = NULL;
    size_t ne = 0;
    ds4_status s = ds4_ckpt_scan(root, DS4_CKPT_VERIFY_FULL, &en, &ne, err);
    if (s) return s;
    int64_t *out = malloc((ne ? ne : 1) * sizeof *out);
    if (!out) {
        free(en);
        return ds4_fail(err, DS4_ERR_OOM, "checkpoint list: %zu steps", ne);
    }
    size_t k = 0;
    for (size_t i = 0; i < ne; i++)
        if (en[i].kind == DS4_CKPT_COMPLETE) out[k++] = en[i].step;
    free(en);
    *steps = out;
    *n = k;
    return DS4_OK;
}

/* Index into en of the newest entry that is complete by sizes and also passes the checksums; entries newer
 * than it that fail are turned INCOMPLETE. -1 when there is none. */
static ptrdiff_t newest_verified(const char *root, ds4_ckpt_entry *en, size_t n, ds4_status *fatal, ds4_error *err) {
    *fatal = DS4_OK;
    for (size_t k = n; k-- > 0;) {
        if (en[k].kind != DS4_CKPT_COMPLETE) continue;
        char *dir = join(root, en[k].name);
        if (!dir) {
            *fatal = ds4_fail(err, DS4_ERR_OOM, "checkpoint: path");
            return -1;
        }
        ds4_error ce = {0};
        ds4_status cs = ds4_ckpt_check(dir, DS4_CKPT_VERIFY_FULL, NULL, &ce);
        free(dir);
        if (cs == DS4_OK) return (ptrdiff_t)k;
        en[k].kind = DS4_CKPT_INCOMPLETE;
        snprintf(en[k].reason, sizeof en[k].reason, "%.*s", (int)sizeof en[k].reason - 1, ce.msg);
    }
    return -1;
}

ds4_status ds4_ckpt_latest(const char *root, int64_t *step, ds4_error *err) {
    if (!root || !step) return ds4_fail(err, DS4_ERR_ARG, "checkpoint latest: NULL argument");
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    ds4_status s = ds4_ckpt_scan(root, DS4_CKPT_VERIFY_SIZES, &en, &n, err);
    if (s) return s;
    ptrdiff_t k = newest_verified(root, en, n, &s, err);
    if (!s && k < 0) {
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += en[i].kind == DS4_CKPT_INCOMPLETE;
        s = ds4_fail(err, DS4_ERR_NOT_FOUND, "checkpoint latest %s: no complete checkpoint (%zu incomplete, %zu "
                     "leftover directories)", root, bad, n - bad);
    }
    if (!s) *step = en[k].step;
    free(en);
    return s;
}

/* ------------------------------------------------------------------------------------------------ prune */

ds4_status ds4_ckpt_prune(const char *root, const ds4_ckpt_prune_options *opt, ds4_ckpt_prune_result *res,
                          ds4_error *err) {
    const char *what = "checkpoint prune";
    if (res) memset(res, 0, sizeof *res);
    if (!root || !opt) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL argument", what);
    if (opt->keep_last < 0 || opt->keep_every < 0)
        return ds4_fail(err, DS4_ERR_ARG, "%s %s: keep_last %lld and keep_every %lld must be >= 0", what, root,
                        (long long)opt->keep_last, (long long)opt->keep_every);
    ds4_ckpt_entry *en = NULL;
    size_t n = 0;
    ds4_status s = ds4_ckpt_scan(root, DS4_CKPT_VERIFY_SIZES, &en, &n, err);
    if (s) return s;
    int64_t *removed = malloc((n ? n : 1) * sizeof *removed);
    if (!removed) {
        free(en);
        return ds4_fail(err, DS4_ERR_OOM, "%s: result", what);
    }
    size_t n_removed = 0, n_kept = 0, n_cleaned = 0, n_left = 0;
    ptrdiff_t newest = newest_verified(root, en, n, &s, err);
    size_t n_complete = 0;
    for (size_t i = 0; i < n; i++) n_complete += en[i].kind == DS4_CKPT_COMPLETE;
    size_t rank = 0; /* complete checkpoints seen so far, oldest first */
    for (size_t i = 0; i < n && !s; i++) {
        ds4_ckpt_entry *e = &en[i];
        if (e->kind != DS4_CKPT_COMPLETE) {
            if (e->kind == DS4_CKPT_STALE && opt->clean_stale) {
                if (!opt->dry_run) {
                    char *p = join(root, e->name);
                    s = p ? ds4_fs_rmtree(what, p, err) : ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
                    free(p);
                    if (s) break;
                }
                n_cleaned++;
            } else {
                n_left++;
            }
            continue;
        }
        rank++;
        int keep = newest < 0                                        /* nothing verifies: touch nothing */
                   || (ptrdiff_t)i == newest                         /* the newest is never removed */
                   || n_complete - rank < (size_t)opt->keep_last     /* one of the keep_last newest */
                   || (opt->keep_every > 0 && e->step % opt->keep_every == 0);
        if (keep) {
            n_kept++;
            continue;
        }
        if (!opt->dry_run) {
            /* Rename first: the step_N name disappears atomically, and a crash during the removal leaves a
             * ".del-" leftover instead of a step_N with missing files. */
            char dname[200];
            leftover_name(dname, sizeof dname, e->step, "del");
            char *from = join(root, e->name), *to = join(root, dname);
            if (!from || !to) s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
            else if (rename(from, to) != 0) {
                if (errno != ENOENT) /* ENOENT: another pruner got there first */
                    s = ds4_fail(err, DS4_ERR_IO, "%s: rename %s to %s: %s", what, from, to, strerror(errno));
            } else {
                s = ds4_fs_rmtree(what, to, err);
            }
            free(from);
            free(to);
            if (s) break;
        }
        removed[n_removed++] = e->step;
    }
    free(en);
    if (res && !s) {
        res->removed = removed;
        res->n_removed = n_removed;
        res->n_kept = n_kept;
        res->n_cleaned = n_cleaned;
        res->n_left = n_left;
    } else {
        free(removed);
    }
    return s;
}

/* ------------------------------------------------------------------------------------------------ extra state */

static ds4_status check_state_name(const char *what, const char *name, ds4_error *err) {
    size_t l = name ? strlen(name) : 0;
    int ok = l >= 1 && l <= 64 && strcmp(name, "model") != 0 && strcmp(name, "config") != 0;
    for (size_t i = 0; ok && i < l; i++) {
        char c = name[i];
        ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    }
    if (!ok)
        return ds4_fail(err, DS4_ERR_ARG, "%s: state name '%s' must be 1-64 characters of [A-Za-z0-9_-] and not "
                        "'model' or 'config'", what, name ? name : "(null)");
    return DS4_OK;
}

static char *state_path(const char *dir, const char *name, const char *ext) {
    char fn[80];
    snprintf(fn, sizeof fn, "%s%s", name, ext);
    return join(dir, fn);
}

ds4_status ds4_ckpt_write_state(const char *dir, const char *name, size_t n, const char *const *names,
                                const ds4_tensor *const *tensors, const char *json_meta, ds4_error *err) {
    const char *what = "checkpoint write_state";
    if (!dir) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL directory", what);
    ds4_status s = check_state_name(what, name, err);
    if (s) return s;
    const char *meta = json_meta ? json_meta : "{}";
    size_t mlen = strlen(meta);
    /* Validate the metadata now: a checkpoint whose state cannot be read back is found out at resume time,
     * which is far too late. */
    ds4_json *doc = ds4_json_parse(meta, mlen, NULL, err);
    if (!doc) {
        ds4_error_prefix(err, "%s %s/%s.json: metadata is not valid JSON: ", what, dir, name);
        return DS4_ERR_ARG;
    }
    int is_obj = doc->type == DS4_JSON_OBJECT;
    ds4_json_free(doc);
    if (!is_obj) return ds4_fail(err, DS4_ERR_ARG, "%s %s/%s.json: metadata must be a JSON object", what, dir, name);
    char *tp = state_path(dir, name, ".safetensors"), *jp = state_path(dir, name, ".json");
    if (!tp || !jp) s = ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
    if (!s) {
        s = ds4_st_write(tp, n, names, tensors, err);
        if (s) ds4_error_prefix(err, "%s: ", what);
    }
    if (!s) s = ds4_fs_write_file(what, jp, meta, mlen, err);
    free(tp);
    free(jp);
    return s;
}

ds4_status ds4_ckpt_read_state(const char *dir, const char *name, ds4_st_file **tensors, char **json_meta,
                               ds4_error *err) {
    const char *what = "checkpoint read_state";
    if (tensors) *tensors = NULL;
    if (json_meta) *json_meta = NULL;
    if (!dir) return ds4_fail(err, DS4_ERR_ARG, "%s: NULL directory", what);
    ds4_status s = check_state_name(what, name, err);
    if (s) return s;
    char *tp = state_path(dir, name, ".safetensors"), *jp = state_path(dir, name, ".json");
    if (!tp || !jp) {
        free(tp);
        free(jp);
        return ds4_fail(err, DS4_ERR_OOM, "%s: path", what);
    }
    struct stat st;
    if (lstat(tp, &st) != 0 || lstat(jp, &st) != 0)
        s = ds4_fail(err, DS4_ERR_NOT_FOUND, "%s %s: no state '%s' (%s.safetensors and %s.json)", what, dir, name,
                     name, name);
    if (!s && tensors) s = ds4_st_open(tp, tensors, err);
    if (!s && json_meta) {
        size_t len;
        s = ds4_read_file(jp, (size_t)1 << 30, json_meta, &len, err);
        if (s && tensors) {
            ds4_st_close(*tensors);
            *tensors = NULL;
        }
    }
    if (s && s != DS4_ERR_NOT_FOUND) ds4_error_prefix(err, "%s: ", what);
    free(tp);
    free(jp);
    return s;
}
