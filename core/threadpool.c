/* threadpool.c — see threadpool.h. A job is a (fn, ctx, n) triple plus an atomic next-index counter, published by
 * bumping an atomic generation. Between jobs a worker first polls the generation for a short while (a training step
 * runs over a thousand jobs, most under a millisecond, so waking sleeping threads for each was a large part of the
 * time on many cores), then sleeps on a condition variable; the caller waits for the last worker the same way. Only
 * when the pool has no more threads than the CPUs this process may run on: a spinning thread on a shared core would
 * take the time of the thread it waits for.
 *
 * A job of n tasks takes part of the pool: the caller and workers 1 .. min(n, threads) - 1 (the count rides in the
 * generation's low bits), and the caller waits for those only. The others let the job pass without touching it, so
 * a small job on a 64-thread pool costs a fork and join of its own few threads, not of all 64. Which thread runs a
 * task never changes what it computes (threadpool.h), so neither does how many take part. A worker's polling budget
 * runs from the last job it took part in, not from the last job: while the jobs need only a few threads the others
 * go to sleep (polling, they would take a core's time from a busy thread on the same core or host), each on its own
 * condition variable, and a job wakes only the sleepers it needs. */
#define _POSIX_C_SOURCE 200809L
#include "threadpool.h"

#include <pthread.h>
#include <time.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

int sched_yield(void); /* POSIX <sched.h>, which core/sched.h shadows on this library's include path */

/* Polls of the generation (or of the active count) before sleeping: about 20-60 µs, longer than the gap between
 * two jobs of a pass, far shorter than the pause between passes. */
enum { SPIN_POLLS = 4096 };
/* The generation's low bits hold the job's thread count (the caller included; at most 1024). */
enum { PART_BITS = 16 };
#define PART_MASK ((uint64_t)((1u << PART_BITS) - 1))

struct ds4_pool {
    int32_t n_threads;          /* including the caller */
    int spin;                   /* poll before sleeping (n_threads <= the CPUs of the affinity mask) */
    pthread_t *threads;         /* n_threads - 1 workers */
    struct worker_arg *args;    /* their (pool, index, wake) */
    int32_t conds;              /* the args' wake conditions initialised */
    pthread_mutex_t mu;
    pthread_cond_t done;
    atomic_uint_fast64_t generation; /* per job: (counter << PART_BITS) | threads taking part; never 0 (wait_job's
                                      * "stopped") */
    atomic_int sleepers;        /* workers asleep on their `wake` (changed under mu) */
    atomic_int caller_sleeps;   /* the caller waits on `done` (changed under mu) */
    atomic_int stop;
    ds4_task_fn fn;
    ds4_task_worker_fn wfn;     /* set instead of fn by ds4_pool_run_worker */
    void *ctx;
    int64_t n;
    atomic_llong next;
    atomic_int active;          /* workers taking part in the current job that have not finished it */
    ds4_pool_trace *trace;      /* or NULL */
};

struct worker_arg {
    ds4_pool *pool;
    int32_t index;              /* 1 .. n_threads - 1; the calling thread is 0 */
    pthread_cond_t wake;        /* this worker sleeps on it */
    int asleep;                 /* (under mu) */
};

/* One poll's wait: a pause, and every 64th poll the processor offered to another runnable thread (on a machine
 * busier than it looked, the thread being waited for). */
static inline void cpu_relax(int k) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    if ((k & 63) == 63) sched_yield();
}

double ds4_thread_cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void drain(ds4_pool *p, int32_t index) {
    ds4_pool_trace *tr = p->trace; /* set between jobs only */
    for (;;) {
        int64_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        const double t0 = tr ? ds4_thread_cpu_seconds() : 0;
        if (p->wfn) p->wfn(p->ctx, i, index);
        else p->fn(p->ctx, i);
        if (tr && !tr->full) tr->task_s[tr->tasks + i] = ds4_thread_cpu_seconds() - t0; /* room checked by run_job */
    }
}

