/* Tests of proto/toolcall: parsing tool calls out of model output in the Hermes/Qwen3,
 * DeepSeek-V3, Qwen3 XML (Qwen3-Coder, Qwen3.5), GLM-4.5/4.7 and MiniMax-M2 syntaxes and
 * gpt-oss's harmony messages (whole and streamed in every split), the XML syntaxes' values
 * typed by the tools' schemas, malformed blocks left as content, choosing the syntax from the
 * tokenizer and chat template, and the grammars that force a call compiling and accepting
 * well-formed calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "grammar.h"
#include "proto/toolcall.h"
#include "test.h"

#define DS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CB "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CE "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"

/* Parses text whole (the tools, a JSON array or NULL, typing XML values), then streamed with
 * every prefix length as a step; both must agree on the content, the reasoning and the calls. */
static void check_trf(enum tc_syntax syn, unsigned flags, const char *tools_json,
                      const char *text, const char *want_content, const char *want_reasoning,
                      const char *const *want, int n_want)
{
    struct ms_buf cb = {0}, rb = {0};
    struct tc_call *calls = NULL;
    int n = 0;
    struct tc_tools *tools = tc_tools_parse(tools_json);
    CHECK(!tools_json || tools);
    CHECK(tc_parse(syn, flags, tools, text, strlen(text), &cb, &calls, &n, &rb) == 0);
    char *content = ms_buf_take(&cb), *reasoning = ms_buf_take(&rb);
    CHECKF(content && strcmp(content, want_content) == 0, "content '%s', want '%s'", content,
           want_content);
    CHECKF(reasoning && strcmp(reasoning, want_reasoning) == 0, "reasoning '%s', want '%s'",
           reasoning, want_reasoning);
    CHECKF(n == n_want, "%d calls, want %d", n, n_want);
    for (int i = 0; i < n && i < n_want; i++) {
        CHECKF(strcmp(calls[i].name, want[2 * i]) == 0, "name %s", calls[i].name);
        CHECKF(strcmp(calls[i].arguments, want[2 * i + 1]) == 0, "args %s", calls[i].arguments);
    }
    tc_calls_free(calls, n);
    free(content);
    free(reasoning);
    size_t len = strlen(text);
    for (size_t cut = 1; cut <= len; cut++) {
        struct tc_stream st;
        tc_stream_init(&st, syn, flags, tools);
        struct ms_buf sb = {0}, tb = {0};
        calls = NULL;
        n = 0;
        for (size_t upto = cut;; upto = upto + cut < len ? upto + cut : len) {
            bool final = upto == len;
            CHECK(tc_stream_feed(&st, text, upto, final, &sb, &tb, &calls, &n) == 0);
            if (final) break;
        }
        char *streamed = ms_buf_take(&sb), *think = ms_buf_take(&tb);
        /* whole-parse content is trimmed; compare trimmed */
        char *a = streamed;
        while (*a == ' ' || *a == '\n') a++;
        size_t al = strlen(a);
        while (al && (a[al - 1] == ' ' || a[al - 1] == '\n')) a[--al] = '\0';
        CHECKF(strcmp(a, want_content) == 0 && n == n_want, "step %zu: '%s', %d calls", cut, a, n);
        char *r = think; /* <think> reasoning is streamed as written, returned whole trimmed */
        size_t rl = strlen(r);
        if (flags & TC_THINK) {
            while (*r == ' ' || *r == '\n') r++, rl--;
            while (rl && (r[rl - 1] == ' ' || r[rl - 1] == '\n')) r[--rl] = '\0';
        }
        CHECKF(strcmp(r, want_reasoning) == 0, "step %zu: reasoning '%s'", cut, r);
        for (int i = 0; i < n && i < n_want; i++)
            CHECKF(strcmp(calls[i].name, want[2 * i]) == 0 &&
                       strcmp(calls[i].arguments, want[2 * i + 1]) == 0,
                   "step %zu: call %d %s %s", cut, i, calls[i].name, calls[i].arguments);
        tc_calls_free(calls, n);
        free(streamed);
        free(think);
    }
    tc_tools_free(tools);
}

static void check_tr(enum tc_syntax syn, const char *tools_json, const char *text,
                     const char *want_content, const char *want_reasoning,
                     const char *const *want, int n_want)
{
    check_trf(syn, 0, tools_json, text, want_content, want_reasoning, want, n_want);
}

static void check_r(enum tc_syntax syn, const char *text, const char *want_content,
                    const char *want_reasoning, const char *const *want, int n_want)
{
    check_tr(syn, NULL, text, want_content, want_reasoning, want, n_want);
}

/* With tools, no reasoning. */
static void check_t(enum tc_syntax syn, const char *tools_json, const char *text,
                    const char *want_content, const char *const *want, int n_want)
{
    check_tr(syn, tools_json, text, want_content, "", want, n_want);
}

/* The syntaxes without reasoning. */
static void check(enum tc_syntax syn, const char *text, const char *want_content,
                  const char *const *want, int n_want)
{
    check_r(syn, text, want_content, "", want, n_want);
}

