/* Tiled paged attention of the CPU backend: units of query rows, FA_TK-key tiles converted once
 * from the cache's stored type, an online softmax per row, segments of FA_SEG folded in order,
 * and split-K when a call has too few units for the threads. See flash.h for the rules that
 * keep every row's result independent of how the call is cut up. */
#include "cpu/flash.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --- buffers ------------------------------------------------------------------------------ */

/* Per-thread floats for units of R rows over KV rows of k_row / v_row elements and heads dk / dv
 * wide: the unit's queries, the key and value tiles (every head of the unit), the scores, the
 * row ranges, and two softmax states (the unit's and the current segment's). */
static size_t thread_floats(int R, int dk, int k_row, int v_row, int dv)
{
    return (size_t)R * dk + (size_t)FA_TK * k_row + (size_t)FA_TK * v_row + (size_t)R * FA_TK +
           2 * (size_t)R + 2 * (size_t)R * (dv + 2) + 64;
}

void fa_work_free(struct fa_work *w)
{
    free(w->scratch);
    free(w->units);
    free(w->tasks);
    free(w->part);
    free(w->zero);
    memset(w, 0, sizeof *w);
}

int fa_work_reserve(struct fa_work *w, int n_threads, int max_tokens, int max_group, int dk,
                    int dv, int max_kv_heads, int max_ctx)
{
    fa_work_free(w);
    w->n_threads = n_threads > 0 ? n_threads : 1;
    w->rows = max_group > FA_ROWS ? max_group : FA_ROWS;
    w->dk = dk > 0 ? dk : 256;
    w->dv = dv > 0 ? dv : 256;
    w->kv_heads = max_kv_heads > 0 ? max_kv_heads : 1;
    w->max_tokens = max_tokens > 0 ? max_tokens : 1;
    /* a unit's heads: as many as fit its rows (plan_units), at most every KV head */
    int nh = w->kv_heads < w->rows ? w->kv_heads : w->rows;
    w->per_thread =
        (thread_floats(w->rows, w->dk, nh * w->dk, nh * w->dv, w->dv) + 15) / 16 * 16;
    /* Splitting serves calls of fewer units than 2 per thread: room for that many units'
     * segments, capped (a call needing more runs unsplit, with the same results). */
    int segs = (max_ctx > 0 ? max_ctx : 4096) / FA_SEG + 2;
    size_t units = 2 * (size_t)w->n_threads;
    size_t part = units * (size_t)segs * (size_t)w->rows * (size_t)(w->dv + 2);
    size_t cap = (size_t)16 << 20; /* floats: 64 MiB */
    w->part_floats = part < cap ? part : cap;
    w->max_tasks = (int)(units * (size_t)segs);
    w->max_units = w->max_tokens * w->kv_heads;
    w->scratch = aligned_alloc(64, sizeof(float) * w->per_thread * (size_t)w->n_threads);
    w->units = malloc(sizeof(int32_t) * 4 * (size_t)w->max_units);
    w->tasks = malloc(sizeof(int32_t) * 3 * (size_t)w->max_tasks);
    w->part = malloc(sizeof(float) * (w->part_floats > 0 ? w->part_floats : 1));
    w->zero = calloc((size_t)(w->dk > w->dv ? w->dk : w->dv), sizeof(float));
    if (!w->scratch || !w->units || !w->tasks || !w->part || !w->zero) {
        fa_work_free(w);
        return -1;
    }
    return 0;
}

bool fa_work_fits(const struct fa_work *w, int n, const struct be_attn *a)
{
    int group = a->n_head / a->n_kv_head;
    return n <= w->max_tokens && group <= w->rows && a->k_dim <= w->dk && a->v_dim <= w->dv &&
           a->n_kv_head <= w->kv_heads;
}

/* --- one unit ------------------------------------------------------------------------------ */

struct fa_call {
    const struct gemm_kernels *kk;
    struct fa_work *w;
    float *out;
    const float *q;
    const struct be_kv *kv;
    const struct be_tokens *tk;
    const struct be_attn *a;
    int block_size, group, esize;
    int n_units;
};

static inline const int32_t *tok_table(const struct be_tokens *tk, int i)
{
    return tk->seq ? tk->tables + (size_t)tk->seq[i] * tk->table_stride : tk->tables;
}

