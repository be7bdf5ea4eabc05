/* Routing statistics (route_stats.h). The decaying window is kept with a growing observation
 * weight instead of decaying every count at every step: gain grows by 2^(n/half_life) with a
 * step of n tokens and the step's tokens then add `gain` to the counts they touch, so that an
 * old observation's share of the stored sum shrinks exactly as if it had been halved every
 * half_life tokens routed after it. Real values are stored / gain. When gain gets large, every count is divided
 * by it once and gain starts again at 1 (O(memory), every ~65 half-lives). */
#include "route_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define RENORM_AT 1e18

struct rstats {
    struct rstats_config c;
    int *width;          /* (E) */
    double gain;
    double mass;         /* stored token mass (real = mass / gain) */
    uint64_t steps, tokens;
    double *tok;         /* (L, E) stored routed tokens */
    float *pair;         /* (L, E, E) upper triangle [min][max]: co-activation, or NULL */
    float *trans;        /* (L, E, E) [i at l][j at l + 1], or NULL */
    uint64_t *rows;      /* (L, E) undecayed */
};

int rstats_create(const struct rstats_config *c, struct rstats **out, char *err, size_t errlen)
{
    *out = NULL;
    if (c->n_layer < 1 || c->n_expert < 1 || c->top_k < 1 || c->half_life < 0)
        return ms_errf(err, errlen, "routing statistics need MoE layers, experts and top_k >= 1 "
                                    "and a half-life >= 0");
    struct rstats *s = calloc(1, sizeof *s);
    if (!s) return ms_errf(err, errlen, "out of memory");
    size_t L = (size_t)c->n_layer, E = (size_t)c->n_expert;
    s->c = *c;
    s->width = malloc(sizeof(int) * E);
    s->tok = calloc(L * E, sizeof *s->tok);
    s->rows = calloc(L * E, sizeof *s->rows);
    if (c->coact) {
        s->pair = calloc(L * E * E, sizeof *s->pair);
        s->trans = calloc(L * E * E, sizeof *s->trans);
    }
    if (!s->width || !s->tok || !s->rows || (c->coact && (!s->pair || !s->trans))) {
        rstats_free(s);
        return ms_errf(err, errlen, "out of memory for routing statistics (%zu layers of %zu "
                                    "experts%s)",
                       L, E, c->coact ? " with co-activation pairs" : "");
    }
    for (size_t x = 0; x < E; x++) s->width[x] = c->expert_width ? c->expert_width[x] : c->d_model;
    s->c.expert_width = s->width;
    s->gain = 1.0;
    *out = s;
    return 0;
}

void rstats_free(struct rstats *s)
{
    if (!s) return;
    free(s->width);
    free(s->tok);
    free(s->pair);
    free(s->trans);
    free(s->rows);
    free(s);
}

void rstats_reset(struct rstats *s)
{
    size_t L = (size_t)s->c.n_layer, E = (size_t)s->c.n_expert;
    memset(s->tok, 0, sizeof *s->tok * L * E);
    memset(s->rows, 0, sizeof *s->rows * L * E);
    if (s->pair) memset(s->pair, 0, sizeof *s->pair * L * E * E);
    if (s->trans) memset(s->trans, 0, sizeof *s->trans * L * E * E);
    s->gain = 1.0;
    s->mass = 0;
    s->steps = s->tokens = 0;
}

static void renormalize(struct rstats *s)
{
    size_t L = (size_t)s->c.n_layer, E = (size_t)s->c.n_expert;
    double inv = 1.0 / s->gain;
    for (size_t i = 0; i < L * E; i++) s->tok[i] *= inv;
    if (s->pair)
        for (size_t i = 0; i < L * E * E; i++) {
            s->pair[i] = (float)(s->pair[i] * inv);
            s->trans[i] = (float)(s->trans[i] * inv);
        }
    s->mass *= inv;
    s->gain = 1.0;
}

