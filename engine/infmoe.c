/* Continuous experts (infmoe): sampling, neuron selection and the gathered FFN of one layer.
 * The selection is the reference's (tools/train/infmoe_model.py): the N highest scores of
 * each sample (ties, which the reference leaves to torch.topk, go to the lower index here),
 * weights sigmoid(score) summed over the samples that keep a neuron, divided by K. */
#include "infmoe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LOGVAR_MIN (-10.0f)
#define LOGVAR_MAX 10.0f

/* The standard normal quantile in double: Acklam's rational approximation refined by one
 * Halley step on erfc (the reference's _ndtri). */
static double ndtri(double p)
{
    static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                               -2.759285104469687e+02, 1.383577518672690e+02,
                               -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                               -1.556989798598866e+02, 6.680131188771972e+01,
                               -1.328068155288572e+01};
    static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                               -2.400758277161838e+00, -2.549732539343734e+00,
                               4.374664141464968e+00,  2.938163982698783e+00};
    static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                               3.754408661907416e+00};
    if (p < 1e-12) p = 1e-12;
    if (p > 1.0 - 1e-12) p = 1.0 - 1e-12;
    double x;
    if (p < 0.02425 || p > 1.0 - 0.02425) {
        double q = sqrt(-2.0 * log(p < 0.5 ? p : 1.0 - p));
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0);
        if (p > 0.5) x = -x;
    } else {
        double q = p - 0.5, r = q * q;
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0);
    }
    double e = 0.5 * erfc(-x / sqrt(2.0)) - p;
    double u = e * sqrt(2.0 * M_PI) * exp(x * x / 2.0);
    return x - u / (1.0 + x * u / 2.0);
}

void infmoe_offsets(int k, int z, float *eps)
{
    /* R_d: alpha_j = phi^-(j+1), phi the positive root of x^(z+1) = x + 1 (Newton from 2,
     * decreasing to it); point s is frac(1/2 + s alpha), whose s = 0 is the mean. */
    double x = 2.0;
    for (int i = 0; i < 100; i++)
        x = x - (pow(x, z + 1) - x - 1.0) / ((z + 1) * pow(x, z) - 1.0);
    for (int s = 0; s < k; s++)
        for (int j = 0; j < z; j++)
            eps[(size_t)s * z + j] =
                s == 0 ? 0.0f : (float)ndtri(fmod(0.5 + s * pow(x, -(double)(j + 1)), 1.0));
}

