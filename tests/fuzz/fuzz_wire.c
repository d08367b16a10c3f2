/* fuzz_wire.c — libFuzzer target for the rollout wire decoder (rollout/wire.h, spec rollout/protocol.md).
 *
 * Input layout (bounded by construction): byte 0 = number of frames (byte % 18, so 0..17: one past the
 * default limit of 16), then one little-endian u16 length per frame, then the frames' bytes in order (a length
 * past the end of the input is cut to what remains). Each frame is copied into its own exactly sized heap
 * buffer, so ASan reports a read past any one of them.
 *
 * Properties: no crash, leak or UB; a rejection has a code, a ds4 status and a "wire decode: " message; an
 * accepted message re-encodes, and the re-encoded frames decode to the same fields (frames: the same bytes);
 * whatever decodes under tighter limits also decodes under the defaults, to the same fields.
 *
 *   bash scripts/fuzz.sh fuzz_wire                      # FUZZ_SECONDS (600) on a copy of the seeds
 *   FUZZ_SECONDS=3600 FUZZ_ARGS="-dict=tests/fuzz/fuzz_wire.dict" bash scripts/fuzz.sh fuzz_wire
 * Seeds: tests/fuzz/corpus/wire/ (one valid message of every type; written by
 * WIRE_WRITE_CORPUS=tests/fuzz/corpus/wire build/test_wire). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

#define REQUIRE(c)                  \
    do {                            \
        if (!(c)) __builtin_trap(); \
    } while (0)

static void check_failure(ds4_wire_code c, const ds4_error *err, const ds4_wire_msg *m) {
    REQUIRE(c != DS4_WIRE_OK && c != DS4_WIRE_ENOMEM);
    REQUIRE(err->code == (c == DS4_WIRE_EARG ? DS4_ERR_ARG : DS4_ERR_FORMAT));
    REQUIRE(strncmp(err->msg, "wire decode: ", 13) == 0);
    REQUIRE((unsigned)m->type < DS4_WIRE_TYPE_COUNT);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int n = data[0] % 18;
    size_t pos = 1;
    size_t lens[18];
    void *frames[18];
    for (int k = 0; k < n; k++) {
        size_t l = 0;
        if (pos + 2 <= size) l = (size_t)data[pos] | (size_t)data[pos + 1] << 8;
        pos += 2;
        lens[k] = l;
    }
    if (pos > size) pos = size;
    for (int k = 0; k < n; k++) {
        size_t l = lens[k] < size - pos ? lens[k] : size - pos;
        lens[k] = l;
        frames[k] = malloc(l ? l : 1);
        REQUIRE(frames[k]);
        if (l) memcpy(frames[k], data + pos, l);
        pos += l;
    }

    static ds4_wire_msg m, m2, m3;
    ds4_error err;
    memset(&err, 0, sizeof err);
    ds4_wire_code c = ds4_wire_decode(NULL, n, (const void *const *)frames, lens, &m, &err);
    if (c != DS4_WIRE_OK) {
        check_failure(c, &err, &m);
    } else {
        ds4_wire_out out;
        REQUIRE(ds4_wire_encode(&m, &out, &err) == DS4_OK);
        for (int k = 1; k < out.nframes; k++) REQUIRE(out.lens[k] == 0 || out.frames[k] == frames[k]);
        REQUIRE(ds4_wire_decode(NULL, out.nframes, out.frames, out.lens, &m2, &err) == DS4_WIRE_OK);
        REQUIRE(ds4_wire_equal(&m, &m2, NULL));
        ds4_wire_out_free(&out);
    }

    /* tighter limits only ever add rejections */
    ds4_wire_limits tight = ds4_wire_default_limits();
    tight.max_header_bytes = 512;
    tight.max_frame_bytes = 4096;
    tight.max_frames = 8;
    tight.max_str_bytes = 16;
    tight.max_prompt_tokens = 64;
    tight.max_samples = 4;
    tight.max_stop_ids = 4;
    tight.max_gen_tokens = 256;
    tight.max_chunk_bytes = 64;
    tight.max_weight_bytes = 4096;
    ds4_wire_code ct = ds4_wire_decode(&tight, n, (const void *const *)frames, lens, &m3, &err);
    if (ct == DS4_WIRE_OK) REQUIRE(c == DS4_WIRE_OK && ds4_wire_equal(&m, &m3, NULL));
    else check_failure(ct, &err, &m3);

    for (int k = 0; k < n; k++) free(frames[k]);
    return 0;
}
