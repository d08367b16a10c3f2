/* backward.c — the explicit backward pass of the fp32 CPU model (spec/ds4-architecture.md), over the flat
 * gradient buffer, from the activations a training forward saved on the tape (fwd.h).
 *
 * Every operation of the forward has its mirror here, in reverse block order. Gradients ACCUMULATE into
 * m->grads. Reductions that many tokens feed (weight gradients, shared keys, router bias, embedding rows)
 * are computed as matmuls or as loops in a fixed order, never with racing atomics, so the result does not
 * depend on the number of threads. Parameters the active losses do not reach (indexer, router bias, MTP
 * without its loss) receive exactly zero.
 *
 * Linear layers y = x Wᵀ (x [T, K], W [O, K]): dx = dy W and dW += dyᵀ x, both computed with the forward's
 * matmul kernel on transposed copies (transposes are cheap next to the products). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fwd.h"
#include "internal.h"

typedef struct bwd {
    fwd f;                        /* pool, config, rope tables, B/S/T of the current pass */
    ds4_model *m;
    ds4_tape *tp;
    float *G;                     /* gradient buffer */
    /* workspace */
    float *lin_wt, *lin_dw;       /* [max O·K] */
    float *lin_a, *lin_b, *lin_c; /* [T · max width] */
    float *dX, *dXt;              /* [T, n, D] */
    float *du, *dh, *da;          /* [T, D] */
    float *dpost, *dcomb;         /* [T, n], [T, n, n] */
    float *dmix, *xn, *dxn;       /* [T, mix], [T, n·D], [T, n·D] */
    float *dzb, *dzs;             /* [T, mix], [T, 3] per-token base / scale gradients */
    double *sk;                   /* [ntask, sinkhorn tape] */
    int64_t sk_stride;
    float *rinv;                  /* [T·max(n, H)] RMS factors */
    float *dq, *dkv, *dqa;        /* [T, H·d], [T, d], [T, q_lora] */
    float *do_, *dy;              /* [T, H·d], [T, g·o_lora] */
    float *dK, *dpool;            /* [B·S, d] */
    float *dC, *dZ;               /* [T, 2d] */
    float *P, *DS;                /* [T, H, maxk] attention probabilities / logit gradients */
    int64_t maxk;
    float *dsink_t;               /* [T, H] */
    int32_t *inv_t, *inv_i;       /* [T·topk] CSA inverse selection lists */
    int64_t *inv_off;             /* [B·S + 1] */
    float *dlog;                  /* [T, max(V, E)] */
    float *dsc;                   /* [T, E] */
    float *dws;                   /* [T·K] */
    float *xs, *dys, *dxs;        /* [T·K, D] one expert's rows: inputs, output gradients, input gradients */
    float *dxslot;                /* [T·K, D] input gradients filed by (token, slot) */
    float *g1s, *g3s, *act, *dact;/* [T·K, I] */
    int32_t *perm;                /* [T·K] */
    int64_t *ecount;              /* [E + 1] */
    float *dmtp;                  /* [T, n, D] MTP input gradient */
    float *dI, *diq, *diw, *dsi;  /* indexer KL: [T, sel], [T, n_I·c_I], [T, n_I], [T, n_I, sel] */
} bwd;

#define GRAD(b, p) ((b)->G + ((p) - (b)->m->params))

/* ------------------------------------------------------------------------------------------------ planning */

static size_t zmax(size_t a, size_t b) { return a > b ? a : b; }

static void bplan(bwd *b, ds4_arena *a) {
    const ds4_config *c = &b->m->cfg;
    const size_t T = (size_t)b->tp->T, S = (size_t)b->tp->S, B = (size_t)b->tp->B;
    const size_t n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, qr = (size_t)c->q_lora_rank;
    const size_t mix = (2 + n) * n, GO = (size_t)(c->o_groups * c->o_lora_rank), nD = n * D;
    const size_t win = (size_t)c->sliding_window < S ? (size_t)c->sliding_window : S;
    const size_t topk = (size_t)(c->index_topk < (int64_t)S ? c->index_topk : (int64_t)S);
    /* largest weight and widest activation any linear backward sees */
    size_t ok = zmax(V * D, H * d * qr);
    ok = zmax(ok, D * GO);
    ok = zmax(ok, GO * H * d);
    ok = zmax(ok, mix * nD);
    ok = zmax(ok, I * D);
    ok = zmax(ok, 2 * d * D);
    ok = zmax(ok, E * D);
    ok = zmax(ok, D * D);
    ok = zmax(ok, qr * D);
    size_t wmax = zmax(V, nD);
    wmax = zmax(wmax, H * d);
    wmax = zmax(wmax, 2 * d);
    wmax = zmax(wmax, GO);
    wmax = zmax(wmax, zmax(I, E));
    wmax = zmax(wmax, zmax(qr, mix));
    const size_t rows = zmax(T * K, T * n); /* routed-expert slots and per-stream rows (MTP h_proj) */
    b->lin_wt = ds4_arena_take(a, ok, 4);
    b->lin_dw = ds4_arena_take(a, ok, 4);
    b->lin_a = ds4_arena_take(a, rows * wmax, 4);
    b->lin_b = ds4_arena_take(a, rows * wmax, 4);
    b->lin_c = ds4_arena_take(a, rows * wmax, 4);
    b->dX = ds4_arena_take(a, T * nD, 4);
    b->dXt = ds4_arena_take(a, T * nD, 4);
    b->du = ds4_arena_take(a, T * D, 4);
    b->dh = ds4_arena_take(a, T * D, 4);
    b->da = ds4_arena_take(a, T * D, 4);
    b->dpost = ds4_arena_take(a, T * n, 4);
    b->dcomb = ds4_arena_take(a, T * n * n, 4);
    b->dmix = ds4_arena_take(a, T * mix, 4);
    b->xn = ds4_arena_take(a, T * nD, 4);
    b->dxn = ds4_arena_take(a, T * nD, 4);
    b->dzb = ds4_arena_take(a, T * mix, 4);
    b->dzs = ds4_arena_take(a, T * 3, 4);
    b->sk_stride = (int64_t)((2 * (size_t)c->hc_sinkhorn_iters + 2) * n * n);
    b->sk = ds4_arena_take(a, (size_t)b->f.ntask * (size_t)b->sk_stride, 8);
    b->rinv = ds4_arena_take(a, T * zmax(n, H), 4);
    b->dq = ds4_arena_take(a, T * H * d, 4);
    b->dkv = ds4_arena_take(a, T * d, 4);
    b->dqa = ds4_arena_take(a, T * qr, 4);
    b->do_ = ds4_arena_take(a, T * H * d, 4);
    b->dy = ds4_arena_take(a, T * GO, 4);
    const size_t dk = zmax(d, (size_t)c->index_head_dim); /* main or indexer compressor entries */
    b->dK = ds4_arena_take(a, B * S * dk, 4);
    b->dpool = ds4_arena_take(a, B * S * dk, 4);
    b->dC = ds4_arena_take(a, T * 2 * dk, 4);
    b->dZ = ds4_arena_take(a, T * 2 * dk, 4);
    b->maxk = (int64_t)(win + S);
    b->P = ds4_arena_take(a, T * H * (size_t)b->maxk, 4);
    b->DS = ds4_arena_take(a, T * H * (size_t)b->maxk, 4);
    b->dsink_t = ds4_arena_take(a, T * H, 4);
    b->inv_t = ds4_arena_take(a, T * (topk ? topk : 1), 4);
    b->inv_i = ds4_arena_take(a, T * (topk ? topk : 1), 4);
    b->inv_off = ds4_arena_take(a, B * S + 1, 8);
    b->dlog = ds4_arena_take(a, T * zmax(V, E), 4);
    b->dsc = ds4_arena_take(a, T * E, 4);
    b->dws = ds4_arena_take(a, T * K, 4);
    b->xs = ds4_arena_take(a, T * K * D, 4);
    b->dys = ds4_arena_take(a, T * K * D, 4);
    b->dxs = ds4_arena_take(a, T * K * D, 4);
    b->dxslot = ds4_arena_take(a, T * K * D, 4);
    b->g1s = ds4_arena_take(a, T * K * I, 4);
    b->g3s = ds4_arena_take(a, T * K * I, 4);
    b->act = ds4_arena_take(a, T * K * I, 4);
    b->dact = ds4_arena_take(a, T * K * I, 4);
    b->perm = ds4_arena_take(a, T * K, 4);
    b->ecount = ds4_arena_take(a, E + 1, 8);
    b->dmtp = ds4_arena_take(a, T * nD, 4);
    const size_t nI = (size_t)c->index_n_heads, cI = (size_t)c->index_head_dim, sel = topk ? topk : 1;
    const int ikl = b->tp->with_ikl;
    b->dI = ikl ? ds4_arena_take(a, T * sel, 4) : NULL;
    b->diq = ikl ? ds4_arena_take(a, T * nI * cI, 4) : NULL;
    b->diw = ikl ? ds4_arena_take(a, T * nI, 4) : NULL;
    b->dsi = ikl ? ds4_arena_take(a, T * nI * sel, 4) : NULL;
}

