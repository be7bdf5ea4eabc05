/* Weight matrices as every backend sees them: a type, a shape and the bytes. The loader keeps a
 * checkpoint's f32/f16/bf16 tensors as they are stored (borrowed from the safetensors mapping,
 * zero copy) or converts / quantizes them once at load; kernels read each type directly and
 * accumulate in f32.
 *
 * Quantized types (WTYPE_Q8, WTYPE_Q4) are our own layout, made for the CPU kernels: rows are
 * grouped in tiles of WQ_TILE (16) rows and columns in blocks of WQ_BLOCK (32); a tile's blocks
 * are stored one after another, and each block record interleaves the tile's 16 rows four
 * columns at a time, so that one 64-byte vector holds 4 consecutive weights of each of 16 rows
 * (the operand shape of an int8 dot-product instruction whose lanes are output rows). Rows past
 * `rows` and columns past `cols` are zero (so any shape can be quantized).
 *
 *   Q8 record (544 bytes): f16 scale[16]; int8 q[8][16][4]   w = q * scale      (q in -127..127)
 *   Q4 record (320 bytes): f16 scale[16]; f16 min[16]; uint8 nib[4][16][4]
 *                          byte nib[p][r][i] holds column 4p+i in its low nibble and column
 *                          4(p+4)+i in its high nibble;            w = q * scale + min (q 0..15)
 *   MXFP4 record (272 bytes): uint8 e8m0 scale[16]; uint8 nib[4][16][4] as Q4, each nibble an
 *                          e2m1 code (sign, 2-bit exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2,
 *                          3, 4, 6 and their negatives)   w = e2m1(q) * 2^(scale - 127)
 *
 * MXFP4 is the OCP microscaling format gpt-oss publishes its experts in (blocks of 32 along a
 * row sharing one power-of-two scale). The loader repacks the checkpoint's row-major blocks into
 * this tile layout once (same 4.25 bits per weight, nothing expanded), so the int8 kernels read
 * it like Q4: twice an e2m1 value is an integer in -12..12, so a 16-entry table turns a nibble
 * into an int8 and the block's dot product is exact in integers.
 *
 * Ownership: a wmat describes memory it does not own (the model's mapping or conversion block,
 * or a backend's copy); it stays valid as long as that memory. */
#ifndef MOESERVE_WEIGHTS_H
#define MOESERVE_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum wtype {
    WTYPE_F32 = 0,
    WTYPE_F16 = 1,
    WTYPE_BF16 = 2,
    WTYPE_Q8 = 3, /* int8, one f16 scale per 32 weights (the manner of Q8_0) */
    WTYPE_Q4 = 4, /* 4-bit, one f16 scale and one f16 min per 32 weights (the manner of Q4_1) */
    WTYPE_MXFP4 = 5, /* e2m1, one e8m0 (power of two) scale per 32 weights: gpt-oss experts */
};

#define WQ_TILE 16
#define WQ_BLOCK 32
#define WQ8_RECORD 544
#define WQ4_RECORD 320
#define WMX4_RECORD 272

struct wmat {
    enum wtype type;
    int rows, cols;   /* the logical matrix (rows, cols), row-major */
    const void *data; /* f32/f16/bf16: rows * cols elements; Q8/Q4: tiles of records */
};

const char *wtype_name(enum wtype t);
/* Bytes of a matrix of this type and shape (Q types: padded to whole tiles and blocks). */
size_t wtype_bytes(enum wtype t, int rows, int cols);
/* Alignment the kernels want for `data` (f32 rows are read with unaligned loads, but UBSan
 * holds C code to the element size). */
