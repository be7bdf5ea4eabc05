/* The continuous-experts kernels (gemm.h neuron_up / neuron_down), written once and compiled by
 * each SIMD kernel file with its own vector primitives. The including file defines NV_UP and
 * NV_DOWN, NV_UP_TOK and NV_DOWN_TOK (the function names), NV (the vector type, NV_W float
 * lanes) and:
 *   NV NV_LD(const int type, const void *row, int c, int k)  NV_W elements of a float row
 *        (WTYPE_F32/F16/BF16, a constant after inlining) from column c as f32, zero beyond k
 *   NV NV_LDX(const float *x, int c, int k)                   the same for an f32 vector
 *   NV_ZERO(), NV_SET1(v), NV_FMA(a, b, acc) = a * b + acc
 *   __m128 NV_HSUM4(a, b, c, d)   the four vectors' sums, each by the file's hsum tree
 *   void NV_STORE(float *y, NV v, int n)                      the first n (<= NV_W) lanes
 * The rows are scattered over the matrix, so the loops are bound by memory latency: the next
 * rows are prefetched while the current ones are summed. */

/* Four rows at a time, gate and up side by side: one accumulator per row and matrix over
 * chunks of NV_W columns in order, reduced by the hsum tree, so a row's value does not depend
 * on its neighbours. */
static inline __attribute__((always_inline)) void
nv_up_typed(const int type, const struct wmat *gate, const struct wmat *up, const int32_t *rows,
            int n, const float *x, const float *coef, float *h)
{
    const int k = gate->cols;
    const size_t rb = (size_t)k * (type == WTYPE_F32 ? 4u : 2u);
    for (int j0 = 0; j0 < n; j0 += 4) {
        const unsigned char *gp[4], *upp[4];
        NV ag[4], au[4];
        for (int r = 0; r < 4; r++) {
            size_t f = (size_t)rows[j0 + r < n ? j0 + r : n - 1];
            gp[r] = (const unsigned char *)gate->data + f * rb;
            upp[r] = (const unsigned char *)up->data + f * rb;
            ag[r] = au[r] = NV_ZERO();
        }
        for (int r = j0 + 4; r < j0 + 8 && r < n; r++)
            for (size_t o = 0; o < rb; o += 64) {
                _mm_prefetch((const char *)gate->data + (size_t)rows[r] * rb + o, _MM_HINT_T0);
                _mm_prefetch((const char *)up->data + (size_t)rows[r] * rb + o, _MM_HINT_T0);
            }
        for (int c = 0; c < k; c += NV_W) {
            NV xv = NV_LDX(x, c, k);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                ag[r] = NV_FMA(NV_LD(type, gp[r], c, k), xv, ag[r]);
                au[r] = NV_FMA(NV_LD(type, upp[r], c, k), xv, au[r]);
            }
        }
        float g[4], u[4];
        _mm_storeu_ps(g, NV_HSUM4(ag[0], ag[1], ag[2], ag[3]));
        _mm_storeu_ps(u, NV_HSUM4(au[0], au[1], au[2], au[3]));
        for (int r = 0; r < 4 && j0 + r < n; r++)
            h[j0 + r] = coef[j0 + r] * (g[r] / (1.0f + expf(-g[r]))) * u[r];
    }
}

static void NV_UP(const struct wmat *gate, const struct wmat *up, const int32_t *rows, int n,
                  const float *x, const float *coef, float *h)
{
    if (up->type != gate->type) {
        gemm_portable.neuron_up(gate, up, rows, n, x, coef, h);
        return;
    }
    switch (gate->type) {
    case WTYPE_F32: nv_up_typed(WTYPE_F32, gate, up, rows, n, x, coef, h); return;
    case WTYPE_F16: nv_up_typed(WTYPE_F16, gate, up, rows, n, x, coef, h); return;
    default: nv_up_typed(WTYPE_BF16, gate, up, rows, n, x, coef, h); return;
    }
}

/* 8 * NV_W columns at a time in eight accumulators, each column summing its rows in order; the
 * row eight ahead is prefetched. */
static inline __attribute__((always_inline)) void
nv_down_typed(const int type, const struct wmat *down, const int32_t *rows, const float *h, int n,
              float *y, int c0, int c1)
{
    const size_t es = type == WTYPE_F32 ? 4u : 2u, rb = (size_t)down->cols * es;
    for (int c = c0; c < c1; c += 8 * NV_W) {
        NV acc[8];
        for (int v = 0; v < 8; v++) acc[v] = NV_ZERO();
        int lim = c + 8 * NV_W < c1 ? c + 8 * NV_W : c1;
        size_t pf0 = (size_t)c * es, pf1 = (size_t)lim * es;
        for (int j = 0; j < n; j++) {
            const unsigned char *p = (const unsigned char *)down->data + (size_t)rows[j] * rb;
            if (j + 8 < n) {
                const char *q = (const char *)down->data + (size_t)rows[j + 8] * rb;
                for (size_t o = pf0; o < pf1; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
            }
            NV hv = NV_SET1(h[j]);
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++)
                if (c + NV_W * v < lim) acc[v] = NV_FMA(hv, NV_LD(type, p, c + NV_W * v, lim), acc[v]);
        }
        for (int v = 0; v < 8 && c + NV_W * v < lim; v++)
            NV_STORE(y + c + NV_W * v, acc[v], lim - c - NV_W * v);
    }
}

