/* OpenAI Responses API at the edge (see responses.h). Input items become chat messages in
 * order: consecutive function_call items (and the assistant message before them) make one
 * assistant turn with tool_calls, a reasoning item's text becomes the next assistant turn's
 * reasoning_content, function_call_output a tool message whose call_id must name a call seen
 * before (in this input or the stored conversation). The output side keeps one item open at a
 * time, as OpenAI's streams do: reasoning, then message text, then a function_call item per
 * completed call. */
#include "proto/responses.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/edge.h"

static int oom(struct proto_error *e)
{
    return proto_fail(e, 500, NULL, NULL, "out of memory");
}

static json_t *msg_new(const char *role, const char *text, size_t len)
{
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string(role));
    json_t *c = json_stringn(text ? text : "", text ? len : 0);
    json_object_set_new(m, "content", c ? c : json_string(""));
    return m;
}

/* The text of a message's content: a string or parts (input_text, output_text, refusal). */
static int content_text(json_t *c, const char *where, struct ms_buf *buf, struct proto_error *e)
{
    if (json_is_string(c))
        return ms_buf_add(buf, json_string_value(c), json_string_length(c)) == 0 ? 0 : oom(e);
    if (!json_is_array(c))
        return proto_fail(e, 400, where, "invalid_type",
                          "'%s' must be a string or an array of content parts", where);
    size_t j;
    json_t *p;
    json_array_foreach(c, j, p)
    {
        char w[80];
        snprintf(w, sizeof w, "%s[%zu]", where, j);
        const char *type = json_string_value(json_object_get(p, "type"));
        if (!json_is_object(p) || !type)
            return proto_fail(e, 400, w, "invalid_type", "'%s' must be a content part", w);
        if (strcmp(type, "input_text") == 0 || strcmp(type, "output_text") == 0) {
            /* annotations and logprobs of an earlier output: what the model said is the text */
            static const char *const keys[] = {"type", "text", "annotations", "logprobs"};
            if (edge_keys(p, w, keys, 4, e) != 0) return -1;
            json_t *t = json_object_get(p, "text");
            if (!json_is_string(t))
                return proto_fail(e, 400, w, "invalid_type", "'%s.text' must be a string", w);
            if (ms_buf_add(buf, json_string_value(t), json_string_length(t)) != 0) return oom(e);
        } else if (strcmp(type, "refusal") == 0) {
            static const char *const keys[] = {"type", "refusal"};
            if (edge_keys(p, w, keys, 2, e) != 0) return -1;
            json_t *t = json_object_get(p, "refusal");
            if (!json_is_string(t))
                return proto_fail(e, 400, w, "invalid_type", "'%s.refusal' must be a string", w);
            if (ms_buf_add(buf, json_string_value(t), json_string_length(t)) != 0) return oom(e);
        } else if (strncmp(type, "input_", 6) == 0) {
            return proto_fail(e, 400, w, "unsupported_content",
                              "'%s' is an '%s' part: the model is served text-only (only "
                              "input_text and output_text parts are accepted)",
                              w, type);
        } else {
            return proto_fail(e, 400, w, "invalid_value", "'%s': unknown content part type '%s'", w,
                              type);
        }
    }
    return 0;
}

/* The translation's state: the chat messages so far and what the next assistant turn needs. */
struct conv {
    json_t *msgs;            /* chat messages (owned) */
    json_t *ids;             /* call ids seen (a set) */
    struct ms_buf reasoning; /* a reasoning item's text waiting for its assistant turn */
    bool have_reasoning;
    bool merge; /* the last message is an assistant turn function calls may join */
};

/* The assistant message function calls join: the last one when it may take them, else new. */
static json_t *assistant_turn(struct conv *cv)
{
    json_t *last = json_array_get(cv->msgs, json_array_size(cv->msgs) - 1);
    if (!cv->merge || !last) {
        last = msg_new("assistant", "", 0);
        json_array_append_new(cv->msgs, last);
        cv->merge = true;
    }
    if (cv->have_reasoning) {
        json_object_set_new(
            last, "reasoning_content",
            json_stringn(cv->reasoning.p ? cv->reasoning.p : "", cv->reasoning.len));
        cv->reasoning.len = 0;
        cv->have_reasoning = false;
    }
    return last;
}

