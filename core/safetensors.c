/* safetensors.c — safetensors reader (mmap, full header validation), atomic writer and sharded checkpoints.
 *
 * File layout: u64 little-endian header length N, N bytes of JSON header (possibly padded with trailing
 * spaces), then the data area. The header maps tensor names to {"dtype", "shape", "data_offsets"} with
 * offsets relative to the data area, plus an optional "__metadata__" object of strings.
 *
 * The reader treats the file as untrusted: like the reference Rust `safetensors` crate it requires the
 * tensors, sorted by offset, to tile the data area exactly (no overlap, no gap, nothing trailing), so every
 * byte range it hands out is inside the mapping and belongs to exactly one tensor.
 *
 * A mapped file that another process truncates while it is mapped raises SIGBUS on access; that cannot be
 * validated away and is the usual contract for mmap'd checkpoints. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"
#include "json.h"

/* The Rust crate's limit is 100 MB; a 70k-tensor checkpoint header is ~10 MB. */
#define ST_MAX_HEADER ((uint64_t)100 << 20)
/* model.safetensors.index.json: ~100 bytes per tensor; 256 MiB is far beyond any real checkpoint. */
#define ST_MAX_INDEX ((size_t)256 << 20)
/* Names in error messages are clipped so a hostile header cannot crowd out the rest of the message. */
#define NAMEFMT "'%.200s'"

struct ds4_st_file {
    void *map; /* mmap'd region (NULL for ds4_st_open_memory) */
    size_t map_len;
    size_t n;
    ds4_st_entry *entries;          /* offset order */
    const ds4_st_entry **by_name;   /* sorted by strcmp(name): binary search */
    char *arena;                    /* tensor names and metadata strings */
    size_t n_meta;
    const char **meta;              /* key0, value0, key1, value1, ... */
};

struct ds4_checkpoint {
    size_t nfiles;
    ds4_st_file **files;
    size_t n;
    const ds4_st_entry **sorted; /* union of all shards, sorted by name: entry_at order and find */
};

/* ------------------------------------------------------------------------------------------------ helpers */

static int cmp_entry_ptr_name(const void *a, const void *b) {
    const ds4_st_entry *x = *(const ds4_st_entry *const *)a, *y = *(const ds4_st_entry *const *)b;
    return strcmp(x->name, y->name);
}

static const ds4_st_entry *find_sorted(const ds4_st_entry *const *v, size_t n, const char *name) {
    if (!v || !name) return NULL;
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(v[mid]->name, name);
        if (c == 0) return v[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* dir + "/" + name, malloc'd. */
static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name), n;
    if (!ds4_add_size(a, b, &n) || !ds4_add_size(n, 2, &n)) return NULL;
    char *p = malloc(n);
    if (!p) return NULL;
    int slash = a > 0 && dir[a - 1] == '/';
    snprintf(p, n, "%s%s%s", dir, slash ? "" : "/", name);
    return p;
}

static const ds4_json_limits *header_limits(size_t header_len, ds4_json_limits *lim) {
    /* The deepest valid header is root -> tensor -> shape array (3 levels). Every JSON value takes at least
     * one byte of text, so the item count is bounded by the input size: allocation stays proportional to
     * what the caller already holds. */
    lim->max_depth = 8;
    lim->max_items = header_len + 16;
    return lim;
}

static ds4_json *parse_json(const char *what, const char *label, const char *text, size_t len,
                            const ds4_json_limits *lim, ds4_status *st, ds4_error *err) {
    ds4_error jerr;
    jerr.code = DS4_ERR_FORMAT;
    jerr.msg[0] = 0;
    ds4_json *root = ds4_json_parse(text, len, lim, &jerr);
    if (!root) {
        *st = jerr.code == DS4_ERR_OOM ? DS4_ERR_OOM : DS4_ERR_FORMAT;
        ds4_fail(err, *st, "%s %s: invalid JSON: %s", what, label, jerr.msg[0] ? jerr.msg : "parse failed");
    }
    return root;
}

/* ------------------------------------------------------------------------------------------------ reader */

typedef struct {
    ds4_st_entry e;
    uint64_t begin, end;
} st_tmp;

static int cmp_tmp_offset(const void *a, const void *b) {
    const st_tmp *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    /* zero-size tensors at an offset come before the tensor that starts there */
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->e.name, y->e.name);
}

static int json_nonneg_int(const ds4_json *v, uint64_t *out) {
    if (!v || v->type != DS4_JSON_NUMBER || !v->is_int || v->integer < 0) return 0;
    *out = (uint64_t)v->integer;
    return 1;
}

