/* model.h — the model's internal layout.
 *
 * All trainable parameters live in ONE flat fp32 buffer (`params`, host memory: the master copy); a table of named
 * views (canonical official names, shape, offset) describes it. A view set (ds4_weights) holds one pointer per
 * tensor: `w` points into `params` and is what the CPU backend computes with; a model moved to another backend
 * (ds4_model_to) also has `dw`, the same views bound to that backend's copy of the weights, where the matrices a
 * matmul reads may be held in a lower precision (`mdt`, see ds4_param_lowp). Checkpoint I/O, gradients and the
 * optimizer work on the flat buffers; the names exist for I/O. The hash-routing tables (tid2eid) are integer
 * buffers outside it: they are data, not parameters. Routed experts of a layer are contiguous:
 * w1 [E, I, D], w2 [E, D, I], w3 [E, I, D]. A model loaded with FP4-resident experts (ds4_load_options.fp4_experts,
 * docs/checkpoints.md) keeps the routed experts its checkpoint stores in FP4 outside the flat buffer too, packed as
 * stored (fp4.h) in one byte buffer `q4`: per layer and kind the E experts' bytes, then their scales. They are
 * frozen: not parameters, no gradient, never changed. */
#ifndef DS4_MODEL_H
#define DS4_MODEL_H

#include <stdint.h>

#include "ds4.h"
#include "engine.h"

/* A LoRA adapter on one weight W [O, K] (docs/lora.md): y = x Wᵀ + s·(x Aᵀ)·B with A [r, K] and B [r, O]. B is
 * PEFT's lora_B transposed, so the forward's add and every backward product is an existing operation (matmul,
 * linear_bwd_x / _w) with no transposed copy. Routed experts: A [E, r, K], B [E, r, O]. Adapters are fp32 in every
 * mode. NULL: no adapter on that weight. */
typedef struct ds4_lora_ab {
    float *A, *B;
} ds4_lora_ab;

/* The adapters of one decoder block, in some memory (the host's, a backend's, or their gradients). */
typedef struct ds4_lora_layer {
    int64_t r;                           /* rank */
    float s;                             /* alpha / r (alpha / sqrt(r) with rsLoRA) */
    ds4_lora_ab wq_a, wq_b, wkv, wo_b;
    ds4_lora_ab wo_a;                    /* A [r, H·d/g] shared by the groups, B [g, r, o_lora] one block per group */
    ds4_lora_ab idx_wq_b, idx_weights;   /* the lightning indexer's query and head-weight projections */
    ds4_lora_ab sw1, sw2, sw3;           /* shared expert */
    ds4_lora_ab e13;                     /* routed gate_up: A [E, r, D] shared by w1 and w3 (PEFT's layout for the
                                            packed gate_up_proj), B [E, r, I] the w1 half */
    float *e3B;                          /* [E, r, I] the w3 half of the gate_up B */
    ds4_lora_ab e2;                      /* routed down: A [E, r, I], B [E, r, D] */
} ds4_lora_layer;

/* In a view set whose mdt is BF16 the pointers marked "M" point at bf16 data; every other pointer is fp32. */
typedef struct ds4_hc_w {
    float *fn;     /* [(2+n)·n, n·D] */
    float *base;   /* [(2+n)·n] */
    float *scale;  /* [3] */
} ds4_hc_w;

typedef struct ds4_compressor_w {
    int64_t width; /* c·dd: 2·dd with overlapping windows (CSA), dd otherwise */
    int64_t dd;    /* entry width: head_dim, or index_head_dim for the indexer's compressor */
    int64_t rate;  /* m */
    float *wkv;    /* M [width, D] */
    float *wgate;  /* M [width, D] */
    float *ape;    /* [m, width] position bias added to the gate */
    float *norm;   /* [dd] */
} ds4_compressor_w;