static int item_message(struct conv *cv, json_t *it, const char *w, struct proto_error *e)
{
    static const char *const keys[] = {"type", "role", "content", "id", "status"};
    if (edge_keys(it, w, keys, 5, e) != 0) return -1;
    const char *role = json_string_value(json_object_get(it, "role"));
    static const char *const roles[] = {"user", "assistant", "system", "developer"};
    bool ok = false;
    for (size_t k = 0; role && k < 4; k++)
        ok |= strcmp(role, roles[k]) == 0;
    if (!ok)
        return proto_fail(e, 400, w, "invalid_value",
                          "'%s.role' must be user, assistant, system or developer", w);
    char wc[80];
    snprintf(wc, sizeof wc, "%s.content", w);
    struct ms_buf t = {0};
    if (content_text(json_object_get(it, "content"), wc, &t, e) != 0) {
        ms_buf_free(&t);
        return -1;
    }
    bool assistant = strcmp(role, "assistant") == 0;
    if (assistant) {
        /* a new turn, which takes a reasoning item before it; calls after it join it */
        cv->merge = false;
        json_t *m = assistant_turn(cv);
        json_t *c = json_stringn(t.p ? t.p : "", t.len);
        json_object_set_new(m, "content", c ? c : json_string(""));
    } else {
        /* developer instructions are the system turn to chat templates */
        json_array_append_new(cv->msgs,
                              msg_new(strcmp(role, "user") == 0 ? "user" : "system", t.p, t.len));
        cv->merge = false;
    }
    ms_buf_free(&t);
    return 0;
}

static int item_call(struct conv *cv, json_t *it, const char *w, struct proto_error *e)
{
    static const char *const keys[] = {"type", "call_id", "name", "arguments", "id", "status"};
    if (edge_keys(it, w, keys, 6, e) != 0) return -1;
    json_t *id = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
           *args = json_object_get(it, "arguments");
    if (!json_is_string(id) || !json_is_string(name) || !json_is_string(args))
        return proto_fail(e, 400, w, "invalid_type",
                          "'%s': a function_call needs string call_id, name and arguments", w);
    json_t *m = assistant_turn(cv);
    json_t *calls = json_object_get(m, "tool_calls");
    if (!json_is_array(calls)) {
        calls = json_array();
        json_object_set_new(m, "tool_calls", calls);
    }
    json_t *fn = json_object(), *c = json_object();
    json_object_set(fn, "name", name);
    json_object_set(fn, "arguments", args);
    json_object_set(c, "id", id);
    json_object_set_new(c, "type", json_string("function"));
    json_object_set_new(c, "function", fn);
    json_array_append_new(calls, c);
    json_object_set_new(cv->ids, json_string_value(id), json_true());
    return 0;
}

static int item_output(struct conv *cv, json_t *it, const char *w, struct proto_error *e)
{
    static const char *const keys[] = {"type", "call_id", "output", "id", "status"};
    if (edge_keys(it, w, keys, 5, e) != 0) return -1;
    json_t *id = json_object_get(it, "call_id");
    if (!json_is_string(id))
        return proto_fail(e, 400, w, "invalid_type", "'%s.call_id' must be a string", w);
    if (!json_object_get(cv->ids, json_string_value(id)))
        return proto_fail(e, 400, w, "invalid_value",
                          "'%s': function_call_output for '%s', which no earlier function_call "
                          "has",
                          w, json_string_value(id));
    char wo[80];
    snprintf(wo, sizeof wo, "%s.output", w);
    struct ms_buf t = {0};
    if (content_text(json_object_get(it, "output"), wo, &t, e) != 0) {
        ms_buf_free(&t);
        return -1;
    }
    json_t *m = msg_new("tool", t.p, t.len);
    ms_buf_free(&t);
    json_object_set(m, "tool_call_id", id);
    json_array_append_new(cv->msgs, m);
    cv->merge = false;
    return 0;
}

/* A reasoning item: its reasoning_text content (else its summary) goes with the next assistant
 * turn. Encrypted reasoning only OpenAI's servers can read. */
static int item_reasoning(struct conv *cv, json_t *it, const char *w, struct proto_error *e)
{
    static const char *const keys[] = {"type",  "id", "summary", "content", "encrypted_content",
                                       "status"};
    if (edge_keys(it, w, keys, 6, e) != 0) return -1;
    json_t *enc = json_object_get(it, "encrypted_content");
    if (enc && !json_is_null(enc))
        return proto_fail(e, 400, w, "unsupported_content",
                          "'%s.encrypted_content': encrypted reasoning cannot be read here", w);
    json_t *parts = json_object_get(it, "content");
    const char *want = "reasoning_text";
    if (!json_is_array(parts) || json_array_size(parts) == 0) {
        parts = json_object_get(it, "summary");
        want = "summary_text";
    }
    if (parts && !json_is_null(parts) && !json_is_array(parts))
        return proto_fail(e, 400, w, "invalid_type", "'%s.summary' must be an array", w);
    size_t j;
    json_t *p;
    json_array_foreach(parts, j, p)
    {
        json_t *t = json_object_get(p, "text");
        const char *type = json_string_value(json_object_get(p, "type"));
        if (!json_is_string(t) || !type || strcmp(type, want) != 0)
            return proto_fail(e, 400, w, "invalid_value",
                              "'%s': reasoning parts must be {\"type\": \"%s\", \"text\": ...}", w,
                              want);
        if (ms_buf_add(&cv->reasoning, json_string_value(t), json_string_length(t)) != 0)
            return oom(e);
    }
    cv->have_reasoning = true;
    cv->merge = false;
    return 0;
}