/* The syntax each real tokenizer's model writes, from its special tokens. */
static void check_syntax_of(const char *unpacked_dir, const char *name, enum tc_syntax want)
{
    char path[4096], err[MS_ERR_LEN];
    snprintf(path, sizeof path, "%s/tokenizers/%s/tokenizer.json", unpacked_dir, name);
    struct tokenizer *tok = NULL;
    CHECKF(tok_load(path, NULL, &tok, err, sizeof err) == 0, "%s: %s", name, err);
    if (!tok) return;
    CHECKF(tc_syntax_of(tok) == want, "%s: syntax %d, want %d", name, (int)tc_syntax_of(tok),
           (int)want);
    tok_free(tok);
}

/* s with ' turned into " (JSON in tests without escapes); rotating static buffers. */
static const char *J(const char *s)
{
    static char bufs[16][4096];
    static int k;
    char *b = bufs[k++ % 16];
    size_t i = 0;
    for (; s[i] && i + 1 < sizeof bufs[0]; i++) b[i] = s[i] == '\'' ? '"' : s[i];
    b[i] = '\0';
    return b;
}

#define WEATHER_TOOL                                                                              \
    "{'type':'function','function':{'name':'get_weather','parameters':{'type':'object',"        \
    "'properties':{'city':{'type':'string'},'days':{'type':'integer'},'temp':{'type':"          \
    "'number'},'metric':{'type':'boolean'},'opts':{'type':'object'},'tags':{'type':'array'},"   \
    "'code':{'type':'string'},'limit':{'anyOf':[{'type':'integer'},{'type':'null'}]},"          \
    "'mode':{'enum':[1,2]}},'required':['city']}}}"

