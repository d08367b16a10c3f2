/* test_cuda_ops.c — every operation of the CUDA backend against the CPU backend's (the fp32 reference), on random
 * inputs with odd shapes, through the same argument structs the schedule uses (core/ops.h).
 *
 * Exit 77 (skipped) without a CUDA build or device. Each check builds its arguments twice — host pointers for the
 * CPU backend, device pointers for CUDA — from the same random inputs, poisons every output with NaN (bytes 0xff)
 * on both sides, runs both, and compares:
 *   - integer outputs (picks, routing, permutations, counts, sampled ids) exactly;
 *   - fp32 outputs by relative Frobenius error <= 1e-5: both sides compute in fp32 with different summation orders
 *     (lanes / butterflies on the GPU, 8 fixed lanes on the CPU); for a reduction over K terms of mixed sign the
 *     rounding differences grow like sqrt(K)·2^-24 (~2e-6 at K = 4096, the longest here), so 1e-5 holds with room
 *     and a wrong index or a missing term (O(1) relative) cannot pass. NaN or a poison left behind is +inf.
 *   - bf16 matmuls against the CPU on the same bf16-rounded inputs and weights: then only the accumulation order
 *     differs (the tensor cores add in fp32) and the same 1e-5 holds.
 * The sampler must draw the same ids as ds4_sample on the same logits and uniforms (its sums run in another order,
 * so a draw could differ only when u·total lies within ~1e-16 of a boundary: none of these cases). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

#ifdef DS4_HAVE_CUDA
#include "cuda_twin.h"

/* ------------------------------------------------------------------------------------------------ matmuls */

/* keep: x's bf16 copy asked for too (keep16), byte for byte the CPU's; in bf16 at 1024 rows and more the product runs
 * on wgmma (on Hopper), whose rounding pass writes it; elsewhere a pass of its own does. */
static void t_matmul_keep(int64_t T, int64_t K, int64_t O, int64_t G, ds4_dtype wdt, int keep) {
    twin x = tw_f(T * K * G, -1, 1), W = tw_f(O * K * G, -0.5f, 0.5f), y = tw_out((size_t)(T * O * G) * 4);
    twin k16 = tw_out((size_t)(T * K * G) * 2);
    twin Wd = W; /* device weights in wdt; the CPU gets the same values rounded */
    if (wdt == DS4_BF16) {
        uint16_t *h = malloc((size_t)(O * K * G) * 2);
        for (int64_t i = 0; i < O * K * G; i++) {
            h[i] = bf(((float *)W.h)[i]);
            ((float *)W.h)[i] = ds4_bf16_to_f32(h[i]);
        }
        if (!keep) /* else x as it is: the kept copy is the rounding under test */
            for (int64_t i = 0; i < T * K * G; i++) ((float *)x.h)[i] = ds4_bf16_to_f32(bf(((float *)x.h)[i]));
        tw_push(&x);
        Wd = tw_new((size_t)(O * K * G) * 2);
        memcpy(Wd.h, h, (size_t)(O * K * G) * 2);
        tw_push(&Wd);
        free(h);
    }
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, matmul, .y = S(y), .ldy = O * G, .x = S(x), .ldx = K * G,
           .W = side ? Wd.d : W.h, .wdt = side ? wdt : DS4_F32, .T = T, .K = K, .O = O, .groups = G, .gx = K, .gy = O,
           .gw = O * K, .bf16_in = !side && wdt == DS4_BF16 && keep, .keep16 = keep ? S(k16) : NULL);
    check_dev(gpu, "matmul");
    char what[128];
    snprintf(what, sizeof what, "matmul %s [%lld x %lld] x [%lld x %lld]^T x %lld groups%s", ds4_dtype_name(wdt),
             (long long)T, (long long)K, (long long)O, (long long)K, (long long)G, keep ? ", x kept in bf16" : "");
    cmp_f(what, &y, T * O * G, 1e-5);
    if (keep) {
        strcat(what, ": the copy");
        cmp_bytes(what, &k16);
    }
    if (Wd.d != W.d) tw_free(&Wd);
    tw_free(&x), tw_free(&W), tw_free(&y), tw_free(&k16);
}
static void t_matmul(int64_t T, int64_t K, int64_t O, int64_t G, ds4_dtype wdt) { t_matmul_keep(T, K, O, G, wdt, 0); }

