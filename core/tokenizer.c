/* tokenizer.c — Hugging Face tokenizer.json byte-level BPE: loading, encode, decode (see ds4_tokenizer.h).
 *
 * The encode pipeline mirrors HF tokenizers' encode(text, add_special_tokens=False):
 *   1. added tokens with normalized = false are cut out of the raw text (leftmost-longest matches, found in
 *      linear time by an automaton over the reversed tokens; then HF's single_word / lstrip / rstrip rules);
 *   2. each stretch between them is normalised (NFC or nothing) and the added tokens with normalized = true
 *      are cut out of the normalised text the same way;
 *   3. each remaining stretch runs through the pre-tokenizer steps depth-first: a step splits its piece and
 *      hands every resulting piece straight to the next step. HF goes breadth-first over a list of pieces; the
 *      pieces are independent, so the order of work cannot change the result, and depth-first needs no lists;
 *   4. the last step (ByteLevel) optionally prefixes a space and splits with the GPT-2 regex, and byte-level
 *      BPE turns each piece into ids.
 * Everything works on raw bytes. ByteLevel's byte -> char mapping is a bijection, so instead of mapping the text
 * into that alphabet at encode time, the vocabulary is mapped out of it at load time: byte_id[] gives the id of
 * each single byte, merges are keyed by id pairs, and ignore_merges looks pieces up by their raw bytes.
 *
 * Regex splits replay Oniguruma's find_iter (what HF uses): after an empty match, an empty match at the same
 * position is skipped by advancing one character. Each split step sees only its own piece, as in HF.
 *
 * Ownership: a ds4_tokenizer owns one arena of strings (token texts and their decoded bytes, addressed by
 * offset so the arena may grow while loading), per-id tables, hash maps, the compiled regexes and a pool of
 * per-call scratch records. Nothing is shared between tokenizers. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "internal.h"
#include "json.h"

#define TOK_MAX_FILE ((size_t)1 << 30)       /* tokenizer.json size limit */
#define TOK_MAX_ID ((int32_t)1 << 22)        /* ids must be below this: bounds the per-id tables of a crafted file */
#define TOK_MAX_STAGES 64                    /* pre-tokenizer steps after flattening Sequences */
#define TOK_MAX_NEST 16                      /* Sequence / Sequence nesting */
#define TOK_POOL_MAX 16                      /* idle scratch records kept for reuse */
#define BPE_SMALL 64                         /* pieces up to this many symbols use the array merge loop */
#define MERGE_EMPTY UINT64_MAX

/* ------------------------------------------------------------------------------------------------ tables */

typedef enum { NORM_NONE = 0, NORM_NFC = 1 } norm_kind;
typedef enum { ST_REGEX = 0, ST_DIGITS = 1 } stage_kind;
typedef enum { B_REMOVED = 0, B_ISOLATED, B_MERGED_PREV, B_MERGED_NEXT, B_CONTIGUOUS } behavior;

/* A compiled pattern; jit: JIT compilation succeeded, so pcre2_jit_match may be called directly (it skips the
 * option checks pcre2_match repeats on every call, which matters at one call per pre-token). */
typedef struct tok_regex {
    pcre2_code *code;
    int jit;
} tok_regex;

typedef struct stage {
    stage_kind kind;
    behavior beh;
    int invert;
    tok_regex re;  /* ST_REGEX */
} stage;

/* A string -> id hash map whose keys live in the tokenizer arena (offset + length). */
typedef struct bmap_ent {
    uint32_t off, len;
    int32_t id;  /* -1: empty slot */
    uint32_t hash;
} bmap_ent;
typedef struct bmap {
    bmap_ent *e;
    uint32_t mask;
    uint32_t n;
} bmap;

typedef struct merge_ent {
    uint64_t key;  /* (left id << 32) | right id; MERGE_EMPTY: empty slot */
    uint32_t rank;
    int32_t new_id;
} merge_ent;

#define AT_SINGLE_WORD 1u
#define AT_LSTRIP 2u
#define AT_RSTRIP 4u

/* Added-token matcher: an Aho-Corasick automaton over the *reversed* token texts. root[b] is the node reached by
 * the last byte b of a token (node 0 is the root itself); children are a sibling list; id >= 0 marks a whole
 * (reversed) token. fail is the usual failure link and out the deepest node on the node's fail chain (itself
 * included) that is a whole token, 0 when none. Reading a text backwards, the state at byte i is the longest
 * reversed-token prefix that the text read so far ends with — the longest token suffix that p[i..] starts with —
 * so its `out` is the longest added token that starts at i. starts[b]: some token begins with byte b. */
typedef struct trie_node {
    uint32_t child, sibling, fail, out, depth;
    int32_t id;
    uint8_t byte, flags;
} trie_node;
typedef struct trie {
    trie_node *nodes;
    uint32_t n, cap;
    uint32_t root[256];
    uint8_t starts[256];
    size_t max_len; /* longest token: the state at i depends on p[i .. i + max_len) only */
    int empty;
} trie;

/* Per-call scratch (see the pool below). */
typedef struct bsym {
    int32_t id, prev, next;
    int32_t alive;
} bsym;
typedef struct bheap {
    uint32_t rank, pos;
    int32_t nid;
} bheap;

/* A direct-mapped memo of BPE results for short pre-tokens: natural text repeats its words, and BPE of a piece is
 * a pure function of its bytes, so a hit returns exactly what the merge loop would. One per scratch record, so it
 * is never shared between threads; it survives across calls because scratch records are pooled. */
#define CACHE_SLOTS 4096
#define CACHE_KEY 22
#define CACHE_IDS 8
typedef struct cache_ent {
    uint8_t klen;  /* 0: empty slot */
    uint8_t nids;
    uint8_t key[CACHE_KEY];
    int32_t ids[CACHE_IDS];
} cache_ent;

typedef struct tok_scratch {
    struct tok_scratch *next;
    cache_ent *cache;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    uint8_t *norm;  /* normalised text of the current stretch */
    size_t norm_cap;
    uint8_t *pre;   /* " " + piece for ByteLevel's add_prefix_space */
    size_t pre_cap;
    uint32_t *best[2]; /* added-token matches of one block of text (trie `out` node per start position), for the */
    size_t best_cap[2]; /* raw [0] and the normalised [1] automaton: a raw stretch is split while the other runs */
    bsym *syms;     /* large-piece BPE */
    bheap *heap;
    size_t big_cap;
    int32_t sym[BPE_SMALL], nid[BPE_SMALL];
    uint32_t rank[BPE_SMALL];
} tok_scratch;

typedef struct tok_pool {
    pthread_mutex_t mu;
    tok_scratch *free_list;
    int32_t n_free;
} tok_pool;

struct ds4_tokenizer {
    int32_t n_ids;          /* largest id + 1 */
    char *arena;
    size_t arena_len, arena_cap;
    uint32_t *tok_off, *tok_len;  /* id -> token text (as in the vocabulary / added token content) */
    uint32_t *dec_off, *dec_len;  /* id -> decoded bytes */
    uint8_t *id_flags;            /* ID_ASSIGNED | ID_SPECIAL */
    bmap model;                   /* model vocabulary: token text -> id */
    bmap added;                   /* added token content -> id (HF's added_tokens_map) */
    bmap raw;                     /* ignore_merges: decoded bytes of model tokens -> id */
    merge_ent *merges;
    uint32_t merge_mask;
    int32_t byte_id[256];         /* model id of each byte's ByteLevel character, -1 when absent */
    int ignore_merges;
    norm_kind norm;
    trie trie_raw, trie_norm;     /* added tokens matched before / after normalisation */
    stage stages[TOK_MAX_STAGES];
    int32_t n_stages;
    int bl_prefix_space, bl_use_regex;
    tok_regex gpt2;
    tok_pool *pool;
    char *json;                   /* the tokenizer.json text it was loaded from (ds4_tokenizer_json) */
    size_t json_len;
};

#define ID_ASSIGNED 1u
#define ID_SPECIAL 2u

static const struct {
    const char *name, *content;
} SPECIAL_NAMES[] = {
    {"bos", "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"},
    {"eos", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"},
    {"user", "<\xef\xbd\x9cUser\xef\xbd\x9c>"},
    {"assistant", "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"},
    {"think", "<think>"},
    {"end_think", "</think>"},
    {"latest_reminder", "<\xef\xbd\x9clatest_reminder\xef\xbd\x9c>"},
    {"dsml", "\xef\xbd\x9c" "DSML\xef\xbd\x9c"},
    {"pad", "<\xef\xbd\x9c\xe2\x96\x81pad\xe2\x96\x81\xef\xbd\x9c>"},
    {"action", "<\xef\xbd\x9c" "action\xef\xbd\x9c>"},
    {"query", "<\xef\xbd\x9cquery\xef\xbd\x9c>"},
    {"authority", "<\xef\xbd\x9c" "authority\xef\xbd\x9c>"},
    {"domain", "<\xef\xbd\x9c" "domain\xef\xbd\x9c>"},
    {"title", "<\xef\xbd\x9ctitle\xef\xbd\x9c>"},
    {"read_url", "<\xef\xbd\x9cread_url\xef\xbd\x9c>"},
    {"tool_calls_begin", "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"},
    {"tool_calls_end", "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"},
    {"tool_call_begin", "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"},
    {"tool_call_end", "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"},
    {"tool_sep", "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"},
    {"tool_outputs_begin", "<\xef\xbd\x9ctool\xe2\x96\x81outputs\xe2\x96\x81" "begin\xef\xbd\x9c>"},
    {"tool_outputs_end", "<\xef\xbd\x9ctool\xe2\x96\x81outputs\xe2\x96\x81" "end\xef\xbd\x9c>"},
    {"tool_output_begin", "<\xef\xbd\x9ctool\xe2\x96\x81output\xe2\x96\x81" "begin\xef\xbd\x9c>"},
    {"tool_output_end", "<\xef\xbd\x9ctool\xe2\x96\x81output\xe2\x96\x81" "end\xef\xbd\x9c>"},
};
#define N_SPECIAL_NAMES (sizeof SPECIAL_NAMES / sizeof SPECIAL_NAMES[0])

static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ------------------------------------------------------------------------------------------------ bytes */

/* GPT-2's bytes_to_unicode: printable bytes stand for themselves, the 68 others (0x00-0x20, 0x7F-0xA0, 0xAD)
 * become U+0100.. in byte order. */
static uint32_t byte_to_cp(uint32_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    if (b <= 0x20) return 256 + b;
    if (b <= 0xA0) return 256 + 33 + (b - 0x7F);
    return 256 + 33 + 34; /* 0xAD */
}

static int cp_to_byte(uint32_t cp) {
    if (cp < 256) return ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || cp >= 0xAE) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 33 + 34) return (int)(0x7F + (cp - 256 - 33));
    if (cp == 256 + 33 + 34) return 0xAD;
    return -1;
}

/* The valid UTF-8 character at p (Unicode scalar values only, shortest form, as Rust's str and PCRE2 demand):
 * its length, or 0 when the bytes at p are not one. */
