/* ds4_tokenizer.h — the byte-level BPE tokenizer of libds4 (Hugging Face tokenizer.json). Included by ds4.h;
 * include ds4.h rather than this file.
 *
 * What is read from a tokenizer.json
 *   - model: BPE with vocab, merges (either spelling: "a b" strings or ["a", "b"] pairs), ignore_merges;
 *     dropout null (or 0), unk_token / continuing_subword_prefix / end_of_word_suffix null, byte_fallback false.
 *   - added_tokens: matched in the raw text before normalisation and pre-tokenisation (normalized = false) or in
 *     the normalised text (normalized = true), leftmost-longest, with single_word / lstrip / rstrip as HF does.
 *   - normalizer: null or NFC.
 *   - pre_tokenizer: Sequence / Split (Regex or String pattern; behaviours Removed, Isolated,
 *     MergedWithPrevious, MergedWithNext, Contiguous; invert) / Digits / ByteLevel (add_prefix_space,
 *     use_regex: the GPT-2 regex). ByteLevel must be present and be the last step: the model is byte-level.
 *   - decoder: ByteLevel or null (null decodes as ByteLevel too; HF would join the raw tokens with spaces).
 *   - post_processor is ignored (encode never adds tokens through it; see DS4_TOK_ADD_BOS); truncation and
 *     padding must be null.
 *   Anything else is DS4_ERR_UNSUPPORTED with the component and field named; malformed JSON or fields are
 *   DS4_ERR_FORMAT with the field named ("tokenizer: model.merges[12]: ...").
 *
 * Regexes run on PCRE2 (UTF + UCP, JIT-compiled when available) with Oniguruma-compatible options (HF uses
 * Oniguruma's Ruby syntax): ^ and $ match at line breaks, \uHHHH and \x{H..} escapes are accepted.
 *
 * Threads: a tokenizer is immutable after loading. Any number of threads may call encode / decode / the lookups
 * on one tokenizer at once. Per-call scratch (PCRE2 match data and JIT stack, buffers) is taken from a small
 * pool inside the tokenizer guarded by a mutex and handed back after the call; it holds no result state, so
 * results never depend on which thread or call ran before.
 *
 * Invalid UTF-8 input (which HF cannot even represent) is encoded by bytes and never rejected: the regex steps
 * run on the valid stretches only, each maximal invalid stretch is a piece of its own, and byte-level BPE maps
 * its raw bytes. decode returns the exact bytes of the tokens (no U+FFFD replacement), so decode(encode(s)) == s
 * for every byte string s when no normalisation applies. */
#ifndef DS4_TOKENIZER_H
#define DS4_TOKENIZER_H

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_tokenizer ds4_tokenizer;

/* A growable id array. encode appends to it (set n = 0 to reuse the memory); free with ds4_tokens_free. */
typedef struct ds4_tokens {
    int32_t *ids;
    size_t n;
    size_t cap;
} ds4_tokens;
void ds4_tokens_free(ds4_tokens *t);  /* frees ids and zeroes the struct */

#define DS4_TOK_ADD_BOS 1u       /* encode: prepend the "bos" special token (error if the tokenizer has none) */
#define DS4_TOK_SKIP_SPECIAL 2u  /* decode: leave out special tokens (HF's skip_special_tokens = True) */

/* Load a tokenizer.json file (path) or its text (len bytes, need not be NUL-terminated). */
ds4_status ds4_tokenizer_load(const char *path, ds4_tokenizer **out, ds4_error *err);
ds4_status ds4_tokenizer_load_json(const char *json, size_t len, ds4_tokenizer **out, ds4_error *err);
/* The built-in byte-level tokenizer for models trained from scratch: ids 0..255 are the raw byte values, no
 * merges, no normaliser; the DeepSeek chat special tokens follow from id 256 in the order of the name table
 * below (bos 256, eos 257, user 258, assistant 259, think 260, end_think 261, ...). */
ds4_status ds4_tokenizer_byte_level(ds4_tokenizer **out, ds4_error *err);
void ds4_tokenizer_free(ds4_tokenizer *tok);
/* The tokenizer.json text tok was loaded from (the built-in one's generated text for ds4_tokenizer_byte_level),
 * byte for byte: len bytes, not NUL-terminated, valid while tok lives. Saving it as DIR/tokenizer.json and
 * loading that gives the same tokenizer. */
const char *ds4_tokenizer_json(const ds4_tokenizer *tok, size_t *len);

/* Tokenise len bytes of text and append the ids to out (on failure out->n is left as it was). No BOS unless
 * flags has DS4_TOK_ADD_BOS. Matches HF's tokenizer.encode(text, add_special_tokens=False).ids. */
ds4_status ds4_tokenizer_encode(const ds4_tokenizer *tok, const char *text, size_t len, uint32_t flags,
                                ds4_tokens *out, ds4_error *err);
/* The bytes of the n tokens, concatenated, as a malloc'd NUL-terminated buffer (*text, length *len; free()).
 * An id that is not a token is DS4_ERR_ARG naming its position. */
ds4_status ds4_tokenizer_decode(const ds4_tokenizer *tok, const int32_t *ids, size_t n, uint32_t flags,
                                char **text, size_t *len, ds4_error *err);

/* Largest id + 1 (model vocabulary and added tokens): the embedding rows a model needs. */
int32_t ds4_tokenizer_vocab_size(const ds4_tokenizer *tok);
/* The id of a token string as written in the vocabulary (byte-level form, e.g. "Ġthe"), or -1. */
int32_t ds4_tokenizer_token_to_id(const ds4_tokenizer *tok, const char *token, size_t len);
/* The vocabulary string of an id (NUL-terminated, valid while tok lives; *len may be NULL), or NULL. */
const char *ds4_tokenizer_id_to_token(const ds4_tokenizer *tok, int32_t id, size_t *len);
/* The bytes an id decodes to (what decode emits for it), or NULL if id is not a token. Not NUL-terminated. */
const char *ds4_tokenizer_id_bytes(const ds4_tokenizer *tok, int32_t id, size_t *len);
/* 1 if id is a special added token (decode with DS4_TOK_SKIP_SPECIAL drops it), else 0. */
int ds4_tokenizer_is_special(const ds4_tokenizer *tok, int32_t id);

/* DeepSeek chat special tokens by short name: "bos", "eos", "user", "assistant", "think", "end_think",
 * "latest_reminder", "dsml", "pad", "action", "query", "authority", "domain", "title", "read_url",
 * "tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end", "tool_sep", "tool_outputs_begin",
 * "tool_outputs_end", "tool_output_begin", "tool_output_end".
 * ds4_tokenizer_special_content gives the token text of a name (NULL for an unknown name);
 * ds4_tokenizer_special_id its id in tok (-1 when the name is unknown or tok lacks that token). */
const char *ds4_tokenizer_special_content(const char *name);
int32_t ds4_tokenizer_special_id(const ds4_tokenizer *tok, const char *name);
/* The i-th entry of the name table (i from 0; NULL past the end), for listing. */
const char *ds4_tokenizer_special_name_at(size_t i);

#ifdef __cplusplus
}
#endif
#endif /* DS4_TOKENIZER_H */
