/* Response serialization for the OpenAI-compatible endpoints (see response.h), built as
 * jansson trees and dumped compactly. Logprobs follow each API's shape: completions use the
 * legacy parallel arrays (tokens, token_logprobs, top_logprobs, text_offset), chat uses
 * content[{token, logprob, bytes, top_logprobs[]}]. */
#include "proto/response.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Text of one token as the client sees it in logprobs. */
static json_t *token_str(const struct tokenizer *tok, int32_t id)
{
    char buf[256];
    long n = tok ? tok_decode(tok, &id, 1, false, buf, sizeof buf) : -1;
    if (n < 0 || (size_t)n >= sizeof buf) {
        snprintf(buf, sizeof buf, "token_id:%d", id);
        n = (long)strlen(buf);
    }
    return json_stringn_nocheck(buf, (size_t)n);
}

static json_t *logprob_num(float lp)
{
    /* JSON has no -inf: clamp like other servers do */
    return json_real(isfinite(lp) ? lp : -9999.0);
}

static json_t *chat_logprobs(const struct smp_logprobs *lps, int n, const struct tokenizer *tok)
{
    json_t *content = json_array();
    for (int i = 0; i < n; i++) {
        json_t *t = json_object();
        json_t *s = token_str(tok, lps[i].token);
        json_t *bytes = json_array();
        const char *sv = json_string_value(s);
        for (size_t b = 0; b < json_string_length(s); b++)
            json_array_append_new(bytes, json_integer((unsigned char)sv[b]));
        json_object_set_new(t, "token", s);
        json_object_set_new(t, "logprob", logprob_num(lps[i].logprob));
        json_object_set_new(t, "bytes", bytes);
        json_t *tops = json_array();
        for (int k = 0; k < lps[i].n_top; k++) {
            json_t *tt = json_object();
            json_object_set_new(tt, "token", token_str(tok, lps[i].top_token[k]));
            json_object_set_new(tt, "logprob", logprob_num(lps[i].top_logprob[k]));
            json_array_append_new(tops, tt);
        }
        json_object_set_new(t, "top_logprobs", tops);
        json_array_append_new(content, t);
    }
    json_t *o = json_object();
    json_object_set_new(o, "content", content);
    return o;
}

static json_t *completion_logprobs(const struct smp_logprobs *lps, int n, size_t offset0,
                                   const struct tokenizer *tok)
{
    json_t *tokens = json_array(), *tlp = json_array(), *tops = json_array(),
           *offs = json_array();
    size_t off = offset0;
    for (int i = 0; i < n; i++) {
        json_t *s = token_str(tok, lps[i].token);
        size_t slen = json_string_length(s);
        json_array_append_new(tokens, s);
        json_array_append_new(tlp, logprob_num(lps[i].logprob));
        json_t *top = json_object();
        for (int k = 0; k < lps[i].n_top; k++) {
            json_t *ts = token_str(tok, lps[i].top_token[k]);
            json_object_set_new(top, json_string_value(ts), logprob_num(lps[i].top_logprob[k]));
            json_decref(ts);
        }
        json_array_append_new(tops, top);
        json_array_append_new(offs, json_integer((json_int_t)off));
        off += slen;
    }
    json_t *o = json_object();
    json_object_set_new(o, "tokens", tokens);
    json_object_set_new(o, "token_logprobs", tlp);
    json_object_set_new(o, "top_logprobs", tops);
    json_object_set_new(o, "text_offset", offs);
    return o;
}

static json_t *usage_obj(const struct proto_usage *u)
{
    json_t *o = json_object();
    json_object_set_new(o, "prompt_tokens", json_integer(u->prompt_tokens));
    json_object_set_new(o, "completion_tokens", json_integer(u->completion_tokens));
    json_object_set_new(o, "total_tokens", json_integer(u->prompt_tokens + u->completion_tokens));
    if (u->cached_tokens >= 0) {
        json_t *d = json_object();
        json_object_set_new(d, "cached_tokens", json_integer(u->cached_tokens));
        json_object_set_new(o, "prompt_tokens_details", d);
    }
    return o;
}

static json_t *finish_obj(const char *f)
{
    return f ? json_string(f) : json_null();
}

static json_t *text_obj(const struct proto_choice *c)
{
    /* Text is valid UTF-8 from the streaming decoder; fall back to a checked copy anyway. */
    json_t *s = json_stringn(c->text ? c->text : "", c->text ? c->text_len : 0);
    return s ? s : json_string("\xef\xbf\xbd");
}

