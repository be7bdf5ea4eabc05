/* Anthropic Messages API at the edge (see anthropic.h). The translation reads each content
 * block by its type and refuses what the server cannot serve (images and documents on a
 * text-only model, server tools, redacted thinking) by name, so a request either means the
 * same thing as its chat translation or is a 400. The output side keeps one block open at a
 * time: reasoning opens a thinking block, text a text block, and each completed tool call is a
 * whole tool_use block, which is the order Anthropic's own streams have. */
#include "proto/anthropic.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/edge.h"

/* --- request ------------------------------------------------------------------------------- */

static int oom(struct proto_error *e)
{
    return proto_fail(e, 500, NULL, NULL, "out of memory");
}

/* The types of content block this text-only server cannot read (refused by name). */
static bool media_block(const char *type)
{
    static const char *const media[] = {"image",
                                        "document",
                                        "search_result",
                                        "container_upload",
                                        "server_tool_use",
                                        "web_search_tool_result",
                                        "code_execution_tool_result",
                                        "mcp_tool_use",
                                        "mcp_tool_result"};
    for (size_t i = 0; i < sizeof media / sizeof *media; i++)
        if (strcmp(type, media[i]) == 0) return true;
    return false;
}

/* A text block {"type": "text", "text", "cache_control"?, "citations"?}: its text appended to
 * buf. cache_control is a caching hint (the prefix cache is automatic); citations must be
 * empty (a model cannot be given sources here). */
static int text_block(json_t *b, const char *where, struct ms_buf *buf, struct proto_error *e)
{
    static const char *const keys[] = {"type", "text", "cache_control", "citations"};
    if (edge_keys(b, where, keys, 4, e) != 0) return -1;
    json_t *t = json_object_get(b, "text");
    if (!json_is_string(t))
        return proto_fail(e, 400, where, "invalid_type", "%s.text: must be a string", where);
    json_t *cit = json_object_get(b, "citations");
    if (cit && !json_is_null(cit) && !(json_is_array(cit) && json_array_size(cit) == 0))
        return proto_fail(e, 400, where, "unsupported_parameter",
                          "%s.citations: citations are not supported by this server", where);
    return ms_buf_add(buf, json_string_value(t), json_string_length(t)) == 0 ? 0 : oom(e);
}

/* A string, or an array of text blocks, as one text (system, tool_result content). */
static int text_of(json_t *v, const char *where, struct ms_buf *buf, struct proto_error *e)
{
    if (json_is_string(v))
        return ms_buf_add(buf, json_string_value(v), json_string_length(v)) == 0 ? 0 : oom(e);
    if (!json_is_array(v))
        return proto_fail(e, 400, where, "invalid_type",
                          "%s: must be a string or an array of text blocks", where);
    size_t i;
    json_t *b;
    json_array_foreach(v, i, b)
    {
        char w[64];
        snprintf(w, sizeof w, "%s[%zu]", where, i);
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!json_is_object(b) || !type)
            return proto_fail(e, 400, w, "invalid_type", "%s: must be a content block", w);
        if (media_block(type))
            return proto_fail(e, 400, w, "unsupported_content",
                              "%s: a '%s' block cannot be read: the model is served text-only", w,
                              type);
        if (strcmp(type, "text") != 0)
            return proto_fail(e, 400, w, "invalid_value", "%s: must be a text block, not '%s'", w,
                              type);
        if (text_block(b, w, buf, e) != 0) return -1;
    }
    return 0;
}

static json_t *msg_new(const char *role, const char *text, size_t len)
{
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string(role));
    json_t *c = json_stringn(text ? text : "", text ? len : 0);
    json_object_set_new(m, "content", c ? c : json_string(""));
    return m;
}

/* One user message's blocks: tool_result blocks become tool messages (first, as Anthropic
 * requires them to come first), the text one user message after them. ids holds the tool_use
 * ids seen so far. */
