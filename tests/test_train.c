/* test_train.c — the model-level optimizer (ds4_adamw_* of ds4_train.h) and a 10-step training trajectory.
 *
 * 1. Trajectory: tests/fixtures/tiny_a/train.safetensors (tests/gen_fixtures.py train_fixture) records torch
 *    training transformers' model on the fixture batch: AdamW lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay
 *    0.1 except on norms/biases/sinks/mHC base+scale, clip_grad_norm_ 1.0, LambdaLR with 3 linear warm-up steps
 *    then cosine to 0.1·lr at step 10. Eleven losses (before each update and after the last) must agree to
 *    1e-5 relative (the bound; the forward alone agrees to ~1e-6, and ten updates of lr <= 1e-3
 *    compound differences of the fp32 gradients, ~1e-5 relative per tensor against autograd, only weakly into
 *    the loss), the ten pre-clip gradient norms to 1e-4 (a norm over 600k gradient entries carries the
 *    gradients' own ~1e-5..1e-4 relative difference from autograd's summation order).
 * 2. What the optimizer must leave alone: tensors that are not trainable (indexer, router bias, MTP block
 *    without its loss) are bit-identical after steps, with zero moments; with zero gradients one step scales
 *    decayed tensors by exactly fp32(1 - lr·wd) and leaves every other tensor bit-identical.
 * 3. The result does not depend on the engine's thread count (bitwise), option validation, a step without a
 *    gradient buffer, and a non-finite gradient (refused, nothing changed).
 * 4. The zero_grad option: a step leaves every gradient +0 (frozen tensors' too) and updates the weights as a step
 *    without it, bitwise; a refused step leaves the gradients as they were. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim.h"
#include "testlib.h"

static ds4_adamw_options fixture_opts(void) {
    return (ds4_adamw_options){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                               .clip = 1.0, .schedule = DS4_LR_COSINE, .warmup_steps = 3, .total_steps = 10,
                               .min_lr_ratio = 0.1};
}

static ds4_model *load_tiny(ds4_engine *e, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = NULL;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/tiny_a", fixtures);
    CHECK_OK(ds4_model_load(e, dir, &m, &err), &err);
    return m;
}

static int is_name(const char *name, const char *part) { return strstr(name, part) != NULL; }

/* ---------------------------------------------------------------------------------------- trajectory */

