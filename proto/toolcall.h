/* Tool calls in model output: the syntaxes models write them in, parsed into OpenAI's
 * message.tool_calls (whole outputs and streams), and the grammar that makes a model write
 * them when tool_choice is "required" or names a function.
 *
 *   TC_HERMES   Qwen3, Qwen2.5, Hermes and any ChatML model (the default):
 *               <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block a call
 *   TC_DEEPSEEK DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
 *               \n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (parsed; a
 *               grammar for it is refused: its markers are special tokens)
 *   TC_HARMONY  gpt-oss: the output is a run of messages, each a header
 *               ([<|start|>assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>json]<|message|>)
 *               and a body ending at <|end|>, <|call|>, <|return|>, the next header or the end
 *               of the output. A body with a recipient R (functions.NAME) is a call of NAME
 *               with the body as its arguments; an "analysis" body is the model's reasoning
 *               (reported apart from the content, as reasoning_content); any other body ("final", a "commentary" preamble) is
 *               content. Text outside any message is content. Parsed for every chat on such a
 *               model, with or without tools; no forcing grammar (special-token markers).
 *
 * Ownership: results are malloc'd and owned by the caller (tc_calls_free); inputs borrowed. */
#ifndef MOESERVE_PROTO_TOOLCALL_H
#define MOESERVE_PROTO_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>

#include "common.h"
#include "tokenizer.h"

enum tc_syntax { TC_HERMES, TC_DEEPSEEK, TC_HARMONY };

struct tc_call {
    char *name;
    char *arguments; /* JSON text of the arguments object (compact) */
};

/* The syntax a tokenizer's model writes tool calls in. */
enum tc_syntax tc_syntax_of(const struct tokenizer *tok);
/* Whether the syntax's markers are special tokens (the text must keep special tokens). */
bool tc_needs_special_tokens(enum tc_syntax syn);

/* Splits a whole output into its content (the text outside well-formed calls, the syntax's
 * outer markers dropped, trimmed; appended to content) and its calls (appended to *calls,
 * *n_calls). A block that does not parse stays in the content. reasoning receives the model's
 * reasoning (harmony's analysis bodies, trimmed; nothing when none). Text may hold NUL bytes:
 * the buffers carry the lengths. Returns 0, or -1 when out of memory. */
int tc_parse(enum tc_syntax syn, const char *text, size_t len, struct ms_buf *content,
             struct tc_call **calls, int *n_calls, struct ms_buf *reasoning);
void tc_calls_free(struct tc_call *calls, int n);

/* Streaming: the output so far is fed whole each time; each step reports the content that can
 * no longer turn out to be part of a call (text[*from, *to)) and the calls completed since the
 * last step. With final, everything left is content. */
struct tc_stream {
    enum tc_syntax syn;
    size_t pos;      /* text before this is reported */
    bool in_block;
    size_t block_at; /* where the open block started */
    /* harmony: outside a message, in its header or in its body (of which kind), where the
     * header and the body start, and where the next marker search resumes */
    int h_state, h_kind;
    size_t h_hdr, h_body, h_scan;
    bool reasoning; /* the range the last step reported is reasoning, not content */
};
void tc_stream_init(struct tc_stream *s, enum tc_syntax syn);
/* Feeds the output so far (text[0, len), the whole of it each time, growing): appends to
 * content what can no longer turn out to be part of a call (outer markers dropped), to
 * reasoning what is the model's reasoning, and to *calls the calls completed since the last
 * feed. With final, everything left is content. The buffers grow as needed, so a caller never
 * sizes them: what is appended may start before the text the last feed consumed (an
 * unfinished block that turns out to be text). Returns 0, or -1 when out of memory (what was
 * appended stays, the stream is then unusable). */
int tc_stream_feed(struct tc_stream *s, const char *text, size_t len, bool final,
                   struct ms_buf *content, struct ms_buf *reasoning, struct tc_call **calls,
                   int *n_calls);

/* EBNF forcing one call (parallel: one or more) of the tools (a JSON array as OpenAI sends),
 * or exactly one call of the one named (whatever parallel says, as vLLM does: a named choice
 * asks for that call, not a run of them). Returns 0 with a malloc'd grammar, or -1 with a reason (a parameters
 * schema the grammar compiler lacks: its keyword in bad_keyword). */
int tc_grammar(enum tc_syntax syn, const char *tools_json, const char *only_name, bool parallel,
               char **out, char *err, size_t errlen, char *bad_keyword, size_t kwlen);

#endif
