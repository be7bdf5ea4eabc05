/* AVX-512 kernels (F, BW, VL, DQ, VNNI; AVX512-BF16 where the CPU has it), compiled with those
 * instruction sets enabled and only ever called after gemm.c has checked the CPU (cpuid).
 *
 * Float weights (f32, f16, bf16) are read in place, row-major, as a dot product per output:
 * tiles of up to 4 activation rows x 4 weight rows keep 16 accumulators of 16 lanes; every
 * accumulator sees the same chunks in the same order whatever the tile, and is reduced by the
 * same tree (hsum4 matches _mm512_reduce_add_ps), so results do not depend on n or on how rows
 * are split. bf16 weights widen with one shift (even elements) and one mask (odd elements)
 * against activations stored even/odd split (ACT_EO); under bf16 compute, vdpbf16ps takes both
 * as bf16.
 *
 * Quantized weights (weights.h tile layout) put 16 output rows in the 16 lanes: per block of 32,
 * eight vpdpbusd (unsigned weights x signed int8 activations, 4 products per lane each) give the
 * exact integer dot products of 16 rows, then one scale multiply-add. Q8 weights are signed, so
 * they are flipped to unsigned (q + 128) and the block's 128 * sum(x) taken back off, exactly,
 * in integers. MXFP4 nibbles go through a 16-entry table (vpshufb) to twice their e2m1 value
 * plus 12, unsigned; 12 * sum(x) comes back off the same way. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "gemm.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512VNNI__)

/* --- helpers ------------------------------------------------------------------------------- */

static inline __mmask16 mask16(int n)
{
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

static inline __mmask32 mask32(int n)
{
    return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
}

/* The reduction tree of _mm512_reduce_add_ps, written out so that hsum4 can follow it. */
static inline float hsum(__m512 v)
{
    __m256 t3 = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* hsum of a, b, c, d at once, each by the same pairs in the same order as hsum. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    /* lanes i and i + 8 of each vector */
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)));
    /* then i and i + 4: one 128-bit lane per vector */
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)));
    /* then i and i + 2, then 0 and 1 */
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}