/* Validate one tensor entry `name: {...}` of the header; fills t (name still points into the DOM). */
static ds4_status parse_tensor(const char *label, const char *name, const ds4_json *v, uint64_t data_len,
                               st_tmp *t, ds4_error *err) {
    if (v->type != DS4_JSON_OBJECT)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": value is not an object",
                        label, name);
    for (size_t i = 0; i < v->count; i++) {
        const char *k = v->keys[i];
        if (strcmp(k, "dtype") != 0 && strcmp(k, "shape") != 0 && strcmp(k, "data_offsets") != 0)
            return ds4_fail(err, DS4_ERR_FORMAT,
                            "safetensors open %s: tensor " NAMEFMT ": unexpected key " NAMEFMT
                            " (allowed: dtype, shape, data_offsets)",
                            label, name, k);
    }
    const ds4_json *dt = ds4_json_get(v, "dtype"), *sh = ds4_json_get(v, "shape"),
                   *off = ds4_json_get(v, "data_offsets");
    if (!dt || !sh || !off)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": missing \"%s\"", label, name,
                        !dt ? "dtype" : !sh ? "shape" : "data_offsets");
    if (dt->type != DS4_JSON_STRING)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": dtype is not a string", label,
                        name);
    if (!ds4_dtype_from_name(dt->str, dt->str_len, &t->e.dtype))
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: tensor " NAMEFMT ": unknown or unsupported dtype \"%.40s\" (known: F32 "
                        "F16 BF16 F64 I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2 F8_E8M0)",
                        label, name, dt->str);
    if (sh->type != DS4_JSON_ARRAY)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": shape is not an array", label,
                        name);
    if (sh->count > DS4_MAX_DIMS)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": shape has %zu dims, max %d",
                        label, name, sh->count, DS4_MAX_DIMS);
    t->e.ndim = (int32_t)sh->count;
    uint64_t numel = 1;
    int overflow = 0;
    for (size_t i = 0; i < sh->count; i++) {
        uint64_t d;
        if (!json_nonneg_int(&sh->items[i], &d))
            return ds4_fail(err, DS4_ERR_FORMAT,
                            "safetensors open %s: tensor " NAMEFMT ": shape[%zu] is not a non-negative integer",
                            label, name, i);
        t->e.shape[i] = (int64_t)d;
        if (d != 0 && numel > UINT64_MAX / d) overflow = 1;
        else numel *= d;
    }
    /* A zero dimension makes the product 0 whatever the overflowing prefix was. */
    for (size_t i = 0; i < sh->count; i++)
        if (t->e.shape[i] == 0) overflow = 0, numel = 0;
    char sbuf[200];
    ds4_shape_str(sbuf, sizeof sbuf, t->e.ndim, t->e.shape);
    uint64_t esz = ds4_dtype_size(t->e.dtype);
    if (overflow || numel > (uint64_t)INT64_MAX || numel > UINT64_MAX / esz)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT ": shape %s %s: size overflows",
                        label, name, sbuf, ds4_dtype_name(t->e.dtype));
    uint64_t need = numel * esz;
    if (off->type != DS4_JSON_ARRAY || off->count != 2 || !json_nonneg_int(&off->items[0], &t->begin) ||
        !json_nonneg_int(&off->items[1], &t->end))
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: tensor " NAMEFMT ": data_offsets is not [begin, end] of non-negative "
                        "integers",
                        label, name);
    if (t->begin > t->end)
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: tensor " NAMEFMT ": data_offsets [%llu,%llu]: begin > end", label, name,
                        (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_len)
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: tensor " NAMEFMT
                        ": data_offsets [%llu,%llu] run past the end of the data area (%llu bytes)",
                        label, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)data_len);
    if (need != t->end - t->begin)
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: tensor " NAMEFMT ": shape %s %s needs %llu bytes but data_offsets "
                        "[%llu,%llu] span %llu",
                        label, name, sbuf, ds4_dtype_name(t->e.dtype), (unsigned long long)need,
                        (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)(t->end - t->begin));
    t->e.name = name;
    t->e.nbytes = (size_t)need;
    return DS4_OK;
}

