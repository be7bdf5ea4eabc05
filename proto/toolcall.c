/* Tool-call syntaxes (see toolcall.h). A call is a block between an open and a close marker;
 * what lies between is parsed per syntax (a JSON object with name and arguments, or DeepSeek's
 * name line and fenced JSON); harmony's messages have their own small state machine.
 * Streaming holds back text that may be the start of an open marker and everything inside an
 * open block, so content never shows a call's syntax. */
#include "proto/toolcall.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json_schema.h"

#define DS_CALLS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALLS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALL_END "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"

static const char *open_marker(enum tc_syntax s)
{
    return s == TC_DEEPSEEK ? DS_CALL_BEGIN : "<tool_call>";
}

static const char *close_marker(enum tc_syntax s)
{
    return s == TC_DEEPSEEK ? DS_CALL_END : "</tool_call>";
}

#define H_START "<|start|>"
#define H_CHANNEL "<|channel|>"
#define H_MESSAGE "<|message|>"

enum tc_syntax tc_syntax_of(const struct tokenizer *tok)
{
    if (!tok) return TC_HERMES;
    if (tok_token_id(tok, DS_CALLS_BEGIN) >= 0) return TC_DEEPSEEK;
    if (tok_token_id(tok, H_CHANNEL) >= 0 && tok_token_id(tok, H_MESSAGE) >= 0 &&
        tok_token_id(tok, "<|call|>") >= 0)
        return TC_HARMONY;
    return TC_HERMES;
}

bool tc_needs_special_tokens(enum tc_syntax syn)
{
    return syn == TC_DEEPSEEK || syn == TC_HARMONY;
}

void tc_calls_free(struct tc_call *calls, int n)
{
    for (int i = 0; calls && i < n; i++) {
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}

static const char *find(const char *s, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp(s + i, needle, m) == 0) return s + i;
    return NULL;
}

/* Arguments as compact JSON text: an object is dumped, a string holding JSON is kept. */
static char *args_text(json_t *a)
{
    if (!a || json_is_null(a)) return strdup("{}");
    if (json_is_string(a)) {
        json_t *p = json_loads(json_string_value(a), JSON_DECODE_ANY, NULL);
        bool ok = json_is_object(p);
        json_decref(p);
        return ok ? strdup(json_string_value(a)) : NULL;
    }
    return json_is_object(a) ? json_dumps(a, JSON_COMPACT) : NULL;
}

/* Parses the inside of one block; returns 1 with *c filled, 0 when it is no call, -1 OOM. */
static int parse_block(enum tc_syntax syn, const char *s, size_t n, struct tc_call *c)
{
    json_t *args = NULL, *obj = NULL;
    char *name = NULL;
    if (syn == TC_HERMES) {
        obj = json_loadb(s, n, 0, NULL);
        const char *nm = json_string_value(json_object_get(obj, "name"));
        args = json_object_get(obj, "arguments");
        if (!args) args = json_object_get(obj, "parameters");
        if (!nm || !*nm) goto no;
        name = strdup(nm);
        json_incref(args);
    } else {
        /* function<｜tool▁sep｜>NAME\n```json\nARGS\n``` */
        const char *sep = find(s, n, DS_SEP);
        if (!sep) goto no;
        const char *nm = sep + strlen(DS_SEP);
        const char *nl = memchr(nm, '\n', (size_t)(s + n - nm));
        if (!nl || nl == nm) goto no;
        name = strndup(nm, (size_t)(nl - nm));
        if (!name) return -1;
        const char *body = nl + 1, *end = s + n;
        if ((size_t)(end - body) >= 7 && memcmp(body, "```json", 7) == 0) body += 7;
        while (end > body && (end[-1] == '\n' || end[-1] == ' ')) end--;
        if (end - body >= 3 && memcmp(end - 3, "```", 3) == 0) end -= 3;
        args = json_loadb(body, (size_t)(end - body), 0, NULL);
        if (!args) goto no;
    }
    char *a = args_text(args);
    json_decref(args);
    json_decref(obj);
    if (!a) {
        free(name);
        return 0;
    }
    c->name = name;
    c->arguments = a;
    return 1;
no:
    free(name);
    json_decref(obj);
    return 0;
}

static size_t held_tail(const char *text, size_t from, size_t len, const char *const *mk, int n);

static int push_call(struct tc_call **calls, int *n, struct tc_call c)
{
    struct tc_call *g = realloc(*calls, sizeof *g * (size_t)(*n + 1));
    if (!g) {
        free(c.name);
        free(c.arguments);
        return -1;
    }
    g[(*n)++] = c;
    *calls = g;
    return 0;
}

/* Removes the syntax's outer markers (DeepSeek's calls begin/end) from content in place;
 * returns the new length. */
