/* Anthropic's Messages API at the edge (POST /v1/messages, /v1/messages/count_tokens): a
 * request body is translated into the equivalent chat-completions request (system and content
 * blocks into chat messages, tool_use / tool_result into tool_calls and tool messages, thinking
 * blocks into reasoning_content, tools' input_schema into function parameters, tool_choice
 * auto/any/tool/none into auto/required/named/none, `thinking` into the template's
 * enable_thinking), which proto_req_parse_api then validates as chat completions are; the
 * output of the shared core (reasoning, text, tool calls) is written back as a message with
 * content blocks, or as the SSE events Anthropic's SDKs parse (message_start, ping,
 * content_block_start / _delta / _stop, message_delta, message_stop). Errors use Anthropic's
 * shape {"type": "error", "error": {"type", "message"}}, the field named in the message.
 *
 * Ownership: anth_to_chat returns a new jansson object the caller decrefs; strings returned
 * are malloc'd for the caller; a stream owns its accumulated message until anth_stream_free
 * and borrows the id, model and call-id strings given to anth_stream_init. */
#ifndef MOESERVE_PROTO_ANTHROPIC_H
#define MOESERVE_PROTO_ANTHROPIC_H

#include <jansson.h>
#include <stdbool.h>

#include "common.h"
#include "proto/request.h"
#include "proto/response.h"
#include "proto/toolcall.h"

/* A Messages body (its keys already checked against proto_fields) as a chat-completions body
 * in *out; r->thinking_switch is set when `thinking` asks the template for its switch. Returns 0,
 * or -1 with e (a 400 naming the field as Anthropic spells it). */
int anth_to_chat(json_t *in, bool count_only, struct proto_req *r, json_t **out,
                 struct proto_error *e);

/* The HTTP status an error goes out with on these routes: 503 (loading, draining, too many
 * connections) is Anthropic's 529 overloaded_error, which its SDKs retry; others unchanged. */
int anth_status(int status);
/* {"type": "error", "error": {"type", "message"}}; the message starts with the field. */
char *anth_error(const struct proto_error *e);
/* The same as an SSE `error` event (a stream that fails after its headers went out). */
char *anth_error_sse(const struct proto_error *e);
/* count_tokens: {"input_tokens": n} */
char *anth_count_body(int input_tokens);

/* The message, built as the core's output arrives: streamed as events, or (out NULL) only
 * accumulated for the non-streamed body. */
struct anth_stream {
    const char *id, *model, *call_id; /* borrowed; tool_use ids are "<call_id>_<n>" */
    int n_blocks;                     /* content blocks opened so far */
    int open;                         /* the open block: 0 none, 1 thinking, 2 text */
    struct ms_buf cur;                /* the open block's text so far */
    json_t *content;                  /* the blocks closed so far */
    int n_calls;
};

void anth_stream_init(struct anth_stream *s, const char *id, const char *model,
                      const char *call_id);
/* message_start (usage: the prompt's tokens) and a ping. 0 or -1 (out of memory). */
int anth_stream_start(struct anth_stream *s, struct ms_buf *out, const struct proto_usage *u);
/* New output: reasoning (a thinking block), text (a text block), completed calls (a tool_use
 * block each, its input as one input_json_delta). Any may be empty. 0 or -1. */
int anth_stream_feed(struct anth_stream *s, struct ms_buf *out, const char *reasoning,
                     size_t reasoning_len, const char *text, size_t text_len,
                     const struct tc_call *calls, int n_calls);
/* Closes the open block; message_delta (stop_reason, stop_sequence or NULL, usage) and
 * message_stop. 0 or -1. */
int anth_stream_end(struct anth_stream *s, struct ms_buf *out, const char *stop_reason,
                    const char *stop_sequence, const struct proto_usage *u);
/* The whole message (after anth_stream_end): the non-streamed body. NULL when out of memory. */
char *anth_stream_message(struct anth_stream *s, const char *stop_reason, const char *stop_sequence,
                          const struct proto_usage *u);
void anth_stream_free(struct anth_stream *s);

#endif
