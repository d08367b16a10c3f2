/* cpu_attn_bwd.c — CPU backward of the attention sub-layer (full forward tapes only): attention with sink in three
 * phases (per query, per window key, per compressed entry, so that no two ranges write the same gradient), the
 * inverse of the CSA picks, the compressor's pooling, and the indexer-KL loss. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "shape_limits.h"

/* The tape's query rows per sequence (a query window, ds4_a_attn_bwd's q0 / qn, or all S) */
static int64_t q_per_seq(const ds4_a_attn_bwd *a) { return a->qn ? a->qn : a->S; }

/* The query row of position s of sequence row, or -1 where s is outside the query window. */
static int64_t q_row(const ds4_a_attn_bwd *a, int64_t row, int64_t s) {
    const int64_t qn = q_per_seq(a);
    return s >= a->q0 && s < a->q0 + qn ? row * qn + s - a->q0 : -1;
}

/* The key list of query t, in the forward's order: window keys, then compressed entries. */
static int64_t key_list(const ds4_a_attn_bwd *a, int64_t t, const float **keys) {
    const ds4_config *c = a->c;
    const ds4_layer_tape *lt = a->lt;
    const int64_t S = a->S, d = c->head_dim, row = t / q_per_seq(a), s = a->q0 + t % q_per_seq(a);
    const int64_t win = c->sliding_window;
    const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
    int64_t nk = 0;
    for (int64_t j = j0; j <= s; j++) keys[nk++] = lt->kv + (row * S + j) * d;
    if (a->l->type == DS4_ATTN_HCA) {
        int64_t valid = (s + 1) / c->compress_rate_hca;
        if (valid > lt->nwin) valid = lt->nwin;
        for (int64_t w = 0; w < valid; w++) keys[nk++] = lt->cK + (row * S + w) * d;
    } else if (a->l->type == DS4_ATTN_CSA) {
        for (int64_t i = 0; i < lt->nsel[t]; i++) keys[nk++] = lt->cK + (row * S + lt->sel[t * a->sel_stride + i]) * d;
    }
    return nk;
}

/* Phase A, per query: probabilities P, logit gradients DS (scale folded in), dq and the sink gradient. The dots of
 * every head with the shared keys and the dq sums run as small products (ds4_dots_ptr, ds4_wsum_ptr), with the same
 * sums as head by head. */
typedef struct {
    const ds4_a_attn_bwd *a;
    float *bf;        /* bf16_in: [ntask, bf_stride] rounded operands (ds4_cpu_attn_bf16_stride), else NULL */
    size_t bf_stride;
} attn_q_job;

static void attn_q_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const attn_q_job *job = p;
    const ds4_a_attn_bwd *a = job->a;
    const ds4_config *c = a->c;
    const int64_t H = c->num_attention_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const float **keys = (const float **)(void *)(ds4_cpu_scratch(cpu, task) + cpu->key_off);
    /* bf16_in: rounded q and dout [H, d] each, keys [nk, d], DS [H, maxk] */
    float *qb = job->bf ? job->bf + (size_t)task * job->bf_stride : NULL, *gb = qb ? qb + H * d : NULL;
    float *kb = qb ? gb + H * d : NULL, *dsb = kb ? kb + a->maxk * d : NULL;
    for (int64_t t = b; t < e; t++) {
        const int64_t nk = key_list(a, t, keys);
        float *Pt = a->P + t * H * a->maxk, *DSt = a->DS + t * H * a->maxk;
        const float *q = a->lt->q + t * H * d, *g = a->dout + t * H * d;
        if (qb) {
            ds4_cpu_round_bf16(qb, q, H * d);
            ds4_cpu_round_bf16(gb, g, H * d);
            ds4_cpu_round_keys(keys, nk, d, kb);
            q = qb, g = gb;
        }
        ds4_dots_ptr(Pt, a->maxk, q, d, H, keys, nk, d);
        ds4_dots_ptr(DSt, a->maxk, g, d, H, keys, nk, d); /* dp_k: the value is the key */
        for (int64_t h = 0; h < H; h++) {
            float *P = Pt + h * a->maxk, *DS = DSt + h * a->maxk;
            const float sink = a->l->sink[h];
            float mx = sink;
            for (int64_t k = 0; k < nk; k++) {
                P[k] = P[k] * scale;
                mx = P[k] > mx ? P[k] : mx;
            }
            double den = exp((double)(sink - mx));
            const double psink_num = den;
            for (int64_t k = 0; k < nk; k++) den += (P[k] = (float)exp((double)(P[k] - mx)));
            double pdp = 0;
            for (int64_t k = 0; k < nk; k++) {
                P[k] = (float)(P[k] / den);
                pdp += (double)P[k] * DS[k];
            }
            a->dsink_t[t * H + h] = (float)(-(psink_num / den) * pdp);
            for (int64_t k = 0; k < nk; k++) DS[k] = (float)(P[k] * (DS[k] - pdp)) * scale;
        }
        const float *ds = DSt;
        if (dsb) { /* dq's product takes bf16 logit gradients; DS itself (the key gradients' weight) stays fp32 */
            for (int64_t h = 0; h < H; h++) ds4_cpu_round_bf16(dsb + h * a->maxk, DSt + h * a->maxk, nk);
            ds = dsb;
        }
        ds4_wsum_ptr(a->dq + t * H * d, d, ds, a->maxk, H, keys, nk, d, 0);
    }
}

