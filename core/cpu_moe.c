/* cpu_moe.c — CPU operations of the MoE sub-layer: the router (scores, top-K or hash routing, weights), grouping
 * the (token, slot) pairs by expert, the SwiGLU with clamps, weighting and combining the expert outputs, and
 * their backward. docs/architecture.md, "MoE", gives the equations. */
#include <string.h>

#include "cpu.h"
#include "shape_limits.h"

float ds4_score(ds4_score_func sf, float x) {
    if (sf == DS4_SCORE_SIGMOID) return ds4_sigmoidf(x);
    /* torch softplus (beta 1, threshold 20): x above 20, log1p(exp(x)) otherwise */
    double sp = x > 20.0f ? (double)x : log1p(exp((double)x));
    return (float)sqrt(sp);
}

static void route_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_route *a = p;
    const ds4_config *c = a->c;
    const int64_t E = c->n_routed_experts, K = c->num_experts_per_tok;
    for (int64_t t = b; t < e; t++) {
        float *s = a->s + t * E;
        if (c->scoring_func == DS4_SCORE_SOFTMAX) {
            float mx = -INFINITY;
            for (int64_t x = 0; x < E; x++) mx = s[x] > mx ? s[x] : mx;
            double den = 0;
            for (int64_t x = 0; x < E; x++) den += exp((double)(s[x] - mx));
            for (int64_t x = 0; x < E; x++) s[x] = (float)(exp((double)(s[x] - mx)) / den);
        } else {
            for (int64_t x = 0; x < E; x++) s[x] = ds4_score(c->scoring_func, s[x]);
        }
        int32_t *idx = a->eidx + t * K;
        const int32_t *rp = a->replay ? a->replay + t * a->replay_ld : NULL;
        if (a->l->is_hash) {
            for (int64_t k = 0; k < K; k++) idx[k] = a->l->tid2eid[a->ids[t] * K + k];
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
                    float v = s[x] + a->l->gate_bias[x];
                    if (best < 0 || v > bv) best = x, bv = v;
                }
                idx[k] = (int32_t)best;
            }
        }
        float sum = 0;
        for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
        for (int64_t k = 0; k < K; k++) a->ew[t * K + k] = s[idx[k]] / (sum + 1e-20f) * (float)c->routed_scaling_factor;
    }
}

void ds4_cpu_route(ds4_dev *d, const ds4_a_route *a) {
    /* a row's scores, then K passes over them for the top K: a few dozen floats' work per token */
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->T, (a->c->num_experts_per_tok + 2) * a->c->n_routed_experts, route_range, a);
}

void ds4_cpu_count_loads(ds4_dev *d, const ds4_a_count_loads *a) {
    (void)d;
    for (int64_t i = 0; i < a->n; i++) a->loads[a->eidx[i]]++;
}

void ds4_cpu_moe_sort(ds4_dev *d, const ds4_a_moe_sort *a) {
    (void)d;
    int64_t *off = a->off;
    memset(off, 0, (size_t)(a->E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < a->n; i++) off[a->eidx[i] + 1]++;
    for (int64_t x = 0; x < a->E; x++) off[x + 1] += off[x];
    /* off[x] serves as expert x's fill cursor, which leaves it at the start of x+1: shift back */
    for (int64_t i = 0; i < a->n; i++) a->perm[off[a->eidx[i]]++] = (int32_t)i;
    for (int64_t x = a->E; x > 0; x--) off[x] = off[x - 1];
    off[0] = 0;
}

/* perm is a permutation of the slots (moe_sort): ranges of r write disjoint rows. */
static void weigh_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_moe_weigh *a = p;
    for (int64_t r = b; r < e; r++) {
        const int32_t slot = a->perm[r];
        const float w = a->ew[slot];
        const float *src = a->ye + r * a->D;
        float *dst = a->yk + (int64_t)slot * a->D;
        for (int64_t cc = 0; cc < a->D; cc++) dst[cc] = src[cc] * w;
    }
}

