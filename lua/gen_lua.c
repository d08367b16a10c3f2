/* gen_lua.c — generation from Lua: caches, incremental steps, sampling and batched generation
 * (C contract: core/include/ds4_gen.h).
 *
 *   model:generate(prompts [, opts])  -> res: res[(p-1)*n + s] = {ids, logprobs, sample_logprobs, finish_reason,
 *                                        stop, prompt_index, sample_index, prompt_len, experts, index_picks};
 *                                        res.stats = {prefill_tokens, decode_tokens, ...}
 *   model:new_cache(max_len)          -> ds4.cache: c:len() c:capacity() c:bytes() c:reset() c:copy_from(o)
 *                                        c:free()
 *   model:step(caches, ids [, opts])  -> {logits, experts, index_picks}
 *   ds4.sample(logits, params, u)     -> id, lp_model, lp_sample
 *   ds4.sample_uniform(seed, stream, step) -> u in [0, 1)
 *   ds4.is_cache(x)
 *
 * Ownership (see ds4lua.h): every array handed to the C core is scratch from lua_newuserdata, left on the Lua
 * stack for the duration of the call; the ds4_gen_result is boxed in a userdata with a __gc before ds4_generate
 * fills it, and caches live in boxes with a __gc. Prompt ids and stop strings are copied into that scratch,
 * never pointed at in Lua values, because on_token runs arbitrary Lua while ds4_generate still reads them.
 *
 * on_token runs while ds4_generate is on the C stack: a Lua error must never longjmp across it. The callback
 * calls the Lua function with lua_pcall; an error is stashed in a stack slot of model:generate, the generation is
 * cancelled, and once ds4_generate has returned and its result is freed the stashed value is raised again (the
 * same value: a message keeps its text, an error object its identity). Returning false (exactly false) cancels;
 * on_token still sees the other tokens sampled in that same step, so what it saw is what the result holds.
 *
 * Ctrl-C: the host stores a lightuserdata to its interrupt flag under DS4L_INTERRUPT_KEY (lua/main.c); it is
 * passed as ds4_gen_args.cancel, read and never cleared here.
 *
 * One step or forward of a model at a time (ds4_gen.h): while a generation runs, its model is marked busy in a
 * weak registry table; model:generate / model:step and the model methods that run or change the model (free,
 * forward, the training calls) raise instead of re-entering it from an on_token callback.
 *
 * A cache keeps its model alive through its environment table ({model = <ds4.model>}); every cache method checks
 * that the model has not been freed with model:free(). The __gc is safe in any order: ds4_cache_free does not
 * touch the model (core/cache.c), so a cache collected after its model (model:free(), or both unreachable in one
 * cycle) is still freed cleanly. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"

#define CACHE_MT "ds4.cache"
#define GENRES_MT "ds4.gen_result"
#define BUSY_KEY "ds4.gen.busy" /* weak table: model userdata -> run record (gen_ctx) of its running generation */

/* ------------------------------------------------------------------------------------------------ helpers */

static int abs_index(lua_State *L, int idx) {
    return idx < 0 && idx > LUA_REGISTRYINDEX ? lua_gettop(L) + idx + 1 : idx;
}

/* ------------------------------------------------------------------------------------------------ busy models */

/* The record of one model:generate call; lives in a scratch userdata on that call's stack. */
typedef struct gen_ctx {
    lua_State *L;
    int fn_slot;  /* stack slot of opts.on_token (0: none) */
    int err_slot; /* stack slot that receives an error raised by on_token */
    int failed;   /* on_token raised: the error waits in err_slot */
    int running;  /* ds4_generate is on the C stack */
} gen_ctx;

/* True when the model userdata at idx has a generation running (we are inside its on_token). */
static int model_busy(lua_State *L, int idx) {
    idx = abs_index(L, idx);
    lua_getfield(L, LUA_REGISTRYINDEX, BUSY_KEY);
    if (!lua_istable(L, -1)) {
        lua_pop(L, 1);
        return 0;
    }
    lua_pushvalue(L, idx);
    lua_rawget(L, -2);
    const gen_ctx *g = lua_touserdata(L, -1);
    int busy = g && g->running;
    lua_pop(L, 2);
    return busy;
}

int ds4l_model_busy(lua_State *L, int idx) { return model_busy(L, idx); }

static void check_not_busy(lua_State *L, int model_idx, const char *fname) {
    if (model_busy(L, model_idx))
        ds4l_raise(L, "%s: the model is generating (called from an on_token callback?); one step, forward or "
                      "generation of a model at a time",
                   fname);
}

/* A model method wrapped so that it raises while its model generates (upvalues: the original, its name). */
static int guarded_method(lua_State *L) {
    if (model_busy(L, 1))
        ds4l_raise(L, "ds4.model:%s: the model is generating (called from an on_token callback?); one step, "
                      "forward or generation of a model at a time",
                   lua_tostring(L, lua_upvalueindex(2)));
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* ------------------------------------------------------------------------------------------------ token ids */

/* Length of the id sequence at idx: a Lua array of integers or a 1-D integer-valued ds4 tensor. `what` names it
 * in errors ("prompts[2]"). */
static int64_t id_seq_len(lua_State *L, int idx, const char *fname, const char *what) {
    ds4_tensor *t = ds4l_tensor_test(L, idx);
    if (t) {
        char sh[128];
        ds4l_format_shape(sh, sizeof sh, t->ndim, t->shape);
        if (t->ndim != 1)
            ds4l_raise(L, "%s: %s must be a 1-D tensor of token ids [S], got shape %s", fname, what, sh);
        if (t->dtype == DS4_BOOL) ds4l_raise(L, "%s: %s must hold integer token ids, got dtype BOOL", fname, what);
        if (t->shape[0] < 1) ds4l_raise(L, "%s: %s is empty (shape %s)", fname, what, sh);
        return t->shape[0];
    }
    if (!lua_istable(L, idx))
        ds4l_raise(L, "%s: %s must be an array of token ids or a 1-D integer ds4.tensor, got %s", fname, what,
                   luaL_typename(L, idx));
    int64_t n = (int64_t)lua_objlen(L, idx);
    if (n < 1) ds4l_raise(L, "%s: %s is empty (at least one token id is needed)", fname, what);
    return n;
}

/* Copy the n ids at idx (checked by id_seq_len) into dst, each an integer in [0, V). */
static void id_seq_fill(lua_State *L, int idx, int64_t n, int64_t V, int64_t *dst, const char *fname,
                        const char *what) {
    ds4_tensor *t = ds4l_tensor_test(L, idx);
    for (int64_t i = 0; i < n; i++) {
        double v;
        if (t) {
            v = ds4_tensor_get(t, i);
        } else {
            lua_rawgeti(L, idx, (int)(i + 1));
            int ty = lua_type(L, -1);
            v = lua_tonumber(L, -1);
            if (ty != LUA_TNUMBER) {
                char vb[96];
                ds4l_raise(L, "%s: %s[%lld] must be a token id, got %s", fname, what, (long long)(i + 1),
                           ds4l_value_str(L, -1, vb, sizeof vb));
            }
            lua_pop(L, 1);
        }
        if (!(v == floor(v)) || !(v >= 0) || !(v < (double)V))
            ds4l_raise(L, "%s: %s[%lld] = %.17g is not a token id (vocabulary size %lld)", fname, what,
                       (long long)(i + 1), v, (long long)V);
        dst[i] = (int64_t)v;
    }
}

/* ------------------------------------------------------------------------------------------------ caches */

typedef struct cache_box {
    ds4_cache *c;
    const ds4_model *m; /* the model it was made for (kept alive by the environment table) */
} cache_box;

static int cache_gc(lua_State *L) {
    cache_box *b = lua_touserdata(L, 1);
    if (b) {
        ds4_cache_free(b->c);
        b->c = NULL;
    }
    return 0;
}

/* The cache box at idx (live or freed), or NULL when the value is not a cache. */
static cache_box *cache_test(lua_State *L, int idx) { return luaL_testudata(L, idx, CACHE_MT); }

/* Push the model userdata that owns the cache at idx. */
static void push_cache_model(lua_State *L, int idx) {
    lua_getfenv(L, idx);
    lua_getfield(L, -1, "model");
    lua_remove(L, -2);
}

/* The live cache at idx whose model is alive too; `what` names the value in errors. */
static cache_box *cache_check(lua_State *L, int idx, const char *fname, const char *what) {
    cache_box *b = cache_test(L, idx);
    if (!b) ds4l_raise(L, "%s: %s must be a ds4.cache (model:new_cache(max_len)), got %s", fname, what, luaL_typename(L, idx));
    if (!b->c) ds4l_raise(L, "%s: %s has been freed", fname, what);
    push_cache_model(L, idx);
    ds4_model *m = ds4l_model_check(L, -1, fname); /* raises "model has been freed" */
    lua_pop(L, 1);
    if (m != b->m) ds4l_raise(L, "%s: internal error: %s's model changed", fname, what);
    return b;
}

static int c_len(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_cache_len(cache_check(L, 1, "ds4.cache:len", "self")->c));
    return 1;
}

