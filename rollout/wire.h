/* wire.h — the rollout wire protocol codec (rollout/protocol.md is the specification; this follows it).
 *
 * A message is a ZeroMQ multipart message: frame 0 is a msgpack map (the header), frames 1.. are raw
 * little-endian arrays declared in the header. This codec turns a typed ds4_wire_msg into header bytes plus
 * the list of frames (ds4_wire_encode), and a list of received frames back into a ds4_wire_msg
 * (ds4_wire_decode). It never touches a socket.
 *
 * Ownership
 *   - Decode is zero-copy for the raw frames: the ds4_wire_view fields of a decoded message point into the
 *     caller's frame buffers, which must outlive the message. Every string is copied into the fixed-size
 *     buffers of the struct; nothing points into msgpack's memory after ds4_wire_decode returns.
 *   - Encode copies nothing from the raw frames either: ds4_wire_out.frames[1..] are the message's own views.
 *     Only the header is allocated (ds4_wire_out_free releases it).
 *   - A view's data need not be aligned: read elements with ds4_wire_i32 / ds4_wire_f32 (memcpy), or check
 *     alignment before casting.
 *
 * Errors
 *   ds4_wire_decode returns a ds4_wire_code (DS4_WIRE_OK = 0) — the code a receiver puts in its error reply —
 *   and fills err (may be NULL) with a message "wire decode: TYPE: what is wrong, with the sizes involved" and
 *   err->code DS4_ERR_FORMAT (DS4_ERR_ARG for DS4_WIRE_EARG, DS4_ERR_OOM for DS4_WIRE_ENOMEM).
 *   ds4_wire_encode follows the ds4 convention (ds4_status + ds4_error, "wire encode: ...").
 *
 * Reentrant, no global state, nothing aborts. */
#ifndef DS4_WIRE_H
#define DS4_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 2: hello carries the model's config and table CRCs (or none: a worker without a model), weight_announce
 * carries the model itself (config.json, tokenizer.json, chat template name, hash-routing tables).
 * 3: a task may carry stop strings (sampling.stop_strings), and samples may end with finish stop_string.
 * 4: weight_announce may describe a LoRA policy (its "adapter" map and "lora_masks" frame): the announced buffer is
 * then the adapters', over frozen base weights published once as a version of their own (protocol.md §7.6). A
 * version-3 peer would refuse that announce by its unknown key only after hello; a new version refuses it at once.
 * 5: streaming and partial rollouts (issue 16). A task may ask for partial results (sampling.stream = every N tokens),
 * which the worker sends as "partial" messages before the final samples; samples may carry the policy version of
 * every token (token_versions and the "policy_lag" frame), for a sequence that went on under newer weights. A
 * version-4 worker would refuse the task's unknown key; a new version refuses it at hello.
 * 6: partial messages carry each token's version too (token_versions and policy_lag, as samples do), so that a
 * consumer of streamed tokens knows which weights made them before the final answer. A version-5 pool would refuse
 * the partial message's unknown key and frame mid-task; a new version refuses it at hello. */
#define DS4_WIRE_VERSION 6

/* Compile-time capacities of the structs below. The configurable limits (ds4_wire_limits) may be lowered
 * from these, never raised past them. */
#define DS4_WIRE_FRAMES_CAP 16    /* frames per message, the header included */
#define DS4_WIRE_STR_CAP 256      /* bytes of a string field (the buffers hold one more, for the NUL) */
#define DS4_WIRE_SAMPLES_CAP 256  /* samples per samples message */
#define DS4_WIRE_STOP_CAP 64      /* stop token ids per task */
#define DS4_WIRE_STOP_STR_CAP 16  /* stop strings per task */
#define DS4_WIRE_STOP_STR_BYTES 64 /* bytes of one stop string (the buffers hold one more, for the NUL) */
#define DS4_WIRE_TEMPLATE_CAP 64  /* bytes of weight_announce.chat_template */
#define DS4_WIRE_MAX_ID 9007199254740991ull /* 2^53 - 1: task ids, policy versions, counts of parameters and
                                              bytes; exact in a Lua number */

/* ------------------------------------------------------------------------------------------------ codes */

