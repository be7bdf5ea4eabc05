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
#include <time.h>

#include "common.h"
#include "grm_internal.h"
#include "json_schema.h"
#include "unicode.h"

/* ---- the rule builder ----------------------------------------------------------------- */

struct gb_rule {
    uint32_t *els; /* alternatives, each ended by GRM_EL_END */
    int n, cap;
    int n_alts;
    char name[48]; /* for error messages (cut short; lookups use the full name) */
    bool defined, referenced;
    bool star; /* a helper "s ::= x s | """ of x*: els[0] is x (see fix_nullable_stars) */
};

/* An open-addressing hash table of int values (rule or set indices) under keys the caller
 * compares: slots hold value + 1 (0: empty) and a cached hash. Grown at half full, so a probe
 * sequence stays short; lookups are what make a grammar of 10^5 rules compile in linear time. */
struct gb_hash {
    uint32_t *hash;
    int32_t *val;
    uint32_t cap, used; /* cap: a power of two, or 0 before the first insert */
};

static uint32_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 16777619u;
    return h ^ (h >> 15);
}

static void gb_hash_free(struct gb_hash *t)
{
    free(t->hash);
    free(t->val);
}

/* Makes room for one more entry. Returns -1 when out of memory. */
static int gb_hash_reserve(struct gb_hash *t)
{
    if ((t->used + 1) * 2 <= t->cap) return 0;
    uint32_t cap = t->cap ? t->cap * 2 : 256;
    uint32_t *h = calloc(cap, sizeof *h);
    int32_t *v = calloc(cap, sizeof *v);
    if (!h || !v) {
        free(h);
        free(v);
        return -1;
    }
    for (uint32_t i = 0; i < t->cap; i++) {
        if (!t->val[i]) continue;
        uint32_t j = t->hash[i] & (cap - 1);
        while (v[j]) j = (j + 1) & (cap - 1);
        h[j] = t->hash[i];
        v[j] = t->val[i];
    }
    gb_hash_free(t);
    t->hash = h;
    t->val = v;
    t->cap = cap;
    return 0;
}

struct gb {
    struct gb_rule *rules;
    int n_rules, cap_rules;
    struct grm_set *sets;
    int n_sets, cap_sets;
    int total;   /* elements */
    int n_alts;  /* alternatives (ended ones) */
    struct gb_hash names; /* named rules, keyed by their full name in the EBNF source */
    const char **name_at; /* (cap_rules) where each named rule's name is in the source */
    size_t *name_len;
    struct gb_hash set_index; /* sets, keyed by their bits */
    const struct grm_limits *lim; /* NULL: no budget */
    double t0;                    /* compile start (monotonic seconds) */
    unsigned tick;
    char *err;
    size_t errlen;
    bool failed;
    bool over; /* failed on a budget limit (GRM_EBUDGET) */
};

static int gb_fail(struct gb *b, const char *msg, const char *arg)
{
    if (!b->failed) ms_errf(b->err, b->errlen, msg, arg ? arg : "");
    b->failed = true;
    return -1;
}

static double mono_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fails with GRM_EBUDGET's message when the grammar so far is over a limit of b->lim. The
 * clock is read every 1024th call only: callers sit in the compile's inner loops. */
