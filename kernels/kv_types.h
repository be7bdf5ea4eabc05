/* The element types a paged KV cache can store (--kv-cache-dtype) and the scalar conversions
 * between them and f32, shared by the CPU kernels (which also convert 8 or 16 at a time in
 * their own instruction sets, to the same values), the CUDA kernels (__host__ __device__ under
 * nvcc) and the tests. Writes round to nearest even and saturate the 8-bit float types at
 * their largest finite value, as vLLM's fp8 cache does; the caches never hold NaN or
 * infinity.
 *
 * Layout: a layer's K (or V) storage is blocks of block_size positions, and within a block
 * each KV head's segments of `seg` elements (its key or value; MLA: the whole latent row, one
 * "head") lie one after another for all the block's positions: head-major, so that one head's
 * keys over a block are one run of memory (kv_seg_offset). int8's scales follow the same order,
 * one per segment.
 *
 * Scales: an fp8 cache stores x / s for one scale s per layer and tensor (vLLM's k_scale and
 * v_scale; 1 unless calibrated), read back as stored * s. An int8 cache stores, for each group
 * of g elements of a token's row (one KV head's key or value; MLA's whole latent row), an f32
 * scale amax / 127 beside round(x / scale): the scale of a row never changes once written, so
 * what a position holds does not depend on how its prompt was split into steps. */
#ifndef MOESERVE_KV_TYPES_H
#define MOESERVE_KV_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KVT_FN static inline __host__ __device__
#else
#define KVT_FN static inline
#endif

enum be_kv_type {
    BE_KV_F32 = 0,
    BE_KV_BF16 = 1,
    BE_KV_F16 = 2,
    BE_KV_FP8_E4M3 = 3, /* 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest 448, no inf */
    BE_KV_FP8_E5M2 = 4, /* 1 sign, 5 exponent (bias 15), 2 mantissa bits; largest 57,344 */
    BE_KV_INT8 = 5,     /* int8 with an f32 scale per group of a row (see above) */
};
#define BE_KV_N_TYPES 6

/* Bytes of one stored element (int8's scales come on top: kv_type_row_bytes). */
KVT_FN int kv_type_size(enum be_kv_type t)
{
    return t == BE_KV_F32 ? 4 : t == BE_KV_BF16 || t == BE_KV_F16 ? 2 : 1;
}

/* Bytes a row of n elements takes, with groups of g elements (int8: a 4-byte scale each). */
KVT_FN size_t kv_type_row_bytes(enum be_kv_type t, int n, int g)
{
    size_t b = (size_t)n * (size_t)kv_type_size(t);
    if (t == BE_KV_INT8 && g > 0) b += sizeof(float) * (size_t)((n + g - 1) / g);
    return b;
}

KVT_FN uint32_t kvt_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

KVT_FN float kvt_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

KVT_FN float kv_bf16_to_f32(uint16_t h)
{
    return kvt_float((uint32_t)h << 16);
}

KVT_FN uint16_t kv_f32_to_bf16(float f)
{
    uint32_t u = kvt_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

KVT_FN float kv_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return kvt_float(sign) + (sign ? -1.0f : 1.0f) * (float)m * 0x1p-24f;
    if (e == 31) return kvt_float(sign | 0x7f800000u | (m << 13));
    return kvt_float(sign | ((e - 15 + 127) << 23) | (m << 13));
}

/* Round to nearest even; past 65,504 saturates (a cache holds no infinity). */
KVT_FN uint16_t kv_f32_to_f16(float f)
{
    uint32_t u = kvt_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7bffu);
    if (a < 0x38800000u) /* subnormal: a multiple of 2^-24, exact once scaled */
        return (uint16_t)(sign | (uint32_t)rintf(kvt_float(a) * 0x1p24f));
    uint32_t h = (a - 0x38000000u) >> 13, rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* An 8-bit float with `mb` mantissa bits and exponent bias `bias` whose largest finite code is
 * `maxcode` (0x7e for e4m3, 0x7b for e5m2): round to nearest even, saturate. */
KVT_FN uint8_t kvt_to_fp8(float f, int mb, int bias, uint8_t maxcode, float maxval)
{
    uint32_t u = kvt_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    float a = fabsf(f);
    if (!(a == a)) return 0; /* NaN: store zero (a cache never holds NaN) */
    if (a >= maxval) return (uint8_t)(sign | maxcode);
    float min_normal = kvt_float((uint32_t)(1 - bias + 127) << 23);
    if (a < min_normal) /* subnormal: steps of min_normal / 2^mb; a carry gives min_normal */
        return (uint8_t)(sign | (uint32_t)rintf(a * kvt_float((uint32_t)(bias - 1 + mb + 127) << 23)));
    uint32_t ua = kvt_bits(a), drop = 23 - (uint32_t)mb;
    uint32_t r = ((((ua >> 23) - 127 + (uint32_t)bias)) << mb) | ((ua & 0x7fffffu) >> drop);
    uint32_t rest = ua & ((1u << drop) - 1), half = 1u << (drop - 1);
    if (rest > half || (rest == half && (r & 1u))) r++;
    return (uint8_t)(sign | (r > maxcode ? maxcode : r));
}

