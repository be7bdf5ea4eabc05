/* What server/http.c shares with server/http_api.c (not a public API): the server's and a
 * generation request's state, and the helpers of http.c that the Messages and Responses
 * output (http_api.c, prefix hapi_) builds on. Internal names of http.c carry http__. See
 * http.c's opening comment for the life of a request and its lock order; every rule there
 * holds for the functions here.
 *
 * Ownership: as in http.c (a gen is freed by its last reference; strings returned are malloc'd
 * for the caller). */
#ifndef MOESERVE_HTTP_INT_H
#define MOESERVE_HTTP_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common.h"
#include "h1.h"
#include "http.h"
#include "jinja.h"
#include "proto/anthropic.h"
#include "proto/request.h"
#include "proto/response.h"
#include "proto/responses.h"
#include "rstore.h"

struct grm_vocab;
struct grm_cache;
struct prep_pool;
struct dash;

enum { HTTP_LOADING, HTTP_READY, HTTP_DRAINING };

struct http_server {
    struct http_config cfg;
    char *host, *api_key, *model_name;
    struct h1_server *srv;
    struct metrics *mt;
    atomic_int state;
    char fail_msg[256]; /* http_set_failed's reason: written once, before state turns */
    const struct model *m;
    struct sched *s;
    jinja_template *chat;      /* m->chat_template parsed once at ready; NULL if none/invalid */
    bool chat_object_args;     /* it iterates tool-call arguments: hand them over as objects */
    bool think;                /* chats have their <think> reasoning split off (tc_reasoning_on) */
    bool think_special;        /* <think> or </think> is a special token: keep those in the text */
    struct grm_vocab *gvocab;  /* the token trie structured output masks with (built at ready) */
    struct grm_cache *gcache;  /* compiled grammars by text (built at ready) */
    struct prep_pool *prep;    /* where generation requests are prepared (prep.h) */
    struct dash *dash;         /* GET /v1/moe/stats (set before ready; NULL: 404) */
    struct rstore *store;      /* Responses kept for GET and previous_response_id (rstore.h) */
    char chat_err[MS_ERR_LEN]; /* why chat is NULL when the model has a template */
    enum tc_syntax tc_syn;     /* the tool-call syntax (cfg.tool_parser, else detected at ready) */
    int port;
    atomic_int active;
    long created;
    atomic_ullong next_id;
};

struct choice_state {
    size_t text_sent;
    int tok_sent;
    bool finish_sent, role_sent;
    char *echo; /* completions with echo: the prompt text, sent first */
    size_t echo_len;
    size_t chars_sent;    /* characters (code points) sent, echo included: text_offset */
    struct tc_stream tcs; /* tool calls: where the output's parsing stands */
    int calls_sent;
    int prompt_tokens;
};

