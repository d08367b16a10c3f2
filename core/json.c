/* json.c — strict RFC 8259 parser into the ds4_json DOM (see json.h).
 *
 * Design notes
 *   - One document = one malloc'd header (the root value) plus an arena of chunks holding every string,
 *     item array and key array, so ds4_json_free is a walk over a few chunks, not over 10^6 nodes.
 *   - Children of an open array/object are collected on a scratch stack shared by the whole parse and
 *     copied into an exactly-sized arena array when the container closes: total work stays linear and no
 *     per-container realloc chains are left behind.
 *   - Recursion depth is bounded by the caller's max_depth, itself capped at JSON_HARD_DEPTH so that a
 *     careless limit cannot blow the C stack of a worker thread.
 *   - Large objects (a safetensors header is one object with ~10^5 keys) get a hash index, stored in the
 *     arena just before their `keys` array: it finds duplicate keys in linear time and makes ds4_json_get
 *     O(1), so callers can look names up without going quadratic. If crafted keys flood the table, the
 *     index is switched off and duplicates are found by sorting (O(n log n) whatever the input). Small
 *     objects are checked pairwise and searched linearly.
 *   - Consequently ds4_json_get and ds4_json_free only accept values that came out of ds4_json_parse.
 */
#include <errno.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "json.h"

#define JSON_DEFAULT_DEPTH 64
#define JSON_DEFAULT_ITEMS ((size_t)1 << 22)
#define JSON_HARD_DEPTH 1024
#define JSON_CHUNK_MIN ((size_t)64 << 10)
#define JSON_CHUNK_MAX ((size_t)4 << 20)
#define JSON_SMALL_OBJECT 16
#define JSON_INDEX_MAGIC 0x445334494e444558ull

/* Header between an indexed object's hash slots and its keys array: [slots][json_index][keys]. */
typedef struct json_index {
    uint64_t magic;   /* JSON_INDEX_MAGIC while the index is usable, 0 if it was abandoned */
    uint32_t mask;    /* slot count - 1 (a power of two minus one) */
    uint32_t seed;
} json_index;

/* ------------------------------------------------------------------------------------------------ arena */

typedef struct json_chunk {
    struct json_chunk *next;
    size_t cap;
    size_t used;
} json_chunk;

/* Chunk payload starts after the header, rounded so that every allocation is 16-aligned. */
#define JSON_CHUNK_HDR ((sizeof(json_chunk) + 15u) & ~(size_t)15u)

typedef struct json_arena {
    json_chunk *head;      /* current bump chunk first; dedicated large chunks are linked after it */
    size_t next_cap;
} json_arena;

static void *arena_alloc(json_arena *a, size_t n) {
    size_t need;
    if (!ds4_add_size(n, 15u, &need)) return NULL;
    need &= ~(size_t)15u;
    if (need == 0) need = 16;
    json_chunk *h = a->head;
    if (h && h->cap - h->used >= need) {
        void *p = (unsigned char *)h + JSON_CHUNK_HDR + h->used;
        h->used += need;
        return p;
    }
    size_t cap = a->next_cap < JSON_CHUNK_MIN ? JSON_CHUNK_MIN : a->next_cap;
    int dedicated = need > cap / 4;   /* big arrays get their own chunk: the bump chunk keeps its slack */
    if (dedicated) cap = need;
    size_t total;
    if (!ds4_add_size(cap, JSON_CHUNK_HDR, &total)) return NULL;
    json_chunk *c = malloc(total);
    if (!c) return NULL;
    c->cap = cap;
    c->used = need;
    if (dedicated && h) {
        c->next = h->next;
        h->next = c;
    } else {
        c->next = h;
        a->head = c;
        if (!dedicated && a->next_cap < JSON_CHUNK_MAX) a->next_cap = cap * 2;
    }
    return (unsigned char *)c + JSON_CHUNK_HDR;
}

static void arena_free(json_chunk *c) {
    while (c) {
        json_chunk *n = c->next;
        free(c);
        c = n;
    }
}

