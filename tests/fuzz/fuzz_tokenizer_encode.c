/* fuzz_tokenizer_encode.c — libFuzzer target for ds4_tokenizer_encode / decode on arbitrary bytes.
 *
 * Three tokenizers, built once from JSON written here (the fuzz build passes no fixture path):
 *   - "deepseek": the DeepSeek-V3/V4 pre-tokenizer (Split \p{N}{1,3}, the CJK run regex, the word/punctuation
 *     regex, ByteLevel without regex), the 256 byte tokens plus a few merges, DeepSeek special tokens;
 *   - "variant": NFC, Split with every behaviour and invert, Digits, ByteLevel with the GPT-2 regex and
 *     add_prefix_space, ignore_merges, added tokens with lstrip / rstrip / single_word / normalized;
 *   - the built-in byte-level tokenizer.
 * Properties: no crash/leak/UB; encode never fails on any bytes; every id decodes; without a normaliser
 * decode(encode(s)) == s byte for byte; the built-in tokenizer's ids are the input bytes when no special token
 * text occurs in it; encoding with DS4_TOK_ADD_BOS gives BOS followed by the same ids. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

static const char DS_PRE[] =
    "{\"type\":\"Sequence\",\"pretokenizers\":["
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}{1,3}\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[\xe4\xb8\x80-\xe9\xbe\xa5\xe3\x81\x80-\xe3\x82\x9f\xe3\x82\xa0-\xe3\x83\xbf]+\"},"
    "\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[!\\\"#$%&'()*+,\\\\-./:;<=>?@\\\\[\\\\\\\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\\r\\n\\\\p{L}\\\\p{P}\\\\p{S}]?[\\\\p{L}\\\\p{M}]+| ?[\\\\p{P}\\\\p{S}]+[\\r\\n]*|\\\\s*[\\r\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
    "\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}";

static const char VAR_PRE[] =
    "{\"type\":\"Sequence\",\"pretokenizers\":["
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[0-9]+\"},\"behavior\":\"MergedWithPrevious\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"String\":\"--\"},\"behavior\":\"Removed\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"[!?]\"},\"behavior\":\"MergedWithNext\",\"invert\":false},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+\"},\"behavior\":\"Contiguous\",\"invert\":true},"
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"x*\"},\"behavior\":\"Isolated\",\"invert\":false},"
    "{\"type\":\"Digits\",\"individual_digits\":true},"
    "{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,\"use_regex\":true}]}";

static const char DS_ADDED[] =
    "[{\"id\":300,\"content\":\"<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>\",\"special\":true,"
    "\"normalized\":false},"
    "{\"id\":301,\"content\":\"<\xef\xbd\x9cUser\xef\xbd\x9c>\",\"special\":true,\"normalized\":false},"
    "{\"id\":302,\"content\":\"<think>\",\"special\":true,\"normalized\":false},"
    "{\"id\":303,\"content\":\"</think>\",\"special\":true,\"normalized\":false}]";

static const char VAR_ADDED[] =
    "[{\"id\":300,\"content\":\"<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>\",\"special\":true,"
    "\"normalized\":false},"
    "{\"id\":301,\"content\":\"<mask>\",\"single_word\":true,\"lstrip\":true,\"rstrip\":true,\"normalized\":true},"
    "{\"id\":302,\"content\":\"caf\xc3\xa9\",\"normalized\":true},"
    "{\"id\":303,\"content\":\"ab\",\"rstrip\":true,\"normalized\":false}]";

/* merges over the byte vocabulary: each result is added to the vocabulary from id 256 */
static const char *const MERGES[][2] = {
    {"\xc4\xa0", "t"}, {"h", "e"}, {"\xc4\xa0t", "he"}, {"i", "n"}, {"e", "r"}, {"1", "2"}, {"12", "3"},
    {"\xc4\xa0", "\xc4\xa0"}, {"\xc4\x8a", "\xc4\x8a"}, {"a", "b"},
};

