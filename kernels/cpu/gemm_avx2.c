/* AVX2 + FMA + F16C kernels, compiled with those instruction sets enabled and only called after
 * gemm.c has checked the CPU. The same structure as the AVX-512 file at 8 lanes: float weights
 * as dot products in tiles of up to 4 x 4 (bf16 widened by shift and mask against even/odd
 * split activations, 16 columns a chunk), quantized weights with 8 output rows a vector. There
 * is no int8 dot-product instruction here: pmaddubsw (unsigned x signed bytes, pairs summed to
 * 16 bits) then pmaddwd by ones does four products a lane. Its 16-bit sums must not saturate,
 * so Q8 weights enter as |x| (unsigned) against the weights with x's sign moved onto them
 * (|q| <= 127: at most 2 * 127 * 127 per pair), and Q4 nibbles (0..15) enter as they are.
 * MXFP4 weights take f32 activations by default (nibbles to exact f32 through an 8-entry table
 * and the sign bit); with int8 activations they become twice their e2m1 value (-12..12, a pshufb
 * table) and then go as Q8's. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "gemm.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

/* --- helpers ------------------------------------------------------------------------------- */

/* The reduction tree every AVX2 dot product uses: lanes i and i + 4, then adjacent pairs. */
static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* hsum of a, b, c, d by the same pairs. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    /* ab: [a(i)+a(i+4) | b(i)+b(i+4)]; hadd twice: [a, c, a, c | b, d, b, d] */
    __m256 h = _mm256_hadd_ps(ab, cd);
    h = _mm256_hadd_ps(h, h);
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline __m256 round_bf16(__m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* exp(x), x clamped to [-87, 88]: the AVX-512 file's method with 2^n made in the exponent. */
static inline __m256 exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Loads of the first `left` (< 8) floats, zero beyond. */
static inline __m256 load_part(const float *p, int left)
{
    if (left >= 8) return _mm256_loadu_ps(p);
    float t[8] = {0};
    if (left > 0) memcpy(t, p, sizeof(float) * (size_t)left);
    return _mm256_loadu_ps(t);
}

/* --- activations --------------------------------------------------------------------------- */

static enum act_kind v_act_kind(enum wtype t, int bf16_compute)
{
    if (t == WTYPE_MXFP4) return ACT_F32;
    if (wtype_is_quant(t)) return ACT_Q8;
    return t == WTYPE_BF16 ? ACT_EO : ACT_F32;
}

static inline float hmax(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static void prep_q8_row(const float *x, int k, int kp, int8_t *q, float *dx, int32_t *isum)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < kp / 32; b++) {
        int c0 = b * 32;
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = load_part(x + c0 + 8 * j, k - c0 - 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        float amax = hmax(mx);
        __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
            sum = _mm256_add_epi32(sum, qi[j]);
        }
        /* 32 int32 -> 32 int8; the packs interleave 128-bit lanes, the permute undoes it */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + c0), p);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        dx[b] = amax / 127.0f;
        isum[b] = _mm_cvtsi128_si32(s4);
    }
}

static void v_act_prepare(enum act_kind kind, int bf16_round, const float *x, size_t ldx, int n,
                          int k, int i0, int i1, void *buf, struct act *out)
{
    int kp = act_kpad(k);
    *out = (struct act){.kind = kind, .n = n, .k = k, .data = buf};
    if (kind == ACT_Q8) {
        act_q8_layout(out, buf, n, k);
        act_q8_rows(out, x, ldx, i0, i1, prep_q8_row);
        return;
    }
    /* ACT_F32 and ACT_EO (an ACT_BF16 request, from tests, is EO rounded to bf16) */
    int eo = kind != ACT_F32, round = bf16_round || kind == ACT_BF16;
    out->kind = eo ? ACT_EO : ACT_F32;
    out->stride = (size_t)kp * 4;
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int i = i0; i < i1; i++) {
        const float *src = x + (size_t)i * ldx;
        float *row = (float *)buf + (size_t)i * kp;
        for (int c0 = 0; c0 < kp; c0 += 16) {
            __m256 a = load_part(src + c0, k - c0), b = load_part(src + c0 + 8, k - c0 - 8);
            if (round) {
                a = round_bf16(a);
                b = round_bf16(b);
            }
            if (eo) {
                /* a = x0..x7, b = x8..x15 -> evens (x0 x2 .. x14), odds (x1 .. x15) */
                __m256 pa = _mm256_permutevar8x32_ps(a, even), pb = _mm256_permutevar8x32_ps(b, even);
                _mm256_storeu_ps(row + c0, _mm256_permute2f128_ps(pa, pb, 0x20));
                _mm256_storeu_ps(row + c0 + 8, _mm256_permute2f128_ps(pa, pb, 0x31));
            } else {
                _mm256_storeu_ps(row + c0, a);
                _mm256_storeu_ps(row + c0 + 8, b);
            }
        }
    }
}

