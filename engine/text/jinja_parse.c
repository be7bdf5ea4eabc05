/* Jinja lexer and parser: turns template source into the syntax tree of jinja_ast.h. The lexer
 * applies whitespace control the way jinja2 does with trim_blocks and lstrip_blocks on (the
 * transformers configuration): `{%-`/`-%}` strip all whitespace on that side, a block or comment
 * tag alone on its line takes its indentation and its newline with it, `{%+`/`+%}` opt out, and
 * one trailing newline of the template is dropped. The parser is recursive descent with
 * jinja2's operator precedence. */
#include "jinja_ast.h"

#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JINJA_MAX_DEPTH 200

typedef enum {
    TK_TEXT,
    TK_VAR_BEGIN,
    TK_VAR_END,
    TK_BLOCK_BEGIN,
    TK_BLOCK_END,
    TK_NAME,
    TK_STRING,
    TK_INT,
    TK_FLOAT,
    TK_OP,
    TK_EOF,
} tok_kind;

typedef struct {
    tok_kind k;
    int line;
    const char *p; /* TEXT/NAME/OP: into the normalised source; STRING: decoded, in the arena */
    size_t n;
    int64_t i;
    double f;
} tok;

typedef struct {
    jinja_arena *a;
    const char *src; /* newline-normalised copy */
    size_t len;
    tok *toks;
    size_t ntok, cap;
    size_t pos; /* parser cursor */
    int depth;  /* nesting of expressions and blocks, bounded so bad input cannot blow the stack */
    char *err;
    size_t errlen;
} parser;

static int perr(parser *ps, int line, const char *fmt, const char *arg)
{
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    return ms_errf(ps->err, ps->errlen, "template line %d: %s", line, msg);
}

static int push_tok(parser *ps, tok t)
{
    if (ps->ntok == ps->cap) {
        size_t cap = ps->cap ? ps->cap * 2 : 256;
        tok *nt = realloc(ps->toks, cap * sizeof *nt);
        if (!nt) return ms_errf(ps->err, ps->errlen, "out of memory");
        ps->toks = nt;
        ps->cap = cap;
    }
    ps->toks[ps->ntok++] = t;
    return 0;
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int count_lines(const char *p, size_t n)
{
    int k = 0;
    for (size_t i = 0; i < n; i++) k += p[i] == '\n';
    return k;
}

static void put_utf8(char *out, size_t *o, uint32_t cp)
{
    if (cp < 0x80) {
        out[(*o)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*o)++] = (char)(0xc0 | (cp >> 6));
        out[(*o)++] = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        out[(*o)++] = (char)(0xe0 | (cp >> 12));
        out[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*o)++] = (char)(0x80 | (cp & 0x3f));
    } else {
        out[(*o)++] = (char)(0xf0 | (cp >> 18));
        out[(*o)++] = (char)(0x80 | ((cp >> 12) & 0x3f));
        out[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*o)++] = (char)(0x80 | (cp & 0x3f));
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes a string literal body with Python's unicode-escape rules (what jinja2 applies);
 * unknown escapes stay as written. */
static int lex_string(parser *ps, size_t *i, int line)
{
    const char *s = ps->src;
    char q = s[*i];
    size_t j = *i + 1;
    while (j < ps->len && s[j] != q) {
        if (s[j] == '\\' && j + 1 < ps->len) j++;
        j++;
    }
    if (j >= ps->len) return perr(ps, line, "unterminated string literal%s", "");
    size_t n = j - (*i + 1);
    char *out = jinja_arena_alloc(ps->a, n + 1);
    if (!out) return ms_errf(ps->err, ps->errlen, "out of memory");
    size_t o = 0;
    for (size_t k = *i + 1; k < j; k++) {
        char c = s[k];
        if (c != '\\' || k + 1 >= j) {
            out[o++] = c;
            continue;
        }
        char e = s[++k];
        int nhex = 0;
        switch (e) {
        case 'n': out[o++] = '\n'; break;
        case 't': out[o++] = '\t'; break;
        case 'r': out[o++] = '\r'; break;
        case 'a': out[o++] = '\a'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'v': out[o++] = '\v'; break;
        case '\\': out[o++] = '\\'; break;
        case '\'': out[o++] = '\''; break;
        case '"': out[o++] = '"'; break;
        case '\n': break; /* line continuation */
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = 0;
                int d = 0;
                while (d < 3 && k < j && s[k] >= '0' && s[k] <= '7') cp = cp * 8 + (uint32_t)(s[k++] - '0'), d++;
                k--;
                put_utf8(out, &o, cp);
            } else {
                out[o++] = '\\';
                out[o++] = e;
            }
        }
        if (nhex) {
            uint32_t cp = 0;
            for (int d = 0; d < nhex; d++) {
                int h = k + 1 + (size_t)d < j ? hexval(s[k + 1 + (size_t)d]) : -1;
                if (h < 0) return perr(ps, line, "truncated \\%s escape in string literal", e == 'x' ? "x" : "u");
                cp = cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10ffff) return perr(ps, line, "bad unicode escape%s", "");
            k += (size_t)nhex;
            put_utf8(out, &o, cp); /* worst case 4 bytes for >= 6 source bytes */
        }
    }
    out[o] = 0;
    *i = j + 1;
    return push_tok(ps, (tok){.k = TK_STRING, .line = line, .p = out, .n = o});
}

