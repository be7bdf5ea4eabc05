/* DeepSeek-V4's ops on the CUDA backend (backend.h hc_pre, hc_post, v4_compress, v4_attention),
 * following the CPU's kernels/cpu/v4.c operation for operation so that results agree to
 * rounding (expf, f32 accumulation, the same orders where a sum is sequential on the CPU):
 *   - hc_pre: one block per token; its first n_stream threads make pre, post and comb in
 *     shared memory (thread r owns row r of the softmax; Sinkhorn's column and row passes are
 *     one thread per column / row, each sum in the CPU's order, iters and eps as given), then
 *     the block collapses the streams channel by channel (streams summed in order).
 *   - hc_post: one thread per output element, the streams summed in order.
 *   - v4_compress: one block per token; a token that closes a window pools it one thread per
 *     channel (max over the slots, then the exponentials and weighted sum in slot order, as
 *     the CPU's two passes), RMS-norms the entry (a block sum) and rotates its last rot_dim;
 *     every other token writes zeros. A partial window's tail token writes zeros, as on the
 *     CPU, so prefill in one step or token by token gives the same entries.
 *   - v4_attention: one block per (token, head) over the token's key list (the sliding
 *     window's positions, then the compressed entries: all completed ones, or the indexer's
 *     selection from dsa_select, which dsa.cu computes for V4's entries with be_dsa.rate).
 *     Logits go to shared memory a chunk of V4_CHUNK keys at a time (a warp per key, lanes
 *     across the dimensions); softmax as the CPU's: the maximum over the sink and every logit
 *     first, then the sum of exponentials, then each probability divided by the sum before
 *     it weighs its key (the value) into the output in key order. Key lists of one chunk
 *     (every V4 layer up to 4,096 keys) keep their logits in shared memory across the three
 *     passes; longer ones recompute them per pass. The cache is read in its stored type.
 * None of them needs device scratch (shared memory only), so none allocates. Correctness
 * first: no tensor cores, no split over keys. */
#include <math.h>

#include "cuda_check.h"
#include "cuda_kernels.h"
#include "kv_types.h"

#define V4_THREADS 128
#define V4_CHUNK   4096
#define V4_DIMS    (CUK_V4_MAX_DIM / V4_THREADS)

static __device__ inline float v4_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* --- hyper-connections ---------------------------------------------------------------------- */

/* grid = n tokens; post NULL: the head's collapse (mix (n, S), pre only). */
static __global__ void __launch_bounds__(V4_THREADS)
    v4_hc_pre_kernel(float *post, float *comb, float *y, const float *x, const float *mix, int d,
                     struct be_hc h)
{
    __shared__ float pre[CUK_V4_MAX_STREAMS];
    __shared__ float cb[CUK_V4_MAX_STREAMS * CUK_V4_MAX_STREAMS];
    int i = blockIdx.x, S = h.n_stream, tid = threadIdx.x;
    bool head = post == NULL;
    const float *m = mix + (size_t)i * (size_t)(head ? S : S * (2 + S));
    if (tid < S) pre[tid] = v4_sigmoid(m[tid] * h.scale[0] + h.base[tid]) + h.eps;
    if (!head) {
        if (tid < S) {
            post[(size_t)i * S + tid] = 2.0f * v4_sigmoid(m[S + tid] * h.scale[1] + h.base[S + tid]);
            /* softmax over row r = tid, then + eps */
            int r = tid;
            float *row = cb + r * S, mx = -INFINITY, sum = 0.0f;
            for (int k = 0; k < S; k++) {
                row[k] = m[2 * S + r * S + k] * h.scale[2] + h.base[2 * S + r * S + k];
                mx = row[k] > mx ? row[k] : mx;
            }
            for (int k = 0; k < S; k++) {
                row[k] = expf(row[k] - mx);
                sum += row[k];
            }
            for (int k = 0; k < S; k++)
                row[k] = row[k] / sum + h.eps;
        }
        __syncthreads();
        /* Sinkhorn as transformers loops it: columns, then iters - 1 rounds of rows, columns;
         * thread a owns row or column a of a pass */
        for (int it = 0; it < h.iters; it++) {
            for (int pass = it == 0 ? 1 : 0; pass < 2; pass++) {
                if (tid < S) {
                    int a = tid;
                    float sum = 0.0f;
                    for (int b = 0; b < S; b++)
                        sum += pass ? cb[b * S + a] : cb[a * S + b];
                    for (int b = 0; b < S; b++) {
                        if (pass)
                            cb[b * S + a] /= sum + h.eps;
                        else
                            cb[a * S + b] /= sum + h.eps;
                    }
                }
                __syncthreads();
            }
        }
        for (int j = tid; j < S * S; j += blockDim.x)
            comb[(size_t)i * S * S + j] = cb[j];
    }
    __syncthreads();
    const float *xi = x + (size_t)i * S * (size_t)d;
    float *yi = y + (size_t)i * (size_t)d;
    for (int k = tid; k < d; k += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < S; j++)
            acc += pre[j] * xi[(size_t)j * d + k];
        yi[k] = acc;
    }
}

