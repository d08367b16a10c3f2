/* threadpool.h — a fixed pool of worker threads owned by an engine.
 *
 * ds4_pool_run(pool, n, fn, ctx) calls fn(ctx, i) for every i in [0, n) across the workers and the calling
 * thread, and returns when all calls have finished. Work is handed out by an atomic counter, so each index
 * runs exactly once; a kernel that writes only the outputs of index i is deterministic whatever the
 * thread count. Calls must not nest (a task must not call ds4_pool_run on the same pool). */
#ifndef DS4_THREADPOOL_H
#define DS4_THREADPOOL_H

#include <stdint.h>
#include "ds4.h"

typedef struct ds4_pool ds4_pool;
typedef void (*ds4_task_fn)(void *ctx, int64_t i);
/* A task that is told which thread runs it: worker in [0, threads), 0 the calling thread. Tasks of one job that run
 * on the same worker run one after the other, so per-worker scratch needs no locking. */
typedef void (*ds4_task_worker_fn)(void *ctx, int64_t i, int32_t worker);

ds4_status ds4_pool_create(int32_t n_threads, ds4_pool **out, ds4_error *err);
void ds4_pool_free(ds4_pool *p);
int32_t ds4_pool_threads(const ds4_pool *p);
void ds4_pool_run(ds4_pool *p, int64_t n, ds4_task_fn fn, void *ctx);
void ds4_pool_run_worker(ds4_pool *p, int64_t n, ds4_task_worker_fn fn, void *ctx);

#endif
