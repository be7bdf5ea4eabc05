/* DeepSeek sparse attention's lightning indexer on the CUDA backend (backend.h dsa_select): per
 * token, its score of every cached position t <= pos, then the top-k positions in ascending
 * order with ties at the k-th score kept in position order, as the CPU's kernels/cpu/dsa.c.
 * One block per token. Scores: one warp per cached position (lanes across the key's
 * dimensions, the index queries in shared memory), written to a scratch row of max_ctx floats.
 * Selection: the k-th largest score by a radix select over order-preserving 32-bit keys (four
 * 8-bit digits, a shared histogram per digit), then one ascending pass in chunks of the block
 * that keeps the positions above it and the earliest ones equal to it (block prefix sums give
 * each kept position its slot). The scratch holds DS_ROWS tokens' scores, so a call of more
 * tokens runs as several launches on the stream. DeepSeek-V4 (be_dsa.rate > 1) scores its
 * completed compressed entries instead of every position, entry t's key at position
 * (t + 1) rate - 1, and lists entry numbers, as the CPU does. Scores differ from the CPU's only
 * by the summation order of the dot products; correctness first, no tensor cores. */
#include <cub/block/block_scan.cuh>
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"
#include "kv_types.h"

#define DS_THREADS 256

/* float -> unsigned, order-preserving (larger float, larger key; -0 and +0 differ, which only
 * orders equal scores, as the CPU's comparisons do not: both are "not above") */