static int user_blocks(json_t *content, size_t i, json_t *ids, json_t *msgs, struct proto_error *e)
{
    struct ms_buf text = {0};
    bool any_text = false;
    size_t j;
    json_t *b;
    json_array_foreach(content, j, b)
    {
        char w[64];
        snprintf(w, sizeof w, "messages[%zu].content[%zu]", i, j);
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!json_is_object(b) || !type) {
            ms_buf_free(&text);
            return proto_fail(e, 400, w, "invalid_type", "%s: must be a content block", w);
        }
        if (strcmp(type, "text") == 0) {
            if (text_block(b, w, &text, e) != 0) goto fail;
            any_text = true;
        } else if (strcmp(type, "tool_result") == 0) {
            static const char *const keys[] = {"type", "tool_use_id", "content", "is_error",
                                               "cache_control"};
            if (edge_keys(b, w, keys, 5, e) != 0) goto fail;
            json_t *id = json_object_get(b, "tool_use_id");
            if (!json_is_string(id)) {
                proto_fail(e, 400, w, "invalid_type", "%s.tool_use_id: must be a string", w);
                goto fail;
            }
            if (!json_object_get(ids, json_string_value(id))) {
                proto_fail(e, 400, w, "invalid_value",
                           "%s: tool_result for '%s', which no earlier tool_use block has", w,
                           json_string_value(id));
                goto fail;
            }
            json_t *err = json_object_get(b, "is_error");
            if (err && !json_is_null(err) && !json_is_boolean(err)) {
                proto_fail(e, 400, w, "invalid_type", "%s.is_error: must be a boolean", w);
                goto fail;
            }
            /* the templates have no error flag: a failed tool's result says so in its text */
            struct ms_buf res = {0};
            if (json_is_true(err) && ms_buf_adds(&res, "Error: ") != 0) goto fail_oom;
            json_t *c = json_object_get(b, "content");
            char wc[80];
            snprintf(wc, sizeof wc, "%s.content", w);
            if (c && !json_is_null(c) && text_of(c, wc, &res, e) != 0) {
                ms_buf_free(&res);
                goto fail;
            }
            json_t *m = msg_new("tool", res.p, res.len);
            ms_buf_free(&res);
            json_object_set(m, "tool_call_id", id);
            json_array_append_new(msgs, m);
        } else if (media_block(type)) {
            proto_fail(e, 400, w, "unsupported_content",
                       "%s: a '%s' block cannot be read: the model is served text-only", w, type);
            goto fail;
        } else {
            proto_fail(e, 400, w, "invalid_value",
                       "%s: a user message takes text and tool_result blocks, not '%s'", w, type);
            goto fail;
        }
    }
    if (any_text || json_array_size(content) == 0)
        json_array_append_new(msgs, msg_new("user", text.p, text.len));
    ms_buf_free(&text);
    return 0;
fail_oom:
    oom(e);
fail:
    ms_buf_free(&text);
    return -1;
}

/* One assistant message's blocks: text the content, thinking the reasoning_content, tool_use
 * blocks its tool_calls (their ids remembered for the tool_results that follow). */
