/* Gated DeltaNet on the CPU (backend.h gdn): the causal conv1d, the q/k normalization and the
 * gates, then the delta rule per (sequence, value head) with the CPU's gdn_head kernel (gemm.h)
 * and the gated RMSNorm, each phase spread over the backend's thread pool. Used by
 * backend_cpu.c; allocates nothing. */
#ifndef MOESERVE_CPU_GDN_H
#define MOESERVE_CPU_GDN_H

#include "backend.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"

void gdn_cpu_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *qkv,
                 const float *z, float *b, float *a, const struct be_gdn *g,
                 const struct be_seqs *sq);

#endif
