/* TCP communicator (see comm_tcp.h): a star around rank 0, framed messages, every wait bounded
 * by poll() against a deadline. */
#include "comm_tcp.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define TCP_MAGIC 0x4d535443u /* "MSTC" */
enum { KIND_HELLO = 1, KIND_MSG = 2, KIND_A2A = 3 };

struct frame_hdr {
    uint32_t magic, kind;
    uint64_t len;
};

struct comm_tcp {
    struct comm base;
    double timeout_s;
    int *fd;               /* (n_rank) rank 0: the connection to each rank; others: fd[0] */
    unsigned char **relay; /* rank 0: (n_rank) the all-to-all frame each rank sent */
    size_t *relay_cap;
    int32_t *zeros; /* (n_rank) the counts of a barrier */
    bool broken;
    char why[256];
};

/* Breaks the communicator with a reason (the first one is kept). Returns -1. */
static int tcp_fail(struct comm_tcp *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int tcp_fail(struct comm_tcp *t, const char *fmt, ...)
{
    if (t->broken) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->why, sizeof t->why, fmt, ap);
    va_end(ap);
    t->broken = true;
    return -1;
}

static int left_ms(double deadline)
{
    double left = deadline - ms_now();
    return left <= 0 ? 0 : left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
}

/* Moves n bytes to (write) or from (read) peer's socket before the deadline. */
static int tcp_io(struct comm_tcp *t, int peer, void *buf, size_t n, bool write, double deadline,
                  const char *what)
{
    int fd = t->fd[t->base.self == 0 ? peer : 0];
    size_t done = 0;
    while (done < n) {
        ssize_t r = write ? send(fd, (char *)buf + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL)
                          : recv(fd, (char *)buf + done, n - done, MSG_DONTWAIT);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if ((r == 0 && !write) || (r < 0 && (errno == ECONNRESET || errno == EPIPE)))
            return tcp_fail(t, "rank %d closed its connection (%s): the process failed or left",
                            peer, what);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return tcp_fail(t, "rank %d: %s (%s): the process failed or is cut off", peer,
                            strerror(errno), what);
        struct pollfd p = {.fd = fd, .events = write ? POLLOUT : POLLIN};
        int w = poll(&p, 1, left_ms(deadline));
        if (w < 0 && errno != EINTR) return tcp_fail(t, "poll: %s", strerror(errno));
        if (w == 0)
            return tcp_fail(t,
                            "rank %d did not answer within %.1f s (%s): the process failed, "
                            "hangs or is cut off",
                            peer, t->timeout_s, what);
    }
    return 0;
}

static int put_hdr(struct comm_tcp *t, int peer, uint32_t kind, uint64_t len, double deadline,
                   const char *what)
{
    struct frame_hdr h = {TCP_MAGIC, kind, len};
    return tcp_io(t, peer, &h, sizeof h, true, deadline, what);
}

/* Reads a header of `kind` from peer; its payload length in *len. */
static int get_hdr(struct comm_tcp *t, int peer, uint32_t kind, uint64_t *len, double deadline,
                   const char *what)
{
    struct frame_hdr h;
    if (tcp_io(t, peer, &h, sizeof h, false, deadline, what) != 0) return -1;
    if (h.magic != TCP_MAGIC || h.kind != kind)
        return tcp_fail(t, "rank %d sent a malformed frame (%s)", peer, what);
    *len = h.len;
    return 0;
}

static bool star_ok(const struct comm_tcp *t, int peer)
{
    return peer >= 0 && peer < t->base.n_rank && peer != t->base.self &&
           (t->base.self == 0 || peer == 0);
}

static int tcp_send(struct comm *c, int dst, const void *buf, size_t bytes)
{
    struct comm_tcp *t = (struct comm_tcp *)c;
    if (t->broken) return -1;
    if (!star_ok(t, dst))
        return tcp_fail(t, "send to rank %d: not a peer of rank %d", dst, c->self);
    double deadline = ms_now() + t->timeout_s;
    if (put_hdr(t, dst, KIND_MSG, bytes, deadline, "message") != 0 ||
        tcp_io(t, dst, (void *)buf, bytes, true, deadline, "message") != 0)
        return -1;
    c->msg_bytes_sent += bytes;
    return 0;
}

