/* Paged causal attention of the CUDA backend, for n tokens of one or several sequences (prefill
 * chunks and decode tokens of a whole step in one launch; struct be_tokens says where each
 * token's block table and position are). One block per (token, head). The context [start, pos] is walked
 * in chunks of AT_CHUNK positions with an online softmax: a chunk's scores go to shared memory
 * (one warp per key row, lanes across head_dim, so each key row is read coalesced), the running
 * maximum and sum are rescaled when a chunk raises the maximum, and each thread accumulates
 * AT_DIMS_PER_THREAD output dimensions in registers. Any context length takes the same path;
 * short contexts are simply one chunk. Keys and values may differ in width and row layout
 * (MLA's latent rows), and a per-head sink logit may join the denominator (gpt-oss). With
 * DeepSeek sparse attention's selection (be_attn.sel), a token walks its listed positions in
 * the same chunks instead of a contiguous range. The cache
 * is read in its stored type (kernels/kv_types.h: f32, bf16, f16, fp8 with the layer's scale,
 * int8 with its rows' scales) and converted as it is loaded. Correctness first: no tensor
 * cores, no split-K over the context (a long decode uses only n_head blocks). */
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"

#define AT_THREADS         128
#define AT_CHUNK           1024
#define AT_DIMS_PER_THREAD (CUK_ATTN_MAX_HEAD_DIM / AT_THREADS)

/* Where position p (block blk, slot) of the layer keeps KV head kvh's segment (seg elements, of
 * row_len / seg per position, head-major within the block: kv_seg_offset) and the scale its
 * elements are multiplied by. */
static __device__ inline const void *at_row(const void *base, const float *sc, enum be_kv_type t,
                                            float layer_scale, size_t blk, int slot, int bs,
                                            int row_len, int kvh, int seg, float *scale)
{
    int n_seg = row_len / seg;
    size_t es = (size_t)kv_type_size(t);
    *scale = t == BE_KV_INT8 ? sc[kv_seg_offset(blk, slot, bs, n_seg, kvh, 1)]
             : t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 ? layer_scale
                                                          : 1.0f;
    return (const char *)base + kv_seg_offset(blk, slot, bs, n_seg, kvh, seg) * es;
}

/* out: (n, n_head, v_dim), q: (n, n_head, k_dim); the layer's cache kv: K rows of k_row and V
 * rows of v_row elements per (block, slot), KV head kvh at kvh * k_dim / kvh * v_dim of a row
 * (struct be_attn); grid = n * n_head; dynamic shared memory = (k_dim + AT_CHUNK) floats. */
