/* fuzz_config.c — libFuzzer target for ds4_config_parse.
 *
 * Properties: no crash/leak/UB; every failure carries a "config: " message; an accepted config validates
 * and survives ds4_config_to_json -> ds4_config_parse unchanged. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_config c;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_status st = ds4_config_parse((const char *)data, size, &c, &err);
    if (st != DS4_OK) {
        if (err.code != st || strncmp(err.msg, "config: ", 8) != 0) abort();
        return 0;
    }
    if (ds4_config_validate(&c, &err) != DS4_OK) abort();
    char *text = ds4_config_to_json(&c);
    if (!text) abort();
    ds4_config back;
    if (ds4_config_parse(text, strlen(text), &back, &err) != DS4_OK) abort();
    if (memcmp(&back, &c, sizeof c) != 0) abort();
    free(text);
    return 0;
}
