/* Jinja builtins: the filters, tests, global functions (raise_exception, namespace, range, dict,
 * strftime_now) and Python string/dict methods that chat templates call, with the semantics of
 * jinja2 3.1 and CPython where output depends on them (str.split/strip rules, json.dumps
 * spacing for tojson as transformers overrides it: ensure_ascii off, keys unsorted). */
#include "jinja_eval.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- UTF-8 and code point helpers ----------------------------------------------------- */

size_t jinja_utf8_len(const char *p, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)p[i] & 0xc0) != 0x80;
    return k;
}

size_t jinja_utf8_offset(const char *p, size_t n, size_t i)
{
    size_t k = 0;
    for (size_t b = 0; b < n; b++)
        if (((unsigned char)p[b] & 0xc0) != 0x80) {
            if (k == i) return b;
            k++;
        }
    return n;
}

/* Decodes the code point at p[*i] and advances *i (invalid bytes decode as themselves). */
static uint32_t utf8_next(const char *p, size_t n, size_t *i)
{
    unsigned char c = (unsigned char)p[*i];
    size_t len = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    if (*i + len > n) len = 1;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
    for (size_t k = 1; k < len; k++) cp = (cp << 6) | ((unsigned char)p[*i + k] & 0x3f);
    *i += len;
    return cp;
}

