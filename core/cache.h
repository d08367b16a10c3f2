/* cache.h — the per-sequence decoding state behind ds4_cache (ds4_gen.h), shared by cache.c, step.c and the
 * backends' step operations. */
#ifndef DS4_CACHE_H
#define DS4_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

/* One compressor's state (docs/architecture.md, "Decoding cache"). Entry w is pooled from the tokens of window w
 * (positions w·m .. w·m+m-1) and, with overlap, of window w-1; a window is pooled once its last token arrives. */
typedef struct ds4_comp_cache {
    int64_t m, width, dd;     /* rate, projection width (2·dd with overlap, else dd), entry width */
    int overlap;
    float *ent;               /* [cap / m, dd] entries after norm and RoPE */
    float *C, *Z;             /* [2m, width] raw projections (Z without ape): rows [0, m) the last complete window
                                 (kept only with overlap), rows [m, 2m) the pending window, token q at m + q mod m */
} ds4_comp_cache;

/* One layer's state: pointers into the cache's backend memory. */
typedef struct ds4_layer_cache {
    float *ring;              /* [R, d] window K(=V) vectors, token q at slot q mod R (R = min(window, cap)) */
    ds4_comp_cache comp;      /* CSA / HCA layers */
    ds4_comp_cache idx;       /* CSA layers: the lightning indexer's own compressor (entries are its keys) */
} ds4_layer_cache;

struct ds4_cache {
    const ds4_model *m;
    struct ds4_dev *dev;      /* the backend whose memory holds the state (the model's when it was created) */
    int64_t len, cap, ring;   /* tokens processed, capacity, R */
    uint64_t stamp;           /* the model's step_serial of the last step that used it */
    ds4_layer_cache *layers;  /* [L] host copy of the layer descriptors */
    ds4_layer_cache *dlayers; /* [L] the same descriptors in backend memory (== layers on the CPU) */
    void *mem;                /* backend memory: the state, then (off the CPU) dlayers */
    size_t bytes;             /* of the state */
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

#endif
