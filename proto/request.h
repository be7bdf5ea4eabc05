/* OpenAI wire requests: parses and validates the JSON bodies of /v1/completions,
 * /v1/chat/completions, /tokenize and /detokenize (jansson) into typed structs, and describes
 * failures as OpenAI error objects (HTTP status, type, the offending field in `param`).
 * Every field a client may send is in one table (proto_fields): implemented, accepted with no
 * effect (the documented allow-list, e.g. `user`), or not supported. A field outside the table,
 * or an unsupported one with a value other than its neutral one (false, 0, null...), is a 400
 * naming it: nothing a client asks for is silently ignored. Known fields are type- and
 * range-checked.
 *
 * Ownership: proto_req_parse fills a caller-owned struct proto_req whose strings and arrays it
 * allocates; proto_req_free releases them (also after a failed parse, which leaves the struct
 * safe to free). Nothing here touches the model: token-id ranges, prompt length and the model
 * name are checked by the server, which knows them. */
#ifndef MOESERVE_PROTO_REQUEST_H
#define MOESERVE_PROTO_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROTO_MAX_STOP 8
#define PROTO_MAX_MOE_TAG 64      /* bytes of a moe_tag */
#define PROTO_MAX_N 16
#define PROTO_MAX_PROMPTS 64
#define PROTO_MAX_LOGPROBS 20
#define PROTO_MAX_LOGIT_BIAS 1024 /* logit_bias entries */
#define PROTO_MAX_STOP_IDS 64     /* stop_token_ids */
#define PROTO_MAX_BEST_OF 16

struct proto_error {
    int status;          /* HTTP status: 400, 401, 404, 405, 408, 411, 413, 414, 417, 429, 431,
                            500, 501, 503, 505 */
    char param[64];      /* the offending field ("" = null) */
    char code[48];       /* "" = null */
    char message[384];
};

/* Sets e and returns -1 (for `return proto_fail(...)`). type follows from status. */
int proto_fail(struct proto_error *e, int status, const char *param, const char *code,
               const char *fmt, ...) __attribute__((format(printf, 5, 6)));
const char *proto_error_type(int status);

enum proto_kind {
    PROTO_COMPLETION,
    PROTO_CHAT,
    PROTO_TOKENIZE,   /* {"prompt": str} or {"messages": [...]} (with tools,
                         chat_template_kwargs, reasoning_effort), add_special_tokens */
    PROTO_DETOKENIZE, /* {"tokens": [ids]} */
};

/* The API a request came in: every one is translated at the edge (proto/anthropic.c,
 * proto/responses.c) into the chat request below, which one validation checks. */
enum proto_api {
    PROTO_API_OPENAI,    /* /v1/completions, /v1/chat/completions, /tokenize, /detokenize */
    PROTO_API_ANTHROPIC, /* /v1/messages, /v1/messages/count_tokens */
    PROTO_API_RESPONSES, /* /v1/responses */
};

/* How the server treats a request field (see proto_fields). */
enum proto_field_how {
    PROTO_FIELD_IMPL,  /* implemented */
    PROTO_FIELD_NOOP,  /* accepted, no effect on the output (the documented allow-list) */
    PROTO_FIELD_UNSUP, /* 400 unless null or its neutral value */
};

#define PROTO_K_CMPL  1u
#define PROTO_K_CHAT  2u
#define PROTO_K_TOK      4u  /* POST /tokenize of a prompt (vLLM's TokenizeCompletionRequest) */
#define PROTO_K_TOK_CHAT 8u  /* POST /tokenize of messages (vLLM's TokenizeChatRequest) */
#define PROTO_K_DETOK    16u /* POST /detokenize */
#define PROTO_K_MSG      32u /* POST /v1/messages (Anthropic Messages) */
#define PROTO_K_MSGC     64u /* POST /v1/messages/count_tokens */
#define PROTO_K_RESP     128u /* POST /v1/responses (OpenAI Responses) */

struct proto_field {
    const char *name;
    unsigned kinds;           /* the requests that take it: PROTO_K_* bits */
    enum proto_field_how how;
    const char *neutral;      /* UNSUP: the JSON value that asks for nothing (NULL: only null) */
};

/* Every field of OpenAI's and vLLM's completion, chat, tokenize and detokenize requests, and
 * moeserve's own. */
extern const struct proto_field proto_fields[];
extern const int proto_n_fields;

/* Structured output: what the output must match. */
enum proto_guide {
    PROTO_GUIDE_NONE,
    PROTO_GUIDE_JSON_OBJECT, /* response_format json_object: any JSON object */
    PROTO_GUIDE_JSON_SCHEMA, /* response_format json_schema, guided_json: `guide` is the schema */
    PROTO_GUIDE_REGEX,       /* guided_regex: `guide` is the pattern */
    PROTO_GUIDE_CHOICE,      /* guided_choice: `guide` is a JSON array of strings */
    PROTO_GUIDE_GRAMMAR,     /* guided_grammar: `guide` is EBNF (see engine/grammar) */
};

enum proto_tool_choice {
    PROTO_TOOL_AUTO,     /* the model may call tools (default when tools are given) */
    PROTO_TOOL_NONE,     /* tools are shown to the template, no call is parsed */
    PROTO_TOOL_REQUIRED, /* at least one call, enforced by the grammar sampler */
    PROTO_TOOL_NAMED,    /* exactly this function (tool_choice_name) */
};

struct proto_bias {
    int32_t id;
    float bias;
};

/* One prompt of a completion: text or token ids. */
struct proto_prompt {
    char *text;   /* NUL-terminated, or NULL when ids */
    int32_t *ids; /* (n_ids) or NULL */
    int n_ids;
};

