/* lora_peft.c — adapters in PEFT's layout (docs/lora.md): the key names and tensor layouts that
 * `PeftModel.from_pretrained(DeepseekV4ForCausalLM, dir)` reads, adapter_config.json, saving and loading.
 *
 * Keys are "base_model.model.<transformers module path>.lora_A.weight" / ".lora_B.weight". Plain projections:
 * lora_A [r, K] as ds4 keeps it, lora_B [O, r] (ds4 keeps its transpose). The routed experts are packed 3-D
 * parameters in transformers (mlp.experts.gate_up_proj [E, 2I, D], down_proj [E, D, I]); PEFT adapts them through
 * target_parameters with one adapter per expert stacked as lora_A [r·E, K] (row e·r + j: expert e's row j) and
 * lora_B [O, r·E] (column j·E + e). When both are targeted PEFT nests its wrappers, gate_up_proj inside, so its keys
 * read "mlp.experts.base_layer.lora_*" and down_proj's "mlp.experts.lora_*". */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_fs.h"
#include "internal.h"
#include "json.h"
#include "lora.h"
#include "sched.h"

static const char *const HF_PATH[DS4_LS_COUNT] = {
    "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj", "self_attn.o_b_proj",
    "self_attn.compressor.indexer.q_b_proj", "self_attn.compressor.indexer.scorer.weights_proj",
    "mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj", "mlp.shared_experts.up_proj",
    "mlp.experts.gate_up_proj", "mlp.experts.down_proj"};

#define KEY_PREFIX "base_model.model.model.layers."

typedef struct peft_tensor {
    char key[192];
    int64_t shape[2];
    int32_t layer, site, part; /* part 0: lora_A, 1: lora_B */
} peft_tensor;

/* The module path of site s on a layer with mask `mask` (the experts' nesting depends on what else is targeted). */
static const char *module_path(int32_t s, uint32_t mask) {
    if (s == DS4_LS_EGU) return mask & (1u << DS4_LS_EDOWN) ? "mlp.experts.base_layer" : "mlp.experts";
    if (s == DS4_LS_EDOWN) return "mlp.experts";
    return HF_PATH[s];
}

/* K, O of site s (the adapted weight's in and out widths; the experts' per expert), E (1 unless routed). */
static void site_dims(const ds4_config *c, int32_t s, int64_t *K, int64_t *O, int64_t *E) {
    const int64_t D = c->hidden_size, Hd = c->num_attention_heads * c->head_dim, qr = c->q_lora_rank;
    const int64_t G = c->o_groups, ol = c->o_lora_rank, I = c->moe_intermediate_size;
    const int64_t dims[DS4_LS_COUNT][2] = {{D, qr}, {qr, Hd}, {D, c->head_dim}, {Hd / G, G * ol}, {G * ol, D},
                                           {qr, c->index_n_heads * c->index_head_dim}, {D, c->index_n_heads},
                                           {D, I}, {I, D}, {D, I}, {D, 2 * I}, {I, D}};
    *K = dims[s][0];
    *O = dims[s][1];
    *E = s == DS4_LS_EGU || s == DS4_LS_EDOWN ? c->n_routed_experts : 1;
}

/* Every PEFT tensor of an adapter set, in layer and site order; returns the count (out may be NULL to count). */
static size_t list_tensors(const ds4_model *m, const ds4_lora *l, peft_tensor *out) {
    size_t n = 0;
    for (int64_t li = 0; li < m->cfg.num_hidden_layers; li++)
        for (int32_t s = 0; s < DS4_LS_COUNT; s++) {
            if (!(l->mask[li] & (1u << s))) continue;
            int64_t K, O, E;
            site_dims(&m->cfg, s, &K, &O, &E);
            for (int32_t part = 0; part < 2; part++, n++) {
                if (!out) continue;
                peft_tensor *t = &out[n];
                snprintf(t->key, sizeof t->key, KEY_PREFIX "%lld.%s.lora_%c.weight", (long long)li,
                         module_path(s, l->mask[li]), part ? 'B' : 'A');
                t->shape[0] = part ? O : l->r * E;
                t->shape[1] = part ? l->r * E : K;
                t->layer = (int32_t)li, t->site = s, t->part = part;
            }
        }
    return n;
}

