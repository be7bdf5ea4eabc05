/* CPU kernels (kernels/cpu/gemm*.c) and weight formats (kernels/weights.c): every SIMD table
 * this CPU can run against the portable C table, and the portable table against a double
 * precision reference, on random shapes with ragged tails (k, m and n not multiples of any
 * vector width), for every weight type; plus the claims the engine relies on: a row's result
 * does not depend on how many rows are computed with it or on how the output rows are split
 * between threads (bit for bit), and int8 activations quantize to the same bytes on every
 * table. Also f16 conversion (exhaustive), quantization error bounds, MXFP4 repacking and
 * dequantization (exact), SiLU, the continuous-experts (neuron) kernels and the state-space
 * recurrences (Gated DeltaNet, Mamba2); attention is test_attention.c's. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/gemm.h"
#include "test.h"
#include "weights.h"

static uint64_t rng = 0x243f6a8885a308d3ull;

static float urand(float lo, float hi)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    uint64_t r = rng * 2685821657736338717ull;
    return lo + (hi - lo) * (float)((double)(r >> 40) / (double)(1ull << 24));
}

static void *xalloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) return NULL;
    return p;
}

/* Every f16 value survives f16 -> f32 -> f16; halfway cases round to even. */
static void test_f16(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue; /* NaN payloads */
        float f = ms_f16_to_f32((uint16_t)h);
        if (ms_f32_to_f16(f) != h) bad++;
        /* the midpoint to the next value up (same sign) rounds to the even one */
        uint32_t next = h + 1;
        if ((h & 0x7fff) < 0x7bff && (next & 0x7c00) != 0x7c00) {
            double mid = ((double)f + (double)ms_f16_to_f32((uint16_t)next)) / 2;
            uint16_t want = (h & 1) ? (uint16_t)next : (uint16_t)h;
            if (ms_f32_to_f16((float)mid) != want) bad++;
        }
    }
    CHECKF(bad == 0, "f16 round trip / rounding: %d values wrong", bad);
    CHECK(ms_f32_to_f16(1e6f) == 0x7c00 && ms_f32_to_f16(-1e6f) == 0xfc00);
    CHECK(ms_f32_to_f16(65504.0f) == 0x7bff);
}

/* Quantized rows dequantize within half a step of the original. */
static void test_quant_bounds(void)
{
    int shapes[][2] = {{1, 1}, {5, 31}, {16, 32}, {17, 33}, {40, 100}, {3, 300}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int rows = shapes[s][0], cols = shapes[s][1];
        float *w = malloc(sizeof(float) * (size_t)rows * cols), *back = malloc(sizeof(float) * cols);
        for (int i = 0; i < rows * cols; i++) w[i] = urand(-2, 2) * (i % 7 == 0 ? 10.0f : 1.0f);
        for (int q = 0; q < 2; q++) {
            enum wtype t = q ? WTYPE_Q4 : WTYPE_Q8;
            void *d = xalloc(wtype_bytes(t, rows, cols));
            wmat_convert(t, d, WSRC_F32, w, rows, cols, 0, rows);
            struct wmat m = {t, rows, cols, d};
            double worst = 0;
            for (int r = 0; r < rows; r++) {
                wmat_row_f32(&m, r, back);
                for (int b = 0; b * 32 < cols; b++) {
                    float lo = INFINITY, hi = -INFINITY, amax = 0;
                    for (int c = b * 32; c < cols && c < b * 32 + 32; c++) {
                        float v = w[(size_t)r * cols + c];
                        lo = fminf(lo, v), hi = fmaxf(hi, v), amax = fmaxf(amax, fabsf(v));
                    }
                    /* half a step, with room for the f16 rounding of scale and min */
                    double step = t == WTYPE_Q8 ? amax / 127.0 : (hi - lo) / 15.0;
                    double bound = 0.5 * step * 1.01 + 1e-3 * fmax(fabs(lo), fabs(hi)) + 1e-7;
                    for (int c = b * 32; c < cols && c < b * 32 + 32; c++) {
                        double err = fabs((double)back[c] - w[(size_t)r * cols + c]);
                        if (err > bound) worst = fmax(worst, err / bound);
                    }
                }
            }
            CHECKF(worst == 0, "%s %dx%d: dequantized error %.2fx its bound", wtype_name(t), rows,
                   cols, worst);
            free(d);
        }
        free(w);
        free(back);
    }
}

