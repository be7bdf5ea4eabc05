/* Paged KV cache: a pool of fixed-size blocks per layer and, per sequence, a block table
 * mapping logical block i (positions i*block_size ..) to a physical block. Blocks carry a
 * reference count so that a later prefix cache can share prompt blocks between sequences.
 *
 * Ownership: kv_create allocates the pool once through the backend (no allocation afterwards
 * except growing a sequence's block table array, which is sized for max_model_len at
 * kv_seq_init). kv_seq_release returns a sequence's blocks to the pool. The cache is owned by
 * the engine's scheduler thread; device threads only read/write rows of blocks they were given. */
#ifndef MOESERVE_KV_CACHE_H
#define MOESERVE_KV_CACHE_H

#include <stdint.h>

#include "backend.h"

struct kv_cache {
    int n_layer;
    int n_kv_head;
    int head_dim;
    int block_size;
    int n_blocks;
    float **k;         /* (n_layer) -> (n_blocks, block_size, n_kv_head, head_dim) */
    float **v;         /* (n_layer) -> same */
    int32_t *free_list;/* (n_blocks) stack of free block ids */
    int n_free;
    int32_t *refcount; /* (n_blocks) */
    struct backend *be;
};

struct kv_seq {
    int32_t *blocks; /* (max_blocks) physical block per logical block */
    int n_blocks;    /* blocks held */
    int max_blocks;
};

int kv_create(struct kv_cache *kv, struct backend *be, int n_layer, int n_kv_head, int head_dim,
              int block_size, int n_blocks, char *err, size_t errlen);
void kv_destroy(struct kv_cache *kv);

/* Bytes of one block across all layers (K and V). */
size_t kv_block_bytes(int n_layer, int n_kv_head, int head_dim, int block_size);

int kv_seq_init(struct kv_seq *s, int max_tokens, int block_size);
void kv_seq_free(struct kv_cache *kv, struct kv_seq *s); /* releases blocks and the table */
/* Makes sure the sequence holds blocks for positions [0, n_tokens). Returns 0, or -1 when the
 * pool has too few free blocks (nothing is taken then) or n_tokens exceeds the table. */
int kv_seq_reserve(struct kv_cache *kv, struct kv_seq *s, int n_tokens);
void kv_seq_release(struct kv_cache *kv, struct kv_seq *s);
int kv_free_blocks(const struct kv_cache *kv);

#endif
