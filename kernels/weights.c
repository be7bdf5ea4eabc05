/* Weight formats: sizes, conversion between float types, quantization into the Q8/Q4 tile
 * layout of weights.h, MXFP4 repacking, and dequantization of a row (for embeddings, tests and reference paths).
 * Load-time code: written for clarity, not speed (the loader runs it over threads). */
#include "weights.h"

#include <math.h>
#include <string.h>

#include "common.h"

const char *wtype_name(enum wtype t)
{
    switch (t) {
    case WTYPE_F32: return "f32";
    case WTYPE_F16: return "f16";
    case WTYPE_BF16: return "bf16";
    case WTYPE_Q8: return "int8";
    case WTYPE_Q4: return "int4";
    case WTYPE_MXFP4: return "mxfp4";
    }
    return "?";
}

size_t wtype_bytes(enum wtype t, int rows, int cols)
{
    size_t n = (size_t)rows * (size_t)cols;
    switch (t) {
    case WTYPE_F32: return 4 * n;
    case WTYPE_F16:
    case WTYPE_BF16: return 2 * n;
    case WTYPE_Q8:
    case WTYPE_Q4:
    case WTYPE_MXFP4: {
        size_t tiles = ((size_t)rows + WQ_TILE - 1) / WQ_TILE;
        return tiles * (size_t)wq_blocks(cols) * wq_record_bytes(t);
    }
    }
    return 0;
}

size_t wtype_align(enum wtype t)
{
    return t == WTYPE_F32 ? 4 : t == WTYPE_F16 || t == WTYPE_BF16 ? 2 : 64;
}

/* Element i of a stored source row, as f32. */
static float src_at(enum wsrc from, const unsigned char *row, size_t i)
{
    if (from == WSRC_F32) {
        float f;
        memcpy(&f, row + 4 * i, sizeof f);
        return f;
    }
    uint16_t h = (uint16_t)(row[2 * i] | (row[2 * i + 1] << 8));
    return from == WSRC_BF16 ? ms_bf16_to_f32(h) : ms_f16_to_f32(h);
}

static size_t src_elem_bytes(enum wsrc from)
{
    return from == WSRC_F32 ? 4 : 2;
}

/* One tile-block of 16 rows x 32 columns (zero beyond the matrix) as f32; element (r, c) of the
 * source is rs * r + cs * c elements from src. */
static void gather_block(enum wsrc from, const unsigned char *src, int rows, int cols, size_t rs,
                         size_t cs, int tile, int block, float v[WQ_TILE][WQ_BLOCK], int *ncols)
{
    int c0 = block * WQ_BLOCK;
    *ncols = cols - c0 < WQ_BLOCK ? cols - c0 : WQ_BLOCK;
    for (int r = 0; r < WQ_TILE; r++) {
        int row = tile * WQ_TILE + r;
        for (int c = 0; c < WQ_BLOCK; c++)
            v[r][c] = row < rows && c < *ncols
                          ? src_at(from, src, (size_t)row * rs + (size_t)(c0 + c) * cs)
                          : 0.0f;
    }
}

static void quantize_q8_block(unsigned char *rec, float v[WQ_TILE][WQ_BLOCK])
{
    uint16_t *scale = (uint16_t *)rec;
    int8_t *q = (int8_t *)(rec + 2 * WQ_TILE);
    for (int r = 0; r < WQ_TILE; r++) {
        float amax = 0.0f;
        for (int c = 0; c < WQ_BLOCK; c++) amax = fmaxf(amax, fabsf(v[r][c]));
        uint16_t d16 = ms_f32_to_f16(amax / 127.0f);
        float d = ms_f16_to_f32(d16);
        scale[r] = d16;
        for (int c = 0; c < WQ_BLOCK; c++) {
            long x = d > 0.0f ? lrintf(v[r][c] / d) : 0;
            x = x > 127 ? 127 : x < -127 ? -127 : x;
            q[((c / 4) * WQ_TILE + r) * 4 + c % 4] = (int8_t)x;
        }
    }
}