/* A double-precision reference of one output: weights dequantized, activations as the kernel
 * reads them (int8 blocks dequantized for Q types, bf16-rounded under bf16 compute). */
static double ref_dot(const struct wmat *w, const float *x, int k, int r, enum act_kind kind,
                      float *row)
{
    wmat_row_f32(w, r, row);
    double s = 0;
    if (kind == ACT_Q8) {
        for (int b = 0; b * 32 < k; b++) {
            float amax = 0;
            for (int c = b * 32; c < k && c < b * 32 + 32; c++) amax = fmaxf(amax, fabsf(x[c]));
            float id = amax > 0 ? 127.0f / amax : 0.0f, dx = amax / 127.0f;
            for (int c = b * 32; c < k && c < b * 32 + 32; c++)
                s += (double)row[c] * (double)lrintf(x[c] * id) * dx;
        }
        return s;
    }
    for (int c = 0; c < k; c++) {
        float xv = kind == ACT_BF16 ? ms_bf16_to_f32(ms_f32_to_bf16(x[c])) : x[c];
        s += (double)row[c] * xv;
    }
    return s;
}

struct run {
    float *y;
    struct act a;
    void *buf;
};

/* y (n, m) with table kk: activations prepared, then output rows in one call. int8: MXFP4
 * weights with int8 activations (what the backend picks under --quantization). */
static void run_gemm(const struct gemm_kernels *kk, const struct wmat *w, const float *x, int n,
                     int k, int bf16, int int8, struct run *out)
{
    enum act_kind kind = int8 ? ACT_Q8 : kk->act_kind(w->type, bf16);
    out->buf = xalloc(gemm_act_bytes(kind, n, k));
    kk->act_prepare(kind, bf16, x, (size_t)k, n, k, 0, n, out->buf, &out->a);
    out->y = malloc(sizeof(float) * (size_t)n * w->rows);
    kk->gemm(w, &out->a, out->y, (size_t)w->rows, 0, w->rows);
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)a[i] - b[i]));
        den = fmax(den, fabs((double)b[i]));
    }
    return den > 0 ? num / den : num;
}

/* Random MXFP4 in the published layout (rows, cols / 32 blocks of 16 bytes; a scale a block):
 * scales around 2^0 with the extremes 0, 1 (subnormal in f32) and 2 mixed in. */
static void random_mxfp4(unsigned char *blocks, unsigned char *scales, int rows, int cols)
{
    for (int i = 0; i < rows * cols / 2; i++) blocks[i] = (unsigned char)(urand(0, 256));
    for (int i = 0; i < rows * cols / 32; i++) {
        int e = 120 + (int)urand(0, 12);
        if (i % 13 == 5) e = i % 3; /* 2^-127, 2^-126, 2^-125 */
        scales[i] = (unsigned char)e;
    }
}

/* MXFP4 as published -> the tile layout and -> f32: both exact against a double-precision
 * dequantization, every other row read (rstep 2, gpt-oss's interleaved gate/up). */
static void test_mxfp4_convert(void)
{
    int shapes[][2] = {{1, 32}, {17, 64}, {33, 96}, {16, 288}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int rows = shapes[s][0], cols = shapes[s][1], src_rows = 2 * rows;
        unsigned char *bl = malloc((size_t)src_rows * cols / 2), *sc = malloc((size_t)src_rows * cols / 32);
        random_mxfp4(bl, sc, src_rows, cols);
        void *mx = xalloc(wtype_bytes(WTYPE_MXFP4, rows, cols));
        float *f = malloc(sizeof(float) * (size_t)rows * cols), *back = malloc(sizeof(float) * cols);
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)rows * cols);
        /* odd rows of the source: pointers one source row in */
        wmat_convert_mxfp4(WTYPE_MXFP4, mx, bl + cols / 2, sc + cols / 32, rows, cols, 2, 0, rows);
        wmat_convert_mxfp4(WTYPE_F32, f, bl + cols / 2, sc + cols / 32, rows, cols, 2, 0, rows);
        wmat_convert_mxfp4(WTYPE_BF16, h, bl + cols / 2, sc + cols / 32, rows, cols, 2, 0, rows);
        struct wmat m = {WTYPE_MXFP4, rows, cols, mx};
        int bad = 0;
        for (int r = 0; r < rows; r++) {
            wmat_row_f32(&m, r, back);
            for (int c = 0; c < cols; c++) {
                size_t sr = (size_t)(2 * r + 1);
                int code = bl[sr * cols / 2 + c / 2] >> (4 * (c & 1)) & 15;
                double want = (double)mxfp4_value((unsigned)code) * pow(2.0, sc[sr * cols / 32 + c / 32] - 127);
                size_t i = (size_t)r * cols + c;
                bad += back[c] != want || f[i] != want || ms_bf16_to_f32(h[i]) != want;
                bad += mxfp4_value2((unsigned)code) != 2 * mxfp4_value((unsigned)code);
            }
        }
        CHECKF(bad == 0, "mxfp4 %dx%d: %d values differ from the exact dequantization", rows, cols, bad);
        free(bl), free(sc), free(mx), free(f), free(back), free(h);
    }
}