int infmoe_scratch_init(struct infmoe_scratch *s, struct backend *be, const struct model *m,
                        int max_tokens)
{
    const struct model_desc *md = &m->desc;
    memset(s, 0, sizeof *s);
    size_t T = (size_t)max_tokens, Z = (size_t)md->cont_z, F = (size_t)md->cont_d_ff;
    size_t KM = (size_t)md->cont_max_samples;
    s->max_tokens = max_tokens;
    s->max_union = model_cont_union_max(md, md->cont_max_samples, md->cont_fraction);
    size_t U = (size_t)s->max_union;
    bool ok = true;
#define ALLOC(field, bytes)                                                                        \
    do {                                                                                           \
        s->field = be->ops->alloc(be, (bytes));                                                    \
        ok = ok && s->field;                                                                       \
    } while (0)
    ALLOC(rz, T * 2 * Z * sizeof(float));
    ALLOC(z, T * KM * Z * sizeof(float));
    ALLOC(scores, T * KM * F * sizeof(float));
    ALLOC(idx, T * U * sizeof(int32_t));
    ALLOC(coef, T * U * sizeof(float));
    ALLOC(count, T * sizeof(int32_t));
    ALLOC(hbuf, T * U * sizeof(float));
#undef ALLOC
    if (be->ops->host_memory) {
        s->h_rz = s->rz;
        s->h_z = s->z;
        s->h_scores = s->scores;
        s->h_idx = s->idx;
        s->h_coef = s->coef;
        s->h_count = s->count;
    } else {
        s->h_rz = malloc(T * 2 * Z * sizeof(float));
        s->h_z = malloc(T * KM * Z * sizeof(float));
        s->h_scores = malloc(T * KM * F * sizeof(float));
        s->h_idx = malloc(T * U * sizeof(int32_t));
        s->h_coef = malloc(T * U * sizeof(float));
        s->h_count = malloc(T * sizeof(int32_t));
        ok = ok && s->h_rz && s->h_z && s->h_scores && s->h_idx && s->h_coef && s->h_count;
    }
    s->eps = malloc(KM * Z * sizeof(float));
    if (be->ops->host_memory) { /* the keys transposed, for infmoe_scores */
        size_t L = (size_t)md->n_layer;
        float *row = malloc(Z * sizeof(float));
        s->keys_t = malloc(L * Z * F * sizeof(float));
        ok = ok && row && s->keys_t;
        for (size_t l = 0; ok && l < L; l++)
            for (size_t f = 0; f < F; f++) {
                wmat_row_f32(m->layers[l].cont_keys, (int)f, row);
                for (size_t j = 0; j < Z; j++) s->keys_t[(l * Z + j) * F + f] = row[j];
            }
        free(row);
    }
    s->iscratch = malloc(NEURON_ISCRATCH(T, U, F) * sizeof(int32_t));
    s->workers = be->ops->host_workers(be);
    if (s->workers < 1) s->workers = 1;
    size_t W = (size_t)s->workers;
    s->sel_list = malloc(W * 3 * F * sizeof(int32_t));
    s->sel_w = malloc(W * 3 * F * sizeof(float));
    s->work = malloc(W * 2 * F * sizeof(uint32_t));
    s->row0 = malloc(T * sizeof(int32_t));
    s->tok_samples = malloc(T * sizeof(int32_t));
    s->tok_keep = malloc(T * sizeof(int32_t));
    s->tok_adaptive = calloc(T, 1);
    s->k_used = malloc(T * sizeof(int32_t));
    if (!ok || !s->eps || !s->iscratch || !s->sel_list || !s->sel_w || !s->work || !s->row0 || !s->tok_samples || !s->tok_keep ||
        !s->tok_adaptive || !s->k_used) {
        infmoe_scratch_release(s, be);
        return -1;
    }
    infmoe_offsets((int)KM, (int)Z, s->eps);
    for (size_t t = 0; t < T; t++) {
        s->tok_samples[t] = md->cont_samples;
        s->tok_keep[t] = model_cont_neurons(md, md->cont_fraction);
    }
    return 0;
}

