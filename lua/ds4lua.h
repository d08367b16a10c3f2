/* ds4lua.h — declarations shared by the `ds4` host program's translation units (the .c files of lua/).
 *
 * Ownership rule for every binding: a C resource is boxed in a userdata with a __gc *before* anything that
 * can raise a Lua error runs (the box is pushed first, empty, then filled). A Lua error unwinds over C
 * frames with longjmp, so a resource held only in a C local would leak; a resource owned by a box on the
 * Lua stack is collected. Scratch memory comes from lua_newuserdata for the same reason. */
#ifndef DS4LUA_H
#define DS4LUA_H

#include <stdint.h>

#include <lauxlib.h>
#include <lua.h>

#include "ds4.h"

#if defined(__GNUC__)
#define DS4L_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define DS4L_NORETURN __attribute__((noreturn))
#else
#define DS4L_PRINTF(a, b)
#define DS4L_NORETURN
#endif

#define DS4L_MAX_EXACT 9007199254740992.0 /* 2^53: every integer up to here is exact in a Lua number */

#define DS4L_TENSOR_MT "ds4.tensor"
#define DS4L_MODEL_MT "ds4.model"
/* Registry key under which the `ds4` host may store a lightuserdata pointing to a `volatile int` that its SIGINT
 * handler sets; model:generate passes it to ds4_generate as the cancel flag (it reads it, never clears it). */
#define DS4L_INTERRUPT_KEY "ds4.interrupt"

/* Full userdata behind a Lua tensor: one reference to a ds4_tensor (NULL only while being built). */
typedef struct ds4l_tensor {
    ds4_tensor *t;
} ds4l_tensor;

/* Raise a Lua error "<where>: <formatted message>" (where = script position of the caller, as luaL_error
 * does). Never returns. Callers must hold no C resource that is not owned by a Lua value. */
DS4L_NORETURN void ds4l_raise(lua_State *L, const char *fmt, ...) DS4L_PRINTF(2, 3);
/* Raise "<fname>: <ds4 error message>". */
DS4L_NORETURN void ds4l_raise_ds4(lua_State *L, const char *fname, const ds4_error *err);

/* Shape as "[2, 37, 256]" into buf (always NUL-terminated). */
void ds4l_format_shape(char *buf, size_t cap, int32_t ndim, const int64_t *shape);

/* Push an empty tensor box (t == NULL) with the tensor metatable; fill box->t afterwards. */
ds4l_tensor *ds4l_tensor_push_box(lua_State *L);
/* Push a new tensor of the given dtype and shape (zero-filled by ds4_tensor_new); returns it. Raises with
 * `fname` as prefix on failure. */
ds4_tensor *ds4l_tensor_push_new(lua_State *L, const char *fname, ds4_dtype dtype, int32_t ndim,
                                 const int64_t *shape);
/* The tensor at stack index idx, or NULL when that value is not a ds4 tensor. */
ds4_tensor *ds4l_tensor_test(lua_State *L, int idx);
/* The tensor at idx; raises "<fname>: bad argument #<argn> (ds4.tensor expected, got <type>)" otherwise. */
ds4_tensor *ds4l_tensor_check(lua_State *L, int idx, const char *fname, int argn);
/* Parse a dtype name ("F32", "bf16", ...; case-insensitive) at idx; `def` when the value is nil/none. */
ds4_dtype ds4l_check_dtype(lua_State *L, int idx, const char *fname, int argn, int has_def, ds4_dtype def);

/* lua/opts_lua.c: result tables and options tables, one message format for every binding (see that file).
 * set_*: t[k] = v for the table at the top of the stack. */
void ds4l_set_num(lua_State *L, const char *k, double v);
void ds4l_set_int(lua_State *L, const char *k, int64_t v);
void ds4l_set_bool(lua_State *L, const char *k, int v);
void ds4l_set_str(lua_State *L, const char *k, const char *v);
/* *out = v when v is integral and in int64 range (a double -> int64 cast of anything else is undefined); else 0. */
int ds4l_number_to_i64(lua_Number v, int64_t *out);
/* A short printable form of the value at idx for messages: 1.5, "text", true, or "a table". */
const char *ds4l_value_str(lua_State *L, int idx, char *buf, size_t cap);
/* The integer at idx in [lo, hi]; raises "<fname>: <what> must be <desc>, got <value>" otherwise. */
int64_t ds4l_check_int(lua_State *L, int idx, const char *fname, const char *what, double lo, double hi,
                       const char *desc);
/* The table at idx of n integers, each in [lo, hi] (else "<fname>: <what>[i] must be <desc>, got <value>"), as a
 * userdata array pushed on the stack (it lives while it stays there). */
const int64_t *ds4l_check_int_list(lua_State *L, int idx, const char *fname, const char *what, int64_t n, double lo,
                                   double hi, const char *desc);
/* The options table at idx (argument #argn as the user counts it), as an absolute index; 0 when nil or none;
 * raises "<fname>: bad argument #<argn> (options table expected, got <type>)" for anything else. */
int ds4l_opt_table(lua_State *L, int idx, const char *fname, int argn);
/* The same for an options table that must be given. */
int ds4l_check_opts(lua_State *L, int idx, const char *fname, int argn);
/* Raise "<fname>: unknown option '<key>' (known: <known>)" for the key at key_idx. */
DS4L_NORETURN void ds4l_raise_unknown_option(lua_State *L, const char *fname, int key_idx, const char *known);
/* Refuse any key of the options table at opts (0: none given) that is not in `known` (NULL-terminated). */
void ds4l_check_keys(lua_State *L, int opts, const char *fname, const char *const *known);
/* opts.key (opts: an index from ds4l_opt_table; 0 = no table): `def` when absent or nil, else the value when it is
 * of the kind asked for, else raise "<fname>: opts.<key> must be <desc>, got <value>". Integers and numbers must
 * lie in [lo, hi] (NaN never does; for an open bound at 0 pass the least positive double); an integer's bounds
 * and def lie within ±DS4L_MAX_EXACT. opt_str's string lives as long as the options table holds it. */