static json_t *choice_obj(enum proto_kind kind, const struct proto_choice *c, bool chunk,
                          bool role, const struct tokenizer *tok)
{
    json_t *o = json_object();
    json_object_set_new(o, "index", json_integer(c->index));
    if (kind == PROTO_CHAT) {
        json_t *msg = json_object();
        if (!chunk || role) json_object_set_new(msg, "role", json_string("assistant"));
        if (!chunk || c->text_len > 0 || role) json_object_set_new(msg, "content", text_obj(c));
        json_object_set_new(o, chunk ? "delta" : "message", msg);
        json_object_set_new(o, "logprobs",
                            c->lps ? chat_logprobs(c->lps, c->n_lps, tok) : json_null());
    } else {
        json_object_set_new(o, "text", text_obj(c));
        json_object_set_new(o, "logprobs",
                            c->lps ? completion_logprobs(c->lps, c->n_lps, c->text_offset, tok)
                                   : json_null());
    }
    json_object_set_new(o, "finish_reason", finish_obj(c->finish_reason));
    return o;
}

static json_t *envelope(enum proto_kind kind, const char *id, long created, const char *model,
                        bool chunk)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object",
                        json_string(kind == PROTO_CHAT ? (chunk ? "chat.completion.chunk"
                                                                : "chat.completion")
                                                       : "text_completion"));
    json_object_set_new(o, "created", json_integer(created));
    json_object_set_new(o, "model", json_string(model));
    return o;
}

static char *dump(json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

char *proto_resp_body(enum proto_kind kind, const char *id, long created, const char *model,
                      const struct proto_choice *choices, int n_choices,
                      const struct proto_usage *usage, const struct tokenizer *tok)
{
    json_t *o = envelope(kind, id, created, model, false);
    json_t *arr = json_array();
    for (int i = 0; i < n_choices; i++)
        json_array_append_new(arr, choice_obj(kind, &choices[i], false, false, tok));
    json_object_set_new(o, "choices", arr);
    if (usage) json_object_set_new(o, "usage", usage_obj(usage));
    return dump(o);
}

static char *sse(char *json)
{
    if (!json) return NULL;
    size_t n = strlen(json);
    char *f = malloc(n + 9);
    if (f) {
        memcpy(f, "data: ", 6);
        memcpy(f + 6, json, n);
        memcpy(f + 6 + n, "\n\n", 3);
    }
    free(json);
    return f;
}

char *proto_resp_chunk(enum proto_kind kind, const char *id, long created, const char *model,
                       const struct proto_choice *c, bool role, const struct proto_usage *usage,
                       const struct tokenizer *tok)
{
    json_t *o = envelope(kind, id, created, model, true);
    json_t *arr = json_array();
    if (c) json_array_append_new(arr, choice_obj(kind, c, true, role, tok));
    json_object_set_new(o, "choices", arr);
    if (usage) json_object_set_new(o, "usage", usage_obj(usage));
    return sse(dump(o));
}

char *proto_resp_models(const char *model, long created, int max_model_len)
{
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(model));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(created));
    json_object_set_new(m, "owned_by", json_string("moeserve"));
    json_object_set_new(m, "max_model_len", json_integer(max_model_len));
    json_t *arr = json_array();
    json_array_append_new(arr, m);
    json_t *o = json_object();
    json_object_set_new(o, "object", json_string("list"));
    json_object_set_new(o, "data", arr);
    return dump(o);
}

char *proto_resp_tokenize(const int32_t *ids, int n, int max_model_len)
{
    json_t *arr = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    json_t *o = json_object();
    json_object_set_new(o, "count", json_integer(n));
    json_object_set_new(o, "max_model_len", json_integer(max_model_len));
    json_object_set_new(o, "tokens", arr);
    return dump(o);
}

char *proto_resp_detokenize(const char *text, size_t len)
{
    json_t *o = json_object();
    json_t *s = json_stringn(text, len);
    json_object_set_new(o, "prompt", s ? s : json_string(""));
    return dump(o);
}

static json_t *error_obj(const struct proto_error *e)
{
    json_t *in = json_object();
    json_t *msg = json_string(e->message);
    json_object_set_new(in, "message", msg ? msg : json_string("invalid request"));
    json_object_set_new(in, "type", json_string(proto_error_type(e->status)));
    json_object_set_new(in, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(in, "code", e->code[0] ? json_string(e->code) : json_null());
    json_t *o = json_object();
    json_object_set_new(o, "error", in);
    return o;
}

char *proto_resp_error(const struct proto_error *e)
{
    return dump(error_obj(e));
}

char *proto_resp_error_sse(const struct proto_error *e)
{
    return sse(dump(error_obj(e)));
}
