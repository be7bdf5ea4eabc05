/* HTTP/1.1 request framing (see h1_parse.h). The grammar is RFC 9112's; where the RFC lets a
 * recipient choose between tolerating and refusing, this file refuses, except for the two
 * tolerances every client relies on: empty lines before a request line and a bare LF ending a
 * head line. */
#include "h1_parse.h"

#include <stdint.h>
#include <string.h>
#include <strings.h>

/* tchar of RFC 9110 5.6.2: what a method, field name or transfer coding is made of. */
static bool is_tchar(unsigned char c)
{
    if (c >= '0' && c <= '9') return true;
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return true;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* Octets allowed in a request-target (RFC 3986 without the fragment): unreserved, sub-delims,
 * ':', '@', '/', '?' and '%' (checked for two hex digits by the caller). */
static bool is_target_char(unsigned char c)
{
    if (c >= '0' && c <= '9') return true;
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return true;
    return c && strchr("-._~!$&'()*+,;=:@/?%", c) != NULL;
}

static bool is_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f');
}

static int hex_val(unsigned char c)
{
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

/* field-value octets: SP, HTAB, VCHAR and obs-text; never CR, LF, NUL or other controls. */
static bool is_value_char(unsigned char c)
{
    return c == ' ' || c == '\t' || (c >= 0x21 && c != 0x7f);
}

long h1p_head_end(struct h1p_scan *sc, const char *buf, size_t len)
{
    size_t i = sc->pos;
    for (; i < len; i++) {
        char ch = buf[i];
        if (i >= H1P_MAX_HEAD) return -431;
        if (!sc->line_done) {
            /* Empty lines before the request line are ignored (RFC 9112 2.2). */
            if (i == sc->start && (ch == '\r' || ch == '\n')) {
                sc->start = i + 1;
                continue;
            }
            if (ch == '\n') {
                sc->line_done = true;
                sc->last_nl = i;
            } else if (i - sc->start >= H1P_MAX_LINE) {
                return -414;
            }
            continue;
        }
        if (ch != '\n') continue;
        /* An empty line ("\n" or "\r\n" right after the previous line's end) ends the head. */
        if (i == sc->last_nl + 1 || (i == sc->last_nl + 2 && buf[i - 1] == '\r')) {
            sc->pos = i + 1;
            return (long)(i + 1);
        }
        sc->last_nl = i;
    }
    sc->pos = i;
    return 0;
}

const char *h1p_field(const struct h1p_request *r, const char *name)
{
    for (int i = 0; i < r->n_fields; i++)
        if (strcasecmp(r->fields[i].name, name) == 0) return r->fields[i].value;
    return NULL;
}

/* Next element of a comma-separated list (RFC 9110 5.6.1) in [*p, end): returns its start
 * and sets *len (OWS trimmed); empty elements are skipped. NULL when the list is done. */
static const char *list_next(const char **p, const char *end, size_t *len)
{
    for (;;) {
        const char *s = *p;
        while (s < end && (*s == ' ' || *s == '\t' || *s == ','))
            s++;
        if (s >= end) return NULL;
        const char *e = s;
        while (e < end && *e != ',')
            e++;
        *p = e;
        const char *t = e;
        while (t > s && (t[-1] == ' ' || t[-1] == '\t'))
            t--;
        if (t > s) {
            *len = (size_t)(t - s);
            return s;
        }
    }
}

/* Content-Length: a list of equal 1*DIGIT values. Returns the value (INT64_MAX when it has
 * more digits than fit), or -1 when malformed. */
static int64_t parse_content_length(const char *v)
{
    const char *p = v, *end = v + strlen(v), *s;
    size_t len;
    int64_t value = -1;
    if (!*v) return -1;
    while ((s = list_next(&p, end, &len))) {
        int64_t x = 0;
        for (size_t i = 0; i < len; i++) {
            if (s[i] < '0' || s[i] > '9') return -1;
            x = x > (INT64_MAX - 9) / 10 ? INT64_MAX : x * 10 + (s[i] - '0');
        }
        if (value >= 0 && x != value) return -1;
        value = x;
    }
    return value;
}

/* Parses the request line [p, le) (CR already stripped). */
static int parse_request_line(char *p, char *le, struct h1p_request *r, const char **why)
{
    *le = '\0';
    char *sp1 = memchr(p, ' ', (size_t)(le - p));
    if (!sp1 || sp1 == p) return *why = "malformed request line", 400;
    for (char *q = p; q < sp1; q++)
        if (!is_tchar((unsigned char)*q)) return *why = "malformed request method", 400;
    char *target = sp1 + 1;
    char *sp2 = memchr(target, ' ', (size_t)(le - target));
    if (!sp2 || sp2 == target) return *why = "malformed request line", 400;
    char *ver = sp2 + 1;
    if (strlen(ver) == 8 && strncmp(ver, "HTTP/", 5) == 0 && ver[5] >= '0' && ver[5] <= '9' &&
        ver[6] == '.' && ver[7] >= '0' && ver[7] <= '9') {
        if (ver[5] != '1') return *why = "only HTTP/1.0 and HTTP/1.1 are supported", 505;
        r->minor = ver[7] == '0' ? 0 : 1;
    } else {
        return *why = "malformed HTTP version", 400;
    }
    *sp1 = '\0';
    *sp2 = '\0';
    r->method = p;
    for (char *q = target; *q; q++) {
        if (!is_target_char((unsigned char)*q))
            return *why = "invalid character in the request target", 400;
        if (*q == '%' && !(is_hex((unsigned char)q[1]) && is_hex((unsigned char)q[2])))
            return *why = "bad percent-encoding in the request target", 400;
    }
    if (target[0] == '/') {
        r->path = target;
    } else if (strcmp(target, "*") == 0 && strcmp(r->method, "OPTIONS") == 0) {
        r->path = target;
    } else if (strncasecmp(target, "http://", 7) == 0 || strncasecmp(target, "https://", 8) == 0) {
        /* absolute-form: servers must accept it (RFC 9112 3.2.2); the authority is ignored */
        char *auth = strstr(target, "://") + 3;
        char *slash = strchr(auth, '/');
        if (auth == slash || *auth == '\0' || *auth == '?')
            return *why = "absolute request target without a host", 400;
        r->path = slash ? slash : "/";
    } else {
        return *why = "the request target must be a path", 400;
    }
    char *q = strchr(r->path, '?');
    if (q) *q = '\0'; /* routes ignore the query */
    return 0;
}

/* Transfer-Encoding: every listed coding, across all fields; chunked must be the last one. */
static int parse_transfer_encoding(const struct h1p_request *r, bool *chunked, const char **why)
{
    int n_codings = 0;
    bool last_chunked = false;
    for (int i = 0; i < r->n_fields; i++) {
        if (strcasecmp(r->fields[i].name, "Transfer-Encoding") != 0) continue;
        const char *p = r->fields[i].value, *end = p + strlen(p), *s;
        size_t len;
        while ((s = list_next(&p, end, &len))) {
            if (last_chunked) return *why = "chunked must be the last transfer coding", 400;
            size_t tl = 0;
            while (tl < len && is_tchar((unsigned char)s[tl]))
                tl++;
            if (tl == 0) return *why = "malformed Transfer-Encoding", 400;
            if (tl == 7 && strncasecmp(s, "chunked", 7) == 0 && tl == len) {
                last_chunked = true;
            } else {
                return *why = "unsupported transfer coding (only chunked is)", 501;
            }
            n_codings++;
        }
    }
    if (n_codings > 0 && !last_chunked) return *why = "malformed Transfer-Encoding", 400;
    *chunked = last_chunked;
    return 0;
}

/* What the fields mean for framing and the connection: Host, Content-Length,
 * Transfer-Encoding, Connection and Expect. */
static int check_fields(struct h1p_request *r, const char **why)
{
    int hosts = 0;
    bool te = false, close = false, ka = false;
    for (int i = 0; i < r->n_fields; i++) {
        const char *n = r->fields[i].name, *v = r->fields[i].value;
        if (strcasecmp(n, "Host") == 0) {
            hosts++;
        } else if (strcasecmp(n, "Content-Length") == 0) {
            int64_t x = parse_content_length(v);
            if (x < 0) return *why = "invalid Content-Length", 400;
            if (r->content_length >= 0 && r->content_length != x)
                return *why = "conflicting Content-Length values", 400;
            r->content_length = x;
        } else if (strcasecmp(n, "Transfer-Encoding") == 0) {
            te = true;
        } else if (strcasecmp(n, "Connection") == 0) {
            const char *p = v, *end = v + strlen(v), *s;
            size_t len;
            while ((s = list_next(&p, end, &len))) {
                if (len == 5 && strncasecmp(s, "close", 5) == 0) close = true;
                if (len == 10 && strncasecmp(s, "keep-alive", 10) == 0) ka = true;
            }
        } else if (strcasecmp(n, "Expect") == 0 && r->minor == 1) {
            /* HTTP/1.0 expectations are ignored (RFC 9110 10.1.1) */
            if (strcasecmp(v, "100-continue") != 0) return *why = "unsupported expectation", 417;
            r->expect_continue = true;
        }
    }
    if (r->minor == 1 && hosts != 1)
        return *why = "an HTTP/1.1 request needs exactly one Host", 400;
    if (hosts > 1) return *why = "more than one Host", 400;
    if (te) {
        /* RFC 9112 6.1 and 6.3: faulty framing in HTTP/1.0; a smuggling attempt with both. */
        if (r->minor == 0) return *why = "Transfer-Encoding in an HTTP/1.0 request", 400;
        if (r->content_length >= 0) return *why = "both Transfer-Encoding and Content-Length", 400;
        int st = parse_transfer_encoding(r, &r->chunked, why);
        if (st) return st;
    }
    r->keep_alive = r->minor == 1 ? !close : ka && !close;
    return 0;
}

int h1p_parse(char *head, size_t len, struct h1p_request *r, const char **why)
{
    memset(r, 0, sizeof *r);
    r->content_length = -1;
    *why = "";
    char *p = head, *end = head + len;
    while (p < end && (*p == '\n' || (*p == '\r' && p + 1 < end && p[1] == '\n')))
        p += *p == '\r' ? 2 : 1;
    bool first = true;
    for (;;) {
        char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) return *why = "incomplete request head", 400;
        char *le = eol > p && eol[-1] == '\r' ? eol - 1 : eol;
        for (char *q = p; q < le; q++)
            if (*q == '\r' || *q == '\0') return *why = "bare CR or NUL in the request head", 400;
        if (first) {
            int st = parse_request_line(p, le, r, why);
            if (st) return st;
            first = false;
        } else if (le == p) {
            break; /* the empty line: end of the head */
        } else {
            if (*p == ' ' || *p == '\t') return *why = "obsolete line folding in a header", 400;
            char *colon = p;
            while (colon < le && is_tchar((unsigned char)*colon))
                colon++;
            if (colon == le || *colon != ':') {
                if (colon < le && (*colon == ' ' || *colon == '\t'))
                    return *why = "whitespace between a header name and its colon", 400;
                return *why = "malformed header line", 400;
            }
            if (colon == p) return *why = "empty header name", 400;
            char *v = colon + 1, *ve = le;
            while (v < ve && (*v == ' ' || *v == '\t'))
                v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            for (char *q = v; q < ve; q++)
                if (!is_value_char((unsigned char)*q))
                    return *why = "invalid character in a header value", 400;
            if (r->n_fields == H1P_MAX_FIELDS) return *why = "too many header fields", 431;
            *colon = '\0';
            *ve = '\0';
            r->fields[r->n_fields].name = p;
            r->fields[r->n_fields].value = v;
            r->n_fields++;
        }
        p = eol + 1;
    }
    return check_fields(r, why);
}