static int gb_budget(struct gb *b)
{
    const struct grm_limits *l = b->lim;
    if (!l || b->failed) return b->failed ? -1 : 0;
    const char *what = NULL;
    char msg[160];
    if (l->max_rules && (size_t)b->n_rules > l->max_rules) {
        snprintf(msg, sizeof msg, "the grammar needs more than %zu rules (limit max_rules)",
                 l->max_rules);
        what = msg;
    } else if (l->max_bytes && grm_compiled_bytes(b->total, b->n_sets, b->n_alts, b->n_rules) >
                                   l->max_bytes) {
        snprintf(msg, sizeof msg,
                 "the compiled grammar needs more than %zu bytes (limit max_bytes)",
                 l->max_bytes);
        what = msg;
    } else if (l->max_seconds > 0 && (++b->tick & 1023) == 0 &&
               mono_seconds() - b->t0 > l->max_seconds) {
        snprintf(msg, sizeof msg, "compiling the grammar took more than %g s (limit max_seconds)",
                 l->max_seconds);
        what = msg;
    }
    if (!what) return 0;
    gb_fail(b, "%s", what);
    b->over = true;
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
        const char **at = realloc(b->name_at, sizeof *at * (size_t)cap);
        if (at) b->name_at = at;
        size_t *ln = at ? realloc(b->name_len, sizeof *ln * (size_t)cap) : NULL;
        if (ln) b->name_len = ln;
        if (!at || !ln) return gb_fail(b, "out of memory%s", NULL);
        b->cap_rules = cap;
    }
    struct gb_rule *r = &b->rules[b->n_rules];
    memset(r, 0, sizeof *r);
    b->name_at[b->n_rules] = NULL;
    b->name_len[b->n_rules] = 0;
    if (nlen >= sizeof r->name) nlen = sizeof r->name - 1;
    memcpy(r->name, name, nlen);
    r->name[nlen] = '\0';
    b->n_rules++;
    if (gb_budget(b) < 0) return -1;
    return b->n_rules - 1;
}

/* The rule called name[0..nlen), a slice of the EBNF source that outlives the parse (created,
 * undefined, on first mention). Helper rules are never in the table, so a user's name cannot
 * meet one. */
static int gb_named(struct gb *b, const char *name, size_t nlen)
{
    if (b->failed) return -1;
    if (gb_hash_reserve(&b->names) < 0) return gb_fail(b, "out of memory%s", NULL);
    uint32_t h = hash_bytes(name, nlen), mask = b->names.cap - 1, j = h & mask;
    for (; b->names.val[j]; j = (j + 1) & mask) {
        int r = b->names.val[j] - 1;
        if (b->names.hash[j] == h && b->name_len[r] == nlen &&
            memcmp(b->name_at[r], name, nlen) == 0)
            return r;
    }
    int r = gb_new_rule(b, name, nlen);
    if (r < 0) return -1;
    b->name_at[r] = name;
    b->name_len[r] = nlen;
    b->names.hash[j] = h;
    b->names.val[j] = r + 1;
    b->names.used++;
    return r;
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
    if (GRM_EL_KIND(el) == GRM_EL_END) {
        r->n_alts++;
        b->n_alts++;
    }
    if (GRM_EL_KIND(el) == GRM_EL_REF) b->rules[GRM_EL_IDX(el)].referenced = true;
    return gb_budget(b);
}

static int gb_set_bits(struct gb *b, const struct grm_set *s)
{
    if (b->failed) return -1;
    if (gb_hash_reserve(&b->set_index) < 0) return gb_fail(b, "out of memory%s", NULL);
    uint32_t h = hash_bytes(s, sizeof *s), mask = b->set_index.cap - 1, j = h & mask;
    for (; b->set_index.val[j]; j = (j + 1) & mask) {
        int i = b->set_index.val[j] - 1;
        if (b->set_index.hash[j] == h && memcmp(&b->sets[i], s, sizeof *s) == 0) return i;
    }
    if (b->n_sets == b->cap_sets) {
        int cap = b->cap_sets ? b->cap_sets * 2 : 64;
        struct grm_set *n = realloc(b->sets, sizeof *n * (size_t)cap);
        if (!n) return gb_fail(b, "out of memory%s", NULL);
        b->sets = n;
        b->cap_sets = cap;
    }
    b->sets[b->n_sets] = *s;
    b->set_index.hash[j] = h;
    b->set_index.val[j] = b->n_sets + 1;
    b->set_index.used++;
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
    free(b->name_at);
    free(b->name_len);
    gb_hash_free(&b->names);
    gb_hash_free(&b->set_index);
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
    int depth; /* groups open around the item being parsed (at most GRM_MAX_NESTING) */
    struct gb *b;
};

