/* model.h — the model's internal layout.
 *
 * All trainable parameters live in ONE flat fp32 buffer (`params`); a table of named views (canonical
 * official names, shape, offset) describes it, and the per-layer structs below hold pointers into it.
 * Checkpoint I/O, and later gradients, optimizer state and all-reduce, work on the flat buffer; the names
 * exist for I/O. The hash-routing tables (tid2eid) are integer buffers outside it: they are data, not
 * parameters. Routed experts of a layer are contiguous: w1 [E, I, D], w2 [E, D, I], w3 [E, I, D]. */
#ifndef DS4_MODEL_H
#define DS4_MODEL_H

#include <stdint.h>

#include "ds4.h"
#include "engine.h"

typedef struct ds4_hc_w {
    float *fn;     /* [(2+n)·n, n·D] */
    float *base;   /* [(2+n)·n] */
    float *scale;  /* [3] */
} ds4_hc_w;

typedef struct ds4_compressor_w {
    int64_t width; /* c·dd: 2·dd with overlapping windows (CSA), dd otherwise */
    int64_t dd;    /* entry width: head_dim, or index_head_dim for the indexer's compressor */
    int64_t rate;  /* m */
    float *wkv;    /* [width, D] */
    float *wgate;  /* [width, D] */
    float *ape;    /* [m, width] position bias added to the gate */
    float *norm;   /* [dd] */
} ds4_compressor_w;

typedef struct ds4_layer_w {
    ds4_attn_type type;
    int is_hash;
    float *attn_norm, *ffn_norm;         /* [D] */
    ds4_hc_w hc_attn, hc_ffn;
    /* attention */
    float *wq_a;                         /* [q_lora, D] */
    float *q_norm;                       /* [q_lora] */
    float *wq_b;                         /* [H·d, q_lora] */
    float *wkv;                          /* [d, D] */
    float *kv_norm;                      /* [d] */
    float *wo_a;                         /* [g·o_lora, H·d/g] */
    float *wo_b;                         /* [D, g·o_lora] */
    float *sink;                         /* [H] */
    ds4_compressor_w comp;               /* CSA / HCA */
    ds4_compressor_w idx_comp;           /* CSA: the indexer's own compressor */
    float *idx_wq_b;                     /* [n_I·c_I, q_lora] */
    float *idx_weights;                  /* [n_I, D] */
    /* MoE */
    float *gate;                         /* [E, D] */
    float *gate_bias;                    /* [E] learned layers: selection-only correction bias */
    int32_t *tid2eid;                    /* [V, K] hash layers */
    float *w1, *w2, *w3;                 /* experts, see above */
    float *sw1, *sw2, *sw3;              /* shared expert: [I, D], [D, I], [I, D] */
} ds4_layer_w;

typedef struct ds4_mtp_w {
    ds4_layer_w block;                   /* sliding attention, learned routing */
    float *e_proj, *h_proj;              /* [D, D] */
    float *enorm, *hnorm, *norm;         /* [D] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale; /* [n, n·D], [n], [1] */
} ds4_mtp_w;

/* One named view of the flat buffer (or of a layer's tid2eid table). */
typedef struct ds4_param {
    char *name;                          /* canonical official name */
    int32_t ndim;
    int64_t shape[4];
    int64_t numel;
    int64_t offset;                      /* into params (F32) or into the owning tid2eid table (I32) */
    ds4_dtype dtype;                     /* DS4_F32, or DS4_I32 for tid2eid */
    void **slot;                         /* where the resolved pointer is stored */
    char *src;                           /* its name in the checkpoint it was loaded from (NULL: not loaded) */
    int32_t src_part;                    /* 0 whole tensor; 1 / 3 the w1 / w3 rows of expert src_expert in a
                                            packed gate_up_proj [E, 2I, D]; 2 its slice of a packed down_proj */
    int64_t src_expert;
} ds4_param;

struct ds4_model {
    ds4_engine *engine;
    ds4_config cfg;
    int has_mtp;
    float *params;                       /* the flat fp32 buffer */
    int64_t n_params;
    ds4_param *table;
    size_t n_table;
    size_t *sorted;                      /* table indices sorted by name, for lookup */
    int32_t *tid2eid_all;                /* all hash tables, contiguous */
    int64_t n_tid2eid;
    /* views */
    float *embed;                        /* [V, D] */
    float *head;                         /* [V, D] (aliases embed when tied) */
    float *norm;                         /* [D] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale;
    ds4_layer_w *layers;                 /* [L] */
    ds4_mtp_w mtp;
    /* forward workspace, planned from (B, S) and reused while it is large enough */
    void *ws;
    size_t ws_bytes;
    /* RoPE tables [rope_n, r] of (cos, sin) pairs for positions 0 .. rope_n-1 (main, compress): a pure function of
     * the config, grown on demand, so decode steps at long positions do not recompute them */
    float *rope_cs[2];
    int64_t rope_n;
    uint64_t step_serial;                /* ds4_model_step calls, to detect a cache passed twice in one step */
    /* training */
    float *grads;                        /* flat, parallel to params; NULL until enable_grad */
    ds4_train_options topt;
    struct ds4_tape *tape;               /* activations of the last training forward (fwd.h) */
    int64_t *router_loads;               /* [(L + 1), E] expert loads since the last bias update */
};

void ds4_tape_free(struct ds4_tape *t);

/* Build the parameter table for `cfg` (with MTP when `with_mtp`), allocate the flat buffer (zeroed) and
 * resolve every view. */
ds4_status ds4_model_alloc(ds4_engine *e, const ds4_config *cfg, int with_mtp, ds4_model **out, ds4_error *err);
/* Index of the table entry with this canonical name, or -1. */
int64_t ds4_model_find(const ds4_model *m, const char *name);

/* Canonical official name for a checkpoint tensor name in any accepted spelling. Returns 1 and writes `out`
 * when the name is recognised, 0 otherwise. Packed HF experts map to "<prefix>.ffn.experts.gate_up_proj" /
 * "<prefix>.ffn.experts.down_proj" (the loader splits them). */
int ds4_canonical_name(const char *src, char *out, size_t out_len);

#endif