void ds4_cpu_moe_weigh(ds4_dev *d, const ds4_a_moe_weigh *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->rows, 16, weigh_range, a);
}

/* silu(min(g, λ)) · clamp(u, -λ, λ), in place into g1 */
static void swiglu_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_swiglu *a = p;
    for (int64_t i = b * a->I; i < e * a->I; i++) {
        float g = a->g1[i] > a->lim ? a->lim : a->g1[i];
        float u = a->g3[i] < -a->lim ? -a->lim : (a->g3[i] > a->lim ? a->lim : a->g3[i]);
        a->g1[i] = ds4_silu(g) * u;
    }
}

void ds4_cpu_swiglu(ds4_dev *d, const ds4_a_swiglu *a) {
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->rows, 3 * a->I, swiglu_range, a); /* g, u read, g written */
}

/* routed = Σ_k w_k · y_k, accumulated in ascending expert order like HF's index_add_ loop; added to the shared
 * expert's output already in a. */
static void combine_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_moe_combine *a = p;
    const int64_t K = a->K, D = a->D;
    float *acc = ds4_cpu_scratch(cpu, task); /* D floats */
    for (int64_t t = b; t < e; t++) {
        int32_t order[DS4_MAX_TOPK_EXPERTS];
        for (int64_t k = 0; k < K; k++) order[k] = (int32_t)k;
        for (int64_t i = 1; i < K; i++) /* insertion sort of slots by expert id (stable) */
            for (int64_t j = i; j > 0 && a->eidx[t * K + order[j]] < a->eidx[t * K + order[j - 1]]; j--) {
                int32_t tmp = order[j];
                order[j] = order[j - 1];
                order[j - 1] = tmp;
            }
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int64_t k = 0; k < K; k++) ds4_axpy(acc, 1.0f, a->yk + (t * K + order[k]) * D, D);
        ds4_axpy(a->a + t * D, 1.0f, acc, D);
    }
}

void ds4_cpu_moe_combine(ds4_dev *d, const ds4_a_moe_combine *a) {
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->T, (a->K + 2) * a->D, combine_range, a); /* K expert rows, a read and written */
}

/* ------------------------------------------------------------------------------------------------ backward */

/* SwiGLU with clamps: act = silu(min(g1, λ)) · clamp(g3, ±λ); torch's clamp passes the gradient where the input
 * lies inside [min, max] (boundaries included). */
static void swiglu_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_swiglu_bwd *c = p;
    for (int64_t i = b * c->I; i < e * c->I; i++) {
        const float g = c->g1[i] > c->lim ? c->lim : c->g1[i];
        const float u = c->g3[i] < -c->lim ? -c->lim : (c->g3[i] > c->lim ? c->lim : c->g3[i]);
        if (!c->grads) { /* the forward's expression, ds4_silu(g)·u; the sigmoid below is not needed here (expf may
                          * set errno, so the compiler kept computing it: two expf a value instead of one) */
            const float ez = expf(-g);
            c->act[i] = g / (1.0f + ez) * u;
            if (c->ex) c->ex[i] = ez;
            continue;
        }
        /* ds4_sigmoidf(g), from the exp the act pass left when it did (the same value: one expf a value fewer) */
        const float sgm = c->ex ? 1.0f / (1.0f + c->ex[i]) : ds4_sigmoidf(g), silu = g * sgm;
        const float dsilu = sgm * (1.0f + g * (1.0f - sgm));
        c->dg1[i] = c->g1[i] <= c->lim ? c->dact[i] * u * dsilu : 0.0f;
        c->dg3[i] = (c->g3[i] >= -c->lim && c->g3[i] <= c->lim) ? c->dact[i] * silu : 0.0f;
    }
}

