/* lora.h — LoRA adapters (internal; the public API is the LoRA part of ds4_train.h, docs/lora.md).
 *
 * The adapters of a model live in ONE flat fp32 buffer (params) with a table of named views, as the model's weights
 * do, and their gradients in a parallel buffer (grads). View sets (ds4_lora_layer [L]) bind them for the schedule:
 * hw (host params), hg (host grads), and on another backend dw / dg (its copies). The model's weight view sets point
 * at them through ds4_layer_w.lora, so a block finds its adapters beside its weights.
 *
 * Sites are per layer: which adapters a layer has is its mask (a PEFT adapter may cover some layers or some
 * projections only). The schedule part (forward add, backward) is lora_sched.c. */
#ifndef DS4_LORA_H
#define DS4_LORA_H

#include <stdint.h>

#include "model.h"

/* One adapted weight kind; a layer's mask has bit (1 << site) when it carries that adapter. */
typedef enum ds4_lora_site {
    DS4_LS_WQ_A, DS4_LS_WQ_B, DS4_LS_WKV, DS4_LS_WO_A, DS4_LS_WO_B, DS4_LS_IDX_Q, DS4_LS_IDX_W,
    DS4_LS_SW1, DS4_LS_SW2, DS4_LS_SW3, DS4_LS_EGU, DS4_LS_EDOWN, DS4_LS_COUNT
} ds4_lora_site;

typedef struct ds4_lora_param {
    char *name;                          /* "layers.0.attn.wq_a.lora_A" (B entries: ".lora_B", gate_up: ".lora_B_w1",
                                            ".lora_B_w3") */
    int32_t ndim;
    int64_t shape[3];
    int64_t numel, offset;
    int32_t layer, site, part;           /* part 0: A, 1: B, 2: the w3 half of a gate_up B */
} ds4_lora_param;

typedef struct ds4_lora {
    int64_t r;
    double alpha;
    int32_t rslora;
    float s;
    uint32_t *mask;                      /* [L] site bits */
    float *params;                       /* [n] host, the master copy */
    float *grads;                        /* [n] host; NULL until gradients are enabled */
    int64_t n;
    ds4_lora_param *table;
    size_t n_table;
    ds4_lora_layer *hw, *hg;             /* [L] views into params / grads */
    /* another backend's copies (the model computes there): params, gradients, AdamW moments */
    float *dparams, *dgrads, *dmoments;  /* dmoments: m, then v at ds4_moments_stride(n) */
    ds4_lora_layer *dw, *dg;             /* [L] */
    int dirty;                           /* params changed on the host since dparams was written */
    int host_stale;                      /* dparams changed (a device optimizer step) since params was read back */
    int grads_stale;                     /* dgrads newer than grads */
    const void *moments_owner;           /* the optimizer whose moments dmoments holds */
    float *moments_home[2];
} ds4_lora;

/* The site bit(s) of a public target bit set (ds4_lora_target) on a layer of type `type`. */
uint32_t ds4_lora_sites(uint32_t targets, ds4_attn_type type);
/* Allocate an adapter set for model m (rank r, scale from alpha / rslora) with per-layer masks (copied); zeroed. */
ds4_status ds4_lora_alloc(const ds4_model *m, int64_t r, double alpha, int32_t rslora, const uint32_t *mask,
                          ds4_lora **out, ds4_error *err);
void ds4_lora_free(ds4_model *m, ds4_lora *l);
/* Bind a view set [L] to a buffer laid out as l->params (the host's, its gradients, a backend's copy). */
void ds4_lora_rebind(const ds4_lora *l, ds4_lora_layer *views, float *base, int64_t L);
/* Make l the model's adapters (the previous ones, the base gradients and the tape are dropped); on a device the
 * adapters are copied there. On failure the model keeps no adapters and l is freed. */
ds4_status ds4_lora_attach(ds4_model *m, ds4_lora *l, ds4_error *err);
/* Point the model's view sets (w, dev_w, gw) at l's adapters, or at none (l NULL). */
void ds4_lora_point_views(ds4_model *m, const ds4_lora *l);
/* Host gradients (zeroed) and their views in the model's gradient view set. */
ds4_status ds4_lora_enable_grad(ds4_model *m, ds4_error *err);
/* Backend side (lora_dev.c). ds4_lora_to_backend: the adapters follow the model to its current backend (copies,
 * views in dev_w and, when training, gw); ds4_lora_release_backend: the copies go away, host brought up to date
 * first. ds4_lora_sync: host params changed → backend copy. ds4_lora_host_sync: the host copies of params and
 * gradients brought up to date. */
ds4_status ds4_lora_to_backend(ds4_model *m, ds4_error *err);
ds4_status ds4_lora_release_backend(ds4_model *m, ds4_error *err);
ds4_status ds4_lora_sync(ds4_model *m, ds4_error *err);
ds4_status ds4_lora_host_sync(ds4_model *m, ds4_error *err);
/* The host adapters were written: the backend copy is refreshed before the next pass, and the write is counted in
 * m->params_gen (an optimizer's bounds of them no longer hold). */
void ds4_lora_params_changed(ds4_model *m);
/* Gradients on the backend (device: allocated and bound into gw), like ds4_model_train_bind. */
ds4_status ds4_lora_train_bind(ds4_model *m, ds4_error *err);
/* Zero the gradients where they live. */
void ds4_lora_zero_grad(ds4_model *m);
/* Which adapter tensors receive a gradient under the model's training options (the indexer's only with its KL
 * loss); AdamW's weight decay applies to all. */
int ds4_lora_trainable(const ds4_model *m, const ds4_lora_param *p);

#endif
