/* Request parsing and validation for the OpenAI-compatible endpoints (see request.h). Each
 * field has one small getter that checks its JSON type and range and names the field in the
 * error, so the error a client sees always says which field to fix. Before any getter runs,
 * every key of the body is looked up in proto_fields: unknown keys and unsupported fields with
 * a non-neutral value are refused there, so a getter never has to think about them (/tokenize,
 * whose fields depend on its form, reads prompt or messages first). */
#include "proto/request.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/anthropic.h"
#include "proto/responses.h"

int proto_fail(struct proto_error *e, int status, const char *param, const char *code,
               const char *fmt, ...)
{
    if (!e) return -1;
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

const char *proto_error_type(int status)
{
    switch (status) {
    case 400: case 405: case 413: return "invalid_request_error";
    /* HTTP-level refusals of a malformed or oversized request: the client's to fix */
    case 408: case 411: case 414: case 417: case 431: case 501: case 505:
        return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return "server_error";
    }
}

/* --- the fields ----------------------------------------------------------------------------- */

#define CMPL PROTO_K_CMPL
#define CHAT PROTO_K_CHAT
#define BOTH (PROTO_K_CMPL | PROTO_K_CHAT)
#define TOK PROTO_K_TOK
#define TOKC PROTO_K_TOK_CHAT
#define DETOK PROTO_K_DETOK
#define MSG   PROTO_K_MSG
#define MSGC  PROTO_K_MSGC
#define RESP  PROTO_K_RESP
/* moeserve's and vLLM's extras that the Messages and Responses routes take too: translated
 * unchanged into the chat request, so they act exactly as on chat completions */
#define XTRA  (MSG | RESP)
#define IMPL PROTO_FIELD_IMPL
#define NOOP PROTO_FIELD_NOOP
#define UNSUP PROTO_FIELD_UNSUP

const struct proto_field proto_fields[] = {
    /* OpenAI, both endpoints */
    {"model", BOTH | TOK | TOKC | DETOK | MSG | MSGC | RESP, IMPL, NULL},
    {"frequency_penalty", BOTH | XTRA, IMPL, NULL},
    {"presence_penalty", BOTH | XTRA, IMPL, NULL},
    {"logit_bias", BOTH, IMPL, NULL},
    {"logprobs", BOTH, IMPL, NULL},
    {"max_tokens", BOTH | MSG, IMPL, NULL},
    {"n", BOTH, IMPL, NULL},
    {"seed", BOTH | XTRA, IMPL, NULL},
    {"stop", BOTH, IMPL, NULL},
    {"stream", BOTH | MSG | RESP, IMPL, NULL},
    {"stream_options", BOTH, IMPL, NULL},
    {"temperature", BOTH | MSG | RESP, IMPL, NULL},
    {"top_p", BOTH | MSG | RESP, IMPL, NULL},
    {"best_of", BOTH, IMPL, NULL},
    {"response_format", BOTH, IMPL, NULL},
    /* OpenAI, accepted with no effect on the output (the allow-list in README.md); Anthropic's
     * `metadata` (a user id) and `service_tier` too */
    {"user", BOTH | RESP, NOOP, NULL},
    {"metadata", BOTH | MSG, NOOP, NULL},
    {"store", BOTH, NOOP, NULL},
    {"service_tier", BOTH | MSG | RESP, NOOP, NULL},
    {"safety_identifier", BOTH | RESP, NOOP, NULL},
    {"prompt_cache_key", BOTH | RESP, NOOP, NULL},
    {"prompt_cache_retention", BOTH | RESP, NOOP, NULL},
    /* OpenAI completions */
    {"prompt", CMPL | TOK, IMPL, NULL},
    {"echo", CMPL, IMPL, NULL},
    {"suffix", CMPL, UNSUP, "\"\""},
    /* OpenAI chat (and the Messages API's messages, tools and tool_choice, translated) */
    {"messages", CHAT | TOKC | MSG | MSGC, IMPL, NULL},
    {"max_completion_tokens", CHAT, IMPL, NULL},
    {"top_logprobs", CHAT, IMPL, NULL},
    {"tools", CHAT | TOKC | MSG | MSGC | RESP, IMPL, NULL},
    {"tool_choice", CHAT | TOKC | MSG | MSGC | RESP, IMPL, NULL},
    {"parallel_tool_calls", CHAT | TOKC | RESP, IMPL, NULL},
    {"functions", CHAT, UNSUP, "[]"},
    {"function_call", CHAT, UNSUP, NULL},
    {"audio", CHAT, UNSUP, NULL},
    {"modalities", CHAT, UNSUP, "[\"text\"]"},
    {"prediction", CHAT, UNSUP, NULL},
    {"reasoning_effort", CHAT | TOKC, IMPL, NULL}, /* to templates that take it (gpt-oss) */
    {"web_search_options", CHAT, UNSUP, NULL},
    {"verbosity", CHAT, UNSUP, NULL},
    /* Anthropic Messages (proto/anthropic.c) */
    {"system", MSG | MSGC, IMPL, NULL},
    {"stop_sequences", MSG, IMPL, NULL},
    {"thinking", MSG | MSGC, IMPL, NULL}, /* the template's enable_thinking */
    {"container", MSG, UNSUP, NULL},
    /* caching hints (the prefix cache is automatic) and account bookkeeping: no effect */
    {"cache_control", MSG | MSGC, NOOP, NULL},
    {"inference_geo", MSG, NOOP, NULL},
    {"user_profile_id", MSG | MSGC, NOOP, NULL},
    {"workspace_id", MSG | MSGC, NOOP, NULL},
    {"thread", MSG, UNSUP, "false"}, /* server-side threads are not kept */
    {"speed", MSG, UNSUP, "\"standard\""},
    {"diagnostics", MSG, UNSUP, NULL},
    {"output_config", MSG | MSGC, IMPL, NULL}, /* format: response_format; effort */
    {"mcp_servers", MSG | MSGC, UNSUP, "[]"},
    {"context_management", MSG | MSGC, UNSUP, NULL},
    /* OpenAI Responses (proto/responses.c) */
    {"input", RESP, IMPL, NULL},
    {"instructions", RESP, IMPL, NULL},
    {"max_output_tokens", RESP, IMPL, NULL},
    {"text", RESP, IMPL, NULL},      /* format: response_format; verbosity refused inside */
    {"reasoning", RESP, IMPL, NULL}, /* effort: reasoning_effort; summary refused inside */
    {"store", RESP, IMPL, NULL},     /* kept for GET and previous_response_id (default true) */
    {"previous_response_id", RESP, IMPL, NULL},
    {"metadata", RESP, IMPL, NULL}, /* repeated in the response object and stored with it */
    {"include", RESP, UNSUP, "[]"},
    {"background", RESP, UNSUP, "false"},
    {"truncation", RESP, UNSUP, "\"disabled\""},
    {"top_logprobs", RESP, UNSUP, "0"},
    {"max_tool_calls", RESP, UNSUP, NULL},
    {"prompt", RESP, UNSUP, NULL},
    {"conversation", RESP, UNSUP, NULL},
    {"stream_options", RESP, UNSUP, NULL},
    /* vLLM's sampling and output extras, both endpoints */
    {"top_k", BOTH | XTRA, IMPL, NULL},
    {"min_p", BOTH | XTRA, IMPL, NULL},
    {"repetition_penalty", BOTH | XTRA, IMPL, NULL},
    {"ignore_eos", BOTH | XTRA, IMPL, NULL},
    {"min_tokens", BOTH | XTRA, IMPL, NULL},
    {"stop_token_ids", BOTH, IMPL, NULL},
    {"include_stop_str_in_output", BOTH, IMPL, NULL},
    {"skip_special_tokens", BOTH, IMPL, NULL},
    /* Only slow (Python) tokenizers insert these spaces; tokenizer.json ones never do, in
     * transformers and vLLM alike, so both values give the same text. */
    {"spaces_between_special_tokens", BOTH, NOOP, NULL},
    {"prompt_logprobs", BOTH, IMPL, NULL},
    {"allowed_token_ids", BOTH, IMPL, NULL},
    {"truncate_prompt_tokens", BOTH, IMPL, NULL},
    {"return_tokens_as_token_ids", BOTH, IMPL, NULL},
    {"add_special_tokens", BOTH | TOK | TOKC, IMPL, NULL},
    {"cache_salt", BOTH | XTRA, IMPL, NULL},
    {"guided_json", BOTH, IMPL, NULL},
    {"guided_regex", BOTH, IMPL, NULL},
    {"guided_choice", BOTH, IMPL, NULL},
    {"guided_grammar", BOTH, IMPL, NULL},
    {"guided_decoding_backend", BOTH, NOOP, NULL}, /* there is one backend: engine/grammar */
    {"request_id", BOTH, NOOP, NULL},
    {"use_beam_search", BOTH, UNSUP, "false"},
    {"length_penalty", BOTH, UNSUP, "1"},
    {"bad_words", BOTH, UNSUP, "[]"},
    {"logits_processors", BOTH, UNSUP, "[]"},
    {"return_token_ids", BOTH, UNSUP, "false"},
    {"priority", BOTH, UNSUP, "0"},
    {"kv_transfer_params", BOTH, UNSUP, NULL},
    {"vllm_xargs", BOTH, UNSUP, NULL},
    {"guided_whitespace_pattern", BOTH, UNSUP, NULL},
    {"structural_tag", BOTH, UNSUP, NULL},
    {"structured_outputs", BOTH, UNSUP, NULL},
    {"prompt_embeds", CMPL, UNSUP, NULL},
    /* vLLM chat */
    {"add_generation_prompt", CHAT | TOKC, IMPL, NULL},
    {"chat_template_kwargs", CHAT | TOKC | XTRA | MSGC, IMPL, NULL},
    {"continue_final_message", CHAT | TOKC, UNSUP, "false"},
    {"chat_template", CHAT | TOKC, UNSUP, NULL},
    {"documents", CHAT, UNSUP, NULL},
    {"mm_processor_kwargs", CHAT | TOKC, UNSUP, NULL},
    {"echo", CHAT, UNSUP, "false"},
    /* vLLM detokenize */
    {"tokens", DETOK, IMPL, NULL},
    /* moeserve */
    {"moe_top_k", BOTH | XTRA, IMPL, NULL},
    {"moe_tag", BOTH | XTRA, IMPL, NULL},
    {"moe_samples", BOTH | XTRA, IMPL, NULL},
    {"moe_neuron_fraction", BOTH | XTRA, IMPL, NULL},
    {"moe_samples_adaptive", BOTH | XTRA, IMPL, NULL},
    {"speculative", BOTH | XTRA, IMPL, NULL}, /* false: no drafted tokens for this request */
};
const int proto_n_fields = (int)(sizeof proto_fields / sizeof *proto_fields);

/* Refuses keys outside the table and unsupported fields that ask for something. */
static int check_fields(json_t *o, unsigned kind_bit, struct proto_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        const struct proto_field *f = NULL;
        for (int i = 0; i < proto_n_fields && !f; i++)
            if ((proto_fields[i].kinds & kind_bit) && strcmp(proto_fields[i].name, key) == 0)
                f = &proto_fields[i];
        if (!f)
            return proto_fail(e, 400, key, "unknown_parameter",
                              "unrecognized request argument '%s'", key);
        if (f->how != PROTO_FIELD_UNSUP || json_is_null(v)) continue;
        json_t *neutral = f->neutral ? json_loads(f->neutral, JSON_DECODE_ANY, NULL) : NULL;
        bool same = neutral && (json_equal(neutral, v) ||
                                (json_is_number(neutral) && json_is_number(v) &&
                                 json_number_value(neutral) == json_number_value(v)));
        json_decref(neutral);
        if (!same)
            return proto_fail(e, 400, key, "unsupported_parameter",
                              "'%s' is not supported by this server%s%s", key,
                              f->neutral ? "; only this value is accepted: " : "",
                              f->neutral ? f->neutral : "");
    }
    return 0;
}

