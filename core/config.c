/* config.c — DeepSeek-V4 config.json → ds4_config, folded exactly as transformers 5.17's DeepseekV4Config
 * (configuration_deepseek_v4.py __post_init__, PreTrainedConfig.convert_rope_params_to_dict and
 * modeling_rope_utils.standardize_rope_params / _compute_yarn_parameters) does it.
 *
 * Order of the fold, mirroring HF:
 *   1. scalar fields (HF name; attribute_map aliases override it like HF's late setattr; the official
 *      inference ModelArgs spelling is used only when neither is present);
 *   2. compress_rates (+ legacy compress_rate_csa/hca), layer_types (explicit > compress_ratios > V4-Pro
 *      default), mlp_layer_types (explicit > num_hash_layers > 3), all truncated to num_hidden_layers;
 *   3. partial_rotary_factor (explicit > qk_rope_head_dim / head_dim > 64/512);
 *   4. rope: nested {"main", "compress"} dicts used as given, otherwise a flat dict (rope_scaling or
 *      rope_parameters) becomes "compress" with compress_rope_theta, and "main" is plain RoPE.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"
#include "json.h"

#define CONFIG_MAX_BYTES ((size_t)16 << 20)
/* Dimensions and counts become tensor extents and loop bounds downstream; anything past int32 is not a
 * real model and would only invite overflow in size arithmetic. */
#define CFG_DIM_MAX ((int64_t)INT32_MAX)
/* Positions are also handled as doubles (YaRN); keep them exactly representable. */
#define CFG_POS_MAX ((int64_t)1 << 53)
/* Loop counts that no weight shape bounds, so a config alone could make a forward run for hours: Sinkhorn
 * iterations of every mHC site (V4 uses 20), the indexer's top-k (V4-Flash: 512; per-row selection buffers and
 * routing records hold index_topk entries; the rollout protocol's index_shape caps it at 65536) and the MTP
 * depth (ds4 builds at most one MTP block, as V4 has). */
#define CFG_SINKHORN_MAX 100
#define CFG_TOPK_MAX 65536
#define CFG_MTP_MAX 1

static const char *const ATTN_NAMES[3] = {"sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"};
static const char *const SCORE_NAMES[3] = {"sqrtsoftplus", "sigmoid", "softmax"};

const char *ds4_attn_type_name(ds4_attn_type t) {
    if ((int)t >= 0 && (int)t < 3) return ATTN_NAMES[t];
    return "unknown";
}

static const char *mlp_name(int32_t is_hash) { return is_hash ? "hash_moe" : "moe"; }

/* ------------------------------------------------------------------------------------------------ errors */

/* A short human rendering of a JSON value for error messages. */
static const char *describe(const ds4_json *v, char *buf, size_t n) {
    if (!v) {
        snprintf(buf, n, "nothing");
        return buf;
    }
    switch (v->type) {
    case DS4_JSON_NULL: snprintf(buf, n, "null"); break;
    case DS4_JSON_BOOL: snprintf(buf, n, "%s", v->boolean ? "true" : "false"); break;
    case DS4_JSON_NUMBER:
        if (v->is_int)
            snprintf(buf, n, "%lld", (long long)v->integer);
        else
            snprintf(buf, n, "%.17g", v->number);
        break;
    case DS4_JSON_STRING: {
        /* Cut long strings on a UTF-8 character boundary so the message stays valid UTF-8. */
        size_t cut = v->str_len > 60 ? 60 : v->str_len;
        while (cut > 0 && cut < v->str_len && ((unsigned char)v->str[cut] & 0xC0) == 0x80) cut--;
        snprintf(buf, n, "\"%.*s%s\"", (int)cut, v->str, cut < v->str_len ? "..." : "");
        break;
    }
    case DS4_JSON_ARRAY: snprintf(buf, n, "an array of %zu items", v->count); break;
    case DS4_JSON_OBJECT: snprintf(buf, n, "an object"); break;
    default: snprintf(buf, n, "an unknown value"); break;
    }
    return buf;
}

static ds4_status bad_field(ds4_error *err, const char *field, const char *expect, const ds4_json *v) {
    char d[128];
    return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' must be %s (got %s)", field, expect,
                    describe(v, d, sizeof d));
}

static int is_null(const ds4_json *v) { return !v || v->type == DS4_JSON_NULL; }

/* ------------------------------------------------------------------------------------------------ scalars */

static ds4_status get_int(const ds4_json *v, const char *name, int64_t lo, int64_t hi, int64_t *out,
                          ds4_error *err) {
    char expect[96];
    if (lo == 1)
        snprintf(expect, sizeof expect, "a positive integer");
    else if (lo == 0)
        snprintf(expect, sizeof expect, "a non-negative integer");
    else
        snprintf(expect, sizeof expect, "an integer >= %lld", (long long)lo);
    if (v->type != DS4_JSON_NUMBER || !v->is_int || v->integer < lo) return bad_field(err, name, expect, v);
    if (v->integer > hi) {
        size_t l = strlen(expect);
        snprintf(expect + l, sizeof expect - l, " no larger than %lld", (long long)hi);
        return bad_field(err, name, expect, v);
    }
    *out = v->integer;
    return DS4_OK;
}

typedef enum num_range { R_ANY, R_POS, R_NONNEG } num_range;

static ds4_status get_num(const ds4_json *v, const char *name, num_range r, double *out, ds4_error *err) {
    static const char *const expect[3] = {"a number", "a positive number", "a non-negative number"};
    if (v->type != DS4_JSON_NUMBER) return bad_field(err, name, expect[r], v);
    double d = v->number;
    if ((r == R_POS && !(d > 0)) || (r == R_NONNEG && !(d >= 0))) return bad_field(err, name, expect[r], v);
    *out = d;
    return DS4_OK;
}

typedef enum field_kind { K_POS, K_NONNEG, K_NUM, K_NUM_POS, K_NUM_NONNEG, K_BOOL } field_kind;

/* Plain scalar fields. `alias` is an attribute_map key: HF assigns it after the dataclass fields, so it
 * wins when both are present. `official` is the inference-code ModelArgs spelling, which transformers
 * ignores; it is read only when neither HF key is present. */
typedef struct field_desc {
    const char *name;
    const char *alias;
    const char *official;
    field_kind kind;
    size_t off;
    int64_t hi;
} field_desc;

