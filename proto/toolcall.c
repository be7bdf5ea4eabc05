/* Tool-call syntaxes (see toolcall.h). A call is a block between an open and a close marker;
 * what lies between is parsed per syntax (a JSON object with name and arguments, DeepSeek's
 * name line and fenced JSON, or the XML-style tags of Qwen3-Coder, GLM and MiniMax, whose raw
 * values are typed by the request's tool schemas); harmony's messages have their own small
 * state machine.
 * Streaming holds back text that may be the start of an open marker and everything inside an
 * open block, so content never shows a call's syntax. */
#include "proto/toolcall.h"

#include <errno.h>
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

#define MM_OPEN "<minimax:tool_call>"
#define MM_CLOSE "</minimax:tool_call>"

static const char *open_marker(enum tc_syntax s)
{
    return s == TC_DEEPSEEK ? DS_CALL_BEGIN : s == TC_MINIMAX ? MM_OPEN : "<tool_call>";
}

static const char *close_marker(enum tc_syntax s)
{
    return s == TC_DEEPSEEK ? DS_CALL_END : s == TC_MINIMAX ? MM_CLOSE : "</tool_call>";
}

#define LL_TAG "<|python_tag|>"     /* Llama 3.1+ */
#define LL_START "<|python_start|>" /* Llama 4 */
#define LL_END "<|python_end|>"

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
    if (tok_token_id(tok, MM_OPEN) >= 0) return TC_MINIMAX;
    if (tok_token_id(tok, "<arg_key>") >= 0) return TC_GLM;
    return TC_HERMES;
}

enum tc_syntax tc_syntax_of_model(const struct tokenizer *tok, const char *chat_template)
{
    enum tc_syntax syn = tc_syntax_of(tok);
    if (syn != TC_HERMES || !chat_template) return syn;
    if (strstr(chat_template, MM_OPEN)) return TC_MINIMAX;
    if (strstr(chat_template, "<arg_key>")) return TC_GLM;
    if (strstr(chat_template, "<function=") && strstr(chat_template, "<parameter="))
        return TC_QWEN3_XML;
    if ((strstr(chat_template, LL_TAG) || strstr(chat_template, LL_START)) &&
        !strstr(chat_template, "<tool_call>"))
        return TC_LLAMA;
    return TC_HERMES;
}

static const struct {
    const char *name;
    enum tc_syntax syn;
} syntax_names[] = {
    {"hermes", TC_HERMES},          {"qwen3_coder", TC_QWEN3_XML}, {"qwen3_xml", TC_QWEN3_XML},
    {"glm45", TC_GLM},              {"glm47", TC_GLM},             {"glm4_moe", TC_GLM},
    {"minimax_m2", TC_MINIMAX},     {"deepseek_v3", TC_DEEPSEEK},  {"openai", TC_HARMONY},
    {"llama3_json", TC_LLAMA},      {"llama4_json", TC_LLAMA},
};
#define N_SYNTAX_NAMES (sizeof syntax_names / sizeof *syntax_names)

int tc_syntax_parse(const char *name, enum tc_syntax *out)
{
    for (size_t i = 0; name && i < N_SYNTAX_NAMES; i++)
        if (strcmp(name, syntax_names[i].name) == 0) {
            *out = syntax_names[i].syn;
            return 0;
        }
    return -1;
}

const char *tc_syntax_name(enum tc_syntax syn)
{
    for (size_t i = 0; i < N_SYNTAX_NAMES; i++)
        if (syntax_names[i].syn == syn) return syntax_names[i].name;
    return "hermes";
}

bool tc_needs_special_tokens(enum tc_syntax syn)
{
    /* GLM and MiniMax as vLLM serves them: their markers are kept whatever the tokenizer says */
    return syn == TC_DEEPSEEK || syn == TC_HARMONY || syn == TC_GLM || syn == TC_MINIMAX;
}

int tc_reasoning_parse(const char *name, int *mode)
{
    static const char *const think[] = {"deepseek_r1", "qwen3", "glm45", "minimax_m2"};
    if (!name || strcmp(name, "auto") == 0) return *mode = -1, 0;
    if (strcmp(name, "none") == 0) return *mode = 0, 0;
    for (size_t i = 0; i < sizeof think / sizeof *think; i++)
        if (strcmp(name, think[i]) == 0) return *mode = 1, 0;
    return -1;
}

bool tc_reasoning_on(int mode, const struct tokenizer *tok, enum tc_syntax syn)
{
    if (syn == TC_HARMONY || mode == 0) return false;
    if (mode == 1) return true;
    return tok && tok_token_id(tok, TC_THINK_BEGIN) >= 0 && tok_token_id(tok, TC_THINK_END) >= 0;
}

static bool is_space(char c);

unsigned tc_think_flags(bool on, const char *prompt)
{
    if (!on) return 0;
    /* the generation prompt ends in <think> (and spaces): a <think> in a message's text is not
     * an open reasoning */
    size_t n = prompt ? strlen(prompt) : 0, bl = strlen(TC_THINK_BEGIN);
    while (n > 0 && is_space(prompt[n - 1])) n--;
    bool open = n >= bl && memcmp(prompt + n - bl, TC_THINK_BEGIN, bl) == 0;
    return TC_THINK | (open ? TC_THINK_OPEN : 0);
}

