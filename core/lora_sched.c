/* lora_sched.c — the schedule's part of LoRA (docs/lora.md): an adapter's term added to its weight's product in the
 * forward (full passes, steps over caches and training alike, so every path computes the same bits), and its
 * backward, from existing operations only (matmul, scale, linear_bwd_x / _w and their grouped forms).
 *
 * With A [r, K] and B [r, O] (PEFT's lora_B transposed, model.h) the forward is
 *     u = s·(x Aᵀ)        [T, r]     matmul, scale
 *     y += u·B                       linear_bwd_x with acc (dx += dy·W is exactly "y += u·B")
 * and, for dy = ∂L/∂y, the backward recomputes u from the kept input x (r is small: cheaper than a tape slot) and
 *     dB += uᵀ dy                    linear_bwd_w
 *     v  = s·(dy Bᵀ)      [T, r]     matmul (B read as an [r, O] weight), scale
 *     dA += vᵀ x,  dx += v·A         linear_bwd_w, linear_bwd_x
 * s multiplies u (not the product) so the frozen weight's product and the adapter's share no rounding. */
#include "internal.h"
#include "sched.h"

static void scale(ds4_dev *d, float *x, int64_t n, float s) {
    if (s != 1.0f) OP(d, scale, .x = x, .n = n, .s = s);
}

/* u [T, r] = s·(x Aᵀ) */
static void down(ds4_dev *d, float *u, const float *x, int64_t ldx, const float *A, int64_t T, int64_t K, int64_t r,
                 float s) {
    OP(d, matmul, .y = u, .ldy = r, .x = x, .ldx = ldx, .W = A, .wdt = DS4_F32, .T = T, .K = K, .O = r);
    scale(d, u, T * r, s);
}

/* y [T, O] (row stride ldy) += u·B */
static void up(ds4_dev *d, float *y, int64_t ldy, const float *u, const float *B, int64_t T, int64_t O, int64_t r) {
    OP(d, linear_bwd_x, .dx = y, .lddx = ldy, .acc = 1, .dy = u, .ldy = r, .W = B, .wdt = DS4_F32, .T = T, .K = O,
       .O = r);
}

void ds4_lora_fwd(ds4_pass *f, const ds4_lora_layer *lo, const ds4_lora_ab *ab, float *y, int64_t ldy, const float *x,
                  int64_t ldx, int64_t T, int64_t K, int64_t O) {
    if (!lo || !ab || !ab->A || T <= 0) return;
    down(f->dev, f->lu, x, ldx, ab->A, T, K, lo->r, lo->s);
    up(f->dev, y, ldy, f->lu, ab->B, T, O, lo->r);
}

void ds4_lora_fwd_wo_a(ds4_pass *f, const ds4_lora_layer *lo, float *y, const float *o, int64_t T) {
    if (!lo || !lo->wo_a.A) return;
    const ds4_config *c = f->c;
    const int64_t G = c->o_groups, ol = c->o_lora_rank, gw = c->num_attention_heads * c->head_dim / G, r = lo->r;
    for (int64_t g = 0; g < G; g++) {
        const ds4_lora_ab ab = {lo->wo_a.A, lo->wo_a.B + g * r * ol};
        ds4_lora_fwd(f, lo, &ab, y + g * ol, G * ol, o + g * gw, G * gw, T, gw, ol);
    }
}

/* Row-grouped (routed experts): u = s·(x A_eᵀ) per group of off. */
static void down_grouped(ds4_dev *d, float *u, const float *x, const float *A, const int64_t *off, int64_t E,
                         int64_t rows, int64_t K, int64_t r, float s) {
    OP(d, matmul_grouped, .y = u, .x = x, .W = A, .wdt = DS4_F32, .wstride = r * K, .off = off, .E = E, .rows = rows,
       .K = K, .O = r);
    scale(d, u, rows * r, s);
}

