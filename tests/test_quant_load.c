/* test_quant_load.c — loading FP8 / FP4 checkpoints (core/quant.c through ds4_model_load).
 *
 * The references are independent of the code under test: tests/gen_quant_fixtures.py (numpy, written from the
 * formats' definitions) quantised tiny_hf's weights into two layouts and wrote the exactly dequantised fp32
 * weights beside them. Here every tensor of the quantised model must equal the reference's bit for bit, and so
 * must the logits. tests/gen_quant_logits.py ran transformers' DeepseekV4ForCausalLM (fp32) on each reference's
 * weights: ds4's logits on the quantised checkpoint must match them (bound at hf_bound). Then broken checkpoints, made by rewriting a fixture with one thing changed, must fail with
 * an error that names the tensor. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ds4.h"
#include "testlib.h"

static const char *g_fixtures;
static ds4_engine *g_eng;

static const char *fixture(const char *name) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", g_fixtures, name);
    return buf;
}

/* ------------------------------------------------------------------------------------------------ exactness */

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
    return m;
}

/* ds4 and transformers in fp32 differ only in summation orders: ~1e-6 of the largest logit on these fixtures
 * (docs/checkpoints.md quotes the measured values). 1e-5 of max(1, max|logit|) leaves a margin of ten and is
 * still far below what the quantisation itself moves (the check below requires the unquantised model to fail it
 * by a factor of 100), so a dequantisation that is off in any block cannot pass. NaN fails (d is NaN). */
static double hf_bound(const float *ref, int64_t n) {
    const double r = max_abs(ref, n);
    return 1e-5 * (r > 1 ? r : 1);
}

/* ds4's logits `got` on the quantised checkpoint against transformers' on the dequantised weights (ref/hf_logits) */
static void check_hf_logits(const char *quant, const char *ref, const float *got, const float *unquantised,
                            int64_t B, int64_t S, int64_t V) {
    ds4_error err = {0};
    char p[4096];
    snprintf(p, sizeof p, "%s/%s/hf_logits.safetensors", g_fixtures, ref);
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(p, &f, &err), &err);
    const ds4_st_entry *l = f ? ds4_st_find(f, "logits") : NULL;
    CHECK(l && l->dtype == DS4_F32 && l->ndim == 3 && l->shape[0] == B && l->shape[1] == S && l->shape[2] == V,
          "%s: logits [%lld, %lld, %lld] F32 expected", p, (long long)B, (long long)S, (long long)V);
    if (l && l->dtype == DS4_F32 && l->ndim == 3 && l->shape[0] * l->shape[1] * l->shape[2] == B * S * V) {
        const float *hf = l->data;
        const double d = ds4t_max_abs_diff(got, hf, B * S * V), tol = hf_bound(hf, B * S * V);
        printf("%s: logits within %.3g of transformers' on the dequantised weights (bound %.3g)\n", quant, d, tol);
        CHECK(d <= tol, "%s: logits differ from transformers' on %s by %g > %g", quant, ref, d, tol);
        if (unquantised) {
            const double du = ds4t_max_abs_diff(unquantised, hf, B * S * V);
            CHECK(du > 100 * tol, "%s: the unquantised model is only %g from the dequantised one's logits: the "
                  "comparison could not tell a skipped dequantisation", quant, du);
        }
    }
    ds4_st_close(f);
}