/* --- field getters: 0 = absent (out untouched), 1 = set, -1 = error ---------------------- */

/* Field k of o, or NULL when it is absent or null (a null field counts as not given). */
static json_t *field(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_null(v) ? NULL : v;
}

static int get_bool(json_t *o, const char *k, bool *out, struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_boolean(v)) return proto_fail(e, 400, k, "invalid_type", "'%s' must be a boolean", k);
    *out = json_is_true(v);
    return 1;
}

static int get_num(json_t *o, const char *k, double lo, double hi, double *out,
                   struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_number(v)) return proto_fail(e, 400, k, "invalid_type", "'%s' must be a number", k);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return proto_fail(e, 400, k, "invalid_value", "'%s' must be in [%g, %g], got %g", k, lo,
                          hi, d);
    *out = d;
    return 1;
}

static int get_int(json_t *o, const char *k, long long lo, long long hi, long long *out,
                   struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_integer(v))
        return proto_fail(e, 400, k, "invalid_type", "'%s' must be an integer", k);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return proto_fail(e, 400, k, "invalid_value", "'%s' must be in [%lld, %lld], got %lld", k,
                          lo, hi, x);
    *out = x;
    return 1;
}

/* get_int into an int field (lo and hi within int's range). */
static int get_int_field(json_t *o, const char *k, long long lo, long long hi, int *out,
                         struct proto_error *e)
{
    long long x;
    int rc = get_int(o, k, lo, hi, &x, e);
    if (rc == 1) *out = (int)x;
    return rc;
}

