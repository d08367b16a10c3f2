/* test_grads_final.c — ds4_model_on_grads_final, the backward's report of the gradient regions that became final
 * (what the bucketed all-reduce overlapped with the backward launches on, docs/distributed.md "Bucketed
 * all-reduce"), on tiny_a, tiny_b and tiny_hf with the MTP loss on where the fixture has the MTP block:
 *
 * - the regions come in descending order and cover [0, n_params) exactly once: the head and MTP region, one per
 *   block from the last to the first, then the embedding (L + 2 regions);
 * - each region is final when reported: a copy taken inside the hook equals the buffer after the backward returned,
 *   bit for bit — for the first micro-batch after zero_grad and for an accumulated one (the set-aside values added
 *   back region by region), and the accumulated buffer equals an unhooked twin's (the same bits as before);
 * - the hook fires for one backward only, and a backward that fails still reports the whole buffer. */
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_train.h"
#include "testlib.h"

enum { MAX_REGIONS = 64 };

typedef struct {
    int64_t lo[MAX_REGIONS], hi[MAX_REGIONS];
    int n;
    float *snap; /* [n_params] each region copied when reported */
    const ds4_model *m;
} record;

static void on_final(void *ctx, ds4_model *m, float *g, int64_t lo, int64_t hi, void *stream) {
    record *r = ctx;
    CHECK(m == r->m, "the hook names its model");
    CHECK(stream == NULL, "a CPU model's regions come without a stream");
    if (r->n < MAX_REGIONS) r->lo[r->n] = lo, r->hi[r->n] = hi;
    r->n++;
    if (r->snap && g) memcpy(r->snap + lo, g + lo, (size_t)(hi - lo) * sizeof(float));
}

/* The regions of one backward tile [0, n) from the top down; returns 1 when they do. */
static int tiles(const record *r, int64_t n) {
    int64_t top = n;
    for (int k = 0; k < r->n && k < MAX_REGIONS; k++) {
        if (r->hi[k] != top || r->lo[k] >= r->hi[k]) return 0;
        top = r->lo[k];
    }
    return top == 0;
}

static void run(ds4_engine *eng, const char *fixtures, const char *fixture) {
    ds4_error err = {0};
    ds4_model *m = NULL, *twin = NULL;
    ds4_st_file *io = NULL, *io2 = NULL;
    ds4_forward_args a;
    if (ds4t_load_fixture(eng, fixtures, fixture, &m, &io, &a)) return;
    if (ds4t_load_fixture(eng, fixtures, fixture, &twin, &io2, &a)) {
        ds4_model_free(m);
        ds4_st_close(io);
        return;
    }
    const ds4_config *c = ds4_model_config(m);
    const int64_t n = ds4_model_param_count(m), L = c->num_hidden_layers;
    /* the MTP block's gradients too, where the fixture has it */
    const ds4_train_options to = {.mtp_lambda = ds4_model_has_mtp(m) ? 0.3 : 0};
    CHECK_OK(ds4_model_set_train_options(m, &to, &err), &err);
    CHECK_OK(ds4_model_set_train_options(twin, &to, &err), &err);
    CHECK_OK(ds4_model_enable_grad(m, &err), &err);
    CHECK_OK(ds4_model_enable_grad(twin, &err), &err);
    record rec = {.snap = malloc((size_t)n * sizeof(float)), .m = m};
    CHECK(rec.snap != NULL, "snapshot buffer");
    ds4_forward_result res;
    for (int micro = 0; micro < 2 && rec.snap; micro++) { /* micro 1 accumulates onto micro 0 */
        rec.n = 0;
        memset(rec.snap, 0xff, (size_t)n * sizeof(float)); /* NaN wherever no region was copied */
        CHECK_OK(ds4_model_forward_train(m, &a, &res, &err), &err);
        CHECK_OK(ds4_model_forward_train(twin, &a, &res, &err), &err);
        const double s = 1.0 / (double)res.loss_tokens;
        ds4_model_on_grads_final(m, on_final, &rec);
        CHECK_OK(ds4_model_backward(m, s, &err), &err);
        CHECK_OK(ds4_model_backward(twin, s, &err), &err);
        CHECK(rec.n == L + 2, "%s micro-batch %d: %d regions reported, want %lld (head and MTP, %lld blocks, embedding)",
              fixture, micro, rec.n, (long long)(L + 2), (long long)L);
        CHECK(tiles(&rec, n), "%s micro-batch %d: the regions tile [0, %lld) from the top down", fixture, micro,
              (long long)n);
        const float *g = ds4_model_grads(m), *gt = ds4_model_grads(twin);
        int64_t early = 0, changed = 0;
        for (int64_t i = 0; g && gt && i < n; i++) {
            early += memcmp(&rec.snap[i], &g[i], sizeof(float)) != 0;
            changed += memcmp(&g[i], &gt[i], sizeof(float)) != 0;
        }
        CHECK(g && gt && early == 0, "%s micro-batch %d: %lld gradients changed after their region was reported",
              fixture, micro, (long long)early);
        CHECK(g && gt && changed == 0, "%s micro-batch %d: %lld gradients differ from the unhooked twin's", fixture,
              micro, (long long)changed);
    }
    /* one backward only: the next one reports nothing */
    rec.n = 0;
    ds4_model_zero_grad(m);
    CHECK_OK(ds4_model_forward_train(m, &a, &res, &err), &err);
    CHECK_OK(ds4_model_backward(m, 1.0, &err), &err);
    CHECK(rec.n == 0, "%s: the hook fired for a backward it was not armed for (%d regions)", fixture, rec.n);
    /* a backward refused (its forward was consumed) still reports the whole buffer, once */
    ds4_model_on_grads_final(m, on_final, &rec);
    CHECK_STATUS(ds4_model_backward(m, 1.0, &err), DS4_ERR_ARG, &err);
    CHECK(rec.n == 1 && rec.lo[0] == 0 && rec.hi[0] == n, "%s: a failed backward reported %d regions, want [0, %lld)",
          fixture, rec.n, (long long)n);
    free(rec.snap);
    ds4_model_free(m);
    ds4_model_free(twin);
    ds4_st_close(io);
    ds4_st_close(io2);
}

int main(int argc, char **argv) { return ds4t_main_fixtures(argc, argv, "test_grads_final", run); }