typedef struct ds4_layer_w {
    ds4_attn_type type;
    int is_hash;
    float *attn_norm, *ffn_norm;         /* [D] */
    ds4_hc_w hc_attn, hc_ffn;
    /* attention */
    float *wq_a;                         /* M [q_lora, D] */
    float *q_norm;                       /* [q_lora] */
    float *wq_b;                         /* M [H·d, q_lora] */
    float *wkv;                          /* M [d, D] */
    float *kv_norm;                      /* [d] */
    float *wo_a;                         /* M [g·o_lora, H·d/g] */
    float *wo_b;                         /* M [D, g·o_lora] */
    float *sink;                         /* [H] */
    ds4_compressor_w comp;               /* CSA / HCA */
    ds4_compressor_w idx_comp;           /* CSA: the indexer's own compressor */
    float *idx_wq_b;                     /* M [n_I·c_I, q_lora] */
    float *idx_weights;                  /* M [n_I, D] */
    /* MoE */
    float *gate;                         /* [E, D] (fp32: the router's scores stay fp32) */
    float *gate_bias;                    /* [E] learned layers: selection-only correction bias */
    int32_t *tid2eid;                    /* [V, K] hash layers */
    float *w1, *w2, *w3;                 /* M experts, see above */
    ds4_dtype edt[3];                    /* what w1, w2, w3 point at: the view set's mdt, or DS4_FP4_PACKED (fp4.h):
                                            expert 0's packed bytes, with escale[k] its e8m0 scales */
    const uint8_t *escale[3];
    float *sw1, *sw2, *sw3;              /* M shared expert: [I, D], [D, I], [I, D] */
    const ds4_lora_layer *lora;          /* this block's adapters in the same memory (NULL: none); kept when the
                                            view set is rebound, set by lora.c */
} ds4_layer_w;

typedef struct ds4_mtp_w {
    ds4_layer_w block;                   /* sliding attention, learned routing */
    float *e_proj, *h_proj;              /* M [D, D] */
    float *enorm, *hnorm, *norm;         /* [D] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale; /* [n, n·D], [n], [1] */
} ds4_mtp_w;

/* One pointer per tensor of the model, in some backend's memory. */
typedef struct ds4_weights {
    ds4_dtype mdt;                       /* dtype of the "M" matrices (F32, or BF16 on CUDA) */
    int32_t bf16_in;                     /* products with M matrices round their activations to bf16 (ops.h) */
    float *embed;                        /* M [V, D] */
    float *head;                         /* M [V, D] (aliases embed when tied) */
    float *norm;                         /* [D] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale;
    ds4_layer_w *layers;                 /* [L] */
    ds4_mtp_w mtp;
} ds4_weights;

/* One named view of the flat buffer (or of a layer's tid2eid table). */
typedef struct ds4_param {
    char *name;                          /* canonical official name */
    int32_t ndim;
    int64_t shape[4];
    int64_t numel;
    int64_t offset;                      /* into params (F32), the owning tid2eid table (I32), or bytes into q4
                                            (DS4_FP4_PACKED: its e2m1 pairs) */
    int64_t qscale;                      /* DS4_FP4_PACKED: bytes into q4 of its e8m0 scales */
    ds4_dtype dtype;                     /* DS4_F32, DS4_I32 for tid2eid, DS4_FP4_PACKED for an FP4-resident expert */
    /* how the checkpoint stored it, when quantised (saving writes it so again while that is exact: save_quant.c) */
    int32_t qkind;                       /* ds4_qkind (quant.h): 0 float, 1 FP8, 2 FP4 */
    ds4_dtype qdt;                       /* its values' dtype: F8_E4M3, I8 or U8 */
    char *src_scale;                     /* its scale's name */
    ds4_dtype sdt;                       /* the scale's dtype and shape */
    int64_t sshape[2];
    uint8_t *sbytes;                     /* a copy of the scale's bytes (NULL for DS4_FP4_PACKED: they are in q4) */
    int32_t lowp;                        /* an "M" matrix: held in the backend's mdt */
    int32_t follows;                     /* a routed expert after the first: contiguous with the entry before it */
    char *src;                           /* its name in the checkpoint it was loaded from (NULL: not loaded) */
    int32_t src_part;                    /* 0 whole tensor; 1 / 3 the w1 / w3 rows of expert src_expert in a
                                            packed gate_up_proj [E, 2I, D]; 2 its slice of a packed down_proj */
    int64_t src_expert;
    int32_t routed;                      /* 1 + e for routed expert e's w1 / w2 / w3; 0 for every other tensor */
    int32_t elsewhere;                   /* sharded experts (ep_shard.c): another rank holds it (offset: -1) */
    int64_t goff;                        /* F32: its offset in the whole layout, every expert present (= offset
                                            unless the experts are sharded) */
} ds4_param;

