/* Tests for proto/: every request field's type and range checks (400 naming the field),
 * prompt and message shapes, defaults, and the JSON shape of responses, SSE chunks and
 * error objects. */
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/request.h"
#include "proto/response.h"
#include "test.h"

/* Parses body as kind; expects failure with `status` and `param` (NULL: expect success). */
static void expect(enum proto_kind kind, const char *body, int status, const char *param,
                   int line)
{
    struct proto_req r;
    struct proto_error e = {0};
    int rc = proto_req_parse(body, strlen(body), kind, &r, &e);
    if (!param && status == 0) {
        CHECKF(rc == 0, "line %d: %s -> %d %s", line, body, e.status, e.message);
    } else {
        CHECKF(rc == -1 && e.status == status && strcmp(e.param, param) == 0,
               "line %d: %s -> rc %d status %d param '%s' (%s)", line, body, rc, e.status,
               e.param, e.message);
    }
    proto_req_free(&r);
}
#define OK(kind, body) expect(kind, body, 0, NULL, __LINE__)
#define BAD(kind, body, param) expect(kind, body, 400, param, __LINE__)

static void test_validation(void)
{
    const enum proto_kind C = PROTO_COMPLETION, H = PROTO_CHAT;
    BAD(C, "{", "");
    BAD(C, "[1,2]", "");
    BAD(C, "{\"model\":\"m\"}", "prompt");
    BAD(C, "{\"prompt\":5}", "prompt");
    BAD(C, "{\"prompt\":[]}", "prompt");
    BAD(C, "{\"prompt\":[-1]}", "prompt");
    BAD(C, "{\"prompt\":[{\"a\":1}]}", "prompt");
    BAD(C, "{\"prompt\":\"x\",\"model\":3}", "model");
    OK(C, "{\"prompt\":\"hello\"}");
    OK(C, "{\"prompt\":[\"a\",\"b\"]}");
    OK(C, "{\"prompt\":[1,2,3]}");
    OK(C, "{\"prompt\":[[1,2],[3]]}");
    BAD(C, "{\"prompt\":\"x\",\"unknown_field\":{\"a\":1}}", "unknown_field");
    OK(C, "{\"prompt\":\"x\",\"max_tokens\":0,\"echo\":true,\"logprobs\":1}");
    BAD(C, "{\"prompt\":\"x\",\"max_tokens\":-1}", "max_tokens");
    BAD(C, "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", "max_tokens");
    BAD(C, "{\"prompt\":\"x\",\"max_tokens\":1.5}", "max_tokens");
    BAD(C, "{\"prompt\":\"x\",\"temperature\":-0.1}", "temperature");
    BAD(C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature");
    BAD(C, "{\"prompt\":\"x\",\"top_p\":0}", "top_p");
    BAD(C, "{\"prompt\":\"x\",\"top_p\":1.5}", "top_p");
    BAD(C, "{\"prompt\":\"x\",\"top_k\":-2}", "top_k");
    BAD(C, "{\"prompt\":\"x\",\"min_p\":2}", "min_p");
    BAD(C, "{\"prompt\":\"x\",\"presence_penalty\":3}", "presence_penalty");
    BAD(C, "{\"prompt\":\"x\",\"frequency_penalty\":-2.5}", "frequency_penalty");
    BAD(C, "{\"prompt\":\"x\",\"repetition_penalty\":0}", "repetition_penalty");
    BAD(C, "{\"prompt\":\"x\",\"seed\":\"1\"}", "seed");
    BAD(C, "{\"prompt\":\"x\",\"n\":0}", "n");
    BAD(C, "{\"prompt\":\"x\",\"n\":17}", "n");
    BAD(C, "{\"prompt\":\"x\",\"stop\":3}", "stop");
    BAD(C, "{\"prompt\":\"x\",\"stop\":[\"a\",1]}", "stop");
    BAD(C, "{\"prompt\":\"x\",\"stop\":\"\"}", "stop");
    BAD(C, "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\"]}",
        "stop");
    BAD(C, "{\"prompt\":\"x\",\"stream\":1}", "stream");
    BAD(C, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", "stream_options");
    BAD(C, "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}",
        "stream_options.include_usage");
    BAD(C, "{\"prompt\":\"x\",\"logprobs\":21}", "logprobs");
    BAD(C, "{\"prompt\":\"x\",\"logprobs\":true}", "logprobs");
    BAD(C, "{\"prompt\":\"x\",\"echo\":\"yes\"}", "echo");
    BAD(C, "{\"prompt\":\"x\",\"ignore_eos\":0}", "ignore_eos");
    BAD(C, "{\"prompt\":\"x\",\"moe_top_k\":-1}", "moe_top_k");
    BAD(C, "{\"prompt\":\"x\",\"moe_tag\":7}", "moe_tag");
    BAD(C, "{\"prompt\":\"x\",\"moe_tag\":\"\"}", "moe_tag");
    BAD(C, "{\"prompt\":\"x\",\"max_tokens\":1,\"max_tokens\":2}", "");

    BAD(H, "{\"prompt\":\"x\"}", "prompt");
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":0}",
        "max_tokens");
    BAD(H, "{\"messages\":[]}", "messages");
    BAD(H, "{\"messages\":\"hi\"}", "messages");
    BAD(H, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "messages");
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages");
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}",
        "messages");
    { /* media parts are refused by name: the server is text-only */
        static const char *const media[] = {"image_url", "input_image", "input_audio", "video_url"};
        for (int k = 0; k < 4; k++) {
            char body[256];
            snprintf(body, sizeof body,
                     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                     "\"text\":\"a\"},{\"type\":\"%s\",\"%s\":{\"url\":\"x\"}}]}]}",
                     media[k], media[k]);
            struct proto_req r;
            struct proto_error e;
            CHECK(proto_req_parse(body, strlen(body), PROTO_CHAT, &r, &e) != 0);
            CHECKF(e.status == 400 && strcmp(e.code, "unsupported_content") == 0 &&
                       strstr(e.message, media[k]) && strstr(e.message, "content[1]") &&
                       strstr(e.message, "text-only"),
                   "%s: %d %s %s", media[k], e.status, e.code, e.message);
            proto_req_free(&r);
        }
    }
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":1}", "logprobs");
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}",
        "top_logprobs");
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}",
        "max_completion_tokens");
    OK(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
          "\"top_logprobs\":3,\"stream\":true,\"stream_options\":{\"include_usage\":true}}");

    /* The allow-list, unsupported fields at their neutral value, and everything new. */
    const char *M = "\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
    char b[512];
