/* The Responses API's store: responses kept for GET /v1/responses/{id} and for a later
 * request's previous_response_id, in memory, bounded in entries and bytes (the oldest go first
 * past either bound) and expiring ttl seconds after they were last written. Each entry holds the
 * response object (JSON) and, once it finished, its conversation as chat messages (what a
 * follow-up continues). A running response also holds a cancel hook, so that
 * POST /v1/responses/{id}/cancel from another connection can stop it.
 *
 * One store per server: under several processes (mpirun, --nnodes) only rank 0 serves HTTP, so
 * every request meets the same store; it does not survive a restart.
 *
 * Threads: every function may be called from any thread (one mutex, held for copies only; a
 * cancel hook runs under it and must not call back into the store). Ownership: strings passed
 * in are copied; strings returned are malloc'd copies for the caller. */
#ifndef MOESERVE_RSTORE_H
#define MOESERVE_RSTORE_H

#include <stdbool.h>
#include <stddef.h>

struct rstore;

/* max_entries 0: nothing is ever stored (every lookup misses). */
struct rstore *rstore_create(int max_entries, size_t max_bytes, double ttl_s);
void rstore_free(struct rstore *s);

/* Inserts or replaces the entry of id (conv may be NULL: not finished). An entry larger than
 * max_bytes is not kept. Keeps the cancel hook of an entry it replaces. 0, or -1 when it was
 * not kept. */
int rstore_put(struct rstore *s, const char *id, const char *response, const char *conv);
/* Copies of the response object / the conversation; NULL when unknown, expired or (conv) not
 * finished. */
char *rstore_response(struct rstore *s, const char *id);
char *rstore_conv(struct rstore *s, const char *id);
bool rstore_delete(struct rstore *s, const char *id);

/* A running response's cancel hook (set after rstore_put, cleared before its owner goes). */
void rstore_set_cancel(struct rstore *s, const char *id, void (*fn)(void *ctx), void *ctx);
void rstore_clear_cancel(struct rstore *s, const char *id);
/* Calls id's cancel hook: 0 when called, 1 when the response is not running, -1 when it is not
 * stored. */
int rstore_cancel(struct rstore *s, const char *id);
int rstore_count(struct rstore *s); /* entries held now (tests, logs) */

#endif
