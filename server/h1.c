/* HTTP/1.1 server core (see h1.h) on libuv. Each I/O thread runs one uv_loop_t over its
 * connections (uv_tcp_t), its own listening socket (SO_REUSEPORT: one socket per loop on the
 * same port, the kernel spreading new connections over them), a uv_async_t for wake-ups from
 * other threads, and one uv_timer_t per connection for its deadline. A connection is driven by
 * conn_run, a loop over its state (head -> body -> pending -> write -> head again for
 * keep-alive) that runs until it needs the socket or the handler; it never recurses, so a
 * pipelined burst of requests costs no stack. A connection is freed once libuv has closed both
 * its handles (uv_close is asynchronous); until then it is marked dead and every callback that
 * still names it returns at once.
 *
 * The listener is shared by SO_REUSEPORT rather than by passing accepted handles from one loop
 * to the others (uv_write2 over a pipe): the kernel spreads connections with no extra thread,
 * pipe or copy on the accept path, each loop accepts on its own, and a busy loop does not
 * delay another's accepts. Against the epoll loop it replaced, throughput, soak latency and
 * the idle-connection cap measured the same (README, "Benchmarks"). */
#include "h1.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common.h"
#include "h1_parse.h"

#define RBUF_MIN     4096
#define RBUF_MAX     65536     /* > H1P_MAX_HEAD; bodies are handed on as they arrive */
#define STREAM_BLOCK 16384     /* bytes asked of a stream reader at a time */
#define STREAM_PAD   16        /* room before a block for its chunk-size line */
#define LINGER_S     2.0       /* how long a refused client's leftovers are discarded */
#define LINGER_BYTES (1 << 20) /* and how many bytes of them at most */
#define WATCH_S      0.05      /* how often a half-closed waiting client is checked for a reset */

enum cstate { C_HEAD, C_BODY, C_PENDING, C_WRITE, C_PARKED, C_LINGER };

struct h1_worker {
    struct h1_server *s;
    pthread_t thread;
    bool started;
    bool loop_ok, async_ok, listen_ok; /* which of the handles below were initialized */
    uv_loop_t loop;
    uv_tcp_t listener; /* this loop's SO_REUSEPORT socket */
    uv_async_t async;  /* wake-ups (h1_wake) and the stop request */
    double now;        /* monotonic seconds, refreshed at each callback */
    struct h1_conn *conns;
    time_t date_t;
    char date[48];           /* "Date: ...\r\n" for date_t */
    char discard[16384];     /* where refused and lingering input is read to */
    pthread_mutex_t wake_mu; /* guards the wake queue and every conn's wq/dead */
    struct h1_conn *wake_head, *wake_tail;
};

struct h1_server {
    struct h1_config cfg;
    int port;
    int n_workers;
    struct h1_worker *w; /* (n_workers) */
    atomic_int n_conns;
    atomic_bool stop;
};

struct h1_conn {
    uv_tcp_t tcp;       /* first: libuv hands it back in callbacks */
    uv_timer_t timer;   /* the connection's next deadline (arm) */
    uv_write_t wreq;    /* the write in flight, if any */
    uv_shutdown_t sreq; /* lingering close */
    struct h1_worker *w;
    enum cstate st;
    int open_handles;            /* handles not yet closed by libuv: freed at 0 */
    struct h1_conn *prev, *next; /* w->conns */
    double t_act;                /* last progress on the socket */
    double t_req;                /* first byte of the current request */
    double t_linger;
    /* input */
    char *rbuf; /* (rcap) bytes received and not consumed: rlen */
    size_t rlen, rcap;
    bool reading; /* uv_read_start is in effect */
    bool eof;     /* the client's EOF was read: libuv reads no more */
    struct h1p_scan scan;
    struct h1p_request *req; /* the current request; its head's bytes follow it */
    bool in_req;             /* H1_HEAD delivered, on_done not yet */
    bool chunked;            /* body framing: chunked, else body_left bytes */
    int64_t body_left;
    struct h1p_chunked ch;
    bool body_done;
    bool peer_closed; /* the client shut its sending side (EOF): at least a half-close;
                       * whether it still reads is only learnt by writing to it */
    bool probed;      /* this request's half-close was probed (probe_peer) */
    size_t lingered;
    int outq_seen;      /* our send queue at the last idle check (slow readers) */
    size_t wq_seen;     /* libuv's write queue at the last stall check */
    /* output */
    char *wbuf; /* (wcap) bytes woff..wlen still to send */
    size_t wlen, woff, wcap;
    bool writing; /* wbuf[woff, wlen) is handed to uv_write (wreq) */
    bool responded, close_after, refused, no_linger;
    h1_reader reader;
    void *rctx;
    bool chunked_out, stream_done;
    void *data;
    char peer[24];  /* the client's "address:port" (IPv4), for logs */
    /* under w->wake_mu */
    bool wq, dead;
    struct h1_conn *wq_prev, *wq_next;
};

static void conn_run(struct h1_conn *c);

