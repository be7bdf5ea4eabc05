/* Paged causal attention for one token and one KV head, written once and compiled by each
 * kernel file with its own vector primitives (see gemm.h, attn_head). The including file
 * defines ATTN_NAME and:
 *   float ATTN_DOT(const float *a, const float *b, int n)
 *   void  ATTN_AXPY(float *y, float a, const float *x, int n)          y += a * x
 *   void  ATTN_EXP(float *x, int n, float sub, float *sum)             x = exp(x - sub), sum
 * Keys are read once for all `group` query heads that share them (GQA). */

static void ATTN_NAME(float *out, const float *q, int group, int hd, const float *k_cache,
                      const float *v_cache, const int32_t *table, int block_size, size_t row,
                      size_t head_off, int start, int pos, float scale, float *scratch)
{
    int len = pos - start + 1;
    for (int t = start; t <= pos; t++) {
        const float *kt = k_cache +
                          ((size_t)table[t / block_size] * block_size + t % block_size) * row +
                          head_off;
        for (int g = 0; g < group; g++)
            scratch[(size_t)g * len + (t - start)] = ATTN_DOT(q + (size_t)g * hd, kt, hd) * scale;
    }
    for (int g = 0; g < group; g++) {
        float *s = scratch + (size_t)g * len;
        float mx = s[0];
        for (int t = 1; t < len; t++) mx = s[t] > mx ? s[t] : mx;
        float sum;
        ATTN_EXP(s, len, mx, &sum);
        float inv = 1.0f / sum;
        for (int t = 0; t < len; t++) s[t] *= inv;
        memset(out + (size_t)g * hd, 0, sizeof(float) * (size_t)hd);
    }
    for (int t = start; t <= pos; t++) {
        const float *vt = v_cache +
                          ((size_t)table[t / block_size] * block_size + t % block_size) * row +
                          head_off;
        for (int g = 0; g < group; g++)
            ATTN_AXPY(out + (size_t)g * hd, scratch[(size_t)g * len + (t - start)], vt, hd);
    }
}