/* Python's str.isspace() set. */
static bool py_space(uint32_t c)
{
    return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

static bool in_chars(uint32_t c, const jinja_value *chars)
{
    if (!chars || chars->t != JINJA_STR) return py_space(c);
    size_t i = 0;
    while (i < chars->u.s.n)
        if (utf8_next(chars->u.s.p, chars->u.s.n, &i) == c) return true;
    return false;
}

/* str.strip/lstrip/rstrip: which = 1 left, 2 right, 3 both. */
static jinja_value strip(jinja_value s, const jinja_value *chars, int which)
{
    const char *p = s.u.s.p;
    size_t lo = 0, hi = s.u.s.n;
    if (which & 1)
        while (lo < hi) {
            size_t j = lo;
            if (!in_chars(utf8_next(p, hi, &j), chars)) break;
            lo = j;
        }
    if (which & 2)
        while (hi > lo) {
            size_t j = hi - 1;
            while (j > lo && ((unsigned char)p[j] & 0xc0) == 0x80) j--;
            size_t k = j;
            if (!in_chars(utf8_next(p, hi, &k), chars)) break;
            hi = j;
        }
    return jinja_str_value(p + lo, hi - lo);
}

static const jinja_value *kwarg(const jinja_args *a, const char *name)
{
    size_t nl = strlen(name);
    for (size_t i = 0; i < a->nkw; i++)
        if (a->kwnames[i].n == nl && memcmp(a->kwnames[i].p, name, nl) == 0) return &a->kw[i];
    return NULL;
}

/* Positional argument pos, else the keyword argument `name`, else NULL. */
static const jinja_value *arg(const jinja_args *a, size_t pos, const char *name)
{
    if (pos < a->n) return &a->v[pos];
    size_t nl = strlen(name);
    for (size_t i = 0; i < a->nkw; i++)
        if (a->kwnames[i].n == nl && memcmp(a->kwnames[i].p, name, nl) == 0) return &a->kw[i];
    return NULL;
}

static bool name_is(jinja_str s, const char *name)
{
    return s.n == strlen(name) && memcmp(s.p, name, s.n) == 0;
}

static int need_str(jinja_ctx *cx, const jinja_value *v, int line, const char *what)
{
    if (!v || v->t != JINJA_STR) return jinja_fail(cx, line, "%s expects a string argument", what);
    return 0;
}

static int buf_value(jinja_ctx *cx, jinja_buf *b, jinja_value *out)
{
    int rc = jinja_buf_put(cx, b, "", 0);
    if (!rc) {
        char *p = jinja_arena_strdup(cx->a, b->p, b->n);
        if (!p) rc = jinja_oom(cx);
        else *out = jinja_str_value(p, b->n);
    }
    free(b->p);
    return rc;
}

static int str_replace(jinja_ctx *cx, jinja_value s, jinja_value from, jinja_value to, int64_t count,
                       jinja_value *out)
{
    if (from.u.s.n == 0) {
        *out = s;
        return 0;
    }
    jinja_buf b = {0};
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    int rc = 0;
    while (!rc && p < end) {
        const char *hit = count != 0 ? memmem(p, (size_t)(end - p), from.u.s.p, from.u.s.n) : NULL;
        if (!hit) {
            rc = jinja_buf_put(cx, &b, p, (size_t)(end - p));
            break;
        }
        rc = jinja_buf_put(cx, &b, p, (size_t)(hit - p));
        if (!rc) rc = jinja_buf_put(cx, &b, to.u.s.p, to.u.s.n);
        p = hit + from.u.s.n;
        if (count > 0) count--;
    }
    if (rc) {
        free(b.p);
        return -1;
    }
    return buf_value(cx, &b, out);
}

/* str.split(sep=None, maxsplit=-1) */
static int str_split(jinja_ctx *cx, jinja_value s, const jinja_value *sep, int64_t maxsplit, int line,
                     jinja_value *out)
{
    *out = jinja_list_new(cx, 0);
    if (cx->failed) return -1;
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, i = 0;
    if (sep && sep->t == JINJA_STR) {
        if (sep->u.s.n == 0) return jinja_fail(cx, line, "empty separator");
        for (;;) {
            const char *hit = maxsplit != 0 ? memmem(p + i, n - i, sep->u.s.p, sep->u.s.n) : NULL;
            if (!hit) return jinja_list_push(cx, *out, jinja_str_value(p + i, n - i));
            if (jinja_list_push(cx, *out, jinja_str_value(p + i, (size_t)(hit - (p + i))))) return -1;
            i = (size_t)(hit - p) + sep->u.s.n;
            if (maxsplit > 0) maxsplit--;
        }
    }
    for (;;) { /* runs of whitespace */
        while (i < n) {
            size_t j = i;
            if (!py_space(utf8_next(p, n, &j))) break;
            i = j;
        }
        if (i >= n) return 0;
        if (maxsplit == 0) {
            jinja_value rest = strip(jinja_str_value(p + i, n - i), NULL, 2);
            return jinja_list_push(cx, *out, rest);
        }
        size_t start = i;
        while (i < n) {
            size_t j = i;
            if (py_space(utf8_next(p, n, &j))) break;
            i = j;
        }
        if (jinja_list_push(cx, *out, jinja_str_value(p + start, i - start))) return -1;
        if (maxsplit > 0) maxsplit--;
    }
}

/* ASCII case mapping (mode: 0 lower, 1 upper, 2 capitalize, 3 title). */
static int str_case(jinja_ctx *cx, jinja_value s, int mode, jinja_value *out)
{
    char *p = jinja_arena_strdup(cx->a, s.u.s.p, s.u.s.n);
    if (!p) return jinja_oom(cx);
    bool word_start = true;
    for (size_t i = 0; i < s.u.s.n; i++) {
        char c = p[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        bool up = mode == 1 || ((mode == 2 && i == 0) || (mode == 3 && word_start));
        if (alpha) p[i] = up ? (char)(c & ~0x20) : (char)(c | 0x20);
        word_start = !alpha && !(c >= '0' && c <= '9') && !((unsigned char)c & 0x80);
    }
    *out = jinja_str_value(p, s.u.s.n);
    return 0;
}

static bool has_prefix(jinja_value s, jinja_value pre, bool suffix)
{
    if (pre.t != JINJA_STR || pre.u.s.n > s.u.s.n) return false;
    const char *at = suffix ? s.u.s.p + s.u.s.n - pre.u.s.n : s.u.s.p;
    return memcmp(at, pre.u.s.p, pre.u.s.n) == 0;
}

/* ---- JSON (Python json.dumps) --------------------------------------------------------- */

typedef struct {
    const char *indent; /* NULL: one line */
    const char *item_sep, *key_sep;
} json_style;

static int json_str_escape(jinja_ctx *cx, jinja_buf *b, const char *p, size_t n)
{
    if (jinja_buf_put(cx, b, "\"", 1)) return -1;
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        const char *esc = NULL;
        char u[8];
        if (c == '"') esc = "\\\"";
        else if (c == '\\') esc = "\\\\";
        else if (c == '\n') esc = "\\n";
        else if (c == '\r') esc = "\\r";
        else if (c == '\t') esc = "\\t";
        else if (c == '\b') esc = "\\b";
        else if (c == '\f') esc = "\\f";
        else if (c < 0x20) snprintf(u, sizeof u, "\\u%04x", c), esc = u;
        if (!esc) continue;
        if (jinja_buf_put(cx, b, p + run, i - run) || jinja_buf_puts(cx, b, esc)) return -1;
        run = i + 1;
    }
    if (jinja_buf_put(cx, b, p + run, n - run)) return -1;
    return jinja_buf_put(cx, b, "\"", 1);
}

static int json_newline(jinja_ctx *cx, jinja_buf *b, const json_style *st, int level)
{
    if (!st->indent) return 0;
    if (jinja_buf_put(cx, b, "\n", 1)) return -1;
    for (int i = 0; i < level; i++)
        if (jinja_buf_puts(cx, b, st->indent)) return -1;
    return 0;
}

static int json_value(jinja_ctx *cx, jinja_buf *b, jinja_value v, const json_style *st, int level,
                      int line)
{
    char num[40];
    if (level > 200) return jinja_fail(cx, line, "tojson: value nested too deeply");
    switch (v.t) {
    case JINJA_NONE: return jinja_buf_puts(cx, b, "null");
    case JINJA_BOOL: return jinja_buf_puts(cx, b, v.u.b ? "true" : "false");
    case JINJA_INT: snprintf(num, sizeof num, "%lld", (long long)v.u.i); return jinja_buf_puts(cx, b, num);
    case JINJA_FLOAT:
        if (v.u.f != v.u.f) return jinja_buf_puts(cx, b, "NaN");
        if (v.u.f > 1.7976931348623157e308) return jinja_buf_puts(cx, b, "Infinity");
        if (v.u.f < -1.7976931348623157e308) return jinja_buf_puts(cx, b, "-Infinity");
        jinja_float_repr(v.u.f, num, sizeof num);
        return jinja_buf_puts(cx, b, num);
    case JINJA_STR: return json_str_escape(cx, b, v.u.s.p, v.u.s.n);
    case JINJA_LIST:
        if (v.u.l->n == 0) return jinja_buf_puts(cx, b, "[]");
        if (jinja_buf_puts(cx, b, "[")) return -1;
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i && jinja_buf_puts(cx, b, st->item_sep)) return -1;
            if (json_newline(cx, b, st, level + 1) || json_value(cx, b, v.u.l->v[i], st, level + 1, line))
                return -1;
        }
        if (json_newline(cx, b, st, level)) return -1;
        return jinja_buf_puts(cx, b, "]");
    case JINJA_DICT:
        if (v.u.d->n == 0) return jinja_buf_puts(cx, b, "{}");
        if (jinja_buf_puts(cx, b, "{")) return -1;
        for (size_t i = 0; i < v.u.d->n; i++) {
            jinja_value k = v.u.d->k[i];
            if (i && jinja_buf_puts(cx, b, st->item_sep)) return -1;
            if (json_newline(cx, b, st, level + 1)) return -1;
            if (k.t == JINJA_STR) {
                if (json_str_escape(cx, b, k.u.s.p, k.u.s.n)) return -1;
            } else { /* Python turns int/float/bool/None keys into strings */
                jinja_buf kb = {0};
                int rc = json_value(cx, &kb, k, st, level + 1, line);
                if (!rc) rc = json_str_escape(cx, b, kb.p, kb.n);
                free(kb.p);
                if (rc) return -1;
            }
            if (jinja_buf_puts(cx, b, st->key_sep) || json_value(cx, b, v.u.d->v[i], st, level + 1, line))
                return -1;
        }
        if (json_newline(cx, b, st, level)) return -1;
        return jinja_buf_puts(cx, b, "}");
    case JINJA_UNDEF: return jinja_fail(cx, line, "tojson: Object of type Undefined is not JSON serializable");
    default: return jinja_fail(cx, line, "tojson: value is not JSON serializable");
    }
}