static void up_grouped(ds4_dev *d, float *y, const float *u, const float *B, const int64_t *off, int64_t E,
                       int64_t rows, int64_t O, int64_t r) {
    OP(d, linear_bwd_x_grouped, .dx = y, .acc = 1, .dy = u, .W = B, .wdt = DS4_F32, .wstride = r * O, .off = off,
       .E = E, .rows = rows, .K = O, .O = r);
}

void ds4_lora_fwd_gate_up(ds4_pass *f, const ds4_lora_layer *lo, float *g1, float *g3, const float *x,
                          const int64_t *off, int64_t rows) {
    if (!lo || !lo->e13.A) return;
    const int64_t E = f->c->n_routed_experts, D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    down_grouped(f->dev, f->lu, x, lo->e13.A, off, E, rows, D, lo->r, lo->s);
    up_grouped(f->dev, g1, f->lu, lo->e13.B, off, E, rows, I, lo->r);
    up_grouped(f->dev, g3, f->lu, lo->e3B, off, E, rows, I, lo->r);
}

void ds4_lora_fwd_down(ds4_pass *f, const ds4_lora_layer *lo, float *y, const float *act, const int64_t *off,
                       int64_t rows) {
    if (!lo || !lo->e2.A) return;
    const int64_t E = f->c->n_routed_experts, D = f->c->hidden_size, I = f->c->moe_intermediate_size;
    down_grouped(f->dev, f->lu, act, lo->e2.A, off, E, rows, I, lo->r, lo->s);
    up_grouped(f->dev, y, f->lu, lo->e2.B, off, E, rows, D, lo->r);
}

/* ------------------------------------------------------------------------------------------------ backward */

void ds4_lora_bwd(const ds4_lora_bwd_ctx *b, const ds4_lora_layer *lo, const ds4_lora_ab *ab, const ds4_lora_ab *g,
                  float *dx, int64_t lddx, const float *dy, int64_t ldy, const float *x, int64_t ldx, int64_t T,
                  int64_t K, int64_t O) {
    if (!lo || !ab || !ab->A || T <= 0) return;
    ds4_dev *d = b->dev;
    const int64_t r = lo->r;
    if (g && g->B) {
        down(d, b->u, x, ldx, ab->A, T, K, r, lo->s);
        OP(d, linear_bwd_w, .dW = g->B, .dy = b->u, .ldy = r, .x = dy, .ldx = ldy, .T = T, .K = O, .O = r);
    }
    OP(d, matmul, .y = b->v, .ldy = r, .x = dy, .ldx = ldy, .W = ab->B, .wdt = DS4_F32, .T = T, .K = O, .O = r);
    scale(d, b->v, T * r, lo->s);
    if (g && g->A) OP(d, linear_bwd_w, .dW = g->A, .dy = b->v, .ldy = r, .x = x, .ldx = ldx, .T = T, .K = K, .O = r);
    if (dx) up(d, dx, lddx, b->v, ab->A, T, K, r);
}

void ds4_lora_bwd_wo_a(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                       const ds4_lora_layer *go, float *dout, const float *dy, const float *o, int64_t T) {
    if (!lo || !lo->wo_a.A) return;
    const int64_t G = c->o_groups, ol = c->o_lora_rank, gw = c->num_attention_heads * c->head_dim / G, r = lo->r;
    for (int64_t g = 0; g < G; g++) {
        const ds4_lora_ab ab = {lo->wo_a.A, lo->wo_a.B + g * r * ol};
        const ds4_lora_ab gg = {go ? go->wo_a.A : NULL, go && go->wo_a.B ? go->wo_a.B + g * r * ol : NULL};
        ds4_lora_bwd(b, lo, &ab, &gg, dout + g * gw, G * gw, dy + g * ol, G * ol, o + g * gw, G * gw, T, gw, ol);
    }
}

