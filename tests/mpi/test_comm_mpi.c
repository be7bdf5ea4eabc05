/* The MPI communicator under mpirun (any number of ranks >= 2): all_to_all_v moves exactly the
 * rows comm.h promises (counts and bytes from a formula every rank can evaluate, zero counts
 * and self rows included, several row sizes), send/recv carry a message and its length, and a
 * rank that stops taking part (it waits elsewhere, as a hung process would) is named by every
 * other rank within the deadline, after which the communicator fails at once. */
#include <stdint.h>
#include <unistd.h>

#include <mpi.h>

#include "common.h"
#include "comm_mpi.h"
#include "test.h"
#include "comm_check.h"

/* The last rank stops taking part: it waits on a world barrier the others reach only after
 * they have noticed. */
static void test_failure(struct comm *c)
{
    int n = c->n_rank, me = c->self;
    if (me == n - 1) {
        MPI_Barrier(MPI_COMM_WORLD);
        return;
    }
    int *sc = calloc((size_t)n, sizeof(int)), *rc = calloc((size_t)n, sizeof(int));
    float send[8] = {0}, recv[8 * 64];
    for (int d = 0; d < n; d++)
        sc[d] = 1;
    double t0 = ms_now();
    int r = c->ops->all_to_all_v(c, me, send, sc, recv, rc, sizeof(float));
    double waited = ms_now() - t0;
    char why[256] = "";
    CHECKF(r == -1, "rank %d: the exchange with a silent rank returned %d", me, r);
    CHECK(c->ops->status(c, why, sizeof why) == -1);
    char want[32];
    snprintf(want, sizeof want, "rank %d did not answer", n - 1);
    CHECKF(strstr(why, want) != NULL, "rank %d: reason '%s' does not name rank %d", me, why, n - 1);
    /* the deadline is 0.5 s: not much before, and not long after (a loaded machine) */
    CHECKF(waited >= 0.45 && waited < 5.0, "rank %d waited %.2f s", me, waited);
    /* broken for good: the next call fails at once */
    t0 = ms_now();
    CHECK(c->ops->all_to_all_v(c, me, send, sc, recv, rc, sizeof(float)) == -1);
    size_t got;
    CHECK(c->ops->recv(c, me == 0 ? 1 : 0, recv, sizeof recv, &got) == -1);
    CHECK(ms_now() - t0 < 0.1);
    free(sc);
    free(rc);
    MPI_Barrier(MPI_COMM_WORLD);
}

int main(void)
{
    char err[MS_ERR_LEN];
    int rank = -1, size = 0;
    CHECK(comm_mpi_built());
    int launched = comm_mpi_launched();
    if (comm_mpi_init(&rank, &size, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    CHECKF(launched == size, "OMPI_COMM_WORLD_SIZE says %d, MPI %d", launched, size);
    CHECK(comm_mpi_create(0, err, sizeof err) == NULL && strstr(err, "positive"));
    struct comm *c = comm_mpi_create(10000, err, sizeof err);
    CHECKF(c != NULL, "%s", err);
    if (c) {
        CHECK(c->n_rank == size && c->self == rank && strcmp(c->ops->name, "mpi") == 0);
        if (size >= 2) {
            test_exchange(c);
            test_p2p(c);
            c->ops->barrier(c, rank);
            CHECK(c->ops->status(c, err, sizeof err) == 0);
        }
        c->ops->destroy(c);
    }
    struct comm *f = comm_mpi_create(500, err, sizeof err);
    CHECKF(f != NULL, "%s", err);
    if (f && size >= 2) test_failure(f);
    if (f) f->ops->destroy(f);
    char name[32];
    snprintf(name, sizeof name, "test_comm_mpi rank %d", rank);
    int rc = test_done(name);
    /* every rank's verdict counts: mpirun exits with the first non-zero status */
    comm_mpi_finalize();
    return rc;
}
