/* Jinja evaluator: walks the tree jinja_parse.c builds and writes the output, with Python's
 * semantics where templates can see them (str() of values, truthiness, == across int/float,
 * negative indices and slices, json.dumps for tojson) and jinja2's Undefined (prints as "",
 * iterates as empty, fails on arithmetic and attribute access). Filters, tests and methods live
 * in jinja_builtins.c. Also holds the arena and the public chat entry points. */
#include "jinja.h"
#include "jinja_eval.h"

#include "common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ---------------------------------------------------------------------------- */

struct jinja_chunk {
    struct jinja_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *jinja_arena_alloc(jinja_arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (a->limit && (n > a->limit || a->total > a->limit - n)) return NULL;
    a->total += n;
    struct jinja_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 60000 ? n : 60000;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *jinja_arena_strdup(jinja_arena *a, const char *s, size_t n)
{
    char *p = jinja_arena_alloc(a, n + 1);
    if (p) {
        if (n) memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

void jinja_arena_free(jinja_arena *a)
{
    struct jinja_chunk *c = a->head;
    while (c) {
        struct jinja_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---- errors, buffers, frames ---------------------------------------------------------- */

int jinja_fail(jinja_ctx *cx, int line, const char *fmt, ...)
{
    if (cx->failed) return -1; /* keep the first, innermost reason */
    cx->failed = true;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0) return ms_errf(cx->err, cx->errlen, "template line %d: %s", line, msg);
    return ms_errf(cx->err, cx->errlen, "%s", msg);
}

int jinja_step(jinja_ctx *cx, int line)
{
    if (++cx->steps <= JINJA_MAX_STEPS) return 0;
    return jinja_fail(cx, line, "the template runs too long (over %d loop iterations and macro calls)",
                      JINJA_MAX_STEPS);
}

int jinja_oom(jinja_ctx *cx)
{
    return jinja_fail(cx, 0, "out of memory (a render may use at most %d MiB)",
                      JINJA_MAX_RENDER_BYTES >> 20);
}

int jinja_buf_put(jinja_ctx *cx, jinja_buf *b, const char *p, size_t n)
{
    if (b->n + n + 1 > JINJA_MAX_RENDER_BYTES / 4)
        return jinja_fail(cx, 0, "text too long (over %d MiB)", JINJA_MAX_RENDER_BYTES >> 22);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) return jinja_oom(cx);
        b->p = np;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int jinja_buf_puts(jinja_ctx *cx, jinja_buf *b, const char *s)
{
    return jinja_buf_put(cx, b, s, strlen(s));
}

jinja_value jinja_str_value(const char *p, size_t n)
{
    return (jinja_value){.t = JINJA_STR, .u.s = {p, n}};
}

/* Copies a buffer's bytes into the arena as a string value. */
static int buf_to_value(jinja_ctx *cx, const jinja_buf *b, jinja_value *out)
{
    char *p = jinja_arena_strdup(cx->a, b->p ? b->p : "", b->n);
    if (!p) return jinja_oom(cx);
    *out = jinja_str_value(p, b->n);
    return 0;
}

jinja_frame *jinja_frame_new(jinja_ctx *cx, jinja_frame *parent)
{
    jinja_frame *f = jinja_arena_alloc(cx->a, sizeof *f);
    if (!f) jinja_oom(cx);
    else f->parent = parent;
    return f;
}

static bool str_eq(const char *p, size_t n, const char *q, size_t m)
{
    return n == m && memcmp(p, q, n) == 0;
}

int jinja_frame_set(jinja_ctx *cx, jinja_frame *f, const char *name, size_t n, jinja_value v)
{
    for (size_t i = 0; i < f->n; i++)
        if (str_eq(f->names[i].p, f->names[i].n, name, n)) {
            f->vals[i] = v;
            return 0;
        }
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 8;
        jinja_str *nn = jinja_arena_alloc(cx->a, cap * sizeof *nn);
        jinja_value *nv = jinja_arena_alloc(cx->a, cap * sizeof *nv);
        if (!nn || !nv) return jinja_oom(cx);
        if (f->n) memcpy(nn, f->names, f->n * sizeof *nn), memcpy(nv, f->vals, f->n * sizeof *nv);
        f->names = nn;
        f->vals = nv;
        f->cap = cap;
    }
    f->names[f->n] = (jinja_str){name, n};
    f->vals[f->n++] = v;
    return 0;
}

static bool frame_get(const jinja_frame *f, const char *name, size_t n, jinja_value *out)
{
    for (; f; f = f->parent)
        for (size_t i = f->n; i-- > 0;)
            if (str_eq(f->names[i].p, f->names[i].n, name, n)) {
                *out = f->vals[i];
                return true;
            }
    return false;
}

/* ---- containers ----------------------------------------------------------------------- */

jinja_value jinja_list_new(jinja_ctx *cx, size_t cap)
{
    struct jinja_list *l = jinja_arena_alloc(cx->a, sizeof *l);
    if (l && cap) l->v = jinja_arena_alloc(cx->a, cap * sizeof *l->v);
    if (!l || (cap && !l->v)) {
        jinja_oom(cx);
        return (jinja_value){.t = JINJA_UNDEF};
    }
    l->cap = cap;
    return (jinja_value){.t = JINJA_LIST, .u.l = l};
}

/* Records that container c (depth *depth, *has_ns) takes v; fails past the depth limit. */
static int take_child(jinja_ctx *cx, int *depth, bool *has_ns, jinja_value v)
{
    int d = 0;
    bool ns = v.t == JINJA_NS;
    if (v.t == JINJA_LIST) {
        d = v.u.l->depth;
        ns = v.u.l->has_ns;
    } else if (v.t == JINJA_DICT || v.t == JINJA_NS) {
        d = v.u.d->depth;
        ns = ns || v.u.d->has_ns;
    }
    if (d + 1 > JINJA_MAX_VALUE_DEPTH)
        return jinja_fail(cx, 0, "values nested deeper than %d levels", JINJA_MAX_VALUE_DEPTH);
    if (d + 1 > *depth) *depth = d + 1;
    *has_ns = *has_ns || ns;
    return 0;
}

int jinja_list_push(jinja_ctx *cx, jinja_value list, jinja_value v)
{
    struct jinja_list *l = list.u.l;
    if (take_child(cx, &l->depth, &l->has_ns, v) < 0) return -1;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        jinja_value *nv = jinja_arena_alloc(cx->a, cap * sizeof *nv);
        if (!nv) return jinja_oom(cx);
        if (l->n) memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
    return 0;
}

jinja_value jinja_dict_new(jinja_ctx *cx, jinja_type t)
{
    struct jinja_dict *d = jinja_arena_alloc(cx->a, sizeof *d);
    if (!d) {
        jinja_oom(cx);
        return (jinja_value){.t = JINJA_UNDEF};
    }
    return (jinja_value){.t = t, .u.d = d};
}

jinja_value *jinja_dict_find(const struct jinja_dict *d, jinja_value key)
{
    for (size_t i = 0; i < d->n; i++)
        if (jinja_equal(d->k[i], key)) return &d->v[i];
    return NULL;
}

jinja_value *jinja_dict_findstr(const struct jinja_dict *d, const char *key, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JINJA_STR && str_eq(d->k[i].u.s.p, d->k[i].u.s.n, key, n)) return &d->v[i];
    return NULL;
}

int jinja_dict_set(jinja_ctx *cx, jinja_value dict, jinja_value key, jinja_value v)
{
    struct jinja_dict *d = dict.u.d;
    /* a namespace changes after it is made: one inside another could make a cycle */
    if (dict.t == JINJA_NS && (v.t == JINJA_NS || ((v.t == JINJA_LIST && v.u.l->has_ns) ||
                                                  (v.t == JINJA_DICT && v.u.d->has_ns))))
        return jinja_fail(cx, 0, "a namespace cannot hold a namespace");
    if (take_child(cx, &d->depth, &d->has_ns, key) < 0 ||
        take_child(cx, &d->depth, &d->has_ns, v) < 0)
        return -1;
    jinja_value *slot = jinja_dict_find(d, key);
    if (slot) {
        *slot = v;
        return 0;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        jinja_value *nk = jinja_arena_alloc(cx->a, cap * sizeof *nk);
        jinja_value *nv = jinja_arena_alloc(cx->a, cap * sizeof *nv);
        if (!nk || !nv) return jinja_oom(cx);
        if (d->n) memcpy(nk, d->k, d->n * sizeof *nk), memcpy(nv, d->v, d->n * sizeof *nv);
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = key;
    d->v[d->n++] = v;
    return 0;
}

/* ---- Python semantics ----------------------------------------------------------------- */

bool jinja_truthy(jinja_value v)
{
    switch (v.t) {
    case JINJA_UNDEF:
    case JINJA_NONE: return false;
    case JINJA_BOOL: return v.u.b;
    case JINJA_INT: return v.u.i != 0;
    case JINJA_FLOAT: return v.u.f != 0.0;
    case JINJA_STR: return v.u.s.n != 0;
    case JINJA_LIST: return v.u.l->n != 0;
    case JINJA_DICT: return v.u.d->n != 0;
    default: return true;
    }
}

static bool is_num(jinja_value v)
{
    return v.t == JINJA_INT || v.t == JINJA_FLOAT || v.t == JINJA_BOOL;
}

double jinja_num(jinja_value v)
{
    return v.t == JINJA_FLOAT ? v.u.f : v.t == JINJA_BOOL ? (double)v.u.b : (double)v.u.i;
}

static int64_t as_int(jinja_value v)
{
    return v.t == JINJA_BOOL ? (int64_t)v.u.b : v.u.i;
}

bool jinja_equal(jinja_value a, jinja_value b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != JINJA_FLOAT && b.t != JINJA_FLOAT) return as_int(a) == as_int(b);
        return jinja_num(a) == jinja_num(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case JINJA_UNDEF:
    case JINJA_NONE: return true;
    case JINJA_STR: return str_eq(a.u.s.p, a.u.s.n, b.u.s.p, b.u.s.n);
    case JINJA_LIST:
        if (a.u.l->n != b.u.l->n) return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jinja_equal(a.u.l->v[i], b.u.l->v[i])) return false;
        return true;
    case JINJA_DICT:
        if (a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            jinja_value *o = jinja_dict_find(b.u.d, a.u.d->k[i]);
            if (!o || !jinja_equal(a.u.d->v[i], *o)) return false;
        }
        return true;
    default: return a.u.d == b.u.d;
    }
}

/* Python's repr(float): the shortest digits that read back as the same double. */
void jinja_float_repr(double x, char *out, size_t outlen)
{
    if (x != x) {
        snprintf(out, outlen, "nan");
        return;
    }
    if (x > 1.7976931348623157e308 || x < -1.7976931348623157e308) {
        snprintf(out, outlen, x > 0 ? "inf" : "-inf");
        return;
    }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, x);
        if (strtod(tmp, NULL) == x) break;
    }
    /* tmp: [-]d[.ddd]e[+-]XX */
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    char digits[24];
    size_t nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char res[64];
    size_t o = 0;
    if (neg) res[o++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp >= 0) {
            for (int i = 0; i <= exp; i++) res[o++] = (size_t)i < nd ? digits[i] : '0';
            res[o++] = '.';
            if ((size_t)exp + 1 < nd)
                for (size_t i = (size_t)exp + 1; i < nd; i++) res[o++] = digits[i];
            else
                res[o++] = '0';
        } else {
            res[o++] = '0';
            res[o++] = '.';
            for (int i = 0; i < -exp - 1; i++) res[o++] = '0';
            for (size_t i = 0; i < nd; i++) res[o++] = digits[i];
        }
        res[o] = 0;
    } else {
        res[o++] = digits[0];
        if (nd > 1) {
            res[o++] = '.';
            for (size_t i = 1; i < nd; i++) res[o++] = digits[i];
        }
        snprintf(res + o, sizeof res - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
    snprintf(out, outlen, "%s", res);
}

static int repr_str(jinja_ctx *cx, jinja_buf *b, jinja_value v)
{
    const char *p = v.u.s.p;
    size_t n = v.u.s.n;
    bool has_sq = memchr(p, '\'', n) != NULL, has_dq = memchr(p, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    if (jinja_buf_put(cx, b, &q, 1)) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        char esc[8];
        if (c == '\\' || c == (unsigned char)q) snprintf(esc, sizeof esc, "\\%c", c);
        else if (c == '\n') snprintf(esc, sizeof esc, "\\n");
        else if (c == '\r') snprintf(esc, sizeof esc, "\\r");
        else if (c == '\t') snprintf(esc, sizeof esc, "\\t");
        else if (c < 0x20 || c == 0x7f) snprintf(esc, sizeof esc, "\\x%02x", c);
        else esc[0] = (char)c, esc[1] = 0;
        if (jinja_buf_put(cx, b, esc, strlen(esc))) return -1;
    }
    return jinja_buf_put(cx, b, &q, 1);
}

/* Python str() of v, appended to b (lists and dicts print as Python repr). */
int jinja_write_str(jinja_ctx *cx, jinja_buf *b, jinja_value v, bool repr)
{
    char num[40];
    switch (v.t) {
    case JINJA_UNDEF: return 0;
    case JINJA_NONE: return jinja_buf_puts(cx, b, "None");
    case JINJA_BOOL: return jinja_buf_puts(cx, b, v.u.b ? "True" : "False");
    case JINJA_INT: snprintf(num, sizeof num, "%lld", (long long)v.u.i); return jinja_buf_puts(cx, b, num);
    case JINJA_FLOAT: jinja_float_repr(v.u.f, num, sizeof num); return jinja_buf_puts(cx, b, num);
    case JINJA_STR: return repr ? repr_str(cx, b, v) : jinja_buf_put(cx, b, v.u.s.p, v.u.s.n);
    case JINJA_LIST:
        if (jinja_buf_puts(cx, b, v.u.l->tuple ? "(" : "[")) return -1;
        for (size_t i = 0; i < v.u.l->n; i++)
            if ((i && jinja_buf_puts(cx, b, ", ")) || jinja_write_str(cx, b, v.u.l->v[i], true)) return -1;
        if (v.u.l->tuple && v.u.l->n == 1 && jinja_buf_puts(cx, b, ",")) return -1;
        return jinja_buf_puts(cx, b, v.u.l->tuple ? ")" : "]");
    case JINJA_DICT:
    case JINJA_NS:
        if (jinja_buf_puts(cx, b, v.t == JINJA_NS ? "<Namespace {" : "{")) return -1;
        for (size_t i = 0; i < v.u.d->n; i++)
            if ((i && jinja_buf_puts(cx, b, ", ")) || jinja_write_str(cx, b, v.u.d->k[i], true) ||
                jinja_buf_puts(cx, b, ": ") || jinja_write_str(cx, b, v.u.d->v[i], true))
                return -1;
        return jinja_buf_puts(cx, b, v.t == JINJA_NS ? "}>" : "}");
    case JINJA_MACRO: return jinja_buf_puts(cx, b, "<Macro>");
    case JINJA_FUNC: return jinja_buf_puts(cx, b, "<function>");
    }
    return 0;
}

int jinja_to_str(jinja_ctx *cx, jinja_value v, jinja_value *out)
{
    if (v.t == JINJA_STR) {
        *out = v;
        return 0;
    }
    if (v.t == JINJA_UNDEF) {
        *out = jinja_str_value("", 0);
        return 0;
    }
    jinja_buf b = {0};
    int rc = jinja_write_str(cx, &b, v, false);
    if (!rc) rc = buf_to_value(cx, &b, out);
    free(b.p);
    return rc;
}

int jinja_undefined_error(jinja_ctx *cx, int line, jinja_value v)
{
    if (v.u.s.p) return jinja_fail(cx, line, "'%.*s' is undefined", (int)v.u.s.n, v.u.s.p);
    return jinja_fail(cx, line, "value is undefined");
}

jinja_value jinja_from_json(jinja_ctx *cx, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_NULL: return (jinja_value){.t = JINJA_NONE};
    case JSON_TRUE: return (jinja_value){.t = JINJA_BOOL, .u.b = true};
    case JSON_FALSE: return (jinja_value){.t = JINJA_BOOL, .u.b = false};
    case JSON_INTEGER: return (jinja_value){.t = JINJA_INT, .u.i = json_integer_value(j)};
    case JSON_REAL: return (jinja_value){.t = JINJA_FLOAT, .u.f = json_real_value(j)};
    case JSON_STRING: return jinja_str_value(json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        jinja_value l = jinja_list_new(cx, json_array_size(j));
        if (cx->failed) return l;
        for (size_t i = 0; i < json_array_size(j); i++)
            if (jinja_list_push(cx, l, jinja_from_json(cx, json_array_get(j, i)))) return l;
        return l;
    }
    case JSON_OBJECT: {
        jinja_value d = jinja_dict_new(cx, JINJA_DICT);
        const char *k;
        json_t *v;
        if (cx->failed) return d;
        json_object_foreach((json_t *)j, k, v)
        {
            if (jinja_dict_set(cx, d, jinja_str_value(k, strlen(k)), jinja_from_json(cx, v))) return d;
        }
        return d;
    }
    }
    return (jinja_value){.t = JINJA_NONE};
}

