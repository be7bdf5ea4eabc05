/* HTTP front end (see http.h). A request's life: h1 (the HTTP/1.1 core) calls `on_request`
 * with the head, where everything that needs no body is decided (route, method, API key,
 * declared size: an unauthenticated or oversized body is never read), then with body pieces
 * (collected up to max_body; past it the 413 goes out at once), then at the end; the route
 * handler answers at once (models, health, metrics, tokenize, errors) or creates a `gen` that
 * submits one scheduler request per choice. Non-streaming gens leave the request pending until
 * every choice finished; streaming gens answer with a stream whose reader turns new output
 * into SSE frames and parks the connection when there is nothing to send. The scheduler's
 * notify hook wakes it (h1_wake). A client that leaves while its request waits is seen by h1,
 * whose on_done frees the gen and so cancels its choices. Lock order: a request's lock, then
 * the gen's lock; the reader never holds both (it samples an event counter instead), so no
 * wake-up is lost. */
#include "http.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common.h"
#include "h1.h"
#include "jinja.h"
#include "proto/request.h"
#include "proto/response.h"

enum { HTTP_LOADING, HTTP_READY, HTTP_DRAINING };

struct http_server {
    struct http_config cfg;
    char *host, *api_key, *model_name;
    struct h1_server *srv;
    struct metrics *mt;
    atomic_int state;
    const struct model *m;
    struct sched *s;
    jinja_template *chat;     /* m->chat_template parsed once at ready; NULL if none/invalid */
    char chat_err[MS_ERR_LEN];/* why chat is NULL when the model has a template */
    int port;
    atomic_int active;
    long created;
    atomic_ullong next_id;
};

struct choice_state {
    size_t text_sent;
    int tok_sent;
    bool finish_sent, role_sent;
    char *echo;          /* completions with echo: the prompt text, sent first */
    size_t echo_len;
    int prompt_tokens;
};

struct gen {
    struct http_server *h;
    struct h1_conn *c;
    enum proto_kind kind;
    bool stream, include_usage, logprobs;
    char id[64];
    long created;
    int n;
    int n_per_prompt;          /* choices per prompt: choice k belongs to prompt k / n_per_prompt */
    struct sched_req **reqs;   /* (n) */
    struct choice_state *cs;   /* (n) */
    int prompt_tokens;         /* each prompt counted once */
    pthread_mutex_t mu;
    uint64_t events;
    bool suspended;
    char *pend;                /* SSE bytes not yet handed to h1 */
    size_t pend_len, pend_off;
    bool usage_sent, done_sent;
};

struct conn {
    const char *route;
    char *body;
    size_t len, cap;
    struct gen *g;
};

/* --- helpers ------------------------------------------------------------------------------- */

static bool route_is_get(const char *route)
{
    return strcmp(route, "/v1/models") == 0 || strcmp(route, "/health") == 0 ||
           strcmp(route, "/metrics") == 0;
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
    char headers[160];
    snprintf(headers, sizeof headers, "Content-Type: %s\r\n%s%s%s", ctype,
             status == 429 ? "Retry-After: 1\r\n" : "",
             status == 405 ? (route_is_get(route) ? "Allow: GET\r\n" : "Allow: POST\r\n") : "",
             status == 401 ? "WWW-Authenticate: Bearer\r\n" : "");
    metrics_http(h->mt, route, status);
    return h1_respond(c, status, headers, body, strlen(body));
}

static int send_json(struct http_server *h, struct h1_conn *c, const char *route, int status,
                     char *body)
{
    return send_text(h, c, route, status, body, "application/json");
}

static int send_error(struct http_server *h, struct h1_conn *c, const char *route,
                      const struct proto_error *e)
{
    return send_json(h, c, route, e->status, proto_resp_error(e));
}

