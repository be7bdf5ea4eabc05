/* The KV cache's stored types and the CPU backend's tiled attention (kernels/kv_types.h,
 * kernels/cpu/flash.c and each kernel table's tile pieces):
 *  - the 8-bit float encodings: known codes, saturation, every code back to itself, halfway
 *    values to the even code; int8 rows within half a step;
 *  - each table's conversion of a stored row equals the scalar one bit for bit, every type;
 *  - each table's tile pieces (dot products, weighted sums) against portable C and double
 *    precision, and a row's scores and outputs the same bits whatever rows share the call;
 *  - whole attention calls on ragged shapes (head dims 64, 80, 128, 192, MLA's 576/512, GQA
 *    groups, sliding windows, Llama 4's chunks, gpt-oss's sinks, contexts across segments and
 *    blocks, every stored type, DeepSeek's sparse attention over selected positions, alone or
 *    mixed with tokens that attend to all) against a double-precision softmax over the values
 *    the cache holds, and the promises of flash.h, bit for bit: a token computed alone equals the same
 *    token in a batch, and 1, 2 or 3 threads (split-K or not) give the same output. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/flash.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"
#include "kv_types.h"
#include "test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float urand(float lo, float hi)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    uint64_t r = rng * 2685821657736338717ull;
    return lo + (hi - lo) * (float)((double)(r >> 40) / (double)(1ull << 24));
}

static const char *type_name(enum be_kv_type t)
{
    static const char *n[] = {"f32", "bf16", "f16", "fp8_e4m3", "fp8_e5m2", "int8"};
    return n[t];
}

/* --- encodings ----------------------------------------------------------------------------- */

static void test_fp8_codes(void)
{
    /* known values */
    CHECK(kv_f32_to_e4m3(1.0f) == 0x38 && kv_f32_to_e4m3(-2.0f) == 0xc0);
    CHECK(kv_f32_to_e4m3(448.0f) == 0x7e && kv_f32_to_e4m3(1e9f) == 0x7e);
    CHECK(kv_f32_to_e4m3(-500.0f) == 0xfe);
    CHECK(kv_f32_to_e4m3(0x1p-9f) == 0x01 && kv_f32_to_e4m3(0x1p-6f) == 0x08);
    CHECK(kv_f32_to_e4m3(0x1p-11f) == 0x00);         /* a quarter of the smallest step */
    CHECK(kv_f32_to_e4m3(1.0625f) == 0x38);          /* halfway 1 .. 1.125: to even */
    CHECK(kv_f32_to_e4m3(1.1875f) == 0x3a);          /* halfway 1.125 .. 1.25: to even */
    CHECK(kv_f32_to_e5m2(1.0f) == 0x3c && kv_f32_to_e5m2(57344.0f) == 0x7b);
    CHECK(kv_f32_to_e5m2(1e9f) == 0x7b && kv_f32_to_e5m2(-1e9f) == 0xfb);
    CHECK(kv_f32_to_e5m2(0x1p-16f) == 0x01);
    CHECK(kv_e4m3_to_f32(0x7e) == 448.0f && kv_e5m2_to_f32(0x7b) == 57344.0f);
    CHECK(kv_f32_to_e4m3(NAN) == 0 && kv_f32_to_e5m2(NAN) == 0); /* never stored */
    /* every finite code back to itself; halfway to the next code up rounds to the even one */
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        uint8_t u = (uint8_t)c;
        if ((c & 0x7f) <= 0x7e) {
            float f = kv_e4m3_to_f32(u);
            if (kv_f32_to_e4m3(f) != u && !(f == 0.0f && (c & 0x7f) == 0)) bad++;
            if ((c & 0x7f) < 0x7e) {
                float mid = (f + kv_e4m3_to_f32((uint8_t)(u + 1))) / 2; /* exact in f32 */
                if (kv_f32_to_e4m3(mid) != ((c & 1) ? u + 1 : u)) bad++;
            }
        }
        if ((c & 0x7f) <= 0x7b) {
            float f = kv_e5m2_to_f32(u);
            if (kv_f32_to_e5m2(f) != u && !(f == 0.0f && (c & 0x7f) == 0)) bad++;
            if ((c & 0x7f) < 0x7b) {
                float mid = (f + kv_e5m2_to_f32((uint8_t)(u + 1))) / 2;
                if (kv_f32_to_e5m2(mid) != ((c & 1) ? u + 1 : u)) bad++;
            }
        }
    }
    CHECKF(bad == 0, "fp8: %d codes do not round trip or round to even", bad);
    /* int8: each group's scale is its largest magnitude / 127, values within half a step */
    float x[100], sc[4], back;
    int8_t q[100];
    for (int i = 0; i < 100; i++) x[i] = urand(-3, 3) * (i < 50 ? 1.0f : 0.01f);
    x[7] = 0.0f;
    kv_store_row(BE_KV_INT8, q, x, 100, 25, 1.0f, sc);
    double worst = 0;
    for (int i = 0; i < 100; i++) {
        back = kv_load(BE_KV_INT8, q, i, sc[i / 25]);
        worst = fmax(worst, fabs(back - x[i]) / (sc[i / 25] / 2));
    }
    CHECKF(worst <= 1.0001, "int8: an element is %.3f half-steps off", worst);
    float zero[8] = {0};
    kv_store_row(BE_KV_INT8, q, zero, 8, 8, 1.0f, sc);
    CHECK(sc[0] == 0.0f && q[0] == 0 && kv_load(BE_KV_INT8, q, 3, sc[0]) == 0.0f);
}