static void NV_DOWN(const struct wmat *down, const int32_t *rows, const float *h, int n,
                    float *y, int c0, int c1)
{
    switch (down->type) {
    case WTYPE_F32: nv_down_typed(WTYPE_F32, down, rows, h, n, y, c0, c1); return;
    case WTYPE_F16: nv_down_typed(WTYPE_F16, down, rows, h, n, y, c0, c1); return;
    default: nv_down_typed(WTYPE_BF16, down, rows, h, n, y, c0, c1); return;
    }
}

/* Neuron-major (a batch): one neuron's rows against four tokens at a time, the same chunk
 * order and reduction per (token, neuron) as nv_up_typed. */
static inline __attribute__((always_inline)) void
nv_up_tok_typed(const int type, const struct wmat *gate, const struct wmat *up, int f,
                const float *x, size_t ldx, const int32_t *tok, const int32_t *slot, int cnt,
                const float *coef, float *h)
{
    const int k = gate->cols;
    const size_t rb = (size_t)k * (type == WTYPE_F32 ? 4u : 2u);
    const unsigned char *gp = (const unsigned char *)gate->data + (size_t)f * rb;
    const unsigned char *upp = (const unsigned char *)up->data + (size_t)f * rb;
    for (int i0 = 0; i0 < cnt; i0 += 4) {
        const float *xp[4];
        NV ag[4], au[4];
        for (int r = 0; r < 4; r++) {
            xp[r] = x + (size_t)tok[i0 + r < cnt ? i0 + r : cnt - 1] * ldx;
            ag[r] = au[r] = NV_ZERO();
        }
        for (int c = 0; c < k; c += NV_W) {
            NV gv = NV_LD(type, gp, c, k), uv = NV_LD(type, upp, c, k);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                NV xv = NV_LDX(xp[r], c, k);
                ag[r] = NV_FMA(gv, xv, ag[r]);
                au[r] = NV_FMA(uv, xv, au[r]);
            }
        }
        float g[4], u[4];
        _mm_storeu_ps(g, NV_HSUM4(ag[0], ag[1], ag[2], ag[3]));
        _mm_storeu_ps(u, NV_HSUM4(au[0], au[1], au[2], au[3]));
        for (int r = 0; r < 4 && i0 + r < cnt; r++) {
            int s = slot[i0 + r];
            h[s] = coef[s] * (g[r] / (1.0f + expf(-g[r]))) * u[r];
        }
    }
}

static void NV_UP_TOK(const struct wmat *gate, const struct wmat *up, int f, const float *x,
                      size_t ldx, const int32_t *tok, const int32_t *slot, int cnt,
                      const float *coef, float *h)
{
    if (up->type != gate->type) {
        gemm_portable.neuron_up_tok(gate, up, f, x, ldx, tok, slot, cnt, coef, h);
        return;
    }
    switch (gate->type) {
    case WTYPE_F32: nv_up_tok_typed(WTYPE_F32, gate, up, f, x, ldx, tok, slot, cnt, coef, h); return;
    case WTYPE_F16: nv_up_tok_typed(WTYPE_F16, gate, up, f, x, ldx, tok, slot, cnt, coef, h); return;
    default: nv_up_tok_typed(WTYPE_BF16, gate, up, f, x, ldx, tok, slot, cnt, coef, h); return;
    }
}

/* One neuron's down row into its tokens' outputs, a chunk of the row at a time (converted
 * once for all the tokens): y = h * w + y, the operation nv_down_typed's accumulators do. */
static inline __attribute__((always_inline)) void
nv_down_tok_typed(const int type, const struct wmat *down, int f, const int32_t *tok,
                  const int32_t *slot, int cnt, const float *h, float *y, size_t ldy, int c0,
                  int c1)
{
    const size_t rb = (size_t)down->cols * (type == WTYPE_F32 ? 4u : 2u);
    const unsigned char *p = (const unsigned char *)down->data + (size_t)f * rb;
    for (int c = c0; c < c1; c += NV_W) {
        NV wv = NV_LD(type, p, c, c1);
        int left = c1 - c;
        for (int i = 0; i < cnt; i++) {
            float *yt = y + (size_t)tok[i] * ldy + c;
            NV_STORE(yt, NV_FMA(NV_SET1(h[slot[i]]), wv, NV_LDX(yt, 0, left)), left);
        }
    }
}

static void NV_DOWN_TOK(const struct wmat *down, int f, const int32_t *tok, const int32_t *slot,
                        int cnt, const float *h, float *y, size_t ldy, int c0, int c1)
{
    switch (down->type) {
    case WTYPE_F32: nv_down_tok_typed(WTYPE_F32, down, f, tok, slot, cnt, h, y, ldy, c0, c1); return;
    case WTYPE_F16: nv_down_tok_typed(WTYPE_F16, down, f, tok, slot, cnt, h, y, ldy, c0, c1); return;
    default: nv_down_tok_typed(WTYPE_BF16, down, f, tok, slot, cnt, h, y, ldy, c0, c1); return;
    }
}