static int get_input(json_t *in, struct conv *cv, struct proto_error *e)
{
    json_t *inp = json_object_get(in, "input");
    if (!inp || json_is_null(inp))
        return proto_fail(e, 400, "input", "missing_required_parameter", "'input' is required");
    if (json_is_string(inp)) {
        json_array_append_new(cv->msgs,
                              msg_new("user", json_string_value(inp), json_string_length(inp)));
        return 0;
    }
    if (!json_is_array(inp) || json_array_size(inp) == 0)
        return proto_fail(e, 400, "input", "invalid_type",
                          "'input' must be a string or a non-empty array of items");
    size_t i;
    json_t *it;
    json_array_foreach(inp, i, it)
    {
        char w[48];
        snprintf(w, sizeof w, "input[%zu]", i);
        if (!json_is_object(it))
            return proto_fail(e, 400, w, "invalid_type", "'%s' must be an object", w);
        const char *type = json_string_value(json_object_get(it, "type"));
        int rc;
        if (!type || strcmp(type, "message") == 0)
            rc = item_message(cv, it, w, e);
        else if (strcmp(type, "function_call") == 0)
            rc = item_call(cv, it, w, e);
        else if (strcmp(type, "function_call_output") == 0)
            rc = item_output(cv, it, w, e);
        else if (strcmp(type, "reasoning") == 0)
            rc = item_reasoning(cv, it, w, e);
        else
            rc = proto_fail(e, 400, w, "unsupported_value",
                            "'%s.type': '%s' items are not supported by this server (message, "
                            "function_call, function_call_output and reasoning are)",
                            w, type);
        if (rc != 0) return -1;
    }
    if (cv->have_reasoning) assistant_turn(cv); /* reasoning with nothing after it */
    return 0;
}

/* tools: [{type: "function", name, description?, parameters?, strict?}] as chat functions. */
static int get_tools(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *tools = json_object_get(in, "tools");
    if (!tools || json_is_null(tools)) return 0;
    if (!json_is_array(tools))
        return proto_fail(e, 400, "tools", "invalid_type", "'tools' must be an array");
    json_t *fns = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        char w[32];
        snprintf(w, sizeof w, "tools[%zu]", i);
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !type) {
            json_decref(fns);
            return proto_fail(e, 400, w, "invalid_type", "'%s' must be an object with a type", w);
        }
        if (strcmp(type, "function") != 0) {
            json_decref(fns);
            return proto_fail(e, 400, w, "unsupported_value",
                              "'%s.type': '%s' tools are not supported (function tools are)", w,
                              type);
        }
        /* strict: the grammar sampler always holds forced calls to the schema */
        static const char *const keys[] = {"type", "name", "description", "parameters", "strict"};
        if (edge_keys(t, w, keys, 5, e) != 0) {
            json_decref(fns);
            return -1;
        }
        json_t *name = json_object_get(t, "name"), *strict = json_object_get(t, "strict");
        if (strict && !json_is_null(strict) && !json_is_boolean(strict)) {
            json_decref(fns);
            return proto_fail(e, 400, w, "invalid_type", "'%s.strict' must be a boolean", w);
        }
        if (!json_is_string(name)) {
            json_decref(fns);
            return proto_fail(e, 400, w, "invalid_value", "'%s.name' must be a string", w);
        }
        json_t *fn = json_object();
        json_object_set(fn, "name", name);
        edge_copy(fn, t, "description");
        edge_copy(fn, t, "parameters");
        json_t *f = json_object();
        json_object_set_new(f, "type", json_string("function"));
        json_object_set_new(f, "function", fn);
        json_array_append_new(fns, f);
    }
    json_object_set_new(out, "tools", fns);
    return 0;
}

/* tool_choice: none | auto | required | {type: "function", name} */
static int get_tool_choice(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *tc = json_object_get(in, "tool_choice");
    if (!tc || json_is_null(tc)) return 0;
    if (json_is_string(tc)) {
        json_object_set(out, "tool_choice", tc); /* checked by the chat core */
        return 0;
    }
    const char *type = json_string_value(json_object_get(tc, "type"));
    json_t *name = json_object_get(tc, "name");
    if (!json_is_object(tc) || !type || strcmp(type, "function") != 0 || !json_is_string(name) ||
        json_object_size(tc) != 2)
        return proto_fail(e, 400, "tool_choice", "invalid_value",
                          "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                          "\"name\": ...}");
    json_t *fn = json_object(), *o = json_object();
    json_object_set(fn, "name", name);
    json_object_set_new(o, "type", json_string("function"));
    json_object_set_new(o, "function", fn);
    json_object_set_new(out, "tool_choice", o);
    return 0;
}