/* A row of n values spanning magnitudes (tiny, ordinary, past each type's range). */
static void random_row(float *x, int n)
{
    for (int i = 0; i < n; i++) {
        float m = i % 7 == 0 ? 1e-4f : i % 11 == 0 ? 300.0f : i % 13 == 0 ? 1e5f : 2.0f;
        x[i] = urand(-m, m);
    }
}

/* Each table converts stored rows to the same bits as the scalar kv_load. */
static void test_cvt(const struct gemm_kernels *kk)
{
    static const int ns[] = {1, 7, 16, 33, 128, 200, 576};
    int bad = 0, cases = 0;
    float x[576], got[576], sc[64];
    unsigned char row[576 * 4];
    for (int t = 0; t < BE_KV_N_TYPES; t++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni];
            random_row(x, n);
            float scale = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 ? 0.37f : 1.0f;
            kv_store_row((enum be_kv_type)t, row, x, n, n, 1.0f / scale, sc);
            if (t == BE_KV_INT8) scale = sc[0];
            kk->kv_cvt(got, row, n, (enum be_kv_type)t, scale);
            for (int i = 0; i < n; i++) {
                float want = kv_load((enum be_kv_type)t, row, i, scale);
                if (memcmp(&want, &got[i], sizeof want) != 0) bad++;
            }
            cases++;
        }
    CHECKF(bad == 0, "%s kv_cvt: %d elements differ from kv_load", kk->name, bad);
    printf("%-9s kv_cvt: %d rows of every type, bit for bit\n", kk->name, cases);
}

/* --- tile pieces --------------------------------------------------------------------------- */

