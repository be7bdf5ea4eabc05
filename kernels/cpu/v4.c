/* DeepSeek-V4's ops on the CPU (see v4.h): hyper-connection mixing per token, the compressor's
 * softmax pooling of a window of cached rows, and the sliding-window + compressed-entry
 * attention with sinks. Every op takes one task per token, so a token's result depends only on
 * its own inputs and the cache, never on how a step was split or batched. Cached rows are read
 * through kv_cvt where the cache is not f32 (the row is one int8 segment: one scale). */
#include "cpu/v4.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/dsa.h"

int v4_work_reserve(struct v4_work *w, int n_threads, int max_heads, int max_keys, int row)
{
    v4_work_free(w);
    if (max_heads < 1 || max_keys < 1 || row < 1) return 0;
    w->per_thread = (size_t)max_heads * (size_t)max_keys + 4 * (size_t)row + 16;
    w->buf = malloc(sizeof(float) * w->per_thread * (size_t)(n_threads < 1 ? 1 : n_threads));
    if (!w->buf) return -1;
    w->max_heads = max_heads;
    w->max_keys = max_keys;
    w->row = row;
    return 0;
}

void v4_work_free(struct v4_work *w)
{
    free(w->buf);
    memset(w, 0, sizeof *w);
}

static float sigmoidf(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* --- hyper-connections ---------------------------------------------------------------------- */

struct hc_call {
    float *post, *comb, *y;
    const float *x, *mix;
    int d;
    const struct be_hc *h;
};

/* Token i: pre (and post, comb) from its mixes, as transformers' DeepseekV4HyperConnection (or
 * HyperHead when post is NULL) computes them in f32, then the collapse. */
static void hc_pre_task(void *ctx, int i, int thread)
{
    (void)thread;
    const struct hc_call *c = ctx;
    const struct be_hc *h = c->h;
    int S = h->n_stream;
    bool head = c->post == NULL;
    const float *m = c->mix + (size_t)i * (head ? S : S * (2 + S));
    float pre[16];
    for (int j = 0; j < S; j++)
        pre[j] = sigmoidf(m[j] * h->scale[0] + h->base[j]) + h->eps;
    if (!head) {
        float *post = c->post + (size_t)i * S, *cb = c->comb + (size_t)i * S * S;
        for (int j = 0; j < S; j++)
            post[j] = 2.0f * sigmoidf(m[S + j] * h->scale[1] + h->base[S + j]);
        for (int r = 0; r < S; r++) { /* softmax over each row, then + eps */
            float *row = cb + (size_t)r * S, mx = -INFINITY, sum = 0.0f;
            for (int k = 0; k < S; k++) {
                row[k] = m[2 * S + r * S + k] * h->scale[2] + h->base[2 * S + r * S + k];
                mx = row[k] > mx ? row[k] : mx;
            }
            for (int k = 0; k < S; k++) {
                row[k] = expf(row[k] - mx);
                sum += row[k];
            }
            for (int k = 0; k < S; k++)
                row[k] = row[k] / sum + h->eps;
        }
        /* Sinkhorn as transformers loops it: columns, then iters - 1 rounds of rows, columns */
        for (int it = 0; it < h->iters; it++) {
            for (int pass = it == 0 ? 1 : 0; pass < 2; pass++) {
                for (int a = 0; a < S; a++) {
                    float sum = 0.0f;
                    for (int b = 0; b < S; b++)
                        sum += pass ? cb[b * S + a] : cb[a * S + b];
                    for (int b = 0; b < S; b++) {
                        if (pass)
                            cb[b * S + a] /= sum + h->eps;
                        else
                            cb[a * S + b] /= sum + h->eps;
                    }
                }
            }
        }
    }
    const float *x = c->x + (size_t)i * S * c->d;
    float *y = c->y + (size_t)i * c->d;
    for (int k = 0; k < c->d; k++) {
        float acc = 0.0f;
        for (int j = 0; j < S; j++)
            acc += pre[j] * x[(size_t)j * c->d + k];
        y[k] = acc;
    }
}

void v4_hc_pre_run(struct pool *pool, float *post, float *comb, float *y, const float *x,
                   const float *mix, int n, int d, const struct be_hc *h)
{
    if (h->n_stream < 1 || h->n_stream > 16) return; /* the config parser's bound */
    struct hc_call c = {.post = post, .comb = comb, .y = y, .x = x, .mix = mix, .d = d, .h = h};
    if (n > 0) pool_run(pool, hc_pre_task, &c, n);
}

struct hc_post_call {
    float *y;
    const float *x, *out, *post, *comb;
    int d, S;
};

static void hc_post_task(void *ctx, int i, int thread)
{
    (void)thread;
    const struct hc_post_call *c = ctx;
    int S = c->S;
    size_t d = (size_t)c->d;
    const float *x = c->x + (size_t)i * S * d, *o = c->out + (size_t)i * d;
    const float *post = c->post + (size_t)i * S, *cb = c->comb + (size_t)i * S * S;
    float *y = c->y + (size_t)i * S * d;
    for (int k = 0; k < S; k++) {
        float *yk = y + (size_t)k * d;
        for (size_t e = 0; e < d; e++) {
            float acc = 0.0f;
            for (int j = 0; j < S; j++)
                acc += cb[j * S + k] * x[(size_t)j * d + e];
            yk[e] = post[k] * o[e] + acc;
        }
    }
}

void v4_hc_post_run(struct pool *pool, float *y, const float *x, const float *out,
                    const float *post, const float *comb, int n, int d, int n_stream)
{
    struct hc_post_call c = {
        .y = y, .x = x, .out = out, .post = post, .comb = comb, .d = d, .S = n_stream};
    if (n > 0) pool_run(pool, hc_post_task, &c, n);
}

/* --- cached rows ---------------------------------------------------------------------------- */

static const int32_t *token_table(const struct be_tokens *tk, int i)
{
    return tk->seq ? tk->tables + (size_t)tk->seq[i] * tk->table_stride : tk->tables;
}

/* --- the compressor ------------------------------------------------------------------------- */

struct cmp_call {
    const struct gemm_kernels *kk;
    struct v4_work *w;
    float *out;
    int ldo;
    const struct be_kv *kv;
    const struct be_tokens *tk;
    int block_size;
    const struct be_v4cmp *p;
};

/* Slot s of window w's entry: the cached position, and where its kv and gate channels and its
 * bias row start (overlap: slots [0, rate) are window w - 1's first halves). */
static int cmp_slot(const struct be_v4cmp *p, int w, int s, int *ch, const float **bias)
{
    int R = p->rate, bw = (p->overlap ? 2 : 1) * p->c;
    if (!p->overlap) {
        *ch = 0;
        *bias = p->bias + (size_t)s * bw;
        return w * R + s;
    }
    bool prev = s < R;
    int j = prev ? s : s - R;
    *ch = prev ? 0 : p->c;
    *bias = p->bias + (size_t)j * bw + *ch;
    return (prev ? w - 1 : w) * R + j;
}

static void cmp_task(void *ctx, int i, int thread)
{
    const struct cmp_call *c = ctx;
    const struct be_v4cmp *p = c->p;
    int C = p->c, R = p->rate;
    int pos = c->tk->pos ? c->tk->pos[i] : c->tk->pos0 + i;
    float *o = c->out + (size_t)i * c->ldo;
    if ((pos + 1) % R != 0 || C > c->w->row) {
        memset(o, 0, sizeof(float) * (size_t)C);
        return;
    }
    int w = (pos + 1) / R - 1, first = p->overlap && w == 0 ? R : 0,
        slots = (p->overlap ? 2 : 1) * R;
    float *buf = c->w->buf + c->w->per_thread * (size_t)thread;
    float *mx = buf, *sum = mx + C, *gbuf = sum + C, *kbuf = gbuf + C;
    const int32_t *table = token_table(c->tk, i);
    for (int k = 0; k < C; k++) {
        mx[k] = -INFINITY;
        sum[k] = 0.0f;
        o[k] = 0.0f;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int s = first; s < slots; s++) {
            int ch;
            const float *bias;
            int at = cmp_slot(p, w, s, &ch, &bias);
            const float *g = kv_row_slice(c->kk, c->kv, table, c->block_size, p->k_row, at,
                                          p->gate_off + ch, C, gbuf);
            if (pass == 0) {
                for (int k = 0; k < C; k++)
                    mx[k] = g[k] + bias[k] > mx[k] ? g[k] + bias[k] : mx[k];
                continue;
            }
            const float *kv = kv_row_slice(c->kk, c->kv, table, c->block_size, p->k_row, at,
                                           p->kv_off + ch, C, kbuf);
            for (int k = 0; k < C; k++) {
                float e = expf(g[k] + bias[k] - mx[k]);
                sum[k] += e;
                o[k] += e * kv[k];
            }
        }
    }
    float ss = 0.0f;
    for (int k = 0; k < C; k++) {
        o[k] /= sum[k];
        ss += o[k] * o[k];
    }
    float inv = 1.0f / sqrtf(ss / (float)C + p->eps);
    for (int k = 0; k < C; k++)
        o[k] = p->norm[k] * (o[k] * inv);
    /* interleaved RoPE on the last rot_dim channels at the window's first position */
    int half = p->rot_dim / 2;
    const float *cs = p->cos_sin + (size_t)w * R * half * 2;
    float *r = o + C - p->rot_dim;
    for (int j = 0; j < half; j++) {
        float cj = cs[2 * j], sj = cs[2 * j + 1], a = r[2 * j], b = r[2 * j + 1];
        r[2 * j] = a * cj - b * sj;
        r[2 * j + 1] = b * cj + a * sj;
    }
}

