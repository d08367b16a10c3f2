/* ds4_train.h — training: gradients, the backward pass, AdamW, checkpoints. Included by ds4.h.
 *
 * Gradients live in one flat fp32 buffer parallel to the parameter buffer (same offsets as the named views
 * of ds4_model_tensor_at). Backward ACCUMULATES into it, so micro-batches add up; ds4_model_zero_grad
 * clears it. A backward adds its whole gradient with one fp32 addition per element (onto a buffer that is not
 * known to be zero it runs on zeros and adds the set-aside values back), so k accumulated backwards give the same
 * bits as their k gradients summed in order: ((G1 + G2) + G3) + ... (what data parallelism's rank-order sum
 * computes). Writes through the pointer of ds4_model_grads must be followed by ds4_model_grads_changed. Parameters that receive no gradient from the active losses (the lightning indexer without its
 * KL loss, the selection-only router bias, the MTP block without the MTP loss) get exactly zero and are
 * reported as not trainable, so optimizers leave them alone (as torch does with a None gradient). */
#ifndef DS4_TRAIN_H
#define DS4_TRAIN_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_train_options {
    double mtp_lambda;        /* > 0: add mtp_lambda · MTP cross-entropy to the loss (needs mtp.0 weights) */
    double indexer_kl;        /* > 0: weight of the lightning-indexer KL loss (DeepSeek-V3.2 style): for every CSA
                                 layer and query, KL(p || q) over the entries the indexer picked, p = the main
                                 attention's probability mass on them (summed over heads, renormalised, detached),
                                 q = softmax of the indexer scores; mean over queries, summed over layers. The
                                 indexer's inputs are detached too, so only indexer parameters receive it. */
    double router_bias_gamma; /* > 0: after each optimizer step, the aux-loss-free balancing update of every
                                 learned router's selection bias: bias_e += γ·sign(mean load − load_e), loads
                                 counted over the training forwards since the previous step */
    int64_t head_chunk;       /* rows of logits a training pass holds at once: the LM head, its losses and
                                 log-probabilities run over chunks of this many tokens and the backward recomputes
                                 each chunk's logits, so [T, V] logits never exist. 0: the backend's default (all rows
                                 on the CPU; 1024 on a GPU). Changes summation order only in the head's weight
                                 gradient (chunks add in order). */
    int32_t recompute;        /* 1: per-block activation recomputation. The training forward keeps, per main block,
                                 only its input streams and its routing and indexer decisions; the backward runs each
                                 block's forward again (with those decisions) just before its backward, so the tape
                                 holds one block's activations instead of every block's. Gradients, losses and
                                 log-probabilities are the same bits; a step costs about one more forward. */
} ds4_train_options;

/* Allocate the gradient buffer (zeroed). Idempotent. */
ds4_status ds4_model_enable_grad(ds4_model *m, ds4_error *err);
void ds4_model_zero_grad(ds4_model *m);
/* The host buffers. For a model training on a device (docs/design.md) they are mirrors, brought up to date by these
 * calls (a download; NULL if it fails): write to params, then call ds4_model_params_changed; writes to the returned
 * gradients do not reach the device's. Under ZeRO-1 on a device the fp32 master is sharded: bringing the params up to
 * date after a step gathers its regions from their owners, a collective every rank calls (ds4_adamw_set_shard). */
float *ds4_model_params(ds4_model *m);         /* flat [ds4_model_param_count] */
float *ds4_model_grads(ds4_model *m);          /* flat, parallel to params; NULL before enable_grad */
/* Bring the host params and gradients up to date with the device's (nothing to do on the CPU). */
ds4_status ds4_model_host_sync(ds4_model *m, ds4_error *err);
/* The gradient buffer where the model computes, for a collective over it (dist/, data parallelism): host memory on
 * the CPU, memory of the model's CUDA device there (ds4_model_device says which). *count = ds4_model_param_count;
 * with LoRA adapters attached, the adapters' gradient buffer instead (*count = their element count: only they train).
 * Everything enqueued on the model's backend has finished when this returns, so another stream (NCCL's) may read
 * and write the buffer until the model's next call; after writing it, call ds4_model_grads_changed (the host
 * mirror of a device model is then behind). DS4_ERR_ARG before enable_grad. */
ds4_status ds4_model_grad_buffer(ds4_model *m, float **out, int64_t *count, ds4_error *err);
void ds4_model_grads_changed(ds4_model *m);
/* The training state's bytes on the model's device (0 each on the CPU backend): the gradients, the fp32 master
 * weights and the optimizer's two moments (a ZeRO-1 shard's only, when the optimizer stepping there is sharded). */