/* Copy one PEFT tensor between its PEFT layout (peft) and ds4's view set v (to_peft: ds4 → PEFT). */
static void copy_tensor(const ds4_model *m, const ds4_lora *l, const ds4_lora_layer *v, const peft_tensor *t,
                        float *peft, int to_peft) {
    const ds4_lora_ab *ab[DS4_LS_COUNT] = {&v->wq_a, &v->wq_b, &v->wkv, &v->wo_a, &v->wo_b, &v->idx_wq_b,
                                           &v->idx_weights, &v->sw1, &v->sw2, &v->sw3, &v->e13, &v->e2};
    const int64_t r = l->r;
    int64_t K, O, E;
    site_dims(&m->cfg, t->site, &K, &O, &E);
    if (t->part == 0) { /* lora_A: [r·E, K], row e·r + j, the layout ds4 keeps ([E, r, K]) */
        float *a = ab[t->site]->A;
        const size_t bytes = (size_t)(r * E * K) * sizeof(float);
        memcpy(to_peft ? peft : a, to_peft ? a : peft, bytes);
        return;
    }
    const int64_t ol = m->cfg.o_lora_rank, I = m->cfg.moe_intermediate_size;
    for (int64_t o = 0; o < O; o++)
        for (int64_t e = 0; e < E; e++)
            for (int64_t j = 0; j < r; j++) {
                float *x; /* ds4's element for PEFT's B[o, j·E + e] */
                if (t->site == DS4_LS_WO_A) x = v->wo_a.B + ((o / ol) * r + j) * ol + o % ol;
                else if (t->site == DS4_LS_EGU) x = (o < I ? v->e13.B : v->e3B) + (e * r + j) * I + o % I;
                else x = ab[t->site]->B + (e * r + j) * O + o;
                float *p = peft + o * r * E + j * E + e;
                if (to_peft) *p = *x;
                else *x = *p;
            }
}

void ds4_lora_tensors_free(ds4_lora_tensors *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n; i++) {
        if (t->names) free(t->names[i]);
        if (t->tensors) ds4_tensor_release(t->tensors[i]);
    }
    free(t->names);
    free(t->tensors);
    memset(t, 0, sizeof *t);
}

ds4_status ds4_model_lora_tensors(ds4_model *m, int grads, ds4_lora_tensors *out, ds4_error *err) {
    if (!m || !out) return ds4_fail(err, DS4_ERR_ARG, "lora tensors: NULL argument");
    memset(out, 0, sizeof *out);
    ds4_lora *l = m->lora;
    if (!l) return ds4_fail(err, DS4_ERR_ARG, "lora tensors: the model has no adapters");
    if (grads && !l->grads)
        return ds4_fail(err, DS4_ERR_ARG, "lora gradients: gradients are not enabled (zero_grad / enable_grad)");
    ds4_status s = ds4_lora_host_sync(m, err);
    if (s) return s;
    const size_t n = list_tensors(m, l, NULL);
    peft_tensor *pt = calloc(n, sizeof *pt);
    out->names = calloc(n, sizeof *out->names);
    out->tensors = calloc(n, sizeof *out->tensors);
    if (!pt || !out->names || !out->tensors) {
        free(pt);
        ds4_lora_tensors_free(out);
        return ds4_fail(err, DS4_ERR_OOM, "lora tensors: %zu entries", n);
    }
    list_tensors(m, l, pt);
    for (size_t i = 0; i < n && !s; i++, out->n++) {
        s = ds4_tensor_new(DS4_F32, 2, pt[i].shape, &out->tensors[i], err);
        if (!s && !(out->names[i] = strdup(pt[i].key))) s = ds4_fail(err, DS4_ERR_OOM, "lora tensors: names");
        if (!s) copy_tensor(m, l, grads ? &l->hg[pt[i].layer] : &l->hw[pt[i].layer], &pt[i], out->tensors[i]->data, 1);
    }
    free(pt);
    if (s) ds4_lora_tensors_free(out);
    return s;
}