struct ds4_dev;
struct ds4_tape;
struct ds4_lora;

struct ds4_model {
    ds4_engine *engine;
    ds4_config cfg;
    int has_mtp;
    float *params;                       /* the flat fp32 buffer (host, the master copy) */
    int64_t n_params;
    ds4_param *table;
    size_t n_table;
    size_t *sorted;                      /* table indices sorted by name, for lookup */
    int32_t *tid2eid_all;                /* all hash tables, contiguous */
    int64_t n_tid2eid;
    uint8_t *q4;                         /* FP4-resident experts (NULL: none), see above */
    int64_t n_q4;                        /* its bytes */
    uint8_t *fp4_kinds;                  /* [(L + 1)·3] whether layer li's (L: the MTP block's) w1, w2, w3 are
                                            FP4-resident; NULL: none is */
    int64_t qblock[2];                   /* the checkpoint's FP8 block (rows, cols), for saving FP8 tensors again */
    ds4_weights w;                       /* views into params / tid2eid_all */
    int32_t emulate_bf16;                /* w.bf16_in on the CPU: ds4_model_emulate_bf16 */
    int32_t tape_f32;                    /* tests: the tape keeps its bf16 products' inputs in fp32 too (sched.h,
                                            ds4_tape.x16 off), the layout the bf16 one must match bit for bit */
    int32_t kv_qat;                      /* the FP8 KV quantisation-aware option: ds4_model_set_kv_qat */
    /* the backend the model computes on (docs/design.md): the CPU backend on the engine's pool, or CUDA */
    struct ds4_dev *dev;
    struct ds4_dev *cpu;                 /* the CPU backend, kept while the model lives on another one */
    const ds4_weights *dw;               /* the views the backend computes with (&w on the CPU) */
    ds4_weights dev_w;                   /* another backend's views, bound to dev_mem */
    void *dev_mem;                       /* another backend's copy of the weights (and tid2eid tables) */
    int64_t *dev_off;                    /* [n_table] byte offset in dev_mem of each F32 entry and of each
                                            FP4-resident expert's bytes */
    size_t dev_f32_bytes, dev_bytes;     /* the weights, then the tid2eid tables, then the FP4-resident experts */
    size_t dev_q4_bytes;                 /* the FP4-resident experts' part of dev_bytes (backend.c, layout) */
    ds4_device_options dev_opt;          /* where it computes */
    int params_dirty;                    /* the host params changed since dev_mem was written */
    uint64_t params_gen;                 /* counts writes to the host params or adapters (ds4_model_params_changed,
                                            ds4_lora_params_changed, read-backs, moves, sharding): an optimizer's
                                            bounds of them hold while it stays the same (optim.c) */
    /* forward workspace in backend memory, planned from (B, S) and reused while it is large enough */
    void *ws;
    size_t ws_bytes;
    /* RoPE tables [rope_n, r] of (cos, sin) pairs for positions 0 .. rope_n-1 (main, compress): a pure function of
     * the config, grown on demand, so decode steps at long positions do not recompute them; rope_dev: the
     * backend's copies (== rope_cs on the CPU) */
    float *rope_cs[2];
    float *rope_dev[2];
    int64_t rope_n;
    uint64_t step_serial;                /* ds4_model_step calls, to detect a cache passed twice in one step */
    /* training */
    float *grads;                        /* flat, parallel to params; NULL until enable_grad */
    int64_t *grad_regions;               /* [2, grad_world]: ds4_model_set_grad_regions, or NULL */
    int32_t grad_world;
    ds4_grads_final_fn gfinal_fn;        /* armed for the next backward (ds4_model_on_grads_final), and its ctx */
    void *gfinal_ctx;
    void (*gguard)(void *ctx);           /* the gradients are in use elsewhere until it returns (ds4_model_guard_grads) */
    void *gguard_ctx;
    int grads_zero;                      /* 1: the gradient buffer is known to hold zeros (enable_grad, zero_grad) */
    float *gsaved;                       /* [n_params] backend memory: the gradients set aside while a backward runs
                                            on zeros (backward.c, accumulation); allocated on first use */
    ds4_weights gw;                      /* views into grads (the backward's "gradient of each tensor") */
    ds4_train_options topt;
    struct ds4_tape *tape;               /* activations of the last training forward (sched.h) */
    int64_t *router_loads;               /* [(L + 1), E] expert loads since the last bias update */
    /* training on a backend the host cannot read (docs/design.md, "Training on a device"): the state lives there and
     * the host buffers mirror it; host_stale / grads_stale say when a mirror is behind */
    float *dgrads;                       /* [n_params] the gradients (flat, as grads); gw views point here */
    float *dmaster;                      /* [master_n] the fp32 master weights, once a device optimizer has stepped */
    /* dmaster holds elements [master_lo, master_lo + master_n) of the flat buffer: all of them, or under ZeRO-1 this
     * rank's region only (the others' on their owners: a read-back gathers them with master_gather, the sharded
     * optimizer's collective, so every rank joins it; NULL once that optimizer is freed) */
    int64_t master_lo, master_n;
    ds4_status (*master_gather)(void *ctx, float *params, ds4_error *err);
    void *master_gather_ctx;
    float *dmoments;                     /* AdamW's m and v: [moments_n] each, v at ds4_moments_stride(moments_n) */
    int64_t moments_n;                   /* elements of each moment in dmoments: n_params, or a ZeRO-1 shard's count */
    const void *moments_owner;           /* the optimizer (ds4_adamw) whose moments dmoments holds, or NULL */
    float *moments_home[2];              /* that optimizer's host m and v, where the moments go when the model moves */
    void *dscratch;                      /* the optimizer's pieces, coefficients and per-piece results */
    size_t dscratch_bytes;
    struct ds4_cast_entry *dcast;        /* [n_cast] master -> working copy (backend memory) */
    struct ds4_cast_entry *hcast;        /* the same table on the host (the optimizer maps its pieces through it) */
    int64_t n_cast;
    int host_stale;                      /* params older than dmaster */
    int grads_stale;                     /* grads older than dgrads */
    struct ds4_lora *lora;               /* LoRA adapters (lora.h); while present only they train: grads stays NULL and
                                            gw's base views are NULL, so no frozen weight's gradient is computed */
    /* expert parallelism (moe_ep.c): the hooks while on, and host scratch for the per-layer row counts and orders */
    int ep_on;
    ds4_expert_parallel ep;
    int64_t *ep_host;
    size_t ep_host_bytes;
    struct ds4_ep_saved *ep_saved;       /* [n_ep_saved] each tape layer's plan, kept for its backward (moe_ep.c) */
    int64_t n_ep_saved;
    /* sharded experts (ep_shard.c): params, grads and the optimizer's moments hold only the routed experts of rank
     * ep_shard_rank of ep_shard_world; n_params counts those, n_full the whole layout. Kept when expert parallelism
     * is turned off (every pass then refuses). ep_full: the whole layout gathered for a save, else NULL. */
    int32_t ep_shard, ep_shard_rank, ep_shard_world;
    int64_t n_full;
    float *ep_full;
    /* context parallelism (cp.c): the hooks while on, and host scratch for the gathers */
    int cp_on;
    ds4_context_parallel cp;
    void *cp_host;
    size_t cp_host_bytes;
};

