/* Routing statistics: what the router has been doing lately, kept in bounded memory for the
 * placement policies (engine/placement: load per expert for eplb, co-activation for c2r), the
 * live rebalancer and the collaboration analysis. Fed one step at a time with the experts each
 * token chose at each MoE layer (the engine does it after every step when asked, and a trace
 * replay can do the same), it keeps, per MoE layer:
 *   - routed tokens and routed FLOPs per expert (width-aware: a row of an expert of FFN width w
 *     costs 6 d_model w FLOPs, so a MoHGE model's narrow experts weigh less);
 *   - co-activation counts: for each pair of experts, the tokens that chose both in the same
 *     layer's top-k (symmetric, diagonal 0);
 *   - adjacent-layer transitions: tokens that chose expert i at this layer and j at the next.
 * Every count is a decaying window: an observation's weight halves every half_life tokens
 * routed after it (0: no decay, counts since the start or the last reset). Decay is lazy (new
 * observations weigh more, and the arrays are renormalized now and then), so adding a step
 * costs O(tokens x layers x top_k^2) whatever the window.
 *
 * Memory: 16 E bytes per layer for the per-expert counts, plus 8 E^2 per layer when pairs are
 * kept (coact): 30 MB for 58 layers of 256 experts. Per-expert counts are always kept.
 *
 * Ownership and threads: rstats_create allocates everything; rstats_add allocates nothing. One
 * thread at a time (the engine's stepping thread); readers copy snapshots out. */
#ifndef MOESERVE_ROUTE_STATS_H
#define MOESERVE_ROUTE_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct rstats_config {
    int n_layer;             /* MoE layers */
    int n_expert;
    int top_k;
    int d_model;
    const int *expert_width; /* (n_expert) FFN widths (copied); NULL: all d_model */
    double half_life;        /* tokens; 0 = no decay */
    bool coact;              /* keep co-activation and transition counts */
};

struct rstats;

int rstats_create(const struct rstats_config *c, struct rstats **out, char *err, size_t errlen);
void rstats_free(struct rstats *s);
/* Forgets everything (the window starts empty). */
void rstats_reset(struct rstats *s);

/* Adds one step of n_tok tokens: expert of layer l, token t, slot j at
 * ids[l * layer_stride + t * top_k + j] (-1 or out of range: slot unused). layer_stride 0 means
 * n_tok * top_k. The step's tokens weigh the same; the window then decays by n_tok tokens. */
void rstats_add(struct rstats *s, const int32_t *ids, int n_tok, size_t layer_stride);

const struct rstats_config *rstats_get_config(const struct rstats *s);
bool rstats_has_coact(const struct rstats *s);
/* Steps and tokens added since the start or the last reset (not decayed). */
uint64_t rstats_steps(const struct rstats *s);
uint64_t rstats_tokens_seen(const struct rstats *s);
/* Token mass in the window (decayed; the tokens seen when there is no decay). */
double rstats_window_tokens(const struct rstats *s);

/* Snapshots of layer `layer` in the window: routed tokens (E), routed FLOPs (E), co-activation
 * (E, E) and transitions to the next layer (E, E; zero for the last layer). The pair snapshots
 * need coact; without it they fill zeros and return -1. */
void rstats_expert_tokens(const struct rstats *s, int layer, double *out);
void rstats_expert_flops(const struct rstats *s, int layer, double *out);
int rstats_coact(const struct rstats *s, int layer, float *out);
int rstats_transitions(const struct rstats *s, int layer, float *out);
/* Undecayed routed rows of every (layer, expert) since the start: (n_layer, n_expert). */
const uint64_t *rstats_expert_rows_total(const struct rstats *s);

#endif
