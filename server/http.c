/* HTTP front end (see http.h). A request's life: h1 (the HTTP/1.1 core) calls `on_request`
 * with the head, where everything that needs no body is decided (route, method, API key,
 * declared size: an unauthenticated or oversized body is never read), then with body pieces
 * (collected up to max_body; past it the 413 goes out at once), then at the end; the route
 * handler answers at once (models, health, metrics, errors), hands a tokenize body to the
 * preparation pool (a `tok_job`, answered when the pool wakes the connection), or creates a
 * `gen` and
 * hands its body to the preparation pool (prep.h), which parses it, renders the chat template,
 * tokenizes, compiles any grammar (through the grammar cache, under a budget) and submits one
 * scheduler request per choice, then wakes the connection: none of that work, whose cost the
 * client picks, runs on an I/O thread. Non-streaming gens leave the request pending until
 * every choice finished; streaming gens answer with a stream whose reader turns new output
 * into SSE frames and parks the connection when there is nothing to send. The scheduler's
 * notify hook wakes it (h1_wake). A client that leaves while its request waits is seen by h1,
 * whose on_done frees the gen and so cancels its choices. The Messages and Responses APIs
 * reach the same gen through their own edge translation (proto_req_parse_api); their output
 * and the Responses store's routes are in http_api.c (shared state: http_int.h). Lock order:
 * a request's lock, then the gen's lock; the reader never holds both (it samples an event counter
 * instead), so no wake-up is lost. */
#include "http.h"
#include "http_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common.h"
#include "dash.h"
#include "grammar.h"
#include "grm_cache.h"
#include "h1.h"
#include "jinja.h"
#include "proto/anthropic.h"
#include "proto/request.h"
#include "proto/response.h"
#include "proto/responses.h"
#include "prep.h"
#include "rstore.h"
#include "slog.h"

/* Threads that prepare generation requests (prep.h): enough that a few slow compiles do not
 * queue every other request behind them; they sleep when idle. */
#define PREP_THREADS 4
/* The compile budget of one request's grammar (guided_*, response_format, forced tools):
 * over it the request is a 400 naming the field. Generous for real schemas, which compile in
 * milliseconds; tight enough that no client holds a preparation thread for long. */
#define GRAMMAR_MAX_SECONDS 2.0
#define GRAMMAR_MAX_RULES (1u << 20)
#define GRAMMAR_MAX_BYTES ((size_t)256 << 20)
/* Compiled grammars kept (grm_cache.h): entries, and bytes of grammar text as keys. */
#define GRAMMAR_CACHE_ENTRIES 64
#define GRAMMAR_CACHE_BYTES ((size_t)32 << 20)
/* Bytes the Responses store keeps at most (entries and TTL are flags: http_config). */
#define RESPONSE_STORE_BYTES ((size_t)64 << 20)

static const struct grm_limits grammar_limits = {.max_seconds = GRAMMAR_MAX_SECONDS,
                                                 .max_rules = GRAMMAR_MAX_RULES,
                                                 .max_bytes = GRAMMAR_MAX_BYTES};

/* The 503 reason while draining: shutting down, or why the server failed (http_set_failed). */
static const char *draining_msg(const struct http_server *h)
{
    return h->fail_msg[0] ? h->fail_msg : "the server is shutting down";
}

struct conn {
    const char *route;
    double t0;     /* the head arrived (ms_now) */
    int status;    /* of the response queued, 0 before */
    char *body;
    size_t len, cap;
    struct gen *g;
    struct tok_job *tj; /* /tokenize, /detokenize, count_tokens on the preparation pool */
};

/* What a tok_job answers. */
enum tok_mode { TOK_ENCODE, TOK_DECODE, TOK_COUNT /* /v1/messages/count_tokens */ };

/* A /tokenize or /detokenize request answered on the preparation pool: rendering a chat
 * template and encoding a megabyte of text is work no I/O thread should do. Shared by the
 * connection and the job like a gen (refs, done and abandoned under mu); the job leaves the
 * answer (status, JSON body) and wakes the connection unless it was abandoned. */
struct tok_job {
    struct http_server *h;
    struct h1_conn *c;
    enum tok_mode mode;
    char *body; /* the request's, taken from the connection */
    size_t len;
    pthread_mutex_t mu;
    int refs;
    bool done, abandoned;
    int status;
    char *answer;
    bool sent; /* the I/O thread's: the answer went out */
};

/* --- helpers ------------------------------------------------------------------------------- */

/* The Messages routes answer errors in Anthropic's shape and status (anthropic.h). */
static bool anthropic_route(const char *route)
{
    return strncmp(route, "/v1/messages", 12) == 0;
}

/* The methods a route takes (its Allow header). */
static const char *route_methods(const char *route)
{
    return strcmp(route, "/v1/responses/{id}") == 0 ? "GET, HEAD, DELETE" : "POST";
}

static bool is_get_route(const char *route)
{
    static const char *const get_routes[] = {"/v1/models", "/v1/models/{id}", "/health",
                                             "/metrics", "/version", "/tokenizer_info",
                                             "/v1/moe/stats", "/dashboard"};
    for (size_t i = 0; i < sizeof get_routes / sizeof *get_routes; i++)
        if (strcmp(route, get_routes[i]) == 0) return true;
    return false;
}

/* The access-log line of a request whose head never arrived (h1 reports framing errors of
 * such requests with no request data): there is nothing else to wait for. */
static void log_headless(struct h1_conn *c, const char *route, int status)
{
    const char *peer = h1_peer(c);
    struct slog_access a = {.route = route, .status = status, .client = peer[0] ? peer : NULL,
                            .prompt_tokens = -1, .completion_tokens = -1, .ttft_s = -1,
                            .duration_s = -1, .outcome = "sent"};
    slog_access(&a);
}

/* Every response goes through here: the metrics count it, the access log gets its status. */
static void count_response(struct http_server *h, struct h1_conn *c, const char *route,
                           int status)
{
    metrics_http(h->mt, route, status);
    struct conn *cn = h1_data(c);
    if (cn) cn->status = status;
    else if (h->cfg.access_log) log_headless(c, route, status);
}

static int send_text(struct http_server *h, struct h1_conn *c, const char *route, int status,
                     char *body, const char *ctype)
{
    if (!body) {
        status = 500;
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                      "\"param\":null,\"code\":null}}");
        if (!body) return -1;
        ctype = "application/json";
    }
    char headers[192], allow[48] = "";
    if (status == 405)
        snprintf(allow, sizeof allow, "Allow: %s\r\n",
                 is_get_route(route) ? "GET, HEAD" : route_methods(route));
    snprintf(headers, sizeof headers, "Content-Type: %s\r\n%s%s%s", ctype,
             status == 429 || status == 529 ? "Retry-After: 1\r\n" : "", allow,
             status == 401 ? "WWW-Authenticate: Bearer\r\n" : "");
    count_response(h, c, route, status);
    return h1_respond(c, status, headers, body, strlen(body));
}

int http__send_json(struct http_server *h, struct h1_conn *c, const char *route, int status,
                    char *body)
{
    return send_text(h, c, route, status, body, "application/json");
}

int http__send_error(struct http_server *h, struct h1_conn *c, const char *route,
                     const struct proto_error *e)
{
    if (anthropic_route(route))
        return http__send_json(h, c, route, anth_status(e->status), anth_error(e));
    return http__send_json(h, c, route, e->status, proto_resp_error(e));
}

static int fail(struct http_server *h, struct h1_conn *c, const char *route, int status,
                const char *param, const char *code, const char *msg)
{
    struct proto_error e;
    proto_fail(&e, status, param, code, "%s", msg);
    return http__send_error(h, c, route, &e);
}

/* Constant-time comparison of the presented key (no early exit on the first difference). */
static bool key_ok(const char *want, const char *got)
{
    if (!got) return false;
    size_t wl = strlen(want), gl = strlen(got);
    unsigned diff = (unsigned)(wl ^ gl);
    for (size_t i = 0; i < gl; i++) diff |= (unsigned char)got[i] ^ (unsigned char)want[i % (wl ? wl : 1)];
    return diff == 0 && wl > 0;
}

/* Tokenizes text into a new array; returns the count or -1. */
int http__encode(const struct tokenizer *tok, const char *text, bool special, int32_t **out)
{
    size_t len = strlen(text);
    int cap = (int)(len < (1u << 28) ? len : (1u << 28)) + 16;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    if (!ids) return -1;
    int n = tok_encode(tok, text, len, special, ids, cap);
    if (n > cap) {
        int32_t *b = realloc(ids, sizeof(int32_t) * (size_t)n);
        if (!b) {
            free(ids);
            return -1;
        }
        ids = b;
        n = tok_encode(tok, text, len, special, ids, n);
    }
    if (n < 0) {
        free(ids);
        return -1;
    }
    *out = ids;
    return n;
}

