/* cpu_gemm.c — the CPU backend's matrix products in the forward's order, y[i, j] = Σ_r A(i, r)·B(j, r) (or y += that
 * sum), with either operand read along r contiguously or across it (a transposed view). See kernels_cpu.h for the
 * contract; the linear backward's products (ds4_gemm.seq) run in cpu_gemm_seq.c.
 *
 * Every output is the sum the reference kernel computes (ds4_dot): eight fp32 lanes, lane l taking the products of
 * r ≡ l (mod 8) for r < R8 = R & ~7 in increasing r, each with a fused multiply-add, the lanes combined as
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the products of r = R8 .. R-1 fused in one by one. Only the
 * layout of the work changes: B (and an A read across r) is copied into packed panels (6 rows of A, 2 columns of B,
 * 8 values of r per step, zero-padded at the edges; an A read along r is read in place), a register tile of 6 × 2
 * outputs (6 × 8 with AVX-512) runs over a chunk of up to KC values of r, and the lane sums of a tile that spans
 * several chunks wait in memory between chunks. Tiles, chunks and threads change which instructions run when, never
 * which products are added in which order, so the bits do not depend on them. Padded rows and columns produce
 * outputs that are never written. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "kernels_cpu.h"
#include "lanes8.h"

/* Two vectors' lanes picked by eight constant indices (0-7: a, 8-15: b): GCC's and clang's spellings of the same
 * data movement (the fuzz build uses clang). */
#if defined(__clang__)
#define SHUF8(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
typedef int32_t ds4_v8i __attribute__((vector_size(32)));
#define SHUF8(a, b, ...) __builtin_shuffle((a), (b), (ds4_v8i){__VA_ARGS__})
#endif

/* Packing and finishing are data movement and the lane tree: an AVX2 clone only makes them faster. */
#define GEMM_CLONES DS4_CLONES

/* MR rows of A and NP columns of B per packed panel; KC values of r per chunk; a tile is at most MC × NC outputs. */
enum { MR = DS4_GEMM_MR, NP = 2, KC = DS4_GEMM_KC, MC = DS4_GEMM_MC, NC = DS4_GEMM_NC };

/* A(i, r) and B(j, r) of one problem */
static inline float a_at(const ds4_gemm *g, int64_t i, int64_t r) { return g->a[i * g->a_rs + r * g->a_ks]; }
static inline float b_at(const ds4_gemm *g, int64_t j, int64_t r) {
    const int64_t i = j * g->b_rs + r * g->b_ks;
    return g->bq ? ds4_fp4_at(g->bq, g->bs, i) : g->b[i];
}

