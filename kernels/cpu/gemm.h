/* CPU kernels behind one table, chosen once at run time by what the CPU can do: portable C
 * (the reference, any CPU), AVX2+FMA+F16C, and AVX-512 (F/BW/VL, with VNNI int8 dot products
 * and AVX512-BF16 where present). The backend (backend_cpu.c) splits work over its thread pool
 * and calls these on one thread's share.
 *
 * Matrix products: y (n, m) = x (n, k) . W (m, k)^T for W of every weight type (weights.h). The
 * activations are first "prepared" once per product into the form the weight type's kernel
 * reads (struct act): f32 rows, f32 rows with even/odd elements split per vector (bf16
 * weights: a bf16 pair widens to two f32 vectors with one shift and one mask), bf16 rows
 * (bf16 weights under bf16 compute), or int8 blocks of 32 with a scale and a sum each (Q8/Q4
 * weights: int8 x int8 dot products). Every output element is computed by one thread in a
 * fixed order over k whatever the tile shape, so results do not depend on n, on the rows a
 * thread is given, or on the thread count.
 *
 * Rows of prepared activations are padded with zeros to a multiple of ACT_PAD elements. */
#ifndef MOESERVE_CPU_GEMM_H
#define MOESERVE_CPU_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "kv_types.h"
#include "weights.h"

#define ACT_PAD 64

/* Keys per attention tile (kernels/cpu/flash.c): one AVX-512 vector of scores per query row. */
#define FA_TK 16

enum act_kind {
    ACT_F32 = 0, /* f32, as given (f32 and f16 weights) */
    ACT_EO = 1,  /* f32 with each vector's even and odd elements split (bf16 weights) */
    ACT_BF16 = 2,/* bf16, rounded to nearest even (bf16 weights, bf16 compute) */
    ACT_Q8 = 3,  /* int8 per block of 32 with an f32 scale and the block's integer sum */
};

struct act {
    enum act_kind kind;
    int n, k;
    size_t stride;        /* bytes from one row of data to the next */
    const void *data;
    const float *dx;      /* ACT_Q8: (n, nb) block scales, row stride nb */
    const int32_t *isum;  /* ACT_Q8: (n, nb) sums of the block's int8 values */
    int nb;               /* ACT_Q8: blocks per row */
};

/* Rows [i0, i0 + n) of a prepared activation. */
static inline struct act act_rows(const struct act *a, int i0, int n)
{
    struct act r = *a;
    r.n = n;
    r.data = (const unsigned char *)a->data + (size_t)i0 * a->stride;
    if (a->kind == ACT_Q8) {
        r.dx = a->dx + (size_t)i0 * a->nb;
        r.isum = a->isum + (size_t)i0 * a->nb;
    }
    return r;
}