void ds4_tape_free(struct ds4_model *m, struct ds4_tape *t);

/* Training state on the model's backend (backend.c). ds4_model_train_bind: gradients where the model computes (on a
 * device: dgrads, initialised from the host's, gw rebound). ds4_model_master_ready: dmaster of region [master_lo,
 * master_lo + master_n) (the whole buffer, or a ZeRO-1 rank's) from the host params and the cast table of that region,
 * on first use (another region than the one held brings the host up to date first, then makes the master anew), and
 * the moments buffer (2 × ds4_moments_stride(moments_n) floats; moments_n: n_params, or a ZeRO-1 shard's length;
 * another size than the buffer's hands the moments it holds back to their optimizer and reallocates).
 * ds4_model_host_sync: the host params and gradients brought up to date (a download when they are stale; a sharded
 * master's other regions gathered from their owners, a collective). */
ds4_status ds4_model_train_bind(struct ds4_model *m, ds4_error *err);
ds4_status ds4_model_master_ready(struct ds4_model *m, size_t scratch_bytes, int64_t moments_n, int64_t master_lo,
                                  int64_t master_n, ds4_error *err);
/* Whether the model's fp32 master on its device holds one rank's region only (ZeRO-1). */
static inline int ds4_model_master_sharded(const struct ds4_model *m) {
    return m->dmaster && (m->master_lo != 0 || m->master_n != m->n_params);
}
/* The working copy's share of each rank's master region (ZeRO-1): rank r's cast writes bytes [4·woff[r],
 * 4·(woff[r] + wlen[r])) of the backend copy, padding between tensors included, so that an all-gather of those
 * 4-byte units gives every rank the whole working copy. off / len: the regions, in elements of the flat buffer,
 * ascending, each starting on a tensor's piece; fails (unsupported) where a boundary is not 4-byte aligned. */
