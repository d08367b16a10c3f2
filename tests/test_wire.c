/* test_wire.c — the rollout wire codec (rollout/wire.h, spec rollout/protocol.md).
 *
 *   1. Round trip of every message type: encode -> decode -> every field equal, frames the very same bytes.
 *   2. A table of malformed messages, each rejected with the expected code and a message naming the problem.
 *      Headers are made by decoding a valid header with msgpack-c, patching the object tree (set, delete, add
 *      or duplicate a key) and packing it again, so each case differs from a valid message in one place.
 *   3. The encoder refuses what would not decode back to the same message.
 *   4. A deterministic mutation loop (100k iterations: flipped, overwritten, truncated and extended header
 *      bytes; shortened, lengthened, dropped and added frames): decode never crashes, and either fails with a
 *      "wire decode: " message or succeeds with a message that re-encodes and decodes to the same fields. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "testlib.h"
#include "wire.h"

/* ------------------------------------------------------------------------------------------------ fixtures */

static int32_t g_prompt[7] = {11, 12, 13, 14, 15, 16, 17};
static int32_t g_tokens[9] = {101, 102, 103, 104, 105, 106, 107, 108, 2};
static float g_lp[9] = {-0.5f, -1.25f, -0.125f, -3.0f, -0.75f, -0.0625f, -2.5f, -1.0f, -0.25f};
static float g_slp[9] = {-0.25f, -1.0f, -0.125f, -2.0f, -0.5f, -0.0625f, -2.0f, -0.5f, -0.125f};
/* samples: rows {10, 6, 11} = 27; experts [27, 2, 3], index [27, 1, 4] */
static int32_t g_experts[27 * 2 * 3];
static int32_t g_index[27 * 1 * 4];
/* weights: 10 f32 = 40 bytes in chunks of 16: chunks of 16, 16, 8 bytes */
static float g_weights[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
static const char g_config[] = "{\"vocab_size\": 129280}";
static const char g_tokenizer[] = "{\"model\": {\"type\": \"BPE\"}}";
static int32_t g_tables[6] = {3, 1, 0, 2, 7, 5};

static ds4_wire_view V(const void *p, size_t n) {
    ds4_wire_view v = {p, n};
    return v;
}

static void mk_hello(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_HELLO;
    strcpy(m->hello.worker, "gpu-node-07:4242");
    m->hello.max_batch = 256;
    m->hello.threads = 16;
    m->hello.vocab_size = 129280;
    m->hello.n_params = 284000000000ull;
    m->hello.config_crc = 0x1a2b3c4du;
    m->hello.tables_crc = 0xdeadbeefu;
    strcpy(m->hello.build, "ds4 0.1.0 cpu+cuda");
    m->hello.policy = 41;
}

static void mk_credit(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_CREDIT;
    m->credit.n = 8;
}

static void mk_task(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_TASK;
    ds4_wire_task *t = &m->task;
    t->task_id = 9007199254740991ull;
    t->attempt = 2;
    t->policy = 40;
    t->max_new_tokens = 512;
    t->temperature = 0.7;
    t->top_k = 50;
    t->top_p = 0.95;
    t->min_p = 0.05;
    t->n = 16;
    t->seed = 0xfedcba9876543210ull;
    t->n_stop = 3;
    t->stop[0] = 1;
    t->stop[1] = 128799;
    t->stop[2] = 0;
    t->n_stop_str = 2;
    strcpy(t->stop_str[0], "</answer>");
    strcpy(t->stop_str[1], "\n\n");
    t->ignore_eos = 1;
    t->record_experts = 1;
    t->record_index = 0;
    t->prompt_len = 7;
    t->prompt = V(g_prompt, sizeof g_prompt);
}

static void mk_samples(ds4_wire_msg *m, int routed) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_SAMPLES;
    ds4_wire_samples *s = &m->samples;
    s->task_id = 77;
    s->attempt = 1;
    s->policy = 41;
    s->n = 3;
    static const uint32_t gen[3] = {4, 0, 5}, fin[3] = {DS4_FINISH_LENGTH, DS4_FINISH_CANCELLED, DS4_FINISH_STOP_TOKEN},
                          rows[3] = {10, 6, 11};
    static const int32_t si[3] = {-1, -1, 0};
    for (int i = 0; i < 3; i++) {
        s->seq[i].prompt_len = 7;
        s->seq[i].n_gen = gen[i];
        s->seq[i].finish = fin[i];
        s->seq[i].stop_index = si[i];
        s->seq[i].n_rows = routed ? rows[i] : 0;
    }
    s->tokens = V(g_tokens, sizeof g_tokens);
    s->logprobs = V(g_lp, sizeof g_lp);
    s->sample_logprobs = V(g_slp, sizeof g_slp);
    if (routed) {
        s->experts_layers = 2;
        s->experts_k = 3;
        s->experts = V(g_experts, sizeof g_experts);
        s->index_layers = 1;
        s->index_topk = 4;
        s->index = V(g_index, sizeof g_index);
    }
}

/* Version 5: samples whose sequences went on under newer weights (per-token versions: policy 41, tokens of 39..41),
 * and a partial message (a running task's newest tokens: 2 of sample 0 after 2 sent, 3 of sample 2, none of 1). */
static int32_t g_lag[9] = {2, 2, 1, 0, 0, 0, 0, 0, 0};
static void mk_samples_versions(ds4_wire_msg *m) {
    mk_samples(m, 1);
    m->samples.token_versions = 1;
    m->samples.policy_lag = V(g_lag, sizeof g_lag);
}

static void mk_partial(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_PARTIAL;
    ds4_wire_samples *s = &m->partial;
    s->task_id = 77;
    s->attempt = 1;
    s->policy = 41;
    s->n = 3;
    static const uint32_t off[3] = {2, 0, 0}, gen[3] = {2, 0, 3};
    for (int i = 0; i < 3; i++) s->seq[i].offset = off[i], s->seq[i].n_gen = gen[i];
    s->tokens = V(g_tokens, 5 * 4);
    s->logprobs = V(g_lp, 5 * 4);
    s->sample_logprobs = V(g_slp, 5 * 4);
}

/* Version 6: a partial message whose tokens went on under newer weights (sample 0's two of version 40, then 41) */
static int32_t g_plag[5] = {1, 0, 0, 0, 0};
static void mk_partial_versions(ds4_wire_msg *m) {
    mk_partial(m);
    m->partial.token_versions = 1;
    m->partial.policy_lag = V(g_plag, sizeof g_plag);
}

static void mk_announce(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_WEIGHT_ANNOUNCE;
    m->announce.version = 42;
    m->announce.bytes = sizeof g_weights;
    m->announce.chunk = 16;
    m->announce.chunks = 3;
    m->announce.n_params = 10;
    strcpy(m->announce.dtype, "f32");
    m->announce.crc = ds4_crc32(0, g_weights, sizeof g_weights);
    m->announce.config = V(g_config, sizeof g_config - 1);
    m->announce.tokenizer = V(g_tokenizer, sizeof g_tokenizer - 1);
    m->announce.tables = V(g_tables, sizeof g_tables);
    m->announce.config_crc = ds4_crc32(0, g_config, sizeof g_config - 1);
    m->announce.tokenizer_crc = ds4_crc32(0, g_tokenizer, sizeof g_tokenizer - 1);
    m->announce.tables_crc = ds4_crc32(0, g_tables, sizeof g_tables);
    strcpy(m->announce.chat_template, "deepseek_v4");
}

/* A LoRA policy (version 4): the buffer is the adapters' (g_weights: 10 values), over a base of 100 parameters
 * published as version 41 in chunks of 64 bytes; 4 layers' site masks. */
static const int32_t g_masks[4] = {0xf9f, 0xfff, 0xfff, 0xf9f};
static void mk_lora_announce(ds4_wire_msg *m) {
    mk_announce(m);
    ds4_wire_weight_announce *a = &m->announce;
    a->n_params = 100;
    a->base_version = 41;
    a->base_chunk = 64;
    a->base_crc = 0x12345678u;
    a->lora_rank = 2;
    a->lora_alpha = 4.0;
    a->lora_rslora = 1;
    a->lora_masks = V(g_masks, sizeof g_masks);
}

static void mk_request(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_WEIGHT_REQUEST;
    m->request.version = 42;
    m->request.index = 2;
}

static void mk_chunk(ds4_wire_msg *m, uint32_t index) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_WEIGHT_CHUNK;
    ds4_wire_weight_chunk *c = &m->chunk;
    c->version = 42;
    c->index = index;
    c->offset = 16ull * index;
    c->bytes = sizeof g_weights;
    c->chunk = 16;
    size_t len = sizeof g_weights - c->offset < 16 ? sizeof g_weights - c->offset : 16;
    c->data = V((const char *)g_weights + c->offset, len);
    c->crc = ds4_crc32(0, c->data.data, len);
}

static void mk_heartbeat(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_HEARTBEAT;
    m->heartbeat.policy = 41;
    m->heartbeat.active = 3;
}