static int tojson(jinja_ctx *cx, jinja_value v, const jinja_args *args, int line, jinja_value *out)
{
    const jinja_value *ind = arg(args, 0, "indent"), *seps = arg(args, 2, "separators");
    char spaces[64];
    json_style st = {NULL, ", ", ": "};
    if (ind && ind->t == JINJA_INT) {
        int64_t k = ind->u.i < 0 ? 0 : ind->u.i > 32 ? 32 : ind->u.i;
        memset(spaces, ' ', (size_t)k);
        spaces[k] = 0;
        st.indent = spaces;
    } else if (ind && ind->t == JINJA_STR) {
        snprintf(spaces, sizeof spaces, "%.*s", (int)ind->u.s.n, ind->u.s.p);
        st.indent = spaces;
    }
    if (st.indent) st.item_sep = ",";
    char sep0[16], sep1[16];
    if (seps && seps->t == JINJA_LIST && seps->u.l->n == 2 && seps->u.l->v[0].t == JINJA_STR &&
        seps->u.l->v[1].t == JINJA_STR) {
        snprintf(sep0, sizeof sep0, "%.*s", (int)seps->u.l->v[0].u.s.n, seps->u.l->v[0].u.s.p);
        snprintf(sep1, sizeof sep1, "%.*s", (int)seps->u.l->v[1].u.s.n, seps->u.l->v[1].u.s.p);
        st.item_sep = sep0;
        st.key_sep = sep1;
    }
    jinja_buf b = {0};
    if (json_value(cx, &b, v, &st, 0, line)) {
        free(b.p);
        return -1;
    }
    return buf_value(cx, &b, out);
}

/* ---- globals -------------------------------------------------------------------------- */

int jinja_add_globals(jinja_ctx *cx, jinja_frame *f)
{
    static const char *const names[] = {"raise_exception", "namespace", "range", "dict", "strftime_now"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        jinja_value fn = {.t = JINJA_FUNC, .u.s = {names[i], strlen(names[i])}};
        if (jinja_frame_set(cx, f, names[i], strlen(names[i]), fn)) return -1;
    }
    return 0;
}

int jinja_call_global(jinja_ctx *cx, jinja_str name, const jinja_args *args, int line, jinja_value *out)
{
    if (name_is(name, "raise_exception")) {
        jinja_value msg = {.t = JINJA_UNDEF};
        if (args->n && jinja_to_str(cx, args->v[0], &msg)) return -1;
        return jinja_fail(cx, line, "raise_exception: %.*s", (int)msg.u.s.n, msg.u.s.p ? msg.u.s.p : "");
    }
    if (name_is(name, "namespace") || name_is(name, "dict")) {
        bool ns = name_is(name, "namespace");
        *out = jinja_dict_new(cx, ns ? JINJA_NS : JINJA_DICT);
        if (cx->failed) return -1;
        for (size_t i = 0; i < args->n; i++) {
            if (args->v[i].t != JINJA_DICT && args->v[i].t != JINJA_NS)
                return jinja_fail(cx, line, "%.*s() expects keyword arguments or a dict", (int)name.n, name.p);
            for (size_t k = 0; k < args->v[i].u.d->n; k++)
                if (jinja_dict_set(cx, *out, args->v[i].u.d->k[k], args->v[i].u.d->v[k])) return -1;
        }
        for (size_t i = 0; i < args->nkw; i++) {
            if (ns && args->kwnames[i].n && args->kwnames[i].p[0] == '_')
                return jinja_fail(cx, line, "namespace attributes cannot start with '_'");
            if (jinja_dict_set(cx, *out, jinja_str_value(args->kwnames[i].p, args->kwnames[i].n), args->kw[i]))
                return -1;
        }
        return 0;
    }
    if (name_is(name, "range")) {
        int64_t a[3] = {0, 0, 1};
        if (args->n < 1 || args->n > 3) return jinja_fail(cx, line, "range() takes 1 to 3 arguments");
        for (size_t i = 0; i < args->n; i++) {
            if (args->v[i].t != JINJA_INT) return jinja_fail(cx, line, "range() expects integers");
            a[args->n == 1 ? 1 : i] = args->v[i].u.i;
        }
        if (a[2] == 0) return jinja_fail(cx, line, "range() step must not be zero");
        int64_t count = jinja_span_count(a[0], a[1], a[2]);
        if (count > 100000) return jinja_fail(cx, line, "range() too large");
        *out = jinja_list_new(cx, (size_t)count);
        for (int64_t i = 0; !cx->failed && i < count; i++) /* between a[0] and a[1]: no wrap */
            jinja_list_push(cx, *out, (jinja_value){
                .t = JINJA_INT, .u.i = (int64_t)((uint64_t)a[0] + (uint64_t)i * (uint64_t)a[2])});
        return cx->failed ? -1 : 0;
    }
    if (name_is(name, "strftime_now")) {
        const jinja_value *fmt = arg(args, 0, "format");
        if (need_str(cx, fmt, line, "strftime_now")) return -1;
        char f[128], res[256];
        snprintf(f, sizeof f, "%.*s", (int)fmt->u.s.n, fmt->u.s.p);
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        size_t n = strftime(res, sizeof res, f, &tm);
        char *p = jinja_arena_strdup(cx->a, res, n);
        if (!p) return jinja_oom(cx);
        *out = jinja_str_value(p, n);
        return 0;
    }
    return jinja_fail(cx, line, "unknown function '%.*s'", (int)name.n, name.p);
}