static int fail(struct http_server *h, struct h1_conn *c, const char *route, int status,
                const char *param, const char *code, const char *msg)
{
    struct proto_error e;
    proto_fail(&e, status, param, code, "%s", msg);
    return send_error(h, c, route, &e);
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
static int encode(const struct tokenizer *tok, const char *text, bool special, int32_t **out)
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
    const struct tokenizer *tok = m->tok;
    int32_t bos = tok_bos_id(tok), eos = tok_eos_id(tok);
    const char *bos_s = bos >= 0 ? tok_token_str(tok, bos) : NULL;
    const char *eos_s = eos >= 0 ? tok_token_str(tok, eos) : NULL;
    struct jinja_chat_args args = {.messages_json = pr->messages_json,
                                   .add_generation_prompt = pr->add_generation_prompt,
                                   .bos_token = bos_s ? bos_s : "",
                                   .eos_token = eos_s ? eos_s : ""};
    char err[MS_ERR_LEN];
    if (jinja_render_chat_args(h->chat, &args, out, err, sizeof err) != 0)
        return proto_fail(e, 400, "messages", "chat_template_error",
                          "cannot apply the chat template: %s", err);
    return 0;
}

/* --- generation ---------------------------------------------------------------------------- */

static void gen_notify(void *ctx)
{
    struct gen *g = ctx;
    pthread_mutex_lock(&g->mu);
    g->events++;
    if (g->suspended) {
        g->suspended = false;
        h1_wake(g->c);
    }
    pthread_mutex_unlock(&g->mu);
}