static int v4_streams_ok(const char *op, int S, char *err, size_t errlen)
{
    if (S >= 1 && S <= CUK_V4_MAX_STREAMS) return 0;
    if (err && errlen)
        snprintf(err, errlen, "%s: %d streams (hc_mult), supported 1 to %d", op, S,
                 CUK_V4_MAX_STREAMS);
    return -1;
}

int cuk_hc_pre(cudaStream_t st, float *post, float *comb, float *y, const float *x,
               const float *mix, int n, int d, const struct be_hc *h, char *err, size_t errlen)
{
    if (n <= 0) return 0;
    if (v4_streams_ok("hc_pre", h->n_stream, err, errlen) < 0) return -1;
    if (post && !comb) {
        if (err && errlen) snprintf(err, errlen, "hc_pre: post given without comb");
        return -1;
    }
    v4_hc_pre_kernel<<<(unsigned)n, V4_THREADS, 0, st>>>(post, comb, y, x, mix, d, *h);
    return CUDA_LAUNCH_CHECK("v4_hc_pre_kernel", err, errlen);
}

/* y (n, S, d): stream k = post_k out + sum_j comb[j][k] x_j, one thread per element */
static __global__ void v4_hc_post_kernel(float *y, const float *x, const float *out,
                                         const float *post, const float *comb, int n, int d, int S)
{
    size_t total = (size_t)n * (size_t)S * (size_t)d;
    for (size_t at = blockIdx.x * (size_t)blockDim.x + threadIdx.x; at < total;
         at += (size_t)gridDim.x * blockDim.x) {
        size_t e = at % (size_t)d, ik = at / (size_t)d;
        int k = (int)(ik % (size_t)S);
        size_t i = ik / (size_t)S;
        const float *xi = x + i * (size_t)S * d, *cb = comb + i * (size_t)S * S;
        float acc = 0.0f;
        for (int j = 0; j < S; j++)
            acc += cb[j * S + k] * xi[(size_t)j * d + e];
        y[at] = post[i * S + k] * out[i * (size_t)d + e] + acc;
    }
}

int cuk_hc_post(cudaStream_t st, float *y, const float *x, const float *out, const float *post,
                const float *comb, int n, int d, int n_stream, char *err, size_t errlen)
{
    if (n <= 0 || d <= 0) return 0;
    if (v4_streams_ok("hc_post", n_stream, err, errlen) < 0) return -1;
    size_t total = (size_t)n * (size_t)n_stream * (size_t)d;
    v4_hc_post_kernel<<<cuk_blocks(total, V4_THREADS), V4_THREADS, 0, st>>>(y, x, out, post, comb,
                                                                          n, d, n_stream);
    return CUDA_LAUNCH_CHECK("v4_hc_post_kernel", err, errlen);
}

/* --- cached rows ---------------------------------------------------------------------------- */

/* Where elements [off, ...) of position p's row (k_row elements, one segment: one int8 scale)
 * are stored, and the scale they are read with (kernels/cpu/dsa.c kv_row_slice). */
static __device__ inline const void *v4_row(const struct be_kv &kv, const int32_t *table, int bs,
                                            int k_row, int p, int off, float *scale)
{
    size_t blk = (size_t)table[p / bs];
    int slot = p % bs;
    *scale = kv.type == BE_KV_INT8 ? kv.k_sc[kv_seg_offset(blk, slot, bs, 1, 0, 1)]
             : kv.type == BE_KV_FP8_E4M3 || kv.type == BE_KV_FP8_E5M2 ? kv.k_scale
                                                                      : 1.0f;
    return (const char *)kv.k +
           (kv_seg_offset(blk, slot, bs, 1, 0, k_row) + (size_t)off) * (size_t)kv_type_size(kv.type);
}

