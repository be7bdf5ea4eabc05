/* MPI communicator (see comm_mpi.h): non-blocking point-to-point messages polled against a
 * deadline, so that a peer that dies or hangs is named and never blocks a caller for good. */
#include "comm_mpi.h"

#include <limits.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

/* Message tags, one per kind, so that an exchange can never match another's message. */
enum { TAG_COUNTS = 101, TAG_ROWS = 102, TAG_BARRIER = 103, TAG_P2P = 104 };

struct comm_mpi {
    struct comm base;
    MPI_Comm comm; /* our duplicate of MPI_COMM_WORLD (errors return, never abort) */
    double timeout_s;
    MPI_Request *reqs; /* (2 n_rank) */
    int *req_peer;     /* (2 n_rank) the peer of each request */
    int *counts_in;    /* (n_rank) counts received in the first phase */
    bool broken;
    char why[256];
};

int comm_mpi_launched(void)
{
    const char *s = getenv("OMPI_COMM_WORLD_SIZE");
    int n = s ? atoi(s) : 0;
    return n > 0 ? n : 0;
}

bool comm_mpi_built(void)
{
    return true;
}

int comm_mpi_init(int *rank, int *size, char *err, size_t errlen)
{
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
        return ms_errf(err, errlen, "MPI_Init_thread failed");
    if (provided < MPI_THREAD_SERIALIZED)
        return ms_errf(err, errlen,
                       "this MPI library offers thread level %d; moeserve needs "
                       "MPI_THREAD_SERIALIZED (%d)",
                       provided, MPI_THREAD_SERIALIZED);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    return 0;
}

void comm_mpi_finalize(void)
{
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
}

/* Breaks the communicator with a reason (the first one is kept). Returns -1. */
static int mpi_fail(struct comm_mpi *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int mpi_fail(struct comm_mpi *m, const char *fmt, ...)
{
    if (m->broken) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->why, sizeof m->why, fmt, ap);
    va_end(ap);
    m->broken = true;
    return -1;
}

/* Between polls of a wait that began `waited` seconds ago (after the first spins): sleep 20 us,
 * which hands the core to the rank being waited for when ranks outnumber cores (sched_yield
 * does not, under CFS), then 1 ms once the wait passes 50 ms (an idle rank waiting for the next
 * plan must not keep a core busy). */
static void pause_after(double waited)
{
    struct timespec ts = {0, waited < 0.05 ? 20 * 1000 : 1000 * 1000};
    nanosleep(&ts, NULL);
}

/* Waits for n requests until the deadline. On time out, the requests still pending name the
 * peers that failed (receives first: a send may complete without its peer); they are cancelled
 * and the communicator is broken. Spins first (a step's exchanges are microseconds apart on a
 * quiet machine), then pauses (pause_after), so that a rank waiting on a slower one leaves it
 * the CPU. */
static int wait_all(struct comm_mpi *m, int n, const char *what)
{
    if (n == 0) return 0;
    double t0 = ms_now(), deadline = t0 + m->timeout_s;
    for (long spin = 0;; spin++) {
        int done = 0;
        int rc = MPI_Testall(n, m->reqs, &done, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(rc, msg, &len);
            return mpi_fail(m, "MPI error during %s: %s", what, msg);
        }
        if (done) return 0;
        if (spin < 2000) continue;
        double now = ms_now();
        if (now > deadline) break;
        pause_after(now - t0);
    }
    /* Who is missing: the first pending receive's peer, else the first pending send's. */
    char ranks[128] = "";
    size_t used = 0;
    int named = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < n; i++) {
            if (m->reqs[i] == MPI_REQUEST_NULL) continue;
            int flag = 0;
            MPI_Test(&m->reqs[i], &flag, MPI_STATUS_IGNORE);
            if (flag) continue;
            bool is_recv = i % 2 == 0; /* requests are posted in (recv, send) pairs */
            if ((pass == 0) != is_recv) continue;
            if (used < sizeof ranks - 16) { /* each peer once: one receive, one send */
                used += (size_t)snprintf(ranks + used, sizeof ranks - used, "%s%d",
                                         used ? ", " : "", m->req_peer[i]);
                named++;
            }
        }
        if (used) break;
    }
    for (int i = 0; i < n; i++) {
        if (m->reqs[i] == MPI_REQUEST_NULL) continue;
        if (i % 2 == 0) MPI_Cancel(&m->reqs[i]);
        MPI_Request_free(&m->reqs[i]);
    }
    /* Several names: the first may be the cause, the others blocked waiting for it. */
    return mpi_fail(m,
                    "%s %s did not answer within %.1f s (%s): the process failed, hangs "
                    "or is cut off",
                    named > 1 ? "ranks" : "rank", used ? ranks : "?", m->timeout_s, what);
}