void ds4_model_train_device_bytes(const ds4_model *m, int64_t *grads, int64_t *master, int64_t *moments);
/* The bytes the model keeps on its backend (host memory on the CPU) for its passes, planned from the largest shape so
 * far and kept between passes (0 before the first): the training tape (what a training forward saves for the
 * backward), the forward workspace and the backward workspace. A backend's own scratch (CUDA: the products' operand
 * copies, cuBLAS's workspace) is not counted. */
void ds4_model_pass_bytes(const ds4_model *m, int64_t *tape, int64_t *workspace, int64_t *backward_workspace);
/* g[i] *= (float)scale over the whole gradient buffer (the adapters' with LoRA), where the model computes (bitwise the same on CPU and CUDA:
 * one fp32 product per element). */
ds4_status ds4_model_scale_grads(ds4_model *m, double scale, ds4_error *err);
/* Gradients that become final during a backward (docs/distributed.md, "Bucketed all-reduce"): fn is called from the
 * next backward (one backward only: the call disarms it) each time a region of the gradient buffer holds its final
 * value for that backward (set-aside accumulated gradients added back), lo < hi, regions in descending order that
 * together cover [0, count) exactly once. `grads` is the buffer ds4_model_grad_buffer gives (memory of the model's
 * device for a CUDA model, whose work producing the region is then enqueued, not finished, on `stream`, the
 * backend's cudaStream_t; NULL on the CPU, where the region is finished). The backward goes on at once: fn must not
 * call into the model. A backward that fails still reports every region (the rest at its end), so data-parallel
 * ranks issue the same collectives. With LoRA adapters, expert or context parallelism (whose backwards run
 * collectives of their own) the whole buffer is reported once at the end. fn NULL disarms. */
/* ZeRO-1's reduce-scatter (docs/distributed.md): the model's gradients are read per region, rank r's optimizer
 * reading [off[r], off[r] + len[r]) only (disjoint, ascending, inside the trained gradient buffer; copied). The
 * data-parallel reduction (ds4_comm_all_reduce_grads) then sums each rank's region only. world 0 clears them. */
ds4_status ds4_model_set_grad_regions(ds4_model *m, int32_t world, const int64_t *off, const int64_t *len,
                                      ds4_error *err);
/* The regions set (pointers into the model, valid until the next set or the model's end) -> their number, 0: none. */
int32_t ds4_model_grad_regions(const ds4_model *m, const int64_t **off, const int64_t **len);
typedef void (*ds4_grads_final_fn)(void *ctx, ds4_model *m, float *grads, int64_t lo, int64_t hi, void *stream);
void ds4_model_on_grads_final(ds4_model *m, ds4_grads_final_fn fn, void *ctx);
/* The gradient buffer is in use by another thread or stream (a reduction in flight) until wait(ctx) returns: freeing
 * the model or dropping its training state calls it first (then forgets it). wait NULL: nothing in use. */
void ds4_model_guard_grads(ds4_model *m, void (*wait)(void *ctx), void *ctx);
ds4_status ds4_model_set_train_options(ds4_model *m, const ds4_train_options *o, ds4_error *err);
/* The options last set (all zero before any), so that a caller can change one and keep the others. */
ds4_train_options ds4_model_train_options(const ds4_model *m);

/* Per named tensor i (as ds4_model_tensor_at): flat offset and size in the parameter buffer, whether it
 * receives a gradient under the current training options, and whether AdamW weight decay applies
 * (not on norms, biases, sinks, mHC base/scale). Integer tables (tid2eid) are never trainable. */
typedef struct ds4_tensor_info {
    int64_t offset, numel;
    int32_t is_param;         /* 1: lives in the fp32 parameter buffer */
    int32_t trainable;
    int32_t decay;
    int32_t elsewhere;        /* sharded experts: a routed expert another rank holds (offset -1, not in this rank's
                                 buffers; docs/distributed.md "Expert parallelism") */
} ds4_tensor_info;
ds4_status ds4_model_tensor_info(const ds4_model *m, size_t i, ds4_tensor_info *out, ds4_error *err);

/* A training forward: like ds4_model_forward (labels required) but keeps the activations the backward
 * needs. res->loss is the mean cross-entropy over scored tokens (+ mtp_lambda · MTP loss when enabled). */
ds4_status ds4_model_forward_train(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res,
                                   ds4_error *err);
