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
 *   TC_QWEN3_XML Qwen3-Coder, Qwen3.5, Qwen3-Next: <tool_call>\n<function=f>\n<parameter=k>\n
 *               VALUE\n</parameter>\n...</function>\n</tool_call> (a block may hold several
 *               functions). Values are raw text, typed as vLLM's qwen3_coder parser types them:
 *               by the parameter's schema type when the request's tools declare it (integer,
 *               number, boolean parsed; object/array JSON-parsed; anything else JSON-parsed or
 *               kept as a string), a parameter the schema lacks kept as a string, "null" null;
 *               one leading and one trailing newline dropped. Told from hermes by the chat
 *               template (tc_syntax_of_model), not by tokens: both have <tool_call>.
 *   TC_GLM      GLM-4.5/4.6/4.7: <tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>
 *               ...</tool_call> (4.7 may leave out the newlines); keys and values trimmed, a value
 *               kept as a string when the schema says "string", else JSON-parsed when it parses
 *               (vLLM's glm45 / glm47 parsers).
 *   TC_MINIMAX  MiniMax-M2: <minimax:tool_call>\n<invoke name="f">\n<parameter name="k">v
 *               </parameter>\n</invoke>\n...</minimax:tool_call>, one block holding every call;
 *               values trimmed and typed by the schema (its type, type lists, enum values,
 *               anyOf/oneOf/allOf), "null"/"none"/"nil" null, else JSON or string (vLLM's
 *               minimax_m2 parser).
 *   TC_LLAMA    Llama 3.1+ and Llama 4 (their published templates ask for JSON calls): the
 *               whole output, after an optional <|python_tag|> or <|python_start|> (and a
 *               <|python_end|> right after it or at the end), is one or more objects
 *               {"name": "f", "parameters": {...}} ("arguments" read too) separated by ';'
 *               (vLLM's llama3_json / llama4_json parsers). An output that starts otherwise,
 *               or does not parse as a whole, is content. A stream holds an output that
 *               starts like a call until its end. Forced as that JSON (no markers).
 * Hermes and Qwen3 XML each also read the other's body inside <tool_call> (a JSON object, a
 * <function= tag), so a wrong guess between the two still parses the calls.
 * A block of these three that does not parse as a whole (a missing close tag, text between the
 * parameters, a bad name) stays in the content, as for hermes.
 * Reasoning (TC_THINK, any syntax but harmony): a <think>...</think> span at the start of the
 * output is the model's reasoning, reported apart (vLLM's deepseek_r1 / qwen3 / glm45 /
 * minimax_m2 reasoning parsers); with TC_THINK_OPEN the prompt left <think> open, so the output
 * starts inside it. Reasoning that never closes is all reasoning. Only the text after </think>
 * is parsed for calls.
 * Forcing grammars: for the three above the call markers, function names and parameter keys
 * are forced, values of string parameters are free text (anything but the closing tag), other
 * values follow the parameter's JSON Schema. Where the markers are special tokens of the model's
 * tokenizer (tc_markers_special) the server refuses to force them, as for DeepSeek.
 *
 * Ownership: results are malloc'd and owned by the caller (tc_calls_free); inputs borrowed. */
#ifndef MOESERVE_PROTO_TOOLCALL_H
#define MOESERVE_PROTO_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>

#include "common.h"
#include "tokenizer.h"

enum tc_syntax { TC_HERMES, TC_DEEPSEEK, TC_HARMONY, TC_QWEN3_XML, TC_GLM, TC_MINIMAX, TC_LLAMA };

/* How an output is read besides its syntax (tc_stream_init, tc_parse): */
enum {
    TC_NO_CALLS = 1,   /* no calls are parsed (a request without tools): the rest is content */
    TC_THINK = 2,      /* a leading <think>...</think> is the reasoning */
    TC_THINK_OPEN = 4, /* with TC_THINK: the prompt left <think> open */
};
#define TC_THINK_BEGIN "<think>"
#define TC_THINK_END "</think>"

struct tc_tools; /* the request's tools, parsed (tc_tools_parse) */

struct tc_call {
    char *name;
    char *arguments; /* JSON text of the arguments object (compact) */
};

/* The syntax a tokenizer's model writes tool calls in, from its special tokens (MiniMax by
 * <minimax:tool_call>, GLM by <arg_key>, DeepSeek and harmony by theirs; hermes otherwise). */
enum tc_syntax tc_syntax_of(const struct tokenizer *tok);
/* Like tc_syntax_of, and where the tokens say hermes, the chat template (NULL: none) decides:
 * <function= and <parameter= in it mean Qwen3's XML calls (the markers of GLM or MiniMax in it
 * mean theirs, for a tokenizer without those tokens; <|python_tag|> or <|python_start|> in a
 * template without <tool_call> means Llama's JSON calls). */