/* ---- methods -------------------------------------------------------------------------- */

static int str_method(jinja_ctx *cx, jinja_value s, jinja_str name, const jinja_args *args, int line,
                      jinja_value *out)
{
    const jinja_value *a0 = arg(args, 0, "chars");
    if (name_is(name, "strip") || name_is(name, "lstrip") || name_is(name, "rstrip")) {
        int which = name.p[0] == 'l' ? 1 : name.p[0] == 'r' ? 2 : 3;
        if (a0 && a0->t != JINJA_STR && a0->t != JINJA_NONE) return need_str(cx, NULL, line, "strip");
        *out = strip(s, a0, which);
        return 0;
    }
    if (name_is(name, "startswith") || name_is(name, "endswith")) {
        bool suffix = name.p[0] == 'e';
        a0 = arg(args, 0, "prefix");
        bool r = false;
        if (a0 && a0->t == JINJA_LIST) {
            for (size_t i = 0; i < a0->u.l->n && !r; i++) r = has_prefix(s, a0->u.l->v[i], suffix);
        } else {
            if (need_str(cx, a0, line, suffix ? "endswith" : "startswith")) return -1;
            r = has_prefix(s, *a0, suffix);
        }
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = r};
        return 0;
    }
    if (name_is(name, "split")) {
        const jinja_value *sep = arg(args, 0, "sep"), *maxs = arg(args, 1, "maxsplit");
        if (sep && sep->t != JINJA_STR && sep->t != JINJA_NONE) return need_str(cx, NULL, line, "split");
        return str_split(cx, s, sep, maxs && maxs->t == JINJA_INT ? maxs->u.i : -1, line, out);
    }
    if (name_is(name, "replace")) {
        const jinja_value *from = arg(args, 0, "old"), *to = arg(args, 1, "new"), *cnt = arg(args, 2, "count");
        if (need_str(cx, from, line, "replace") || need_str(cx, to, line, "replace")) return -1;
        return str_replace(cx, s, *from, *to, cnt && cnt->t == JINJA_INT ? cnt->u.i : -1, out);
    }
    if (name_is(name, "lower")) return str_case(cx, s, 0, out);
    if (name_is(name, "upper")) return str_case(cx, s, 1, out);
    if (name_is(name, "capitalize")) {
        if (str_case(cx, s, 0, out)) return -1;
        if (out->u.s.n && out->u.s.p[0] >= 'a' && out->u.s.p[0] <= 'z') ((char *)out->u.s.p)[0] &= ~0x20;
        return 0;
    }
    if (name_is(name, "title")) return str_case(cx, s, 3, out);
    if (name_is(name, "find") || name_is(name, "count") || name_is(name, "index")) {
        a0 = arg(args, 0, "sub");
        if (need_str(cx, a0, line, "find")) return -1;
        const char *hit = memmem(s.u.s.p, s.u.s.n, a0->u.s.p, a0->u.s.n);
        if (name.p[0] == 'c') {
            int64_t k = 0;
            for (const char *p = s.u.s.p, *e = p + s.u.s.n; a0->u.s.n && (hit = memmem(p, (size_t)(e - p), a0->u.s.p, a0->u.s.n)); p = hit + a0->u.s.n) k++;
            *out = (jinja_value){.t = JINJA_INT, .u.i = a0->u.s.n ? k : (int64_t)jinja_utf8_len(s.u.s.p, s.u.s.n) + 1};
            return 0;
        }
        if (!hit && name.p[0] == 'i') return jinja_fail(cx, line, "substring not found");
        *out = (jinja_value){.t = JINJA_INT, .u.i = hit ? (int64_t)jinja_utf8_len(s.u.s.p, (size_t)(hit - s.u.s.p)) : -1};
        return 0;
    }
    if (name_is(name, "join")) {
        jinja_value r;
        if (!args->n) return jinja_fail(cx, line, "join() takes one argument");
        jinja_args fa = {.v = {s}, .n = 1};
        return jinja_apply_filter(cx, (jinja_str){"join", 4}, args->v[0], &fa, line, &r) ? -1 : (*out = r, 0);
    }
    if (name_is(name, "isdigit") || name_is(name, "isspace") || name_is(name, "isalpha") || name_is(name, "isalnum")) {
        bool r = s.u.s.n > 0;
        for (size_t i = 0; i < s.u.s.n && r; i++) {
            unsigned char c = (unsigned char)s.u.s.p[i];
            bool d = c >= '0' && c <= '9', a = (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
            r = name.p[2] == 'd' ? d : name.p[2] == 's' ? py_space(c) : name.p[4] == 'a' && name.n == 7 ? a : (a || d);
        }
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = r};
        return 0;
    }
    return 1;
}

