/* host_twin.h — a stand-in device for tests on a machine without a GPU: a twin of the CPU backend that declares its
 * memory host-invisible, so that a model attached to it takes the paths a CUDA model takes (its inputs uploaded into
 * planned buffers, its outputs, gradients and tape read back, the device hooks of the distributed modes) while the
 * operations are still the CPU reference's. Used by test_zero_device.c and test_cp_device.c. */
#ifndef DS4_TEST_HOST_TWIN_H
#define DS4_TEST_HOST_TWIN_H

#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "internal.h"
#include "model.h"
#include "ops.h"
#include "testlib.h"

/* Give a CPU model a "device": a CPU backend marked host-invisible, with a working copy laid out flat (fp32). The
 * backend runs its large copies on e's pool: each rank's twin gets an engine of its own, as a pool serves one caller
 * at a time (ranks are processes of their own in a real job). */
static inline ds4_dev *twin_attach(ds4_engine *e, ds4_model *m) {
    ds4_error err = {0};
    ds4_dev *d = NULL;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (!d) return NULL;
    d->host_visible = 0;
    m->dev_off = malloc(m->n_table * sizeof *m->dev_off);
    m->dev_mem = malloc((size_t)m->n_params * sizeof(float));
    if (!m->dev_off || !m->dev_mem) {
        CHECK(0, "twin: allocating the working copy");
        return NULL;
    }
    for (size_t i = 0; i < m->n_table; i++)
        m->dev_off[i] = m->table[i].dtype == DS4_F32 ? m->table[i].offset * (int64_t)sizeof(float) : -1;
    memcpy(m->dev_mem, m->params, (size_t)m->n_params * sizeof(float));
    m->dev_w.mdt = DS4_F32;
    m->dev = d;
    CHECK_OK(ds4_model_train_bind(m, &err), &err); /* the gradients on the twin */
    return d;
}

/* Back to the CPU backend: the training state read back and freed through the twin, the RoPE tables a pass copied
 * onto it freed (the CPU backend uses the host's in place, so it would not free them), then the twin released. */
static inline void twin_detach(ds4_model *m, ds4_dev *d) {
    ds4_error err = {0};
    CHECK_OK(ds4_model_drop_train_state(m, &err), &err);
    for (int k = 0; k < 2; k++) {
        if (m->rope_dev[k] != m->rope_cs[k]) d->ops->free(d, m->rope_dev[k]);
        m->rope_dev[k] = NULL;
    }
    free(m->dev_mem);
    free(m->dev_off);
    m->dev_mem = NULL;
    m->dev_off = NULL;
    m->dev = m->cpu;
    ds4_dev_release(d);
}

#endif