#define STR_(x) #x
#define STR(x) STR_(x)

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
        /* parse_alts recurses here: the bound keeps hostile nesting off the stack */
        if (p->depth >= GRM_MAX_NESTING)
            return perr(p, "groups nested deeper than " STR(GRM_MAX_NESTING) " levels");
        p->i++;
        int g = gb_anon(b, rule);
        p->depth++;
        int rc = g < 0 ? -1 : parse_alts(p, g);
        p->depth--;
        if (rc < 0) return -1;
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
    if (s >= 0) b->rules[s].star = true; /* x stays els[0]: fix_nullable_stars may replace it */
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
            /* the EBNF parser nests a call per group: refuse here, naming the limit */
            if (++depth > GRM_MAX_NESTING)
                return ms_errf(err, errlen,
                               "regex: groups nested deeper than " STR(GRM_MAX_NESTING) " levels");
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
            /* Python's forms: {m}, {m,}, {m,n}, {,n}, {,} (an empty bound is 0 or none);
             * anything else is a literal '{' */
            size_t k = i + 1, lo_end, comma = 0;
            while (k < n && re[k] >= '0' && re[k] <= '9') k++;
            lo_end = k;
            if (k < n && re[k] == ',') {
                comma = k++;
                while (k < n && re[k] >= '0' && re[k] <= '9') k++;
            }
            if (k < n && re[k] == '}' && (comma || lo_end > i + 1)) {
                grm_txt_put(t, "{", 1);
                if (lo_end == i + 1) grm_txt_put(t, "0", 1);
                else grm_txt_put(t, re + i + 1, lo_end - i - 1);
                if (comma) grm_txt_put(t, re + comma, k - comma); /* ",n" or "," */
                grm_txt_put(t, "}", 1);
                i = k + 1;
                if (i < n && re[i] == '?') i++;
                if (i < n && re[i] == '+')
                    return ms_errf(err, errlen, "regex: possessive quantifiers are not supported");
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

/* nullable[r] for rules 0..n-1 (r can match the empty string), in time linear in the grammar:
 * each alternative without a byte set counts its references not yet known nullable; a rule
 * found nullable decrements the counts of the alternatives that reference it, and an
 * alternative reaching zero makes its rule nullable (a worklist, never a pass per rule of a
 * long chain). References to rules at or past n are taken as not nullable. */
static int compute_nullable(struct gb *b, int n, bool *nullable)
{
    int n_alts = 0, n_refs = 0;
    for (int r = 0; r < n; r++) {
        n_alts += b->rules[r].n_alts;
        for (int k = 0; k < b->rules[r].n; k++)
            n_refs += GRM_EL_KIND(b->rules[r].els[k]) == GRM_EL_REF;
    }
    int *pending = malloc(sizeof *pending * (size_t)(n_alts + 1));
    int *alt_rule = malloc(sizeof *alt_rule * (size_t)(n_alts + 1));
    int *first = calloc((size_t)n + 1, sizeof *first);
    int *fill = malloc(sizeof *fill * (size_t)(n + 1));
    int *uses = malloc(sizeof *uses * (size_t)(n_refs + 1)); /* alternatives per callee (CSR) */
    int *queue = malloc(sizeof *queue * (size_t)(n + 1));
    int rc = -1;
    if (!pending || !alt_rule || !first || !fill || !uses || !queue) {
        gb_fail(b, "out of memory%s", NULL);
        goto out;
    }
    memset(nullable, 0, sizeof *nullable * (size_t)n);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < b->rules[r].n; k++) {
            uint32_t e = b->rules[r].els[k];
            if (GRM_EL_KIND(e) == GRM_EL_REF && (int)GRM_EL_IDX(e) < n) first[GRM_EL_IDX(e) + 1]++;
        }
    for (int t = 0; t < n; t++) first[t + 1] += first[t];
    memcpy(fill, first, sizeof *fill * (size_t)n);
    int qn = 0, alt = 0;
    for (int r = 0; r < n; r++) {
        int refs = 0;
        bool set = false;
        for (int k = 0; k < b->rules[r].n; k++) {
            uint32_t e = b->rules[r].els[k];
            if (GRM_EL_KIND(e) == GRM_EL_END) {
                alt_rule[alt] = r;
                pending[alt] = set ? -1 : refs;
                if (!set && refs == 0 && !nullable[r]) {
                    nullable[r] = true;
                    queue[qn++] = r;
                }
                alt++;
                refs = 0;
                set = false;
            } else if (GRM_EL_KIND(e) == GRM_EL_REF && (int)GRM_EL_IDX(e) < n) {
                refs++;
                uses[fill[GRM_EL_IDX(e)]++] = alt;
            } else {
                set = true; /* a byte set (or a rule past n): never matches nothing */
            }
        }
    }
    for (int qi = 0; qi < qn; qi++) {
        int t = queue[qi];
        if ((qi & 1023) == 0 && gb_budget(b) < 0) goto out;
        for (int j = first[t]; j < first[t + 1]; j++) {
            int a2 = uses[j];
            if (pending[a2] > 0 && --pending[a2] == 0 && !nullable[alt_rule[a2]]) {
                nullable[alt_rule[a2]] = true;
                queue[qn++] = alt_rule[a2];
            }
        }
    }
    rc = 0;
out:
    free(pending);
    free(alt_rule);
    free(first);
    free(fill);
    free(uses);
    free(queue);
    return rc;
}

