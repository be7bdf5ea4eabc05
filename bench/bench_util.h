/* Shared by the benchmarks in bench/: host memory read bandwidth, measured in the run that
 * reports against it. Header-only (every benchmark is its own program). */
#ifndef MOESERVE_BENCH_UTIL_H
#define MOESERVE_BENCH_UTIL_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

struct bw_arg {
    const float *p;
    size_t n;
    double sum;
};

#if defined(__x86_64__)
#include <immintrin.h>
/* 256-bit loads into four independent accumulators: bound by memory, not by the core. */
__attribute__((target("avx2"))) static inline double bw_read_avx2(const float *p, size_t n)
{
    __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
    for (size_t i = 0; i + 32 <= n; i += 32) {
        a = _mm256_add_ps(a, _mm256_load_ps(p + i));
        b = _mm256_add_ps(b, _mm256_load_ps(p + i + 8));
        c = _mm256_add_ps(c, _mm256_load_ps(p + i + 16));
        d = _mm256_add_ps(d, _mm256_load_ps(p + i + 24));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    return (double)t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

static inline void *bw_read(void *arg)
{
    struct bw_arg *a = arg;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2")) {
        a->sum = bw_read_avx2(a->p, a->n);
        return NULL;
    }
#endif
    /* Several independent accumulators so the loop is bound by loads, not by add latency. */
    float s[8] = {0};
    for (size_t i = 0; i + 8 <= a->n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a->p[i + j];
    double t = 0;
    for (int j = 0; j < 8; j++) t += s[j];
    a->sum = t;
    return NULL;
}

/* Read bandwidth in bytes/s over a buffer much larger than the caches, all cores reading
 * their own part: the best of 7 passes (this machine's bandwidth moves with its neighbours). */
static inline double measure_read_bandwidth(int threads)
{
    size_t bytes = (size_t)1 << 30, n = bytes / sizeof(float);
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, bytes) != 0) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023);
    double best = 0;
    for (int rep = 0; rep < 7; rep++) {
        pthread_t th[64];
        struct bw_arg args[64];
        size_t chunk = n / (size_t)threads / 32 * 32;
        double t0 = ms_now();
        for (int i = 0; i < threads; i++) {
            args[i] = (struct bw_arg){buf + chunk * (size_t)i, chunk, 0};
            pthread_create(&th[i], NULL, bw_read, &args[i]);
        }
        double sink = 0;
        for (int i = 0; i < threads; i++) {
            pthread_join(th[i], NULL);
            sink += args[i].sum;
        }
        double dt = ms_now() - t0;
        if (sink == 42.0) fprintf(stderr, " ");
        double rate = (double)(chunk * (size_t)threads * sizeof(float)) / dt;
        if (rate > best) best = rate;
    }
    free(buf);
    return best;
}

#endif