/* Renders a chat through the model's template. */
static int render_chat(const struct http_server *h, const struct proto_req *pr, char **out,
                       struct proto_error *e)
{
    const struct model *m = h->m;
    if (!m->chat_template)
        return proto_fail(e, 400, "messages", "no_chat_template",
                          "this model has no chat template");
    if (!h->chat)
        return proto_fail(e, 400, "messages", "chat_template_error",
                          "the model's chat template does not parse: %s", h->chat_err);
    /* a field with no effect is refused: the template must read the variable */
    if (pr->reasoning_effort && !strstr(m->chat_template, "reasoning_effort"))
        return proto_fail(e, 400, "reasoning_effort", "unsupported_value",
                          "this model's chat template does not take 'reasoning_effort'");
    if (pr->thinking_switch && !strstr(m->chat_template, "enable_thinking"))
        return proto_fail(e, 400, "thinking", "unsupported_value",
                          "this model's chat template has no thinking switch (enable_thinking)");
    const struct tokenizer *tok = m->tok;
    int32_t bos = tok_bos_id(tok), eos = tok_eos_id(tok);
    const char *bos_s = bos >= 0 ? tok_token_str(tok, bos) : NULL;
    const char *eos_s = eos >= 0 ? tok_token_str(tok, eos) : NULL;
    /* tools reach the template whatever tool_choice is, as transformers passes them */
    struct jinja_chat_args args = {.messages_json = pr->messages_json,
                                   .tools_json = pr->tools_json,
                                   .extra_json = pr->template_kwargs_json,
                                   .add_generation_prompt = pr->add_generation_prompt,
                                   .bos_token = bos_s ? bos_s : "",
                                   .eos_token = eos_s ? eos_s : "",
                                   .object_arguments = h->chat_object_args};
    char err[MS_ERR_LEN];
    if (jinja_render_chat_args(h->chat, &args, out, err, sizeof err) != 0)
        return proto_fail(e, 400, "messages", "chat_template_error",
                          "cannot apply the chat template: %s", err);
    return 0;
}

/* --- generation ---------------------------------------------------------------------------- */

/* The scheduler thread, with the request's lock held, after new output was published. */
static void gen_notify(void *ctx)
{
    struct gen *g = ctx;
    hapi_check_budget(g); /* at the token that reaches it: the budget is kept to a step */
    pthread_mutex_lock(&g->mu);
    g->events++;
    if (g->suspended && !g->abandoned) {
        g->suspended = false;
        h1_wake(g->c);
    }
    pthread_mutex_unlock(&g->mu);
}

static void gen_free(struct gen *g)
{
    if (!g) return;
    if (g->store) {
        /* no cancel may reach the choices freed below; a response that never finished (its
         * client left) is stored as cancelled */
        rstore_clear_cancel(g->h->store, g->id);
        if (!g->stored_final) {
            char *snap = rsp_stream_snapshot(&g->rs, "cancelled");
            if (snap) rstore_put(g->h->store, g->id, snap, NULL);
            free(snap);
        }
    }
    if (g->api == PROTO_API_ANTHROPIC) anth_stream_free(&g->as);
    if (g->api == PROTO_API_RESPONSES) rsp_stream_free(&g->rs);
    for (int i = 0; i < g->n_stop; i++)
        free(g->stop[i]);
    free(g->conv_json);
    for (int i = 0; g->reqs && i < g->n; i++) {
        if (!g->reqs[i]) continue;
        sched_req_set_notify(g->reqs[i], NULL, NULL);
        sched_req_cancel(g->h->s, g->reqs[i]);
        sched_req_release(g->reqs[i]);
    }
    for (int i = 0; g->cs && i < g->n; i++) free(g->cs[i].echo);
    free(g->reqs);
    free(g->cs);
    tc_tools_free(g->tc_tools);
    ms_buf_free(&g->pend);
    free(g->body);
    pthread_mutex_destroy(&g->mu);
    atomic_fetch_sub(&g->h->active, 1);
    free(g);
}

/* Drops one reference (the connection's with abandon: nobody may wake it any more); the last
 * frees the gen, cancelling its choices. */
static void gen_unref(struct gen *g, bool abandon)
{
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    if (abandon) g->abandoned = true;
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) gen_free(g);
}

static bool gen_prepared(struct gen *g)
{
    pthread_mutex_lock(&g->mu);
    bool done = g->prepared;
    pthread_mutex_unlock(&g->mu);
    return done;
}

/* Marks the gen as waiting for output unless output arrived since `seen` (then the caller
 * retries). The caller then leaves the connection pending or parked; gen_notify wakes it. */
