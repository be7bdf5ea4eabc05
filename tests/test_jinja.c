/* Chat template tests: renders every conversation in tests/fixtures/chat/cases.json with the
 * template it names and compares byte for byte with what transformers' apply_chat_template
 * produced (tests/reference/make_chat_fixtures.py); renders the single-feature templates of
 * unit.json against jinja2's output; and checks that syntax errors name their line, that
 * raise_exception's message and bad messages JSON come back as errors. */
#include "jinja.h"
#include "test.h"

#include <jansson.h>

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf) buf[n] = 0;
    fclose(f);
    return buf;
}

/* Prints where two strings first differ, with some context. */
static void show_diff(const char *name, const char *want, const char *got)
{
    size_t i = 0;
    while (want[i] && want[i] == got[i]) i++;
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "%s: mismatch at byte %zu\n  want: \"", name, i);
    for (size_t k = from; want[k] && k < i + 40; k++) fputs(want[k] == '\n' ? "\\n" : (char[]){want[k], 0}, stderr);
    fprintf(stderr, "\"\n  got:  \"");
    for (size_t k = from; got[k] && k < i + 40; k++) fputs(got[k] == '\n' ? "\\n" : (char[]){got[k], 0}, stderr);
    fprintf(stderr, "\"\n");
}

static char *dump_or_null(const json_t *j)
{
    return j ? json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
}

static void test_cases(const char *dir)
{
    json_error_t je;
    json_t *cases = json_load_file(test_path(dir, "fixtures/chat/cases.json"), 0, &je);
    CHECKF(cases && json_is_array(cases), "cases.json: %s", je.text);
    if (!cases) return;
    int n_ok = 0, n_err = 0, n_obj = 0;
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *tname = json_string_value(json_object_get(c, "template"));
        char rel[256];
        snprintf(rel, sizeof rel, "fixtures/chat/%s.jinja", tname);
        char *src = read_file(test_path(dir, rel));
        CHECKF(src != NULL, "%s: cannot read %s", name, rel);
        if (!src) continue;
        char err[512] = "";
        jinja_template *t = jinja_template_parse(src, err, sizeof err);
        CHECKF(t != NULL, "%s: parse failed: %s", name, err);
        char *msgs = dump_or_null(json_object_get(c, "messages"));
        char *tools = dump_or_null(json_object_get(c, "tools"));
        char *extra = dump_or_null(json_object_get(c, "kwargs"));
        struct jinja_chat_args args = {
            .messages_json = msgs,
            .tools_json = tools,
            .extra_json = extra,
            .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
            .bos_token = json_string_value(json_object_get(c, "bos_token")),
            .eos_token = json_string_value(json_object_get(c, "eos_token")),
        };
        char *out = NULL;
        int rc = t ? jinja_render_chat_args(t, &args, &out, err, sizeof err) : -1;
        const char *want = json_string_value(json_object_get(c, "expected"));
        if (want) {
            CHECKF(rc == 0, "%s: render failed: %s", name, err);
            bool same = rc == 0 && strcmp(out, want) == 0;
            if (rc == 0 && !same) show_diff(name, want, out);
            CHECKF(same, "%s: output differs from transformers", name);
            n_ok += same;
            /* the one-shot API must agree where it can express the case */
            if (!tools && !extra) {
                char *out2 = NULL;
                int rc2 = jinja_render_chat(src, msgs, args.add_generation_prompt, args.bos_token,
                                            args.eos_token, &out2, err, sizeof err);
                CHECKF(rc2 == 0 && strcmp(out2, want) == 0, "%s: jinja_render_chat differs: %s", name,
                       rc2 ? err : "");
                free(out2);
            }
        } else {
            CHECKF(rc != 0, "%s: transformers raised (%s) but we rendered", name,
                   json_string_value(json_object_get(c, "error")));
            CHECK(out == NULL);
            CHECKF(err[0] != 0, "%s: no error message", name);
            n_err += rc != 0;
        }
        free(out);
        out = NULL;
        /* the same conversation with the calls' JSON-string arguments handed over as objects
         * (vLLM's way), and the probe that decides it: a template that raises on the client's
         * strings but renders objects must be given objects */
        const char *want_obj = json_string_value(json_object_get(c, "expected_object_arguments"));
        if (t && (want_obj || json_object_get(c, "error_object_arguments"))) {
            if (!want && want_obj)
                CHECKF(jinja_chat_object_arguments(t), "%s: the template needs object arguments "
                       "but the probe keeps strings", name);
            args.object_arguments = true;
            rc = jinja_render_chat_args(t, &args, &out, err, sizeof err);
            if (want_obj) {
                bool same = rc == 0 && strcmp(out, want_obj) == 0;
                if (rc == 0 && !same) show_diff(name, want_obj, out);
                CHECKF(same, "%s: object arguments: output differs from transformers (%s)", name,
                       rc ? err : "");
                n_obj += same;
            } else {
                CHECKF(rc != 0, "%s: object arguments: transformers raised but we rendered", name);
            }
            free(out);
        }
        free(msgs);
        free(tools);
        free(extra);
        jinja_template_free(t);
        free(src);
    }
    printf("chat cases: %d rendered identically, %d failed as expected, of %zu; %d with object "
           "arguments\n", n_ok, n_err, json_array_size(cases), n_obj);
    json_decref(cases);
}

