/* ds4_ckpt.h — saving models in the Hugging Face layout, and training checkpoint directories. Included by
 * ds4.h.
 *
 * Saving a model (ds4_model_save) writes config.json + model.safetensors under the tensor names that
 * transformers' save_pretrained writes for DeepseekV4ForCausalLM, so that from_pretrained loads the directory
 * (and ds4_model_load gives back bit-identical F32 weights). The directory appears atomically: everything is
 * written and fsynced in a temporary sibling, which is then renamed into place.
 *
 * Checkpoint directories. A training run keeps its checkpoints under one ROOT:
 *
 *   ROOT/step_000020/            20 = completed optimizer updates (the unit of every step number below)
 *       config.json              the model, loadable by ds4_model_load and by from_pretrained
 *       model.safetensors
 *       adapter_config.json      a model's LoRA adapters when it carries them (ds4_model_lora_write_files: PEFT's
 *       adapter_model.safetensors  layout, F32; ds4_model_lora_load(dir) reads them back bitwise)
 *       <name>.safetensors       named extra state (optimizer moments, data-loader position, ...) written by
 *       <name>.json              ds4_ckpt_write_state: tensors + a JSON metadata object
 *       COMPLETE                 the marker, written and fsynced last: JSON {format, version, step, time,
 *                                files: [{name, size, crc32}]} over every other file of the directory
 *
 * A checkpoint is written into ROOT/step_000020.tmp-<pid>@<host> (ds4_ckpt_begin), filled by the caller, and
 * committed (ds4_ckpt_commit): every file is fsynced and checksummed, the marker is written, the directory is
 * renamed to its final name and ROOT is fsynced. A reader trusts a directory only when its name is exactly
 * step_ + at least 6 digits (the canonical "%06lld" spelling), its marker parses, names the same step, and
 * every file it lists exists with the recorded size (and CRC-32, when verifying fully). A process killed at
 * any point therefore leaves either the previous set of checkpoints or a new complete one, plus at most a
 * leftover directory (".tmp-", ".old-" or ".del-" + pid@host) that is never listed, that the next successful
 * commit removes (its writer's process is gone, or its step is older than the step committed), and that
 * ds4_ckpt_prune removes on request once its writer is dead.
 *
 * Checkpoints of one ROOT are written from one host at a time (leftovers of other hosts are reported but
 * never removed, since their writer's liveness cannot be checked from here). All strings returned through
 * `char **` or arrays through `T **` are malloc'd: release them with free(). */
#ifndef DS4_CKPT_H
#define DS4_CKPT_H

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------ models */

/* A file saved next to the weights (e.g. tokenizer.json): name is a plain file name of [A-Za-z0-9._-] ending in
 * .json (what a checkpoint directory may hold, see overwrite), not config.json. */
typedef struct ds4_save_file {
    const char *name;
    const void *data;
    size_t len;
} ds4_save_file;

typedef struct ds4_save_options {
    ds4_dtype dtype;          /* floating-point parameters: DS4_F32 (0, the default: exact), DS4_BF16 or DS4_F16
                                 (rounded to nearest even). Hash-routing tables are always I64, as HF writes. */
    int32_t expand_quantised; /* 0 (default): a tensor loaded as FP8 or FP4 is written so again, with its loaded
                                 scales, while that is exactly its value (FP4-resident experts always; a dequantised
                                 tensor unless training changed it: docs/checkpoints.md, "Saving"); 1: every tensor
                                 is written in `dtype` */
    int32_t overwrite;        /* 1: replace an existing non-empty `dir`, provided it holds nothing but files of
                                 a checkpoint (config.json, *.safetensors, *.json); 0: refuse */
    const ds4_save_file *files; /* n_files more files written (and fsynced) with the weights, before the rename or
                                 commit that publishes them: the tokenizer of a saved model appears with it */
    size_t n_files;
} ds4_save_options;

/* Save to `dir` (created with its missing parents) as F32, refusing a non-empty existing `dir`. */
ds4_status ds4_model_save(const ds4_model *m, const char *dir, ds4_error *err);
/* Same with options (opt may be NULL: the defaults above). */
ds4_status ds4_model_save_opts(const ds4_model *m, const char *dir, const ds4_save_options *opt, ds4_error *err);
/* Write config.json and model.safetensors (each fsynced) into the existing directory `dir`, replacing files of
 * those names, without the atomic directory swap: for checkpoint directories, whose commit is the atomic
 * step. opt->overwrite is ignored. */