static void check_equal(const char *quant, const char *ref, const char *unquantised) {
    ds4_error err = {0};
    ds4_model *a = NULL, *b = NULL;
    char qdir[4096];
    snprintf(qdir, sizeof qdir, "%s", fixture(quant));
    CHECK_OK(ds4_model_load(g_eng, qdir, &a, &err), &err);
    CHECK_OK(ds4_model_load(g_eng, fixture(ref), &b, &err), &err);
    if (!a || !b) goto out;
    CHECK(ds4_model_tensor_count(a) == ds4_model_tensor_count(b), "%s: tensor counts differ", quant);
    size_t differ = 0;
    for (size_t i = 0; i < ds4_model_tensor_count(a) && i < ds4_model_tensor_count(b); i++) {
        const char *na, *nb;
        ds4_tensor va, vb;
        CHECK_OK(ds4_model_tensor_at(a, i, &na, &va, &err), &err);
        CHECK_OK(ds4_model_tensor_at(b, i, &nb, &vb, &err), &err);
        CHECK(strcmp(na, nb) == 0, "%s: tensor %zu is %s vs %s", quant, i, na, nb);
        if (va.nbytes != vb.nbytes || memcmp(va.data, vb.data, va.nbytes) != 0) {
            if (differ++ < 5) fprintf(stderr, "%s: tensor %s differs from the dequantised reference\n", quant, na);
        }
    }
    CHECK(differ == 0, "%s: %zu tensors differ from %s bitwise", quant, differ, ref);

    /* logits on tiny_hf's inputs: the same weights must give the same bits */
    ds4_st_file *io = NULL;
    char iop[4096];
    snprintf(iop, sizeof iop, "%s/tiny_hf/io.safetensors", g_fixtures);
    CHECK_OK(ds4_st_open(iop, &io, &err), &err);
    const ds4_st_entry *ids = io ? ds4_st_find(io, "input_ids") : NULL;
    CHECK(ids && ids->dtype == DS4_I64 && ids->ndim == 2, "tiny_hf io input_ids");
    if (ids) {
        const int64_t B = ids->shape[0], S = ids->shape[1], V = ds4_model_config(a)->vocab_size;
        float *la = malloc((size_t)(B * S * V) * sizeof(float)), *lb = malloc((size_t)(B * S * V) * sizeof(float));
        ds4_forward_args args = {.ids = ids->data, .batch = B, .seq = S};
        ds4_forward_result res;
        args.logits = la;
        CHECK_OK(ds4_model_forward(a, &args, &res, &err), &err);
        args.logits = lb;
        CHECK_OK(ds4_model_forward(b, &args, &res, &err), &err);
        CHECK(memcmp(la, lb, (size_t)(B * S * V) * sizeof(float)) == 0, "%s: logits differ from %s's (max %g)",
              quant, ref, ds4t_max_abs_diff(la, lb, B * S * V));
        /* the quantisation did something: the reference is not the fp32 model it was made from */
        ds4_model *orig = NULL;
        if (unquantised) CHECK_OK(ds4_model_load(g_eng, fixture(unquantised), &orig, &err), &err);
        if (orig) {
            float *lq = malloc((size_t)(B * S * V) * sizeof(float));
            memcpy(lq, la, (size_t)(B * S * V) * sizeof(float));
            args.logits = la;
            CHECK_OK(ds4_model_forward(orig, &args, &res, &err), &err);
            const double d = ds4t_max_abs_diff(la, lb, B * S * V);
            CHECK(d > 0 && d < 0.5, "%s: logits move by %g from the fp32 model's (want a small, nonzero change)",
                  quant, d);
            printf("%s: logits within %.3g of tiny_hf's fp32 model\n", quant, d);
            check_hf_logits(quant, ref, lq, la, B, S, V);
            free(lq);
            ds4_model_free(orig);
        } else {
            check_hf_logits(quant, ref, la, NULL, B, S, V);
        }
        free(la);
        free(lb);
    }
    ds4_st_close(io);
out:
    ds4_model_free(a);
    ds4_model_free(b);
}

/* ------------------------------------------------------------------------------------------------ broken copies */

typedef struct edit {
    const char *drop;         /* a tensor left out */
    const char *target;       /* a tensor changed: */
    int32_t new_ndim;         /*   new shape (0: keep), zero-filled data of its dtype */
    int64_t new_shape[2];
    ds4_dtype new_dtype;      /*   retyped (same size) when new_retype */
    int new_retype;
    int poison_byte;          /*   first byte set to 255 (e8m0 NaN) */
    const char *add;          /* a tensor added: a copy of `add_from` under this name */
    const char *add_from;
    const char *config_from, *config_to; /* config.json text substitution */
    int fp4_experts;          /* loaded with ds4_load_options.fp4_experts */
} edit;

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(1 << 16);
    size_t n = buf ? fread(buf, 1, (1 << 16) - 1, f) : 0;
    fclose(f);
    if (buf) buf[n] = 0;
    return buf;
}

