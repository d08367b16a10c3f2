/* names.c — map every accepted checkpoint spelling of a tensor name to the canonical official name.
 *
 * Three spellings reach us (docs/architecture.md, "Checkpoint names"):
 *   official release   layers.0.attn.wq_a.weight, embed.weight, hc_head_fn, layers.0.attn.kv_norm.weight
 *   save_pretrained    the official names under "model." — except that transformers' reverse renaming turns
 *                      every kv_norm into norm (model.layers.0.attn.norm.weight) and writes the top-level
 *                      modules with their HF names (model.embed_tokens.weight, model.hc_head.hc_fn)
 *   HF module names    model.layers.0.self_attn.q_a_proj.weight, ...mlp.experts.gate_up_proj (packed)
 * The mapping works on dot-separated components so that one rule never rewrites another's output. */
#include <stdio.h>
#include <string.h>

#include "model.h"

enum { MAXC = 16 };

typedef struct {
    const char *from, *to;
} rename_t;

static const char *lookup(const rename_t *table, const char *s) {
    for (; table->from; table++)
        if (strcmp(table->from, s) == 0) return table->to;
    return NULL;
}

/* attention projections: HF -> official (official names map to themselves) */
static const rename_t ATTN[] = {
    {"q_a_proj", "wq_a"}, {"q_b_proj", "wq_b"}, {"q_a_norm", "q_norm"}, {"kv_proj", "wkv"},
    {"o_a_proj", "wo_a"}, {"o_b_proj", "wo_b"}, {"wq_a", "wq_a"},       {"wq_b", "wq_b"},
    {"q_norm", "q_norm"}, {"wkv", "wkv"},       {"wo_a", "wo_a"},       {"wo_b", "wo_b"},
    {"kv_norm", "kv_norm"}, {"norm", "kv_norm"}, /* save_pretrained writes the attention kv_norm as norm */
    {NULL, NULL}};

/* compressor parts (main compressor and the indexer's) */
static const rename_t COMP[] = {
    {"kv_proj", "wkv"}, {"gate_proj", "wgate"}, {"kv_norm", "norm"}, {"wkv", "wkv"},
    {"wgate", "wgate"}, {"norm", "norm"},       {NULL, NULL}};

static const rename_t SHARED[] = {
    {"gate_proj", "w1"}, {"down_proj", "w2"}, {"up_proj", "w3"}, {"w1", "w1"}, {"w2", "w2"}, {"w3", "w3"},
    {NULL, NULL}};

static const rename_t HC[] = {
    {"attn_hc", "hc_attn"}, {"ffn_hc", "hc_ffn"}, {NULL, NULL}};

static int is_index(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* Append components to out with '.' separators. */
static int emit(char *out, size_t len, const char *const *parts, int n) {
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        int w = snprintf(out + used, len - used, "%s%s", i ? "." : "", parts[i]);
        if (w < 0 || (size_t)w >= len - used) return 0;
        used += (size_t)w;
    }
    return 1;
}