static char *dup_str(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

/* Reads a JSON array of token ids into a new array. */
static int get_ids(json_t *arr, const char *param, int32_t **out, int *n, struct proto_error *e)
{
    size_t len = json_array_size(arr);
    if (len == 0) return proto_fail(e, 400, param, "invalid_value", "'%s' is empty", param);
    if (len > (1u << 20)) return proto_fail(e, 400, param, "invalid_value", "'%s' is too long", param);
    int32_t *ids = malloc(sizeof(int32_t) * len);
    if (!ids) return proto_fail(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < len; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > INT32_MAX) {
            free(ids);
            return proto_fail(e, 400, param, "invalid_value",
                              "'%s' must hold non-negative integer token ids", param);
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    *out = ids;
    *n = (int)len;
    return 0;
}

/* prompt: string | [string] | [int] | [[int]] */
static int get_prompt(json_t *o, struct proto_req *r, struct proto_error *e, bool required)
{
    json_t *p = field(o, "prompt");
    if (!p) {
        if (!required) return 0;
        return proto_fail(e, 400, "prompt", "missing_required_parameter", "'prompt' is required");
    }
    const char *bad = "'prompt' must be a string, an array of strings, an array of token ids or "
                      "an array of token-id arrays";
    if (json_is_string(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return proto_fail(e, 500, NULL, NULL, "out of memory");
        r->n_prompts = 1;
        r->prompts[0].text = dup_str(json_string_value(p), json_string_length(p));
        if (!r->prompts[0].text) return proto_fail(e, 500, NULL, NULL, "out of memory");
        return 0;
    }
    if (!json_is_array(p)) return proto_fail(e, 400, "prompt", "invalid_type", "%s", bad);
    size_t len = json_array_size(p);
    if (len == 0) return proto_fail(e, 400, "prompt", "invalid_value", "'prompt' is empty");
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return proto_fail(e, 500, NULL, NULL, "out of memory");
        r->n_prompts = 1;
        return get_ids(p, "prompt", &r->prompts[0].ids, &r->prompts[0].n_ids, e);
    }
    if (len > PROTO_MAX_PROMPTS)
        return proto_fail(e, 400, "prompt", "invalid_value", "at most %d prompts per request",
                          PROTO_MAX_PROMPTS);
    r->prompts = calloc(len, sizeof *r->prompts);
    if (!r->prompts) return proto_fail(e, 500, NULL, NULL, "out of memory");
    r->n_prompts = (int)len;
    for (size_t i = 0; i < len; i++) {
        json_t *v = json_array_get(p, i);
        if (json_is_string(v)) {
            r->prompts[i].text = dup_str(json_string_value(v), json_string_length(v));
            if (!r->prompts[i].text) return proto_fail(e, 500, NULL, NULL, "out of memory");
        } else if (json_is_array(v)) {
            if (get_ids(v, "prompt", &r->prompts[i].ids, &r->prompts[i].n_ids, e) != 0) return -1;
        } else {
            return proto_fail(e, 400, "prompt", "invalid_type", "%s", bad);
        }
    }
    return 0;
}

/* messages: [{role, content: string | [{type: "text", text}] | null}], re-serialized with
 * string contents. */
static int get_messages(json_t *o, struct proto_req *r, struct proto_error *e, bool required)
{
    json_t *msgs = field(o, "messages");
    if (!msgs) {
        if (!required) return 0;
        return proto_fail(e, 400, "messages", "missing_required_parameter",
                          "'messages' is required");
    }
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return proto_fail(e, 400, "messages", "invalid_value",
                          "'messages' must be a non-empty array of messages");
    json_t *out = json_array();
    if (!out) return proto_fail(e, 500, NULL, NULL, "out of memory");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m)
    {
        if (!json_is_object(m)) goto bad_msg;
        json_t *role = json_object_get(m, "role");
        static const char *roles[] = {"system", "user", "assistant", "tool", "developer"};
        bool ok = json_is_string(role);
        bool known = false;
        for (size_t k = 0; ok && k < sizeof roles / sizeof *roles; k++)
            if (strcmp(json_string_value(role), roles[k]) == 0) known = true;
        if (!ok || !known) {
            json_decref(out);
            return proto_fail(e, 400, "messages", "invalid_value",
                              "messages[%zu].role must be one of system, user, assistant, tool, "
                              "developer",
                              i);
        }
        json_t *content = json_object_get(m, "content");
        json_t *text = NULL;
        if (!content || json_is_null(content)) {
            text = json_string("");
        } else if (json_is_string(content)) {
            text = json_copy(content);
        } else if (json_is_array(content)) {
            size_t total = 0, j;
            json_t *part;
            json_array_foreach(content, j, part)
            {
                json_t *t = json_object_get(part, "text");
                json_t *ty = json_object_get(part, "type");
                const char *tys = json_string_value(ty);
                if (tys && strcmp(tys, "text") != 0 &&
                    (strncmp(tys, "image", 5) == 0 || strncmp(tys, "input_", 6) == 0 ||
                     strncmp(tys, "audio", 5) == 0 || strncmp(tys, "video", 5) == 0)) {
                    /* image_url, input_image, input_audio, video_url, ...: media this text-only
                     * server cannot read, refused by name rather than dropped */
                    json_decref(out);
                    return proto_fail(e, 400, "messages", "unsupported_content",
                                      "messages[%zu].content[%zu] is a '%s' part: the model is "
                                      "served text-only (only \"text\" parts are accepted)",
                                      i, j, tys);
                }
                if (!json_is_string(t) || !json_is_string(ty) ||
                    strcmp(json_string_value(ty), "text") != 0) {
                    json_decref(out);
                    return proto_fail(e, 400, "messages", "invalid_value",
                                      "messages[%zu].content parts must be {\"type\": \"text\", "
                                      "\"text\": ...}",
                                      i);
                }
                total += json_string_length(t);
            }
            char *buf = malloc(total + 1);
            if (!buf) goto oom;
            size_t at = 0;
            json_array_foreach(content, j, part)
            {
                json_t *t = json_object_get(part, "text");
                memcpy(buf + at, json_string_value(t), json_string_length(t));
                at += json_string_length(t);
            }
            text = json_stringn(buf, at);
            free(buf);
        } else {
            goto bad_msg;
        }
        json_t *nm = json_object();
        if (!text || !nm) {
            json_decref(text);
            json_decref(nm);
            goto oom;
        }
        json_object_set(nm, "role", role);
        json_object_set_new(nm, "content", text);
        /* The other keys a message may carry reach the template as given (null ones are
         * dropped there); anything else is refused rather than lost. */
        const char *key;
        json_t *mv;
        json_object_foreach(m, key, mv)
        {
            static const char *pass[] = {"name", "tool_calls", "tool_call_id",
                                         "reasoning_content", "reasoning", "thinking"};
            if (strcmp(key, "role") == 0 || strcmp(key, "content") == 0) continue;
            if (strcmp(key, "refusal") == 0 && json_is_null(mv)) continue;
            bool passed = false;
            for (size_t k = 0; k < sizeof pass / sizeof *pass; k++)
                passed |= strcmp(key, pass[k]) == 0;
            if (!passed ||
                (strcmp(key, "tool_calls") == 0 && !json_is_array(mv) && !json_is_null(mv))) {
                json_decref(nm);
                json_decref(out);
                return proto_fail(e, 400, "messages", passed ? "invalid_type" : "unknown_parameter",
                                  passed ? "messages[%zu].%s must be an array"
                                         : "unrecognized argument messages[%zu].%s",
                                  i, key);
            }
            json_object_set(nm, key, mv);
        }
        json_array_append_new(out, nm);
        continue;
    bad_msg:
        json_decref(out);
        return proto_fail(e, 400, "messages", "invalid_type",
                          "messages[%zu] must be an object with a role and a string or "
                          "text-part content",
                          i);
    }
    r->messages_json = json_dumps(out, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(out);
    if (!r->messages_json) return proto_fail(e, 500, NULL, NULL, "out of memory");
    return 0;
oom:
    json_decref(out);
    return proto_fail(e, 500, NULL, NULL, "out of memory");
}

static int get_stop(json_t *o, struct proto_req *r, struct proto_error *e)
{
    json_t *s = field(o, "stop");
    if (!s) return 0;
    if (json_is_string(s)) {
        if (json_string_length(s) == 0 || json_string_length(s) > 256)
            return proto_fail(e, 400, "stop", "invalid_value", "stop strings must be 1 to 256 bytes");
        r->stop[0] = dup_str(json_string_value(s), json_string_length(s));
        if (!r->stop[0]) return proto_fail(e, 500, NULL, NULL, "out of memory");
        r->n_stop = 1;
        return 0;
    }
    if (!json_is_array(s))
        return proto_fail(e, 400, "stop", "invalid_type",
                          "'stop' must be a string or an array of strings");
    if (json_array_size(s) > PROTO_MAX_STOP)
        return proto_fail(e, 400, "stop", "invalid_value", "at most %d stop strings",
                          PROTO_MAX_STOP);
    size_t i;
    json_t *v;
    json_array_foreach(s, i, v)
    {
        if (!json_is_string(v))
            return proto_fail(e, 400, "stop", "invalid_type",
                              "'stop' must be a string or an array of strings");
        if (json_string_length(v) == 0 || json_string_length(v) > 256)
            return proto_fail(e, 400, "stop", "invalid_value", "stop strings must be 1 to 256 bytes");
        r->stop[r->n_stop] = dup_str(json_string_value(v), json_string_length(v));
        if (!r->stop[r->n_stop]) return proto_fail(e, 500, NULL, NULL, "out of memory");
        r->n_stop++;
    }
    return 0;
}

static int get_string(json_t *o, const char *k, char **out, struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_string(v)) return proto_fail(e, 400, k, "invalid_type", "'%s' must be a string", k);
    *out = dup_str(json_string_value(v), json_string_length(v));
    if (!*out) return proto_fail(e, 500, NULL, NULL, "out of memory");
    return 1;
}

/* An array of token ids (ints >= 0), at most `max` of them, into a new array. */
static int get_id_list(json_t *o, const char *k, int max, int32_t **out, int *n,
                       struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_array(v))
        return proto_fail(e, 400, k, "invalid_type", "'%s' must be an array of token ids", k);
    if (json_array_size(v) > (size_t)max)
        return proto_fail(e, 400, k, "invalid_value", "'%s' holds at most %d ids", k, max);
    if (json_array_size(v) == 0) return 0;
    return get_ids(v, k, out, n, e) < 0 ? -1 : 1;
}