/* --- float weights ------------------------------------------------------------------------- */

/* A chunk of a weight row at column c of k, zero beyond k: 8 floats (f32, f16) or the 16 bf16
 * of an EO chunk. */
static inline __m256 ld_f32(const float *p, int c, int k)
{
    return load_part(p + c, k - c);
}

static inline __m256 ld_f16(const uint16_t *p, int c, int k)
{
    if (k - c >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + c)));
    uint16_t t[8] = {0};
    memcpy(t, p + c, sizeof(uint16_t) * (size_t)(k - c));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
}

static inline __m256i ld_bf16(const uint16_t *p, int c, int k)
{
    if (k - c >= 16) return _mm256_loadu_si256((const __m256i *)(p + c));
    uint16_t t[16] = {0};
    memcpy(t, p + c, sizeof(uint16_t) * (size_t)(k - c));
    return _mm256_loadu_si256((const __m256i *)t);
}

#define TV __m256
#define TVI __m256i
#define TV_W 8
#define TV_ZERO _mm256_setzero_ps
#define TV_LOADU _mm256_loadu_ps
#define TV_FMA _mm256_fmadd_ps
#define TV_SET1_EPI32 _mm256_set1_epi32
#define TV_BF16_EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define TV_BF16_ODD(v, hi) _mm256_castsi256_ps(_mm256_and_si256(v, hi))
#include "gemm_tile.h"

/* --- quantized weights --------------------------------------------------------------------- */

#define QR 4

/* Eight e8m0 scales as 2^(e - 128) (the kernel's integers are twice the e2m1 values): the
 * exponent field e - 1 for e >= 2, the subnormals 2^-127 and 2^-128 for e = 1 and 0. */
static inline __m256 mx_scales8(const unsigned char *p)
{
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i sub = _mm256_srlv_epi32(_mm256_set1_epi32(0x400000),
                                    _mm256_sub_epi32(_mm256_set1_epi32(1), e));
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small));
}

/* Four products a lane summed to int32: u8 x s8 byte pairs through 16 bits (no overflow for
 * the operand ranges in the file comment). */