#define OFF(f) offsetof(ds4_config, f)
static const field_desc FIELDS[] = {
    {"vocab_size", NULL, NULL, K_POS, OFF(vocab_size), CFG_DIM_MAX},
    {"hidden_size", NULL, "dim", K_POS, OFF(hidden_size), CFG_DIM_MAX},
    {"num_hidden_layers", NULL, "n_layers", K_POS, OFF(num_hidden_layers), CFG_DIM_MAX},
    {"num_attention_heads", NULL, "n_heads", K_POS, OFF(num_attention_heads), CFG_DIM_MAX},
    {"num_key_value_heads", NULL, NULL, K_POS, OFF(num_key_value_heads), CFG_DIM_MAX},
    {"head_dim", NULL, NULL, K_POS, OFF(head_dim), CFG_DIM_MAX},
    {"q_lora_rank", NULL, NULL, K_POS, OFF(q_lora_rank), CFG_DIM_MAX},
    {"o_groups", NULL, NULL, K_POS, OFF(o_groups), CFG_DIM_MAX},
    {"o_lora_rank", NULL, NULL, K_POS, OFF(o_lora_rank), CFG_DIM_MAX},
    {"sliding_window", NULL, "window_size", K_POS, OFF(sliding_window), CFG_DIM_MAX},
    {"index_n_heads", NULL, NULL, K_POS, OFF(index_n_heads), CFG_DIM_MAX},
    {"index_head_dim", NULL, NULL, K_POS, OFF(index_head_dim), CFG_DIM_MAX},
    {"index_topk", NULL, NULL, K_POS, OFF(index_topk), CFG_DIM_MAX},
    {"n_routed_experts", "num_local_experts", NULL, K_POS, OFF(n_routed_experts), CFG_DIM_MAX},
    {"num_experts_per_tok", NULL, "n_activated_experts", K_POS, OFF(num_experts_per_tok), CFG_DIM_MAX},
    {"n_shared_experts", NULL, NULL, K_NONNEG, OFF(n_shared_experts), CFG_DIM_MAX},
    {"moe_intermediate_size", "intermediate_size", "moe_inter_dim", K_POS, OFF(moe_intermediate_size),
     CFG_DIM_MAX},
    {"hc_mult", NULL, NULL, K_POS, OFF(hc_mult), CFG_DIM_MAX},
    {"hc_sinkhorn_iters", NULL, NULL, K_POS, OFF(hc_sinkhorn_iters), CFG_DIM_MAX},
    {"max_position_embeddings", NULL, NULL, K_POS, OFF(max_position_embeddings), CFG_POS_MAX},
    {"num_nextn_predict_layers", NULL, "n_mtp_layers", K_NONNEG, OFF(num_nextn_predict_layers), CFG_DIM_MAX},
    {"norm_topk_prob", NULL, NULL, K_BOOL, OFF(norm_topk_prob), 0},
    {"tie_word_embeddings", NULL, NULL, K_BOOL, OFF(tie_word_embeddings), 0},
    {"routed_scaling_factor", NULL, "route_scale", K_NUM, OFF(routed_scaling_factor), 0},
    {"swiglu_limit", NULL, NULL, K_NUM_NONNEG, OFF(swiglu_limit), 0},
    {"hc_eps", NULL, NULL, K_NUM_POS, OFF(hc_eps), 0},
    {"rms_norm_eps", NULL, "norm_eps", K_NUM_POS, OFF(rms_norm_eps), 0},
    {"initializer_range", NULL, NULL, K_NUM_NONNEG, OFF(initializer_range), 0},
};
#undef OFF

/* The value for an HF field with optional alias and official spelling; *used names the key it came from. */
static const ds4_json *lookup3(const ds4_json *root, const char *name, const char *alias, const char *official,
                               const char **used) {
    const ds4_json *v;
    if (alias && (v = ds4_json_get(root, alias))) {
        *used = alias;
        return v;
    }
    if ((v = ds4_json_get(root, name))) {
        *used = name;
        return v;
    }
    if (official && (v = ds4_json_get(root, official))) {
        *used = official;
        return v;
    }
    return NULL;
}

static ds4_status read_fields(const ds4_json *root, ds4_config *c, ds4_error *err) {
    for (size_t i = 0; i < sizeof FIELDS / sizeof FIELDS[0]; i++) {
        const field_desc *f = &FIELDS[i];
        const char *used = f->name;
        const ds4_json *v = lookup3(root, f->name, f->alias, f->official, &used);
        if (!v) continue;
        unsigned char *dst = (unsigned char *)c + f->off;
        ds4_status st = DS4_OK;
        switch (f->kind) {
        case K_POS:
        case K_NONNEG: {
            int64_t x;
            st = get_int(v, used, f->kind == K_POS ? 1 : 0, f->hi, &x, err);
            if (!st) memcpy(dst, &x, sizeof x);
            break;
        }
        case K_NUM:
        case K_NUM_POS:
        case K_NUM_NONNEG: {
            double d = 0;
            st = get_num(v, used, f->kind == K_NUM ? R_ANY : f->kind == K_NUM_POS ? R_POS : R_NONNEG, &d, err);
            if (!st) memcpy(dst, &d, sizeof d);
            break;
        }
        case K_BOOL: {
            if (v->type != DS4_JSON_BOOL) return bad_field(err, used, "true or false", v);
            int32_t b = v->boolean ? 1 : 0;
            memcpy(dst, &b, sizeof b);
            break;
        }
        }
        if (st) return st;
    }
    return DS4_OK;
}

static ds4_status read_token_id(const ds4_json *root, const char *name, int allow_list, int64_t *out,
                                ds4_error *err) {
    const ds4_json *v = ds4_json_get(root, name);
    if (!v) return DS4_OK;
    if (v->type == DS4_JSON_NULL) {
        *out = -1;
        return DS4_OK;
    }
    if (allow_list && v->type == DS4_JSON_ARRAY) {
        /* eos_token_id may list several ids (chat models); the first is the canonical one. */
        char nm[64];
        *out = -1;
        for (size_t i = 0; i < v->count; i++) {
            int64_t x = 0;
            snprintf(nm, sizeof nm, "%s[%zu]", name, i);
            ds4_status st = get_int(&v->items[i], nm, 0, CFG_DIM_MAX, &x, err);
            if (st) return st;
            if (i == 0) *out = x;
        }
        return DS4_OK;
    }
    if (v->type != DS4_JSON_NUMBER || !v->is_int || v->integer < -1 || v->integer > CFG_DIM_MAX)
        return bad_field(err, name, allow_list ? "a token id, a list of token ids or null" : "a token id or null", v);
    *out = v->integer;
    return DS4_OK;
}

static ds4_status read_strings(const ds4_json *root, ds4_config *c, ds4_error *err) {
    const ds4_json *v = ds4_json_get(root, "model_type");
    if (v && (v->type != DS4_JSON_STRING || strcmp(v->str, "deepseek_v4") != 0))
        return bad_field(err, "model_type", "\"deepseek_v4\"", v);
    v = ds4_json_get(root, "hidden_act");
    if (v && (v->type != DS4_JSON_STRING || strcmp(v->str, "silu") != 0))
        return bad_field(err, "hidden_act", "\"silu\" (the only activation DeepSeek-V4 uses)", v);
    const char *used = "scoring_func";
    v = lookup3(root, "scoring_func", NULL, "score_func", &used);
    if (v) {
        int found = 0;
        if (v->type == DS4_JSON_STRING)
            for (int i = 0; i < 3; i++)
                if (strcmp(v->str, SCORE_NAMES[i]) == 0) {
                    c->scoring_func = (ds4_score_func)i;
                    found = 1;
                }
        if (!found) return bad_field(err, used, "one of \"sqrtsoftplus\", \"sigmoid\", \"softmax\"", v);
    }
    ds4_status st = read_token_id(root, "bos_token_id", 0, &c->bos_token_id, err);
    if (st) return st;
    return read_token_id(root, "eos_token_id", 1, &c->eos_token_id, err);
}

/* ------------------------------------------------------------------------------------------------ layers */

