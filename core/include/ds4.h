/* ds4.h — the public, embeddable C API of libds4.
 *
 * Conventions
 *   - Every fallible function returns a ds4_status and, on failure, fills the caller's ds4_error with a
 *     message naming the stage, the operation and the shapes involved. The error pointer may be NULL.
 *   - Nothing here exits or aborts; there is no global mutable state. An engine (thread pool, options) is a
 *     value the caller creates and frees; models belong to one engine.
 *   - Sizes and shapes are int64_t; shape arrays are outermost-first (row-major, C order).
 */
#ifndef DS4_H
#define DS4_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_VERSION_MAJOR 0
#define DS4_VERSION_MINOR 1
#define DS4_VERSION_PATCH 0
#define DS4_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------------------------------------ errors */

typedef enum ds4_status {
    DS4_OK = 0,
    DS4_ERR_ARG,          /* invalid argument from the caller */
    DS4_ERR_IO,           /* open/read/write/mmap failed */
    DS4_ERR_FORMAT,       /* malformed file or message (safetensors header, JSON, ...) */
    DS4_ERR_CONFIG,       /* invalid or inconsistent model configuration */
    DS4_ERR_SHAPE,        /* shape or size mismatch */
    DS4_ERR_OOM,          /* allocation failed */
    DS4_ERR_UNSUPPORTED,  /* valid input that this build does not handle */
    DS4_ERR_NOT_FOUND,    /* a named item (tensor, file, key) is missing */
    DS4_ERR_CUDA,         /* CUDA / cuBLAS / NCCL failure */
    DS4_ERR_INTERNAL,     /* a broken invariant: a bug in ds4 */
    DS4_ERR_COMM          /* a collective between ranks failed (MPI): a peer gone, the network */
} ds4_status;

typedef struct ds4_error {
    ds4_status code;
    char msg[1024];
} ds4_error;

const char *ds4_status_name(ds4_status s);

/* ------------------------------------------------------------------------------------------------ dtypes */

typedef enum ds4_dtype {
    DS4_F32 = 0,
    DS4_F16,
    DS4_BF16,
    DS4_F64,
    DS4_I64,
    DS4_I32,
    DS4_I16,
    DS4_I8,
    DS4_U8,
    DS4_BOOL,
    DS4_F8_E4M3,
    DS4_F8_E5M2,
    DS4_F8_E8M0,
    DS4_DTYPE_COUNT
} ds4_dtype;

size_t ds4_dtype_size(ds4_dtype t);                       /* bytes per element; 0 for an invalid value */
const char *ds4_dtype_name(ds4_dtype t);                  /* safetensors spelling: "F32", "BF16", ... */
int ds4_dtype_from_name(const char *name, size_t len, ds4_dtype *out); /* 1 if known, 0 otherwise */
int ds4_dtype_is_float(ds4_dtype t);

/* ------------------------------------------------------------------------------------------------ tensors */

#define DS4_MAX_DIMS 8

/* A dense, contiguous, row-major tensor in host memory. Reference-counted: ds4_tensor_new returns one
 * reference; ds4_tensor_release drops it and frees the tensor at zero. A tensor whose refcount is <= 0 is a
 * borrowed view (e.g. from ds4_model_tensor_at): retain/release leave it alone. */
typedef struct ds4_tensor {
    ds4_dtype dtype;
    int32_t ndim;
    int64_t shape[DS4_MAX_DIMS];
    void *data;
    size_t nbytes;
    int32_t refcount;
} ds4_tensor;

ds4_status ds4_tensor_new(ds4_dtype dtype, int32_t ndim, const int64_t *shape, ds4_tensor **out, ds4_error *err);
void ds4_tensor_retain(ds4_tensor *t);
void ds4_tensor_release(ds4_tensor *t);
int64_t ds4_tensor_numel(const ds4_tensor *t);
/* Element i (flat, row-major) as a double, whatever the dtype (F8/F16/BF16 decoded exactly). */
double ds4_tensor_get(const ds4_tensor *t, int64_t i);
/* Store v into element i, rounding to the tensor's dtype (round-to-nearest-even for BF16/F16). */
void ds4_tensor_set(ds4_tensor *t, int64_t i, double v);

