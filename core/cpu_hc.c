/* cpu_hc.c — CPU operations of the residual streams: the embedding into n streams, the mHC sites (pre: mixing
 * coefficients with Sinkhorn and the collapse; post: the expansion), the HyperHead, and their backward.
 * docs/architecture.md, "Hyper-connections", gives the equations. */
#include <string.h>

#include "cpu.h"
#include "shape_limits.h"

static void embed_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_embed *a = p;
    const float *E = a->E;
    for (int64_t t = b; t < e; t++)
        for (int64_t i = 0; i < a->n; i++)
            memcpy(a->X + (t * a->n + i) * a->D, E + a->ids[t] * a->D, (size_t)a->D * sizeof(float));
}

void ds4_cpu_embed(ds4_dev *d, const ds4_a_embed *a) {
    if (a->edt != DS4_F32) {
        ds4_dev_fail(d, DS4_ERR_UNSUPPORTED, "embed: table dtype %s (the CPU backend holds fp32 weights)",
                     ds4_dtype_name(a->edt));
        return;
    }
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T, 8, embed_range, a);
}

/* Row softmax of the scaled comb logits, + eps: the first state of the iteration (P: the plain softmax too). */
static void sinkhorn_start(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base, double *M,
                           double *P) {
    const int64_t n = c->hc_mult;
    const double hc_eps = c->hc_eps;
    for (int64_t j = 0; j < n; j++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k < n; k++) {
            const double r = (double)(comb_logits[j * n + k] * sc2 + comb_base[j * n + k]);
            M[j * n + k] = r;
            mx = r > mx ? r : mx;
        }
        for (int64_t k = 0; k < n; k++) sum += (M[j * n + k] = exp(M[j * n + k] - mx));
        for (int64_t k = 0; k < n; k++) {
            if (P) P[j * n + k] = M[j * n + k] / sum;
            M[j * n + k] = M[j * n + k] / sum + hc_eps;
        }
    }
}

void ds4_hc_sinkhorn(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base, double *M,
                     double *tape) {
    const int64_t n = c->hc_mult, it = c->hc_sinkhorn_iters, nn = n * n;
    const double hc_eps = c->hc_eps;
    sinkhorn_start(c, comb_logits, sc2, comb_base, M, tape ? tape + 2 * it * nn : NULL);
    if (tape) memcpy(tape, M, (size_t)nn * sizeof(double));
    for (int64_t step = 1; step < 2 * it; step++) {
        const int col = step % 2 == 1; /* step 1 is a column normalisation; the last one is too */
        for (int64_t a = 0; a < n; a++) {
            double s = 0;
            for (int64_t q = 0; q < n; q++) s += col ? M[q * n + a] : M[a * n + q];
            for (int64_t q = 0; q < n; q++) {
                if (col) M[q * n + a] /= s + hc_eps;
                else M[a * n + q] /= s + hc_eps;
            }
        }
        if (tape) memcpy(tape + step * nn, M, (size_t)nn * sizeof(double));
    }
}

typedef double hc_lanes __attribute__((vector_size(DS4_HC_SB * sizeof(double))));

/* ds4_hc_sinkhorn on DS4_HC_SB tokens as lanes, into M [n·n] (M[i][s]: element i of token s); with tape, its
 * layout in lanes: the states 0 .. 2·iters − 1, then the plain softmax. */
static void sinkhorn_lanes_run(const ds4_config *c, const float *const logits[DS4_HC_SB], float sc2,
                               const float *comb_base, hc_lanes *M, hc_lanes *tape) {
    const int64_t n = c->hc_mult, it = c->hc_sinkhorn_iters, nn = n * n;
    double one[DS4_HC_LANES_SQ], pone[DS4_HC_LANES_SQ];
    hc_lanes e;
    for (int s = 0; s < DS4_HC_SB; s++) {
        sinkhorn_start(c, logits[s], sc2, comb_base, one, tape ? pone : NULL);
        for (int64_t i = 0; i < nn; i++) {
            M[i][s] = one[i];
            if (tape) tape[2 * it * nn + i][s] = pone[i];
        }
        e[s] = c->hc_eps;
    }
    if (tape) memcpy(tape, M, (size_t)nn * sizeof(hc_lanes));
    for (int64_t step = 1; step < 2 * it; step++) { /* ds4_hc_sinkhorn's steps, lane by lane */
        const int col = step % 2 == 1;
        for (int64_t a = 0; a < n; a++) {
            hc_lanes sum = {0};
            for (int64_t q = 0; q < n; q++) sum += col ? M[q * n + a] : M[a * n + q];
            for (int64_t q = 0; q < n; q++) {
                hc_lanes *m = col ? &M[q * n + a] : &M[a * n + q];
                *m /= sum + e;
            }
        }
        if (tape) memcpy(tape + step * nn, M, (size_t)nn * sizeof(hc_lanes));
    }
}