/* Back-propagate `scale` · Σ(per-token CE over scored tokens) of the last training forward, accumulating into
 * the gradient buffer. scale = 1 / loss_tokens reproduces the gradient of the mean loss; for micro-batches
 * of one global batch pass 1 / (scored tokens of the whole global batch) to each. */
ds4_status ds4_model_backward(ds4_model *m, double scale, ds4_error *err);

/* Each part of the loss with its own normalisation, for a loss spread over micro-batches and ranks whose parts are
 * means over different counts (docs/distributed.md, "Loss normalisation"): the gradient of
 *     ce · Σ CE(scored tokens) + mtp · Σ CE_mtp(MTP-scored tokens) + ikl · Σ_layers Σ KL(queries with picks)
 * A global token-mean is ce = 1 / N (N: scored tokens of the global batch), mtp = mtp_lambda / M (M: its MTP-scored
 * tokens, ds4_forward_result.mtp_loss_tokens summed), ikl = indexer_kl / Q (Q: the queries with picks,
 * ds4_forward_result.indexer_queries summed; the same count in every CSA layer, since picks depend on positions
 * only). mtp < 0 or ikl <= 0: that part's default as ds4_model_backward(ce) computes it (MTP: λ·ce·(loss_tokens /
 * mtp_tokens); indexer KL: indexer_kl / this forward's own query count, per layer). */
typedef struct ds4_backward_scales {
    double ce, mtp, ikl;
} ds4_backward_scales;
ds4_status ds4_model_backward_scaled(ds4_model *m, const ds4_backward_scales *s, ds4_error *err);
/* The indexer KL loss's query count of rows of these real lengths ([B]; ds4_forward_args.lengths), known before any
 * forward: the positions with picks, s >= compress_rate_csa - 1, below each row's length (0 without CSA layers). A
 * training forward with indexer_kl > 0 reports the same count (ds4_forward_result.indexer_queries), so a loop can
 * take the global Q of micro-batches it has not run yet (the RL trainer: Q of a whole minibatch). A query whose picks
 * get no attention mass at all (fp32 underflow) counts with KL 0. */
int64_t ds4_model_indexer_queries(const ds4_model *m, const int64_t *lengths, int64_t B);

/* Expert loads counted by training forwards since the last reset: loads[l·E + e] = number of (token, slot)
 * routings of layer l (0..L-1, then L for the MTP block) to expert e. NULL before the first training forward. */
const int64_t *ds4_model_router_loads(const ds4_model *m);
/* Apply the aux-loss-free update with step γ to every learned router's bias from the counted loads (layers
 * with no counted token are left alone), then reset the counts. Called by ds4_adamw_step when
 * router_bias_gamma > 0; callable directly by a custom loop. */
ds4_status ds4_model_update_router_bias(ds4_model *m, double gamma, ds4_error *err);
/* Data parallelism: replace the counted loads by their sum over the ranks, through `sum` (an in-place all-reduce of
 * n doubles on every rank; the counts are integers below 2^53, so exact in any order), so that every rank's bias
 * update sees the global batch's loads and the ranks' biases stay equal. Does nothing (and calls no collective)
 * unless router_bias_gamma > 0 and loads were counted, and with expert parallelism on (whose update sums them
 * itself); the condition is the same on every rank of a data-parallel run. Called once per optimizer step, after
 * the last backward and before the step (ds4_comm_all_reduce_grads does). */
ds4_status ds4_model_sum_router_loads(ds4_model *m,
                                      ds4_status (*sum)(void *ctx, double *buf, int64_t n, ds4_error *err), void *ctx,
                                      ds4_error *err);

/* ------------------------------------------------------------------------------------------------ expert parallelism */

/* Expert parallelism (docs/distributed.md, "Expert parallelism"): rank `rank` of `world` computes routed experts
 * [rank·E/world, (rank + 1)·E/world) of every MoE layer for the tokens of every rank, and everything else on its own
 * tokens. The core does not know how ranks talk; the caller gives the two collectives (dist/: ds4_comm_expert_parallel
 * over MPI, the TCP star or NCCL). While it is on, every full forward (ds4_model_forward, _forward_train) and every
 * backward of the model is collective: every rank must make them in the same order. Decoding (ds4_model_step,
 * generation) is not: it computes every expert locally, as the weights are replicated on every rank (with `shard`
 * they are not, and decoding is refused). */
