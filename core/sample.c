/* sample.c — drawing one token from a row of logits (ds4_sample), the counter-based uniform that drives it, and
 * the names of the finish reasons. Contract: core/include/ds4_gen.h.
 *
 * Semantics, all in double:
 *   - lp_model = logit[id] - logsumexp(logits): temperature 1, full vocabulary, with the max subtracted first.
 *   - temperature 0: greedy, the argmax with ties to the lowest id; lp_sample = 0.
 *   - otherwise w_i = exp((logit_i - max) / T), i.e. p_i ∝ exp(logit_i / T), then in HF's warper order:
 *       top-k: keep the k largest (ties at the boundary: lower ids first, so exactly k survive); k = 0 or
 *              k >= V: off;
 *       top-p: in descending order (ties: lower id first), keep the smallest prefix whose cumulative mass,
 *              renormalised over what top-k kept, is >= top_p (at least one token; all if rounding never gets
 *              there); top_p = 0 or 1: off (0 so that a zero-initialised ds4_sampling is plain greedy);
 *       min-p: keep p_i >= min_p · p_max of what is left (renormalising cancels in the ratio);
 *     then renormalise and draw by inverse CDF at u over the kept tokens in ascending id order: the first id
 *     whose cumulative weight exceeds u · total. lp_sample = log(w_id / total).
 *   - +inf logits are rejected (one would take all the mass and make the softmax inf/inf); -inf logits are
 *     probability 0 and can never be drawn, but at least one logit must be finite. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
    double w;   /* unnormalised probability exp((logit - max) / T) */
    int64_t id;
} sample_ent;

