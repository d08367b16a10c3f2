/* ckpt_fs.h — the file-system steps that make saves durable and atomic (private to save.c and ckptdir.c).
 *
 * Durability follows the usual POSIX recipe: a file's bytes are fsynced before the rename that publishes
 * them, and the directory holding a new or renamed entry is fsynced after it. Errors name the operation and
 * the path; `what` prefixes them ("model save", "checkpoint commit", ...). */
#ifndef DS4_CKPT_FS_H
#define DS4_CKPT_FS_H

#include <stddef.h>

#include "ds4.h"

/* mkdir -p (mode 0755). */
ds4_status ds4_fs_mkdirs(const char *what, const char *path, ds4_error *err);
/* Create or truncate `path`, write len bytes, fsync, close. */
ds4_status ds4_fs_write_file(const char *what, const char *path, const void *data, size_t len, ds4_error *err);
/* fsync a directory. File systems that cannot sync directories (EINVAL, ENOTSUP) are accepted silently. */
ds4_status ds4_fs_sync_dir(const char *what, const char *path, ds4_error *err);
/* Remove `path` and everything below it without following symbolic links (a link is removed, not its
 * target). A missing path is not an error. */
ds4_status ds4_fs_rmtree(const char *what, const char *path, ds4_error *err);
/* Split `path` (trailing slashes ignored) into its parent directory and last component, into caller buffers.
 * Returns 0 when the path has no usable last component ("", "/", ".", "..") or a buffer is too small. */
/* Write a directory atomically (save.c): `write` fills a sibling "<dir>.tmp-<pid>", which is fsynced and renamed
 * into place. An existing directory is replaced only with `overwrite` and only when it holds nothing but checkpoint
 * files (*.json, *.safetensors); `what` prefixes messages ("model save"). */
typedef ds4_status (*ds4_dir_writer)(void *ctx, const char *dir, ds4_error *err);
ds4_status ds4_dir_save_atomic(const char *what, const char *dir, int overwrite, ds4_dir_writer write, void *ctx,
                               ds4_error *err);
int ds4_fs_split(const char *path, char *parent, size_t pcap, char *base, size_t bcap);

#endif
