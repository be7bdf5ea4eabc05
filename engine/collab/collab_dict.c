/* Nonnegative online dictionary learning for expert collaboration groups (collab_dict.h). */
#include "collab/collab_dict.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "collab/collab_data.h"
#include "common.h"
#include "rng.h"

#define CD_MAX_SWEEPS 100
#define CD_TOL        1e-6

void cdict_params_default(struct cdict_params *p)
{
    *p = (struct cdict_params){.n_atoms = 16, .lambda = 0.1, .epochs = 10, .batch = 256, .seed = 1};
}

void cdict_free(struct cdict *d)
{
    if (!d) return;
    free(d->atom);
    free(d->gram);
    free(d);
}

static void update_gram(struct cdict *d)
{
    int K = d->n_atoms, F = d->n_feat;
    for (int i = 0; i < K; i++)
        for (int j = 0; j <= i; j++) {
            const float *a = d->atom + (size_t)i * F, *b = d->atom + (size_t)j * F;
            double s = 0.0;
            for (int f = 0; f < F; f++)
                s += (double)a[f] * b[f];
            d->gram[i * K + j] = d->gram[j * K + i] = s;
        }
}

/* b = D x for row r */
static void project_row(const struct cdict *d, const struct cdata *x, size_t r, double *b)
{
    int K = d->n_atoms, F = d->n_feat;
    for (int k = 0; k < K; k++) {
        const float *a = d->atom + (size_t)k * F;
        double s = 0.0;
        for (size_t p = x->ptr[r]; p < x->ptr[r + 1]; p++)
            s += (double)a[x->idx[p]] * x->val[p];
        b[k] = s;
    }
}

void cdict_encode(const struct cdict *d, const struct cdata *x, size_t r, float *code, double *work)
{
    int K = d->n_atoms;
    double *res = work; /* res_j = b_j - sum_k G_jk a_k */
    project_row(d, x, r, res);
    for (int k = 0; k < K; k++)
        code[k] = 0.0f;
    for (int sweep = 0; sweep < CD_MAX_SWEEPS; sweep++) {
        double moved = 0.0;
        for (int j = 0; j < K; j++) {
            double g = d->gram[j * K + j];
            if (g < 1e-12) continue;
            double old = code[j];
            double nw = (res[j] + g * old - d->lambda) / g;
            if (nw < 0.0) nw = 0.0;
            float nf = (float)nw;
            double delta = (double)nf - old;
            if (delta == 0.0) continue;
            code[j] = nf;
            const double *gj = d->gram + (size_t)j * K;
            for (int k = 0; k < K; k++)
                res[k] -= gj[k] * delta;
            if (fabs(delta) > moved) moved = fabs(delta);
        }
        if (moved < CD_TOL) break;
    }
}

static void set_atom_from_row(struct cdict *d, int k, const struct cdata *x, size_t r)
{
    float *a = d->atom + (size_t)k * d->n_feat;
    memset(a, 0, sizeof(float) * (size_t)d->n_feat);
    for (size_t p = x->ptr[r]; p < x->ptr[r + 1]; p++)
        a[x->idx[p]] = x->val[p];
}

/* Initial atoms: K rows chosen k-means++ style (each next row drawn with probability growing
 * with its distance to the rows chosen so far) among up to INIT_SAMPLE random rows, so that a
 * popular group does not take several atoms while a rare one gets none. order: a permutation
 * of the rows (shuffled here); dense: (n_feat) scratch. */