ds4_status ds4_model_working_regions(const struct ds4_model *m, int32_t world, const int64_t *off, const int64_t *len,
                                     int64_t *woff, int64_t *wlen, ds4_error *err);
ds4_status ds4_model_host_sync(struct ds4_model *m, ds4_error *err);
/* ds4_model_to's second half: the model moves onto backend nd, which the caller created (the model takes it and
 * releases it on failure), as device o (CUDA, o->index, o->dtype): the weights laid out and uploaded, the views bound,
 * the gradients and adapters following. ds4_model_to passes its CUDA backend; the tests pass a host-invisible twin of
 * the CPU backend (tests/twin_device.h), so the device paths run without a GPU. */
ds4_status ds4_model_to_backend(struct ds4_model *m, struct ds4_dev *nd, const ds4_device_options *o, ds4_error *err);

/* Build the parameter table for `cfg` (with MTP when `with_mtp`), allocate the flat buffer (zeroed) and
 * resolve every view. The model computes on the CPU backend of engine e. */
ds4_status ds4_model_alloc(ds4_engine *e, const ds4_config *cfg, int with_mtp, ds4_model **out, ds4_error *err);
/* The same with FP4-resident experts where fp4_kinds ([(L + 1)·3], copied; NULL: none) says so. */
ds4_status ds4_model_alloc_fp4(ds4_engine *e, const ds4_config *cfg, int with_mtp, const uint8_t *fp4_kinds,
                               ds4_model **out, ds4_error *err);
/* Whether the model holds FP4-resident experts. */
int ds4_model_has_fp4(const ds4_model *m);
/* Index of the table entry with this canonical name, or -1. */
int64_t ds4_model_find(const ds4_model *m, const char *name);
/* Bind a view set to memory laid out by `byte_offset(i)` for table entry i (the view of entry i points at
 * base + byte_offset(i) for F32 entries, i32_base + 4·offset for tid2eid). */
