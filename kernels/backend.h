/* Backend interface: the compute operations the forward pass needs, as a table of function
 * pointers behind an opaque handle (ggml-backend style). The CPU backend (kernels/cpu/) is the
 * reference and is always built; the CUDA backend (kernels/cuda/) implements the same table.
 *
 * Conventions: all tensors are row-major f32 on the CPU backend (bf16 storage on CUDA, f32
 * accumulation). Pointers passed to an op belong to the backend's memory (host memory for the
 * CPU backend, device memory for CUDA). Ops never allocate: scratch comes from the caller.
 * A backend instance belongs to one device thread and is not shared between threads.
 *
 * Ownership: backend_cpu_create returns a backend freed with backend->ops->destroy. */
#ifndef MOESERVE_BACKEND_H
#define MOESERVE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

struct backend;

struct backend_ops {
    const char *name;
    void (*destroy)(struct backend *be);

    /* Memory: alloc returns NULL on failure; upload/download copy host <-> backend memory
     * (plain memcpy on the CPU backend). */
    void *(*alloc)(struct backend *be, size_t bytes);
    void (*free)(struct backend *be, void *p);
    void (*upload)(struct backend *be, void *dst, const void *src, size_t bytes);
    void (*download)(struct backend *be, void *dst, const void *src, size_t bytes);
    void (*synchronize)(struct backend *be);

    /* y (n, m) = x (n, k) . w (m, k)^T [+ bias (m)] */
    void (*matmul)(struct backend *be, float *y, const float *x, const float *w, const float *bias,
                   int n, int k, int m);
    /* y (n, d) = x (n, d) * rsqrt(mean(x^2) + eps) * w (d); y may equal x */
    void (*rmsnorm)(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                    float eps);
    /* In place on x (n, n_head, head_dim), rotate-half RoPE at positions pos (n), with the
     * precomputed table cos_sin (max_pos, head_dim/2, 2). */
    void (*rope)(struct backend *be, float *x, const int32_t *pos, int n, int n_head,
                 int head_dim, const float *cos_sin);
    /* y (n, d) += x (n, d) */
    void (*add)(struct backend *be, float *y, const float *x, int n, int d);
    /* x (n, d) = clamp(x, -c, c) */
    void (*clamp)(struct backend *be, float *x, int n, int d, float c);
    /* out (n, d_ff) = silu(gate) * up, gate_up given as two (n, d_ff) arrays */
    void (*swiglu)(struct backend *be, float *out, const float *gate, const float *up, int n,
                   int d_ff);
    /* out (n, d) = embed[ids[i]] */
    void (*embed)(struct backend *be, float *out, const float *embed, const int32_t *ids, int n,
                  int d);
    /* rows: dst[i] = src[idx[i]] for row length d */
    void (*gather_rows)(struct backend *be, float *dst, const float *src, const int32_t *idx,
                        int n, int d);
    /* rows: dst[idx[i]] = src[i] */
    void (*scatter_rows)(struct backend *be, float *dst, const float *src, const int32_t *idx,
                         int n, int d);

    /* out (n, d) = sum over j < k with idx[i*k+j] >= 0 of w[i*k+j] * rows[idx[i*k+j]], summed in
     * slot order j (fixed order: results do not depend on where rows were computed). */
    void (*moe_combine)(struct backend *be, float *out, const float *rows, const int32_t *idx,
                        const float *w, int n, int k, int d);
    /* y (n, d) += f(s[i]) * x (n, d), f = sigmoid when `sigmoid` else identity */
    void (*add_scaled_rows)(struct backend *be, float *y, const float *x, const float *s, int n,
                            int d, int sigmoid);

    /* Paged causal attention for a run of n tokens of ONE sequence at positions pos0..pos0+n-1,
     * whose keys/values for positions [0, pos0+n) are already in the cache.
     * q (n, n_head, head_dim) -> out (n, n_head, head_dim).
     * k_cache/v_cache: (n_blocks, block_size, n_kv_head, head_dim) for this layer;
     * block_table (ceil((pos0+n)/block_size)) maps logical to physical blocks.
     * window > 0 limits attention to the last `window` positions (sliding window).
     * scratch: at least (pos0 + n) floats. */
    void (*attention)(struct backend *be, float *out, const float *q, const float *k_cache,
                      const float *v_cache, const int32_t *block_table, int block_size, int pos0,
                      int n, int n_head, int n_kv_head, int head_dim, int window, float scale,
                      float *scratch);
    /* Writes k/v rows (n, n_kv_head*head_dim) of one sequence at positions pos0.. into the cache. */
    void (*kv_write)(struct backend *be, float *k_cache, float *v_cache, const float *k,
                     const float *v, const int32_t *block_table, int block_size, int pos0, int n,
                     int row);
};

struct backend {
    const struct backend_ops *ops;
};

/* CPU backend; n_threads is the BLAS thread count this device may use (>= 1). */
struct backend *backend_cpu_create(int n_threads);

#endif
