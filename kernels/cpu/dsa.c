/* DeepSeek sparse attention's indexer on the CPU (see dsa.h). One task per token: its score of
 * every cached position t <= pos (DeepSeek-V4: of every completed compressed entry), sum_h w_h
 * n_head^-0.5 relu(scale q_h . key_t), in head order (the dot products q_h . key_t by the GEMM
 * kernels, DSA_CHUNK candidates at a time), then the k-th largest score by selection on a copy
 * and the candidates above it (and the earliest of those equal to it) in one ascending pass. */
#include "cpu/dsa.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv_types.h"

const float *kv_row_slice(const struct gemm_kernels *kk, const struct be_kv *kv,
                          const int32_t *table, int block_size, int k_row, int pos, int off,
                          int len, float *buf)
{
    size_t blk = (size_t)table[pos / block_size];
    int slot = pos % block_size;
    size_t es = (size_t)kv_type_size(kv->type);
    const char *src = (const char *)kv->k +
                      (kv_seg_offset(blk, slot, block_size, 1, 0, k_row) + (size_t)off) * es;
    if (kv->type == BE_KV_F32) return (const float *)src;
    bool fp8 = kv->type == BE_KV_FP8_E4M3 || kv->type == BE_KV_FP8_E5M2;
    float sc = fp8 ? kv->k_scale
               : kv->type == BE_KV_INT8 ? kv->k_sc[kv_seg_offset(blk, slot, block_size, 1, 0, 1)]
                                        : 1.0f;
    kk->kv_cvt(buf, src, len, kv->type, sc);
    return buf;
}

/* Floats, rounded up to whole 64-byte lines. */
static size_t dsa_lines(size_t floats)
{
    return (floats + 15) / 16 * 16;
}

int dsa_work_reserve(struct dsa_work *w, int n_threads, int max_ctx, int dim, int heads)
{
    dsa_work_free(w);
    if (max_ctx < 1 || dim < 1 || heads < 1) return 0;
    size_t act = (gemm_act_bytes(ACT_EO, heads, dim) > gemm_act_bytes(ACT_F32, heads, dim)
                      ? gemm_act_bytes(ACT_EO, heads, dim)
                      : gemm_act_bytes(ACT_F32, heads, dim)) / sizeof(float) + 16;
    w->per_thread = 2 * dsa_lines((size_t)max_ctx) + dsa_lines((size_t)DSA_CHUNK * dim) +
                    dsa_lines((size_t)heads * DSA_CHUNK) + dsa_lines(act);
    w->buf = aligned_alloc(64, sizeof(float) * w->per_thread * (size_t)(n_threads < 1 ? 1 : n_threads));
    if (!w->buf) return -1;
    w->max_ctx = max_ctx;
    w->dim = dim;
    w->heads = heads;
    return 0;
}

void dsa_work_free(struct dsa_work *w)
{
    free(w->buf);
    memset(w, 0, sizeof *w);
}

/* The k-th largest of a[0, n) (1 <= k <= n); reorders a. Quickselect with a median-of-three
 * pivot, iterative. */
static float kth_largest(float *a, int n, int k)
{
    int lo = 0, hi = n - 1, want = k - 1; /* index in descending order */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float piv = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want];
    }
    return a[want];
}

struct dsa_call {
    const struct gemm_kernels *kk;
    struct dsa_work *w;
    int32_t *sel, *sel_n;
    const float *q, *wt;
    const struct be_kv *kv;
    const struct be_tokens *tk;
    int block_size;
    const struct be_dsa *p;
};

static void dsa_task(void *ctx, int i, int thread)
{
    const struct dsa_call *c = ctx;
    const struct be_dsa *p = c->p;
    const struct be_kv *kv = c->kv;
    const struct be_tokens *tk = c->tk;
    int rate = p->rate > 1 ? p->rate : 1; /* DeepSeek-V4: entries of `rate` positions */
    int pos = tk->pos ? tk->pos[i] : tk->pos0 + i, P = (pos + 1) / rate;
    int32_t *out = c->sel + (size_t)i * p->topk;
    if (P <= p->topk) {
        c->sel_n[i] = -1;
        return;
    }
    if (P > c->w->max_ctx || p->n_head > c->w->heads || p->dim > c->w->dim) {
        c->sel_n[i] = 0;
        return;
    }
    const struct dsa_work *w = c->w;
    float *s = w->buf + w->per_thread * (size_t)thread, *cp = s + dsa_lines((size_t)w->max_ctx);
    float *keys = cp + dsa_lines((size_t)w->max_ctx);
    float *dots = keys + dsa_lines((size_t)DSA_CHUNK * w->dim);
    void *abuf = dots + dsa_lines((size_t)w->heads * DSA_CHUNK);
    const int32_t *table = tk->seq ? tk->tables + (size_t)tk->seq[i] * tk->table_stride
                                   : tk->tables;
    const float *qi = c->q + (size_t)i * p->n_head * p->dim;
    const float *wi = c->wt + (size_t)i * p->n_head;
    float hs = 1.0f / sqrtf((float)p->n_head);
    /* the queries as the f32-weight GEMM reads its activations, once per token */
    struct act a;
    enum act_kind ak = c->kk->act_kind(WTYPE_F32, 0);
    c->kk->act_prepare(ak, 0, qi, (size_t)p->dim, p->n_head, p->dim, 0, p->n_head, abuf, &a);
    for (int t0 = 0; t0 < P; t0 += DSA_CHUNK) {
        int n = P - t0 < DSA_CHUNK ? P - t0 : DSA_CHUNK;
        for (int j = 0; j < n; j++) { /* the chunk's keys (each candidate's cache position), f32 */
            int t = t0 + j;
            float *kj = keys + (size_t)j * p->dim;
            const float *k = kv_row_slice(c->kk, kv, table, c->block_size, p->k_row,
                                          t * rate + rate - 1, p->k_off, p->dim, kj);
            if (k != kj) memcpy(kj, k, sizeof(float) * (size_t)p->dim);
        }
        /* dots (n_head, n): q_h . key_t, every head against the chunk */
        struct wmat km = {.type = WTYPE_F32, .rows = n, .cols = p->dim, .data = keys};
        c->kk->gemm(&km, &a, dots, DSA_CHUNK, 0, n);
        for (int j = 0; j < n; j++) {
            float score = 0.0f;
            for (int h = 0; h < p->n_head; h++) {
                float dot = dots[(size_t)h * DSA_CHUNK + j] * p->scale;
                if (dot > 0.0f) score += wi[h] * hs * dot;
            }
            s[t0 + j] = score;
        }
    }
    memcpy(cp, s, sizeof(float) * (size_t)P);
    float thr = kth_largest(cp, P, p->topk);
    int above = 0;
    for (int t = 0; t < P; t++) above += s[t] > thr;
    int ties = p->topk - above, cnt = 0;
    for (int t = 0; t < P && cnt < p->topk; t++)
        if (s[t] > thr || (s[t] == thr && ties-- > 0)) out[cnt++] = t;
    c->sel_n[i] = cnt;
}

void dsa_select_run(struct pool *pool, const struct gemm_kernels *kk, struct dsa_work *w,
                    int32_t *sel, int32_t *sel_n, const float *q, const float *wt,
                    const struct be_kv *kv, const struct be_tokens *tk, int block_size, int n,
                    const struct be_dsa *p)
{
    struct dsa_call c = {.kk = kk, .w = w, .sel = sel, .sel_n = sel_n, .q = q, .wt = wt,
                         .kv = kv, .tk = tk, .block_size = block_size, .p = p};
    if (n > 0) pool_run(pool, dsa_task, &c, n);
}