/* ------------------------------------------------------------------------------------------------ linear */

typedef struct {
    float *dst;
    const float *src;
    int64_t rows, cols, lds, ldd;
} tr_ctx;

/* dst[c, r] = src[r, c] for the src rows [b, e) of this task. Column tiles of 32 keep the 32 destination rows
 * being filled (each written sequentially in r) in L1, instead of touching a new line per element. */
static void tr_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const tr_ctx *t = p;
    for (int64_t c0 = 0; c0 < t->cols; c0 += 32) {
        const int64_t c1 = c0 + 32 < t->cols ? c0 + 32 : t->cols;
        for (int64_t r = b; r < e; r++) {
            const float *s = t->src + r * t->lds;
            for (int64_t c = c0; c < c1; c++) t->dst[c * t->ldd + r] = s[c];
        }
    }
}

/* dst [cols, rows] = srcᵀ (src [rows, cols] with row stride lds). */
static void transpose(bwd *b, float *dst, const float *src, int64_t rows, int64_t cols, int64_t lds) {
    tr_ctx t = {dst, src, rows, cols, lds, rows};
    ds4_fwd_parallel_range(&b->f, rows, tr_range, &t);
}

/* Backward of y = x Wᵀ over T rows (x row stride ldx, dy row stride ldy, dx row stride lddx):
 * dx = dy W (added when acc, else written; dx may be NULL) and dW += dyᵀ x (dW may be NULL). */
static void lin_bwd(bwd *b, float *dx, int64_t lddx, int acc, float *dW, const float *dy, int64_t ldy,
                    const float *x, int64_t ldx, const float *W, int64_t T, int64_t K, int64_t O) {
    if (T <= 0) return;
    if (dx) {
        transpose(b, b->lin_wt, W, O, K, K); /* Wᵀ [K, O] */
        ds4_matmul_nt(b->f.pool, b->lin_a, K, dy, ldy, b->lin_wt, T, O, K);
        for (int64_t t = 0; t < T; t++) {
            if (acc) ds4_axpy(dx + t * lddx, 1.0f, b->lin_a + t * K, K);
            else memcpy(dx + t * lddx, b->lin_a + t * K, (size_t)K * sizeof(float));
        }
    }
    if (dW) {
        transpose(b, b->lin_b, dy, T, O, ldy); /* dyᵀ [O, T] */
        transpose(b, b->lin_c, x, T, K, ldx);  /* xᵀ [K, T] */
        ds4_matmul_nt(b->f.pool, b->lin_dw, K, b->lin_b, T, b->lin_c, O, T, K);
        ds4_axpy(dW, 1.0f, b->lin_dw, O * K);
    }
}

/* ------------------------------------------------------------------------------------------------ RMSNorm */

typedef struct {
    float *dx;
    const float *dy, *x, *w;
    float *rinv;
    int64_t width;
    double eps;
    int acc;
    int rinv_only; /* first pass: the RMS factors alone */
} nb_ctx;

static void nb_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const nb_ctx *c = p;
    const int64_t n = c->width;
    for (int64_t r = b; r < e; r++) {
        const float *x = c->x + r * n, *dy = c->dy + r * n;
        double ss = 0, dot = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
        const double ri = 1.0 / sqrt(ss / (double)n + c->eps);
        c->rinv[r] = (float)ri;
        if (c->rinv_only) continue;
        for (int64_t i = 0; i < n; i++) dot += (double)(c->w ? c->w[i] * dy[i] : dy[i]) * x[i];
        const double k = ri * ri * ri * dot / (double)n;
        float *dx = c->dx + r * n;
        for (int64_t i = 0; i < n; i++) {
            double g = (double)(c->w ? c->w[i] * dy[i] : dy[i]) * ri - (double)x[i] * k;
            dx[i] = c->acc ? dx[i] + (float)g : (float)g;
        }
    }
}

typedef struct {
    float *dw;
    const float *dy, *x, *rinv;
    int64_t rows, width;
} nw_ctx;

static void nw_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const nw_ctx *c = p;
    for (int64_t i = b; i < e; i++) { /* a column per task item: a fixed-order sum over rows */
        double s = 0;
        for (int64_t r = 0; r < c->rows; r++) s += (double)c->dy[r * c->width + i] * c->x[r * c->width + i] * c->rinv[r];
        c->dw[i] += (float)s;
    }
}

/* y = w ⊙ x / rms(x) over `rows` rows: dx (written, or added when acc) and dw += (w may be NULL). dx may
 * alias dy: the weight gradient, which reads dy, is taken before dx overwrites it. */
static void norm_bwd(bwd *b, float *dx, int acc, float *dw, const float *dy, const float *x, const float *w,
                     int64_t rows, int64_t width) {
    nb_ctx c = {dx, dy, x, w, b->rinv, width, b->m->cfg.rms_norm_eps, acc, 1};
    if (dw) {
        ds4_fwd_parallel_range(&b->f, rows, nb_range, &c);
        nw_ctx cw = {dw, dy, x, b->rinv, rows, width};
        ds4_fwd_parallel_range(&b->f, width, nw_range, &cw);
    }
    c.rinv_only = 0;
    ds4_fwd_parallel_range(&b->f, rows, nb_range, &c);
}

/* RoPE is an orthogonal rotation: its backward is the rotation by the opposite angle. */
static void rope_bwd(bwd *b, float *dx, int64_t heads, int64_t width, const rope_tab *rt, int fwd_sign) {
    ds4_fwd_rope_rows(&b->f, dx, heads, width, rt, -fwd_sign);
}

/* ------------------------------------------------------------------------------------------------ mHC */

typedef struct {
    const ds4_hc_w *w;
    const float *X;    /* [T, n, D] site input */
    const float *du;   /* [T, D] gradient of the collapsed input */
    float *dX;         /* [T, n, D] accumulated */
} hcb_ctx;

/* Recompute one site's coefficients with a Sinkhorn tape and back-propagate dpre (from du), dpost, dcomb to
 * the mix logits; also dX += pre_i · du (the collapse itself). Per token; weight-side sums come later. */