/* The adapter values from tensors found by name through find(ctx, key) (F32, BF16 or F16, PEFT's shapes). */
typedef const ds4_st_entry *(*find_fn)(const void *ctx, const char *key);

static ds4_status import_values(ds4_model *m, ds4_lora *l, find_fn find, const void *ctx, size_t *used,
                                ds4_error *err) {
    const size_t n = list_tensors(m, l, NULL);
    peft_tensor *pt = calloc(n ? n : 1, sizeof *pt);
    if (!pt) return ds4_fail(err, DS4_ERR_OOM, "lora: %zu tensors", n);
    list_tensors(m, l, pt);
    ds4_status s = DS4_OK;
    float *buf = NULL;
    for (size_t i = 0; i < n && !s; i++) {
        const ds4_st_entry *e = find(ctx, pt[i].key);
        if (!e) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "lora: tensor '%s' is missing", pt[i].key);
            break;
        }
        if (e->ndim != 2 || e->shape[0] != pt[i].shape[0] || e->shape[1] != pt[i].shape[1]) {
            char a[96];
            ds4_shape_str(a, sizeof a, e->ndim, e->shape);
            s = ds4_fail(err, DS4_ERR_SHAPE, "lora: tensor '%s' has shape %s, expected [%lld, %lld]", pt[i].key, a,
                         (long long)pt[i].shape[0], (long long)pt[i].shape[1]);
            break;
        }
        if (e->dtype != DS4_F32 && e->dtype != DS4_BF16 && e->dtype != DS4_F16) {
            s = ds4_fail(err, DS4_ERR_UNSUPPORTED, "lora: tensor '%s' is %s (F32, BF16 or F16 expected)", pt[i].key,
                         ds4_dtype_name(e->dtype));
            break;
        }
        const int64_t k = pt[i].shape[0] * pt[i].shape[1];
        float *nb = realloc(buf, (size_t)(k ? k : 1) * sizeof(float));
        if (!nb) {
            s = ds4_fail(err, DS4_ERR_OOM, "lora: staging for '%s'", pt[i].key);
            break;
        }
        buf = nb;
        if ((s = ds4_convert_to_f32(e->dtype, e->data, k, buf, err))) break;
        for (int64_t j = 0; j < k; j++)
            if (!isfinite(buf[j])) {
                s = ds4_fail(err, DS4_ERR_FORMAT, "lora: tensor '%s' element %lld is %g", pt[i].key, (long long)j,
                             (double)buf[j]);
                break;
            }
        if (!s) copy_tensor(m, l, &l->hw[pt[i].layer], &pt[i], buf, 0);
    }
    free(buf);
    free(pt);
    if (used) *used = n;
    return s;
}

typedef struct tensors_ctx {
    const ds4_lora_tensors *t;
    ds4_st_entry e;
} tensors_ctx;

static const ds4_st_entry *find_in_tensors(const void *vctx, const char *key) {
    tensors_ctx *c = (tensors_ctx *)(uintptr_t)vctx;
    for (size_t i = 0; i < c->t->n; i++)
        if (c->t->names[i] && !strcmp(c->t->names[i], key) && c->t->tensors[i]) {
            const ds4_tensor *t = c->t->tensors[i];
            memset(&c->e, 0, sizeof c->e);
            c->e.name = key;
            c->e.dtype = t->dtype;
            c->e.ndim = t->ndim;
            for (int32_t k = 0; k < t->ndim && k < DS4_MAX_DIMS; k++) c->e.shape[k] = t->shape[k];
            c->e.data = t->data;
            c->e.nbytes = t->nbytes;
            return &c->e;
        }
    return NULL;
}

ds4_status ds4_model_lora_set(ds4_model *m, const ds4_lora_tensors *in, ds4_error *err) {
    if (!m || !in) return ds4_fail(err, DS4_ERR_ARG, "lora set: NULL argument");
    if (!m->lora) return ds4_fail(err, DS4_ERR_ARG, "lora set: the model has no adapters");
    ds4_status s = ds4_lora_host_sync(m, err);
    if (s) return s;
    tensors_ctx c = {.t = in};
    size_t used = 0;
    s = import_values(m, m->lora, find_in_tensors, &c, &used, err);
    if (!s && used != in->n)
        s = ds4_fail(err, DS4_ERR_ARG, "lora set: %zu tensors given, the adapters have %zu", in->n, used);
    ds4_lora_params_changed(m);
    if (m->tape) m->tape->valid = 0;
    return s;
}