typedef struct ds4_expert_parallel {
    int32_t rank, world;
    int32_t device;           /* the memory all_to_all_v takes: -1 host (a CPU model), N: CUDA device N's; a pass of a
                                 model on another device is refused (install the hooks again after moving it) */
    int32_t shard;            /* 1: sharded experts: this rank keeps only its own experts' weights, gradients and
                                 moments (on its device too: working copy, fp32 master; docs/distributed.md). Kept
                                 when expert parallelism is turned off: the model then refuses every pass until it is
                                 turned on again, sharded */
    void *ctx;                /* passed to both calls */
    /* Rank q receives send_rows[q] rows of row_bytes bytes, the q-th consecutive block of send; recv gets
     * recv_rows[s] rows from rank s, blocks in rank order. Memory of the model's backend (host for a CPU model, its
     * CUDA device's otherwise), whose earlier work has finished. A row's bytes move unchanged. */
    ds4_status (*all_to_all_v)(void *ctx, const void *send, const int64_t *send_rows, void *recv,
                               const int64_t *recv_rows, size_t row_bytes, ds4_error *err);
    /* Host memory, fixed blocks: block q (bytes each) of send goes to rank q; block s of recv comes from rank s. */
    ds4_status (*host_all_to_all)(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err);
} ds4_expert_parallel;

/* Turn expert parallelism on (ep copied; its ctx must outlive it) or off (ep NULL). Refused when E is not a multiple
 * of world, with LoRA adapters on the routed experts, or with a rank outside [0, world). Invalidates the tape (a
 * training forward must be followed by a backward of the same mode). While it is on the expert loads of
 * ds4_model_router_loads count this rank's tokens only; ds4_model_update_router_bias sums them over the ranks first
 * (a collective then), so every rank applies the same update. */
ds4_status ds4_model_set_expert_parallel(ds4_model *m, const ds4_expert_parallel *ep, ds4_error *err);
/* Sharded experts (ep->shard): the runs of the parameter and gradient buffers that every rank holds alike (every
 * tensor but the routed experts: what a data-parallel all-reduce sums; each rank's experts are its own), ascending.
 * Writes up to cap (offset, length) pairs and returns how many there are; 0 when the experts are not sharded (the
 * whole buffer is replicated). Elements, not bytes. */
size_t ds4_model_replicated_runs(const ds4_model *m, int64_t *off, int64_t *len, size_t cap);
/* Sharded experts: the whole layout's parameter count, every expert included (ds4_model_param_count: this rank's). */
int64_t ds4_model_whole_param_count(const ds4_model *m);
/* The whole parameter buffer [ds4_model_whole_param_count] on the host: with sharded experts every rank's experts
 * gathered from their owners (a collective: every rank calls it), otherwise a copy of ds4_model_params. */
ds4_status ds4_model_gather_params(ds4_model *m, float *out, ds4_error *err);
/* The inverse: the parameters from a whole buffer [ds4_model_whole_param_count] (this rank's part; no exchange). */
ds4_status ds4_model_scatter_params(ds4_model *m, const float *in, ds4_error *err);
/* The installed hooks, or NULL when expert parallelism is off. */
const ds4_expert_parallel *ds4_model_expert_parallel(const ds4_model *m);

/* ------------------------------------------------------------------------------------------------ context parallelism */

/* Context parallelism (docs/distributed.md, "Context parallelism"): one long sequence split over the ranks. Every
 * rank passes the same whole ids and labels [B, S]; rank r computes positions [o_r, o_r + n_r) of every row (the
 * contiguous shard of S: S / world each, the first S % world one more) through every per-token layer, and at each
 * attention sub-layer the ranks all-gather its input (after attn_norm), so that each computes the attention of the
 * whole sequence (window ring, compressed entries, indexer) and keeps its own rows of the output; the backward
 * gathers the output gradient the same way. The MTP block's next-token roll reads the whole ids, so it is global.
 * The losses and token counts a forward returns are the whole sequence's (the per-row losses gathered and summed in
 * row order), on every rank. The attention weights' gradients are computed on rank 0 only (the other ranks' stay
 * zero), every other gradient on each rank from its own rows: summed over the ranks by the usual all-reduce.
 * While it is on, every forward and backward is collective; each starts with the ranks comparing their checks and
 * hashes of their ids and labels (a rank that refused, or was given other sequences, fails every rank). A model whose
 * memory the host cannot read (a CUDA model) gathers its attention rows through device_all_gather, in the memory of
 * the device named by `device`; the per-row losses, the notes and whether each rank's pass failed take the host
 * all_gather. Refused: LoRA adapters, expert parallelism, routing replay, logits / MTP logits / hidden outputs, the
 * indexer KL loss, per-block recomputation, decoding (ds4_model_step), S < 2·world (every rank needs two positions),
 * and a device model without device_all_gather or on another device than `device`. */
