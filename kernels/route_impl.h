/* The routing rules, written once for the CPU backend (C) and the CUDA route kernel (device
 * code), so that both backends choose the same experts with the same weights for the same
 * logits. One call routes one token. Ties go to the lower index, as torch.topk returns them.
 * Header-only: every function is static inline and marked ROUTE_FN (host and device under
 * nvcc, plain C otherwise). */
#ifndef MOESERVE_ROUTE_IMPL_H
#define MOESERVE_ROUTE_IMPL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"

#ifdef __CUDACC__
#define ROUTE_FN static inline __host__ __device__
#else
#define ROUTE_FN static inline
#endif

#define ROUTE_MAX_EXPERTS 512
#define ROUTE_MAX_GROUPS 64

/* A set of up to ROUTE_MAX_EXPERTS indices as a bit mask: small enough for a GPU thread's
 * registers and local memory (the route kernel runs one token per thread). */
#define ROUTE_MASK_WORDS (ROUTE_MAX_EXPERTS / 32)

ROUTE_FN void route_mask_clear(uint32_t *m)
{
    for (int i = 0; i < ROUTE_MASK_WORDS; i++) m[i] = 0;
}

ROUTE_FN bool route_mask_has(const uint32_t *m, int i)
{
    return (m[i >> 5] >> (i & 31)) & 1u;
}

ROUTE_FN void route_mask_set(uint32_t *m, int i)
{
    m[i >> 5] |= 1u << (i & 31);
}

/* Index of the largest v[i] over i < n not in taken (ties to the lower index). */
ROUTE_FN int route_argmax_free(const float *v, const uint32_t *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!route_mask_has(taken, i) && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* A softmax's maximum and the sum of exp(logit - maximum) over n logits. */
ROUTE_FN void route_softmax_norm(const float *logits, int n, float *mx, float *sum)
{
    float m = -INFINITY, s = 0.0f;
    for (int e = 0; e < n; e++) m = logits[e] > m ? logits[e] : m;
    for (int e = 0; e < n; e++) s += expf(logits[e] - m);
    *mx = m;
    *sum = s;
}

/* Softmax over the experts, top-k by probability, optionally renormalized over the k kept. */
ROUTE_FN void route_softmax_topk(const struct be_route *r, const float *logits, int k,
                                 int32_t *idx, float *w)
{
    int E = r->n_expert;
    uint32_t taken[ROUTE_MASK_WORDS];
    route_mask_clear(taken);
    float mx, sum;
    route_softmax_norm(logits, E, &mx, &sum);
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = route_argmax_free(logits, taken, E);
        route_mask_set(taken, best);
        idx[j] = best;
        w[j] = expf(logits[best] - mx) / sum;
        wsum += w[j];
    }
    if (r->norm_topk)
        for (int j = 0; j < k; j++) w[j] /= wsum;
    for (int j = 0; j < k; j++) w[j] *= r->scale;
}

/* DeepSeek-V2 group_limited_greedy, as transformers' DeepseekV2TopkRouter: p = softmax(logits);
 * a group's score is its largest p; the topk_group best groups are kept and the other experts'
 * p count as 0; the top-k experts by that; their weights are p times scale. */
ROUTE_FN float route_group_p(const float *logits, int e, float mx, float sum, const uint32_t *kept,
                             int epg)
{
    return route_mask_has(kept, e / epg) ? expf(logits[e] - mx) / sum : 0.0f;
}

ROUTE_FN void route_softmax_group(const struct be_route *r, const float *logits, int k,
                                  int32_t *idx, float *w)
{
    int E = r->n_expert, G = r->n_group, epg = E / G;
    float gs[ROUTE_MAX_GROUPS];
    uint32_t kept[ROUTE_MASK_WORDS], taken[ROUTE_MASK_WORDS];
    route_mask_clear(kept);
    route_mask_clear(taken);
    float mx, sum;
    route_softmax_norm(logits, E, &mx, &sum);
    /* softmax is monotone: a group's best probability is that of its best logit */
    for (int g = 0; g < G; g++) {
        float b = -INFINITY;
        for (int i = 0; i < epg; i++) b = logits[g * epg + i] > b ? logits[g * epg + i] : b;
        gs[g] = expf(b - mx) / sum;
    }
    for (int j = 0; j < r->topk_group; j++) route_mask_set(kept, route_argmax_free(gs, kept, G));
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bp = 0.0f;
        for (int e = 0; e < E; e++) {
            if (route_mask_has(taken, e)) continue;
            float p = route_group_p(logits, e, mx, sum, kept, epg);
            if (best < 0 || p > bp) {
                best = e;
                bp = p;
            }
        }
        route_mask_set(taken, best);
        idx[j] = best;
        w[j] = bp * r->scale;
    }
}

