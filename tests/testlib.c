#include "testlib.h"

#include <stdio.h>

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