static bool gen_suspend(struct gen *g, uint64_t seen)
{
    pthread_mutex_lock(&g->mu);
    bool ok = g->events == seen;
    if (ok) g->suspended = true;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

static uint64_t gen_events(struct gen *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t ev = g->events;
    pthread_mutex_unlock(&g->mu);
    return ev;
}

static bool gen_all_finished(struct gen *g)
{
    for (int i = 0; i < g->n; i++) {
        sched_req_lock(g->reqs[i]);
        bool f = g->reqs[i]->out.finish != SCHED_FINISH_NONE;
        sched_req_unlock(g->reqs[i]);
        if (!f) return false;
    }
    return true;
}

static const char *finish_name(enum sched_finish f)
{
    return f == SCHED_FINISH_LENGTH ? "length" : f == SCHED_FINISH_NONE ? NULL
                                             : f == SCHED_FINISH_STOP   ? "stop"
                                                                        : "abort";
}

/* Prompt tokens whose K/V came from the prefix cache, counted once per prompt (its first
 * choice; later choices of the same prompt reuse what the first computed). */
int http__gen_cached_tokens(struct gen *g)
{
    int cached = 0;
    for (int k = 0; k < g->n; k += g->n_per_prompt > 0 ? g->n_per_prompt : 1) {
        sched_req_lock(g->reqs[k]);
        cached += g->reqs[k]->out.n_cached_tokens;
        sched_req_unlock(g->reqs[k]);
    }
    return cached;
}

/* Once every choice finished, before the answer's last bytes go out (so a scrape after the
 * answer sees it): per prompt, the most tokens one of its choices generated. vLLM observes
 * request_max_num_generation_tokens per request of n choices, and each prompt of a list is a
 * request there. */
void http__gen_observe_max(struct gen *g)
{
    int per = g->n_per_prompt > 0 ? g->n_per_prompt : 1;
    for (int k = 0; k < g->n; k += per) {
        int most = 0;
        for (int j = k; j < k + per && j < g->n; j++) {
            sched_req_lock(g->reqs[j]);
            if (g->reqs[j]->out.n_tokens > most) most = g->reqs[j]->out.n_tokens;
            sched_req_unlock(g->reqs[j]);
        }
        metrics_request_max_gen(g->h->mt, most);
    }
}

/* Sum of the chosen tokens' logprobs: how best_of ranks a request's samples. */
static double cum_logprob(const struct sched_req *r)
{
    double sum = 0.0;
    for (int t = 0; r->out.lps && t < r->out.n_tokens; t++) sum += r->out.lps[t].logprob;
    return sum;
}

/* Fills the prompt-logprob part of a choice from its finished (or prefilled) request. */
static void choice_prompt(const struct gen *g, const struct sched_req *r, struct proto_choice *c)
{
    c->echo_logprobs = g->echo_lps;
    c->prompt_logprobs = g->plp_field;
    c->tokens_as_ids = g->tokens_as_ids;
    if (!g->echo_lps && !g->plp_field) return;
    c->prompt_ids = r->tokens; /* the prompt part never changes */
    c->prompt_lps = r->out.prompt_lps;
    c->n_prompt = r->n_prompt;
}

/* The full body once every choice finished. With best_of, each prompt's samples are ranked by
 * cumulative logprob and its n best become its choices. */
static char *gen_body(struct gen *g, int *status, struct proto_error *e)
{
    size_t n_choices = g->n > 0 ? (size_t)g->n : 1;
    struct proto_choice *ch = calloc(n_choices, sizeof *ch);
    char **texts = calloc(n_choices, sizeof *texts);
    int *order = calloc(n_choices, sizeof *order);
    char *body = NULL;
    int completion = 0, n_ch = 0;
    struct tc_call **calls = calloc(n_choices, sizeof *calls);
    int *n_calls = calloc(n_choices, sizeof *n_calls);
    char **thinks = calloc(n_choices, sizeof *thinks);
    *status = 200;
    if (!ch || !texts || !order || !calls || !n_calls || !thinks) goto out;
    for (int i = 0; i < g->n; i++) {
        struct sched_req *r = g->reqs[i];
        sched_req_lock(r);
        enum sched_finish f = r->out.finish;
        completion += r->out.n_tokens;
        sched_req_unlock(r);
        if (f == SCHED_FINISH_ERROR || f == SCHED_FINISH_ABORT) {
            proto_fail(e, f == SCHED_FINISH_ERROR ? 500 : 503, NULL, NULL,
                       "generation failed: %s", r->out.error);
            *status = e->status;
            goto out;
        }
    }
    /* Every request finished: their outputs no longer change and are read unlocked. */
    for (int p = 0; p < g->n / g->n_per_prompt; p++) {
        int base = p * g->n_per_prompt;
        for (int j = 0; j < g->n_per_prompt; j++) order[base + j] = base + j;
        for (int j = 1; j < g->n_per_prompt && g->n_out < g->n_per_prompt; j++)
            for (int k = j; k > 0 && cum_logprob(g->reqs[order[base + k]]) >
                                         cum_logprob(g->reqs[order[base + k - 1]]);
                 k--) {
                int t = order[base + k];
                order[base + k] = order[base + k - 1];
                order[base + k - 1] = t;
            }
        for (int j = 0; j < g->n_out; j++) {
            int i = order[base + j];
            struct sched_req *r = g->reqs[i];
            struct proto_choice *c = &ch[n_ch];
            struct ms_buf t = {0};
            if (ms_buf_add(&t, g->cs[i].echo, g->cs[i].echo_len) != 0 ||
                ms_buf_add(&t, r->out.text, r->out.text_len) != 0) {
                ms_buf_free(&t);
                goto out;
            }
            c->index = n_ch;
            c->text_len = t.len;
            c->text = texts[n_ch] = ms_buf_take(&t);
            c->finish_reason = finish_name(r->out.finish);
            if (g->tools) {
                struct ms_buf content = {0}, think = {0};
                int prc = tc_parse(g->tc_syn, g->tc_flags, g->tc_tools, texts[n_ch], c->text_len, &content,
                                   &calls[n_ch], &n_calls[n_ch], &think);
                c->text_len = content.len;
                c->reasoning_len = think.len;
                free(texts[n_ch]);
                c->text = texts[n_ch] = ms_buf_take(&content);
                c->reasoning = thinks[n_ch] = ms_buf_take(&think);
                if (prc != 0 || !c->text || !c->reasoning) goto out;
                c->calls = calls[n_ch];
                c->n_calls = n_calls[n_ch];
                c->call_id = g->call_id;
                if (n_calls[n_ch] > 0 && r->out.finish == SCHED_FINISH_STOP) {
                    c->finish_reason = "tool_calls";
                    g->tool_calls = true;
                }
            }
            if (g->logprobs) {
                c->lps = r->out.lps;
                c->n_lps = r->out.n_tokens;
            }
            choice_prompt(g, r, c);
            n_ch++;
        }
    }
    struct proto_usage u = {.prompt_tokens = g->prompt_tokens,
                            .completion_tokens = completion,
                            .cached_tokens = http__gen_cached_tokens(g)};
    body = proto_resp_body(g->kind, g->id, g->created, g->h->model_name, ch, n_ch, &u,
                           g->h->m->tok);
out:
    /* all of them: a failure leaves the choice it was building half made */
    for (size_t i = 0; texts && i < n_choices; i++) free(texts[i]);
    for (size_t i = 0; calls && n_calls && i < n_choices; i++) tc_calls_free(calls[i], n_calls[i]);
    for (size_t i = 0; thinks && i < n_choices; i++) free(thinks[i]);
    free(thinks);
    free(calls);
    free(n_calls);
    free(texts);
    free(order);
    free(ch);
    return body;
}

/* Queues a frame (malloc'd, taken) behind the SSE bytes not yet sent. */
bool http__pend_add(struct gen *g, char *frame)
{
    if (!frame) return false;
    if (g->pend_off == g->pend.len) g->pend_off = g->pend.len = 0;
    bool ok = ms_buf_adds(&g->pend, frame) == 0;
    free(frame);
    return ok;
}

/* A choice's new text for its next chunk, appended to text (and reasoning): the echoed prompt
 * first when the choice has not started, then the output since the last chunk, or, for an
 * output parsed for tool calls, what its parser released (the calls completed since then in
 * *calls). Under r's lock. Returns -1 when out of memory. */
int http__choice_delta(struct gen *g, struct choice_state *cs, const struct sched_req *r, size_t tl,
                       bool final, struct ms_buf *text, struct ms_buf *reasoning,
                       struct tc_call **calls, int *n_calls)
{
    if (cs->echo && !cs->role_sent && ms_buf_add(text, cs->echo, cs->echo_len) != 0) return -1;
    if (g->tools)
        return tc_stream_feed(&cs->tcs, r->out.text, tl, final, text, reasoning, calls, n_calls);
    return ms_buf_add(text, r->out.text + cs->text_sent, tl - cs->text_sent);
}

/* Turns new output of every choice into SSE frames. Returns true when frames were added. */
static bool gen_collect(struct gen *g)
{
    if (g->api != PROTO_API_OPENAI) return hapi_collect(g);
    bool added = false, all_done = true;
    int completion = 0;
    for (int i = 0; i < g->n; i++) {
        struct choice_state *cs = &g->cs[i];
        struct sched_req *r = g->reqs[i];
        if (cs->finish_sent) {
            completion += r->out.n_tokens; /* finished: no writer any more */
            continue;
        }
        sched_req_lock(r);
        size_t tl = r->out.text_len;
        int nt = r->out.n_tokens;
        enum sched_finish fin = r->out.finish;
        bool has_new = tl > cs->text_sent || (g->logprobs && nt > cs->tok_sent) ||
                       fin != SCHED_FINISH_NONE || (cs->echo && !cs->role_sent);
        /* A choice's first chunk carries its prompt logprobs: wait for the prefill. */
        if ((g->echo_lps || g->plp_field) && !cs->role_sent && r->out.prompt_lps &&
            r->out.n_prompt_lps < r->n_prompt && fin == SCHED_FINISH_NONE)
            has_new = false;
        char *frame = NULL;
        if (fin == SCHED_FINISH_ERROR) {
            struct proto_error e;
            proto_fail(&e, 500, NULL, NULL, "generation failed: %s", r->out.error);
            frame = proto_resp_error_sse(&e);
        } else if (has_new) {
            struct ms_buf delta = {0}, think = {0};
            struct tc_call *calls = NULL;
            int n_calls = 0;
            if (http__choice_delta(g, cs, r, tl, fin != SCHED_FINISH_NONE, &delta, &think, &calls,
                                   &n_calls) != 0) {
                sched_req_unlock(r);
                ms_buf_free(&delta);
                ms_buf_free(&think);
                tc_calls_free(calls, n_calls);
                return added;
            }
            const char *text = delta.p ? delta.p : "";
            size_t len = delta.len, think_len = think.len;
            struct proto_choice c = {
                .index = i, .text = text, .text_len = len, .finish_reason = finish_name(fin),
                .lps = g->logprobs ? r->out.lps + cs->tok_sent : NULL,
                .n_lps = g->logprobs ? nt - cs->tok_sent : 0,
                .text_offset = cs->chars_sent,
                .tokens_as_ids = g->tokens_as_ids,
            };
            if (!cs->role_sent) choice_prompt(g, r, &c);
            c.calls = calls;
            c.n_calls = n_calls;
            c.reasoning = think.p;
            c.reasoning_len = think_len;
            c.call_index0 = cs->calls_sent;
            c.call_id = g->call_id;
            if (fin == SCHED_FINISH_STOP && cs->calls_sent + n_calls > 0) {
                c.finish_reason = "tool_calls";
                g->tool_calls = true;
            }
            /* nothing to say yet (a call's text is held back): no empty delta */
            bool empty = g->tools && len == 0 && n_calls == 0 && think_len == 0 &&
                         cs->role_sent && fin == SCHED_FINISH_NONE &&
                         !(g->logprobs && nt > cs->tok_sent);
            if (!empty)
                frame = proto_resp_chunk(g->kind, g->id, g->created, g->h->model_name, &c,
                                         g->kind == PROTO_CHAT && !cs->role_sent, NULL,
                                         g->h->m->tok);
            if (frame) cs->calls_sent += n_calls;
            tc_calls_free(calls, n_calls);
            for (size_t b = 0; frame && b < len; b++)
                cs->chars_sent += ((unsigned char)text[b] & 0xC0) != 0x80;
            ms_buf_free(&delta);
            ms_buf_free(&think);
        }
        sched_req_unlock(r);
        if (frame) {
            if (!http__pend_add(g, frame)) return added;
            added = true;
            cs->text_sent = tl;
            cs->tok_sent = nt;
            cs->role_sent = true;
            if (fin != SCHED_FINISH_NONE) cs->finish_sent = true;
        }
        if (!cs->finish_sent) all_done = false;
        completion += nt;
    }
    if (all_done && !g->done_sent) {
        if (g->include_usage && !g->usage_sent) {
            struct proto_usage u = {.prompt_tokens = g->prompt_tokens,
                                    .completion_tokens = completion,
                                    .cached_tokens = http__gen_cached_tokens(g)};
            http__pend_add(g, proto_resp_chunk(g->kind, g->id, g->created, g->h->model_name, NULL,
                                               false, &u, NULL));
            g->usage_sent = true;
        }
        http__gen_observe_max(g);
        http__pend_add(g, strdup(PROTO_SSE_DONE));
        g->done_sent = true;
        added = true;
    }
    return added;
}

static long stream_reader(void *cls, char *buf, size_t max)
{
    struct gen *g = cls;
    for (;;) {
        if (g->pend_off < g->pend.len) {
            size_t n = g->pend.len - g->pend_off;
            if (n > max) n = max;
            memcpy(buf, g->pend.p + g->pend_off, n);
            g->pend_off += n;
            return (long)n;
        }
        if (g->done_sent) return H1_STREAM_END;
        uint64_t seen = gen_events(g);
        if (gen_collect(g)) continue;
        if (gen_suspend(g, seen)) return 0; /* parked until gen_notify */
    }
}

/* Token ids a request names (logit_bias, stop_token_ids, allowed_token_ids) must exist. */
static int check_ids(const struct proto_req *pr, int vocab, struct proto_error *e)
{
    for (int i = 0; i < pr->n_logit_bias; i++)
        if (pr->logit_bias[i].id >= vocab)
            return proto_fail(e, 400, "logit_bias", "invalid_value",
                              "token id %d out of range [0, %d)", pr->logit_bias[i].id, vocab);
    for (int i = 0; i < pr->n_stop_token_ids; i++)
        if (pr->stop_token_ids[i] >= vocab)
            return proto_fail(e, 400, "stop_token_ids", "invalid_value",
                              "token id %d out of range [0, %d)", pr->stop_token_ids[i], vocab);
    for (int i = 0; i < pr->n_allowed; i++)
        if (pr->allowed_token_ids[i] >= vocab)
            return proto_fail(e, 400, "allowed_token_ids", "invalid_value",
                              "token id %d out of range [0, %d)", pr->allowed_token_ids[i], vocab);
    return 0;
}

/* FNV-1a of a cache_salt (0 = none). */
static uint64_t salt_hash(const char *salt)
{
    if (!salt) return 0;
    uint64_t x = 1469598103934665603ull;
    for (const char *c = salt; *c; c++) x = (x ^ (unsigned char)*c) * 1099511628211ull;
    return x ? x : 1;
}

/* The scheduler parameters every request of pr shares (j: the sample's index, for the seed). */
static void req_params(const struct gen *g, const struct proto_req *pr, int max_tokens, int j,
                       struct smp_bias *bias, struct sched_req_params *sp)
{
    sched_req_params_default(sp);
    sp->max_tokens = max_tokens;
    sp->smp.temperature = (float)pr->temperature;
    sp->smp.top_p = (float)pr->top_p;
    sp->smp.top_k = pr->top_k;
    sp->smp.min_p = (float)pr->min_p;
    sp->smp.presence_penalty = (float)pr->presence_penalty;
    sp->smp.frequency_penalty = (float)pr->frequency_penalty;
    sp->smp.repetition_penalty = (float)pr->repetition_penalty;
    sp->smp.has_seed = pr->has_seed;
    sp->smp.seed = (uint64_t)pr->seed + (uint64_t)j;
    /* best_of ranks samples by their cumulative logprob: record them even if not shown */
    sp->logprobs = pr->logprobs || g->n_per_prompt > g->n_out;
    sp->smp.n_logprobs = pr->top_logprobs < SMP_MAX_LOGPROBS ? pr->top_logprobs : SMP_MAX_LOGPROBS;
    sp->smp.bias = bias;
    sp->smp.n_bias = pr->n_logit_bias;
    sp->smp.allowed = pr->allowed_token_ids;
    sp->smp.n_allowed = pr->n_allowed;
    sp->ignore_eos = pr->ignore_eos;
    sp->skip_special = pr->skip_special_tokens;
    sp->moe_top_k = pr->moe_top_k;
    sp->moe_samples = pr->moe_samples;
    sp->moe_neuron_fraction = pr->moe_neuron_fraction;
    sp->moe_samples_adaptive = pr->moe_samples_adaptive;
    sp->speculative = pr->speculative != 0;
    sp->prompt_logprobs = -1;
    if (g->plp_field) sp->prompt_logprobs = pr->prompt_logprobs;
    if (g->echo_lps && pr->top_logprobs > sp->prompt_logprobs)
        sp->prompt_logprobs = pr->top_logprobs;
    sp->n_stop = pr->n_stop;
    for (int s = 0; s < pr->n_stop; s++) sp->stop[s] = pr->stop[s];
    /* Anthropic's stop sequences stay in the text until the API sees which one matched */
    sp->include_stop_str = pr->include_stop_str || g->n_stop > 0;
    sp->stop_ids = pr->stop_token_ids;
    sp->n_stop_ids = pr->n_stop_token_ids;
    sp->min_tokens = pr->min_tokens;
    sp->cache_salt = salt_hash(pr->cache_salt);
    sp->tag = g->h->dash ? dash_tag_id(g->h->dash, pr->moe_tag) : 0;
}

/* Compiles the request's structured-output constraint. A JSON Schema keyword the compiler
 * lacks is named in the message. */
static int compile_guide(struct http_server *h, const struct proto_req *pr,
                         struct grm_grammar **out, struct proto_error *e)
{
    enum grm_kind kind = GRM_EBNF;
    switch (pr->guide_kind) {
    case PROTO_GUIDE_JSON_OBJECT: kind = GRM_JSON_OBJECT; break;
    case PROTO_GUIDE_JSON_SCHEMA: kind = GRM_JSON_SCHEMA; break;
    case PROTO_GUIDE_REGEX: kind = GRM_REGEX; break;
    case PROTO_GUIDE_CHOICE: kind = GRM_CHOICE; break;
    default: break;
    }
    if (!h->gcache)
        return proto_fail(e, 500, NULL, NULL, "structured output needs the model's tokenizer");
    char err[MS_ERR_LEN], kw[64];
    int rc = grm_cache_compile(h->gcache, kind, pr->guide, &grammar_limits, out, err, sizeof err,
                               kw, sizeof kw);
    if (rc == GRM_EBUDGET)
        return proto_fail(e, 400, pr->guide_param, "grammar_too_expensive", "'%s': %s",
                          pr->guide_param, err);
    if (rc != 0)
        return proto_fail(e, 400, pr->guide_param,
                          kw[0] ? "unsupported_schema_keyword" : "invalid_grammar", "'%s': %s",
                          pr->guide_param, err);
    return 0;
}

/* tool_choice required or named: a grammar that makes the output one call (or, with
 * parallel_tool_calls, one or more) in the model's syntax. */
static int compile_tool_grammar(struct http_server *h, const struct proto_req *pr,
                                enum tc_syntax syn, struct grm_grammar **grammar,
                                struct proto_error *e)
{
    if (*grammar) {
        grm_release(*grammar);
        *grammar = NULL;
        return proto_fail(e, 400, "tool_choice", "invalid_value",
                          "tool_choice %s cannot be combined with %s",
                          pr->tool_choice == PROTO_TOOL_REQUIRED ? "required" : "(a function)",
                          pr->guide_param);
    }
    char *ebnf = NULL, err[MS_ERR_LEN], kw[64] = "";
    if (tc_markers_special(syn, h->m->tok))
        return proto_fail(e, 400, "tool_choice", "invalid_value",
                          "forcing a tool call is not supported for this model's tool-call "
                          "syntax (%s: its markers are special tokens)", tc_syntax_name(syn));
    int rc = tc_grammar(syn, pr->tools_json,
                        pr->tool_choice == PROTO_TOOL_NAMED ? pr->tool_choice_name : NULL,
                        pr->parallel_tool_calls, &ebnf, err, sizeof err, kw, sizeof kw);
    if (rc == 0 && !h->gcache) rc = ms_errf(err, sizeof err, "the model has no tokenizer");
    if (rc == 0)
        rc = grm_cache_compile(h->gcache, GRM_EBNF, ebnf, &grammar_limits, grammar, err,
                               sizeof err, NULL, 0);
    free(ebnf);
    if (rc == GRM_EBUDGET)
        return proto_fail(e, 400, "tools", "grammar_too_expensive", "%s", err);
    if (rc != 0)
        return proto_fail(e, 400, kw[0] ? "tools" : "tool_choice",
                          kw[0] ? "unsupported_schema_keyword" : "invalid_value", "%s", err);
    return 0;
}

/* The echoed prompt of a completion: its text, or the decoded ids when it came as ids or was
 * truncated. */
static char *echo_text(const struct tokenizer *tok, const char *text, const int32_t *ids, int n)
{
    if (text) return strdup(text);
    char tmp[1];
    long need = tok_decode(tok, ids, n, false, tmp, sizeof tmp);
    char *s = need >= 0 ? malloc((size_t)need + 1) : NULL;
    if (s) tok_decode(tok, ids, n, false, s, (size_t)need + 1);
    return s;
}

/* The continuous-experts budget (moe_samples, moe_neuron_fraction) against the model: within
 * its bounds, and only for a continuous-experts model (like moe_top_k above a model's k, the
 * field is refused rather than ignored). */
static int check_cont_budget(const struct model_desc *md, const struct proto_req *pr,
                             struct proto_error *e)
{
    bool cont = md->ffn == FFN_KIND_CONTINUOUS;
    if (pr->moe_samples > 0 && !cont)
        return proto_fail(e, 400, "moe_samples", "invalid_value",
                          "'moe_samples' applies to continuous-experts (infmoe) models only");
    if (pr->moe_samples > 0 && pr->moe_samples > md->cont_max_samples)
        return proto_fail(e, 400, "moe_samples", "invalid_value",
                          "'moe_samples' must be at most the model's %d samples per token",
                          md->cont_max_samples);
    if (pr->moe_samples_adaptive && (!cont || md->cont_n_quant == 0))
        return proto_fail(e, 400, "moe_samples_adaptive", "invalid_value",
                          "'moe_samples_adaptive' needs a continuous-experts (infmoe) model whose "
                          "config has an adaptive_logvar_quantiles calibration");
    if (pr->moe_neuron_fraction > 0 && !cont)
        return proto_fail(e, 400, "moe_neuron_fraction", "invalid_value",
                          "'moe_neuron_fraction' applies to continuous-experts (infmoe) models "
                          "only");
    if (pr->moe_neuron_fraction > 0 && pr->moe_neuron_fraction > md->cont_fraction)
        return proto_fail(e, 400, "moe_neuron_fraction", "invalid_value",
                          "'moe_neuron_fraction' must be at most the model's trained %g",
                          md->cont_fraction);
    return 0;
}

/* Builds and submits the scheduler requests: per prompt, n (or best_of) samples. Returns 0 or
 * -1 with e. */
static int gen_submit(struct http_server *h, struct gen *g, struct proto_req *pr,
                      struct proto_error *e)
{
    const struct model *m = h->m;
    int n_prompts = pr->kind == PROTO_CHAT ? 1 : pr->n_prompts;
    g->n_out = pr->n;
    g->n_per_prompt = pr->best_of > pr->n ? pr->best_of : pr->n;
    g->n = n_prompts * g->n_per_prompt;
    g->echo_lps = pr->echo && pr->logprobs;
    g->plp_field = pr->prompt_logprobs >= 0;
    g->tokens_as_ids = pr->tokens_as_ids;
    g->reqs = calloc((size_t)g->n, sizeof *g->reqs);
    g->cs = calloc((size_t)g->n, sizeof *g->cs);
    if (!g->reqs || !g->cs) return proto_fail(e, 500, NULL, NULL, "out of memory");
    /* Each choice is one queued sequence: more than the queue holds could never be admitted,
     * so this is the client's error to fix, not a 429 to retry. */
    if (h->cfg.max_waiting > 0 && g->n > h->cfg.max_waiting)
        return proto_fail(e, 400, pr->n > 1 ? "n" : "prompt", "invalid_value",
                          "the request asks for %d sequences (%d prompt(s) x n=%d) but the server "
                          "queues at most %d (--max-waiting)",
                          g->n, n_prompts, pr->n, h->cfg.max_waiting);
    if (pr->moe_top_k > m->desc.top_k)
        return proto_fail(e, 400, "moe_top_k", "invalid_value",
                          "'moe_top_k' must be at most the model's %d experts per token",
                          m->desc.top_k);
    if (check_cont_budget(&m->desc, pr, e) != 0) return -1;
    /* speculative: false opts out; true asks for what only --speculative-config gives */
    if (pr->speculative == 1 && !sched_spec_enabled(h->s))
        return proto_fail(e, 400, "speculative", "invalid_value",
                          "'speculative' is true, but the server was started without "
                          "--speculative-config");
    if (check_ids(pr, m->desc.vocab, e) != 0) return -1;
    if (g->api == PROTO_API_ANTHROPIC)
        for (int i = 0; i < pr->n_stop; i++) {
            if (!(g->stop[i] = strdup(pr->stop[i])))
                return proto_fail(e, 500, NULL, NULL, "out of memory");
            g->n_stop++;
            if (strlen(pr->stop[i]) > g->stop_hold) g->stop_hold = strlen(pr->stop[i]);
        }
    struct grm_grammar *grammar = NULL;
    if (pr->guide_kind != PROTO_GUIDE_NONE && compile_guide(h, pr, &grammar, e) != 0) return -1;
    if (pr->kind == PROTO_CHAT && pr->tools_json && pr->tool_choice != PROTO_TOOL_NONE) {
        g->tools = true;
        g->tc_syn = h->tc_syn;
        g->tc_tools = tc_tools_parse(pr->tools_json); /* NULL (out of memory): untyped values */
        if ((pr->tool_choice == PROTO_TOOL_REQUIRED || pr->tool_choice == PROTO_TOOL_NAMED) &&
            compile_tool_grammar(h, pr, g->tc_syn, &grammar, e) != 0)
            return -1;
    } else if (pr->kind == PROTO_CHAT && h->tc_syn == TC_HARMONY) {
        /* harmony output is always messages on channels: the reasoning is not content */
        g->tools = true;
        g->tc_syn = TC_HARMONY;
    }
    /* struct proto_bias and struct smp_bias have the same fields: copy, do not alias */
    struct smp_bias *bias = NULL;
    if (pr->n_logit_bias > 0) {
        bias = malloc(sizeof *bias * (size_t)pr->n_logit_bias);
        if (!bias) return proto_fail(e, 500, NULL, NULL, "out of memory");
        for (int i = 0; i < pr->n_logit_bias; i++)
            bias[i] = (struct smp_bias){pr->logit_bias[i].id, pr->logit_bias[i].bias};
    }
    int rc = -1;
    for (int p = 0; p < n_prompts; p++) {
        int32_t *ids = NULL;
        int n_ids;
        const char *text = NULL;
        char *rendered = NULL;
        if (pr->kind == PROTO_CHAT) {
            if (render_chat(h, pr, &rendered, e) != 0) goto out;
            n_ids = http__encode(m->tok, rendered, pr->add_special_tokens, &ids);
            text = rendered;
            /* <think> reasoning is split off unless a grammar decides the output: then what it
             * forces is the answer (vLLM would force only what follows the reasoning) */
            if (h->think && !grammar) {
                g->tc_flags |= tc_think_flags(true, rendered);
                if (!g->tools) {
                    g->tools = true;
                    g->tc_syn = h->tc_syn;
                    g->tc_flags |= TC_NO_CALLS;
                }
            }
        } else if (pr->prompts[p].text) {
            text = pr->prompts[p].text;
            n_ids = http__encode(m->tok, text, pr->add_special_tokens, &ids);
        } else {
            ids = pr->prompts[p].ids;
            n_ids = pr->prompts[p].n_ids;
            pr->prompts[p].ids = NULL; /* taken */
            for (int i = 0; i < n_ids; i++)
                if (ids[i] >= m->desc.vocab) {
                    int32_t bad = ids[i]; /* read before the free */
                    free(ids);
                    proto_fail(e, 400, "prompt", "invalid_value",
                               "token id %d out of range [0, %d)", bad, m->desc.vocab);
                    goto out;
                }
        }
        if (n_ids < 0) {
            free(rendered);
            proto_fail(e, 500, NULL, NULL, "cannot tokenize the prompt");
            goto out;
        }
        int limit = h->cfg.max_model_len;
        /* truncate_prompt_tokens: keep the last k tokens (-1: as many as the model takes) */
        int keep = pr->truncate_prompt_tokens < 0 ? limit - 1 : pr->truncate_prompt_tokens;
        if (pr->truncate_prompt_tokens != 0 && n_ids > keep) {
            memmove(ids, ids + (n_ids - keep), sizeof *ids * (size_t)keep);
            n_ids = keep;
            text = NULL; /* echo the tokens kept */
        }
        if (n_ids == 0 || n_ids >= limit) {
            free(ids);
            free(rendered);
            proto_fail(e, 400, pr->kind == PROTO_CHAT ? "messages" : "prompt", "invalid_value",
                       "the prompt has %d tokens; it must have 1 to %d (max_model_len %d "
                       "leaves room for at least one new token)",
                       n_ids, limit - 1, limit);
            goto out;
        }
        int max_tokens = pr->max_tokens >= 0 ? pr->max_tokens : limit - n_ids;
        if (n_ids + max_tokens > limit) {
            free(ids);
            free(rendered);
            proto_fail(e, 400, "max_tokens", "invalid_value",
                       "this model's maximum context length is %d tokens; the prompt has "
                       "%d tokens and max_tokens is %d",
                       limit, n_ids, max_tokens);
            goto out;
        }
        g->prompt_tokens += n_ids;
        for (int j = 0; j < g->n_per_prompt; j++) {
            int k = p * g->n_per_prompt + j;
            struct sched_req_params sp;
            req_params(g, pr, max_tokens, j, bias, &sp);
            sp.grammar = grammar;
            /* a syntax of special tokens must survive into the text to be parsed */
            if ((g->tools && !(g->tc_flags & TC_NO_CALLS) && tc_needs_special_tokens(g->tc_syn)) ||
                ((g->tc_flags & TC_THINK) && h->think_special))
                sp.skip_special = false;
            char err[MS_ERR_LEN];
            g->reqs[k] = sched_req_create(ids, n_ids, &sp, err, sizeof err);
            if (!g->reqs[k]) {
                free(ids);
                free(rendered);
                proto_fail(e, 400, NULL, NULL, "%s", err);
                goto out;
            }
            g->cs[k].prompt_tokens = n_ids;
            tc_stream_init(&g->cs[k].tcs, g->tc_syn, g->tc_flags, g->tc_tools);
            if (pr->echo) {
                g->cs[k].echo = echo_text(m->tok, text, ids, n_ids);
                g->cs[k].echo_len = g->cs[k].echo ? strlen(g->cs[k].echo) : 0;
            }
        }
        free(ids);
        free(rendered);
    }
    for (int k = 0; k < g->n; k++) {
        sched_req_set_notify(g->reqs[k], gen_notify, g);
        char err[MS_ERR_LEN];
        int src = sched_submit(h->s, g->reqs[k], err, sizeof err);
        if (src != 0) {
            proto_fail(e, src == SCHED_EFULL ? 429 : src == SCHED_ECLOSED ? 503 : 400, NULL,
                       src == SCHED_EFULL ? "rate_limit_exceeded" : NULL, "%s", err);
            goto out;
        }
    }
    rc = 0;
out:
    free(bias);
    grm_release(grammar); /* each request holds its own reference */
    return rc;
}

static int gen_poll(struct http_server *h, struct h1_conn *c, struct conn *cn);

/* On a preparation thread: parses the body and submits the choices, then wakes the
 * connection (gen_start answers on its I/O thread). */
static void gen_prepare(void *ctx)
{
    struct gen *g = ctx;
    struct http_server *h = g->h;
    struct proto_req pr;
    struct proto_error e = {0};
    int rc = -1;
    pthread_mutex_lock(&g->mu);
    bool gone = g->abandoned;
    pthread_mutex_unlock(&g->mu);
    const char *body = g->body ? g->body : "";
    if (gone) {
        proto_fail(&e, 499, NULL, NULL, "the client left");
    } else if ((g->api == PROTO_API_OPENAI
                    ? proto_req_parse(body, g->body_len, g->kind, &pr, &e)
                    : proto_req_parse_api(body, g->body_len, g->api, false, hapi_conv_lookup, h,
                                          &pr, &e)) != 0) {
        proto_req_free(&pr);
    } else {
        if (pr.model && strcmp(pr.model, h->model_name) != 0) {
            proto_fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist",
                       pr.model);
        } else {
            g->stream = pr.stream;
            g->include_usage = pr.include_usage;
            g->logprobs = pr.logprobs;
            g->think_budget = pr.thinking_budget;
            if (g->api == PROTO_API_ANTHROPIC)
                anth_stream_init(&g->as, g->id, h->model_name, g->call_id);
            if (g->api == PROTO_API_RESPONSES) {
                rsp_stream_init(&g->rs, g->id, h->model_name, g->call_id, g->created, pr.echo_json);
                g->conv_json = pr.conv_json;
                pr.conv_json = NULL;
            }
            rc = gen_submit(h, g, &pr, &e);
            /* a stored response is visible (in progress) and cancellable from now on */
            if (rc == 0 && g->api == PROTO_API_RESPONSES && pr.store) {
                char *snap = rsp_stream_snapshot(&g->rs, "in_progress");
                if (snap && rstore_put(h->store, g->id, snap, NULL) == 0) {
                    g->store = true;
                    rstore_set_cancel(h->store, g->id, hapi_cancel_hook, g);
                }
                free(snap);
            }
        }
        proto_req_free(&pr);
    }
    if (rc != 0) proto_error_remap(g->api, &e);
    free(g->body);
    g->body = NULL;
    pthread_mutex_lock(&g->mu);
    g->prep_rc = rc;
    g->prep_err = e;
    g->prepared = true;
    if (!g->abandoned) h1_wake(g->c);
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) gen_free(g);
}