/* Star rules over a body that can match nothing, s ::= x s | "", reach s again before
 * consuming input. x* matches what (x minus "")* matches, so the body becomes x', a rule of
 * x's non-empty strings: for an alternative e1..ek whose first p elements are nullable, x'
 * takes e_i' e_(i+1)..e_k for i = 1..min(p+1, k), where e' is a byte set itself, a
 * non-nullable rule itself and a nullable rule u its own u' (made the same way, once per
 * rule, through a queue). The tails e_(i+1)..e_k are shared through a chain of helper rules
 * R_j ::= e_j R_(j+1), so x' is linear in the size of x. Every x' is non-nullable; star
 * bodies are rewritten before any alternative is copied, so a copied star rule already has
 * x' and its copy is not left-recursive either. */
struct prime_ctx {
    struct gb *b;
    int n0;            /* rules before fix_nullable_stars */
    const bool *nullable;
    int *prime;        /* (n0) u' of each nullable rule u, -1 until made */
    int *queue, *qn;   /* rules whose u' is made but not filled yet */
};

/* e' of an element: itself, or u' (made on first use) for a reference to a nullable rule u. */
static uint32_t prime_el(struct prime_ctx *c, uint32_t e)
{
    if (GRM_EL_KIND(e) != GRM_EL_REF) return e;
    int u = (int)GRM_EL_IDX(e);
    if (u >= c->n0 || !c->nullable[u]) return e;
    if (c->prime[u] < 0) {
        c->prime[u] = gb_anon(c->b, u);
        if (c->prime[u] < 0) return e; /* b->failed is set */
        c->queue[(*c->qn)++] = u;
    }
    return GRM_EL(GRM_EL_REF, c->prime[u]);
}

