/* Tests for the TCP rendezvous (engine/comm/bootstrap.c) over 127.0.0.1: three peers fetching one
 * random blob; a fetcher with nobody listening, a server short of peers, and fake servers that
 * send a wrong magic, a wrong length, a cut blob or nothing at all, each failing in time with a
 * message saying what went wrong; a stranger that connects and leaves before the peers; a peer
 * whose check rejects the blob; a port already taken; and address parsing. Built with NCCL,
 * also the shape checks of comm_nccl_create_world, which run before any device is touched (so
 * here without a GPU too; the rendezvous itself needs one GPU per rank). At the end no
 * descriptor may be left open. Ports come from binding port 0, so tests never collide with a
 * fixed port in use. */
#include "bootstrap.h"
#include "common.h"
#include "test.h"
#ifdef MOESERVE_HAVE_NCCL
#include "cuda/comm_nccl.h"
#endif

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { BLOB = 128, MAX_FETCH = 4 };

/* A listening socket on 127.0.0.1 and an ephemeral port, or -1. */
static int listen_any(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 8) < 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) < 0) {
        close(fd);
        return -1;
    }
    *port = ntohs(sa.sin_port);
    return fd;
}

/* A port that was free a moment ago (nobody listens on it once this returns). */
static int free_port(void)
{
    int port = 0, fd = listen_any(&port);
    if (fd < 0) return 0;
    close(fd);
    return port;
}

struct fetch_job {
    pthread_t tid;
    int port, timeout_ms, rc;
    int reject; /* the check refuses the blob */
    unsigned char blob[BLOB];
    char err[512];
};

static int reject_check(const void *blob, size_t len, void *ctx, char *err, size_t errlen)
{
    (void)blob;
    (void)len;
    (void)ctx;
    return ms_errf(err, errlen, "test check: world size differs");
}

static void *fetch_main(void *arg)
{
    struct fetch_job *j = arg;
    j->rc = bootstrap_fetch_checked("127.0.0.1", j->port, j->blob, sizeof j->blob, j->timeout_ms,
                                    j->reject ? reject_check : NULL, NULL, j->err, sizeof j->err);
    return NULL;
}

static void fetch_start(struct fetch_job *j, int port, int timeout_ms, int reject)
{
    memset(j->blob, 0, sizeof j->blob);
    j->reject = reject;
    j->port = port;
    j->timeout_ms = timeout_ms;
    j->rc = 99;
    j->err[0] = '\0';
    if (pthread_create(&j->tid, NULL, fetch_main, j) != 0) {
        fprintf(stderr, "pthread_create failed\n");
        exit(1);
    }
}

struct serve_job {
    pthread_t tid;
    int port, n_peers, timeout_ms, rc;
    unsigned char blob[BLOB];
    char err[512];
};

static void *serve_main(void *arg)
{
    struct serve_job *s = arg;
    s->rc = bootstrap_serve("127.0.0.1", s->port, s->n_peers, s->blob, sizeof s->blob,
                            s->timeout_ms, s->err, sizeof s->err);
    return NULL;
}

static void serve_start(struct serve_job *s, int port, int n_peers, int timeout_ms)
{
    for (int i = 0; i < BLOB; i++)
        s->blob[i] = (unsigned char)(rand() & 0xff);
    s->port = port;
    s->n_peers = n_peers;
    s->timeout_ms = timeout_ms;
    s->rc = 99;
    s->err[0] = '\0';
    if (pthread_create(&s->tid, NULL, serve_main, s) != 0) {
        fprintf(stderr, "pthread_create failed\n");
        exit(1);
    }
}

static void test_three_peers(void)
{
    struct serve_job s;
    struct fetch_job f[3];
    int port = free_port();
    CHECK(port > 0);
    serve_start(&s, port, 3, 5000);
    for (int i = 0; i < 3; i++)
        fetch_start(&f[i], port, 5000, 0);
    for (int i = 0; i < 3; i++)
        pthread_join(f[i].tid, NULL);
    pthread_join(s.tid, NULL);
    CHECKF(s.rc == 0, "serve: %s", s.err);
    for (int i = 0; i < 3; i++) {
        CHECKF(f[i].rc == 0, "fetch %d: %s", i, f[i].err);
        CHECKF(memcmp(f[i].blob, s.blob, BLOB) == 0, "fetch %d got a different blob", i);
    }
}