/* Decode n elements of any numeric dtype at src into float. */
ds4_status ds4_convert_to_f32(ds4_dtype src_dtype, const void *src, int64_t n, float *dst, ds4_error *err);
float ds4_bf16_to_f32(uint16_t h);
uint16_t ds4_f32_to_bf16(float f);
float ds4_f16_to_f32(uint16_t h);
uint16_t ds4_f32_to_f16(float f);
float ds4_f8e4m3_to_f32(uint8_t b);
float ds4_f8e5m2_to_f32(uint8_t b);
float ds4_f8e8m0_to_f32(uint8_t b);

/* ------------------------------------------------------------------------------------------------ safetensors */

/* One tensor inside an opened safetensors file. `data` points into the mapping (valid until close); it may be
 * unaligned for files from other writers (ours and Python's pad the header to 8 bytes): read with memcpy. */
typedef struct ds4_st_entry {
    const char *name;
    ds4_dtype dtype;
    int32_t ndim;
    int64_t shape[DS4_MAX_DIMS];
    const void *data;
    size_t nbytes;
} ds4_st_entry;

typedef struct ds4_st_file ds4_st_file;

/* mmap a file and validate its header: header length bounds, JSON syntax, known dtypes, shapes whose byte
 * count matches the offsets, offsets inside the data area, no overlapping tensors, no duplicate names. */
ds4_status ds4_st_open(const char *path, ds4_st_file **out, ds4_error *err);
/* Same validation over a caller-owned buffer (borrowed, must outlive the handle): for tests and fuzzing. */
ds4_status ds4_st_open_memory(const void *buf, size_t len, ds4_st_file **out, ds4_error *err);
void ds4_st_close(ds4_st_file *f);
size_t ds4_st_count(const ds4_st_file *f);
const ds4_st_entry *ds4_st_entry_at(const ds4_st_file *f, size_t i);   /* in file (offset) order */
const ds4_st_entry *ds4_st_find(const ds4_st_file *f, const char *name);
/* A string value of the "__metadata__" object, or NULL. */
const char *ds4_st_metadata(const ds4_st_file *f, const char *key);

/* Write tensors to `path` (atomically: a temporary file renamed into place). Names must be unique. */
ds4_status ds4_st_write(const char *path, size_t n, const char *const *names, const ds4_tensor *const *tensors,
                        ds4_error *err);

/* A checkpoint: a path to a single .safetensors file, or a directory holding (looked for in this order, as
 * transformers does) model.safetensors, or model.safetensors.index.json plus its shards, or exactly one
 * *.safetensors file. Entries of all shards are visible through one handle, in name (byte) order. */
typedef struct ds4_checkpoint ds4_checkpoint;
ds4_status ds4_checkpoint_open(const char *path, ds4_checkpoint **out, ds4_error *err);
void ds4_checkpoint_close(ds4_checkpoint *c);
size_t ds4_checkpoint_count(const ds4_checkpoint *c);
const ds4_st_entry *ds4_checkpoint_entry_at(const ds4_checkpoint *c, size_t i);
const ds4_st_entry *ds4_checkpoint_find(const ds4_checkpoint *c, const char *name);

/* ------------------------------------------------------------------------------------------------ config */

#define DS4_MAX_LAYERS 256

typedef enum ds4_attn_type { DS4_ATTN_SLIDING = 0, DS4_ATTN_CSA = 1, DS4_ATTN_HCA = 2 } ds4_attn_type;
typedef enum ds4_rope_type { DS4_ROPE_DEFAULT = 0, DS4_ROPE_YARN = 1 } ds4_rope_type;
typedef enum ds4_score_func { DS4_SCORE_SQRTSOFTPLUS = 0, DS4_SCORE_SIGMOID = 1, DS4_SCORE_SOFTMAX = 2 } ds4_score_func;