/* ---- expressions ---------------------------------------------------------------------- */

static int eval_args(jinja_ctx *cx, const jinja_node *n, jinja_args *args)
{
    args->n = n->nkids;
    args->nkw = n->nkw;
    args->kwnames = n->kwnames;
    if (args->n + args->nkw > JINJA_MAX_ARGS) return jinja_fail(cx, n->line, "too many arguments");
    for (size_t i = 0; i < n->nkids; i++)
        if (jinja_eval(cx, n->kids[i], &args->v[i])) return -1;
    for (size_t i = 0; i < n->nkw; i++)
        if (jinja_eval(cx, n->kwvals[i], &args->kw[i])) return -1;
    return 0;
}

static int call_macro(jinja_ctx *cx, const jinja_node *m, const jinja_args *args, int line,
                      jinja_value *out)
{
    if (++cx->depth > 64) return jinja_fail(cx, line, "macro recursion too deep");
    if (jinja_step(cx, line)) return -1;
    jinja_frame *f = jinja_frame_new(cx, cx->root);
    if (!f) return -1;
    if (args->n > m->ntargets)
        return jinja_fail(cx, line, "macro '%.*s' takes %zu arguments", (int)m->name.n, m->name.p, m->ntargets);
    for (size_t i = 0; i < m->ntargets; i++) {
        jinja_value v = {.t = JINJA_UNDEF, .u.s = {m->targets[i].p, m->targets[i].n}};
        bool set = false;
        if (i < args->n) v = args->v[i], set = true;
        for (size_t k = 0; k < args->nkw; k++)
            if (str_eq(args->kwnames[k].p, args->kwnames[k].n, m->targets[i].p, m->targets[i].n))
                v = args->kw[k], set = true;
        jinja_frame *saved = cx->frame;
        cx->frame = f;
        int rc = !set && m->kids[i] ? jinja_eval(cx, m->kids[i], &v) : 0;
        cx->frame = saved;
        if (rc || jinja_frame_set(cx, f, m->targets[i].p, m->targets[i].n, v)) return -1;
    }
    jinja_buf b = {0};
    jinja_buf *saved_out = cx->out;
    jinja_frame *saved = cx->frame;
    cx->out = &b;
    cx->frame = f;
    int rc = jinja_exec(cx, m->b);
    cx->out = saved_out;
    cx->frame = saved;
    if (rc >= 0) rc = buf_to_value(cx, &b, out);
    free(b.p);
    cx->depth--;
    return rc < 0 ? -1 : 0;
}

