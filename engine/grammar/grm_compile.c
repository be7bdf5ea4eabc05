/* Grammar compilation (see grammar.h): every input form becomes EBNF text first (regular
 * expressions and choices are translated here, JSON Schemas by json_schema.c), one parser
 * turns EBNF into rules over byte sets, and a last pass flattens the rules into the arrays the
 * matcher walks and refuses left recursion. Quantified items become small helper rules:
 * x? is (x | ""), x* is a right-recursive rule, x{m,n} m copies and a chain of n-m optional
 * ones. Code-point classes become alternatives of UTF-8 byte-range sequences. */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "grm_internal.h"
#include "json_schema.h"
#include "unicode.h"

/* ---- the rule builder ----------------------------------------------------------------- */

struct gb_rule {
    uint32_t *els; /* alternatives, each ended by GRM_EL_END */
    int n, cap;
    int n_alts;
    char name[48];
    bool defined, referenced;
};

struct gb {
    struct gb_rule *rules;
    int n_rules, cap_rules;
    struct grm_set *sets;
    int n_sets, cap_sets;
    int total;
    char *err;
    size_t errlen;
    bool failed;
};

static int gb_fail(struct gb *b, const char *msg, const char *arg)
{
    if (!b->failed) ms_errf(b->err, b->errlen, msg, arg ? arg : "");
    b->failed = true;
    return -1;
}

static int gb_new_rule(struct gb *b, const char *name, size_t nlen)
{
    if (b->failed) return -1;
    if (b->n_rules >= GRM_MAX_RULES) return gb_fail(b, "the grammar has too many rules%s", NULL);
    if (b->n_rules == b->cap_rules) {
        int cap = b->cap_rules ? b->cap_rules * 2 : 64;
        struct gb_rule *r = realloc(b->rules, sizeof *r * (size_t)cap);
        if (!r) return gb_fail(b, "out of memory%s", NULL);
        b->rules = r;
        b->cap_rules = cap;
    }
    struct gb_rule *r = &b->rules[b->n_rules];
    memset(r, 0, sizeof *r);
    if (nlen >= sizeof r->name) nlen = sizeof r->name - 1;
    memcpy(r->name, name, nlen);
    r->name[nlen] = '\0';
    return b->n_rules++;
}

/* The rule called name (created, undefined, on first mention). */
static int gb_named(struct gb *b, const char *name, size_t nlen)
{
    for (int i = 0; i < b->n_rules; i++)
        if (strlen(b->rules[i].name) == nlen && memcmp(b->rules[i].name, name, nlen) == 0 &&
            b->rules[i].name[0] != '_')
            return i;
    return gb_new_rule(b, name, nlen);
}

/* A helper rule, named after the rule it serves (for error messages). */
static int gb_anon(struct gb *b, int parent)
{
    char name[48];
    int n = snprintf(name, sizeof name, "_%s", parent >= 0 ? b->rules[parent].name : "");
    int r = gb_new_rule(b, name, (size_t)(n < (int)sizeof name ? n : (int)sizeof name - 1));
    if (r >= 0) b->rules[r].defined = true;
    return r;
}

static int gb_push(struct gb *b, int rule, uint32_t el)
{
    if (b->failed || rule < 0) return -1;
    if (b->total >= GRM_MAX_ELEMENTS) return gb_fail(b, "the grammar is too large%s", NULL);
    struct gb_rule *r = &b->rules[rule];
    if (r->n == r->cap) {
        int cap = r->cap ? r->cap * 2 : 8;
        uint32_t *e = realloc(r->els, sizeof *e * (size_t)cap);
        if (!e) return gb_fail(b, "out of memory%s", NULL);
        r->els = e;
        r->cap = cap;
    }
    r->els[r->n++] = el;
    b->total++;
    if (GRM_EL_KIND(el) == GRM_EL_END) r->n_alts++;
    if (GRM_EL_KIND(el) == GRM_EL_REF) b->rules[GRM_EL_IDX(el)].referenced = true;
    return 0;
}

static int gb_set_bits(struct gb *b, const struct grm_set *s)
{
    for (int i = 0; i < b->n_sets; i++)
        if (memcmp(&b->sets[i], s, sizeof *s) == 0) return i;
    if (b->failed) return -1;
    if (b->n_sets == b->cap_sets) {
        int cap = b->cap_sets ? b->cap_sets * 2 : 64;
        struct grm_set *n = realloc(b->sets, sizeof *n * (size_t)cap);
        if (!n) return gb_fail(b, "out of memory%s", NULL);
        b->sets = n;
        b->cap_sets = cap;
    }
    b->sets[b->n_sets] = *s;
    return b->n_sets++;
}

static int gb_set_range(struct gb *b, unsigned lo, unsigned hi)
{
    struct grm_set s = {{0, 0, 0, 0}};
    for (unsigned c = lo; c <= hi; c++) s.bits[c >> 6] |= 1ull << (c & 63);
    return gb_set_bits(b, &s);
}

static void gb_free(struct gb *b)
{
    for (int i = 0; i < b->n_rules; i++) free(b->rules[i].els);
    free(b->rules);
    free(b->sets);
}