int jinja_call_method(jinja_ctx *cx, jinja_value obj, jinja_str name, const jinja_args *args, int line,
                      jinja_value *out)
{
    if (obj.t == JINJA_STR) return str_method(cx, obj, name, args, line, out);
    if (obj.t == JINJA_DICT) {
        struct jinja_dict *d = obj.u.d;
        if (name_is(name, "items") || name_is(name, "keys") || name_is(name, "values")) {
            *out = jinja_list_new(cx, d->n);
            if (cx->failed) return -1;
            for (size_t i = 0; i < d->n; i++) {
                jinja_value item = name.p[0] == 'k' ? d->k[i] : d->v[i];
                if (name.p[0] == 'i') {
                    item = jinja_list_new(cx, 2);
                    if (!cx->failed) item.u.l->tuple = true;
                    if (cx->failed || jinja_list_push(cx, item, d->k[i]) || jinja_list_push(cx, item, d->v[i]))
                        return -1;
                }
                if (jinja_list_push(cx, *out, item)) return -1;
            }
            return 0;
        }
        if (name_is(name, "get")) {
            const jinja_value *k = arg(args, 0, "key"), *def = arg(args, 1, "default");
            if (!k) return jinja_fail(cx, line, "get() takes a key");
            jinja_value *v = jinja_dict_find(d, *k);
            *out = v ? *v : def ? *def : (jinja_value){.t = JINJA_NONE};
            return 0;
        }
        if (name_is(name, "cycle") && jinja_dict_findstr(d, "index0", 6) && !jinja_dict_findstr(d, "cycle", 5)) {
            if (!args->n) return jinja_fail(cx, line, "loop.cycle() needs arguments");
            *out = args->v[jinja_dict_findstr(d, "index0", 6)->u.i % (int64_t)args->n];
            return 0;
        }
    }
    if (obj.t == JINJA_LIST && (name_is(name, "index") || name_is(name, "count"))) {
        const jinja_value *x = arg(args, 0, "value");
        if (!x) return jinja_fail(cx, line, "%.*s() takes one argument", (int)name.n, name.p);
        int64_t k = 0, first = -1;
        for (size_t i = 0; i < obj.u.l->n; i++)
            if (jinja_equal(obj.u.l->v[i], *x)) k++, first = first < 0 ? (int64_t)i : first;
        if (name.p[0] == 'i' && first < 0) return jinja_fail(cx, line, "value is not in list");
        *out = (jinja_value){.t = JINJA_INT, .u.i = name.p[0] == 'i' ? first : k};
        return 0;
    }
    return 1;
}

/* ---- filters -------------------------------------------------------------------------- */

/* obj.attr.sub, with digit parts as indices (jinja's attribute= paths). */
static int get_path(jinja_ctx *cx, jinja_value obj, jinja_value path, int line, jinja_value *out)
{
    if (path.t != JINJA_STR) return jinja_getitem(cx, obj, path, line, out);
    const char *p = path.u.s.p, *end = p + path.u.s.n;
    *out = obj;
    while (p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        if (!dot) dot = end;
        jinja_value key = jinja_str_value(p, (size_t)(dot - p));
        bool digits = dot > p;
        for (const char *q = p; q < dot; q++) digits = digits && *q >= '0' && *q <= '9';
        if (digits) key = (jinja_value){.t = JINJA_INT, .u.i = strtoll(p, NULL, 10)};
        if (out->t == JINJA_UNDEF) return 0;
        if (jinja_getitem(cx, *out, key, line, out)) return -1;
        p = dot + 1;
    }
    return 0;
}

static int to_list(jinja_ctx *cx, jinja_value v, int line, jinja_value *out)
{
    if (v.t == JINJA_LIST) {
        *out = v;
        return 0;
    }
    jinja_args none = {0};
    return jinja_apply_filter(cx, (jinja_str){"list", 4}, v, &none, line, out);
}

/* select/reject/selectattr/rejectattr */
static int select_filter(jinja_ctx *cx, jinja_value seq, const jinja_args *args, bool attr, bool keep,
                         int line, jinja_value *out)
{
    jinja_value list;
    if (to_list(cx, seq, line, &list)) return -1;
    size_t first_test = attr ? 1 : 0;
    if (attr && !args->n) return jinja_fail(cx, line, "selectattr needs an attribute name");
    jinja_args targs = {.kwnames = args->kwnames, .nkw = 0};
    for (size_t i = first_test + 1; i < args->n; i++) targs.v[targs.n++] = args->v[i];
    *out = jinja_list_new(cx, 0);
    if (cx->failed) return -1;
    for (size_t i = 0; i < list.u.l->n; i++) {
        jinja_value x = list.u.l->v[i], probe = x;
        bool r;
        if (attr && get_path(cx, x, args->v[0], line, &probe)) return -1;
        if (args->n > first_test) {
            if (args->v[first_test].t != JINJA_STR) return jinja_fail(cx, line, "test name must be a string");
            jinja_str tn = {args->v[first_test].u.s.p, args->v[first_test].u.s.n};
            if (jinja_apply_test(cx, tn, probe, &targs, line, &r)) return -1;
        } else {
            r = jinja_truthy(probe);
        }
        if (r == keep && jinja_list_push(cx, *out, x)) return -1;
    }
    return 0;
}