#define HB(fmt) (snprintf(b, sizeof b, "{%s," fmt "}", M), b)
    OK(C, "{\"prompt\":\"x\",\"user\":\"u\",\"metadata\":{\"a\":\"b\"},\"store\":false,"
          "\"spaces_between_special_tokens\":false,\"use_beam_search\":false,\"priority\":0,"
          "\"length_penalty\":1.0,\"suffix\":null,\"bad_words\":[]}");
    BAD(C, "{\"prompt\":\"x\",\"suffix\":\"end\"}", "suffix");
    BAD(C, "{\"prompt\":\"x\",\"use_beam_search\":true}", "use_beam_search");
    BAD(C, "{\"prompt\":\"x\",\"length_penalty\":0.5}", "length_penalty");
    BAD(C, "{\"prompt\":\"x\",\"messages\":[]}", "messages");
    BAD(C, "{\"prompt\":\"x\",\"top_logprobs\":2}", "top_logprobs");
    BAD(H, HB("\"echo\":true"), "echo");
    OK(H, HB("\"echo\":false"));
    BAD(H, HB("\"functions\":[{\"name\":\"f\"}]"), "functions");
    BAD(H, HB("\"modalities\":[\"audio\"]"), "modalities");
    OK(H, HB("\"modalities\":[\"text\"]"));
    BAD(C, "{\"prompt\":\"x\",\"logit_bias\":{\"a\":1}}", "logit_bias");
    BAD(C, "{\"prompt\":\"x\",\"logit_bias\":{\"1\":101}}", "logit_bias");
    BAD(C, "{\"prompt\":\"x\",\"logit_bias\":{\"01\":1}}", "logit_bias");
    BAD(C, "{\"prompt\":\"x\",\"logit_bias\":[1]}", "logit_bias");
    BAD(C, "{\"prompt\":\"x\",\"stop_token_ids\":[1,-1]}", "stop_token_ids");
    BAD(C, "{\"prompt\":\"x\",\"min_tokens\":5,\"max_tokens\":4}", "min_tokens");
    BAD(C, "{\"prompt\":\"x\",\"n\":3,\"best_of\":2}", "best_of");
    BAD(C, "{\"prompt\":\"x\",\"best_of\":2,\"stream\":true}", "best_of");
    BAD(C, "{\"prompt\":\"x\",\"prompt_logprobs\":21}", "prompt_logprobs");
    BAD(C, "{\"prompt\":\"x\",\"allowed_token_ids\":[]}", "allowed_token_ids");
    BAD(C, "{\"prompt\":\"x\",\"truncate_prompt_tokens\":0}", "truncate_prompt_tokens");
    BAD(C, "{\"prompt\":\"x\",\"guided_choice\":[]}", "guided_choice");
    BAD(C, "{\"prompt\":\"x\",\"guided_json\":\"{not json\"}", "guided_json");
    BAD(C, "{\"prompt\":\"x\",\"guided_regex\":\"a\",\"guided_choice\":[\"b\"]}",
        "guided_choice");
    BAD(H, HB("\"response_format\":{\"type\":\"xml\"}"), "response_format.type");
    BAD(H, HB("\"response_format\":{\"type\":\"json_schema\"}"),
        "response_format.json_schema");
    BAD(H, HB("\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{},"
              "\"extra\":1}}"),
        "response_format.json_schema");
    OK(H, HB("\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
             "\"schema\":{\"type\":\"object\"},\"strict\":true}}"));
    BAD(H, HB("\"tools\":[{\"type\":\"function\"}]"), "tools");
    BAD(H, HB("\"tool_choice\":\"required\""), "tool_choice");
    BAD(H, HB("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
              "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}"),
        "tool_choice");
    OK(H, HB("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
             "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}"));
    BAD(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"colour\":1}]}", "messages");
    OK(H, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
          "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
          "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"1\"}]}");
    BAD(H, HB("\"chat_template_kwargs\":[1]"), "chat_template_kwargs");