/* Operators, longest first. */
static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~",
                                  "[",  "]",  "(",  ")",  "{",  "}",  ">", "<", "=", ".", ":", "|",
                                  ",",  ";"};

/* Lexes the inside of a {{ }} or {% %} tag starting at *i; stops after the closing delimiter
 * and returns through *strip_after whether it was `-}}`/`-%}` and through *plus whether `+%}`. */
static int lex_tag(parser *ps, size_t *i, int *line, bool block, bool *strip_after, bool *plus)
{
    const char *s = ps->src;
    int depth = 0;
    for (;;) {
        while (*i < ps->len && is_ws(s[*i])) {
            if (s[*i] == '\n') (*line)++;
            (*i)++;
        }
        if (*i >= ps->len) return perr(ps, *line, "unclosed %s tag", block ? "{%" : "{{");
        const char *p = s + *i;
        size_t rest = ps->len - *i;
        const char *close = block ? "%}" : "}}";
        if (depth == 0) {
            if (rest >= 3 && (p[0] == '-' || (block && p[0] == '+')) && memcmp(p + 1, close, 2) == 0) {
                *strip_after = p[0] == '-';
                *plus = p[0] == '+';
                *i += 3;
                return push_tok(ps, (tok){.k = block ? TK_BLOCK_END : TK_VAR_END, .line = *line});
            }
            if (rest >= 2 && memcmp(p, close, 2) == 0) {
                *i += 2;
                return push_tok(ps, (tok){.k = block ? TK_BLOCK_END : TK_VAR_END, .line = *line});
            }
        }
        char c = *p;
        if (c == '\'' || c == '"') {
            if (lex_string(ps, i, *line)) return -1;
            continue;
        }
        if (isalpha((unsigned char)c) || c == '_') {
            size_t j = *i;
            while (j < ps->len && (isalnum((unsigned char)s[j]) || s[j] == '_')) j++;
            if (push_tok(ps, (tok){.k = TK_NAME, .line = *line, .p = p, .n = j - *i})) return -1;
            *i = j;
            continue;
        }
        if (isdigit((unsigned char)c)) {
            size_t j = *i;
            while (j < ps->len && (isdigit((unsigned char)s[j]) || s[j] == '_')) j++;
            bool is_float = false;
            if (j + 1 < ps->len && s[j] == '.' && isdigit((unsigned char)s[j + 1])) {
                is_float = true;
                j++;
                while (j < ps->len && (isdigit((unsigned char)s[j]) || s[j] == '_')) j++;
            }
            if (j < ps->len && (s[j] == 'e' || s[j] == 'E')) {
                size_t k = j + 1;
                if (k < ps->len && (s[k] == '+' || s[k] == '-')) k++;
                if (k < ps->len && isdigit((unsigned char)s[k])) {
                    is_float = true;
                    j = k;
                    while (j < ps->len && isdigit((unsigned char)s[j])) j++;
                }
            }
            char num[64];
            size_t o = 0;
            for (size_t k = *i; k < j && o + 1 < sizeof num; k++)
                if (s[k] != '_') num[o++] = s[k];
            num[o] = 0;
            tok t = {.k = is_float ? TK_FLOAT : TK_INT, .line = *line, .p = p, .n = j - *i};
            errno = 0;
            if (is_float) t.f = strtod(num, NULL);
            else t.i = strtoll(num, NULL, 10);
            if (errno) return perr(ps, *line, "number out of range: %s", num);
            if (push_tok(ps, t)) return -1;
            *i = j;
            continue;
        }
        size_t k;
        for (k = 0; k < sizeof OPS / sizeof OPS[0]; k++) {
            size_t n = strlen(OPS[k]);
            if (rest >= n && memcmp(p, OPS[k], n) == 0) break;
        }
        if (k == sizeof OPS / sizeof OPS[0]) {
            char bad[2] = {c, 0};
            return perr(ps, *line, "unexpected character '%s'", bad);
        }
        if (c == '(' || c == '[' || c == '{') depth++;
        if ((c == ')' || c == ']' || c == '}') && depth > 0) depth--;
        size_t n = strlen(OPS[k]);
        if (push_tok(ps, (tok){.k = TK_OP, .line = *line, .p = p, .n = n})) return -1;
        *i += n;
    }
}