/* --- small helpers ------------------------------------------------------------------------- */

static const char *reason(int status)
{
    static const struct {
        int status;
        const char *text;
    } reasons[] = {
        {100, "Continue"},
        {200, "OK"},
        {400, "Bad Request"},
        {401, "Unauthorized"},
        {404, "Not Found"},
        {405, "Method Not Allowed"},
        {408, "Request Timeout"},
        {411, "Length Required"},
        {413, "Content Too Large"},
        {414, "URI Too Long"},
        {417, "Expectation Failed"},
        {429, "Too Many Requests"},
        {431, "Request Header Fields Too Large"},
        {500, "Internal Server Error"},
        {501, "Not Implemented"},
        {503, "Service Unavailable"},
        {529, "Overloaded"}, /* Anthropic's overloaded_error, on the Messages routes */
        {505, "HTTP Version Not Supported"},
    };
    for (size_t i = 0; i < sizeof reasons / sizeof *reasons; i++)
        if (reasons[i].status == status) return reasons[i].text;
    return "Unknown";
}

static const char *date_line(struct h1_worker *w)
{
    time_t t = time(NULL);
    if (t != w->date_t) {
        struct tm tm;
        gmtime_r(&t, &tm);
        strftime(w->date, sizeof w->date, "Date: %a, %d %b %Y %H:%M:%S GMT\r\n", &tm);
        w->date_t = t;
    }
    return w->date;
}

static void tick(struct h1_worker *w)
{
    w->now = (double)uv_now(&w->loop) / 1e3;
}

static void consume(struct h1_conn *c, size_t n)
{
    memmove(c->rbuf, c->rbuf + n, c->rlen - n);
    c->rlen -= n;
}

static void deliver(struct h1_conn *c, enum h1_event ev, const char *data, size_t len)
{
    const struct h1_callbacks *cb = &c->w->s->cfg.cb;
    cb->on_request(cb->ctx, c, ev, data, len);
}

static uv_stream_t *stream(struct h1_conn *c)
{
    return (uv_stream_t *)&c->tcp;
}

/* Bytes of ours the client has not taken yet (our kernel send queue). */
static int out_queued(struct h1_conn *c)
{
    uv_os_fd_t fd;
    int queued = 0;
    if (uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0) return 0;
    return ioctl(fd, SIOCOUTQ, &queued) == 0 ? queued : 0;
}

/* Whether the client reset the connection: after its EOF, libuv reads no more, so a reset
 * that answers our bytes (probe_peer) is seen here, in the kernel's state of the socket. */
static bool peer_reset(struct h1_conn *c)
{
    uv_os_fd_t fd;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0) return true;
    int err = 0;
    socklen_t elen = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) == 0 && err != 0) return true;
    return getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0 && ti.tcpi_state == TCP_CLOSE;
}

/* --- connection lifetime ------------------------------------------------------------------- */

static void end_request(struct h1_conn *c, enum h1_done why)
{
    if (c->in_req) {
        const struct h1_callbacks *cb = &c->w->s->cfg.cb;
        c->in_req = false;
        cb->on_done(cb->ctx, c, why);
    }
    c->data = NULL;
    free(c->req);
    c->req = NULL;
    if (!c->writing) { /* else libuv may still hold it: freed with the connection */
        free(c->wbuf);
        c->wbuf = NULL;
        c->wcap = 0;
    }
    c->wlen = c->woff = 0;
    c->reader = NULL;
    c->rctx = NULL;
    c->responded = c->chunked_out = c->stream_done = c->probed = false;
}

static void on_handle_closed(uv_handle_t *h)
{
    struct h1_conn *c = h->data;
    if (--c->open_handles > 0) return;
    free(c->wbuf);
    free(c->rbuf);
    free(c);
}

static void conn_close(struct h1_conn *c, enum h1_done why)
{
    struct h1_worker *w = c->w;
    if (c->dead) return;
    end_request(c, why);
    pthread_mutex_lock(&w->wake_mu);
    if (c->wq) {
        if (c->wq_prev)
            c->wq_prev->wq_next = c->wq_next;
        else
            w->wake_head = c->wq_next;
        if (c->wq_next)
            c->wq_next->wq_prev = c->wq_prev;
        else
            w->wake_tail = c->wq_prev;
        c->wq = false;
    }
    c->dead = true;
    pthread_mutex_unlock(&w->wake_mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    /* closes the socket (a reset if input is unread) and cancels a write in flight */
    uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_handle_closed);
    atomic_fetch_sub(&w->s->n_conns, 1);
}

