/* The recurrences of hybrid models' state-space layers (gemm.h gdn_head and mamba_head), written
 * once and compiled by each kernel file with its own vector width. The including file defines
 * SSM_VW (float lanes of a vector: 4, 8 or 16), SSM_SW (the state columns a Gated DeltaNet strip
 * carries, a multiple of SSM_VW) and the function names GDN_HEAD_NAME and MAMBA_HEAD_NAME.
 *
 * Every vector operation is lane by lane (GCC's vector extensions; ISO C mode, so no multiply
 * is contracted into a fused multiply-add), every sum runs over a scalar dimension in one fixed
 * order, and the only sums across lanes (Mamba2's per-row reductions) go through one fixed tree
 * of 16 partial sums: the vector width decides how fast, never what comes out, and the
 * portable, AVX2 and AVX-512 tables agree bit for bit (test_cpu_kernels checks it). */

typedef float ssm_v __attribute__((vector_size(SSM_VW * sizeof(float))));

/* Before the loops over a register block's vectors: unrolled, the block's arrays are registers
 * rather than memory. */
#define SSM_UNROLL _Pragma("GCC unroll 16")

/* Tokens whose decays are computed at once; a Gated DeltaNet strip starts each block with one
 * extra read of its rows (its first token's m). */
#define SSM_TOKENS 64
/* The state a Mamba2 row block carries through a block of tokens: 16 KB, L1-resident. */
#define SSM_BLOCK_FLOATS 4096

static inline __attribute__((always_inline)) ssm_v ssm_zero(void)
{
    return (ssm_v){0};
}

static inline __attribute__((always_inline)) ssm_v ssm_set1(float s)
{
    ssm_v v; /* a loop GCC turns into one broadcast (unrolled, into one insert per lane) */
    for (int l = 0; l < SSM_VW; l++) v[l] = s;
    return v;
}

static inline __attribute__((always_inline)) ssm_v ssm_ld(const float *p)
{
    ssm_v v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void ssm_st(float *p, ssm_v v)
{
    memcpy(p, &v, sizeof v);
}

/* Vector c of a row of `cols` valid floats, zeros past the end; cols is a constant in full
 * strips, where this folds to a plain load. */
static inline __attribute__((always_inline)) ssm_v ssm_ldc(const float *row, int c, int cols)
{
    int left = cols - c * SSM_VW;
    if (left >= SSM_VW) return ssm_ld(row + c * SSM_VW);
    ssm_v v = ssm_zero();
    if (left > 0) memcpy(&v, row + c * SSM_VW, sizeof(float) * (size_t)left);
    return v;
}

static inline __attribute__((always_inline)) void ssm_stc(float *row, int c, int cols, ssm_v v)
{
    int left = cols - c * SSM_VW;
    if (left >= SSM_VW)
        ssm_st(row + c * SSM_VW, v);
    else if (left > 0)
        memcpy(row + c * SSM_VW, &v, sizeof(float) * (size_t)left);
}

/* The sum of 16 partial sums held in 16 / SSM_VW vectors (partial r: the terms whose index is r
 * mod 16), halving: p[r] + p[r + 8], then + 4, + 2, + 1. The same tree for every width. */
static inline __attribute__((always_inline)) float ssm_hsum16(const ssm_v *acc)
{
    float p[16];
    SSM_UNROLL
    for (int a = 0; a < 16 / SSM_VW; a++) ssm_st(p + a * SSM_VW, acc[a]);
    for (int h = 8; h >= 1; h /= 2)
        for (int r = 0; r < h; r++) p[r] += p[r + h];
    return p[0];
}

/* --- Gated DeltaNet ------------------------------------------------------------------------ */

/* Token by token in prefill as in decode, by measurement. The chunked (WY) form, which GPUs use
 * for prefill, does per state element and token the same three products as the recurrence
 * (the recall S^T k, the read S^T q, the rank-one update), as matrix products against the
 * chunk's start state, plus each chunk's C x C work (k_t.k_s, q_t.k_s, the triangular solve);
 * it can win on a CPU only where the recurrence is bound by memory or latency, and the strip
 * below is neither. Written here with chunks of 16 and 32 and register-blocked products, it
 * measured 1.0-1.2x the recurrence's time on AVX-512 and 1.1-1.5x on AVX2 from 8 to 2,048
 * tokens (Zen 4, dk = dv = 128), and it would round differently by how a prompt is split into
 * steps, which bf16 serving amplifies (test_forward compares chunked and one-step prefill). */

/* One token's pass over a strip's rows: row = row * e + k_i d[c], and with the new row in a
 * register the sums acc += q_i row and, for a next token (kn), m += kn_i row. */
static inline __attribute__((always_inline)) void
ssm_gdn_pass(float *S, size_t lds, const float *kt, const float *qt, const float *kn, int dk,
             int cols, ssm_v e, const ssm_v *d, ssm_v *acc, ssm_v *m)
{
    enum { NV = SSM_SW / SSM_VW };
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * lds;
        const ssm_v ki = ssm_set1(kt[i]), qi = ssm_set1(qt[i]);
        const ssm_v kni = ssm_set1(kn ? kn[i] : 0.0f);
        SSM_UNROLL
        for (int c = 0; c < NV; c++) {
            ssm_v r = ssm_ldc(row, c, cols) * e + ki * d[c];
            ssm_stc(row, c, cols, r);
            acc[c] += qi * r;
            if (kn) m[c] += kni * r;
        }
    }
}