static void hcb_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const hcb_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D, mix = (2 + n) * n, it = c->hc_sinkhorn_iters;
    const double hc_eps = c->hc_eps;
    const float *base = cx->w->base, *sc = cx->w->scale;
    double *tape = bw->sk + task * bw->sk_stride; /* (2·iters) states of n·n, then the softmax P */
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * nD, *du = cx->du + t * D;
        float *xn = bw->xn + t * nD, *mixv = bw->dmix + t * mix; /* dmix holds mix first, then its gradient */
        ds4_rmsnorm_rows(xn, x, NULL, 1, nD, c->rms_norm_eps);
        for (int64_t j = 0; j < mix; j++) mixv[j] = ds4_dot(cx->w->fn + j * nD, xn, nD);
        float *dzb = bw->dzb + t * mix, *dzs = bw->dzs + t * 3;
        dzs[0] = dzs[1] = dzs[2] = 0;
        /* pre = σ(z)+eps, z = mix·s0 + b: the collapse gradient dpre_i = <du, X_i> */
        for (int64_t i = 0; i < n; i++) {
            const float sg = sigmoidf(mixv[i] * sc[0] + base[i]);
            ds4_axpy(cx->dX + t * nD + i * D, sg + (float)hc_eps, du, D);
            const float dz = ds4_dot(du, x + i * D, D) * sg * (1.0f - sg);
            dzb[i] = dz;
            dzs[0] += dz * mixv[i];
        }
        for (int64_t i = 0; i < n; i++) {
            const float sg = sigmoidf(mixv[n + i] * sc[1] + base[n + i]);
            const float dz = bw->dpost[t * n + i] * 2.0f * sg * (1.0f - sg);
            dzb[n + i] = dz;
            dzs[1] += dz * mixv[n + i];
        }
        /* Sinkhorn forward again, keeping its states */
        double M[64 * 64];
        ds4_hc_sinkhorn(c, mixv + 2 * n, sc[2], base + 2 * n, M, tape);
        const double *P = tape + 2 * it * n * n;
        const int64_t ns = 2 * it; /* states 0 .. 2·iters − 1 */
        /* backward through the normalisations: y = x / (Σ x + eps) along an axis */
        double g[64 * 64], gx[64 * 64];
        for (int64_t i = 0; i < n * n; i++) g[i] = bw->dcomb[t * n * n + i];
        for (int64_t s = ns - 1; s >= 1; s--) {
            const double *x0 = tape + (s - 1) * n * n;
            const int col = s % 2 == 1;
            for (int64_t a = 0; a < n; a++) {
                double sum = 0, gs = 0;
                for (int64_t q = 0; q < n; q++) {
                    const int64_t ix = col ? q * n + a : a * n + q;
                    sum += x0[ix];
                    gs += g[ix] * x0[ix];
                }
                const double cden = sum + hc_eps;
                for (int64_t q = 0; q < n; q++) {
                    const int64_t ix = col ? q * n + a : a * n + q;
                    gx[ix] = g[ix] / cden - gs / (cden * cden);
                }
            }
            memcpy(g, gx, (size_t)(n * n) * sizeof(double));
        }
        /* softmax rows (the +eps passes the gradient through) */
        for (int64_t j = 0; j < n; j++) {
            double dot = 0;
            for (int64_t k = 0; k < n; k++) dot += P[j * n + k] * g[j * n + k];
            for (int64_t k = 0; k < n; k++) {
                const float dz = (float)(P[j * n + k] * (g[j * n + k] - dot));
                dzb[2 * n + j * n + k] = dz;
                dzs[2] += dz * mixv[2 * n + j * n + k];
            }
        }
        for (int64_t i = 0; i < mix; i++) mixv[i] = dzb[i] * sc[i < n ? 0 : (i < 2 * n ? 1 : 2)];
    }
}

/* Backward of one mHC site given du (gradient of its collapsed input) and bw->dpost / bw->dcomb; adds into
 * dX and the site's weight gradients. */
static void hc_site_bwd(bwd *b, const ds4_hc_w *w, const float *X, const float *du, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, n = c->hc_mult, nD = n * c->hidden_size, mix = (2 + n) * n;
    hcb_ctx cx = {w, X, du, dX};
    ds4_fwd_parallel_range(&b->f, T, hcb_range, &cx);
    /* mix = fn · x̂: dfn += dmixᵀ x̂, dx̂ = dmix · fn, then through the RMS over n·D */
    lin_bwd(b, b->dxn, nD, 0, GRAD(b, w->fn), b->dmix, mix, b->xn, nD, w->fn, T, nD, mix);
    norm_bwd(b, dX, 1, NULL, b->dxn, X, NULL, T, nD);
    float *gb = GRAD(b, w->base), *gs = GRAD(b, w->scale);
    for (int64_t t = 0; t < T; t++) { /* token order: deterministic */
        for (int64_t i = 0; i < mix; i++) gb[i] += b->dzb[t * mix + i];
        for (int64_t i = 0; i < 3; i++) gs[i] += b->dzs[t * 3 + i];
    }
}

typedef struct {
    const float *dXo, *a, *X;
    float *dX;         /* written */
    const ds4_hc_w *w;
} hpb_ctx;

/* X'[k] = post_k·a + Σ_j comb[j][k]·X[j]: da, dpost, dcomb and dX (per token). The coefficients are
 * recomputed from X exactly as the forward did. */