static int join_filter(jinja_ctx *cx, jinja_value v, const jinja_args *args, int line, jinja_value *out)
{
    const jinja_value *sep = arg(args, 0, "d"), *attr = arg(args, 1, "attribute");
    jinja_value list;
    if (to_list(cx, v, line, &list)) return -1;
    jinja_buf b = {0};
    int rc = 0;
    for (size_t i = 0; !rc && i < list.u.l->n; i++) {
        jinja_value x = list.u.l->v[i];
        if (attr) rc = get_path(cx, x, *attr, line, &x);
        if (!rc && i && sep) rc = jinja_write_str(cx, &b, *sep, false);
        if (!rc) rc = jinja_write_str(cx, &b, x, false);
    }
    if (rc) {
        free(b.p);
        return -1;
    }
    return buf_value(cx, &b, out);
}

static int indent_filter(jinja_ctx *cx, jinja_value v, const jinja_args *args, int line, jinja_value *out)
{
    const jinja_value *w = arg(args, 0, "width"), *first = arg(args, 1, "first"), *blank = arg(args, 2, "blank");
    jinja_value s, pad = jinja_str_value("    ", 4);
    if (jinja_to_str(cx, v, &s)) return -1;
    char spaces[65];
    if (w && w->t == JINJA_INT) {
        int64_t k = w->u.i < 0 ? 0 : w->u.i > 64 ? 64 : w->u.i;
        memset(spaces, ' ', (size_t)k);
        pad = jinja_str_value(spaces, (size_t)k);
    } else if (w && w->t == JINJA_STR) {
        pad = *w;
    }
    /* jinja2: s + "\n" split into lines; later lines padded unless empty (or blank=True) */
    bool pad_blank = blank && jinja_truthy(*blank);
    jinja_buf b = {0};
    int rc = 0;
    if (first && jinja_truthy(*first)) rc = jinja_buf_put(cx, &b, pad.u.s.p, pad.u.s.n);
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    for (bool first_line = true; !rc && p < end; first_line = false) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        if (!first_line) {
            rc = jinja_buf_put(cx, &b, "\n", 1);
            if (!rc && (le > p || pad_blank)) rc = jinja_buf_put(cx, &b, pad.u.s.p, pad.u.s.n);
        }
        if (!rc) rc = jinja_buf_put(cx, &b, p, (size_t)(le - p));
        p = nl ? nl + 1 : end;
    }
    if (rc) {
        free(b.p);
        return -1;
    }
    return buf_value(cx, &b, out);
}

