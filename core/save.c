/* save.c — write a model as a Hugging Face checkpoint directory (config.json + model.safetensors).
 *
 * Names: transformers 5.17 keeps the DeepSeek-V4 checkpoint spelling on disk and renames to its module names
 * only in memory, so save_pretrained writes the official names under "model.", with the exceptions listed at
 * ds4_hf_save_name (tests/fixtures/tiny_a/names.txt is what it wrote for the fixture). The hash-routing tables
 * are written as I64 (torch's dtype for them); ds4 keeps them as I32 in memory.
 *
 * Atomicity: the directory is assembled as a sibling "<dir>.tmp-<pid>" (same parent, so the final rename
 * cannot cross file systems), every file is fsynced, then the sibling is renamed to `dir` and the parent
 * fsynced. A crash leaves either no `dir`, the old one, or the new complete one — plus, at worst, the
 * temporary sibling. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_fs.h"
#include "fp4.h"
#include "internal.h"
#include "model.h"
#include "save_quant.h"

enum { NAME_CAP = 256 };

/* ------------------------------------------------------------------------------------------------ names */

int ds4_hf_save_name(const char *c, char *out, size_t cap) {
    if (!c || !out || cap == 0) return 0;
    const char *mapped = NULL;
    if (!strcmp(c, "embed.weight")) mapped = "model.embed_tokens.weight";
    else if (!strcmp(c, "head.weight")) mapped = "head.weight";
    else if (!strcmp(c, "hc_head_fn")) mapped = "model.hc_head.hc_fn";
    else if (!strcmp(c, "hc_head_base")) mapped = "model.hc_head.hc_base";
    else if (!strcmp(c, "hc_head_scale")) mapped = "model.hc_head.hc_scale";
    else if (!strcmp(c, "norm.weight")) mapped = "model.norm.weight";
    int w;
    if (mapped) {
        w = snprintf(out, cap, "%s", mapped);
    } else if (!strncmp(c, "mtp.", 4)) {
        /* transformers has no MTP module: save_pretrained never renames these, so they keep the official
         * spelling (the attention kv_norm included) */
        w = snprintf(out, cap, "%s", c);
    } else if (!strncmp(c, "layers.", 7)) {
        /* transformers' reverse renaming turns the attention's kv_norm into norm; the compressors' own norms
         * ("attn.compressor.norm.weight") are already called norm */
        const char *p = c + 7;
        while (*p >= '0' && *p <= '9') p++;
        if (p == c + 7 || *p != '.') return 0;
        if (!strcmp(p, ".attn.kv_norm.weight"))
            w = snprintf(out, cap, "model.%.*s.attn.norm.weight", (int)(p - c), c);
        else
            w = snprintf(out, cap, "model.%s", c);
    } else {
        return 0;
    }
    return w > 0 && (size_t)w < cap;
}

/* ------------------------------------------------------------------------------------------------ tensors */

typedef struct save_set {
    size_t n;
    char (*names)[NAME_CAP];
    ds4_tensor *tensors;
    const char **name_ptrs;        /* sorted by name */
    const ds4_tensor **tensor_ptrs;
    void *conv;                    /* converted floats (BF16/F16), when not F32 */
    int64_t *tid;                  /* tid2eid widened to I64 */
    uint8_t *codes;                /* re-encoded quantised tensors (save_quant.h) */
    float *scratch;                /* checking them */
    float *dec;                    /* FP4-resident experts decoded, when every tensor is written as float */
    int any_quant;                 /* some tensor is written quantised */
} save_set;

static void save_set_free(save_set *s) {
    free(s->names);
    free(s->tensors);
    free(s->name_ptrs);
    free(s->tensor_ptrs);
    free(s->conv);
    free(s->tid);
    free(s->codes);
    free(s->scratch);
    free(s->dec);
    memset(s, 0, sizeof *s);
}

typedef struct {
    const char *name;
    size_t idx;
} sort_item;

static int cmp_item(const void *a, const void *b) {
    return strcmp(((const sort_item *)a)->name, ((const sort_item *)b)->name);
}

/* Room for every tensor of the model: a quantised one may add its scale (save_quant.h). */
typedef struct {
    size_t cap;
    int64_t n_float, n_int, n_codes, n_scratch, n_dec;
} set_sizes;