#undef HB

    BAD(PROTO_TOKENIZE, "{}", "prompt");
    BAD(PROTO_TOKENIZE, "{\"prompt\":[1,2]}", "prompt");
    OK(PROTO_TOKENIZE, "{\"prompt\":\"hi\",\"add_special_tokens\":false}");
    BAD(PROTO_DETOKENIZE, "{\"tokens\":\"1 2\"}", "tokens");
    BAD(PROTO_DETOKENIZE, "{}", "tokens");
    BAD(PROTO_DETOKENIZE, "{\"tokens\":[1,-2]}", "tokens");
    OK(PROTO_DETOKENIZE, "{\"tokens\":[1,2]}");
}

static void test_values(void)
{
    struct proto_req r;
    struct proto_error e;
    const char *body = "{\"model\":\"m\",\"prompt\":[\"ab\",[5,6,7]],\"max_tokens\":7,"
                       "\"temperature\":0.5,\"top_p\":0.9,\"top_k\":-1,\"min_p\":0.1,\"seed\":-3,"
                       "\"n\":2,\"stop\":[\"x\",\"yz\"],\"stream\":true,"
                       "\"stream_options\":{\"include_usage\":true},\"logprobs\":2,\"echo\":true,"
                       "\"ignore_eos\":true,\"moe_top_k\":1,\"repetition_penalty\":1.2}";
    CHECK(proto_req_parse(body, strlen(body), PROTO_COMPLETION, &r, &e) == 0);
    CHECK(strcmp(r.model, "m") == 0);
    CHECK(r.n_prompts == 2 && strcmp(r.prompts[0].text, "ab") == 0 && r.prompts[1].n_ids == 3 &&
          r.prompts[1].ids[2] == 7);
    CHECK(r.max_tokens == 7 && r.temperature == 0.5 && r.top_p == 0.9 && r.top_k == 0);
    CHECK(r.has_seed && r.seed == -3 && r.n == 2 && r.n_stop == 2 && strcmp(r.stop[1], "yz") == 0);
    CHECK(r.stream && r.include_usage && r.logprobs && r.top_logprobs == 2 && r.echo);
    CHECK(r.ignore_eos && r.moe_top_k == 1 && r.repetition_penalty > 1.19);
    CHECK(r.prompt_logprobs == -1 && r.skip_special_tokens && r.add_special_tokens);
    proto_req_free(&r);

    body = "{\"prompt\":\"x\",\"logit_bias\":{\"7\":-100,\"3\":2.5},\"stop_token_ids\":[4,5],"
           "\"min_tokens\":2,\"include_stop_str_in_output\":true,\"best_of\":3,"
           "\"skip_special_tokens\":false,\"prompt_logprobs\":0,\"allowed_token_ids\":[1,2],"
           "\"truncate_prompt_tokens\":-1,\"return_tokens_as_token_ids\":true,"
           "\"guided_json\":\"{\\\"type\\\":\\\"integer\\\"}\"}";
    CHECKF(proto_req_parse(body, strlen(body), PROTO_COMPLETION, &r, &e) == 0, "%s", e.message);
    CHECK(r.n_logit_bias == 2 && r.logit_bias[0].id == 3 && r.logit_bias[1].bias == -100);
    CHECK(r.n_stop_token_ids == 2 && r.stop_token_ids[1] == 5 && r.min_tokens == 2);
    CHECK(r.include_stop_str && r.best_of == 3 && !r.skip_special_tokens);
    CHECK(r.prompt_logprobs == 0 && r.n_allowed == 2 && r.truncate_prompt_tokens == -1);
    CHECK(r.tokens_as_ids && r.guide_kind == PROTO_GUIDE_JSON_SCHEMA && r.guide &&
          strcmp(r.guide, "{\"type\":\"integer\"}") == 0);
    proto_req_free(&r);

    body = "{\"prompt\":\"x\"}";
    CHECK(proto_req_parse(body, strlen(body), PROTO_COMPLETION, &r, &e) == 0);
    CHECK(r.max_tokens == -1 && r.temperature == 1 && r.n == 1 && !r.stream && !r.model);
    proto_req_free(&r);

    body = "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
           "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
           "{\"role\":\"assistant\",\"content\":null}],\"max_completion_tokens\":3}";
    CHECK(proto_req_parse(body, strlen(body), PROTO_CHAT, &r, &e) == 0);
    CHECKF(r.messages_json && strcmp(r.messages_json,
                                     "[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\","
                                     "\"content\":\"ab\"},{\"role\":\"assistant\",\"content\":\"\"}]") == 0,
           "%s", r.messages_json);
    CHECK(r.max_tokens == 3 && r.add_generation_prompt);
    proto_req_free(&r);
}