static int lex(parser *ps)
{
    const char *s = ps->src;
    size_t i = 0;
    int line = 1;
    bool line_starting = true, strip_next = false;
    while (i < ps->len) {
        if (strip_next) {
            while (i < ps->len && is_ws(s[i])) {
                if (s[i] == '\n') line++;
                i++;
            }
            strip_next = false;
        }
        /* next tag start */
        size_t j = i;
        while (j + 1 < ps->len && !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#')))
            j++;
        if (j + 1 >= ps->len) j = ps->len;
        size_t tend = j; /* end of the text before the tag */
        char kind = j < ps->len ? s[j + 1] : 0;
        char sign = j + 2 < ps->len ? s[j + 2] : 0;
        if (kind && sign == '-') {
            while (tend > i && is_ws(s[tend - 1])) tend--;
        } else if (kind && kind != '{' && sign != '+') { /* lstrip_blocks */
            size_t l = tend;
            while (l > i && (s[l - 1] == ' ' || s[l - 1] == '\t')) l--;
            bool at_bol = l > i ? s[l - 1] == '\n' : line_starting;
            if (at_bol) tend = l;
        }
        if (tend > i && push_tok(ps, (tok){.k = TK_TEXT, .line = line, .p = s + i, .n = tend - i}))
            return -1;
        line += count_lines(s + i, j - i);
        if (!kind) break;
        int tag_line = line;
        i = j + 2 + (sign == '-' || sign == '+');
        bool strip_after = false, plus = false;
        if (kind == '#') {
            const char *e = NULL;
            for (size_t k = i; k + 1 < ps->len; k++)
                if (s[k] == '#' && s[k + 1] == '}') {
                    e = s + k;
                    break;
                }
            if (!e) return perr(ps, tag_line, "unclosed comment%s", "");
            size_t k = (size_t)(e - s);
            strip_after = k > i && s[k - 1] == '-';
            plus = k > i && s[k - 1] == '+';
            line += count_lines(s + i, k - i);
            i = k + 2;
        } else {
            bool block = kind == '%';
            if (push_tok(ps, (tok){.k = block ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, .line = line}))
                return -1;
            if (lex_tag(ps, &i, &line, block, &strip_after, &plus)) return -1;
        }
        if (strip_after) {
            strip_next = true;
        } else if (kind != '{' && !plus && i < ps->len && s[i] == '\n') { /* trim_blocks */
            i++;
            line++;
        }
        line_starting = i > 0 && s[i - 1] == '\n';
    }
    return push_tok(ps, (tok){.k = TK_EOF, .line = line});
}

/* ---- parser --------------------------------------------------------------------------- */

static tok *cur(parser *ps)
{
    return &ps->toks[ps->pos];
}

static bool is_op(const tok *t, const char *op)
{
    return t->k == TK_OP && t->n == strlen(op) && memcmp(t->p, op, t->n) == 0;
}

static bool is_name(const tok *t, const char *name)
{
    return t->k == TK_NAME && t->n == strlen(name) && memcmp(t->p, name, t->n) == 0;
}

static bool accept_op(parser *ps, const char *op)
{
    if (!is_op(cur(ps), op)) return false;
    ps->pos++;
    return true;
}

static bool accept_name(parser *ps, const char *name)
{
    if (!is_name(cur(ps), name)) return false;
    ps->pos++;
    return true;
}

static const char *tok_desc(const tok *t, char *buf, size_t n)
{
    switch (t->k) {
    case TK_TEXT: return "template text";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "'}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "'%}'";
    case TK_STRING: return "a string";
    case TK_EOF: return "end of template";
    default: snprintf(buf, n, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->p); return buf;
    }
}

static int unexpected(parser *ps, const char *wanted)
{
    char buf[64], msg[160];
    snprintf(msg, sizeof msg, "expected %s, got %s", wanted, tok_desc(cur(ps), buf, sizeof buf));
    return perr(ps, cur(ps)->line, "%s", msg);
}

static int expect_op(parser *ps, const char *op)
{
    if (accept_op(ps, op)) return 0;
    char w[16];
    snprintf(w, sizeof w, "'%s'", op);
    return unexpected(ps, w);
}

static int expect_kind(parser *ps, tok_kind k, const char *what)
{
    if (cur(ps)->k != k) return unexpected(ps, what);
    ps->pos++;
    return 0;
}

static jinja_node *new_node(parser *ps, jinja_node_kind kind, int line)
{
    jinja_node *n = jinja_arena_alloc(ps->a, sizeof *n);
    if (!n) ms_errf(ps->err, ps->errlen, "out of memory");
    else n->kind = kind, n->line = line;
    return n;
}

/* Growable pointer array in the arena (the old block is simply abandoned). */
static int push_kid(parser *ps, jinja_node ***arr, size_t *n, jinja_node *k)
{
    if ((*n & (*n - 1)) == 0 || *n == 0) { /* at powers of two, grow */
        size_t cap = *n ? *n * 2 : 4;
        jinja_node **na = jinja_arena_alloc(ps->a, cap * sizeof *na);
        if (!na) return ms_errf(ps->err, ps->errlen, "out of memory");
        if (*n) memcpy(na, *arr, *n * sizeof *na);
        *arr = na;
    }
    (*arr)[(*n)++] = k;
    return 0;
}

static int push_str(parser *ps, jinja_str **arr, size_t *n, jinja_str s)
{
    if ((*n & (*n - 1)) == 0 || *n == 0) {
        size_t cap = *n ? *n * 2 : 4;
        jinja_str *na = jinja_arena_alloc(ps->a, cap * sizeof *na);
        if (!na) return ms_errf(ps->err, ps->errlen, "out of memory");
        if (*n) memcpy(na, *arr, *n * sizeof *na);
        *arr = na;
    }
    (*arr)[(*n)++] = s;
    return 0;
}

static jinja_node *parse_expr(parser *ps);
static jinja_node *parse_unary(parser *ps, bool with_filter);
static jinja_node *parse_primary(parser *ps);
static jinja_node *parse_postfix(parser *ps, jinja_node *n);

/* Call arguments after '(' : positional and name=value, up to ')'. */
static int parse_args(parser *ps, jinja_node *n)
{
    while (!accept_op(ps, ")")) {
        if (n->nkids || n->nkw)
            if (expect_op(ps, ",")) return -1;
        if (accept_op(ps, ")")) break; /* trailing comma */
        if (cur(ps)->k == TK_NAME && is_op(&ps->toks[ps->pos + 1], "=")) {
            jinja_str key = {cur(ps)->p, cur(ps)->n};
            ps->pos += 2;
            jinja_node *v = parse_expr(ps);
            if (!v) return -1;
            size_t nkw = n->nkw;
            if (push_str(ps, &n->kwnames, &nkw, key) || push_kid(ps, &n->kwvals, &n->nkw, v)) return -1;
        } else {
            if (n->nkw) return perr(ps, cur(ps)->line, "positional argument after keyword argument%s", "");
            jinja_node *v = parse_expr(ps);
            if (!v || push_kid(ps, &n->kids, &n->nkids, v)) return -1;
        }
    }
    return 0;
}

static jinja_node *parse_filters(parser *ps, jinja_node *n)
{
    for (;;) {
        if (accept_op(ps, "|")) {
            tok *t = cur(ps);
            if (t->k != TK_NAME) return unexpected(ps, "a filter name"), NULL;
            ps->pos++;
            jinja_str name = {t->p, t->n};
            while (accept_op(ps, ".")) { /* dotted filter names are not used; keep the last part */
                if (cur(ps)->k != TK_NAME) return unexpected(ps, "a filter name"), NULL;
                name = (jinja_str){cur(ps)->p, cur(ps)->n};
                ps->pos++;
            }
            jinja_node *f = new_node(ps, JINJA_N_FILTER, t->line);
            if (!f) return NULL;
            f->a = n;
            f->name = name;
            if (accept_op(ps, "(") && parse_args(ps, f)) return NULL;
            n = f;
        } else if (is_name(cur(ps), "is")) {
            int line = cur(ps)->line;
            ps->pos++;
            jinja_node *t = new_node(ps, JINJA_N_TEST, line);
            if (!t) return NULL;
            t->op = accept_name(ps, "not");
            if (cur(ps)->k != TK_NAME) return unexpected(ps, "a test name"), NULL;
            t->name = (jinja_str){cur(ps)->p, cur(ps)->n};
            ps->pos++;
            t->a = n;
            tok *nx = cur(ps);
            if (accept_op(ps, "(")) {
                if (parse_args(ps, t)) return NULL;
            } else if ((nx->k == TK_NAME && !is_name(nx, "else") && !is_name(nx, "or") &&
                        !is_name(nx, "and") && !is_name(nx, "if") && !is_name(nx, "in") &&
                        !is_name(nx, "is") && !is_name(nx, "not")) ||
                       nx->k == TK_STRING || nx->k == TK_INT || nx->k == TK_FLOAT ||
                       is_op(nx, "[") || is_op(nx, "{")) {
                jinja_node *arg = parse_primary(ps);
                if (!arg || !(arg = parse_postfix(ps, arg))) return NULL;
                if (push_kid(ps, &t->kids, &t->nkids, arg)) return NULL;
            }
            n = t;
        } else {
            return n;
        }
    }
}

static jinja_node *parse_postfix(parser *ps, jinja_node *n)
{
    for (;;) {
        tok *t = cur(ps);
        if (accept_op(ps, ".")) {
            tok *nm = cur(ps);
            jinja_node *x;
            if (nm->k == TK_NAME) {
                x = new_node(ps, JINJA_N_ATTR, t->line);
                if (!x) return NULL;
                x->name = (jinja_str){nm->p, nm->n};
            } else if (nm->k == TK_INT) { /* foo.0 is foo[0] */
                x = new_node(ps, JINJA_N_INDEX, t->line);
                jinja_node *k = new_node(ps, JINJA_N_LIT, t->line);
                if (!x || !k) return NULL;
                k->lit = (jinja_value){.t = JINJA_INT, .u.i = nm->i};
                x->b = k;
            } else {
                return unexpected(ps, "an attribute name"), NULL;
            }
            ps->pos++;
            x->a = n;
            n = x;
        } else if (accept_op(ps, "[")) {
            jinja_node *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            bool slice = false;
            for (;;) {
                if (is_op(cur(ps), ":")) {
                    if (np == 2) return unexpected(ps, "']'"), NULL;
                    ps->pos++;
                    slice = true;
                    np++;
                    continue;
                }
                if (accept_op(ps, "]")) break;
                if (parts[np]) return unexpected(ps, "']'"), NULL;
                if (!(parts[np] = parse_expr(ps))) return NULL;
            }
            jinja_node *x = new_node(ps, slice ? JINJA_N_SLICE : JINJA_N_INDEX, t->line);
            if (!x) return NULL;
            x->a = n;
            if (slice) x->b = parts[0], x->c = parts[1], x->d = parts[2];
            else if (!parts[0]) return perr(ps, t->line, "empty subscript%s", ""), NULL;
            else x->b = parts[0];
            n = x;
        } else if (accept_op(ps, "(")) {
            jinja_node *x = new_node(ps, JINJA_N_CALL, t->line);
            if (!x) return NULL;
            x->a = n;
            if (parse_args(ps, x)) return NULL;
            n = x;
        } else {
            return n;
        }
    }
}

static jinja_node *parse_primary(parser *ps)
{
    tok *t = cur(ps);
    jinja_node *n;
    if (t->k == TK_NAME) {
        ps->pos++;
        n = new_node(ps, JINJA_N_LIT, t->line);
        if (!n) return NULL;
        if (is_name(t, "true") || is_name(t, "True")) {
            n->lit = (jinja_value){.t = JINJA_BOOL, .u.b = true};
        } else if (is_name(t, "false") || is_name(t, "False")) {
            n->lit = (jinja_value){.t = JINJA_BOOL, .u.b = false};
        } else if (is_name(t, "none") || is_name(t, "None")) {
            n->lit = (jinja_value){.t = JINJA_NONE};
        } else {
            n->kind = JINJA_N_NAME;
            n->name = (jinja_str){t->p, t->n};
        }
        return n;
    }
    if (t->k == TK_STRING) {
        /* adjacent literals concatenate */
        size_t total = 0, k = ps->pos;
        while (ps->toks[k].k == TK_STRING) total += ps->toks[k++].n;
        char *buf = jinja_arena_alloc(ps->a, total + 1);
        n = new_node(ps, JINJA_N_LIT, t->line);
        if (!buf || !n) return NULL;
        size_t o = 0;
        while (cur(ps)->k == TK_STRING) {
            memcpy(buf + o, cur(ps)->p, cur(ps)->n);
            o += cur(ps)->n;
            ps->pos++;
        }
        n->lit = (jinja_value){.t = JINJA_STR, .u.s = {buf, o}};
        return n;
    }
    if (t->k == TK_INT || t->k == TK_FLOAT) {
        ps->pos++;
        n = new_node(ps, JINJA_N_LIT, t->line);
        if (!n) return NULL;
        if (t->k == TK_INT) n->lit = (jinja_value){.t = JINJA_INT, .u.i = t->i};
        else n->lit = (jinja_value){.t = JINJA_FLOAT, .u.f = t->f};
        return n;
    }
    if (accept_op(ps, "(")) {
        if (accept_op(ps, ")")) { /* () */
            n = new_node(ps, JINJA_N_LIST, t->line);
            if (n) n->op = 1;
            return n;
        }
        jinja_node *e = parse_expr(ps);
        if (!e) return NULL;
        if (is_op(cur(ps), ",")) { /* tuple */
            n = new_node(ps, JINJA_N_LIST, t->line);
            if (!n || push_kid(ps, &n->kids, &n->nkids, e)) return NULL;
            n->op = 1;
            while (accept_op(ps, ",")) {
                if (is_op(cur(ps), ")")) break;
                if (!(e = parse_expr(ps)) || push_kid(ps, &n->kids, &n->nkids, e)) return NULL;
            }
            e = n;
        }
        if (expect_op(ps, ")")) return NULL;
        return e;
    }
    if (accept_op(ps, "[")) {
        n = new_node(ps, JINJA_N_LIST, t->line);
        if (!n) return NULL;
        while (!accept_op(ps, "]")) {
            if (n->nkids && expect_op(ps, ",")) return NULL;
            if (accept_op(ps, "]")) break;
            jinja_node *e = parse_expr(ps);
            if (!e || push_kid(ps, &n->kids, &n->nkids, e)) return NULL;
        }
        return n;
    }
    if (accept_op(ps, "{")) {
        n = new_node(ps, JINJA_N_DICT, t->line);
        if (!n) return NULL;
        while (!accept_op(ps, "}")) {
            if (n->nkids && expect_op(ps, ",")) return NULL;
            if (accept_op(ps, "}")) break;
            jinja_node *k = parse_expr(ps);
            if (!k || expect_op(ps, ":")) return NULL;
            jinja_node *v = parse_expr(ps);
            if (!v || push_kid(ps, &n->kids, &n->nkids, k) || push_kid(ps, &n->kids, &n->nkids, v))
                return NULL;
        }
        return n;
    }
    return unexpected(ps, "an expression"), NULL;
}

static jinja_node *parse_unary(parser *ps, bool with_filter)
{
    tok *t = cur(ps);
    jinja_node *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        ps->pos++;
        if (++ps->depth > JINJA_MAX_DEPTH) return perr(ps, t->line, "expression nested too deeply%s", ""), NULL;
        jinja_node *x = parse_unary(ps, false);
        ps->depth--;
        if (!x) return NULL;
        if (is_op(t, "+")) {
            n = x;
        } else {
            if (!(n = new_node(ps, JINJA_N_NEG, t->line))) return NULL;
            n->a = x;
        }
    } else {
        if (!(n = parse_primary(ps))) return NULL;
    }
    if (!(n = parse_postfix(ps, n))) return NULL;
    if (with_filter) n = parse_filters(ps, n);
    return n;
}