static int eval_call(jinja_ctx *cx, const jinja_node *n, jinja_value *out)
{
    jinja_args args;
    const jinja_node *callee = n->a;
    if (callee->kind == JINJA_N_ATTR) { /* method call */
        jinja_value obj;
        if (jinja_eval(cx, callee->a, &obj)) return -1;
        if (obj.t == JINJA_UNDEF) return jinja_undefined_error(cx, n->line, obj);
        if (eval_args(cx, n, &args)) return -1;
        int rc = jinja_call_method(cx, obj, callee->name, &args, n->line, out);
        if (rc <= 0) return rc;
        /* not a method: a macro stored in a namespace or dict */
        jinja_value *m = (obj.t == JINJA_DICT || obj.t == JINJA_NS)
                             ? jinja_dict_findstr(obj.u.d, callee->name.p, callee->name.n) : NULL;
        if (m && m->t == JINJA_MACRO) return call_macro(cx, m->u.macro, &args, n->line, out);
        return jinja_fail(cx, n->line, "no method '%.*s' on this value", (int)callee->name.n, callee->name.p);
    }
    jinja_value fn;
    if (jinja_eval(cx, callee, &fn) || eval_args(cx, n, &args)) return -1;
    if (fn.t == JINJA_MACRO) return call_macro(cx, fn.u.macro, &args, n->line, out);
    if (fn.t == JINJA_FUNC) return jinja_call_global(cx, (jinja_str){fn.u.s.p, fn.u.s.n}, &args, n->line, out);
    if (fn.t == JINJA_UNDEF) return jinja_undefined_error(cx, n->line, fn);
    return jinja_fail(cx, n->line, "value is not callable");
}

/* Index i (possibly negative) into a sequence of length n; false when out of range. */
static bool norm_index(int64_t i, size_t n, size_t *out)
{
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return false;
    *out = (size_t)i;
    return true;
}

