/* forward.c — the fp32 CPU forward pass of the whole DeepSeek-V4 architecture (spec/ds4-architecture.md).
 *
 * Token layout: T = B·S rows, row t = b·S + s; every sequence starts at absolute position 0 (compression
 * windows are aligned to position 0, so there is no left padding). Residual streams X are [T, n, D].
 * One block (Appendix A):  attn site  X → Xt,  ffn site  Xt → X.
 * All scratch memory is planned from (B, S) once per call and kept in the model while large enough, so
 * nothing is allocated per token or per layer. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kernels_cpu.h"
#include "cache.h"
#include "fwd.h"

/* ------------------------------------------------------------------------------------------------ planning */

static void plan(fwd *f, ds4_arena *a, int need_logits_ws) {
    const ds4_config *c = f->c;
    const size_t T = (size_t)f->T, S = (size_t)f->S, B = (size_t)f->B, n = (size_t)c->hc_mult, D = (size_t)c->hidden_size;
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts;
    const size_t cI = (size_t)c->index_head_dim, nI = (size_t)c->index_n_heads;
    f->sel_stride = c->index_topk < f->S ? c->index_topk : f->S;
    if (f->sel_stride < 1) f->sel_stride = 1;
    /* Per-task scratch, the largest of: mHC / HyperHead normalised streams (n·D), compressor slots (4·m),
     * indexer scores (<= S entries), attention logits (window + <= S entries) followed by as many key
     * pointers (2 floats each). */
    const int64_t mmax = c->compress_rate_csa > c->compress_rate_hca ? c->compress_rate_csa : c->compress_rate_hca;
    const int64_t nkeys = (c->sliding_window < f->S ? c->sliding_window : f->S) + f->S;
    f->key_off = (nkeys + 1) & ~(int64_t)1; /* keep the pointer array 8-byte aligned */
    int64_t stride = f->key_off + 2 * nkeys;
    if ((int64_t)(n * D) > stride) stride = (int64_t)(n * D);
    if (12 * mmax > stride) stride = 12 * mmax; /* pooling: 2m gates, 2m values, 4m row pointers */
    f->scratch_stride = (stride + 15) & ~(int64_t)15;
    f->X = ds4_arena_take(a, T * n * D, 4);
    f->Xt = ds4_arena_take(a, T * n * D, 4);
    f->Xz = ds4_arena_take(a, T * n * D, 4);
    f->pre = ds4_arena_take(a, T * n, 4);
    f->post = ds4_arena_take(a, T * n, 4);
    f->comb = ds4_arena_take(a, T * n * n, 4);
    f->u = ds4_arena_take(a, T * D, 4);
    f->h = ds4_arena_take(a, T * D, 4);
    f->a = ds4_arena_take(a, T * D, 4);
    f->qr = ds4_arena_take(a, T * (size_t)c->q_lora_rank, 4);
    f->q = ds4_arena_take(a, T * H * d, 4);
    f->o = ds4_arena_take(a, T * H * d, 4);
    f->kv = ds4_arena_take(a, T * d, 4);
    f->y = ds4_arena_take(a, T * (size_t)(c->o_groups * c->o_lora_rank), 4);
    f->cC = ds4_arena_take(a, T * 2 * d, 4);
    f->cZ = ds4_arena_take(a, T * 2 * d, 4);
    f->cK = ds4_arena_take(a, B * S * d, 4);
    f->iC = ds4_arena_take(a, T * 2 * cI, 4);
    f->iZ = ds4_arena_take(a, T * 2 * cI, 4);
    f->iK = ds4_arena_take(a, B * S * cI, 4);
    f->iq = ds4_arena_take(a, T * nI * cI, 4);
    f->iw = ds4_arena_take(a, T * nI, 4);
    f->sel = ds4_arena_take(a, T * (size_t)f->sel_stride, 4);
    f->nsel = ds4_arena_take(a, T, 4);
    f->scratch = ds4_arena_take(a, (size_t)f->ntask * (size_t)f->scratch_stride, 4);
    f->rl = ds4_arena_take(a, T * E, 4);
    f->eidx = ds4_arena_take(a, T * K, 4);
    f->ew = ds4_arena_take(a, T * K, 4);
    f->yk = ds4_arena_take(a, T * K * D, 4);
    f->xg = ds4_arena_take(a, T * K * D, 4);
    f->ye = ds4_arena_take(a, T * K * D, 4);
    f->g1 = ds4_arena_take(a, T * K * I, 4);
    f->g3 = ds4_arena_take(a, T * K * I, 4);
    f->perm = ds4_arena_take(a, T * K, 4);
    f->ecount = ds4_arena_take(a, E + 1, 8);
    f->logits_ws = need_logits_ws ? ds4_arena_take(a, T * (size_t)c->vocab_size, 4) : NULL;
    f->mtp_ids = ds4_arena_take(a, T, 8);
}

/* Copy n floats into a tape slot when training (dst NULL: inference, nothing to keep). */
static void keep(float *dst, const float *src, int64_t n) {
    if (dst) memcpy(dst, src, (size_t)n * sizeof(float));
}

/* ------------------------------------------------------------------------------------------------ RoPE */

/* Inverse frequencies exactly as transformers computes them in fp32 (default and YaRN, §3.3). */
static void rope_inv_freq(const ds4_rope_params *p, float *inv) {
    const int64_t dim = p->dim, half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)dim;
        float pos_freq = powf((float)p->theta, e);
        float extrap = 1.0f / pos_freq;
        if (p->type != DS4_ROPE_YARN) {
            inv[i] = extrap;
            continue;
        }
        float interp = 1.0f / ((float)p->factor * pos_freq);
        /* correction range in double, as Python's math module computes it */
        double twopi = 6.283185307179586;
        double lo = dim * log(p->original_max_position_embeddings / (p->beta_fast * twopi)) / (2 * log(p->theta));
        double hi = dim * log(p->original_max_position_embeddings / (p->beta_slow * twopi)) / (2 * log(p->theta));
        if (p->truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = (double)(dim - 1);
        if (lo == hi) hi += 0.001;
        float ramp = ((float)i - (float)lo) / (float)(hi - lo);
        ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
        float ef = 1.0f - ramp; /* extrapolation factor */
        inv[i] = interp * (1.0f - ef) + extrap * ef;
    }
}

static void rope_table(float *cs, const ds4_rope_params *p, int64_t from, int64_t to) {
    const int64_t half = p->dim / 2;
    float inv[1024];
    rope_inv_freq(p, inv);
    const double scale = p->type == DS4_ROPE_YARN ? p->attention_factor : 1.0;
    for (int64_t s = from; s < to; s++)
        for (int64_t i = 0; i < half; i++) {
            float ang = inv[i] * (float)s; /* fp32 product, as HF's inv_freq @ position_ids */
            cs[s * 2 * half + 2 * i] = (float)(cos((double)ang) * scale);
            cs[s * 2 * half + 2 * i + 1] = (float)(sin((double)ang) * scale);
        }
}

/* The model's RoPE tables cover positions [0, S) afterwards (grown geometrically: decoding asks for one more
 * position per step). */
static ds4_status rope_reserve(ds4_model *m, int64_t S, ds4_error *err) {
    if (S <= m->rope_n) return DS4_OK;
    int64_t n = m->rope_n * 2 > S ? m->rope_n * 2 : S;
    if (n < 256) n = 256;
    const ds4_rope_params *p[2] = {&m->cfg.rope_main, &m->cfg.rope_compress};
    for (int k = 0; k < 2; k++) {
        float *cs = realloc(m->rope_cs[k], (size_t)(n * p[k]->dim) * sizeof(float));
        if (!cs) return ds4_fail(err, DS4_ERR_OOM, "forward: RoPE table of %lld positions", (long long)n);
        m->rope_cs[k] = cs;
        rope_table(cs, p[k], m->rope_n, n);
    }
    m->rope_n = n;
    return DS4_OK;
}


/* ------------------------------------------------------------------------------------------------ task helpers */

typedef struct {
    fwd *f;
    void *ctx;
    range_fn fn;
    int64_t n, ntask;
} range_job;

static void range_task(void *p, int64_t i) {
    range_job *j = p;
    int64_t b = j->n * i / j->ntask, e = j->n * (i + 1) / j->ntask;
    if (b < e) j->fn(j->f, j->ctx, b, e, i);
}

void ds4_fwd_parallel_range(fwd *f, int64_t n, range_fn fn, void *ctx) {
    int64_t nt = f->ntask < n ? f->ntask : n;
    if (nt <= 0) return;
    range_job j = {f, ctx, fn, n, nt};
    ds4_pool_run(f->pool, nt, range_task, &j);
}

static void matmul(fwd *f, float *y, const float *x, const float *W, int64_t T, int64_t K, int64_t O) {
    ds4_matmul_nt(f->pool, y, O, x, K, W, T, K, O);
}


/* ------------------------------------------------------------------------------------------------ mHC */