bool tc_markers_special(enum tc_syntax syn, const struct tokenizer *tok)
{
    if (syn == TC_DEEPSEEK || syn == TC_HARMONY) return true;
    if (syn == TC_HERMES || syn == TC_LLAMA) return false; /* forced without markers */
    const char *mk[] = {open_marker(syn), close_marker(syn), "<arg_key>", "</arg_key>",
                        "<arg_value>", "</arg_value>"};
    int n = syn == TC_GLM ? 6 : 2;
    for (int i = 0; tok && i < n; i++) {
        int32_t id = tok_token_id(tok, mk[i]);
        if (id >= 0 && tok_is_special(tok, id)) return true;
    }
    return false;
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

/* Parses the inside of one hermes or DeepSeek block; returns 1 with *c filled, 0 when it is no
 * call, -1 OOM. */
static int parse_json_block(enum tc_syntax syn, const char *s, size_t n, struct tc_call *c)
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

/* --- XML-style syntaxes: Qwen3 XML, GLM, MiniMax ----------------------------------------------
 * Each block is parsed whole: every call in it parses, or the block is no call (content).
 * Values are raw text, typed by the parameter's schema in the request's tools the way each
 * family's vLLM parser types them. */

struct tc_tools {
    json_t *arr; /* the request's tools array */
};

struct tc_tools *tc_tools_parse(const char *tools_json)
{
    if (!tools_json) return NULL;
    json_t *a = json_loads(tools_json, 0, NULL);
    struct tc_tools *t = json_is_array(a) ? malloc(sizeof *t) : NULL;
    if (!t) {
        json_decref(a);
        return NULL;
    }
    t->arr = a;
    return t;
}

void tc_tools_free(struct tc_tools *t)
{
    if (!t) return;
    json_decref(t->arr);
    free(t);
}

/* The properties object of the tool named name (NULL: no such tool or none declared); with
 * whole_params, a parameters object without "properties" stands for them (qwen3_coder does). */
static json_t *tool_props(const struct tc_tools *t, const char *name, bool whole_params)
{
    size_t i;
    json_t *x;
    if (!t) return NULL;
    json_array_foreach(t->arr, i, x)
    {
        json_t *fn = json_object_get(x, "function");
        const char *nm = json_string_value(json_object_get(fn, "name"));
        if (!nm || strcmp(nm, name) != 0) continue;
        json_t *params = json_object_get(fn, "parameters");
        json_t *props = json_object_get(params, "properties");
        if (json_is_object(props)) return props;
        return whole_params && json_is_object(params) ? params : NULL;
    }
    return NULL;
}

static bool xml_space(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v';
}

static bool at(const char *s, size_t n, size_t i, const char *lit)
{
    size_t m = strlen(lit);
    return i <= n && m <= n - i && memcmp(s + i, lit, m) == 0;
}

static size_t skip_space(const char *s, size_t n, size_t i)
{
    while (i < n && xml_space(s[i])) i++;
    return i;
}

/* Trims whitespace at both ends of the span *p, *n. */
static void trim_span(const char **p, size_t *n)
{
    while (*n && xml_space(**p)) {
        (*p)++;
        (*n)--;
    }
    while (*n && xml_space((*p)[*n - 1])) (*n)--;
}

/* Drops one leading and one trailing newline (what the template writes around a value). */
static void strip_newline(const char **p, size_t *n)
{
    if (*n && **p == '\n') {
        (*p)++;
        (*n)--;
    }
    if (*n && (*p)[*n - 1] == '\n') (*n)--;
}

/* A quoted name loses its quotes (MiniMax writes name="f"; vLLM also takes 'f' and f). */
static void unquote(const char **p, size_t *n)
{
    trim_span(p, n);
    if (*n >= 2 && (**p == '"' || **p == '\'') && (*p)[*n - 1] == **p) {
        (*p)++;
        *n -= 2;
    }
}

/* A function name: no spaces, controls, quotes, braces or angle brackets. */
static bool good_name(const char *s, size_t n)
{
    if (n == 0) return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c <= ' ' || c == 0x7f || strchr("<>\"'{}", c)) return false;
    }
    return true;
}

/* A parameter key: not empty, on one line, no tags, no NUL. */
static bool good_key(const char *s, size_t n)
{
    return n > 0 && !memchr(s, '\n', n) && !memchr(s, '<', n) && !memchr(s, '>', n) &&
           !memchr(s, '\0', n);
}

static bool ieq(const char *s, size_t n, const char *lit)
{
    size_t m = strlen(lit);
    if (n != m) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i] >= 'A' && s[i] <= 'Z' ? (char)(s[i] - 'A' + 'a') : s[i];
        if (c != lit[i]) return false;
    }
    return true;
}

static json_t *json_any(const char *s, size_t n)
{
    return json_loadb(s, n, JSON_DECODE_ANY, NULL);
}

/* Python's int() of a value: an optional sign and decimal digits, spaces around allowed
 * (integers past 64 bits stay strings). NULL when it is none. */
static json_t *as_int(const char *s, size_t n)
{
    char buf[32], *end;
    trim_span(&s, &n);
    size_t i = n && (s[0] == '-' || s[0] == '+') ? 1 : 0;
    if (i == n || n >= sizeof buf) return NULL;
    for (size_t k = i; k < n; k++)
        if (s[k] < '0' || s[k] > '9') return NULL;
    memcpy(buf, s, n);
    buf[n] = '\0';
    errno = 0;
    long long v = strtoll(buf, &end, 10);
    return errno || *end ? NULL : json_integer((json_int_t)v);
}

/* Python's float() of a value, returned as an integer when it is integral (as the parsers do);
 * infinities, NaN and hex floats are no numbers here (JSON has none). */
static json_t *as_float(const char *s, size_t n)
{
    char buf[64], *end;
    trim_span(&s, &n);
    if (n == 0 || n >= sizeof buf) return NULL;
    for (size_t k = 0; k < n; k++)
        if (!strchr("0123456789+-.eE", s[k]) || s[k] == '\0') return NULL;
    memcpy(buf, s, n);
    buf[n] = '\0';
    errno = 0;
    double v = strtod(buf, &end);
    if (*end || end == buf || v != v || v - v != 0) return NULL; /* NaN or infinite */
    if (v > -9e18 && v < 9e18 && (double)(long long)v == v) return json_integer((json_int_t)v);
    return json_real(v);
}

/* The lower-cased, trimmed type name of a parameter schema, "string" when it has none (a list
 * of types: its first that is not "null"). */
static void qwen_type(json_t *ps, char *ty, size_t cap)
{
    json_t *jt = json_is_object(ps) ? json_object_get(ps, "type") : NULL;
    const char *t = json_string_value(jt);
    for (size_t i = 0; json_is_array(jt) && !t && i < json_array_size(jt); i++) {
        const char *e = json_string_value(json_array_get(jt, i));
        if (e && strcmp(e, "null") != 0) t = e;
    }
    if (!t) t = "string";
    size_t n = strlen(t);
    trim_span(&t, &n);
    size_t w = 0;
    for (; w < n && w + 1 < cap; w++) ty[w] = (char)(t[w] >= 'A' && t[w] <= 'Z' ? t[w] + 32 : t[w]);
    ty[w] = '\0';
}

