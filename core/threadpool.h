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
/* CPUs this process may run on (its affinity mask, else the online count): the pool polls for jobs only when it
 * has no more threads than these. */
int32_t ds4_usable_cpus(void);
/* The thread count an engine takes when none is asked for: one per physical core this process may run on (its CPU
 * affinity and cgroup quota), at most DS4_DEFAULT_THREADS_MAX; cpus.c says why. */
enum { DS4_DEFAULT_THREADS_MAX = 16 };
int32_t ds4_default_threads(void);
void ds4_pool_free(ds4_pool *p);
int32_t ds4_pool_threads(const ds4_pool *p);
void ds4_pool_run(ds4_pool *p, int64_t n, ds4_task_fn fn, void *ctx);
void ds4_pool_run_worker(ds4_pool *p, int64_t n, ds4_task_worker_fn fn, void *ctx);
/* The same on at most `threads` threads (the caller's included): for jobs whose tasks are more than their work is
 * worth threads. */
void ds4_pool_run_worker_on(ds4_pool *p, int64_t n, int32_t threads, ds4_task_worker_fn fn, void *ctx);

/* A record of the jobs a pool runs, for finding what limits thread scaling (bench/bench_profile_step --scaling):
 * per job its task count, a tag (*tag when set: the op then running, -1 outside one) and the calling thread's CPU
 * clock when it began and ended; per task its CPU seconds on the thread that ran it. The caller owns the arrays;
 * recording stops silently (full = 1) when either is full. CPU clocks, not wall clocks, so that a record taken with
 * more threads than cores still tells each task's cost. */
typedef struct ds4_pool_trace {
    int64_t job_cap, task_cap;   /* capacities of the arrays below */
    int64_t jobs, tasks;         /* records used */
    int32_t full;
    const int32_t *tag;          /* read at each job's start; NULL: tag -1 */
    int32_t *job_tag;            /* [job_cap] */
    int64_t *job_n, *job_first;  /* [job_cap] tasks, and the index of the first in task_s */
    double *job_t0, *job_t1;     /* [job_cap] the caller's CPU seconds at the start and at the end */
    double *task_s;              /* [task_cap] */
} ds4_pool_trace;

/* Start (trace) or stop (NULL) recording; not while a job runs. */
void ds4_pool_set_trace(ds4_pool *p, ds4_pool_trace *trace);
/* This thread's CPU seconds (the clock of the records above). */
double ds4_thread_cpu_seconds(void);

#endif