/* Descending weight, ties to the lower id: the order top-k and top-p read. */
static int by_weight(const void *a, const void *b) {
    const sample_ent *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int by_id(const void *a, const void *b) {
    const sample_ent *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

size_t ds4_sample_scratch_bytes(int64_t V) {
    size_t n;
    /* 0 also signals "not addressable": ds4_sample rejects such a V */
    if (V < 1 || (uint64_t)V > SIZE_MAX || !ds4_mul_size((size_t)V, sizeof(sample_ent), &n)) return 0;
    return n;
}

#define SAMPLE_BAD(...) return (ds4_fail(err, DS4_ERR_ARG, __VA_ARGS__), (int64_t)-1)

int64_t ds4_sample(const float *logits, int64_t V, const ds4_sampling *p, double u, double *lp_model,
                   double *lp_sample, void *scratch, ds4_error *err) {
    const char *null = !logits ? "logits" : !p ? "sampling" : !lp_model ? "lp_model" : !lp_sample ? "lp_sample"
                     : !scratch ? "scratch" : NULL;
    if (null) SAMPLE_BAD("sample: %s is NULL", null);
    if (ds4_sample_scratch_bytes(V) == 0)
        SAMPLE_BAD("sample: vocabulary size V = %lld must be >= 1 (and V·%zu scratch bytes addressable)",
                   (long long)V, sizeof(sample_ent));
    const double T = p->temperature;
    /* inf is refused because -inf / inf (a -inf logit) would be NaN */
    if (!(T >= 0) || isinf(T)) SAMPLE_BAD("sample: temperature %g must be finite and >= 0", T);
    if (p->top_k < 0) SAMPLE_BAD("sample: top_k %lld must be >= 0 (0: off)", (long long)p->top_k);
    if (!(p->top_p >= 0 && p->top_p <= 1)) SAMPLE_BAD("sample: top_p %g outside [0, 1] (0 or 1: off)", p->top_p);
    if (!(p->min_p >= 0 && p->min_p <= 1)) SAMPLE_BAD("sample: min_p %g outside [0, 1] (0: off)", p->min_p);
    if (!(u >= 0 && u < 1)) SAMPLE_BAD("sample: u %g outside [0, 1)", u);

    int64_t arg = 0; /* strict > keeps the lowest id among equal maxima */
    for (int64_t i = 0; i < V; i++) {
        if (isnan(logits[i])) SAMPLE_BAD("sample: logits[%lld] of [%lld] is NaN", (long long)i, (long long)V);
        if (isinf(logits[i]) && logits[i] > 0)
            SAMPLE_BAD("sample: logits[%lld] of [%lld] is +inf (invalid: the softmax is undefined)", (long long)i,
                       (long long)V);
        if (logits[i] > logits[arg]) arg = i;
    }
    const double mx = logits[arg];
    if (isinf(mx)) SAMPLE_BAD("sample: all %lld logits are -inf (no token has nonzero probability)", (long long)V);
    /* At temperature 1 the sampling weights are the normaliser's terms ((l - mx) / 1 is exact): one exp per id,
     * kept in the scratch and added in the same order, the same bits as taking them twice. */
    sample_ent *e = scratch;
    const int unit = T == 1.0;
    double z = 0;
    for (int64_t i = 0; i < V; i++) {
        const double w = exp((double)logits[i] - mx);
        if (unit) e[i] = (sample_ent){w, i};
        z += w;
    }
    const double lse = mx + log(z);

    if (T == 0) {
        *lp_model = (double)logits[arg] - lse;
        *lp_sample = 0;
        return arg;
    }

    if (!unit)
        for (int64_t i = 0; i < V; i++) e[i] = (sample_ent){exp(((double)logits[i] - mx) / T), i};
    int64_t n = V; /* e[0, n) is the kept set */
    const int topk = p->top_k > 0 && p->top_k < V, topp = p->top_p > 0 && p->top_p < 1;
    if (topk || topp) { /* only these need an order; without them everything below is O(V) */
        qsort(e, (size_t)V, sizeof *e, by_weight);
        if (topk) n = p->top_k;
        if (topp) {
            double tot = 0, cum = 0;
            for (int64_t j = 0; j < n; j++) tot += e[j].w;
            int64_t m = 0;
            while (m < n) {
                cum += e[m++].w;
                if (cum / tot >= p->top_p) break;
            }
            n = m;
        }
    }
    /* The argmax survives top-k and top-p (it sorts first) and its weight is exp(0) = 1 exactly, so p_max = 1 /
     * total and p_i >= min_p · p_max is w_i >= min_p; it always keeps the argmax since min_p <= 1. */
    if (p->min_p > 0) {
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++)
            if (e[j].w >= p->min_p) e[m++] = e[j]; /* stable: a sorted prefix stays a sorted prefix */
        n = m;
    }
    if (topk || topp) qsort(e, (size_t)n, sizeof *e, by_id);

    /* Total and running sum in the same (ascending id) order, so the running sum ends exactly at the total and
     * u · total < total finds a token; the fallback (last kept token of nonzero weight) only guards rounding.
     * A weight-0 token is never picked: the running sum does not grow there, so it would have stopped earlier
     * (and 0 > u · total is false at the first). */
    double tot = 0;
    for (int64_t j = 0; j < n; j++) tot += e[j].w;
    const double target = u * tot;
    double cum = 0;
    int64_t pick = 0;
    for (int64_t j = 0; j < n; j++) {
        cum += e[j].w;
        if (e[j].w > 0) pick = j;
        if (cum > target) break;
    }
    *lp_model = (double)logits[e[pick].id] - lse;
    *lp_sample = log(e[pick].w / tot);
    return e[pick].id;
}

/* splitmix64's finaliser: a bijection of 64-bit words with full avalanche. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Each input is folded in by its own round, each a bijection of the new input for fixed earlier ones: for a
 * given (seed, stream) distinct steps never collide, nor distinct streams for a given (seed, step). The odd
 * constant keeps zero inputs away from mix64's fixed point 0. */
double ds4_sample_uniform(uint64_t seed, uint64_t stream, uint64_t step) {
    const uint64_t g = 0x9E3779B97F4A7C15ull;
    uint64_t h = mix64(seed + g);
    h = mix64((h ^ stream) + g);
    h = mix64((h ^ step) + g);
    return (double)(h >> 11) * 0x1.0p-53; /* top 53 bits: exact in a double, < 1 */
}

const char *ds4_finish_name(ds4_finish f) {
    switch (f) {
    case DS4_FINISH_NONE: return "none";
    case DS4_FINISH_LENGTH: return "length";
    case DS4_FINISH_EOS: return "eos";
    case DS4_FINISH_STOP_TOKEN: return "stop_token";
    case DS4_FINISH_STOP_STRING: return "stop_string";
    case DS4_FINISH_CANCELLED: return "cancelled";
    }
    return "unknown";
}