/* Fetchers started before the server wait for it, then all get the blob. */
static void test_server_late(void)
{
    struct serve_job s;
    struct fetch_job f[2];
    int port = free_port();
    for (int i = 0; i < 2; i++)
        fetch_start(&f[i], port, 5000, 0);
    /* The server comes 50 ms later, so the fetchers most likely meet refused connections
     * first; either order must end the same way. */
    poll(NULL, 0, 50);
    serve_start(&s, port, 2, 5000);
    for (int i = 0; i < 2; i++)
        pthread_join(f[i].tid, NULL);
    pthread_join(s.tid, NULL);
    CHECKF(s.rc == 0, "serve: %s", s.err);
    for (int i = 0; i < 2; i++) {
        CHECKF(f[i].rc == 0, "late server, fetch %d: %s", i, f[i].err);
        CHECK(memcmp(f[i].blob, s.blob, BLOB) == 0);
    }
}

static void test_nobody_listening(void)
{
    unsigned char blob[BLOB];
    char err[512] = "";
    int port = free_port();
    double t0 = ms_now();
    int rc = bootstrap_fetch("127.0.0.1", port, blob, sizeof blob, 300, err, sizeof err);
    double dt = ms_now() - t0;
    CHECK(rc == -1);
    CHECKF(strstr(err, "timed out after 300 ms") != NULL, "message: %s", err);
    CHECKF(strstr(err, "refused") != NULL, "message lacks the last error: %s", err);
    /* It kept retrying until the deadline, and stopped soon after it. */
    CHECKF(dt >= 0.29 && dt < 1.5, "took %.3f s", dt);
}

static void test_too_few_peers(void)
{
    struct serve_job s;
    struct fetch_job f;
    int port = free_port();
    double t0 = ms_now();
    serve_start(&s, port, 3, 300);
    fetch_start(&f, port, 3000, 0);
    pthread_join(s.tid, NULL);
    double dt = ms_now() - t0;
    pthread_join(f.tid, NULL);
    CHECK(s.rc == -1);
    CHECKF(strstr(s.err, "timed out after 300 ms waiting for 2 of 3 peers") != NULL, "serve: %s",
           s.err);
    CHECKF(dt >= 0.29 && dt < 1.5, "serve took %.3f s", dt);
    /* All or nothing: the one peer that came is not left holding the blob. */
    CHECK(f.rc == -1);
    CHECKF(strstr(f.err, "closed the connection after 0 of 12 bytes") != NULL, "fetch: %s", f.err);
    unsigned char zero[BLOB] = {0};
    CHECK(memcmp(f.blob, zero, BLOB) == 0);
}

/* A connection that comes and goes before the peers does not take a peer's place. */
static void test_stranger(void)
{
    struct serve_job s;
    struct fetch_job f[2];
    int port = free_port();
    serve_start(&s, port, 2, 5000);
    int fd = -1;
    double t0 = ms_now();
    while (fd < 0 && ms_now() - t0 < 5) {
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)port),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
            close(fd);
            fd = -1;
            poll(NULL, 0, 5);
        }
    }
    CHECK(fd >= 0);
    if (fd >= 0) close(fd);
    for (int i = 0; i < 2; i++)
        fetch_start(&f[i], port, 5000, 0);
    for (int i = 0; i < 2; i++)
        pthread_join(f[i].tid, NULL);
    pthread_join(s.tid, NULL);
    CHECKF(s.rc == 0, "serve with a stranger: %s", s.err);
    for (int i = 0; i < 2; i++) {
        CHECKF(f[i].rc == 0, "fetch %d: %s", i, f[i].err);
        CHECK(memcmp(f[i].blob, s.blob, BLOB) == 0);
    }
}