static int assistant_blocks(json_t *content, size_t i, json_t *ids, json_t *msgs,
                            struct proto_error *e)
{
    struct ms_buf text = {0}, think = {0};
    json_t *calls = json_array();
    size_t j;
    json_t *b;
    json_array_foreach(content, j, b)
    {
        char w[64];
        snprintf(w, sizeof w, "messages[%zu].content[%zu]", i, j);
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!json_is_object(b) || !type) {
            proto_fail(e, 400, w, "invalid_type", "%s: must be a content block", w);
            goto fail;
        }
        if (strcmp(type, "text") == 0) {
            if (text_block(b, w, &text, e) != 0) goto fail;
        } else if (strcmp(type, "thinking") == 0) {
            /* the signature only proves the thinking came from Anthropic: any is taken */
            static const char *const keys[] = {"type", "thinking", "signature"};
            if (edge_keys(b, w, keys, 3, e) != 0) goto fail;
            json_t *t = json_object_get(b, "thinking");
            if (!json_is_string(t)) {
                proto_fail(e, 400, w, "invalid_type", "%s.thinking: must be a string", w);
                goto fail;
            }
            if (ms_buf_add(&think, json_string_value(t), json_string_length(t)) != 0) {
                oom(e);
                goto fail;
            }
        } else if (strcmp(type, "tool_use") == 0) {
            static const char *const keys[] = {"type",          "id",    "name", "input",
                                               "cache_control", "caller"};
            if (edge_keys(b, w, keys, 6, e) != 0) goto fail;
            /* a call the client made itself ("direct"), as the SDK echoes it back */
            json_t *caller = json_object_get(b, "caller");
            const char *ct = json_string_value(json_object_get(caller, "type"));
            if (caller && !json_is_null(caller) && (!ct || strcmp(ct, "direct") != 0)) {
                proto_fail(e, 400, w, "unsupported_value",
                           "%s.caller: only calls of type 'direct' are served here", w);
                goto fail;
            }
            json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name"),
                   *input = json_object_get(b, "input");
            if (!json_is_string(id) || !json_is_string(name) || !json_is_object(input)) {
                proto_fail(e, 400, w, "invalid_type",
                           "%s: a tool_use block needs a string id and name and an object input",
                           w);
                goto fail;
            }
            char *args = edge_dump(input);
            json_t *fn = json_object(), *call = json_object();
            json_object_set(fn, "name", name);
            json_object_set_new(fn, "arguments", args ? json_string(args) : json_string("{}"));
            free(args);
            json_object_set(call, "id", id);
            json_object_set_new(call, "type", json_string("function"));
            json_object_set_new(call, "function", fn);
            json_array_append_new(calls, call);
            json_object_set_new(ids, json_string_value(id), json_true());
        } else if (strcmp(type, "redacted_thinking") == 0 || media_block(type)) {
            proto_fail(e, 400, w, "unsupported_content",
                       "%s: a '%s' block cannot be given to this model", w, type);
            goto fail;
        } else {
            proto_fail(e, 400, w, "invalid_value",
                       "%s: an assistant message takes text, thinking and tool_use blocks, not "
                       "'%s'",
                       w, type);
            goto fail;
        }
    }
    json_t *m = msg_new("assistant", text.p, text.len);
    if (think.len > 0)
        json_object_set_new(m, "reasoning_content", json_stringn(think.p, think.len));
    if (json_array_size(calls) > 0) json_object_set(m, "tool_calls", calls);
    json_array_append_new(msgs, m);
    json_decref(calls);
    ms_buf_free(&text);
    ms_buf_free(&think);
    return 0;
fail:
    json_decref(calls);
    ms_buf_free(&text);
    ms_buf_free(&think);
    return -1;
}

static int get_messages(json_t *in, json_t *msgs, struct proto_error *e)
{
    json_t *m = json_object_get(in, "messages");
    if (!m || json_is_null(m))
        return proto_fail(e, 400, "messages", "missing_required_parameter",
                          "messages: Field required");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return proto_fail(e, 400, "messages", "invalid_value",
                          "messages: must be a non-empty array of messages");
    json_t *ids = json_object(); /* tool_use ids seen (a set) */
    size_t i;
    json_t *msg;
    json_array_foreach(m, i, msg)
    {
        char w[48];
        snprintf(w, sizeof w, "messages[%zu]", i);
        static const char *const keys[] = {"role", "content"};
        if (!json_is_object(msg)) {
            json_decref(ids);
            return proto_fail(e, 400, w, "invalid_type", "%s: must be an object", w);
        }
        if (edge_keys(msg, w, keys, 2, e) != 0) goto fail;
        const char *role = json_string_value(json_object_get(msg, "role"));
        bool user = role && strcmp(role, "user") == 0;
        if (!role || (!user && strcmp(role, "assistant") != 0)) {
            proto_fail(e, 400, w, "invalid_value", "%s.role: must be 'user' or 'assistant'", w);
            goto fail;
        }
        json_t *c = json_object_get(msg, "content");
        if (json_is_string(c)) {
            json_array_append_new(msgs, msg_new(role, json_string_value(c), json_string_length(c)));
        } else if (json_is_array(c)) {
            if ((user ? user_blocks(c, i, ids, msgs, e) : assistant_blocks(c, i, ids, msgs, e)) !=
                0)
                goto fail;
        } else {
            proto_fail(e, 400, w, "invalid_type",
                       "%s.content: must be a string or an array of content blocks", w);
            goto fail;
        }
    }
    json_decref(ids);
    /* Anthropic continues a final assistant message (prefill); the chat core cannot continue a
     * rendered turn (continue_final_message is not built), so it is refused, not answered anew */
    size_t last = json_array_size(m) - 1;
    const char *role = json_string_value(json_object_get(json_array_get(m, last), "role"));
    if (role && strcmp(role, "assistant") == 0)
        return proto_fail(e, 400, "messages", "unsupported_value",
                          "messages[%zu]: a final assistant message (a prefill to continue) is "
                          "not supported by this server",
                          last);
    return 0;
fail:
    json_decref(ids);
    return -1;
}