/* routed-expert grouping: expert e gets counts[e] rows (some 0) */
static void t_matmul_grouped(ds4_dtype wdt) {
    const int64_t E = 6, K = 96, O = 40, counts[6] = {3, 0, 17, 1, 0, 40};
    int64_t off[7] = {0};
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
    const int64_t R = off[E];
    twin x = tw_f(R * K, -1, 1), W = tw_f(E * O * K, -0.5f, 0.5f), y = tw_out((size_t)(R * O) * 4), of = tw_i64(E + 1, off);
    twin Wd = W;
    if (wdt == DS4_BF16) {
        Wd = tw_new((size_t)(E * O * K) * 2);
        for (int64_t i = 0; i < E * O * K; i++) {
            ((uint16_t *)Wd.h)[i] = bf(((float *)W.h)[i]);
            ((float *)W.h)[i] = ds4_bf16_to_f32(((uint16_t *)Wd.h)[i]);
        }
        for (int64_t i = 0; i < R * K; i++) ((float *)x.h)[i] = ds4_bf16_to_f32(bf(((float *)x.h)[i]));
        tw_push(&x), tw_push(&Wd);
    }
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, matmul_grouped, .y = S(y), .x = S(x), .W = side ? Wd.d : W.h, .wdt = side ? wdt : DS4_F32,
           .wstride = O * K, .off = S(of), .E = E, .rows = R, .K = K, .O = O);
    check_dev(gpu, "matmul_grouped");
    cmp_f(wdt == DS4_BF16 ? "matmul_grouped bf16" : "matmul_grouped fp32", &y, R * O, 1e-5);
    if (Wd.d != W.d) tw_free(&Wd);
    tw_free(&x), tw_free(&W), tw_free(&y), tw_free(&of);
}

/* ------------------------------------------------------------------------------------------------ rows */