void ds4_hc_sinkhorn(const ds4_config *c, const float *comb_logits, float sc2, const float *comb_base, double *M,
                     double *tape) {
    const int64_t n = c->hc_mult, it = c->hc_sinkhorn_iters, nn = n * n;
    const double hc_eps = c->hc_eps;
    double *P = tape ? tape + 2 * it * nn : NULL;
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

typedef struct {
    const ds4_hc_w *w;
    const float *X;
} hc_ctx;

/* pre/post/comb and the collapsed input u for tokens [b, e) (§2.2). */
static void hc_pre_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const hc_ctx *cx = p;
    const int64_t n = f->c->hc_mult, D = f->c->hidden_size, nD = n * D, mix = (2 + n) * n;
    const double eps = f->c->rms_norm_eps, hc_eps = f->c->hc_eps;
    float *xn = f->scratch + task * f->scratch_stride; /* n·D floats */
    float mixv[64 * 64 + 128];
    double M[64 * 64];
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * nD;
        ds4_rmsnorm_rows(xn, x, NULL, 1, nD, eps);
        for (int64_t j = 0; j < mix; j++) mixv[j] = ds4_dot(cx->w->fn + j * nD, xn, nD);
        const float *base = cx->w->base, *sc = cx->w->scale;
        float *pre = f->pre + t * n, *post = f->post + t * n, *comb = f->comb + t * n * n;
        for (int64_t i = 0; i < n; i++) {
            pre[i] = sigmoidf(mixv[i] * sc[0] + base[i]) + (float)hc_eps;
            post[i] = 2.0f * sigmoidf(mixv[n + i] * sc[1] + base[n + i]);
        }
        ds4_hc_sinkhorn(f->c, mixv + 2 * n, sc[2], base + 2 * n, M, NULL);
        for (int64_t i = 0; i < n * n; i++) comb[i] = (float)M[i];
        float *u = f->u + t * D;
        memset(u, 0, (size_t)D * sizeof(float));
        for (int64_t i = 0; i < n; i++) ds4_axpy(u, pre[i], x + i * D, D);
    }
}

typedef struct {
    const float *X, *a;
    float *Xo;
} hc_post_ctx;

/* X'[k] = post_k · a + Σ_j comb[j][k] · X[j]  (the sum runs over the SOURCE stream j: Mᵀ X). */
static void hc_post_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const hc_post_ctx *cx = p;
    const int64_t n = f->c->hc_mult, D = f->c->hidden_size;
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * n * D, *a = cx->a + t * D, *post = f->post + t * n, *comb = f->comb + t * n * n;
        float *xo = cx->Xo + t * n * D;
        for (int64_t k = 0; k < n; k++) {
            float *y = xo + k * D;
            memset(y, 0, (size_t)D * sizeof(float));
            for (int64_t j = 0; j < n; j++) ds4_axpy(y, comb[j * n + k], x + j * D, D);
            ds4_axpy(y, post[k], a, D);
        }
    }
}

/* ------------------------------------------------------------------------------------------------ small row ops */

typedef struct {
    float *x;
    const float *w;
    int64_t width;
    double eps;
} norm_ctx;

static void norm_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const norm_ctx *cx = p;
    ds4_rmsnorm_rows(cx->x + b * cx->width, cx->x + b * cx->width, cx->w, e - b, cx->width, cx->eps);
}

/* In-place RMSNorm of `rows` rows of `width` (w may be NULL). */
void ds4_fwd_norm_rows(fwd *f, float *x, const float *w, int64_t rows, int64_t width) {
    norm_ctx cx = {x, w, width, f->c->rms_norm_eps};
    ds4_fwd_parallel_range(f, rows, norm_range, &cx);
}

typedef struct {
    float *x;           /* [T, heads, width] */
    int64_t heads, width;
    const rope_tab *rt;
    int sign;
} rope_ctx;

static void rope_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const rope_ctx *cx = p;
    for (int64_t t = b; t < e; t++) {
        const float *cs = rope_at(cx->rt, ds4_row_pos(f, t));
        for (int64_t hh = 0; hh < cx->heads; hh++)
            ds4_rope_apply(cx->x + (t * cx->heads + hh) * cx->width, cx->width, cx->rt->half, cs, cx->sign);
    }
}

/* Rotate each of `heads` vectors of every token at that token's position. */
void ds4_fwd_rope_rows(fwd *f, float *x, int64_t heads, int64_t width, const rope_tab *rt, int sign) {
    rope_ctx cx = {x, heads, width, rt, sign};
    ds4_fwd_parallel_range(f, f->T, rope_range, &cx);
}

/* ------------------------------------------------------------------------------------------------ compressor */

/* Pool one entry (§3.4) from row pointers: nprev rows of the previous window (their first halves; overlap only),
 * then the m rows of window `win` (their second halves with overlap, whole rows otherwise); then RMSNorm and RoPE
 * at position win·m. gl and kv are 2m floats of scratch each. */
static void pool_entry(const fwd *f, const ds4_compressor_w *w, const float *const *Cr, const float *const *Zr,
                       int64_t nprev, int overlap, int64_t win, float *out, float *pool_keep, float *gl, float *kv) {
    const int64_t m = w->rate, dd = w->dd, width = w->width, off = overlap ? dd : 0;
    for (int64_t ch = 0; ch < dd; ch++) {
        int64_t ns = 0;
        for (int64_t j = 0; j < nprev; j++) {
            gl[ns] = Zr[j][ch] + w->ape[j * width + ch];
            kv[ns++] = Cr[j][ch];
        }
        for (int64_t j = 0; j < m; j++) {
            gl[ns] = Zr[nprev + j][off + ch] + w->ape[j * width + off + ch];
            kv[ns++] = Cr[nprev + j][off + ch];
        }
        /* per-channel softmax over the slots in fp32 (HF: softmax(dim=2, dtype=float32)); the missing
         * previous-window slots of window 0 are -inf gates, i.e. simply absent */
        float mx = -INFINITY;
        for (int64_t k = 0; k < ns; k++) mx = gl[k] > mx ? gl[k] : mx;
        double den = 0;
        for (int64_t k = 0; k < ns; k++) den += (gl[k] = (float)exp((double)(gl[k] - mx)));
        float acc = 0;
        for (int64_t k = 0; k < ns; k++) acc += kv[k] * (float)(gl[k] / den);
        out[ch] = acc;
    }
    keep(pool_keep, out, dd);
    ds4_rmsnorm_rows(out, out, w->norm, 1, dd, f->c->rms_norm_eps);
    ds4_rope_apply(out, dd, f->rcomp.half, rope_at(&f->rcomp, win * m), 1);
}

typedef struct {
    const ds4_compressor_w *w;
    const float *C, *Z;   /* [T, width] */
    float *out;           /* [B, S, dd]: entry w of row b at (b·S + w)·dd */
    float *pool;          /* same layout: the pooled entry before norm and RoPE (training), or NULL */
    int64_t nwin;         /* complete windows per row: floor(S / m) */
    int overlap;
    int which;            /* step: 0 the attention's compressor, 1 the indexer's */
} comp_ctx;

/* Scratch of one task for pool_entry: gates, values, then 4m row pointers. */
static float *pool_scratch(fwd *f, int64_t task, int64_t m, const float ***Cr, const float ***Zr) {
    float *gl = f->scratch + task * f->scratch_stride;
    *Cr = (const float **)(void *)(gl + 4 * m);
    *Zr = *Cr + 2 * m;
    return gl;
}

/* Full forward: every complete window of every row. */
static void comp_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const comp_ctx *cx = p;
    const int64_t m = cx->w->rate, dd = cx->w->dd, width = cx->w->width, S = f->S;
    const float **Cr, **Zr;
    float *gl = pool_scratch(f, task, m, &Cr, &Zr);
    for (int64_t i = b; i < e; i++) {
        const int64_t row = i / cx->nwin, win = i % cx->nwin, nprev = cx->overlap && win > 0 ? m : 0;
        const int64_t t0 = row * S + win * m - nprev; /* the first row pooled */
        for (int64_t j = 0; j < nprev + m; j++) {
            Cr[j] = cx->C + (t0 + j) * width;
            Zr[j] = cx->Z + (t0 + j) * width;
        }
        pool_entry(f, cx->w, Cr, Zr, nprev, cx->overlap, win, cx->out + (row * S + win) * dd,
                   cx->pool ? cx->pool + (row * S + win) * dd : NULL, gl, gl + 2 * m);
    }
}

/* Step: the windows that complete among the new tokens, numbered across sequences (sequence s owns jobs
 * [w0, w0 + its count)); rows come from the chunk or the cache, entries go into the cache. */
static void comp_step_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const comp_ctx *cx = p;
    const int64_t m = cx->w->rate;
    const float **Cr, **Zr;
    float *gl = pool_scratch(f, task, m, &Cr, &Zr);
    int64_t s = 0;
    for (int64_t i = b; i < e; i++) {
        while (s + 1 < f->nseq && f->seqs[s + 1].w0[cx->which] <= i) s++;
        const ds4_step_seq *sq = &f->seqs[s];
        ds4_layer_cache *lc = &sq->cache->layers[f->li];
        ds4_comp_cache *cc = cx->which ? &lc->idx : &lc->comp;
        const int64_t win = sq->p0 / m + (i - sq->w0[cx->which]), nprev = cx->overlap && win > 0 ? m : 0;
        const float *C = cx->C + sq->r0 * cc->width, *Z = cx->Z + sq->r0 * cc->width;
        for (int64_t j = 0; j < nprev + m; j++) {
            const int64_t q = win * m - nprev + j;
            Cr[j] = ds4_comp_row(cc, cc->C, C, sq->p0, q);
            Zr[j] = ds4_comp_row(cc, cc->Z, Z, sq->p0, q);
        }
        pool_entry(f, cx->w, Cr, Zr, nprev, cx->overlap, win, cc->ent + win * cc->dd, NULL, gl, gl + 2 * m);
    }
}