/* text: {format: {type: text | json_object | json_schema (name, schema, strict,
 * description)}}; verbosity is refused (it is not a sampling parameter here). */
static int get_text(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *t = json_object_get(in, "text");
    if (!t || json_is_null(t)) return 0;
    if (!json_is_object(t))
        return proto_fail(e, 400, "text", "invalid_type", "'text' must be an object");
    static const char *const keys[] = {"format", "verbosity"};
    if (edge_keys(t, "text", keys, 2, e) != 0) return -1;
    json_t *verb = json_object_get(t, "verbosity");
    if (verb && !json_is_null(verb))
        return proto_fail(e, 400, "text.verbosity", "unsupported_parameter",
                          "'text.verbosity' is not supported by this server");
    json_t *f = json_object_get(t, "format");
    if (!f || json_is_null(f)) return 0;
    const char *type = json_string_value(json_object_get(f, "type"));
    if (!json_is_object(f) || !type)
        return proto_fail(e, 400, "text.format", "invalid_type",
                          "'text.format' must be an object with a type");
    json_t *rf = json_object();
    json_object_set_new(rf, "type", json_string(type));
    if (strcmp(type, "json_schema") == 0) {
        static const char *const fk[] = {"type", "name", "schema", "strict", "description"};
        if (edge_keys(f, "text.format", fk, 5, e) != 0) {
            json_decref(rf);
            return -1;
        }
        json_t *js = json_object();
        edge_copy(js, f, "name");
        edge_copy(js, f, "schema");
        edge_copy(js, f, "strict");
        edge_copy(js, f, "description");
        json_object_set_new(rf, "json_schema", js);
    } else if (json_object_size(f) != 1) {
        json_decref(rf);
        return proto_fail(e, 400, "text.format", "unknown_parameter",
                          "'text.format' of type '%s' takes no other key", type);
    }
    json_object_set_new(out, "response_format", rf);
    return 0;
}

/* reasoning: {effort: low | medium | high}; a summary cannot be made here, so summary and
 * generate_summary are refused unless null. */
static int get_reasoning(json_t *in, json_t *out, struct proto_error *e)
{
    json_t *rs = json_object_get(in, "reasoning");
    if (!rs || json_is_null(rs)) return 0;
    if (!json_is_object(rs))
        return proto_fail(e, 400, "reasoning", "invalid_type", "'reasoning' must be an object");
    static const char *const keys[] = {"effort", "summary", "generate_summary"};
    if (edge_keys(rs, "reasoning", keys, 3, e) != 0) return -1;
    const char *refuse = NULL;
    if (json_object_get(rs, "summary") && !json_is_null(json_object_get(rs, "summary")))
        refuse = "summary";
    if (json_object_get(rs, "generate_summary") &&
        !json_is_null(json_object_get(rs, "generate_summary")))
        refuse = "generate_summary";
    if (refuse) {
        char p[40];
        snprintf(p, sizeof p, "reasoning.%s", refuse);
        return proto_fail(e, 400, p, "unsupported_parameter",
                          "'reasoning.%s': reasoning summaries are not made by this server (the "
                          "reasoning text itself is returned)",
                          refuse);
    }
    edge_copy(out, rs, "effort");
    json_t *eff = json_object_get(out, "effort");
    if (eff) {
        json_object_set(out, "reasoning_effort", eff);
        json_object_del(out, "effort");
    }
    return 0;
}