static size_t strip_markers(enum tc_syntax syn, char *content, size_t len)
{
    if (syn != TC_DEEPSEEK) return len;
    /* One pass over the text as it was: a marker that only appears once another is removed
     * ("<｜tool" + marker + "▁calls▁begin｜>") is text the model wrote, and stays. */
    static const char *const drop[] = {DS_CALLS_BEGIN, DS_CALLS_END};
    size_t w = 0;
    for (size_t i = 0; i < len;) {
        size_t skip = 0;
        for (int d = 0; d < 2 && !skip; d++) {
            size_t m = strlen(drop[d]);
            if (m <= len - i && memcmp(content + i, drop[d], m) == 0) skip = m;
        }
        if (skip) {
            i += skip;
            continue;
        }
        content[w++] = content[i++];
    }
    return w;
}


/* --- harmony (gpt-oss) ---------------------------------------------------------------------- */

enum { H_OUT, H_HEADER, H_BODY };
enum { HK_CONTENT, HK_HIDDEN, HK_CALL };

/* What ends a body: the first three are consumed with it, the last two open the next header. */
static const char *const h_ends[] = {"<|end|>", "<|call|>", "<|return|>", H_START, H_CHANNEL};
#define H_N_ENDS 5
#define H_MAX_MARKER 11 /* strlen(H_CHANNEL), the longest marker */

/* The earliest of markers[0, n) in text[from, len): its address (NULL if none), which in *which. */
static const char *find_first(const char *text, size_t from, size_t len, const char *const *mk,
                              int n, int *which)
{
    const char *best = NULL;
    for (int i = 0; i < n; i++) {
        const char *at = find(text + from, len - from, mk[i]);
        if (at && (!best || at < best)) {
            best = at;
            *which = i;
        }
    }
    return best;
}

/* Length of the longest tail of text[from, len) that is a proper prefix of one of markers. */
static size_t held_tail(const char *text, size_t from, size_t len, const char *const *mk, int n)
{
    size_t keep = 0;
    for (int i = 0; i < n; i++) {
        size_t ml = strlen(mk[i]);
        for (size_t k = ml - 1; k > keep; k--)
            if (k <= len - from && memcmp(text + len - k, mk[i], k) == 0) {
                keep = k;
                break;
            }
    }
    return keep;
}

/* The word after `key` in a header (up to a space, '<' or the end), or an empty span. */
static void header_word(const char *h, size_t n, const char *key, const char **w, size_t *wl)
{
    const char *at = find(h, n, key);
    *w = h;
    *wl = 0;
    if (!at) return;
    at += strlen(key);
    while (at < h + n && *at == ' ') at++;
    const char *e = at;
    while (e < h + n && *e != ' ' && *e != '<') e++;
    *w = at;
    *wl = (size_t)(e - at);
}

/* A call body: its recipient (functions. prefix dropped) and JSON arguments; 1, 0 or -1 (OOM). */
static int harmony_call(const char *hdr, size_t hl, const char *body, size_t bl,
                        struct tc_call *c)
{
    const char *r;
    size_t rl;
    header_word(hdr, hl, "to=", &r, &rl);
    if (rl > 10 && memcmp(r, "functions.", 10) == 0) {
        r += 10;
        rl -= 10;
    }
    json_t *args = json_loadb(body, bl, 0, NULL);
    char *a = json_is_object(args) ? args_text(args) : NULL;
    json_decref(args);
    if (!a || rl == 0) {
        free(a);
        return 0;
    }
    char *name = strndup(r, rl);
    if (!name) {
        free(a);
        return -1;
    }
    c->name = name;
    c->arguments = a;
    return 1;
}

static size_t resume_at(size_t len, size_t floor)
{
    return len > floor + H_MAX_MARKER ? len - H_MAX_MARKER : floor;
}

