/* Weight cache (prefix wcache_): the block of weights a model converted or quantized at load,
 * kept in a file next to the model (DIR/.moeserve/) so that the next load maps it instead of
 * converting again (--quantization-cache). A cache file is valid for one checkpoint (the size
 * and modification time of every safetensors file), one set of load options and one version
 * of the layout; anything else misses and is written anew.
 *
 * File: a 4096-byte header (magic, version, key, data size), then the data block exactly as
 * model_load lays it out in memory.
 *
 * Ownership: wcache_map returns a read-only mapping the caller releases with wcache_unmap. */
#ifndef MOESERVE_WEIGHT_CACHE_H
#define MOESERVE_WEIGHT_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

/* The key of a checkpoint's files (config.json and every safetensors file: names, sizes,
 * modification times) and `tag` (the load options and the layout version, as text). */
uint64_t wcache_key(const char *model_dir, const struct st_archive *st, const char *tag);

/* path (cap bytes) = DIR/.moeserve/weights-<key>.bin */
void wcache_path(const char *model_dir, uint64_t key, char *path, size_t cap);

/* Maps the cache file for key holding exactly `bytes` of data: 0 and *data / *map / *map_len
 * on a hit, -1 on a miss (no file, another key or size, unreadable: the reason in err). */
int wcache_map(const char *path, uint64_t key, size_t bytes, const void **data, void **map,
               size_t *map_len, char *err, size_t errlen);
void wcache_unmap(void *map, size_t map_len);

/* Writes the cache file (through a temporary file and a rename, so a reader never sees half
 * of one); -1 with the reason in err (a read-only folder, a full disk). */
int wcache_write(const char *path, uint64_t key, const void *data, size_t bytes, char *err,
                 size_t errlen);

#endif