/* Entries of a compressor over h: returns the number of complete windows per row (0 in a step, where the
 * entries go to the caches). In training the projections and pooled entries are kept (keep_* non-NULL). */
static int64_t compress(fwd *f, const ds4_compressor_w *w, int which, float *C, float *Z, float *out, int overlap,
                        float *keep_C, float *keep_Z, float *keep_pool) {
    matmul(f, C, f->h, w->wkv, f->T, f->c->hidden_size, w->width);
    matmul(f, Z, f->h, w->wgate, f->T, f->c->hidden_size, w->width);
    keep(keep_C, C, f->T * w->width);
    keep(keep_Z, Z, f->T * w->width);
    comp_ctx cx = {w, C, Z, out, keep_pool, 0, overlap, which};
    if (f->pos) {
        int64_t jobs = 0;
        for (int64_t s = 0; s < f->nseq; s++) {
            ds4_step_seq *sq = &f->seqs[s];
            sq->w0[which] = jobs;
            jobs += (sq->p0 + sq->n) / w->rate - sq->p0 / w->rate;
        }
        ds4_fwd_parallel_range(f, jobs, comp_step_range, &cx);
        return 0;
    }
    cx.nwin = f->S / w->rate;
    if (cx.nwin == 0) return 0;
    ds4_fwd_parallel_range(f, f->B * cx.nwin, comp_range, &cx);
    return cx.nwin;
}

/* The entries query row t may read from (base; entry w at base + w·dd) and how many are causal: w < (p+1)/m. */
static const float *row_entries(const fwd *f, int64_t t, int which, int64_t m, int64_t nwin, int64_t *valid) {
    const int64_t v = (ds4_row_pos(f, t) + 1) / m;
    if (f->pos) {
        const ds4_layer_cache *lc = &f->seqs[f->rowseq[t]].cache->layers[f->li];
        *valid = v; /* a step pooled every window that completed up to this row */
        return which ? lc->idx.ent : lc->comp.ent;
    }
    *valid = v < nwin ? v : nwin;
    const int64_t dd = which ? f->c->index_head_dim : f->c->head_dim;
    return (which ? f->iK : f->cK) + (t / f->S) * f->S * dd;
}

/* Window key j (<= the row's position) of query row t: from the ring for tokens before the step, else this call. */
static const float *window_key(const fwd *f, int64_t t, int64_t j) {
    const int64_t d = f->c->head_dim;
    if (!f->pos) return f->kv + ((t / f->S) * f->S + j) * d;
    const ds4_step_seq *sq = &f->seqs[f->rowseq[t]];
    if (j >= sq->p0) return f->kv + (sq->r0 + j - sq->p0) * d;
    return sq->cache->layers[f->li].ring + (j % sq->cache->ring) * d;
}

/* ------------------------------------------------------------------------------------------------ indexer */

typedef struct {
    int64_t nwin, topk;
} idx_ctx;

/* Lightning-indexer scores and top-k over the causal entries w < floor((s+1)/m) (§3.5). */
static void indexer_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const idx_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim, m = c->compress_rate_csa;
    const float qscale = 1.0f / sqrtf((float)cI);
    float *score = f->scratch + task * f->scratch_stride;
    for (int64_t t = b; t < e; t++) {
        int64_t valid;
        const float *keys = row_entries(f, t, 1, m, cx->nwin, &valid);
        int32_t *sel = f->sel + t * f->sel_stride;
        const int32_t *rp = f->replay_index && f->replay_on
                                ? f->replay_index + (t * ds4_model_csa_layers(f->m) + f->csa_i) * c->index_topk : NULL;
        if (rp && rp[0] >= 0) { /* replayed picks (validated causal and distinct by check_args) */
            int64_t k = 0;
            for (int64_t i = 0; i < c->index_topk && k < f->sel_stride; i++)
                if (rp[i] >= 0) sel[k++] = rp[i];
            f->nsel[t] = (int32_t)k;
            continue;
        }
        for (int64_t w = 0; w < valid; w++) {
            const float *k = keys + w * cI;
            float acc = 0;
            for (int64_t hh = 0; hh < nI; hh++) {
                float dot = ds4_dot(f->iq + (t * nI + hh) * cI, k, cI);
                float r = dot > 0 ? dot * qscale : 0.0f;
                acc += r * f->iw[t * nI + hh];
            }
            score[w] = acc;
        }
        /* k = min(index_topk, entries); with fewer causal entries than k every causal one is kept */
        int64_t k = cx->topk < valid ? cx->topk : valid;
        if (k == valid) {
            for (int64_t w = 0; w < valid; w++) sel[w] = (int32_t)w;
        } else {
            /* partial selection sort: largest score first, ties to the lower index (the fixtures carry no
             * near-ties at the boundary, so any tie rule matches transformers there) */
            for (int64_t i = 0; i < k; i++) {
                int64_t best = -1;
                for (int64_t w = 0; w < valid; w++) {
                    if (score[w] == -INFINITY) continue;
                    if (best < 0 || score[w] > score[best]) best = w;
                }
                sel[i] = (int32_t)best;
                score[best] = -INFINITY;
            }
        }
        f->nsel[t] = (int32_t)k;
    }
}

/* ------------------------------------------------------------------------------------------------ attention core */

typedef struct {
    const ds4_layer_w *l;
    int64_t nwin;   /* compressed entries per row */
} att_ctx;

/* Joint softmax with sink over window keys ∪ permitted compressed entries; values = keys (§3.6). */
static void attn_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const att_ctx *cx = p;
    const ds4_config *c = f->c;
    const ds4_layer_w *l = cx->l;
    const int64_t H = c->num_attention_heads, d = c->head_dim, win = c->sliding_window;
    const float scale = 1.0f / sqrtf((float)d);
    float *lg = f->scratch + task * f->scratch_stride;
    const float **keys = (const float **)(void *)(lg + f->key_off);
    for (int64_t t = b; t < e; t++) {
        const int64_t s = ds4_row_pos(f, t);
        int64_t nk = 0;
        const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
        for (int64_t j = j0; j <= s; j++) keys[nk++] = window_key(f, t, j);
        if (l->type != DS4_ATTN_SLIDING) {
            const int64_t m = l->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
            int64_t valid;
            const float *ent = row_entries(f, t, 0, m, cx->nwin, &valid);
            if (l->type == DS4_ATTN_HCA)
                for (int64_t w = 0; w < valid; w++) keys[nk++] = ent + w * d;
            else
                for (int64_t i = 0; i < f->nsel[t]; i++) keys[nk++] = ent + f->sel[t * f->sel_stride + i] * d;
        }
        float *tgt = l->type == DS4_ATTN_CSA && f->lt && f->lt->itgt ? f->lt->itgt + t * f->sel_stride : NULL;
        if (tgt) memset(tgt, 0, (size_t)f->sel_stride * sizeof(float));
        for (int64_t hh = 0; hh < H; hh++) {
            const float *q = f->q + (t * H + hh) * d;
            float mx = l->sink[hh];
            for (int64_t k = 0; k < nk; k++) {
                lg[k] = ds4_dot(q, keys[k], d) * scale;
                if (lg[k] > mx) mx = lg[k];
            }
            double den = exp((double)(l->sink[hh] - mx));
            for (int64_t k = 0; k < nk; k++) den += (lg[k] = (float)exp((double)(lg[k] - mx)));
            float *o = f->o + (t * H + hh) * d;
            memset(o, 0, (size_t)d * sizeof(float));
            for (int64_t k = 0; k < nk; k++) ds4_axpy(o, (float)(lg[k] / den), keys[k], d);
            if (tgt) /* attention mass on each indexer pick, the indexer KL loss's (detached) target */
                for (int64_t k = s - j0 + 1; k < nk; k++) tgt[k - (s - j0 + 1)] += (float)(lg[k] / den);
        }
    }
}

/* A step's new tokens join the caches once every query of the layer has read the old state: the window vectors
 * go into the rings (overwriting slots earlier queries of the step still read), the raw projections into the
 * compressors' pending / last-window rows. */
static void step_commit(fwd *f, const ds4_layer_w *l) {
    const int64_t d = f->c->head_dim;
    for (int64_t s = 0; s < f->nseq; s++) {
        const ds4_step_seq *sq = &f->seqs[s];
        ds4_layer_cache *lc = &sq->cache->layers[f->li];
        ds4_ring_commit(lc->ring, sq->cache->ring, d, sq->p0, sq->n, f->kv + sq->r0 * d);
        if (l->type == DS4_ATTN_SLIDING) continue;
        ds4_comp_commit(&lc->comp, sq->p0, sq->n, f->cC + sq->r0 * lc->comp.width, f->cZ + sq->r0 * lc->comp.width);
        if (l->type == DS4_ATTN_CSA)
            ds4_comp_commit(&lc->idx, sq->p0, sq->n, f->iC + sq->r0 * lc->idx.width, f->iZ + sq->r0 * lc->idx.width);
    }
}