/* The root lives at offset 0 so that ds4_json_free can recover the document from the root pointer. */
typedef struct json_doc {
    ds4_json root;
    json_chunk *chunks;
} json_doc;

/* ------------------------------------------------------------------------------------------------ parser */

typedef struct json_key {
    const char *k;
    size_t len;
    size_t off;   /* byte offset of the key's opening quote, for duplicate-key messages */
} json_key;

typedef struct json_parser {
    const unsigned char *s;
    size_t len;
    size_t pos;
    int32_t max_depth;
    size_t max_items;
    size_t n_items;
    json_arena arena;
    ds4_json *vals;       /* scratch stack of children of the open containers */
    size_t nvals, capvals;
    json_key *keys;       /* scratch stack of keys of the open objects */
    size_t nkeys, capkeys;
    json_key *sortbuf;
    size_t capsort;
    char *numbuf;
    size_t capnum;
    ds4_error *err;
} json_parser;

static int fail_at(json_parser *p, size_t off, const char *fmt, ...) DS4_PRINTF(3, 4);
static int fail_at(json_parser *p, size_t off, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    ds4_fail(p->err, DS4_ERR_FORMAT, "json: %s at byte offset %zu", what, off);
    return -1;
}

static int fail_oom(json_parser *p, size_t bytes) {
    ds4_fail(p->err, DS4_ERR_OOM, "json: out of memory (allocating %zu bytes) at byte offset %zu", bytes, p->pos);
    return -1;
}

/* Grow a scratch array to hold at least `need` elements of `elem` bytes. */
static int grow(json_parser *p, void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap : 64;
    while (ncap < need) {
        if (ncap > ((size_t)-1) / 2) return fail_oom(p, (size_t)-1);
        ncap *= 2;
    }
    size_t bytes;
    if (!ds4_mul_size(ncap, elem, &bytes)) return fail_oom(p, (size_t)-1);
    void *nb = realloc(*buf, bytes);
    if (!nb) return fail_oom(p, bytes);
    *buf = nb;
    *cap = ncap;
    return 0;
}

static void skip_ws(json_parser *p) {
    const unsigned char *s = p->s;
    size_t i = p->pos, n = p->len;
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++;
    p->pos = i;
}

static void describe_byte(unsigned char c, char *buf, size_t n) {
    if (c >= 0x20 && c < 0x7f)
        snprintf(buf, n, "'%c'", c);
    else
        snprintf(buf, n, "byte 0x%02X", c);
}

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int read_hex4(json_parser *p, size_t i, uint32_t *out) {
    uint32_t v = 0;
    for (size_t k = 0; k < 4; k++) {
        int h = hexval(p->s[i + k]);
        if (h < 0) {
            char d[32];
            describe_byte(p->s[i + k], d, sizeof d);
            return fail_at(p, i + k, "invalid hex digit %s in \\u escape", d);
        }
        v = v * 16 + (uint32_t)h;
    }
    *out = v;
    return 0;
}

static size_t put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the well-formed UTF-8 sequence starting at s[i] (lead byte >= 0x80) inside [i, end), or 0.
 * Rejects overlong forms, encoded surrogates and code points above U+10FFFF (RFC 3629 table 3-7). */
static size_t utf8_seq(const unsigned char *s, size_t i, size_t end) {
    unsigned char c = s[i];
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c == 0xE0) { n = 3; lo = 0xA0; }
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) n = 3;
    else if (c == 0xED) { n = 3; hi = 0x9F; }
    else if (c == 0xF0) { n = 4; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) n = 4;
    else if (c == 0xF4) { n = 4; hi = 0x8F; }
    else return 0;
    if (end - i < n) return 0;
    if (s[i + 1] < lo || s[i + 1] > hi) return 0;
    for (size_t k = 2; k < n; k++)
        if (s[i + k] < 0x80 || s[i + k] > 0xBF) return 0;
    return n;
}