/* dst[q·8 + l] = src[l·ks + q] for q, l < 8: an 8 × 8 block transposed with shuffles (data movement only). */
__attribute__((always_inline)) static inline void transpose8(float *dst, const float *src, int64_t ks) {
    v8f r[8], t[8], u[8];
    for (int l = 0; l < 8; l++) r[l] = ld8(src + l * ks);
    for (int l = 0; l < 8; l += 2) {
        t[l] = SHUF8(r[l], r[l + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[l + 1] = SHUF8(r[l], r[l + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int h = 0; h < 8; h += 4)
        for (int l = 0; l < 2; l++) {
            u[h + 2 * l] = SHUF8(t[h + l], t[h + l + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[h + 2 * l + 1] = SHUF8(t[h + l], t[h + l + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int q = 0; q < 4; q++) {
        st8(dst + q * 8, SHUF8(u[q], u[q + 4], 0, 1, 2, 3, 8, 9, 10, 11));
        st8(dst + (q + 4) * 8, SHUF8(u[q], u[q + 4], 4, 5, 6, 7, 12, 13, 14, 15));
    }
}

/* Pack rows [i0, i0 + n) of a view X(i, r) = x[i·rs + r·ks] (extent rows in all) over r in [r0, r0 + 8·nk) into
 * panels of `width` rows, `pstride` floats apart: dst[panel][r / 8][row in panel][r % 8], rows past n zero. A
 * transposed view (rs = 1) is gathered 8 rows at a time with 8 × 8 transposes. */
GEMM_CLONES
static void pack(float *dst, int64_t pstride, const float *x, int64_t rs, int64_t ks, int64_t extent, int64_t i0,
                 int64_t n, int64_t width, int64_t r0, int64_t nk) {
    int64_t q0 = 0; /* rows [0, q0) are done */
    if (ks != 1 && rs == 1) {
        float blk[64];
        for (; q0 + 8 <= n && i0 + q0 + 8 <= extent; q0 += 8)
            for (int64_t k = 0; k < nk; k++) {
                transpose8(blk, x + (r0 + k * 8) * ks + i0 + q0, ks); /* blk[q·8 + l] = X(i0 + q0 + q, r0 + 8k + l) */
                for (int64_t q = 0; q < 8; q++) {
                    const int64_t row = q0 + q;
                    memcpy(dst + (row / width) * pstride + (k * width + row % width) * 8, blk + q * 8, 8 * sizeof(float));
                }
            }
    }
    for (int64_t row = q0; row < n; row++) {
        float *d = dst + (row / width) * pstride + (row % width) * 8;
        const float *src = x + (i0 + row) * rs + r0 * ks;
        if (ks == 1)
            for (int64_t k = 0; k < nk; k++) memcpy(d + k * width * 8, src + k * 8, 8 * sizeof(float));
        else
            for (int64_t r = 0; r < 8 * nk; r++) d[(r / 8) * width * 8 + r % 8] = src[r * ks];
    }
    for (int64_t row = n; row % width; row++) /* zero rows up to the end of the last panel */
        for (int64_t k = 0; k < nk; k++)
            memset(dst + (row / width) * pstride + (k * width + row % width) * 8, 0, 8 * sizeof(float));
}

/* pack() for an FP4-resident B (g->bq): the same panels, every value decoded (fp4.h) as it is placed. Decoding goes
 * along B's contiguous runs: a row over the chunk's r when B is read along r (the forward, W[o, k]), a row of the
 * tile's columns at each r when it is read across (dx = dy W). At most max(KC, NC) values are decoded at a time. */
static void pack_fp4(float *dst, int64_t pstride, const ds4_gemm *g, int64_t i0, int64_t n, int64_t width, int64_t r0,
                     int64_t nk) {
    float run[KC > NC ? KC : NC];
    const int64_t kr = 8 * nk;
    if (g->b_ks == 1) {
        for (int64_t row = 0; row < n; row++) {
            ds4_fp4_decode(run, g->bq, g->bs, (i0 + row) * g->b_rs + r0, kr);
            float *d = dst + (row / width) * pstride + (row % width) * 8;
            for (int64_t k = 0; k < nk; k++) memcpy(d + k * width * 8, run + k * 8, 8 * sizeof(float));
        }
    } else if (g->b_rs == 1 && n <= NC) {
        for (int64_t r = 0; r < kr; r++) {
            ds4_fp4_decode(run, g->bq, g->bs, (r0 + r) * g->b_ks + i0, n);
            for (int64_t row = 0; row < n; row++)
                dst[(row / width) * pstride + ((r / 8) * width + row % width) * 8 + r % 8] = run[row];
        }
    } else {
        for (int64_t row = 0; row < n; row++)
            for (int64_t r = 0; r < kr; r++)
                dst[(row / width) * pstride + ((r / 8) * width + row % width) * 8 + r % 8] = b_at(g, i0 + row, r0 + r);
    }
    for (int64_t row = n; row % width; row++)
        for (int64_t k = 0; k < nk; k++)
            memset(dst + (row / width) * pstride + (k * width + row % width) * 8, 0, 8 * sizeof(float));
}

/* The lane sums of eight accumulators, s[k] = ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) of a[k], computed
 * for all eight at once: every output is the same three levels of scalar additions on the same operands, the
 * shuffles only line the operands up. */
__attribute__((always_inline)) static inline void lane_sums8(const v8f a[8], float *s) {
#define LO 0, 1, 2, 3, 8, 9, 10, 11
#define HI 4, 5, 6, 7, 12, 13, 14, 15
#define EV 0, 2, 8, 10, 4, 6, 12, 14
#define OD 1, 3, 9, 11, 5, 7, 13, 15
    v8f p[4], q[2];
    for (int k = 0; k < 4; k++) /* [a_2k lanes i + (i+4)], then [a_2k+1 ...] */
        p[k] = SHUF8(a[2 * k], a[2 * k + 1], LO) + SHUF8(a[2 * k], a[2 * k + 1], HI);
    for (int k = 0; k < 2; k++) /* pairs of those: (l0+l4)+(l1+l5) and (l2+l6)+(l3+l7) */
        q[k] = SHUF8(p[2 * k], p[2 * k + 1], EV) + SHUF8(p[2 * k], p[2 * k + 1], OD);
    const v8f r = SHUF8(q[0], q[1], EV) + SHUF8(q[0], q[1], OD);
#undef LO
#undef HI
#undef EV
#undef OD
    /* r holds the sums of a0, a2, a4, a6, a1, a3, a5, a7 */
    s[0] = r[0], s[2] = r[1], s[4] = r[2], s[6] = r[3], s[1] = r[4], s[3] = r[5], s[5] = r[6], s[7] = r[7];
}

/* The register tile: rows q < 6 of A × the two columns of a B panel (bp: 16 floats per step, column 0's 8 values of
 * r then column 1's), over nk steps of 8 values of r. Row q's 8 values of step k are at a[q] + k·astep: a packed A
 * panel (astep = MR·8) or A's own row (astep = 8, A read along r). The lane sums start at zero (first chunk) or from
 * `io` ([6][NP][8]); after the last chunk the outputs' lane sums go to sums[q·NC + c] (q < 6: rows, c < 2; NC floats
 * per row of the tile), else the lanes go back to `io`. In the FMA version each A vector is loaded once and held in a
 * register (the empty asm keeps GCC from re-reading it as a memory operand of each multiply-add): 8 loads per 12
 * fused multiply-adds, fewer than the two load ports allow. */
#define RS (NP * 8) /* floats between rows of a block of lanes */
#define TILE_6X2(HOLD, FMA8)                                                                                        \
    v8f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};                                         \
    v8f c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};                                         \
    if (!first) {                                                                                                  \
        c00 = ld8(io), c01 = ld8(io + 8), c10 = ld8(io + RS), c11 = ld8(io + RS + 8), c20 = ld8(io + 2 * RS);      \
        c21 = ld8(io + 2 * RS + 8), c30 = ld8(io + 3 * RS), c31 = ld8(io + 3 * RS + 8), c40 = ld8(io + 4 * RS);    \
        c41 = ld8(io + 4 * RS + 8), c50 = ld8(io + 5 * RS), c51 = ld8(io + 5 * RS + 8);                            \
    }                                                                                                              \
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];                            \
    for (int64_t k = 0, o = 0; k < nk; k++, o += astep, bp += NP * 8) {                                            \
        const v8f u0 = ld8(bp), u1 = ld8(bp + 8);                                                                  \
        v8f v;                                                                                                     \
        v = ld8(a0 + o); HOLD(v); c00 = FMA8(c00, v, u0); c01 = FMA8(c01, v, u1);                                  \
        v = ld8(a1 + o); HOLD(v); c10 = FMA8(c10, v, u0); c11 = FMA8(c11, v, u1);                                  \
        v = ld8(a2 + o); HOLD(v); c20 = FMA8(c20, v, u0); c21 = FMA8(c21, v, u1);                                  \
        v = ld8(a3 + o); HOLD(v); c30 = FMA8(c30, v, u0); c31 = FMA8(c31, v, u1);                                  \
        v = ld8(a4 + o); HOLD(v); c40 = FMA8(c40, v, u0); c41 = FMA8(c41, v, u1);                                  \
        v = ld8(a5 + o); HOLD(v); c50 = FMA8(c50, v, u0); c51 = FMA8(c51, v, u1);                                  \
    }                                                                                                              \
    if (sums) {                                                                                                    \
        const v8f p[8] = {c00, c01, c10, c11, c20, c21, c30, c31}, q[8] = {c40, c41, c50, c51, c50, c51, c50, c51}; \
        float s[16];                                                                                               \
        lane_sums8(p, s);                                                                                          \
        lane_sums8(q, s + 8);                                                                                      \
        for (int r = 0; r < 6; r++) sums[r * NC] = s[2 * r], sums[r * NC + 1] = s[2 * r + 1];                      \
        return;                                                                                                    \
    }                                                                                                              \
    st8(io, c00), st8(io + 8, c01), st8(io + RS, c10), st8(io + RS + 8, c11), st8(io + 2 * RS, c20);               \
    st8(io + 2 * RS + 8, c21), st8(io + 3 * RS, c30), st8(io + 3 * RS + 8, c31), st8(io + 4 * RS, c40);            \
    st8(io + 4 * RS + 8, c41), st8(io + 5 * RS, c50), st8(io + 5 * RS + 8, c51);

/* One column pair; wide: WIDE consecutive pairs of B panels bstride floats apart, their lanes in consecutive `io`
 * blocks and their sums in consecutive columns. Every tile gives the same bits (the same fused multiply-adds lane for
 * lane); the wide one is the AVX-512 tile below. */
typedef void (*tile_fn)(const float *const *a, int64_t astep, const float *bp, int64_t nk, int first, float *io,
                        float *sums);
typedef void (*wide_fn)(const float *const *a, int64_t astep, const float *bp, int64_t bstride, int64_t nk, int first,
                        float *io, float *sums);
enum { WIDE = 4 };

/* The portable tile: each lane's fused multiply-add by fmaf (for CPUs without FMA: slow, the same bits). */
#define HOLD_NONE(v) (void)(v)
static void tile_6x2(const float *const *a, int64_t astep, const float *bp, int64_t nk, int first, float *io,
                     float *sums) {
    TILE_6X2(HOLD_NONE, fma8_soft)
}

#ifdef DS4_X86_FMA
#define HOLD_REG(v) __asm__("" : "+x"(v))
DS4_FMA_TARGET static void tile_6x2_fma(const float *const *a, int64_t astep, const float *bp,
                                                            int64_t nk, int first, float *io, float *sums) {
    TILE_6X2(HOLD_REG, fma8_hw)
}

/* The AVX-512 tile: 6 rows × 4 column pairs in 24 registers of 16 lanes, each holding a pair's two columns of 8
 * lanes (the packed B panel's layout, so one load per pair); a row's 8 values are broadcast to both halves. 10 loads
 * per 24 fused multiply-adds of 16 lanes. */
#define W512_ROW(q)                                                                                                 \
    {                                                                                                              \
        const __m512 v = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(a##q + o))));     \
        c##q##0 = _mm512_fmadd_ps(v, u0, c##q##0), c##q##1 = _mm512_fmadd_ps(v, u1, c##q##1);                      \
        c##q##2 = _mm512_fmadd_ps(v, u2, c##q##2), c##q##3 = _mm512_fmadd_ps(v, u3, c##q##3);                      \
    }
#define W512_IO(X, q) X(q, 0), X(q, 1), X(q, 2), X(q, 3)
#define W512_LOAD(q, p) c##q##p = first ? _mm512_setzero_ps() : _mm512_loadu_ps(io + (p) * MR * RS + (q) * RS)
#define W512_STORE(q, p) _mm512_storeu_ps(io + (p) * MR * RS + (q) * RS, c##q##p)
__attribute__((target("avx512f,avx2,fma"))) static void tile_6x8_avx512(const float *const *a, int64_t astep,
                                                                       const float *bp, int64_t bstride, int64_t nk,
                                                                       int first, float *io, float *sums) {
    __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23;
    __m512 c30, c31, c32, c33, c40, c41, c42, c43, c50, c51, c52, c53;
    W512_IO(W512_LOAD, 0), W512_IO(W512_LOAD, 1), W512_IO(W512_LOAD, 2);
    W512_IO(W512_LOAD, 3), W512_IO(W512_LOAD, 4), W512_IO(W512_LOAD, 5);
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    const float *b0 = bp, *b1 = bp + bstride, *b2 = bp + 2 * bstride, *b3 = bp + 3 * bstride;
    for (int64_t k = 0, o = 0, ob = 0; k < nk; k++, o += astep, ob += NP * 8) {
        const __m512 u0 = _mm512_loadu_ps(b0 + ob), u1 = _mm512_loadu_ps(b1 + ob);
        const __m512 u2 = _mm512_loadu_ps(b2 + ob), u3 = _mm512_loadu_ps(b3 + ob);
        W512_ROW(0) W512_ROW(1) W512_ROW(2) W512_ROW(3) W512_ROW(4) W512_ROW(5)
    }
    W512_IO(W512_STORE, 0), W512_IO(W512_STORE, 1), W512_IO(W512_STORE, 2);
    W512_IO(W512_STORE, 3), W512_IO(W512_STORE, 4), W512_IO(W512_STORE, 5);
    if (!sums) return;
    for (int p = 0; p < WIDE; p++) { /* the finished lanes, back from io: each pair's 12 outputs */
        const float *l = io + p * MR * RS;
        const v8f x[8] = {ld8(l), ld8(l + 8), ld8(l + RS), ld8(l + RS + 8), ld8(l + 2 * RS), ld8(l + 2 * RS + 8),
                          ld8(l + 3 * RS), ld8(l + 3 * RS + 8)};
        const v8f y[8] = {ld8(l + 4 * RS), ld8(l + 4 * RS + 8), ld8(l + 5 * RS), ld8(l + 5 * RS + 8),
                          ld8(l + 5 * RS), ld8(l + 5 * RS + 8), ld8(l + 5 * RS), ld8(l + 5 * RS + 8)};
        float s[16];
        lane_sums8(x, s);
        lane_sums8(y, s + 8);
        for (int r = 0; r < 6; r++) sums[r * NC + 2 * p] = s[2 * r], sums[r * NC + 2 * p + 1] = s[2 * r + 1];
    }
}
#endif

typedef struct {
    tile_fn tile;
    wide_fn wide; /* NULL: pairs one at a time */
} gemm_kernels;

/* The best kernels this CPU runs, at most `isa` (ds4_gemm_isa). */
static gemm_kernels pick_kernels(ds4_gemm_isa isa) {
#ifdef DS4_X86_FMA
    if (isa >= DS4_GEMM_AVX2_FMA && ds4_cpu_fma()) {
        __builtin_cpu_init();
        const int wide = isa >= DS4_GEMM_AVX512 && __builtin_cpu_supports("avx512f");
        return (gemm_kernels){tile_6x2_fma, wide ? tile_6x8_avx512 : NULL};
    }
#endif
    (void)isa;
    return (gemm_kernels){tile_6x2, NULL};
}

/* finish() where R % 8 > 0: each output's lane sum with the last products fused in one by one, in increasing r. B's
 * last values for the tile's columns are gathered once (bt[r - R8][c]); the outputs of a row then take each r's
 * multiply-add 8 columns at a time (FMA8; the portable version fmaf lane by lane): the same operations per output. */
#define FINISH_TAIL(FMA8)                                                                                           \
    const int64_t R = g->R, R8 = R & ~(int64_t)7, nt = R - R8, n8 = (n + 7) & ~(int64_t)7;                         \
    float bt[7 * NC], s[NC];                                                                                       \
    for (int64_t r = 0; r < nt; r++) {                                                                             \
        for (int64_t c = 0; c < n; c++) bt[r * NC + c] = b_at(g, j0 + c, R8 + r);                                  \
        for (int64_t c = n; c < n8; c++) bt[r * NC + c] = 0;                                                       \
    }                                                                                                              \
    for (int64_t q = 0; q < mv; q++) {                                                                             \
        float *y = g->y + (i0 + q) * g->ldy + j0;                                                                  \
        memcpy(s, sums + q * NC, (size_t)n * sizeof(float));                                                       \
        memset(s + n, 0, (size_t)(n8 - n) * sizeof(float));                                                        \
        for (int64_t r = 0; r < nt; r++) {                                                                         \
            const float av = a_at(g, i0 + q, R8 + r);                                                              \
            const v8f a8 = {av, av, av, av, av, av, av, av};                                                       \
            for (int64_t c = 0; c < n8; c += 8) st8(s + c, FMA8(ld8(s + c), a8, ld8(bt + r * NC + c)));            \
        }                                                                                                          \
        if (g->acc)                                                                                                \
            for (int64_t c = 0; c < n; c++) y[c] = y[c] + s[c];                                                    \
        else memcpy(y, s, (size_t)n * sizeof(float));                                                             \
    }

static void finish_tail_soft(const ds4_gemm *g, const float *sums, int64_t i0, int64_t mv, int64_t j0, int64_t n) {
    FINISH_TAIL(fma8_soft)
}

#ifdef DS4_X86_FMA
DS4_FMA_TARGET static void finish_tail_hw(const ds4_gemm *g, const float *sums, int64_t i0,
                                                              int64_t mv, int64_t j0, int64_t n) {
    FINISH_TAIL(fma8_hw)
}
#endif

/* The outputs (i0 + q, j0 + c), q < mv, c < n: their lane sums (sums[q·NC + c]) plus the products of the last R % 8
 * values of r one by one, stored (or added). */
GEMM_CLONES
static void finish(const ds4_gemm *g, const float *sums, int64_t i0, int64_t mv, int64_t j0, int64_t n) {
    const int64_t R = g->R, R8 = R & ~(int64_t)7, ldy = g->ldy;
    float *y0 = g->y + i0 * ldy + j0;
    if (R8 == R && !g->acc) {
        for (int64_t q = 0; q < mv; q++) memcpy(y0 + q * ldy, sums + q * NC, (size_t)n * sizeof(float));
        return;
    }
    if (R8 == R) { /* y + s, 8 outputs at a time (elementwise fp32 adds) */
        for (int64_t q = 0; q < mv; q++) {
            float *y = y0 + q * ldy;
            const float *sq = sums + q * NC;
            int64_t c = 0;
            for (; c + 8 <= n; c += 8) st8(y + c, ld8(y + c) + ld8(sq + c));
            for (; c < n; c++) y[c] = y[c] + sq[c];
        }
        return;
    }
#ifdef DS4_X86_FMA
    if (ds4_cpu_fma()) {
        finish_tail_hw(g, sums, i0, mv, j0, n);
        return;
    }
#endif
    finish_tail_soft(g, sums, i0, mv, j0, n);
}

/* What a worker's packed A and B blocks hold, so that consecutive tiles of the same rows or columns (the task order
 * puts them together) pack them once. Reset at the start of every run. */
typedef struct {
    const ds4_gemm *g;
    int64_t i0, n, r0;
} blk_key;

/* A tile of fewer than DIRECT_M rows with both operands read along r (decode: one or two tokens per product or per
 * expert) is summed by ds4_dot straight from the operands: packing would pad its rows to MR and copy B for a single
 * pass. ds4_dot is the sum the packed path computes (kernels_cpu.h), so the bits are the same. */
enum { DIRECT_M = 3 };

/* An FP4-resident B row is decoded whole into the worker's packing space first, which holds this many values. */
enum { DIRECT_ROW_MAX = DS4_GEMM_MC * DS4_GEMM_KC + DS4_GEMM_NC * DS4_GEMM_KC };

static int direct_tile(const ds4_gemm *g, int64_t m) {
    return m < DIRECT_M && g->a_ks == 1 && g->b_ks == 1 && (!g->bq || g->R <= DIRECT_ROW_MAX);
}

/* row: DIRECT_ROW_MAX floats for an FP4-resident B's row (one row of an expert at a time, never the whole) */
static void gemm_direct(const ds4_gemm *g, int64_t i0, int64_t m, int64_t j0, int64_t n, float *row) {
    for (int64_t c = 0; c < n; c++) {
        const float *b = g->b ? g->b + (j0 + c) * g->b_rs : row;
        if (g->bq) ds4_fp4_decode(row, g->bq, g->bs, (j0 + c) * g->b_rs, g->R);
        for (int64_t q = 0; q < m; q++) {
            float *y = g->y + (i0 + q) * g->ldy + j0 + c;
            const float s = ds4_dot(g->a + (i0 + q) * g->a_rs, b, g->R);
            *y = g->acc ? *y + s : s;
        }
    }
}

/* One tile: rows [i0, i0 + m) × columns [j0, j0 + n) of problem g, every chunk of r. ws: DS4_GEMM_WS_FLOATS, its
 * head a b_key. An A read along r is not packed: the tiles read its rows where they lie (rows past the tile's read its
 * last row: lanes that are never finished). */
static void gemm_tile(const ds4_gemm *g, int64_t i0, int64_t m, int64_t j0, int64_t n, float *ws, gemm_kernels kern) {
    blk_key *akey = (blk_key *)(void *)ws, *key = akey + 1;
    float *pa = ws + DS4_GEMM_WS_HEAD, *pb = pa + MC * KC, *lanes = pb + NC * KC; /* lanes: [MC/MR][NC/NP][MR][NP][8] */
    const int64_t R8 = g->R & ~(int64_t)7, mp = (m + MR - 1) / MR, np = (n + NP - 1) / NP;
    const int adirect = g->a_ks == 1;
    float sums[MR * NC]; /* one row block of the tile's finished lane sums */
    if (direct_tile(g, m)) {
        gemm_direct(g, i0, m, j0, n, pa);
        if (g->bq) *akey = *key = (blk_key){0}; /* pa and pb held a decoded row */
        return;
    }
    if (R8 == 0) {
        memset(sums, 0, sizeof sums); /* the lane sums of no products: +0, as the reference's zero lanes give */
        for (int64_t ip = 0; ip < mp; ip++) finish(g, sums, i0 + ip * MR, m - ip * MR < MR ? m - ip * MR : MR, j0, n);
        return;
    }
    for (int64_t r0 = 0; r0 < R8; r0 += KC) {
        const int64_t kc = R8 - r0 < KC ? R8 - r0 : KC, nk = kc / 8;
        const int first = r0 == 0, last = r0 + kc == R8;
        if (!adirect && (akey->g != g || akey->i0 != i0 || akey->n != m || akey->r0 != r0)) {
            pack(pa, nk * MR * 8, g->a, g->a_rs, g->a_ks, g->M, i0, m, MR, r0, nk);
            *akey = (blk_key){g, i0, m, r0};
        }
        if (key->g != g || key->i0 != j0 || key->n != n || key->r0 != r0) {
            if (g->bq) pack_fp4(pb, nk * NP * 8, g, j0, n, NP, r0, nk);
            else pack(pb, nk * NP * 8, g->b, g->b_rs, g->b_ks, g->N, j0, n, NP, r0, nk);
            *key = (blk_key){g, j0, n, r0};
        }
        const float *bb = pb;
        const int64_t bstride = nk * NP * 8;
        for (int64_t ip = 0; ip < mp; ip++) {
            const int64_t mv = m - ip * MR < MR ? m - ip * MR : MR;
            const float *ar[MR];
            int64_t astep = MR * 8;
            for (int64_t q = 0; q < MR; q++)
                ar[q] = adirect ? g->a + (i0 + ip * MR + (q < mv ? q : mv - 1)) * g->a_rs + r0
                                : pa + ip * nk * MR * 8 + q * 8;
            if (adirect) astep = 8;
            for (int64_t jp = 0; jp < np;) {
                float *io = lanes + (ip * (NC / NP) + jp) * MR * NP * 8; /* lane sums kept between chunks */
                float *sp = last ? sums + jp * NP : NULL;
                if (kern.wide && jp + WIDE <= np) {
                    kern.wide(ar, astep, bb + jp * bstride, bstride, nk, first, io, sp);
                    jp += WIDE;
                } else {
                    kern.tile(ar, astep, bb + jp * bstride, nk, first, io, sp);
                    jp++;
                }
            }
            if (last) finish(g, sums, i0 + ip * MR, mv, j0, n);
        }
    }
}

/* ------------------------------------------------------------------------------------------------ scheduling */

typedef struct {
    const ds4_gemm *g;
    int64_t n, mc, nc;
    int64_t *first;               /* [n + 1] first task of each problem */
    int64_t *bper;                /* [n] blocks per task of each problem */
    float *ws;
    int64_t ws_stride;
    gemm_kernels kern;
} gemm_job;

/* A task is a run of row blocks of one column block, whose tiles share B's packed block: a worker packs it once per
 * task rather than once per tile. */
static void gemm_task(void *ctx, int64_t t, int32_t worker) {
    const gemm_job *j = ctx;
    const int64_t p = ds4_gemm_problem_of(j->first, t);
    const ds4_gemm *g = &j->g[p];
    const int64_t nbi = ds4_cdiv(g->M, j->mc), per = j->bper[p], runs = ds4_cdiv(nbi, per), k = t - j->first[p];
    const int64_t j0 = (k / runs) * j->nc, b0 = (k % runs) * per, b1 = b0 + per < nbi ? b0 + per : nbi;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i0 = b * j->mc;
        gemm_tile(g, i0, g->M - i0 < j->mc ? g->M - i0 : j->mc, j0, g->N - j0 < j->nc ? g->N - j0 : j->nc,
                  j->ws + (int64_t)worker * j->ws_stride, j->kern);
    }
}

int64_t ds4_gemm_threads(ds4_pool *pool, const ds4_gemm *g, int64_t n) {
    const int64_t threads = pool ? ds4_pool_threads(pool) : 1;
    double work = 0;
    for (int64_t p = 0; p < n; p++) work += (double)g[p].M * (double)g[p].N * (double)g[p].R;
    const double useful = work / DS4_GEMM_THREAD_WORK;
    return useful >= (double)threads ? threads : useful >= 1 ? (int64_t)useful : 1;
}

void ds4_gemm_run(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws) {
    ds4_gemm_run_isa(pool, g, n, ws, DS4_GEMM_AVX512);
}

void ds4_gemm_run_isa(ds4_pool *pool, const ds4_gemm *g, int64_t n, float *ws, ds4_gemm_isa isa) {
    if (n > 0 && g[0].seq) {
        ds4_gemm_seq_run(pool, g, n, ws, isa);
        return;
    }
    enum { MAX_PROBLEMS = 256 };
    int64_t first[MAX_PROBLEMS + 1], bper[MAX_PROBLEMS];
    const gemm_kernels kern = pick_kernels(isa);
    const int64_t pool_threads = pool ? ds4_pool_threads(pool) : 1;
    for (int64_t w = 0; w < pool_threads; w++) memset(ws + w * DS4_GEMM_WS_FLOATS, 0, 2 * sizeof(blk_key));
    for (int64_t p0 = 0; p0 < n; p0 += MAX_PROBLEMS) {
        const int64_t cnt = n - p0 < MAX_PROBLEMS ? n - p0 : MAX_PROBLEMS;
        const int64_t threads = ds4_gemm_threads(pool, g + p0, cnt);
        /* the largest tiles that still give every thread a few, down to 12 × 16 */
        int64_t mc = MC, nc = NC, tiles = 0;
        for (;;) {
            tiles = 0;
            for (int64_t p = 0; p < cnt; p++) tiles += ds4_cdiv(g[p0 + p].M, mc) * ds4_cdiv(g[p0 + p].N, nc);
            if (tiles >= 3 * threads || (mc <= 2 * MR && nc <= 16)) break;
            if ((mc * 3 >= nc * 2 || nc <= 16) && mc > 2 * MR) mc /= 2;
            else nc /= 2;
        }
        first[0] = 0;
        int64_t outer = 0;
        for (int64_t p = 0; p < cnt; p++) outer += ds4_cdiv(g[p0 + p].N, nc);
        /* about eight tasks per thread (tiles at the edges cost less, and the last task of a job decides when it
         * ends): whole runs where there are that many, else shorter ones */
        const int64_t split = threads > 1 ? ds4_cdiv(8 * threads, outer > 0 ? outer : 1) : 1;
        for (int64_t p = 0; p < cnt; p++) {
            const ds4_gemm *q = &g[p0 + p];
            const int64_t nbi = ds4_cdiv(q->M, mc), nbj = ds4_cdiv(q->N, nc);
            bper[p] = nbi > 0 ? ds4_cdiv(nbi, split) : 1;
            first[p + 1] = first[p] + (q->M > 0 && q->N > 0 ? nbj * ds4_cdiv(nbi, bper[p]) : 0);
        }
        gemm_job j = {g + p0, cnt, mc, nc, first, bper, ws, DS4_GEMM_WS_FLOATS, kern};
        if (pool) ds4_pool_run_worker_on(pool, first[cnt], (int32_t)threads, gemm_task, &j);
        else
            for (int64_t t = 0; t < first[cnt]; t++) gemm_task(&j, t, 0);
    }
}
