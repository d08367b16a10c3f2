/* cpu_rows.c — CPU operations that work row by row on activations: RMSNorm and its backward, RoPE, scaling,
 * row copies / gathers / scatters, stream sums, column sums. */
#include <string.h>

#include "cpu.h"

#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors stay inside the (cloned) functions */

static void rmsnorm_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_rmsnorm *a = p;
    ds4_rmsnorm_rows(a->y + b * a->width, a->x + b * a->width, a->w, e - b, a->width, a->eps);
}

void ds4_cpu_rmsnorm(ds4_dev *d, const ds4_a_rmsnorm *a) {
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->rows, 2 * a->width, rmsnorm_range, a); /* x read, y written */
}

static void rope_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_rope *a = p;
    for (int64_t t = b; t < e; t++) {
        const float *cs = ds4_rope_at(&a->rt, ds4_rows_pos(&a->rows, t));
        for (int64_t hh = 0; hh < a->heads; hh++)
            ds4_rope_apply(a->x + (t * a->heads + hh) * a->width, a->width, a->rt.half, cs, a->sign);
    }
}

void ds4_cpu_rope(ds4_dev *d, const ds4_a_rope *a) {
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->rows.T, 2 * a->heads * a->rt.half, rope_range, a); /* the rotated pairs */
}

/* Row operations below split their rows (or, where two rows may write the same destination, their columns) over
 * the pool with a grain that keeps a range worth waking a thread for; every element is computed by the same
 * scalar expression in the same order whatever the split. */
enum { COL_BLOCK = 16 };

static int64_t row_grain(int64_t width) { return ds4_cpu_grain(width); }

static void scale_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_scale *a = p;
    for (int64_t i = b; i < e; i++) a->x[i] *= a->s;
}

void ds4_cpu_scale(ds4_dev *d, const ds4_a_scale *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->n, DS4_CPU_TASK_WORK, scale_range, a);
}

/* rows of every group, numbered group-major */
static void fake_quant_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_fake_quant *a = p;
    for (int64_t i = b; i < e; i++)
        ds4_fake_quant_row(a->x + (i / a->rows) * a->gstride + (i % a->rows) * a->width, a->width, &a->q);
}

void ds4_cpu_fake_quant(ds4_dev *d, const ds4_a_fake_quant *a) {
    if (a->rows <= 0) return;
    ds4_cpu_parallel_grain(ds4_cpu_of(d), (a->groups > 0 ? a->groups : 1) * a->rows, row_grain(a->width),
                           fake_quant_range, a);
}

static void copy_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_copy_rows *a = p;
    for (int64_t r = b; r < e; r++)
        memcpy((char *)a->dst + r * a->ldd, (const char *)a->src + r * a->lds, (size_t)a->row_bytes);
}

void ds4_cpu_copy_rows(ds4_dev *d, const ds4_a_copy_rows *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->rows, row_grain(a->row_bytes / 4), copy_range, a);
}


static void gather_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_gather_rows *a = p;
    for (int64_t r = b; r < e; r++)
        memcpy(a->dst + r * a->width, a->src + (a->idx[r] / a->div) * a->width, (size_t)a->width * sizeof(float));
}

void ds4_cpu_gather_rows(ds4_dev *d, const ds4_a_gather_rows *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->rows, row_grain(a->width), gather_range, a);
}

/* Column blocks [b, e) of COL_BLOCK floats, every row in order: a repeated destination row keeps its sequence of
 * writes (or adds). */
static void scatter_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_scatter_rows *a = p;
    const int64_t c0 = b * COL_BLOCK, c1 = e * COL_BLOCK < a->width ? e * COL_BLOCK : a->width;
    for (int64_t r = 0; r < a->rows; r++)
        memcpy(a->dst + (int64_t)a->idx[r] * a->width + c0, a->src + r * a->width + c0, (size_t)(c1 - c0) * sizeof(float));
}

static int64_t col_grain(int64_t rows) {
    const int64_t per_block = rows * COL_BLOCK;
    return ds4_cpu_grain(per_block);
}

void ds4_cpu_scatter_rows(ds4_dev *d, const ds4_a_scatter_rows *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), (a->width + COL_BLOCK - 1) / COL_BLOCK, col_grain(a->rows), scatter_range, a);
}

