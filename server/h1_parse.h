/* HTTP/1.1 request framing (RFC 9112) without I/O: finds the end of a request head in bytes as
 * they arrive, parses it strictly, and decodes chunked bodies incrementally. Everything a
 * hostile client can send ends in a status the server answers with (400, 413, 414, 431, 501,
 * 505), never in a guess: whitespace before a field's colon, obs-fold, bare CR, conflicting
 * Content-Length values, Transfer-Encoding together with Content-Length, and codings other
 * than chunked are refused rather than interpreted, because two parsers reading one message
 * differently is how requests get smuggled.
 *
 * Ownership: the parser keeps no allocation. h1p_parse writes NULs into the head it is given
 * and every string in struct h1p_request points into that buffer, valid while it lives. */
#ifndef MOESERVE_H1_PARSE_H
#define MOESERVE_H1_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define H1P_MAX_LINE       8192  /* bytes of the request line; longer: 414 */
#define H1P_MAX_HEAD       32768 /* bytes of the whole head; longer: 431 */
#define H1P_MAX_FIELDS     100   /* header fields; more: 431 */
#define H1P_MAX_CHUNK_LINE 4096  /* a chunk-size line with its extensions; longer: 400 */
#define H1P_MAX_TRAILER    8192  /* bytes of a chunked body's trailer section; more: 431 */

struct h1p_field {
    const char *name;  /* as sent (compare case-insensitively) */
    const char *value; /* without surrounding whitespace */
};

struct h1p_request {
    const char *method;
    const char *path; /* the request target reduced to its path (no query) */
    int minor;        /* HTTP/1.minor; a minor above 1 is read as 1 (RFC 9110 2.5) */
    struct h1p_field fields[H1P_MAX_FIELDS];
    int n_fields;
    int64_t content_length; /* -1: none; INT64_MAX: more digits than fit (too large) */
    bool chunked;           /* Transfer-Encoding: chunked */
    bool keep_alive;        /* the connection may carry another request after this one */
    bool expect_continue;   /* Expect: 100-continue (HTTP/1.1 only) */
};

/* Incremental search state for h1p_head_end; zero it before a new head. */
struct h1p_scan {
    size_t pos;     /* bytes searched so far */
    size_t start;   /* where the request line starts (after ignored empty lines) */
    size_t last_nl; /* the latest line end seen */
    bool line_done; /* the request line has ended */
};

/* Looks for the end of a request head in buf[0..len) (the bytes received so far, the same
 * prefix on every call). Returns the head's length (through its empty line), 0 when more bytes
 * are needed, or -414 / -431 when the head cannot fit the limits whatever follows. */
long h1p_head_end(struct h1p_scan *sc, const char *buf, size_t len);

/* Parses a complete head of `len` bytes (as found by h1p_head_end) in place. Returns 0, or the
 * HTTP status to answer (400, 417, 431, 501, 505) with a static reason in *why. */
int h1p_parse(char *head, size_t len, struct h1p_request *r, const char **why);

/* Value of the first field called `name` (case-insensitive), or NULL. */
const char *h1p_field(const struct h1p_request *r, const char *name);

/* Chunked body decoder (RFC 9112 7.1); zero it (or h1p_chunked_init) before a body. */
struct h1p_chunked {
    int state;
    uint64_t size;  /* chunk-size being read, then the data bytes left in the chunk */
    size_t line;    /* bytes of the current size or trailer line */
    size_t trailer; /* bytes of the trailer section so far */
    int digits;     /* significant hex digits of the chunk size */
};

void h1p_chunked_init(struct h1p_chunked *d);
/* Decodes in[0..len). Returns the bytes consumed (>= 0) and points *data and *n at body bytes
 * found in them (*n may be 0), or returns -400 or -431 for a malformed or oversized encoding
 * (reason in *why). Sets *done once the last chunk and the trailer section are through; bytes
 * after that belong to the next request and are not consumed. Call again with the rest. */
long h1p_chunked(struct h1p_chunked *d, const char *in, size_t len, const char **data, size_t *n,
                 bool *done, const char **why);

#endif
