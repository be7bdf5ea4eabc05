/* Synthetic skewed routing with planted clusters (route_synth.h). Draws use cumulative Zipf
 * tables and a binary search, so a token costs O(layers x top_k x log E). */
#include "route_synth.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "rng.h"

struct rsynth {
    struct rsynth_config c;
    struct ms_rng rng;
    int n_cluster;
    int *width, *group;   /* (E) */
    int *member;          /* (L, E): cluster c of layer l is member[l][c*cluster ...], by
                             popularity inside the cluster */
    int *popular;         /* (L, E): all experts of layer l, most popular first */
    double *cum_in;       /* (cluster) Zipf cumulative weights inside a cluster */
    double *cum_all;      /* (E) over all experts */
    double *cum_topic;    /* (n_cluster) over topics */
};

static void zipf_cum(double *cum, int n, double s)
{
    double acc = 0.0;
    for (int i = 0; i < n; i++) cum[i] = acc += pow(i + 1.0, -s);
    for (int i = 0; i < n; i++) cum[i] /= acc;
}

static int draw(struct ms_rng *r, const double *cum, int n)
{
    double u = ms_rng_uniform(r);
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (u < cum[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static void shuffle(struct ms_rng *r, int *a, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(ms_rng_next(r) % (uint64_t)(i + 1));
        int t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

void rsynth_free(struct rsynth *s)
{
    if (!s) return;
    free(s->width);
    free(s->group);
    free(s->member);
    free(s->popular);
    free(s->cum_in);
    free(s->cum_all);
    free(s->cum_topic);
    free(s);
}

int rsynth_create(const struct rsynth_config *c, struct rsynth **out, char *err, size_t errlen)
{
    *out = NULL;
    int E = c->n_expert, L = c->n_layer, K = c->top_k;
    if (L < 1 || E < 1 || K < 1 || K > E || c->cluster < 1 || E % c->cluster != 0 ||
        c->cluster < K || c->width < 1 || c->d_model < 1 || c->p_in < 0 || c->p_in > 1 ||
        (c->groups > 1 && E % c->groups != 0))
        return ms_errf(err, errlen,
                       "synthetic routing: need layers, experts >= top_k, a cluster size >= top_k "
                       "dividing the experts (and the groups), widths >= 1, p_in in [0, 1]");
    struct rsynth *s = calloc(1, sizeof *s);
    if (!s) return ms_errf(err, errlen, "out of memory");
    s->c = *c;
    s->n_cluster = E / c->cluster;
    s->width = malloc(sizeof(int) * (size_t)E);
    s->group = malloc(sizeof(int) * (size_t)E);
    s->member = malloc(sizeof(int) * (size_t)L * E);
    s->popular = malloc(sizeof(int) * (size_t)L * E);
    s->cum_in = malloc(sizeof(double) * (size_t)c->cluster);
    s->cum_all = malloc(sizeof(double) * (size_t)E);
    s->cum_topic = malloc(sizeof(double) * (size_t)s->n_cluster);
    if (!s->width || !s->group || !s->member || !s->popular || !s->cum_in || !s->cum_all ||
        !s->cum_topic) {
        rsynth_free(s);
        return ms_errf(err, errlen, "out of memory");
    }
    ms_rng_seed(&s->rng, c->seed);
    int G = c->groups > 1 ? c->groups : 1;
    for (int x = 0; x < E; x++) {
        s->group[x] = G > 1 ? x / (E / G) : 0;
        s->width[x] = G > 1 ? (int)((long)c->width * (s->group[x] + 1) / G) : c->width;
        if (s->width[x] < 1) s->width[x] = 1;
    }
    for (int l = 0; l < L; l++) {
        int *m = s->member + (size_t)l * E, *p = s->popular + (size_t)l * E;
        for (int x = 0; x < E; x++) m[x] = p[x] = x;
        shuffle(&s->rng, m, E);
        shuffle(&s->rng, p, E);
    }
    zipf_cum(s->cum_in, c->cluster, c->expert_skew);
    zipf_cum(s->cum_all, E, c->expert_skew);
    zipf_cum(s->cum_topic, s->n_cluster, c->topic_skew);
    *out = s;
    return 0;
}

const int *rsynth_widths(const struct rsynth *s)
{
    return s->width;
}

const int *rsynth_groups(const struct rsynth *s)
{
    return s->group;
}

int rsynth_topic_of(const struct rsynth *s, int layer, int expert)
{
    int E = s->c.n_expert;
    const int *m = s->member + (size_t)layer * E;
    for (int i = 0; i < E; i++)
        if (m[i] == expert) return ((i / s->c.cluster - layer) % s->n_cluster + s->n_cluster) %
                                   s->n_cluster;
    return -1;
}

void rsynth_step(struct rsynth *s, int n, int32_t *ids, uint16_t *tags)
{
    int E = s->c.n_expert, L = s->c.n_layer, K = s->c.top_k, C = s->c.cluster;
    for (int t = 0; t < n; t++) {
        int topic = draw(&s->rng, s->cum_topic, s->n_cluster);
        if (tags) tags[t] = (uint16_t)topic;
        for (int l = 0; l < L; l++) {
            int cl = (topic + l) % s->n_cluster;
            const int *m = s->member + (size_t)l * E + (size_t)cl * C;
            const int *p = s->popular + (size_t)l * E;
            int32_t *row = ids + ((size_t)l * n + t) * K;
            for (int j = 0; j < K; j++) {
                int x;
                bool fresh;
                do { /* distinct experts (K <= cluster, so this ends) */
                    x = ms_rng_uniform(&s->rng) < s->c.p_in ? m[draw(&s->rng, s->cum_in, C)]
                                                            : p[draw(&s->rng, s->cum_all, E)];
                    fresh = true;
                    for (int i = 0; i < j; i++) fresh &= row[i] != x;
                } while (!fresh);
                row[j] = x;
            }
        }
    }
}