static ds4_status read_compress_rates(const ds4_json *root, ds4_config *c, int *have_csa, int *have_hca,
                                      ds4_error *err) {
    ds4_status st;
    const ds4_json *v = ds4_json_get(root, "compress_rates");
    *have_csa = *have_hca = 1;
    if (!is_null(v)) {
        if (v->type != DS4_JSON_OBJECT) return bad_field(err, "compress_rates", "an object or null", v);
        /* An explicit dict replaces the default one wholesale (HF assigns it as is). */
        *have_csa = *have_hca = 0;
        const ds4_json *x = ds4_json_get(v, ATTN_NAMES[DS4_ATTN_CSA]);
        if (x) {
            if ((st = get_int(x, "compress_rates.compressed_sparse_attention", 1, CFG_DIM_MAX,
                              &c->compress_rate_csa, err)))
                return st;
            *have_csa = 1;
        }
        x = ds4_json_get(v, ATTN_NAMES[DS4_ATTN_HCA]);
        if (x) {
            if ((st = get_int(x, "compress_rates.heavily_compressed_attention", 1, CFG_DIM_MAX,
                              &c->compress_rate_hca, err)))
                return st;
            *have_hca = 1;
        }
    }
    v = ds4_json_get(root, "compress_rate_csa");
    if (!is_null(v)) {
        if ((st = get_int(v, "compress_rate_csa", 1, CFG_DIM_MAX, &c->compress_rate_csa, err))) return st;
        *have_csa = 1;
    }
    v = ds4_json_get(root, "compress_rate_hca");
    if (!is_null(v)) {
        if ((st = get_int(v, "compress_rate_hca", 1, CFG_DIM_MAX, &c->compress_rate_hca, err))) return st;
        *have_hca = 1;
    }
    return DS4_OK;
}

static ds4_status list_length_error(ds4_error *err, const char *name, size_t got, int64_t n) {
    return ds4_fail(err, DS4_ERR_CONFIG,
                    "config: field '%s' has %zu entries but num_hidden_layers is %lld (a longer list is truncated, "
                    "a shorter one is an error)",
                    name, got, (long long)n);
}

static ds4_status read_layer_types(const ds4_json *root, ds4_config *c, ds4_error *err) {
    int64_t n = c->num_hidden_layers;
    const ds4_json *v = ds4_json_get(root, "layer_types");
    char nm[64];
    if (!is_null(v)) {
        if (v->type != DS4_JSON_ARRAY) return bad_field(err, "layer_types", "a list of strings", v);
        if (v->count < (size_t)n) return list_length_error(err, "layer_types", v->count, n);
        /* HF truncates before validating, so entries past num_hidden_layers are never looked at. */
        for (int64_t i = 0; i < n; i++) {
            const ds4_json *x = &v->items[i];
            int found = 0;
            if (x->type == DS4_JSON_STRING)
                for (int t = 0; t < 3; t++)
                    if (strcmp(x->str, ATTN_NAMES[t]) == 0) {
                        c->layer_types[i] = (ds4_attn_type)t;
                        found = 1;
                    }
            if (!found) {
                snprintf(nm, sizeof nm, "layer_types[%lld]", (long long)i);
                return bad_field(err, nm,
                                 "one of \"sliding_attention\", \"compressed_sparse_attention\", "
                                 "\"heavily_compressed_attention\"",
                                 x);
            }
        }
        return DS4_OK;
    }
    v = ds4_json_get(root, "compress_ratios");
    if (!is_null(v)) {
        if (v->type != DS4_JSON_ARRAY) return bad_field(err, "compress_ratios", "a list of 0, 4 or 128", v);
        /* HF maps every entry (the released list carries one more entry for the MTP block) before
         * truncating, so a bad value anywhere is an error. Python's dict lookup equates 4.0 with 4. */
        for (size_t i = 0; i < v->count; i++) {
            const ds4_json *x = &v->items[i];
            ds4_attn_type t;
            if (x->type == DS4_JSON_NUMBER && x->number == 0)
                t = DS4_ATTN_SLIDING;
            else if (x->type == DS4_JSON_NUMBER && x->number == 4)
                t = DS4_ATTN_CSA;
            else if (x->type == DS4_JSON_NUMBER && x->number == 128)
                t = DS4_ATTN_HCA;
            else {
                snprintf(nm, sizeof nm, "compress_ratios[%zu]", i);
                return bad_field(err, nm, "0, 4 or 128", x);
            }
            if ((int64_t)i < n) c->layer_types[i] = t;
        }
        if (v->count < (size_t)n) return list_length_error(err, "compress_ratios", v->count, n);
        return DS4_OK;
    }
    /* V4-Pro default: two HCA layers, then HCA/CSA alternating starting with HCA. */
    for (int64_t i = 0; i < n; i++)
        c->layer_types[i] = (i >= 2 && (i - 2) % 2 == 1) ? DS4_ATTN_CSA : DS4_ATTN_HCA;
    return DS4_OK;
}

static ds4_status read_mlp_types(const ds4_json *root, ds4_config *c, ds4_error *err) {
    int64_t n = c->num_hidden_layers;
    const ds4_json *v = ds4_json_get(root, "mlp_layer_types");
    char nm[64];
    if (!is_null(v)) {
        if (v->type != DS4_JSON_ARRAY) return bad_field(err, "mlp_layer_types", "a list of strings", v);
        if (v->count < (size_t)n) return list_length_error(err, "mlp_layer_types", v->count, n);
        for (int64_t i = 0; i < n; i++) {
            const ds4_json *x = &v->items[i];
            if (x->type == DS4_JSON_STRING && strcmp(x->str, "hash_moe") == 0)
                c->layer_is_hash[i] = 1;
            else if (x->type == DS4_JSON_STRING && strcmp(x->str, "moe") == 0)
                c->layer_is_hash[i] = 0;
            else {
                snprintf(nm, sizeof nm, "mlp_layer_types[%lld]", (long long)i);
                return bad_field(err, nm, "\"hash_moe\" or \"moe\"", v->items + i);
            }
        }
        return DS4_OK;
    }
    int64_t n_hash = 3;
    const char *used = "num_hash_layers";
    v = lookup3(root, "num_hash_layers", NULL, "n_hash_layers", &used);
    if (!is_null(v)) {
        ds4_status st = get_int(v, used, 0, CFG_DIM_MAX, &n_hash, err);
        if (st) return st;
    }
    for (int64_t i = 0; i < n; i++) c->layer_is_hash[i] = i < n_hash;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ rope */

/* Python's int(head_dim * factor): truncation toward zero of the double product. */
static ds4_status rotary_dim(int64_t head_dim, double prf, const char *name, int64_t *out, ds4_error *err) {
    double x = (double)head_dim * prf;
    if (!(x > -4e18 && x < 4e18))
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' = %.17g gives a rotary width head_dim * %.17g "
                        "out of range", name, prf, prf);
    *out = (int64_t)x;
    return DS4_OK;
}

/* The keys of one rope dict that matter, with a Python-dict-like view: entries can be overridden or
 * defaulted with synthetic values, and every entry remembers the name to blame in an error. */