/* The attention sub-layer on f->u (collapsed input): result in f->a. */
static void attention(fwd *f, const ds4_layer_w *l) {
    const ds4_config *c = f->c;
    const int64_t T = f->T, D = c->hidden_size, H = c->num_attention_heads, d = c->head_dim, qr = c->q_lora_rank;
    const rope_tab *rt = l->type == DS4_ATTN_SLIDING ? &f->rmain : &f->rcomp;
    ds4_layer_tape *lt = f->lt;
    memcpy(f->h, f->u, (size_t)(T * D) * sizeof(float));
    ds4_fwd_norm_rows(f, f->h, l->attn_norm, T, D);
    matmul(f, f->qr, f->h, l->wq_a, T, D, qr);
    if (lt) {
        keep(lt->h_attn, f->h, T * D);
        keep(lt->qa, f->qr, T * qr);
    }
    ds4_fwd_norm_rows(f, f->qr, l->q_norm, T, qr);
    matmul(f, f->q, f->qr, l->wq_b, T, qr, H * d);
    if (lt) {
        keep(lt->qr, f->qr, T * qr);
        keep(lt->q_pre, f->q, T * H * d);
    }
    ds4_fwd_norm_rows(f, f->q, NULL, T * H, d); /* per-head unweighted RMS */
    ds4_fwd_rope_rows(f, f->q, H, d, rt, 1);
    matmul(f, f->kv, f->h, l->wkv, T, D, d);
    if (lt) keep(lt->kv_pre, f->kv, T * d);
    ds4_fwd_norm_rows(f, f->kv, l->kv_norm, T, d);
    ds4_fwd_rope_rows(f, f->kv, 1, d, rt, 1);
    if (lt) {
        keep(lt->q, f->q, T * H * d);
        keep(lt->kv, f->kv, T * d);
    }
    att_ctx ax = {l, 0};
    if (l->type != DS4_ATTN_SLIDING)
        ax.nwin = compress(f, &l->comp, 0, f->cC, f->cZ, f->cK, l->type == DS4_ATTN_CSA, lt ? lt->cC : NULL,
                           lt ? lt->cZ : NULL, lt ? lt->pool : NULL);
    if (l->type == DS4_ATTN_CSA) {
        const int64_t nI = c->index_n_heads, cI = c->index_head_dim;
        int64_t nwin = compress(f, &l->idx_comp, 1, f->iC, f->iZ, f->iK, 1, lt ? lt->iC : NULL, lt ? lt->iZ : NULL,
                                lt ? lt->ipool : NULL);
        matmul(f, f->iq, f->qr, l->idx_wq_b, T, qr, nI * cI);
        ds4_fwd_rope_rows(f, f->iq, nI, cI, &f->rcomp, 1);
        matmul(f, f->iw, f->h, l->idx_weights, T, D, nI);
        const float wscale = 1.0f / sqrtf((float)nI);
        for (int64_t i = 0; i < T * nI; i++) f->iw[i] *= wscale;
        if (lt && lt->iq) {
            keep(lt->iq, f->iq, T * nI * cI);
            keep(lt->iw, f->iw, T * nI);
            keep(lt->iK, f->iK, f->B * f->S * cI);
        }
        /* a step's rows each see their own number of entries: k = min(index_topk, causal entries) per row */
        idx_ctx ix = {nwin, f->pos ? c->index_topk : (c->index_topk < nwin ? c->index_topk : nwin)};
        if (nwin == 0 && !f->pos)
            memset(f->nsel, 0, (size_t)T * sizeof(int32_t));
        else
            ds4_fwd_parallel_range(f, T, indexer_range, &ix);
        if (f->rec_index) {
            const int64_t K = c->index_topk, ncsa = ds4_model_csa_layers(f->m);
            for (int64_t t = 0; t < T; t++) {
                int32_t *dst = f->rec_index + (t * ncsa + f->csa_i) * K;
                for (int64_t i = 0; i < K; i++) dst[i] = i < f->nsel[t] ? f->sel[t * f->sel_stride + i] : -1;
            }
        }
    }
    ds4_fwd_parallel_range(f, T, attn_range, &ax);
    if (f->pos) step_commit(f, l);
    ds4_fwd_rope_rows(f, f->o, H, d, rt, -1); /* de-rotate the output at the query position */
    if (lt) {
        lt->nwin = ax.nwin;
        if (ax.nwin) keep(lt->cK, f->cK, f->B * f->S * d);
        if (l->type == DS4_ATTN_CSA) {
            memcpy(lt->sel, f->sel, (size_t)(T * f->sel_stride) * sizeof(int32_t));
            memcpy(lt->nsel, f->nsel, (size_t)T * sizeof(int32_t));
        }
        keep(lt->o, f->o, T * H * d);
    }
    /* grouped output projection: group g = heads [g·H/g, (g+1)·H/g) → o_lora values */
    const int64_t G = c->o_groups, ol = c->o_lora_rank, gw = H * d / G;
    for (int64_t g = 0; g < G; g++)
        ds4_matmul_nt(f->pool, f->y + g * ol, G * ol, f->o + g * gw, H * d, l->wo_a + g * ol * gw, T, gw, ol);
    matmul(f, f->a, f->y, l->wo_b, T, G * ol, D);
    if (lt) {
        keep(lt->y, f->y, T * G * ol);
        keep(lt->a_attn, f->a, T * D);
    }
}

/* ------------------------------------------------------------------------------------------------ MoE */

typedef struct {
    const ds4_layer_w *l;
    const int64_t *ids;
} route_ctx;

float ds4_fwd_score(ds4_score_func sf, float x) {
    if (sf == DS4_SCORE_SIGMOID) return sigmoidf(x);
    /* torch softplus (beta 1, threshold 20): x above 20, log1p(exp(x)) otherwise */
    double sp = x > 20.0f ? (double)x : log1p(exp((double)x));
    return (float)sqrt(sp);
}

static void route_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const route_ctx *cx = p;
    const ds4_config *c = f->c;
    const int64_t E = c->n_routed_experts, K = c->num_experts_per_tok;
    for (int64_t t = b; t < e; t++) {
        float *s = f->rl + t * E;
        if (c->scoring_func == DS4_SCORE_SOFTMAX) {
            float mx = -INFINITY;
            for (int64_t x = 0; x < E; x++) mx = s[x] > mx ? s[x] : mx;
            double den = 0;
            for (int64_t x = 0; x < E; x++) den += exp((double)(s[x] - mx));
            for (int64_t x = 0; x < E; x++) s[x] = (float)(exp((double)(s[x] - mx)) / den);
        } else {
            for (int64_t x = 0; x < E; x++) s[x] = ds4_fwd_score(c->scoring_func, s[x]);
        }
        int32_t *idx = f->eidx + t * K;
        const int32_t *rp = f->replay_experts && f->replay_on
                                ? f->replay_experts + (t * c->num_hidden_layers + f->li) * K : NULL;
        if (cx->l->is_hash) {
            for (int64_t k = 0; k < K; k++) idx[k] = cx->l->tid2eid[cx->ids[t] * K + k];
        } else if (rp && rp[0] >= 0) {
            memcpy(idx, rp, (size_t)K * sizeof(int32_t));
        } else {
            /* top-K of score + correction bias (selection only), ties to the lower expert index */
            for (int64_t k = 0; k < K; k++) {
                int64_t best = -1;
                float bv = -INFINITY;
                for (int64_t x = 0; x < E; x++) {
                    int taken = 0;
                    for (int64_t j = 0; j < k; j++) taken |= idx[j] == x;
                    if (taken) continue;
                    float v = s[x] + cx->l->gate_bias[x];
                    if (best < 0 || v > bv) best = x, bv = v;
                }
                idx[k] = (int32_t)best;
            }
        }
        float sum = 0;
        for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
        for (int64_t k = 0; k < K; k++)
            f->ew[t * K + k] = s[idx[k]] / (sum + 1e-20f) * (float)c->routed_scaling_factor;
    }
}

typedef struct {
    float *g1, *g3;
    int64_t I;
    float lim;
} swiglu_ctx;

/* silu(min(g, λ)) · clamp(u, -λ, λ), in place into g1 */
static void swiglu_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const swiglu_ctx *cx = p;
    for (int64_t i = b * cx->I; i < e * cx->I; i++) {
        float g = cx->g1[i] > cx->lim ? cx->lim : cx->g1[i];
        float u = cx->g3[i] < -cx->lim ? -cx->lim : (cx->g3[i] > cx->lim ? cx->lim : cx->g3[i]);
        cx->g1[i] = ds4_silu(g) * u;
    }
}

/* out = W2 (silu(min(x W1ᵀ, λ)) ⊙ clamp(x W3ᵀ, ±λ)) over `rows` rows; with g1_keep/g3_keep (training) the
 * pre-activations of row r are kept at row slot[r] (or r when slot is NULL). */
static void swiglu(fwd *f, float *x, int64_t rows, const float *w1, const float *w3, const float *w2, float *out,
                   float *g1_keep, float *g3_keep, const int32_t *slot) {
    const int64_t D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    matmul(f, f->g1, x, w1, rows, D, I);
    matmul(f, f->g3, x, w3, rows, D, I);
    if (g1_keep)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t dst = slot ? slot[r] : r;
            keep(g1_keep + dst * I, f->g1 + r * I, I);
            keep(g3_keep + dst * I, f->g3 + r * I, I);
        }
    swiglu_ctx sx = {f->g1, f->g3, I, (float)f->c->swiglu_limit};
    ds4_fwd_parallel_range(f, rows, swiglu_range, &sx);
    matmul(f, out, f->g1, w2, rows, I, D);
}

