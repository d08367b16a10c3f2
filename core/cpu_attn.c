/* cpu_attn.c — CPU operations of the attention sub-layer: the KV compressor's pooling, the lightning indexer,
 * attention with sink over the window and the compressed entries, the step's cache commit, and the indexer-KL
 * loss. docs/architecture.md, "Attention", gives the equations; the addressing of rows, windows and caches is the
 * same in a full forward and a step, which is why decoding equals the full forward bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "shape_limits.h"

/* ------------------------------------------------------------------------------------------------ compressor */

/* Pool one entry from row pointers: nprev rows of the previous window (their first halves; overlap only), then the
 * m rows of window `win` (their second halves with overlap, whole rows otherwise); then RMSNorm and RoPE at
 * position win·m. gl and kv are 2m floats of scratch each. */
static void pool_entry(const ds4_a_compress *a, const float *const *Cr, const float *const *Zr, int64_t nprev,
                       int64_t win, float *out, float *pool_keep, float *gl, float *kv) {
    const ds4_compressor_w *w = a->w;
    const int64_t m = w->rate, dd = w->dd, width = w->width, off = a->overlap ? dd : 0;
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
    if (pool_keep) memcpy(pool_keep, out, (size_t)dd * sizeof(float));
    ds4_rmsnorm_rows(out, out, w->norm, 1, dd, a->c->rms_norm_eps);
    ds4_rope_apply(out, dd, a->rt.half, ds4_rope_at(&a->rt, win * m), 1);
    if (a->q.fmt || a->q.hadamard) ds4_fake_quant_row(out, dd, &a->q); /* the QAT option, the same in a step */
}

/* Scratch of one range for pool_entry: gates, values, then 4m row pointers. */
static float *pool_scratch(const ds4_cpu *cpu, int64_t task, int64_t m, const float ***Cr, const float ***Zr) {
    float *gl = ds4_cpu_scratch(cpu, task);
    *Cr = (const float **)(void *)(gl + 4 * m);
    *Zr = *Cr + 2 * m;
    return gl;
}

/* Full forward: every complete window of every row. */
static void comp_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_compress *a = p;
    const int64_t m = a->w->rate, dd = a->w->dd, width = a->w->width, S = a->rows.S;
    const float **Cr, **Zr;
    float *gl = pool_scratch(cpu, task, m, &Cr, &Zr);
    for (int64_t i = b; i < e; i++) {
        const int64_t row = i / a->nwin, win = i % a->nwin, nprev = a->overlap && win > 0 ? m : 0;
        const int64_t t0 = row * S + win * m - nprev; /* the first row pooled */
        for (int64_t j = 0; j < nprev + m; j++) {
            Cr[j] = a->C + (t0 + j) * width;
            Zr[j] = a->Z + (t0 + j) * width;
        }
        pool_entry(a, Cr, Zr, nprev, win, a->out + (row * S + win) * dd, a->pool ? a->pool + (row * S + win) * dd : NULL,
                   gl, gl + 2 * m);
    }
}

/* Step: the windows that complete among the new tokens, numbered across sequences (sequence s owns jobs
 * [w0, w0 + its count)); rows come from the chunk or the cache, entries go into the cache. */
static void comp_step_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_compress *a = p;
    const int64_t m = a->w->rate;
    const float **Cr, **Zr;
    float *gl = pool_scratch(cpu, task, m, &Cr, &Zr);
    int64_t s = 0;
    for (int64_t i = b; i < e; i++) {
        while (s + 1 < a->rows.nseq && a->rows.seqs[s + 1].w0[a->cls] <= i) s++;
        const ds4_seq_desc *sq = &a->rows.seqs[s];
        const ds4_layer_cache *lc = &sq->layers[a->rows.li];
        const ds4_comp_cache *cc = a->which ? &lc->idx : &lc->comp;
        const int64_t win = sq->p0 / m + (i - sq->w0[a->cls]), nprev = a->overlap && win > 0 ? m : 0;
        const float *C = a->C + sq->r0 * cc->width, *Z = a->Z + sq->r0 * cc->width;
        for (int64_t j = 0; j < nprev + m; j++) {
            const int64_t q = win * m - nprev + j;
            Cr[j] = ds4_comp_row(cc, cc->C, C, sq->p0, q);
            Zr[j] = ds4_comp_row(cc, cc->Z, Z, sq->p0, q);
        }
        pool_entry(a, Cr, Zr, nprev, win, cc->ent + win * cc->dd, NULL, gl, gl + 2 * m);
    }
}

void ds4_cpu_compress(ds4_dev *d, const ds4_a_compress *a) {
    if (a->rows.pos) ds4_cpu_parallel(ds4_cpu_of(d), a->njobs, comp_step_range, a);
    else ds4_cpu_parallel(ds4_cpu_of(d), a->B * a->nwin, comp_range, a);
}