static void test_gemm_table(const struct gemm_kernels *kk)
{
    const struct gemm_kernels *ref = gemm_kernels_portable();
    static const int ks[] = {1, 7, 16, 31, 32, 33, 64, 100, 257};
    static const int ms[] = {1, 3, 4, 16, 17, 35};
    static const int ns[] = {1, 2, 3, 4, 5, 9};
    static const enum wtype types[] = {WTYPE_F32, WTYPE_F16, WTYPE_BF16, WTYPE_Q8, WTYPE_Q4,
                                       WTYPE_MXFP4};
    int cases = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        /* bf16: bf16 compute for bf16 weights; int8 activations for MXFP4 ones */
        for (int bf16 = 0; bf16 <= (types[ti] == WTYPE_BF16 || types[ti] == WTYPE_MXFP4); bf16++)
            for (size_t a = 0; a < sizeof ks / sizeof ks[0]; a++)
                for (size_t b = 0; b < sizeof ms / sizeof ms[0]; b++) {
                    int k = ks[a], m = ms[b], n = ns[(a + b) % 6];
                    enum wtype t = types[ti];
                    if (t == WTYPE_MXFP4) k = (k + 31) / 32 * 32; /* whole blocks, as published */
                    float *wf = malloc(sizeof(float) * (size_t)m * k);
                    float *x = malloc(sizeof(float) * (size_t)n * k);
                    for (int i = 0; i < m * k; i++) wf[i] = urand(-1, 1);
                    for (int i = 0; i < n * k; i++) x[i] = urand(-3, 3);
                    void *wd = xalloc(wtype_bytes(t, m, k));
                    if (t == WTYPE_MXFP4) {
                        unsigned char *bl = malloc((size_t)m * k / 2), *sc = malloc((size_t)m * k / 32);
                        random_mxfp4(bl, sc, m, k);
                        wmat_convert_mxfp4(t, wd, bl, sc, m, k, 1, 0, m);
                        free(bl), free(sc);
                    } else {
                        wmat_convert(t, wd, WSRC_F32, wf, m, k, 0, m);
                    }
                    struct wmat w = {t, m, k, wd};
                    struct run rr, rk;
                    int int8 = t == WTYPE_MXFP4 && bf16;
                    if (int8) bf16 = 0;
                    run_gemm(ref, &w, x, n, k, bf16, int8, &rr);
                    run_gemm(kk, &w, x, n, k, bf16, int8, &rk);
                    char what[96];
                    snprintf(what, sizeof what, "%s %s%s n=%d k=%d m=%d", kk->name, wtype_name(t),
                             bf16 ? " (bf16 compute)" : int8 ? " (int8 activations)" : "", n, k, m);
                    /* the table against the portable one */
                    double e = rel_err(rk.y, rr.y, (size_t)n * m);
                    CHECKF(e <= 2e-5, "%s: %.3g from the portable kernels", what, e);
                    /* the portable one against double precision */
                    float *row = malloc(sizeof(float) * (size_t)k);
                    double num = 0, den = 0;
                    enum act_kind kind = rk.a.kind == ACT_Q8 ? ACT_Q8
                                         : bf16                  ? ACT_BF16
                                                                 : ACT_F32;
                    CHECKF((rk.a.kind == ACT_Q8) == (int8 || (wtype_is_quant(t) && t != WTYPE_MXFP4)),
                           "%s: activation kind %d", what, (int)rk.a.kind);
                    for (int i = 0; i < n; i++)
                        for (int r = 0; r < m; r++) {
                            double want = ref_dot(&w, x + (size_t)i * k, k, r, kind, row);
                            num = fmax(num, fabs(rr.y[(size_t)i * m + r] - want));
                            den = fmax(den, fabs(want));
                        }
                    CHECKF(num <= 2e-5 * fmax(den, 1.0), "%s: portable off by %.3g (max %.3g)",
                           what, num, den);
                    /* int8 activations: the same bytes on every table */
                    if (kind == ACT_Q8) {
                        size_t kp = (size_t)act_kpad(k), nb = kp / 32;
                        CHECKF(memcmp(rr.buf, rk.buf, (size_t)n * kp) == 0 &&
                                   memcmp(rr.a.dx, rk.a.dx, sizeof(float) * n * nb) == 0 &&
                                   memcmp(rr.a.isum, rk.a.isum, sizeof(int32_t) * n * nb) == 0,
                               "%s: int8 activations differ from the portable ones", what);
                    }
                    /* each row alone, and the output split in tiles: bit for bit the same */
                    float *y1 = malloc(sizeof(float) * (size_t)m);
                    int same = 1;
                    for (int i = 0; i < n; i++) {
                        struct act one = act_rows(&rk.a, i, 1);
                        kk->gemm(&w, &one, y1, (size_t)m, 0, m);
                        same &= memcmp(y1, rk.y + (size_t)i * m, sizeof(float) * m) == 0;
                        for (int r0 = 0; r0 < m; r0 += WQ_TILE) {
                            int r1 = r0 + WQ_TILE < m ? r0 + WQ_TILE : m;
                            kk->gemm(&w, &one, y1 + r0, (size_t)m, r0, r1);
                        }
                        same &= memcmp(y1, rk.y + (size_t)i * m, sizeof(float) * m) == 0;
                    }
                    CHECKF(same, "%s: a row's result depends on n or on the row split", what);
                    free(y1);
                    free(row);
                    free(rr.y), free(rr.buf), free(rk.y), free(rk.buf);
                    free(wd);
                    free(wf);
                    free(x);
                    cases++;
                    if (int8) bf16 = 1; /* the loop's own variable */
                }
    printf("%-9s gemm: %d cases against portable C and double precision\n", kk->name, cases);
}

