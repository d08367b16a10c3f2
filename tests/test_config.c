/* test_config.c — config.json folding against transformers' own resolution of the fixture configs, the
 * released V4-Flash config, the official inference spelling, every error class, and the to_json round trip.
 * argv[1] is the fixtures directory. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "json.h"
#include "testlib.h"

static const char *fixtures = "tests/fixtures";

static ds4_status parse_str(const char *text, ds4_config *c, ds4_error *err) {
    memset(err, 0, sizeof *err);
    return ds4_config_parse(text, strlen(text), c, err);
}

/* ------------------------------------------------------------------------------------------------ (a) fixtures */

static const ds4_json *member(const ds4_json *o, const char *k, int line) {
    const ds4_json *v = ds4_json_get(o, k);
    CHECK(v != NULL, "line %d: reference lacks '%s'", line, k);
    return v;
}

static double num_of(const ds4_json *o, const char *k, int line) {
    const ds4_json *v = member(o, k, line);
    return v && v->type == DS4_JSON_NUMBER ? v->number : NAN;
}

/* Compare one of our resolved rope dicts with the one transformers wrote. */
static void compare_rope(const char *name, const char *label, const ds4_json *ref, const ds4_rope_params *r,
                         int64_t head_dim) {
    if (!ref) return;
    const ds4_json *t = member(ref, "rope_type", __LINE__);
    int yarn = t && t->type == DS4_JSON_STRING && strcmp(t->str, "yarn") == 0;
    CHECK(r->type == (yarn ? DS4_ROPE_YARN : DS4_ROPE_DEFAULT), "%s %s: rope type %d", name, label, (int)r->type);
    CHECK(r->theta == num_of(ref, "rope_theta", __LINE__), "%s %s: theta %g", name, label, r->theta);
    double prf = num_of(ref, "partial_rotary_factor", __LINE__);
    CHECK(r->partial_rotary_factor == prf, "%s %s: prf %g vs %g", name, label, r->partial_rotary_factor, prf);
    CHECK(r->dim == (int64_t)((double)head_dim * prf), "%s %s: dim %lld", name, label, (long long)r->dim);
    CHECK(r->truncate == 1, "%s %s: truncate", name, label);
    if (!yarn) return;
    CHECK(r->factor == num_of(ref, "factor", __LINE__), "%s %s: factor %g", name, label, r->factor);
    CHECK(r->original_max_position_embeddings == num_of(ref, "original_max_position_embeddings", __LINE__),
          "%s %s: original_max_position_embeddings %g", name, label, r->original_max_position_embeddings);
    CHECK(r->beta_fast == num_of(ref, "beta_fast", __LINE__), "%s %s: beta_fast %g", name, label, r->beta_fast);
    CHECK(r->beta_slow == num_of(ref, "beta_slow", __LINE__), "%s %s: beta_slow %g", name, label, r->beta_slow);
    CHECK(r->attention_factor == num_of(ref, "attention_factor", __LINE__), "%s %s: attention_factor %g", name,
          label, r->attention_factor);
}

/* Scalars that transformers copies through unchanged: compare with the input config.json itself. */
static void compare_scalars(const char *name, const ds4_json *cfg, const ds4_config *c) {
    const struct {
        const char *key;
        int64_t v;
    } ints[] = {
        {"vocab_size", c->vocab_size},
        {"hidden_size", c->hidden_size},
        {"num_hidden_layers", c->num_hidden_layers},
        {"num_attention_heads", c->num_attention_heads},
        {"num_key_value_heads", c->num_key_value_heads},
        {"head_dim", c->head_dim},
        {"q_lora_rank", c->q_lora_rank},
        {"o_groups", c->o_groups},
        {"o_lora_rank", c->o_lora_rank},
        {"sliding_window", c->sliding_window},
        {"index_n_heads", c->index_n_heads},
        {"index_head_dim", c->index_head_dim},
        {"index_topk", c->index_topk},
        {"n_routed_experts", c->n_routed_experts},
        {"num_experts_per_tok", c->num_experts_per_tok},
        {"n_shared_experts", c->n_shared_experts},
        {"moe_intermediate_size", c->moe_intermediate_size},
        {"hc_mult", c->hc_mult},
        {"hc_sinkhorn_iters", c->hc_sinkhorn_iters},
        {"max_position_embeddings", c->max_position_embeddings},
        {"num_nextn_predict_layers", c->num_nextn_predict_layers},
        {"bos_token_id", c->bos_token_id},
        {"eos_token_id", c->eos_token_id},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        const ds4_json *v = ds4_json_get(cfg, ints[i].key);
        if (!v) continue;
        CHECK(v->is_int && v->integer == ints[i].v, "%s: %s = %lld, config.json has %lld", name, ints[i].key,
              (long long)ints[i].v, (long long)v->integer);
    }
    const struct {
        const char *key;
        double v;
    } nums[] = {
        {"routed_scaling_factor", c->routed_scaling_factor},
        {"swiglu_limit", c->swiglu_limit},
        {"hc_eps", c->hc_eps},
        {"rms_norm_eps", c->rms_norm_eps},
        {"initializer_range", c->initializer_range},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        const ds4_json *v = ds4_json_get(cfg, nums[i].key);
        if (!v) continue;
        CHECK(v->number == nums[i].v, "%s: %s = %g, config.json has %g", name, nums[i].key, nums[i].v, v->number);
    }
}

static ds4_json *load_json(const char *path) {
    char *text = NULL;
    size_t len = 0;
    ds4_error err;
    if (ds4_read_file(path, (size_t)16 << 20, &text, &len, &err) != DS4_OK) {
        CHECK(0, "cannot read %s: %s", path, err.msg);
        return NULL;
    }
    ds4_json *v = ds4_json_parse(text, len, NULL, &err);
    CHECK(v != NULL, "cannot parse %s: %s", path, err.msg);
    free(text);
    return v;
}

