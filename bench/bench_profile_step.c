/* bench_profile_step.c — one training step (forward, backward, AdamW as bench_train runs it) or one forward with
 * logits (as bench_forward runs it) of a model with random weights, after warm-up steps, for a profiler:
 *
 *   build/bench_forward --print-config 50m > /tmp/50m.json
 *   perf record build/bench_profile_step --config /tmp/50m.json --threads 2 --shape 1x512 --steps 5
 *   valgrind --tool=callgrind --instr-atstart=no build/bench_profile_step --config /tmp/50m.json --shape 1x128
 *
 * Under callgrind, instrumentation is on for the measured steps only (where valgrind's header was found at build
 * time; otherwise --instr-atstart=no collects nothing: drop it). It prints the loss (or one logit) of each step and
 * the wall time of the measured ones; it measures nothing else and never fails but on an error.
 *
 *   build/bench_profile_step --config /tmp/50m.json --threads 16 --simulate [--fork-us 4]
 *
 * --simulate records every pool job of the measured steps (threadpool.h's trace: each task's CPU seconds, the calling
 * thread's CPU seconds outside jobs, the op each job belongs to) and replays them on --threads ideal threads: the
 * tasks of a job dealt in order to whichever thread is free first, as the pool's counter deals them, the job ending
 * with its last task, plus --fork-us per job for waking and joining the threads (by default what an empty job of one
 * task per thread costs on this pool, measured first; 0 where the pool has more threads than CPUs). What it cannot
 * see: memory bandwidth shared by the threads, and hardware threads sharing a core; the measured wall time per op
 * (the profile's, printed beside the replay) shows them where it is much longer than the replayed span. Task CPU
 * times are taken at the thread count asked for (the split into tasks depends on it), so a host with fewer cores can
 * run it: with more threads than cores the pool sleeps rather than polls, CPU clocks do not count waiting, and only
 * the wall column means nothing then. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "ds4.h"
#include "engine.h"
#include "model.h"
#include "profile.h"

#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define HAVE_CALLGRIND 1
#endif
#endif
#ifndef HAVE_CALLGRIND
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

/* ------------------------------------------------------------------------------------------------ --simulate */

enum { SIM_OPS = DS4_OP_COUNT + 1 }; /* the ops, then "between ops" (tag -1: copies, fills, the optimizer's jobs) */

static void no_task(void *ctx, int64_t i) { (void)ctx, (void)i; }

/* Wall µs of an empty job of one task per thread (waking the workers, joining them), the median of 21 batches of 200
 * after a warm-up batch; -1 where the pool has more threads than CPUs (it sleeps between jobs there). */
static double fork_join_us(ds4_pool *pool) {
    const int32_t P = ds4_pool_threads(pool);
    if (P > ds4_usable_cpus()) return -1;
    double t[21];
    for (int b = -1; b < 21; b++) {
        const double t0 = now_s();
        for (int k = 0; k < 200; k++) ds4_pool_run(pool, P, no_task, NULL);
        if (b >= 0) t[b] = (now_s() - t0) / 200 * 1e6;
    }
    for (int i = 1; i < 21; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1], t[j - 1] = x;
        }
    return t[10];
}

typedef struct {
    int64_t jobs, tasks;
    double task_cpu, makespan, in_jobs; /* in_jobs: the caller's CPU seconds inside the op's jobs */
} sim_op;

static ds4_pool_trace *trace_new(int64_t job_cap, int64_t task_cap) {
    ds4_pool_trace *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->job_cap = job_cap, t->task_cap = task_cap;
    t->job_tag = malloc((size_t)job_cap * sizeof *t->job_tag);
    t->job_n = malloc((size_t)job_cap * sizeof *t->job_n);
    t->job_first = malloc((size_t)job_cap * sizeof *t->job_first);
    t->job_t0 = malloc((size_t)job_cap * sizeof *t->job_t0);
    t->job_t1 = malloc((size_t)job_cap * sizeof *t->job_t1);
    t->task_s = malloc((size_t)task_cap * sizeof *t->task_s);
    if (!t->job_tag || !t->job_n || !t->job_first || !t->job_t0 || !t->job_t1 || !t->task_s) return NULL;
    return t;
}

/* The time a job's tasks take on P threads (at most one per task), each task to the thread free first. */
static double makespan(const double *d, int64_t n, int32_t P, double *free_at) {
    const int32_t k = n < P ? (int32_t)n : P;
    for (int32_t t = 0; t < k; t++) free_at[t] = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t best = 0;
        for (int32_t t = 1; t < k; t++)
            if (free_at[t] < free_at[best]) best = t;
        free_at[best] += d[i];
    }
    double end = 0;
    for (int32_t t = 0; t < k; t++)
        if (free_at[t] > end) end = free_at[t];
    return end;
}

static int by_time(const void *a, const void *b) {
    const double x = ((const double *)a)[0], y = ((const double *)b)[0];
    return (x < y) - (x > y);
}

/* The replay's table: per op its jobs, the caller's CPU outside the op's jobs (run by one thread whatever the
 * count), the tasks' CPU, and their replayed span on P threads; per step. */