int jinja_getitem(jinja_ctx *cx, jinja_value obj, jinja_value key, int line, jinja_value *out)
{
    *out = (jinja_value){.t = JINJA_UNDEF};
    if (key.t == JINJA_STR) out->u.s = key.u.s;
    switch (obj.t) {
    case JINJA_UNDEF: return jinja_undefined_error(cx, line, obj);
    case JINJA_DICT:
    case JINJA_NS: {
        jinja_value *v = jinja_dict_find(obj.u.d, key);
        if (v) *out = *v;
        return 0;
    }
    case JINJA_LIST: {
        size_t i;
        if ((key.t == JINJA_INT || key.t == JINJA_BOOL) && norm_index(as_int(key), obj.u.l->n, &i))
            *out = obj.u.l->v[i];
        return 0;
    }
    case JINJA_STR: {
        if (key.t != JINJA_INT) return 0;
        size_t ncp = jinja_utf8_len(obj.u.s.p, obj.u.s.n), i;
        if (!norm_index(key.u.i, ncp, &i)) return 0;
        size_t off = jinja_utf8_offset(obj.u.s.p, obj.u.s.n, i);
        size_t end = jinja_utf8_offset(obj.u.s.p, obj.u.s.n, i + 1);
        *out = jinja_str_value(obj.u.s.p + off, end - off);
        return 0;
    }
    default: return 0;
    }
}

/* Python slice semantics for lists and strings (by code point). */
static int eval_slice(jinja_ctx *cx, const jinja_node *n, jinja_value *out)
{
    jinja_value obj, parts[3];
    if (jinja_eval(cx, n->a, &obj)) return -1;
    const jinja_node *pn[3] = {n->b, n->c, n->d};
    for (int k = 0; k < 3; k++) {
        parts[k] = (jinja_value){.t = JINJA_NONE};
        if (pn[k] && jinja_eval(cx, pn[k], &parts[k])) return -1;
        if (parts[k].t != JINJA_NONE && parts[k].t != JINJA_INT)
            return jinja_fail(cx, n->line, "slice indices must be integers");
    }
    if (obj.t == JINJA_UNDEF) return jinja_undefined_error(cx, n->line, obj);
    if (obj.t != JINJA_LIST && obj.t != JINJA_STR) return jinja_fail(cx, n->line, "value cannot be sliced");
    int64_t len = obj.t == JINJA_LIST ? (int64_t)obj.u.l->n : (int64_t)jinja_utf8_len(obj.u.s.p, obj.u.s.n);
    int64_t step = parts[2].t == JINJA_INT ? parts[2].u.i : 1;
    if (step == 0) return jinja_fail(cx, n->line, "slice step cannot be zero");
    int64_t lo = step > 0 ? 0 : -1, hi = step > 0 ? len : len - 1, start, stop;
    if (parts[0].t == JINJA_INT) {
        start = parts[0].u.i < 0 ? parts[0].u.i + len : parts[0].u.i;
        start = start < lo ? lo : start > hi ? hi : start;
    } else {
        start = step > 0 ? 0 : len - 1;
    }
    if (parts[1].t == JINJA_INT) {
        stop = parts[1].u.i < 0 ? parts[1].u.i + len : parts[1].u.i;
        stop = stop < lo ? lo : stop > hi ? hi : stop;
    } else {
        stop = step > 0 ? len : -1;
    }
    /* the k-th index, start + k * step, stays inside [lo, hi]: only the last step could
     * overflow, so count the indices instead of stepping past stop */
    int64_t count = jinja_span_count(start, stop, step);
#define SLICE_INDEX(k) ((int64_t)((uint64_t)start + (uint64_t)(k) * (uint64_t)step))
    if (obj.t == JINJA_LIST) {
        *out = jinja_list_new(cx, 0);
        if (cx->failed) return -1;
        for (int64_t k = 0; k < count; k++)
            if (jinja_list_push(cx, *out, obj.u.l->v[SLICE_INDEX(k)])) return -1;
        return 0;
    }
    /* code point offsets first, so long strings slice in linear time */
    size_t *offs = jinja_arena_alloc(cx->a, ((size_t)len + 1) * sizeof *offs);
    if (!offs) return jinja_oom(cx);
    for (size_t b = 0, k = 0; b <= obj.u.s.n; b++)
        if (b == obj.u.s.n || ((unsigned char)obj.u.s.p[b] & 0xc0) != 0x80) offs[k++] = b;
    jinja_buf b = {0};
    int rc = jinja_buf_put(cx, &b, "", 0);
    for (int64_t k = 0; !rc && k < count; k++) {
        int64_t i = SLICE_INDEX(k);
        rc = jinja_buf_put(cx, &b, obj.u.s.p + offs[i], offs[i + 1] - offs[i]);
    }
#undef SLICE_INDEX
    if (!rc) rc = buf_to_value(cx, &b, out);
    free(b.p);
    return rc;
}

static int type_error(jinja_ctx *cx, int line, const char *op, jinja_value a, jinja_value b)
{
    static const char *const names[] = {"undefined", "none", "bool", "int", "float", "str",
                                        "list", "dict", "namespace", "macro", "function"};
    return jinja_fail(cx, line, "unsupported operand types for %s: %s and %s", op, names[a.t], names[b.t]);
}

int jinja_compare(jinja_ctx *cx, jinja_value a, jinja_value b, int line, int *cmp)
{
    if (is_num(a) && is_num(b)) {
        double x = jinja_num(a), y = jinja_num(b);
        if (a.t != JINJA_FLOAT && b.t != JINJA_FLOAT) *cmp = as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b);
        else *cmp = x < y ? -1 : x > y;
        return 0;
    }
    if (a.t == JINJA_STR && b.t == JINJA_STR) {
        size_t m = a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n;
        int c = m ? memcmp(a.u.s.p, b.u.s.p, m) : 0;
        *cmp = c ? (c < 0 ? -1 : 1) : a.u.s.n < b.u.s.n ? -1 : a.u.s.n > b.u.s.n;
        return 0;
    }
    if (a.t == JINJA_LIST && b.t == JINJA_LIST) {
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (jinja_compare(cx, a.u.l->v[i], b.u.l->v[i], line, cmp)) return -1;
            if (*cmp) return 0;
        }
        *cmp = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
        return 0;
    }
    if (a.t == JINJA_UNDEF) return jinja_undefined_error(cx, line, a);
    if (b.t == JINJA_UNDEF) return jinja_undefined_error(cx, line, b);
    return type_error(cx, line, "comparison", a, b);
}

int jinja_contains(jinja_ctx *cx, jinja_value hay, jinja_value needle, int line, bool *res)
{
    *res = false;
    switch (hay.t) {
    case JINJA_UNDEF: return 0; /* iterates as empty */
    case JINJA_STR:
        if (needle.t != JINJA_STR) return jinja_fail(cx, line, "'in <string>' requires a string on the left");
        *res = needle.u.s.n == 0 || memmem(hay.u.s.p, hay.u.s.n, needle.u.s.p, needle.u.s.n) != NULL;
        return 0;
    case JINJA_LIST:
        for (size_t i = 0; i < hay.u.l->n && !*res; i++) *res = jinja_equal(hay.u.l->v[i], needle);
        return 0;
    case JINJA_DICT:
    case JINJA_NS: *res = jinja_dict_find(hay.u.d, needle) != NULL; return 0;
    default: return jinja_fail(cx, line, "argument of 'in' is not iterable");
    }
}

