/* Roofline floors of the GPU the benchmarks run on (floors.h): an HBM read kernel, a
 * device-to-device copy and a cuBLAS bf16 GEMM, each timed rep by rep with CUDA events on a
 * private stream and checked against a host reference before its rate is believed. The buffers
 * are filled on the device (an index pattern, a hash of the index) so no large host transfer
 * ever happens and the host can recompute any element. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>

#include "common.h"
#include "cuda_check.h"
#include "floors.h"

#define FL_THREADS 256 /* per block, every kernel here; the read kernel's reduction assumes it */

/* One measurement's device state; fl_begin acquires it, fl_end releases whatever exists. */
struct fl_run {
    int prev_device; /* the caller's current device, restored by fl_end; -1 if unknown */
    int device;
    cudaStream_t stream;
    cudaEvent_t start, stop;
};

static int fl_begin(struct fl_run *run, int device, int reps, char *err, size_t errlen)
{
    memset(run, 0, sizeof *run);
    run->prev_device = -1;
    run->device = device;
    if (reps < 1) return ms_errf(err, errlen, "floors: reps must be >= 1 (got %d)", reps);
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count < 1) {
        (void)cudaGetLastError(); /* not sticky; keep it out of later launch checks */
        return ms_errf(err, errlen, "floors: no CUDA device: %s",
                       rc != cudaSuccess ? cudaGetErrorString(rc) : "device count is 0");
    }
    if (device < 0 || device >= count)
        return ms_errf(err, errlen, "floors: device %d out of range (%d device%s)", device, count,
                       count == 1 ? "" : "s");
    if (CUDA_CHECK(cudaGetDevice(&run->prev_device), err, errlen) < 0) return -1;
    if (CUDA_CHECK(cudaSetDevice(device), err, errlen) < 0) return -1;
    if (CUDA_CHECK(cudaStreamCreateWithFlags(&run->stream, cudaStreamNonBlocking), err, errlen) < 0)
        return -1;
    if (CUDA_CHECK(cudaEventCreate(&run->start), err, errlen) < 0) return -1;
    if (CUDA_CHECK(cudaEventCreate(&run->stop), err, errlen) < 0) return -1;
    return 0;
}

/* Frees `p` (device memory, may be NULL) as part of cleanup: a failure is reported only when
 * nothing failed before (*rc == 0), so err keeps the first reason. */
static void fl_free(void *p, int *rc, char *err, size_t errlen)
{
    if (p && CUDA_CHECK(cudaFree(p), *rc < 0 ? NULL : err, errlen) < 0) *rc = -1;
}

/* Releases the run's stream and events and restores the caller's device; returns the final
 * status (rc, or -1 when only the cleanup failed). */
static int fl_end(struct fl_run *run, int rc, char *err, size_t errlen)
{
    if (run->stop && CUDA_CHECK(cudaEventDestroy(run->stop), rc < 0 ? NULL : err, errlen) < 0)
        rc = -1;
    if (run->start && CUDA_CHECK(cudaEventDestroy(run->start), rc < 0 ? NULL : err, errlen) < 0)
        rc = -1;
    if (run->stream && CUDA_CHECK(cudaStreamDestroy(run->stream), rc < 0 ? NULL : err, errlen) < 0)
        rc = -1;
    if (run->prev_device >= 0 && run->prev_device != run->device &&
        CUDA_CHECK(cudaSetDevice(run->prev_device), rc < 0 ? NULL : err, errlen) < 0)
        rc = -1;
    return rc;
}

static int fl_rep_start(struct fl_run *run, char *err, size_t errlen)
{
    return CUDA_CHECK(cudaEventRecord(run->start, run->stream), err, errlen);
}

/* Ends a timed rep: waits for it and lowers *best_ms to its time when faster. */
static int fl_rep_stop(struct fl_run *run, float *best_ms, char *err, size_t errlen)
{
    float ms = 0;
    if (CUDA_CHECK(cudaEventRecord(run->stop, run->stream), err, errlen) < 0) return -1;
    if (CUDA_CHECK(cudaEventSynchronize(run->stop), err, errlen) < 0) return -1;
    if (CUDA_CHECK(cudaEventElapsedTime(&ms, run->start, run->stop), err, errlen) < 0) return -1;
    if (ms < *best_ms) *best_ms = ms;
    return 0;
}