static void simulate(const ds4_pool_trace *t, const ds4_profile *prof, double caller_cpu, double wall, int steps,
                     int32_t P, double fork_us) {
    static sim_op ops[SIM_OPS];
    memset(ops, 0, sizeof ops);
    double *free_at = calloc((size_t)P, sizeof *free_at);
    double in_jobs = 0, taking_part = 0;
    for (int64_t j = 0; j < t->jobs; j++) {
        taking_part += (double)(t->job_n[j] < P ? t->job_n[j] : P);
        const int32_t tag = t->job_tag[j] >= 0 && t->job_tag[j] < DS4_OP_COUNT ? t->job_tag[j] : DS4_OP_COUNT;
        sim_op *o = &ops[tag];
        const double *d = t->task_s + t->job_first[j];
        o->jobs++, o->tasks += t->job_n[j];
        for (int64_t i = 0; i < t->job_n[j]; i++) o->task_cpu += d[i];
        o->makespan += makespan(d, t->job_n[j], P, free_at);
        o->in_jobs += t->job_t1[j] - t->job_t0[j];
        in_jobs += t->job_t1[j] - t->job_t0[j];
    }
    free(free_at);
    double rows[SIM_OPS][2], serial_ops = 0, tot_task = 0, tot_span = 0;
    int64_t jobs = 0;
    for (int k = 0; k < SIM_OPS; k++) {
        const double serial = k < DS4_OP_COUNT ? prof->cpu_seconds[k] - ops[k].in_jobs : 0;
        if (k < DS4_OP_COUNT) serial_ops += serial > 0 ? serial : 0;
        rows[k][0] = (serial > 0 ? serial : 0) + ops[k].makespan + ops[k].jobs * fork_us * 1e-6;
        rows[k][1] = k;
        tot_task += ops[k].task_cpu, tot_span += ops[k].makespan, jobs += ops[k].jobs;
    }
    const double serial_all = caller_cpu - in_jobs, between = serial_all - serial_ops;
    rows[DS4_OP_COUNT][0] += between > 0 ? between : 0;
    qsort(rows, SIM_OPS, sizeof rows[0], by_time);
    const double n = steps, pred = serial_all + tot_span + jobs * fork_us * 1e-6, one = serial_all + tot_task;
    printf("\nreplay on %d ideal threads, per step (%d measured, %s%lld jobs, %lld tasks recorded):\n", (int)P, steps,
           t->full ? "RECORD FULL: only the first " : "", (long long)t->jobs, (long long)t->tasks);
    printf("  measured wall %.1f ms; one thread's work %.1f ms = tasks %.1f + calling thread alone %.1f (%.1f%%)\n",
           1e3 * wall / n, 1e3 * one / n, 1e3 * tot_task / n, 1e3 * serial_all / n, 100 * serial_all / one);
    printf("  replayed: %.1f ms = calling thread alone %.1f + jobs' spans %.1f + %lld jobs x %.1f us; tasks / (P x spans)"
           " %.0f%%\n", 1e3 * pred / n, 1e3 * serial_all / n, 1e3 * tot_span / n, (long long)(jobs / steps), fork_us,
           tot_span > 0 ? 100 * tot_task / (P * tot_span) : 0.0);
    printf("  speed-up over one thread: replayed %.2fx; with no serial part and perfect balance %.2fx; threads taking part"
           " in a job: %.1f on average (at most its tasks)\n", one / pred, (double)P, t->jobs ? taking_part / t->jobs : 0.0);
    printf("  (per op: the calling thread's CPU alone, the tasks' CPU, their replayed span, alone + span + forks; the\n"
           "  tasks' CPU over P x span; the op's measured wall time in this run)\n");
    printf("  %-20s %7s %8s %9s %10s %9s %9s %5s %9s\n", "op", "jobs", "tasks", "alone ms", "tasks ms", "span ms",
           "total ms", "eff", "wall ms");
    double wall_ops = 0;
    for (int k = 0; k < DS4_OP_COUNT; k++) wall_ops += prof->seconds[k];
    for (int r = 0; r < SIM_OPS && rows[r][0] > 0; r++) {
        const int k = (int)rows[r][1];
        const double serial = k < DS4_OP_COUNT ? prof->cpu_seconds[k] - ops[k].in_jobs : between;
        const double w = k < DS4_OP_COUNT ? prof->seconds[k] : wall - wall_ops;
        printf("  %-20s %7lld %8lld %9.2f %10.2f %9.2f %9.2f %4.0f%% %9.2f\n",
               k < DS4_OP_COUNT ? ds4_op_name((ds4_op_id)k) : "(between ops)", (long long)(ops[k].jobs / steps),
               (long long)(ops[k].tasks / steps), 1e3 * (serial > 0 ? serial : 0) / n, 1e3 * ops[k].task_cpu / n,
               1e3 * ops[k].makespan / n, 1e3 * rows[r][0] / n,
               ops[k].makespan > 0 ? 100 * ops[k].task_cpu / (P * ops[k].makespan) : 0.0, 1e3 * w / n);
    }
}

