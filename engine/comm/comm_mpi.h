/* MPI communicator: the all-to-all interface of comm.h between processes, one engine rank
 * per process, on Open MPI (`mpirun -np N moeserve serve`). Rank r of the communicator is MPI
 * rank r of MPI_COMM_WORLD; this process drives c->self only.
 *
 * all_to_all_v first trades the row counts (one int to and from every peer), then the rows,
 * with non-blocking point-to-point messages, so that when something goes wrong it is known
 * which peer did not answer. Every call (all_to_all_v, barrier, send, recv) polls its requests
 * against one deadline, timeout_ms after it began: a peer that died, hangs, or was cut off
 * never makes a call wait longer than that. The first failure breaks the communicator: its
 * reason names the rank ("rank 2 did not answer within 5.0 s (all-to-all counts)") and every
 * later call returns -1 at once without touching MPI (status reports it). Errors MPI itself
 * returns (MPI_ERRORS_RETURN on our communicator) break it the same way.
 *
 * Threads: MPI is initialised with MPI_THREAD_SERIALIZED; callers make sure that one thread at a
 * time calls into the communicator (the engine serializes its step and its heartbeat).
 *
 * Fault tolerance needs the launcher's help: by default Open MPI's mpirun kills every process of
 * the job as soon as one dies. Started with `mpirun --enable-recovery`, the survivors keep
 * running, notice the failure through these deadlines and report it.
 *
 * Builds without MPI link comm_mpi_stub.c instead: comm_mpi_init and comm_mpi_create fail
 * with a reason.
 *
 * Ownership: comm_mpi_create returns a communicator destroyed by ops->destroy (which frees its
 * MPI communicator unless it is broken: a broken one is left to the process's exit). */
#ifndef MOESERVE_COMM_MPI_H
#define MOESERVE_COMM_MPI_H

#include <stdbool.h>
#include <stddef.h>

#include "comm.h"

/* Processes in the job this process was started in by mpirun (read from Open MPI's environment
 * before MPI is initialised), or 0 when not started by mpirun. Also in builds without MPI. */
int comm_mpi_launched(void);

/* Whether this build has the MPI communicator. */
bool comm_mpi_built(void);

/* Initialises MPI (MPI_THREAD_SERIALIZED or better). rank, size: OUT. -1 with a reason. */
int comm_mpi_init(int *rank, int *size, char *err, size_t errlen);

/* A communicator over every process of the job (after comm_mpi_init); timeout_ms > 0 bounds
 * every call. NULL with a reason. */
struct comm *comm_mpi_create(int timeout_ms, char *err, size_t errlen);

/* Clean exit (after every communicator is destroyed): MPI_Finalize. */
void comm_mpi_finalize(void);

#endif