static size_t utf8_char(const uint8_t *p, size_t n, uint32_t *cp) {
    uint32_t c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c < 0xC2) return 0;
    if (c < 0xE0) {
        if (n < 2 || (p[1] & 0xC0) != 0x80) return 0;
        *cp = ((c & 0x1F) << 6) | (p[1] & 0x3Fu);
        return 2;
    }
    if (c < 0xF0) {
        if (n < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
        uint32_t v = ((c & 0x0F) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
        if (v < 0x800 || (v >= 0xD800 && v <= 0xDFFF)) return 0;
        *cp = v;
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
        uint32_t v = ((c & 0x07) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
        if (v < 0x10000 || v > 0x10FFFF) return 0;
        *cp = v;
        return 4;
    }
    return 0;
}

/* Length of the longest valid UTF-8 prefix of p[0..n). */
static size_t utf8_valid_prefix(const uint8_t *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        /* ASCII runs dominate real text: check 8 bytes at a time */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            if (w & 0x8080808080808080ull) break;
            i += 8;
        }
        if (i >= n) break;
        uint32_t cp;
        size_t l = utf8_char(p + i, n - i, &cp);
        if (!l) break;
        i += l;
    }
    return i;
}

/* Length of the invalid stretch at p: bytes up to the next position where a valid character starts. */
static size_t utf8_invalid_run(const uint8_t *p, size_t n) {
    size_t i = 1;
    uint32_t cp;
    while (i < n && !utf8_char(p + i, n - i, &cp)) i++;
    return i;
}

/* Unicode White_Space (Rust's char::is_whitespace and the regex crate's \s, which HF's lstrip/rstrip use). */
static int is_white_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* The regex crate's Unicode \w (Alphabetic, M, Nd, Pc, Join_Control), which HF's single_word rule uses.
 * Alphabetic is approximated by L, Nl and the Other_Alphabetic symbols outside M (circled / squared
 * letters); utf8proc has no property tables beyond the general category. */
static int is_word_char(uint32_t c) {
    if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    if (c == 0x200C || c == 0x200D) return 1;
    if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
        (c >= 0x1F170 && c <= 0x1F189))
        return 1;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC: return 1;
    default: return 0;
    }
}

/* Rust's char::is_numeric (general categories Nd, Nl, No): what HF's Digits pre-tokenizer splits on. */
static int is_numeric(uint32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    if (c < 0xB2) return 0;
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

/* The character ending at p[n-1] (searching back at most 4 bytes), or 0 when none is valid there. */
static int last_char(const uint8_t *p, size_t n, uint32_t *cp) {
    for (size_t k = 1; k <= 4 && k <= n; k++) {
        if (utf8_char(p + n - k, k, cp) == k) return 1;
        if ((p[n - k] & 0xC0) != 0x80) break;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ hashing */

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    h = (h ^ v) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h;
}

static int bmap_init(bmap *m, size_t expect) {
    size_t cap = 16;
    while (cap < expect * 2 + 16) cap <<= 1;
    if (cap > ((size_t)1 << 31)) return 0;
    m->e = malloc(cap * sizeof *m->e);
    if (!m->e) return 0;
    for (size_t i = 0; i < cap; i++) m->e[i].id = -1;
    m->mask = (uint32_t)(cap - 1);
    m->n = 0;
    return 1;
}

static int32_t bmap_get(const bmap *m, const char *arena, const void *key, size_t len) {
    if (!m->e) return -1;
    uint32_t h = (uint32_t)hash_bytes(key, len);
    for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
        const bmap_ent *e = &m->e[i];
        if (e->id < 0) return -1;
        if (e->hash == h && e->len == len && memcmp(arena + e->off, key, len) == 0) return e->id;
    }
}

static int bmap_grow(bmap *m) {
    size_t cap = (size_t)m->mask + 1;
    bmap_ent *old = m->e;
    bmap nm;
    if (!bmap_init(&nm, cap)) return 0; /* twice the capacity */
    for (size_t i = 0; i < cap; i++) {
        if (old[i].id < 0) continue;
        uint32_t j = old[i].hash & nm.mask;
        while (nm.e[j].id >= 0) j = (j + 1) & nm.mask;
        nm.e[j] = old[i];
    }
    nm.n = m->n;
    free(old);
    *m = nm;
    return 1;
}

/* Insert key (arena[off..off+len)) -> id, replacing the id of an equal key. 0 on OOM. */
static int bmap_put(bmap *m, const char *arena, uint32_t off, uint32_t len, int32_t id) {
    if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1 && !bmap_grow(m)) return 0;
    uint32_t h = (uint32_t)hash_bytes((const uint8_t *)arena + off, len);
    for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
        bmap_ent *e = &m->e[i];
        if (e->id < 0) {
            e->off = off;
            e->len = len;
            e->id = id;
            e->hash = h;
            m->n++;
            return 1;
        }
        if (e->hash == h && e->len == len && memcmp(arena + e->off, arena + off, len) == 0) {
            e->id = id;
            return 1;
        }
    }
}

static inline size_t merge_slot(uint64_t key, uint32_t mask) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

static inline int merge_find(const ds4_tokenizer *t, int32_t a, int32_t b, uint32_t *rank, int32_t *nid) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (size_t i = merge_slot(key, t->merge_mask);; i = (i + 1) & t->merge_mask) {
        const merge_ent *m = &t->merges[i];
        if (m->key == key) {
            *rank = m->rank;
            *nid = m->new_id;
            return 1;
        }
        if (m->key == MERGE_EMPTY) return 0;
    }
}

/* ------------------------------------------------------------------------------------------------ trie */

static int trie_init(trie *tr) {
    memset(tr, 0, sizeof *tr);
    tr->cap = 64;
    tr->nodes = calloc(tr->cap, sizeof *tr->nodes);
    if (!tr->nodes) return 0;
    tr->n = 1; /* node 0: the root */
    tr->empty = 1;
    return 1;
}

static uint32_t trie_new_node(trie *tr, uint8_t byte) {
    if (tr->n == tr->cap) {
        if (tr->cap > (UINT32_MAX >> 2)) return 0;
        trie_node *nn = realloc(tr->nodes, (size_t)tr->cap * 2 * sizeof *nn);
        if (!nn) return 0;
        tr->nodes = nn;
        tr->cap *= 2;
    }
    trie_node *nd = &tr->nodes[tr->n];
    nd->child = nd->sibling = nd->fail = nd->out = nd->depth = 0;
    nd->id = -1;
    nd->byte = byte;
    nd->flags = 0;
    return tr->n++;
}

static uint32_t trie_child(const trie *tr, uint32_t node, uint8_t byte) {
    if (!node) return tr->root[byte];
    uint32_t c = tr->nodes[node].child;
    while (c && tr->nodes[c].byte != byte) c = tr->nodes[c].sibling;
    return c;
}

/* Insert token s[0..n) reversed. trie_build must run after the last insert. */
static int trie_insert(trie *tr, const uint8_t *s, size_t n, int32_t id, uint8_t flags) {
    if (n == 0) return 1;
    if (n > UINT32_MAX) return 0;
    uint32_t cur = 0;
    for (size_t k = n; k-- > 0;) {
        uint32_t c = trie_child(tr, cur, s[k]);
        if (!c) {
            if (!(c = trie_new_node(tr, s[k]))) return 0;
            tr->nodes[c].depth = (uint32_t)(n - k);
            if (!cur) {
                tr->root[s[k]] = c;
            } else {
                tr->nodes[c].sibling = tr->nodes[cur].child;
                tr->nodes[cur].child = c;
            }
        }
        cur = c;
    }
    tr->nodes[cur].id = id;
    tr->nodes[cur].flags = flags;
    tr->starts[s[0]] = 1;
    if (n > tr->max_len) tr->max_len = n;
    tr->empty = 0;
    return 1;
}

/* The automaton's transition from `node` on `byte`, following failure links. */
static uint32_t trie_step(const trie *tr, uint32_t node, uint8_t byte) {
    for (;;) {
        uint32_t c = trie_child(tr, node, byte);
        if (c || !node) return c;
        node = tr->nodes[node].fail;
    }
}

/* Failure and output links, breadth-first (a node's fail link is shallower than the node). */
static int trie_build(trie *tr) {
    uint32_t *queue = malloc((size_t)tr->n * sizeof *queue);
    if (!queue) return 0;
    size_t head = 0, tail = 0;
    for (int b = 0; b < 256; b++) {
        uint32_t c = tr->root[b];
        if (!c) continue;
        tr->nodes[c].fail = 0;
        tr->nodes[c].out = tr->nodes[c].id >= 0 ? c : 0;
        queue[tail++] = c;
    }
    while (head < tail) {
        uint32_t u = queue[head++];
        for (uint32_t c = tr->nodes[u].child; c; c = tr->nodes[c].sibling) {
            uint32_t f = trie_step(tr, tr->nodes[u].fail, tr->nodes[c].byte);
            tr->nodes[c].fail = f;
            tr->nodes[c].out = tr->nodes[c].id >= 0 ? c : tr->nodes[f].out;
            queue[tail++] = c;
        }
    }
    free(queue);
    return 1;
}

/* best[i - a] = the `out` node of the longest token starting at i, for i in [a, b): one backward pass from
 * b + max_len - 1 (the state at i depends on the max_len bytes from i only). */
static void trie_matches(const trie *tr, const uint8_t *p, size_t n, size_t a, size_t b, uint32_t *best) {
    size_t e = b + tr->max_len - 1;
    if (e > n) e = n;
    uint32_t st = 0;
    for (size_t j = e; j-- > a;) {
        st = trie_step(tr, st, p[j]);
        if (j < b) best[j - a] = tr->nodes[st].out;
    }
}

/* ------------------------------------------------------------------------------------------------ regexes */