void ds4_hc_sinkhorn_lanes(const ds4_config *c, const float *const logits[DS4_HC_SB], float sc2, const float *comb_base,
                           double *const Mout[DS4_HC_SB], float *const comb[DS4_HC_SB]) {
    const int64_t nn = c->hc_mult * c->hc_mult;
    hc_lanes M[DS4_HC_LANES_SQ]; /* nn <= DS4_HC_LANES_SQ: the callers' */
    sinkhorn_lanes_run(c, logits, sc2, comb_base, M, NULL);
    for (int s = 0; s < DS4_HC_SB; s++)
        for (int64_t i = 0; i < nn; i++) {
            if (Mout) Mout[s][i] = M[i][s];
            if (comb) comb[s][i] = (float)M[i][s];
        }
}

/* The comb of a block's first tokens, DS4_HC_SB at a time side by side (n <= 8): token k's comb logits at lg + k·ldl,
 * its comb into comb + k·ldc. Returns how many tokens that was (a multiple of DS4_HC_SB, 0 for larger n); the caller
 * takes the rest one at a time (ds4_hc_sinkhorn: the same bits). */
static int64_t block_combs(const ds4_config *c, const float *lg, int64_t ldl, int64_t tb, float sc2, const float *base,
                           float *comb, int64_t ldc) {
    int64_t k = 0;
    for (; c->hc_mult * c->hc_mult <= DS4_HC_LANES_SQ && k + DS4_HC_SB <= tb; k += DS4_HC_SB) {
        const float *l[DS4_HC_SB];
        float *cb[DS4_HC_SB];
        for (int s = 0; s < DS4_HC_SB; s++) l[s] = lg + (k + s) * ldl, cb[s] = comb + (k + s) * ldc;
        ds4_hc_sinkhorn_lanes(c, l, sc2, base, NULL, cb);
    }
    return k;
}

/* pre/post/comb and the collapsed input u for tokens [b, e). The mix logits of DS4_HC_TB tokens at a time are one
 * small product with fn (each the same 8-lane dot as ds4_dot), so fn is read once per block instead of per token. */
static void hc_pre_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hc_pre *a = p;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D, mix = (2 + n) * n;
    const double eps = c->rms_norm_eps, hc_eps = c->hc_eps;
    float *xn = ds4_cpu_scratch(cpu, task); /* DS4_HC_TB · n·D floats */
    float mixb[DS4_HC_TB * DS4_MAX_HC_MIX];
    double M[DS4_MAX_HC_SQ];
    for (int64_t t0 = b; t0 < e; t0 += DS4_HC_TB) {
        const int64_t tb = e - t0 < DS4_HC_TB ? e - t0 : DS4_HC_TB;
        ds4_rmsnorm_rows(xn, a->X + t0 * nD, NULL, tb, nD, eps);
        ds4_matmul_nt_serial(mixb, mix, xn, nD, a->w->fn, tb, nD, mix);
        if (a->mix) memcpy(a->mix + t0 * mix, mixb, (size_t)(tb * mix) * sizeof(float));
        const float *base = a->w->base, *sc = a->w->scale;
        const int64_t lanes = block_combs(c, mixb + 2 * n, mix, tb, sc[2], base + 2 * n, a->comb + t0 * n * n, n * n);
        for (int64_t t = t0; t < t0 + tb; t++) {
            const float *x = a->X + t * nD, *mixv = mixb + (t - t0) * mix;
            float *pre = a->pre + t * n, *post = a->post + t * n, *comb = a->comb + t * n * n;
            for (int64_t i = 0; i < n; i++) {
                pre[i] = ds4_sigmoidf(mixv[i] * sc[0] + base[i]) + (float)hc_eps;
                post[i] = 2.0f * ds4_sigmoidf(mixv[n + i] * sc[1] + base[n + i]);
            }
            if (t - t0 >= lanes) { /* the block's last tokens, fewer than DS4_HC_SB: one at a time */
                ds4_hc_sinkhorn(c, mixv + 2 * n, sc[2], base + 2 * n, M, NULL);
                for (int64_t i = 0; i < n * n; i++) comb[i] = (float)M[i];
            }
            float *u = a->u + t * D;
            memset(u, 0, (size_t)D * sizeof(float));
            for (int64_t i = 0; i < n; i++) ds4_axpy(u, pre[i], x + i * D, D);
        }
    }
}