/* The whole request is in: hands its body to the preparation pool. The connection waits
 * (pending) until gen_prepare wakes it. */
static int handle_generate(struct http_server *h, struct h1_conn *c, struct conn *cn,
                           enum proto_kind kind, enum proto_api api)
{
    struct gen *g = calloc(1, sizeof *g);
    if (!g) return fail(h, c, cn->route, 500, NULL, NULL, "out of memory");
    g->h = h;
    g->c = c;
    g->kind = kind;
    g->api = api;
    g->created = (long)time(NULL);
    char uniq[40];
    snprintf(uniq, sizeof uniq, "%llx%08llx", (unsigned long long)g->created,
             (unsigned long long)atomic_fetch_add(&h->next_id, 1));
    /* each API's id spelling: chatcmpl-, msg_ (tool_use ids toolu_), resp_ */
    snprintf(g->id, sizeof g->id, "%s%s",
             api == PROTO_API_ANTHROPIC   ? "msg_"
             : api == PROTO_API_RESPONSES ? "resp_"
             : kind == PROTO_CHAT         ? "chatcmpl-"
                                          : "cmpl-",
             uniq);
    snprintf(g->call_id, sizeof g->call_id, "%s%s", api == PROTO_API_ANTHROPIC ? "toolu_" : "call_",
             uniq);
    atomic_init(&g->cancelled, false);
    atomic_init(&g->budget_hit, false);
    pthread_mutex_init(&g->mu, NULL);
    atomic_fetch_add(&h->active, 1);
    g->body = cn->body;
    g->body_len = cn->len;
    cn->body = NULL;
    cn->len = cn->cap = 0;
    g->refs = 2;
    cn->g = g;
    if (prep_submit(h->prep, gen_prepare, g) != 0) {
        g->refs = 1;
        g->prepared = g->started = true;
        return fail(h, c, cn->route, 503, NULL, NULL, "the server cannot take the request now");
    }
    return 0;
}