static int harmony_step(struct tc_stream *s, const char *text, size_t len, bool final,
                        size_t *from, size_t *to, struct tc_call **calls, int *n_calls)
{
    *from = *to = s->pos;
    s->reasoning = false;
    int which = 0;
    if (s->h_state == H_OUT) {
        static const char *const opens[] = {H_START, H_CHANNEL};
        const char *o = find_first(text, s->pos, len, opens, 2, &which);
        if (!o) {
            *to = len - (final ? 0 : held_tail(text, s->pos, len, opens, 2));
            s->pos = *to;
            return 0;
        }
        *to = (size_t)(o - text);
        s->h_state = H_HEADER;
        s->h_hdr = s->h_scan = s->pos = *to;
        return 1;
    }
    if (s->h_state == H_HEADER) {
        const char *m = find(text + s->h_scan, len - s->h_scan, H_MESSAGE);
        if (!m) {
            s->h_scan = resume_at(len, s->h_hdr);
            if (!final) return 0;
            /* a header that never opened a body is plain text */
            *from = s->h_hdr;
            *to = s->pos = len;
            s->h_state = H_OUT;
            return 1;
        }
        const char *h = text + s->h_hdr, *w;
        size_t hl = (size_t)(m - h), wl;
        header_word(h, hl, "to=", &w, &wl);
        int kind = HK_CONTENT;
        if (wl) {
            kind = HK_CALL;
        } else {
            header_word(h, hl, H_CHANNEL, &w, &wl);
            if (wl == 8 && memcmp(w, "analysis", 8) == 0) kind = HK_HIDDEN;
        }
        s->h_kind = kind;
        s->h_state = H_BODY;
        s->h_body = s->h_scan = s->pos = (size_t)(m - text) + strlen(H_MESSAGE);
        return 1;
    }
    /* in a body */
    const char *e = find_first(text, s->h_scan, len, h_ends, H_N_ENDS, &which);
    s->reasoning = s->h_kind == HK_HIDDEN;
    if (!e && !final) {
        s->h_scan = resume_at(len, s->h_body);
        if (s->h_kind == HK_CALL) return 0;
        *to = len - held_tail(text, s->pos, len, h_ends, H_N_ENDS);
        s->pos = *to;
        return *to > *from;
    }
    size_t end = e ? (size_t)(e - text) : len;
    size_t next = e && which < 3 ? end + strlen(h_ends[which]) : end;
    if (s->h_kind != HK_CALL) {
        *to = end;
    } else {
        struct tc_call call;
        int rc = harmony_call(text + s->h_hdr, s->h_body - s->h_hdr, text + s->h_body,
                              end - s->h_body, &call);
        if (rc < 0) return -1;
        if (rc == 0) { /* no call after all: the whole message is content */
            *from = s->h_hdr;
            *to = end;
        } else if (push_call(calls, n_calls, call) < 0) {
            return -1;
        }
    }
    s->pos = next;
    s->h_state = H_OUT;
    return 1;
}

void tc_stream_init(struct tc_stream *s, enum tc_syntax syn)
{
    memset(s, 0, sizeof *s);
    s->syn = syn;
}

/* One step: the range of text that is now certainly content (or reasoning: s->reasoning) and
 * at most one completed call. The range may start before s->pos as it was (an unfinished block
 * that turns out to be text is reported from its open marker). Returns 1 (call again), 0
 * (nothing more now) or -1 (out of memory). */
static int stream_step(struct tc_stream *s, const char *text, size_t len, bool final,
                       size_t *from, size_t *to, struct tc_call **calls, int *n_calls)
{
    if (s->syn == TC_HARMONY) return harmony_step(s, text, len, final, from, to, calls, n_calls);
    s->reasoning = false;
    const char *om = open_marker(s->syn), *cm = close_marker(s->syn);
    size_t ol = strlen(om), cl = strlen(cm);
    *from = *to = s->pos;
    if (!s->in_block) {
        const char *o = find(text + s->pos, len - s->pos, om);
        if (!o) {
            /* hold back a tail that may start the open marker (or, for DeepSeek, an outer
             * marker: content drops those whole, so one must not be split across steps) */
            static const char *const ds_outer[] = {DS_CALL_BEGIN, DS_CALLS_BEGIN, DS_CALLS_END};
            const char *const *mk = s->syn == TC_DEEPSEEK ? ds_outer : &om;
            size_t keep = final ? 0 : held_tail(text, s->pos, len, mk, s->syn == TC_DEEPSEEK ? 3 : 1);
            *to = len - keep;
            s->pos = *to;
            return 0;
        }
        *to = (size_t)(o - text);
        s->in_block = true;
        s->block_at = *to;
        s->pos = *to + ol;
    }
    const char *c = find(text + s->pos, len - s->pos, cm);
    if (!c) {
        if (final) { /* an unfinished block is plain text */
            s->in_block = false;
            s->pos = len;
            if (*to == *from) *from = s->block_at;
            *to = len;
        }
        return *to > *from ? 1 : 0;
    }
    struct tc_call call;
    const char *inner = text + s->block_at + ol;
    int rc = parse_block(s->syn, inner, (size_t)(c - inner), &call);
    if (rc < 0) return -1;
    size_t end = (size_t)(c - text) + cl;
    s->in_block = false;
    s->pos = end;
    if (rc == 0) { /* not a call after all: the block is content */
        if (*to == *from) *from = s->block_at;
        *to = end;
        return 1;
    }
    if (push_call(calls, n_calls, call) < 0) return -1;
    return 1;
}