static void test_elementwise(const struct gemm_kernels *kk)
{
    enum { N = 1003 };
    float g[N], u[N], a[N], b[N];
    for (int i = 0; i < N; i++) {
        g[i] = i < 8 ? (float)(i - 4) * 30.0f : urand(-20, 20);
        u[i] = urand(-2, 2);
    }
    kk->silu_mul(a, g, u, N);
    gemm_kernels_portable()->silu_mul(b, g, u, N);
    double worst = 0;
    for (int i = 0; i < N; i++) worst = fmax(worst, fabs(a[i] - b[i]) / fmax(fabs(b[i]), 1e-3));
    CHECKF(worst <= 1e-5, "%s silu_mul: relative error %.3g", kk->name, worst);
    /* gpt-oss's clamp (limit 7, alpha 1.702): both sides of both clamps are in g and u */
    for (int i = 0; i < N; i++) u[i] = urand(-10, 10);
    kk->swiglu_oai(a, g, u, N, 1.702f, 7.0f);
    gemm_kernels_portable()->swiglu_oai(b, g, u, N, 1.702f, 7.0f);
    worst = 0;
    for (int i = 0; i < N; i++) worst = fmax(worst, fabs(a[i] - b[i]) / fmax(fabs(b[i]), 1e-3));
    CHECKF(worst <= 1e-5, "%s swiglu_oai: relative error %.3g", kk->name, worst);
}

/* The continuous-experts kernels over gathered rows of f32, f16 and bf16 matrices against
 * double precision; a row's h and a column's y do not depend on which other rows or columns
 * the call was given, and the neuron-major entry points give the per-token values (all bit
 * for bit). */