/* The part after "layers.N." or "mtp.N.": r[0..n). Writes canonical components into o, returns count or -1. */
static int map_block(const char *const *r, int n, const char **o, char *tmp, size_t tmplen) {
    const char *t;
    if (n == 2 && strcmp(r[1], "weight") == 0) {
        if (strcmp(r[0], "input_layernorm") == 0 || strcmp(r[0], "attn_norm") == 0) return o[0] = "attn_norm", o[1] = "weight", 2;
        if (strcmp(r[0], "post_attention_layernorm") == 0 || strcmp(r[0], "ffn_norm") == 0) return o[0] = "ffn_norm", o[1] = "weight", 2;
        /* MTP-only parts keep their names */
        if (!strcmp(r[0], "e_proj") || !strcmp(r[0], "h_proj") || !strcmp(r[0], "enorm") || !strcmp(r[0], "hnorm") ||
            !strcmp(r[0], "norm"))
            return o[0] = r[0], o[1] = "weight", 2;
    }
    /* mHC sites: attn_hc.fn (HF) or hc_attn_fn (official); MTP hc_head_* */
    if (n == 2 && (t = lookup(HC, r[0])) && (!strcmp(r[1], "fn") || !strcmp(r[1], "base") || !strcmp(r[1], "scale"))) {
        snprintf(tmp, tmplen, "%s_%s", t, r[1]);
        return o[0] = tmp, 1;
    }
    if (n == 1) {
        static const char *const ok[] = {"hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
                                         "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale", NULL};
        for (int i = 0; ok[i]; i++)
            if (!strcmp(r[0], ok[i])) return o[0] = r[0], 1;
        return -1;
    }
    if (!strcmp(r[0], "self_attn") || !strcmp(r[0], "attn")) {
        o[0] = "attn";
        if (n == 2 && (!strcmp(r[1], "sinks") || !strcmp(r[1], "attn_sink"))) return o[1] = "attn_sink", 2;
        if (n == 3 && !strcmp(r[2], "weight") && (t = lookup(ATTN, r[1]))) return o[1] = t, o[2] = "weight", 3;
        if (!strcmp(r[1], "compressor")) {
            /* HF nests the indexer under the compressor; official has attn.indexer.{wq_b, weights_proj, compressor.*} */
            if (n >= 3 && !strcmp(r[2], "indexer")) {
                o[1] = "indexer";
                if (n == 6 && !strcmp(r[3], "scorer") && !strcmp(r[4], "weights_proj") && !strcmp(r[5], "weight"))
                    return o[2] = "weights_proj", o[3] = "weight", 4;
                if (n == 5 && !strcmp(r[3], "q_b_proj") && !strcmp(r[4], "weight")) return o[2] = "wq_b", o[3] = "weight", 4;
                o[2] = "compressor";
                if (n == 4 && (!strcmp(r[3], "position_bias") || !strcmp(r[3], "ape"))) return o[3] = "ape", 4;
                if (n == 5 && !strcmp(r[4], "weight") && (t = lookup(COMP, r[3]))) return o[3] = t, o[4] = "weight", 5;
                return -1;
            }
            o[1] = "compressor";
            if (n == 3 && (!strcmp(r[2], "position_bias") || !strcmp(r[2], "ape"))) return o[2] = "ape", 3;
            if (n == 4 && !strcmp(r[3], "weight") && (t = lookup(COMP, r[2]))) return o[2] = t, o[3] = "weight", 4;
            return -1;
        }
        if (!strcmp(r[1], "indexer")) {
            o[1] = "indexer";
            if (n == 4 && !strcmp(r[3], "weight") && (!strcmp(r[2], "wq_b") || !strcmp(r[2], "weights_proj")))
                return o[2] = r[2], o[3] = "weight", 4;
            if (n >= 3 && !strcmp(r[2], "compressor")) {
                o[2] = "compressor";
                if (n == 4 && (!strcmp(r[3], "ape") || !strcmp(r[3], "position_bias"))) return o[3] = "ape", 4;
                if (n == 5 && !strcmp(r[4], "weight") && (t = lookup(COMP, r[3]))) return o[3] = t, o[4] = "weight", 5;
            }
            return -1;
        }
        return -1;
    }
    if (!strcmp(r[0], "mlp") || !strcmp(r[0], "ffn")) {
        o[0] = "ffn";
        if (n == 3 && !strcmp(r[1], "gate")) {
            o[1] = "gate";
            if (!strcmp(r[2], "weight") || !strcmp(r[2], "tid2eid")) return o[2] = r[2], 3;
            if (!strcmp(r[2], "bias") || !strcmp(r[2], "e_score_correction_bias")) return o[2] = "bias", 3;
            return -1;
        }
        if (n == 4 && !strcmp(r[1], "shared_experts") && !strcmp(r[3], "weight") && (t = lookup(SHARED, r[2])))
            return o[1] = "shared_experts", o[2] = t, o[3] = "weight", 4;
        if (!strcmp(r[1], "experts")) {
            o[1] = "experts";
            if (n == 3 && (!strcmp(r[2], "gate_up_proj") || !strcmp(r[2], "down_proj"))) return o[2] = r[2], 3;
            if (n == 5 && is_index(r[2]) && !strcmp(r[4], "weight") &&
                (!strcmp(r[3], "w1") || !strcmp(r[3], "w2") || !strcmp(r[3], "w3")))
                return o[2] = r[2], o[3] = r[3], o[4] = "weight", 5;
        }
        return -1;
    }
    return -1;
}

int ds4_canonical_name(const char *src, char *out, size_t out_len) {
    char buf[512];
    size_t len = strlen(src);
    if (len == 0 || len >= sizeof buf) return 0;
    memcpy(buf, src, len + 1);
    const char *c[MAXC];
    int n = 0;
    for (char *p = buf;;) {
        if (n == MAXC) return 0;
        c[n++] = p;
        char *dot = strchr(p, '.');
        if (!dot) break;
        *dot = 0;
        p = dot + 1;
    }
    for (int i = 0; i < n; i++)
        if (!*c[i]) return 0;
    int s = 0;
    if (!strcmp(c[0], "model") && n > 1) s = 1; /* save_pretrained / HF module prefix */
    const char **r = c + s;
    int rn = n - s;
    const char *o[MAXC];
    char tmp[64];
    /* top level */
    if (rn == 2 && !strcmp(r[1], "weight")) {
        if (!strcmp(r[0], "embed") || !strcmp(r[0], "embed_tokens")) return o[0] = "embed", o[1] = "weight", emit(out, out_len, o, 2);
        if (!strcmp(r[0], "head") || !strcmp(r[0], "lm_head")) return o[0] = "head", o[1] = "weight", emit(out, out_len, o, 2);
        if (!strcmp(r[0], "norm")) return o[0] = "norm", o[1] = "weight", emit(out, out_len, o, 2);
    }
    if (rn == 1 && (!strcmp(r[0], "hc_head_fn") || !strcmp(r[0], "hc_head_base") || !strcmp(r[0], "hc_head_scale")))
        return emit(out, out_len, r, 1);
    if (rn == 2 && !strcmp(r[0], "hc_head") &&
        (!strcmp(r[1], "hc_fn") || !strcmp(r[1], "hc_base") || !strcmp(r[1], "hc_scale"))) {
        snprintf(tmp, sizeof tmp, "hc_head_%s", r[1] + 3);
        o[0] = tmp;
        return emit(out, out_len, o, 1);
    }
    if (rn >= 3 && (!strcmp(r[0], "layers") || !strcmp(r[0], "mtp")) && is_index(r[1])) {
        o[0] = r[0];
        o[1] = r[1];
        int k = map_block(r + 2, rn - 2, o + 2, tmp, sizeof tmp);
        if (k < 0) return 0;
        /* MTP-only parts are not valid inside ordinary layers */
        if (!strcmp(r[0], "layers") &&
            (!strcmp(o[2], "e_proj") || !strcmp(o[2], "h_proj") || !strcmp(o[2], "enorm") || !strcmp(o[2], "hnorm") ||
             !strcmp(o[2], "norm") || !strncmp(o[2], "hc_head_", 8)))
            return 0;
        return emit(out, out_len, o, k + 2);
    }
    return 0;
}