/* routed = Σ_k w_k · y_k, accumulated in ascending expert order like HF's index_add_ loop; + shared (in a). */
static void combine_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const int64_t K = f->c->num_experts_per_tok, D = f->c->hidden_size;
    for (int64_t t = b; t < e; t++) {
        int32_t order[64];
        for (int64_t k = 0; k < K; k++) order[k] = (int32_t)k;
        for (int64_t i = 1; i < K; i++) /* insertion sort of slots by expert id (stable) */
            for (int64_t j = i; j > 0 && f->eidx[t * K + order[j]] < f->eidx[t * K + order[j - 1]]; j--) {
                int32_t tmp = order[j];
                order[j] = order[j - 1];
                order[j - 1] = tmp;
            }
        float *a = f->a + t * D, *acc = f->xg + t * D; /* xg is free again once the experts ran */
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int64_t k = 0; k < K; k++) ds4_axpy(acc, 1.0f, f->yk + (t * K + order[k]) * D, D);
        ds4_axpy(a, 1.0f, acc, D);
    }
}

/* The MoE sub-layer on f->u with token ids `ids` (hash routing): result in f->a. */
static void moe(fwd *f, const ds4_layer_w *l, const int64_t *ids) {
    const ds4_config *c = f->c;
    const int64_t T = f->T, D = c->hidden_size, E = c->n_routed_experts, K = c->num_experts_per_tok;
    ds4_layer_tape *lt = f->lt;
    memcpy(f->h, f->u, (size_t)(T * D) * sizeof(float));
    ds4_fwd_norm_rows(f, f->h, l->ffn_norm, T, D);
    matmul(f, f->rl, f->h, l->gate, T, D, E);
    if (lt) {
        keep(lt->h_ffn, f->h, T * D);
        keep(lt->rlog, f->rl, T * E);
    }
    route_ctx rx = {l, ids};
    ds4_fwd_parallel_range(f, T, route_range, &rx);
    if (f->rec_experts)
        for (int64_t t = 0; t < T; t++)
            memcpy(f->rec_experts + (t * c->num_hidden_layers + f->li) * K, f->eidx + t * K, (size_t)K * sizeof(int32_t));
    if (lt) {
        keep(lt->rsc, f->rl, T * E);
        memcpy(lt->eidx, f->eidx, (size_t)(T * K) * sizeof(int32_t));
        keep(lt->ew, f->ew, T * K);
        if (f->m->router_loads && !l->is_hash) { /* expert loads for the aux-loss-free bias update */
            const int64_t li = lt - f->tape->layers;
            for (int64_t i = 0; i < T * K; i++) f->m->router_loads[li * E + f->eidx[i]]++;
        }
    }
    /* group (token, slot) pairs by expert: counting sort */
    memset(f->ecount, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < T * K; i++) f->ecount[f->eidx[i] + 1]++;
    for (int64_t x = 0; x < E; x++) f->ecount[x + 1] += f->ecount[x];
    /* ecount[x] serves as expert x's fill cursor, which leaves it at the start of x+1: shift back */
    for (int64_t i = 0; i < T * K; i++) f->perm[f->ecount[f->eidx[i]]++] = (int32_t)i;
    for (int64_t x = E; x > 0; x--) f->ecount[x] = f->ecount[x - 1];
    f->ecount[0] = 0;
    for (int64_t x = 0; x < E; x++) {
        const int64_t b = f->ecount[x], n = f->ecount[x + 1] - b;
        if (n == 0) continue;
        for (int64_t r = 0; r < n; r++) memcpy(f->xg + r * D, f->h + (f->perm[b + r] / K) * D, (size_t)D * sizeof(float));
        const int64_t I = c->moe_intermediate_size;
        swiglu(f, f->xg, n, l->w1 + x * I * D, l->w3 + x * I * D, l->w2 + x * D * I, f->ye, lt ? lt->eg1 : NULL,
               lt ? lt->eg3 : NULL, f->perm + b);
        if (lt)
            for (int64_t r = 0; r < n; r++) keep(lt->ye + (int64_t)f->perm[b + r] * D, f->ye + r * D, D);
        for (int64_t r = 0; r < n; r++) {
            const int32_t slot = f->perm[b + r];
            const float w = f->ew[slot];
            const float *src = f->ye + r * D;
            float *dst = f->yk + (int64_t)slot * D;
            for (int64_t cc = 0; cc < D; cc++) dst[cc] = src[cc] * w;
        }
    }
    swiglu(f, f->h, T, l->sw1, l->sw3, l->sw2, f->a, lt ? lt->sg1 : NULL, lt ? lt->sg3 : NULL,
           NULL); /* shared expert, every token */
    ds4_fwd_parallel_range(f, T, combine_range, NULL);
    if (lt) keep(lt->a_ffn, f->a, T * D);
}

/* ------------------------------------------------------------------------------------------------ block / head */

/* One decoder block over streams X (result back in X; Xt is scratch). */
static void block(fwd *f, const ds4_layer_w *l, float *X, const int64_t *ids) {
    const int64_t nD = f->c->hc_mult * f->c->hidden_size;
    ds4_layer_tape *lt = f->lt;
    if (lt) keep(lt->X_in, X, f->T * nD);
    hc_ctx hx = {&l->hc_attn, X};
    ds4_fwd_parallel_range(f, f->T, hc_pre_range, &hx);
    if (lt) keep(lt->u_attn, f->u, f->T * f->c->hidden_size);
    attention(f, l);
    hc_post_ctx px = {X, f->a, f->Xt};
    ds4_fwd_parallel_range(f, f->T, hc_post_range, &px);
    if (lt) keep(lt->X_mid, f->Xt, f->T * nD);
    hc_ctx hf = {&l->hc_ffn, f->Xt};
    ds4_fwd_parallel_range(f, f->T, hc_pre_range, &hf);
    if (lt) keep(lt->u_ffn, f->u, f->T * f->c->hidden_size);
    moe(f, l, ids);
    hc_post_ctx pf = {f->Xt, f->a, X};
    ds4_fwd_parallel_range(f, f->T, hc_post_range, &pf);
}

typedef struct {
    const float *X, *fn, *base, *scale;
} head_ctx;

/* HyperHead: p_i = σ(s·(W_h RMS(vec X))_i + b_i) + eps; y = Σ p_i X_i  → f->u (§2.4). */
static void hyperhead_range(fwd *f, void *p, int64_t b, int64_t e, int64_t task) {
    const head_ctx *cx = p;
    const int64_t n = f->c->hc_mult, D = f->c->hidden_size;
    float *xn = f->scratch + task * f->scratch_stride;
    for (int64_t t = b; t < e; t++) {
        const float *x = cx->X + t * n * D;
        ds4_rmsnorm_rows(xn, x, NULL, 1, n * D, f->c->rms_norm_eps);
        float pre[64];
        for (int64_t i = 0; i < n; i++)
            pre[i] = sigmoidf(ds4_dot(cx->fn + i * n * D, xn, n * D) * cx->scale[0] + cx->base[i]) + (float)f->c->hc_eps;
        float *u = f->u + t * D;
        memset(u, 0, (size_t)D * sizeof(float));
        for (int64_t i = 0; i < n; i++) ds4_axpy(u, pre[i], x + i * D, D);
    }
}

/* logits = head(norm(HyperHead(X))) for all T rows. */
static void lm_head(fwd *f, const float *X, const float *fn, const float *base, const float *scale, const float *norm,
                    float *logits, float *u_keep, float *y_keep) {
    const int64_t D = f->c->hidden_size;
    head_ctx hx = {X, fn, base, scale};
    ds4_fwd_parallel_range(f, f->T, hyperhead_range, &hx);
    keep(u_keep, f->u, f->T * D);
    ds4_fwd_norm_rows(f, f->u, norm, f->T, D);
    keep(y_keep, f->u, f->T * D);
    matmul(f, logits, f->u, f->m->head, f->T, D, f->c->vocab_size);
}

/* Mean cross-entropy of logits[b, s] against labels[b, s + shift] over s + shift < S, ignoring -100. */
static void cross_entropy(const float *logits, int64_t B, int64_t Sl, int64_t V, const int64_t *labels, int64_t S,
                          int64_t shift, double *loss, int64_t *count) {
    double sum = 0;
    int64_t cnt = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s + shift < S && s < Sl; s++) {
            const int64_t y = labels[b * S + s + shift];
            if (y == -100) continue;
            const float *z = logits + (b * Sl + s) * V;
            float mx = -INFINITY;
            for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
            double se = 0;
            for (int64_t v = 0; v < V; v++) se += exp((double)z[v] - mx);
            sum += log(se) + mx - z[y];
            cnt++;
        }
    *count = cnt;
    *loss = cnt ? sum / (double)cnt : NAN;
}

/* ------------------------------------------------------------------------------------------------ entry point */