static int mpi_all_to_all_v(struct comm *c, int rank, const void *send, const int *send_counts,
                            void *recv, int *recv_counts, size_t row_bytes)
{
    struct comm_mpi *m = (struct comm_mpi *)c;
    int n = c->n_rank, self = c->self;
    if (m->broken) return -1;
    if (rank != self) return mpi_fail(m, "all_to_all_v called for rank %d by rank %d", rank, self);
    /* 1. counts: a (recv, send) pair per peer */
    int k = 0;
    for (int p = 0; p < n; p++) {
        if (p == self) continue;
        m->req_peer[k] = p;
        MPI_Irecv(&m->counts_in[p], 1, MPI_INT, p, TAG_COUNTS, m->comm, &m->reqs[k++]);
        m->req_peer[k] = p;
        MPI_Isend(&send_counts[p], 1, MPI_INT, p, TAG_COUNTS, m->comm, &m->reqs[k++]);
    }
    if (wait_all(m, k, "all-to-all counts") != 0) return -1;
    m->counts_in[self] = send_counts[self];
    /* 2. rows, grouped by peer in rank order on both sides */
    size_t send_off = 0, recv_off = 0;
    k = 0;
    for (int p = 0; p < n; p++) {
        size_t out = (size_t)send_counts[p] * row_bytes, in = (size_t)m->counts_in[p] * row_bytes;
        if (m->counts_in[p] < 0 || out > INT_MAX || in > INT_MAX)
            return mpi_fail(m, "all-to-all of %zu/%zu bytes with rank %d: out of range", out, in,
                            p);
        recv_counts[p] = m->counts_in[p];
        if (p == self) {
            if (out) memcpy((char *)recv + recv_off, (const char *)send + send_off, out);
        } else {
            m->req_peer[k] = p;
            if (in)
                MPI_Irecv((char *)recv + recv_off, (int)in, MPI_BYTE, p, TAG_ROWS, m->comm,
                          &m->reqs[k]);
            else
                m->reqs[k] = MPI_REQUEST_NULL;
            k++;
            m->req_peer[k] = p;
            if (out)
                MPI_Isend((const char *)send + send_off, (int)out, MPI_BYTE, p, TAG_ROWS, m->comm,
                          &m->reqs[k]);
            else
                m->reqs[k] = MPI_REQUEST_NULL;
            k++;
            c->bytes_sent[(size_t)self * n + p] += out;
        }
        send_off += out;
        recv_off += in;
    }
    return wait_all(m, k, "all-to-all rows");
}

/* A barrier as one empty message to and from every peer: bounded like the rest. */
static void mpi_barrier(struct comm *c, int rank)
{
    struct comm_mpi *m = (struct comm_mpi *)c;
    if (m->broken) return;
    (void)rank;
    static const char zero = 0;
    int k = 0;
    for (int p = 0; p < c->n_rank; p++) {
        if (p == c->self) continue;
        m->req_peer[k] = p;
        MPI_Irecv(NULL, 0, MPI_BYTE, p, TAG_BARRIER, m->comm, &m->reqs[k++]);
        m->req_peer[k] = p;
        MPI_Isend(&zero, 0, MPI_BYTE, p, TAG_BARRIER, m->comm, &m->reqs[k++]);
    }
    wait_all(m, k, "barrier");
}

static int mpi_send(struct comm *c, int dst, const void *buf, size_t bytes)
{
    struct comm_mpi *m = (struct comm_mpi *)c;
    if (m->broken) return -1;
    if (dst < 0 || dst >= c->n_rank || dst == c->self || bytes > INT_MAX)
        return mpi_fail(m, "send of %zu bytes to rank %d: bad arguments", bytes, dst);
    /* slot 0 stays a receive (wait_all's convention): a null one */
    m->reqs[0] = MPI_REQUEST_NULL;
    m->req_peer[0] = m->req_peer[1] = dst;
    MPI_Isend(buf, (int)bytes, MPI_BYTE, dst, TAG_P2P, m->comm, &m->reqs[1]);
    int rc = wait_all(m, 2, "send");
    if (rc == 0) c->msg_bytes_sent += bytes;
    return rc;
}

