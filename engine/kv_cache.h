/* Paged KV cache with automatic prefix caching: a pool of fixed-size blocks per layer and, per
 * sequence, a block table mapping logical block i (positions i*block_size ..) to a physical
 * block. Blocks carry a reference count so that sequences can share full prompt blocks.
 *
 * Prefix caching (vLLM-style): a full block is identified by a chain hash of (the previous
 * block's hash, a namespace key, the block's token ids). Once a sequence has computed a full
 * block, kv_seq_register enters it in a hash table sized at kv_create. A new sequence takes the
 * longest run of registered blocks matching its tokens with kv_seq_match (refcount++), then
 * computes from there. A hit is exact, not probabilistic: it also compares the block's token
 * ids, the namespace key and the identity of the physical parent block (id and registration
 * generation), so a 64-bit hash collision can never hand out another prefix's K/V. A registered
 * block whose refcount drops to zero is not freed but parked in an LRU list of evictable
 * blocks; allocation takes never-used/free blocks first, then evicts the least recently released
 * cached block (dropping its hash entry). Evictable blocks count as free in kv_free_blocks.
 * Only full blocks are shared and nobody writes a full block again, so no copy-on-write.
 *
 * Token-level reuse of the first block that differs (llama.cpp's common prefix, at block
 * granularity elsewhere): every cached block is also indexed by (parent, key, first token), and
 * a finished sequence's partly filled last block can be kept as a "tail" with its fill count
 * (kv_seq_keep_tail). After the full-block match, kv_seq_match_tail takes the cached block
 * after the matched ones whose tokens share the longest common prefix with the new sequence's,
 * provided nobody holds it: it leaves the cache (it will be overwritten past the common part)
 * and becomes the sequence's own. So a prompt repeated after its request finished recomputes
 * only its last token, whatever its length.
 *
 * Ownership: kv_create allocates the pool, the hash table, the LRU links and the per-block
 * token copies once through the backend / malloc; nothing is allocated afterwards except a
 * sequence's block table and hash array at kv_seq_init (sized for max_model_len). kv_seq_release
 * returns a sequence's blocks to the pool (or to the evictable list). The cache is owned by the
 * engine's scheduler thread; device threads only read/write rows of blocks they were given. */
#ifndef MOESERVE_KV_CACHE_H
#define MOESERVE_KV_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"

/* What one token of one layer stores: K rows of k_row elements and V rows of v_row (MLA: the
 * latent row, v_row 0), of one type; int8 keeps a scale per group of k_grp / v_grp elements
 * (a KV head's key or value; MLA's whole row) beside them (kernels/kv_types.h). */
struct kv_geom {
    enum be_kv_type type;
    int k_row, v_row;
    int k_grp, v_grp;
};

/* Bytes one token takes in one layer, scales included. */
size_t kv_geom_token_bytes(const struct kv_geom *g);

/* One layer's storage for n_blocks blocks of block_size tokens (struct be_kv, fp8 scales 1; for
 * v_row 0, v and v_sc alias k and k_sc). 0, or -1 when out of memory (nothing is left
 * allocated). kv_layer_free releases it (a zeroed layer is a no-op). */
int kv_layer_alloc(struct backend *be, const struct kv_geom *g, int n_blocks, int block_size,
                   struct be_kv *out);
void kv_layer_free(struct backend *be, struct be_kv *l);

struct kv_cache {
    int n_layer;
    int n_kv_head;     /* kv_create only (0 after kv_create_rows) */
    int head_dim;
    int k_row, v_row;  /* elements per token and layer in k and v (MLA: the latent row, v_row 0) */
    struct kv_geom geom;
    int block_size;
    int n_blocks;
    struct be_kv *layer; /* (n_layer) each layer's storage; zeroed for layers without K/V */
    int32_t *free_list;/* (n_blocks) stack of free (unregistered, unreferenced) block ids */
    int n_free;
    int32_t *refcount; /* (n_blocks) */
    struct backend *be;

