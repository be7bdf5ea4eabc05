/* The continuous-experts FFN of the CUDA backend (backend.h neuron_ffn, infmoe models): each
 * token computes only the neurons the host selected for it. Two passes, each output written by
 * one thread in a fixed order (no atomics), so results do not depend on the launch shape:
 *   1. one warp per (token, neuron): the gate and up rows (bf16, contiguous) dotted with the
 *      token's row, reduced across the warp, times silu and the neuron's summed weight, into
 *      hbuf;
 *   2. one block per token, threads across the output columns: the weighted sum of the
 *      selected rows of the neuron-major down matrix, in the selection's order (reads of one
 *      row are coalesced across the block).
 * The CPU reference is kernels/cpu/backend_cpu.c (cpu_neuron_ffn); tests/test_backend_ops.c
 * compares the two on a GPU. */
#include <cuda_bf16.h>

#include "cuda_check.h"
#include "cuda_kernels.h"

#define NF_THREADS 256
#define NF_WARPS   (NF_THREADS / 32)

/* grid (n, ceil(stride / NF_WARPS)); warp w of block (i, b) takes neuron j = b * NF_WARPS + w. */
static __global__ void nf_up_kernel(float *hbuf, const float *x, const __nv_bfloat16 *gate,
                                    const __nv_bfloat16 *up, const int32_t *idx, const float *coef,
                                    const int32_t *count, int stride, int d)
{
    int i = blockIdx.x, lane = threadIdx.x % 32;
    int j = blockIdx.y * NF_WARPS + threadIdx.x / 32;
    if (j >= count[i]) return; /* the whole warp: j is the same for its lanes */
    size_t base = (size_t)i * (size_t)stride;
    size_t f = (size_t)idx[base + j];
    const float *xi = x + (size_t)i * (size_t)d;
    const __nv_bfloat16 *g = gate + f * (size_t)d, *u = up + f * (size_t)d;
    float sg = 0.0f, su = 0.0f;
    for (int c = lane; c < d; c += 32) {
        float xv = xi[c];
        sg += __bfloat162float(g[c]) * xv;
        su += __bfloat162float(u[c]) * xv;
    }
    for (int o = 16; o > 0; o >>= 1) {
        sg += __shfl_xor_sync(0xffffffffu, sg, o);
        su += __shfl_xor_sync(0xffffffffu, su, o);
    }
    if (lane == 0) hbuf[base + j] = coef[base + j] * (sg / (1.0f + expf(-sg))) * su;
}

/* grid n: y[i, c] = sum over j < count[i] of hbuf[i, j] * down_t[idx[i, j], c], j ascending. */
static __global__ void nf_down_kernel(float *y, const float *hbuf, const __nv_bfloat16 *down_t,
                                      const int32_t *idx, const int32_t *count, int stride, int d)
{
    int i = blockIdx.x;
    size_t base = (size_t)i * (size_t)stride;
    int cnt = count[i];
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < cnt; j++)
            acc += hbuf[base + j] * __bfloat162float(down_t[(size_t)idx[base + j] * (size_t)d + c]);
        y[(size_t)i * (size_t)d + c] = acc;
    }
}

int cuk_neuron_ffn(cudaStream_t st, float *y, const float *x, int n, int d, const void *gate,
                   const void *up, const void *down_t, const int32_t *idx, const float *coef,
                   const int32_t *count, int stride, float *hbuf, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0 || stride <= 0) return 0;
    dim3 grid((unsigned)n, (unsigned)((stride + NF_WARPS - 1) / NF_WARPS));
    nf_up_kernel<<<grid, NF_THREADS, 0, st>>>(hbuf, x, (const __nv_bfloat16 *)gate,
                                              (const __nv_bfloat16 *)up, idx, coef, count, stride,
                                              d);
    if (CUDA_LAUNCH_CHECK("nf_up_kernel", err, errlen) < 0) return -1;
    nf_down_kernel<<<(unsigned)n, NF_THREADS, 0, st>>>(y, hbuf, (const __nv_bfloat16 *)down_t, idx,
                                                       count, stride, d);
    return CUDA_LAUNCH_CHECK("nf_down_kernel", err, errlen);
}
