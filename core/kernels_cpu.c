/* kernels_cpu.c — see kernels_cpu.h. */
#include "kernels_cpu.h"

#include "lanes8.h"

__attribute__((always_inline)) static inline float hsum8(const v8f *p) {
    const v8f v = *p;
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Every dot product's lane step is c + a·b rounded once (lanes8.h): the FMA instruction where the CPU has one, else
 * the C library's fmaf, which rounds the same (IEEE 754 fusedMultiplyAdd), so every machine gives the same bits. The
 * instruction is picked per call by a CPUID test (ds4_cpu_fma), not by an ifunc, so sanitizer builds run it too. */
int ds4_cpu_fma(void) {
#ifdef DS4_X86_FMA
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#define DOT_BODY(FMA8)                                                                                              \
    v8f acc = {0};                                                                                                 \
    int64_t k = 0;                                                                                                 \
    for (; k + 8 <= n; k += 8) acc = FMA8(acc, ld8(a + k), ld8(b + k));                                           \
    float s = hsum8(&acc);                                                                                         \
    for (; k < n; k++) s = fmaf(a[k], b[k], s);                                                                    \
    return s;

static float dot_soft(const float *a, const float *b, int64_t n) { DOT_BODY(fma8_soft) }
#ifdef DS4_X86_FMA
DS4_FMA_TARGET static float dot_hw(const float *a, const float *b, int64_t n) { DOT_BODY(fma8_hw) }
#endif

float ds4_dot(const float *a, const float *b, int64_t n) {
#ifdef DS4_X86_FMA
    if (ds4_cpu_fma()) return dot_hw(a, b, n);
#endif
    return dot_soft(a, b, n);
}

/* A 4-row × 3-output register tile over the whole K: 12 vector accumulators plus 3 weight vectors and one input
 * vector fit the 16 AVX registers; each step loads 7 vectors for 12 vector multiply-adds. Every output element is
 * one ds4_dot-style 8-lane sum, so tiles, remainders and thread splits all give identical bits. Row o of W is wp[o]
 * when wp is given, else W + o·K. */
#define DOT_BLOCK_BODY(FMA8, DOT)                                                                                   \
    const int64_t K8 = K & ~(int64_t)7;                                                                            \
    int64_t t = 0;                                                                                                 \
    for (; t + 4 <= nx; t += 4) {                                                                                  \
        const float *x0 = x + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;                             \
        int64_t o = 0;                                                                                             \
        for (; o + 3 <= nw; o += 3) {                                                                              \
            const float *w0 = wp ? wp[o] : W + o * K, *w1 = wp ? wp[o + 1] : w0 + K, *w2 = wp ? wp[o + 2] : w1 + K; \
            v8f c00 = {0}, c01 = {0}, c02 = {0}, c10 = {0}, c11 = {0}, c12 = {0};                                  \
            v8f c20 = {0}, c21 = {0}, c22 = {0}, c30 = {0}, c31 = {0}, c32 = {0};                                  \
            for (int64_t k = 0; k < K8; k += 8) {                                                                  \
                const v8f u0 = ld8(w0 + k), u1 = ld8(w1 + k), u2 = ld8(w2 + k);                              \
                v8f v = ld8(x0 + k);                                                                             \
                c00 = FMA8(c00, v, u0), c01 = FMA8(c01, v, u1), c02 = FMA8(c02, v, u2);                            \
                v = ld8(x1 + k);                                                                                 \
                c10 = FMA8(c10, v, u0), c11 = FMA8(c11, v, u1), c12 = FMA8(c12, v, u2);                            \
                v = ld8(x2 + k);                                                                                 \
                c20 = FMA8(c20, v, u0), c21 = FMA8(c21, v, u1), c22 = FMA8(c22, v, u2);                            \
                v = ld8(x3 + k);                                                                                 \
                c30 = FMA8(c30, v, u0), c31 = FMA8(c31, v, u1), c32 = FMA8(c32, v, u2);                            \
            }                                                                                                      \
            float r[12] = {hsum8(&c00), hsum8(&c01), hsum8(&c02), hsum8(&c10), hsum8(&c11), hsum8(&c12),           \
                           hsum8(&c20), hsum8(&c21), hsum8(&c22), hsum8(&c30), hsum8(&c31), hsum8(&c32)};          \
            const float *xs[4] = {x0, x1, x2, x3}, *ws[3] = {w0, w1, w2};                                          \
            for (int i = 0; i < 4; i++)                                                                            \
                for (int j = 0; j < 3; j++) {                                                                      \
                    float acc = r[i * 3 + j];                                                                      \
                    for (int64_t k = K8; k < K; k++) acc = fmaf(xs[i][k], ws[j][k], acc);                          \
                    y[(t + i) * ldy + o + j] = acc;                                                                \
                }                                                                                                  \
        }                                                                                                          \
        for (; o < nw; o++)                                                                                        \
            for (int i = 0; i < 4; i++) y[(t + i) * ldy + o] = DOT(x + (t + i) * ldx, wp ? wp[o] : W + o * K, K);  \
    }                                                                                                              \
    for (; t < nx; t++)                                                                                            \
        for (int64_t o = 0; o < nw; o++) y[t * ldy + o] = DOT(x + t * ldx, wp ? wp[o] : W + o * K, K);

static void dot_block_soft(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t nx, const float *const *wp,
                           const float *W, int64_t nw, int64_t K) {
    DOT_BLOCK_BODY(fma8_soft, dot_soft)
}

#ifdef DS4_X86_FMA
DS4_FMA_TARGET static void dot_block_hw(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t nx,
                                    const float *const *wp, const float *W, int64_t nw, int64_t K) {
    DOT_BLOCK_BODY(fma8_hw, dot_hw)
}
#endif

static void dot_block(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t nx, const float *const *wp,
                      const float *W, int64_t nw, int64_t K) {
#ifdef DS4_X86_FMA
    if (ds4_cpu_fma()) {
        dot_block_hw(y, ldy, x, ldx, nx, wp, W, nw, K);
        return;
    }
#endif
    dot_block_soft(y, ldy, x, ldx, nx, wp, W, nw, K);
}

void ds4_dots_ptr(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t nx, const float *const *w, int64_t nw,
                  int64_t K) {
    dot_block(y, ldy, x, ldx, nx, w, NULL, nw, K);
}

/* o[h·ldo + i] (+)= Σ_k p[h·ldp + k]·v[k][i] for h < nh, i < n, summed in increasing k onto +0 (or onto o when acc):
 * for every element the additions that zeroing o (or not) and ds4_axpy(o_h, p[h][k], v[k]) for k = 0, 1, .. make,
 * with a block of o held in registers across all of k instead of reloaded for every k: 4 rows × 16 columns, or one
 * row × 32 columns where fewer than 4 rows are left. */
DS4_CLONES
void ds4_wsum_ptr(float *o, int64_t ldo, const float *p, int64_t ldp, int64_t nh, const float *const *v, int64_t nk,
                  int64_t n, int acc) {
    const int64_t n16 = n & ~(int64_t)15, n32 = n & ~(int64_t)31;
    int64_t h = 0;
    for (; h + 4 <= nh; h += 4) {
        const float *p0 = p + h * ldp, *p1 = p0 + ldp, *p2 = p1 + ldp, *p3 = p2 + ldp;
        for (int64_t i = 0; i < n16; i += 16) {
            float *q = o + h * ldo + i;
            v8f a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
            if (acc) {
                a0 = ld8(q), b0 = ld8(q + 8), a1 = ld8(q + ldo), b1 = ld8(q + ldo + 8);
                a2 = ld8(q + 2 * ldo), b2 = ld8(q + 2 * ldo + 8), a3 = ld8(q + 3 * ldo), b3 = ld8(q + 3 * ldo + 8);
            }
            for (int64_t k = 0; k < nk; k++) {
                const v8f x = ld8(v[k] + i), z = ld8(v[k] + i + 8);
                v8f s = {p0[k], p0[k], p0[k], p0[k], p0[k], p0[k], p0[k], p0[k]};
                a0 += s * x, b0 += s * z;
                s = (v8f){p1[k], p1[k], p1[k], p1[k], p1[k], p1[k], p1[k], p1[k]};
                a1 += s * x, b1 += s * z;
                s = (v8f){p2[k], p2[k], p2[k], p2[k], p2[k], p2[k], p2[k], p2[k]};
                a2 += s * x, b2 += s * z;
                s = (v8f){p3[k], p3[k], p3[k], p3[k], p3[k], p3[k], p3[k], p3[k]};
                a3 += s * x, b3 += s * z;
            }
            memcpy(q, &a0, 32), memcpy(q + 8, &b0, 32), q += ldo;
            memcpy(q, &a1, 32), memcpy(q + 8, &b1, 32), q += ldo;
            memcpy(q, &a2, 32), memcpy(q + 8, &b2, 32), q += ldo;
            memcpy(q, &a3, 32), memcpy(q + 8, &b3, 32);
        }
    }
    for (int64_t r = h; r < nh; r++) {
        const float *pr = p + r * ldp;
        for (int64_t i = 0; i < n32; i += 32) {
            float *q = o + r * ldo + i;
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            if (acc) a0 = ld8(q), a1 = ld8(q + 8), a2 = ld8(q + 16), a3 = ld8(q + 24);
            for (int64_t k = 0; k < nk; k++) {
                const v8f s = {pr[k], pr[k], pr[k], pr[k], pr[k], pr[k], pr[k], pr[k]};
                const float *x = v[k] + i;
                a0 += s * ld8(x), a1 += s * ld8(x + 8), a2 += s * ld8(x + 16), a3 += s * ld8(x + 24);
            }
            memcpy(q, &a0, 32), memcpy(q + 8, &a1, 32), memcpy(q + 16, &a2, 32), memcpy(q + 24, &a3, 32);
        }
    }
    /* the rest: columns past the blocks, one scalar sum each */
    for (int64_t r = 0; r < nh; r++)
        for (int64_t i = r < h ? n16 : n32; i < n; i++) {
            float s = acc ? o[r * ldo + i] : 0.0f;
            for (int64_t k = 0; k < nk; k++) s += p[r * ldp + k] * v[k][i];
            o[r * ldo + i] = s;
        }
}

DS4_CLONES
void ds4_axpy(float *y, float a, const float *x, int64_t n) {
    int64_t i = 0;
    const v8f av = {a, a, a, a, a, a, a, a};
    for (; i + 8 <= n; i += 8) {
        v8f v = ld8(y + i) + av * ld8(x + i);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] += a * x[i];
}

void ds4_matmul_nt_serial(float *y, int64_t ldy, const float *x, int64_t ldx, const float *W, int64_t T,
                          int64_t K, int64_t O) {
    dot_block(y, ldy, x, ldx, T, NULL, W, O, K);
}

typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));