/* tools: [{name, description?, input_schema, type? "custom", cache_control?}] as functions. */
static int get_tools(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *tools = json_object_get(in, "tools");
    if (!tools || json_is_null(tools)) return 0;
    if (!json_is_array(tools))
        return proto_fail(e, 400, "tools", "invalid_type", "tools: must be an array");
    json_t *fns = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        char w[32];
        snprintf(w, sizeof w, "tools[%zu]", i);
        static const char *const keys[] = {"type", "name", "description", "input_schema",
                                           "cache_control"};
        if (!json_is_object(t)) {
            json_decref(fns);
            return proto_fail(e, 400, w, "invalid_type", "%s: must be an object", w);
        }
        const char *type = json_string_value(json_object_get(t, "type"));
        if (type && strcmp(type, "custom") != 0) {
            json_decref(fns);
            return proto_fail(e, 400, w, "unsupported_value",
                              "%s.type: '%s' is a server tool, which this server does not run "
                              "(client tools only: no type, or 'custom')",
                              w, type);
        }
        if (edge_keys(t, w, keys, 5, e) != 0) {
            json_decref(fns);
            return -1;
        }
        json_t *name = json_object_get(t, "name"), *schema = json_object_get(t, "input_schema"),
               *desc = json_object_get(t, "description");
        if (!json_is_string(name) || json_string_length(name) == 0 || !json_is_object(schema) ||
            (desc && !json_is_null(desc) && !json_is_string(desc))) {
            json_decref(fns);
            return proto_fail(e, 400, w, "invalid_value",
                              "%s: needs a name and an input_schema object (description: a "
                              "string)",
                              w);
        }
        json_t *fn = json_object();
        json_object_set(fn, "name", name);
        if (json_is_string(desc)) json_object_set(fn, "description", desc);
        json_object_set(fn, "parameters", schema);
        json_t *f = json_object();
        json_object_set_new(f, "type", json_string("function"));
        json_object_set_new(f, "function", fn);
        json_array_append_new(fns, f);
    }
    json_object_set_new(out, "tools", fns);
    return 0;
}

/* tool_choice: {type: auto | any | tool (name) | none, disable_parallel_tool_use?} */
static int get_tool_choice(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *tc = json_object_get(in, "tool_choice");
    if (!tc || json_is_null(tc)) return 0;
    const char *type = json_string_value(json_object_get(tc, "type"));
    if (!json_is_object(tc) || !type)
        return proto_fail(e, 400, "tool_choice", "invalid_type",
                          "tool_choice: must be an object with a type");
    static const char *const keys[] = {"type", "name", "disable_parallel_tool_use"};
    if (edge_keys(tc, "tool_choice", keys, 3, e) != 0) return -1;
    json_t *dp = json_object_get(tc, "disable_parallel_tool_use");
    if (dp && !json_is_null(dp)) {
        if (!json_is_boolean(dp))
            return proto_fail(e, 400, "tool_choice.disable_parallel_tool_use", "invalid_type",
                              "tool_choice.disable_parallel_tool_use: must be a boolean");
        json_object_set_new(out, "parallel_tool_calls", json_boolean(!json_is_true(dp)));
    }
    json_t *name = json_object_get(tc, "name");
    if (strcmp(type, "tool") == 0) {
        if (!json_is_string(name))
            return proto_fail(e, 400, "tool_choice.name", "missing_required_parameter",
                              "tool_choice.name: required when type is 'tool'");
        json_t *fn = json_object(), *o = json_object();
        json_object_set(fn, "name", name);
        json_object_set_new(o, "type", json_string("function"));
        json_object_set_new(o, "function", fn);
        json_object_set_new(out, "tool_choice", o);
        return 0;
    }
    if (name && !json_is_null(name))
        return proto_fail(e, 400, "tool_choice.name", "invalid_value",
                          "tool_choice.name: only with type 'tool'");
    const char *chat = strcmp(type, "auto") == 0   ? "auto"
                       : strcmp(type, "any") == 0  ? "required"
                       : strcmp(type, "none") == 0 ? "none"
                                                   : NULL;
    if (!chat)
        return proto_fail(e, 400, "tool_choice.type", "invalid_value",
                          "tool_choice.type: must be auto, any, tool or none");
    json_object_set_new(out, "tool_choice", json_string(chat));
    return 0;
}

