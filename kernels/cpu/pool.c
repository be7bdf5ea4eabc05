/* Thread pool: one job at a time, tasks taken from an atomic counter, workers that spin briefly
 * and then sleep on a futex (the job generation). See pool.h.
 *
 * Protocol (a sequence lock on the job): `gen` is even when a job is published and odd while
 * the caller rewrites it. The caller makes it odd, waits until no worker is `active`, writes
 * fn/ctx/n_tasks, and makes it even again. A worker that sees a new even generation announces
 * itself in `active` and re-reads `gen`: if it changed, the worker is stale and leaves;
 * otherwise the caller cannot rewrite the job until the worker leaves. `done` counts finished
 * tasks; the caller returns when all are done (a worker that finds no task left touches
 * nothing of the job). */
#include "pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

struct worker {
    struct pool *p;
    int id;
};

struct pool {
    int n;
    pthread_t *threads;
    struct worker *workers;
    int started;
    long spin_ns;

    _Atomic uint32_t gen;   /* futex word */
    _Atomic int sleepers;
    _Atomic int active;
    _Atomic int quit;
    /* the job: written by the caller before gen moves, read by workers after */
    pool_fn fn;
    void *ctx;
    int n_tasks;
    _Atomic int next;
    _Atomic int done;
};

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void run_tasks(struct pool *p, pool_fn fn, void *ctx, int n_tasks, int thread)
{
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= n_tasks) break;
        fn(ctx, t, thread);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

/* Waits for a published generation (even) other than seen: spins for spin_ns, then sleeps. */
static uint32_t wait_job(struct pool *p, uint32_t seen)
{
    long t0 = now_ns();
    unsigned spins = 0;
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if ((g != seen && g % 2 == 0) || atomic_load(&p->quit)) return g;
        if (g % 2 == 1 || ++spins % 64 != 0 || now_ns() - t0 < p->spin_ns) {
            cpu_relax();
            continue;
        }
        atomic_fetch_add(&p->sleepers, 1);
        if (atomic_load(&p->gen) == g && !atomic_load(&p->quit)) futex_wait(&p->gen, g);
        atomic_fetch_sub(&p->sleepers, 1);
        t0 = now_ns();
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct pool *p = w->p;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = wait_job(p, seen);
        if (atomic_load(&p->quit)) break;
        atomic_fetch_add(&p->active, 1);
        if (atomic_load(&p->gen) == g) {
            run_tasks(p, p->fn, p->ctx, p->n_tasks, w->id);
            seen = g;
        }
        atomic_fetch_sub_explicit(&p->active, 1, memory_order_release);
    }
    return NULL;
}

struct pool *pool_create(int n_threads, int spin_us)
{
    struct pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads < 1 ? 1 : n_threads;
    if (spin_us < 0) {
        const char *env = getenv("MOESERVE_SPIN_US");
        spin_us = env && *env ? atoi(env) : 200;
        if (spin_us < 0) spin_us = 0;
    }
    p->spin_ns = (long)spin_us * 1000L;
    if (p->n == 1) return p;
    p->threads = calloc((size_t)p->n, sizeof *p->threads);
    p->workers = calloc((size_t)p->n, sizeof *p->workers);
    if (!p->threads || !p->workers) goto fail;
    for (int i = 1; i < p->n; i++) {
        p->workers[i] = (struct worker){p, i};
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) goto fail;
        p->started++;
        char name[32]; /* the kernel keeps 15 bytes of it */
        snprintf(name, sizeof name, "moeserve-cpu%d", i % 100);
        name[15] = '\0';
        pthread_setname_np(p->threads[i], name);
    }
    return p;
fail:
    pool_free(p);
    return NULL;
}

void pool_free(struct pool *p)
{
    if (!p) return;
    atomic_store(&p->quit, 1);
    atomic_fetch_add(&p->gen, 2);
    futex_wake_all(&p->gen);
    for (int i = 1; i <= p->started; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p->workers);
    free(p);
}

int pool_size(const struct pool *p)
{
    return p->n;
}

void pool_run(struct pool *p, pool_fn fn, void *ctx, int n_tasks)
{
    if (n_tasks <= 0) return;
    if (p->n == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    uint32_t g = atomic_load_explicit(&p->gen, memory_order_relaxed);
    atomic_store(&p->gen, g + 1); /* odd: the job is being rewritten */
    while (atomic_load(&p->active) != 0) cpu_relax();
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store(&p->gen, g + 2);
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
    run_tasks(p, fn, ctx, n_tasks, 0);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks) cpu_relax();
}
