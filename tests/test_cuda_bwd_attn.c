/* test_cuda_bwd_attn.c — the CUDA backward of the attention sub-layer (attn_bwd_q / _kv / _entry, pick_inverse,
 * entry_rope, comp_bwd, ikl, ikl_bwd_q / _k) and the attention's indexer-KL target (itgt) against the CPU backend's,
 * through the argument structs and tapes the schedule uses (core/ops.h, core/sched.h).
 *
 * Exit 77 (skipped) without a CUDA build or device. Inputs are random tapes of odd shapes: several sequences, S not a
 * multiple of the window or the rates, sliding windows smaller and larger than S, HCA and CSA, index_topk larger than
 * the causal entry count early in a sequence, and CSA picks that are valid (distinct, causal, -1 padded) but in
 * random order, some queries with fewer picks than they could have (as a replay may give). Each operation:
 *   - runs on the CPU and on the GPU from the same inputs, every output poisoned with NaN (bytes 0xff) on both sides
 *     and every in/out buffer (gape, the entries that entry_rope rotates) starting equal;
 *   - runs a second time on the GPU (in/out buffers restored) and must give the same bits: no reduction may depend on
 *     scheduling;
 *   - is compared with the CPU: integers (the inverse pick lists, has) exactly; elements the CPU leaves untouched
 *     must be left untouched (still poison); the rest by relative Frobenius error <= 1e-5 (fp32; rope 1e-6, its two
 *     products per element). Both sides sum in fp32 in different orders (warp butterflies on the GPU, 8 lanes on the
 *     CPU): the rounding differences grow like sqrt(K)·2^-24 for K terms (K <= a few hundred here: ~1e-6), while a
 *     wrong index, a missing term or a wrong scale is an O(1) relative error. NaN in an element the CPU wrote is +inf.
 *   - runs a third time on a second GPU backend made with DS4_CUDA_ATTN_REF=1 (the bf16 attention's, dq's and key
 *     gradients' reference kernels; every other operation is the same code there) and must give the first run's
 *     bytes: the pipelined kernels change when operands are loaded, never what is multiplied or in which order;
 *   - then the CPU's results are uploaded to the GPU, so that each next operation is compared on identical inputs.
 * Query windows (context parallelism split by query) in the attention and its three backward phases, through the same
 * comparisons. Refusals: shared memory that would not fit. The indexer-KL loss (double per query) is compared by relative Frobenius error <= 1e-5 as well: its scores are fp32
 * sums of the same kind. */
#define _POSIX_C_SOURCE 200809L /* setenv: the reference backend */
#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"
#include "sched.h"

/* `bytes` of zeros on both sides */
static twin tw_zero(size_t bytes) {
    twin t = tw_new(bytes);
    memset(t.h, 0, bytes);
    tw_push(&t);
    return t;
}

/* ------------------------------------------------------------------------------------------------ comparisons */

typedef enum { F32, F64, EXACT } kind;

static int is_poison(const void *p, size_t size) {
    for (size_t i = 0; i < size; i++)
        if (((const unsigned char *)p)[i] != 0xff) return 0;
    return 1;
}

/* got (the GPU's) against ref (the CPU's) of n elements of `size` bytes: elements the CPU left poisoned must still be
 * poisoned; the others by relative Frobenius error (NaN / inf where the CPU wrote a number: +inf) */