static jinja_node *binop(parser *ps, int op, jinja_node *l, jinja_node *r, int line)
{
    if (!l || !r) return NULL;
    jinja_node *n = new_node(ps, JINJA_N_BINOP, line);
    if (!n) return NULL;
    n->op = op;
    n->a = l;
    n->b = r;
    return n;
}

static jinja_node *parse_pow(parser *ps)
{
    jinja_node *l = parse_unary(ps, true);
    while (l && is_op(cur(ps), "**")) {
        int line = cur(ps)->line;
        ps->pos++;
        l = binop(ps, JINJA_OP_POW, l, parse_unary(ps, true), line);
    }
    return l;
}

static jinja_node *parse_math2(parser *ps)
{
    jinja_node *l = parse_pow(ps);
    for (;;) {
        if (!l) return NULL;
        tok *t = cur(ps);
        int op = is_op(t, "*") ? JINJA_OP_MUL : is_op(t, "/") ? JINJA_OP_DIV
               : is_op(t, "//") ? JINJA_OP_FLOORDIV : is_op(t, "%") ? JINJA_OP_MOD : 0;
        if (!op) return l;
        ps->pos++;
        l = binop(ps, op, l, parse_pow(ps), t->line);
    }
}

static jinja_node *parse_concat(parser *ps)
{
    jinja_node *l = parse_math2(ps);
    while (l && is_op(cur(ps), "~")) {
        int line = cur(ps)->line;
        ps->pos++;
        l = binop(ps, JINJA_OP_CONCAT, l, parse_math2(ps), line);
    }
    return l;
}

