/* optim.c — AdamW, global-norm gradient clipping and learning-rate schedules (ds4_train.h; raw-buffer
 * functions in optim.h).
 *
 * Reference: torch.optim.AdamW's single-tensor path (what torch runs for CPU tensors) and
 * torch.nn.utils.clip_grad_norm_. Per parameter tensor and update t (1-based, counted per tensor):
 *     p *= 1 - lr·wd                                  (decoupled decay, before the moments, decayed tensors only)
 *     m  = m + (1-β1)·(g - m)                         (exp_avg.lerp_(grad, 1-β1))
 *     v  = v·β2 + ((1-β2)·g)·g                        (exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1-β2))
 *     denom = sqrt(v) / sqrt(1-β2^t) + eps
 *     p  = p + (-(lr / (1-β1^t))·m) / denom           (param.addcdiv_(exp_avg, denom, value=-step_size))
 * Scalars are computed in double as Python does and rounded to fp32 where ATen converts its scalar argument to
 * the tensor's dtype; elementwise math is fp32 in the same operation order. The build does not contract a·b+c
 * into FMAs (ISO C mode), and ATen's vectorised lerp does, so m may differ from torch's by an ulp; the effect
 * on p is far below the ulp of p (tests/test_adamw.c measures it). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "internal.h"
#include "lora.h"
#include "model.h"
#include "ops.h"
#include "optim.h"

#define DS4_PI 3.14159265358979323846

/* ------------------------------------------------------------------------------------------------ raw */

ds4_adamw_coefs ds4_adamw_coefs_at(const ds4_adamw_hparams *h, int64_t t, double lr, int decay) {
    ds4_adamw_coefs c;
    c.decay = decay && h->weight_decay != 0.0;
    c.decay_mul = c.decay ? (float)(1.0 - lr * h->weight_decay) : 1.0f;
    c.one_m_b1 = (float)(1.0 - h->beta1);
    c.beta2 = (float)h->beta2;
    c.one_m_b2 = (float)(1.0 - h->beta2);
    /* torch: step = float(state_steps[i]); bias_correction1 = 1 - beta1 ** step (Python floats). */
    double bc1 = 1.0 - pow(h->beta1, (double)t);
    double bc2 = 1.0 - pow(h->beta2, (double)t);
    c.neg_step = (float)(-(lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2); /* Python's bc2 ** 0.5: both correctly rounded, so equal */
    c.eps = (float)h->eps;
    return c;
}

/* One element of the update: the scalar form of ds4_adamw_update (its SSE lanes compute the same bits). */
static inline void adamw_elem(const ds4_adamw_coefs *c, int small_w, float omw, float p, float g, float m, float v,
                              float *p_out, float *m_out, float *v_out) {
    const float pi = p * c->decay_mul; /* torch decays first, in its own pass; per element the same */
    const float mi = small_w ? m + c->one_m_b1 * (g - m) : g - (g - m) * omw;
    float vi = v * c->beta2;
    vi = vi + c->one_m_b2 * g * g;
    const float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
    *m_out = mi;
    *v_out = vi;
    *p_out = pi + c->neg_step * mi / denom;
}

#if defined(__SSE2__)
/* Four lanes of exactly the scalar expression of adamw_elem (for β1 < 0.5 lerp weights, the branch ATen takes):
 * SSE add/mul/div/sqrt are the IEEE-rounded fp32 operations, so the bits are the same (the scalar sqrtf also
 * cannot vectorise while it may set errno). */
typedef struct adamw_sse {
    __m128 w, b2, w2, ns, bs, eps, dm;
} adamw_sse;

static adamw_sse adamw_sse_coefs(const ds4_adamw_coefs *c) {
    adamw_sse k = {_mm_set1_ps(c->one_m_b1), _mm_set1_ps(c->beta2), _mm_set1_ps(c->one_m_b2),
                   _mm_set1_ps(c->neg_step), _mm_set1_ps(c->bc2_sqrt), _mm_set1_ps(c->eps), _mm_set1_ps(c->decay_mul)};
    return k;
}

/* The decayed parameters and the new moments. */
static inline void adamw_moments(const adamw_sse *k, __m128 p, __m128 g, __m128 m, __m128 v, __m128 *pi, __m128 *mi,
                                 __m128 *vi) {
    *pi = _mm_mul_ps(p, k->dm);
    *mi = _mm_add_ps(m, _mm_mul_ps(k->w, _mm_sub_ps(g, m)));
    *vi = _mm_add_ps(_mm_mul_ps(v, k->b2), _mm_mul_ps(_mm_mul_ps(k->w2, g), g));
}

static inline void adamw_lanes(const adamw_sse *k, __m128 p, __m128 g, __m128 m, __m128 v, __m128 *p_out,
                               __m128 *m_out, __m128 *v_out) {
    __m128 pi, mi, vi;
    adamw_moments(k, p, g, m, v, &pi, &mi, &vi);
    const __m128 den = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), k->bs), k->eps);
    *m_out = mi;
    *v_out = vi;
    *p_out = _mm_add_ps(pi, _mm_div_ps(_mm_mul_ps(k->ns, mi), den));
}
#endif

static inline float max_abs(float b, float x) { return fabsf(x) > b ? fabsf(x) : b; }

/* g (as scaled, written back when coef != 1) then the update: the same bits as ds4_grad_scale followed by
 * ds4_adamw_update, in one pass over memory. The bounds of what it wrote go to *bnd (the maxima cost nothing in a
 * pass that is memory bound). */
static void adamw_update_scaled(const ds4_adamw_coefs *c, float coef, float *p, float *g, float *m, float *v,
                                int64_t n, ds4_adamw_bounds *bnd) {
    /* ATen's lerp takes "start + w·(end - start)" for w < 0.5 and "end - (end - start)·(1 - w)" otherwise
     * (better rounding near either end); reproduce the branch it takes for this β1. */
    const int small_w = fabsf(c->one_m_b1) < 0.5f, scale = coef != 1.0f;
    const float omw = 1.0f - c->one_m_b1;
    ds4_adamw_bounds b = {0, 0, 0, 0};
    int64_t i = 0;
#if defined(__SSE2__)
    /* About 4x faster than the scalar loop on cached chunks, 1.8x on a 50M-parameter model (memory bound). */
    if (small_w) {
        const adamw_sse k = adamw_sse_coefs(c);
        const __m128 cf = _mm_set1_ps(coef), abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
        const __m128 zero = _mm_setzero_ps();
        __m128 bp = zero, bm = zero, bv = zero, bn = zero;
        for (; i + 4 <= n; i += 4) {
            __m128 pn, mn, vn, gi = _mm_loadu_ps(g + i);
            if (scale) {
                gi = _mm_mul_ps(gi, cf);
                _mm_storeu_ps(g + i, gi);
            }
            adamw_lanes(&k, _mm_loadu_ps(p + i), gi, _mm_loadu_ps(m + i), _mm_loadu_ps(v + i), &pn, &mn, &vn);
            _mm_storeu_ps(m + i, mn);
            _mm_storeu_ps(v + i, vn);
            _mm_storeu_ps(p + i, pn);
            bp = _mm_max_ps(bp, _mm_and_ps(pn, abs_mask));
            bm = _mm_max_ps(bm, _mm_and_ps(mn, abs_mask));
            bv = _mm_max_ps(bv, _mm_and_ps(vn, abs_mask));
            bn = _mm_max_ps(bn, _mm_sub_ps(zero, vn));
        }
        float lp[4], lm[4], lv[4], ln[4];
        _mm_storeu_ps(lp, bp);
        _mm_storeu_ps(lm, bm);
        _mm_storeu_ps(lv, bv);
        _mm_storeu_ps(ln, bn);
        for (int l = 0; l < 4; l++) {
            b.p = lp[l] > b.p ? lp[l] : b.p;
            b.m = lm[l] > b.m ? lm[l] : b.m;
            b.v = lv[l] > b.v ? lv[l] : b.v;
            b.neg_v = ln[l] > b.neg_v ? ln[l] : b.neg_v;
        }
    }
#endif
    for (; i < n; i++) {
        if (scale) g[i] *= coef;
        adamw_elem(c, small_w, omw, p[i], g[i], m[i], v[i], &p[i], &m[i], &v[i]);
        b.p = max_abs(b.p, p[i]);
        b.m = max_abs(b.m, m[i]);
        b.v = max_abs(b.v, v[i]);
        b.neg_v = -v[i] > b.neg_v ? -v[i] : b.neg_v;
    }
    if (bnd) *bnd = b;
}

void ds4_adamw_update_bounded(const ds4_adamw_coefs *c, float coef, float *p, float *g, float *m, float *v, int64_t n,
                              ds4_adamw_bounds *bnd) {
    adamw_update_scaled(c, coef, p, g, m, v, n, bnd);
}

void ds4_adamw_update(const ds4_adamw_coefs *c, float *p, const float *g, float *m, float *v, int64_t n) {
    adamw_update_scaled(c, 1.0f, p, (float *)g, m, v, n, NULL); /* coef 1: g is only read */
}

/* The proof of ds4_adamw_bounds_finite, in double on the bounds. Every fp32 operation of the update rounds its exact
 * result by a factor within 1 ± 2^-24, so each intermediate is at most its bound below times (1 + 2^-24)^6; a bound
 * under LIMIT (34x below FLT_MAX) therefore keeps every intermediate finite, and then no NaN can arise either: no
 * inf - inf or 0·inf, v' >= 0 under the square root (v >= 0, β2 >= 0, 1-β2 >= 0), den = sqrt(v')/bs + eps >= eps > 0
 * (no 0/0). The same reasoning as surely_finite below, with maxima in place of the elements. */
#define BOUNDS_LIMIT 1e37

int ds4_adamw_bounds_finite(const ds4_adamw_coefs *c, float coef, double gmax, const ds4_adamw_bounds *b) {
    if (!(c->eps > 0) || !isfinite(c->eps) || !isfinite(c->neg_step) || !isfinite(c->decay_mul) ||
        !(c->bc2_sqrt > 0) || !isfinite(c->bc2_sqrt) || !(c->beta2 >= 0) || !(c->one_m_b2 >= 0) ||
        !isfinite(c->one_m_b1) || !isfinite(coef))
        return 0;
    if (!(b->neg_v <= 0) || !(gmax >= 0)) return 0; /* a v < 0 (a loaded state) or no gradient bound: no proof */
    const double P = b->p, M = b->m, V = b->v, L = BOUNDS_LIMIT;
    const double gs = gmax * fabs((double)coef);            /* |g·coef| */
    const double d = gs + M;                                 /* |g - m| */
    const double w = fabs((double)c->one_m_b1), omw = fabs(1.0 - (double)c->one_m_b1);
    const double mb = fmax(M + w * d, gs + d * omw);        /* |m'|, either form of the lerp */
    const double vb = V * (double)c->beta2 + (double)c->one_m_b2 * gs * gs; /* v' = v·β2 + ((1-β2)·g)·g */
    const double ns = fabs((double)c->neg_step), step = ns * mb / (double)c->eps; /* |ns·m'/den|, den >= eps */
    const double pb = P * fabs((double)c->decay_mul) + step; /* |p·decay + step| */
    return P < L && gs < L && d < L && mb < L && vb < L && sqrt(vb) / (double)c->bc2_sqrt < L && ns * mb < L &&
           step < L && pb < L;
}

