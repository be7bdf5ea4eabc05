/* mhd_server: the smallest libmicrohttpd server shaped like moeserve's use of it (before issue
 * 12): JSON answers, a request that waits on "the engine" with its connection suspended, the
 * 300 s connection timeout the server had then. Used only by mhd_repro.py, which measures the
 * library's defects that made us write server/h1.c; not part of the build.
 *
 *   cc -O1 -o mhd_server mhd_server.c $(pkg-config --cflags --libs libmicrohttpd) -lpthread
 *   ./mhd_server PORT epoll|poll WAIT_S
 *
 * Routes: any URL answers {"ok":true}; /wait suspends the connection for WAIT_S seconds (a
 * thread resumes it) before answering. Every finished request and every closed connection is
 * printed to stdout with its time since start, so the driver can see when the library noticed. */
#include <microhttpd.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double t_start;
static double wait_s;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct req {
    struct MHD_Connection *conn;
    int suspended, resumed;
    char url[64];
};

static void *resumer(void *arg)
{
    struct req *r = arg;
    usleep((useconds_t)(wait_s * 1e6));
    r->resumed = 1;
    MHD_resume_connection(r->conn);
    return NULL;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *data,
                                  size_t *size, void **state)
{
    (void)cls, (void)method, (void)version, (void)data;
    struct req *r = *state;
    if (!r) {
        r = calloc(1, sizeof *r);
        r->conn = conn;
        snprintf(r->url, sizeof r->url, "%s", url);
        *state = r;
        return MHD_YES;
    }
    if (*size) { /* the body is read and dropped */
        *size = 0;
        return MHD_YES;
    }
    if (strcmp(url, "/wait") == 0 && !r->resumed) {
        if (!r->suspended) {
            r->suspended = 1;
            printf("suspended %s at %.3f\n", url, now() - t_start);
            fflush(stdout);
            MHD_suspend_connection(conn);
            pthread_t t;
            pthread_create(&t, NULL, resumer, r);
            pthread_detach(t);
        }
        return MHD_YES;
    }
    static const char body[] = "{\"ok\":true}";
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(sizeof body - 1, (void *)body, MHD_RESPMEM_PERSISTENT);
    MHD_add_response_header(resp, "Content-Type", "application/json");
    enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return ret;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **state,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)conn;
    struct req *r = *state;
    printf("completed %s at %.3f code %d\n", r ? r->url : "?", now() - t_start, (int)toe);
    fflush(stdout);
    free(r);
    *state = NULL;
}

static void on_conn(void *cls, struct MHD_Connection *conn, void **socket_context,
                    enum MHD_ConnectionNotificationCode code)
{
    (void)cls, (void)conn, (void)socket_context;
    if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        printf("closed at %.3f\n", now() - t_start);
        fflush(stdout);
    }
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: mhd_server PORT epoll|poll WAIT_S\n");
        return 2;
    }
    t_start = now();
    wait_s = atof(argv[3]);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_ALLOW_SUSPEND_RESUME;
    flags |= strcmp(argv[2], "epoll") == 0 ? MHD_USE_EPOLL : MHD_USE_POLL;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)atoi(argv[1]), NULL, NULL, on_request, NULL,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)300, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
        NULL, MHD_OPTION_NOTIFY_CONNECTION, on_conn, NULL, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "mhd_server: cannot start\n");
        return 1;
    }
    printf("ready %s\n", MHD_get_version());
    fflush(stdout);
    pause();
    return 0;
}