void ds4_cpu_hc_pre(ds4_dev *d, const ds4_a_hc_pre *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->T, hc_pre_range, a); }

/* X'[k] = post_k · a + Σ_j comb[j][k] · X[j]  (the sum runs over the SOURCE stream j: Mᵀ X). */
static void hc_post_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hc_post *a = p;
    const int64_t n = a->c->hc_mult, D = a->c->hidden_size;
    for (int64_t t = b; t < e; t++) {
        const float *x = a->X + t * n * D, *at = a->a + t * D, *post = a->post + t * n, *comb = a->comb + t * n * n;
        float *xo = a->Xo + t * n * D;
        for (int64_t k = 0; k < n; k++) {
            float *y = xo + k * D;
            memset(y, 0, (size_t)D * sizeof(float));
            for (int64_t j = 0; j < n; j++) ds4_axpy(y, comb[j * n + k], x + j * D, D);
            ds4_axpy(y, post[k], at, D);
        }
    }
}

void ds4_cpu_hc_post(ds4_dev *d, const ds4_a_hc_post *a) {
    const int64_t n = a->c->hc_mult, D = a->c->hidden_size;
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->T, (n + 1) * n * D, hc_post_range, a); /* n outputs of n + 1 axpys */
}

/* HyperHead: p_i = σ(s·(W_h RMS(vec X))_i + b_i) + eps; y = Σ p_i X_i. */
static void hyperhead_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hyperhead *a = p;
    const int64_t n = a->c->hc_mult, D = a->c->hidden_size;
    float *xn = ds4_cpu_scratch(cpu, task);
    for (int64_t t = b; t < e; t++) {
        const float *x = a->X + t * n * D;
        ds4_rmsnorm_rows(xn, x, NULL, 1, n * D, a->c->rms_norm_eps);
        float pre[DS4_MAX_HC];
        for (int64_t i = 0; i < n; i++)
            pre[i] = ds4_sigmoidf(ds4_dot(a->fn + i * n * D, xn, n * D) * a->scale[0] + a->base[i]) + (float)a->c->hc_eps;
        float *u = a->u + t * D;
        memset(u, 0, (size_t)D * sizeof(float));
        for (int64_t i = 0; i < n; i++) ds4_axpy(u, pre[i], x + i * D, D);
    }
}

void ds4_cpu_hyperhead(ds4_dev *d, const ds4_a_hyperhead *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->T, hyperhead_range, a);
}

/* ------------------------------------------------------------------------------------------------ backward */

