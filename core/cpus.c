/* cpus.c — how many CPUs and physical cores this process may use, and the thread count an engine takes by default.
 * Linux: the affinity mask (taskset, cpusets, a container's CPU list) by the raw system call (cpu_set_t needs glibc's
 * <sched.h>, which core/sched.h shadows on this library's include path), sysfs for which CPUs share a core, cgroup v2
 * for a CPU quota. Elsewhere: the online CPUs. */
#define _DEFAULT_SOURCE /* syscall */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

#include "threadpool.h"

enum { MAX_CPUS = 4096, WORD_BITS = 8 * (int)sizeof(unsigned long) };

typedef struct {
    unsigned long w[MAX_CPUS / WORD_BITS];
} cpu_mask;

static int in_mask(const cpu_mask *m, long c) {
    return c >= 0 && c < MAX_CPUS && ((m->w[c / WORD_BITS] >> (c % WORD_BITS)) & 1ul);
}

/* This process's affinity mask; 0 when it cannot be had. */
static int affinity(cpu_mask *m) {
#if defined(__linux__) && defined(SYS_sched_getaffinity)
    for (int i = 0; i < MAX_CPUS / WORD_BITS; i++) m->w[i] = 0;
    return syscall(SYS_sched_getaffinity, 0, sizeof m->w, m->w) > 0;
#else
    (void)m;
    return 0;
#endif
}

int32_t ds4_usable_cpus(void) {
    cpu_mask m;
    if (affinity(&m)) {
        int32_t n = 0;
        for (long c = 0; c < MAX_CPUS; c++) n += in_mask(&m, c);
        if (n > 0) return n;
    }
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int32_t)(online < MAX_CPUS ? online : MAX_CPUS) : 1;
}

/* The lowest CPU of `list` ("0-3,8,10-11": sysfs's CPU list format) that `m` holds, or -1. */
static long lowest_in(const char *list, const cpu_mask *m) {
    const char *s = list;
    while (isdigit((unsigned char)*s)) {
        char *e;
        const long a = strtol(s, &e, 10);
        long b = a;
        if (*e == '-') b = strtol(e + 1, &e, 10);
        for (long c = a; c <= b && c < MAX_CPUS; c++)
            if (in_mask(m, c)) return c;
        s = e;
        while (*s == ',') s++;
    }
    return -1;
}

/* Physical cores among the CPUs of the affinity mask: a CPU counts when it is the lowest of its core's hardware threads
 * (sysfs topology) that the mask holds. 0 when the mask or the topology cannot be read. */
static int32_t usable_cores(void) {
    cpu_mask m;
    if (!affinity(&m)) return 0;
    int32_t cores = 0;
    for (long c = 0; c < MAX_CPUS; c++) {
        if (!in_mask(&m, c)) continue;
        char path[96], list[512];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/thread_siblings_list", c);
        FILE *f = fopen(path, "r");
        if (!f) return 0;
        const int ok = fgets(list, sizeof list, f) != NULL;
        fclose(f);
        if (!ok) return 0;
        cores += lowest_in(list, &m) == c;
    }
    return cores;
}

/* A cgroup v2 CPU quota ("cpu.max" holds "QUOTA PERIOD", or "max PERIOD"), rounded up to whole CPUs; 0: none. */
static int32_t quota_cpus(void) {
    FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (!f) return 0;
    char q[32] = {0};
    long long period = 0;
    const int got = fscanf(f, "%31s %lld", q, &period);
    fclose(f);
    if (got != 2 || !isdigit((unsigned char)q[0]) || period <= 0) return 0;
    const long long quota = strtoll(q, NULL, 10), n = (quota + period - 1) / period;
    return n > 0 && n < MAX_CPUS ? (int32_t)n : 0;
}

/* One thread per physical core: a core's second hardware thread shares its FMA units, which the matrix products keep
 * busy. At most DS4_DEFAULT_THREADS_MAX: past about 16 threads the fixed costs of each op (its fork and join, the
 * serial steps between ops) eat what more cores add at the model sizes this CPU backend serves (bench/RESULTS.md: a
 * small model trained 4.5x slower on 64 threads than on 16), and a trainer and its rollout workers on one host
 * should not each take every core unasked. ds4_engine_options.n_threads, ds4.set_threads and --threads set any
 * count. */
int32_t ds4_default_threads(void) {
    const int32_t cpus = ds4_usable_cpus(), quota = quota_cpus();
    int32_t n = usable_cores();
    if (n <= 0 || n > cpus) n = cpus;
    if (quota > 0 && quota < n) n = quota;
    if (n > DS4_DEFAULT_THREADS_MAX) n = DS4_DEFAULT_THREADS_MAX;
    return n > 0 ? n : 1;
}
