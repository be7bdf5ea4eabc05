/* The preparation pool: a few worker threads that turn a generation request's body into
 * scheduler requests (JSON parsing, the chat template, tokenization, grammar compilation), so
 * that this work, whose cost the client chooses, never runs on an HTTP I/O thread: while one
 * client's 300 KB JSON Schema compiles, every other connection's bytes keep flowing. Jobs run
 * in submission order on whichever worker is free; a job may take as long as its own limits
 * allow (the grammar compile budget bounds the longest).
 *
 * Ownership: the pool owns its threads; a job's context belongs to the job, whose function
 * must release it. prep_stop runs the jobs still queued (so each context is released exactly
 * once), then joins the threads. */
#ifndef MOESERVE_PREP_H
#define MOESERVE_PREP_H

#include <stddef.h>

struct prep_pool;

typedef void (*prep_fn)(void *ctx);

/* Starts `threads` workers. Returns 0, or -1 with a reason in err (nothing left running). */
int prep_start(int threads, struct prep_pool **out, char *err, size_t errlen);
/* Queues fn(ctx). Returns 0, or -1 when out of memory or stopping (fn not called: the caller
 * still owns ctx). Any thread. */
int prep_submit(struct prep_pool *p, prep_fn fn, void *ctx);
/* Jobs queued or running now (a gauge for tests and metrics). */
int prep_backlog(struct prep_pool *p);
void prep_stop(struct prep_pool *p);

#endif
