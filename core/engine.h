/* engine.h — the engine's internals, shared by the model code. */
#ifndef DS4_ENGINE_H
#define DS4_ENGINE_H

#include "ds4.h"
#include "threadpool.h"

struct ds4_engine {
    ds4_pool *pool;
    ds4_device_options device;    /* where new models go */
    int profile;                  /* per-op profiles on */
    int profile_env;              /* DS4_PROFILE=1: print each model's profile to stderr when it is freed */
};

#endif
