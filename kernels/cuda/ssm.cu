/* Kernels of hybrid models on the CUDA backend (backend.h gather_cols, mul_sigmoid, scale, gdn,
 * mamba2): the column gather and sigmoid gate of gated attention, and the state-space layers in
 * a few launches as on the CPU (kernels/cpu/ssm.c). The causal conv1d runs one thread per
 * (sequence, channel) walking the tokens. Gated DeltaNet: the q/k l2 norms (a warp per token and
 * head) and the gates; the delta rule with one block per (sequence, value head) in which thread
 * j owns column j of the state S, since the rule never mixes columns (only the gated RMSNorm
 * reduces over them). Mamba2: the steps; the scan with one block per (sequence, head), thread p
 * owning row p of S; the gated RMSNorm per (token, group). Arithmetic follows the CPU (expf,
 * log1pf, the same operation order), so results agree to rounding. The sequences come as an
 * int32 table (tok0, n_tok, slot, fresh) x n in device memory. */
#include "cuda_check.h"
#include "cuda_kernels.h"

#define GDN_THREADS 256

static __global__ void gather_cols_kernel(float *y, int ldy, const float *x, int ldx,
                                          const int32_t *idx, int n, int m)
{
    size_t total = (size_t)n * (size_t)m;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)m, j = i % (size_t)m;
        y[r * (size_t)ldy + j] = x[r * (size_t)ldx + (size_t)idx[j]];
    }
}

int cuk_gather_cols(cudaStream_t st, float *y, int ldy, const float *x, int ldx,
                    const int32_t *idx, int n, int m, char *err, size_t errlen)
{
    size_t total = (size_t)n * (size_t)m;
    if (total == 0) return 0;
    gather_cols_kernel<<<cuk_blocks(total, GDN_THREADS), GDN_THREADS, 0, st>>>(y, ldy, x, ldx, idx,
                                                                               n, m);
    return CUDA_LAUNCH_CHECK("gather_cols_kernel", err, errlen);
}

static __global__ void scale_kernel(float *x, size_t total, float s)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

static __global__ void mul_rows_kernel(float *x, const float *s, size_t total, int d)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] *= s[i / (size_t)d];
}

int cuk_mul_rows(cudaStream_t st, float *x, const float *s, int n, int d, char *err,
                 size_t errlen)
{
    size_t total = (size_t)n * (size_t)d;
    if (total == 0) return 0;
    mul_rows_kernel<<<cuk_blocks(total, GDN_THREADS), GDN_THREADS, 0, st>>>(x, s, total, d);
    return CUDA_LAUNCH_CHECK("mul_rows_kernel", err, errlen);
}

int cuk_scale(cudaStream_t st, float *x, size_t total, float s, char *err, size_t errlen)
{
    if (total == 0) return 0;
    scale_kernel<<<cuk_blocks(total, GDN_THREADS), GDN_THREADS, 0, st>>>(x, total, s);
    return CUDA_LAUNCH_CHECK("scale_kernel", err, errlen);
}

static __global__ void mul_sigmoid_kernel(float *y, const float *g, size_t total)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] *= 1.0f / (1.0f + expf(-g[i]));
}

int cuk_mul_sigmoid(cudaStream_t st, float *y, const float *g, size_t total, char *err,
                    size_t errlen)
{
    if (total == 0) return 0;
    mul_sigmoid_kernel<<<cuk_blocks(total, GDN_THREADS), GDN_THREADS, 0, st>>>(y, g, total);
    return CUDA_LAUNCH_CHECK("mul_sigmoid_kernel", err, errlen);
}

