/* Tests of engine/grammar: EBNF, regex, choice and JSON Schema compilation (what is accepted,
 * what is refused and how the error names it), byte-level matching of strings, and the token
 * mask against brute force (every token tried on a second matcher) on the bundled model's
 * vocabulary and on Qwen3's 151k-token one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "grammar.h"
#include "test.h"
#include "tokenizer.h"

static struct grm_grammar *compile(enum grm_kind k, const char *text, const struct grm_vocab *v,
                                   char *err, char *kw)
{
    struct grm_grammar *g = NULL;
    if (grm_compile(k, text, v, &g, err, MS_ERR_LEN, kw, 64) != 0) return NULL;
    return g;
}

/* Whether the whole string s is accepted (and may end there). */
static bool matches(const struct grm_grammar *g, const char *s)
{
    struct grm_matcher *m = grm_matcher_create(g);
    if (!m) return false;
    /* a byte a call: the states one call passes through must fit the matcher's tables, and a
     * state of the 10^4-property schema below has 10^4 stacks */
    bool ok = true;
    for (size_t i = 0, n = strlen(s); i < n && ok; i++) ok = grm_accept_bytes(m, s + i, 1) == 0;
    ok = ok && grm_can_end(m);
    grm_matcher_free(m);
    return ok;
}

static void expect_matches(enum grm_kind k, const char *text, const struct grm_vocab *v,
                           const char *const *yes, const char *const *no, int line)
{
    char err[MS_ERR_LEN], kw[64];
    struct grm_grammar *g = compile(k, text, v, err, kw);
    CHECKF(g != NULL, "line %d: %s", line, err);
    if (!g) return;
    for (int i = 0; yes[i]; i++) CHECKF(matches(g, yes[i]), "line %d: should match '%s'", line, yes[i]);
    for (int i = 0; no[i]; i++) CHECKF(!matches(g, no[i]), "line %d: should not match '%s'", line, no[i]);
    grm_release(g);
}
#define MATCHES(k, text, v, ...) do { \
    const char *const *y_ = (const char *const[]){__VA_ARGS__}; \
    const char *const *n_ = y_; while (*n_) n_++; n_++; \
    expect_matches(k, text, v, y_, n_, __LINE__); } while (0)

static void expect_error(enum grm_kind k, const char *text, const struct grm_vocab *v,
                         const char *in_msg, const char *keyword, int line)
{
    char err[MS_ERR_LEN] = "", kw[64] = "";
    struct grm_grammar *g = compile(k, text, v, err, kw);
    CHECKF(g == NULL, "line %d: '%s' compiled", line, text);
    grm_release(g);
    CHECKF(strstr(err, in_msg) != NULL, "line %d: error '%s' lacks '%s'", line, err, in_msg);
    if (keyword) CHECKF(strcmp(kw, keyword) == 0, "line %d: keyword '%s', want '%s'", line, kw, keyword);
}
#define BAD(k, text, v, msg, kw) expect_error(k, text, v, msg, kw, __LINE__)

