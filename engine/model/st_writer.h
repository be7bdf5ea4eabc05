/* safetensors writer (prefix stw_): collects tensor declarations (name, dtype, shape, optional
 * data) and writes a file that the reader here and the Hugging Face `safetensors` library both
 * accept: 8-byte little-endian header length, a JSON header padded with spaces so the data
 * section starts 8-byte aligned, then the tensors back to back with no holes. Tensors are laid
 * out by decreasing element size (stable in declaration order), so every tensor starts at a
 * multiple of its element size. Used by tests and by tools such as bench/make_synthetic_model.
 *
 * Two ways to write:
 *  - stw_add with data, then stw_write(path): everything in one call.
 *  - stw_add with data == NULL for tensors too big to hold at once, then stw_begin(path),
 *    stw_write_tensor for each part of each tensor (any order), stw_end. stw_end fails if a
 *    byte of some tensor was never written.
 *
 * Ownership: data passed to stw_add is borrowed until stw_write returns; names, shapes and
 * metadata are copied. stw_free releases the writer and closes a file left open by stw_begin
 * (the partial file is left on disk). Errors name the path or the tensor. */
#ifndef MOESERVE_ST_WRITER_H
#define MOESERVE_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

struct stw;

struct stw *stw_new(void); /* NULL when out of memory */
void stw_free(struct stw *w);

/* Declares a tensor; returns its index (>= 0) or -1 (duplicate name, bad shape, OOM). `data`
 * holds numel x dtype size bytes, or is NULL for a tensor written later with stw_write_tensor. */
int stw_add(struct stw *w, const char *name, enum st_dtype dtype, int ndim, const int64_t *shape,
            const void *data, char *err, size_t errlen);
/* Adds "__metadata__"[key] = value. */
int stw_set_metadata(struct stw *w, const char *key, const char *value, char *err, size_t errlen);

/* Writes the whole file; every tensor must have been given data. */
int stw_write(struct stw *w, const char *path, char *err, size_t errlen);

/* Streaming: header first, then bytes [offset, offset+nbytes) of tensor `index`. */
int stw_begin(struct stw *w, const char *path, char *err, size_t errlen);
int stw_write_tensor(struct stw *w, int index, size_t offset, const void *data, size_t nbytes,
                     char *err, size_t errlen);
int stw_end(struct stw *w, char *err, size_t errlen);

/* Bytes of tensor `index` (numel x dtype size), 0 for a bad index. */
size_t stw_tensor_nbytes(const struct stw *w, int index);

#endif