__device__ static inline float gdn_silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* One thread per (sequence, channel): the window of the last K - 1 inputs in registers. */
static __global__ void ssm_conv_kernel(float *qkv, int C, int K, const float *w,
                                       const float *bias, float *state, const int32_t *seq,
                                       int ns)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ns * C) return;
    int s = i / C, c = i % C, W = K - 1;
    int t0 = seq[4 * s], n = seq[4 * s + 1], slot = seq[4 * s + 2], fresh = seq[4 * s + 3];
    float *st = state + (size_t)slot * (size_t)W * C;
    float win[16];
    for (int k = 0; k < W; k++) win[k] = fresh ? 0.0f : st[(size_t)k * C + c];
    const float *wc = w + (size_t)c * K;
    for (int t = 0; t < n; t++) {
        float *xp = qkv + (size_t)(t0 + t) * C + c;
        float raw = *xp, acc = 0.0f;
        for (int k = 0; k < W; k++) acc += wc[k] * win[k];
        acc += wc[W] * raw;
        *xp = gdn_silu(acc + (bias ? bias[c] : 0.0f));
        for (int k = 0; k + 1 < W; k++) win[k] = win[k + 1];
        if (W > 0) win[W - 1] = raw;
    }
    for (int k = 0; k < W; k++) st[(size_t)k * C + c] = win[k];
}

/* A warp per (token, one of the 2 nk q/k heads): x *= scale / sqrt(sum x^2 + 1e-6). */
static __global__ void gdn_l2_kernel(float *qkv, int C, int nk, int dk, int n_tok)
{
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= n_tok * 2 * nk) return;
    int t = warp / (2 * nk), h = warp % (2 * nk);
    float *x = qkv + (size_t)t * C + (size_t)h * dk;
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) ss += x[i] * x[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float r = (h < nk ? 1.0f / sqrtf((float)dk) : 1.0f) / sqrtf(ss + 1e-6f);
    for (int i = lane; i < dk; i += 32) x[i] *= r;
}

static __global__ void gdn_gate_kernel(float *b, float *a, const float *a_log,
                                       const float *dt_bias, int nv, int n_tok)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tok * nv) return;
    int h = i % nv;
    float x = a[i] + dt_bias[h];
    float sp = x > 20.0f ? x : log1pf(expf(x));
    b[i] = 1.0f / (1.0f + expf(-b[i]));
    a[i] = -expf(a_log[h]) * sp;
}

/* One block per (sequence, value head), thread j < dv owning column j of S (dk, dv). */
static __global__ void gdn_head_kernel(float *out, const float *qkv, const float *z,
                                       const float *beta, const float *lg, struct be_gdn g,
                                       const int32_t *seq)
{
    extern __shared__ float sh[]; /* q (dk), k (dk), then 32 for the reduction */
    int nk = g.n_k_head, nv = g.n_v_head, dk = g.k_dim, dvh = g.v_dim;
    int s = blockIdx.x / nv, h = blockIdx.x % nv, kh = h / (nv / nk), j = threadIdx.x;
    int t0 = seq[4 * s], n = seq[4 * s + 1], slot = seq[4 * s + 2], fresh = seq[4 * s + 3];
    size_t C = 2 * (size_t)nk * dk + (size_t)nv * dvh, vd = (size_t)nv * dvh;
    float *qs = sh, *ks = sh + dk, *red = sh + 2 * dk;
    float *S = g.ssm_state + ((size_t)slot * nv + h) * (size_t)dk * dvh;
    bool mine = j < dvh;
    if (mine && fresh)
        for (int i = 0; i < dk; i++) S[(size_t)i * dvh + j] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float *row = qkv + (size_t)(t0 + t) * C;
        __syncthreads(); /* the previous token's q/k are read */
        for (int i = j; i < dk; i += blockDim.x) {
            qs[i] = row[(size_t)kh * dk + i];
            ks[i] = row[(size_t)(nk + kh) * dk + i];
        }
        __syncthreads();
        size_t tv = (size_t)(t0 + t) * nv + h;
        float eg = expf(lg[tv]), bt = beta[tv], o = 0.0f;
        if (mine) {
            float mem = 0.0f;
            for (int i = 0; i < dk; i++) {
                float v = S[(size_t)i * dvh + j] * eg;
                S[(size_t)i * dvh + j] = v;
                mem += v * ks[i];
            }
            float delta = (row[2 * (size_t)nk * dk + (size_t)h * dvh + j] - mem) * bt;
            for (int i = 0; i < dk; i++) {
                float v = S[(size_t)i * dvh + j] + ks[i] * delta;
                S[(size_t)i * dvh + j] = v;
                o += qs[i] * v;
            }
        }
        float ss = cuk_block_sum(o * o, red);
        if (mine) {
            float r = 1.0f / sqrtf(ss / (float)dvh + g.eps);
            size_t oi = (size_t)(t0 + t) * vd + (size_t)h * dvh + j;
            out[oi] = g.norm_w[j] * (o * r) * gdn_silu(z[oi]);
        }
    }
}