static void test_neuron(const struct gemm_kernels *kk)
{
    enum { F = 300 };
    static const int ks[] = {192, 100, 37};
    static const int ns[] = {1, 7, 64};
    static const enum wtype types[] = {WTYPE_F32, WTYPE_F16, WTYPE_BF16};
    int cases = 0;
    /* its own random stream: the other tests keep the data they were written with */
    uint64_t saved = rng;
    rng = 0x6a09e667f3bcc909ull;
    for (size_t ti = 0; ti < 3; ti++)
        for (size_t ki = 0; ki < 3; ki++)
            for (size_t ni = 0; ni < 3; ni++) {
                enum wtype t = types[ti];
                int k = ks[ki], n = ns[ni];
                size_t el = t == WTYPE_F32 ? 4 : 2, cnt = (size_t)F * k;
                void *wd[3];
                double *wv[3]; /* the values the kernels see */
                struct wmat w[3];
                for (int m = 0; m < 3; m++) {
                    wd[m] = xalloc(cnt * el);
                    wv[m] = malloc(sizeof(double) * cnt);
                    for (size_t e = 0; e < cnt; e++) {
                        float v = urand(-0.5f, 0.5f);
                        if (t == WTYPE_F32) {
                            ((float *)wd[m])[e] = v;
                            wv[m][e] = v;
                        } else if (t == WTYPE_F16) {
                            ((uint16_t *)wd[m])[e] = ms_f32_to_f16(v);
                            wv[m][e] = ms_f16_to_f32(((uint16_t *)wd[m])[e]);
                        } else {
                            ((uint16_t *)wd[m])[e] = ms_f32_to_bf16(v);
                            wv[m][e] = ms_bf16_to_f32(((uint16_t *)wd[m])[e]);
                        }
                    }
                    w[m] = (struct wmat){.type = t, .rows = F, .cols = k, .data = wd[m]};
                }
                float x[192], coef[64], h[64], h2[64], y[192], y2[192];
                float ref_h[64], ref_y[192];
                int32_t rows[64];
                for (int c = 0; c < k; c++) x[c] = urand(-1, 1);
                for (int j = 0; j < n; j++) {
                    rows[j] = (int32_t)((j * 37 + 11) % F);
                    coef[j] = urand(0.1f, 1.0f);
                }
                for (int j = 0; j < n; j++) {
                    double g = 0, u = 0;
                    for (int c = 0; c < k; c++) {
                        g += wv[0][(size_t)rows[j] * k + c] * x[c];
                        u += wv[1][(size_t)rows[j] * k + c] * x[c];
                    }
                    ref_h[j] = (float)(coef[j] * (g / (1.0 + exp(-g))) * u);
                }
                kk->neuron_up(&w[0], &w[1], rows, n, x, coef, h);
                char what[96];
                snprintf(what, sizeof what, "%s neuron_up %s k=%d n=%d", kk->name, wtype_name(t),
                         k, n);
                CHECKF(rel_err(h, ref_h, (size_t)n) <= 1e-4, "%s: relative error %.3g", what,
                       rel_err(h, ref_h, (size_t)n));
                if (n > 1) {
                    kk->neuron_up(&w[0], &w[1], rows + 1, n - 1, x, coef + 1, h2);
                    CHECKF(memcmp(h + 1, h2, sizeof(float) * (size_t)(n - 1)) == 0,
                           "%s: a row's value depends on the rows computed with it", what);
                }
                for (int c = 0; c < k; c++) {
                    double acc = 0;
                    for (int j = 0; j < n; j++) acc += (double)ref_h[j] * wv[2][(size_t)rows[j] * k + c];
                    ref_y[c] = (float)acc;
                }
                kk->neuron_down(&w[2], rows, ref_h, n, y, 0, k);
                snprintf(what, sizeof what, "%s neuron_down %s k=%d n=%d", kk->name,
                         wtype_name(t), k, n);
                CHECKF(rel_err(y, ref_y, (size_t)k) <= 1e-4, "%s: relative error %.3g", what,
                       rel_err(y, ref_y, (size_t)k));
                int split = k / 3;
                kk->neuron_down(&w[2], rows, ref_h, n, y2, 0, split);
                kk->neuron_down(&w[2], rows, ref_h, n, y2, split, k);
                CHECKF(memcmp(y, y2, sizeof(float) * (size_t)k) == 0,
                       "%s: a column's value depends on the column range", what);
                /* neuron-major: token 0 is x, token 1 a copy (out of order in tok), token 2
                 * another vector; each (token, neuron) bit for bit the per-token value */
                float xs[3][192], hb[3 * 64], yb[3][192], ycheck[192];
                memcpy(xs[0], x, sizeof x), memcpy(xs[1], x, sizeof x);
                for (int c = 0; c < k; c++) xs[2][c] = urand(-1, 1);
                int32_t tk[3] = {1, 0, 2}, sl[3];
                float cf[3 * 64];
                for (int j = 0; j < 3 * n; j++) cf[j] = coef[j % n];
                memset(yb, 0, sizeof yb);
                bool same = true;
                for (int j = 0; j < n; j++) { /* neurons in ascending slot order */
                    for (int q = 0; q < 3; q++) sl[q] = tk[q] * n + j;
                    kk->neuron_up_tok(&w[0], &w[1], rows[j], &xs[0][0], 192, tk, sl, 3, cf, hb);
                    kk->neuron_down_tok(&w[2], rows[j], tk, sl, 3, hb, &yb[0][0], 192, 0, k);
                }
                kk->neuron_down(&w[2], rows, hb, n, y2, 0, k); /* token 0's h */
                same &= memcmp(hb, h, sizeof(float) * (size_t)n) == 0;
                same &= memcmp(hb + n, h, sizeof(float) * (size_t)n) == 0;
                same &= memcmp(yb[0], y2, sizeof(float) * (size_t)k) == 0;
                same &= memcmp(yb[1], y2, sizeof(float) * (size_t)k) == 0;
                kk->neuron_up(&w[0], &w[1], rows, n, xs[2], coef, h2);
                same &= memcmp(hb + 2 * n, h2, sizeof(float) * (size_t)n) == 0;
                kk->neuron_down(&w[2], rows, h2, n, ycheck, 0, k);
                same &= memcmp(yb[2], ycheck, sizeof(float) * (size_t)k) == 0;
                CHECKF(same, "%s %s k=%d n=%d: neuron-major results differ from per-token ones",
                       kk->name, wtype_name(t), k, n);
                for (int m = 0; m < 3; m++) free(wd[m]), free(wv[m]);
                cases++;
            }
    rng = saved;
    printf("%-9s neuron_up/neuron_down (+ neuron-major): %d cases against double precision\n",
           kk->name, cases);
}

