/* The MPI communicator's entry points in a build without MPI (comm_mpi.h): a process started by
 * mpirun still sees that it was (so that it refuses to run as N independent servers), and
 * asking for MPI explains how to get it. */
#include <stdlib.h>

#include "comm_mpi.h"
#include "common.h"

int comm_mpi_launched(void)
{
    const char *s = getenv("OMPI_COMM_WORLD_SIZE");
    int n = s ? atoi(s) : 0;
    return n > 0 ? n : 0;
}

bool comm_mpi_built(void)
{
    return false;
}

int comm_mpi_init(int *rank, int *size, char *err, size_t errlen)
{
    *rank = 0;
    *size = 1;
    return ms_errf(err, errlen, "this build has no MPI (install libopenmpi-dev and reconfigure)");
}

struct comm *comm_mpi_create(int timeout_ms, char *err, size_t errlen)
{
    (void)timeout_ms;
    ms_errf(err, errlen, "this build has no MPI (install libopenmpi-dev and reconfigure)");
    return NULL;
}

void comm_mpi_finalize(void) {}