/* ------------------------------------------------------------------------------------------------ save */

/* adapter_config.json: what PEFT's LoraConfig needs to rebuild the same modules. target_modules are written as
 * suffixes qualified enough to match nothing else ("self_attn.kv_proj", not "kv_proj", which would also catch the
 * compressors' kv_proj); a set that differs between layers becomes a regex over the exact module names. */
static char *config_json(const ds4_model *m, const ds4_lora *l, const char *base_name) {
    const int64_t L = m->cfg.num_hidden_layers;
    uint32_t all = 0, same = 1;
    for (int64_t li = 0; li < L; li++) {
        all |= l->mask[li];
        same &= l->mask[li] == l->mask[0];
    }
    size_t cap = 4096 + (size_t)L * DS4_LS_COUNT * 96, n = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
#define PUT(...) (n += (size_t)snprintf(out + n, n < cap ? cap - n : 0, __VA_ARGS__))
    PUT("{\n  \"peft_type\": \"LORA\",\n  \"task_type\": \"CAUSAL_LM\",\n  \"base_model_name_or_path\": ");
    if (base_name) {
        PUT("\"");
        for (const char *p = base_name; *p; p++) {
            if (*p == '"' || *p == '\\') PUT("\\%c", *p);
            else if ((unsigned char)*p < 0x20) PUT("\\u%04x", (unsigned)(unsigned char)*p);
            else PUT("%c", *p);
        }
        PUT("\"");
    } else {
        PUT("null");
    }
    PUT(",\n  \"r\": %lld,\n  \"lora_alpha\": %.17g,\n  \"lora_dropout\": 0.0,\n  \"use_rslora\": %s,\n",
        (long long)l->r, l->alpha, l->rslora ? "true" : "false");
    PUT("  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"use_dora\": false,\n  \"lora_bias\": false,\n"
        "  \"init_lora_weights\": true,\n  \"inference_mode\": true,\n  \"modules_to_save\": null,\n"
        "  \"layers_to_transform\": null,\n  \"layers_pattern\": null,\n  \"rank_pattern\": {},\n"
        "  \"alpha_pattern\": {},\n  \"revision\": null,\n  \"target_modules\": ");
    const uint32_t mods = all & ~((1u << DS4_LS_EGU) | (1u << DS4_LS_EDOWN));
    if (!mods) {
        PUT("null");
    } else if (same) {
        PUT("[");
        for (int32_t s = 0, k = 0; s < DS4_LS_COUNT; s++)
            if (mods & (1u << s)) PUT("%s\"%s\"", k++ ? ", " : "", HF_PATH[s]);
        PUT("]");
    } else {
        PUT("\"model\\\\.layers\\\\.(?:");
        for (int64_t li = 0, k = 0; li < L; li++)
            for (int32_t s = 0; s < DS4_LS_COUNT; s++) {
                if (!(l->mask[li] & mods & (1u << s))) continue;
                PUT("%s%lld\\\\.", k++ ? "|" : "", (long long)li);
                for (const char *p = HF_PATH[s]; *p; p++) PUT(*p == '.' ? "\\\\." : "%c", *p);
            }
        PUT(")\"");
    }
    /* PEFT matches target_parameters on every layer; a layer-dependent set of expert adapters is refused before */
    PUT(",\n  \"target_parameters\": ");
    if (all & ((1u << DS4_LS_EGU) | (1u << DS4_LS_EDOWN))) {
        PUT("[");
        int k = 0;
        if (all & (1u << DS4_LS_EGU)) PUT("%s\"mlp.experts.gate_up_proj\"", k++ ? ", " : "");
        if (all & (1u << DS4_LS_EDOWN)) PUT("%s\"mlp.experts.down_proj\"", k++ ? ", " : "");
        PUT("]");
    } else {
        PUT("null");
    }
    PUT("\n}\n");
#undef PUT
    if (n >= cap) {
        free(out);
        return NULL;
    }
    return out;
}