static ds4_status size_set(const ds4_model *m, int expand, set_sizes *z, ds4_error *err) {
    memset(z, 0, sizeof *z);
    const size_t n = ds4_model_tensor_count(m);
    z->cap = n;
    for (size_t i = 0; i < n; i++) {
        ds4_tensor v;
        ds4_status st = ds4_model_tensor_at(m, i, NULL, &v, err); /* brings a device model's host copy up to date */
        if (st) return st;
        const ds4_param *p = &m->table[i];
        int64_t codes, scratch;
        if (ds4_qsave_candidate(m, i, expand, &codes, &scratch)) {
            z->cap++;
            z->n_codes += codes;
            z->n_scratch = scratch > z->n_scratch ? scratch : z->n_scratch;
        }
        if (p->dtype == DS4_FP4_PACKED) {
            if (expand) z->n_dec += p->numel, z->n_float += p->numel;
        } else if (p->dtype == DS4_F32) {
            z->n_float += p->numel; /* a quantised candidate may be written as float after all */
        } else {
            z->n_int += p->numel;
        }
    }
    return DS4_OK;
}

static ds4_status alloc_set(save_set *s, const set_sizes *z, ds4_dtype dtype, ds4_error *err) {
    const size_t c = z->cap ? z->cap : 1;
    s->names = calloc(c, sizeof *s->names);
    s->tensors = calloc(c, sizeof *s->tensors);
    s->name_ptrs = calloc(c, sizeof *s->name_ptrs);
    s->tensor_ptrs = calloc(c, sizeof *s->tensor_ptrs);
    if (!s->names || !s->tensors || !s->name_ptrs || !s->tensor_ptrs)
        return ds4_fail(err, DS4_ERR_OOM, "model save: tensor tables for %zu tensors", z->cap);
    /* Converted copies live in flat buffers sized from the whole model. */
    if (dtype != DS4_F32 && z->n_float > 0 && !(s->conv = malloc((size_t)z->n_float * 2)))
        return ds4_fail(err, DS4_ERR_OOM, "model save: %lld-element %s copy of the parameters", (long long)z->n_float,
                        ds4_dtype_name(dtype));
    if (z->n_int > 0 && !(s->tid = malloc((size_t)z->n_int * sizeof(int64_t))))
        return ds4_fail(err, DS4_ERR_OOM, "model save: %lld-element I64 copy of the hash tables", (long long)z->n_int);
    if ((z->n_codes > 0 && !(s->codes = malloc((size_t)z->n_codes))) ||
        (z->n_scratch > 0 && !(s->scratch = malloc((size_t)z->n_scratch * sizeof(float)))) ||
        (z->n_dec > 0 && !(s->dec = malloc((size_t)z->n_dec * sizeof(float)))))
        return ds4_fail(err, DS4_ERR_OOM, "model save: %lld bytes of quantised codes, %lld + %lld floats to check and "
                        "decode them", (long long)z->n_codes, (long long)z->n_scratch, (long long)z->n_dec);
    return DS4_OK;
}

/* Entry t as the float values src (numel) in the save dtype (conv + *fo when converted). */
static void float_entry(ds4_tensor *t, const float *src, int64_t numel, ds4_dtype dtype, save_set *s, int64_t *fo) {
    t->dtype = DS4_F32;
    t->data = (void *)(uintptr_t)src;
    t->nbytes = (size_t)numel * 4;
    if (dtype == DS4_F32) return;
    uint16_t *dst = (uint16_t *)s->conv + *fo;
    for (int64_t k = 0; k < numel; k++) dst[k] = dtype == DS4_BF16 ? ds4_f32_to_bf16(src[k]) : ds4_f32_to_f16(src[k]);
    t->dtype = dtype;
    t->data = dst;
    t->nbytes = (size_t)numel * 2;
    *fo += numel;
}

/* Views of every parameter under its save_pretrained name: loaded-quantised ones in their loaded format while that is
 * exact (unless expand), the others converted where the dtype asks for it. */