static void quantize_q4_block(unsigned char *rec, float v[WQ_TILE][WQ_BLOCK], int ncols)
{
    uint16_t *scale = (uint16_t *)rec, *mins = scale + WQ_TILE;
    unsigned char *nib = rec + 4 * WQ_TILE;
    memset(nib, 0, 4 * WQ_TILE * 4);
    for (int r = 0; r < WQ_TILE; r++) {
        /* The range of the real columns only: padding multiplies zero activations. */
        float mn = ncols > 0 ? v[r][0] : 0.0f, mx = mn;
        for (int c = 1; c < ncols; c++) {
            mn = fminf(mn, v[r][c]);
            mx = fmaxf(mx, v[r][c]);
        }
        uint16_t d16 = ms_f32_to_f16((mx - mn) / 15.0f), m16 = ms_f32_to_f16(mn);
        float d = ms_f16_to_f32(d16), m = ms_f16_to_f32(m16);
        scale[r] = d16;
        mins[r] = m16;
        for (int c = 0; c < ncols; c++) {
            long x = d > 0.0f ? lrintf((v[r][c] - m) / d) : 0;
            x = x > 15 ? 15 : x < 0 ? 0 : x;
            int quad = c / 4, p = quad % 4, hi = quad / 4;
            nib[(p * WQ_TILE + r) * 4 + c % 4] |= (unsigned char)(x << (4 * hi));
        }
    }
}

/* Element i of a float-type matrix (f32, bf16 rounded to nearest even, or f16). */
static void store_float(enum wtype to, void *dst, size_t i, float f)
{
    if (to == WTYPE_F32)
        ((float *)dst)[i] = f;
    else if (to == WTYPE_BF16)
        ((uint16_t *)dst)[i] = ms_f32_to_bf16(f);
    else
        ((uint16_t *)dst)[i] = ms_f32_to_f16(f);
}

/* e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0; twice the value is an integer. */
static const int8_t e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

int mxfp4_value2(unsigned q)
{
    return e2m1_x2[q & 15];
}

float mxfp4_value(unsigned q)
{
    return 0.5f * (float)e2m1_x2[q & 15];
}

/* Nibble `c` (0..31) of lane r in a tile record whose nibbles start at byte WQ_TILE (MXFP4) --
 * the Q4 interleave: byte nib[p][r][i] holds column 4p+i (low) and 4(p+4)+i (high). */
static unsigned mx_tile_code(const unsigned char *rec, int r, int c)
{
    int quad = c / 4;
    return rec[WQ_TILE + ((quad % 4) * WQ_TILE + r) * 4 + c % 4] >> (4 * (quad / 4)) & 15;
}

/* Code of element c of a published MXFP4 row (16 bytes a block, low nibble first). */
static unsigned mx_src_code(const unsigned char *row, int c)
{
    return row[c / 2] >> (4 * (c & 1)) & 15;
}

void wmat_convert_mxfp4(enum wtype to, void *dst, const void *blocks, const void *scales,
                        int rows, int cols, size_t rstep, int r0, int r1)
{
    const unsigned char *bl = blocks, *sc = scales;
    int nb = cols / WQ_BLOCK;
    if (to == WTYPE_MXFP4) {
        for (int t = r0 / WQ_TILE; t * WQ_TILE < r1; t++)
            for (int b = 0; b < nb; b++) {
                unsigned char *rec = (unsigned char *)dst + wq_record_offset(to, cols, t, b);
                memset(rec, 0, WMX4_RECORD); /* rows past `rows`: scale 2^-127, codes 0 */
                for (int r = 0; r < WQ_TILE && t * WQ_TILE + r < rows; r++) {
                    size_t row = (size_t)(t * WQ_TILE + r) * rstep;
                    const unsigned char *src = bl + row * (size_t)cols / 2 + (size_t)b * 16;
                    rec[r] = sc[row * (size_t)nb + (size_t)b];
                    for (int c = 0; c < WQ_BLOCK; c++) {
                        int quad = c / 4;
                        rec[WQ_TILE + ((quad % 4) * WQ_TILE + r) * 4 + c % 4] |=
                            (unsigned char)(mx_src_code(src, c) << (4 * (quad / 4)));
                    }
                }
            }
        return;
    }
    for (int r = r0; r < r1; r++) {
        size_t row = (size_t)r * rstep;
        for (int c = 0; c < cols; c++) {
            const unsigned char *src = bl + row * (size_t)cols / 2;
            float f = ldexpf(mxfp4_value(mx_src_code(src, c)), sc[row * (size_t)nb + c / 32] - 127);
            store_float(to, dst, (size_t)r * cols + c, f);
        }
    }
}

