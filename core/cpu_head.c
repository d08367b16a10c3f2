/* cpu_head.c — CPU operations at the ends of the model: per-row cross-entropy and log-probabilities over the
 * vocabulary (sums in double, the max subtracted first), sampling, and the backward of the log-probabilities
 * and of the embedding. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

static void ce_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_ce_rows *a = p;
    const int64_t V = a->V;
    for (int64_t r = b; r < e; r++) {
        const int64_t y = a->tgt[r];
        if (y == -100 && !a->rmx) continue;
        const float *z = a->logits + r * V;
        float mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        double se = 0;
        for (int64_t v = 0; v < V; v++) se += exp((double)z[v] - mx);
        if (a->rmx) a->rmx[r] = mx, a->rse[r] = se;
        if (y != -100) a->nll[r] = log(se) + mx - z[y];
    }
}

/* Rows are independent: any split gives the same bits. */
void ds4_cpu_ce_rows(ds4_dev *d, const ds4_a_ce_rows *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->rows, ce_range, a); }

static void logprobs_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t end, int64_t task) {
    const ds4_a_logprobs *a = p;
    const int64_t V = a->V;
    for (int64_t t = b; t < end; t++) {
        const float *z = a->logits + t * V;
        float mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        double se = 0, ez = 0;
        for (int64_t v = 0; v < V; v++) {
            const double e = exp((double)z[v] - mx);
            se += e;
            ez += e * ((double)z[v] - mx);
        }
        if (a->rmx) a->rmx[t] = mx, a->rse[t] = se;
        const double lse = log(se);
        const int64_t y = a->tgt[t];
        if (a->nll && y != -100) a->nll[t] = lse + mx - z[y]; /* ce_range's expression on the same sum */
        if (a->logp) a->logp[t] = y == -100 ? 0.0f : (float)((double)z[y] - mx - lse);
        if (a->entropy) a->entropy[t] = (float)(lse - ez / se); /* H = log Σe − E[z − mx] */
    }
}

void ds4_cpu_logprobs(ds4_dev *d, const ds4_a_logprobs *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->rows, logprobs_range, a); }

typedef struct {
    const ds4_a_sample *a;
    char *ws;                     /* [ntask, stride] ds4_sample's scratch, one per range */
    size_t stride;
} sample_job;

/* Rows are independent (each has its own uniform u[r]): any split gives the same ids and log-probabilities. A row
 * that fails is left at id -1; ds4_cpu_sample draws it again alone for the message. */
static void sample_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    (void)cpu;
    const sample_job *j = p;
    const ds4_a_sample *a = j->a;
    for (int64_t r = b; r < e; r++) {
        ds4_error err;
        a->id[r] = ds4_sample(a->logits + (int64_t)a->lrow[r] * a->V, a->V, &a->p, a->u[r], &a->lp_model[r],
                              &a->lp_sample[r], j->ws + (size_t)task * j->stride, &err);
    }
}

void ds4_cpu_sample(ds4_dev *d, const ds4_a_sample *a) {
    ds4_cpu *cpu = ds4_cpu_of(d);
    const size_t one = (ds4_sample_scratch_bytes(a->V) + 63) & ~(size_t)63;
    if (a->rows <= 0) return;
    if (one == 0) { /* a vocabulary ds4_sample refuses: its message */
        ds4_error e;
        (void)ds4_sample(a->logits, a->V, &a->p, a->u[0], &a->lp_model[0], &a->lp_sample[0], &e, &e);
        ds4_dev_fail(d, DS4_ERR_ARG, "sample: row 0 of [%lld, %lld]: %s", (long long)a->rows, (long long)a->V, e.msg);
        return;
    }
    if (one > SIZE_MAX / (size_t)cpu->ntask) {
        ds4_dev_fail(d, DS4_ERR_OOM, "sample: scratch of %lld x %zu bytes", (long long)cpu->ntask, one);
        return;
    }
    const size_t need = one * (size_t)cpu->ntask;
    if (need > cpu->sample_bytes) {
        void *ws = realloc(cpu->sample_ws, need);
        if (!ws) {
            ds4_dev_fail(d, DS4_ERR_OOM, "sample: scratch of %zu bytes for a vocabulary of %lld", need, (long long)a->V);
            return;
        }
        cpu->sample_ws = ws;
        cpu->sample_bytes = need;
    }
    const sample_job j = {a, cpu->sample_ws, one};
    ds4_cpu_parallel(cpu, a->rows, sample_range, &j);
    for (int64_t r = 0; r < a->rows; r++) {
        if (a->id[r] >= 0) continue;
        ds4_error e;
        (void)ds4_sample(a->logits + (int64_t)a->lrow[r] * a->V, a->V, &a->p, a->u[r], &a->lp_model[r],
                         &a->lp_sample[r], cpu->sample_ws, &e);
        ds4_dev_fail(d, DS4_ERR_ARG, "sample: row %lld of [%lld, %lld]: %s", (long long)r, (long long)a->rows,
                     (long long)a->V, e.msg);
        return;
    }
}

/* dlogits of a per-token objective on log p(target): d logp_y / dz = onehot(y) − softmax(z), so dz = g·(onehot −
 * softmax) at scored rows, 0 elsewhere. The cross-entropy is the case g = −scale. Each exp is taken once and kept
 * (in double, in the range's scratch) for the normalised pass: the same values as taking it twice. Given the row's
 * statistics (rmx, rse: the forward's, on these logits), the max and the sum are not formed again. */
static void logp_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_logp_bwd *a = p;
    const int64_t V = a->V;
    double *ex = (double *)(void *)ds4_cpu_scratch(cpu, task); /* V doubles: cpu_reserve sizes the scratch for them */
    for (int64_t r = b; r < e; r++) {
        float *dl = a->dl + r * V;
        const float *z = a->logits + r * V;
        const int64_t y = a->tgt[r];
        const double g = a->dlogp ? (double)a->dlogp[r] : a->g0;
        if (y == -100 || g == 0) {
            memset(dl, 0, (size_t)V * sizeof(float));
            continue;
        }
        if (a->rmx) {
            const float mx = a->rmx[r];
            const double se = a->rse[r];
            for (int64_t v = 0; v < V; v++) dl[v] = (float)(-g * exp((double)z[v] - mx) / se);
            dl[y] += (float)g;
            continue;
        }
        float mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        double se = 0;
        for (int64_t v = 0; v < V; v++) se += (ex[v] = exp((double)z[v] - mx));
        for (int64_t v = 0; v < V; v++) dl[v] = (float)(-g * ex[v] / se);
        dl[y] += (float)g;
    }
}

void ds4_cpu_logp_bwd(ds4_dev *d, const ds4_a_logp_bwd *a) { ds4_cpu_parallel(ds4_cpu_of(d), a->rows, logp_bwd_range, a); }

/* Column blocks of 16, every token in order: repeated ids add up deterministically. */
static void embed_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_embed_bwd *a = p;
    const int64_t c0 = b * 16, c1 = e * 16 < a->D ? e * 16 : a->D;
    for (int64_t t = 0; t < a->T; t++)
        for (int64_t i = 0; i < a->n; i++) {
            float *g = a->ge + a->ids[t] * a->D;
            const float *x = a->dx + (t * a->n + i) * a->D;
            for (int64_t j = c0; j < c1; j++) g[j] += 1.0f * x[j];
        }
}

void ds4_cpu_embed_bwd(ds4_dev *d, const ds4_a_embed_bwd *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), (a->D + 15) / 16, 2, embed_bwd_range, a);
}
