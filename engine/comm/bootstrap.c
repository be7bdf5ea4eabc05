/* The TCP rendezvous of bootstrap.h: a poll() loop on the serving side that gathers every peer
 * before sending anything, and on the fetching side a connect loop with backoff followed by
 * exact reads. All sockets are non-blocking, so each wait is a poll() bounded by the call's
 * deadline and nothing can block past it. */
#include "bootstrap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"

#define BS_MAGIC_LEN    8
#define BS_HEADER_LEN   (BS_MAGIC_LEN + 4)
#define BS_ACK_KEPT     'K'
#define BS_ACK_REJECTED 'N'
/* Connect retries start fast (the server is usually up) and slow down so that a long wait for
 * a late server does not hammer it or the resolver. */
#define BS_BACKOFF_FIRST_MS 10
#define BS_BACKOFF_MAX_MS   500
#define BS_ADDR_LEN         (NI_MAXHOST + 16)

static const char bs_magic[BS_MAGIC_LEN] = "MSBOOT1"; /* the eighth byte is the NUL */

/* Milliseconds until `deadline` (a ms_now() time), rounded up so that a wait never ends just
 * short of it and spins on zero timeouts; 0 once it has passed. */
static int bs_left_ms(double deadline)
{
    double left = (deadline - ms_now()) * 1000.0;
    if (left <= 0) return 0;
    if (left >= INT_MAX - 1) return INT_MAX;
    return (int)left + 1;
}

/* Waits until fd is ready for `events`: 1 when it is (or has an error or hang-up to report),
 * 0 when the deadline passes first, -1 when poll itself fails (errno set). */
static int bs_wait(int fd, short events, double deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, bs_left_ms(deadline));
        if (rc > 0) return 1;
        if (rc == 0) {
            if (bs_left_ms(deadline) == 0) return 0;
        } else if (errno != EINTR) {
            return -1;
        }
    }
}

/* "host:port", with brackets around an IPv6 literal and "*" for every local address. */
static void bs_fmt_addr(char *out, size_t n, const char *host, int port)
{
    if (!host || !*host)
        snprintf(out, n, "*:%d", port);
    else if (strchr(host, ':'))
        snprintf(out, n, "[%s]:%d", host, port);
    else
        snprintf(out, n, "%s:%d", host, port);
}

static void bs_fmt_sockaddr(char *out, size_t n, const struct sockaddr *sa, socklen_t len)
{
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        snprintf(out, n, "(unknown address)");
        return;
    }
    bs_fmt_addr(out, n, host, atoi(serv));
}

static const char *bs_gai_error(int rc)
{
    return rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc);
}

static int bs_check_args(const char *who, int port, const void *blob, size_t len, int timeout_ms,
                         char *err, size_t errlen)
{
    if (port < 1 || port > 65535) return ms_errf(err, errlen, "%s: bad port %d", who, port);
    if (len > BOOTSTRAP_MAX_BLOB)
        return ms_errf(err, errlen, "%s: blob of %zu bytes is over the %u-byte limit", who, len,
                       BOOTSTRAP_MAX_BLOB);
    if (!blob && len) return ms_errf(err, errlen, "%s: no blob", who);
    /* A rendezvous without a deadline could wait forever for a process that never starts. */
    if (timeout_ms <= 0) return ms_errf(err, errlen, "%s: timeout must be positive", who);
    return 0;
}

/* Reads exactly n bytes of `what` from addr into buf. */
static int bs_read_full(int fd, void *buf, size_t n, const char *what, const char *addr,
                        double deadline, int timeout_ms, char *err, size_t errlen)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, (char *)buf + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0)
            return ms_errf(err, errlen,
                           "bootstrap: %s closed the connection after %zu of %zu bytes of the %s",
                           addr, got, n, what);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return ms_errf(err, errlen, "bootstrap: reading the %s from %s: %s", what, addr,
                           strerror(errno));
        int w = bs_wait(fd, POLLIN, deadline);
        if (w == 0)
            return ms_errf(err, errlen,
                           "bootstrap: timed out after %d ms waiting for the %s from %s "
                           "(%zu of %zu bytes)",
                           timeout_ms, what, addr, got, n);
        if (w < 0) return ms_errf(err, errlen, "bootstrap: poll: %s", strerror(errno));
    }
    return 0;
}