/* --- chunked bodies -------------------------------------------------------------------------- */

enum {
    CH_SIZE,    /* chunk-size hex digits */
    CH_EXT,     /* chunk extensions, ignored, up to CR */
    CH_SIZE_LF, /* LF ending the size line */
    CH_DATA,    /* chunk data */
    CH_DATA_CR, /* CRLF after the data */
    CH_DATA_LF,
    CH_TRAILER,      /* start of a trailer line, or the final empty line */
    CH_TRAILER_LINE, /* inside a trailer field line (ignored) */
    CH_TRAILER_LF,   /* LF ending a trailer line */
    CH_END_LF,       /* LF of the final empty line */
    CH_DONE,
};

/* One octet of a line the decoder skips (a chunk extension, a trailer field): its CR moves
 * to `on_cr`; a control character other than HTAB is refused (false). */
static bool skip_text(struct h1p_chunked *d, unsigned char c, int on_cr)
{
    if (c == '\r') {
        d->state = on_cr;
        return true;
    }
    return is_value_char(c);
}

void h1p_chunked_init(struct h1p_chunked *d)
{
    memset(d, 0, sizeof *d);
}

long h1p_chunked(struct h1p_chunked *d, const char *in, size_t len, const char **data, size_t *n,
                 bool *done, const char **why)
{
    size_t i = 0;
    *data = NULL;
    *n = 0;
    *done = d->state == CH_DONE;
    while (i < len && d->state != CH_DONE) {
        unsigned char c = (unsigned char)in[i];
        switch (d->state) {
        case CH_SIZE:
            if (is_hex(c)) {
                if (d->size || c != '0') d->digits++;
                if (d->digits > 15) return *why = "chunk size too large", -400;
                d->size = d->size * 16 + (uint64_t)hex_val(c);
                d->line++;
                i++;
                break;
            }
            if (d->line == 0) return *why = "malformed chunk size", -400;
            if (c == '\r') {
                d->state = CH_SIZE_LF;
            } else if (c == ';' || c == ' ' || c == '\t') {
                d->state = CH_EXT;
            } else {
                return *why = "malformed chunk size", -400;
            }
            i++;
            break;
        case CH_EXT: /* skipped up to its CR, like a trailer field */
            if (++d->line > H1P_MAX_CHUNK_LINE) return *why = "chunk extension too long", -400;
            if (!skip_text(d, c, CH_SIZE_LF))
                return *why = "invalid character in a chunk extension", -400;
            i++;
            break;
        case CH_SIZE_LF:
            if (c != '\n') return *why = "chunk size line must end with CRLF", -400;
            i++;
            d->line = 0;
            d->digits = 0;
            d->state = d->size ? CH_DATA : CH_TRAILER;
            break;
        case CH_DATA: {
            size_t take = len - i < d->size ? len - i : (size_t)d->size;
            *data = in + i;
            *n = take;
            d->size -= take;
            i += take;
            if (d->size == 0) d->state = CH_DATA_CR;
            return (long)i; /* one span per call */
        }
        case CH_DATA_CR:
        case CH_DATA_LF:
            if (c != (d->state == CH_DATA_CR ? '\r' : '\n'))
                return *why = "chunk data must end with CRLF", -400;
            d->state = d->state == CH_DATA_CR ? CH_DATA_LF : CH_SIZE;
            i++;
            break;
        case CH_TRAILER:
            if (c == '\r') {
                d->state = CH_END_LF;
                i++;
                break;
            }
            d->state = CH_TRAILER_LINE;
            break;
        case CH_TRAILER_LINE:
            if (++d->trailer > H1P_MAX_TRAILER) return *why = "trailer section too large", -431;
            if (!skip_text(d, c, CH_TRAILER_LF))
                return *why = "invalid character in a trailer field", -400;
            i++;
            break;
        case CH_TRAILER_LF:
        case CH_END_LF:
            if (c != '\n') return *why = "trailer line must end with CRLF", -400;
            d->state = d->state == CH_END_LF ? CH_DONE : CH_TRAILER;
            i++;
            break;
        default:
            return *why = "chunked decoder state", -400;
        }
    }
    *done = d->state == CH_DONE;
    return (long)i;
}