static void mk_error(ds4_wire_msg *m) {
    ds4_wire_make_error(m, DS4_WIRE_ECOUNT, "wire decode: samples: raw frame 1 'tokens' holds 8 elements, the sum of gen gives 9",
                        "samples", 77, 1);
}

static void mk_bye(ds4_wire_msg *m) {
    memset(m, 0, sizeof *m);
    m->type = DS4_WIRE_BYE;
    strcpy(m->bye.reason, "SIGTERM");
}

#define NSEED 17
static void mk_seed(int i, ds4_wire_msg *m) {
    switch (i) {
    case 0: mk_hello(m); break;
    case 1: mk_credit(m); break;
    case 2: mk_task(m); break;
    case 3: mk_samples(m, 1); break;
    case 4: mk_samples(m, 0); break;
    case 5: mk_announce(m); break;
    case 6: mk_request(m); break;
    case 7: mk_chunk(m, 0); break;
    case 8: mk_chunk(m, 2); break;
    case 9: mk_heartbeat(m); break;
    case 10: mk_error(m); break;
    case 11: mk_bye(m); break;
    case 12: mk_lora_announce(m); break;
    case 13: mk_samples_versions(m); break;
    case 14: mk_partial(m); break;
    case 16: mk_partial_versions(m); break;
    default:
        mk_task(m);
        m->task.stream = 16; /* version 5: a partial message every 16 tokens */
        break;
    }
}

/* ------------------------------------------------------------------------------------------------ 1. round trip */

static void test_round_trip(void) {
    for (int i = 0; i < NSEED; i++) {
        ds4_wire_msg m, back;
        ds4_wire_out out;
        ds4_error err;
        mk_seed(i, &m);
        const char *tn = ds4_wire_type_name(m.type);
        ds4_status st = ds4_wire_encode(&m, &out, &err);
        CHECK(st == DS4_OK, "%s: encode: %s", tn, st ? err.msg : "");
        if (st != DS4_OK) continue;
        memset(&err, 0, sizeof err);
        ds4_wire_code c = ds4_wire_decode(NULL, out.nframes, out.frames, out.lens, &back, &err);
        CHECK(c == DS4_WIRE_OK, "%s: decode: %s (%s)", tn, ds4_wire_error_name(c), err.msg);
        const char *field = NULL;
        CHECK(ds4_wire_equal(&m, &back, &field), "%s: field %s differs after the round trip", tn, field);
        CHECK(out.frames[0] == out.header && out.lens[0] > 0 && out.lens[0] < 512, "%s: header of %zu bytes", tn,
              out.lens[0]);
        /* the raw frames are the message's own bytes, never copies */
        if (m.type == DS4_WIRE_TASK) {
            CHECK(out.nframes == 2 && out.frames[1] == (const void *)g_prompt && back.task.prompt.data == g_prompt,
                  "task: prompt frame is not the caller's buffer");
            CHECK(ds4_wire_i32(back.task.prompt, 6) == 17, "task: prompt[6]");
        }
        if (m.type == DS4_WIRE_SAMPLES) {
            int routed = m.samples.experts_layers != 0;
            CHECK(out.nframes == (routed ? 6 : 4) + m.samples.token_versions, "samples: %d frames", out.nframes);
            if (m.samples.token_versions)
                CHECK(back.samples.policy_lag.data == g_lag && ds4_wire_i32(back.samples.policy_lag, 2) == 1 &&
                          back.samples.experts.data == g_experts,
                      "samples: the policy_lag frame, before the routing frames");
            CHECK(back.samples.tokens.data == g_tokens && back.samples.logprobs.data == g_lp &&
                      back.samples.sample_logprobs.data == g_slp,
                  "samples: frames are not the caller's buffers");
            CHECK(ds4_wire_f32(back.samples.logprobs, 1) == -1.25f, "samples: logprobs[1]");
            if (routed)
                CHECK(back.samples.experts.data == g_experts && back.samples.index.data == g_index &&
                          back.samples.experts.len == sizeof g_experts,
                      "samples: routing frames");
        }
        if (m.type == DS4_WIRE_PARTIAL)
            CHECK(out.nframes == 4 + back.partial.token_versions && back.partial.tokens.len == 20 && back.partial.seq[0].offset == 2 &&
                      back.partial.seq[2].n_gen == 3 && ds4_wire_i32(back.partial.tokens, 4) == 105,
                  "partial: offsets, counts and frames");
        if (m.type == DS4_WIRE_WEIGHT_CHUNK)
            CHECK(back.chunk.data.data == m.chunk.data.data && back.chunk.data.len == (m.chunk.index == 2 ? 8u : 16u),
                  "chunk: data view");
        /* limits: every message also decodes at the capacities, and equality notices a changed field */
        back.type = DS4_WIRE_NONE;
        CHECK(!ds4_wire_equal(&m, &back, &field) && field && strcmp(field, "type") == 0, "%s: equal() misses type", tn);
        ds4_wire_out_free(&out);
        CHECK(out.header == NULL && out.nframes == 0, "out_free clears");
    }
    /* names */
    CHECK(strcmp(ds4_wire_type_name(DS4_WIRE_WEIGHT_CHUNK), "weight_chunk") == 0, "type name");
    CHECK(strcmp(ds4_wire_error_name(DS4_WIRE_EVERSION), "version") == 0, "error name");
    CHECK(strcmp(ds4_wire_error_name(999), "unknown") == 0, "unknown error name");
    ds4_wire_limits l = ds4_wire_default_limits();
    CHECK(l.max_header_bytes == 65536 && l.max_frames == 16 && l.max_prompt_tokens == 4096 && l.max_samples == 64 &&
              l.max_gen_tokens == (1u << 20) && l.max_chunk_bytes == (16u << 20) && l.max_str_bytes == 256,
          "default limits");
}

/* ------------------------------------------------------------------------------------------------ patching */

/* A message as frames the test can change. */
typedef struct wmsg {
    int n;
    const void *f[20];
    size_t l[20];
    char hdr[1 << 17];
} wmsg;

static void from_out(wmsg *w, const ds4_wire_out *o) {
    w->n = o->nframes;
    memcpy(w->hdr, o->header, o->lens[0]);
    w->f[0] = w->hdr;
    w->l[0] = o->lens[0];
    for (int k = 1; k < o->nframes; k++) {
        w->f[k] = o->frames[k];
        w->l[k] = o->lens[k];
    }
}

/* Encode message m into w. */
static void load(wmsg *w, const ds4_wire_msg *m) {
    ds4_wire_out o;
    ds4_error err;
    memset(w, 0, sizeof *w);
    if (ds4_wire_encode(m, &o, &err) != DS4_OK) {
        CHECK(0, "fixture does not encode: %s", err.msg);
        return;
    }
    from_out(w, &o);
    ds4_wire_out_free(&o);
}

static msgpack_object mo_u(uint64_t v) {
    msgpack_object o;
    o.type = MSGPACK_OBJECT_POSITIVE_INTEGER;
    o.via.u64 = v;
    return o;
}
static msgpack_object mo_i(int64_t v) {
    msgpack_object o;
    if (v >= 0) return mo_u((uint64_t)v);
    o.type = MSGPACK_OBJECT_NEGATIVE_INTEGER;
    o.via.i64 = v;
    return o;
}
static msgpack_object mo_d(double v) {
    msgpack_object o;
    o.type = MSGPACK_OBJECT_FLOAT64;
    o.via.f64 = v;
    return o;
}
static msgpack_object mo_sn(const char *s, size_t n) {
    msgpack_object o;
    o.type = MSGPACK_OBJECT_STR;
    o.via.str.ptr = s;
    o.via.str.size = (uint32_t)n;
    return o;
}
static msgpack_object mo_s(const char *s) { return mo_sn(s, strlen(s)); }
static msgpack_object mo_b(int v) {
    msgpack_object o;
    o.type = MSGPACK_OBJECT_BOOLEAN;
    o.via.boolean = v != 0;
    return o;
}
static msgpack_object mo_arr(msgpack_object *items, uint32_t n) {
    msgpack_object o;
    o.type = MSGPACK_OBJECT_ARRAY;
    o.via.array.ptr = items;
    o.via.array.size = n;
    return o;
}

enum { P_SET, P_DEL, P_ADD, P_DUP };

/* Find the map holding the last component of path ("a.b.c": map at a.b, key c). */
static msgpack_object *walk(msgpack_object *root, const char *path, const char **leaf) {
    msgpack_object *o = root;
    const char *p = path;
    for (;;) {
        const char *dot = strchr(p, '.');
        if (!dot) {
            *leaf = p;
            return o;
        }
        size_t n = (size_t)(dot - p);
        msgpack_object *next = NULL;
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            msgpack_object *k = &o->via.map.ptr[i].key;
            if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, p, n) == 0)
                next = &o->via.map.ptr[i].val;
        }
        if (!next || next->type != MSGPACK_OBJECT_MAP) return NULL;
        o = next;
        p = dot + 1;
    }
}