/* Validate buf[0..len) and fill f (whose map fields the caller owns). */
static ds4_status st_parse(const char *label, const unsigned char *buf, size_t len, ds4_st_file *f,
                           ds4_error *err) {
    if (len < 8)
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: file is %zu bytes, too short for the 8-byte header length", label, len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i]; /* little-endian whatever the host */
    if (n > ST_MAX_HEADER)
        return ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: header length %llu exceeds the %llu-byte limit",
                        label, (unsigned long long)n, (unsigned long long)ST_MAX_HEADER);
    if (n > len - 8)
        return ds4_fail(err, DS4_ERR_FORMAT,
                        "safetensors open %s: header length %llu runs past the end of the file (%zu bytes)", label,
                        (unsigned long long)n, len);
    const size_t hlen = (size_t)n;
    const uint64_t data_len = (uint64_t)(len - 8 - hlen);
    const unsigned char *data = buf + 8 + hlen;

    ds4_json_limits lim;
    ds4_status st = DS4_OK;
    ds4_json *root = parse_json("safetensors open", label, (const char *)buf + 8, hlen, header_limits(hlen, &lim),
                                &st, err);
    if (!root) return st;
    st_tmp *tmp = NULL;
    if (root->type != DS4_JSON_OBJECT) {
        st = ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: header is not a JSON object", label);
        goto out;
    }

    /* Pass 1: validate, count and size the arena (names + metadata strings, NUL-terminated). */
    size_t ntensor = 0, arena_len = 0;
    const ds4_json *meta = NULL;
    for (size_t i = 0; i < root->count; i++) {
        const char *k = root->keys[i];
        size_t kl = strlen(k) + 1;
        if (strcmp(k, "__metadata__") == 0) {
            meta = &root->items[i];
            if (meta->type != DS4_JSON_OBJECT) {
                st = ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: __metadata__ is not an object", label);
                goto out;
            }
            for (size_t j = 0; j < meta->count; j++) {
                if (meta->items[j].type != DS4_JSON_STRING) {
                    st = ds4_fail(err, DS4_ERR_FORMAT,
                                  "safetensors open %s: __metadata__ value for key " NAMEFMT " is not a string", label,
                                  meta->keys[j]);
                    goto out;
                }
                /* sizes are bounded by the header length, which is bounded by len: no overflow possible */
                arena_len += strlen(meta->keys[j]) + 1 + meta->items[j].str_len + 1;
            }
        } else {
            ntensor++;
            arena_len += kl;
        }
    }

    tmp = calloc(ntensor ? ntensor : 1, sizeof *tmp);
    f->entries = calloc(ntensor ? ntensor : 1, sizeof *f->entries);
    f->by_name = calloc(ntensor ? ntensor : 1, sizeof *f->by_name);
    f->arena = malloc(arena_len ? arena_len : 1);
    f->meta = calloc(meta && meta->count ? 2 * meta->count : 1, sizeof *f->meta);
    if (!tmp || !f->entries || !f->by_name || !f->arena || !f->meta) {
        st = ds4_fail(err, DS4_ERR_OOM, "safetensors open %s: cannot allocate the index of %zu tensors", label,
                      ntensor);
        goto out;
    }

    size_t ti = 0;
    for (size_t i = 0; i < root->count; i++) {
        if (&root->items[i] == meta) continue;
        st = parse_tensor(label, root->keys[i], &root->items[i], data_len, &tmp[ti], err);
        if (st) goto out;
        ti++;
    }

    /* Tiling: sorted by offset, each tensor begins where the previous one ended and the last one ends at the
     * end of the data area. This rejects overlaps (aliasing writes), gaps and trailing garbage. */
    qsort(tmp, ntensor, sizeof *tmp, cmp_tmp_offset);
    uint64_t pos = 0;
    for (size_t i = 0; i < ntensor; i++) {
        if (tmp[i].begin != pos) {
            if (i == 0)
                st = ds4_fail(err, DS4_ERR_FORMAT,
                              "safetensors open %s: tensor " NAMEFMT
                              ": data_offsets [%llu,%llu] leave a gap: data bytes [0,%llu) belong to no tensor",
                              label, tmp[i].e.name, (unsigned long long)tmp[i].begin,
                              (unsigned long long)tmp[i].end, (unsigned long long)tmp[i].begin);
            else if (tmp[i].begin > pos)
                st = ds4_fail(err, DS4_ERR_FORMAT,
                              "safetensors open %s: gap of %llu bytes between tensor " NAMEFMT
                              " data_offsets [%llu,%llu] and tensor " NAMEFMT " data_offsets [%llu,%llu]",
                              label, (unsigned long long)(tmp[i].begin - pos), tmp[i - 1].e.name,
                              (unsigned long long)tmp[i - 1].begin, (unsigned long long)tmp[i - 1].end,
                              tmp[i].e.name, (unsigned long long)tmp[i].begin, (unsigned long long)tmp[i].end);
            else
                st = ds4_fail(err, DS4_ERR_FORMAT,
                              "safetensors open %s: tensor " NAMEFMT " data_offsets [%llu,%llu] overlap tensor " NAMEFMT
                              " data_offsets [%llu,%llu]",
                              label, tmp[i].e.name, (unsigned long long)tmp[i].begin, (unsigned long long)tmp[i].end,
                              tmp[i - 1].e.name, (unsigned long long)tmp[i - 1].begin,
                              (unsigned long long)tmp[i - 1].end);
            goto out;
        }
        pos = tmp[i].end;
    }
    if (pos != data_len) {
        if (ntensor == 0)
            st = ds4_fail(err, DS4_ERR_FORMAT,
                          "safetensors open %s: header lists no tensors but the data area has %llu bytes", label,
                          (unsigned long long)data_len);
        else
            st = ds4_fail(err, DS4_ERR_FORMAT,
                          "safetensors open %s: last tensor " NAMEFMT " ends at data offset %llu but the data area "
                          "has %llu bytes: %llu trailing bytes belong to no tensor",
                          label, tmp[ntensor - 1].e.name, (unsigned long long)pos, (unsigned long long)data_len,
                          (unsigned long long)(data_len - pos));
        goto out;
    }

    /* Copy names and metadata out of the DOM (which is freed below) into the arena. */
    char *ap = f->arena;
    for (size_t i = 0; i < ntensor; i++) {
        size_t kl = strlen(tmp[i].e.name) + 1;
        memcpy(ap, tmp[i].e.name, kl);
        f->entries[i] = tmp[i].e;
        f->entries[i].name = ap;
        f->entries[i].data = data + tmp[i].begin;
        f->by_name[i] = &f->entries[i];
        ap += kl;
    }
    if (meta) {
        for (size_t j = 0; j < meta->count; j++) {
            size_t kl = strlen(meta->keys[j]) + 1, vl = meta->items[j].str_len + 1;
            memcpy(ap, meta->keys[j], kl);
            f->meta[2 * j] = ap;
            ap += kl;
            memcpy(ap, meta->items[j].str, vl);
            f->meta[2 * j + 1] = ap;
            ap += vl;
        }
        f->n_meta = meta->count;
    }
    f->n = ntensor;
    qsort(f->by_name, ntensor, sizeof *f->by_name, cmp_entry_ptr_name);
    /* The JSON parser rejects duplicate keys; this keeps find() well-defined even if it ever did not. */
    for (size_t i = 1; i < ntensor; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0) {
            st = ds4_fail(err, DS4_ERR_FORMAT, "safetensors open %s: tensor " NAMEFMT " is listed twice", label,
                          f->by_name[i]->name);
            goto out;
        }
    st = DS4_OK;