static void hpb_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const hpb_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t n = c->hc_mult, D = c->hidden_size, nD = n * D, mix = (2 + n) * n;
    float *xn = f->scratch + task * f->scratch_stride;
    const float *base = cx->w->base, *sc = cx->w->scale;
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * nD, *dxo = cx->dXo + t * nD, *a = cx->a + t * D;
        float mixv[64 * 64 + 128];
        double M[64 * 64];
        ds4_rmsnorm_rows(xn, x, NULL, 1, nD, c->rms_norm_eps);
        for (int64_t j = 2 * n; j < mix; j++) mixv[j] = ds4_dot(cx->w->fn + j * nD, xn, nD);
        for (int64_t i = 0; i < n; i++)
            mixv[n + i] = ds4_dot(cx->w->fn + (n + i) * nD, xn, nD);
        ds4_hc_sinkhorn(c, mixv + 2 * n, sc[2], base + 2 * n, M, NULL);
        float *da = bw->da + t * D, *dX = cx->dX + t * nD;
        memset(da, 0, (size_t)D * sizeof(float));
        for (int64_t k = 0; k < n; k++) {
            const float post = 2.0f * sigmoidf(mixv[n + k] * sc[1] + base[n + k]);
            ds4_axpy(da, post, dxo + k * D, D);
            bw->dpost[t * n + k] = ds4_dot(dxo + k * D, a, D);
        }
        for (int64_t j = 0; j < n; j++) {
            float *dxj = dX + j * D;
            memset(dxj, 0, (size_t)D * sizeof(float));
            for (int64_t k = 0; k < n; k++) {
                bw->dcomb[t * n * n + j * n + k] = ds4_dot(dxo + k * D, x + j * D, D);
                ds4_axpy(dxj, (float)M[j * n + k], dxo + k * D, D);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ attention */

/* The key list of query t, in the forward's order: window keys, then compressed entries. */
static int64_t key_list(bwd *b, const ds4_layer_w *l, const ds4_layer_tape *lt, int64_t t, const float **keys) {
    const ds4_config *c = &b->m->cfg;
    const int64_t S = b->f.S, d = c->head_dim, row = t / S, s = t % S, win = c->sliding_window;
    const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
    int64_t nk = 0;
    for (int64_t j = j0; j <= s; j++) keys[nk++] = lt->kv + (row * S + j) * d;
    if (l->type == DS4_ATTN_HCA) {
        int64_t valid = (s + 1) / c->compress_rate_hca;
        if (valid > lt->nwin) valid = lt->nwin;
        for (int64_t w = 0; w < valid; w++) keys[nk++] = lt->cK + (row * S + w) * d;
    } else if (l->type == DS4_ATTN_CSA) {
        const int64_t stride = c->index_topk < S ? c->index_topk : S;
        for (int64_t i = 0; i < lt->nsel[t]; i++) keys[nk++] = lt->cK + (row * S + lt->sel[t * (stride ? stride : 1) + i]) * d;
    }
    return nk;
}

typedef struct {
    const ds4_layer_w *l;
    const ds4_layer_tape *lt;
} ab_ctx;

/* Phase A, per query: probabilities P, logit gradients DS (scale folded in), dq and the sink gradient. */
static void attn_q_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const ab_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t H = c->num_attention_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const float **keys = (const float **)(void *)(f->scratch + task * f->scratch_stride + f->key_off);
    for (int64_t t = b; t < e; t++) {
        const int64_t nk = key_list(bw, cx->l, cx->lt, t, keys);
        for (int64_t h = 0; h < H; h++) {
            const float *q = cx->lt->q + (t * H + h) * d, *dout = bw->do_ + (t * H + h) * d;
            float *P = bw->P + (t * H + h) * bw->maxk, *DS = bw->DS + (t * H + h) * bw->maxk;
            const float sink = cx->l->sink[h];
            float mx = sink;
            for (int64_t k = 0; k < nk; k++) {
                P[k] = ds4_dot(q, keys[k], d) * scale;
                mx = P[k] > mx ? P[k] : mx;
            }
            double den = exp((double)(sink - mx));
            const double psink_num = den;
            for (int64_t k = 0; k < nk; k++) den += (P[k] = (float)exp((double)(P[k] - mx)));
            double pdp = 0;
            for (int64_t k = 0; k < nk; k++) {
                P[k] = (float)(P[k] / den);
                DS[k] = ds4_dot(dout, keys[k], d); /* dp_k: the value is the key */
                pdp += (double)P[k] * DS[k];
            }
            bw->dsink_t[t * H + h] = (float)(-(psink_num / den) * pdp);
            float *dq = bw->dq + (t * H + h) * d;
            memset(dq, 0, (size_t)d * sizeof(float));
            for (int64_t k = 0; k < nk; k++) {
                DS[k] = (float)(P[k] * (DS[k] - pdp)) * scale;
                ds4_axpy(dq, DS[k], keys[k], d);
            }
        }
    }
}

/* dkey += Σ_h (DS·q + P·dout) for the query t at key-list position kidx */
static void key_grad_from(bwd *bw, const ds4_layer_tape *lt, int64_t t, int64_t kidx, float *dk) {
    const ds4_config *c = &bw->m->cfg;
    const int64_t H = c->num_attention_heads, d = c->head_dim;
    for (int64_t h = 0; h < H; h++) {
        const int64_t o = (t * H + h) * bw->maxk + kidx;
        ds4_axpy(dk, bw->DS[o], lt->q + (t * H + h) * d, d);
        ds4_axpy(dk, bw->P[o], bw->do_ + (t * H + h) * d, d);
    }
}

/* Phase B1, per window key (token j): the queries j .. j+win-1 of its row. */
static void attn_kv_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const ab_ctx *cx = p;
    const int64_t S = f->S, win = f->c->sliding_window, d = f->c->head_dim;
    for (int64_t tk = b; tk < e; tk++) {
        const int64_t row = tk / S, j = tk % S;
        float *dk = bw->dkv + tk * d;
        memset(dk, 0, (size_t)d * sizeof(float));
        for (int64_t s = j; s < S && s < j + win; s++) {
            const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
            key_grad_from(bw, cx->lt, row * S + s, j - j0, dk);
        }
    }
}

/* Phase B2, per compressed entry (row, w): HCA queries s with w < floor((s+1)/m); CSA the queries that picked
 * it (inverse lists). */
static void attn_entry_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const ab_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t S = f->S, win = c->sliding_window, d = c->head_dim, nwin = cx->lt->nwin;
    for (int64_t i = b; i < e; i++) {
        const int64_t row = i / nwin, w = i % nwin;
        float *dk = bw->dK + (row * S + w) * d;
        memset(dk, 0, (size_t)d * sizeof(float));
        if (cx->l->type == DS4_ATTN_HCA) {
            const int64_t m = c->compress_rate_hca;
            for (int64_t s = (w + 1) * m - 1; s < S; s++) {
                const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
                key_grad_from(bw, cx->lt, row * S + s, (s - j0 + 1) + w, dk);
            }
        } else {
            for (int64_t q = bw->inv_off[row * S + w]; q < bw->inv_off[row * S + w + 1]; q++) {
                const int64_t t = bw->inv_t[q], s = t % S;
                const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
                key_grad_from(bw, cx->lt, t, (s - j0 + 1) + bw->inv_i[q], dk);
            }
        }
    }
}

typedef struct {
    const ds4_compressor_w *w;
    const float *C, *Z;  /* tape projections [T, width] */
    int64_t nwin;
    int overlap;
} cb_ctx;

/* Pooling backward per channel ch < dd (a task owns channel ch of every entry, its two source channels of
 * C/Z and its ape columns, so nothing races): α = softmax over the slots, pooled = Σ α·kv. */
static void comp_bwd_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const cb_ctx *cx = p;
    const ds4_compressor_w *w = cx->w;
    const int64_t m = w->rate, dd = w->dd, width = w->width, S = f->S;
    float *gape = GRAD(bw, w->ape);
    for (int64_t ch = b; ch < e; ch++)
        for (int64_t row = 0; row < f->B; row++)
            for (int64_t win = 0; win < cx->nwin; win++) {
                float gl[512], kv[512];
                int64_t tok[512], colv[512], jv[512], ns = 0;
                if (cx->overlap && win > 0)
                    for (int64_t j = 0; j < m; j++) {
                        tok[ns] = row * S + (win - 1) * m + j, colv[ns] = ch, jv[ns] = j;
                        gl[ns] = cx->Z[tok[ns] * width + ch] + w->ape[j * width + ch];
                        kv[ns] = cx->C[tok[ns] * width + ch];
                        ns++;
                    }
                const int64_t off = cx->overlap ? dd : 0;
                for (int64_t j = 0; j < m; j++) {
                    tok[ns] = row * S + win * m + j, colv[ns] = off + ch, jv[ns] = j;
                    gl[ns] = cx->Z[tok[ns] * width + off + ch] + w->ape[j * width + off + ch];
                    kv[ns] = cx->C[tok[ns] * width + off + ch];
                    ns++;
                }
                float mx = -INFINITY;
                for (int64_t k = 0; k < ns; k++) mx = gl[k] > mx ? gl[k] : mx;
                double den = 0;
                for (int64_t k = 0; k < ns; k++) den += (gl[k] = (float)exp((double)(gl[k] - mx)));
                const float dp = bw->dpool[(row * S + win) * dd + ch];
                double adot = 0;
                for (int64_t k = 0; k < ns; k++) {
                    gl[k] = (float)(gl[k] / den); /* α */
                    adot += (double)gl[k] * dp * kv[k];
                }
                for (int64_t k = 0; k < ns; k++) {
                    const float dg = (float)(gl[k] * ((double)dp * kv[k] - adot));
                    bw->dC[tok[k] * width + colv[k]] = gl[k] * dp;
                    bw->dZ[tok[k] * width + colv[k]] = dg;
                    gape[jv[k] * width + colv[k]] += dg;
                }
            }
}

/* Compressor backward from bw->dK (entry gradients): through RoPE, the norm and the pooling into its
 * projections (C, Z, pool: what the forward kept); adds to bw->dh unless the input is detached (want_dh 0). */
