/* The output of the Messages and Responses APIs (see http_int.h): a gen of these APIs has one
 * choice, whose text, reasoning and tool calls (parsed by the same tool parser as chat) go
 * through the API's stream builder (proto/anthropic.h, proto/responses.h) as events, or once as
 * the body; and the Responses store's routes. Runs on the I/O threads, like the rest of a gen's
 * output, except hapi_cancel_hook (any thread, under the store's lock). */
#include <stdlib.h>
#include <string.h>

#include "http_int.h"

/* How much of the output the API may show: all of it, except that Anthropic's stop sequences
 * stay in the text (include_stop_str) until the output ends, so the longest one's length is
 * held back (on a character boundary) while it runs; at a stop, the sequence it ends with is
 * the one that matched (stop_hit) and is cut off. */
static size_t api_visible(struct gen *g, const char *text, size_t tl, enum sched_finish fin)
{
    if (g->n_stop == 0) return tl;
    if (fin != SCHED_FINISH_NONE) {
        for (int i = 0; fin == SCHED_FINISH_STOP && i < g->n_stop; i++)
            if (strlen(g->stop[i]) <= tl &&
                memcmp(text + tl - strlen(g->stop[i]), g->stop[i], strlen(g->stop[i])) == 0) {
                g->stop_hit = g->stop[i];
                return tl - strlen(g->stop[i]);
            }
        return tl;
    }
    size_t v = tl > g->stop_hold ? tl - g->stop_hold : 0;
    while (v > 0 && ((unsigned char)text[v] & 0xC0) == 0x80)
        v--;
    return v;
}

static int api_feed(struct gen *g, struct ms_buf *out, const struct ms_buf *think,
                    const struct ms_buf *text, const struct tc_call *calls, int n_calls)
{
    if (g->api == PROTO_API_ANTHROPIC)
        return anth_stream_feed(&g->as, out, think->p, think->len, text->p, text->len, calls,
                                n_calls);
    return rsp_stream_feed(&g->rs, out, think->p, think->len, text->p, text->len, calls, n_calls);
}

/* The end of the output: the API's last events (out NULL: none) and its whole body (Anthropic's
 * message, the response object), which a stored response keeps with its conversation. NULL
 * when out of memory. */
static char *api_end(struct gen *g, struct ms_buf *out, enum sched_finish fin, bool calls)
{
    struct sched_req *r = g->reqs[0];
    sched_req_lock(r);
    int nt = r->out.n_tokens;
    sched_req_unlock(r);
    struct proto_usage u = {.prompt_tokens = g->prompt_tokens,
                            .completion_tokens = nt,
                            .cached_tokens = http__gen_cached_tokens(g)};
    if (g->api == PROTO_API_ANTHROPIC) {
        const char *why = fin == SCHED_FINISH_LENGTH ? "max_tokens"
                          : calls                    ? "tool_use"
                          : g->stop_hit              ? "stop_sequence"
                                                     : "end_turn";
        if (anth_stream_end(&g->as, out, why, g->stop_hit, &u) != 0) return NULL;
        return anth_stream_message(&g->as, why, g->stop_hit, &u);
    }
    bool length = fin == SCHED_FINISH_LENGTH;
    const char *status = atomic_load(&g->cancelled) ? "cancelled"
                         : length                   ? "incomplete"
                                                    : "completed";
    int reasoning_tokens = 0;
    if (g->rs.think.len > 0) { /* the reasoning's share of the output, as its tokens */
        int32_t *ids = NULL;
        reasoning_tokens = http__encode(g->h->m->tok, g->rs.think.p, false, &ids);
        free(ids);
        if (reasoning_tokens < 0 || reasoning_tokens > nt) reasoning_tokens = nt;
    }
    char *final = rsp_stream_end(&g->rs, out, status, length ? "max_output_tokens" : NULL, &u,
                                 reasoning_tokens);
    if (final && g->store) {
        char *conv = rsp_stream_conversation(&g->rs, g->conv_json);
        bool kept = conv && rstore_put(g->h->store, g->id, final, conv) == 0;
        free(conv);
        rstore_clear_cancel(g->h->store, g->id);
        /* too large for the store (or out of memory): gone, rather than left in progress */
        if (!kept) rstore_delete(g->h->store, g->id);
        g->stored_final = true;
    }
    return final;
}