enum {
    RK_ROPE_TYPE, RK_TYPE, RK_THETA, RK_PRF, RK_FACTOR, RK_ORIG, RK_BETA_FAST, RK_BETA_SLOW, RK_ATTN,
    RK_MSCALE, RK_MSCALE_ALL, RK_COUNT
};
static const char *const ROPE_KEYS[RK_COUNT] = {
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"};

typedef struct rope_dict {
    const ds4_json *val[RK_COUNT];
    char name[RK_COUNT][96];
} rope_dict;

static void rd_init(rope_dict *d, const ds4_json *obj, const char *label) {
    for (int k = 0; k < RK_COUNT; k++) {
        d->val[k] = obj ? ds4_json_get(obj, ROPE_KEYS[k]) : NULL;
        snprintf(d->name[k], sizeof d->name[k], "%.60s.%.34s", label, ROPE_KEYS[k]);
    }
}

static void rd_set(rope_dict *d, int k, const ds4_json *v, const char *name) {
    d->val[k] = v;
    snprintf(d->name[k], sizeof d->name[k], "%s", name);
}

static void rd_setdefault(rope_dict *d, int k, const ds4_json *v, const char *name) {
    if (!d->val[k]) rd_set(d, k, v, name);
}

static ds4_json synth_num(double x) {
    ds4_json v;
    memset(&v, 0, sizeof v);
    v.type = DS4_JSON_NUMBER;
    v.number = x;
    return v;
}

static ds4_json synth_str(const char *s) {
    ds4_json v;
    memset(&v, 0, sizeof v);
    v.type = DS4_JSON_STRING;
    v.str = (char *)s;
    v.str_len = strlen(s);
    return v;
}

/* rope_type, else the legacy "type", else "default" (standardize_rope_params). */
static ds4_status rd_type(const rope_dict *d, ds4_rope_type *out, ds4_error *err) {
    const ds4_json *v = d->val[RK_ROPE_TYPE];
    const char *nm = d->name[RK_ROPE_TYPE];
    if (!v) {
        v = d->val[RK_TYPE];
        nm = d->name[RK_TYPE];
    }
    if (!v) {
        *out = DS4_ROPE_DEFAULT;
        return DS4_OK;
    }
    if (v->type != DS4_JSON_STRING) return bad_field(err, nm, "a string naming the rope type", v);
    if (strcmp(v->str, "default") == 0) {
        *out = DS4_ROPE_DEFAULT;
        return DS4_OK;
    }
    if (strcmp(v->str, "yarn") == 0) {
        *out = DS4_ROPE_YARN;
        return DS4_OK;
    }
    return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                    "config: field '%s' = \"%.60s\": rope type not supported (only \"default\" and \"yarn\")", nm,
                    v->str);
}

static double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0; }

typedef struct rope_env {
    int64_t head_dim;
    int64_t max_pos;
    double default_prf;    /* partial_rotary_factor when the dict has none */
    const char *factor_name; /* what to call a missing "factor" (the official spelling is rope_factor) */
} rope_env;

static ds4_status rd_resolve(const rope_dict *d, const rope_env *env, ds4_rope_params *out, ds4_error *err) {
    ds4_status st;
    memset(out, 0, sizeof *out);
    if ((st = rd_type(d, &out->type, err))) return st;
    /* HF reads "truncate" from config.rope_parameters — for V4 the outer {"main", "compress"} dict, which
     * never has that key — so the correction range is always truncated. */
    out->truncate = 1;
    const ds4_json *v = d->val[RK_THETA];
    if ((st = get_num(v, d->name[RK_THETA], R_POS, &out->theta, err))) return st;
    v = d->val[RK_PRF];
    if (v) {
        if ((st = get_num(v, d->name[RK_PRF], R_ANY, &out->partial_rotary_factor, err))) return st;
    } else {
        out->partial_rotary_factor = env->default_prf;
    }
    if ((st = rotary_dim(env->head_dim, out->partial_rotary_factor, d->name[RK_PRF], &out->dim, err))) return st;

    if (out->type == DS4_ROPE_DEFAULT) {
        /* Neutral values: nothing reads them for plain RoPE. */
        out->factor = 1.0;
        out->attention_factor = 1.0;
        return DS4_OK;
    }

    /* YaRN (_compute_yarn_parameters after standardize_rope_params). */
    v = d->val[RK_ORIG];
    if (!v)
        out->original_max_position_embeddings = (double)env->max_pos;
    else if ((st = get_num(v, d->name[RK_ORIG], R_POS, &out->original_max_position_embeddings, err)))
        return st;

    v = d->val[RK_FACTOR];
    if (!v)   /* HF indexes rope_parameters["factor"] (and its validator requires the key): KeyError */
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' is required for rope type \"yarn\"",
                        env->factor_name ? env->factor_name : d->name[RK_FACTOR]);
    if (v->type == DS4_JSON_NULL)
        out->factor = (double)env->max_pos / out->original_max_position_embeddings;
    else if ((st = get_num(v, d->name[RK_FACTOR], R_POS, &out->factor, err)))
        return st;

    /* `rope_parameters.get("beta_fast") or 32`: absent, null and 0 all select the default. */
    out->beta_fast = 32;
    v = d->val[RK_BETA_FAST];
    if (!is_null(v)) {
        if ((st = get_num(v, d->name[RK_BETA_FAST], R_ANY, &out->beta_fast, err))) return st;
        if (out->beta_fast == 0) out->beta_fast = 32;
    }
    out->beta_slow = 1;
    v = d->val[RK_BETA_SLOW];
    if (!is_null(v)) {
        if ((st = get_num(v, d->name[RK_BETA_SLOW], R_ANY, &out->beta_slow, err))) return st;
        if (out->beta_slow == 0) out->beta_slow = 1;
    }

    v = d->val[RK_ATTN];
    if (!is_null(v)) {
        if ((st = get_num(v, d->name[RK_ATTN], R_NONNEG, &out->attention_factor, err))) return st;
    } else {
        double ms = 0, msa = 0;
        if (!is_null(d->val[RK_MSCALE]) && (st = get_num(d->val[RK_MSCALE], d->name[RK_MSCALE], R_ANY, &ms, err)))
            return st;
        if (!is_null(d->val[RK_MSCALE_ALL]) &&
            (st = get_num(d->val[RK_MSCALE_ALL], d->name[RK_MSCALE_ALL], R_ANY, &msa, err)))
            return st;
        if (ms != 0 && msa != 0) {
            double den = yarn_mscale(out->factor, msa);
            if (den == 0)
                return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' = %.17g makes the YaRN mscale ratio divide "
                                "by zero", d->name[RK_MSCALE_ALL], msa);
            out->attention_factor = yarn_mscale(out->factor, ms) / den;
        } else {
            out->attention_factor = yarn_mscale(out->factor, 1.0);
        }
        if (!isfinite(out->attention_factor))
            return ds4_fail(err, DS4_ERR_CONFIG, "config: YaRN attention factor derived from '%s' is not finite",
                            d->name[RK_FACTOR]);
    }
    return DS4_OK;
}

typedef struct rope_in {
    int64_t head_dim, max_pos;
    double theta_main, theta_compress;   /* rope_theta, compress_rope_theta */
    double prf;                          /* folded top-level partial_rotary_factor */
    int prf_explicit;                    /* partial_rotary_factor was given (not derived) */
} rope_in;