__attribute__((always_inline)) static inline v4d load4d(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, v4d);
}

/* Each product is exact in double (24 + 24 bits), so only the order of the additions is chosen: lo holds lanes 0-3,
 * hi lanes 4-7, and lo + hi then (s0 + s1) + (s2 + s3) is the lane tree of the header. */
DS4_CLONES
double ds4_dot_f64(const float *w, const float *a, const float *b, int64_t n) {
    v4d lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f a0, a1;
        memcpy(&a0, a + i, sizeof a0);
        memcpy(&a1, a + i + 4, sizeof a1);
        if (w) {
            v4f w0, w1;
            memcpy(&w0, w + i, sizeof w0);
            memcpy(&w1, w + i + 4, sizeof w1);
            a0 = w0 * a0, a1 = w1 * a1;
        }
        lo += __builtin_convertvector(a0, v4d) * load4d(b + i);
        hi += __builtin_convertvector(a1, v4d) * load4d(b + i + 4);
    }
    const v4d s = lo + hi;
    double r = (s[0] + s[1]) + (s[2] + s[3]);
    for (; i < n; i++) r += (double)(w ? w[i] * a[i] : a[i]) * b[i];
    return r;
}

/* y = x·inv (or w·(x·inv)), elementwise: the same fp32 operations as the scalar loop, 8 at a time. */
DS4_CLONES
static void scale_row(float *y, const float *x, const float *w, float inv, int64_t n) {
    const v8f iv = {inv, inv, inv, inv, inv, inv, inv, inv};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v = ld8(x + i) * iv;
        if (w) v = ld8(w + i) * v;
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] = w ? w[i] * (x[i] * inv) : x[i] * inv;
}

void ds4_rmsnorm_rows(float *y, const float *x, const float *w, int64_t rows, int64_t n, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        const double ss = ds4_dot_f64(NULL, xr, xr, n);
        /* HF: x * rsqrt(mean + eps) in fp32, then weight * (...) */
        const float inv = (float)(1.0 / sqrt(ss / (double)n + eps));
        scale_row(y + r * n, xr, w, inv, n);
    }
}

void ds4_rope_apply(float *x, int64_t width, int64_t half, const float *cs, int sign) {
    float *p = x + width - 2 * half;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[2 * i], s = sign * cs[2 * i + 1];
        float a = p[2 * i], b = p[2 * i + 1];
        p[2 * i] = a * c - b * s;
        p[2 * i + 1] = b * c + a * s;
    }
}