static __device__ inline const int32_t *v4_table(const struct be_tokens &tk, int i)
{
    return tk.seq ? tk.tables + (size_t)tk.seq[i] * (size_t)tk.table_stride : tk.tables;
}

/* --- the compressor ------------------------------------------------------------------------- */

/* grid = n tokens; dynamic shared memory = c floats (the entry) */
static __global__ void __launch_bounds__(V4_THREADS)
    v4_compress_kernel(float *out, int ldo, struct be_kv kv, struct be_tokens tk, int bs,
                       struct be_v4cmp p)
{
    extern __shared__ float v4_ent[];
    __shared__ float red[32];
    int i = blockIdx.x, tid = threadIdx.x, C = p.c, R = p.rate;
    int pos = tk.pos ? tk.pos[i] : tk.pos0 + i;
    float *o = out + (size_t)i * (size_t)ldo;
    if ((pos + 1) % R != 0) { /* no window closes here (a partial tail included) */
        for (int k = tid; k < C; k += blockDim.x)
            o[k] = 0.0f;
        return;
    }
    int w = (pos + 1) / R - 1, first = p.overlap && w == 0 ? R : 0,
        slots = (p.overlap ? 2 : 1) * R, bw = (p.overlap ? 2 : 1) * C;
    const int32_t *table = v4_table(tk, i);
    float part = 0.0f;
    for (int k = tid; k < C; k += blockDim.x) {
        float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
        for (int pass = 0; pass < 2; pass++) {
            for (int s = first; s < slots; s++) {
                /* slot s: its cached position, channel half and bias row (kernels/cpu/v4.c
                 * cmp_slot; overlap: slots [0, R) are window w - 1's first halves) */
                int ch, at;
                const float *bias;
                if (!p.overlap) {
                    ch = 0;
                    bias = p.bias + (size_t)s * bw;
                    at = w * R + s;
                } else {
                    bool prev = s < R;
                    int j = prev ? s : s - R;
                    ch = prev ? 0 : C;
                    bias = p.bias + (size_t)j * bw + ch;
                    at = (prev ? w - 1 : w) * R + j;
                }
                float gsc;
                const void *g = v4_row(kv, table, bs, p.k_row, at, p.gate_off + ch, &gsc);
                float gb = kv_load(kv.type, g, k, gsc) + bias[k];
                if (pass == 0) {
                    mx = gb > mx ? gb : mx;
                    continue;
                }
                float vsc;
                const void *v = v4_row(kv, table, bs, p.k_row, at, p.kv_off + ch, &vsc);
                float e = expf(gb - mx);
                sum += e;
                acc += e * kv_load(kv.type, v, k, vsc);
            }
        }
        acc /= sum;
        v4_ent[k] = acc;
        part += acc * acc;
    }
    float ss = cuk_block_sum(part, red); /* its barriers also publish v4_ent */
    float inv = 1.0f / sqrtf(ss / (float)C + p.eps);
    for (int k = tid; k < C; k += blockDim.x)
        v4_ent[k] = p.norm[k] * (v4_ent[k] * inv);
    __syncthreads();
    /* interleaved RoPE on the last rot_dim channels at the window's first position */
    int half = p.rot_dim / 2;
    const float *cs = p.cos_sin + (size_t)w * R * half * 2;
    float *r = v4_ent + C - p.rot_dim;
    for (int j = tid; j < half; j += blockDim.x) {
        float cj = cs[2 * j], sj = cs[2 * j + 1], a = r[2 * j], b = r[2 * j + 1];
        r[2 * j] = a * cj - b * sj;
        r[2 * j + 1] = b * cj + a * sj;
    }
    __syncthreads();
    for (int k = tid; k < C; k += blockDim.x)
        o[k] = v4_ent[k];
}