typedef struct ds4_rope_params {
    ds4_rope_type type;
    double theta;
    double partial_rotary_factor;
    int64_t dim;              /* rotary width r = int(head_dim * partial_rotary_factor): the trailing r
                                 channels of a head (and of an indexer head) are rotated */
    /* YaRN only */
    double factor;
    double original_max_position_embeddings;
    double beta_fast, beta_slow;
    double attention_factor;  /* scales cos/sin; transformers injects 1.0 for the flat (legacy) form, a nested
                                 yarn dict without it gets YaRN's mscale 0.1·ln(factor) + 1 */
    int32_t truncate;         /* floor/ceil the correction range (HF default: true) */
} ds4_rope_params;

/* Every field the architecture uses, after the folding transformers applies (legacy spellings such as
 * compress_ratios, compress_rate_csa/hca, num_hash_layers, qk_rope_head_dim, rope_scaling are accepted). */
typedef struct ds4_config {
    int64_t vocab_size;
    int64_t hidden_size;             /* D */
    int64_t num_hidden_layers;       /* L */
    int64_t num_attention_heads;     /* H */
    int64_t num_key_value_heads;     /* must be 1 (shared K=V head) */
    int64_t head_dim;                /* d */
    int64_t rope_head_dim;           /* top-level qk_rope_head_dim = int(head_dim * partial_rotary_factor); the
                                        widths actually used are rope_main.dim and rope_compress.dim */
    int64_t q_lora_rank;
    int64_t o_groups;
    int64_t o_lora_rank;
    int64_t sliding_window;
    int64_t compress_rate_csa;       /* m of CSA layers (4 in every release; overlapping windows of 2m) */
    int64_t compress_rate_hca;
    ds4_attn_type layer_types[DS4_MAX_LAYERS];
    int32_t layer_is_hash[DS4_MAX_LAYERS]; /* 1: hash_moe (tid2eid routing), 0: learned top-k */
    int64_t index_n_heads;
    int64_t index_head_dim;
    int64_t index_topk;
    int64_t n_routed_experts;        /* E */
    int64_t num_experts_per_tok;     /* K */
    int64_t n_shared_experts;
    int64_t moe_intermediate_size;   /* I */
    ds4_score_func scoring_func;
    int32_t norm_topk_prob;
    double routed_scaling_factor;
    double swiglu_limit;
    int64_t hc_mult;                 /* n */
    int64_t hc_sinkhorn_iters;
    double hc_eps;
    double rms_norm_eps;
    ds4_rope_params rope_main;       /* sliding layers (and MTP) */
    ds4_rope_params rope_compress;   /* CSA / HCA layers, their compressors and indexers */
    int64_t max_position_embeddings;
    int64_t num_nextn_predict_layers;
    int32_t tie_word_embeddings;
    int64_t bos_token_id;
    int64_t eos_token_id;
    double initializer_range;
} ds4_config;

/* Parse a config.json text. Errors name the offending field. */
ds4_status ds4_config_parse(const char *json, size_t len, ds4_config *out, ds4_error *err);
/* `path` is a config.json file or a checkpoint directory containing one. */
ds4_status ds4_config_load(const char *path, ds4_config *out, ds4_error *err);
/* Consistency checks (positive sizes, divisibility, rates, rope widths). ds4_config_parse calls it. */
ds4_status ds4_config_validate(const ds4_config *c, ds4_error *err);
/* The V4-Flash defaults transformers uses for absent fields. */
void ds4_config_default(ds4_config *c);
/* Write the config as JSON in HF's modern form (layer_types, compress_rates, nested rope_parameters).
 * Returns a malloc'd NUL-terminated string or NULL on OOM. */
char *ds4_config_to_json(const ds4_config *c);
const char *ds4_attn_type_name(ds4_attn_type t);

/* ------------------------------------------------------------------------------------------------ engine */

typedef struct ds4_engine ds4_engine;

/* Where a model computes (docs/design.md). CPU: fp32, the reference. CUDA: device `index`, with the weight
 * matrices that matmuls read held in `dtype` (DS4_F32, the reference mode, or DS4_BF16: bf16 weights, fp32
 * activations and accumulation; norms, softmax, Sinkhorn, router scores, compressor gates and log-softmax stay
 * fp32). A zero-initialised value is the CPU. */