static void test_pieces(const struct gemm_kernels *kk)
{
    const struct gemm_kernels *pk = gemm_kernels_portable();
    static const int dims[] = {1, 8, 13, 64, 80, 128, 192, 576};
    int bad_rows = 0;
    double worst_s = 0, worst_o = 0;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        int d = dims[di], R = 11, ld = d + 3; /* tiles of a wider row (several heads) */
        float *kf = malloc(sizeof(float) * FA_TK * ld), *q = malloc(sizeof(float) * R * d);
        float s1[11 * FA_TK], s2[11 * FA_TK], one[FA_TK], p[11 * FA_TK];
        float *vt = malloc(sizeof(float) * FA_TK * ld), *o1 = malloc(sizeof(float) * R * d);
        float *o2 = malloc(sizeof(float) * R * d), *orow = malloc(sizeof(float) * d);
        for (int i = 0; i < FA_TK * ld; i++) kf[i] = urand(-1, 1), vt[i] = urand(-1, 1);
        for (int i = 0; i < R * d; i++) q[i] = urand(-1, 1), o1[i] = o2[i] = urand(-1, 1);
        for (int i = 0; i < R * FA_TK; i++) p[i] = urand(0, 1);
        kk->fa_dots(s1, q, R, d, kf, ld);
        pk->fa_dots(s2, q, R, d, kf, ld);
        for (int r = 0; r < R; r++) {
            kk->fa_dots(one, q + (size_t)r * d, 1, d, kf, ld);
            bad_rows += memcmp(one, s1 + r * FA_TK, sizeof one) != 0;
            for (int j = 0; j < FA_TK; j++) {
                double ref = 0;
                for (int i = 0; i < d; i++) ref += (double)q[r * d + i] * kf[j * ld + i];
                worst_s = fmax(worst_s, fabs(s1[r * FA_TK + j] - ref) / (sqrt((double)d) + 1e-9));
                worst_s = fmax(worst_s, fabs(s2[r * FA_TK + j] - ref) / (sqrt((double)d) + 1e-9));
            }
        }
        int cnt = d % FA_TK ? d % FA_TK : FA_TK; /* a partial tile too */
        memcpy(orow, o1 + (size_t)3 * d, sizeof(float) * d);
        double ref3[576];
        for (int c = 0; c < d; c++) {
            ref3[c] = orow[c];
            for (int j = 0; j < cnt; j++) ref3[c] += (double)p[3 * FA_TK + j] * vt[j * ld + c];
        }
        kk->fa_pv(o1, p, R, d, vt, ld, cnt);
        pk->fa_pv(o2, p, R, d, vt, ld, cnt);
        kk->fa_pv(orow, p + 3 * FA_TK, 1, d, vt, ld, cnt);
        bad_rows += memcmp(orow, o1 + (size_t)3 * d, sizeof(float) * d) != 0;
        for (int c = 0; c < d; c++) {
            worst_o = fmax(worst_o, fabs(o1[3 * d + c] - ref3[c]));
            worst_o = fmax(worst_o, fabs(o2[3 * d + c] - ref3[c]));
        }
        free(kf), free(q), free(vt), free(o1), free(o2), free(orow);
    }
    CHECKF(bad_rows == 0, "%s: %d rows depend on the rows computed with them", kk->name, bad_rows);
    CHECKF(worst_s <= 1e-6, "%s fa_dots: error %.3g (per sqrt(d))", kk->name, worst_s);
    CHECKF(worst_o <= 1e-5, "%s fa_pv: error %.3g", kk->name, worst_o);
    printf("%-9s tiles: scores %.2e, outputs %.2e from double\n", kk->name, worst_s, worst_o);
}

/* --- whole calls --------------------------------------------------------------------------- */

struct acase {
    const char *what;
    int n_head, n_kv, dk, dv, mla;
    int window, chunk, sinks;
    int pos0, n; /* the call's tokens: one sequence at positions pos0 .. pos0 + n - 1 */
    int topk;    /* > 0: a token past topk positions attends to topk of them (be_attn.sel) */
};

/* Sparse attention's selections of case a (topk > 0): token i at position P > topk - 1 keeps
 * topk positions, its own and others picked by a hash, ascending; the others keep all (-1). */
static void make_sel(const struct acase *a, int32_t *sel, int32_t *sel_n)
{
    for (int i = 0; i < a->n; i++) {
        int P = a->pos0 + i, cnt = 0;
        if (P + 1 <= a->topk) {
            sel_n[i] = -1;
            continue;
        }
        int need = a->topk - 1; /* besides P: the first `need` positions in hash order */
        for (int p = 0; p < P && cnt < need; p++) {
            uint32_t hsh = (uint32_t)(p * 2654435761u) ^ (uint32_t)(i * 40503u);
            if (hsh % (uint32_t)(P + 1) < (uint32_t)(a->topk + 1) || P - p <= need - cnt)
                sel[(size_t)i * a->topk + cnt++] = p;
        }
        sel[(size_t)i * a->topk + cnt++] = P;
        sel_n[i] = cnt;
    }
}

/* A layer cache of max_pos positions in blocks of bs (shuffled), written from random rows
 * through the type's scalar store. k_row / v_row: the row widths; MLA's v aliases k. */
struct tcache {
    struct be_kv kv;
    int bs, n_blocks, k_row, v_row;
    int32_t *table;
};