static int cmp_bias(const void *a, const void *b)
{
    int32_t x = ((const struct proto_bias *)a)->id, y = ((const struct proto_bias *)b)->id;
    return (x > y) - (x < y);
}

/* logit_bias: {"token id": bias in [-100, 100]} */
static int get_logit_bias(json_t *o, struct proto_req *r, struct proto_error *e)
{
    json_t *v = field(o, "logit_bias");
    if (!v) return 0;
    if (!json_is_object(v))
        return proto_fail(e, 400, "logit_bias", "invalid_type",
                          "'logit_bias' must be an object mapping token ids to biases");
    size_t n = json_object_size(v);
    if (n > PROTO_MAX_LOGIT_BIAS)
        return proto_fail(e, 400, "logit_bias", "invalid_value",
                          "'logit_bias' holds at most %d entries", PROTO_MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->logit_bias = calloc(n, sizeof *r->logit_bias);
    if (!r->logit_bias) return proto_fail(e, 500, NULL, NULL, "out of memory");
    const char *key;
    json_t *b;
    json_object_foreach(v, key, b)
    {
        char *end;
        long id = strtol(key, &end, 10);
        if (!*key || *end || id < 0 || id > INT32_MAX || (key[0] == '0' && key[1]))
            return proto_fail(e, 400, "logit_bias", "invalid_value",
                              "'logit_bias' keys must be token ids, got '%s'", key);
        if (!json_is_number(b) || json_number_value(b) < -100 || json_number_value(b) > 100)
            return proto_fail(e, 400, "logit_bias", "invalid_value",
                              "'logit_bias' values must be numbers in [-100, 100]");
        r->logit_bias[r->n_logit_bias++] =
            (struct proto_bias){.id = (int32_t)id, .bias = (float)json_number_value(b)};
    }
    qsort(r->logit_bias, (size_t)r->n_logit_bias, sizeof *r->logit_bias, cmp_bias);
    return 0;
}

/* Sets the one structured-output constraint; a second one is refused. */
static int set_guide(struct proto_req *r, enum proto_guide kind, const char *param, char *text,
                     struct proto_error *e)
{
    if (!text) return proto_fail(e, 500, NULL, NULL, "out of memory");
    if (r->guide_kind != PROTO_GUIDE_NONE) {
        free(text);
        return proto_fail(e, 400, param, "invalid_value",
                          "give at most one of response_format (json_object or json_schema), "
                          "guided_json, guided_regex, guided_choice and guided_grammar");
    }
    r->guide_kind = kind;
    r->guide = text;
    r->guide_param = param;
    return 0;
}

static int get_response_format(json_t *o, struct proto_req *r, struct proto_error *e)
{
    json_t *rf = field(o, "response_format");
    if (!rf) return 0;
    const char *type = json_string_value(json_object_get(rf, "type"));
    if (!json_is_object(rf) || !type)
        return proto_fail(e, 400, "response_format", "invalid_type",
                          "'response_format' must be an object with a 'type'");
    const char *key;
    json_t *v;
    json_object_foreach(rf, key, v)
    {
        if (strcmp(key, "type") != 0 && strcmp(key, "json_schema") != 0)
            return proto_fail(e, 400, "response_format", "unknown_parameter",
                              "unrecognized argument 'response_format.%s'", key);
    }
    if (strcmp(type, "text") == 0) return 0;
    if (strcmp(type, "json_object") == 0)
        return set_guide(r, PROTO_GUIDE_JSON_OBJECT, "response_format", strdup("{}"), e);
    if (strcmp(type, "json_schema") != 0)
        return proto_fail(e, 400, "response_format.type", "invalid_value",
                          "'response_format.type' must be text, json_object or json_schema");
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return proto_fail(e, 400, "response_format.json_schema", "invalid_type",
                          "'response_format.json_schema' must be an object");
    json_object_foreach(js, key, v)
    {
        static const char *known[] = {"name", "schema", "strict", "description"};
        bool ok = false;
        for (size_t i = 0; i < sizeof known / sizeof *known; i++) ok |= strcmp(key, known[i]) == 0;
        if (!ok)
            return proto_fail(e, 400, "response_format.json_schema", "unknown_parameter",
                              "unrecognized argument 'response_format.json_schema.%s'", key);
    }
    json_t *schema = json_object_get(js, "schema");
    json_t *strict = json_object_get(js, "strict");
    json_t *name = json_object_get(js, "name");
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return proto_fail(e, 400, "response_format.json_schema.strict", "invalid_type",
                          "'strict' must be a boolean");
    if (name && !json_is_string(name))
        return proto_fail(e, 400, "response_format.json_schema.name", "invalid_type",
                          "'name' must be a string");
    if (name && !(r->guide_name = strdup(json_string_value(name))))
        return proto_fail(e, 500, NULL, NULL, "out of memory");
    /* No schema: OpenAI's default, any JSON object. */
    if (!schema || json_is_null(schema))
        return set_guide(r, PROTO_GUIDE_JSON_OBJECT, "response_format", strdup("{}"), e);
    if (!json_is_object(schema) && !json_is_boolean(schema))
        return proto_fail(e, 400, "response_format.json_schema.schema", "invalid_type",
                          "the schema must be a JSON object");
    return set_guide(r, PROTO_GUIDE_JSON_SCHEMA, "response_format",
                     json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY), e);
}