static inline __m256i dot4(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void
tile_q(enum wtype type, const unsigned char *recs, int nb, const struct act *a, int i0, float *y,
       size_t ldy, int rows, const int R)
{
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    __m256 acc[QR][2];
    const int8_t *xq[QR];
    const float *dx[QR];
    const int32_t *isum[QR];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        xq[i] = (const int8_t *)a->data + (size_t)(i0 + i) * a->stride;
        dx[i] = a->dx + (size_t)(i0 + i) * a->nb;
        isum[i] = a->isum + (size_t)(i0 + i) * a->nb;
    }
    /* MXFP4: twice each e2m1 value, signed, by nibble (a 16-byte table in both lanes) */
    const __m256i mx_lut =
        _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4,
                         6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    size_t rec_bytes = wq_record_bytes(type);
    for (int b = 0; b < nb; b++, recs += rec_bytes) {
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            if (type == WTYPE_MXFP4) {
                d[h] = mx_scales8(recs + 8 * h);
                m[h] = _mm256_setzero_ps();
                continue;
            }
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)recs + h));
            m[h] = type == WTYPE_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(recs + 32) + h))
                                    : _mm256_setzero_ps();
        }
        /* wv[p][h]: quad p (4 columns) of rows 8h..8h+7 */
        __m256i wv[8][2];
        if (type == WTYPE_MXFP4) {
            const unsigned char *q = recs + WQ_TILE;
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++)
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32 * h));
                    wv[p][h] = _mm256_shuffle_epi8(mx_lut, _mm256_and_si256(v, lo4));
                    wv[p + 4][h] =
                        _mm256_shuffle_epi8(mx_lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
                }
        } else if (type == WTYPE_Q8) {
            const __m256i *q = (const __m256i *)(recs + 32);
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) {
                wv[p][0] = _mm256_loadu_si256(q + 2 * p);
                wv[p][1] = _mm256_loadu_si256(q + 2 * p + 1);
            }
        } else {
            const __m256i *q = (const __m256i *)(recs + 64);
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++)
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_loadu_si256(q + 2 * p + h);
                    wv[p][h] = _mm256_and_si256(v, lo4);
                    wv[p + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const int32_t *xb = (const int32_t *)(xq[i] + 32 * b);
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) {
                __m256i xv = _mm256_set1_epi32(xb[p]);
                if (type == WTYPE_Q8 || type == WTYPE_MXFP4) {
                    __m256i ax = _mm256_abs_epi8(xv);
                    s0 = _mm256_add_epi32(s0, dot4(ax, _mm256_sign_epi8(wv[p][0], xv)));
                    s1 = _mm256_add_epi32(s1, dot4(ax, _mm256_sign_epi8(wv[p][1], xv)));
                } else {
                    s0 = _mm256_add_epi32(s0, dot4(wv[p][0], xv));
                    s1 = _mm256_add_epi32(s1, dot4(wv[p][1], xv));
                }
            }
            __m256 sx = _mm256_set1_ps(dx[i][b]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d[0], sx), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d[1], sx), acc[i][1]);
            if (type == WTYPE_Q4) {
                __m256 c = _mm256_set1_ps(dx[i][b] * (float)isum[i][b]);
                acc[i][0] = _mm256_fmadd_ps(m[0], c, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(m[1], c, acc[i][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        float t[16];
        _mm256_storeu_ps(t, acc[i][0]);
        _mm256_storeu_ps(t + 8, acc[i][1]);
        memcpy(y + (size_t)i * ldy, t, sizeof(float) * (size_t)rows);
    }
}

/* Eight e8m0 scales as f32 2^(e - 127): the exponent field e, or the subnormal 2^-127 for e = 0. */
static inline __m256 mx_scales8_f32(const unsigned char *p)
{
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x400000), zero));
}

/* Eight rows' e2m1 codes (low 4 bits of each lane) as f32: the magnitude from an 8-entry table,
 * the code's bit 3 moved to the sign. */
static inline __m256 mx_f32(__m256i code, __m256 lut8)
{
    __m256 m = _mm256_permutevar8x32_ps(lut8, _mm256_and_si256(code, _mm256_set1_epi32(7)));
    __m256i s = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(m, _mm256_castsi256_ps(s));
}

/* MXFP4 against f32 activations, as the AVX-512 file does it, rows 8h..8h+7 from the 32-byte
 * half h of each 64-byte vector. */