static void test_units(const char *dir)
{
    json_error_t je;
    json_t *units = json_load_file(test_path(dir, "fixtures/chat/unit.json"), 0, &je);
    CHECKF(units && json_is_array(units), "unit.json: %s", je.text);
    if (!units) return;
    size_t i;
    json_t *u;
    json_array_foreach(units, i, u)
    {
        const char *name = json_string_value(json_object_get(u, "name"));
        const char *want = json_string_value(json_object_get(u, "expected"));
        char err[512] = "";
        char *out = NULL;
        jinja_template *t = jinja_template_parse(json_string_value(json_object_get(u, "template")), err, sizeof err);
        CHECKF(t != NULL, "unit %s: parse failed: %s", name, err);
        int rc = t ? jinja_template_render(t, json_object_get(u, "context"), &out, err, sizeof err) : -1;
        if (want) {
            CHECKF(rc == 0, "unit %s: render failed: %s", name, err);
            if (rc == 0 && strcmp(out, want) != 0) show_diff(name, want, out);
            CHECKF(rc == 0 && strcmp(out, want) == 0, "unit %s: output differs from jinja2", name);
        } else {
            CHECKF(rc != 0, "unit %s: jinja2 raised but we rendered", name);
        }
        free(out);
        jinja_template_free(t);
    }
    json_decref(units);
}

static void expect_error(const char *tpl, const char *msgs, const char *needle)
{
    char err[512] = "";
    char *out = (char *)1;
    int rc = jinja_render_chat(tpl, msgs, true, "<s>", "</s>", &out, err, sizeof err);
    CHECKF(rc == -1, "expected an error for %s", tpl);
    CHECK(out == NULL);
    CHECKF(strstr(err, needle) != NULL, "error '%s' lacks '%s'", err, needle);
}

