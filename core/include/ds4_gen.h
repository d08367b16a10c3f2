/* ds4_gen.h — incremental decoding with a per-sequence cache, sampling, and batched generation. Included by
 * ds4.h.
 *
 * A ds4_cache is one sequence's state of every layer (docs/architecture.md, "Decoding cache"): the sliding-window
 * ring of the last `sliding_window` K(=V) vectors, and for CSA / HCA layers the compressed entries, the raw
 * projections of the incomplete window (pending) and, for CSA's overlapping windows, those of the last complete
 * window; for CSA the lightning indexer's entries and its own pending / overlap rows. Memory per sequence is the
 * window plus one entry per compression window up to the capacity given at creation, never a full KV history.
 *
 * Positions are absolute from 0 for every sequence (compression windows are aligned to position 0; no padding).
 * ds4_model_step appends any number of new tokens to each of several sequences at once; any chunking of a
 * sequence (prefill in pieces, one token at a time, chunks crossing window boundaries) gives the same results as
 * one full forward over the whole sequence, to the last bit on the same build (the same kernels run on the same
 * rows in the same order). The MTP block is not run. */
#ifndef DS4_GEN_H
#define DS4_GEN_H

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------ cache */

typedef struct ds4_cache ds4_cache;

/* A cache for one sequence of up to `max_len` positions of model m (the model must outlive it). */
ds4_status ds4_cache_create(const ds4_model *m, int64_t max_len, ds4_cache **out, ds4_error *err);
void ds4_cache_free(ds4_cache *c);
void ds4_cache_reset(ds4_cache *c);                /* back to length 0 */
int64_t ds4_cache_len(const ds4_cache *c);         /* tokens processed so far */
int64_t ds4_cache_capacity(const ds4_cache *c);    /* max_len */
size_t ds4_cache_bytes(const ds4_cache *c);        /* memory held */
/* Make dst the same state as src (same model; dst's capacity must hold src's length). */
ds4_status ds4_cache_copy(ds4_cache *dst, const ds4_cache *src, ds4_error *err);

/* Number of CSA layers (the rows of recorded indexer picks per token). */
int64_t ds4_model_csa_layers(const ds4_model *m);

/* ------------------------------------------------------------------------------------------------ step */

typedef struct ds4_step_args {
    int64_t nseq;
    ds4_cache *const *caches; /* [nseq] distinct caches of this model */
    const int64_t *counts;    /* [nseq] new tokens per sequence, each >= 1 */
    const int64_t *ids;       /* [N] the new tokens, sequence after sequence (N = Σ counts) */
    float *logits;            /* out [N, V] logits of every new token, or NULL */
    float *last_logits;       /* out [nseq, V] logits of each sequence's last new token, or NULL */
    int32_t *experts;         /* out [N, L, K] routed experts of every main layer (hash or learned), or NULL */
    int32_t *index_picks;     /* out [N, n_csa, index_topk] the indexer's picks per CSA layer, -1 padded, or NULL */
} ds4_step_args;

/* Run the new tokens through the model, appending them to the caches. On error nothing is appended (the shapes,
 * ids and capacities are checked before any cache changes). One step or forward of a model at a time. */
ds4_status ds4_model_step(ds4_model *m, const ds4_step_args *a, ds4_error *err);

/* ------------------------------------------------------------------------------------------------ sampling */

typedef struct ds4_sampling {
    double temperature;       /* 0: greedy (argmax, ties to the lowest id) */
    int64_t top_k;            /* keep the k most probable tokens; 0: off */
    double top_p;             /* keep the smallest most-probable set with mass >= top_p; 0 or 1: off */
    double min_p;             /* keep tokens with p >= min_p · p_max; 0: off */
} ds4_sampling;

/* Scratch for ds4_sample over a vocabulary of V tokens: ds4_sample_scratch_bytes(V) bytes, 8-byte aligned. */
size_t ds4_sample_scratch_bytes(int64_t V);

/* A zero-initialised ds4_sampling is greedy with every filter off. Draw one token from logits [V]: temperature, then top-k, then top-p, then min-p (HF's warper order), then the
 * inverse CDF at u in [0, 1). *lp_model = log softmax(logits)[id] (temperature 1, unfiltered); *lp_sample = the
 * log-probability of id under the distribution actually sampled from (0 for greedy). Returns the id, or -1 when
 * the arguments are invalid (a NULL pointer, V < 1, a NaN or +inf logit, every logit -inf, a negative or infinite
 * temperature, top_k < 0, top_p outside [0, 1], min_p outside [0, 1], u outside [0, 1)); message in err. */
int64_t ds4_sample(const float *logits, int64_t V, const ds4_sampling *p, double u, double *lp_model,
                   double *lp_sample, void *scratch, ds4_error *err);

