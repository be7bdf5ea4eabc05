/* Attention benchmark (not a test): the CPU backend's attention op alone (kernels/cpu/flash.c)
 * for one decode token or one prefill chunk at a given depth, per KV cache type: time per call,
 * the KV bytes it reads per second, and keys x heads per second.
 *
 *   bench_attention [--depth 4096] [--tokens 1] [--heads 16] [--kv-heads 8] [--head-dim 64]
 *                   [--threads N] [--iters 20] [--types f32,bf16,f16,fp8_e4m3,fp8_e5m2,int8]
 *                   [--shuffle 1]   (the sequence's blocks scattered over the pool)
 *
 * The cache is filled through the backend's own kv_write with random rows; the query tokens sit
 * at positions depth .. depth + tokens - 1. Also the process's CPU time per call (all threads),
 * which a machine shared with other work inflates less than the wall time. */
#include <math.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "common.h"
#include "engine.h"
#include "kv_cache.h"

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    int depth = 4096, tokens = 1, heads = 16, kv_heads = 8, hd = 64, threads = 0, iters = 20;
    int shuffle = 0;
    const char *type_list = "float32,bfloat16,float16,fp8_e4m3,fp8_e5m2,int8";
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (strcmp(a, "--depth") == 0) depth = atoi(v);
        else if (strcmp(a, "--tokens") == 0) tokens = atoi(v);
        else if (strcmp(a, "--heads") == 0) heads = atoi(v);
        else if (strcmp(a, "--kv-heads") == 0) kv_heads = atoi(v);
        else if (strcmp(a, "--head-dim") == 0) hd = atoi(v);
        else if (strcmp(a, "--threads") == 0) threads = atoi(v);
        else if (strcmp(a, "--iters") == 0) iters = atoi(v);
        else if (strcmp(a, "--types") == 0) type_list = v;
        else if (strcmp(a, "--shuffle") == 0) shuffle = atoi(v);
        else {
            fprintf(stderr, "usage: bench_attention [--depth N] [--tokens N] [--heads H] "
                            "[--kv-heads K] [--head-dim D] [--threads N] [--iters N] "
                            "[--types LIST] [--shuffle 0|1]\n");
            return 2;
        }
    }
    if (depth < 0 || tokens < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || hd < 1 ||
        iters < 1) {
        fprintf(stderr, "bench_attention: bad shape\n");
        return 2;
    }
    if (threads <= 0) threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    struct backend *be = backend_cpu_create(threads, false);
    if (!be) return 1;
    int bs = 16, n_pos = depth + tokens, n_blocks = (n_pos + bs - 1) / bs, row = kv_heads * hd;
    struct be_reserve rs = {.max_elems = (size_t)n_pos * row, .max_rows = n_pos, .max_experts = 1,
                            .max_ctx = n_pos, .max_heads = heads / kv_heads, .max_k_dim = hd,
                            .max_v_dim = hd, .max_kv_heads = kv_heads};
    if (be->ops->reserve(be, &rs) != 0) return 1;
    int32_t *table = malloc(sizeof(int32_t) * n_blocks);
    float *k = malloc(sizeof(float) * (size_t)n_pos * row), *v = malloc(sizeof(float) * (size_t)n_pos * row);
    float *q = malloc(sizeof(float) * (size_t)tokens * heads * hd);
    float *out = malloc(sizeof(float) * (size_t)tokens * heads * hd);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < (size_t)n_pos * row; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        k[i] = (float)((int)(x % 2001) - 1000) / 500.0f;
        v[i] = (float)((int)((x >> 20) % 2001) - 1000) / 500.0f;
    }
    for (size_t i = 0; i < (size_t)tokens * heads * hd; i++) q[i] = (float)(i % 17) / 17.0f - 0.5f;
    /* blocks in order, as a lone sequence gets them from the pool (--shuffle: scattered) */
    for (int i = 0; i < n_blocks; i++) table[i] = shuffle ? (i * 7 + 3) % n_blocks : i;
    printf("attention: %d token(s) at depth %d, %d query heads over %d KV heads of %d, %d "
           "threads, kernels %s\n",
           tokens, depth, heads, kv_heads, hd, threads, backend_cpu_kernels());
    printf("%-9s %10s %12s %10s %12s %14s\n", "type", "us/call", "cpu us/call", "KV MB",
           "KV GB/s", "Mkey*head/s");
    char list[256];
    snprintf(list, sizeof list, "%s", type_list);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int t;
        if (engine_kv_type_parse(tok, &t) != 0 || t < 0) {
            fprintf(stderr, "bench_attention: unknown type %s\n", tok);
            return 2;
        }
        struct kv_geom g = {.type = (enum be_kv_type)t, .k_row = row, .v_row = row, .k_grp = hd,
                            .v_grp = hd};
        struct be_kv kv;
        if (kv_layer_alloc(be, &g, n_blocks, bs, &kv) != 0) return 1;
        struct be_tokens all = {.tables = table, .pos0 = 0};
        be->ops->kv_write(be, &kv, k, v, &all, bs, n_pos, row);
        struct be_tokens tk = {.tables = table, .pos0 = depth};
        struct be_attn a = {.n_head = heads, .n_kv_head = kv_heads, .k_dim = hd, .v_dim = hd,
                            .k_row = row, .v_row = row, .scale = 1.0f / sqrtf((float)hd)};
        be->ops->attention(be, out, q, &kv, &tk, bs, tokens, &a); /* warm */
        double t0 = ms_now(), c0 = cpu_now();
        for (int it = 0; it < iters; it++) be->ops->attention(be, out, q, &kv, &tk, bs, tokens, &a);
        double per = (ms_now() - t0) / iters, cpu = (cpu_now() - c0) / iters;
        double bytes = (double)n_pos * kv_geom_token_bytes(&g);
        printf("%-9s %10.1f %12.1f %10.2f %12.2f %14.1f\n", tok, per * 1e6, cpu * 1e6,
               bytes / 1e6, bytes / per / 1e9, (double)n_pos * kv_heads * tokens / per / 1e6);
        kv_layer_free(be, &kv);
    }
    be->ops->destroy(be);
    free(table), free(k), free(v), free(q), free(out);
    return 0;
}
