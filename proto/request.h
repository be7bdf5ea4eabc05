/* OpenAI wire requests: parses and validates the JSON bodies of /v1/completions,
 * /v1/chat/completions, /tokenize and /detokenize (jansson) into typed structs, and describes
 * failures as OpenAI error objects (HTTP status, type, the offending field in `param`).
 * Unknown fields are ignored, as the official clients send extras; every known field is
 * type- and range-checked.
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
#define PROTO_MAX_N 16
#define PROTO_MAX_PROMPTS 64
#define PROTO_MAX_LOGPROBS 20

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
    PROTO_TOKENIZE,   /* {"prompt": str} or {"messages": [...]}, add_special_tokens */
    PROTO_DETOKENIZE, /* {"tokens": [ids]} */
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
};

/* Parses `len` bytes of JSON. Returns 0, or -1 with e filled (400 for bad JSON or fields). */
int proto_req_parse(const char *body, size_t len, enum proto_kind kind, struct proto_req *r,
                    struct proto_error *e);
void proto_req_free(struct proto_req *r);

#endif
