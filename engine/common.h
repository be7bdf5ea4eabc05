/* Small things every engine module shares: the error-message convention and bf16/f16
 * conversion. Library functions report failure by returning a negative value and writing a
 * one-line, human-readable reason into a caller-owned buffer `err` of `errlen` bytes (the
 * reason names the file and tensor where there is one). They never exit or abort on bad input. */
#ifndef MOESERVE_COMMON_H
#define MOESERVE_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" { /* also included by the CUDA backend (.cu files are C++) */
#endif

#define MS_ERR_LEN 512

/* Writes a formatted reason into err (if non-NULL) and returns -1, so that callers can write
 * `return ms_errf(err, errlen, "...", ...);`. */
int ms_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static inline float ms_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round-to-nearest-even, NaN kept quiet. */
static inline uint16_t ms_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float ms_f16_to_f32(uint16_t h);
/* Round-to-nearest-even; overflow gives infinity, NaN stays NaN. */
uint16_t ms_f32_to_f16(float f);

/* Monotonic clock in seconds. */
double ms_now(void);

/* A growable byte string: the one buffer type of the output path (detokenized text, tool-call
 * content, SSE frames), so that no caller sizes a copy by hand. p[0, len) is the data and p[len]
 * is always '\0' once anything was added (p is NULL while cap is 0). The owner frees it with
 * ms_buf_free, or takes p with ms_buf_take. A failed add (out of memory) leaves the buffer as
 * it was and returns -1; a zeroed struct is an empty buffer. */
struct ms_buf {
    char *p;
    size_t len, cap;
};
/* Room for `extra` more bytes (plus the terminator). 0 or -1. */
int ms_buf_reserve(struct ms_buf *b, size_t extra);
/* Appends data[0, n). 0 or -1. */
int ms_buf_add(struct ms_buf *b, const void *data, size_t n);
/* Appends a NUL-terminated string. 0 or -1. */
int ms_buf_adds(struct ms_buf *b, const char *s);
/* The data as a malloc'd NUL-terminated string (an empty one when nothing was added; NULL when
 * out of memory); the buffer is left empty. */
char *ms_buf_take(struct ms_buf *b);
void ms_buf_free(struct ms_buf *b);

#ifdef __cplusplus
}
#endif

#endif