static int concat_str(jinja_ctx *cx, jinja_value a, jinja_value b, jinja_value *out)
{
    char *p = jinja_arena_alloc(cx->a, a.u.s.n + b.u.s.n + 1);
    if (!p) return jinja_oom(cx);
    memcpy(p, a.u.s.p, a.u.s.n);
    memcpy(p + a.u.s.n, b.u.s.p, b.u.s.n);
    *out = jinja_str_value(p, a.u.s.n + b.u.s.n);
    return 0;
}

/* Python's ints are unbounded; here they are int64, and a result past that is a template error
 * (chat templates never come near it) rather than a wrapped value. */
static int int_result(jinja_ctx *cx, int line, bool overflow, int64_t r, jinja_value *out)
{
    if (overflow) return jinja_fail(cx, line, "integer overflow");
    *out = (jinja_value){.t = JINJA_INT, .u.i = r};
    return 0;
}

int64_t jinja_span_count(int64_t start, int64_t stop, int64_t step)
{
    if (step > 0 ? start >= stop : start <= stop) return 0;
    uint64_t dist = step > 0 ? (uint64_t)stop - (uint64_t)start : (uint64_t)start - (uint64_t)stop;
    uint64_t st = step > 0 ? (uint64_t)step : 0 - (uint64_t)step;
    uint64_t n = (dist - 1) / st + 1;
    return n > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)n;
}

static int arith(jinja_ctx *cx, int op, jinja_value a, jinja_value b, int line, jinja_value *out)
{
    static const char *const opname[] = {"", "+", "-", "*", "/", "//", "%", "**"};
    if (a.t == JINJA_UNDEF) return jinja_undefined_error(cx, line, a);
    if (b.t == JINJA_UNDEF) return jinja_undefined_error(cx, line, b);
    if (op == JINJA_OP_ADD && a.t == JINJA_STR && b.t == JINJA_STR) return concat_str(cx, a, b, out);
    if (op == JINJA_OP_ADD && a.t == JINJA_LIST && b.t == JINJA_LIST) {
        *out = jinja_list_new(cx, a.u.l->n + b.u.l->n);
        if (cx->failed) return -1;
        for (size_t i = 0; i < a.u.l->n; i++) jinja_list_push(cx, *out, a.u.l->v[i]);
        for (size_t i = 0; i < b.u.l->n; i++) jinja_list_push(cx, *out, b.u.l->v[i]);
        return 0;
    }
    if (op == JINJA_OP_MUL && ((a.t == JINJA_STR && b.t == JINJA_INT) || (a.t == JINJA_INT && b.t == JINJA_STR))) {
        jinja_value s = a.t == JINJA_STR ? a : b;
        int64_t k = a.t == JINJA_INT ? a.u.i : b.u.i;
        if (k > 0 && s.u.s.n * (uint64_t)k > ((uint64_t)1 << 26))
            return jinja_fail(cx, line, "string repetition too large");
        /* an empty string repeats to itself however large k is (fuzz_jinja: '' * 8 ** 10 ran
         * a billion empty appends) */
        if (s.u.s.n == 0) k = 0;
        jinja_buf buf = {0};
        int rc = jinja_buf_put(cx, &buf, "", 0);
        for (int64_t i = 0; i < k && !rc; i++) rc = jinja_buf_put(cx, &buf, s.u.s.p, s.u.s.n);
        if (!rc) rc = buf_to_value(cx, &buf, out);
        free(buf.p);
        return rc;
    }
    if (!is_num(a) || !is_num(b)) return type_error(cx, line, opname[op], a, b);
    bool ints = a.t != JINJA_FLOAT && b.t != JINJA_FLOAT;
    int64_t x = as_int(a), y = as_int(b), r;
    double fx = jinja_num(a), fy = jinja_num(b);
    switch (op) {
    case JINJA_OP_ADD:
        if (ints) {
            bool of = __builtin_add_overflow(x, y, &r);
            return int_result(cx, line, of, r, out);
        }
        *out = (jinja_value){.t = JINJA_FLOAT, .u.f = fx + fy};
        return 0;
    case JINJA_OP_SUB:
        if (ints) {
            bool of = __builtin_sub_overflow(x, y, &r);
            return int_result(cx, line, of, r, out);
        }
        *out = (jinja_value){.t = JINJA_FLOAT, .u.f = fx - fy};
        return 0;
    case JINJA_OP_MUL:
        if (ints) {
            bool of = __builtin_mul_overflow(x, y, &r);
            return int_result(cx, line, of, r, out);
        }
        *out = (jinja_value){.t = JINJA_FLOAT, .u.f = fx * fy};
        return 0;
    case JINJA_OP_DIV:
        if (fy == 0) return jinja_fail(cx, line, "division by zero");
        *out = (jinja_value){.t = JINJA_FLOAT, .u.f = fx / fy};
        return 0;
    case JINJA_OP_FLOORDIV:
    case JINJA_OP_MOD:
        if (ints) {
            if (y == 0) return jinja_fail(cx, line, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) return int_result(cx, line, true, 0, out);
            int64_t q = x / y;
            r = x % y;
            if (r != 0 && ((r < 0) != (y < 0))) q--, r += y;
            *out = (jinja_value){.t = JINJA_INT, .u.i = op == JINJA_OP_MOD ? r : q};
        } else {
            if (fy == 0) return jinja_fail(cx, line, "float division by zero");
            double q = __builtin_floor(fx / fy);
            *out = (jinja_value){.t = JINJA_FLOAT, .u.f = op == JINJA_OP_MOD ? fx - q * fy : q};
        }
        return 0;
    case JINJA_OP_POW:
        if (ints && y >= 0) { /* by squaring: a square that overflows is needed by the result */
            bool of = false;
            r = 1;
            for (int64_t e = y, base = x; e > 0 && !of; e >>= 1) {
                if (e & 1) of = __builtin_mul_overflow(r, base, &r);
                if (e > 1 && !of) of = __builtin_mul_overflow(base, base, &base);
            }
            return int_result(cx, line, of, r, out);
        } else {
            *out = (jinja_value){.t = JINJA_FLOAT, .u.f = __builtin_pow(fx, fy)};
        }
        return 0;
    }
    return jinja_fail(cx, line, "bad operator");
}

static int eval_binop(jinja_ctx *cx, const jinja_node *n, jinja_value *out)
{
    jinja_value a, b;
    if (jinja_eval(cx, n->a, &a) || jinja_eval(cx, n->b, &b)) return -1;
    int cmp;
    bool in;
    switch (n->op) {
    case JINJA_OP_CONCAT: {
        jinja_value sa, sb;
        if (jinja_to_str(cx, a, &sa) || jinja_to_str(cx, b, &sb)) return -1;
        return concat_str(cx, sa, sb, out);
    }
    case JINJA_OP_EQ:
    case JINJA_OP_NE:
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = jinja_equal(a, b) == (n->op == JINJA_OP_EQ)};
        return 0;
    case JINJA_OP_LT:
    case JINJA_OP_LE:
    case JINJA_OP_GT:
    case JINJA_OP_GE:
        if (jinja_compare(cx, a, b, n->line, &cmp)) return -1;
        out->t = JINJA_BOOL;
        out->u.b = n->op == JINJA_OP_LT ? cmp < 0 : n->op == JINJA_OP_LE ? cmp <= 0
                 : n->op == JINJA_OP_GT ? cmp > 0 : cmp >= 0;
        return 0;
    case JINJA_OP_IN:
    case JINJA_OP_NOTIN:
        if (jinja_contains(cx, b, a, n->line, &in)) return -1;
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = in == (n->op == JINJA_OP_IN)};
        return 0;
    default: return arith(cx, n->op, a, b, n->line, out);
    }
}