static inline __attribute__((always_inline)) void
tile_mx(const unsigned char *recs, int nb, const struct act *a, int i0, float *y, size_t ldy,
        int rows, const int R)
{
    const __m256 lut8 = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256 acc[QR][2];
    const float *x[QR];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        x[i] = (const float *)((const unsigned char *)a->data + (size_t)(i0 + i) * a->stride);
    }
    for (int b = 0; b < nb; b++, recs += WMX4_RECORD) {
        __m256 blk[QR][2];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) blk[i][0] = blk[i][1] = _mm256_setzero_ps();
        const unsigned char *q = recs + WQ_TILE;
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32 * h));
                __m256i vs[4] = {v, _mm256_srli_epi32(v, 8), _mm256_srli_epi32(v, 16),
                                 _mm256_srli_epi32(v, 24)};
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m256 wl = mx_f32(vs[c], lut8), wh = mx_f32(_mm256_srli_epi32(vs[c], 4), lut8);
#pragma GCC unroll 4
                    for (int i = 0; i < R; i++) {
                        const float *xb = x[i] + 32 * b;
                        blk[i][h] = _mm256_fmadd_ps(wl, _mm256_set1_ps(xb[4 * p + c]), blk[i][h]);
                        blk[i][h] =
                            _mm256_fmadd_ps(wh, _mm256_set1_ps(xb[4 * (p + 4) + c]), blk[i][h]);
                    }
                }
            }
        for (int h = 0; h < 2; h++) {
            __m256 sc = mx_scales8_f32(recs + 8 * h);
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) acc[i][h] = _mm256_fmadd_ps(blk[i][h], sc, acc[i][h]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        float t[16];
        _mm256_storeu_ps(t, acc[i][0]);
        _mm256_storeu_ps(t + 8, acc[i][1]);
        memcpy(y + (size_t)i * ldy, t, sizeof(float) * (size_t)rows);
    }
}

#include "gemm_loops.h"

/* --- elementwise and attention ------------------------------------------------------------- */

static void v_silu_mul(float *out, const float *g, const float *u, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void v_swiglu_oai(float *out, const float *g, const float *u, int n, float alpha,
                         float limit)
{
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
    const __m256 one = _mm256_set1_ps(1.0f), nalpha = _mm256_set1_ps(-alpha);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_min_ps(_mm256_loadu_ps(g + i), lim);
        __m256 uv = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(u + i), lim), nlim);
        __m256 e = exp256(_mm256_mul_ps(gv, nalpha));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_add_ps(uv, one), s));
    }
    for (; i < n; i++) {
        float gi = g[i] < limit ? g[i] : limit;
        float ui = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        out[i] = (ui + 1.0f) * (gi * (1.0f / (1.0f + expf(-(gi * alpha)))));
    }
}

/* --- attention tiles ------------------------------------------------------------------- */

/* 8 stored elements of type t from src + i as f32, before any scale (the AVX-512 file's
 * conversions, 8 wide). */
static inline __attribute__((always_inline)) __m256 kv8(enum be_kv_type t, const void *src, int i)
{
    switch (t) {
    case BE_KV_F32: return _mm256_loadu_ps((const float *)src + i);
    case BE_KV_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
    case BE_KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    case BE_KV_FP8_E5M2:
        return _mm256_cvtph_ps(_mm_slli_epi16(
            _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)src + i))), 8));
    case BE_KV_FP8_E4M3: {
        __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)src + i)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    }
    case BE_KV_INT8:
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)src + i))));
    }
    return _mm256_setzero_ps();
}

static inline __attribute__((always_inline)) void v_kv_cvt_t(float *dst, const void *src, int n,
                                                             const enum be_kv_type t, float scale)
{
    const __m256 sv = _mm256_set1_ps(scale);
    const int scaled = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 || t == BE_KV_INT8;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = kv8(t, src, i);
        _mm256_storeu_ps(dst + i, scaled ? _mm256_mul_ps(v, sv) : v);
    }
    for (; i < n; i++) dst[i] = kv_load(t, src, i, scale);
}

static void v_kv_cvt(float *dst, const void *src, int n, enum be_kv_type t, float scale)
{
    switch (t) { /* one loop per type, the type a constant inside */
    case BE_KV_F32: v_kv_cvt_t(dst, src, n, BE_KV_F32, scale); break;
    case BE_KV_BF16: v_kv_cvt_t(dst, src, n, BE_KV_BF16, scale); break;
    case BE_KV_F16: v_kv_cvt_t(dst, src, n, BE_KV_F16, scale); break;
    case BE_KV_FP8_E4M3: v_kv_cvt_t(dst, src, n, BE_KV_FP8_E4M3, scale); break;
    case BE_KV_FP8_E5M2: v_kv_cvt_t(dst, src, n, BE_KV_FP8_E5M2, scale); break;
    case BE_KV_INT8: v_kv_cvt_t(dst, src, n, BE_KV_INT8, scale); break;
    }
}

