/* bench_util.h — what the benchmark programs share: DIE, the message and exit of a program that cannot go on (these
 * are programs, not library code). */
#ifndef DS4_BENCH_UTIL_H
#define DS4_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>

#define DIE(...)                      \
    do {                              \
        fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, "\n");        \
        exit(1);                      \
    } while (0)

#endif