static void test_rejected(void)
{
    struct serve_job s;
    struct fetch_job f[2];
    int port = free_port();
    serve_start(&s, port, 2, 5000);
    fetch_start(&f[0], port, 5000, 0);
    fetch_start(&f[1], port, 5000, 1);
    double t0 = ms_now();
    for (int i = 0; i < 2; i++)
        pthread_join(f[i].tid, NULL);
    pthread_join(s.tid, NULL);
    CHECKF(s.rc == -1 && strstr(s.err, "rejected the blob") != NULL, "serve: %s", s.err);
    /* Told at once, not after its 5 s deadline. */
    CHECKF(ms_now() - t0 < 2.0, "rejection took %.3f s", ms_now() - t0);
    CHECKF(f[0].rc == 0, "accepting peer: %s", f[0].err);
    CHECKF(f[1].rc == -1 && strcmp(f[1].err, "test check: world size differs") == 0,
           "rejecting peer: %s", f[1].err);
}

static void test_port_taken(void)
{
    int port = 0, fd = listen_any(&port);
    char err[512] = "";
    unsigned char blob[BLOB] = {0};
    CHECK(fd >= 0);
    int rc = bootstrap_serve("127.0.0.1", port, 1, blob, sizeof blob, 300, err, sizeof err);
    char want[64];
    snprintf(want, sizeof want, "cannot listen on 127.0.0.1:%d", port);
    CHECK(rc == -1);
    CHECKF(strstr(err, want) != NULL && strstr(err, "Address already in use") != NULL,
           "message: %s", err);
    if (fd >= 0) close(fd);
}

/* ---- fake servers ---- */

struct fake {
    pthread_t tid;
    int lfd;
    const unsigned char *bytes;
    size_t n;
    int hold_ms; /* keep the connection open this long after sending */
    int got_ack; /* OUT: the byte the client answered, -1 for none */
};