/* The settings a response object repeats back (OpenAI returns the request's). */
static json_t *echo_obj(json_t *in, bool store)
{
    json_t *o = json_object();
    static const char *const same[] = {
        "instructions", "max_output_tokens",   "temperature",          "top_p",    "tools",
        "tool_choice",  "parallel_tool_calls", "previous_response_id", "metadata", "user"};
    for (size_t i = 0; i < sizeof same / sizeof *same; i++) {
        json_t *v = json_object_get(in, same[i]);
        json_object_set(o, same[i], v ? v : json_null());
    }
    if (json_is_null(json_object_get(o, "temperature")))
        json_object_set_new(o, "temperature", json_real(1.0));
    if (json_is_null(json_object_get(o, "top_p"))) json_object_set_new(o, "top_p", json_real(1.0));
    if (json_is_null(json_object_get(o, "tools"))) json_object_set_new(o, "tools", json_array());
    if (json_is_null(json_object_get(o, "tool_choice")))
        json_object_set_new(o, "tool_choice", json_string("auto"));
    if (json_is_null(json_object_get(o, "parallel_tool_calls")))
        json_object_set_new(o, "parallel_tool_calls", json_true());
    if (json_is_null(json_object_get(o, "metadata")))
        json_object_set_new(o, "metadata", json_object());
    json_t *text = json_object_get(in, "text");
    json_t *fmt = json_object_get(text, "format");
    json_t *t = json_object();
    if (fmt && !json_is_null(fmt))
        json_object_set(t, "format", fmt);
    else {
        json_t *f = json_object();
        json_object_set_new(f, "type", json_string("text"));
        json_object_set_new(t, "format", f);
    }
    json_object_set_new(o, "text", t);
    json_t *r = json_object();
    json_t *eff = json_object_get(json_object_get(in, "reasoning"), "effort");
    json_object_set(r, "effort", eff ? eff : json_null());
    json_object_set_new(r, "summary", json_null());
    json_object_set_new(o, "reasoning", r);
    json_object_set_new(o, "store", json_boolean(store));
    json_object_set_new(o, "truncation", json_string("disabled"));
    json_object_set_new(o, "background", json_false());
    json_object_set_new(o, "service_tier", json_string("default"));
    return o;
}

int rsp_to_chat(json_t *in, proto_conv_lookup lookup, void *lookup_ctx, struct proto_req *r,
                json_t **out, struct proto_error *e)
{
    *out = NULL;
    struct conv cv = {.msgs = json_array(), .ids = json_object()};
    json_t *c = json_object(), *msgs = json_array();
    int rc = -1;
    json_t *prev = json_object_get(in, "previous_response_id");
    json_t *st = json_object_get(in, "store");
    json_t *ins = json_object_get(in, "instructions");
    r->store = true;
    if (st && !json_is_null(st)) {
        if (!json_is_boolean(st)) {
            proto_fail(e, 400, "store", "invalid_type", "'store' must be a boolean");
            goto out;
        }
        r->store = json_is_true(st);
    }
    if (ins && !json_is_null(ins) && !json_is_string(ins)) {
        proto_fail(e, 400, "instructions", "invalid_type", "'instructions' must be a string");
        goto out;
    }
    json_t *md = json_object_get(in, "metadata");
    if (md && !json_is_null(md)) {
        bool ok = json_is_object(md) && json_object_size(md) <= 16;
        const char *k;
        json_t *v;
        json_object_foreach(md, k, v) ok =
            ok && json_is_string(v) && strlen(k) <= 64 && json_string_length(v) <= 512;
        if (!ok) {
            proto_fail(e, 400, "metadata", "invalid_value",
                       "'metadata' must be an object of at most 16 string values (keys up to 64 "
                       "characters, values up to 512)");
            goto out;
        }
    }
    if (prev && !json_is_null(prev)) {
        if (!json_is_string(prev) || json_string_length(prev) == 0) {
            proto_fail(e, 400, "previous_response_id", "invalid_type",
                       "'previous_response_id' must be a response id");
            goto out;
        }
        char *conv = lookup ? lookup(lookup_ctx, json_string_value(prev)) : NULL;
        json_t *stored = conv ? json_loads(conv, 0, NULL) : NULL;
        free(conv);
        if (!json_is_array(stored)) {
            json_decref(stored);
            proto_fail(e, 404, "previous_response_id", "not_found",
                       "Previous response with id '%s' not found.", json_string_value(prev));
            goto out;
        }
        /* the calls of the stored turns answer function_call_outputs of this input */
        size_t i;
        json_t *m;
        json_array_foreach(stored, i, m)
        {
            size_t k;
            json_t *tc;
            json_array_foreach(json_object_get(m, "tool_calls"), k, tc)
            {
                const char *id = json_string_value(json_object_get(tc, "id"));
                if (id) json_object_set_new(cv.ids, id, json_true());
            }
        }
        json_array_extend(cv.msgs, stored);
        json_decref(stored);
        if (!(r->previous_response_id = strdup(json_string_value(prev)))) {
            oom(e);
            goto out;
        }
    }
    if (get_input(in, &cv, e) != 0) goto out;
    if (!(r->conv_json = edge_dump(cv.msgs))) {
        oom(e);
        goto out;
    }
    /* instructions lead this request only: a later previous_response_id does not carry them */
    if (json_is_string(ins))
        json_array_append_new(msgs,
                              msg_new("system", json_string_value(ins), json_string_length(ins)));
    json_array_extend(msgs, cv.msgs);
    json_object_set(c, "messages", msgs);
    edge_copy_shared(c, in);
    edge_copy(c, in, "parallel_tool_calls");
    edge_copy(c, in, "max_output_tokens");
    json_t *mo = json_object_get(c, "max_output_tokens");
    if (mo) {
        json_object_set(c, "max_tokens", mo);
        json_object_del(c, "max_output_tokens");
    }
    if (get_tools(in, c, e) != 0 || get_tool_choice(in, c, e) != 0 || get_text(in, c, e) != 0 ||
        get_reasoning(in, c, e) != 0)
        goto out;
    json_t *echo = echo_obj(in, r->store);
    r->echo_json = edge_dump(echo);
    json_decref(echo);
    if (!r->echo_json) {
        oom(e);
        goto out;
    }
    *out = c;
    c = NULL;
    rc = 0;
out:
    json_decref(c);
    json_decref(msgs);
    json_decref(cv.msgs);
    json_decref(cv.ids);
    ms_buf_free(&cv.reasoning);
    return rc;
}