static void comp_bwd(bwd *b, const ds4_compressor_w *w, const ds4_layer_tape *lt, const float *C, const float *Z,
                     const float *pool, int overlap, int want_dh) {
    const ds4_config *c = &b->m->cfg;
    const int64_t S = b->f.S, B = b->f.B, T = b->f.T, dd = w->dd, D = c->hidden_size, nwin = lt->nwin;
    for (int64_t row = 0; row < B; row++)
        for (int64_t win = 0; win < nwin; win++)
            ds4_rope_apply(b->dK + (row * S + win) * dd, dd, b->f.rcomp.half, rope_at(&b->f.rcomp, win * w->rate), -1);
    /* norm over the complete entries only: rows (row, win < nwin) */
    for (int64_t row = 0; row < B; row++)
        norm_bwd(b, b->dpool + row * S * dd, 0, GRAD(b, w->norm), b->dK + row * S * dd, pool + row * S * dd,
                 w->norm, nwin, dd);
    memset(b->dC, 0, (size_t)(T * w->width) * sizeof(float)); /* tokens of incomplete windows: no gradient */
    memset(b->dZ, 0, (size_t)(T * w->width) * sizeof(float));
    cb_ctx cx = {w, C, Z, nwin, overlap};
    ds4_fwd_parallel_range(&b->f, dd, comp_bwd_range, &cx);
    lin_bwd(b, want_dh ? b->dh : NULL, D, 1, GRAD(b, w->wkv), b->dC, w->width, lt->h_attn, D, w->wkv, T, D, w->width);
    lin_bwd(b, want_dh ? b->dh : NULL, D, 1, GRAD(b, w->wgate), b->dZ, w->width, lt->h_attn, D, w->wgate, T, D,
            w->width);
}

typedef struct {
    const ds4_layer_tape *lt;
} ikb_ctx;

/* Indexer KL backward, per query: I_i = Σ_h ω_h·relu(q_h·K_i)·c^-1/2 over the picks i. dω and dq stay with the
 * query; the per-pick dscore·ω·[q·K > 0]·c^-1/2 goes to dsi for the per-entry gather. */
static void ikb_q_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const ds4_layer_tape *lt = ((const ikb_ctx *)p)->lt;
    const ds4_config *c = f->c;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim, S = f->S, sel = bw->tp->sel_stride;
    const float qscale = 1.0f / sqrtf((float)cI);
    for (int64_t t = b; t < e; t++) {
        const int64_t row = t / S;
        memset(bw->diq + t * nI * cI, 0, (size_t)(nI * cI) * sizeof(float));
        for (int64_t h = 0; h < nI; h++) {
            const float *q = lt->iq + (t * nI + h) * cI;
            float dw = 0;
            for (int64_t i = 0; i < lt->nsel[t]; i++) {
                const float *key = lt->iK + (row * S + lt->sel[t * sel + i]) * cI;
                const float dot = ds4_dot(q, key, cI), g = bw->dI[t * sel + i];
                dw += g * (dot > 0 ? dot * qscale : 0.0f);
                const float ds = dot > 0 ? g * lt->iw[t * nI + h] * qscale : 0.0f;
                bw->dsi[(t * nI + h) * sel + i] = ds;
                if (ds != 0) ds4_axpy(bw->diq + (t * nI + h) * cI, ds, key, cI);
            }
            bw->diw[t * nI + h] = dw;
        }
    }
}

/* Per indexer entry: dK_w = Σ over the queries that picked it (inverse lists) of Σ_h dsi · q_h. */
static void ikb_k_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const ds4_layer_tape *lt = ((const ikb_ctx *)p)->lt;
    const ds4_config *c = f->c;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim, S = f->S, sel = bw->tp->sel_stride;
    for (int64_t x = b; x < e; x++) {
        const int64_t row = x / lt->nwin, w = x % lt->nwin;
        float *dk = bw->dK + (row * S + w) * cI;
        memset(dk, 0, (size_t)cI * sizeof(float));
        for (int64_t q = bw->inv_off[row * S + w]; q < bw->inv_off[row * S + w + 1]; q++) {
            const int64_t t = bw->inv_t[q], i = bw->inv_i[q];
            for (int64_t h = 0; h < nI; h++) ds4_axpy(dk, bw->dsi[(t * nI + h) * sel + i], lt->iq + (t * nI + h) * cI, cI);
        }
    }
}

/* The indexer KL loss's backward for one CSA layer (after the attention backward built the inverse pick lists):
 * into the indexer's wq_b, weights_proj and compressor only; its inputs (q_residual, h) are detached. */
static void indexer_kl_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, nI = c->index_n_heads, cI = c->index_head_dim, qr = c->q_lora_rank, D = c->hidden_size;
    int64_t nq = 0;
    ds4_ikl_eval(c, lt, T, b->f.S, b->tp->sel_stride, b->dI, b->m->topt.indexer_kl, &nq);
    if (nq == 0) return;
    ikb_ctx cx = {lt};
    ds4_fwd_parallel_range(&b->f, T, ikb_q_range, &cx);
    ds4_fwd_parallel_range(&b->f, b->f.B * lt->nwin, ikb_k_range, &cx);
    rope_bwd(b, b->diq, nI, cI, &b->f.rcomp, 1);
    lin_bwd(b, NULL, qr, 0, GRAD(b, l->idx_wq_b), b->diq, nI * cI, lt->qr, qr, l->idx_wq_b, T, qr, nI * cI);
    const float ws = 1.0f / sqrtf((float)nI); /* ω = weights_proj(h) · n_I^-1/2 */
    for (int64_t i = 0; i < T * nI; i++) b->diw[i] *= ws;
    lin_bwd(b, NULL, D, 0, GRAD(b, l->idx_weights), b->diw, nI, lt->h_attn, D, l->idx_weights, T, D, nI);
    comp_bwd(b, &l->idx_comp, lt, lt->iC, lt->iZ, lt->ipool, 1, 0);
}

/* Attention sub-layer backward: bw->da (gradient of its output) → bw->dh (gradient of h_attn, written). */
static void attention_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, S = b->f.S, D = c->hidden_size, H = c->num_attention_heads, d = c->head_dim;
    const int64_t qr = c->q_lora_rank, G = c->o_groups, ol = c->o_lora_rank, gw = H * d / G;
    const rope_tab *rt = l->type == DS4_ATTN_SLIDING ? &b->f.rmain : &b->f.rcomp;
    lin_bwd(b, b->dy, G * ol, 0, GRAD(b, l->wo_b), b->da, D, lt->y, G * ol, l->wo_b, T, G * ol, D);
    for (int64_t g = 0; g < G; g++)
        lin_bwd(b, b->do_ + g * gw, H * d, 0, GRAD(b, l->wo_a + g * ol * gw), b->dy + g * ol, G * ol, lt->o + g * gw, H * d,
                l->wo_a + g * ol * gw, T, gw, ol);
    rope_bwd(b, b->do_, H, d, rt, -1); /* the output was de-rotated */
    ab_ctx ax = {l, lt};
    ds4_fwd_parallel_range(&b->f, T, attn_q_range, &ax);
    ds4_fwd_parallel_range(&b->f, T, attn_kv_range, &ax);
    float *gs = GRAD(b, l->sink);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) gs[h] += b->dsink_t[t * H + h];
    memset(b->dh, 0, (size_t)(T * D) * sizeof(float));
    if (l->type != DS4_ATTN_SLIDING && lt->nwin > 0) {
        if (l->type == DS4_ATTN_CSA) { /* inverse of the indexer picks: (query, position) per entry */
            const int64_t stride = c->index_topk < S ? c->index_topk : S;
            memset(b->inv_off, 0, (size_t)(b->f.B * S + 1) * sizeof(int64_t));
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < lt->nsel[t]; i++) b->inv_off[(t / S) * S + lt->sel[t * stride + i] + 1]++;
            for (int64_t x = 0; x < b->f.B * S; x++) b->inv_off[x + 1] += b->inv_off[x];
            for (int64_t t = 0; t < T; t++) /* t ascending: each list is in query order */
                for (int64_t i = 0; i < lt->nsel[t]; i++) {
                    const int64_t slot = b->inv_off[(t / S) * S + lt->sel[t * stride + i]]++;
                    b->inv_t[slot] = (int32_t)t;
                    b->inv_i[slot] = (int32_t)i;
                }
            for (int64_t x = b->f.B * S; x > 0; x--) b->inv_off[x] = b->inv_off[x - 1];
            b->inv_off[0] = 0;
        }
        ds4_fwd_parallel_range(&b->f, b->f.B * lt->nwin, attn_entry_range, &ax);
        comp_bwd(b, &l->comp, lt, lt->cC, lt->cZ, lt->pool, l->type == DS4_ATTN_CSA, 1);
        if (l->type == DS4_ATTN_CSA && lt->iq) indexer_kl_bwd(b, l, lt);
    }
    /* window keys: RoPE, kv_norm, wkv */
    rope_bwd(b, b->dkv, 1, d, rt, 1);
    norm_bwd(b, b->dkv, 0, GRAD(b, l->kv_norm), b->dkv, lt->kv_pre, l->kv_norm, T, d);
    lin_bwd(b, b->dh, D, 1, GRAD(b, l->wkv), b->dkv, d, lt->h_attn, D, l->wkv, T, D, d);
    /* queries: RoPE, per-head RMS, wq_b, q_norm, wq_a */
    rope_bwd(b, b->dq, H, d, rt, 1);
    norm_bwd(b, b->dq, 0, NULL, b->dq, lt->q_pre, NULL, T * H, d);
    lin_bwd(b, b->dqa, qr, 0, GRAD(b, l->wq_b), b->dq, H * d, lt->qr, qr, l->wq_b, T, qr, H * d);
    norm_bwd(b, b->dqa, 0, GRAD(b, l->q_norm), b->dqa, lt->qa, l->q_norm, T, qr);
    lin_bwd(b, b->dh, D, 1, GRAD(b, l->wq_a), b->dqa, qr, lt->h_attn, D, l->wq_a, T, D, qr);
}