static ds4_status compile_regex(const char *pat, size_t len, int literal, tok_regex *out, const char *where,
                                ds4_error *err) {
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    if (!cc) return ds4_fail(err, DS4_ERR_OOM, "tokenizer: %s: cannot allocate a PCRE2 compile context", where);
    uint32_t opts;
    if (literal) {
        opts = PCRE2_LITERAL | PCRE2_UTF;
    } else {
        /* HF compiles with Oniguruma's Ruby syntax: ^/$ are line anchors there, and \uHHHH, \u{..}, \x{..} are
         * escapes. \C could split a UTF-8 character and is refused. */
        opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_ALT_BSUX | PCRE2_NEVER_BACKSLASH_C;
        pcre2_set_compile_extra_options(cc, PCRE2_EXTRA_ALT_BSUX);
    }
    int ec = 0;
    PCRE2_SIZE eo = 0;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &ec, &eo, cc);
    pcre2_compile_context_free(cc);
    if (!re) {
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(ec, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", ec);
        return ds4_fail(err, DS4_ERR_FORMAT, "tokenizer: %s: regex does not compile (PCRE2: %s, at pattern offset %zu)",
                        where, (const char *)msg, (size_t)eo);
    }
    /* Without JIT support (some builds/CPUs) PCRE2 falls back to its interpreter: same results, slower. */
    out->jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    out->code = re;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ scratch pool */

static void scratch_free(tok_scratch *s) {
    if (!s) return;
    pcre2_match_data_free(s->md);
    pcre2_match_context_free(s->mctx);
    pcre2_jit_stack_free(s->jit);
    free(s->norm);
    free(s->pre);
    free(s->best[0]);
    free(s->best[1]);
    free(s->syms);
    free(s->heap);
    free(s->cache);
    free(s);
}

static tok_scratch *scratch_acquire(const ds4_tokenizer *t) {
    tok_pool *p = t->pool;
    pthread_mutex_lock(&p->mu);
    tok_scratch *s = p->free_list;
    if (s) {
        p->free_list = s->next;
        p->n_free--;
    }
    pthread_mutex_unlock(&p->mu);
    if (s) return s;
    s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->md = pcre2_match_data_create(1, NULL);
    s->mctx = pcre2_match_context_create(NULL);
    /* PCRE2's default JIT stack (32 KiB on the machine stack) is too small for long whitespace runs under
     * \s+(?!\S): give each scratch its own, growing up to 8 MiB. */
    s->jit = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    s->cache = calloc(CACHE_SLOTS, sizeof *s->cache);
    if (!s->md || !s->mctx || !s->jit || !s->cache) {
        scratch_free(s);
        return NULL;
    }
    pcre2_jit_stack_assign(s->mctx, NULL, s->jit);
    return s;
}

static void scratch_release(const ds4_tokenizer *t, tok_scratch *s) {
    tok_pool *p = t->pool;
    /* an idle record keeps ordinary-sized buffers only: one huge input must not pin its memory in the pool */
    if (s->big_cap > 4096) {
        free(s->syms);
        free(s->heap);
        s->syms = NULL;
        s->heap = NULL;
        s->big_cap = 0;
    }
    if (s->norm_cap > ((size_t)1 << 20)) {
        free(s->norm);
        s->norm = NULL;
        s->norm_cap = 0;
    }
    if (s->pre_cap > ((size_t)1 << 20)) {
        free(s->pre);
        s->pre = NULL;
        s->pre_cap = 0;
    }
    for (int lv = 0; lv < 2; lv++)
        if (s->best_cap[lv] > ((size_t)1 << 18)) {
            free(s->best[lv]);
            s->best[lv] = NULL;
            s->best_cap[lv] = 0;
        }
    pthread_mutex_lock(&p->mu);
    if (p->n_free < TOK_POOL_MAX) {
        s->next = p->free_list;
        p->free_list = s;
        p->n_free++;
        s = NULL;
    }
    pthread_mutex_unlock(&p->mu);
    scratch_free(s);
}

static int grow_bytes(uint8_t **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 1;
    size_t nc = *cap ? *cap : 256;
    while (nc < need) {
        if (nc > ((size_t)-1) / 2) return 0;
        nc *= 2;
    }
    uint8_t *nb = realloc(*buf, nc);
    if (!nb) return 0;
    *buf = nb;
    *cap = nc;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ encode */

typedef struct enc {
    const ds4_tokenizer *t;
    tok_scratch *s;
    ds4_tokens *out;
    int valid;  /* the whole input is valid UTF-8, so every piece is: no per-piece checks */
    ds4_error *err;
} enc;

/* A callback receiving the pieces of a split: [s, e) of the piece being split, is_match as the pattern said. */
typedef ds4_status (*piece_fn)(enc *e, void *arg, size_t s, size_t end, int is_match);

static ds4_status push_id(enc *e, int32_t id) {
    ds4_tokens *o = e->out;
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 64;
        if (nc > ((size_t)-1) / sizeof(int32_t)) return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: too many ids");
        int32_t *ni = realloc(o->ids, nc * sizeof *ni);
        if (!ni) return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: cannot grow the id array to %zu ids", nc);
        o->ids = ni;
        o->cap = nc;
    }
    o->ids[o->n++] = id;
    return DS4_OK;
}

/* BPE of one piece with many symbols: HF's Word::merge_all (a heap of (rank, position) candidate merges over a
 * linked list of symbols; stale heap entries are skipped when popped). */
static ds4_status bpe_big(enc *e, const uint8_t *p, size_t n) {
    const ds4_tokenizer *t = e->t;
    tok_scratch *s = e->s;
    if (n > s->big_cap) {
        size_t hc;
        if (n > (size_t)INT32_MAX / 4 || !ds4_mul_size(n, 3, &hc))
            return ds4_fail(e->err, DS4_ERR_ARG, "tokenizer encode: a pre-token of %zu bytes is too long", n);
        bsym *ns = malloc(n * sizeof *ns);
        bheap *nh = malloc((hc + 4) * sizeof *nh);
        if (!ns || !nh) {
            free(ns);
            free(nh);
            return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: BPE scratch for a %zu-byte pre-token", n);
        }
        free(s->syms);
        free(s->heap);
        s->syms = ns;
        s->heap = nh;
        s->big_cap = n;
    }
    bsym *sy = s->syms;
    bheap *hp = s->heap;
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[p[i]];
        if (id < 0) continue; /* HF drops characters the vocabulary lacks when there is no unk token */
        sy[m].id = id;
        sy[m].prev = m - 1;
        sy[m].next = m + 1;
        sy[m].alive = 1;
        m++;
    }
    if (m == 0) return DS4_OK;
    sy[m - 1].next = -1;
    size_t hn = 0;
    /* binary min-heap on (rank, pos) */
#define HLESS(x, y) ((x).rank < (y).rank || ((x).rank == (y).rank && (x).pos < (y).pos))
#define HPUSH(R, P, N)                                          \
    do {                                                        \
        size_t k_ = hn++;                                       \
        bheap v_ = {(R), (uint32_t)(P), (N)};                   \
        while (k_ > 0) {                                        \
            size_t up_ = (k_ - 1) / 2;                          \
            if (!HLESS(v_, hp[up_])) break;                     \
            hp[k_] = hp[up_];                                   \
            k_ = up_;                                           \
        }                                                       \
        hp[k_] = v_;                                            \
    } while (0)
    for (int32_t i = 0; i + 1 < m; i++) {
        uint32_t r;
        int32_t nid;
        if (merge_find(t, sy[i].id, sy[i + 1].id, &r, &nid)) HPUSH(r, i, nid);
    }
    while (hn > 0) {
        bheap top = hp[0];
        bheap last = hp[--hn];
        size_t k = 0;
        for (;;) {
            size_t c = 2 * k + 1;
            if (c >= hn) break;
            if (c + 1 < hn && HLESS(hp[c + 1], hp[c])) c++;
            if (!HLESS(hp[c], last)) break;
            hp[k] = hp[c];
            k = c;
        }
        if (hn > 0) hp[k] = last;

        int32_t pos = (int32_t)top.pos;
        if (!sy[pos].alive || sy[pos].next < 0) continue;
        int32_t nx = sy[pos].next;
        uint32_t r;
        int32_t nid;
        if (!merge_find(t, sy[pos].id, sy[nx].id, &r, &nid) || nid != top.nid) continue; /* stale entry */
        sy[pos].id = top.nid;
        sy[nx].alive = 0;
        sy[pos].next = sy[nx].next;
        if (sy[pos].next >= 0) sy[sy[pos].next].prev = pos;
        if (sy[pos].prev >= 0 && merge_find(t, sy[sy[pos].prev].id, sy[pos].id, &r, &nid)) HPUSH(r, sy[pos].prev, nid);
        if (sy[pos].next >= 0 && merge_find(t, sy[pos].id, sy[sy[pos].next].id, &r, &nid)) HPUSH(r, pos, nid);
    }
#undef HPUSH
#undef HLESS
    for (int32_t i = 0; i >= 0; i = sy[i].next) {
        ds4_status st = push_id(e, sy[i].id);
        if (st) return st;
    }
    return DS4_OK;
}

/* BPE of one pre-token. Short pieces (nearly all) use arrays: repeatedly merge the lowest-rank adjacent pair,
 * leftmost first among equal ranks, which is exactly the order HF's heap produces. */
static ds4_status bpe_piece(enc *e, const uint8_t *p, size_t n) {
    const ds4_tokenizer *t = e->t;
    if (n == 0) return DS4_OK;
    if (t->ignore_merges) {
        int32_t id = bmap_get(&t->raw, t->arena, p, n);
        if (id >= 0) return push_id(e, id);
    }
    if (n == 1) {
        int32_t id = t->byte_id[p[0]];
        return id >= 0 ? push_id(e, id) : DS4_OK;
    }
    if (n > BPE_SMALL) return bpe_big(e, p, n);
    tok_scratch *s = e->s;
    cache_ent *ce = NULL;
    if (n <= CACHE_KEY) {
        ce = &s->cache[hash_bytes(p, n) & (CACHE_SLOTS - 1)];
        if (ce->klen == n && memcmp(ce->key, p, n) == 0) {
            for (size_t i = 0; i < ce->nids; i++) {
                ds4_status st = push_id(e, ce->ids[i]);
                if (st) return st;
            }
            return DS4_OK;
        }
    }
    int32_t *sym = s->sym, *nid = s->nid;
    uint32_t *rank = s->rank;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[p[i]];
        if (id >= 0) sym[m++] = id;
    }
    if (m == 0) return DS4_OK;
    for (size_t i = 0; i + 1 < m; i++)
        if (!merge_find(t, sym[i], sym[i + 1], &rank[i], &nid[i])) rank[i] = UINT32_MAX;
    while (m > 1) {
        size_t best = 0;
        uint32_t br = UINT32_MAX;
        for (size_t i = 0; i + 1 < m; i++)
            if (rank[i] < br) {
                br = rank[i];
                best = i;
            }
        if (br == UINT32_MAX) break;
        sym[best] = nid[best];
        /* drop symbol best+1 and the pair that started at it */
        for (size_t i = best + 1; i + 1 < m; i++) {
            sym[i] = sym[i + 1];
            rank[i] = rank[i + 1];
            nid[i] = nid[i + 1];
        }
        m--;
        if (best > 0 && !merge_find(t, sym[best - 1], sym[best], &rank[best - 1], &nid[best - 1]))
            rank[best - 1] = UINT32_MAX;
        if (best + 1 < m && !merge_find(t, sym[best], sym[best + 1], &rank[best], &nid[best])) rank[best] = UINT32_MAX;
    }
    if (ce && m <= CACHE_IDS) {
        ce->klen = (uint8_t)n;
        ce->nids = (uint8_t)m;
        memcpy(ce->key, p, n);
        memcpy(ce->ids, sym, m * sizeof *sym);
    }
    for (size_t i = 0; i < m; i++) {
        ds4_status st = push_id(e, sym[i]);
        if (st) return st;
    }
    return DS4_OK;
}