void v4_compress_run(struct pool *pool, const struct gemm_kernels *kk, struct v4_work *w,
                     float *out, int ldo, const struct be_kv *kv, const struct be_tokens *tk,
                     int block_size, int n, const struct be_v4cmp *p)
{
    struct cmp_call c = {.kk = kk,
                         .w = w,
                         .out = out,
                         .ldo = ldo,
                         .kv = kv,
                         .tk = tk,
                         .block_size = block_size,
                         .p = p};
    if (n > 0) pool_run(pool, cmp_task, &c, n);
}

/* --- attention ------------------------------------------------------------------------------ */

struct att_call {
    const struct gemm_kernels *kk;
    struct v4_work *w;
    float *out;
    const float *q;
    const struct be_kv *kv;
    const struct be_tokens *tk;
    int block_size;
    const struct be_v4attn *a;
};

/* Key k of token i's list: the window's positions first, then the entries. */
static const float *att_key(const struct att_call *c, int i, const int32_t *table, int pos, int nw,
                            int k, float *buf)
{
    const struct be_v4attn *a = c->a;
    if (k < nw)
        return kv_row_slice(c->kk, c->kv, table, c->block_size, a->k_row, pos - nw + 1 + k, 0,
                            a->dim, buf);
    k -= nw;
    bool listed = a->sel && a->sel_n[i] >= 0;
    int j = listed ? a->sel[(size_t)i * a->sel_stride + k] : k;
    return kv_row_slice(c->kk, c->kv, table, c->block_size, a->k_row, (j + 1) * a->rate - 1,
                        a->ent_off, a->dim, buf);
}