/* ---- code-point classes as UTF-8 byte sequences --------------------------------------- */

struct cp_range {
    uint32_t lo, hi;
};

static int cmp_range(const void *a, const void *b)
{
    uint32_t x = ((const struct cp_range *)a)->lo, y = ((const struct cp_range *)b)->lo;
    return (x > y) - (x < y);
}

/* Sorts and merges r[0..n), optionally complements it within [0, 0x10FFFF], and removes the
 * surrogates. out needs room for n + 2 ranges. Returns the count. */
static int normalize_ranges(struct cp_range *r, int n, bool negate, struct cp_range *out)
{
    qsort(r, (size_t)n, sizeof *r, cmp_range);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m && r[i].lo <= out[m - 1].hi + 1) {
            if (r[i].hi > out[m - 1].hi) out[m - 1].hi = r[i].hi;
        } else {
            out[m++] = r[i];
        }
    }
    if (negate) {
        struct cp_range *tmp = malloc(sizeof *tmp * (size_t)(m + 2));
        if (!tmp) return -1;
        int k = 0;
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (out[i].lo > next) tmp[k++] = (struct cp_range){next, out[i].lo - 1};
            next = out[i].hi + 1;
        }
        if (next <= 0x10FFFF) tmp[k++] = (struct cp_range){next, 0x10FFFF};
        memcpy(out, tmp, sizeof *tmp * (size_t)k);
        free(tmp);
        m = k;
    }
    /* cut the surrogates out (at most one range holds them: they are contiguous) */
    for (int i = 0; i < m; i++) {
        if (out[i].hi < 0xD800 || out[i].lo > 0xDFFF) continue;
        struct cp_range a = {out[i].lo, 0xD7FF}, z = {0xE000, out[i].hi};
        bool ka = out[i].lo < 0xD800, kz = out[i].hi > 0xDFFF;
        if (ka && kz) {
            memmove(&out[i + 2], &out[i + 1], sizeof *out * (size_t)(m - i - 1));
            out[i] = a;
            out[i + 1] = z;
            m++;
        } else if (ka || kz) {
            out[i] = ka ? a : z;
        } else {
            memmove(&out[i], &out[i + 1], sizeof *out * (size_t)(m - i - 1));
            m--;
        }
        break;
    }
    return m;
}

/* Appends to `rule` one alternative per UTF-8 byte-range sequence of [lo, hi] (both of the
 * same encoded length), splitting until every byte position is a plain range. */
static void utf8_seqs(struct gb *b, int rule, uint32_t lo, uint32_t hi)
{
    char lb[4], hb[4];
    int n = uni_utf8_put(lo, lb);
    uni_utf8_put(hi, hb);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_seqs(b, rule, lo, lo | m);
                utf8_seqs(b, rule, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_seqs(b, rule, lo, (hi & ~m) - 1);
                utf8_seqs(b, rule, hi & ~m, hi);
                return;
            }
        }
    }
    for (int k = 0; k < n; k++)
        gb_push(b, rule, GRM_EL(GRM_EL_SET, gb_set_range(b, (unsigned char)lb[k],
                                                        (unsigned char)hb[k])));
    gb_push(b, rule, GRM_EL(GRM_EL_END, 0));
}

/* The elements of a class: one set when all of it is ASCII, else a helper rule. Fills prim
 * with one element. */
static int class_element(struct gb *b, int parent, struct cp_range *r, int n, bool negate,
                         uint32_t *prim)
{
    struct cp_range *norm = malloc(sizeof *norm * (size_t)(n + 3));
    if (!norm) return gb_fail(b, "out of memory%s", NULL);
    int m = normalize_ranges(r, n, negate, norm);
    if (m <= 0) {
        free(norm);
        return gb_fail(b, m < 0 ? "out of memory%s" : "a character class matches nothing%s",
                       NULL);
    }
    if (norm[m - 1].hi < 0x80 && m == 1) {
        *prim = GRM_EL(GRM_EL_SET, gb_set_range(b, norm[0].lo, norm[0].hi));
        free(norm);
        return b->failed ? -1 : 0;
    }
    int rule = gb_anon(b, parent);
    struct grm_set ascii = {{0, 0, 0, 0}};
    bool any_ascii = false;
    static const uint32_t bounds[4][2] = {{0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xFFFF},
                                          {0x10000, 0x10FFFF}};
    for (int i = 0; i < m; i++)
        for (int L = 0; L < 4; L++) {
            uint32_t lo = norm[i].lo > bounds[L][0] ? norm[i].lo : bounds[L][0];
            uint32_t hi = norm[i].hi < bounds[L][1] ? norm[i].hi : bounds[L][1];
            if (lo > hi) continue;
            if (L == 0) {
                for (uint32_t c = lo; c <= hi; c++) ascii.bits[c >> 6] |= 1ull << (c & 63);
                any_ascii = true;
            } else {
                utf8_seqs(b, rule, lo, hi);
            }
        }
    free(norm);
    if (any_ascii && !b->failed) {
        gb_push(b, rule, GRM_EL(GRM_EL_SET, gb_set_bits(b, &ascii)));
        gb_push(b, rule, GRM_EL(GRM_EL_END, 0));
    }
    *prim = GRM_EL(GRM_EL_REF, rule);
    return b->failed ? -1 : 0;
}