int ds4l_opt_bool(lua_State *L, int opts, const char *key, int def, const char *fname);
int64_t ds4l_opt_int(lua_State *L, int opts, const char *key, int64_t def, double lo, double hi, const char *desc,
                     const char *fname);
double ds4l_opt_num(lua_State *L, int opts, const char *key, double def, double lo, double hi, const char *desc,
                    const char *fname);
const char *ds4l_opt_str(lua_State *L, int opts, const char *key, const char *def, const char *fname);

/* Register the tensor metatable and put the tensor functions (tensor, zeros, load_tensors, save_tensors,
 * ...) into the table at the top of the stack. */
void ds4l_tensor_open(lua_State *L);

/* Put ds4.tokenizer, ds4.is_tokenizer, ds4.special_tokens and the tokenizer metatable into the table at the top of
 * the stack (tokenizer_lua.c). */
void ds4l_tokenizer_open(lua_State *L);

/* Push the metatable `mt`, creating it first when it does not exist yet: __index = a table of `methods`, __gc,
 * __tostring (either may be NULL) and __name. Returns 1 when it was created. */
int ds4l_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction tostring);
/* Push a new userdata of `size` bytes (zeroed) with metatable `mt` whose environment table holds the model at
 * stack index model_idx under "model", so the model outlives the object (caches, optimizers). */
void *ds4l_push_model_owned(lua_State *L, size_t size, const char *mt, int model_idx);
/* Make sure the registry holds a table under `key` with weak `mode` ("k", "v", "kv"); nothing is pushed. */
void ds4l_weak_registry_table(lua_State *L, const char *key, const char *mode);

/* The ds4_tokenizer behind a ds4.tokenizer at idx, or NULL when the value is not one; *freed = 1 for a tokenizer
 * that has been freed (tokenizer_lua.c). */
const ds4_tokenizer *ds4l_tokenizer_test(lua_State *L, int idx, int *freed);

/* 1 when the model userdata at idx is generating (its model:generate is on the C stack: the caller is inside an
 * on_token callback), when nothing may change its weights (gen_lua.c). */
int ds4l_model_busy(lua_State *L, int idx);

/* The `ds4.core` module: package.preload["ds4.core"]. */
int luaopen_ds4_core(lua_State *L);

/* lua/binding.c: the live model behind the ds4.model at idx; raises "<fname>: ..." when the value is not a
 * model or the model has been freed. */
ds4_model *ds4l_model_check(lua_State *L, int idx, const char *fname);
/* The live optimizer (ds4.adamw userdata) at idx, its model alive too; raises otherwise (train_lua.c). */
ds4_adamw *ds4l_adamw_check(lua_State *L, int idx, const char *fname);
/* lua/save_lua.c: add model:save to the model methods and the ds4.checkpoints table to the module table at the
 * top of the stack. */
void ds4l_save_open(lua_State *L);
/* lua/train_lua.c: add zero_grad / backward / grads to the model methods and ds4.adamw to the module table at
 * the top of the stack. */
void ds4l_train_open(lua_State *L);
/* lua/lora_lua.c: add lora / save_lora / load_lora / merge_lora / ... to the model methods (docs/lora.md). */
void ds4l_lora_open(lua_State *L);
/* lua/params_lua.c: add params / set_params / tables_crc (the flat fp32 parameter buffer, for weight sync) to the
 * model methods. */
void ds4l_params_open(lua_State *L);
/* lua/gen_lua.c: add generate / new_cache / step to the model methods and ds4.sample, ds4.sample_uniform,
 * ds4.is_cache to the module table at the top of the stack. */
void ds4l_gen_open(lua_State *L);
/* lua/zmq_lua.c: put the ds4.zmq table (sockets, poll, CURVE keys, the ZAP handler) into the module table at the
 * top of the stack. The ZeroMQ context belongs to the lua_State: made on first use, terminated at lua_close. */
void ds4l_zmq_open(lua_State *L);
/* lua/zmq_lua.c: `ds4 keygen [--out PREFIX] [--force]` (argv[1] is "keygen"); returns the exit status (0 ok, 1
 * failure, 2 usage error). */
int ds4l_keygen_main(int argc, char **argv);
/* lua/wire_lua.c: put the ds4.wire table (the rollout wire codec, rollout/wire.h) into the module table at the top
 * of the stack. */
void ds4l_wire_open(lua_State *L);
/* lua/dist_lua.c: put the ds4.dist table (the communicator and collectives on tensors, dist/ds4_dist.h) into the
 * module table at the top of the stack. */
void ds4l_dist_open(lua_State *L);
/* lua/tb_lua.c (built with protobuf-c only: DS4_HAVE_TENSORBOARD): put the ds4.tb table (TensorBoard event records)
 * into the module table at the top of the stack. */
void ds4l_tb_open(lua_State *L);
/* lua/train_lua.c: model:forward's pass: a training forward (activations kept for model:backward) when
 * opts.train is true, or when it is nil and labels are given to a model with gradients enabled; else
 * ds4_model_forward. model_idx: the model's stack slot; opts_idx: the options table's slot, or 0. */
ds4_status ds4l_train_forward(lua_State *L, int model_idx, int opts_idx, ds4_model *m, const ds4_forward_args *args,
                              ds4_forward_result *res, ds4_error *err);

#endif