/* Eight of a row's dot products with the tile's keys k (rows ldk apart): eight accumulators over
 * d, reduced four at a time by hsum4 (the tail of d < 8 through load_part). */
static inline __attribute__((always_inline)) void v_dots8(float *s, const float *q, int d,
                                                          const float *k, int ldk)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (size_t)j * ldk + i), acc[j]);
    }
    if (i < d) {
        __m256 qv = load_part(q + i, d - i);
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(qv, load_part(k + (size_t)j * ldk + i, d - i), acc[j]);
    }
    _mm_storeu_ps(s, hsum4(acc[0], acc[1], acc[2], acc[3]));
    _mm_storeu_ps(s + 4, hsum4(acc[4], acc[5], acc[6], acc[7]));
}

static void v_fa_dots(float *s, const float *q, int R, int d, const float *kf, int ldk)
{
    for (int r = 0; r < R; r++) {
        v_dots8(s + (size_t)r * 16, q + (size_t)r * d, d, kf, ldk);
        v_dots8(s + (size_t)r * 16 + 8, q + (size_t)r * d, d, kf + (size_t)8 * ldk, ldk);
    }
}

/* NV vectors (8 NV columns from c0) of one output row through the tile's cnt values. */
static inline __attribute__((always_inline)) void v_pv_cols(float *o, const float *p,
                                                            const float *vt, int ldv, int cnt,
                                                            int c0, const int NV)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) acc[v] = _mm256_loadu_ps(o + c0 + 8 * v);
    for (int j = 0; j < cnt; j++) {
        __m256 pj = _mm256_set1_ps(p[j]);
        const float *vr = vt + (size_t)j * ldv + c0;
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            acc[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * v), acc[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + c0 + 8 * v, acc[v]);
}

static void v_fa_pv(float *o, const float *p, int R, int dv, const float *vt, int ldv, int cnt)
{
    for (int r = 0; r < R; r++) {
        float *orow = o + (size_t)r * dv;
        const float *pr = p + (size_t)r * FA_TK;
        int c0 = 0;
        for (; c0 + 8 <= dv; c0 += 64) {
            int nv = (dv - c0) / 8;
            switch (nv < 8 ? nv : 8) {
            case 8: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 8); break;
            case 7: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 7); break;
            case 6: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 6); break;
            case 5: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 5); break;
            case 4: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 4); break;
            case 3: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 3); break;
            case 2: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 2); break;
            default: v_pv_cols(orow, pr, vt, ldv, cnt, c0, 1); break;
            }
        }
        c0 = dv / 8 * 8; /* the last dv % 8 columns, one at a time in the same order */
        for (int c = c0; c < dv; c++) {
            float acc = orow[c];
            for (int j = 0; j < cnt; j++) acc = fmaf(pr[j], vt[(size_t)j * ldv + c], acc);
            orow[c] = acc;
        }
    }
}

/* 8 stored elements of type t at src + i as f32 times f for fp8 and int8 (kv_cvt's values);
 * left < 8: the first `left`, zero beyond. */
static inline __attribute__((always_inline)) __m256 kv8s(const enum be_kv_type t, const void *src,
                                                         int i, int left, float f)
{
    const int scaled = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 || t == BE_KV_INT8;
    if (left < 8) {
        float tmp[8] = {0};
        for (int e = 0; e < left; e++) tmp[e] = kv_load(t, src, i + e, f);
        return _mm256_loadu_ps(tmp);
    }
    __m256 v = kv8(t, src, i);
    return scaled ? _mm256_mul_ps(v, _mm256_set1_ps(f)) : v;
}

static inline __attribute__((always_inline)) void v_dots8_kv(float *s, const float *q, int d,
                                                             const void *const *k,
                                                             const float *sc,
                                                             const enum be_kv_type t)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        int left = d - i < 8 ? d - i : 8;
        __m256 qv = load_part(q + i, left);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(qv, kv8s(t, k[j], i, left, sc ? sc[j] : 1.0f), acc[j]);
    }
    _mm_storeu_ps(s, hsum4(acc[0], acc[1], acc[2], acc[3]));
    _mm_storeu_ps(s + 4, hsum4(acc[4], acc[5], acc[6], acc[7]));
}