/* p->pos is at the opening quote. Decodes into the arena; on return p->pos is past the closing quote. */
static int parse_string(json_parser *p, char **out, size_t *out_len) {
    const unsigned char *s = p->s;
    size_t open = p->pos, start = open + 1, j = start, n = p->len;
    /* Pass 1: find the closing quote so that the decoded string (never longer than the raw span) can be
     * allocated once. */
    while (j < n) {
        unsigned char c = s[j];
        if (c == '"') break;
        j += (c == '\\') ? 2 : 1;
    }
    if (j >= n) return fail_at(p, open, "unterminated string");
    size_t raw = j - start, cap;
    if (!ds4_add_size(raw, 1, &cap)) return fail_oom(p, (size_t)-1);
    char *o = arena_alloc(&p->arena, cap);
    if (!o) return fail_oom(p, cap);
    size_t w = 0, i = start;
    while (i < j) {
        unsigned char c = s[i];
        if (c >= 0x20 && c < 0x80 && c != '\\') {
            o[w++] = (char)c;
            i++;
            continue;
        }
        if (c < 0x20) return fail_at(p, i, "unescaped control character U+%04X in string", (unsigned)c);
        if (c >= 0x80) {
            size_t k = utf8_seq(s, i, j);
            if (!k) return fail_at(p, i, "invalid UTF-8 byte 0x%02X in string", (unsigned)c);
            memcpy(o + w, s + i, k);
            w += k;
            i += k;
            continue;
        }
        /* Backslash: pass 1 guarantees s[i + 1] lies inside the string. */
        unsigned char e = s[i + 1];
        switch (e) {
        case '"': o[w++] = '"'; i += 2; continue;
        case '\\': o[w++] = '\\'; i += 2; continue;
        case '/': o[w++] = '/'; i += 2; continue;
        case 'b': o[w++] = '\b'; i += 2; continue;
        case 'f': o[w++] = '\f'; i += 2; continue;
        case 'n': o[w++] = '\n'; i += 2; continue;
        case 'r': o[w++] = '\r'; i += 2; continue;
        case 't': o[w++] = '\t'; i += 2; continue;
        case 'u': break;
        default: {
            char d[32];
            describe_byte(e, d, sizeof d);
            return fail_at(p, i, "invalid escape \\ followed by %s", d);
        }
        }
        if (j - i < 6) return fail_at(p, i, "truncated \\u escape");
        uint32_t cp;
        if (read_hex4(p, i + 2, &cp)) return -1;
        /* Strings are handed out NUL-terminated: an embedded NUL would silently truncate them. */
        if (cp == 0) return fail_at(p, i, "\\u0000 is not allowed in strings");
        if (cp >= 0xDC00 && cp <= 0xDFFF) return fail_at(p, i, "unpaired low surrogate \\u%04X", (unsigned)cp);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (j - i < 12 || s[i + 6] != '\\' || s[i + 7] != 'u')
                return fail_at(p, i, "unpaired high surrogate \\u%04X", (unsigned)cp);
            uint32_t lo;
            if (read_hex4(p, i + 8, &lo)) return -1;
            if (lo < 0xDC00 || lo > 0xDFFF)
                return fail_at(p, i, "high surrogate \\u%04X followed by \\u%04X, not a low surrogate", (unsigned)cp,
                               (unsigned)lo);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 12;
        } else {
            i += 6;
        }
        /* An escape takes >= 6 raw bytes and yields <= 4, so the output never overtakes the input. */
        w += put_utf8(o + w, cp);
    }
    o[w] = 0;
    *out = o;
    *out_len = w;
    p->pos = j + 1;
    return 0;
}

