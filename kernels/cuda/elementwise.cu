/* Elementwise kernels of the CUDA backend: bias add, residual add, clamp, SwiGLU, scaled
 * residual rows. All are memory-bound grid-stride loops; the arithmetic is written as in
 * the CPU reference (expf, not __expf; same operation order) so results agree to rounding. */
#include "cuda_check.h"
#include "cuda_kernels.h"

#define EW_THREADS 256

static __global__ void ew_add_bias_kernel(float *y, const float *bias, size_t total, int m)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % (size_t)m];
}

static __global__ void ew_add_kernel(float *y, const float *x, size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

static __global__ void ew_clamp_kernel(float *x, size_t total, float c)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        /* Same comparisons as the CPU: NaN stays NaN. */
        x[i] = v < -c ? -c : (v > c ? c : v);
    }
}

static __global__ void ew_swiglu_kernel(float *out, const float *gate, const float *up,
                                        size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static __global__ void ew_add_scaled_rows_kernel(float *y, const float *x, const float *s,
                                                 size_t total, int d, int sigmoid)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float si = s[i / (size_t)d];
        float f = sigmoid ? 1.0f / (1.0f + expf(-si)) : si;
        y[i] += f * x[i];
    }
}

int cuk_add_bias(cudaStream_t st, float *y, const float *bias, int n, int m, char *err,
                 size_t errlen)
{
    size_t total = (size_t)n * (size_t)m;
    if (total == 0) return 0;
    ew_add_bias_kernel<<<cuk_blocks(total, EW_THREADS), EW_THREADS, 0, st>>>(y, bias, total, m);
    return CUDA_LAUNCH_CHECK("ew_add_bias_kernel", err, errlen);
}

int cuk_add(cudaStream_t st, float *y, const float *x, size_t total, char *err, size_t errlen)
{
    if (total == 0) return 0;
    ew_add_kernel<<<cuk_blocks(total, EW_THREADS), EW_THREADS, 0, st>>>(y, x, total);
    return CUDA_LAUNCH_CHECK("ew_add_kernel", err, errlen);
}

int cuk_clamp(cudaStream_t st, float *x, size_t total, float c, char *err, size_t errlen)
{
    if (total == 0) return 0;
    ew_clamp_kernel<<<cuk_blocks(total, EW_THREADS), EW_THREADS, 0, st>>>(x, total, c);
    return CUDA_LAUNCH_CHECK("ew_clamp_kernel", err, errlen);
}

int cuk_swiglu(cudaStream_t st, float *out, const float *gate, const float *up, size_t total,
               char *err, size_t errlen)
{
    if (total == 0) return 0;
    ew_swiglu_kernel<<<cuk_blocks(total, EW_THREADS), EW_THREADS, 0, st>>>(out, gate, up, total);
    return CUDA_LAUNCH_CHECK("ew_swiglu_kernel", err, errlen);
}

int cuk_add_scaled_rows(cudaStream_t st, float *y, const float *x, const float *s, int n, int d,
                        int sigmoid, char *err, size_t errlen)
{
    size_t total = (size_t)n * (size_t)d;
    if (total == 0) return 0;
    ew_add_scaled_rows_kernel<<<cuk_blocks(total, EW_THREADS), EW_THREADS, 0, st>>>(y, x, s, total,
                                                                                    d, sigmoid);
    return CUDA_LAUNCH_CHECK("ew_add_scaled_rows_kernel", err, errlen);
}
