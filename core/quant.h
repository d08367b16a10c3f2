/* quant.h — the quantised checkpoint formats ds4 reads (docs/checkpoints.md): validating a quantised weight and its
 * scale tensor against the shape the model expects, and dequantising them to fp32 exactly.
 *
 *   FP8   weight F8_E4M3 [rows, cols]; scale F32, BF16 or F8_E8M0 [ceil(rows/br), ceil(cols/bc)], one per br x bc
 *         block (128 x 128 unless config.json's quantization_config.weight_block_size says otherwise);
 *         w = e4m3(q) * scale[r / br][c / bc].
 *   FP4   weight I8 or U8 [rows, cols/2], two e2m1 values per byte, element 2j in the low nibble and 2j+1 in the
 *         high nibble (as DeepSeek's converter unpacks them); scale F8_E8M0 (or F32 / BF16) [rows, cols/32];
 *         w = e2m1(nibble) * scale[r][c / 32].
 * The scale's name is the weight's with ".weight" replaced by ".scale" (official release) or ".weight_scale_inv"
 * (transformers); despite the name, transformers' "inverse" scale multiplies too. */
#ifndef DS4_QUANT_H
#define DS4_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

enum { DS4_FP4_BLOCK = 32, DS4_FP8_BLOCK_DEFAULT = 128 };

typedef struct ds4_quant_format {
    int64_t block[2]; /* FP8 block rows, cols */
} ds4_quant_format;

typedef enum ds4_qkind { DS4_Q_NONE = 0, DS4_Q_FP8, DS4_Q_FP4 } ds4_qkind;

/* The FP8 block from a config.json text's "quantization_config" (absent: 128 x 128). Refuses a quant_method other
 * than "fp8", an fmt other than "e4m3", and a weight_block_size that is not two integers in [1, 2^20]. */
ds4_status ds4_quant_format_parse(const char *json, size_t len, ds4_quant_format *q, ds4_error *err);
/* The same from DIR/config.json (a missing file gives the default: ds4_config_load reports it). */
ds4_status ds4_quant_format_load(const char *dir, ds4_quant_format *q, ds4_error *err);

/* Which quantised layout a weight's dtype says it is in (DS4_Q_NONE for a float weight). */
ds4_qkind ds4_quant_kind(ds4_dtype weight_dtype);

/* "X.scale" / "X.weight_scale_inv" -> "X.weight" into out; 0 when `name` is not spelled as a scale (or out is
 * too small). Whether it really is one is for the caller to decide: "attn_hc.scale" is an mHC parameter. */
int ds4_quant_scale_target(const char *name, char *out, size_t cap);

/* Check weight `w` (quantised, kind from its dtype) and its `scale` (may be NULL: an error) against the logical
 * [rows, cols] fp32 shape the model expects. Errors name both tensors and the shapes found and expected. */
ds4_status ds4_quant_check(const ds4_st_entry *w, const ds4_st_entry *scale, int64_t rows, int64_t cols,
                           const ds4_quant_format *q, ds4_error *err);

/* Dequantise a checked pair into dst[rows * cols]. A NaN or infinite scale is an error naming its position. */
ds4_status ds4_quant_dequant(float *dst, const ds4_st_entry *w, const ds4_st_entry *scale, int64_t rows,
                             int64_t cols, const ds4_quant_format *q, ds4_error *err);

/* The inverse for saving: the codes nearest to w [rows, cols] under `scale` (FP8: [rows, cols] bytes; FP4: [rows,
 * cols/2] packed as read). Exact where w came from dequantising with those scales; whether it did is the caller's to
 * check (dequantise the codes again and compare). */
ds4_status ds4_quant_encode(void *codes, const float *w, const ds4_st_entry *scale, int64_t rows, int64_t cols,
                            ds4_qkind kind, const ds4_quant_format *q, ds4_error *err);

/* e2m1 code (low 4 bits of `nibble`) as a float: sign bit 3, then {0, 0.5, 1, 1.5, 2, 3, 4, 6}. */
float ds4_fp4_e2m1_to_f32(uint8_t nibble);

#endif