/* strtod honours LC_NUMERIC; if some host code changed the locale, retry with its decimal point. */
static int convert_double(json_parser *p, char *buf, size_t n, size_t off, double *out) {
    char *end;
    errno = 0;
    double d = strtod(buf, &end);
    if (end != buf + n) {
        const char *dp = localeconv()->decimal_point;
        size_t dpl = dp ? strlen(dp) : 0;
        char *dot = memchr(buf, '.', n);
        if (!dot || dpl == 0 || (dpl == 1 && dp[0] == '.'))
            return fail_at(p, off, "cannot convert number '%.40s'", buf);
        size_t m = n - 1 + dpl, need;
        if (!ds4_add_size(m, 1, &need)) return fail_oom(p, (size_t)-1);
        char *alt = malloc(need);
        if (!alt) return fail_oom(p, need);
        size_t pre = (size_t)(dot - buf);
        memcpy(alt, buf, pre);
        memcpy(alt + pre, dp, dpl);
        memcpy(alt + pre + dpl, dot + 1, n - pre - 1);
        alt[m] = 0;
        errno = 0;
        d = strtod(alt, &end);
        int ok = end == alt + m;
        free(alt);
        if (!ok) return fail_at(p, off, "cannot convert number '%.40s'", buf);
    }
    /* RFC 8259 lets implementations bound the range; a value that only exists as infinity is useless to
     * every consumer here and would poison later arithmetic. Underflow to 0 or a subnormal is kept. */
    if (isinf(d)) return fail_at(p, off, "number '%.40s' overflows a double", buf);
    *out = d;
    return 0;
}

static int parse_number(json_parser *p, ds4_json *v) {
    const unsigned char *s = p->s;
    size_t n = p->len, start = p->pos, i = start;
    int neg = 0, integral = 1;
    if (s[i] == '-') {
        neg = 1;
        i++;
    }
    if (i >= n || s[i] < '0' || s[i] > '9') return fail_at(p, start, "invalid number (expected a digit after '-')");
    if (s[i] == '0') {
        i++;
        if (i < n && s[i] >= '0' && s[i] <= '9') return fail_at(p, start, "leading zero in number");
    } else {
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    size_t int_end = i;
    if (i < n && s[i] == '.') {
        integral = 0;
        i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return fail_at(p, i, "invalid number (expected a digit after '.')");
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        integral = 0;
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || s[i] < '0' || s[i] > '9') return fail_at(p, i, "invalid number (expected an exponent digit)");
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
    }
    p->pos = i;
    v->type = DS4_JSON_NUMBER;
    if (integral) {
        /* Exact int64 when it fits; then the double is the correctly rounded conversion of that integer,
         * which is what strtod would return, without the copy. */
        uint64_t mag = 0, lim = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
        int fits = 1;
        for (size_t k = start + (size_t)neg; k < int_end; k++) {
            uint64_t dgt = (uint64_t)(s[k] - '0');
            if (mag > (lim - dgt) / 10) {
                fits = 0;
                break;
            }
            mag = mag * 10 + dgt;
        }
        if (fits) {
            v->is_int = 1;
            if (neg) {
                v->integer = mag == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)mag;
                v->number = mag == 0 ? -0.0 : (double)v->integer;
            } else {
                v->integer = (int64_t)mag;
                v->number = (double)v->integer;
            }
            return 0;
        }
    }
    size_t len = i - start, need;
    if (!ds4_add_size(len, 1, &need)) return fail_oom(p, (size_t)-1);
    if (grow(p, (void **)&p->numbuf, &p->capnum, need, 1)) return -1;
    memcpy(p->numbuf, s + start, len);
    p->numbuf[len] = 0;
    return convert_double(p, p->numbuf, len, start, &v->number);
}

static int parse_literal(json_parser *p, const char *word, size_t wl) {
    if (p->len - p->pos < wl || memcmp(p->s + p->pos, word, wl) != 0)
        return fail_at(p, p->pos, "invalid literal (expected '%s')", word);
    p->pos += wl;
    return 0;
}

static int parse_value(json_parser *p, int32_t depth, ds4_json *v);

static int push_val(json_parser *p, const ds4_json *v) {
    if (grow(p, (void **)&p->vals, &p->capvals, p->nvals + 1, sizeof *p->vals)) return -1;
    p->vals[p->nvals++] = *v;
    return 0;
}

/* Move the children above `base` into an arena array owned by the container. */
static int take_children(json_parser *p, size_t base, ds4_json *v) {
    size_t count = p->nvals - base, bytes;
    v->count = count;
    v->items = NULL;
    if (count == 0) return 0;
    if (!ds4_mul_size(count, sizeof(ds4_json), &bytes)) return fail_oom(p, (size_t)-1);
    v->items = arena_alloc(&p->arena, bytes);
    if (!v->items) return fail_oom(p, bytes);
    memcpy(v->items, p->vals + base, bytes);
    p->nvals = base;
    return 0;
}

