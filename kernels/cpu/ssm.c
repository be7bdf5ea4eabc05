/* State-space layers of hybrid models on the CPU: Gated DeltaNet (backend.h gdn) and Mamba2
 * (backend.h mamba2), each a few pool jobs. (1) The causal conv1d per (sequence, block of
 * channels), which needs every channel's previous inputs and so runs along the tokens. (2) Per
 * token: Gated DeltaNet's l2 norms of q and k and its gates; Mamba2's discretized step. (3) Per
 * (sequence, head) the recurrence over the sequence's tokens in order (the CPU's gdn_head /
 * mamba_head kernels, gemm.h), Gated DeltaNet's gated RMSNorm per head with it. (4) Mamba2's
 * gated RMSNorm per (token, group of heads). The results do not depend on the thread count:
 * every value is computed by one task in a fixed order. */
#include "cpu/ssm.h"

#include <math.h>
#include <string.h>

/* Channels per conv task. */
#define CONV_CHUNK 64

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static inline float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* The causal conv1d + SiLU of one layer over the sequences of sq, in place on x (n, C). */
struct conv_job {
    const struct gemm_kernels *kk;
    float *x;
    int C, K;
    const float *w, *bias; /* (C, K), (C) or NULL */
    float *state;          /* (slots, K - 1, C) */
    const struct be_seqs *sq;
    int n_chunks;
};

/* Channels [c0, c1) of one sequence, along its tokens: each token's row is read and written
 * once (a channel at a time down the tokens, every row's cache line came back 16 times). The
 * window of the last K - 1 inputs per channel is a ring (ring[(head + i) % W] the i-th oldest),
 * starting from the slot's (zeros for a fresh sequence) and ending there. Each output is
 * summed oldest input first as before; the SiLU is the table's (vector exp, not libm's). */
static void conv_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct conv_job *j = ctx;
    int s = task / j->n_chunks, c0 = task % j->n_chunks * CONV_CHUNK;
    int C = j->C, K = j->K, W = K - 1;
    int nc = (c0 + CONV_CHUNK < C ? c0 + CONV_CHUNK : C) - c0;
    float *st = j->state + (size_t)j->sq->slot[s] * (size_t)W * C + c0;
    float *x = j->x + (size_t)j->sq->tok0[s] * C + c0;
    int n = j->sq->n_tok[s];
    bool fresh = j->sq->fresh[s];
    /* conv_k <= 16 (model_config.c) */
    float wt[16][CONV_CHUNK], ring[16][CONV_CHUNK], bias[CONV_CHUNK], one[CONV_CHUNK];
    float pre[CONV_CHUNK];
    for (int c = 0; c < nc; c++) {
        for (int i = 0; i < K; i++) wt[i][c] = j->w[(size_t)(c0 + c) * K + i];
        bias[c] = j->bias ? j->bias[c0 + c] : 0.0f;
        one[c] = 1.0f;
    }
    for (int i = 0; i < W; i++)
        for (int c = 0; c < nc; c++) ring[i][c] = fresh ? 0.0f : st[(size_t)i * C + c];
    int head = 0;
    for (int t = 0; t < n; t++) {
        float *xt = x + (size_t)t * C;
        for (int c = 0; c < nc; c++) pre[c] = 0.0f;
        for (int i = 0; i < W; i++) {
            const float *r = ring[head + i < W ? head + i : head + i - W];
            for (int c = 0; c < nc; c++) pre[c] += wt[i][c] * r[c];
        }
        for (int c = 0; c < nc; c++) {
            pre[c] = pre[c] + wt[W][c] * xt[c] + bias[c];
            if (W > 0) ring[head][c] = xt[c]; /* the oldest input gives way to this one */
        }
        j->kk->silu_mul(xt, pre, one, nc);
        if (W > 0) head = head + 1 < W ? head + 1 : 0;
    }
    for (int i = 0; i < W; i++) {
        const float *r = ring[head + i < W ? head + i : head + i - W];
        for (int c = 0; c < nc; c++) st[(size_t)i * C + c] = r[c];
    }
}

