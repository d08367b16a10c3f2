/* test_json.c — the strict JSON parser: every accept/reject rule of core/json.h, exact int64 edges, escape
 * decoding, limits, and a large object (duplicate detection must not be quadratic). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "json.h"
#include "testlib.h"

static ds4_json *parse_n(const char *text, size_t len, const ds4_json_limits *lim, ds4_error *err) {
    memset(err, 0, sizeof *err);
    return ds4_json_parse(text, len, lim, err);
}

/* Must parse; returns the document (caller frees). */
static ds4_json *accept_lim(const char *text, const ds4_json_limits *lim, int line) {
    ds4_error err;
    ds4_json *v = parse_n(text, strlen(text), lim, &err);
    CHECK(v != NULL, "line %d: rejected %s: %s", line, text, err.msg);
    return v;
}
#define ACCEPT(text) accept_lim((text), NULL, __LINE__)

/* Must be rejected as DS4_ERR_FORMAT with a message naming `what` and, if offset >= 0, that byte offset. */
static void reject_n(const char *text, size_t len, const ds4_json_limits *lim, const char *what, long offset,
                     int line) {
    ds4_error err;
    ds4_json *v = parse_n(text, len, lim, &err);
    CHECK(v == NULL, "line %d: accepted %.60s", line, text);
    if (v) {
        ds4_json_free(v);
        return;
    }
    CHECK(err.code == DS4_ERR_FORMAT, "line %d: %.60s: code %s (%s)", line, text, ds4_status_name(err.code),
          err.msg);
    CHECK(strstr(err.msg, "json: ") == err.msg, "line %d: message lacks the stage: %s", line, err.msg);
    CHECK(strstr(err.msg, "byte offset") != NULL, "line %d: message lacks the offset: %s", line, err.msg);
    if (what) CHECK(strstr(err.msg, what) != NULL, "line %d: message lacks '%s': %s", line, what, err.msg);
    if (offset >= 0) {
        char want[64];
        snprintf(want, sizeof want, "byte offset %ld", offset);
        CHECK(strstr(err.msg, want) != NULL, "line %d: wanted '%s' in: %s", line, want, err.msg);
    }
}
#define REJECT(text, what, off) reject_n((text), strlen(text), NULL, (what), (off), __LINE__)
#define REJECT_N(text, len, what, off) reject_n((text), (len), NULL, (what), (off), __LINE__)

static void check_string(const char *text, const char *want, size_t want_len, int line) {
    ds4_json *v = accept_lim(text, NULL, line);
    if (!v) return;
    CHECK(v->type == DS4_JSON_STRING, "line %d: type %d", line, (int)v->type);
    CHECK(v->str_len == want_len && memcmp(v->str, want, want_len) == 0 && v->str[want_len] == 0,
          "line %d: decoded %zu bytes, wanted %zu", line, v->str_len, want_len);
    ds4_json_free(v);
}
#define STRING_IS(text, want) check_string((text), (want), sizeof(want) - 1, __LINE__)

static void check_int(const char *text, int64_t want, int line) {
    ds4_json *v = accept_lim(text, NULL, line);
    if (!v) return;
    CHECK(v->type == DS4_JSON_NUMBER && v->is_int && v->integer == want, "line %d: %s -> is_int %d integer %lld",
          line, text, v->is_int, (long long)v->integer);
    CHECK(v->number == (double)want, "line %d: %s -> number %.17g", line, text, v->number);
    ds4_json_free(v);
}
#define INT_IS(text, want) check_int((text), (want), __LINE__)

static void check_double(const char *text, double want, int line) {
    ds4_json *v = accept_lim(text, NULL, line);
    if (!v) return;
    CHECK(v->type == DS4_JSON_NUMBER && !v->is_int, "line %d: %s -> is_int %d", line, text, v->is_int);
    CHECK(v->number == want, "line %d: %s -> %.17g, wanted %.17g", line, text, v->number, want);
    ds4_json_free(v);
}
#define DOUBLE_IS(text, want) check_double((text), (want), __LINE__)