typedef enum ds4_wire_code {
    DS4_WIRE_OK = 0,
    /* returned by ds4_wire_decode */
    DS4_WIRE_EARG = 1,      /* the caller's arguments (NULL pointers, invalid limits): never the peer's fault */
    DS4_WIRE_ENOMEM = 2,    /* allocation failed while parsing the (bounded) header */
    DS4_WIRE_ELIMIT = 3,    /* a size or count above a limit: frames, header or frame bytes, string length,
                               prompt tokens, samples, generated tokens, chunk bytes, map entries, nesting */
    DS4_WIRE_EPARSE = 4,    /* the header is not one well-formed msgpack object (truncated, invalid byte, ext) */
    DS4_WIRE_ETRAILING = 5, /* bytes after the header object */
    DS4_WIRE_ENOTMAP = 6,   /* the header is not a msgpack map */
    DS4_WIRE_EVERSION = 7,  /* "v" is not DS4_WIRE_VERSION (a peer of another protocol version) */
    DS4_WIRE_ETYPE = 8,     /* "t" names no message type */
    DS4_WIRE_EMISSING = 9,  /* a required key is absent */
    DS4_WIRE_EKEY = 10,     /* an unknown key, or a key that is not a string */
    DS4_WIRE_EDUP = 11,     /* a key appears twice in one map */
    DS4_WIRE_EVALTYPE = 12, /* a value of the wrong msgpack type */
    DS4_WIRE_ERANGE = 13,   /* a value outside its range, or inconsistent with another (offset past the end) */
    DS4_WIRE_EFRAME = 14,   /* the raw frames do not match their declaration: count, name, dtype, byte size */
    DS4_WIRE_ECOUNT = 15,   /* declared element counts disagree with the header (array lengths, sums) */
    DS4_WIRE_ECRC = 16,     /* a weight chunk's or an announce's model frame's CRC-32 does not match its bytes */
    /* never returned by the codec: sent in error messages by the worker loop and the trainer pool */
    DS4_WIRE_ESTATE = 32,   /* valid message, wrong moment: unknown or finished task, unknown worker (send
                               hello), weight version no longer kept, task without credit */
    DS4_WIRE_ESTALE = 33,   /* samples generated with a policy older than the staleness bound allows */
    DS4_WIRE_EREFUSED = 34, /* hello refused: model mismatch (vocab_size, n_params, config, tables) or worker id in
                               use; or a worker refusing the trainer's model (it differs from its --model) */
    DS4_WIRE_EINTERNAL = 35 /* the sender failed (generation error, out of memory): the task may be re-issued */
} ds4_wire_code;

/* "ok", "bad_argument", "no_memory", "limit", "parse", "trailing", "not_map", "version", "type", "missing",
 * "key", "duplicate", "value_type", "range", "frame", "count", "crc", "state", "stale", "refused",
 * "internal"; "unknown" for anything else. */
const char *ds4_wire_error_name(uint32_t code);

/* ------------------------------------------------------------------------------------------------ limits */

typedef struct ds4_wire_limits {
    size_t max_header_bytes;    /* frame 0: 65536 (cap 1 MiB) */
    size_t max_frame_bytes;     /* any raw frame: 1 GiB (cap 2^40) */
    uint32_t max_frames;        /* frames per message, header included: 16 (cap DS4_WIRE_FRAMES_CAP) */
    uint32_t max_str_bytes;     /* string fields: 256 (cap DS4_WIRE_STR_CAP) */
    uint32_t max_prompt_tokens; /* task prompt, and each sample's prompt_len: 4096 (cap 2^31 - 1) */
    uint32_t max_samples;       /* samples per task and per samples message: 64 (cap DS4_WIRE_SAMPLES_CAP) */
    uint32_t max_stop_ids;      /* stop ids per task: 64 (cap DS4_WIRE_STOP_CAP) */
    uint64_t max_gen_tokens;    /* generated tokens per message (and n · max_new_tokens per task): 2^20
                                   (cap 2^31) */
    uint32_t max_chunk_bytes;   /* weight chunk: 16 MiB (cap 1 GiB) */
    uint64_t max_weight_bytes;  /* announced weight buffer: 2^44 (16 TiB; cap DS4_WIRE_MAX_ID) */
} ds4_wire_limits;

/* The defaults above. */
ds4_wire_limits ds4_wire_default_limits(void);

/* ------------------------------------------------------------------------------------------------ messages */