void ds4_cpu_attn_bwd_q(ds4_dev *d, const ds4_a_attn_bwd *a) {
    const ds4_cpu *cpu = ds4_cpu_of(d);
    attn_q_job job = {a, NULL, 0};
    /* the longest key list (the window, then every causal entry or every pick) must fit the P / DS rows */
    const ds4_config *c = a->c;
    const int64_t win = c->sliding_window < a->S ? c->sliding_window : a->S;
    const int64_t kmax = win + (a->l->type == DS4_ATTN_HCA ? a->lt->nwin
                                : a->l->type == DS4_ATTN_CSA ? a->sel_stride : 0);
    if (kmax > a->maxk) {
        ds4_dev_fail(d, DS4_ERR_INTERNAL, "attn_bwd_q: %lld keys per query, the P / DS rows hold %lld",
                     (long long)kmax, (long long)a->maxk);
        return;
    }
    if (a->bf16_in) {
        job.bf_stride = ds4_cpu_attn_bf16_stride(a->c, a->maxk);
        job.bf = malloc((size_t)cpu->ntask * job.bf_stride * sizeof(float));
        if (!job.bf) {
            ds4_dev_fail(d, DS4_ERR_OOM, "attn_bwd_q: bf16 operand copies of %lld ranges x %zu floats",
                         (long long)cpu->ntask, job.bf_stride);
            return;
        }
    }
    ds4_cpu_parallel(cpu, a->B * q_per_seq(a), attn_q_range, &job);
    free(job.bf);
}

/* The rows a key's gradient adds up, with their weights, in the order the sum takes them; flushed into dk through
 * ds4_wsum_ptr (the same adds as one ds4_axpy per row onto a zeroed dk) whenever the range's scratch is full. */
typedef struct {
    const float **row;
    float *coef;
    int64_t n, cap, d;
    float *dk;
    int started;                  /* dk holds the sum so far (else it is still to be zeroed) */
} kg_list;

static kg_list kg_begin(const ds4_cpu *cpu, int64_t task, float *dk, int64_t d) {
    float *ws = ds4_cpu_scratch(cpu, task);
    const int64_t cap = (cpu->scratch_stride - 2) / 3; /* a pointer (2 floats) and a weight per row */
    return (kg_list){(const float **)(void *)ws, ws + 2 * cap, 0, cap, d, dk, 0};
}

static void kg_flush(kg_list *l) {
    if (l->n == 0) return;
    ds4_wsum_ptr(l->dk, l->d, l->coef, l->n, 1, l->row, l->n, l->d, l->started);
    l->started = 1;
    l->n = 0;
}

static void kg_add(kg_list *l, float c, const float *row) {
    if (l->n == l->cap) kg_flush(l);
    l->coef[l->n] = c;
    l->row[l->n++] = row;
}

static void kg_end(kg_list *l) {
    kg_flush(l);
    if (!l->started) memset(l->dk, 0, (size_t)l->d * sizeof(float));
}

/* The key gradients' operands: the tape's q and dout, or (bf16_in) copies rounded to bf16, the logit gradients DS
 * and probabilities P then rounded as they are read (the bf16 mode's products take bf16 operands, sums in fp32). */
typedef struct {
    const ds4_a_attn_bwd *a;
    const float *q, *dout; /* [T, H, d] */
    int bf16;
} kg_job;

static float kg_coef(const kg_job *j, float v) { return j->bf16 ? ds4_bf16_to_f32(ds4_f32_to_bf16(v)) : v; }