int jinja_apply_filter(jinja_ctx *cx, jinja_str name, jinja_value v, const jinja_args *args, int line,
                       jinja_value *out)
{
    if (name_is(name, "default") || name_is(name, "d")) {
        const jinja_value *def = arg(args, 0, "default_value"), *boolean = arg(args, 1, "boolean");
        bool use = v.t == JINJA_UNDEF || (boolean && jinja_truthy(*boolean) && !jinja_truthy(v));
        *out = use ? (def ? *def : jinja_str_value("", 0)) : v;
        return 0;
    }
    if (name_is(name, "length") || name_is(name, "count")) {
        int64_t n;
        switch (v.t) {
        case JINJA_UNDEF: n = 0; break;
        case JINJA_STR: n = (int64_t)jinja_utf8_len(v.u.s.p, v.u.s.n); break;
        case JINJA_LIST: n = (int64_t)v.u.l->n; break;
        case JINJA_DICT:
        case JINJA_NS: n = (int64_t)v.u.d->n; break;
        default: return jinja_fail(cx, line, "object has no length");
        }
        *out = (jinja_value){.t = JINJA_INT, .u.i = n};
        return 0;
    }
    if (name_is(name, "tojson")) return tojson(cx, v, args, line, out);
    if (name_is(name, "string")) return jinja_to_str(cx, v, out);
    if (name_is(name, "safe")) {
        *out = v;
        return 0;
    }
    if (name_is(name, "items")) {
        if (v.t == JINJA_UNDEF) {
            *out = jinja_list_new(cx, 0);
            return cx->failed ? -1 : 0;
        }
        if (v.t != JINJA_DICT && v.t != JINJA_NS) return jinja_fail(cx, line, "items filter expects a mapping");
        jinja_value d = v;
        d.t = JINJA_DICT;
        return jinja_call_method(cx, d, (jinja_str){"items", 5}, args, line, out);
    }
    if (name_is(name, "list")) {
        if (v.t == JINJA_LIST) { /* a copy, as list() makes */
            *out = jinja_list_new(cx, v.u.l->n);
            for (size_t i = 0; !cx->failed && i < v.u.l->n; i++) jinja_list_push(cx, *out, v.u.l->v[i]);
            return cx->failed ? -1 : 0;
        }
        if (v.t == JINJA_UNDEF || v.t == JINJA_STR || v.t == JINJA_DICT) {
            jinja_value it = v;
            if (v.t == JINJA_UNDEF) {
                *out = jinja_list_new(cx, 0);
                return cx->failed ? -1 : 0;
            }
            if (v.t == JINJA_DICT) return jinja_call_method(cx, it, (jinja_str){"keys", 4}, args, line, out);
            size_t ncp = jinja_utf8_len(v.u.s.p, v.u.s.n), off = 0;
            *out = jinja_list_new(cx, ncp);
            for (size_t i = 0; !cx->failed && i < ncp; i++) {
                size_t e = off + 1;
                while (e < v.u.s.n && ((unsigned char)v.u.s.p[e] & 0xc0) == 0x80) e++;
                jinja_list_push(cx, *out, jinja_str_value(v.u.s.p + off, e - off));
                off = e;
            }
            return cx->failed ? -1 : 0;
        }
        return jinja_fail(cx, line, "value is not iterable");
    }
    if (name_is(name, "first") || name_is(name, "last")) {
        jinja_value list;
        if (to_list(cx, v, line, &list)) return -1;
        *out = (jinja_value){.t = JINJA_UNDEF};
        if (list.u.l->n) *out = list.u.l->v[name.p[0] == 'f' ? 0 : list.u.l->n - 1];
        return 0;
    }
    if (name_is(name, "reverse")) {
        jinja_value list;
        if (to_list(cx, v, line, &list)) return -1;
        jinja_value r = jinja_list_new(cx, list.u.l->n);
        for (size_t i = list.u.l->n; !cx->failed && i-- > 0;) jinja_list_push(cx, r, list.u.l->v[i]);
        if (cx->failed) return -1;
        if (v.t != JINJA_STR) {
            *out = r;
            return 0;
        }
        jinja_args none = {0};
        return join_filter(cx, r, &none, line, out);
    }
    if (name_is(name, "join")) return join_filter(cx, v, args, line, out);
    if (name_is(name, "trim") || name_is(name, "lower") || name_is(name, "upper") ||
        name_is(name, "capitalize") || name_is(name, "title") || name_is(name, "replace")) {
        jinja_value s;
        if (jinja_to_str(cx, v, &s)) return -1;
        if (name_is(name, "trim")) {
            const jinja_value *chars = arg(args, 0, "chars");
            *out = strip(s, chars, 3);
            return 0;
        }
        if (name_is(name, "replace")) {
            const jinja_value *from = arg(args, 0, "old"), *to = arg(args, 1, "new"), *cnt = arg(args, 2, "count");
            jinja_value fs, ts;
            if (!from || !to) return jinja_fail(cx, line, "replace needs two arguments");
            if (jinja_to_str(cx, *from, &fs) || jinja_to_str(cx, *to, &ts)) return -1;
            return str_replace(cx, s, fs, ts, cnt && cnt->t == JINJA_INT ? cnt->u.i : -1, out);
        }
        return str_method(cx, s, name, args, line, out);
    }
    if (name_is(name, "indent")) return indent_filter(cx, v, args, line, out);
    if (name_is(name, "int") || name_is(name, "float")) {
        bool want_int = name.p[0] == 'i';
        const jinja_value *def = arg(args, 0, "default");
        jinja_value d = def ? *def : want_int ? (jinja_value){.t = JINJA_INT} : (jinja_value){.t = JINJA_FLOAT};
        double x;
        if (v.t == JINJA_INT || v.t == JINJA_FLOAT || v.t == JINJA_BOOL) {
            x = jinja_num(v);
        } else if (v.t == JINJA_STR) {
            char buf[64], *end;
            snprintf(buf, sizeof buf, "%.*s", (int)v.u.s.n, v.u.s.p);
            x = strtod(buf, &end);
            if (end == buf || *end) {
                *out = d;
                return 0;
            }
        } else {
            *out = d;
            return 0;
        }
        /* an integer past int64 (or NaN) is not representable here: the default, as Jinja
         * gives for a value int() refuses */
        if (want_int && !(x > -9223372036854775808.0 && x < 9223372036854775808.0)) {
            *out = d;
            return 0;
        }
        *out = want_int ? (jinja_value){.t = JINJA_INT, .u.i = (int64_t)x} : (jinja_value){.t = JINJA_FLOAT, .u.f = x};
        if (want_int && v.t == JINJA_INT) *out = v;
        return 0;
    }
    if (name_is(name, "abs")) {
        if (v.t == JINJA_INT && v.u.i == INT64_MIN) /* -INT64_MIN overflows: Python's value */
            *out = (jinja_value){.t = JINJA_FLOAT, .u.f = 9223372036854775808.0};
        else if (v.t == JINJA_INT) *out = (jinja_value){.t = JINJA_INT, .u.i = v.u.i < 0 ? -v.u.i : v.u.i};
        else if (v.t == JINJA_FLOAT) *out = (jinja_value){.t = JINJA_FLOAT, .u.f = v.u.f < 0 ? -v.u.f : v.u.f};
        else return jinja_fail(cx, line, "abs expects a number");
        return 0;
    }
    if (name_is(name, "select") || name_is(name, "reject"))
        return select_filter(cx, v, args, false, name.p[0] == 's', line, out);
    if (name_is(name, "selectattr") || name_is(name, "rejectattr"))
        return select_filter(cx, v, args, true, name.p[0] == 's', line, out);
    if (name_is(name, "map")) {
        jinja_value list;
        const jinja_value *attr = kwarg(args, "attribute"), *def = kwarg(args, "default");
        if (to_list(cx, v, line, &list)) return -1;
        *out = jinja_list_new(cx, list.u.l->n);
        if (cx->failed) return -1;
        jinja_args fargs = {0};
        for (size_t i = 1; i < args->n; i++) fargs.v[fargs.n++] = args->v[i];
        if (!attr && (!args->n || args->v[0].t != JINJA_STR)) return jinja_fail(cx, line, "map needs a filter name or attribute=");
        for (size_t i = 0; i < list.u.l->n; i++) {
            jinja_value x;
            if (attr) {
                if (get_path(cx, list.u.l->v[i], *attr, line, &x)) return -1;
                if (x.t == JINJA_UNDEF && def) x = *def;
            } else if (jinja_apply_filter(cx, (jinja_str){args->v[0].u.s.p, args->v[0].u.s.n}, list.u.l->v[i], &fargs, line, &x)) {
                return -1;
            }
            if (jinja_list_push(cx, *out, x)) return -1;
        }
        return 0;
    }
    if (name_is(name, "unique")) {
        jinja_value list;
        if (to_list(cx, v, line, &list)) return -1;
        *out = jinja_list_new(cx, list.u.l->n);
        for (size_t i = 0; !cx->failed && i < list.u.l->n; i++) {
            bool seen;
            if (jinja_contains(cx, *out, list.u.l->v[i], line, &seen)) return -1;
            if (!seen) jinja_list_push(cx, *out, list.u.l->v[i]);
        }
        return cx->failed ? -1 : 0;
    }
    if (name_is(name, "escape") || name_is(name, "e") || name_is(name, "forceescape")) {
        jinja_value s;
        if (jinja_to_str(cx, v, &s)) return -1;
        jinja_buf b = {0};
        int rc = jinja_buf_put(cx, &b, "", 0);
        for (size_t i = 0; !rc && i < s.u.s.n; i++) {
            char c = s.u.s.p[i];
            const char *r = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;" : c == '\'' ? "&#39;" : NULL;
            rc = r ? jinja_buf_puts(cx, &b, r) : jinja_buf_put(cx, &b, &c, 1);
        }
        if (rc) {
            free(b.p);
            return -1;
        }
        return buf_value(cx, &b, out);
    }
    return jinja_fail(cx, line, "unknown filter '%.*s'", (int)name.n, name.p);
}