typedef enum ds4_wire_type {
    DS4_WIRE_NONE = 0,       /* no message (a failed decode that did not get as far as a known "t") */
    DS4_WIRE_HELLO,          /* "hello"            worker -> trainer */
    DS4_WIRE_CREDIT,         /* "credit"           worker -> trainer */
    DS4_WIRE_TASK,           /* "task"             trainer -> worker, 1 frame (prompt) */
    DS4_WIRE_SAMPLES,        /* "samples"          worker -> trainer, 3 to 6 frames */
    DS4_WIRE_WEIGHT_ANNOUNCE,/* "weight_announce"  trainer -> worker, 3 frames (config, tokenizer, tables), a LoRA
                                policy's 4 (lora_masks) */
    DS4_WIRE_WEIGHT_REQUEST, /* "weight_request"   worker -> trainer */
    DS4_WIRE_WEIGHT_CHUNK,   /* "weight_chunk"     trainer -> worker, 1 frame (the chunk) */
    DS4_WIRE_HEARTBEAT,      /* "heartbeat"        both ways */
    DS4_WIRE_ERROR,          /* "error"            both ways */
    DS4_WIRE_BYE,            /* "bye"              both ways */
    DS4_WIRE_PARTIAL,        /* "partial"          worker -> trainer, 3 frames: a running task's newest tokens (v5) */
    DS4_WIRE_TYPE_COUNT
} ds4_wire_type;

/* The "t" string of a type ("hello", ...), or "none". */
const char *ds4_wire_type_name(ds4_wire_type t);

/* Bytes of a raw frame, not owned. */
typedef struct ds4_wire_view {
    const void *data;
    size_t len;
} ds4_wire_view;

typedef struct ds4_wire_hello {
    char worker[DS4_WIRE_STR_CAP + 1]; /* 1..64 bytes of printable ASCII, no space; also its ZMQ routing id */
    /* capabilities ("caps" map) */
    uint32_t max_batch;                /* sequences per decode step: 1..65536 */
    uint32_t threads;                  /* CPU threads: 1..4096 */
    uint32_t vocab_size;               /* 1..2^31-1; 0 (with n_params 0): no model, build it from the announce */
    uint64_t n_params;                 /* 1..DS4_WIRE_MAX_ID; 0 exactly when vocab_size is 0 */
    uint32_t config_crc;               /* CRC-32 of the model's canonical config JSON (ds4_config_to_json); 0: none */
    uint32_t tables_crc;               /* CRC-32 of its hash-routing tables (non-fp32 tensors in order); 0: none */
    char build[DS4_WIRE_STR_CAP + 1];  /* free text ("ds4 0.1.0 cpu+cuda"), 0..max_str_bytes */
    uint64_t policy;                   /* policy version loaded, 0: none */
} ds4_wire_hello;

typedef struct ds4_wire_credit {
    uint32_t n; /* more tasks the worker can take now: 1..65536 */
} ds4_wire_credit;

typedef struct ds4_wire_task {
    uint64_t task_id;                  /* 0..DS4_WIRE_MAX_ID */
    uint32_t attempt;                  /* 0 for the first lease, +1 per re-issue */
    uint64_t policy;                   /* the oldest policy version the worker may generate with */
    /* sampling parameters ("sampling" map) */
    uint32_t max_new_tokens;           /* 1..max_gen_tokens, and n · max_new_tokens <= max_gen_tokens */
    double temperature;                /* [0, 1000]; 0 greedy */
    uint32_t top_k;                    /* 0 off, else 1..2^31-1 */
    double top_p;                      /* [0, 1]; 0 or 1 off */
    double min_p;                      /* [0, 1]; 0 off */
    uint32_t n;                        /* samples of the prompt: 1..max_samples */
    uint64_t seed;                     /* any */
    uint32_t n_stop;                   /* 0..max_stop_ids */
    int32_t stop[DS4_WIRE_STOP_CAP];   /* extra stop token ids, each 0..2^31-1 */
    uint32_t n_stop_str;               /* 0..DS4_WIRE_STOP_STR_CAP (version 3) */
    char stop_str[DS4_WIRE_STOP_STR_CAP][DS4_WIRE_STOP_STR_BYTES + 1]; /* stop strings, 1..64 bytes, no NUL */
    uint8_t ignore_eos, record_experts, record_index; /* 0 or 1 */
    uint32_t stream;                   /* send a partial message every this many new tokens: 0 off, 1..2^20 (v5) */
    uint32_t prompt_len;               /* 1..max_prompt_tokens */
    ds4_wire_view prompt;              /* frame 1 "prompt": i32 LE [prompt_len] */
} ds4_wire_task;