static void test_scalars(void) {
    ds4_json *v = ACCEPT("true");
    CHECK(v && v->type == DS4_JSON_BOOL && v->boolean == 1, "true");
    ds4_json_free(v);
    v = ACCEPT("false");
    CHECK(v && v->type == DS4_JSON_BOOL && v->boolean == 0, "false");
    ds4_json_free(v);
    v = ACCEPT(" \t\r\n null \n");
    CHECK(v && v->type == DS4_JSON_NULL, "null with whitespace");
    ds4_json_free(v);

    INT_IS("0", 0);
    INT_IS("1", 1);
    INT_IS("-1", -1);
    INT_IS("4096", 4096);
    INT_IS("9223372036854775807", INT64_MAX);
    INT_IS("-9223372036854775808", INT64_MIN);
    INT_IS("9007199254740993", 9007199254740993LL); /* 2^53 + 1: exact as int64, rounded as a double */
    v = ACCEPT("-0");
    CHECK(v && v->is_int && v->integer == 0 && v->number == 0 && signbit(v->number), "-0 keeps its sign bit");
    ds4_json_free(v);
    /* One past the int64 range: still a number, no longer an exact integer. */
    DOUBLE_IS("9223372036854775808", 9223372036854775808.0);
    DOUBLE_IS("-9223372036854775809", -9223372036854775808.0);
    DOUBLE_IS("123456789012345678901234567890", 1.2345678901234568e29);
    /* A fraction or exponent means "not an integer literal", whatever the value. */
    DOUBLE_IS("1.0", 1.0);
    DOUBLE_IS("1e2", 100.0);
    DOUBLE_IS("1E+2", 100.0);
    DOUBLE_IS("-2.5e-3", -0.0025);
    DOUBLE_IS("0.1", 0.1);
    DOUBLE_IS("1e-06", 1e-6);
    DOUBLE_IS("-0.0", -0.0);
    DOUBLE_IS("1e-400", 0.0);                  /* underflow is harmless */
    DOUBLE_IS("1.7976931348623157e308", 1.7976931348623157e308);
}

static void test_number_rejects(void) {
    REJECT("01", "leading zero", 0);
    REJECT("-01", "leading zero", 0);
    REJECT("00", "leading zero", 0);
    REJECT("[1, 007]", "leading zero", 4);
    REJECT("1.", "digit after '.'", 2);
    REJECT(".5", "unexpected '.'", 0);
    REJECT("+1", "unexpected '+'", 0);
    REJECT("-", "digit after '-'", 0);
    REJECT("1e", "exponent digit", 2);
    REJECT("1e+", "exponent digit", 3);
    REJECT("1.e5", "digit after '.'", 2);
    REJECT("0x10", "trailing 'x'", 1);
    REJECT("NaN", "unexpected 'N'", 0);
    REJECT("nan", "expected 'null'", 0);
    REJECT("Infinity", "unexpected 'I'", 0);
    REJECT("-Infinity", "digit after '-'", 0);
    REJECT("[1, -NaN]", "digit after '-'", 4);
    REJECT("1e400", "overflows", 0);
    REJECT("-1e400", "overflows", 0);
}

