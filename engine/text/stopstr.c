/* Stop-string filter (stopstr.h). Each feed appends the piece to the hold, looks for the
 * earliest match of every stop string there, and otherwise keeps the longest tail that is a
 * proper prefix of one. Every text position that could start a match is still held when the
 * match completes, so feeding piece by piece finds the same match as searching each prefix
 * of the whole text at the piece boundaries. */
#include "stopstr.h"

#include <string.h>

int stopstr_init(struct stopstr *f, const char *const *stop, int n_stop, bool include,
                 size_t max_piece)
{
    size_t longest = 0;
    for (int i = 0; i < n_stop; i++) {
        size_t l = strlen(stop[i]);
        if (l > longest) longest = l;
    }
    *f = (struct stopstr){.stop = stop, .n_stop = n_stop, .include = include};
    return n_stop > 0 ? ms_buf_reserve(&f->hold, longest + max_piece) : 0;
}

void stopstr_free(struct stopstr *f)
{
    ms_buf_free(&f->hold);
}

void stopstr_flush(struct stopstr *f, stopstr_emit emit, void *ctx)
{
    if (f->hold.len) emit(ctx, f->hold.p, f->hold.len);
    f->hold.len = 0;
}

bool stopstr_feed(struct stopstr *f, const char *t, size_t n, bool active, stopstr_emit emit,
                  void *ctx)
{
    if (f->n_stop == 0 || !active) {
        stopstr_flush(f, emit, ctx);
        if (n) emit(ctx, t, n);
        return false;
    }
    if (ms_buf_add(&f->hold, t, n) != 0) {
        stopstr_flush(f, emit, ctx);
        if (n) emit(ctx, t, n);
        return false;
    }
    const char *h = f->hold.p;
    size_t hl = f->hold.len, best = hl, best_len = 0;
    for (int i = 0; i < f->n_stop; i++) {
        size_t sl = strlen(f->stop[i]);
        for (size_t k = 0; k + sl <= hl && k < best; k++)
            if (memcmp(h + k, f->stop[i], sl) == 0) {
                best = k;
                best_len = sl;
                break;
            }
    }
    if (best < hl) {
        size_t w = best + (f->include ? best_len : 0);
        if (w) emit(ctx, h, w);
        f->hold.len = 0;
        return true;
    }
    size_t keep = 0; /* the longest tail that is a proper prefix of some stop string */
    for (int i = 0; i < f->n_stop; i++) {
        size_t sl = strlen(f->stop[i]);
        for (size_t l = sl - 1; l > keep; l--)
            if (l <= hl && memcmp(h + hl - l, f->stop[i], l) == 0) {
                keep = l;
                break;
            }
    }
    if (hl - keep) emit(ctx, h, hl - keep);
    memmove(f->hold.p, h + hl - keep, keep);
    f->hold.len = keep;
    f->hold.p[keep] = '\0';
    return false;
}