void infmoe_scratch_release(struct infmoe_scratch *s, struct backend *be)
{
    if (s->h_rz != s->rz) {
        free(s->h_rz);
        free(s->h_z);
        free(s->h_scores);
        free(s->h_idx);
        free(s->h_coef);
        free(s->h_count);
    }
    void *bufs[] = {s->rz, s->z, s->scores, s->idx, s->coef, s->count, s->hbuf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    free(s->eps);
    free(s->keys_t);
    free(s->iscratch);
    free(s->sel_list);
    free(s->sel_w);
    free(s->work);
    free(s->row0);
    free(s->tok_samples);
    free(s->tok_keep);
    free(s->tok_adaptive);
    free(s->k_used);
    memset(s, 0, sizeof *s);
}

int infmoe_adaptive_k(const double *q, int nq, double u, int k, int k_max)
{
    int Q = nq - 1;
    double r;
    if (u <= q[0]) {
        r = 0.0;
    } else if (u >= q[Q]) {
        r = 1.0;
    } else {
        int i = 0;
        while (i + 1 < Q && u >= q[i + 1])
            i++;
        double span = q[i + 1] - q[i];
        r = (i + (span > 0 ? (u - q[i]) / span : 0.0)) / Q;
    }
    int kk = 1 + (int)floor(2.0 * (k - 1) * r + 0.5);
    return kk < 1 ? 1 : kk > k_max ? k_max : kk;
}

/* A float's bits as an unsigned key in the same order (-0 and +0 equal, like the floats:
 * adding +0 turns -0 into +0 and changes nothing else). */
static inline uint32_t order_key(float f)
{
    uint32_t u;
    f += 0.0f;
    memcpy(&u, &f, sizeof u);
    uint32_t neg = (uint32_t)((int32_t)u >> 31); /* all ones for a negative float */
    return u ^ (neg | 0x80000000u);
}

/* The key of the n-th largest (1 <= n <= len) of keys[0..len), by radix selection a byte at
 * a time from the top: a histogram of the candidates' byte, the bucket holding the n-th, then
 * only that bucket's keys (cand: len scratch) for the next byte. No data-dependent branches
 * on the common path, unlike a quickselect over floats. *ties: how many keys equal to it are
 * among the n largest (the rest are above it); *equal: how many keys equal it in all. */
static uint32_t nth_largest_key(const uint32_t *keys, int len, int n, uint32_t *cand, int *ties,
                                int *equal)
{
    uint32_t prefix = 0;
    const uint32_t *src = keys;
    int cnt = len;
    for (int shift = 24; shift >= 0; shift -= 8) {
        /* four histograms, added after: scores crowd into few buckets, and one histogram
         * would wait on its own last increment; a few hundred keys take one (clearing and
         * adding four would cost more than the waits) */
        int h4[4][256], *hist = h4[0];
        int i = 0;
        if (cnt >= 1024) {
            memset(h4, 0, sizeof h4);
            for (; i + 4 <= cnt; i += 4) {
                h4[0][(src[i] >> shift) & 255]++;
                h4[1][(src[i + 1] >> shift) & 255]++;
                h4[2][(src[i + 2] >> shift) & 255]++;
                h4[3][(src[i + 3] >> shift) & 255]++;
            }
            for (int v = 0; v < 256; v++)
                hist[v] += h4[1][v] + h4[2][v] + h4[3][v];
        } else {
            memset(hist, 0, sizeof h4[0]);
        }
        for (; i < cnt; i++)
            hist[(src[i] >> shift) & 255]++;
        int b = 255;
        while (b > 0 && n > hist[b])
            n -= hist[b--];
        prefix |= (uint32_t)b << shift;
        *ties = n;
        *equal = hist[b];
        if (shift == 0 || hist[b] == 1) {
            if (hist[b] == 1) /* the only key left: find it */
                for (int x = 0; x < cnt; x++)
                    if (((src[x] >> shift) & 255) == (uint32_t)b) return src[x];
            break;
        }
        int m = 0;
        for (int x = 0; x < cnt; x++) {
            cand[m] = src[x];
            m += ((src[x] >> shift) & 255) == (uint32_t)b;
        }
        src = cand, cnt = m;
    }
    return prefix;
}

/* y (rows, F) = z (rows, Z) . keys_t (Z, F): a GEMM whose inner dimension is the latent's
 * 16 or so, which the tiled GEMM (built for wide rows) takes at a fraction of its speed. Here
 * 64 scores of up to four rows (a token's samples) are summed in 16 vector accumulators that
 * stay in registers while the Z key columns stream past once; GCC's vector extension lowers
 * them to the machine's widest SIMD (one clone per instruction set, chosen at load). Each
 * score sums its Z products in latent order. */
typedef float score_vec __attribute__((vector_size(64)));

/* 64 scores of NR rows (a constant once inlined, so that the accumulators are registers). */
static inline __attribute__((always_inline)) void
scores_block(const int NR, float *restrict y, const float *restrict zr,
             const float *restrict keys_t, int Z, int F, int f0)
{
    score_vec acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = (score_vec){0};
    for (int j = 0; j < Z; j++) {
        score_vec k[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) memcpy(&k[c], keys_t + (size_t)j * F + f0 + 16 * c, sizeof k[c]);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float a = zr[(size_t)r * Z + j];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] += a * k[c];
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) memcpy(y + (size_t)r * F + f0 + 16 * c, &acc[r][c], sizeof acc[r][c]);
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void infmoe_scores(float *restrict y, const float *restrict z, const float *restrict keys_t,
                   int rows, int Z, int F)
{
    enum { COLS = 64 };
    int fv = F - F % COLS;
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int nr = rows - r0 < 4 ? rows - r0 : 4;
        const float *zr = z + (size_t)r0 * Z;
        float *yr = y + (size_t)r0 * F;
        for (int f0 = 0; f0 < fv; f0 += COLS) {
            switch (nr) {
            case 1: scores_block(1, yr, zr, keys_t, Z, F, f0); break;
            case 2: scores_block(2, yr, zr, keys_t, Z, F, f0); break;
            case 3: scores_block(3, yr, zr, keys_t, Z, F, f0); break;
            default: scores_block(4, yr, zr, keys_t, Z, F, f0); break;
            }
        }
        for (int r = 0; r < nr; r++) /* the columns past the last whole block */
            for (int f = fv; f < F; f++) {
                float s = 0.0f;
                for (int j = 0; j < Z; j++) s += zr[(size_t)r * Z + j] * keys_t[(size_t)j * F + f];
                yr[(size_t)r * F + f] = s;
            }
    }
}