/* The uniform draw in [0, 1) used for (seed, stream, step): a counter-based generator, so a sequence's samples
 * depend only on the seed, its stream id and the step, never on batching. ds4_generate draws sequence
 * (prompt p, sample s)'s k-th token (k from 0) at stream = p << 32 | s, step = k. */
double ds4_sample_uniform(uint64_t seed, uint64_t stream, uint64_t step);

/* ------------------------------------------------------------------------------------------------ generation */

typedef enum ds4_finish {
    DS4_FINISH_NONE = 0,      /* still running (never in a returned result) */
    DS4_FINISH_LENGTH,        /* max_new_tokens reached, or the cache capacity */
    DS4_FINISH_EOS,           /* generated the config's eos_token_id */
    DS4_FINISH_STOP_TOKEN,    /* generated one of stop_ids (stop_index says which) */
    DS4_FINISH_STOP_STRING,   /* the decoded output now contains stop_strings[stop_index] */
    DS4_FINISH_CANCELLED      /* *cancel became nonzero or on_token returned nonzero */
} ds4_finish;

const char *ds4_finish_name(ds4_finish f); /* "length", "eos", "stop_token", "stop_string", "cancelled" */

/* Called for every generated token as soon as it is sampled (seq: index into the result's seqs). Return nonzero
 * to cancel the whole generation. */
typedef int (*ds4_token_fn)(void *ud, int64_t seq, int64_t id, double logprob);

typedef struct ds4_gen_args {
    int64_t nprompts;
    const int64_t *const *prompts;  /* [nprompts] token arrays */
    const int64_t *prompt_lens;     /* [nprompts], each >= 1 */
    int32_t n;                      /* samples per prompt (>= 1); they share the prompt's prefill */
    int64_t max_new_tokens;         /* >= 1 */
    ds4_sampling sampling;
    uint64_t seed;
    int64_t prompt_base;            /* prompt p draws from stream (prompt_base + p) << 32 | sample: a share of a larger
                                       batch passes its first prompt's index there, so its draws are the whole batch's
                                       (data parallelism: each rank generates some prompts of one batch) */
    const int64_t *stop_ids;        /* [n_stop_ids] extra stop tokens */
    int64_t n_stop_ids;
    int32_t ignore_eos;             /* nonzero: eos_token_id does not stop */
    const char *const *stop_strings; /* [n_stop_strings] NUL-terminated, non-empty; need `tokenizer` */
    int64_t n_stop_strings;
    const ds4_tokenizer *tokenizer; /* decodes generated tokens for stop strings */
    int32_t record_experts;         /* keep each sequence's routed experts (for routing replay) */
    int32_t record_index;           /* keep each sequence's indexer picks */
    int64_t max_batch;              /* at most this many sequences run at once (ds4_batcher max_seqs); 0: all */
    int64_t prefill_chunk;          /* at most this many prompt tokens per prefill step; 0: 2048 */
    ds4_token_fn on_token;          /* may be NULL */
    void *ud;
    const volatile int *cancel;     /* may be NULL; polled before every step */
} ds4_gen_args;

typedef struct ds4_gen_seq {
    int64_t prompt_index, sample_index;
    int64_t prompt_len;
    int64_t n_ids;
    int64_t *ids;                   /* [n_ids] generated tokens, prompt excluded; a final eos / stop token is kept */
    float *logprobs;                /* [n_ids] log p_model(id | prefix) at temperature 1, unfiltered */
    float *sample_logprobs;         /* [n_ids] log-probability under the distribution sampled from */
    ds4_finish finish;
    int64_t stop_index;             /* the stop id / string that matched, else -1 */
    /* routing replay: one row per token the model ran on, i.e. the prompt and every generated token but the
     * last (n_rows = prompt_len + n_ids - 1 once a token was generated; a sequence cancelled earlier has the rows
     * of the prompt tokens that ran, possibly 0) */
    int64_t n_rows;
    int32_t *experts;               /* [n_rows, L, K] when record_experts, else NULL */
    int32_t *index_picks;           /* [n_rows, n_csa, index_topk] (-1 padded) when record_index, else NULL */
} ds4_gen_seq;

typedef struct ds4_gen_result {
    int64_t nseq;                   /* nprompts · n, prompt-major: seqs[i] is prompt i / n, sample i % n */
    ds4_gen_seq *seqs;
    int64_t prefill_tokens, decode_tokens;
    /* seconds of the steps that ran prompt tokens of this task (they may also have decoded other sequences: with
     * more prompt tokens than prefill_chunk, or beside other tasks in a batcher), and of its other steps */
    double prefill_seconds, decode_seconds;
} ds4_gen_result;

