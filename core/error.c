/* error.c — status names and the error-filling helpers. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

const char *ds4_status_name(ds4_status s) {
    switch (s) {
    case DS4_OK: return "ok";
    case DS4_ERR_ARG: return "invalid argument";
    case DS4_ERR_IO: return "I/O error";
    case DS4_ERR_FORMAT: return "format error";
    case DS4_ERR_CONFIG: return "config error";
    case DS4_ERR_SHAPE: return "shape error";
    case DS4_ERR_OOM: return "out of memory";
    case DS4_ERR_UNSUPPORTED: return "unsupported";
    case DS4_ERR_NOT_FOUND: return "not found";
    case DS4_ERR_CUDA: return "CUDA error";
    case DS4_ERR_INTERNAL: return "internal error";
    case DS4_ERR_COMM: return "communication error";
    }
    return "unknown status";
}

ds4_status ds4_fail(ds4_error *err, ds4_status code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

void ds4_error_prefix(ds4_error *err, const char *fmt, ...) {
    if (!err) return;
    char prefix[256], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    /* the combined message is cut at the buffer size; the prefix (context) comes first by design */
    size_t pl = strlen(prefix);
    if (pl >= sizeof err->msg) pl = sizeof err->msg - 1;
    memcpy(err->msg, prefix, pl);
    size_t room = sizeof err->msg - 1 - pl, ol = strnlen(old, sizeof old);
    if (ol > room) ol = room;
    memcpy(err->msg + pl, old, ol);
    err->msg[pl + ol] = 0;
}