static ds4_status check_args(const ds4_model *m, const ds4_forward_args *a, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    if (!a || !a->ids) return ds4_fail(err, DS4_ERR_ARG, "forward: ids is NULL");
    if (a->batch < 1 || a->seq < 1)
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: ids shape [%lld, %lld] must be at least [1, 1]",
                        (long long)a->batch, (long long)a->seq);
    if (a->batch > (1 << 20) || a->seq > (1 << 24) || a->batch * a->seq > (1 << 24))
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: ids shape [%lld, %lld] too large", (long long)a->batch,
                        (long long)a->seq);
    const int64_t T = a->batch * a->seq;
    for (int64_t i = 0; i < T; i++)
        if (a->ids[i] < 0 || a->ids[i] >= c->vocab_size)
            return ds4_fail(err, DS4_ERR_ARG, "forward: ids[%lld, %lld] = %lld outside [0, %lld) (ids [%lld, %lld])",
                            (long long)(i / a->seq), (long long)(i % a->seq), (long long)a->ids[i],
                            (long long)c->vocab_size, (long long)a->batch, (long long)a->seq);
    if (a->labels)
        for (int64_t i = 0; i < T; i++)
            if (a->labels[i] != -100 && (a->labels[i] < 0 || a->labels[i] >= c->vocab_size))
                return ds4_fail(err, DS4_ERR_ARG,
                                "forward: labels[%lld, %lld] = %lld is neither -100 nor in [0, %lld) (labels [%lld, %lld])",
                                (long long)(i / a->seq), (long long)(i % a->seq), (long long)a->labels[i],
                                (long long)c->vocab_size, (long long)a->batch, (long long)a->seq);
    if (a->replay_experts) {
        const int64_t L = c->num_hidden_layers, K = c->num_experts_per_tok, E = c->n_routed_experts;
        for (int64_t t = 0; t < T; t++)
            for (int64_t li = 0; li < L; li++) {
                const int32_t *r = a->replay_experts + (t * L + li) * K;
                if (r[0] < 0) continue;
                for (int64_t k = 0; k < K; k++) {
                    int dup = 0;
                    for (int64_t j = 0; j < k; j++) dup |= r[j] == r[k];
                    if (r[k] < 0 || r[k] >= E || dup)
                        return ds4_fail(err, DS4_ERR_ARG,
                                        "forward: replay_experts[%lld, %lld, layer %lld] slot %lld = %d is not a distinct "
                                        "expert in [0, %lld)", (long long)(t / a->seq), (long long)(t % a->seq),
                                        (long long)li, (long long)k, r[k], (long long)E);
                }
            }
    }
    if (a->replay_index) {
        const int64_t nc = ds4_model_csa_layers(m), K = c->index_topk, mr = c->compress_rate_csa;
        for (int64_t t = 0; t < T; t++)
            for (int64_t ci = 0; ci < nc; ci++) {
                const int32_t *r = a->replay_index + (t * nc + ci) * K;
                if (r[0] < 0) continue;
                const int64_t valid = (t % a->seq + 1) / mr;
                for (int64_t k = 0; k < K; k++) {
                    int dup = 0;
                    for (int64_t j = 0; j < k; j++) dup |= r[k] >= 0 && r[j] == r[k];
                    if (r[k] < -1 || r[k] >= valid || dup)
                        return ds4_fail(err, DS4_ERR_ARG,
                                        "forward: replay_index[%lld, %lld, CSA layer %lld] slot %lld = %d is not a distinct "
                                        "causal entry in [0, %lld) or -1", (long long)(t / a->seq), (long long)(t % a->seq),
                                        (long long)ci, (long long)k, r[k], (long long)valid);
                }
            }
    }
    if (a->mtp_logits && !m->has_mtp)
        return ds4_fail(err, DS4_ERR_ARG, "forward: MTP logits requested but the checkpoint has no mtp.0.* weights");
    if (a->mtp_logits && a->seq < 2)
        return ds4_fail(err, DS4_ERR_SHAPE, "forward: MTP needs seq >= 2 (ids [%lld, %lld])", (long long)a->batch,
                        (long long)a->seq);
    return DS4_OK;
}

/* Plan f's scratch (f->T rows, positions < f->S) in the model's workspace and point it at the RoPE tables. */
static ds4_status fwd_plan(ds4_model *m, fwd *f, int need_logits_ws, ds4_error *err) {
    const ds4_config *c = &m->cfg;
    f->ntask = 4 * (int64_t)ds4_pool_threads(f->pool);
    if (f->ntask > MAX_TASKS) f->ntask = MAX_TASKS;
    ds4_arena a = {0};
    plan(f, &a, need_logits_ws);
    if (a.used > m->ws_bytes) {
        free(m->ws);
        m->ws = malloc(a.used);
        m->ws_bytes = m->ws ? a.used : 0;
        if (!m->ws)
            return ds4_fail(err, DS4_ERR_OOM, "forward: workspace of %zu bytes for %lld rows (ids [%lld, %lld])",
                            a.used, (long long)f->T, (long long)f->B, (long long)f->S);
    }
    ds4_arena w = {(char *)m->ws, 0};
    plan(f, &w, need_logits_ws);
    ds4_status s = rope_reserve(m, f->S, err);
    if (s) return s;
    f->rmain = (rope_tab){c->rope_main.dim / 2, m->rope_cs[0]};
    f->rcomp = (rope_tab){c->rope_compress.dim / 2, m->rope_cs[1]};
    return DS4_OK;
}

ds4_status ds4_fwd_setup(ds4_model *m, fwd *f, int64_t B, int64_t S, int need_logits_ws, ds4_error *err) {
    *f = (fwd){.m = m, .c = &m->cfg, .pool = m->engine->pool, .B = B, .S = S};
    f->T = B * S;
    return fwd_plan(m, f, need_logits_ws, err);
}

/* Carve the tape for (B, S) out of one arena; sizes depend on each layer's attention type. */
static void plan_tape(const ds4_model *m, ds4_tape *tp, ds4_arena *a, int64_t B, int64_t S, int with_mtp) {
    const ds4_config *c = &m->cfg;
    const size_t T = (size_t)(B * S), n = (size_t)c->hc_mult, D = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
    const size_t H = (size_t)c->num_attention_heads, d = (size_t)c->head_dim, K = (size_t)c->num_experts_per_tok;
    const size_t I = (size_t)c->moe_intermediate_size, E = (size_t)c->n_routed_experts, qr = (size_t)c->q_lora_rank;
    const size_t selw = (size_t)(c->index_topk < S ? c->index_topk : S) > 0 ? (size_t)(c->index_topk < S ? c->index_topk : S) : 1;
    const int64_t L = c->num_hidden_layers;
    tp->B = B;
    tp->S = S;
    tp->T = (int64_t)T;
    tp->with_mtp = with_mtp;
    tp->with_ikl = m->topt.indexer_kl > 0;
    tp->sel_stride = (int64_t)selw;
    for (int64_t li = 0; li < L + (with_mtp ? 1 : 0); li++) {
        ds4_layer_tape *lt = a->base ? &tp->layers[li] : &(ds4_layer_tape){0};
        const ds4_attn_type ty = li < L ? c->layer_types[li] : DS4_ATTN_SLIDING;
        const size_t width = ty == DS4_ATTN_CSA ? 2 * d : (ty == DS4_ATTN_HCA ? d : 0);
        lt->X_in = ds4_arena_take(a, T * n * D, 4);
        lt->X_mid = ds4_arena_take(a, T * n * D, 4);
        lt->u_attn = ds4_arena_take(a, T * D, 4);
        lt->h_attn = ds4_arena_take(a, T * D, 4);
        lt->qa = ds4_arena_take(a, T * qr, 4);
        lt->qr = ds4_arena_take(a, T * qr, 4);
        lt->q_pre = ds4_arena_take(a, T * H * d, 4);
        lt->q = ds4_arena_take(a, T * H * d, 4);
        lt->kv_pre = ds4_arena_take(a, T * d, 4);
        lt->kv = ds4_arena_take(a, T * d, 4);
        lt->cC = width ? ds4_arena_take(a, T * width, 4) : NULL;
        lt->cZ = width ? ds4_arena_take(a, T * width, 4) : NULL;
        lt->pool = width ? ds4_arena_take(a, T * d, 4) : NULL;
        lt->cK = width ? ds4_arena_take(a, T * d, 4) : NULL;
        lt->sel = ty == DS4_ATTN_CSA ? ds4_arena_take(a, T * selw, 4) : NULL;
        const int ikl = ty == DS4_ATTN_CSA && m->topt.indexer_kl > 0;
        const size_t nI = (size_t)c->index_n_heads, cI = (size_t)c->index_head_dim;
        lt->iq = ikl ? ds4_arena_take(a, T * nI * cI, 4) : NULL;
        lt->iw = ikl ? ds4_arena_take(a, T * nI, 4) : NULL;
        lt->iK = ikl ? ds4_arena_take(a, T * cI, 4) : NULL;
        lt->iC = ikl ? ds4_arena_take(a, T * 2 * cI, 4) : NULL;
        lt->iZ = ikl ? ds4_arena_take(a, T * 2 * cI, 4) : NULL;
        lt->ipool = ikl ? ds4_arena_take(a, T * cI, 4) : NULL;
        lt->itgt = ikl ? ds4_arena_take(a, T * selw, 4) : NULL;
        lt->nsel = ty == DS4_ATTN_CSA ? ds4_arena_take(a, T, 4) : NULL;
        lt->o = ds4_arena_take(a, T * H * d, 4);
        lt->y = ds4_arena_take(a, T * (size_t)(c->o_groups * c->o_lora_rank), 4);
        lt->a_attn = ds4_arena_take(a, T * D, 4);
        lt->u_ffn = ds4_arena_take(a, T * D, 4);
        lt->h_ffn = ds4_arena_take(a, T * D, 4);
        lt->rlog = ds4_arena_take(a, T * E, 4);
        lt->rsc = ds4_arena_take(a, T * E, 4);
        lt->eidx = ds4_arena_take(a, T * K, 4);
        lt->ew = ds4_arena_take(a, T * K, 4);
        lt->eg1 = ds4_arena_take(a, T * K * I, 4);
        lt->eg3 = ds4_arena_take(a, T * K * I, 4);
        lt->ye = ds4_arena_take(a, T * K * D, 4);
        lt->sg1 = ds4_arena_take(a, T * I, 4);
        lt->sg3 = ds4_arena_take(a, T * I, 4);
        lt->a_ffn = ds4_arena_take(a, T * D, 4);
    }
    tp->X_L = ds4_arena_take(a, T * n * D, 4);
    tp->u_fin = ds4_arena_take(a, T * D, 4);
    tp->y_fin = ds4_arena_take(a, T * D, 4);
    tp->logits = ds4_arena_take(a, T * V, 4);
    tp->ids = ds4_arena_take(a, T, 8);
    tp->labels = ds4_arena_take(a, T, 8);
    tp->mtp_e = with_mtp ? ds4_arena_take(a, T * D, 4) : NULL;
    tp->mtp_en = with_mtp ? ds4_arena_take(a, T * D, 4) : NULL;
    tp->mtp_hn = with_mtp ? ds4_arena_take(a, T * n * D, 4) : NULL;
    tp->mtp_u = with_mtp ? ds4_arena_take(a, T * D, 4) : NULL;
    tp->mtp_y = with_mtp ? ds4_arena_take(a, T * D, 4) : NULL;
    tp->mtp_logits = with_mtp ? ds4_arena_take(a, T * V, 4) : NULL;
    tp->mtp_X = with_mtp ? ds4_arena_take(a, T * n * D, 4) : NULL;
}

