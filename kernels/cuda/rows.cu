/* Row-moving kernels of the CUDA backend: gather (embedding lookup and MoE permute), scatter
 * (unpermute), the MoE combine (weighted sum of each token's expert rows in slot order, the
 * CPU's order, so results do not depend on where rows were computed) and the paged KV write.
 * One block per row, threads across the row so each row is read and written coalesced. */
#include "cuda_check.h"
#include "cuda_kernels.h"

#define RW_THREADS 256

/* dst (n, d): dst[i] = src[idx[i]]; grid = n. */
static __global__ void rw_gather_kernel(float *dst, const float *src, const int32_t *idx, int d)
{
    size_t i = blockIdx.x;
    const float *s = src + (size_t)idx[i] * (size_t)d;
    float *o = dst + i * (size_t)d;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = s[c];
}

/* dst[idx[i]] = src[i] (n, d); grid = n. */
static __global__ void rw_scatter_kernel(float *dst, const float *src, const int32_t *idx, int d)
{
    size_t i = blockIdx.x;
    const float *s = src + i * (size_t)d;
    float *o = dst + (size_t)idx[i] * (size_t)d;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = s[c];
}

/* out (n, d) = sum_j w[i*k+j] * rows[idx[i*k+j]] over idx >= 0, j ascending; grid = n. */
static __global__ void rw_moe_combine_kernel(float *out, const float *rows, const int32_t *idx,
                                             const float *w, int k, int d)
{
    size_t i = blockIdx.x;
    const int32_t *ii = idx + i * (size_t)k;
    const float *wi = w + i * (size_t)k;
    float *o = out + i * (size_t)d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int32_t r = ii[j];
            if (r < 0) continue;
            acc += wi[j] * rows[(size_t)r * (size_t)d + c];
        }
        o[c] = acc;
    }
}

/* Rows (n, row) of k and v to the tokens' positions (struct be_tokens) in the paged caches
 * (n_blocks, block_size, row); grid = n. */
/* One block per token, one warp per KV head segment of its row (an int8 segment needs its
 * maximum first; the other types convert element by element with the same rounding as the
 * CPU), written head-major within the block (kv_seg_offset). */
static __global__ void rw_kv_write_kernel(struct be_kv kv, const float *k, const float *v,
                                          struct be_tokens tk, int block_size, int row)
{
    int i = blockIdx.x;
    int p = tk.pos ? tk.pos[i] : tk.pos0 + i;
    const int32_t *block_table =
        tk.seq ? tk.tables + (size_t)tk.seq[i] * (size_t)tk.table_stride : tk.tables;
    size_t blk = (size_t)block_table[p / block_size];
    int slot = p % block_size;
    size_t es = (size_t)kv_type_size(kv.type);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warp = blockDim.x >> 5;
    for (int which = 0; which < (v ? 2 : 1); which++) {
        const float *x = (which ? v : k) + (size_t)i * (size_t)row;
        float *sc = which ? kv.v_sc : kv.k_sc;
        int seg = which ? kv.v_grp : kv.k_grp, n_seg = row / seg;
        float inv = which ? (kv.v_scale > 0.0f ? 1.0f / kv.v_scale : 1.0f)
                          : (kv.k_scale > 0.0f ? 1.0f / kv.k_scale : 1.0f);
        for (int g = warp; g < n_seg; g += n_warp) {
            const float *xs = x + (size_t)g * seg;
            char *dst = (char *)(which ? kv.v : kv.k) +
                        kv_seg_offset(blk, slot, block_size, n_seg, g, seg) * es;
            if (kv.type != BE_KV_INT8) {
                for (int c = lane; c < seg; c += 32) {
                    switch (kv.type) {
                    case BE_KV_F32: ((float *)dst)[c] = xs[c]; break;
                    case BE_KV_BF16: ((uint16_t *)dst)[c] = kv_f32_to_bf16(xs[c]); break;
                    case BE_KV_F16: ((uint16_t *)dst)[c] = kv_f32_to_f16(xs[c]); break;
                    case BE_KV_FP8_E4M3: ((uint8_t *)dst)[c] = kv_f32_to_e4m3(xs[c] * inv); break;
                    case BE_KV_FP8_E5M2: ((uint8_t *)dst)[c] = kv_f32_to_e5m2(xs[c] * inv); break;
                    default: break;
                    }
                }
                continue;
            }
            float amax = 0.0f;
            for (int c = lane; c < seg; c += 32) amax = fmaxf(amax, fabsf(xs[c]));
            for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            float qinv = amax > 0.0f ? 127.0f / amax : 0.0f;
            if (lane == 0) sc[kv_seg_offset(blk, slot, block_size, n_seg, g, 1)] = amax / 127.0f;
            for (int c = lane; c < seg; c += 32) {
                float q = rintf(xs[c] * qinv);
                ((int8_t *)dst)[c] = (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : (int)q);
            }
        }
    }
}

int cuk_gather_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n, int d,
                    char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    rw_gather_kernel<<<(unsigned)n, RW_THREADS, 0, st>>>(dst, src, idx, d);
    return CUDA_LAUNCH_CHECK("rw_gather_kernel", err, errlen);
}

int cuk_scatter_rows(cudaStream_t st, float *dst, const float *src, const int32_t *idx, int n,
                     int d, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    rw_scatter_kernel<<<(unsigned)n, RW_THREADS, 0, st>>>(dst, src, idx, d);
    return CUDA_LAUNCH_CHECK("rw_scatter_kernel", err, errlen);
}

int cuk_moe_combine(cudaStream_t st, float *out, const float *rows, const int32_t *idx,
                    const float *w, int n, int k, int d, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    rw_moe_combine_kernel<<<(unsigned)n, RW_THREADS, 0, st>>>(out, rows, idx, w, k < 0 ? 0 : k, d);
    return CUDA_LAUNCH_CHECK("rw_moe_combine_kernel", err, errlen);
}

int cuk_kv_write(cudaStream_t st, const struct be_kv *kv, const float *k, const float *v,
                 const struct be_tokens *tk, int block_size, int n, int row, char *err,
                 size_t errlen)
{
    if (n <= 0 || row <= 0) return 0;
    if (kv->k_grp <= 0 || row % kv->k_grp || (v && (kv->v_grp <= 0 || row % kv->v_grp))) {
        if (err && errlen)
            snprintf(err, errlen, "kv_write: head segments (%d, %d) do not divide row %d",
                     kv->k_grp, kv->v_grp, row);
        return -1;
    }
    rw_kv_write_kernel<<<(unsigned)n, RW_THREADS, 0, st>>>(*kv, k, v, *tk, block_size, row);
    return CUDA_LAUNCH_CHECK("rw_kv_write_kernel", err, errlen);
}