/* A guided_* field that holds the constraint's text (a regex, a grammar). */
static int get_guide_text(json_t *o, const char *k, enum proto_guide kind, struct proto_req *r,
                          struct proto_error *e)
{
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_string(v) || json_string_length(v) == 0)
        return proto_fail(e, 400, k, "invalid_type", "'%s' must be a non-empty string", k);
    return set_guide(r, kind, k, strdup(json_string_value(v)), e);
}

/* vLLM's guided_* fields. */
static int get_guided(json_t *o, struct proto_req *r, struct proto_error *e)
{
    json_t *v = field(o, "guided_json");
    if (v) {
        if (json_is_string(v)) {
            json_t *parsed = json_loads(json_string_value(v), JSON_DECODE_ANY, NULL);
            bool ok = json_is_object(parsed) || json_is_boolean(parsed);
            char *text = ok ? json_dumps(parsed, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
            json_decref(parsed);
            if (!ok)
                return proto_fail(e, 400, "guided_json", "invalid_value",
                                  "'guided_json' must be a JSON schema (an object, or its text)");
            if (set_guide(r, PROTO_GUIDE_JSON_SCHEMA, "guided_json", text, e) < 0) return -1;
        } else if (json_is_object(v)) {
            if (set_guide(r, PROTO_GUIDE_JSON_SCHEMA, "guided_json",
                          json_dumps(v, JSON_COMPACT), e) < 0)
                return -1;
        } else {
            return proto_fail(e, 400, "guided_json", "invalid_type",
                              "'guided_json' must be a JSON schema (an object, or its text)");
        }
    }
    if (get_guide_text(o, "guided_regex", PROTO_GUIDE_REGEX, r, e) < 0) return -1;
    v = field(o, "guided_choice");
    if (v) {
        bool ok = json_is_array(v) && json_array_size(v) > 0;
        size_t i;
        json_t *c;
        json_array_foreach(v, i, c) ok = ok && json_is_string(c) && json_string_length(c) > 0;
        if (!ok)
            return proto_fail(e, 400, "guided_choice", "invalid_type",
                              "'guided_choice' must be a non-empty array of non-empty strings");
        if (set_guide(r, PROTO_GUIDE_CHOICE, "guided_choice", json_dumps(v, JSON_COMPACT), e) < 0)
            return -1;
    }
    return get_guide_text(o, "guided_grammar", PROTO_GUIDE_GRAMMAR, r, e);
}

/* tools, tool_choice, parallel_tool_calls, chat_template_kwargs, reasoning_effort (chat). */
static int get_tools(json_t *o, struct proto_req *r, struct proto_error *e)
{
    json_t *tools = field(o, "tools");
    if (tools) {
        if (!json_is_array(tools))
            return proto_fail(e, 400, "tools", "invalid_type", "'tools' must be an array");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t)
        {
            json_t *fn = json_object_get(t, "function");
            const char *type = json_string_value(json_object_get(t, "type"));
            json_t *name = json_object_get(fn, "name");
            json_t *params = json_object_get(fn, "parameters");
            if (!type || strcmp(type, "function") != 0 || !json_is_object(fn) ||
                !json_is_string(name) || json_string_length(name) == 0)
                return proto_fail(e, 400, "tools", "invalid_value",
                                  "tools[%zu] must be {\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": {...}}}",
                                  i);
            if (params && !json_is_null(params) && !json_is_object(params))
                return proto_fail(e, 400, "tools", "invalid_value",
                                  "tools[%zu].function.parameters must be a JSON schema object", i);
        }
        if (json_array_size(tools) > 0 &&
            !(r->tools_json = json_dumps(tools, JSON_COMPACT | JSON_ENSURE_ASCII)))
            return proto_fail(e, 500, NULL, NULL, "out of memory");
    }
    r->tool_choice = r->tools_json ? PROTO_TOOL_AUTO : PROTO_TOOL_NONE;
    json_t *tc = field(o, "tool_choice");
    if (tc) {
        const char *s = json_string_value(tc);
        if (s && strcmp(s, "none") == 0) {
            r->tool_choice = PROTO_TOOL_NONE;
        } else if (s && (strcmp(s, "auto") == 0 || strcmp(s, "required") == 0)) {
            if (!r->tools_json)
                return proto_fail(e, 400, "tool_choice", "invalid_value",
                                  "'tool_choice' %s needs 'tools'", s);
            r->tool_choice = s[0] == 'a' ? PROTO_TOOL_AUTO : PROTO_TOOL_REQUIRED;
        } else if (json_is_object(tc)) {
            const char *type = json_string_value(json_object_get(tc, "type"));
            const char *name =
                json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
            if (!type || strcmp(type, "function") != 0 || !name)
                return proto_fail(e, 400, "tool_choice", "invalid_value",
                                  "'tool_choice' must be none, auto, required or {\"type\": "
                                  "\"function\", \"function\": {\"name\": ...}}");
            bool found = false;
            size_t i;
            json_t *t;
            json_array_foreach(tools, i, t)
            {
                const char *n = json_string_value(
                    json_object_get(json_object_get(t, "function"), "name"));
                found |= n && strcmp(n, name) == 0;
            }
            if (!r->tools_json || !found)
                return proto_fail(e, 400, "tool_choice", "invalid_value",
                                  "'tool_choice' names '%s', which is not in 'tools'", name);
            r->tool_choice = PROTO_TOOL_NAMED;
            if (!(r->tool_choice_name = strdup(name)))
                return proto_fail(e, 500, NULL, NULL, "out of memory");
        } else {
            return proto_fail(e, 400, "tool_choice", "invalid_value",
                              "'tool_choice' must be none, auto, required or a named function");
        }
    }
    if (get_bool(o, "parallel_tool_calls", &r->parallel_tool_calls, e) < 0) return -1;
    json_t *kw = field(o, "chat_template_kwargs");
    if (kw && !json_is_object(kw))
        return proto_fail(e, 400, "chat_template_kwargs", "invalid_type",
                          "'chat_template_kwargs' must be an object");
    /* reasoning_effort reaches the template as the variable of that name (as vLLM passes it);
     * chat_template_kwargs, more specific, wins when it sets the same key */
    if (get_string(o, "reasoning_effort", &r->reasoning_effort, e) < 0) return -1;
    if (r->reasoning_effort && strcmp(r->reasoning_effort, "low") != 0 &&
        strcmp(r->reasoning_effort, "medium") != 0 && strcmp(r->reasoning_effort, "high") != 0)
        return proto_fail(e, 400, "reasoning_effort", "invalid_value",
                          "'reasoning_effort' must be low, medium or high");
    json_t *all = kw ? json_deep_copy(kw) : r->reasoning_effort ? json_object() : NULL;
    if (all && r->reasoning_effort && !json_object_get(all, "reasoning_effort"))
        json_object_set_new(all, "reasoning_effort", json_string(r->reasoning_effort));
    if (all) {
        r->template_kwargs_json = json_dumps(all, JSON_COMPACT | JSON_ENSURE_ASCII);
        json_decref(all);
        if (!r->template_kwargs_json) return proto_fail(e, 500, NULL, NULL, "out of memory");
    }
    return 0;
}

