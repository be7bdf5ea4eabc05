/* Reservoir sample of served tokens' cross-layer routing (collab_live.h). */
#include "collab/collab_live.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "rng.h"

struct clive {
    int n_layer, n_expert, top_k, cap, width;
    pthread_mutex_t mu;
    struct ms_rng rng;
    uint64_t seen;
    size_t n;
    int32_t *rows;  /* (cap, width) */
    uint16_t *tags; /* (cap) */
};

int clive_create(int n_layer, int n_expert, int top_k, int capacity, uint64_t seed,
                 struct clive **out, char *err, size_t errlen)
{
    *out = NULL;
    if (n_layer < 1 || n_expert < 1 || top_k < 1 || capacity < 1 || capacity > (1 << 24))
        return ms_errf(err, errlen, "collab capture: bad shape or capacity %d", capacity);
    struct clive *c = calloc(1, sizeof *c);
    if (!c) return ms_errf(err, errlen, "out of memory");
    c->n_layer = n_layer;
    c->n_expert = n_expert;
    c->top_k = top_k;
    c->cap = capacity;
    c->width = n_layer * top_k;
    c->rows = malloc(sizeof(int32_t) * (size_t)capacity * c->width);
    c->tags = malloc(sizeof(uint16_t) * (size_t)capacity);
    if (!c->rows || !c->tags) {
        free(c->rows);
        free(c->tags);
        free(c);
        return ms_errf(err, errlen, "out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    ms_rng_seed(&c->rng, seed);
    *out = c;
    return 0;
}

void clive_free(struct clive *c)
{
    if (!c) return;
    pthread_mutex_destroy(&c->mu);
    free(c->rows);
    free(c->tags);
    free(c);
}

void clive_add(struct clive *c, const int32_t *ids, const uint16_t *tags, int n_tok,
               size_t layer_stride)
{
    size_t stride = layer_stride ? layer_stride : (size_t)n_tok * c->top_k;
    pthread_mutex_lock(&c->mu);
    for (int t = 0; t < n_tok; t++) {
        uint64_t i = c->seen++;
        size_t slot;
        if (i < (uint64_t)c->cap) {
            slot = (size_t)i;
            c->n = slot + 1;
        } else {
            uint64_t j = ms_rng_next(&c->rng) % (i + 1);
            if (j >= (uint64_t)c->cap) continue;
            slot = (size_t)j;
        }
        int32_t *row = c->rows + slot * c->width;
        c->tags[slot] = tags ? tags[t] : 0;
        for (int l = 0; l < c->n_layer; l++)
            for (int k = 0; k < c->top_k; k++) {
                int32_t x = ids[(size_t)l * stride + (size_t)t * c->top_k + k];
                row[l * c->top_k + k] = x >= 0 && x < c->n_expert ? l * c->n_expert + x : -1;
            }
    }
    pthread_mutex_unlock(&c->mu);
}

size_t clive_snapshot(struct clive *c, int32_t *rows, uint16_t *tags, uint64_t *seen)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->n;
    memcpy(rows, c->rows, sizeof(int32_t) * n * c->width);
    if (tags) memcpy(tags, c->tags, sizeof(uint16_t) * n);
    if (seen) *seen = c->seen;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int clive_capacity(const struct clive *c)
{
    return c->cap;
}

int clive_row_width(const struct clive *c)
{
    return c->width;
}
