/* save_quant.c — saving tensors in the quantised format they were loaded in (docs/checkpoints.md, "Saving").
 *
 * A tensor the checkpoint stored as FP8 or FP4 is saved so again, with its original scales, while that is still the
 * model's tensor exactly:
 *   - an FP4-resident expert always: its bytes and scales are the loaded ones and never change;
 *   - a dequantised tensor when the nearest codes of its fp32 values under the kept scales, dequantised again the way
 *     the loader does (ds4_quant_dequant), give its bits back. A tensor that training or merging changed fails the
 *     check and is written as float. The check makes the saved checkpoint load to the same model whatever happened
 *     to the tensor; on an unchanged one the codes are the loaded bytes (the nearest code of an exact value is its
 *     own code, signed zeros included). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "internal.h"
#include "model.h"
#include "quant.h"
#include "save_quant.h"

static int64_t code_bytes(const ds4_param *p) { return p->qkind == DS4_Q_FP8 ? p->numel : p->numel / 2; }

int ds4_qsave_candidate(const ds4_model *m, size_t i, int expand, int64_t *codes, int64_t *scratch) {
    const ds4_param *p = &m->table[i];
    *codes = *scratch = 0;
    if (p->dtype == DS4_FP4_PACKED) return !expand;
    if (expand || p->dtype != DS4_F32 || !p->qkind || !p->sbytes || p->src_part != 0 || p->ndim != 2) return 0;
    *codes = code_bytes(p);
    *scratch = p->numel;
    return 1;
}

/* The scale's name beside saved weight name `wname` ("X.weight"): the suffix the checkpoint used. */
static int scale_name(const ds4_param *p, const char *wname, char *out, size_t cap) {
    const size_t n = strlen(wname), k = sizeof ".weight" - 1, sl = strlen(p->src_scale);
    const int inv = sl > 10 && strcmp(p->src_scale + sl - 10, "_scale_inv") == 0;
    if (n <= k || strcmp(wname + n - k, ".weight") != 0) return 0;
    const int w = inv ? snprintf(out, cap, "%s_scale_inv", wname)
                      : snprintf(out, cap, "%.*s.scale", (int)(n - k), wname);
    return w > 0 && (size_t)w < cap;
}

static void view(ds4_tensor *t, ds4_dtype dt, int64_t d0, int64_t d1, const void *data, size_t nbytes) {
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = 2;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->data = (void *)(uintptr_t)data;
    t->nbytes = nbytes;
}

ds4_status ds4_qsave_tensor(const ds4_model *m, size_t i, const char *wname, uint8_t *codes, float *scratch,
                            ds4_tensor *w, ds4_tensor *s, char *sname, size_t cap, int *yes, ds4_error *err) {
    const ds4_param *p = &m->table[i];
    *yes = 0;
    if (!p->src_scale || !scale_name(p, wname, sname, cap))
        return ds4_fail(err, DS4_ERR_INTERNAL, "model save: no scale name for '%s'", wname);
    if (p->dtype == DS4_FP4_PACKED) {
        view(w, p->qdt, p->shape[0], p->shape[1] / 2, m->q4 + p->offset, (size_t)p->numel / 2);
        view(s, DS4_F8_E8M0, p->sshape[0], p->sshape[1], m->q4 + p->qscale, (size_t)(p->numel / DS4_FP4_BLOCK));
        *yes = 1;
        return DS4_OK;
    }
    const int64_t rows = p->shape[0], cols = p->shape[1];
    const size_t sbytes = (size_t)(p->sshape[0] * p->sshape[1]) * ds4_dtype_size(p->sdt);
    const ds4_quant_format qf = {{m->qblock[0], m->qblock[1]}};
    const ds4_st_entry se = {.name = p->src_scale, .dtype = p->sdt, .ndim = 2, .shape = {p->sshape[0], p->sshape[1]},
                             .data = p->sbytes, .nbytes = sbytes};
    const ds4_st_entry we = {.name = p->src, .dtype = p->qdt, .ndim = 2,
                             .shape = {rows, p->qkind == DS4_Q_FP8 ? cols : cols / 2}, .data = codes,
                             .nbytes = (size_t)code_bytes(p)};
    const float *values = ds4_param_host(m, p); /* the gathered whole layout while saving sharded experts */
    ds4_status st = ds4_quant_encode(codes, values, &se, rows, cols, (ds4_qkind)p->qkind, &qf, err);
    if (!st) st = ds4_quant_dequant(scratch, &we, &se, rows, cols, &qf, err);
    if (st) {
        ds4_error_prefix(err, "model save: ");
        return st;
    }
    if (memcmp(scratch, values, (size_t)p->numel * sizeof(float)) != 0) return DS4_OK; /* changed: write it as float */
    view(w, p->qdt, we.shape[0], we.shape[1], codes, we.nbytes);
    view(s, p->sdt, p->sshape[0], p->sshape[1], p->sbytes, sbytes);
    *yes = 1;
    return DS4_OK;
}

void ds4_qsave_decode(const ds4_model *m, size_t i, float *out) {
    const ds4_param *p = &m->table[i];
    ds4_fp4_decode(out, m->q4 + p->offset, m->q4 + p->qscale, 0, p->numel);
}