static int fix_nullable_stars(struct gb *b)
{
    int n0 = b->n_rules, rc = -1;
    bool any = false;
    for (int r = 0; r < n0 && !any; r++) any = b->rules[r].star;
    if (!any) return 0;
    bool *nullable = calloc((size_t)n0, sizeof *nullable);
    int *prime = malloc(sizeof *prime * (size_t)n0);
    int *queue = malloc(sizeof *queue * (size_t)n0);
    uint32_t *tmp = NULL;
    int *chain = NULL;
    if (!nullable || !prime || !queue) {
        gb_fail(b, "out of memory%s", NULL);
        goto out;
    }
    if (compute_nullable(b, n0, nullable) < 0) goto out;
    for (int r = 0; r < n0; r++) prime[r] = -1;
    int qn = 0;
    struct prime_ctx pc = {b, n0, nullable, prime, queue, &qn};
    for (int r = 0; r < n0 && !b->failed; r++) {
        if (!b->rules[r].star) continue;
        uint32_t x = b->rules[r].els[0];
        uint32_t xp = prime_el(&pc, x);
        if (b->failed) goto out;
        b->rules[r].els[0] = xp;
        if (GRM_EL_KIND(xp) == GRM_EL_REF) b->rules[GRM_EL_IDX(xp)].referenced = true;
    }
    for (int qi = 0; qi < qn && !b->failed; qi++) {
        int t = queue[qi], tp = prime[t];
        /* copy t's alternatives out: making rules moves b->rules */
        int len = b->rules[t].n;
        free(tmp);
        tmp = malloc(sizeof *tmp * (size_t)(len + 1));
        if (!tmp) {
            gb_fail(b, "out of memory%s", NULL);
            goto out;
        }
        memcpy(tmp, b->rules[t].els, sizeof *tmp * (size_t)len);
        for (int s0 = 0; s0 < len && !b->failed;) {
            int k = 0;
            while (GRM_EL_KIND(tmp[s0 + k]) != GRM_EL_END) k++;
            const uint32_t *e = tmp + s0;
            s0 += k + 1;
            if (k == 0) continue; /* "" has no non-empty part */
            int p = 0;
            while (p < k && GRM_EL_KIND(e[p]) == GRM_EL_REF && (int)GRM_EL_IDX(e[p]) < n0 &&
                   nullable[GRM_EL_IDX(e[p])])
                p++;
            int m = p + 1 < k ? p + 1 : k;
            /* chain[j] (0-based j = 1..m-1): R_j ::= e_j R_(j+1), the last one e_(m-1)..e_(k-1) */
            free(chain);
            chain = malloc(sizeof *chain * (size_t)(m + 1));
            if (!chain) {
                gb_fail(b, "out of memory%s", NULL);
                goto out;
            }
            for (int j = m - 1; j >= 1; j--) {
                chain[j] = gb_anon(b, t);
                if (j == m - 1) {
                    for (int q = j; q < k; q++) gb_push(b, chain[j], e[q]);
                } else {
                    gb_push(b, chain[j], e[j]);
                    gb_push(b, chain[j], GRM_EL(GRM_EL_REF, chain[j + 1]));
                }
                gb_push(b, chain[j], GRM_EL(GRM_EL_END, 0));
            }
            for (int i = 0; i < m && !b->failed; i++) {
                uint32_t pe = prime_el(&pc, e[i]);
                gb_push(b, tp, pe);
                if (i < m - 1) gb_push(b, tp, GRM_EL(GRM_EL_REF, chain[i + 1]));
                else
                    for (int q = i + 1; q < k; q++) gb_push(b, tp, e[q]);
                gb_push(b, tp, GRM_EL(GRM_EL_END, 0));
            }
        }
        if (gb_budget(b) < 0) goto out;
    }
    rc = b->failed ? -1 : 0;
out:
    free(nullable);
    free(prime);
    free(queue);
    free(tmp);
    free(chain);
    return rc;
}

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
    if (compute_nullable(b, n, nullable) < 0) goto out;
    /* left-call edges, as lists of callers per callee (CSR) */
    int n_edges = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < n; r++) {
            if ((r & 1023) == 0 && gb_budget(b) < 0) goto out;
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
    if (b->failed || fix_nullable_stars(b) < 0 || check_left_recursion(b) < 0) return -1;
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
    return grm_compile_limited(kind, text, v, NULL, out, err, errlen, bad_keyword, kwlen);
}

int grm_compile_limited(enum grm_kind kind, const char *text, const struct grm_vocab *v,
                        const struct grm_limits *lim, struct grm_grammar **out, char *err,
                        size_t errlen, char *bad_keyword, size_t kwlen)
{
    *out = NULL;
    double t0 = mono_seconds();
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
    struct gb b = {.err = err, .errlen = errlen, .lim = lim, .t0 = t0};
    rc = parse_ebnf(&b, ebnf ? ebnf : text);
    if (rc == 0) rc = flatten(&b, v, out);
    bool over = b.over;
    gb_free(&b);
    free(ebnf);
    if (rc < 0 && over) return GRM_EBUDGET;
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