/* ---- the EBNF parser ------------------------------------------------------------------ */

struct ps {
    const char *s;
    size_t i, n;
    int line;
    struct gb *b;
};

static void skip_ws(struct ps *p)
{
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n') p->i++;
        } else if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
            if (c == '\n') p->line++;
            p->i++;
        } else {
            break;
        }
    }
}

static bool is_name_char(char c, bool first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
           (!first && ((c >= '0' && c <= '9') || c == '-'));
}

static size_t name_len(const struct ps *p, size_t at)
{
    size_t k = at;
    if (k < p->n && is_name_char(p->s[k], true))
        while (k < p->n && is_name_char(p->s[k], false)) k++;
    return k - at;
}

/* Whether a rule definition "name ::=" starts at p->i. */
static bool at_definition(const struct ps *p)
{
    size_t k = p->i + name_len(p, p->i);
    if (k == p->i) return false;
    while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t')) k++;
    return p->n - k >= 3 && memcmp(p->s + k, "::=", 3) == 0;
}

static int perr(struct ps *p, const char *what)
{
    if (!p->b->failed)
        ms_errf(p->b->err, p->b->errlen, "grammar line %d: %s", p->line, what);
    p->b->failed = true;
    return -1;
}

static int hex_digits(struct ps *p, int count, uint32_t *out)
{
    uint32_t v = 0;
    for (int k = 0; k < count; k++) {
        if (p->i >= p->n) return perr(p, "truncated escape");
        char c = p->s[p->i++];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                               : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return perr(p, "bad hex digit in an escape");
        v = v * 16 + (uint32_t)d;
    }
    *out = v;
    return 0;
}

/* One character of a literal or class: a code point, or with *is_byte a raw byte (\xHH in a
 * literal). */
static int read_char(struct ps *p, bool in_class, uint32_t *cp, bool *is_byte)
{
    *is_byte = false;
    if (p->i >= p->n) return perr(p, "unterminated literal or class");
    unsigned char c = (unsigned char)p->s[p->i];
    if (c != '\\') {
        int k = uni_utf8_next((const unsigned char *)p->s + p->i, p->n - p->i, cp);
        if (k <= 0) return perr(p, "invalid UTF-8");
        p->i += (size_t)k;
        return 0;
    }
    p->i++;
    if (p->i >= p->n) return perr(p, "truncated escape");
    char e = p->s[p->i++];
    switch (e) {
    case 'n': *cp = '\n'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case '0': *cp = 0; return 0;
    case 'x':
        *is_byte = !in_class;
        return hex_digits(p, 2, cp);
    case 'u': return hex_digits(p, 4, cp);
    case 'U': return hex_digits(p, 8, cp);
    case '\\': case '"': case ']': case '[': case '-': case '^': case '/': case '\'':
        *cp = (uint32_t)e;
        return 0;
    default: return perr(p, "unknown escape");
    }
}

#define MAX_PRIM 4096 /* bytes of one literal */

static int parse_alts(struct ps *p, int rule);

/* A primary into prim[0..*n). */
static int parse_primary(struct ps *p, int rule, uint32_t *prim, int *n)
{
    struct gb *b = p->b;
    char c = p->s[p->i];
    *n = 0;
    if (c == '"') {
        p->i++;
        while (p->i < p->n && p->s[p->i] != '"') {
            uint32_t cp;
            bool is_byte;
            if (read_char(p, false, &cp, &is_byte) < 0) return -1;
            char bytes[4];
            int k = is_byte ? 1 : uni_utf8_put(cp, bytes);
            if (is_byte) bytes[0] = (char)cp;
            if (*n + k > MAX_PRIM) return perr(p, "literal too long");
            for (int j = 0; j < k; j++) {
                int set = gb_set_range(b, (unsigned char)bytes[j], (unsigned char)bytes[j]);
                prim[(*n)++] = GRM_EL(GRM_EL_SET, set);
            }
        }
        if (p->i >= p->n) return perr(p, "unterminated literal");
        p->i++;
        if (*n == 0) return 0; /* "" is the empty string */
        return b->failed ? -1 : 0;
    }
    if (c == '[' || c == '.') {
        struct cp_range *r = NULL;
        int nr = 0, cap = 0;
        bool negate = false;
        if (c == '.') {
            p->i++;
            r = malloc(sizeof *r);
            if (!r) return perr(p, "out of memory");
            r[nr++] = (struct cp_range){0, 0x10FFFF};
        } else {
            p->i++;
            if (p->i < p->n && p->s[p->i] == '^') {
                negate = true;
                p->i++;
            }
            while (p->i < p->n && p->s[p->i] != ']') {
                uint32_t lo, hi;
                bool is_byte;
                if (read_char(p, true, &lo, &is_byte) < 0) goto class_fail;
                hi = lo;
                if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
                    p->i++;
                    if (read_char(p, true, &hi, &is_byte) < 0) goto class_fail;
                    if (hi < lo) {
                        perr(p, "a class range runs backwards");
                        goto class_fail;
                    }
                }
                if (hi > 0x10FFFF) {
                    perr(p, "code point out of range");
                    goto class_fail;
                }
                if (nr == cap) {
                    cap = cap ? cap * 2 : 16;
                    struct cp_range *g = realloc(r, sizeof *g * (size_t)cap);
                    if (!g) {
                        perr(p, "out of memory");
                        goto class_fail;
                    }
                    r = g;
                }
                r[nr++] = (struct cp_range){lo, hi};
            }
            if (p->i >= p->n) {
                perr(p, "unterminated class");
                goto class_fail;
            }
            p->i++;
            if (nr == 0 && !negate) {
                perr(p, "empty class");
                goto class_fail;
            }
        }
        int rc = class_element(b, rule, r ? r : (struct cp_range[1]){{0, 0}}, nr, negate, prim);
        free(r);
        if (rc < 0) return -1;
        *n = 1;
        return 0;
    class_fail:
        free(r);
        return -1;
    }
    if (c == '(') {
        p->i++;
        int g = gb_anon(b, rule);
        if (g < 0 || parse_alts(p, g) < 0) return -1;
        skip_ws(p);
        if (p->i >= p->n || p->s[p->i] != ')') return perr(p, "missing ')'");
        p->i++;
        prim[0] = GRM_EL(GRM_EL_REF, g);
        *n = 1;
        return 0;
    }
    size_t nl = name_len(p, p->i);
    if (nl == 0) return perr(p, "expected a literal, a class, a rule name or '('");
    int r = gb_named(b, p->s + p->i, nl);
    p->i += nl;
    if (r < 0) return -1;
    prim[0] = GRM_EL(GRM_EL_REF, r);
    *n = 1;
    return 0;
}

