/* Log lines (see slog.h): a line is formatted into a stack buffer, JSON strings escaped, then
 * written with one fwrite under stdio's stream lock. */
#include "slog.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

static bool use_json;
static char msg_prefix[32];

void slog_set_json(bool on)
{
    use_json = on;
}

void slog_set_prefix(const char *prefix)
{
    snprintf(msg_prefix, sizeof msg_prefix, "%s", prefix ? prefix : "");
}

bool slog_json(void)
{
    return use_json;
}

struct line {
    char s[2048];
    size_t n;
};

static void put(struct line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct line *l, const char *fmt, ...)
{
    if (l->n >= sizeof l->s - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(l->s + l->n, sizeof l->s - l->n, fmt, ap);
    va_end(ap);
    if (w < 0) return;
    l->n += (size_t)w < sizeof l->s - l->n ? (size_t)w : sizeof l->s - 1 - l->n;
}

/* s as the inside of a JSON string: quotes and backslashes escaped, control bytes as \u00XX. */
static void put_escaped(struct line *l, const char *s)
{
    for (; *s && l->n < sizeof l->s - 8; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            l->s[l->n++] = '\\';
            l->s[l->n++] = (char)c;
        } else if (c < 0x20) {
            put(l, "\\u%04x", c);
        } else {
            l->s[l->n++] = (char)c;
        }
    }
    l->s[l->n] = '\0';
}

static void put_head(struct line *l, const char *level)
{
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    char ts[32];
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    if (use_json)
        put(l, "{\"ts\":\"%s\",\"level\":\"%s\"", ts, level);
    else
        put(l, "%s %s ", ts, level);
}

static void emit(struct line *l)
{
    if (l->n > sizeof l->s - 2) l->n = sizeof l->s - 2;
    l->s[l->n++] = '\n';
    flockfile(stderr);
    fwrite(l->s, 1, l->n, stderr);
    fflush(stderr);
    funlockfile(stderr);
}

void slog_vmsg(const char *level, const char *fmt, va_list ap)
{
    char msg[1024];
    int pre = snprintf(msg, sizeof msg, "%s", msg_prefix);
    vsnprintf(msg + pre, sizeof msg - (size_t)pre, fmt, ap);
    struct line l = {.n = 0};
    put_head(&l, level);
    if (use_json) {
        put(&l, ",\"msg\":\"");
        put_escaped(&l, msg);
        put(&l, "\"}");
    } else {
        /* one line per message, whatever it holds */
        for (char *p = msg; *p; p++)
            if (*p == '\n' || *p == '\r') *p = ' ';
        put(&l, "%s", msg);
    }
    emit(&l);
}

void slog_msg(const char *level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    slog_vmsg(level, fmt, ap);
    va_end(ap);
}

static void json_str(struct line *l, const char *key, const char *v)
{
    put(l, ",\"%s\":", key);
    if (!v) {
        put(l, "null");
        return;
    }
    put(l, "\"");
    put_escaped(l, v);
    put(l, "\"");
}

static void json_num(struct line *l, const char *key, double v, bool integer)
{
    if (v < 0)
        put(l, ",\"%s\":null", key);
    else if (integer)
        put(l, ",\"%s\":%.0f", key, v);
    else
        put(l, ",\"%s\":%.6f", key, v);
}

/* Text: a token that cannot hold a space or a quote (client-chosen bytes are escaped). */
static void text_str(struct line *l, const char *key, const char *v)
{
    if (!v) return;
    put(l, " %s=", key);
    for (; *v && l->n < sizeof l->s - 8; v++) {
        unsigned char c = (unsigned char)*v;
        if (c <= 0x20 || c == '"' || c == '\\' || c >= 0x7f)
            put(l, "\\x%02x", c);
        else
            l->s[l->n++] = (char)c;
    }
    l->s[l->n] = '\0';
}

void slog_access(const struct slog_access *a)
{
    struct line l = {.n = 0};
    put_head(&l, "info");
    if (use_json) {
        put(&l, ",\"msg\":\"access\"");
        json_str(&l, "id", a->id);
        json_str(&l, "method", a->method);
        json_str(&l, "route", a->route);
        put(&l, ",\"status\":%d", a->status);
        json_num(&l, "prompt_tokens", a->prompt_tokens, true);
        json_num(&l, "completion_tokens", a->completion_tokens, true);
        json_num(&l, "ttft_s", a->ttft_s, false);
        json_num(&l, "duration_s", a->duration_s, false);
        json_str(&l, "finish_reason", a->finish_reason);
        json_str(&l, "client", a->client);
        json_str(&l, "outcome", a->outcome);
        put(&l, "}");
    } else {
        put(&l, "access");
        text_str(&l, "client", a->client);
        text_str(&l, "method", a->method);
        text_str(&l, "route", a->route);
        put(&l, " status=%d", a->status);
        text_str(&l, "id", a->id);
        if (a->prompt_tokens >= 0) put(&l, " prompt_tokens=%d", a->prompt_tokens);
        if (a->completion_tokens >= 0) put(&l, " completion_tokens=%d", a->completion_tokens);
        if (a->ttft_s >= 0) put(&l, " ttft=%.4fs", a->ttft_s);
        if (a->duration_s >= 0) put(&l, " duration=%.4fs", a->duration_s);
        text_str(&l, "finish_reason", a->finish_reason);
        text_str(&l, "outcome", a->outcome);
    }
    emit(&l);
}