void wmat_convert(enum wtype to, void *dst, enum wsrc from, const void *src, int rows, int cols,
                  int r0, int r1)
{
    wmat_convert_strided(to, dst, from, src, rows, cols, (size_t)cols, 1, r0, r1);
}

void wmat_convert_strided(enum wtype to, void *dst, enum wsrc from, const void *src, int rows,
                          int cols, size_t rs, size_t cs, int r0, int r1)
{
    const unsigned char *s = src;
    size_t eb = src_elem_bytes(from);
    if (to == WTYPE_Q8 || to == WTYPE_Q4) {
        float v[WQ_TILE][WQ_BLOCK];
        int nb = wq_blocks(cols);
        for (int t = r0 / WQ_TILE; t * WQ_TILE < r1; t++)
            for (int b = 0; b < nb; b++) {
                int ncols;
                gather_block(from, s, rows, cols, rs, cs, t, b, v, &ncols);
                unsigned char *rec = (unsigned char *)dst + wq_record_offset(to, cols, t, b);
                if (to == WTYPE_Q8)
                    quantize_q8_block(rec, v);
                else
                    quantize_q4_block(rec, v, ncols);
            }
        return;
    }
    for (int r = r0; r < r1; r++) {
        const unsigned char *row = s + (size_t)r * rs * eb;
        if (cs == 1 && ((to == WTYPE_F32 && from == WSRC_F32) ||
                        (to == WTYPE_BF16 && from == WSRC_BF16) ||
                        (to == WTYPE_F16 && from == WSRC_F16))) {
            memcpy((unsigned char *)dst + (size_t)r * cols * eb, row, (size_t)cols * eb);
            continue;
        }
        for (int c = 0; c < cols; c++)
            store_float(to, dst, (size_t)r * cols + c, src_at(from, row, (size_t)c * cs));
    }
}

void wmat_row_f32(const struct wmat *w, int r, float *out)
{
    int cols = w->cols;
    switch (w->type) {
    case WTYPE_F32:
        memcpy(out, (const float *)w->data + (size_t)r * cols, sizeof(float) * (size_t)cols);
        return;
    case WTYPE_BF16: {
        const uint16_t *p = (const uint16_t *)w->data + (size_t)r * cols;
        for (int c = 0; c < cols; c++) out[c] = ms_bf16_to_f32(p[c]);
        return;
    }
    case WTYPE_F16: {
        const uint16_t *p = (const uint16_t *)w->data + (size_t)r * cols;
        for (int c = 0; c < cols; c++) out[c] = ms_f16_to_f32(p[c]);
        return;
    }
    case WTYPE_MXFP4: {
        int t = r / WQ_TILE, i = r % WQ_TILE;
        for (int b = 0; b < wq_blocks(cols); b++) {
            const unsigned char *rec =
                (const unsigned char *)w->data + wq_record_offset(w->type, cols, t, b);
            for (int c = 0; c < WQ_BLOCK && b * WQ_BLOCK + c < cols; c++)
                out[b * WQ_BLOCK + c] = ldexpf(mxfp4_value(mx_tile_code(rec, i, c)), rec[i] - 127);
        }
        return;
    }
    case WTYPE_Q8:
    case WTYPE_Q4: {
        int t = r / WQ_TILE, i = r % WQ_TILE;
        for (int b = 0; b < wq_blocks(cols); b++) {
            const unsigned char *rec =
                (const unsigned char *)w->data + wq_record_offset(w->type, cols, t, b);
            const uint16_t *scale = (const uint16_t *)rec;
            float d = ms_f16_to_f32(scale[i]);
            for (int c = 0; c < WQ_BLOCK && b * WQ_BLOCK + c < cols; c++) {
                float x;
                if (w->type == WTYPE_Q8) {
                    const int8_t *q = (const int8_t *)(rec + 2 * WQ_TILE);
                    x = d * (float)q[((c / 4) * WQ_TILE + i) * 4 + c % 4];
                } else {
                    const unsigned char *nib = rec + 4 * WQ_TILE;
                    int quad = c / 4;
                    int v = nib[((quad % 4) * WQ_TILE + i) * 4 + c % 4] >> (4 * (quad / 4)) & 15;
                    x = d * (float)v + ms_f16_to_f32(scale[WQ_TILE + i]);
                }
                out[b * WQ_BLOCK + c] = x;
            }
        }
        return;
    }
    }
}