static inline __m512 round_bf16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* exp(x) for x in about [-87, 88] (clamped), relative error about 1e-7: x = n ln2 + r with
 * |r| <= ln2/2, a degree-7 polynomial in r (Cephes' expf coefficients), scaled by 2^n. */
static inline __m512 exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* --- activations --------------------------------------------------------------------------- */

static enum act_kind x_act_kind(enum wtype t, int bf16_compute)
{
    if (t == WTYPE_MXFP4) return ACT_F32;
    if (wtype_is_quant(t)) return ACT_Q8;
    if (t == WTYPE_BF16) return bf16_compute && cpu_has_avx512_bf16() ? ACT_BF16 : ACT_EO;
    return ACT_F32;
}

static void prep_q8_row(const float *x, int k, int kp, int8_t *q, float *dx, int32_t *isum)
{
    for (int b = 0; b < kp / 32; b++) {
        int c0 = b * 32, left = k - c0;
        __m512 x0 = _mm512_maskz_loadu_ps(left > 0 ? mask16(left) : 0, x + c0);
        __m512 x1 = _mm512_maskz_loadu_ps(left > 16 ? mask16(left - 16) : 0, x + c0 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
        _mm_storeu_si128((__m128i *)(q + c0), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + c0 + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = amax / 127.0f;
        isum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

static void x_act_prepare(enum act_kind kind, int bf16_round, const float *x, size_t ldx, int n,
                          int k, int i0, int i1, void *buf, struct act *out)
{
    int kp = act_kpad(k);
    *out = (struct act){.kind = kind, .n = n, .k = k, .data = buf};
    if (kind == ACT_Q8) {
        act_q8_layout(out, buf, n, k);
        act_q8_rows(out, x, ldx, i0, i1, prep_q8_row);
        return;
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    out->stride = (size_t)kp * (kind == ACT_BF16 ? 2 : 4);
    for (int i = i0; i < i1; i++) {
        const float *src = x + (size_t)i * ldx;
        unsigned char *row = (unsigned char *)buf + (size_t)i * out->stride;
        for (int c0 = 0; c0 < kp; c0 += 32) {
            int left = k - c0;
            __m512 a = _mm512_maskz_loadu_ps(left > 0 ? mask16(left) : 0, src + c0);
            __m512 b = _mm512_maskz_loadu_ps(left > 16 ? mask16(left - 16) : 0, src + c0 + 16);
            if (kind == ACT_BF16) {
                __m512bh h = _mm512_cvtne2ps_pbh(b, a);
                _mm512_storeu_si512(row + 2 * (size_t)c0, (__m512i)h);
                continue;
            }
            if (bf16_round) {
                a = round_bf16(a);
                b = round_bf16(b);
            }
            float *f = (float *)row + c0;
            if (kind == ACT_EO) {
                _mm512_storeu_ps(f, _mm512_permutex2var_ps(a, even, b));
                _mm512_storeu_ps(f + 16, _mm512_permutex2var_ps(a, odd, b));
            } else {
                _mm512_storeu_ps(f, a);
                _mm512_storeu_ps(f + 16, b);
            }
        }
    }
}

/* --- float weights ------------------------------------------------------------------------- */

/* One chunk of weight row w (element offset c of a row of k) as f32 vector(s): F32 and F16
 * chunks are 16 wide (one vector), BF16 chunks 32 wide (even and odd vectors). */
static inline __m512 ld_f32(const void *w, int c, int k)
{
    const float *p = (const float *)w + c;
    return k - c >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask16(k - c), p);
}

static inline __m512 ld_f16(const void *w, int c, int k)
{
    const uint16_t *p = (const uint16_t *)w + c;
    __m256i h = k - c >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                            : _mm256_maskz_loadu_epi16(mask16(k - c), p);
    return _mm512_cvtph_ps(h);
}

static inline __m512i ld_bf16(const void *w, int c, int k)
{
    const uint16_t *p = (const uint16_t *)w + c;
    return k - c >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask32(k - c), p);
}

#define TV __m512
#define TVI __m512i
#define TV_W 16
#define TV_ZERO _mm512_setzero_ps
#define TV_LOADU _mm512_loadu_ps
#define TV_FMA _mm512_fmadd_ps
#define TV_SET1_EPI32 _mm512_set1_epi32
#define TV_BF16_EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define TV_BF16_ODD(v, hi) _mm512_castsi512_ps(_mm512_and_si512(v, hi))
#ifdef __AVX512BF16__
#define TV_LOADI _mm512_loadu_si512
#define TV_DPBF16(acc, x, w) _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(w))
#endif
#include "gemm_tile.h"

/* --- quantized weights --------------------------------------------------------------------- */

/* R activation rows (<= QR) against one tile of 16 weight rows; y lanes are the tile's rows. */
#define QR 4

/* Sixteen e8m0 scales as 2^(e - 128) (the kernel's integers are twice the e2m1 values): the
 * exponent field e - 1 for e >= 2, the subnormals 2^-127 and 2^-128 for e = 1 and 0. */
static inline __m512 mx_scales(__m128i e8)
{
    __m512i e = _mm512_cvtepu8_epi32(e8);
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i sub = _mm512_srlv_epi32(_mm512_set1_epi32(0x400000),
                                    _mm512_sub_epi32(_mm512_set1_epi32(1), e));
    __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
}

static inline __attribute__((always_inline)) void
tile_q(enum wtype type, const unsigned char *recs, int nb, const struct act *a, int i0, float *y,
       size_t ldy, int rows, const int R)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80), lo4 = _mm512_set1_epi8(0x0f);
    __m512 acc[QR];
    const int8_t *xq[QR];
    const float *dx[QR];
    const int32_t *isum[QR];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
    {
        acc[i] = _mm512_setzero_ps();
        xq[i] = (const int8_t *)a->data + (size_t)(i0 + i) * a->stride;
        dx[i] = a->dx + (size_t)(i0 + i) * a->nb;
        isum[i] = a->isum + (size_t)(i0 + i) * a->nb;
    }
    /* MXFP4: twice each e2m1 value plus 12, by nibble (a 16-byte table in every lane) */
    const __m512i mx_lut = _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    size_t rec_bytes = wq_record_bytes(type);
    for (int b = 0; b < nb; b++, recs += rec_bytes) {
        __m512 d, m = _mm512_setzero_ps();
        if (type == WTYPE_MXFP4) {
            d = mx_scales(_mm_loadu_si128((const __m128i *)recs));
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)recs));
            if (type == WTYPE_Q4) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(recs + 32)));
        }
        __m512i wv[8];
        if (type == WTYPE_MXFP4) {
            const unsigned char *q = recs + WQ_TILE;
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            {
                __m512i v = _mm512_loadu_si512(q + 64 * p);
                wv[p] = _mm512_shuffle_epi8(mx_lut, _mm512_and_si512(v, lo4));
                wv[p + 4] = _mm512_shuffle_epi8(mx_lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
            }
        } else if (type == WTYPE_Q8) {
            const __m512i *q = (const __m512i *)(recs + 32);
            _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) wv[p] =
                _mm512_xor_si512(_mm512_loadu_si512(q + p), flip);
        } else {
            const __m512i *q = (const __m512i *)(recs + 64);
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            {
                __m512i v = _mm512_loadu_si512(q + p);
                wv[p] = _mm512_and_si512(v, lo4);
                wv[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        {
            const int32_t *xb = (const int32_t *)(xq[i] + 32 * b);
            __m512i s = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) s =
                _mm512_dpbusd_epi32(s, wv[p], _mm512_set1_epi32(xb[p]));
            if (type == WTYPE_Q8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * isum[i][b]));
            if (type == WTYPE_MXFP4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(12 * isum[i][b]));
            __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(dx[i][b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[i]);
            if (type == WTYPE_Q4)
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx[i][b] * (float)isum[i][b]), acc[i]);
        }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _mm512_mask_storeu_ps(y + (size_t)i * ldy, mask16(rows), acc[i]);
}