typedef enum ds4_device_type { DS4_DEVICE_CPU = 0, DS4_DEVICE_CUDA = 1 } ds4_device_type;
typedef struct ds4_device_options {
    ds4_device_type type;
    int32_t index;      /* CUDA device ordinal */
    ds4_dtype dtype;    /* DS4_F32 (0) or DS4_BF16; the CPU is always fp32 */
} ds4_device_options;

typedef struct ds4_engine_options {
    int32_t n_threads;  /* 0: one per physical core this process may run on (affinity, cgroup quota), at most 16 (core/cpus.c) */
    ds4_device_options device; /* where models loaded or created by this engine compute (default: the CPU) */
    int32_t profile;    /* nonzero: per-op profiles from the start (also: environment DS4_PROFILE=1) */
} ds4_engine_options;

ds4_status ds4_engine_create(const ds4_engine_options *opt, ds4_engine **out, ds4_error *err);
void ds4_engine_free(ds4_engine *e);
int32_t ds4_engine_threads(const ds4_engine *e);
/* Switch the per-op profile of every model of the engine on or off (from their next pass); see
 * ds4_model_profile_report. */
void ds4_engine_set_profile(ds4_engine *e, int on);
int ds4_engine_profile(const ds4_engine *e);
/* Build facts for `ds4 version`: "cpu", "cpu+cuda", ... */
const char *ds4_build_info(void);
/* The number of CUDA devices this process can use: 0 in a build without CUDA, without a driver or without a GPU. */
ds4_status ds4_cuda_devices(int32_t *n, ds4_error *err);
/* Parse a device spelling: "cpu", "cuda" (device 0) or "cuda:N", optionally followed by a space and a dtype
 * ("cuda:1 bf16", as ds4_model_device_name writes it). `dtype` (may be NULL) names the dtype separately: "fp32"
 * ("f32", "float32") or "bf16" ("bfloat16"), case-insensitive; given both ways they must agree. Without a dtype: fp32
 * on the CPU, bf16 on CUDA. Checks the spelling only, not whether such a device exists (ds4_model_to does). */
ds4_status ds4_device_parse(const char *spec, const char *dtype, ds4_device_options *out, ds4_error *err);

/* ------------------------------------------------------------------------------------------------ model */

typedef struct ds4_model ds4_model;

/* Load an HF-format checkpoint directory (config.json + safetensors). Tensor names may be the official
 * release names, the names transformers' save_pretrained writes (official names under "model."), or the HF
 * module names (packed experts). Missing or unexpected tensors give an error listing them. */
ds4_status ds4_model_load(ds4_engine *e, const char *dir, ds4_model **out, ds4_error *err);

typedef struct ds4_load_options {
    /* Keep the routed experts the checkpoint stores in FP4 packed in memory as stored (4.25 bits per parameter:
     * e2m1 pairs and an e8m0 scale per 32), decoded tile by tile inside the expert products, instead of dequantising
     * them to fp32. They are then frozen (not parameters: full fine-tuning trains everything else, LoRA adapters
     * train on top). On CUDA (ds4_model_to) they stay packed in device memory and the expert kernels decode them.
     * docs/checkpoints.md, "FP4-resident experts". */
    int32_t fp4_experts;
    /* Sharded experts from the start (expert parallelism, docs/distributed.md "Sharded experts"): with
     * expert_shard_world > 0 the model keeps only rank expert_shard_rank's routed experts, as turning expert parallelism
     * on with `shard` over that world would leave it; the other experts are read and checked one tensor at a time but
     * not kept, so the whole weights are never resident. 0: every expert. CPU models. */
    int32_t expert_shard_rank, expert_shard_world;
} ds4_load_options;
/* ds4_model_load with options (NULL: the defaults, as ds4_model_load). */
ds4_status ds4_model_load_opts(ds4_engine *e, const char *dir, const ds4_load_options *opt, ds4_model **out,
                               ds4_error *err);