/* Sampling and output fields shared by completions and chat. */
static int get_generation(json_t *o, struct proto_req *r, struct proto_error *e)
{
    long long x;
    int rc;
    bool chat = r->kind == PROTO_CHAT;
    /* completions: max_tokens 0 with echo scores a text without generating (lm-eval) */
    if (get_int_field(o, "max_tokens", chat ? 1 : 0, 1 << 24, &r->max_tokens, e) < 0) return -1;
    if (chat && get_int_field(o, "max_completion_tokens", 1, 1 << 24, &r->max_tokens, e) < 0)
        return -1;
    if (get_num(o, "temperature", 0, 100, &r->temperature, e) < 0) return -1;
    if (get_num(o, "top_p", 1e-9, 1, &r->top_p, e) < 0) return -1;
    if ((rc = get_int(o, "top_k", -1, 1 << 24, &x, e)) < 0) return -1;
    if (rc) r->top_k = x < 0 ? 0 : (int)x;
    if (get_num(o, "min_p", 0, 1, &r->min_p, e) < 0) return -1;
    if (get_num(o, "presence_penalty", -2, 2, &r->presence_penalty, e) < 0) return -1;
    if (get_num(o, "frequency_penalty", -2, 2, &r->frequency_penalty, e) < 0) return -1;
    if (get_num(o, "repetition_penalty", 1e-6, 100, &r->repetition_penalty, e) < 0) return -1;
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &x, e)) < 0) return -1;
    if (rc) {
        r->has_seed = true;
        r->seed = x;
    }
    if (get_int_field(o, "n", 1, PROTO_MAX_N, &r->n, e) < 0) return -1;
    if (get_stop(o, r, e) < 0) return -1;
    if (get_bool(o, "stream", &r->stream, e) < 0) return -1;
    json_t *so = field(o, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return proto_fail(e, 400, "stream_options", "invalid_type",
                              "'stream_options' must be an object");
        if (!r->stream)
            return proto_fail(e, 400, "stream_options", "invalid_value",
                              "'stream_options' is only allowed when 'stream' is true");
        json_t *iu = field(so, "include_usage");
        if (iu) {
            if (!json_is_boolean(iu))
                return proto_fail(e, 400, "stream_options.include_usage", "invalid_type",
                                  "'stream_options.include_usage' must be a boolean");
            r->include_usage = json_is_true(iu);
        }
    }
    if (chat) {
        if (get_bool(o, "logprobs", &r->logprobs, e) < 0) return -1;
        if ((rc = get_int(o, "top_logprobs", 0, PROTO_MAX_LOGPROBS, &x, e)) < 0) return -1;
        if (rc) {
            if (!r->logprobs)
                return proto_fail(e, 400, "top_logprobs", "invalid_value",
                                  "'top_logprobs' requires 'logprobs' to be true");
            r->top_logprobs = (int)x;
        }
    } else {
        if ((rc = get_int(o, "logprobs", 0, PROTO_MAX_LOGPROBS, &x, e)) < 0) return -1;
        if (rc) {
            r->logprobs = true;
            r->top_logprobs = (int)x;
        }
        if (get_bool(o, "echo", &r->echo, e) < 0) return -1;
    }
    if (get_bool(o, "ignore_eos", &r->ignore_eos, e) < 0) return -1;
    if (get_int_field(o, "moe_top_k", 0, 512, &r->moe_top_k, e) < 0) return -1;
    /* continuous-experts budget; the model's bounds are checked where the model is known */
    if (get_int_field(o, "moe_samples", 0, 64, &r->moe_samples, e) < 0) return -1;
    if (get_num(o, "moe_neuron_fraction", 0.0, 1.0, &r->moe_neuron_fraction, e) < 0) return -1;
    if (get_bool(o, "moe_samples_adaptive", &r->moe_samples_adaptive, e) < 0) return -1;
    bool spec;
    if ((rc = get_bool(o, "speculative", &spec, e)) < 0) return -1;
    if (rc) r->speculative = spec;

    if (get_int_field(o, "prompt_logprobs", 0, PROTO_MAX_LOGPROBS, &r->prompt_logprobs, e) < 0)
        return -1;
    if (get_int_field(o, "min_tokens", 0, 1 << 24, &r->min_tokens, e) < 0) return -1;
    if (r->max_tokens >= 0 && r->min_tokens > r->max_tokens)
        return proto_fail(e, 400, "min_tokens", "invalid_value",
                          "'min_tokens' (%d) must be at most max_tokens (%d)", r->min_tokens,
                          r->max_tokens);
    if (get_id_list(o, "stop_token_ids", PROTO_MAX_STOP_IDS, &r->stop_token_ids,
                    &r->n_stop_token_ids, e) < 0)
        return -1;
    if (get_bool(o, "include_stop_str_in_output", &r->include_stop_str, e) < 0) return -1;
    if (get_bool(o, "skip_special_tokens", &r->skip_special_tokens, e) < 0) return -1;
    if ((rc = get_int(o, "best_of", 1, PROTO_MAX_BEST_OF, &x, e)) < 0) return -1;
    if (rc) {
        if (x < r->n)
            return proto_fail(e, 400, "best_of", "invalid_value",
                              "'best_of' (%lld) must be at least n (%d)", x, r->n);
        if (r->stream && x > r->n)
            return proto_fail(e, 400, "best_of", "invalid_value",
                              "'best_of' larger than n cannot be streamed");
        r->best_of = (int)x;
    }
    if (get_logit_bias(o, r, e) < 0) return -1;
    if (get_id_list(o, "allowed_token_ids", 1 << 20, &r->allowed_token_ids, &r->n_allowed, e) < 0)
        return -1;
    json_t *ati = json_object_get(o, "allowed_token_ids");
    if (json_is_array(ati) && json_array_size(ati) == 0)
        return proto_fail(e, 400, "allowed_token_ids", "invalid_value",
                          "'allowed_token_ids' must not be empty");
    if ((rc = get_int(o, "truncate_prompt_tokens", -1, 1 << 24, &x, e)) < 0) return -1;
    if (rc && x == 0)
        return proto_fail(e, 400, "truncate_prompt_tokens", "invalid_value",
                          "'truncate_prompt_tokens' must be positive (or -1: the model's limit)");
    if (rc) r->truncate_prompt_tokens = (int)x;
    if (get_bool(o, "return_tokens_as_token_ids", &r->tokens_as_ids, e) < 0) return -1;
    if (get_string(o, "cache_salt", &r->cache_salt, e) < 0) return -1;
    if (get_string(o, "moe_tag", &r->moe_tag, e) < 0) return -1;
    if (r->moe_tag && (!r->moe_tag[0] || strlen(r->moe_tag) > PROTO_MAX_MOE_TAG))
        return proto_fail(e, 400, "moe_tag", "invalid_value",
                          "'moe_tag' must be 1 to %d bytes", PROTO_MAX_MOE_TAG);
    if (get_bool(o, "add_special_tokens", &r->add_special_tokens, e) < 0) return -1;
    if (get_response_format(o, r, e) < 0 || get_guided(o, r, e) < 0) return -1;
    return 0;
}