/* Sixteen e8m0 scales as f32 2^(e - 127): the exponent field e, or the subnormal 2^-127 for
 * e = 0. */
static inline __m512 mx_scales_f32(const unsigned char *p)
{
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    return _mm512_castsi512_ps(
        _mm512_mask_blend_epi32(zero, _mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x400000)));
}

/* MXFP4 against f32 activations: a 64-byte vector of a record holds 4 columns of the 16 rows
 * per nibble half; byte i of each lane is column 4p + i (low nibble) and 4(p + 4) + i (high),
 * turned into the 16 rows' f32 weights by one vpermps over the e2m1 table. */
static inline __attribute__((always_inline)) void
tile_mx(const unsigned char *recs, int nb, const struct act *a, int i0, float *y, size_t ldy,
        int rows, const int R)
{
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i lo4 = _mm512_set1_epi32(0x0f);
    __m512 acc[QR];
    const float *x[QR];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
    {
        acc[i] = _mm512_setzero_ps();
        x[i] = (const float *)((const unsigned char *)a->data + (size_t)(i0 + i) * a->stride);
    }
    for (int b = 0; b < nb; b++, recs += WMX4_RECORD) {
        __m512 blk[QR];
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) blk[i] = _mm512_setzero_ps();
        const unsigned char *q = recs + WQ_TILE;
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
        {
            __m512i v = _mm512_loadu_si512(q + 64 * p);
            __m512i vs[4] = {v, _mm512_srli_epi32(v, 8), _mm512_srli_epi32(v, 16),
                             _mm512_srli_epi32(v, 24)};
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            {
                __m512 wl = _mm512_permutexvar_ps(_mm512_and_si512(vs[c], lo4), lut);
                __m512 wh =
                    _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(vs[c], 4), lo4), lut);
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
                {
                    const float *xb = x[i] + 32 * b;
                    blk[i] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[4 * p + c]), blk[i]);
                    blk[i] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[4 * (p + 4) + c]), blk[i]);
                }
            }
        }
        __m512 sc = mx_scales_f32(recs);
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(blk[i], sc, acc[i]);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _mm512_mask_storeu_ps(y + (size_t)i * ldy, mask16(rows), acc[i]);
}

#include "gemm_loops.h"

/* --- elementwise and attention ------------------------------------------------------------- */

