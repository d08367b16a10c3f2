/* internal.h — helpers shared by libds4's translation units (not installed). */
#ifndef DS4_INTERNAL_H
#define DS4_INTERNAL_H

#include <stdarg.h>
#include "ds4.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DS4_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DS4_PRINTF(a, b)
#endif

/* Fill `err` (may be NULL) and return `code`. The message should name stage, operation and shapes:
 *   return ds4_fail(err, DS4_ERR_SHAPE, "load: tensor %s: shape [%lld] != expected [%lld]", ...); */
ds4_status ds4_fail(ds4_error *err, ds4_status code, const char *fmt, ...) DS4_PRINTF(3, 4);
/* Prefix an existing error message with context ("model load: " + msg). */
void ds4_error_prefix(ds4_error *err, const char *fmt, ...) DS4_PRINTF(2, 3);

/* Checked size arithmetic: return 0 on overflow. */
static inline int ds4_mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > (size_t)-1 / a) return 0;
    *out = a * b;
    return 1;
}
static inline int ds4_add_size(size_t a, size_t b, size_t *out) {
    if (b > (size_t)-1 - a) return 0;
    *out = a + b;
    return 1;
}

/* splitmix64: a tiny, well-mixed generator; callers own the state, so a seed determines everything. */
static inline uint64_t ds4_splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* Uniform in (0, 1): the top 53 bits, centred in their interval. */
static inline double ds4_uniform01(uint64_t *s) { return ((ds4_splitmix64(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

/* "[2,37,256]" into buf (truncated to cap, always NUL-terminated): for error messages. */
void ds4_shape_str(char *buf, size_t cap, int32_t ndim, const int64_t *shape);

/* Open the regular file `path` for reading (O_RDONLY | O_CLOEXEC | flags, e.g. O_NOFOLLOW) without ever blocking
 * in open(2): a FIFO, directory or device is refused with status `not_regular` (core/file.c). *fd receives the
 * descriptor (-1 on failure) and *size (may be NULL) the file's size; errors read "open PATH: ..."
 * (DS4_ERR_NOT_FOUND for a missing file, DS4_ERR_IO for other failures). */
ds4_status ds4_open_regular(const char *path, int flags, ds4_status not_regular, int *fd, int64_t *size,
                            ds4_error *err);
/* Read a whole regular file into a malloc'd NUL-terminated buffer (limit: max_bytes). */
ds4_status ds4_read_file(const char *path, size_t max_bytes, char **out, size_t *len, ds4_error *err);

#ifdef __cplusplus
}
#endif
#endif
