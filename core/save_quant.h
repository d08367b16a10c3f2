/* save_quant.h — writing loaded-quantised tensors in their loaded format (save_quant.c), for save.c. */
#ifndef DS4_SAVE_QUANT_H
#define DS4_SAVE_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "ds4.h"

/* Whether table entry i may be written quantised (expand: every tensor is to be written as float instead), and the
 * room ds4_qsave_tensor then needs: *codes bytes for its codes and *scratch floats to check them (0 for an
 * FP4-resident expert, whose bytes are written as they are). */
int ds4_qsave_candidate(const ds4_model *m, size_t i, int expand, int64_t *codes, int64_t *scratch);

/* Entry i (a candidate) as its weight w and scale s tensors, when that is still exact: *yes = 1, w and s viewing the
 * model's memory, `codes` or the kept scale; sname (cap bytes) the scale's name beside weight name wname, with the
 * suffix the checkpoint used (".scale", or "_scale_inv" after ".weight"). *yes = 0: the tensor changed since it was
 * loaded; write it as float. */
ds4_status ds4_qsave_tensor(const ds4_model *m, size_t i, const char *wname, uint8_t *codes, float *scratch,
                            ds4_tensor *w, ds4_tensor *s, char *sname, size_t cap, int *yes, ds4_error *err);

/* An FP4-resident expert's values (numel floats), for writing it as float. */
void ds4_qsave_decode(const ds4_model *m, size_t i, float *out);

#endif