static void x_silu_mul(float *out, const float *g, const float *u, int n)
{
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, uv));
    }
}

static void x_swiglu_oai(float *out, const float *g, const float *u, int n, float alpha,
                         float limit)
{
    const __m512 lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
    const __m512 one = _mm512_set1_ps(1.0f), nalpha = _mm512_set1_ps(-alpha);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        __m512 gv = _mm512_min_ps(_mm512_maskz_loadu_ps(m, g + i), lim);
        __m512 uv = _mm512_max_ps(_mm512_min_ps(_mm512_maskz_loadu_ps(m, u + i), lim), nlim);
        __m512 e = exp512(_mm512_mul_ps(gv, nalpha));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_add_ps(uv, one), s));
    }
}

/* --- attention tiles ------------------------------------------------------------------- */

/* 16 stored elements of type t from src + i (the first `m` lanes) as f32, before any scale:
 * bf16 widens by a shift; f16 and both fp8 types go through F16C (an e5m2 byte is the top half
 * of an f16; an e4m3 byte's bits moved into an f16 read 2^-8 of its value); int8 converts. */
static inline __attribute__((always_inline)) __m512 kv16(enum be_kv_type t, const void *src,
                                                         int i, __mmask16 m)
{
    switch (t) {
    case BE_KV_F32: return _mm512_maskz_loadu_ps(m, (const float *)src + i);
    case BE_KV_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + i)), 16));
    case BE_KV_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + i));
    case BE_KV_FP8_E5M2:
        return _mm512_cvtph_ps(_mm256_slli_epi16(
            _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, (const uint8_t *)src + i)), 8));
    case BE_KV_FP8_E4M3: {
        __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, (const uint8_t *)src + i));
        __m256i h = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    }
    case BE_KV_INT8:
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)src + i)));
    }
    return _mm512_setzero_ps();
}

static inline __attribute__((always_inline)) void x_kv_cvt_t(float *dst, const void *src, int n,
                                                             const enum be_kv_type t, float scale)
{
    const __m512 sv = _mm512_set1_ps(scale);
    const int scaled = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 || t == BE_KV_INT8;
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        __m512 v = kv16(t, src, i, m);
        if (scaled) v = _mm512_mul_ps(v, sv);
        _mm512_mask_storeu_ps(dst + i, m, v);
    }
}

static void x_kv_cvt(float *dst, const void *src, int n, enum be_kv_type t, float scale)
{
    switch (t) { /* one loop per type, the type a constant inside */
    case BE_KV_F32: x_kv_cvt_t(dst, src, n, BE_KV_F32, scale); break;
    case BE_KV_BF16: x_kv_cvt_t(dst, src, n, BE_KV_BF16, scale); break;
    case BE_KV_F16: x_kv_cvt_t(dst, src, n, BE_KV_F16, scale); break;
    case BE_KV_FP8_E4M3: x_kv_cvt_t(dst, src, n, BE_KV_FP8_E4M3, scale); break;
    case BE_KV_FP8_E5M2: x_kv_cvt_t(dst, src, n, BE_KV_FP8_E5M2, scale); break;
    case BE_KV_INT8: x_kv_cvt_t(dst, src, n, BE_KV_INT8, scale); break;
    }
}

/* Each row's 16 dot products with the tile's keys: 16 accumulators over d (one chain per key),
 * reduced four at a time by hsum4, the same tree for every row. */
static void x_fa_dots(float *s, const float *q, int R, int d, const float *kf, int ldk)
{
    for (int r = 0; r < R; r++) {
        const float *qr = q + (size_t)r * d;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) {
            __mmask16 m = mask16(d - i);
            __m512 qv = _mm512_maskz_loadu_ps(m, qr + i);
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, kf + (size_t)j * ldk + i), acc[j]);
        }
        __m512 v = _mm512_castps128_ps512(hsum4(acc[0], acc[1], acc[2], acc[3]));
        v = _mm512_insertf32x4(v, hsum4(acc[4], acc[5], acc[6], acc[7]), 1);
        v = _mm512_insertf32x4(v, hsum4(acc[8], acc[9], acc[10], acc[11]), 2);
        v = _mm512_insertf32x4(v, hsum4(acc[12], acc[13], acc[14], acc[15]), 3);
        _mm512_storeu_ps(s + (size_t)r * 16, v);
    }
}