int jinja_eval(jinja_ctx *cx, const jinja_node *n, jinja_value *out)
{
    jinja_value a;
    jinja_args args;
    switch (n->kind) {
    case JINJA_N_LIT: *out = n->lit; return 0;
    case JINJA_N_NAME:
        if (!frame_get(cx->frame, n->name.p, n->name.n, out))
            *out = (jinja_value){.t = JINJA_UNDEF, .u.s = {n->name.p, n->name.n}};
        return 0;
    case JINJA_N_LIST:
        *out = jinja_list_new(cx, n->nkids);
        if (cx->failed) return -1;
        out->u.l->tuple = n->op == 1;
        for (size_t i = 0; i < n->nkids; i++)
            if (jinja_eval(cx, n->kids[i], &a) || jinja_list_push(cx, *out, a)) return -1;
        return 0;
    case JINJA_N_DICT:
        *out = jinja_dict_new(cx, JINJA_DICT);
        if (cx->failed) return -1;
        for (size_t i = 0; i + 1 < n->nkids; i += 2) {
            jinja_value k;
            if (jinja_eval(cx, n->kids[i], &k) || jinja_eval(cx, n->kids[i + 1], &a) ||
                jinja_dict_set(cx, *out, k, a))
                return -1;
        }
        return 0;
    case JINJA_N_ATTR:
        if (jinja_eval(cx, n->a, &a)) return -1;
        if (a.t == JINJA_UNDEF) return jinja_undefined_error(cx, n->line, a);
        return jinja_getitem(cx, a, jinja_str_value(n->name.p, n->name.n), n->line, out);
    case JINJA_N_INDEX: {
        jinja_value k;
        if (jinja_eval(cx, n->a, &a) || jinja_eval(cx, n->b, &k)) return -1;
        return jinja_getitem(cx, a, k, n->line, out);
    }
    case JINJA_N_SLICE: return eval_slice(cx, n, out);
    case JINJA_N_CALL: return eval_call(cx, n, out);
    case JINJA_N_FILTER:
        if (jinja_eval(cx, n->a, &a) || eval_args(cx, n, &args)) return -1;
        return jinja_apply_filter(cx, n->name, a, &args, n->line, out);
    case JINJA_N_TEST: {
        bool r;
        if (jinja_eval(cx, n->a, &a) || eval_args(cx, n, &args)) return -1;
        if (jinja_apply_test(cx, n->name, a, &args, n->line, &r)) return -1;
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = r != (n->op == 1)};
        return 0;
    }
    case JINJA_N_NOT:
        if (jinja_eval(cx, n->a, &a)) return -1;
        *out = (jinja_value){.t = JINJA_BOOL, .u.b = !jinja_truthy(a)};
        return 0;
    case JINJA_N_NEG:
        if (jinja_eval(cx, n->a, &a)) return -1;
        return arith(cx, JINJA_OP_SUB, (jinja_value){.t = JINJA_INT, .u.i = 0}, a, n->line, out);
    case JINJA_N_BINOP: return eval_binop(cx, n, out);
    case JINJA_N_AND:
    case JINJA_N_OR: /* Python: returns the deciding operand */
        if (jinja_eval(cx, n->a, &a)) return -1;
        if (jinja_truthy(a) == (n->kind == JINJA_N_OR)) {
            *out = a;
            return 0;
        }
        return jinja_eval(cx, n->b, out);
    case JINJA_N_CONDEXPR:
        if (jinja_eval(cx, n->b, &a)) return -1;
        if (jinja_truthy(a)) return jinja_eval(cx, n->a, out);
        if (n->c) return jinja_eval(cx, n->c, out);
        *out = (jinja_value){.t = JINJA_UNDEF};
        return 0;
    default: return jinja_fail(cx, n->line, "statement used as an expression");
    }
}

/* ---- statements ----------------------------------------------------------------------- */

/* Everything `for` can iterate: lists, dict keys, string code points; undefined is empty. */
static int iterable(jinja_ctx *cx, jinja_value v, int line, jinja_value *list)
{
    switch (v.t) {
    case JINJA_UNDEF: *list = jinja_list_new(cx, 0); return cx->failed ? -1 : 0;
    case JINJA_LIST: *list = v; return 0;
    case JINJA_DICT:
        *list = jinja_list_new(cx, v.u.d->n);
        if (cx->failed) return -1;
        for (size_t i = 0; i < v.u.d->n; i++) jinja_list_push(cx, *list, v.u.d->k[i]);
        return 0;
    case JINJA_STR: {
        size_t ncp = jinja_utf8_len(v.u.s.p, v.u.s.n), off = 0;
        *list = jinja_list_new(cx, ncp);
        if (cx->failed) return -1;
        for (size_t i = 0; i < ncp; i++) {
            size_t end = off + 1;
            while (end < v.u.s.n && ((unsigned char)v.u.s.p[end] & 0xc0) == 0x80) end++;
            jinja_list_push(cx, *list, jinja_str_value(v.u.s.p + off, end - off));
            off = end;
        }
        return 0;
    }
    default: return jinja_fail(cx, line, "value is not iterable");
    }
}

static int bind_targets(jinja_ctx *cx, jinja_frame *f, const jinja_node *n, jinja_value v)
{
    if (n->ntargets == 1) return jinja_frame_set(cx, f, n->targets[0].p, n->targets[0].n, v);
    jinja_value l;
    if (v.t == JINJA_STR || v.t == JINJA_DICT) {
        if (iterable(cx, v, n->line, &l)) return -1;
    } else {
        l = v;
    }
    if (l.t != JINJA_LIST || l.u.l->n != n->ntargets)
        return jinja_fail(cx, n->line, "cannot unpack value into %zu names", n->ntargets);
    for (size_t i = 0; i < n->ntargets; i++)
        if (jinja_frame_set(cx, f, n->targets[i].p, n->targets[i].n, l.u.l->v[i])) return -1;
    return 0;
}

static int set_key(jinja_ctx *cx, jinja_value d, const char *k, jinja_value v)
{
    return jinja_dict_set(cx, d, jinja_str_value(k, strlen(k)), v);
}

