/* Paged KV cache: block pool with reference counts and per-sequence block tables. */
#include "kv_cache.h"

#include <stdlib.h>

#include "common.h"

size_t kv_block_bytes(int n_layer, int n_kv_head, int head_dim, int block_size)
{
    return 2 * (size_t)n_layer * block_size * n_kv_head * head_dim * sizeof(float);
}

int kv_create(struct kv_cache *kv, struct backend *be, int n_layer, int n_kv_head, int head_dim,
              int block_size, int n_blocks, char *err, size_t errlen)
{
    memset(kv, 0, sizeof *kv);
    kv->n_layer = n_layer;
    kv->n_kv_head = n_kv_head;
    kv->head_dim = head_dim;
    kv->block_size = block_size;
    kv->n_blocks = n_blocks;
    kv->be = be;
    size_t per_layer = (size_t)n_blocks * block_size * n_kv_head * head_dim * sizeof(float);
    kv->k = calloc((size_t)n_layer, sizeof *kv->k);
    kv->v = calloc((size_t)n_layer, sizeof *kv->v);
    kv->free_list = malloc(sizeof(int32_t) * (size_t)n_blocks);
    kv->refcount = calloc((size_t)n_blocks, sizeof(int32_t));
    if (!kv->k || !kv->v || !kv->free_list || !kv->refcount) goto oom;
    for (int l = 0; l < n_layer; l++) {
        kv->k[l] = be->ops->alloc(be, per_layer);
        kv->v[l] = be->ops->alloc(be, per_layer);
        if (!kv->k[l] || !kv->v[l]) goto oom;
    }
    /* Hand out low block ids first. */
    for (int i = 0; i < n_blocks; i++) kv->free_list[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    return 0;
oom:
    kv_destroy(kv);
    return ms_errf(err, errlen, "KV cache: cannot allocate %d blocks of %d tokens (%.1f MiB)",
                   n_blocks, block_size,
                   (double)kv_block_bytes(n_layer, n_kv_head, head_dim, block_size) * n_blocks /
                       (1 << 20));
}

void kv_destroy(struct kv_cache *kv)
{
    if (kv->k || kv->v) {
        for (int l = 0; l < kv->n_layer; l++) {
            if (kv->k && kv->k[l]) kv->be->ops->free(kv->be, kv->k[l]);
            if (kv->v && kv->v[l]) kv->be->ops->free(kv->be, kv->v[l]);
        }
    }
    free(kv->k);
    free(kv->v);
    free(kv->free_list);
    free(kv->refcount);
    memset(kv, 0, sizeof *kv);
}

int kv_seq_init(struct kv_seq *s, int max_tokens, int block_size)
{
    s->max_blocks = (max_tokens + block_size - 1) / block_size;
    s->n_blocks = 0;
    s->blocks = malloc(sizeof(int32_t) * (size_t)(s->max_blocks > 0 ? s->max_blocks : 1));
    return s->blocks ? 0 : -1;
}

void kv_seq_free(struct kv_cache *kv, struct kv_seq *s)
{
    if (!s->blocks) return;
    kv_seq_release(kv, s);
    free(s->blocks);
    s->blocks = NULL;
    s->max_blocks = 0;
}

int kv_seq_reserve(struct kv_cache *kv, struct kv_seq *s, int n_tokens)
{
    int need = (n_tokens + kv->block_size - 1) / kv->block_size;
    if (need > s->max_blocks) return -1;
    if (need - s->n_blocks > kv->n_free) return -1;
    while (s->n_blocks < need) {
        int32_t b = kv->free_list[--kv->n_free];
        kv->refcount[b] = 1;
        s->blocks[s->n_blocks++] = b;
    }
    return 0;
}

void kv_seq_release(struct kv_cache *kv, struct kv_seq *s)
{
    for (int i = s->n_blocks - 1; i >= 0; i--) {
        int32_t b = s->blocks[i];
        if (--kv->refcount[b] == 0) kv->free_list[kv->n_free++] = b;
    }
    s->n_blocks = 0;
}

int kv_free_blocks(const struct kv_cache *kv)
{
    return kv->n_free;
}
