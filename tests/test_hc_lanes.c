/* test_hc_lanes.c — the mHC Sinkhorn of DS4_HC_SB tokens side by side (ds4_hc_sinkhorn_lanes, core/cpu_hc.c, which
 * the CPU's hc_pre takes for whole groups of tokens) against the one-token reference (ds4_hc_sinkhorn), byte for
 * byte: each lane must do the reference's IEEE operations in its order, so any difference is a defect, not rounding.
 * The fp64 matrices are compared, not only their fp32 roundings, which would hide most last-bit differences.
 * Random logits over a wide range (softmax rows from nearly one-hot to flat), stream counts 1, 2, 3, 4, 5 and 8,
 * iteration counts 1, 2, 7 and 20, tokens of one group with different logits. The same for the backward through the
 * Sinkhorn (ds4_hc_sinkhorn_bwd_lanes against ds4_hc_sinkhorn_bwd, the fp64 gradients and their fp32 roundings;
 * `gs / cden / cden` for `gs / (cden · cden)` in the lanes fails 184 checks). Then the whole ops that take them
 * (ds4_op_hc_pre, ds4_op_hc_post_bwd, ds4_op_hc_pre_bwd on the CPU backend) over token counts that leave a ragged
 * last group and blocks of several groups, against the one-token code token by token: hc_pre's comb, hc_post_bwd's
 * dX formed here from that comb as the op forms it, and hc_pre_bwd's comb gradients, dmix and scale sum (byte for
 * byte). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "kernels_cpu.h"
#include "model.h"
#include "testlib.h"

static uint64_t rs = 0x2545f4914f6cdd1dull;
static float frand(float lo, float hi) {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return lo + (hi - lo) * (float)((double)((rs * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0));
}

static void t_lanes(int64_t n, int64_t iters, float spread) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = n, c.hc_sinkhorn_iters = iters;
    const int64_t nn = n * n;
    float logits[DS4_HC_SB][64], base[64], got[DS4_HC_SB][64], want[64];
    double M[64], gotM[DS4_HC_SB][64];
    for (int64_t i = 0; i < nn; i++) base[i] = frand(-1, 1);
    for (int s = 0; s < DS4_HC_SB; s++)
        for (int64_t i = 0; i < nn; i++) logits[s][i] = frand(-spread, spread);
    const float sc2 = frand(0.5f, 2.0f);
    const float *lg[DS4_HC_SB];
    float *cb[DS4_HC_SB];
    double *mb[DS4_HC_SB];
    for (int s = 0; s < DS4_HC_SB; s++) lg[s] = logits[s], cb[s] = got[s], mb[s] = gotM[s];
    ds4_hc_sinkhorn_lanes(&c, lg, sc2, base, mb, cb);
    for (int s = 0; s < DS4_HC_SB; s++) {
        ds4_hc_sinkhorn(&c, logits[s], sc2, base, M, NULL);
        for (int64_t i = 0; i < nn; i++) want[i] = (float)M[i];
        CHECK(memcmp(gotM[s], M, (size_t)nn * sizeof(double)) == 0 &&
              memcmp(got[s], want, (size_t)nn * sizeof(float)) == 0, "n %lld, %lld iterations, logits within ±%g: "
              "lane %d differs from the one-token Sinkhorn", (long long)n, (long long)iters, spread, s);
        int finite = 1;
        for (int64_t i = 0; i < nn; i++) finite &= isfinite(got[s][i]);
        CHECK(finite, "n %lld: lane %d is finite", (long long)n, s);
    }
}

/* The Sinkhorn backward of DS4_HC_SB tokens side by side (ds4_hc_sinkhorn_bwd_lanes) against one token at a time
 * (ds4_hc_sinkhorn_bwd): the gradients of the comb logits byte for byte in fp64 (before their rounding to fp32,
 * which would hide most last-bit differences) and in fp32, each lane with its own logits and dcomb. */
static void t_lanes_bwd(int64_t n, int64_t iters, float spread) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = n, c.hc_sinkhorn_iters = iters;
    const int64_t nn = n * n;
    float logits[DS4_HC_SB][64], dcomb[DS4_HC_SB][64], base[64], got[DS4_HC_SB][64], want[64];
    double got64[DS4_HC_SB][64], want64[64];
    double *tape = aligned_alloc(64, (size_t)(DS4_HC_SB * (2 * iters + 1) * 64) * sizeof(double));
    if (!tape) {
        CHECK(0, "allocation");
        return;
    }
    for (int64_t i = 0; i < nn; i++) base[i] = frand(-1, 1);
    for (int s = 0; s < DS4_HC_SB; s++)
        for (int64_t i = 0; i < nn; i++) logits[s][i] = frand(-spread, spread), dcomb[s][i] = frand(-1, 1);
    const float sc2 = frand(0.5f, 2.0f);
    const float *lg[DS4_HC_SB], *dc[DS4_HC_SB];
    float *dz[DS4_HC_SB];
    double *dz64[DS4_HC_SB];
    for (int s = 0; s < DS4_HC_SB; s++) lg[s] = logits[s], dc[s] = dcomb[s], dz[s] = got[s], dz64[s] = got64[s];
    ds4_hc_sinkhorn_bwd_lanes(&c, lg, sc2, base, dc, dz, dz64, tape);
    for (int s = 0; s < DS4_HC_SB; s++) {
        ds4_hc_sinkhorn_bwd(&c, logits[s], sc2, base, dcomb[s], want, want64, tape);
        CHECK(memcmp(got[s], want, (size_t)nn * sizeof(float)) == 0 &&
              memcmp(got64[s], want64, (size_t)nn * sizeof(double)) == 0, "backward, n %lld, %lld iterations, logits "
              "within ±%g: lane %d differs from the one-token backward", (long long)n, (long long)iters, spread, s);
        int finite = 1;
        for (int64_t i = 0; i < nn; i++) finite &= isfinite(got[s][i]);
        CHECK(finite, "backward, n %lld: lane %d is finite", (long long)n, s);
    }
    free(tape);
}