static inline int tok_pos(const struct be_tokens *tk, int i)
{
    return tk->pos ? tk->pos[i] : tk->pos0 + i;
}

/* The context columns [*lo, *hi] token i reads: positions from its window's or chunk's start
 * to its own; with a selection (DeepSeek sparse attention), its selected list, column t being
 * the list's t-th position (fa_unit.map). */
static inline void tok_range(const struct be_attn *a, const struct be_tokens *tk, int i, int *lo,
                             int *hi)
{
    if (a->sel && a->sel_n[i] >= 0) {
        *lo = 0;
        *hi = a->sel_n[i] - 1;
        return;
    }
    int pos = tok_pos(tk, i);
    int start = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    if (a->chunk > 0 && pos - pos % a->chunk > start) start = pos - pos % a->chunk;
    *lo = start;
    *hi = pos;
}

/* A unit: tokens tok0 .. tok0 + nt - 1 of one sequence and KV heads h0 .. h0 + nh - 1. Row
 * r = (hh * nt + t) * group + g is token tok0 + t, query head (h0 + hh) * group + g: each KV
 * head's rows are contiguous. */
struct fa_unit {
    int tok0, nt, h0, nh, R;
    const int32_t *table;
    /* DeepSeek sparse attention: the unit's one token attends to the positions its indexer
     * selected (ascending), and the unit's context is that list: column t reads position
     * map[t]. NULL: column t is position t. */
    const int32_t *map;
    float *qb;        /* (R, dk) queries times the softmax scale */
    int32_t *lo, *hi; /* (R) each row's positions [lo, hi] */
    int minlo, maxhi;
    float *kf, *vt, *s; /* per-thread tiles: (FA_TK, nh * dk), (FA_TK, nh * dv), (R, FA_TK) */
};

/* A row's softmax state: max, sum, then the value accumulator (dv). */
#define ST_M 0
#define ST_L 1
#define ST_O 2

static void unit_init(const struct fa_call *c, int u, float *scratch, struct fa_unit *un)
{
    const struct be_attn *a = c->a;
    const struct fa_work *w = c->w;
    const int32_t *ud = w->units + 4 * (size_t)u;
    un->tok0 = ud[0];
    un->nt = ud[1];
    un->h0 = ud[2];
    un->nh = ud[3];
    un->R = un->nt * un->nh * c->group;
    un->table = tok_table(c->tk, un->tok0);
    float *p = scratch;
    un->qb = p;
    p += (size_t)w->rows * w->dk;
    un->kf = p;
    p += (size_t)FA_TK * un->nh * a->k_dim;
    un->vt = p;
    p += (size_t)FA_TK * un->nh * a->v_dim;
    un->s = p;
    p += (size_t)un->R * FA_TK;
    un->lo = (int32_t *)p;
    p += un->R;
    un->hi = (int32_t *)p;
    un->minlo = 1 << 30;
    un->maxhi = -1;
    /* plan_units gives a token with a selection a unit alone */
    un->map = a->sel && a->sel_n[un->tok0] >= 0 ? a->sel + (size_t)un->tok0 * a->sel_stride : NULL;
    for (int t = 0; t < un->nt; t++) {
        int i = un->tok0 + t, start, end;
        tok_range(a, c->tk, i, &start, &end);
        for (int hh = 0; hh < un->nh; hh++)
            for (int g = 0; g < c->group; g++) {
                int r = (hh * un->nt + t) * c->group + g;
                un->lo[r] = start;
                un->hi[r] = end;
                const float *qr =
                    c->q + ((size_t)i * a->n_head + (size_t)(un->h0 + hh) * c->group + g) *
                               (size_t)a->k_dim;
                float *qd = un->qb + (size_t)r * a->k_dim;
                for (int d = 0; d < a->k_dim; d++) qd[d] = qr[d] * a->scale;
            }
        if (start < un->minlo) un->minlo = start;
        if (end > un->maxhi) un->maxhi = end;
    }
}

/* The states after the unit's tiles: two arrays of R rows of (dv + 2). */
static float *unit_states(const struct fa_unit *un)
{
    return (float *)(un->hi + un->R);
}

/* Rows j in [j0, j1] of a tile from cache positions t0 + j, converted for the unit's heads (the
 * rest of the key tile zero: those scores are masked; values before j0 zero too, as the
 * products read them with p = 0, those after j1 are not read). */