static void gen_free(struct gen *g)
{
    if (!g) return;
    for (int i = 0; g->reqs && i < g->n; i++) {
        if (!g->reqs[i]) continue;
        sched_req_set_notify(g->reqs[i], NULL, NULL);
        sched_req_cancel(g->h->s, g->reqs[i]);
        sched_req_release(g->reqs[i]);
    }
    for (int i = 0; g->cs && i < g->n; i++) free(g->cs[i].echo);
    free(g->reqs);
    free(g->cs);
    free(g->pend);
    pthread_mutex_destroy(&g->mu);
    atomic_fetch_sub(&g->h->active, 1);
    free(g);
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
static int gen_cached_tokens(struct gen *g)
{
    int cached = 0;
    for (int k = 0; k < g->n; k += g->n_per_prompt > 0 ? g->n_per_prompt : 1) {
        sched_req_lock(g->reqs[k]);
        cached += g->reqs[k]->out.n_cached_tokens;
        sched_req_unlock(g->reqs[k]);
    }
    return cached;
}

/* The full body once every choice finished. */
static char *gen_body(struct gen *g, int *status, struct proto_error *e)
{
    size_t n_choices = g->n > 0 ? (size_t)g->n : 1;
    struct proto_choice *ch = calloc(n_choices, sizeof *ch);
    char **texts = calloc(n_choices, sizeof *texts);
    char *body = NULL;
    int completion = 0;
    *status = 200;
    if (!ch || !texts) goto out;
    for (int i = 0; i < g->n; i++) {
        struct sched_req *r = g->reqs[i];
        sched_req_lock(r);
        if (r->out.finish == SCHED_FINISH_ERROR || r->out.finish == SCHED_FINISH_ABORT) {
            proto_fail(e, r->out.finish == SCHED_FINISH_ERROR ? 500 : 503, NULL, NULL,
                       "generation failed: %s", r->out.error);
            *status = e->status;
            sched_req_unlock(r);
            goto out;
        }
        size_t el = g->cs[i].echo_len;
        texts[i] = malloc(el + r->out.text_len + 1);
        if (!texts[i]) {
            sched_req_unlock(r);
            goto out;
        }
        if (el) memcpy(texts[i], g->cs[i].echo, el);
        memcpy(texts[i] + el, r->out.text, r->out.text_len);
        ch[i].index = i;
        ch[i].text = texts[i];
        ch[i].text_len = el + r->out.text_len;
        ch[i].finish_reason = finish_name(r->out.finish);
        completion += r->out.n_tokens;
        sched_req_unlock(r);
    }
    /* Logprob arrays only grow and the request is finished: safe to read unlocked now. */
    for (int i = 0; i < g->n; i++)
        if (g->logprobs) {
            ch[i].lps = g->reqs[i]->out.lps;
            ch[i].n_lps = g->reqs[i]->out.n_tokens;
            ch[i].text_offset = g->cs[i].echo_len;
        }
    struct proto_usage u = {.prompt_tokens = g->prompt_tokens,
                            .completion_tokens = completion,
                            .cached_tokens = gen_cached_tokens(g)};
    body = proto_resp_body(g->kind, g->id, g->created, g->h->model_name, ch, g->n, &u,
                           g->h->m->tok);
out:
    for (int i = 0; texts && i < g->n; i++) free(texts[i]);
    free(texts);
    free(ch);
    return body;
}

static bool pend_add(struct gen *g, char *frame)
{
    if (!frame) return false;
    size_t n = strlen(frame);
    if (g->pend_off == g->pend_len) g->pend_off = g->pend_len = 0;
    char *p = realloc(g->pend, g->pend_len + n + 1);
    if (!p) {
        free(frame);
        return false;
    }
    g->pend = p;
    memcpy(g->pend + g->pend_len, frame, n);
    g->pend_len += n;
    free(frame);
    return true;
}

/* Turns new output of every choice into SSE frames. Returns true when frames were added. */
static bool gen_collect(struct gen *g)
{
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
        char *frame = NULL;
        if (fin == SCHED_FINISH_ERROR) {
            struct proto_error e;
            proto_fail(&e, 500, NULL, NULL, "generation failed: %s", r->out.error);
            frame = proto_resp_error_sse(&e);
        } else if (has_new) {
            char *text = r->out.text + cs->text_sent;
            size_t len = tl - cs->text_sent;
            char *joined = NULL;
            if (cs->echo && !cs->role_sent) {
                joined = malloc(cs->echo_len + len + 1);
                if (joined) {
                    memcpy(joined, cs->echo, cs->echo_len);
                    memcpy(joined + cs->echo_len, text, len);
                    text = joined;
                    len += cs->echo_len;
                }
            }
            struct proto_choice c = {
                .index = i, .text = text, .text_len = len, .finish_reason = finish_name(fin),
                .lps = g->logprobs ? r->out.lps + cs->tok_sent : NULL,
                .n_lps = g->logprobs ? nt - cs->tok_sent : 0,
                .text_offset = cs->text_sent + (cs->role_sent ? cs->echo_len : 0),
            };
            frame = proto_resp_chunk(g->kind, g->id, g->created, g->h->model_name, &c,
                                     g->kind == PROTO_CHAT && !cs->role_sent, NULL,
                                     g->h->m->tok);
            free(joined);
        }
        sched_req_unlock(r);
        if (frame) {
            if (!pend_add(g, frame)) return added;
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
                                    .cached_tokens = gen_cached_tokens(g)};
            pend_add(g, proto_resp_chunk(g->kind, g->id, g->created, g->h->model_name, NULL,
                                         false, &u, NULL));
            g->usage_sent = true;
        }
        pend_add(g, strdup(PROTO_SSE_DONE));
        g->done_sent = true;
        added = true;
    }
    return added;
}

static long stream_reader(void *cls, char *buf, size_t max)
{
    struct gen *g = cls;
    for (;;) {
        if (g->pend_off < g->pend_len) {
            size_t n = g->pend_len - g->pend_off;
            if (n > max) n = max;
            memcpy(buf, g->pend + g->pend_off, n);
            g->pend_off += n;
            return (long)n;
        }
        if (g->done_sent) return H1_STREAM_END;
        uint64_t seen = gen_events(g);
        if (gen_collect(g)) continue;
        if (gen_suspend(g, seen)) return 0; /* parked until gen_notify */
    }
}