/* ---- tests ---------------------------------------------------------------------------- */

int jinja_apply_test(jinja_ctx *cx, jinja_str name, jinja_value v, const jinja_args *args, int line, bool *out)
{
    const jinja_value *a0 = args->n ? &args->v[0] : NULL;
    int cmp;
    if (name_is(name, "defined")) *out = v.t != JINJA_UNDEF;
    else if (name_is(name, "undefined")) *out = v.t == JINJA_UNDEF;
    else if (name_is(name, "none")) *out = v.t == JINJA_NONE;
    else if (name_is(name, "boolean")) *out = v.t == JINJA_BOOL;
    else if (name_is(name, "true")) *out = v.t == JINJA_BOOL && v.u.b;
    else if (name_is(name, "false")) *out = v.t == JINJA_BOOL && !v.u.b;
    else if (name_is(name, "integer")) *out = v.t == JINJA_INT;
    else if (name_is(name, "float")) *out = v.t == JINJA_FLOAT;
    else if (name_is(name, "number")) *out = v.t == JINJA_INT || v.t == JINJA_FLOAT || v.t == JINJA_BOOL;
    else if (name_is(name, "string")) *out = v.t == JINJA_STR;
    else if (name_is(name, "mapping")) *out = v.t == JINJA_DICT;
    else if (name_is(name, "sequence")) *out = v.t == JINJA_STR || v.t == JINJA_LIST || v.t == JINJA_DICT;
    else if (name_is(name, "iterable")) *out = v.t == JINJA_STR || v.t == JINJA_LIST || v.t == JINJA_DICT || v.t == JINJA_UNDEF;
    else if (name_is(name, "callable")) *out = v.t == JINJA_MACRO || v.t == JINJA_FUNC;
    else if (name_is(name, "odd") || name_is(name, "even")) {
        if (v.t != JINJA_INT) return jinja_fail(cx, line, "%.*s test expects an integer", (int)name.n, name.p);
        *out = ((v.u.i % 2) != 0) == (name.p[0] == 'o');
    } else if (name_is(name, "divisibleby")) {
        if (v.t != JINJA_INT || !a0 || a0->t != JINJA_INT || a0->u.i == 0)
            return jinja_fail(cx, line, "divisibleby expects integers");
        *out = v.u.i % a0->u.i == 0;
    } else if (name_is(name, "lower") || name_is(name, "upper")) {
        if (v.t != JINJA_STR) {
            *out = false;
            return 0;
        }
        bool any = false, ok = true;
        for (size_t i = 0; i < v.u.s.n; i++) {
            char c = v.u.s.p[i];
            if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
                any = true;
                ok = ok && (name.p[0] == 'l' ? (c >= 'a' && c <= 'z') : (c >= 'A' && c <= 'Z'));
            }
        }
        *out = any && ok;
    } else if (name_is(name, "in")) {
        if (!a0) return jinja_fail(cx, line, "in test needs an argument");
        return jinja_contains(cx, *a0, v, line, out);
    } else if (name_is(name, "sameas")) {
        if (!a0) return jinja_fail(cx, line, "sameas test needs an argument");
        *out = v.t == a0->t && (v.t == JINJA_NONE || v.t == JINJA_UNDEF ||
                                (v.t == JINJA_BOOL && v.u.b == a0->u.b) || (v.t == JINJA_INT && v.u.i == a0->u.i) ||
                                ((v.t == JINJA_LIST || v.t == JINJA_DICT || v.t == JINJA_NS) && v.u.d == a0->u.d));
    } else if (name_is(name, "eq") || name_is(name, "equalto") || name_is(name, "==") ||
               name_is(name, "ne") || name_is(name, "!=")) {
        if (!a0) return jinja_fail(cx, line, "comparison test needs an argument");
        *out = jinja_equal(v, *a0) == (name.p[0] != 'n' && name.p[0] != '!');
    } else if (name_is(name, "lt") || name_is(name, "lessthan") || name_is(name, "le") ||
               name_is(name, "gt") || name_is(name, "greaterthan") || name_is(name, "ge")) {
        if (!a0) return jinja_fail(cx, line, "comparison test needs an argument");
        if (jinja_compare(cx, v, *a0, line, &cmp)) return -1;
        bool lt = name.p[0] == 'l', eq = name.n == 2 && name.p[1] == 'e';
        *out = lt ? (eq ? cmp <= 0 : cmp < 0) : (eq ? cmp >= 0 : cmp > 0);
    } else if (name_is(name, "escaped")) {
        *out = false;
    } else {
        return jinja_fail(cx, line, "unknown test '%.*s'", (int)name.n, name.p);
    }
    return 0;
}
