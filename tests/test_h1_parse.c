/* Tests for server/h1_parse: the end of a head found byte by byte, every framing rule of RFC
 * 9112 the parser enforces (each refusal with its status), and chunked bodies decoded the same
 * whatever way the bytes are split. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/h1_parse.h"
#include "test.h"

/* Parses a complete head; returns the status (0 = valid). */
static int parse(const char *text, struct h1p_request *r, char *buf, size_t cap)
{
    size_t len = strlen(text);
    if (len >= cap) return -1;
    memcpy(buf, text, len + 1);
    struct h1p_scan sc = {0};
    long end = h1p_head_end(&sc, buf, len);
    if (end < 0) return (int)-end;
    if (end == 0) return -2; /* incomplete */
    const char *why;
    return h1p_parse(buf, (size_t)end, r, &why);
}

static void expect_status(const char *text, int status, int line)
{
    static char buf[1 << 17];
    struct h1p_request r;
    int st = parse(text, &r, buf, sizeof buf);
    CHECKF(st == status, "line %d: status %d, want %d for %.60s", line, st, status, text);
}
#define EXPECT(text, status) expect_status(text, status, __LINE__)

static void test_head_end(void)
{
    const char *req = "\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /next";
    size_t head_len = strlen("\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    struct h1p_scan sc = {0};
    long end = 0;
    size_t n;
    for (n = 1; n <= strlen(req) && end == 0; n++)
        end = h1p_head_end(&sc, req, n);
    CHECKF(end == (long)head_len, "end %ld", end);
    CHECK(n - 1 == head_len); /* found as soon as its last byte arrived */
    /* bare LF line ends */
    struct h1p_scan s2 = {0};
    CHECK(h1p_head_end(&s2, "GET / HTTP/1.1\nHost: x\n\nX", 25) == 24);
    /* a request line that never ends, a head that never ends */
    char *big = malloc(H1P_MAX_HEAD + 16);
    memset(big, 'a', H1P_MAX_HEAD + 16);
    struct h1p_scan s3 = {0};
    CHECK(h1p_head_end(&s3, big, H1P_MAX_LINE + 1) == -414);
    memcpy(big, "GET / HTTP/1.1\r\nX: ", 19);
    struct h1p_scan s4 = {0};
    CHECK(h1p_head_end(&s4, big, H1P_MAX_HEAD + 16) == -431);
    /* endless empty lines count against the head */
    memset(big, '\n', H1P_MAX_HEAD + 16);
    struct h1p_scan s5 = {0};
    CHECK(h1p_head_end(&s5, big, H1P_MAX_HEAD + 16) == -431);
    free(big);
}

static void test_valid(void)
{
    static char buf[4096];
    struct h1p_request r;
    CHECK(parse("POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\ncontent-length:  12 \r\n"
                "Authorization: Bearer k\r\nExpect: 100-Continue\r\n\r\n",
                &r, buf, sizeof buf) == 0);
    CHECK(strcmp(r.method, "POST") == 0);
    CHECK(strcmp(r.path, "/v1/completions") == 0);
    CHECK(r.minor == 1 && r.keep_alive && r.expect_continue && !r.chunked);
    CHECK(r.content_length == 12);
    CHECK(strcmp(h1p_field(&r, "AUTHORIZATION"), "Bearer k") == 0);
    CHECK(h1p_field(&r, "Cookie") == NULL);

    CHECK(parse("GET http://example.com:8000/health HTTP/1.1\r\nHost: example.com\r\n\r\n", &r, buf,
                sizeof buf) == 0);
    CHECK(strcmp(r.path, "/health") == 0);
    CHECK(parse("GET http://example.com HTTP/1.1\r\nHost: e\r\n\r\n", &r, buf, sizeof buf) == 0);
    CHECK(strcmp(r.path, "/") == 0);
    CHECK(parse("GET / HTTP/1.0\r\n\r\n", &r, buf, sizeof buf) == 0);
    CHECK(r.minor == 0 && !r.keep_alive && r.content_length == -1);
    CHECK(parse("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", &r, buf, sizeof buf) == 0);
    CHECK(r.keep_alive);
    CHECK(parse("GET / HTTP/1.1\r\nHost: x\r\nConnection: foo, close\r\n\r\n", &r, buf,
                sizeof buf) == 0);
    CHECK(!r.keep_alive);
    CHECK(parse("GET / HTTP/1.9\r\nHost: x\r\n\r\n", &r, buf, sizeof buf) == 0);
    CHECK(r.minor == 1); /* a later 1.x is read as 1.1 */
    CHECK(parse("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n", &r, buf,
                sizeof buf) == 0);
    CHECK(r.chunked && r.content_length == -1);
    CHECK(parse("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n",
                &r, buf, sizeof buf) == 0);
    CHECK(r.content_length == 5);
    CHECK(parse("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n", &r,
                buf, sizeof buf) == 0);
    CHECK(r.content_length == INT64_MAX);
    CHECK(parse("OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", &r, buf, sizeof buf) == 0);
    CHECK(parse("GET /a%20b HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Utf8: \xc3\xa9\r\n\r\n", &r, buf,
                sizeof buf) == 0);
    CHECK(strcmp(h1p_field(&r, "x-empty"), "") == 0);
}

static void test_refused(void)
{
    EXPECT("GARBAGE\r\n\r\n", 400);
    EXPECT("GET /\r\n\r\n", 400);                      /* HTTP/0.9 style */
    EXPECT("GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400); /* two spaces */
    EXPECT("GET / HTTP/1.1 \r\nHost: x\r\n\r\n", 400);
    EXPECT("G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400); /* not a token */
    EXPECT("GET / http/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET / HTTP/1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505);
    EXPECT("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505); /* HTTP/2 preface */
    EXPECT("GET / HTTP/0.9\r\nHost: x\r\n\r\n", 505);
    EXPECT("GET x HTTP/1.1\r\nHost: x\r\n\r\n", 400); /* not a path */
    EXPECT("GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400); /* '*' is for OPTIONS */
    EXPECT("GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET /a\"b HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET /a%2 HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET /#frag HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET http:///x HTTP/1.1\r\nHost: x\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\n\r\n", 400); /* no Host */
    EXPECT("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400); /* space before the colon */
    EXPECT("GET / HTTP/1.1\r\nHost\t: x\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400); /* obs-fold */
    EXPECT("GET / HTTP/1.1\r\n Host: x\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\nHost: x\r\n: empty\r\n\r\n", 400);
    EXPECT("GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400); /* bare CR */
    EXPECT("GET / HTTP/1.1\r\nHost: x\r\nX: a\x01"
           "b\r\n\r\n",
           400);
    EXPECT("GET / HTTP/1.1\rHost: x\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 6\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
           "Transfer-Encoding: chunked\r\n\r\n",
           400); /* smuggling shape */
    EXPECT("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", 400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
           "Transfer-Encoding: chunked\r\n\r\n",
           400);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n", 501);
    EXPECT("POST / HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n\r\n", 417);
    /* limits */
    char *big = malloc(1 << 17);
    int n = sprintf(big, "GET /");
    memset(big + n, 'a', H1P_MAX_LINE);
    strcpy(big + n + H1P_MAX_LINE, " HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT(big, 414);
    n = sprintf(big, "GET / HTTP/1.1\r\nHost: x\r\nX: ");
    memset(big + n, 'a', H1P_MAX_HEAD);
    strcpy(big + n + H1P_MAX_HEAD, "\r\n\r\n");
    EXPECT(big, 431);
    n = sprintf(big, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i < H1P_MAX_FIELDS; i++)
        n += sprintf(big + n, "X%d: y\r\n", i);
    strcpy(big + n, "\r\n");
    EXPECT(big, 431);
    free(big);
}

/* Decodes `enc` fed in pieces of `step` bytes; returns 0 with the body in out, or the error. */
static int dechunk(const char *enc, size_t len, size_t step, char *out, size_t *out_len,
                   size_t *rest)
{
    struct h1p_chunked d;
    h1p_chunked_init(&d);
    char buf[4096];
    size_t have = 0, fed = 0;
    bool done = false;
    *out_len = 0;
    while (!done) {
        size_t add = fed + step <= len ? step : len - fed;
        memcpy(buf + have, enc + fed, add);
        have += add;
        fed += add;
        for (;;) {
            const char *data, *why;
            size_t n;
            long used = h1p_chunked(&d, buf, have, &data, &n, &done, &why);
            if (used < 0) return (int)-used;
            if (n) memcpy(out + *out_len, data, n);
            *out_len += n;
            memmove(buf, buf + used, have - (size_t)used);
            have -= (size_t)used;
            if (done || used == 0) break;
        }
        if (!done && fed == len) return -1; /* incomplete */
    }
    *rest = have + (len - fed);
    return 0;
}

static void test_chunked(void)
{
    const char *enc = "5\r\nhello\r\n0006;name=val;x\r\n world\r\nA \r\n0123456789\r\n"
                      "0\r\nTrailer: yes\r\nX: y\r\n\r\nNEXT";
    char out[256];
    size_t out_len, rest;
    for (size_t step = 1; step <= strlen(enc); step++) {
        int rc = dechunk(enc, strlen(enc), step, out, &out_len, &rest);
        CHECKF(rc == 0 && out_len == 21 && memcmp(out, "hello world0123456789", 21) == 0 &&
                   rest == 4,
               "step %zu: rc %d len %zu rest %zu", step, rc, out_len, rest);
    }
    CHECK(dechunk("0\r\n\r\n", 5, 1, out, &out_len, &rest) == 0 && out_len == 0);
    CHECK(dechunk("000\r\n\r\n", 7, 3, out, &out_len, &rest) == 0 && out_len == 0);
    const char *bad[] = {
        "zz\r\n",                /* not hex */
        "\r\n",                  /* no size */
        "5\nhello\r\n0\r\n\r\n", /* LF alone after the size */
        "5\r\nhello\n0\r\n\r\n", /* LF alone after the data */
        "5\r\nhelloXX0\r\n\r\n", /* data longer than its size */
        "1000000000000000\r\n",  /* 16 significant hex digits */
        "-5\r\n",
        "5\x01\r\n",
        "5;a\x01\r\n",
        "0\r\nX: a\rb\r\n\r\n",
        "0\r\n\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECKF(dechunk(bad[i], strlen(bad[i]), 1, out, &out_len, &rest) == 400, "bad %zu", i);
    /* leading zeros are not digits that count */
    CHECK(dechunk("00000000000000000001\r\na\r\n0\r\n\r\n", 30, 7, out, &out_len, &rest) == 0 &&
          out_len == 1);
    /* an endless trailer section */
    char *trailer = malloc(H1P_MAX_TRAILER + 64);
    strcpy(trailer, "0\r\nX: ");
    memset(trailer + 6, 'a', H1P_MAX_TRAILER + 10);
    struct h1p_chunked d;
    h1p_chunked_init(&d);
    const char *data, *why;
    size_t n;
    bool done;
    long used = 0, total = 0;
    while ((used = h1p_chunked(&d, trailer + total, H1P_MAX_TRAILER + 16 - (size_t)total, &data, &n,
                               &done, &why)) > 0)
        total += used;
    CHECK(used == -431);
    free(trailer);
}

int main(void)
{
    test_head_end();
    test_valid();
    test_refused();
    test_chunked();
    return test_done("test_h1_parse");
}
