/* threadpool.c — see threadpool.h. Workers sleep on a condition variable between jobs; a job is a
 * (fn, ctx, n) triple plus an atomic next-index counter. */
#define _POSIX_C_SOURCE 200809L
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct ds4_pool {
    int32_t n_threads;          /* including the caller */
    pthread_t *threads;         /* n_threads - 1 workers */
    struct worker_arg *args;    /* their (pool, index) */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    uint64_t generation;        /* bumped per job so sleeping workers see a new one */
    int stop;
    ds4_task_fn fn;
    ds4_task_worker_fn wfn;         /* set instead of fn by ds4_pool_run_worker */
    void *ctx;
    int64_t n;
    atomic_llong next;
    int32_t active;             /* workers still inside the current job */
};

struct worker_arg {
    ds4_pool *pool;
    int32_t index;              /* 1 .. n_threads - 1; the calling thread is 0 */
};

static void drain(ds4_pool *p, int32_t index) {
    for (;;) {
        int64_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        if (p->wfn) p->wfn(p->ctx, i, index);
        else p->fn(p->ctx, i);
    }
}

static void *worker(void *arg) {
    ds4_pool *p = ((struct worker_arg *)arg)->pool;
    const int32_t index = ((struct worker_arg *)arg)->index;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        drain(p, index);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

ds4_status ds4_pool_create(int32_t n_threads, ds4_pool **out, ds4_error *err) {
    if (n_threads < 1 || n_threads > 1024)
        return ds4_fail(err, DS4_ERR_ARG, "thread pool: n_threads %d outside [1, 1024]", (int)n_threads);
    ds4_pool *p = calloc(1, sizeof *p);
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "thread pool: allocation failed");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->args = calloc((size_t)n_threads - 1, sizeof *p->args);
        if (!p->threads || !p->args) {
            ds4_pool_free(p);
            return ds4_fail(err, DS4_ERR_OOM, "thread pool: allocation failed");
        }
        for (int32_t i = 0; i < n_threads - 1; i++) {
            p->args[i] = (struct worker_arg){p, i + 1};
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
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    if (p->threads)
        for (int32_t i = 0; i < p->n_threads - 1; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p->args);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p);
}

int32_t ds4_pool_threads(const ds4_pool *p) { return p->n_threads; }

static void run_job(ds4_pool *p, int64_t n, ds4_task_fn fn, ds4_task_worker_fn wfn, void *ctx) {
    if (n <= 0) return;
    if (p->n_threads == 1 || n == 1) {
        for (int64_t i = 0; i < n; i++) {
            if (wfn) wfn(ctx, i, 0);
            else fn(ctx, i);
        }
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->wfn = wfn;
    p->ctx = ctx;
    p->n = n;
    atomic_store(&p->next, 0);
    p->active = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    drain(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void ds4_pool_run(ds4_pool *p, int64_t n, ds4_task_fn fn, void *ctx) { run_job(p, n, fn, NULL, ctx); }

void ds4_pool_run_worker(ds4_pool *p, int64_t n, ds4_task_worker_fn fn, void *ctx) { run_job(p, n, NULL, fn, ctx); }