struct gemm_kernels {
    const char *name;
    /* The activation kind the kernels for weight type t read; bf16_compute: bf16 weights
     * multiply bf16-rounded activations. */
    enum act_kind (*act_kind)(enum wtype t, int bf16_compute);
    /* Rows [i0, i1) of x (ldx floats apart) into the prepared form, in buf laid out for n rows
     * of k (buf at least gemm_act_bytes(kind, n, k) bytes, 64-byte aligned); *out describes
     * all n rows, so several threads may each prepare a share. bf16_round: round the values
     * to bf16 first (bf16 compute on a table without bf16 dot products; ACT_BF16 always
     * rounds). */
    void (*act_prepare)(enum act_kind kind, int bf16_round, const float *x, size_t ldx, int n,
                        int k, int i0, int i1, void *buf, struct act *out);
    /* Columns [r0, r1) of y for every activation row i < a->n: y[i * ldy + (r - r0)] =
     * x_i . W_r (y points at column r0); r0 a multiple of WQ_TILE. */
    void (*gemm)(const struct wmat *w, const struct act *a, float *y, size_t ldy, int r0, int r1);
    /* out[i] = silu(g[i]) * u[i] for i < n (out may be g). */
    void (*silu_mul)(float *out, const float *g, const float *u, int n);
    /* gpt-oss's clamped SwiGLU: with g' = min(g, limit) and u' = clamp(u, -limit, limit),
     * out[i] = (u' + 1) * g' * sigmoid(alpha * g') (out may be g). */
    void (*swiglu_oai)(float *out, const float *g, const float *u, int n, float alpha,
                       float limit);
    /* The pieces of tiled attention (kernels/cpu/flash.c), FA_TK keys at a time.
     * kv_cvt: dst (n) = the stored row src (n elements of type t) as f32, times scale (the fp8
     * layer scale or the int8 group scale; 1 for the other types), the values kv_load gives.
     * fa_dots: s (R, FA_TK) = q (R, d) . kf (FA_TK, d; rows ldk floats apart)^T, each score by
     * the same sequence of operations whatever R (the query rows are independent).
     * fa_pv: o (R, dv) += p (R, FA_TK)[:, :cnt] . vt (cnt, dv; rows ldv floats apart), each
     * output summed over j in ascending order.
     * fa_max: the largest of p[lo .. hi] (hi < FA_TK).
     * fa_exp: p[j] = exp(p[j] - m) for lo <= j <= hi, 0 for the other j < FA_TK; returns their
     * sum, added in a fixed order. */
    void (*kv_cvt)(float *dst, const void *src, int n, enum be_kv_type t, float scale);
    void (*fa_dots)(float *s, const float *q, int R, int d, const float *kf, int ldk);
    void (*fa_pv)(float *o, const float *p, int R, int dv, const float *vt, int ldv, int cnt);
    /* The same two products reading the tile's rows where the cache stores them, in its type
     * t: row j at k[j] / v[j] (FA_TK pointers), each element times sc[j] for fp8 and int8 (sc
     * NULL for the others), converted in registers: bit for bit kv_cvt into a tile followed
     * by fa_dots / fa_pv, without the tile (for units with few rows per head: a decode). */
    void (*fa_dots_kv)(float *s, const float *q, int R, int d, const void *const *k,
                       const float *sc, enum be_kv_type t);
    void (*fa_pv_kv)(float *o, size_t ldo, const float *p, int R, int dv, const void *const *v,
                     const float *sc, int cnt, enum be_kv_type t); /* o: R rows ldo apart */
    float (*fa_max)(const float *p, int lo, int hi);
    float (*fa_exp)(float *p, int lo, int hi, float m);
    /* Continuous experts (backend.h neuron_ffn) over gathered rows of (F, k) f32, f16 or bf16
     * matrices, k = cols; each result by one fixed order, whatever rows a call is given.
     * neuron_up: h[j] = coef[j] * silu(gate_f . x) * (up_f . x), f = rows[j], j < n (gate and
     * up of one type). neuron_down: y[c] = sum_{j < n} h[j] * down_f[c], j in order, for c in
     * [c0, c1) (y points at column 0). */
    void (*neuron_up)(const struct wmat *gate, const struct wmat *up, const int32_t *rows,
                      int n, const float *x, const float *coef, float *h);
    void (*neuron_down)(const struct wmat *down, const int32_t *rows, const float *h, int n,
                        float *y, int c0, int c1);
    /* The same products neuron-major, for a batch: one neuron f against cnt tokens, its rows
     * read once. neuron_up_tok: h[slot[i]] = coef[slot[i]] * silu(gate_f . x_t) * (up_f . x_t),
     * t = tok[i] (rows of x ldx apart), i < cnt: bit for bit neuron_up's value.
     * neuron_down_tok: y_t[c] += h[slot[i]] * down_f[c] for c in [c0, c1) (rows of y ldy
     * apart): with y zeroed and the neurons taken in ascending order, bit for bit what
     * neuron_down gives for each token's ascending rows. */
    void (*neuron_up_tok)(const struct wmat *gate, const struct wmat *up, int f, const float *x,
                          size_t ldx, const int32_t *tok, const int32_t *slot, int cnt,
                          const float *coef, float *h);
    void (*neuron_down_tok)(const struct wmat *down, int f, const int32_t *tok,
                            const int32_t *slot, int cnt, const float *h, float *y, size_t ldy,
                            int c0, int c1);
    /* The gated delta rule (backend.h gdn) for one value head over n tokens of one sequence,
     * state S (dk, dv) updated in place: per token t, with q/k rows (normalized already) at
     * q/k + t * ldqk, v at v + t * ldv, the log-decay and beta at g/beta + t * ldgb:
     * S *= exp(g); S += k (beta (v - S^T k))^T; o + t * ldo = S^T q. dk, dv <= GDN_MAX_DIM.
     * The same bits on every table. */
    void (*gdn_head)(float *S, const float *q, const float *k, size_t ldqk, const float *v,
                     size_t ldv, const float *g, const float *beta, size_t ldgb, float *o,
                     size_t ldo, int n, int dk, int dv);
    /* The Mamba2 recurrence (backend.h mamba2) for one head over n tokens of one sequence, state
     * S (P, N) updated in place: per token t, with x at x + t * ldx (P), B and C at + t * ldbc
     * (N), the step dt[t * lddt]: S = exp(dt A) S + (dt x) B^T; y + t * ldy = S C + D x.
     * The same bits on every table. */
    void (*mamba_head)(float *S, const float *x, size_t ldx, const float *B, const float *C,
                       size_t ldbc, const float *dt, size_t lddt, float A, float D, float *y,
                       size_t ldy, int n, int P, int N);
};