/* Builds and submits one scheduler request per choice. Returns 0 or -1 with e. */
static int gen_submit(struct http_server *h, struct gen *g, struct proto_req *pr,
                      struct proto_error *e)
{
    const struct model *m = h->m;
    int n_prompts = pr->kind == PROTO_CHAT ? 1 : pr->n_prompts;
    g->n = n_prompts * pr->n;
    g->n_per_prompt = pr->n;
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
    for (int p = 0; p < n_prompts; p++) {
        int32_t *ids = NULL;
        int n_ids;
        const char *text = NULL;
        char *rendered = NULL;
        if (pr->kind == PROTO_CHAT) {
            if (render_chat(h, pr, &rendered, e) != 0) return -1;
            n_ids = encode(m->tok, rendered, false, &ids);
            text = rendered;
        } else if (pr->prompts[p].text) {
            text = pr->prompts[p].text;
            n_ids = encode(m->tok, text, true, &ids);
        } else {
            ids = pr->prompts[p].ids;
            n_ids = pr->prompts[p].n_ids;
            pr->prompts[p].ids = NULL; /* taken */
            for (int i = 0; i < n_ids; i++)
                if (ids[i] >= m->desc.vocab) {
                    int32_t bad = ids[i]; /* read before the free */
                    free(ids);
                    return proto_fail(e, 400, "prompt", "invalid_value",
                                      "token id %d out of range [0, %d)", bad, m->desc.vocab);
                }
        }
        if (n_ids < 0) {
            free(rendered);
            return proto_fail(e, 500, NULL, NULL, "cannot tokenize the prompt");
        }
        int limit = h->cfg.max_model_len;
        if (n_ids == 0 || n_ids >= limit) {
            free(ids);
            free(rendered);
            return proto_fail(e, 400, pr->kind == PROTO_CHAT ? "messages" : "prompt",
                              "invalid_value",
                              "the prompt has %d tokens; it must have 1 to %d (max_model_len %d "
                              "leaves room for at least one new token)",
                              n_ids, limit - 1, limit);
        }
        int max_tokens = pr->max_tokens > 0 ? pr->max_tokens : limit - n_ids;
        if (n_ids + max_tokens > limit) {
            free(ids);
            free(rendered);
            return proto_fail(e, 400, "max_tokens", "invalid_value",
                              "this model's maximum context length is %d tokens; the prompt has "
                              "%d tokens and max_tokens is %d",
                              limit, n_ids, max_tokens);
        }
        g->prompt_tokens += n_ids;
        for (int j = 0; j < pr->n; j++) {
            int k = p * pr->n + j;
            struct sched_req_params sp;
            sched_req_params_default(&sp);
            sp.max_tokens = max_tokens;
            sp.smp.temperature = (float)pr->temperature;
            sp.smp.top_p = (float)pr->top_p;
            sp.smp.top_k = pr->top_k;
            sp.smp.min_p = (float)pr->min_p;
            sp.smp.presence_penalty = (float)pr->presence_penalty;
            sp.smp.frequency_penalty = (float)pr->frequency_penalty;
            sp.smp.repetition_penalty = (float)pr->repetition_penalty;
            sp.smp.has_seed = pr->has_seed;
            sp.smp.seed = (uint64_t)pr->seed + (uint64_t)j;
            sp.logprobs = pr->logprobs;
            sp.smp.n_logprobs = pr->top_logprobs < SMP_MAX_LOGPROBS ? pr->top_logprobs
                                                                    : SMP_MAX_LOGPROBS;
            sp.ignore_eos = pr->ignore_eos;
            sp.moe_top_k = pr->moe_top_k;
            sp.n_stop = pr->n_stop;
            for (int s = 0; s < pr->n_stop; s++) sp.stop[s] = pr->stop[s];
            char err[MS_ERR_LEN];
            g->reqs[k] = sched_req_create(ids, n_ids, &sp, err, sizeof err);
            if (!g->reqs[k]) {
                free(ids);
                free(rendered);
                return proto_fail(e, 400, NULL, NULL, "%s", err);
            }
            g->cs[k].prompt_tokens = n_ids;
            if (pr->echo) {
                if (text) {
                    g->cs[k].echo = strdup(text);
                } else {
                    char tmp[1];
                    long need = tok_decode(m->tok, ids, n_ids, false, tmp, sizeof tmp);
                    g->cs[k].echo = need >= 0 ? malloc((size_t)need + 1) : NULL;
                    if (g->cs[k].echo)
                        tok_decode(m->tok, ids, n_ids, false, g->cs[k].echo, (size_t)need + 1);
                }
                g->cs[k].echo_len = g->cs[k].echo ? strlen(g->cs[k].echo) : 0;
            }
        }
        free(ids);
        free(rendered);
    }
    for (int k = 0; k < g->n; k++) {
        sched_req_set_notify(g->reqs[k], gen_notify, g);
        char err[MS_ERR_LEN];
        int rc = sched_submit(h->s, g->reqs[k], err, sizeof err);
        if (rc != 0)
            return proto_fail(e, rc == SCHED_EFULL ? 429 : rc == SCHED_ECLOSED ? 503 : 400,
                              NULL, rc == SCHED_EFULL ? "rate_limit_exceeded" : NULL, "%s", err);
    }
    return 0;
}

