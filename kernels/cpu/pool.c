/* Thread pool: one job at a time, tasks handed out one by one, workers that spin briefly and
 * then sleep on a futex (the job generation). See pool.h.
 *
 * Protocol: `gen` is even when a job is published and odd while the caller rewrites it (a
 * sequence lock): a worker copies fn/ctx/n_tasks between two reads of `gen` and keeps the copy
 * only if both read the same even value. Tasks are claimed from `ticket`, which holds the job's
 * number next to the next task index, with a compare-and-swap: a worker holding a stale copy
 * finds another job number and claims nothing, so the caller never waits for slow or
 * descheduled workers before starting a job, only for the tasks they claimed. `done` counts
 * finished tasks of the current job; the caller returns when all are done. */
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

#define cpu_relax() POOL_RELAX()

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

    _Atomic uint32_t gen;   /* futex word; even: published */
    _Atomic int sleepers;
    _Atomic int quit;
    /* the job, written while gen is odd */
    _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int n_tasks;
    _Atomic uint64_t ticket; /* (job number << 32) | next task */
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

/* Claims and runs tasks of job `job` until none is left or the job is another one. */
static void run_tasks(struct pool *p, uint32_t job, pool_fn fn, void *ctx, int n_tasks,
                      int thread)
{
    uint64_t t = atomic_load_explicit(&p->ticket, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(t >> 32) != job || (int)(uint32_t)t >= n_tasks) return;
        if (!atomic_compare_exchange_weak_explicit(&p->ticket, &t, t + 1, memory_order_acquire,
                                                   memory_order_relaxed))
            continue; /* t reloaded */
        fn(ctx, (int)(uint32_t)t, thread);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        t = atomic_load_explicit(&p->ticket, memory_order_relaxed);
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
        pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
        int n_tasks = atomic_load_explicit(&p->n_tasks, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&p->gen, memory_order_relaxed) != g) continue; /* rewritten */
        run_tasks(p, g / 2, fn, ctx, n_tasks, w->id);
        seen = g;
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
    atomic_store_explicit(&p->gen, g + 1, memory_order_relaxed); /* odd: being rewritten */
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint32_t job = (g + 2) / 2;
    atomic_store_explicit(&p->ticket, (uint64_t)job << 32, memory_order_relaxed);
    atomic_store(&p->gen, g + 2);
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->gen);
    run_tasks(p, job, fn, ctx, n_tasks, 0);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks) cpu_relax();
}