static inline __attribute__((always_inline)) void v_dots_kv_t(float *s, const float *q, int R,
                                                              int d, const void *const *k,
                                                              const float *sc,
                                                              const enum be_kv_type t)
{
    for (int r = 0; r < R; r++) {
        v_dots8_kv(s + (size_t)r * 16, q + (size_t)r * d, d, k, sc, t);
        v_dots8_kv(s + (size_t)r * 16 + 8, q + (size_t)r * d, d, k + 8, sc ? sc + 8 : NULL, t);
    }
}

static void v_fa_dots_kv(float *s, const float *q, int R, int d, const void *const *k,
                         const float *sc, enum be_kv_type t)
{
    switch (t) {
    case BE_KV_F32: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_F32); break;
    case BE_KV_BF16: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_BF16); break;
    case BE_KV_F16: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_F16); break;
    case BE_KV_FP8_E4M3: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_FP8_E4M3); break;
    case BE_KV_FP8_E5M2: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_FP8_E5M2); break;
    case BE_KV_INT8: v_dots_kv_t(s, q, R, d, k, sc, BE_KV_INT8); break;
    }
}

static inline __attribute__((always_inline)) void v_pv_kv_cols(float *o, const float *p,
                                                               const void *const *v,
                                                               const float *sc, int cnt, int c0,
                                                               const int NV,
                                                               const enum be_kv_type t)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int w = 0; w < NV; w++) acc[w] = _mm256_loadu_ps(o + c0 + 8 * w);
    for (int j = 0; j < cnt; j++) {
        __m256 pj = _mm256_set1_ps(p[j]);
        float f = sc ? sc[j] : 1.0f;
#pragma GCC unroll 8
        for (int w = 0; w < NV; w++)
            acc[w] = _mm256_fmadd_ps(pj, kv8s(t, v[j], c0 + 8 * w, 8, f), acc[w]);
    }
#pragma GCC unroll 8
    for (int w = 0; w < NV; w++) _mm256_storeu_ps(o + c0 + 8 * w, acc[w]);
}

static inline __attribute__((always_inline)) void v_pv_kv_t(float *o, size_t ldo, const float *p,
                                                            int R, int dv, const void *const *v,
                                                            const float *sc, int cnt,
                                                            const enum be_kv_type t)
{
    for (int r = 0; r < R; r++) {
        float *orow = o + (size_t)r * ldo;
        const float *pr = p + (size_t)r * FA_TK;
        int c0 = 0;
        for (; c0 + 8 <= dv; c0 += 64) {
            int nv = (dv - c0) / 8;
            switch (nv < 8 ? nv : 8) {
            case 8: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 8, t); break;
            case 7: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 7, t); break;
            case 6: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 6, t); break;
            case 5: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 5, t); break;
            case 4: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 4, t); break;
            case 3: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 3, t); break;
            case 2: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 2, t); break;
            default: v_pv_kv_cols(orow, pr, v, sc, cnt, c0, 1, t); break;
            }
        }
        for (int c = dv / 8 * 8; c < dv; c++) { /* the last dv % 8 columns, as v_fa_pv */
            float acc = orow[c];
            for (int j = 0; j < cnt; j++) acc = fmaf(pr[j], kv_load(t, v[j], c, sc ? sc[j] : 1.0f), acc);
            orow[c] = acc;
        }
    }
}

static void v_fa_pv_kv(float *o, size_t ldo, const float *p, int R, int dv,
                       const void *const *v, const float *sc, int cnt, enum be_kv_type t)
{
    switch (t) {
    case BE_KV_F32: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_F32); break;
    case BE_KV_BF16: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_BF16); break;
    case BE_KV_F16: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_F16); break;
    case BE_KV_FP8_E4M3: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_FP8_E4M3); break;
    case BE_KV_FP8_E5M2: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_FP8_E5M2); break;
    case BE_KV_INT8: v_pv_kv_t(o, ldo, p, R, dv, v, sc, cnt, BE_KV_INT8); break;
    }
}