static void test_compile(const struct grm_vocab *v)
{
    /* lists: accepted strings, NULL, refused strings, NULL */
    MATCHES(GRM_EBNF, "root ::= \"a\" [0-9]+ (\"x\" | \"yz\")?  # comment\n", v,
            "a1", "a123x", "a9yz", NULL, "a", "ax", "a1y", "a1xx", "b1", NULL);
    MATCHES(GRM_EBNF, "root ::= item{2,3}\nitem ::= [a-b] | \"-\"", v, "ab", "a-b", NULL, "a",
            "abab", NULL);
    MATCHES(GRM_EBNF, "root ::= [\\u00e9-\\u00fc]+ [^a-z]", v, "\xc3\xa9\xc3\xbc!",
            "\xc3\xa9\xe2\x82\xac", NULL, "\xc3\xa9", "e!", "\xc3\xa9z", NULL);
    MATCHES(GRM_EBNF, "root ::= . \"\\x01\" \"\"", v, "\xf0\x9f\x98\x80\x01", "a\x01", NULL,
            "ab", "\x01", NULL);
    MATCHES(GRM_REGEX, "^[a-c]{2}\\d+(x|yz)?$", v, "ab1", "cc42yz", NULL, "a1", "ab", "ab1y",
            NULL);
    MATCHES(GRM_REGEX, "(?P<year>[0-9]{4})-(?:0[1-9]|1[0-2])", v, "2024-01", "1999-12", NULL,
            "2024-13", "24-01", NULL);
    MATCHES(GRM_REGEX, "a.c|\\.\\*", v, "abc", "a\xc3\xa9" "c", ".*", NULL, "a\nc", "ac", NULL);
    /* {,n} and {,} as Python reads them; other braces are literal */
    MATCHES(GRM_REGEX, "a{,2}b{,}c{1,2,3}", v, "c{1,2,3}", "aabbbc{1,2,3}", NULL, "aaac{1,2,3}",
            "c", NULL);
    MATCHES(GRM_CHOICE, "[\"yes\", \"no\", \"n\\\"a\"]", v, "yes", "no", "n\"a", NULL, "ye",
            "yesno", NULL);
    MATCHES(GRM_JSON_OBJECT, "", v, "{}", "{\"a\": [1, 2.5e3, null, true, \"x\\n\"]}",
            "{ \"k\" : {\"n\": -0}}", NULL, "[]", "{", "{\"a\" 1}", "{\"a\":01}", NULL);
    const char *schema =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
        "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\","
        "\"b\"]},\"minItems\":1,\"maxItems\":2},\"when\":{\"type\":\"string\",\"format\":"
        "\"date\"},\"kind\":{\"anyOf\":[{\"const\":1},{\"type\":\"null\"}]},\"next\":{\"$ref\":"
        "\"#/$defs/node\"}},\"required\":[\"name\",\"tags\"],\"additionalProperties\":false,"
        "\"$defs\":{\"node\":{\"type\":[\"object\",\"null\"],\"properties\":{\"next\":{\"$ref\":"
        "\"#/$defs/node\"}}}}}";
    MATCHES(GRM_JSON_SCHEMA, schema, v, "{\"name\":\"bob\",\"tags\":[\"a\"]}",
            "{\"name\": \"\", \"age\": -12, \"tags\": [\"a\", \"b\"], \"when\": \"2024-02-28\", "
            "\"kind\": null, \"next\": {\"next\": {\"next\": null}}}",
            "{\"name\":\"x\",\"tags\":[\"b\"],\"kind\":1}", NULL,
            "{\"tags\":[\"a\"]}", "{\"name\":\"toolong\",\"tags\":[\"a\"]}",
            "{\"name\":\"x\",\"tags\":[]}", "{\"name\":\"x\",\"tags\":[\"a\",\"a\",\"a\"]}",
            "{\"tags\":[\"a\"],\"name\":\"x\"}", "{\"name\":\"x\",\"tags\":[\"a\"],\"zz\":1}",
            "{\"name\":\"x\",\"tags\":[\"a\"],\"when\":\"2024-02-30\"}", NULL);
    MATCHES(GRM_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-[0-9]+$\"}", v,
            "\"AB-12\"", NULL, "\"A-1\"", "AB-12", NULL);

    BAD(GRM_EBNF, "root ::= x\n", v, "'x' is used but not defined", NULL);
    BAD(GRM_EBNF, "start ::= \"a\"", v, "no 'root' rule", NULL);
    BAD(GRM_EBNF, "root ::= root \"a\" | \"b\"", v, "left-recursive", NULL);
    BAD(GRM_EBNF, "root ::= x \"a\"\nx ::= \"b\"? root", v, "left-recursive", NULL);
    BAD(GRM_EBNF, "root ::= (root)* \"a\"", v, "left-recursive", NULL);
    BAD(GRM_EBNF, "root ::= \"a\" | \"b\nroot2 ::= x", v, "unterminated", NULL);
    BAD(GRM_EBNF, "root ::= [z-a]", v, "backwards", NULL);
    BAD(GRM_EBNF, "root ::= \"a\"{5,2}", v, "repetition", NULL);
    BAD(GRM_EBNF, "root ::= \"a\"\nroot ::= \"b\"", v, "defined twice", NULL);
    BAD(GRM_REGEX, "a(?=b)", v, "lookaround", NULL);
    BAD(GRM_REGEX, "(a", v, "unbalanced", NULL);
    BAD(GRM_REGEX, "a\\1", v, "not supported", NULL);
    BAD(GRM_CHOICE, "[]", v, "non-empty", NULL);
    BAD(GRM_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":3}", v, "'minimum'", "minimum");
    BAD(GRM_JSON_SCHEMA, "{\"oneOf\":[{\"type\":\"string\"}]}", v, "'oneOf'", "oneOf");
    BAD(GRM_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}", v, "'not'",
        "not");
    BAD(GRM_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"email\"}", v, "email", "format");
    BAD(GRM_JSON_SCHEMA, "{\"$ref\":\"#/$defs/missing\"}", v, "cannot resolve", "$ref");
    BAD(GRM_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"^[^a]$\"}", v, "negated", "pattern");
    BAD(GRM_JSON_SCHEMA, "{\"type\":\"bogus\"}", v, "unknown type", "type");
    BAD(GRM_JSON_SCHEMA, "[1", v, "invalid JSON", NULL);
    /* refused after some of the rule was written (fuzz_grammar: leaked that text) */
    BAD(GRM_JSON_SCHEMA, "{\"anyOf\":[{\"const\":1},{\"t{1,}ype\":\"null\"}]}", v,
        "'t{1,}ype' is not supported", "t{1,}ype");
    BAD(GRM_JSON_SCHEMA, "{\"type\":[\"string\",\"bogus\"]}", v, "unknown type", "type");
}

