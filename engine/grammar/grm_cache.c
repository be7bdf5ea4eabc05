/* The compiled-grammar cache (grm_cache.h): a small array of entries searched by a 64-bit
 * hash of (kind, text) and confirmed by comparing the text, evicted least recently used. A
 * few dozen entries make a linear scan cheaper than any index. */
#include "grm_cache.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

struct entry {
    uint64_t hash;
    enum grm_kind kind;
    char *text;
    size_t text_len;
    uint64_t used;             /* the tick of its last lookup (0: slot empty) */
    struct grm_grammar *g;     /* NULL for a cached failure */
    int rc;                    /* the compile's return */
    char err[MS_ERR_LEN], kw[64];
};

struct grm_cache {
    const struct grm_vocab *v;
    pthread_mutex_t mu;
    struct entry *e; /* (max_entries) */
    size_t max_entries, max_bytes, bytes;
    uint64_t tick;
    unsigned long long hits, misses;
};

static uint64_t key_hash(enum grm_kind kind, const char *text, size_t n)
{
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)kind; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)text[i];
        h *= 1099511628211ULL;
    }
    return h;
}

struct grm_cache *grm_cache_create(const struct grm_vocab *v, size_t max_entries,
                                   size_t max_bytes)
{
    struct grm_cache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (max_entries < 1) max_entries = 1;
    c->e = calloc(max_entries, sizeof *c->e);
    if (!c->e) {
        free(c);
        return NULL;
    }
    c->v = v;
    c->max_entries = max_entries;
    c->max_bytes = max_bytes;
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

static void drop(struct grm_cache *c, struct entry *e)
{
    if (!e->used) return;
    grm_release(e->g);
    c->bytes -= e->text_len;
    free(e->text);
    memset(e, 0, sizeof *e);
}

void grm_cache_free(struct grm_cache *c)
{
    if (!c) return;
    for (size_t i = 0; i < c->max_entries; i++) drop(c, &c->e[i]);
    pthread_mutex_destroy(&c->mu);
    free(c->e);
    free(c);
}

static void answer(const struct entry *e, struct grm_grammar **out, char *err, size_t errlen,
                   char *kw, size_t kwlen)
{
    *out = e->g;
    if (e->g) grm_retain(e->g);
    if (e->rc != 0) {
        if (err && errlen) snprintf(err, errlen, "%s", e->err);
        if (kw && kwlen) snprintf(kw, kwlen, "%s", e->kw);
    }
}

/* The least recently used slot (an empty one first), dropping entries until `need` more key
 * bytes fit. Under c->mu. */
static struct entry *make_room(struct grm_cache *c, size_t need)
{
    for (;;) {
        struct entry *victim = NULL;
        for (size_t i = 0; i < c->max_entries; i++) {
            struct entry *e = &c->e[i];
            if (!e->used) {
                if (c->bytes + need <= c->max_bytes) return e;
                continue;
            }
            if (!victim || e->used < victim->used) victim = e;
        }
        if (!victim) return NULL; /* empty and still too big: not kept */
        drop(c, victim);
    }
}

int grm_cache_compile(struct grm_cache *c, enum grm_kind kind, const char *text,
                      const struct grm_limits *lim, struct grm_grammar **out, char *err,
                      size_t errlen, char *bad_keyword, size_t kwlen)
{
    *out = NULL;
    if (bad_keyword && kwlen) bad_keyword[0] = '\0';
    size_t n = strlen(text);
    uint64_t h = key_hash(kind, text, n);
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->max_entries; i++) {
        struct entry *e = &c->e[i];
        if (e->used && e->hash == h && e->kind == kind && e->text_len == n &&
            memcmp(e->text, text, n) == 0) {
            e->used = ++c->tick;
            c->hits++;
            int rc = e->rc;
            answer(e, out, err, errlen, bad_keyword, kwlen);
            pthread_mutex_unlock(&c->mu);
            return rc;
        }
    }
    c->misses++;
    pthread_mutex_unlock(&c->mu);

    struct entry fresh = {.hash = h, .kind = kind, .text_len = n};
    fresh.rc = grm_compile_limited(kind, text, c->v, lim, &fresh.g, fresh.err, sizeof fresh.err,
                                   fresh.kw, sizeof fresh.kw);
    if (fresh.rc != 0) fresh.g = NULL;
    answer(&fresh, out, err, errlen, bad_keyword, kwlen);
    int rc = fresh.rc;

    fresh.text = malloc(n + 1);
    if (!fresh.text) { /* not kept: the answer stands */
        grm_release(fresh.g);
        return rc;
    }
    memcpy(fresh.text, text, n + 1);
    pthread_mutex_lock(&c->mu);
    struct entry *slot = n <= c->max_bytes ? make_room(c, n) : NULL;
    if (slot) {
        fresh.used = ++c->tick;
        *slot = fresh;
        c->bytes += n;
    }
    pthread_mutex_unlock(&c->mu);
    if (!slot) {
        free(fresh.text);
        grm_release(fresh.g);
    }
    return rc;
}

void grm_cache_counts(struct grm_cache *c, unsigned long long *hits, unsigned long long *misses)
{
    pthread_mutex_lock(&c->mu);
    *hits = c->hits;
    *misses = c->misses;
    pthread_mutex_unlock(&c->mu);
}