static ds4_status regex_error(enc *e, int rc, const char *what) {
    PCRE2_UCHAR msg[256];
    if (pcre2_get_error_message(rc, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", rc);
    ds4_status code = rc == PCRE2_ERROR_NOMEMORY ? DS4_ERR_OOM : DS4_ERR_UNSUPPORTED;
    return ds4_fail(e->err, code, "tokenizer encode: %s: regex match failed (PCRE2: %s)", what, (const char *)msg);
}

/* Oniguruma's find_iter over the valid UTF-8 stretch p[rs..rend), reporting matches and the gaps between them
 * (HF's Pattern::find_matches) with offsets relative to p. */
static ds4_status regex_run(enc *e, const tok_regex *re, const char *what, const uint8_t *p, size_t rs, size_t rend,
                            piece_fn fn, void *arg) {
    const uint8_t *sub = p + rs;
    size_t len = rend - rs, last_end = 0, prev = 0, lme = 0;
    int have_lme = 0;
    ds4_status st;
    while (last_end <= len) {
        int rc = re->jit ? pcre2_jit_match(re->code, sub, len, last_end, PCRE2_NO_UTF_CHECK, e->s->md, e->s->mctx)
                         : pcre2_match(re->code, sub, len, last_end, PCRE2_NO_UTF_CHECK, e->s->md, e->s->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return regex_error(e, rc, what);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->s->md);
        size_t ms = ov[0], me = ov[1];
        if (ms > me || me > len || ms < last_end)
            return ds4_fail(e->err, DS4_ERR_INTERNAL, "tokenizer encode: %s: match [%zu, %zu) outside [%zu, %zu]", what,
                            ms, me, last_end, len);
        if (ms == me && have_lme && lme == me) {
            /* an empty match right after the previous match: step over one character */
            if (last_end >= len) break;
            uint32_t cp;
            size_t cl = utf8_char(sub + last_end, len - last_end, &cp);
            last_end += cl ? cl : 1;
            continue;
        }
        last_end = me;
        lme = me;
        have_lme = 1;
        if (prev != ms && (st = fn(e, arg, rs + prev, rs + ms, 0))) return st;
        if ((st = fn(e, arg, rs + ms, rs + me, 1))) return st;
        prev = me;
    }
    if (prev != len && (st = fn(e, arg, rs + prev, rs + len, 0))) return st;
    return DS4_OK;
}

/* The regex pieces of p[0..n): valid stretches are matched, each invalid stretch is one non-matching piece. */
static ds4_status regex_walk(enc *e, const tok_regex *re, const char *what, const uint8_t *p, size_t n, piece_fn fn,
                             void *arg) {
    if (e->valid) return regex_run(e, re, what, p, 0, n, fn, arg);
    size_t pos = 0;
    ds4_status st;
    while (pos < n) {
        size_t v = utf8_valid_prefix(p + pos, n - pos);
        if (v) {
            if ((st = regex_run(e, re, what, p, pos, pos + v, fn, arg))) return st;
            pos += v;
        } else {
            size_t bad = utf8_invalid_run(p + pos, n - pos);
            if ((st = fn(e, arg, pos, pos + bad, 0))) return st;
            pos += bad;
        }
    }
    return DS4_OK;
}

/* HF's char-predicate pattern for Digits: every numeric character is a match of its own. */
static ds4_status digits_walk(enc *e, const uint8_t *p, size_t n, piece_fn fn, void *arg) {
    size_t last = 0, i = 0;
    ds4_status st;
    while (i < n) {
        uint32_t cp = 0;
        size_t l = p[i] < 0x80 ? (cp = p[i], 1) : utf8_char(p + i, n - i, &cp);
        int num = l ? is_numeric(cp) : 0;
        if (!l) l = 1; /* an invalid byte: not a digit */
        if (num) {
            if (last < i && (st = fn(e, arg, last, i, 0))) return st;
            if ((st = fn(e, arg, i, i + l, 1))) return st;
            last = i + l;
        }
        i += l;
    }
    if (last < n && (st = fn(e, arg, last, n, 0))) return st;
    return DS4_OK;
}

static ds4_status run_stage(enc *e, int32_t k, const uint8_t *p, size_t n);

/* One split step in progress: HF's NormalizedString::split behaviours, fed one piece at a time with a single
 * pending group (the only look-back any behaviour needs). */
typedef struct splitter {
    const stage *sg;
    int32_t next;
    const uint8_t *base;
    size_t ps, pe;    /* pending group */
    int has;          /* a group is pending */
    int prev_flag;    /* is_match of the previous piece */
    int last_match;   /* MergedWithNext: the pending group ends with a match */
} splitter;

static ds4_status split_emit(enc *e, splitter *sp, size_t s, size_t end) {
    return end > s ? run_stage(e, sp->next, sp->base + s, end - s) : DS4_OK; /* HF drops empty splits */
}

/* Emit the pending group (if any) and start a new one with [s, end). */
static ds4_status split_restart(enc *e, splitter *sp, size_t s, size_t end) {
    const ds4_status st = sp->has ? split_emit(e, sp, sp->ps, sp->pe) : DS4_OK;
    sp->ps = s;
    sp->pe = end;
    sp->has = 1;
    return st;
}

static ds4_status split_feed(enc *e, void *arg, size_t s, size_t end, int flag) {
    splitter *sp = arg;
    ds4_status st = DS4_OK;
    if (sp->sg->invert) flag = !flag;
    switch (sp->sg->beh) {
    case B_ISOLATED: return split_emit(e, sp, s, end);
    case B_REMOVED: return flag ? DS4_OK : split_emit(e, sp, s, end);
    case B_CONTIGUOUS:
        if (sp->has && flag == sp->prev_flag) sp->pe = end;
        else st = split_restart(e, sp, s, end);
        sp->prev_flag = flag;
        return st;
    case B_MERGED_PREV:
        if (flag && !sp->prev_flag && sp->has) sp->pe = end;
        else st = split_restart(e, sp, s, end);
        sp->prev_flag = flag;
        return st;
    case B_MERGED_NEXT:
        /* HF folds from the right: a match joins the piece after it when that piece is not a match. */
        if (sp->has && sp->last_match && !flag) {
            sp->pe = end;
            sp->last_match = 0;
        } else {
            st = split_restart(e, sp, s, end);
            sp->last_match = flag;
        }
        return st;
    }
    return ds4_fail(e->err, DS4_ERR_INTERNAL, "tokenizer encode: unknown split behaviour %d", (int)sp->sg->beh);
}

static ds4_status bpe_cb(enc *e, void *arg, size_t s, size_t end, int is_match) {
    (void)is_match;
    return bpe_piece(e, (const uint8_t *)arg + s, end - s);
}

/* The last step: ByteLevel (prefix space, GPT-2 regex), then BPE. */
static ds4_status bytelevel_piece(enc *e, const uint8_t *p, size_t n) {
    const ds4_tokenizer *t = e->t;
    if (t->bl_prefix_space && p[0] != ' ') {
        tok_scratch *s = e->s;
        if (!grow_bytes(&s->pre, &s->pre_cap, n + 1))
            return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: prefix-space buffer of %zu bytes", n + 1);
        s->pre[0] = ' ';
        memcpy(s->pre + 1, p, n);
        p = s->pre;
        n++;
    }
    if (t->bl_use_regex) return regex_walk(e, &t->gpt2, "ByteLevel regex", p, n, bpe_cb, (void *)p);
    return bpe_piece(e, p, n);
}

static ds4_status run_stage(enc *e, int32_t k, const uint8_t *p, size_t n) {
    const ds4_tokenizer *t = e->t;
    if (k == t->n_stages) return bytelevel_piece(e, p, n);
    const stage *sg = &t->stages[k];
    splitter sp = {sg, k + 1, p, 0, 0, 0, 0, 0};
    ds4_status st = sg->kind == ST_DIGITS ? digits_walk(e, p, n, split_feed, &sp)
                                          : regex_walk(e, &sg->re, "Split regex", p, n, split_feed, &sp);
    if (st) return st;
    return sp.has ? split_emit(e, &sp, sp.ps, sp.pe) : DS4_OK;
}

/* A piece of text with no added token left in it. */
static ds4_status pretok_text(enc *e, const uint8_t *p, size_t n) {
    return n ? run_stage(e, 0, p, n) : DS4_OK;
}

typedef ds4_status (*text_fn)(enc *e, const uint8_t *p, size_t n);

/* HF's AddedVocabulary::find_matches: cut the added tokens of `tr` out of p[0..n); token ids are pushed, the
 * text between them goes to `text`. */
static ds4_status split_added(enc *e, const trie *tr, const uint8_t *p, size_t n, text_fn text) {
    if (tr->empty) return text(e, p, n);
    /* matches are computed a block at a time: [blk_a, blk_b), at least max_len long so that the backward pass
     * that fills a block reads at most twice its length (linear overall, memory bounded by the longest token) */
    const size_t W = tr->max_len > 4096 ? tr->max_len : 4096;
    tok_scratch *sc = e->s;
    const int lv = tr != &e->t->trie_raw;
    if (sc->best_cap[lv] < W) {
        uint32_t *nb = realloc(sc->best[lv], W * sizeof *nb);
        if (!nb) return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: added-token matches for %zu bytes", W);
        sc->best[lv] = nb;
        sc->best_cap[lv] = W;
    }
    uint32_t *const best = sc->best[lv];
    size_t start_offset = 0, i = 0, blk_a = 0, blk_b = 0;
    ds4_status st;
    while (i < n) {
        if (!tr->starts[p[i]]) {
            i++;
            continue;
        }
        if (i >= blk_b) {
            blk_a = i;
            blk_b = n - i > W ? i + W : n;
            trie_matches(tr, p, n, blk_a, blk_b, best);
        }
        const uint32_t node = best[i - blk_a];
        if (!node) {
            i++;
            continue;
        }
        const int32_t id = tr->nodes[node].id;
        const uint8_t fl = tr->nodes[node].flags;
        size_t start = i, stop = i + tr->nodes[node].depth;
        i = stop; /* the automaton resumes after the match even when a rule below discards it */
        if (fl & AT_SINGLE_WORD) {
            uint32_t cp;
            int start_space = start == 0 || !(last_char(p, start, &cp) && is_word_char(cp));
            int stop_space = stop == n || !(utf8_char(p + stop, n - stop, &cp) && is_word_char(cp));
            if (!start_space || !stop_space) continue;
        }
        if (fl & AT_LSTRIP) {
            size_t ns = start;
            uint32_t cp;
            while (ns > 0 && last_char(p, ns, &cp) && is_white_space(cp)) {
                size_t cl = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
                ns -= cl;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (fl & AT_RSTRIP) {
            uint32_t cp;
            size_t cl;
            while (stop < n && (cl = utf8_char(p + stop, n - stop, &cp)) && is_white_space(cp)) stop += cl;
        }
        if (start_offset < start && (st = text(e, p + start_offset, start - start_offset))) return st;
        if ((st = push_id(e, id))) return st;
        start_offset = stop;
    }
    if (start_offset < n) return text(e, p + start_offset, n - start_offset);
    return DS4_OK;
}

/* A stretch between raw-matched added tokens: normalise it, then cut out the normalised added tokens. */
static ds4_status normalized_text(enc *e, const uint8_t *p, size_t n) {
    const ds4_tokenizer *t = e->t;
    if (t->norm == NORM_NFC) {
        /* No byte >= 0xCC means no character >= U+0300: such text is NFC already (every character below
         * U+0300 is NFC_QC=Yes and only composes with a following mark at U+0300 or above). */
        size_t i = 0;
        while (i < n && p[i] < 0xCC) i++;
        if (i < n) {
            tok_scratch *s = e->s;
            size_t o = 0, pos = 0;
            while (pos < n) {
                size_t v = e->valid ? n - pos : utf8_valid_prefix(p + pos, n - pos);
                if (v) {
                    utf8proc_uint8_t *dst = NULL;
                    utf8proc_ssize_t r = utf8proc_map(p + pos, (utf8proc_ssize_t)v, &dst,
                                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
                    if (r < 0) {
                        free(dst);
                        return ds4_fail(e->err, r == UTF8PROC_ERROR_NOMEM ? DS4_ERR_OOM : DS4_ERR_INTERNAL,
                                        "tokenizer encode: NFC of a %zu-byte stretch failed (utf8proc: %s)", v,
                                        utf8proc_errmsg(r));
                    }
                    if (!grow_bytes(&s->norm, &s->norm_cap, o + (size_t)r + 1)) {
                        free(dst);
                        return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: NFC buffer of %zu bytes", o + (size_t)r);
                    }
                    memcpy(s->norm + o, dst, (size_t)r);
                    free(dst);
                    o += (size_t)r;
                    pos += v;
                } else {
                    size_t bad = utf8_invalid_run(p + pos, n - pos);
                    if (!grow_bytes(&s->norm, &s->norm_cap, o + bad + 1))
                        return ds4_fail(e->err, DS4_ERR_OOM, "tokenizer encode: NFC buffer of %zu bytes", o + bad);
                    memcpy(s->norm + o, p + pos, bad);
                    o += bad;
                    pos += bad;
                }
            }
            p = s->norm;
            n = o;
        }
    }
    return split_added(e, &t->trie_norm, p, n, pretok_text);
}

ds4_status ds4_tokenizer_encode(const ds4_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                                ds4_tokens *out, ds4_error *err) {
    if (!tok || !out || (!text && len))
        return ds4_fail(err, DS4_ERR_ARG, "tokenizer encode: NULL %s", !tok ? "tokenizer" : !out ? "output" : "text");
    if (flags & ~DS4_TOK_ADD_BOS)
        return ds4_fail(err, DS4_ERR_ARG, "tokenizer encode: unknown flags 0x%x", (unsigned)(flags & ~DS4_TOK_ADD_BOS));
    size_t n0 = out->n;
    enc e = {tok, NULL, out, 0, err};
    ds4_status st = DS4_OK;
    if (flags & DS4_TOK_ADD_BOS) {
        int32_t bos = ds4_tokenizer_special_id(tok, "bos");
        if (bos < 0)
            return ds4_fail(err, DS4_ERR_NOT_FOUND, "tokenizer encode: BOS requested but the tokenizer has no %s token",
                            SPECIAL_NAMES[0].content);
        if ((st = push_id(&e, bos))) return st;
    }
    if (len == 0) return DS4_OK;
    const uint8_t *p = (const uint8_t *)text;
    e.valid = utf8_valid_prefix(p, len) == len;
    e.s = scratch_acquire(tok);
    if (!e.s) {
        out->n = n0;
        return ds4_fail(err, DS4_ERR_OOM, "tokenizer encode: cannot allocate per-call scratch");
    }
    st = split_added(&e, &tok->trie_raw, p, len, normalized_text);
    scratch_release(tok, e.s);
    if (st) out->n = n0;
    return st;
}

void ds4_tokens_free(ds4_tokens *t) {
    if (!t) return;
    free(t->ids);
    t->ids = NULL;
    t->n = t->cap = 0;
}

/* ------------------------------------------------------------------------------------------------ decode & lookups */

static int id_ok(const ds4_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_ids && (t->id_flags[id] & ID_ASSIGNED);
}

ds4_status ds4_tokenizer_decode(const ds4_tokenizer *tok, const int32_t *ids, size_t n, uint32_t flags, char **text,
                                size_t *len, ds4_error *err) {
    if (!tok || !text || (!ids && n))
        return ds4_fail(err, DS4_ERR_ARG, "tokenizer decode: NULL %s", !tok ? "tokenizer" : !text ? "output" : "ids");
    if (flags & ~DS4_TOK_SKIP_SPECIAL)
        return ds4_fail(err, DS4_ERR_ARG, "tokenizer decode: unknown flags 0x%x", (unsigned)(flags & ~DS4_TOK_SKIP_SPECIAL));
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (!id_ok(tok, id))
            return ds4_fail(err, DS4_ERR_ARG, "tokenizer decode: ids[%zu] = %ld is not a token id (vocabulary size %ld)", i,
                            (long)id, (long)tok->n_ids);
        if ((flags & DS4_TOK_SKIP_SPECIAL) && (tok->id_flags[id] & ID_SPECIAL)) continue;
        if (!ds4_add_size(total, tok->dec_len[id], &total))
            return ds4_fail(err, DS4_ERR_ARG, "tokenizer decode: the decoded text of %zu ids overflows size_t", n);
    }
    if (total == (size_t)-1) return ds4_fail(err, DS4_ERR_OOM, "tokenizer decode: %zu bytes", total);
    char *buf = malloc(total + 1);
    if (!buf) return ds4_fail(err, DS4_ERR_OOM, "tokenizer decode: cannot allocate %zu bytes", total + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if ((flags & DS4_TOK_SKIP_SPECIAL) && (tok->id_flags[id] & ID_SPECIAL)) continue;
        memcpy(buf + o, tok->arena + tok->dec_off[id], tok->dec_len[id]);
        o += tok->dec_len[id];
    }
    buf[o] = 0;
    *text = buf;
    if (len) *len = o;
    return DS4_OK;
}

int32_t ds4_tokenizer_vocab_size(const ds4_tokenizer *tok) { return tok ? tok->n_ids : 0; }

int32_t ds4_tokenizer_token_to_id(const ds4_tokenizer *tok, const char *token, size_t len) {
    if (!tok || (!token && len)) return -1;
    /* HF's token_to_id: the added vocabulary first, then the model */
    int32_t id = bmap_get(&tok->added, tok->arena, token, len);
    return id >= 0 ? id : bmap_get(&tok->model, tok->arena, token, len);
}

const char *ds4_tokenizer_id_to_token(const ds4_tokenizer *tok, int32_t id, size_t *len) {
    if (!id_ok(tok, id)) return NULL;
    if (len) *len = tok->tok_len[id];
    return tok->arena + tok->tok_off[id];
}

const char *ds4_tokenizer_id_bytes(const ds4_tokenizer *tok, int32_t id, size_t *len) {
    if (!id_ok(tok, id)) return NULL;
    if (len) *len = tok->dec_len[id];
    return tok->arena + tok->dec_off[id];
}

int ds4_tokenizer_is_special(const ds4_tokenizer *tok, int32_t id) {
    return id_ok(tok, id) && (tok->id_flags[id] & ID_SPECIAL) ? 1 : 0;
}

const char *ds4_tokenizer_special_content(const char *name) {
    if (!name) return NULL;
    for (size_t i = 0; i < N_SPECIAL_NAMES; i++)
        if (strcmp(SPECIAL_NAMES[i].name, name) == 0) return SPECIAL_NAMES[i].content;
    return NULL;
}

int32_t ds4_tokenizer_special_id(const ds4_tokenizer *tok, const char *name) {
    const char *c = ds4_tokenizer_special_content(name);
    return c ? ds4_tokenizer_token_to_id(tok, c, strlen(c)) : -1;
}

const char *ds4_tokenizer_special_name_at(size_t i) { return i < N_SPECIAL_NAMES ? SPECIAL_NAMES[i].name : NULL; }

/* ------------------------------------------------------------------------------------------------ free */

void ds4_tokenizer_free(ds4_tokenizer *t) {
    if (!t) return;
    free(t->json);
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->dec_off);
    free(t->dec_len);
    free(t->id_flags);
    free(t->model.e);
    free(t->added.e);
    free(t->raw.e);
    free(t->merges);
    free(t->trie_raw.nodes);
    free(t->trie_norm.nodes);
    for (int32_t i = 0; i < t->n_stages; i++) pcre2_code_free(t->stages[i].re.code);
    pcre2_code_free(t->gpt2.code);
    if (t->pool) {
        tok_scratch *s = t->pool->free_list;
        while (s) {
            tok_scratch *nx = s->next;
            scratch_free(s);
            s = nx;
        }
        pthread_mutex_destroy(&t->pool->mu);
        free(t->pool);
    }
    free(t);
}

/* ------------------------------------------------------------------------------------------------ load */

typedef struct loader {
    ds4_tokenizer *t;
    ds4_error *err;
} loader;

static ds4_status oom(loader *L, const char *what) {
    return ds4_fail(L->err, DS4_ERR_OOM, "tokenizer: out of memory (%s)", what);
}

/* Append bytes + NUL to the arena; *off receives their offset. */
static int arena_add(ds4_tokenizer *t, const void *b, size_t n, uint32_t *off) {
    size_t need = t->arena_len + n + 1;
    if (need > UINT32_MAX) return 0;
    if (need > t->arena_cap) {
        size_t nc = t->arena_cap ? t->arena_cap : 4096;
        while (nc < need) nc *= 2;
        char *na = realloc(t->arena, nc);
        if (!na) return 0;
        t->arena = na;
        t->arena_cap = nc;
    }
    memcpy(t->arena + t->arena_len, b, n);
    t->arena[t->arena_len + n] = 0;
    *off = (uint32_t)t->arena_len;
    t->arena_len = need;
    return 1;
}

/* Quote a JSON string value for an error message: control bytes, quotes and backslashes escaped, cut (at a
 * character boundary) to fit cap, which must be at least 16. */
static const char *quote(char *buf, size_t cap, const char *s, size_t n) {
    size_t o = 0;
    buf[o++] = '"';
    for (size_t i = 0; i < n; i++) {
        if (o + 9 > cap) {
            while (o > 1 && ((unsigned char)buf[o - 1] & 0xC0) == 0x80) o--;
            if (o > 1 && ((unsigned char)buf[o - 1] & 0xC0) == 0xC0) o--;
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == '"' || c == '\\') {
            snprintf(buf + o, cap - o, "\\x%02x", c);
            o += 4;
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o++] = '"';
    buf[o] = 0;
    return buf;
}

static const char *type_name(const ds4_json *v) {
    if (!v) return "absent";
    switch (v->type) {
    case DS4_JSON_NULL: return "null";
    case DS4_JSON_BOOL: return "a boolean";
    case DS4_JSON_NUMBER: return "a number";
    case DS4_JSON_STRING: return "a string";
    case DS4_JSON_ARRAY: return "an array";
    case DS4_JSON_OBJECT: return "an object";
    }
    return "?";
}

/* A boolean field: absent or null gives def. */
static ds4_status get_bool(loader *L, const ds4_json *o, const char *key, int def, int *out, const char *path) {
    const ds4_json *v = ds4_json_get(o, key);
    if (!v || v->type == DS4_JSON_NULL) {
        *out = def;
        return DS4_OK;
    }
    if (v->type != DS4_JSON_BOOL)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.%s must be a boolean (got %s)", path, key, type_name(v));
    *out = v->boolean;
    return DS4_OK;
}

/* A field that must be absent or null (an option this tokenizer does not implement otherwise). */
static ds4_status want_null(loader *L, const ds4_json *o, const char *key, const char *path) {
    const ds4_json *v = ds4_json_get(o, key);
    if (v && v->type != DS4_JSON_NULL)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: %s%s%s = %s is not supported (only null)", path,
                        *path ? "." : "", key, type_name(v));
    return DS4_OK;
}

static const ds4_json *get_type(loader *L, const ds4_json *o, const char *path, ds4_status *st) {
    if (!o || o->type != DS4_JSON_OBJECT) {
        *st = ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s must be an object (got %s)", path, type_name(o));
        return NULL;
    }
    const ds4_json *ty = ds4_json_get(o, "type");
    if (!ty || ty->type != DS4_JSON_STRING) {
        *st = ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.type must be a string (got %s)", path, type_name(ty));
        return NULL;
    }
    *st = DS4_OK;
    return ty;
}

static ds4_status parse_normalizer(loader *L, const ds4_json *v, const char *path, int depth) {
    if (!v || v->type == DS4_JSON_NULL) return DS4_OK;
    ds4_status st;
    const ds4_json *ty = get_type(L, v, path, &st);
    if (!ty) return st;
    if (strcmp(ty->str, "NFC") == 0) {
        L->t->norm = NORM_NFC;
        return DS4_OK;
    }
    if (strcmp(ty->str, "Sequence") == 0 && depth < TOK_MAX_NEST) {
        const ds4_json *list = ds4_json_get(v, "normalizers");
        if (!list || list->type != DS4_JSON_ARRAY)
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.normalizers must be an array (got %s)", path,
                            type_name(list));
        for (size_t i = 0; i < list->count; i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.normalizers[%zu]", path, i);
            if ((st = parse_normalizer(L, &list->items[i], sub, depth + 1))) return st;
        }
        return DS4_OK;
    }
    char q[96];
    return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: %s.type %s is not supported (supported: NFC, a Sequence of NFC, null)",
                    path, quote(q, sizeof q, ty->str, ty->str_len));
}

static ds4_status parse_pretok(loader *L, const ds4_json *v, const char *path, int depth) {
    ds4_tokenizer *t = L->t;
    ds4_status st;
    const ds4_json *ty = get_type(L, v, path, &st);
    if (!ty) return st;
    const char *type = ty->str;
    char q[96];
    if (strcmp(type, "Sequence") == 0) {
        if (depth >= TOK_MAX_NEST)
            return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: %s: Sequences nested deeper than %d", path, TOK_MAX_NEST);
        const ds4_json *list = ds4_json_get(v, "pretokenizers");
        if (!list || list->type != DS4_JSON_ARRAY)
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.pretokenizers must be an array (got %s)", path,
                            type_name(list));
        for (size_t i = 0; i < list->count; i++) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%zu]", path, i);
            if ((st = parse_pretok(L, &list->items[i], sub, depth + 1))) return st;
        }
        return DS4_OK;
    }
    int is_split = strcmp(type, "Split") == 0, is_digits = strcmp(type, "Digits") == 0;
    int is_bl = strcmp(type, "ByteLevel") == 0;
    if (!is_split && !is_digits && !is_bl)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED,
                        "tokenizer: %s.type %s is not supported (supported: Sequence, Split, Digits, ByteLevel)", path,
                        quote(q, sizeof q, type, ty->str_len));
    if (t->gpt2.code || t->bl_use_regex < 0)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED,
                        "tokenizer: %s: %s after ByteLevel is not supported (ByteLevel must be the last pre-tokenizer)", path,
                        type);
    if (is_bl) {
        int aps, ur;
        if ((st = get_bool(L, v, "add_prefix_space", 1, &aps, path)) || (st = get_bool(L, v, "use_regex", 1, &ur, path)))
            return st;
        int trim;
        if ((st = get_bool(L, v, "trim_offsets", 1, &trim, path))) return st; /* offsets only: checked, unused */
        t->bl_prefix_space = aps;
        t->bl_use_regex = ur ? 1 : -1; /* -1: ByteLevel seen, no regex */
        if (ur && (st = compile_regex(GPT2_REGEX, sizeof GPT2_REGEX - 1, 0, &t->gpt2, "ByteLevel GPT-2 regex", L->err)))
            return st;
        return DS4_OK;
    }
    if (t->n_stages >= TOK_MAX_STAGES)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: %s: more than %d pre-tokenizer steps", path, TOK_MAX_STAGES);
    stage *sg = &t->stages[t->n_stages];
    memset(sg, 0, sizeof *sg);
    if (is_digits) {
        int ind;
        if ((st = get_bool(L, v, "individual_digits", 0, &ind, path))) return st;
        sg->kind = ST_DIGITS;
        sg->beh = ind ? B_ISOLATED : B_CONTIGUOUS;
        t->n_stages++;
        return DS4_OK;
    }
    /* Split */
    const ds4_json *pat = ds4_json_get(v, "pattern");
    if (!pat || pat->type != DS4_JSON_OBJECT || pat->count != 1)
        return ds4_fail(L->err, DS4_ERR_FORMAT,
                        "tokenizer: %s.pattern must be an object with one member, \"Regex\" or \"String\" (got %s)", path,
                        type_name(pat));
    int literal;
    if (strcmp(pat->keys[0], "Regex") == 0) literal = 0;
    else if (strcmp(pat->keys[0], "String") == 0) literal = 1;
    else
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: %s.pattern.%s is not supported (supported: Regex, String)",
                        path, quote(q, sizeof q, pat->keys[0], strlen(pat->keys[0])));
    const ds4_json *ps = &pat->items[0];
    if (ps->type != DS4_JSON_STRING)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.pattern.%s must be a string (got %s)", path, pat->keys[0],
                        type_name(ps));
    const ds4_json *bv = ds4_json_get(v, "behavior");
    if (!bv || bv->type != DS4_JSON_STRING)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.behavior must be a string (got %s)", path, type_name(bv));
    static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    int beh = -1;
    for (int i = 0; i < 5; i++)
        if (strcmp(bv->str, names[i]) == 0) beh = i;
    if (beh < 0)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED,
                        "tokenizer: %s.behavior %s is not supported (supported: Removed, Isolated, MergedWithPrevious, "
                        "MergedWithNext, Contiguous)",
                        path, quote(q, sizeof q, bv->str, bv->str_len));
    int inv;
    if ((st = get_bool(L, v, "invert", 0, &inv, path))) return st;
    char where[300];
    snprintf(where, sizeof where, "%s.pattern.%s", path, pat->keys[0]);
    if ((st = compile_regex(ps->str, ps->str_len, literal, &sg->re, where, L->err))) return st;
    sg->kind = ST_REGEX;
    sg->beh = (behavior)beh;
    sg->invert = inv;
    t->n_stages++;
    return DS4_OK;
}