/* thinking: {type: "enabled", budget_tokens} or {type: "disabled"}: the template's
 * enable_thinking (chat_template_kwargs, when given, wins on that key). */
static int get_thinking(json_t *in, json_t *out, bool count_only, struct proto_req *r,
                        struct proto_error *e)
{
    json_t *th = json_object_get(in, "thinking");
    if (!th || json_is_null(th)) return 0;
    const char *type = json_string_value(json_object_get(th, "type"));
    if (!json_is_object(th) || !type)
        return proto_fail(e, 400, "thinking", "invalid_type",
                          "thinking: must be an object with a type");
    static const char *const keys[] = {"type", "budget_tokens"};
    if (edge_keys(th, "thinking", keys, 2, e) != 0) return -1;
    bool on = strcmp(type, "enabled") == 0;
    if (!on && strcmp(type, "disabled") != 0)
        return proto_fail(e, 400, "thinking.type", "invalid_value",
                          "thinking.type: must be 'enabled' or 'disabled'");
    json_t *b = json_object_get(th, "budget_tokens");
    if (on) {
        /* below max_tokens, as Anthropic has it (the thinking counts in max_tokens); its
         * minimum of 1024 is not kept: small local models have contexts shorter than that */
        json_t *mt = json_object_get(in, "max_tokens");
        if (!json_is_integer(b) || json_integer_value(b) < 1)
            return proto_fail(e, 400, "thinking.budget_tokens", "invalid_value",
                              "thinking.budget_tokens: must be a positive integer");
        if (!count_only && json_is_integer(mt) && json_integer_value(b) >= json_integer_value(mt))
            return proto_fail(e, 400, "thinking.budget_tokens", "invalid_value",
                              "thinking.budget_tokens: must be less than max_tokens");
        r->thinking_budget = (int)json_integer_value(b);
    } else if (b && !json_is_null(b)) {
        return proto_fail(e, 400, "thinking.budget_tokens", "invalid_value",
                          "thinking.budget_tokens: only with type 'enabled'");
    }
    json_t *kw = json_object_get(out, "chat_template_kwargs");
    if (!json_is_object(kw)) {
        kw = json_object();
        json_object_set_new(out, "chat_template_kwargs", kw);
    }
    if (!json_object_get(kw, "enable_thinking"))
        json_object_set_new(kw, "enable_thinking", json_boolean(on));
    r->thinking_switch = true;
    return 0;
}

/* output_config: {format: {type: json_schema, schema}} (structured output through the grammar
 * sampler) and effort (the template's reasoning_effort; only low, medium and high). */
static int get_output_config(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *oc = json_object_get(in, "output_config");
    if (!oc || json_is_null(oc)) return 0;
    if (!json_is_object(oc))
        return proto_fail(e, 400, "output_config", "invalid_type",
                          "output_config: must be an object");
    static const char *const keys[] = {"format", "effort"};
    if (edge_keys(oc, "output_config", keys, 2, e) != 0) return -1;
    json_t *eff = json_object_get(oc, "effort");
    if (eff && !json_is_null(eff)) {
        const char *v = json_string_value(eff);
        if (!v || (strcmp(v, "low") != 0 && strcmp(v, "medium") != 0 && strcmp(v, "high") != 0))
            return proto_fail(e, 400, "output_config.effort", "invalid_value",
                              "output_config.effort: must be low, medium or high here");
        json_object_set(out, "reasoning_effort", eff);
    }
    json_t *f = json_object_get(oc, "format");
    if (!f || json_is_null(f)) return 0;
    static const char *const fkeys[] = {"type", "schema"};
    const char *type = json_string_value(json_object_get(f, "type"));
    if (!json_is_object(f) || !type || strcmp(type, "json_schema") != 0 ||
        !json_is_object(json_object_get(f, "schema")))
        return proto_fail(e, 400, "output_config.format", "invalid_value",
                          "output_config.format: must be {\"type\": \"json_schema\", \"schema\": "
                          "{...}}");
    if (edge_keys(f, "output_config.format", fkeys, 2, e) != 0) return -1;
    json_t *js = json_object(), *rf = json_object();
    json_object_set_new(js, "name", json_string("output"));
    json_object_set(js, "schema", json_object_get(f, "schema"));
    json_object_set_new(rf, "type", json_string("json_schema"));
    json_object_set_new(rf, "json_schema", js);
    json_object_set_new(out, "response_format", rf);
    return 0;
}

