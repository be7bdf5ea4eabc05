/* NCCL communicator: the interface of engine/comm/comm.h for ranks that each drive their own GPU,
 * either all threads of one process (comm_nccl_create) or spread over several processes on
 * one or more nodes (comm_nccl_create_world). all_to_all_v exchanges the row counts with an
 * all-gather, then moves the rows with one group of ncclSend/ncclRecv per rank (self
 * included), on the rank's stream; send, recv are device pointers of that rank's GPU,
 * send_counts/recv_counts host arrays as in comm.h. Each call returns after its transfers have
 * finished (the stream is synchronized), so the comm.h contract holds on any stream.
 *
 * Ranks are global. c->n_rank is the size of the whole world, send_counts and recv_counts
 * have one entry per rank of the world, and a thread passes its global rank to all_to_all_v,
 * barrier, comm_nccl_set_stream and comm_nccl_error. A process created with first_rank f and
 * n_local n drives ranks f..f+n-1: its local thread i passes f + i and runs on devices[i];
 * other ranks are refused. Only the rows of this process's ranks in c->bytes_sent are counted
 * (the others stay 0: their bytes are counted by their own process).
 *
 * Ordering: by default a rank's transfers run on a stream of the communicator's own, and
 * all_to_all_v first synchronizes the rank's device so that rows produced by other streams are
 * complete. comm_nccl_set_stream makes a rank use the caller's stream instead (e.g. its CUDA
 * backend's, backend_cuda_stream), which orders the transfers after that stream's kernels
 * without a device-wide wait.
 *
 * Errors: all_to_all_v returns -1 and barrier returns nothing; the first failure per rank is
 * kept, readable with comm_nccl_error. Built without NCCL (MOESERVE_HAVE_NCCL undefined), the
 * constructors fail with a reason.
 *
 * Ownership: the constructors return a communicator destroyed by ops->destroy once no rank of
 * this process uses it; it owns the NCCL communicators, its streams and its count buffers,
 * never the streams given to comm_nccl_set_stream. Callable from C. */
#ifndef MOESERVE_COMM_NCCL_H
#define MOESERVE_COMM_NCCL_H

#include <stddef.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* n_rank ranks, all in this process, on the distinct CUDA devices devices[0..n_rank). NULL with
 * a reason in err on failure (nothing is left allocated). Call from one thread before the rank
 * threads start. */
struct comm *comm_nccl_create(int n_rank, const int *devices, char *err, size_t errlen);

/* One process's part of a world of `world` ranks spread over n_procs processes (this one
 * included). This process drives global ranks [first_rank, first_rank + n_local) on the
 * distinct CUDA devices devices[0..n_local); the processes' ranges must tile 0..world-1, each
 * holding at least one rank.
 *
 * Rendezvous: the process holding rank 0 creates the NCCL unique id and serves it on host:port
 * (bootstrap_serve: host is the address to listen on, e.g. "0.0.0.0", or NULL for every
 * address) to the n_procs - 1 others, which fetch it from host:port (bootstrap_fetch: rank 0's
 * address). The id travels with world and n_procs, and a process started with other values
 * refuses it, which fails rank 0 at once instead of leaving NCCL waiting. Rank 0 sends nothing
 * until every other process has connected, so a rendezvous that times out fails everywhere.
 * Each process waits at most timeout_ms (> 0) for it: give every process a timeout covering
 * the others' start-up. With n_procs == 1 there is no rendezvous (host, port and timeout_ms
 * are unused) and the result is that of comm_nccl_create(world, devices).
 *
 * Then every process creates its ranks' NCCL communicators together (ncclCommInitRank in one
 * group), which blocks until all ranks of the world have joined: NCCL's own start-up has no
 * deadline, which is why the rendezvous first makes sure every process is up and agrees.
 * NULL with a reason in err on failure (nothing of ours is left allocated; on rank 0, the
 * listener thread ncclGetUniqueId starts stays, as NCCL offers no call to stop it, and a new
 * attempt makes a new id). Call from one thread of each process before its rank threads start. */
struct comm *comm_nccl_create_world(int world, int n_procs, int first_rank, int n_local,
                                    const int *devices, const char *host, int port, int timeout_ms,
                                    char *err, size_t errlen);

/* Rank `rank` runs its transfers on `stream` (a cudaStream_t of its device; NULL returns to
 * the communicator's own stream). Call from the rank's thread, between exchanges. */
int comm_nccl_set_stream(struct comm *c, int rank, void *stream, char *err, size_t errlen);

/* Bounds every later exchange's wait to timeout_ms (<= 0: no bound, the default): an exchange
 * that has not finished by then (a peer died or hangs) or that NCCL reports failed aborts the
 * rank's NCCL communicator and returns -1 (barrier: records the failure); every later call
 * of that rank fails at once. comm_nccl_error says why. Call between exchanges. */
int comm_nccl_set_timeout(struct comm *c, int timeout_ms, char *err, size_t errlen);

/* -1 with the reason of rank's first failure, 0 when it has none. */
int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
