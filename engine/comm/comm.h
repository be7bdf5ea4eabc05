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
 * Communicators whose ranks are separate processes (MPI, engine/comm_mpi.h) have `self` >= 0:
 * the one rank this process drives. They also carry point-to-point messages (send/recv, for the
 * step plan and the logits the engine moves between processes) and a failure state: every call
 * waits against a deadline, and a peer that does not answer in time breaks the communicator
 * for good (every later call returns -1 at once; status says which rank failed and how). The
 * in-process communicator has self == -1 and leaves those three NULL.
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
    /* Multi-process communicators only (NULL otherwise). send: `bytes` to rank dst. recv: one
     * message from rank src into buf (cap bytes), its length in *got. 0, or -1 when the peer
     * failed, did not answer within the deadline, or sent more than cap. */
    int (*send)(struct comm *c, int dst, const void *buf, size_t bytes);
    int (*recv)(struct comm *c, int src, void *buf, size_t cap, size_t *got);
    /* 0 while healthy; -1 once broken, with the reason (naming the failed rank) in err. */
    int (*status)(const struct comm *c, char *err, size_t errlen);
};

struct comm {
    const struct comm_ops *ops;
    int n_rank;
    int self; /* the rank this process drives (multi-process), or -1: every rank, as threads */
    /* Bytes this rank sent to each other rank, for /metrics: (n_rank, n_rank), row = sender. */
    unsigned long long *bytes_sent;
    /* Multi-process: bytes this process sent with send() (step plans, logits, status words). */
    unsigned long long msg_bytes_sent;
};

/* In-process communicator for CPU virtual devices (threads of one process). */
struct comm *comm_local_create(int n_rank);

#endif
