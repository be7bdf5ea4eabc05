/* CUDA backend: the ops of kernels/backend.h on one NVIDIA GPU, matching the CPU reference
 * (kernels/cpu/backend_cpu.c) op for op. Weights are bf16 on the device (weight_upload);
 * GEMM inputs are converted to bf16 in the reserved workspace and multiplied by cuBLAS with
 * f32 accumulation; activations between ops stay f32 (inside an expert FFN they are bf16).
 * The other ops are kernels in this folder, all issued on one stream per instance.
 *
 * Memory: every pointer an op receives is device memory from this backend's alloc, including
 * the int32 index arrays (positions, token ids, row indices, block tables): upload them first.
 * upload returns once the host buffer may be reused; download returns once the data is on the
 * host (it synchronizes the stream). Ops are asynchronous.
 *
 * Errors: the ops of struct backend_ops return nothing, so the first failure of any CUDA or
 * cuBLAS call (or a bad argument the kernels cannot take) is kept in the instance as a sticky
 * reason; backend_cuda_error reports it. After a failure the results of later ops are
 * unspecified. alloc returns NULL on failure (and records why).
 *
 * Ownership: backend_cuda_create returns a backend freed with be->ops->destroy, which frees
 * the stream and cuBLAS handle but not memory still allocated through it. An instance belongs
 * to one host thread; it makes its device current in every call, so one thread may drive
 * several instances on different devices. These functions are callable from C. */
#ifndef MOESERVE_BACKEND_CUDA_H
#define MOESERVE_BACKEND_CUDA_H

#include <stddef.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 when there is no driver, no device or any error. */
int backend_cuda_device_count(void);

/* Backend on device `device`; NULL with a reason in err when that fails (no GPU: "no CUDA
 * device: <cudaGetErrorString>"). */
struct backend *backend_cuda_create(int device, char *err, size_t errlen);

/* -1 with the first recorded failure's reason in err when any call on this instance has failed
 * since creation (or the last backend_cuda_clear_error); 0 otherwise. Does not synchronize:
 * call be->ops->synchronize first to catch errors of kernels still running. */
int backend_cuda_error(struct backend *be, char *err, size_t errlen);
void backend_cuda_clear_error(struct backend *be);

/* The instance's stream (a cudaStream_t), for a communicator that must order its transfers
 * after this backend's kernels (comm_nccl_set_stream). */
void *backend_cuda_stream(struct backend *be);

/* Device the instance runs on. */
int backend_cuda_device(struct backend *be);

#ifdef __cplusplus
}
#endif

#endif
