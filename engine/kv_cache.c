/* Paged KV cache: block pool with reference counts, per-sequence block tables, and the prefix
 * cache (chain-hash table of full blocks plus an LRU list of evictable cached blocks). All
 * bookkeeping arrays are sized at kv_create; see kv_cache.h for the rules. */
#include "kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"

size_t kv_block_bytes(int n_layer, int n_kv_head, int head_dim, int block_size)
{
    return kv_block_bytes_rows(n_layer, n_kv_head * head_dim, n_kv_head * head_dim, block_size);
}

size_t kv_block_bytes_rows(int n_layer, int k_row, int v_row, int block_size)
{
    return (size_t)n_layer * block_size * ((size_t)k_row + (size_t)v_row) * sizeof(float);
}

size_t kv_geom_token_bytes(const struct kv_geom *g)
{
    return kv_type_row_bytes(g->type, g->k_row, g->k_grp) +
           kv_type_row_bytes(g->type, g->v_row, g->v_grp);
}

void kv_layer_free(struct backend *be, struct be_kv *l)
{
    if (l->k) be->ops->free(be, l->k);
    if (l->v && l->v != l->k) be->ops->free(be, l->v);
    if (l->k_sc) be->ops->free(be, l->k_sc);
    if (l->v_sc && l->v_sc != l->k_sc) be->ops->free(be, l->v_sc);
    memset(l, 0, sizeof *l);
}

int kv_layer_alloc(struct backend *be, const struct kv_geom *g, int n_blocks, int block_size,
                   struct be_kv *out)
{
    memset(out, 0, sizeof *out);
    size_t tokens = (size_t)n_blocks * (size_t)block_size, es = (size_t)kv_type_size(g->type);
    out->type = g->type;
    out->k_scale = out->v_scale = 1.0f;
    out->k_grp = g->k_grp;
    out->v_grp = g->v_row > 0 ? g->v_grp : g->k_grp;
    bool int8 = g->type == BE_KV_INT8;
    out->k = be->ops->alloc(be, tokens * (size_t)g->k_row * es);
    if (int8) out->k_sc = be->ops->alloc(be, tokens * (size_t)(g->k_row / g->k_grp) * sizeof(float));
    if (g->v_row > 0) {
        out->v = be->ops->alloc(be, tokens * (size_t)g->v_row * es);
        if (int8)
            out->v_sc = be->ops->alloc(be, tokens * (size_t)(g->v_row / g->v_grp) * sizeof(float));
    } else { /* MLA: the value is read from the key row */
        out->v = out->k;
        out->v_sc = out->k_sc;
    }
    if (!out->k || !out->v || (int8 && (!out->k_sc || !out->v_sc))) {
        kv_layer_free(be, out);
        return -1;
    }
    return 0;
}

int kv_create(struct kv_cache *kv, struct backend *be, int n_layer, int n_kv_head, int head_dim,
              int block_size, int n_blocks, char *err, size_t errlen)
{
    if (kv_create_rows(kv, be, n_layer, n_kv_head * head_dim, n_kv_head * head_dim, block_size,
                       n_blocks, err, errlen) != 0)
        return -1;
    kv->n_kv_head = n_kv_head;
    kv->head_dim = head_dim;
    return 0;
}

int kv_create_rows(struct kv_cache *kv, struct backend *be, int n_layer, int k_row, int v_row,
                   int block_size, int n_blocks, char *err, size_t errlen)
{
    struct kv_geom g = {.type = BE_KV_F32, .k_row = k_row, .v_row = v_row, .k_grp = k_row,
                        .v_grp = v_row};
    return kv_create_layers(kv, be, n_layer, NULL, &g, block_size, n_blocks, err, errlen);
}