/* A growable string for the large inputs below. */
struct sbuf {
    char *p;
    size_t len, cap;
};

static void sb_put(struct sbuf *b, const char *s)
{
    size_t n = strlen(s);
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *q = realloc(b->p, cap);
        if (!q) abort();
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n + 1);
    b->len += n;
}

static void sb_repeat(struct sbuf *b, const char *s, int n)
{
    for (int i = 0; i < n; i++) sb_put(b, s);
}

/* Groups nested `depth` deep around one "a", as a regex or EBNF. */
static char *nested(bool ebnf, int depth)
{
    struct sbuf b = {0};
    sb_put(&b, ebnf ? "root ::= " : "");
    sb_repeat(&b, "(", depth);
    sb_put(&b, ebnf ? "\"a\"" : "a");
    sb_repeat(&b, ")", depth);
    return b.p;
}

/* Inputs that used to overflow the stack or take quadratic time: deep nesting stops at
 * GRM_MAX_NESTING with an error naming it, long rule chains and wide schemas compile. */
static void test_limits(const struct grm_vocab *v)
{
    char err[MS_ERR_LEN], kw[64];
    for (int ebnf = 0; ebnf < 2; ebnf++) {
        enum grm_kind k = ebnf ? GRM_EBNF : GRM_REGEX;
        char *at = nested(ebnf, GRM_MAX_NESTING), *over = nested(ebnf, GRM_MAX_NESTING + 1);
        char *huge = nested(ebnf, 50000);
        const char *const yes[] = {"a", NULL}, *const no[] = {"", "aa", NULL};
        expect_matches(k, at, v, yes, no, __LINE__);
        BAD(k, over, v, "groups nested deeper than 256 levels", NULL);
        BAD(k, huge, v, "groups nested deeper than 256 levels", NULL);
        free(at);
        free(over);
        free(huge);
    }
    /* JSON Schema: 64 levels of items compile, 65 do not; deeper JSON stops in the parser */
    for (int depth = 64; depth <= 65; depth++) {
        struct sbuf js = {0};
        sb_repeat(&js, "{\"type\":\"array\",\"items\":", depth);
        sb_put(&js, "{\"type\":\"integer\"}");
        sb_repeat(&js, "}", depth);
        struct grm_grammar *g = compile(GRM_JSON_SCHEMA, js.p, v, err, kw);
        if (depth == 64) {
            CHECKF(g != NULL, "%s", err);
            struct sbuf inst = {0};
            sb_repeat(&inst, "[", depth);
            sb_put(&inst, "7");
            sb_repeat(&inst, "]", depth);
            CHECK(g && matches(g, inst.p));
            inst.p[depth] = 'x';
            CHECK(g && !matches(g, inst.p));
            free(inst.p);
        } else {
            CHECK(g == NULL && strstr(err, "schemas nested deeper than 64 levels") != NULL);
        }
        grm_release(g);
        free(js.p);
    }
    {
        struct sbuf js = {0};
        sb_repeat(&js, "[", 100000);
        sb_repeat(&js, "]", 100000);
        BAD(GRM_JSON_SCHEMA, js.p, v, "invalid JSON", NULL);
        BAD(GRM_CHOICE, js.p, v, "non-empty JSON array", NULL);
        free(js.p);
    }
    /* a chain of 50,000 rules, each referring to the next */
    struct sbuf b = {0};
    char line[64];
    sb_put(&b, "root ::= r0\n");
    for (int i = 0; i < 50000; i++) {
        snprintf(line, sizeof line, "r%d ::= \"x\" | \"<\" r%d \">\"\n", i, i + 1);
        sb_put(&b, line);
    }
    sb_put(&b, "r50000 ::= \"x\"\n");
    MATCHES(GRM_EBNF, b.p, v, "x", "<x>", "<<<x>>>", NULL, "", "<x", "x>", "<>", NULL);
    free(b.p);
    /* a chain of 50,000 nullable rules ending in one that consumes: not left-recursive */
    b = (struct sbuf){0};
    sb_put(&b, "root ::= r0 \"!\"\n");
    for (int i = 0; i < 50000; i++) {
        snprintf(line, sizeof line, "r%d ::= r%d | \"\"\n", i, i + 1);
        sb_put(&b, line);
    }
    sb_put(&b, "r50000 ::= \"x\"\n");
    MATCHES(GRM_EBNF, b.p, v, "!", "x!", NULL, "x", "xx!", NULL);
    free(b.p);
    /* ... and one that loops back to its start: left recursion found through all of them */
    b = (struct sbuf){0};
    sb_put(&b, "root ::= r0\n");
    for (int i = 0; i < 50000; i++) {
        snprintf(line, sizeof line, "r%d ::= \"\" | r%d\n", i, i + 1);
        sb_put(&b, line);
    }
    sb_put(&b, "r50000 ::= r0 \"x\"\n");
    BAD(GRM_EBNF, b.p, v, "left-recursive", NULL);
    free(b.p);
    /* a 10,000-property schema (all optional) and one with them all required */
    for (int req = 0; req < 2; req++) {
        b = (struct sbuf){0};
        sb_put(&b, "{\"type\":\"object\",\"properties\":{");
        for (int i = 0; i < 10000; i++) {
            snprintf(line, sizeof line, "%s\"p%d\":{\"type\":\"string\"}", i ? "," : "", i);
            sb_put(&b, line);
        }
        sb_put(&b, "}");
        if (req) {
            sb_put(&b, ",\"required\":[");
            for (int i = 0; i < 10000; i++) {
                snprintf(line, sizeof line, "%s\"p%d\"", i ? "," : "", i);
                sb_put(&b, line);
            }
            sb_put(&b, "]");
        }
        sb_put(&b, "}");
        struct grm_grammar *g = compile(GRM_JSON_SCHEMA, b.p, v, err, kw);
        CHECKF(g != NULL, "10k properties: %s", err);
        free(b.p);
        if (!g) continue;
        CHECK(!matches(g, "{\"p0\":1}"));                 /* a number, not a string */
        CHECK(!matches(g, "{\"p1\":\"a\",\"p0\":\"b\"}")); /* out of order */
        CHECK(!matches(g, "{\"q\":\"a\"}"));
        CHECK(matches(g, "{\"p0\":\"a\",\"p1\":\"b\"}") == !req);
        CHECK(matches(g, "{}") == !req);
        /* every member (with all optional, each key position has a stack per remaining
         * property: the full instance is checked on the required schema only) */
        CHECK(matches(g, "{\"p0\":\"a\",\"p5000\":\"b\",\"p9999\":\"c\"}") == !req);
        CHECK(!matches(g, "{\"p0\":\"a\",\"p5000\":\"b\",\"p10000\":\"c\"}"));
        if (!req) {
            grm_release(g);
            continue;
        }
        struct sbuf all = {0};
        sb_put(&all, "{");
        for (int i = 0; i < 10000; i++) {
            snprintf(line, sizeof line, "%s\"p%d\":\"v%d\"", i ? "," : "", i, i);
            sb_put(&all, line);
        }
        sb_put(&all, "}");
        CHECK(matches(g, all.p));
        all.p[all.len - 3] = '1'; /* "v9999" -> "v9991": still valid */
        CHECK(matches(g, all.p));
        all.p[all.len - 1] = ','; /* unclosed */
        CHECK(!matches(g, all.p));
        free(all.p);
        grm_release(g);
    }
}

