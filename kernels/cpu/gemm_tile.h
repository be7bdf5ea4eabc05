/* The float-weight tile kernel (f32, f16 and bf16 weights), written once and compiled by each
 * SIMD file (gemm_avx2.c, gemm_avx512.c) with its own vector primitives, before gemm_loops.h.
 * The including file defines ld_f32, ld_f16 and ld_bf16 (a chunk of a weight row at column c
 * of k, zero beyond k: TV_W floats, or the 2 * TV_W bf16 of an even/odd chunk), hsum and hsum4
 * (its reduction tree), and:
 *   TV, TVI            the float and integer vector types, TV_W float lanes
 *   TV_ZERO(), TV_LOADU(const float *p), TV_FMA(a, b, acc) = a * b + acc
 *   TV_SET1_EPI32(v), TV_BF16_EVEN(TVI v), TV_BF16_ODD(TVI v, TVI hi)
 *                      a bf16 chunk's even elements (shifted up) and odd ones (masked by hi)
 *   TV_DPBF16(acc, x, w), TV_LOADI(p)  optional (with both, gemm_any takes TW_BF16_DP for
 *                      ACT_BF16 activations): acc plus the pairwise bf16 products of x and w,
 *                      and an integer vector's load */

/* Float weight kinds of the tile kernel. */
enum { TW_F32, TW_F16, TW_BF16_EO, TW_BF16_DP };

/* R activation rows x C weight rows (R, C <= 4; weight row j at w + j * ldw elements), out
 * y[i * ldy + j * ystep]: one accumulator per pair, chunks of TV_W (f32, f16) or 2 * TV_W (bf16)
 * columns in order. Inlined with constant arguments, so the unrolled accumulators live in
 * registers and the type tests fold away. */
static inline __attribute__((always_inline)) void
tile(const int tw, const void *w, size_t ldw, const unsigned char *x, size_t ldx, int k, float *y,
     size_t ldy, size_t ystep, const int R, const int C)
{
    const TVI hi = TV_SET1_EPI32((int)0xffff0000u);
    const int step = tw == TW_F32 || tw == TW_F16 ? TV_W : 2 * TV_W;
    TV acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[i][j] = TV_ZERO();
    for (int c = 0; c < k; c += step) {
        TV wa[4], wb[4];
        TVI wi[4];
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            if (tw == TW_F32) {
                wa[j] = ld_f32((const float *)w + j * ldw, c, k);
            } else if (tw == TW_F16) {
                wa[j] = ld_f16((const uint16_t *)w + j * ldw, c, k);
            } else {
                wi[j] = ld_bf16((const uint16_t *)w + j * ldw, c, k);
                wa[j] = TV_BF16_EVEN(wi[j]);
                wb[j] = TV_BF16_ODD(wi[j], hi);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const unsigned char *xi = x + i * ldx;
            if (tw == TW_BF16_DP) {
#ifdef TV_DPBF16
                TVI xv = TV_LOADI((const uint16_t *)xi + c);
#pragma GCC unroll 4
                for (int j = 0; j < C; j++) acc[i][j] = TV_DPBF16(acc[i][j], xv, wi[j]);
#endif
            } else if (tw == TW_BF16_EO) {
                TV xe = TV_LOADU((const float *)xi + c);
                TV xo = TV_LOADU((const float *)xi + c + TV_W);
#pragma GCC unroll 4
                for (int j = 0; j < C; j++) {
                    acc[i][j] = TV_FMA(wa[j], xe, acc[i][j]);
                    acc[i][j] = TV_FMA(wb[j], xo, acc[i][j]);
                }
            } else {
                TV xv = TV_LOADU((const float *)xi + c);
#pragma GCC unroll 4
                for (int j = 0; j < C; j++) acc[i][j] = TV_FMA(wa[j], xv, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        if (C == 4) {
            float s[4];
            _mm_storeu_ps(s, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
            for (int j = 0; j < 4; j++) y[(size_t)i * ldy + (size_t)j * ystep] = s[j];
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < C; j++) y[(size_t)i * ldy + (size_t)j * ystep] = hsum(acc[i][j]);
        }
    }
}