void ds4_cpu_swiglu_bwd(ds4_dev *d, const ds4_a_swiglu_bwd *a) {
    ds4_cpu_parallel_work(ds4_cpu_of(d), a->rows, 5 * a->I, swiglu_bwd_range, a); /* g, u, dact read; dg1, dg3 */
}

static void dws_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_moe_dws *a = p;
    for (int64_t slot = b; slot < e; slot++)
        a->dws[slot] = ds4_dot(a->da + (slot / a->K) * a->D, a->ye + slot * a->D, a->D);
}

void ds4_cpu_moe_dws(ds4_dev *d, const ds4_a_moe_dws *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T * a->K, 16, dws_range, a);
}

static void dy_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_moe_dy *a = p;
    for (int64_t r = b; r < e; r++) {
        const int64_t slot = a->perm[r];
        float *dy = a->dys + r * a->D;
        memset(dy, 0, (size_t)a->D * sizeof(float));
        ds4_axpy(dy, a->ew[slot], a->da + (slot / a->K) * a->D, a->D);
    }
}

void ds4_cpu_moe_dy(ds4_dev *d, const ds4_a_moe_dy *a) { ds4_cpu_parallel_grain(ds4_cpu_of(d), a->rows, 16, dy_range, a); }

static void sum_slots_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_moe_sum_slots *a = p;
    for (int64_t t = b; t < e; t++) /* slot order: deterministic */
        for (int64_t k = 0; k < a->K; k++) ds4_axpy(a->dh + t * a->D, 1.0f, a->dxslot + (t * a->K + k) * a->D, a->D);
}

void ds4_cpu_moe_sum_slots(ds4_dev *d, const ds4_a_moe_sum_slots *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T, 16, sum_slots_range, a);
}

/* Router: w_k = rsf·s_k / (Σ s + 1e-20) on the gathered scores (the correction bias only selected), then through
 * the score function. */
static void router_bwd_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e_, int64_t task) {
    const ds4_a_router_bwd *a = p;
    const ds4_config *c = a->c;
    const int64_t E = c->n_routed_experts, K = c->num_experts_per_tok;
    const float rsf = (float)c->routed_scaling_factor;
    memset(a->dsc + b * E, 0, (size_t)((e_ - b) * E) * sizeof(float));
    for (int64_t t = b; t < e_; t++) {
        const int32_t *idx = a->eidx + t * K;
        const float *s = a->rsc + t * E;
        float sum = 0, wdot = 0;
        for (int64_t k = 0; k < K; k++) sum += s[idx[k]];
        sum += 1e-20f;
        for (int64_t k = 0; k < K; k++) wdot += a->dws[t * K + k] * s[idx[k]];
        for (int64_t k = 0; k < K; k++) a->dsc[t * E + idx[k]] += rsf * (a->dws[t * K + k] / sum - wdot / (sum * sum));
    }
    for (int64_t t = b; t < e_; t++) {
        const float *x = a->rlog + t * E, *s = a->rsc + t * E, *ds = a->dsc + t * E;
        float *dl = a->dlog + t * E;
        if (c->scoring_func == DS4_SCORE_SOFTMAX) {
            double dot = 0;
            for (int64_t e = 0; e < E; e++) dot += (double)s[e] * ds[e];
            for (int64_t e = 0; e < E; e++) dl[e] = (float)(s[e] * (ds[e] - dot));
        } else if (c->scoring_func == DS4_SCORE_SIGMOID) {
            for (int64_t e = 0; e < E; e++) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
        } else {
            /* d sqrt(softplus(x)) = σ(x) / (2 sqrt(softplus(x))); where softplus underflows, the limit e^{x/2}/2
             * (docs/architecture.md, "Numerical choices") instead of 0/0. Torch's softplus returns x above 20
             * (gradient 1). */
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
}

void ds4_cpu_router_bwd(ds4_dev *d, const ds4_a_router_bwd *a) {
    ds4_cpu_parallel_grain(ds4_cpu_of(d), a->T, 32, router_bwd_range, a);
}