static bool has_prefix(const char *s, const char *p)
{
    return strncmp(s, p, strlen(p)) == 0;
}

/* qwen3_coder: by the schema's type; a parameter the schema lacks is a string. */
static json_t *qwen_value(const char *v, size_t n, json_t *ps)
{
    if (ieq(v, n, "null")) return json_null();
    if (!ps) return json_stringn(v, n);
    char ty[32];
    qwen_type(ps, ty, sizeof ty);
    static const char *const str_types[] = {"string", "str", "text", "varchar", "char", "enum"};
    for (size_t i = 0; i < sizeof str_types / sizeof *str_types; i++)
        if (strcmp(ty, str_types[i]) == 0) return json_stringn(v, n);
    json_t *r = NULL;
    if (has_prefix(ty, "int") || has_prefix(ty, "uint") || has_prefix(ty, "long") ||
        has_prefix(ty, "short") || has_prefix(ty, "unsigned")) {
        r = as_int(v, n);
    } else if (has_prefix(ty, "num") || has_prefix(ty, "float")) {
        r = as_float(v, n);
    } else if (strcmp(ty, "boolean") == 0 || strcmp(ty, "bool") == 0 ||
               strcmp(ty, "binary") == 0) {
        return json_boolean(ieq(v, n, "true"));
    } else { /* object, array and anything else: JSON when it parses */
        r = json_any(v, n);
    }
    return r ? r : json_stringn(v, n);
}

/* glm45: a string parameter stays text, anything else is JSON when it parses. */
static json_t *glm_value(const char *v, size_t n, json_t *ps)
{
    const char *t = json_string_value(json_object_get(ps, "type"));
    json_t *r = t && strcmp(t, "string") == 0 ? NULL : json_any(v, n);
    return r ? r : json_stringn(v, n);
}

enum { MT_INT = 1, MT_NUM = 2, MT_BOOL = 4, MT_JSON = 8, MT_STR = 16, MT_OTHER = 32 };
#define MT_MAX_DEPTH 16 /* anyOf/oneOf/allOf nesting followed; deeper adds nothing */

static unsigned mm_type_bit(const char *t)
{
    char ty[16];
    size_t n = strlen(t), w = 0;
    if (n >= sizeof ty) return MT_OTHER;
    for (; w < n; w++) ty[w] = (char)(t[w] >= 'A' && t[w] <= 'Z' ? t[w] + 32 : t[w]);
    ty[w] = '\0';
    if (!strcmp(ty, "integer") || !strcmp(ty, "int")) return MT_INT;
    if (!strcmp(ty, "number") || !strcmp(ty, "float")) return MT_NUM;
    if (!strcmp(ty, "boolean") || !strcmp(ty, "bool")) return MT_BOOL;
    if (!strcmp(ty, "object") || !strcmp(ty, "array")) return MT_JSON;
    if (!strcmp(ty, "string") || !strcmp(ty, "str") || !strcmp(ty, "text")) return MT_STR;
    return MT_OTHER;
}

/* The types a schema allows (minimax_m2): its type or types, its enum values' types, and
 * those of its anyOf/oneOf/allOf branches (depth-bounded). */
static unsigned mm_types(json_t *sch, int depth)
{
    if (!json_is_object(sch) || depth > MT_MAX_DEPTH) return 0;
    unsigned m = 0;
    json_t *t = json_object_get(sch, "type"), *e;
    size_t i;
    if (json_is_string(t)) m |= mm_type_bit(json_string_value(t));
    json_array_foreach(t, i, e) if (json_is_string(e)) m |= mm_type_bit(json_string_value(e));
    json_array_foreach(json_object_get(sch, "enum"), i, e)
    {
        m |= json_is_boolean(e)  ? MT_BOOL
             : json_is_integer(e) ? MT_INT
             : json_is_real(e)    ? MT_NUM
             : json_is_string(e)  ? MT_STR
             : json_is_null(e)    ? MT_OTHER
                                  : MT_JSON;
    }
    static const char *const branches[] = {"anyOf", "oneOf", "allOf"};
    for (int b = 0; b < 3; b++)
        json_array_foreach(json_object_get(sch, branches[b]), i, e) m |= mm_types(e, depth + 1);
    return m;
}

/* minimax_m2: the schema's types tried in the order integer, number, boolean, object/array,
 * string; then JSON when it parses, else the text. */
static json_t *mm_value(const char *v, size_t n, json_t *ps)
{
    if (ieq(v, n, "null") || ieq(v, n, "none") || ieq(v, n, "nil")) return json_null();
    unsigned m = ps ? mm_types(ps, 0) : 0;
    if (!m) m = MT_STR;
    json_t *r = NULL;
    if ((m & MT_INT) && (r = as_int(v, n))) return r;
    if ((m & MT_NUM) && (r = as_float(v, n))) return r;
    if (m & MT_BOOL) {
        const char *b = v;
        size_t bl = n;
        trim_span(&b, &bl);
        if (ieq(b, bl, "true") || ieq(b, bl, "1") || ieq(b, bl, "yes") || ieq(b, bl, "on"))
            return json_true();
        if (ieq(b, bl, "false") || ieq(b, bl, "0") || ieq(b, bl, "no") || ieq(b, bl, "off"))
            return json_false();
    }
    if ((m & MT_JSON) && (r = json_any(v, n))) return r;
    if (m & MT_STR) return json_stringn(v, n);
    r = json_any(v, n);
    return r ? r : json_stringn(v, n);
}

/* One call being built from a block. */
struct xcall {
    enum tc_syntax syn;
    json_t *props; /* the tool's declared parameters, borrowed (NULL: none known) */
    json_t *args;
};

/* Starts a call of name s[0, n) (validated); returns 0, or 1 when it is no call. */
static int xcall_begin(struct xcall *x, const struct tc_tools *tools, const char *s, size_t n,
                       char **name)
{
    if (!good_name(s, n)) return 1;
    json_t *probe = json_stringn(s, n); /* the name must be UTF-8 to be sent */
    if (!probe) return 1;
    json_decref(probe);
    *name = strndup(s, n);
    x->args = json_object();
    if (!*name || !x->args) return -1;
    x->props = tool_props(tools, *name, x->syn == TC_QWEN3_XML);
    return 0;
}