static ds4_status read_rope(const ds4_json *root, const rope_in *in, ds4_config *c, ds4_error *err) {
    ds4_status st;
    ds4_json j_theta_main = synth_num(in->theta_main), j_theta_c = synth_num(in->theta_compress);
    ds4_json j_prf = synth_num(in->prf), j_one = synth_num(1.0);
    ds4_json j_yarn = synth_str("yarn");
    rope_env env = {in->head_dim, in->max_pos, in->prf, NULL};

    /* convert_rope_params_to_dict: `rope_scaling or rope_parameters` — a non-empty legacy dict wins. */
    const ds4_json *src = NULL;
    const char *src_name = NULL;
    const ds4_json *v = ds4_json_get(root, "rope_scaling");
    if (!is_null(v)) {
        if (v->type != DS4_JSON_OBJECT) return bad_field(err, "rope_scaling", "an object or null", v);
        if (v->count) {
            src = v;
            src_name = "rope_scaling";
        }
    }
    if (!src) {
        v = ds4_json_get(root, "rope_parameters");
        if (!is_null(v)) {
            if (v->type != DS4_JSON_OBJECT) return bad_field(err, "rope_parameters", "an object or null", v);
            src = v;
            src_name = "rope_parameters";
        }
    }

    rope_dict flat;
    int ignore_type = 0;
    char nm[96];
    if (src) {
        const ds4_json *m = ds4_json_get(src, "main"), *cp = ds4_json_get(src, "compress");
        if (m || cp) {
            /* standardize_rope_params indexes both labels as soon as one is present. */
            if (!m || !cp) {
                return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.%s' is missing (\"main\" and \"compress\" "
                                "go together)", src_name, m ? "compress" : "main");
            }
            if (!is_null(m) && m->type != DS4_JSON_OBJECT) {
                snprintf(nm, sizeof nm, "%s.main", src_name);
                return bad_field(err, nm, "an object or null", m);
            }
            if (!is_null(cp) && cp->type != DS4_JSON_OBJECT) {
                snprintf(nm, sizeof nm, "%s.compress", src_name);
                return bad_field(err, nm, "an object or null", cp);
            }
            if (!is_null(m) && !is_null(cp)) {
                /* Nested form, used as given. Missing rope_theta comes from the top-level rope_theta (also for
                 * "compress": standardize_rope_params does not know compress_rope_theta). A missing
                 * partial_rotary_factor is filled with the top-level one by standardize_rope_params, which
                 * runs at config time only if partial_rotary_factor was given explicitly, and again inside
                 * _compute_yarn_parameters (by then with the folded value) if either dict is YaRN;
                 * otherwise the rotary init's `.get("partial_rotary_factor", 1.0)` applies. */
                rope_dict dm, dc;
                snprintf(nm, sizeof nm, "%s.main", src_name);
                rd_init(&dm, m, nm);
                snprintf(nm, sizeof nm, "%s.compress", src_name);
                rd_init(&dc, cp, nm);
                rd_setdefault(&dm, RK_THETA, &j_theta_main, "rope_theta");
                rd_setdefault(&dc, RK_THETA, &j_theta_main, "rope_theta");
                ds4_rope_type tm, tc;
                if ((st = rd_type(&dm, &tm, err)) || (st = rd_type(&dc, &tc, err))) return st;
                env.default_prf =
                    (in->prf_explicit || tm == DS4_ROPE_YARN || tc == DS4_ROPE_YARN) ? in->prf : 1.0;
                if ((st = rd_resolve(&dm, &env, &c->rope_main, err))) return st;
                return rd_resolve(&dc, &env, &c->rope_compress, err);
            }
            /* One label is null: the V4 fold falls back to the flat form over the remaining keys, and its
             * `compress.setdefault("rope_type", "default")` runs without the legacy "type" lookup. */
            ignore_type = 1;
        }
        rd_init(&flat, src, src_name);
        if (ignore_type) flat.val[RK_TYPE] = NULL;
    } else {
        rd_init(&flat, NULL, "rope_parameters");
        /* Official inference config: YaRN on the compressed layers when original_seq_len > 0. */
        const ds4_json *osl = ds4_json_get(root, "original_seq_len");
        if (!is_null(osl)) {
            double o = 0;
            if ((st = get_num(osl, "original_seq_len", R_NONNEG, &o, err))) return st;
            if (o > 0) {
                rd_set(&flat, RK_ROPE_TYPE, &j_yarn, "original_seq_len");
                rd_set(&flat, RK_ORIG, osl, "original_seq_len");
                flat.val[RK_FACTOR] = ds4_json_get(root, "rope_factor");
                snprintf(flat.name[RK_FACTOR], sizeof flat.name[RK_FACTOR], "rope_factor");
                env.factor_name = "rope_factor";
                flat.val[RK_BETA_FAST] = ds4_json_get(root, "beta_fast");
                snprintf(flat.name[RK_BETA_FAST], sizeof flat.name[RK_BETA_FAST], "beta_fast");
                flat.val[RK_BETA_SLOW] = ds4_json_get(root, "beta_slow");
                snprintf(flat.name[RK_BETA_SLOW], sizeof flat.name[RK_BETA_SLOW], "beta_slow");
            }
        }
    }

    /* Flat form: "compress" = the flat dict with compress_rope_theta and the folded rotary factor forced;
     * YaRN there gets attention_factor 1.0 unless the key is present (the reference does not scale cos/sin).
     * "main" is plain RoPE at rope_theta. */
    rope_dict dc = flat, dm;
    rd_set(&dc, RK_THETA, &j_theta_c, "compress_rope_theta");
    rd_set(&dc, RK_PRF, &j_prf, "partial_rotary_factor");
    ds4_rope_type tc;
    if ((st = rd_type(&dc, &tc, err))) return st;
    if (tc == DS4_ROPE_YARN) rd_setdefault(&dc, RK_ATTN, &j_one, "attention_factor");
    if ((st = rd_resolve(&dc, &env, &c->rope_compress, err))) return st;
    rd_init(&dm, NULL, "rope_parameters.main");
    rd_set(&dm, RK_THETA, &j_theta_main, "rope_theta");
    rd_set(&dm, RK_PRF, &j_prf, "partial_rotary_factor");
    return rd_resolve(&dm, &env, &c->rope_main, err);
}

/* ------------------------------------------------------------------------------------------------ defaults */

static void rope_default(ds4_rope_params *r, double theta, int64_t head_dim, double prf) {
    memset(r, 0, sizeof *r);
    r->type = DS4_ROPE_DEFAULT;
    r->theta = theta;
    r->partial_rotary_factor = prf;
    r->dim = (int64_t)((double)head_dim * prf);
    r->factor = 1.0;
    r->attention_factor = 1.0;
    r->truncate = 1;
}

void ds4_config_default(ds4_config *c) {
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->vocab_size = 129280;
    c->hidden_size = 4096;
    c->num_hidden_layers = 43;
    c->num_attention_heads = 64;
    c->num_key_value_heads = 1;
    c->head_dim = 512;
    c->q_lora_rank = 1024;
    c->o_groups = 8;
    c->o_lora_rank = 1024;
    c->sliding_window = 128;
    c->compress_rate_csa = 4;
    c->compress_rate_hca = 128;
    for (int64_t i = 0; i < c->num_hidden_layers; i++) {
        c->layer_types[i] = (i >= 2 && (i - 2) % 2 == 1) ? DS4_ATTN_CSA : DS4_ATTN_HCA;
        c->layer_is_hash[i] = i < 3;
    }
    c->index_n_heads = 64;
    c->index_head_dim = 128;
    c->index_topk = 512;
    c->n_routed_experts = 256;
    c->num_experts_per_tok = 6;
    c->n_shared_experts = 1;
    c->moe_intermediate_size = 2048;
    c->scoring_func = DS4_SCORE_SQRTSOFTPLUS;
    c->norm_topk_prob = 1;
    c->routed_scaling_factor = 1.5;
    c->swiglu_limit = 10.0;
    c->hc_mult = 4;
    c->hc_sinkhorn_iters = 20;
    c->hc_eps = 1e-6;
    c->rms_norm_eps = 1e-6;
    const double prf = 64.0 / 512.0;
    c->rope_head_dim = (int64_t)(512 * prf);
    rope_default(&c->rope_main, 10000.0, c->head_dim, prf);
    rope_default(&c->rope_compress, 160000.0, c->head_dim, prf);
    c->max_position_embeddings = 1048576;
    c->num_nextn_predict_layers = 1;
    c->tie_word_embeddings = 0;
    c->bos_token_id = 0;
    c->eos_token_id = 1;
    c->initializer_range = 0.02;
}

/* ------------------------------------------------------------------------------------------------ parse */