/* A stored response that failed: kept as such (not left in progress, nor cancellable). */
static void store_failed(struct gen *g)
{
    if (!g->store || g->stored_final) return;
    char *snap = rsp_stream_snapshot(&g->rs, "failed");
    if (snap) rstore_put(g->h->store, g->id, snap, NULL);
    free(snap);
    rstore_clear_cancel(g->h->store, g->id);
    g->stored_final = true;
}

/* The error event of a stream that failed after its headers went out. */
static char *api_error_frame(struct gen *g, const struct proto_error *e)
{
    if (g->api == PROTO_API_ANTHROPIC) return anth_error_sse(e);
    return rsp_error_sse(e, g->rs.seq++);
}

/* Whether an output (text[0, len)) is still inside its <think> reasoning. */
static bool in_reasoning(const struct gen *g, const char *text, size_t len)
{
    if (!(g->tc_flags & TC_THINK)) return false;
    size_t i = 0;
    while (i < len && (text[i] == ' ' || text[i] == '\n'))
        i++;
    size_t bl = strlen(TC_THINK_BEGIN), el = strlen(TC_THINK_END);
    bool opened = (g->tc_flags & TC_THINK_OPEN) ||
                  (len - i >= bl && memcmp(text + i, TC_THINK_BEGIN, bl) == 0);
    if (!opened) return false;
    for (size_t k = i; k + el <= len; k++)
        if (memcmp(text + k, TC_THINK_END, el) == 0) return false;
    return true;
}

/* Anthropic's thinking budget: a choice whose reasoning reaches budget_tokens while still open
 * is stopped there, and reported as max_tokens (its budget ran out). Called at each wake. */
void hapi_check_budget(struct gen *g)
{
    if (g->think_budget <= 0 || atomic_load(&g->budget_hit) || g->n < 1) return;
    struct sched_req *r = g->reqs[0]; /* locked by the caller */
    if (r->out.finish != SCHED_FINISH_NONE || r->out.n_tokens < g->think_budget ||
        !in_reasoning(g, r->out.text, r->out.text_len))
        return;
    atomic_store(&g->budget_hit, true);
    sched_req_cancel(g->h->s, r);
}

/* Streams of these APIs: the one choice's new output becomes the API's events, and its end
 * the closing ones. Returns true when bytes were queued or the stream ended. */
bool hapi_collect(struct gen *g)
{
    struct choice_state *cs = &g->cs[0];
    struct sched_req *r = g->reqs[0];
    if (g->done_sent) return false;
    struct ms_buf out = {0}, text = {0}, think = {0};
    struct tc_call *calls = NULL;
    int n_calls = 0, rc = 0;
    bool cancelled = atomic_load(&g->cancelled);
    sched_req_lock(r);
    enum sched_finish fin = r->out.finish;
    if (fin == SCHED_FINISH_ABORT && atomic_load(&g->budget_hit)) fin = SCHED_FINISH_LENGTH;
    bool failed = fin == SCHED_FINISH_ERROR || (fin == SCHED_FINISH_ABORT && !cancelled);
    size_t vis = api_visible(g, r->out.text, r->out.text_len, fin);
    bool fed = !failed && (vis > cs->text_sent || fin != SCHED_FINISH_NONE);
    if (fed) {
        rc = http__choice_delta(g, cs, r, vis, fin != SCHED_FINISH_NONE, &text, &think, &calls,
                                &n_calls);
        cs->text_sent = vis;
    }
    struct proto_error e = {0};
    if (failed)
        proto_fail(&e, fin == SCHED_FINISH_ERROR ? 500 : 503, NULL, NULL, "generation failed: %s",
                   fin == SCHED_FINISH_ERROR ? r->out.error : "the request was aborted");
    sched_req_unlock(r);
    if (rc == 0 && fed) rc = api_feed(g, &out, &think, &text, calls, n_calls);
    cs->calls_sent += n_calls;
    tc_calls_free(calls, n_calls);
    ms_buf_free(&text);
    ms_buf_free(&think);
    if (rc != 0) { /* out of memory: the stream ends here */
        ms_buf_free(&out);
        g->done_sent = true;
        return true;
    }
    if (fin != SCHED_FINISH_NONE) {
        if (failed) {
            store_failed(g);
            http__pend_add(g, api_error_frame(g, &e));
        } else {
            free(api_end(g, &out, fin, cs->calls_sent > 0));
            if (fin == SCHED_FINISH_STOP && cs->calls_sent > 0) g->tool_calls = true;
        }
        http__gen_observe_max(g);
        cs->finish_sent = true;
        g->done_sent = true;
    }
    bool queued = out.len > 0 && http__pend_add(g, ms_buf_take(&out));
    ms_buf_free(&out);
    return queued || g->done_sent;
}