/* Adds the parameter key k[0, kl) = raw value v[0, vl), typed per syntax; 0, or 1 when the
 * key or value cannot be JSON (not UTF-8) or memory ran out (both leave the block text). */
static int xcall_param(struct xcall *x, const char *k, size_t kl, const char *v, size_t vl)
{
    if (!good_key(k, kl)) return 1;
    char key[256];
    if (kl >= sizeof key) return 1;
    memcpy(key, k, kl);
    key[kl] = '\0';
    json_t *ps = json_object_get(x->props, key);
    json_t *val = x->syn == TC_QWEN3_XML ? qwen_value(v, vl, ps)
                  : x->syn == TC_GLM     ? glm_value(v, vl, ps)
                                         : mm_value(v, vl, ps);
    return val && json_object_set_new(x->args, key, val) == 0 ? 0 : 1;
}

/* Finishes the call into lc[*ln] (arguments dumped); name is taken. 0, 1 (no call), -1 OOM. */
static int xcall_end(struct xcall *x, char *name, struct tc_call **lc, int *ln)
{
    char *a = json_dumps(x->args, JSON_COMPACT);
    json_decref(x->args);
    x->args = NULL;
    if (!a) {
        free(name);
        return -1;
    }
    return push_call(lc, ln, (struct tc_call){name, a});
}

/* Qwen3 XML: <function=NAME> (<parameter=KEY>VALUE</parameter>)* </function>, repeated. A value
 * ends at its </parameter>, or (as vLLM reads it) at the next <parameter= or </function>. */
static int qwen_block(struct xcall *x, const struct tc_tools *tools, const char *s, size_t n,
                      struct tc_call **lc, int *ln)
{
    size_t i = skip_space(s, n, 0);
    while (i < n) {
        if (!at(s, n, i, "<function=")) return 1;
        i += strlen("<function=");
        const char *gt = memchr(s + i, '>', n - i), *fe;
        if (!gt || !(fe = find(gt, (size_t)(s + n - gt), "</function>"))) return 1;
        const char *nm = s + i;
        size_t nl = (size_t)(gt - nm);
        trim_span(&nm, &nl);
        char *name = NULL;
        int rc = xcall_begin(x, tools, nm, nl, &name);
        size_t end = (size_t)(fe - s);
        size_t j = skip_space(s, end, (size_t)(gt - s) + 1);
        while (rc == 0 && j < end) {
            const char *kgt;
            if (!at(s, end, j, "<parameter=") ||
                !(kgt = memchr(s + j, '>', end - j))) {
                rc = 1;
                break;
            }
            const char *k = s + j + strlen("<parameter="), *v = kgt + 1;
            const char *pe = find(v, (size_t)(s + end - v), "</parameter>");
            const char *pn = find(v, (size_t)(s + end - v), "<parameter=");
            const char *ve = pe && (!pn || pe < pn) ? pe : pn ? pn : s + end;
            size_t vl = (size_t)(ve - v);
            strip_newline(&v, &vl);
            rc = xcall_param(x, k, (size_t)(kgt - k), v, vl);
            j = skip_space(s, end, (size_t)(ve - s) + (ve == pe ? strlen("</parameter>") : 0));
        }
        if (rc == 0) rc = xcall_end(x, name, lc, ln);
        else free(name);
        if (rc != 0) return rc;
        i = skip_space(s, n, end + strlen("</function>"));
    }
    return *ln > 0 ? 0 : 1;
}

/* Spaces and the two characters \n that GLM-4.7 sometimes writes literally between tags. */
static size_t glm_skip(const char *s, size_t n, size_t i)
{
    for (;;) {
        i = skip_space(s, n, i);
        if (!at(s, n, i, "\\n")) return i;
        i += 2;
    }
}

/* GLM: NAME (<arg_key>KEY</arg_key> <arg_value>VALUE</arg_value>)*, one call a block. */
static int glm_block(struct xcall *x, const struct tc_tools *tools, const char *s, size_t n,
                     struct tc_call **lc, int *ln)
{
    const char *ak = find(s, n, "<arg_key>"), *nm = s;
    size_t nl = ak ? (size_t)(ak - s) : n;
    trim_span(&nm, &nl);
    char *name = NULL;
    int rc = xcall_begin(x, tools, nm, nl, &name);
    size_t j = ak ? (size_t)(ak - s) : n;
    while (rc == 0 && (j = glm_skip(s, n, j)) < n) {
        const char *ke, *ve;
        size_t k0 = j + strlen("<arg_key>");
        if (!at(s, n, j, "<arg_key>") || !(ke = find(s + k0, n - k0, "</arg_key>"))) {
            rc = 1;
            break;
        }
        j = glm_skip(s, n, (size_t)(ke - s) + strlen("</arg_key>"));
        size_t v0 = j + strlen("<arg_value>");
        if (!at(s, n, j, "<arg_value>") || !(ve = find(s + v0, n - v0, "</arg_value>"))) {
            rc = 1;
            break;
        }
        const char *k = s + k0, *v = s + v0;
        size_t kl = (size_t)(ke - k), vl = (size_t)(ve - v);
        trim_span(&k, &kl);
        trim_span(&v, &vl);
        rc = xcall_param(x, k, kl, v, vl);
        j = (size_t)(ve - s) + strlen("</arg_value>");
    }
    if (rc == 0) return xcall_end(x, name, lc, ln);
    free(name);
    return rc;
}