/* The gated delta rule token by token on columns [0, cols) of the state (S: dk rows lds apart,
 * cols <= SSM_SW): per token t, with e = exp(g) and m = S^T k over the state before the decay,
 *   delta = beta (v - e m);  S = e S + k delta^T;  o = S^T q.
 * One pass over the strip's rows per token updates each row and, with the row in a register,
 * sums the output and the next token's m: each row is loaded and stored once a token, and the
 * sums are 2 x SSM_SW / SSM_VW independent chains, enough to keep the multipliers busy (the
 * previous form, decay and recall in one pass and update and read in another, waited on one
 * chain per vector). The columns are independent, so a strip (16-32 KB at dk 128) stays in L1
 * through the tokens, and every sum runs over the key dimension in ascending order whatever
 * the strip: the results do not depend on how a sequence's tokens are split into calls. */
static inline __attribute__((always_inline)) void
ssm_gdn_strip(float *S, size_t lds, const float *q, const float *k, size_t ldqk, const float *v,
              size_t ldv, const float *eg, const float *beta, size_t ldb, float *o, size_t ldo,
              int n, int dk, int cols)
{
    enum { NV = SSM_SW / SSM_VW };
    ssm_v m[NV];
    SSM_UNROLL
    for (int c = 0; c < NV; c++) m[c] = ssm_zero();
    for (int i = 0; i < dk; i++) {
        const float *row = S + (size_t)i * lds;
        const ssm_v ki = ssm_set1(k[i]);
        SSM_UNROLL
        for (int c = 0; c < NV; c++) m[c] += ssm_ldc(row, c, cols) * ki;
    }
    for (int t = 0; t < n; t++) {
        const float *kt = k + (size_t)t * ldqk, *qt = q + (size_t)t * ldqk;
        const float *vt = v + (size_t)t * ldv;
        const ssm_v e = ssm_set1(eg[t]), b = ssm_set1(beta[(size_t)t * ldb]);
        ssm_v d[NV], acc[NV];
        SSM_UNROLL
        for (int c = 0; c < NV; c++) {
            d[c] = b * (ssm_ldc(vt, c, cols) - e * m[c]);
            acc[c] = m[c] = ssm_zero();
        }
        if (t + 1 < n)
            ssm_gdn_pass(S, lds, kt, qt, kt + ldqk, dk, cols, e, d, acc, m);
        else
            ssm_gdn_pass(S, lds, kt, qt, NULL, dk, cols, e, d, acc, m);
        float *ot = o + (size_t)t * ldo;
        SSM_UNROLL
        for (int c = 0; c < NV; c++) ssm_stc(ot, c, cols, acc[c]);
    }
}

