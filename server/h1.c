/* HTTP/1.1 server core (see h1.h). Each I/O thread runs one epoll loop over its connections,
 * the shared listening socket (EPOLLEXCLUSIVE, so one thread wakes per burst) and an eventfd
 * for wake-ups from other threads. A connection is driven by conn_run, a loop over its state
 * (head -> body -> pending -> write -> head again for keep-alive) that runs until it needs the
 * socket or the handler; it never recurses, so a pipelined burst of requests costs no stack.
 * Connections closed inside a loop iteration are freed at its end, because the same batch of
 * epoll events may still name them. */
#include "h1.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "h1_parse.h"

#define RBUF_MIN        4096
#define RBUF_MAX        65536     /* > H1P_MAX_HEAD; bodies are handed on as they arrive */
#define STREAM_BLOCK    16384     /* bytes asked of a stream reader at a time */
#define STREAM_PAD      16        /* room before a block for its chunk-size line */
#define LINGER_S        2.0       /* how long a refused client's leftovers are discarded */
#define LINGER_BYTES    (1 << 20) /* and how many bytes of them at most */
#define SWEEP_S         0.25      /* timeout granularity */
#define ACCEPT_BATCH    64
#define READS_PER_EVENT 8 /* recv calls per readiness event: others get their turn */

enum cstate { C_HEAD, C_BODY, C_PENDING, C_WRITE, C_PARKED, C_LINGER };

struct h1_worker {
    struct h1_server *s;
    pthread_t thread;
    bool started;
    int ep, evfd;
    double now;            /* monotonic seconds, refreshed after each epoll_wait */
    struct h1_conn *conns; /* this thread's connections */
    struct h1_conn *dead;  /* closed this iteration, freed at its end */
    bool listening;        /* the listening socket is in this epoll */
    double relisten_at;    /* after EMFILE: when to take connections again */
    time_t date_t;
    char date[48];           /* "Date: ...\r\n" for date_t */
    pthread_mutex_t wake_mu; /* guards the wake queue and every conn's wq/dead */
    struct h1_conn *wake_head, *wake_tail;
};

struct h1_server {
    struct h1_config cfg;
    int lfd, port;
    int n_workers;
    struct h1_worker *w; /* (n_workers) */
    atomic_int n_conns;
    atomic_bool stop;
};

struct h1_conn {
    struct h1_worker *w;
    int fd;
    enum cstate st;
    uint32_t ev;                 /* epoll interest now */
    struct h1_conn *prev, *next; /* w->conns (next also links w->dead) */
    double t_act;                /* last progress on the socket */
    double t_req;                /* first byte of the current request */
    double t_linger;
    /* input */
    char *rbuf; /* (rcap) bytes received and not consumed: rlen */
    size_t rlen, rcap;
    struct h1p_scan scan;
    struct h1p_request *req; /* the current request; its head's bytes follow it */
    bool in_req;             /* H1_HEAD delivered, on_done not yet */
    bool chunked;            /* body framing: chunked, else body_left bytes */
    int64_t body_left;
    struct h1p_chunked ch;
    bool body_done;
    bool peer_closed; /* the client shut its sending side (EOF or EPOLLRDHUP): at least a
                       * half-close; whether it still reads is only learnt by writing to it */
    bool probed;      /* this request's half-close was probed (probe_peer) */
    size_t lingered;
    int outq_seen; /* our send queue at the last idle check (slow readers) */
    /* output */
    char *wbuf; /* (wcap) bytes woff..wlen still to send */
    size_t wlen, woff, wcap;
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

static void set_interest(struct h1_conn *c, uint32_t ev)
{
    if (ev == c->ev) return;
    struct epoll_event e = {.events = ev, .data.ptr = c};
    epoll_ctl(c->w->ep, EPOLL_CTL_MOD, c->fd, &e);
    c->ev = ev;
}

/* What the connection waits for in its state. */
static void update_interest(struct h1_conn *c)
{
    uint32_t hup = c->peer_closed ? 0 : EPOLLRDHUP;
    switch (c->st) {
    case C_HEAD:
    case C_BODY:
    case C_LINGER:
        set_interest(c, EPOLLIN | EPOLLRDHUP);
        break;
    case C_WRITE:
        set_interest(c, EPOLLOUT | hup);
        break;
    case C_PENDING:
    case C_PARKED:
        set_interest(c, hup);
        break;
    }
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
    free(c->wbuf);
    c->wbuf = NULL;
    c->wlen = c->woff = c->wcap = 0;
    c->reader = NULL;
    c->rctx = NULL;
    c->responded = c->chunked_out = c->stream_done = c->probed = false;
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
    close(c->fd); /* also leaves the epoll set */
    if (c->prev)
        c->prev->next = c->next;
    else
        w->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c->rbuf);
    c->rbuf = NULL;
    c->next = w->dead;
    w->dead = c;
    atomic_fetch_sub(&w->s->n_conns, 1);
}

