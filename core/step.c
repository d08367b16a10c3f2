/* step.c — ds4_model_step: new tokens of several sequences through the model, appended to their caches.
 *
 * The T rows of a step are the new tokens of nseq sequences, sequence after sequence, each at its own absolute
 * positions. The schedule is the forward's (ds4_block); only the addressing differs (ds4_rows: positions, the
 * sequence of each row, each sequence's cache), which the operations read. Row tables are built here on the host
 * and handed to the backend before the pass. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lora.h"
#include "sched.h"

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
        if (c->dev != m->dev)
            return ds4_fail(err, DS4_ERR_ARG, "step: cache %lld lives on the %s backend but the model now computes on %s "
                            "(create caches after moving the model)", (long long)s, c->dev->ops->name, m->dev->ops->name);
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

/* The record key of a decoding step: its shape, where its buffers are, what it writes. */
static uint64_t step_key(const ds4_model *m, const ds4_pass *f, int64_t nseq, int64_t cap, const float *last_out,
                         const ds4_step_args *a) {
    const uint64_t v[] = {(uint64_t)nseq, (uint64_t)f->T, (uint64_t)cap, (uint64_t)(uintptr_t)m->ws,
                          (uint64_t)(uintptr_t)last_out, (uint64_t)(uintptr_t)m->rope_dev[0],
                          (uint64_t)(uintptr_t)m->rope_dev[1], (uint64_t)(uintptr_t)f->w->embed,
                          (uint64_t)(a->experts != NULL), (uint64_t)(a->index_picks != NULL), (uint64_t)m->ws_bytes,
                          /* the adapters' buffer: attaching or replacing them changes the launches */
                          (uint64_t)(uintptr_t)(m->lora ? m->lora->dparams : NULL), (uint64_t)(m->lora ? m->lora->r : 0),
                          /* the QAT option adds the fake_quant launches and changes the compressor's */
                          (uint64_t)m->kv_qat};
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        for (int b = 0; b < 8; b++) h = (h ^ ((v[i] >> (8 * b)) & 0xff)) * 1099511628211ull;
    return h | 1; /* never 0: 0 means "not recorded" */
}

ds4_status ds4_model_step(ds4_model *m, const ds4_step_args *a, ds4_error *err) {
    return ds4_step_run(m, a, NULL, err);
}