static __global__ void __launch_bounds__(AT_THREADS)
    at_attention_kernel(float *out, const float *q, struct be_kv kv, struct be_tokens tk,
                        int block_size, struct be_attn a)
{
    extern __shared__ float at_smem[];
    __shared__ float red[32];
    int n_head = a.n_head, head_dim = a.v_dim, window = a.window;
    float scale = a.scale;
    float *qs = at_smem;             /* (k_dim) */
    float *sc = at_smem + a.k_dim;   /* (AT_CHUNK) scores, then probabilities */

    int i = blockIdx.x / n_head;
    int h = blockIdx.x % n_head;
    int pos = tk.pos ? tk.pos[i] : tk.pos0 + i;
    const int32_t *block_table =
        tk.seq ? tk.tables + (size_t)tk.seq[i] * (size_t)tk.table_stride : tk.tables;
    int start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    if (a.chunk > 0 && pos - pos % a.chunk > start) start = pos - pos % a.chunk;
    /* the positions walked: [start, pos], or the token's selection (ascending, all <= pos) */
    const int32_t *list = a.sel && a.sel_n[i] >= 0 ? a.sel + (size_t)i * (size_t)a.sel_stride
                                                   : NULL;
    int count = list ? a.sel_n[i] : pos + 1 - start;
    int kvh = h / (n_head / a.n_kv_head);
    const float *qh = q + ((size_t)i * n_head + h) * (size_t)a.k_dim;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, n_warp = blockDim.x >> 5;

    for (int j = tid; j < a.k_dim; j += blockDim.x)
        qs[j] = qh[j];
    __syncthreads();

    float m = -INFINITY, l = 0.0f;
    float acc[AT_DIMS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < AT_DIMS_PER_THREAD; r++)
        acc[r] = 0.0f;

    for (int c0 = 0; c0 < count; c0 += AT_CHUNK) {
        int len = count - c0 < AT_CHUNK ? count - c0 : AT_CHUNK;

        for (int t = warp; t < len; t += n_warp) {
            int p = list ? list[c0 + t] : start + c0 + t;
            float ksc;
            const void *kt = at_row(kv.k, kv.k_sc, kv.type, kv.k_scale,
                                    (size_t)block_table[p / block_size], p % block_size,
                                    block_size, a.k_row, kvh, kv.k_grp, &ksc);
            float s = 0.0f;
            for (int j = lane; j < a.k_dim; j += 32)
                s += qs[j] * kv_load(kv.type, kt, j, ksc);
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
                float o = acc[r] * alpha;
                for (int t = 0; t < len; t++) {
                    int p = list ? list[c0 + t] : start + c0 + t;
                    float vsc;
                    const void *vt = at_row(kv.v, kv.v_sc, kv.type, kv.v_scale,
                                            (size_t)block_table[p / block_size], p % block_size,
                                            block_size, a.v_row, kvh, kv.v_grp, &vsc);
                    o += sc[t] * kv_load(kv.type, vt, j, vsc);
                }
                acc[r] = o;
            }
        }
        __syncthreads(); /* the next chunk overwrites sc */
    }

    /* A sink is one more logit in the denominator, with no value. */
    float rescale = 1.0f;
    if (a.sinks) {
        float sk = a.sinks[h], new_m = fmaxf(m, sk);
        rescale = expf(m - new_m);
        l = l * rescale + expf(sk - new_m);
    }
    float inv = l > 0.0f ? rescale / l : 0.0f; /* an empty selection attends to nothing */
    float *oh = out + ((size_t)i * n_head + h) * (size_t)head_dim;
#pragma unroll
    for (int r = 0; r < AT_DIMS_PER_THREAD; r++) {
        int j = tid + r * AT_THREADS;
        if (j < head_dim) oh[j] = acc[r] * inv;
    }
}

int cuk_attention(cudaStream_t st, float *out, const float *q, const struct be_kv *kv,
                  const struct be_tokens *tk, int block_size, int n, const struct be_attn *a,
                  char *err, size_t errlen)
{
    if (n <= 0 || a->n_head <= 0) return 0;
    if (a->v_dim <= 0 || a->v_dim > CUK_ATTN_MAX_HEAD_DIM || a->k_dim <= 0 ||
        a->k_dim > CUK_ATTN_MAX_K_DIM || a->n_kv_head <= 0 || a->n_head % a->n_kv_head != 0 ||
        block_size <= 0 || tk->pos0 < 0 || a->k_row < a->n_kv_head * a->k_dim ||
        a->v_row < a->n_kv_head * a->v_dim ||
        kv->k_grp <= 0 || kv->v_grp <= 0 || a->k_row % kv->k_grp || a->v_row % kv->v_grp) {
        if (err && errlen)
            snprintf(err, errlen,
                     "attention: unsupported shape (key width %d, max %d; value width %d, max %d; "
                     "n_head %d, n_kv_head %d; block_size %d; pos0 %d)",
                     a->k_dim, CUK_ATTN_MAX_K_DIM, a->v_dim, CUK_ATTN_MAX_HEAD_DIM, a->n_head,
                     a->n_kv_head, block_size, tk->pos0);
        return -1;
    }
    size_t blocks = (size_t)n * (size_t)a->n_head;
    if (blocks > 0x7fffffffu) {
        if (err && errlen) snprintf(err, errlen, "attention: %zu blocks exceed one grid", blocks);
        return -1;
    }
    size_t smem = sizeof(float) * ((size_t)a->k_dim + AT_CHUNK);
    at_attention_kernel<<<(unsigned)blocks, AT_THREADS, smem, st>>>(out, q, *kv, *tk, block_size,
                                                                    *a);
    return CUDA_LAUNCH_CHECK("at_attention_kernel", err, errlen);
}
