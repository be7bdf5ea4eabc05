/* Paged causal attention of the CUDA backend, for n tokens of one or several sequences (prefill
 * chunks and decode tokens of a whole step in one launch; struct be_tokens says where each
 * token's block table and position are). One block per (token, head). The context [start, pos] is walked
 * in chunks of AT_CHUNK positions with an online softmax: a chunk's scores go to shared memory
 * (one warp per key row, lanes across head_dim, so each key row is read coalesced), the running
 * maximum and sum are rescaled when a chunk raises the maximum, and each thread accumulates
 * AT_DIMS_PER_THREAD output dimensions in registers. Any context length takes the same path;
 * short contexts are simply one chunk. Correctness first: no tensor cores, no split-K over the
 * context (a long decode uses only n_head blocks). */
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"

#define AT_THREADS         128
#define AT_CHUNK           1024
#define AT_DIMS_PER_THREAD (CUK_ATTN_MAX_HEAD_DIM / AT_THREADS)

/* out, q: (n, n_head, head_dim); caches: (n_blocks, block_size, n_kv_head, head_dim);
 * grid = n * n_head; dynamic shared memory = (head_dim + AT_CHUNK) floats. */
static __global__ void __launch_bounds__(AT_THREADS)
    at_attention_kernel(float *out, const float *q, const float *k_cache, const float *v_cache,
                        struct be_tokens tk, int block_size, int n_head, int n_kv_head,
                        int head_dim, int window, float scale)
{
    extern __shared__ float at_smem[];
    __shared__ float red[32];
    float *qs = at_smem;            /* (head_dim) */
    float *sc = at_smem + head_dim; /* (AT_CHUNK) scores, then probabilities */

    int i = blockIdx.x / n_head;
    int h = blockIdx.x % n_head;
    int pos = tk.pos ? tk.pos[i] : tk.pos0 + i;
    const int32_t *block_table =
        tk.seq ? tk.tables + (size_t)tk.seq[i] * (size_t)tk.table_stride : tk.tables;
    int start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    int kvh = h / (n_head / n_kv_head);
    size_t row = (size_t)n_kv_head * (size_t)head_dim;
    const float *qh = q + ((size_t)i * n_head + h) * (size_t)head_dim;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, n_warp = blockDim.x >> 5;

    for (int j = tid; j < head_dim; j += blockDim.x)
        qs[j] = qh[j];
    __syncthreads();

    float m = -INFINITY, l = 0.0f;
    float acc[AT_DIMS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < AT_DIMS_PER_THREAD; r++)
        acc[r] = 0.0f;

    for (int c0 = start; c0 <= pos; c0 += AT_CHUNK) {
        int len = pos + 1 - c0 < AT_CHUNK ? pos + 1 - c0 : AT_CHUNK;

        for (int t = warp; t < len; t += n_warp) {
            int p = c0 + t;
            const float *kt =
                k_cache +
                ((size_t)block_table[p / block_size] * block_size + p % block_size) * row +
                (size_t)kvh * head_dim;
            float s = 0.0f;
            for (int j = lane; j < head_dim; j += 32)
                s += qs[j] * kt[j];
            for (int o = 16; o > 0; o >>= 1)
                s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) sc[t] = s * scale;
        }
        __syncthreads();

        float cm = -INFINITY;
        for (int t = tid; t < len; t += blockDim.x)
            cm = fmaxf(cm, sc[t]);
        cm = cuk_block_max(cm, red);
        float new_m = fmaxf(m, cm);
        float alpha = expf(m - new_m); /* 0 on the first chunk (m = -inf) */

        float ps = 0.0f;
        for (int t = tid; t < len; t += blockDim.x) {
            float e = expf(sc[t] - new_m);
            sc[t] = e;
            ps += e;
        }
        /* The barriers inside the sum also publish the probabilities written above. */
        ps = cuk_block_sum(ps, red);
        l = l * alpha + ps;
        m = new_m;

#pragma unroll
        for (int r = 0; r < AT_DIMS_PER_THREAD; r++) {
            int j = tid + r * AT_THREADS;
            if (j < head_dim) {
                float a = acc[r] * alpha;
                for (int t = 0; t < len; t++) {
                    int p = c0 + t;
                    const float *vt =
                        v_cache +
                        ((size_t)block_table[p / block_size] * block_size + p % block_size) * row +
                        (size_t)kvh * head_dim;
                    a += sc[t] * vt[j];
                }
                acc[r] = a;
            }
        }
        __syncthreads(); /* the next chunk overwrites sc */
    }

    float inv = 1.0f / l;
    float *oh = out + ((size_t)i * n_head + h) * (size_t)head_dim;
#pragma unroll
    for (int r = 0; r < AT_DIMS_PER_THREAD; r++) {
        int j = tid + r * AT_THREADS;
        if (j < head_dim) oh[j] = acc[r] * inv;
    }
}

int cuk_attention(cudaStream_t st, float *out, const float *q, const float *k_cache,
                  const float *v_cache, const struct be_tokens *tk, int block_size, int n,
                  int n_head, int n_kv_head, int head_dim, int window, float scale, char *err,
                  size_t errlen)
{
    if (n <= 0 || n_head <= 0) return 0;
    if (head_dim <= 0 || head_dim > CUK_ATTN_MAX_HEAD_DIM || n_kv_head <= 0 ||
        n_head % n_kv_head != 0 || block_size <= 0 || tk->pos0 < 0) {
        if (err && errlen)
            snprintf(err, errlen,
                     "attention: unsupported shape (head_dim %d, max %d; n_head %d, n_kv_head %d; "
                     "block_size %d; pos0 %d)",
                     head_dim, CUK_ATTN_MAX_HEAD_DIM, n_head, n_kv_head, block_size, tk->pos0);
        return -1;
    }
    size_t blocks = (size_t)n * (size_t)n_head;
    if (blocks > 0x7fffffffu) {
        if (err && errlen) snprintf(err, errlen, "attention: %zu blocks exceed one grid", blocks);
        return -1;
    }
    size_t smem = sizeof(float) * ((size_t)head_dim + AT_CHUNK);
    at_attention_kernel<<<(unsigned)blocks, AT_THREADS, smem, st>>>(
        out, q, k_cache, v_cache, *tk, block_size, n_head, n_kv_head, head_dim, window, scale);
    return CUDA_LAUNCH_CHECK("at_attention_kernel", err, errlen);
}
