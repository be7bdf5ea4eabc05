/* libFuzzer harness: request bodies through the OpenAI request parser (proto/request.c) for
 * every request kind (the first byte picks it), then the error serializer on what failed.
 * Beyond the sanitizers it checks that a failure is always a 400 naming its cause. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/request.h"
#include "proto/response.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const enum proto_kind kinds[] = {PROTO_COMPLETION, PROTO_CHAT, PROTO_TOKENIZE,
                                            PROTO_DETOKENIZE};
    if (size < 1) return 0;
    struct proto_req r;
    struct proto_error e;
    memset(&e, 0, sizeof e);
    if (proto_req_parse((const char *)data + 1, size - 1, kinds[data[0] % 4], &r, &e) != 0) {
        if (e.status != 400 || e.message[0] == '\0') abort();
        free(proto_resp_error(&e));
    }
    proto_req_free(&r);
    return 0;
}