static void test_trajectory(ds4_engine *e, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = load_tiny(e, fixtures);
    ds4_st_file *io = NULL, *tr = NULL;
    ds4_adamw *opt = NULL;
    CHECK_OK(ds4_st_open(ds4t_path(fixtures, "tiny_a/io.safetensors"), &io, &err), &err);
    CHECK_OK(ds4_st_open(ds4t_path(fixtures, "tiny_a/train.safetensors"), &tr, &err), &err);
    if (!m || !io || !tr) goto out;
    const ds4_st_entry *ids = ds4_st_find(io, "input_ids"), *labels = ds4_st_find(io, "labels");
    const ds4_st_entry *rl = ds4_st_find(tr, "loss"), *rn = ds4_st_find(tr, "grad_norm"), *rlr = ds4_st_find(tr, "lr");
    CHECK(ids && labels && ids->dtype == DS4_I64 && labels->dtype == DS4_I64 && ids->ndim == 2,
          "io.safetensors: input_ids / labels I64 [B, S] expected");
    CHECK(rl && rn && rlr && rl->dtype == DS4_F64 && rl->shape[0] == 11 && rn->shape[0] == 10 && rlr->shape[0] == 10,
          "train.safetensors: loss F64 [11], grad_norm [10], lr [10] expected");
    if (!ids || !labels || !rl || !rn || !rlr || ids->dtype != DS4_I64 || labels->dtype != DS4_I64 || ids->ndim != 2 ||
        rl->dtype != DS4_F64 || rl->shape[0] != 11 || rn->shape[0] != 10 || rlr->shape[0] != 10)
        goto out;
    double ref_loss[11], ref_norm[10], ref_lr[10];
    memcpy(ref_loss, rl->data, sizeof ref_loss);
    memcpy(ref_norm, rn->data, sizeof ref_norm);
    memcpy(ref_lr, rlr->data, sizeof ref_lr);
    const int64_t B = ids->shape[0], S = ids->shape[1];
    int64_t *tok = malloc((size_t)(2 * B * S) * sizeof *tok);
    if (!tok) goto out;
    memcpy(tok, ids->data, (size_t)(B * S) * sizeof *tok);
    memcpy(tok + B * S, labels->data, (size_t)(B * S) * sizeof *tok);
    ds4_forward_args args = {.ids = tok, .batch = B, .seq = S, .labels = tok + B * S};

    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    ds4_adamw_options o = fixture_opts();
    CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
    double worst_loss = 0, worst_norm = 0;
    for (int k = 0; opt && k <= 10; k++) {
        ds4_forward_result res;
        memset(&res, 0, sizeof res);
        if (k == 10) { /* the loss after the last update: an inference forward is enough */
            CHECK_OK(ds4_model_forward(m, &args, &res, &err), &err);
        } else {
            ds4_model_zero_grad(m);
            ds4_status s = ds4_model_forward_train(m, &args, &res, &err);
            CHECK(s == DS4_OK, "step %d: forward_train: %s (%s)", k, ds4_status_name(s), err.msg);
            if (s) break;
        }
        double el = fabs(res.loss - ref_loss[k]) / fabs(ref_loss[k]);
        if (!(el <= worst_loss)) worst_loss = el;
        CHECK(el <= 1e-5, "loss %d: %.9g vs torch %.9g (rel %.3g > 1e-5)", k, res.loss, ref_loss[k], el);
        if (k == 10) break;
        CHECK(res.loss_tokens > 0, "step %d: no scored tokens", k);
        ds4_status s = ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err);
        CHECK(s == DS4_OK, "step %d: backward: %s (%s)", k, ds4_status_name(s), err.msg);
        if (s) break;
        ds4_adamw_stats st;
        CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
        double en = fabs(st.grad_norm - ref_norm[k]) / ref_norm[k];
        if (!(en <= worst_norm)) worst_norm = en;
        CHECK(en <= 1e-4, "step %d: grad norm %.9g vs torch %.9g (rel %.3g > 1e-4)", k, st.grad_norm, ref_norm[k],
              en);
        CHECK(fabs(st.lr - ref_lr[k]) <= 1e-15 * ref_lr[k], "step %d: lr %.17g vs torch %.17g", k, st.lr, ref_lr[k]);
        CHECK(st.step == k + 1 && ds4_adamw_steps(opt) == k + 1, "step %d: stats.step %lld, steps %lld", k,
              (long long)st.step, (long long)ds4_adamw_steps(opt));
        printf("  step %d: loss %.7f (torch %.7f)  grad norm %.6f (torch %.6f)  lr %.4g\n", k, res.loss, ref_loss[k],
               st.grad_norm, ref_norm[k], st.lr);
    }
    printf("  trajectory: losses max rel err %.3g (bound 1e-5), grad norms max rel err %.3g (bound 1e-4)\n",
           worst_loss, worst_norm);
    free(tok);
out:
    ds4_adamw_free(opt);
    ds4_st_close(io);
    ds4_st_close(tr);
    ds4_model_free(m);
}

/* ---------------------------------------------------------------------------------------- what is touched */

/* A copy of the parameter buffer. */
static float *snapshot(ds4_model *m) {
    int64_t P = ds4_model_param_count(m);
    float *c = malloc((size_t)P * sizeof *c);
    if (c) memcpy(c, ds4_model_params(m), (size_t)P * sizeof *c);
    return c;
}