static void add_rows_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_add_rows *a = p;
    const int64_t c0 = b * COL_BLOCK, c1 = e * COL_BLOCK < a->width ? e * COL_BLOCK : a->width;
    for (int64_t r = 0; r < a->rows; r++) {
        float *y = a->dst + (int64_t)a->idx[r] * a->width;
        const float *x = a->src + r * a->width;
        for (int64_t i = c0; i < c1; i++) y[i] += x[i];
    }
}

void ds4_cpu_add_rows(ds4_dev *d, const ds4_a_add_rows *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), (a->width + COL_BLOCK - 1) / COL_BLOCK, col_grain(a->rows), add_rows_range, a);
}

static void add_bcast_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_add_bcast *a = p;
    for (int64_t t = b; t < e; t++)
        for (int64_t i = 0; i < a->n; i++) ds4_axpy(a->x + (t * a->n + i) * a->D, 1.0f, a->h + t * a->D, a->D);
}

void ds4_cpu_add_bcast(ds4_dev *d, const ds4_a_add_bcast *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T, row_grain(a->n * a->D), add_bcast_range, a);
}

static void sum_streams_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_sum_streams *a = p;
    memset(a->du + b * a->D, 0, (size_t)((e - b) * a->D) * sizeof(float));
    for (int64_t t = b; t < e; t++)
        for (int64_t k = 0; k < a->n; k++) ds4_axpy(a->du + t * a->D, 1.0f, a->dX + (t * a->n + k) * a->D, a->D);
}

void ds4_cpu_sum_streams(ds4_dev *d, const ds4_a_sum_streams *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T, row_grain(a->n * a->D), sum_streams_range, a);
}

/* ops.h's order: a chunk's rows in order from 0, then the chunk into dst, chunk after chunk */
static void colsum_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_colsum_add *a = p;
    for (int64_t c0 = b * COL_BLOCK, cend = e * COL_BLOCK < a->width ? e * COL_BLOCK : a->width; c0 < cend;
         c0 += COL_BLOCK) {
        const int64_t c1 = c0 + COL_BLOCK < cend ? c0 + COL_BLOCK : cend;
        for (int64_t r0 = 0; r0 < a->rows; r0 += DS4_COLSUM_CHUNK) {
            const int64_t r1 = r0 + DS4_COLSUM_CHUNK < a->rows ? r0 + DS4_COLSUM_CHUNK : a->rows;
            float part[COL_BLOCK] = {0};
            for (int64_t r = r0; r < r1; r++)
                for (int64_t i = c0; i < c1; i++) part[i - c0] += a->src[r * a->ld + i];
            for (int64_t i = c0; i < c1; i++) a->dst[i] += part[i - c0];
        }
    }
}

void ds4_cpu_colsum_add(ds4_dev *d, const ds4_a_colsum_add *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), (a->width + COL_BLOCK - 1) / COL_BLOCK, col_grain(a->rows), colsum_range, a);
}

/* ------------------------------------------------------------------------------------------------ norm backward */

typedef struct {
    float *dx;
    const float *dy, *x, *w;
    float *rinv;
    int64_t width;
    double eps;
    int acc;
    int rinv_only; /* first pass: the RMS factors alone */
} nb_ctx;

/* The elementwise step of the norm backward, dx (+)= (double)(w·dy)·ri − (double)x·k rounded to fp32, 4 at a time:
 * the scalar expression's double operations lane by lane. */
DS4_CLONES
static void nb_dx(float *dx, const float *dy, const float *x, const float *w, double ri, double k, int acc, int64_t n) {
    typedef float v4f __attribute__((vector_size(16)));
    typedef double v4d __attribute__((vector_size(32)));
    const v4d riv = {ri, ri, ri, ri}, kv = {k, k, k, k};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        v4f d, xv, o;
        memcpy(&d, dy + i, sizeof d);
        memcpy(&xv, x + i, sizeof xv);
        if (w) {
            v4f wv;
            memcpy(&wv, w + i, sizeof wv);
            d = wv * d;
        }
        const v4d g = __builtin_convertvector(d, v4d) * riv - __builtin_convertvector(xv, v4d) * kv;
        o = __builtin_convertvector(g, v4f);
        if (acc) {
            v4f prev;
            memcpy(&prev, dx + i, sizeof prev);
            o = prev + o;
        }
        memcpy(dx + i, &o, sizeof o);
    }
    for (; i < n; i++) {
        const double g = (double)(w ? w[i] * dy[i] : dy[i]) * ri - (double)x[i] * k;
        dx[i] = acc ? dx[i] + (float)g : (float)g;
    }
}