typedef struct ds4_wire_seq {
    uint32_t prompt_len;  /* 1..max_prompt_tokens */
    uint32_t n_gen;       /* generated tokens, 0..max_gen_tokens (the sum over samples too) */
    uint32_t finish;      /* ds4_finish: 1 length, 2 eos, 3 stop_token, 4 stop_string, 5 cancelled */
    int32_t stop_index;   /* >= 0 exactly when finish is stop_token or stop_string, else -1 */
    uint32_t n_rows;      /* routing-replay rows, 0..prompt_len + n_gen; 0 without experts / index frames */
    uint32_t offset;      /* partial only: the sample's tokens sent in earlier partial messages of this lease */
} ds4_wire_seq;

typedef struct ds4_wire_samples {
    uint64_t task_id;
    uint32_t attempt;
    uint64_t policy;                      /* the policy version the samples were generated with */
    uint32_t n;                           /* 1..max_samples */
    ds4_wire_seq seq[DS4_WIRE_SAMPLES_CAP];
    uint32_t experts_layers, experts_k;   /* [L, K] of the experts frame; both 0: no experts frame */
    uint32_t index_layers, index_topk;    /* [n_csa, topk] of the index frame; both 0: no index frame */
    uint8_t token_versions;               /* samples v5, partial v6: the policy_lag frame gives each token's version
                                             (a sequence went on under newer weights); policy is then the newest */
    /* frames, samples concatenated in order (sample i's tokens start at the sum of n_gen before it) */
    ds4_wire_view tokens;                 /* i32 [sum n_gen] generated ids */
    ds4_wire_view logprobs;               /* f32 [sum n_gen] log p_model at temperature 1, unfiltered */
    ds4_wire_view sample_logprobs;        /* f32 [sum n_gen] log-prob under the distribution sampled from */
    ds4_wire_view policy_lag;             /* i32 [sum n_gen] when token_versions: policy - the token's version, in
                                             [0, policy - 1] */
    ds4_wire_view experts;                /* i32 [sum n_rows, L, K] routed experts, when experts_layers > 0 */
    ds4_wire_view index;                  /* i32 [sum n_rows, n_csa, topk] indexer picks, when index_layers > 0 */
} ds4_wire_samples;

typedef struct ds4_wire_weight_announce {
    uint64_t version;  /* 1..DS4_WIRE_MAX_ID */
    uint64_t bytes;    /* 1..max_weight_bytes; = n_params · 4 (a LoRA policy: the adapters' values · 4) */
    uint32_t chunk;    /* bytes per chunk (the last may be shorter): 4..max_chunk_bytes, a multiple of 4 */
    uint32_t chunks;   /* = ceil(bytes / chunk) */
    uint64_t n_params; /* layout.n_params */
    char dtype[8];     /* layout.dtype: "f32" */
    uint32_t crc;      /* CRC-32 (ds4_crc32) of the whole buffer */
    /* the model the weights belong to ("model" map; what a worker without local files builds its model from) */
    uint32_t config_crc, tokenizer_crc, tables_crc; /* CRC-32 of each frame below (checked by ds4_wire_decode) */
    char chat_template[DS4_WIRE_TEMPLATE_CAP + 1];  /* the tokenizer's chat template name, 0..64 bytes; "" none */
    ds4_wire_view config;    /* frame 1 "config": u8, the canonical config JSON (ds4_config_to_json), >= 2 bytes */
    ds4_wire_view tokenizer; /* frame 2 "tokenizer": u8, tokenizer.json; 0 bytes: the model has no tokenizer */
    ds4_wire_view tables;    /* frame 3 "tables": i32, every non-fp32 tensor (tid2eid) in tensor order; may be 0 */
    /* A LoRA policy ("adapter" map, version 4; lora_rank 0: a plain policy, and the fields below are 0): bytes /
     * chunk / chunks / crc above describe the adapters' flat fp32 buffer, and n_params still counts the base model's
     * parameters, whose frozen values are the weights of version base_version (fetched with weight_request like any
     * version; chunk size base_chunk, CRC-32 base_crc). */
    uint32_t lora_rank;      /* adapter.rank: 1..65536 */
    double lora_alpha;       /* adapter.alpha: [-1e30, 1e30] */
    uint8_t lora_rslora;     /* adapter.rslora: scale alpha / sqrt(rank), else alpha / rank */
    uint64_t base_version;   /* adapter.base_version: 1..version - 1 */
    uint32_t base_chunk;     /* adapter.base_chunk: 4..max_chunk_bytes, a multiple of 4 */
    uint32_t base_crc;       /* adapter.base_crc: CRC-32 of the base's n_params f32 */
    ds4_wire_view lora_masks;/* frame 4 "lora_masks": i32 [layers >= 1], each layer's adapted weights as site bits */
} ds4_wire_weight_announce;