static jinja_node *parse_math1(parser *ps)
{
    jinja_node *l = parse_concat(ps);
    for (;;) {
        if (!l) return NULL;
        tok *t = cur(ps);
        int op = is_op(t, "+") ? JINJA_OP_ADD : is_op(t, "-") ? JINJA_OP_SUB : 0;
        if (!op) return l;
        ps->pos++;
        l = binop(ps, op, l, parse_concat(ps), t->line);
    }
}

/* Chained comparisons (a < b < c) are evaluated pairwise with `and`, as Python does. */
static jinja_node *parse_compare(parser *ps)
{
    jinja_node *l = parse_math1(ps), *result = NULL;
    for (;;) {
        if (!l) return NULL;
        tok *t = cur(ps);
        int op = 0;
        if (is_op(t, "==")) op = JINJA_OP_EQ;
        else if (is_op(t, "!=")) op = JINJA_OP_NE;
        else if (is_op(t, "<")) op = JINJA_OP_LT;
        else if (is_op(t, "<=")) op = JINJA_OP_LE;
        else if (is_op(t, ">")) op = JINJA_OP_GT;
        else if (is_op(t, ">=")) op = JINJA_OP_GE;
        else if (is_name(t, "in")) op = JINJA_OP_IN;
        else if (is_name(t, "not") && is_name(&ps->toks[ps->pos + 1], "in")) op = JINJA_OP_NOTIN;
        if (!op) return result ? result : l;
        ps->pos += op == JINJA_OP_NOTIN ? 2 : 1;
        jinja_node *r = parse_math1(ps);
        jinja_node *cmp = binop(ps, op, l, r, t->line);
        if (!cmp) return NULL;
        if (result) {
            jinja_node *and = new_node(ps, JINJA_N_AND, t->line);
            if (!and) return NULL;
            and->a = result;
            and->b = cmp;
            result = and;
        } else {
            result = cmp;
        }
        l = r;
    }
}