/* Blocks for a grid-stride kernel over `total` items: enough to fill every SM, no more than
 * the items need. */
static unsigned int fl_blocks(size_t total, int per_sm, int sm_count)
{
    size_t want = (total + FL_THREADS - 1) / FL_THREADS;
    size_t full = (size_t)(per_sm > 0 ? per_sm : 1) * (size_t)(sm_count > 0 ? sm_count : 1);
    return (unsigned int)(want < full ? (want ? want : 1) : full);
}

/* ---- HBM read ---------------------------------------------------------------------------- */

/* Word i holds i (mod 2^32): the host knows the sum of any prefix in closed form. */
static __global__ void fl_iota_kernel(uint32_t *p, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)i;
}

/* Sums n 16-byte vectors (mod 2^32) and writes one partial sum per block: the stores keep the
 * compiler from dropping the loads, and the host checks the partials add up. */
static __global__ void fl_read_kernel(const uint4 *__restrict__ src, size_t n, uint32_t *block_sums)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    /* Four independent 16-byte loads per trip: enough bytes in flight per SM to cover HBM
     * latency at full bandwidth. */
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w) + (c.x + c.y + c.z + c.w) +
               (d.x + d.y + d.z + d.w);
    }
    for (; i < n; i += stride) {
        uint4 a = src[i];
        acc += a.x + a.y + a.z + a.w;
    }
    for (int off = 16; off > 0; off /= 2)
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    __shared__ uint32_t warp_sums[FL_THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t s = 0;
        for (int w = 0; w < FL_THREADS / 32; w++)
            s += warp_sums[w];
        block_sums[blockIdx.x] = s;
    }
}

/* Sum of 0, 1, ..., n_words-1 modulo 2^32: n(n-1)/2 with the even factor halved first, so the
 * 64-bit product may wrap without changing the low 32 bits. */
static uint32_t fl_iota_sum(size_t n_words)
{
    if (n_words == 0) return 0;
    uint64_t a = n_words, b = n_words - 1;
    if (a % 2 == 0)
        a /= 2;
    else
        b /= 2;
    return (uint32_t)(a * b);
}

extern "C" int cuda_floor_device_info(int device, struct cuda_floor_device *out, char *err,
                                      size_t errlen)
{
    struct fl_run run;
    cudaDeviceProp prop;
    int clock_khz = 0, bus_bits = 0;
    int rc = fl_begin(&run, device, 1 /* nothing is timed */, err, errlen);
    if (rc < 0) goto out;
    rc = -1;
    if (CUDA_CHECK(cudaGetDeviceProperties(&prop, device), err, errlen) < 0) goto out;
    /* Memory clock and bus width left cudaDeviceProp in CUDA 13; the attributes remain. Some
     * devices report 0: the peak is then unknown, not an error. */
    if (CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device), err,
                   errlen) < 0)
        goto out;
    if (CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device), err,
                   errlen) < 0)
        goto out;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->sm_count = prop.multiProcessorCount;
    out->l2_bytes = prop.l2CacheSize > 0 ? (size_t)prop.l2CacheSize : 0;
    out->mem_bytes = prop.totalGlobalMem;
    /* Double data rate: two transfers per memory clock. */
    out->peak_hbm_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    rc = 0;
out:
    return fl_end(&run, rc, err, errlen);
}