/* Grouped form of ds4_lora_bwd's dB and v: dB_e += u_eᵀ dy (u recomputed by the caller), v (+)= dy B_eᵀ. */
static void grouped_dB(ds4_dev *d, float *gB, const float *u, const float *dy, const int64_t *off, int64_t E,
                       int64_t rows, int64_t O, int64_t r) {
    if (gB)
        OP(d, linear_bwd_w_grouped, .dW = gB, .wstride = r * O, .dy = u, .x = dy, .off = off, .E = E, .rows = rows,
           .K = O, .O = r);
}

static void grouped_v(ds4_dev *d, float *v, const float *dy, const float *B, const int64_t *off, int64_t E,
                      int64_t rows, int64_t O, int64_t r) {
    OP(d, matmul_grouped, .y = v, .x = dy, .W = B, .wdt = DS4_F32, .wstride = r * O, .off = off, .E = E, .rows = rows,
       .K = O, .O = r);
}

/* dA_e += v_eᵀ x, dx += v·A_e, with v = s·v. */
static void grouped_dA_dx(ds4_dev *d, const ds4_lora_layer *lo, float *v, float *gA, const float *A, float *dx,
                          const float *x, const int64_t *off, int64_t E, int64_t rows, int64_t K) {
    const int64_t r = lo->r;
    scale(d, v, rows * r, lo->s);
    if (gA)
        OP(d, linear_bwd_w_grouped, .dW = gA, .wstride = r * K, .dy = v, .x = x, .off = off, .E = E, .rows = rows,
           .K = K, .O = r);
    OP(d, linear_bwd_x_grouped, .dx = dx, .acc = 1, .dy = v, .W = A, .wdt = DS4_F32, .wstride = r * K, .off = off,
       .E = E, .rows = rows, .K = K, .O = r);
}

void ds4_lora_bwd_down(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                       const ds4_lora_layer *go, float *dact, const float *dys, const float *act, const int64_t *off,
                       int64_t rows) {
    if (!lo || !lo->e2.A) return;
    const int64_t E = c->n_routed_experts, D = c->hidden_size, I = c->moe_intermediate_size, r = lo->r;
    if (go && go->e2.B) {
        down_grouped(b->dev, b->u, act, lo->e2.A, off, E, rows, I, r, lo->s);
        grouped_dB(b->dev, go->e2.B, b->u, dys, off, E, rows, D, r);
    }
    grouped_v(b->dev, b->v, dys, lo->e2.B, off, E, rows, D, r);
    grouped_dA_dx(b->dev, lo, b->v, go ? go->e2.A : NULL, lo->e2.A, dact, act, off, E, rows, I);
}

void ds4_lora_bwd_gate_up(const ds4_lora_bwd_ctx *b, const ds4_config *c, const ds4_lora_layer *lo,
                          const ds4_lora_layer *go, float *dxs, const float *dg1, const float *dg3, const float *xs,
                          const int64_t *off, int64_t rows) {
    if (!lo || !lo->e13.A) return;
    const int64_t E = c->n_routed_experts, D = c->hidden_size, I = c->moe_intermediate_size, r = lo->r;
    if (go && go->e13.B) {
        down_grouped(b->dev, b->u, xs, lo->e13.A, off, E, rows, D, r, lo->s);
        grouped_dB(b->dev, go->e13.B, b->u, dg1, off, E, rows, I, r);
        grouped_dB(b->dev, go->e3B, b->u, dg3, off, E, rows, I, r);
    }
    /* v = dg1·B1ᵀ + dg3·B3ᵀ: the shared A sees both halves */
    grouped_v(b->dev, b->v, dg1, lo->e13.B, off, E, rows, I, r);
    grouped_v(b->dev, b->u, dg3, lo->e3B, off, E, rows, I, r);
    OP(b->dev, add_bcast, .x = b->v, .h = b->u, .T = rows, .n = 1, .D = r);
    grouped_dA_dx(b->dev, lo, b->v, go ? go->e13.A : NULL, lo->e13.A, dxs, xs, off, E, rows, D);
}