static int parse_array(json_parser *p, int32_t depth, ds4_json *v) {
    if (depth > p->max_depth) return fail_at(p, p->pos, "nesting deeper than the limit of %d", (int)p->max_depth);
    v->type = DS4_JSON_ARRAY;
    size_t base = p->nvals;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == ']') {
        p->pos++;
        return take_children(p, base, v);
    }
    for (;;) {
        ds4_json child;
        if (parse_value(p, depth, &child) || push_val(p, &child)) return -1;
        skip_ws(p);
        if (p->pos >= p->len) return fail_at(p, p->pos, "unexpected end of input inside an array");
        unsigned char c = p->s[p->pos];
        if (c == ',') {
            p->pos++;
            continue;
        }
        if (c == ']') {
            p->pos++;
            break;
        }
        char d[32];
        describe_byte(c, d, sizeof d);
        return fail_at(p, p->pos, "expected ',' or ']' in array, found %s", d);
    }
    return take_children(p, base, v);
}

static int key_cmp(const void *a, const void *b) {
    const json_key *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    int c = memcmp(x->k, y->k, x->len);
    if (c) return c;
    return x->off < y->off ? -1 : (x->off > y->off);
}

/* Bytes of s to quote in a message: at most max, cut on a UTF-8 character boundary. */
static int quote_len(const char *s, size_t len, size_t max) {
    size_t cut = len > max ? max : len;
    while (cut > 0 && cut < len && ((unsigned char)s[cut] & 0xC0) == 0x80) cut--;
    return (int)cut;
}

static int dup_key_fail(json_parser *p, const json_key *later) {
    return fail_at(p, later->off, "duplicate object key \"%.*s\"", quote_len(later->k, later->len, 200), later->k);
}

static int check_duplicates(json_parser *p, const json_key *keys, size_t n) {
    if (n < 2) return 0;
    if (n <= JSON_SMALL_OBJECT) {
        for (size_t a = 1; a < n; a++)
            for (size_t b = 0; b < a; b++)
                if (keys[a].len == keys[b].len && memcmp(keys[a].k, keys[b].k, keys[a].len) == 0)
                    return dup_key_fail(p, &keys[a]);
        return 0;
    }
    if (grow(p, (void **)&p->sortbuf, &p->capsort, n, sizeof *p->sortbuf)) return -1;
    memcpy(p->sortbuf, keys, n * sizeof *keys);
    qsort(p->sortbuf, n, sizeof *p->sortbuf, key_cmp);
    for (size_t a = 1; a < n; a++) {
        const json_key *x = &p->sortbuf[a - 1], *y = &p->sortbuf[a];
        if (x->len == y->len && memcmp(x->k, y->k, x->len) == 0) return dup_key_fail(p, y);
    }
    return 0;
}

static uint32_t key_hash(const char *k, size_t len, uint32_t seed) {
    uint32_t h = 2166136261u ^ seed;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)k[i]) * 16777619u;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    return h;
}

/* Allocate the keys array of an object with nk > JSON_SMALL_OBJECT keys behind a hash index, filling the
 * index and checking for duplicates on the way. */