static ds4_status build_set(const ds4_model *m, ds4_dtype dtype, int expand, save_set *s, ds4_error *err) {
    memset(s, 0, sizeof *s);
    set_sizes z;
    ds4_status st = size_set(m, expand, &z, err);
    sort_item *order = NULL;
    if (!st) st = alloc_set(s, &z, dtype, err);
    if (!st && !(order = calloc(z.cap ? z.cap : 1, sizeof *order)))
        st = ds4_fail(err, DS4_ERR_OOM, "model save: order of %zu tensors", z.cap);
    if (st) goto out;
    int64_t fo = 0, io = 0, co = 0, dof = 0;
    size_t k = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
        const char *canon = NULL;
        ds4_tensor v;
        st = ds4_model_tensor_at(m, i, &canon, &v, err);
        if (st) goto out;
        if (!ds4_hf_save_name(canon, s->names[k], NAME_CAP)) {
            st = ds4_fail(err, DS4_ERR_INTERNAL, "model save: no save_pretrained name for tensor '%s'", canon);
            goto out;
        }
        const ds4_param *p = &m->table[i];
        ds4_tensor *t = &s->tensors[k];
        int64_t ncodes, nscratch;
        if (ds4_qsave_candidate(m, i, expand, &ncodes, &nscratch)) {
            int yes = 0;
            st = ds4_qsave_tensor(m, i, s->names[k], s->codes + co, s->scratch, t, t + 1, s->names[k + 1], NAME_CAP,
                                  &yes, err);
            if (st) goto out;
            if (yes) {
                co += ncodes;
                s->any_quant = 1;
                for (int j = 0; j < 2; j++) order[k + j] = (sort_item){s->names[k + j], k + j};
                k += 2;
                continue;
            }
        }
        const int64_t numel = p->numel;
        *t = v; /* shape, ndim; a borrowed view (refcount 0) */
        if (p->dtype == DS4_FP4_PACKED) { /* expand: its values as float */
            ds4_qsave_decode(m, i, s->dec + dof);
            t->shape[1] = p->shape[1];
            float_entry(t, s->dec + dof, numel, dtype, s, &fo);
            dof += numel;
        } else if (v.dtype == DS4_F32) {
            float_entry(t, v.data, numel, dtype, s, &fo);
        } else if (v.dtype == DS4_I32) {
            int64_t *dst = s->tid + io;
            const int32_t *src = v.data;
            for (int64_t x = 0; x < numel; x++) dst[x] = src[x];
            t->dtype = DS4_I64;
            t->data = dst;
            t->nbytes = (size_t)numel * 8;
            io += numel;
        } else {
            st = ds4_fail(err, DS4_ERR_INTERNAL, "model save: tensor '%s' has unexpected dtype %s", canon,
                          ds4_dtype_name(v.dtype));
            goto out;
        }
        order[k] = (sort_item){s->names[k], k};
        k++;
    }
    s->n = k;
    /* Sorted by name: the same model always gives the same bytes. */
    qsort(order, k, sizeof *order, cmp_item);
    for (size_t i = 0; i < k; i++) {
        s->name_ptrs[i] = order[i].name;
        s->tensor_ptrs[i] = &s->tensors[order[i].idx];
    }
out:
    free(order);
    if (st) save_set_free(s);
    return st;
}

/* ------------------------------------------------------------------------------------------------ files */

static const char *hf_dtype_name(ds4_dtype d) {
    return d == DS4_BF16 ? "bfloat16" : d == DS4_F16 ? "float16" : "float32";
}

/* ds4_config_to_json plus the "dtype" field save_pretrained writes (transformers reads it for dtype="auto"), and with
 * quantised tensors (qblock non-NULL) the quantization_config that says their FP8 block. */
static char *config_text(const ds4_config *c, ds4_dtype dtype, const int64_t *qblock, size_t *len) {
    char *js = ds4_config_to_json(c);
    if (!js) return NULL;
    char *close = strrchr(js, '}');
    if (!close) {
        free(js);
        return NULL;
    }
    size_t head = (size_t)(close - js);
    while (head > 0 && (js[head - 1] == ' ' || js[head - 1] == '\n' || js[head - 1] == '\t' || js[head - 1] == '\r'))
        head--;
    const char *fmt = ",\n  \"dtype\": \"%s\"%s\n}\n";
    char quant[192] = "";
    if (qblock)
        snprintf(quant, sizeof quant, ",\n  \"quantization_config\": {\"fmt\": \"e4m3\", \"quant_method\": \"fp8\", "
                 "\"weight_block_size\": [%lld, %lld]}", (long long)qblock[0], (long long)qblock[1]);
    size_t cap = head + strlen(fmt) + strlen(quant) + 16;
    char *out = malloc(cap);
    if (!out) {
        free(js);
        return NULL;
    }
    memcpy(out, js, head);
    int w = snprintf(out + head, cap - head, fmt, hf_dtype_name(dtype), quant);
    free(js);
    if (w < 0 || (size_t)w >= cap - head) {
        free(out);
        return NULL;
    }
    *len = head + (size_t)w;
    return out;
}