/* The gated delta rule in double precision, as gemm.h defines gdn_head; S (dk, dv). */
static void gdn_ref(double *S, const float *q, const float *k, size_t ldqk, const float *v,
                    size_t ldv, const float *g, const float *beta, size_t ldgb, double *o,
                    size_t ldo, int n, int dk, int dv)
{
    double m[512];
    for (int t = 0; t < n; t++) {
        const float *qt = q + t * ldqk, *kt = k + t * ldqk, *vt = v + t * ldv;
        double eg = exp((double)g[t * ldgb]), b = beta[t * ldgb];
        for (int j = 0; j < dv; j++) m[j] = 0;
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++) {
                S[i * dv + j] *= eg;
                m[j] += S[i * dv + j] * kt[i];
            }
        for (int j = 0; j < dv; j++) m[j] = b * (vt[j] - m[j]);
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++) S[i * dv + j] += kt[i] * m[j];
        for (int j = 0; j < dv; j++) {
            double a = 0;
            for (int i = 0; i < dk; i++) a += qt[i] * S[i * dv + j];
            o[t * ldo + j] = a;
        }
    }
}

/* The Mamba2 recurrence in double precision, as gemm.h defines mamba_head; S (P, N). */
static void mamba_ref(double *S, const float *x, size_t ldx, const float *B, const float *C,
                      size_t ldbc, const float *dt, size_t lddt, float A, float D, double *y,
                      size_t ldy, int n, int P, int N)
{
    for (int t = 0; t < n; t++) {
        double d = dt[t * lddt], da = exp(d * A);
        for (int p = 0; p < P; p++) {
            double a = 0;
            for (int j = 0; j < N; j++) {
                double *s = &S[p * N + j];
                *s = *s * da + d * x[t * ldx + p] * B[t * ldbc + j];
                a += *s * C[t * ldbc + j];
            }
            y[t * ldy + p] = a + D * (double)x[t * ldx + p];
        }
    }
}

/* max |a - b| / max |b| over rows of w values ld apart */
static double ref_err(const float *a, const double *b, int rows, size_t ld, int w)
{
    double num = 0, den = 0;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < w; j++) {
            num = fmax(num, fabs(a[r * ld + j] - b[r * ld + j]));
            den = fmax(den, fabs(b[r * ld + j]));
        }
    return den > 0 ? num / den : num;
}

/* The state-space recurrences on ragged shapes (head widths that are no multiple of any
 * vector width, lengths across the kernels' token blocks), rows of a wider buffer as the backend
 * lays them out, a non-zero starting state, and decays from none to total: against double
 * precision, and bit for bit the portable table's results and those of the same tokens in two
 * calls (so the engine's prefill in one step, in chunks and token by token agree exactly). */
