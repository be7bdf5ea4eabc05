/* libFuzzer harness: raw bytes through the HTTP/1.1 request framing (server/h1_parse.c) as a
 * server meets them: the end of the head searched as bytes arrive (in pieces whose sizes the
 * input picks), the head parsed, and what follows decoded as a chunked body. Checks beyond
 * the sanitizers: the head's end does not depend on how the bytes were split, parsed strings
 * stay inside the head, and decoded body bytes are spans of the input. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/h1_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_inside(const char *p, const char *buf, size_t len)
{
    if (p && !(p >= buf && p <= buf + len)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    unsigned step = data[0] % 16 + 1; /* how the head arrives */
    const char *in = (const char *)data + 1;
    size_t len = size - 1;

    struct h1p_scan whole = {0}, pieces = {0};
    long end = h1p_head_end(&whole, in, len), end2 = 0;
    for (size_t n = step < len ? step : len; end2 == 0; n = n + step < len ? n + step : len) {
        end2 = h1p_head_end(&pieces, in, n);
        if (n == len) break;
    }
    if (end != end2 || end > (long)len) abort();
    if (end <= 0) return 0;

    char *head = malloc((size_t)end + 1);
    memcpy(head, in, (size_t)end);
    head[end] = '\0';
    struct h1p_request r;
    const char *why;
    int st = h1p_parse(head, (size_t)end, &r, &why);
    if (st == 0) {
        check_inside(r.method, head, (size_t)end);
        if (r.path && strcmp(r.path, "/") != 0) check_inside(r.path, head, (size_t)end);
        for (int i = 0; i < r.n_fields; i++) {
            check_inside(r.fields[i].name, head, (size_t)end);
            check_inside(r.fields[i].value, head, (size_t)end);
        }
        if (r.chunked && r.content_length >= 0) abort(); /* refused as a smuggling shape */
    } else if (!why || !*why) {
        abort();
    }
    free(head);

    /* the rest as a chunked body, fed in pieces */
    const char *body = in + end;
    size_t blen = len - (size_t)end, off = 0;
    struct h1p_chunked d;
    h1p_chunked_init(&d);
    bool done = false;
    while (off < blen && !done) {
        size_t avail = blen - off < step ? blen - off : step;
        const char *span;
        size_t n;
        long used = h1p_chunked(&d, body + off, avail, &span, &n, &done, &why);
        if (used < 0) break;
        if ((size_t)used > avail) abort();
        if (n && (span < body + off || span + n > body + off + used)) abort();
        if (used == 0 && !done) {
            if (avail == blen - off) break; /* needs bytes that never come */
            step++;                         /* give it more at once */
            continue;
        }
        off += (size_t)used;
    }
    return 0;
}