static json_t *load(char *s)
{
    json_t *o = s ? json_loads(s, 0, NULL) : NULL;
    free(s);
    return o;
}

static void test_responses(void)
{
    struct proto_error e;
    proto_fail(&e, 400, "temperature", "invalid_value", "bad %s", "value");
    json_t *o = load(proto_resp_error(&e));
    json_t *in = json_object_get(o, "error");
    CHECK(in && strcmp(json_string_value(json_object_get(in, "message")), "bad value") == 0);
    CHECK(strcmp(json_string_value(json_object_get(in, "type")), "invalid_request_error") == 0);
    CHECK(strcmp(json_string_value(json_object_get(in, "param")), "temperature") == 0);
    CHECK(strcmp(json_string_value(json_object_get(in, "code")), "invalid_value") == 0);
    json_decref(o);
    proto_fail(&e, 503, NULL, NULL, "loading");
    o = load(proto_resp_error(&e));
    in = json_object_get(o, "error");
    CHECK(json_is_null(json_object_get(in, "param")) && json_is_null(json_object_get(in, "code")));
    CHECK(strcmp(json_string_value(json_object_get(in, "type")), "service_unavailable_error") == 0);
    json_decref(o);

    struct smp_logprobs lp = {.token = 3, .logprob = -0.5f, .n_top = 1, .top_token = {3},
                              .top_logprob = {-0.5f}};
    struct proto_choice c[2] = {
        {.index = 0, .text = "hello", .text_len = 5, .finish_reason = "stop", .lps = &lp,
         .n_lps = 1},
        {.index = 1, .text = "hi", .text_len = 2, .finish_reason = "length"},
    };
    struct proto_usage u = {.prompt_tokens = 4, .completion_tokens = 3, .cached_tokens = 2};
    o = load(proto_resp_body(PROTO_COMPLETION, "cmpl-1", 42, "m", c, 2, &u, NULL));
    CHECK(json_integer_value(json_object_get(
              json_object_get(json_object_get(o, "usage"), "prompt_tokens_details"),
              "cached_tokens")) == 2);
    CHECK(strcmp(json_string_value(json_object_get(o, "object")), "text_completion") == 0);
    json_t *ch = json_object_get(o, "choices");
    CHECK(json_array_size(ch) == 2);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(ch, 0), "text")), "hello") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(ch, 1), "finish_reason")),
                 "length") == 0);
    json_t *lpo = json_object_get(json_array_get(ch, 0), "logprobs");
    CHECK(json_array_size(json_object_get(lpo, "token_logprobs")) == 1);
    CHECK(json_array_size(json_object_get(lpo, "text_offset")) == 1);
    CHECK(json_integer_value(json_object_get(json_object_get(o, "usage"), "total_tokens")) == 7);
    json_decref(o);

    o = load(proto_resp_body(PROTO_CHAT, "chatcmpl-1", 42, "m", c, 1, &u, NULL));
    CHECK(strcmp(json_string_value(json_object_get(o, "object")), "chat.completion") == 0);
    json_t *msg = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message");
    CHECK(strcmp(json_string_value(json_object_get(msg, "role")), "assistant") == 0);
    CHECK(strcmp(json_string_value(json_object_get(msg, "content")), "hello") == 0);
    lpo = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    CHECK(json_array_size(json_object_get(lpo, "content")) == 1);
    json_decref(o);

    char *f = proto_resp_chunk(PROTO_CHAT, "chatcmpl-1", 42, "m", &c[1], true, NULL, NULL);
    CHECK(f && strncmp(f, "data: {", 7) == 0 && strcmp(f + strlen(f) - 2, "\n\n") == 0);
    if (f) {
        f[strlen(f) - 2] = '\0';
        o = json_loads(f + 6, 0, NULL);
        CHECK(strcmp(json_string_value(json_object_get(o, "object")), "chat.completion.chunk") == 0);
        json_t *d = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "delta");
        CHECK(strcmp(json_string_value(json_object_get(d, "role")), "assistant") == 0);
        CHECK(strcmp(json_string_value(json_object_get(d, "content")), "hi") == 0);
        json_decref(o);
    }
    free(f);
    f = proto_resp_chunk(PROTO_COMPLETION, "cmpl-1", 42, "m", NULL, false, &u, NULL);
    CHECK(f && strstr(f, "\"choices\":[]") && strstr(f, "\"total_tokens\":7"));
    free(f);

    o = load(proto_resp_models("m", 1, 128));
    CHECK(strcmp(json_string_value(json_object_get(o, "object")), "list") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(json_object_get(o, "data"), 0),
                                                   "id")),
                 "m") == 0);
    json_decref(o);
    int32_t ids[3] = {1, 2, 3};
    o = load(proto_resp_tokenize(ids, 3, 128));
    CHECK(json_integer_value(json_object_get(o, "count")) == 3);
    json_decref(o);
    o = load(proto_resp_detokenize("ab", 2));
    CHECK(strcmp(json_string_value(json_object_get(o, "prompt")), "ab") == 0);
    json_decref(o);
}