int cuk_v4_compress(cudaStream_t st, float *out, int ldo, const struct be_kv *kv,
                    const struct be_tokens *tk, int block_size, int n, const struct be_v4cmp *p,
                    char *err, size_t errlen)
{
    if (n <= 0) return 0;
    int rows = p->overlap ? 2 : 1;
    if (p->rate <= 0 || p->c <= 0 || p->c > CUK_V4_MAX_ENTRY || block_size <= 0 ||
        p->rot_dim < 0 || p->rot_dim % 2 || p->rot_dim > p->c || ldo < p->c ||
        p->kv_off + rows * p->c > p->k_row || p->gate_off + rows * p->c > p->k_row ||
        tk->pos0 < 0) {
        if (err && errlen)
            snprintf(err, errlen,
                     "v4_compress: unsupported shape (rate %d, %d channels of at most %d, rot_dim "
                     "%d, row %d, kv at %d, gate at %d, ldo %d, block_size %d)",
                     p->rate, p->c, CUK_V4_MAX_ENTRY, p->rot_dim, p->k_row, p->kv_off,
                     p->gate_off, ldo, block_size);
        return -1;
    }
    size_t smem = sizeof(float) * (size_t)p->c;
    v4_compress_kernel<<<(unsigned)n, V4_THREADS, smem, st>>>(out, ldo, *kv, *tk, block_size, *p);
    return CUDA_LAUNCH_CHECK("v4_compress_kernel", err, errlen);
}

/* --- attention ------------------------------------------------------------------------------ */

/* Key k of token i's list (window positions first, then entries): its stored row and scale. */
static __device__ inline const void *v4_key(const struct be_kv &kv, const int32_t *table, int bs,
                                            const struct be_v4attn &a, int i, int pos, int nw,
                                            int k, float *scale)
{
    if (k < nw) return v4_row(kv, table, bs, a.k_row, pos - nw + 1 + k, 0, scale);
    k -= nw;
    bool listed = a.sel && a.sel_n[i] >= 0;
    int j = listed ? a.sel[(size_t)i * a.sel_stride + k] : k;
    return v4_row(kv, table, bs, a.k_row, (j + 1) * a.rate - 1, a.ent_off, scale);
}

/* Logits of keys [c0, c0 + len) into sc (a warp per key), times scale; as_exp: then
 * expf(logit - mx) instead. Ends with a barrier. */