/* Whether generation g is a job worker `index` takes part in (and not the one it has seen). */
static int mine(uint64_t g, uint64_t *seen, int32_t index) {
    if (g == *seen) return 0;
    *seen = g;
    return (uint64_t)index < (g & PART_MASK);
}

/* The next job after `seen` that worker w takes part in (its generation), or 0 once the pool stops; *polls: what is
 * left of its polling budget. The sleeper is marked under mu before its last look at the generation, and run_tasks
 * publishes the generation before it looks at the sleepers (both sequentially consistent), so either the worker sees
 * the new job or run_tasks sees it asleep and signals it. */
static uint64_t wait_job(ds4_pool *p, uint64_t seen, struct worker_arg *w, int *polls) {
    for (; p->spin && *polls > 0; --*polls) {
        if (atomic_load(&p->stop)) return 0;
        if (mine(atomic_load(&p->generation), &seen, w->index)) return seen;
        cpu_relax(*polls);
    }
    pthread_mutex_lock(&p->mu);
    w->asleep = 1;
    atomic_fetch_add(&p->sleepers, 1);
    while (!atomic_load(&p->stop) && !mine(atomic_load(&p->generation), &seen, w->index))
        pthread_cond_wait(&w->wake, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    w->asleep = 0;
    pthread_mutex_unlock(&p->mu);
    return atomic_load(&p->stop) ? 0 : seen;
}

static void *worker(void *arg) {
    struct worker_arg *w = arg;
    ds4_pool *p = w->pool;
    const int32_t index = w->index;
    uint64_t seen = 1; /* the generation the pool starts at (a job already published is seen as new) */
    for (;;) {
        int polls = SPIN_POLLS;
        seen = wait_job(p, seen, w, &polls);
        if (seen == 0) break;
        drain(p, index);
        if (atomic_fetch_sub(&p->active, 1) == 1 && atomic_load(&p->caller_sleeps)) {
            pthread_mutex_lock(&p->mu); /* the caller re-checks active under mu before it sleeps */
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

ds4_status ds4_pool_create(int32_t n_threads, ds4_pool **out, ds4_error *err) {
    if (n_threads < 1 || n_threads > 1024)
        return ds4_fail(err, DS4_ERR_ARG, "thread pool: n_threads %d outside [1, 1024]", (int)n_threads);
    ds4_pool *p = calloc(1, sizeof *p);
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "thread pool: allocation failed");
    p->n_threads = n_threads;
    p->spin = n_threads <= ds4_usable_cpus();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 1); /* 0 means "stopped" to wait_job's callers */
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_sleeps, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->active, 0);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->args = calloc((size_t)n_threads - 1, sizeof *p->args);
        if (!p->threads || !p->args) {
            p->n_threads = 1; /* nothing started */
            ds4_pool_free(p);
            return ds4_fail(err, DS4_ERR_OOM, "thread pool: allocation failed");
        }
        for (int32_t i = 0; i < n_threads - 1; i++) {
            p->args[i] = (struct worker_arg){.pool = p, .index = i + 1};
            pthread_cond_init(&p->args[i].wake, NULL);
        }
        p->conds = n_threads - 1;
        for (int32_t i = 0; i < n_threads - 1; i++) {
            int rc = pthread_create(&p->threads[i], NULL, worker, &p->args[i]);
            if (rc != 0) {
                p->n_threads = i + 1; /* only join what started */
                ds4_pool_free(p);
                return ds4_fail(err, DS4_ERR_INTERNAL, "thread pool: pthread_create #%d failed: %s", (int)i,
                                strerror(rc));
            }
        }
    }
    *out = p;
    return DS4_OK;
}

void ds4_pool_free(ds4_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    for (int32_t i = 0; i < p->conds; i++) pthread_cond_signal(&p->args[i].wake);
    pthread_mutex_unlock(&p->mu);
    if (p->threads)
        for (int32_t i = 0; i < p->n_threads - 1; i++) pthread_join(p->threads[i], NULL);
    for (int32_t i = 0; i < p->conds; i++) pthread_cond_destroy(&p->args[i].wake);
    free(p->threads);
    free(p->args);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->done);
    free(p);
}