typedef struct save_ctx {
    ds4_model *m;
    const char *base_name;
} save_ctx;

static ds4_status write_adapter(void *vctx, const char *dir, ds4_error *err) {
    save_ctx *c = vctx;
    char *js = config_json(c->m, c->m->lora, c->base_name);
    if (!js) return ds4_fail(err, DS4_ERR_OOM, "lora save: adapter_config.json text");
    const size_t cap = strlen(dir) + 48;
    char *path = malloc(cap);
    if (!path) {
        free(js);
        return ds4_fail(err, DS4_ERR_OOM, "lora save: path");
    }
    snprintf(path, cap, "%s/adapter_config.json", dir);
    ds4_status s = ds4_fs_write_file("lora save", path, js, strlen(js), err);
    free(js);
    ds4_lora_tensors t = {0};
    if (!s) s = ds4_model_lora_tensors(c->m, 0, &t, err);
    if (!s) {
        snprintf(path, cap, "%s/adapter_model.safetensors", dir);
        s = ds4_st_write(path, t.n, (const char *const *)t.names, (const ds4_tensor *const *)t.tensors, err);
        if (s) ds4_error_prefix(err, "lora save: ");
    }
    ds4_lora_tensors_free(&t);
    free(path);
    return s;
}

/* What PEFT's layout can hold and what is worth writing: expert adapters on every layer or none, finite values. */
static ds4_status check_savable(ds4_model *m, const char *dir, ds4_error *err) {
    if (!m || !dir) return ds4_fail(err, DS4_ERR_ARG, "lora save: NULL argument");
    ds4_lora *l = m->lora;
    if (!l) return ds4_fail(err, DS4_ERR_ARG, "lora save %s: the model has no adapters", dir);
    const uint32_t ex = (1u << DS4_LS_EGU) | (1u << DS4_LS_EDOWN);
    for (int64_t li = 1; li < m->cfg.num_hidden_layers; li++)
        if ((l->mask[li] & ex) != (l->mask[0] & ex))
            return ds4_fail(err, DS4_ERR_UNSUPPORTED, "lora save %s: expert adapters on some layers only cannot be "
                            "written for PEFT (its target_parameters apply to every layer)", dir);
    ds4_status s = ds4_lora_host_sync(m, err);
    if (s) return s;
    for (int64_t i = 0; i < l->n; i++)
        if (!isfinite(l->params[i]))
            return ds4_fail(err, DS4_ERR_ARG, "lora save %s: adapter value %lld is %g: refusing to write diverged "
                            "adapters", dir, (long long)i, (double)l->params[i]);
    return DS4_OK;
}

ds4_status ds4_model_lora_save(ds4_model *m, const char *dir, const char *base_name, int overwrite, ds4_error *err) {
    ds4_status s = check_savable(m, dir, err);
    if (s) return s;
    save_ctx c = {m, base_name};
    return ds4_dir_save_atomic("lora save", dir, overwrite, write_adapter, &c, err);
}

ds4_status ds4_model_lora_write_files(ds4_model *m, const char *dir, const char *base_name, ds4_error *err) {
    ds4_status s = check_savable(m, dir, err);
    if (s) return s;
    save_ctx c = {m, base_name};
    return write_adapter(&c, dir, err);
}

/* ------------------------------------------------------------------------------------------------ load */

/* The site of a PEFT module path, with the experts told apart by their shapes (gate_up: lora_A's in-width D and
 * lora_B's out-width 2I; down: I and D; never both, since that would need I = 0). -1: not an adaptable module. */
static int32_t site_of(const ds4_config *c, const char *path, const ds4_st_entry *A, const ds4_st_entry *B) {
    for (int32_t s = 0; s < DS4_LS_EGU; s++)
        if (!strcmp(path, HF_PATH[s])) return s;
    if (strcmp(path, "mlp.experts") && strcmp(path, "mlp.experts.base_layer")) return -1;
    if (!A || !B || A->ndim != 2 || B->ndim != 2) return -1;
    const int64_t D = c->hidden_size, I = c->moe_intermediate_size;
    if (A->shape[1] == D && B->shape[0] == 2 * I) return DS4_LS_EGU;
    if (A->shape[1] == I && B->shape[0] == D) return DS4_LS_EDOWN;
    return -1;
}