/* A protocol-level failure: the handler answers it (JSON), then the connection closes. */
static void conn_fail(struct h1_conn *c, int status, const char *why)
{
    if (c->responded) { /* too late for an answer: the response is under way */
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    c->close_after = true;
    c->refused = true;
    const struct h1_callbacks *cb = &c->w->s->cfg.cb;
    cb->on_error(cb->ctx, c, status, why);
    if (!c->responded) conn_close(c, H1_DONE_CLOSED);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    (void)req;
    (void)status; /* a failure shows as the reset or EOF the lingering read meets */
}

/* After a response: the next request (keep-alive), lingering, or close. A half-closed client
 * stays in keep-alive: requests it pipelined before its EOF are still answered, and once they
 * are done the connection closes (conn_run). */
static void response_complete(struct h1_conn *c)
{
    bool keep = !c->close_after && c->req && c->req->keep_alive;
    end_request(c, H1_DONE_SENT);
    if (keep) {
        c->st = C_HEAD;
        c->outq_seen = INT32_MAX;
        memset(&c->scan, 0, sizeof c->scan);
        c->t_act = c->w->now;
        c->t_req = c->w->now;
        if (c->rlen == 0) {
            free(c->rbuf); /* an idle connection holds no buffer */
            c->rbuf = NULL;
            c->rcap = 0;
        }
        return;
    }
    if (c->peer_closed || c->no_linger) {
        conn_close(c, H1_DONE_SENT);
        return;
    }
    /* Lingering close: closing with unread input makes the kernel send a reset, which can
     * destroy the answer before the client reads it; shut our side and discard for a while. */
    if (uv_shutdown(&c->sreq, stream(c), on_shutdown) != 0) {
        conn_close(c, H1_DONE_SENT);
        return;
    }
    c->st = C_LINGER;
    c->rlen = 0;
    c->t_linger = c->w->now;
}

/* --- input --------------------------------------------------------------------------------- */

/* Sends bytes the client must accept before any response: an interim "100 Continue". Only
 * between responses, when nothing else is queued, so they go out whole or not at all (a
 * partial one would corrupt the stream: the connection is closed then). Returns false when
 * the connection is gone. */
static bool send_interim(struct h1_conn *c)
{
    static char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    uv_buf_t b = uv_buf_init(cont, sizeof cont - 1);
    int n = uv_try_write(stream(c), &b, 1);
    if (n == (int)(sizeof cont - 1) || n == UV_EAGAIN) return true; /* no room: the answer tells */
    conn_close(c, H1_DONE_CLOSED);
    return false;
}


/* C_HEAD: a complete head is parsed and delivered. Returns false when more bytes are needed. */
static bool step_head(struct h1_conn *c)
{
    if (c->rlen == 0) return false;
    long end = h1p_head_end(&c->scan, c->rbuf, c->rlen);
    if (end < 0) {
        conn_fail(c, (int)-end,
                  end == -414 ? "the request line is too long" : "the request head is too large");
        return true;
    }
    if (end == 0) return false;
    c->req = malloc(sizeof *c->req + (size_t)end + 1);
    if (!c->req) {
        conn_close(c, H1_DONE_CLOSED);
        return true;
    }
    char *head = (char *)(c->req + 1);
    memcpy(head, c->rbuf, (size_t)end);
    head[end] = '\0';
    consume(c, (size_t)end);
    memset(&c->scan, 0, sizeof c->scan);
    const char *why;
    int st = h1p_parse(head, (size_t)end, c->req, &why);
    if (st) {
        conn_fail(c, st, why);
        return true;
    }
    c->chunked = c->req->chunked;
    c->body_left = c->req->content_length > 0 ? c->req->content_length : 0;
    c->body_done = !c->chunked && c->body_left == 0;
    if (c->chunked) h1p_chunked_init(&c->ch);
    c->st = C_BODY; /* a response from now on refuses only the body still to come */
    c->in_req = true;
    deliver(c, H1_HEAD, NULL, 0);
    if (c->dead || c->responded) return true;
    if (!c->body_done && c->req->expect_continue && c->rlen == 0) send_interim(c);
    return true;
}

/* C_BODY: hands on what arrived of the body; at its end delivers H1_END. */
static bool step_body(struct h1_conn *c)
{
    if (c->body_done) {
        c->st = C_PENDING;
        deliver(c, H1_END, NULL, 0);
        return true;
    }
    if (c->rlen == 0) return false;
    if (!c->chunked) {
        size_t take = c->rlen < (uint64_t)c->body_left ? c->rlen : (size_t)c->body_left;
        c->body_left -= (int64_t)take;
        c->body_done = c->body_left == 0;
        deliver(c, H1_BODY, c->rbuf, take);
        if (!c->dead) consume(c, take);
        return true;
    }
    const char *data, *why;
    size_t n;
    bool done;
    long used = h1p_chunked(&c->ch, c->rbuf, c->rlen, &data, &n, &done, &why);
    if (used < 0) {
        conn_fail(c, (int)-used, why);
        return true;
    }
    c->body_done = done;
    if (n) deliver(c, H1_BODY, data, n);
    if (!c->dead) consume(c, (size_t)used);
    return true;
}

/* --- output -------------------------------------------------------------------------------- */

/* Writes the status line and standard headers of a response into a new wbuf with room for
 * `extra` more bytes; returns the head's length or -1. */
static long build_head(struct h1_conn *c, int status, const char *headers, const char *framing,
                       size_t extra)
{
    bool keep = !c->close_after && !c->refused && c->req && c->req->keep_alive;
    if (!keep) c->close_after = true;
    const char *conn = !keep                ? "Connection: close\r\n"
                       : c->req->minor == 0 ? "Connection: keep-alive\r\n"
                                            : "";
    const char *date = date_line(c->w);
    int n = snprintf(NULL, 0, "HTTP/1.1 %d %s\r\n%s%s%s%s\r\n", status, reason(status), date,
                     framing, conn, headers ? headers : "");
    if (n < 0) return -1;
    size_t cap = (size_t)n + 1 + extra;
    char *b = malloc(cap);
    if (!b) return -1;
    snprintf(b, (size_t)n + 1, "HTTP/1.1 %d %s\r\n%s%s%s%s\r\n", status, reason(status), date,
             framing, conn, headers ? headers : "");
    free(c->wbuf);
    c->wbuf = b;
    c->wcap = cap;
    c->woff = 0;
    c->wlen = (size_t)n;
    return n;
}

/* A request to HEAD: its response has the headers of the GET response and no content (RFC 9110
 * 9.3.2). */
static bool is_head(const struct h1_conn *c)
{
    return c->req && c->req->method && strcmp(c->req->method, "HEAD") == 0;
}

/* Marks the connection as answered: a response queued while the body is still coming refuses
 * the rest of it. */
static bool start_response(struct h1_conn *c)
{
    if (c->responded || c->dead) return false;
    c->responded = true;
    if (c->st == C_HEAD || (c->st == C_BODY && !c->body_done)) c->refused = true;
    c->st = C_WRITE;
    c->t_act = c->w->now;
    return true;
}

int h1_respond(struct h1_conn *c, int status, const char *headers, char *body, size_t len)
{
    if (!start_response(c)) {
        free(body);
        return -1;
    }
    char framing[48];
    snprintf(framing, sizeof framing, "Content-Length: %zu\r\n", len);
    long n = build_head(c, status, headers, framing, len);
    if (n < 0) {
        free(body);
        c->close_after = true;
        c->wlen = c->woff = 0; /* nothing to send: the connection just closes */
        return -1;
    }
    if (is_head(c)) len = 0;
    if (len) memcpy(c->wbuf + n, body, len);
    c->wlen += len;
    free(body);
    return 0;
}

int h1_respond_stream(struct h1_conn *c, int status, const char *headers, h1_reader reader,
                      void *reader_ctx)
{
    if (!start_response(c)) return -1;
    /* HTTP/1.0 has no chunked encoding: the body ends when the connection does. */
    c->chunked_out = c->req && c->req->minor == 1;
    if (!c->chunked_out) c->close_after = true;
    if (build_head(c, status, headers, c->chunked_out ? "Transfer-Encoding: chunked\r\n" : "", 0) <
        0) {
        c->close_after = true;
        c->wlen = c->woff = 0;
        return -1;
    }
    c->reader = reader;
    c->rctx = reader_ctx;
    c->stream_done = is_head(c);
    return 0;
}

/* Asks the stream reader for the next block. Returns false when the connection parked (or
 * closed). */
static bool fill_stream(struct h1_conn *c)
{
    size_t need = STREAM_PAD + STREAM_BLOCK + 2;
    if (c->wcap < need) {
        char *b = realloc(c->wbuf, need);
        if (!b) {
            conn_close(c, H1_DONE_CLOSED);
            return false;
        }
        c->wbuf = b;
        c->wcap = need;
    }
    c->woff = c->wlen = 0;
    long n = c->reader(c->rctx, c->wbuf + STREAM_PAD, STREAM_BLOCK);
    if (n > 0) {
        c->woff = STREAM_PAD;
        c->wlen = STREAM_PAD + (size_t)n;
        if (c->chunked_out) {
            char line[STREAM_PAD];
            int l = snprintf(line, sizeof line, "%lx\r\n", (unsigned long)n);
            c->woff = STREAM_PAD - (size_t)l;
            memcpy(c->wbuf + c->woff, line, (size_t)l);
            memcpy(c->wbuf + c->wlen, "\r\n", 2);
            c->wlen += 2;
        }
        return true;
    }
    if (n == 0) {
        c->st = C_PARKED; /* even half-closed: the client may still read (see probe_peer) */
        return false;
    }
    if (n == H1_STREAM_END) {
        c->stream_done = true;
        if (c->chunked_out) {
            memcpy(c->wbuf, "0\r\n\r\n", 5);
            c->wlen = 5;
        }
        return true;
    }
    conn_close(c, H1_DONE_CLOSED); /* the handler cut the stream */
    return false;
}

/* A pending request's client shut its sending side. That may be a half-close (shutdown
 * SHUT_WR, as `nc -N` does after its request), which still wants the answer, or a full close;
 * TCP tells them apart only when data reaches the client: a closed socket answers it with a
 * reset. Nothing else on Linux does: both leave our socket in CLOSE-WAIT, a read and MSG_PEEK
 * both see EOF, a zero-length send emits no segment, and keep-alive probes carry no new data,
 * so even a closed peer just acknowledges them. So bytes the client must accept are sent: an
 * interim "100 Continue", which RFC 9110 15.2 has every HTTP/1.1 client parse and skip before
 * the final response, unexpected or not. A client that left resets, which the connection's
 * timer sees in the socket's state (peer_reset, every WATCH_S while it waits: libuv stops
 * reading at the EOF, so no read reports it), or the next write fails; either closes the
 * connection and cancels the request. Once per request, so clients that cap interim responses
 * are safe. Not for HTTP/1.0, which must not get a 1xx: there a full close is seen only when
 * the answer is written. A streamed response needs no probe: its own bytes (the head at once,
 * then each event) are the probe. */
static void probe_peer(struct h1_conn *c)
{
    c->probed = true;
    if (!c->req || c->req->minor == 0) return;
    send_interim(c);
}

static void on_write(uv_write_t *req, int status)
{
    struct h1_conn *c = req->data;
    c->writing = false;
    if (c->dead) return; /* cancelled by the close */
    tick(c->w);
    if (status < 0) { /* EPIPE, ECONNRESET: the client left */
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    c->woff = c->wlen;
    c->t_act = c->w->now;
    conn_run(c);
}

/* C_WRITE: sends what is queued (what the socket takes at once, the rest through uv_write),
 * refills from a stream reader. Returns false when waiting on the socket, parked, or closed. */
static bool step_write(struct h1_conn *c)
{
    for (;;) {
        if (c->writing) return false;
        if (c->woff < c->wlen) {
            uv_buf_t b = uv_buf_init(c->wbuf + c->woff, (unsigned)(c->wlen - c->woff));
            int n = uv_try_write(stream(c), &b, 1);
            if (n > 0) {
                c->woff += (size_t)n;
                c->t_act = c->w->now;
                continue;
            }
            if (n == UV_EAGAIN) {
                c->wreq.data = c;
                c->wq_seen = SIZE_MAX;
                if (uv_write(&c->wreq, stream(c), &b, 1, on_write) == 0) {
                    c->writing = true;
                    return false;
                }
            }
            conn_close(c, H1_DONE_CLOSED);
            return false;
        }
        if (c->reader && !c->stream_done) {
            if (!fill_stream(c)) return false;
            continue;
        }
        response_complete(c);
        return !c->dead;
    }
}

/* --- reading ------------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct h1_conn *c = h->data;
    (void)suggested;
    *buf = uv_buf_init(NULL, 0);
    if (c->dead) return;
    /* a refused body's rest and a lingering client's leftovers are discarded */
    if (c->st == C_LINGER || (c->refused && c->st != C_HEAD && c->st != C_BODY)) {
        *buf = uv_buf_init(c->w->discard, sizeof c->w->discard);
        return;
    }
    if (c->rcap - c->rlen < 1024 && c->rcap < RBUF_MAX) {
        size_t cap = c->rcap ? c->rcap * 2 : RBUF_MIN;
        if (cap > RBUF_MAX) cap = RBUF_MAX;
        char *b = realloc(c->rbuf, cap);
        if (!b) return; /* read_cb gets UV_ENOBUFS */
        c->rbuf = b;
        c->rcap = cap;
    }
    if (c->rlen < c->rcap) *buf = uv_buf_init(c->rbuf + c->rlen, (unsigned)(c->rcap - c->rlen));
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    struct h1_conn *c = st->data;
    if (c->dead) return;
    tick(c->w);
    if (n > 0 && buf->base == c->w->discard) {
        c->lingered += (size_t)n;
        if (c->st == C_LINGER && c->lingered > LINGER_BYTES) conn_close(c, H1_DONE_SENT);
        return;
    }
    if (n > 0) {
        if (c->rlen == 0 && c->st == C_HEAD) c->t_req = c->w->now;
        c->rlen += (size_t)n;
        if (c->st == C_HEAD || c->st == C_BODY) { /* else pipelined input, kept for later */
            c->t_act = c->w->now;
            conn_run(c);
        }
        return;
    }
    if (n == 0) return; /* nothing now (EAGAIN) */
    if (n == UV_ENOBUFS) { /* the buffer is full or could not grow: wait for it to drain */
        uv_read_stop(st);
        c->reading = false;
        return;
    }
    if (n != UV_EOF) { /* a reset or another error */
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    /* EOF: libuv has stopped reading */
    c->reading = false;
    c->eof = true;
    c->peer_closed = true;
    if (c->st == C_LINGER) {
        conn_close(c, H1_DONE_SENT);
        return;
    }
    conn_run(c); /* an unfinished request can never complete; a pending one is probed */
}

/* --- the connection's state machine and deadline ------------------------------------------- */

static void on_timer(uv_timer_t *t);

/* Reading on or off (libuv's read interest), then the connection's next deadline: idle and
 * stall timeouts while the server waits on the client, the request deadline, the lingering
 * time, and the reset watch of a half-closed client waiting for its answer. */
static void arm(struct h1_conn *c)
{
    const struct h1_config *cfg = &c->w->s->cfg;
    bool want = !c->eof && (c->st == C_LINGER || c->refused || c->rlen < RBUF_MAX);
    if (want && !c->reading) {
        if (uv_read_start(stream(c), on_alloc, on_read) != 0) {
            conn_close(c, H1_DONE_CLOSED);
            return;
        }
        c->reading = true;
    } else if (!want && c->reading) {
        uv_read_stop(stream(c));
        c->reading = false;
    }
    double at = -1;
    switch (c->st) {
    case C_HEAD:
    case C_BODY:
        at = c->t_act + cfg->keep_alive_s;
        if (!(c->st == C_HEAD && c->rlen == 0) && c->t_req + cfg->read_timeout_s < at)
            at = c->t_req + cfg->read_timeout_s;
        break;
    case C_WRITE:
        at = c->t_act + cfg->keep_alive_s;
        break;
    case C_LINGER:
        at = c->t_linger + LINGER_S;
        break;
    case C_PENDING:
    case C_PARKED:
        /* the server's own wait never times out; a half-closed client is checked every
         * WATCH_S, which wake-ups (a token each) must not keep postponing */
        if (!c->peer_closed) break;
        if (uv_is_active((uv_handle_t *)&c->timer) &&
            uv_timer_get_due_in(&c->timer) <= (uint64_t)(WATCH_S * 1e3))
            return;
        at = c->w->now + WATCH_S;
        break;
    }
    if (at < 0) {
        uv_timer_stop(&c->timer);
        return;
    }
    double ms = (at - c->w->now) * 1e3;
    uv_timer_start(&c->timer, on_timer, ms > 0 ? (uint64_t)ms + 1 : 0, 0);
}

static void on_timer(uv_timer_t *t)
{
    struct h1_conn *c = t->data;
    if (c->dead) return;
    struct h1_worker *w = c->w;
    const struct h1_config *cfg = &w->s->cfg;
    tick(w);
    double now = w->now;
    switch (c->st) {
    case C_HEAD:
    case C_BODY:
        if (c->st == C_HEAD && c->rlen == 0) {
            if (now - c->t_act < cfg->keep_alive_s) break;
            /* A slow reader still taking the last response is not idle: its keep-alive time
             * starts once it has it all. One whose queue stopped shrinking is. */
            int q = out_queued(c);
            if (q > 0 && q < c->outq_seen) {
                c->outq_seen = q;
                c->t_act = now;
            } else {
                conn_close(c, H1_DONE_CLOSED);
                return;
            }
        } else if (now - c->t_act >= cfg->keep_alive_s || now - c->t_req >= cfg->read_timeout_s) {
            conn_fail(c, 408, "the request was not received in time");
            conn_run(c);
            return;
        }
        break;
    case C_WRITE:
        if (now - c->t_act < cfg->keep_alive_s) break;
        /* a write in flight that still moves is progress (libuv's queue shrinks as the
         * client reads); one that stopped means the client stopped reading */
        if (c->writing) {
            size_t q = uv_stream_get_write_queue_size(stream(c));
            if (q < c->wq_seen) {
                c->wq_seen = q;
                c->t_act = now;
                break;
            }
        }
        conn_close(c, H1_DONE_CLOSED);
        return;
    case C_LINGER:
        if (now - c->t_linger >= LINGER_S) {
            conn_close(c, H1_DONE_SENT);
            return;
        }
        break;
    case C_PENDING:
    case C_PARKED:
        if (c->peer_closed && peer_reset(c)) {
            conn_close(c, H1_DONE_CLOSED);
            return;
        }
        break;
    }
    arm(c);
}

/* Runs the connection's state machine until it waits for the socket or the handler. */
static void conn_run(struct h1_conn *c)
{
    for (;;) {
        if (c->dead) return;
        bool progress = false;
        switch (c->st) {
        case C_HEAD:
            progress = step_head(c);
            break;
        case C_BODY:
            progress = step_body(c);
            break;
        case C_WRITE:
            progress = step_write(c);
            break;
        case C_PENDING:
            /* half-closed or gone while waiting: find out which (probe_peer) */
            if (c->peer_closed && !c->probed) probe_peer(c);
            break;
        case C_PARKED:
        case C_LINGER:
            break;
        }
        if (!progress) break;
    }
    if (c->dead) return;
    /* after the EOF, what is buffered is all there will be: a request it leaves unfinished
     * can never complete (a half-closed client's complete requests were answered above) */
    if (c->eof && (c->st == C_HEAD || c->st == C_BODY)) {
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    arm(c);
}

/* --- wake-ups, accept ---------------------------------------------------------------------- */

void h1_wake(struct h1_conn *c)
{
    struct h1_worker *w = c->w;
    bool kick = false;
    pthread_mutex_lock(&w->wake_mu);
    if (!c->wq && !c->dead) {
        kick = w->wake_head == NULL;
        c->wq = true;
        c->wq_next = NULL;
        c->wq_prev = w->wake_tail;
        if (w->wake_tail)
            w->wake_tail->wq_next = c;
        else
            w->wake_head = c;
        w->wake_tail = c;
    }
    pthread_mutex_unlock(&w->wake_mu);
    if (kick) uv_async_send(&w->async); /* coalesced: one callback for a burst */
}

static void stop_worker(struct h1_worker *w)
{
    while (w->conns)
        conn_close(w->conns, H1_DONE_STOPPED);
    if (w->listen_ok) uv_close((uv_handle_t *)&w->listener, NULL);
    uv_close((uv_handle_t *)&w->async, NULL);
}

static void on_async(uv_async_t *a)
{
    struct h1_worker *w = a->data;
    tick(w);
    if (atomic_load(&w->s->stop)) {
        stop_worker(w);
        return;
    }
    for (;;) {
        pthread_mutex_lock(&w->wake_mu);
        struct h1_conn *c = w->wake_head;
        if (c) {
            w->wake_head = c->wq_next;
            if (w->wake_head)
                w->wake_head->wq_prev = NULL;
            else
                w->wake_tail = NULL;
            c->wq = false;
        }
        pthread_mutex_unlock(&w->wake_mu);
        if (!c) return;
        if (c->st == C_PENDING) {
            deliver(c, H1_WAKE, NULL, 0);
            conn_run(c);
        } else if (c->st == C_PARKED) {
            c->st = C_WRITE;
            c->t_act = w->now;
            conn_run(c);
        }
    }
}

static void free_handle(uv_handle_t *h)
{
    free(h);
}

static void on_connection(uv_stream_t *listener, int status)
{
    struct h1_worker *w = listener->data;
    struct h1_server *s = w->s;
    /* an accept error (out of descriptors: libuv's reserve descriptor turns the waiting
     * clients away rather than spin) leaves nothing to do */
    if (status < 0) return;
    tick(w);
    struct h1_conn *c = calloc(1, sizeof *c);
    if (!c) { /* out of memory: take the client (libuv accepts no more until then), reset it */
        uv_tcp_t *tmp = malloc(sizeof *tmp);
        if (tmp && uv_tcp_init(&w->loop, tmp) == 0) {
            if (uv_accept(listener, (uv_stream_t *)tmp) != 0 ||
                uv_tcp_close_reset(tmp, free_handle) != 0)
                uv_close((uv_handle_t *)tmp, free_handle);
        } else {
            free(tmp);
        }
        return;
    }
    c->w = w;
    c->st = C_HEAD;
    c->t_act = c->t_req = w->now;
    c->outq_seen = INT32_MAX;
    uv_tcp_init(&w->loop, &c->tcp);
    uv_timer_init(&w->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    c->next = w->conns;
    if (w->conns) w->conns->prev = c;
    w->conns = c;
    atomic_fetch_add(&s->n_conns, 1);
    if (uv_accept(listener, stream(c)) != 0) {
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1); /* a token per packet */
    struct sockaddr_storage pa;
    int pal = sizeof pa;
    char ip[INET_ADDRSTRLEN];
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&pa, &pal) == 0 &&
        pa.ss_family == AF_INET &&
        uv_ip4_name((struct sockaddr_in *)&pa, ip, sizeof ip) == 0)
        snprintf(c->peer, sizeof c->peer, "%s:%u", ip,
                 (unsigned)ntohs(((struct sockaddr_in *)&pa)->sin_port));
    if (atomic_load(&s->n_conns) > s->cfg.max_conns) {
        c->no_linger = true;
        conn_fail(c, 503, "too many open connections; retry later");
    }
    conn_run(c);
}

static void *worker_main(void *arg)
{
    struct h1_worker *w = arg;
    /* libuv writes without MSG_NOSIGNAL: a client gone mid-write must give EPIPE, not kill
     * the process (a SIGPIPE raised by a write goes to the writing thread, here blocked) */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &mask, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT); /* until stop_worker has closed every handle */
    return NULL;
}

/* --- lifecycle ----------------------------------------------------------------------------- */

/* A listening socket on addr with SO_REUSEPORT, so that every loop has its own. */
static int listen_socket(const struct sockaddr_in *addr)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd < 0) return -1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0 ||
        bind(fd, (const struct sockaddr *)addr, sizeof *addr) != 0 || listen(fd, SOMAXCONN) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void server_free(struct h1_server *s)
{
    atomic_store(&s->stop, true);
    for (int i = 0; i < s->n_workers; i++) {
        struct h1_worker *w = &s->w[i];
        if (w->started) {
            uv_async_send(&w->async);
            pthread_join(w->thread, NULL);
        } else if (w->loop_ok) { /* never ran: close what was made, let the loop finish */
            if (w->async_ok) uv_close((uv_handle_t *)&w->async, NULL);
            if (w->listen_ok) uv_close((uv_handle_t *)&w->listener, NULL);
            uv_run(&w->loop, UV_RUN_DEFAULT);
        }
        if (w->loop_ok) uv_loop_close(&w->loop);
        pthread_mutex_destroy(&w->wake_mu);
    }
    free(s->w);
    free(s);
}