int32_t ds4_pool_threads(const ds4_pool *p) { return p->n_threads; }

void ds4_pool_set_trace(ds4_pool *p, ds4_pool_trace *trace) { p->trace = trace; }

/* The trace's records of a job: its start (before publishing it) and its end (after the last task). */
static void trace_begin(ds4_pool_trace *tr, int64_t n) {
    if (tr->full || tr->jobs >= tr->job_cap || tr->tasks + n > tr->task_cap) {
        tr->full = 1;
        return;
    }
    tr->job_tag[tr->jobs] = tr->tag ? *tr->tag : -1;
    tr->job_n[tr->jobs] = n;
    tr->job_first[tr->jobs] = tr->tasks;
    tr->job_t0[tr->jobs] = ds4_thread_cpu_seconds();
}

static void trace_end(ds4_pool_trace *tr, int64_t n) {
    if (tr->full) return;
    tr->job_t1[tr->jobs++] = ds4_thread_cpu_seconds();
    tr->tasks += n;
}

static void run_tasks(ds4_pool *p, int64_t n, int32_t cap, ds4_task_fn fn, ds4_task_worker_fn wfn, void *ctx) {
    int32_t part = n < p->n_threads ? (int32_t)n : p->n_threads; /* threads taking part, the caller included */
    if (cap >= 1 && cap < part) part = cap;
    if (part == 1) {
        p->fn = fn, p->wfn = wfn, p->ctx = ctx, p->n = n; /* for drain; no worker looks at a job of one thread */
        atomic_store(&p->next, 0);
        drain(p, 0);
        return;
    }
    /* every worker has left the previous job (active reached 0), so these plain stores race with nothing; the
     * generation's bump publishes them */
    p->fn = fn;
    p->wfn = wfn;
    p->ctx = ctx;
    p->n = n;
    atomic_store(&p->next, 0);
    atomic_store(&p->active, part - 1);
    const uint64_t g = atomic_load(&p->generation);
    atomic_store(&p->generation, (((g >> PART_BITS) + 1) << PART_BITS) | (uint64_t)part);
    if (atomic_load(&p->sleepers) > 0) { /* wake the job's sleeping workers, and only those */
        pthread_mutex_lock(&p->mu);
        for (int32_t i = 0; i < part - 1; i++)
            if (p->args[i].asleep) pthread_cond_signal(&p->args[i].wake);
        pthread_mutex_unlock(&p->mu);
    }
    drain(p, 0);
    for (int k = 0; p->spin && k < SPIN_POLLS && atomic_load(&p->active) > 0; k++) cpu_relax(k);
    if (atomic_load(&p->active) > 0) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_sleeps, 1);
        while (atomic_load(&p->active) > 0) pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_sleeps, 0);
        pthread_mutex_unlock(&p->mu);
    }
}

static void run_job(ds4_pool *p, int64_t n, int32_t cap, ds4_task_fn fn, ds4_task_worker_fn wfn, void *ctx) {
    if (n <= 0) return;
    ds4_pool_trace *tr = p->trace;
    if (tr) trace_begin(tr, n);
    run_tasks(p, n, cap, fn, wfn, ctx);
    if (tr) trace_end(tr, n);
}

void ds4_pool_run(ds4_pool *p, int64_t n, ds4_task_fn fn, void *ctx) { run_job(p, n, 0, fn, NULL, ctx); }

void ds4_pool_run_worker(ds4_pool *p, int64_t n, ds4_task_worker_fn fn, void *ctx) { run_job(p, n, 0, NULL, fn, ctx); }

void ds4_pool_run_worker_on(ds4_pool *p, int64_t n, int32_t threads, ds4_task_worker_fn fn, void *ctx) {
    run_job(p, n, threads > 0 ? threads : 1, NULL, fn, ctx);
}