typedef struct ds4_context_parallel {
    int32_t rank, world;
    int32_t device;           /* the memory device_all_gather takes: -1 host, N: CUDA device N's; a pass of a CUDA model
                                 on another device is refused (install the hooks again after moving it) */
    void *ctx;                /* passed to both calls */
    /* Host memory: every rank's `bytes` of send, in rank order, into recv (world · bytes). */
    ds4_status (*all_gather)(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err);
    /* The same in the model's backend memory, whose earlier work has finished; send and recv do not overlap. NULL: the
     * model computes in host memory (a CPU model), where all_gather serves. Bytes move unchanged. */
    ds4_status (*device_all_gather)(void *ctx, const void *send, void *recv, size_t bytes, ds4_error *err);
    /* 0: attention split by query: each rank's queries over the gathered keys, the key gradients summed over the
     * ranks (its attention gradients within fp32 regrouping of one process's). 1: every rank runs each attention
     * sub-layer over the whole sequences and keeps its rows (P times the attention's work and memory; its gradients
     * one process's bits in fp32, docs/distributed.md). */
    int32_t whole_attention;
} ds4_context_parallel;

/* Turn context parallelism on (cp copied; its ctx must outlive it) or off (cp NULL). Invalidates the tape. */
ds4_status ds4_model_set_context_parallel(ds4_model *m, const ds4_context_parallel *cp, ds4_error *err);
/* The installed hooks, or NULL when context parallelism is off. */
const ds4_context_parallel *ds4_model_context_parallel(const ds4_model *m);

/* Batch shape [B, S] of the last training forward (its tape); with context parallelism [B, n_r], this rank's slice
 * (the shape of ds4_model_logprobs' rows and of backward_logprobs' dlogp). */
ds4_status ds4_model_last_batch(const ds4_model *m, int64_t *batch, int64_t *seq, ds4_error *err);
/* Per-token log-probabilities of the last training forward: logp[b·S + s] = log p(labels[b, s+1] | ids[b, ..s])
 * for scored positions (labels[b, s+1] != -100); 0 at the others (including s = S-1). entropy (may be NULL):
 * the entropy of the full next-token distribution at every position. Both [B, S]. */
ds4_status ds4_model_logprobs(ds4_model *m, float *logp, float *entropy, ds4_error *err);
/* Back-propagate a per-token gradient dlogp [B, S] (d objective / d logp at each scored position; ignored at
 * unscored ones) of the last training forward, accumulating into the gradients. ds4_model_backward(scale) is
 * this with dlogp = -scale at every scored position (the cross-entropy is −Σ logp), so any policy loss
 * written in Lua goes through the same code. */
ds4_status ds4_model_backward_logprobs(ds4_model *m, const float *dlogp, ds4_error *err);
/* The same with the indexer KL loss's per-query factor (> 0: indexer_kl / the global query count; <= 0: the
 * default, its own count), for a policy loss spread over ranks. */
ds4_status ds4_model_backward_logprobs_scaled(ds4_model *m, const float *dlogp, double ikl_scale, ds4_error *err);

/* ------------------------------------------------------------------------------------------------ AdamW */

typedef enum ds4_lr_schedule {
    DS4_LR_CONSTANT = 0,      /* lr (after warm-up, if warmup_steps > 0) */
    DS4_LR_LINEAR = 1,        /* warm-up, then linear decay to min_lr_ratio·lr at total_steps */
    DS4_LR_COSINE = 2         /* warm-up, then cosine decay to min_lr_ratio·lr at total_steps */
} ds4_lr_schedule;

typedef struct ds4_adamw_options {
    double lr;                /* peak learning rate */
    double beta1, beta2, eps;
    double weight_decay;      /* decoupled, on tensors with decay = 1 */
    double clip;              /* global gradient-norm clip; <= 0: off */
    ds4_lr_schedule schedule;
    int64_t warmup_steps;     /* linear warm-up: lr·(k+1)/warmup_steps for update k < warmup_steps */
    int64_t total_steps;      /* end of the decay */
    double min_lr_ratio;
    int32_t zero_grad;        /* 1: a step leaves the gradients zeroed, as ds4_model_zero_grad would (the clipped
                                 gradients are not kept); on a device the update then does not write the clipped
                                 gradients back, and the next ds4_model_zero_grad has nothing left to do (as torch's
                                 zero_grad(set_to_none=True) after its step costs no pass) */
} ds4_adamw_options;