static void rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[4096];
        while ((de = readdir(d)) != NULL) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

/* A borrowed tensor view of a checkpoint entry (ds4_st_write only reads it). */
static void entry_view(const ds4_st_entry *en, ds4_tensor *t) {
    t->dtype = en->dtype;
    t->ndim = en->ndim;
    memcpy(t->shape, en->shape, sizeof t->shape);
    t->data = (void *)(uintptr_t)en->data;
    t->nbytes = en->nbytes;
}

/* Copy fixture `src` (sharded or not) into a new directory as one model.safetensors with edit `e` applied. */
static int make_copy(const char *src, const edit *e, char *dir, size_t cap) {
    const char *base = getenv("TMPDIR");
    snprintf(dir, cap, "%s/ds4_quant_XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return -1;
    }
    ds4_error err = {0};
    ds4_checkpoint *ck = NULL;
    CHECK_OK(ds4_checkpoint_open(fixture(src), &ck, &err), &err);
    if (!ck) return -1;
    const size_t n = ds4_checkpoint_count(ck);
    const char **names = calloc(n + 1, sizeof *names);
    ds4_tensor *ts = calloc(n + 1, sizeof *ts);
    const ds4_tensor **tp = calloc(n + 1, sizeof *tp);
    void *owned[2] = {NULL, NULL};
    size_t k = 0;
    int found = e->target == NULL;
    for (size_t i = 0; i < n; i++) {
        const ds4_st_entry *en = ds4_checkpoint_entry_at(ck, i);
        if (e->drop && strcmp(en->name, e->drop) == 0) continue;
        ds4_tensor *t = &ts[k];
        entry_view(en, t);
        if (e->target && strcmp(en->name, e->target) == 0) {
            found = 1;
            if (e->new_retype) t->dtype = e->new_dtype;
            if (e->new_ndim) {
                t->ndim = e->new_ndim;
                t->shape[0] = e->new_shape[0];
                t->shape[1] = e->new_shape[1];
                t->nbytes = (size_t)(t->shape[0] * (t->ndim > 1 ? t->shape[1] : 1)) * ds4_dtype_size(t->dtype);
                t->data = owned[0] = calloc(1, t->nbytes);
            } else if (e->poison_byte) {
                t->data = owned[0] = malloc(t->nbytes);
                memcpy(t->data, en->data, t->nbytes);
                ((unsigned char *)t->data)[0] = 255;
            }
        }
        names[k] = en->name;
        tp[k] = t;
        k++;
    }
    CHECK(found, "edit target %s not in %s", e->target, src);
    if (e->add) {
        const ds4_st_entry *from = ds4_checkpoint_find(ck, e->add_from);
        CHECK(from != NULL, "%s not in %s", e->add_from, src);
        if (from) {
            entry_view(from, &ts[k]);
            names[k] = e->add;
            tp[k] = &ts[k];
            k++;
        }
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK_OK(ds4_st_write(path, k, names, tp, &err), &err);
    snprintf(path, sizeof path, "%s/config.json", fixture(src));
    char *cfg = read_text(path);
    CHECK(cfg != NULL, "read %s", path);
    if (cfg) {
        char *at = e->config_from ? strstr(cfg, e->config_from) : NULL;
        CHECK(!e->config_from || at, "config substitution %s", e->config_from);
        snprintf(path, sizeof path, "%s/config.json", dir);
        FILE *f = fopen(path, "wb");
        if (f) {
            if (at) {
                fwrite(cfg, 1, (size_t)(at - cfg), f);
                fputs(e->config_to, f);
                fputs(at + strlen(e->config_from), f);
            } else {
                fputs(cfg, f);
            }
            fclose(f);
        }
        free(cfg);
    }
    free(owned[0]);
    free(names);
    free(ts);
    free(tp);
    ds4_checkpoint_close(ck);
    return 0;
}

/* Load `src` with edit `e`: expect status `want` and every string of `needles` in the message. */
static void expect_error(const char *what, const char *src, const edit *e, ds4_status want, const char *const *needles) {
    char dir[512];
    if (make_copy(src, e, dir, sizeof dir)) return;
    ds4_error err = {0};
    ds4_model *m = NULL;
    const ds4_load_options lo = {.fp4_experts = e->fp4_experts};
    ds4_status s = ds4_model_load_opts(g_eng, dir, &lo, &m, &err);
    CHECK(s == want, "%s: status %s (%s), wanted %s", what, ds4_status_name(s), s ? err.msg : "", ds4_status_name(want));
    for (int i = 0; s && needles[i]; i++)
        CHECK(strstr(err.msg, needles[i]) != NULL, "%s: message lacks '%s': %s", what, needles[i], err.msg);
    if (s) printf("%s: %s\n", what, err.msg);
    ds4_model_free(m);
    rm_dir(dir);
}

static void test_errors(void) {
    const char *O = "quant_official", *H = "quant_hf", *F = "quant_fp4";
    /* FP4-resident experts (docs/checkpoints.md): every expert of a packed kind FP4, with finite e8m0 scales */
    expect_error("fp4_experts: one expert FP8", F,
                 &(edit){.target = "layers.0.ffn.experts.1.w1.weight", .new_retype = 1, .new_dtype = DS4_F8_E4M3,
                         .new_ndim = 2, .new_shape = {32, 32}, .fp4_experts = 1},
                 DS4_ERR_FORMAT, (const char *[]){"'layers.0.ffn.experts.1.w1.weight'", "must all be FP4", NULL});
    expect_error("fp4_experts: F32 scales", F,
                 &(edit){.target = "layers.0.ffn.experts.0.w2.scale", .new_retype = 1, .new_dtype = DS4_F32,
                         .new_ndim = 2, .new_shape = {32, 1}, .fp4_experts = 1},
                 DS4_ERR_UNSUPPORTED, (const char *[]){"'layers.0.ffn.experts.0.w2.weight'", "F8_E8M0", NULL});
    expect_error("fp4_experts: NaN scale", F,
                 &(edit){.target = "layers.1.ffn.experts.2.w3.scale", .poison_byte = 1, .fp4_experts = 1},
                 DS4_ERR_FORMAT, (const char *[]){"'layers.1.ffn.experts.2.w3.scale'", "NaN", NULL});
    expect_error("fp4_experts: missing scale", F,
                 &(edit){.drop = "layers.1.ffn.experts.5.w2.scale", .fp4_experts = 1}, DS4_ERR_FORMAT,
                 (const char *[]){"'layers.1.ffn.experts.5.w2.weight'", "no scale", NULL});
    expect_error("missing scale", O, &(edit){.drop = "layers.0.attn.wq_a.scale"}, DS4_ERR_FORMAT,
                 (const char *[]){"'layers.0.attn.wq_a.weight'", "no scale", NULL});
    expect_error("scale without weight", O, &(edit){.drop = "layers.0.attn.wkv.weight"}, DS4_ERR_FORMAT,
                 (const char *[]){"'layers.0.attn.wkv.scale'", "no weight", NULL});
    expect_error("FP4 scale shape", O,
                 &(edit){.target = "layers.0.ffn.experts.1.w1.scale", .new_ndim = 2, .new_shape = {16, 2}},
                 DS4_ERR_SHAPE, (const char *[]){"'layers.0.ffn.experts.1.w1.scale'", "[16,2]", "expected [16,1]", NULL});
    expect_error("FP4 packed shape", O,
                 &(edit){.target = "layers.1.ffn.experts.3.w3.weight", .new_ndim = 2, .new_shape = {16, 32}},
                 DS4_ERR_SHAPE, (const char *[]){"'layers.1.ffn.experts.3.w3.weight'", "expected [16,16]", NULL});
    expect_error("FP8 block count", H,
                 &(edit){.target = "model.layers.0.self_attn.q_b_proj.weight_scale_inv", .new_ndim = 2,
                         .new_shape = {4, 2}},
                 DS4_ERR_SHAPE, (const char *[]){"q_b_proj.weight_scale_inv'", "expected [4,1]", "16x24", NULL});
    expect_error("FP8 scale rank", O,
                 &(edit){.target = "layers.1.attn.wo_a.scale", .new_ndim = 1, .new_shape = {1, 0}},
                 DS4_ERR_SHAPE, (const char *[]){"'layers.1.attn.wo_a.scale'", "expected [1,1]", NULL});
    expect_error("NaN FP8 scale", O, &(edit){.target = "layers.1.attn.wo_b.scale", .poison_byte = 1},
                 DS4_ERR_FORMAT, (const char *[]){"'layers.1.attn.wo_b.scale'", "NaN", NULL});
    expect_error("NaN FP4 scale", O, &(edit){.target = "layers.0.ffn.experts.2.w3.scale", .poison_byte = 1},
                 DS4_ERR_FORMAT, (const char *[]){"'layers.0.ffn.experts.2.w3.scale'", "[0, 0] is NaN", NULL});
    expect_error("scale dtype", O,
                 &(edit){.target = "layers.0.attn.wq_b.scale", .new_retype = 1, .new_dtype = DS4_I8},
                 DS4_ERR_FORMAT, (const char *[]){"'layers.0.attn.wq_b.scale'", "I8", NULL});
    expect_error("scale of a float weight", "quant_official_ref",
                 &(edit){.add = "layers.0.attn.wq_a.scale", .add_from = "hc_head_scale"}, DS4_ERR_FORMAT,
                 (const char *[]){"'layers.0.attn.wq_a.scale'", "not a quantised weight", NULL});
    expect_error("two scales", O,
                 &(edit){.add = "layers.0.attn.wq_a.weight_scale_inv", .add_from = "layers.0.attn.wq_a.scale"},
                 DS4_ERR_FORMAT, (const char *[]){"two scales", "layers.0.attn.wq_a.weight_scale_inv", NULL});
    expect_error("quant_method", H, &(edit){.config_from = "\"fp8\"", .config_to = "\"awq\""}, DS4_ERR_UNSUPPORTED,
                 (const char *[]){"quant_method 'awq'", NULL});
    expect_error("weight_block_size", H, &(edit){.config_from = "[\n      16,", .config_to = "[\n      0,"},
                 DS4_ERR_FORMAT, (const char *[]){"weight_block_size[0]", NULL});
}

/* FP4 packed as U8 (some writers) reads as I8 does. */
static void test_u8(void) {
    char dir[512];
    edit e = {.target = "layers.0.ffn.experts.0.w1.weight", .new_retype = 1, .new_dtype = DS4_U8};
    if (make_copy("quant_official", &e, dir, sizeof dir)) return;
    ds4_error err = {0};
    ds4_model *m = NULL, *r = NULL;
    CHECK_OK(ds4_model_load(g_eng, dir, &m, &err), &err);
    CHECK_OK(ds4_model_load(g_eng, fixture("quant_official_ref"), &r, &err), &err);
    if (m && r) {
        for (size_t i = 0; i < ds4_model_tensor_count(m); i++) {
            ds4_tensor va, vb;
            const char *name;
            CHECK_OK(ds4_model_tensor_at(m, i, &name, &va, &err), &err);
            CHECK_OK(ds4_model_tensor_at(r, i, NULL, &vb, &err), &err);
            CHECK(memcmp(va.data, vb.data, va.nbytes) == 0, "U8 copy: %s differs", name);
        }
    }
    ds4_model_free(m);
    ds4_model_free(r);
    rm_dir(dir);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    g_fixtures = argv[1];
    ds4_error err = {0};
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &g_eng, &err), &err);
    if (!g_eng) return ds4t_finish("test_quant_load");
    check_equal("quant_official", "quant_official_ref", "tiny_hf");
    check_equal("quant_hf", "quant_hf_ref", "tiny_hf");
    check_equal("quant_fp4", "quant_fp4_ref", NULL);
    test_u8();
    test_errors();
    ds4_engine_free(g_eng);
    return ds4t_finish("test_quant_load");
}