/* --- output ------------------------------------------------------------------------------- */

void rsp_stream_init(struct rsp_stream *s, const char *id, const char *model, const char *call_id,
                     long created, const char *echo_json)
{
    memset(s, 0, sizeof *s);
    s->id = id;
    s->model = model;
    s->call_id = call_id;
    s->created = created;
    s->base = echo_json ? json_loads(echo_json, 0, NULL) : NULL;
    if (!json_is_object(s->base)) {
        json_decref(s->base);
        s->base = json_object();
    }
    s->output = json_array();
    s->calls = json_array();
}

static json_t *response_obj(const struct rsp_stream *s, const char *status, json_t *output)
{
    json_t *o = json_deep_copy(s->base);
    if (!o) o = json_object();
    json_object_set_new(o, "id", json_string(s->id));
    json_object_set_new(o, "object", json_string("response"));
    json_object_set_new(o, "created_at", json_integer(s->created));
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "error", json_null());
    json_object_set_new(o, "incomplete_details", json_null());
    json_object_set_new(o, "model", json_string(s->model));
    json_object_set_new(o, "output", output);
    json_object_set_new(o, "usage", json_null());
    return o;
}

static int event(struct rsp_stream *s, struct ms_buf *out, const char *type, json_t *ev)
{
    json_object_set_new(ev, "type", json_string(type));
    json_object_set_new(ev, "sequence_number", json_integer(s->seq++));
    return edge_emit(out, type, ev);
}

static int lifecycle(struct rsp_stream *s, struct ms_buf *out, const char *type, json_t *response)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "response", response);
    return event(s, out, type, ev);
}

int rsp_stream_start(struct rsp_stream *s, struct ms_buf *out)
{
    if (lifecycle(s, out, "response.created", response_obj(s, "in_progress", json_array())) != 0)
        return -1;
    return lifecycle(s, out, "response.in_progress", response_obj(s, "in_progress", json_array()));
}

char *rsp_stream_snapshot(struct rsp_stream *s, const char *status)
{
    json_t *o = response_obj(s, status, json_deep_copy(s->output));
    char *js = edge_dump(o);
    json_decref(o);
    return js;
}

static json_t *item_ev(const struct rsp_stream *s, json_t *item)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "output_index", json_integer(s->n_items));
    json_object_set_new(ev, "item", item);
    return ev;
}

static json_t *part_ev(const struct rsp_stream *s)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "item_id", json_string(s->item_id));
    json_object_set_new(ev, "output_index", json_integer(s->n_items));
    json_object_set_new(ev, "content_index", json_integer(0));
    return ev;
}

/* The open item as it stands: a reasoning item (status given) or a message. */
static json_t *open_item(const struct rsp_stream *s, bool done)
{
    json_t *t = json_stringn(s->cur.p ? s->cur.p : "", s->cur.len);
    if (!t) t = json_string("");
    json_t *it = json_object();
    json_object_set_new(it, "id", json_string(s->item_id));
    json_t *parts = json_array();
    json_t *p = json_object();
    if (s->open == 1) {
        json_object_set_new(it, "type", json_string("reasoning"));
        json_object_set_new(it, "summary", json_array());
        json_object_set_new(p, "type", json_string("reasoning_text"));
        json_object_set_new(p, "text", t);
        json_array_append_new(parts, p);
        json_object_set_new(it, "content", done ? parts : json_array());
        if (!done) json_decref(parts);
    } else {
        json_object_set_new(it, "type", json_string("message"));
        json_object_set_new(it, "role", json_string("assistant"));
        json_object_set_new(p, "type", json_string("output_text"));
        json_object_set_new(p, "text", t);
        json_object_set_new(p, "annotations", json_array());
        json_object_set_new(p, "logprobs", json_array());
        json_array_append_new(parts, p);
        json_object_set_new(it, "content", done ? parts : json_array());
        if (!done) json_decref(parts);
    }
    json_object_set_new(it, "status", json_string(done ? "completed" : "in_progress"));
    return it;
}