static int usage(void) {
    fprintf(stderr, "usage: bench_profile_step --config CONFIG.json [--threads N] [--shape BxS] [--forward] "
                    "[--warmup N] [--steps N] [--simulate [--fork-us US]]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *config = NULL;
    int threads = 0, forward = 0, warmup = 1, steps = 1, sim = 0;
    double fork_us = -1;
    long long B = 1, S = 512;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) config = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (sscanf(argv[++i], "%lldx%lld", &B, &S) != 2 || B < 1 || S < 2) return usage();
        } else if (!strcmp(argv[i], "--forward")) forward = 1;
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--simulate")) sim = 1;
        else if (!strcmp(argv[i], "--fork-us") && i + 1 < argc) fork_us = atof(argv[++i]);
        else return usage();
    }
    if (!config || warmup < 0 || steps < 1) return usage();
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {threads};
    ds4_config cfg;
    ds4_model *m = NULL;
    ds4_adamw *opt = NULL;
    ds4_adamw_options ao = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0,
                            .schedule = DS4_LR_CONSTANT, .total_steps = 1000};
    if (ds4_engine_create(&eo, &eng, &err) || ds4_config_load(config, &cfg, &err) ||
        ds4_model_create_random(eng, &cfg, 1, &m, &err) ||
        (!forward && (ds4_model_enable_grad(m, &err) || ds4_adamw_create(m, &ao, &opt, &err)))) {
        fprintf(stderr, "bench_profile_step: %s\n", err.msg);
        return 1;
    }
    const int64_t T = (int64_t)(B * S), V = cfg.vocab_size;
    int64_t *ids = malloc((size_t)T * sizeof *ids);
    float *logits = forward ? malloc((size_t)(T * V) * sizeof *logits) : NULL;
    if (!ids || (forward && !logits)) {
        fprintf(stderr, "bench_profile_step: out of memory\n");
        return 1;
    }
    uint64_t rng = 7;
    for (int64_t i = 0; i < T; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int64_t)((rng >> 33) % (uint64_t)V); /* bench_train's ids */
    }
    ds4_forward_args a = {.ids = ids, .batch = B, .seq = S, .labels = forward ? NULL : ids, .logits = logits};
    double t0 = 0, c0 = 0;
    ds4_pool_trace *trace = sim ? trace_new(20000 * (int64_t)steps, 400000 * (int64_t)steps) : NULL;
    if (sim && !trace) {
        fprintf(stderr, "bench_profile_step: out of memory for the trace\n");
        return 1;
    }
    if (sim) ds4_engine_set_profile(eng, 1); /* the op tags; switched on at the next pass */
    if (sim && fork_us < 0) {
        fork_us = fork_join_us(eng->pool);
        if (fork_us < 0) printf("fork and join: not measured (%d threads, more than this process's %d CPUs)\n",
                                (int)ds4_engine_threads(eng), (int)ds4_usable_cpus());
        else printf("fork and join: %.2f us per empty job of %d tasks on %d threads\n", fork_us,
                    (int)ds4_engine_threads(eng), (int)ds4_engine_threads(eng));
        if (fork_us < 0) fork_us = 0;
    }
    if (sim && warmup < 1) warmup = 1;
    for (int r = 0; r < warmup + steps; r++) {
        if (r == warmup) {
            if (sim) {
                ds4_profile_reset(m->dev);
                m->dev->prof->cpu_clock = 1;
                trace->tag = &m->dev->prof->op_now;
                ds4_pool_set_trace(eng->pool, trace);
                c0 = ds4_thread_cpu_seconds();
            }
            CALLGRIND_START_INSTRUMENTATION;
            t0 = now_s();
        }
        ds4_forward_result res;
        ds4_adamw_stats st;
        ds4_status s;
        if (forward) s = ds4_model_forward(m, &a, &res, &err);
        else {
            ds4_model_zero_grad(m);
            s = ds4_model_forward_train(m, &a, &res, &err);
            if (!s) s = ds4_model_backward(m, 1.0 / (double)res.loss_tokens, &err);
            if (!s) s = ds4_adamw_step(opt, &st, &err);
        }
        if (s) {
            fprintf(stderr, "bench_profile_step: %s\n", err.msg);
            return 1;
        }
        printf("%s %d: %s %.6f\n", r < warmup ? "warm-up" : "step", r < warmup ? r : r - warmup,
               forward ? "logits[0]" : "loss", forward ? (double)logits[0] : res.loss);
    }
    CALLGRIND_STOP_INSTRUMENTATION;
    const double wall = now_s() - t0;
    printf("%d measured %s of %lld x %lld in %.3f s\n", steps, forward ? "forwards" : "training steps", B, S, wall);
    if (sim) {
        const double caller = ds4_thread_cpu_seconds() - c0;
        ds4_pool_set_trace(eng->pool, NULL);
        simulate(trace, m->dev->prof, caller, wall, steps, ds4_engine_threads(eng), fork_us);
    }
    free(ids);
    free(logits);
    ds4_adamw_free(opt);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return 0;
}