/* The widest Gated DeltaNet head the kernels take (model_config.c checks configs against it). */
#define GDN_MAX_DIM 512

size_t gemm_act_bytes(enum act_kind kind, int n, int k);

/* The table for this CPU (cpuid; MOESERVE_CPU_KERNELS=portable|avx2|avx512 forces one, if the
 * CPU can run it). Never NULL. */
const struct gemm_kernels *gemm_kernels_best(void);
/* Each table, or NULL when the CPU cannot run it (tests compare them with the portable one). */
const struct gemm_kernels *gemm_kernels_portable(void);
const struct gemm_kernels *gemm_kernels_avx2(void);
const struct gemm_kernels *gemm_kernels_avx512(void);
/* The same tables without the CPU check (the ISA files define them). */
extern const struct gemm_kernels gemm_portable;
extern const struct gemm_kernels gemm_avx2;
extern const struct gemm_kernels gemm_avx512;

/* The CPU's features as a short string for logs, e.g. "avx2 fma f16c avx512f avx512bw
 * avx512vl avx512vnni avx512bf16". */
const char *cpu_features_string(void);
int cpu_has_avx512_bf16(void);
int cpu_has_avx512_vnni(void);

/* Shared by the ISA files: the activation row length, padded. */
static inline int act_kpad(int k)
{
    return (k + ACT_PAD - 1) / ACT_PAD * ACT_PAD;
}

/* ACT_Q8 in buf for n rows of k: the int8 rows (n, kp), then the scales (n, nb), then the
 * sums (n, nb). Sets everything of *out but the data. */
static inline void act_q8_layout(struct act *out, void *buf, int n, int k)
{
    int kp = act_kpad(k);
    *out = (struct act){.kind = ACT_Q8, .n = n, .k = k, .data = buf, .stride = (size_t)kp,
                        .nb = kp / 32};
    out->dx = (const float *)((char *)buf + (size_t)n * kp);
    out->isum = (const int32_t *)(out->dx + (size_t)n * out->nb);
}

/* Quantizes rows [i0, i1) of x into the ACT_Q8 layout with one ISA's row function. */
static inline void act_q8_rows(struct act *out, const float *x, size_t ldx, int i0, int i1,
                               void (*row)(const float *x, int k, int kp, int8_t *q, float *dx,
                                           int32_t *isum))
{
    int kp = (int)out->stride;
    for (int i = i0; i < i1; i++)
        row(x + (size_t)i * ldx, out->k, kp, (int8_t *)out->data + (size_t)i * kp,
            (float *)out->dx + (size_t)i * out->nb, (int32_t *)out->isum + (size_t)i * out->nb);
}

#endif