static int close_open(struct rsp_stream *s, struct ms_buf *out)
{
    if (!s->open) return 0;
    bool reasoning = s->open == 1;
    json_t *t = json_stringn(s->cur.p ? s->cur.p : "", s->cur.len);
    json_t *ev = part_ev(s);
    json_object_set_new(ev, "text", t ? t : json_string(""));
    if (!reasoning) json_object_set_new(ev, "logprobs", json_array());
    if (event(s, out, reasoning ? "response.reasoning_text.done" : "response.output_text.done",
              ev) != 0)
        return -1;
    json_t *item = open_item(s, true);
    ev = part_ev(s);
    json_object_set(ev, "part", json_array_get(json_object_get(item, "content"), 0));
    if (event(s, out, "response.content_part.done", ev) != 0) {
        json_decref(item);
        return -1;
    }
    json_array_append(s->output, item);
    if (event(s, out, "response.output_item.done", item_ev(s, item)) != 0) return -1;
    s->n_items++;
    s->open = 0;
    s->cur.len = 0;
    return 0;
}

static int add_text(struct rsp_stream *s, struct ms_buf *out, int kind, const char *p, size_t n)
{
    if (n == 0) return 0;
    if (s->open != kind) {
        if (close_open(s, out) != 0) return -1;
        snprintf(s->item_id, sizeof s->item_id, "%s_%s_%d", kind == 1 ? "rs" : "msg",
                 strchr(s->id, '_') ? strchr(s->id, '_') + 1 : s->id, s->n_items);
        s->open = kind;
        if (event(s, out, "response.output_item.added", item_ev(s, open_item(s, false))) != 0)
            return -1;
        json_t *part = json_object();
        json_object_set_new(part, "type",
                            json_string(kind == 1 ? "reasoning_text" : "output_text"));
        json_object_set_new(part, "text", json_string(""));
        if (kind == 2) {
            json_object_set_new(part, "annotations", json_array());
            json_object_set_new(part, "logprobs", json_array());
        }
        json_t *ev = part_ev(s);
        json_object_set_new(ev, "part", part);
        if (event(s, out, "response.content_part.added", ev) != 0) return -1;
    }
    if (ms_buf_add(&s->cur, p, n) != 0 || ms_buf_add(kind == 1 ? &s->think : &s->text, p, n) != 0)
        return -1;
    json_t *d = json_stringn(p, n);
    json_t *ev = part_ev(s);
    json_object_set_new(ev, "delta", d ? d : json_string("\xef\xbf\xbd"));
    if (kind == 2) json_object_set_new(ev, "logprobs", json_array());
    return event(s, out, kind == 1 ? "response.reasoning_text.delta" : "response.output_text.delta",
                 ev);
}

static int add_call(struct rsp_stream *s, struct ms_buf *out, const struct tc_call *c)
{
    if (close_open(s, out) != 0) return -1;
    char call_id[112], item_id[112];
    snprintf(call_id, sizeof call_id, "%s_%d", s->call_id, s->n_calls);
    snprintf(item_id, sizeof item_id, "fc_%s_%d",
             strchr(s->id, '_') ? strchr(s->id, '_') + 1 : s->id, s->n_calls);
    s->n_calls++;
    json_t *it = json_object();
    json_object_set_new(it, "type", json_string("function_call"));
    json_object_set_new(it, "id", json_string(item_id));
    json_object_set_new(it, "call_id", json_string(call_id));
    json_object_set_new(it, "name", json_string(c->name));
    json_object_set_new(it, "arguments", json_string(""));
    json_object_set_new(it, "status", json_string("in_progress"));
    if (event(s, out, "response.output_item.added", item_ev(s, it)) != 0) return -1;
    json_t *ev = json_object();
    json_object_set_new(ev, "item_id", json_string(item_id));
    json_object_set_new(ev, "output_index", json_integer(s->n_items));
    json_object_set_new(ev, "delta", json_string(c->arguments));
    if (event(s, out, "response.function_call_arguments.delta", ev) != 0) return -1;
    ev = json_object();
    json_object_set_new(ev, "item_id", json_string(item_id));
    json_object_set_new(ev, "output_index", json_integer(s->n_items));
    json_object_set_new(ev, "name", json_string(c->name));
    json_object_set_new(ev, "arguments", json_string(c->arguments));
    if (event(s, out, "response.function_call_arguments.done", ev) != 0) return -1;
    json_t *done = json_object();
    json_object_set_new(done, "type", json_string("function_call"));
    json_object_set_new(done, "id", json_string(item_id));
    json_object_set_new(done, "call_id", json_string(call_id));
    json_object_set_new(done, "name", json_string(c->name));
    json_object_set_new(done, "arguments", json_string(c->arguments));
    json_object_set_new(done, "status", json_string("completed"));
    json_array_append(s->output, done);
    /* the chat form, for the stored conversation */
    json_t *fn = json_object(), *tc = json_object();
    json_object_set_new(fn, "name", json_string(c->name));
    json_object_set_new(fn, "arguments", json_string(c->arguments));
    json_object_set_new(tc, "id", json_string(call_id));
    json_object_set_new(tc, "type", json_string("function"));
    json_object_set_new(tc, "function", fn);
    json_array_append_new(s->calls, tc);
    if (event(s, out, "response.output_item.done", item_ev(s, done)) != 0) return -1;
    s->n_items++;
    return 0;
}