static void t_rows(void) {
    const int64_t R = 37, W = 300;
    twin x = tw_f(R * W, -2, 2), w = tw_f(W, 0.5f, 1.5f), y = tw_out((size_t)(R * W) * 4), y2 = tw_out((size_t)(R * W) * 4);
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, rmsnorm, .y = S(y), .x = S(x), .w = S(w), .rows = R, .width = W, .eps = 1e-6);
        OP(d, rmsnorm, .y = S(y2), .x = S(x), .w = NULL, .rows = R, .width = W, .eps = 1e-6);
    }
    check_dev(gpu, "rmsnorm");
    cmp_f("rmsnorm", &y, R * W, 1e-5);
    cmp_f("rmsnorm (unweighted)", &y2, R * W, 1e-5);
    /* rope: positions from a table (a step) and from t % S */
    const int64_t T = 11, H = 3, width = 40, half = 8, S = 5;
    twin cs = tw_f(64 * 2 * half, -1, 1), q = tw_f(T * H * width, -1, 1), q2 = tw_copy(&q), q3 = tw_copy(&q);
    int64_t pos[11];
    for (int i = 0; i < T; i++) pos[i] = (i * 7) % 64;
    twin tp = tw_i64(T, pos);
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        const ds4_rope_table rt = {S(cs), half};
        OP(d, rope, .x = side ? q.d : q.h, .heads = H, .width = width, .rt = rt, .rows = {.T = T, .S = 64, .pos = S(tp)},
           .sign = 1);
        OP(d, rope, .x = side ? q2.d : q2.h, .heads = H, .width = width, .rt = rt, .rows = {.T = T, .S = S}, .sign = -1);
        /* a query window: row t at position 40 + t % 4 (of sequence t / 4 of 60 positions) */
        OP(d, rope, .x = side ? q3.d : q3.h, .heads = H, .width = width, .rt = rt,
           .rows = {.T = T, .S = 60, .q0 = 40, .qn = 4}, .sign = 1);
    }
    check_dev(gpu, "rope");
    cmp_f("rope (positions)", &q, T * H * width, 1e-6);
    cmp_f("rope (t % S, inverse)", &q2, T * H * width, 1e-6);
    cmp_f("rope (query window)", &q3, T * H * width, 1e-6);
    /* gathers, scatters, broadcast add, scale, copy rows */
    int32_t idx[9] = {4, 0, 8, 2, 7, 1, 3, 6, 5};
    twin ix = tw_i32(9, idx), src = tw_f(9 * 3 * 16, -1, 1), g = tw_out(9 * 16 * 4), sc = tw_out(9 * 16 * 4);
    twin acc = tw_f(9 * 16, -1, 1), hb = tw_f(3 * 16, -1, 1), xb = tw_f(3 * 4 * 16, -1, 1), cr = tw_out(9 * 5 * 4);
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, gather_rows, .dst = S(g), .src = S(src), .idx = S(ix), .div = 3, .rows = 9, .width = 16);
        OP(d, scatter_rows, .dst = S(sc), .src = S(src), .idx = S(ix), .rows = 9, .width = 16);
        OP(d, add_rows, .dst = S(acc), .src = S(src), .idx = S(ix), .rows = 9, .width = 16);
        OP(d, add_bcast, .x = S(xb), .h = S(hb), .T = 3, .n = 4, .D = 16);
        OP(d, scale, .x = S(hb), .n = 48, .s = 0.37f);
        OP(d, copy_rows, .dst = S(cr), .ldd = 20, .src = S(src), .lds = 48, .rows = 9, .row_bytes = 20);
    }
    check_dev(gpu, "row copies");
    cmp_bytes("gather_rows", &g);
    cmp_bytes("scatter_rows", &sc);
    cmp_bytes("add_rows", &acc);
    /* the row ops at widths the four-at-a-time kernel takes with a loop (1028 = 4·257) and does not take (13), and
     * through sources off a 16-byte boundary (the scalar kernel) */
    static const int64_t widths[3] = {1028, 13, 16};
    for (int wi = 0; wi < 3; wi++) {
        const int64_t wd = widths[wi], so = wi == 2 ? 1 : 0;
        twin src2 = tw_f(9 * 3 * wd + so, -1, 1), g2 = tw_out((size_t)(9 * wd) * 4), sc2 = tw_out((size_t)(9 * wd) * 4);
        twin acc2 = tw_f(9 * wd, -1, 1);
        for (int side = 0; side < 2; side++) {
            ds4_dev *d = side ? gpu : cpu;
            float *sp = (float *)S(src2) + so;
            OP(d, gather_rows, .dst = S(g2), .src = sp, .idx = S(ix), .div = 3, .rows = 9, .width = wd);
            OP(d, scatter_rows, .dst = S(sc2), .src = sp, .idx = S(ix), .rows = 9, .width = wd);
            OP(d, add_rows, .dst = S(acc2), .src = sp, .idx = S(ix), .rows = 9, .width = wd);
        }
        char what[64];
        check_dev(gpu, "row copies (widths)");
        snprintf(what, sizeof what, "gather_rows (width %lld%s)", (long long)wd, so ? ", unaligned" : "");
        cmp_bytes(what, &g2);
        snprintf(what, sizeof what, "scatter_rows (width %lld%s)", (long long)wd, so ? ", unaligned" : "");
        cmp_bytes(what, &sc2);
        snprintf(what, sizeof what, "add_rows (width %lld%s)", (long long)wd, so ? ", unaligned" : "");
        cmp_bytes(what, &acc2);
        twin all[] = {src2, g2, sc2, acc2};
        for (int i = 0; i < 4; i++) tw_free(&all[i]);
    }
    cmp_bytes("add_bcast", &xb);
    cmp_bytes("scale", &hb);
    cmp_bytes("copy_rows", &cr);
    twin all[] = {x, w, y, y2, cs, q, q2, q3, tp, ix, src, g, sc, acc, hb, xb, cr};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ model pieces */

/* A small config with every feature; n streams, score function sf. */
static ds4_config small_config(int64_t n, ds4_score_func sf) {
    ds4_config c;
    ds4_config_default(&c);
    c.vocab_size = 300, c.hidden_size = 48, c.num_hidden_layers = 1, c.num_attention_heads = 3, c.head_dim = 32;
    c.q_lora_rank = 24, c.o_groups = 3, c.o_lora_rank = 8, c.sliding_window = 5, c.compress_rate_csa = 4;
    c.compress_rate_hca = 8, c.index_n_heads = 2, c.index_head_dim = 16, c.index_topk = 3, c.n_routed_experts = 7;
    c.num_experts_per_tok = 3, c.moe_intermediate_size = 20, c.hc_mult = n, c.scoring_func = sf;
    c.rope_main.dim = c.rope_compress.dim = 16;
    return c;
}