/* MiniMax: (<invoke name=NAME> (<parameter name=KEY>VALUE</parameter>)* </invoke>)+. */
static int mm_block(struct xcall *x, const struct tc_tools *tools, const char *s, size_t n,
                    struct tc_call **lc, int *ln)
{
    size_t i = skip_space(s, n, 0);
    while (i < n) {
        if (!at(s, n, i, "<invoke name=")) return 1;
        i += strlen("<invoke name=");
        const char *gt = memchr(s + i, '>', n - i), *ie;
        if (!gt || !(ie = find(gt, (size_t)(s + n - gt), "</invoke>"))) return 1;
        const char *nm = s + i;
        size_t nl = (size_t)(gt - nm);
        unquote(&nm, &nl);
        char *name = NULL;
        int rc = xcall_begin(x, tools, nm, nl, &name);
        size_t end = (size_t)(ie - s);
        size_t j = skip_space(s, end, (size_t)(gt - s) + 1);
        while (rc == 0 && j < end) {
            const char *kgt, *pe = NULL;
            if (!at(s, end, j, "<parameter name=") || !(kgt = memchr(s + j, '>', end - j)) ||
                !(pe = find(kgt, (size_t)(s + end - kgt), "</parameter>"))) {
                rc = 1;
                break;
            }
            const char *k = s + j + strlen("<parameter name="), *v = kgt + 1;
            size_t kl = (size_t)(kgt - k), vl = (size_t)(pe - v);
            unquote(&k, &kl);
            trim_span(&v, &vl);
            rc = xcall_param(x, k, kl, v, vl);
            j = skip_space(s, end, (size_t)(pe - s) + strlen("</parameter>"));
        }
        if (rc == 0) rc = xcall_end(x, name, lc, ln);
        else free(name);
        if (rc != 0) return rc;
        i = skip_space(s, n, end + strlen("</invoke>"));
    }
    return *ln > 0 ? 0 : 1;
}

/* The calls of one XML block, appended to *calls only if the whole block parses. Returns 1
 * (calls added), 0 (no call: the block is text) or -1 (out of memory). */
static int parse_xml_block(enum tc_syntax syn, const struct tc_tools *tools, const char *s,
                           size_t n, struct tc_call **calls, int *n_calls)
{
    struct tc_call *lc = NULL;
    int ln = 0;
    struct xcall x = {.syn = syn};
    int rc = syn == TC_QWEN3_XML ? qwen_block(&x, tools, s, n, &lc, &ln)
             : syn == TC_GLM     ? glm_block(&x, tools, s, n, &lc, &ln)
                                 : mm_block(&x, tools, s, n, &lc, &ln);
    json_decref(x.args);
    if (rc == 0) {
        struct tc_call *g = realloc(*calls, sizeof *g * (size_t)(*n_calls + ln));
        if (g) {
            memcpy(g + *n_calls, lc, sizeof *lc * (size_t)ln);
            *calls = g;
            *n_calls += ln;
            free(lc);
            return 1;
        }
        rc = -1;
    }
    tc_calls_free(lc, ln);
    return rc < 0 ? -1 : 0;
}