/* A rule "x{0,k}" as a chain: o_k ::= x o_{k-1} | "". Returns its element. */
static uint32_t opt_chain(struct gb *b, int parent, uint32_t x, int k)
{
    uint32_t next = 0;
    for (int j = 1; j <= k; j++) {
        int o = gb_anon(b, parent);
        gb_push(b, o, x);
        if (j > 1) gb_push(b, o, next);
        gb_push(b, o, GRM_EL(GRM_EL_END, 0));
        gb_push(b, o, GRM_EL(GRM_EL_END, 0));
        next = GRM_EL(GRM_EL_REF, o);
    }
    return next;
}

static uint32_t star_rule(struct gb *b, int parent, uint32_t x)
{
    int s = gb_anon(b, parent);
    gb_push(b, s, x);
    gb_push(b, s, GRM_EL(GRM_EL_REF, s));
    gb_push(b, s, GRM_EL(GRM_EL_END, 0));
    gb_push(b, s, GRM_EL(GRM_EL_END, 0));
    return GRM_EL(GRM_EL_REF, s);
}

static int read_int(struct ps *p, long *out)
{
    size_t start = p->i;
    long v = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9' && v < 100000)
        v = v * 10 + (p->s[p->i++] - '0');
    if (p->i == start) return perr(p, "expected a number in {m,n}");
    *out = v;
    return 0;
}

static int parse_item(struct ps *p, int rule, uint32_t *prim)
{
    struct gb *b = p->b;
    int n;
    if (parse_primary(p, rule, prim, &n) < 0) return -1;
    char q = p->i < p->n ? p->s[p->i] : '\0';
    if (q != '*' && q != '+' && q != '?' && q != '{') {
        for (int k = 0; k < n; k++) gb_push(b, rule, prim[k]);
        return b->failed ? -1 : 0;
    }
    if (n == 0) return perr(p, "a quantifier after an empty literal");
    uint32_t x = prim[0];
    if (n > 1) { /* a literal of several bytes repeats as a whole */
        int w = gb_anon(b, rule);
        for (int k = 0; k < n; k++) gb_push(b, w, prim[k]);
        gb_push(b, w, GRM_EL(GRM_EL_END, 0));
        x = GRM_EL(GRM_EL_REF, w);
    }
    p->i++;
    long lo = 0, hi = -1;
    if (q == '?') hi = 1;
    if (q == '+') lo = 1;
    if (q == '{') {
        skip_ws(p);
        if (read_int(p, &lo) < 0) return -1;
        skip_ws(p);
        hi = lo;
        if (p->i < p->n && p->s[p->i] == ',') {
            p->i++;
            skip_ws(p);
            hi = -1;
            if (p->i < p->n && p->s[p->i] != '}' && read_int(p, &hi) < 0) return -1;
            skip_ws(p);
        }
        if (p->i >= p->n || p->s[p->i] != '}') return perr(p, "missing '}'");
        p->i++;
        if (lo > 1000 || hi > 1000 || (hi >= 0 && hi < lo))
            return perr(p, "bad repetition bounds (at most 1000)");
    }
    for (long k = 0; k < lo; k++) gb_push(b, rule, x);
    if (hi < 0) gb_push(b, rule, star_rule(b, rule, x));
    else if (hi > lo) gb_push(b, rule, opt_chain(b, rule, x, (int)(hi - lo)));
    return b->failed ? -1 : 0;
}

