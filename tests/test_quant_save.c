/* test_quant_save.c — saving in the loaded format (docs/checkpoints.md, "Saving"; core/save_quant.c).
 *
 * The reference is the input checkpoint itself: after load -> save, every FP8 / FP4 weight of the input and its scale
 * must be in the saved file with the same dtype, shape and bytes (matched by canonical name), and the saved checkpoint
 * must load to the same logits, bit for bit. Then the cases where a tensor must not stay quantised: a full
 * fine-tuning step changes most weights, which must come back as F32 and reload to the trained model's logits, while
 * the weights the step did not change stay byte-identical; expand_quantised writes everything in the save dtype: in
 * F32 the reload gives the same logits, and in bf16 the experts come back exactly (bf16 holds every e2m1 value times
 * a power of two). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_ckpt.h"
#include "ds4_train.h"
#include "model.h"
#include "quant.h"
#include "testlib.h"

static const char *g_fixtures;
static ds4_engine *g_eng;
static char g_tmp[256];
static ds4_error err_unused;

static ds4_model *load_dir(const char *dir, int fp4) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    const ds4_load_options o = {.fp4_experts = fp4};
    CHECK_OK(ds4_model_load_opts(g_eng, dir, &o, &m, &err), &err);
    return m;
}

static const char *fixture(const char *fx) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", g_fixtures, fx);
    return buf;
}

/* tiny_hf's io.safetensors (NULL: a failed check) with its input_ids and labels */
static ds4_st_file *open_io(const ds4_st_entry **ids, const ds4_st_entry **labels) {
    char p[4096];
    snprintf(p, sizeof p, "%s/tiny_hf/io.safetensors", g_fixtures);
    ds4_error err = {0};
    ds4_st_file *f = NULL;
    CHECK_OK(ds4_st_open(p, &f, &err), &err);
    *ids = f ? ds4_st_find(f, "input_ids") : NULL;
    *labels = f ? ds4_st_find(f, "labels") : NULL;
    CHECK(*ids && *labels, "%s: input_ids and labels", p);
    return f;
}

/* logits on tiny_hf's inputs (a new block) */
static float *logits(ds4_model *m, int64_t *n) {
    const ds4_st_entry *ids, *lab;
    ds4_st_file *f = open_io(&ids, &lab);
    ds4_error err = {0};
    float *l = NULL;
    if (ids) {
        *n = ids->shape[0] * ids->shape[1] * ds4_model_config(m)->vocab_size;
        l = malloc((size_t)*n * sizeof(float));
        ds4_forward_args a = {.ids = ids->data, .batch = ids->shape[0], .seq = ids->shape[1], .logits = l};
        ds4_forward_result r;
        CHECK_OK(ds4_model_forward(m, &a, &r, &err), &err);
    }
    ds4_st_close(f);
    return l;
}

static const ds4_st_entry *scale_of(const ds4_checkpoint *ck, const char *wname) {
    char a[600], b[600];
    const size_t n = strlen(wname);
    snprintf(a, sizeof a, "%.*s.scale", (int)(n - 7), wname);
    snprintf(b, sizeof b, "%s_scale_inv", wname);
    const ds4_st_entry *s = ds4_checkpoint_find(ck, a);
    return s ? s : ds4_checkpoint_find(ck, b);
}

/* The saved weight whose canonical name is `canon`, and the saved scale whose weight's canonical name is it. */
static void find_saved(const ds4_checkpoint *out, const char *canon, const ds4_st_entry **w, const ds4_st_entry **s) {
    *w = *s = NULL;
    char c[512], t[600];
    for (size_t i = 0; i < ds4_checkpoint_count(out); i++) {
        const ds4_st_entry *e = ds4_checkpoint_entry_at(out, i);
        if (ds4_canonical_name(e->name, c, sizeof c) && !strcmp(c, canon)) *w = e;
        else if (ds4_quant_scale_target(e->name, t, sizeof t) && ds4_canonical_name(t, c, sizeof c) && !strcmp(c, canon))
            *s = e;
    }
}

static int same_entry(const ds4_st_entry *a, const ds4_st_entry *b) {
    if (!a || !b || a->dtype != b->dtype || a->ndim != b->ndim || a->nbytes != b->nbytes) return 0;
    for (int32_t k = 0; k < a->ndim; k++)
        if (a->shape[k] != b->shape[k]) return 0;
    return memcmp(a->data, b->data, a->nbytes) == 0;
}

