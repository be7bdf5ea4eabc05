/* The preparation pool (prep.h): a mutex-guarded FIFO of jobs and a condition variable the
 * workers sleep on. Jobs are few per second and each is long next to a lock hand-off, so one
 * lock is all the pool needs. The workers run at a lower priority than the I/O threads. */
#include "prep.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

/* The nice increment of the workers. */
#define PREP_NICE 10

struct prep_job {
    prep_fn fn;
    void *ctx;
    struct prep_job *next;
};

struct prep_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct prep_job *head, *tail;
    int backlog; /* queued + running */
    bool stopping;
    int n_threads;
    pthread_t *threads;
};

static void *worker(void *arg)
{
    struct prep_pool *p = arg;
    /* Below the I/O threads: when preparations saturate the CPUs, bytes of other connections
     * still go first (on Linux a nice value is per thread). A failure leaves it as it was. */
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), PREP_NICE) != 0) {
        /* not fatal: the pool works at the process's priority */
    }
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stopping) pthread_cond_wait(&p->cv, &p->mu);
        struct prep_job *j = p->head;
        if (!j) break; /* stopping and drained */
        p->head = j->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        j->fn(j->ctx);
        free(j);
        pthread_mutex_lock(&p->mu);
        p->backlog--;
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int prep_start(int threads, struct prep_pool **out, char *err, size_t errlen)
{
    *out = NULL;
    if (threads < 1) threads = 1;
    struct prep_pool *p = calloc(1, sizeof *p);
    if (!p) return ms_errf(err, errlen, "out of memory");
    p->threads = calloc((size_t)threads, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return ms_errf(err, errlen, "out of memory");
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
            ms_errf(err, errlen, "cannot start the request preparation threads");
            p->n_threads = i;
            prep_stop(p);
            return -1;
        }
        p->n_threads = i + 1;
    }
    *out = p;
    return 0;
}

int prep_submit(struct prep_pool *p, prep_fn fn, void *ctx)
{
    struct prep_job *j = malloc(sizeof *j);
    if (!j) return -1;
    *j = (struct prep_job){.fn = fn, .ctx = ctx};
    pthread_mutex_lock(&p->mu);
    if (p->stopping) {
        pthread_mutex_unlock(&p->mu);
        free(j);
        return -1;
    }
    if (p->tail)
        p->tail->next = j;
    else
        p->head = j;
    p->tail = j;
    p->backlog++;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

int prep_backlog(struct prep_pool *p)
{
    pthread_mutex_lock(&p->mu);
    int n = p->backlog;
    pthread_mutex_unlock(&p->mu);
    return n;
}

void prep_stop(struct prep_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}
