/* Portable C kernels: the reference every SIMD table is tested against, and what a CPU without
 * AVX2 runs. Plain loops in the order the definitions in gemm.h and weights.h state. */
#include <math.h>
#include <string.h>

#include "common.h"
#include "gemm.h"

static enum act_kind p_act_kind(enum wtype t, int bf16_compute)
{
    return wtype_is_quant(t) && t != WTYPE_MXFP4 ? ACT_Q8 : ACT_F32;
}

/* x_i . W_r for MXFP4 weights and f32 activations: per block the exact e2m1 values against x,
 * then the block's scale 2^(e - 127). */
static float mx_dot_f32(const struct wmat *w, const float *x, int r)
{
    int nb = wq_blocks(w->cols), t = r / WQ_TILE, lane = r % WQ_TILE;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const unsigned char *rec =
            (const unsigned char *)w->data + wq_record_offset(w->type, w->cols, t, b);
        const unsigned char *nib = rec + WQ_TILE;
        float blk = 0.0f;
        for (int c = 0; c < 32; c++) {
            int quad = c / 4;
            unsigned q = nib[((quad % 4) * WQ_TILE + lane) * 4 + c % 4] >> (4 * (quad / 4));
            blk += mxfp4_value(q) * x[b * 32 + c];
        }
        acc += blk * ldexpf(1.0f, rec[lane] - 127);
    }
    return acc;
}

/* Shared by every table: int8 blocks of 32 with scale amax/127, values rounded to nearest even
 * after multiplying by 127/amax (the SIMD versions compute the same expression). */
static void quantize_row_q8(const float *x, int k, int kp, int8_t *q, float *dx, int32_t *isum)
{
    for (int b = 0; b < kp / 32; b++) {
        float amax = 0.0f;
        for (int c = b * 32; c < b * 32 + 32 && c < k; c++) amax = fmaxf(amax, fabsf(x[c]));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int c = b * 32; c < b * 32 + 32; c++) {
            int v = c < k ? (int)lrintf(x[c] * id) : 0;
            q[c] = (int8_t)v;
            s += v;
        }
        dx[b] = amax / 127.0f;
        isum[b] = s;
    }
}

static void p_act_prepare(enum act_kind kind, int bf16_round, const float *x, size_t ldx, int n,
                          int k, int i0, int i1, void *buf, struct act *out)
{
    int kp = act_kpad(k);
    *out = (struct act){.kind = kind, .n = n, .k = k, .data = buf};
    if (kind == ACT_Q8) {
        act_q8_layout(out, buf, n, k);
        act_q8_rows(out, x, ldx, i0, i1, quantize_row_q8);
        return;
    }
    /* The portable kernels read f32 rows for every float weight type (p_act_kind); a request
     * for another float kind (tests) gets the same, rounded to bf16 for ACT_BF16. */
    out->kind = ACT_F32;
    out->stride = (size_t)kp * sizeof(float);
    int round = bf16_round || kind == ACT_BF16;
    for (int i = i0; i < i1; i++) {
        float *row = (float *)buf + (size_t)i * kp;
        const float *src = x + (size_t)i * ldx;
        for (int c = 0; c < k; c++) row[c] = round ? ms_bf16_to_f32(ms_f32_to_bf16(src[c])) : src[c];
        memset(row + k, 0, sizeof(float) * (size_t)(kp - k));
    }
}

static float w_at(const struct wmat *w, size_t i)
{
    switch (w->type) {
    case WTYPE_F32: return ((const float *)w->data)[i];
    case WTYPE_F16: return ms_f16_to_f32(((const uint16_t *)w->data)[i]);
    case WTYPE_BF16: return ms_bf16_to_f32(((const uint16_t *)w->data)[i]);
    default: return 0.0f;
    }
}