/* MoHGE two-level routing (DESIGN.md): sigmoid group scores, keep the top-kg groups and
 * renormalize their scores; softmax of the expert logits inside each group, times the group's
 * score and kept mask, flattened and renormalized; top-k experts of that; weights = softmax over
 * the k kept probabilities. elog: (E) expert logits, glog: (G) group logits.
 * The flattened probabilities are not stored: each is recomputed from its group's maximum, sum
 * and scale when the top-k scans need it, with the same operations in the same order, so the
 * values are those a stored array would hold. */
ROUTE_FN float route_mohge_q(const float *elog, int e, int epg, const float *gmax,
                             const float *gsum, const float *gscale, const uint32_t *kept,
                             float qsum)
{
    int g = e / epg;
    if (!route_mask_has(kept, g)) return 0.0f / qsum;
    return expf(elog[e] - gmax[g]) / gsum[g] * gscale[g] / qsum;
}

ROUTE_FN void route_mohge(const struct be_route *r, const float *elog, const float *glog, int k,
                          int32_t *idx, float *w)
{
    int E = r->n_expert, G = r->n_group, epg = E / G;
    float sg[ROUTE_MAX_GROUPS], gmax[ROUTE_MAX_GROUPS], gsum[ROUTE_MAX_GROUPS];
    float gscale[ROUTE_MAX_GROUPS];
    uint32_t kept[ROUTE_MASK_WORDS], taken[ROUTE_MASK_WORDS];
    route_mask_clear(kept);
    route_mask_clear(taken);
    for (int g = 0; g < G; g++) sg[g] = 1.0f / (1.0f + expf(-glog[g]));
    float ssum = 0.0f;
    for (int j = 0; j < r->topk_group; j++) {
        int g = route_argmax_free(sg, kept, G);
        route_mask_set(kept, g);
        ssum += sg[g];
    }
    float qsum = 0.0f;
    for (int g = 0; g < G; g++) {
        if (!route_mask_has(kept, g)) continue;
        const float *l = elog + (size_t)g * epg;
        float mx = -INFINITY, sum = 0.0f, scale = sg[g] / ssum;
        for (int i = 0; i < epg; i++) mx = l[i] > mx ? l[i] : mx;
        for (int i = 0; i < epg; i++) sum += expf(l[i] - mx);
        gmax[g] = mx;
        gsum[g] = sum;
        gscale[g] = scale;
        for (int i = 0; i < epg; i++) qsum += expf(l[i] - mx) / sum * scale;
    }
    float mx = -INFINITY, wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bq = 0.0f;
        for (int e = 0; e < E; e++) {
            if (route_mask_has(taken, e)) continue;
            float q = route_mohge_q(elog, e, epg, gmax, gsum, gscale, kept, qsum);
            if (best < 0 || q > bq) {
                best = e;
                bq = q;
            }
        }
        route_mask_set(taken, best);
        idx[j] = best;
        w[j] = bq; /* the probability; turned into a weight below */
        mx = bq > mx ? bq : mx;
    }
    for (int j = 0; j < k; j++) {
        w[j] = expf(w[j] - mx);
        wsum += w[j];
    }
    for (int j = 0; j < k; j++) w[j] /= wsum;
}

/* The score of a logit under r->score: sigmoid, or DeepSeek-V4's sqrt(softplus(x)) (torch's
 * softplus: x itself past 20). */
ROUTE_FN float route_score(const struct be_route *r, float x)
{
    if (r->score == BE_SCORE_SQRTSOFTPLUS) return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
    return 1.0f / (1.0f + expf(-x));
}

/* DeepSeek-V3 group-limited routing, as transformers' DeepseekV3TopkRouter: s = sigmoid(logit)
 * (or route_score's); choice c = s + bias; a group's score is the sum of its two largest c; the
 * topk_group best groups are kept and the other experts' c count as minus infinity; the top-k
 * experts by c; their weights are their s, renormalized (plus 1e-20) when norm_topk, times
 * scale. DeepSeek-V4 is one group. */
ROUTE_FN float route_sig_choice(const struct be_route *r, const float *logits, int e)
{
    return route_score(r, logits[e]) + r->bias[e];
}