int cuk_gdn(cudaStream_t st, float *out, float *qkv, const float *z, float *b, float *a,
            const struct be_gdn *g, const int32_t *seq, int ns, int n_tok, char *err,
            size_t errlen)
{
    int C = 2 * g->n_k_head * g->k_dim + g->n_v_head * g->v_dim;
    if (ns <= 0 || n_tok <= 0) return 0;
    if (g->v_dim > 1024 || g->conv_k > 16) {
        snprintf(err, errlen, "gdn: value heads of %d (at most 1024) or a conv of %d (at most 16)",
                 g->v_dim, g->conv_k);
        return -1;
    }
    int cells = ns * C;
    ssm_conv_kernel<<<(cells + GDN_THREADS - 1) / GDN_THREADS, GDN_THREADS, 0, st>>>(
        qkv, C, g->conv_k, g->conv_w, NULL, g->conv_state, seq, ns);
    if (CUDA_LAUNCH_CHECK("ssm_conv_kernel", err, errlen) < 0) return -1;
    int warps = n_tok * 2 * g->n_k_head;
    gdn_l2_kernel<<<(warps * 32 + GDN_THREADS - 1) / GDN_THREADS, GDN_THREADS, 0, st>>>(
        qkv, C, g->n_k_head, g->k_dim, n_tok);
    if (CUDA_LAUNCH_CHECK("gdn_l2_kernel", err, errlen) < 0) return -1;
    int gates = n_tok * g->n_v_head;
    gdn_gate_kernel<<<(gates + GDN_THREADS - 1) / GDN_THREADS, GDN_THREADS, 0, st>>>(
        b, a, g->a_log, g->dt_bias, g->n_v_head, n_tok);
    if (CUDA_LAUNCH_CHECK("gdn_gate_kernel", err, errlen) < 0) return -1;
    int threads = (g->v_dim + 31) / 32 * 32;
    size_t shmem = sizeof(float) * (2 * (size_t)g->k_dim + 32);
    gdn_head_kernel<<<ns * g->n_v_head, threads, shmem, st>>>(out, qkv, z, b, a, *g, seq);
    return CUDA_LAUNCH_CHECK("gdn_head_kernel", err, errlen);
}

/* --- Mamba2 --------------------------------------------------------------------------------- */

static __global__ void mamba_dt_kernel(float *dt, const float *dt_bias, int H, int n_tok,
                                       float lo, float hi)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tok * H) return;
    float x = dt[i] + dt_bias[i % H];
    float d = x > 20.0f ? x : log1pf(expf(x));
    dt[i] = d < lo ? lo : d > hi ? hi : d;
}

