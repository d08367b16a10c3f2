/* test_colsum.c — the CPU's colsum_add (the bias-like gradients: the mHC base and scale, the attention sink; context
 * parallelism's sum over the ranks) against its definition in ops.h, written out here as plain loops: each chunk of
 * DS4_COLSUM_CHUNK rows summed from 0 in row order, the chunk sums added into dst in chunk order, fp32 throughout. The
 * GPU forms the chunks side by side and must give the same bytes (test_cuda_row_bits), so the bytes are compared
 * here: a chunk boundary moved, a row skipped or the rows added straight into dst (the order before chunks) all
 * differ. With 1 and with 2 threads (the column blocks split), dst starting nonzero (gradients add), strided rows.
 * Also against the exact sum in double, within the fp32 bound of a chain of its length (a wrong row, sign or stride
 * is far outside it). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "ops.h"
#include "testlib.h"

static uint64_t rs = 0x94d049bb133111ebull;
static float frand(float lo, float hi) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return lo + (hi - lo) * (float)((double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0));
}

static void t_colsum(ds4_engine *e, int threads, int64_t rows, int64_t width, int64_t ld) {
    char what[96];
    snprintf(what, sizeof what, "colsum_add [%lld rows x %lld, stride %lld], %d threads", (long long)rows,
             (long long)width, (long long)ld, threads);
    ds4_dev *d = NULL;
    ds4_error err;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (!d) return;
    float *src = malloc((size_t)(rows * ld) * sizeof(float)), *dst = malloc((size_t)width * 2 * sizeof(float));
    if (!src || !dst) {
        CHECK(0, "allocation");
        free(src), free(dst), ds4_dev_release(d);
        return;
    }
    float *want = dst + width;
    for (int64_t i = 0; i < rows * ld; i++) src[i] = frand(-1, 1);
    for (int64_t i = 0; i < width; i++) dst[i] = want[i] = frand(-1, 1);
    OP(d, colsum_add, .dst = dst, .src = src, .rows = rows, .width = width, .ld = ld);
    CHECK_OK(ds4_dev_check(d, what, &err), &err);
    int64_t bad = 0;
    double emax = 0, bound = 0;
    for (int64_t i = 0; i < width; i++) {
        double exact = want[i], mag = fabs(want[i]);
        for (int64_t r0 = 0; r0 < rows; r0 += DS4_COLSUM_CHUNK) {
            float p = 0.0f;
            for (int64_t r = r0; r < rows && r < r0 + DS4_COLSUM_CHUNK; r++) {
                p += src[r * ld + i];
                exact += src[r * ld + i], mag += fabs(src[r * ld + i]);
            }
            want[i] += p;
        }
        bad += memcmp(&want[i], &dst[i], sizeof(float)) != 0;
        emax = fmax(emax, fabs(dst[i] - exact));
        /* each of the ≤ rows + chunks fp32 adds errs by at most 2^-24 of a partial sum, and |partials| ≤ mag */
        bound = fmax(bound, (double)(rows + rows / DS4_COLSUM_CHUNK + 2) * ldexp(mag, -24));
    }
    CHECK(bad == 0, "%s: %lld of %lld columns are not ops.h's chunked sum", what, (long long)bad, (long long)width);
    CHECK(emax <= bound, "%s: %g from the exact sum (bound %g)", what, emax, bound);
    free(src), free(dst);
    ds4_dev_release(d);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    for (int threads = 1; threads <= 2; threads++) {
        ds4_engine *e = NULL;
        ds4_error err;
        const ds4_engine_options o = {.n_threads = threads};
        CHECK_OK(ds4_engine_create(&o, &e, &err), &err);
        if (!e) continue;
        t_colsum(e, threads, 1, 3, 3);
        t_colsum(e, threads, 255, 24, 24);
        t_colsum(e, threads, 256, 24, 24);
        t_colsum(e, threads, 257, 24, 24);   /* a second chunk of one row */
        t_colsum(e, threads, 8192, 24, 24);  /* the 599M config's mHC base gradient: 32 chunks */
        t_colsum(e, threads, 1000, 1, 3);    /* HyperHead's scale: column 0 of [T, 3] */
        t_colsum(e, threads, 4099, 70, 75);  /* columns over several blocks, strided rows, a ragged last chunk */
        t_colsum(e, threads, 3, 5000, 5000); /* context parallelism's sum over ranks: few rows, many columns */
        ds4_engine_free(e);
    }
    return ds4t_finish("test_colsum");
}