KVT_FN float kvt_from_fp8(uint8_t c, int mb, int bias)
{
    int e = (c >> mb) & ((1 << (7 - mb)) - 1), m = c & ((1 << mb) - 1);
    float v = e == 0 ? (float)m * ldexpf(1.0f, 1 - bias - mb)
                     : ldexpf(1.0f + (float)m / (float)(1 << mb), e - bias);
    return c & 0x80 ? -v : v;
}

KVT_FN uint8_t kv_f32_to_e4m3(float f)
{
    return kvt_to_fp8(f, 3, 7, 0x7e, 448.0f);
}

KVT_FN uint8_t kv_f32_to_e5m2(float f)
{
    return kvt_to_fp8(f, 2, 15, 0x7b, 57344.0f);
}

KVT_FN float kv_e4m3_to_f32(uint8_t c)
{
    return kvt_from_fp8(c, 3, 7);
}

KVT_FN float kv_e5m2_to_f32(uint8_t c)
{
    return kvt_from_fp8(c, 2, 15);
}

/* The element offset of KV head h's segment (seg elements) at slot `slot` of block `blk`, in a
 * layer whose rows hold n_heads segments; the int8 scale of that segment is element
 * kv_seg_offset(blk, slot, bs, n_heads, h, 1) of the scale array. */
KVT_FN size_t kv_seg_offset(size_t blk, int slot, int block_size, int n_heads, int h, int seg)
{
    return ((blk * (size_t)n_heads + (size_t)h) * (size_t)block_size + (size_t)slot) * (size_t)seg;
}

/* Element i of a stored row as f32, times `scale` (the fp8 layer scale, the int8 group scale,
 * 1 for the others). */
KVT_FN float kv_load(enum be_kv_type t, const void *row, int i, float scale)
{
    switch (t) {
    case BE_KV_F32: return ((const float *)row)[i];
    case BE_KV_BF16: return kv_bf16_to_f32(((const uint16_t *)row)[i]);
    case BE_KV_F16: return kv_f16_to_f32(((const uint16_t *)row)[i]);
    case BE_KV_FP8_E4M3: return kv_e4m3_to_f32(((const uint8_t *)row)[i]) * scale;
    case BE_KV_FP8_E5M2: return kv_e5m2_to_f32(((const uint8_t *)row)[i]) * scale;
    case BE_KV_INT8: return (float)((const int8_t *)row)[i] * scale;
    }
    return 0.0f;
}

/* Stores x (n) as row elements [0, n) of type t. fp8: inv_scale = 1 / the layer's scale.
 * int8: groups of g elements, each scale written to sc[group]. */
KVT_FN void kv_store_row(enum be_kv_type t, void *row, const float *x, int n, int g,
                         float inv_scale, float *sc)
{
    switch (t) {
    case BE_KV_F32:
        memcpy(row, x, sizeof(float) * (size_t)n);
        return;
    case BE_KV_BF16:
        for (int i = 0; i < n; i++) ((uint16_t *)row)[i] = kv_f32_to_bf16(x[i]);
        return;
    case BE_KV_F16:
        for (int i = 0; i < n; i++) ((uint16_t *)row)[i] = kv_f32_to_f16(x[i]);
        return;
    case BE_KV_FP8_E4M3:
        for (int i = 0; i < n; i++) ((uint8_t *)row)[i] = kv_f32_to_e4m3(x[i] * inv_scale);
        return;
    case BE_KV_FP8_E5M2:
        for (int i = 0; i < n; i++) ((uint8_t *)row)[i] = kv_f32_to_e5m2(x[i] * inv_scale);
        return;
    case BE_KV_INT8:
        for (int g0 = 0, gi = 0; g0 < n; g0 += g, gi++) {
            int g1 = g0 + g < n ? g0 + g : n;
            float amax = 0.0f;
            for (int i = g0; i < g1; i++) amax = fmaxf(amax, fabsf(x[i]));
            float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            sc[gi] = s;
            for (int i = g0; i < g1; i++) {
                float q = rintf(x[i] * inv);
                ((int8_t *)row)[i] = (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : (int)q);
            }
        }
        return;
    }
}

#endif