struct gen {
    struct http_server *h;
    struct h1_conn *c;
    enum proto_kind kind;
    bool stream, include_usage, logprobs;
    bool echo_lps;  /* echo + logprobs: the prompt's logprobs lead each choice's */
    bool plp_field; /* vLLM prompt_logprobs asked for */
    bool tokens_as_ids;
    bool tools; /* chat output to parse: tool calls, harmony channels, <think> */
    enum tc_syntax tc_syn;
    unsigned tc_flags;         /* TC_NO_CALLS / TC_THINK / TC_THINK_OPEN */
    struct tc_tools *tc_tools; /* the request's tools, typing XML-style arguments (may be NULL) */
    char id[64];
    char call_id[80]; /* tool-call ids: "<call_id>_<index>" */
    long created;
    int n;                   /* scheduler requests: prompts x n_per_prompt */
    int n_per_prompt;        /* requests per prompt: request k belongs to prompt k / n_per_prompt */
    int n_out;               /* choices per prompt in the answer (n; best_of picks them) */
    struct sched_req **reqs; /* (n) */
    struct choice_state *cs; /* (n) */
    int prompt_tokens;       /* each prompt counted once */
    pthread_mutex_t mu;
    uint64_t events;
    bool suspended;
    struct ms_buf pend; /* SSE bytes; those from pend_off on not yet handed to h1 */
    size_t pend_off;
    bool usage_sent, done_sent;
    bool tool_calls; /* a choice ended in tool calls (the access log's finish reason) */
    /* Preparation on the pool (gen_prepare): the body, taken from the connection, is parsed
     * and submitted there; the connection stays pending until the job wakes it. Under mu:
     * refs (the connection's and the job's), prepared (the job is done: prep_rc, prep_err,
     * stream, include_usage, logprobs and reqs are final), abandoned (on_done ran, so nobody
     * may wake the connection). started is the I/O thread's alone. */
    char *body;
    size_t body_len;
    int refs;
    bool prepared, abandoned, started;
    int prep_rc;
    struct proto_error prep_err;
    /* The Messages and Responses APIs (api != PROTO_API_OPENAI): one choice, whose output the
     * API's stream builds into events or, not streamed, into the body. Anthropic's
     * stop_sequences are kept in the text by the scheduler (include_stop_str) and held back
     * here (stop_hold bytes) until the output ends, so the one that matched is known. */
    enum proto_api api;
    struct anth_stream as;
    struct rsp_stream rs;
    char *stop[PROTO_MAX_STOP];
    int n_stop;
    size_t stop_hold;
    const char *stop_hit;  /* the stop sequence that ended the output, or NULL */
    bool store;            /* Responses: kept in h->store (running: with a cancel hook) */
    bool stored_final;     /* its final object is in the store */
    char *conv_json;       /* Responses: the conversation before this response */
    atomic_bool cancelled; /* POST /v1/responses/{id}/cancel stopped it */
    int think_budget;      /* Anthropic thinking.budget_tokens (0: none) */
    atomic_bool budget_hit;       /* the reasoning reached it: the choice was stopped there */
};

/* --- http.c's helpers ------------------------------------------------------------------- */

/* Sends a JSON body (taken) / an error in the route's API shape; counts and logs it. */
int http__send_json(struct http_server *h, struct h1_conn *c, const char *route, int status,
                    char *body);
int http__send_error(struct http_server *h, struct h1_conn *c, const char *route,
                     const struct proto_error *e);
/* Tokenizes text into a new array; returns the count or -1. */
int http__encode(const struct tokenizer *tok, const char *text, bool special, int32_t **out);
/* Prompt tokens served from the prefix cache (each prompt once). */
int http__gen_cached_tokens(struct gen *g);
/* Observes the most tokens a choice of each prompt generated (once every choice finished). */
void http__gen_observe_max(struct gen *g);
/* Queues an SSE frame (malloc'd, taken) behind the bytes not yet sent. */
bool http__pend_add(struct gen *g, char *frame);
/* A choice's new text (and reasoning, calls) up to tl, under r's lock. 0 or -1. */
int http__choice_delta(struct gen *g, struct choice_state *cs, const struct sched_req *r, size_t tl,
                       bool final, struct ms_buf *text, struct ms_buf *reasoning,
                       struct tc_call **calls, int *n_calls);

/* --- http_api.c: the Messages and Responses APIs' output and the Responses store -------- */

/* A streamed gen of these APIs: its new output into the API's events. True when bytes were
 * queued or the stream ended. */
bool hapi_collect(struct gen *g);
/* The non-streamed body once the choice finished (NULL with *status and e on failure). */
char *hapi_body(struct gen *g, int *status, struct proto_error *e);
/* Anthropic's thinking budget: stops a choice whose open reasoning reached it. From the
 * notify hook: the scheduler thread, the choice's lock held. */
void hapi_check_budget(struct gen *g);
/* The store's cancel hook of a running response (rstore_set_cancel). */
void hapi_cancel_hook(void *ctx);
/* proto_conv_lookup over the server's store (ctx: the http_server). */
char *hapi_conv_lookup(void *ctx, const char *id);
/* GET, DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel. */
int hapi_stored(struct http_server *h, struct h1_conn *c, const char *route);

#endif
