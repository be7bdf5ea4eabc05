/* DeepSeek sparse attention's lightning indexer on the CPU (backend.h dsa_select): each token's
 * scores against the index keys of its sequence's cached positions (the keys gathered to f32
 * DSA_CHUNK positions at a time and multiplied by the token's index queries with the GEMM
 * kernels), then the top-k positions in ascending order, tokens spread over the backend's
 * thread pool. Used by backend_cpu.c; the scratch is reserved once (dsa_work_reserve), so a
 * call allocates nothing. */
#ifndef MOESERVE_CPU_DSA_H
#define MOESERVE_CPU_DSA_H

#include "backend.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"

/* Cached positions scored per GEMM call. */
#define DSA_CHUNK 256

struct dsa_work {
    float *buf;      /* (n_threads, per_thread) scores, their copy for the selection, a chunk
                        of keys (DSA_CHUNK, dim), its dot products (heads, DSA_CHUNK), the
                        prepared queries */
    size_t per_thread;
    int max_ctx, dim, heads;
};

/* Elements [off, off + len) of the cached K row (k_row elements, one segment) of position
 * `pos` of the sequence whose block table is `table`, as f32: in place for an f32 cache, else
 * converted into buf (len floats). Shared with DeepSeek-V4's ops (cpu/v4.c). */
const float *kv_row_slice(const struct gemm_kernels *kk, const struct be_kv *kv,
                          const int32_t *table, int block_size, int k_row, int pos, int off,
                          int len, float *buf);

int dsa_work_reserve(struct dsa_work *w, int n_threads, int max_ctx, int dim, int heads);
void dsa_work_free(struct dsa_work *w);
/* backend.h dsa_select; positions past the reserved context get sel_n 0 (nothing attended:
 * the caller reserved too little, which the engine never does) */
void dsa_select_run(struct pool *pool, const struct gemm_kernels *kk, struct dsa_work *w,
                    int32_t *sel, int32_t *sel_n, const float *q, const float *wt,
                    const struct be_kv *kv, const struct be_tokens *tk, int block_size, int n,
                    const struct be_dsa *p);

#endif
