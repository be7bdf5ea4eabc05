/* RMSNorm, LayerNorm and RoPE (rotate-half or interleaved pairs) kernels of the CUDA backend.
 * The norms take one block per row (the sums are block reductions, so they differ from the
 * CPU's sequential sums only by rounding); y may alias x because every element is read before
 * the barrier that precedes the writes. RoPE takes one block per (token, head) and one thread per rotated pair. */
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"

#define NR_NORM_THREADS 256
#define NR_ROPE_THREADS 64

/* y (n, d) = x (n, d) * rsqrt(mean(x^2) + eps) * w (d), rows ld floats apart; grid = n
 * blocks. */
static __global__ void nr_rmsnorm_kernel(float *y, const float *x, const float *w, int d, int ld,
                                         float eps)
{
    __shared__ float red[32];
    size_t row = blockIdx.x;
    const float *xi = x + row * (size_t)ld;
    float *yi = y + row * (size_t)ld;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        ss += xi[j] * xi[j];
    ss = cuk_block_sum(ss, red);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        yi[j] = w[j] * (xi[j] * inv);
}

/* y (n, d; rows ldy apart) = (x - mean) / sqrt(var + eps) * w + b of x (rows ldx apart), the
 * variance taken about the mean in a second pass as the CPU does; grid = n blocks. */
static __global__ void nr_layernorm_kernel(float *y, int ldy, const float *x, int ldx,
                                           const float *w, const float *b, int d, float eps)
{
    __shared__ float red[32];
    size_t row = blockIdx.x;
    const float *xi = x + row * (size_t)ldx;
    float *yi = y + row * (size_t)ldy;
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        s += xi[j];
    float mean = cuk_block_sum(s, red) / (float)d, ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        ss += (xi[j] - mean) * (xi[j] - mean);
    float inv = 1.0f / sqrtf(cuk_block_sum(ss, red) / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        yi[j] = (xi[j] - mean) * inv * w[j] + b[j];
}

/* rot_dim values of each (token, head) vector of x (x_stride apart) rotated into y (y_stride
 * apart); pairs (j, j + rot_dim/2), or (2j, 2j + 1) when interleave; cos_sin
 * (max_pos, rot_dim/2, 2); grid = n*n_head. */
static __global__ void nr_rope_kernel(float *y, int y_stride, const float *x, int x_stride,
                                      const int32_t *pos, int n_head, int rot_dim, int interleave,
                                      const float *cos_sin)
{
    size_t vec = blockIdx.x;
    size_t tok = vec / (size_t)n_head;
    int half = rot_dim / 2;
    int step = interleave ? 2 : 1, other = interleave ? 1 : half;
    const float *cs = cos_sin + (size_t)pos[tok] * (size_t)half * 2;
    const float *u = x + vec * (size_t)x_stride;
    float *v = y + vec * (size_t)y_stride;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float c = cs[2 * j], s = cs[2 * j + 1];
        float a = u[j * step], b = u[j * step + other];
        v[j * step] = a * c - b * s;
        v[j * step + other] = b * c + a * s;
    }
}

int cuk_rmsnorm(cudaStream_t st, float *y, const float *x, const float *w, int n, int d, float eps,
                char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    nr_rmsnorm_kernel<<<(unsigned)n, NR_NORM_THREADS, 0, st>>>(y, x, w, d, d, eps);
    return CUDA_LAUNCH_CHECK("nr_rmsnorm_kernel", err, errlen);
}

int cuk_rmsnorm_ld(cudaStream_t st, float *y, const float *x, const float *w, int n, int d, int ld,
                   float eps, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    nr_rmsnorm_kernel<<<(unsigned)n, NR_NORM_THREADS, 0, st>>>(y, x, w, d, ld, eps);
    return CUDA_LAUNCH_CHECK("nr_rmsnorm_kernel", err, errlen);
}

int cuk_layernorm_ld(cudaStream_t st, float *y, int ldy, const float *x, int ldx, const float *w,
                     const float *b, int n, int d, float eps, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    nr_layernorm_kernel<<<(unsigned)n, NR_NORM_THREADS, 0, st>>>(y, ldy, x, ldx, w, b, d, eps);
    return CUDA_LAUNCH_CHECK("nr_layernorm_kernel", err, errlen);
}

int cuk_rope_ex(cudaStream_t st, float *y, int y_stride, const float *x, int x_stride,
                const int32_t *pos, int n, int n_head, int rot_dim, int interleave,
                const float *cos_sin, char *err, size_t errlen)
{
    size_t vecs = (size_t)n * (size_t)n_head;
    if (vecs == 0 || rot_dim < 2) return 0;
    if (vecs > 0x7fffffffu) {
        if (err && errlen) snprintf(err, errlen, "rope: %zu vectors exceed one grid", vecs);
        return -1;
    }
    nr_rope_kernel<<<(unsigned)vecs, NR_ROPE_THREADS, 0, st>>>(y, y_stride, x, x_stride, pos,
                                                               n_head, rot_dim, interleave,
                                                               cos_sin);
    return CUDA_LAUNCH_CHECK("nr_rope_kernel", err, errlen);
}

int cuk_rope(cudaStream_t st, float *x, const int32_t *pos, int n, int n_head, int head_dim,
             const float *cos_sin, char *err, size_t errlen)
{
    return cuk_rope_ex(st, x, head_dim, x, head_dim, pos, n, n_head, head_dim, 0, cos_sin, err,
                       errlen);
}