/* One block per (sequence, head), thread p < head_dim owning row p of S (P, N). */
static __global__ void mamba_head_kernel(float *out, const float *xbc, const float *dt,
                                         struct be_mamba m, const int32_t *seq)
{
    int H = m.n_head, P = m.head_dim, N = m.d_state, G = m.n_group;
    int s = blockIdx.x / H, h = blockIdx.x % H, grp = h / (H / G), p = threadIdx.x;
    int t0 = seq[4 * s], n = seq[4 * s + 1], slot = seq[4 * s + 2], fresh = seq[4 * s + 3];
    if (p >= P) return;
    size_t C = (size_t)H * P + 2 * (size_t)G * N, I = (size_t)H * P;
    float *row = m.ssm_state + (((size_t)slot * H + h) * P + p) * (size_t)N;
    if (fresh)
        for (int j = 0; j < N; j++) row[j] = 0.0f;
    float A = -expf(m.a_log[h]), D = m.d_skip[h];
    for (int t = 0; t < n; t++) {
        const float *x = xbc + (size_t)(t0 + t) * C;
        const float *B = x + I + (size_t)grp * N, *Cv = x + I + (size_t)G * N + (size_t)grp * N;
        float d = dt[(size_t)(t0 + t) * H + h], da = expf(d * A), xd = x[(size_t)h * P + p] * d;
        float acc = 0.0f;
        for (int j = 0; j < N; j++) {
            float v = row[j] * da + xd * B[j];
            row[j] = v;
            acc += v * Cv[j];
        }
        out[(size_t)(t0 + t) * I + (size_t)h * P + p] = acc + D * x[(size_t)h * P + p];
    }
}

/* One block per (token, group): y = rmsnorm(y * silu(z)) * w over the group. */
static __global__ void mamba_norm_kernel(float *out, const float *z, const float *w, int I,
                                         int G, float eps)
{
    __shared__ float red[32];
    int t = blockIdx.x / G, g = blockIdx.x % G, gs = I / G;
    float *y = out + (size_t)t * I + (size_t)g * gs;
    const float *zz = z + (size_t)t * I + (size_t)g * gs;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        float v = y[i] * gdn_silu(zz[i]);
        y[i] = v;
        ss += v * v;
    }
    ss = cuk_block_sum(ss, red);
    float r = 1.0f / sqrtf(ss / (float)gs + eps);
    for (int i = threadIdx.x; i < gs; i += blockDim.x) y[i] = w[(size_t)g * gs + i] * (y[i] * r);
}

int cuk_mamba2(cudaStream_t st, float *out, float *xbc, const float *z, float *dt,
               const struct be_mamba *m, const int32_t *seq, int ns, int n_tok, char *err,
               size_t errlen)
{
    int C = m->n_head * m->head_dim + 2 * m->n_group * m->d_state;
    if (ns <= 0 || n_tok <= 0) return 0;
    if (m->head_dim > 1024 || m->conv_k > 16) {
        snprintf(err, errlen, "mamba2: heads of %d (at most 1024) or a conv of %d (at most 16)",
                 m->head_dim, m->conv_k);
        return -1;
    }
    int cells = ns * C;
    ssm_conv_kernel<<<(cells + GDN_THREADS - 1) / GDN_THREADS, GDN_THREADS, 0, st>>>(
        xbc, C, m->conv_k, m->conv_w, m->conv_b, m->conv_state, seq, ns);
    if (CUDA_LAUNCH_CHECK("ssm_conv_kernel", err, errlen) < 0) return -1;
    int steps = n_tok * m->n_head;
    mamba_dt_kernel<<<(steps + GDN_THREADS - 1) / GDN_THREADS, GDN_THREADS, 0, st>>>(
        dt, m->dt_bias, m->n_head, n_tok, m->dt_min, m->dt_max);
    if (CUDA_LAUNCH_CHECK("mamba_dt_kernel", err, errlen) < 0) return -1;
    int threads = (m->head_dim + 31) / 32 * 32;
    mamba_head_kernel<<<ns * m->n_head, threads, 0, st>>>(out, xbc, dt, *m, seq);
    if (CUDA_LAUNCH_CHECK("mamba_head_kernel", err, errlen) < 0) return -1;
    mamba_norm_kernel<<<n_tok * m->n_group, 256, 0, st>>>(out, z, m->norm_w,
                                                          m->n_head * m->head_dim, m->n_group,
                                                          m->eps);
    return CUDA_LAUNCH_CHECK("mamba_norm_kernel", err, errlen);
}