extern "C" int cuda_floor_hbm(int device, size_t bytes, int reps, double *gbps, char *err,
                              size_t errlen)
{
    struct fl_run run;
    uint4 *buf = NULL;
    uint32_t *d_sums = NULL, *h_sums = NULL;
    size_t n = bytes / sizeof(uint4), used = n * sizeof(uint4);
    int l2 = 0, sm_count = 0, per_sm = 0;
    unsigned int blocks = 0;
    float best_ms = INFINITY;
    uint32_t got = 0, want = 0;
    int rc = fl_begin(&run, device, reps, err, errlen);
    if (rc < 0) goto out;
    rc = -1;
    if (CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), err, errlen) < 0 ||
        CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), err,
                   errlen) < 0)
        goto out;
    if (used < 4 * (size_t)l2) {
        ms_errf(err, errlen,
                "floors: hbm buffer of %zu bytes is under 4x the %d-byte L2 cache: it would "
                "measure the cache, not HBM",
                bytes, l2);
        goto out;
    }
    if (CUDA_CHECK(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fl_read_kernel, FL_THREADS, 0),
            err, errlen) < 0)
        goto out;
    blocks = fl_blocks(n, per_sm, sm_count);
    if (CUDA_CHECK(cudaMalloc(&buf, used), err, errlen) < 0) goto out;
    if (CUDA_CHECK(cudaMalloc(&d_sums, sizeof(uint32_t) * blocks), err, errlen) < 0) goto out;
    h_sums = (uint32_t *)malloc(sizeof(uint32_t) * blocks);
    if (!h_sums) {
        ms_errf(err, errlen, "floors: out of host memory for %u block sums", blocks);
        goto out;
    }

    fl_iota_kernel<<<fl_blocks(used / 4, per_sm, sm_count), FL_THREADS, 0, run.stream>>>(
        (uint32_t *)buf, used / 4);
    if (CUDA_LAUNCH_CHECK("fl_iota_kernel", err, errlen) < 0) goto out;
    /* Warm-up: first-launch costs and clock ramp stay out of the timed reps. */
    fl_read_kernel<<<blocks, FL_THREADS, 0, run.stream>>>(buf, n, d_sums);
    if (CUDA_LAUNCH_CHECK("fl_read_kernel", err, errlen) < 0) goto out;
    for (int r = 0; r < reps; r++) {
        if (fl_rep_start(&run, err, errlen) < 0) goto out;
        fl_read_kernel<<<blocks, FL_THREADS, 0, run.stream>>>(buf, n, d_sums);
        if (CUDA_LAUNCH_CHECK("fl_read_kernel", err, errlen) < 0) goto out;
        if (fl_rep_stop(&run, &best_ms, err, errlen) < 0) goto out;
    }

    if (CUDA_CHECK(cudaMemcpyAsync(h_sums, d_sums, sizeof(uint32_t) * blocks,
                                   cudaMemcpyDeviceToHost, run.stream),
                   err, errlen) < 0 ||
        CUDA_CHECK(cudaStreamSynchronize(run.stream), err, errlen) < 0)
        goto out;
    for (unsigned int b = 0; b < blocks; b++)
        got += h_sums[b];
    want = fl_iota_sum(used / 4);
    if (got != want) {
        ms_errf(err, errlen,
                "floors: hbm read kernel summed %u, expected %u: it did not read "
                "every byte once, its bandwidth would be meaningless",
                got, want);
        goto out;
    }
    if (!(best_ms > 0)) {
        ms_errf(err, errlen, "floors: hbm read timed at %g ms, too short to measure", best_ms);
        goto out;
    }
    *gbps = (double)used / (best_ms * 1e-3) / 1e9;
    rc = 0;
out:
    free(h_sums);
    fl_free(d_sums, &rc, err, errlen);
    fl_free(buf, &rc, err, errlen);
    return fl_end(&run, rc, err, errlen);
}

/* ---- device-to-device copy --------------------------------------------------------------- */