static int tcp_recv(struct comm *c, int src, void *buf, size_t cap, size_t *got)
{
    struct comm_tcp *t = (struct comm_tcp *)c;
    if (t->broken) return -1;
    if (!star_ok(t, src))
        return tcp_fail(t, "receive from rank %d: not a peer of rank %d", src, c->self);
    double deadline = ms_now() + t->timeout_s;
    uint64_t len;
    if (get_hdr(t, src, KIND_MSG, &len, deadline, "message") != 0) return -1;
    if (len > cap)
        return tcp_fail(t, "rank %d sent %llu bytes, more than %zu", src, (unsigned long long)len,
                        cap);
    if (tcp_io(t, src, buf, (size_t)len, false, deadline, "message") != 0) return -1;
    *got = (size_t)len;
    return 0;
}

/* Rank 0: the rows rank s sends to rank d in the current exchange, and how many. */
static const unsigned char *relay_rows(const struct comm_tcp *t, int s, int d, const void *send,
                                       const int *send_counts, size_t row_bytes, int *count)
{
    int n = t->base.n_rank;
    const int32_t *cnt = s == 0 ? (const int32_t *)send_counts : (const int32_t *)t->relay[s];
    const unsigned char *rows = s == 0 ? send : t->relay[s] + sizeof(int32_t) * (size_t)n;
    size_t before = 0;
    for (int k = 0; k < d; k++)
        before += (size_t)cnt[k];
    *count = cnt[d];
    return rows + before * row_bytes;
}

static int tcp_all_to_all_v(struct comm *c, int rank, const void *send, const int *send_counts,
                            void *recv, int *recv_counts, size_t row_bytes)
{
    struct comm_tcp *t = (struct comm_tcp *)c;
    int n = c->n_rank, self = c->self;
    if (t->broken) return -1;
    if (rank != self) return tcp_fail(t, "all_to_all_v called for rank %d by rank %d", rank, self);
    _Static_assert(sizeof(int) == sizeof(int32_t), "counts travel as int32");
    double deadline = ms_now() + t->timeout_s;
    size_t total = 0;
    for (int d = 0; d < n; d++) {
        if (send_counts[d] < 0) return tcp_fail(t, "all_to_all_v: negative count");
        total += (size_t)send_counts[d];
        if (d != self) c->bytes_sent[(size_t)self * n + d] += (size_t)send_counts[d] * row_bytes;
    }
    size_t counts_bytes = sizeof(int32_t) * (size_t)n;
    if (self != 0) {
        /* one frame up (counts, rows by destination), one frame down (counts, rows by source) */
        if (put_hdr(t, 0, KIND_A2A, counts_bytes + total * row_bytes, deadline, "all-to-all") ||
            tcp_io(t, 0, (void *)send_counts, counts_bytes, true, deadline, "all-to-all") ||
            tcp_io(t, 0, (void *)send, total * row_bytes, true, deadline, "all-to-all"))
            return -1;
        uint64_t len;
        if (get_hdr(t, 0, KIND_A2A, &len, deadline, "all-to-all") != 0 || len < counts_bytes ||
            tcp_io(t, 0, recv_counts, counts_bytes, false, deadline, "all-to-all") != 0)
            return -1;
        size_t in = 0;
        for (int s = 0; s < n; s++)
            in += recv_counts[s] >= 0 ? (size_t)recv_counts[s] : 0;
        if (len != counts_bytes + in * row_bytes)
            return tcp_fail(t, "rank 0 sent a malformed all-to-all frame");
        return tcp_io(t, 0, recv, in * row_bytes, false, deadline, "all-to-all");
    }
    /* Rank 0: gather every rank's frame, then hand each its rows. */
    for (int s = 1; s < n; s++) {
        uint64_t len;
        if (get_hdr(t, s, KIND_A2A, &len, deadline, "all-to-all") != 0) return -1;
        if (len < counts_bytes) return tcp_fail(t, "rank %d sent a malformed all-to-all", s);
        if (len > t->relay_cap[s]) { /* grows to the largest exchange once, then stays */
            unsigned char *p = realloc(t->relay[s], (size_t)len);
            if (!p)
                return tcp_fail(t, "out of memory relaying %llu bytes", (unsigned long long)len);
            t->relay[s] = p;
            t->relay_cap[s] = (size_t)len;
        }
        if (tcp_io(t, s, t->relay[s], (size_t)len, false, deadline, "all-to-all") != 0) return -1;
        size_t rows = 0;
        const int32_t *cnt = (const int32_t *)t->relay[s];
        for (int d = 0; d < n; d++)
            rows += cnt[d] >= 0 ? (size_t)cnt[d] : 0;
        for (int d = 0; d < n; d++)
            if (cnt[d] < 0 || len != counts_bytes + rows * row_bytes)
                return tcp_fail(t, "rank %d sent a malformed all-to-all", s);
    }
    for (int d = 0; d < n; d++) {
        int32_t *cnt_in = d == 0 ? (int32_t *)recv_counts : NULL;
        int32_t tmp[256];
        int32_t *ci = cnt_in ? cnt_in : n <= 256 ? tmp : NULL;
        if (!ci) return tcp_fail(t, "more than 256 ranks");
        size_t in = 0;
        for (int s = 0; s < n; s++) {
            relay_rows(t, s, d, send, send_counts, row_bytes, &ci[s]);
            in += (size_t)ci[s];
        }
        if (d == 0) {
            unsigned char *out = recv;
            for (int s = 0; s < n; s++) {
                int k;
                const unsigned char *rows = relay_rows(t, s, 0, send, send_counts, row_bytes, &k);
                if (k) memcpy(out, rows, (size_t)k * row_bytes);
                out += (size_t)k * row_bytes;
            }
            continue;
        }
        if (put_hdr(t, d, KIND_A2A, counts_bytes + in * row_bytes, deadline, "all-to-all") ||
            tcp_io(t, d, ci, counts_bytes, true, deadline, "all-to-all"))
            return -1;
        for (int s = 0; s < n; s++) {
            int k;
            const unsigned char *rows = relay_rows(t, s, d, send, send_counts, row_bytes, &k);
            if (k && tcp_io(t, d, (void *)rows, (size_t)k * row_bytes, true, deadline,
                            "all-to-all") != 0)
                return -1;
        }
    }
    return 0;
}

