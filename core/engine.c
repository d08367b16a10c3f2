/* engine.c — the engine value: options and the thread pool every model of this engine computes with. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "engine.h"
#include "internal.h"

ds4_status ds4_engine_create(const ds4_engine_options *opt, ds4_engine **out, ds4_error *err) {
    if (!out) return ds4_fail(err, DS4_ERR_ARG, "engine create: out is NULL");
    int32_t n = opt ? opt->n_threads : 0;
    if (n < 0) return ds4_fail(err, DS4_ERR_ARG, "engine create: n_threads %d < 0", (int)n);
    if (n == 0) n = ds4_default_threads();
    ds4_engine *e = calloc(1, sizeof *e);
    if (!e) return ds4_fail(err, DS4_ERR_OOM, "engine create: allocation failed");
    ds4_status s = ds4_pool_create(n, &e->pool, err);
    if (s) {
        free(e);
        return s;
    }
    if (opt) e->device = opt->device;
    const char *prof = getenv("DS4_PROFILE");
    e->profile_env = prof && prof[0] == '1';
    e->profile = (opt && opt->profile) || e->profile_env;
    *out = e;
    return DS4_OK;
}

void ds4_engine_free(ds4_engine *e) {
    if (!e) return;
    ds4_pool_free(e->pool);
    free(e);
}

int32_t ds4_engine_threads(const ds4_engine *e) { return ds4_pool_threads(e->pool); }

void ds4_engine_set_profile(ds4_engine *e, int on) {
    if (e) e->profile = on != 0;
}

int ds4_engine_profile(const ds4_engine *e) { return e ? e->profile : 0; }

const char *ds4_build_info(void) {
#if defined(DS4_HAVE_CUDA) && defined(DS4_HAVE_NCCL)
    return "cpu+cuda+nccl";
#elif defined(DS4_HAVE_CUDA)
    return "cpu+cuda";
#else
    return "cpu";
#endif
}
