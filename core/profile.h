/* profile.h — the per-op profile of a backend (ops.c): calls, time and bytes of every operation of the table,
 * printed sorted by time. Host wall clock around each call on the CPU; a backend whose operations run
 * asynchronously (CUDA) installs timers that measure on the device and are read when the table is printed. */
#ifndef DS4_PROFILE_H
#define DS4_PROFILE_H

#include "ops.h"

struct ds4_profile {
    int64_t calls[DS4_OP_COUNT];
    double seconds[DS4_OP_COUNT];
    double bytes[DS4_OP_COUNT];   /* at the least: each input read once, each output written once */
    double t_begin;
    /* for bench_profile_step --simulate: the op now running (-1 between ops), read by a pool trace as each job's tag;
     * and, when cpu_clock is set, the calling thread's CPU seconds inside each op */
    int32_t op_now;
    int32_t cpu_clock;
    double cpu_begin;
    double cpu_seconds[DS4_OP_COUNT];
    int (*timer_start)(ds4_dev *d, ds4_op_id op);
    void (*timer_stop)(ds4_dev *d, ds4_op_id op, int token);
    void (*timer_flush)(ds4_dev *d);  /* add the pending device times into seconds[] */
    void (*timer_free)(ds4_dev *d);
    /* optional: a second table after the per-op one (CUDA with DS4_PROFILE_SHAPES=1: time per op and launch shapes),
     * and the reset of what it gathered */
    size_t (*timer_detail)(ds4_dev *d, char *buf, size_t len);
    void (*timer_reset)(ds4_dev *d);
    void *timer_state;
};

ds4_status ds4_profile_enable(ds4_dev *d, int on, ds4_error *err);
void ds4_profile_reset(ds4_dev *d);
/* The table (one line per op that ran, sorted by time, then a total), NUL-terminated; returns its length. */
size_t ds4_profile_format(ds4_dev *d, char *buf, size_t len);

#endif