void ds4_hc_sinkhorn_bwd(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base,
                         const float *dcomb, float *dz, double *dz64, double *tape) {
    const int64_t n = c->hc_mult, it = c->hc_sinkhorn_iters, nn = n * n, ns = 2 * it; /* states 0 .. 2·iters − 1 */
    const double hc_eps = c->hc_eps;
    double M[DS4_MAX_HC_SQ];
    ds4_hc_sinkhorn(c, comb_logits, sc2, comb_base, M, tape);
    const double *P = tape + ns * nn;
    /* backward through the normalisations: y = x / (Σ x + eps) along an axis */
    double g[DS4_MAX_HC_SQ], gx[DS4_MAX_HC_SQ];
    for (int64_t i = 0; i < nn; i++) g[i] = dcomb[i];
    for (int64_t s = ns - 1; s >= 1; s--) {
        const double *x0 = tape + (s - 1) * nn;
        const int col = s % 2 == 1;
        for (int64_t q0 = 0; q0 < n; q0++) {
            double sum = 0, gs = 0;
            for (int64_t q = 0; q < n; q++) {
                const int64_t ix = col ? q * n + q0 : q0 * n + q;
                sum += x0[ix];
                gs += g[ix] * x0[ix];
            }
            const double cden = sum + hc_eps;
            for (int64_t q = 0; q < n; q++) {
                const int64_t ix = col ? q * n + q0 : q0 * n + q;
                gx[ix] = g[ix] / cden - gs / (cden * cden);
            }
        }
        memcpy(g, gx, (size_t)nn * sizeof(double));
    }
    /* softmax rows (the +eps passes the gradient through) */
    for (int64_t j = 0; j < n; j++) {
        double dot = 0;
        for (int64_t k = 0; k < n; k++) dot += P[j * n + k] * g[j * n + k];
        for (int64_t k = 0; k < n; k++) {
            const double v = P[j * n + k] * (g[j * n + k] - dot);
            if (dz64) dz64[j * n + k] = v;
            dz[j * n + k] = (float)v;
        }
    }
}

void ds4_hc_sinkhorn_bwd_lanes(const ds4_config *c, const float *const logits[DS4_HC_SB], float sc2,
                               const float *comb_base, const float *const dcomb[DS4_HC_SB], float *const dz[DS4_HC_SB],
                               double *const dz64[DS4_HC_SB], double *tape) {
    const int64_t n = c->hc_mult, it = c->hc_sinkhorn_iters, nn = n * n, ns = 2 * it;
    hc_lanes *T = (hc_lanes *)(void *)tape, *P = T + ns * nn; /* T[s·nn + i][lane]: state s; then the softmax */
    hc_lanes M[DS4_HC_LANES_SQ], e;
    sinkhorn_lanes_run(c, logits, sc2, comb_base, M, T);
    for (int s = 0; s < DS4_HC_SB; s++) e[s] = c->hc_eps;
    hc_lanes g[DS4_HC_LANES_SQ], gx[DS4_HC_LANES_SQ];
    for (int s = 0; s < DS4_HC_SB; s++)
        for (int64_t i = 0; i < nn; i++) g[i][s] = dcomb[s][i];
    for (int64_t s = ns - 1; s >= 1; s--) { /* ds4_hc_sinkhorn_bwd's, lane by lane */
        const hc_lanes *x0 = T + (s - 1) * nn;
        const int col = s % 2 == 1;
        for (int64_t q0 = 0; q0 < n; q0++) {
            hc_lanes sum = {0}, gs = {0};
            for (int64_t q = 0; q < n; q++) {
                const int64_t ix = col ? q * n + q0 : q0 * n + q;
                sum += x0[ix];
                gs += g[ix] * x0[ix];
            }
            const hc_lanes cden = sum + e;
            for (int64_t q = 0; q < n; q++) {
                const int64_t ix = col ? q * n + q0 : q0 * n + q;
                gx[ix] = g[ix] / cden - gs / (cden * cden);
            }
        }
        memcpy(g, gx, (size_t)nn * sizeof(hc_lanes));
    }
    for (int64_t j = 0; j < n; j++) {
        hc_lanes dot = {0};
        for (int64_t k = 0; k < n; k++) dot += P[j * n + k] * g[j * n + k];
        for (int64_t k = 0; k < n; k++) {
            const hc_lanes v = P[j * n + k] * (g[j * n + k] - dot);
            for (int s = 0; s < DS4_HC_SB; s++) {
                if (dz64) dz64[s][j * n + k] = v[s];
                dz[s][j * n + k] = (float)v[s];
            }
        }
    }
}

/* Recompute one site's coefficients with a Sinkhorn tape and back-propagate dpre (from du), dpost, dcomb to the
 * mix logits; also dX += pre_i · du (the collapse itself). Per token; weight-side sums come later. The pre and post
 * parts token by token, then the comb part (ds4_hc_sinkhorn_bwd) DS4_HC_SB tokens side by side, then the scale's
 * comb sum and dmix: each token's operations in the order they had one token at a time, so the same bits. */