static int exec_for(jinja_ctx *cx, const jinja_node *n)
{
    jinja_value src, items;
    if (jinja_eval(cx, n->a, &src) || iterable(cx, src, n->line, &items)) return -1;
    if (n->d) { /* loop filter: loop.* counts only the items that pass */
        jinja_value kept = jinja_list_new(cx, 0);
        if (cx->failed) return -1;
        for (size_t i = 0; i < items.u.l->n; i++) {
            jinja_frame *f = jinja_frame_new(cx, cx->frame);
            jinja_value c;
            if (!f || bind_targets(cx, f, n, items.u.l->v[i])) return -1;
            jinja_frame *saved = cx->frame;
            cx->frame = f;
            int rc = jinja_eval(cx, n->d, &c);
            cx->frame = saved;
            if (rc) return -1;
            if (jinja_truthy(c) && jinja_list_push(cx, kept, items.u.l->v[i])) return -1;
        }
        items = kept;
    }
    size_t len = items.u.l->n;
    jinja_frame *saved = cx->frame;
    for (size_t i = 0; i < len; i++) {
        if (jinja_step(cx, n->line)) return -1;
        jinja_frame *f = jinja_frame_new(cx, saved);
        jinja_value loop = jinja_dict_new(cx, JINJA_DICT);
        if (!f || cx->failed) return -1;
        jinja_value undef = {.t = JINJA_UNDEF};
        if (set_key(cx, loop, "index", (jinja_value){.t = JINJA_INT, .u.i = (int64_t)i + 1}) ||
            set_key(cx, loop, "index0", (jinja_value){.t = JINJA_INT, .u.i = (int64_t)i}) ||
            set_key(cx, loop, "revindex", (jinja_value){.t = JINJA_INT, .u.i = (int64_t)(len - i)}) ||
            set_key(cx, loop, "revindex0", (jinja_value){.t = JINJA_INT, .u.i = (int64_t)(len - i - 1)}) ||
            set_key(cx, loop, "first", (jinja_value){.t = JINJA_BOOL, .u.b = i == 0}) ||
            set_key(cx, loop, "last", (jinja_value){.t = JINJA_BOOL, .u.b = i + 1 == len}) ||
            set_key(cx, loop, "length", (jinja_value){.t = JINJA_INT, .u.i = (int64_t)len}) ||
            set_key(cx, loop, "depth", (jinja_value){.t = JINJA_INT, .u.i = 1}) ||
            set_key(cx, loop, "depth0", (jinja_value){.t = JINJA_INT, .u.i = 0}) ||
            set_key(cx, loop, "previtem", i ? items.u.l->v[i - 1] : undef) ||
            set_key(cx, loop, "nextitem", i + 1 < len ? items.u.l->v[i + 1] : undef) ||
            jinja_frame_set(cx, f, "loop", 4, loop) || bind_targets(cx, f, n, items.u.l->v[i]))
            return -1;
        cx->frame = f;
        int rc = jinja_exec(cx, n->b);
        cx->frame = saved;
        if (rc < 0) return -1;
        if (rc == JINJA_EXEC_BREAK) break;
    }
    if (len == 0 && n->c) return jinja_exec(cx, n->c);
    return 0;
}

static int exec_set(jinja_ctx *cx, const jinja_node *n)
{
    jinja_value v;
    if (jinja_eval(cx, n->a, &v)) return -1;
    if (n->attr.p) { /* set ns.attr = v */
        jinja_value ns;
        if (!frame_get(cx->frame, n->name.p, n->name.n, &ns))
            return jinja_fail(cx, n->line, "'%.*s' is undefined", (int)n->name.n, n->name.p);
        if (ns.t != JINJA_NS)
            return jinja_fail(cx, n->line, "cannot assign attribute on non-namespace object '%.*s'", (int)n->name.n, n->name.p);
        return jinja_dict_set(cx, ns, jinja_str_value(n->attr.p, n->attr.n), v);
    }
    if (n->ntargets == 0) return 0; /* {% do %} */
    return bind_targets(cx, cx->frame, n, v);
}

int jinja_exec(jinja_ctx *cx, const jinja_node *n)
{
    jinja_value v;
    switch (n->kind) {
    case JINJA_N_BODY:
        for (size_t i = 0; i < n->nkids; i++) {
            int rc = jinja_exec(cx, n->kids[i]);
            if (rc) return rc;
        }
        return 0;
    case JINJA_N_TEXT: return jinja_buf_put(cx, cx->out, n->name.p, n->name.n);
    case JINJA_N_OUTPUT:
        if (jinja_eval(cx, n->a, &v)) return -1;
        return jinja_write_str(cx, cx->out, v, false);
    case JINJA_N_IF:
        if (jinja_eval(cx, n->a, &v)) return -1;
        if (jinja_truthy(v)) return jinja_exec(cx, n->b);
        return n->c ? jinja_exec(cx, n->c) : 0;
    case JINJA_N_FOR: return exec_for(cx, n);
    case JINJA_N_SET: return exec_set(cx, n);
    case JINJA_N_SETBLOCK: {
        jinja_buf b = {0};
        jinja_buf *saved = cx->out;
        cx->out = &b;
        int rc = jinja_exec(cx, n->b);
        cx->out = saved;
        if (rc >= 0) rc = buf_to_value(cx, &b, &v);
        free(b.p);
        if (rc < 0) return -1;
        return jinja_frame_set(cx, cx->frame, n->targets[0].p, n->targets[0].n, v);
    }
    case JINJA_N_MACRO:
        return jinja_frame_set(cx, cx->frame, n->name.p, n->name.n,
                               (jinja_value){.t = JINJA_MACRO, .u.macro = n});
    case JINJA_N_BREAK: return JINJA_EXEC_BREAK;
    case JINJA_N_CONTINUE: return JINJA_EXEC_CONTINUE;
    default: return jinja_fail(cx, n->line, "expression used as a statement");
    }
}

/* ---- public API ----------------------------------------------------------------------- */

struct jinja_template {
    jinja_arena arena;
    jinja_node *root;
};

jinja_template *jinja_template_parse(const char *src, char *err, size_t errlen)
{
    if (!src) return ms_errf(err, errlen, "no template source"), NULL;
    jinja_template *t = calloc(1, sizeof *t);
    if (!t) return ms_errf(err, errlen, "out of memory"), NULL;
    t->root = jinja_parse(&t->arena, src, err, errlen);
    if (!t->root) {
        jinja_template_free(t);
        return NULL;
    }
    return t;
}

void jinja_template_free(jinja_template *t)
{
    if (!t) return;
    jinja_arena_free(&t->arena);
    free(t);
}

/* Renders with a root frame that the caller filled through `fill`. */
static int render(const jinja_template *t, int (*fill)(jinja_ctx *, const void *), const void *arg,
                  char **out, char *err, size_t errlen)
{
    *out = NULL;
    jinja_arena arena = {.limit = JINJA_MAX_RENDER_BYTES};
    jinja_buf b = {0};
    jinja_ctx cx = {.a = &arena, .err = err, .errlen = errlen, .out = &b};
    int rc = -1;
    jinja_frame *globals = jinja_frame_new(&cx, NULL);
    if (!globals || jinja_add_globals(&cx, globals)) goto fail;
    if (!(cx.root = cx.frame = jinja_frame_new(&cx, globals))) goto fail;
    if (fill && fill(&cx, arg)) goto fail;
    if (jinja_exec(&cx, t->root) < 0 || jinja_buf_put(&cx, &b, "", 0)) goto fail;
    *out = b.p;
    b.p = NULL;
    rc = 0;
fail:
    free(b.p);
    jinja_arena_free(&arena);
    return rc;
}

static int fill_json(jinja_ctx *cx, const void *arg)
{
    const json_t *ctx = arg;
    const char *k;
    json_t *v;
    if (!ctx) return 0;
    if (!json_is_object(ctx)) return jinja_fail(cx, 0, "render context must be a JSON object");
    json_object_foreach((json_t *)ctx, k, v)
    {
        jinja_value val = jinja_from_json(cx, v);
        if (cx->failed || jinja_frame_set(cx, cx->root, k, strlen(k), val)) return -1;
    }
    return 0;
}

