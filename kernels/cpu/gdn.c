/* Gated DeltaNet on the CPU: see gdn.h and backend.h's gdn for the math. Three phases, each a
 * pool job: (1) the conv1d per (sequence, block of channels), which needs every channel's
 * previous inputs and so runs along the tokens; (2) per (token, key head) the l2 norm of q and
 * k, and per (token, value head) beta and the log-decay; (3) per (sequence, value head) the
 * delta rule over the sequence's tokens in order, then the gated RMSNorm of each output. The
 * results do not depend on the thread count: every value is computed by one task in a fixed
 * order. */
#include "cpu/gdn.h"

#include <math.h>
#include <string.h>

/* Channels per conv task. */
#define CONV_CHUNK 64

struct gdn_job {
    const struct gemm_kernels *kk;
    float *out, *qkv, *b, *a;
    const float *z;
    const struct be_gdn *g;
    const struct be_seqs *sq;
    int conv_dim, n_chunks, n_tok;
};

static inline float silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static inline float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* Phase 1: channels [c0, c1) of one sequence, in place; the window starts from the slot's last
 * conv_k - 1 inputs (zeros for a fresh sequence) and ends there. */
static void conv_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct gdn_job *j = ctx;
    const struct be_gdn *g = j->g;
    int s = task / j->n_chunks, c0 = task % j->n_chunks * CONV_CHUNK;
    int c1 = c0 + CONV_CHUNK < j->conv_dim ? c0 + CONV_CHUNK : j->conv_dim;
    int C = j->conv_dim, K = g->conv_k, W = K - 1;
    float *st = g->conv_state + (size_t)j->sq->slot[s] * (size_t)W * C;
    float *x = j->qkv + (size_t)j->sq->tok0[s] * C;
    int n = j->sq->n_tok[s];
    bool fresh = j->sq->fresh[s];
    for (int c = c0; c < c1; c++) {
        const float *w = g->conv_w + (size_t)c * K;
        float win[16]; /* the last W inputs, oldest first (conv_k <= 16: model_config.c) */
        for (int i = 0; i < W; i++) win[i] = fresh ? 0.0f : st[(size_t)i * C + c];
        for (int t = 0; t < n; t++) {
            float raw = x[(size_t)t * C + c], acc = 0.0f;
            for (int i = 0; i < W; i++) acc += w[i] * win[i];
            acc += w[W] * raw;
            x[(size_t)t * C + c] = silu(acc);
            for (int i = 0; i + 1 < W; i++) win[i] = win[i + 1];
            if (W > 0) win[W - 1] = raw;
        }
        for (int i = 0; i < W; i++) st[(size_t)i * C + c] = win[i];
    }
}

/* x (d) *= scale / sqrt(sum x^2 + 1e-6) (transformers' l2norm, then the query scale) */
static void l2norm(float *x, int d, float scale)
{
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < d; i++) x[i] *= r;
}

/* Phase 2: token t's q and k heads normalized in place, its b -> beta and a -> log-decay. */
static void gate_task(void *ctx, int t, int thread)
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

/* Phase 3: the delta rule of value head h over sequence s, then each token's gated RMSNorm. */
static void head_task(void *ctx, int task, int thread)
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
        const float *zt = z + (size_t)t * vd;
        float ss = 0.0f;
        for (int i = 0; i < dv; i++) ss += ot[i] * ot[i];
        float r = 1.0f / sqrtf(ss / (float)dv + g->eps);
        for (int i = 0; i < dv; i++) ot[i] = g->norm_w[i] * (ot[i] * r) * silu(zt[i]);
    }
}

void gdn_cpu_run(struct pool *pool, const struct gemm_kernels *kk, float *out, float *qkv,
                 const float *z, float *b, float *a, const struct be_gdn *g,
                 const struct be_seqs *sq)
{
    int conv_dim = 2 * g->n_k_head * g->k_dim + g->n_v_head * g->v_dim;
    int n_tok = 0;
    for (int s = 0; s < sq->n; s++) {
        int end = sq->tok0[s] + sq->n_tok[s];
        n_tok = end > n_tok ? end : n_tok;
    }
    struct gdn_job j = {.kk = kk, .out = out, .qkv = qkv, .b = b, .a = a, .z = z, .g = g,
                        .sq = sq, .conv_dim = conv_dim,
                        .n_chunks = (conv_dim + CONV_CHUNK - 1) / CONV_CHUNK, .n_tok = n_tok};
    pool_run(pool, conv_task, &j, sq->n * j.n_chunks);
    pool_run(pool, gate_task, &j, n_tok);
    pool_run(pool, head_task, &j, sq->n * g->n_v_head);
}