/* On the I/O thread, at each wake: the first after the preparation answers with its error or
 * starts the response; later ones drive a non-streamed answer. */
static int gen_start(struct http_server *h, struct h1_conn *c, struct conn *cn)
{
    struct gen *g = cn->g;
    if (!g->started) {
        if (!gen_prepared(g)) return 0;
        g->started = true;
        if (g->prep_rc != 0) return http__send_error(h, c, cn->route, &g->prep_err);
        metrics_request_n(h->mt, g->n_out);
        if (g->stream) {
            if (g->api == PROTO_API_ANTHROPIC) {
                struct proto_usage u = {.prompt_tokens = g->prompt_tokens, .cached_tokens = -1};
                anth_stream_start(&g->as, &g->pend, &u);
            } else if (g->api == PROTO_API_RESPONSES) {
                rsp_stream_start(&g->rs, &g->pend);
            }
            count_response(h, c, cn->route, 200);
            return h1_respond_stream(c, 200,
                                     "Content-Type: text/event-stream\r\nCache-Control: "
                                     "no-cache\r\n",
                                     stream_reader, g);
        }
    }
    return gen_poll(h, c, cn); /* suspends until the choices finish */
}

/* Non-streaming: called on every resume until the choices finished. */
static int gen_poll(struct http_server *h, struct h1_conn *c, struct conn *cn)
{
    struct gen *g = cn->g;
    for (;;) {
        uint64_t seen = gen_events(g);
        if (gen_all_finished(g)) break;
        if (gen_suspend(g, seen)) return 0; /* pending until gen_notify */
    }
    int status;
    struct proto_error e;
    char *body = g->api != PROTO_API_OPENAI ? hapi_body(g, &status, &e) : gen_body(g, &status, &e);
    if (status != 200) {
        free(body);
        return http__send_error(h, c, cn->route, &e);
    }
    http__gen_observe_max(g);
    return http__send_json(h, c, cn->route, 200, body);
}

