/* Chat templates: a Jinja2 subset, enough to render the chat templates that models ship in
 * tokenizer_config.json exactly as Hugging Face transformers renders them (jinja2 with
 * trim_blocks and lstrip_blocks on, its tojson/raise_exception/namespace globals, and the
 * message normalisation apply_chat_template does first). Supported: {{ }}, {% %}, {# #},
 * whitespace control, if/elif/else, for (loop.*, else, inline if, tuple targets), set (plain,
 * ns.attr, block), macro, break/continue, generation blocks, the usual expressions, filters,
 * tests and Python string/dict methods. Parse once with jinja_template_parse, render many
 * times; every render allocates from its own arena, freed before it returns. */
#ifndef MOESERVE_JINJA_H
#define MOESERVE_JINJA_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

typedef struct jinja_template jinja_template;

/* Parses template source. Returns a template the caller frees with jinja_template_free, or NULL
 * with "line N: reason" in err. The template copies what it needs; src may be freed after. */
jinja_template *jinja_template_parse(const char *src, char *err, size_t errlen);
void jinja_template_free(jinja_template *t);

/* Renders with the variables of the JSON object `context` (borrowed; may be NULL) plus the
 * globals raise_exception, namespace, range, dict and strftime_now. Returns 0 and a malloc'd
 * NUL-terminated string in *out (caller frees), or -1 with a reason in err and *out == NULL.
 * The template is not modified, so several threads may render it at once. */
int jinja_template_render(const jinja_template *t, const json_t *context, char **out, char *err,
                          size_t errlen);

/* What apply_chat_template passes to a chat template. JSON strings are borrowed; NULL means
 * absent. tools_json is a JSON array (rendered as `tools`, none when NULL); extra_json a JSON
 * object of extra template variables such as {"enable_thinking": false}; bos/eos NULL leave
 * bos_token/eos_token undefined. */
struct jinja_chat_args {
    const char *messages_json;
    const char *tools_json;
    const char *extra_json;
    bool add_generation_prompt;
    const char *bos_token;
    const char *eos_token;
    /* tool_calls[].function.arguments given as a JSON string (as OpenAI clients send them) are
     * handed to the template as the object they spell ("" as {}), as vLLM does: for templates
     * that iterate the arguments (jinja_chat_object_arguments says which). A string that is not
     * a JSON object stays a string. */
    bool object_arguments;
};

/* Whether a chat template needs tool-call arguments as objects: given a call whose arguments are
 * a JSON string it raises, drops them or escapes them as a string (tojson), and it renders the
 * same call with an object. Probed by rendering one call both ways; once per template. */
bool jinja_chat_object_arguments(const jinja_template *t);

/* Renders a parsed chat template the way transformers' apply_chat_template(tokenize=False)
 * does: drops message keys whose value is null, copies "reasoning"/"thinking" into
 * "reasoning_content", rejects an empty conversation. Same ownership as jinja_template_render. */
int jinja_render_chat_args(const jinja_template *t, const struct jinja_chat_args *args, char **out,
                           char *err, size_t errlen);

/* Renders a chat template for `messages_json` (a JSON array of {"role","content", and optional
 * "tool_calls", "reasoning_content", ...} objects as OpenAI sends them). Returns 0 and a malloc'd
 * NUL-terminated string in *out (caller frees), or -1 with a reason in err (template syntax
 * error with line number, raise_exception message, bad messages JSON). Parses the template on
 * every call; a server should parse once and call jinja_render_chat_args. */
int jinja_render_chat(const char *template_src, const char *messages_json,
                      bool add_generation_prompt, const char *bos_token, const char *eos_token,
                      char **out, char *err, size_t errlen);

#endif
