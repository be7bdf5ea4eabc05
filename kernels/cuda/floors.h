/* Roofline floors of one GPU, measured where the benchmark runs: the HBM read bandwidth a kernel
 * actually reaches, the device-to-device copy bandwidth, and the dense bf16 GEMM rate cuBLAS
 * reaches. The GPU benchmarks set a MoE layer's measured time against the floor those rates
 * imply (moe_floor_seconds), so a claim like "at 80% of the bandwidth floor" rests on numbers
 * from the same machine and run, not on a datasheet.
 *
 * Every measurement function makes `device` current for its duration and restores the caller's
 * current device before it returns. Each allocates its buffers, times `reps` runs after a
 * warm-up with CUDA events on a private stream, checks the result against a host reference
 * (so a broken kernel cannot report a rate), frees everything on every path, and reports the
 * BEST rep (the floor is the fastest the hardware was seen to go, not a typical run). They
 * return 0, or -1 with a reason in err (no GPU, bad argument, out of memory, a failed CUDA or
 * cuBLAS call, a wrong result); *OUT is written only on success. They synchronize the device
 * and are not for use while other work shares it: they measure the whole GPU.
 *
 * This header is plain C (no CUDA headers) so C code includes it in every build; the functions
 * exist only when the CUDA library is built (MOESERVE_HAVE_CUDA), moe_floor_seconds always. */
#ifndef MOESERVE_CUDA_FLOORS_H
#define MOESERVE_CUDA_FLOORS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What the floors were measured on. */
struct cuda_floor_device {
    char name[256];
    int sm_count;
    size_t l2_bytes;
    size_t mem_bytes;
    double peak_hbm_gbps; /* datasheet-style peak from memory clock x bus width; 0 if unknown */
};

int cuda_floor_device_info(int device, struct cuda_floor_device *out /* OUT */, char *err,
                           size_t errlen);

/* Achievable HBM read bandwidth in GB/s (1e9 bytes/s): a vectorized grid-stride kernel reads a
 * buffer of `bytes` (rounded down to a multiple of 16) and sums it. `bytes` must be at least
 * four times the L2 cache, or the number would be the cache's; 2 GiB is a good size. */
int cuda_floor_hbm(int device, size_t bytes, int reps, double *gbps /* OUT */, char *err,
                   size_t errlen);

/* Device-to-device cudaMemcpyAsync bandwidth in GB/s, counting both the bytes read and the
 * bytes written (2 x `bytes` per copy); allocates two buffers of `bytes`. A bound for layers
 * that stream data through (gather/scatter of token rows), not a second read floor. */
int cuda_floor_copy(int device, size_t bytes, int reps, double *gbps /* OUT */, char *err,
                    size_t errlen);

/* Achievable dense bf16 rate in TFLOP/s (1e12 FLOP/s, 2*m*n*k per GEMM): cublasGemmEx with bf16
 * A (m, k), B (k, n) and C (m, n), f32 accumulation, the default algorithm. Needs
 * 2*(m*k + k*n + m*n) bytes of device memory; 8192^3 is large enough to reach the plateau. */
int cuda_floor_bf16_gemm(int device, int m, int n, int k, int reps, double *tflops /* OUT */,
                         char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

/* Lower bound in seconds for work that reads `bytes` from HBM and does `flops` of bf16 math:
 * it cannot beat either resource, so the floor is the larger of the two times (the work may
 * overlap them perfectly, hence max, not sum). A rate <= 0 means "not measured" and drops its
 * term; with neither measured the floor is 0. */
static inline double moe_floor_seconds(double bytes, double flops, double gbps, double tflops)
{
    double t_mem = gbps > 0 ? bytes / (gbps * 1e9) : 0;
    double t_math = tflops > 0 ? flops / (tflops * 1e12) : 0;
    return t_mem > t_math ? t_mem : t_math;
}

#endif