int anth_to_chat(json_t *in, bool count_only, struct proto_req *r, json_t **out,
                 struct proto_error *e)
{
    *out = NULL;
    json_t *c = json_object(), *msgs = json_array();
    if (!c || !msgs) {
        json_decref(c);
        json_decref(msgs);
        return oom(e);
    }
    json_object_set_new(c, "messages", msgs);
    json_t *sys = json_object_get(in, "system");
    if (sys && !json_is_null(sys)) {
        struct ms_buf t = {0};
        if (text_of(sys, "system", &t, e) != 0) {
            ms_buf_free(&t);
            goto fail;
        }
        json_array_append_new(msgs, msg_new("system", t.p, t.len));
        ms_buf_free(&t);
    }
    if (get_messages(in, msgs, e) != 0) goto fail;
    edge_copy_shared(c, in); /* the extras and the fields of the same meaning */
    json_t *kw = json_object_get(c, "chat_template_kwargs");
    if (kw) { /* get_thinking may add to it: a copy of the client's object */
        json_t *cp = json_deep_copy(kw);
        json_object_set_new(c, "chat_template_kwargs", cp);
    }
    if (!count_only) {
        json_t *mt = json_object_get(in, "max_tokens");
        if (!mt || json_is_null(mt)) {
            proto_fail(e, 400, "max_tokens", "missing_required_parameter",
                       "max_tokens: Field required");
            goto fail;
        }
        json_object_set(c, "max_tokens", mt);
        json_t *ss = json_object_get(in, "stop_sequences");
        if (ss && !json_is_null(ss)) {
            if (!json_is_array(ss)) {
                proto_fail(e, 400, "stop_sequences", "invalid_type",
                           "stop_sequences: must be an array of strings");
                goto fail;
            }
            if (json_array_size(ss) > 0) json_object_set(c, "stop", ss);
        }
    }
    if (get_tools(in, c, e) != 0 || get_tool_choice(in, c, e) != 0 ||
        get_thinking(in, c, count_only, r, e) != 0 || get_output_config(in, c, e) != 0)
        goto fail;
    if (count_only) json_object_del(c, "response_format"); /* the prompt is all that counts */
    *out = c;
    return 0;
fail:
    json_decref(c);
    return -1;
}

/* --- errors ------------------------------------------------------------------------------- */

int anth_status(int status)
{
    return status == 503 ? 529 : status;
}