/* hc_pre over T tokens (blocks of DS4_HC_TB, groups of DS4_HC_SB, a ragged rest) against comb token by token */
static void t_op(ds4_engine *e, int64_t T) {
    ds4_config c;
    ds4_config_default(&c);
    c.hc_mult = 3, c.hidden_size = 16, c.hc_sinkhorn_iters = 20;
    const int64_t n = c.hc_mult, D = c.hidden_size, mix = (2 + n) * n;
    float *X = malloc((size_t)(T * n * D) * sizeof(float)), fn[15 * 48], bs[15], sc[3];
    float *pre = malloc((size_t)(T * n) * sizeof(float)), *post = malloc((size_t)(T * n) * sizeof(float));
    float *comb = malloc((size_t)(T * n * n) * sizeof(float)), *u = malloc((size_t)(T * D) * sizeof(float));
    float *mx = malloc((size_t)(T * mix) * sizeof(float));
    if (!X || !pre || !post || !comb || !u || !mx) {
        CHECK(0, "allocation");
        free(X), free(pre), free(post), free(comb), free(u), free(mx);
        return;
    }
    for (int64_t i = 0; i < T * n * D; i++) X[i] = frand(-2, 2);
    for (int64_t i = 0; i < mix * n * D; i++) fn[i] = frand(-0.5f, 0.5f);
    for (int64_t i = 0; i < mix; i++) bs[i] = frand(-1, 1);
    sc[0] = 0.7f, sc[1] = 1.3f, sc[2] = 2.1f;
    const ds4_hc_w w = {.fn = fn, .base = bs, .scale = sc};
    ds4_dev *d = NULL;
    ds4_error err;
    CHECK_OK(ds4_cpu_dev_create(e->pool, &d, &err), &err);
    if (d) CHECK_OK(d->ops->reserve(d, &c, T, 1, 1, &err), &err); /* training: hc_pre_bwd's tapes */
    if (!d) {
        free(X), free(pre), free(post), free(comb), free(u), free(mx);
        return;
    }
    OP(d, hc_pre, .c = &c, .w = &w, .X = X, .T = T, .pre = pre, .post = post, .comb = comb, .u = u, .mix = mx);
    CHECK_OK(ds4_dev_check(d, "hc_pre", &err), &err);
    int64_t bad = 0;
    double M[9];
    float one[9];
    for (int64_t t = 0; t < T; t++) {
        ds4_hc_sinkhorn(&c, mx + t * mix + 2 * n, sc[2], bs + 2 * n, M, NULL);
        for (int64_t i = 0; i < n * n; i++) one[i] = (float)M[i];
        bad += memcmp(one, comb + t * n * n, sizeof one) != 0;
    }
    CHECK(bad == 0, "hc_pre over %lld tokens: %lld tokens' comb differ from the one-token Sinkhorn", (long long)T,
          (long long)bad);
    /* hc_post_bwd: dX_j = sum_k comb[j][k] dXo_k per token, comb from its own mix logits (rows n.. of fn) */
    float *dXo = malloc((size_t)(T * n * D) * sizeof(float)), *at = malloc((size_t)(T * D) * sizeof(float));
    float *dX = malloc((size_t)(T * n * D) * sizeof(float)), *da = malloc((size_t)(T * D) * sizeof(float));
    float *dpost = malloc((size_t)(T * n) * sizeof(float)), *dcomb = malloc((size_t)(T * n * n) * sizeof(float));
    if (dXo && at && dX && da && dpost && dcomb) {
        for (int64_t i = 0; i < T * n * D; i++) dXo[i] = frand(-1, 1);
        for (int64_t i = 0; i < T * D; i++) at[i] = frand(-1, 1);
        OP(d, hc_post_bwd, .c = &c, .w = &w, .dXo = dXo, .a = at, .X = X, .dX = dX, .da = da, .dpost = dpost,
           .dcomb = dcomb, .T = T);
        CHECK_OK(ds4_dev_check(d, "hc_post_bwd", &err), &err);
        int64_t badx = 0;
        float xn[48], mixrow[15], want[48];
        for (int64_t t = 0; t < T; t++) {
            ds4_rmsnorm_rows(xn, X + t * n * D, NULL, 1, n * D, c.rms_norm_eps);
            ds4_matmul_nt_serial(mixrow, mix, xn, n * D, fn + n * n * D, 1, n * D, mix - n);
            ds4_hc_sinkhorn(&c, mixrow + n, sc[2], bs + 2 * n, M, NULL);
            for (int64_t j = 0; j < n; j++) {
                memset(want + j * D, 0, (size_t)D * sizeof(float));
                for (int64_t k = 0; k < n; k++) ds4_axpy(want + j * D, (float)M[j * n + k], dXo + t * n * D + k * D, D);
            }
            badx += memcmp(want, dX + t * n * D, (size_t)(n * D) * sizeof(float)) != 0;
        }
        CHECK(badx == 0, "hc_post_bwd over %lld tokens: %lld tokens' dX differ from the one-token Sinkhorn's",
              (long long)T, (long long)badx);
    } else {
        CHECK(0, "allocation");
    }
    /* hc_pre_bwd (its comb part DS4_HC_SB tokens at a time, the rest one by one) against ds4_hc_sinkhorn_bwd token
     * by token, from the token's own mix logits: dzb's comb part, dmix = dzb · scale, and the scale's sum dzs[2] */
    float *du = malloc((size_t)(T * D) * sizeof(float)), *xnb = malloc((size_t)(T * n * D) * sizeof(float));
    float *dmix = malloc((size_t)(T * mix) * sizeof(float)), *dzb = malloc((size_t)(T * mix) * sizeof(float));
    float *dzs = malloc((size_t)(T * 3) * sizeof(float)), *dX2 = calloc((size_t)(T * n * D), sizeof(float));
    double *tp = aligned_alloc(64, ((size_t)((2 * c.hc_sinkhorn_iters + 1) * n * n) * sizeof(double) + 63) / 64 * 64);
    if (du && xnb && dmix && dzb && dzs && dX2 && tp && dpost && dcomb) {
        for (int64_t i = 0; i < T * D; i++) du[i] = frand(-1, 1);
        for (int64_t i = 0; i < T * n * n; i++) dcomb[i] = frand(-1, 1);
        OP(d, hc_pre_bwd, .c = &c, .w = &w, .X = X, .du = du, .dX = dX2, .dpost = dpost, .dcomb = dcomb, .dmix = dmix,
           .xn = xnb, .dzb = dzb, .dzs = dzs, .T = T);
        CHECK_OK(ds4_dev_check(d, "hc_pre_bwd", &err), &err);
        int64_t badp = 0;
        float xn[48], mixrow[15], dz[9];
        for (int64_t t = 0; t < T; t++) {
            ds4_rmsnorm_rows(xn, X + t * n * D, NULL, 1, n * D, c.rms_norm_eps);
            ds4_matmul_nt_serial(mixrow, mix, xn, n * D, fn, 1, n * D, mix);
            ds4_hc_sinkhorn_bwd(&c, mixrow + 2 * n, sc[2], bs + 2 * n, dcomb + t * n * n, dz, NULL, tp);
            float z2 = 0, dm[9];
            for (int64_t i = 0; i < n * n; i++) z2 += dz[i] * mixrow[2 * n + i], dm[i] = dz[i] * sc[2];
            badp += memcmp(dz, dzb + t * mix + 2 * n, (size_t)(n * n) * sizeof(float)) != 0 ||
                    memcmp(dm, dmix + t * mix + 2 * n, (size_t)(n * n) * sizeof(float)) != 0 ||
                    memcmp(&z2, dzs + t * 3 + 2, sizeof z2) != 0;
        }
        CHECK(badp == 0, "hc_pre_bwd over %lld tokens: %lld tokens' comb gradients differ from the one-token "
              "backward's", (long long)T, (long long)badp);
    } else {
        CHECK(0, "allocation");
    }
    free(du), free(xnb), free(dmix), free(dzb), free(dzs), free(dX2), free(tp);
    free(dXo), free(at), free(dX), free(da), free(dpost), free(dcomb);
    ds4_dev_release(d);
    free(X), free(pre), free(post), free(comb), free(u), free(mx);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    static const int64_t ns[] = {1, 2, 3, 4, 5, 8}, its[] = {1, 2, 7, 20};
    static const float spreads[] = {0.1f, 3.0f, 40.0f};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
        for (size_t j = 0; j < sizeof its / sizeof its[0]; j++)
            for (size_t k = 0; k < sizeof spreads / sizeof spreads[0]; k++) {
                t_lanes(ns[i], its[j], spreads[k]);
                t_lanes_bwd(ns[i], its[j], spreads[k]);
            }
    ds4_engine *e = NULL;
    ds4_error err;
    const ds4_engine_options o = {.n_threads = 2};
    CHECK_OK(ds4_engine_create(&o, &e, &err), &err);
    if (e) {
        static const int64_t Ts[] = {1, 3, 4, 7, 8, 9, 13, 64, 131};
        for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) t_op(e, Ts[i]);
        ds4_engine_free(e);
    }
    return ds4t_finish("test_hc_lanes");
}
