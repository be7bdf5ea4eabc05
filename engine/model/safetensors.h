/* safetensors reader: maps `model.safetensors`, or every shard named by
 * `model.safetensors.index.json`, read-only with mmap and indexes their tensors by name.
 * Tensor data is borrowed from the mapping (zero copy) and stays valid until st_close.
 *
 * Every malformed input is reported by file (and tensor) name: missing file, truncated file,
 * header length past the end, header that is not a JSON object, tensor entry without dtype,
 * shape or data_offsets, offsets outside the data section or not matching shape × dtype size,
 * unsupported dtype. */
#ifndef MOESERVE_SAFETENSORS_H
#define MOESERVE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

enum st_dtype {
    ST_DTYPE_F32,
    ST_DTYPE_F16,
    ST_DTYPE_BF16,
    ST_DTYPE_F64,
    ST_DTYPE_I64,
    ST_DTYPE_I32,
    ST_DTYPE_I16,
    ST_DTYPE_I8,
    ST_DTYPE_U8,
    ST_DTYPE_BOOL,
    ST_DTYPE_F8_E4M3,
    ST_DTYPE_F8_E5M2,
};

#define ST_MAX_DIMS 8

struct st_tensor {
    const char *name;   /* owned by the archive */
    const char *file;   /* path of the file holding it, owned by the archive */
    enum st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;   /* into the read-only mapping */
    size_t nbytes;
};

struct st_archive;

/* Opens the safetensors weights of a model folder: model.safetensors.index.json and its
 * shards when the index exists, else model.safetensors. */
int st_open_dir(const char *dir, struct st_archive **out, char *err, size_t errlen);
/* Opens one .safetensors file. */
int st_open_file(const char *path, struct st_archive **out, char *err, size_t errlen);
void st_close(struct st_archive *a);

const struct st_tensor *st_find(const struct st_archive *a, const char *name);
int st_count(const struct st_archive *a);
const struct st_tensor *st_at(const struct st_archive *a, int i);
/* The files of the archive (their paths, owned by it). */
int st_file_count(const struct st_archive *a);
const char *st_file_path(const struct st_archive *a, int i);

/* The index i of a tensor of the archive (st_at(a, i) == t). */
int st_index(const struct st_archive *a, const struct st_tensor *t);

/* Gives the pages that lie wholly inside t's data back to the kernel (the mapping stays
 * valid: reading them again faults them in from the file). For tensors the caller has copied
 * or converted and will not read again, so they stop counting in the resident set. */
void st_release_pages(const struct st_tensor *t);
/* The same for the pages wholly inside bytes [off, off + len) of t's data (clipped to it). */
void st_release_range(const struct st_tensor *t, size_t off, size_t len);

/* Value of `key` in the files' "__metadata__" objects (string -> string), or NULL. Owned by
 * the archive. */
const char *st_metadata(const struct st_archive *a, const char *key);

const char *st_dtype_name(enum st_dtype t);
size_t st_dtype_size(enum st_dtype t);

#endif