static void *fake_main(void *arg)
{
    struct fake *fk = arg;
    fk->got_ack = -1;
    struct pollfd p = {.fd = fk->lfd, .events = POLLIN};
    if (poll(&p, 1, 5000) != 1) return NULL;
    int fd = accept(fk->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    if (fk->n && send(fd, fk->bytes, fk->n, MSG_NOSIGNAL) != (ssize_t)fk->n) {
        close(fd);
        return NULL;
    }
    /* Wait for an answer or the client's close, up to hold_ms. */
    struct pollfd q = {.fd = fd, .events = POLLIN};
    unsigned char a;
    if (poll(&q, 1, fk->hold_ms) == 1 && recv(fd, &a, 1, 0) == 1) fk->got_ack = a;
    close(fd);
    return NULL;
}

/* Runs bootstrap_fetch of BLOB bytes (timeout_ms) against a server that sends `bytes`. */
static int fetch_from_fake(const unsigned char *bytes, size_t n, int hold_ms, int timeout_ms,
                           int *got_ack, char *err, size_t errlen)
{
    struct fake fk = {.bytes = bytes, .n = n, .hold_ms = hold_ms};
    int port = 0;
    fk.lfd = listen_any(&port);
    if (fk.lfd < 0) return ms_errf(err, errlen, "test: cannot listen");
    if (pthread_create(&fk.tid, NULL, fake_main, &fk) != 0) {
        close(fk.lfd);
        return ms_errf(err, errlen, "test: pthread_create failed");
    }
    unsigned char blob[BLOB];
    int rc = bootstrap_fetch("127.0.0.1", port, blob, sizeof blob, timeout_ms, err, errlen);
    pthread_join(fk.tid, NULL);
    close(fk.lfd);
    *got_ack = fk.got_ack;
    return rc;
}

static size_t make_msg(unsigned char *m, const char *magic, uint32_t len, size_t blob_bytes)
{
    uint32_t be = htonl(len);
    memcpy(m, magic, 8);
    memcpy(m + 8, &be, 4);
    memset(m + 12, 0xab, blob_bytes);
    return 12 + blob_bytes;
}

static void test_fake_servers(void)
{
    unsigned char m[12 + BLOB];
    char err[512] = "";
    int ack;
    size_t n;

    /* A well-formed message is acknowledged: the fake is a faithful server. */
    n = make_msg(m, "MSBOOT1", BLOB, BLOB);
    CHECKF(fetch_from_fake(m, n, 2000, 2000, &ack, err, sizeof err) == 0, "good fake: %s", err);
    CHECK(ack == 'K');

    n = make_msg(m, "HTTP/1.1", BLOB, BLOB);
    CHECK(fetch_from_fake(m, n, 2000, 2000, &ack, err, sizeof err) == -1);
    CHECKF(strstr(err, "not a moeserve bootstrap server (bad magic)") != NULL, "magic: %s", err);
    CHECK(ack == -1);

    n = make_msg(m, "MSBOOT1", 64, 64);
    CHECK(fetch_from_fake(m, n, 2000, 2000, &ack, err, sizeof err) == -1);
    CHECKF(strstr(err, "sends a 64-byte blob where this process expects 128 bytes") != NULL,
           "length: %s", err);
    CHECK(ack == -1);

    n = make_msg(m, "MSBOOT1", 0x7fffffffu, 0);
    CHECK(fetch_from_fake(m, n, 2000, 2000, &ack, err, sizeof err) == -1);
    CHECKF(strstr(err, "sends a 2147483647-byte blob") != NULL, "huge length: %s", err);

    /* Cut short: the header and 10 bytes of blob, then close. */
    n = make_msg(m, "MSBOOT1", BLOB, 10);
    CHECK(fetch_from_fake(m, n, 0, 2000, &ack, err, sizeof err) == -1);
    CHECKF(strstr(err, "closed the connection after 10 of 128 bytes of the blob") != NULL,
           "short read: %s", err);

    /* Half a header. */
    CHECK(fetch_from_fake(m, 5, 0, 2000, &ack, err, sizeof err) == -1);
    CHECKF(strstr(err, "closed the connection after 5 of 12 bytes of the header") != NULL,
           "short header: %s", err);

    /* Accepts and says nothing: the fetch gives up at its deadline. */
    double t0 = ms_now();
    CHECK(fetch_from_fake(m, 0, 3000, 300, &ack, err, sizeof err) == -1);
    double dt = ms_now() - t0;
    CHECKF(strstr(err, "timed out after 300 ms waiting for the header") != NULL, "silent: %s", err);
    CHECKF(dt < 3.0, "silent server: fetch took %.3f s", dt);
}

static void test_bad_args(void)
{
    char err[512];
    unsigned char blob[BLOB] = {0};
    CHECK(bootstrap_serve("127.0.0.1", 0, 1, blob, BLOB, 100, err, sizeof err) == -1);
    CHECKF(strstr(err, "bad port 0") != NULL, "%s", err);
    CHECK(bootstrap_serve("127.0.0.1", 29500, 0, blob, BLOB, 100, err, sizeof err) == -1);
    CHECKF(strstr(err, "bad peer count 0") != NULL, "%s", err);
    CHECK(bootstrap_serve("127.0.0.1", 29500, 1, blob, BLOB, 0, err, sizeof err) == -1);
    CHECKF(strstr(err, "timeout must be positive") != NULL, "%s", err);
    CHECK(bootstrap_fetch("127.0.0.1", 70000, blob, BLOB, 100, err, sizeof err) == -1);
    CHECKF(strstr(err, "bad port 70000") != NULL, "%s", err);
    CHECK(bootstrap_fetch("", 29500, blob, BLOB, 100, err, sizeof err) == -1);
    CHECKF(strstr(err, "no host") != NULL, "%s", err);
    CHECK(bootstrap_fetch("127.0.0.1", 29500, blob, BOOTSTRAP_MAX_BLOB + 1, 100, err, sizeof err) ==
          -1);
    CHECKF(strstr(err, "over the") != NULL, "%s", err);
}

static void test_parse_addr(void)
{
    static const struct {
        const char *in, *host;
        int port;
    } good[] = {
        {"127.0.0.1:29500", "127.0.0.1", 29500},
        {"node-0.moeserve.svc:1", "node-0.moeserve.svc", 1},
        {"[::1]:65535", "::1", 65535},
        {"[fe80::1%eth0]:80", "fe80::1%eth0", 80},
        {"0.0.0.0:00080", "0.0.0.0", 80},
    };
    static const struct {
        const char *in, *why;
    } bad[] = {
        {"", "empty address"},
        {"localhost", "lacks ':port'"},
        {":29500", "has no host"},
        {"[]:29500", "has no host"},
        {"host:", "port must be"},
        {"host:0", "port must be"},
        {"host:65536", "port must be"},
        {"host:123456", "port must be"},
        {"host:29500x", "port must be"},
        {"host:-1", "port must be"},
        {"host: 80", "port must be"},
        {"::1:29500", "in brackets"},
        {"[::1]", "lacks ':port' after ']'"},
        {"[::1:29500", "lacks a closing ']'"},
        {"[::1]x29500", "lacks ':port' after ']'"},
    };
    char host[64], err[512];
    int port;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        port = -1;
        int rc = bootstrap_parse_addr(good[i].in, host, sizeof host, &port, err, sizeof err);
        CHECKF(rc == 0, "'%s': %s", good[i].in, err);
        if (rc == 0)
            CHECKF(strcmp(host, good[i].host) == 0 && port == good[i].port, "'%s' -> '%s' %d",
                   good[i].in, host, port);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        int rc = bootstrap_parse_addr(bad[i].in, host, sizeof host, &port, err, sizeof err);
        CHECKF(rc == -1 && strstr(err, bad[i].why) != NULL, "'%s': rc %d, '%s'", bad[i].in, rc,
               err);
    }
    /* The host must fit, with its NUL. */
    char small[9];
    CHECK(bootstrap_parse_addr("123456789:1", small, sizeof small, &port, err, sizeof err) == -1);
    CHECKF(strstr(err, "longer than 8 bytes") != NULL, "%s", err);
    CHECK(bootstrap_parse_addr("12345678:1", small, sizeof small, &port, err, sizeof err) == 0);
    CHECK(strcmp(small, "12345678") == 0);
}