/* The defaults of a request of this kind, before its fields are read. */
static void req_defaults(struct proto_req *r, enum proto_kind kind)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->max_tokens = -1;
    r->temperature = 1;
    r->top_p = 1;
    r->repetition_penalty = 1;
    r->n = 1;
    r->add_generation_prompt = true;
    /* completions and /tokenize add BOS by default; a rendered chat already holds it */
    r->add_special_tokens = kind != PROTO_CHAT;
    r->prompt_logprobs = -1;
    r->skip_special_tokens = true;
    r->parallel_tool_calls = true;
    r->speculative = -1;
}

/* The body as a JSON object (the caller's to free), or NULL after failing e. */
static json_t *load_body(const char *body, size_t len, struct proto_error *e)
{
    json_error_t je;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        proto_fail(e, 400, NULL, "invalid_json", "invalid JSON body: %s (line %d, column %d)",
                   je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(o)) {
        proto_fail(e, 400, NULL, "invalid_json", "the body must be a JSON object");
        json_decref(o);
        return NULL;
    }
    return o;
}

int proto_req_parse(const char *body, size_t len, enum proto_kind kind, struct proto_req *r,
                    struct proto_error *e)
{
    req_defaults(r, kind);
    json_t *o = load_body(body, len, e);
    if (!o) return -1;
    int rc = -1;
    /* Every route refuses the fields it does not take, /tokenize and /detokenize included: a
     * field there that would do nothing (max_tokens on /tokenize, say) is a client's mistake
     * too. /tokenize's fields depend on its form, known once prompt or messages is read. */
    if (kind != PROTO_TOKENIZE &&
        check_fields(o, kind == PROTO_CHAT         ? PROTO_K_CHAT
                        : kind == PROTO_COMPLETION ? PROTO_K_CMPL
                                                   : PROTO_K_DETOK,
                     e) < 0)
        goto out;
    if (get_string(o, "model", &r->model, e) < 0) goto out;
    switch (kind) {
    case PROTO_COMPLETION:
        if (get_prompt(o, r, e, true) < 0 || get_generation(o, r, e) < 0) goto out;
        break;
    case PROTO_CHAT:
        if (get_messages(o, r, e, true) < 0 || get_generation(o, r, e) < 0) goto out;
        if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, e) < 0) goto out;
        if (get_tools(o, r, e) < 0) goto out;
        break;
    case PROTO_TOKENIZE:
        if (get_prompt(o, r, e, false) < 0 || get_messages(o, r, e, false) < 0) goto out;
        if (!r->prompts == !r->messages_json) {
            proto_fail(e, 400, "prompt", "invalid_value",
                       "give exactly one of 'prompt' (a string) and 'messages'");
            goto out;
        }
        if (r->prompts && (r->n_prompts != 1 || !r->prompts[0].text)) {
            proto_fail(e, 400, "prompt", "invalid_type", "'prompt' must be a string");
            goto out;
        }
        if (check_fields(o, r->messages_json ? PROTO_K_TOK_CHAT : PROTO_K_TOK, e) < 0) goto out;
        if (get_bool(o, "add_special_tokens", &r->add_special_tokens, e) < 0) goto out;
        if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, e) < 0) goto out;
        /* a chat renders as /v1/chat/completions would render it (vLLM's TokenizeChatRequest) */
        if (r->messages_json && get_tools(o, r, e) < 0) goto out;
        break;
    case PROTO_DETOKENIZE: {
        json_t *t = json_object_get(o, "tokens");
        if (!json_is_array(t)) {
            proto_fail(e, 400, "tokens", t ? "invalid_type" : "missing_required_parameter",
                       "'tokens' must be an array of token ids");
            goto out;
        }
        if (json_array_size(t) == 0) {
            rc = 0;
            goto out;
        }
        if (get_ids(t, "tokens", &r->tokens, &r->n_tokens, e) < 0) goto out;
        break;
    }
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