ds4_status ds4_step_run(ds4_model *m, const ds4_step_args *a, float *last_dev, ds4_error *err) {
    int64_t N = 0, Smax = 0;
    if (m && m->cp_on)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "step: context parallel is on: decoding (and generation) with "
                                                  "context parallelism is not supported (turn it off first)");
    if (m && m->ep_shard)
        return ds4_fail(err, DS4_ERR_UNSUPPORTED, "step: the routed experts are sharded over %d ranks: decoding (and "
                                                  "generation) computes every expert locally and needs them all (load "
                                                  "a whole copy of the model to generate)", m->ep_shard_world);
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
    const int hv = m->dev->host_visible;
    const int64_t nseq = a->nseq, n = c->hc_mult, D = c->hidden_size, V = c->vocab_size;
    const int64_t ncsa = ds4_model_csa_layers(m), L = c->num_hidden_layers, K = c->num_experts_per_tok;
    /* host row tables: position and sequence of every row, the sequences (with their caches' descriptors) */
    int64_t *pos = malloc((size_t)N * sizeof *pos);
    int32_t *rowseq = malloc((size_t)N * sizeof *rowseq);
    int32_t *lastrow = malloc((size_t)nseq * sizeof *lastrow);
    ds4_seq_desc *seqs = malloc((size_t)nseq * sizeof *seqs);
    if (!pos || !rowseq || !lastrow || !seqs) {
        st = ds4_fail(err, DS4_ERR_OOM, "step: row tables for %lld tokens of %lld sequences", (long long)N, (long long)nseq);
        goto done;
    }
    for (int64_t s = 0, r = 0; s < nseq; s++) {
        const ds4_cache *cache = a->caches[s];
        seqs[s] = (ds4_seq_desc){.p0 = cache->len, .n = a->counts[s], .r0 = r, .ring = cache->ring, .layers = cache->dlayers};
        for (int64_t i = 0; i < a->counts[s]; i++, r++) {
            pos[r] = seqs[s].p0 + i;
            rowseq[r] = (int32_t)s;
        }
        lastrow[s] = (int32_t)(r - 1);
    }
    /* compressor jobs: the windows each sequence completes, numbered across sequences, per rate class */
    int64_t njobs[2] = {0, 0};
    const int64_t rate[2] = {c->compress_rate_csa, c->compress_rate_hca};
    for (int k = 0; k < 2; k++)
        for (int64_t s = 0; s < nseq; s++) {
            seqs[s].w0[k] = njobs[k];
            njobs[k] += (seqs[s].p0 + seqs[s].n) / rate[k] - seqs[s].p0 / rate[k];
        }
    const int want_logits = a->logits || a->last_logits || last_dev;
    const ds4_pass_opts po = {
        .logits_ws = !hv && (a->logits || a->last_logits),
        .rec_experts = a->experts && !hv,
        .rec_index = a->index_picks && ncsa && !hv,
        .nseq = hv ? 0 : nseq,
    };
    ds4_pass f;
    st = ds4_pass_setup(m, &f, 0, Smax, N, &po, 0, err);
    if (st) goto done;
    int64_t cap = 0, decode = 1;
    for (int64_t s = 0; s < nseq; s++) {
        cap = a->caches[s]->cap > cap ? a->caches[s]->cap : cap;
        decode &= a->counts[s] == 1;
    }
    /* every input the pass reads goes to the backend first (a recorded pass replays over the same buffers) */
    f.rows = (ds4_rows){.T = N, .S = Smax, .nseq = nseq, .cap = cap};
    f.rows.pos = ds4_pass_input(&f, f.pos, pos, (size_t)N * sizeof *pos);
    f.rows.rowseq = ds4_pass_input(&f, f.rowseq, rowseq, (size_t)N * sizeof *rowseq);
    f.rows.seqs = ds4_pass_input(&f, f.seqs, seqs, (size_t)nseq * sizeof *seqs);
    f.rows.njobs = ds4_pass_input(&f, f.njobs_dev, njobs, sizeof njobs);
    const int32_t *rows_last = ds4_pass_input(&f, f.rowmap, lastrow, (size_t)nseq * sizeof(int32_t));
    f.njobs[0] = njobs[0];
    f.njobs[1] = njobs[1];
    f.rec_experts = a->experts && hv ? a->experts : f.rec_experts;
    f.rec_index = ncsa && a->index_picks && hv ? a->index_picks : f.rec_index;
    const int64_t *ids = ds4_pass_input(&f, f.ids, a->ids, (size_t)N * sizeof(int64_t));
    float *logits = a->logits ? (hv ? a->logits : f.logits_ws) : NULL;
    float *last_out = last_dev ? last_dev : (hv ? a->last_logits : f.logits_ws);
    /* A decoding step (one new token per sequence) of a given shape is the same sequence of launches every time: a
     * backend may record it once and replay it (CUDA graphs); the key names everything the launches depend on. */
    const uint64_t key = decode && !a->logits && want_logits ? step_key(m, &f, nseq, cap, last_out, a) : 0;
    if (!(key && f.dev->ops->graph_begin && f.dev->ops->graph_begin(f.dev, key))) {
        OP(f.dev, embed, .X = f.X, .E = f.w->embed, .edt = f.w->mdt, .ids = ids, .T = N, .n = n, .D = D); /* X⁰ */
        f.csa_i = 0;
        for (int64_t li = 0; li < L; li++) {
            f.li = li;
            f.rows.li = li;
            ds4_block(&f, &f.w->layers[li], f.X, ids);
            f.csa_i += c->layer_types[li] == DS4_ATTN_CSA;
        }
        if (logits) {
            ds4_lm_head(&f, f.X, f.w->hc_head_fn, f.w->hc_head_base, f.w->hc_head_scale, f.w->norm, logits, NULL, NULL);
            if (last_dev)
                OP(f.dev, gather_rows, .dst = last_dev, .src = logits, .idx = rows_last, .div = 1, .rows = nseq, .width = V);
        } else if (want_logits) {
            /* only the last row of each sequence goes through the head: gather them into the front of Xt */
            OP(f.dev, gather_rows, .dst = f.Xt, .src = f.X, .idx = rows_last, .div = 1, .rows = nseq, .width = n * D);
            f.T = nseq;
            ds4_lm_head(&f, f.Xt, f.w->hc_head_fn, f.w->hc_head_base, f.w->hc_head_scale, f.w->norm, last_out, NULL, NULL);
        }
        if (key && f.dev->ops->graph_end) f.dev->ops->graph_end(f.dev, key);
    }
    if (logits && logits != a->logits) ds4_dev_download(f.dev, a->logits, logits, (size_t)(N * V) * sizeof(float));
    if (logits && a->last_logits && !f.dev->st)
        for (int64_t s = 0; s < nseq; s++)
            memcpy(a->last_logits + s * V, a->logits + (int64_t)lastrow[s] * V, (size_t)V * sizeof(float));
    if (!logits && a->last_logits && last_out != a->last_logits)
        ds4_dev_download(f.dev, a->last_logits, last_out, (size_t)(nseq * V) * sizeof(float));
    if (a->experts && f.rec_experts != a->experts)
        ds4_dev_download(f.dev, a->experts, f.rec_experts, (size_t)(N * L * K) * sizeof(int32_t));
    if (ncsa && a->index_picks && f.rec_index != a->index_picks)
        ds4_dev_download(f.dev, a->index_picks, f.rec_index, (size_t)(N * ncsa * c->index_topk) * sizeof(int32_t));
    st = ds4_dev_check(f.dev, "step", err);
    /* the caches hold the new tokens once the pass ran (a failed pass leaves them in an unknown state: reset) */
    for (int64_t s = 0; s < nseq; s++) {
        if (st) ds4_cache_reset(a->caches[s]);
        else a->caches[s]->len += seqs[s].n;
    }
done:
    free(pos);
    free(rowseq);
    free(lastrow);
    free(seqs);
    return st;
}
