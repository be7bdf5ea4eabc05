/* TCP communicator: the interface of engine/comm/comm.h between processes started without mpirun
 * (`moeserve serve --nnodes N --node-rank R --master-addr A --master-port P`, torchrun's
 * spellings), one engine rank per process.
 *
 * A star: rank 0 listens on the master port and every other rank keeps one connection to it.
 * Messages (send/recv) go between rank 0 and another rank, which is all the multi-process engine
 * sends (plans, logits, status words). all_to_all_v is relayed by rank 0: each rank sends rank 0
 * its counts and rows in one frame, rank 0 regroups them by destination and sends each rank its
 * rows; the rows of two ranks other than 0 cross the wire twice, the price of needing one open
 * port only. Frames are a 16-byte header (magic, kind, length) and the payload, in this machine's
 * byte order (the ranks must share it).
 *
 * Time: every call waits with poll() against one deadline, timeout_ms after it began; a peer that
 * does not answer in time, closes its connection or sends something malformed breaks the
 * communicator for good (every later call returns -1 at once), with a reason naming the rank
 * ("rank 2 did not answer within 5.0 s (message)", "rank 1 closed its connection ..."), which
 * status returns. Setup waits at most setup_timeout_ms for every rank to connect (rank 0 may
 * start after the others, or the others after it: they retry).
 *
 * Ownership: comm_tcp_create returns a communicator destroyed by ops->destroy, which closes its
 * sockets. Nothing process-wide is changed (MSG_NOSIGNAL, close-on-exec). */
#ifndef MOESERVE_COMM_TCP_H
#define MOESERVE_COMM_TCP_H

#include <stddef.h>

#include "comm.h"

/* Rank `rank` of `world` (>= 2): rank 0 listens on every address at master_port, the others
 * connect to master_addr:master_port. NULL with a reason. */
struct comm *comm_tcp_create(int world, int rank, const char *master_addr, int master_port,
                             int timeout_ms, int setup_timeout_ms, char *err, size_t errlen);

#endif