void proto_req_free(struct proto_req *r)
{
    if (!r) return;
    free(r->model);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    free(r->messages_json);
    free(r->tokens);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop_token_ids);
    free(r->logit_bias);
    free(r->allowed_token_ids);
    free(r->cache_salt);
    free(r->moe_tag);
    free(r->guide);
    free(r->guide_name);
    free(r->tools_json);
    free(r->tool_choice_name);
    free(r->template_kwargs_json);
    free(r->reasoning_effort);
    free(r->previous_response_id);
    free(r->echo_json);
    free(r->conv_json);
    memset(r, 0, sizeof *r);
}

/* --- the other APIs, translated at the edge -------------------------------------------------- */

/* The chat core's field names as each API spells them (errors name what the client sent). */
struct rename {
    const char *chat, *api;
};
static const struct rename anth_names[] = {
    {"stop", "stop_sequences"},
    {"response_format.json_schema.schema", "output_config.format.schema"},
    {"response_format", "output_config.format"},
    {"reasoning_effort", "output_config.effort"},
};
static const struct rename rsp_names[] = {
    {"max_tokens", "max_output_tokens"},
    {"messages", "input"},
    {"response_format.json_schema.schema", "text.format.schema"},
    {"response_format.json_schema.strict", "text.format.strict"},
    {"response_format.json_schema.name", "text.format.name"},
    {"response_format.json_schema", "text.format"},
    {"response_format.type", "text.format.type"},
    {"response_format", "text.format"},
    {"reasoning_effort", "reasoning.effort"},
};

static bool ident_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.';
}

/* Replaces whole-word occurrences of from by to in s (of capacity cap). */
static void replace_word(char *s, size_t cap, const char *from, const char *to)
{
    size_t fl = strlen(from), tl = strlen(to);
    char out[512];
    size_t o = 0;
    for (size_t i = 0; s[i] && o + 1 < sizeof out;) {
        if (strncmp(s + i, from, fl) == 0 && (i == 0 || !ident_char(s[i - 1])) &&
            !ident_char(s[i + fl])) {
            for (size_t k = 0; k < tl && o + 1 < sizeof out; k++)
                out[o++] = to[k];
            i += fl;
        } else {
            out[o++] = s[i++];
        }
    }
    out[o] = '\0';
    if (o >= cap) o = cap - 1;
    memcpy(s, out, o);
    s[o] = '\0';
}

void proto_error_remap(enum proto_api api, struct proto_error *e)
{
    const struct rename *t = api == PROTO_API_ANTHROPIC   ? anth_names
                             : api == PROTO_API_RESPONSES ? rsp_names
                                                          : NULL;
    size_t n = api == PROTO_API_ANTHROPIC   ? sizeof anth_names / sizeof *anth_names
               : api == PROTO_API_RESPONSES ? sizeof rsp_names / sizeof *rsp_names
                                            : 0;
    if (!t || !e) return;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(e->param, t[i].chat) == 0) snprintf(e->param, sizeof e->param, "%s", t[i].api);
        replace_word(e->message, sizeof e->message, t[i].chat, t[i].api);
    }
}

int proto_req_parse_api(const char *body, size_t len, enum proto_api api, bool count_only,
                        proto_conv_lookup lookup, void *lookup_ctx, struct proto_req *r,
                        struct proto_error *e)
{
    if (api == PROTO_API_OPENAI)
        return proto_fail(e, 500, NULL, NULL, "proto_req_parse_api: not an edge API");
    req_defaults(r, PROTO_CHAT);
    r->api = api;
    r->count_only = count_only;
    json_t *o = load_body(body, len, e), *chat = NULL;
    if (!o) return -1;
    int rc = -1;
    unsigned bit = api == PROTO_API_RESPONSES ? PROTO_K_RESP
                   : count_only               ? PROTO_K_MSGC
                                              : PROTO_K_MSG;
    if (check_fields(o, bit, e) < 0) goto out;
    if ((api == PROTO_API_ANTHROPIC ? anth_to_chat(o, count_only, r, &chat, e)
                                    : rsp_to_chat(o, lookup, lookup_ctx, r, &chat, e)) != 0)
        goto out;
    /* the one validation of chat completions, on the translated request */
    if (get_string(chat, "model", &r->model, e) < 0 || get_messages(chat, r, e, true) < 0 ||
        (!count_only && get_generation(chat, r, e) < 0) || get_tools(chat, r, e) < 0) {
        proto_error_remap(api, e);
        goto out;
    }
    rc = 0;
out:
    json_decref(chat);
    json_decref(o);
    return rc;
}
