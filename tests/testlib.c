#define _XOPEN_SOURCE 700 /* nftw */
#include "testlib.h"

#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>

int ds4t_failures = 0;
int ds4t_checks = 0;

int ds4t_finish(const char *name) {
    printf("%s: %d passed, %d failed\n", name, ds4t_checks - ds4t_failures, ds4t_failures);
    return ds4t_failures ? 1 : 0;
}

const char *ds4t_path(const char *dir, const char *file) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", dir, file);
    return buf;
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *f) {
    (void)sb, (void)flag, (void)f;
    return remove(p);
}

void ds4t_rm_rf(const char *path) { nftw(path, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

int ds4t_exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}
