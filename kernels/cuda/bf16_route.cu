/* bf16 and routing kernels of the CUDA backend: f32 <-> bf16 conversion of GEMM inputs and
 * outputs (the weights are bf16, cuBLAS wants both operands in one type), SwiGLU on the bf16
 * expert activations, the embedding lookup from a bf16 table, and the router's top-k choice,
 * one thread per token, with the very code the CPU backend runs (kernels/route_impl.h). */
#include <cuda_bf16.h>

#include "cuda_check.h"
#include "cuda_kernels.h"
#include "route_impl.h"

#define BR_THREADS 256

/* Element conversion, f32 <-> bf16 (round to nearest even going down). */
static __device__ inline void br_cvt(__nv_bfloat16 *d, float s)
{
    *d = __float2bfloat16_rn(s);
}

static __device__ inline void br_cvt(float *d, __nv_bfloat16 s)
{
    *d = __bfloat162float(s);
}

/* dst[i] = src[i] for the `total` elements of rows of k: source rows ld apart (ld == k:
 * contiguous), destination contiguous. */
template <typename D, typename S>
static __global__ void br_convert_kernel(D *dst, const S *src, size_t total, size_t k, size_t ld)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        br_cvt(&dst[i], src[ld == k ? i : i / k * ld + i % k]);
}

template <typename D, typename S>
static int br_convert(cudaStream_t st, D *dst, const S *src, size_t total, char *err,
                      size_t errlen)
{
    if (total == 0) return 0;
    br_convert_kernel<D, S><<<cuk_blocks(total, BR_THREADS), BR_THREADS, 0, st>>>(dst, src, total,
                                                                                 total, total);
    return CUDA_LAUNCH_CHECK("br_convert_kernel", err, errlen);
}

int cuk_to_bf16_ld(cudaStream_t st, void *dst, const float *src, int n, int k, int ld, char *err,
                   size_t errlen)
{
    size_t total = (size_t)n * (size_t)k;
    if (total == 0) return 0;
    br_convert_kernel<__nv_bfloat16, float><<<cuk_blocks(total, BR_THREADS), BR_THREADS, 0, st>>>(
        (__nv_bfloat16 *)dst, src, total, (size_t)k, (size_t)ld);
    return CUDA_LAUNCH_CHECK("br_convert_kernel", err, errlen);
}

int cuk_to_bf16(cudaStream_t st, void *dst, const float *src, size_t total, char *err,
                size_t errlen)
{
    return br_convert(st, (__nv_bfloat16 *)dst, src, total, err, errlen);
}

int cuk_bf16_to_f32(cudaStream_t st, float *dst, const void *src, size_t total, char *err,
                    size_t errlen)
{
    return br_convert(st, dst, (const __nv_bfloat16 *)src, total, err, errlen);
}

/* out = silu(gate) * up on bf16 arrays, computed in f32 as the CPU's SwiGLU. */
static __global__ void br_swiglu_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *gate,
                                        const __nv_bfloat16 *up, size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = __bfloat162float(gate[i]);
        out[i] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * __bfloat162float(up[i]));
    }
}

int cuk_swiglu_bf16(cudaStream_t st, void *out, const void *gate, const void *up, size_t total,
                    char *err, size_t errlen)
{
    if (total == 0) return 0;
    br_swiglu_kernel<<<cuk_blocks(total, BR_THREADS), BR_THREADS, 0, st>>>(
        (__nv_bfloat16 *)out, (const __nv_bfloat16 *)gate, (const __nv_bfloat16 *)up, total);
    return CUDA_LAUNCH_CHECK("br_swiglu_kernel", err, errlen);
}

/* One expert's hidden rows (rows, ff) of bf16 gate and up with optional per-column biases and
 * the activation act (enum be_act: SiLU, gpt-oss's clamped SwiGLU or DeepSeek-V4's clamped
 * SiLU; the CPU's order of operations), written over gate. */