/* Below this many scores the selection is a radix select over all of them. */
#define SELECT_PIVOT_MIN 512
/* Strided sample for the pivot: this many scores, and the pivot's rank in it chosen so that
 * about 5/4 of `keep` scores reach it on the whole row. */
#define SELECT_SAMPLE 128

int infmoe_select(const float *sc, int F, int keep, int32_t *list, float *w, uint32_t *work)
{
    uint32_t *keys = work, *scratch = work + F;
    if (keep > F) keep = F;
    if (keep <= 0) return 0;
    /* keys[0, n) with their neurons list[0, n) (ascending): all F, or (when a pivot below the
     * keep-th largest is found) only the scores that reach it, which hold the keep-th largest
     * and every score equal to it, so that the search over them is exact. A strided sample's
     * rank estimates the pivot; one that proves too high (fewer than keep reach it) falls back
     * to all. */
    int n = F;
    bool narrowed = false;
    if (F >= SELECT_PIVOT_MIN && keep <= F / 4) {
        uint32_t sample[SELECT_SAMPLE];
        int stride = F / SELECT_SAMPLE, st, se;
        int rank = (int)((5 * (int64_t)keep * SELECT_SAMPLE) / (4 * (int64_t)F)) + 2;
        for (int i = 0; i < SELECT_SAMPLE; i++) sample[i] = order_key(sc[(size_t)i * stride]);
        uint32_t pivot = nth_largest_key(sample, SELECT_SAMPLE, rank, scratch, &st, &se);
        int c = 0;
        for (int f = 0; f < F; f++) {
            uint32_t k = order_key(sc[f]);
            keys[c] = k;
            list[c] = f;
            c += k >= pivot;
        }
        if (c >= keep) n = c, narrowed = true;
    }
    if (!narrowed)
        for (int f = 0; f < F; f++) keys[f] = order_key(sc[f]), list[f] = f;
    int ties, equal; /* neurons equal to the threshold to take (lowest first), and in all */
    uint32_t thr = nth_largest_key(keys, n, keep, scratch, &ties, &equal);
    /* the lowest `ties` neurons equal to the threshold when only some of them are kept (rare) */
    int32_t *tie = (int32_t *)scratch;
    int nt = 0;
    if (ties < equal && ties > 0)
        for (int x = 0; nt < ties && x < n; x++)
            if (keys[x] == thr) tie[nt++] = list[x];
    /* the kept neurons by an in-place compaction without data-dependent branches (about one
     * neuron in ten is kept, one candidate in 1.25: a branch per entry mispredicts); then the
     * ties merged in, from the end */
    uint32_t lo = ties == equal || thr == UINT32_MAX ? thr : thr + 1;
    int m = 0;
    for (int x = 0; x < n; x++) {
        list[m] = list[x];
        m += keys[x] >= lo;
    }
    for (int a = m - 1, b = nt - 1, o = m + nt - 1; b >= 0; o--)
        list[o] = a >= 0 && list[a] > tie[b] ? list[a--] : tie[b--];
    m += nt;
    for (int i = 0; i < m; i++) w[i] = 1.0f / (1.0f + expf(-sc[list[i]]));
    return m;
}

struct select_job {
    struct infmoe_scratch *s;
    int F;
};

/* Token t's slices and their union (ascending), with worker w's scratch: each sample's kept
 * list merged into the union so far, a neuron's weight summed in sample order. */
static void select_task(void *ctx, int t, int w)
{
    struct select_job *j = ctx;
    struct infmoe_scratch *s = j->s;
    int F = j->F, U = s->max_union, K = s->k_used[t];
    int32_t *li = s->sel_list + (size_t)w * 3 * (size_t)F, *ui = li + F, *vi = ui + F;
    float *lw = s->sel_w + (size_t)w * 3 * (size_t)F, *uw = lw + F, *vw = uw + F;
    uint32_t *work = s->work + (size_t)w * 2 * F;
    int nu = 0;
    for (int k = 0; k < K; k++) {
        int nl = infmoe_select(s->h_scores + (size_t)(s->row0[t] + k) * F, F, s->tok_keep[t], li,
                               lw, work);
        int a = 0, b = 0, o = 0;
        while (a < nu || b < nl) {
            if (b >= nl || (a < nu && ui[a] < li[b])) {
                vi[o] = ui[a], vw[o++] = uw[a++];
            } else if (a >= nu || li[b] < ui[a]) {
                vi[o] = li[b], vw[o++] = 0.0f + lw[b++];
            } else {
                vi[o] = ui[a], vw[o++] = uw[a++] + lw[b++];
            }
        }
        int32_t *ti = ui;
        float *tw = uw;
        ui = vi, uw = vw, vi = ti, vw = tw, nu = o;
    }
    if (nu > U) nu = U; /* never: K <= max_samples, N <= the model's */
    int32_t *oi = s->h_idx + (size_t)t * U;
    float *oc = s->h_coef + (size_t)t * U;
    for (int i = 0; i < nu; i++) {
        oi[i] = ui[i];
        oc[i] = uw[i] / (float)K;
    }
    s->h_count[t] = nu;
}

