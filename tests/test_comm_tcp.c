/* The TCP communicator across 3 forked processes on loopback: the exchange and message checks
 * of comm_check.h; a rank that announces another world size is refused and a rank with nobody
 * to join gives up at its setup deadline with a reason; a rank that stops taking part (it waits
 * on a pipe, as a hung process would) is named by rank 0 within the deadline, the rank waiting
 * on rank 0 names rank 0, and the communicator then fails at once; a rank whose process exits
 * is reported as gone at once. */
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm_tcp.h"
#include "common.h"
#include "test.h"
#include "comm_check.h"

#define WORLD 3

/* A port the kernel just handed out (tiny race with other processes binding the same). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &l) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

/* Rank `me` of the good run. */
static void good_rank(int me, int port)
{
    char err[MS_ERR_LEN];
    struct comm *c = comm_tcp_create(WORLD, me, "127.0.0.1", port, 10000, 10000, err, sizeof err);
    CHECKF(c != NULL, "rank %d: %s", me, err);
    if (!c) return;
    CHECK(c->n_rank == WORLD && c->self == me && strcmp(c->ops->name, "tcp") == 0);
    test_exchange(c);
    test_p2p(c);
    c->ops->barrier(c, me);
    CHECK(c->ops->status(c, err, sizeof err) == 0);
    c->ops->destroy(c);
}

/* Rank `me` of the failure run: the last rank joins, then waits on `hold` instead of taking
 * part; the others exchange with a 0.5 s deadline. */
static void silent_rank(int me, int port, int hold)
{
    char err[MS_ERR_LEN], why[256] = "";
    struct comm *c = comm_tcp_create(WORLD, me, "127.0.0.1", port, 500, 10000, err, sizeof err);
    CHECKF(c != NULL, "rank %d: %s", me, err);
    if (!c) return;
    if (me == WORLD - 1) {
        char b;
        CHECK(read(hold, &b, 1) == 0); /* until the parent closes it */
        c->ops->destroy(c);
        return;
    }
    int sc[WORLD] = {1, 1, 1}, rc[WORLD];
    float send[WORLD] = {0}, recv[WORLD * 4];
    double t0 = ms_now();
    int r = c->ops->all_to_all_v(c, me, send, sc, recv, rc, sizeof(float));
    double waited = ms_now() - t0;
    CHECKF(r == -1, "rank %d: the exchange with a silent rank returned %d", me, r);
    CHECK(c->ops->status(c, why, sizeof why) == -1);
    /* rank 0 waits for the silent rank; rank 1 waits for rank 0, which relays, and which may
     * time out first and leave */
    char want[32];
    snprintf(want, sizeof want, "rank %d did not answer", me == 0 ? WORLD - 1 : 0);
    CHECKF(strstr(why, want) != NULL ||
               (me != 0 && strstr(why, "rank 0 closed its connection") != NULL),
           "rank %d: reason '%s' lacks '%s'", me, why, want);
    CHECKF(waited >= 0.45 && waited < 5.0, "rank %d waited %.2f s", me, waited);
    t0 = ms_now();
    size_t got;
    CHECK(c->ops->all_to_all_v(c, me, send, sc, recv, rc, sizeof(float)) == -1);
    CHECK(c->ops->recv(c, me == 0 ? 1 : 0, recv, sizeof recv, &got) == -1);
    CHECK(ms_now() - t0 < 0.1);
    c->ops->destroy(c);
}

/* Rank 1 of 2 exits right after joining: rank 0's next receive says it is gone, at once. */
static void gone_rank(int me, int port)
{
    char err[MS_ERR_LEN], why[256] = "";
    struct comm *c = comm_tcp_create(2, me, "127.0.0.1", port, 10000, 10000, err, sizeof err);
    CHECKF(c != NULL, "rank %d: %s", me, err);
    if (!c) return;
    if (me == 1) {
        c->ops->destroy(c);
        return;
    }
    char buf[16];
    size_t got;
    double t0 = ms_now();
    CHECK(c->ops->recv(c, 1, buf, sizeof buf, &got) == -1);
    CHECK(ms_now() - t0 < 5.0);
    CHECK(c->ops->status(c, why, sizeof why) == -1);
    CHECKF(strstr(why, "rank 1 closed its connection") != NULL, "reason '%s'", why);
    c->ops->destroy(c);
}

/* Runs fn(rank, port) in `world` children; the number of children that failed. */
static int run_world(int world, void (*fn)(int, int), int port)
{
    pid_t pids[WORLD];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            test_failed_ = 0; /* a child's verdict is its own */
            fn(r, port);
            fflush(NULL);
            _exit(test_failed_ ? 1 : 0);
        }
    }
    int bad = 0;
    for (int r = 0; r < world; r++) {
        int st = 0;
        if (pids[r] < 0 || waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) bad++;
    }
    return bad;
}

int main(void)
{
    char err[MS_ERR_LEN];
    int port = free_port();
    CHECK(port > 0);
    CHECKF(run_world(WORLD, good_rank, port) == 0, "a rank of the good run failed");

    /* nobody listening: the setup deadline, with a reason naming the address */
    double t0 = ms_now();
    CHECK(comm_tcp_create(2, 1, "127.0.0.1", free_port(), 1000, 500, err, sizeof err) == NULL);
    CHECKF(strstr(err, "cannot join rank 0 at 127.0.0.1") != NULL, "%s", err);
    CHECK(ms_now() - t0 < 5.0);
    CHECK(comm_tcp_create(1, 0, "127.0.0.1", 29500, 1000, 500, err, sizeof err) == NULL);

    /* a rank of another world size is refused; rank 0 then gives up at its deadline */
    port = free_port();
    pid_t p = fork();
    if (p == 0) {
        test_failed_ = 0;
        struct comm *c = comm_tcp_create(3, 1, "127.0.0.1", port, 1000, 1500, err, sizeof err);
        _exit(c == NULL && strstr(err, "refused") ? 0 : 1);
    }
    CHECK(comm_tcp_create(2, 0, "127.0.0.1", port, 1000, 1000, err, sizeof err) == NULL);
    CHECKF(strstr(err, "0 of 1 ranks joined") != NULL, "%s", err);
    int st = 0;
    CHECK(waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 0);

    int hold[2];
    CHECK(pipe(hold) == 0);
    port = free_port();
    pid_t pids[WORLD];
    for (int r = 0; r < WORLD; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            test_failed_ = 0;
            close(hold[1]);
            silent_rank(r, port, hold[0]);
            fflush(NULL);
            _exit(test_failed_ ? 1 : 0);
        }
    }
    close(hold[0]);
    int bad = 0;
    for (int r = 0; r < WORLD - 1; r++)
        if (waitpid(pids[r], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) bad++;
    close(hold[1]); /* releases the silent rank */
    if (waitpid(pids[WORLD - 1], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) bad++;
    CHECKF(bad == 0, "%d ranks of the failure run failed", bad);

    CHECKF(run_world(2, gone_rank, free_port()) == 0, "a rank of the gone run failed");
    return test_done("test_comm_tcp");
}