out:
    free(tmp);
    ds4_json_free(root);
    return st;
}

static void st_free(ds4_st_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->map_len);
    free(f->entries);
    free(f->by_name);
    free(f->arena);
    free(f->meta);
    free(f);
}

ds4_status ds4_st_open_memory(const void *buf, size_t len, ds4_st_file **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "safetensors open <memory>: out is NULL");
    *out = NULL;
    if (!buf && len) return ds4_fail(err, DS4_ERR_ARG, "safetensors open <memory>: buffer is NULL");
    ds4_st_file *f = calloc(1, sizeof *f);
    if (!f) return ds4_fail(err, DS4_ERR_OOM, "safetensors open <memory>: cannot allocate handle");
    ds4_status st = st_parse("<memory>", buf ? buf : (const void *)"", len, f, err);
    if (st) {
        st_free(f);
        return st;
    }
    *out = f;
    return DS4_OK;
}

ds4_status ds4_st_open(const char *path, ds4_st_file **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "safetensors open: out is NULL");
    *out = NULL;
    if (!path) return ds4_fail(err, DS4_ERR_ARG, "safetensors open: path is NULL");
    int fd;
    int64_t size = 0;
    ds4_status ost = ds4_open_regular(path, 0, DS4_ERR_IO, &fd, &size, err); /* a FIFO would block a plain open(2) */
    if (ost) {
        ds4_error_prefix(err, "safetensors ");
        return ost;
    }
    if (size < 0 || (uint64_t)size > (uint64_t)SIZE_MAX) {
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "safetensors open %s: size %lld not addressable", path, (long long)size);
    }
    size_t len = (size_t)size;
    ds4_st_file *f = calloc(1, sizeof *f);
    if (!f) {
        close(fd);
        return ds4_fail(err, DS4_ERR_OOM, "safetensors open %s: cannot allocate handle", path);
    }
    const unsigned char *buf = (const unsigned char *)"";
    if (len > 0) { /* mmap of length 0 fails; an empty file is reported by the parser as too short */
        void *m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            free(f);
            return ds4_fail(err, DS4_ERR_IO, "safetensors open %s: mmap %zu bytes: %s", path, len, strerror(e));
        }
        f->map = m;
        f->map_len = len;
        buf = m;
    }
    close(fd); /* the mapping keeps the file referenced */
    ds4_status st = st_parse(path, buf, len, f, err);
    if (st) {
        st_free(f);
        return st;
    }
    *out = f;
    return DS4_OK;
}

void ds4_st_close(ds4_st_file *f) { st_free(f); }

size_t ds4_st_count(const ds4_st_file *f) { return f ? f->n : 0; }

const ds4_st_entry *ds4_st_entry_at(const ds4_st_file *f, size_t i) {
    return f && i < f->n ? &f->entries[i] : NULL;
}

const ds4_st_entry *ds4_st_find(const ds4_st_file *f, const char *name) {
    return f ? find_sorted(f->by_name, f->n, name) : NULL;
}

const char *ds4_st_metadata(const ds4_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ writer */

typedef struct {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    size_t need;
    if (!ds4_add_size(b->len, n, &need) || !ds4_add_size(need, 1, &need)) {
        b->oom = 1;
        return;
    }
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) {
            if (cap > (size_t)-1 / 2) {
                cap = need;
                break;
            }
            cap *= 2;
        }
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_putu(sbuf *b, unsigned long long v) {
    char t[32];
    int w = snprintf(t, sizeof t, "%llu", v);
    sb_put(b, t, (size_t)w);
}
/* JSON string literal; the caller has checked s is valid UTF-8, so only '"', '\\' and controls need escapes. */
static void sb_json_str(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"') sb_put(b, "\\\"", 2);
        else if (*p == '\\') sb_put(b, "\\\\", 2);
        else if (*p < 0x20) {
            char t[8];
            snprintf(t, sizeof t, "\\u%04x", (unsigned)*p);
            sb_put(b, t, 6);
        } else sb_put(b, (const char *)p, 1);
    }
    sb_put(b, "\"", 1);
}

/* Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF): what the reader's JSON parser accepts. */
static int utf8_valid(const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int n;
        unsigned cp, min;
        if ((c & 0xE0) == 0xC0) n = 1, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0) n = 2, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0) n = 3, cp = c & 0x07, min = 0x10000;
        else return 0;
        for (int i = 1; i <= n; i++) {
            if ((s[i] & 0xC0) != 0x80) return 0; /* also stops at the terminating NUL */
            cp = (cp << 6) | (s[i] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        s += n + 1;
    }
    return 1;
}

static int write_all(int fd, const void *p, size_t n) {
    const unsigned char *c = p;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n; /* Linux caps one write near 2 GiB */
        ssize_t w = write(fd, c, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

typedef struct {
    const char *name;
    size_t idx;
} name_idx;

static int cmp_name_idx(const void *a, const void *b) {
    const name_idx *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

ds4_status ds4_st_write(const char *path, size_t n, const char *const *names, const ds4_tensor *const *tensors,
                        ds4_error *err) {
    if (!path) return ds4_fail(err, DS4_ERR_ARG, "safetensors write: path is NULL");
    if (n > 0 && (!names || !tensors))
        return ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: %zu tensors but names or tensors is NULL", path, n);
    name_idx *order = NULL;
    sbuf hb = {0};
    char *tmp_path = NULL;
    int fd = -1;
    ds4_status st = DS4_OK;
    char sb[200];

    /* Validate every argument before touching the file system. */
    for (size_t i = 0; i < n; i++) {
        const char *nm = names[i];
        const ds4_tensor *t = tensors[i];
        if (!nm) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: name %zu is NULL", path, i);
            goto out;
        }
        if (!t) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: tensor " NAMEFMT " is NULL", path, nm);
            goto out;
        }
        if (strcmp(nm, "__metadata__") == 0 || !utf8_valid(nm)) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: tensor name " NAMEFMT " is %s", path, nm,
                          utf8_valid(nm) ? "reserved" : "not valid UTF-8");
            goto out;
        }
        if ((unsigned)t->dtype >= (unsigned)DS4_DTYPE_COUNT || t->ndim < 0 || t->ndim > DS4_MAX_DIMS) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: tensor " NAMEFMT ": invalid dtype %d or ndim %d",
                          path, nm, (int)t->dtype, (int)t->ndim);
            goto out;
        }
        int64_t numel = ds4_tensor_numel(t);
        size_t need;
        ds4_shape_str(sb, sizeof sb, t->ndim, t->shape);
        if (numel < 0 || (uint64_t)numel > SIZE_MAX || !ds4_mul_size((size_t)numel, ds4_dtype_size(t->dtype), &need)) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: tensor " NAMEFMT ": invalid shape %s", path, nm, sb);
            goto out;
        }
        if (need != t->nbytes || (need > 0 && !t->data)) {
            st = ds4_fail(err, DS4_ERR_ARG,
                          "safetensors write %s: tensor " NAMEFMT
                          ": shape %s %s needs %zu bytes but the tensor has %zu%s",
                          path, nm, sb, ds4_dtype_name(t->dtype), need, t->nbytes, t->data ? "" : " (data is NULL)");
            goto out;
        }
    }
    order = malloc((n ? n : 1) * sizeof *order);
    if (!order) {
        st = ds4_fail(err, DS4_ERR_OOM, "safetensors write %s: cannot allocate name index for %zu tensors", path, n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) order[i] = (name_idx){names[i], i};
    qsort(order, n, sizeof *order, cmp_name_idx);
    for (size_t i = 1; i < n; i++)
        if (strcmp(order[i - 1].name, order[i].name) == 0) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: tensor name " NAMEFMT " given twice (#%zu and #%zu)",
                          path, order[i].name, order[i - 1].idx, order[i].idx);
            goto out;
        }

    /* Header, tensors in the given order, contiguous. */
    sb_puts(&hb, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const ds4_tensor *t = tensors[i];
        size_t end;
        if (!ds4_add_size(off, t->nbytes, &end)) {
            st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: total data size overflows at tensor " NAMEFMT, path,
                          names[i]);
            goto out;
        }
        sb_put(&hb, ",", 1);
        sb_json_str(&hb, names[i]);
        sb_puts(&hb, ":{\"dtype\":\"");
        sb_puts(&hb, ds4_dtype_name(t->dtype));
        sb_puts(&hb, "\",\"shape\":[");
        for (int32_t d = 0; d < t->ndim; d++) {
            if (d) sb_put(&hb, ",", 1);
            sb_putu(&hb, (unsigned long long)t->shape[d]);
        }
        sb_puts(&hb, "],\"data_offsets\":[");
        sb_putu(&hb, (unsigned long long)off);
        sb_put(&hb, ",", 1);
        sb_putu(&hb, (unsigned long long)end);
        sb_puts(&hb, "]}");
        off = end;
    }
    sb_put(&hb, "}", 1);
    /* Pad with spaces (valid JSON whitespace) so the data area starts 8-byte aligned, as the Rust crate does:
     * readers can then use the mmap'd F32/I64 data in place. */
    while (!hb.oom && (8 + hb.len) % 8 != 0) sb_put(&hb, " ", 1);
    if (hb.oom) {
        st = ds4_fail(err, DS4_ERR_OOM, "safetensors write %s: cannot allocate the header for %zu tensors", path, n);
        goto out;
    }
    if ((uint64_t)hb.len > ST_MAX_HEADER) {
        st = ds4_fail(err, DS4_ERR_ARG, "safetensors write %s: header of %zu bytes exceeds the %llu-byte limit readers"
                      " accept", path, hb.len, (unsigned long long)ST_MAX_HEADER);
        goto out;
    }

    /* Write to "<path>.tmp.<pid>", fsync, then rename: a crash leaves either the old file or the new one. */
    {
        size_t pl = strlen(path) + 32;
        tmp_path = malloc(pl);
        if (!tmp_path) {
            st = ds4_fail(err, DS4_ERR_OOM, "safetensors write %s: cannot allocate temporary path", path);
            goto out;
        }
        snprintf(tmp_path, pl, "%s.tmp.%ld", path, (long)getpid());
    }
    fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = errno;
        free(tmp_path);
        tmp_path = NULL; /* nothing created: nothing to unlink */
        st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: create temporary file: %s", path, strerror(e));
        goto out;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hb.len >> (8 * i));
    if (write_all(fd, len8, 8) || write_all(fd, hb.p, hb.len)) {
        st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: write header (%zu bytes): %s", path, hb.len + 8,
                      strerror(errno));
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (tensors[i]->nbytes && write_all(fd, tensors[i]->data, tensors[i]->nbytes)) {
            st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: write tensor " NAMEFMT " (%zu bytes): %s", path,
                          names[i], tensors[i]->nbytes, strerror(errno));
            goto out;
        }
    }
    if (fsync(fd) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: fsync: %s", path, strerror(errno));
        goto out;
    }
    {
        int rc = close(fd);
        fd = -1;
        if (rc != 0) {
            st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: close: %s", path, strerror(errno));
            goto out;
        }
    }
    if (rename(tmp_path, path) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "safetensors write %s: rename from %s: %s", path, tmp_path, strerror(errno));
        goto out;
    }
    free(tmp_path);
    tmp_path = NULL;
    /* Make the rename itself durable. Best effort: some file systems refuse fsync on a directory, and the data
     * is already safe, so a failure here is not reported. */
    {
        const char *slash = strrchr(path, '/');
        char *dir = NULL;
        if (!slash) dir = strdup(".");
        else if (slash == path) dir = strdup("/");
        else if ((dir = malloc((size_t)(slash - path) + 1)) != NULL) {
            memcpy(dir, path, (size_t)(slash - path));
            dir[slash - path] = 0;
        }
        if (dir) {
            int dfd = open(dir, O_RDONLY | O_CLOEXEC);
            if (dfd >= 0) {
                (void)fsync(dfd);
                close(dfd);
            }
            free(dir);
        }
    }