void ds4_weights_bind(const ds4_model *m, ds4_weights *w, ds4_dtype mdt, char *base,
                      int64_t (*byte_offset)(const ds4_model *m, size_t i, void *ctx), void *ctx, int32_t *i32_base);
/* Every view of w NULL (its layers array, layer types and adapter pointers kept): the gradient view set while only
 * adapters train, so the backward skips every frozen weight's gradient. */
void ds4_weights_clear(const ds4_model *m, ds4_weights *w);
/* Drop the model's own training state: host and device gradients, master weights and moments (host copies brought
 * up to date first), the tape; gw cleared. */
ds4_status ds4_model_drop_train_state(ds4_model *m, ds4_error *err);
/* ds4_model_guard_grads' wait, called once and forgotten (the gradients are about to go away). */
void ds4_model_grads_unguard(ds4_model *m);
/* A test reference for the bf16 mode: the CPU's products with M matrices round their activation operands to bf16
 * as the bf16 mode does (ops.h, bf16_in). The M matrices' values are the caller's to round (the CPU keeps fp32). */
void ds4_model_emulate_bf16(ds4_model *m, int on);
/* Elements from m to v in a device buffer of two AdamW moments of n values each (the model's dmoments, the adapters'):
 * n rounded up to a multiple of 4, so that v lies as m does modulo 16 bytes. The CUDA update moves a piece 16 bytes at
 * a time only where p, g, m and v are equally aligned; v right after n values of m would be off by n mod 4. The buffer
 * holds 2 · ds4_moments_stride(n) values. */
static inline int64_t ds4_moments_stride(int64_t n) { return (n + 3) / 4 * 4; }

/* The byte offset of table entry i in the flat fp32 layout (params, grads): ds4_weights_bind's offset function. */
int64_t ds4_f32_byte_offset(const ds4_model *m, size_t i, void *ctx);
/* Whether a tensor is an "M" matrix (read by a matmul or the embedding; held in the backend's mdt). The router's
 * gate, the mHC mixing matrices, the compressors' position biases and every vector stay fp32. */
int ds4_param_lowp(const char *name, int32_t ndim);

/* An fp32 tensor's host values: the gathered whole layout while a save of sharded experts holds one (ep_full), else
 * its place in params. */
static inline float *ds4_param_host(const struct ds4_model *m, const ds4_param *p) {
    return m->ep_full ? m->ep_full + p->goff : m->params + p->offset;
}

/* Sharded experts (ep_shard.c, docs/distributed.md "Expert parallelism"). ds4_ep_shard: keep only rank `rank` of
 * `world`'s routed experts in params and grads (CPU models). ds4_ep_gather: the whole layout [n_full] from a local
 * buffer laid out as params (params, grads or a moment), every rank's experts brought by the installed exchange (a
 * collective): on rank `root` only (the others' `full` is not touched and may be NULL), or on every rank (root -1). ds4_ep_scatter: the local layout from a whole one (no exchange). ds4_ep_sum_f64: n doubles summed over
 * the ranks in rank order (a collective). ds4_ep_refuse: why a pass cannot run on the sharded model (NULL: it can). */
ds4_status ds4_ep_shard(struct ds4_model *m, int32_t rank, int32_t world, ds4_error *err);
ds4_status ds4_ep_gather(struct ds4_model *m, const float *local, float *full, int32_t root, ds4_error *err);
void ds4_ep_scatter(const struct ds4_model *m, const float *full, float *local);
ds4_status ds4_ep_sum_f64(struct ds4_model *m, double *buf, int64_t n, ds4_error *err);
ds4_status ds4_ep_refuse(const struct ds4_model *m, const char *what, ds4_error *err);

/* Canonical official name for a checkpoint tensor name in any accepted spelling. Returns 1 and writes `out`
 * when the name is recognised, 0 otherwise. Packed HF experts map to "<prefix>.ffn.experts.gate_up_proj" /
 * "<prefix>.ffn.experts.down_proj" (the loader splits them). */
int ds4_canonical_name(const char *src, char *out, size_t out_len);

#endif