/* A cheap proof that an update stays finite, without its square root and divisions: when p·decay, m' and v' are
 * finite, the step ns·m'/den is at most |ns|·max|m'|/eps in size (den = sqrt(v')/bs + eps >= eps), so p' is finite
 * when that plus max|p·decay| is far below FLT_MAX. Training is always far below (|ns| ~ 1e-2, |m'| ~ 1, eps
 * 1e-8: 1e6); an lr of 1e38, eps = 0 or an overflowing v fail the proof and go to the exact count. */
static int surely_finite(const ds4_adamw_coefs *c, float coef, const float *p, const float *g, const float *m,
                         const float *v, int64_t n) {
    if (!(c->eps > 0) || !isfinite(c->neg_step) || !isfinite(c->decay_mul)) return 0;
    const int small_w = fabsf(c->one_m_b1) < 0.5f;
    const float omw = 1.0f - c->one_m_b1;
    float maxm = 0, maxp = 0, fin = 0;
    int64_t i = 0;
#if defined(__SSE2__)
    if (small_w) {
        const adamw_sse k = adamw_sse_coefs(c);
        const __m128 cf = _mm_set1_ps(coef), abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
        __m128 acc = _mm_setzero_ps(), mm = _mm_setzero_ps(), mp = _mm_setzero_ps();
        for (; i + 4 <= n; i += 4) {
            __m128 gi = _mm_loadu_ps(g + i), pi, mi, vi;
            if (coef != 1.0f) gi = _mm_mul_ps(gi, cf);
            adamw_moments(&k, _mm_loadu_ps(p + i), gi, _mm_loadu_ps(m + i), _mm_loadu_ps(v + i), &pi, &mi, &vi);
            /* x - x: 0 for a finite x, NaN otherwise; a NaN stays in the sum */
            acc = _mm_add_ps(acc, _mm_add_ps(_mm_sub_ps(pi, pi), _mm_add_ps(_mm_sub_ps(mi, mi), _mm_sub_ps(vi, vi))));
            mm = _mm_max_ps(mm, _mm_and_ps(mi, abs_mask));
            mp = _mm_max_ps(mp, _mm_and_ps(pi, abs_mask));
        }
        float a[4], b[4], d[4];
        _mm_storeu_ps(a, acc);
        _mm_storeu_ps(b, mm);
        _mm_storeu_ps(d, mp);
        for (int l = 0; l < 4; l++) {
            fin += a[l];
            maxm = b[l] > maxm ? b[l] : maxm;
            maxp = d[l] > maxp ? d[l] : maxp;
        }
    }
#endif
    for (; i < n; i++) {
        const float gi = coef == 1.0f ? g[i] : g[i] * coef;
        const float pi = p[i] * c->decay_mul;
        const float mi = small_w ? m[i] + c->one_m_b1 * (gi - m[i]) : gi - (gi - m[i]) * omw;
        const float vi = v[i] * c->beta2 + c->one_m_b2 * gi * gi;
        fin += (pi - pi) + (mi - mi) + (vi - vi);
        maxm = fabsf(mi) > maxm ? fabsf(mi) : maxm;
        maxp = fabsf(pi) > maxp ? fabsf(pi) : maxp;
    }
    return fin == 0 && fabs((double)c->neg_step) * (double)maxm / (double)c->eps + (double)maxp < 1e37;
}

int64_t ds4_adamw_count_nonfinite(const ds4_adamw_coefs *c, float coef, const float *p, const float *g,
                                  const float *m, const float *v, int64_t n) {
    if (surely_finite(c, coef, p, g, m, v, n)) return 0;
    const int small_w = fabsf(c->one_m_b1) < 0.5f;
    const float omw = 1.0f - c->one_m_b1;
    int64_t bad = 0, i = 0;
#if defined(__SSE2__)
    if (small_w) {
        /* the fast path only says whether any lane is non-finite: x - x is 0 for a finite x and NaN otherwise,
         * and a NaN stays in the running sum; the exact count is the scalar loop's, run only then */
        const adamw_sse k = adamw_sse_coefs(c);
        const __m128 cf = _mm_set1_ps(coef);
        __m128 acc = _mm_setzero_ps();
        for (; i + 4 <= n; i += 4) {
            __m128 gi = _mm_loadu_ps(g + i), pn, mn, vn;
            if (coef != 1.0f) gi = _mm_mul_ps(gi, cf); /* what ds4_grad_scale will write */
            adamw_lanes(&k, _mm_loadu_ps(p + i), gi, _mm_loadu_ps(m + i), _mm_loadu_ps(v + i), &pn, &mn, &vn);
            acc = _mm_add_ps(acc, _mm_add_ps(_mm_sub_ps(pn, pn), _mm_add_ps(_mm_sub_ps(mn, mn), _mm_sub_ps(vn, vn))));
        }
        if (_mm_movemask_ps(_mm_cmpunord_ps(acc, acc)) != 0) i = 0;
    }
#endif
    for (; i < n; i++) {
        float pn, mn, vn;
        adamw_elem(c, small_w, omw, p[i], coef == 1.0f ? g[i] : g[i] * coef, m[i], v[i], &pn, &mn, &vn);
        bad += !(isfinite(pn) && isfinite(mn) && isfinite(vn));
    }
    return bad;
}

void ds4_adamw_update_range(const ds4_adamw_hparams *h, int64_t t, double lr, float *p, const float *g, float *m,
                            float *v, int64_t n, int decay) {
    ds4_adamw_coefs c = ds4_adamw_coefs_at(h, t, lr, decay);
    ds4_adamw_update(&c, p, g, m, v, n);
}

int64_t ds4_optim_chunk_count(const ds4_optim_range *r, size_t n) {
    int64_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (r[i].n > 0) k += (r[i].n + DS4_OPTIM_CHUNK - 1) / DS4_OPTIM_CHUNK;
    return k;
}

void ds4_optim_make_chunks(const ds4_optim_range *r, size_t n, ds4_optim_chunk *chunks) {
    int64_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (int64_t b = 0; b < r[i].n; b += DS4_OPTIM_CHUNK) {
            chunks[k].range = i;
            chunks[k].begin = b;
            chunks[k].n = r[i].n - b < DS4_OPTIM_CHUNK ? r[i].n - b : DS4_OPTIM_CHUNK;
            k++;
        }
}

/* Sum of squares of one chunk in double. Eight independent accumulators in a fixed pattern (so the loop can use
 * vector lanes without reassociating anything the compiler would have to prove), combined in a fixed order. */