static void t_hc(int64_t n, int64_t T) {
    const ds4_config c = small_config(n, DS4_SCORE_SQRTSOFTPLUS);
    const int64_t D = c.hidden_size, nD = n * D, mix = (2 + n) * n;
    twin X = tw_f(T * nD, -2, 2), fn = tw_f(mix * nD, -0.1f, 0.1f), base = tw_f(mix, -1, 1), scl = tw_f(3, 0.5f, 1.5f);
    twin pre = tw_out((size_t)(T * n) * 4), post = tw_out((size_t)(T * n) * 4), comb = tw_out((size_t)(T * n * n) * 4);
    twin u = tw_out((size_t)(T * D) * 4), A = tw_f(T * D, -1, 1), Xo = tw_out((size_t)(T * nD) * 4);
    twin hu = tw_out((size_t)(T * D) * 4), mk = tw_out((size_t)(T * mix) * 4);
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        const ds4_hc_w w = {S(fn), S(base), S(scl)};
        OP(d, hc_pre, .c = &c, .w = &w, .X = S(X), .pre = S(pre), .post = S(post), .comb = S(comb), .u = S(u),
           .mix = S(mk), .T = T);
        OP(d, hc_post, .c = &c, .X = S(X), .a = S(A), .post = S(post), .comb = S(comb), .Xo = S(Xo), .T = T);
        OP(d, hyperhead, .c = &c, .X = S(X), .fn = S(fn), .base = S(base), .scale = S(scl), .u = S(hu), .T = T);
    }
    check_dev(gpu, "mHC");
    char what[64];
    snprintf(what, sizeof what, "hc_pre n=%lld T=%lld pre", (long long)n, (long long)T);
    cmp_f(what, &pre, T * n, 1e-5);
    cmp_f("hc_pre post", &post, T * n, 1e-5);
    cmp_f("hc_pre comb (Sinkhorn)", &comb, T * n * n, 1e-5);
    cmp_f("hc_pre u", &u, T * D, 1e-5);
    cmp_f("hc_pre mix (the kept logits: the same sums as pre's)", &mk, T * mix, 1e-5);
    cmp_f("hc_post", &Xo, T * nD, 1e-5);
    cmp_f("hyperhead", &hu, T * D, 1e-5);
    twin all[] = {X, fn, base, scl, pre, post, comb, u, A, Xo, hu, mk};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

static void t_embed(void) {
    const int64_t V = 50, D = 24, T = 9, n = 3;
    int64_t ids[9] = {3, 49, 0, 7, 7, 12, 33, 1, 48};
    twin E = tw_f(V * D, -1, 1), id = tw_i64(T, ids), X = tw_out((size_t)(T * n * D) * 4);
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, embed, .X = S(X), .E = S(E), .edt = DS4_F32, .ids = S(id), .T = T, .n = n, .D = D);
    check_dev(gpu, "embed");
    cmp_bytes("embed", &X);
    tw_free(&E), tw_free(&id), tw_free(&X);
}

