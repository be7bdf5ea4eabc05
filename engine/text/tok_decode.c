/* Decoding for the tokenizer (tok_decode and the tok_stream_* functions of tokenizer.h):
 * the ByteLevel decoder (GPT-2 byte table inverted, then a lossy UTF-8 repair of the whole
 * output) and the SentencePiece-style chain Replace -> ByteFallback -> Fuse -> Strip.
 * Streaming keeps the few bytes of an unfinished character in the caller's tok_stream and
 * never allocates. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "unicode.h"

/* Growable (or, with `fixed`, bounded) byte buffer; `failed` records out-of-memory or
 * overflow and makes further writes no-ops. Keeps a NUL after the data. */
struct buf {
    char *p;
    size_t len, cap;
    bool fixed, failed;
};

static void buf_put(struct buf *b, const char *s, size_t n)
{
    if (b->failed) return;
    if (b->len + n + 1 > b->cap) {
        if (b->fixed) {
            b->failed = true;
            return;
        }
        size_t c = b->cap ? b->cap : 256;
        while (c < b->len + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) {
            b->failed = true;
            return;
        }
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void buf_fffd(struct buf *b, size_t count)
{
    for (size_t i = 0; i < count; i++) buf_put(b, "\xEF\xBF\xBD", 3);
}

/* Byte value of a "<0xNN>" token, or -1. */
static int byte_token_value(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* True when every character of the token has a byte in the ByteLevel table; the decoder then
 * emits those bytes, otherwise the token's own UTF-8. */
static bool byte_level_mappable(const struct tokenizer *t, const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = uni_utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (k <= 0 || cp >= 0x144 || t->bl_inv[cp] < 0) return false;
        i += (size_t)k;
    }
    return true;
}

/* Converts mappable token text to bytes, at most `room` of them; *used: input bytes consumed. */
static size_t byte_level_chunk(const struct tokenizer *t, const char *s, size_t n, size_t *used, char *dst, size_t room)
{
    size_t i = 0, w = 0;
    while (i < n && w < room) {
        uint32_t cp = 0;
        int k = uni_utf8_next((const unsigned char *)s + i, n - i, &cp);
        dst[w++] = (char)t->bl_inv[cp];
        i += (size_t)k;
    }
    *used = i;
    return w;
}

/* Appends token text with the decoder's Replace applied. */
static void put_replaced(const struct tokenizer *t, struct buf *o, const char *s, size_t n)
{
    if (!t->dec_from) {
        buf_put(o, s, n);
        return;
    }
    size_t fl = strlen(t->dec_from), tl = strlen(t->dec_to);
    size_t i = 0, from = 0;
    while (i + fl <= n) {
        if (memcmp(s + i, t->dec_from, fl) == 0) {
            buf_put(o, s + from, i - from);
            buf_put(o, t->dec_to, tl);
            i += fl;
            from = i;
        } else {
            i++;
        }
    }
    buf_put(o, s + from, n - from);
}

/* Ends a byte-fallback group that started at `start` in o: kept if valid UTF-8, else replaced
 * by one U+FFFD per byte token (what the ByteFallback decoder does). */
static void end_byte_group(struct buf *o, size_t start, size_t *count)
{
    if (*count && !o->failed && !uni_utf8_valid(o->p + start, o->len - start)) {
        o->len = start;
        buf_fffd(o, *count);
    }
    *count = 0;
}

static size_t strip_len(const struct tokenizer *t, const char *s, size_t n)
{
    if (t->strip_start <= 0 || n == 0) return 0;
    uint32_t cp;
    int k = uni_utf8_next((const unsigned char *)s, n, &cp);
    return k > 0 && cp == t->strip_ch ? (size_t)k : 0;
}

long tok_decode(const struct tokenizer *t, const int32_t *ids, int n, bool skip_special, char *out, size_t cap)
{
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_ids) return -1;
    struct buf b = {0};
    size_t group_start = 0, group_n = 0;
    bool first = true;
    buf_put(&b, "", 0);
    for (int i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_entry(t, ids[i], &len);
        if (!s || (skip_special && t->special[ids[i]])) continue;
        if (t->dec == DEC_BYTELEVEL) {
            if (!byte_level_mappable(t, s, len)) {
                buf_put(&b, s, len);
                continue;
            }
            while (len) {
                char tmp[256];
                size_t used, k = byte_level_chunk(t, s, len, &used, tmp, sizeof tmp);
                buf_put(&b, tmp, k);
                s += used;
                len -= used;
            }
        } else if (t->dec == DEC_JOIN) {
            if (!first) buf_put(&b, " ", 1);
            buf_put(&b, s, len);
        } else {
            int bv = t->dec_byte_fallback ? byte_token_value(s, len) : -1;
            if (bv >= 0) {
                char c = (char)bv;
                if (group_n++ == 0) group_start = b.len;
                buf_put(&b, &c, 1);
            } else {
                end_byte_group(&b, group_start, &group_n);
                put_replaced(t, &b, s, len);
            }
        }
        first = false;
    }
    end_byte_group(&b, group_start, &group_n);
    if (b.failed) {
        free(b.p);
        return -1;
    }
    const char *res = b.p;
    size_t rlen = b.len;
    char *fixed = NULL;
    if (t->dec == DEC_BYTELEVEL) {
        long r = uni_utf8_repair(b.p, b.len, &fixed);
        if (r < 0) {
            free(b.p);
            return -1;
        }
        res = fixed;
        rlen = (size_t)r;
    } else if (t->dec == DEC_PIECES) {
        size_t k = strip_len(t, res, rlen);
        res += k;
        rlen -= k;
    }
    if (cap > 0) {
        size_t c = rlen < cap - 1 ? rlen : cap - 1;
        memcpy(out, res, c);
        out[c] = '\0';
    }
    free(b.p);
    free(fixed);
    return (long)rlen;
}

void tok_stream_init(struct tok_stream *s, bool skip_special)
{
    memset(s, 0, sizeof *s);
    s->skip_special = skip_special;
}

/* Writes stream output, applying the decoder's leading Strip to the very start of the text. */
static void sput(const struct tokenizer *t, struct tok_stream *st, struct buf *o, const char *s, size_t n)
{
    if (n == 0) return;
    if (!st->started && t->dec == DEC_PIECES) {
        size_t k = strip_len(t, s, n);
        s += k;
        n -= k;
    }
    st->started = true;
    buf_put(o, s, n);
}

static void sput_fffd(const struct tokenizer *t, struct tok_stream *st, struct buf *o, int count)
{
    for (int i = 0; i < count; i++) sput(t, st, o, "\xEF\xBF\xBD", 3);
}

/* ByteLevel: runs bytes through the pending buffer, writing whole characters and one U+FFFD
 * per maximal invalid sequence, as a lossy decode of the whole concatenation would. */
static void stream_bytes(const struct tokenizer *t, struct tok_stream *st, struct buf *o, const char *b, size_t n)
{
    while (n > 0) {
        unsigned char tmp[256 + sizeof st->pending];
        size_t c = n < 256 ? n : 256, m = (size_t)st->n_pending;
        memcpy(tmp, st->pending, m);
        memcpy(tmp + m, b, c);
        m += c;
        b += c;
        n -= c;
        st->n_pending = 0;
        size_t i = 0;
        while (i < m) {
            uint32_t cp;
            int k = uni_utf8_next(tmp + i, m - i, &cp);
            if (k > 0) {
                sput(t, st, o, (const char *)tmp + i, (size_t)k);
                i += (size_t)k;
            } else if (k == 0) { /* an incomplete character: hold it (at most 3 bytes) */
                memcpy(st->pending, tmp + i, m - i);
                st->n_pending = (int)(m - i);
                break;
            } else {
                sput_fffd(t, st, o, 1);
                i += (size_t)-k;
            }
        }
    }
}

/* SentencePiece byte fallback: a run of byte tokens is written as soon as it forms whole
 * characters; bytes that cannot form one become one U+FFFD per byte. Unlike a full decode,
 * characters already written stay written if a later byte of the same run is invalid (which
 * ids produced by encoding never contain). */
static void stream_byte_token(const struct tokenizer *t, struct tok_stream *st, struct buf *o, unsigned char b)
{
    st->pending[st->n_pending++] = b;
    uint32_t cp;
    int k = uni_utf8_next(st->pending, (size_t)st->n_pending, &cp);
    if (k == 0) return;
    if (k > 0 && k == st->n_pending) sput(t, st, o, (const char *)st->pending, (size_t)k);
    else sput_fffd(t, st, o, st->n_pending);
    st->n_pending = 0;
}

int tok_stream_push(const struct tokenizer *t, struct tok_stream *st, int32_t id, char *out, size_t cap)
{
    if (id < 0 || id >= t->n_ids || cap == 0) return -1;
    struct tok_stream saved = *st;
    struct buf o = {out, 0, cap, true, false};
    out[0] = '\0';
    size_t len;
    const char *s = tok_entry(t, id, &len);
    if (!s || (st->skip_special && t->special[id])) return 0;
    if (t->dec == DEC_BYTELEVEL) {
        if (!byte_level_mappable(t, s, len)) {
            stream_bytes(t, st, &o, s, len);
        } else {
            while (len) {
                char tmp[256];
                size_t used, k = byte_level_chunk(t, s, len, &used, tmp, sizeof tmp);
                stream_bytes(t, st, &o, tmp, k);
                s += used;
                len -= used;
            }
        }
    } else if (t->dec == DEC_JOIN) {
        if (st->n_prev++ > 0) sput(t, st, &o, " ", 1); /* no decoder: n_prev counts tokens */
        sput(t, st, &o, s, len);
    } else {
        int bv = t->dec_byte_fallback ? byte_token_value(s, len) : -1;
        if (bv >= 0) {
            stream_byte_token(t, st, &o, (unsigned char)bv);
        } else {
            if (st->n_pending) {
                sput_fffd(t, st, &o, st->n_pending);
                st->n_pending = 0;
            }
            char tmp[1024];
            struct buf r = {tmp, 0, sizeof tmp, true, false};
            put_replaced(t, &r, s, len);
            if (r.failed) o.failed = true;
            else sput(t, st, &o, tmp, r.len);
        }
    }
    if (o.failed) {
        *st = saved;
        out[0] = '\0';
        return -1;
    }
    return (int)o.len;
}

int tok_stream_flush(const struct tokenizer *t, struct tok_stream *st, char *out, size_t cap)
{
    if (cap == 0) return -1;
    struct buf o = {out, 0, cap, true, false};
    out[0] = '\0';
    /* ByteLevel: a truncated character is one error; byte fallback: one per byte token. */
    if (st->n_pending) sput_fffd(t, st, &o, t->dec == DEC_BYTELEVEL ? 1 : st->n_pending);
    if (o.failed) {
        out[0] = '\0';
        return -1;
    }
    st->n_pending = 0;
    return (int)o.len;
}


int tok_token_bytes(const struct tokenizer *t, int32_t id, char *out, size_t cap)
{
    size_t n;
    const char *s = tok_entry(t, id, &n);
    if (!s) return -1;
    struct buf b = {.p = out, .cap = cap, .fixed = true};
    if (cap == 0) return -1;
    out[0] = '\0';
    bool added = false;
    for (int i = 0; i < t->n_added && !added; i++) added = t->added[i].id == id;
    if (added) {
        buf_put(&b, s, n); /* added tokens decode to their content in every style */
    } else if (t->dec == DEC_BYTELEVEL && byte_level_mappable(t, s, n)) {
        for (size_t i = 0; i < n && !b.failed;) {
            size_t used;
            char chunk[64];
            size_t w = byte_level_chunk(t, s + i, n - i, &used, chunk, sizeof chunk);
            buf_put(&b, chunk, w);
            i += used;
        }
    } else if (t->dec == DEC_PIECES && t->dec_byte_fallback && byte_token_value(s, n) >= 0) {
        char byte = (char)byte_token_value(s, n);
        buf_put(&b, &byte, 1);
    } else if (t->dec == DEC_PIECES) {
        put_replaced(t, &b, s, n); /* "\u2581myth" -> " myth": no start-of-text stripping */
    } else {
        buf_put(&b, s, n);
    }
    return b.failed ? -1 : (int)b.len;
}

bool tok_decode_strips_first_space(const struct tokenizer *t)
{
    return t->dec == DEC_PIECES && t->strip_start > 0 && t->strip_ch == ' ';
}