/* Compare the quantised weights of input `in` with the saved checkpoint `out`: *kept byte-identical (weight and
 * scale), *floated written as float instead; *total quantised weights in the input. */
static void compare(const char *in_dir, const char *out_dir, int64_t *kept, int64_t *floated, int64_t *total) {
    ds4_error err = {0};
    ds4_checkpoint *in = NULL, *out = NULL;
    CHECK_OK(ds4_checkpoint_open(in_dir, &in, &err), &err);
    CHECK_OK(ds4_checkpoint_open(out_dir, &out, &err), &err);
    *kept = *floated = *total = 0;
    char canon[512];
    for (size_t i = 0; in && out && i < ds4_checkpoint_count(in); i++) {
        const ds4_st_entry *e = ds4_checkpoint_entry_at(in, i);
        if (ds4_quant_kind(e->dtype) == DS4_Q_NONE || !ds4_canonical_name(e->name, canon, sizeof canon)) continue;
        (*total)++;
        const ds4_st_entry *w, *s;
        find_saved(out, canon, &w, &s);
        if (w && ds4_quant_kind(w->dtype) == DS4_Q_NONE && !s) (*floated)++;
        else if (same_entry(e, w) && same_entry(scale_of(in, e->name), s)) (*kept)++;
        else CHECK(0, "%s: saved as %s %s, not as loaded", e->name, w ? ds4_dtype_name(w->dtype) : "(missing)",
                   s ? "with a scale" : "without a scale");
    }
    ds4_checkpoint_close(in);
    ds4_checkpoint_close(out);
}

static const char *save(ds4_model *m, const ds4_save_options *o) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/saved", g_tmp);
    ds4_save_options opt = o ? *o : (ds4_save_options){0};
    opt.overwrite = 1;
    ds4_error err = {0};
    CHECK_OK(ds4_model_save_opts(m, dir, &opt, &err), &err);
    return dir;
}

/* load (FP4-resident or not) -> save -> every quantised tensor byte-identical -> reload -> the same logits */
static void test_roundtrip(const char *fx, int fp4) {
    ds4_model *m = load_dir(fixture(fx), fp4);
    if (!m) return;
    int64_t n = 0, n2 = 0, kept, floated, total;
    float *l0 = logits(m, &n);
    const char *dir = save(m, NULL);
    compare(fixture(fx), dir, &kept, &floated, &total);
    CHECK(total > 0 && kept == total && floated == 0, "%s%s: %lld of %lld quantised tensors saved as loaded", fx,
          fp4 ? " (FP4-resident)" : "", (long long)kept, (long long)total);
    for (int reload_fp4 = 0; reload_fp4 <= fp4; reload_fp4++) {
        ds4_model *r = load_dir(dir, reload_fp4);
        float *l1 = r ? logits(r, &n2) : NULL;
        CHECK(l0 && l1 && n == n2 && !memcmp(l0, l1, (size_t)n * sizeof(float)),
              "%s: the saved checkpoint's logits differ (reloaded %s)", fx, reload_fp4 ? "FP4-resident" : "dequantised");
        free(l1);
        ds4_model_free(r);
    }
    printf("%s%s: %lld quantised tensors saved byte-identical with their scales; reloaded logits bit for bit\n", fx,
           fp4 ? " (FP4-resident)" : "", (long long)kept);
    free(l0);
    ds4_model_free(m);
}

/* a full fine-tuning step (lora 0) changes the weights it trains: those are saved as F32, the others as loaded; a
 * LoRA step (lora 1) changes no weight: everything stays as loaded */