static void load_tile(const struct fa_call *c, const struct fa_unit *un, int t0, int j0, int j1)
{
    const struct be_attn *a = c->a;
    const struct be_kv *kv = c->kv;
    int dk = a->k_dim, dv = a->v_dim, bs = c->block_size, nh = un->nh;
    int ks = kv->k_grp, vs = kv->v_grp, nk = a->k_row / ks, nv = a->v_row / vs;
    size_t es = (size_t)c->esize, kw = (size_t)nh * dk, vw = (size_t)nh * dv;
    bool fp8 = kv->type == BE_KV_FP8_E4M3 || kv->type == BE_KV_FP8_E5M2;
    bool int8 = kv->type == BE_KV_INT8;
    memset(un->kf, 0, sizeof(float) * (size_t)j0 * kw);
    memset(un->kf + (size_t)(j1 + 1) * kw, 0, sizeof(float) * (size_t)(FA_TK - 1 - j1) * kw);
    memset(un->vt, 0, sizeof(float) * (size_t)j0 * vw);
    for (int j = j0; j <= j1; j++) {
        int p = un->map ? un->map[t0 + j] : t0 + j, slot = p % bs;
        size_t blk = (size_t)un->table[p / bs];
        float *kd = un->kf + (size_t)j * kw, *vd = un->vt + (size_t)j * vw;
        for (int hh = 0; hh < nh; hh++) {
            int h = un->h0 + hh;
            size_t ko = kv_seg_offset(blk, slot, bs, nk, h, ks);
            size_t vo = kv_seg_offset(blk, slot, bs, nv, h, vs);
            float kf = fp8 ? kv->k_scale
                       : int8 ? kv->k_sc[kv_seg_offset(blk, slot, bs, nk, h, 1)] : 1.0f;
            float vf = fp8 ? kv->v_scale
                       : int8 ? kv->v_sc[kv_seg_offset(blk, slot, bs, nv, h, 1)] : 1.0f;
            c->kk->kv_cvt(kd + (size_t)hh * dk, (const char *)kv->k + ko * es, dk, kv->type, kf);
            c->kk->kv_cvt(vd + (size_t)hh * dv, (const char *)kv->v + vo * es, dv, kv->type, vf);
        }
    }
}

/* Rows per KV head up to which a tile is read where the cache holds it (fa_dots_kv, fa_pv_kv)
 * rather than converted into a tile first: with few query rows (a decode) the conversion and
 * the tile's stores cost more than converting in registers for each row. Both give the same
 * bits, so which one runs changes no output. */
#define FA_DIRECT_ROWS 4

/* Head hh's rows of the tile at t0 where the cache holds them (values if v): pointers for
 * j in [j0, j1], the zero row elsewhere; their scales into sc (fp8, int8). Returns sc, or NULL
 * for the types without scales. */
static const float *tile_ptrs(const struct fa_call *c, const struct fa_unit *un, int hh, int t0,
                              int j0, int j1, int v, const void **ptr, float *sc)
{
    const struct be_attn *a = c->a;
    const struct be_kv *kv = c->kv;
    int seg = v ? kv->v_grp : kv->k_grp, n_seg = (v ? a->v_row : a->k_row) / seg;
    int bs = c->block_size, h = un->h0 + hh;
    size_t es = (size_t)c->esize;
    bool fp8 = kv->type == BE_KV_FP8_E4M3 || kv->type == BE_KV_FP8_E5M2;
    bool int8 = kv->type == BE_KV_INT8;
    const char *base = (const char *)(v ? kv->v : kv->k);
    int p0 = un->map ? 0 : t0 + j0, slot = p0 % bs, bi = p0 / bs; /* then by steps */
    size_t blk = (size_t)un->table[bi];
    for (int j = 0; j < FA_TK; j++) {
        if (j < j0 || j > j1) {
            ptr[j] = c->w->zero;
            sc[j] = 1.0f;
            continue;
        }
        if (un->map) { /* selected positions: a block lookup each */
            int p = un->map[t0 + j];
            slot = p % bs;
            blk = (size_t)un->table[p / bs];
        } else if (slot == bs) {
            slot = 0;
            blk = (size_t)un->table[++bi];
        }
        ptr[j] = base + kv_seg_offset(blk, slot, bs, n_seg, h, seg) * es;
        sc[j] = fp8    ? (v ? kv->v_scale : kv->k_scale)
                : int8 ? (v ? kv->v_sc : kv->k_sc)[kv_seg_offset(blk, slot, bs, n_seg, h, 1)]
                       : 1.0f;
        slot++;
    }
    return fp8 || int8 ? sc : NULL;
}