static int c_capacity(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_cache_capacity(cache_check(L, 1, "ds4.cache:capacity", "self")->c));
    return 1;
}

static int c_bytes(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds4_cache_bytes(cache_check(L, 1, "ds4.cache:bytes", "self")->c));
    return 1;
}

static int c_reset(lua_State *L) {
    const char *fname = "ds4.cache:reset";
    cache_box *b = cache_check(L, 1, fname, "self");
    ds4_cache_reset(b->c);
    lua_settop(L, 1);
    return 1;
}

/* c:copy_from(other): c becomes the same state as other (same model; c's capacity must hold other's length). */
static int c_copy_from(lua_State *L) {
    const char *fname = "ds4.cache:copy_from";
    cache_box *dst = cache_check(L, 1, fname, "self");
    cache_box *src = cache_check(L, 2, fname, "argument #1");
    push_cache_model(L, 1);
    push_cache_model(L, 2);
    if (!lua_rawequal(L, -1, -2)) ds4l_raise(L, "%s: the caches belong to different models", fname);
    lua_pop(L, 2);
    if (ds4_cache_len(src->c) > ds4_cache_capacity(dst->c))
        ds4l_raise(L, "%s: the source holds %lld positions, more than this cache's capacity %lld", fname,
                   (long long)ds4_cache_len(src->c), (long long)ds4_cache_capacity(dst->c));
    ds4_error err = {0};
    if (dst != src && ds4_cache_copy(dst->c, src->c, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, 1);
    return 1;
}

/* c:free(): release now (a second call is harmless; later use raises). */
static int c_free(lua_State *L) {
    cache_box *b = cache_test(L, 1);
    if (!b) ds4l_raise(L, "ds4.cache:free: self must be a ds4.cache (got %s)", luaL_typename(L, 1));
    ds4_cache_free(b->c);
    b->c = NULL;
    return 0;
}

static int c_tostring(lua_State *L) {
    cache_box *b = cache_test(L, 1);
    int alive = 0;
    if (b && b->c) {
        push_cache_model(L, 1);
        ds4_model **mb = luaL_testudata(L, -1, DS4L_MODEL_MT); /* model_box's first field is the model */
        alive = mb && *mb == b->m;
        lua_pop(L, 1);
    }
    if (!alive) {
        lua_pushstring(L, b && b->c ? "ds4.cache (model freed)" : "ds4.cache (freed)");
        return 1;
    }
    char buf[160];
    snprintf(buf, sizeof buf, "ds4.cache (%lld of %lld positions, %zu bytes)", (long long)ds4_cache_len(b->c),
             (long long)ds4_cache_capacity(b->c), ds4_cache_bytes(b->c));
    lua_pushstring(L, buf);
    return 1;
}

/* model:new_cache(max_len) -> ds4.cache for one sequence of up to max_len positions. */
static int m_new_cache(lua_State *L) {
    const char *fname = "ds4.model:new_cache";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int64_t max_len = ds4l_check_int(L, 2, fname, "bad argument #1 (max_len)", 1, DS4L_MAX_EXACT, "a positive integer");
    cache_box *b = ds4l_push_model_owned(L, sizeof *b, CACHE_MT, 1);
    b->m = m;
    ds4_error err = {0};
    if (ds4_cache_create(m, max_len, &b->c, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int l_is_cache(lua_State *L) {
    lua_pushboolean(L, cache_test(L, 1) != NULL);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ step */

/* model:step(caches, ids [, opts]) -> {logits, experts, index_picks}
 *   caches: array of distinct caches of this model; ids: array of as many id sequences (Lua arrays or 1-D
 *   integer tensors, each non-empty), appended to the caches in one call. A single cache with a single id
 *   sequence is accepted too: model:step(c, {1, 2, 3}).
 *   opts.logits = "last" (default: [nseq, V], each sequence's last new token) | "all" ([N, V], every new token,
 *   sequence after sequence) | "none"; opts.experts = true: I32 [N, L, K]; opts.index = true: I32
 *   [N, n_csa, index_topk] (-1 padded). */
static int m_step(lua_State *L) {
    const char *fname = "ds4.model:step";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int opts = ds4l_opt_table(L, 4, fname, 3);
    static const char *const known[] = {"logits", "experts", "index", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 4); /* 1 model, 2 caches, 3 ids, 4 opts; temporaries above */
    check_not_busy(L, 1, fname);
    const ds4_config *cfg = ds4_model_config(m);
    const int64_t V = cfg->vocab_size;

    int logits_mode = 1; /* 0 none, 1 last, 2 all */
    if (opts) {
        lua_getfield(L, opts, "logits");
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (lua_isnil(L, -1)) logits_mode = 1;
        else if (s && !strcmp(s, "last")) logits_mode = 1;
        else if (s && !strcmp(s, "all")) logits_mode = 2;
        else if ((s && !strcmp(s, "none")) || (lua_type(L, -1) == LUA_TBOOLEAN && !lua_toboolean(L, -1)))
            logits_mode = 0;
        else {
            char vb[96];
            ds4l_raise(L, "%s: opts.logits must be \"last\", \"all\" or \"none\", got %s", fname,
                       ds4l_value_str(L, -1, vb, sizeof vb));
        }
        lua_pop(L, 1);
    }
    int want_experts = ds4l_opt_bool(L, opts, "experts", 0, fname);
    int want_index = ds4l_opt_bool(L, opts, "index", 0, fname);

    /* The sequences: caches[i] with ids[i], or one cache with one id sequence. */
    int single = cache_test(L, 2) != NULL;
    int64_t nseq;
    if (single) {
        nseq = 1;
    } else {
        if (!lua_istable(L, 2))
            ds4l_raise(L, "%s: bad argument #1 (array of ds4.cache expected, got %s)", fname, luaL_typename(L, 2));
        nseq = (int64_t)lua_objlen(L, 2);
        if (nseq < 1) ds4l_raise(L, "%s: bad argument #1 is an empty array (at least one cache is needed)", fname);
        if (!lua_istable(L, 3) || ds4l_tensor_test(L, 3))
            ds4l_raise(L, "%s: bad argument #2 (array of %lld id sequences expected, one per cache, got %s)", fname,
                       (long long)nseq, luaL_typename(L, 3));
        if ((int64_t)lua_objlen(L, 3) != nseq) {
            lua_rawgeti(L, 3, 1);
            int flat = lua_type(L, -1) == LUA_TNUMBER;
            lua_pop(L, 1);
            ds4l_raise(L, "%s: %lld caches but %lld id sequences%s", fname, (long long)nseq,
                       (long long)lua_objlen(L, 3),
                       flat ? " (ids must be an array of id arrays, one per cache: {{...}, {...}})" : "");
        }
    }
    if (nseq > INT32_MAX / 8) ds4l_raise(L, "%s: %lld sequences in one step is too many", fname, (long long)nseq);
    ds4_cache **caches = lua_newuserdata(L, (size_t)nseq * sizeof *caches);
    int64_t *counts = lua_newuserdata(L, (size_t)nseq * sizeof *counts);
    int64_t N = 0;
    char what[64];
    /* Nothing but raw table reads runs between these passes: the tables cannot change under them. */
    for (int64_t i = 0; i < nseq; i++) {
        if (single) {
            lua_pushvalue(L, 2);
            lua_pushvalue(L, 3);
        } else {
            lua_rawgeti(L, 2, (int)(i + 1));
            lua_rawgeti(L, 3, (int)(i + 1));
        }
        const int ci = lua_gettop(L) - 1, ii = ci + 1;
        snprintf(what, sizeof what, single ? "the cache" : "caches[%lld]", (long long)(i + 1));
        cache_box *cb = cache_check(L, ci, fname, what);
        push_cache_model(L, ci);
        int mine = lua_rawequal(L, -1, 1);
        lua_pop(L, 1);
        if (!mine) ds4l_raise(L, "%s: %s belongs to another model", fname, what);
        for (int64_t j = 0; j < i; j++)
            if (caches[j] == cb->c)
                ds4l_raise(L, "%s: caches[%lld] and caches[%lld] are the same cache", fname, (long long)(j + 1),
                           (long long)(i + 1));
        caches[i] = cb->c;
        snprintf(what, sizeof what, single ? "ids" : "ids[%lld]", (long long)(i + 1));
        counts[i] = id_seq_len(L, ii, fname, what);
        const int64_t len = ds4_cache_len(cb->c), cap = ds4_cache_capacity(cb->c);
        if (counts[i] > cap - len)
            ds4l_raise(L, "%s: %s: %lld new tokens do not fit (the cache holds %lld of %lld positions)", fname,
                       what, (long long)counts[i], (long long)len, (long long)cap);
        N += counts[i];
        lua_pop(L, 2);
    }
    int64_t *ids = lua_newuserdata(L, (size_t)N * sizeof *ids);
    for (int64_t i = 0, off = 0; i < nseq; i++) {
        if (single) lua_pushvalue(L, 3);
        else lua_rawgeti(L, 3, (int)(i + 1));
        snprintf(what, sizeof what, single ? "ids" : "ids[%lld]", (long long)(i + 1));
        id_seq_fill(L, lua_gettop(L), counts[i], V, ids + off, fname, what);
        lua_pop(L, 1);
        off += counts[i];
    }

    lua_createtable(L, 0, 3);
    const int res = lua_gettop(L);
    ds4_step_args a = {.nseq = nseq, .caches = caches, .counts = counts, .ids = ids};
    if (logits_mode) {
        const int64_t shape[2] = {logits_mode == 2 ? N : nseq, V};
        float *p = ds4l_tensor_push_new(L, fname, DS4_F32, 2, shape)->data;
        if (logits_mode == 2) a.logits = p;
        else a.last_logits = p;
        lua_setfield(L, res, "logits");
    }
    if (want_experts) {
        const int64_t shape[3] = {N, cfg->num_hidden_layers, cfg->num_experts_per_tok};
        a.experts = ds4l_tensor_push_new(L, fname, DS4_I32, 3, shape)->data;
        lua_setfield(L, res, "experts");
    }
    if (want_index) {
        const int64_t shape[3] = {N, ds4_model_csa_layers(m), cfg->index_topk};
        a.index_picks = ds4l_tensor_push_new(L, fname, DS4_I32, 3, shape)->data;
        lua_setfield(L, res, "index_picks");
    }
    ds4_error err = {0};
    if (ds4_model_step(m, &a, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    lua_settop(L, res);
    return 1;
}

/* ------------------------------------------------------------------------------------------------ sampling */

/* Sampling parameters from the table at idx (0: defaults); `prefix` names the table in errors ("opts."). */
static ds4_sampling read_sampling(lua_State *L, int idx, const char *fname) {
    ds4_sampling p = {.temperature = 1.0, .top_k = 0, .top_p = 1.0, .min_p = 0.0};
    p.temperature = ds4l_opt_num(L, idx, "temperature", p.temperature, 0, HUGE_VAL, "a finite number >= 0 (0: greedy)",
                                 fname);
    if (!isfinite(p.temperature)) ds4l_raise(L, "%s: opts.temperature must be finite, got %g", fname, p.temperature);
    p.top_k = ds4l_opt_int(L, idx, "top_k", 0, 0, DS4L_MAX_EXACT, "an integer >= 0 (0: off)", fname);
    /* (0, 1]: the least positive double is the open bound at 0 */
    p.top_p = ds4l_opt_num(L, idx, "top_p", 1.0, nextafter(0.0, 1.0), 1, "a number in (0, 1] (1: off)", fname);
    p.min_p = ds4l_opt_num(L, idx, "min_p", 0.0, 0, 1, "a number in [0, 1] (0: off)", fname);
    return p;
}

/* ds4.sample(logits, params, u) -> id, lp_model, lp_sample: one draw with ds4_sample. logits: a tensor of V
 * values (any shape, e.g. [V] or [1, V]) or a Lua array of numbers; params: {temperature = 1, top_k = 0,
 * top_p = 1, min_p = 0} (nil: those defaults); u: the uniform draw in [0, 1) (may be omitted when
 * temperature = 0). The id is 0-based, as every token id. */
static int l_sample(lua_State *L) {
    const char *fname = "ds4.sample";
    int opts = ds4l_opt_table(L, 2, fname, 2);
    static const char *const known[] = {"temperature", "top_k", "top_p", "min_p", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 3);
    ds4_sampling p = read_sampling(L, opts, fname);
    double u = 0;
    if (!lua_isnil(L, 3) || p.temperature > 0) {
        u = lua_tonumber(L, 3);
        if (lua_type(L, 3) != LUA_TNUMBER || !(u >= 0) || !(u < 1)) {
            char vb[96];
            ds4l_raise(L, "%s: bad argument #3 (uniform draw u in [0, 1) expected, got %s)", fname,
                       ds4l_value_str(L, 3, vb, sizeof vb));
        }
    }
    ds4_tensor *t = ds4l_tensor_test(L, 1);
    const float *logits;
    int64_t V;
    if (t) {
        V = ds4_tensor_numel(t);
        if (V < 1) ds4l_raise(L, "%s: bad argument #1 (the logits tensor is empty)", fname);
        if (t->dtype == DS4_F32) {
            logits = t->data;
        } else {
            float *f = lua_newuserdata(L, (size_t)V * sizeof *f);
            for (int64_t i = 0; i < V; i++) f[i] = (float)ds4_tensor_get(t, i);
            logits = f;
        }
    } else if (lua_istable(L, 1)) {
        V = (int64_t)lua_objlen(L, 1);
        if (V < 1) ds4l_raise(L, "%s: bad argument #1 (the logits array is empty)", fname);
        float *f = lua_newuserdata(L, (size_t)V * sizeof *f);
        for (int64_t i = 0; i < V; i++) {
            lua_rawgeti(L, 1, (int)(i + 1));
            if (lua_type(L, -1) != LUA_TNUMBER) {
                char vb[96];
                ds4l_raise(L, "%s: logits[%lld] must be a number, got %s", fname, (long long)(i + 1),
                           ds4l_value_str(L, -1, vb, sizeof vb));
            }
            f[i] = (float)lua_tonumber(L, -1);
            lua_pop(L, 1);
        }
        logits = f;
    } else {
        ds4l_raise(L, "%s: bad argument #1 (logits tensor or array of numbers expected, got %s)", fname,
                   luaL_typename(L, 1));
    }
    void *scratch = lua_newuserdata(L, ds4_sample_scratch_bytes(V));
    double lp_model = 0, lp_sample = 0;
    ds4_error err = {0};
    int64_t id = ds4_sample(logits, V, &p, u, &lp_model, &lp_sample, scratch, &err);
    if (id < 0) ds4l_raise_ds4(L, fname, &err);
    lua_pushnumber(L, (lua_Number)id);
    lua_pushnumber(L, lp_model);
    lua_pushnumber(L, lp_sample);
    return 3;
}

/* ds4.sample_uniform(seed, stream, step) -> the uniform draw in [0, 1) generation uses for that triple. */
static int l_sample_uniform(lua_State *L) {
    const char *fname = "ds4.sample_uniform";
    const char *desc = "a non-negative integer (at most 2^53)";
    uint64_t seed = (uint64_t)ds4l_check_int(L, 1, fname, "bad argument #1 (seed)", 0, DS4L_MAX_EXACT, desc);
    uint64_t stream = (uint64_t)ds4l_check_int(L, 2, fname, "bad argument #2 (stream)", 0, DS4L_MAX_EXACT, desc);
    uint64_t step = (uint64_t)ds4l_check_int(L, 3, fname, "bad argument #3 (step)", 0, DS4L_MAX_EXACT, desc);
    lua_pushnumber(L, ds4_sample_uniform(seed, stream, step));
    return 1;
}

/* ------------------------------------------------------------------------------------------------ generate */

typedef struct genres_box {
    ds4_gen_result *r;
} genres_box;

static int genres_gc(lua_State *L) {
    genres_box *b = lua_touserdata(L, 1);
    if (b) {
        ds4_gen_result_free(b->r);
        b->r = NULL;
    }
    return 0;
}

/* ds4_token_fn: call opts.on_token(i, id, logprob) under lua_pcall (never let an error unwind over
 * ds4_generate). Returning false cancels; an error is stashed in err_slot and cancels. */
static int gen_on_token(void *ud, int64_t seq, int64_t id, double logprob) {
    gen_ctx *g = ud;
    lua_State *L = g->L;
    if (g->failed) return 1;
    /* room for these four values was reserved with lua_checkstack before ds4_generate */
    lua_pushvalue(L, g->fn_slot);
    lua_pushnumber(L, (lua_Number)(seq + 1));
    lua_pushnumber(L, (lua_Number)id);
    lua_pushnumber(L, logprob);
    if (lua_pcall(L, 3, 1, 0) != 0) {
        lua_replace(L, g->err_slot);
        g->failed = 1;
        return 1;
    }
    int cancel = lua_type(L, -1) == LUA_TBOOLEAN && !lua_toboolean(L, -1);
    lua_pop(L, 1);
    return cancel;
}

static void push_i64_array(lua_State *L, const int64_t *v, int64_t n) {
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
        lua_pushnumber(L, (lua_Number)v[i]);
        lua_rawseti(L, -2, (int)(i + 1));
    }
}

static void push_f32_array(lua_State *L, const float *v, int64_t n) {
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n && v; i++) {
        lua_pushnumber(L, (lua_Number)v[i]);
        lua_rawseti(L, -2, (int)(i + 1));
    }
}

static const char *const gen_known[] = {
    "max_new_tokens", "temperature", "top_k",          "top_p",        "min_p",     "n",
    "seed",           "stop",        "tokenizer",      "ignore_eos",   "record_experts",
    "record_index",   "max_batch",   "prefill_chunk",  "on_token",     "prompt_base", NULL,
};

/* The scalar options of a generation (opts at idx; 0: none) into a. */
static void read_gen_opts(lua_State *L, int opts, const char *fname, ds4_gen_args *a) {
    a->max_new_tokens = ds4l_opt_int(L, opts, "max_new_tokens", 64, 1, DS4L_MAX_EXACT, "a positive integer", fname);
    a->sampling = read_sampling(L, opts, fname);
    a->n = (int32_t)ds4l_opt_int(L, opts, "n", 1, 1, 2147483647.0, "a positive integer (samples per prompt)", fname);
    a->seed = (uint64_t)ds4l_opt_int(L, opts, "seed", 0, 0, DS4L_MAX_EXACT, "a non-negative integer (at most 2^53)", fname);
    /* a share of a larger batch: its first prompt's index there, so the draws are the whole batch's */
    a->prompt_base = ds4l_opt_int(L, opts, "prompt_base", 0, 0, 2147483647.0, "an integer >= 0", fname);
    a->ignore_eos = ds4l_opt_bool(L, opts, "ignore_eos", 0, fname);
    a->record_experts = ds4l_opt_bool(L, opts, "record_experts", 0, fname);
    a->record_index = ds4l_opt_bool(L, opts, "record_index", 0, fname);
    a->max_batch = ds4l_opt_int(L, opts, "max_batch", 0, 0, DS4L_MAX_EXACT, "an integer >= 0 (0: all sequences)", fname);
    a->prefill_chunk = ds4l_opt_int(L, opts, "prefill_chunk", 0, 0, DS4L_MAX_EXACT, "an integer >= 0 (0: 2048)", fname);
}

/* Push opts.tokenizer (nil, or a live ds4.tokenizer: returned). */
static const ds4_tokenizer *push_gen_tokenizer(lua_State *L, int opts, const char *fname) {
    if (opts) lua_getfield(L, opts, "tokenizer");
    else lua_pushnil(L);
    if (lua_isnil(L, -1)) return NULL;
    int freed = 0;
    const ds4_tokenizer *tok = ds4l_tokenizer_test(L, -1, &freed);
    if (freed) ds4l_raise(L, "%s: opts.tokenizer has been freed", fname);
    if (!tok)
        ds4l_raise(L, "%s: opts.tokenizer must be a ds4.tokenizer (ds4.tokenizer([path])), got %s", fname,
                   luaL_typename(L, -1));
    return tok;
}

/* The prompts at idx (an array of id sequences, Lua arrays or 1-D tensors, or a 2-D tensor [B, S] of B prompts)
 * into a->nprompts / prompts / prompt_lens, copied into scratch userdata left on the stack. */
static void read_gen_prompts(lua_State *L, int idx, int64_t V, const char *fname, ds4_gen_args *a) {
    ds4_tensor *pt = ds4l_tensor_test(L, idx);
    int64_t np;
    if (pt) {
        char sh[128];
        ds4l_format_shape(sh, sizeof sh, pt->ndim, pt->shape);
        if (pt->ndim != 2 || pt->shape[0] < 1 || pt->shape[1] < 1 || pt->dtype == DS4_BOOL)
            ds4l_raise(L, "%s: bad argument #1: a prompts tensor must be an integer [batch, seq] tensor with both "
                          "sizes >= 1, got %s %s",
                       fname, ds4_dtype_name(pt->dtype), sh);
        np = pt->shape[0];
    } else {
        if (!lua_istable(L, idx))
            ds4l_raise(L, "%s: bad argument #1 (array of prompts expected, each an array of token ids; got %s)",
                       fname, luaL_typename(L, idx));
        np = (int64_t)lua_objlen(L, idx);
        if (np < 1) ds4l_raise(L, "%s: bad argument #1 is an empty array (at least one prompt is needed)", fname);
        lua_rawgeti(L, idx, 1);
        int flat = lua_type(L, -1) == LUA_TNUMBER;
        lua_pop(L, 1);
        if (flat)
            ds4l_raise(L, "%s: bad argument #1 must be an array of prompts, each an array of token ids; got a flat "
                          "array of numbers (wrap a single prompt: {ids})",
                       fname);
    }
    if ((double)np * (double)a->n > 2147483647.0)
        ds4l_raise(L, "%s: %lld prompts x n = %d samples is too many", fname, (long long)np, (int)a->n);
    const int64_t **prompts = lua_newuserdata(L, (size_t)np * sizeof *prompts);
    int64_t *lens = lua_newuserdata(L, (size_t)np * sizeof *lens);
    char what[64];
    int64_t total = 0;
    for (int64_t p = 0; p < np; p++) {
        if (pt) {
            lens[p] = pt->shape[1];
        } else {
            lua_rawgeti(L, idx, (int)(p + 1));
            snprintf(what, sizeof what, "prompts[%lld]", (long long)(p + 1));
            lens[p] = id_seq_len(L, -1, fname, what);
            lua_pop(L, 1);
        }
        total += lens[p];
    }
    int64_t *idbuf = lua_newuserdata(L, (size_t)total * sizeof *idbuf);
    for (int64_t p = 0, off = 0; p < np; p++) {
        if (pt) {
            for (int64_t j = 0; j < lens[p]; j++) {
                double v = ds4_tensor_get(pt, off + j);
                if (!(v == floor(v)) || !(v >= 0) || !(v < (double)V))
                    ds4l_raise(L, "%s: prompts[%lld][%lld] = %.17g is not a token id (vocabulary size %lld)", fname,
                               (long long)(p + 1), (long long)(j + 1), v, (long long)V);
                idbuf[off + j] = (int64_t)v;
            }
        } else {
            lua_rawgeti(L, idx, (int)(p + 1));
            snprintf(what, sizeof what, "prompts[%lld]", (long long)(p + 1));
            id_seq_fill(L, lua_gettop(L), lens[p], V, idbuf + off, fname, what);
            lua_pop(L, 1);
        }
        prompts[p] = idbuf + off;
        off += lens[p];
    }
    a->nprompts = np;
    a->prompts = prompts;
    a->prompt_lens = lens;
}

/* The stop values of a generation: token ids and strings, in opts.stop's order within each kind. */
typedef struct gen_stops {
    const int64_t *ids;
    const char *const *strs;
    int64_t n_ids, n_strs;
} gen_stops;

/* opts.stop (integer ids and strings in one array) into a and *s, copied into scratch (on_token may change
 * opts.stop). Leaves exactly four values on the stack: opts.stop (or nil), then the scratch of the ids, of the
 * string pointers and of the strings' bytes. */
static void read_gen_stops(lua_State *L, int opts, int64_t V, const ds4_tokenizer *tok, const char *fname,
                           ds4_gen_args *a, gen_stops *s) {
    int64_t n_sid = 0, n_sstr = 0;
    size_t str_bytes = 0;
    char what[64];
    if (opts) lua_getfield(L, opts, "stop");
    else lua_pushnil(L);
    int stop_slot = lua_gettop(L);
    if (lua_isnil(L, stop_slot)) {
        stop_slot = 0;
    } else if (!lua_istable(L, stop_slot) || ds4l_tensor_test(L, stop_slot)) {
        char vb[96];
        ds4l_raise(L, "%s: opts.stop must be an array of token ids and strings, got %s", fname,
                   ds4l_value_str(L, stop_slot, vb, sizeof vb));
    }
    const int64_t n_stop = stop_slot ? (int64_t)lua_objlen(L, stop_slot) : 0;
    for (int64_t i = 0; i < n_stop; i++) {
        lua_rawgeti(L, stop_slot, (int)(i + 1));
        int ty = lua_type(L, -1);
        if (ty == LUA_TNUMBER) {
            char desc[96];
            snprintf(what, sizeof what, "opts.stop[%lld]", (long long)(i + 1));
            snprintf(desc, sizeof desc, "a token id in [0, %lld) or a non-empty string", (long long)V);
            ds4l_check_int(L, -1, fname, what, 0, (double)V - 1, desc);
            n_sid++;
        } else if (ty == LUA_TSTRING) {
            size_t len = 0;
            const char *str = lua_tolstring(L, -1, &len);
            if (len == 0) ds4l_raise(L, "%s: opts.stop[%lld] is an empty string", fname, (long long)(i + 1));
            if (strlen(str) != len)
                ds4l_raise(L, "%s: opts.stop[%lld] contains a NUL byte (stop strings are NUL-terminated in C)", fname,
                           (long long)(i + 1));
            if (!tok)
                ds4l_raise(L, "%s: opts.stop[%lld] is a string (\"%.40s\"): stop strings need opts.tokenizer (a "
                              "ds4.tokenizer) to decode the generated tokens",
                           fname, (long long)(i + 1), str);
            n_sstr++;
            str_bytes += len + 1;
        } else {
            char vb[96];
            ds4l_raise(L, "%s: opts.stop[%lld] must be a token id or a non-empty string, got %s", fname,
                       (long long)(i + 1), ds4l_value_str(L, -1, vb, sizeof vb));
        }
        lua_pop(L, 1);
    }
    int64_t *stop_ids = lua_newuserdata(L, (size_t)(n_sid ? n_sid : 1) * sizeof *stop_ids);
    const char **stop_strs = lua_newuserdata(L, (size_t)(n_sstr ? n_sstr : 1) * sizeof *stop_strs);
    char *str_buf = lua_newuserdata(L, str_bytes ? str_bytes : 1);
    for (int64_t i = 0, si = 0, ss = 0, off = 0; i < n_stop; i++) {
        lua_rawgeti(L, stop_slot, (int)(i + 1));
        if (lua_type(L, -1) == LUA_TNUMBER) {
            stop_ids[si++] = (int64_t)lua_tonumber(L, -1);
        } else {
            size_t len = 0;
            const char *str = lua_tolstring(L, -1, &len);
            memcpy(str_buf + off, str, len + 1);
            stop_strs[ss++] = str_buf + off;
            off += (int64_t)len + 1;
        }
        lua_pop(L, 1);
    }
    *s = (gen_stops){.ids = stop_ids, .strs = stop_strs, .n_ids = n_sid, .n_strs = n_sstr};
    a->stop_ids = n_sid ? stop_ids : NULL;
    a->n_stop_ids = n_sid;
    a->stop_strings = n_sstr ? stop_strs : NULL;
    a->n_stop_strings = n_sstr;
    a->tokenizer = tok;
}

/* Push the results of a generation as model:generate returns them (the table of the comment at the top). */
static void push_gen_results(lua_State *L, ds4_model *m, const ds4_gen_result *r, int rec_experts, int rec_index,
                             const gen_stops *stops, const char *fname) {
    const ds4_config *cfg = ds4_model_config(m);
    if (r->nseq > INT32_MAX) ds4l_raise(L, "%s: %lld results do not fit a Lua array", fname, (long long)r->nseq);
    const int64_t nl = cfg->num_hidden_layers, K = cfg->num_experts_per_tok;
    const int64_t n_csa = ds4_model_csa_layers(m), topk = cfg->index_topk;
    lua_createtable(L, (int)r->nseq, 1);
    const int res = lua_gettop(L);
    for (int64_t i = 0; i < r->nseq; i++) {
        const ds4_gen_seq *s = &r->seqs[i];
        if (s->n_ids > INT32_MAX) ds4l_raise(L, "%s: %lld ids do not fit a Lua array", fname, (long long)s->n_ids);
        lua_createtable(L, 0, 12);
        push_i64_array(L, s->ids, s->n_ids);
        lua_setfield(L, -2, "ids");
        push_f32_array(L, s->logprobs, s->n_ids);
        lua_setfield(L, -2, "logprobs");
        push_f32_array(L, s->sample_logprobs, s->n_ids);
        lua_setfield(L, -2, "sample_logprobs");
        ds4l_set_str(L, "finish_reason", ds4_finish_name(s->finish));
        if (s->finish == DS4_FINISH_STOP_TOKEN && s->stop_index >= 0 && s->stop_index < stops->n_ids) {
            ds4l_set_int(L, "stop", stops->ids[s->stop_index]);
        } else if (s->finish == DS4_FINISH_STOP_STRING && s->stop_index >= 0 && s->stop_index < stops->n_strs) {
            ds4l_set_str(L, "stop", stops->strs[s->stop_index]);
        }
        ds4l_set_int(L, "prompt_index", s->prompt_index + 1);
        ds4l_set_int(L, "sample_index", s->sample_index + 1);
        ds4l_set_int(L, "prompt_len", s->prompt_len);
        /* recorded rows: a model without CSA layers records no picks (NULL), which is an [n_rows, 0, topk] tensor */
        if (rec_experts) {
            const int64_t shape[3] = {s->n_rows, nl, K};
            ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_I32, 3, shape);
            if (t->nbytes && s->experts) memcpy(t->data, s->experts, t->nbytes);
            lua_setfield(L, -2, "experts");
        }
        if (rec_index) {
            const int64_t shape[3] = {s->n_rows, n_csa, topk};
            ds4_tensor *t = ds4l_tensor_push_new(L, fname, DS4_I32, 3, shape);
            if (t->nbytes && s->index_picks) memcpy(t->data, s->index_picks, t->nbytes);
            lua_setfield(L, -2, "index_picks");
        }
        lua_rawseti(L, res, (int)(i + 1));
    }
    lua_createtable(L, 0, 6);
    ds4l_set_int(L, "prefill_tokens", r->prefill_tokens);
    ds4l_set_int(L, "decode_tokens", r->decode_tokens);
    ds4l_set_num(L, "prefill_seconds", r->prefill_seconds);
    ds4l_set_num(L, "decode_seconds", r->decode_seconds);
    ds4l_set_num(L, "prefill_tokens_per_s", r->prefill_seconds > 0 ? (double)r->prefill_tokens / r->prefill_seconds : 0);
    ds4l_set_num(L, "decode_tokens_per_s", r->decode_seconds > 0 ? (double)r->decode_tokens / r->decode_seconds : 0);
    lua_setfield(L, res, "stats");
}

/* model:generate(prompts [, opts]) -> res (see the comment at the top of lua/ds4/init.lua). */
static int m_generate(lua_State *L) {
    const char *fname = "ds4.model:generate";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int opts = ds4l_opt_table(L, 3, fname, 2);
    ds4l_check_keys(L, opts, fname, gen_known);
    lua_settop(L, 3); /* 1 model, 2 prompts, 3 opts */
    check_not_busy(L, 1, fname);
    const int64_t V = ds4_model_config(m)->vocab_size;

    ds4_gen_args a;
    memset(&a, 0, sizeof a);
    read_gen_opts(L, opts, fname, &a);

    /* Fixed slots above the arguments: 4 on_token, 5 tokenizer, 6 stashed error, 7 run record. */
    if (opts) lua_getfield(L, opts, "on_token");
    else lua_pushnil(L);
    if (!lua_isnil(L, 4) && !lua_isfunction(L, 4)) {
        char vb[96];
        ds4l_raise(L, "%s: opts.on_token must be a function(i, id, logprob), got %s", fname,
                   ds4l_value_str(L, 4, vb, sizeof vb));
    }
    const ds4_tokenizer *tok = push_gen_tokenizer(L, opts, fname);
    lua_pushnil(L); /* 6: error raised by on_token */
    gen_ctx *g = lua_newuserdata(L, sizeof *g); /* 7 */
    memset(g, 0, sizeof *g);
    g->L = L;
    g->fn_slot = lua_isnil(L, 4) ? 0 : 4;
    g->err_slot = 6;

    read_gen_prompts(L, 2, V, fname, &a);
    gen_stops stops;
    read_gen_stops(L, opts, V, tok, fname, &a, &stops);

    if (g->fn_slot) {
        a.on_token = gen_on_token;
        a.ud = g;
    }
    lua_getfield(L, LUA_REGISTRYINDEX, DS4L_INTERRUPT_KEY);
    if (lua_islightuserdata(L, -1)) a.cancel = (const volatile int *)lua_touserdata(L, -1);
    lua_pop(L, 1);

    /* Mark the model busy (weak table model -> run record; the record is anchored in slot 7). */
    lua_getfield(L, LUA_REGISTRYINDEX, BUSY_KEY);
    if (lua_istable(L, -1)) {
        lua_pushvalue(L, 1);
        lua_pushvalue(L, 7);
        lua_rawset(L, -3);
    }
    lua_pop(L, 1);

    genres_box *box = lua_newuserdata(L, sizeof *box);
    box->r = NULL;
    luaL_getmetatable(L, GENRES_MT);
    lua_setmetatable(L, -2);
    const int box_slot = lua_gettop(L);
    luaL_checkstack(L, 16, fname); /* for on_token's calls, made with this frame's stack */
    ds4_error err = {0};
    g->running = 1;
    ds4_status st = ds4_generate(m, &a, &box->r, &err);
    g->running = 0;
    if (g->failed) {
        /* on_token raised: free now, then raise its error value unchanged */
        ds4_gen_result_free(box->r);
        box->r = NULL;
        lua_pushvalue(L, g->err_slot);
        lua_error(L);
    }
    if (st != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    if (!box->r) ds4l_raise(L, "%s: internal error: ds4_generate returned no result", fname);
    push_gen_results(L, m, box->r, a.record_experts, a.record_index, &stops, fname);
    /* the result's memory now, rather than at the next collection */
    box = lua_touserdata(L, box_slot);
    ds4_gen_result_free(box->r);
    box->r = NULL;
    return 1;
}

/* ------------------------------------------------------------------------------------------------ batcher */

/* model:batcher([opts]) -> ds4.batcher (continuous batching, ds4_gen.h): opts.max_seqs (32) sequences run at once,
 * opts.prefill_chunk (0: 2048) prompt tokens per step.
 *   b:submit(prompts [, opts]) -> tag   opts: those of model:generate but max_batch, prefill_chunk, on_token
 *   b:step()                            one step of every admitted sequence (raises when the step fails: then
 *                                       every admitted task ends, and take() returns it with the message)
 *   b:take() -> tag, res | tag, nil, message | nil   the oldest finished task; res as model:generate's
 *   b:cancel(tag) -> bool  b:stats() -> {queued, running, finished, seqs, free_seqs, steps, prefill_tokens,
 *                                        decode_tokens}  b:free()
 * A task's res equals model:generate(prompts, opts) alone, bit for bit, whatever else runs in the batcher.
 * Per pending task, the batcher's environment table keeps {the stop scratch, counts, record flags} under its tag
 * (pending[tag]) so that take() can name the stop that matched. */
#define BATCHER_MT "ds4.batcher"

typedef struct batcher_box {
    ds4_batcher *b;
    uint64_t next_tag;
    char last_err[sizeof(((ds4_error *)0)->msg)]; /* the message of the last failed step, for the tasks it ended */
} batcher_box;

static const char *const batcher_submit_known[] = {
    "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "n", "seed", "stop", "tokenizer", "ignore_eos",
    "record_experts", "record_index", NULL,
};

static int batcher_gc(lua_State *L) {
    batcher_box *b = lua_touserdata(L, 1);
    if (b) {
        ds4_batcher_free(b->b);
        b->b = NULL;
    }
    return 0;
}

/* The live batcher at idx whose model is alive; pushes nothing. */
static batcher_box *batcher_check(lua_State *L, int idx, const char *fname, ds4_model **m) {
    batcher_box *b = luaL_testudata(L, idx, BATCHER_MT);
    if (!b) ds4l_raise(L, "%s: self must be a ds4.batcher (model:batcher()), got %s", fname, luaL_typename(L, idx));
    if (!b->b) ds4l_raise(L, "%s: the batcher has been freed", fname);
    lua_getfenv(L, idx);
    lua_getfield(L, -1, "model");
    ds4_model *mm = ds4l_model_check(L, -1, fname); /* raises "model has been freed" */
    lua_pop(L, 2);
    if (m) *m = mm;
    return b;
}

/* Push the batcher's pending table (in its environment). */
static void push_pending(lua_State *L, int idx) {
    lua_getfenv(L, idx);
    lua_getfield(L, -1, "pending");
    lua_remove(L, -2);
}

static int m_batcher(lua_State *L) {
    const char *fname = "ds4.model:batcher";
    ds4_model *m = ds4l_model_check(L, 1, fname);
    int opts = ds4l_opt_table(L, 2, fname, 1);
    static const char *const known[] = {"max_seqs", "prefill_chunk", NULL};
    ds4l_check_keys(L, opts, fname, known);
    lua_settop(L, 2);
    ds4_batcher_options o = {
        .max_seqs = ds4l_opt_int(L, opts, "max_seqs", 32, 1, 1 << 20, "an integer in [1, 2^20]", fname),
        .prefill_chunk = ds4l_opt_int(L, opts, "prefill_chunk", 0, 0, 1 << 24, "an integer in [0, 2^24] (0: 2048)", fname)};
    batcher_box *b = ds4l_push_model_owned(L, sizeof *b, BATCHER_MT, 1);
    lua_getfenv(L, -1);
    lua_newtable(L);
    lua_setfield(L, -2, "pending");
    lua_pop(L, 1);
    ds4_error err = {0};
    if (ds4_batcher_create(m, &o, &b->b, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    return 1;
}

static int b_submit(lua_State *L) {
    const char *fname = "ds4.batcher:submit";
    ds4_model *m = NULL;
    batcher_box *b = batcher_check(L, 1, fname, &m);
    int opts = ds4l_opt_table(L, 3, fname, 2);
    ds4l_check_keys(L, opts, fname, batcher_submit_known);
    lua_settop(L, 3); /* 1 batcher, 2 prompts, 3 opts */
    const int64_t V = ds4_model_config(m)->vocab_size;
    ds4_gen_args a;
    memset(&a, 0, sizeof a);
    read_gen_opts(L, opts, fname, &a);
    const ds4_tokenizer *tok = push_gen_tokenizer(L, opts, fname); /* 4 */
    read_gen_prompts(L, 2, V, fname, &a);
    gen_stops stops;
    read_gen_stops(L, opts, V, tok, fname, &a, &stops); /* the top 3: the stop scratch */
    const int top = lua_gettop(L);
    /* pending[tag] = {ids, strs, bytes, n_ids, n_strs, record_experts, record_index, tokenizer} */
    lua_createtable(L, 8, 0);
    for (int k = 0; k < 3; k++) {
        lua_pushvalue(L, top - 2 + k);
        lua_rawseti(L, -2, k + 1);
    }
    const double rec[4] = {(double)stops.n_ids, (double)stops.n_strs, a.record_experts, a.record_index};
    for (int k = 0; k < 4; k++) {
        lua_pushnumber(L, rec[k]);
        lua_rawseti(L, -2, k + 4);
    }
    lua_pushvalue(L, 4); /* the tokenizer stays alive while the task may decode with it */
    lua_rawseti(L, -2, 8);
    const uint64_t tag = ++b->next_tag;
    ds4_error err = {0};
    if (ds4_batcher_submit(b->b, &a, tag, &err) != DS4_OK) ds4l_raise_ds4(L, fname, &err);
    push_pending(L, 1);
    lua_pushnumber(L, (lua_Number)tag);
    lua_pushvalue(L, -3);
    lua_rawset(L, -3);
    lua_pushnumber(L, (lua_Number)tag);
    return 1;
}

static int b_step(lua_State *L) {
    const char *fname = "ds4.batcher:step";
    ds4_model *m = NULL;
    batcher_box *b = batcher_check(L, 1, fname, &m);
    lua_getfenv(L, 1);
    lua_getfield(L, -1, "model");
    check_not_busy(L, lua_gettop(L), fname);
    lua_pop(L, 2);
    ds4_error err = {0};
    if (ds4_batcher_step(b->b, &err) != DS4_OK) {
        snprintf(b->last_err, sizeof b->last_err, "%s", err.msg);
        ds4l_raise_ds4(L, fname, &err);
    }
    return 0;
}

static int b_take(lua_State *L) {
    const char *fname = "ds4.batcher:take";
    ds4_model *m = NULL;
    batcher_box *b = batcher_check(L, 1, fname, &m);
    lua_settop(L, 1);
    genres_box *box = lua_newuserdata(L, sizeof *box); /* 2: owns the result until it is pushed */
    box->r = NULL;
    luaL_getmetatable(L, GENRES_MT);
    lua_setmetatable(L, -2);
    uint64_t tag = 0;
    ds4_status st = DS4_OK;
    if (!ds4_batcher_take(b->b, &tag, &box->r, &st)) return 0;
    push_pending(L, 1); /* 3 */
    lua_pushnumber(L, (lua_Number)tag);
    lua_rawget(L, 3); /* 4: the task's record */
    lua_pushnumber(L, (lua_Number)tag);
    lua_pushnil(L);
    lua_rawset(L, 3);
    lua_pushnumber(L, (lua_Number)tag); /* 5 */
    if (st != DS4_OK || !box->r || !lua_istable(L, 4)) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: the task ended with a failed step (%s): %s", fname, ds4_status_name(st), b->last_err);
        return 3;
    }
    double rec[7];
    for (int k = 0; k < 7; k++) {
        lua_rawgeti(L, 4, k + 1);
        rec[k] = k < 3 ? 0 : lua_tonumber(L, -1);
        if (k >= 3) lua_pop(L, 1);
    }
    /* stack 6..8: the stop scratch */
    const gen_stops stops = {.ids = lua_touserdata(L, 6), .strs = lua_touserdata(L, 7), .n_ids = (int64_t)rec[3],
                             .n_strs = (int64_t)rec[4]};
    push_gen_results(L, m, box->r, rec[5] != 0, rec[6] != 0, &stops, fname);
    ds4_gen_result_free(box->r);
    box->r = NULL;
    lua_pushvalue(L, 5);
    lua_insert(L, -2);
    return 2;
}

static int b_cancel(lua_State *L) {
    const char *fname = "ds4.batcher:cancel";
    batcher_box *b = batcher_check(L, 1, fname, NULL);
    const uint64_t tag = (uint64_t)ds4l_check_int(L, 2, fname, "bad argument #1 (tag)", 0, DS4L_MAX_EXACT, "a task's tag");
    lua_pushboolean(L, ds4_batcher_cancel(b->b, tag));
    return 1;
}

/* batcher:peek(tag [, from]) -> counts [, parts] | nil: what an unfinished task has generated so far
 * (ds4_batcher_peek). counts[i]: sequence i's tokens so far. With from (an array of per-sequence counts already
 * seen, missing ones 0), parts[i] = {ids = {...}, logprobs = {...}, sample_logprobs = {...}}: its tokens after
 * from[i]. nil once the task has finished (take it) or for an unknown tag. */
static int b_peek(lua_State *L) {
    const char *fname = "ds4.batcher:peek";
    batcher_box *b = batcher_check(L, 1, fname, NULL);
    const uint64_t tag = (uint64_t)ds4l_check_int(L, 2, fname, "bad argument #1 (tag)", 0, DS4L_MAX_EXACT, "a task's tag");
    const int with = !lua_isnoneornil(L, 3);
    if (with) luaL_checktype(L, 3, LUA_TTABLE);
    const ds4_gen_result *r = ds4_batcher_peek(b->b, tag);
    if (!r) return 0;
    lua_createtable(L, (int)r->nseq, 0);
    for (int64_t i = 0; i < r->nseq; i++) {
        lua_pushnumber(L, (lua_Number)r->seqs[i].n_ids);
        lua_rawseti(L, -2, (int)i + 1);
    }
    if (!with) return 1;
    lua_createtable(L, (int)r->nseq, 0);
    for (int64_t i = 0; i < r->nseq; i++) {
        const ds4_gen_seq *q = &r->seqs[i];
        lua_rawgeti(L, 3, (int)i + 1);
        int64_t from = lua_isnumber(L, -1) ? (int64_t)lua_tonumber(L, -1) : 0;
        lua_pop(L, 1);
        if (from < 0) from = 0;
        if (from > q->n_ids) from = q->n_ids;
        const int n = (int)(q->n_ids - from);
        lua_createtable(L, 0, 3);
        lua_createtable(L, n, 0);
        for (int k = 0; k < n; k++) {
            lua_pushnumber(L, (lua_Number)q->ids[from + k]);
            lua_rawseti(L, -2, k + 1);
        }
        lua_setfield(L, -2, "ids");
        lua_createtable(L, n, 0);
        for (int k = 0; k < n; k++) {
            lua_pushnumber(L, (lua_Number)q->logprobs[from + k]);
            lua_rawseti(L, -2, k + 1);
        }
        lua_setfield(L, -2, "logprobs");
        lua_createtable(L, n, 0);
        for (int k = 0; k < n; k++) {
            lua_pushnumber(L, (lua_Number)q->sample_logprobs[from + k]);
            lua_rawseti(L, -2, k + 1);
        }
        lua_setfield(L, -2, "sample_logprobs");
        lua_rawseti(L, -2, (int)i + 1);
    }
    return 2;
}

static int b_stats(lua_State *L) {
    batcher_box *b = batcher_check(L, 1, "ds4.batcher:stats", NULL);
    ds4_batcher_stats s;
    ds4_batcher_get_stats(b->b, &s);
    lua_createtable(L, 0, 8);
    ds4l_set_int(L, "queued", s.queued);
    ds4l_set_int(L, "running", s.running);
    ds4l_set_int(L, "finished", s.finished);
    ds4l_set_int(L, "seqs", s.seqs);
    ds4l_set_int(L, "free_seqs", s.free_seqs);
    ds4l_set_int(L, "steps", s.steps);
    ds4l_set_int(L, "prefill_tokens", s.prefill_tokens);
    ds4l_set_int(L, "decode_tokens", s.decode_tokens);
    return 1;
}

static int b_free(lua_State *L) {
    batcher_box *b = luaL_checkudata(L, 1, BATCHER_MT);
    ds4_batcher_free(b->b);
    b->b = NULL;
    lua_getfenv(L, 1);
    lua_newtable(L);
    lua_setfield(L, -2, "pending");
    return 0;
}

static int b_tostring(lua_State *L) {
    batcher_box *b = luaL_checkudata(L, 1, BATCHER_MT);
    if (!b->b) {
        lua_pushstring(L, "ds4.batcher (freed)");
        return 1;
    }
    ds4_batcher_stats s;
    ds4_batcher_get_stats(b->b, &s);
    lua_pushfstring(L, "ds4.batcher (%d running, %d queued, %d sequences, %d free)", (int)s.running, (int)s.queued,
                    (int)s.seqs, (int)s.free_seqs);
    return 1;
}

static const luaL_Reg batcher_methods[] = {
    {"submit", b_submit}, {"step", b_step}, {"take", b_take}, {"cancel", b_cancel},
    {"peek", b_peek},     {"stats", b_stats}, {"free", b_free}, {NULL, NULL},
};

/* ------------------------------------------------------------------------------------------------ module */

static const luaL_Reg gen_model_methods[] = {
    {"generate", m_generate},
    {"new_cache", m_new_cache},
    {"step", m_step},
    {"batcher", m_batcher},
    {NULL, NULL},
};

static const luaL_Reg cache_methods[] = {
    {"len", c_len},     {"capacity", c_capacity},   {"bytes", c_bytes}, {"reset", c_reset},
    {"copy_from", c_copy_from}, {"free", c_free}, {NULL, NULL},
};

/* Model methods that run or change the model: wrapped so that an on_token callback cannot re-enter them. */
static const char *const guarded_names[] = {
    "free", "forward", "zero_grad", "backward", "backward_logprobs", "set_train_options", "set_params", "to", NULL,
};

void ds4l_gen_open(lua_State *L) {
    int mod = lua_gettop(L);
    lua_getfield(L, mod, "model_methods");
    if (!lua_istable(L, -1)) ds4l_raise(L, "ds4.core: internal error: model_methods missing when adding generation");
    int methods = lua_gettop(L);
    for (const luaL_Reg *r = gen_model_methods; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, methods, r->name);
    }
    for (int i = 0; guarded_names[i]; i++) {
        lua_getfield(L, methods, guarded_names[i]);
        if (lua_iscfunction(L, -1) && !(lua_tocfunction(L, -1) == guarded_method)) {
            lua_pushstring(L, guarded_names[i]);
            lua_pushcclosure(L, guarded_method, 2);
            lua_setfield(L, methods, guarded_names[i]);
        } else {
            lua_pop(L, 1);
        }
    }
    lua_pop(L, 1);

    ds4l_weak_registry_table(L, BUSY_KEY, "kv");
    ds4l_class(L, CACHE_MT, cache_methods, cache_gc, c_tostring);
    lua_pop(L, 1);
    ds4l_class(L, BATCHER_MT, batcher_methods, batcher_gc, b_tostring);
    lua_pop(L, 1);
    if (luaL_newmetatable(L, GENRES_MT)) {
        lua_pushcfunction(L, genres_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_pop(L, 1);

    lua_pushcfunction(L, l_sample);
    lua_setfield(L, mod, "sample");
    lua_pushcfunction(L, l_sample_uniform);
    lua_setfield(L, mod, "sample_uniform");
    lua_pushcfunction(L, l_is_cache);
    lua_setfield(L, mod, "is_cache");
    lua_settop(L, mod);
}