/* grm_compile_limited: each limit gives GRM_EBUDGET naming itself; within limits it compiles. */
static void test_budget(const struct grm_vocab *v)
{
    char err[MS_ERR_LEN], kw[64];
    struct grm_grammar *g = NULL;
    const char *small = "root ::= [a-z]+ \"!\"";
    struct grm_limits lim = {.max_seconds = 5, .max_rules = 100, .max_bytes = 1 << 20};
    CHECKF(grm_compile_limited(GRM_EBNF, small, v, &lim, &g, err, sizeof err, kw, sizeof kw) == 0,
           "%s", err);
    CHECK(g && matches(g, "ab!") && !matches(g, "ab"));
    grm_release(g);
    g = NULL;
    /* x{0,1000} nested three deep: ~3000 rules and quick; with a small rule budget refused */
    const char *big = "root ::= ((\"a\"{0,1000}){0,1000}){0,1000}";
    lim = (struct grm_limits){.max_rules = 1000};
    CHECK(grm_compile_limited(GRM_EBNF, big, v, &lim, &g, err, sizeof err, kw, sizeof kw) ==
          GRM_EBUDGET);
    CHECK(g == NULL);
    CHECKF(strstr(err, "1000 rules (limit max_rules)") != NULL, "%s", err);
    lim = (struct grm_limits){.max_bytes = 4096};
    CHECK(grm_compile_limited(GRM_EBNF, big, v, &lim, &g, err, sizeof err, kw, sizeof kw) ==
          GRM_EBUDGET);
    CHECKF(strstr(err, "4096 bytes (limit max_bytes)") != NULL, "%s", err);
    lim = (struct grm_limits){.max_seconds = 1e-9};
    CHECK(grm_compile_limited(GRM_EBNF, big, v, &lim, &g, err, sizeof err, kw, sizeof kw) ==
          GRM_EBUDGET);
    CHECKF(strstr(err, "1e-09 s (limit max_seconds)") != NULL, "%s", err);
    /* invalid input stays -1, also with limits */
    CHECK(grm_compile_limited(GRM_EBNF, "root ::= (", v, &lim, &g, err, sizeof err, kw,
                              sizeof kw) == -1);
    CHECK(grm_compile_limited(GRM_JSON_SCHEMA, "{\"minimum\":1}", v, &lim, &g, err, sizeof err,
                              kw, sizeof kw) == -1 && strcmp(kw, "minimum") == 0);
    /* no limits: the same grammar compiles */
    CHECKF(grm_compile_limited(GRM_EBNF, big, v, NULL, &g, err, sizeof err, kw, sizeof kw) == 0,
           "%s", err);
    CHECK(g && matches(g, "aaa") && matches(g, ""));
    grm_release(g);
}

