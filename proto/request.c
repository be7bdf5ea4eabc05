/* Request parsing and validation for the OpenAI-compatible endpoints (see request.h). Each
 * field has one small getter that checks its JSON type and range and names the field in the
 * error, so the error a client sees always says which field to fix. */
#include "proto/request.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* --- field getters: 0 = absent (out untouched), 1 = set, -1 = error ---------------------- */

static int get_bool(json_t *o, const char *k, bool *out, struct proto_error *e)
{
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return proto_fail(e, 400, k, "invalid_type", "'%s' must be a boolean", k);
    *out = json_is_true(v);
    return 1;
}

static int get_num(json_t *o, const char *k, double lo, double hi, double *out,
                   struct proto_error *e)
{
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
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
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v))
        return proto_fail(e, 400, k, "invalid_type", "'%s' must be an integer", k);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return proto_fail(e, 400, k, "invalid_value", "'%s' must be in [%lld, %lld], got %lld", k,
                          lo, hi, x);
    *out = x;
    return 1;
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
    json_t *p = json_object_get(o, "prompt");
    if (!p || json_is_null(p)) {
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
    json_t *msgs = json_object_get(o, "messages");
    if (!msgs || json_is_null(msgs)) {
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
    json_t *s = json_object_get(o, "stop");
    if (!s || json_is_null(s)) return 0;
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
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) return proto_fail(e, 400, k, "invalid_type", "'%s' must be a string", k);
    *out = dup_str(json_string_value(v), json_string_length(v));
    if (!*out) return proto_fail(e, 500, NULL, NULL, "out of memory");
    return 1;
}

/* Sampling and output fields shared by completions and chat. */
static int get_generation(json_t *o, struct proto_req *r, struct proto_error *e)
{
    long long x;
    int rc;
    bool chat = r->kind == PROTO_CHAT;
    if ((rc = get_int(o, "max_tokens", 1, 1 << 24, &x, e)) < 0) return -1;
    if (rc) r->max_tokens = (int)x;
    if (chat) {
        if ((rc = get_int(o, "max_completion_tokens", 1, 1 << 24, &x, e)) < 0) return -1;
        if (rc) r->max_tokens = (int)x;
    }
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
    if ((rc = get_int(o, "n", 1, PROTO_MAX_N, &x, e)) < 0) return -1;
    if (rc) r->n = (int)x;
    if (get_stop(o, r, e) < 0) return -1;
    if (get_bool(o, "stream", &r->stream, e) < 0) return -1;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return proto_fail(e, 400, "stream_options", "invalid_type",
                              "'stream_options' must be an object");
        if (!r->stream)
            return proto_fail(e, 400, "stream_options", "invalid_value",
                              "'stream_options' is only allowed when 'stream' is true");
        json_t *iu = json_object_get(so, "include_usage");
        if (iu && !json_is_null(iu)) {
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
    if ((rc = get_int(o, "moe_top_k", 0, 512, &x, e)) < 0) return -1;
    if (rc) r->moe_top_k = (int)x;
    return 0;
}

int proto_req_parse(const char *body, size_t len, enum proto_kind kind, struct proto_req *r,
                    struct proto_error *e)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->max_tokens = -1;
    r->temperature = 1;
    r->top_p = 1;
    r->repetition_penalty = 1;
    r->n = 1;
    r->add_generation_prompt = true;
    r->add_special_tokens = true;
    json_error_t je;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!o)
        return proto_fail(e, 400, NULL, "invalid_json", "invalid JSON body: %s (line %d, column %d)",
                          je.text, je.line, je.column);
    int rc = -1;
    if (!json_is_object(o)) {
        proto_fail(e, 400, NULL, "invalid_json", "the body must be a JSON object");
        goto out;
    }
    if (get_string(o, "model", &r->model, e) < 0) goto out;
    switch (kind) {
    case PROTO_COMPLETION:
        if (get_prompt(o, r, e, true) < 0 || get_generation(o, r, e) < 0) goto out;
        break;
    case PROTO_CHAT:
        if (get_messages(o, r, e, true) < 0 || get_generation(o, r, e) < 0) goto out;
        if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, e) < 0) goto out;
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
        if (get_bool(o, "add_special_tokens", &r->add_special_tokens, e) < 0) goto out;
        if (get_bool(o, "add_generation_prompt", &r->add_generation_prompt, e) < 0) goto out;
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
    memset(r, 0, sizeof *r);
}