static void fill_grads(ds4_model *m, uint64_t seed) {
    float *g = ds4_model_grads(m);
    int64_t P = ds4_model_param_count(m);
    for (int64_t i = 0; i < P; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (float)((double)(seed >> 40) / 16777216.0 - 0.5) * 0.01f;
    }
}

static void test_untouched(ds4_engine *e, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = load_tiny(e, fixtures);
    if (!m) return;
    ds4_adamw *opt = NULL;
    ds4_adamw_options o = fixture_opts();
    o.schedule = DS4_LR_CONSTANT;
    o.warmup_steps = 0;
    o.lr = 0.05; /* large, so a decay of 1 - 5e-3 is far from 1 in fp32 */
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    CHECK_OK(ds4_adamw_create(m, &o, &opt, &err), &err);
    float *before = snapshot(m);
    if (!opt || !before) goto out;
    const float *p = ds4_model_params(m);
    const size_t T = ds4_model_tensor_count(m);

    /* Zero gradients: Adam's update is exactly 0 (m = 0, so 0 / (0 + eps)), leaving the decay alone. */
    ds4_model_zero_grad(m);
    ds4_adamw_stats st;
    CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
    CHECK(st.grad_norm == 0, "zero gradients: norm %g", st.grad_norm);
    const float dm = (float)(1.0 - o.lr * o.weight_decay);
    int n_decay = 0, n_plain = 0, n_frozen = 0, bad = 0;
    for (size_t i = 0; i < T; i++) {
        ds4_tensor_info ti;
        const char *name = NULL;
        CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
        CHECK_OK(ds4_model_tensor_at(m, i, &name, NULL, &err), &err);
        if (!ti.is_param) continue;
        /* The expectations below are the rules, independent of how tensor_info derives them. */
        int frozen = is_name(name, ".indexer.") || is_name(name, ".gate.bias") || strncmp(name, "mtp.", 4) == 0;
        CHECK(ti.trainable == !frozen, "%s: trainable %d", name, ti.trainable);
        for (int64_t j = 0; j < ti.numel && bad < 5; j++) {
            float want = ti.trainable && ti.decay ? before[ti.offset + j] * dm : before[ti.offset + j];
            if (memcmp(&want, &p[ti.offset + j], sizeof want) != 0) {
                CHECK(0, "%s[%lld]: %.9g after a zero-gradient step, expected %.9g (trainable %d, decay %d)", name,
                      (long long)j, (double)p[ti.offset + j], (double)want, ti.trainable, ti.decay);
                bad++;
            }
        }
        if (!ti.trainable) n_frozen++;
        else if (ti.decay) n_decay++;
        else n_plain++;
    }
    CHECK(n_decay > 0 && n_plain > 0 && n_frozen > 0, "tensor classes: %d decayed, %d not decayed, %d frozen",
          n_decay, n_plain, n_frozen);
    printf("  zero-gradient step: %d decayed tensors scaled by fp32(1 - lr*wd), %d others and %d frozen unchanged\n",
           n_decay, n_plain, n_frozen);

    /* Random gradients everywhere (frozen tensors included: the optimizer must not read them): frozen tensors
     * stay bit-identical with zero moments; every trainable tensor moves. */
    memcpy(before, p, (size_t)ds4_model_param_count(m) * sizeof *before);
    for (int k = 0; k < 3; k++) {
        fill_grads(m, 100 + (uint64_t)k);
        CHECK_OK(ds4_adamw_step(opt, &st, &err), &err);
    }
    ds4_adamw_state state;
    ds4_adamw_get_state(opt, &state);
    CHECK(*state.steps == 4 && ds4_adamw_steps(opt) == 4, "steps %lld", (long long)ds4_adamw_steps(opt));
    for (size_t i = 0; i < T; i++) {
        ds4_tensor_info ti;
        const char *name = NULL;
        CHECK_OK(ds4_model_tensor_info(m, i, &ti, &err), &err);
        CHECK_OK(ds4_model_tensor_at(m, i, &name, NULL, &err), &err);
        if (!ti.is_param) continue;
        int same = memcmp(before + ti.offset, p + ti.offset, (size_t)ti.numel * sizeof *p) == 0;
        int zero_m = 1;
        for (int64_t j = 0; j < ti.numel; j++)
            if (state.m[ti.offset + j] != 0 || state.v[ti.offset + j] != 0) zero_m = 0;
        if (ti.trainable) {
            CHECK(!same && !zero_m, "%s: trainable but unchanged after 3 steps", name);
            CHECK(state.tensor_steps[i] == 4, "%s: tensor step %lld, expected 4", name, (long long)state.tensor_steps[i]);
        } else {
            CHECK(same && zero_m, "%s: not trainable but changed (params same %d, moments zero %d)", name, same, zero_m);
            CHECK(state.tensor_steps[i] == 0, "%s: frozen tensor step %lld", name, (long long)state.tensor_steps[i]);
        }
    }
out:
    free(before);
    ds4_adamw_free(opt);
    ds4_model_free(m);
}