/* dkey += Σ_h (DS·q + P·dout) for the query t at key-list position kidx */
static void key_grad_from(const kg_job *j, int64_t t, int64_t kidx, kg_list *l) {
    const ds4_a_attn_bwd *a = j->a;
    const int64_t H = a->c->num_attention_heads, d = a->c->head_dim;
    for (int64_t h = 0; h < H; h++) {
        const int64_t o = (t * H + h) * a->maxk + kidx;
        kg_add(l, kg_coef(j, a->DS[o]), j->q + (t * H + h) * d);
        kg_add(l, kg_coef(j, a->P[o]), j->dout + (t * H + h) * d);
    }
}

/* Phase B1, per window key (token j): the queries j .. j+win-1 of its row (those in the query window). */
static void attn_kv_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const kg_job *job = p;
    const ds4_a_attn_bwd *a = job->a;
    const int64_t S = a->S, win = a->c->sliding_window, d = a->c->head_dim;
    for (int64_t tk = b; tk < e; tk++) {
        const int64_t row = tk / S, j = tk % S;
        kg_list l = kg_begin(cpu, task, a->dkv + tk * d, d);
        for (int64_t s = j; s < S && s < j + win; s++) {
            const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0, t = q_row(a, row, s);
            if (t >= 0) key_grad_from(job, t, j - j0, &l);
        }
        kg_end(&l);
    }
}

/* Run a key-gradient phase: with bf16_in, over q and dout rounded to bf16 once for the layer. */
static void key_grads(ds4_dev *d, const ds4_a_attn_bwd *a, int64_t n, void (*range)(const ds4_cpu *, const void *,
                                                                                    int64_t, int64_t, int64_t),
                      const char *op) {
    kg_job job = {a, a->lt->q, a->dout, a->bf16_in};
    float *rb = NULL;
    if (a->bf16_in) {
        const int64_t m = a->B * q_per_seq(a) * a->c->num_attention_heads * a->c->head_dim; /* [T, H, d] */
        rb = malloc((size_t)(2 * m) * sizeof(float));
        if (!rb) {
            ds4_dev_fail(d, DS4_ERR_OOM, "%s (bf16): rounded q and dout, 2 x %lld floats", op, (long long)m);
            return;
        }
        ds4_cpu_round_bf16(rb, a->lt->q, m);
        ds4_cpu_round_bf16(rb + m, a->dout, m);
        job.q = rb, job.dout = rb + m;
    }
    ds4_cpu_parallel(ds4_cpu_of(d), n, range, &job);
    free(rb);
}

void ds4_cpu_attn_bwd_kv(ds4_dev *d, const ds4_a_attn_bwd *a) {
    key_grads(d, a, a->B * a->S, attn_kv_range, "attn_bwd_kv");
}

/* Phase B2, per compressed entry (row, w): HCA queries s with w < floor((s+1)/m); CSA the queries that picked it
 * (inverse lists). */
static void attn_entry_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const kg_job *job = p;
    const ds4_a_attn_bwd *a = job->a;
    const ds4_config *c = a->c;
    const int64_t S = a->S, win = c->sliding_window, d = c->head_dim, nwin = a->lt->nwin;
    for (int64_t i = b; i < e; i++) {
        const int64_t row = i / nwin, w = i % nwin;
        kg_list l = kg_begin(cpu, task, a->dK + (row * S + w) * d, d);
        if (a->l->type == DS4_ATTN_HCA) {
            const int64_t m = c->compress_rate_hca;
            for (int64_t s = (w + 1) * m - 1; s < S; s++) {
                const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0, t = q_row(a, row, s);
                if (t >= 0) key_grad_from(job, t, (s - j0 + 1) + w, &l);
            }
        } else {
            for (int64_t q = a->inv_off[row * S + w]; q < a->inv_off[row * S + w + 1]; q++) {
                const int64_t t = a->inv_t[q], s = a->q0 + t % q_per_seq(a);
                const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
                key_grad_from(job, t, (s - j0 + 1) + a->inv_i[q], &l);
            }
        }
        kg_end(&l);
    }
}

void ds4_cpu_attn_bwd_entry(ds4_dev *d, const ds4_a_attn_bwd *a) {
    key_grads(d, a, a->B * a->lt->nwin, attn_entry_range, "attn_bwd_entry");
}