int kv_create_layers(struct kv_cache *kv, struct backend *be, int n_layer, const bool *no_kv,
                     const struct kv_geom *g, int block_size, int n_blocks, char *err,
                     size_t errlen)
{
    memset(kv, 0, sizeof *kv);
    if (n_blocks < 1 || block_size < 1 || n_blocks > (1 << 30) || g->k_row < 1 ||
        g->v_row < 0 || (g->type == BE_KV_INT8 && (g->k_grp < 1 || g->k_row % g->k_grp ||
                                                  (g->v_row && (g->v_grp < 1 || g->v_row % g->v_grp)))))
        return ms_errf(err, errlen, "KV cache: bad geometry (%d blocks of %d tokens)", n_blocks,
                       block_size);
    kv->n_layer = n_layer;
    kv->k_row = g->k_row;
    kv->v_row = g->v_row;
    kv->geom = *g;
    kv->block_size = block_size;
    kv->n_blocks = n_blocks;
    kv->be = be;
    kv->lru_head = kv->lru_tail = -1;
    uint32_t n_buckets = 1;
    while (n_buckets < (uint32_t)n_blocks) n_buckets <<= 1;
    kv->bucket_mask = n_buckets - 1;
    size_t nb = (size_t)n_blocks;
    kv->layer = calloc((size_t)n_layer, sizeof *kv->layer);
    kv->free_list = malloc(sizeof(int32_t) * nb);
    kv->refcount = calloc(nb, sizeof(int32_t));
    kv->hash = calloc(nb, sizeof *kv->hash);
    kv->key = calloc(nb, sizeof *kv->key);
    kv->parent = calloc(nb, sizeof *kv->parent);
    kv->parent_gen = calloc(nb, sizeof *kv->parent_gen);
    kv->gen = calloc(nb, sizeof *kv->gen);
    kv->registered = calloc(nb, sizeof *kv->registered);
    kv->tail = calloc(nb, sizeof *kv->tail);
    kv->fill = calloc(nb, sizeof *kv->fill);
    kv->pbuckets = malloc(sizeof(int32_t) * n_buckets);
    kv->pnext = malloc(sizeof(int32_t) * nb);
    kv->tokens = malloc(sizeof(int32_t) * nb * (size_t)block_size);
    kv->buckets = malloc(sizeof(int32_t) * n_buckets);
    kv->hnext = malloc(sizeof(int32_t) * nb);
    kv->lru_prev = malloc(sizeof(int32_t) * nb);
    kv->lru_next = malloc(sizeof(int32_t) * nb);
    if (!kv->layer || !kv->free_list || !kv->refcount || !kv->hash || !kv->key ||
        !kv->parent || !kv->parent_gen || !kv->gen || !kv->registered || !kv->tokens ||
        !kv->tail || !kv->fill || !kv->pbuckets || !kv->pnext ||
        !kv->buckets || !kv->hnext || !kv->lru_prev || !kv->lru_next)
        goto oom;
    for (int l = 0; l < n_layer; l++) {
        if (no_kv && no_kv[l]) continue;
        kv->n_kv_layers++;
        if (kv_layer_alloc(be, g, n_blocks, block_size, &kv->layer[l]) != 0) goto oom;
    }
    for (uint32_t i = 0; i < n_buckets; i++) kv->buckets[i] = kv->pbuckets[i] = -1;
    for (int i = 0; i < n_blocks; i++) {
        kv->hnext[i] = kv->pnext[i] = kv->lru_prev[i] = kv->lru_next[i] = -1;
        kv->parent[i] = -1;
    }
    /* Hand out low block ids first. */
    for (int i = 0; i < n_blocks; i++) kv->free_list[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    return 0;
oom:
    kv_destroy(kv);
    return ms_errf(err, errlen, "KV cache: cannot allocate %d blocks of %d tokens (%.1f MiB)",
                   n_blocks, block_size,
                   (double)kv_geom_token_bytes(g) * n_layer * block_size * n_blocks / (1 << 20));
}

int kv_state_init(struct kv_cache *kv, int n_slots)
{
    free(kv->slot_free);
    kv->slot_free = NULL;
    kv->n_slots = kv->n_slot_free = 0;
    if (n_slots <= 0) return 0;
    kv->slot_free = malloc(sizeof(int32_t) * (size_t)n_slots);
    if (!kv->slot_free) return -1;
    for (int i = 0; i < n_slots; i++) kv->slot_free[i] = n_slots - 1 - i; /* slot 0 first */
    kv->n_slots = kv->n_slot_free = n_slots;
    return 0;
}

int kv_seq_slot(struct kv_cache *kv, struct kv_seq *s)
{
    if (s->slot >= 0) return s->slot;
    if (kv->n_slot_free == 0) return -1;
    s->slot = kv->slot_free[--kv->n_slot_free];
    s->state_pos = 0;
    return s->slot;
}

int kv_seq_spare_slot(struct kv_cache *kv, struct kv_seq *s)
{
    if (s->spare_slot >= 0) return s->spare_slot;
    if (kv->n_slot_free == 0) return -1;
    s->spare_slot = kv->slot_free[--kv->n_slot_free];
    s->spare_pos = -1;
    return s->spare_slot;
}

void kv_destroy(struct kv_cache *kv)
{
    for (int l = 0; kv->layer && l < kv->n_layer; l++) kv_layer_free(kv->be, &kv->layer[l]);
    free(kv->layer);
    free(kv->free_list);
    free(kv->refcount);
    free(kv->hash);
    free(kv->key);
    free(kv->parent);
    free(kv->parent_gen);
    free(kv->gen);
    free(kv->registered);
    free(kv->tail);
    free(kv->fill);
    free(kv->pbuckets);
    free(kv->pnext);
    free(kv->tokens);
    free(kv->buckets);
    free(kv->hnext);
    free(kv->lru_prev);
    free(kv->lru_next);
    free(kv->slot_free);
    memset(kv, 0, sizeof *kv);
}

/* --- hash table and LRU list --------------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return x;
}

uint64_t kv_block_hash(uint64_t parent_hash, uint64_t key, const int32_t *tokens, int n)
{
    uint64_t h = mix64(parent_hash ^ mix64(key + UINT64_C(0x9e3779b97f4a7c15)));
    for (int i = 0; i < n; i++)
        h = mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + ((uint64_t)i << 32)));
    return mix64(h ^ (uint64_t)n);
}

static void lru_unlink(struct kv_cache *kv, int32_t b)
{
    int32_t p = kv->lru_prev[b], n = kv->lru_next[b];
    if (p >= 0) kv->lru_next[p] = n;
    else kv->lru_head = n;
    if (n >= 0) kv->lru_prev[n] = p;
    else kv->lru_tail = p;
    kv->lru_prev[b] = kv->lru_next[b] = -1;
    kv->n_evictable--;
}

static void lru_push_tail(struct kv_cache *kv, int32_t b)
{
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = -1;
    if (kv->lru_tail >= 0) kv->lru_next[kv->lru_tail] = b;
    else kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_evictable++;
}

/* The parent index's bucket of a block continuing `parent` under `key` whose first token is
 * `first`. */
static uint32_t pindex_slot(const struct kv_cache *kv, int32_t parent, uint32_t parent_gen,
                            uint64_t key, int32_t first)
{
    uint64_t x = mix64(((uint64_t)(uint32_t)parent << 32 | parent_gen) ^ mix64(key) ^
                       ((uint64_t)(uint32_t)first * UINT64_C(0x9e3779b97f4a7c15)));
    return (uint32_t)(x & kv->bucket_mask);
}

static void pindex_add(struct kv_cache *kv, int32_t b)
{
    uint32_t slot = pindex_slot(kv, kv->parent[b], kv->parent_gen[b], kv->key[b],
                                kv->tokens[(size_t)b * kv->block_size]);
    kv->pnext[b] = kv->pbuckets[slot];
    kv->pbuckets[slot] = b;
}

static void pindex_remove(struct kv_cache *kv, int32_t b)
{
    uint32_t slot = pindex_slot(kv, kv->parent[b], kv->parent_gen[b], kv->key[b],
                                kv->tokens[(size_t)b * kv->block_size]);
    int32_t *link = &kv->pbuckets[slot];
    while (*link >= 0 && *link != b) link = &kv->pnext[*link];
    if (*link == b) *link = kv->pnext[b];
    kv->pnext[b] = -1;
}

/* Takes a cached block (registered or a tail) out of the cache's indexes. */
static void hash_remove(struct kv_cache *kv, int32_t b)
{
    pindex_remove(kv, b);
    if (kv->tail[b]) {
        kv->tail[b] = false;
        return;
    }
    int32_t *link = &kv->buckets[kv->hash[b] & kv->bucket_mask];
    while (*link >= 0 && *link != b) link = &kv->hnext[*link];
    if (*link == b) *link = kv->hnext[b];
    kv->hnext[b] = -1;
    kv->registered[b] = false;
    kv->n_registered--;
}

/* A block for a new use: a free one, else the least recently released cached one. */
static int32_t take_block(struct kv_cache *kv)
{
    if (kv->n_free > 0) return kv->free_list[--kv->n_free];
    int32_t b = kv->lru_head;
    if (b < 0) return -1;
    lru_unlink(kv, b);
    hash_remove(kv, b);
    kv->n_evictions++;
    return b;
}

static void put_block(struct kv_cache *kv, int32_t b)
{
    if (--kv->refcount[b] > 0) return;
    if (kv->registered[b] || kv->tail[b]) lru_push_tail(kv, b);
    else kv->free_list[kv->n_free++] = b;
}

/* --- sequences ----------------------------------------------------------------------------- */

int kv_seq_init(struct kv_seq *s, int max_tokens, int block_size)
{
    memset(s, 0, sizeof *s);
    s->device = -1;
    s->slot = -1;
    s->spare_slot = -1;
    s->max_blocks = (max_tokens + block_size - 1) / block_size;
    size_t n = (size_t)(s->max_blocks > 0 ? s->max_blocks : 1);
    s->blocks = malloc(sizeof(int32_t) * n);
    s->hash = malloc(sizeof(uint64_t) * n);
    if (!s->blocks || !s->hash) {
        free(s->blocks);
        free(s->hash);
        memset(s, 0, sizeof *s);
        return -1;
    }
    return 0;
}

void kv_seq_free(struct kv_cache *kv, struct kv_seq *s)
{
    if (!s->blocks) return;
    kv_seq_release(kv, s);
    free(s->blocks);
    free(s->hash);
    memset(s, 0, sizeof *s);
    s->slot = -1;
    s->spare_slot = -1;
}

int kv_seq_reserve(struct kv_cache *kv, struct kv_seq *s, int n_tokens)
{
    int need = (n_tokens + kv->block_size - 1) / kv->block_size;
    if (need > s->max_blocks) return -1;
    if (need - s->n_blocks > kv_free_blocks(kv)) return -1;
    while (s->n_blocks < need) {
        int32_t b = take_block(kv);
        kv->refcount[b] = 1;
        s->blocks[s->n_blocks++] = b;
    }
    return 0;
}

int kv_seq_drop_before(struct kv_cache *kv, struct kv_seq *s, int pos)
{
    int upto = pos > 0 ? pos / kv->block_size : 0, n = 0;
    if (upto > s->n_blocks) upto = s->n_blocks;
    for (; s->n_dropped < upto; s->n_dropped++, n++) {
        put_block(kv, s->blocks[s->n_dropped]);
        s->blocks[s->n_dropped] = -1;
    }
    return n;
}

int kv_seq_truncate(struct kv_cache *kv, struct kv_seq *s, int n_tokens)
{
    int keep = n_tokens > 0 ? (n_tokens + kv->block_size - 1) / kv->block_size : 0, n = 0;
    if (keep < s->n_dropped) keep = s->n_dropped;
    if (keep < s->n_hashed) keep = s->n_hashed; /* never a registered block (see the header) */
    while (s->n_blocks > keep) {
        put_block(kv, s->blocks[--s->n_blocks]);
        n++;
    }
    return n;
}

void kv_seq_release(struct kv_cache *kv, struct kv_seq *s)
{
    for (int i = s->n_blocks - 1; i >= s->n_dropped; i--) put_block(kv, s->blocks[i]);
    s->n_blocks = 0;
    s->n_dropped = 0;
    s->n_hashed = 0;
    s->reg_stop = false;
    if (s->blocks && s->slot >= 0 && kv->slot_free && kv->n_slot_free < kv->n_slots)
        kv->slot_free[kv->n_slot_free++] = s->slot;
    if (s->blocks && s->spare_slot >= 0 && kv->slot_free && kv->n_slot_free < kv->n_slots)
        kv->slot_free[kv->n_slot_free++] = s->spare_slot;
    s->slot = -1;
    s->spare_slot = -1;
    s->state_pos = 0;
}

int kv_free_blocks(const struct kv_cache *kv)
{
    return kv->n_free + kv->n_evictable;
}

int kv_cached_blocks(const struct kv_cache *kv)
{
    return kv->n_evictable;
}

/* --- prefix caching ------------------------------------------------------------------------ */

int32_t kv_prefix_lookup(const struct kv_cache *kv, int32_t parent, uint64_t key, uint64_t h,
                         const int32_t *tokens)
{
    size_t bs = (size_t)kv->block_size;
    for (int32_t b = kv->buckets[h & kv->bucket_mask]; b >= 0; b = kv->hnext[b]) {
        if (kv->hash[b] != h || kv->key[b] != key || kv->parent[b] != parent) continue;
        if (parent >= 0 && kv->parent_gen[b] != kv->gen[parent]) continue;
        if (memcmp(kv->tokens + (size_t)b * bs, tokens, sizeof(int32_t) * bs) != 0) continue;
        return b;
    }
    return -1;
}

/* The longest run of cached blocks matching tokens[0, max_blocks*block_size): their count,
 * and, with s, each block and chain hash written into s's table (nothing taken yet). */
static int prefix_walk(const struct kv_cache *kv, uint64_t key, const int32_t *tokens,
                       int max_blocks, struct kv_seq *s)
{
    int bs = kv->block_size;
    uint64_t h = KV_HASH_ROOT;
    int32_t parent = -1;
    int n = 0;
    while (n < max_blocks) {
        const int32_t *t = tokens + (size_t)n * bs;
        h = kv_block_hash(h, key, t, bs);
        int32_t b = kv_prefix_lookup(kv, parent, key, h, t);
        if (b < 0) break;
        if (s) {
            s->blocks[n] = b;
            s->hash[n] = h;
        }
        parent = b;
        n++;
    }
    return n;
}

int kv_seq_match(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                 int max_blocks)
{
    if (s->n_blocks != 0) return 0;
    if (max_blocks > s->max_blocks) max_blocks = s->max_blocks;
    int n = prefix_walk(kv, key, tokens, max_blocks, s);
    for (int i = 0; i < n; i++)
        if (kv->refcount[s->blocks[i]]++ == 0) lru_unlink(kv, s->blocks[i]);
    s->n_blocks = n;
    s->n_hashed = n;
    s->reg_stop = false;
    return n;
}

int kv_prefix_count(const struct kv_cache *kv, uint64_t key, const int32_t *tokens, int max_blocks)
{
    return prefix_walk(kv, key, tokens, max_blocks, NULL);
}

void kv_seq_register(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                     int n_computed)
{
    int bs = kv->block_size;
    int full = n_computed / bs;
    if (full > s->n_blocks) full = s->n_blocks;
    while (!s->reg_stop && s->n_hashed < full) {
        int i = s->n_hashed;
        int32_t b = s->blocks[i];
        if (b < 0 || (i > 0 && s->blocks[i - 1] < 0)) { /* dropped: the chain ends here */
            s->reg_stop = true;
            break;
        }
        int32_t parent = i > 0 ? s->blocks[i - 1] : -1;
        const int32_t *t = tokens + (size_t)i * bs;
        uint64_t h = kv_block_hash(i > 0 ? s->hash[i - 1] : KV_HASH_ROOT, key, t, bs);
        if (!kv->registered[b]) {
            if (kv_prefix_lookup(kv, parent, key, h, t) >= 0) {
                /* Another sequence computed the same block first: keep ours private; its
                 * successors could never be found (their parent is unregistered). */
                s->reg_stop = true;
                break;
            }
            kv->hash[b] = h;
            kv->key[b] = key;
            kv->parent[b] = parent;
            kv->parent_gen[b] = parent >= 0 ? kv->gen[parent] : 0;
            kv->gen[b]++;
            memcpy(kv->tokens + (size_t)b * bs, t, sizeof(int32_t) * (size_t)bs);
            uint32_t slot = (uint32_t)(h & kv->bucket_mask);
            kv->hnext[b] = kv->buckets[slot];
            kv->buckets[slot] = b;
            kv->registered[b] = true;
            kv->n_registered++;
            kv->fill[b] = bs;
            pindex_add(kv, b);
        }
        s->hash[i] = h;
        s->n_hashed++;
    }
}

int kv_seq_match_tail(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                      int max_tokens)
{
    int bs = kv->block_size, i = s->n_blocks, base = i * bs;
    if (i >= s->max_blocks || base >= max_tokens || s->n_dropped > 0) return 0;
    int32_t parent = i > 0 ? s->blocks[i - 1] : -1;
    uint32_t pgen = parent >= 0 ? kv->gen[parent] : 0;
    int room = max_tokens - base < bs ? max_tokens - base : bs, best = 0;
    int32_t pick = -1;
    for (int32_t b = kv->pbuckets[pindex_slot(kv, parent, pgen, key, tokens[base])]; b >= 0;
         b = kv->pnext[b]) {
        if (kv->refcount[b] != 0 || kv->parent[b] != parent || kv->key[b] != key ||
            (parent >= 0 && kv->parent_gen[b] != pgen))
            continue;
        const int32_t *t = kv->tokens + (size_t)b * bs;
        int n = 0, lim = kv->fill[b] < room ? kv->fill[b] : room;
        while (n < lim && t[n] == tokens[base + n]) n++;
        if (n > best) {
            best = n;
            pick = b;
        }
    }
    if (pick < 0) return 0;
    lru_unlink(kv, pick); /* refcount 0: it was evictable */
    hash_remove(kv, pick);
    kv->refcount[pick] = 1;
    s->blocks[s->n_blocks++] = pick;
    return best;
}

void kv_seq_keep_tail(struct kv_cache *kv, struct kv_seq *s, uint64_t key, const int32_t *tokens,
                      int n_computed)
{
    int bs = kv->block_size, i = n_computed / bs, m = n_computed % bs;
    if (m == 0 || i >= s->n_blocks || i < s->n_dropped) return;
    int32_t b = s->blocks[i], parent = i > 0 ? s->blocks[i - 1] : -1;
    if (kv->registered[b] || kv->tail[b] || kv->refcount[b] != 1) return;
    if (parent >= 0 && !kv->registered[parent]) return; /* nothing could reach it */
    kv->key[b] = key;
    kv->parent[b] = parent;
    kv->parent_gen[b] = parent >= 0 ? kv->gen[parent] : 0;
    kv->gen[b]++;
    kv->fill[b] = m;
    memcpy(kv->tokens + (size_t)b * bs, tokens + (size_t)i * bs, sizeof(int32_t) * (size_t)m);
    kv->tail[b] = true;
    pindex_add(kv, b);
}

int kv_prefix_reset(struct kv_cache *kv)
{
    int n = 0;
    while (kv->lru_head >= 0) {
        int32_t b = kv->lru_head;
        lru_unlink(kv, b);
        hash_remove(kv, b);
        kv->free_list[kv->n_free++] = b;
        n++;
    }
    return n;
}