double ds4_optim_sumsq(const float *g, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            double x = (double)g[i + j];
            acc[j] += x * x;
        }
    for (; i < n; i++) {
        double x = (double)g[i];
        acc[0] += x * x;
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

typedef struct {
    const ds4_optim_range *r;
    const ds4_optim_chunk *chunks;
    double *partial;
    ds4_adamw_bounds *bnd; /* [n_chunks] what each chunk's update wrote (NULL: not wanted) */
    float coef;
} multi_ctx;

static void task_sumsq(void *vctx, int64_t i) {
    multi_ctx *c = vctx;
    const ds4_optim_chunk *k = &c->chunks[i];
    c->partial[i] = ds4_optim_sumsq(c->r[k->range].g + k->begin, k->n);
}

static void scale_chunk(float *g, int64_t n, float coef) {
    for (int64_t i = 0; i < n; i++) g[i] *= coef;
}

static void task_scale(void *vctx, int64_t i) {
    multi_ctx *c = vctx;
    const ds4_optim_chunk *k = &c->chunks[i];
    scale_chunk(c->r[k->range].g + k->begin, k->n, c->coef);
}

static void update_chunk(const ds4_optim_range *r, float coef, int64_t begin, int64_t n, ds4_adamw_bounds *bnd) {
    adamw_update_scaled(&r->c, coef, r->p + begin, r->g + begin, r->m + begin, r->v + begin, n, bnd);
}

static void task_update(void *vctx, int64_t i) {
    multi_ctx *c = vctx;
    const ds4_optim_chunk *k = &c->chunks[i];
    update_chunk(&c->r[k->range], c->coef, k->begin, k->n, c->bnd ? &c->bnd[i] : NULL);
}

static void bounds_merge(ds4_adamw_bounds *into, const ds4_adamw_bounds *b) {
    into->p = b->p > into->p ? b->p : into->p;
    into->m = b->m > into->m ? b->m : into->m;
    into->v = b->v > into->v ? b->v : into->v;
    into->neg_v = b->neg_v > into->neg_v ? b->neg_v : into->neg_v;
}

double ds4_grad_global_norm(const ds4_optim_range *r, size_t n, const ds4_optim_chunk *chunks, int64_t n_chunks,
                            double *partial, double *sumsq, ds4_pool *pool) {
    double total = 0;
    if (pool && chunks && partial && n_chunks > 0) {
        multi_ctx c = {.r = r, .chunks = chunks, .partial = partial};
        ds4_pool_run(pool, n_chunks, task_sumsq, &c);
        int64_t k = 0;
        for (size_t i = 0; i < n; i++) {
            double s = 0;
            for (; k < n_chunks && chunks[k].range == i; k++) s += partial[k];
            if (sumsq) sumsq[i] = s;
            total += s;
        }
    } else {
        /* The same chunking and the same order of additions as above. */
        for (size_t i = 0; i < n; i++) {
            double s = 0;
            for (int64_t b = 0; b < r[i].n; b += DS4_OPTIM_CHUNK)
                s += ds4_optim_sumsq(r[i].g + b, r[i].n - b < DS4_OPTIM_CHUNK ? r[i].n - b : DS4_OPTIM_CHUNK);
            if (sumsq) sumsq[i] = s;
            total += s;
        }
    }
    return sqrt(total);
}

float ds4_grad_clip_coef(double total_norm, double clip) {
    if (!(clip > 0)) return 1.0f;
    /* torch: clip_coef = max_norm / (total_norm + 1e-6) with total_norm an fp32 tensor; float / tensor is
     * tensor.reciprocal() * float; then clamp(max=1.0). All fp32. */
    float t = (float)total_norm + 1e-6f;
    float coef = (1.0f / t) * (float)clip;
    return coef < 1.0f ? coef : 1.0f;
}

void ds4_grad_scale(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks, int64_t n_chunks,
                    ds4_pool *pool) {
    if (coef == 1.0f) return;
    if (pool && chunks && n_chunks > 0) {
        multi_ctx c = {.r = r, .chunks = chunks, .coef = coef};
        ds4_pool_run(pool, n_chunks, task_scale, &c);
        return;
    }
    for (size_t i = 0; i < n; i++) scale_chunk(r[i].g, r[i].n, coef);
}

double ds4_grad_clip(const ds4_optim_range *r, size_t n, double clip, const ds4_optim_chunk *chunks,
                     int64_t n_chunks, double *partial, ds4_pool *pool, float *coef_out) {
    double total = ds4_grad_global_norm(r, n, chunks, n_chunks, partial, NULL, pool);
    float coef = ds4_grad_clip_coef(total, clip);
    ds4_grad_scale(r, n, coef, chunks, n_chunks, pool);
    if (coef_out) *coef_out = coef;
    return total;
}

void ds4_adamw_update_ranges(const ds4_optim_range *r, size_t n, const ds4_optim_chunk *chunks, int64_t n_chunks,
                             ds4_pool *pool) {
    ds4_adamw_update_ranges_scaled(r, n, 1.0f, chunks, n_chunks, pool);
}

void ds4_adamw_update_ranges_scaled(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                    int64_t n_chunks, ds4_pool *pool) {
    if (pool && chunks && n_chunks > 0) {
        multi_ctx c = {.r = r, .chunks = chunks, .coef = coef};
        ds4_pool_run(pool, n_chunks, task_update, &c);
        return;
    }
    for (size_t i = 0; i < n; i++) update_chunk(&r[i], coef, 0, r[i].n, NULL);
}

void ds4_adamw_update_ranges_bounded(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                     int64_t n_chunks, ds4_adamw_bounds *scratch, ds4_pool *pool,
                                     ds4_adamw_bounds *out) {
    *out = (ds4_adamw_bounds){0, 0, 0, 0};
    if (pool && chunks && scratch && n_chunks > 0) {
        multi_ctx c = {.r = r, .chunks = chunks, .bnd = scratch, .coef = coef};
        ds4_pool_run(pool, n_chunks, task_update, &c);
        for (int64_t k = 0; k < n_chunks; k++) bounds_merge(out, &scratch[k]);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ds4_adamw_bounds b;
        update_chunk(&r[i], coef, 0, r[i].n, &b);
        bounds_merge(out, &b);
    }
}

static int64_t nonfinite_chunk(const ds4_optim_range *r, int64_t begin, int64_t n, float coef) {
    return ds4_adamw_count_nonfinite(&r->c, coef, r->p + begin, r->g + begin, r->m + begin, r->v + begin, n);
}

static void task_nonfinite(void *vctx, int64_t i) {
    multi_ctx *c = vctx;
    const ds4_optim_chunk *k = &c->chunks[i];
    c->partial[i] = (double)nonfinite_chunk(&c->r[k->range], k->begin, k->n, c->coef);
}

int64_t ds4_adamw_count_nonfinite_ranges(const ds4_optim_range *r, size_t n, float coef, const ds4_optim_chunk *chunks,
                                         int64_t n_chunks, double *partial, ds4_pool *pool, size_t *first_range) {
    int64_t total = 0;
    *first_range = n;
    if (pool && chunks && partial && n_chunks > 0) {
        multi_ctx c = {.r = r, .chunks = chunks, .partial = partial, .coef = coef};
        ds4_pool_run(pool, n_chunks, task_nonfinite, &c);
        for (int64_t k = 0; k < n_chunks; k++) {
            if (partial[k] > 0 && chunks[k].range < *first_range) *first_range = chunks[k].range;
            total += (int64_t)partial[k];
        }
        return total;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t b = nonfinite_chunk(&r[i], 0, r[i].n, coef);
        if (b > 0 && i < *first_range) *first_range = i;
        total += b;
    }
    return total;
}

/* ------------------------------------------------------------------------------------------------ schedule */

double ds4_lr_at(const ds4_adamw_options *o, int64_t k) {
    if (!o) return 0.0;
    if (k < 0) k = 0;
    const int64_t W = o->warmup_steps > 0 ? o->warmup_steps : 0;
    double f = 1.0;
    if (k < W) {
        f = (double)(k + 1) / (double)W;
    } else if (o->schedule == DS4_LR_LINEAR || o->schedule == DS4_LR_COSINE) {
        /* Progress through the decay, clamped to 1 after total_steps (the rate stays at its floor). Written
         * as the fixture's LambdaLR lambda (tests/gen_fixtures.py) so the doubles come out identical:
         * min + (1 - min)·0.5·(1 + cos(π·prog)), multiplied into the base rate as LambdaLR does. */
        const int64_t span = o->total_steps - W;
        double prog = span > 0 ? (double)(k - W) / (double)span : 1.0;
        if (prog > 1.0) prog = 1.0;
        const double lo = o->min_lr_ratio;
        if (o->schedule == DS4_LR_COSINE) f = lo + (1.0 - lo) * 0.5 * (1.0 + cos(DS4_PI * prog));
        else f = lo + (1.0 - lo) * (1.0 - prog);
    }
    return o->lr * f;
}

/* ------------------------------------------------------------------------------------------------ optimizer */

struct ds4_adamw {
    ds4_model *model;
    ds4_adamw_options o;
    ds4_adamw_hparams h;
    int64_t steps;
    int64_t n_params;
    float *m, *v;                /* [n_params], parallel to the parameter buffer */
    size_t n_tensors;
    int64_t *tensor_steps;       /* [n_tensors] */
    /* Per-step scratch, sized at create for the worst case (every fp32 tensor trainable), so a step allocates
     * nothing. Trainability is re-read every step: ds4_model_set_train_options may change it. */
    ds4_optim_range *ranges;     /* [n_tensors] */
    size_t *range_tensor;        /* [n_tensors]: the tensor index of each range */
    ds4_optim_chunk *chunks;     /* [max_chunks] */
    double *partial;             /* [max_chunks] */
    int64_t max_chunks;
    /* a model on a device: the pieces and coefficients sent there, the per-piece counts read back */
    ds4_optim_piece *pieces;     /* [max_chunks] */
    ds4_adamw_coefs *coefs;      /* [n_tensors] */
    int64_t *bad;                /* [max_chunks] */
    /* ZeRO-1 (ds4_adamw_set_shard): m and v hold elements [lo, hi) only; roff / rlen every rank's region */
    int sharded;
    ds4_adamw_shard sh;
    int64_t lo, hi;
    int64_t *roff, *rlen;        /* [world] */
    int64_t *woff, *wlen;        /* [world] each region's bytes of a device model's working copy, in 4-byte units */
    ds4_optim_range *own;        /* [n_tensors] this rank's parts of the trainable tensors */
    size_t *own_of;              /* [n_tensors] the trainable range each part belongs to */
    ds4_optim_chunk *own_chunks; /* [max_chunks] */
    double *own_partial;         /* [max_chunks] */
    double *bad_ranges;          /* [n_tensors] refusal counts per trainable tensor, summed over ranks */
    const ds4_lora *lora;        /* the model's adapters when created on a model that carries them: then the optimizer
                                    steps them alone (moments and tensors are the adapters') */
    /* The finiteness proof from bounds (docs/design.md, "The optimizer's finiteness check"): what the last host update
     * wrote (bnd, over the tensors marked in covered), valid while bounds_ok and the model's write count is still
     * bounds_gen (nothing else wrote the parameters); cleared wherever the moments may change outside a step. */
    int bounds_ok;
    int grads_zeroed;            /* the last device step zeroed the model's gradients itself (options' zero_grad) */
    int exact_always;            /* ds4_adamw_set_exact_check: every step runs the exact pass */
    uint64_t bounds_gen;
    ds4_adamw_bounds bnd;
    unsigned char *covered;      /* [n_tensors] */
    ds4_adamw_bounds *chunk_bnd; /* [max_chunks] per-chunk bounds of an update on the pool */
    ds4_optim_wcast *wcast;      /* [max_chunks] a device step's pieces' places in the working copy (piece_casts) */
    ds4_cast_entry *wrest;       /* [max_chunks + n_tensors + 1] the cast table's runs no piece steps */
};

/* The tensors the optimizer steps: the model's, or its adapters' while it carries them. */
static size_t target_count(const ds4_model *m) { return m->lora ? m->lora->n_table : ds4_model_tensor_count(m); }
static int64_t target_numel(const ds4_model *m) { return m->lora ? m->lora->n : ds4_model_param_count(m); }

static ds4_status target_info(const ds4_model *m, size_t i, ds4_tensor_info *ti, ds4_error *err) {
    if (!m->lora) return ds4_model_tensor_info(m, i, ti, err);
    const ds4_lora_param *p = &m->lora->table[i];
    ti->offset = p->offset;
    ti->numel = p->numel;
    ti->elsewhere = 0;
    ti->is_param = 1;
    ti->trainable = ds4_lora_trainable(m, p);
    ti->decay = ti->trainable;
    return DS4_OK;
}

static const char *target_name(const ds4_model *m, size_t i) {
    return m->lora ? m->lora->table[i].name : m->table[i].name;
}

static ds4_status check_options(const ds4_adamw_options *o, ds4_error *err) {
    const char *w = "adamw create";
    if (!(isfinite(o->lr) && o->lr >= 0))
        return ds4_fail(err, DS4_ERR_ARG, "%s: lr = %g; expected a finite value >= 0", w, o->lr);
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1))
        return ds4_fail(err, DS4_ERR_ARG, "%s: betas = (%g, %g); each must lie in [0, 1)", w, o->beta1, o->beta2);
    if (!(isfinite(o->eps) && o->eps >= 0))
        return ds4_fail(err, DS4_ERR_ARG, "%s: eps = %g; expected a finite value >= 0", w, o->eps);
    if (!(isfinite(o->weight_decay) && o->weight_decay >= 0))
        return ds4_fail(err, DS4_ERR_ARG, "%s: weight_decay = %g; expected a finite value >= 0", w, o->weight_decay);
    if (isnan(o->clip) || isinf(o->clip))
        return ds4_fail(err, DS4_ERR_ARG, "%s: clip = %g; expected a finite norm (<= 0: no clipping)", w, o->clip);
    if (o->schedule != DS4_LR_CONSTANT && o->schedule != DS4_LR_LINEAR && o->schedule != DS4_LR_COSINE)
        return ds4_fail(err, DS4_ERR_ARG, "%s: schedule = %d; expected DS4_LR_CONSTANT, DS4_LR_LINEAR or DS4_LR_COSINE",
                        w, (int)o->schedule);
    if (o->warmup_steps < 0 || o->total_steps < 0)
        return ds4_fail(err, DS4_ERR_ARG, "%s: warmup_steps = %lld, total_steps = %lld; expected >= 0", w,
                        (long long)o->warmup_steps, (long long)o->total_steps);
    if (!(o->min_lr_ratio >= 0 && o->min_lr_ratio <= 1))
        return ds4_fail(err, DS4_ERR_ARG, "%s: min_lr_ratio = %g; expected a value in [0, 1]", w, o->min_lr_ratio);
    if (o->zero_grad != 0 && o->zero_grad != 1)
        return ds4_fail(err, DS4_ERR_ARG, "%s: zero_grad = %d; expected 0 or 1", w, (int)o->zero_grad);
    if (o->schedule != DS4_LR_CONSTANT && o->total_steps <= o->warmup_steps)
        return ds4_fail(err, DS4_ERR_ARG,
                        "%s: a %s schedule decays from the end of warm-up to total_steps, so total_steps (%lld) must "
                        "exceed warmup_steps (%lld)",
                        w, o->schedule == DS4_LR_LINEAR ? "linear" : "cosine", (long long)o->total_steps,
                        (long long)o->warmup_steps);
    return DS4_OK;
}