static int bs_write_full(int fd, const void *buf, size_t n, const char *what, const char *addr,
                         double deadline, int timeout_ms, char *err, size_t errlen)
{
    size_t put = 0;
    while (put < n) {
        ssize_t r = send(fd, (const char *)buf + put, n - put, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r >= 0) {
            put += (size_t)r;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return ms_errf(err, errlen, "bootstrap: sending the %s to %s: %s", what, addr,
                           strerror(errno));
        int w = bs_wait(fd, POLLOUT, deadline);
        if (w == 0)
            return ms_errf(err, errlen, "bootstrap: timed out after %d ms sending the %s to %s",
                           timeout_ms, what, addr);
        if (w < 0) return ms_errf(err, errlen, "bootstrap: poll: %s", strerror(errno));
    }
    return 0;
}

/* ---- serving side ---- */

struct bs_peer {
    int fd;
    int acked;
    size_t sent; /* bytes of header + blob gone out */
    char name[BS_ADDR_LEN];
};

static int bs_listen(const char *host, int port, int backlog, const char *addr, int *out, char *err,
                     size_t errlen)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char serv[16];
    snprintf(serv, sizeof serv, "%d", port);
    int g = getaddrinfo(host && *host ? host : NULL, serv, &hints, &res);
    if (g != 0)
        return ms_errf(err, errlen, "bootstrap: cannot listen on %s: %s", addr, bs_gai_error(g));
    int saved = EADDRNOTAVAIL;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd =
            socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        /* A restarted rank 0 must be able to take its port back while the last run's
         * connections sit in TIME_WAIT. */
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
            bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) {
            freeaddrinfo(res);
            *out = fd;
            return 0;
        }
        saved = errno;
        close(fd);
    }
    freeaddrinfo(res);
    return ms_errf(err, errlen, "bootstrap: cannot listen on %s: %s", addr, strerror(saved));
}

/* Takes every pending connection while there is room. -1 only for failures of the listener
 * itself; a connection that broke before accept() returned is simply not counted. */
static int bs_accept(int lfd, struct bs_peer *peers, int *n_conn, int n_peers, const char *addr,
                     char *err, size_t errlen)
{
    while (*n_conn < n_peers) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM ||
                errno == EBADF || errno == EINVAL)
                return ms_errf(err, errlen, "bootstrap: accepting on %s: %s", addr,
                               strerror(errno));
            continue; /* EINTR, or an error of that one connection (ECONNABORTED, EPROTO...) */
        }
        struct bs_peer *p = &peers[(*n_conn)++];
        p->fd = fd;
        p->acked = 0;
        p->sent = 0;
        bs_fmt_sockaddr(p->name, sizeof p->name, (struct sockaddr *)&sa, sl);
    }
    return 0;
}

/* Drops every connection that has something to read: a fetcher sends nothing until it has the
 * blob, so this is a close, an error or a stranger talking. Returns how many were dropped. */
