/* Communicator: how device ranks exchange token rows for the MoE layer (dispatch to the device
 * that owns an expert, combine back). An interface (table of function pointers) so that the
 * in-process implementation here and an NCCL one (kernels/cuda) are interchangeable.
 *
 * all_to_all_v is collective: every rank of the communicator calls it once per exchange, from
 * its own thread. Rank r sends send_counts[d] rows to each rank d, laid out in `send` grouped by
 * destination in rank order; on return `recv` holds the rows sent to r grouped by source rank in
 * rank order and recv_counts[s] says how many came from s. `recv` must have room for every row
 * that can arrive (the caller sizes it for the worst case). The send buffer may be reused as
 * soon as the call returns.
 *
 * Ownership: comm_local_create returns a communicator destroyed by ops->destroy once no rank
 * uses it. */
#ifndef MOESERVE_COMM_H
#define MOESERVE_COMM_H

#include <stddef.h>

struct comm;

struct comm_ops {
    const char *name;
    void (*destroy)(struct comm *c);
    int (*all_to_all_v)(struct comm *c, int rank, const void *send, const int *send_counts,
                        void *recv, int *recv_counts, size_t row_bytes);
    void (*barrier)(struct comm *c, int rank);
};

struct comm {
    const struct comm_ops *ops;
    int n_rank;
    /* Bytes this rank sent to each other rank, for /metrics: (n_rank, n_rank), row = sender. */
    unsigned long long *bytes_sent;
};

/* In-process communicator for CPU virtual devices (threads of one process). */
struct comm *comm_local_create(int n_rank);

#endif