ds4_status ds4_adamw_create(ds4_model *m, const ds4_adamw_options *o, ds4_adamw **out, ds4_error *err) {
    if (!m || !o || !out)
        return ds4_fail(err, DS4_ERR_ARG, "adamw create: model, options and out must not be NULL");
    *out = NULL;
    ds4_status s = check_options(o, err);
    if (s) return s;
    const int64_t P = target_numel(m);
    const size_t T = target_count(m);
    /* Worst-case chunk count: every fp32 tensor trainable. */
    int64_t max_chunks = 0;
    for (size_t i = 0; i < T; i++) {
        ds4_tensor_info ti;
        if ((s = target_info(m, i, &ti, err))) {
            ds4_error_prefix(err, "adamw create: ");
            return s;
        }
        if (ti.is_param && ti.numel > 0) max_chunks += (ti.numel + DS4_OPTIM_CHUNK - 1) / DS4_OPTIM_CHUNK;
    }
    ds4_adamw *a = calloc(1, sizeof *a);
    if (!a) return ds4_fail(err, DS4_ERR_OOM, "adamw create: optimizer struct");
    a->model = m;
    a->lora = m->lora;
    a->o = *o;
    a->h = (ds4_adamw_hparams){.beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps, .weight_decay = o->weight_decay};
    a->n_params = P;
    a->n_tensors = T;
    a->max_chunks = max_chunks;
    size_t pn = (size_t)(P > 0 ? P : 1), tn = T ? T : 1, cn = (size_t)(max_chunks > 0 ? max_chunks : 1);
    a->m = calloc(pn, sizeof *a->m);
    a->v = calloc(pn, sizeof *a->v);
    a->tensor_steps = calloc(tn, sizeof *a->tensor_steps);
    a->ranges = calloc(tn, sizeof *a->ranges);
    a->range_tensor = calloc(tn, sizeof *a->range_tensor);
    a->chunks = calloc(cn, sizeof *a->chunks);
    a->partial = calloc(cn, sizeof *a->partial);
    a->pieces = calloc(cn, sizeof *a->pieces);
    a->coefs = calloc(tn, sizeof *a->coefs);
    a->bad = calloc(cn, sizeof *a->bad);
    a->covered = calloc(tn, sizeof *a->covered);
    a->chunk_bnd = calloc(cn, sizeof *a->chunk_bnd);
    a->wcast = calloc(cn, sizeof *a->wcast);
    a->wrest = calloc(cn + tn + 1, sizeof *a->wrest);
    if (!a->m || !a->v || !a->tensor_steps || !a->ranges || !a->range_tensor || !a->chunks || !a->partial ||
        !a->pieces || !a->coefs || !a->bad || !a->covered || !a->chunk_bnd || !a->wcast || !a->wrest) {
        ds4_adamw_free(a);
        return ds4_fail(err, DS4_ERR_OOM, "adamw create: moments for %lld parameters (%zu tensors)", (long long)P, T);
    }
    *out = a;
    return DS4_OK;
}

void ds4_adamw_free(ds4_adamw *a) {
    if (!a) return;
    /* moments held on the model's device are this optimizer's only copy: they go with it */
    if (a->model && a->model->moments_owner == a) a->model->moments_owner = NULL;
    if (a->model && a->model->lora && a->model->lora->moments_owner == a) a->model->lora->moments_owner = NULL;
    /* a sharded master's other regions can no longer be gathered through this optimizer (a read-back then refuses) */
    if (a->model && a->model->master_gather_ctx == a) a->model->master_gather = NULL, a->model->master_gather_ctx = NULL;
    free(a->pieces);
    free(a->coefs);
    free(a->bad);
    free(a->m);
    free(a->v);
    free(a->tensor_steps);
    free(a->ranges);
    free(a->range_tensor);
    free(a->chunks);
    free(a->partial);
    free(a->roff);
    free(a->own);
    free(a->own_of);
    free(a->own_chunks);
    free(a->own_partial);
    free(a->bad_ranges);
    free(a->covered);
    free(a->chunk_bnd);
    free(a->wcast);
    free(a->wrest);
    free(a);
}

int64_t ds4_adamw_steps(const ds4_adamw *a) { return a ? a->steps : 0; }

void ds4_adamw_set_exact_check(ds4_adamw *a, int always) {
    if (a) a->exact_always = always != 0;
}

/* Work below this many elements runs on the calling thread: waking the pool costs more than it saves. The
 * chunking is the same either way, so the result is too. */
#define SERIAL_BELOW ((int64_t)1 << 16)

/* The step on a backend the host cannot read (docs/design.md, "Training on a device"): the same stages as the host
 * step below — norm from per-piece sums of squares added in piece order, refusal of a non-finite norm or update, clip,
 * AdamW — run by the backend's optim_sumsq / adamw operations over the fp32 master weights, the gradients and the
 * moments it holds; then the working weights are cast from the master. Only the per-piece sums and counts cross to
 * the host. */
/* A step's statistics, then its gradient norm checked: torch would carry a NaN/Inf norm into every parameter; refuse
 * instead and leave the model untouched, so a caller can skip the batch. (The host and the device step alike.) */
static ds4_status step_norm_check(const ds4_adamw *a, size_t nr, double norm, double lr, ds4_adamw_stats *stats,
                                  ds4_error *err) {
    if (stats) {
        stats->lr = lr;
        stats->grad_norm = norm;
        stats->step = a->steps;
        stats->exact_check = 0;
    }
    if (!isfinite(norm))
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step %lld: the gradient norm over %zu trainable tensors is %g; parameters, moments "
                        "and the step count are unchanged",
                        (long long)a->steps + 1, nr, norm);
    return DS4_OK;
}

/* Whether the bounds kept from the last update prove this update of ranges r[0, n) finite without reading p, m, v
 * (docs/design.md, "The optimizer's finiteness check"): they still hold (nothing wrote the parameters since, as the
 * model's write count says, nor the moments), they cover the tensor of every range (range of[q] for part q; q when
 * of is NULL), and each range's coefficients pass ds4_adamw_bounds_finite. The gradient's bound is the global norm,
 * which no element exceeds (max |g_i| <= sqrt(Σ g_i²)), doubled against the rounding of a long sum in double: it
 * covers a sharded step's parts too, since every rank's norm is the whole model's. */
static int bounds_prove(const ds4_adamw *a, const ds4_optim_range *r, size_t n, const size_t *of, float coef,
                        double norm) {
    if (!a->bounds_ok || a->exact_always || a->bounds_gen != a->model->params_gen) return 0;
    for (size_t q = 0; q < n; q++)
        if (!a->covered[a->range_tensor[of ? of[q] : q]] || !ds4_adamw_bounds_finite(&r[q].c, coef, 2.0 * norm, &a->bnd))
            return 0;
    return 1;
}

/* A host step is about to write the parameters (or the adapters): a device copy follows before the next pass, and the
 * write is counted (so another optimizer of the same model sees it). Its own bounds are void until it keeps new ones. */
static void host_params_written(ds4_adamw *a) {
    a->bounds_ok = 0;
    if (a->lora) ds4_lora_params_changed(a->model);
    else ds4_model_params_changed(a->model);
}

/* What the update of ranges [0, n) (parts of ranges of[q], as in bounds_prove) wrote: the next step's bounds. */
static void bounds_keep(ds4_adamw *a, size_t n, const size_t *of, const ds4_adamw_bounds *b) {
    memset(a->covered, 0, a->n_tensors * sizeof *a->covered);
    for (size_t q = 0; q < n; q++) a->covered[a->range_tensor[of ? of[q] : q]] = 1;
    a->bnd = *b;
    a->bounds_gen = a->model->params_gen;
    a->bounds_ok = 1;
}

/* The end of a host step: the router biases (when their update is on), the stats' count. The biases are never
 * trainable (model.c), so no tensor the bounds cover changes: the write they count leaves the bounds valid. */
static ds4_status step_finish(ds4_adamw *a, ds4_adamw_stats *stats, ds4_error *err) {
    ds4_model *m = a->model;
    if (m->topt.router_bias_gamma > 0) {
        ds4_status s = ds4_model_update_router_bias(m, m->topt.router_bias_gamma, err);
        if (s) return s;
        if (a->bounds_ok) a->bounds_gen = m->params_gen;
    }
    if (stats) stats->step = a->steps;
    return DS4_OK;
}

/* ZeRO-1 on a device: this rank's pieces are the run [*k0, *k1) of the step's pieces that lie in its region (whole
 * pieces: a region is a run of pieces, and the pieces ascend in offset); unsharded, all of them. */
static void own_piece_run(const ds4_adamw *a, int64_t nc, int64_t *k0, int64_t *k1) {
    int64_t k = 0;
    if (a->sharded)
        while (k < nc && a->pieces[k].off < a->lo) k++;
    *k0 = k;
    if (a->sharded)
        while (k < nc && a->pieces[k].off < a->hi) k++;
    *k1 = a->sharded ? k : nc;
}

static ds4_status sharded_experts_norm(ds4_adamw *a, size_t nr, const double *sumsq, double *norm, ds4_error *err);
static ds4_status master_gather(void *ctx, float *params, ds4_error *err);
static ds4_status sharded_experts_refusals(ds4_model *m, int64_t *bad, ds4_error *err);

/* The refusal count of a device step, from the per-piece counts of pieces [k0, k1) (a->bad[k]): the total, and the
 * first trainable range with one in *first (nr when none). Sharded (ZeRO-1): counted per range and summed over the
 * ranks, so every rank refuses together; over sharded experts the total is summed over the ranks for the same reason. */
static ds4_status device_refusals(ds4_adamw *a, size_t nr, int64_t k0, int64_t k1, int64_t *bad, size_t *first,
                                  ds4_error *err) {
    *bad = 0;
    *first = nr;
    if (!a->sharded) {
        for (int64_t k = k0; k < k1; k++) {
            if (a->bad[k] > 0 && a->chunks[k].range < *first) *first = a->chunks[k].range;
            *bad += a->bad[k];
        }
        return a->model->ep_shard && !a->lora ? sharded_experts_refusals(a->model, bad, err) : DS4_OK;
    }
    memset(a->bad_ranges, 0, nr * sizeof *a->bad_ranges);
    for (int64_t k = k0; k < k1; k++) a->bad_ranges[a->chunks[k].range] += (double)a->bad[k];
    ds4_status s = a->sh.sum_f64(a->sh.ctx, a->bad_ranges, (int64_t)nr, err);
    if (s) {
        ds4_error_prefix(err, "adamw step (sharded): the refusal counts: ");
        return s;
    }
    for (size_t k = 0; k < nr; k++) {
        if (a->bad_ranges[k] > 0 && *first == nr) *first = k;
        *bad += (int64_t)a->bad_ranges[k];
    }
    return DS4_OK;
}

