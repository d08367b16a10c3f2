/* embed.c — a C program that embeds ds4 through the installed library and nothing else (tests/test_install.sh
 * builds it with pkg-config and with find_package(ds4), against libds4.so and libds4.a).
 *
 *   embed FIXTURE_DIR      (tests/fixtures/tiny_a: a checkpoint with io.safetensors, transformers' inputs and loss)
 *
 * Loads the checkpoint, runs the forward pass on transformers' inputs and compares the loss with the one
 * transformers computed; encodes a text with the built-in tokenizer. Prints one line and exits 0 when both agree. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ds4.h>

static int fail(const char *what, const ds4_error *err) {
    fprintf(stderr, "embed: %s: %s\n", what, err ? err->msg : "");
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: embed FIXTURE_DIR\n");
        return 2;
    }
    ds4_error err = {0};
    ds4_engine *eng = NULL;
    ds4_engine_options eo = {.n_threads = 2};
    if (ds4_engine_create(&eo, &eng, &err) != DS4_OK) return fail("engine", &err);
    ds4_model *m = NULL;
    if (ds4_model_load(eng, argv[1], &m, &err) != DS4_OK) return fail("load", &err);
    char path[4096];
    snprintf(path, sizeof path, "%s/io.safetensors", argv[1]);
    ds4_st_file *io = NULL;
    if (ds4_st_open(path, &io, &err) != DS4_OK) return fail("io.safetensors", &err);
    const ds4_st_entry *ids = ds4_st_find(io, "input_ids"), *labels = ds4_st_find(io, "labels"),
                       *loss = ds4_st_find(io, "loss");
    if (!ids || !labels || !loss || ids->dtype != DS4_I64 || labels->dtype != DS4_I64 || loss->dtype != DS4_F32)
        return fail("io.safetensors: input_ids, labels (I64) and loss (F32) expected", NULL);
    int64_t B = ids->shape[0], S = ids->shape[1];
    int64_t *x = malloc((size_t)(B * S) * sizeof *x), *y = malloc((size_t)(B * S) * sizeof *y);
    float ref;
    memcpy(x, ids->data, (size_t)(B * S) * sizeof *x); /* the mapping may be unaligned: copy */
    memcpy(y, labels->data, (size_t)(B * S) * sizeof *y);
    memcpy(&ref, loss->data, sizeof ref);
    ds4_forward_args a = {.ids = x, .batch = B, .seq = S, .labels = y};
    ds4_forward_result r;
    if (ds4_model_forward(m, &a, &r, &err) != DS4_OK) return fail("forward", &err);
    ds4_tokenizer *tok = NULL;
    if (ds4_tokenizer_byte_level(&tok, &err) != DS4_OK) return fail("tokenizer", &err);
    ds4_tokens t = {0};
    if (ds4_tokenizer_encode(tok, "hi", 2, 0, &t, &err) != DS4_OK) return fail("encode", &err);
    int ok = fabs(r.loss - ref) < 1e-4 && t.n == 2 && t.ids[0] == 'h' && t.ids[1] == 'i';
    printf("embed: ds4 %s, %lld parameters, loss %.6f (transformers %.6f), tokens %s: %s\n", DS4_VERSION_STRING,
           (long long)ds4_model_param_count(m), r.loss, (double)ref, t.n == 2 ? "104 105" : "?",
           ok ? "ok" : "MISMATCH");
    ds4_tokens_free(&t);
    ds4_tokenizer_free(tok);
    free(x);
    free(y);
    ds4_st_close(io);
    ds4_model_free(m);
    ds4_engine_free(eng);
    return ok ? 0 : 1;
}
