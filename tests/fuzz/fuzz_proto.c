/* libFuzzer harness: request bodies through the request parsers (proto/request.c) for every
 * request kind (the first byte picks it): OpenAI's completion, chat, tokenize and detokenize,
 * and the edge translations of Anthropic's Messages (and count_tokens) and OpenAI's Responses
 * (whose previous_response_id "resp_x" finds a stored conversation), then the error serializers
 * on what failed. Beyond the sanitizers it checks that a failure is always a 400 (404 for an
 * unknown previous_response_id) with a message. A body the Messages or Responses parser takes
 * also drives that API's output builder, its bytes (valid UTF-8 or not) as reasoning and text. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/anthropic.h"
#include "proto/request.h"
#include "proto/response.h"
#include "proto/responses.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char *lookup(void *ctx, const char *id)
{
    (void)ctx;
    if (strcmp(id, "resp_x") != 0) return NULL;
    return strdup(
        "[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"\","
        "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":"
        "{\"name\":\"f\",\"arguments\":\"{}\"}}]}]");
}

/* The output side of an API, fed the body's own bytes. */
static void drive_output(enum proto_api api, const char *body, size_t n, const char *echo)
{
    struct ms_buf out = {0};
    struct tc_call call = {.name = "f", .arguments = "{\"a\":1}"};
    struct proto_usage u = {.prompt_tokens = 3, .completion_tokens = 2, .cached_tokens = 1};
    size_t third = n / 3;
    if (api == PROTO_API_ANTHROPIC) {
        struct anth_stream s;
        anth_stream_init(&s, "msg_1", "m", "toolu_1");
        anth_stream_start(&s, &out, &u);
        anth_stream_feed(&s, &out, body, third, body + third, n - third, NULL, 0);
        anth_stream_feed(&s, &out, NULL, 0, body, third, &call, 1);
        anth_stream_end(&s, &out, "end_turn", NULL, &u);
        free(anth_stream_message(&s, "end_turn", NULL, &u));
        anth_stream_free(&s);
    } else {
        struct rsp_stream s;
        rsp_stream_init(&s, "resp_1", "m", "call_1", 1, echo);
        rsp_stream_start(&s, &out);
        rsp_stream_feed(&s, &out, body, third, body + third, n - third, &call, 1);
        free(rsp_stream_snapshot(&s, "in_progress"));
        free(rsp_stream_end(&s, &out, "incomplete", "max_output_tokens", &u, 1));
        free(rsp_stream_conversation(&s, "[]"));
        rsp_stream_free(&s);
    }
    ms_buf_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const enum proto_kind kinds[] = {PROTO_COMPLETION, PROTO_CHAT, PROTO_TOKENIZE,
                                            PROTO_DETOKENIZE};
    if (size < 1) return 0;
    const char *body = (const char *)data + 1;
    size_t n = size - 1;
    int k = data[0] % 7;
    struct proto_req r;
    struct proto_error e;
    memset(&e, 0, sizeof e);
    if (k < 4) {
        if (proto_req_parse(body, n, kinds[k], &r, &e) != 0) {
            if (e.status != 400 || e.message[0] == '\0') abort();
            free(proto_resp_error(&e));
        }
        proto_req_free(&r);
        return 0;
    }
    enum proto_api api = k == 6 ? PROTO_API_RESPONSES : PROTO_API_ANTHROPIC;
    if (proto_req_parse_api(body, n, api, k == 5, lookup, NULL, &r, &e) != 0) {
        if ((e.status != 400 && !(e.status == 404 && api == PROTO_API_RESPONSES)) ||
            e.message[0] == '\0')
            abort();
        proto_error_remap(api, &e);
        free(api == PROTO_API_ANTHROPIC ? anth_error(&e) : proto_resp_error(&e));
        free(anth_error_sse(&e));
        free(rsp_error_sse(&e, 3));
    } else {
        if (!r.messages_json) abort(); /* every translation gives the core its messages */
        drive_output(api, body, n, r.echo_json);
    }
    proto_req_free(&r);
    return 0;
}