static void tcp_barrier(struct comm *c, int rank)
{
    struct comm_tcp *t = (struct comm_tcp *)c;
    int32_t in[256];
    if (c->n_rank <= 256) tcp_all_to_all_v(c, rank, NULL, t->zeros, NULL, in, 1);
}

static int tcp_status(const struct comm *c, char *err, size_t errlen)
{
    const struct comm_tcp *t = (const struct comm_tcp *)c;
    return t->broken ? ms_errf(err, errlen, "%s", t->why) : 0;
}

static void tcp_destroy(struct comm *c)
{
    struct comm_tcp *t = (struct comm_tcp *)c;
    if (!t) return;
    for (int i = 0; t->fd && i < c->n_rank; i++)
        if (t->fd[i] >= 0) close(t->fd[i]);
    for (int i = 0; t->relay && i < c->n_rank; i++)
        free(t->relay[i]);
    free(t->fd);
    free(t->relay);
    free(t->relay_cap);
    free(t->zeros);
    free(c->bytes_sent);
    free(t);
}

static const struct comm_ops tcp_ops = {
    .name = "tcp",
    .destroy = tcp_destroy,
    .all_to_all_v = tcp_all_to_all_v,
    .barrier = tcp_barrier,
    .send = tcp_send,
    .recv = tcp_recv,
    .status = tcp_status,
};

static void tune(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* small frames: no Nagle */
}

/* Setup: reads exactly n bytes from fd within ms milliseconds (and before the deadline). */
static int read_exact(int fd, void *buf, size_t n, int ms, double deadline)
{
    double until = ms_now() + ms / 1000.0;
    if (until > deadline) until = deadline;
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, (char *)buf + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left_ms(until)) == 0) return -1;
    }
    return 0;
}

/* Rank 0: accepts one connection per other rank, each announcing (world, rank). A connection
 * that says something else (a probe, a stray client) is dropped and does not count. */
static int setup_root(struct comm_tcp *t, int port, double deadline, char *err, size_t errlen)
{
    int n = t->base.n_rank;
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *res = NULL;
    char serv[16];
    snprintf(serv, sizeof serv, "%d", port);
    int g = getaddrinfo(NULL, serv, &hints, &res);
    if (g != 0) return ms_errf(err, errlen, "comm_tcp: port %d: %s", port, gai_strerror(g));
    int lfd = -1, saved = EADDRNOTAVAIL;
    for (struct addrinfo *ai = res; ai && lfd < 0; ai = ai->ai_next) {
        lfd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        if (lfd >= 0 && (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
                         bind(lfd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(lfd, n) != 0)) {
            saved = errno;
            close(lfd);
            lfd = -1;
        }
    }
    freeaddrinfo(res);
    if (lfd < 0)
        return ms_errf(err, errlen, "comm_tcp: cannot listen on port %d: %s", port,
                       strerror(saved));
    int joined = 0;
    while (joined < n - 1) {
        struct pollfd p = {.fd = lfd, .events = POLLIN};
        int w = poll(&p, 1, left_ms(deadline));
        if (w == 0) {
            close(lfd);
            return ms_errf(err, errlen,
                           "comm_tcp: %d of %d ranks joined on port %d before the "
                           "deadline",
                           joined, n - 1, port);
        }
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) continue;
        tune(fd);
        uint32_t hello[4];
        /* a silent stranger gets 2 s, not the whole setup */
        int r = read_exact(fd, hello, sizeof hello, 2000, deadline);
        int rank = r == 0 ? (int)hello[3] : -1;
        if (r != 0 || hello[0] != TCP_MAGIC || hello[1] != KIND_HELLO || (int)hello[2] != n ||
            rank < 1 || rank >= n || t->fd[rank] >= 0) {
            close(fd); /* not one of ours, a duplicate, or a rank of another world size */
            continue;
        }
        uint32_t ok = TCP_MAGIC;
        if (send(fd, &ok, sizeof ok, MSG_NOSIGNAL) != (ssize_t)sizeof ok) {
            close(fd);
            continue;
        }
        t->fd[rank] = fd;
        joined++;
    }
    close(lfd);
    return 0;
}