/* ------------------------------------------------------------------------------------------------ MoE */

typedef struct {
    const float *g1, *g3, *dact;
    float *act, *dg1, *dg3;
    int64_t I;
    float lim;
    int grads;  /* 0: compute act only; 1: dg1/dg3 from dact */
} sg_ctx;

/* SwiGLU with clamps: act = silu(min(g1, λ)) · clamp(g3, ±λ); torch's clamp passes the gradient where the
 * input lies inside [min, max] (boundaries included). */
static void sg_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const sg_ctx *c = p;
    for (int64_t i = b * c->I; i < e * c->I; i++) {
        const float g = c->g1[i] > c->lim ? c->lim : c->g1[i];
        const float u = c->g3[i] < -c->lim ? -c->lim : (c->g3[i] > c->lim ? c->lim : c->g3[i]);
        const float sgm = sigmoidf(g), silu = g * sgm;
        if (!c->grads) {
            c->act[i] = ds4_silu(g) * u;
            continue;
        }
        const float dsilu = sgm * (1.0f + g * (1.0f - sgm));
        c->dg1[i] = c->g1[i] <= c->lim ? c->dact[i] * u * dsilu : 0.0f;
        c->dg3[i] = (c->g3[i] >= -c->lim && c->g3[i] <= c->lim) ? c->dact[i] * silu : 0.0f;
    }
}

/* Backward of out = W2·act(x W1ᵀ, x W3ᵀ) over `rows` rows: dx written (row stride D), weight grads added. */
static void swiglu_bwd(bwd *b, float *dx, const float *dy, const float *x, const float *g1, const float *g3,
                       const float *w1, const float *w3, const float *w2, int64_t rows) {
    const ds4_config *c = &b->m->cfg;
    const int64_t D = c->hidden_size, I = c->moe_intermediate_size;
    sg_ctx s = {g1, g3, NULL, b->act, NULL, NULL, I, (float)c->swiglu_limit, 0};
    ds4_fwd_parallel_range(&b->f, rows, sg_range, &s);
    lin_bwd(b, b->dact, I, 0, GRAD(b, w2), dy, D, b->act, I, w2, rows, I, D);
    /* act is no longer needed: dg1 goes there; dg3 overwrites dact element by element, each element read
     * (for both) before it is written */
    sg_ctx s2 = {g1, g3, b->dact, NULL, b->act, b->dact, I, (float)c->swiglu_limit, 1};
    ds4_fwd_parallel_range(&b->f, rows, sg_range, &s2);
    lin_bwd(b, dx, D, 0, GRAD(b, w1), b->act, I, x, D, w1, rows, D, I);
    lin_bwd(b, dx, D, 1, GRAD(b, w3), b->dact, I, x, D, w3, rows, D, I);
}

/* MoE backward: bw->da (gradient of routed + shared output) → bw->dh (written). */
static void moe_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_tape *lt) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, E = c->n_routed_experts, K = c->num_experts_per_tok;
    const int64_t I = c->moe_intermediate_size;
    const float rsf = (float)c->routed_scaling_factor;
    swiglu_bwd(b, b->dh, b->da, lt->h_ffn, lt->sg1, lt->sg3, l->sw1, l->sw3, l->sw2, T);
    /* routed: d(weight) = <da, y_slot>, dy_slot = weight · da */
    for (int64_t slot = 0; slot < T * K; slot++) b->dws[slot] = ds4_dot(b->da + (slot / K) * D, lt->ye + slot * D, D);
    memset(b->ecount, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < T * K; i++) b->ecount[lt->eidx[i] + 1]++;
    for (int64_t x = 0; x < E; x++) b->ecount[x + 1] += b->ecount[x];
    for (int64_t i = 0; i < T * K; i++) b->perm[b->ecount[lt->eidx[i]]++] = (int32_t)i;
    for (int64_t x = E; x > 0; x--) b->ecount[x] = b->ecount[x - 1];
    b->ecount[0] = 0;
    for (int64_t x = 0; x < E; x++) {
        const int64_t o = b->ecount[x], n = b->ecount[x + 1] - o;
        if (n == 0) continue;
        for (int64_t r = 0; r < n; r++) {
            const int64_t slot = b->perm[o + r];
            memcpy(b->xs + r * D, lt->h_ffn + (slot / K) * D, (size_t)D * sizeof(float));
            memcpy(b->g1s + r * I, lt->eg1 + slot * I, (size_t)I * sizeof(float));
            memcpy(b->g3s + r * I, lt->eg3 + slot * I, (size_t)I * sizeof(float));
            float *dy = b->dys + r * D;
            memset(dy, 0, (size_t)D * sizeof(float));
            ds4_axpy(dy, lt->ew[slot], b->da + (slot / K) * D, D);
        }
        swiglu_bwd(b, b->dxs, b->dys, b->xs, b->g1s, b->g3s, l->w1 + x * I * D, l->w3 + x * I * D,
                   l->w2 + x * D * I, n);
        /* dxs rows are in expert order: file them by slot */
        for (int64_t r = 0; r < n; r++)
            memcpy(b->dxslot + (int64_t)b->perm[o + r] * D, b->dxs + r * D, (size_t)D * sizeof(float));
    }
    for (int64_t t = 0; t < T; t++) /* slot order: deterministic */
        for (int64_t k = 0; k < K; k++) ds4_axpy(b->dh + t * D, 1.0f, b->dxslot + (t * K + k) * D, D);
    /* router: w_k = rsf·s_k / (Σ s + 1e-20) on the gathered scores; the correction bias only selected */
    memset(b->dsc, 0, (size_t)(T * E) * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        const int32_t *idx = lt->eidx + t * K;
        const float *s = lt->rsc + t * E;
        float sum = 0, wdot = 0;
        for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
        sum += 1e-20f;
        for (int64_t k = 0; k < K; k++) wdot += b->dws[t * K + k] * s[idx[k]];
        for (int64_t k = 0; k < K; k++)
            b->dsc[t * E + idx[k]] += rsf * (b->dws[t * K + k] / sum - wdot / (sum * sum));
    }
    for (int64_t t = 0; t < T; t++) {
        const float *x = lt->rlog + t * E, *s = lt->rsc + t * E, *ds = b->dsc + t * E;
        float *dl = b->dlog + t * E;
        if (c->scoring_func == DS4_SCORE_SOFTMAX) {
            double dot = 0;
            for (int64_t e = 0; e < E; e++) dot += (double)s[e] * ds[e];
            for (int64_t e = 0; e < E; e++) dl[e] = (float)(s[e] * (ds[e] - dot));
        } else if (c->scoring_func == DS4_SCORE_SIGMOID) {
            for (int64_t e = 0; e < E; e++) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
        } else {
            /* d sqrt(softplus(x)) = σ(x) / (2 sqrt(softplus(x))); where softplus underflows, the limit
             * e^{x/2}/2 (spec §10.3) instead of 0/0. Torch's softplus returns x above 20 (gradient 1). */
            for (int64_t e = 0; e < E; e++) {
                if (ds[e] == 0.0f) {
                    dl[e] = 0;
                    continue;
                }
                double der;
                if (x[e] > 20.0f) der = 0.5 / s[e];
                else if (s[e] > 0) der = (1.0 / (1.0 + exp(-(double)x[e]))) / (2.0 * s[e]);
                else der = 0.5 * exp(0.5 * (double)x[e]);
                dl[e] = (float)(ds[e] * der);
            }
        }
    }
    lin_bwd(b, b->dh, D, 1, GRAD(b, l->gate), b->dlog, E, lt->h_ffn, D, l->gate, T, D, E);
}

