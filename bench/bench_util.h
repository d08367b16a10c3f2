/* bench_util.h — what the benchmark programs share: DIE, the message and exit of a program that cannot go on (these
 * are programs, not library code), and now_s, the monotonic clock in seconds (clock_gettime: the including file
 * defines _POSIX_C_SOURCE before its first system header). */
#ifndef DS4_BENCH_UTIL_H
#define DS4_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define DIE(...)                      \
    do {                              \
        fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, "\n");        \
        exit(1);                      \
    } while (0)

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