static void test_errors(void)
{
    const char *msgs = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    /* syntax errors name the line */
    expect_error("line one\n{% if x %}\nno endif", msgs, "line 3");
    expect_error("a\nb\n{{ 1 + }}", msgs, "line 3");
    expect_error("{% for x in y %}\n{% endif %}", msgs, "line 2");
    expect_error("\n\n{% frobnicate %}", msgs, "line 3");
    expect_error("{{ 'unterminated }}", msgs, "line 1");
    expect_error("x\n{# never closed", msgs, "line 2");
    expect_error("{{ x | nosuchfilter }}", msgs, "unknown filter");
    /* raise_exception surfaces its message */
    expect_error("{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with "
                 "a system message') }}{% endif %}",
                 msgs, "Conversation must start with a system message");
    /* bad messages JSON */
    const char *tpl = "{% for m in messages %}{{ m.content }}{% endfor %}";
    expect_error(tpl, "[{\"role\": \"user\", ", "invalid JSON");
    expect_error(tpl, "{\"role\": \"user\"}", "array");
    expect_error(tpl, "[]", "empty");
    expect_error(tpl, "[1, 2]", "messages[0]");
    expect_error(tpl, NULL, "messages");
    /* undefined values fail where jinja2 fails */
    expect_error("{{ messages[0].nope.deeper }}", msgs, "undefined");
    expect_error("{{ messages[0].nope + 'x' }}", msgs, "undefined");
    /* and work where jinja2 lets them */
    char err[512], *out = NULL;
    CHECK(jinja_render_chat("[{{ nope }}{{ messages[0].nope }}{% for x in nope %}x{% endfor %}"
                            "{{ nope is defined }}{{ bos_token }}{{ eos_token }}]",
                            msgs, false, NULL, "</s>", &out, err, sizeof err) == 0);
    CHECKF(out && strcmp(out, "[False</s>]") == 0, "got %s", out ? out : err);
    free(out);
    /* null keys are dropped, as apply_chat_template does */
    out = NULL;
    CHECK(jinja_render_chat("{{ messages[0].content is defined }}{{ messages[0] | length }}",
                            "[{\"role\":\"assistant\",\"content\":null}]", false, NULL, NULL, &out, err,
                            sizeof err) == 0);
    CHECKF(out && strcmp(out, "False1") == 0, "got %s", out ? out : err);
    free(out);
    /* int64 bounds (Python's ints have none): overflow is an error, never a wrapped value;
     * steps near the bounds count their elements rather than step past the end (fuzz_jinja) */
    expect_error("{{ 2 ** 70 }}", msgs, "integer overflow");
    expect_error("{{ 9223372036854775807 + 1 }}", msgs, "integer overflow");
    expect_error("{{ (-9223372036854775807 - 1) // -1 }}", msgs, "integer overflow");
    expect_error("{{ 3037000500 * 3037000500 }}", msgs, "integer overflow");
    /* a render's work and memory are bounded (fuzz_jinja found nested loops that ran for ever) */
    expect_error("{% for a in range(1000) %}{% for b in range(101) %}{% endfor %}{% endfor %}",
                 msgs, "runs too long");
    expect_error("{% macro f(n) %}{% for i in range(100000) %}{% endfor %}{{ f(n) }}{% endmacro %}"
                 "{{ f(1) }}",
                 msgs, "runs too long");
    expect_error("{% set s = 'a' * 60000000 %}{{ s ~ s ~ s ~ s ~ s }}", msgs, "at most 256 MiB");
    /* values nest at most JINJA_MAX_VALUE_DEPTH deep: printing or comparing a value built by a
     * loop of [x] 99,990 deep overflowed the stack; a namespace holding itself made a cycle */
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(99990) %}{% set ns.x = [ns.x] %}"
                 "{% endfor %}{{ ns.x }}{{ ns.x == ns.x }}",
                 msgs, "values nested deeper than 512 levels");
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(512) %}{% set ns.x = [ns.x] %}"
                 "{% endfor %}{{ ns.x }}",
                 msgs, "values nested deeper than 512 levels");
    expect_error("{% set ns = namespace(a=1) %}{% set ns.x = ns %}{{ ns }}", msgs,
                 "a namespace cannot hold a namespace");
    expect_error("{% set ns = namespace(a=1) %}{% set ns.x = [{'k': ns}] %}{{ ns }}", msgs,
                 "a namespace cannot hold a namespace");
    {
        char *o = NULL;
        CHECK(jinja_render_chat("{% set ns = namespace(x=[]) %}{% for i in range(511) %}"
                                "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|string|length }}",
                                msgs, false, NULL, NULL, &o, err, sizeof err) == 0);
        CHECKF(o && strcmp(o, "1024") == 0, "got %s", o ? o : err);
        free(o);
    }
    out = NULL;
    CHECK(jinja_render_chat("{{ 2 ** 62 }} {{ (-1) ** 65 }} {{ 'abcdef'[1::9223372036854775807] }} "
                            "{{ 'abc'[::-9223372036854775807] }} "
                            "{{ range(-9223372036854775807, 9223372036854775807, "
                            "4611686018427387904) | list }}",
                            msgs, false, NULL, NULL, &out, err, sizeof err) == 0);
    CHECKF(out && strcmp(out, "4611686018427387904 -1 b c [-9223372036854775807, "
                              "-4611686018427387903, 1, 4611686018427387905]") == 0,
           "got %s", out ? out : err);
    free(out);
}

