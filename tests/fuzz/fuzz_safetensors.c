/* fuzz_safetensors.c — libFuzzer target for the safetensors header validator (ds4_st_open_memory).
 *
 * libFuzzer hands over an exactly sized buffer, so ASan reports any read outside it. For every file that
 * validates, each reported tensor is read byte by byte and decoded, and the reader's invariants are checked
 * (entries inside the buffer, tiling in offset order, find() consistent with entry_at()); a violated invariant
 * traps so the fuzzer records it as a crash.
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Icore/include -Icore core/error.c core/json.c \
 *     core/tensor.c core/safetensors.c tests/fuzz/fuzz_safetensors.c -lm -o fuzz_safetensors
 *   ./fuzz_safetensors tests/fuzz/corpus/safetensors */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

#define REQUIRE(c) \
    do {           \
        if (!(c)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_st_file *f = NULL;
    ds4_error err;
    ds4_status s = ds4_st_open_memory(data, size, &f, &err);
    if (s != DS4_OK) {
        REQUIRE(f == NULL);
        REQUIRE(memchr(err.msg, 0, sizeof err.msg) != NULL && err.msg[0] != 0);
        return 0;
    }
    REQUIRE(f != NULL);
    size_t n = ds4_st_count(f);
    const uint8_t *prev_end = NULL;
    volatile uint8_t sink = 0;
    float conv[64];
    for (size_t i = 0; i < n; i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        REQUIRE(e != NULL && e->name != NULL);
        const uint8_t *p = e->data;
        REQUIRE(p >= data && p <= data + size && e->nbytes <= (size_t)(data + size - p));
        if (prev_end) REQUIRE(p == prev_end);
        prev_end = p + e->nbytes;
        REQUIRE(e->ndim >= 0 && e->ndim <= DS4_MAX_DIMS);
        REQUIRE((unsigned)e->dtype < (unsigned)DS4_DTYPE_COUNT);
        uint64_t numel = 1;
        for (int32_t d = 0; d < e->ndim; d++) {
            REQUIRE(e->shape[d] >= 0);
            /* unsigned: a huge prefix before a 0 dim may wrap, but then the product is 0 anyway */
            numel *= (uint64_t)e->shape[d];
        }
        REQUIRE(numel * ds4_dtype_size(e->dtype) == e->nbytes);
        for (size_t b = 0; b < e->nbytes; b++) sink ^= p[b]; /* every byte of the reported range */
        int64_t m = (int64_t)(numel < 64 ? numel : 64);
        REQUIRE(ds4_convert_to_f32(e->dtype, p, m, conv, &err) == DS4_OK);
        REQUIRE(ds4_st_find(f, e->name) == e);
        (void)strlen(e->name);
    }
    if (n > 0) REQUIRE(prev_end == data + size); /* the last tensor ends the file */
    REQUIRE(ds4_st_entry_at(f, n) == NULL);
    const char *fmt = ds4_st_metadata(f, "format");
    if (fmt) sink ^= (uint8_t)strlen(fmt);
    (void)sink;
    ds4_st_close(f);
    return 0;
}