static int parse_alts(struct ps *p, int rule)
{
    uint32_t *prim = malloc(sizeof *prim * MAX_PRIM);
    if (!prim) return perr(p, "out of memory");
    int rc = -1;
    for (;;) {
        for (;;) {
            skip_ws(p);
            if (p->i >= p->n) break;
            char c = p->s[p->i];
            if (c == '|' || c == ')' || at_definition(p)) break;
            if (parse_item(p, rule, prim) < 0) goto out;
        }
        gb_push(p->b, rule, GRM_EL(GRM_EL_END, 0));
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        break;
    }
    rc = p->b->failed ? -1 : 0;
out:
    free(prim);
    return rc;
}

static int parse_ebnf(struct gb *b, const char *src)
{
    struct ps p = {.s = src, .n = strlen(src), .line = 1, .b = b};
    for (;;) {
        skip_ws(&p);
        if (p.i >= p.n) break;
        if (!at_definition(&p)) return perr(&p, "expected a rule definition 'name ::= ...'");
        size_t nl = name_len(&p, p.i);
        int r = gb_named(b, p.s + p.i, nl);
        if (r < 0) return -1;
        if (b->rules[r].defined) return gb_fail(b, "rule '%s' is defined twice", b->rules[r].name);
        b->rules[r].defined = true;
        p.i += nl;
        skip_ws(&p);
        p.i += 3; /* ::= */
        if (parse_alts(&p, r) < 0) return -1;
        if (p.i < p.n && p.s[p.i] == ')') return perr(&p, "unbalanced ')'");
    }
    return 0;
}

/* ---- the EBNF text buffer (grm_internal.h) ---------------------------------------------- */

void grm_txt_put(struct grm_txt *t, const char *s, size_t n)
{
    if (t->failed) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        while (cap < t->len + n + 1) cap *= 2;
        char *q = realloc(t->p, cap);
        if (!q) {
            t->failed = true;
            return;
        }
        t->p = q;
        t->cap = cap;
    }
    memcpy(t->p + t->len, s, n);
    t->len += n;
    t->p[t->len] = '\0';
}

void grm_txt_puts(struct grm_txt *t, const char *s)
{
    grm_txt_put(t, s, strlen(s));
}

void grm_txt_putf(struct grm_txt *t, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof buf) n = (int)sizeof buf - 1;
    grm_txt_put(t, buf, (size_t)n);
}

void grm_txt_literal(struct grm_txt *t, const char *s, size_t n)
{
    grm_txt_puts(t, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\' || c < 0x20 || c == 0x7f) grm_txt_putf(t, "\\x%02X", c);
        else grm_txt_put(t, (const char *)&c, 1);
    }
    grm_txt_puts(t, "\"");
}

/* ---- other forms as EBNF text ---------------------------------------------------------- */

static void put_cp(struct grm_txt *t, uint32_t cp)
{
    char buf[16];
    snprintf(buf, sizeof buf, "\\U%08X", cp);
    grm_txt_puts(t, buf);
}

static int choice_to_ebnf(const char *json, char **out, char *err, size_t errlen)
{
    json_error_t je;
    json_t *arr = json_loads(json, 0, &je);
    if (!json_is_array(arr) || json_array_size(arr) == 0) {
        json_decref(arr);
        return ms_errf(err, errlen, "choices must be a non-empty JSON array of strings");
    }
    struct grm_txt t = {0};
    grm_txt_puts(&t, "root ::= ");
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v)
    {
        if (!json_is_string(v)) {
            json_decref(arr);
            free(t.p);
            return ms_errf(err, errlen, "choice %zu is not a string", i);
        }
        if (i) grm_txt_puts(&t, " | ");
        grm_txt_literal(&t, json_string_value(v), json_string_length(v));
    }
    json_decref(arr);
    if (t.failed) {
        free(t.p);
        return ms_errf(err, errlen, "out of memory");
    }
    *out = t.p;
    return 0;
}