int jinja_template_render(const jinja_template *t, const json_t *context, char **out, char *err,
                          size_t errlen)
{
    return render(t, fill_json, context, out, err, errlen);
}

struct chat_fill {
    const struct jinja_chat_args *args;
    json_t *messages, *tools, *extra;
};

/* One message as apply_chat_template hands it over: null-valued keys dropped, reasoning
 * aliased to "thinking" (first) and "reasoning_content". */
static int chat_message(jinja_ctx *cx, json_t *m, jinja_value *out)
{
    static const char *const reasoning_keys[] = {"reasoning_content", "thinking", "reasoning"};
    json_t *reasoning = NULL;
    for (int i = 0; i < 3 && !reasoning; i++) {
        json_t *r = json_object_get(m, reasoning_keys[i]);
        if (r && !json_is_null(r)) reasoning = r;
    }
    *out = jinja_dict_new(cx, JINJA_DICT);
    if (cx->failed) return -1;
    jinja_value rv = reasoning ? jinja_from_json(cx, reasoning) : (jinja_value){0};
    if (reasoning && set_key(cx, *out, "thinking", rv)) return -1;
    const char *k;
    json_t *v;
    json_object_foreach(m, k, v)
    {
        if (json_is_null(v)) continue;
        if (set_key(cx, *out, k, jinja_from_json(cx, v))) return -1;
    }
    if (reasoning && set_key(cx, *out, "reasoning_content", rv)) return -1;
    return cx->failed ? -1 : 0;
}

static int fill_chat(jinja_ctx *cx, const void *arg)
{
    const struct chat_fill *cf = arg;
    jinja_frame *f = cx->root;
    jinja_value msgs = jinja_list_new(cx, json_array_size(cf->messages));
    if (cx->failed) return -1;
    for (size_t i = 0; i < json_array_size(cf->messages); i++) {
        jinja_value m;
        if (chat_message(cx, json_array_get(cf->messages, i), &m) || jinja_list_push(cx, msgs, m))
            return -1;
    }
    jinja_value none = {.t = JINJA_NONE};
    if (jinja_frame_set(cx, f, "messages", 8, msgs) ||
        jinja_frame_set(cx, f, "tools", 5, cf->tools ? jinja_from_json(cx, cf->tools) : none) ||
        jinja_frame_set(cx, f, "documents", 9, none) ||
        jinja_frame_set(cx, f, "add_generation_prompt", 21,
                        (jinja_value){.t = JINJA_BOOL, .u.b = cf->args->add_generation_prompt}))
        return -1;
    const char *bos = cf->args->bos_token, *eos = cf->args->eos_token;
    if (bos && jinja_frame_set(cx, f, "bos_token", 9, jinja_str_value(bos, strlen(bos)))) return -1;
    if (eos && jinja_frame_set(cx, f, "eos_token", 9, jinja_str_value(eos, strlen(eos)))) return -1;
    return fill_json(cx, cf->extra);
}

/* args->object_arguments: each call's string arguments replaced by the object they parse to. */
static void parse_call_arguments(json_t *messages)
{
    for (size_t i = 0; i < json_array_size(messages); i++) {
        json_t *calls = json_object_get(json_array_get(messages, i), "tool_calls");
        for (size_t j = 0; j < json_array_size(calls); j++) {
            json_t *fn = json_object_get(json_array_get(calls, j), "function");
            json_t *a = json_object_get(fn, "arguments");
            if (!json_is_string(a)) continue;
            json_t *obj = json_string_length(a) == 0
                              ? json_object()
                              : json_loadb(json_string_value(a), json_string_length(a), 0, NULL);
            if (json_is_object(obj))
                json_object_set_new(fn, "arguments", obj);
            else
                json_decref(obj);
        }
    }
}

bool jinja_chat_object_arguments(const jinja_template *t)
{
    static const char probe[] =
        "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\","
        "\"tool_calls\":[{\"type\":\"function\",\"id\":\"call_0\",\"function\":{\"name\":"
        "\"probe_fn\",\"arguments\":\"{\\\"probe_key\\\": \\\"probe_value\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"call_0\",\"content\":\"r\"}]";
    struct jinja_chat_args a = {.messages_json = probe, .bos_token = "", .eos_token = ""};
    char err[256], *as_string = NULL, *as_object = NULL;
    int rs = jinja_render_chat_args(t, &a, &as_string, err, sizeof err);
    a.object_arguments = true;
    int ro = jinja_render_chat_args(t, &a, &as_object, err, sizeof err);
    /* the string reached the text as given (not re-escaped by tojson, not dropped) */
    bool string_ok = rs == 0 && strstr(as_string, "{\"probe_key\": \"probe_value\"}");
    bool object_ok = ro == 0 && strstr(as_object, "probe_value");
    free(as_string);
    free(as_object);
    return !string_ok && object_ok;
}

int jinja_render_chat_args(const jinja_template *t, const struct jinja_chat_args *args, char **out,
                           char *err, size_t errlen)
{
    struct chat_fill cf = {.args = args};
    json_error_t je;
    int rc = -1;
    *out = NULL;
    if (!args->messages_json) return ms_errf(err, errlen, "no messages");
    cf.messages = json_loads(args->messages_json, JSON_DECODE_ANY, &je);
    if (!cf.messages) {
        ms_errf(err, errlen, "messages: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
        goto fail;
    }
    if (!json_is_array(cf.messages)) {
        ms_errf(err, errlen, "messages: expected a JSON array");
        goto fail;
    }
    if (json_array_size(cf.messages) == 0) {
        ms_errf(err, errlen, "messages: the conversation is empty");
        goto fail;
    }
    for (size_t i = 0; i < json_array_size(cf.messages); i++)
        if (!json_is_object(json_array_get(cf.messages, i))) {
            ms_errf(err, errlen, "messages[%zu]: expected a JSON object", i);
            goto fail;
        }
    if (args->object_arguments) parse_call_arguments(cf.messages);
    if (args->tools_json) {
        cf.tools = json_loads(args->tools_json, JSON_DECODE_ANY, &je);
        if (!cf.tools || !json_is_array(cf.tools)) {
            ms_errf(err, errlen, "tools: expected a JSON array");
            goto fail;
        }
    }
    if (args->extra_json) {
        cf.extra = json_loads(args->extra_json, JSON_DECODE_ANY, &je);
        if (!cf.extra || !json_is_object(cf.extra)) {
            ms_errf(err, errlen, "template variables: expected a JSON object");
            goto fail;
        }
    }
    rc = render(t, fill_chat, &cf, out, err, errlen);
fail:
    json_decref(cf.messages);
    json_decref(cf.tools);
    json_decref(cf.extra);
    return rc;
}

int jinja_render_chat(const char *template_src, const char *messages_json,
                      bool add_generation_prompt, const char *bos_token, const char *eos_token,
                      char **out, char *err, size_t errlen)
{
    *out = NULL;
    jinja_template *t = jinja_template_parse(template_src, err, errlen);
    if (!t) return -1;
    struct jinja_chat_args args = {.messages_json = messages_json,
                                   .add_generation_prompt = add_generation_prompt,
                                   .bos_token = bos_token,
                                   .eos_token = eos_token};
    int rc = jinja_render_chat_args(t, &args, out, err, errlen);
    jinja_template_free(t);
    return rc;
}