static char *make(const char *norm, const char *pre, const char *added, int ignore_merges) {
    size_t cap = 32768, o = 0;
    char *j = malloc(cap);
    if (!j) abort();
#define PUT(...) o += (size_t)snprintf(j + o, cap - o, __VA_ARGS__)
    PUT("{\"version\":\"1.0\",\"added_tokens\":%s,\"normalizer\":%s,\"pre_tokenizer\":%s,\"decoder\":{\"type\":\"ByteLevel\"},"
        "\"model\":{\"type\":\"BPE\",\"ignore_merges\":%s,\"vocab\":{",
        added, norm, pre, ignore_merges ? "true" : "false");
    for (unsigned b = 0; b < 256; b++) {
        unsigned cp = b, k = 0;
        if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
            for (unsigned x = 0; x < b; x++)
                if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) k++;
            cp = 256 + k;
        }
        if (cp == '"' || cp == '\\') PUT("\"\\%c\":%u,", cp, b);
        else if (cp < 0x80) PUT("\"%c\":%u,", cp, b);
        else PUT("\"%c%c\":%u,", 0xC0 | (cp >> 6), 0x80 | (cp & 0x3F), b);
    }
    size_t nm = sizeof MERGES / sizeof MERGES[0];
    for (size_t i = 0; i < nm; i++) PUT("\"%s%s\":%zu%s", MERGES[i][0], MERGES[i][1], 256 + i, i + 1 < nm ? "," : "");
    PUT("},\"merges\":[");
    for (size_t i = 0; i < nm; i++) PUT("[\"%s\",\"%s\"]%s", MERGES[i][0], MERGES[i][1], i + 1 < nm ? "," : "");
    PUT("]}}");
#undef PUT
    if (o >= cap) abort();
    return j;
}

static ds4_tokenizer *load(const char *json) {
    ds4_tokenizer *t = NULL;
    ds4_error err;
    if (ds4_tokenizer_load_json(json, strlen(json), &t, &err) != DS4_OK) {
        fprintf(stderr, "fuzz_tokenizer_encode: setup: %s\n", err.msg);
        abort();
    }
    return t;
}

static ds4_tokenizer *g_tok[3];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char *a = make("null", DS_PRE, DS_ADDED, 0), *b = make("{\"type\":\"NFC\"}", VAR_PRE, VAR_ADDED, 1);
    g_tok[0] = load(a);
    g_tok[1] = load(b);
    free(a);
    free(b);
    ds4_error err;
    if (ds4_tokenizer_byte_level(&g_tok[2], &err) != DS4_OK) abort();
    /* the tokenizers live for the whole process: LeakSanitizer sees them as reachable */
    return 0;
}

static void run(const ds4_tokenizer *t, const uint8_t *data, size_t size, int exact, ds4_tokens *out) {
    ds4_error err;
    out->n = 0;
    if (ds4_tokenizer_encode(t, (const char *)data, size, 0, out, &err) != DS4_OK) {
        fprintf(stderr, "encode failed: %s\n", err.msg);
        abort();
    }
    char *dec = NULL;
    size_t dl = 0;
    if (ds4_tokenizer_decode(t, out->ids, out->n, 0, &dec, &dl, &err) != DS4_OK) abort();
    if (exact && (dl != size || memcmp(dec, data, size) != 0)) abort();
    free(dec);
    /* with BOS: the same ids after it */
    ds4_tokens b = {0};
    if (ds4_tokenizer_encode(t, (const char *)data, size, DS4_TOK_ADD_BOS, &b, &err) != DS4_OK) abort();
    if (b.n != out->n + 1 || b.ids[0] != ds4_tokenizer_special_id(t, "bos") ||
        (out->n && memcmp(b.ids + 1, out->ids, out->n * sizeof *b.ids) != 0))
        abort();
    ds4_tokens_free(&b);
}

static int has(const uint8_t *d, size_t n, const char *pat, size_t pl) {
    for (size_t i = 0; i + pl <= n; i++)
        if (memcmp(d + i, pat, pl) == 0) return 1;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_tokens out = {0};
    run(g_tok[0], data, size, 1, &out);
    run(g_tok[1], data, size, 0, &out);
    run(g_tok[2], data, size, 1, &out);
    /* the built-in tokenizer: ids are the bytes unless a special token's text occurs */
    if (!has(data, size, "<", 1) && !has(data, size, "\xef\xbd\x9c", 3)) {
        if (out.n != size) abort();
        for (size_t i = 0; i < size; i++)
            if (out.ids[i] != data[i]) abort();
    }
    ds4_tokens_free(&out);
    return 0;
}