/* The device step's gradient norm from the per-piece sums (a->partial [nc], summed over the ranks under ZeRO-1): per
 * tensor, then the tensors in order, the host step's additions; over sharded experts the experts' sums come from
 * their owners (sharded_experts_norm). */
static ds4_status device_norm(ds4_adamw *a, size_t nr, int64_t nc, double *norm, ds4_error *err) {
    const int experts = a->model->ep_shard && !a->lora;
    double *sumsq = experts ? malloc((nr ? nr : 1) * sizeof *sumsq) : NULL, total = 0;
    if (experts && !sumsq) return ds4_fail(err, DS4_ERR_OOM, "adamw step: the norms of %zu tensors", nr);
    for (size_t i = 0, k = 0; i < nr; i++) {
        double t = 0;
        for (; k < (size_t)nc && a->chunks[k].range == i; k++) t += a->partial[k];
        if (sumsq) sumsq[i] = t;
        total += t;
    }
    *norm = sqrt(total);
    ds4_status s = experts ? sharded_experts_norm(a, nr, sumsq, norm, err) : DS4_OK;
    free(sumsq);
    return s;
}

/* ds4_optim_piece_casts (optim.h). Each run of rest ends at an entry's end or at a piece's start: at most ne + n. */
int ds4_optim_piece_casts(const ds4_cast_entry *e, int64_t ne, ds4_dtype mdt, const ds4_optim_piece *pc, int64_t n,
                          int64_t po, ds4_optim_wcast *w, ds4_cast_entry *rest, int64_t cap, int64_t *nrest) {
    const int64_t bf16 = mdt == DS4_BF16;
    *nrest = 0;
    if ((!e && ne) || !w || !rest || (mdt != DS4_BF16 && mdt != DS4_F32)) return 0;
    int64_t k = 0, done = ne > 0 ? e[0].src : 0; /* entry k's elements before `done` are stepped or in rest */
    for (int64_t c = 0; c <= n; c++) {
        const int64_t x = c < n ? pc[c].off - po : INT64_MAX; /* the piece's first element in the region */
        /* the table's elements before x that no piece covers: to rest */
        while (k < ne && done < x) {
            const int64_t end = e[k].src + e[k].n < x ? e[k].src + e[k].n : x, b = done > e[k].src ? done : e[k].src;
            const int64_t size = e[k].lowp && bf16 ? 2 : 4;
            if (b < end && *nrest == cap) return 0;
            if (b < end) rest[(*nrest)++] = (ds4_cast_entry){.src = b, .dst = e[k].dst + (b - e[k].src) * size,
                                                             .n = end - b, .lowp = e[k].lowp};
            done = end;
            if (done == e[k].src + e[k].n && ++k < ne) done = e[k].src;
        }
        if (c == n) break;
        w[c] = (ds4_optim_wcast){.dst = -1, .lowp = 0};
        if (k == ne || x < e[k].src) continue; /* no working copy: not an fp32 tensor of the table */
        if (x + pc[c].n > e[k].src + e[k].n) return 0;
        const int64_t size = e[k].lowp && bf16 ? 2 : 4, dst = e[k].dst + (x - e[k].src) * size;
        if (dst % size) return 0;
        w[c] = (ds4_optim_wcast){.dst = dst, .lowp = e[k].lowp};
        done = x + pc[c].n;
        if (done == e[k].src + e[k].n && ++k < ne) done = e[k].src;
    }
    return 1;
}

static ds4_status adamw_step_device(ds4_adamw *a, size_t nr, int64_t total_elems, ds4_adamw_stats *stats,
                                    ds4_error *err) {
    ds4_model *m = a->model;
    ds4_dev *d = m->dev;
    ds4_lora *l = m->lora;
    const int64_t nc = ds4_optim_chunk_count(a->ranges, nr);
    const size_t off_bad = (size_t)a->max_chunks * sizeof(double), off_pieces = 2 * off_bad,
                 off_coefs = off_pieces + (size_t)a->max_chunks * sizeof(ds4_optim_piece),
                 off_bnd = off_coefs + (a->n_tensors ? a->n_tensors : 1) * sizeof(ds4_adamw_coefs),
                 off_wcast = off_bnd + (size_t)a->max_chunks * sizeof(ds4_adamw_bounds),
                 off_wrest = off_wcast + (size_t)a->max_chunks * sizeof(ds4_optim_wcast),
                 scratch = off_wrest + (size_t)(a->max_chunks + a->n_tensors + 1) * sizeof(ds4_cast_entry);
    /* the moments this optimizer holds: elements [mo, mo + mn) of the flat buffer (a ZeRO-1 shard's, or all) */
    int64_t mo = 0, mn = 0;
    ds4_adamw_shard_region(a, &mo, &mn);
    /* with adapters: the scratch only; else the fp32 master of the same region as the moments (ZeRO-1: this rank's) */
    ds4_status s = ds4_model_master_ready(m, scratch, mn, mo, mn, err);
    if (s) return s;
    if (!l && a->sharded) { /* a read-back gathers the other regions through this optimizer's collective */
        m->master_gather = master_gather;
        m->master_gather_ctx = a;
    }
    const int64_t po = l ? 0 : m->master_lo;
    const size_t mbytes = (size_t)mn * sizeof(float);
    const int64_t vo = ds4_moments_stride(mn); /* v's place after m (model.h) */
    /* the buffers stepped: the model's fp32 master (then cast to the working copy), or the adapters, which are fp32
     * and read by the kernels directly */
    float **dmom = l ? &l->dmoments : &m->dmoments;
    const void **owner = l ? &l->moments_owner : &m->moments_owner;
    float **home = l ? l->moments_home : m->moments_home;
    if (l && !l->dmoments) {
        void *mem = NULL;
        if ((s = d->ops->alloc(d, 2 * (size_t)vo * sizeof(float), &mem, err))) {
            ds4_error_prefix(err, "adamw step: adapter moments on %s: ", ds4_model_device_name(m));
            return s;
        }
        l->dmoments = mem;
        l->moments_owner = NULL;
    }
    /* the bounds kept from a step describe the moments it left where it left them: those of the last device step
     * while the device copy is still this optimizer's; a ZeRO-1 shard keeps none (each rank would prove its region
     * alone; its steps always count) */
    if (*owner != a || a->sharded) a->bounds_ok = 0;
    if (*owner != a) { /* this optimizer's moments are on the host: send them */
        s = d->ops->upload(d, *dmom, a->m, mbytes, err);
        if (!s) s = d->ops->upload(d, *dmom + vo, a->v, mbytes, err);
        if (s) {
            ds4_error_prefix(err, "adamw step: the moments to %s: ", ds4_model_device_name(m));
            return s;
        }
        *owner = a;
        home[0] = a->m;
        home[1] = a->v;
    }
    char *sc = m->dscratch;
    double *d_partial = (double *)(void *)sc;
    int64_t *d_bad = (int64_t *)(void *)(sc + off_bad);
    ds4_optim_piece *d_pieces = (ds4_optim_piece *)(void *)(sc + off_pieces);
    ds4_adamw_coefs *d_coefs = (ds4_adamw_coefs *)(void *)(sc + off_coefs);
    ds4_adamw_bounds *d_bnd = (ds4_adamw_bounds *)(void *)(sc + off_bnd);
    ds4_optim_wcast *d_wcast = (ds4_optim_wcast *)(void *)(sc + off_wcast);
    ds4_cast_entry *d_wrest = (ds4_cast_entry *)(void *)(sc + off_wrest);
    float *grads = l ? l->dgrads : m->dgrads, *master = l ? l->dparams : m->dmaster, *mom = *dmom, *mov = *dmom + vo;
    const float *host_grads = l ? l->grads : m->grads;
    /* pieces in flat offsets: the ranges were built over the host buffers, whose offsets the device buffers share */
    ds4_optim_make_chunks(a->ranges, nr, a->chunks);
    for (int64_t k = 0; k < nc; k++) {
        const ds4_optim_chunk *c = &a->chunks[k];
        a->pieces[k] = (ds4_optim_piece){.off = (a->ranges[c->range].g - host_grads) + c->begin, .n = c->n,
                                         .range = (int64_t)c->range};
    }
    /* the pieces this rank steps (sharded: those of its region; the others' sums of squares are 0 here) */
    int64_t k0 = 0, k1 = 0;
    own_piece_run(a, nc, &k0, &k1);
    const int64_t no = k1 - k0;
    memset(a->partial, 0, (size_t)nc * sizeof *a->partial);
    ds4_dev_upload(d, d_pieces, a->pieces + k0, (size_t)no * sizeof *a->pieces);
    OP(d, optim_sumsq, .pieces = d_pieces, .n = no, .g = grads, .partial = d_partial);
    ds4_dev_download(d, a->partial + k0, d_partial, (size_t)no * sizeof(double));
    if ((s = ds4_dev_check(d, "adamw step: gradient norm: ", err))) return s;
    /* sharded: every piece's sum from its owner (the others add zeros, exactly) */
    if (a->sharded && (s = a->sh.sum_f64(a->sh.ctx, a->partial, nc, err))) {
        ds4_error_prefix(err, "adamw step (sharded): the gradient norm's partial sums: ");
        return s;
    }
    double norm = 0;
    if ((s = device_norm(a, nr, nc, &norm, err))) return s;
    const double lr = ds4_lr_at(&a->o, a->steps);
    s = step_norm_check(a, nr, norm, lr, stats, err);
    if (s) return s;
    const float coef = ds4_grad_clip_coef(norm, a->o.clip);
    for (size_t k = 0; k < nr; k++) {
        a->coefs[k] = ds4_adamw_coefs_at(&a->h, a->tensor_steps[a->range_tensor[k]] + 1, lr, a->ranges[k].c.decay);
        a->ranges[k].c = a->coefs[k]; /* what bounds_prove reads */
    }
    ds4_dev_upload(d, d_coefs, a->coefs, nr * sizeof *a->coefs);
    /* the bounds of the last update prove most steps finite (as on the host); else the check pass and its counts */
    const int proved = bounds_prove(a, a->ranges, nr, NULL, coef, norm);
    if (stats) stats->exact_check = !proved;
    if (proved) {
        memset(a->bad + k0, 0, (size_t)no * sizeof *a->bad);
    } else {
        OP(d, adamw, .pieces = d_pieces, .n = no, .coefs = d_coefs, .coef = coef, .p = master, .g = grads, .m = mom,
           .v = mov, .bad = d_bad, .update = 0, .mo = mo, .po = po);
        ds4_dev_download(d, a->bad + k0, d_bad, (size_t)no * sizeof(int64_t));
    }
    if ((s = ds4_dev_check(d, "adamw step: finiteness check: ", err))) return s;
    int64_t bad = 0;
    size_t first = nr;
    if ((s = device_refusals(a, nr, k0, k1, &bad, &first, err))) return s;
    if (bad > 0) {
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step %lld: the update would make %lld of %lld parameters non-finite (first in %s; lr %g, "
                        "gradient norm %g, clip %g); parameters, moments, gradients and the step count are unchanged",
                        (long long)a->steps + 1, (long long)bad, (long long)total_elems,
                        first < nr ? target_name(m, a->range_tensor[first]) : "?", lr, norm, a->o.clip);
    }
    a->bounds_ok = 0; /* until the bounds of this update are read back below */
    /* the working copy of the master's region (ZeRO-1: this rank's; the cast table is the region's): written by the
     * update for the pieces it steps and by a cast pass over the table's other runs (frozen tensors, the correction
     * biases), or, where a piece cannot be mapped (ds4_optim_piece_casts), by a cast pass over the whole table */
    int64_t nrest = 0;
    const int fused = !l && m->hcast &&
                      ds4_optim_piece_casts(m->hcast, m->n_cast, m->dev_w.mdt, a->pieces + k0, no, po, a->wcast,
                                            a->wrest, (int64_t)(a->max_chunks + a->n_tensors + 1), &nrest);
    if (fused) {
        ds4_dev_upload(d, d_wcast, a->wcast, (size_t)no * sizeof *a->wcast);
        ds4_dev_upload(d, d_wrest, a->wrest, (size_t)nrest * sizeof *a->wrest);
    }
    /* zero_grad (the model's own gradients, unsharded; else ds4_adamw_step zeroes them after the step): the update
     * does not write the clipped gradients back (4 of the 34 bytes it moves a parameter) and the buffer is filled with
     * zeros after it, which costs a GPU far less than a pass that writes values (bench/RESULTS.md) */
    const int zero_g = a->o.zero_grad && !l && !a->sharded;
    OP(d, adamw, .pieces = d_pieces, .n = no, .coefs = d_coefs, .coef = coef, .p = master, .g = grads, .m = mom,
       .v = mov, .update = 1, .mo = mo, .po = po, .bnd = a->sharded ? NULL : d_bnd, .wdst = fused ? m->dev_mem : NULL,
       .wcast = fused ? d_wcast : NULL, .wdt = m->dev_w.mdt, .skip_g = zero_g);
    if (zero_g) ds4_dev_fill(d, grads, 0, (size_t)m->n_params * sizeof(float));
    if (!l && !fused)
        OP(d, cast_params, .dst = m->dev_mem, .src = master, .e = m->dcast, .n = m->n_cast, .mdt = m->dev_w.mdt);
    else if (fused && nrest)
        OP(d, cast_params, .dst = m->dev_mem, .src = master, .e = d_wrest, .n = nrest, .mdt = m->dev_w.mdt);
    if (a->sharded) {
        /* every rank's region of the working copy from its owner, in its dtype (bf16: half the bytes of the fp32
         * master's); NCCL, on its own stream: the cast must have finished */
        s = ds4_dev_check(d, "adamw step (sharded): update: ", err);
        if (!s) s = ds4_model_working_regions(m, a->sh.world, a->roff, a->rlen, a->woff, a->wlen, err);
        if (!s) s = d->ops->sync(d, err);
        if (!s && (s = a->sh.gather_dev_f32(a->sh.ctx, (float *)m->dev_mem, a->woff, a->wlen, err)))
            ds4_error_prefix(err, "adamw step (sharded): gathering the updated working weights: ");
        if (s) {
            ds4_error_prefix(err, "the model's weights on the device may be partly updated: ");
            return s;
        }
    }
    /* the per-piece bounds of the update (16 bytes a piece; this waits for the update and the cast, which the next
     * forward would wait for anyway); a ZeRO-1 shard keeps none (its device steps run the check every time) */
    if (!a->sharded) ds4_dev_download(d, a->chunk_bnd, d_bnd, (size_t)no * sizeof *a->chunk_bnd);
    if ((s = ds4_dev_check(d, "adamw step: update: ", err))) {
        /* the update may be half written: the device copies cannot be trusted; say so */
        ds4_error_prefix(err, "the model's weights on the device may be partly updated: ");
        return s;
    }
    if (l) {
        l->host_stale = 1;
        l->grads_stale = 1;
    } else {
        m->host_stale = 1;
        m->grads_stale = 1; /* the clipped gradients (zeros with zero_grad) are in the device buffer */
        if (zero_g) m->grads_zero = 1, a->grads_zeroed = 1;
    }
    for (size_t k = 0; k < nr; k++) ++a->tensor_steps[a->range_tensor[k]];
    a->steps++;
    if (!a->sharded) {
        ds4_adamw_bounds b = {0, 0, 0, 0};
        for (int64_t k = 0; k < no; k++) bounds_merge(&b, &a->chunk_bnd[k]);
        bounds_keep(a, nr, NULL, &b);
    }
    return step_finish(a, stats, err);
}