extern "C" int cuda_floor_copy(int device, size_t bytes, int reps, double *gbps, char *err,
                               size_t errlen)
{
    struct fl_run run;
    uint32_t *src = NULL, *dst = NULL;
    size_t n_words = bytes / sizeof(uint32_t), used = n_words * sizeof(uint32_t);
    int sm_count = 0, per_sm = 0;
    float best_ms = INFINITY;
    size_t probe[3];
    uint32_t seen[3];
    int rc = fl_begin(&run, device, reps, err, errlen);
    if (rc < 0) goto out;
    rc = -1;
    if (n_words == 0) {
        ms_errf(err, errlen, "floors: copy of %zu bytes is empty", bytes);
        goto out;
    }
    if (CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), err,
                   errlen) < 0 ||
        CUDA_CHECK(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fl_iota_kernel, FL_THREADS, 0),
            err, errlen) < 0)
        goto out;
    if (CUDA_CHECK(cudaMalloc(&src, used), err, errlen) < 0) goto out;
    if (CUDA_CHECK(cudaMalloc(&dst, used), err, errlen) < 0) goto out;
    fl_iota_kernel<<<fl_blocks(n_words, per_sm, sm_count), FL_THREADS, 0, run.stream>>>(src,
                                                                                        n_words);
    if (CUDA_LAUNCH_CHECK("fl_iota_kernel", err, errlen) < 0) goto out;
    /* Also the warm-up: it touches every page of dst. */
    if (CUDA_CHECK(cudaMemsetAsync(dst, 0, used, run.stream), err, errlen) < 0) goto out;
    for (int r = 0; r < reps; r++) {
        if (fl_rep_start(&run, err, errlen) < 0) goto out;
        if (CUDA_CHECK(cudaMemcpyAsync(dst, src, used, cudaMemcpyDeviceToDevice, run.stream), err,
                       errlen) < 0)
            goto out;
        if (fl_rep_stop(&run, &best_ms, err, errlen) < 0) goto out;
    }

    probe[0] = 0;
    probe[1] = n_words / 2;
    probe[2] = n_words - 1;
    for (int i = 0; i < 3; i++)
        if (CUDA_CHECK(cudaMemcpyAsync(&seen[i], dst + probe[i], sizeof(uint32_t),
                                       cudaMemcpyDeviceToHost, run.stream),
                       err, errlen) < 0)
            goto out;
    if (CUDA_CHECK(cudaStreamSynchronize(run.stream), err, errlen) < 0) goto out;
    for (int i = 0; i < 3; i++)
        if (seen[i] != (uint32_t)probe[i]) {
            ms_errf(err, errlen, "floors: copy left word %zu = %u, expected %u", probe[i], seen[i],
                    (uint32_t)probe[i]);
            goto out;
        }
    if (!(best_ms > 0)) {
        ms_errf(err, errlen, "floors: copy timed at %g ms, too short to measure", best_ms);
        goto out;
    }
    *gbps = 2.0 * (double)used / (best_ms * 1e-3) / 1e9;
    rc = 0;
out:
    fl_free(dst, &rc, err, errlen);
    fl_free(src, &rc, err, errlen);
    return fl_end(&run, rc, err, errlen);
}

/* ---- bf16 GEMM --------------------------------------------------------------------------- */

/* Element i of a GEMM input: a hash of (i, seed) mapped to [-0.5, 0.5), so the tensor cores see
 * varied bits (zeros would understate power draw) and the host can recompute any element. */
