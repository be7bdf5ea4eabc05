/* HTTP/1.1 server core: listening sockets, I/O threads (one libuv loop each), connections, request
 * framing (h1_parse), responses (fixed or streamed with chunked encoding), keep-alive and
 * pipelining, timeouts, and a connection cap. It knows nothing of routes: a handler gets each
 * request as events and answers with h1_respond or h1_respond_stream.
 *
 * Why not libmicrohttpd: it answers malformed requests with fixed HTML bodies (400, 414, 431,
 * 505), sends the headers of its Content-Length errors twice, closes on garbage without a
 * reply, accepts conflicting Content-Length values and whitespace before a colon, cannot see a
 * client leave while a connection is suspended, and in epoll mode (0.9.75) leaves sockets of
 * clients that close mid-request in CLOSE-WAIT until its timeout. Here the server owns
 * framing, so every error is the handler's JSON and sent once.
 *
 * A connection lives on the I/O thread that accepted it. Its states: reading a head, reading a
 * body, waiting for the handler (pending), writing, streaming but parked (waiting for output),
 * and lingering (discarding what a refused client still sends, so that our answer is not
 * lost to a reset). A pending or parked connection keeps reading: pipelined requests are
 * buffered (up to 64 KiB) for after its answer, and its client's EOF or reset is seen.
 *
 * A client that stops sending, by case:
 * - mid-request (head or body incomplete) and EOF: the request can never complete; closed.
 * - half-close after a complete request (shutdown(SHUT_WR), `nc -N`): answered, then closed.
 *   Requests it pipelined before its EOF are answered first. A pending (non-streamed) request
 *   first gets one interim "HTTP/1.1 100 Continue" (HTTP/1.1 only), which a client must skip.
 * - full close or reset while the request is pending, parked or written: the request is
 *   cancelled (on_done with H1_DONE_CLOSED). TCP shows a full close only as an EOF, the same as
 *   a half-close, until data reaches the client and its closed socket resets; so a pending
 *   request's EOF is answered by the 100 Continue probe (h1.c, probe_peer), and a streamed one's
 *   by its own next bytes; the reset (seen in the socket's state, checked every 50 ms after the
 *   EOF, or EPIPE/ECONNRESET from a write) then cancels. An HTTP/1.0 client that closes while its request is pending is seen only when the
 *   answer is written (no 1xx may be sent to it), and a streamed request's only at its next
 *   event; a client that resets (closes with unread data) is seen at once.
 *
 * Timeouts: keep_alive_s bounds an idle connection between requests and any stall while the
 * server waits on the client (a request arriving, a response not being read); read_timeout_s
 * bounds a whole request from its first byte to its last, so trickling bytes does not hold a
 * connection (408). Pending and parked connections wait on the server and never time out.
 *
 * Threads and ownership: callbacks run on the connection's I/O thread. h1_respond*, h1_data,
 * h1_set_data and the request accessors may only be called there, from inside a callback.
 * h1_wake may be called from any thread while the request is live, i.e. from the H1_HEAD
 * event until on_done returns; after on_done the connection may be freed. The I/O threads
 * block SIGPIPE for themselves (a client gone mid-write is an EPIPE). */
#ifndef MOESERVE_H1_H
#define MOESERVE_H1_H

#include <stddef.h>
#include <stdint.h>

struct h1_server;
struct h1_conn;

enum h1_event {
    H1_HEAD, /* the head is in and its framing is valid: route, method, auth, declared size */
    H1_BODY, /* a piece of the body: (data, len) */
    H1_END,  /* the whole request is in (also right after H1_HEAD for a request with no body) */
    H1_WAKE, /* h1_wake was called while the request waits for its response */
};

enum h1_done {
    H1_DONE_SENT,    /* the response went out */
    H1_DONE_CLOSED,  /* the client left or stopped reading first */
    H1_DONE_STOPPED, /* the server is stopping */
};

struct h1_callbacks {
    void *ctx;
    /* Drives one request. A response queued before H1_END refuses the rest of the body: it is
     * never read (what still arrives is discarded) and the connection closes after the answer.
     * Without a response after H1_END the request waits until h1_wake. */
    void (*on_request)(void *ctx, struct h1_conn *c, enum h1_event ev, const char *data,
                       size_t len);
    /* A protocol-level failure (malformed framing, a limit, the read deadline, the connection
     * cap): answer it with h1_respond(status, ...); the connection closes after. h1_data is
     * the request's data if H1_HEAD was delivered, else NULL. */
    void (*on_error)(void *ctx, struct h1_conn *c, int status, const char *message);
    /* The request's life is over (after H1_HEAD): free what h1_set_data holds. Not called for
     * a request whose head never arrived. */
    void (*on_done)(void *ctx, struct h1_conn *c, enum h1_done why);
};

struct h1_config {
    const char *host;      /* IPv4 address to listen on */
    int port;              /* 0 = any free port (see h1_port) */
    int threads;           /* I/O threads (default 4) */
    int max_conns;         /* open connections; past it a client gets 503 and is closed */
    double keep_alive_s;   /* idle and stall timeout (default 5) */
    double read_timeout_s; /* deadline for a whole request (default 30) */
    struct h1_callbacks cb;
};

/* Listens and starts the I/O threads. Returns 0, or -1 with a reason in err (nothing left
 * running). The configuration is copied. */
int h1_start(const struct h1_config *cfg, struct h1_server **out, char *err, size_t errlen);
int h1_port(const struct h1_server *s);
int h1_open_conns(const struct h1_server *s);
/* Closes every connection (on_done(H1_DONE_STOPPED) for live requests), joins the threads and
 * frees the server. */
void h1_stop(struct h1_server *s);

/* The current request (valid from H1_HEAD until on_done). */
const char *h1_method(const struct h1_conn *c);
const char *h1_peer(const struct h1_conn *c); /* the client's "address:port", "" if unknown */
const char *h1_path(const struct h1_conn *c);
const char *h1_header(const struct h1_conn *c, const char *name); /* first value, or NULL */
/* Declared body length: >= 0, INT64_MAX when too large to represent, -1 for chunked, -2
 * when the request has no body framing at all. */
int64_t h1_content_length(const struct h1_conn *c);

void h1_set_data(struct h1_conn *c, void *data);
void *h1_data(const struct h1_conn *c);

/* Queues the response: `headers` are extra "Name: value\r\n" lines (Content-Type included;
 * may be NULL); body (len bytes, malloc'd) is taken and freed. Returns 0, or -1 (out of
 * memory, or a response was already queued: body freed, the connection closes). */
int h1_respond(struct h1_conn *c, int status, const char *headers, char *body, size_t len);

/* A streamed body: reader fills buf with up to max bytes and returns how many, 0 when it has
 * nothing yet (the connection parks until h1_wake), H1_STREAM_END when the body is complete,
 * or H1_STREAM_ABORT to cut the connection. Sent with chunked encoding (HTTP/1.1). */
enum { H1_STREAM_END = -1, H1_STREAM_ABORT = -2 };
typedef long (*h1_reader)(void *ctx, char *buf, size_t max);
int h1_respond_stream(struct h1_conn *c, int status, const char *headers, h1_reader reader,
                      void *reader_ctx);

/* Any thread: has the I/O thread deliver H1_WAKE (pending) or call the reader again (parked).
 * Cheap when repeated; a wake for a connection in another state is dropped. */
void h1_wake(struct h1_conn *c);

#endif