/* Rewrite w's header: op on the key at path (SET: replace its value; DEL: remove it; ADD: add key with val
 * (the key need not exist); DUP: append a second entry with the same key and val). */
static void patch(wmsg *w, int op, const char *path, msgpack_object val) {
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    if (msgpack_unpack_next(&up, w->hdr, w->l[0], &off) != MSGPACK_UNPACK_SUCCESS) {
        CHECK(0, "patch %s: the header does not unpack", path);
        msgpack_unpacked_destroy(&up);
        return;
    }
    const char *leaf;
    msgpack_object *map = walk(&up.data, path, &leaf);
    msgpack_object_kv *grown = NULL;
    if (!map) {
        CHECK(0, "patch: no map for %s", path);
    } else {
        uint32_t n = map->via.map.size, at = n;
        for (uint32_t i = 0; i < n; i++) {
            msgpack_object *k = &map->via.map.ptr[i].key;
            if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(leaf) &&
                memcmp(k->via.str.ptr, leaf, k->via.str.size) == 0)
                at = i;
        }
        if ((op == P_SET || op == P_DEL) && at == n) CHECK(0, "patch: no key %s", path);
        if (op == P_SET && at < n) map->via.map.ptr[at].val = val;
        if (op == P_DEL && at < n) {
            memmove(&map->via.map.ptr[at], &map->via.map.ptr[at + 1], (n - at - 1) * sizeof(msgpack_object_kv));
            map->via.map.size--;
        }
        if (op == P_ADD || op == P_DUP) {
            grown = malloc((n + 1) * sizeof *grown);
            if (n) memcpy(grown, map->via.map.ptr, n * sizeof *grown);
            grown[n].key = mo_s(leaf);
            grown[n].val = val;
            map->via.map.ptr = grown;
            map->via.map.size = n + 1;
        }
    }
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_object(&pk, up.data);
    if (sb.size <= sizeof w->hdr) {
        memcpy(w->hdr, sb.data, sb.size);
        w->l[0] = sb.size;
    }
    msgpack_sbuffer_destroy(&sb);
    free(grown);
    msgpack_unpacked_destroy(&up);
}

static int g_verbose = 0;

/* Decode w and expect code want with needle in the message. */
static void expect_lim(int line, const char *what, const wmsg *w, const ds4_wire_limits *lim, ds4_wire_code want,
                       const char *needle) {
    ds4_wire_msg m;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_wire_code c = ds4_wire_decode(lim, w->n, w->f, w->l, &m, &err);
    CHECK(c == want, "line %d (%s): got %s (%s), wanted %s", line, what, ds4_wire_error_name(c),
          c ? err.msg : "accepted", ds4_wire_error_name(want));
    if (c == DS4_WIRE_OK) return;
    CHECK(strncmp(err.msg, "wire decode: ", 13) == 0, "line %d (%s): message lacks the stage: %s", line, what, err.msg);
    CHECK(err.code == (c == DS4_WIRE_EARG ? DS4_ERR_ARG : DS4_ERR_FORMAT), "line %d (%s): status %s", line, what,
          ds4_status_name(err.code));
    if (needle) CHECK(strstr(err.msg, needle) != NULL, "line %d (%s): wanted '%s' in: %s", line, what, needle, err.msg);
    if (g_verbose || getenv("WIRE_VERBOSE")) printf("  %-40s %-11s %s\n", what, ds4_wire_error_name(c), err.msg);
}
#define EXPECT(what, w, want, needle) expect_lim(__LINE__, (what), (w), NULL, (want), (needle))
#define EXPECT_LIM(what, w, lim, want, needle) expect_lim(__LINE__, (what), (w), (lim), (want), (needle))

/* ------------------------------------------------------------------------------------------------ 2. rejects */

