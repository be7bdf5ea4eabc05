/* Launchers of the CUDA backend's kernels, one .cu per op family (elementwise.cu, norm_rope.cu,
 * rows.cu, attention.cu, dsa.cu, ...). Each launcher issues its kernel on `stream`, checks the
 * launch, and returns 0, or -1 with the reason in err. Arguments follow the matching op of
 * kernels/backend.h (device pointers throughout); sizes are validated by the caller
 * (backend_cuda.cu) except where a launcher names its own limit. Internal to kernels/cuda. */
#ifndef MOESERVE_CUDA_KERNELS_H
#define MOESERVE_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* Blocks for a grid-stride loop over `total` items, `threads` per block: enough to fill any
 * current GPU, capped so the count fits gridDim.x. */
static inline unsigned cuk_blocks(size_t total, int threads)
{
    size_t b = (total + (size_t)threads - 1) / (size_t)threads;
    if (b > 65536) b = 65536;
    return b ? (unsigned)b : 1u;
}

#ifdef __CUDACC__
/* Block-wide reductions for kernels whose blockDim.x is a multiple of 32 (<= 1024): every thread
 * passes its value and gets the block's result. `red` is 32 floats of shared memory; the calls
 * contain __syncthreads(), so all threads of the block must make them. */
__device__ static inline float cuk_block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warp = blockDim.x >> 5;
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warp ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ static inline float cuk_block_max(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warp = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warp ? red[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
#endif

/* elementwise.cu */
int cuk_add_bias(cudaStream_t st, float *y, const float *bias, int n, int m, char *err,
                 size_t errlen); /* y (n, m) += bias (m) */
int cuk_add(cudaStream_t st, float *y, const float *x, size_t total, char *err, size_t errlen);
int cuk_clamp(cudaStream_t st, float *x, size_t total, float c, char *err, size_t errlen);
int cuk_swiglu(cudaStream_t st, float *out, const float *gate, const float *up, size_t total,
               char *err, size_t errlen);
int cuk_add_scaled_rows(cudaStream_t st, float *y, const float *x, const float *s, int n, int d,
                        int sigmoid, char *err, size_t errlen);

/* norm_rope.cu */
int cuk_rmsnorm(cudaStream_t st, float *y, const float *x, const float *w, int n, int d, float eps,
                char *err, size_t errlen);
int cuk_rope(cudaStream_t st, float *x, const int32_t *pos, int n, int n_head, int head_dim,
             const float *cos_sin, char *err, size_t errlen);
/* rows ld floats apart, the first d of each normed (backend.h rmsnorm_ld) */
int cuk_rmsnorm_ld(cudaStream_t st, float *y, const float *x, const float *w, int n, int d, int ld,
                   float eps, char *err, size_t errlen);
/* backend.h layernorm_ld */
int cuk_layernorm_ld(cudaStream_t st, float *y, int ldy, const float *x, int ldx, const float *w,
                     const float *b, int n, int d, float eps, char *err, size_t errlen);
/* backend.h rope_ex */
int cuk_rope_ex(cudaStream_t st, float *y, int y_stride, const float *x, int x_stride,
                const int32_t *pos, int n, int n_head, int rot_dim, int interleave,
                const float *cos_sin, char *err, size_t errlen);

/* ssm.cu: backend.h gather_cols, mul_sigmoid and scale (over total elements), gdn and mamba2,
 * whose sequences
 * are the device table seq of ns (tok0, n_tok, slot, fresh) entries over n_tok tokens */
int cuk_gather_cols(cudaStream_t st, float *y, int ldy, const float *x, int ldx,
                    const int32_t *idx, int n, int m, char *err, size_t errlen);
int cuk_mul_sigmoid(cudaStream_t st, float *y, const float *g, size_t total, char *err,
                    size_t errlen);
int cuk_gdn(cudaStream_t st, float *out, float *qkv, const float *z, float *b, float *a,
            const struct be_gdn *g, const int32_t *seq, int ns, int n_tok, char *err,
            size_t errlen);
int cuk_mamba2(cudaStream_t st, float *out, float *xbc, const float *z, float *dt,
               const struct be_mamba *m, const int32_t *seq, int ns, int n_tok, char *err,
               size_t errlen);
int cuk_scale(cudaStream_t st, float *x, size_t total, float s, char *err, size_t errlen);
int cuk_mul_rows(cudaStream_t st, float *x, const float *s, int n, int d, char *err,
                 size_t errlen);

/* rows.cu */
int cuk_gather_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n, int d,
                    char *err, size_t errlen);
int cuk_scatter_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n,
                     int d, char *err, size_t errlen);
int cuk_moe_combine(cudaStream_t st, float *out, const float *rows, const int32_t *idx,
                    const float *w, int n, int k, int d, char *err, size_t errlen);