static void hc_pre_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hc_pre_bwd *a = p;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D, mix = (2 + n) * n;
    const double hc_eps = c->hc_eps;
    const float *base = a->w->base, *sc = a->w->scale;
    double *tape = cpu->sk + task * cpu->sk_stride; /* DS4_HC_SB tapes of ds4_hc_sinkhorn_bwd's, 64-byte aligned */
    /* xn and the mix logits for all the range's tokens first: one small product with fn (dmix holds mix first,
     * then its gradient) */
    ds4_rmsnorm_rows(a->xn + b * nD, a->X + b * nD, NULL, e - b, nD, c->rms_norm_eps);
    ds4_matmul_nt_serial(a->dmix + b * mix, mix, a->xn + b * nD, nD, a->w->fn, e - b, nD, mix);
    for (int64_t t = b; t < e; t++) {
        const float *x = a->X + t * nD, *du = a->du + t * D;
        float *mixv = a->dmix + t * mix;
        float *dzb = a->dzb + t * mix, *dzs = a->dzs + t * 3;
        dzs[0] = dzs[1] = dzs[2] = 0;
        /* pre = σ(z)+eps, z = mix·s0 + b: the collapse gradient dpre_i = <du, X_i> */
        for (int64_t i = 0; i < n; i++) {
            const float sg = ds4_sigmoidf(mixv[i] * sc[0] + base[i]);
            ds4_axpy(a->dX + t * nD + i * D, sg + (float)hc_eps, du, D);
            const float dz = ds4_dot(du, x + i * D, D) * sg * (1.0f - sg);
            dzb[i] = dz;
            dzs[0] += dz * mixv[i];
        }
        for (int64_t i = 0; i < n; i++) {
            const float sg = ds4_sigmoidf(mixv[n + i] * sc[1] + base[n + i]);
            const float dz = a->dpost[t * n + i] * 2.0f * sg * (1.0f - sg);
            dzb[n + i] = dz;
            dzs[1] += dz * mixv[n + i];
        }
    }
    /* the comb part: DS4_HC_SB tokens side by side while they last, then one at a time (the same bits) */
    int64_t t = b;
    for (; n * n <= DS4_HC_LANES_SQ && t + DS4_HC_SB <= e; t += DS4_HC_SB) {
        const float *lg[DS4_HC_SB], *dc[DS4_HC_SB];
        float *dz[DS4_HC_SB];
        for (int s = 0; s < DS4_HC_SB; s++)
            lg[s] = a->dmix + (t + s) * mix + 2 * n, dc[s] = a->dcomb + (t + s) * n * n,
            dz[s] = a->dzb + (t + s) * mix + 2 * n;
        ds4_hc_sinkhorn_bwd_lanes(c, lg, sc[2], base + 2 * n, dc, dz, NULL, tape);
    }
    for (; t < e; t++)
        ds4_hc_sinkhorn_bwd(c, a->dmix + t * mix + 2 * n, sc[2], base + 2 * n, a->dcomb + t * n * n,
                            a->dzb + t * mix + 2 * n, NULL, tape);
    for (t = b; t < e; t++) {
        float *mixv = a->dmix + t * mix, *dzb = a->dzb + t * mix, *dzs = a->dzs + t * 3;
        for (int64_t i = 2 * n; i < mix; i++) dzs[2] += dzb[i] * mixv[i];
        for (int64_t i = 0; i < mix; i++) mixv[i] = dzb[i] * sc[i < n ? 0 : (i < 2 * n ? 1 : 2)];
    }
}

void ds4_cpu_hc_pre_bwd(ds4_dev *d, const ds4_a_hc_pre_bwd *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->T, hc_pre_bwd_range, a);
}

/* X'[k] = post_k·a + Σ_j comb[j][k]·X[j]: da, dpost, dcomb and dX (per token). The coefficients are recomputed
 * from X exactly as the forward did. */