/* Up to NV vectors (16 NV columns from c0) of one output row through the tile's cnt values. */
static inline __attribute__((always_inline)) void x_pv_cols(float *o, const float *p,
                                                            const float *vt, int dv, int ldv,
                                                            int cnt, int c0, const int NV)
{
    __m512 acc[8];
    __mmask16 m[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) {
        m[v] = mask16(dv - c0 - 16 * v);
        acc[v] = _mm512_maskz_loadu_ps(m[v], o + c0 + 16 * v);
    }
    for (int j = 0; j < cnt; j++) {
        __m512 pj = _mm512_set1_ps(p[j]);
        const float *vr = vt + (size_t)j * ldv + c0;
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            acc[v] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[v], vr + 16 * v), acc[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) _mm512_mask_storeu_ps(o + c0 + 16 * v, m[v], acc[v]);
}

static void x_fa_pv(float *o, const float *p, int R, int dv, const float *vt, int ldv, int cnt)
{
    for (int r = 0; r < R; r++) {
        float *orow = o + (size_t)r * dv;
        const float *pr = p + (size_t)r * FA_TK;
        for (int c0 = 0; c0 < dv; c0 += 128) {
            int nv = (dv - c0 + 15) / 16;
            switch (nv < 8 ? nv : 8) {
            case 8: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 8); break;
            case 7: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 7); break;
            case 6: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 6); break;
            case 5: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 5); break;
            case 4: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 4); break;
            case 3: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 3); break;
            case 2: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 2); break;
            default: x_pv_cols(orow, pr, vt, dv, ldv, cnt, c0, 1); break;
            }
        }
    }
}

/* 16 stored elements of type t at src + i (lanes of m) as f32 times f (fp8, int8: the
 * values kv_cvt writes into a tile). */
static inline __attribute__((always_inline)) __m512 kv16s(const enum be_kv_type t, const void *src,
                                                          int i, __mmask16 m, float f)
{
    __m512 v = kv16(t, src, i, m);
    if (t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 || t == BE_KV_INT8)
        v = _mm512_mul_ps(v, _mm512_set1_ps(f));
    return v;
}

/* RB rows' dot products with KB of the tile's keys (RB * KB = 16 accumulators), each stored key
 * converted once for the RB rows; every (row, key) sum is the same sequence of FMAs over d and
 * the same hsum4 tree as fa_dots', whatever RB and KB. */
static inline __attribute__((always_inline)) void x_dots_kv_blk(float *s, const float *q, int d,
                                                                const void *const *k,
                                                                const float *sc, int j0,
                                                                const int RB, const int KB,
                                                                const enum be_kv_type t)
{
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < RB * KB; a++) acc[a] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        __mmask16 m = mask16(d - i);
        __m512 qv[4];
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) qv[r] = _mm512_maskz_loadu_ps(m, q + (size_t)r * d + i);
#pragma GCC unroll 16
        for (int j = 0; j < KB; j++) {
            __m512 kvv = kv16s(t, k[j0 + j], i, m, sc ? sc[j0 + j] : 1.0f);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) acc[r * KB + j] = _mm512_fmadd_ps(qv[r], kvv, acc[r * KB + j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < KB; j += 4)
            _mm_storeu_ps(s + (size_t)r * 16 + j0 + j,
                          hsum4(acc[r * KB + j], acc[r * KB + j + 1], acc[r * KB + j + 2],
                                acc[r * KB + j + 3]));
}

static inline __attribute__((always_inline)) void x_dots_kv_t(float *s, const float *q, int R,
                                                              int d, const void *const *k,
                                                              const float *sc,
                                                              const enum be_kv_type t)
{
    int r = 0;
    for (; r + 4 <= R; r += 4)
        for (int j0 = 0; j0 < 16; j0 += 4)
            x_dots_kv_blk(s + (size_t)r * 16, q + (size_t)r * d, d, k, sc, j0, 4, 4, t);
    for (; r + 2 <= R; r += 2)
        for (int j0 = 0; j0 < 16; j0 += 8)
            x_dots_kv_blk(s + (size_t)r * 16, q + (size_t)r * d, d, k, sc, j0, 2, 8, t);
    for (; r < R; r++) x_dots_kv_blk(s + (size_t)r * 16, q + (size_t)r * d, d, k, sc, 0, 1, 16, t);
}

