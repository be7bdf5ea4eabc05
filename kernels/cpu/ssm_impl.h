/* The recurrences of hybrid models' state-space layers, written once and compiled by each
 * kernel file with its own instruction set (see gemm.h, gdn_head and mamba_head).
 *
 * The gated delta rule for one value head over the tokens of one sequence: the including file
 * defines GDN_HEAD_NAME. The loops run along the value dimension, where every
 * element is independent (column v of S only ever meets column v of the update), so they
 * vectorize without changing the order of any sum: each output is accumulated over the key
 * dimension in ascending order on every instruction set. */

static void GDN_HEAD_NAME(float *S, const float *q, const float *k, size_t ldqk, const float *v,
                          size_t ldv, const float *g, const float *beta, size_t ldgb, float *o,
                          size_t ldo, int n, int dk, int dv)
{
    float mem[GDN_MAX_DIM], delta[GDN_MAX_DIM];
    for (int t = 0; t < n; t++) {
        const float *qt = q + (size_t)t * ldqk, *kt = k + (size_t)t * ldqk;
        const float *vt = v + (size_t)t * ldv;
        float *ot = o + (size_t)t * ldo;
        const float eg = expf(g[(size_t)t * ldgb]), bt = beta[(size_t)t * ldgb];
        /* decay, and what the decayed state already recalls for this key: S^T k */
        for (int j = 0; j < dv; j++) mem[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv;
            const float ki = kt[i];
            for (int j = 0; j < dv; j++) {
                row[j] *= eg;
                mem[j] += row[j] * ki;
            }
        }
        for (int j = 0; j < dv; j++) {
            delta[j] = (vt[j] - mem[j]) * bt;
            ot[j] = 0.0f;
        }
        /* the rank-one correction, and the read of the new state by the query */
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv;
            const float ki = kt[i], qi = qt[i];
            for (int j = 0; j < dv; j++) {
                row[j] += ki * delta[j];
                ot[j] += qi * row[j];
            }
        }
    }
}

/* The Mamba2 recurrence for one head over the tokens of one sequence (the including file also
 * defines MAMBA_HEAD_NAME): state S (P, N); per token t, with the discretized step dt (> 0) and
 * the head's decay rate A (< 0): S = exp(dt A) S + (dt x) B^T, y = S C + D x. The loops run
 * along the state dimension N; each y[p] is summed over it in ascending order. */
static void MAMBA_HEAD_NAME(float *S, const float *x, size_t ldx, const float *B, const float *C,
                            size_t ldbc, const float *dt, size_t lddt, float A, float D, float *y,
                            size_t ldy, int n, int P, int N)
{
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * ldx, *bt = B + (size_t)t * ldbc;
        const float *ct = C + (size_t)t * ldbc;
        float *yt = y + (size_t)t * ldy;
        const float d = dt[(size_t)t * lddt], da = expf(d * A);
        for (int p = 0; p < P; p++) {
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