static int bs_drop_talkers(struct bs_peer *peers, int *n_conn, const struct pollfd *pfds)
{
    int dropped = 0;
    /* Backwards, so that moving the last peer into a freed slot never skips one. */
    for (int i = *n_conn - 1; i >= 0; i--) {
        if (!pfds[i].revents) continue;
        char c;
        ssize_t r = recv(peers[i].fd, &c, 1, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        close(peers[i].fd);
        peers[i] = peers[--*n_conn];
        peers[*n_conn].fd = -1;
        dropped++;
    }
    return dropped;
}

/* Phase 1: hold connections until n_peers are open at once with none of them closed. */
static int bs_gather(int lfd, struct bs_peer *peers, struct pollfd *pfds, int n_peers,
                     const char *addr, double deadline, int timeout_ms, char *err, size_t errlen)
{
    int n_conn = 0;
    for (;;) {
        int full = n_conn == n_peers;
        for (int i = 0; i < n_conn; i++)
            pfds[i] = (struct pollfd){.fd = peers[i].fd, .events = POLLIN};
        pfds[n_conn] = (struct pollfd){.fd = full ? -1 : lfd, .events = POLLIN};
        /* Once full, one last look without waiting: a peer that went away meanwhile must not
         * be sent the blob in place of one still to come. */
        int nr = poll(pfds, (nfds_t)n_conn + 1, full ? 0 : bs_left_ms(deadline));
        if (nr < 0 && errno != EINTR)
            return ms_errf(err, errlen, "bootstrap: poll: %s", strerror(errno));
        if (nr < 0) continue;
        short listener = pfds[n_conn].revents;
        int dropped = bs_drop_talkers(peers, &n_conn, pfds);
        if (full && !dropped) return 0;
        if (listener && bs_accept(lfd, peers, &n_conn, n_peers, addr, err, errlen) < 0) return -1;
        if (n_conn < n_peers && bs_left_ms(deadline) == 0)
            return ms_errf(err, errlen,
                           "bootstrap: timed out after %d ms waiting for %d of %d peers on %s",
                           timeout_ms, n_peers - n_conn, n_peers, addr);
    }
}

/* Phase 2: send msg to every peer at once and read one acknowledgement byte from each. */
static int bs_deliver(struct bs_peer *peers, struct pollfd *pfds, int n_peers,
                      const unsigned char *msg, size_t total, double deadline, int timeout_ms,
                      char *err, size_t errlen)
{
    int n_acked = 0;
    while (n_acked < n_peers) {
        for (int i = 0; i < n_peers; i++)
            pfds[i] = (struct pollfd){.fd = peers[i].acked ? -1 : peers[i].fd,
                                      .events = peers[i].sent < total ? POLLOUT : POLLIN};
        int nr = poll(pfds, (nfds_t)n_peers, bs_left_ms(deadline));
        if (nr < 0 && errno != EINTR)
            return ms_errf(err, errlen, "bootstrap: poll: %s", strerror(errno));
        if (nr == 0 && bs_left_ms(deadline) == 0)
            return ms_errf(err, errlen,
                           "bootstrap: timed out after %d ms waiting for %d of %d peers to "
                           "acknowledge",
                           timeout_ms, n_peers - n_acked, n_peers);
        for (int i = 0; i < n_peers && nr > 0; i++) {
            struct bs_peer *p = &peers[i];
            if (!pfds[i].revents) continue;
            if (p->sent < total) {
                ssize_t w =
                    send(p->fd, msg + p->sent, total - p->sent, MSG_DONTWAIT | MSG_NOSIGNAL);
                if (w >= 0)
                    p->sent += (size_t)w;
                else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return ms_errf(err, errlen, "bootstrap: sending to peer %s: %s", p->name,
                                   strerror(errno));
                continue;
            }
            unsigned char a;
            ssize_t r = recv(p->fd, &a, 1, MSG_DONTWAIT);
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            if (r < 0)
                return ms_errf(err, errlen, "bootstrap: reading the acknowledgement of peer %s: %s",
                               p->name, strerror(errno));
            if (r == 0)
                return ms_errf(err, errlen,
                               "bootstrap: peer %s closed the connection before acknowledging",
                               p->name);
            if (a == BS_ACK_REJECTED)
                return ms_errf(err, errlen,
                               "bootstrap: peer %s rejected the blob (its log says why)", p->name);
            if (a != BS_ACK_KEPT)
                return ms_errf(err, errlen,
                               "bootstrap: peer %s answered 0x%02x instead of an acknowledgement",
                               p->name, a);
            p->acked = 1;
            n_acked++;
        }
    }
    return 0;
}

int bootstrap_serve(const char *host, int port, int n_peers, const void *blob, size_t len,
                    int timeout_ms, char *err, size_t errlen)
{
    char addr[BS_ADDR_LEN];
    bs_fmt_addr(addr, sizeof addr, host, port);
    if (bs_check_args("bootstrap_serve", port, blob, len, timeout_ms, err, errlen) < 0) return -1;
    if (n_peers < 1 || n_peers > BOOTSTRAP_MAX_PEERS)
        return ms_errf(err, errlen, "bootstrap_serve: bad peer count %d (1..%d)", n_peers,
                       BOOTSTRAP_MAX_PEERS);
    double deadline = ms_now() + timeout_ms / 1000.0;
    int rc = -1, lfd = -1;
    size_t total = BS_HEADER_LEN + len;
    struct bs_peer *peers = calloc((size_t)n_peers, sizeof *peers);
    struct pollfd *pfds = calloc((size_t)n_peers + 1, sizeof *pfds);
    unsigned char *msg = malloc(total);
    if (!peers || !pfds || !msg) {
        ms_errf(err, errlen, "bootstrap: out of memory for %d peers", n_peers);
        goto out;
    }
    for (int i = 0; i < n_peers; i++)
        peers[i].fd = -1;
    uint32_t be_len = htonl((uint32_t)len);
    memcpy(msg, bs_magic, BS_MAGIC_LEN);
    memcpy(msg + BS_MAGIC_LEN, &be_len, 4);
    if (len) memcpy(msg + BS_HEADER_LEN, blob, len);

    /* Room in the backlog for a few strangers besides the peers. */
    if (bs_listen(host, port, n_peers + 8, addr, &lfd, err, errlen) < 0) goto out;
    if (bs_gather(lfd, peers, pfds, n_peers, addr, deadline, timeout_ms, err, errlen) < 0) goto out;
    /* Latecomers are refused from here on rather than left waiting in the backlog. */
    close(lfd);
    lfd = -1;
    rc = bs_deliver(peers, pfds, n_peers, msg, total, deadline, timeout_ms, err, errlen);
out:
    if (lfd >= 0) close(lfd);
    for (int i = 0; peers && i < n_peers; i++)
        if (peers[i].fd >= 0) close(peers[i].fd);
    free(peers);
    free(pfds);
    free(msg);
    return rc;
}

/* ---- fetching side ---- */

/* One connection attempt to one resolved address: the connected socket, or -1 with the reason
 * in `last`. */
static int bs_try_connect(const struct addrinfo *ai, double deadline, char *last, size_t lastlen)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
        snprintf(last, lastlen, "socket: %s", strerror(errno));
        return -1;
    }
    /* EINTR leaves a non-blocking connect going on in the background, like EINPROGRESS. */
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS && errno != EINTR) {
        snprintf(last, lastlen, "%s", strerror(errno));
        close(fd);
        return -1;
    }
    int w = bs_wait(fd, POLLOUT, deadline);
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (w == 0)
        soerr = ETIMEDOUT;
    else if (w < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
        soerr = errno;
    if (soerr) {
        snprintf(last, lastlen, "%s", strerror(soerr));
        close(fd);
        return -1;
    }
    /* Retrying a local port nobody listens on can end in a TCP simultaneous open with itself
     * when the kernel picks that very port as the source; such a socket would wait on itself. */
    struct sockaddr_storage me, peer;
    socklen_t ml = sizeof me, pl = sizeof peer;
    if (getsockname(fd, (struct sockaddr *)&me, &ml) == 0 &&
        getpeername(fd, (struct sockaddr *)&peer, &pl) == 0 && ml == pl &&
        memcmp(&me, &peer, ml) == 0) {
        snprintf(last, lastlen, "%s", strerror(ECONNREFUSED));
        close(fd);
        return -1;
    }
    return fd;
}