static struct h1_conn *conn_new(struct h1_worker *w, int fd)
{
    struct h1_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->w = w;
    c->fd = fd;
    c->st = C_HEAD;
    c->ev = EPOLLIN | EPOLLRDHUP;
    c->t_act = w->now;
    struct epoll_event e = {.events = c->ev, .data.ptr = c};
    if (epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &e) != 0) {
        free(c);
        return NULL;
    }
    c->next = w->conns;
    if (w->conns) w->conns->prev = c;
    w->conns = c;
    return c;
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

/* After a response: the next request (keep-alive), lingering, or close. A half-closed client
 * stays in keep-alive: requests it pipelined before its EOF are still answered, and reading
 * meets the EOF once they are done, which closes the connection. */
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
    shutdown(c->fd, SHUT_WR);
    c->st = C_LINGER;
    c->rlen = 0;
    c->t_linger = c->w->now;
}

/* --- input --------------------------------------------------------------------------------- */

/* Sends the interim 100 response of a request that waits for it before sending its body. The
 * send buffer is empty between requests, so the 25 bytes go out in one call. */
static bool send_continue(struct h1_conn *c)
{
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    return send(c->fd, cont, sizeof cont - 1, MSG_NOSIGNAL) == (ssize_t)(sizeof cont - 1);
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
    if (!c->body_done && c->req->expect_continue && c->rlen == 0 && !send_continue(c))
        conn_close(c, H1_DONE_CLOSED);
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

/* C_LINGER: discards what a refused client still sends. */
static void linger_read(struct h1_conn *c)
{
    char tmp[16384];
    for (int i = 0; i < READS_PER_EVENT; i++) {
        ssize_t n = recv(c->fd, tmp, sizeof tmp, 0);
        if (n > 0) {
            c->lingered += (size_t)n;
            if (c->lingered <= LINGER_BYTES) continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else if (n < 0 && errno == EINTR) {
            continue;
        }
        conn_close(c, H1_DONE_SENT);
        return;
    }
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
 * reset. Nothing else on Linux does: both leave our socket in CLOSE-WAIT with only
 * EPOLLRDHUP (EPOLLHUP needs both directions shut), recv and MSG_PEEK both see EOF, a
 * zero-length send emits no segment, and keep-alive probes carry no new data, so even a closed
 * peer just acknowledges them. So bytes the client must accept are sent: an interim
 * "100 Continue", which RFC 9110 15.2 has every HTTP/1.1 client parse and skip before the
 * final response, unexpected or not. A client that left resets; EPOLLHUP|EPOLLERR (or the
 * next send failing) then closes the connection and cancels the request. Once per request, so
 * clients that cap interim responses are safe. Not for HTTP/1.0, which must not get a 1xx:
 * there a full close is seen only when the answer is written. A streamed response needs no
 * probe: its own bytes (the head at once, then each event) are the probe. */
static void probe_peer(struct h1_conn *c)
{
    static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
    c->probed = true;
    if (!c->req || c->req->minor == 0) return;
    ssize_t n = send(c->fd, probe, sizeof probe - 1, MSG_NOSIGNAL);
    if (n == (ssize_t)(sizeof probe - 1)) return;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return; /* no room now: the answer will tell */
    /* gone (EPIPE, ECONNRESET), or a partial interim response that would corrupt the stream */
    conn_close(c, H1_DONE_CLOSED);
}

/* C_WRITE: sends what is queued, refills from a stream reader. Returns false when blocked on
 * the socket, parked, or closed. */
static bool step_write(struct h1_conn *c)
{
    for (;;) {
        if (c->woff < c->wlen) {
            ssize_t n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
            if (n > 0) {
                c->woff += (size_t)n;
                c->t_act = c->w->now;
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
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
            break;
        case C_LINGER:
            break;
        }
        if (!progress) break;
    }
    if (!c->dead) update_interest(c);
}

/* Reads what the socket has (C_HEAD, C_BODY) and runs the connection on it. */
static void conn_read(struct h1_conn *c)
{
    for (int i = 0; i < READS_PER_EVENT && !c->dead && (c->st == C_HEAD || c->st == C_BODY); i++) {
        if (c->rcap - c->rlen < 1024 && c->rcap < RBUF_MAX) {
            size_t cap = c->rcap ? c->rcap * 2 : RBUF_MIN;
            if (cap > RBUF_MAX) cap = RBUF_MAX;
            char *b = realloc(c->rbuf, cap);
            if (!b) {
                conn_close(c, H1_DONE_CLOSED);
                return;
            }
            c->rbuf = b;
            c->rcap = cap;
        }
        if (c->rlen == c->rcap) break; /* full: the handler is not consuming (cannot happen) */
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, 0);
        if (n > 0) {
            if (c->rlen == 0 && c->st == C_HEAD) c->t_req = c->w->now;
            c->rlen += (size_t)n;
            c->t_act = c->w->now;
            conn_run(c);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        /* EOF or error: whatever was half-received can never complete */
        c->peer_closed = true;
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    if (!c->dead) conn_run(c);
}

static void conn_event(struct h1_conn *c, uint32_t ev)
{
    if (c->dead) return;
    if (ev & (EPOLLERR | EPOLLHUP)) {
        conn_close(c, H1_DONE_CLOSED);
        return;
    }
    if (ev & EPOLLRDHUP) c->peer_closed = true;
    switch (c->st) {
    case C_HEAD:
    case C_BODY:
        conn_read(c);
        break;
    case C_LINGER:
        linger_read(c);
        break;
    default:
        conn_run(c);
        break;
    }
}

/* --- wake-ups, timeouts, accept -------------------------------------------------------------- */

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
    if (kick) {
        uint64_t one = 1;
        ssize_t rc = write(w->evfd, &one, sizeof one);
        (void)rc; /* a full counter still wakes the thread */
    }
}

static void process_wakes(struct h1_worker *w)
{
    uint64_t v;
    ssize_t rc = read(w->evfd, &v, sizeof v);
    (void)rc;
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

/* Bytes of ours the client has not taken yet (our send queue). */
static int out_queued(struct h1_conn *c)
{
    int queued = 0;
    return ioctl(c->fd, SIOCOUTQ, &queued) == 0 ? queued : 0;
}

static void sweep(struct h1_worker *w)
{
    const struct h1_config *cfg = &w->s->cfg;
    double now = w->now;
    for (struct h1_conn *c = w->conns, *next; c; c = next) {
        next = c->next;
        switch (c->st) {
        case C_HEAD:
        case C_BODY:
            if (c->st == C_HEAD && c->rlen == 0) {
                if (now - c->t_act <= cfg->keep_alive_s) break;
                /* A slow reader still taking the last response is not idle: its keep-alive
                 * time starts once it has it all. One whose queue stopped shrinking is. */
                int q = out_queued(c);
                if (q > 0 && q < c->outq_seen) {
                    c->outq_seen = q;
                    c->t_act = now;
                } else {
                    conn_close(c, H1_DONE_CLOSED);
                }
            } else if (now - c->t_act > cfg->keep_alive_s || now - c->t_req > cfg->read_timeout_s) {
                conn_fail(c, 408, "the request was not received in time");
                conn_run(c);
            }
            break;
        case C_WRITE:
            if (now - c->t_act > cfg->keep_alive_s) conn_close(c, H1_DONE_CLOSED); /* not reading */
            break;
        case C_LINGER:
            if (now - c->t_linger > LINGER_S) conn_close(c, H1_DONE_SENT);
            break;
        default:
            break;
        }
    }
}

static void listen_toggle(struct h1_worker *w, bool on)
{
    struct h1_server *s = w->s;
    struct epoll_event e = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &s->lfd};
    if (on == w->listening) return;
    if (epoll_ctl(w->ep, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, s->lfd, on ? &e : NULL) == 0)
        w->listening = on;
}

static void accept_batch(struct h1_worker *w)
{
    struct h1_server *s = w->s;
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        struct sockaddr_in pa;
        socklen_t pal = sizeof pa;
        int fd = accept4(s->lfd, (struct sockaddr *)&pa, &pal, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* out of descriptors: stop taking connections for a moment rather than spin on
                 * a listening socket that stays readable */
                listen_toggle(w, false);
                w->relisten_at = w->now + 0.1;
            }
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* a token per packet */
        struct h1_conn *c = conn_new(w, fd);
        if (!c) {
            close(fd);
            continue;
        }
        char ip[INET_ADDRSTRLEN];
        if (pa.sin_family == AF_INET && inet_ntop(AF_INET, &pa.sin_addr, ip, sizeof ip))
            snprintf(c->peer, sizeof c->peer, "%s:%u", ip, (unsigned)ntohs(pa.sin_port));
        if (atomic_fetch_add(&s->n_conns, 1) >= s->cfg.max_conns) {
            c->no_linger = true;
            conn_fail(c, 503, "too many open connections; retry later");
            conn_run(c);
        }
    }
}

static void free_dead(struct h1_worker *w)
{
    while (w->dead) {
        struct h1_conn *c = w->dead;
        w->dead = c->next;
        free(c);
    }
}

static void *worker_main(void *arg)
{
    struct h1_worker *w = arg;
    struct h1_server *s = w->s;
    struct epoll_event evs[128];
    w->now = ms_now();
    double next_sweep = w->now + SWEEP_S;
    while (!atomic_load(&s->stop)) {
        int timeout = (int)((next_sweep - w->now) * 1000.0) + 1;
        int n = epoll_wait(w->ep, evs, 128, timeout < 0 ? 0 : timeout);
        w->now = ms_now();
        for (int i = 0; i < n; i++) {
            void *p = evs[i].data.ptr;
            if (p == &w->evfd)
                process_wakes(w);
            else if (p == &s->lfd)
                accept_batch(w);
            else
                conn_event(p, evs[i].events);
        }
        if (w->now >= next_sweep) {
            sweep(w);
            if (!w->listening && w->now >= w->relisten_at) listen_toggle(w, true);
            next_sweep = w->now + SWEEP_S;
        }
        free_dead(w);
    }
    while (w->conns)
        conn_close(w->conns, H1_DONE_STOPPED);
    free_dead(w);
    return NULL;
}

/* --- lifecycle ----------------------------------------------------------------------------- */

static void server_free(struct h1_server *s)
{
    atomic_store(&s->stop, true);
    for (int i = 0; i < s->n_workers; i++) {
        struct h1_worker *w = &s->w[i];
        if (w->started) {
            uint64_t one = 1;
            ssize_t rc = write(w->evfd, &one, sizeof one);
            (void)rc;
            pthread_join(w->thread, NULL);
        }
        if (w->ep >= 0) close(w->ep);
        if (w->evfd >= 0) close(w->evfd);
        pthread_mutex_destroy(&w->wake_mu);
    }
    if (s->lfd >= 0) close(s->lfd);
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
    s->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(s->lfd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        listen(s->lfd, SOMAXCONN) != 0) {
        ms_errf(err, errlen, "cannot listen on %s:%d: %s", cfg->host, cfg->port, strerror(errno));
        goto fail;
    }
    socklen_t al = sizeof addr;
    getsockname(s->lfd, (struct sockaddr *)&addr, &al);
    s->port = ntohs(addr.sin_port);
    s->w = calloc((size_t)s->cfg.threads, sizeof *s->w);
    if (!s->w) {
        ms_errf(err, errlen, "out of memory");
        goto fail;
    }
    for (int i = 0; i < s->cfg.threads; i++) {
        struct h1_worker *w = &s->w[i];
        w->s = s;
        w->ep = epoll_create1(EPOLL_CLOEXEC);
        w->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        pthread_mutex_init(&w->wake_mu, NULL);
        s->n_workers++;
        struct epoll_event e = {.events = EPOLLIN, .data.ptr = &w->evfd};
        if (w->ep < 0 || w->evfd < 0 || epoll_ctl(w->ep, EPOLL_CTL_ADD, w->evfd, &e) != 0) {
            ms_errf(err, errlen, "cannot create an event loop: %s", strerror(errno));
            goto fail;
        }
        listen_toggle(w, true);
        if (!w->listening || pthread_create(&w->thread, NULL, worker_main, w) != 0) {
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