static const char *error_type(int status)
{
    switch (status) {
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 413:
        return "request_too_large";
    case 429:
        return "rate_limit_error";
    case 503:
    case 529:
        return "overloaded_error";
    default:
        return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

static json_t *error_obj(const struct proto_error *e)
{
    char msg[sizeof e->param + sizeof e->message + 4];
    /* Anthropic's errors name the field at the start of the message ("max_tokens: Field
     * required"); ours already do unless the message is the chat core's */
    size_t pl = strlen(e->param);
    bool named = pl > 0 && strncmp(e->message, e->param, pl) == 0;
    snprintf(msg, sizeof msg, "%s%s%s", pl && !named ? e->param : "", pl && !named ? ": " : "",
             e->message);
    json_t *in = json_object();
    json_t *m = json_string(msg);
    json_object_set_new(in, "type", json_string(error_type(e->status)));
    json_object_set_new(in, "message", m ? m : json_string("invalid request"));
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string("error"));
    json_object_set_new(o, "error", in);
    return o;
}

char *anth_error(const struct proto_error *e)
{
    json_t *o = error_obj(e);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

char *anth_error_sse(const struct proto_error *e)
{
    struct ms_buf b = {0};
    if (edge_emit(&b, "error", error_obj(e)) != 0) {
        ms_buf_free(&b);
        return NULL;
    }
    return ms_buf_take(&b);
}

char *anth_count_body(int input_tokens)
{
    json_t *o = json_object();
    json_object_set_new(o, "input_tokens", json_integer(input_tokens));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* --- output ------------------------------------------------------------------------------- */

/* Anthropic counts input_tokens apart from the cache: the three add up to the prompt. */
static json_t *usage_obj(const struct proto_usage *u, bool with_output)
{
    int cached = u && u->cached_tokens > 0 ? u->cached_tokens : 0;
    json_t *o = json_object();
    json_object_set_new(o, "input_tokens", json_integer(u ? u->prompt_tokens - cached : 0));
    json_object_set_new(o, "cache_creation_input_tokens", json_integer(0));
    json_object_set_new(o, "cache_read_input_tokens", json_integer(cached));
    json_object_set_new(o, "output_tokens",
                        json_integer(with_output && u ? u->completion_tokens : 0));
    return o;
}

void anth_stream_init(struct anth_stream *s, const char *id, const char *model, const char *call_id)
{
    memset(s, 0, sizeof *s);
    s->id = id;
    s->model = model;
    s->call_id = call_id;
    s->content = json_array();
}

static json_t *message_obj(const struct anth_stream *s, json_t *content, const char *stop_reason,
                           const char *stop_sequence, const struct proto_usage *u, bool final)
{
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(s->id));
    json_object_set_new(m, "type", json_string("message"));
    json_object_set_new(m, "role", json_string("assistant"));
    json_object_set_new(m, "model", json_string(s->model));
    json_object_set_new(m, "content", content);
    json_object_set_new(m, "stop_reason", stop_reason ? json_string(stop_reason) : json_null());
    json_object_set_new(m, "stop_sequence",
                        stop_sequence ? json_string(stop_sequence) : json_null());
    json_object_set_new(m, "usage", usage_obj(u, final));
    return m;
}

int anth_stream_start(struct anth_stream *s, struct ms_buf *out, const struct proto_usage *u)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("message_start"));
    json_object_set_new(ev, "message", message_obj(s, json_array(), NULL, NULL, u, false));
    if (edge_emit(out, "message_start", ev) != 0) return -1;
    json_t *ping = json_object();
    json_object_set_new(ping, "type", json_string("ping"));
    return edge_emit(out, "ping", ping);
}

static int block_start(struct anth_stream *s, struct ms_buf *out, json_t *block)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("content_block_start"));
    json_object_set_new(ev, "index", json_integer(s->n_blocks));
    json_object_set_new(ev, "content_block", block);
    return edge_emit(out, "content_block_start", ev);
}

static int block_delta(struct anth_stream *s, struct ms_buf *out, json_t *delta)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("content_block_delta"));
    json_object_set_new(ev, "index", json_integer(s->n_blocks));
    json_object_set_new(ev, "delta", delta);
    return edge_emit(out, "content_block_delta", ev);
}

static int block_stop(struct anth_stream *s, struct ms_buf *out)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("content_block_stop"));
    json_object_set_new(ev, "index", json_integer(s->n_blocks));
    int rc = edge_emit(out, "content_block_stop", ev);
    s->n_blocks++;
    return rc;
}

/* Closes the open thinking or text block: its whole text joins the message's content. */
static int close_open(struct anth_stream *s, struct ms_buf *out)
{
    if (!s->open) return 0;
    json_t *b = json_object();
    json_t *t = json_stringn(s->cur.p ? s->cur.p : "", s->cur.len);
    if (s->open == 1) {
        json_object_set_new(b, "type", json_string("thinking"));
        json_object_set_new(b, "thinking", t ? t : json_string(""));
        json_object_set_new(b, "signature", json_string(""));
    } else {
        json_object_set_new(b, "type", json_string("text"));
        json_object_set_new(b, "text", t ? t : json_string(""));
    }
    json_array_append_new(s->content, b);
    s->open = 0;
    s->cur.len = 0;
    return block_stop(s, out);
}