/* The bytes the model's FP4-resident experts occupy (packed values and scales); 0 without them. */
int64_t ds4_model_fp4_bytes(const ds4_model *m);
/* The bytes of the model's weights on its backend: ds4_model_to's copy, 0 on the CPU backend (which computes with
 * the host buffers). *fp4_bytes (may be NULL): of those, the FP4-resident experts', packed as on the host
 * (ds4_model_fp4_bytes, plus at most 15 bytes of alignment per expert kind of a block). */
int64_t ds4_model_device_bytes(const ds4_model *m, int64_t *fp4_bytes);
/* A model with random weights (HF init: N(0, initializer_range²), norms 1, ...) for benchmarks and training
 * from scratch. */
ds4_status ds4_model_create_random(ds4_engine *e, const ds4_config *cfg, uint64_t seed, ds4_model **out,
                                   ds4_error *err);
void ds4_model_free(ds4_model *m);
const ds4_config *ds4_model_config(const ds4_model *m);
int ds4_model_has_mtp(const ds4_model *m);
int64_t ds4_model_param_count(const ds4_model *m);      /* trainable fp32 parameters (with sharded experts: those
                                                            this rank holds; ds4_train.h) */

/* Named parameters (canonical official names, e.g. "layers.0.attn.wq_a.weight"). The view aliases the
 * model's flat buffer: data stays valid while the model lives. */
size_t ds4_model_tensor_count(const ds4_model *m);
ds4_status ds4_model_tensor_at(const ds4_model *m, size_t i, const char **name, ds4_tensor *view, ds4_error *err);

/* The name tensor i had in the checkpoint the model was loaded from (NULL for a model that was not loaded).
 * *part (may be NULL) says where it sat: 0 the whole tensor; 1 / 3 the gate (w1) / up (w3) rows of expert
 * *expert in an HF packed experts.gate_up_proj [E, 2I, D]; 2 expert *expert's slice of experts.down_proj
 * [E, D, I]. Gradients and saved tensors can so be keyed the way the user's checkpoint names them. */
const char *ds4_model_tensor_source(const ds4_model *m, size_t i, int32_t *part, int64_t *expert);

typedef struct ds4_forward_args {
    const int64_t *ids;       /* [B, S] token ids */
    int64_t batch;            /* B */
    int64_t seq;              /* S */
    const int64_t *labels;    /* [B, S] or NULL; HF convention: position t is scored against labels[t+1],
                                 -100 is ignored, the loss is the mean over scored tokens */
    float *logits;            /* out [B, S, V], or NULL if not wanted */
    float *mtp_logits;        /* out [B, S-1, V] (position i predicts ids[i+2]), or NULL: MTP not run */
    float *hidden;            /* out [L, B, S, n, D] residual streams after each layer, or NULL */
    /* Routing replay (e.g. the routing a rollout recorded, ds4_gen.h): the experts and indexer picks to use
     * instead of the ones the forward would select. The routing weights are still computed from the router's
     * scores at the given experts (so the router gets its gradient); only the selection is replayed. A row whose
     * first value is -1 is routed normally (padding, or a token the rollout did not run). Hash-routed layers and
     * the MTP block always route themselves. */
    const int32_t *replay_experts; /* [B, S, L, K] expert ids (distinct per row, in [0, E)), or NULL */
    const int32_t *replay_index;   /* [B, S, n_csa, index_topk] indexer picks (-1 padded; each < the causal entry
                                      count (s+1)/m, distinct), or NULL */
    /* [B] each row's real length (0..S), or NULL: every position real. Positions s >= lengths[b] are right padding:
     * the indexer KL loss (training, indexer_kl > 0) leaves them out of its value, its query count and its gradient
     * (a real query never attends to a later padded one, so the rest is unchanged). CE and MTP leave padding out
     * through labels -100. */
    const int64_t *lengths;
} ds4_forward_args;

typedef struct ds4_forward_result {
    double loss;              /* NaN when no labels or no scored token */
    int64_t loss_tokens;
    double mtp_loss;          /* CE of mtp_logits[i] against labels[i+2]; NaN when not computed */
    int64_t mtp_loss_tokens;
    double indexer_loss;      /* training forward with indexer_kl > 0: the indexer KL loss (unweighted); else NaN */
    int64_t indexer_queries;  /* its queries with picks in one CSA layer: the real (not padded, args.lengths)
                                 positions s >= compress_rate_csa - 1, ds4_model_indexer_queries (the same in every
                                 CSA layer) */
} ds4_forward_result;

