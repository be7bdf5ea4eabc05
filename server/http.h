/* HTTP front end on the h1 core (h1.h): routes (/v1/completions, /v1/chat/completions,
 * Anthropic's /v1/messages and /v1/messages/count_tokens, OpenAI's /v1/responses with its
 * store (GET, DELETE /v1/responses/{id}, POST .../cancel: rstore.h), /v1/models, /health,
 * /metrics, /tokenize, /detokenize), key auth (Bearer or x-api-key), body limits and each
 * API's error responses, protocol errors included. The three generation APIs share one
 * request core (proto/request.h) and differ only in their translation at the edge. HTTP threads
 * (h1's I/O threads) only frame requests and drain request outputs: parsing a generation or
 * tokenize body, rendering the chat template, tokenizing and compiling grammars run on the
 * preparation pool (prep.h), which wakes the connection when its request is submitted or answered.
 * A connection waiting for tokens is parked and woken by the scheduler's notify hook, so no thread
 * waits per connection, and a client that leaves while it waits cancels its request at once.
 *
 * Lifecycle: http_start listens at once and answers 503 until http_set_ready hands it the
 * model and scheduler (they must outlive http_stop). http_set_draining makes new generation
 * requests 503 while in-flight ones finish. http_stop closes every connection. */
#ifndef MOESERVE_HTTP_H
#define MOESERVE_HTTP_H

#include <stdbool.h>
#include <stddef.h>

#include "metrics.h"
#include "model.h"
#include "scheduler.h"

struct http_config {
    const char *host;        /* "127.0.0.1" */
    int port;                /* 0 = any free port (see http_port) */
    const char *api_key;     /* NULL = no auth */
    const char *model_name;  /* served model name */
    size_t max_body;         /* bytes; larger bodies get 413 */
    int threads;             /* I/O threads */
    int max_model_len;
    int max_waiting;         /* the scheduler's queue length: more choices than this are a 400 */
    int max_conns;           /* open connections at once (h1_config.max_conns) */
    double keep_alive_s;     /* idle / stall timeout (h1_config.keep_alive_s) */
    double read_timeout_s;   /* whole-request deadline (h1_config.read_timeout_s) */
    bool access_log;         /* one slog_access line per request (slog.h) */
    const char *tool_parser; /* vLLM's --tool-call-parser name (tc_syntax_parse); NULL or "auto":
                              * detected from the model (tc_syntax_of_model). Borrowed. */
    const char *reasoning_parser; /* --reasoning-parser (tc_reasoning_parse); NULL: auto */
    int response_store_entries;   /* Responses kept for GET and previous_response_id (0: none) */
    double response_store_ttl_s;  /* seconds a stored response is kept after its last write */
};

struct http_server;

int http_start(const struct http_config *cfg, struct metrics *mt, struct http_server **out,
               char *err, size_t errlen);
int http_port(const struct http_server *h);
/* max_model_len: the engine's resolved value (replaces cfg.max_model_len). */
void http_set_ready(struct http_server *h, const struct model *m, struct sched *s,
                    int max_model_len);
void http_set_draining(struct http_server *h);
/* Before http_set_ready: the live MoE view behind GET /v1/moe/stats (borrowed; it must outlive
 * http_stop). */
struct dash;
void http_set_dash(struct http_server *h, struct dash *d);
/* Like http_set_draining, from a READY server that cannot go on (a failed rank under mpirun):
 * 503s say "the server failed: WHY". */
void http_set_failed(struct http_server *h, const char *why);
int http_active_streams(const struct http_server *h); /* generation requests in flight */
void http_stop(struct http_server *h);

#endif