    /* prefix cache: a block is "registered" when it has an entry in the hash table */
    uint64_t *hash;      /* (n_blocks) chain hash of a registered block */
    uint64_t *key;       /* (n_blocks) namespace key it was computed under */
    int32_t *parent;     /* (n_blocks) physical parent block, -1 for a sequence's first block */
    uint32_t *parent_gen;/* (n_blocks) the parent's gen when this block was registered */
    uint32_t *gen;       /* (n_blocks) bumped at each registration of the block */
    bool *registered;    /* (n_blocks) */
    bool *tail;          /* (n_blocks) a kept tail (kv_seq_keep_tail): cached, not in the hash
                            table */
    int32_t *fill;       /* (n_blocks) tokens a cached block holds (block_size unless a tail) */
    int32_t *pbuckets;   /* (n_buckets) cached blocks by (parent, key, first token) */
    int32_t *pnext;      /* (n_blocks) */
    int32_t *tokens;     /* (n_blocks, block_size) token ids of registered blocks */
    int32_t *buckets;    /* (n_buckets) first block of each hash chain, -1 if empty */
    int32_t *hnext;      /* (n_blocks) next block in the same bucket */
    uint32_t bucket_mask;/* n_buckets - 1 (a power of two >= n_blocks) */
    int32_t *lru_prev;   /* (n_blocks) evictable list links; head = next victim */
    int32_t *lru_next;   /* (n_blocks) */
    int32_t lru_head, lru_tail;
    int n_evictable;     /* registered blocks with refcount 0 */
    int n_registered;
    uint64_t n_evictions;/* cached blocks reused for other content (counter) */
    int n_kv_layers;     /* layers with storage (hybrid models: the attention layers; k[l] and
                            v[l] are NULL for the others) */

    /* Recurrent-state slots (hybrid models; kv_state_init): a sequence takes one at its first
     * step and holds it until its blocks are released (finish, cancel, preemption), as the
     * state belongs with its K/V. The engine keeps the state itself, indexed by slot. */
    int n_slots;
    int32_t *slot_free;  /* (n_slots) stack of free slots */
    int n_slot_free;
};

struct kv_seq {
    int32_t *blocks; /* (max_blocks) physical block per logical block */
    uint64_t *hash;  /* (max_blocks) chain hash of each full block, valid below n_hashed */
    int n_blocks;    /* blocks held */
    int n_hashed;    /* leading full blocks whose chain hash is known (taken or registered) */
    bool reg_stop;   /* block n_hashed duplicates a registered one: register nothing further */
    int max_blocks;
    int device;      /* engines whose devices hold separate KV storage: the device this
                        sequence's K/V live on, -1 until its first step */
    int slot;        /* recurrent-state slot, -1 when none is held */
    int state_pos;   /* positions [0, state_pos) are folded into the slot's state */
    int spare_slot;  /* speculative decoding on hybrid models: a second slot holding the state
                        as it was before the last verification (spare_pos), -1 when none */
    int spare_pos;
    int n_dropped;   /* leading blocks given back because every layer's window has passed
                        them (kv_seq_drop_before): blocks[0, n_dropped) are -1 */
};

/* An f32 cache of n_kv_head heads of head_dim per layer. */
int kv_create(struct kv_cache *kv, struct backend *be, int n_layer, int n_kv_head, int head_dim,
              int block_size, int n_blocks, char *err, size_t errlen);
void kv_destroy(struct kv_cache *kv);

/* An f32 cache whose tokens hold k_row floats of keys and v_row of values per layer (v_row may
 * be 0: MLA caches one latent row per token and no values). */
int kv_create_rows(struct kv_cache *kv, struct backend *be, int n_layer, int k_row, int v_row,
                   int block_size, int n_blocks, char *err, size_t errlen);

/* A cache of geometry *g, without storage for the layers where no_kv[l] (may be NULL: none). */
int kv_create_layers(struct kv_cache *kv, struct backend *be, int n_layer, const bool *no_kv,
                     const struct kv_geom *g, int block_size, int n_blocks, char *err,
                     size_t errlen);

/* n_slots recurrent-state slots (0: none). 0, or -1 when out of memory. */
int kv_state_init(struct kv_cache *kv, int n_slots);
/* The sequence's slot, taken from the free ones if it holds none (state_pos 0 then); -1 when
 * every slot is held. */
int kv_seq_slot(struct kv_cache *kv, struct kv_seq *s);

/* Speculative decoding on hybrid models: the sequence's spare slot (kv_seq.spare_slot), taken
 * from the free ones if it holds none; -1 when every slot is held. Freed with the sequence's
 * blocks. */
int kv_seq_spare_slot(struct kv_cache *kv, struct kv_seq *s);

/* Bytes of one f32 block across all layers (K and V). */
size_t kv_block_bytes(int n_layer, int n_kv_head, int head_dim, int block_size);
size_t kv_block_bytes_rows(int n_layer, int k_row, int v_row, int block_size);