static void nb_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const nb_ctx *c = p;
    const int64_t n = c->width;
    for (int64_t r = b; r < e; r++) {
        const float *x = c->x + r * n, *dy = c->dy + r * n;
        const double ss = ds4_dot_f64(NULL, x, x, n); /* the forward's sum (ds4_rmsnorm_rows) */
        const double ri = 1.0 / sqrt(ss / (double)n + c->eps);
        c->rinv[r] = (float)ri;
        if (c->rinv_only) continue;
        const double k = ri * ri * ri * ds4_dot_f64(c->w, dy, x, n) / (double)n;
        nb_dx(c->dx + r * n, dy, x, c->w, ri, k, c->acc, n);
    }
}

typedef struct {
    float *dw;
    const float *dy, *x, *rinv;
    int64_t rows, width;
} nw_ctx;

enum { NW_BLOCK = 32 };

/* A range owns blocks of NW_BLOCK columns and walks the rows once, in order, for all of them: each column's sum is
 * the same fixed-order sum over rows as a column-at-a-time loop, without striding down the matrix per column; the
 * columns of a block are 4-lane vectors of the same double operations. */
DS4_CLONES
static void nw_block(float *dw, const float *dy, const float *x, const float *rinv, int64_t rows, int64_t ld,
                     int64_t c0, int64_t c1) {
    typedef float v4f __attribute__((vector_size(16)));
    typedef double v4d __attribute__((vector_size(32)));
    v4d s[NW_BLOCK / 4];
    memset(s, 0, sizeof s);
    const int64_t full = c1 - c0 == NW_BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        const float *dr = dy + r * ld + c0, *xr = x + r * ld + c0;
        const double rv = rinv[r];
        if (full) {
            const v4d rr = {rv, rv, rv, rv};
            for (int j = 0; j < NW_BLOCK / 4; j++) {
                v4f a, bb;
                memcpy(&a, dr + 4 * j, sizeof a);
                memcpy(&bb, xr + 4 * j, sizeof bb);
                s[j] += __builtin_convertvector(a, v4d) * __builtin_convertvector(bb, v4d) * rr;
            }
        } else {
            for (int64_t i = 0; i < c1 - c0; i++) s[i / 4][i % 4] += (double)dr[i] * xr[i] * rv;
        }
    }
    for (int64_t i = c0; i < c1; i++) dw[i] += (float)s[(i - c0) / 4][(i - c0) % 4];
}

static void nw_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const nw_ctx *c = p;
    for (int64_t blk = b; blk < e; blk++) {
        const int64_t c0 = blk * NW_BLOCK, c1 = c0 + NW_BLOCK < c->width ? c0 + NW_BLOCK : c->width;
        nw_block(c->dw, c->dy, c->x, c->rinv, c->rows, c->width, c0, c1);
    }
}

/* y = w ⊙ x / rms(x) over each group's rows: dx (written, or added when acc) and dw += (w may be NULL). dx may
 * alias dy: the weight gradient, which reads dy, is taken before dx overwrites it. */
void ds4_cpu_norm_bwd(ds4_dev *d, const ds4_a_norm_bwd *a) {
    const ds4_cpu *cpu = ds4_cpu_of(d);
    const int64_t groups = a->groups > 0 ? a->groups : 1;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o = g * a->gstride;
        nb_ctx c = {a->dx + o, a->dy + o, a->x + o, a->w, cpu->rinv, a->width, a->eps, a->acc, 1};
        if (a->dw) {
            ds4_cpu_parallel_work(cpu, a->rows, a->width, nb_range, &c);
            nw_ctx cw = {a->dw, a->dy + o, a->x + o, cpu->rinv, a->rows, a->width};
            ds4_cpu_parallel(cpu, (a->width + NW_BLOCK - 1) / NW_BLOCK, nw_range, &cw);
        }
        c.rinv_only = 0;
        ds4_cpu_parallel_work(cpu, a->rows, 4 * a->width, nb_range, &c); /* x, dy, w read, dx written */
    }
}