static void x_fa_dots_kv(float *s, const float *q, int R, int d, const void *const *k,
                         const float *sc, enum be_kv_type t)
{
    switch (t) {
    case BE_KV_F32: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_F32); break;
    case BE_KV_BF16: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_BF16); break;
    case BE_KV_F16: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_F16); break;
    case BE_KV_FP8_E4M3: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_FP8_E4M3); break;
    case BE_KV_FP8_E5M2: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_FP8_E5M2); break;
    case BE_KV_INT8: x_dots_kv_t(s, q, R, d, k, sc, BE_KV_INT8); break;
    }
}

/* RB output rows (ldo apart) through the tile's cnt value rows, NV vectors from column c0, each
 * stored value converted once for the RB rows (RB * NV <= 16). */
static inline __attribute__((always_inline)) void x_pv_kv_cols(float *o, size_t ldo,
                                                               const float *p,
                                                               const void *const *v,
                                                               const float *sc, int dv, int cnt,
                                                               int c0, const int RB, const int NV,
                                                               const enum be_kv_type t)
{
    __m512 acc[16];
    __mmask16 m[8];
#pragma GCC unroll 8
    for (int w = 0; w < NV; w++) m[w] = mask16(dv - c0 - 16 * w);
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int w = 0; w < NV; w++)
            acc[r * NV + w] = _mm512_maskz_loadu_ps(m[w], o + (size_t)r * ldo + c0 + 16 * w);
    for (int j = 0; j < cnt; j++) {
        __m512 pj[2];
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) pj[r] = _mm512_set1_ps(p[(size_t)r * FA_TK + j]);
        float f = sc ? sc[j] : 1.0f;
#pragma GCC unroll 8
        for (int w = 0; w < NV; w++) {
            __m512 vv = kv16s(t, v[j], c0 + 16 * w, m[w], f);
#pragma GCC unroll 2
            for (int r = 0; r < RB; r++) acc[r * NV + w] = _mm512_fmadd_ps(pj[r], vv, acc[r * NV + w]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int w = 0; w < NV; w++)
            _mm512_mask_storeu_ps(o + (size_t)r * ldo + c0 + 16 * w, m[w], acc[r * NV + w]);
}

/* RB rows from r: 16-column chunks, 16 / RB vectors at a time. */
static inline __attribute__((always_inline)) void x_pv_kv_rows(float *o, size_t ldo,
                                                               const float *p,
                                                               const void *const *v,
                                                               const float *sc, int dv, int cnt,
                                                               const int RB,
                                                               const enum be_kv_type t)
{
    const int step = 16 / RB * 16;
    for (int c0 = 0; c0 < dv; c0 += step) {
        int nv = (dv - c0 + 15) / 16;
        if (RB == 2) {
            switch (nv < 8 ? nv : 8) {
            case 8: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 8, t); break;
            case 7: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 7, t); break;
            case 6: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 6, t); break;
            case 5: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 5, t); break;
            case 4: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 4, t); break;
            case 3: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 3, t); break;
            case 2: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 2, t); break;
            default: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 2, 1, t); break;
            }
        } else {
            switch (nv < 8 ? nv : 8) {
            case 8: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 8, t); break;
            case 7: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 7, t); break;
            case 6: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 6, t); break;
            case 5: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 5, t); break;
            case 4: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 4, t); break;
            case 3: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 3, t); break;
            case 2: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 2, t); break;
            default: x_pv_kv_cols(o, ldo, p, v, sc, dv, cnt, c0, 1, 1, t); break;
            }
        }
    }
}

static inline __attribute__((always_inline)) void x_pv_kv_t(float *o, size_t ldo, const float *p,
                                                            int R, int dv, const void *const *v,
                                                            const float *sc, int cnt,
                                                            const enum be_kv_type t)
{
    int r = 0;
    for (; r + 2 <= R; r += 2)
        x_pv_kv_rows(o + (size_t)r * ldo, ldo, p + (size_t)r * FA_TK, v, sc, dv, cnt, 2, t);
    for (; r < R; r++)
        x_pv_kv_rows(o + (size_t)r * ldo, ldo, p + (size_t)r * FA_TK, v, sc, dv, cnt, 1, t);
}

