/* json.h — a small, strict JSON (RFC 8259) DOM parser for config files and safetensors headers.
 *
 * Untrusted input: nesting depth, string length and element counts are bounded by the caller's limits
 * before allocation; errors report the byte offset. Numbers keep both a double and, when the literal is an
 * integer that fits, an exact int64. Strings are decoded (escapes, \u surrogate pairs) to UTF-8; invalid
 * UTF-8 or lone surrogates are rejected. Duplicate object keys are rejected (a header that names a
 * tensor twice is malformed). */
#ifndef DS4_JSON_H
#define DS4_JSON_H

#include <stddef.h>
#include <stdint.h>
#include "ds4.h"

typedef enum ds4_json_type {
    DS4_JSON_NULL = 0,
    DS4_JSON_BOOL,
    DS4_JSON_NUMBER,
    DS4_JSON_STRING,
    DS4_JSON_ARRAY,
    DS4_JSON_OBJECT
} ds4_json_type;

typedef struct ds4_json ds4_json;
struct ds4_json {
    ds4_json_type type;
    int boolean;             /* BOOL */
    double number;           /* NUMBER */
    int is_int;              /* NUMBER: the literal had no fraction/exponent and fits int64 */
    int64_t integer;         /* NUMBER, when is_int */
    char *str;               /* STRING: NUL-terminated UTF-8 (may contain no NUL: \u0000 is rejected) */
    size_t str_len;
    size_t count;            /* ARRAY / OBJECT: number of items */
    ds4_json *items;         /* ARRAY / OBJECT values, in document order */
    char **keys;             /* OBJECT keys, parallel to items */
};

typedef struct ds4_json_limits {
    int32_t max_depth;       /* e.g. 64; 0 means the default (64); capped at 1024 */
    size_t max_items;        /* total values in the document, e.g. 1 << 22; 0 means the default (1 << 22) */
} ds4_json_limits;

/* Parse exactly one JSON value (surrounded by optional whitespace). Returns NULL and fills err on failure. */
ds4_json *ds4_json_parse(const char *text, size_t len, const ds4_json_limits *limits, ds4_error *err);
/* Nodes live in one arena owned by the root: free only a root returned by ds4_json_parse. */
void ds4_json_free(ds4_json *v);
/* Object member lookup (NULL if absent or v is not an object); O(1) on large objects (hash index), for values
 * produced by ds4_json_parse only. */
const ds4_json *ds4_json_get(const ds4_json *obj, const char *key);

#endif