static ds4_status check_opts(const ds4_save_options *opt, ds4_save_options *o, ds4_error *err) {
    memset(o, 0, sizeof *o);
    o->dtype = DS4_F32;
    if (opt) *o = *opt;
    if (o->dtype != DS4_F32 && o->dtype != DS4_BF16 && o->dtype != DS4_F16)
        return ds4_fail(err, DS4_ERR_ARG, "model save: dtype %s is not one of F32, BF16, F16",
                        ds4_dtype_name(o->dtype) ? ds4_dtype_name(o->dtype) : "?");
    if (o->n_files && !o->files) return ds4_fail(err, DS4_ERR_ARG, "model save: %zu files but NULL files", o->n_files);
    for (size_t i = 0; i < o->n_files; i++) {
        const ds4_save_file *f = &o->files[i];
        const char *n = f->name;
        size_t l = n ? strlen(n) : 0;
        int ok = l > 5 && l < NAME_CAP && n[0] != '.' && !strcmp(n + l - 5, ".json") && strcmp(n, "config.json") &&
                 (f->data || !f->len);
        for (size_t k = 0; ok && k < l; k++) {
            char c = n[k];
            ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                 c == '-';
        }
        if (!ok)
            return ds4_fail(err, DS4_ERR_ARG, "model save: files[%zu]: name '%s' is not a plain *.json file name "
                            "([A-Za-z0-9._-], not config.json) with data", i, n ? n : "(null)");
    }
    return DS4_OK;
}

/* A diverged model (NaN or Inf weights) must never become a checkpoint that looks complete: it would load, and
 * then every loss would be NaN. */
static ds4_status check_finite(const ds4_model *m, const char *dir, ds4_error *err) {
    const size_t n = ds4_model_tensor_count(m);
    for (size_t i = 0; i < n; i++) {
        const char *name = NULL;
        ds4_tensor v;
        ds4_status st = ds4_model_tensor_at(m, i, &name, &v, err);
        if (st) return st;
        if (v.dtype != DS4_F32) continue;
        const float *x = v.data;
        const int64_t k = ds4_tensor_numel(&v);
        int64_t bad = 0, first = -1;
        for (int64_t j = 0; j < k; j++)
            if (!isfinite(x[j])) {
                if (first < 0) first = j;
                bad++;
            }
        if (bad)
            return ds4_fail(err, DS4_ERR_ARG,
                            "model save %s: tensor %s holds %lld non-finite values of %lld (element %lld is %g): "
                            "refusing to write the weights of a diverged model",
                            dir, name, (long long)bad, (long long)k, (long long)first, (double)x[first]);
    }
    return DS4_OK;
}

ds4_status ds4_model_write_files(const ds4_model *m, const char *dir, const ds4_save_options *opt, ds4_error *err) {
    if (!m || !dir) return ds4_fail(err, DS4_ERR_ARG, "model save: NULL argument");
    ds4_save_options o;
    ds4_status st = check_opts(opt, &o, err);
    if (st) return st;
    if ((st = check_finite(m, dir, err))) return st;
    size_t dl = strlen(dir);
    char *path = malloc(dl + 32);
    if (!path) return ds4_fail(err, DS4_ERR_OOM, "model save %s: path", dir);
    /* the tensors first (in memory: whether any stays quantised decides the config), then config.json: a directory
     * with weights but no config is useless, the reverse is merely incomplete — and neither is published before the
     * caller's rename or commit anyway. */
    save_set s;
    st = build_set(m, o.dtype, o.expand_quantised, &s, err);
    if (st) {
        free(path);
        return st;
    }
    size_t clen = 0;
    char *cfg = config_text(ds4_model_config(m), o.dtype, s.any_quant ? m->qblock : NULL, &clen);
    if (!cfg) st = ds4_fail(err, DS4_ERR_OOM, "model save %s: config.json text", dir);
    if (!st) {
        snprintf(path, dl + 32, "%s/config.json", dir);
        st = ds4_fs_write_file("model save", path, cfg, clen, err);
    }
    free(cfg);
    if (!st) {
        snprintf(path, dl + 32, "%s/model.safetensors", dir);
        st = ds4_st_write(path, s.n, s.name_ptrs, s.tensor_ptrs, err);
        if (st) ds4_error_prefix(err, "model save: ");
    }
    save_set_free(&s);
    free(path);
    for (size_t i = 0; !st && i < o.n_files; i++) {
        size_t cap = dl + strlen(o.files[i].name) + 2;
        char *fp = malloc(cap);
        if (!fp) return ds4_fail(err, DS4_ERR_OOM, "model save %s: path", dir);
        snprintf(fp, cap, "%s/%s", dir, o.files[i].name);
        st = ds4_fs_write_file("model save", fp, o.files[i].data, o.files[i].len, err);
        free(fp);
    }
    return st;
}