/* Runs on the engine's thread pool. A model reuses one workspace (planned from B and S, grown when needed), so
 * it serves one forward at a time: callers must not run two forwards of the same model concurrently.
 * Results do not depend on the number of threads (bit-identical). */
ds4_status ds4_model_forward(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_error *err);

/* Move the model to another device (or back to the CPU): its weights are copied there in the device's working
 * dtype, and every later forward, step and generation runs there; tensors handed back are host memory. The host
 * fp32 parameters stay the master copy (ds4_model_params). Caches made before the move belong to the old device
 * (a step with them is an error). Fails without changing anything when there is no such device, the build has no
 * CUDA, or the device memory is short (the message says how much was asked and how much is free). */
ds4_status ds4_model_to(ds4_model *m, const ds4_device_options *o, ds4_error *err);
ds4_device_options ds4_model_device(const ds4_model *m);
/* The FP8 KV quantisation-aware option (off by default; docs/architecture.md, "FP8 KV quantisation-aware
 * training"), as the official inference code computes: window keys and the attention compressor's entries have
 * their non-RoPE channels rounded to FP8 e4m3 in blocks of 64 with power-of-two scales; the indexer's queries and
 * entries are Hadamard-rotated and rounded to FP4 e2m1 in blocks of 32. Every forward, step and generation of the
 * model applies it the same way (so rollout and training log-probabilities still agree exactly); gradients pass
 * straight through the rounding. Set it before making caches: a cache holds what was computed when it was filled.
 * Both backends: the CUDA backend rounds a vector to the CPU's bits given the same input. The indexer needs a
 * power-of-two index_head_dim. */
ds4_status ds4_model_set_kv_qat(ds4_model *m, int on, ds4_error *err);
int ds4_model_kv_qat(const ds4_model *m);
/* The CPU's emulation of the CUDA bf16 mode (a model on the CPU only): every product's operands are rounded to bf16
 * to nearest even where the bf16 mode rounds them (the activations of the linear products, the attention's q, keys
 * and probabilities), the sums stay fp32. With the weight matrices rounded to bf16 too (write them through
 * ds4_model_params), the model computes what the GPU's bf16 mode computes up to fp32 summation order: the reference
 * the bf16 tests compare the GPU with, and a way to see how far bf16 moves a model from fp32. */
ds4_status ds4_model_set_bf16_emulation(ds4_model *m, int on, ds4_error *err);
int ds4_model_bf16_emulation(const ds4_model *m);
/* A short description: "cpu", "cuda:0 bf16". */
const char *ds4_model_device_name(const ds4_model *m);
/* Call after writing to the host parameters (ds4_model_params, tensor views): a model on a device refreshes its copy
 * before its next pass. ds4's own writers (optimizer steps, router-bias updates, checkpoint loads) call it. */
void ds4_model_params_changed(ds4_model *m);
/* The per-op profile of the model's backend since the last reset (time per op of the operation table, calls, bytes),
 * sorted by time, as text (NUL-terminated, truncated to len); returns its length. */
size_t ds4_model_profile_report(ds4_model *m, char *buf, size_t len);
void ds4_model_profile_reset(ds4_model *m);

/* Plan the memory of passes of up to `tokens` rows at positions < `max_pos` (a forward of [B, S] is B·S rows at
 * positions < S; a step of N new tokens whose longest sequence reaches P is N rows at positions < P) now, on the
 * model's backend, so that such passes allocate nothing (the workspace only grows). With `training`, also the
 * backward's scratch. Optional: a pass plans what it needs itself. */
ds4_status ds4_model_reserve(ds4_model *m, int64_t tokens, int64_t max_pos, int training, ds4_error *err);

#ifdef __cplusplus
}
#endif

#include "ds4_train.h"
#include "ds4_ckpt.h"
#include "ds4_tokenizer.h"
#include "ds4_gen.h"

#endif /* DS4_H */
