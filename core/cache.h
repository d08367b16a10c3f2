/* cache.h — the per-sequence decoding state behind ds4_cache (ds4_gen.h), shared by cache.c and forward.c. */
#ifndef DS4_CACHE_H
#define DS4_CACHE_H

#include <stdint.h>

#include "model.h"

/* One compressor's state (§7.1). Entry w is pooled from the tokens of window w (positions w·m .. w·m+m-1) and, with
 * overlap, of window w-1; a window is pooled once its last token arrives. */
typedef struct ds4_comp_cache {
    int64_t m, width, dd;     /* rate, projection width (2·dd with overlap, else dd), entry width */
    int overlap;
    float *ent;               /* [cap / m, dd] entries after norm and RoPE */
    float *C, *Z;             /* [2m, width] raw projections (Z without ape): rows [0, m) the last complete window
                                 (kept only with overlap), rows [m, 2m) the pending window, token q at m + q mod m */
} ds4_comp_cache;

typedef struct ds4_layer_cache {
    float *ring;              /* [R, d] window K(=V) vectors, token q at slot q mod R (R = min(window, cap)) */
    ds4_comp_cache comp;      /* CSA / HCA layers */
    ds4_comp_cache idx;       /* CSA layers: the lightning indexer's own compressor (entries are its keys) */
} ds4_layer_cache;

struct ds4_cache {
    const ds4_model *m;
    int64_t len, cap, ring;   /* tokens processed, capacity, R */
    uint64_t stamp;           /* the model's step_serial of the last step that used it */
    ds4_layer_cache *layers;  /* [L] */
    float *mem;
    size_t bytes;
};

/* The rows of token q for a step that appends tokens [p0, p0 + n) whose projections are X (row 0 = token p0):
 * from the chunk, the pending rows or the last complete window's rows (only these can hold a token of a window
 * that completes in the step). */
static inline const float *ds4_comp_row(const ds4_comp_cache *cc, const float *buf, const float *X, int64_t p0,
                                        int64_t q) {
    if (q >= p0) return X + (q - p0) * cc->width;
    const int64_t m = cc->m;
    return buf + ((q / m == p0 / m ? m : 0) + q % m) * cc->width;
}

/* After a layer of a step appended tokens [p0, p0 + n): keep the new window vectors (kv [n, d]) in the ring, and
 * the compressor's pending / last-window rows (C, Z [n, width]). */
void ds4_ring_commit(float *ring, int64_t R, int64_t d, int64_t p0, int64_t n, const float *kv);
void ds4_comp_commit(ds4_comp_cache *cc, int64_t p0, int64_t n, const float *C, const float *Z);

#endif