struct proto_req {
    enum proto_kind kind;
    char *model;                /* NULL when absent */
    struct proto_prompt *prompts; /* (n_prompts) completions/tokenize */
    int n_prompts;
    char *messages_json;        /* chat/tokenize: messages array re-serialized with string
                                   contents (parts joined), ready for the chat template */
    bool add_generation_prompt; /* chat/tokenize (default true for chat) */
    bool add_special_tokens;    /* tokenize (default true); completions always true */
    int32_t *tokens;            /* detokenize: (n_tokens) */
    int n_tokens;

    int max_tokens;             /* -1 = not given (the server fills the rest of the context) */
    double temperature;         /* default 1 */
    double top_p;               /* default 1 */
    int top_k;                  /* default 0 = off (-1 accepted as off) */
    double min_p;               /* default 0 */
    double presence_penalty, frequency_penalty; /* default 0 */
    double repetition_penalty;  /* default 1 */
    bool has_seed;
    int64_t seed;
    int n;                      /* default 1 */
    char *stop[PROTO_MAX_STOP];
    int n_stop;
    bool stream;
    bool include_usage;         /* stream_options.include_usage */
    bool logprobs;              /* chat: logprobs=true; completions: logprobs given */
    int top_logprobs;           /* chat: top_logprobs; completions: the logprobs integer */
    bool echo;
    bool ignore_eos;
    int moe_top_k;              /* 0 = the model's */
    int moe_samples;            /* continuous experts: samples per token, 0 = the default */
    double moe_neuron_fraction; /* continuous experts: neuron fraction, 0 = the default */
    bool moe_samples_adaptive;  /* continuous experts: moe_samples is an average, per-token K
                                   from the router's uncertainty */
    int speculative;            /* -1 not given, 0 false (no drafts for this request), 1 true */

    int prompt_logprobs;        /* vLLM prompt_logprobs: -1 = off, else alternatives (0..20) */
    int min_tokens;             /* EOS and stop conditions are held off until this many */
    int32_t *stop_token_ids;    /* (n_stop_token_ids) */
    int n_stop_token_ids;
    bool include_stop_str;      /* include_stop_str_in_output */
    int best_of;                /* 0 = n; else best_of >= n samples, the n best returned */
    bool skip_special_tokens;   /* default true */
    struct proto_bias *logit_bias; /* (n_logit_bias) sorted by id, ids unique */
    int n_logit_bias;
    int32_t *allowed_token_ids; /* (n_allowed) or NULL */
    int n_allowed;
    int truncate_prompt_tokens; /* 0 = off; else keep the last k prompt tokens */
    bool tokens_as_ids;         /* return_tokens_as_token_ids */
    char *cache_salt;           /* NULL or a salt separating this request's prefix cache */
    char *moe_tag;              /* NULL or the request's tag in the live collaboration view
                                   (1..PROTO_MAX_MOE_TAG bytes) */

    enum proto_guide guide_kind;
    char *guide;                /* see enum proto_guide */
    char *guide_name;           /* json_schema.name, or NULL */
    const char *guide_param;    /* the field that asked for it (static string) */

    char *tools_json;           /* chat: the tools array as given (for the template), or NULL */
    enum proto_tool_choice tool_choice;
    char *tool_choice_name;     /* PROTO_TOOL_NAMED */
    bool parallel_tool_calls;   /* default true */
    char *template_kwargs_json; /* chat_template_kwargs object (reasoning_effort merged in),
                                   or NULL */
    char *reasoning_effort;     /* "low" / "medium" / "high", or NULL; the server refuses it
                                   for a template that does not read it */

    /* Set by the edge translations (proto_req_parse_api), zero for OpenAI's routes. */
    enum proto_api api;
    bool count_only;            /* /v1/messages/count_tokens: only the prompt is read */
    bool thinking_switch;       /* Anthropic `thinking` set enable_thinking: the template must
                                   read it (else a 400 naming `thinking`) */
    int thinking_budget;        /* Anthropic thinking.budget_tokens (0: none): the output ends
                                   (max_tokens) when the reasoning reaches it unfinished */
    bool store;                 /* Responses: keep the response (default true) */
    char *previous_response_id; /* Responses: the stored response this one continues */
    char *echo_json;            /* Responses: the request's settings the response object
                                   repeats (a JSON object) */
    char *conv_json;            /* Responses: the conversation as chat messages without the
                                   instructions (what a later previous_response_id continues) */
};

/* Parses `len` bytes of JSON. Returns 0, or -1 with e filled (400 for bad JSON or fields). */
int proto_req_parse(const char *body, size_t len, enum proto_kind kind, struct proto_req *r,
                    struct proto_error *e);
void proto_req_free(struct proto_req *r);

/* Responses' previous_response_id: the stored conversation of response `id` as a malloc'd
 * JSON array of chat messages, or NULL when no such response is stored. */
typedef char *(*proto_conv_lookup)(void *ctx, const char *id);

/* Parses a body of the Anthropic Messages API (count_only: count_tokens) or of OpenAI's
 * Responses API: its fields are checked against proto_fields (PROTO_K_MSG / _MSGC / _RESP),
 * translated into a chat request and validated as chat completions are, so all three APIs share
 * one validation. Errors name the field as the client's API spells it. lookup (may be NULL:
 * previous_response_id is then unknown) is called at most once. Same ownership as
 * proto_req_parse. */
int proto_req_parse_api(const char *body, size_t len, enum proto_api api, bool count_only,
                        proto_conv_lookup lookup, void *lookup_ctx, struct proto_req *r,
                        struct proto_error *e);
/* Rewrites an error of the internal chat request (e.g. from the server's checks: `max_tokens`
 * past the context) to name the field as `api` spells it (Responses: `max_output_tokens`). */
void proto_error_remap(enum proto_api api, struct proto_error *e);

#endif
