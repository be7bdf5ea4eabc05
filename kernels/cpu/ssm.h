/* State-space layers of hybrid models on the CPU (backend.h gdn and mamba2): the causal conv1d,
 * the per-token gates, the recurrence per (sequence, head) with the CPU's gdn_head / mamba_head
 * kernels (gemm.h) and the gated RMSNorms, each phase spread over the backend's thread pool.
 * Used by backend_cpu.c; allocates nothing. */
#ifndef MOESERVE_CPU_SSM_H
#define MOESERVE_CPU_SSM_H

#include "backend.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"

void ssm_gdn_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *qkv,
                 const float *z, float *b, float *a, const struct be_gdn *g,
                 const struct be_seqs *sq);
void ssm_mamba2_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *xbc,
                    const float *z, float *dt, const struct be_mamba *m,
                    const struct be_seqs *sq);

#endif
