/* OpenAI's Responses API at the edge (POST /v1/responses): `input` (a string or items:
 * messages, function_call, function_call_output, reasoning) and `instructions` are translated
 * into chat messages, function tools into chat tools, `text.format` into response_format,
 * `reasoning.effort` into reasoning_effort, `max_output_tokens` into max_tokens; the chat
 * request is then validated as chat completions are. A previous_response_id puts the stored
 * conversation first (proto_conv_lookup). The core's output comes back as output items
 * (reasoning, message, function_call) in a response object, or streamed as the typed events
 * the SDK parses (response.created, response.in_progress, response.output_item.added,
 * response.content_part.added, response.output_text.delta / .done, response.reasoning_text.delta
 * / .done, response.function_call_arguments.delta / .done, response.output_item.done,
 * response.completed or response.incomplete), each with its sequence_number.
 *
 * Ownership: rsp_to_chat returns a new jansson object the caller decrefs and fills r's
 * echo_json, conv_json, previous_response_id and store; strings returned are malloc'd for the
 * caller; a stream owns what it accumulated until rsp_stream_free and borrows the strings given
 * to rsp_stream_init. */
#ifndef MOESERVE_PROTO_RESPONSES_H
#define MOESERVE_PROTO_RESPONSES_H

#include <jansson.h>
#include <stdbool.h>

#include "common.h"
#include "proto/request.h"
#include "proto/response.h"
#include "proto/toolcall.h"

int rsp_to_chat(json_t *in, proto_conv_lookup lookup, void *lookup_ctx, struct proto_req *r,
                json_t **out, struct proto_error *e);

struct rsp_stream {
    const char *id, *model, *call_id; /* borrowed; function calls' call_id "<call_id>_<n>" */
    long created;
    json_t *base; /* the response object's request settings (echo_json) */
    int seq;      /* the next event's sequence_number */
    int n_items;  /* output items opened (the next one's output_index) */
    int open;     /* the open item: 0 none, 1 reasoning, 2 message */
    char item_id[112];
    struct ms_buf cur;   /* the open item's text so far */
    struct ms_buf text;  /* every message's text (the stored conversation's assistant turn) */
    struct ms_buf think; /* every reasoning text */
    json_t *output;      /* the items done */
    json_t *calls;       /* chat tool_calls of the function calls (the stored conversation) */
    int n_calls;
};

/* echo_json: the request's settings (proto_req.echo_json; NULL: none). */
void rsp_stream_init(struct rsp_stream *s, const char *id, const char *model, const char *call_id,
                     long created, const char *echo_json);
/* response.created and response.in_progress. 0 or -1 (out of memory). */
int rsp_stream_start(struct rsp_stream *s, struct ms_buf *out);
/* New output: reasoning (a reasoning item), text (a message item), completed calls (a
 * function_call item each). out NULL: only accumulated. 0 or -1. */
int rsp_stream_feed(struct rsp_stream *s, struct ms_buf *out, const char *reasoning,
                    size_t reasoning_len, const char *text, size_t text_len,
                    const struct tc_call *calls, int n_calls);
/* Closes the open item and writes the final event: status "completed", "incomplete"
 * (incomplete_reason "max_output_tokens") or "cancelled" (response.incomplete / .completed /
 * .cancelled as the status says). reasoning_tokens: of the output, for usage. Returns the
 * final response object's JSON (malloc'd; NULL when out of memory). */
char *rsp_stream_end(struct rsp_stream *s, struct ms_buf *out, const char *status,
                     const char *incomplete_reason, const struct proto_usage *u,
                     int reasoning_tokens);
/* The response object as it stands (status "in_progress", no output yet): what the store holds
 * while it runs. */
char *rsp_stream_snapshot(struct rsp_stream *s, const char *status);
/* The conversation to store: conv_json (a JSON array of chat messages) with this response's
 * output appended as one assistant message. malloc'd, NULL when out of memory. */
char *rsp_stream_conversation(struct rsp_stream *s, const char *conv_json);
void rsp_stream_free(struct rsp_stream *s);

/* A Responses `error` SSE event (a stream that fails after its headers went out). */
char *rsp_error_sse(const struct proto_error *e, int seq);
/* A stored response object with its status replaced (POST .../cancel's answer); malloc'd,
 * NULL when out of memory or not JSON. */
char *rsp_with_status(const char *response_json, const char *status);
/* DELETE /v1/responses/{id}: {"id", "object": "response.deleted", "deleted": true} */
char *rsp_deleted_body(const char *id);

#endif
