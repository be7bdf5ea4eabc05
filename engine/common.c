/* Error formatting, half-precision conversion and the clock shared by engine modules. */
#include "common.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int ms_errf(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

float ms_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    int exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal: value = mant * 2^-24 */
            float f = ldexpf((float)mant, -24);
            memcpy(&u, &f, sizeof u);
            u |= sign;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((uint32_t)(exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t ms_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* rounds past 65504: inf */
    if (a < 0x38800000u) {                                        /* below 2^-14: subnormal */
        /* value = m * 2^-24 with m rounded to nearest even; a float's exact product then
         * rounds once, since 2^24 * f is exact for |f| < 2^-14. */
        float s;
        uint32_t abits = a;
        memcpy(&s, &abits, sizeof s);
        return (uint16_t)(sign | (uint32_t)lrintf(s * 0x1p24f));
    }
    /* Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even; a
     * carry out of the mantissa correctly bumps the exponent. */
    uint32_t h = ((a - 0x38000000u) >> 13);
    uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

double ms_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int ms_buf_reserve(struct ms_buf *b, size_t extra)
{
    if (extra > SIZE_MAX / 2 - b->len) return -1;
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

int ms_buf_add(struct ms_buf *b, const void *data, size_t n)
{
    if (ms_buf_reserve(b, n) != 0) return -1;
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

int ms_buf_adds(struct ms_buf *b, const char *s)
{
    return ms_buf_add(b, s, strlen(s));
}

char *ms_buf_take(struct ms_buf *b)
{
    char *p = b->p;
    if (!p) p = calloc(1, 1);
    *b = (struct ms_buf){0};
    return p;
}

void ms_buf_free(struct ms_buf *b)
{
    free(b->p);
    *b = (struct ms_buf){0};
}