static void test_trained(int lora) {
    ds4_model *m = load_dir(fixture("quant_official"), lora);
    if (!m) return;
    ds4_error err0 = {0};
    const ds4_lora_options lo = {.rank = 4, .alpha = 8, .targets = DS4_LORA_ALL};
    if (lora) CHECK_OK(ds4_model_lora(m, &lo, &err0), &err0);
    const ds4_st_entry *ids, *lab;
    ds4_st_file *f = open_io(&ids, &lab);
    ds4_error err = {0};
    if (ids && lab) {
        ds4_forward_args a = {.ids = ids->data, .batch = ids->shape[0], .seq = ids->shape[1], .labels = lab->data};
        ds4_forward_result r;
        CHECK_OK(ds4_model_enable_grad(m, &err), &err);
        CHECK_OK(ds4_model_forward_train(m, &a, &r, &err), &err);
        CHECK_OK(ds4_model_backward(m, 1.0 / (double)r.loss_tokens, &err), &err);
        ds4_adamw *opt = NULL;
        const ds4_adamw_options o = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
        CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
        if (opt) CHECK_OK(ds4_adamw_step(opt, NULL, &err), &err);
        ds4_adamw_free(opt);
    }
    ds4_st_close(f);
    int64_t n = 0, n2 = 0, kept, floated, total;
    float *l0 = NULL;
    const char *dir = save(m, NULL);
    compare(fixture("quant_official"), dir, &kept, &floated, &total);
    /* full fine-tuning: the indexer's projections train only through the indexer KL loss (off), and experts no token
     * reached get no update (no weight decay here): they stay as loaded */
    CHECK(lora ? floated == 0 && kept == total : floated > 0 && kept > 0 && kept + floated == total,
          "trained (%s): %lld kept, %lld floated of %lld", lora ? "LoRA" : "full", (long long)kept, (long long)floated,
          (long long)total);
    if (lora) ds4_model_drop_lora(m); /* the saved base model, without the adapters (saved apart, docs/lora.md) */
    free(l0);
    l0 = logits(m, &n);
    ds4_model *r = load_dir(dir, 0);
    float *l1 = r ? logits(r, &n2) : NULL;
    CHECK(l0 && l1 && n == n2 && !memcmp(l0, l1, (size_t)n * sizeof(float)),
          "trained: the saved checkpoint's logits differ from the trained model's");
    printf("trained (%s): %lld changed tensors saved as F32, %lld unchanged ones as loaded; reloaded logits bit for "
           "bit\n", lora ? "LoRA step, experts FP4-resident" : "full fine-tuning", (long long)floated, (long long)kept);
    free(l0);
    free(l1);
    ds4_model_free(r);
    ds4_model_free(m);
}

/* expand_quantised: everything in the save dtype, the FP4-resident experts decoded */
static void test_expand(void) {
    ds4_model *m = load_dir(fixture("quant_fp4"), 1), *deq = load_dir(fixture("quant_fp4"), 0);
    if (!m || !deq) goto out;
    int64_t n = 0, n2 = 0, kept, floated, total;
    float *l0 = logits(m, &n);
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        const ds4_save_options o = {.dtype = bf16 ? DS4_BF16 : DS4_F32, .expand_quantised = 1};
        const char *dir = save(m, &o);
        compare(fixture("quant_fp4"), dir, &kept, &floated, &total);
        CHECK(kept == 0 && floated == total && total == 48, "expand_quantised: %lld of %lld written as float",
              (long long)floated, (long long)total);
        ds4_model *r = load_dir(dir, 0);
        if (!r) continue;
        if (!bf16) {
            float *l1 = logits(r, &n2);
            CHECK(l0 && l1 && n == n2 && !memcmp(l0, l1, (size_t)n * sizeof(float)),
                  "expand_quantised (F32): the saved checkpoint's logits differ");
            free(l1);
        }
        int64_t same = 0;
        for (size_t i = 0; i < ds4_model_tensor_count(r); i++) {
            const char *name;
            ds4_tensor a, b;
            CHECK_OK(ds4_model_tensor_at(r, i, &name, &a, &err_unused), &err_unused);
            if (!strstr(name, ".ffn.experts.")) continue;
            CHECK_OK(ds4_model_tensor_at(deq, (size_t)ds4_model_find(deq, name), NULL, &b, &err_unused), &err_unused);
            same += a.nbytes == b.nbytes && !memcmp(a.data, b.data, a.nbytes);
        }
        CHECK(same == 48, "expand_quantised (%s): %lld of 48 experts reload to the dequantised values",
              bf16 ? "BF16" : "F32", (long long)same);
        ds4_model_free(r);
    }
    printf("expand_quantised: the 48 FP4-resident experts written as F32 and as BF16 reload to the dequantised values "
           "bit for bit (F32: the same logits)\n");
    free(l0);
out:
    ds4_model_free(m);
    ds4_model_free(deq);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
        return 2;
    }
    g_fixtures = argv[1];
    snprintf(g_tmp, sizeof g_tmp, "/tmp/ds4_qsave_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    ds4_error err = {0};
    ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &g_eng, &err), &err);
    if (g_eng) {
        test_roundtrip("quant_official", 0);
        test_roundtrip("quant_official", 1);
        test_roundtrip("quant_hf", 0);
        test_roundtrip("quant_fp4", 1);
        test_trained(0);
        test_trained(1);
        test_expand();
        ds4_engine_free(g_eng);
    }
    ds4t_rm_rf(g_tmp);
    return ds4t_finish("test_quant_save");
}