static ds4_status parse_decoder(loader *L, const ds4_json *v) {
    if (!v || v->type == DS4_JSON_NULL) return DS4_OK;
    ds4_status st;
    const ds4_json *ty = get_type(L, v, "decoder", &st);
    if (!ty) return st;
    if (strcmp(ty->str, "ByteLevel") != 0) {
        char q[96];
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: decoder.type %s is not supported (supported: ByteLevel, null)",
                        quote(q, sizeof q, ty->str, ty->str_len));
    }
    return DS4_OK;
}

/* Decoded bytes of a token text: ByteLevel's char -> byte map when every character has one, else the text
 * itself (HF's ByteLevel decoder does the same per token). */
static int add_decoded(ds4_tokenizer *t, uint32_t off, uint32_t len, uint32_t *doff, uint32_t *dlen, int *mapped) {
    uint8_t stack_buf[256];
    uint8_t *buf = len <= sizeof stack_buf ? stack_buf : malloc(len);
    if (!buf) return 0;
    /* work in buf: arena_add below may move the arena that s points into */
    const uint8_t *s = (const uint8_t *)t->arena + off;
    size_t o = 0, i = 0;
    int ok = 1;
    while (i < len) {
        uint32_t cp;
        size_t l = utf8_char(s + i, len - i, &cp);
        int b = l ? cp_to_byte(cp) : -1;
        if (b < 0) {
            ok = 0;
            break;
        }
        buf[o++] = (uint8_t)b;
        i += l;
    }
    if (!ok) {
        memcpy(buf, s, len);
        o = len;
    }
    int r = arena_add(t, buf, o, doff);
    *dlen = (uint32_t)o;
    *mapped = ok;
    if (buf != stack_buf) free(buf);
    return r;
}