/* The names in every "KEY: [a, b, ...]" line of text, joined as " a b ... ". */
static void list_names(const char *text, const char *key, char *out, size_t cap)
{
    size_t w = 0, kl = strlen(key);
    out[0] = '\0';
    for (const char *p = strstr(text, key); p; p = strstr(p + kl, key)) {
        if (p[kl] != ':') continue;
        const char *a = strchr(p, '['), *z = a ? strchr(a, ']') : NULL;
        if (!a || !z) continue;
        for (const char *c = a + 1; c < z && w + 2 < cap; c++)
            out[w++] = (*c == ',' || *c == ' ') ? ' ' : *c;
        out[w++] = ' ';
        out[w] = '\0';
    }
}

/* proto/openapi.yaml describes every field of proto_fields the way the server treats it. */
static void test_openapi_matches_table(const char *tests)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/../proto/openapi.yaml", tests);
    FILE *f = fopen(path, "rb");
    CHECKF(f != NULL, "%s", path);
    if (!f) return;
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    static char noop[8192], refused[8192];
    list_names(text, "x-no-effect", noop + 1, sizeof noop - 1);
    list_names(text, "x-refused", refused + 1, sizeof refused - 1);
    noop[0] = refused[0] = ' ';
    for (int i = 0; i < proto_n_fields; i++) {
        const struct proto_field *fl = &proto_fields[i];
        char word[80], prop[80];
        snprintf(word, sizeof word, " %s ", fl->name);
        snprintf(prop, sizeof prop, " %s:", fl->name);
        bool in_noop = strstr(noop, word) != NULL, in_refused = strstr(refused, word) != NULL;
        bool documented = strstr(text, prop) != NULL;
        switch (fl->how) {
        case PROTO_FIELD_IMPL:
            CHECKF(documented, "openapi.yaml does not describe '%s'", fl->name);
            break;
        case PROTO_FIELD_NOOP:
            CHECKF(in_noop, "'%s' is missing from x-no-effect", fl->name);
            break;
        case PROTO_FIELD_UNSUP:
            CHECKF(in_refused, "'%s' is missing from x-refused", fl->name);
            break;
        }
    }
}

int main(int argc, char **argv)
{
    test_openapi_matches_table(argc > 1 ? argv[1] : "tests");
    test_validation();
    test_values();
    test_responses();
    return test_done("test_proto");
}