static void x_fa_pv_kv(float *o, size_t ldo, const float *p, int R, int dv,
                       const void *const *v, const float *sc, int cnt, enum be_kv_type t)
{
    switch (t) {
    case BE_KV_F32: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_F32); break;
    case BE_KV_BF16: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_BF16); break;
    case BE_KV_F16: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_F16); break;
    case BE_KV_FP8_E4M3: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_FP8_E4M3); break;
    case BE_KV_FP8_E5M2: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_FP8_E5M2); break;
    case BE_KV_INT8: x_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_INT8); break;
    }
}

static inline __mmask16 range16(int lo, int hi)
{
    return (__mmask16)(mask16(hi + 1) & ~mask16(lo));
}

static float x_fa_max(const float *p, int lo, int hi)
{
    return _mm512_mask_reduce_max_ps(range16(lo, hi), _mm512_loadu_ps(p));
}

static float x_fa_exp(float *p, int lo, int hi, float m)
{
    __m512 e = _mm512_maskz_mov_ps(range16(lo, hi),
                                   exp512(_mm512_sub_ps(_mm512_loadu_ps(p), _mm512_set1_ps(m))));
    _mm512_storeu_ps(p, e);
    return hsum(e);
}

/* --- continuous experts ------------------------------------------------------------------ */

/* 16 elements of a float row (f32, f16 or bf16) from column c of k as f32, zero beyond k. */
static inline __attribute__((always_inline)) __m512 ld16(const int type, const void *row, int c,
                                                         int k)
{
    __mmask16 m = mask16(k - c);
    if (type == WTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)row + c);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + c);
    if (type == WTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void st16(float *y, __m512 v, int n)
{
    _mm512_mask_storeu_ps(y, mask16(n), v);
}

#define NV __m512
#define NV_W 16
#define NV_LD ld16
#define NV_LDX(x, c, k) _mm512_maskz_loadu_ps(mask16((k) - (c)), (x) + (c))
#define NV_ZERO _mm512_setzero_ps
#define NV_SET1 _mm512_set1_ps
#define NV_FMA _mm512_fmadd_ps
#define NV_HSUM4 hsum4
#define NV_STORE st16
#define NV_UP x_neuron_up
#define NV_DOWN x_neuron_down
#define NV_UP_TOK x_neuron_up_tok
#define NV_DOWN_TOK x_neuron_down_tok
#include "neuron_impl.h"

/* ssm_impl.h: strips of 64 columns, 4 vectors (measured ~25% faster than 32 on Zen 4) */
#define SSM_VW 16
#define SSM_SW 64
#define GDN_HEAD_NAME x_gdn_head
#define MAMBA_HEAD_NAME x_mamba_head
#include "ssm_impl.h"

const struct gemm_kernels gemm_avx512 = {
    .name = "avx512",
    .act_kind = x_act_kind,
    .act_prepare = x_act_prepare,
    .gemm = gemm_any,
    .silu_mul = x_silu_mul,
    .swiglu_oai = x_swiglu_oai,
    .kv_cvt = x_kv_cvt,
    .fa_dots = x_fa_dots,
    .fa_pv = x_fa_pv,
    .fa_dots_kv = x_fa_dots_kv,
    .fa_pv_kv = x_fa_pv_kv,
    .fa_max = x_fa_max,
    .fa_exp = x_fa_exp,
    .neuron_up = x_neuron_up,
    .neuron_down = x_neuron_down,
    .neuron_up_tok = x_neuron_up_tok,
    .neuron_down_tok = x_neuron_down_tok,
    .gdn_head = x_gdn_head,
    .mamba_head = x_mamba_head,
};

#else
/* Not an x86-64 build with AVX-512: an empty table that gemm_kernels_avx512 never returns. */
const struct gemm_kernels gemm_avx512 = {.name = "avx512 (not built)"};
#endif