int kv_seq_init(struct kv_seq *s, int max_tokens, int block_size);
void kv_seq_free(struct kv_cache *kv, struct kv_seq *s); /* releases blocks and the table */
/* Makes sure the sequence holds blocks for positions [0, n_tokens), evicting cached blocks
 * when no free one is left. Returns 0, or -1 when the pool has too few free or evictable
 * blocks (nothing is taken then) or n_tokens exceeds the table. */
int kv_seq_reserve(struct kv_cache *kv, struct kv_seq *s, int n_tokens);
/* Gives back the sequence's blocks whose positions all lie before pos (a sliding-window model
 * past its window: no later query reads them), leaving -1 in their table entries. The table
 * keeps its length; the blocks count as held for kv_seq_reserve. Returns the blocks dropped. */
int kv_seq_drop_before(struct kv_cache *kv, struct kv_seq *s, int pos);
/* Gives back the sequence's blocks past those holding positions [0, n_tokens) (speculative
 * decoding: the blocks of rejected drafts). Only blocks nothing registered: a sequence's
 * registered blocks hold positions it has verified, which n_tokens must cover. Returns the blocks
 * given back. */
int kv_seq_truncate(struct kv_cache *kv, struct kv_seq *s, int n_tokens);
/* Drops the sequence's references, last block first (so a sequence's tail is evicted before
 * its head). Registered blocks left unreferenced become evictable, the others free. Its state
 * slot, if any, is freed too (the state is meaningless without the K/V). */
void kv_seq_release(struct kv_cache *kv, struct kv_seq *s);
/* Blocks an allocation can get: free plus evictable cached ones. */
int kv_free_blocks(const struct kv_cache *kv);
/* Registered blocks nobody references (a subset of kv_free_blocks). */
int kv_cached_blocks(const struct kv_cache *kv);

/* --- prefix caching ------------------------------------------------------------------------ */

/* Chain hash of a block: parent_hash is the previous block's hash, or KV_HASH_ROOT for the
 * first block. key separates caches whose K/V differ for equal tokens (e.g. the MoE expert
 * budget) and is mixed into every block. tokens: (n). */
#define KV_HASH_ROOT UINT64_C(0x6d6f657365727665)
uint64_t kv_block_hash(uint64_t parent_hash, uint64_t key, const int32_t *tokens, int n);

/* The registered block that continues physical block `parent` (-1: a sequence's start) with
 * `tokens` (block_size ids) under `key`, whose chain hash is h; -1 when there is none. */
int32_t kv_prefix_lookup(const struct kv_cache *kv, int32_t parent, uint64_t key, uint64_t h,
                         const int32_t *tokens);

/* For a sequence holding no blocks: takes the longest run of cached blocks matching
 * tokens[0, max_blocks*block_size) (refcount++, out of the evictable list). Returns the number
 * of blocks taken; positions [0, that * block_size) then hold valid K/V. */
int kv_seq_match(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                 int max_blocks);

/* The blocks kv_seq_match would take for tokens[0, max_blocks*block_size), taking none. */
int kv_prefix_count(const struct kv_cache *kv, uint64_t key, const int32_t *tokens, int max_blocks);

/* Registers the sequence's full blocks whose positions [0, n_computed) hold computed K/V
 * (tokens: (n_computed) ids at those positions). Blocks already registered are skipped; a block
 * whose content another registered block already holds stays unregistered (it is freed normally
 * on release), as do the blocks after it. Never allocates. */
void kv_seq_register(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                     int n_computed);

/* After kv_seq_match: takes the cached block (full or a tail) that continues the sequence's
 * matched blocks and shares the longest common prefix with tokens[n_blocks * block_size,
 * max_tokens), if nobody holds it; it leaves the cache and becomes the sequence's last block.
 * Returns the tokens of it now valid (0: none taken). */
int kv_seq_match_tail(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                      int max_tokens);

/* Before releasing a sequence whose positions [0, n_computed) hold K/V: keeps its partly filled
 * last block cached as a tail (when its parent block is registered, or it is the first), so a
 * later sequence with the same tokens can take it (kv_seq_match_tail). Never allocates. */
void kv_seq_keep_tail(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                      int n_computed);

/* Forgets every evictable cached block (they become free). Referenced blocks stay registered.
 * Returns the number of blocks freed. */
int kv_prefix_reset(struct kv_cache *kv);

#endif