static double rel_err(const void *got, const void *ref, int64_t n, kind k, int64_t *untouched_bad) {
    const size_t size = k == F64 ? 8 : 4;
    double num = 0, den = 0;
    *untouched_bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const void *g = (const char *)got + i * size, *r = (const char *)ref + i * size;
        if (is_poison(r, size)) {
            *untouched_bad += !is_poison(g, size);
            continue;
        }
        const double gv = k == F64 ? *(const double *)g : *(const float *)g;
        const double rv = k == F64 ? *(const double *)r : *(const float *)r;
        if (!isfinite(gv) || !isfinite(rv)) return INFINITY;
        num += (gv - rv) * (gv - rv);
        den += rv * rv;
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* ------------------------------------------------------------------------------------------------ one case */

typedef struct tcase {
    ds4_attn_type type;
    int64_t B, S, win, m, topk, H, d, nI, cI;
    int64_t q0, qn;               /* a query window (qn 0: none): the queries are positions [q0, q0 + qn) */
} tcase;

typedef struct ctx {
    ds4_config c;
    ds4_attn_type type;
    int64_t B, S, T, H, d, m, nwin, stride, maxk, nI, cI, half;
    int64_t q0, qn, Tq;           /* the query window (qn 0: none) and the query rows, B·qn (or T); T = B·S keys */
    ds4_layer_w l[2];             /* [0] the CPU's (host pointers), [1] the GPU's */
    ds4_layer_tape lt[2];
    twin q, kv, cK, sink, dout, sel, nsel, iq, iw, iK, itgt, cs, o;          /* tape and inputs */
    twin P, DS, dsink, dq, dkv, dK, inv_off, inv_t, inv_i;                   /* attention backward */
    twin C, Z, ape, dpool, dC, dZ, gape;                                     /* pooling backward */
    ds4_compressor_w cw[2];
    int overlap;
    twin kl, has, dI, diq, diw, dsi, dKi;                                    /* indexer KL */
    int with_dI;
    int bf16;                     /* the bf16 mode's attention (bf16_in) on both sides */
} ctx;

#define SIDE(b) S(x->b)
static ds4_dev *gpu_ref; /* DS4_CUDA_ATTN_REF=1: the reference kernels (side 2: device buffers, this backend) */
static ds4_dev *dev_of(int side) { return side == 2 ? gpu_ref : (side ? gpu : cpu); }
/* The weights / tape / compressor struct a side reads: [0] the CPU's, [1] the device buffers' (both GPU backends).
 * Side 2 must not index l / lt / cw with 2: that read past the arrays (the next members' bytes, host pointers among
 * them), which the reference backend's kernels dereferenced (an illegal address in its first attn_bwd_q). */
static int dev_side(int side) { return side ? 1 : 0; }

static void s_attention(const ctx *x, int side) {
    OP(dev_of(side), attention, .c = &x->c, .type = x->type, .sink = SIDE(sink), .q = SIDE(q), .kv = SIDE(kv),
       .cK = SIDE(cK), .rows = {.T = x->Tq, .S = x->S, .q0 = x->q0, .qn = x->qn}, .nwin = x->nwin, .sel = SIDE(sel), .nsel = SIDE(nsel),
       .sel_stride = x->stride, .o = SIDE(o), .itgt = SIDE(itgt), .bf16_in = x->bf16);
}

static ds4_a_attn_bwd abwd(const ctx *x, int side) {
    return (ds4_a_attn_bwd){.c = &x->c, .l = &x->l[dev_side(side)], .lt = &x->lt[dev_side(side)], .B = x->B, .S = x->S,
                            .sel_stride = x->stride, .dout = SIDE(dout), .P = SIDE(P), .DS = SIDE(DS),
                            .maxk = x->maxk, .dsink_t = SIDE(dsink), .dq = SIDE(dq), .dkv = SIDE(dkv), .dK = SIDE(dK),
                            .inv_off = SIDE(inv_off), .inv_t = SIDE(inv_t), .inv_i = SIDE(inv_i),
                            .bf16_in = x->bf16, .q0 = x->q0, .qn = x->qn};
}
static void s_attn_q(const ctx *x, int side) {
    const ds4_a_attn_bwd a = abwd(x, side);
    ds4_op_attn_bwd_q(dev_of(side), &a);
}
static void s_attn_kv(const ctx *x, int side) {
    const ds4_a_attn_bwd a = abwd(x, side);
    ds4_op_attn_bwd_kv(dev_of(side), &a);
}
static void s_attn_entry(const ctx *x, int side) {
    const ds4_a_attn_bwd a = abwd(x, side);
    ds4_op_attn_bwd_entry(dev_of(side), &a);
}
static void s_pick_inverse(const ctx *x, int side) {
    OP(dev_of(side), pick_inverse, .sel = SIDE(sel), .nsel = SIDE(nsel), .sel_stride = x->stride, .T = x->Tq,
       .S = x->S, .B = x->B, .inv_off = SIDE(inv_off), .inv_t = SIDE(inv_t), .inv_i = SIDE(inv_i), .qn = x->qn);
}
static void s_entry_rope(const ctx *x, int side) {
    OP(dev_of(side), entry_rope, .x = SIDE(dK), .B = x->B, .S = x->S, .nwin = x->nwin, .dd = x->d, .m = x->m,
       .rt = {SIDE(cs), x->half}, .sign = -1);
}
static void s_comp_bwd(const ctx *x, int side) {
    OP(dev_of(side), comp_bwd, .c = &x->c, .w = &x->cw[dev_side(side)], .overlap = x->overlap, .C = SIDE(C),
       .Z = SIDE(Z), .dpool = SIDE(dpool), .dC = SIDE(dC), .dZ = SIDE(dZ), .gape = SIDE(gape), .B = x->B, .S = x->S,
       .nwin = x->nwin);
}
static void s_ikl(const ctx *x, int side) {
    OP(dev_of(side), ikl, .c = &x->c, .lt = &x->lt[dev_side(side)], .T = x->T, .S = x->S, .sel_stride = x->stride,
       .kl = SIDE(kl), .has = SIDE(has), .dI = x->with_dI ? SIDE(dI) : NULL, .scale = 0.37);
}
static void s_ikl_q(const ctx *x, int side) {
    OP(dev_of(side), ikl_bwd_q, .c = &x->c, .lt = &x->lt[dev_side(side)], .B = x->B, .S = x->S, .T = x->T,
       .sel_stride = x->stride, .dI = SIDE(dI), .diq = SIDE(diq), .diw = SIDE(diw), .dsi = SIDE(dsi));
}
static void s_ikl_k(const ctx *x, int side) {
    OP(dev_of(side), ikl_bwd_k, .c = &x->c, .lt = &x->lt[dev_side(side)], .B = x->B, .S = x->S, .T = x->T,
       .sel_stride = x->stride, .dsi = SIDE(dsi), .inv_off = SIDE(inv_off), .inv_t = SIDE(inv_t),
       .inv_i = SIDE(inv_i), .dK = SIDE(dKi));
}

typedef struct out {
    const char *name;
    twin *b;
    kind k;
    double tol;
    int inout;                    /* read and written: restored before the second GPU run */
} out;

/* Run one operation on both sides, twice on the GPU, and compare (header comment); then give the GPU the CPU's
 * results. */
static void check_op(const char *what, const ctx *x, void (*step)(const ctx *, int), out *o, int n) {
    enum { MAXO = 8 };
    if (twin_broken()) return; /* after a CUDA error nothing runs (cuda_twin.h) */
    void *orig[MAXO] = {0}, *first[MAXO] = {0};
    for (int i = 0; i < n; i++)
        if (o[i].inout) {
            orig[i] = malloc(o[i].b->bytes);
            memcpy(orig[i], o[i].b->h, o[i].b->bytes);
        }
    step(x, 0);
    step(x, 1);
    check_dev(gpu, what);
    for (int i = 0; i < n; i++) {
        first[i] = fetch(o[i].b);
        if (o[i].inout) {
            void *cpu_result = o[i].b->h;
            o[i].b->h = orig[i];
            tw_push(o[i].b);
            o[i].b->h = cpu_result;
        }
    }
    step(x, 1);
    check_dev(gpu, what);
    void *again[MAXO] = {0};
    for (int i = 0; i < n; i++) {
        again[i] = fetch(o[i].b);
        /* the reference run starts as the first did: in/out buffers restored, outputs poisoned */
        void *cpu_result = o[i].b->h;
        if (!o[i].inout) {
            o[i].b->h = malloc(o[i].b->bytes);
            memset(o[i].b->h, 0xff, o[i].b->bytes);
        } else {
            o[i].b->h = orig[i];
        }
        tw_push(o[i].b);
        if (!o[i].inout) free(o[i].b->h);
        o[i].b->h = cpu_result;
    }
    check_dev(gpu, what); /* the uploads are done before the other backend's stream reads them */
    step(x, 2);
    char ref_what[300];
    snprintf(ref_what, sizeof ref_what, "%s on the reference backend (DS4_CUDA_ATTN_REF=1)", what);
    check_dev(gpu_ref, ref_what);
    for (int i = 0; i < n; i++) {
        if (twin_broken()) { /* the error is the one failure: comparing poison would add one a buffer */
            free(again[i]), free(first[i]), free(orig[i]);
            continue;
        }
        void *ref = fetch(o[i].b);
        CHECK(memcmp(again[i], first[i], o[i].b->bytes) == 0, "%s: %s differs between two GPU runs", what, o[i].name);
        CHECK(memcmp(ref, first[i], o[i].b->bytes) == 0, "%s: %s differs from the reference kernels' "
              "(DS4_CUDA_ATTN_REF=1)", what, o[i].name);
        free(again[i]);
        free(ref);
        if (o[i].k == EXACT) {
            CHECK(memcmp(first[i], o[i].b->h, o[i].b->bytes) == 0, "%s: %s differs from the CPU's", what, o[i].name);
        } else {
            int64_t bad;
            const int64_t cnt = (int64_t)(o[i].b->bytes / (o[i].k == F64 ? 8 : 4));
            const double e = rel_err(first[i], o[i].b->h, cnt, o[i].k, &bad);
            CHECK(e <= o[i].tol && bad == 0, "%s: %s: rel. Frobenius %g (bound %g), %lld elements written that the CPU "
                  "leaves untouched", what, o[i].name, e, o[i].tol, (long long)bad);
        }
        tw_push(o[i].b);
        free(first[i]);
        free(orig[i]);
    }
}

/* Random valid picks: query t of a sequence picks k = min(topk, causal entries) distinct causal entries in random
 * order (every third query with picks: fewer, as a replay may give), -1 padded. */
static void make_picks(ctx *x, int64_t topk) {
    int32_t *sel = x->sel.h, *nsel = x->nsel.h, perm[4096];
    for (int64_t t = 0; t < x->Tq; t++) {
        const int64_t s = x->q0 + t % (x->qn ? x->qn : x->S), v = (s + 1) / x->m < x->nwin ? (s + 1) / x->m : x->nwin;
        int64_t k = topk < v ? topk : v;
        if (t % 3 == 1 && k > 1) k = k / 2;
        for (int64_t w = 0; w < v; w++) perm[w] = (int32_t)w;
        for (int64_t i = 0; i < k; i++) {
            const int64_t j = i + (int64_t)(urand() * (double)(v - i));
            const int32_t tmp = perm[i];
            perm[i] = perm[j], perm[j] = tmp;
        }
        for (int64_t i = 0; i < x->stride; i++) sel[t * x->stride + i] = i < k ? perm[i] : -1;
        nsel[t] = (int32_t)k;
    }
    tw_push(&x->sel);
    tw_push(&x->nsel);
}

static void tapes(ctx *x) {
    for (int side = 0; side < 2; side++) {
        x->l[side] = (ds4_layer_w){.type = x->type, .sink = SIDE(sink)};
        x->lt[side] = (ds4_layer_tape){.q = SIDE(q), .kv = SIDE(kv), .cK = SIDE(cK), .nwin = x->nwin, .sel = SIDE(sel),
                                       .nsel = SIDE(nsel), .iq = SIDE(iq), .iw = SIDE(iw), .iK = SIDE(iK),
                                       .itgt = SIDE(itgt)};
    }
}

/* The pooling backward of a compressor of entry width dd (overlapping windows for CSA). */
static void t_comp_bwd(ctx *x, int64_t dd, const char *what) {
    const int64_t width = (x->overlap ? 2 : 1) * dd;
    x->C = tw_f(x->T * width, -1, 1), x->Z = tw_f(x->T * width, -2, 2), x->ape = tw_f(x->m * width, -0.5f, 0.5f);
    x->dpool = tw_f(x->B * x->S * dd, -1, 1), x->gape = tw_f(x->m * width, -1, 1);
    x->dC = tw_out((size_t)(x->T * width) * 4), x->dZ = tw_out((size_t)(x->T * width) * 4);
    for (int side = 0; side < 2; side++)
        x->cw[side] = (ds4_compressor_w){.width = width, .dd = dd, .rate = x->m, .ape = SIDE(ape)};
    out o[] = {{"dC", &x->dC, F32, 1e-5, 0}, {"dZ", &x->dZ, F32, 1e-5, 0}, {"gape", &x->gape, F32, 1e-5, 1}};
    check_op(what, x, s_comp_bwd, o, 3);
    twin *all[] = {&x->C, &x->Z, &x->ape, &x->dpool, &x->gape, &x->dC, &x->dZ};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(all[i]);
}

/* The key gradients: the window keys' (dkv), then where there are entries the CSA inverse pick lists (exact) and the
 * entries' (dK), within tol; mode names the pass (", bf16" or ""). */
static void check_key_grads(ctx *x, ds4_attn_type type, const char *what, const char *mode, double tol) {
    char name[240];
    snprintf(name, sizeof name, "attn_bwd_kv%s (%s)", mode, what);
    out ok[] = {{"dkv", &x->dkv, F32, tol, 0}};
    check_op(name, x, s_attn_kv, ok, 1);
    if (x->nwin <= 0) return;
    if (type == DS4_ATTN_CSA) {
        snprintf(name, sizeof name, "pick_inverse%s (%s)", mode, what);
        out oi[] = {{"inv_off", &x->inv_off, EXACT, 0, 0}, {"inv_t", &x->inv_t, EXACT, 0, 0},
                    {"inv_i", &x->inv_i, EXACT, 0, 0}};
        check_op(name, x, s_pick_inverse, oi, 3);
    }
    snprintf(name, sizeof name, "attn_bwd_entry%s (%s)", mode, what);
    out oe[] = {{"dK", &x->dK, F32, tol, 0}};
    check_op(name, x, s_attn_entry, oe, 1);
}

static void t_case(const tcase *tc) {
    ctx X, *x = &X;
    memset(x, 0, sizeof *x);
    ds4_config_default(&x->c);
    x->c.num_attention_heads = tc->H, x->c.head_dim = tc->d, x->c.sliding_window = tc->win;
    x->c.compress_rate_csa = tc->type == DS4_ATTN_CSA ? tc->m : 4;
    x->c.compress_rate_hca = tc->type == DS4_ATTN_HCA ? tc->m : 128;
    x->c.index_n_heads = tc->nI, x->c.index_head_dim = tc->cI, x->c.index_topk = tc->topk;
    x->type = tc->type, x->B = tc->B, x->S = tc->S, x->T = tc->B * tc->S, x->H = tc->H, x->d = tc->d, x->m = tc->m;
    x->nwin = tc->type == DS4_ATTN_SLIDING ? 0 : tc->S / tc->m;
    x->stride = tc->topk < tc->S ? tc->topk : tc->S;
    x->maxk = (tc->win < tc->S ? tc->win : tc->S) + tc->S; /* as backward.c plans P / DS */
    x->nI = tc->nI, x->cI = tc->cI, x->half = 8;
    x->overlap = tc->type == DS4_ATTN_CSA;
    x->q0 = tc->q0, x->qn = tc->qn, x->Tq = tc->B * (tc->qn ? tc->qn : tc->S);
    /* T: the query rows (q, dout, picks, outputs, P / DS, dq); BS: the key side's (kv, entries, their gradients) */
    const int64_t T = x->Tq, H = x->H, d = x->d, BS = x->B * x->S, st = x->stride;
    char what[200], win[64] = "";
    if (tc->qn) snprintf(win, sizeof win, ", queries %lld..%lld", (long long)tc->q0, (long long)(tc->q0 + tc->qn - 1));
    snprintf(what, sizeof what, "%s B=%lld S=%lld window=%lld rate=%lld topk=%lld H=%lld d=%lld%s",
             ds4_attn_type_name(tc->type), (long long)tc->B, (long long)tc->S, (long long)tc->win, (long long)tc->m,
             (long long)tc->topk, (long long)H, (long long)d, win);
    char name[240];
#define NAME(op) (snprintf(name, sizeof name, "%s (%s)", op, what), name)

    x->q = tw_f(T * H * d, -1, 1), x->kv = tw_f(BS * d, -1, 1), x->cK = tw_f(BS * d, -1, 1);
    x->sink = tw_f(H, -1, 1), x->dout = tw_f(T * H * d, -1, 1), x->cs = tw_f(x->S * 2 * x->half, -1, 1);
    x->sel = tw_zero((size_t)(T * st) * 4), x->nsel = tw_zero((size_t)T * 4);
    x->iq = tw_f(T * x->nI * x->cI, -1, 1), x->iw = tw_f(T * x->nI, -1, 1), x->iK = tw_f(BS * x->cI, -1, 1);
    x->itgt = tw_out((size_t)(T * st) * 4), x->o = tw_out((size_t)(T * H * d) * 4);
    if (tc->type == DS4_ATTN_CSA) make_picks(x, tc->topk);
    tapes(x);

    if (tc->type == DS4_ATTN_CSA) { /* the forward's target for the indexer KL */
        out o[] = {{"o", &x->o, F32, 1e-5, 0}, {"itgt", &x->itgt, F32, 1e-5, 0}};
        check_op(NAME("attention with itgt"), x, s_attention, o, 2);
    }
    x->P = tw_out((size_t)(T * H * x->maxk) * 4), x->DS = tw_out((size_t)(T * H * x->maxk) * 4);
    x->dsink = tw_out((size_t)(T * H) * 4), x->dq = tw_out((size_t)(T * H * d) * 4);
    x->dkv = tw_out((size_t)(BS * d) * 4), x->dK = tw_out((size_t)(BS * d) * 4);
    x->inv_off = tw_out((size_t)(BS + 1) * 8), x->inv_t = tw_out((size_t)(T * st) * 4);
    x->inv_i = tw_out((size_t)(T * st) * 4);
    {
        out o[] = {{"P", &x->P, F32, 1e-5, 0}, {"DS", &x->DS, F32, 1e-5, 0}, {"dsink_t", &x->dsink, F32, 1e-5, 0},
                   {"dq", &x->dq, F32, 1e-5, 0}};
        check_op(NAME("attn_bwd_q"), x, s_attn_q, o, 4);
    }
    { /* the bf16 mode: the tensor-core kernels (one block per query, every head) against the CPU's emulation, which
       * rounds the same operands to bf16. P, DS, dsink and itgt come from bf16 products of exact fp32 products summed
       * in another order: 1e-5 as above. o and dq multiply P and DS rounded to bf16: where the two sides' fp32 P
       * differ in their last bits and straddle a bf16 rounding boundary, that term moves by up to 2^-8 of itself
       * (a rare event: P within ~1e-7 relative of a boundary); 2e-3 leaves room for a few such terms per row, while a
       * wrong key, head or scale is an O(1) error. */
        x->bf16 = 1;
        out oa[] = {{"o", &x->o, F32, 2e-3, 0}, {"itgt", &x->itgt, F32, 1e-5, 0}};
        check_op(NAME("attention, bf16"), x, s_attention, oa, tc->type == DS4_ATTN_CSA ? 2 : 1);
        out o[] = {{"P", &x->P, F32, 1e-5, 0}, {"DS", &x->DS, F32, 1e-5, 0}, {"dsink_t", &x->dsink, F32, 1e-5, 0},
                   {"dq", &x->dq, F32, 2e-3, 0}};
        check_op(NAME("attn_bwd_q, bf16"), x, s_attn_q, o, 4);
        /* the key gradients multiply DS, P, q and dout rounded to bf16 (on the tensor cores where d is a multiple
         * of 8 and H <= 32, else the fp32 kernels on the rounded values): 2e-3 for the same reason */
        check_key_grads(x, tc->type, what, ", bf16", 2e-3);
        x->bf16 = 0;
    }
    check_key_grads(x, tc->type, what, "", 1e-5);
    if (x->nwin > 0) {
        out orr[] = {{"entries", &x->dK, F32, 1e-6, 1}};
        check_op(NAME("entry_rope"), x, s_entry_rope, orr, 1);
        t_comp_bwd(x, d, NAME("comp_bwd"));
    }
    if (tc->type == DS4_ATTN_CSA && x->nwin > 0 && !x->qn) { /* the indexer KL takes no query window (cp.c) */
        /* a query with picks but no attention mass on them: no loss there */
        int32_t *ns = x->nsel.h;
        for (int64_t t = T - 1; t >= 0; t--)
            if (ns[t] > 0) {
                memset((float *)x->itgt.h + t * st, 0, (size_t)st * 4);
                break;
            }
        tw_push(&x->itgt);
        x->kl = tw_out((size_t)T * 8), x->has = tw_out((size_t)T * 4);
        x->dI = tw_out((size_t)(T * st) * 4);
        out o[] = {{"kl", &x->kl, F64, 1e-5, 0}, {"has", &x->has, EXACT, 0, 0}, {"dI", &x->dI, F32, 1e-5, 0}};
        check_op(NAME("ikl"), x, s_ikl, o, 2);
        x->with_dI = 1;
        check_op(NAME("ikl with dI"), x, s_ikl, o, 3);
        x->diq = tw_out((size_t)(T * x->nI * x->cI) * 4), x->diw = tw_out((size_t)(T * x->nI) * 4);
        x->dsi = tw_out((size_t)(T * x->nI * st) * 4), x->dKi = tw_out((size_t)(BS * x->cI) * 4);
        out oq[] = {{"diq", &x->diq, F32, 1e-5, 0}, {"diw", &x->diw, F32, 1e-5, 0}, {"dsi", &x->dsi, F32, 1e-5, 0}};
        check_op(NAME("ikl_bwd_q"), x, s_ikl_q, oq, 3);
        out ok[] = {{"dK", &x->dKi, F32, 1e-5, 0}};
        check_op(NAME("ikl_bwd_k"), x, s_ikl_k, ok, 1);
        t_comp_bwd(x, x->cI, NAME("comp_bwd (indexer)"));
    }
#undef NAME
    twin *all[] = {&x->q, &x->kv, &x->cK, &x->sink, &x->dout, &x->sel, &x->nsel, &x->iq, &x->iw, &x->iK, &x->itgt,
                  &x->cs, &x->o, &x->P, &x->DS, &x->dsink, &x->dq, &x->dkv, &x->dK, &x->inv_off, &x->inv_t,
                  &x->inv_i, &x->kl, &x->has, &x->dI, &x->diq, &x->diw, &x->dsi, &x->dKi};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->h) tw_free(all[i]);
}