/* ---------------------------------------------------------------------------------------- zero_grad option */

static int64_t nonzero_grads(ds4_model *m) {
    const float *g = ds4_model_grads(m);
    int64_t n = 0;
    for (int64_t i = 0; i < ds4_model_param_count(m); i++) n += g[i] != 0 || signbit(g[i]);
    return n;
}

static void test_zero_grad_option(ds4_engine *e, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *a = load_tiny(e, fixtures), *b = load_tiny(e, fixtures);
    ds4_adamw *oa = NULL, *ob = NULL;
    if (!a || !b) goto out;
    ds4_adamw_options o = fixture_opts();
    CHECK_OK(ds4_model_enable_grad(a, &err), &err);
    CHECK_OK(ds4_model_enable_grad(b, &err), &err);
    CHECK_OK(ds4_adamw_create(b, &o, &ob, &err), &err);
    o.zero_grad = 1;
    CHECK_OK(ds4_adamw_create(a, &o, &oa, &err), &err);
    if (!oa || !ob) goto out;
    const int64_t P = ds4_model_param_count(a);
    for (int k = 0; k < 3; k++) {
        fill_grads(a, 40 + (uint64_t)k), fill_grads(b, 40 + (uint64_t)k); /* frozen tensors' gradients too */
        ds4_adamw_stats sa, sb;
        CHECK_OK(ds4_adamw_step(oa, &sa, &err), &err);
        CHECK_OK(ds4_adamw_step(ob, &sb, &err), &err);
        CHECK(memcmp(ds4_model_params(a), ds4_model_params(b), (size_t)P * sizeof(float)) == 0 &&
                  sa.grad_norm == sb.grad_norm,
              "zero_grad: step %d updated the weights otherwise than a step without it", k);
        const int64_t nz = nonzero_grads(a);
        CHECK(nz == 0, "zero_grad: %lld of %lld gradients not +0 after step %d", (long long)nz, (long long)P, k);
        CHECK(nonzero_grads(b) > 0, "without zero_grad the clipped gradients stay (step %d)", k);
    }
    /* a refused step (a non-finite gradient) changes nothing, the gradients included */
    fill_grads(a, 50);
    ds4_model_grads(a)[777] = NAN;
    float *g = malloc((size_t)P * sizeof *g);
    if (g) memcpy(g, ds4_model_grads(a), (size_t)P * sizeof *g);
    CHECK(ds4_adamw_step(oa, NULL, &err) == DS4_ERR_ARG, "zero_grad: a NaN gradient must be refused");
    CHECK(g && memcmp(g, ds4_model_grads(a), (size_t)P * sizeof *g) == 0, "zero_grad: a refused step changed the "
                                                                          "gradients");
    free(g);
    printf("  zero_grad option: 3 steps bitwise as without it, every gradient +0 after each, a refused step kept them\n");
out:
    ds4_adamw_free(oa);
    ds4_adamw_free(ob);
    ds4_model_free(a);
    ds4_model_free(b);
}