static int gen_poll(struct http_server *h, struct h1_conn *c, struct conn *cn);

static int handle_generate(struct http_server *h, struct h1_conn *c, struct conn *cn,
                           enum proto_kind kind)
{
    struct proto_req pr;
    struct proto_error e;
    if (proto_req_parse(cn->body ? cn->body : "", cn->len, kind, &pr, &e) != 0) {
        proto_req_free(&pr);
        return send_error(h, c, cn->route, &e);
    }
    if (pr.model && strcmp(pr.model, h->model_name) != 0) {
        proto_fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist",
                   pr.model);
        proto_req_free(&pr);
        return send_error(h, c, cn->route, &e);
    }
    struct gen *g = calloc(1, sizeof *g);
    if (!g) {
        proto_req_free(&pr);
        return fail(h, c, cn->route, 500, NULL, NULL, "out of memory");
    }
    g->h = h;
    g->c = c;
    g->kind = kind;
    g->stream = pr.stream;
    g->include_usage = pr.include_usage;
    g->logprobs = pr.logprobs;
    g->created = (long)time(NULL);
    snprintf(g->id, sizeof g->id, "%s-%llx%08llx", kind == PROTO_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)g->created,
             (unsigned long long)atomic_fetch_add(&h->next_id, 1));
    pthread_mutex_init(&g->mu, NULL);
    atomic_fetch_add(&h->active, 1);
    cn->g = g;
    int rc = gen_submit(h, g, &pr, &e);
    proto_req_free(&pr);
    if (rc != 0) return send_error(h, c, cn->route, &e);
    if (g->stream) {
        metrics_http(h->mt, cn->route, 200);
        return h1_respond_stream(c, 200,
                                 "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n",
                                 stream_reader, g);
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
    char *body = gen_body(g, &status, &e);
    if (status != 200) {
        free(body);
        return send_error(h, c, cn->route, &e);
    }
    return send_json(h, c, cn->route, 200, body);
}

/* --- other routes -------------------------------------------------------------------------- */

static int handle_tokenize(struct http_server *h, struct h1_conn *c, struct conn *cn,
                           bool detok)
{
    struct proto_req pr;
    struct proto_error e;
    const struct model *m = h->m;
    if (proto_req_parse(cn->body ? cn->body : "", cn->len,
                        detok ? PROTO_DETOKENIZE : PROTO_TOKENIZE, &pr, &e) != 0) {
        proto_req_free(&pr);
        return send_error(h, c, cn->route, &e);
    }
    char *body = NULL;
    if (detok) {
        for (int i = 0; i < pr.n_tokens; i++)
            if (pr.tokens[i] >= m->desc.vocab) {
                proto_req_free(&pr);
                return fail(h, c, cn->route, 400, "tokens", "invalid_value",
                            "token id out of range");
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
                return send_error(h, c, cn->route, &e);
            }
            special = false;
        }
        int32_t *ids = NULL;
        int n = encode(m->tok, rendered ? rendered : pr.prompts[0].text, special, &ids);
        if (n >= 0) body = proto_resp_tokenize(ids, n, h->cfg.max_model_len);
        free(ids);
        free(rendered);
    }
    proto_req_free(&pr);
    return send_json(h, c, cn->route, 200, body);
}