/* A grammar whose parse stacks multiply (10^6 after the first character): the mask stops
 * within its work bound (it took 36 s on a 151k vocabulary) and keeps only tokens the
 * grammar allows. */
static void test_mask_work_bound(const struct grm_vocab *v, int vocab)
{
    char err[MS_ERR_LEN], kw[64];
    struct grm_grammar *g =
        compile(GRM_EBNF, "root ::= (((.\"a\"{0,1000}){0,1000}){0,1000})", v, err, kw);
    CHECKF(g != NULL, "%s", err);
    if (!g) return;
    struct grm_matcher *m = grm_matcher_create(g), *b = grm_matcher_create(g);
    float *row = calloc((size_t)vocab, sizeof *row);
    CHECK(m && b && row);
    if (m && b && row) {
        int n = grm_mask(m, row), bad = 0;
        CHECK(n > 0);
        for (int id = 0; id < vocab; id++)
            if (row[id] == 0.0f && !grm_allows(b, id)) bad++;
        CHECKF(bad == 0, "%d masked-in tokens refused", bad);
        /* a byte at a time: each accept restarts the tables with ~10^5 stack nodes to keep
         * (restart overran its buffer here: fuzz_grammar) */
        CHECK(grm_accept_bytes(m, "x", 1) == 0);
        CHECK(grm_accept_bytes(m, "a", 1) == 0 && grm_can_end(m));
        CHECK(grm_accept_bytes(m, "\xc3", 1) == 0 && !grm_can_end(m)); /* half a character */
        CHECK(grm_accept_bytes(m, "\xa9", 1) == 0 && grm_can_end(m));
        CHECK(grm_accept_bytes(m, "\xff", 1) == -1); /* never in UTF-8 */
    }
    free(row);
    grm_matcher_free(m);
    grm_matcher_free(b);
    grm_release(g);
}