/* Files a checkpoint directory may hold; overwrite replaces nothing else (a typo'd model:save("/home/me") must
 * never wipe a home directory). */
static int checkpoint_file_name(const char *n) {
    size_t l = strlen(n);
    if (!strcmp(n, "config.json")) return 1;
    if (l > 12 && !strcmp(n + l - 12, ".safetensors")) return 1;
    if (l > 5 && !strcmp(n + l - 5, ".json")) return 1;
    return 0;
}

/* 0: missing, 1: empty directory, 2: directory holding only checkpoint files, 3: anything else (not a
 * directory, or foreign entries). */
static int inspect_target(const char *dir, char *why, size_t cap) {
    struct stat st;
    if (lstat(dir, &st) != 0) return errno == ENOENT ? 0 : (snprintf(why, cap, "stat: %s", strerror(errno)), 3);
    if (!S_ISDIR(st.st_mode)) return snprintf(why, cap, "it exists and is not a directory"), 3;
    DIR *d = opendir(dir);
    if (!d) return snprintf(why, cap, "opendir: %s", strerror(errno)), 3;
    int kind = 1;
    char *full = malloc(strlen(dir) + NAME_CAP + 2);
    if (!full) {
        closedir(d);
        return snprintf(why, cap, "out of memory"), 3;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(full, strlen(dir) + NAME_CAP + 2, "%s/%s", dir, e->d_name);
        struct stat fs;
        if (lstat(full, &fs) != 0 || !S_ISREG(fs.st_mode) || !checkpoint_file_name(e->d_name)) {
            snprintf(why, cap, "it holds '%s', which is not a checkpoint file", e->d_name);
            kind = 3;
            break;
        }
        kind = 2;
    }
    free(full);
    closedir(d);
    return kind;
}

ds4_status ds4_model_save(const ds4_model *m, const char *dir, ds4_error *err) {
    return ds4_model_save_opts(m, dir, NULL, err);
}

typedef struct model_writer {
    const ds4_model *m;
    const ds4_save_options *o;
} model_writer;

static ds4_status write_model(void *ctx, const char *dir, ds4_error *err) {
    const model_writer *w = ctx;
    return ds4_model_write_files(w->m, dir, w->o, err);
}

static ds4_status save_whole(const ds4_model *m, const char *dir_in, const ds4_save_options *opt, ds4_error *err) {
    ds4_save_options o;
    ds4_status st = check_opts(opt, &o, err);
    if (st) return st;
    if ((st = check_finite(m, dir_in, err))) return st; /* before anything is created */
    model_writer w = {m, &o};
    return ds4_dir_save_atomic("model save", dir_in, o.overwrite, write_model, &w, err);
}

/* Sharded experts (expert parallelism, ep_shard.c): every rank calls the save; the weights are gathered whole on
 * rank 0 (every rank's experts from their owners, one at a time), which writes them as one process holding every
 * expert would, the same files; the other ranks send their experts and write nothing. The gathered copy lives for
 * the save only. */