/* The non-streamed body of these APIs, once the choice finished. */
char *hapi_body(struct gen *g, int *status, struct proto_error *e)
{
    struct sched_req *r = g->reqs[0]; /* finished: read unlocked */
    enum sched_finish f = r->out.finish;
    *status = 200;
    if (f == SCHED_FINISH_ABORT && atomic_load(&g->budget_hit)) f = SCHED_FINISH_LENGTH;
    if (f == SCHED_FINISH_ERROR || (f == SCHED_FINISH_ABORT && !atomic_load(&g->cancelled))) {
        proto_fail(e, f == SCHED_FINISH_ERROR ? 500 : 503, NULL, NULL, "generation failed: %s",
                   f == SCHED_FINISH_ERROR ? r->out.error : "the request was aborted");
        *status = e->status;
        store_failed(g);
        return NULL;
    }
    size_t vis = api_visible(g, r->out.text, r->out.text_len, f);
    struct ms_buf content = {0}, think = {0};
    struct tc_call *calls = NULL;
    int n_calls = 0;
    int rc = g->tools ? tc_parse(g->tc_syn, g->tc_flags, g->tc_tools, r->out.text, vis, &content,
                                 &calls, &n_calls, &think)
                      : ms_buf_add(&content, r->out.text, vis);
    char *body = NULL;
    if (rc == 0 && api_feed(g, NULL, &think, &content, calls, n_calls) == 0)
        body = api_end(g, NULL, f, n_calls > 0);
    if (f == SCHED_FINISH_STOP && n_calls > 0) g->tool_calls = true;
    tc_calls_free(calls, n_calls);
    ms_buf_free(&content);
    ms_buf_free(&think);
    return body;
}

/* POST /v1/responses/{id}/cancel, from any thread: stops the response's choices; their end
 * then reports it cancelled. Called under the store's lock, while the gen is registered. */
void hapi_cancel_hook(void *ctx)
{
    struct gen *g = ctx;
    atomic_store(&g->cancelled, true);
    for (int i = 0; i < g->n; i++)
        sched_req_cancel(g->h->s, g->reqs[i]);
}

/* previous_response_id: the stored conversation (proto_conv_lookup). */
char *hapi_conv_lookup(void *ctx, const char *id)
{
    struct http_server *h = ctx;
    return rstore_conv(h->store, id);
}

/* GET, DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel: the store. */
int hapi_stored(struct http_server *h, struct h1_conn *c, const char *route)
{
    const char *method = h1_method(c);
    char id[128];
    const char *p = h1_path(c) + strlen("/v1/responses/");
    size_t n = strcspn(p, "/");
    snprintf(id, sizeof id, "%.*s", (int)(n < sizeof id ? n : sizeof id - 1), p);
    struct proto_error e;
    if (strcmp(route, "/v1/responses/{id}/cancel") == 0) {
        int rc = rstore_cancel(h->store, id);
        char *now = rc >= 0 ? rstore_response(h->store, id) : NULL;
        if (rc < 0 || !now) {
            free(now);
            proto_fail(&e, 404, NULL, "not_found", "Response with id '%s' not found.", id);
            return http__send_error(h, c, route, &e);
        }
        if (rc > 0) {
            free(now);
            proto_fail(&e, 400, NULL, "invalid_request",
                       "Cannot cancel a response that is not in progress ('%s').", id);
            return http__send_error(h, c, route, &e);
        }
        char *cancelled = rsp_with_status(now, "cancelled");
        free(now);
        return http__send_json(h, c, route, 200, cancelled);
    }
    if (strcmp(method, "DELETE") == 0) {
        if (rstore_delete(h->store, id))
            return http__send_json(h, c, route, 200, rsp_deleted_body(id));
        char *running = rstore_response(h->store, id);
        proto_fail(&e, running ? 400 : 404, NULL, running ? "invalid_request" : "not_found",
                   running ? "Response '%s' is in progress: cancel it first."
                           : "Response with id '%s' not found.",
                   id);
        free(running);
        return http__send_error(h, c, route, &e);
    }
    char *resp = rstore_response(h->store, id);
    if (!resp) {
        proto_fail(&e, 404, NULL, "not_found", "Response with id '%s' not found.", id);
        return http__send_error(h, c, route, &e);
    }
    return http__send_json(h, c, route, 200, resp);
}