/* ------------------------------------------------------------------------------------------------ block */

/* One block backward: dX holds the gradient of the block output on entry, of its input on return. */
static void block_bwd(bwd *b, const ds4_layer_w *l, const ds4_layer_tape *lt, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size;
    /* ffn site: X = post ⊗ a_ffn + combᵀ X_mid */
    hpb_ctx pf = {dX, lt->a_ffn, lt->X_mid, b->dXt, &l->hc_ffn};
    ds4_fwd_parallel_range(&b->f, T, hpb_range, &pf);
    moe_bwd(b, l, lt);
    norm_bwd(b, b->du, 0, GRAD(b, l->ffn_norm), b->dh, lt->u_ffn, l->ffn_norm, T, D);
    hc_site_bwd(b, &l->hc_ffn, lt->X_mid, b->du, b->dXt);
    /* attention site: X_mid = post ⊗ a_attn + combᵀ X_in */
    hpb_ctx pa = {b->dXt, lt->a_attn, lt->X_in, dX, &l->hc_attn};
    ds4_fwd_parallel_range(&b->f, T, hpb_range, &pa);
    attention_bwd(b, l, lt);
    norm_bwd(b, b->du, 0, GRAD(b, l->attn_norm), b->dh, lt->u_attn, l->attn_norm, T, D);
    hc_site_bwd(b, &l->hc_attn, lt->X_in, b->du, dX);
}

typedef struct {
    const float *X, *fn, *base, *scale, *du;
    float *dX;
} hhb_ctx;

/* HyperHead backward per token: y = Σ p_i X_i, p = σ(s·(W x̂) + b) + eps. Writes dX, dmix (in bw->dmix, width n)
 * and per-token base/scale parts (bw->dzb width n, bw->dzs[0]). */
static void hhb_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    bwd *bw = (bwd *)f;
    const hhb_ctx *cx = p;
    const int64_t n = f->c->hc_mult, D = f->c->hidden_size, nD = n * D;
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * nD, *du = cx->du + t * D;
        float *xn = bw->xn + t * nD, *dm = bw->dmix + t * n, *dzb = bw->dzb + t * n;
        ds4_rmsnorm_rows(xn, x, NULL, 1, nD, f->c->rms_norm_eps);
        bw->dzs[t * 3] = 0;
        for (int64_t i = 0; i < n; i++) {
            const float mix = ds4_dot(cx->fn + i * nD, xn, nD);
            const float sg = sigmoidf(mix * cx->scale[0] + cx->base[i]);
            float *dx = cx->dX + t * nD + i * D;
            memset(dx, 0, (size_t)D * sizeof(float));
            ds4_axpy(dx, sg + (float)f->c->hc_eps, du, D);
            const float dz = ds4_dot(du, x + i * D, D) * sg * (1.0f - sg);
            dzb[i] = dz;
            bw->dzs[t * 3] += dz * mix;
            dm[i] = dz * cx->scale[0];
        }
    }
}

static void hyperhead_bwd(bwd *b, const float *X, const float *fn, const float *base, const float *scale,
                          const float *du, float *dX) {
    const int64_t T = b->f.T, n = b->m->cfg.hc_mult, nD = n * b->m->cfg.hidden_size;
    hhb_ctx cx = {X, fn, base, scale, du, dX};
    ds4_fwd_parallel_range(&b->f, T, hhb_range, &cx);
    lin_bwd(b, b->dxn, nD, 0, GRAD(b, fn), b->dmix, n, b->xn, nD, fn, T, nD, n);
    norm_bwd(b, dX, 1, NULL, b->dxn, X, NULL, T, nD);
    float *gb = GRAD(b, base), *gs = GRAD(b, scale);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < n; i++) gb[i] += b->dzb[t * n + i];
        gs[0] += b->dzs[t * 3];
    }
}

/* dlogits of a per-token objective on log p(target): d logp_y / dz = onehot(y) − softmax(z), so
 * dz = g·(onehot − softmax) with g = dlogp[b·Sl + s] (or the constant g0 when dlogp is NULL) at scored
 * positions (labels[b, s + shift] != -100), 0 elsewhere. The cross-entropy is the case g = −scale. */
static void logp_bwd(float *dl, const float *logits, int64_t B, int64_t Sl, int64_t V, const int64_t *labels,
                     int64_t S, int64_t shift, const float *dlogp, double g0) {
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t s = 0; s < Sl; s++) {
            float *d = dl + (bb * Sl + s) * V;
            const float *z = logits + (bb * Sl + s) * V;
            const int64_t y = s + shift < S ? labels[bb * S + s + shift] : -100;
            const double g = dlogp ? (double)dlogp[bb * Sl + s] : g0;
            if (y == -100 || g == 0) {
                memset(d, 0, (size_t)V * sizeof(float));
                continue;
            }
            float mx = -INFINITY;
            for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
            double se = 0;
            for (int64_t v = 0; v < V; v++) se += exp((double)z[v] - mx);
            for (int64_t v = 0; v < V; v++) d[v] = (float)(-g * exp((double)z[v] - mx) / se);
            d[y] += (float)g;
        }
}

/* The head of a pass: logits = head(norm(HyperHead(X))) → dX (written). */
static void head_bwd(bwd *b, const float *logits, const float *u, const float *y, const float *X, const float *fn,
                     const float *base, const float *scale, const float *norm, const int64_t *labels, int64_t Sl,
                     int64_t S, int64_t shift, const float *dlogp, double g0, float *dX) {
    const ds4_config *c = &b->m->cfg;
    const int64_t T = b->f.T, D = c->hidden_size, V = c->vocab_size;
    logp_bwd(b->dlog, logits, b->f.B, Sl, V, labels, S, shift, dlogp, g0);
    lin_bwd(b, b->dh, D, 0, GRAD(b, b->m->head), b->dlog, V, y, D, b->m->head, T, D, V);
    norm_bwd(b, b->du, 0, GRAD(b, norm), b->dh, u, norm, T, D);
    hyperhead_bwd(b, X, fn, base, scale, b->du, dX);
}

/* ------------------------------------------------------------------------------------------------ entry */

static ds4_status tape_ready(ds4_model *m, const char *op, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "%s: model is NULL", op);
    if (!m->grads) return ds4_fail(err, DS4_ERR_ARG, "%s: gradients are not enabled (enable_grad)", op);
    if (!m->tape || !m->tape->valid)
        return ds4_fail(err, DS4_ERR_ARG, "%s: no training forward to differentiate (call forward_train first)", op);
    return DS4_OK;
}