uint64_t infmoe_forward(const struct model *m, int layer, struct backend *be,
                        struct infmoe_scratch *s, const float *h, int n, float *out)
{
    const struct model_desc *md = &m->desc;
    const struct layer_w *lw = &m->layers[layer];
    int D = md->d_model, Z = md->cont_z, F = md->cont_d_ff, U = s->max_union;
    if (n <= 0) return 0;

    be->ops->matmul(be, s->rz, h, lw->cont_router, lw->cont_router_b, n, D, 2 * Z);
    be->ops->download(be, s->h_rz, s->rz, sizeof(float) * (size_t)n * 2 * Z);
    /* Samples, scaled by 1/sqrt(Z) before the key product (the reference's order). */
    float scale = (float)(1.0 / sqrt((double)Z));
    int rows = 0;
    for (int t = 0; t < n; t++) {
        const float *mu = s->h_rz + (size_t)t * 2 * Z, *lv = mu + Z;
        int K = s->tok_samples[t];
        if (s->tok_adaptive[t] && md->cont_n_quant >= 2) {
            double u = 0.0;
            for (int j = 0; j < Z; j++) {
                float v = lv[j] < LOGVAR_MIN ? LOGVAR_MIN : lv[j] > LOGVAR_MAX ? LOGVAR_MAX : lv[j];
                u += (double)v;
            }
            K = infmoe_adaptive_k(md->cont_quant + (size_t)layer * md->cont_n_quant,
                                  md->cont_n_quant, u / Z, K, md->cont_max_samples);
        }
        s->k_used[t] = K;
        s->row0[t] = rows;
        for (int k = 0; k < K; k++, rows++) {
            float *zr = s->h_z + (size_t)rows * Z;
            const float *eps = s->eps + (size_t)k * Z;
            for (int j = 0; j < Z; j++) {
                float v = lv[j] < LOGVAR_MIN ? LOGVAR_MIN : lv[j] > LOGVAR_MAX ? LOGVAR_MAX : lv[j];
                zr[j] = (mu[j] + expf(0.5f * v) * eps[j]) * scale;
            }
        }
    }
    if (s->keys_t) { /* host memory: h_scores is scores */
        infmoe_scores(s->h_scores, s->h_z, s->keys_t + (size_t)layer * Z * F, rows, Z, F);
    } else {
        be->ops->upload(be, s->z, s->h_z, sizeof(float) * (size_t)rows * Z);
        be->ops->matmul(be, s->scores, s->z, lw->cont_keys, NULL, rows, Z, F);
        be->ops->download(be, s->h_scores, s->scores, sizeof(float) * (size_t)rows * F);
    }

    /* Per token: the union of its samples' slices, in ascending neuron order. */
    struct select_job j = {.s = s, .F = F};
    be->ops->host_for(be, n, select_task, &j);
    uint64_t computed = 0;
    for (int t = 0; t < n; t++)
        computed += (uint64_t)s->h_count[t];
    if (!be->ops->host_memory) {
        be->ops->upload(be, s->count, s->h_count, sizeof(int32_t) * (size_t)n);
        be->ops->upload(be, s->idx, s->h_idx, sizeof(int32_t) * (size_t)n * U);
        be->ops->upload(be, s->coef, s->h_coef, sizeof(float) * (size_t)n * U);
    }
    be->ops->neuron_ffn(be, out, h, n, D, lw->cont_gate, lw->cont_up, lw->cont_down_t, s->idx,
                        s->coef, s->count, U, s->hbuf, s->iscratch);
    return computed;
}
