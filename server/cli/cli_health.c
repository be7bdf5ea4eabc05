/* `moeserve healthcheck`: GET /health on the local server, exit 0 on 200 and 1 otherwise, so a
 * container's HEALTHCHECK needs no curl in the image. It reads the server's own --host/--port
 * environment (MOESERVE_HOST, MOESERVE_PORT) unless given flags; a wildcard host (0.0.0.0) is
 * reached on loopback. Bounded: 5 s in all by default (--timeout). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Waits for fd to be ready for `events` until `deadline`; 0 when ready, -1 on timeout/error. */
static int wait_fd(int fd, short events, double deadline)
{
    for (;;) {
        int ms = (int)((deadline - now_s()) * 1000.0);
        if (ms <= 0) return -1;
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, ms);
        if (rc > 0) return 0;
        if (rc < 0 && errno != EINTR) return -1;
    }
}

/* Returns the HTTP status of GET /health, or -1 with a reason in err. */
static int get_health(const char *host, int port, double timeout_s, char *err, size_t errlen)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (strcmp(host, "0.0.0.0") == 0) host = "127.0.0.1";
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        snprintf(err, errlen, "host '%s' is not an IPv4 address", host);
        return -1;
    }
    double deadline = now_s() + timeout_s;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), status = -1;
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 &&
        (errno != EINPROGRESS || wait_fd(fd, POLLOUT, deadline) != 0)) {
        snprintf(err, errlen, "cannot connect to %s:%d: %s", host, port,
                 errno == EINPROGRESS ? "timed out" : strerror(errno));
        goto out;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    if (soerr) {
        snprintf(err, errlen, "cannot connect to %s:%d: %s", host, port, strerror(soerr));
        goto out;
    }
    char req[128];
    int n = snprintf(req, sizeof req, "GET /health HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n",
                     host, port);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
        snprintf(err, errlen, "cannot send the request");
        goto out;
    }
    char buf[64];
    size_t got = 0;
    while (got < 12) { /* "HTTP/1.1 200" */
        if (wait_fd(fd, POLLIN, deadline) != 0) {
            snprintf(err, errlen, "no answer from %s:%d within %.0f s", host, port, timeout_s);
            goto out;
        }
        ssize_t r = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            snprintf(err, errlen, "the connection closed before an answer");
            goto out;
        }
        got += (size_t)r;
    }
    buf[got] = '\0';
    if (strncmp(buf, "HTTP/1.", 7) != 0 || sscanf(buf + 9, "%3d", &status) != 1) {
        snprintf(err, errlen, "not an HTTP answer");
        status = -1;
    }
out:
    close(fd);
    return status;
}

int cli_healthcheck(int argc, char **argv)
{
    const char *host = getenv("MOESERVE_HOST"), *port_s = getenv("MOESERVE_PORT");
    double timeout_s = 5.0;
    if (!host || !*host) host = "127.0.0.1";
    if (!port_s || !*port_s) port_s = "8000";
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: moeserve healthcheck [--host H] [--port P] [--timeout S]\n"
                   "GET /health on a running server: exit 0 when it answers 200 (ready), 1 "
                   "otherwise.\nDefaults: MOESERVE_HOST (0.0.0.0 means loopback) or 127.0.0.1, "
                   "MOESERVE_PORT or 8000, 5 s.\n");
            return 0;
        }
        if (!v || (strcmp(a, "--host") != 0 && strcmp(a, "--port") != 0 &&
                   strcmp(a, "--timeout") != 0)) {
            fprintf(stderr, "moeserve healthcheck: unknown option or missing value '%s'\n", a);
            return 2;
        }
        if (strcmp(a, "--host") == 0) host = v;
        else if (strcmp(a, "--port") == 0) port_s = v;
        else timeout_s = atof(v);
    }
    char *end;
    long port = strtol(port_s, &end, 10);
    if (*end || port < 1 || port > 65535 || !(timeout_s > 0)) {
        fprintf(stderr, "moeserve healthcheck: port must be 1..65535 and timeout > 0\n");
        return 2;
    }
    char err[160];
    int st = get_health(host, (int)port, timeout_s, err, sizeof err);
    if (st == 200) return 0;
    if (st < 0) fprintf(stderr, "moeserve healthcheck: %s\n", err);
    else fprintf(stderr, "moeserve healthcheck: /health answered %d\n", st);
    return 1;
}