/* Segment `seg` of the unit's context into fresh states st (R rows of dv + 2). */
static void unit_segment(const struct fa_call *c, const struct fa_unit *un, int seg, float *st)
{
    const struct be_attn *a = c->a;
    int R = un->R, dk = a->k_dim, dv = a->v_dim, rows_h = un->nt * c->group;
    size_t ld = (size_t)dv + 2;
    for (int r = 0; r < R; r++) {
        float *sr = st + (size_t)r * ld;
        sr[ST_M] = -INFINITY;
        sr[ST_L] = 0.0f;
        memset(sr + ST_O, 0, sizeof(float) * (size_t)dv);
    }
    int s0 = seg * FA_SEG, s1 = s0 + FA_SEG - 1;
    int first = (un->minlo > s0 ? un->minlo : s0) / FA_TK * FA_TK;
    int last = un->maxhi < s1 ? un->maxhi : s1;
    for (int t0 = first; t0 <= last; t0 += FA_TK) {
        int j0 = un->minlo > t0 ? un->minlo - t0 : 0;
        int j1 = un->maxhi < t0 + FA_TK - 1 ? un->maxhi - t0 : FA_TK - 1;
        bool direct = rows_h <= FA_DIRECT_ROWS;
        const void *ptr[FA_TK];
        float sc[FA_TK];
        if (!direct) load_tile(c, un, t0, j0, j1);
        for (int hh = 0; hh < un->nh; hh++) {
            float *sh = un->s + (size_t)hh * rows_h * FA_TK;
            const float *qh = un->qb + (size_t)hh * rows_h * dk;
            if (direct)
                c->kk->fa_dots_kv(sh, qh, rows_h, dk, ptr,
                                  tile_ptrs(c, un, hh, t0, j0, j1, 0, ptr, sc), c->kv->type);
            else
                c->kk->fa_dots(sh, qh, rows_h, dk, un->kf + (size_t)hh * dk, un->nh * dk);
        }
        for (int r = 0; r < R; r++) {
            float *p = un->s + (size_t)r * FA_TK, *sr = st + (size_t)r * ld;
            int rlo = un->lo[r] > t0 ? un->lo[r] - t0 : 0;
            int rhi = un->hi[r] < t0 + FA_TK - 1 ? un->hi[r] - t0 : FA_TK - 1;
            if (rlo > rhi) { /* no key of this tile: the row contributes nothing */
                memset(p, 0, sizeof(float) * FA_TK);
                continue;
            }
            float mt = c->kk->fa_max(p, rlo, rhi), m = sr[ST_M];
            if (mt > m) {
                if (m != -INFINITY) { /* a larger maximum: what came before shrinks */
                    float f = expf(m - mt);
                    sr[ST_L] *= f;
                    for (int d = 0; d < dv; d++) sr[ST_O + d] *= f;
                }
                m = sr[ST_M] = mt;
            }
            sr[ST_L] += c->kk->fa_exp(p, rlo, rhi, m);
        }
        /* rows without keys here add 0 * v (v finite: loaded or zero) */
        for (int hh = 0; hh < un->nh; hh++) {
            int r0 = hh * rows_h;
            if (direct) {
                const float *scv = tile_ptrs(c, un, hh, t0, j0, j1, 1, ptr, sc);
                c->kk->fa_pv_kv(st + (size_t)r0 * ld + ST_O, ld, un->s + (size_t)r0 * FA_TK,
                                rows_h, dv, ptr, scv, j1 + 1, c->kv->type);
                continue;
            }
            for (int r = r0; r < r0 + rows_h; r++)
                c->kk->fa_pv(st + (size_t)r * ld + ST_O, un->s + (size_t)r * FA_TK, 1, dv,
                             un->vt + (size_t)hh * dv, un->nh * dv, j1 + 1);
        }
    }
}

