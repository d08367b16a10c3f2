/* engine.h — the engine's internals, shared by the model code. */
#ifndef DS4_ENGINE_H
#define DS4_ENGINE_H

#include "ds4.h"
#include "threadpool.h"

struct ds4_engine {
    ds4_pool *pool;
};

#endif
