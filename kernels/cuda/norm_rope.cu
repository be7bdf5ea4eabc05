/* RMSNorm and rotate-half RoPE kernels of the CUDA backend. RMSNorm takes one block per row
 * (the sum of squares is a block reduction, so it differs from the CPU's sequential sum only by
 * rounding); y may alias x because every element is read before the barrier that precedes
 * the writes. RoPE takes one block per (token, head) and one thread per rotated pair. */
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"

#define NR_NORM_THREADS 256
#define NR_ROPE_THREADS 64

/* y (n, d) = x (n, d) * rsqrt(mean(x^2) + eps) * w (d); grid = n blocks. */
static __global__ void nr_rmsnorm_kernel(float *y, const float *x, const float *w, int d, float eps)
{
    __shared__ float red[32];
    size_t row = blockIdx.x;
    const float *xi = x + row * (size_t)d;
    float *yi = y + row * (size_t)d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        ss += xi[j] * xi[j];
    ss = cuk_block_sum(ss, red);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        yi[j] = w[j] * (xi[j] * inv);
}

/* x (n, n_head, head_dim) rotated in place; cos_sin (max_pos, head_dim/2, 2); grid = n*n_head. */
static __global__ void nr_rope_kernel(float *x, const int32_t *pos, int n_head, int head_dim,
                                      const float *cos_sin)
{
    size_t vec = blockIdx.x;
    size_t tok = vec / (size_t)n_head;
    int half = head_dim / 2;
    const float *cs = cos_sin + (size_t)pos[tok] * (size_t)half * 2;
    float *v = x + vec * (size_t)head_dim;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float c = cs[2 * j], s = cs[2 * j + 1];
        float a = v[j], b = v[j + half];
        v[j] = a * c - b * s;
        v[j + half] = b * c + a * s;
    }
}

int cuk_rmsnorm(cudaStream_t st, float *y, const float *x, const float *w, int n, int d, float eps,
                char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    nr_rmsnorm_kernel<<<(unsigned)n, NR_NORM_THREADS, 0, st>>>(y, x, w, d, eps);
    return CUDA_LAUNCH_CHECK("nr_rmsnorm_kernel", err, errlen);
}

int cuk_rope(cudaStream_t st, float *x, const int32_t *pos, int n, int n_head, int head_dim,
             const float *cos_sin, char *err, size_t errlen)
{
    size_t vecs = (size_t)n * (size_t)n_head;
    if (vecs == 0 || head_dim < 2) return 0;
    if (vecs > 0x7fffffffu) {
        if (err && errlen) snprintf(err, errlen, "rope: %zu vectors exceed one grid", vecs);
        return -1;
    }
    nr_rope_kernel<<<(unsigned)vecs, NR_ROPE_THREADS, 0, st>>>(x, pos, n_head, head_dim, cos_sin);
    return CUDA_LAUNCH_CHECK("nr_rope_kernel", err, errlen);
}
