/* The loops around the tile kernels, written once and compiled by each SIMD file (gemm_avx2.c,
 * gemm_avx512.c) as its gemm_any (struct gemm_kernels' gemm) after it defines, always inlined
 * and with constant R and C:
 *   tile(tw, w, ldw, x, ldx, k, y, ldy, ystep, R, C)  float weights (gemm_tile.h): R activation
 *                      rows (<= 4) x C weight rows (4, ldw elements apart, or 1), outputs
 *                      ystep apart
 *   tile_q(type, recs, nb, a, i0, y, ldy, rows, R)  quantized weights: R activation rows
 *                                                 (<= QR) x one tile of WQ_TILE weight rows
 *   tile_mx(recs, nb, a, i0, y, ldy, rows, R)     MXFP4 weights against f32 activations, the
 *                                                 same shape
 * Outputs go to y[i * ldy + (r - r0)] (see struct gemm_kernels, gemm). */

/* Activation rows are taken in blocks of XB so that they stay in L2 while a thread's weight
 * rows stream past once per block. */
#define XB 64

/* The four weight rows of a tile are taken a quarter of the range apart (rows j, j + q, j + 2q,
 * j + 3q): four sequential streams, which the hardware prefetchers follow, where four adjacent
 * rows read a chunk at a time run at half the bandwidth (measured on Zen 4). */
static inline __attribute__((always_inline)) void
gemm_float(const int tw, const void *w, size_t esize, int k, const struct act *a, float *y,
           size_t ldy, int r0, int r1)
{
    const unsigned char *wb = w, *xd = a->data;
    size_t ldw = (size_t)k, rb = esize * (size_t)k;
    int q = (r1 - r0) / 4;
    size_t qs = (size_t)q * ldw; /* elements between a tile's rows */
    for (int ib = 0; ib < a->n; ib += XB) {
        int ie = ib + XB < a->n ? ib + XB : a->n;
        for (int j = r0; j < r0 + q; j++) {
            const void *wj = wb + (size_t)j * rb;
            float *yj = y + (j - r0);
            int i = ib;
            for (; i + 4 <= ie; i += 4)
                tile(tw, wj, qs, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, q, 4, 4);
            switch (ie - i) {
            case 3: tile(tw, wj, qs, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, q, 3, 4); break;
            case 2: tile(tw, wj, qs, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, q, 2, 4); break;
            case 1: tile(tw, wj, qs, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, q, 1, 4); break;
            }
        }
        for (int j = r0 + 4 * q; j < r1; j++)
            for (int i = ib; i < ie; i++)
                tile(tw, wb + (size_t)j * rb, ldw, xd + i * a->stride, a->stride, k,
                     y + i * ldy + (j - r0), ldy, 1, 1, 1);
    }
}

/* The loops of gemm_q and gemm_mx: tiles of WQ_TILE weight rows, activation rows QR at a time
 * then one by one; TILE(recs, nb, a, i, y, ldy, rows, R) runs one tile. A macro, so that both
 * compile to what they did when each wrote the loops out. */
#define WQ_TILES(TILE)                                                                             \
    int nb = wq_blocks(w->cols);                                                                   \
    for (int t = r0 / WQ_TILE; t * WQ_TILE < r1; t++) {                                            \
        const unsigned char *recs =                                                                \
            (const unsigned char *)w->data + wq_record_offset(w->type, w->cols, t, 0);             \
        int rows = r1 - t * WQ_TILE < WQ_TILE ? r1 - t * WQ_TILE : WQ_TILE;                        \
        float *yt = y + ((size_t)t * WQ_TILE - (size_t)r0);                                        \
        int i = 0;                                                                                 \
        for (; i + QR <= a->n; i += QR) TILE(recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, QR); \
        for (; i < a->n; i++) TILE(recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, 1);            \
    }

/* The tile_q instance for the weights' type. */
#define TILE_Q_OF_TYPE(recs, nb, a, i, y, ldy, rows, R)                                            \
    {                                                                                              \
        if (w->type == WTYPE_Q8)                                                                   \
            tile_q(WTYPE_Q8, recs, nb, a, i, y, ldy, rows, R);                                     \
        else if (w->type == WTYPE_Q4)                                                              \
            tile_q(WTYPE_Q4, recs, nb, a, i, y, ldy, rows, R);                                     \
        else                                                                                       \
            tile_q(WTYPE_MXFP4, recs, nb, a, i, y, ldy, rows, R);                                  \
    }

static void gemm_q(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0, int r1)
{
    WQ_TILES(TILE_Q_OF_TYPE)
}

/* MXFP4 weights with f32 activations (ACT_F32): each e2m1 nibble becomes its exact f32 value,
 * a block's 32 columns accumulate per row, then the block's power-of-two scale. */
static void gemm_mx(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0,
                    int r1)
{
    WQ_TILES(tile_mx)
}

static void gemm_any(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0,
                     int r1)
{
    switch (w->type) {
    case WTYPE_F32: gemm_float(TW_F32, w->data, 4, w->cols, a, y, ldy, r0, r1); return;
    case WTYPE_F16: gemm_float(TW_F16, w->data, 2, w->cols, a, y, ldy, r0, r1); return;
    case WTYPE_BF16:
#ifdef TV_DPBF16
        if (a->kind == ACT_BF16) {
            gemm_float(TW_BF16_DP, w->data, 2, w->cols, a, y, ldy, r0, r1);
            return;
        }
#endif
        gemm_float(TW_BF16_EO, w->data, 2, w->cols, a, y, ldy, r0, r1);
        return;
    case WTYPE_MXFP4:
        if (a->kind == ACT_F32) {
            gemm_mx(w, a, y, ldy, r0, r1);
            return;
        }
        gemm_q(w, a, y, ldy, r0, r1);
        return;
    case WTYPE_Q8:
    case WTYPE_Q4: gemm_q(w, a, y, ldy, r0, r1); return;
    }
}
