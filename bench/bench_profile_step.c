/* bench_profile_step.c — one training step (forward, backward, AdamW as bench_train runs it) or one forward with
 * logits (as bench_forward runs it) of a model with random weights, after warm-up steps, for a profiler:
 *
 *   build/bench_forward --print-config 50m > /tmp/50m.json
 *   perf record build/bench_profile_step --config /tmp/50m.json --threads 2 --shape 1x512 --steps 5
 *   valgrind --tool=callgrind --instr-atstart=no build/bench_profile_step --config /tmp/50m.json --shape 1x128
 *
 * Under callgrind, instrumentation is on for the measured steps only (where valgrind's header was found at build
 * time; otherwise --instr-atstart=no collects nothing: drop it). It prints the loss (or one logit) of each step and
 * the wall time of the measured ones; it measures nothing else and never fails but on an error. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ds4.h"

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

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int usage(void) {
    fprintf(stderr, "usage: bench_profile_step --config CONFIG.json [--threads N] [--shape BxS] [--forward] "
                    "[--warmup N] [--steps N]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *config = NULL;
    int threads = 0, forward = 0, warmup = 1, steps = 1;
    long long B = 1, S = 512;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) config = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (sscanf(argv[++i], "%lldx%lld", &B, &S) != 2 || B < 1 || S < 2) return usage();
        } else if (!strcmp(argv[i], "--forward")) forward = 1;
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
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
    double t0 = 0;
    for (int r = 0; r < warmup + steps; r++) {
        if (r == warmup) {
            CALLGRIND_START_INSTRUMENTATION;
            t0 = now();
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
    printf("%d measured %s of %lld x %lld in %.3f s\n", steps, forward ? "forwards" : "training steps", B, S, now() - t0);
    free(ids);
    free(logits);
    ds4_adamw_free(opt);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return 0;
}
