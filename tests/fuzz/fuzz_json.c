/* fuzz_json.c — libFuzzer target for ds4_json_parse.
 *
 * Beyond "no crash, no leak, no UB" it checks DOM invariants and a round trip: an accepted document is
 * re-serialised and must parse back to the same tree (so the parser neither loses nor invents data). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

typedef struct out {
    char *buf;
    size_t len, cap;
} out;

static void put(out *o, const char *s, size_t n) {
    if (o->len + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->len + n + 1) cap *= 2;
        char *nb = realloc(o->buf, cap);
        if (!nb) abort();
        o->buf = nb;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len] = 0;
}

static void put_str(out *o, const char *s, size_t n) {
    put(o, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            put(o, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            put(o, esc, 6);
        } else {
            put(o, (const char *)&s[i], 1);
        }
    }
    put(o, "\"", 1);
}

static void dump(out *o, const ds4_json *v) {
    char tmp[64];
    switch (v->type) {
    case DS4_JSON_NULL: put(o, "null", 4); break;
    case DS4_JSON_BOOL: put(o, v->boolean ? "true" : "false", v->boolean ? 4 : 5); break;
    case DS4_JSON_NUMBER:
        if (v->is_int)
            snprintf(tmp, sizeof tmp, "%lld", (long long)v->integer);
        else
            snprintf(tmp, sizeof tmp, "%.17g", v->number);
        /* %.17g of an integral double has no '.' and would come back as an exact integer. */
        if (!v->is_int && !strpbrk(tmp, ".e")) strcat(tmp, ".0");
        put(o, tmp, strlen(tmp));
        break;
    case DS4_JSON_STRING: put_str(o, v->str, v->str_len); break;
    case DS4_JSON_ARRAY:
        put(o, "[", 1);
        for (size_t i = 0; i < v->count; i++) {
            if (i) put(o, ",", 1);
            dump(o, &v->items[i]);
        }
        put(o, "]", 1);
        break;
    case DS4_JSON_OBJECT:
        put(o, "{", 1);
        for (size_t i = 0; i < v->count; i++) {
            if (i) put(o, ",", 1);
            put_str(o, v->keys[i], strlen(v->keys[i]));
            put(o, ":", 1);
            dump(o, &v->items[i]);
        }
        put(o, "}", 1);
        break;
    }
}

static void check(const ds4_json *v) {
    switch (v->type) {
    case DS4_JSON_NUMBER:
        if (!isfinite(v->number)) abort();
        if (v->is_int && v->number != (double)v->integer) abort();
        break;
    case DS4_JSON_STRING:
        if (!v->str || strlen(v->str) != v->str_len) abort();
        break;
    case DS4_JSON_ARRAY:
    case DS4_JSON_OBJECT:
        if (v->count && !v->items) abort();
        for (size_t i = 0; i < v->count; i++) {
            if (v->type == DS4_JSON_OBJECT && (!v->keys[i] || ds4_json_get(v, v->keys[i]) != &v->items[i])) abort();
            check(&v->items[i]);
        }
        break;
    default: break;
    }
}

static int same(const ds4_json *a, const ds4_json *b) {
    if (a->type != b->type) return 0;
    switch (a->type) {
    case DS4_JSON_NULL: return 1;
    case DS4_JSON_BOOL: return a->boolean == b->boolean;
    case DS4_JSON_NUMBER:
        return a->is_int == b->is_int && (a->is_int ? a->integer == b->integer : a->number == b->number);
    case DS4_JSON_STRING: return a->str_len == b->str_len && memcmp(a->str, b->str, a->str_len) == 0;
    case DS4_JSON_ARRAY:
    case DS4_JSON_OBJECT:
        if (a->count != b->count) return 0;
        for (size_t i = 0; i < a->count; i++) {
            if (a->type == DS4_JSON_OBJECT && strcmp(a->keys[i], b->keys[i]) != 0) return 0;
            if (!same(&a->items[i], &b->items[i])) return 0;
        }
        return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_error err;
    ds4_json_limits lim = {32, 4096};
    ds4_json *v = ds4_json_parse((const char *)data, size, &lim, &err);
    if (!v) {
        if (err.code != DS4_ERR_FORMAT || !strstr(err.msg, "byte offset")) abort();
        return 0;
    }
    check(v);
    out o = {NULL, 0, 0};
    dump(&o, v);
    ds4_json *w = ds4_json_parse(o.buf, o.len, &lim, &err);
    if (!w || !same(v, w)) abort();
    ds4_json_free(w);
    ds4_json_free(v);
    free(o.buf);
    return 0;
}