typedef struct ds4_wire_weight_request {
    uint64_t version;  /* 1..DS4_WIRE_MAX_ID */
    uint32_t index;    /* chunk index */
} ds4_wire_weight_request;

typedef struct ds4_wire_weight_chunk {
    uint64_t version;  /* 1..DS4_WIRE_MAX_ID */
    uint32_t index;    /* < ceil(bytes / chunk) */
    uint64_t offset;   /* = index · chunk, < bytes */
    uint64_t bytes;    /* the announced total (receiver checks it equals the announce's) */
    uint32_t chunk;    /* the announced chunk size */
    uint32_t crc;      /* CRC-32 of this chunk's bytes (checked by ds4_wire_decode) */
    ds4_wire_view data;/* frame 1 "weights": f32 [min(chunk, bytes - offset) / 4] */
} ds4_wire_weight_chunk;

typedef struct ds4_wire_heartbeat {
    uint64_t policy;   /* sender's policy version: loaded (worker) / current (trainer) */
    uint32_t active;   /* tasks in progress (worker) / leased to this worker (trainer) */
} ds4_wire_heartbeat;

typedef struct ds4_wire_errmsg {
    uint32_t code;                     /* a ds4_wire_code, 1..65535 */
    char reason[DS4_WIRE_STR_CAP + 1]; /* human-readable, 0..max_str_bytes (a decode error's message, cut) */
    char ref_t[33];                    /* "t" of the message it refers to ("" when unknown) */
    uint64_t ref_id;                   /* its task id (task, samples) or version (weight_*), else 0 */
    uint32_t ref_n;                    /* its attempt (task, samples) or chunk index (weight_*), else 0 */
} ds4_wire_errmsg;

typedef struct ds4_wire_bye {
    char reason[DS4_WIRE_STR_CAP + 1]; /* optional, "" when absent */
} ds4_wire_bye;

typedef struct ds4_wire_msg {
    ds4_wire_type type;
    union {
        ds4_wire_hello hello;
        ds4_wire_credit credit;
        ds4_wire_task task;
        ds4_wire_samples samples;
        ds4_wire_samples partial; /* a partial message: task_id, attempt, policy, n, seq[].offset and n_gen, and the
                                     three token frames; nothing else */
        ds4_wire_weight_announce announce;
        ds4_wire_weight_request request;
        ds4_wire_weight_chunk chunk;
        ds4_wire_heartbeat heartbeat;
        ds4_wire_errmsg error;
        ds4_wire_bye bye;
    };
} ds4_wire_msg;

/* ------------------------------------------------------------------------------------------------ fields */

/* Every header field of every message type, declared once, in wire order (the encoder's key order): the codec's
 * decoder, encoder and equality (rollout/wire.c) and the Lua binding's fill and push (lua/wire_lua.c) all walk
 * this table. A field of kind DS4_WIRE_K_OTHER (task.sampling.stop and stop_strings; the samples' per-sample
 * arrays and routing shapes) has its key here and its values in each place's own code, as have the raw frames
 * and the cross-field rules (protocol.md §3). */
typedef enum ds4_wire_kind {
    DS4_WIRE_K_U64,   /* msgpack uint -> uint64_t */
    DS4_WIRE_K_U32,   /* msgpack uint -> uint32_t */
    DS4_WIRE_K_F64,   /* a float (an integer accepted) -> double */
    DS4_WIRE_K_BOOL,  /* true / false -> uint8_t */
    DS4_WIRE_K_STR,   /* str -> char[size], NUL-terminated */
    DS4_WIRE_K_OTHER  /* an array or a shape: the type's own code */
} ds4_wire_kind;

enum {
    DS4_WIRE_F_REQ = 1,      /* required on the wire (absent otherwise: 0, "") */
    DS4_WIRE_F_STRLIM = 2,   /* a string also at most max_str_bytes */
    DS4_WIRE_F_LUA_REQ = 4,  /* required in a Lua message (absent otherwise: def / sdef) */
    DS4_WIRE_F_LUA_CALC = 8, /* absent from a Lua message: the binding derives it from the other fields */
    DS4_WIRE_F_LUA_OWN = 16, /* the binding reads it its own way (an error code by name, samples.n from seq) */
    DS4_WIRE_F_OPT_MAP = 32  /* of a nested map that may be absent as a whole (weight_announce.adapter): present
                                exactly when its first field, whose range excludes 0, is not 0; absent, its fields
                                are 0. Its REQ / LUA_REQ fields are required when it is present. */
};