void ds4_cpu_pick_inverse(ds4_dev *d, const ds4_a_pick_inverse *a) {
    (void)d;
    const int64_t S = a->S, n = a->B * S, qn = a->qn ? a->qn : S; /* query row t belongs to sequence t / qn */
    memset(a->inv_off, 0, (size_t)(n + 1) * sizeof(int64_t));
    for (int64_t t = 0; t < a->T; t++)
        for (int64_t i = 0; i < a->nsel[t]; i++) a->inv_off[(t / qn) * S + a->sel[t * a->sel_stride + i] + 1]++;
    for (int64_t x = 0; x < n; x++) a->inv_off[x + 1] += a->inv_off[x];
    for (int64_t t = 0; t < a->T; t++) /* t ascending: each list is in query order */
        for (int64_t i = 0; i < a->nsel[t]; i++) {
            const int64_t slot = a->inv_off[(t / qn) * S + a->sel[t * a->sel_stride + i]]++;
            a->inv_t[slot] = (int32_t)t;
            a->inv_i[slot] = (int32_t)i;
        }
    for (int64_t x = n; x > 0; x--) a->inv_off[x] = a->inv_off[x - 1];
    a->inv_off[0] = 0;
}

void ds4_cpu_entry_rope(ds4_dev *d, const ds4_a_entry_rope *a) {
    (void)d;
    for (int64_t row = 0; row < a->B; row++)
        for (int64_t win = 0; win < a->nwin; win++)
            ds4_rope_apply(a->x + (row * a->S + win) * a->dd, a->dd, a->rt.half, ds4_rope_at(&a->rt, win * a->m), a->sign);
}

/* Pooling backward per window (row, win) and block of COMP_CH channels ch < dd: α = softmax over the slots, pooled =
 * Σ α·kv. A window writes dC / dZ of its own tokens (columns off + ch) and, with overlap, of the previous window's
 * tokens (columns ch < dd): no element twice, so items split across tasks race on nothing. Items were channels
 * alone before: a task of a few channels wrote one or two floats of every cache line of dC / dZ, and tasks of
 * neighbouring channels on other cores fought for the same lines (on a 16-core host this op took 3.9x the task CPU
 * of two threads, whose 16-channel tasks own whole lines). The bias gradient is summed afterwards
 * (comp_bwd_ape_range). */
enum { COMP_CH = 16 };
static void comp_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_comp_bwd *a = p;
    const ds4_compressor_w *w = a->w;
    const int64_t m = w->rate, dd = w->dd, width = w->width, S = a->S, nblk = (dd + COMP_CH - 1) / COMP_CH;
    for (int64_t item = b; item < e; item++) {
        const int64_t row = item / nblk / a->nwin, win = item / nblk % a->nwin, c0 = item % nblk * COMP_CH;
        for (int64_t ch = c0; ch < dd && ch < c0 + COMP_CH; ch++) {
            float gl[2 * DS4_MAX_RATE], kv[2 * DS4_MAX_RATE];
            int64_t tok[2 * DS4_MAX_RATE], colv[2 * DS4_MAX_RATE], ns = 0;
            if (a->overlap && win > 0)
                for (int64_t j = 0; j < m; j++) {
                    tok[ns] = row * S + (win - 1) * m + j, colv[ns] = ch;
                    gl[ns] = a->Z[tok[ns] * width + ch] + w->ape[j * width + ch];
                    kv[ns] = a->C[tok[ns] * width + ch];
                    ns++;
                }
            const int64_t off = a->overlap ? dd : 0;
            for (int64_t j = 0; j < m; j++) {
                tok[ns] = row * S + win * m + j, colv[ns] = off + ch;
                gl[ns] = a->Z[tok[ns] * width + off + ch] + w->ape[j * width + off + ch];
                kv[ns] = a->C[tok[ns] * width + off + ch];
                ns++;
            }
            float mx = -INFINITY;
            for (int64_t k = 0; k < ns; k++) mx = gl[k] > mx ? gl[k] : mx;
            double den = 0;
            for (int64_t k = 0; k < ns; k++) den += (gl[k] = (float)exp((double)(gl[k] - mx)));
            const float dp = a->dpool[(row * S + win) * dd + ch];
            double adot = 0;
            for (int64_t k = 0; k < ns; k++) {
                gl[k] = (float)(gl[k] / den); /* α */
                adot += (double)gl[k] * dp * kv[k];
            }
            for (int64_t k = 0; k < ns; k++) {
                a->dC[tok[k] * width + colv[k]] = gl[k] * dp;
                a->dZ[tok[k] * width + colv[k]] = (float)(gl[k] * ((double)dp * kv[k] - adot));
            }
        }
    }
}

/* gape[j, col] += dZ of slot j of every window in (row, win) order, the order the per-channel loop added them in
 * (one slot per window and column: columns ch < dd take the overlap slots of windows win >= 1, the others the
 * window's own). Items of COMP_CH columns: each task owns whole cache lines of gape. */