/* x_i . W_r over the quantized tile layout: per block an exact integer dot product, scaled. */
static float q_dot(const struct wmat *w, const struct act *a, int i, int r)
{
    int nb = wq_blocks(w->cols), t = r / WQ_TILE, lane = r % WQ_TILE;
    const int8_t *xq = (const int8_t *)a->data + (size_t)i * a->stride;
    const float *dx = a->dx + (size_t)i * a->nb;
    const int32_t *isum = a->isum + (size_t)i * a->nb;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const unsigned char *rec =
            (const unsigned char *)w->data + wq_record_offset(w->type, w->cols, t, b);
        const uint16_t *scale = (const uint16_t *)rec;
        const int8_t *x = xq + b * 32;
        int32_t p = 0;
        if (w->type == WTYPE_MXFP4) {
            /* twice the e2m1 values, so the scale is 2^(e - 128) */
            const unsigned char *nib = rec + WQ_TILE;
            for (int c = 0; c < 32; c++) {
                int quad = c / 4;
                unsigned q = nib[((quad % 4) * WQ_TILE + lane) * 4 + c % 4] >> (4 * (quad / 4));
                p += mxfp4_value2(q) * x[c];
            }
            acc += ldexpf(1.0f, rec[lane] - 128) * dx[b] * (float)p;
        } else if (w->type == WTYPE_Q8) {
            const int8_t *q = (const int8_t *)(rec + 2 * WQ_TILE);
            for (int c = 0; c < 32; c++) p += (int32_t)q[((c / 4) * WQ_TILE + lane) * 4 + c % 4] * x[c];
            acc += ms_f16_to_f32(scale[lane]) * dx[b] * (float)p;
        } else {
            const unsigned char *nib = rec + 4 * WQ_TILE;
            for (int c = 0; c < 32; c++) {
                int quad = c / 4;
                int v = nib[((quad % 4) * WQ_TILE + lane) * 4 + c % 4] >> (4 * (quad / 4)) & 15;
                p += v * x[c];
            }
            acc += ms_f16_to_f32(scale[lane]) * dx[b] * (float)p +
                   ms_f16_to_f32(scale[WQ_TILE + lane]) * (dx[b] * (float)isum[b]);
        }
    }
    return acc;
}

static void p_gemm(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0, int r1)
{
    int k = w->cols;
    for (int i = 0; i < a->n; i++) {
        const float *x = (const float *)((const char *)a->data + (size_t)i * a->stride);
        for (int r = r0; r < r1; r++) {
            float acc = 0.0f;
            if (w->type == WTYPE_MXFP4 && a->kind == ACT_F32) {
                acc = mx_dot_f32(w, x, r);
            } else if (wtype_is_quant(w->type)) {
                acc = q_dot(w, a, i, r);
            } else {
                size_t base = (size_t)r * k;
                for (int c = 0; c < k; c++) acc += w_at(w, base + c) * x[c];
            }
            y[(size_t)i * ldy + (r - r0)] = acc;
        }
    }
}