/* Repetitions of bodies that can match nothing (once refused as left-recursive). */
static void test_nested_quantifiers(const struct grm_vocab *v)
{
    MATCHES(GRM_REGEX, "(a*)*b", v, "b", "ab", "aaab", NULL, "", "a", "ba", NULL);
    MATCHES(GRM_REGEX, "(.*)*x", v, "x", "abx", "xxx", NULL, "", "xa", "a\nx", NULL);
    MATCHES(GRM_REGEX, "(a|b*)+c", v, "c", "ac", "abbac", "bbc", NULL, "", "ab", "cc", NULL);
    MATCHES(GRM_REGEX, "(a?)*", v, "", "a", "aaaa", NULL, "b", "ab", NULL);
    MATCHES(GRM_REGEX, "((a*)*)*", v, "", "aaa", NULL, "b", NULL);
    MATCHES(GRM_REGEX, "(a?b?)+c{2}", v, "cc", "abcc", "bacc", "aabbcc", NULL, "c", "abc", NULL);
    MATCHES(GRM_REGEX, "((a|)(b|))*x", v, "x", "abx", "bax", "aax", NULL, "xb", NULL);
    MATCHES(GRM_REGEX, "(a*b*)*", v, "", "ba", "abab", NULL, "c", NULL);
    MATCHES(GRM_REGEX, "(a?){2,}b", v, "b", "aaab", NULL, "ba", NULL);
    MATCHES(GRM_EBNF, "root ::= (\"a\"*)*", v, "", "a", "aaa", NULL, "b", NULL);
    MATCHES(GRM_EBNF, "root ::= x* \"a\"\nx ::= \"b\"?", v, "a", "ba", "bba", NULL, "b", "ab",
            NULL);
    MATCHES(GRM_EBNF, "root ::= (x y)+ \"!\"\nx ::= \"a\"* | \"\"\ny ::= z?\nz ::= \"b\" | x", v,
            "!", "ab!", "bbaa!", NULL, "", "c!", NULL);
}

/* The text of a fixture line after its "X " tag, its escapes \\ \n \t \r undone, into out. */
static void unescape(const char *s, char *out)
{
    for (; *s && *s != '\n'; s++) {
        if (*s == '\\' && s[1]) {
            s++;
            *out++ = *s == 'n' ? '\n' : *s == 't' ? '\t' : *s == 'r' ? '\r' : *s;
        } else {
            *out++ = *s;
        }
    }
    *out = '\0';
}

/* Every case of tests/fixtures/regex_cases.txt (tests/reference/make_regex_cases.py): random
 * regexes with strings and whether Python's re.fullmatch takes them; ours must agree. */
static void test_regex_cases(const char *tests, const struct grm_vocab *v)
{
    FILE *f = fopen(test_path(tests, "fixtures/regex_cases.txt"), "r");
    CHECKF(f != NULL, "cannot open %s", test_path(tests, "fixtures/regex_cases.txt"));
    if (!f) return;
    char line[1024], text[1024], rx[1024] = "", err[MS_ERR_LEN], kw[64];
    struct grm_grammar *g = NULL;
    int n_rx = 0, n_str = 0, wrong = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[1] != ' ') continue;
        unescape(line + 2, text);
        if (line[0] == 'R') {
            grm_release(g);
            snprintf(rx, sizeof rx, "%s", text);
            g = compile(GRM_REGEX, rx, v, err, kw);
            if (!g && wrong++ < 10) fprintf(stderr, "regex /%s/ refused: %s\n", rx, err);
            n_rx++;
        } else if (g && (line[0] == 'Y' || line[0] == 'N')) {
            bool want = line[0] == 'Y', got = matches(g, text);
            if (got != want && wrong++ < 10)
                fprintf(stderr, "regex /%s/ on '%s': ours %d, Python %d\n", rx, text, got, want);
            n_str++;
        }
    }
    grm_release(g);
    fclose(f);
    CHECKF(n_rx >= 300 && n_str >= 300 * 15, "%d regexes, %d strings", n_rx, n_str);
    CHECKF(wrong == 0, "%d disagreements with Python's re", wrong);
}

