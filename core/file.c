/* file.c — opening and reading the files a caller names (config.json, tokenizer.json, safetensors shards,
 * checkpoint markers and states).
 *
 * Only regular files are read, and opening one never blocks: open(2) of a FIFO waits for a writer (forever, if
 * none comes) and opening a device can have side effects, so a path is opened with O_NONBLOCK, checked with
 * fstat to be a regular file, and only then switched back to blocking reads. A `stat` before `open` would not
 * do: the name can change between the two calls, and the open itself is what blocks. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

ds4_status ds4_open_regular(const char *path, int flags, ds4_status not_regular, int *fd_out, int64_t *size,
                             ds4_error *err) {
    *fd_out = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | flags);
    if (fd < 0) {
        int e = errno;
        return ds4_fail(err, e == ENOENT ? DS4_ERR_NOT_FOUND : DS4_ERR_IO, "open %s: %s", path, strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "open %s: fstat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return ds4_fail(err, not_regular, "open %s: not a regular file (%s)", path,
                        S_ISFIFO(sb.st_mode)  ? "a FIFO"
                        : S_ISDIR(sb.st_mode) ? "a directory"
                                              : "a device or socket");
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "open %s: fcntl: %s", path, strerror(e));
    }
    if (size) *size = (int64_t)sb.st_size;
    *fd_out = fd;
    return DS4_OK;
}

ds4_status ds4_read_file(const char *path, size_t max_bytes, char **out, size_t *len, ds4_error *err) {
    int64_t sz = 0;
    int fd;
    ds4_status st = ds4_open_regular(path, 0, DS4_ERR_IO, &fd, &sz, err);
    if (st == DS4_ERR_NOT_FOUND) { /* this function's contract: every failure to read is DS4_ERR_IO */
        st = DS4_ERR_IO;
        if (err) err->code = st;
    }
    if (st) return st;
    if (sz < 0 || (uint64_t)sz > (uint64_t)max_bytes) {
        close(fd);
        return ds4_fail(err, DS4_ERR_IO, "read %s: size %lld outside [0, %zu]", path, (long long)sz, max_bytes);
    }
    char *buf = malloc((size_t)sz + 1);
    if (!buf) {
        close(fd);
        return ds4_fail(err, DS4_ERR_OOM, "read %s: cannot allocate %lld bytes", path, (long long)sz);
    }
    size_t got = 0;
    while (got < (size_t)sz) {
        ssize_t r = read(fd, buf + got, (size_t)sz - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != (size_t)sz) {
        free(buf);
        return ds4_fail(err, DS4_ERR_IO, "read %s: short read (%zu of %lld bytes)", path, got, (long long)sz);
    }
    buf[sz] = 0;
    *out = buf;
    if (len) *len = (size_t)sz;
    return DS4_OK;
}