static void test_fixture(const char *name, ds4_config *out) {
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    ds4_error err;
    ds4_config c;
    memset(&c, 0, sizeof c);
    CHECK_OK(ds4_config_load(dir, &c, &err), &err);

    /* The same result through the file path. */
    ds4_config c2;
    memset(&c2, 0, sizeof c2);
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK_OK(ds4_config_load(path, &c2, &err), &err);
    CHECK(memcmp(&c, &c2, sizeof c) == 0, "%s: loading the directory and the file differ", name);

    snprintf(path, sizeof path, "%s/resolved_config.json", dir);
    ds4_json *ref = load_json(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ds4_json *cfg = load_json(path);
    if (!ref || !cfg) {
        ds4_json_free(ref);
        ds4_json_free(cfg);
        return;
    }
    int64_t n = c.num_hidden_layers;
    const ds4_json *lt = member(ref, "layer_types", __LINE__);
    CHECK(lt && (int64_t)lt->count == n, "%s: %lld layers, reference has %zu", name, (long long)n, lt ? lt->count : 0);
    for (int64_t i = 0; lt && i < n && i < (int64_t)lt->count; i++)
        CHECK(strcmp(ds4_attn_type_name(c.layer_types[i]), lt->items[i].str) == 0, "%s: layer %lld is %s, HF says %s",
              name, (long long)i, ds4_attn_type_name(c.layer_types[i]), lt->items[i].str);
    const ds4_json *mt = member(ref, "mlp_layer_types", __LINE__);
    CHECK(mt && (int64_t)mt->count == n, "%s: mlp_layer_types length", name);
    for (int64_t i = 0; mt && i < n && i < (int64_t)mt->count; i++)
        CHECK(strcmp(c.layer_is_hash[i] ? "hash_moe" : "moe", mt->items[i].str) == 0, "%s: mlp layer %lld: HF says %s",
              name, (long long)i, mt->items[i].str);
    const ds4_json *cr = member(ref, "compress_rates", __LINE__);
    CHECK(c.compress_rate_csa == num_of(cr, "compressed_sparse_attention", __LINE__), "%s: compress_rate_csa %lld",
          name, (long long)c.compress_rate_csa);
    CHECK(c.compress_rate_hca == num_of(cr, "heavily_compressed_attention", __LINE__), "%s: compress_rate_hca %lld",
          name, (long long)c.compress_rate_hca);
    const ds4_json *rp = member(ref, "rope_parameters", __LINE__);
    compare_rope(name, "main", ds4_json_get(rp, "main"), &c.rope_main, c.head_dim);
    compare_rope(name, "compress", ds4_json_get(rp, "compress"), &c.rope_compress, c.head_dim);
    double prf = num_of(ref, "partial_rotary_factor", __LINE__);
    CHECK(c.rope_head_dim == (int64_t)((double)c.head_dim * prf), "%s: rope_head_dim %lld", name,
          (long long)c.rope_head_dim);
    compare_scalars(name, cfg, &c);
    ds4_json_free(ref);
    ds4_json_free(cfg);
    if (out) *out = c;
}

/* ------------------------------------------------------------------------------------------------ (b) V4-Flash */

/* The released deepseek-ai/DeepSeek-V4-Flash config.json (docs/architecture.md, "Configuration"), legacy spellings
 * included. */
static char *flash_json(void) {
    char ratios[512];
    size_t l = (size_t)snprintf(ratios, sizeof ratios, "[0, 0");
    for (int i = 0; i < 20; i++) l += (size_t)snprintf(ratios + l, sizeof ratios - l, ", 4, 128");
    snprintf(ratios + l, sizeof ratios - l, ", 4, 0]");
    const char *fmt =
        "{\n"
        "  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n"
        "  \"model_type\": \"deepseek_v4\",\n"
        "  \"attention_bias\": false,\n"
        "  \"bos_token_id\": 0,\n"
        "  \"eos_token_id\": 1,\n"
        "  \"compress_ratios\": %s,\n"
        "  \"compress_rope_theta\": 160000,\n"
        "  \"expert_dtype\": \"fp4\",\n"
        "  \"first_k_dense_replace\": 0,\n"
        "  \"hc_eps\": 1e-06,\n"
        "  \"hc_mult\": 4,\n"
        "  \"hc_sinkhorn_iters\": 20,\n"
        "  \"head_dim\": 512,\n"
        "  \"hidden_act\": \"silu\",\n"
        "  \"hidden_size\": 4096,\n"
        "  \"index_head_dim\": 128,\n"
        "  \"index_n_heads\": 64,\n"
        "  \"index_topk\": 512,\n"
        "  \"initializer_range\": 0.02,\n"
        "  \"max_position_embeddings\": 1048576,\n"
        "  \"moe_intermediate_size\": 2048,\n"
        "  \"n_routed_experts\": 256,\n"
        "  \"n_shared_experts\": 1,\n"
        "  \"norm_topk_prob\": true,\n"
        "  \"num_attention_heads\": 64,\n"
        "  \"num_experts_per_tok\": 6,\n"
        "  \"num_hash_layers\": 3,\n"
        "  \"num_hidden_layers\": 43,\n"
        "  \"num_key_value_heads\": 1,\n"
        "  \"num_nextn_predict_layers\": 1,\n"
        "  \"o_groups\": 8,\n"
        "  \"o_lora_rank\": 1024,\n"
        "  \"q_lora_rank\": 1024,\n"
        "  \"qk_rope_head_dim\": 64,\n"
        "  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": \"fp8\",\n"
        "                          \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128]},\n"
        "  \"rms_norm_eps\": 1e-06,\n"
        "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16,\n"
        "                   \"original_max_position_embeddings\": 65536, \"type\": \"yarn\"},\n"
        "  \"rope_theta\": 10000,\n"
        "  \"routed_scaling_factor\": 1.5,\n"
        "  \"scoring_func\": \"sqrtsoftplus\",\n"
        "  \"sliding_window\": 128,\n"
        "  \"swiglu_limit\": 10.0,\n"
        "  \"tie_word_embeddings\": false,\n"
        "  \"topk_method\": \"noaux_tc\",\n"
        "  \"torch_dtype\": \"bfloat16\",\n"
        "  \"transformers_version\": \"4.57.1\",\n"
        "  \"use_cache\": true,\n"
        "  \"vocab_size\": 129280\n"
        "}\n";
    size_t cap = strlen(fmt) + strlen(ratios) + 1;
    char *s = malloc(cap);
    snprintf(s, cap, fmt, ratios);
    return s;
}

static void test_flash(ds4_config *out) {
    char *text = flash_json();
    ds4_config c;
    ds4_error err;
    CHECK_OK(parse_str(text, &c, &err), &err);
    free(text);
    int n_sl = 0, n_csa = 0, n_hca = 0;
    for (int i = 0; i < c.num_hidden_layers; i++) {
        n_sl += c.layer_types[i] == DS4_ATTN_SLIDING;
        n_csa += c.layer_types[i] == DS4_ATTN_CSA;
        n_hca += c.layer_types[i] == DS4_ATTN_HCA;
        CHECK(c.layer_is_hash[i] == (i < 3), "flash: layer %d hash %d", i, c.layer_is_hash[i]);
    }
    CHECK(c.num_hidden_layers == 43, "flash: 43 layers");
    CHECK(n_sl == 2 && n_csa == 21 && n_hca == 20, "flash: %d sliding, %d CSA, %d HCA", n_sl, n_csa, n_hca);
    CHECK(c.layer_types[0] == DS4_ATTN_SLIDING && c.layer_types[1] == DS4_ATTN_SLIDING &&
              c.layer_types[2] == DS4_ATTN_CSA && c.layer_types[3] == DS4_ATTN_HCA && c.layer_types[42] == DS4_ATTN_CSA,
          "flash: schedule");
    CHECK(c.compress_rate_csa == 4 && c.compress_rate_hca == 128, "flash: rates");
    CHECK(c.rope_head_dim == 64, "flash: rope_head_dim %lld", (long long)c.rope_head_dim);
    CHECK(c.rope_main.type == DS4_ROPE_DEFAULT && c.rope_main.theta == 10000 && c.rope_main.dim == 64 &&
              c.rope_main.partial_rotary_factor == 0.125,
          "flash: main rope");
    const ds4_rope_params *r = &c.rope_compress;
    CHECK(r->type == DS4_ROPE_YARN && r->theta == 160000 && r->dim == 64 && r->partial_rotary_factor == 0.125,
          "flash: compress rope type %d theta %g dim %lld", (int)r->type, r->theta, (long long)r->dim);
    CHECK(r->factor == 16 && r->original_max_position_embeddings == 65536 && r->beta_fast == 32 && r->beta_slow == 1,
          "flash: yarn factor %g orig %g beta %g/%g", r->factor, r->original_max_position_embeddings, r->beta_fast,
          r->beta_slow);
    CHECK(r->attention_factor == 1.0 && r->truncate == 1, "flash: attention_factor %g", r->attention_factor);
    CHECK(c.vocab_size == 129280 && c.hidden_size == 4096 && c.num_attention_heads == 64 && c.head_dim == 512 &&
              c.q_lora_rank == 1024 && c.o_groups == 8 && c.o_lora_rank == 1024 && c.sliding_window == 128 &&
              c.index_n_heads == 64 && c.index_head_dim == 128 && c.index_topk == 512 && c.n_routed_experts == 256 &&
              c.num_experts_per_tok == 6 && c.moe_intermediate_size == 2048 && c.hc_mult == 4 &&
              c.num_nextn_predict_layers == 1 && c.routed_scaling_factor == 1.5 && c.swiglu_limit == 10.0 &&
              c.scoring_func == DS4_SCORE_SQRTSOFTPLUS && c.norm_topk_prob == 1 && c.bos_token_id == 0 &&
              c.eos_token_id == 1,
          "flash: scalar fields");
    *out = c;
}

/* The official inference/config.json spelling of the same model must fold to the identical struct. */
static void test_official(const ds4_config *flash) {
    char ratios[512];
    size_t l = (size_t)snprintf(ratios, sizeof ratios, "[0, 0");
    for (int i = 0; i < 20; i++) l += (size_t)snprintf(ratios + l, sizeof ratios - l, ", 4, 128");
    snprintf(ratios + l, sizeof ratios - l, ", 4, 0]");
    char text[4096];
    snprintf(text, sizeof text,
             "{\"vocab_size\": 129280, \"dim\": 4096, \"moe_inter_dim\": 2048, \"n_layers\": 43, \"n_hash_layers\": 3,"
             " \"n_mtp_layers\": 1, \"n_heads\": 64, \"norm_eps\": 1e-06, \"n_routed_experts\": 256,"
             " \"n_shared_experts\": 1, \"n_activated_experts\": 6, \"score_func\": \"sqrtsoftplus\","
             " \"route_scale\": 1.5, \"swiglu_limit\": 10.0, \"q_lora_rank\": 1024, \"head_dim\": 512,"
             " \"rope_head_dim\": 64, \"o_groups\": 8, \"o_lora_rank\": 1024, \"window_size\": 128,"
             " \"compress_ratios\": %s, \"compress_rope_theta\": 160000.0, \"original_seq_len\": 65536,"
             " \"rope_theta\": 10000.0, \"rope_factor\": 16, \"beta_fast\": 32, \"beta_slow\": 1,"
             " \"index_n_heads\": 64, \"index_head_dim\": 128, \"index_topk\": 512, \"hc_mult\": 4,"
             " \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-06, \"dtype\": \"fp8\", \"scale_fmt\": \"ue8m0\","
             " \"expert_dtype\": \"fp4\", \"max_batch_size\": 4, \"max_seq_len\": 4096}",
             ratios);
    ds4_config c;
    ds4_error err;
    CHECK_OK(parse_str(text, &c, &err), &err);
    CHECK(memcmp(&c, flash, sizeof c) == 0, "official spelling folds differently from the HF V4-Flash config");

    /* HF names win over official ones; without original_seq_len there is no YaRN. */
    CHECK_OK(parse_str("{\"dim\": 64, \"hidden_size\": 4096, \"rope_factor\": 4}", &c, &err), &err);
    CHECK(c.hidden_size == 4096 && c.rope_compress.type == DS4_ROPE_DEFAULT, "HF name wins over 'dim'");
    CHECK_STATUS(parse_str("{\"original_seq_len\": 4096}", &c, &err), DS4_ERR_CONFIG, &err);
    CHECK(strstr(err.msg, "'rope_factor'") != NULL, "missing rope_factor named: %s", err.msg);
}

/* ------------------------------------------------------------------------------------------------ folding rules */

static void test_defaults(void) {
    ds4_config d, c;
    ds4_error err;
    ds4_config_default(&d);
    CHECK_OK(ds4_config_validate(&d, &err), &err);
    CHECK_OK(parse_str("{}", &c, &err), &err);
    CHECK(memcmp(&c, &d, sizeof c) == 0, "parse(\"{}\") differs from ds4_config_default");
    /* V4-Pro default schedule: HCA, HCA, then HCA/CSA alternating. */
    static const ds4_attn_type want[6] = {DS4_ATTN_HCA, DS4_ATTN_HCA, DS4_ATTN_HCA,
                                          DS4_ATTN_CSA, DS4_ATTN_HCA, DS4_ATTN_CSA};
    CHECK_OK(parse_str("{\"num_hidden_layers\": 6}", &c, &err), &err);
    for (int i = 0; i < 6; i++) CHECK(c.layer_types[i] == want[i], "default schedule layer %d = %d", i, c.layer_types[i]);
    CHECK(c.layer_is_hash[2] == 1 && c.layer_is_hash[3] == 0, "default: 3 hash layers");
    CHECK(c.rope_compress.type == DS4_ROPE_DEFAULT && c.rope_compress.theta == 160000, "default compress rope is plain");
    CHECK(strcmp(ds4_attn_type_name(DS4_ATTN_SLIDING), "sliding_attention") == 0 &&
              strcmp(ds4_attn_type_name(DS4_ATTN_CSA), "compressed_sparse_attention") == 0 &&
              strcmp(ds4_attn_type_name(DS4_ATTN_HCA), "heavily_compressed_attention") == 0 &&
              strcmp(ds4_attn_type_name((ds4_attn_type)7), "unknown") == 0,
          "attention type names");
}

static void test_folding(void) {
    ds4_config c;
    ds4_error err;
    /* num_hash_layers extremes; explicit lists win over legacy keys; lists longer than n are truncated. */
    CHECK_OK(parse_str("{\"num_hidden_layers\": 2, \"num_hash_layers\": 0}", &c, &err), &err);
    CHECK(c.layer_is_hash[0] == 0 && c.layer_is_hash[1] == 0, "num_hash_layers 0");
    CHECK_OK(parse_str("{\"num_hidden_layers\": 2, \"num_hash_layers\": 9}", &c, &err), &err);
    CHECK(c.layer_is_hash[0] == 1 && c.layer_is_hash[1] == 1, "num_hash_layers > n");
    CHECK_OK(parse_str("{\"num_hidden_layers\": 2, \"num_hash_layers\": 2, \"mlp_layer_types\": [\"moe\", \"hash_moe\","
                       " \"bogus\"], \"compress_ratios\": [0, 0], \"layer_types\": [\"compressed_sparse_attention\","
                       " \"sliding_attention\", 17]}",
                       &c, &err),
             &err);
    CHECK(c.layer_is_hash[0] == 0 && c.layer_is_hash[1] == 1, "explicit mlp_layer_types wins");
    CHECK(c.layer_types[0] == DS4_ATTN_CSA && c.layer_types[1] == DS4_ATTN_SLIDING, "explicit layer_types wins");
    /* compress_ratios entries compare like Python numbers (4.0 == 4); the MTP entry is dropped. */
    CHECK_OK(parse_str("{\"num_hidden_layers\": 3, \"compress_ratios\": [4.0, 128, 0e0, 4]}", &c, &err), &err);
    CHECK(c.layer_types[0] == DS4_ATTN_CSA && c.layer_types[1] == DS4_ATTN_HCA && c.layer_types[2] == DS4_ATTN_SLIDING,
          "compress_ratios mapping");
    /* compress_rate_csa / hca override the dict; null legacy keys are ignored. */
    CHECK_OK(parse_str("{\"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 64},"
                       " \"compress_rate_hca\": 32, \"compress_rate_csa\": null}",
                       &c, &err),
             &err);
    CHECK(c.compress_rate_csa == 4 && c.compress_rate_hca == 32, "compress_rate_hca overrides");
    /* A dict missing a rate is fine as long as no layer needs it. */
    CHECK_OK(parse_str("{\"num_hidden_layers\": 1, \"layer_types\": [\"sliding_attention\"], \"compress_rates\": {}}", &c,
                       &err),
             &err);
    /* attribute_map aliases are assigned after the fields, as HF's setattr does. */
    CHECK_OK(parse_str("{\"n_routed_experts\": 8, \"num_local_experts\": 16, \"intermediate_size\": 96}", &c, &err), &err);
    CHECK(c.n_routed_experts == 16 && c.moe_intermediate_size == 96, "aliases");
    /* Token ids: null, list. */
    CHECK_OK(parse_str("{\"bos_token_id\": null, \"eos_token_id\": [7, 9]}", &c, &err), &err);
    CHECK(c.bos_token_id == -1 && c.eos_token_id == 7, "token ids %lld %lld", (long long)c.bos_token_id,
          (long long)c.eos_token_id);
    /* qk_rope_head_dim only matters without partial_rotary_factor. */
    CHECK_OK(parse_str("{\"qk_rope_head_dim\": 32, \"partial_rotary_factor\": 0.25}", &c, &err), &err);
    CHECK(c.rope_head_dim == 128 && c.rope_main.dim == 128 && c.rope_compress.dim == 128, "explicit prf wins");
    CHECK_OK(parse_str("{\"qk_rope_head_dim\": 32}", &c, &err), &err);
    CHECK(c.rope_head_dim == 32 && c.rope_main.partial_rotary_factor == 32.0 / 512, "qk_rope_head_dim folds");
    CHECK_OK(parse_str("{\"num_hidden_layers\": 2, \"layer_types\": [\"sliding_attention\", \"heavily_compressed_attention\"],"
                       " \"head_dim\": 48, \"qk_rope_head_dim\": 10}",
                       &c, &err),
             &err);
    CHECK(c.rope_head_dim == (int64_t)(48 * (10.0 / 48)), "python int() of the double product");
}

static void test_rope(void) {
    ds4_config c;
    ds4_error err;
    /* Flat rope_parameters: theta and the rotary factor of "compress" are forced, attention_factor
     * defaults to 1.0, original_max_position_embeddings to max_position_embeddings. */
    CHECK_OK(parse_str("{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 8, \"rope_theta\": 5,"
                       " \"partial_rotary_factor\": 0.5}, \"max_position_embeddings\": 4096}",
                       &c, &err),
             &err);
    CHECK(c.rope_compress.type == DS4_ROPE_YARN && c.rope_compress.theta == 160000 &&
              c.rope_compress.partial_rotary_factor == 0.125 && c.rope_compress.attention_factor == 1.0 &&
              c.rope_compress.original_max_position_embeddings == 4096 && c.rope_compress.factor == 8,
          "flat rope_parameters");
    CHECK(c.rope_main.type == DS4_ROPE_DEFAULT && c.rope_main.theta == 10000, "flat: main is plain");
    /* rope_scaling wins over rope_parameters unless empty. */
    CHECK_OK(parse_str("{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2}, \"rope_parameters\": {\"rope_type\": \"default\"}}",
                       &c, &err),
             &err);
    CHECK(c.rope_compress.type == DS4_ROPE_YARN && c.rope_compress.factor == 2, "rope_scaling wins");
    CHECK_OK(parse_str("{\"rope_scaling\": {}, \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 3}}", &c, &err),
             &err);
    CHECK(c.rope_compress.type == DS4_ROPE_YARN && c.rope_compress.factor == 3, "empty rope_scaling falls through");
    /* Python `or`: beta 0 means default; factor null falls back to max_position / original. An explicit
     * attention_factor null is not replaced by the 1.0 default: YaRN's mscale applies. */
    CHECK_OK(parse_str("{\"max_position_embeddings\": 65536, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": null,"
                       " \"original_max_position_embeddings\": 4096, \"beta_fast\": 0, \"beta_slow\": 0,"
                       " \"attention_factor\": null}}",
                       &c, &err),
             &err);
    CHECK(c.rope_compress.factor == 16 && c.rope_compress.beta_fast == 32 && c.rope_compress.beta_slow == 1,
          "factor fallback %g, betas %g %g", c.rope_compress.factor, c.rope_compress.beta_fast, c.rope_compress.beta_slow);
    CHECK(c.rope_compress.attention_factor == 0.1 * log(16.0) + 1.0, "mscale %.17g", c.rope_compress.attention_factor);
    /* Nested form: used as given, no attention_factor injection; missing theta is the top-level rope_theta. */
    CHECK_OK(parse_str("{\"rope_theta\": 500, \"rope_parameters\": {\"main\": {\"rope_type\": \"default\","
                       " \"partial_rotary_factor\": 0.25}, \"compress\": {\"type\": \"yarn\", \"factor\": 4,"
                       " \"partial_rotary_factor\": 0.25, \"mscale\": 1, \"mscale_all_dim\": 0.5}}}",
                       &c, &err),
             &err);
    CHECK(c.rope_main.theta == 500 && c.rope_compress.theta == 500, "nested: theta from rope_theta");
    CHECK(c.rope_main.dim == 128 && c.rope_compress.dim == 128, "nested: own rotary factors");
    CHECK(c.rope_compress.attention_factor == (0.1 * log(4.0) + 1.0) / (0.05 * log(4.0) + 1.0),
          "nested: mscale ratio %.17g", c.rope_compress.attention_factor);
    CHECK(c.rope_compress.original_max_position_embeddings == 1048576, "nested: original defaults to max_position");
    /* Nested without rotary factors: plain RoPE on both keeps .get(..., 1.0); YaRN anywhere (or an explicit
     * top-level factor) fills them with the folded top-level one. */
    CHECK_OK(parse_str("{\"head_dim\": 64, \"index_head_dim\": 64, \"rope_parameters\": {\"main\": {}, \"compress\": {}}}",
                       &c, &err),
             &err);
    CHECK(c.rope_main.partial_rotary_factor == 1.0 && c.rope_main.dim == 64 && c.rope_compress.dim == 64,
          "nested plain: factor 1.0");
    CHECK_OK(parse_str("{\"rope_parameters\": {\"main\": {}, \"compress\": {\"rope_type\": \"yarn\", \"factor\": 2}}}", &c,
                       &err),
             &err);
    CHECK(c.rope_main.dim == 64 && c.rope_compress.dim == 64, "nested yarn: folded factor fills both");
    CHECK_OK(parse_str("{\"partial_rotary_factor\": 0.25, \"rope_parameters\": {\"main\": {}, \"compress\": {}}}", &c,
                       &err),
             &err);
    CHECK(c.rope_main.dim == 128 && c.rope_compress.dim == 128, "nested: explicit top-level factor fills both");
    /* One label null: flat form over the remaining keys, without the legacy "type" lookup. */
    CHECK_OK(parse_str("{\"rope_parameters\": {\"main\": null, \"compress\": null, \"type\": \"yarn\"}}", &c, &err), &err);
    CHECK(c.rope_compress.type == DS4_ROPE_DEFAULT, "null label: type ignored");
}

/* ------------------------------------------------------------------------------------------------ (c) errors */

typedef struct err_case {
    const char *json;
    ds4_status want;
    const char *needle[2];
} err_case;

static void test_errors(void) {
    static const err_case cases[] = {
        {"{\"hidden_size\": 4096,", DS4_ERR_FORMAT, {"config: json:", "byte offset 21"}},
        {"[1, 2]", DS4_ERR_CONFIG, {"top level", "an array"}},
        {"{\"hidden_size\": -3}", DS4_ERR_CONFIG,
         {"config: field 'hidden_size' must be a positive integer (got -3)", NULL}},
        {"{\"hidden_size\": 4096.5}", DS4_ERR_CONFIG, {"'hidden_size'", "4096.5"}},
        {"{\"hidden_size\": 4096.0}", DS4_ERR_CONFIG, {"'hidden_size'", "integer"}},
        {"{\"vocab_size\": \"129280\"}", DS4_ERR_CONFIG, {"'vocab_size'", "\"129280\""}},
        {"{\"vocab_size\": null}", DS4_ERR_CONFIG, {"'vocab_size'", "null"}},
        {"{\"vocab_size\": 99999999999}", DS4_ERR_CONFIG, {"'vocab_size'", "no larger than"}},
        {"{\"dim\": 0}", DS4_ERR_CONFIG, {"'dim'", "(got 0)"}},
        {"{\"num_local_experts\": true}", DS4_ERR_CONFIG, {"'num_local_experts'", "true"}},
        {"{\"num_hidden_layers\": 300}", DS4_ERR_CONFIG, {"'num_hidden_layers'", "300"}},
        {"{\"norm_topk_prob\": 1}", DS4_ERR_CONFIG, {"'norm_topk_prob'", "true or false"}},
        {"{\"rms_norm_eps\": 0}", DS4_ERR_CONFIG, {"'rms_norm_eps'", "positive"}},
        {"{\"hc_eps\": -1e-6}", DS4_ERR_CONFIG, {"'hc_eps'", "-9.99"}},
        {"{\"swiglu_limit\": -1}", DS4_ERR_CONFIG, {"'swiglu_limit'", "-1"}},
        {"{\"rope_theta\": 0}", DS4_ERR_CONFIG, {"'rope_theta'", "positive"}},
        {"{\"model_type\": \"deepseek_v3\"}", DS4_ERR_CONFIG, {"'model_type'", "deepseek_v3"}},
        {"{\"hidden_act\": \"gelu\"}", DS4_ERR_CONFIG, {"'hidden_act'", "gelu"}},
        {"{\"scoring_func\": \"relu\"}", DS4_ERR_CONFIG, {"'scoring_func'", "relu"}},
        {"{\"score_func\": 3}", DS4_ERR_CONFIG, {"'score_func'", "3"}},
        {"{\"eos_token_id\": \"x\"}", DS4_ERR_CONFIG, {"'eos_token_id'", "\"x\""}},
        {"{\"eos_token_id\": [1, -5]}", DS4_ERR_CONFIG, {"'eos_token_id[1]'", "-5"}},
        {"{\"num_hidden_layers\": 4, \"compress_ratios\": [0, 4, 5, 128]}", DS4_ERR_CONFIG,
         {"'compress_ratios[2]'", "(got 5)"}},
        {"{\"num_hidden_layers\": 2, \"compress_ratios\": [0, 4, \"x\"]}", DS4_ERR_CONFIG,
         {"'compress_ratios[2]'", "\"x\""}},
        {"{\"num_hidden_layers\": 4, \"compress_ratios\": [0, 4]}", DS4_ERR_CONFIG,
         {"'compress_ratios' has 2 entries", "num_hidden_layers is 4"}},
        {"{\"compress_ratios\": 4}", DS4_ERR_CONFIG, {"'compress_ratios'", "(got 4)"}},
        {"{\"num_hidden_layers\": 2, \"layer_types\": [\"sliding_attention\", \"full_attention\"]}", DS4_ERR_CONFIG,
         {"'layer_types[1]'", "full_attention"}},
        {"{\"num_hidden_layers\": 3, \"layer_types\": [\"sliding_attention\"]}", DS4_ERR_CONFIG,
         {"'layer_types' has 1 entries", NULL}},
        {"{\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\", \"moe\"]}", DS4_ERR_CONFIG,
         {"'mlp_layer_types[0]'", "dense"}},
        {"{\"num_hash_layers\": -1}", DS4_ERR_CONFIG, {"'num_hash_layers'", "-1"}},
        {"{\"compress_rates\": [4, 128]}", DS4_ERR_CONFIG, {"'compress_rates'", "an array"}},
        {"{\"compress_rates\": {\"compressed_sparse_attention\": 0}}", DS4_ERR_CONFIG,
         {"'compress_rates.compressed_sparse_attention'", "(got 0)"}},
        {"{\"compress_rates\": {\"compressed_sparse_attention\": 4}}", DS4_ERR_CONFIG,
         {"'compress_rates' has no \"heavily_compressed_attention\"", "layer 0"}},
        {"{\"compress_rate_hca\": 0}", DS4_ERR_CONFIG, {"'compress_rate_hca'", "(got 0)"}},
        {"{\"partial_rotary_factor\": \"half\"}", DS4_ERR_CONFIG, {"'partial_rotary_factor'", "half"}},
        {"{\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}}", DS4_ERR_UNSUPPORTED,
         {"'rope_scaling.type'", "linear"}},
        {"{\"rope_parameters\": {\"main\": {\"rope_type\": \"llama3\"}, \"compress\": {}}}", DS4_ERR_UNSUPPORTED,
         {"'rope_parameters.main.rope_type'", "llama3"}},
        {"{\"rope_parameters\": {\"rope_type\": 3}}", DS4_ERR_CONFIG, {"'rope_parameters.rope_type'", "3"}},
        {"{\"rope_scaling\": {\"type\": \"yarn\", \"original_max_position_embeddings\": 4096}}", DS4_ERR_CONFIG,
         {"'rope_scaling.factor' is required", NULL}},
        {"{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": -2}}", DS4_ERR_CONFIG, {"'rope_scaling.factor'", "-2"}},
        {"{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2, \"beta_fast\": \"x\"}}", DS4_ERR_CONFIG,
         {"'rope_scaling.beta_fast'", NULL}},
        {"{\"rope_parameters\": {\"main\": {}}}", DS4_ERR_CONFIG, {"'rope_parameters.compress' is missing", NULL}},
        {"{\"rope_parameters\": {\"main\": {}, \"compress\": 1}}", DS4_ERR_CONFIG, {"'rope_parameters.compress'", "1"}},
        {"{\"rope_parameters\": {\"main\": {\"rope_theta\": null}, \"compress\": {}}}", DS4_ERR_CONFIG,
         {"'rope_parameters.main.rope_theta'", "null"}},
        {"{\"rope_parameters\": [1]}", DS4_ERR_CONFIG, {"'rope_parameters'", "an array"}},
        {"{\"num_key_value_heads\": 2}", DS4_ERR_CONFIG, {"'num_key_value_heads'", "2"}},
        {"{\"num_attention_heads\": 6}", DS4_ERR_CONFIG, {"'num_attention_heads' (6)", "'o_groups' (8)"}},
        {"{\"num_experts_per_tok\": 300}", DS4_ERR_CONFIG, {"'num_experts_per_tok'", "300"}},
        {"{\"n_shared_experts\": 2}", DS4_ERR_UNSUPPORTED, {"'n_shared_experts'", "2"}},
        {"{\"n_shared_experts\": 0}", DS4_ERR_UNSUPPORTED, {"'n_shared_experts'", "0"}},
        {"{\"qk_rope_head_dim\": 63}", DS4_ERR_CONFIG, {"rope_parameters.main", "= 63"}},
        {"{\"partial_rotary_factor\": 2}", DS4_ERR_CONFIG, {"rope_parameters.main", "= 1024"}},
        {"{\"partial_rotary_factor\": 0}", DS4_ERR_CONFIG, {"partial_rotary_factor", "= 0"}},
        {"{\"partial_rotary_factor\": 1e300}", DS4_ERR_CONFIG, {"'partial_rotary_factor'", "out of range"}},
        {"{\"partial_rotary_factor\": 0.5}", DS4_ERR_CONFIG, {"256", "'index_head_dim' (128)"}},
        {"{\"rope_parameters\": {\"main\": {}, \"compress\": {\"rope_type\": \"yarn\", \"factor\": 2, \"rope_theta\": 1}}}",
         DS4_ERR_CONFIG, {"'rope_parameters.compress.rope_theta'", "YaRN"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ds4_config c;
        ds4_error err;
        ds4_status st = parse_str(cases[i].json, &c, &err);
        CHECK(st == cases[i].want, "%s: got %s (%s), wanted %s", cases[i].json, ds4_status_name(st),
              st ? err.msg : "", ds4_status_name(cases[i].want));
        CHECK(st == DS4_OK || err.code == st, "%s: err.code %d", cases[i].json, (int)err.code);
        for (int k = 0; k < 2; k++)
            if (cases[i].needle[k] && st)
                CHECK(strstr(err.msg, cases[i].needle[k]) != NULL, "%s: message lacks '%s': %s", cases[i].json,
                      cases[i].needle[k], err.msg);
    }
    ds4_config c;
    CHECK(ds4_config_parse("{\"hidden_size\": 0}", 18, &c, NULL) == DS4_ERR_CONFIG, "NULL err still reports the status");
    CHECK(ds4_config_parse("{", 1, &c, NULL) == DS4_ERR_FORMAT, "NULL err: format error status");
    ds4_error err;
    CHECK_STATUS(ds4_config_parse(NULL, 0, &c, &err), DS4_ERR_ARG, &err);
}

/* ds4_config_validate on structs built in code (the parser never produces these). */
static void test_validate(void) {
    ds4_config d, c;
    ds4_error err;
    ds4_config_default(&d);
    CHECK_STATUS(ds4_config_validate(NULL, &err), DS4_ERR_ARG, &err);
#define BAD(mutation, want, needle)                                                                    \
    do {                                                                                               \
        c = d;                                                                                         \
        mutation;                                                                                      \
        memset(&err, 0, sizeof err);                                                                   \
        ds4_status s_ = ds4_config_validate(&c, &err);                                                 \
        CHECK(s_ == (want), "%s: got %s (%s)", #mutation, ds4_status_name(s_), err.msg);              \
        CHECK(strstr(err.msg, needle) != NULL, "%s: message lacks '%s': %s", #mutation, needle, err.msg); \
    } while (0)
    BAD(c.vocab_size = 0, DS4_ERR_CONFIG, "'vocab_size'");
    BAD(c.hidden_size = -1, DS4_ERR_CONFIG, "'hidden_size'");
    BAD(c.num_hidden_layers = DS4_MAX_LAYERS + 1, DS4_ERR_CONFIG, "'num_hidden_layers'");
    BAD(c.q_lora_rank = 0, DS4_ERR_CONFIG, "'q_lora_rank'");
    BAD(c.sliding_window = 0, DS4_ERR_CONFIG, "'sliding_window'");
    BAD(c.compress_rate_csa = 0, DS4_ERR_CONFIG, "'compress_rate_csa'");
    BAD(c.index_topk = 0, DS4_ERR_CONFIG, "'index_topk'");
    BAD(c.hc_mult = 0, DS4_ERR_CONFIG, "'hc_mult'");
    BAD(c.hc_sinkhorn_iters = 0, DS4_ERR_CONFIG, "'hc_sinkhorn_iters'");
    /* loop counts no weight shape bounds: a config alone must not make a forward run for hours */
    BAD(c.hc_sinkhorn_iters = 1000000000, DS4_ERR_CONFIG, "'hc_sinkhorn_iters' must be in [1, 100]");
    BAD(c.hc_sinkhorn_iters = 101, DS4_ERR_CONFIG, "'hc_sinkhorn_iters'");
    BAD(c.index_topk = INT32_MAX, DS4_ERR_CONFIG, "'index_topk' must be in [1, 65536]");
    BAD(c.num_nextn_predict_layers = 1000000, DS4_ERR_CONFIG, "'num_nextn_predict_layers' must be in [0, 1]");
    BAD(c.num_nextn_predict_layers = 2, DS4_ERR_CONFIG, "at most one MTP block");
    BAD(c.eos_token_id = c.vocab_size, DS4_ERR_CONFIG, "'eos_token_id' must be in [-1, 129279]");
    BAD(c.bos_token_id = c.vocab_size + 5, DS4_ERR_CONFIG, "'bos_token_id'");
    BAD(c.eos_token_id = -2, DS4_ERR_CONFIG, "'eos_token_id'");
    BAD(c.num_key_value_heads = 64, DS4_ERR_CONFIG, "'num_key_value_heads'");
    BAD(c.o_groups = 7, DS4_ERR_CONFIG, "'o_groups'");
    BAD(c.num_experts_per_tok = 0, DS4_ERR_CONFIG, "'num_experts_per_tok'");
    BAD(c.n_shared_experts = 3, DS4_ERR_UNSUPPORTED, "'n_shared_experts'");
    BAD(c.hc_eps = 0, DS4_ERR_CONFIG, "'hc_eps'");
    BAD(c.rms_norm_eps = NAN, DS4_ERR_CONFIG, "'rms_norm_eps'");
    BAD(c.scoring_func = (ds4_score_func)9, DS4_ERR_CONFIG, "'scoring_func'");
    BAD(c.layer_types[5] = (ds4_attn_type)3, DS4_ERR_CONFIG, "'layer_types[5]'");
    BAD(c.layer_is_hash[1] = 2, DS4_ERR_CONFIG, "'mlp_layer_types[1]'");
    BAD(c.rope_main.dim = 63, DS4_ERR_CONFIG, "rope_parameters.main");
    BAD(c.rope_compress.dim = 0, DS4_ERR_CONFIG, "rope_parameters.compress");
    BAD(c.rope_compress.dim = 514, DS4_ERR_CONFIG, "rope_parameters.compress");
    BAD(c.rope_compress.dim = 256, DS4_ERR_CONFIG, "'index_head_dim'");
    BAD(c.rope_main.theta = 0, DS4_ERR_CONFIG, "'rope_parameters.main.rope_theta'");
    BAD(c.rope_main.type = (ds4_rope_type)5, DS4_ERR_CONFIG, "'rope_parameters.main.type'");
    BAD((c.rope_compress.type = DS4_ROPE_YARN, c.rope_compress.factor = 0), DS4_ERR_CONFIG,
        "'rope_parameters.compress.factor'");
    BAD((c.rope_compress.type = DS4_ROPE_YARN, c.rope_compress.factor = 2, c.rope_compress.original_max_position_embeddings = 0),
        DS4_ERR_CONFIG, "'rope_parameters.compress.original_max_position_embeddings'");
#undef BAD
    /* Without CSA layers the indexer width does not constrain the compressed rotary width. */
    c = d;
    for (int i = 0; i < c.num_hidden_layers; i++) c.layer_types[i] = DS4_ATTN_HCA;
    c.rope_compress.dim = 256;
    CHECK_OK(ds4_config_validate(&c, &err), &err);
    /* the bounds themselves are accepted */
    c = d;
    c.hc_sinkhorn_iters = 100;
    c.index_topk = 65536;
    c.num_nextn_predict_layers = 0;
    c.bos_token_id = -1;
    c.eos_token_id = c.vocab_size - 1;
    CHECK_OK(ds4_config_validate(&c, &err), &err);
}

/* ------------------------------------------------------------------------------------------------ load */

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot create %s", path);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static void test_load_errors(void) {
    char dir[] = "/tmp/ds4_test_config_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp failed");
        return;
    }
    char path[256], sub[256];
    ds4_config c;
    ds4_error err;
    /* A directory without config.json. */
    CHECK_STATUS(ds4_config_load(dir, &c, &err), DS4_ERR_NOT_FOUND, &err);
    CHECK(strstr(err.msg, dir) != NULL, "message names the directory: %s", err.msg);
    /* A missing path. */
    snprintf(path, sizeof path, "%s/nope.json", dir);
    CHECK_STATUS(ds4_config_load(path, &c, &err), DS4_ERR_NOT_FOUND, &err);
    CHECK(strstr(err.msg, path) != NULL, "message names the path: %s", err.msg);
    /* Malformed JSON and a bad field: the path and the problem are both named. */
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, "{\"hidden_size\": 1,}");
    CHECK_STATUS(ds4_config_load(dir, &c, &err), DS4_ERR_FORMAT, &err);
    CHECK(strstr(err.msg, path) != NULL && strstr(err.msg, "byte offset 18") != NULL, "load format error: %s", err.msg);
    write_file(path, "{\"o_groups\": -2}");
    CHECK_STATUS(ds4_config_load(dir, &c, &err), DS4_ERR_CONFIG, &err);
    CHECK(strstr(err.msg, path) != NULL && strstr(err.msg, "'o_groups'") != NULL, "load config error: %s", err.msg);
    /* A trailing slash and a file path work. */
    write_file(path, "{\"num_hidden_layers\": 2}");
    snprintf(sub, sizeof sub, "%s/", dir);
    CHECK_OK(ds4_config_load(sub, &c, &err), &err);
    CHECK(c.num_hidden_layers == 2, "loaded through dir/");
    CHECK_OK(ds4_config_load(path, &c, &err), &err);
    CHECK_STATUS(ds4_config_load(NULL, &c, &err), DS4_ERR_ARG, &err);
    remove(path);
    rmdir(dir);
}