static jinja_node *parse_not(parser *ps)
{
    tok *t = cur(ps);
    if (accept_name(ps, "not")) {
        if (++ps->depth > JINJA_MAX_DEPTH) return perr(ps, t->line, "expression nested too deeply%s", ""), NULL;
        jinja_node *x = parse_not(ps);
        ps->depth--;
        jinja_node *n = x ? new_node(ps, JINJA_N_NOT, t->line) : NULL;
        if (n) n->a = x;
        return n;
    }
    return parse_compare(ps);
}

static jinja_node *parse_and(parser *ps)
{
    jinja_node *l = parse_not(ps);
    while (l && is_name(cur(ps), "and")) {
        int line = cur(ps)->line;
        ps->pos++;
        jinja_node *r = parse_not(ps);
        jinja_node *n = r ? new_node(ps, JINJA_N_AND, line) : NULL;
        if (!n) return NULL;
        n->a = l;
        n->b = r;
        l = n;
    }
    return l;
}

static jinja_node *parse_or(parser *ps)
{
    jinja_node *l = parse_and(ps);
    while (l && is_name(cur(ps), "or")) {
        int line = cur(ps)->line;
        ps->pos++;
        jinja_node *r = parse_and(ps);
        jinja_node *n = r ? new_node(ps, JINJA_N_OR, line) : NULL;
        if (!n) return NULL;
        n->a = l;
        n->b = r;
        l = n;
    }
    return l;
}

static jinja_node *parse_expr(parser *ps)
{
    if (++ps->depth > JINJA_MAX_DEPTH) return perr(ps, cur(ps)->line, "expression nested too deeply%s", ""), NULL;
    jinja_node *e = parse_or(ps);
    ps->depth--;
    while (e && is_name(cur(ps), "if")) {
        int line = cur(ps)->line;
        ps->pos++;
        jinja_node *n = new_node(ps, JINJA_N_CONDEXPR, line);
        if (!n || !(n->b = parse_or(ps))) return NULL;
        n->a = e;
        if (accept_name(ps, "else") && !(n->c = parse_expr(ps))) return NULL;
        e = n;
    }
    return e;
}