/* Learning rate for update number k (0-based: k updates completed before this one). */
double ds4_lr_at(const ds4_adamw_options *o, int64_t k);

typedef struct ds4_adamw ds4_adamw;
typedef struct ds4_adamw_stats {
    double lr;                /* used by this update */
    double grad_norm;         /* global L2 norm of the trainable gradients before clipping */
    int64_t step;             /* updates completed, this one included */
    int32_t exact_check;      /* 1: the update's finiteness was checked by a pass over the parameters, gradients and
                                 moments; 0: bounds kept from the previous update proved it (or the step was refused
                                 before: a non-finite gradient norm) */
} ds4_adamw_stats;

ds4_status ds4_adamw_create(ds4_model *m, const ds4_adamw_options *o, ds4_adamw **out, ds4_error *err);
void ds4_adamw_free(ds4_adamw *a);
/* One update from the model's gradient buffer: clip (in place, as torch's clip_grad_norm_ does, so the buffer holds
 * the clipped gradients afterwards), then AdamW on trainable tensors. Does not zero grads, unless the options'
 * zero_grad asks it to (a refused step zeroes nothing). A non-finite gradient norm is an error that leaves
 * parameters, moments and the step count unchanged (torch would write NaN into every weight), and so is an update
 * that would make a parameter or moment non-finite. On the CPU that check reads every parameter and moment only when
 * the bounds kept from the previous update cannot prove the update finite (docs/design.md): so a write to the host
 * parameters must be followed by ds4_model_params_changed, as the device copy already needs. */
ds4_status ds4_adamw_step(ds4_adamw *a, ds4_adamw_stats *stats, ds4_error *err);
int64_t ds4_adamw_steps(const ds4_adamw *a);

/* Optimizer state access for checkpoints (saving and resuming training): the two moment buffers are flat and parallel to the
 * model's parameter buffer (same offsets as ds4_tensor_info; zero where a tensor has never been updated), and
 * each named tensor has its own update count (torch keeps state["step"] per parameter; a tensor that becomes
 * trainable later starts its bias correction at 1). */
typedef struct ds4_adamw_state {
    float *m, *v;             /* [m_count] each: elements [m_offset, m_offset + m_count) of the flat buffer (all of
                                 it, 0 and n_params, unless the optimizer is sharded: ds4_adamw_set_shard) */
    int64_t n_params;
    int64_t n_whole;          /* the whole moments' length (ds4_adamw_gather_moments, ds4_adamw_put_moments):
                                 n_params, or with sharded experts the whole model's, every expert included */
    int64_t m_offset, m_count;
    int64_t *tensor_steps;    /* [n_tensors], indexed like ds4_model_tensor_at */
    size_t n_tensors;
    int64_t *steps;           /* the optimizer's update count (what the schedule reads) */
} ds4_adamw_state;
/* Pointers into the optimizer (mutable: a resume writes through them; so the next step checks the moments in full).
 * For a model on a device the moments live there between steps: call ds4_adamw_sync_state before reading them, and
 * ds4_adamw_state_changed after writing. */
void ds4_adamw_get_state(ds4_adamw *a, ds4_adamw_state *out);
ds4_status ds4_adamw_sync_state(ds4_adamw *a, ds4_error *err);
void ds4_adamw_state_changed(ds4_adamw *a);
/* The whole moments, m and v [n_params] each (read back from the model's device first when they are there; a sharded
 * optimizer gathers every rank's part: a collective step, every rank calls it; on a device it also reads the model's
 * sharded fp32 master back, so a save after it on one rank finds the weights whole). */
ds4_status ds4_adamw_gather_moments(ds4_adamw *a, float *m, float *v, ds4_error *err);
/* The inverse, for a resume: this optimizer's part of whole moments m and v [n_whole] each (its ZeRO-1 region, or with
 * sharded experts its replicated tensors and own experts); no exchange. */
void ds4_adamw_put_moments(ds4_adamw *a, const float *m, const float *v);