static __device__ inline void v4_logits(float *sc, const float *qs, const struct be_kv &kv,
                                        const int32_t *table, int bs, const struct be_v4attn &a,
                                        int i, int pos, int nw, int c0, int len, bool as_exp,
                                        float mx)
{
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, n_warp = blockDim.x >> 5;
    for (int t = warp; t < len; t += n_warp) {
        float ksc;
        const void *key = v4_key(kv, table, bs, a, i, pos, nw, c0 + t, &ksc);
        float dot = 0.0f;
        for (int e = lane; e < a.dim; e += 32)
            dot += qs[e] * kv_load(kv.type, key, e, ksc);
        for (int o = 16; o > 0; o >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        float l = dot * a.scale;
        if (lane == 0) sc[t] = as_exp ? expf(l - mx) : l;
    }
    __syncthreads();
}

/* grid = n * n_head; dynamic shared memory = dim + V4_CHUNK floats */
static __global__ void __launch_bounds__(V4_THREADS)
    v4_attention_kernel(float *out, const float *q, struct be_kv kv, struct be_tokens tk, int bs,
                        struct be_v4attn a)
{
    extern __shared__ float v4_att[];
    __shared__ float red[32];
    int H = a.n_head, D = a.dim, tid = threadIdx.x;
    int i = blockIdx.x / H, h = blockIdx.x % H;
    float *qs = v4_att, *sc = v4_att + D;
    int pos = tk.pos ? tk.pos[i] : tk.pos0 + i;
    int nw = pos + 1 < a.window ? pos + 1 : a.window;
    int ne = 0;
    if (a.rate > 0) ne = a.sel && a.sel_n[i] >= 0 ? a.sel_n[i] : (pos + 1) / a.rate;
    int nk = nw + ne;
    bool one = nk <= V4_CHUNK; /* the logits stay in shared memory across the passes */
    const int32_t *table = v4_table(tk, i);
    const float *qh = q + ((size_t)i * H + h) * (size_t)D;
    for (int e = tid; e < D; e += blockDim.x)
        qs[e] = qh[e];
    __syncthreads();

    /* the maximum over the sink and every logit */
    float mx = a.sinks ? a.sinks[h] : -INFINITY;
    for (int c0 = 0; c0 < nk; c0 += V4_CHUNK) {
        int len = nk - c0 < V4_CHUNK ? nk - c0 : V4_CHUNK;
        v4_logits(sc, qs, kv, table, bs, a, i, pos, nw, c0, len, false, 0.0f);
        float cm = -INFINITY;
        for (int t = tid; t < len; t += blockDim.x)
            cm = fmaxf(cm, sc[t]);
        mx = fmaxf(mx, cuk_block_max(cm, red));
    }
    /* the sum of exponentials, with the sink's */
    float sum = 0.0f;
    for (int c0 = 0; c0 < nk; c0 += V4_CHUNK) {
        int len = nk - c0 < V4_CHUNK ? nk - c0 : V4_CHUNK;
        if (!one) v4_logits(sc, qs, kv, table, bs, a, i, pos, nw, c0, len, false, 0.0f);
        float part = 0.0f;
        for (int t = tid; t < len; t += blockDim.x) {
            float e = expf(sc[t] - mx);
            if (one) sc[t] = e;
            part += e;
        }
        sum += cuk_block_sum(part, red); /* its barriers also publish sc */
    }
    if (a.sinks) sum += expf(a.sinks[h] - mx);
    /* probabilities weigh the keys (the values) in key order */
    float acc[V4_DIMS];
#pragma unroll
    for (int r = 0; r < V4_DIMS; r++)
        acc[r] = 0.0f;
    for (int c0 = 0; c0 < nk; c0 += V4_CHUNK) {
        int len = nk - c0 < V4_CHUNK ? nk - c0 : V4_CHUNK;
        if (!one) v4_logits(sc, qs, kv, table, bs, a, i, pos, nw, c0, len, true, mx);
        for (int t = 0; t < len; t++) {
            float p = sc[t] / sum, vsc;
            const void *v = v4_key(kv, table, bs, a, i, pos, nw, c0 + t, &vsc);
#pragma unroll
            for (int r = 0; r < V4_DIMS; r++) {
                int e = tid + r * V4_THREADS;
                if (e < D) acc[r] += p * kv_load(kv.type, v, e, vsc);
            }
        }
        __syncthreads(); /* the next chunk overwrites sc */
    }
    float *oh = out + ((size_t)i * H + h) * (size_t)D;
#pragma unroll
    for (int r = 0; r < V4_DIMS; r++) {
        int e = tid + r * V4_THREADS;
        if (e < D) oh[e] = acc[r];
    }
}

int cuk_v4_attention(cudaStream_t st, float *out, const float *q, const struct be_kv *kv,
                     const struct be_tokens *tk, int block_size, int n, const struct be_v4attn *a,
                     char *err, size_t errlen)
{
    if (n <= 0 || a->n_head <= 0) return 0;
    if (a->dim <= 0 || a->dim > CUK_V4_MAX_DIM || a->k_row < a->dim || block_size <= 0 ||
        a->window < 0 || a->rate < 0 || tk->pos0 < 0 ||
        (a->rate > 0 && (a->ent_off < 0 || a->ent_off + a->dim > a->k_row)) ||
        (a->sel && (!a->sel_n || a->sel_stride <= 0))) {
        if (err && errlen)
            snprintf(err, errlen,
                     "v4_attention: unsupported shape (head width %d, max %d; row %d, entries at "
                     "%d; window %d, rate %d; block_size %d)",
                     a->dim, CUK_V4_MAX_DIM, a->k_row, a->ent_off, a->window, a->rate, block_size);
        return -1;
    }
    size_t blocks = (size_t)n * (size_t)a->n_head;
    if (blocks > 0x7fffffffu) {
        if (err && errlen) snprintf(err, errlen, "v4_attention: %zu blocks exceed one grid", blocks);
        return -1;
    }
    size_t smem = sizeof(float) * ((size_t)a->dim + V4_CHUNK);
    v4_attention_kernel<<<(unsigned)blocks, V4_THREADS, smem, st>>>(out, q, *kv, *tk, block_size,
                                                                    *a);
    return CUDA_LAUNCH_CHECK("v4_attention_kernel", err, errlen);
}
