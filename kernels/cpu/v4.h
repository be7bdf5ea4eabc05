/* DeepSeek-V4's ops on the CPU (backend.h hc_pre, hc_post, v4_compress, v4_attention): the
 * hyper-connections' per-token mixing, the compressor that pools a window of cached rows into
 * one entry, and the attention over a sliding window plus compressed entries with sink logits.
 * Tokens are spread over the backend's thread pool; the scratch is reserved once
 * (v4_work_reserve), so a call allocates nothing. */
#ifndef MOESERVE_CPU_V4_H
#define MOESERVE_CPU_V4_H

#include "backend.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"

struct v4_work {
    float *buf; /* (n_threads, per_thread): logits (max_heads, max_keys), two rows */
    size_t per_thread;
    int max_heads, max_keys, row;
};

/* Scratch for up to max_heads heads over max_keys keys (window + context) and rows of `row`
 * elements; 0, or -1 when out of memory (w is then empty). */
int v4_work_reserve(struct v4_work *w, int n_threads, int max_heads, int max_keys, int row);
void v4_work_free(struct v4_work *w);

void v4_hc_pre_run(struct pool *pool, float *post, float *comb, float *y, const float *x,
                   const float *mix, int n, int d, const struct be_hc *h);
void v4_hc_post_run(struct pool *pool, float *y, const float *x, const float *out,
                    const float *post, const float *comb, int n, int d, int n_stream);
/* A token whose entry would need more than the reserved scratch gets zeros (the engine always
 * reserves enough). */
void v4_compress_run(struct pool *pool, const struct gemm_kernels *kk, struct v4_work *w,
                     float *out, int ldo, const struct be_kv *kv, const struct be_tokens *tk,
                     int block_size, int n, const struct be_v4cmp *p);
/* A token with more keys or heads than reserved gets zeros (never with the engine's reserve). */
void v4_attention_run(struct pool *pool, const struct gemm_kernels *kk, struct v4_work *w,
                      float *out, const float *q, const struct be_kv *kv,
                      const struct be_tokens *tk, int block_size, int n, const struct be_v4attn *a);

#endif