/* A regex class "[...]" (after the '[') as code-point ranges; escapes \d \w \s inside. */
static int regex_class(const char *re, size_t *i, size_t n, struct grm_txt *t, char *err,
                       size_t errlen)
{
    bool neg = false;
    if (*i < n && re[*i] == '^') {
        neg = true;
        (*i)++;
    }
    grm_txt_put(t, neg ? "[^" : "[", neg ? 2 : 1);
    bool first = true;
    while (*i < n && (re[*i] != ']' || first)) {
        first = false;
        uint32_t lo;
        if (re[*i] == '\\' && *i + 1 < n) {
            char e = re[*i + 1];
            *i += 2;
            if (e == 'd') { grm_txt_puts(t, "0-9"); continue; }
            if (e == 'w') { grm_txt_puts(t, "a-zA-Z0-9_"); continue; }
            if (e == 's') { grm_txt_puts(t, " \\t\\n\\r\\f\\v"); continue; }
            if (e == 'D' || e == 'W' || e == 'S' || e == 'p' || e == 'P')
                return ms_errf(err, errlen, "regex: \\%c inside a class is not supported", e);
            if (e == 'n') lo = '\n';
            else if (e == 't') lo = '\t';
            else if (e == 'r') lo = '\r';
            else if (e == 'f') lo = '\f';
            else if (e == 'v') lo = '\v';
            else if (e == 'x' || e == 'u') {
                int k = e == 'x' ? 2 : 4;
                lo = 0;
                for (int j = 0; j < k; j++, (*i)++) {
                    char c = *i < n ? re[*i] : '\0';
                    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                           : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
                    if (d < 0) return ms_errf(err, errlen, "regex: bad \\%c escape", e);
                    lo = lo * 16 + (uint32_t)d;
                }
            } else if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
                return ms_errf(err, errlen, "regex: unknown escape \\%c", e);
            else lo = (uint32_t)(unsigned char)e;
        } else if (re[*i] == '-' ) {
            (*i)++;
            bool range_end = *i < n && re[*i] != ']' && !first;
            grm_txt_puts(t, range_end ? "-" : "\\-");
            continue;
        } else {
            int k = uni_utf8_next((const unsigned char *)re + *i, n - *i, &lo);
            if (k <= 0) return ms_errf(err, errlen, "regex: invalid UTF-8");
            *i += (size_t)k;
        }
        put_cp(t, lo);
    }
    if (*i >= n) return ms_errf(err, errlen, "regex: unterminated class");
    (*i)++;
    grm_txt_put(t, "]", 1);
    return 0;
}

/* Translates a regular expression (Python/JS syntax subset, matched whole) into EBNF. */
static int regex_to_ebnf_text(const char *re, struct grm_txt *t, char *err, size_t errlen)
{
    size_t n = strlen(re), i = 0;
    if (n && re[0] == '^') i = 1;
    if (n > i && re[n - 1] == '$' && (n < 2 || re[n - 2] != '\\')) n--;
    int depth = 0;
    while (i < n) {
        char c = re[i];
        if (c == '(') {
            if (i + 1 < n && re[i + 1] == '?') {
                if (i + 2 < n && re[i + 2] == ':') {
                    i += 3;
                } else if (i + 3 < n && (re[i + 2] == 'P' || re[i + 2] == '<') &&
                           (re[i + 3] == '<' || (re[i + 2] == '<' && re[i + 3] != '=' &&
                                                  re[i + 3] != '!'))) {
                    const char *close = memchr(re + i, '>', n - i);
                    if (!close) return ms_errf(err, errlen, "regex: unterminated group name");
                    i = (size_t)(close - re) + 1;
                } else {
                    return ms_errf(err, errlen,
                                   "regex: lookaround, flags and other (?...) groups are not "
                                   "supported");
                }
            } else {
                i++;
            }
            depth++;
            grm_txt_puts(t, " (");
            continue;
        }
        if (c == ')') {
            if (--depth < 0) return ms_errf(err, errlen, "regex: unbalanced ')'");
            grm_txt_puts(t, " )");
            i++;
            continue;
        }
        if (c == '|') {
            grm_txt_puts(t, " |");
            i++;
            continue;
        }
        if (c == '*' || c == '+' || c == '?') {
            grm_txt_put(t, &c, 1);
            i++;
            if (i < n && re[i] == '?') i++; /* lazy: the same strings */
            if (i < n && re[i] == '+') return ms_errf(err, errlen, "regex: possessive quantifiers are not supported");
            continue;
        }
        if (c == '{') {
            size_t k = i + 1;
            while (k < n && ((re[k] >= '0' && re[k] <= '9') || re[k] == ',')) k++;
            if (k < n && re[k] == '}' && k > i + 1 && re[i + 1] != ',') {
                grm_txt_put(t, re + i, k + 1 - i);
                i = k + 1;
                if (i < n && re[i] == '?') i++;
                continue;
            }
            grm_txt_puts(t, " \"{\"");
            i++;
            continue;
        }
        if (c == '[') {
            i++;
            grm_txt_put(t, " ", 1);
            if (regex_class(re, &i, n, t, err, errlen) < 0) return -1;
            continue;
        }
        if (c == '.') {
            grm_txt_puts(t, " [^\\n]");
            i++;
            continue;
        }
        if (c == '^' || c == '$') return ms_errf(err, errlen, "regex: anchors are supported only at the ends");
        grm_txt_put(t, " ", 1);
        if (c == '\\' && i + 1 < n) {
            char e = re[i + 1];
            i += 2;
            const char *cls = NULL;
            switch (e) {
            case 'd': cls = "[0-9]"; break;
            case 'D': cls = "[^0-9]"; break;
            case 'w': cls = "[a-zA-Z0-9_]"; break;
            case 'W': cls = "[^a-zA-Z0-9_]"; break;
            case 's': cls = "[ \\t\\n\\r\\f\\v]"; break;
            case 'S': cls = "[^ \\t\\n\\r\\f\\v]"; break;
            case 'n': cls = "\"\\n\""; break;
            case 't': cls = "\"\\t\""; break;
            case 'r': cls = "\"\\r\""; break;
            case 'f': cls = "\"\\f\""; break;
            case 'v': cls = "\"\\v\""; break;
            default: break;
            }
            if (cls) {
                grm_txt_puts(t, cls);
                continue;
            }
            if (e == 'x' || e == 'u') {
                i -= 2;
                size_t j = i;
                grm_txt_put(t, "[", 1);
                /* reuse the class reader on a one-item class */
                char tmp[16];
                int k = e == 'x' ? 4 : 6;
                if (j + (size_t)k > n) return ms_errf(err, errlen, "regex: truncated escape");
                snprintf(tmp, sizeof tmp, "%.*s]", k, re + j);
                size_t ti = 0;
                t->len--; /* regex_class writes its own '[' */
                if (regex_class(tmp, &ti, strlen(tmp), t, err, errlen) < 0) return -1;
                i += (size_t)k;
                continue;
            }
            if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
                return ms_errf(err, errlen, "regex: \\%c (anchors, back-references, ...) is not supported", e);
            grm_txt_literal(t, &e, 1);
            continue;
        }
        uint32_t cp;
        int k = uni_utf8_next((const unsigned char *)re + i, n - i, &cp);
        if (k <= 0) return ms_errf(err, errlen, "regex: invalid UTF-8");
        grm_txt_literal(t, re + i, (size_t)k);
        i += (size_t)k;
    }
    if (depth != 0) return ms_errf(err, errlen, "regex: unbalanced '('");
    return 0;
}

