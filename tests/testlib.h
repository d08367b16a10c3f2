/* testlib.h — minimal assertion helpers for the C tests (each test is its own executable under ctest). */
#ifndef DS4_TESTLIB_H
#define DS4_TESTLIB_H

#include <stdio.h>
#include "ds4.h"

extern int ds4t_failures;
extern int ds4t_checks;

#define CHECK(cond, ...)                                                              \
    do {                                                                              \
        ds4t_checks++;                                                                \
        if (!(cond)) {                                                                \
            ds4t_failures++;                                                          \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                             \
            fprintf(stderr, "\n");                                                    \
        }                                                                             \
    } while (0)

/* Check that a ds4 call returned `want`; prints the error message otherwise. */
#define CHECK_STATUS(call, want, errp)                                                         \
    do {                                                                                       \
        ds4_status s_ = (call);                                                                \
        CHECK(s_ == (want), "%s returned %s (%s), wanted %s", #call, ds4_status_name(s_),     \
              s_ ? (errp)->msg : "", ds4_status_name(want));                                   \
    } while (0)
#define CHECK_OK(call, errp) CHECK_STATUS(call, DS4_OK, errp)

/* Print a summary line ("N passed, N failed") and return the process exit code. */
int ds4t_finish(const char *name);
/* Load fixture `name` (model and io.safetensors) and point args at its input_ids and labels (views into the
 * open file). Returns 0 on success; failures are counted as checks. */
int ds4t_load_fixture(ds4_engine *eng, const char *fixtures, const char *name, ds4_model **m, ds4_st_file **io,
                      ds4_forward_args *args);

/* main() of a test that runs `run` on the fixtures tiny_a, tiny_b and tiny_hf with a 2-thread engine:
 * usage check, engine, the three runs, summary line and exit code. */
int ds4t_main_fixtures(int argc, char **argv, const char *name,
                       void (*run)(ds4_engine *eng, const char *fixtures, const char *fixture));

/* max |a[i] - b[i]| over n floats (in double); NaN anywhere gives NaN, so `<= tol` checks fail on it. */
double ds4t_max_abs_diff(const float *a, const float *b, int64_t n);

/* Logits of every position of sequence ids[0..S) through the step API (one cache of capacity S), in chunks of the
 * given sizes (cycled): out [S, vocab]. Failures are counted as checks. */
void ds4t_step_logits(ds4_model *m, const int64_t *ids, int64_t S, const int64_t *chunks, int nchunks, float *out);

/* Each generated sequence of r (prompts as given to ds4_generate, at most 128 tokens with its prompt) scored by one
 * training forward of prompt + completion: how many of its tokens' rollout log-probabilities differ from the
 * forward's (bitwise); *scored counts the tokens compared. Turns gradients on. Failures are counted as checks. */
int64_t ds4t_rollout_mismatch(ds4_model *m, const ds4_gen_result *r, const int64_t *const *prompts, int64_t *scored);

/* rm -rf path (no error if absent), and whether a path exists (lstat). */
void ds4t_rm_rf(const char *path);
int ds4t_exists(const char *path);
/* Join a directory and a file name into a static buffer (one at a time). */
const char *ds4t_path(const char *dir, const char *file);

#endif