/* ---------------------------------------------------------------------------------------- threads */

static void test_threads(const char *fixtures) {
    ds4_error err = {0};
    ds4_engine *e1 = NULL, *e4 = NULL;
    ds4_engine_options o1 = {.n_threads = 1}, o4 = {.n_threads = 4};
    CHECK_OK(ds4_engine_create(&o1, &e1, &err), &err);
    CHECK_OK(ds4_engine_create(&o4, &e4, &err), &err);
    ds4_model *a = e1 ? load_tiny(e1, fixtures) : NULL, *b = e4 ? load_tiny(e4, fixtures) : NULL;
    ds4_adamw *oa = NULL, *ob = NULL;
    ds4_adamw_options o = fixture_opts();
    if (!a || !b) goto out;
    CHECK_OK(ds4_model_enable_grad(a, &err), &err);
    CHECK_OK(ds4_model_enable_grad(b, &err), &err);
    CHECK_OK(ds4_adamw_create(a, &o, &oa, &err), &err);
    CHECK_OK(ds4_adamw_create(b, &o, &ob, &err), &err);
    if (!oa || !ob) goto out;
    for (int k = 0; k < 4; k++) {
        fill_grads(a, 7 + (uint64_t)k);
        fill_grads(b, 7 + (uint64_t)k);
        ds4_adamw_stats sa, sb;
        CHECK_OK(ds4_adamw_step(oa, &sa, &err), &err);
        CHECK_OK(ds4_adamw_step(ob, &sb, &err), &err);
        CHECK(sa.grad_norm == sb.grad_norm, "step %d: norm %.17g (1 thread) vs %.17g (4 threads)", k, sa.grad_norm,
              sb.grad_norm);
    }
    int64_t P = ds4_model_param_count(a);
    CHECK(memcmp(ds4_model_params(a), ds4_model_params(b), (size_t)P * sizeof(float)) == 0,
          "parameters after 4 steps differ between 1 and 4 threads");
    CHECK(memcmp(ds4_model_grads(a), ds4_model_grads(b), (size_t)P * sizeof(float)) == 0,
          "clipped gradients differ between 1 and 4 threads");
    printf("  optimizer on 1 vs 4 threads: bit-identical after 4 steps (%lld parameters)\n", (long long)P);
out:
    ds4_adamw_free(oa);
    ds4_adamw_free(ob);
    ds4_model_free(a);
    ds4_model_free(b);
    ds4_engine_free(e1);
    ds4_engine_free(e4);
}

/* ---------------------------------------------------------------------------------------- errors */

static void expect_create_error(ds4_model *m, ds4_adamw_options o, const char *needle) {
    ds4_error err = {0};
    ds4_adamw *a = NULL;
    ds4_status s = ds4_adamw_create(m, &o, &a, &err);
    CHECK(s == DS4_ERR_ARG && a == NULL && strstr(err.msg, needle) && strstr(err.msg, "adamw create"),
          "create with bad %s: status %s, message '%s'", needle, ds4_status_name(s), err.msg);
    ds4_adamw_free(a);
}