/* --- other routes -------------------------------------------------------------------------- */

/* POST /v1/messages/count_tokens: the prompt the Messages request would render, counted. */
static char *count_answer(struct http_server *h, const char *req, size_t len, int *status)
{
    struct proto_req pr;
    struct proto_error e;
    char *rendered = NULL, *body = NULL;
    int32_t *ids = NULL;
    if (proto_req_parse_api(req, len, PROTO_API_ANTHROPIC, true, NULL, NULL, &pr, &e) != 0 ||
        (pr.model && strcmp(pr.model, h->model_name) != 0 &&
         proto_fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist",
                    pr.model) != 0) ||
        render_chat(h, &pr, &rendered, &e) != 0) {
        proto_req_free(&pr);
        *status = anth_status(e.status);
        return anth_error(&e);
    }
    int n = http__encode(h->m->tok, rendered, false, &ids);
    *status = 200;
    if (n >= 0) body = anth_count_body(n);
    free(ids);
    free(rendered);
    proto_req_free(&pr);
    return body;
}

/* The answer to a /tokenize or /detokenize body: its status and JSON (NULL when out of
 * memory). On a preparation thread. */
static char *tokenize_answer(struct http_server *h, const char *req, size_t len, enum tok_mode mode,
                             int *status)
{
    struct proto_req pr;
    struct proto_error e;
    const struct model *m = h->m;
    bool detok = mode == TOK_DECODE;
    *status = 400;
    if (mode == TOK_COUNT) return count_answer(h, req, len, status);
    if (proto_req_parse(req, len, detok ? PROTO_DETOKENIZE : PROTO_TOKENIZE, &pr, &e) != 0) {
        proto_req_free(&pr);
        *status = e.status;
        return proto_resp_error(&e);
    }
    char *body = NULL;
    if (detok) {
        for (int i = 0; i < pr.n_tokens; i++)
            if (pr.tokens[i] >= m->desc.vocab) {
                proto_req_free(&pr);
                proto_fail(&e, 400, "tokens", "invalid_value", "token id out of range");
                return proto_resp_error(&e);
            }
        char tmp[1];
        long need = pr.n_tokens ? tok_decode(m->tok, pr.tokens, pr.n_tokens, true, tmp, 1) : 0;
        char *text = need >= 0 ? malloc((size_t)need + 1) : NULL;
        if (text) {
            if (pr.n_tokens) tok_decode(m->tok, pr.tokens, pr.n_tokens, true, text, (size_t)need + 1);
            body = proto_resp_detokenize(text, (size_t)need);
        }
        free(text);
    } else {
        char *rendered = NULL;
        bool special = pr.add_special_tokens;
        if (pr.messages_json) {
            if (render_chat(h, &pr, &rendered, &e) != 0) {
                proto_req_free(&pr);
                *status = e.status;
                return proto_resp_error(&e);
            }
            special = false;
        }
        int32_t *ids = NULL;
        int n = http__encode(m->tok, rendered ? rendered : pr.prompts[0].text, special, &ids);
        if (n >= 0) body = proto_resp_tokenize(ids, n, h->cfg.max_model_len);
        free(ids);
        free(rendered);
    }
    proto_req_free(&pr);
    *status = 200;
    return body;
}

static void tok_job_unref(struct tok_job *j, bool abandon)
{
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    if (abandon) j->abandoned = true;
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    pthread_mutex_destroy(&j->mu);
    free(j->body);
    free(j->answer);
    free(j);
}