/* An operation whose shared memory would not fit fails with a message, not a crash. */
static void t_too_large(void) {
    ds4_config c;
    ds4_config_default(&c);
    c.num_attention_heads = 1, c.head_dim = 32, c.sliding_window = 1 << 20, c.compress_rate_hca = 4;
    const int64_t S = 1 << 20;
    ds4_layer_w l = {.type = DS4_ATTN_HCA};
    ds4_layer_tape lt = {.nwin = S / 4};
    const ds4_a_attn_bwd a = {.c = &c, .l = &l, .lt = &lt, .B = 1, .S = S, .sel_stride = 1, .maxk = 2 * S};
    ds4_op_attn_bwd_q(gpu, &a);
    ds4_error err;
    CHECK_STATUS(ds4_dev_check(gpu, "attn_bwd_q", &err), DS4_ERR_UNSUPPORTED, &err);
    CHECK(strstr(err.msg, "attn_bwd_q") && strstr(err.msg, "shared memory"), "names it: %s", err.msg);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    ds4_engine *eng = NULL;
    const int rc = twins_open("test_cuda_bwd_attn", &eng);
    if (rc == 77) return 77;
    if (rc) return ds4t_finish("test_cuda_bwd_attn");
    ds4_error err = {0};
    setenv("DS4_CUDA_ATTN_REF", "1", 1); /* read when a backend is made */
    CHECK_OK(ds4_cuda_dev_create(0, &gpu_ref, &err), &err);
    unsetenv("DS4_CUDA_ATTN_REF");
    if (!gpu_ref) {
        twins_close(eng);
        return ds4t_finish("test_cuda_bwd_attn");
    }
    ds4_config big = {0}; /* CPU scratch (attention key lists) for every shape below */
    big.hc_mult = 4, big.hidden_size = 64, big.num_attention_heads = 40, big.head_dim = 136, big.sliding_window = 200;
    big.compress_rate_csa = 4, big.compress_rate_hca = 128, big.index_topk = 64;
    CHECK_OK(cpu->ops->reserve(cpu, &big, 1024, 512, 0, &err), &err);
    const tcase cases[] = {
        /* type, B, S, window, rate, topk, H, d, n_I, c_I, q0, qn */
        {DS4_ATTN_SLIDING, 2, 37, 5, 1, 1, 3, 32, 2, 16, 0, 0},
        {DS4_ATTN_SLIDING, 1, 19, 64, 1, 1, 2, 40, 2, 16, 0, 0},   /* window > S; d not a multiple of 32 */
        {DS4_ATTN_HCA, 3, 29, 5, 8, 1, 3, 32, 2, 16, 0, 0},         /* S not a multiple of the rate */
        {DS4_ATTN_HCA, 2, 13, 16, 4, 1, 2, 48, 2, 16, 0, 0},        /* window > S */
        {DS4_ATTN_CSA, 3, 31, 5, 4, 3, 3, 32, 2, 16, 0, 0},         /* fewer causal entries than topk early */
        {DS4_ATTN_CSA, 2, 45, 64, 4, 16, 2, 32, 3, 24, 0, 0},       /* topk > every query's entries; window > S */
        {DS4_ATTN_CSA, 1, 9, 3, 4, 5, 1, 16, 1, 16, 0, 0},          /* tiny: two entries */
        {DS4_ATTN_CSA, 2, 70, 7, 4, 9, 2, 64, 2, 40, 0, 0},         /* several chunks of picks; more than a warp of channels */
        {DS4_ATTN_HCA, 1, 77, 40, 4, 1, 20, 136, 2, 16, 0, 0},      /* bf16: two m-tiles of heads, two passes of channels */
        {DS4_ATTN_CSA, 2, 50, 33, 4, 7, 16, 128, 2, 16, 0, 0},      /* the 599M config's heads and head_dim */
        {DS4_ATTN_CSA, 2, 37, 8, 4, 5, 3, 36, 2, 16, 0, 0},         /* bf16 key gradients off the tensor cores: d % 8 */
        {DS4_ATTN_HCA, 1, 30, 9, 4, 1, 40, 16, 2, 16, 0, 0},        /* ... and H > 32 */
        /* the 599M config's heads and head_dim over more than 256 queries: query chunks of the bf16 key gradients
         * (entries: 64 queries a chunk, five of them; with the long window also the window keys: two chunks of 256),
         * groups of 4 queries a barrier with a partial last one, key lists over several 32-key chunks */
        {DS4_ATTN_CSA, 1, 301, 70, 4, 45, 16, 128, 2, 16, 0, 0},
        {DS4_ATTN_HCA, 2, 263, 200, 8, 1, 16, 128, 2, 16, 0, 0},
        /* d = 128 with 40 heads: the bf16-key kernels' dq and output in two passes of m-tiles (three m-tiles) */
        {DS4_ATTN_CSA, 2, 70, 9, 4, 20, 40, 128, 2, 16, 0, 0},
        /* query windows (context parallelism split by query): a rank's positions of each sequence attend over the
         * whole sequences' keys; the key gradients sum that rank's queries only. First, middle and last slices;
         * windows that start inside a compressor window and a sliding window; the bf16 tensor-core key gradients
         * with two query chunks whose ranges the window clips */
        {DS4_ATTN_SLIDING, 2, 37, 5, 1, 1, 3, 32, 2, 16, 12, 13},
        {DS4_ATTN_HCA, 3, 29, 5, 8, 1, 3, 32, 2, 16, 0, 10},
        {DS4_ATTN_CSA, 3, 31, 5, 4, 3, 3, 32, 2, 16, 21, 10},
        {DS4_ATTN_CSA, 2, 70, 7, 4, 9, 2, 64, 2, 40, 30, 25},
        {DS4_ATTN_CSA, 1, 301, 70, 4, 45, 16, 128, 2, 16, 41, 260},
        {DS4_ATTN_HCA, 2, 263, 200, 8, 1, 16, 128, 2, 16, 131, 132},
    };
    const size_t ncases = sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < ncases && !twin_broken(); i++) t_case(&cases[i]);
    if (twin_broken())
        fprintf(stderr, "test_cuda_bwd_attn: stopped at the first CUDA error, in %s; the rest of its case and "
                "the cases after it are skipped (every later CUDA call would fail with it)\n", twin_dead);
    else {
        t_too_large();
    }
    ds4_dev_release(gpu_ref);
    twins_close(eng);
    return ds4t_finish("test_cuda_bwd_attn");
}
#else
int main(void) {
    printf("test_cuda_bwd_attn: skipped (built without CUDA)\n");
    return 77;
}
#endif
