/* libFuzzer harness: chat templates (engine/jinja*.c). The input is a template, optionally
 * followed by a NUL and a messages JSON array; the template is parsed and, when it parses,
 * rendered the way the server does (jinja_render_chat_args) with those messages or a fixed
 * conversation. Errors must carry a reason; nothing may crash, leak or run away. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const default_messages =
    "[{\"role\":\"system\",\"content\":\"be brief\"},{\"role\":\"user\",\"content\":\"hi\"},"
    "{\"role\":\"assistant\",\"content\":\"hello\",\"reasoning_content\":\"r\"},"
    "{\"role\":\"user\",\"content\":\"2+2?\"}]";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = '\0';
    size_t tlen = strlen(buf);
    const char *messages = tlen + 1 < size ? buf + tlen + 1 : default_messages;
    char err[256];
    err[0] = '\0';
    jinja_template *t = jinja_template_parse(buf, err, sizeof err);
    if (!t) {
        if (!err[0]) abort();
        free(buf);
        return 0;
    }
    struct jinja_chat_args args = {.messages_json = messages,
                                   .add_generation_prompt = size & 1,
                                   .bos_token = "<s>",
                                   .eos_token = "</s>"};
    char *out = NULL;
    err[0] = '\0';
    if (jinja_render_chat_args(t, &args, &out, err, sizeof err) == 0) {
        if (!out) abort();
        free(out);
    } else if (!err[0] || out) {
        abort();
    }
    jinja_template_free(t);
    free(buf);
    return 0;
}