static void t_moe(ds4_score_func sf, int hash, int replay) {
    const ds4_config c = small_config(4, sf);
    const int64_t T = 29, E = c.n_routed_experts, K = c.num_experts_per_tok, D = 16;
    twin s = tw_f(T * E, -3, 3), bias = tw_f(E, -0.1f, 0.1f), eidx = tw_out((size_t)(T * K) * 4);
    twin ew = tw_out((size_t)(T * K) * 4);
    int64_t ids[29];
    int32_t tab[300 * 3], rp[29 * 3];
    for (int i = 0; i < T; i++) ids[i] = (i * 37) % 300;
    for (int v = 0; v < 300; v++)
        for (int k = 0; k < K; k++) tab[v * K + k] = (int32_t)((v + k * 2) % E);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) rp[t * K + k] = t % 4 == 0 ? -1 : (int32_t)((t + k) % E);
    twin id = tw_i64(T, ids), tb = tw_i32(300 * K, tab), rpl = tw_i32(T * K, rp);
    for (int side = 0; side < 2; side++) {
        ds4_layer_w l = {.is_hash = hash, .gate_bias = S(bias), .tid2eid = S(tb)};
        OP(side ? gpu : cpu, route, .c = &c, .l = &l, .ids = S(id), .s = S(s), .eidx = S(eidx), .ew = S(ew),
           .replay = replay ? S(rpl) : NULL, .replay_ld = K, .T = T);
    }
    check_dev(gpu, "route");
    char what[80];
    snprintf(what, sizeof what, "route (score %d%s%s): experts", (int)sf, hash ? ", hash" : "", replay ? ", replay" : "");
    cmp_bytes(what, &eidx);
    cmp_f("route: scores", &s, T * E, 1e-6);
    cmp_f("route: weights", &ew, T * K, 1e-6);
    /* sort, weigh, combine, count */
    twin perm = tw_out((size_t)(T * K) * 4), off = tw_out((size_t)(E + 1) * 8), ye = tw_f(T * K * D, -1, 1);
    twin yk = tw_out((size_t)(T * K * D) * 4), A = tw_f(T * D, -1, 1), loads = tw_new((size_t)E * 8);
    memset(loads.h, 0, (size_t)E * 8);
    tw_push(&loads);
    twin ei = tw_copy(&eidx); /* the CPU's routing on both sides */
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, moe_sort, .eidx = S(ei), .n = T * K, .E = E, .perm = S(perm), .off = S(off));
        OP(d, moe_weigh, .yk = S(yk), .ye = S(ye), .perm = S(perm), .ew = S(ew), .rows = T * K, .D = D);
        OP(d, moe_combine, .a = S(A), .yk = S(yk), .eidx = S(ei), .T = T, .K = K, .D = D);
        OP(d, count_loads, .loads = S(loads), .eidx = S(ei), .n = T * K);
    }
    check_dev(gpu, "moe");
    cmp_bytes("moe_sort perm (stable)", &perm);
    cmp_bytes("moe_sort offsets", &off);
    cmp_f("moe_weigh", &yk, T * K * D, 1e-6);
    cmp_f("moe_combine", &A, T * D, 1e-6);
    cmp_bytes("count_loads", &loads);
    /* swiglu with clamps: values beyond the limit on purpose */
    twin g1 = tw_f(T * 20, -12, 12), g3 = tw_f(T * 20, -12, 12);
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, swiglu, .g1 = S(g1), .g3 = S(g3), .rows = T, .I = 20, .lim = 7.0f);
    check_dev(gpu, "swiglu");
    cmp_f("swiglu", &g1, T * 20, 1e-6);
    twin all[] = {s, bias, eidx, ew, id, tb, rpl, perm, off, ye, yk, A, loads, ei, g1, g3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* compressor, indexer and attention of one layer type, full forward, B sequences of S */
static void t_attention(ds4_attn_type type) {
    ds4_config c = small_config(4, DS4_SCORE_SQRTSOFTPLUS);
    const int64_t B = 3, S = 23, T = B * S, H = c.num_attention_heads, d = c.head_dim, half = 8;
    const int overlap = type == DS4_ATTN_CSA;
    const int64_t m = type == DS4_ATTN_HCA ? c.compress_rate_hca : c.compress_rate_csa, nwin = S / m;
    const int64_t width = (overlap ? 2 : 1) * d, cI = c.index_head_dim, nI = c.index_n_heads;
    const int64_t stride = c.index_topk < S ? c.index_topk : S;
    twin C = tw_f(T * width, -1, 1), Z = tw_f(T * width, -1, 1), ape = tw_f(m * width, -0.5f, 0.5f);
    twin nw = tw_f(d, 0.5f, 1.5f), cs = tw_f(S * 2 * half, -1, 1), cK = tw_out((size_t)(B * S * d) * 4);
    twin pool = tw_out((size_t)(B * S * d) * 4);
    twin q = tw_f(T * H * d, -1, 1), kv = tw_f(T * d, -1, 1), sink = tw_f(H, -1, 1), o = tw_out((size_t)(T * H * d) * 4);
    twin iq = tw_f(T * nI * cI, -1, 1), iw = tw_f(T * nI, -1, 1), iK = tw_f(B * S * cI, -1, 1);
    twin sel = tw_out((size_t)(T * stride) * 4), nsel = tw_out((size_t)T * 4);
    for (int side = 0; side < 2; side++) {
        ds4_dev *dv = side ? gpu : cpu;
        const ds4_compressor_w cw = {.width = width, .dd = d, .rate = m, .ape = S(ape), .norm = S(nw)};
        const ds4_rope_table rt = {S(cs), half};
        const ds4_rows rows = {.T = T, .S = S};
        if (type != DS4_ATTN_SLIDING)
            OP(dv, compress, .c = &c, .w = &cw, .overlap = overlap, .C = S(C), .Z = S(Z), .out = S(cK), .pool = S(pool),
               .rows = rows, .B = B, .nwin = nwin, .rt = rt);
        if (type == DS4_ATTN_CSA)
            OP(dv, indexer, .c = &c, .iq = S(iq), .iw = S(iw), .iK = S(iK), .rows = rows, .nwin = nwin,
               .topk = c.index_topk < nwin ? c.index_topk : nwin, .sel = S(sel), .nsel = S(nsel), .sel_stride = stride);
    }
    check_dev(gpu, "compress / indexer");
    if (type != DS4_ATTN_SLIDING) {
        /* only the complete windows' entries are written */
        float *gk = fetch(&cK), *gp = fetch(&pool);
        double e = 0, ep = 0;
        for (int64_t b = 0; b < B; b++) {
            e = fmax(e, rel_frob(gk + b * S * d, (float *)cK.h + b * S * d, nwin * d));
            ep = fmax(ep, rel_frob(gp + b * S * d, (float *)pool.h + b * S * d, nwin * d));
        }
        CHECK(e <= 1e-5 && ep <= 1e-5, "compress (%s): entries %g, pooled %g", ds4_attn_type_name(type), e, ep);
        free(gk), free(gp);
        tw_push(&cK); /* the attention reads the CPU's entries on both sides */
    }
    if (type == DS4_ATTN_CSA) {
        int32_t *gs = fetch(&sel), *gn = fetch(&nsel);
        int ok = 1;
        for (int64_t t = 0; t < T; t++) {
            ok &= gn[t] == ((int32_t *)nsel.h)[t];
            for (int32_t i = 0; ok && i < gn[t]; i++) ok &= gs[t * stride + i] == ((int32_t *)sel.h)[t * stride + i];
        }
        CHECK(ok, "indexer: picks differ from the CPU's");
        free(gs), free(gn);
        tw_push(&sel), tw_push(&nsel);
    }
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, attention, .c = &c, .type = type, .sink = S(sink), .q = S(q), .kv = S(kv), .cK = S(cK),
           .rows = {.T = T, .S = S}, .nwin = nwin, .sel = S(sel), .nsel = S(nsel), .sel_stride = stride, .o = S(o));
    check_dev(gpu, "attention");
    char what[96];
    snprintf(what, sizeof what, "attention (%s)", ds4_attn_type_name(type));
    cmp_f(what, &o, T * H * d, 1e-5);
    /* A query window (context parallelism split by query): positions q0 .. q0 + qn - 1 of each sequence (from inside
     * a compressor window and past the sliding window's start), their queries over the whole sequences' keys and
     * entries. A query row's picks and output depend on its position and the keys alone, so the GPU's are the rows
     * of the pass above bit for bit (batch invariance), and the CPU's as above: picks exactly, outputs 1e-5. */
    const int64_t q0 = 9, qn = 8, Tw = B * qn;
    twin wq = tw_new((size_t)(Tw * H * d) * 4), wiq = tw_new((size_t)(Tw * nI * cI) * 4);
    twin wiw = tw_new((size_t)(Tw * nI) * 4), wo = tw_out((size_t)(Tw * H * d) * 4);
    twin wsel = tw_out((size_t)(Tw * stride) * 4), wnsel = tw_out((size_t)Tw * 4);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < qn; i++) {
            const int64_t t = b * S + q0 + i, u = b * qn + i;
            memcpy((float *)wq.h + u * H * d, (float *)q.h + t * H * d, (size_t)(H * d) * 4);
            memcpy((float *)wiq.h + u * nI * cI, (float *)iq.h + t * nI * cI, (size_t)(nI * cI) * 4);
            memcpy((float *)wiw.h + u * nI, (float *)iw.h + t * nI, (size_t)nI * 4);
        }
    tw_push(&wq), tw_push(&wiq), tw_push(&wiw);
    const ds4_rows wrows = {.T = Tw, .S = S, .q0 = q0, .qn = qn};
    if (type == DS4_ATTN_CSA) {
        for (int side = 0; side < 2; side++)
            OP(side ? gpu : cpu, indexer, .c = &c, .iq = S(wiq), .iw = S(wiw), .iK = S(iK), .rows = wrows,
               .nwin = nwin, .topk = c.index_topk < nwin ? c.index_topk : nwin, .sel = S(wsel), .nsel = S(wnsel),
               .sel_stride = stride);
        check_dev(gpu, "indexer (query window)");
        int32_t *gs = fetch(&wsel), *gn = fetch(&wnsel);
        int ok = 1, full = 1;
        for (int64_t u = 0; u < Tw; u++) {
            const int64_t t = u / qn * S + q0 + u % qn;
            ok &= gn[u] == ((int32_t *)wnsel.h)[u];
            full &= gn[u] == ((int32_t *)nsel.h)[t];
            for (int32_t i = 0; ok && full && i < gn[u]; i++) {
                ok &= gs[u * stride + i] == ((int32_t *)wsel.h)[u * stride + i];
                full &= gs[u * stride + i] == ((int32_t *)sel.h)[t * stride + i];
            }
        }
        CHECK(ok && full, "indexer (query window %lld..%lld): picks differ from the CPU's (%d) or from the whole "
              "pass's rows (%d)", (long long)q0, (long long)(q0 + qn - 1), !ok, !full);
        free(gs), free(gn);
        tw_push(&wsel), tw_push(&wnsel);
    }
    float *go = fetch(&o); /* the GPU's whole pass */
    for (int side = 0; side < 2; side++)
        OP(side ? gpu : cpu, attention, .c = &c, .type = type, .sink = S(sink), .q = S(wq), .kv = S(kv), .cK = S(cK),
           .rows = wrows, .nwin = nwin, .sel = S(wsel), .nsel = S(wnsel), .sel_stride = stride, .o = S(wo));
    check_dev(gpu, "attention (query window)");
    snprintf(what, sizeof what, "attention (%s, query window %lld..%lld)", ds4_attn_type_name(type), (long long)q0,
             (long long)(q0 + qn - 1));
    cmp_f(what, &wo, Tw * H * d, 1e-5);
    float *gw = fetch(&wo);
    int64_t differ = 0;
    for (int64_t u = 0; u < Tw; u++)
        differ += memcmp(gw + u * H * d, go + (u / qn * S + q0 + u % qn) * H * d, (size_t)(H * d) * 4) != 0;
    CHECK(differ == 0, "%s: %lld rows differ from the whole pass's", what, (long long)differ);
    free(go), free(gw);
    twin all[] = {C, Z, ape, nw, cs, cK, pool, q, kv, sink, o, iq, iw, iK, sel, nsel, wq, wiq, wiw, wo, wsel, wnsel};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