int rsp_stream_feed(struct rsp_stream *s, struct ms_buf *out, const char *reasoning,
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

char *rsp_stream_end(struct rsp_stream *s, struct ms_buf *out, const char *status,
                     const char *incomplete_reason, const struct proto_usage *u,
                     int reasoning_tokens)
{
    if (close_open(s, out) != 0) return NULL;
    json_t *o = response_obj(s, status, json_incref(s->output));
    if (incomplete_reason) {
        json_t *d = json_object();
        json_object_set_new(d, "reason", json_string(incomplete_reason));
        json_object_set_new(o, "incomplete_details", d);
    }
    json_t *us = json_object();
    int cached = u->cached_tokens > 0 ? u->cached_tokens : 0;
    json_t *ind = json_object(), *outd = json_object();
    json_object_set_new(ind, "cached_tokens", json_integer(cached));
    json_object_set_new(outd, "reasoning_tokens", json_integer(reasoning_tokens));
    json_object_set_new(us, "input_tokens", json_integer(u->prompt_tokens));
    json_object_set_new(us, "input_tokens_details", ind);
    json_object_set_new(us, "output_tokens", json_integer(u->completion_tokens));
    json_object_set_new(us, "output_tokens_details", outd);
    json_object_set_new(us, "total_tokens", json_integer(u->prompt_tokens + u->completion_tokens));
    json_object_set_new(o, "usage", us);
    char *js = edge_dump(o);
    /* the SDK's events have no cancelled one: a stream cut by a cancel fails */
    const char *type = strcmp(status, "incomplete") == 0  ? "response.incomplete"
                       : strcmp(status, "cancelled") == 0 ? "response.failed"
                                                          : "response.completed";
    if (lifecycle(s, out, type, o) != 0) {
        free(js);
        return NULL;
    }
    return js;
}

char *rsp_stream_conversation(struct rsp_stream *s, const char *conv_json)
{
    json_t *conv = conv_json ? json_loads(conv_json, 0, NULL) : NULL;
    if (!json_is_array(conv)) {
        json_decref(conv);
        conv = json_array();
    }
    json_t *m = msg_new("assistant", s->text.p, s->text.len);
    if (s->think.len > 0)
        json_object_set_new(m, "reasoning_content", json_stringn(s->think.p, s->think.len));
    if (json_array_size(s->calls) > 0) json_object_set(m, "tool_calls", s->calls);
    json_array_append_new(conv, m);
    char *js = edge_dump(conv);
    json_decref(conv);
    return js;
}

void rsp_stream_free(struct rsp_stream *s)
{
    json_decref(s->base);
    json_decref(s->output);
    json_decref(s->calls);
    ms_buf_free(&s->cur);
    ms_buf_free(&s->text);
    ms_buf_free(&s->think);
    memset(s, 0, sizeof *s);
}

char *rsp_error_sse(const struct proto_error *e, int seq)
{
    json_t *ev = json_object();
    json_object_set_new(ev, "type", json_string("error"));
    json_object_set_new(ev, "code", e->code[0] ? json_string(e->code) : json_null());
    json_object_set_new(ev, "message", json_string(e->message));
    json_object_set_new(ev, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(ev, "sequence_number", json_integer(seq));
    struct ms_buf b = {0};
    if (edge_emit(&b, "error", ev) != 0) {
        ms_buf_free(&b);
        return NULL;
    }
    return ms_buf_take(&b);
}

char *rsp_with_status(const char *response_json, const char *status)
{
    json_t *o = json_loads(response_json, 0, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        return NULL;
    }
    json_object_set_new(o, "status", json_string(status));
    char *js = edge_dump(o);
    json_decref(o);
    return js;
}

char *rsp_deleted_body(const char *id)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object", json_string("response.deleted"));
    json_object_set_new(o, "deleted", json_true());
    char *js = edge_dump(o);
    json_decref(o);
    return js;
}