static ds4_status parse_root(const ds4_json *root, ds4_config *c, ds4_error *err) {
    ds4_status st;
    if (root->type != DS4_JSON_OBJECT) return bad_field(err, "(top level)", "a JSON object", root);
    ds4_config_default(c);
    if ((st = read_fields(root, c, err))) return st;
    if ((st = read_strings(root, c, err))) return st;
    if (c->num_hidden_layers > DS4_MAX_LAYERS)
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'num_hidden_layers' must be at most %d (got %lld)",
                        DS4_MAX_LAYERS, (long long)c->num_hidden_layers);
    /* The default schedule was laid out for 43 layers; the fold below rewrites exactly n entries. */
    memset(c->layer_types, 0, sizeof c->layer_types);
    memset(c->layer_is_hash, 0, sizeof c->layer_is_hash);

    int have_csa, have_hca;
    if ((st = read_compress_rates(root, c, &have_csa, &have_hca, err))) return st;
    if ((st = read_layer_types(root, c, err))) return st;
    if ((st = read_mlp_types(root, c, err))) return st;
    for (int64_t i = 0; i < c->num_hidden_layers; i++) {
        ds4_attn_type t = c->layer_types[i];
        if ((t == DS4_ATTN_CSA && !have_csa) || (t == DS4_ATTN_HCA && !have_hca))
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'compress_rates' has no \"%s\" entry, needed by "
                            "layer %lld", ATTN_NAMES[t], (long long)i);
    }

    rope_in in;
    memset(&in, 0, sizeof in);
    in.head_dim = c->head_dim;
    in.max_pos = c->max_position_embeddings;
    in.theta_main = 10000.0;
    in.theta_compress = 160000.0;
    const ds4_json *v = ds4_json_get(root, "rope_theta");
    if (v && (st = get_num(v, "rope_theta", R_POS, &in.theta_main, err))) return st;
    v = ds4_json_get(root, "compress_rope_theta");
    if (v && (st = get_num(v, "compress_rope_theta", R_POS, &in.theta_compress, err))) return st;

    v = ds4_json_get(root, "partial_rotary_factor");
    if (!is_null(v)) {
        if ((st = get_num(v, "partial_rotary_factor", R_ANY, &in.prf, err))) return st;
        in.prf_explicit = 1;
    } else {
        const char *used = "qk_rope_head_dim";
        v = lookup3(root, "qk_rope_head_dim", NULL, "rope_head_dim", &used);
        if (!is_null(v)) {
            int64_t r;
            if ((st = get_int(v, used, 0, CFG_DIM_MAX, &r, err))) return st;
            in.prf = (double)r / (double)c->head_dim;
        } else {
            in.prf = 64.0 / 512.0;
        }
    }
    if ((st = rotary_dim(c->head_dim, in.prf, "partial_rotary_factor", &c->rope_head_dim, err))) return st;
    if ((st = read_rope(root, &in, c, err))) return st;
    return ds4_config_validate(c, err);
}

ds4_status ds4_config_parse(const char *json, size_t len, ds4_config *out, ds4_error *err) {
    if (!json || !out) return ds4_fail(err, DS4_ERR_ARG, "config: parse called with a NULL %s", json ? "output" : "text");
    ds4_error local;
    ds4_error *e = err ? err : &local;
    ds4_json_limits lim = {64, (size_t)1 << 20};
    ds4_json *root = ds4_json_parse(json, len, &lim, e);
    if (!root) {
        ds4_error_prefix(e, "config: ");
        return e->code;
    }
    ds4_config c;
    ds4_status st = parse_root(root, &c, e);
    ds4_json_free(root);
    if (st) return st;
    memcpy(out, &c, sizeof c); /* padding included: callers may compare configs with memcmp */
    return DS4_OK;
}

ds4_status ds4_config_load(const char *path, ds4_config *out, ds4_error *err) {
    if (!path || !out) return ds4_fail(err, DS4_ERR_ARG, "config: load called with a NULL %s", path ? "output" : "path");
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        return ds4_fail(err, e == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO, "config: %s: %s", path, strerror(e));
    }
    char *file = NULL;
    const char *fpath = path;
    if (S_ISDIR(sb.st_mode)) {
        size_t pl = strlen(path), need;
        if (!ds4_add_size(pl, sizeof "/config.json", &need))
            return ds4_fail(err, DS4_ERR_ARG, "config: path too long");
        file = malloc(need);
        if (!file) return ds4_fail(err, DS4_ERR_OOM, "config: cannot allocate %zu bytes for a path", need);
        snprintf(file, need, "%s%sconfig.json", path, (pl && path[pl - 1] == '/') ? "" : "/");
        fpath = file;
        if (stat(fpath, &sb) != 0) {
            int e = errno;
            ds4_status st = ds4_fail(err, e == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO,
                                     "config: no readable config.json in directory %s (%s)", path, strerror(e));
            free(file);
            return st;
        }
    }
    char *text = NULL;
    size_t len = 0;
    ds4_status st = ds4_read_file(fpath, CONFIG_MAX_BYTES, &text, &len, err);
    if (st) {
        ds4_error_prefix(err, "config: ");
        free(file);
        return st;
    }
    st = ds4_config_parse(text, len, out, err);
    if (st) ds4_error_prefix(err, "%s: ", fpath);
    free(text);
    free(file);
    return st;
}

/* ------------------------------------------------------------------------------------------------ validate */

static ds4_status check_range(const char *name, int64_t v, int64_t lo, int64_t hi, ds4_error *err) {
    if (v < lo || v > hi)
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' must be in [%lld, %lld] (got %lld)", name,
                        (long long)lo, (long long)hi, (long long)v);
    return DS4_OK;
}

static ds4_status check_rope(const char *label, const ds4_rope_params *r, int64_t head_dim, ds4_error *err) {
    if (r->type != DS4_ROPE_DEFAULT && r->type != DS4_ROPE_YARN)
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.type' has invalid value %d", label, (int)r->type);
    if (!(r->theta > 0) || !isfinite(r->theta))
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.rope_theta' must be a positive number (got %.17g)",
                        label, r->theta);
    if (!isfinite(r->partial_rotary_factor))
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.partial_rotary_factor' must be finite", label);
    if (r->dim <= 0 || r->dim > head_dim || r->dim % 2 != 0)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: rotary width of %s = int(head_dim %lld * partial_rotary_factor %.17g) = %lld must be "
                        "even and in (0, head_dim]",
                        label, (long long)head_dim, r->partial_rotary_factor, (long long)r->dim);
    if (r->type == DS4_ROPE_YARN) {
        /* log(base) divides the YaRN correction range. */
        if (r->theta == 1)
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.rope_theta' must not be 1 for YaRN", label);
        if (!(r->factor > 0) || !isfinite(r->factor))
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s.factor' must be a positive number (got %.17g)",
                            label, r->factor);
        if (!(r->original_max_position_embeddings > 0) || !isfinite(r->original_max_position_embeddings))
            return ds4_fail(err, DS4_ERR_CONFIG,
                            "config: field '%s.original_max_position_embeddings' must be positive (got %.17g)", label,
                            r->original_max_position_embeddings);
        if (!isfinite(r->beta_fast) || !isfinite(r->beta_slow))
            return ds4_fail(err, DS4_ERR_CONFIG, "config: fields '%s.beta_fast' / '%s.beta_slow' must be finite",
                            label, label);
        if (!(r->attention_factor >= 0) || !isfinite(r->attention_factor))
            return ds4_fail(err, DS4_ERR_CONFIG,
                            "config: field '%s.attention_factor' must be a non-negative number (got %.17g)", label,
                            r->attention_factor);
    }
    return DS4_OK;
}