static void comp_bwd_ape_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_comp_bwd *a = p;
    const int64_t m = a->w->rate, dd = a->w->dd, width = a->w->width, ncol = a->overlap ? 2 * dd : dd;
    const int64_t c0 = b * COMP_CH, c1 = e * COMP_CH < ncol ? e * COMP_CH : ncol;
    for (int64_t row = 0; row < a->B; row++)
        for (int64_t win = 0; win < a->nwin; win++)
            for (int64_t j = 0; j < m; j++) {
                float *g = a->gape + j * width;
                const float *own = a->dZ + (row * a->S + win * m + j) * width;
                const float *prev = win > 0 ? own - m * width : NULL; /* slot j of the previous window */
                for (int64_t c = c0; c < c1; c++) {
                    const int ov = a->overlap && c < dd;
                    if (ov && !prev) continue;
                    g[c] += ov ? prev[c] : own[c];
                }
            }
}

void ds4_cpu_comp_bwd(ds4_dev *d, const ds4_a_comp_bwd *a) {
    const ds4_cpu *cpu = ds4_cpu_of(d);
    const int64_t m = a->w->rate, dd = a->w->dd, ncol = a->overlap ? 2 * dd : dd;
    const int64_t nblk = (dd + COMP_CH - 1) / COMP_CH;
    /* per item: C, Z and ape read, dC and dZ written, for m slots (2m with overlap) of COMP_CH channels */
    ds4_cpu_parallel_work(cpu, a->B * a->nwin * nblk, 5 * m * COMP_CH * (ncol / dd), comp_bwd_range, a);
    if (a->gape)
        ds4_cpu_parallel_work(cpu, (ncol + COMP_CH - 1) / COMP_CH, a->B * a->nwin * m * COMP_CH,
                              comp_bwd_ape_range, a);
}

/* Indexer KL backward, per query: I_i = Σ_h ω_h·relu(q_h·K_i)·c^-1/2 over the picks i. dω and dq stay with the
 * query; the per-pick dscore·ω·[q·K > 0]·c^-1/2 goes to dsi for the per-entry gather. */
static void ikl_q_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_ikl_bwd *a = p;
    const ds4_layer_tape *lt = a->lt;
    const int64_t nI = a->c->index_n_heads, cI = a->c->index_head_dim, S = a->S, sel = a->sel_stride;
    const float qscale = 1.0f / sqrtf((float)cI);
    for (int64_t t = b; t < e; t++) {
        const int64_t row = t / S;
        memset(a->diq + t * nI * cI, 0, (size_t)(nI * cI) * sizeof(float));
        for (int64_t h = 0; h < nI; h++) {
            const float *q = lt->iq + (t * nI + h) * cI;
            float dw = 0;
            for (int64_t i = 0; i < lt->nsel[t]; i++) {
                const float *key = lt->iK + (row * S + lt->sel[t * sel + i]) * cI;
                const float dot = ds4_dot(q, key, cI), g = a->dI[t * sel + i];
                dw += g * (dot > 0 ? dot * qscale : 0.0f);
                const float ds = dot > 0 ? g * lt->iw[t * nI + h] * qscale : 0.0f;
                a->dsi[(t * nI + h) * sel + i] = ds;
                if (ds != 0) ds4_axpy(a->diq + (t * nI + h) * cI, ds, key, cI);
            }
            a->diw[t * nI + h] = dw;
        }
    }
}

void ds4_cpu_ikl_bwd_q(ds4_dev *d, const ds4_a_ikl_bwd *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->T, ikl_q_range, a); }

/* Per indexer entry: dK_w = Σ over the queries that picked it (inverse lists) of Σ_h dsi · q_h. */
static void ikl_k_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_ikl_bwd *a = p;
    const ds4_layer_tape *lt = a->lt;
    const int64_t nI = a->c->index_n_heads, cI = a->c->index_head_dim, S = a->S, sel = a->sel_stride;
    for (int64_t x = b; x < e; x++) {
        const int64_t row = x / lt->nwin, w = x % lt->nwin;
        float *dk = a->dK + (row * S + w) * cI;
        memset(dk, 0, (size_t)cI * sizeof(float));
        for (int64_t q = a->inv_off[row * S + w]; q < a->inv_off[row * S + w + 1]; q++) {
            const int64_t t = a->inv_t[q], i = a->inv_i[q];
            for (int64_t h = 0; h < nI; h++) ds4_axpy(dk, a->dsi[(t * nI + h) * sel + i], lt->iq + (t * nI + h) * cI, cI);
        }
    }
}

void ds4_cpu_ikl_bwd_k(ds4_dev *d, const ds4_a_ikl_bwd *a) {
    ds4_cpu_parallel(ds4_cpu_of(d), a->B * a->lt->nwin, ikl_k_range, a);
}