/* tot = tot folded with seg, row by row (R rows of dv + 2). */
static void fold(float *tot, const float *seg, int R, int dv)
{
    size_t ld = (size_t)dv + 2;
    for (int r = 0; r < R; r++) {
        float *t = tot + (size_t)r * ld;
        const float *s = seg + (size_t)r * ld;
        if (s[ST_M] == -INFINITY) continue;
        if (t[ST_M] == -INFINITY) {
            memcpy(t, s, sizeof(float) * ld);
            continue;
        }
        float M = t[ST_M] > s[ST_M] ? t[ST_M] : s[ST_M];
        float ft = expf(t[ST_M] - M), fs = expf(s[ST_M] - M);
        t[ST_M] = M;
        t[ST_L] = t[ST_L] * ft + s[ST_L] * fs;
        for (int d = 0; d < dv; d++) t[ST_O + d] = t[ST_O + d] * ft + s[ST_O + d] * fs;
    }
}

static void state_reset(float *st, int R, int dv)
{
    for (int r = 0; r < R; r++) {
        float *t = st + (size_t)r * (dv + 2);
        t[ST_M] = -INFINITY;
        t[ST_L] = 0.0f;
        memset(t + ST_O, 0, sizeof(float) * (size_t)dv);
    }
}

/* The unit's outputs from its folded states: a sink (gpt-oss) is one more logit in each
 * head's denominator. */
static void unit_finish(const struct fa_call *c, const struct fa_unit *un, const float *tot)
{
    const struct be_attn *a = c->a;
    int dv = a->v_dim, rows_h = un->nt * c->group;
    for (int r = 0; r < un->R; r++) {
        const float *t = tot + (size_t)r * (dv + 2);
        int hh = r / rows_h, tt = r % rows_h / c->group, g = r % c->group;
        int h = (un->h0 + hh) * c->group + g;
        float m = t[ST_M], l = t[ST_L], f = 1.0f;
        if (a->sinks) {
            float sk = a->sinks[h], M = sk > m ? sk : m;
            f = expf(m - M);
            l = l * f + expf(sk - M);
        }
        float inv = f / l;
        float *o = c->out + ((size_t)(un->tok0 + tt) * a->n_head + h) * (size_t)dv;
        for (int d = 0; d < dv; d++) o[d] = t[ST_O + d] * inv;
    }
}

/* One unit, all its segments in order. */
static void unit_task(void *ctx, int u, int thread)
{
    const struct fa_call *c = ctx;
    float *scratch = c->w->scratch + (size_t)thread * c->w->per_thread;
    struct fa_unit un;
    unit_init(c, u, scratch, &un);
    float *tot = unit_states(&un), *seg = tot + (size_t)un.R * (c->a->v_dim + 2);
    state_reset(tot, un.R, c->a->v_dim);
    for (int s = un.minlo / FA_SEG; s <= un.maxhi / FA_SEG; s++) {
        unit_segment(c, &un, s, seg);
        fold(tot, seg, un.R, c->a->v_dim);
    }
    unit_finish(c, &un, tot);
}

/* One segment of a split unit, into its partial. */
static void seg_task(void *ctx, int task, int thread)
{
    const struct fa_call *c = ctx;
    const int32_t *tk = c->w->tasks + 3 * (size_t)task;
    float *scratch = c->w->scratch + (size_t)thread * c->w->per_thread;
    struct fa_unit un;
    unit_init(c, tk[0], scratch, &un);
    unit_segment(c, &un, tk[1], c->w->part + (size_t)tk[2] * (c->a->v_dim + 2));
}

/* A split unit's partials folded in segment order (its tasks are consecutive, from
 * first_task[u]). */
struct merge_job {
    const struct fa_call *c;
    const int32_t *first_task; /* (n_units + 1) */
};

static void merge_task(void *ctx, int u, int thread)
{
    const struct merge_job *mj = ctx;
    const struct fa_call *c = mj->c;
    float *scratch = c->w->scratch + (size_t)thread * c->w->per_thread;
    struct fa_unit un;
    unit_init(c, u, scratch, &un);
    float *tot = unit_states(&un);
    state_reset(tot, un.R, c->a->v_dim);
    for (int t = mj->first_task[u]; t < mj->first_task[u + 1]; t++)
        fold(tot, c->w->part + (size_t)c->w->tasks[3 * (size_t)t + 2] * (c->a->v_dim + 2), un.R,
             c->a->v_dim);
    unit_finish(c, &un, tot);
}