ds4_status ds4_model_last_batch(const ds4_model *m, int64_t *batch, int64_t *seq, ds4_error *err) {
    if (!m || !m->tape || !m->tape->valid)
        return ds4_fail(err, DS4_ERR_ARG, "last_batch: no training forward (call forward_train first)");
    if (batch) *batch = m->tape->B;
    if (seq) *seq = m->tape->S;
    return DS4_OK;
}

ds4_status ds4_model_logprobs(ds4_model *m, float *logp, float *entropy, ds4_error *err) {
    ds4_status s = tape_ready(m, "logprobs", err);
    if (s) return s;
    const ds4_tape *tp = m->tape;
    const int64_t S = tp->S, V = m->cfg.vocab_size;
    for (int64_t t = 0; t < tp->T; t++) {
        const float *z = tp->logits + t * V;
        float mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        double se = 0, ez = 0;
        for (int64_t v = 0; v < V; v++) {
            const double e = exp((double)z[v] - mx);
            se += e;
            ez += e * ((double)z[v] - mx);
        }
        const double lse = log(se);
        const int64_t y = t % S + 1 < S ? tp->labels[t + 1] : -100;
        if (logp) logp[t] = y == -100 ? 0.0f : (float)((double)z[y] - mx - lse);
        if (entropy) entropy[t] = (float)(lse - ez / se); /* H = log Σe − E[z − mx] */
    }
    return DS4_OK;
}

static ds4_status backward_impl(ds4_model *m, const float *dlogp, double scale, ds4_error *err);

ds4_status ds4_model_backward(ds4_model *m, double scale, ds4_error *err) {
    ds4_status s = tape_ready(m, "backward", err);
    if (s) return s;
    if (!isfinite(scale)) return ds4_fail(err, DS4_ERR_ARG, "backward: scale %g is not finite", scale);
    return backward_impl(m, NULL, scale, err);
}

ds4_status ds4_model_backward_logprobs(ds4_model *m, const float *dlogp, ds4_error *err) {
    ds4_status s = tape_ready(m, "backward_logprobs", err);
    if (s) return s;
    if (!dlogp) return ds4_fail(err, DS4_ERR_ARG, "backward_logprobs: dlogp is NULL");
    for (int64_t t = 0; t < m->tape->T; t++)
        if (!isfinite(dlogp[t]))
            return ds4_fail(err, DS4_ERR_ARG, "backward_logprobs: dlogp[%lld, %lld] = %g is not finite (dlogp [%lld, %lld])",
                            (long long)(t / m->tape->S), (long long)(t % m->tape->S), (double)dlogp[t],
                            (long long)m->tape->B, (long long)m->tape->S);
    return backward_impl(m, dlogp, 0.0, err);
}

/* The CE path passes dlogp = NULL and scale; the per-token path passes dlogp (and the MTP term, when on,
 * keeps its own mean normalisation relative to the main loss: see below). */
static ds4_status backward_impl(ds4_model *m, const float *dlogp, double scale, ds4_error *err) {
    ds4_tape *tp = m->tape;
    const ds4_config *c = &m->cfg;
    bwd b;
    memset(&b, 0, sizeof b);
    ds4_status s = ds4_fwd_setup(m, &b.f, tp->B, tp->S, 0, err);
    if (s) return s;
    b.m = m;
    b.tp = tp;
    b.G = m->grads;
    ds4_arena a = {0};
    bplan(&b, &a);
    if (a.used > tp->bbytes) {
        free(tp->bmem);
        tp->bmem = malloc(a.used);
        tp->bbytes = tp->bmem ? a.used : 0;
        if (!tp->bmem)
            return ds4_fail(err, DS4_ERR_OOM, "backward: workspace of %zu bytes for ids [%lld, %lld]", a.used,
                            (long long)tp->B, (long long)tp->S);
    }
    ds4_arena w = {tp->bmem, 0};
    bplan(&b, &w);
    const int64_t B = tp->B, S = tp->S, T = tp->T, n = c->hc_mult, D = c->hidden_size, nD = n * D;
    const int64_t L = c->num_hidden_layers;

    head_bwd(&b, tp->logits, tp->u_fin, tp->y_fin, tp->X_L, m->hc_head_fn, m->hc_head_base, m->hc_head_scale, m->norm,
             tp->labels, S, S, 1, dlogp, -scale, b.dX);
    if (tp->with_mtp && tp->mtp_tokens > 0 && !dlogp) {
        /* MTP term λ·mean over its own scored tokens: per-token scale λ·scale·(main tokens / MTP tokens), which
         * is λ / mtp_tokens when scale = 1 / loss_tokens */
        const ds4_mtp_w *mt = &m->mtp;
        const int64_t S1 = S - 1, T1 = B * S1;
        const double ms = m->topt.mtp_lambda * scale * (double)tp->loss_tokens / (double)tp->mtp_tokens;
        b.f.S = S1;
        b.f.T = T1;
        /* the main gradient stays in dX; the MTP pass works in dmtp (block_bwd's scratch is dXt) */
        head_bwd(&b, tp->mtp_logits, tp->mtp_u, tp->mtp_y, tp->mtp_X, mt->hc_head_fn, mt->hc_head_base,
                 mt->hc_head_scale, mt->norm, tp->labels, S1, S, 2, NULL, -ms, b.dmtp);
        block_bwd(&b, &mt->block, &tp->layers[L], b.dmtp);
        /* z_i[k] = e_proj(enorm(e_{i+1})) + h_proj(hnorm(X^L_i[k])) */
        memset(b.du, 0, (size_t)(T1 * D) * sizeof(float));
        for (int64_t t = 0; t < T1; t++)
            for (int64_t k = 0; k < n; k++) ds4_axpy(b.du + t * D, 1.0f, b.dmtp + (t * n + k) * D, D);
        lin_bwd(&b, b.dh, D, 0, GRAD(&b, mt->e_proj), b.du, D, tp->mtp_en, D, mt->e_proj, T1, D, D);
        norm_bwd(&b, b.da, 0, GRAD(&b, mt->enorm), b.dh, tp->mtp_e, mt->enorm, T1, D);
        float *ge = GRAD(&b, m->embed);
        for (int64_t bb = 0; bb < B; bb++)
            for (int64_t i = 0; i < S1; i++) ds4_axpy(ge + tp->ids[bb * S + i + 1] * D, 1.0f, b.da + (bb * S1 + i) * D, D);
        lin_bwd(&b, b.dxn, D, 0, GRAD(&b, mt->h_proj), b.dmtp, D, tp->mtp_hn, D, mt->h_proj, T1 * n, D, D);
        /* hnorm over the rows X^L[b, i < S-1, k]: gather them, then scatter the gradient back */
        for (int64_t bb = 0; bb < B; bb++)
            memcpy(b.xn + bb * S1 * nD, tp->X_L + bb * S * nD, (size_t)(S1 * nD) * sizeof(float));
        norm_bwd(&b, b.dxn, 0, GRAD(&b, mt->hnorm), b.dxn, b.xn, mt->hnorm, T1 * n, D);
        for (int64_t bb = 0; bb < B; bb++)
            for (int64_t i = 0; i < S1 * nD; i++) b.dX[bb * S * nD + i] += b.dxn[bb * S1 * nD + i];
        b.f.S = S;
        b.f.T = T;
    }
    for (int64_t li = L - 1; li >= 0; li--) block_bwd(&b, &m->layers[li], &tp->layers[li], b.dX);
    float *ge = GRAD(&b, m->embed);
    for (int64_t t = 0; t < T; t++) /* token order: repeated ids add up deterministically */
        for (int64_t i = 0; i < n; i++) ds4_axpy(ge + tp->ids[t] * D, 1.0f, b.dX + (t * n + i) * D, D);
    tp->valid = 0;
    return DS4_OK;
}