static void tcache_make(struct tcache *c, const struct acase *a, enum be_kv_type t, int max_pos)
{
    memset(c, 0, sizeof *c);
    c->bs = 16;
    c->n_blocks = (max_pos + c->bs - 1) / c->bs + 3;
    c->k_row = a->n_kv * a->dk;
    c->v_row = a->mla ? c->k_row : a->n_kv * a->dv;
    size_t rows = (size_t)c->n_blocks * c->bs, es = (size_t)kv_type_size(t);
    c->kv.type = t;
    c->kv.k_grp = a->mla ? c->k_row : a->dk;
    c->kv.v_grp = a->mla ? c->k_row : a->dv;
    c->kv.k_scale = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 ? 0.05f : 1.0f;
    c->kv.v_scale = t == BE_KV_FP8_E4M3 || t == BE_KV_FP8_E5M2 ? 0.02f : 1.0f;
    c->kv.k = calloc(rows * c->k_row, es);
    c->kv.k_sc = calloc(rows * (c->k_row / c->kv.k_grp), sizeof(float));
    if (a->mla) {
        c->kv.v = c->kv.k;
        c->kv.v_sc = c->kv.k_sc;
    } else {
        c->kv.v = calloc(rows * c->v_row, es);
        c->kv.v_sc = calloc(rows * (c->v_row / c->kv.v_grp), sizeof(float));
    }
    c->table = malloc(sizeof(int32_t) * c->n_blocks);
    for (int i = 0; i < c->n_blocks; i++) c->table[i] = (i * 7 + 5) % c->n_blocks;
    float *x = malloc(sizeof(float) * (c->k_row > c->v_row ? c->k_row : c->v_row));
    for (int p = 0; p < max_pos; p++) {
        size_t blk = (size_t)c->table[p / c->bs];
        int slot = p % c->bs;
        for (int v = 0; v < (a->mla ? 1 : 2); v++) { /* head-major segments (kv_seg_offset) */
            int row = v ? c->v_row : c->k_row, seg = v ? c->kv.v_grp : c->kv.k_grp;
            float f = v ? c->kv.v_scale : c->kv.k_scale;
            for (int i = 0; i < row; i++) x[i] = urand(-2, 2);
            for (int h = 0; h < row / seg; h++)
                kv_store_row(t,
                             (char *)(v ? c->kv.v : c->kv.k) +
                                 kv_seg_offset(blk, slot, c->bs, row / seg, h, seg) * es,
                             x + (size_t)h * seg, seg, seg, 1.0f / f,
                             (v ? c->kv.v_sc : c->kv.k_sc) +
                                 kv_seg_offset(blk, slot, c->bs, row / seg, h, 1));
        }
    }
    free(x);
}

static void tcache_free(struct tcache *c)
{
    if (c->kv.v != c->kv.k) free(c->kv.v);
    if (c->kv.v_sc != c->kv.k_sc) free(c->kv.v_sc);
    free(c->kv.k);
    free(c->kv.k_sc);
    free(c->table);
}

/* Element i of position p's key (or value) for KV head h, as the cache holds it. */
static double cache_at(const struct tcache *c, int v, int p, int h, int dim, int i)
{
    size_t blk = (size_t)c->table[p / c->bs], es = (size_t)kv_type_size(c->kv.type);
    int slot = p % c->bs, row = v ? c->v_row : c->k_row, seg = v ? c->kv.v_grp : c->kv.k_grp;
    int n = row / seg;
    (void)dim;
    const char *base = (const char *)(v ? c->kv.v : c->kv.k) +
                       kv_seg_offset(blk, slot, c->bs, n, h, seg) * es;
    float sc = c->kv.type == BE_KV_INT8
                   ? (v ? c->kv.v_sc : c->kv.k_sc)[kv_seg_offset(blk, slot, c->bs, n, h, 1)]
               : c->kv.type == BE_KV_FP8_E4M3 || c->kv.type == BE_KV_FP8_E5M2
                   ? (v ? c->kv.v_scale : c->kv.k_scale)
                   : 1.0f;
    return kv_load(c->kv.type, base, i, sc);
}

/* The double-precision attention of token (pos) query head qh. */
static void ref_attention(double *out, const struct acase *a, const struct tcache *c,
                          const float *q, int pos, int qh, float scale, const float *sinks,
                          const int32_t *sel, int sel_n)
{
    int group = a->n_head / a->n_kv, kvh = qh / group;
    int start = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    if (a->chunk > 0 && pos - pos % a->chunk > start) start = pos - pos % a->chunk;
    int len = sel_n >= 0 ? sel_n : pos - start + 1;
#define AT(t) (sel_n >= 0 ? sel[t] : start + (t))
    double *s = malloc(sizeof(double) * len), mx = sinks ? sinks[qh] : -1e300, sum = 0;
    for (int t = 0; t < len; t++) {
        double d = 0;
        for (int i = 0; i < a->dk; i++) d += (double)q[i] * cache_at(c, 0, AT(t), kvh, a->dk, i);
        s[t] = d * scale;
        mx = s[t] > mx ? s[t] : mx;
    }
    for (int t = 0; t < len; t++) sum += exp(s[t] - mx);
    if (sinks) sum += exp(sinks[qh] - mx);
    for (int i = 0; i < a->dv; i++) out[i] = 0;
    for (int t = 0; t < len; t++) {
        double w = exp(s[t] - mx) / sum;
        for (int i = 0; i < a->dv; i++) out[i] += w * cache_at(c, 1, AT(t), kvh, a->dv, i);
    }
#undef AT
    free(s);
}