static int build_index(json_parser *p, const json_key *keys, size_t nk, char ***out) {
    size_t cap = 64;
    while (cap < 2 * nk) cap *= 2;   /* nk <= max_items, so this cannot overflow */
    size_t slot_bytes, key_bytes, bytes;
    if (!ds4_mul_size(cap, sizeof(uint32_t), &slot_bytes) || !ds4_mul_size(nk, sizeof(char *), &key_bytes) ||
        !ds4_add_size(slot_bytes, sizeof(json_index), &bytes) || !ds4_add_size(bytes, key_bytes, &bytes))
        return fail_oom(p, (size_t)-1);
    unsigned char *mem = arena_alloc(&p->arena, bytes);
    if (!mem) return fail_oom(p, bytes);
    uint32_t *slots = (uint32_t *)(void *)mem;
    json_index *ix = (json_index *)(void *)(mem + slot_bytes);
    char **karr = (char **)(void *)(ix + 1);
    memset(slots, 0, slot_bytes);
    ix->magic = JSON_INDEX_MAGIC;
    ix->mask = (uint32_t)(cap - 1);
    /* The mapping address varies between runs: a file cannot be tuned to collide for every process. */
    ix->seed = (uint32_t)((uintptr_t)mem >> 4) * 2654435761u;
    size_t probes = 0, budget = 16 * nk + 4096;
    for (size_t i = 0; i < nk; i++) {
        karr[i] = (char *)keys[i].k;
        if (!ix->magic) continue;
        uint32_t h = key_hash(keys[i].k, keys[i].len, ix->seed) & ix->mask;
        while (slots[h]) {
            const json_key *o = &keys[slots[h] - 1];
            if (o->len == keys[i].len && memcmp(o->k, keys[i].k, o->len) == 0) return dup_key_fail(p, &keys[i]);
            h = (h + 1) & ix->mask;
            if (++probes > budget) break;
        }
        if (probes > budget) {
            ix->magic = 0;
            continue;
        }
        slots[h] = (uint32_t)(i + 1);
    }
    if (!ix->magic && check_duplicates(p, keys, nk)) return -1;
    *out = karr;
    return 0;
}

static int parse_object(json_parser *p, int32_t depth, ds4_json *v) {
    if (depth > p->max_depth) return fail_at(p, p->pos, "nesting deeper than the limit of %d", (int)p->max_depth);
    v->type = DS4_JSON_OBJECT;
    size_t base = p->nvals, kbase = p->nkeys;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == '}') {
        p->pos++;
        v->keys = NULL;
        return take_children(p, base, v);
    }
    for (;;) {
        skip_ws(p);
        if (p->pos >= p->len) return fail_at(p, p->pos, "unexpected end of input inside an object");
        if (p->s[p->pos] != '"') {
            char d[32];
            describe_byte(p->s[p->pos], d, sizeof d);
            return fail_at(p, p->pos, "expected a string key in object, found %s", d);
        }
        json_key k;
        k.off = p->pos;
        char *ks;
        if (parse_string(p, &ks, &k.len)) return -1;
        k.k = ks;
        if (grow(p, (void **)&p->keys, &p->capkeys, p->nkeys + 1, sizeof *p->keys)) return -1;
        p->keys[p->nkeys++] = k;
        skip_ws(p);
        if (p->pos >= p->len || p->s[p->pos] != ':')
            return fail_at(p, p->pos, "expected ':' after object key \"%.*s\"", quote_len(ks, k.len, 200), ks);
        p->pos++;
        ds4_json child;
        if (parse_value(p, depth, &child) || push_val(p, &child)) return -1;
        skip_ws(p);
        if (p->pos >= p->len) return fail_at(p, p->pos, "unexpected end of input inside an object");
        unsigned char c = p->s[p->pos];
        if (c == ',') {
            p->pos++;
            continue;
        }
        if (c == '}') {
            p->pos++;
            break;
        }
        char d[32];
        describe_byte(c, d, sizeof d);
        return fail_at(p, p->pos, "expected ',' or '}' in object, found %s", d);
    }
    size_t nk = p->nkeys - kbase, bytes;
    if (nk > JSON_SMALL_OBJECT) {
        if (build_index(p, p->keys + kbase, nk, &v->keys)) return -1;
    } else {
        if (check_duplicates(p, p->keys + kbase, nk)) return -1;
        if (!ds4_mul_size(nk, sizeof(char *), &bytes)) return fail_oom(p, (size_t)-1);
        v->keys = arena_alloc(&p->arena, bytes);
        if (!v->keys) return fail_oom(p, bytes);
        for (size_t i = 0; i < nk; i++) v->keys[i] = (char *)p->keys[kbase + i].k;
    }
    p->nkeys = kbase;
    return take_children(p, base, v);
}