/* Resolves and connects until one attempt succeeds or the deadline passes. */
static int bs_connect(const char *host, int port, const char *addr, double deadline, int timeout_ms,
                      int *out, char *err, size_t errlen)
{
    char serv[16], last[NI_MAXHOST + 128] = "no attempt finished";
    snprintf(serv, sizeof serv, "%d", port);
    int backoff = BS_BACKOFF_FIRST_MS;
    for (;;) {
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        /* A name that does not resolve yet (a pod whose DNS record is not published) is
         * retried like a refused connection. */
        int g = getaddrinfo(host, serv, &hints, &res);
        if (g != 0) snprintf(last, sizeof last, "cannot resolve %s: %s", host, bs_gai_error(g));
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = bs_try_connect(ai, deadline, last, sizeof last);
            if (fd >= 0) {
                freeaddrinfo(res);
                *out = fd;
                return 0;
            }
            if (bs_left_ms(deadline) == 0) break;
        }
        if (res) freeaddrinfo(res);
        int left = bs_left_ms(deadline);
        if (left == 0)
            return ms_errf(err, errlen,
                           "bootstrap: timed out after %d ms connecting to %s (last error: %s)",
                           timeout_ms, addr, last);
        /* An interrupted sleep only retries sooner. */
        poll(NULL, 0, backoff < left ? backoff : left);
        backoff = backoff * 2 > BS_BACKOFF_MAX_MS ? BS_BACKOFF_MAX_MS : backoff * 2;
    }
}