static void att_task(void *ctx, int i, int thread)
{
    const struct att_call *c = ctx;
    const struct be_v4attn *a = c->a;
    int H = a->n_head, D = a->dim;
    int pos = c->tk->pos ? c->tk->pos[i] : c->tk->pos0 + i;
    int nw = pos + 1 < a->window ? pos + 1 : a->window;
    int ne = 0;
    if (a->rate > 0) ne = a->sel && a->sel_n[i] >= 0 ? a->sel_n[i] : (pos + 1) / a->rate;
    int nk = nw + ne;
    float *o = c->out + (size_t)i * H * D;
    memset(o, 0, sizeof(float) * (size_t)H * D);
    if (nk > c->w->max_keys || H > c->w->max_heads || D > c->w->row) return;
    float *lg = c->w->buf + c->w->per_thread * (size_t)thread, *kbuf = lg + (size_t)H * nk;
    const int32_t *table = token_table(c->tk, i);
    const float *q = c->q + (size_t)i * H * D;
    for (int k = 0; k < nk; k++) {
        const float *key = att_key(c, i, table, pos, nw, k, kbuf);
        for (int h = 0; h < H; h++) {
            const float *qh = q + (size_t)h * D;
            float dot = 0.0f;
            for (int e = 0; e < D; e++)
                dot += qh[e] * key[e];
            lg[(size_t)h * nk + k] = dot * a->scale;
        }
    }
    for (int h = 0; h < H; h++) { /* softmax with the sink in the denominator */
        float *l = lg + (size_t)h * nk, mx = a->sinks ? a->sinks[h] : -INFINITY, sum = 0.0f;
        for (int k = 0; k < nk; k++)
            mx = l[k] > mx ? l[k] : mx;
        for (int k = 0; k < nk; k++) {
            l[k] = expf(l[k] - mx);
            sum += l[k];
        }
        if (a->sinks) sum += expf(a->sinks[h] - mx);
        for (int k = 0; k < nk; k++)
            l[k] /= sum;
    }
    for (int k = 0; k < nk; k++) { /* the key is the value */
        const float *v = att_key(c, i, table, pos, nw, k, kbuf);
        for (int h = 0; h < H; h++) {
            float p = lg[(size_t)h * nk + k], *oh = o + (size_t)h * D;
            for (int e = 0; e < D; e++)
                oh[e] += p * v[e];
        }
    }
}

void v4_attention_run(struct pool *pool, const struct gemm_kernels *kk, struct v4_work *w,
                      float *out, const float *q, const struct be_kv *kv,
                      const struct be_tokens *tk, int block_size, int n, const struct be_v4attn *a)
{
    struct att_call c = {
        .kk = kk, .w = w, .out = out, .q = q, .kv = kv, .tk = tk, .block_size = block_size, .a = a};
    if (n > 0) pool_run(pool, att_task, &c, n);
}