/* Split "base_model.model.model.layers.N.<path>.lora_X.weight": layer, path (into buf), part. 0: not such a key. */
static int parse_key(const char *key, int64_t L, int64_t *layer, char *path, size_t cap, int *part) {
    const size_t pl = strlen(KEY_PREFIX);
    if (strncmp(key, KEY_PREFIX, pl)) return 0;
    const char *p = key + pl;
    int64_t li = 0;
    const char *d0 = p;
    while (*p >= '0' && *p <= '9' && li < 1000000) li = li * 10 + (*p++ - '0');
    if (p == d0 || *p != '.' || li >= L) return 0;
    p++;
    const char *tail = NULL;
    for (const char *q = p; (q = strstr(q, ".lora_")) != NULL; q++) tail = q;
    if (!tail || (strcmp(tail, ".lora_A.weight") && strcmp(tail, ".lora_B.weight"))) return 0;
    if ((size_t)(tail - p) >= cap || tail == p) return 0;
    memcpy(path, p, (size_t)(tail - p));
    path[tail - p] = 0;
    *layer = li;
    *part = tail[6] == 'B';
    return 1;
}

static const ds4_st_entry *find_in_file(const void *ctx, const char *key) { return ds4_st_find(ctx, key); }

/* adapter_config.json → r, alpha, rsLoRA; every setting ds4 cannot honour refused by name. */
static ds4_status read_config(const char *dir, int64_t *r, double *alpha, int32_t *rslora, ds4_error *err) {
    const size_t cap = strlen(dir) + 32;
    char *path = malloc(cap), *text = NULL;
    if (!path) return ds4_fail(err, DS4_ERR_OOM, "lora load: path");
    snprintf(path, cap, "%s/adapter_config.json", dir);
    size_t len = 0;
    ds4_status s = ds4_read_file(path, 1 << 20, &text, &len, err);
    free(path);
    if (s) return s;
    ds4_json *js = ds4_json_parse(text, len, NULL, err);
    free(text);
    if (!js) {
        ds4_error_prefix(err, "lora load %s: adapter_config.json: ", dir);
        return err ? err->code : DS4_ERR_FORMAT;
    }
    const ds4_json *v = NULL;
    s = DS4_OK;
#define BAD(...) (s = ds4_fail(err, DS4_ERR_UNSUPPORTED, __VA_ARGS__))
    if (js->type != DS4_JSON_OBJECT) s = ds4_fail(err, DS4_ERR_FORMAT, "lora load %s: adapter_config.json is not an object", dir);
    else if ((v = ds4_json_get(js, "peft_type")) && v->type == DS4_JSON_STRING && strcmp(v->str, "LORA"))
        BAD("lora load %s: peft_type \"%s\" (only LORA)", dir, v->str);
    else if (!(v = ds4_json_get(js, "r")) || v->type != DS4_JSON_NUMBER || !v->is_int || v->integer < 1)
        s = ds4_fail(err, DS4_ERR_FORMAT, "lora load %s: adapter_config.json needs an integer r >= 1", dir);
    if (!s) {
        *r = v->integer;
        v = ds4_json_get(js, "lora_alpha");
        *alpha = v && v->type == DS4_JSON_NUMBER ? v->number : 8.0; /* PEFT's default */
        v = ds4_json_get(js, "use_rslora");
        *rslora = v && v->type == DS4_JSON_BOOL && v->boolean;
    }
    static const char *const must_false[] = {"use_dora", "fan_in_fan_out", "lora_bias", "use_qalora", NULL};
    for (int i = 0; !s && must_false[i]; i++)
        if ((v = ds4_json_get(js, must_false[i])) && v->type == DS4_JSON_BOOL && v->boolean)
            BAD("lora load %s: %s = true is not supported", dir, must_false[i]);
    if (!s && (v = ds4_json_get(js, "bias")) && v->type == DS4_JSON_STRING && strcmp(v->str, "none"))
        BAD("lora load %s: bias \"%s\" (only \"none\")", dir, v->str);
    static const char *const must_empty[] = {"rank_pattern", "alpha_pattern", "modules_to_save", NULL};
    for (int i = 0; !s && must_empty[i]; i++)
        if ((v = ds4_json_get(js, must_empty[i])) && (v->type == DS4_JSON_OBJECT || v->type == DS4_JSON_ARRAY) &&
            v->count > 0)
            BAD("lora load %s: a non-empty %s is not supported", dir, must_empty[i]);
#undef BAD
    ds4_json_free(js);
    return s;
}

