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

#include "unicode.h"

/* The bytes of one token as the client sees them in logprobs (see proto_resp_body); *len gets
 * their count. Returns a string, or NULL with the bytes in buf when they are not UTF-8. */
static int token_bytes(const struct tokenizer *tok, int32_t id, bool as_id, char *buf,
                       size_t cap)
{
    int n = tok && !as_id ? tok_token_bytes(tok, id, buf, cap) : -1;
    if (n < 0) n = snprintf(buf, cap, "token_id:%d", id);
    return n;
}

static json_t *token_str(const struct tokenizer *tok, int32_t id, bool as_id)
{
    char buf[256];
    int n = token_bytes(tok, id, as_id, buf, sizeof buf);
    if (uni_utf8_valid(buf, (size_t)n)) return json_stringn_nocheck(buf, (size_t)n);
    char esc[sizeof buf * 4 + 8];
    int w = snprintf(esc, sizeof esc, "bytes:");
    for (int i = 0; i < n; i++)
        w += snprintf(esc + w, sizeof esc - (size_t)w, "\\x%02x", (unsigned char)buf[i]);
    return json_stringn_nocheck(esc, (size_t)w);
}

/* Characters (code points) a token adds to the text: its bytes that start a character. */
static size_t token_chars(const struct tokenizer *tok, int32_t id, bool as_id)
{
    char buf[256];
    int n = token_bytes(tok, id, as_id, buf, sizeof buf);
    size_t c = 0;
    for (int i = 0; i < n; i++) c += ((unsigned char)buf[i] & 0xC0) != 0x80;
    return c;
}

static json_t *logprob_num(float lp)
{
    /* JSON has no -inf: clamp like other servers do */
    return json_real(isfinite(lp) ? lp : -9999.0);
}

static json_t *chat_logprobs(const struct proto_choice *c, const struct tokenizer *tok)
{
    json_t *content = json_array();
    for (int i = 0; i < c->n_lps; i++) {
        const struct smp_logprobs *lp = &c->lps[i];
        json_t *t = json_object();
        char raw[256];
        int n = token_bytes(tok, lp->token, c->tokens_as_ids, raw, sizeof raw);
        json_t *bytes = json_array();
        for (int b = 0; b < n; b++) json_array_append_new(bytes, json_integer((unsigned char)raw[b]));
        json_object_set_new(t, "token", token_str(tok, lp->token, c->tokens_as_ids));
        json_object_set_new(t, "logprob", logprob_num(lp->logprob));
        json_object_set_new(t, "bytes", bytes);
        json_t *tops = json_array();
        for (int k = 0; k < lp->n_top; k++) {
            json_t *tt = json_object();
            json_object_set_new(tt, "token", token_str(tok, lp->top_token[k], c->tokens_as_ids));
            json_object_set_new(tt, "logprob", logprob_num(lp->top_logprob[k]));
            json_array_append_new(tops, tt);
        }
        json_object_set_new(t, "top_logprobs", tops);
        json_array_append_new(content, t);
    }
    json_t *o = json_object();
    json_object_set_new(o, "content", content);
    return o;
}

/* Appends one token's entry to the legacy parallel arrays; lp == NULL: the first prompt token,
 * which has no logprob. */
static void legacy_entry(json_t *o, int32_t id, const struct smp_logprobs *lp, size_t *off,
                         const struct tokenizer *tok, bool as_id)
{
    json_array_append_new(json_object_get(o, "tokens"), token_str(tok, id, as_id));
    json_array_append_new(json_object_get(o, "token_logprobs"),
                          lp ? logprob_num(lp->logprob) : json_null());
    json_t *top = lp ? json_object() : json_null();
    for (int k = 0; lp && k < lp->n_top; k++) {
        json_t *ts = token_str(tok, lp->top_token[k], as_id);
        json_object_set_new(top, json_string_value(ts), logprob_num(lp->top_logprob[k]));
        json_decref(ts);
    }
    json_array_append_new(json_object_get(o, "top_logprobs"), top);
    json_array_append_new(json_object_get(o, "text_offset"), json_integer((json_int_t)*off));
    *off += token_chars(tok, id, as_id);
}