static void conv_run(struct pool *pool, const struct gemm_kernels *kk, float *x, int C, int K,
                     const float *w, const float *b, float *state, const struct be_seqs *sq)
{
    struct conv_job j = {.kk = kk, .x = x, .C = C, .K = K, .w = w, .bias = b, .state = state,
                         .sq = sq, .n_chunks = (C + CONV_CHUNK - 1) / CONV_CHUNK};
    pool_run(pool, conv_task, &j, sq->n * j.n_chunks);
}

/* The rows the call covers: every sequence's tokens end by then. */
static int seqs_rows(const struct be_seqs *sq)
{
    int n = 0;
    for (int s = 0; s < sq->n; s++) {
        int end = sq->tok0[s] + sq->n_tok[s];
        n = end > n ? end : n;
    }
    return n;
}

/* --- Gated DeltaNet ------------------------------------------------------------------------ */

struct gdn_job {
    const struct gemm_kernels *kk;
    float *out, *qkv, *b, *a;
    const float *z;
    const struct be_gdn *g;
    const struct be_seqs *sq;
    int conv_dim;
};

/* x (d) *= scale / sqrt(sum x^2 + 1e-6) (transformers' l2norm, then the query scale) */
static void l2norm(float *x, int d, float scale)
{
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < d; i++) x[i] *= r;
}

/* Token t's q and k heads normalized in place, its b -> beta and a -> log-decay. */
static void gdn_gate_task(void *ctx, int t, int thread)
{
    (void)thread;
    const struct gdn_job *j = ctx;
    const struct be_gdn *g = j->g;
    int nk = g->n_k_head, nv = g->n_v_head, dk = g->k_dim;
    float *row = j->qkv + (size_t)t * j->conv_dim;
    float qs = 1.0f / sqrtf((float)dk);
    for (int h = 0; h < nk; h++) {
        l2norm(row + (size_t)h * dk, dk, qs);
        l2norm(row + (size_t)(nk + h) * dk, dk, 1.0f);
    }
    float *b = j->b + (size_t)t * nv, *a = j->a + (size_t)t * nv;
    for (int h = 0; h < nv; h++) {
        b[h] = 1.0f / (1.0f + expf(-b[h]));
        a[h] = -expf(g->a_log[h]) * softplus(a[h] + g->dt_bias[h]);
    }
}

/* The delta rule of value head h over sequence s, then each token's gated RMSNorm. */
static void gdn_head_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct gdn_job *j = ctx;
    const struct be_gdn *g = j->g;
    int nk = g->n_k_head, nv = g->n_v_head, dk = g->k_dim, dv = g->v_dim;
    int s = task / nv, h = task % nv, kh = h / (nv / nk);
    int t0 = j->sq->tok0[s], n = j->sq->n_tok[s];
    size_t C = (size_t)j->conv_dim, vd = (size_t)nv * dv;
    float *S = g->ssm_state + ((size_t)j->sq->slot[s] * nv + h) * (size_t)dk * dv;
    if (j->sq->fresh[s]) memset(S, 0, sizeof(float) * (size_t)dk * dv);
    const float *x = j->qkv + (size_t)t0 * C;
    float *o = j->out + (size_t)t0 * vd + (size_t)h * dv;
    j->kk->gdn_head(S, x + (size_t)kh * dk, x + (size_t)(nk + kh) * dk, C,
                    x + 2 * (size_t)nk * dk + (size_t)h * dv, C, j->a + (size_t)t0 * nv + h,
                    j->b + (size_t)t0 * nv + h, (size_t)nv, o, vd, n, dk, dv);
    const float *z = j->z + (size_t)t0 * vd + (size_t)h * dv;
    for (int t = 0; t < n; t++) {
        float *ot = o + (size_t)t * vd;
        float ss = 0.0f;
        for (int i = 0; i < dv; i++) ss += ot[i] * ot[i];
        float r = 1.0f / sqrtf(ss / (float)dv + g->eps);
        for (int i = 0; i < dv; i++) ot[i] = g->norm_w[i] * (ot[i] * r);
        j->kk->silu_mul(ot, z + (size_t)t * vd, ot, dv);
    }
}