int h1_start(const struct h1_config *cfg, struct h1_server **out, char *err, size_t errlen)
{
    *out = NULL;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cfg->port)};
    if (inet_pton(AF_INET, cfg->host, &addr.sin_addr) != 1)
        return ms_errf(err, errlen, "--host '%s' is not an IPv4 address", cfg->host);
    struct h1_server *s = calloc(1, sizeof *s);
    if (!s) return ms_errf(err, errlen, "out of memory");
    s->cfg = *cfg;
    if (s->cfg.threads <= 0) s->cfg.threads = 4;
    if (s->cfg.max_conns <= 0) s->cfg.max_conns = 1024;
    if (s->cfg.keep_alive_s <= 0) s->cfg.keep_alive_s = 5;
    if (s->cfg.read_timeout_s <= 0) s->cfg.read_timeout_s = 30;
    /* The port is taken first without SO_REUSEPORT: a port another process listens on (with
     * or without it) is refused rather than shared, and port 0 becomes a free port; then every
     * loop binds its own socket to it. */
    int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (probe < 0 || setsockopt(probe, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(probe, (struct sockaddr *)&addr, sizeof addr) != 0) {
        ms_errf(err, errlen, "cannot listen on %s:%d: %s", cfg->host, cfg->port, strerror(errno));
        if (probe >= 0) close(probe);
        free(s);
        return -1;
    }
    socklen_t al = sizeof addr;
    getsockname(probe, (struct sockaddr *)&addr, &al);
    s->port = ntohs(addr.sin_port);
    s->w = calloc((size_t)s->cfg.threads, sizeof *s->w);
    if (!s->w) {
        close(probe);
        free(s);
        return ms_errf(err, errlen, "out of memory");
    }
    int fds[256];
    int nfd = 0;
    close(probe); /* the loops' sockets take the port at once */
    for (int i = 0; i < s->cfg.threads && i < 256; i++, nfd++) {
        fds[i] = listen_socket(&addr);
        if (fds[i] < 0) {
            ms_errf(err, errlen, "cannot listen on %s:%d: %s", cfg->host, s->port,
                    strerror(errno));
            for (int j = 0; j < i; j++) close(fds[j]);
            free(s->w);
            free(s);
            return -1;
        }
    }
    for (int i = 0; i < nfd; i++) {
        struct h1_worker *w = &s->w[i];
        w->s = s;
        pthread_mutex_init(&w->wake_mu, NULL);
        s->n_workers++;
        if (uv_loop_init(&w->loop) != 0) {
            for (int j = i; j < nfd; j++) close(fds[j]);
            ms_errf(err, errlen, "cannot create an event loop");
            goto fail;
        }
        w->loop_ok = true;
        w->async.data = w->listener.data = w;
        w->async_ok = uv_async_init(&w->loop, &w->async, on_async) == 0;
        w->listen_ok = uv_tcp_init(&w->loop, &w->listener) == 0;
        if (!w->listen_ok || uv_tcp_open(&w->listener, fds[i]) != 0) {
            for (int j = i; j < nfd; j++) close(fds[j]);
            ms_errf(err, errlen, "cannot create an event loop");
            goto fail;
        }
        int rc = w->async_ok ? uv_listen((uv_stream_t *)&w->listener, SOMAXCONN, on_connection)
                             : -1;
        if (rc != 0 || pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            for (int j = i + 1; j < nfd; j++) close(fds[j]);
            ms_errf(err, errlen, "cannot start an HTTP thread");
            goto fail;
        }
        w->started = true;
        pthread_setname_np(w->thread, "h1-io");
    }
    *out = s;
    return 0;
fail:
    server_free(s);
    return -1;
}

int h1_port(const struct h1_server *s)
{
    return s->port;
}

int h1_open_conns(const struct h1_server *s)
{
    return atomic_load(&((struct h1_server *)s)->n_conns);
}

void h1_stop(struct h1_server *s)
{
    if (s) server_free(s);
}

/* --- request accessors ----------------------------------------------------------------------- */

const char *h1_peer(const struct h1_conn *c)
{
    return c->peer;
}

const char *h1_method(const struct h1_conn *c)
{
    return c->req && c->req->method ? c->req->method : "";
}

const char *h1_path(const struct h1_conn *c)
{
    return c->req && c->req->path ? c->req->path : "";
}

const char *h1_header(const struct h1_conn *c, const char *name)
{
    return c->req ? h1p_field(c->req, name) : NULL;
}

int64_t h1_content_length(const struct h1_conn *c)
{
    if (!c->req) return -2;
    if (c->req->chunked) return -1;
    return c->req->content_length >= 0 ? c->req->content_length : -2;
}

void h1_set_data(struct h1_conn *c, void *data)
{
    c->data = data;
}

void *h1_data(const struct h1_conn *c)
{
    return c->data;
}