static __global__ void br_expert_act_kernel(__nv_bfloat16 *gate, const __nv_bfloat16 *up,
                                            size_t total, int ff, const float *b_gate,
                                            const float *b_up, int act, float alpha, float limit)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(i % (size_t)ff);
        float g = __bfloat162float(gate[i]), u = __bfloat162float(up[i]);
        if (b_gate) g += b_gate[c];
        if (b_up) u += b_up[c];
        float h;
        if (act == BE_ACT_SWIGLU_OAI) {
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : u > limit ? limit : u;
            h = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
        } else if (act == BE_ACT_SILU_CLAMP) {
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : u > limit ? limit : u;
            h = g / (1.0f + expf(-g)) * u;
        } else {
            h = g / (1.0f + expf(-g)) * u;
        }
        gate[i] = __float2bfloat16_rn(h);
    }
}

int cuk_expert_act_bf16(cudaStream_t st, void *gate, const void *up, int rows, int ff,
                        const float *b_gate, const float *b_up, int act, float alpha, float limit,
                        char *err, size_t errlen)
{
    size_t total = (size_t)rows * (size_t)ff;
    if (total == 0) return 0;
    br_expert_act_kernel<<<cuk_blocks(total, BR_THREADS), BR_THREADS, 0, st>>>(
        (__nv_bfloat16 *)gate, (const __nv_bfloat16 *)up, total, ff, b_gate, b_up, act, alpha,
        limit);
    return CUDA_LAUNCH_CHECK("br_expert_act_kernel", err, errlen);
}

/* out (n, d) = table[ids[i]] widened to f32; grid = n. */
static __global__ void br_embed_kernel(float *out, const __nv_bfloat16 *table, const int32_t *ids,
                                       int d)
{
    size_t i = blockIdx.x;
    const __nv_bfloat16 *row = table + (size_t)ids[i] * (size_t)d;
    float *o = out + i * (size_t)d;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = __bfloat162float(row[c]);
}

int cuk_embed_bf16(cudaStream_t st, float *out, const void *table, const int32_t *ids, int n,
                   int d, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    br_embed_kernel<<<(unsigned)n, BR_THREADS, 0, st>>>(out, (const __nv_bfloat16 *)table, ids,
                                                         d);
    return CUDA_LAUNCH_CHECK("br_embed_kernel", err, errlen);
}

/* One thread per token; the rule's scratch lives in the thread's local memory. */
static __global__ void br_route_kernel(int32_t *idx, float *w, const float *logits,
                                       const float *glog, const int32_t *tok_k, int n,
                                       struct be_route r)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) route_token(&r, logits, glog, tok_k, t, idx, w);
}

int cuk_route(cudaStream_t st, int32_t *idx, float *w, const float *logits, const float *glog,
              const int32_t *tok_k, int n, const struct be_route *r, char *err, size_t errlen)
{
    if (n <= 0) return 0;
    if (r->n_expert < 1 || r->n_expert > ROUTE_MAX_EXPERTS || r->top_k < 1 ||
        r->top_k > r->n_expert ||
        (r->kind != BE_ROUTE_SOFTMAX_TOPK && r->kind != BE_ROUTE_SIGMOID_TOPK &&
         (r->n_group < 1 || r->n_group > ROUTE_MAX_GROUPS || r->n_expert % r->n_group != 0 ||
          r->topk_group < 1 || r->topk_group > r->n_group)) ||
        (r->kind == BE_ROUTE_SIGMOID_GROUP && !r->bias)) {
        snprintf(err, errlen, "route: unsupported shape (%d experts, top-%d, %d groups, top-%d)",
                 r->n_expert, r->top_k, r->n_group, r->topk_group);
        return -1;
    }
    /* Small blocks: each thread carries ~3 KB of local arrays. */
    int threads = 64;
    br_route_kernel<<<(unsigned)((n + threads - 1) / threads), threads, 0, st>>>(idx, w, logits,
                                                                                 glog, tok_k, n,
                                                                                 *r);
    return CUDA_LAUNCH_CHECK("br_route_kernel", err, errlen);
}
