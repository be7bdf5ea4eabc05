/* Cross-layer activation rows for the collaboration analysis, built from routing steps (see
 * collab_data.h). */
#include "collab/collab_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "routing/route_trace.h"

int cdata_create(int n_layer, int n_expert, int top_k, struct cdata **out, char *err, size_t errlen)
{
    *out = NULL;
    if (n_layer < 1 || n_expert < 1 || top_k < 1 || (int64_t)n_layer * n_expert > (1 << 24))
        return ms_errf(err, errlen, "collab: bad shape (%d layers, %d experts, top-%d)", n_layer,
                       n_expert, top_k);
    struct cdata *d = calloc(1, sizeof *d);
    if (!d) return ms_errf(err, errlen, "out of memory");
    d->n_layer = n_layer;
    d->n_expert = n_expert;
    d->top_k = top_k;
    d->n_feat = n_layer * n_expert;
    d->ptr = calloc(1, sizeof *d->ptr);
    d->count = calloc((size_t)d->n_feat, sizeof *d->count);
    if (!d->ptr || !d->count) {
        cdata_free(d);
        return ms_errf(err, errlen, "out of memory");
    }
    *out = d;
    return 0;
}

void cdata_free(struct cdata *d)
{
    if (!d) return;
    free(d->ptr);
    free(d->idx);
    free(d->val);
    free(d->token);
    free(d->tag);
    free(d->count);
    free(d);
}

static size_t next_cap(size_t cap, size_t need)
{
    size_t n = cap ? cap : 1024;
    while (n < need)
        n *= 2;
    return n;
}

int cdata_add_step(struct cdata *d, const struct rtrace_step *s, bool use_weights, char *err,
                   size_t errlen)
{
    int L = d->n_layer, E = d->n_expert, K = d->top_k;
    size_t stride = s->layer_stride ? s->layer_stride : (size_t)s->n_tok * K;
    size_t need_nnz = d->ptr[d->n_row] + (size_t)s->n_tok * L * K;
    size_t need_row = d->n_row + (size_t)s->n_tok;
    if (need_nnz > d->cap_nnz) {
        size_t n = next_cap(d->cap_nnz, need_nnz);
        int32_t *idx = realloc(d->idx, n * sizeof *idx);
        if (idx) d->idx = idx;
        float *val = realloc(d->val, n * sizeof *val);
        if (val) d->val = val;
        if (!idx || !val) return ms_errf(err, errlen, "out of memory");
        d->cap_nnz = n;
    }
    if (need_row > d->cap_row) {
        size_t n = next_cap(d->cap_row, need_row);
        int32_t *tok = realloc(d->token, n * sizeof *tok);
        if (tok) d->token = tok;
        uint16_t *tag = realloc(d->tag, n * sizeof *tag);
        if (tag) d->tag = tag;
        size_t *ptr = realloc(d->ptr, (n + 1) * sizeof *ptr);
        if (ptr) d->ptr = ptr;
        if (!tok || !tag || !ptr) return ms_errf(err, errlen, "out of memory");
        d->cap_row = n;
    }
    bool w = use_weights && s->weights;
    d->weighted = d->weighted || w;
    for (int t = 0; t < s->n_tok; t++) {
        size_t at = d->ptr[d->n_row], start = at;
        double norm = 0.0;
        for (int l = 0; l < L; l++) {
            const int32_t *ids = s->ids + (size_t)l * stride + (size_t)t * K;
            const float *wt = w ? s->weights + (size_t)l * stride + (size_t)t * K : NULL;
            /* insertion-sorted by expert: rows keep increasing feature indices */
            size_t row_l = at;
            for (int j = 0; j < K; j++) {
                int32_t x = ids[j];
                if (x < 0 || x >= E) continue;
                float v = wt ? wt[j] : 1.0f;
                if (!(v > 0.0f) || !isfinite(v)) continue;
                int32_t f = l * E + x;
                size_t p = at;
                while (p > row_l && d->idx[p - 1] > f) {
                    d->idx[p] = d->idx[p - 1];
                    d->val[p] = d->val[p - 1];
                    p--;
                }
                if (p > row_l && d->idx[p - 1] == f) { /* the same expert twice: merge */
                    memmove(d->idx + p, d->idx + p + 1, (at - p) * sizeof *d->idx);
                    memmove(d->val + p, d->val + p + 1, (at - p) * sizeof *d->val);
                    d->val[p - 1] += v;
                    continue;
                }
                d->idx[p] = f;
                d->val[p] = v;
                at++;
                d->count[f]++;
            }
        }
        if (at == start) continue;
        for (size_t p = start; p < at; p++)
            norm += (double)d->val[p] * d->val[p];
        float inv = (float)(1.0 / sqrt(norm));
        for (size_t p = start; p < at; p++)
            d->val[p] *= inv;
        d->token[d->n_row] = s->tokens ? s->tokens[t] : -1;
        d->tag[d->n_row] = s->tags ? s->tags[t] : 0;
        d->n_row++;
        d->ptr[d->n_row] = at;
    }
    return 0;
}