/* ------------------------------------------------------------------------------------------------ (d) round trip */

static void round_trip(const char *name, const ds4_config *c) {
    char *text = ds4_config_to_json(c);
    CHECK(text != NULL, "%s: to_json returned NULL", name);
    if (!text) return;
    ds4_error err;
    ds4_json *doc = ds4_json_parse(text, strlen(text), NULL, &err);
    CHECK(doc != NULL, "%s: to_json output is not JSON: %s", name, err.msg);
    if (doc) {
        const ds4_json *rp = ds4_json_get(doc, "rope_parameters");
        CHECK(rp && ds4_json_get(rp, "main") && ds4_json_get(rp, "compress") && ds4_json_get(doc, "layer_types") &&
                  ds4_json_get(doc, "mlp_layer_types") && ds4_json_get(doc, "compress_rates"),
              "%s: modern HF form", name);
        ds4_json_free(doc);
    }
    ds4_config back;
    CHECK_OK(parse_str(text, &back, &err), &err);
    CHECK(memcmp(&back, c, sizeof back) == 0, "%s: round trip changed the config:\n%s", name, text);
    free(text);
}

static void test_round_trip(ds4_config *const *cfgs, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++) round_trip(names[i], cfgs[i]);
    ds4_config d, c;
    ds4_error err;
    ds4_config_default(&d);
    round_trip("defaults", &d);
    CHECK_OK(parse_str("{\"bos_token_id\": null, \"eos_token_id\": null, \"head_dim\": 48, \"qk_rope_head_dim\": 10,"
                       " \"index_head_dim\": 48, \"routed_scaling_factor\": 0.1, \"initializer_range\": 0.3,"
                       " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 3.3, \"mscale\": 0.7, \"mscale_all_dim\": 1.1}}",
                       &c, &err),
             &err);
    round_trip("odd values", &c);
}

int main(int argc, char **argv) {
    if (argc > 1) fixtures = argv[1];
    ds4_config a, b, h, flash;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&h, 0, sizeof h);
    test_fixture("tiny_a", &a);
    test_fixture("tiny_b", &b);
    test_fixture("tiny_hf", &h);
    test_flash(&flash);
    test_official(&flash);
    test_defaults();
    test_folding();
    test_rope();
    test_errors();
    test_validate();
    test_load_errors();
    ds4_config *cfgs[] = {&a, &b, &h, &flash};
    const char *names[] = {"tiny_a", "tiny_b", "tiny_hf", "v4-flash"};
    test_round_trip(cfgs, names, 4);
    return ds4t_finish("test_config");
}