static void tok_job_run(void *ctx)
{
    struct tok_job *j = ctx;
    pthread_mutex_lock(&j->mu);
    bool gone = j->abandoned;
    pthread_mutex_unlock(&j->mu);
    int status = 500;
    char *answer =
        gone ? NULL : tokenize_answer(j->h, j->body ? j->body : "", j->len, j->mode, &status);
    pthread_mutex_lock(&j->mu);
    j->status = status;
    j->answer = answer;
    j->done = true;
    if (!j->abandoned) h1_wake(j->c);
    pthread_mutex_unlock(&j->mu);
    tok_job_unref(j, false);
}

static int handle_tokenize(struct http_server *h, struct h1_conn *c, struct conn *cn,
                           enum tok_mode mode)
{
    struct tok_job *j = calloc(1, sizeof *j);
    if (!j) return fail(h, c, cn->route, 500, NULL, NULL, "out of memory");
    *j =
        (struct tok_job){.h = h, .c = c, .mode = mode, .body = cn->body, .len = cn->len, .refs = 2};
    pthread_mutex_init(&j->mu, NULL);
    cn->body = NULL;
    cn->len = cn->cap = 0;
    cn->tj = j;
    if (prep_submit(h->prep, tok_job_run, j) != 0) {
        j->refs = 1;
        j->done = j->sent = true;
        return fail(h, c, cn->route, 503, NULL, NULL, "the server cannot take the request now");
    }
    return 0;
}

/* The I/O thread's side: the job's answer, once it is there. */
static int tok_job_answer(struct http_server *h, struct h1_conn *c, struct conn *cn)
{
    struct tok_job *j = cn->tj;
    if (j->sent) return 0;
    pthread_mutex_lock(&j->mu);
    bool done = j->done;
    pthread_mutex_unlock(&j->mu);
    if (!done) return 0;
    j->sent = true;
    if (!j->answer) return fail(h, c, cn->route, 500, NULL, NULL, "out of memory");
    char *answer = j->answer;
    j->answer = NULL;
    return http__send_json(h, c, cn->route, j->status, answer);
}

static const char *const known_routes[] = {"/v1/completions",
                                           "/v1/chat/completions",
                                           "/v1/models",
                                           "/health",
                                           "/metrics",
                                           "/tokenize",
                                           "/detokenize",
                                           "/version",
                                           "/tokenizer_info",
                                           "/v1/moe/stats",
                                           "/dashboard",
                                           "/v1/messages",
                                           "/v1/messages/count_tokens",
                                           "/v1/responses"};

/* The token of an "Authorization: Bearer TOKEN" header, or NULL. The scheme name is
 * case-insensitive (RFC 9110 11.1), so "bearer" works as clients send it. */
static const char *bearer_token(const char *auth)
{
    if (!auth || strncasecmp(auth, "Bearer", 6) != 0 || (auth[6] != ' ' && auth[6] != '\t'))
        return NULL;
    auth += 6;
    while (*auth == ' ' || *auth == '\t') auth++;
    return auth;
}

/* The head is in: everything that needs no body is decided here, so a request refused for its
 * route, method, key, declared size or the server's state never has its body read. */
static int on_head(struct http_server *h, struct h1_conn *c)
{
    struct conn *cn = calloc(1, sizeof *cn);
    if (!cn) return fail(h, c, "other", 500, NULL, NULL, "out of memory");
    h1_set_data(c, cn);
    cn->route = "other";
    cn->t0 = ms_now();
    const char *path = h1_path(c);
    for (size_t i = 0; i < sizeof known_routes / sizeof *known_routes; i++)
        if (strcmp(path, known_routes[i]) == 0) cn->route = known_routes[i];
    if (strncmp(path, "/v1/models/", 11) == 0 && path[11]) cn->route = "/v1/models/{id}";
    if (strncmp(path, "/v1/responses/", 14) == 0 && path[14]) {
        const char *slash = strchr(path + 14, '/');
        cn->route = !slash ? "/v1/responses/{id}"
                    : strcmp(slash, "/cancel") == 0 && slash > path + 14
                        ? "/v1/responses/{id}/cancel"
                        : "other";
    }
    const char *route = cn->route, *method = h1_method(c);
    if (strcmp(route, "other") == 0)
        return fail(h, c, route, 404, NULL, "not_found", "no such route");
    /* HEAD is served wherever GET is (RFC 9110 9.3.2): the same route runs and h1 sends its
     * status and headers, Content-Length included, without the content. */
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0,
         post = strcmp(method, "POST") == 0;
    bool want_get = is_get_route(route);
    bool stored = strcmp(route, "/v1/responses/{id}") == 0; /* GET, HEAD or DELETE */
    if (stored ? !(get || strcmp(method, "DELETE") == 0)
               : (want_get && !get) || (!want_get && !post))
        return fail(h, c, route, 405, NULL, "method_not_allowed", "method not allowed");
    /* the key as OpenAI's clients send it (Bearer) or Anthropic's (x-api-key), on every route */
    if (h->api_key && strncmp(route, "/v1/", 4) == 0 &&
        !key_ok(h->api_key, bearer_token(h1_header(c, "Authorization"))) &&
        !key_ok(h->api_key, h1_header(c, "x-api-key")))
        return fail(h, c, route, 401, NULL, "invalid_api_key",
                    "missing or invalid API key (Authorization: Bearer ... or x-api-key)");
    int64_t cl = h1_content_length(c);
    if (post && cl == -2)
        return fail(h, c, route, 411, NULL, "length_required",
                    "a request body with Content-Length or chunked encoding is required");
    if (cl > (int64_t)h->cfg.max_body)
        return fail(h, c, route, 413, NULL, "request_too_large", "the request body is too large");
    int state = atomic_load(&h->state);
    if (post && state == HTTP_LOADING)
        return fail(h, c, route, 503, NULL, NULL, "the model is loading");
    if (post && state == HTTP_DRAINING && strncmp(route, "/v1/", 4) == 0)
        return fail(h, c, route, 503, NULL, NULL, draining_msg(h));
    return 0;
}

/* A piece of the body: bodies of unknown length (chunked) are counted as they arrive, and the
 * 413 goes out as soon as the limit is passed. */
static int on_body(struct http_server *h, struct h1_conn *c, struct conn *cn, const char *data,
                   size_t n)
{
    if (cn->len + n > h->cfg.max_body)
        return fail(h, c, cn->route, 413, NULL, "request_too_large",
                    "the request body is too large");
    if (cn->len + n + 1 > cn->cap) {
        size_t cap = (cn->len + n + 1) * 2;
        if (cap > h->cfg.max_body + 1) cap = h->cfg.max_body + 1;
        char *b = realloc(cn->body, cap);
        if (!b) return fail(h, c, cn->route, 500, NULL, NULL, "out of memory");
        cn->body = b;
        cn->cap = cap;
    }
    memcpy(cn->body + cn->len, data, n);
    cn->len += n;
    cn->body[cn->len] = '\0';
    return 0;
}

/* The whole request is in. */
static int on_end(struct http_server *h, struct h1_conn *c, struct conn *cn)
{
    const char *route = cn->route;
    int state = atomic_load(&h->state);
    if (strcmp(route, "/health") == 0)
        return state == HTTP_READY
                   ? http__send_json(h, c, route, 200, strdup("{\"status\":\"ok\"}"))
                   : fail(h, c, route, 503, NULL, NULL,
                          state == HTTP_LOADING ? "the model is loading" : draining_msg(h));
    if (strcmp(route, "/metrics") == 0) {
        struct sched_stats st;
        if (state != HTTP_LOADING) sched_get_stats(h->s, &st);
        return send_text(h, c, route, 200,
                         metrics_render(h->mt, state != HTTP_LOADING ? &st : NULL, h->model_name),
                         "text/plain; version=0.0.4");
    }
    if (strcmp(route, "/dashboard") == 0) {
        char *page = malloc(dash_page_len + 1);
        if (page) memcpy(page, dash_page, dash_page_len + 1);
        return send_text(h, c, route, 200, page, "text/html; charset=utf-8");
    }
    if (state == HTTP_LOADING)
        return fail(h, c, route, 503, NULL, NULL, "the model is loading");
    if (strcmp(route, "/v1/moe/stats") == 0) {
        if (!h->dash) return fail(h, c, route, 404, NULL, "not_found", "no MoE statistics");
        struct sched_stats st;
        sched_get_stats(h->s, &st);
        return http__send_json(h, c, route, 200, dash_stats_json(h->dash, &st, h->model_name));
    }
    if (strcmp(route, "/v1/models") == 0)
        return http__send_json(h, c, route, 200,
                               proto_resp_models(h->model_name, h->created, h->cfg.max_model_len));
    if (strcmp(route, "/v1/models/{id}") == 0) {
        if (strcmp(h1_path(c) + 11, h->model_name) != 0)
            return fail(h, c, route, 404, NULL, "model_not_found", "no such model");
        return http__send_json(h, c, route, 200,
                               proto_resp_model(h->model_name, h->created, h->cfg.max_model_len));
    }
    if (strcmp(route, "/version") == 0)
        return http__send_json(h, c, route, 200, proto_resp_version());
    if (strcmp(route, "/tokenizer_info") == 0) {
        const struct tokenizer *tok = h->m->tok;
        int32_t bos = tok_bos_id(tok), eos = tok_eos_id(tok);
        return http__send_json(h, c, route, 200,
                               proto_resp_tokenizer_info(bos >= 0 ? tok_token_str(tok, bos) : NULL,
                                                         eos >= 0 ? tok_token_str(tok, eos) : NULL,
                                                         h->m->chat_template, h->cfg.max_model_len,
                                                         tok_vocab_size(tok)));
    }
    if (strcmp(route, "/tokenize") == 0) return handle_tokenize(h, c, cn, TOK_ENCODE);
    if (strcmp(route, "/detokenize") == 0) return handle_tokenize(h, c, cn, TOK_DECODE);
    if (strcmp(route, "/v1/messages/count_tokens") == 0)
        return handle_tokenize(h, c, cn, TOK_COUNT);
    if (strncmp(route, "/v1/responses/{id}", 18) == 0) return hapi_stored(h, c, route);
    if (state == HTTP_DRAINING)
        return fail(h, c, route, 503, NULL, NULL, draining_msg(h));
    return handle_generate(h, c, cn,
                           strcmp(route, "/v1/completions") == 0 ? PROTO_COMPLETION : PROTO_CHAT,
                           strcmp(route, "/v1/messages") == 0    ? PROTO_API_ANTHROPIC
                           : strcmp(route, "/v1/responses") == 0 ? PROTO_API_RESPONSES
                                                                 : PROTO_API_OPENAI);
}

