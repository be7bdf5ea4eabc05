/* Tests of proto/toolcall: parsing tool calls out of model output in the Hermes/Qwen3 and
 * DeepSeek-V3 syntaxes and gpt-oss's harmony messages (whole and streamed in every split),
 * malformed blocks left as content, and the grammar that forces a call compiling and accepting exactly well-formed calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "grammar.h"
#include "proto/toolcall.h"
#include "test.h"

#define DS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CB "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CE "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"

/* Parses text whole, then streamed with every prefix length as a step; both must agree on the
 * content, the reasoning and the calls. */
static void check_r(enum tc_syntax syn, const char *text, const char *want_content,
                    const char *want_reasoning, const char *const *want, int n_want)
{
    struct ms_buf cb = {0}, rb = {0};
    struct tc_call *calls = NULL;
    int n = 0;
    CHECK(tc_parse(syn, text, strlen(text), &cb, &calls, &n, &rb) == 0);
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
        tc_stream_init(&st, syn);
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
        CHECKF(strcmp(think, want_reasoning) == 0, "step %zu: reasoning '%s'", cut, think);
        tc_calls_free(calls, n);
        free(streamed);
        free(think);
    }
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

int main(int argc, char **argv)
{
    if (argc > 2) {
        check_syntax_of(argv[2], "qwen3", TC_HERMES);
        check_syntax_of(argv[2], "deepseek_v3", TC_DEEPSEEK);
        check_syntax_of(argv[2], "gptoss", TC_HARMONY);
    }
    check(TC_HERMES, "plain text", "plain text", NULL, 0);
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
    return test_done("test_toolcall");
}
