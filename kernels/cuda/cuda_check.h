/* Checked CUDA, cuBLAS and NCCL calls (STYLE.md rule 8). Each macro evaluates one call and, when
 * it fails, writes a one-line reason naming the expression, the error, the enclosing function,
 * file and line into a caller-owned buffer `err` of `errlen` bytes (skipped when err is NULL),
 * then evaluates to -1; on success it evaluates to 0. Nothing aborts: the caller decides (goto
 * fail, or record the error in a backend's sticky status). CUDA_LAUNCH_CHECK goes right after
 * every kernel launch and reports launch-configuration errors through cudaGetLastError().
 *
 * Usable from .cu files only (needs the CUDA runtime types); the helpers are C++ functions with
 * internal linkage in each translation unit, so this header needs no .cu of its own. */
#ifndef MOESERVE_CUDA_CHECK_H
#define MOESERVE_CUDA_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#ifdef MOESERVE_HAVE_NCCL
#include <nccl.h>
#endif

static inline int cuda_check_report(const char *expr, const char *what, const char *func,
                                    const char *file, int line, char *err, size_t errlen)
{
    if (err && errlen)
        snprintf(err, errlen, "%s failed: %s in %s at %s:%d", expr, what, func, file, line);
    return -1;
}

static inline int cuda_check_rt(cudaError_t rc, const char *expr, const char *func,
                                const char *file, int line, char *err, size_t errlen)
{
    if (rc == cudaSuccess) return 0;
    char what[256];
    snprintf(what, sizeof what, "%s (%s)", cudaGetErrorString(rc), cudaGetErrorName(rc));
    return cuda_check_report(expr, what, func, file, line, err, errlen);
}

static inline const char *cuda_check_blas_name(cublasStatus_t rc)
{
    switch (rc) {
    case CUBLAS_STATUS_SUCCESS:
        return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
        return "CUBLAS_STATUS_LICENSE_ERROR";
    default:
        return "unknown cuBLAS status";
    }
}

static inline int cuda_check_blas(cublasStatus_t rc, const char *expr, const char *func,
                                  const char *file, int line, char *err, size_t errlen)
{
    if (rc == CUBLAS_STATUS_SUCCESS) return 0;
    return cuda_check_report(expr, cuda_check_blas_name(rc), func, file, line, err, errlen);
}

#ifdef MOESERVE_HAVE_NCCL
static inline int cuda_check_nccl(ncclResult_t rc, const char *expr, const char *func,
                                  const char *file, int line, char *err, size_t errlen)
{
    if (rc == ncclSuccess) return 0;
    return cuda_check_report(expr, ncclGetErrorString(rc), func, file, line, err, errlen);
}
#define NCCL_CHECK(call, err, errlen)                                                              \
    cuda_check_nccl((call), #call, __func__, __FILE__, __LINE__, (err), (errlen))
#endif

#define CUDA_CHECK(call, err, errlen)                                                              \
    cuda_check_rt((call), #call, __func__, __FILE__, __LINE__, (err), (errlen))
#define CUBLAS_CHECK(call, err, errlen)                                                            \
    cuda_check_blas((call), #call, __func__, __FILE__, __LINE__, (err), (errlen))
/* After each launch: `kernel` is the kernel's name, for the message. */
#define CUDA_LAUNCH_CHECK(kernel, err, errlen)                                                     \
    cuda_check_rt(cudaGetLastError(), "launch of " kernel, __func__, __FILE__, __LINE__, (err),    \
                  (errlen))

#endif