/* The entries query row t may read from (base; entry w at base + w·dd) and how many are causal: w < (p+1)/m. */
static const float *row_entries(const ds4_rows *r, const float *full, int which, int64_t m, int64_t nwin, int64_t dd,
                                int64_t t, int64_t *valid) {
    const int64_t v = (ds4_rows_pos(r, t) + 1) / m;
    if (r->pos) {
        const ds4_layer_cache *lc = &r->seqs[r->rowseq[t]].layers[r->li];
        *valid = v; /* a step pooled every window that completed up to this row */
        return which ? lc->idx.ent : lc->comp.ent;
    }
    *valid = v < nwin ? v : nwin;
    return full + ds4_rows_seq(r, t) * r->S * dd;
}

/* Window key j (<= the row's position) of query row t: from the ring for tokens before the step, else this pass. */
static const float *window_key(const ds4_rows *r, const float *kv, int64_t d, int64_t t, int64_t j) {
    if (!r->pos) return kv + (ds4_rows_seq(r, t) * r->S + j) * d;
    const ds4_seq_desc *sq = &r->seqs[r->rowseq[t]];
    if (j >= sq->p0) return kv + (sq->r0 + j - sq->p0) * d;
    return sq->layers[r->li].ring + (j % sq->ring) * d;
}

/* ------------------------------------------------------------------------------------------------ indexer */

/* Lightning-indexer scores and top-k over the causal entries w < floor((s+1)/m). */
static void indexer_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const ds4_a_indexer *a = p;
    const ds4_config *c = a->c;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim, m = c->compress_rate_csa;
    const float qscale = 1.0f / sqrtf((float)cI);
    float *score = ds4_cpu_scratch(cpu, task);
    for (int64_t t = b; t < e; t++) {
        int64_t valid;
        const float *keys = row_entries(&a->rows, a->iK, 1, m, a->nwin, cI, t, &valid);
        int32_t *sel = a->sel + t * a->sel_stride;
        const int32_t *rp = a->replay ? a->replay + t * a->replay_ld : NULL;
        if (rp && rp[0] >= 0) { /* replayed picks (validated causal and distinct by the forward's argument check) */
            int64_t k = 0;
            for (int64_t i = 0; i < c->index_topk && k < a->sel_stride; i++)
                if (rp[i] >= 0) sel[k++] = rp[i];
            a->nsel[t] = (int32_t)k;
            continue;
        }
        for (int64_t w = 0; w < valid; w++) {
            const float *k = keys + w * cI;
            float acc = 0;
            for (int64_t hh = 0; hh < nI; hh++) {
                float dot = ds4_dot(a->iq + (t * nI + hh) * cI, k, cI);
                float r = dot > 0 ? dot * qscale : 0.0f;
                acc += r * a->iw[t * nI + hh];
            }
            score[w] = acc;
        }
        /* k = min(index_topk, entries); with fewer causal entries than k every causal one is kept */
        int64_t k = a->topk < valid ? a->topk : valid;
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
        a->nsel[t] = (int32_t)k;
    }
}

void ds4_cpu_indexer(ds4_dev *d, const ds4_a_indexer *a) {
    if (a->nwin == 0 && !a->rows.pos) memset(a->nsel, 0, (size_t)a->rows.T * sizeof(int32_t));
    else ds4_cpu_parallel(ds4_cpu_of(d), a->rows.T, indexer_range, a);
}

void ds4_cpu_record_picks(ds4_dev *d, const ds4_a_record_picks *a) {
    (void)d;
    for (int64_t t = 0; t < a->T; t++) {
        int32_t *dst = a->dst + t * a->ld;
        for (int64_t i = 0; i < a->K; i++) dst[i] = i < a->nsel[t] ? a->sel[t * a->sel_stride + i] : -1;
    }
}

/* ------------------------------------------------------------------------------------------------ attention */

/* bf16_in (ops.h; the emulation of the bf16 mode, used by its tests): per range, rounded copies of the operands
 * of the attention's products — q (or dout) [H, d], the keys [nk, d] and the probabilities (or DS) [H, nk] — so that
 * the fp32 kernels below multiply bf16 values. Sized for the longest key list. */
size_t ds4_cpu_attn_bf16_stride(const ds4_config *c, int64_t nkeys) {
    const int64_t H = c->num_attention_heads, d = c->head_dim;
    return (size_t)(2 * H * d + nkeys * d + H * nkeys + 16) & ~(size_t)15;
}

void ds4_cpu_round_bf16(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = ds4_bf16_to_f32(ds4_f32_to_bf16(src[i]));
}