/* DeepSeek-V4's hash routing: the token's experts from the table, weighted by their scores
 * renormalized (plus 1e-20), times scale. */
ROUTE_FN void route_hash(const struct be_route *r, const float *logits, int32_t id, int k,
                         int32_t *idx, float *w)
{
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        idx[j] = r->hash[(size_t)id * r->top_k + j];
        w[j] = route_score(r, logits[idx[j]]);
        wsum += w[j];
    }
    for (int j = 0; j < k; j++) w[j] = w[j] / (wsum + 1e-20f) * r->scale;
}

ROUTE_FN void route_sigmoid_group(const struct be_route *r, const float *logits, int k,
                                  int32_t *idx, float *w)
{
    int E = r->n_expert, G = r->n_group, epg = E / G;
    float gs[ROUTE_MAX_GROUPS];
    uint32_t kept[ROUTE_MASK_WORDS], taken[ROUTE_MASK_WORDS];
    route_mask_clear(kept);
    route_mask_clear(taken);
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int i = 0; i < epg; i++) {
            float c = route_sig_choice(r, logits, g * epg + i);
            if (c > b1) {
                b2 = b1;
                b1 = c;
            } else if (c > b2) {
                b2 = c;
            }
        }
        gs[g] = epg > 1 ? b1 + b2 : b1;
    }
    for (int j = 0; j < r->topk_group; j++) route_mask_set(kept, route_argmax_free(gs, kept, G));
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bc = 0.0f;
        for (int e = 0; e < E; e++) {
            if (route_mask_has(taken, e)) continue;
            float c = route_mask_has(kept, e / epg) ? route_sig_choice(r, logits, e) : -INFINITY;
            if (best < 0 || c > bc) {
                best = e;
                bc = c;
            }
        }
        route_mask_set(taken, best);
        idx[j] = best;
        w[j] = route_score(r, logits[best]);
        wsum += w[j];
    }
    for (int j = 0; j < k; j++) {
        if (r->norm_topk) w[j] /= wsum + 1e-20f;
        w[j] *= r->scale;
    }
}

/* Llama 4, as transformers' Llama4Router: the top-k experts by logit, each weighted by the
 * sigmoid of its logit (no renormalization), times scale. */
ROUTE_FN void route_sigmoid_topk(const struct be_route *r, const float *logits, int k,
                                 int32_t *idx, float *w)
{
    uint32_t taken[ROUTE_MASK_WORDS];
    route_mask_clear(taken);
    for (int j = 0; j < k; j++) {
        int best = route_argmax_free(logits, taken, r->n_expert);
        route_mask_set(taken, best);
        idx[j] = best;
        w[j] = 1.0f / (1.0f + expf(-logits[best])) * r->scale;
    }
}

/* Token t of a batch: its k = tok_k[t] slots by the rule of r, then -1 / 0 up to top_k. */
ROUTE_FN void route_token(const struct be_route *r, const float *logits, const float *glog,
                          const int32_t *tok_k, int t, int32_t *idx, float *w)
{
    int K = r->top_k, k = tok_k[t];
    int32_t *ti = idx + (size_t)t * K;
    float *tw = w + (size_t)t * K;
    k = k < 1 ? 1 : (k > K ? K : k);
    if (r->kind == BE_ROUTE_MOHGE)
        route_mohge(r, logits + (size_t)t * r->n_expert, glog + (size_t)t * r->n_group, k, ti, tw);
    else if (r->kind == BE_ROUTE_SIGMOID_GROUP && r->hash)
        route_hash(r, logits + (size_t)t * r->n_expert, r->ids[t], k, ti, tw);
    else if (r->kind == BE_ROUTE_SIGMOID_GROUP)
        route_sigmoid_group(r, logits + (size_t)t * r->n_expert, k, ti, tw);
    else if (r->kind == BE_ROUTE_SOFTMAX_GROUP)
        route_softmax_group(r, logits + (size_t)t * r->n_expert, k, ti, tw);
    else if (r->kind == BE_ROUTE_SIGMOID_TOPK)
        route_sigmoid_topk(r, logits + (size_t)t * r->n_expert, k, ti, tw);
    else
        route_softmax_topk(r, logits + (size_t)t * r->n_expert, k, ti, tw);
    for (int j = k; j < K; j++) {
        ti[j] = -1;
        tw[j] = 0.0f;
    }
}

#endif