typedef struct vocab_item {
    uint32_t off, len;
    int32_t id;
} vocab_item;

typedef struct atok {
    uint32_t off, len;
    int32_t id;
    uint8_t single_word, lstrip, rstrip, normalized, special;
} atok;

static ds4_status parse_model(loader *L, const ds4_json *m, vocab_item **items_out, size_t *n_items, int32_t *max_id) {
    ds4_tokenizer *t = L->t;
    ds4_status st;
    char q[96];
    if (!m || m->type != DS4_JSON_OBJECT)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model must be an object (got %s)", type_name(m));
    const ds4_json *ty = ds4_json_get(m, "type");
    if (ty && (ty->type != DS4_JSON_STRING || strcmp(ty->str, "BPE") != 0)) {
        if (ty->type != DS4_JSON_STRING)
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.type must be a string (got %s)", type_name(ty));
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: model.type %s is not supported (supported: BPE)",
                        quote(q, sizeof q, ty->str, ty->str_len));
    }
    const ds4_json *dr = ds4_json_get(m, "dropout");
    if (dr && dr->type != DS4_JSON_NULL && !(dr->type == DS4_JSON_NUMBER && dr->number == 0))
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: model.dropout = %s is not supported (only null or 0)",
                        dr->type == DS4_JSON_NUMBER ? "a non-zero number" : type_name(dr));
    if ((st = want_null(L, m, "unk_token", "model")) || (st = want_null(L, m, "continuing_subword_prefix", "model")) ||
        (st = want_null(L, m, "end_of_word_suffix", "model")))
        return st;
    int bf, fuse;
    if ((st = get_bool(L, m, "byte_fallback", 0, &bf, "model")) || (st = get_bool(L, m, "fuse_unk", 0, &fuse, "model")) ||
        (st = get_bool(L, m, "ignore_merges", 0, &t->ignore_merges, "model")))
        return st;
    if (bf) return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: model.byte_fallback = true is not supported");

    const ds4_json *vocab = ds4_json_get(m, "vocab");
    if (!vocab || vocab->type != DS4_JSON_OBJECT)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.vocab must be an object (got %s)", type_name(vocab));
    size_t nv = vocab->count;
    vocab_item *items = malloc((nv ? nv : 1) * sizeof *items);
    if (!items) return oom(L, "model.vocab");
    *items_out = items;
    *n_items = nv;
    if (!bmap_init(&t->model, nv)) return oom(L, "model.vocab map");
    int32_t mx = -1;
    for (size_t i = 0; i < nv; i++) {
        const char *key = vocab->keys[i];
        size_t kl = strlen(key);
        const ds4_json *iv = &vocab->items[i];
        if (iv->type != DS4_JSON_NUMBER || !iv->is_int || iv->integer < 0 || iv->integer >= TOK_MAX_ID)
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.vocab[%s] must be an integer id in [0, %ld) (got %s)",
                            quote(q, sizeof q, key, kl), (long)TOK_MAX_ID,
                            iv->type == DS4_JSON_NUMBER ? "a number outside that range" : type_name(iv));
        uint32_t off;
        if (!arena_add(t, key, kl, &off)) return oom(L, "model.vocab strings");
        items[i].off = off;
        items[i].len = (uint32_t)kl;
        items[i].id = (int32_t)iv->integer;
        if (items[i].id > mx) mx = items[i].id;
        if (!bmap_put(&t->model, t->arena, off, (uint32_t)kl, items[i].id)) return oom(L, "model.vocab map");
    }
    *max_id = mx;

    /* merges: "a b" strings (HF's legacy form: exactly one space; "#version" lines skipped) or [a, b] pairs */
    const ds4_json *merges = ds4_json_get(m, "merges");
    if (merges && merges->type != DS4_JSON_ARRAY && merges->type != DS4_JSON_NULL)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.merges must be an array (got %s)", type_name(merges));
    size_t nm = merges && merges->type == DS4_JSON_ARRAY ? merges->count : 0;
    size_t cap = 16;
    while (cap < nm * 2 + 16) cap <<= 1;
    if (cap > ((size_t)1 << 31)) return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.merges: too many merges (%zu)", nm);
    t->merges = malloc(cap * sizeof *t->merges);
    if (!t->merges) return oom(L, "model.merges");
    for (size_t i = 0; i < cap; i++) t->merges[i].key = MERGE_EMPTY;
    t->merge_mask = (uint32_t)(cap - 1);
    uint8_t *cat = NULL;
    size_t cat_cap = 0;
    uint32_t rank = 0;
    for (size_t i = 0; i < nm; i++) {
        const ds4_json *it = &merges->items[i];
        const char *a, *b;
        size_t al, bl;
        if (it->type == DS4_JSON_STRING) {
            if (it->str_len >= 8 && memcmp(it->str, "#version", 8) == 0) continue;
            const char *sp = memchr(it->str, ' ', it->str_len);
            if (!sp || memchr(sp + 1, ' ', it->str_len - (size_t)(sp + 1 - it->str))) {
                free(cat);
                return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.merges[%zu] = %s must be two tokens separated by one space",
                                i, quote(q, sizeof q, it->str, it->str_len));
            }
            a = it->str;
            al = (size_t)(sp - it->str);
            b = sp + 1;
            bl = it->str_len - al - 1;
        } else if (it->type == DS4_JSON_ARRAY && it->count == 2 && it->items[0].type == DS4_JSON_STRING &&
                   it->items[1].type == DS4_JSON_STRING) {
            a = it->items[0].str;
            al = it->items[0].str_len;
            b = it->items[1].str;
            bl = it->items[1].str_len;
        } else {
            free(cat);
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.merges[%zu] must be a string \"a b\" or a pair [\"a\", \"b\"] (got %s)",
                            i, type_name(it));
        }
        int32_t ia = bmap_get(&t->model, t->arena, a, al), ib = bmap_get(&t->model, t->arena, b, bl);
        if (!grow_bytes(&cat, &cat_cap, al + bl + 1)) {
            free(cat);
            return oom(L, "model.merges");
        }
        memcpy(cat, a, al);
        memcpy(cat + al, b, bl);
        int32_t in = bmap_get(&t->model, t->arena, cat, al + bl);
        if (ia < 0 || ib < 0 || in < 0) {
            const char *miss = ia < 0 ? a : ib < 0 ? b : (const char *)cat;
            size_t ml = ia < 0 ? al : ib < 0 ? bl : al + bl;
            ds4_status r = ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.merges[%zu]: token %s is not in model.vocab", i,
                                    quote(q, sizeof q, miss, ml));
            free(cat);
            return r;
        }
        uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
        size_t s = merge_slot(key, t->merge_mask);
        while (t->merges[s].key != MERGE_EMPTY && t->merges[s].key != key) s = (s + 1) & t->merge_mask;
        /* a repeated pair takes the later rank, as HF's collect() into a HashMap does */
        t->merges[s].key = key;
        t->merges[s].rank = rank++;
        t->merges[s].new_id = in;
    }
    free(cat);
    return DS4_OK;
}