static void test_errors(ds4_engine *e, const char *fixtures) {
    ds4_error err = {0};
    ds4_model *m = load_tiny(e, fixtures);
    if (!m) return;
    ds4_adamw_options o = fixture_opts(), b;
    b = o, b.lr = -1, expect_create_error(m, b, "lr");
    b = o, b.lr = NAN, expect_create_error(m, b, "lr");
    b = o, b.beta1 = 1.0, expect_create_error(m, b, "betas");
    b = o, b.beta2 = -0.1, expect_create_error(m, b, "betas");
    b = o, b.eps = -1e-8, expect_create_error(m, b, "eps");
    b = o, b.weight_decay = -0.1, expect_create_error(m, b, "weight_decay");
    b = o, b.clip = INFINITY, expect_create_error(m, b, "clip");
    b = o, b.schedule = (ds4_lr_schedule)7, expect_create_error(m, b, "schedule");
    b = o, b.warmup_steps = -1, expect_create_error(m, b, "warmup_steps");
    b = o, b.min_lr_ratio = 1.5, expect_create_error(m, b, "min_lr_ratio");
    b = o, b.zero_grad = 2, expect_create_error(m, b, "zero_grad");
    b = o, b.total_steps = 3, expect_create_error(m, b, "total_steps (3) must exceed warmup_steps (3)");
    ds4_adamw *a = NULL;
    CHECK_STATUS(ds4_adamw_create(NULL, &o, &a, &err), DS4_ERR_ARG, &err);

    /* A step before gradients exist. */
    CHECK_OK(ds4_adamw_create(m, &o, &a, &err), &err);
    if (a) {
        ds4_status s = ds4_adamw_step(a, NULL, &err);
        CHECK(s == DS4_ERR_ARG && strstr(err.msg, "no gradient buffer"), "step without grads: %s '%s'",
              ds4_status_name(s), err.msg);
        CHECK(ds4_adamw_steps(a) == 0, "a failed step must not count");
        /* A non-finite gradient: refused, nothing changes. */
        CHECK_OK(ds4_model_enable_grad(m, &err), &err);
        fill_grads(m, 3);
        ds4_model_grads(m)[12345] = NAN;
        float *before = snapshot(m);
        ds4_adamw_stats st;
        s = ds4_adamw_step(a, &st, &err);
        CHECK(s == DS4_ERR_ARG && strstr(err.msg, "gradient norm") && strstr(err.msg, "unchanged"),
              "NaN gradient: %s '%s'", ds4_status_name(s), err.msg);
        CHECK(isnan(st.grad_norm), "NaN gradient: stats.grad_norm %g", st.grad_norm);
        CHECK(before && memcmp(before, ds4_model_params(m), (size_t)ds4_model_param_count(m) * sizeof(float)) == 0,
              "NaN gradient: parameters changed");
        CHECK(ds4_adamw_steps(a) == 0, "NaN gradient: step counted");
        ds4_adamw_state state;
        ds4_adamw_get_state(a, &state);
        int clean = 1;
        for (int64_t i = 0; i < state.n_params; i++)
            if (state.m[i] != 0 || state.v[i] != 0) clean = 0;
        CHECK(clean, "NaN gradient: moments changed");
        free(before);
        /* After repairing the gradient the optimizer works. */
        ds4_model_grads(m)[12345] = 0;
        CHECK_OK(ds4_adamw_step(a, &st, &err), &err);
        CHECK(st.step == 1 && fabs(st.lr - 1e-3 / 3) < 1e-18, "first good step: step %lld lr %g", (long long)st.step,
              st.lr);
    }
    ds4_adamw_free(a);
    ds4_adamw_free(NULL);
    CHECK(ds4_adamw_steps(NULL) == 0, "steps of NULL");
    CHECK_STATUS(ds4_adamw_step(NULL, NULL, &err), DS4_ERR_ARG, &err);
    ds4_model_free(m);
}

int main(int argc, char **argv) {
    const char *fixtures = argc > 1 ? argv[1] : "tests/fixtures";
    ds4_error err = {0};
    ds4_engine *e = NULL;
    ds4_engine_options eo = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&eo, &e, &err), &err);
    if (!e) return ds4t_finish("test_train");
    test_errors(e, fixtures);
    test_untouched(e, fixtures);
    test_zero_grad_option(e, fixtures);
    test_threads(fixtures);
    test_trajectory(e, fixtures);
    ds4_engine_free(e);
    return ds4t_finish("test_train");
}
