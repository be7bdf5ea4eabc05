/* In-process communicator: ranks are threads sharing memory. An exchange publishes each rank's
 * send buffer and counts, waits at a barrier, lets every rank copy its rows straight out of the
 * senders' buffers, and waits again so no sender reuses its buffer while it is being read. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"

#define COMM_MAX_RANKS 64

struct comm_local {
    struct comm base;
    pthread_barrier_t barrier;
    const void *send[COMM_MAX_RANKS];
    const int *counts[COMM_MAX_RANKS];
};

static void local_destroy(struct comm *c)
{
    struct comm_local *l = (struct comm_local *)c;
    pthread_barrier_destroy(&l->barrier);
    free(c->bytes_sent);
    free(l);
}

static void local_barrier(struct comm *c, int rank)
{
    struct comm_local *l = (struct comm_local *)c;
    if (c->n_rank > 1) pthread_barrier_wait(&l->barrier);
}

static int local_all_to_all_v(struct comm *c, int rank, const void *send, const int *send_counts,
                              void *recv, int *recv_counts, size_t row_bytes)
{
    struct comm_local *l = (struct comm_local *)c;
    int n = c->n_rank;
    l->send[rank] = send;
    l->counts[rank] = send_counts;
    local_barrier(c, rank);
    char *out = recv;
    for (int src = 0; src < n; src++) {
        const int *cnt = l->counts[src];
        size_t before = 0;
        for (int d = 0; d < rank; d++) before += (size_t)cnt[d];
        size_t bytes = (size_t)cnt[rank] * row_bytes;
        if (bytes) memcpy(out, (const char *)l->send[src] + before * row_bytes, bytes);
        out += bytes;
        recv_counts[src] = cnt[rank];
        c->bytes_sent[(size_t)src * n + rank] += src == rank ? 0 : bytes;
    }
    local_barrier(c, rank);
    return 0;
}

static const struct comm_ops local_ops = {
    .name = "local",
    .destroy = local_destroy,
    .all_to_all_v = local_all_to_all_v,
    .barrier = local_barrier,
};

struct comm *comm_local_create(int n_rank)
{
    if (n_rank < 1 || n_rank > COMM_MAX_RANKS) return NULL;
    struct comm_local *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->base.ops = &local_ops;
    l->base.n_rank = n_rank;
    l->base.self = -1;
    l->base.bytes_sent = calloc((size_t)n_rank * n_rank, sizeof(unsigned long long));
    if (!l->base.bytes_sent || pthread_barrier_init(&l->barrier, NULL, (unsigned)n_rank) != 0) {
        free(l->base.bytes_sent);
        free(l);
        return NULL;
    }
    return &l->base;
}