/* Other ranks: connect to rank 0 (retrying until it listens), announce (world, rank), wait for
 * its acknowledgement. */
static int setup_leaf(struct comm_tcp *t, const char *addr, int port, double deadline, char *err,
                      size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV},
                    *res = NULL;
    char serv[16];
    snprintf(serv, sizeof serv, "%d", port);
    const char *why = "no answer";
    while (ms_now() < deadline) {
        int g = getaddrinfo(addr, serv, &hints, &res);
        for (struct addrinfo *ai = g == 0 ? res : NULL; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
            if (fd < 0) continue;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
                why = strerror(errno);
                close(fd);
                continue;
            }
            tune(fd);
            uint32_t hello[4] = {TCP_MAGIC, KIND_HELLO, (uint32_t)t->base.n_rank,
                                 (uint32_t)t->base.self},
                     ok = 0;
            if (send(fd, hello, sizeof hello, MSG_NOSIGNAL) == (ssize_t)sizeof hello &&
                read_exact(fd, &ok, sizeof ok, 2000, deadline) == 0 && ok == TCP_MAGIC) {
                freeaddrinfo(res);
                t->fd[0] = fd;
                return 0;
            }
            why = "rank 0 refused this rank (another world size, or the rank is taken)";
            close(fd);
        }
        if (g == 0) freeaddrinfo(res);
        res = NULL;
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return ms_errf(err, errlen, "comm_tcp: rank %d cannot join rank 0 at %s:%d: %s", t->base.self,
                   addr, port, why);
}

struct comm *comm_tcp_create(int world, int rank, const char *master_addr, int master_port,
                             int timeout_ms, int setup_timeout_ms, char *err, size_t errlen)
{
    if (world < 2 || world > 256 || rank < 0 || rank >= world || master_port < 1 ||
        master_port > 65535 || timeout_ms <= 0 || setup_timeout_ms <= 0 || !master_addr) {
        ms_errf(err, errlen, "comm_tcp: bad arguments (rank %d of %d, port %d)", rank, world,
                master_port);
        return NULL;
    }
    struct comm_tcp *t = calloc(1, sizeof *t);
    if (!t) goto oom;
    t->base.ops = &tcp_ops;
    t->base.n_rank = world;
    t->base.self = rank;
    t->timeout_s = timeout_ms / 1000.0;
    t->fd = malloc(sizeof *t->fd * (size_t)world);
    for (int i = 0; t->fd && i < world; i++)
        t->fd[i] = -1;
    t->relay = calloc((size_t)world, sizeof *t->relay);
    t->relay_cap = calloc((size_t)world, sizeof *t->relay_cap);
    t->zeros = calloc((size_t)world, sizeof *t->zeros);
    t->base.bytes_sent = calloc((size_t)world * world, sizeof *t->base.bytes_sent);
    if (!t->fd || !t->relay || !t->relay_cap || !t->zeros || !t->base.bytes_sent) goto oom;
    double deadline = ms_now() + setup_timeout_ms / 1000.0;
    int rc = rank == 0 ? setup_root(t, master_port, deadline, err, errlen)
                       : setup_leaf(t, master_addr, master_port, deadline, err, errlen);
    if (rc != 0) {
        tcp_destroy(&t->base);
        return NULL;
    }
    return &t->base;
oom:
    ms_errf(err, errlen, "out of memory for the TCP communicator");
    tcp_destroy(t ? &t->base : NULL);
    return NULL;
}