/* HF's AddedVocabulary::add_tokens, one token at a time as its tokenizer.json reader calls it. */
static ds4_status parse_added(loader *L, const ds4_json *list, size_t vocab_len, atok **out, size_t *n_out,
                              int32_t *max_id) {
    ds4_tokenizer *t = L->t;
    ds4_status st;
    char path[96];
    *out = NULL;
    *n_out = 0;
    if (!list || list->type == DS4_JSON_NULL) return DS4_OK;
    if (list->type != DS4_JSON_ARRAY)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: added_tokens must be an array (got %s)", type_name(list));
    atok *toks = malloc((list->count ? list->count : 1) * sizeof *toks);
    if (!toks) return oom(L, "added_tokens");
    *out = toks;
    bmap special;  /* special contents (HF's special_tokens_set) -> 1 */
    if (!bmap_init(&special, 16)) return oom(L, "added_tokens");
    size_t n = 0;
    int32_t amax = -1; /* largest id in the added map (HF's added_tokens_map.values().max()) */
    int32_t mx = *max_id;
    for (size_t i = 0; i < list->count; i++) {
        const ds4_json *o = &list->items[i];
        snprintf(path, sizeof path, "added_tokens[%zu]", i);
        if (o->type != DS4_JSON_OBJECT) {
            free(special.e);
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s must be an object (got %s)", path, type_name(o));
        }
        const ds4_json *c = ds4_json_get(o, "content"), *idv = ds4_json_get(o, "id");
        if (!c || c->type != DS4_JSON_STRING) {
            free(special.e);
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.content must be a string (got %s)", path, type_name(c));
        }
        if (!idv || idv->type != DS4_JSON_NUMBER || !idv->is_int || idv->integer < 0 || idv->integer > UINT32_MAX) {
            free(special.e);
            return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s.id must be a non-negative integer (got %s)", path,
                            idv && idv->type == DS4_JSON_NUMBER ? "a number outside [0, 2^32)" : type_name(idv));
        }
        int sw, ls, rs, nz, sp;
        if ((st = get_bool(L, o, "single_word", 0, &sw, path)) || (st = get_bool(L, o, "lstrip", 0, &ls, path)) ||
            (st = get_bool(L, o, "rstrip", 0, &rs, path)) || (st = get_bool(L, o, "normalized", 1, &nz, path)) ||
            (st = get_bool(L, o, "special", 0, &sp, path))) {
            free(special.e);
            return st;
        }
        if (c->str_len == 0) continue; /* HF ignores empty tokens */
        uint32_t off;
        if (!arena_add(t, c->str, c->str_len, &off)) {
            free(special.e);
            return oom(L, "added_tokens");
        }
        uint32_t len = (uint32_t)c->str_len;
        if (sp && bmap_get(&special, t->arena, c->str, len) < 0 && !bmap_put(&special, t->arena, off, len, 1)) {
            free(special.e);
            return oom(L, "added_tokens");
        }
        int32_t prev = bmap_get(&t->added, t->arena, c->str, len);
        if (prev >= 0) {
            /* an identical token (every field) is ignored */
            size_t k = n;
            while (k > 0 && !(toks[k - 1].id == prev && toks[k - 1].len == len &&
                              memcmp(t->arena + toks[k - 1].off, c->str, len) == 0))
                k--;
            if (k > 0) {
                atok *pt = &toks[k - 1];
                if (pt->single_word == sw && pt->lstrip == ls && pt->rstrip == rs && pt->normalized == nz && pt->special == sp)
                    continue;
            }
        }
        int32_t id = prev >= 0 ? prev : bmap_get(&t->model, t->arena, c->str, len);
        if (id < 0) {
            /* a new id after the model vocabulary or after the largest added id */
            int64_t nid = amax < 0 ? (int64_t)vocab_len
                                   : ((size_t)amax >= vocab_len || vocab_len == 0) ? (int64_t)amax + 1 : (int64_t)vocab_len;
            if (nid >= TOK_MAX_ID) {
                free(special.e);
                return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: %s: the token would get id %lld, beyond the limit %ld", path,
                                (long long)nid, (long)TOK_MAX_ID);
            }
            id = (int32_t)nid;
        }
        if (!bmap_put(&t->added, t->arena, off, len, id)) {
            free(special.e);
            return oom(L, "added_tokens");
        }
        if (id > amax) amax = id;
        if (id > mx) mx = id;
        toks[n].off = off;
        toks[n].len = len;
        toks[n].id = id;
        toks[n].single_word = (uint8_t)sw;
        toks[n].lstrip = (uint8_t)ls;
        toks[n].rstrip = (uint8_t)rs;
        toks[n].normalized = (uint8_t)nz;
        toks[n].special = (uint8_t)sp;
        n++;
    }
    /* ids that are special: those whose token content is in the special set (HF's is_special_token) */
    for (size_t i = 0; i < n; i++)
        toks[i].special = bmap_get(&special, t->arena, t->arena + toks[i].off, toks[i].len) >= 0;
    free(special.e);
    *n_out = n;
    *max_id = mx;
    return DS4_OK;
}

