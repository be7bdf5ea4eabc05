/* OpenAI wire responses: completion and chat-completion bodies, their streaming chunks (SSE
 * `data: {...}\n\n` frames ending in `data: [DONE]`), /v1/models, /tokenize, /detokenize and
 * error objects {"error": {"message", "type", "param", "code"}}.
 *
 * Ownership: every function returns a NUL-terminated string allocated with malloc that the
 * caller frees, or NULL when out of memory. Inputs are borrowed for the call only. */
#ifndef MOESERVE_PROTO_RESPONSE_H
#define MOESERVE_PROTO_RESPONSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/request.h"
#include "proto/toolcall.h"
#include "sampler.h"
#include "tokenizer.h"

/* One choice's output (or, in a chunk, its new part). */
struct proto_choice {
    int index;
    const char *text;              /* (text_len) bytes, need not be NUL-terminated */
    size_t text_len;
    const char *finish_reason;     /* "stop", "length" or NULL */
    const struct smp_logprobs *lps; /* (n_lps) when logprobs were asked for, else NULL */
    int n_lps;
    size_t text_offset;            /* completions logprobs: offset of this text in the choice,
                                      in characters (code points), as OpenAI counts */
    /* The prompt's own logprobs: with echo_logprobs (completions echo + logprobs) they lead
     * the `logprobs` arrays, entry 0 null as OpenAI has it; prompt_logprobs adds vLLM's
     * `prompt_logprobs` list. prompt_lps: (n_prompt), entry q for token q; entry 0 unused. */
    const int32_t *prompt_ids;
    const struct smp_logprobs *prompt_lps;
    int n_prompt;
    bool echo_logprobs;
    bool prompt_logprobs;          /* add vLLM's `prompt_logprobs` list */
    bool tokens_as_ids;            /* logprob tokens as "token_id:N" */
    /* chat: tool calls, as message.tool_calls or (chunks) delta.tool_calls; their ids are
     * "<call_id>_<index>", index counting from call_index0 among the choice's calls */
    const struct tc_call *calls;
    int n_calls;
    int call_index0;
    const char *call_id;
    /* chat: the model's reasoning (gpt-oss's analysis channel), as reasoning_content when
     * reasoning_len > 0 */
    const char *reasoning;
    size_t reasoning_len;
};

struct proto_usage {
    int prompt_tokens;
    int completion_tokens;
    int cached_tokens; /* prompt tokens served from the prefix cache; < 0: not reported */
};

/* The full (non-streaming) body. kind: PROTO_COMPLETION or PROTO_CHAT. tok renders logprob
 * token strings: each token's own bytes (tok_token_bytes), so they join up to the text; a
 * token that is not whole UTF-8 reads "bytes:\\xNN..." (chat also gives its `bytes`). A
 * chat body carries vLLM's prompt_logprobs at the top level, from choices[0]. */
char *proto_resp_body(enum proto_kind kind, const char *id, long created, const char *model,
                      const struct proto_choice *choices, int n_choices,
                      const struct proto_usage *usage, const struct tokenizer *tok);

/* One SSE frame "data: {...}\n\n" for a streaming chunk of one choice; with `role` (chat, a
 * choice's first chunk) the delta carries "role": "assistant". With c == NULL the chunk has
 * empty choices and the usage (the final include_usage chunk). */
char *proto_resp_chunk(enum proto_kind kind, const char *id, long created, const char *model,
                       const struct proto_choice *c, bool role, const struct proto_usage *usage,
                       const struct tokenizer *tok);

#define PROTO_SSE_DONE "data: [DONE]\n\n"

char *proto_resp_models(const char *model, long created, int max_model_len);
char *proto_resp_model(const char *model, long created, int max_model_len); /* /v1/models/{id} */
/* GET /version: {"version", "commit", "build": {"cuda", "sanitize", "native"}} */
char *proto_resp_version(void);
/* The version and commit /version reports (static strings; moeserve_build_info). */
const char *proto_version_string(void);
const char *proto_commit_string(void);
/* GET /tokenizer_info (vLLM's; lm-eval's remote tokenizer reads it): the special tokens and
 * chat template (each may be NULL), the context length and vocabulary size. */
char *proto_resp_tokenizer_info(const char *bos, const char *eos, const char *chat_template,
                                int max_model_len, int vocab_size);
char *proto_resp_tokenize(const int32_t *ids, int n, int max_model_len);
char *proto_resp_detokenize(const char *text, size_t len);
char *proto_resp_error(const struct proto_error *e);
/* An error as an SSE frame (sent when a stream fails after its headers went out). */
char *proto_resp_error_sse(const struct proto_error *e);

#endif
