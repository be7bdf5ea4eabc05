/* Paged causal attention for one token and one KV head, written once and compiled by each
 * kernel file with its own vector primitives (see gemm.h, attn_head_ex). The including file
 * defines ATTN_NAME_EX, ATTN_W (positions per batch, <= 16), optionally ATTN_NAME (the
 * plain-GQA entry point attn_head), and:
 *   void ATTN_DOTS(float *s, const float *q, const float *const *k, int cnt, int hd, float scale)
 *        s[j] = scale * (q . k[j]) for j < cnt, each reduced in a fixed order whatever cnt
 *   void ATTN_EXP(float *x, int n, float sub, float *sum)     x = exp(x - sub), sum of x
 *   void ATTN_AXPYS(float *y, const float *p, const float *const *v, int cnt, int hd)
 *        y += sum over j < cnt of p[j] * v[j]
 * Keys and values are read once for all `group` query heads that share them (GQA; every head
 * for MLA's one latent), ATTN_W positions at a time, so reductions and the output's loads and
 * stores are shared too. Keys are hdk wide, values hdv (MLA: the latent plus rope key, and the
 * latent alone, both read from one cache row). A sink (gpt-oss) is one more logit in each
 * head's softmax denominator that takes no value. */

static void ATTN_NAME_EX(float *out, const float *q, int group, int hdk, int hdv,
                         const float *k_cache, const float *v_cache, const int32_t *table,
                         int block_size, size_t krow, size_t vrow, size_t koff, size_t voff,
                         int start, int pos, float scale, const float *sinks, float *scratch)
{
    int len = pos - start + 1;
    const float *rows[ATTN_W];
    for (int t0 = start; t0 <= pos; t0 += ATTN_W) {
        int cnt = pos + 1 - t0 < ATTN_W ? pos + 1 - t0 : ATTN_W;
        for (int j = 0; j < cnt; j++) {
            int t = t0 + j;
            rows[j] = k_cache + ((size_t)table[t / block_size] * block_size + t % block_size) * krow +
                      koff;
        }
        for (int g = 0; g < group; g++)
            ATTN_DOTS(scratch + (size_t)g * len + (t0 - start), q + (size_t)g * hdk, rows, cnt, hdk,
                      scale);
    }
    for (int g = 0; g < group; g++) {
        float *s = scratch + (size_t)g * len;
        float mx = s[0];
        for (int t = 1; t < len; t++) mx = s[t] > mx ? s[t] : mx;
        if (sinks && sinks[g] > mx) mx = sinks[g];
        float sum;
        ATTN_EXP(s, len, mx, &sum);
        if (sinks) sum += expf(sinks[g] - mx);
        float inv = 1.0f / sum;
        for (int t = 0; t < len; t++) s[t] *= inv;
        memset(out + (size_t)g * hdv, 0, sizeof(float) * (size_t)hdv);
    }
    for (int t0 = start; t0 <= pos; t0 += ATTN_W) {
        int cnt = pos + 1 - t0 < ATTN_W ? pos + 1 - t0 : ATTN_W;
        for (int j = 0; j < cnt; j++) {
            int t = t0 + j;
            rows[j] = v_cache + ((size_t)table[t / block_size] * block_size + t % block_size) * vrow +
                      voff;
        }
        for (int g = 0; g < group; g++)
            ATTN_AXPYS(out + (size_t)g * hdv, scratch + (size_t)g * len + (t0 - start), rows, cnt,
                       hdv);
    }
}

#ifdef ATTN_NAME
static void ATTN_NAME(float *out, const float *q, int group, int hd, const float *k_cache,
                      const float *v_cache, const int32_t *table, int block_size, size_t row,
                      size_t head_off, int start, int pos, float scale, float *scratch)
{
    ATTN_NAME_EX(out, q, group, hd, hd, k_cache, v_cache, table, block_size, row, row, head_off,
                 head_off, start, pos, scale, NULL, scratch);
}
#endif