ds4_status ds4_adamw_sync_state(ds4_adamw *a, ds4_error *err) {
    if (!a) return ds4_fail(err, DS4_ERR_ARG, "adamw state: optimizer is NULL");
    ds4_model *m = a->model;
    const void *owner = m->lora ? m->lora->moments_owner : m->moments_owner;
    float *dmom = m->lora ? m->lora->dmoments : m->dmoments;
    if (owner != a || !dmom) return DS4_OK;
    int64_t off = 0, len = 0; /* the moments held: the whole buffer's, or this rank's shard's (ZeRO-1) */
    ds4_adamw_shard_region(a, &off, &len);
    const size_t bytes = (size_t)len * sizeof(float);
    a->bounds_ok = 0; /* the host moments take the device's */
    ds4_status s = m->dev->ops->download(m->dev, a->m, dmom, bytes, err);
    if (!s) s = m->dev->ops->download(m->dev, a->v, dmom + ds4_moments_stride(len), bytes, err);
    if (s) ds4_error_prefix(err, "adamw state: reading the moments back from %s: ", ds4_model_device_name(m));
    return s;
}

void ds4_adamw_state_changed(ds4_adamw *a) {
    if (a) a->bounds_ok = 0; /* the caller wrote the moments: the next host step checks them in full */
    if (a && a->model && a->model->moments_owner == a) a->model->moments_owner = NULL; /* sent again at the next step */
    if (a && a->model && a->model->lora && a->model->lora->moments_owner == a) a->model->lora->moments_owner = NULL;
}

/* ------------------------------------------------------------------------------------------------ ZeRO-1 */

void ds4_adamw_shard_region(const ds4_adamw *a, int64_t *off, int64_t *len) {
    *off = a->sharded ? a->lo : 0;
    *len = a->sharded ? a->hi - a->lo : a->n_params;
}

/* The pieces of every fp32 tensor (trainable or not, so the layout does not move when trainability does), numbered
 * in buffer order: piece k's first element into *first (when k < the count), their count returned. */
static int64_t piece_at(ds4_model *m, size_t nt, int64_t k, int64_t *first, int64_t *end) {
    int64_t seen = 0;
    for (size_t i = 0; i < nt; i++) {
        ds4_tensor_info ti;
        if (ds4_model_tensor_info(m, i, &ti, NULL) || !ti.is_param || ti.numel <= 0) continue;
        const int64_t n = (ti.numel + DS4_OPTIM_CHUNK - 1) / DS4_OPTIM_CHUNK;
        if (k >= seen && k < seen + n) {
            *first = ti.offset + (k - seen) * DS4_OPTIM_CHUNK;
            *end = ti.offset + ti.numel < *first + DS4_OPTIM_CHUNK ? ti.offset + ti.numel : *first + DS4_OPTIM_CHUNK;
        }
        seen += n;
    }
    return seen;
}

ds4_model *ds4_adamw_model(const ds4_adamw *a) { return a ? a->model : NULL; }

int32_t ds4_adamw_shard_regions(const ds4_adamw *a, const int64_t **off, const int64_t **len) {
    *off = a && a->sharded ? a->roff : NULL;
    *len = a && a->sharded ? a->rlen : NULL;
    return a && a->sharded ? a->sh.world : 0;
}

ds4_status ds4_adamw_set_shard(ds4_adamw *a, const ds4_adamw_shard *s, ds4_error *err) {
    if (!a || !s || !s->sum_f64 || !s->gather_f32 || s->world < 1 || s->rank < 0 || s->rank >= s->world)
        return ds4_fail(err, DS4_ERR_ARG, "adamw shard: optimizer, collectives or rank %d of %d invalid",
                        s ? s->rank : -1, s ? s->world : -1);
    if (a->sharded) return ds4_fail(err, DS4_ERR_ARG, "adamw shard: the optimizer is sharded already");
    if (a->lora) return ds4_fail(err, DS4_ERR_UNSUPPORTED, "adamw shard: an optimizer of LoRA adapters is not sharded");
    ds4_model *m = a->model;
    if (m->ep_shard)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "adamw shard: the model's routed experts are sharded (expert "
                                                  "parallelism): ZeRO-1 on top of sharded experts is not supported");
    if (!m->dev->host_visible && !s->gather_dev_f32)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "adamw shard: the model is on %s and the collectives have no device "
                                                  "all-gather: a device model needs the NCCL communicator (Lua: "
                                                  "ds4.dist.init{device = \"cuda\"})", ds4_model_device_name(m));
    /* moments the optimizer keeps on the device come back first: the shard is cut from the current state */
    ds4_status st = ds4_adamw_sync_state(a, err);
    if (st) {
        ds4_error_prefix(err, "adamw shard: ");
        return st;
    }
    int64_t first = 0, end = 0;
    const int64_t pieces = piece_at(m, a->n_tensors, -1, &first, &end);
    const size_t W = (size_t)s->world, tn = a->n_tensors ? a->n_tensors : 1;
    const size_t cn = (size_t)(a->max_chunks > 0 ? a->max_chunks : 1);
    a->roff = calloc(4 * W, sizeof *a->roff);
    a->own = calloc(tn, sizeof *a->own);
    a->own_of = calloc(tn, sizeof *a->own_of);
    a->own_chunks = calloc(cn, sizeof *a->own_chunks);
    a->own_partial = calloc(cn, sizeof *a->own_partial);
    a->bad_ranges = calloc(tn, sizeof *a->bad_ranges);
    if (!a->roff || !a->own || !a->own_of || !a->own_chunks || !a->own_partial || !a->bad_ranges)
        return ds4_fail(err, DS4_ERR_OOM, "adamw shard: scratch for %zu tensors over %zu ranks", a->n_tensors, W);
    a->rlen = a->roff + W;
    a->woff = a->roff + 2 * W, a->wlen = a->roff + 3 * W;
    for (int32_t r = 0; r < s->world; r++) { /* the region of a run of pieces: its first's start, its last's end */
        int64_t p0 = 0, np = 0, last = 0;
        const int64_t q = pieces / s->world, rem = pieces % s->world;
        np = q + (r < rem);
        p0 = r * q + (r < rem ? r : rem);
        if (np == 0) continue;
        piece_at(m, a->n_tensors, p0, &a->roff[r], &last);
        piece_at(m, a->n_tensors, p0 + np - 1, &first, &end);
        a->rlen[r] = end - a->roff[r];
    }
    const int64_t lo = a->roff[s->rank], n = a->rlen[s->rank];
    float *mm = malloc((size_t)(n ? n : 1) * sizeof *mm), *vv = malloc((size_t)(n ? n : 1) * sizeof *vv);
    if (!mm || !vv) {
        free(mm);
        free(vv);
        return ds4_fail(err, DS4_ERR_OOM, "adamw shard: moments of %lld parameters", (long long)n);
    }
    memcpy(mm, a->m + lo, (size_t)n * sizeof *mm); /* the state so far, this rank's part */
    memcpy(vv, a->v + lo, (size_t)n * sizeof *vv);
    free(a->m);
    free(a->v);
    a->m = mm, a->v = vv;
    a->lo = lo, a->hi = lo + n;
    a->sh = *s;
    a->sharded = 1;
    ds4_adamw_state_changed(a); /* a model on a device gets the shard's moments at the next step */
    return DS4_OK;
}