static void test_rejects(void) {
    static wmsg w; /* big: not on the stack */
    ds4_wire_msg m;
    ds4_wire_limits lim;

    /* --- frames and sizes, checked before the header is read */
    mk_credit(&m);
    load(&w, &m);
    EXPECT("valid credit", &w, DS4_WIRE_OK, NULL);
    w.n = 0;
    EXPECT("no frames", &w, DS4_WIRE_EFRAME, "header frame is missing");
    w.n = 17;
    EXPECT("too many frames (17)", &w, DS4_WIRE_ELIMIT, "17 frames in one message, limit 16");
    lim = ds4_wire_default_limits();
    lim.max_frames = 4;
    w.n = 5;
    EXPECT_LIM("too many frames (limit 4)", &w, &lim, DS4_WIRE_ELIMIT, "5 frames in one message, limit 4");
    mk_task(&m);
    load(&w, &m);
    lim = ds4_wire_default_limits();
    lim.max_header_bytes = 32;
    EXPECT_LIM("header over the limit", &w, &lim, DS4_WIRE_ELIMIT, "header frame of");
    lim = ds4_wire_default_limits();
    lim.max_frame_bytes = 16;
    EXPECT_LIM("raw frame over the limit", &w, &lim, DS4_WIRE_ELIMIT, "raw frame 1 is 28 bytes, limit 16");
    lim = ds4_wire_default_limits();
    lim.max_samples = 1000;
    EXPECT_LIM("limits over their caps", &w, &lim, DS4_WIRE_EARG, "max_samples = 1000 is outside [1, 256]");
    {
        ds4_wire_msg out;
        ds4_error err;
        CHECK(ds4_wire_decode(NULL, w.n, NULL, w.l, &out, &err) == DS4_WIRE_EARG, "NULL frames");
        CHECK(ds4_wire_decode(NULL, w.n, w.f, w.l, NULL, &err) == DS4_WIRE_EARG, "NULL out");
        CHECK(ds4_wire_decode(NULL, w.n, w.f, w.l, &out, NULL) == DS4_WIRE_OK, "NULL err is fine");
    }
    /* a 70 KB header with the default limits */
    {
        static char big[70000];
        memset(big, 'a', sizeof big);
        load(&w, &m);
        patch(&w, P_ADD, "padding", mo_sn(big, sizeof big));
        EXPECT("header of 70 KB", &w, DS4_WIRE_ELIMIT, "header frame of 7");
    }

    /* --- the header as msgpack */
    mk_task(&m);
    load(&w, &m);
    w.l[0] -= 3;
    EXPECT("truncated header", &w, DS4_WIRE_EPARSE, "truncated");
    load(&w, &m);
    w.l[0] = 1;
    EXPECT("header of one byte", &w, DS4_WIRE_EPARSE, "truncated");
    w.l[0] = 0;
    EXPECT("empty header", &w, DS4_WIRE_EPARSE, "empty header");
    load(&w, &m);
    memcpy(w.hdr + w.l[0], "xx", 2);
    w.l[0] += 2;
    EXPECT("trailing garbage", &w, DS4_WIRE_ETRAILING, "2 trailing bytes");
    load(&w, &m);
    memcpy(w.hdr, "\x92\x01\x02", 3);
    w.l[0] = 3;
    EXPECT("not a map (array)", &w, DS4_WIRE_ENOTMAP, "must be a msgpack map, its first byte is 0x92");
    memcpy(w.hdr, "\xa3" "abc", 4);
    w.l[0] = 4;
    EXPECT("not a map (str)", &w, DS4_WIRE_ENOTMAP, "must be a msgpack map");
    /* msgpack-c would allocate ~100 GB for these: the walk refuses them first */
    memcpy(w.hdr, "\xdf\xff\xff\xff\xff", 5);
    w.l[0] = 5;
    EXPECT("map32 declaring 2^32-1 entries", &w, DS4_WIRE_EPARSE, "declares 4294967295 entries, 0 bytes remain");
    memcpy(w.hdr, "\x81\xa1v\xdd\xff\xff\xff\xff\x00", 9);
    w.l[0] = 9;
    EXPECT("array32 declaring 2^32-1 entries", &w, DS4_WIRE_EPARSE, "declares 4294967295 entries, 1 bytes remain");
    memcpy(w.hdr, "\x81\xa1v\xdb\x7f\xff\xff\xff", 8);
    w.l[0] = 8;
    EXPECT("str32 of 2 GB", &w, DS4_WIRE_EPARSE, "needs 2147483647 more bytes");
    memcpy(w.hdr, "\x81\xa1v\xc1", 4);
    w.l[0] = 4;
    EXPECT("invalid byte 0xc1", &w, DS4_WIRE_EPARSE, "0xc1");
    memcpy(w.hdr, "\x81\xa1v\xd4\x01\x02", 6);
    w.l[0] = 6;
    EXPECT("ext type", &w, DS4_WIRE_EPARSE, "ext type");
    {
        /* {"v": [[[[[[[[[1]]]]]]]]]}: nine nested arrays */
        unsigned char deep[16] = {0x81, 0xa1, 'v'};
        for (int i = 0; i < 9; i++) deep[3 + i] = 0x91;
        deep[12] = 0x01;
        memcpy(w.hdr, deep, 13);
        w.l[0] = 13;
        EXPECT("nesting deeper than 8", &w, DS4_WIRE_ELIMIT, "nested deeper than 8");
    }

    /* --- version and type */
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(1));
    EXPECT("a version 1 peer", &w, DS4_WIRE_EVERSION, "protocol version 1, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(2));
    EXPECT("a version 2 peer", &w, DS4_WIRE_EVERSION, "protocol version 2, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(3));
    EXPECT("a version 3 peer (no LoRA policies)", &w, DS4_WIRE_EVERSION, "protocol version 3, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(4));
    EXPECT("a version 4 peer (no streaming, no per-token versions)", &w, DS4_WIRE_EVERSION,
           "protocol version 4, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(5));
    EXPECT("a version 5 peer (partial messages without per-token versions)", &w, DS4_WIRE_EVERSION,
           "protocol version 5, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(7));
    EXPECT("wrong version", &w, DS4_WIRE_EVERSION, "protocol version 7, this build speaks version 6");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_i(-1));
    EXPECT("negative version", &w, DS4_WIRE_EVERSION, "protocol version -1");
    /* another version may have other keys: the version is judged before anything else in the map */
    load(&w, &m);
    patch(&w, P_SET, "v", mo_u(1));
    patch(&w, P_ADD, "future_key", mo_u(1));
    EXPECT("wrong version with unknown keys", &w, DS4_WIRE_EVERSION, "protocol version 1");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_s("1"));
    EXPECT("version as a string", &w, DS4_WIRE_EVALTYPE, "'v' must be an unsigned integer, got str");
    load(&w, &m);
    patch(&w, P_SET, "v", mo_b(1));
    EXPECT("version as a bool", &w, DS4_WIRE_EVALTYPE, "'v' must be an unsigned integer, got bool");
    load(&w, &m);
    patch(&w, P_DEL, "v", mo_u(0));
    EXPECT("missing version", &w, DS4_WIRE_EMISSING, "'v'");
    load(&w, &m);
    patch(&w, P_SET, "t", mo_s("bogus"));
    EXPECT("unknown type", &w, DS4_WIRE_ETYPE, "unknown message type 'bogus'");
    load(&w, &m);
    patch(&w, P_SET, "t", mo_sn("tas\x01k", 5));
    EXPECT("unknown type, control byte", &w, DS4_WIRE_ETYPE, "unknown message type 'tas?k'");
    load(&w, &m);
    patch(&w, P_DEL, "t", mo_u(0));
    EXPECT("missing type", &w, DS4_WIRE_EMISSING, "'t'");

    /* --- schema */
    load(&w, &m);
    patch(&w, P_DEL, "attempt", mo_u(0));
    EXPECT("missing required key", &w, DS4_WIRE_EMISSING, "missing required key 'attempt'");
    load(&w, &m);
    patch(&w, P_DEL, "sampling.seed", mo_u(0));
    EXPECT("missing nested key", &w, DS4_WIRE_EMISSING, "missing required key 'sampling.seed'");
    {
        ds4_wire_msg out;
        ds4_error err;
        ds4_wire_decode(NULL, w.n, w.f, w.l, &out, &err);
        CHECK(out.type == DS4_WIRE_TASK && out.task.task_id == 0, "a failed decode names its type, fields zeroed");
    }
    load(&w, &m);
    patch(&w, P_SET, "attempt", mo_s("one"));
    EXPECT("wrong value type", &w, DS4_WIRE_EVALTYPE, "'attempt' must be an unsigned integer, got str");
    load(&w, &m);
    patch(&w, P_SET, "sampling.ignore_eos", mo_u(1));
    EXPECT("bool as integer", &w, DS4_WIRE_EVALTYPE, "'sampling.ignore_eos' must be a bool");
    load(&w, &m);
    patch(&w, P_SET, "sampling", mo_u(1));
    EXPECT("nested map as integer", &w, DS4_WIRE_EVALTYPE, "'sampling' must be a map");
    load(&w, &m);
    patch(&w, P_SET, "sampling.top_k", mo_u(2147483648u));
    EXPECT("integer out of range", &w, DS4_WIRE_ERANGE, "'sampling.top_k' = 2147483648 is out of range [0, 2147483647]");
    load(&w, &m);
    patch(&w, P_SET, "attempt", mo_i(-3));
    EXPECT("negative unsigned", &w, DS4_WIRE_ERANGE, "'attempt' = -3 is out of range");
    load(&w, &m);
    patch(&w, P_SET, "task", mo_u(9007199254740992ull));
    EXPECT("task id past 2^53-1", &w, DS4_WIRE_ERANGE, "'task' = 9007199254740992 is out of range");
    load(&w, &m);
    patch(&w, P_SET, "sampling.top_p", mo_d(1.5));
    EXPECT("float out of range", &w, DS4_WIRE_ERANGE, "'sampling.top_p' = 1.5 is out of range [0, 1]");
    load(&w, &m);
    patch(&w, P_SET, "sampling.temperature", mo_d(NAN));
    EXPECT("NaN temperature", &w, DS4_WIRE_ERANGE, "'sampling.temperature' = ");
    load(&w, &m);
    patch(&w, P_SET, "sampling.temperature", mo_u(1));
    EXPECT("integer accepted as a number", &w, DS4_WIRE_OK, NULL);
    {
        msgpack_object st[2] = {mo_u(5), mo_i(-7)};
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop", mo_arr(st, 2));
        EXPECT("negative stop id", &w, DS4_WIRE_ERANGE, "'sampling.stop[1]' = -7");
    }
    {
        /* stop strings (version 3): strings of 1..64 bytes without NUL, at most 16 */
        static const char long65[] = "0123456789012345678901234567890123456789012345678901234567890123X";
        msgpack_object st[2] = {mo_s("ok"), mo_u(5)};
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop_strings", mo_arr(st, 2));
        EXPECT("stop string not a string", &w, DS4_WIRE_EVALTYPE, "'sampling.stop_strings[1]' must be a string");
        st[1] = mo_s("");
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop_strings", mo_arr(st, 2));
        EXPECT("empty stop string", &w, DS4_WIRE_ERANGE, "'sampling.stop_strings[1]' is 0 bytes");
        st[1] = mo_s(long65);
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop_strings", mo_arr(st, 2));
        EXPECT("stop string of 65 bytes", &w, DS4_WIRE_ELIMIT, "'sampling.stop_strings[1]' is 65 bytes, limit 64");
        msgpack_object many[17];
        for (int i = 0; i < 17; i++) many[i] = mo_s("x");
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop_strings", mo_arr(many, 17));
        EXPECT("17 stop strings", &w, DS4_WIRE_ELIMIT, "'sampling.stop_strings' has 17 elements, limit 16");
    }
    {
        static msgpack_object st[65];
        for (int i = 0; i < 65; i++) st[i] = mo_u((uint64_t)i);
        load(&w, &m);
        patch(&w, P_SET, "sampling.stop", mo_arr(st, 65));
        EXPECT("too many stop ids", &w, DS4_WIRE_ELIMIT, "'sampling.stop' has 65 elements, limit 64");
    }
    load(&w, &m);
    patch(&w, P_SET, "sampling.n", mo_u(65));
    EXPECT("task asks for too many samples", &w, DS4_WIRE_ELIMIT, "sampling.n = 65 samples, limit 64");
    load(&w, &m);
    patch(&w, P_SET, "sampling.max_new_tokens", mo_u(65537));
    EXPECT("n * max_new_tokens over the limit", &w, DS4_WIRE_ELIMIT, "16 * 65537 tokens");
    load(&w, &m);
    patch(&w, P_SET, "prompt_len", mo_u(4097));
    EXPECT("prompt over the limit", &w, DS4_WIRE_ELIMIT, "prompt_len = 4097 tokens, limit 4096");
    load(&w, &m);
    patch(&w, P_ADD, "colour", mo_s("blue"));
    EXPECT("unknown key", &w, DS4_WIRE_EKEY, "unknown key 'colour'");
    load(&w, &m);
    patch(&w, P_ADD, "sampling.beam", mo_u(4));
    EXPECT("unknown nested key", &w, DS4_WIRE_EKEY, "unknown key 'sampling.beam'");
    load(&w, &m);
    patch(&w, P_DUP, "task", mo_u(5));
    EXPECT("duplicate key", &w, DS4_WIRE_EDUP, "duplicate key 'task'");
    load(&w, &m);
    patch(&w, P_DUP, "sampling.seed", mo_u(5));
    EXPECT("duplicate nested key", &w, DS4_WIRE_EDUP, "duplicate key 'sampling.seed'");
    load(&w, &m);
    patch(&w, P_DUP, "v", mo_u(1));
    EXPECT("duplicate version key", &w, DS4_WIRE_EDUP, "duplicate key 'v'");
    {
        /* {"v": 6, "t": "credit", "n": 1, 7: 1}: a key that is not a string */
        memcpy(w.hdr, "\x84\xa1v\x06\xa1t\xa6" "credit\xa1n\x01\x07\x01", 18);
        w.l[0] = 18;
        w.n = 1;
        EXPECT("integer key", &w, DS4_WIRE_EKEY, "key 3 is not a string (unsigned integer)");
    }
    {
        static msgpack_object items[40];
        static msgpack_object_kv kv[40];
        (void)items;
        for (int i = 0; i < 40; i++) {
            static char names[40][8];
            snprintf(names[i], sizeof names[i], "k%d", i);
            kv[i].key = mo_s(names[i]);
            kv[i].val = mo_u(1);
        }
        kv[0].key = mo_s("v");
        kv[1].key = mo_s("t");
        kv[1].val = mo_s("credit");
        msgpack_object root;
        root.type = MSGPACK_OBJECT_MAP;
        root.via.map.ptr = kv;
        root.via.map.size = 40;
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_object(&pk, root);
        memcpy(w.hdr, sb.data, sb.size);
        w.l[0] = sb.size;
        msgpack_sbuffer_destroy(&sb);
        EXPECT("map of 40 entries", &w, DS4_WIRE_ELIMIT, "header map has 40 entries, at most 32");
    }

    /* --- strings */
    mk_hello(&m);
    load(&w, &m);
    EXPECT("valid hello", &w, DS4_WIRE_OK, NULL);
    patch(&w, P_SET, "caps.vocab_size", mo_u(0));
    EXPECT("hello: vocab 0 with parameters", &w, DS4_WIRE_ERANGE, "both 0 (no model) or neither");
    patch(&w, P_SET, "caps.n_params", mo_u(0));
    EXPECT("hello without a model", &w, DS4_WIRE_OK, NULL);
    load(&w, &m);
    {
        static char s257[257];
        memset(s257, 'b', sizeof s257);
        patch(&w, P_SET, "caps.build", mo_sn(s257, 257));
        EXPECT("string too long", &w, DS4_WIRE_ELIMIT, "string 'caps.build' is 257 bytes, limit 256");
        load(&w, &m);
        patch(&w, P_SET, "worker", mo_sn(s257, 65));
        EXPECT("worker id too long", &w, DS4_WIRE_ELIMIT, "string 'worker' is 65 bytes, limit 64");
        load(&w, &m);
        lim = ds4_wire_default_limits();
        lim.max_str_bytes = 8;
        EXPECT_LIM("string over a lowered limit", &w, &lim, DS4_WIRE_ELIMIT, "limit 8");
    }
    load(&w, &m);
    patch(&w, P_SET, "worker", mo_s("gpu node"));
    EXPECT("worker id with a space", &w, DS4_WIRE_ERANGE, "printable ASCII without spaces");
    load(&w, &m);
    patch(&w, P_SET, "worker", mo_s(""));
    EXPECT("empty worker id", &w, DS4_WIRE_ERANGE, "is 0 bytes, at least 1");
    load(&w, &m);
    patch(&w, P_SET, "caps.build", mo_sn("a\0b", 3));
    EXPECT("string with NUL", &w, DS4_WIRE_ERANGE, "contains a NUL byte");
    load(&w, &m);
    patch(&w, P_SET, "caps.threads", mo_u(0));
    EXPECT("zero threads", &w, DS4_WIRE_ERANGE, "'caps.threads' = 0 is out of range [1, 4096]");

    /* --- frames against their declarations */
    mk_task(&m);
    load(&w, &m);
    w.f[2] = g_prompt;
    w.l[2] = 4;
    w.n = 3;
    EXPECT("frame count mismatch (one extra)", &w, DS4_WIRE_EFRAME, "the header declares 1 raw frames, the message has 2");
    load(&w, &m);
    w.n = 1;
    EXPECT("frame count mismatch (missing)", &w, DS4_WIRE_EFRAME, "the header declares 1 raw frames, the message has 0");
    load(&w, &m);
    w.l[1] = 26;
    EXPECT("prompt frame misaligned", &w, DS4_WIRE_EFRAME, "raw frame 1 'prompt' is 26 bytes, not a multiple of 4");
    load(&w, &m);
    w.l[1] = 24;
    EXPECT("prompt frame shorter than declared", &w, DS4_WIRE_EFRAME, "declared 7 i32 elements, the frame holds 6");
    {
        msgpack_object e[3] = {mo_s("prompt"), mo_s("i32"), mo_u(6)}, f[1];
        f[0] = mo_arr(e, 3);
        load(&w, &m);
        w.l[1] = 24;
        patch(&w, P_SET, "f", mo_arr(f, 1));
        EXPECT("prompt_len != prompt frame", &w, DS4_WIRE_ECOUNT, "holds 6 elements, prompt_len gives 7");
        e[1] = mo_s("f32");
        e[2] = mo_u(7);
        load(&w, &m);
        patch(&w, P_SET, "f", mo_arr(f, 1));
        EXPECT("wrong dtype", &w, DS4_WIRE_EFRAME, "declared dtype 'f32', expected 'i32'");
        e[0] = mo_s("tokens");
        e[1] = mo_s("i32");
        load(&w, &m);
        patch(&w, P_SET, "f", mo_arr(f, 1));
        EXPECT("wrong frame name", &w, DS4_WIRE_EFRAME, "raw frame 1 is declared 'tokens', expected 'prompt'");
        f[0] = mo_u(3);
        load(&w, &m);
        patch(&w, P_SET, "f", mo_arr(f, 1));
        EXPECT("frame declaration not an array", &w, DS4_WIRE_EVALTYPE, "'f[0]' must be a [name, dtype, count] array");
    }
    mk_credit(&m);
    load(&w, &m);
    w.f[1] = g_prompt;
    w.l[1] = 4;
    w.n = 2;
    EXPECT("frame on a frameless message", &w, DS4_WIRE_EFRAME, "the header declares 0 raw frames, the message has 1");

    /* --- samples */
    mk_samples(&m, 1);
    load(&w, &m);
    EXPECT("valid samples", &w, DS4_WIRE_OK, NULL);
    w.l[1] = 34;
    EXPECT("token frame size not a multiple of 4", &w, DS4_WIRE_EFRAME,
           "raw frame 1 'tokens' is 34 bytes, not a multiple of 4 (i32)");
    {
        msgpack_object g[3] = {mo_u(4), mo_u(0), mo_u(4)};
        load(&w, &m);
        patch(&w, P_SET, "gen", mo_arr(g, 3));
        EXPECT("sum of token counts != frame elements", &w, DS4_WIRE_ECOUNT,
               "raw frame 1 'tokens' holds 9 elements, the sum of gen gives 8");
        msgpack_object g2[2] = {mo_u(4), mo_u(5)};
        load(&w, &m);
        patch(&w, P_SET, "gen", mo_arr(g2, 2));
        EXPECT("per-sample array length != n", &w, DS4_WIRE_ECOUNT, "'gen' has 2 elements, n = 3 samples");
        msgpack_object r[3] = {mo_u(10), mo_u(6), mo_u(13)};
        load(&w, &m);
        patch(&w, P_SET, "rows", mo_arr(r, 3));
        EXPECT("rows past prompt + gen", &w, DS4_WIRE_ERANGE, "'rows[2]' = 13 is out of range [0, 12]");
        msgpack_object r2[3] = {mo_u(10), mo_u(6), mo_u(10)};
        load(&w, &m);
        patch(&w, P_SET, "rows", mo_arr(r2, 3));
        EXPECT("rows != experts frame", &w, DS4_WIRE_ECOUNT, "'experts' holds 162 elements, sum(rows) * L * K gives 156");
        msgpack_object si[3] = {mo_i(-1), mo_i(-1), mo_i(-1)};
        load(&w, &m);
        patch(&w, P_SET, "stop_index", mo_arr(si, 3));
        EXPECT("stop_token without stop_index", &w, DS4_WIRE_ERANGE, "stop_index[2] = -1 with finish[2] = stop_token");
        msgpack_object fi[3] = {mo_u(1), mo_u(6), mo_u(3)};
        load(&w, &m);
        patch(&w, P_SET, "finish", mo_arr(fi, 3));
        EXPECT("finish out of range", &w, DS4_WIRE_ERANGE, "'finish[1]' = 6 is out of range [1, 5]");
        msgpack_object sh[3] = {mo_u(2), mo_u(3), mo_u(1)};
        load(&w, &m);
        patch(&w, P_SET, "experts_shape", mo_arr(sh, 3));
        EXPECT("experts_shape of 3", &w, DS4_WIRE_ELIMIT, "'experts_shape' has 3 elements, limit 2");
    }
    load(&w, &m);
    w.n = 5;
    EXPECT("routing frame missing", &w, DS4_WIRE_EFRAME, "the header declares 5 raw frames, the message has 4");
    /* version 5: per-token versions and partial messages */
    mk_samples_versions(&m);
    load(&w, &m);
    EXPECT("samples with per-token versions", &w, DS4_WIRE_OK, NULL);
    {
        static int32_t lag[9] = {2, 2, 1, 0, 0, 0, 41, 0, 0}; /* version 41 - 41 = 0: none */
        load(&w, &m);
        w.f[4] = lag;
        EXPECT("a token of version 0", &w, DS4_WIRE_ERANGE, "policy_lag[6] = 41: a token's version");
        static int32_t neg[9] = {2, 2, 1, 0, -1, 0, 0, 0, 0};
        load(&w, &m);
        w.f[4] = neg;
        EXPECT("a token newer than the answer's policy", &w, DS4_WIRE_ERANGE, "policy_lag[4] = -1");
        load(&w, &m);
        patch(&w, P_SET, "token_versions", mo_b(0));
        EXPECT("a policy_lag frame without token_versions", &w, DS4_WIRE_EFRAME, "has 5");
    }
    mk_partial(&m);
    load(&w, &m);
    EXPECT("valid partial", &w, DS4_WIRE_OK, NULL);
    {
        msgpack_object g[3] = {mo_u(2), mo_u(0), mo_u(2)};
        load(&w, &m);
        patch(&w, P_SET, "gen", mo_arr(g, 3));
        EXPECT("partial: sum of gen != frame elements", &w, DS4_WIRE_ECOUNT,
               "raw frame 1 'tokens' holds 5 elements, the sum of gen gives 4");
        msgpack_object o[2] = {mo_u(2), mo_u(0)};
        load(&w, &m);
        patch(&w, P_SET, "offset", mo_arr(o, 2));
        EXPECT("partial: offset of 2 samples, n = 3", &w, DS4_WIRE_ECOUNT, "'offset' has 2 elements, n = 3 samples");
        load(&w, &m);
        patch(&w, P_DEL, "offset", mo_u(0));
        EXPECT("partial without offsets", &w, DS4_WIRE_EMISSING, "offset");
        load(&w, &m);
        patch(&w, P_ADD, "finish", mo_u(1));
        EXPECT("partial with a finish", &w, DS4_WIRE_EKEY, "finish");
    }
    /* version 6: a partial message's per-token versions */
    mk_partial_versions(&m);
    load(&w, &m);
    EXPECT("partial with per-token versions", &w, DS4_WIRE_OK, NULL);
    {
        static int32_t lag[5] = {1, 0, 0, 41, 0}; /* version 41 - 41 = 0: none */
        load(&w, &m);
        w.f[4] = lag;
        EXPECT("partial: a token of version 0", &w, DS4_WIRE_ERANGE, "policy_lag[3] = 41: a token's version");
        load(&w, &m);
        patch(&w, P_SET, "token_versions", mo_b(0));
        EXPECT("partial: a policy_lag frame without token_versions", &w, DS4_WIRE_EFRAME, "has 3");
        mk_partial(&m);
        load(&w, &m);
        patch(&w, P_SET, "token_versions", mo_b(1));
        EXPECT("partial: token_versions without the frame", &w, DS4_WIRE_EFRAME, "has 4");
    }
    mk_task(&m);
    m.task.stream = 16;
    load(&w, &m);
    EXPECT("task with streaming", &w, DS4_WIRE_OK, NULL);
    mk_samples(&m, 0);
    load(&w, &m);
    {
        msgpack_object r[3] = {mo_u(1), mo_u(1), mo_u(1)};
        patch(&w, P_ADD, "rows", mo_arr(r, 3));
        EXPECT("rows without routing frames", &w, DS4_WIRE_ERANGE, "'rows' without experts_shape");
    }
    {
        /* 65 samples encode (the capacity is 256) but exceed the default limit of 64 */
        static ds4_wire_msg big;
        memset(&big, 0, sizeof big);
        big.type = DS4_WIRE_SAMPLES;
        big.samples.n = 65;
        for (int i = 0; i < 65; i++) {
            big.samples.seq[i].prompt_len = 1;
            big.samples.seq[i].finish = DS4_FINISH_CANCELLED;
            big.samples.seq[i].stop_index = -1;
        }
        load(&w, &big);
        EXPECT("too many samples", &w, DS4_WIRE_ELIMIT, "n = 65 samples in one message, limit 64");
        lim = ds4_wire_default_limits();
        lim.max_samples = 65;
        EXPECT_LIM("65 samples under a raised limit", &w, &lim, DS4_WIRE_OK, NULL);
        big.samples.n = 2;
        big.samples.seq[0].n_gen = 600000;
        big.samples.seq[1].n_gen = 600000;
        static int32_t none[1];
        big.samples.tokens = V(none, 1200000u * 4);   /* never read: only lengths are checked */
        big.samples.logprobs = V(none, 1200000u * 4);
        big.samples.sample_logprobs = V(none, 1200000u * 4);
        load(&w, &big);
        EXPECT("too many generated tokens", &w, DS4_WIRE_ELIMIT, "add up to 1200000 generated tokens, limit 1048576");
    }

    /* --- weights */
    mk_announce(&m);
    load(&w, &m);
    EXPECT("valid announce", &w, DS4_WIRE_OK, NULL);
    patch(&w, P_SET, "chunks", mo_u(4));
    EXPECT("chunks != ceil(bytes/chunk)", &w, DS4_WIRE_ERANGE, "chunks = 4, but 40 bytes in chunks of 16 make 3");
    load(&w, &m);
    patch(&w, P_SET, "layout.dtype", mo_s("bf16"));
    EXPECT("dtype other than f32", &w, DS4_WIRE_ERANGE, "layout.dtype 'bf16' is not supported");
    load(&w, &m);
    patch(&w, P_SET, "layout.n_params", mo_u(11));
    EXPECT("bytes != 4 n_params", &w, DS4_WIRE_ERANGE, "bytes = 40 is not layout.n_params = 11 times 4");
    load(&w, &m);
    patch(&w, P_SET, "chunk", mo_u(17u << 20));
    EXPECT("announced chunk over the limit", &w, DS4_WIRE_ELIMIT, "weight chunk size 17825792 bytes, limit 16777216");
    load(&w, &m);
    patch(&w, P_SET, "bytes", mo_u(1ull << 45));
    EXPECT("announced weights over the limit", &w, DS4_WIRE_ELIMIT, "weights of 35184372088832 bytes, limit 17592186044416");
    /* the model frames: a worker builds its model from them, so each is checked against its CRC */
    load(&w, &m);
    patch(&w, P_SET, "model.tables_crc", mo_u(m.announce.tables_crc ^ 1u));
    EXPECT("announce tables CRC mismatch", &w, DS4_WIRE_ECRC, "the tables frame (24 bytes): CRC-32");
    load(&w, &m);
    patch(&w, P_SET, "model.config_crc", mo_u(m.announce.config_crc ^ 1u));
    EXPECT("announce config CRC mismatch", &w, DS4_WIRE_ECRC, "the config frame");
    load(&w, &m);
    patch(&w, P_SET, "model.tokenizer_crc", mo_u(m.announce.tokenizer_crc ^ 1u));
    EXPECT("announce tokenizer CRC mismatch", &w, DS4_WIRE_ECRC, "the tokenizer frame");
    load(&w, &m);
    patch(&w, P_DEL, "model", mo_u(0));
    EXPECT("announce without its model", &w, DS4_WIRE_EMISSING, "model");
    load(&w, &m);
    w.l[3] = 20;
    EXPECT("announce tables frame shorter than declared", &w, DS4_WIRE_EFRAME, "declared 6 i32 elements");
    /* a LoRA policy: bytes are the adapters', the base is another version; its map and its frame go together */
    mk_lora_announce(&m);
    load(&w, &m);
    EXPECT("valid LoRA announce", &w, DS4_WIRE_OK, NULL);
    patch(&w, P_SET, "adapter.base_version", mo_u(42));
    EXPECT("LoRA base not older than the version", &w, DS4_WIRE_ERANGE, "adapter.base_version = 42 is not older");
    load(&w, &m);
    patch(&w, P_SET, "adapter.base_chunk", mo_u(62));
    EXPECT("LoRA base chunk not f32", &w, DS4_WIRE_ERANGE, "must be multiples of 4");
    load(&w, &m);
    patch(&w, P_SET, "adapter.rank", mo_u(0));
    EXPECT("LoRA rank 0", &w, DS4_WIRE_ERANGE, "adapter.rank");
    load(&w, &m);
    patch(&w, P_DEL, "adapter.rslora", mo_u(0));
    EXPECT("LoRA map without rslora", &w, DS4_WIRE_EMISSING, "adapter.rslora");
    load(&w, &m);
    patch(&w, P_ADD, "adapter.dropout", mo_u(0));
    EXPECT("LoRA map with an unknown key", &w, DS4_WIRE_EKEY, "dropout");
    load(&w, &m);
    patch(&w, P_DEL, "adapter", mo_u(0));
    EXPECT("lora_masks frame without the adapter map", &w, DS4_WIRE_ERANGE, "bytes = 40 is not layout.n_params = 100");
    load(&w, &m);
    w.n = 4; /* the masks frame dropped (its declaration stays) */
    EXPECT("adapter map without the lora_masks frame", &w, DS4_WIRE_EFRAME, NULL);

    mk_chunk(&m, 2);
    load(&w, &m);
    EXPECT("valid last chunk", &w, DS4_WIRE_OK, NULL);
    patch(&w, P_SET, "offset", mo_u(40));
    EXPECT("chunk offset beyond the announced size", &w, DS4_WIRE_ERANGE,
           "chunk offset 40 is beyond the announced size of 40 bytes");
    load(&w, &m);
    patch(&w, P_SET, "offset", mo_u(24));
    EXPECT("chunk offset != index * chunk", &w, DS4_WIRE_ERANGE, "chunk 2 starts at byte 24, not index * chunk = 32");
    load(&w, &m);
    patch(&w, P_SET, "index", mo_u(3));
    patch(&w, P_SET, "offset", mo_u(48));
    EXPECT("chunk offset past the end (index 3)", &w, DS4_WIRE_ERANGE, "beyond the announced size");
    load(&w, &m);
    w.l[1] = 16;
    EXPECT("last chunk too long", &w, DS4_WIRE_EFRAME, "declared 2 f32 elements, the frame holds 4");
    load(&w, &m);
    patch(&w, P_SET, "crc", mo_u(m.chunk.crc ^ 1u));
    EXPECT("chunk CRC mismatch", &w, DS4_WIRE_ECRC, "CRC-32");
    mk_chunk(&m, 0);
    load(&w, &m);
    lim = ds4_wire_default_limits();
    lim.max_chunk_bytes = 8;
    EXPECT_LIM("oversized weight chunk (limit 8)", &w, &lim, DS4_WIRE_ELIMIT,
               "raw frame 1 is 16 bytes, over the weight chunk limit of 8 bytes");
    {
        /* a 16 MiB + 4 chunk with the default limits */
        size_t n = (16u << 20) + 4;
        char *buf = calloc(1, n);
        if (buf) {
            ds4_wire_msg big;
            mk_chunk(&big, 0);
            big.chunk.bytes = n;
            big.chunk.chunk = (uint32_t)n;
            big.chunk.data = V(buf, n);
            big.chunk.crc = 0;
            load(&w, &big); /* the encoder validates against the capacity (1 GiB), not the default */
            EXPECT("oversized weight chunk (16 MiB + 4)", &w, DS4_WIRE_ELIMIT,
                   "raw frame 1 is 16777220 bytes, over the weight chunk limit of 16777216 bytes");
            free(buf);
        }
    }
    mk_request(&m);
    load(&w, &m);
    patch(&w, P_SET, "version", mo_u(0));
    EXPECT("weight version 0", &w, DS4_WIRE_ERANGE, "'version' = 0 is out of range");

    /* --- error and bye */
    mk_error(&m);
    load(&w, &m);
    patch(&w, P_DEL, "ref_t", mo_u(0));
    patch(&w, P_DEL, "ref_id", mo_u(0));
    patch(&w, P_DEL, "ref_n", mo_u(0));
    EXPECT("error without the optional refs", &w, DS4_WIRE_OK, NULL);
    patch(&w, P_SET, "code", mo_u(0));
    EXPECT("error code 0", &w, DS4_WIRE_ERANGE, "'code' = 0 is out of range [1, 65535]");
    mk_bye(&m);
    load(&w, &m);
    patch(&w, P_DEL, "reason", mo_u(0));
    EXPECT("bye without a reason", &w, DS4_WIRE_OK, NULL);
}

/* ------------------------------------------------------------------------------------------------ 3. encoder */

static void expect_enc(int line, const char *what, const ds4_wire_msg *m, const char *needle) {
    ds4_wire_out out;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_status s = ds4_wire_encode(m, &out, &err);
    CHECK(s == DS4_ERR_ARG, "line %d (%s): encode returned %s", line, what, ds4_status_name(s));
    CHECK(out.nframes == 0 && out.header == NULL, "line %d (%s): out not empty after a failure", line, what);
    CHECK(strncmp(err.msg, "wire encode: ", 13) == 0 && strstr(err.msg, needle), "line %d (%s): wanted '%s' in: %s",
          line, what, needle, err.msg);
    if (s == DS4_OK) ds4_wire_out_free(&out);
}
#define EXPECT_ENC(what, m, needle) expect_enc(__LINE__, (what), (m), (needle))

static void test_encoder(void) {
    ds4_wire_msg m;
    mk_task(&m);
    m.task.top_p = 2.0;
    EXPECT_ENC("top_p 2", &m, "task: 'sampling.top_p' = 2 is out of range [0, 1]");
    mk_task(&m);
    m.task.record_index = 2;
    EXPECT_ENC("bool 2", &m, "field task.sampling.record_index does not survive encoding");
    mk_task(&m);
    m.task.prompt_len = 8;
    EXPECT_ENC("prompt_len != prompt frame", &m, "holds 7 elements, prompt_len gives 8");
    mk_task(&m);
    m.task.n_stop = 65;
    EXPECT_ENC("n_stop over the capacity", &m, "n_stop is over DS4_WIRE_STOP_CAP");
    mk_task(&m);
    m.task.n_stop_str = 17;
    EXPECT_ENC("n_stop_str over the capacity", &m, "n_stop_str is over DS4_WIRE_STOP_STR_CAP");
    mk_task(&m);
    m.task.stop_str[1][0] = 0;
    EXPECT_ENC("an empty stop string", &m, "is 0 bytes");
    mk_samples(&m, 0);
    m.samples.seq[1].n_rows = 3;
    EXPECT_ENC("rows without routing", &m, "field samples.rows[] does not survive encoding");
    mk_samples(&m, 0);
    m.samples.tokens.len = 34;
    EXPECT_ENC("tokens frame misaligned", &m, "raw frame 1 'tokens' is 34 bytes, not a multiple of 4");
    mk_samples(&m, 0);
    m.samples.n = 300;
    EXPECT_ENC("n over the capacity", &m, "n is over DS4_WIRE_SAMPLES_CAP");
    mk_hello(&m);
    memset(m.hello.worker, 'x', sizeof m.hello.worker);
    EXPECT_ENC("unterminated string", &m, "not NUL-terminated");
    mk_hello(&m);
    m.type = (ds4_wire_type)99;
    EXPECT_ENC("bad type", &m, "message type 99");
    mk_chunk(&m, 1);
    m.chunk.data.data = NULL;
    EXPECT_ENC("NULL frame", &m, "raw frame 1 has NULL data of 16 bytes");
    /* the adapter map goes with its rank: adapter fields or the lora_masks frame without it have no place */
    mk_announce(&m);
    m.announce.base_version = 3;
    EXPECT_ENC("adapter field without a rank", &m, "field weight_announce.adapter.base_version does not survive");
    mk_announce(&m);
    m.announce.lora_masks = V(g_masks, sizeof g_masks);
    EXPECT_ENC("lora_masks without a rank", &m, "field weight_announce.lora_masks (frame) does not survive");
    mk_lora_announce(&m);
    m.announce.lora_masks.len = 0;
    EXPECT_ENC("LoRA announce without masks", &m, "the lora_masks frame is empty");
    mk_lora_announce(&m);
    m.announce.base_crc = 0; /* 0 is a CRC like any other: only the rank says whether the map is there */
    ds4_wire_out o0;
    ds4_error e0;
    CHECK_OK(ds4_wire_encode(&m, &o0, &e0), &e0);
    ds4_wire_out_free(&o0);
    /* the encoder does not check CRCs (decode does) */
    mk_chunk(&m, 1);
    m.chunk.crc ^= 1;
    ds4_wire_out out;
    ds4_error err;
    CHECK_OK(ds4_wire_encode(&m, &out, &err), &err);
    ds4_wire_out_free(&out);

    /* make_error cuts a long reason at a UTF-8 boundary */
    char reason[400];
    memset(reason, 'a', sizeof reason);
    memcpy(reason + 255, "\xc3\xa9", 2); /* é straddles byte 256 */
    reason[399] = 0;
    ds4_wire_make_error(&m, DS4_WIRE_ESTATE, reason, "task", 5, 1);
    CHECK(strlen(m.error.reason) == 255, "reason cut to %zu bytes", strlen(m.error.reason));
    CHECK_OK(ds4_wire_encode(&m, &out, &err), &err);
    ds4_wire_out_free(&out);
}

/* ------------------------------------------------------------------------------------------------ 4. mutation */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}
static size_t rndn(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static void test_mutation(int iters) {
    static wmsg seeds[NSEED];
    static ds4_wire_msg sm[NSEED];
    for (int i = 0; i < NSEED; i++) {
        mk_seed(i, &sm[i]);
        load(&seeds[i], &sm[i]);
    }
    /* backing store for frames whose length grows: every frame view must be readable for its whole length */
    static unsigned char pad[8][4096];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4096; j++) pad[i][j] = (unsigned char)rnd();
    static const unsigned char interesting[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
                                                0xc2, 0xc3, 0xca, 0xcb, 0xcc, 0xcf, 0xd0, 0xd3, 0xd4, 0xd9, 0xdb,
                                                0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff};
    static wmsg w;
    long ok = 0, codes[64] = {0};
    for (int it = 0; it < iters; it++) {
        const wmsg *sd = &seeds[rndn(NSEED)];
        w.n = sd->n;
        memcpy(w.f, sd->f, sizeof w.f);
        memcpy(w.l, sd->l, sizeof w.l);
        memcpy(w.hdr, sd->hdr, sd->l[0]);
        w.f[0] = w.hdr;
        int nmut = 1 + (int)rndn(4);
        for (int k = 0; k < nmut; k++) {
            size_t hl = w.l[0];
            switch (rndn(10)) {
            case 0: case 1: /* flip a bit */
                if (hl) w.hdr[rndn(hl)] ^= (char)(1u << rndn(8));
                break;
            case 2: case 3: /* an interesting byte */
                if (hl) w.hdr[rndn(hl)] = (char)interesting[rndn(sizeof interesting)];
                break;
            case 4: /* a random byte */
                if (hl) w.hdr[rndn(hl)] = (char)rnd();
                break;
            case 5: /* truncate */
                w.l[0] = rndn(hl + 1);
                break;
            case 6: { /* extend with random bytes */
                size_t add = 1 + rndn(16);
                for (size_t j = 0; j < add && w.l[0] < sizeof w.hdr; j++) w.hdr[w.l[0]++] = (char)rnd();
                break;
            }
            case 7: { /* copy a range of the header over another place */
                if (hl < 2) break;
                size_t a = rndn(hl), b = rndn(hl), n = 1 + rndn(8);
                if (a + n > hl) n = hl - a;
                if (b + n > hl) n = hl - b;
                memmove(w.hdr + b, w.hdr + a, n);
                break;
            }
            case 8: { /* a frame's length: shorter, or longer over readable padding */
                if (w.n < 2) break;
                int f = 1 + (int)rndn((size_t)w.n - 1);
                if (rnd() & 1) w.l[f] = rndn(w.l[f] + 1);
                else {
                    w.f[f] = pad[f % 8];
                    w.l[f] = rndn(sizeof pad[0] + 1);
                }
                break;
            }
            default: /* drop or add a frame */
                if ((rnd() & 1) && w.n > 1) w.n--;
                else if (w.n < 18) {
                    w.f[w.n] = pad[w.n % 8];
                    w.l[w.n] = rndn(64);
                    w.n++;
                }
                break;
            }
        }
        ds4_wire_msg m, m2;
        ds4_error err;
        memset(&err, 0, sizeof err);
        ds4_wire_code c = ds4_wire_decode(NULL, w.n, w.f, w.l, &m, &err);
        codes[c < 64 ? c : 63]++;
        if (c != DS4_WIRE_OK) {
            if (strncmp(err.msg, "wire decode: ", 13) != 0 || err.code == DS4_OK || (unsigned)m.type >= DS4_WIRE_TYPE_COUNT) {
                CHECK(0, "iteration %d: failure without a proper message: code %d, %s", it, (int)c, err.msg);
                break;
            }
            continue;
        }
        ok++;
        ds4_wire_out out;
        if (ds4_wire_encode(&m, &out, &err) != DS4_OK) {
            CHECK(0, "iteration %d: a decoded %s does not re-encode: %s", it, ds4_wire_type_name(m.type), err.msg);
            break;
        }
        c = ds4_wire_decode(NULL, out.nframes, out.frames, out.lens, &m2, &err);
        const char *field = NULL;
        int same = c == DS4_WIRE_OK && ds4_wire_equal(&m, &m2, &field);
        ds4_wire_out_free(&out);
        if (!same) {
            CHECK(0, "iteration %d: re-encoded %s: %s (%s)", it, ds4_wire_type_name(m.type),
                  c ? err.msg : "decodes", field ? field : "");
            break;
        }
    }
    printf("test_wire: mutation: %d iterations, %ld decoded and round-tripped; rejections:", iters, ok);
    for (int c = 1; c < 64; c++)
        if (codes[c]) printf(" %s %ld", ds4_wire_error_name((uint32_t)c), codes[c]);
    printf("\n");
    CHECK(ok > iters / 200, "only %ld of %d mutated messages decoded: the mutations are too destructive", ok, iters);
    CHECK(codes[DS4_WIRE_EPARSE] && codes[DS4_WIRE_EFRAME] && codes[DS4_WIRE_ECRC], "mutations reach the checks");
}

/* Seed message i encoded in fuzz_wire's input layout (byte 0 = frames, u16 LE lengths, the frames) into buf
 * (malloc'd, *n bytes), and its file name NN_TYPE.bin; 0 when encoding failed (counted as a failed check). */
static int seed_bytes(int i, unsigned char **buf, size_t *n, char *name, size_t cap) {
    ds4_wire_msg m;
    ds4_wire_out o;
    ds4_error err;
    mk_seed(i, &m);
    if (ds4_wire_encode(&m, &o, &err) != DS4_OK) {
        CHECK(0, "seed %d: %s", i, err.msg);
        return 0;
    }
    snprintf(name, cap, "%02d_%s.bin", i, ds4_wire_type_name(m.type));
    size_t total = 1 + 2 * (size_t)o.nframes;
    for (int k = 0; k < o.nframes; k++) total += o.lens[k];
    unsigned char *b = malloc(total), *p = b;
    if (b) {
        *p++ = (unsigned char)o.nframes;
        for (int k = 0; k < o.nframes; k++) {
            *p++ = (unsigned char)(o.lens[k] & 0xff);
            *p++ = (unsigned char)(o.lens[k] >> 8);
        }
        for (int k = 0; k < o.nframes; k++) memcpy(p, o.frames[k], o.lens[k]), p += o.lens[k];
    }
    ds4_wire_out_free(&o);
    CHECK(b != NULL, "seed %d: out of memory", i);
    *buf = b;
    *n = total;
    return b != NULL;
}

/* WIRE_WRITE_CORPUS=DIR: write every valid seed message as DIR/NN_TYPE.bin: the seed corpus
 * tests/fuzz/corpus/wire/, which is also the golden set below. */
static void write_corpus(const char *dir) {
    for (int i = 0; i < NSEED; i++) {
        unsigned char *b;
        size_t n;
        char name[64], path[4096];
        if (!seed_bytes(i, &b, &n, name, sizeof name)) continue;
        snprintf(path, sizeof path, "%s/%s", dir, name);
        FILE *f = fopen(path, "wb");
        CHECK(f != NULL, "corpus: cannot write %s", path);
        if (f) {
            fwrite(b, 1, n, f);
            fclose(f);
        }
        free(b);
    }
}

/* Golden encodings: every seed message encodes to the bytes committed in tests/fuzz/corpus/wire/ (written by
 * WIRE_WRITE_CORPUS when the protocol changed): the encoder's output is the wire format, byte for byte, so a
 * refactoring of the codec that changes one byte fails here. */
static void test_golden(const char *fixtures) {
    int compared = 0;
    for (int i = 0; i < NSEED; i++) {
        unsigned char *b;
        size_t n;
        char name[64], path[4096];
        if (!seed_bytes(i, &b, &n, name, sizeof name)) continue;
        snprintf(path, sizeof path, "%s/../fuzz/corpus/wire/%s", fixtures, name);
        FILE *f = fopen(path, "rb");
        CHECK(f != NULL, "golden: cannot read %s", path);
        if (f) {
            unsigned char *g = malloc(n + 1);
            size_t got = g ? fread(g, 1, n + 1, f) : 0;
            CHECK(got == n && memcmp(g, b, n) == 0, "golden: %s: the encoding (%zu bytes) differs from the committed "
                  "one (%zu bytes)", name, n, got);
            compared += got == n && memcmp(g, b, n) == 0;
            free(g);
            fclose(f);
        }
        free(b);
    }
    printf("golden: %d of %d seed messages encode to their committed bytes\n", compared, NSEED);
}

int main(int argc, char **argv) {
    for (int i = 0; i < 27 * 6; i++) g_experts[i] = i % 7;
    for (int i = 0; i < 27 * 4; i++) g_index[i] = i % 5 - 1;
    g_verbose = getenv("WIRE_VERBOSE") != NULL;
    if (getenv("WIRE_WRITE_CORPUS")) write_corpus(getenv("WIRE_WRITE_CORPUS"));
    if (argc > 1) test_golden(argv[1]);
    test_round_trip();
    test_rejects();
    test_encoder();
    const char *iters = getenv("WIRE_MUTATIONS");
    test_mutation(iters ? atoi(iters) : 100000);
    return ds4t_finish("test_wire");
}