#ifdef MOESERVE_HAVE_NCCL
static void test_nccl_world_shapes(void)
{
    static const struct {
        int world, n_procs, first, n_local;
        const char *why;
    } bad[] = {
        {0, 1, 0, 1, "do not fit in a world of 0"},
        {4, 2, 3, 2, "ranks 3..4 do not fit in a world of 4"},
        {4, 2, -1, 1, "do not fit"},
        {4, 0, 0, 2, "bad process count 0"},
        {4, 1, 0, 2, "a single process must drive all 4 ranks, this one drives 2"},
        {4, 2, 0, 4, "1 other processes cannot each hold one of the 0 ranks"},
        {4, 4, 0, 2, "3 other processes cannot each hold one of the 2 ranks"},
    };
    int devices[4] = {0, 1, 2, 3};
    char err[512];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        struct comm *c =
            comm_nccl_create_world(bad[i].world, bad[i].n_procs, bad[i].first, bad[i].n_local,
                                   devices, "127.0.0.1", 29500, 300, err, sizeof err);
        CHECKF(c == NULL && strstr(err, bad[i].why) != NULL, "shape %zu: %s", i, err);
        if (c) c->ops->destroy(c);
    }
}
#endif

/* Open file descriptors of this process, to show that no path leaks a socket. */
static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d) return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    srand((unsigned)time(NULL));
    int fds = count_fds();
    test_parse_addr();
    test_bad_args();
    test_three_peers();
    test_server_late();
    test_nobody_listening();
    test_too_few_peers();
    test_stranger();
    test_rejected();
    test_port_taken();
    test_fake_servers();
#ifdef MOESERVE_HAVE_NCCL
    test_nccl_world_shapes();
#endif
    CHECKF(count_fds() == fds, "%d descriptors open before, %d after", fds, count_fds());
    return test_done("test_bootstrap");
}