static int parse_value(json_parser *p, int32_t depth, ds4_json *v) {
    memset(v, 0, sizeof *v);
    skip_ws(p);
    if (p->pos >= p->len) return fail_at(p, p->pos, "unexpected end of input (expected a value)");
    if (p->n_items >= p->max_items)
        return fail_at(p, p->pos, "document has more than %zu values (the limit)", p->max_items);
    p->n_items++;
    unsigned char c = p->s[p->pos];
    switch (c) {
    case '{': return parse_object(p, depth + 1, v);
    case '[': return parse_array(p, depth + 1, v);
    case '"':
        v->type = DS4_JSON_STRING;
        return parse_string(p, &v->str, &v->str_len);
    case 't':
        v->type = DS4_JSON_BOOL;
        v->boolean = 1;
        return parse_literal(p, "true", 4);
    case 'f':
        v->type = DS4_JSON_BOOL;
        return parse_literal(p, "false", 5);
    case 'n':
        v->type = DS4_JSON_NULL;
        return parse_literal(p, "null", 4);
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, v);
        {
            char d[32];
            describe_byte(c, d, sizeof d);
            return fail_at(p, p->pos, "unexpected %s (expected a value)", d);
        }
    }
}

/* A zero field in `limits` selects the default for that field, so a zero-initialised struct is usable. */
ds4_json *ds4_json_parse(const char *text, size_t len, const ds4_json_limits *limits, ds4_error *err) {
    if (!text && len) {
        ds4_fail(err, DS4_ERR_ARG, "json: NULL text with length %zu", len);
        return NULL;
    }
    json_parser p;
    memset(&p, 0, sizeof p);
    p.s = (const unsigned char *)(text ? text : "");
    p.len = len;
    p.err = err;
    p.max_depth = JSON_DEFAULT_DEPTH;
    p.max_items = JSON_DEFAULT_ITEMS;
    if (limits) {
        if (limits->max_depth > 0) p.max_depth = limits->max_depth;
        if (limits->max_items > 0) p.max_items = limits->max_items;
    }
    if (p.max_depth > JSON_HARD_DEPTH) p.max_depth = JSON_HARD_DEPTH;

    json_doc *doc = malloc(sizeof *doc);
    ds4_json root;
    int rc = -1;
    if (!doc) {
        fail_oom(&p, sizeof *doc);
    } else if (parse_value(&p, 0, &root) == 0) {
        skip_ws(&p);
        if (p.pos != p.len) {
            char d[32];
            describe_byte(p.s[p.pos], d, sizeof d);
            fail_at(&p, p.pos, "trailing %s after the JSON value", d);
        } else {
            rc = 0;
        }
    }
    free(p.vals);
    free(p.keys);
    free(p.sortbuf);
    free(p.numbuf);
    if (rc) {
        arena_free(p.arena.head);
        free(doc);
        return NULL;
    }
    doc->root = root;
    doc->chunks = p.arena.head;
    return &doc->root;
}

/* `v` must be a value returned by ds4_json_parse (the document root): every node below it lives in the
 * document's arena. */
void ds4_json_free(ds4_json *v) {
    if (!v) return;
    json_doc *doc = (json_doc *)(void *)v;
    arena_free(doc->chunks);
    free(doc);
}

const ds4_json *ds4_json_get(const ds4_json *obj, const char *key) {
    if (!obj || obj->type != DS4_JSON_OBJECT || !key) return NULL;
    if (obj->count > JSON_SMALL_OBJECT) {
        const json_index *ix = (const json_index *)(const void *)obj->keys - 1;
        if (ix->magic == JSON_INDEX_MAGIC) {
            const uint32_t *slots = (const uint32_t *)(const void *)ix - ((size_t)ix->mask + 1);
            uint32_t h = key_hash(key, strlen(key), ix->seed) & ix->mask;
            for (; slots[h]; h = (h + 1) & ix->mask)
                if (strcmp(obj->keys[slots[h] - 1], key) == 0) return &obj->items[slots[h] - 1];
            return NULL;
        }
    }
    for (size_t i = 0; i < obj->count; i++)
        if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
    return NULL;
}
