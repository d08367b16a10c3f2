/* test_threadpool.c — the engine's thread pool (core/threadpool.c): every index of every job runs exactly once, on a
 * worker index below the thread count, and a job returns only when all of its calls have finished; for many short
 * jobs back to back (the pattern of a training step, where workers poll for the next job before sleeping), for jobs
 * after a pause long enough that the workers went to sleep, for both job kinds and for jobs held to fewer threads
 * (ds4_pool_run_worker_on: every worker index below the cap), with fewer tasks than threads (only that many take
 * part), and for thread counts at and above this machine's processors (the pool polls only at or below). The
 * reference is a count per index, kept by the tasks themselves. */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "testlib.h"
#include "threadpool.h"

enum { MAX_N = 97 };

typedef struct {
    atomic_int hits[MAX_N];
    atomic_int bad_worker;
    int32_t threads;
} job;

static void task(void *ctx, int64_t i) { atomic_fetch_add(&((job *)ctx)->hits[i], 1); }

static void task_worker(void *ctx, int64_t i, int32_t worker) {
    job *j = ctx;
    if (worker < 0 || worker >= j->threads) atomic_fetch_add(&j->bad_worker, 1);
    atomic_fetch_add(&j->hits[i], 1);
}

/* Run `jobs` jobs of 1..MAX_N tasks; after each, every index must have run once. Returns the failures. */
static int run_jobs(ds4_pool *pool, int32_t threads, int jobs, int pause_every) {
    int bad = 0;
    job *j = malloc(sizeof *j);
    for (int k = 0; k < jobs; k++) {
        const int64_t n = 1 + (k * 37) % MAX_N;
        memset(j, 0, sizeof *j);
        j->threads = threads;
        if (k % 3 == 1) ds4_pool_run(pool, n, task, j);
        else if (k % 3 == 2) {
            j->threads = 1 + (int32_t)(k % threads); /* the cap: worker indices below it */
            ds4_pool_run_worker_on(pool, n, j->threads, task_worker, j);
        } else {
            j->threads = n < threads ? (int32_t)n : threads; /* a job of n tasks takes n threads at most */
            ds4_pool_run_worker(pool, n, task_worker, j);
        }
        for (int64_t i = 0; i < MAX_N; i++) bad += atomic_load(&j->hits[i]) != (i < n);
        bad += atomic_load(&j->bad_worker) != 0;
        if (pause_every && k % pause_every == pause_every - 1) {
            struct timespec ts = {0, 3000000}; /* 3 ms: longer than the workers poll */
            nanosleep(&ts, NULL);
        }
    }
    free(j);
    return bad;
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    /* 16: many sleeping workers, each woken only for the jobs that need it */
    const int32_t counts[] = {1, 2, (int32_t)(online > 2 ? online : 2), (int32_t)(online + 2), 16};
    for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        ds4_pool *pool = NULL;
        ds4_error err;
        CHECK_OK(ds4_pool_create(counts[c], &pool, &err), &err);
        CHECK(ds4_pool_threads(pool) == counts[c], "pool of %d threads reports %d", counts[c], ds4_pool_threads(pool));
        const int bad = run_jobs(pool, counts[c], 20000, 0) + run_jobs(pool, counts[c], 40, 4);
        CHECK(bad == 0, "%d threads: %d indices ran other than once (or on a worker index out of range)", counts[c], bad);
        ds4_pool_free(pool);
    }
    /* the default thread count: at least one, at most the cap and the CPUs this process may use (under
     * `taskset -c 1`: one), which are at most the online ones */
    const int32_t dflt = ds4_default_threads(), cpus = ds4_usable_cpus();
    CHECK(dflt >= 1 && dflt <= DS4_DEFAULT_THREADS_MAX && dflt <= cpus, "default threads %d (usable CPUs %d, cap %d)",
          (int)dflt, (int)cpus, (int)DS4_DEFAULT_THREADS_MAX);
    CHECK(cpus >= 1 && cpus <= online, "usable CPUs %d, online %ld", (int)cpus, online);
    printf("  default threads %d of %d usable CPUs (%ld online)\n", (int)dflt, (int)cpus, online);
    /* a pool freed right after it was made, and one freed while its workers sleep */
    ds4_pool *pool = NULL;
    ds4_error err;
    CHECK_OK(ds4_pool_create(3, &pool, &err), &err);
    ds4_pool_free(pool);
    CHECK_OK(ds4_pool_create(2, &pool, &err), &err);
    CHECK(run_jobs(pool, 2, 10, 0) == 0, "2 threads: a short run failed");
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
    ds4_pool_free(pool);
    return ds4t_finish("test_threadpool");
}