#define INIT_SAMPLE 8192
static int init_atoms(struct cdict *d, const struct cdata *x, size_t *order, struct ms_rng *rng,
                      double *dense)
{
    size_t n = x->n_row;
    int K = d->n_atoms;
    for (size_t i = n - 1; i > 0; i--) {
        size_t j = (size_t)(ms_rng_next(rng) % (uint64_t)(i + 1));
        size_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    size_t S = n < INIT_SAMPLE ? n : INIT_SAMPLE;
    double *mind = malloc(sizeof(double) * S);
    if (!mind) return -1;
    for (size_t i = 0; i < S; i++)
        mind[i] = 4.0;
    size_t pick = (size_t)(ms_rng_next(rng) % (uint64_t)S);
    for (int k = 0; k < K; k++) {
        size_t r = order[pick];
        set_atom_from_row(d, k, x, r);
        for (int f = 0; f < d->n_feat; f++)
            dense[f] = d->atom[(size_t)k * d->n_feat + f];
        double total = 0.0;
        for (size_t i = 0; i < S; i++) {
            size_t ri = order[i];
            double dot = 0.0;
            for (size_t q = x->ptr[ri]; q < x->ptr[ri + 1]; q++)
                dot += dense[x->idx[q]] * x->val[q];
            double dist = 2.0 - 2.0 * dot; /* unit rows: squared distance */
            if (dist < mind[i]) mind[i] = dist;
            total += mind[i] > 0.0 ? mind[i] * mind[i] : 0.0;
        }
        if (!(total > 0.0)) { /* fewer distinct rows than atoms: any row */
            pick = (size_t)(ms_rng_next(rng) % (uint64_t)S);
            continue;
        }
        double u = ms_rng_uniform(rng) * total, acc = 0.0;
        pick = S - 1;
        for (size_t i = 0; i < S; i++) {
            acc += mind[i] > 0.0 ? mind[i] * mind[i] : 0.0;
            if (acc > u) {
                pick = i;
                break;
            }
        }
    }
    free(mind);
    return 0;
}

int cdict_learn(const struct cdata *x, const struct cdict_params *p, struct cdict **out, char *err,
                size_t errlen)
{
    *out = NULL;
    int K = p->n_atoms, F = x->n_feat;
    if (K < 1 || K > 4096)
        return ms_errf(err, errlen, "collab: the number of groups must be in [1, 4096], got %d", K);
    if (x->n_row < (size_t)K)
        return ms_errf(err, errlen,
                       "collab: %zu activation rows are too few to learn %d groups (need at "
                       "least as many tokens as groups)",
                       x->n_row, K);
    if (!(p->lambda >= 0.0) || p->epochs < 1 || p->batch < 1)
        return ms_errf(err, errlen, "collab: lambda must be >= 0, epochs and batch >= 1");
    struct cdict *d = calloc(1, sizeof *d);
    size_t n = x->n_row;
    double *A = NULL, *B = NULL, *work = NULL;
    float *code = NULL;
    size_t *order = NULL;
    if (!d) goto oom;
    d->n_atoms = K;
    d->n_feat = F;
    d->lambda = p->lambda;
    d->atom = calloc((size_t)K * F, sizeof *d->atom);
    d->gram = calloc((size_t)K * K, sizeof *d->gram);
    A = calloc((size_t)K * K, sizeof *A);
    B = calloc((size_t)K * F, sizeof *B);
    work = malloc(sizeof(double) * (size_t)(K > F ? K : F));
    code = malloc(sizeof(float) * (size_t)K * (size_t)p->batch);
    order = malloc(sizeof(size_t) * n);
    if (!d->atom || !d->gram || !A || !B || !work || !code || !order) goto oom;

    struct ms_rng rng;
    ms_rng_seed(&rng, p->seed);
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    if (init_atoms(d, x, order, &rng, work) != 0) goto oom;
    update_gram(d);
    int bs = p->batch < (int)(n < 1u << 30 ? n : 1u << 30) ? p->batch : (int)n;
    /* forgetting factor: the statistics are a window of about one pass */
    double beta = 1.0 - (double)bs / (double)n;
    for (int ep = 0; ep < p->epochs; ep++) {
        for (size_t i = n - 1; i > 0; i--) {
            size_t j = (size_t)(ms_rng_next(&rng) % (uint64_t)(i + 1));
            size_t t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (size_t b0 = 0; b0 < n; b0 += (size_t)bs) {
            int m = n - b0 < (size_t)bs ? (int)(n - b0) : bs;
            for (int i = 0; i < K * K; i++)
                A[i] *= beta;
            for (size_t i = 0; i < (size_t)K * F; i++)
                B[i] *= beta;
            for (int i = 0; i < m; i++) {
                size_t r = order[b0 + (size_t)i];
                float *c = code + (size_t)i * K;
                cdict_encode(d, x, r, c, work);
                for (int a = 0; a < K; a++) {
                    if (c[a] == 0.0f) continue;
                    for (int b = 0; b < K; b++)
                        A[a * K + b] += (double)c[a] * c[b];
                    double *Ba = B + (size_t)a * F;
                    for (size_t q = x->ptr[r]; q < x->ptr[r + 1]; q++)
                        Ba[x->idx[q]] += (double)c[a] * x->val[q];
                }
            }
            /* block-coordinate descent on the atoms, one sweep per batch */
            for (int j = 0; j < K; j++) {
                float *dj = d->atom + (size_t)j * F;
                double ajj = A[j * K + j];
                if (ajj < 1e-9) {
                    /* unused atom: restart it from a row of this batch */
                    size_t r = order[b0 + (size_t)(ms_rng_next(&rng) % (uint64_t)m)];
                    set_atom_from_row(d, j, x, r);
                    continue;
                }
                /* u = d_j + (B_j - sum_k A_jk d_k) / A_jj */
                for (int f = 0; f < F; f++)
                    work[f] = B[(size_t)j * F + f];
                for (int k = 0; k < K; k++) {
                    double akj = A[k * K + j];
                    if (akj == 0.0) continue;
                    const float *dk = d->atom + (size_t)k * F;
                    for (int f = 0; f < F; f++)
                        work[f] -= akj * dk[f];
                }
                double norm = 0.0;
                for (int f = 0; f < F; f++) {
                    double u = dj[f] + work[f] / ajj;
                    work[f] = u > 0.0 ? u : 0.0;
                    norm += work[f] * work[f];
                }
                norm = sqrt(norm);
                double s = norm > 1.0 ? 1.0 / norm : 1.0;
                for (int f = 0; f < F; f++)
                    dj[f] = (float)(work[f] * s);
            }
            update_gram(d);
        }
    }
    free(A);
    free(B);
    free(work);
    free(code);
    free(order);
    *out = d;
    return 0;
oom:
    free(A);
    free(B);
    free(work);
    free(code);
    free(order);
    cdict_free(d);
    return ms_errf(err, errlen, "out of memory");
}

double cdict_encode_all(const struct cdict *d, const struct cdata *x, float *codes)
{
    int K = d->n_atoms;
    double *work = malloc(sizeof(double) * (size_t)K * 2);
    float *own = codes ? NULL : malloc(sizeof(float) * (size_t)K);
    if (!work || (!codes && !own)) {
        free(work);
        free(own);
        return -1.0;
    }
    double *b = work + K;
    double num = 0.0, den = 0.0;
    for (size_t r = 0; r < x->n_row; r++) {
        float *c = codes ? codes + r * K : own;
        cdict_encode(d, x, r, c, work);
        /* ||x - D^T a||^2 = ||x||^2 - 2 a.b + a^T G a */
        project_row(d, x, r, b);
        double xx = 0.0, ab = 0.0, aga = 0.0;
        for (size_t q = x->ptr[r]; q < x->ptr[r + 1]; q++)
            xx += (double)x->val[q] * x->val[q];
        for (int i = 0; i < K; i++) {
            if (c[i] == 0.0f) continue;
            ab += c[i] * b[i];
            for (int j = 0; j < K; j++)
                aga += (double)c[i] * c[j] * d->gram[i * K + j];
        }
        double e = xx - 2.0 * ab + aga;
        num += e > 0.0 ? e : 0.0;
        den += xx;
    }
    free(work);
    free(own);
    return den > 0.0 ? num / den : 0.0;
}

int cdict_merge(const struct cdict *fine, int n_coarse, int *parent, struct cdict **coarse,
                char *err, size_t errlen)
{
    *coarse = NULL;
    int K = fine->n_atoms, F = fine->n_feat;
    if (n_coarse < 1 || n_coarse > K)
        return ms_errf(err, errlen, "collab: %d coarse groups from %d fine ones (need 1..%d)",
                       n_coarse, K, K);
    double *sim = malloc(sizeof(double) * (size_t)K * K); /* cluster-to-cluster sum of cosines */
    int *size = malloc(sizeof(int) * (size_t)K);
    struct cdict *c = calloc(1, sizeof *c);
    if (!sim || !size || !c) goto oom;
    for (int i = 0; i < K; i++) {
        parent[i] = i;
        size[i] = 1;
        for (int j = 0; j < K; j++) {
            double n = sqrt(fine->gram[i * K + i] * fine->gram[j * K + j]);
            sim[i * K + j] = n > 0.0 ? fine->gram[i * K + j] / n : 0.0;
        }
    }
    /* clusters are named by their lowest atom; merge the pair of highest average similarity */
    for (int left = K; left > n_coarse; left--) {
        int bi = -1, bj = -1;
        double best = -1.0;
        for (int i = 0; i < K; i++) {
            if (parent[i] != i) continue;
            for (int j = i + 1; j < K; j++) {
                if (parent[j] != j) continue;
                double avg = sim[i * K + j] / ((double)size[i] * size[j]);
                if (avg > best) {
                    best = avg;
                    bi = i;
                    bj = j;
                }
            }
        }
        for (int a = 0; a < K; a++)
            if (parent[a] == bj) parent[a] = bi;
        for (int a = 0; a < K; a++) {
            if (parent[a] != a || a == bi) continue;
            sim[bi * K + a] = sim[a * K + bi] = sim[bi * K + a] + sim[bj * K + a];
        }
        size[bi] += size[bj];
    }
    /* dense numbering 0..n_coarse-1 by the lowest fine atom */
    int *num = size; /* reused: root -> number */
    int m = 0;
    for (int i = 0; i < K; i++)
        num[i] = parent[i] == i ? m++ : -1;
    for (int i = 0; i < K; i++)
        parent[i] = num[parent[i]];
    c->n_atoms = n_coarse;
    c->n_feat = F;
    c->lambda = fine->lambda;
    c->atom = calloc((size_t)n_coarse * F, sizeof *c->atom);
    c->gram = calloc((size_t)n_coarse * n_coarse, sizeof *c->gram);
    if (!c->atom || !c->gram) goto oom;
    for (int i = 0; i < K; i++) {
        float *dst = c->atom + (size_t)parent[i] * F;
        const float *src = fine->atom + (size_t)i * F;
        for (int f = 0; f < F; f++)
            dst[f] += src[f];
    }
    for (int k = 0; k < n_coarse; k++) {
        float *a = c->atom + (size_t)k * F;
        double n = 0.0;
        for (int f = 0; f < F; f++)
            n += (double)a[f] * a[f];
        if (n > 0.0)
            for (int f = 0; f < F; f++)
                a[f] = (float)(a[f] / sqrt(n));
    }
    update_gram(c);
    free(sim);
    free(size);
    *coarse = c;
    return 0;
oom:
    free(sim);
    free(size);
    cdict_free(c);
    return ms_errf(err, errlen, "out of memory");
}

void cdict_assign(const struct cdict *d, int *group)
{
    for (int f = 0; f < d->n_feat; f++) {
        float best = 0.0f;
        group[f] = -1;
        for (int k = 0; k < d->n_atoms; k++) {
            float v = d->atom[(size_t)k * d->n_feat + f];
            if (v > best) {
                best = v;
                group[f] = k;
            }
        }
    }
}

static int relabel(const int *a, int n, int *out)
{
    /* dense labels 0..m-1 in order of first appearance (O(n m), n is small) */
    int m = 0;
    int *seen = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (!seen) return -1;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < m && seen[j] != a[i])
            j++;
        if (j == m) seen[m++] = a[i];
        out[i] = j;
    }
    free(seen);
    return m;
}