/* Qwen3 XML (Qwen3-Coder, Qwen3.5): raw values typed by the schema as qwen3_coder does. */
static void test_qwen_xml(void)
{
    char tools[2048];
    snprintf(tools, sizeof tools, "%s", J("[" WEATHER_TOOL "]"));
    const char *call =
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
        "\n<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
        "<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n"
        "</parameter>\n<parameter=tags>\n[1, \"a\"]\n</parameter>\n</function>\n</tool_call>";
    check_t(TC_QWEN3_XML, tools, call, "I'll check.",
            (const char *const[]){"get_weather",
                                  J("{'city':'Paris','days':3,'temp':21.5,'metric':true,"
                                    "'opts':{'unit':'C'},'tags':[1,'a']}")},
            1);
    /* without tools every value is a string, as in vLLM */
    check(TC_QWEN3_XML, call, "I'll check.",
          (const char *const[]){"get_weather",
                                "{\"city\":\"Paris\",\"days\":\"3\",\"temp\":\"21.5\",\"metric\":"
                                "\"True\",\"opts\":\"{\\\"unit\\\": \\\"C\\\"}\",\"tags\":"
                                "\"[1, \\\"a\\\"]\"}"},
          1);
    /* values that do not parse stay text, integral numbers are integers, null is null, a
     * parameter the schema lacks is a string, one newline at each end is dropped */
    check_t(TC_QWEN3_XML, tools,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
            "<parameter=days>\nabc\n</parameter>\n<parameter=temp>\n4.0\n</parameter>\n"
            "<parameter=limit>\nNULL\n</parameter>\n<parameter=extra>\n5\n</parameter>\n"
            "<parameter=code>\n\nint x = a << 2; if (a<b) {}\n\n</parameter>\n</function>\n"
            "</tool_call>",
            "",
            (const char *const[]){"get_weather",
                                  "{\"city\":\"123\",\"days\":\"abc\",\"temp\":4,\"limit\":null,"
                                  "\"extra\":\"5\",\"code\":\"\\nint x = a << 2; if (a<b) {}\\n\"}"},
            1);
    /* several functions in a block, several blocks, text between them kept */
    check(TC_QWEN3_XML,
          "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>"
          "\n</function>\n</tool_call> then <tool_call>\n<function=c>\n<parameter=y>\nv\n"
          "</parameter>\n</function>\n</tool_call>",
          "then", (const char *const[]){"a", "{}", "b", "{\"x\":\"1\"}", "c", "{\"y\":\"v\"}"}, 3);
    /* a parameter left open ends at the next one or at </function>, as vLLM reads it */
    check(TC_QWEN3_XML,
          "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n"
          "</tool_call>",
          "", (const char *const[]){"f", "{\"a\":\"1\",\"b\":\"2\"}"}, 1);
    /* malformed blocks stay content: no </function>, text between parameters, a bad name, an
     * unfinished block */
    const char *bad[] = {
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
        "x <tool_call>\n<function=f>\n<parameter=a>\n1",
        "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) check(TC_QWEN3_XML, bad[i], bad[i], NULL, 0);
    /* hermes JSON in a Qwen3 XML block, and XML in a hermes block, are read too */
    check(TC_QWEN3_XML, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
          "", (const char *const[]){"f", "{\"a\":1}"}, 1);
    check_t(TC_HERMES, tools,
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call>",
            "", (const char *const[]){"get_weather", "{\"days\":2}"}, 1);
    CHECK(!tc_needs_special_tokens(TC_QWEN3_XML));
}

/* GLM-4.5/4.6/4.7: <arg_key>/<arg_value> pairs, values JSON unless the schema says string. */
static void test_glm(void)
{
    char tools[2048];
    snprintf(tools, sizeof tools, "%s", J("[" WEATHER_TOOL "]"));
    const char *call = "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
                       "123</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
                       "<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1]}</arg_value>\n<arg_key>"
                       "temp</arg_key>\n<arg_value>warm</arg_value>\n</tool_call>";
    check_t(TC_GLM, tools, call, "Let me check.",
            (const char *const[]){"get_weather", J("{'city':'123','days':2,'opts':{'a':[1]},"
                                                   "'temp':'warm'}")},
            1);
    check(TC_GLM, call, "Let me check.",
          (const char *const[]){"get_weather", J("{'city':123,'days':2,'opts':{'a':[1]},"
                                                 "'temp':'warm'}")},
          1);
    /* GLM-4.7: no newline after the name, a literal \n between tags, values trimmed */
    check(TC_GLM,
          "<tool_call>f<arg_key>a</arg_key><arg_value>[1, 2]</arg_value><arg_key> b </arg_key>"
          "\\n<arg_value> x y </arg_value></tool_call>",
          "", (const char *const[]){"f", J("{'a':[1,2],'b':'x y'}")}, 1);
    /* calls without arguments, two blocks */
    check(TC_GLM, "<tool_call>get_time\n</tool_call>\n<tool_call>get_date</tool_call>", "",
          (const char *const[]){"get_time", "{}", "get_date", "{}"}, 2);
    const char *bad[] = {
        "<tool_call>{\"name\": \"f\"}</tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1\n</tool_call>",
        "<tool_call>f\nsome words<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>",
        "<tool_call>\n</tool_call>",
        "a <tool_call>f\n<arg_key>a</arg_key>",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) check(TC_GLM, bad[i], bad[i], NULL, 0);
    CHECK(tc_needs_special_tokens(TC_GLM));
}

/* MiniMax-M2: <invoke>s in one block, values typed by the schema (types, enum, anyOf). */
static void test_minimax(void)
{
    char tools[2048];
    snprintf(tools, sizeof tools, "%s", J("[" WEATHER_TOOL "]"));
    const char *call =
        "Sure.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">"
        "Paris</parameter>\n<parameter name=\"days\">3</parameter>\n<parameter name=\"metric\">"
        "yes</parameter>\n<parameter name=\"limit\">5</parameter>\n<parameter name=\"mode\">2"
        "</parameter>\n<parameter name=\"temp\">2.50</parameter>\n</invoke>\n<invoke name=\"add\">"
        "\n<parameter name=\"a\">1</parameter>\n</invoke>\n</minimax:tool_call>";
    check_t(TC_MINIMAX, tools, call, "Sure.",
            (const char *const[]){"get_weather",
                                  J("{'city':'Paris','days':3,'metric':true,'limit':5,'mode':2,"
                                    "'temp':2.5}"),
                                  "add", J("{'a':'1'}")},
            2);
    check(TC_MINIMAX, call, "Sure.",
          (const char *const[]){"get_weather",
                                J("{'city':'Paris','days':'3','metric':'yes','limit':'5',"
                                  "'mode':'2','temp':'2.50'}"),
                                "add", J("{'a':'1'}")},
          2);
    /* null words, trimming, a failed integer left as text, JSON objects, quotes of either kind */
    check_t(TC_MINIMAX, tools,
            "<minimax:tool_call><invoke name='get_weather'><parameter name=\"limit\">none"
            "</parameter><parameter name='city'>\n  padded  \n</parameter><parameter name=\"days\">"
            "x</parameter><parameter name=\"opts\">{\"k\": null}</parameter></invoke>"
            "</minimax:tool_call>",
            "",
            (const char *const[]){"get_weather",
                                  J("{'limit':null,'city':'padded','days':'x','opts':{'k':null}}")},
            1);
    const char *bad[] = {
        "<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"a\">1</parameter>\n"
        "</minimax:tool_call>",
        "<minimax:tool_call>\n<invoke name=\"f\">\n</invoke>\n<invoke name=\"g\">\n<parameter "
        "name=\"a\">1\n</invoke>\n</minimax:tool_call>",
        "<minimax:tool_call>\n<invoke name=\"f\">\ntext\n</invoke>\n</minimax:tool_call>",
        "<minimax:tool_call>\n</minimax:tool_call>",
        "x <minimax:tool_call>\n<invoke name=\"f\">",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) check(TC_MINIMAX, bad[i], bad[i], NULL, 0);
    CHECK(tc_needs_special_tokens(TC_MINIMAX));
}

/* A small tokenizer with these added tokens (special or not), written to a temporary file. */
static struct tokenizer *small_tok(const char *const *added, const bool *special, int n)
{
    char path[] = "/tmp/moeserve_tctok_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, "w");
    fputs("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}, "
          "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
          "\"use_regex\": true}, \"decoder\": {\"type\": \"ByteLevel\"}, \"added_tokens\": [", f);
    for (int i = 0; i < n; i++)
        fprintf(f, "%s{\"id\": %d, \"content\": \"%s\", \"single_word\": false, \"lstrip\": false, "
                   "\"rstrip\": false, \"normalized\": false, \"special\": %s}",
                i ? ", " : "", 2 + i, added[i], special[i] ? "true" : "false");
    fputs("]}", f);
    fclose(f);
    struct tokenizer *tok = NULL;
    char err[MS_ERR_LEN];
    int rc = tok_load(path, NULL, &tok, err, sizeof err);
    unlink(path);
    CHECKF(rc == 0, "%s", err);
    return tok;
}

static void test_detect(const char *tests_dir)
{
    CHECK(tc_syntax_of_model(NULL, NULL) == TC_HERMES);
    CHECK(tc_syntax_of_model(NULL, "{% if tools %}<tool_call>\n<function=x>\n<parameter=y>") ==
          TC_QWEN3_XML);
    CHECK(tc_syntax_of_model(NULL, "<tool_call>{{ name }}<arg_key>") == TC_GLM);
    CHECK(tc_syntax_of_model(NULL, "<minimax:tool_call>") == TC_MINIMAX);
    CHECK(tc_syntax_of_model(NULL, "<tool_call>\n{\"name\": ...}") == TC_HERMES);
    /* the published templates: Qwen3's is hermes, Llama 4's JSON calls */
    static const struct {
        const char *file;
        enum tc_syntax syn;
    } tmpls[] = {{"qwen3.jinja", TC_HERMES}, {"llama4.jinja", TC_LLAMA}};
    for (size_t t = 0; tests_dir && t < sizeof tmpls / sizeof *tmpls; t++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/fixtures/chat/%s", tests_dir, tmpls[t].file);
        FILE *f = fopen(path, "rb");
        static char tmpl[1 << 16];
        size_t n = f ? fread(tmpl, 1, sizeof tmpl - 1, f) : 0;
        if (f) fclose(f);
        tmpl[n] = '\0';
        CHECKF(n > 0 && tc_syntax_of_model(NULL, tmpl) == tmpls[t].syn, "%s (%zu bytes)",
               tmpls[t].file, n);
    }
    static const char *const glm[] = {"<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                      "<arg_value>", "</arg_value>"};
    static const char *const mm[] = {"<minimax:tool_call>", "</minimax:tool_call>"};
    bool plain[6] = {false}, sp[6] = {true, true, true, true, true, true};
    struct tokenizer *t1 = small_tok(glm, plain, 6), *t2 = small_tok(mm, sp, 2);
    struct tokenizer *t3 = small_tok(glm, sp, 6), *t4 = small_tok(glm, plain, 2);
    CHECK(t1 && tc_syntax_of(t1) == TC_GLM && !tc_markers_special(TC_GLM, t1));
    CHECK(t2 && tc_syntax_of(t2) == TC_MINIMAX && tc_markers_special(TC_MINIMAX, t2));
    CHECK(t3 && tc_markers_special(TC_GLM, t3));
    CHECK(t4 && tc_syntax_of(t4) == TC_HERMES && !tc_markers_special(TC_QWEN3_XML, t4));
    CHECK(t4 && tc_syntax_of_model(t4, "<function=f><parameter=p>") == TC_QWEN3_XML);
    CHECK(tc_markers_special(TC_DEEPSEEK, NULL) && tc_markers_special(TC_HARMONY, NULL));
    tok_free(t1);
    tok_free(t2);
    tok_free(t3);
    tok_free(t4);
    static const struct {
        const char *name;
        enum tc_syntax syn;
    } names[] = {{"hermes", TC_HERMES},       {"qwen3_coder", TC_QWEN3_XML},
                 {"glm45", TC_GLM},           {"minimax_m2", TC_MINIMAX},
                 {"deepseek_v3", TC_DEEPSEEK}, {"openai", TC_HARMONY}};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        enum tc_syntax s = TC_HERMES;
        CHECKF(tc_syntax_parse(names[i].name, &s) == 0 && s == names[i].syn, "%s", names[i].name);
        CHECK(strcmp(tc_syntax_name(names[i].syn), names[i].name) == 0);
    }
    enum tc_syntax s;
    CHECK(tc_syntax_parse("auto", &s) == -1 && tc_syntax_parse(NULL, &s) == -1);
}

/* Whether the grammar takes text whole (and may end there). */
static bool grammar_takes(const struct grm_grammar *g, const char *text)
{
    struct grm_matcher *m = grm_matcher_create(g);
    bool ok = m && grm_accept_bytes(m, text, strlen(text)) == 0 && grm_can_end(m);
    grm_matcher_free(m);
    return ok;
}

/* Llama 3.1+/4 JSON calls: the whole output (after an optional <|python_tag|> or
 * <|python_start|>) is calls separated by ';', else it is content. */
static void test_llama(void)
{
    const char *two[] = {"get_weather", "{\"city\":\"Paris\"}", "add", "{\"a\":1,\"b\":2}"};
    check(TC_LLAMA,
          "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"add\", "
          "\"parameters\": {\"a\": 1, \"b\": 2}}",
          "", two, 2);
    check(TC_LLAMA,
          "  <|python_start|>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}};"
          "{\"name\": \"add\", \"parameters\": \"{\\\"a\\\":1,\\\"b\\\":2}\"}<|python_end|>\n",
          "", two, 2);
    check(TC_LLAMA, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
          "", two, 1);
    check(TC_LLAMA, "<|python_start|><|python_end|>{\"name\": \"f\", \"parameters\": {}}", "",
          (const char *const[]){"f", "{}"}, 1);
    /* content: text first, no name, no parameters, something after a call, an open call */
    const char *content[] = {
        "It is sunny. {\"name\": \"f\", \"parameters\": {}}",
        "{\"parameters\": {\"a\": 1}}",
        "{\"name\": \"f\"}",
        "{\"name\": \"f\", \"parameters\": {}} and then",
        "{\"name\": \"f\", \"parameters\": {}};",
        "{\"name\": \"f\", \"parameters\": {\"a\":",
        "{\"name\": \"\", \"parameters\": {}}",
        "<|python_sta",
        "{not json}",
    };
    for (size_t i = 0; i < sizeof content / sizeof *content; i++)
        check(TC_LLAMA, content[i], content[i], NULL, 0);
    check(TC_LLAMA, "   ", "", NULL, 0);
    check_trf(TC_LLAMA, TC_NO_CALLS, NULL, "{\"name\": \"f\", \"parameters\": {}}",
              "{\"name\": \"f\", \"parameters\": {}}", "", NULL, 0);
    /* detection from the template, vLLM's names */
    CHECK(tc_syntax_of_model(NULL, "{{- '<|python_start|>' }}") == TC_LLAMA);
    CHECK(tc_syntax_of_model(NULL, "<|python_tag|>") == TC_LLAMA);
    CHECK(tc_syntax_of_model(NULL, "<|python_tag|> <tool_call>") == TC_HERMES);
    enum tc_syntax syn = TC_HERMES;
    CHECK(tc_syntax_parse("llama4_json", &syn) == 0 && syn == TC_LLAMA);
    CHECK(tc_syntax_parse("llama3_json", &syn) == 0 && syn == TC_LLAMA);
    CHECK(strcmp(tc_syntax_name(TC_LLAMA), "llama3_json") == 0);
    CHECK(!tc_needs_special_tokens(TC_LLAMA) && !tc_markers_special(TC_LLAMA, NULL));

    /* the forcing grammar: the JSON the parser reads, "; " between parallel calls */
    struct tokenizer *tok = small_tok(NULL, NULL, 0);
    struct grm_vocab *v = tok ? grm_vocab_build(tok, tok_vocab_size(tok), NULL, 0) : NULL;
    CHECK(v != NULL);
    char tools[1024];
    snprintf(tools, sizeof tools, "%s",
             J("[{'type':'function','function':{'name':'get_weather','parameters':{'type':"
               "'object','properties':{'city':{'type':'string'},'days':{'type':'integer'}},"
               "'required':['city']}}},{'type':'function','function':{'name':'ping'}}]"));
    const char *good = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"days\": 2}}";
    const char *pair = "{\"name\": \"ping\", \"parameters\": {}}; {\"name\": \"ping\", "
                       "\"parameters\": {}}";
    for (int parallel = 0; parallel < 2; parallel++) {
        char err[MS_ERR_LEN], kw[64] = "", *ebnf = NULL;
        struct grm_grammar *g = NULL;
        CHECKF(tc_grammar(TC_LLAMA, tools, NULL, parallel, &ebnf, err, sizeof err, kw,
                          sizeof kw) == 0, "%s", err);
        CHECKF(ebnf && v && grm_compile(GRM_EBNF, ebnf, v, &g, err, sizeof err, NULL, 0) == 0,
               "%s\n%s", err, ebnf ? ebnf : "");
        free(ebnf);
        if (!g) continue;
        CHECK(grammar_takes(g, good));
        CHECK(grammar_takes(g, pair) == (parallel == 1));
        CHECK(!grammar_takes(g, "{\"name\": \"pong\", \"parameters\": {}}"));
        CHECK(!grammar_takes(g, "{\"name\": \"get_weather\", \"parameters\": {\"days\": 2}}"));
        CHECK(!grammar_takes(g, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}"));
        grm_release(g);
    }
    check(TC_LLAMA, good, "", (const char *const[]){"get_weather", "{\"city\":\"Oslo\",\"days\":2}"},
          1);
    grm_vocab_free(v);
    tok_free(tok);
}

/* The forcing grammars of the XML syntaxes take the calls the parser reads (names, keys,
 * typed values as the schema says) and refuse others. */
static void test_xml_grammar(void)
{
    struct tokenizer *tok = small_tok(NULL, NULL, 0);
    struct grm_vocab *v = tok ? grm_vocab_build(tok, tok_vocab_size(tok), NULL, 0) : NULL;
    CHECK(v != NULL);
    char tools[2048];
    snprintf(tools, sizeof tools, "%s",
             J("[{'type':'function','function':{'name':'get_weather','parameters':{'type':"
               "'object','properties':{'city':{'type':'string'},'days':{'type':'integer'},"
               "'unit':{'type':'string','enum':['c','f']}},'required':['city']}}},"
               "{'type':'function','function':{'name':'ping'}}]"));
    struct {
        enum tc_syntax syn;
        const char *good, *args, *two, *bad_name, *bad_value, *bad_key;
    } cases[] = {
        {TC_QWEN3_XML,
         "<tool_call>\n<function=get_weather>\n<parameter=city>\na <b> << c </par\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         "{\"city\":\"a <b> << c </par\",\"days\":3}",
         "<tool_call>\n<function=ping>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n"
         "</function>\n</tool_call>",
         "<tool_call>\n<function=pong>\n</function>\n</tool_call>",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>"
         "\nsoon\n</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function=get_weather>\n<parameter=town>\nx\n</parameter>\n</function>\n"
         "</tool_call>"},
        {TC_GLM,
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a <b> << c </arg"
         "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>f</arg_value>\n</tool_call>",
         "{\"city\":\"a <b> << c </arg\",\"unit\":\"f\"}",
         "<tool_call>ping\n</tool_call>\n<tool_call>ping\n</tool_call>",
         "<tool_call>pong\n</tool_call>",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>x</arg_value>\n<arg_key>"
         "unit</arg_key>\n<arg_value>k</arg_value>\n</tool_call>",
         "<tool_call>get_weather\n<arg_key>town</arg_key>\n<arg_value>x</arg_value>\n</tool_call>"},
        {TC_MINIMAX,
         "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Oslo"
         "</parameter>\n<parameter name=\"days\">-2</parameter>\n</invoke>\n</minimax:tool_call>",
         "{\"city\":\"Oslo\",\"days\":-2}",
         "<minimax:tool_call>\n<invoke name=\"ping\">\n</invoke>\n<invoke name=\"ping\">\n"
         "</invoke>\n</minimax:tool_call>",
         "<minimax:tool_call>\n<invoke name=\"pong\">\n</invoke>\n</minimax:tool_call>",
         "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">x"
         "</parameter>\n<parameter name=\"days\">1.5</parameter>\n</invoke>\n</minimax:tool_call>",
         "<minimax:tool_call>\n<invoke name=\"get_weather\">\n</invoke>\n</minimax:tool_call>"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char err[MS_ERR_LEN], kw[64] = "";
        for (int parallel = 0; parallel < 2; parallel++) {
            char *ebnf = NULL;
            struct grm_grammar *g = NULL;
            CHECKF(tc_grammar(cases[c].syn, tools, NULL, parallel, &ebnf, err, sizeof err, kw,
                              sizeof kw) == 0,
                   "%zu: %s", c, err);
            CHECKF(ebnf && grm_compile(GRM_EBNF, ebnf, v, &g, err, sizeof err, NULL, 0) == 0,
                   "%zu: %s\n%s", c, err, ebnf ? ebnf : "");
            free(ebnf);
            if (!g) continue;
            CHECKF(grammar_takes(g, cases[c].good), "%zu: good", c);
            CHECKF(grammar_takes(g, cases[c].two) == (parallel == 1), "%zu: two, parallel %d", c,
                   parallel);
            CHECKF(!grammar_takes(g, cases[c].bad_name), "%zu: bad name", c);
            CHECKF(!grammar_takes(g, cases[c].bad_value), "%zu: bad value", c);
            CHECKF(!grammar_takes(g, cases[c].bad_key), "%zu: bad key", c);
            grm_release(g);
        }
        /* what the grammar lets through parses to the typed call */
        check_t(cases[c].syn, tools, cases[c].good, "",
                (const char *const[]){"get_weather", cases[c].args}, 1);
        /* a named function: that one call only */
        char *ebnf = NULL;
        struct grm_grammar *g = NULL;
        CHECK(tc_grammar(cases[c].syn, tools, "ping", true, &ebnf, err, sizeof err, kw,
                         sizeof kw) == 0);
        CHECK(ebnf && grm_compile(GRM_EBNF, ebnf, v, &g, err, sizeof err, NULL, 0) == 0);
        CHECK(g && !grammar_takes(g, cases[c].good) && !grammar_takes(g, cases[c].two));
        grm_release(g);
        free(ebnf);
        CHECK(tc_grammar(cases[c].syn, tools, "nope", false, &ebnf, err, sizeof err, kw,
                         sizeof kw) == -1);
        /* a name the syntax cannot carry, a schema keyword the compiler lacks */
        CHECK(tc_grammar(cases[c].syn, J("[{'type':'function','function':{'name':'a b'}}]"), NULL,
                         false, &ebnf, err, sizeof err, kw, sizeof kw) == -1);
        kw[0] = '\0';
        CHECK(tc_grammar(cases[c].syn,
                         J("[{'type':'function','function':{'name':'f','parameters':{'type':"
                           "'object','properties':{'a':{'type':'integer','maximum':3}}}}}]"),
                         NULL, false, &ebnf, err, sizeof err, kw, sizeof kw) == -1 &&
              strcmp(kw, "maximum") == 0);
        kw[0] = '\0';
        CHECK(tc_grammar(cases[c].syn,
                         J("[{'type':'function','function':{'name':'f','parameters':{'type':"
                           "'object','properties':{'a':{'type':'string','pattern':'^a$'}}}}}]"),
                         NULL, false, &ebnf, err, sizeof err, kw, sizeof kw) == -1 &&
              strcmp(kw, "pattern") == 0);
        /* a parameter whose schema refers to the parameters' $defs */
        CHECK(tc_grammar(cases[c].syn,
                         J("[{'type':'function','function':{'name':'f','parameters':{'type':"
                           "'object','$defs':{'n':{'type':'integer'}},'properties':{'a':{'type':"
                           "'array','items':{'$ref':'#/$defs/n'}}},'required':['a']}}}]"),
                         NULL, false, &ebnf, err, sizeof err, kw, sizeof kw) == 0);
        g = NULL;
        CHECK(ebnf && grm_compile(GRM_EBNF, ebnf, v, &g, err, sizeof err, NULL, 0) == 0);
        free(ebnf);
        static const char *const ref_a[] = {
            "<tool_call>\n<function=f>\n<parameter=a>\n[4,2]\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>[4,2]</arg_value>\n</tool_call>",
            ("<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"a\">[4,2]</parameter>\n"
             "</invoke>\n</minimax:tool_call>")};
        static const char *const ref_bad[] = {
            "<tool_call>\n<function=f>\n<parameter=a>\n[\"x\"]\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>[\"x\"]</arg_value>\n</tool_call>",
            ("<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"a\">[\"x\"]</parameter>\n"
             "</invoke>\n</minimax:tool_call>")};
        CHECK(g && grammar_takes(g, ref_a[c]) && !grammar_takes(g, ref_bad[c]));
        grm_release(g);
        /* bounded strings: at most maxLength characters */
        const char *bounded = J("[{'type':'function','function':{'name':'f','parameters':{'type':"
                                "'object','properties':{'a':{'type':'string','maxLength':3}},"
                                "'required':['a']}}}]");
        CHECK(tc_grammar(cases[c].syn, bounded, NULL, false, &ebnf, err, sizeof err, kw,
                         sizeof kw) == 0);
        g = NULL;
        CHECK(ebnf && grm_compile(GRM_EBNF, ebnf, v, &g, err, sizeof err, NULL, 0) == 0);
        free(ebnf);
        static const char *const short_a[] = {
            "<tool_call>\n<function=f>\n<parameter=a>\nabc\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>abc</arg_value>\n</tool_call>",
            ("<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"a\">abc</parameter>\n"
             "</invoke>\n</minimax:tool_call>")};
        static const char *const long_a[] = {
            "<tool_call>\n<function=f>\n<parameter=a>\nabcd\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>abcd</arg_value>\n</tool_call>",
            ("<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"a\">abcd</parameter>\n"
             "</invoke>\n</minimax:tool_call>")};
        CHECK(g && grammar_takes(g, short_a[c]) && !grammar_takes(g, long_a[c]));
        grm_release(g);
    }
    grm_vocab_free(v);
    tok_free(tok);
}

/* <think> reasoning (TC_THINK): split off at the start only, streamed as whole at every step
 * size, calls parsed after it and not inside it, none at all with TC_NO_CALLS. */
static void test_think(void)
{
    const unsigned T = TC_THINK, O = TC_THINK | TC_THINK_OPEN;
    check_trf(TC_HERMES, T, NULL, "<think>\nplan it\n</think>\n\nHello", "Hello", "plan it", NULL, 0);
    check_trf(TC_HERMES, T, NULL, "  \n<think>a</think>b", "b", "a", NULL, 0);
    check_trf(TC_HERMES, O, NULL, "plan more</think>answer", "answer", "plan more", NULL, 0);
    check_trf(TC_HERMES, T, NULL, "no reasoning here", "no reasoning here", "", NULL, 0);
    check_trf(TC_HERMES, T, NULL, "answer <think>x</think>", "answer <think>x</think>", "", NULL, 0);
    check_trf(TC_HERMES, T, NULL, "<thin", "<thin", "", NULL, 0);
    check_trf(TC_HERMES, T, NULL, "<think>never closed", "", "never closed", NULL, 0);
    check_trf(TC_HERMES, O, NULL, "still thinking </thi", "", "still thinking </thi", NULL, 0);
    check_trf(TC_HERMES, 0, NULL, "<think>a</think>b", "<think>a</think>b", "", NULL, 0);
    const char *call[] = {"f", "{\"a\":\"1\"}"}; /* untyped: no tools */
    check_trf(TC_QWEN3_XML, O, NULL,
              "call f: <tool_call>\n<function=g>\n</function>\n</tool_call></think>\n"
              "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
              "", "call f: <tool_call>\n<function=g>\n</function>\n</tool_call>", call, 1);
    const char *hc[] = {"f", "{}"};
    check_trf(TC_HERMES, T, NULL, "<think>x</think><tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
              "", "x", hc, 1);
    check_trf(TC_HERMES, T | TC_NO_CALLS, NULL,
              "<think>x</think><tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
              "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", "x", NULL, 0);
    /* whether the prompt left the reasoning open */
    CHECK(tc_think_flags(false, "<think>\n") == 0);
    CHECK(tc_think_flags(true, "<|im_start|>assistant\n<think>\n") == O);
    CHECK(tc_think_flags(true, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == T);
    CHECK(tc_think_flags(true, "<think>a</think> q <think>\n") == O);
    CHECK(tc_think_flags(true, "plain") == T);
    CHECK(tc_think_flags(true, "user: what does <think> do?\nassistant:") == T);
    CHECK(tc_think_flags(true, "<|assistant|><think>") == O);
    CHECK(tc_think_flags(true, "<|assistant|></think>") == T);
    int mode = 7;
    CHECK(tc_reasoning_parse(NULL, &mode) == 0 && mode == -1);
    CHECK(tc_reasoning_parse("none", &mode) == 0 && mode == 0);
    CHECK(tc_reasoning_parse("glm45", &mode) == 0 && mode == 1);
    CHECK(tc_reasoning_parse("think", &mode) == -1);
    CHECK(!tc_reasoning_on(1, NULL, TC_HARMONY) && tc_reasoning_on(1, NULL, TC_GLM));
    CHECK(!tc_reasoning_on(-1, NULL, TC_HERMES));
}

int main(int argc, char **argv)
{
    if (argc > 2) {
        check_syntax_of(argv[2], "qwen3", TC_HERMES);
        check_syntax_of(argv[2], "deepseek_v3", TC_DEEPSEEK);
        check_syntax_of(argv[2], "gptoss", TC_HARMONY);
    }
    check(TC_HERMES, "plain text", "plain text", NULL, 0);
    test_llama();
    check(TC_HERMES,
          "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
          "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, "
          "\"b\": 2}}\n</tool_call>",
          "Let me look.", (const char *const[]){"get_weather", "{\"city\":\"Paris\"}", "add",
                                                 "{\"a\":1,\"b\":2}"},
          2);
    check(TC_HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>",
          "", (const char *const[]){"f", "{\"x\": 1}"}, 1);
    check(TC_HERMES, "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b",
          NULL, 0);
    check(TC_HERMES, "x <tool_call>{\"name\": \"f\"", "x <tool_call>{\"name\": \"f\"", NULL, 0);
    check(TC_DEEPSEEK,
          "ok" DS_BEGIN DS_CB "function" DS_SEP "get_weather\n```json\n{\"city\": \"Rome\"}\n```"
          DS_CE DS_END,
          "ok", (const char *const[]){"get_weather", "{\"city\":\"Rome\"}"}, 1);

    /* harmony (gpt-oss): reasoning apart, final and preambles are content, calls by recipient
     * in either place of the header, bodies ended by a marker, the next header or the end */
    check_r(TC_HARMONY,
            "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            "<|message|>{\"city\": \"Oslo\"}<|call|>",
            "", "The user wants the weather.",
            (const char *const[]){"get_weather", "{\"city\":\"Oslo\"}"}, 1);
    check_r(TC_HARMONY,
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
            "<|message|>It is sunny.",
            "It is sunny.", "think", NULL, 0);
    check(TC_HARMONY,
          "<|channel|>commentary<|message|>Checking two cities.<|end|>"
          "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}"
          "<|call|><|start|>assistant to=functions.ping<|channel|>commentary<|message|>{}",
          "Checking two cities.",
          (const char *const[]){"add", "{\"a\":1}", "ping", "{}"}, 2);
    /* reasoning cut off by the end of the output (max_tokens) is still reasoning */
    check_r(TC_HARMONY, "<|channel|>analysis<|message|>step one, step", "", "step one, step",
            NULL, 0);
    /* no harmony structure at all; a header that never opens; a call whose body is no JSON */
    check(TC_HARMONY, "just text < | not a marker", "just text < | not a marker", NULL, 0);
    check(TC_HARMONY, "a<|channel|>final", "a<|channel|>final", NULL, 0);
    check(TC_HARMONY, "<|channel|>commentary to=functions.f<|message|>oops<|call|>",
          "<|channel|>commentary to=functions.f<|message|>oops", NULL, 0);
    check(TC_HARMONY, "<|channel|>final<|message|>a<|end|><|channel|>final<|message|>b", "ab",
          NULL, 0);
    CHECK(tc_needs_special_tokens(TC_HARMONY));

    /* the forcing grammar: exactly {"name": ..., "arguments": {...}} in a block */
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"add\",\"parameters\":"
                        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                        "\"required\":[\"a\"]}}},{\"type\":\"function\",\"function\":{\"name\":"
                        "\"ping\"}}]";
    char *ebnf = NULL, err[MS_ERR_LEN], kw[64] = "";
    CHECKF(tc_grammar(TC_HERMES, tools, NULL, false, &ebnf, err, sizeof err, kw, sizeof kw) == 0,
           "%s", err);
    char *ds = NULL;
    CHECK(tc_grammar(TC_DEEPSEEK, tools, NULL, false, &ds, err, sizeof err, kw, sizeof kw) == -1);
    struct grm_grammar *g = NULL;
    CHECKF(ebnf && grm_compile(GRM_EBNF, ebnf, NULL, &g, err, sizeof err, NULL, 0) == 0, "%s", err);
    free(ebnf);
    grm_release(g);
    char *bad = NULL;
    CHECK(tc_grammar(TC_HERMES, "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
                                "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\","
                                "\"maximum\":3}}}}}]",
                     NULL, true, &bad, err, sizeof err, kw, sizeof kw) == -1);
    CHECK(strcmp(kw, "maximum") == 0);
    CHECK(tc_grammar(TC_HERMES, tools, "nope", true, &bad, err, sizeof err, kw, sizeof kw) == -1);

    test_qwen_xml();
    test_glm();
    test_minimax();
    test_think();
    test_detect(argc > 1 ? argv[1] : NULL);
    test_xml_grammar();
    return test_done("test_toolcall");
}