static ds4_status save_sharded(ds4_model *m, const char *dir_in, const ds4_save_options *opt, ds4_error *err) {
    size_t bytes;
    const int root = m->ep_shard_rank == 0;
    float *full = !root ? NULL : ds4_mul_size((size_t)m->n_full, sizeof(float), &bytes) ? malloc(bytes ? bytes : 1) : NULL;
    if (root && !full) return ds4_fail(err, DS4_ERR_OOM, "model save: %lld parameters gathered", (long long)m->n_full);
    ds4_status st = ds4_model_host_sync(m, err); /* a model training on a device: its master comes back first */
    if (!st) st = ds4_ep_gather(m, m->params, full, 0, err);
    if (!st && root) {
        m->ep_full = full;
        st = save_whole(m, dir_in, opt, err);
        m->ep_full = NULL;
    }
    free(full);
    return st;
}

ds4_status ds4_model_save_opts(const ds4_model *m, const char *dir_in, const ds4_save_options *opt, ds4_error *err) {
    if (!m || !dir_in) return ds4_fail(err, DS4_ERR_ARG, "model save: NULL argument");
    if (m->ep_shard) return save_sharded((ds4_model *)(uintptr_t)m, dir_in, opt, err); /* the gather's scratch only */
    return save_whole(m, dir_in, opt, err);
}

ds4_status ds4_dir_save_atomic(const char *what, const char *dir_in, int overwrite, ds4_dir_writer write, void *ctx,
                               ds4_error *err) {
    ds4_status st = DS4_OK;
    const size_t cap = strlen(dir_in) + 64;
    char *dir = malloc(cap), *parent = malloc(cap), *base = malloc(cap), *tmp = malloc(cap), *old = malloc(cap);
    if (!dir || !parent || !base || !tmp || !old) {
        st = ds4_fail(err, DS4_ERR_OOM, "%s %s: paths", what, dir_in);
        goto out;
    }
    if (!ds4_fs_split(dir_in, parent, cap, base, cap)) {
        st = ds4_fail(err, DS4_ERR_ARG, "%s '%s': not a directory path with a last component", what, dir_in);
        goto out;
    }
    snprintf(dir, cap, "%s/%s", parent, base);
    long pid = (long)getpid();
    snprintf(tmp, cap, "%s.tmp-%ld", dir, pid);
    snprintf(old, cap, "%s.old-%ld", dir, pid);
    st = ds4_fs_mkdirs(what, parent, err);
    if (st) goto out;
    char why[512] = "";
    int target = inspect_target(dir, why, sizeof why);
    if (target == 3) {
        st = ds4_fail(err, DS4_ERR_IO, "%s %s: refusing to save there: %s", what, dir, why);
        goto out;
    }
    if (target == 2 && !overwrite) {
        st = ds4_fail(err, DS4_ERR_IO, "%s %s: the directory exists and is not empty (set overwrite to replace it)",
                      what, dir);
        goto out;
    }
    /* A leftover of an earlier attempt under our pid is ours to discard. */
    st = ds4_fs_rmtree(what, tmp, err);
    if (st) goto out;
    if (mkdir(tmp, 0755) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "%s %s: mkdir %s: %s", what, dir, tmp, strerror(errno));
        goto out;
    }
    st = write(ctx, tmp, err);
    if (!st) st = ds4_fs_sync_dir(what, tmp, err);
    if (st) {
        ds4_fs_rmtree(what, tmp, NULL);
        goto out;
    }
    if (target == 2) {
        /* rename(2) cannot replace a non-empty directory: move the old one aside first. Between the two renames
         * `dir` is absent, never half-written; the old copy is dropped only once the new one is in place. */
        if (rename(dir, old) != 0) {
            st = ds4_fail(err, DS4_ERR_IO, "%s %s: rename the old directory to %s: %s", what, dir, old,
                          strerror(errno));
            ds4_fs_rmtree(what, tmp, NULL);
            goto out;
        }
    }
    if (rename(tmp, dir) != 0) {
        st = ds4_fail(err, DS4_ERR_IO, "%s %s: rename from %s: %s", what, dir, tmp, strerror(errno));
        if (target == 2) (void)rename(old, dir);
        ds4_fs_rmtree(what, tmp, NULL);
        goto out;
    }
    st = ds4_fs_sync_dir(what, parent, err);
    /* The new directory is in place; failing to delete the old copy only leaves a ".old-" sibling behind. */
    if (target == 2) ds4_fs_rmtree(what, old, NULL);
out:
    free(dir);
    free(parent);
    free(base);
    free(tmp);
    free(old);
    return st;
}