static void GDN_HEAD_NAME(float *S, const float *q, const float *k, size_t ldqk, const float *v,
                          size_t ldv, const float *g, const float *beta, size_t ldgb, float *o,
                          size_t ldo, int n, int dk, int dv)
{
    float eg[SSM_TOKENS];
    for (int t0 = 0; t0 < n; t0 += SSM_TOKENS) {
        int nb = n - t0 < SSM_TOKENS ? n - t0 : SSM_TOKENS;
        for (int t = 0; t < nb; t++) eg[t] = expf(g[(size_t)(t0 + t) * ldgb]);
        const float *qb = q + (size_t)t0 * ldqk, *kb = k + (size_t)t0 * ldqk;
        const float *vb = v + (size_t)t0 * ldv, *bb = beta + (size_t)t0 * ldgb;
        float *ob = o + (size_t)t0 * ldo;
        int j0 = 0;
        for (; j0 + SSM_SW <= dv; j0 += SSM_SW) /* a constant width: registers, no tails */
            ssm_gdn_strip(S + j0, (size_t)dv, qb, kb, ldqk, vb + j0, ldv, eg, bb, ldgb, ob + j0,
                          ldo, nb, dk, SSM_SW);
        if (j0 < dv)
            ssm_gdn_strip(S + j0, (size_t)dv, qb, kb, ldqk, vb + j0, ldv, eg, bb, ldgb, ob + j0,
                          ldo, nb, dk, dv - j0);
    }
}

/* --- Mamba2 -------------------------------------------------------------------------------- */

/* The Mamba2 recurrence token by token, state S (P, N): per token t, with the step dt (> 0) and
 * the head's decay rate A (< 0): S = exp(dt A) S + (dt x) B^T, y = S C + D x. Rows of the state
 * are blocked to stay in L1 through a block of tokens (each row is its own recurrence); a row's
 * y is summed over N as 16 partial sums (index mod 16, ascending) and ssm_hsum16's tree. */
static void MAMBA_HEAD_NAME(float *S, const float *x, size_t ldx, const float *B, const float *C,
                            size_t ldbc, const float *dt, size_t lddt, float A, float D, float *y,
                            size_t ldy, int n, int P, int N)
{
    enum { NA = 16 / SSM_VW };
    float da[SSM_TOKENS];
    int rows = N < SSM_BLOCK_FLOATS ? SSM_BLOCK_FLOATS / N : 1;
    int nf = N / 16 * 16;
    for (int t0 = 0; t0 < n; t0 += SSM_TOKENS) {
        int nb = n - t0 < SSM_TOKENS ? n - t0 : SSM_TOKENS;
        for (int t = 0; t < nb; t++) da[t] = expf(dt[(size_t)(t0 + t) * lddt] * A);
        for (int p0 = 0; p0 < P; p0 += rows) {
            int p1 = p0 + rows < P ? p0 + rows : P;
            for (int t = 0; t < nb; t++) {
                size_t tt = (size_t)(t0 + t);
                const float *xt = x + tt * ldx, *bt = B + tt * ldbc, *ct = C + tt * ldbc;
                const float d = dt[tt * lddt];
                const ssm_v e = ssm_set1(da[t]);
                float *yt = y + tt * ldy;
                for (int p = p0; p < p1; p++) {
                    float *row = S + (size_t)p * N;
                    const ssm_v xd = ssm_set1(xt[p] * d);
                    ssm_v acc[NA];
                    SSM_UNROLL
                    for (int a = 0; a < NA; a++) acc[a] = ssm_zero();
                    for (int j = 0; j < nf; j += 16) {
                        SSM_UNROLL
                        for (int a = 0; a < NA; a++) {
                            float *rj = row + j + a * SSM_VW;
                            ssm_v r = ssm_ld(rj) * e + xd * ssm_ld(bt + j + a * SSM_VW);
                            ssm_st(rj, r);
                            acc[a] += r * ssm_ld(ct + j + a * SSM_VW);
                        }
                    }
                    if (nf < N) { /* the last partial group of 16, zeros past N */
                        SSM_UNROLL
                        for (int a = 0; a < NA; a++) {
                            int c = nf / SSM_VW + a;
                            ssm_v r = ssm_ldc(row, c, N) * e + xd * ssm_ldc(bt, c, N);
                            ssm_stc(row, c, N, r);
                            acc[a] += r * ssm_ldc(ct, c, N);
                        }
                    }
                    yt[p] = ssm_hsum16(acc) + D * xt[p];
                }
            }
        }
    }
}