/* Point keys[0..nk) at rounded copies in kb ([nk, d]). */
void ds4_cpu_round_keys(const float **keys, int64_t nk, int64_t d, float *kb) {
    for (int64_t k = 0; k < nk; k++) {
        ds4_cpu_round_bf16(kb + k * d, keys[k], d);
        keys[k] = kb + k * d;
    }
}

typedef struct {
    const ds4_a_attention *a;
    float *bf;        /* bf16_in: [ntask, bf_stride] rounded operands (else NULL) */
    size_t bf_stride;
} attn_job;

/* Joint softmax with sink over window keys ∪ permitted compressed entries; values = keys. All heads share the keys
 * (one KV head), so the logits of every head are one small product with the key rows and the outputs one weighted
 * sum over them (ds4_dots_ptr, ds4_wsum_ptr: the same dots and the same sequence of adds as head by head). */
static void attn_range(const ds4_cpu *cpu, const void *p, int64_t b, int64_t e, int64_t task) {
    const attn_job *job = p;
    const ds4_a_attention *a = job->a;
    const ds4_config *c = a->c;
    const int64_t H = c->num_attention_heads, d = c->head_dim, win = c->sliding_window;
    const float scale = 1.0f / sqrtf((float)d);
    float *lg = ds4_cpu_scratch(cpu, task); /* [H, nk] logits, then probabilities */
    const float **keys = (const float **)(void *)(lg + cpu->key_off);
    float *qb = job->bf ? job->bf + (size_t)task * job->bf_stride : NULL; /* [H, d] rounded q */
    float *kb = qb ? qb + 2 * H * d : NULL;                                /* [nk, d] rounded keys */
    for (int64_t t = b; t < e; t++) {
        const int64_t s = ds4_rows_pos(&a->rows, t);
        int64_t nk = 0;
        const int64_t j0 = s - win + 1 > 0 ? s - win + 1 : 0;
        for (int64_t j = j0; j <= s; j++) keys[nk++] = window_key(&a->rows, a->kv, d, t, j);
        if (a->type != DS4_ATTN_SLIDING) {
            const int64_t m = a->type == DS4_ATTN_HCA ? c->compress_rate_hca : c->compress_rate_csa;
            int64_t valid;
            const float *ent = row_entries(&a->rows, a->cK, 0, m, a->nwin, d, t, &valid);
            if (a->type == DS4_ATTN_HCA)
                for (int64_t w = 0; w < valid; w++) keys[nk++] = ent + w * d;
            else
                for (int64_t i = 0; i < a->nsel[t]; i++) keys[nk++] = ent + a->sel[t * a->sel_stride + i] * d;
        }
        const float *q = a->q + t * H * d;
        if (qb) {
            ds4_cpu_round_bf16(qb, q, H * d);
            ds4_cpu_round_keys(keys, nk, d, kb);
            q = qb;
        }
        ds4_dots_ptr(lg, nk, q, d, H, keys, nk, d);
        for (int64_t hh = 0; hh < H; hh++) {
            float *l = lg + hh * nk, mx = a->sink[hh];
            for (int64_t k = 0; k < nk; k++) {
                l[k] = l[k] * scale;
                if (l[k] > mx) mx = l[k];
            }
            double den = exp((double)(a->sink[hh] - mx));
            for (int64_t k = 0; k < nk; k++) den += (l[k] = (float)exp((double)(l[k] - mx)));
            for (int64_t k = 0; k < nk; k++) l[k] = (float)(l[k] / den);
        }
        float *tgt = a->type == DS4_ATTN_CSA && a->itgt ? a->itgt + t * a->sel_stride : NULL;
        if (tgt) { /* attention mass on each indexer pick, the indexer KL loss's (detached) target */
            memset(tgt, 0, (size_t)a->sel_stride * sizeof(float));
            for (int64_t hh = 0; hh < H; hh++)
                for (int64_t k = s - j0 + 1; k < nk; k++) tgt[k - (s - j0 + 1)] += lg[hh * nk + k];
        }
        if (qb) ds4_cpu_round_bf16(lg, lg, H * nk); /* the output's product takes bf16 probabilities */
        ds4_wsum_ptr(a->o + t * H * d, d, lg, nk, H, keys, nk, d, 0);
    }
}

void ds4_cpu_attention(ds4_dev *d, const ds4_a_attention *a) {
    const ds4_cpu *cpu = ds4_cpu_of(d);
    attn_job job = {a, NULL, 0};
    if (a->bf16_in) {
        const int64_t S = a->rows.pos ? a->rows.cap : a->rows.S;
        const int64_t nkeys = (a->c->sliding_window < S ? a->c->sliding_window : S) + S;
        job.bf_stride = ds4_cpu_attn_bf16_stride(a->c, nkeys);
        job.bf = malloc((size_t)cpu->ntask * job.bf_stride * sizeof(float));
        if (!job.bf) {
            ds4_dev_fail(d, DS4_ERR_OOM, "attention: bf16 operand copies of %lld ranges x %zu floats",
                         (long long)cpu->ntask, job.bf_stride);
            return;
        }
    }
    ds4_cpu_parallel(cpu, a->rows.T, attn_range, &job);
    free(job.bf);
}

