/* Stop strings over streamed text: the filter between the incremental detokenizer and a
 * request's published output. Text that can no longer be the start of a stop string is
 * emitted; a tail that may still become one is held back. The first piece that completes a
 * stop string ends the output: what precedes the earliest-starting match among the text held
 * is emitted (and the stop string itself with include), the rest is dropped.
 *
 * Ownership: the filter borrows the stop strings (they must outlive it) and owns its hold
 * buffer, sized at init for the longest stop string plus one piece so that feeding never
 * allocates in practice (a longer piece grows it). */
#ifndef MOESERVE_STOPSTR_H
#define MOESERVE_STOPSTR_H

#include <stdbool.h>
#include <stddef.h>

#include "common.h"

struct stopstr {
    const char *const *stop; /* (n_stop) NUL-terminated, non-empty; borrowed */
    int n_stop;
    bool include;            /* emit the matched stop string too */
    struct ms_buf hold;      /* text held back while it may start a stop string */
};

/* Where emitted text goes (a request's output buffer). */
typedef void (*stopstr_emit)(void *ctx, const char *text, size_t n);

/* max_piece: the longest piece one feed usually brings. Returns 0, or -1 when out of memory. */
int stopstr_init(struct stopstr *f, const char *const *stop, int n_stop, bool include,
                 size_t max_piece);
void stopstr_free(struct stopstr *f);
/* Feeds the next piece. With active false (before min_tokens) no stop string counts: what is
 * held and the piece are emitted as they are. Returns true when a stop string matched (the
 * filter is then empty and the output must end). Returns false, emitting what it could, when
 * the hold cannot grow (out of memory): the piece is then passed through unfiltered. */
bool stopstr_feed(struct stopstr *f, const char *t, size_t n, bool active, stopstr_emit emit,
                  void *ctx);
/* The output ended another way: what was held is plain text after all. */
void stopstr_flush(struct stopstr *f, stopstr_emit emit, void *ctx);

#endif