/* Text for a thinking (kind 1) or text (kind 2) block: opens one unless it is open. */
static int add_text(struct anth_stream *s, struct ms_buf *out, int kind, const char *p, size_t n)
{
    if (n == 0) return 0;
    if (s->open != kind) {
        if (close_open(s, out) != 0) return -1;
        json_t *b = json_object();
        json_object_set_new(b, "type", json_string(kind == 1 ? "thinking" : "text"));
        json_object_set_new(b, kind == 1 ? "thinking" : "text", json_string(""));
        if (kind == 1) json_object_set_new(b, "signature", json_string(""));
        if (block_start(s, out, b) != 0) return -1;
        s->open = kind;
    }
    if (ms_buf_add(&s->cur, p, n) != 0) return -1;
    json_t *t = json_stringn(p, n);
    if (!t) t = json_string("\xef\xbf\xbd"); /* not UTF-8: cannot happen from the decoder */
    json_t *d = json_object();
    json_object_set_new(d, "type", json_string(kind == 1 ? "thinking_delta" : "text_delta"));
    json_object_set_new(d, kind == 1 ? "thinking" : "text", t);
    return block_delta(s, out, d);
}

static int add_call(struct anth_stream *s, struct ms_buf *out, const struct tc_call *c)
{
    if (close_open(s, out) != 0) return -1;
    char id[112];
    snprintf(id, sizeof id, "%s_%d", s->call_id, s->n_calls++);
    json_t *input = json_loads(c->arguments, 0, NULL);
    if (!json_is_object(input)) { /* the parsers give objects; keep the text if not */
        json_decref(input);
        input = json_object();
        json_object_set_new(input, "arguments", json_string(c->arguments));
    }
    json_t *b = json_object();
    json_object_set_new(b, "type", json_string("tool_use"));
    json_object_set_new(b, "id", json_string(id));
    json_object_set_new(b, "name", json_string(c->name));
    json_object_set_new(b, "input", json_object());
    if (block_start(s, out, b) != 0) {
        json_decref(input);
        return -1;
    }
    char *args = edge_dump(input);
    json_t *d = json_object();
    json_object_set_new(d, "type", json_string("input_json_delta"));
    json_object_set_new(d, "partial_json", json_string(args ? args : "{}"));
    free(args);
    if (block_delta(s, out, d) != 0) {
        json_decref(input);
        return -1;
    }
    json_t *whole = json_object();
    json_object_set_new(whole, "type", json_string("tool_use"));
    json_object_set_new(whole, "id", json_string(id));
    json_object_set_new(whole, "name", json_string(c->name));
    json_object_set_new(whole, "input", input);
    json_array_append_new(s->content, whole);
    return block_stop(s, out);
}

int anth_stream_feed(struct anth_stream *s, struct ms_buf *out, const char *reasoning,
                     size_t reasoning_len, const char *text, size_t text_len,
                     const struct tc_call *calls, int n_calls)
{
    if (add_text(s, out, 1, reasoning, reasoning_len) != 0 ||
        add_text(s, out, 2, text, text_len) != 0)
        return -1;
    for (int i = 0; i < n_calls; i++)
        if (add_call(s, out, &calls[i]) != 0) return -1;
    return 0;
}

int anth_stream_end(struct anth_stream *s, struct ms_buf *out, const char *stop_reason,
                    const char *stop_sequence, const struct proto_usage *u)
{
    if (close_open(s, out) != 0) return -1;
    json_t *d = json_object();
    json_object_set_new(d, "stop_reason", json_string(stop_reason));
    json_object_set_new(d, "stop_sequence",
                        stop_sequence ? json_string(stop_sequence) : json_null());
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("message_delta"));
    json_object_set_new(ev, "delta", d);
    json_object_set_new(ev, "usage", usage_obj(u, true));
    if (edge_emit(out, "message_delta", ev) != 0) return -1;
    json_t *stop = json_object();
    json_object_set_new(stop, "type", json_string("message_stop"));
    return edge_emit(out, "message_stop", stop);
}

char *anth_stream_message(struct anth_stream *s, const char *stop_reason, const char *stop_sequence,
                          const struct proto_usage *u)
{
    json_t *m = message_obj(s, json_incref(s->content), stop_reason, stop_sequence, u, true);
    char *body = json_dumps(m, JSON_COMPACT);
    json_decref(m);
    return body;
}

void anth_stream_free(struct anth_stream *s)
{
    json_decref(s->content);
    ms_buf_free(&s->cur);
    memset(s, 0, sizeof *s);
}