int grm_regex_to_ebnf(const char *re, char **out, char *err, size_t errlen);
int grm_regex_to_ebnf(const char *re, char **out, char *err, size_t errlen)
{
    struct grm_txt t = {0};
    if (regex_to_ebnf_text(re, &t, err, errlen) < 0 || t.failed) {
        if (t.failed) ms_errf(err, errlen, "out of memory");
        free(t.p);
        return -1;
    }
    grm_txt_put(&t, "", 0);
    if (t.failed) {
        free(t.p);
        return ms_errf(err, errlen, "out of memory");
    }
    *out = t.p;
    return 0;
}

/* ---- flattening and checks ------------------------------------------------------------- */

/* Refuses left recursion: a rule reaching itself before consuming a byte would expand
 * forever. Edge A -> B when some alternative of A references B after only nullable elements;
 * a cycle among those edges is left recursion (found by peeling off rules without edges left,
 * Kahn's algorithm). */
static int check_left_recursion(struct gb *b)
{
    int n = b->n_rules, rc = -1;
    bool *nullable = calloc((size_t)n, sizeof *nullable);
    int *outdeg = calloc((size_t)n, sizeof *outdeg);
    int *queue = malloc(sizeof *queue * (size_t)n);
    bool *gone = calloc((size_t)n, sizeof *gone);
    int *first = calloc((size_t)n + 1, sizeof *first), *callers = NULL, *fill = NULL;
    if (!nullable || !outdeg || !queue || !gone || !first) {
        gb_fail(b, "out of memory%s", NULL);
        goto out;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            if (nullable[r]) continue;
            bool alt_ok = true;
            for (int k = 0; k < b->rules[r].n && !nullable[r]; k++) {
                uint32_t e = b->rules[r].els[k];
                if (GRM_EL_KIND(e) == GRM_EL_END) {
                    if (alt_ok) nullable[r] = changed = true;
                    alt_ok = true;
                } else if (GRM_EL_KIND(e) == GRM_EL_SET ||
                           (GRM_EL_KIND(e) == GRM_EL_REF && !nullable[GRM_EL_IDX(e)])) {
                    alt_ok = false;
                }
            }
        }
    }
    /* left-call edges, as lists of callers per callee (CSR) */
    int n_edges = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < n; r++) {
            bool live = true;
            for (int k = 0; k < b->rules[r].n; k++) {
                uint32_t e = b->rules[r].els[k];
                if (GRM_EL_KIND(e) == GRM_EL_END) {
                    live = true;
                } else if (live && GRM_EL_KIND(e) == GRM_EL_REF) {
                    int t = (int)GRM_EL_IDX(e);
                    if (pass == 0) {
                        outdeg[r]++;
                        first[t + 1]++;
                        n_edges++;
                    } else {
                        callers[fill[t]++] = r;
                    }
                    live = nullable[t];
                } else {
                    live = false;
                }
            }
        }
        if (pass == 0) {
            for (int t = 0; t < n; t++) first[t + 1] += first[t];
            callers = malloc(sizeof *callers * (size_t)(n_edges > 0 ? n_edges : 1));
            fill = malloc(sizeof *fill * (size_t)n);
            if (!callers || !fill) {
                gb_fail(b, "out of memory%s", NULL);
                goto out;
            }
            memcpy(fill, first, sizeof *fill * (size_t)n);
        }
    }
    int qn = 0, removed = 0;
    for (int r = 0; r < n; r++)
        if (outdeg[r] == 0) queue[qn++] = r;
    for (int qi = 0; qi < qn; qi++) {
        int t = queue[qi];
        gone[t] = true;
        removed++;
        for (int j = first[t]; j < first[t + 1]; j++)
            if (--outdeg[callers[j]] == 0) queue[qn++] = callers[j];
    }
    if (removed < n) {
        int r = 0;
        while (gone[r]) r++;
        gb_fail(b,
                "the grammar is left-recursive (rule '%s' can reach itself without consuming "
                "input)",
                b->rules[r].name[0] == '_' ? b->rules[r].name + 1 : b->rules[r].name);
        goto out;
    }
    rc = 0;
