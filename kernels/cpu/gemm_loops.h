/* The loops around the tile kernels, written once and compiled by each SIMD file (gemm_avx2.c,
 * gemm_avx512.c) after it defines, always inlined and with constant R and C:
 *   tile(tw, w, ldw, x, ldx, k, y, ldy, R, C)   float weights: R activation rows (<= 4) x C
 *                                                 weight rows (4, or 1 at the end of a range)
 *   tile_q(type, recs, nb, a, i0, y, ldy, rows, R)  quantized weights: R activation rows
 *                                                 (<= QR) x one tile of WQ_TILE weight rows
 * Outputs go to y[i * ldy + (r - r0)] (see struct gemm_kernels, gemm). */

/* Activation rows are taken in blocks of XB so that they stay in L2 while a thread's weight
 * rows stream past once per block. */
#define XB 64

static inline __attribute__((always_inline)) void
gemm_float(const int tw, const void *w, size_t esize, int k, const struct act *a, float *y,
           size_t ldy, int r0, int r1)
{
    const unsigned char *wb = w, *xd = a->data;
    size_t ldw = (size_t)k, rb = esize * (size_t)k;
    for (int ib = 0; ib < a->n; ib += XB) {
        int ie = ib + XB < a->n ? ib + XB : a->n;
        int j = r0;
        for (; j + 4 <= r1; j += 4) {
            const void *wj = wb + (size_t)j * rb;
            float *yj = y + (j - r0);
            int i = ib;
            for (; i + 4 <= ie; i += 4)
                tile(tw, wj, ldw, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, 4, 4);
            switch (ie - i) {
            case 3: tile(tw, wj, ldw, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, 3, 4); break;
            case 2: tile(tw, wj, ldw, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, 2, 4); break;
            case 1: tile(tw, wj, ldw, xd + i * a->stride, a->stride, k, yj + i * ldy, ldy, 1, 4); break;
            }
        }
        for (; j < r1; j++)
            for (int i = ib; i < ie; i++)
                tile(tw, wb + (size_t)j * rb, ldw, xd + i * a->stride, a->stride, k,
                     y + i * ldy + (j - r0), ldy, 1, 1);
    }
}

static void gemm_q(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0, int r1)
{
    int nb = wq_blocks(w->cols);
    for (int t = r0 / WQ_TILE; t * WQ_TILE < r1; t++) {
        const unsigned char *recs =
            (const unsigned char *)w->data + wq_record_offset(w->type, w->cols, t, 0);
        int rows = r1 - t * WQ_TILE < WQ_TILE ? r1 - t * WQ_TILE : WQ_TILE;
        float *yt = y + ((size_t)t * WQ_TILE - (size_t)r0);
        int i = 0;
        for (; i + QR <= a->n; i += QR) {
            if (w->type == WTYPE_Q8)
                tile_q(WTYPE_Q8, recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, QR);
            else
                tile_q(WTYPE_Q4, recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, QR);
        }
        for (; i < a->n; i++) {
            if (w->type == WTYPE_Q8)
                tile_q(WTYPE_Q8, recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, 1);
            else
                tile_q(WTYPE_Q4, recs, nb, a, i, yt + (size_t)i * ldy, ldy, rows, 1);
        }
    }
}