static void p_silu_mul(float *out, const float *g, const float *u, int n)
{
    for (int i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void p_swiglu_oai(float *out, const float *g, const float *u, int n, float alpha,
                         float limit)
{
    for (int i = 0; i < n; i++) {
        float gi = g[i] < limit ? g[i] : limit;
        float ui = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        out[i] = (ui + 1.0f) * (gi * (1.0f / (1.0f + expf(-(gi * alpha)))));
    }
}

/* --- attention tiles ------------------------------------------------------------------ */

static void p_kv_cvt(float *dst, const void *src, int n, enum be_kv_type t, float scale)
{
    for (int i = 0; i < n; i++) dst[i] = kv_load(t, src, i, scale);
}

static void p_fa_dots(float *s, const float *q, int R, int d, const float *kf, int ldk)
{
    for (int r = 0; r < R; r++)
        for (int j = 0; j < FA_TK; j++) {
            float acc = 0.0f;
            for (int i = 0; i < d; i++) acc += q[(size_t)r * d + i] * kf[(size_t)j * ldk + i];
            s[(size_t)r * FA_TK + j] = acc;
        }
}

static void p_fa_pv(float *o, const float *p, int R, int dv, const float *vt, int ldv, int cnt)
{
    for (int r = 0; r < R; r++) {
        float *orow = o + (size_t)r * dv;
        for (int j = 0; j < cnt; j++) {
            float pj = p[(size_t)r * FA_TK + j];
            for (int c = 0; c < dv; c++) orow[c] += pj * vt[(size_t)j * ldv + c];
        }
    }
}

static void p_fa_dots_kv(float *s, const float *q, int R, int d, const void *const *k,
                         const float *sc, enum be_kv_type t)
{
    for (int r = 0; r < R; r++)
        for (int j = 0; j < FA_TK; j++) {
            float acc = 0.0f, f = sc ? sc[j] : 1.0f;
            for (int i = 0; i < d; i++) acc += q[(size_t)r * d + i] * kv_load(t, k[j], i, f);
            s[(size_t)r * FA_TK + j] = acc;
        }
}

static void p_fa_pv_kv(float *o, size_t ldo, const float *p, int R, int dv,
                       const void *const *v, const float *sc, int cnt, enum be_kv_type t)
{
    for (int r = 0; r < R; r++) {
        float *orow = o + (size_t)r * ldo;
        for (int j = 0; j < cnt; j++) {
            float pj = p[(size_t)r * FA_TK + j], f = sc ? sc[j] : 1.0f;
            for (int c = 0; c < dv; c++) orow[c] += pj * kv_load(t, v[j], c, f);
        }
    }
}

static float p_fa_max(const float *p, int lo, int hi)
{
    float m = p[lo];
    for (int j = lo + 1; j <= hi; j++) m = p[j] > m ? p[j] : m;
    return m;
}

static float p_fa_exp(float *p, int lo, int hi, float m)
{
    float sum = 0.0f;
    for (int j = 0; j < FA_TK; j++) {
        p[j] = j >= lo && j <= hi ? expf(p[j] - m) : 0.0f;
        sum += p[j];
    }
    return sum;
}

/* --- continuous experts --------------------------------------------------------------- */

/* One neuron's value for one token: the single expression both the per-token and the
 * neuron-major entry points use, so they agree bit for bit. */
static inline float neuron_value(const struct wmat *gate, const struct wmat *up, int f,
                                 const float *x, float coef)
{
    size_t k = (size_t)gate->cols, base = (size_t)f * k;
    float g = 0.0f, u = 0.0f;
    for (size_t c = 0; c < k; c++) {
        g += w_at(gate, base + c) * x[c];
        u += w_at(up, base + c) * x[c];
    }
    return coef * (g / (1.0f + expf(-g))) * u;
}

/* y[c] += h * down_f[c] for c in [c0, c1). */
static inline void neuron_axpy(const struct wmat *down, int f, float h, float *y, int c0, int c1)
{
    size_t base = (size_t)f * (size_t)down->cols;
    for (int c = c0; c < c1; c++) y[c] += h * w_at(down, base + (size_t)c);
}

static void p_neuron_up(const struct wmat *gate, const struct wmat *up, const int32_t *rows,
                        int n, const float *x, const float *coef, float *h)
{
    for (int j = 0; j < n; j++) h[j] = neuron_value(gate, up, rows[j], x, coef[j]);
}

static void p_neuron_down(const struct wmat *down, const int32_t *rows, const float *h, int n,
                          float *y, int c0, int c1)
{
    for (int c = c0; c < c1; c++) y[c] = 0.0f;
    for (int j = 0; j < n; j++) neuron_axpy(down, rows[j], h[j], y, c0, c1);
}

static void p_neuron_up_tok(const struct wmat *gate, const struct wmat *up, int f, const float *x,
                            size_t ldx, const int32_t *tok, const int32_t *slot, int cnt,
                            const float *coef, float *h)
{
    for (int i = 0; i < cnt; i++)
        h[slot[i]] = neuron_value(gate, up, f, x + (size_t)tok[i] * ldx, coef[slot[i]]);
}

static void p_neuron_down_tok(const struct wmat *down, int f, const int32_t *tok,
                              const int32_t *slot, int cnt, const float *h, float *y, size_t ldy,
                              int c0, int c1)
{
    for (int i = 0; i < cnt; i++) neuron_axpy(down, f, h[slot[i]], y + (size_t)tok[i] * ldy, c0, c1);
}

/* ssm_impl.h: GCC vectors of 4 floats (SSE2, NEON or scalar code), strips of 16 columns */
#define SSM_VW 4
#define SSM_SW 16
#define GDN_HEAD_NAME p_gdn_head
#define MAMBA_HEAD_NAME p_mamba_head
#include "ssm_impl.h"

const struct gemm_kernels gemm_portable = {
    .name = "portable",
    .act_kind = p_act_kind,
    .act_prepare = p_act_prepare,
    .gemm = p_gemm,
    .silu_mul = p_silu_mul,
    .swiglu_oai = p_swiglu_oai,
    .kv_cvt = p_kv_cvt,
    .fa_dots = p_fa_dots,
    .fa_pv = p_fa_pv,
    .fa_dots_kv = p_fa_dots_kv,
    .fa_pv_kv = p_fa_pv_kv,
    .fa_max = p_fa_max,
    .fa_exp = p_fa_exp,
    .neuron_up = p_neuron_up,
    .neuron_down = p_neuron_down,
    .neuron_up_tok = p_neuron_up_tok,
    .neuron_down_tok = p_neuron_down_tok,
    .gdn_head = p_gdn_head,
    .mamba_head = p_mamba_head,
};