/* ------------------------------------------------------------------------------------------------ cache commit */

/* After a layer of a step appended tokens [p0, p0 + n): keep the new window vectors (kv [n, d]) in the ring. */
static void ring_commit(float *ring, int64_t R, int64_t d, int64_t p0, int64_t n, const float *kv) {
    const int64_t p1 = p0 + n;
    for (int64_t q = (p1 - R > p0 ? p1 - R : p0); q < p1; q++)
        memcpy(ring + (q % R) * d, kv + (q - p0) * d, (size_t)d * sizeof(float));
}

/* ... and the compressor's pending / last-window rows (C, Z [n, width]). */
static void comp_commit(const ds4_comp_cache *cc, int64_t p0, int64_t n, const float *C, const float *Z) {
    const int64_t m = cc->m, w = cc->width, p1 = p0 + n;
    const size_t row = (size_t)w * sizeof(float);
    if (cc->overlap && p1 / m > p0 / m) {
        /* a window completed: it becomes the last complete window. Its tokens before p0 sit in the old pending
         * rows, which are read here before the pending rows are rewritten below. */
        const int64_t base = (p1 / m - 1) * m;
        for (int64_t j = 0; j < m; j++) {
            memcpy(cc->C + j * w, ds4_comp_row(cc, cc->C, C, p0, base + j), row);
            memcpy(cc->Z + j * w, ds4_comp_row(cc, cc->Z, Z, p0, base + j), row);
        }
    }
    for (int64_t q = (p1 / m * m > p0 ? p1 / m * m : p0); q < p1; q++) {
        memcpy(cc->C + (m + q % m) * w, C + (q - p0) * w, row);
        memcpy(cc->Z + (m + q % m) * w, Z + (q - p0) * w, row);
    }
}

/* The new tokens join the caches once every query of the layer has read the old state: the window vectors go into
 * the rings (overwriting slots earlier queries of the step still read), the raw projections into the
 * compressors' pending / last-window rows. */
void ds4_cpu_cache_commit(ds4_dev *d, const ds4_a_cache_commit *a) {
    (void)d;
    const int64_t hd = a->c->head_dim;
    for (int64_t s = 0; s < a->rows.nseq; s++) {
        const ds4_seq_desc *sq = &a->rows.seqs[s];
        const ds4_layer_cache *lc = &sq->layers[a->rows.li];
        ring_commit(lc->ring, sq->ring, hd, sq->p0, sq->n, a->kv + sq->r0 * hd);
        if (a->type == DS4_ATTN_SLIDING) continue;
        comp_commit(&lc->comp, sq->p0, sq->n, a->cC + sq->r0 * lc->comp.width, a->cZ + sq->r0 * lc->comp.width);
        if (a->type == DS4_ATTN_CSA)
            comp_commit(&lc->idx, sq->p0, sq->n, a->iC + sq->r0 * lc->idx.width, a->iZ + sq->r0 * lc->idx.width);
    }
}

/* ------------------------------------------------------------------------------------------------ indexer KL */

void ds4_cpu_ikl(ds4_dev *d, const ds4_a_ikl *a) {
    (void)d;
    const ds4_config *c = a->c;
    const ds4_layer_tape *lt = a->lt;
    const int64_t nI = c->index_n_heads, cI = c->index_head_dim, S = a->S, stride = a->sel_stride;
    const float qscale = 1.0f / sqrtf((float)cI);
    double sc[DS4_MAX_IKL_TOPK];
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t k = lt->nsel[t], row = t / S;
        if (a->dI) memset(a->dI + t * stride, 0, (size_t)stride * sizeof(float));
        double mass = 0;
        for (int64_t i = 0; i < k; i++) mass += lt->itgt[t * stride + i];
        a->has[t] = k > 0 && mass > 0;
        a->kl[t] = 0;
        if (!a->has[t]) continue;
        /* the indexer scores of the picks, as the forward computed them */
        double mx = -INFINITY, den = 0, kl = 0;
        for (int64_t i = 0; i < k; i++) { /* k <= DS4_MAX_IKL_TOPK: checked where indexer_kl is set */
            const float *key = lt->iK + (row * S + lt->sel[t * stride + i]) * cI;
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
            const double p = lt->itgt[t * stride + i] / mass, lq = sc[i] - mx - log(den);
            if (p > 0) kl += p * (log(p) - lq);
            if (a->dI) a->dI[t * stride + i] = (float)(a->scale * (exp(lq) - p));
        }
        a->kl[t] = kl;
    }
}
