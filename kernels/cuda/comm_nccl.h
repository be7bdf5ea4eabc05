/* NCCL communicator: the interface of engine/comm.h for ranks that are threads of one process,
 * each driving its own GPU (rank r on devices[r]). all_to_all_v exchanges the row counts with
 * an all-gather, then moves the rows with one group of ncclSend/ncclRecv per rank (self
 * included), on the rank's stream; send, recv are device pointers of that rank's GPU,
 * send_counts/recv_counts host arrays as in comm.h. Each call returns after its transfers have
 * finished (the stream is synchronized), so the comm.h contract holds on any stream.
 *
 * Ordering: by default a rank's transfers run on a stream of the communicator's own, and
 * all_to_all_v first synchronizes the rank's device so that rows produced by other streams are
 * complete. comm_nccl_set_stream makes a rank use the caller's stream instead (e.g. its CUDA
 * backend's, backend_cuda_stream), which orders the transfers after that stream's kernels
 * without a device-wide wait.
 *
 * Errors: all_to_all_v returns -1 and barrier returns nothing; the first failure per rank is
 * kept, readable with comm_nccl_error. Built without NCCL (MOESERVE_HAVE_NCCL undefined),
 * comm_nccl_create fails with a reason.
 *
 * Ownership: comm_nccl_create returns a communicator destroyed by ops->destroy once no rank
 * uses it; it owns the NCCL communicators, its streams and its count buffers, never the streams
 * given to comm_nccl_set_stream. Callable from C. */
#ifndef MOESERVE_COMM_NCCL_H
#define MOESERVE_COMM_NCCL_H

#include <stddef.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* n_rank ranks on the distinct CUDA devices devices[0..n_rank). NULL with a reason in err on
 * failure (nothing is left allocated). Call from one thread before the rank threads start. */
struct comm *comm_nccl_create(int n_rank, const int *devices, char *err, size_t errlen);

/* Rank `rank` runs its transfers on `stream` (a cudaStream_t of its device; NULL returns to
 * the communicator's own stream). Call from the rank's thread, between exchanges. */
int comm_nccl_set_stream(struct comm *c, int rank, void *stream, char *err, size_t errlen);

/* -1 with the reason of rank's first failure, 0 when it has none. */
int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