/* Lanes lo .. hi of the 16 (two vectors) as all-ones masks. */
static inline void range8x2(int lo, int hi, __m256 *m0, __m256 *m1)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i l = _mm256_set1_epi32(lo - 1), h = _mm256_set1_epi32(hi + 1);
    __m256i i1 = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
    *m0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, l), _mm256_cmpgt_epi32(h, idx)));
    *m1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i1, l), _mm256_cmpgt_epi32(h, i1)));
}

static float v_fa_max(const float *p, int lo, int hi)
{
    float m = p[lo];
    for (int j = lo + 1; j <= hi; j++) m = p[j] > m ? p[j] : m;
    return m;
}

static float v_fa_exp(float *p, int lo, int hi, float m)
{
    __m256 m0, m1, s = _mm256_set1_ps(m);
    range8x2(lo, hi, &m0, &m1);
    __m256 e0 = _mm256_and_ps(m0, exp256(_mm256_sub_ps(_mm256_loadu_ps(p), s)));
    __m256 e1 = _mm256_and_ps(m1, exp256(_mm256_sub_ps(_mm256_loadu_ps(p + 8), s)));
    _mm256_storeu_ps(p, e0);
    _mm256_storeu_ps(p + 8, e1);
    return hsum(_mm256_add_ps(e0, e1));
}

/* --- continuous experts ------------------------------------------------------------------ */

/* 8 elements of a float row (f32, f16 or bf16) from column c of k as f32, zero beyond k. */
static inline __attribute__((always_inline)) __m256 ld8(const int type, const void *row, int c,
                                                        int k)
{
    if (type == WTYPE_F32) return load_part((const float *)row + c, k - c);
    const uint16_t *p = (const uint16_t *)row + c;
    __m128i h;
    if (k - c >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t t[8] = {0};
        memcpy(t, p, sizeof(uint16_t) * (size_t)(k - c));
        h = _mm_loadu_si128((const __m128i *)t);
    }
    if (type == WTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void st8(float *y, __m256 v, int n)
{
    if (n >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(y, t, sizeof(float) * (size_t)n);
}

#define NV __m256
#define NV_W 8
#define NV_LD ld8
#define NV_LDX(x, c, k) load_part((x) + (c), (k) - (c))
#define NV_ZERO _mm256_setzero_ps
#define NV_SET1 _mm256_set1_ps
#define NV_FMA _mm256_fmadd_ps
#define NV_HSUM4 hsum4
#define NV_STORE st8
#define NV_UP v_neuron_up
#define NV_DOWN v_neuron_down
#define NV_UP_TOK v_neuron_up_tok
#define NV_DOWN_TOK v_neuron_down_tok
#include "neuron_impl.h"

/* ssm_impl.h: strips of 32 columns, 4 vectors (at 64, 3 x 8 vectors of sums spill) */
#define SSM_VW 8
#define SSM_SW 32
#define GDN_HEAD_NAME v_gdn_head
#define MAMBA_HEAD_NAME v_mamba_head
#include "ssm_impl.h"

const struct gemm_kernels gemm_avx2 = {
    .name = "avx2",
    .act_kind = v_act_kind,
    .act_prepare = v_act_prepare,
    .gemm = gemm_any,
    .silu_mul = v_silu_mul,
    .swiglu_oai = v_swiglu_oai,
    .kv_cvt = v_kv_cvt,
    .fa_dots = v_fa_dots,
    .fa_pv = v_fa_pv,
    .fa_dots_kv = v_fa_dots_kv,
    .fa_pv_kv = v_fa_pv_kv,
    .fa_max = v_fa_max,
    .fa_exp = v_fa_exp,
    .neuron_up = v_neuron_up,
    .neuron_down = v_neuron_down,
    .neuron_up_tok = v_neuron_up_tok,
    .neuron_down_tok = v_neuron_down_tok,
    .gdn_head = v_gdn_head,
    .mamba_head = v_mamba_head,
};

#else
const struct gemm_kernels gemm_avx2 = {.name = "avx2 (not built)"};
#endif