ds4_status ds4_model_lora_load(ds4_model *m, const char *dir, ds4_error *err) {
    if (!m || !dir) return ds4_fail(err, DS4_ERR_ARG, "lora load: NULL argument");
    int64_t r = 0;
    double alpha = 0;
    int32_t rslora = 0;
    ds4_status s = read_config(dir, &r, &alpha, &rslora, err);
    if (s) return s;
    const size_t cap = strlen(dir) + 40;
    char *path = malloc(cap);
    if (!path) return ds4_fail(err, DS4_ERR_OOM, "lora load: path");
    snprintf(path, cap, "%s/adapter_model.safetensors", dir);
    ds4_st_file *f = NULL;
    s = ds4_st_open(path, &f, err);
    free(path);
    if (s) {
        ds4_error_prefix(err, "lora load %s: ", dir);
        return s;
    }
    const ds4_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers;
    uint32_t *mask = calloc((size_t)L, sizeof *mask);
    ds4_lora *l = NULL;
    if (!mask) {
        s = ds4_fail(err, DS4_ERR_OOM, "lora load: masks");
        goto done;
    }
    /* which adapters each layer has, from the keys */
    const size_t n = ds4_st_count(f);
    for (size_t i = 0; i < n && !s; i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        char mpath[160], other[224];
        int64_t li;
        int part;
        if (!parse_key(e->name, L, &li, mpath, sizeof mpath, &part)) {
            s = ds4_fail(err, DS4_ERR_FORMAT, "lora load %s: tensor '%s' is not a LoRA weight of a layer of this model "
                         "(expected " KEY_PREFIX "<layer < %lld>.<module>.lora_A|lora_B.weight)", dir, e->name,
                         (long long)L);
            break;
        }
        snprintf(other, sizeof other, KEY_PREFIX "%lld.%s.lora_%c.weight", (long long)li, mpath, part ? 'A' : 'B');
        const ds4_st_entry *o = ds4_st_find(f, other);
        const int32_t site = site_of(c, mpath, part ? o : e, part ? e : o);
        if (site < 0 || ((site == DS4_LS_IDX_Q || site == DS4_LS_IDX_W) && c->layer_types[li] != DS4_ATTN_CSA)) {
            s = ds4_fail(err, DS4_ERR_UNSUPPORTED,
                         "lora load %s: tensor '%s': module '%s' of layer %lld is not one ds4 adapts (attention "
                         "q_a/q_b/kv/o_a/o_b projections, the indexer's q_b_proj and weights_proj, the shared and "
                         "routed experts), or its lora_%c is missing", dir, e->name, mpath, (long long)li,
                         part ? 'A' : 'B');
            break;
        }
        mask[li] |= 1u << site;
    }
    if (!s) s = ds4_lora_alloc(m, r, alpha, rslora, mask, &l, err);
    size_t used = 0;
    if (!s) s = import_values(m, l, find_in_file, f, &used, err);
    if (!s && used != n)
        s = ds4_fail(err, DS4_ERR_FORMAT, "lora load %s: %zu tensors in the file, %zu expected", dir, n, used);
    if (s) ds4_lora_free(NULL, l);
    else if ((s = ds4_lora_attach(m, l, err))) ds4_error_prefix(err, "lora load %s: ", dir);
done:
    free(mask);
    ds4_st_close(f);
    return s;
}