out:
    if (fd >= 0) close(fd);
    if (tmp_path) {
        unlink(tmp_path);
        free(tmp_path);
    }
    free(order);
    free(hb.p);
    return st;
}

/* ------------------------------------------------------------------------------------------------ checkpoints */

static void ckpt_free(ds4_checkpoint *c) {
    if (!c) return;
    for (size_t i = 0; i < c->nfiles; i++) st_free(c->files[i]);
    free(c->files);
    free(c->sorted);
    free(c);
}

void ds4_checkpoint_close(ds4_checkpoint *c) { ckpt_free(c); }

size_t ds4_checkpoint_count(const ds4_checkpoint *c) { return c ? c->n : 0; }

/* Entries are exposed sorted by name (bytewise strcmp), whatever the layout: deterministic for sharded and
 * single-file checkpoints alike, and the same array serves binary search. */
const ds4_st_entry *ds4_checkpoint_entry_at(const ds4_checkpoint *c, size_t i) {
    return c && i < c->n ? c->sorted[i] : NULL;
}

const ds4_st_entry *ds4_checkpoint_find(const ds4_checkpoint *c, const char *name) {
    return c ? find_sorted(c->sorted, c->n, name) : NULL;
}

typedef struct {
    const ds4_st_entry *e;
    size_t file;
} ck_ent;

static int cmp_ck_ent(const void *a, const void *b) {
    const ck_ent *x = a, *y = b;
    int c = strcmp(x->e->name, y->e->name);
    if (c) return c;
    return x->file < y->file ? -1 : x->file > y->file;
}

