/* Synthetic routing: a skewed MoE router with planted collaborating experts, for the placement
 * tests, the simulator and the bench where no trained model of that shape exists (256 experts,
 * top-8, dozens of layers). Deterministic for a seed.
 *
 * The model: experts of each layer are split into clusters of `cluster` experts drawn at random
 * (a different random permutation per layer, so expert ids say nothing about clusters and a
 * contiguous placement gains nothing by accident). Each token has a topic, drawn with Zipf
 * skew `topic_skew` over the clusters; at layer l its cluster is (topic + l) mod clusters (so
 * consecutive layers' choices are linked too). Each of its top_k distinct experts comes from
 * that cluster with probability p_in, else from all experts; within either set experts are
 * drawn with Zipf skew `expert_skew` over a fixed random popularity order. Widths: every expert
 * `width`, or, when groups > 1, group g of `groups` equal groups gets width * (g + 1) / groups
 * (heterogeneous widths like MoHGE's), experts of a group contiguous as MoHGE lays them out.
 *
 * Ownership: rsynth_create allocates; rsynth_step fills caller arrays; rsynth_free. */
#ifndef MOESERVE_ROUTE_SYNTH_H
#define MOESERVE_ROUTE_SYNTH_H

#include <stddef.h>
#include <stdint.h>

struct rsynth_config {
    int n_layer, n_expert, top_k, d_model;
    int width;            /* FFN width (largest group's with groups) */
    int groups;           /* expert groups of increasing width; 0 or 1: none */
    int cluster;          /* experts per planted cluster (divides n_expert) */
    double p_in;          /* probability a slot comes from the token's cluster */
    double topic_skew;    /* Zipf exponent over topics (0: uniform) */
    double expert_skew;   /* Zipf exponent over experts inside a set (0: uniform) */
    uint64_t seed;
};

struct rsynth;

int rsynth_create(const struct rsynth_config *c, struct rsynth **out, char *err, size_t errlen);
void rsynth_free(struct rsynth *s);
/* FFN width and group of each expert (n_expert), for a trace header. */
const int *rsynth_widths(const struct rsynth *s);
const int *rsynth_groups(const struct rsynth *s);
/* The planted truth: the topic whose tokens draw expert `expert` of layer `layer` from their
 * cluster (what a collaboration analysis should recover). */
int rsynth_topic_of(const struct rsynth *s, int layer, int expert);
/* n tokens: ids (n_layer, n, top_k) layer-major as in struct rtrace_step, and each token's
 * topic in tags (n) (may be NULL). */
void rsynth_step(struct rsynth *s, int n, int32_t *ids, uint16_t *tags);

#endif