ds4_status ds4_config_validate(const ds4_config *c, ds4_error *err) {
    ds4_status st;
    if (!c) return ds4_fail(err, DS4_ERR_ARG, "config: validate called with NULL");
    const struct {
        const char *name;
        int64_t v, hi;
    } sizes[] = {
        {"vocab_size", c->vocab_size, CFG_DIM_MAX},
        {"hidden_size", c->hidden_size, CFG_DIM_MAX},
        {"num_hidden_layers", c->num_hidden_layers, DS4_MAX_LAYERS},
        {"num_attention_heads", c->num_attention_heads, CFG_DIM_MAX},
        {"head_dim", c->head_dim, CFG_DIM_MAX},
        {"q_lora_rank", c->q_lora_rank, CFG_DIM_MAX},
        {"o_groups", c->o_groups, CFG_DIM_MAX},
        {"o_lora_rank", c->o_lora_rank, CFG_DIM_MAX},
        {"sliding_window", c->sliding_window, CFG_DIM_MAX},
        {"compress_rate_csa", c->compress_rate_csa, CFG_DIM_MAX},
        {"compress_rate_hca", c->compress_rate_hca, CFG_DIM_MAX},
        {"index_n_heads", c->index_n_heads, CFG_DIM_MAX},
        {"index_head_dim", c->index_head_dim, CFG_DIM_MAX},
        {"index_topk", c->index_topk, CFG_TOPK_MAX},
        {"n_routed_experts", c->n_routed_experts, CFG_DIM_MAX},
        {"moe_intermediate_size", c->moe_intermediate_size, CFG_DIM_MAX},
        {"hc_mult", c->hc_mult, CFG_DIM_MAX},
        {"hc_sinkhorn_iters", c->hc_sinkhorn_iters, CFG_SINKHORN_MAX},
        {"max_position_embeddings", c->max_position_embeddings, CFG_POS_MAX},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if ((st = check_range(sizes[i].name, sizes[i].v, 1, sizes[i].hi, err))) return st;
    if (c->num_key_value_heads != 1)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: field 'num_key_value_heads' must be 1 (DeepSeek-V4 shares one K=V head; got %lld)",
                        (long long)c->num_key_value_heads);
    if (c->num_attention_heads % c->o_groups != 0)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: field 'num_attention_heads' (%lld) must be divisible by 'o_groups' (%lld)",
                        (long long)c->num_attention_heads, (long long)c->o_groups);
    if (c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->n_routed_experts)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: field 'num_experts_per_tok' must be in [1, n_routed_experts = %lld] (got %lld)",
                        (long long)c->n_routed_experts, (long long)c->num_experts_per_tok);
    if (c->n_shared_experts != 1)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED,
                        "config: field 'n_shared_experts' = %lld is not supported (transformers builds exactly one "
                        "shared expert)",
                        (long long)c->n_shared_experts);
    if (c->num_nextn_predict_layers < 0 || c->num_nextn_predict_layers > CFG_MTP_MAX)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: field 'num_nextn_predict_layers' must be in [0, %d] (ds4 builds at most one MTP "
                        "block; got %lld)",
                        CFG_MTP_MAX, (long long)c->num_nextn_predict_layers);
    /* -1: none; otherwise an id the model can emit (a stop id outside the vocabulary is never sampled) */
    if ((st = check_range("bos_token_id", c->bos_token_id, -1, c->vocab_size - 1, err))) return st;
    if ((st = check_range("eos_token_id", c->eos_token_id, -1, c->vocab_size - 1, err))) return st;
    if ((int)c->scoring_func < 0 || (int)c->scoring_func > 2)
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'scoring_func' has invalid value %d", (int)c->scoring_func);
    if ((c->norm_topk_prob != 0 && c->norm_topk_prob != 1) || (c->tie_word_embeddings != 0 && c->tie_word_embeddings != 1))
        return ds4_fail(err, DS4_ERR_CONFIG, "config: fields 'norm_topk_prob' / 'tie_word_embeddings' must be 0 or 1");
    int any_csa = 0;
    for (int64_t i = 0; i < c->num_hidden_layers; i++) {
        int t = (int)c->layer_types[i];
        if (t < 0 || t > 2)
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'layer_types[%lld]' has invalid value %d", (long long)i, t);
        if (t == DS4_ATTN_CSA) any_csa = 1;
        if (c->layer_is_hash[i] != 0 && c->layer_is_hash[i] != 1)
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'mlp_layer_types[%lld]' has invalid value %d",
                            (long long)i, (int)c->layer_is_hash[i]);
    }
    struct {
        const char *name;
        double v;
        int pos;
    } nums[] = {
        {"hc_eps", c->hc_eps, 1},
        {"rms_norm_eps", c->rms_norm_eps, 1},
        {"swiglu_limit", c->swiglu_limit, 0},
        {"initializer_range", c->initializer_range, 0},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        double x = nums[i].v;
        if (!isfinite(x) || (nums[i].pos ? !(x > 0) : !(x >= 0)))
            return ds4_fail(err, DS4_ERR_CONFIG, "config: field '%s' must be a %s number (got %.17g)", nums[i].name,
                            nums[i].pos ? "positive" : "non-negative", x);
    }
    if (!isfinite(c->routed_scaling_factor))
        return ds4_fail(err, DS4_ERR_CONFIG, "config: field 'routed_scaling_factor' must be finite");
    if ((st = check_rope("rope_parameters.main", &c->rope_main, c->head_dim, err))) return st;
    if ((st = check_rope("rope_parameters.compress", &c->rope_compress, c->head_dim, err))) return st;
    if (any_csa && c->rope_compress.dim > c->index_head_dim)
        return ds4_fail(err, DS4_ERR_CONFIG,
                        "config: compressed rotary width %lld (rope_parameters.compress.partial_rotary_factor * head_dim) "
                        "exceeds 'index_head_dim' (%lld), which the CSA indexer rotates",
                        (long long)c->rope_compress.dim, (long long)c->index_head_dim);
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ to_json */

typedef struct strbuf {
    char *buf;
    size_t len, cap;
    int oom;
} strbuf;

static void sb_put(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    size_t need;
    if (!ds4_add_size(b->len, n + 1, &need)) {
        b->oom = 1;
        return;
    }
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < need) cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (!nb) {
            b->oom = 1;
            return;
        }
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = 0;
}

static void sb_printf(strbuf *b, const char *fmt, ...) DS4_PRINTF(2, 3);
static void sb_printf(strbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) {
        b->oom = 1;
        return;
    }
    sb_put(b, tmp, (size_t)n);
}

/* Shortest "%.Ng" that reads back to the same double; the decimal point is forced to '.' whatever the
 * locale, so the output stays JSON. Fields that transformers types as float get a fraction or exponent
 * ("10.0", not "10"), so that its strict dataclass check sees a float. */
static void sb_double(strbuf *b, double d, int as_float) {
    char tmp[64];
    if (!isfinite(d)) {
        sb_put(b, "null", 4);
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (prec == 17 || strtod(tmp, NULL) == d) break;
    }
    int has_frac = 0;
    for (char *p = tmp; *p; p++) {
        if (*p == ',') *p = '.';
        if (*p == '.' || *p == 'e') has_frac = 1;
    }
    sb_put(b, tmp, strlen(tmp));
    if (as_float && !has_frac) sb_put(b, ".0", 2);
}

static void sb_key(strbuf *b, const char *indent, const char *key) { sb_printf(b, ",\n%s\"%s\": ", indent, key); }

static void sb_int_field(strbuf *b, const char *key, int64_t v) {
    sb_key(b, "  ", key);
    sb_printf(b, "%lld", (long long)v);
}