/* The model's hook for reading a sharded master back (model.h, master_gather): params' other regions from their
 * owners, this rank's already downloaded. */
static ds4_status master_gather(void *ctx, float *params, ds4_error *err) {
    ds4_adamw *a = ctx;
    ds4_status s = a->sh.gather_f32(a->sh.ctx, params, a->roff, a->rlen, err);
    if (s)
        ds4_error_prefix(err, "reading the sharded master weights back (ZeRO-1; a collective: every rank reads the "
                              "weights back together): ");
    return s;
}

ds4_status ds4_adamw_gather_moments(ds4_adamw *a, float *m, float *v, ds4_error *err) {
    ds4_status s = ds4_adamw_sync_state(a, err); /* moments held on the model's device come back first */
    if (s) return s;
    /* a device master sharded by this optimizer comes back in the same collective call, so that a checkpoint of the
     * state and the weights (a save on one rank after it) finds the host's weights whole */
    if (a->model->master_gather_ctx == a && (s = ds4_model_host_sync(a->model, err))) return s;
    if (a->model->ep_shard && !a->lora) { /* sharded experts: the experts' moments from their owners */
        s = ds4_ep_gather(a->model, a->m, m, -1, err);
        if (!s) s = ds4_ep_gather(a->model, a->v, v, -1, err);
        if (s) ds4_error_prefix(err, "adamw gather moments: ");
        return s;
    }
    int64_t off = 0, len = 0;
    ds4_adamw_shard_region(a, &off, &len);
    memcpy(m + off, a->m, (size_t)len * sizeof *m);
    memcpy(v + off, a->v, (size_t)len * sizeof *v);
    if (!a->sharded) return DS4_OK;
    s = a->sh.gather_f32(a->sh.ctx, m, a->roff, a->rlen, err);
    if (!s) s = a->sh.gather_f32(a->sh.ctx, v, a->roff, a->rlen, err);
    if (s) ds4_error_prefix(err, "adamw gather moments: ");
    return s;
}

/* This rank's parts of the trainable ranges (within [lo, hi): whole pieces, so their chunks are the global
 * chunks that fall there), with the moments of its region; returns how many. */
static size_t own_parts(ds4_adamw *a, size_t nr, const float *grads) {
    size_t no = 0;
    for (size_t k = 0; k < nr; k++) {
        const ds4_optim_range *r = &a->ranges[k];
        const int64_t off = r->g - grads, b = off > a->lo ? off : a->lo;
        const int64_t e = off + r->n < a->hi ? off + r->n : a->hi;
        if (b >= e) continue;
        ds4_optim_range *o = &a->own[no];
        *o = *r;
        o->g = r->g + (b - off), o->p = r->p + (b - off);
        o->m = a->m + (b - a->lo), o->v = a->v + (b - a->lo);
        o->n = e - b;
        a->own_of[no++] = k;
    }
    return no;
}

/* The host step of a sharded optimizer: the unsharded step's stages, each on this rank's pieces, with the norm's
 * per-chunk sums and the refusal counts summed over ranks, then the parameters gathered. */
static ds4_status adamw_step_sharded(ds4_adamw *a, size_t nr, int64_t nc, float *grads, float *params, ds4_pool *pool,
                                     ds4_adamw_stats *stats, ds4_error *err) {
    ds4_model *m = a->model;
    const size_t no = own_parts(a, nr, grads);
    const int64_t noc = ds4_optim_chunk_count(a->own, no);
    ds4_optim_make_chunks(a->own, no, a->own_chunks);
    for (int64_t j = 0; j < noc; j++) a->own_partial[j] = ds4_optim_sumsq(a->own[a->own_chunks[j].range].g +
                                                                          a->own_chunks[j].begin, a->own_chunks[j].n);
    /* this rank's chunks are the global chunks inside [lo, hi), in the same order */
    int64_t j = 0;
    for (int64_t k = 0; k < nc; k++) {
        const int64_t at = (a->ranges[a->chunks[k].range].g - grads) + a->chunks[k].begin;
        a->partial[k] = at >= a->lo && at < a->hi && j < noc ? a->own_partial[j++] : 0.0;
    }
    if (j != noc)
        return ds4_fail(err, DS4_ERR_INTERNAL, "adamw step (sharded): %lld of this rank's %lld chunks matched",
                        (long long)j, (long long)noc);
    ds4_status s = a->sh.sum_f64(a->sh.ctx, a->partial, nc, err);
    if (s) {
        ds4_error_prefix(err, "adamw step (sharded): the gradient norm's partial sums: ");
        return s;
    }
    double total = 0; /* ds4_grad_global_norm's order: per tensor its chunks, then the tensors */
    for (int64_t k = 0; k < nc;) {
        double t = 0;
        const size_t i = a->chunks[k].range;
        for (; k < nc && a->chunks[k].range == i; k++) t += a->partial[k];
        total += t;
    }
    const double norm = sqrt(total), lr = ds4_lr_at(&a->o, a->steps);
    if ((s = step_norm_check(a, nr, norm, lr, stats, err))) return s;
    const float coef = ds4_grad_clip_coef(norm, a->o.clip);
    for (size_t q = 0; q < no; q++)
        a->own[q].c = ds4_adamw_coefs_at(&a->h, a->tensor_steps[a->range_tensor[a->own_of[q]]] + 1, lr,
                                         a->ranges[a->own_of[q]].c.decay);
    /* each rank proves its own parts or counts them (a proof means a count of 0), then the counts are summed */
    const int proved = bounds_prove(a, a->own, no, a->own_of, coef, norm);
    if (stats) stats->exact_check = !proved;
    memset(a->bad_ranges, 0, nr * sizeof *a->bad_ranges);
    for (size_t q = 0; q < no && !proved; q++) {
        const ds4_optim_range *o = &a->own[q];
        a->bad_ranges[a->own_of[q]] = (double)ds4_adamw_count_nonfinite(&o->c, coef, o->p, o->g, o->m, o->v, o->n);
    }
    if ((s = a->sh.sum_f64(a->sh.ctx, a->bad_ranges, (int64_t)nr, err))) {
        ds4_error_prefix(err, "adamw step (sharded): the refusal counts: ");
        return s;
    }
    int64_t bad = 0;
    size_t first = nr;
    for (size_t k = 0; k < nr; k++) {
        if (a->bad_ranges[k] > 0 && first == nr) first = k;
        bad += (int64_t)a->bad_ranges[k];
    }
    if (bad > 0) {
        const char *name = NULL;
        ds4_tensor view;
        if (ds4_model_tensor_at(m, a->range_tensor[first], &name, &view, NULL) != DS4_OK) name = "?";
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step %lld: the update would make %lld parameters non-finite (first in %s; lr %g, "
                        "gradient norm %g, clip %g); parameters, moments, gradients and the step count are unchanged",
                        (long long)a->steps + 1, (long long)bad, name, lr, norm, a->o.clip);
    }
    host_params_written(a);
    ds4_grad_scale(a->own, no, coef, a->own_chunks, noc, pool);
    for (size_t k = 0; k < nr; k++) ++a->tensor_steps[a->range_tensor[k]];
    ds4_adamw_bounds b;
    ds4_adamw_update_ranges_bounded(a->own, no, 1.0f, a->own_chunks, noc, a->chunk_bnd, pool, &b);
    a->steps++;
    if ((s = a->sh.gather_f32(a->sh.ctx, params, a->roff, a->rlen, err))) {
        ds4_error_prefix(err, "adamw step (sharded): gathering the updated parameters: ");
        return s;
    }
    /* the gather wrote the other ranks' regions only: this rank's parts are as its update left them */
    bounds_keep(a, no, a->own_of, &b);
    return step_finish(a, stats, err);
}

/* The gradient norm of a model whose routed experts are sharded (ep_shard.c), from this rank's per-range sums of
 * squares sumsq [nr] (its replicated tensors and its own experts; each the unsharded step's sum: the same chunks, in the
 * same order). The experts' are summed over the ranks (each expert has one owner and the others add zeros: exact), and
 * the sums are added in table order, every expert included — the norm of the model with every expert here, bit for
 * bit, the same on every rank. The host step and the device step (whose per-piece sums come from the backend) alike. */
static ds4_status sharded_experts_norm(ds4_adamw *a, size_t nr, const double *sumsq, double *norm, ds4_error *err) {
    ds4_model *m = a->model;
    double *ex = malloc((m->n_table + 1) * sizeof *ex);
    if (!ex) return ds4_fail(err, DS4_ERR_OOM, "adamw step: the norms of %zu tensors", m->n_table);
    memset(ex, 0, m->n_table * sizeof *ex);
    for (size_t k = 0; k < nr; k++)
        if (m->table[a->range_tensor[k]].routed) ex[a->range_tensor[k]] = sumsq[k];
    ds4_status s = ds4_ep_sum_f64(m, ex, (int64_t)m->n_table, err);
    if (s) {
        ds4_error_prefix(err, "adamw step (sharded experts): the experts' sums of squares: ");
        free(ex);
        return s;
    }
    double total = 0;
    size_t k = 0;
    for (size_t i = 0; i < m->n_table && !s; i++) {
        ds4_tensor_info ti;
        s = ds4_model_tensor_info(m, i, &ti, err);
        if (s || !ti.is_param || !ti.trainable || ti.numel <= 0) continue;
        const int here = !ti.elsewhere;
        total += m->table[i].routed ? ex[i] : sumsq[k];
        k += (size_t)here;
    }
    free(ex);
    if (!s && k != nr)
        s = ds4_fail(err, DS4_ERR_INTERNAL, "adamw step (sharded experts): %zu of %zu ranges matched", k, nr);
    *norm = sqrt(total);
    return s;
}