/* Build c->sorted as the union of c->files, rejecting a name present in two files. */
static ds4_status ckpt_build_union(const char *label, ds4_checkpoint *c, const char *const *file_names,
                                   ds4_error *err) {
    size_t total = 0;
    for (size_t i = 0; i < c->nfiles; i++) total += c->files[i]->n; /* bounded by mapped memory: no overflow */
    ck_ent *all = malloc((total ? total : 1) * sizeof *all);
    c->sorted = malloc((total ? total : 1) * sizeof *c->sorted);
    if (!all || !c->sorted) {
        free(all);
        return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate the index of %zu tensors", label, total);
    }
    size_t k = 0;
    for (size_t i = 0; i < c->nfiles; i++)
        for (size_t j = 0; j < c->files[i]->n; j++) all[k++] = (ck_ent){&c->files[i]->entries[j], i};
    qsort(all, total, sizeof *all, cmp_ck_ent);
    for (size_t i = 0; i < total; i++) {
        if (i > 0 && strcmp(all[i - 1].e->name, all[i].e->name) == 0) {
            ds4_status st = ds4_fail(err, DS4_ERR_FORMAT,
                                     "checkpoint open %s: tensor " NAMEFMT " is present in both shard %s and shard %s",
                                     label, all[i].e->name, file_names[all[i - 1].file], file_names[all[i].file]);
            free(all);
            return st;
        }
        c->sorted[i] = all[i].e;
    }
    c->n = total;
    free(all);
    return DS4_OK;
}

static ds4_status ckpt_single(const char *file, ds4_checkpoint **out, ds4_error *err) {
    ds4_checkpoint *c = calloc(1, sizeof *c);
    if (!c) return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate handle", file);
    c->files = calloc(1, sizeof *c->files);
    if (!c->files) {
        free(c);
        return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate handle", file);
    }
    ds4_status st = ds4_st_open(file, &c->files[0], err);
    if (st) {
        ds4_error_prefix(err, "checkpoint open: ");
        ckpt_free(c);
        return st;
    }
    c->nfiles = 1;
    const char *fn[1] = {file};
    st = ckpt_build_union(file, c, fn, err);
    if (st) {
        ckpt_free(c);
        return st;
    }
    *out = c;
    return DS4_OK;
}

/* Shard names come from an untrusted index: plain file names only, so the index cannot reach outside the
 * checkpoint directory. */
static int shard_name_ok(const char *s) {
    static const char ext[] = ".safetensors";
    size_t n = strlen(s), e = sizeof ext - 1;
    return n > e && !strchr(s, '/') && !strstr(s, "..") && strcmp(s + n - e, ext) == 0;
}

typedef struct {
    const char *tensor, *shard;
    size_t file; /* index into the distinct shard list */
} wm_ent;

static int cmp_wm_shard(const void *a, const void *b) {
    const wm_ent *x = a, *y = b;
    int c = strcmp(x->shard, y->shard);
    return c ? c : strcmp(x->tensor, y->tensor);
}

static ds4_status ckpt_index(const char *dir, const char *index_path, ds4_checkpoint **out, ds4_error *err) {
    char *text = NULL;
    size_t len = 0;
    ds4_status st = ds4_read_file(index_path, ST_MAX_INDEX, &text, &len, err);
    if (st) {
        ds4_error_prefix(err, "checkpoint open %s: ", dir);
        return st;
    }
    ds4_json_limits lim = {64, len + 16};
    ds4_json *root = parse_json("checkpoint open", index_path, text, len, &lim, &st, err);
    free(text);
    if (!root) return st;

    ds4_checkpoint *c = NULL;
    wm_ent *wm = NULL;
    const char **shard_names = NULL;
    const ds4_json *map = ds4_json_get(root, "weight_map");
    if (root->type != DS4_JSON_OBJECT || !map || map->type != DS4_JSON_OBJECT) {
        st = ds4_fail(err, DS4_ERR_FORMAT, "checkpoint open %s: %s has no \"weight_map\" object", dir, index_path);
        goto out;
    }
    size_t nw = map->count;
    wm = malloc((nw ? nw : 1) * sizeof *wm);
    shard_names = malloc((nw ? nw : 1) * sizeof *shard_names);
    c = calloc(1, sizeof *c);
    if (!wm || !shard_names || !c) {
        st = ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate the weight map of %zu tensors", dir, nw);
        goto out;
    }
    for (size_t i = 0; i < nw; i++) {
        const ds4_json *v = &map->items[i];
        if (v->type != DS4_JSON_STRING) {
            st = ds4_fail(err, DS4_ERR_FORMAT, "checkpoint open %s: weight_map entry for tensor " NAMEFMT
                          " is not a string", dir, map->keys[i]);
            goto out;
        }
        if (!shard_name_ok(v->str)) {
            st = ds4_fail(err, DS4_ERR_FORMAT,
                          "checkpoint open %s: weight_map maps tensor " NAMEFMT " to shard " NAMEFMT
                          ", which is not a plain *.safetensors file name (no '/', no '..')",
                          dir, map->keys[i], v->str);
            goto out;
        }
        wm[i] = (wm_ent){map->keys[i], v->str, 0};
    }
    /* Distinct shards, each opened once, in name order. */
    qsort(wm, nw, sizeof *wm, cmp_wm_shard);
    size_t ns = 0;
    for (size_t i = 0; i < nw; i++) {
        if (i > 0 && strcmp(wm[i - 1].tensor, wm[i].tensor) == 0 && strcmp(wm[i - 1].shard, wm[i].shard) == 0) {
            /* unreachable with a parser that rejects duplicate keys; kept as a cheap guard */
            st = ds4_fail(err, DS4_ERR_FORMAT, "checkpoint open %s: tensor " NAMEFMT " is listed twice in %s", dir,
                          wm[i].tensor, index_path);
            goto out;
        }
        if (ns == 0 || strcmp(shard_names[ns - 1], wm[i].shard) != 0) shard_names[ns++] = wm[i].shard;
        wm[i].file = ns - 1;
    }
    c->files = calloc(ns ? ns : 1, sizeof *c->files);
    if (!c->files) {
        st = ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate %zu shard handles", dir, ns);
        goto out;
    }
    for (size_t s = 0, i = 0; s < ns; s++) {
        char *p = path_join(dir, shard_names[s]);
        if (!p) {
            st = ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate a shard path", dir);
            goto out;
        }
        st = ds4_st_open(p, &c->files[s], err);
        free(p);
        while (i < nw && wm[i].file < s) i++; /* first tensor listed for this shard, for the message */
        if (st) {
            /* the shard's own message carries the full path; the prefix (capped at 256 bytes by
             * ds4_error_prefix) says why that shard was opened */
            ds4_error_prefix(err, "checkpoint open: index lists tensor '%.80s' in shard %.120s: ", wm[i].tensor,
                             shard_names[s]);
            goto out;
        }
        c->nfiles = s + 1;
    }
    /* Every listed tensor must be in the shard the index names. */
    for (size_t i = 0; i < nw; i++) {
        if (!ds4_st_find(c->files[wm[i].file], wm[i].tensor)) {
            st = ds4_fail(err, DS4_ERR_FORMAT,
                          "checkpoint open %s: %s maps tensor " NAMEFMT " to shard %.200s, which does not contain it",
                          dir, index_path, wm[i].tensor, wm[i].shard);
            goto out;
        }
    }
    /* The union of the opened shards (as transformers loads every tensor of every listed shard); a tensor in
     * two shards would make the result depend on load order, so it is an error. */
    st = ckpt_build_union(dir, c, shard_names, err);
out:
    if (st) ckpt_free(c);
    else *out = c;
    free(wm);
    free(shard_names);
    ds4_json_free(root);
    return st;
}