int bootstrap_fetch_checked(const char *host, int port, void *blob, size_t len, int timeout_ms,
                            int (*check)(const void *blob, size_t len, void *ctx, char *err,
                                         size_t errlen),
                            void *ctx, char *err, size_t errlen)
{
    if (!host || !*host) return ms_errf(err, errlen, "bootstrap_fetch: no host");
    if (bs_check_args("bootstrap_fetch", port, blob, len, timeout_ms, err, errlen) < 0) return -1;
    char addr[BS_ADDR_LEN];
    bs_fmt_addr(addr, sizeof addr, host, port);
    double deadline = ms_now() + timeout_ms / 1000.0;
    int fd = -1, rc = -1;
    unsigned char hdr[BS_HEADER_LEN];
    if (bs_connect(host, port, addr, deadline, timeout_ms, &fd, err, errlen) < 0) return -1;
    if (bs_read_full(fd, hdr, sizeof hdr, "header", addr, deadline, timeout_ms, err, errlen) < 0)
        goto out;
    if (memcmp(hdr, bs_magic, BS_MAGIC_LEN) != 0) {
        ms_errf(err, errlen, "bootstrap: %s is not a moeserve bootstrap server (bad magic)", addr);
        goto out;
    }
    uint32_t be_len;
    memcpy(&be_len, hdr + BS_MAGIC_LEN, 4);
    uint32_t n = ntohl(be_len);
    if (n != len) {
        ms_errf(err, errlen,
                "bootstrap: %s sends a %u-byte blob where this process expects %zu bytes "
                "(different builds?)",
                addr, n, len);
        goto out;
    }
    if (bs_read_full(fd, blob, len, "blob", addr, deadline, timeout_ms, err, errlen) < 0) goto out;
    char why[MS_ERR_LEN] = "";
    int bad = check && check(blob, len, ctx, why, sizeof why) < 0;
    unsigned char ack = bad ? BS_ACK_REJECTED : BS_ACK_KEPT;
    rc = bs_write_full(fd, &ack, 1, "acknowledgement", addr, deadline, timeout_ms, err, errlen);
    /* The check's reason matters more than whether the server heard the rejection. */
    if (bad) rc = ms_errf(err, errlen, "%s", why[0] ? why : "bootstrap: blob rejected");
out:
    close(fd);
    return rc;
}

int bootstrap_fetch(const char *host, int port, void *blob, size_t len, int timeout_ms, char *err,
                    size_t errlen)
{
    return bootstrap_fetch_checked(host, port, blob, len, timeout_ms, NULL, NULL, err, errlen);
}

int bootstrap_parse_addr(const char *s, char *host, size_t hostlen, int *port, char *err,
                         size_t errlen)
{
    if (!host || !hostlen || !port) return ms_errf(err, errlen, "bootstrap: no room for the host");
    if (!s || !*s) return ms_errf(err, errlen, "bootstrap: empty address (want host:port)");
    const char *h, *colon;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close) return ms_errf(err, errlen, "bootstrap: address '%s' lacks a closing ']'", s);
        if (close[1] != ':')
            return ms_errf(err, errlen, "bootstrap: address '%s' lacks ':port' after ']'", s);
        h = s + 1;
        colon = close + 1;
        if (close == h) return ms_errf(err, errlen, "bootstrap: address '%s' has no host", s);
    } else {
        colon = strrchr(s, ':');
        if (!colon) return ms_errf(err, errlen, "bootstrap: address '%s' lacks ':port'", s);
        if (memchr(s, ':', (size_t)(colon - s)))
            return ms_errf(err, errlen,
                           "bootstrap: address '%s': write an IPv6 address in brackets, "
                           "as [addr]:port",
                           s);
        h = s;
        if (colon == h) return ms_errf(err, errlen, "bootstrap: address '%s' has no host", s);
    }
    size_t hl = (size_t)((s[0] == '[' ? colon - 1 : colon) - h);
    const char *d = colon + 1;
    size_t nd = strspn(d, "0123456789");
    long v = 0;
    for (size_t i = 0; i < nd && i < 6; i++)
        v = v * 10 + (d[i] - '0');
    if (nd == 0 || d[nd] != '\0' || nd > 5 || v < 1 || v > 65535)
        return ms_errf(err, errlen, "bootstrap: address '%s': port must be a number in 1..65535",
                       s);
    if (hl >= hostlen)
        return ms_errf(err, errlen, "bootstrap: host of '%s' is longer than %zu bytes", s,
                       hostlen - 1);
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (int)v;
    return 0;
}