ds4_status ds4_model_write_files(const ds4_model *m, const char *dir, const ds4_save_options *opt, ds4_error *err);
/* The name save_pretrained writes for the canonical official name `canonical` (as ds4_model_tensor_at gives):
 * "model." + name, except embed.weight -> model.embed_tokens.weight, head.weight unchanged,
 * hc_head_{fn,base,scale} -> model.hc_head.hc_{fn,base,scale}, layers.N.attn.kv_norm.weight ->
 * model.layers.N.attn.norm.weight, and mtp.* unchanged (transformers has no MTP module). Returns 1 and fills
 * `out`, or 0 when the name is not canonical or does not fit in `cap` bytes. */
int ds4_hf_save_name(const char *canonical, char *out, size_t cap);

/* ------------------------------------------------------------------------------------------------ checkpoint directories */

#define DS4_CKPT_MARKER "COMPLETE"

/* 1 when `name` is exactly a checkpoint directory name ("step_" + the step as printed by "%06lld": at least 6
 * digits, no leading zero beyond those 6), storing the step; 0 otherwise ("step_20", "step_0000020",
 * "step_000020.tmp-1", "xstep_000020" are not checkpoint names). */
int ds4_ckpt_parse_name(const char *name, int64_t *step);
/* "ROOT/step_%06lld" into out (cap bytes). Returns 1, or 0 when it does not fit or step < 0. */
int ds4_ckpt_step_path(const char *root, int64_t step, char *out, size_t cap);

/* Create ROOT (and its parents) if needed and a fresh, empty ROOT/step_NNNNNN.tmp-<pid>@<host> directory
 * (a leftover of this same process under that name is removed first). *tmp_path receives its path. */
ds4_status ds4_ckpt_begin(const char *root, int64_t step, char **tmp_path, ds4_error *err);
/* Seal tmp_path (from ds4_ckpt_begin for the same root and step) and rename it to ROOT/step_NNNNNN. Every
 * entry of tmp_path must be a regular file named with [A-Za-z0-9._-] only. An existing ROOT/step_NNNNNN is
 * replaced (moved aside, then removed once the new one is in place). On failure tmp_path is left as it is:
 * remove it with ds4_ckpt_abort. After a successful commit, crash leftovers of ROOT are removed (best effort):
 * this host's whose process is gone, and any of an older step than `step` (one writer per ROOT: nobody is still
 * writing an older step; pids repeat across container restarts, so the pid test alone would keep them). */
ds4_status ds4_ckpt_commit(const char *root, int64_t step, const char *tmp_path, ds4_error *err);
/* Remove a temporary checkpoint directory. Refuses any path whose last component is not a
 * "step_NNNNNN.tmp-..." name, so that it can never delete anything else. */
ds4_status ds4_ckpt_abort(const char *tmp_path, ds4_error *err);

typedef enum ds4_ckpt_verify {
    DS4_CKPT_VERIFY_FULL = 0, /* marker + sizes + CRC-32 of every file (reads every byte) */
    DS4_CKPT_VERIFY_SIZES = 1 /* marker + sizes (catches truncated and missing files; reads only the marker) */
} ds4_ckpt_verify;

/* DS4_OK when `dir` is a complete checkpoint; *step (may be NULL) receives the marker's step. Otherwise an
 * error saying what is wrong (no marker, bad marker, step differs from the directory name, file missing,
 * size or checksum mismatch): DS4_ERR_NOT_FOUND for a missing directory or marker, DS4_ERR_FORMAT else. */
ds4_status ds4_ckpt_check(const char *dir, ds4_ckpt_verify how, int64_t *step, ds4_error *err);