/* Generate continuations of every prompt. A cancelled generation is not an error: it returns what was generated,
 * with finish DS4_FINISH_CANCELLED on the sequences still running. */
ds4_status ds4_generate(ds4_model *m, const ds4_gen_args *a, ds4_gen_result **out, ds4_error *err);
void ds4_gen_result_free(ds4_gen_result *r);

/* ------------------------------------------------------------------------------------------------ batcher */

/* Continuous batching: tasks (each a ds4_gen_args) are submitted at any time; every ds4_batcher_step appends one
 * token to every running sequence of every admitted task at once, and a piece of the prompts still being read
 * (prefill_chunk tokens in all), so a new task's prefill joins while the others decode and a finished sequence's
 * room goes to the next task at once. A prompt's n samples are admitted together when at most max_seqs sequences
 * would then be running (a prompt with n > max_seqs when nothing else runs; steps then hold max_seqs sequences at a
 * time), in submission order. A task's result is bit for bit ds4_generate(m, its args) alone: the same tokens,
 * log-probabilities, finish reasons and routing records, whatever runs beside it (the model step is batch
 * invariant and each sequence draws from its own stream, ds4_sample_uniform(seed, prompt << 32 | sample, k)).
 * ds4_generate is one task in a batcher of max_seqs = max_batch (0: all its sequences).
 *
 * The batcher uses its model between steps only: nothing else may run the model during ds4_batcher_step, and
 * changing the model's parameters while tasks are admitted mixes two models in their sequences. */
typedef struct ds4_batcher ds4_batcher;

typedef struct ds4_batcher_options {
    int64_t max_seqs;               /* sequences running at once, in [1, 2^20] */
    int64_t prefill_chunk;          /* prompt tokens per step over all prefilling prompts; 0: 2048 */
} ds4_batcher_options;

typedef struct ds4_batcher_stats {
    int64_t queued, running, finished; /* tasks waiting for room / admitted / finished and not yet taken */
    int64_t seqs, free_seqs;        /* sequences of admitted prompts still running; room left (max_seqs - seqs) */
    int64_t steps, prefill_tokens, decode_tokens; /* model steps run and tokens they ran, since creation */
} ds4_batcher_stats;

ds4_status ds4_batcher_create(ds4_model *m, const ds4_batcher_options *o, ds4_batcher **out, ds4_error *err);
void ds4_batcher_free(ds4_batcher *b);      /* drops unfinished and untaken tasks */
/* Queue a task (checked as ds4_generate checks its args; its arrays and strings are copied). Its max_batch and
 * prefill_chunk are ignored (the batcher's options rule); on_token and *cancel work as in ds4_generate, for this
 * task: the callback's seq indexes the task's result, and a nonzero return or *cancel cancels only this task
 * (cancel must stay valid until the task is taken). tag: the caller's name for the task. */
ds4_status ds4_batcher_submit(ds4_batcher *b, const ds4_gen_args *a, uint64_t tag, ds4_error *err);
/* One step: admit what fits, run every admitted sequence once, retire finished tasks. Without admitted or queued
 * tasks it does nothing. On an error (a failed model step, out of memory) every admitted task ends: it is taken
 * with that status and no result; queued tasks stay queued. */
ds4_status ds4_batcher_step(ds4_batcher *b, ds4_error *err);
/* Take the oldest finished task: 1 and its tag, its result (the caller frees it with ds4_gen_result_free; NULL when
 * the task ended by a failed step) and status (DS4_OK, or that step's code); 0 when none is finished. */
int ds4_batcher_take(ds4_batcher *b, uint64_t *tag, ds4_gen_result **res, ds4_status *st);
/* Cancel a queued or running task now: it becomes finished (sequences still running: DS4_FINISH_CANCELLED, with
 * what they generated). Returns 1 when the tag named an unfinished task. */
int ds4_batcher_cancel(ds4_batcher *b, uint64_t tag);
void ds4_batcher_get_stats(const ds4_batcher *b, ds4_batcher_stats *s);
/* What a queued or running task has generated so far: its result as it grows (each sequence's ids, logprobs and
 * sample_logprobs up to n_ids; finish DS4_FINISH_NONE while the sequence runs; routing records incomplete). Read-only
 * and the batcher's: valid until the next ds4_batcher_step, _cancel, _take or _free. NULL when tag names no
 * unfinished task (never submitted, finished, or taken). For streaming partial results (a rollout worker sends them
 * every few tokens) and for counting the tokens a sequence had when the model's weights changed. */
const ds4_gen_result *ds4_batcher_peek(const ds4_batcher *b, uint64_t tag);

#ifdef __cplusplus
}
#endif

#endif