static void test_strings(void) {
    STRING_IS("\"\"", "");
    STRING_IS("\"abc\"", "abc");
    STRING_IS("\"a\\\"b\\\\c\\/d\\b\\f\\n\\r\\t\"", "a\"b\\c/d\b\f\n\r\t");
    STRING_IS("\"\\u0041\\u00e9\"", "A\xC3\xA9");
    STRING_IS("\"\\u20AC\"", "\xE2\x82\xAC");
    STRING_IS("\"\\uFFFF\"", "\xEF\xBF\xBF");
    STRING_IS("\"\\uD83D\\uDE00\"", "\xF0\x9F\x98\x80");       /* surrogate pair -> U+1F600 */
    STRING_IS("\"\\udbff\\udfff\"", "\xF4\x8F\xBF\xBF");       /* U+10FFFF, lower-case hex */
    STRING_IS("\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"", "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"); /* raw UTF-8 */
    STRING_IS("\"\x7F\"", "\x7F");                             /* DEL is not a control character in JSON */
    STRING_IS("\"model.layers.0.attn.wq_a.weight\"", "model.layers.0.attn.wq_a.weight");
}

static void test_string_rejects(void) {
    REJECT("\"abc", "unterminated", 0);
    REJECT("\"abc\\\"", "unterminated", 0);
    REJECT("\"a\nb\"", "control character U+000A", 2);
    REJECT("\"a\tb\"", "control character U+0009", 2);
    REJECT("\"\x01\"", "control character U+0001", 1);
    REJECT("\"\\x41\"", "invalid escape", 1);
    REJECT("\"\\a\"", "invalid escape", 1);
    REJECT("\"\\'\"", "invalid escape", 1);
    REJECT("\"\\u12\"", "truncated", 1);
    REJECT("\"\\u12G4\"", "invalid hex digit 'G'", 5);
    REJECT("\"\\u0000\"", "\\u0000", 1);
    REJECT("\"ab\\uD800\"", "unpaired high surrogate", 3);
    REJECT("\"\\uD800x\"", "unpaired high surrogate", 1);
    REJECT("\"\\uD800\\n\"", "unpaired high surrogate", 1);
    REJECT("\"\\uD800\\u0041\"", "not a low surrogate", 1);
    REJECT("\"\\uD800\\uD800\"", "not a low surrogate", 1);
    REJECT("\"\\uDC00\"", "unpaired low surrogate", 1);
    REJECT("\"\\uDFFF\\uD800\"", "unpaired low surrogate", 1);
    /* Invalid UTF-8: stray continuation, overlong forms, encoded surrogates, > U+10FFFF, truncation. */
    REJECT("\"\x80\"", "invalid UTF-8 byte 0x80", 1);
    REJECT("\"\xC0\xAF\"", "invalid UTF-8 byte 0xC0", 1);
    REJECT("\"\xC1\xBF\"", "invalid UTF-8", 1);
    REJECT("\"\xE0\x80\xAF\"", "invalid UTF-8 byte 0xE0", 1);
    REJECT("\"\xF0\x80\x80\xAF\"", "invalid UTF-8", 1);
    REJECT("\"\xED\xA0\x80\"", "invalid UTF-8 byte 0xED", 1);
    REJECT("\"\xED\xBF\xBF\"", "invalid UTF-8", 1);
    REJECT("\"\xF4\x90\x80\x80\"", "invalid UTF-8 byte 0xF4", 1);
    REJECT("\"\xF5\x80\x80\x80\"", "invalid UTF-8", 1);
    REJECT("\"\xFF\"", "invalid UTF-8", 1);
    REJECT("\"a\xC3\"", "invalid UTF-8 byte 0xC3", 2);
    REJECT("\"\xE2\x82\"", "invalid UTF-8", 1);
    REJECT("\"\xE2\x82x\"", "invalid UTF-8", 1);
    REJECT("'abc'", "unexpected '''", 0);
}

static void test_structure(void) {
    const char *doc = "{\"a\": [1, {\"b\": null}, \"s\"], \"c\": {}, \"d\": [], \"a\\u0062\": true}";
    ds4_json *v = ACCEPT(doc);
    if (v) {
        CHECK(v->type == DS4_JSON_OBJECT && v->count == 4, "object with 4 members (got %zu)", v->count);
        CHECK(strcmp(v->keys[0], "a") == 0 && strcmp(v->keys[3], "ab") == 0, "keys in document order, decoded");
        const ds4_json *a = ds4_json_get(v, "a");
        CHECK(a && a->type == DS4_JSON_ARRAY && a->count == 3, "a is a 3-array");
        if (a && a->count == 3) {
            CHECK(a->items[0].is_int && a->items[0].integer == 1, "a[0] = 1");
            CHECK(a->items[1].type == DS4_JSON_OBJECT && ds4_json_get(&a->items[1], "b") &&
                      ds4_json_get(&a->items[1], "b")->type == DS4_JSON_NULL,
                  "a[1].b = null");
            CHECK(a->items[2].type == DS4_JSON_STRING && strcmp(a->items[2].str, "s") == 0, "a[2] = \"s\"");
        }
        const ds4_json *c = ds4_json_get(v, "c");
        CHECK(c && c->type == DS4_JSON_OBJECT && c->count == 0, "c = {}");
        const ds4_json *d = ds4_json_get(v, "d");
        CHECK(d && d->type == DS4_JSON_ARRAY && d->count == 0, "d = []");
        const ds4_json *ab = ds4_json_get(v, "ab");
        CHECK(ab && ab->type == DS4_JSON_BOOL && ab->boolean, "ab = true");
        CHECK(ds4_json_get(v, "zz") == NULL, "absent key");
        CHECK(ds4_json_get(a, "a") == NULL, "lookup on a non-object");
        CHECK(ds4_json_get(NULL, "a") == NULL, "lookup on NULL");
        ds4_json_free(v);
    }
    ds4_json_free(NULL);

    REJECT("", "end of input", 0);
    REJECT("   ", "end of input", 3);
    REJECT("[", "end of input", 1);
    REJECT("[1", "end of input", 2);
    REJECT("[1,]", "unexpected ']'", 3);
    REJECT("[,1]", "unexpected ','", 1);
    REJECT("[1 2]", "expected ',' or ']'", 3);
    REJECT("{\"a\":1,}", "expected a string key", 7);
    REJECT("{\"a\" 1}", "expected ':'", 5);
    REJECT("{a:1}", "expected a string key", 1);
    REJECT("{\"a\":1", "end of input", 6);
    REJECT("{\"a\":}", "unexpected '}'", 5);
    REJECT("{\"a\":1 \"b\":2}", "expected ',' or '}'", 7);
    REJECT("[1]]", "trailing ']'", 3);
    REJECT("{}{}", "trailing '{'", 2);
    REJECT("1 2", "trailing '2'", 2);
    REJECT("truex", "trailing 'x'", 4);
    REJECT("tru", "expected 'true'", 0);
    REJECT("nul", "expected 'null'", 0);
    REJECT("True", "unexpected 'T'", 0);
    REJECT("/* c */ 1", "unexpected '/'", 0);
    REJECT("\xEF\xBB\xBF{}", "byte 0xEF", 0); /* a UTF-8 BOM is not JSON text */
    REJECT_N("[1,\0 2]", 7, "byte 0x00", 3);
    REJECT_N("1\0", 2, "trailing byte 0x00", 1);
    REJECT("[1]\x0B", "trailing byte 0x0B", 3); /* vertical tab is not JSON whitespace */

    /* Duplicate keys, including ones that only collide after unescaping. */
    REJECT("{\"a\":1,\"a\":2}", "duplicate object key \"a\"", 7);
    REJECT("{\"ab\":1,\"a\\u0062\":2}", "duplicate object key \"ab\"", 8);
    REJECT("{\"x\":{\"k\":1,\"k\":1}}", "duplicate", 12);
    {
        /* A long key is quoted in the message cut on a character boundary, never inside "é". */
        char text[600], key[256];
        memset(key, 'a', 199);
        memcpy(key + 199, "\xC3\xA9", 3);
        snprintf(text, sizeof text, "{\"%s\":1,\"%s\":2}", key, key);
        ds4_error err;
        CHECK(parse_n(text, strlen(text), NULL, &err) == NULL, "long duplicate key accepted");
        CHECK(strstr(err.msg, "\xC3") == NULL && strstr(err.msg, "aaaa\" at byte offset 207") != NULL,
              "long key cut: %s", err.msg);
    }
    v = ACCEPT("[{\"k\":1},{\"k\":2}]"); /* same key in sibling objects is fine */
    ds4_json_free(v);

    /* Around the size where objects switch from pairwise checks and linear lookup to a hash index. */
    for (int n = 14; n <= 40; n++) {
        char text[2048];
        size_t len = (size_t)snprintf(text, sizeof text, "{");
        for (int i = 0; i < n; i++) len += (size_t)snprintf(text + len, sizeof text - len, "%s\"k%d\":%d", i ? "," : "", i, i);
        snprintf(text + len, sizeof text - len, "}");
        v = ACCEPT(text);
        if (v) {
            int ok = 1;
            for (int i = 0; i < n; i++) {
                char k[16];
                snprintf(k, sizeof k, "k%d", i);
                const ds4_json *e = ds4_json_get(v, k);
                ok &= e && e->integer == i;
            }
            CHECK(ok && !ds4_json_get(v, "k") && !ds4_json_get(v, "k99"), "lookups in a %d-key object", n);
            ds4_json_free(v);
        }
        /* Same document with the last key repeating the first one. */
        len = (size_t)snprintf(text, sizeof text, "{");
        for (int i = 0; i < n; i++)
            len += (size_t)snprintf(text + len, sizeof text - len, "%s\"k%d\":%d", i ? "," : "", i == n - 1 ? 0 : i, i);
        snprintf(text + len, sizeof text - len, "}");
        REJECT(text, "duplicate object key \"k0\"", -1);
    }

    ds4_error err;
    CHECK(ds4_json_parse(NULL, 3, NULL, &err) == NULL && err.code == DS4_ERR_ARG, "NULL text is an argument error");
    CHECK(ds4_json_parse(NULL, 0, NULL, NULL) == NULL, "NULL err is allowed");
}

static char *nested(int depth) {
    char *s = malloc((size_t)depth * 2 + 2);
    for (int i = 0; i < depth; i++) s[i] = '[';
    s[depth] = '1';
    for (int i = 0; i < depth; i++) s[depth + 1 + i] = ']';
    s[2 * depth + 1] = 0;
    return s;
}

static void test_limits(void) {
    char *s = nested(64);
    ds4_json *v = ACCEPT(s); /* the default depth limit is 64 */
    ds4_json_free(v);
    free(s);
    s = nested(65);
    REJECT(s, "nesting deeper than the limit of 64", 64);
    free(s);
    s = nested(100000); /* far past any limit: must fail cleanly, not overflow the stack */
    ds4_json_limits deep = {1 << 30, 0};
    reject_n(s, strlen(s), &deep, "nesting", -1, __LINE__);
    free(s);

    ds4_json_limits lim = {3, 0};
    v = accept_lim("[[[1]]]", &lim, __LINE__);
    ds4_json_free(v);
    v = accept_lim("{\"a\":{\"b\":[1]}}", &lim, __LINE__);
    ds4_json_free(v);
    reject_n("[[[[1]]]]", 9, &lim, "nesting deeper than the limit of 3", 3, __LINE__);
    reject_n("{\"a\":{\"b\":{\"c\":{}}}}", 20, &lim, "nesting", 15, __LINE__);

    ds4_json_limits items = {0, 3};  /* containers count as values */
    v = accept_lim("[1,2]", &items, __LINE__);
    ds4_json_free(v);
    v = accept_lim("{\"a\":1,\"b\":2}", &items, __LINE__);
    ds4_json_free(v);
    reject_n("[1,2,3]", 7, &items, "more than 3 values", 5, __LINE__);
    reject_n("[[1],[2]]", 9, &items, "more than 3 values", 5, __LINE__);
}

/* A safetensors-like header: one object with 100k keys, each an object with dtype/shape/offsets. */
static char *big_header(size_t n, int duplicate) {
    size_t cap = n * 128 + 64, len = 0;
    char *s = malloc(cap);
    len += (size_t)snprintf(s + len, cap - len, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        size_t name = (duplicate && i == n - 1) ? n / 2 : i;
        len += (size_t)snprintf(s + len, cap - len,
                                ",\"model.layers.%zu.w\":{\"dtype\":\"BF16\",\"shape\":[4096,%zu],"
                                "\"data_offsets\":[%zu,%zu]}",
                                name, i, i * 8, i * 8 + 8);
    }
    snprintf(s + len, cap - len, "}");
    return s;
}

static void test_large(void) {
    const size_t n = 100000;
    char *s = big_header(n, 0);
    ds4_error err;
    clock_t t0 = clock();
    ds4_json *v = parse_n(s, strlen(s), NULL, &err);
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    CHECK(v != NULL, "large header rejected: %s", err.msg);
    if (v) {
        CHECK(v->count == n + 1, "large header has %zu members", v->count);
        const ds4_json *last = &v->items[n];
        const ds4_json *off = ds4_json_get(last, "data_offsets");
        CHECK(off && off->count == 2 && off->items[1].integer == (int64_t)(n * 8), "last entry decoded");
        /* Every name must be found, at its own position, and fast: callers look tensors up by name. */
        char name[64];
        size_t found = 0;
        t0 = clock();
        for (size_t i = 0; i < n; i++) {
            snprintf(name, sizeof name, "model.layers.%zu.w", i);
            const ds4_json *e = ds4_json_get(v, name);
            found += e == &v->items[i + 1];
        }
        double lookup = (double)(clock() - t0) / CLOCKS_PER_SEC;
        CHECK(found == n, "found %zu of %zu names", found, n);
        CHECK(ds4_json_get(v, "model.layers.100000.w") == NULL && ds4_json_get(v, "") == NULL &&
                  ds4_json_get(v, "model.layers.1.") == NULL,
              "absent names");
        CHECK(ds4_json_get(v, "__metadata__") == &v->items[0], "first key");
        CHECK(lookup < 5, "%zu lookups took %.2f s", n, lookup);
        ds4_json_free(v);
    }
    /* ~10 MB of text; generous bound even for sanitizer builds. */
    CHECK(secs < 20, "parsing %zu entries took %.2f s", n, secs);
    printf("test_json: parsed %zu-entry header (%zu bytes) in %.3f s\n", n, strlen(s), secs);
    free(s);

    s = big_header(n, 1);
    char want[64];
    snprintf(want, sizeof want, "duplicate object key \"model.layers.%zu.w\"", n / 2);
    reject_n(s, strlen(s), NULL, want, -1, __LINE__);
    free(s);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    test_scalars();
    test_number_rejects();
    test_strings();
    test_string_rejects();
    test_structure();
    test_limits();
    test_large();
    return ds4t_finish("test_json");
}