static bool is_space(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

int tc_stream_feed(struct tc_stream *s, const char *text, size_t len, bool final,
                   struct ms_buf *content, struct ms_buf *reasoning, struct tc_call **calls,
                   int *n_calls)
{
    size_t c0 = content->len;
    for (;;) {
        size_t from, to;
        int rc = stream_step(s, text, len, final, &from, &to, calls, n_calls);
        if (rc < 0) return -1;
        struct ms_buf *dst = s->reasoning ? reasoning : content;
        if (to > from && ms_buf_add(dst, text + from, to - from) != 0) return -1;
        if (rc == 0) break;
    }
    if (content->len > c0) {
        content->len = c0 + strip_markers(s->syn, content->p + c0, content->len - c0);
        content->p[content->len] = '\0';
    }
    return 0;
}

/* Trims spaces at both ends of b[from, len) in place. */
static void trim_from(struct ms_buf *b, size_t from)
{
    size_t a = from, w = b->len;
    while (a < w && is_space(b->p[a])) a++;
    while (w > a && is_space(b->p[w - 1])) w--;
    if (a > from) memmove(b->p + from, b->p + a, w - a);
    b->len = from + (w - a);
    if (b->p) b->p[b->len] = '\0';
}

int tc_parse(enum tc_syntax syn, const char *text, size_t len, struct ms_buf *content,
             struct tc_call **calls, int *n_calls, struct ms_buf *reasoning)
{
    struct tc_stream st;
    tc_stream_init(&st, syn);
    size_t c0 = content->len, r0 = reasoning->len;
    if (tc_stream_feed(&st, text, len, true, content, reasoning, calls, n_calls) != 0) return -1;
    trim_from(content, c0);
    trim_from(reasoning, r0);
    return 0;
}

int tc_grammar(enum tc_syntax syn, const char *tools_json, const char *only_name, bool parallel,
               char **out, char *err, size_t errlen, char *bad_keyword, size_t kwlen)
{
    *out = NULL;
    if (syn != TC_HERMES) /* DeepSeek and harmony */
        return ms_errf(err, errlen,
                       "forcing a tool call is not supported for this model's tool-call syntax "
                       "(its markers are special tokens)");
    json_t *tools = json_loads(tools_json, 0, NULL);
    char *rules = strdup(jschema_base_rules());
    struct ms_buf calls = {0}; /* the alternatives of `call`, one per tool */
    int rc = -1, n = 0;
    size_t i;
    json_t *t;
    if (!tools || !rules) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    json_array_foreach(tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (only_name && strcmp(name, only_name) != 0)) continue;
        json_t *params = json_object_get(fn, "parameters");
        char *schema = params && !json_is_null(params) ? json_dumps(params, JSON_COMPACT)
                                                       : strdup("{\"type\":\"object\"}");
        char prefix[32];
        snprintf(prefix, sizeof prefix, "t%zu_", i);
        int r = schema ? jschema_rules(schema, prefix, &rules, err, errlen, bad_keyword, kwlen)
                       : ms_errf(err, errlen, "out of memory");
        free(schema);
        if (r < 0) goto out;
        /* "{\"name\": \"NAME\", \"arguments\": " tK_root "}" as EBNF, the name escaped */
        json_t *js = json_string(name);
        char *qn = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
        json_decref(js);
        if (!qn) {
            ms_errf(err, errlen, "out of memory");
            goto out;
        }
        bool ok = ms_buf_adds(&calls, n ? " | \"{\\\"name\\\": " : "\"{\\\"name\\\": ") == 0;
        for (const char *c = qn; *c && ok; c++) /* the JSON name, escaped as an EBNF literal */
            ok = (!(*c == '"' || *c == '\\') || ms_buf_add(&calls, "\\", 1) == 0) &&
                 ms_buf_add(&calls, c, 1) == 0;
        free(qn);
        ok = ok && ms_buf_adds(&calls, ", \\\"arguments\\\": \" ") == 0 &&
             ms_buf_adds(&calls, prefix) == 0 && ms_buf_adds(&calls, "root \"}\"") == 0;
        if (!ok) {
            ms_errf(err, errlen, "out of memory");
            goto out;
        }
        n++;
    }
    if (n == 0) {
        ms_errf(err, errlen, "no tool to call");
        goto out;
    }
    struct ms_buf g = {0};
    if (ms_buf_adds(&g, rules) != 0 || ms_buf_adds(&g, "call ::= ") != 0 ||
        ms_buf_add(&g, calls.p, calls.len) != 0 ||
        ms_buf_adds(&g, "\nblock ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n"
                        "root ::= block") != 0 ||
        ms_buf_adds(&g, parallel && !only_name ? " ( \"\\n\" block )*\n" : "\n") != 0) {
        ms_buf_free(&g);
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    *out = ms_buf_take(&g);
    rc = 0;
out:
    json_decref(tools);
    free(rules);
    ms_buf_free(&calls);
    return rc;
}