enum tc_syntax tc_syntax_of_model(const struct tokenizer *tok, const char *chat_template);
/* vLLM's --tool-call-parser names: hermes, qwen3_coder (also qwen3_xml), glm45 (also glm47,
 * glm4_moe), minimax_m2, deepseek_v3, openai, llama3_json (also llama4_json). Returns 0 with
 * *out, -1 for another name. */
int tc_syntax_parse(const char *name, enum tc_syntax *out);
const char *tc_syntax_name(enum tc_syntax syn); /* the first vLLM name above */
/* Whether the syntax's call markers are special tokens of tok (a grammar cannot force those:
 * the grammar's vocabulary leaves special tokens out). Always for DeepSeek and harmony, never
 * for hermes (forced as it always was); for the XML syntaxes, as tok says. */
bool tc_markers_special(enum tc_syntax syn, const struct tokenizer *tok);
/* Whether the syntax's markers are special tokens (the text must keep special tokens). */
bool tc_needs_special_tokens(enum tc_syntax syn);

/* --reasoning-parser: "auto" (NULL too), "none", or one of vLLM's names for a <think> parser
 * (deepseek_r1, qwen3, glm45, minimax_m2: all read <think>...</think> the same way here).
 * Returns 0 with *mode (-1 auto, 0 off, 1 on), -1 for another name. */
int tc_reasoning_parse(const char *name, int *mode);
/* Whether chats on this model have their <think> reasoning split off: mode 1, or auto and the
 * tokenizer has <think> and </think> tokens; never for harmony (its channels say it). */
bool tc_reasoning_on(int mode, const struct tokenizer *tok, enum tc_syntax syn);
/* The TC_THINK flags for one chat: 0 when off; TC_THINK_OPEN when the rendered prompt ends in
 * <think> and spaces (the template opened the reasoning for the model). */
unsigned tc_think_flags(bool on, const char *prompt);

/* Splits a whole output into its content (the text outside well-formed calls, the syntax's
 * outer markers dropped, trimmed; appended to content) and its calls (appended to *calls,
 * *n_calls). A block that does not parse stays in the content. reasoning receives the model's
 * reasoning (harmony's analysis bodies, the <think> span under TC_THINK, trimmed; nothing when
 * none); flags are TC_NO_CALLS / TC_THINK / TC_THINK_OPEN. Text may hold NUL bytes:
 * the buffers carry the lengths. tools (borrowed, may be NULL) types the XML syntaxes' values.
 * Returns 0, or -1 when out of memory. */
int tc_parse(enum tc_syntax syn, unsigned flags, const struct tc_tools *tools, const char *text,
             size_t len, struct ms_buf *content, struct tc_call **calls, int *n_calls,
             struct ms_buf *reasoning);
void tc_calls_free(struct tc_call *calls, int n);

/* A request's tools (the JSON array OpenAI sends), parsed once for the parameter types that
 * type the XML syntaxes' raw values. Returns NULL for NULL, text that is no array, or out of
 * memory: values are then typed as without tools. Freed with tc_tools_free (NULL is fine); the
 * parses that borrow it must be done by then. */
struct tc_tools *tc_tools_parse(const char *tools_json);
void tc_tools_free(struct tc_tools *t);

/* Streaming: the output so far is fed whole each time; each step reports the content that can
 * no longer turn out to be part of a call (text[*from, *to)) and the calls completed since the
 * last step. With final, everything left is content. */
struct tc_stream {
    enum tc_syntax syn;
    const struct tc_tools *tools; /* borrowed; may be NULL */
    size_t pos;      /* text before this is reported */
    bool in_block;
    size_t block_at; /* where the open block started */
    /* harmony: outside a message, in its header or in its body (of which kind), where the
     * header and the body start, and where the next marker search resumes */
    int h_state, h_kind;
    size_t h_hdr, h_body, h_scan;
    bool reasoning; /* the range the last step reported is reasoning, not content */
    unsigned flags; /* TC_NO_CALLS / TC_THINK / TC_THINK_OPEN */
    int think;      /* TC_THINK: 1 the output may still open <think>, 2 inside it, 0 past it */
    int llama;      /* TC_LLAMA: 0 undecided, 1 content, 2 a call output (held to its end) */
};
/* tools (may be NULL) types the XML syntaxes' values; borrowed: it must outlive the stream.
 * flags: TC_NO_CALLS / TC_THINK / TC_THINK_OPEN. */
void tc_stream_init(struct tc_stream *s, enum tc_syntax syn, unsigned flags,
                    const struct tc_tools *tools);
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