double cdict_ari(const int *a, const int *b, int n)
{
    if (n < 2) return 1.0;
    int *ra = malloc(sizeof(int) * (size_t)n), *rb = malloc(sizeof(int) * (size_t)n);
    double ari = NAN;
    double *tab = NULL;
    int ma, mb;
    if (!ra || !rb || (ma = relabel(a, n, ra)) < 0 || (mb = relabel(b, n, rb)) < 0) goto out;
    tab = calloc((size_t)ma * mb, sizeof *tab);
    if (!tab) goto out;
    for (int i = 0; i < n; i++)
        tab[(size_t)ra[i] * mb + rb[i]] += 1.0;
    double sij = 0.0, sa = 0.0, sb = 0.0;
    for (int i = 0; i < ma; i++) {
        double row = 0.0;
        for (int j = 0; j < mb; j++) {
            double v = tab[(size_t)i * mb + j];
            sij += v * (v - 1) / 2;
            row += v;
        }
        sa += row * (row - 1) / 2;
    }
    for (int j = 0; j < mb; j++) {
        double col = 0.0;
        for (int i = 0; i < ma; i++)
            col += tab[(size_t)i * mb + j];
        sb += col * (col - 1) / 2;
    }
    double total = (double)n * (n - 1) / 2;
    double expect = sa * sb / total, maxi = (sa + sb) / 2;
    ari = maxi == expect ? 1.0 : (sij - expect) / (maxi - expect);
out:
    free(ra);
    free(rb);
    free(tab);
    return ari;
}