out:
    free(nullable);
    free(outdeg);
    free(queue);
    free(gone);
    free(first);
    free(callers);
    free(fill);
    return rc;
}

static int flatten(struct gb *b, const struct grm_vocab *v, struct grm_grammar **out)
{
    int root = -1;
    for (int r = 0; r < b->n_rules; r++) {
        if (!b->rules[r].defined)
            return gb_fail(b, "rule '%s' is used but not defined", b->rules[r].name);
        if (strcmp(b->rules[r].name, "root") == 0) root = r;
    }
    if (root < 0) return gb_fail(b, "the grammar has no 'root' rule%s", NULL);
    /* root_sp ::= " " root | root */
    int sp = gb_new_rule(b, "_root_sp", 8);
    if (sp >= 0) {
        b->rules[sp].defined = true;
        gb_push(b, sp, GRM_EL(GRM_EL_SET, gb_set_range(b, ' ', ' ')));
        gb_push(b, sp, GRM_EL(GRM_EL_REF, root));
        gb_push(b, sp, GRM_EL(GRM_EL_END, 0));
        gb_push(b, sp, GRM_EL(GRM_EL_REF, root));
        gb_push(b, sp, GRM_EL(GRM_EL_END, 0));
    }
    if (b->failed || check_left_recursion(b) < 0) return -1;
    struct grm_grammar *g = calloc(1, sizeof *g);
    if (!g) return gb_fail(b, "out of memory%s", NULL);
    atomic_init(&g->refs, 1);
    g->vocab = v;
    g->n_rules = b->n_rules;
    g->n_els = b->total;
    g->n_sets = b->n_sets;
    for (int r = 0; r < b->n_rules; r++) g->n_alts += b->rules[r].n_alts;
    g->els = malloc(sizeof *g->els * (size_t)(g->n_els > 0 ? g->n_els : 1));
    g->sets = malloc(sizeof *g->sets * (size_t)(g->n_sets > 0 ? g->n_sets : 1));
    g->alt_start = malloc(sizeof *g->alt_start * (size_t)(g->n_alts > 0 ? g->n_alts : 1));
    g->rule_alt = malloc(sizeof *g->rule_alt * (size_t)(g->n_rules + 1));
    if (!g->els || !g->sets || !g->alt_start || !g->rule_alt) {
        grm_release(g);
        return gb_fail(b, "out of memory%s", NULL);
    }
    memcpy(g->sets, b->sets, sizeof *g->sets * (size_t)g->n_sets);
    int e = 0, a = 0;
    for (int r = 0; r < b->n_rules; r++) {
        g->rule_alt[r] = a;
        bool start = true;
        for (int k = 0; k < b->rules[r].n; k++) {
            if (start) g->alt_start[a++] = e;
            uint32_t el = b->rules[r].els[k];
            start = GRM_EL_KIND(el) == GRM_EL_END;
            g->els[e++] = el;
        }
    }
    g->rule_alt[b->n_rules] = a;
    g->root = root;
    g->root_sp = sp;
    *out = g;
    return 0;
}

int grm_compile(enum grm_kind kind, const char *text, const struct grm_vocab *v,
                struct grm_grammar **out, char *err, size_t errlen, char *bad_keyword,
                size_t kwlen)
{
    *out = NULL;
    if (bad_keyword && kwlen) bad_keyword[0] = '\0';
    char *ebnf = NULL;
    int rc;
    switch (kind) {
    case GRM_EBNF:
        break;
    case GRM_REGEX:
        if (grm_regex_to_ebnf(text, &ebnf, err, errlen) < 0) return -1;
        {
            char *full = malloc(strlen(ebnf) + 16);
            if (!full) {
                free(ebnf);
                return ms_errf(err, errlen, "out of memory");
            }
            sprintf(full, "root ::= %s", ebnf);
            free(ebnf);
            ebnf = full;
        }
        break;
    case GRM_CHOICE:
        if (choice_to_ebnf(text, &ebnf, err, errlen) < 0) return -1;
        break;
    case GRM_JSON_SCHEMA:
    case GRM_JSON_OBJECT:
        rc = jschema_to_ebnf(kind == GRM_JSON_OBJECT ? "{\"type\":\"object\"}" : text, &ebnf,
                             err, errlen, bad_keyword, kwlen);
        if (rc < 0) return -1;
        break;
    }
    struct gb b = {.err = err, .errlen = errlen};
    rc = parse_ebnf(&b, ebnf ? ebnf : text);
    if (rc == 0) rc = flatten(&b, v, out);
    gb_free(&b);
    free(ebnf);
    return rc < 0 ? -1 : 0;
}

void grm_retain(struct grm_grammar *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
}

void grm_release(struct grm_grammar *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    free(g->els);
    free(g->sets);
    free(g->alt_start);
    free(g->rule_alt);
    free(g);
}