void ssm_gdn_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *qkv,
                 const float *z, float *b, float *a, const struct be_gdn *g,
                 const struct be_seqs *sq)
{
    int conv_dim = 2 * g->n_k_head * g->k_dim + g->n_v_head * g->v_dim;
    struct gdn_job j = {.kk = kk, .out = out, .qkv = qkv, .b = b, .a = a, .z = z, .g = g,
                        .sq = sq, .conv_dim = conv_dim};
    conv_run(pool, kk, qkv, conv_dim, g->conv_k, g->conv_w, NULL, g->conv_state, sq);
    pool_run(pool, gdn_gate_task, &j, seqs_rows(sq));
    pool_run(pool, gdn_head_task, &j, sq->n * g->n_v_head);
}

/* --- Mamba2 -------------------------------------------------------------------------------- */

struct mamba_job {
    const struct gemm_kernels *kk;
    float *out, *xbc, *dt;
    const float *z;
    const struct be_mamba *m;
    const struct be_seqs *sq;
    int conv_dim;
};

/* Token t's steps: clamp(softplus(dt + dt_bias)). */
static void mamba_dt_task(void *ctx, int t, int thread)
{
    (void)thread;
    const struct mamba_job *j = ctx;
    const struct be_mamba *m = j->m;
    float *dt = j->dt + (size_t)t * m->n_head;
    for (int h = 0; h < m->n_head; h++) {
        float d = softplus(dt[h] + m->dt_bias[h]);
        dt[h] = d < m->dt_min ? m->dt_min : d > m->dt_max ? m->dt_max : d;
    }
}

static void mamba_head_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct mamba_job *j = ctx;
    const struct be_mamba *m = j->m;
    int H = m->n_head, P = m->head_dim, N = m->d_state, G = m->n_group;
    int s = task / H, h = task % H, grp = h / (H / G);
    int t0 = j->sq->tok0[s], n = j->sq->n_tok[s];
    size_t C = (size_t)j->conv_dim, I = (size_t)H * P;
    float *S = m->ssm_state + ((size_t)j->sq->slot[s] * H + h) * (size_t)P * N;
    if (j->sq->fresh[s]) memset(S, 0, sizeof(float) * (size_t)P * N);
    const float *x = j->xbc + (size_t)t0 * C;
    j->kk->mamba_head(S, x + (size_t)h * P, C, x + I + (size_t)grp * N,
                      x + I + (size_t)G * N + (size_t)grp * N, C, j->dt + (size_t)t0 * H + h,
                      (size_t)H, -expf(m->a_log[h]), m->d_skip[h],
                      j->out + (size_t)t0 * I + (size_t)h * P, I, n, P, N);
}

/* Token t's gated RMSNorm: per group of heads, rmsnorm(y * silu(z)) * w. */
static void mamba_norm_task(void *ctx, int t, int thread)
{
    (void)thread;
    const struct mamba_job *j = ctx;
    const struct be_mamba *m = j->m;
    int I = m->n_head * m->head_dim, gs = I / m->n_group;
    float *y = j->out + (size_t)t * I;
    const float *z = j->z + (size_t)t * I;
    j->kk->silu_mul(y, z, y, I);
    for (int g = 0; g < m->n_group; g++) {
        float *yg = y + (size_t)g * gs, ss = 0.0f;
        for (int i = 0; i < gs; i++) ss += yg[i] * yg[i];
        float r = 1.0f / sqrtf(ss / (float)gs + m->eps);
        for (int i = 0; i < gs; i++) yg[i] = m->norm_w[(size_t)g * gs + i] * (yg[i] * r);
    }
}

void ssm_mamba2_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *xbc,
                    const float *z, float *dt, const struct be_mamba *m,
                    const struct be_seqs *sq)
{
    int conv_dim = m->n_head * m->head_dim + 2 * m->n_group * m->d_state;
    struct mamba_job j = {.kk = kk, .out = out, .xbc = xbc, .dt = dt, .z = z, .m = m, .sq = sq,
                          .conv_dim = conv_dim};
    int rows = seqs_rows(sq);
    conv_run(pool, kk, xbc, conv_dim, m->conv_k, m->conv_w, m->conv_b, m->conv_state, sq);
    pool_run(pool, mamba_dt_task, &j, rows);
    pool_run(pool, mamba_head_task, &j, sq->n * m->n_head);
    pool_run(pool, mamba_norm_task, &j, rows);
}
