/* ops.c — what every backend shares around the operation table: sticky errors, checked transfers, and the per-op
 * profile (calls, time, bytes). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ops.h"
#include "profile.h"
#include "sched.h"
#include "threadpool.h"

static const char *const op_names[DS4_OP_COUNT] = {
#define DS4_OP_NAME(name) #name,
    DS4_OPS(DS4_OP_NAME)
#undef DS4_OP_NAME
};

const char *ds4_op_name(ds4_op_id op) { return op >= 0 && op < DS4_OP_COUNT ? op_names[op] : "?"; }

void ds4_dev_fail(ds4_dev *d, ds4_status code, const char *fmt, ...) {
    if (d->st) return;
    d->st = code;
    d->err.code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err.msg, sizeof d->err.msg, fmt, ap);
    va_end(ap);
}

ds4_status ds4_dev_check(ds4_dev *d, const char *stage, ds4_error *err) {
    if (!d->st) return DS4_OK;
    const ds4_status st = d->st;
    ds4_fail(err, st, "%s: %s backend: %s", stage, d->ops->name, d->err.msg);
    d->st = DS4_OK;
    d->err.msg[0] = 0;
    return st;
}

void ds4_dev_retain(ds4_dev *d) {
    if (d) d->refs++;
}

void ds4_dev_release(ds4_dev *d) {
    if (!d || --d->refs > 0) return;
    ds4_profile_enable(d, 0, NULL);
    d->ops->destroy(d);
}

void ds4_dev_upload(ds4_dev *d, void *dst, const void *host_src, size_t bytes) {
    if (d->st || !bytes) return;
    ds4_error e;
    if (d->ops->upload(d, dst, host_src, bytes, &e)) ds4_dev_fail(d, e.code, "%s", e.msg);
}

void ds4_dev_download(ds4_dev *d, void *host_dst, const void *src, size_t bytes) {
    if (d->st || !bytes) return;
    ds4_error e;
    if (d->ops->download(d, host_dst, src, bytes, &e)) ds4_dev_fail(d, e.code, "%s", e.msg);
}

/* ------------------------------------------------------------------------------------------------ profile */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define F4 ((double)sizeof(float))

/* Bytes an operation reads and writes at the least (each input once, each output once): the figure a roofline
 * compares its time with. Weights count at their dtype's size. */
static double op_bytes(ds4_op_id op, const void *args) {
    switch (op) {
    case DS4_OP_embed: {
        const ds4_a_embed *a = args;
        return (double)a->T * a->D * (ds4_dtype_size(a->edt) + a->n * F4) + 8.0 * a->T;
    }
    case DS4_OP_matmul: {
        const ds4_a_matmul *a = args;
        const double g = a->groups > 1 ? (double)a->groups : 1.0;
        return g * ((double)a->T * (a->K * (a->keep16 ? F4 + 2.0 : F4) + a->O * (a->y16 ? F4 + 2.0 : F4)) +
                    (double)a->O * a->K * ds4_dtype_size(a->wdt));
    }
    case DS4_OP_matmul_grouped: {
        const ds4_a_matmul_grouped *a = args;
        return (double)a->rows * (a->K + a->O) * F4 + (double)a->E * a->O * a->K * ds4_dtype_size(a->wdt);
    }
    case DS4_OP_rmsnorm: {
        const ds4_a_rmsnorm *a = args;
        return 2.0 * a->rows * a->width * F4;
    }
    case DS4_OP_rope: {
        const ds4_a_rope *a = args;
        return 2.0 * a->rows.T * a->heads * 2 * a->rt.half * F4;
    }
    case DS4_OP_hc_pre: {
        const ds4_a_hc_pre *a = args;
        const int64_t n = a->c->hc_mult, D = a->c->hidden_size;
        return (double)a->T * (n * D + D + 2 * n + n * n) * F4 + (double)(2 + n) * n * n * D * F4;
    }
    case DS4_OP_hc_post: {
        const ds4_a_hc_post *a = args;
        const int64_t n = a->c->hc_mult, D = a->c->hidden_size;
        return (double)a->T * (2 * n * D + D) * F4;
    }
    case DS4_OP_attention: {
        const ds4_a_attention *a = args;
        const int64_t H = a->c->num_attention_heads, d = a->c->head_dim;
        return (double)a->rows.T * (2 * H * d + a->c->sliding_window * d) * F4;
    }
    case DS4_OP_logprobs: {
        const ds4_a_logprobs *a = args;
        return (double)a->rows * a->V * F4;
    }
    case DS4_OP_ce_rows: {
        const ds4_a_ce_rows *a = args;
        return (double)a->rows * a->V * F4;
    }
    case DS4_OP_sample: {
        const ds4_a_sample *a = args;
        return (double)a->rows * a->V * F4;
    }
    case DS4_OP_linear_bwd_x: {
        const ds4_a_linear_bwd_x *a = args;
        return (double)a->T * (a->K + a->O) * F4 + (double)a->O * a->K * ds4_dtype_size(a->wdt);
    }
    case DS4_OP_linear_bwd_w: {
        const ds4_a_linear_bwd_w *a = args;
        return (double)a->T * (a->K * (a->x16 ? 2.0 : F4) + a->O * F4) + 2.0 * a->O * a->K * F4;
    }
    default:
        return 0; /* small or data-dependent: time and calls only */
    }
}

