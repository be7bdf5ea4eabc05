/* Thread pool of the CPU backend: n - 1 persistent worker threads plus the calling thread run
 * the tasks of one job at a time. Tasks are handed out one by one from a shared counter, so a
 * slow core (one also serving HTTP) takes fewer. Between jobs the workers spin for a short
 * while (a decode step issues a job every few microseconds) and then sleep on a futex, so an
 * idle server does not burn its cores. No allocation after pool_create.
 *
 * Ownership: pool_create returns a pool freed with pool_free (joins the workers). pool_run is
 * called by one thread at a time (the backend's device thread) and returns when every task has
 * finished. */
#ifndef MOESERVE_CPU_POOL_H
#define MOESERVE_CPU_POOL_H

struct pool;

/* fn(ctx, task, thread): task in [0, n_tasks), thread in [0, pool_size) (0 is the caller), so
 * tasks can use per-thread scratch. */
typedef void (*pool_fn)(void *ctx, int task, int thread);

/* n_threads >= 1 (1: no workers, pool_run runs everything on the caller). NULL when threads
 * cannot be started. spin_us: how long idle workers spin before sleeping (<0: the default,
 * MOESERVE_SPIN_US or 200). */
struct pool *pool_create(int n_threads, int spin_us);
void pool_free(struct pool *p);
int pool_size(const struct pool *p);
void pool_run(struct pool *p, pool_fn fn, void *ctx, int n_tasks);

/* The pause of a spin-wait loop. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_RELAX() _mm_pause()
#else
#define POOL_RELAX() ((void)0)
#endif

#endif