typedef enum ds4_ckpt_kind {
    DS4_CKPT_COMPLETE = 0,    /* step_N, verified */
    DS4_CKPT_INCOMPLETE = 1,  /* step_N that fails verification (reason says why): never listed, never removed */
    DS4_CKPT_ACTIVE = 2,      /* leftover (.tmp-/.old-/.del-) whose writer may be running: its pid is alive, or
                                 it belongs to another host */
    DS4_CKPT_STALE = 3        /* leftover of a dead process of this host: removable (ds4_ckpt_prune clean) */
} ds4_ckpt_kind;

typedef struct ds4_ckpt_entry {
    char name[256];           /* the directory's name under ROOT */
    int64_t step;
    ds4_ckpt_kind kind;
    int64_t pid;              /* leftovers: the writer's pid (0 otherwise) */
    char reason[512];         /* INCOMPLETE: why; leftovers: whose */
} ds4_ckpt_entry;

/* Every checkpoint-related directory under ROOT (other entries are ignored), sorted by step, then name. A
 * missing ROOT gives n = 0. */
ds4_status ds4_ckpt_scan(const char *root, ds4_ckpt_verify how, ds4_ckpt_entry **entries, size_t *n, ds4_error *err);
/* Steps of the complete checkpoints, ascending, fully verified (reads every file: see ds4_ckpt_latest for the
 * cheap way to find where to resume). A missing ROOT gives n = 0. */
ds4_status ds4_ckpt_list(const char *root, int64_t **steps, size_t *n, ds4_error *err);
/* The newest complete checkpoint: candidates are checked by size, newest first, and the first that also
 * passes the checksums wins. DS4_ERR_NOT_FOUND when there is none. */
ds4_status ds4_ckpt_latest(const char *root, int64_t *step, ds4_error *err);

typedef struct ds4_ckpt_prune_options {
    int64_t keep_last;        /* keep the K newest complete checkpoints (0: only the newest, which is always kept) */
    int64_t keep_every;       /* and every complete one whose step is a multiple of M (0: none) */
    int32_t clean_stale;      /* 1: also remove STALE leftovers (never ACTIVE ones, never INCOMPLETE ones) */
    int32_t dry_run;          /* 1: report what would be removed, remove nothing */
} ds4_ckpt_prune_options;

typedef struct ds4_ckpt_prune_result {
    int64_t *removed;         /* steps removed (or that would be), ascending; free() */
    size_t n_removed;
    size_t n_kept;            /* complete checkpoints left */
    size_t n_cleaned;         /* stale leftovers removed (or that would be) */
    size_t n_left;            /* incomplete directories and leftovers left in place */
} ds4_ckpt_prune_result;

/* Retention: among the complete checkpoints, keep the newest (always: it is the one fully verified, newest
 * first, as ds4_ckpt_latest finds it), the keep_last newest and the multiples of keep_every; remove the
 * others (each is first renamed to a ".del-" leftover, so a crash mid-removal never leaves a damaged
 * step_N). Nothing is removed when no checkpoint verifies. res may be NULL. */
ds4_status ds4_ckpt_prune(const char *root, const ds4_ckpt_prune_options *opt, ds4_ckpt_prune_result *res,
                          ds4_error *err);

/* Named extra state inside a checkpoint directory (normally the tmp_path of ds4_ckpt_begin): writes
 * dir/<name>.safetensors (the n named tensors; n may be 0) and dir/<name>.json (json_meta, which must be a
 * JSON object; NULL writes "{}"), each fsynced. name: 1-64 characters of [A-Za-z0-9_-], not "model" or
 * "config" (those files belong to the model). */
ds4_status ds4_ckpt_write_state(const char *dir, const char *name, size_t n, const char *const *names,
                                const ds4_tensor *const *tensors, const char *json_meta, ds4_error *err);
/* Read it back: *tensors (may be NULL: not opened) is the opened safetensors file (ds4_st_close it),
 * *json_meta (may be NULL) the metadata text. DS4_ERR_NOT_FOUND when the state was never written. */
ds4_status ds4_ckpt_read_state(const char *dir, const char *name, ds4_st_file **tensors, char **json_meta,
                               ds4_error *err);

/* CRC-32 (IEEE 802.3, the zlib/PNG polynomial) of n bytes, continuing from `crc` (0 to start). */
uint32_t ds4_crc32(uint32_t crc, const void *data, size_t n);

#ifdef __cplusplus
}
#endif
#endif