static void test_ssm(const struct gemm_kernels *kk)
{
    const struct gemm_kernels *pk = gemm_kernels_portable();
    uint64_t saved = rng;
    double worst_o = 0, worst_s = 0;
    int cases = 0;
    /* Gated DeltaNet: dk, dv, tokens */
    int gshapes[][3] = {{16, 8, 89}, {13, 37, 70}, {128, 128, 130}, {32, 100, 65},
                        {7, 5, 3},   {64, 80, 1},  {128, 128, 200}};
    for (size_t sh = 0; sh < sizeof gshapes / sizeof gshapes[0]; sh++) {
        int dk = gshapes[sh][0], dv = gshapes[sh][1], n = gshapes[sh][2];
        size_t ld = (size_t)(2 * dk + dv + 3), ldgb = 3, ldo = (size_t)dv + 5;
        float *x = malloc(sizeof(float) * n * ld), *g = malloc(sizeof(float) * n * ldgb);
        float *be = malloc(sizeof(float) * n * ldgb), *o[3], *S[3];
        double *so = malloc(sizeof(double) * dk * dv);
        double *ro = calloc((size_t)n * ldo, sizeof(double));
        for (size_t i = 0; i < (size_t)n * ld; i++) x[i] = urand(-1, 1);
        for (int t = 0; t < n; t++) { /* l2-normalized q (scaled) and k, as the backend gives */
            for (int h = 0; h < 2; h++) {
                float *r = x + t * ld + h * dk, ss = 0;
                for (int i = 0; i < dk; i++) ss += r[i] * r[i];
                float sc = (h == 0 ? 1 / sqrtf((float)dk) : 1) / sqrtf(ss);
                for (int i = 0; i < dk; i++) r[i] *= sc;
            }
            g[t * ldgb] = t % 17 == 5 ? -80.0f : t % 11 == 3 ? 0.0f : urand(-2.0f, -0.001f);
            be[t * ldgb] = urand(0.02f, 0.98f);
        }
        for (int c = 0; c < 3; c++) {
            o[c] = calloc((size_t)n * ldo, sizeof(float));
            S[c] = malloc(sizeof(float) * dk * dv);
            for (int i = 0; i < dk * dv; i++) S[c][i] = 0;
        }
        for (int i = 0; i < dk * dv; i++) S[0][i] = S[1][i] = S[2][i] = urand(-0.5f, 0.5f);
        for (int i = 0; i < dk * dv; i++) so[i] = S[0][i];
        const float *q = x, *k = x + dk, *v = x + 2 * dk;
        gdn_ref(so, q, k, ld, v, ld, g, be, ldgb, ro, ldo, n, dk, dv);
        kk->gdn_head(S[0], q, k, ld, v, ld, g, be, ldgb, o[0], ldo, n, dk, dv);
        pk->gdn_head(S[1], q, k, ld, v, ld, g, be, ldgb, o[1], ldo, n, dk, dv);
        int n1 = n / 3; /* two calls: the state carries over */
        kk->gdn_head(S[2], q, k, ld, v, ld, g, be, ldgb, o[2], ldo, n1, dk, dv);
        kk->gdn_head(S[2], q + n1 * ld, k + n1 * ld, ld, v + n1 * ld, ld, g + n1 * ldgb,
                     be + n1 * ldgb, ldgb, o[2] + n1 * ldo, ldo, n - n1, dk, dv);
        double eo = ref_err(o[0], ro, n, ldo, dv), es = ref_err(S[0], so, dk, (size_t)dv, dv);
        worst_o = fmax(worst_o, eo), worst_s = fmax(worst_s, es);
        CHECKF(eo <= 5e-6 && es <= 5e-6,
               "%s gdn_head dk=%d dv=%d n=%d: outputs %.3g, state %.3g from double", kk->name,
               dk, dv, n, eo, es);
        for (int c = 1; c < 3; c++)
            CHECKF(memcmp(o[0], o[c], sizeof(float) * n * ldo) == 0 &&
                       memcmp(S[0], S[c], sizeof(float) * dk * dv) == 0,
                   "%s gdn_head dk=%d dv=%d n=%d: not the bits of %s", kk->name, dk, dv, n,
                   c == 1 ? "the portable table" : "two calls");
        for (int c = 0; c < 3; c++) free(o[c]), free(S[c]);
        free(x), free(g), free(be), free(so), free(ro);
        cases++;
    }
    /* Mamba2: P, N, tokens */
    int mshapes[][3] = {{32, 16, 89}, {5, 13, 40}, {64, 128, 130}, {3, 33, 1}, {17, 100, 20}};
    for (size_t sh = 0; sh < sizeof mshapes / sizeof mshapes[0]; sh++) {
        int P = mshapes[sh][0], N = mshapes[sh][1], n = mshapes[sh][2];
        size_t ld = (size_t)(P + 2 * N + 1), lddt = 2, ldy = (size_t)P + 3;
        float *x = malloc(sizeof(float) * n * ld), *dt = malloc(sizeof(float) * n * lddt);
        float *y[3], *S[3], A = -1.7f, D = 0.6f;
        double *so = malloc(sizeof(double) * P * N), *ry = calloc((size_t)n * ldy, sizeof(double));
        for (size_t i = 0; i < (size_t)n * ld; i++) x[i] = urand(-1, 1);
        for (int t = 0; t < n; t++) dt[t * lddt] = t % 13 == 4 ? 60.0f : urand(0.001f, 0.5f);
        for (int c = 0; c < 3; c++) {
            y[c] = calloc((size_t)n * ldy, sizeof(float));
            S[c] = malloc(sizeof(float) * P * N);
        }
        for (int i = 0; i < P * N; i++) S[0][i] = S[1][i] = S[2][i] = urand(-0.5f, 0.5f);
        for (int i = 0; i < P * N; i++) so[i] = S[0][i];
        const float *B = x + P, *C = x + P + N;
        mamba_ref(so, x, ld, B, C, ld, dt, lddt, A, D, ry, ldy, n, P, N);
        kk->mamba_head(S[0], x, ld, B, C, ld, dt, lddt, A, D, y[0], ldy, n, P, N);
        pk->mamba_head(S[1], x, ld, B, C, ld, dt, lddt, A, D, y[1], ldy, n, P, N);
        int n1 = n / 3;
        kk->mamba_head(S[2], x, ld, B, C, ld, dt, lddt, A, D, y[2], ldy, n1, P, N);
        kk->mamba_head(S[2], x + n1 * ld, ld, B + n1 * ld, C + n1 * ld, ld, dt + n1 * lddt, lddt,
                       A, D, y[2] + n1 * ldy, ldy, n - n1, P, N);
        double eo = ref_err(y[0], ry, n, ldy, P), es = ref_err(S[0], so, P, (size_t)N, N);
        worst_o = fmax(worst_o, eo), worst_s = fmax(worst_s, es);
        CHECKF(eo <= 5e-6 && es <= 5e-6,
               "%s mamba_head P=%d N=%d n=%d: outputs %.3g, state %.3g from double", kk->name, P,
               N, n, eo, es);
        for (int c = 1; c < 3; c++)
            CHECKF(memcmp(y[0], y[c], sizeof(float) * n * ldy) == 0 &&
                       memcmp(S[0], S[c], sizeof(float) * P * N) == 0,
                   "%s mamba_head P=%d N=%d n=%d: not the bits of %s", kk->name, P, N, n,
                   c == 1 ? "the portable table" : "two calls");
        for (int c = 0; c < 3; c++) free(y[c]), free(S[c]);
        free(x), free(dt), free(so), free(ry);
        cases++;
    }
    rng = saved;
    printf("%-9s gdn_head/mamba_head: %d cases, worst %.2e (outputs) %.2e (state) from double\n",
           kk->name, cases, worst_o, worst_s);
}

int main(void)
{
    test_f16();
    test_quant_bounds();
    test_mxfp4_convert();
    const struct gemm_kernels *tables[] = {gemm_kernels_portable(), gemm_kernels_avx2(),
                                           gemm_kernels_avx512()};
    printf("cpu: %s; kernels chosen: %s\n", cpu_features_string(), gemm_kernels_best()->name);
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++) {
        if (!tables[i]) {
            printf("(%s kernels: not run, this CPU lacks them)\n", i == 1 ? "avx2" : "avx512");
            continue;
        }
        test_gemm_table(tables[i]);
        test_elementwise(tables[i]);
        test_neuron(tables[i]);
        test_ssm(tables[i]);
    }
    return test_done("test_cpu_kernels");
}