/* The calls of one block of any block syntax: 1 (added), 0 (no call) or -1 (out of memory). */
static int parse_block(enum tc_syntax syn, const struct tc_tools *tools, const char *s, size_t n,
                       struct tc_call **calls, int *n_calls)
{
    /* Hermes and Qwen3 XML share <tool_call>, and the template alone tells them apart: each
     * also reads the other's body (a JSON object, a <function= tag), so a model whose template
     * was overridden or misread still has its calls parsed. */
    size_t lead = skip_space(s, n, 0);
    if (syn == TC_HERMES && at(s, n, lead, "<function=")) syn = TC_QWEN3_XML;
    else if (syn == TC_QWEN3_XML && lead < n && s[lead] == '{') syn = TC_HERMES;
    if (syn == TC_QWEN3_XML || syn == TC_GLM || syn == TC_MINIMAX)
        return parse_xml_block(syn, tools, s, n, calls, n_calls);
    struct tc_call c;
    int rc = parse_json_block(syn, s, n, &c);
    if (rc <= 0) return rc;
    return push_call(calls, n_calls, c) < 0 ? -1 : 1;
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

void tc_stream_init(struct tc_stream *s, enum tc_syntax syn, unsigned flags,
                    const struct tc_tools *tools)
{
    memset(s, 0, sizeof *s);
    s->syn = syn;
    s->tools = tools;
    s->flags = flags;
    if (flags & TC_THINK) s->think = flags & TC_THINK_OPEN ? 2 : 1;
}

static bool is_space(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* The <think> span at the output's start. Returns like stream_step, or 2 when the output is
 * past it (or never opened it) and the calls' step goes on from s->pos. */
static int think_step(struct tc_stream *s, const char *text, size_t len, bool final,
                      size_t *from, size_t *to)
{
    static const char *const end_mk[] = {TC_THINK_END};
    *from = *to = s->pos;
    if (s->think == 1) {
        size_t i = s->pos, bl = strlen(TC_THINK_BEGIN);
        while (i < len && is_space(text[i])) i++;
        size_t have = len - i < bl ? len - i : bl;
        if (memcmp(text + i, TC_THINK_BEGIN, have) != 0 || (have < bl && final)) {
            s->think = 0; /* no reasoning: all of it is the answer */
            return 2;
        }
        if (have < bl) return 0; /* it may still open */
        s->pos = i + bl;          /* the spaces before <think> and the marker are dropped */
        s->think = 2;
        *from = *to = s->pos;
    }
    s->reasoning = true;
    const char *e = find(text + s->pos, len - s->pos, TC_THINK_END);
    if (!e) { /* reasoning that never closes is all reasoning */
        *to = len - (final ? 0 : held_tail(text, s->pos, len, end_mk, 1));
        s->pos = *to;
        if (final) s->think = 0;
        return final ? 1 : 0;
    }
    *to = (size_t)(e - text);
    s->pos = *to + strlen(TC_THINK_END);
    s->think = 0;
    return 1;
}

/* --- Llama's JSON calls ----------------------------------------------------------------------- */

/* Length of the marker at text[i, len) among Llama's opening ones: its length, 0 when none,
 * (size_t)-1 when the text so far is a proper prefix of one. */
static size_t llama_tag(const char *text, size_t i, size_t len)
{
    static const char *const tags[] = {LL_TAG, LL_START};
    bool partial = false;
    for (int t = 0; t < 2; t++) {
        size_t m = strlen(tags[t]), have = len - i < m ? len - i : m;
        if (memcmp(text + i, tags[t], have) != 0) continue;
        if (have == m) return m;
        partial = true;
    }
    return partial ? (size_t)-1 : 0;
}

/* The calls of a whole Llama output text[0, n) (from its first non-space byte): appended to
 * *calls and 1 when all of it is calls, 0 when it is not (nothing appended), -1 OOM. */
static int llama_calls(const char *text, size_t n, struct tc_call **calls, int *n_calls)
{
    size_t i = skip_space(text, n, 0);
    size_t tag = llama_tag(text, i, n);
    if (tag != (size_t)-1 && tag > 0) {
        i = skip_space(text, n, i + tag);
        if (at(text, n, i, LL_END)) i += strlen(LL_END);
    }
    size_t end = n;
    while (end > i && is_space(text[end - 1])) end--;
    if (end - i >= strlen(LL_END) && memcmp(text + end - strlen(LL_END), LL_END,
                                            strlen(LL_END)) == 0)
        end -= strlen(LL_END);
    struct tc_call *lc = NULL;
    int ln = 0, rc = 0;
    for (;;) {
        i = skip_space(text, end, i);
        if (i >= end || text[i] != '{') goto no;
        json_error_t jerr;
        json_t *obj = json_loadb(text + i, end - i, JSON_DISABLE_EOF_CHECK, &jerr);
        const char *nm = json_string_value(json_object_get(obj, "name"));
        json_t *args = json_object_get(obj, "parameters");
        if (!args) args = json_object_get(obj, "arguments");
        struct tc_call c = {0};
        if (nm && *nm && args && (c.arguments = args_text(args)) && !(c.name = strdup(nm))) {
            free(c.arguments);
            json_decref(obj);
            rc = -1;
            goto no;
        }
        json_decref(obj);
        if (!c.name) {
            free(c.arguments);
            goto no;
        }
        if (push_call(&lc, &ln, c) != 0) {
            rc = -1;
            goto no;
        }
        i = skip_space(text, end, i + (size_t)jerr.position);
        if (i == end) break;
        if (text[i] != ';') goto no;
        i++;
    }
    struct tc_call *g = realloc(*calls, sizeof *g * (size_t)(*n_calls + ln));
    if (!g) {
        rc = -1;
        goto no;
    }
    memcpy(g + *n_calls, lc, sizeof *lc * (size_t)ln);
    *calls = g;
    *n_calls += ln;
    free(lc);
    return 1;
no:
    tc_calls_free(lc, ln);
    return rc;
}

/* Llama's step: undecided until the first non-space byte (or an opening marker) says whether
 * the output is calls; content then goes out as it comes, a call output is parsed at its end
 * (and is content when it does not parse). Returns like stream_step. */
static int llama_step(struct tc_stream *s, const char *text, size_t len, bool final,
                      size_t *from, size_t *to, struct tc_call **calls, int *n_calls)
{
    *from = *to = s->pos;
    if (s->llama == 0) {
        size_t i = s->pos;
        while (i < len && is_space(text[i])) i++;
        size_t tag = i < len ? llama_tag(text, i, len) : (size_t)-1;
        if (tag == (size_t)-1 && !final) return 0; /* spaces, or a marker's beginning */
        s->llama = i < len && (text[i] == '{' || (tag != (size_t)-1 && tag > 0)) ? 2 : 1;
    }
    if (s->llama == 1 || final) {
        int rc = s->llama == 2 ? llama_calls(text + s->pos, len - s->pos, calls, n_calls) : 0;
        if (rc < 0) return -1;
        if (rc == 0) *to = len; /* content (a call output that did not parse is content too) */
        s->pos = len;
    }
    return 0;
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
    if (s->think) {
        int rc = think_step(s, text, len, final, from, to);
        if (rc != 2) return rc;
        s->reasoning = false;
    }
    *from = *to = s->pos;
    if (s->flags & TC_NO_CALLS) {
        *to = s->pos = len;
        return 0;
    }
    if (s->syn == TC_LLAMA) return llama_step(s, text, len, final, from, to, calls, n_calls);
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
    const char *inner = text + s->block_at + ol;
    int rc = parse_block(s->syn, s->tools, inner, (size_t)(c - inner), calls, n_calls);
    if (rc < 0) return -1;
    size_t end = (size_t)(c - text) + cl;
    s->in_block = false;
    s->pos = end;
    if (rc == 0) { /* not a call after all: the block is content */
        if (*to == *from) *from = s->block_at;
        *to = end;
        return 1;
    }
    return 1;
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
    if (content->len > c0 && !(s->flags & TC_NO_CALLS)) {
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

int tc_parse(enum tc_syntax syn, unsigned flags, const struct tc_tools *tools, const char *text,
             size_t len, struct ms_buf *content, struct tc_call **calls, int *n_calls,
             struct ms_buf *reasoning)
{
    struct tc_stream st;
    tc_stream_init(&st, syn, flags, tools);
    size_t c0 = content->len, r0 = reasoning->len;
    if (tc_stream_feed(&st, text, len, true, content, reasoning, calls, n_calls) != 0) return -1;
    trim_from(content, c0);
    trim_from(reasoning, r0);
    return 0;
}

/* --- forcing grammars of the XML-style syntaxes ----------------------------------------------- */

/* Appends s[0, n) as an EBNF literal (quotes, backslashes and bytes outside printable ASCII
 * escaped). */
static bool ebnf_lit(struct ms_buf *b, const char *s, size_t n)
{
    bool ok = ms_buf_adds(b, "\"") == 0;
    for (size_t i = 0; ok && i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8] = {(char)c, 0};
        if (c == '"' || c == '\\') snprintf(e, sizeof e, "\\%c", c);
        else if (c == '\n') snprintf(e, sizeof e, "\\n");
        else if (c < 0x20 || c >= 0x7f) snprintf(e, sizeof e, "\\x%02X", c);
        ok = ms_buf_adds(b, e) == 0;
    }
    return ok && ms_buf_adds(b, "\"") == 0;
}

/* The literal a + mid + c. */
static bool ebnf_lit3(struct ms_buf *b, const char *a, const char *mid, const char *c)
{
    struct ms_buf t = {0};
    bool ok = ms_buf_adds(&t, a) == 0 && ms_buf_adds(&t, mid) == 0 && ms_buf_adds(&t, c) == 0 &&
              ebnf_lit(b, t.p, t.len);
    ms_buf_free(&t);
    return ok;
}

/* `xv ::= ` any text without the closing tag T (whose only '<' is its first byte). Exact: after
 * each '<' comes a proper prefix of T, then a byte that breaks T (not '<') and more text
 * without '<', or the next '<' (which starts the next such run), or the end. */
static bool text_rule(struct ms_buf *g, const char *tag)
{
    bool ok = ms_buf_adds(g, "xv ::= [^<]* (") == 0;
    size_t m = strlen(tag);
    for (size_t k = 1; ok && k < m; k++) {
        char cls[8];
        snprintf(cls, sizeof cls, "[^%c<]", tag[k]);
        ok = ms_buf_adds(g, k == 1 ? " " : " | ") == 0 && ebnf_lit(g, tag, k) &&
             ms_buf_adds(g, " ( ") == 0 && ms_buf_adds(g, cls) == 0 &&
             ms_buf_adds(g, " [^<]* )?") == 0;
    }
    return ok && ms_buf_adds(g, " )*\n") == 0;
}

/* Whether a parameter is written as raw text: its type is (or includes) string, or it has
 * none; the parsers keep such text as a string. Other types are written as JSON. */
static bool raw_param(json_t *ps)
{
    json_t *t = json_object_get(ps, "type"), *e;
    size_t i;
    if (!json_is_array(t)) return !json_is_string(t) || !strcmp(json_string_value(t), "string");
    json_array_foreach(t, i, e) if (json_is_string(e) && !strcmp(json_string_value(e), "string"))
        return true;
    return false;
}

/* A raw value: one of a string enum's values, text of bounded length (minLength, maxLength:
 * no '<' then), else free text. A pattern or format cannot be forced on raw text here: -1 with
 * the keyword, as the JSON Schema compiler refuses what it lacks. */
static int raw_value(struct ms_buf *g, json_t *ps, char *err, size_t errlen, char *bad_keyword,
                     size_t kwlen)
{
    json_t *en = json_object_get(ps, "enum"), *e;
    size_t k;
    bool all = json_array_size(en) > 0;
    json_array_foreach(en, k, e) if (!json_is_string(e)) all = false;
    if (all) {
        bool ok = ms_buf_adds(g, " (") == 0;
        json_array_foreach(en, k, e) ok = ok && ms_buf_adds(g, k ? " | " : " ") == 0 &&
                                          ebnf_lit(g, json_string_value(e), json_string_length(e));
        return ok && ms_buf_adds(g, " )") == 0 ? 0 : ms_errf(err, errlen, "out of memory");
    }
    static const char *const refused[] = {"pattern", "format"};
    for (int i = 0; i < 2; i++)
        if (json_object_get(ps, refused[i])) {
            snprintf(bad_keyword, kwlen, "%s", refused[i]);
            return ms_errf(err, errlen,
                           "JSON Schema: '%s' on a string parameter cannot be forced in this "
                           "model's tool-call syntax (its values are raw text)", refused[i]);
        }
    json_t *mn = json_object_get(ps, "minLength"), *mx = json_object_get(ps, "maxLength");
    if (!mn && !mx) return ms_buf_adds(g, " xv") == 0 ? 0 : ms_errf(err, errlen, "out of memory");
    json_int_t lo = json_is_integer(mn) ? json_integer_value(mn) : 0;
    json_int_t hi = json_is_integer(mx) ? json_integer_value(mx) : -1;
    if ((mn && !json_is_integer(mn)) || (mx && !json_is_integer(mx)) || lo < 0 || lo > 1000 ||
        hi > 1000 || (mx && hi < lo)) {
        snprintf(bad_keyword, kwlen, "%s", mx && (hi > 1000 || hi < lo) ? "maxLength" : "minLength");
        return ms_errf(err, errlen, "JSON Schema: string length bounds must be integers in "
                                    "[0, 1000], minLength <= maxLength");
    }
    char rep[64];
    if (hi >= 0) snprintf(rep, sizeof rep, " [^<]{%lld,%lld}", (long long)lo, (long long)hi);
    else snprintf(rep, sizeof rep, " [^<]{%lld,}", (long long)lo);
    return ms_buf_adds(g, rep) == 0 ? 0 : ms_errf(err, errlen, "out of memory");
}

static bool in_array(json_t *a, const char *s)
{
    size_t i;
    json_t *e;
    json_array_foreach(a, i, e) if (json_is_string(e) && !strcmp(json_string_value(e), s))
        return true;
    return false;
}

/* How each syntax writes a call: around the name, around each key, after each value, after
 * the call. */
struct xml_form {
    const char *name_pre, *name_post, *key_pre, *key_post, *value_post, *call_post, *close;
};

static const struct xml_form qwen_form = {"<function=", ">\n", "<parameter=", ">\n",
                                          "\n</parameter>\n", "</function>", "</parameter>"};
static const struct xml_form glm_form = {"", "\n", "<arg_key>", "</arg_key>\n<arg_value>",
                                         "</arg_value>\n", "", "</arg_value>"};
static const struct xml_form mm_form = {"<invoke name=\"", "\">\n", "<parameter name=\"", "\">",
                                        "</parameter>\n", "</invoke>\n", "</parameter>"};

/* The JSON text of one parameter's schema, standing alone: the definitions its $refs point
 * to ("#/$defs/x", "#/definitions/x", relative to the parameters schema) go with it. */
static char *value_schema(json_t *params, json_t *ps)
{
    json_t *defs = json_object_get(params, "$defs"), *old = json_object_get(params, "definitions");
    if (!defs && !old) return json_dumps(ps, JSON_COMPACT);
    json_t *c = json_copy(ps);
    if (!c || (defs && json_object_set(c, "$defs", defs) != 0) ||
        (old && json_object_set(c, "definitions", old) != 0)) {
        json_decref(c);
        return NULL;
    }
    char *t = json_dumps(c, JSON_COMPACT);
    json_decref(c);
    return t;
}

/* The rule tI_call of one tool: its name, then its declared parameters in order (the required
 * ones always, the others optionally), each value free text or the parameter's JSON Schema. */
static int xml_call_rule(const struct xml_form *f, json_t *fn, const char *name, size_t ti,
                         struct ms_buf *g, char **rules, char *err, size_t errlen,
                         char *bad_keyword, size_t kwlen)
{
    json_t *params = json_object_get(fn, "parameters"), *ps;
    json_t *props = json_object_get(params, "properties");
    json_t *req = json_object_get(params, "required");
    char pre[40];
    snprintf(pre, sizeof pre, "t%zu_", ti);
    bool ok = ms_buf_adds(g, pre) == 0 && ms_buf_adds(g, "call ::= ") == 0 &&
              ebnf_lit3(g, f->name_pre, name, f->name_post);
    size_t j = 0;
    const char *key;
    json_object_foreach(props, key, ps)
    {
        if (!good_key(key, strlen(key)) || strlen(key) >= 256)
            return ms_errf(err, errlen,
                           "the parameter '%.64s' of '%.64s' cannot be written in this model's "
                           "tool-call syntax", key, name);
        ok = ok && ms_buf_adds(g, " ( ") == 0 && ebnf_lit3(g, f->key_pre, key, f->key_post);
        if (raw_param(ps)) {
            if (ok && raw_value(g, ps, err, errlen, bad_keyword, kwlen) != 0) return -1;
        } else {
            char vp[64];
            snprintf(vp, sizeof vp, "t%zu_p%zu_", ti, j);
            char *schema = value_schema(params, ps);
            int r = schema ? jschema_rules(schema, vp, rules, err, errlen, bad_keyword, kwlen)
                           : ms_errf(err, errlen, "out of memory");
            free(schema);
            if (r < 0) return -1;
            ok = ok && ms_buf_adds(g, " ") == 0 && ms_buf_adds(g, vp) == 0 &&
                 ms_buf_adds(g, "root") == 0;
        }
        ok = ok && ms_buf_adds(g, " ") == 0 && ebnf_lit(g, f->value_post, strlen(f->value_post)) &&
             ms_buf_adds(g, in_array(req, key) ? " )" : " )?") == 0;
        j++;
    }
    if (*f->call_post)
        ok = ok && ms_buf_adds(g, " ") == 0 && ebnf_lit(g, f->call_post, strlen(f->call_post));
    return ok && ms_buf_adds(g, "\n") == 0 ? 0 : ms_errf(err, errlen, "out of memory");
}

static int xml_grammar(enum tc_syntax syn, const char *tools_json, const char *only_name,
                       bool parallel, char **out, char *err, size_t errlen, char *bad_keyword,
                       size_t kwlen)
{
    const struct xml_form *f = syn == TC_QWEN3_XML ? &qwen_form
                               : syn == TC_GLM     ? &glm_form
                                                   : &mm_form;
    json_t *tools = json_loads(tools_json, 0, NULL), *t;
    char *rules = strdup(jschema_base_rules());
    struct ms_buf g = {0}, alts = {0};
    int rc = -1, n = 0;
    size_t i;
    if (!tools || !rules) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    json_array_foreach(tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (only_name && strcmp(name, only_name) != 0)) continue;
        if (!good_name(name, strlen(name))) {
            ms_errf(err, errlen,
                    "the tool name '%.64s' cannot be written in this model's tool-call syntax",
                    name);
            goto out;
        }
        if (xml_call_rule(f, fn, name, i, &g, &rules, err, errlen, bad_keyword, kwlen) != 0)
            goto out;
        char ref[40];
        snprintf(ref, sizeof ref, "%st%zu_call", n ? " | " : "", i);
        if (ms_buf_adds(&alts, ref) != 0) {
            ms_errf(err, errlen, "out of memory");
            goto out;
        }
        n++;
    }
    if (n == 0) {
        ms_errf(err, errlen, "no tool to call");
        goto out;
    }
    bool many = parallel && !only_name;
    struct ms_buf o = {0};
    bool ok = ms_buf_adds(&o, rules) == 0 && ms_buf_add(&o, g.p, g.len) == 0 &&
              text_rule(&o, f->close) && ms_buf_adds(&o, "call ::= ") == 0 &&
              ms_buf_add(&o, alts.p, alts.len) == 0;
    if (syn == TC_MINIMAX)
        ok = ok && ms_buf_adds(&o, "\nroot ::= \"<minimax:tool_call>\\n\" call") == 0 &&
             ms_buf_adds(&o, many ? "+" : "") == 0 &&
             ms_buf_adds(&o, " \"</minimax:tool_call>\"\n") == 0;
    else
        ok = ok &&
             ms_buf_adds(&o, syn == TC_QWEN3_XML
                                 ? "\nblock ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n"
                                 : "\nblock ::= \"<tool_call>\" call \"</tool_call>\"\n") == 0 &&
             ms_buf_adds(&o, many ? "root ::= block ( \"\\n\" block )*\n" : "root ::= block\n") == 0;
    if (!ok) {
        ms_buf_free(&o);
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    *out = ms_buf_take(&o);
    rc = 0;
out:
    json_decref(tools);
    free(rules);
    ms_buf_free(&g);
    ms_buf_free(&alts);
    return rc;
}

int tc_grammar(enum tc_syntax syn, const char *tools_json, const char *only_name, bool parallel,
               char **out, char *err, size_t errlen, char *bad_keyword, size_t kwlen)
{
    *out = NULL;
    if (syn == TC_QWEN3_XML || syn == TC_GLM || syn == TC_MINIMAX)
        return xml_grammar(syn, tools_json, only_name, parallel, out, err, errlen, bad_keyword,
                           kwlen);
    if (syn != TC_HERMES && syn != TC_LLAMA) /* DeepSeek and harmony */
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
        /* "{\"name\": \"NAME\", \"arguments\": " tK_root "}" as EBNF, the name escaped
         * (Llama's key is "parameters") */
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
        ok = ok &&
             ms_buf_adds(&calls, syn == TC_LLAMA ? ", \\\"parameters\\\": \" "
                                                 : ", \\\"arguments\\\": \" ") == 0 &&
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
    /* hermes: each call in its <tool_call> block, blocks a line apart; Llama: calls alone,
     * "; " apart */
    bool llama = syn == TC_LLAMA;
    if (ms_buf_adds(&g, rules) != 0 || ms_buf_adds(&g, "call ::= ") != 0 ||
        ms_buf_add(&g, calls.p, calls.len) != 0 ||
        ms_buf_adds(&g, llama ? "\nblock ::= call\n"
                              : "\nblock ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n") != 0 ||
        ms_buf_adds(&g, "root ::= block") != 0 ||
        ms_buf_adds(&g, !(parallel && !only_name) ? "\n"
                        : llama                   ? " ( \"; \" block )*\n"
                                                  : " ( \"\\n\" block )*\n") != 0) {
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
