/* Server log lines on stderr: messages (`slog_msg`) and the access log (`slog_access`, one line
 * per HTTP request), as text ("TIME LEVEL MESSAGE") or, after slog_set_json(true), one JSON
 * object per line. Each line goes out in one write, so lines of concurrent threads never
 * interleave. Any thread; no state but the format, set once before threads start. */
#ifndef MOESERVE_SLOG_H
#define MOESERVE_SLOG_H

#include <stdarg.h>
#include <stdbool.h>

void slog_set_json(bool on);
/* Text put before every message (e.g. "[rank 1] " under mpirun); copied; NULL for none. */
void slog_set_prefix(const char *prefix);
bool slog_json(void);
void slog_msg(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void slog_vmsg(const char *level, const char *fmt, va_list ap);

/* One finished HTTP request. Strings may be NULL (left out: null in JSON); numbers < 0 are
 * unknown (left out likewise). */
struct slog_access {
    const char *id;            /* the response id (cmpl-..., chatcmpl-...), generation only */
    const char *method;
    const char *route;         /* the route name, never the raw path */
    int status;
    const char *client;        /* "address:port" */
    int prompt_tokens, completion_tokens;
    double ttft_s, duration_s;
    const char *finish_reason; /* generation: the first choice's */
    const char *outcome;       /* "sent", or "client_closed" / "server_stopped" first */
};
void slog_access(const struct slog_access *a);

#endif