/* ZeRO-1 (docs/distributed.md, "ZeRO-1"): the ranks of a data-parallel job split the optimizer. The flat buffer's
 * fp32 tensors are cut into pieces of DS4_OPTIM_CHUNK elements (each tensor from its start); rank r owns a
 * contiguous run of pieces (ds4_shard_range over their number), keeps Adam's moments for those only, and updates
 * only those parameters; the gradient norm's per-piece sums of squares are summed over ranks (each piece has one
 * owner: the others add zeros), so the norm, the clip coefficient, every update and the refusal of a non-finite one
 * are the bits the unsharded optimizer computes; then the updated parameters are gathered on every rank. Every rank
 * must hold the whole summed gradient (an all-reduce before the step). A model on a device (CUDA) keeps its shard's
 * moments and the fp32 master weights of its region only there, updates them there, casts them into its working copy
 * (bf16 or fp32), and gathers every rank's part of the working copy with gather_dev_f32 (NCCL). Reading the weights
 * back to the host (ds4_model_params, a save, moving the model, another shard) then gathers the master's regions from
 * their owners with gather_f32: a collective, every rank calls it, and before the optimizer is freed. A rank that
 * reads back alone must get an error, not wait forever: the collectives should fail after a deadline (those of
 * ds4_comm_shard_optimizer do: DS4_DIST_TIMEOUT), and the read-back then fails naming itself, the weights stale. */
typedef struct ds4_adamw_shard {
    int32_t rank, world;
    void *ctx;
    /* in place: buf[i] summed over ranks, in rank order (the same on every rank) */
    ds4_status (*sum_f64)(void *ctx, double *buf, int64_t n, ds4_error *err);
    /* in place: buf[off[r] .. off[r] + len[r]) from rank r, for every rank r (the regions are disjoint) */
    ds4_status (*gather_f32)(void *ctx, float *buf, const int64_t *off, const int64_t *len, ds4_error *err);
    /* the same on a buffer in the model's device memory (NULL: host models only); called once everything enqueued
     * on the model's device has finished, and returns once the gather has completed there */
    ds4_status (*gather_dev_f32)(void *ctx, float *dev_buf, const int64_t *off, const int64_t *len, ds4_error *err);
} ds4_adamw_shard;
/* Shard the optimizer (its current moments keep their values); the collectives must stay valid while it steps and
 * while its model's weights are read back. */
ds4_status ds4_adamw_set_shard(ds4_adamw *a, const ds4_adamw_shard *s, ds4_error *err);
/* This rank's region of the flat buffer: elements [*off, *off + *len) (the whole buffer when not sharded). */
void ds4_adamw_shard_region(const ds4_adamw *a, int64_t *off, int64_t *len);
/* Every rank's region (arrays of the world size, owned by the optimizer); 0 when not sharded. */
int32_t ds4_adamw_shard_regions(const ds4_adamw *a, const int64_t **off, const int64_t **len);
/* The model the optimizer steps. */
ds4_model *ds4_adamw_model(const ds4_adamw *a);

/* ------------------------------------------------------------------------------------------------ LoRA */

/* Low-rank adapters (docs/lora.md): on each targeted weight W [O, K] the model computes y = x Wᵀ + s·B(A x) with
 * A [r, K], B [O, r] (PEFT's lora_A / lora_B), s = alpha / r (alpha / sqrt(r) with rsLoRA), adapters in fp32. While
 * a model carries adapters only they train: the gradient buffer covers them alone (ds4_model_grads is NULL, no
 * frozen weight's gradient is computed), and an optimizer created on the model steps the adapters only. Forward
 * passes, model steps (decoding) and generation all apply them, so rollout and training log-probabilities agree. */
enum ds4_lora_target {
    DS4_LORA_WQ_A = 1u << 0,         /* attention projections (HF q_a_proj, q_b_proj, kv_proj, o_a_proj, o_b_proj) */
    DS4_LORA_WQ_B = 1u << 1,
    DS4_LORA_WKV = 1u << 2,
    DS4_LORA_WO_A = 1u << 3,
    DS4_LORA_WO_B = 1u << 4,
    DS4_LORA_INDEXER = 1u << 5,      /* the lightning indexer's wq_b and weights_proj (CSA layers; they receive a
                                        gradient only from the indexer KL loss) */
    DS4_LORA_SHARED = 1u << 6,       /* the shared expert's w1, w2, w3 */
    DS4_LORA_EXPERTS = 1u << 7,      /* every routed expert's own adapters: gate_up (w1 and w3) and down (w2) */
    DS4_LORA_ALL = 0xffu
};

typedef struct ds4_lora_options {
    int64_t rank;                    /* r >= 1 */
    double alpha;                    /* scale alpha / r */
    double dropout;                  /* must be 0: a dropout mask would make rollout and training differ */
    uint32_t targets;                /* ds4_lora_target bits */
    int32_t rslora;                  /* 1: scale alpha / sqrt(r) */
    uint64_t seed;                   /* A ~ U(-1/sqrt(K), 1/sqrt(K)) (PEFT's default), B = 0: the model is unchanged */
} ds4_lora_options;