/* The host step's norm over sharded experts: this rank's per-range sums (ds4_grad_global_norm's chunks), then the
 * above. */
static ds4_status sharded_experts_norm_host(ds4_adamw *a, size_t nr, int64_t nc, ds4_pool *pool, double *norm,
                                            ds4_error *err) {
    double *sumsq = malloc((nr ? nr : 1) * sizeof *sumsq);
    if (!sumsq) return ds4_fail(err, DS4_ERR_OOM, "adamw step: the norms of %zu tensors", nr);
    ds4_grad_global_norm(a->ranges, nr, a->chunks, nc, a->partial, sumsq, pool);
    ds4_status s = sharded_experts_norm(a, nr, sumsq, norm, err);
    free(sumsq);
    return s;
}

/* Sharded experts: a count of refused updates summed over the ranks, so every rank refuses together. */
static ds4_status sharded_experts_refusals(ds4_model *m, int64_t *bad, ds4_error *err) {
    double b = (double)*bad;
    ds4_status s = ds4_ep_sum_f64(m, &b, 1, err);
    if (s) ds4_error_prefix(err, "adamw step (sharded experts): the refusal counts: ");
    else *bad = (int64_t)b;
    return s;
}

static ds4_status adamw_step_once(ds4_adamw *a, ds4_adamw_stats *stats, ds4_error *err);

ds4_status ds4_adamw_step(ds4_adamw *a, ds4_adamw_stats *stats, ds4_error *err) {
    if (!a) return ds4_fail(err, DS4_ERR_ARG, "adamw step: optimizer is NULL");
    a->grads_zeroed = 0;
    const ds4_status s = adamw_step_once(a, stats, err);
    /* zero_grad where the device step did not zero the buffer itself (the host, adapters, ZeRO-1) */
    if (!s && a->o.zero_grad && !a->grads_zeroed) ds4_model_zero_grad(a->model);
    return s;
}

static ds4_status adamw_step_once(ds4_adamw *a, ds4_adamw_stats *stats, ds4_error *err) {
    ds4_model *m = a->model;
    if (m->lora != a->lora)
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step: the model's LoRA adapters were %s since the optimizer was created; create a new "
                        "optimizer (it steps the adapters while the model carries them, else the weights)",
                        a->lora ? (m->lora ? "replaced" : "merged or dropped") : "attached");
    if (m->ep_shard && !m->lora && target_numel(m) != a->n_params)
        return ds4_fail(err, DS4_ERR_ARG, "adamw step: the model's routed experts were sharded (expert parallelism) "
                                          "after this optimizer was created for %lld parameters (the rank now holds "
                                          "%lld): create the optimizer after expert_parallel{shard = true}",
                        (long long)a->n_params, (long long)target_numel(m));
    if (target_numel(m) != a->n_params || target_count(m) != a->n_tensors)
        return ds4_fail(err, DS4_ERR_INTERNAL,
                        "adamw step: the model changed shape since the optimizer was created (%lld parameters in "
                        "%zu tensors, now %lld in %zu)",
                        (long long)a->n_params, a->n_tensors, (long long)target_numel(m), target_count(m));
    const int on_device = !m->dev->host_visible;
    ds4_lora *l = m->lora;
    if (on_device && (l ? l->grads && !l->dgrads : m->grads && !m->dgrads)) {
        ds4_status s = ds4_model_train_bind(m, err);
        if (s) return s;
    }
    /* on a device the host buffers only lend their offsets to the ranges (the arithmetic reads the device's) */
    float *grads = l ? l->grads : on_device ? m->grads : ds4_model_grads(m);
    if (l && !on_device) {
        ds4_status s = ds4_lora_host_sync(m, err);
        if (s) return s;
    }
    if (!grads)
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step: the model has no gradient buffer (enable gradients, run a training forward and "
                        "a backward first)");
    float *params = l ? l->params : on_device ? m->params : ds4_model_params(m);

    /* The trainable tensors, in parameter-buffer order (the order of the norm's sum). */
    size_t nr = 0;
    int64_t total_elems = 0;
    for (size_t i = 0; i < a->n_tensors; i++) {
        ds4_tensor_info ti;
        ds4_status s = target_info(m, i, &ti, err);
        if (s) {
            ds4_error_prefix(err, "adamw step: ");
            return s;
        }
        if (!ti.is_param || !ti.trainable || ti.numel <= 0 || ti.elsewhere) continue; /* elsewhere: its owner's */
        if (ti.offset < 0 || ti.numel > a->n_params - ti.offset)
            return ds4_fail(err, DS4_ERR_INTERNAL,
                            "adamw step: tensor %zu spans [%lld, %lld) outside the %lld-element parameter buffer", i,
                            (long long)ti.offset, (long long)(ti.offset + ti.numel), (long long)a->n_params);
        ds4_optim_range *r = &a->ranges[nr];
        memset(r, 0, sizeof *r);
        r->g = grads + ti.offset;
        r->p = params + ti.offset;
        r->m = a->sharded ? NULL : a->m + ti.offset; /* sharded: the moments of this rank's part only (own) */
        r->v = a->sharded ? NULL : a->v + ti.offset;
        r->n = ti.numel;
        r->c.decay = ti.decay; /* coefficients are filled in once the step is known to proceed */
        a->range_tensor[nr] = i;
        nr++;
        total_elems += ti.numel;
    }
    /* The model lays its tensors out in table order, so offsets ascend; check it rather than sort, since an
     * overlap (an element updated twice, e.g. an aliased tied head listed as its own tensor) would be a bug. */
    for (size_t k = 1; k < nr; k++)
        if (a->ranges[k].g < a->ranges[k - 1].g + a->ranges[k - 1].n)
            return ds4_fail(err, DS4_ERR_INTERNAL,
                            "adamw step: trainable tensors %zu and %zu overlap or are out of offset order in the "
                            "parameter buffer",
                            a->range_tensor[k - 1], a->range_tensor[k]);

    int64_t nc = ds4_optim_chunk_count(a->ranges, nr);
    if (nc > a->max_chunks)
        return ds4_fail(err, DS4_ERR_INTERNAL, "adamw step: %lld chunks > the %lld planned at create", (long long)nc,
                        (long long)a->max_chunks);
    if (on_device && a->sharded && !a->sh.gather_dev_f32)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "adamw step: the optimizer was sharded (ZeRO-1) without a device "
                                                  "all-gather and the model is now on %s: shard it with the NCCL "
                                                  "communicator (Lua: ds4.dist.init{device = \"cuda\"})",
                        ds4_model_device_name(m));
    if (on_device) return adamw_step_device(a, nr, total_elems, stats, err);
    ds4_optim_make_chunks(a->ranges, nr, a->chunks);
    ds4_pool *pool = total_elems >= SERIAL_BELOW ? m->engine->pool : NULL;
    if (a->sharded) return adamw_step_sharded(a, nr, nc, grads, params, pool, stats, err);

    double norm = 0;
    ds4_status s = m->ep_shard && !l ? sharded_experts_norm_host(a, nr, nc, pool, &norm, err)
                                     : (norm = ds4_grad_global_norm(a->ranges, nr, a->chunks, nc, a->partial, NULL, pool),
                                        DS4_OK);
    if (s) return s;
    double lr = ds4_lr_at(&a->o, a->steps);
    s = step_norm_check(a, nr, norm, lr, stats, err);
    if (s) return s;
    float coef = ds4_grad_clip_coef(norm, a->o.clip);
    for (size_t k = 0; k < nr; k++)
        a->ranges[k].c = ds4_adamw_coefs_at(&a->h, a->tensor_steps[a->range_tensor[k]] + 1, lr, a->ranges[k].c.decay);
    /* A finite gradient can still give non-finite weights (an lr of 1e38 overflows the step; huge gradients
     * overflow v): refuse such an update whole, so that the model is never left half-updated or poisoned. The
     * bounds the last update left prove most steps finite from a few scalars; otherwise the update is computed
     * without being written (one extra read of p, g, m, v). */
    size_t first = nr;
    const int proved = bounds_prove(a, a->ranges, nr, NULL, coef, norm);
    if (stats) stats->exact_check = !proved;
    int64_t bad = proved ? 0 : ds4_adamw_count_nonfinite_ranges(a->ranges, nr, coef, a->chunks, nc, a->partial, pool,
                                                                &first);
    if (m->ep_shard && !l && (s = sharded_experts_refusals(m, &bad, err))) return s;
    if (bad > 0) {
        const char *name = first < nr ? target_name(m, a->range_tensor[first]) : "?";
        return ds4_fail(err, DS4_ERR_ARG,
                        "adamw step %lld: the update would make %lld of %lld parameters non-finite (first in %s; lr %g, "
                        "gradient norm %g, clip %g); parameters, moments, gradients and the step count are unchanged",
                        (long long)a->steps + 1, (long long)bad, (long long)total_elems, name, lr, norm, a->o.clip);
    }
    host_params_written(a);
    for (size_t k = 0; k < nr; k++) ++a->tensor_steps[a->range_tensor[k]];
    ds4_adamw_bounds b; /* clips the gradients as it goes */
    ds4_adamw_update_ranges_bounded(a->ranges, nr, coef, a->chunks, nc, a->chunk_bnd, pool, &b);
    a->steps++;
    bounds_keep(a, nr, NULL, &b);
    return step_finish(a, stats, err);
}

void ds4_adamw_put_moments(ds4_adamw *a, const float *m, const float *v) {
    if (a->model->ep_shard && !a->lora) {
        ds4_ep_scatter(a->model, m, a->m);
        ds4_ep_scatter(a->model, v, a->v);
    } else {
        int64_t off = 0, len = 0;
        ds4_adamw_shard_region(a, &off, &len);
        memcpy(a->m, m + off, (size_t)len * sizeof *m);
        memcpy(a->v, v + off, (size_t)len * sizeof *v);
    }
    ds4_adamw_state_changed(a); /* a model on a device gets these moments at the next step */
}

void ds4_adamw_get_state(ds4_adamw *a, ds4_adamw_state *out) {
    a->bounds_ok = 0; /* the moments are handed out writable: the next step checks them in full */
    out->m = a->m;
    out->v = a->v;
    out->n_params = a->n_params;
    out->n_whole = a->model->ep_shard && !a->lora ? a->model->n_full : a->n_params;
    ds4_adamw_shard_region(a, &out->m_offset, &out->m_count);
    out->tensor_steps = a->tensor_steps;
    out->n_tensors = a->n_tensors;
    out->steps = &a->steps;
}

const ds4_adamw_options *ds4_adamw_get_options(const ds4_adamw *a) { return &a->o; }
