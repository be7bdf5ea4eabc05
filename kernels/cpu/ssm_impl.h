/* The recurrences of hybrid models' state-space layers, written once and compiled by each
 * kernel file with its own instruction set (see gemm.h, gdn_head and mamba_head).
 *
 * The gated delta rule for one value head over the tokens of one sequence: the including file
 * defines GDN_HEAD_NAME. The loops run along the value dimension, where every
 * element is independent (column v of S only ever meets column v of the update), so they
 * vectorize without changing the order of any sum: each output is accumulated over the key
 * dimension in ascending order on every instruction set. */

#define GDN_STRIP 32 /* value columns a strip carries through the tokens (16 KB of state at dk 128) */
#define SSM_BLOCK_FLOATS 4096 /* the state a Mamba2 row block carries through the tokens: 16 KB */
#define SSM_CAT2(a, b) a##b
#define SSM_CAT(a, b) SSM_CAT2(a, b)
#define GDN_STRIP_NAME SSM_CAT(GDN_HEAD_NAME, _strip)

/* Columns [j0, j0 + W) of the state over all n tokens: a strip of dk x W floats stays in L1
 * while the tokens go by (the whole state, dk x dv, would be swept from L2 twice a token). The
 * columns are independent, so this is the token-by-token rule with every sum in the same
 * order: the same results as one token at a time over the whole state. */
static inline __attribute__((always_inline)) void GDN_STRIP_NAME(
    float *S, const float *q, const float *k, size_t ldqk, const float *v, size_t ldv,
    const float *g, const float *beta, size_t ldgb, float *o, size_t ldo, int n, int dk, int dv,
    int j0, int W)
{
    float mem[GDN_STRIP], acc[GDN_STRIP];
    for (int t = 0; t < n; t++) {
        const float *qt = q + (size_t)t * ldqk, *kt = k + (size_t)t * ldqk;
        const float *vt = v + (size_t)t * ldv + j0;
        float *ot = o + (size_t)t * ldo + j0;
        const float eg = expf(g[(size_t)t * ldgb]), bt = beta[(size_t)t * ldgb];
        /* decay, and what the decayed state already recalls for this key: S^T k */
        for (int j = 0; j < W; j++) mem[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv + j0;
            const float ki = kt[i];
            for (int j = 0; j < W; j++) {
                row[j] *= eg;
                mem[j] += row[j] * ki;
            }
        }
        for (int j = 0; j < W; j++) {
            mem[j] = (vt[j] - mem[j]) * bt; /* now the update's value: delta */
            acc[j] = 0.0f;
        }
        /* the rank-one correction, and the read of the new state by the query */
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv + j0;
            const float ki = kt[i], qi = qt[i];
            for (int j = 0; j < W; j++) {
                row[j] += ki * mem[j];
                acc[j] += qi * row[j];
            }
        }
        for (int j = 0; j < W; j++) ot[j] = acc[j];
    }
}

static void GDN_HEAD_NAME(float *S, const float *q, const float *k, size_t ldqk, const float *v,
                          size_t ldv, const float *g, const float *beta, size_t ldgb, float *o,
                          size_t ldo, int n, int dk, int dv)
{
    int j0 = 0;
    for (; j0 + GDN_STRIP <= dv; j0 += GDN_STRIP) /* a constant width: registers, unrolled */
        GDN_STRIP_NAME(S, q, k, ldqk, v, ldv, g, beta, ldgb, o, ldo, n, dk, dv, j0, GDN_STRIP);
    if (j0 < dv)
        GDN_STRIP_NAME(S, q, k, ldqk, v, ldv, g, beta, ldgb, o, ldo, n, dk, dv, j0, dv - j0);
}

/* The Mamba2 recurrence for one head over the tokens of one sequence (the including file also
 * defines MAMBA_HEAD_NAME): state S (P, N); per token t, with the discretized step dt (> 0) and
 * the head's decay rate A (< 0): S = exp(dt A) S + (dt x) B^T, y = S C + D x. The loops run
 * along the state dimension N; each y[p] is summed over it in ascending order. */
static void MAMBA_HEAD_NAME(float *S, const float *x, size_t ldx, const float *B, const float *C,
                            size_t ldbc, const float *dt, size_t lddt, float A, float D, float *y,
                            size_t ldy, int n, int P, int N)
{
    /* rows [p0, p1) of the state through all the tokens, as the delta rule's strips: each
     * row is its own recurrence, so the order of every sum is the token-by-token one */
    int rows = N > 0 && N < SSM_BLOCK_FLOATS ? SSM_BLOCK_FLOATS / N : 1;
    for (int p0 = 0; p0 < P; p0 += rows) {
        int p1 = p0 + rows < P ? p0 + rows : P;
        for (int t = 0; t < n; t++) {
            const float *xt = x + (size_t)t * ldx, *bt = B + (size_t)t * ldbc;
            const float *ct = C + (size_t)t * ldbc;
            float *yt = y + (size_t)t * ldy;
            const float d = dt[(size_t)t * lddt], da = expf(d * A);
            for (int p = p0; p < p1; p++) {
                float *row = S + (size_t)p * N;
                const float xd = xt[p] * d;
                float acc = 0.0f;
                for (int j = 0; j < N; j++) {
                    row[j] = row[j] * da + xd * bt[j];
                    acc += row[j] * ct[j];
                }
                yt[p] = acc + D * xt[p];
            }
        }
    }
}
