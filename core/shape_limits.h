/* shape_limits.h — shape limits that the kernels of every backend rely on, checked once where a model is built
 * (ds4_model_alloc) so that no kernel has to. Far above any released configuration (DeepSeek-V4-Flash:
 * hc_mult 4, 6 of 256 experts, rotary width 64, compress rates 4 / 128, index_topk 512).
 *
 * Why each exists:
 *   DS4_MAX_HC          per-token mHC work arrays (mix logits (2+n)·n, the n×n Sinkhorn matrix and its
 *                       backward states) live on the stack / in registers.
 *   DS4_MAX_TOPK_EXPERTS per-token slot arrays (combine order, routing weights).
 *   DS4_MAX_ROPE_DIM    the inverse-frequency table is built on the stack.
 *   DS4_MAX_RATE        a compressor pools 2m slots per channel on the stack (overlap doubles m).
 *   DS4_MAX_EXPERTS     the random initialiser permutes experts on the stack; kernels size expert tables.
 *   DS4_MAX_IKL_TOPK    the indexer-KL loss keeps one score per pick on the stack.
 */
#ifndef DS4_SHAPE_LIMITS_H
#define DS4_SHAPE_LIMITS_H

#define DS4_MAX_HC 32
#define DS4_MAX_TOPK_EXPERTS 64
#define DS4_MAX_ROPE_DIM 2048
#define DS4_MAX_RATE 256
#define DS4_MAX_EXPERTS 4096
#define DS4_MAX_IKL_TOPK 4096

/* Sinkhorn work arrays: the n×n matrix and the mix logits of one token. */
#define DS4_MAX_HC_SQ (DS4_MAX_HC * DS4_MAX_HC)
#define DS4_MAX_HC_MIX ((2 + DS4_MAX_HC) * DS4_MAX_HC)

#endif