/* A parsed template is reusable and unchanged by renders (set/namespace live per render). */
static void test_reuse(void)
{
    char err[512];
    jinja_template *t = jinja_template_parse(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}{% if add_generation_prompt %}+{% endif %}",
        err, sizeof err);
    CHECKF(t != NULL, "%s", err);
    if (!t) return;
    for (int k = 0; k < 3; k++) {
        struct jinja_chat_args a = {.messages_json = "[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\"}]",
                                    .add_generation_prompt = k == 1};
        char *out = NULL;
        CHECK(jinja_render_chat_args(t, &a, &out, err, sizeof err) == 0);
        CHECKF(out && strcmp(out, k == 1 ? "2+" : "2") == 0, "render %d: %s", k, out ? out : err);
        free(out);
    }
    jinja_template_free(t);
}

/* Bad templates fail cleanly: every prefix of a real template, and absurd nesting. */
/* Numbers past int64 (fuzz_jinja found the first under UBSan): `int` of a float too large for
 * int64 gives the filter's default, as for any value it cannot convert; `abs` of the smallest
 * int64 is its magnitude as a float. */
static void test_int_range(void)
{
    char err[512] = "", *out = NULL;
    jinja_template *t = jinja_template_parse(
        "{{ 3.4e62|int }}|{{ (0.0/1 - 1e300)|int(7) }}|{{ (-9223372036854775807 - 1)|abs }}", err,
        sizeof err);
    CHECKF(t != NULL, "%s", err);
    json_t *ctx = json_object();
    int rc = t ? jinja_template_render(t, ctx, &out, err, sizeof err) : -1;
    CHECKF(rc == 0 && out && strcmp(out, "0|7|9.223372036854776e+18") == 0, "got '%s' (%s)",
           out ? out : "", err);
    free(out);
    out = NULL;
    jinja_template_free(t);
    /* an empty string repeated 8 ** 10 times is empty at once (it looped a billion times) */
    t = jinja_template_parse("{{ '' * 8 ** 10 }}x{{ 'ab' * 3 }}", err, sizeof err);
    rc = t ? jinja_template_render(t, ctx, &out, err, sizeof err) : -1;
    CHECKF(rc == 0 && out && strcmp(out, "xababab") == 0, "got '%s' (%s)", out ? out : "", err);
    free(out);
    json_decref(ctx);
    jinja_template_free(t);
}

static void test_robustness(const char *dir)
{
    char *src = read_file(test_path(dir, "fixtures/chat/qwen3.jinja"));
    CHECK(src != NULL);
    if (!src) return;
    size_t n = strlen(src);
    const char *msgs = "[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"<think>x</think>y\"}]";
    int parsed = 0;
    for (size_t k = 0; k < n; k += 3) {
        char saved = src[k];
        src[k] = 0;
        char err[512], *out = NULL;
        jinja_template *t = jinja_template_parse(src, err, sizeof err);
        if (t) {
            parsed++;
            struct jinja_chat_args a = {.messages_json = msgs, .add_generation_prompt = true};
            if (jinja_render_chat_args(t, &a, &out, err, sizeof err) == 0) free(out);
            jinja_template_free(t);
        } else {
            CHECKF(strncmp(err, "template line ", 14) == 0, "prefix %zu: error without a line: %s", k, err);
        }
        src[k] = saved;
    }
    CHECK(parsed > 0);
    free(src);
    /* nesting deeper than the parser allows */
    size_t depth = 5000;
    char *deep = malloc(depth * 2 + 16);
    strcpy(deep, "{{ ");
    for (size_t i = 0; i < depth; i++) strcat(deep + i, "(");
    strcat(deep, "1");
    for (size_t i = 0; i < depth; i++) strcat(deep + depth, ")");
    strcat(deep, " }}");
    char err[512];
    jinja_template *t = jinja_template_parse(deep, err, sizeof err);
    CHECKF(t == NULL && strstr(err, "too deeply"), "deep nesting: %s", t ? "parsed" : err);
    jinja_template_free(t);
    free(deep);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "tests";
    test_cases(dir);
    test_units(dir);
    test_errors();
    test_reuse();
    test_int_range();
    test_robustness(dir);
    return test_done("test_jinja");
}