static void sb_num_field(strbuf *b, const char *indent, const char *key, double v) {
    sb_key(b, indent, key);
    sb_double(b, v, 1);
}

/* Numbers HF reads as int or float alike (YaRN sizes and betas): integral values print as integers. */
static void sb_plain_num_field(strbuf *b, const char *indent, const char *key, double v) {
    sb_key(b, indent, key);
    sb_double(b, v, 0);
}

static void sb_rope(strbuf *b, const char *label, const ds4_rope_params *r) {
    sb_printf(b, "\"%s\": {\n      \"rope_type\": \"%s\"", label, r->type == DS4_ROPE_YARN ? "yarn" : "default");
    sb_num_field(b, "      ", "rope_theta", r->theta);
    sb_num_field(b, "      ", "partial_rotary_factor", r->partial_rotary_factor);
    if (r->type == DS4_ROPE_YARN) {
        sb_plain_num_field(b, "      ", "factor", r->factor);
        sb_plain_num_field(b, "      ", "original_max_position_embeddings", r->original_max_position_embeddings);
        sb_plain_num_field(b, "      ", "beta_fast", r->beta_fast);
        sb_plain_num_field(b, "      ", "beta_slow", r->beta_slow);
        sb_num_field(b, "      ", "attention_factor", r->attention_factor);
    }
    sb_put(b, "\n    }", 6);
}

/* A top-level partial_rotary_factor that folds back to rope_head_dim under int(head_dim * f). */
static int folds_to(double hd, double f, int64_t want, int64_t *got) {
    double x = hd * f;
    if (!(x > -4e18 && x < 4e18)) return 0;
    *got = (int64_t)x;
    return *got == want;
}

static double top_rotary_factor(const ds4_config *c) {
    double hd = (double)c->head_dim;
    double f = c->rope_main.partial_rotary_factor;
    int64_t got = 0;
    if (c->head_dim <= 0) return f;
    if (folds_to(hd, f, c->rope_head_dim, &got)) return f;
    f = (double)c->rope_head_dim / hd;
    for (int i = 0; i < 8 && !folds_to(hd, f, c->rope_head_dim, &got); i++)
        f = nextafter(f, got < c->rope_head_dim ? INFINITY : -INFINITY);
    return f;
}

char *ds4_config_to_json(const ds4_config *c) {
    if (!c) return NULL;
    strbuf b = {NULL, 0, 0, 0};
    sb_printf(&b, "{\n  \"architectures\": [\"DeepseekV4ForCausalLM\"]");
    sb_printf(&b, ",\n  \"model_type\": \"deepseek_v4\"");
    sb_int_field(&b, "vocab_size", c->vocab_size);
    sb_int_field(&b, "hidden_size", c->hidden_size);
    sb_int_field(&b, "num_hidden_layers", c->num_hidden_layers);
    sb_int_field(&b, "num_attention_heads", c->num_attention_heads);
    sb_int_field(&b, "num_key_value_heads", c->num_key_value_heads);
    sb_int_field(&b, "head_dim", c->head_dim);
    sb_int_field(&b, "q_lora_rank", c->q_lora_rank);
    sb_int_field(&b, "o_groups", c->o_groups);
    sb_int_field(&b, "o_lora_rank", c->o_lora_rank);
    sb_int_field(&b, "sliding_window", c->sliding_window);
    int64_t n = c->num_hidden_layers;
    if (n < 0) n = 0;
    if (n > DS4_MAX_LAYERS) n = DS4_MAX_LAYERS;
    sb_key(&b, "  ", "layer_types");
    sb_put(&b, "[", 1);
    for (int64_t i = 0; i < n; i++)
        sb_printf(&b, "%s\n    \"%s\"", i ? "," : "", ds4_attn_type_name(c->layer_types[i]));
    sb_put(&b, n ? "\n  ]" : "]", n ? 4 : 1);
    sb_key(&b, "  ", "mlp_layer_types");
    sb_put(&b, "[", 1);
    for (int64_t i = 0; i < n; i++) sb_printf(&b, "%s\n    \"%s\"", i ? "," : "", mlp_name(c->layer_is_hash[i]));
    sb_put(&b, n ? "\n  ]" : "]", n ? 4 : 1);
    sb_key(&b, "  ", "compress_rates");
    sb_printf(&b, "{\n    \"%s\": %lld,\n    \"%s\": %lld\n  }", ATTN_NAMES[DS4_ATTN_CSA],
              (long long)c->compress_rate_csa, ATTN_NAMES[DS4_ATTN_HCA], (long long)c->compress_rate_hca);
    sb_int_field(&b, "index_n_heads", c->index_n_heads);
    sb_int_field(&b, "index_head_dim", c->index_head_dim);
    sb_int_field(&b, "index_topk", c->index_topk);
    sb_int_field(&b, "n_routed_experts", c->n_routed_experts);
    sb_int_field(&b, "num_experts_per_tok", c->num_experts_per_tok);
    sb_int_field(&b, "n_shared_experts", c->n_shared_experts);
    sb_int_field(&b, "moe_intermediate_size", c->moe_intermediate_size);
    sb_key(&b, "  ", "scoring_func");
    sb_printf(&b, "\"%s\"",
              ((int)c->scoring_func >= 0 && (int)c->scoring_func < 3) ? SCORE_NAMES[c->scoring_func] : "unknown");
    sb_key(&b, "  ", "norm_topk_prob");
    sb_printf(&b, "%s", c->norm_topk_prob ? "true" : "false");
    sb_num_field(&b, "  ", "routed_scaling_factor", c->routed_scaling_factor);
    sb_num_field(&b, "  ", "swiglu_limit", c->swiglu_limit);
    sb_int_field(&b, "hc_mult", c->hc_mult);
    sb_int_field(&b, "hc_sinkhorn_iters", c->hc_sinkhorn_iters);
    sb_num_field(&b, "  ", "hc_eps", c->hc_eps);
    sb_num_field(&b, "  ", "rms_norm_eps", c->rms_norm_eps);
    sb_printf(&b, ",\n  \"hidden_act\": \"silu\"");
    sb_num_field(&b, "  ", "rope_theta", c->rope_main.theta);
    sb_num_field(&b, "  ", "compress_rope_theta", c->rope_compress.theta);
    sb_num_field(&b, "  ", "partial_rotary_factor", top_rotary_factor(c));
    sb_key(&b, "  ", "rope_parameters");
    sb_put(&b, "{\n    ", 6);
    sb_rope(&b, "main", &c->rope_main);
    sb_put(&b, ",\n    ", 6);
    sb_rope(&b, "compress", &c->rope_compress);
    sb_put(&b, "\n  }", 4);
    sb_int_field(&b, "max_position_embeddings", c->max_position_embeddings);
    sb_int_field(&b, "num_nextn_predict_layers", c->num_nextn_predict_layers);
    sb_key(&b, "  ", "tie_word_embeddings");
    sb_printf(&b, "%s", c->tie_word_embeddings ? "true" : "false");
    sb_key(&b, "  ", "bos_token_id");
    if (c->bos_token_id < 0)
        sb_put(&b, "null", 4);
    else
        sb_printf(&b, "%lld", (long long)c->bos_token_id);
    sb_key(&b, "  ", "eos_token_id");
    if (c->eos_token_id < 0)
        sb_put(&b, "null", 4);
    else
        sb_printf(&b, "%lld", (long long)c->eos_token_id);
    sb_num_field(&b, "  ", "initializer_range", c->initializer_range);
    sb_put(&b, "\n}\n", 3);
    if (b.oom) {
        free(b.buf);
        return NULL;
    }
    return b.buf;
}
