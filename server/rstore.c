/* The Responses store (see rstore.h): a list in write order, searched linearly (a few thousand
 * entries at most, each lookup a string compare per entry), trimmed from its old end. */
#include "rstore.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

struct entry {
    struct entry *prev, *next; /* prev: newer, next: older */
    char *id, *response, *conv;
    size_t bytes;
    double written; /* ms_now() of the last put */
    void (*cancel)(void *ctx);
    void *cancel_ctx;
};

struct rstore {
    pthread_mutex_t mu;
    struct entry *newest, *oldest;
    int n, max_entries;
    size_t bytes, max_bytes;
    double ttl_s;
};

struct rstore *rstore_create(int max_entries, size_t max_bytes, double ttl_s)
{
    struct rstore *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    s->max_entries = max_entries;
    s->max_bytes = max_bytes;
    s->ttl_s = ttl_s;
    return s;
}

static void unlink_entry(struct rstore *s, struct entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        s->newest = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        s->oldest = e->prev;
    s->n--;
    s->bytes -= e->bytes;
}

static void entry_free(struct entry *e)
{
    free(e->id);
    free(e->response);
    free(e->conv);
    free(e);
}

void rstore_free(struct rstore *s)
{
    if (!s) return;
    for (struct entry *e = s->newest, *nx; e; e = nx) {
        nx = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Drops expired entries and, past the bounds, the oldest ones (never a running one: its owner
 * still holds the hook). Under mu. */
static void trim(struct rstore *s)
{
    double now = ms_now();
    for (struct entry *e = s->oldest, *pv; e; e = pv) {
        pv = e->prev;
        bool expired = s->ttl_s > 0 && now - e->written > s->ttl_s;
        bool over = s->n > s->max_entries || s->bytes > s->max_bytes;
        if (e->cancel || (!expired && !over)) continue;
        unlink_entry(s, e);
        entry_free(e);
    }
}

static struct entry *find(struct rstore *s, const char *id)
{
    trim(s);
    for (struct entry *e = s->newest; e; e = e->next)
        if (strcmp(e->id, id) == 0) return e;
    return NULL;
}

int rstore_put(struct rstore *s, const char *id, const char *response, const char *conv)
{
    size_t bytes = strlen(id) + strlen(response) + (conv ? strlen(conv) : 0) + sizeof(struct entry);
    if (!s || s->max_entries <= 0 || bytes > s->max_bytes) return -1;
    struct entry *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->id = strdup(id);
    e->response = strdup(response);
    e->conv = conv ? strdup(conv) : NULL;
    if (!e->id || !e->response || (conv && !e->conv)) {
        entry_free(e);
        return -1;
    }
    e->bytes = bytes;
    e->written = ms_now();
    pthread_mutex_lock(&s->mu);
    struct entry *old = find(s, id);
    if (old) {
        e->cancel = old->cancel;
        e->cancel_ctx = old->cancel_ctx;
        unlink_entry(s, old);
        entry_free(old);
    }
    e->next = s->newest;
    if (s->newest)
        s->newest->prev = e;
    else
        s->oldest = e;
    s->newest = e;
    s->n++;
    s->bytes += e->bytes;
    trim(s);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static char *copy_field(struct rstore *s, const char *id, bool conv)
{
    if (!s) return NULL;
    pthread_mutex_lock(&s->mu);
    struct entry *e = find(s, id);
    const char *v = e ? (conv ? e->conv : e->response) : NULL;
    char *out = v ? strdup(v) : NULL;
    pthread_mutex_unlock(&s->mu);
    return out;
}

char *rstore_response(struct rstore *s, const char *id)
{
    return copy_field(s, id, false);
}

char *rstore_conv(struct rstore *s, const char *id)
{
    return copy_field(s, id, true);
}

bool rstore_delete(struct rstore *s, const char *id)
{
    if (!s) return false;
    pthread_mutex_lock(&s->mu);
    struct entry *e = find(s, id);
    bool found = e && !e->cancel; /* a running response is deleted once it is over */
    if (found) {
        unlink_entry(s, e);
        entry_free(e);
    }
    pthread_mutex_unlock(&s->mu);
    return found;
}

void rstore_set_cancel(struct rstore *s, const char *id, void (*fn)(void *ctx), void *ctx)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    struct entry *e = find(s, id);
    if (e) {
        e->cancel = fn;
        e->cancel_ctx = ctx;
    }
    pthread_mutex_unlock(&s->mu);
}

void rstore_clear_cancel(struct rstore *s, const char *id)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    for (struct entry *e = s->newest; e; e = e->next) /* no trim: the entry must be found */
        if (strcmp(e->id, id) == 0) e->cancel = NULL, e->cancel_ctx = NULL;
    pthread_mutex_unlock(&s->mu);
}

int rstore_cancel(struct rstore *s, const char *id)
{
    if (!s) return -1;
    pthread_mutex_lock(&s->mu);
    struct entry *e = find(s, id);
    int rc = !e ? -1 : e->cancel ? 0 : 1;
    if (rc == 0) e->cancel(e->cancel_ctx);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int rstore_count(struct rstore *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->n;
    pthread_mutex_unlock(&s->mu);
    return n;
}
