/* Helpers shared by the Anthropic and Responses translations (see edge.h). */
#include "proto/edge.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int edge_emit(struct ms_buf *out, const char *event, json_t *data)
{
    if (!out) {
        json_decref(data);
        return 0;
    }
    char *js = data ? json_dumps(data, JSON_COMPACT) : NULL;
    json_decref(data);
    if (!js) return -1;
    size_t at = out->len;
    int rc = ms_buf_adds(out, "event: ") | ms_buf_adds(out, event) | ms_buf_adds(out, "\ndata: ") |
             ms_buf_adds(out, js) | ms_buf_adds(out, "\n\n");
    free(js);
    if (rc != 0) { /* leave no half frame behind */
        out->len = at;
        if (out->p) out->p[at] = '\0';
        return -1;
    }
    return 0;
}

int edge_keys(json_t *o, const char *where, const char *const *keys, size_t n,
              struct proto_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        /* a null asks for nothing: the SDKs write every field of their models back, unset
         * ones as null */
        bool ok = json_is_null(v);
        for (size_t i = 0; i < n && !ok; i++)
            ok = strcmp(key, keys[i]) == 0;
        if (!ok) {
            char param[64];
            snprintf(param, sizeof param, "%s.%s", where, key);
            return proto_fail(e, 400, param, "unknown_parameter", "%s: unrecognized argument '%s'",
                              where, key);
        }
    }
    return 0;
}

char *edge_dump(json_t *v)
{
    return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
}

void edge_copy(json_t *out, json_t *in, const char *key)
{
    json_t *v = json_object_get(in, key);
    if (v && !json_is_null(v)) json_object_set(out, key, v);
}

void edge_copy_shared(json_t *out, json_t *in)
{
    static const char *const shared[] = {
        "model", "temperature", "top_p", "top_k", "stream", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "min_tokens", "cache_salt",
        "chat_template_kwargs", "moe_top_k", "moe_tag", "moe_samples", "moe_neuron_fraction",
        "moe_samples_adaptive", "speculative"};
    for (size_t i = 0; i < sizeof shared / sizeof *shared; i++)
        edge_copy(out, in, shared[i]);
}

bool edge_ends_with(const char *s, size_t len, const char *suffix)
{
    size_t n = strlen(suffix);
    return n <= len && memcmp(s + len - n, suffix, n) == 0;
}