static void run_call(struct pool *pool, const struct gemm_kernels *kk, struct fa_work *w,
                     float *out, const float *q, const struct tcache *c, const struct acase *a,
                     int pos0, int n, float scale, const float *sinks, const int32_t *sel,
                     const int32_t *sel_n)
{
    struct be_tokens tk = {.tables = c->table, .pos0 = pos0};
    struct be_attn at = {.n_head = a->n_head, .n_kv_head = a->n_kv, .k_dim = a->dk,
                         .v_dim = a->dv, .k_row = c->k_row, .v_row = c->v_row,
                         .window = a->window, .scale = scale, .sinks = sinks,
                         .chunk = a->chunk, .sel = a->topk > 0 ? sel : NULL,
                         .sel_n = a->topk > 0 ? sel_n : NULL, .sel_stride = a->topk};
    fa_attention(pool, kk, w, out, q, &c->kv, &tk, c->bs, n, &at);
}

/* Every case and type: the double-precision reference once, then each kernel table. */
static void test_calls(const struct gemm_kernels *const *tables, int n_tables)
{
    static const struct acase cases[] = {
        {"decode gqa4 d128", 8, 2, 128, 128, 0, 0, 0, 0, 700, 1, 0},
        {"prefill gqa4 d64", 8, 2, 64, 64, 0, 0, 0, 0, 0, 37, 0},
        {"chunk at depth d80", 6, 3, 80, 80, 0, 0, 0, 0, 505, 21, 0},
        {"decode mqa d192", 4, 1, 192, 192, 0, 0, 0, 0, 1100, 1, 0},
        {"window+sinks d64", 8, 2, 64, 64, 0, 100, 0, 1, 590, 9, 0},
        {"llama4 chunks d128", 4, 2, 128, 128, 0, 0, 64, 0, 120, 30, 0},
        {"mla decode", 16, 1, 576, 512, 1, 0, 0, 0, 530, 1, 0},
        {"mla prefill", 16, 1, 576, 512, 1, 0, 0, 0, 40, 5, 0},
        {"dsa decode", 16, 1, 576, 512, 1, 0, 0, 0, 1500, 1, 700},
        {"dsa prefill, some dense", 16, 1, 576, 512, 1, 0, 0, 0, 30, 20, 40},
    };
    struct pool *pools[3] = {pool_create(1, 0), pool_create(2, 0), pool_create(3, 0)};
    struct fa_work w[3];
    memset(w, 0, sizeof w);
    for (int i = 0; i < 3; i++)
        CHECK(pools[i] && fa_work_reserve(&w[i], i + 1, 64, 16, 576, 512, 4, 2048) == 0);
    double worst[3][BE_KV_N_TYPES] = {{0}};
    int bad_split[3] = {0}, bad_batch[3] = {0}, bad_port[3] = {0};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const struct acase *a = &cases[ci];
        for (int t = 0; t < BE_KV_N_TYPES; t++) {
            struct tcache c;
            tcache_make(&c, a, (enum be_kv_type)t, a->pos0 + a->n);
            size_t qn = (size_t)a->n * a->n_head * a->dk, on = (size_t)a->n * a->n_head * a->dv;
            float *q = malloc(sizeof(float) * qn), sinks[16];
            float *o[3], *alone = malloc(sizeof(float) * on), *port = malloc(sizeof(float) * on);
            double *ref = malloc(sizeof(double) * on);
            int32_t *sel = malloc(sizeof(int32_t) * (size_t)a->n * (a->topk > 0 ? a->topk : 1));
            int32_t *sel_n = malloc(sizeof(int32_t) * (size_t)a->n);
            if (a->topk > 0) make_sel(a, sel, sel_n);
            for (size_t i = 0; i < qn; i++) q[i] = urand(-1, 1);
            for (int h = 0; h < a->n_head; h++) sinks[h] = urand(-1, 3);
            const float *sk = a->sinks ? sinks : NULL;
            float scale = 1.0f / sqrtf((float)a->dk);
            double den = 0;
            for (int i = 0; i < a->n; i++)
                for (int h = 0; h < a->n_head; h++) {
                    size_t off = (size_t)i * a->n_head + h;
                    ref_attention(ref + off * a->dv, a, &c, q + off * a->dk, a->pos0 + i, h, scale,
                                  sk, sel + (size_t)i * a->topk,
                                  a->topk > 0 ? sel_n[i] : -1);
                }
            for (size_t j = 0; j < on; j++) den += ref[j] * ref[j];
            for (int i = 0; i < 3; i++) o[i] = malloc(sizeof(float) * on);
            run_call(pools[1], gemm_kernels_portable(), &w[1], port, q, &c, a, a->pos0, a->n,
                     scale, sk, sel, sel_n);
            for (int ti = 0; ti < n_tables; ti++) {
                const struct gemm_kernels *kk = tables[ti];
                for (int i = 0; i < 3; i++)
                    run_call(pools[i], kk, &w[i], o[i], q, &c, a, a->pos0, a->n, scale, sk, sel,
                             sel_n);
                bad_split[ti] += memcmp(o[0], o[1], sizeof(float) * on) != 0;
                bad_split[ti] += memcmp(o[0], o[2], sizeof(float) * on) != 0;
                for (int i = 0; i < a->n; i++) /* each token alone */
                    run_call(pools[1], kk, &w[1], alone + (size_t)i * a->n_head * a->dv,
                             q + (size_t)i * a->n_head * a->dk, &c, a, a->pos0 + i, 1, scale, sk,
                             sel + (size_t)i * a->topk, sel_n + i);
                bad_batch[ti] += memcmp(o[0], alone, sizeof(float) * on) != 0;
                double num = 0, pn = 0;
                for (size_t j = 0; j < on; j++) {
                    num += (o[1][j] - ref[j]) * (o[1][j] - ref[j]);
                    pn += (double)(port[j] - o[1][j]) * (port[j] - o[1][j]);
                }
                double err = sqrt(num / den);
                worst[ti][t] = fmax(worst[ti][t], err);
                CHECKF(err <= 2e-6, "%s %s %s: %.3g from double precision", kk->name, a->what,
                       type_name((enum be_kv_type)t), err);
                bad_port[ti] += sqrt(pn / den) > 2e-6;
            }
            free(ref), free(q), free(alone), free(port), free(sel), free(sel_n);
            for (int i = 0; i < 3; i++) free(o[i]);
            tcache_free(&c);
        }
    }
    for (int ti = 0; ti < n_tables; ti++) {
        const char *name = tables[ti]->name;
        CHECKF(bad_split[ti] == 0, "%s: %d calls differ between 1, 2 and 3 threads", name,
               bad_split[ti]);
        CHECKF(bad_batch[ti] == 0, "%s: %d calls differ from their tokens run alone", name,
               bad_batch[ti]);
        CHECKF(bad_port[ti] == 0, "%s: %d calls differ from portable C beyond 2e-6", name,
               bad_port[ti]);
        printf("%-9s attention: %zu shapes x %d types, worst error from double:", name,
               sizeof cases / sizeof cases[0], BE_KV_N_TYPES);
        for (int t = 0; t < BE_KV_N_TYPES; t++)
            printf(" %s %.1e", type_name((enum be_kv_type)t), worst[ti][t]);
        printf("\n");
    }
    for (int i = 0; i < 3; i++) {
        fa_work_free(&w[i]);
        if (pools[i]) pool_free(pools[i]);
    }
}

int main(void)
{
    test_fp8_codes();
    const struct gemm_kernels *tables[] = {gemm_kernels_portable(), gemm_kernels_avx2(),
                                           gemm_kernels_avx512()};
    const struct gemm_kernels *have[3];
    int n = 0;
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++) {
        if (!tables[i]) {
            printf("(%s kernels: not run, this CPU lacks them)\n", i == 1 ? "avx2" : "avx512");
            continue;
        }
        test_cvt(tables[i]);
        test_pieces(tables[i]);
        have[n++] = tables[i];
    }
    test_calls(have, n);
    return test_done("test_attention");
}