static void on_request(void *cls, struct h1_conn *c, enum h1_event ev, const char *data,
                       size_t len)
{
    struct http_server *h = cls;
    struct conn *cn = h1_data(c);
    switch (ev) {
    case H1_HEAD: on_head(h, c); break;
    case H1_BODY: if (cn) on_body(h, c, cn, data, len); break;
    case H1_END: if (cn) on_end(h, c, cn); break;
    case H1_WAKE:
        if (cn && cn->g) gen_start(h, c, cn);
        if (cn && cn->tj) tok_job_answer(h, c, cn);
        break;
    }
}

/* Protocol-level failures found by h1 (framing, limits, deadlines): the same JSON errors. */
static void on_error(void *cls, struct h1_conn *c, int status, const char *message)
{
    struct http_server *h = cls;
    struct conn *cn = h1_data(c);
    const char *code = status == 408   ? "request_timeout"
                       : status == 413 ? "request_too_large"
                       : status == 414 ? "uri_too_long"
                       : status == 417 ? "expectation_failed"
                       : status == 431 ? "headers_too_large"
                       : status == 501 ? "not_implemented"
                       : status == 503 ? "too_many_connections"
                       : status == 505 ? "http_version_not_supported"
                                       : "bad_request";
    fail(h, c, cn ? cn->route : "other", status, NULL, code, message);
}

/* The access-log line of a request whose life is over (on_done). */
static void log_access(struct h1_conn *c, struct conn *cn, enum h1_done why)
{
    const char *peer = h1_peer(c);
    struct slog_access a = {.method = h1_method(c), .route = cn->route, .status = cn->status,
                            .client = peer[0] ? peer : NULL, .prompt_tokens = -1,
                            .completion_tokens = -1, .ttft_s = -1,
                            .duration_s = ms_now() - cn->t0,
                            .outcome = why == H1_DONE_SENT     ? "sent"
                                       : why == H1_DONE_CLOSED ? "client_closed"
                                                               : "server_stopped"};
    struct gen *g = cn->g;
    if (g && !gen_prepared(g)) { /* still being prepared: its fields are the job's */
        a.id = g->id;
        g = NULL;
    }
    if (g) {
        a.id = g->id;
        a.prompt_tokens = g->prompt_tokens;
        a.completion_tokens = 0;
        for (int i = 0; g->reqs && i < g->n; i++) {
            struct sched_req *r = g->reqs[i];
            if (!r) continue;
            sched_req_lock(r);
            a.completion_tokens += r->out.n_tokens;
            if (r->out.n_tokens > 0 && (a.ttft_s < 0 || r->out.ttft_s < a.ttft_s))
                a.ttft_s = r->out.ttft_s;
            if (i == 0)
                a.finish_reason = g->tool_calls && r->out.finish == SCHED_FINISH_STOP
                                      ? "tool_calls"
                                      : sched_finish_str(r->out.finish);
            sched_req_unlock(r);
        }
    }
    slog_access(&a);
}

static void on_done(void *cls, struct h1_conn *c, enum h1_done why)
{
    struct http_server *h = cls;
    struct conn *cn = h1_data(c);
    if (!cn) return;
    if (h->cfg.access_log) log_access(c, cn, why);
    gen_unref(cn->g, true); /* cancels choices still running (client gone, or stopping) */
    tok_job_unref(cn->tj, true);
    free(cn->body);
    free(cn);
    h1_set_data(c, NULL);
}

/* --- lifecycle ----------------------------------------------------------------------------- */

int http_start(const struct http_config *cfg, struct metrics *mt, struct http_server **out,
               char *err, size_t errlen)
{
    *out = NULL;
    struct http_server *h = calloc(1, sizeof *h);
    if (!h) return ms_errf(err, errlen, "out of memory");
    h->cfg = *cfg;
    h->mt = mt;
    h->host = strdup(cfg->host);
    h->model_name = strdup(cfg->model_name);
    h->api_key = cfg->api_key && cfg->api_key[0] ? strdup(cfg->api_key) : NULL;
    h->created = (long)time(NULL);
    atomic_init(&h->state, HTTP_LOADING);
    atomic_init(&h->active, 0);
    atomic_init(&h->next_id, 1);
    if (h->cfg.max_body == 0) h->cfg.max_body = 1 << 20;
    struct h1_config hc = {.host = cfg->host, .port = cfg->port, .threads = cfg->threads,
                           .max_conns = cfg->max_conns, .keep_alive_s = cfg->keep_alive_s,
                           .read_timeout_s = cfg->read_timeout_s,
                           .cb = {.ctx = h, .on_request = on_request, .on_error = on_error,
                                  .on_done = on_done}};
    h->store =
        rstore_create(cfg->response_store_entries, RESPONSE_STORE_BYTES, cfg->response_store_ttl_s);
    if (!h->store) {
        free(h->host);
        free(h->model_name);
        free(h->api_key);
        free(h);
        return ms_errf(err, errlen, "out of memory");
    }
    if (prep_start(PREP_THREADS, &h->prep, err, errlen) != 0 ||
        h1_start(&hc, &h->srv, err, errlen) != 0) {
        prep_stop(h->prep);
        rstore_free(h->store);
        free(h->host);
        free(h->model_name);
        free(h->api_key);
        free(h);
        return -1;
    }
    h->port = h1_port(h->srv);
    *out = h;
    return 0;
}

int http_port(const struct http_server *h)
{
    return h->port;
}

void http_set_dash(struct http_server *h, struct dash *d)
{
    h->dash = d;
}

void http_set_ready(struct http_server *h, const struct model *m, struct sched *s,
                    int max_model_len)
{
    h->cfg.max_model_len = max_model_len;
    h->m = m;
    h->s = s;
    /* Parse the chat template once; every chat request renders the parsed form. */
    if (m->chat_template)
        h->chat = jinja_template_parse(m->chat_template, h->chat_err, sizeof h->chat_err);
    h->chat_object_args = h->chat && jinja_chat_object_arguments(h->chat);
    if (tc_syntax_parse(h->cfg.tool_parser, &h->tc_syn) != 0) /* "auto" (serve.c checked it) */
        h->tc_syn = tc_syntax_of_model(m->tok, m->chat_template);
    int think_mode = -1;
    (void)tc_reasoning_parse(h->cfg.reasoning_parser, &think_mode); /* serve.c checked it */
    h->think = tc_reasoning_on(think_mode, m->tok, h->tc_syn);
    if (h->think && m->tok) {
        int32_t b = tok_token_id(m->tok, TC_THINK_BEGIN), e = tok_token_id(m->tok, TC_THINK_END);
        h->think_special = (b >= 0 && tok_is_special(m->tok, b)) ||
                           (e >= 0 && tok_is_special(m->tok, e));
    }
    if (m->tok) h->gvocab = grm_vocab_build(m->tok, m->desc.vocab, m->desc.eos_ids, m->desc.n_eos);
    if (h->gvocab) h->gcache = grm_cache_create(h->gvocab, GRAMMAR_CACHE_ENTRIES, GRAMMAR_CACHE_BYTES);
    atomic_store(&h->state, HTTP_READY);
}

void http_set_draining(struct http_server *h)
{
    atomic_store(&h->state, HTTP_DRAINING);
}

void http_set_failed(struct http_server *h, const char *why)
{
    if (atomic_load(&h->state) == HTTP_DRAINING) return; /* already answering 503 */
    snprintf(h->fail_msg, sizeof h->fail_msg, "the server failed: %s", why);
    atomic_store(&h->state, HTTP_DRAINING);
}

int http_active_streams(const struct http_server *h)
{
    return atomic_load(&h->active);
}

void http_stop(struct http_server *h)
{
    if (!h) return;
    h1_stop(h->srv);
    prep_stop(h->prep); /* runs what is queued: each job frees its abandoned gen */
    rstore_free(h->store);
    jinja_template_free(h->chat);
    grm_cache_free(h->gcache);
    grm_vocab_free(h->gvocab);
    free(h->host);
    free(h->model_name);
    free(h->api_key);
    free(h);
}
