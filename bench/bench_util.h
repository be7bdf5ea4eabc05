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

static inline void *bw_read(void *arg)
{
    struct bw_arg *a = arg;
    /* Several independent accumulators so the loop is bound by loads, not by add latency. */
    float s[8] = {0};
    for (size_t i = 0; i + 8 <= a->n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a->p[i + j];
    double t = 0;
    for (int j = 0; j < 8; j++) t += s[j];
    a->sum = t;
    return NULL;
}

/* Read bandwidth in bytes/s over a buffer much larger than the caches, all cores reading. */
static inline double measure_read_bandwidth(int threads)
{
    size_t bytes = (size_t)1 << 30, n = bytes / sizeof(float);
    float *buf = malloc(bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023);
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        pthread_t th[64];
        struct bw_arg args[64];
        size_t chunk = n / (size_t)threads;
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
        if (bytes / dt > best) best = bytes / dt;
    }
    free(buf);
    return best;
}

#endif