static int mpi_recv(struct comm *c, int src, void *buf, size_t cap, size_t *got)
{
    struct comm_mpi *m = (struct comm_mpi *)c;
    if (m->broken) return -1;
    if (src < 0 || src >= c->n_rank || src == c->self)
        return mpi_fail(m, "receive from rank %d: bad arguments", src);
    int icap = cap > INT_MAX ? INT_MAX : (int)cap;
    m->req_peer[0] = m->req_peer[1] = src;
    m->reqs[1] = MPI_REQUEST_NULL;
    MPI_Irecv(buf, icap, MPI_BYTE, src, TAG_P2P, m->comm, &m->reqs[0]);
    /* wait_all frees the status: poll here to keep it (the length) */
    double t0 = ms_now(), deadline = t0 + m->timeout_s;
    for (long spin = 0;; spin++) {
        int done = 0;
        MPI_Status st;
        int rc = MPI_Test(&m->reqs[0], &done, &st);
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(rc, msg, &len);
            return mpi_fail(m, "MPI error receiving from rank %d: %s", src, msg);
        }
        if (done) {
            int n = 0;
            MPI_Get_count(&st, MPI_BYTE, &n);
            *got = (size_t)n;
            return 0;
        }
        if (spin < 2000) continue;
        double now = ms_now();
        if (now > deadline) break;
        pause_after(now - t0);
    }
    MPI_Cancel(&m->reqs[0]);
    MPI_Request_free(&m->reqs[0]);
    return mpi_fail(m,
                    "rank %d did not answer within %.1f s (message): the process failed, "
                    "hangs or is cut off",
                    src, m->timeout_s);
}

static int mpi_status(const struct comm *c, char *err, size_t errlen)
{
    const struct comm_mpi *m = (const struct comm_mpi *)c;
    return m->broken ? ms_errf(err, errlen, "%s", m->why) : 0;
}

static void mpi_destroy(struct comm *c)
{
    struct comm_mpi *m = (struct comm_mpi *)c;
    if (!m) return;
    if (!m->broken && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    free(m->reqs);
    free(m->req_peer);
    free(m->counts_in);
    free(c->bytes_sent);
    free(m);
}

static const struct comm_ops mpi_ops = {
    .name = "mpi",
    .destroy = mpi_destroy,
    .all_to_all_v = mpi_all_to_all_v,
    .barrier = mpi_barrier,
    .send = mpi_send,
    .recv = mpi_recv,
    .status = mpi_status,
};

struct comm *comm_mpi_create(int timeout_ms, char *err, size_t errlen)
{
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        ms_errf(err, errlen, "comm_mpi_create: MPI is not initialised (comm_mpi_init)");
        return NULL;
    }
    if (timeout_ms <= 0) {
        ms_errf(err, errlen, "comm_mpi_create: the timeout must be positive, got %d ms",
                timeout_ms);
        return NULL;
    }
    struct comm_mpi *m = calloc(1, sizeof *m);
    if (!m) goto oom;
    m->comm = MPI_COMM_NULL;
    m->base.ops = &mpi_ops;
    m->timeout_s = timeout_ms / 1000.0;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &m->comm) != MPI_SUCCESS) {
        ms_errf(err, errlen, "comm_mpi_create: MPI_Comm_dup failed");
        mpi_destroy(&m->base);
        return NULL;
    }
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    MPI_Comm_size(m->comm, &m->base.n_rank);
    MPI_Comm_rank(m->comm, &m->base.self);
    size_t n = (size_t)m->base.n_rank;
    m->reqs = malloc(sizeof *m->reqs * 2 * (n + 1));
    m->req_peer = malloc(sizeof *m->req_peer * 2 * (n + 1));
    m->counts_in = calloc(n, sizeof *m->counts_in);
    m->base.bytes_sent = calloc(n * n, sizeof *m->base.bytes_sent);
    if (!m->reqs || !m->req_peer || !m->counts_in || !m->base.bytes_sent) goto oom;
    for (size_t i = 0; i < 2 * (n + 1); i++)
        m->reqs[i] = MPI_REQUEST_NULL;
    return &m->base;
oom:
    ms_errf(err, errlen, "out of memory for the MPI communicator");
    if (m) mpi_destroy(&m->base);
    return NULL;
}