void rstats_add(struct rstats *s, const int32_t *ids, int n_tok, size_t layer_stride)
{
    int L = s->c.n_layer, E = s->c.n_expert, K = s->c.top_k;
    size_t stride = layer_stride ? layer_stride : (size_t)n_tok * K;
    /* Everything before this step is n_tok tokens older: it weighs 2^(-n_tok / half_life) less
     * next to this step's tokens. */
    if (s->c.half_life > 0) {
        s->gain *= exp2((double)n_tok / s->c.half_life);
        if (s->gain > RENORM_AT) renormalize(s);
    }
    double g = s->gain;
    float gf = (float)g;
    for (int l = 0; l < L; l++) {
        const int32_t *lay = ids + (size_t)l * stride;
        double *tok = s->tok + (size_t)l * E;
        uint64_t *rows = s->rows + (size_t)l * E;
        float *pair = s->pair ? s->pair + (size_t)l * E * E : NULL;
        float *trans = s->trans && l + 1 < L ? s->trans + (size_t)l * E * E : NULL;
        const int32_t *next = ids + (size_t)(l + 1) * stride;
        for (int t = 0; t < n_tok; t++) {
            const int32_t *row = lay + (size_t)t * K;
            for (int j = 0; j < K; j++) {
                int32_t a = row[j];
                if (a < 0 || a >= E) continue;
                tok[a] += g;
                rows[a]++;
                if (pair)
                    for (int i = j + 1; i < K; i++) {
                        int32_t b = row[i];
                        if (b < 0 || b >= E || b == a) continue;
                        pair[(size_t)(a < b ? a : b) * E + (a < b ? b : a)] += gf;
                    }
                if (trans)
                    for (int i = 0; i < K; i++) {
                        int32_t b = next[(size_t)t * K + i];
                        if (b >= 0 && b < E) trans[(size_t)a * E + b] += gf;
                    }
            }
        }
    }
    s->mass += g * n_tok;
    s->steps++;
    s->tokens += (uint64_t)n_tok;
}

const struct rstats_config *rstats_get_config(const struct rstats *s)
{
    return &s->c;
}

bool rstats_has_coact(const struct rstats *s)
{
    return s->pair != NULL;
}

uint64_t rstats_steps(const struct rstats *s)
{
    return s->steps;
}

uint64_t rstats_tokens_seen(const struct rstats *s)
{
    return s->tokens;
}

double rstats_window_tokens(const struct rstats *s)
{
    return s->mass / s->gain;
}

void rstats_expert_tokens(const struct rstats *s, int layer, double *out)
{
    int E = s->c.n_expert;
    for (int x = 0; x < E; x++) out[x] = s->tok[(size_t)layer * E + x] / s->gain;
}

void rstats_expert_flops(const struct rstats *s, int layer, double *out)
{
    rstats_expert_tokens(s, layer, out);
    for (int x = 0; x < s->c.n_expert; x++) out[x] *= 6.0 * s->c.d_model * s->width[x];
}

/* A pair matrix of one layer out of the window: src is the upper triangle (symmetric) or the
 * full matrix. */
static int pair_snapshot(const struct rstats *s, const float *src, bool upper, int layer,
                         float *out)
{
    size_t E = (size_t)s->c.n_expert;
    if (!src) {
        memset(out, 0, sizeof *out * E * E);
        return -1;
    }
    const float *p = src + (size_t)layer * E * E;
    float inv = (float)(1.0 / s->gain);
    for (size_t a = 0; a < E; a++)
        for (size_t b = 0; b < E; b++)
            out[a * E + b] = !upper ? p[a * E + b] * inv
                             : a == b ? 0.0f
                                      : p[(a < b ? a : b) * E + (a < b ? b : a)] * inv;
    return 0;
}

int rstats_coact(const struct rstats *s, int layer, float *out)
{
    return pair_snapshot(s, s->pair, true, layer, out);
}

int rstats_transitions(const struct rstats *s, int layer, float *out)
{
    return pair_snapshot(s, s->trans, false, layer, out);
}

const uint64_t *rstats_expert_rows_total(const struct rstats *s)
{
    return s->rows;
}