/* Size (and grow) the tape's memory for (B, S). */
static ds4_status tape_reserve(const ds4_model *m, ds4_tape *tp, int64_t B, int64_t S, int with_mtp, ds4_error *err) {
    const int64_t nl = m->cfg.num_hidden_layers + 1;
    if (!tp->layers) {
        tp->layers = calloc((size_t)nl, sizeof *tp->layers);
        if (!tp->layers) return ds4_fail(err, DS4_ERR_OOM, "training forward: tape of %lld layers", (long long)nl);
    }
    ds4_arena a = {0};
    plan_tape(m, tp, &a, B, S, with_mtp);
    if (a.used > tp->bytes) {
        free(tp->mem);
        tp->mem = malloc(a.used);
        tp->bytes = tp->mem ? a.used : 0;
        if (!tp->mem)
            return ds4_fail(err, DS4_ERR_OOM, "training forward: activation tape of %zu bytes for ids [%lld, %lld]",
                            a.used, (long long)B, (long long)S);
    }
    ds4_arena w = {tp->mem, 0};
    plan_tape(m, tp, &w, B, S, with_mtp);
    return DS4_OK;
}

double ds4_ikl_eval(const ds4_config *c, const ds4_layer_tape *lt, int64_t T, int64_t S, int64_t sel_stride,
                    float *dI, double weight, int64_t *nq) {
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim;
    const float qscale = 1.0f / sqrtf((float)cI);
    double total = 0, sc[4096];
    int64_t count = 0;
    /* two passes: count the queries that define a loss (their mean is the loss), then losses and gradients */
    for (int64_t t = 0; t < T; t++) {
        double mass = 0;
        for (int64_t i = 0; i < lt->nsel[t]; i++) mass += lt->itgt[t * sel_stride + i];
        count += lt->nsel[t] > 0 && mass > 0;
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t k = lt->nsel[t], row = t / S;
        if (dI) memset(dI + t * sel_stride, 0, (size_t)sel_stride * sizeof(float));
        double mass = 0;
        for (int64_t i = 0; i < k; i++) mass += lt->itgt[t * sel_stride + i];
        if (k == 0 || !(mass > 0)) continue;
        /* the indexer scores of the picks, as the forward computed them (§3.5) */
        double mx = -INFINITY, den = 0, kl = 0;
        for (int64_t i = 0; i < k; i++) { /* k <= 4096: checked where indexer_kl is set */
            const float *key = lt->iK + (row * S + lt->sel[t * sel_stride + i]) * cI;
            float acc = 0;
            for (int64_t h = 0; h < nI; h++) {
                const float dot = ds4_dot(lt->iq + (t * nI + h) * cI, key, cI);
                acc += (dot > 0 ? dot * qscale : 0.0f) * lt->iw[t * nI + h];
            }
            sc[i] = acc;
            mx = acc > mx ? acc : mx;
        }
        for (int64_t i = 0; i < k; i++) den += exp(sc[i] - mx);
        for (int64_t i = 0; i < k; i++) {
            const double p = lt->itgt[t * sel_stride + i] / mass, lq = sc[i] - mx - log(den);
            if (p > 0) kl += p * (log(p) - lq);
            if (dI) dI[t * sel_stride + i] = (float)(weight / (double)count * (exp(lq) - p));
        }
        total += kl;
    }
    if (nq) *nq = count;
    return total;
}

void ds4_tape_free(ds4_tape *t) {
    if (!t) return;
    free(t->layers);
    free(t->mem);
    free(t->bmem);
    free(t);
}

ds4_status ds4_model_forward(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_error *err) {
    return ds4_fwd_run(m, args, res, NULL, err);
}

ds4_status ds4_model_forward_train(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res,
                                   ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "training forward: model is NULL");
    if (!m->grads) return ds4_fail(err, DS4_ERR_ARG, "training forward: gradients are not enabled (enable_grad)");
    if (!m->tape && !(m->tape = calloc(1, sizeof *m->tape)))
        return ds4_fail(err, DS4_ERR_OOM, "training forward: tape");
    if (!m->router_loads &&
        !(m->router_loads = calloc((size_t)((m->cfg.num_hidden_layers + 1) * m->cfg.n_routed_experts), sizeof(int64_t))))
        return ds4_fail(err, DS4_ERR_OOM, "training forward: router load counters");
    return ds4_fwd_run(m, args, res, m->tape, err);
}

ds4_status ds4_fwd_run(ds4_model *m, const ds4_forward_args *args, ds4_forward_result *res, ds4_tape *tape,
                       ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "forward: model is NULL");
    ds4_status s = check_args(m, args, err);
    if (s) return s;
    const int train_mtp = tape && m->topt.mtp_lambda > 0;
    if (tape) {
        if (!args->labels) return ds4_fail(err, DS4_ERR_ARG, "training forward: labels are required");
        if (train_mtp && !m->has_mtp)
            return ds4_fail(err, DS4_ERR_ARG, "training forward: mtp_lambda > 0 but the model has no mtp.0.* weights");
        if (train_mtp && args->seq < 3)
            return ds4_fail(err, DS4_ERR_SHAPE, "training forward: MTP loss needs seq >= 3 (ids [%lld, %lld])",
                            (long long)args->batch, (long long)args->seq);
        tape->valid = 0;
        s = tape_reserve(m, tape, args->batch, args->seq, train_mtp, err);
        if (s) return s;
    }
    const ds4_config *c = &m->cfg;
    fwd f;
    s = ds4_fwd_setup(m, &f, args->batch, args->seq, args->logits == NULL && args->labels != NULL, err);
    if (s) return s;
    f.tape = tape;

    const int64_t T = f.T, n = c->hc_mult, D = c->hidden_size, V = c->vocab_size;
    for (int64_t t = 0; t < T; t++) /* X⁰: n copies of the embedding */
        for (int64_t i = 0; i < n; i++)
            memcpy(f.X + (t * n + i) * D, m->embed + args->ids[t] * D, (size_t)D * sizeof(float));
    f.replay_experts = args->replay_experts;
    f.replay_index = args->replay_index;
    f.replay_on = 1;
    f.csa_i = 0;
    for (int64_t li = 0; li < c->num_hidden_layers; li++) {
        f.lt = tape ? &tape->layers[li] : NULL;
        f.li = li;
        block(&f, &m->layers[li], f.X, args->ids);
        f.csa_i += c->layer_types[li] == DS4_ATTN_CSA;
        if (args->hidden) memcpy(args->hidden + li * T * n * D, f.X, (size_t)(T * n * D) * sizeof(float));
    }
    f.lt = NULL;
    float *logits = tape ? tape->logits : (args->logits ? args->logits : f.logits_ws);
    ds4_forward_result r = {NAN, 0, NAN, 0, NAN};
    if (logits) {
        if (tape) {
            keep(tape->X_L, f.X, T * n * D);
            memcpy(tape->ids, args->ids, (size_t)T * sizeof(int64_t));
            memcpy(tape->labels, args->labels, (size_t)T * sizeof(int64_t));
        }
        lm_head(&f, f.X, m->hc_head_fn, m->hc_head_base, m->hc_head_scale, m->norm, logits,
                tape ? tape->u_fin : NULL, tape ? tape->y_fin : NULL);
        if (tape && args->logits) memcpy(args->logits, logits, (size_t)(T * V) * sizeof(float));
        if (args->labels) cross_entropy(logits, f.B, f.S, V, args->labels, f.S, 1, &r.loss, &r.loss_tokens);
    }
    float *mtp_logits = train_mtp ? tape->mtp_logits : args->mtp_logits;
    if (mtp_logits) {
        /* MTP (§5): position i < S-1 combines the final streams X^L_i with the embedding of token i+1 and
         * runs one more block over the S-1 positions; its logits predict token i+2. */
        const ds4_mtp_w *mt = &m->mtp;
        const int64_t S1 = f.S - 1, B = f.B, T1 = B * S1;
        int64_t *nxt = f.mtp_ids;
        /* e-term per token into h ([T1, D]); h-term per stream into Xz */
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < S1; i++) {
                const int64_t t1 = b * S1 + i;
                nxt[t1] = args->ids[b * f.S + i + 1];
                memcpy(f.a + t1 * D, m->embed + nxt[t1] * D, (size_t)D * sizeof(float));
                memcpy(f.Xt + t1 * n * D, f.X + (b * f.S + i) * n * D, (size_t)(n * D) * sizeof(float));
            }
        f.S = S1;
        f.T = T1;
        if (train_mtp) keep(tape->mtp_e, f.a, T1 * D);
        ds4_fwd_norm_rows(&f, f.a, mt->enorm, T1, D);
        matmul(&f, f.h, f.a, mt->e_proj, T1, D, D);
        ds4_fwd_norm_rows(&f, f.Xt, mt->hnorm, T1 * n, D);
        if (train_mtp) {
            keep(tape->mtp_en, f.a, T1 * D);
            keep(tape->mtp_hn, f.Xt, T1 * n * D);
        }
        matmul(&f, f.Xz, f.Xt, mt->h_proj, T1 * n, D, D);
        for (int64_t t = 0; t < T1; t++)
            for (int64_t i = 0; i < n; i++) ds4_axpy(f.Xz + (t * n + i) * D, 1.0f, f.h + t * D, D);
        f.lt = train_mtp ? &tape->layers[c->num_hidden_layers] : NULL;
        f.replay_on = 0; /* the MTP block routes itself */
        block(&f, &mt->block, f.Xz, nxt);
        f.lt = NULL;
        if (train_mtp) keep(tape->mtp_X, f.Xz, T1 * n * D);
        lm_head(&f, f.Xz, mt->hc_head_fn, mt->hc_head_base, mt->hc_head_scale, mt->norm, mtp_logits,
                train_mtp ? tape->mtp_u : NULL, train_mtp ? tape->mtp_y : NULL);
        if (train_mtp && args->mtp_logits) memcpy(args->mtp_logits, mtp_logits, (size_t)(T1 * V) * sizeof(float));
        if (args->labels)
            cross_entropy(mtp_logits, B, S1, V, args->labels, S1 + 1, 2, &r.mtp_loss, &r.mtp_loss_tokens);
    }
    if (tape && tape->with_ikl) {
        double sum = 0;
        int64_t nq_all = 0;
        for (int64_t li = 0; li < c->num_hidden_layers; li++) {
            if (c->layer_types[li] != DS4_ATTN_CSA) continue;
            int64_t nq = 0;
            const double kl = ds4_ikl_eval(c, &tape->layers[li], T, tape->S, tape->sel_stride, NULL, 1.0, &nq);
            if (nq > 0) sum += kl / (double)nq;
            nq_all += nq;
        }
        r.indexer_loss = nq_all ? sum : 0.0;
    }
    if (tape) {
        tape->valid = 1;
        tape->loss_tokens = r.loss_tokens;
        tape->mtp_tokens = train_mtp ? r.mtp_loss_tokens : 0;
        if (train_mtp && r.mtp_loss_tokens > 0) r.loss += m->topt.mtp_lambda * r.mtp_loss;
    }
    if (res) *res = r;
    return DS4_OK;
}