/* A tuple without parentheses, as in `{% set a, b = ... %}` values or `{{ a, b }}`. */
static jinja_node *parse_tuple(parser *ps)
{
    int line = cur(ps)->line;
    jinja_node *e = parse_expr(ps);
    if (!e || !is_op(cur(ps), ",")) return e;
    jinja_node *n = new_node(ps, JINJA_N_LIST, line);
    if (!n || push_kid(ps, &n->kids, &n->nkids, e)) return NULL;
    n->op = 1;
    while (accept_op(ps, ",")) {
        if (cur(ps)->k == TK_BLOCK_END || cur(ps)->k == TK_VAR_END) break;
        if (!(e = parse_expr(ps)) || push_kid(ps, &n->kids, &n->nkids, e)) return NULL;
    }
    return n;
}

/* Names separated by commas (for/set targets). */
static int parse_targets(parser *ps, jinja_node *n)
{
    bool paren = accept_op(ps, "(");
    do {
        if (cur(ps)->k != TK_NAME) return unexpected(ps, "a variable name");
        if (push_str(ps, &n->targets, &n->ntargets, (jinja_str){cur(ps)->p, cur(ps)->n})) return -1;
        ps->pos++;
    } while (accept_op(ps, ","));
    return paren ? expect_op(ps, ")") : 0;
}

static jinja_node *parse_body(parser *ps, const char *const *ends, const char **which);

static int end_block(parser *ps)
{
    return expect_kind(ps, TK_BLOCK_END, "'%}'");
}

/* Parses {% name ... %} starting after the name. */
static jinja_node *parse_statement(parser *ps, tok *kw)
{
    int line = kw->line;
    jinja_node *n;
    const char *which;
    if (is_name(kw, "if") || is_name(kw, "elif")) {
        n = new_node(ps, JINJA_N_IF, line);
        if (!n || !(n->a = parse_expr(ps)) || end_block(ps)) return NULL;
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        if (!(n->b = parse_body(ps, ends, &which))) return NULL;
        if (strcmp(which, "elif") == 0) {
            if (++ps->depth > JINJA_MAX_DEPTH) return perr(ps, line, "elif chain too long%s", ""), NULL;
            n->c = parse_statement(ps, &ps->toks[ps->pos - 1]);
            ps->depth--;
            if (!n->c) return NULL;
            return n; /* the nested if consumed endif */
        }
        if (strcmp(which, "else") == 0) {
            static const char *const ends2[] = {"endif", NULL};
            if (end_block(ps) || !(n->c = parse_body(ps, ends2, &which))) return NULL;
        }
        return end_block(ps) ? NULL : n;
    }
    if (is_name(kw, "for")) {
        n = new_node(ps, JINJA_N_FOR, line);
        if (!n || parse_targets(ps, n)) return NULL;
        if (!accept_name(ps, "in")) return unexpected(ps, "'in'"), NULL;
        if (!(n->a = parse_or(ps))) return NULL; /* no inline if: `if` filters the loop */
        if (accept_name(ps, "if") && !(n->d = parse_expr(ps))) return NULL;
        accept_name(ps, "recursive");
        if (end_block(ps)) return NULL;
        static const char *const ends[] = {"else", "endfor", NULL};
        if (!(n->b = parse_body(ps, ends, &which))) return NULL;
        if (strcmp(which, "else") == 0) {
            static const char *const ends2[] = {"endfor", NULL};
            if (end_block(ps) || !(n->c = parse_body(ps, ends2, &which))) return NULL;
        }
        return end_block(ps) ? NULL : n;
    }
    if (is_name(kw, "set")) {
        tok *t = cur(ps);
        if (t->k == TK_NAME && is_op(&ps->toks[ps->pos + 1], ".")) { /* set ns.attr = v */
            n = new_node(ps, JINJA_N_SET, line);
            if (!n) return NULL;
            n->name = (jinja_str){t->p, t->n};
            ps->pos += 2;
            if (cur(ps)->k != TK_NAME) return unexpected(ps, "an attribute name"), NULL;
            n->attr = (jinja_str){cur(ps)->p, cur(ps)->n};
            ps->pos++;
            if (expect_op(ps, "=") || !(n->a = parse_tuple(ps)) || end_block(ps)) return NULL;
            return n;
        }
        n = new_node(ps, JINJA_N_SET, line);
        if (!n || parse_targets(ps, n)) return NULL;
        if (cur(ps)->k == TK_BLOCK_END && n->ntargets == 1) { /* {% set x %}...{% endset %} */
            n->kind = JINJA_N_SETBLOCK;
            static const char *const ends[] = {"endset", NULL};
            if (end_block(ps) || !(n->b = parse_body(ps, ends, &which)) || end_block(ps)) return NULL;
            return n;
        }
        if (expect_op(ps, "=") || !(n->a = parse_tuple(ps)) || end_block(ps)) return NULL;
        return n;
    }
    if (is_name(kw, "macro")) {
        n = new_node(ps, JINJA_N_MACRO, line);
        if (!n) return NULL;
        if (cur(ps)->k != TK_NAME) return unexpected(ps, "a macro name"), NULL;
        n->name = (jinja_str){cur(ps)->p, cur(ps)->n};
        ps->pos++;
        if (expect_op(ps, "(")) return NULL;
        while (!accept_op(ps, ")")) {
            if (n->ntargets && expect_op(ps, ",")) return NULL;
            if (cur(ps)->k != TK_NAME) return unexpected(ps, "a parameter name"), NULL;
            if (push_str(ps, &n->targets, &n->ntargets, (jinja_str){cur(ps)->p, cur(ps)->n}))
                return NULL;
            ps->pos++;
            jinja_node *def = NULL;
            if (accept_op(ps, "=") && !(def = parse_expr(ps))) return NULL;
            size_t nk = n->nkids;
            if (push_kid(ps, &n->kids, &nk, def)) return NULL;
            n->nkids = nk;
        }
        static const char *const ends[] = {"endmacro", NULL};
        if (end_block(ps) || !(n->b = parse_body(ps, ends, &which)) || end_block(ps)) return NULL;
        return n;
    }
    if (is_name(kw, "break") || is_name(kw, "continue")) {
        n = new_node(ps, is_name(kw, "break") ? JINJA_N_BREAK : JINJA_N_CONTINUE, line);
        return !n || end_block(ps) ? NULL : n;
    }
    if (is_name(kw, "generation")) { /* transformers' assistant-mask marker: renders its body */
        static const char *const ends[] = {"endgeneration", NULL};
        if (end_block(ps) || !(n = parse_body(ps, ends, &which)) || end_block(ps)) return NULL;
        return n;
    }
    if (is_name(kw, "do")) { /* expression statement: evaluate, discard */
        n = new_node(ps, JINJA_N_SET, line);
        if (!n || !(n->a = parse_tuple(ps)) || end_block(ps)) return NULL;
        return n; /* no targets: value dropped */
    }
    char buf[64];
    snprintf(buf, sizeof buf, "%.*s", (int)(kw->n > 40 ? 40 : kw->n), kw->p);
    return perr(ps, line, "unknown or unsupported tag '%s'", buf), NULL;
}