int ds4_prof_begin(ds4_dev *d, ds4_op_id op) {
    ds4_profile *p = d->prof;
    p->op_now = (int32_t)op;
    if (p->cpu_clock) p->cpu_begin = ds4_thread_cpu_seconds();
    if (p->timer_start) return p->timer_start(d, op);
    p->t_begin = now_s();
    return 0;
}

void ds4_prof_end(ds4_dev *d, ds4_op_id op, int token, const void *args) {
    ds4_profile *p = d->prof;
    p->calls[op]++;
    p->bytes[op] += op_bytes(op, args);
    if (p->timer_stop) p->timer_stop(d, op, token);
    else p->seconds[op] += now_s() - p->t_begin;
    if (p->cpu_clock) p->cpu_seconds[op] += ds4_thread_cpu_seconds() - p->cpu_begin;
    p->op_now = -1;
}

ds4_status ds4_profile_enable(ds4_dev *d, int on, ds4_error *err) {
    if (!on) {
        if (d->prof && d->prof->timer_free) d->prof->timer_free(d);
        free(d->prof);
        d->prof = NULL;
        return DS4_OK;
    }
    if (d->prof) return DS4_OK;
    ds4_profile *p = calloc(1, sizeof *p);
    if (!p) return ds4_fail(err, DS4_ERR_OOM, "profile: %zu bytes", sizeof *p);
    p->op_now = -1;
    d->prof = p;
    if (d->ops->profile_init) {
        ds4_status st = d->ops->profile_init(d, err);
        if (st) {
            free(p);
            d->prof = NULL;
            return st;
        }
    }
    return DS4_OK;
}

void ds4_profile_reset(ds4_dev *d) {
    ds4_profile *p = d->prof;
    if (!p) return;
    if (p->timer_flush) p->timer_flush(d);
    if (p->timer_reset) p->timer_reset(d);
    memset(p->calls, 0, sizeof p->calls);
    memset(p->seconds, 0, sizeof p->seconds);
    memset(p->bytes, 0, sizeof p->bytes);
    memset(p->cpu_seconds, 0, sizeof p->cpu_seconds);
}

size_t ds4_profile_format(ds4_dev *d, char *buf, size_t len) {
    if (!buf || len == 0) return 0;
    buf[0] = 0;
    ds4_profile *p = d->prof;
    size_t pos = 0;
#define APPEND(...)                                                                   \
    do {                                                                              \
        if (pos < len) {                                                              \
            const int k_ = snprintf(buf + pos, len - pos, __VA_ARGS__);               \
            pos = k_ < 0 ? len : ((size_t)k_ >= len - pos ? len : pos + (size_t)k_); \
        }                                                                             \
    } while (0)
    if (!p) {
        APPEND("profile: off (ds4.profile(true) or DS4_PROFILE=1 switches it on)\n");
        return pos;
    }
    if (p->timer_flush) p->timer_flush(d);
    int order[DS4_OP_COUNT], n = 0;
    double total = 0;
    for (int i = 0; i < DS4_OP_COUNT; i++)
        if (p->calls[i]) {
            order[n++] = i;
            total += p->seconds[i];
        }
    for (int i = 1; i < n; i++) /* by time, descending; ties keep table order */
        for (int j = i; j > 0 && p->seconds[order[j]] > p->seconds[order[j - 1]]; j--) {
            const int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    APPEND("%-22s %10s %10s %7s %11s %12s %10s\n", "op", "calls", "ms", "%", "us/call", "MB",
           "GB/s");
    for (int k = 0; k < n; k++) {
        const int i = order[k];
        const double ms = 1e3 * p->seconds[i], mb = p->bytes[i] / 1e6;
        APPEND("%-22s %10lld %10.3f %6.1f%% %11.2f %12.1f %10.1f\n", op_names[i], (long long)p->calls[i], ms,
               total > 0 ? 100.0 * p->seconds[i] / total : 0.0, 1e3 * ms / (double)p->calls[i], mb,
               p->seconds[i] > 0 && mb > 0 ? mb / 1e3 / p->seconds[i] : 0.0);
    }
    APPEND("%-22s %10s %10.3f   (%s backend)\n", "total", "", 1e3 * total, d->ops->name);
#undef APPEND
    if (p->timer_detail && pos < len) pos += p->timer_detail(d, buf + pos, len - pos);
    return pos;
}