/* Normalise an added token's content for the normalised trie (HF normalises the patterns too). */
static ds4_status norm_content(loader *L, const uint8_t *s, size_t n, uint8_t **out, size_t *olen) {
    *out = NULL;
    *olen = n;
    if (L->t->norm != NORM_NFC) return DS4_OK;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map(s, (utf8proc_ssize_t)n, &dst, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (r < 0) {
        free(dst);
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: added token content: NFC failed (utf8proc: %s)", utf8proc_errmsg(r));
    }
    *out = dst;
    *olen = (size_t)r;
    return DS4_OK;
}

static ds4_status build(loader *L, const ds4_json *root) {
    ds4_tokenizer *t = L->t;
    ds4_status st;
    char q[96];
    if (root->type != DS4_JSON_OBJECT)
        return ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: the document must be a JSON object (got %s)", type_name(root));
    const ds4_json *ver = ds4_json_get(root, "version");
    if (ver && (ver->type != DS4_JSON_STRING || strcmp(ver->str, "1.0") != 0))
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED, "tokenizer: version %s is not supported (only \"1.0\")",
                        ver->type == DS4_JSON_STRING ? quote(q, sizeof q, ver->str, ver->str_len) : type_name(ver));
    if ((st = want_null(L, root, "truncation", "")) || (st = want_null(L, root, "padding", ""))) return st;
    if ((st = parse_normalizer(L, ds4_json_get(root, "normalizer"), "normalizer", 0))) return st;
    const ds4_json *pt = ds4_json_get(root, "pre_tokenizer");
    if (!pt || pt->type == DS4_JSON_NULL)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED,
                        "tokenizer: pre_tokenizer is null: only byte-level BPE is supported (a ByteLevel pre-tokenizer as the "
                        "last step)");
    if ((st = parse_pretok(L, pt, "pre_tokenizer", 0))) return st;
    if (t->bl_use_regex == 0)
        return ds4_fail(L->err, DS4_ERR_UNSUPPORTED,
                        "tokenizer: pre_tokenizer has no ByteLevel step: only byte-level BPE is supported (ByteLevel as the "
                        "last pre-tokenizer)");
    if (t->bl_use_regex < 0) t->bl_use_regex = 0;
    if ((st = parse_decoder(L, ds4_json_get(root, "decoder")))) return st;

    vocab_item *items = NULL;
    atok *added = NULL;
    size_t nv = 0, na = 0;
    int32_t mx = -1;
    uint8_t *nbuf = NULL;
    if (!bmap_init(&t->added, 16)) return oom(L, "added_tokens");
    st = parse_model(L, ds4_json_get(root, "model"), &items, &nv, &mx);
    if (!st) st = parse_added(L, ds4_json_get(root, "added_tokens"), nv, &added, &na, &mx);
    if (st) goto done;
    if (mx < 0) {
        st = ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.vocab is empty and there are no added tokens");
        goto done;
    }
    t->n_ids = mx + 1;
    size_t nid = (size_t)t->n_ids;
    t->tok_off = calloc(nid, sizeof *t->tok_off);
    t->tok_len = calloc(nid, sizeof *t->tok_len);
    t->dec_off = calloc(nid, sizeof *t->dec_off);
    t->dec_len = calloc(nid, sizeof *t->dec_len);
    t->id_flags = calloc(nid, 1);
    if (!t->tok_off || !t->tok_len || !t->dec_off || !t->dec_len || !t->id_flags) {
        st = oom(L, "per-id tables");
        goto done;
    }
    /* HF's vocab_r is built from the vocab map: two tokens with one id would make it depend on hash order */
    for (size_t i = 0; i < nv; i++) {
        int32_t id = items[i].id;
        if (t->id_flags[id] & ID_ASSIGNED) {
            char q2[96];
            st = ds4_fail(L->err, DS4_ERR_FORMAT, "tokenizer: model.vocab: id %ld is given to both %s and %s", (long)id,
                          quote(q, sizeof q, t->arena + t->tok_off[id], t->tok_len[id]),
                          quote(q2, sizeof q2, t->arena + items[i].off, items[i].len));
            goto done;
        }
        t->id_flags[id] = ID_ASSIGNED;
        t->tok_off[id] = items[i].off;
        t->tok_len[id] = items[i].len;
    }
    /* added tokens override the model's text of their id (HF's id_to_token asks the added vocabulary first) */
    for (size_t i = 0; i < na; i++) {
        int32_t id = added[i].id;
        t->id_flags[id] = (uint8_t)(ID_ASSIGNED | (added[i].special ? ID_SPECIAL : 0));
        t->tok_off[id] = added[i].off;
        t->tok_len[id] = added[i].len;
    }
    if (t->ignore_merges && !bmap_init(&t->raw, nv)) {
        st = oom(L, "ignore_merges map");
        goto done;
    }
    for (size_t id = 0; id < nid; id++) {
        if (!(t->id_flags[id] & ID_ASSIGNED)) continue;
        int mapped;
        if (!add_decoded(t, t->tok_off[id], t->tok_len[id], &t->dec_off[id], &t->dec_len[id], &mapped)) {
            st = oom(L, "decoded tokens");
            goto done;
        }
    }
    if (t->ignore_merges) {
        /* model tokens only, keyed by their raw bytes: what a byte-level piece can equal */
        for (size_t i = 0; i < nv; i++) {
            uint32_t doff, dlen;
            int mapped;
            if (!add_decoded(t, items[i].off, items[i].len, &doff, &dlen, &mapped)) {
                st = oom(L, "ignore_merges map");
                goto done;
            }
            if (mapped && !bmap_put(&t->raw, t->arena, doff, dlen, items[i].id)) {
                st = oom(L, "ignore_merges map");
                goto done;
            }
        }
    }
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_to_cp((uint32_t)b);
        char u[2];
        size_t ul;
        if (cp < 0x80) {
            u[0] = (char)cp;
            ul = 1;
        } else {
            u[0] = (char)(0xC0 | (cp >> 6));
            u[1] = (char)(0x80 | (cp & 0x3F));
            ul = 2;
        }
        t->byte_id[b] = bmap_get(&t->model, t->arena, u, ul);
    }
    /* the added-token tries: one entry per content, with the flags of the token that holds its id */
    if (!trie_init(&t->trie_raw) || !trie_init(&t->trie_norm)) {
        st = oom(L, "added-token trie");
        goto done;
    }
    for (size_t i = 0; i < na; i++) {
        atok *a = &added[i];
        int32_t id = bmap_get(&t->added, t->arena, t->arena + a->off, a->len);
        if (id != a->id) continue; /* superseded */
        uint8_t fl = (uint8_t)((a->single_word ? AT_SINGLE_WORD : 0) | (a->lstrip ? AT_LSTRIP : 0) | (a->rstrip ? AT_RSTRIP : 0));
        if (!a->normalized) {
            if (!trie_insert(&t->trie_raw, (const uint8_t *)t->arena + a->off, a->len, id, fl)) {
                st = oom(L, "added-token trie");
                goto done;
            }
            continue;
        }
        size_t nl;
        if ((st = norm_content(L, (const uint8_t *)t->arena + a->off, a->len, &nbuf, &nl))) goto done;
        const uint8_t *s = nbuf ? nbuf : (const uint8_t *)t->arena + a->off;
        if (!trie_insert(&t->trie_norm, s, nl, id, fl)) {
            st = oom(L, "added-token trie");
            goto done;
        }
        free(nbuf);
        nbuf = NULL;
    }
    if (!trie_build(&t->trie_raw) || !trie_build(&t->trie_norm)) {
        st = oom(L, "added-token automaton");
        goto done;
    }
    t->pool = calloc(1, sizeof *t->pool);
    if (!t->pool) {
        st = oom(L, "scratch pool");
        goto done;
    }
    if (pthread_mutex_init(&t->pool->mu, NULL) != 0) {
        free(t->pool);
        t->pool = NULL;
        st = ds4_fail(L->err, DS4_ERR_INTERNAL, "tokenizer: pthread_mutex_init failed");
        goto done;
    }
done:
    free(nbuf);
    free(items);
    free(added);
    return st;
}

ds4_status ds4_tokenizer_load_json(const char *json, size_t len, ds4_tokenizer **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "tokenizer: NULL output pointer");
    *out = NULL;
    if (!json && len) return ds4_fail(err, DS4_ERR_ARG, "tokenizer: NULL text");
    /* a large vocabulary with merges as [a, b] pairs is ~4 values per merge: allow 2^25 values */
    ds4_json_limits lim = {64, (size_t)1 << 25};
    ds4_json *root = ds4_json_parse(json ? json : "", len, &lim, err);
    if (!root) {
        ds4_error_prefix(err, "tokenizer: ");
        return err ? err->code : DS4_ERR_FORMAT;
    }
    ds4_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        ds4_json_free(root);
        return ds4_fail(err, DS4_ERR_OOM, "tokenizer: out of memory");
    }
    loader L = {t, err};
    ds4_status st = build(&L, root);
    ds4_json_free(root);
    /* Kept verbatim: a saved model writes it next to its weights (tokenizer.json), so that what loads the model
     * back gets this tokenizer, id for id, whatever this loader ignored (post_processor, ...). */
    if (!st && !(t->json = malloc(len ? len : 1))) st = ds4_fail(err, DS4_ERR_OOM, "tokenizer: out of memory");
    if (st) {
        ds4_tokenizer_free(t);
        return st;
    }
    if (len) memcpy(t->json, json, len);
    t->json_len = len;
    *out = t;
    return DS4_OK;
}

const char *ds4_tokenizer_json(const ds4_tokenizer *tok, size_t *len) {
    if (len) *len = tok ? tok->json_len : 0;
    return tok ? tok->json : NULL;
}

ds4_status ds4_tokenizer_load(const char *path, ds4_tokenizer **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "tokenizer: NULL output pointer");
    *out = NULL;
    if (!path) return ds4_fail(err, DS4_ERR_ARG, "tokenizer: NULL path");
    char *text = NULL;
    size_t len = 0;
    ds4_status st = ds4_read_file(path, TOK_MAX_FILE, &text, &len, err);
    if (st) {
        ds4_error_prefix(err, "tokenizer: ");
        return st;
    }
    st = ds4_tokenizer_load_json(text, len, out, err);
    free(text);
    if (st) ds4_error_prefix(err, "%s: ", path);
    return st;
}

/* The built-in tokenizer, written as a tokenizer.json and loaded like any other: one code path to trust. */
ds4_status ds4_tokenizer_byte_level(ds4_tokenizer **out, ds4_error *err) {
    size_t cap = 16384, o = 0;
    char *j = malloc(cap);
    if (!j) return ds4_fail(err, DS4_ERR_OOM, "tokenizer: byte_level: out of memory");
#define PUT(...)                                                        \
    do {                                                                \
        if (o < cap) o += (size_t)snprintf(j + o, cap - o, __VA_ARGS__); \
    } while (0)
    PUT("{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":[");
    for (size_t i = 0; i < N_SPECIAL_NAMES; i++)
        PUT("%s{\"id\":%zu,\"content\":\"%s\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
            "\"normalized\":false,\"special\":true}",
            i ? "," : "", 256 + i, SPECIAL_NAMES[i].content);
    PUT("],\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
        "\"trim_offsets\":false,\"use_regex\":false},\"post_processor\":null,\"decoder\":{\"type\":\"ByteLevel\","
        "\"add_prefix_space\":false,\"trim_offsets\":false,\"use_regex\":false},"
        "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"continuing_subword_prefix\":null,"
        "\"end_of_word_suffix\":null,\"fuse_unk\":false,\"byte_fallback\":false,\"ignore_merges\":false,\"vocab\":{");
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t cp = byte_to_cp(b);
        if (cp == '"' || cp == '\\') PUT("%s\"\\%c\":%u", b ? "," : "", (char)cp, b);
        else if (cp < 0x80) PUT("%s\"%c\":%u", b ? "," : "", (char)cp, b);
        else PUT("%s\"%c%c\":%u", b ? "," : "", (char)(0xC0 | (cp >> 6)), (char)(0x80 | (cp & 0x3F)), b);
    }
    PUT("},\"merges\":[]}}");
#undef PUT
    ds4_status st;
    if (o >= cap) st = ds4_fail(err, DS4_ERR_INTERNAL, "tokenizer: byte_level: JSON buffer too small (%zu bytes)", o);
    else st = ds4_tokenizer_load_json(j, o, out, err);
    free(j);
    return st;
}