/* Mask of the matcher after `prefix` versus trying each token on another matcher. */
static void check_mask(const struct grm_grammar *g, const struct grm_vocab *v, int vocab,
                       const char *prefix, int stride, const char *what)
{
    struct grm_matcher *m = grm_matcher_create(g);
    float *row = malloc(sizeof *row * (size_t)vocab);
    if (!m || !row || grm_accept_bytes(m, prefix, strlen(prefix)) != 0) {
        CHECKF(0, "%s: prefix '%s' refused", what, prefix);
        grm_matcher_free(m);
        free(row);
        return;
    }
    for (int i = 0; i < vocab; i++) row[i] = 0.0f;
    int n = grm_mask(m, row);
    int allowed = 0, wrong = 0;
    /* brute force on a second matcher, whose tables fill independently of the walk's */
    struct grm_matcher *b = grm_matcher_create(g);
    CHECK(b && grm_accept_bytes(b, prefix, strlen(prefix)) == 0);
    for (int id = 0; id < vocab && b; id++) {
        if (id % stride != 0 && row[id] != 0.0f) continue; /* every allowed one, a sample of the rest */
        bool ok = grm_allows(b, id);
        bool masked_ok = row[id] == 0.0f;
        allowed += ok;
        if (ok != masked_ok && wrong++ < 3)
            fprintf(stderr, "%s after '%s': token %d mask %d, brute force %d\n", what, prefix,
                    id, masked_ok, ok);
    }
    grm_matcher_free(b);
    CHECKF(wrong == 0, "%s: %d tokens disagree", what, wrong);
    if (stride == 1) CHECKF(n == allowed, "%s: mask count %d, brute force %d", what, n, allowed);
    CHECK(allowed > 0);
    grm_matcher_free(m);
    free(row);
}

static void test_mask(const char *tests, const char *tok_path, const char *cfg, int stride,
                      const char *what)
{
    char err[MS_ERR_LEN], kw[64];
    struct tokenizer *tok = NULL;
    if (tok_load(tok_path, cfg, &tok, err, sizeof err) != 0) {
        CHECKF(0, "%s", err);
        return;
    }
    int vocab = tok_vocab_size(tok);
    int32_t eos = tok_eos_id(tok);
    struct grm_vocab *v = grm_vocab_build(tok, vocab, &eos, eos >= 0 ? 1 : 0);
    CHECK(v != NULL);
    const char *schema = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
                         "\"n\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},"
                         "\"required\":[\"city\",\"n\"]}";
    struct grm_grammar *g = v ? compile(GRM_JSON_SCHEMA, schema, v, err, kw) : NULL;
    CHECKF(g != NULL, "%s", err);
    if (g) {
        const char *prefixes[] = {"", "{", "{\"ci", "{\"city\": \"Par", "{\"city\": \"Paris\", ",
                                  "{\"city\": \"Paris\", \"n\": 12", "{\"city\":\"P\",\"n\":1}"};
        for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
            check_mask(g, v, vocab, prefixes[i], stride, what);
        /* EOS only once the object is closed */
        struct grm_matcher *m = grm_matcher_create(g);
        float *row = calloc((size_t)vocab, sizeof *row);
        if (m && row && eos >= 0) {
            grm_mask(m, row);
            CHECK(row[eos] == -INFINITY);
            CHECK(grm_accept(m, eos) == -1);
            CHECK(grm_accept_bytes(m, "{\"city\":\"P\",\"n\":1}", 18) == 0);
            CHECK(grm_can_end(m) && grm_must_end(m));
            memset(row, 0, sizeof *row * (size_t)vocab);
            CHECK(grm_mask(m, row) == 1 && row[eos] == 0.0f);
            CHECK(grm_accept(m, eos) == 0);
        }
        free(row);
        grm_matcher_free(m);
        if (stride == 1) {
            test_compile(v);
            test_limits(v);
            test_budget(v);
            test_nested_quantifiers(v);
            test_regex_cases(tests, v);
            test_mask_work_bound(v, vocab);
        }
    }
    grm_release(g);
    grm_vocab_free(v);
    tok_free(tok);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    const char *built = argc > 2 ? argv[2] : "build/fixtures";
    char path[4096], cfg[4096];
    snprintf(path, sizeof path, "%s/../models/mohge-small/tokenizer.json", tests);
    snprintf(cfg, sizeof cfg, "%s/../models/mohge-small/tokenizer_config.json", tests);
    test_mask(tests, path, cfg, 1, "mohge-small");
    snprintf(path, sizeof path, "%s/tokenizers/qwen3/tokenizer.json", built);
    snprintf(cfg, sizeof cfg, "%s/fixtures/tokenizers/qwen3/tokenizer_config.json", tests);
    test_mask(tests, path, cfg, 97, "qwen3");
    return test_done("test_grammar");
}