/* --- the call ------------------------------------------------------------------------------ */

/* Units of the call: runs of consecutive positions of one sequence, as many tokens as fit the
 * unit's rows (a prefill chunk: tokens of one KV head, so that each tile serves many), then as
 * many KV heads as fit (a decode token: every head, so that a tile reads whole cache rows).
 * Returns the number of units. */
static int plan_units(const struct fa_call *c, int n)
{
    struct fa_work *w = c->w;
    const struct be_tokens *tk = c->tk;
    int rows = w->rows, per = rows / c->group > 1 ? rows / c->group : 1, nu = 0;
    for (int i = 0; i < n;) {
        const int32_t *tb = tok_table(tk, i);
        int p0 = tok_pos(tk, i), cnt = 1;
        /* a token with a selection (DeepSeek sparse attention) has a context of its own */
        bool alone = c->a->sel && c->a->sel_n[i] >= 0;
        while (!alone && i + cnt < n && cnt < per && tok_table(tk, i + cnt) == tb &&
               tok_pos(tk, i + cnt) == p0 + cnt &&
               !(c->a->sel && c->a->sel_n[i + cnt] >= 0))
            cnt++;
        int nh = rows / (cnt * c->group);
        nh = nh < 1 ? 1 : nh > c->a->n_kv_head ? c->a->n_kv_head : nh;
        for (int h = 0; h < c->a->n_kv_head; h += nh) {
            int32_t *ud = w->units + 4 * (size_t)nu++;
            ud[0] = i;
            ud[1] = cnt;
            ud[2] = h;
            ud[3] = h + nh <= c->a->n_kv_head ? nh : c->a->n_kv_head - h;
        }
        i += cnt;
    }
    return nu;
}

void fa_attention(struct pool *pool, const struct gemm_kernels *kk, struct fa_work *w,
                  float *out, const float *q, const struct be_kv *kv,
                  const struct be_tokens *tk, int block_size, int n, const struct be_attn *a)
{
    if (n <= 0) return;
    struct fa_call c = {.kk = kk, .w = w, .out = out, .q = q, .kv = kv, .tk = tk, .a = a,
                        .block_size = block_size, .group = a->n_head / a->n_kv_head,
                        .esize = kv_type_size(kv->type)};
    c.n_units = plan_units(&c, n);
    int threads = pool_size(pool);
    if (threads > 1 && c.n_units < 2 * threads) {
        /* Few units: a task per segment, if the partials fit. first_task (n_units + 1) lives
         * at the end of the task table. */
        int n_tasks = 0;
        size_t off = 0;
        bool fits = true;
        int32_t *first = w->tasks + 3 * (size_t)w->max_tasks - (c.n_units + 1);
        for (int u = 0; u < c.n_units && fits; u++) {
            const int32_t *ud = w->units + 4 * (size_t)u;
            int lo, hi, unused; /* the unit's columns: its first token's start, its last's end */
            tok_range(a, tk, ud[0], &lo, &unused);
            tok_range(a, tk, ud[0] + ud[1] - 1, &unused, &hi);
            size_t rows = (size_t)ud[1] * ud[3] * c.group;
            first[u] = n_tasks;
            for (int s = lo / FA_SEG; s <= hi / FA_SEG; s++) {
                if (3 * (n_tasks + 1) > 3 * w->max_tasks - (c.n_units + 1) ||
                    off + rows * (a->v_dim + 2) > w->part_floats) {
                    fits = false;
                    break;
                }
                w->tasks[3 * n_tasks] = u;
                w->tasks[3 * n_tasks + 1] = s;
                w->tasks[3 * n_tasks + 2] = (int32_t)(off / (size_t)(a->v_dim + 2));
                off += rows * (a->v_dim + 2);
                n_tasks++;
            }
        }
        if (fits && n_tasks > c.n_units) {
            first[c.n_units] = n_tasks;
            pool_run(pool, seg_task, &c, n_tasks);
            struct merge_job mj = {.c = &c, .first_task = first};
            pool_run(pool, merge_task, &mj, c.n_units);
            return;
        }
    }
    pool_run(pool, unit_task, &c, c.n_units);
}