/* k/v rows (n, row) into the layer's cache, converted to its type (v NULL: k only) */
int cuk_kv_write(cudaStream_t st, const struct be_kv *kv, const float *k, const float *v,
                 const struct be_tokens *tk, int block_size, int n, int row, char *err,
                 size_t errlen);

/* neuron_ffn.cu: backend.h neuron_ffn; gate, up and down_t are (F, d) bf16 arrays */
int cuk_neuron_ffn(cudaStream_t st, float *y, const float *x, int n, int d, const void *gate,
                   const void *up, const void *down_t, const int32_t *idx, const float *coef,
                   const int32_t *count, int stride, float *hbuf, char *err, size_t errlen);

/* bf16_route.cu. dst of cuk_to_bf16 and the embedding table are bf16 (__nv_bfloat16) arrays. */
struct be_route;
int cuk_to_bf16(cudaStream_t st, void *dst, const float *src, size_t total, char *err,
                size_t errlen);
/* dst (n, k) bf16 contiguous from src (n, k) f32 with rows ld floats apart */
int cuk_to_bf16_ld(cudaStream_t st, void *dst, const float *src, int n, int k, int ld, char *err,
                   size_t errlen);
int cuk_bf16_to_f32(cudaStream_t st, float *dst, const void *src, size_t total, char *err,
                    size_t errlen);
int cuk_swiglu_bf16(cudaStream_t st, void *out, const void *gate, const void *up, size_t total,
                    char *err, size_t errlen);
/* gate (rows, ff) = act(gate + b_gate, up + b_up), bf16 in and out (biases f32 or NULL); act
 * an enum be_act: SiLU, gpt-oss's clamped SwiGLU or DeepSeek-V4's clamped SiLU. */
int cuk_expert_act_bf16(cudaStream_t st, void *gate, const void *up, int rows, int ff,
                        const float *b_gate, const float *b_up, int act, float alpha, float limit,
                        char *err, size_t errlen);
int cuk_embed_bf16(cudaStream_t st, float *out, const void *table, const int32_t *ids, int n,
                   int d, char *err, size_t errlen);
int cuk_route(cudaStream_t st, int32_t *idx, float *w, const float *logits, const float *glog,
              const int32_t *tok_k, int n, const struct be_route *r, char *err, size_t errlen);

/* attention.cu; head_dim (value width) <= CUK_ATTN_MAX_HEAD_DIM, key width <= CUK_ATTN_MAX_K_DIM
 * (MLA: kv_lora_rank + qk_rope_dim = 576 for DeepSeek-V3). */
#define CUK_ATTN_MAX_HEAD_DIM 512
#define CUK_ATTN_MAX_K_DIM 4096
int cuk_attention(cudaStream_t st, float *out, const float *q, const struct be_kv *kv,
                  const struct be_tokens *tk, int block_size, int n, const struct be_attn *a,
                  char *err, size_t errlen);

/* dsa.cu: backend.h dsa_select (DeepSeek-V4's compressed entries too: be_dsa.rate > 1), with a
 * scratch of `rows` tokens' scores of max_ctx floats each (a call of more tokens runs in
 * launches of `rows`) */
int cuk_dsa_select(cudaStream_t st, int32_t *sel, int32_t *sel_n, const float *q, const float *w,
                   const struct be_kv *kv, const struct be_tokens *tk, int block_size, int n,
                   const struct be_dsa *p, float *scores, int rows, int max_ctx, char *err,
                   size_t errlen);

/* v4.cu: backend.h hc_pre, hc_post, v4_compress, v4_attention (DeepSeek-V4). n_stream <=
 * CUK_V4_MAX_STREAMS (the config parser's bound), an attention head <= CUK_V4_MAX_DIM wide, a
 * compressed entry <= CUK_V4_MAX_ENTRY channels (V4-Flash: 512 and 128). No scratch. */
#define CUK_V4_MAX_STREAMS 16
#define CUK_V4_MAX_DIM 512
#define CUK_V4_MAX_ENTRY 8192
int cuk_hc_pre(cudaStream_t st, float *post, float *comb, float *y, const float *x,
               const float *mix, int n, int d, const struct be_hc *h, char *err, size_t errlen);
int cuk_hc_post(cudaStream_t st, float *y, const float *x, const float *out, const float *post,
                const float *comb, int n, int d, int n_stream, char *err, size_t errlen);
int cuk_v4_compress(cudaStream_t st, float *out, int ldo, const struct be_kv *kv,
                    const struct be_tokens *tk, int block_size, int n, const struct be_v4cmp *p,
                    char *err, size_t errlen);
int cuk_v4_attention(cudaStream_t st, float *out, const float *q, const struct be_kv *kv,
                     const struct be_tokens *tk, int block_size, int n, const struct be_v4attn *a,
                     char *err, size_t errlen);

#endif
