/* train_lua.c — training from Lua: gradients, the training forward, backward, and the AdamW optimizer.
 *
 *   model:zero_grad()                 enable gradients (first call) and clear them
 *   model:forward(ids, {labels = ...}) on a model with gradients enabled is a training forward: it keeps the
 *                                     activations that model:backward() needs (opts.train = false forces an
 *                                     inference forward; opts.train = true enables gradients itself)
 *   model:backward([scale])           gradient of scale · Σ per-token CE of the last training forward, added to
 *                                     the gradients; scale defaults to 1 / loss_tokens (the mean loss)
 *   model:backward{ce = s, mtp = s2, ikl = s3}   each loss part with its own factor (ds4_model_backward_scaled:
 *                                     ce per scored token, mtp per MTP-scored token, ikl per indexer query; mtp /
 *                                     ikl left out: their defaults), for means over a global batch
 *                                     (docs/distributed.md, "Loss normalisation")
 *   model:grads()                     {name = F32 tensor}: copies of the gradients of every fp32 parameter
 *   ds4.adamw(model, opts)            optimizer: opt:step() -> {lr, grad_norm, step}, opt:lr(), opt:steps()
 *
 * Which training forward model:backward() differentiates is tracked per model in a weak-keyed registry table
 * (model userdata -> loss_tokens of its last training forward), so that the default scale is known and a
 * second backward of the same forward (which would count its gradient twice) is an error, as in torch. A
 * forward whose loss came out NaN or infinite is recorded as the loss's text instead: backward refuses it
 * rather than fill the gradients with non-finite values.
 *
 * The optimizer userdata keeps its model alive through its environment table, so a collection never frees the
 * model first. ds4_adamw_free reads the model (it hands back the moments a device held for it), so an explicit
 * model:free() first frees the C optimizers of that model (a registry table lists them), which then raise "model
 * has been freed"; every other optimizer call checks that the model has not been freed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"

#define ADAMW_MT "ds4.adamw"
#define PENDING_KEY "ds4.train.pending" /* weak-keyed: model -> loss_tokens of its last training forward, or the */
                                        /* text of its loss ("nan", "inf") when that was not finite */

/* ------------------------------------------------------------------------------------------------ helpers */

static int abs_index(lua_State *L, int idx) {
    return idx < 0 && idx > LUA_REGISTRYINDEX ? lua_gettop(L) + idx + 1 : idx;
}

static void push_pending(lua_State *L) { lua_getfield(L, LUA_REGISTRYINDEX, PENDING_KEY); }

/* Record (loss_tokens >= 0) or clear (loss_tokens < 0) the pending training forward of the model at idx. */
static void set_pending(lua_State *L, int model_idx, double loss_tokens) {
    model_idx = abs_index(L, model_idx);
    push_pending(L);
    lua_pushvalue(L, model_idx);
    if (loss_tokens >= 0) lua_pushnumber(L, loss_tokens);
    else lua_pushnil(L);
    lua_rawset(L, -3);
    lua_pop(L, 1);
}

/* ------------------------------------------------------------------------------------------------ forward */

ds4_status ds4l_train_forward(lua_State *L, int model_idx, int opts_idx, ds4_model *m, const ds4_forward_args *args,
                              ds4_forward_result *res, ds4_error *err) {
    const char *fname = "ds4.model:forward";
    model_idx = abs_index(L, model_idx);
    int train = -1; /* -1: automatic (gradients enabled and labels given) */
    train = ds4l_opt_bool(L, opts_idx, "train", train, fname);
    if (train == 1) {
        if (!args->labels)
            ds4l_raise(L, "%s: opts.train = true needs opts.labels (the loss to differentiate), ids [%lld, %lld]",
                       fname, (long long)args->batch, (long long)args->seq);
        if (ds4_model_enable_grad(m, err) != DS4_OK) return err->code;
    }
    if (train == -1) train = args->labels && ds4_model_grad_enabled(m);
    if (!train) return ds4_model_forward(m, args, res, err);
    /* The previous training forward's activations are being replaced: forget it first, so that a failed
     * forward leaves nothing to differentiate. */
    set_pending(L, model_idx, -1);
    ds4_status s = ds4_model_forward_train(m, args, res, err);
    if (s == DS4_OK && res->loss_tokens > 0 && !isfinite(res->loss)) {
        push_pending(L);
        lua_pushvalue(L, model_idx);
        lua_pushfstring(L, "%s", isnan(res->loss) ? "nan" : res->loss > 0 ? "inf" : "-inf");
        lua_rawset(L, -3);
        lua_pop(L, 1);
    } else if (s == DS4_OK) {
        set_pending(L, model_idx, (double)res->loss_tokens);
    }
    return s;
}

