/* fuzz_tokenizer_load.c — libFuzzer target for ds4_tokenizer_load_json on mutated tokenizer.json files.
 *
 * Properties: no crash/leak/UB; a failure carries its status in err.code and a "tokenizer: " message; an accepted
 * tokenizer encodes a few fixed strings and a prefix of the input itself without error (or with the bounded
 * PCRE2 match-limit error a pathological pattern can reach), every id it returns decodes, and every id below
 * vocab_size answers the lookups consistently (decode of one id = id_bytes).
 * Seeds: tests/fuzz/corpus/tokenizer_load/ (small hand-made tokenizer.json files); keywords for -dict= in
 * tests/fuzz/fuzz_tokenizer_load.dict. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

static void check_encode(const ds4_tokenizer *t, const char *s, size_t n) {
    ds4_tokens out = {0};
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_status st = ds4_tokenizer_encode(t, s, n, 0, &out, &err);
    if (st != DS4_OK) {
        /* only a regex hitting PCRE2's match/depth/heap limits may fail, and it must say so */
        if (st != DS4_ERR_UNSUPPORTED || err.code != st || !strstr(err.msg, "regex match failed")) abort();
        if (out.n != 0) abort();
        ds4_tokens_free(&out);
        return;
    }
    int32_t vs = ds4_tokenizer_vocab_size(t);
    for (size_t i = 0; i < out.n; i++)
        if (out.ids[i] < 0 || out.ids[i] >= vs || !ds4_tokenizer_id_bytes(t, out.ids[i], NULL)) abort();
    char *dec = NULL;
    size_t dl = 0;
    if (ds4_tokenizer_decode(t, out.ids, out.n, 0, &dec, &dl, &err) != DS4_OK) abort();
    free(dec);
    ds4_tokens_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_tokenizer *t = NULL;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_status st = ds4_tokenizer_load_json((const char *)data, size, &t, &err);
    if (st != DS4_OK) {
        if (t || err.code != st || strncmp(err.msg, "tokenizer: ", 11) != 0) abort();
        return 0;
    }
    static const char *const samples[] = {
        "Hello, world! 12345 <think>x</think>",
        "  \n\n\t def f(x):\n    return x ** 2\n",
        "\xe6\xb7\xb1\xe5\xba\xa6\xe5\xad\xa6\xe4\xb9\xa0 e\xcc\x81 \xf0\x9f\x98\x80 caf\xc3\xa9",
        "<\xef\xbd\x9cUser\xef\xbd\x9c>hi<\xef\xbd\x9c\x41ssistant\xef\xbd\x9c>", /* \x41: 'A' */
        "bad \xff\xfe utf8 \xed\xa0\x80 \xc0\xaf",
    };
    for (size_t i = 0; i < sizeof samples / sizeof samples[0]; i++) check_encode(t, samples[i], strlen(samples[i]));
    check_encode(t, (const char *)data, size < 256 ? size : 256);
    int32_t vs = ds4_tokenizer_vocab_size(t);
    if (vs <= 0) abort();
    for (int32_t id = 0; id < vs && id < 4096; id++) {
        size_t tl = 0, bl = 0;
        const char *tok = ds4_tokenizer_id_to_token(t, id, &tl);
        const char *b = ds4_tokenizer_id_bytes(t, id, &bl);
        if (!tok != !b) abort();
        if (!tok) continue;
        if (ds4_tokenizer_token_to_id(t, tok, tl) < 0) abort();
        char *dec = NULL;
        size_t dl = 0;
        if (ds4_tokenizer_decode(t, &id, 1, 0, &dec, &dl, &err) != DS4_OK) abort();
        if (dl != bl || memcmp(dec, b, bl) != 0) abort();
        free(dec);
    }
    ds4_tokenizer_free(t);
    return 0;
}