/* Attach fresh adapters (replacing any). The model's gradient buffer and training forward are dropped. */
ds4_status ds4_model_lora(ds4_model *m, const ds4_lora_options *o, ds4_error *err);
/* Attach the adapters of a PEFT directory (adapter_config.json + adapter_model.safetensors). */
ds4_status ds4_model_lora_load(ds4_model *m, const char *dir, ds4_error *err);
/* Write the adapters as a PEFT directory (atomically, as ds4_model_save; overwrite: replace an adapter directory).
 * base_name: adapter_config.json's base_model_name_or_path (may be NULL). */
ds4_status ds4_model_lora_save(ds4_model *m, const char *dir, const char *base_name, int overwrite, ds4_error *err);
/* Write adapter_config.json and adapter_model.safetensors into the existing directory `dir`, replacing files of those
 * names, without the atomic swap: for checkpoint directories (their commit is the atomic step), which then hold the
 * model and its adapters side by side (ds4_model_load(dir) then ds4_model_lora_load(dir) gives both back bitwise). */
ds4_status ds4_model_lora_write_files(ds4_model *m, const char *dir, const char *base_name, ds4_error *err);
/* W += s·B A on every adapted weight, then drop the adapters. */
ds4_status ds4_model_merge_lora(ds4_model *m, ds4_error *err);
/* Drop the adapters without merging them. */
void ds4_model_drop_lora(ds4_model *m);
int ds4_model_has_lora(const ds4_model *m);
/* The adapters' rank, scale and element count (0 without adapters). */
ds4_status ds4_model_lora_info(const ds4_model *m, int64_t *rank, double *scale, int64_t *numel, ds4_error *err);
/* The adapters' layout, what makes their flat buffer (ds4's order: layer by layer, site by site, A before B; the
 * optimizer's moments and ds4_model_lora_read use it): rank, alpha, rsLoRA and per layer the adapted weights as bits
 * 1 << site, sites in the order wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, indexer weights_proj, shared w1, w2, w3,
 * routed experts' gate_up, down. masks: room for cap >= num_hidden_layers entries (may be NULL). */
ds4_status ds4_model_lora_layout(const ds4_model *m, int64_t *rank, double *alpha, int32_t *rslora, uint32_t *masks,
                                 int64_t cap, ds4_error *err);
/* Attach zero adapters of that layout (n = num_hidden_layers masks, each checked against its layer): a rollout worker
 * makes the trainer's adapter buffer this way, then fills it with ds4_model_lora_write. */
ds4_status ds4_model_lora_attach_layout(ds4_model *m, int64_t rank, double alpha, int32_t rslora, const uint32_t *masks,
                                        int64_t n, ds4_error *err);
/* The element count of adapters of that layout on this model (the masks checked as above), without attaching them. */
ds4_status ds4_model_lora_layout_numel(const ds4_model *m, int64_t rank, const uint32_t *masks, int64_t n,
                                       int64_t *numel, ds4_error *err);
/* Copy the adapters' flat fp32 buffer out / in (n = the adapters' element count, ds4_model_lora_info's numel). */
ds4_status ds4_model_lora_read(ds4_model *m, float *dst, int64_t n, ds4_error *err);
ds4_status ds4_model_lora_write(ds4_model *m, const float *src, int64_t n, ds4_error *err);
/* Gradients are enabled: the model's (ds4_model_enable_grad) or, with adapters, the adapters'. */
int ds4_model_grad_enabled(const ds4_model *m);

/* The adapters (grads 0) or their gradients (grads 1) in PEFT's layout under PEFT's key names
 * ("base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight"): n new F32 tensors (names[i] malloc'd);
 * release with ds4_lora_tensors_free. */
typedef struct ds4_lora_tensors {
    size_t n;
    char **names;
    ds4_tensor **tensors;
} ds4_lora_tensors;
ds4_status ds4_model_lora_tensors(ds4_model *m, int grads, ds4_lora_tensors *out, ds4_error *err);
/* The inverse for values: write tensors (PEFT layout and names, every adapter tensor given once) into the adapters. */
ds4_status ds4_model_lora_set(ds4_model *m, const ds4_lora_tensors *in, ds4_error *err);
void ds4_lora_tensors_free(ds4_lora_tensors *t);

#ifdef __cplusplus
}
#endif
#endif