static const char *const known_routes[] = {"/v1/completions", "/v1/chat/completions",
                                           "/v1/models", "/health", "/metrics", "/tokenize",
                                           "/detokenize"};

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
    for (size_t i = 0; i < sizeof known_routes / sizeof *known_routes; i++)
        if (strcmp(h1_path(c), known_routes[i]) == 0) cn->route = known_routes[i];
    const char *route = cn->route, *method = h1_method(c);
    if (strcmp(route, "other") == 0)
        return fail(h, c, route, 404, NULL, "not_found", "no such route");
    bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
    if ((route_is_get(route) && !get) || (!route_is_get(route) && !post))
        return fail(h, c, route, 405, NULL, "method_not_allowed", "method not allowed");
    if (h->api_key && strncmp(route, "/v1/", 4) == 0 &&
        !key_ok(h->api_key, bearer_token(h1_header(c, "Authorization"))))
        return fail(h, c, route, 401, NULL, "invalid_api_key",
                    "missing or invalid API key (Authorization: Bearer ...)");
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
        return fail(h, c, route, 503, NULL, NULL, "the server is shutting down");
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
        return state == HTTP_READY ? send_json(h, c, route, 200, strdup("{\"status\":\"ok\"}"))
                                   : fail(h, c, route, 503, NULL, NULL,
                                          state == HTTP_LOADING ? "the model is loading"
                                                                : "the server is shutting down");
    if (strcmp(route, "/metrics") == 0) {
        struct sched_stats st;
        if (state != HTTP_LOADING) sched_get_stats(h->s, &st);
        return send_text(h, c, route, 200,
                         metrics_render(h->mt, state != HTTP_LOADING ? &st : NULL, h->model_name),
                         "text/plain; version=0.0.4");
    }
    if (state == HTTP_LOADING)
        return fail(h, c, route, 503, NULL, NULL, "the model is loading");
    if (strcmp(route, "/v1/models") == 0)
        return send_json(h, c, route, 200,
                         proto_resp_models(h->model_name, h->created, h->cfg.max_model_len));
    if (strcmp(route, "/tokenize") == 0) return handle_tokenize(h, c, cn, false);
    if (strcmp(route, "/detokenize") == 0) return handle_tokenize(h, c, cn, true);
    if (state == HTTP_DRAINING)
        return fail(h, c, route, 503, NULL, NULL, "the server is shutting down");
    return handle_generate(h, c, cn,
                           strcmp(route, "/v1/completions") == 0 ? PROTO_COMPLETION : PROTO_CHAT);
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
    case H1_WAKE: if (cn && cn->g) gen_poll(h, c, cn); break;
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

static void on_done(void *cls, struct h1_conn *c, enum h1_done why)
{
    struct conn *cn = h1_data(c);
    if (!cn) return;
    gen_free(cn->g); /* cancels choices still running (client gone, or stopping) */
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
    if (h1_start(&hc, &h->srv, err, errlen) != 0) {
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

void http_set_ready(struct http_server *h, const struct model *m, struct sched *s,
                    int max_model_len)
{
    h->cfg.max_model_len = max_model_len;
    h->m = m;
    h->s = s;
    /* Parse the chat template once; every chat request renders the parsed form. */
    if (m->chat_template)
        h->chat = jinja_template_parse(m->chat_template, h->chat_err, sizeof h->chat_err);
    atomic_store(&h->state, HTTP_READY);
}

void http_set_draining(struct http_server *h)
{
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
    jinja_template_free(h->chat);
    free(h->host);
    free(h->model_name);
    free(h->api_key);
    free(h);
}