/* ------------------------------------------------------------------------------------------------ model methods */

/* Raise when the pending training forward of the model at slot 1 had a non-finite loss (and forget it: the next
 * training forward replaces it anyway). */
static void check_finite_forward(lua_State *L, const char *fname) {
    push_pending(L);
    lua_pushvalue(L, 1);
    lua_rawget(L, -2);
    if (lua_type(L, -1) != LUA_TSTRING) {
        lua_pop(L, 2);
        return;
    }
    char loss[16];
    snprintf(loss, sizeof loss, "%s", lua_tostring(L, -1));
    lua_pop(L, 2);
    set_pending(L, 1, -1);
    ds4l_raise(L, "%s: the last training forward's loss is %s: its gradient would not be finite (check the inputs, "
                  "the labels and the weights)", fname, loss);
}

static int m_zero_grad(lua_State *L) {
    const char *fname = "ds4.model:zero_grad";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    ds4_error err = {0};
    if (ds4_model_enable_grad(m, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    ds4_model_zero_grad(m);
    return 0;
}

static int m_backward(lua_State *L) {
    const char *fname = "ds4.model:backward";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int explicit_scale = !lua_isnoneornil(L, 2);
    double scale = 0;
    ds4_backward_scales sc = {.ce = 0, .mtp = -1, .ikl = -1};
    const int parts = lua_type(L, 2) == LUA_TTABLE;
    if (parts) {
        static const char *const known[] = {"ce", "mtp", "ikl", NULL};
        double *dst[] = {&sc.ce, &sc.mtp, &sc.ikl};
        for (lua_pushnil(L); lua_next(L, 2); lua_pop(L, 1)) {
            const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
            int i = 0;
            while (k && known[i] && strcmp(k, known[i]) != 0) i++;
            if (!k || !known[i] || lua_type(L, -1) != LUA_TNUMBER)
                ds4l_raise(L, "%s: scales: unknown or mistyped field %s (known: ce, mtp, ikl = number)", fname,
                           k ? lua_pushfstring(L, "'%s'", k) : luaL_typename(L, -2));
            *dst[i] = lua_tonumber(L, -1);
        }
        lua_getfield(L, 2, "ce");
        if (lua_isnil(L, -1)) ds4l_raise(L, "%s: scales need ce (the factor of the cross-entropy sum)", fname);
        lua_pop(L, 1);
    } else if (explicit_scale) {
        if (lua_type(L, 2) != LUA_TNUMBER)
            ds4l_raise(L, "%s: bad argument #1 (scale number expected, got %s)", fname, luaL_typename(L, 2));
        scale = lua_tonumber(L, 2);
        if (!isfinite(scale)) ds4l_raise(L, "%s: scale %g is not finite", fname, scale);
    }
    check_finite_forward(L, fname);
    push_pending(L);
    lua_pushvalue(L, 1);
    lua_rawget(L, -2);
    int have = lua_type(L, -1) == LUA_TNUMBER;
    double tokens = have ? lua_tonumber(L, -1) : 0;
    lua_pop(L, 2);
    if (!have)
        ds4l_raise(L,
                   "%s: no training forward to differentiate (call model:zero_grad(), then model:forward(ids, "
                   "{labels = ...}); each training forward can be back-propagated once)",
                   fname);
    if (!explicit_scale && !parts) {
        if (!(tokens > 0))
            ds4l_raise(L, "%s: the last training forward scored no token (every label is -100); pass an explicit "
                          "scale", fname);
        scale = 1.0 / tokens;
    }
    ds4_error err = {0};
    if (!parts) sc.ce = scale;
    if (ds4_model_backward_scaled(m, &sc, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    set_pending(L, 1, -1);
    return 0;
}

/* model:grads([{canonical = true}]) -> {name = F32 tensor}, keyed by the tensor names of the checkpoint the model
 * was loaded from (official, save_pretrained or HF module spelling), so a gradient can be matched with the file
 * the user has; HF's packed experts come back packed ([E, 2I, D] gate_up_proj, [E, D, I] down_proj).
 * {canonical = true}, or a model that was not loaded, gives the canonical official names (model:tensors()).
 * Integer tables (tid2eid) have no gradient and are left out; so are, with sharded experts (expert parallelism), the
 * routed experts other ranks hold (zeros in a packed HF experts tensor). */
static int m_grads(lua_State *L) {
    const char *fname = "ds4.model:grads";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int canonical = 0;
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        lua_getfield(L, 2, "canonical");
        canonical = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    ds4_error serr = {0};
    if (ds4_model_host_sync(m, &serr) != DS4_OK) ds4l_raise_ds4(L, fname, &serr);
    const float *g = ds4_model_grads(m);
    if (!g) ds4l_raise(L, "%s: gradients are not enabled (call model:zero_grad() first)", fname);
    const ds4_config *c = ds4_model_config(m);
    const int64_t E = c->n_routed_experts, I = c->moe_intermediate_size, D = c->hidden_size;
    size_t n = ds4_model_tensor_count(m);
    lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
    int tbl = lua_gettop(L);
    for (size_t i = 0; i < n; i++) {
        const char *name = NULL;
        ds4_tensor view;
        ds4_tensor_info ti;
        ds4_error err = {0};
        if (ds4_model_tensor_info(m, i, &ti, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        if (!ti.is_param || ti.elsewhere) continue; /* elsewhere: another rank's expert (sharded experts) */
        if (ds4_model_tensor_at(m, i, &name, &view, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
        int32_t part = 0;
        int64_t expert = 0;
        const char *src = canonical ? NULL : ds4_model_tensor_source(m, i, &part, &expert);
        const char *key = src ? src : name;
        if (part == 0) {
            ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_F32, view.ndim, view.shape);
            if ((int64_t)(t->nbytes / sizeof(float)) != ti.numel)
                ds4l_raise(L, "%s: tensor %s: %lld gradient entries, %zu expected from its shape", fname, name,
                           (long long)ti.numel, t->nbytes / sizeof(float));
            if (t->nbytes) memcpy(t->data, g + ti.offset, t->nbytes);
            lua_setfield(L, tbl, key);
            continue;
        }
        /* a slice of a packed HF experts tensor: create it on first sight, then fill expert `expert`'s rows */
        lua_getfield(L, tbl, key);
        ds4_tensor *t = ds4l_tensor_test(L, -1);
        if (!t) {
            lua_pop(L, 1);
            const int64_t shape[3] = {E, part == 2 ? D : 2 * I, part == 2 ? I : D};
            t = ds4l_tensor_push_new(L, fname, DS4_F32, 3, shape);
            lua_pushvalue(L, -1);
            lua_setfield(L, tbl, key);
        }
        const int64_t per_expert = (part == 2 ? D * I : 2 * I * D);
        if (expert < 0 || expert >= E || ti.numel != (part == 2 ? D * I : I * D))
            ds4l_raise(L, "%s: tensor %s: packed slice %lld of %s does not fit [%lld experts]", fname, name,
                       (long long)expert, key, (long long)E);
        float *dst = (float *)t->data + expert * per_expert + (part == 3 ? I * D : 0);
        memcpy(dst, g + ti.offset, (size_t)ti.numel * sizeof(float));
        lua_pop(L, 1);
    }
    return 1;
}

/* model:logprobs([{entropy = true}]) -> logp [B, S] (, entropy [B, S]) of the last training forward:
 * logp[b][s] = log p(labels[b][s+1]), 0 where unscored (context parallelism: [B, n_r], this rank's positions). Does
 * not consume the forward. */
static int m_logprobs(lua_State *L) {
    const char *fname = "ds4.model:logprobs";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int want_entropy = 0;
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        lua_getfield(L, 2, "entropy");
        want_entropy = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    int64_t shape[2];
    ds4_error err = {0};
    if (ds4_model_last_batch(m, &shape[0], &shape[1], &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    ds4_tensor *lp = ds4l_tensor_push_new(L, fname, DS4_F32, 2, shape);
    ds4_tensor *en = want_entropy ? ds4l_tensor_push_new(L, fname, DS4_F32, 2, shape) : NULL;
    if (ds4_model_logprobs(m, lp->data, en ? en->data : NULL, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return want_entropy ? 2 : 1;
}

/* model:backward_logprobs(g [, {ikl = s}]): g is an F32 tensor [B, S] of dLoss/dlogp per position, for the loss the
 * optimizer MINIMISES (ignored where unscored): the gradients get sum g[b][s] * d logp[b][s] / d theta added. The SFT
 * mean loss -mean(logp) is g = -1/N on every scored position (tests/lua/test_train.lua checks that against torch).
 * ikl: the indexer KL loss's per-query factor (indexer_kl / the global query count; default: its own count).
 * Consumes the training forward, like model:backward. */
static int m_backward_logprobs(lua_State *L) {
    const char *fname = "ds4.model:backward_logprobs";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    ds4_tensor *g = ds4l_tensor_check(L, 2, fname, 1);
    int64_t B, S;
    ds4_error err = {0};
    if (ds4_model_last_batch(m, &B, &S, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    check_finite_forward(L, fname);
    if (g->dtype != DS4_F32 || ds4_tensor_numel(g) != B * S) {
        char sh[96];
        ds4l_format_shape(sh, sizeof sh, g->ndim, g->shape);
        ds4l_raise(L, "%s: gradient must be an F32 tensor of %lld x %lld values (the last forward's ids), got %s %s",
                   fname, (long long)B, (long long)S, ds4_dtype_name(g->dtype), sh);
    }
    const int opts = ds4l_opt_table(L, 3, fname, 2);
    static const char *const known[] = {"ikl", NULL};
    ds4l_check_keys(L, opts, fname, known);
    const double ikl = ds4l_opt_num(L, opts, "ikl", -1, -HUGE_VAL, HUGE_VAL, "a number", fname);
    if (ds4_model_backward_logprobs_scaled(m, g->data, ikl, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    set_pending(L, 1, -1);
    return 0;
}

/* model:set_train_options{mtp_lambda = x, indexer_kl = k, router_bias_gamma = g, head_chunk = n, recompute = b}: the
 * MTP loss, the indexer KL loss, the aux-loss-free router-bias update applied after each opt:step(), the LM head's
 * chunk and per-block recomputation (ds4_train_options); an option left out is 0 / false. */
static int m_set_train_options(lua_State *L) {
    const char *fname = "ds4.model:set_train_options";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    const int opts = ds4l_check_opts(L, 2, fname, 1);
    static const char *const known[] = {"mtp_lambda", "router_bias_gamma", "indexer_kl", "head_chunk", "recompute",
                                        NULL};
    ds4l_check_keys(L, opts, fname, known);
    const double inf = HUGE_VAL;
    ds4_train_options o = {
        .mtp_lambda = ds4l_opt_num(L, opts, "mtp_lambda", 0, -inf, inf, "a number", fname),
        .router_bias_gamma = ds4l_opt_num(L, opts, "router_bias_gamma", 0, -inf, inf, "a number", fname),
        .indexer_kl = ds4l_opt_num(L, opts, "indexer_kl", 0, -inf, inf, "a number", fname),
        .head_chunk = ds4l_opt_int(L, opts, "head_chunk", 0, 0, 1e9, "an integer in [0, 1e9] (0: the default)", fname),
        .recompute = ds4l_opt_bool(L, opts, "recompute", 0, fname)};
    ds4_error err = {0};
    if (ds4_model_set_train_options(m, &o, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 0;
}

/* model:train_options() -> the table set_train_options takes, as last set (so one option can change alone). */
static int m_train_options(lua_State *L) {
    const ds4_train_options o = ds4_model_train_options(ds4l_model_check(L, 1, "ds4.model:train_options"));
    lua_createtable(L, 0, 5);
    ds4l_set_num(L, "mtp_lambda", o.mtp_lambda);
    ds4l_set_num(L, "router_bias_gamma", o.router_bias_gamma);
    ds4l_set_num(L, "indexer_kl", o.indexer_kl);
    ds4l_set_int(L, "head_chunk", o.head_chunk);
    ds4l_set_bool(L, "recompute", o.recompute);
    return 1;
}

/* model:indexer_queries(lengths) -> the indexer KL loss's query count of rows of these real lengths (a table of
 * integers >= 0), as a training forward with those lengths reports it (ds4_model_indexer_queries): the Q of
 * micro-batches not yet run, for backward{ikl = indexer_kl / Q}. */
static int m_indexer_queries(lua_State *L) {
    const char *fname = "ds4.model:indexer_queries";
    const ds4_model *m = ds4l_model_check(L, 1, fname);
    if (!lua_istable(L, 2))
        ds4l_raise(L, "%s: bad argument #1 (a table of row lengths expected, got %s)", fname, luaL_typename(L, 2));
    const int64_t n = (int64_t)lua_objlen(L, 2);
    const int64_t *len = ds4l_check_int_list(L, 2, fname, "lengths", n, 0, 9007199254740992.0, "an integer >= 0");
    lua_pushinteger(L, (lua_Integer)ds4_model_indexer_queries(m, len, n));
    return 1;
}

/* ------------------------------------------------------------------------------------------------ optimizer */

typedef struct adamw_box {
    ds4_adamw *a;
    ds4_adamw_options o; /* as created: for opt:lr() and tostring */
    int model_freed;     /* a was freed by model:free() */
} adamw_box;

/* registry: model userdata -> {optimizer userdata = true}, weak keys at both levels */
#define OPTIMIZERS_KEY "ds4.optimizers_of_model"

static int adamw_gc(lua_State *L) {
    adamw_box *b = lua_touserdata(L, 1);
    if (b) {
        ds4_adamw_free(b->a);
        b->a = NULL;
    }
    return 0;
}

/* The optimizer at slot 1 (live), with its model checked to be alive too. */
static adamw_box *check_adamw(lua_State *L, const char *fname) {
    adamw_box *b = luaL_testudata(L, 1, ADAMW_MT);
    if (!b)
        ds4l_raise(L, "%s: self must be a ds4.adamw optimizer (got %s); call it as opt:method(...)", fname,
                   luaL_typename(L, 1));
    if (b->model_freed) ds4l_raise(L, "%s: model has been freed", fname);
    if (!b->a) ds4l_raise(L, "%s: optimizer has been freed", fname);
    lua_getfenv(L, 1);
    lua_getfield(L, -1, "model");
    ds4l_model_check(L, -1, fname); /* raises "model has been freed" after model:free() */
    lua_pop(L, 2);
    return b;
}

ds4_adamw *ds4l_adamw_check(lua_State *L, int idx, const char *fname) {
    lua_pushvalue(L, idx);
    lua_insert(L, 1);
    ds4_adamw *a = check_adamw(L, fname)->a;
    lua_remove(L, 1);
    return a;
}

static int o_step(lua_State *L) {
    const char *fname = "ds4.adamw:step";
    ds4_adamw *a = check_adamw(L, fname)->a;
    lua_getfenv(L, 1);
    lua_getfield(L, -1, "model");
    if (ds4l_model_busy(L, -1))
        ds4l_raise(L, "%s: the model is generating (called from an on_token callback?): an update now would make the "
                      "rest of that generation use other weights", fname);
    lua_pop(L, 2);
    ds4_adamw_stats st;
    ds4_error err = {0};
    if (ds4_adamw_step(a, &st, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_createtable(L, 0, 3);
    ds4l_set_num(L, "lr", st.lr);
    ds4l_set_num(L, "grad_norm", st.grad_norm);
    ds4l_set_int(L, "step", st.step);
    return 1;
}

/* The learning rate the next step will use. */
static int o_lr(lua_State *L) {
    adamw_box *b = check_adamw(L, "ds4.adamw:lr");
    lua_pushnumber(L, ds4_lr_at(&b->o, ds4_adamw_steps(b->a)));
    return 1;
}

static int o_steps(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_adamw_steps(check_adamw(L, "ds4.adamw:steps")->a));
    return 1;
}

/* opt:state() -> {m = F32 [n_params], v = F32 [n_params], tensor_steps = I64 [n_tensors], step = n}: copies of
 * everything an exact resume needs (the moments are parallel to the model's flat parameter buffer). A sharded
 * optimizer (ZeRO-1, ds4.dist.shard_optimizer) or one over sharded experts (expert parallelism) gathers every rank's
 * moments: every rank calls it together, and the state is the unsharded one, which any number of ranks can load. */
static int o_state(lua_State *L) {
    const char *fname = "ds4.adamw:state";
    adamw_box *b = check_adamw(L, fname);
    ds4_error err = {0};
    if (ds4_adamw_sync_state(b->a, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err); /* moments on a device */
    ds4_adamw_state st;
    ds4_adamw_get_state(b->a, &st);
    lua_createtable(L, 0, 4);
    const int64_t np[1] = {st.n_whole}, nt[1] = {(int64_t)st.n_tensors};
    ds4_tensor *tm = ds4l_tensor_push_new(L, fname, DS4_F32, 1, np);
    lua_setfield(L, -2, "m");
    ds4_tensor *tv = ds4l_tensor_push_new(L, fname, DS4_F32, 1, np);
    lua_setfield(L, -2, "v");
    if (ds4_adamw_gather_moments(b->a, tm->data, tv->data, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_I64, 1, nt);
    memcpy(t->data, st.tensor_steps, t->nbytes);
    lua_setfield(L, -2, "tensor_steps");
    ds4l_set_int(L, "step", *st.steps);
    return 1;
}

/* opt:load_state(state): the inverse of opt:state(), for an optimizer created with the same options over a
 * model of the same configuration (sharded or not, over any number of ranks: a sharded one keeps its region of the
 * whole moments). Sizes and dtypes are checked before anything is written. */
static int o_load_state(lua_State *L) {
    const char *fname = "ds4.adamw:load_state";
    adamw_box *b = check_adamw(L, fname);
    luaL_checktype(L, 2, LUA_TTABLE);
    ds4_adamw_state st;
    ds4_adamw_get_state(b->a, &st);
    const char *keys[3] = {"m", "v", "tensor_steps"};
    ds4_tensor *src[3];
    for (int i = 0; i < 3; i++) {
        lua_getfield(L, 2, keys[i]);
        src[i] = ds4l_tensor_test(L, -1);
        const int64_t want = i < 2 ? st.n_whole : (int64_t)st.n_tensors;
        const ds4_dtype dt = i < 2 ? DS4_F32 : DS4_I64;
        if (!src[i] || src[i]->dtype != dt || ds4_tensor_numel(src[i]) != want)
            ds4l_raise(L, "%s: state.%s must be a %s tensor of %lld elements", fname, keys[i], ds4_dtype_name(dt),
                       (long long)want);
        lua_pop(L, 1); /* the state table keeps the tensor alive */
    }
    lua_getfield(L, 2, "step");
    if (lua_type(L, -1) != LUA_TNUMBER || lua_tonumber(L, -1) < 0 || lua_tonumber(L, -1) != (int64_t)lua_tonumber(L, -1))
        ds4l_raise(L, "%s: state.step must be a non-negative integer", fname);
    const int64_t step = (int64_t)lua_tonumber(L, -1);
    lua_pop(L, 1);
    ds4_adamw_put_moments(b->a, src[0]->data, src[1]->data); /* this optimizer's part */
    memcpy(st.tensor_steps, src[2]->data, src[2]->nbytes);
    *st.steps = step;
    return 0;
}

static int o_free(lua_State *L) {
    adamw_box *b = luaL_testudata(L, 1, ADAMW_MT);
    if (!b) ds4l_raise(L, "ds4.adamw:free: self must be a ds4.adamw optimizer (got %s)", luaL_typename(L, 1));
    ds4_adamw_free(b->a);
    b->a = NULL;
    b->model_freed = 0; /* from now on: "optimizer has been freed" */
    return 0;
}

static int o_tostring(lua_State *L) {
    adamw_box *b = lua_touserdata(L, 1);
    if (!b || !b->a) {
        lua_pushliteral(L, "ds4.adamw (freed)");
        return 1;
    }
    const ds4_adamw_options *o = &b->o;
    static const char *const sched[] = {"constant", "linear", "cosine"};
    char buf[256];
    snprintf(buf, sizeof buf, "ds4.adamw (lr %g, %s schedule, %lld steps done)", o->lr,
             (unsigned)o->schedule < 3 ? sched[o->schedule] : "?", (long long)ds4_adamw_steps(b->a));
    lua_pushstring(L, buf);
    return 1;
}

/* ds4.adamw(model [, opts]): defaults as torch.optim.AdamW (lr 1e-3, betas {0.9, 0.999}, eps 1e-8,
 * weight_decay 0.01), no clipping, constant schedule without warm-up. */
static int l_adamw(lua_State *L) {
    const char *fname = "ds4.adamw";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"lr", "betas", "eps", "weight_decay", "clip", "schedule", "warmup",
                                        "total", "min_lr_ratio", "zero_grad", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 2);
    ds4_adamw_options o = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01,
                           .schedule = DS4_LR_CONSTANT};
    if (opts) { /* the ranges are ds4_adamw_create's to check (its message names the value) */
        const double inf = HUGE_VAL, n = DS4L_MAX_EXACT;
        o.lr = ds4l_opt_num(L, opts, "lr", o.lr, -inf, inf, "a number", fname);
        o.eps = ds4l_opt_num(L, opts, "eps", o.eps, -inf, inf, "a number", fname);
        o.weight_decay = ds4l_opt_num(L, opts, "weight_decay", o.weight_decay, -inf, inf, "a number", fname);
        o.clip = ds4l_opt_num(L, opts, "clip", 0, -inf, inf, "a number", fname);
        o.warmup_steps = ds4l_opt_int(L, opts, "warmup", 0, -n, n, "an integer", fname);
        o.total_steps = ds4l_opt_int(L, opts, "total", 0, -n, n, "an integer", fname);
        o.min_lr_ratio = ds4l_opt_num(L, opts, "min_lr_ratio", 0, -inf, inf, "a number", fname);
        o.zero_grad = ds4l_opt_bool(L, opts, "zero_grad", 0, fname);
        lua_getfield(L, opts, "betas");
        if (!lua_isnil(L, -1)) {
            if (!lua_istable(L, -1) || lua_objlen(L, -1) != 2)
                ds4l_raise(L, "%s: opts.betas must be a table of two numbers {beta1, beta2}, got %s", fname,
                           lua_istable(L, -1) ? "a table of another length" : luaL_typename(L, -1));
            for (int i = 1; i <= 2; i++) {
                lua_rawgeti(L, -1, i);
                if (lua_type(L, -1) != LUA_TNUMBER)
                    ds4l_raise(L, "%s: opts.betas[%d] must be a number, got %s", fname, i, luaL_typename(L, -1));
                *(i == 1 ? &o.beta1 : &o.beta2) = lua_tonumber(L, -1);
                lua_pop(L, 1);
            }
        }
        lua_pop(L, 1);
        lua_getfield(L, opts, "schedule");
        if (!lua_isnil(L, -1)) {
            const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            if (s && strcmp(s, "constant") == 0) o.schedule = DS4_LR_CONSTANT;
            else if (s && strcmp(s, "linear") == 0) o.schedule = DS4_LR_LINEAR;
            else if (s && strcmp(s, "cosine") == 0) o.schedule = DS4_LR_COSINE;
            else
                ds4l_raise(L, "%s: opts.schedule must be \"constant\", \"linear\" or \"cosine\", got %s%s%s", fname,
                           s ? "\"" : "", s ? s : luaL_typename(L, -1), s ? "\"" : "");
        }
        lua_pop(L, 1);
    }
    /* Box first (see ds4lua.h), then create into it. */
    adamw_box *b = ds4l_push_model_owned(L, sizeof *b, ADAMW_MT, 1);
    b->o = o;
    ds4_error err = {0};
    if (ds4_adamw_create(m, &o, &b->a, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    int box = lua_gettop(L);
    lua_getfield(L, LUA_REGISTRYINDEX, OPTIMIZERS_KEY);
    lua_pushvalue(L, 1);
    lua_rawget(L, -2);
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_createtable(L, 0, 1);
        lua_pushliteral(L, "k");
        lua_setfield(L, -2, "__mode");
        lua_setmetatable(L, -2);
        lua_pushvalue(L, 1);
        lua_pushvalue(L, -2);
        lua_rawset(L, -4);
    }
    lua_pushvalue(L, box);
    lua_pushboolean(L, 1);
    lua_rawset(L, -3);
    lua_settop(L, box);
    return 1;
}

/* model:free(): the model's optimizers first (see the top of this file), then the original free (upvalue 1). */
static int m_free_optimizers_first(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, OPTIMIZERS_KEY);
    lua_pushvalue(L, 1);
    lua_rawget(L, -2);
    if (lua_istable(L, -1)) {
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            lua_pop(L, 1);
            adamw_box *b = luaL_testudata(L, -1, ADAMW_MT);
            if (b && b->a) {
                ds4_adamw_free(b->a);
                b->a = NULL;
                b->model_freed = 1;
            }
        }
    }
    lua_pop(L, 2);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* model:router_loads() -> I64 tensor [L + 1, E] (a copy): the expert loads counted by training forwards since the
 * last router-bias update (layers 0..L-1, then the MTP block); nil before the first training forward. With expert
 * parallelism on they are this rank's tokens' (the bias update sums them over the ranks). */
static int m_router_loads(lua_State *L) {
    const char *fname = "ds4.model:router_loads";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    const int64_t *loads = ds4_model_router_loads(m);
    if (!loads) {
        lua_pushnil(L);
        return 1;
    }
    const ds4_config *c = ds4_model_config(m);
    const int64_t shape[2] = {c->num_hidden_layers + 1, c->n_routed_experts};
    ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_I64, 2, shape);
    memcpy(t->data, loads, (size_t)(shape[0] * shape[1]) * sizeof(int64_t));
    return 1;
}

/* ------------------------------------------------------------------------------------------------ module */

static const luaL_Reg train_model_methods[] = {
    {"router_loads", m_router_loads},
    {"zero_grad", m_zero_grad},
    {"backward", m_backward},
    {"grads", m_grads},
    {"logprobs", m_logprobs},
    {"backward_logprobs", m_backward_logprobs},
    {"set_train_options", m_set_train_options},
    {"train_options", m_train_options},
    {"indexer_queries", m_indexer_queries},
    {NULL, NULL},
};

static const luaL_Reg adamw_methods[] = {
    {"step", o_step}, {"lr", o_lr}, {"steps", o_steps}, {"state", o_state}, {"load_state", o_load_state},
    {"free", o_free}, {NULL, NULL},
};

void ds4l_train_open(lua_State *L) {
    int mod = lua_gettop(L);
    lua_getfield(L, mod, "model_methods");
    if (!lua_istable(L, -1)) ds4l_raise(L, "ds4.core: internal error: model_methods missing when adding training");
    for (const luaL_Reg *r = train_model_methods; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_getfield(L, -1, "free");
    lua_pushcclosure(L, m_free_optimizers_first, 1);
    lua_setfield(L, -2, "free");
    lua_pop(L, 1);

    ds4l_weak_registry_table(L, PENDING_KEY, "k");
    ds4l_weak_registry_table(L, OPTIMIZERS_KEY, "k");
    ds4l_class(L, ADAMW_MT, adamw_methods, adamw_gc, o_tostring);
    lua_pop(L, 1);

    lua_pushcfunction(L, l_adamw);
    lua_setfield(L, mod, "adamw");
    lua_settop(L, mod);
}