/* ------------------------------------------------------------------------------------------------ step */

static ds4_status check_step(const ds4_model *m, const ds4_step_args *a, int64_t *N, int64_t *Smax, ds4_error *err) {
    if (!m) return ds4_fail(err, DS4_ERR_ARG, "step: model is NULL");
    if (!a || !a->caches || !a->counts || !a->ids) return ds4_fail(err, DS4_ERR_ARG, "step: caches, counts or ids is NULL");
    if (a->nseq < 1 || a->nseq > (1 << 20))
        return ds4_fail(err, DS4_ERR_ARG, "step: %lld sequences outside [1, 2^20]", (long long)a->nseq);
    const int64_t V = m->cfg.vocab_size;
    int64_t n = 0, smax = 0;
    for (int64_t s = 0; s < a->nseq; s++) {
        const ds4_cache *c = a->caches[s];
        if (!c) return ds4_fail(err, DS4_ERR_ARG, "step: cache %lld is NULL", (long long)s);
        if (c->m != m) return ds4_fail(err, DS4_ERR_ARG, "step: cache %lld belongs to another model", (long long)s);
        if (a->counts[s] < 1 || a->counts[s] > (1 << 24))
            return ds4_fail(err, DS4_ERR_ARG, "step: sequence %lld has %lld new tokens (must be in [1, 2^24])",
                            (long long)s, (long long)a->counts[s]);
        if (c->len + a->counts[s] > c->cap)
            return ds4_fail(err, DS4_ERR_SHAPE, "step: sequence %lld: %lld cached + %lld new tokens exceed its capacity %lld",
                            (long long)s, (long long)c->len, (long long)a->counts[s], (long long)c->cap);
        n += a->counts[s];
        if (n > (1 << 24)) return ds4_fail(err, DS4_ERR_SHAPE, "step: more than 2^24 new tokens");
        smax = c->len + a->counts[s] > smax ? c->len + a->counts[s] : smax;
    }
    for (int64_t i = 0; i < n; i++)
        if (a->ids[i] < 0 || a->ids[i] >= V)
            return ds4_fail(err, DS4_ERR_ARG, "step: ids[%lld] = %lld outside [0, %lld) (%lld new tokens)", (long long)i,
                            (long long)a->ids[i], (long long)V, (long long)n);
    *N = n;
    *Smax = smax;
    return DS4_OK;
}

ds4_status ds4_model_step(ds4_model *m, const ds4_step_args *a, ds4_error *err) {
    int64_t N = 0, Smax = 0;
    ds4_status st = check_step(m, a, &N, &Smax, err);
    if (st) return st;
    /* a cache passed twice would be appended to twice from the same old state */
    const uint64_t serial = ++m->step_serial;
    for (int64_t s = 0; s < a->nseq; s++) {
        if (a->caches[s]->stamp == serial)
            return ds4_fail(err, DS4_ERR_ARG, "step: cache %lld appears twice among the %lld sequences", (long long)s,
                            (long long)a->nseq);
        a->caches[s]->stamp = serial;
    }
    const ds4_config *c = &m->cfg;
    const int64_t nseq = a->nseq, n = c->hc_mult, D = c->hidden_size, V = c->vocab_size;
    int64_t *pos = malloc((size_t)N * sizeof *pos);
    int32_t *rowseq = malloc((size_t)N * sizeof *rowseq);
    ds4_step_seq *seqs = malloc((size_t)nseq * sizeof *seqs);
    fwd f;
    if (!pos || !rowseq || !seqs) {
        st = ds4_fail(err, DS4_ERR_OOM, "step: row tables for %lld tokens of %lld sequences", (long long)N, (long long)nseq);
        goto done;
    }
    for (int64_t s = 0, r = 0; s < nseq; s++) {
        seqs[s] = (ds4_step_seq){.cache = a->caches[s], .p0 = a->caches[s]->len, .n = a->counts[s], .r0 = r};
        for (int64_t i = 0; i < a->counts[s]; i++, r++) {
            pos[r] = seqs[s].p0 + i;
            rowseq[r] = (int32_t)s;
        }
    }
    f = (fwd){.m = m, .c = c, .pool = m->engine->pool, .B = 0, .S = Smax, .T = N};
    st = fwd_plan(m, &f, 0, err);
    if (st) goto done;
    f.pos = pos;
    f.rowseq = rowseq;
    f.seqs = seqs;
    f.nseq = nseq;
    f.rec_experts = a->experts;
    f.rec_index = a->index_picks;
    for (int64_t t = 0; t < N; t++) /* X⁰: n copies of the embedding */
        for (int64_t i = 0; i < n; i++)
            memcpy(f.X + (t * n + i) * D, m->embed + a->ids[t] * D, (size_t)D * sizeof(float));
    f.csa_i = 0;
    for (int64_t li = 0; li < c->num_hidden_layers; li++) {
        f.li = li;
        block(&f, &m->layers[li], f.X, a->ids);
        f.csa_i += c->layer_types[li] == DS4_ATTN_CSA;
    }
    for (int64_t s = 0; s < nseq; s++) seqs[s].cache->len += seqs[s].n;
    if (a->logits) {
        lm_head(&f, f.X, m->hc_head_fn, m->hc_head_base, m->hc_head_scale, m->norm, a->logits, NULL, NULL);
        if (a->last_logits)
            for (int64_t s = 0; s < nseq; s++)
                memcpy(a->last_logits + s * V, a->logits + (seqs[s].r0 + seqs[s].n - 1) * V, (size_t)V * sizeof(float));
    } else if (a->last_logits) {
        /* only the last row of each sequence goes through the head: gather them into the front of Xt */
        for (int64_t s = 0; s < nseq; s++)
            memcpy(f.Xt + s * n * D, f.X + (seqs[s].r0 + seqs[s].n - 1) * n * D, (size_t)(n * D) * sizeof(float));
        f.T = nseq;
        lm_head(&f, f.Xt, m->hc_head_fn, m->hc_head_base, m->hc_head_scale, m->norm, a->last_logits, NULL, NULL);
    }
done:
    free(pos);
    free(rowseq);
    free(seqs);
    return st;
}