typedef struct ds4_wire_field {
    const char *name;   /* "hello.caps.max_batch": the name in messages (ds4_wire_equal's field) */
    const char *map;    /* NULL: a key of the header map; else the key of the nested map holding it */
    const char *key;    /* the key on the wire */
    const char *lua;    /* the key in a Lua message (ds4.wire); NULL: the binding names it otherwise */
    ds4_wire_kind kind;
    unsigned flags;     /* DS4_WIRE_F_* */
    uint64_t lo, hi;    /* integers: the range; strings: the range of the length in bytes */
    double flo, fhi;    /* doubles: the range */
    double def;         /* a number's or boolean's value when absent from a Lua message */
    const char *sdef;   /* a string's value when absent from a Lua message (NULL: "") */
    size_t offset;      /* of the C field in its type's struct (every struct of ds4_wire_msg's union) */
    size_t size;        /* of the C field */
} ds4_wire_field;

/* The fields of type t in wire order, and how many (*n); NULL and 0 for DS4_WIRE_NONE. */
const ds4_wire_field *ds4_wire_fields(ds4_wire_type t, int *n);

/* Whether field f (a row of ds4_wire_fields(m->type)) is in m's header: a field of an optional map (OPT_MAP) with
 * its map, an OTHER field by its type's rule (stop strings when there are some, routing rows and shapes with
 * routing records); every other field always. */
int ds4_wire_field_present(const ds4_wire_msg *m, const ds4_wire_field *f);

/* ------------------------------------------------------------------------------------------------ codec */

typedef struct ds4_wire_out {
    int nframes;                              /* header included */
    const void *frames[DS4_WIRE_FRAMES_CAP];  /* frames[0]: the header (owned); the rest: the message's views */
    size_t lens[DS4_WIRE_FRAMES_CAP];
    char *header;                             /* = frames[0], malloc'd */
} ds4_wire_out;

/* Encode m (its type's fields; the others are ignored). The message is validated by decoding the header it
 * produced against the capacities (not the default limits) and comparing every field: anything that would
 * not decode back to m is DS4_ERR_ARG with the decoder's message; *out is then empty. CRCs are not computed
 * here: fill announce.crc / chunk.crc with ds4_crc32. On success release out with ds4_wire_out_free. */
ds4_status ds4_wire_encode(const ds4_wire_msg *m, ds4_wire_out *out, ds4_error *err);
void ds4_wire_out_free(ds4_wire_out *out);

/* Decode one received message: frames[0] the header, frames[1..nframes-1] the raw frames (a frame of length 0
 * may be NULL). lim NULL: the defaults. Order of checks: the frame count and every frame length against the
 * limits, the header as msgpack (walked without allocating first: see protocol.md "Decoding"), "v", "t", the
 * type's schema (keys, value types, ranges, lengths, cross-field consistency), then the raw frames against
 * their declarations and the weight chunk CRC. Nothing allocates from a size read off the wire.
 * On failure *out is zeroed but out->type names the message type when "t" was understood. */
ds4_wire_code ds4_wire_decode(const ds4_wire_limits *lim, int nframes, const void *const *frames,
                              const size_t *lens, ds4_wire_msg *out, ds4_error *err);

/* Field-by-field equality of two messages (views compared by pointer and length; doubles bitwise). Returns 1
 * when equal; else 0 and, when field is not NULL, the name of the first field that differs. */
int ds4_wire_equal(const ds4_wire_msg *a, const ds4_wire_msg *b, const char **field);

/* Fill m as an error message: code, reason (cut to DS4_WIRE_STR_CAP bytes at a UTF-8 boundary), and what it
 * refers to (ref_t may be NULL). */
void ds4_wire_make_error(ds4_wire_msg *m, ds4_wire_code code, const char *reason, const char *ref_t,
                         uint64_t ref_id, uint32_t ref_n);

/* Element i of a raw frame (little-endian; the codec builds only on little-endian hosts). */
static inline int32_t ds4_wire_i32(ds4_wire_view v, size_t i) {
    int32_t x;
    memcpy(&x, (const char *)v.data + 4 * i, 4);
    return x;
}
static inline float ds4_wire_f32(ds4_wire_view v, size_t i) {
    float x;
    memcpy(&x, (const char *)v.data + 4 * i, 4);
    return x;
}

#ifdef __cplusplus
}
#endif
#endif
