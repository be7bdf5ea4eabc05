/* The MPI communicator under mpirun (any number of ranks >= 2): all_to_all_v moves exactly the
 * rows comm.h promises (counts and bytes from a formula every rank can evaluate, zero counts
 * and self rows included, several row sizes), send/recv carry a message and its length, and a
 * rank that stops taking part (it waits elsewhere, as a hung process would) is named by every
 * other rank within the deadline, after which the communicator fails at once. */
#include <stdint.h>
#include <unistd.h>

#include <mpi.h>

#include "common.h"
#include "mpi/comm_mpi.h"
#include "test.h"

/* Rows rank s sends to rank d in round r: some zero, some large. */
static int rows_for(int r, int s, int d)
{
    int v = (r * 7 + s * 13 + d * 5) % 11;
    return v < 3 ? 0 : v * (r + 1);
}

/* Byte b of row i that s sends to d in round r. */
static unsigned char byte_for(int r, int s, int d, int i, size_t b)
{
    return (unsigned char)(r * 31 + s * 17 + d * 7 + i * 3 + (int)b);
}

static void test_exchange(struct comm *c)
{
    int n = c->n_rank, me = c->self;
    size_t row_sizes[] = {4, 40, 4096};
    size_t cap = 0;
    for (int r = 0; r < 6; r++)
        for (int p = 0; p < n; p++) {
            size_t a = 0, b = 0;
            for (int q = 0; q < n; q++) {
                a += (size_t)rows_for(r, p, q);
                b += (size_t)rows_for(r, q, p);
            }
            cap = a > cap ? a : cap;
            cap = b > cap ? b : cap;
        }
    unsigned char *send = malloc(cap * 4096), *recv = malloc(cap * 4096);
    int *sc = calloc((size_t)n, sizeof(int)), *rc = calloc((size_t)n, sizeof(int));
    unsigned long long before_self = c->bytes_sent[(size_t)me * n + me];
    CHECK(send && recv && sc && rc);
    if (!send || !recv || !sc || !rc) goto out;
    for (int r = 0; r < 6; r++) {
        size_t rb = row_sizes[r % 3], off = 0;
        for (int d = 0; d < n; d++) {
            sc[d] = rows_for(r, me, d);
            for (int i = 0; i < sc[d]; i++, off += rb)
                for (size_t b = 0; b < rb; b++) send[off + b] = byte_for(r, me, d, i, b);
        }
        memset(recv, 0xEE, cap * rb);
        for (int s = 0; s < n; s++) rc[s] = -7;
        CHECKF(c->ops->all_to_all_v(c, me, send, sc, recv, rc, rb) == 0, "round %d", r);
        off = 0;
        int bad = 0;
        for (int s = 0; s < n; s++) {
            CHECKF(rc[s] == rows_for(r, s, me), "round %d: %d rows from %d, want %d", r, rc[s],
                   s, rows_for(r, s, me));
            for (int i = 0; i < rows_for(r, s, me); i++, off += rb)
                for (size_t b = 0; b < rb; b++) bad += recv[off + b] != byte_for(r, s, me, i, b);
        }
        CHECKF(bad == 0, "round %d (row %zu bytes): %d bytes differ", r, rb, bad);
    }
    /* bytes_sent counts what went to other ranks, nothing for the rank itself */
    CHECK(c->bytes_sent[(size_t)me * n + me] == before_self);
    for (int d = 0; d < n; d++) {
        if (d == me) continue;
        unsigned long long want = 0;
        for (int r = 0; r < 6; r++) want += (unsigned long long)rows_for(r, me, d) * row_sizes[r % 3];
        CHECKF(c->bytes_sent[(size_t)me * n + d] == want, "bytes to %d: %llu, want %llu", d,
               c->bytes_sent[(size_t)me * n + d], want);
    }
out:
    free(send);
    free(recv);
    free(sc);
    free(rc);
}

/* Rank 0 sends every other rank a message of its own length; each answers with it reversed. */
static void test_p2p(struct comm *c)
{
    int n = c->n_rank, me = c->self;
    char buf[256], back[256];
    size_t got = 0, sent = 0;
    unsigned long long before = c->msg_bytes_sent;
    if (me == 0) {
        for (int d = 1; d < n; d++) {
            int len = snprintf(buf, sizeof buf, "step plan for rank %d", d);
            CHECK(c->ops->send(c, d, buf, (size_t)len) == 0);
            sent += (size_t)len;
        }
        for (int d = 1; d < n; d++) {
            CHECK(c->ops->recv(c, d, back, sizeof back, &got) == 0);
            int len = snprintf(buf, sizeof buf, "step plan for rank %d", d);
            CHECKF(got == (size_t)len, "reply of %zu bytes from %d, want %d", got, d, len);
            int same = got == (size_t)len;
            for (int i = 0; same && i < len; i++) same = back[i] == buf[len - 1 - i];
            CHECKF(same, "reply from %d", d);
        }
    } else {
        CHECK(c->ops->recv(c, 0, buf, sizeof buf, &got) == 0);
        char want[64];
        int len = snprintf(want, sizeof want, "step plan for rank %d", me);
        CHECKF(got == (size_t)len && memcmp(buf, want, got) == 0, "rank %d got '%.*s'", me,
               (int)got, buf);
        for (size_t i = 0; i < got; i++) back[i] = buf[got - 1 - i];
        CHECK(c->ops->send(c, 0, back, got) == 0);
        sent = got;
    }
    CHECKF(c->msg_bytes_sent - before == sent, "rank %d: %llu message bytes counted, %zu sent",
           me, c->msg_bytes_sent - before, sent);
}

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
    for (int d = 0; d < n; d++) sc[d] = 1;
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