static __host__ __device__ float fl_fill_value(size_t i, uint32_t seed)
{
    uint32_t x = (uint32_t)i ^ ((uint32_t)(i >> 32) * 0x9e3779b9u) ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return (float)(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
}

static __global__ void fl_fill_bf16_kernel(__nv_bfloat16 *p, size_t n, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(fl_fill_value(i, seed));
}

#define FL_SEED_A 0x1234567u
#define FL_SEED_B 0x89abcdeu

/* C[row, col] of the column-major product, from the bf16-rounded inputs, in double. */
static double fl_gemm_ref(int m, int k, int row, int col)
{
    double s = 0;
    for (int kk = 0; kk < k; kk++) {
        float a =
            __bfloat162float(__float2bfloat16(fl_fill_value(row + (size_t)kk * m, FL_SEED_A)));
        float b =
            __bfloat162float(__float2bfloat16(fl_fill_value(kk + (size_t)col * k, FL_SEED_B)));
        s += (double)a * b;
    }
    return s;
}

extern "C" int cuda_floor_bf16_gemm(int device, int m, int n, int k, int reps, double *tflops,
                                    char *err, size_t errlen)
{
    struct fl_run run;
    cublasHandle_t blas = NULL;
    __nv_bfloat16 *a = NULL, *b = NULL, *c = NULL; /* a (m, k), b (k, n), c (m, n), column-major */
    size_t na = (size_t)m * k, nb = (size_t)k * n, nc = (size_t)m * n;
    int sm_count = 0, per_sm = 0;
    const float one = 1.0f, zero = 0.0f;
    float best_ms = INFINITY;
    int probe[3][2] = {{0, 0}, {m / 2, n / 3}, {m - 1, n - 1}}; /* (row, col) */
    __nv_bfloat16 seen[3];
    int rc = fl_begin(&run, device, reps, err, errlen);
    if (rc < 0) goto out;
    rc = -1;
    if (m < 1 || n < 1 || k < 1) {
        ms_errf(err, errlen, "floors: gemm shape %dx%dx%d must be positive", m, n, k);
        goto out;
    }
    if (CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), err,
                   errlen) < 0 ||
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fl_fill_bf16_kernel,
                                                                 FL_THREADS, 0),
                   err, errlen) < 0)
        goto out;
    if (CUDA_CHECK(cudaMalloc(&a, sizeof(*a) * na), err, errlen) < 0) goto out;
    if (CUDA_CHECK(cudaMalloc(&b, sizeof(*b) * nb), err, errlen) < 0) goto out;
    if (CUDA_CHECK(cudaMalloc(&c, sizeof(*c) * nc), err, errlen) < 0) goto out;
    fl_fill_bf16_kernel<<<fl_blocks(na, per_sm, sm_count), FL_THREADS, 0, run.stream>>>(a, na,
                                                                                        FL_SEED_A);
    if (CUDA_LAUNCH_CHECK("fl_fill_bf16_kernel", err, errlen) < 0) goto out;
    fl_fill_bf16_kernel<<<fl_blocks(nb, per_sm, sm_count), FL_THREADS, 0, run.stream>>>(b, nb,
                                                                                        FL_SEED_B);
    if (CUDA_LAUNCH_CHECK("fl_fill_bf16_kernel", err, errlen) < 0) goto out;
    if (CUBLAS_CHECK(cublasCreate(&blas), err, errlen) < 0) goto out;
    if (CUBLAS_CHECK(cublasSetStream(blas, run.stream), err, errlen) < 0) goto out;

    /* Rep -1 is the warm-up: cuBLAS picks its kernel and sets up its workspace there. */
    for (int r = -1; r < reps; r++) {
        if (r >= 0 && fl_rep_start(&run, err, errlen) < 0) goto out;
        if (CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, a, CUDA_R_16BF,
                                      m, b, CUDA_R_16BF, k, &zero, c, CUDA_R_16BF, m,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                         err, errlen) < 0)
            goto out;
        if (r >= 0 && fl_rep_stop(&run, &best_ms, err, errlen) < 0) goto out;
    }

    for (int i = 0; i < 3; i++)
        if (CUDA_CHECK(cudaMemcpyAsync(&seen[i], c + probe[i][0] + (size_t)probe[i][1] * m,
                                       sizeof(seen[i]), cudaMemcpyDeviceToHost, run.stream),
                       err, errlen) < 0)
            goto out;
    if (CUDA_CHECK(cudaStreamSynchronize(run.stream), err, errlen) < 0) goto out;
    for (int i = 0; i < 3; i++) {
        double want = fl_gemm_ref(m, k, probe[i][0], probe[i][1]);
        double got = __bfloat162float(seen[i]);
        /* bf16 output rounding (2^-8 relative) plus f32 accumulation noise growing with k. */
        double tol = 0.01 * fabs(want) + 1e-3 * sqrt((double)k);
        if (!(fabs(got - want) <= tol)) {
            ms_errf(err, errlen, "floors: gemm C[%d, %d] = %g, expected %g (tolerance %g)",
                    probe[i][0], probe[i][1], got, want, tol);
            goto out;
        }
    }
    if (!(best_ms > 0)) {
        ms_errf(err, errlen, "floors: gemm timed at %g ms, too short to measure", best_ms);
        goto out;
    }
    *tflops = 2.0 * m * (double)n * k / (best_ms * 1e-3) / 1e12;
    rc = 0;
out:
    if (blas && CUBLAS_CHECK(cublasDestroy(blas), rc < 0 ? NULL : err, errlen) < 0) rc = -1;
    fl_free(c, &rc, err, errlen);
    fl_free(b, &rc, err, errlen);
    fl_free(a, &rc, err, errlen);
    return fl_end(&run, rc, err, errlen);
}