static void hc_post_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hc_post_bwd *a = p;
    const ds4_config *c = a->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D, mix = (2 + n) * n;
    float *xn = ds4_cpu_scratch(cpu, task); /* DS4_HC_TB · n·D floats */
    const float *base = a->w->base, *sc = a->w->scale;
    float mixb[DS4_HC_TB * DS4_MAX_HC_MIX];
    /* comb of the block's first tokens, DS4_HC_SB at a time side by side (n <= 8: a few kB here) */
    float combb[DS4_HC_TB][DS4_HC_LANES_SQ];
    int64_t lanes = 0; /* the block's tokens whose comb is in combb */
    for (int64_t t = b; t < e; t++) {
        const int64_t k0 = (t - b) % DS4_HC_TB;
        if (k0 == 0) { /* the post and comb logits (rows n .. mix-1 of fn) of the next block of tokens */
            const int64_t tb = e - t < DS4_HC_TB ? e - t : DS4_HC_TB;
            ds4_rmsnorm_rows(xn, a->X + t * nD, NULL, tb, nD, c->rms_norm_eps);
            ds4_matmul_nt_serial(mixb, mix, xn, nD, a->w->fn + n * nD, tb, nD, mix - n);
            lanes = block_combs(c, mixb + n, mix, tb, sc[2], base + 2 * n, combb[0], DS4_HC_LANES_SQ);
        }
        const float *x = a->X + t * nD, *dxo = a->dXo + t * nD, *at = a->a + t * D;
        float mixv[DS4_MAX_HC_MIX], comb[DS4_MAX_HC_SQ];
        for (int64_t j = n; j < mix; j++) mixv[j] = mixb[k0 * mix + j - n];
        if (k0 < lanes) {
            memcpy(comb, combb[k0], (size_t)(n * n) * sizeof(float));
        } else {
            double M[DS4_MAX_HC_SQ];
            ds4_hc_sinkhorn(c, mixv + 2 * n, sc[2], base + 2 * n, M, NULL);
            for (int64_t i = 0; i < n * n; i++) comb[i] = (float)M[i];
        }
        float *da = a->da + t * D, *dX = a->dX + t * nD;
        memset(da, 0, (size_t)D * sizeof(float));
        for (int64_t k = 0; k < n; k++) {
            const float post = 2.0f * ds4_sigmoidf(mixv[n + k] * sc[1] + base[n + k]);
            ds4_axpy(da, post, dxo + k * D, D);
            a->dpost[t * n + k] = ds4_dot(dxo + k * D, at, D);
        }
        for (int64_t j = 0; j < n; j++) {
            float *dxj = dX + j * D;
            memset(dxj, 0, (size_t)D * sizeof(float));
            for (int64_t k = 0; k < n; k++) {
                a->dcomb[t * n * n + j * n + k] = ds4_dot(dxo + k * D, x + j * D, D);
                ds4_axpy(dxj, comb[j * n + k], dxo + k * D, D);
            }
        }
    }
}

void ds4_cpu_hc_post_bwd(ds4_dev *d, const ds4_a_hc_post_bwd *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->T, hc_post_bwd_range, a);
}

/* HyperHead backward per token: y = Σ p_i X_i, p = σ(s·(W x̂) + b) + eps. */
static void hyperhead_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_hyperhead_bwd *a = p;
    const int64_t n = a->c->hc_mult, D = a->c->hidden_size, nD = n * D;
    for (int64_t t = b; t < e; t++) {
        const float *x = a->X + t * nD, *du = a->du + t * D;
        float *xn = a->xn + t * nD, *dm = a->dmix + t * n, *dzb = a->dzb + t * n;
        ds4_rmsnorm_rows(xn, x, NULL, 1, nD, a->c->rms_norm_eps);
        a->dzs[t * 3] = 0;
        for (int64_t i = 0; i < n; i++) {
            const float mix = ds4_dot(a->fn + i * nD, xn, nD);
            const float sg = ds4_sigmoidf(mix * a->scale[0] + a->base[i]);
            float *dx = a->dX + t * nD + i * D;
            memset(dx, 0, (size_t)D * sizeof(float));
            ds4_axpy(dx, sg + (float)a->c->hc_eps, du, D);
            const float dz = ds4_dot(du, x + i * D, D) * sg * (1.0f - sg);
            dzb[i] = dz;
            a->dzs[t * 3] += dz * mix;
            dm[i] = dz * a->scale[0];
        }
    }
}

void ds4_cpu_hyperhead_bwd(ds4_dev *d, const ds4_a_hyperhead_bwd *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->T, hyperhead_bwd_range, a);
}