static __device__ inline uint32_t ds_key(float f)
{
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* Block-wide exclusive prefix sum of v; *total gets the sum over the block. */
typedef cub::BlockScan<int, DS_THREADS> ds_scan_t;

static __device__ inline int ds_exclusive(ds_scan_t::TempStorage &tmp, int v, int *total)
{
    int out;
    ds_scan_t(tmp).ExclusiveSum(v, out, *total);
    __syncthreads(); /* tmp is reused by the next scan */
    return out;
}

/* grid = n tokens (from tok0 of the call); P candidates per token: its positions [0, pos], or
 * with rate > 1 its completed entries; dynamic shared memory = n_head * (dim + 1) floats:
 * the token's index queries and head weights. scores: (gridDim.x, max_ctx). */
static __global__ void __launch_bounds__(DS_THREADS)
    ds_select_kernel(int32_t *sel, int32_t *sel_n, const float *q, const float *wt,
                     struct be_kv kv, struct be_tokens tk, int block_size, struct be_dsa p,
                     int tok0, float *scores, int max_ctx)
{
    extern __shared__ float ds_smem[];
    __shared__ int hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int s_want;
    __shared__ typename ds_scan_t::TempStorage scan_tmp;
    int i = tok0 + blockIdx.x;
    int rate = p.rate > 1 ? p.rate : 1; /* DeepSeek-V4: entries of `rate` positions */
    int pos = tk.pos ? tk.pos[i] : tk.pos0 + i, P = (pos + 1) / rate;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, n_warp = blockDim.x >> 5;
    if (P <= p.topk) {
        if (tid == 0) sel_n[i] = -1;
        return;
    }
    if (P > max_ctx) { /* past the reserved context: nothing attended (never, from the engine) */
        if (tid == 0) sel_n[i] = 0;
        return;
    }
    float *qs = ds_smem, *ws = ds_smem + (size_t)p.n_head * p.dim;
    for (int j = tid; j < p.n_head * p.dim; j += blockDim.x)
        qs[j] = q[(size_t)i * p.n_head * p.dim + j];
    for (int h = tid; h < p.n_head; h += blockDim.x)
        ws[h] = wt[(size_t)i * p.n_head + h] / sqrtf((float)p.n_head);
    __syncthreads();

    const int32_t *table =
        tk.seq ? tk.tables + (size_t)tk.seq[i] * (size_t)tk.table_stride : tk.tables;
    size_t es = (size_t)kv_type_size(kv.type);
    float *s = scores + (size_t)blockIdx.x * (size_t)max_ctx;
    for (int t = warp; t < P; t += n_warp) {
        int at = t * rate + rate - 1; /* the candidate's cache position */
        size_t blk = (size_t)table[at / block_size];
        int slot = at % block_size;
        float ksc = kv.type == BE_KV_INT8 ? kv.k_sc[kv_seg_offset(blk, slot, block_size, 1, 0, 1)]
                    : kv.type == BE_KV_FP8_E4M3 || kv.type == BE_KV_FP8_E5M2 ? kv.k_scale
                                                                             : 1.0f;
        const void *key =
            (const char *)kv.k + (kv_seg_offset(blk, slot, block_size, 1, 0, p.k_row) +
                                  (size_t)p.k_off) * es;
        float score = 0.0f;
        for (int h = 0; h < p.n_head; h++) {
            const float *qh = qs + (size_t)h * p.dim;
            float dot = 0.0f;
            for (int d = lane; d < p.dim; d += 32)
                dot += qh[d] * kv_load(kv.type, key, d, ksc);
            for (int o = 16; o > 0; o >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            dot *= p.scale;
            if (dot > 0.0f) score += ws[h] * dot;
        }
        if (lane == 0) s[t] = score;
    }
    __syncthreads();

    /* radix select: the key of the topk-th largest score, most significant digit first */
    if (tid == 0) {
        s_prefix = 0;
        s_want = p.topk; /* rank from the top among the keys matching the prefix */
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix, mask = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (int t = tid; t < P; t += blockDim.x) {
            uint32_t k = ds_key(s[t]);
            if ((k & mask) == (prefix & mask)) atomicAdd(&hist[(k >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int want = s_want, b = 255;
            while (b > 0 && hist[b] < want) want -= hist[b--];
            s_prefix = prefix | ((uint32_t)b << shift);
            s_want = want;
        }
        __syncthreads();
    }
    uint32_t thr = s_prefix;
    /* keys above the threshold number topk - s_want; the first s_want equal ones join them */
    int ties = s_want, base_eq = 0, base_out = 0;
    int32_t *out = sel + (size_t)i * p.topk;
    for (int c0 = 0; c0 < P; c0 += blockDim.x) {
        int t = c0 + tid;
        uint32_t k = t < P ? ds_key(s[t]) : 0u;
        int eq = t < P && k == thr, tot;
        int eq_rank = base_eq + ds_exclusive(scan_tmp, eq, &tot);
        base_eq += tot;
        int keep = t < P && (k > thr || (eq && eq_rank < ties));
        int slot = base_out + ds_exclusive(scan_tmp, keep, &tot);
        base_out += tot;
        if (keep) out[slot] = t;
    }
    if (tid == 0) sel_n[i] = base_out;
}

int cuk_dsa_select(cudaStream_t st, int32_t *sel, int32_t *sel_n, const float *q, const float *w,
                   const struct be_kv *kv, const struct be_tokens *tk, int block_size, int n,
                   const struct be_dsa *p, float *scores, int rows, int max_ctx, char *err,
                   size_t errlen)
{
    if (n <= 0) return 0;
    size_t smem = sizeof(float) * (size_t)p->n_head * ((size_t)p->dim + 1);
    if (p->n_head <= 0 || p->dim <= 0 || p->topk <= 0 || block_size <= 0 || rows <= 0 ||
        !scores || smem > 48 * 1024) {
        if (err && errlen)
            snprintf(err, errlen,
                     "dsa_select: unsupported shape (%d index heads of width %d, top-k %d, %d "
                     "scratch rows; the queries must fit 48 KiB of shared memory)",
                     p->n_head, p->dim, p->topk, rows);
        return -1;
    }
    for (int t0 = 0; t0 < n; t0 += rows) {
        int m = n - t0 < rows ? n - t0 : rows;
        ds_select_kernel<<<(unsigned)m, DS_THREADS, smem, st>>>(sel, sel_n, q, w, *kv, *tk,
                                                                block_size, *p, t0, scores,
                                                                max_ctx);
        if (CUDA_LAUNCH_CHECK("ds_select_kernel", err, errlen) != 0) return -1;
    }
    return 0;
}