static json_t *completion_logprobs(const struct proto_choice *c, const struct tokenizer *tok)
{
    json_t *o = json_object();
    json_object_set_new(o, "tokens", json_array());
    json_object_set_new(o, "token_logprobs", json_array());
    json_object_set_new(o, "top_logprobs", json_array());
    json_object_set_new(o, "text_offset", json_array());
    size_t off = c->text_offset;
    if (c->echo_logprobs && c->prompt_lps)
        for (int q = 0; q < c->n_prompt; q++)
            legacy_entry(o, c->prompt_ids[q], q > 0 ? &c->prompt_lps[q] : NULL, &off, tok,
                         c->tokens_as_ids);
    for (int i = 0; i < c->n_lps; i++)
        legacy_entry(o, c->lps[i].token, &c->lps[i], &off, tok, c->tokens_as_ids);
    return o;
}

/* vLLM's prompt_logprobs: [null, {"id": {"logprob", "rank", "decoded_token"}, ...}, ...] with
 * the prompt token and its top alternatives at each position. */
static json_t *prompt_logprobs_list(const struct proto_choice *c, const struct tokenizer *tok)
{
    json_t *arr = json_array();
    for (int q = 0; q < c->n_prompt; q++) {
        if (q == 0 || !c->prompt_lps) {
            json_array_append_new(arr, json_null());
            continue;
        }
        const struct smp_logprobs *lp = &c->prompt_lps[q];
        json_t *d = json_object();
        char key[16];
        for (int k = -1; k < lp->n_top; k++) {
            int32_t id = k < 0 ? lp->token : lp->top_token[k];
            snprintf(key, sizeof key, "%d", id);
            if (json_object_get(d, key)) continue; /* the token is among its top ones */
            json_t *e = json_object();
            json_object_set_new(e, "logprob", logprob_num(k < 0 ? lp->logprob : lp->top_logprob[k]));
            json_object_set_new(e, "rank", json_integer(k < 0 ? lp->rank : k + 1));
            json_object_set_new(e, "decoded_token", token_str(tok, id, c->tokens_as_ids));
            json_object_set_new(d, key, e);
        }
        json_array_append_new(arr, d);
    }
    return arr;
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

static json_t *tool_calls_arr(const struct proto_choice *c, bool chunk)
{
    json_t *arr = json_array();
    for (int i = 0; i < c->n_calls; i++) {
        char id[96];
        snprintf(id, sizeof id, "%s_%d", c->call_id ? c->call_id : "call", c->call_index0 + i);
        json_t *fn = json_object();
        json_object_set_new(fn, "name", json_string(c->calls[i].name));
        json_object_set_new(fn, "arguments", json_string(c->calls[i].arguments));
        json_t *t = json_object();
        if (chunk) json_object_set_new(t, "index", json_integer(c->call_index0 + i));
        json_object_set_new(t, "id", json_string(id));
        json_object_set_new(t, "type", json_string("function"));
        json_object_set_new(t, "function", fn);
        json_array_append_new(arr, t);
    }
    return arr;
}

static json_t *choice_obj(enum proto_kind kind, const struct proto_choice *c, bool chunk,
                          bool role, const struct tokenizer *tok)
{
    json_t *o = json_object();
    json_object_set_new(o, "index", json_integer(c->index));
    if (kind == PROTO_CHAT) {
        json_t *msg = json_object();
        if (!chunk || role) json_object_set_new(msg, "role", json_string("assistant"));
        if (!chunk && c->n_calls > 0 && c->text_len == 0)
            json_object_set_new(msg, "content", json_null()); /* as OpenAI: calls only */
        else if (!chunk || c->text_len > 0 || role)
            json_object_set_new(msg, "content", text_obj(c));
        if (c->reasoning_len > 0)
            json_object_set_new(msg, "reasoning_content",
                                json_stringn(c->reasoning, c->reasoning_len));
        if (c->n_calls > 0) json_object_set_new(msg, "tool_calls", tool_calls_arr(c, chunk));
        json_object_set_new(o, chunk ? "delta" : "message", msg);
        json_object_set_new(o, "logprobs", c->lps ? chat_logprobs(c, tok) : json_null());
    } else {
        json_object_set_new(o, "text", text_obj(c));
        json_object_set_new(o, "logprobs",
                            c->lps || c->echo_logprobs ? completion_logprobs(c, tok) : json_null());
        if (c->prompt_logprobs)
            json_object_set_new(o, "prompt_logprobs", prompt_logprobs_list(c, tok));
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
    if (kind == PROTO_CHAT && n_choices > 0 && choices[0].prompt_logprobs)
        json_object_set_new(o, "prompt_logprobs", prompt_logprobs_list(&choices[0], tok));
    if (usage) json_object_set_new(o, "usage", usage_obj(usage));
    return dump(o);
}

static char *sse(char *json)
{
    if (!json) return NULL;
    struct ms_buf f = {0};
    bool ok = ms_buf_adds(&f, "data: ") == 0 && ms_buf_adds(&f, json) == 0 &&
              ms_buf_adds(&f, "\n\n") == 0;
    free(json);
    if (!ok) {
        ms_buf_free(&f);
        return NULL;
    }
    return ms_buf_take(&f);
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

static json_t *model_obj(const char *model, long created, int max_model_len)
{
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(model));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(created));
    json_object_set_new(m, "owned_by", json_string("moeserve"));
    json_object_set_new(m, "max_model_len", json_integer(max_model_len));
    return m;
}

char *proto_resp_model(const char *model, long created, int max_model_len)
{
    return dump(model_obj(model, created, max_model_len));
}

#ifndef MOESERVE_VERSION
#define MOESERVE_VERSION "unknown"
#endif
#ifndef MOESERVE_COMMIT
#define MOESERVE_COMMIT "unknown"
#endif
#ifndef MOESERVE_SANITIZE_OPT
#define MOESERVE_SANITIZE_OPT ""
#endif

const char *proto_version_string(void)
{
    return MOESERVE_VERSION;
}

const char *proto_commit_string(void)
{
    return MOESERVE_COMMIT;
}

char *proto_resp_version(void)
{
    json_t *b = json_object();
#ifdef MOESERVE_HAVE_CUDA
    json_object_set_new(b, "cuda", json_true());
#else
    json_object_set_new(b, "cuda", json_false());
#endif
#ifdef MOESERVE_HAVE_NCCL
    json_object_set_new(b, "nccl", json_true());
#else
    json_object_set_new(b, "nccl", json_false());
#endif
    json_object_set_new(b, "sanitize", json_string(MOESERVE_SANITIZE_OPT));
#ifdef MOESERVE_NATIVE_OPT
    json_object_set_new(b, "native", json_true());
#else
    json_object_set_new(b, "native", json_false());
#endif
    json_t *o = json_object();
    json_object_set_new(o, "version", json_string(MOESERVE_VERSION));
    json_object_set_new(o, "commit", json_string(MOESERVE_COMMIT));
    json_object_set_new(o, "build", b);
    return dump(o);
}

char *proto_resp_tokenizer_info(const char *bos, const char *eos, const char *chat_template,
                                int max_model_len, int vocab_size)
{
    json_t *o = json_object();
    json_object_set_new(o, "bos_token", bos ? json_string(bos) : json_null());
    json_object_set_new(o, "eos_token", eos ? json_string(eos) : json_null());
    json_object_set_new(o, "pad_token", json_null());
    json_object_set_new(o, "chat_template", chat_template ? json_string(chat_template) : json_null());
    json_object_set_new(o, "model_max_length", json_integer(max_model_len));
    json_object_set_new(o, "vocab_size", json_integer(vocab_size));
    return dump(o);
}

char *proto_resp_models(const char *model, long created, int max_model_len)
{
    json_t *m = model_obj(model, created, max_model_len);
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