/* ------------------------------------------------------------------------------------------------ vocabulary */

static void t_head(void) {
    const int64_t R = 9, V = 3001;
    twin lg = tw_f(R * V, -8, 8), nll = tw_out((size_t)R * 8), lp = tw_out((size_t)R * 4), ent = tw_out((size_t)R * 4);
    int64_t tgt[9] = {5, -100, 3000, 0, 17, 1234, -100, 7, 2999};
    twin tg = tw_i64(R, tgt);
    for (int side = 0; side < 2; side++) {
        ds4_dev *d = side ? gpu : cpu;
        OP(d, ce_rows, .logits = S(lg), .rows = R, .V = V, .tgt = S(tg), .nll = S(nll));
        OP(d, logprobs, .logits = S(lg), .rows = R, .V = V, .tgt = S(tg), .logp = S(lp), .entropy = S(ent));
    }
    check_dev(gpu, "ce / logprobs");
    double *gn = fetch(&nll);
    double e = 0;
    for (int r = 0; r < R; r++)
        if (tgt[r] != -100) e = fmax(e, fabs(gn[r] - ((double *)nll.h)[r]) / fabs(((double *)nll.h)[r]));
    CHECK(e <= 1e-9, "ce_rows: relative difference %g (double sums)", e);
    free(gn);
    cmp_f("logprobs", &lp, R, 1e-6);
    cmp_f("entropy", &ent, R, 1e-6);
    /* sampling: the same draws as ds4_sample, over filters and temperatures */
    enum { ND = 64 };
    const int64_t SV = 1000;
    twin sl = tw_f(ND * SV, -6, 6);
    int32_t rows[ND];
    double us[ND];
    for (int i = 0; i < ND; i++) rows[i] = i, us[i] = urand();
    twin rw = tw_i32(ND, rows), u = tw_new(ND * 8);
    memcpy(u.h, us, sizeof us);
    tw_push(&u);
    const ds4_sampling ps[6] = {{0}, {.temperature = 1.0}, {.temperature = 0.7, .top_k = 20},
                                {.temperature = 1.3, .top_p = 0.8}, {.temperature = 0.9, .min_p = 0.05},
                                {.temperature = 1.0, .top_k = 50, .top_p = 0.9, .min_p = 0.02}};
    void *scr = malloc(ds4_sample_scratch_bytes(SV));
    for (int k = 0; k < 6; k++) {
        twin id = tw_out(ND * 8), lpm = tw_out(ND * 8), lps = tw_out(ND * 8);
        OP(gpu, sample, .logits = sl.d, .lrow = rw.d, .rows = ND, .V = SV, .p = ps[k], .u = u.d, .id = id.d,
           .lp_model = lpm.d, .lp_sample = lps.d);
        check_dev(gpu, "sample");
        int64_t *gid = fetch(&id);
        double *gm = fetch(&lpm), *gs = fetch(&lps);
        int same = 0;
        double dm = 0, ds = 0;
        for (int i = 0; i < ND; i++) {
            ds4_error err;
            double m1, s1;
            const int64_t cid = ds4_sample((float *)sl.h + i * SV, SV, &ps[k], us[i], &m1, &s1, scr, &err);
            same += cid == gid[i];
            dm = fmax(dm, fabs(m1 - gm[i]));
            ds = fmax(ds, fabs(s1 - gs[i]));
        }
        CHECK(same == ND && dm <= 1e-9 && ds <= 1e-9, "sample case %d: %d of %d draws equal, |dlp| %g / %g", k, same, ND,
              dm, ds);
        free(gid), free(gm), free(gs);
        tw_free(&id), tw_free(&lpm), tw_free(&lps);
    }
    free(scr);
    /* an invalid row is an error of the operation that names it */
    ((float *)sl.h)[5 * SV + 17] = NAN;
    tw_push(&sl);
    twin id = tw_out(ND * 8), lpm = tw_out(ND * 8), lps = tw_out(ND * 8);
    OP(gpu, sample, .logits = sl.d, .lrow = rw.d, .rows = ND, .V = SV, .p = ps[1], .u = u.d, .id = id.d, .lp_model = lpm.d,
       .lp_sample = lps.d);
    ds4_error err;
    CHECK_STATUS(ds4_dev_check(gpu, "sample", &err), DS4_ERR_ARG, &err);
    CHECK(strstr(err.msg, "row 5") && strstr(err.msg, "logits[17]") && strstr(err.msg, "NaN"), "names it: %s", err.msg);
    tw_free(&id), tw_free(&lpm), tw_free(&lps);
    twin all[] = {lg, nll, lp, ent, tg, sl, rw, u};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tw_free(&all[i]);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    ds4_engine *eng = NULL;
    const int open = twins_open("test_cuda_ops", &eng);
    if (open == 77) return 77;
    if (open) return ds4t_finish("test_cuda_ops");
    ds4_error err = {0};
    ds4_config big = {0};
    big.hc_mult = 4, big.hidden_size = 4096, big.vocab_size = 32000, big.num_attention_heads = 16, big.head_dim = 128;
    big.sliding_window = 128, big.compress_rate_csa = 4, big.compress_rate_hca = 128, big.index_topk = 64;
    big.num_experts_per_tok = 8, big.n_routed_experts = 64, big.moe_intermediate_size = 512, big.q_lora_rank = 1024;
    big.o_groups = 8, big.o_lora_rank = 1024, big.index_n_heads = 8, big.index_head_dim = 128, big.hc_sinkhorn_iters = 20;
    CHECK_OK(cpu->ops->reserve(cpu, &big, 4096, 4096, 0, &err), &err); /* CPU scratch for every shape below */
    const int64_t Ms[] = {1, 5, 16, 17, 100};
    for (int i = 0; i < 5; i++) {
        t_matmul(Ms[i], 96, 40, 1, DS4_F32);
        t_matmul(Ms[i], 96, 40, 1, DS4_BF16);
        t_matmul(Ms[i], 4096, 300, 1, DS4_BF16);
    }
    t_matmul(9, 40, 24, 3, DS4_F32);  /* grouped output projection */
    t_matmul(9, 40, 24, 3, DS4_BF16);
    t_matmul(3, 37, 13, 1, DS4_BF16); /* K not a multiple of 8: the scalar load path */
    t_matmul_keep(17, 40, 24, 1, DS4_F32, 1);  /* the copy by a pass of its own */
    t_matmul_keep(9, 37, 24, 3, DS4_BF16, 1);
    t_matmul_keep(2048, 200, 2048, 1, DS4_BF16, 1); /* the wgmma product's rounding pass writes it */
    t_matmul_keep(1024, 200, 2048, 2, DS4_BF16, 1); /* ... by groups of x's columns (the grouped output projection) */
    t_matmul_grouped(DS4_F32);
    t_matmul_grouped(DS4_BF16);
    t_rows();
    for (int64_t k = 2; k <= 4; k++) t_hc(k, 13);
    t_hc(4, 300); /* many tokens: the mixing GEMM's narrow kernel, scaling X's rows by the norm factors */
    t_embed();
    t_moe(DS4_SCORE_SQRTSOFTPLUS, 0, 0);
    t_moe(DS4_SCORE_SIGMOID, 0, 0);
    t_moe(DS4_SCORE_SOFTMAX, 0, 0);
    t_moe(DS4_SCORE_SQRTSOFTPLUS, 1, 0);
    t_moe(DS4_SCORE_SQRTSOFTPLUS, 0, 1);
    t_attention(DS4_ATTN_SLIDING);
    t_attention(DS4_ATTN_CSA);
    t_attention(DS4_ATTN_HCA);
    t_head();
    twins_close(eng);
    return ds4t_finish("test_cuda_ops");
}
#else
int main(void) {
    printf("test_cuda_ops: skipped (built without CUDA)\n");
    return 77;
}
#endif