/* Parses statements up to one of the block names in `ends` (NULL-terminated; NULL for the
 * top level, which runs to EOF). On return the cursor is after the end tag's name and *which
 * names it. */
static jinja_node *parse_body(parser *ps, const char *const *ends, const char **which)
{
    if (ps->depth + 1 > JINJA_MAX_DEPTH) return perr(ps, cur(ps)->line, "blocks nested too deeply%s", ""), NULL;
    jinja_node *body = new_node(ps, JINJA_N_BODY, cur(ps)->line);
    if (!body) return NULL;
    for (;;) {
        tok *t = cur(ps);
        jinja_node *n = NULL;
        if (t->k == TK_EOF) {
            if (!ends) return body;
            return perr(ps, t->line, "unexpected end of template, expected {%% %s %%}", ends[ends[1] ? 1 : 0]), NULL;
        } else if (t->k == TK_TEXT) {
            ps->pos++;
            if (!(n = new_node(ps, JINJA_N_TEXT, t->line))) return NULL;
            n->name = (jinja_str){t->p, t->n};
        } else if (t->k == TK_VAR_BEGIN) {
            ps->pos++;
            if (!(n = new_node(ps, JINJA_N_OUTPUT, t->line))) return NULL;
            if (!(n->a = parse_tuple(ps)) || expect_kind(ps, TK_VAR_END, "'}}'")) return NULL;
        } else if (t->k == TK_BLOCK_BEGIN) {
            ps->pos++;
            tok *kw = cur(ps);
            if (kw->k != TK_NAME) return unexpected(ps, "a tag name"), NULL;
            for (size_t k = 0; ends && ends[k]; k++)
                if (is_name(kw, ends[k])) {
                    ps->pos++;
                    *which = ends[k];
                    return body;
                }
            ps->pos++;
            ps->depth++;
            n = parse_statement(ps, kw);
            ps->depth--;
            if (!n) return NULL;
        } else {
            return unexpected(ps, "template text or a tag"), NULL;
        }
        if (push_kid(ps, &body->kids, &body->nkids, n)) return NULL;
    }
}

jinja_node *jinja_parse(jinja_arena *a, const char *src, char *err, size_t errlen)
{
    parser ps = {.a = a, .err = err, .errlen = errlen};
    size_t n = strlen(src);
    char *norm = jinja_arena_alloc(a, n + 1);
    if (!norm) return ms_errf(err, errlen, "out of memory"), NULL;
    /* jinja2 turns \r\n and \r into \n and drops one trailing newline */
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (src[i] == '\r') {
            norm[o++] = '\n';
            if (i + 1 < n && src[i + 1] == '\n') i++;
        } else {
            norm[o++] = src[i];
        }
    }
    if (o && norm[o - 1] == '\n') o--;
    norm[o] = 0;
    ps.src = norm;
    ps.len = o;
    jinja_node *root = NULL;
    if (lex(&ps) == 0) root = parse_body(&ps, NULL, NULL);
    free(ps.toks);
    return root;
}