static int is_regular(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static int has_st_suffix(const char *s) {
    size_t n = strlen(s);
    return n > 12 && strcmp(s + n - 12, ".safetensors") == 0;
}

ds4_status ds4_checkpoint_open(const char *path, ds4_checkpoint **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "checkpoint open: out is NULL");
    *out = NULL;
    if (!path) return ds4_fail(err, DS4_ERR_ARG, "checkpoint open: path is NULL");
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        return ds4_fail(err, e == ENOENT || e == ENOTDIR ? DS4_ERR_NOT_FOUND : DS4_ERR_IO, "checkpoint open %s: %s",
                        path, strerror(e));
    }
    if (S_ISREG(sb.st_mode)) return ckpt_single(path, out, err);
    if (!S_ISDIR(sb.st_mode))
        return ds4_fail(err, DS4_ERR_ARG, "checkpoint open %s: neither a regular file nor a directory", path);

    /* transformers' order: model.safetensors first, then the sharded index */
    ds4_status st;
    char *p = path_join(path, "model.safetensors");
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate a path", path);
    if (stat(p, &sb) == 0) {
        st = ckpt_single(p, out, err);
        free(p);
        return st;
    }
    free(p);
    p = path_join(path, "model.safetensors.index.json");
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate a path", path);
    if (stat(p, &sb) == 0) { /* present (even if unreadable: then reading it reports why) */
        st = ckpt_index(path, p, out, err);
        free(p);
        return st;
    }
    free(p);

    /* Last resort: exactly one *.safetensors file. */
    DIR *d = opendir(path);
    if (!d) return ds4_fail(err, DS4_ERR_IO, "checkpoint open %s: opendir: %s", path, strerror(errno));
    size_t found = 0;
    char *only = NULL;
    char listed[400] = "";
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!has_st_suffix(de->d_name)) continue;
        char *q = path_join(path, de->d_name);
        if (!q) {
            closedir(d);
            free(only);
            return ds4_fail(err, DS4_ERR_OOM, "checkpoint open %s: cannot allocate a path", path);
        }
        if (!is_regular(q)) {
            free(q);
            continue;
        }
        found++;
        size_t ll = strlen(listed);
        if (ll + 2 < sizeof listed)
            snprintf(listed + ll, sizeof listed - ll, "%s%s", ll ? ", " : "", de->d_name);
        if (found == 1) only = q;
        else free(q);
    }
    closedir(d);
    if (found == 1) {
        st = ckpt_single(only, out, err);
        free(only);
        return st;
    }
    free(only);
    if (found == 0)
        return ds4_fail(err, DS4_ERR_NOT_FOUND,
                        "checkpoint open %s: found neither model.safetensors, model.safetensors.index.json nor any "
                        "other *.safetensors file",
                        path);
    return ds4_fail(err, DS4_ERR_NOT_FOUND,
                    "checkpoint open %s: no model.safetensors or model.safetensors.index.json, and %zu *.safetensors "
                    "files (%s) are ambiguous",
                    path, found, listed);
}