size_t wtype_align(enum wtype t);
/* The tile-layout types (Q8, Q4, MXFP4): read by the int8 kernels with int8 activations. */
static inline int wtype_is_quant(enum wtype t)
{
    return t == WTYPE_Q8 || t == WTYPE_Q4 || t == WTYPE_MXFP4;
}
static inline size_t wq_record_bytes(enum wtype t)
{
    return t == WTYPE_Q8 ? WQ8_RECORD : t == WTYPE_Q4 ? WQ4_RECORD : WMX4_RECORD;
}
/* Blocks of one row of a Q matrix, and the byte offset of the record of (tile, block). */
static inline int wq_blocks(int cols)
{
    return (cols + WQ_BLOCK - 1) / WQ_BLOCK;
}
static inline size_t wq_record_offset(enum wtype t, int cols, int tile, int block)
{
    return ((size_t)tile * (size_t)wq_blocks(cols) + (size_t)block) * wq_record_bytes(t);
}

/* Rows [r0, r0 + n) of w as a matrix of their own, sharing w's data (Q types: r0 a multiple of
 * WQ_TILE). */
static inline struct wmat wmat_rows(const struct wmat *w, int r0, int n)
{
    struct wmat v = *w;
    v.rows = n;
    if (wtype_is_quant(w->type))
        v.data = (const unsigned char *)w->data + wq_record_offset(w->type, w->cols, r0 / WQ_TILE, 0);
    else
        v.data = (const unsigned char *)w->data +
                 (size_t)r0 * (size_t)w->cols * (w->type == WTYPE_F32 ? 4u : 2u);
    return v;
}

/* Source element types for conversion: a tensor as stored (possibly unaligned bytes). */
enum wsrc {
    WSRC_F32 = 0,
    WSRC_F16 = 1,
    WSRC_BF16 = 2,
};

/* Converts or quantizes rows [r0, r1) of a (rows, cols) row-major source matrix `src` into
 * `dst`, the data of a wmat of type `to` and the same shape (dst of wtype_bytes(to, rows, cols)
 * bytes). For Q types r0 and r1 are multiples of WQ_TILE (or r1 == rows), so tiles can be
 * filled by several threads. Reads `src` bytewise, so any alignment works. */
void wmat_convert(enum wtype to, void *dst, enum wsrc from, const void *src, int rows, int cols,
                  int r0, int r1);

/* wmat_convert from a source laid out with strides: element (r, c) of the (rows, cols) matrix is
 * rs * r + cs * c elements from src (rs = cols, cs = 1: row-major; rs = 1, cs = rows: the
 * transpose of a row-major (cols, rows) matrix). Used for weights a model multiplies by their
 * transpose (MLA's absorbed key projection) or stores interleaved. */
void wmat_convert_strided(enum wtype to, void *dst, enum wsrc from, const void *src, int rows,
                          int cols, size_t rs, size_t cs, int r0, int r1);

/* An e2m1 code (low 4 bits of q) as f32, and twice that as an integer (-12..12). */
float mxfp4_value(unsigned q);
int mxfp4_value2(unsigned q);

/* Converts rows [r0, r1) of a matrix stored in MXFP4 as gpt-oss publishes it into `dst` of type
 * `to` (WTYPE_MXFP4: repacked into the tile layout, bit-exact; WTYPE_F32 / WTYPE_BF16:
 * dequantized, exact). Source row i (of `rows`, cols a multiple of 32) has its cols/32 blocks
 * of 16 bytes (byte j: element 2j in the low nibble, 2j + 1 in the high one) at
 * blocks + i * rstep * cols / 2 and its e8m0 scales at scales + i * rstep * cols / 32: rstep 2
 * reads every other row of a tensor whose rows interleave two matrices (gpt-oss's gate/up).
 * For WTYPE_MXFP4, r0 and r1 are multiples of WQ_TILE (or r1 == rows). */
void wmat_convert_mxfp4(enum wtype to, void *dst, const void *blocks, const void *scales,
                        int rows, int cols, size_t rstep, int r0, int r1);

/* Row r of w as f32 (cols floats): exact for f32/f16/bf16, the dequantized values for Q. */
void wmat_row_f32(const struct wmat *w, int r, float *out);

#ifdef __cplusplus
}
#endif

#endif
