/* Live cross-layer activation capture while serving (prefix clive_): a bounded, uniform sample
 * (reservoir sampling, Vitter's algorithm R, seeded) of the tokens the engine routed, each kept
 * as its whole cross-layer activation vector: the expert of every MoE layer and top-k slot. The
 * dashboard encodes the sample with the collaborative groups of `moeserve analyze` (live group
 * usage) and counts which (layer, expert) pairs fire together across layers (the graph's edges).
 * Off unless the server is given --collab-reservoir N.
 *
 * Cost: clive_add takes the engine's per-step routing (the same buffers a routing trace is
 * written from), draws one random number per token and copies n_layer x top_k ids for the
 * tokens it keeps; it never allocates. Memory: 4 x n_layer x top_k bytes per kept token.
 *
 * Threads: clive_add on the engine's stepping thread, clive_snapshot on any; a mutex guards the
 * sample (held for the copy only). Ownership: clive_create allocates, clive_free releases. */
#ifndef MOESERVE_COLLAB_LIVE_H
#define MOESERVE_COLLAB_LIVE_H

#include <stddef.h>
#include <stdint.h>

struct clive;

int clive_create(int n_layer, int n_expert, int top_k, int capacity, uint64_t seed,
                 struct clive **out, char *err, size_t errlen);
void clive_free(struct clive *c);
/* One step: expert of MoE layer l, token t, slot j at ids[l * layer_stride + t * top_k + j]
 * (layer_stride 0: n_tok * top_k; -1 or out of range: unused); tags (n_tok) each token's
 * request tag, or NULL (all 0). */
void clive_add(struct clive *c, const int32_t *ids, const uint16_t *tags, int n_tok,
               size_t layer_stride);
/* Copies the sample: rows (capacity, n_layer * top_k) of feature ids l * n_expert + e (-1
 * unused) and their tags (capacity; may be NULL), returns the rows copied; *seen gets the
 * tokens offered so far. */
size_t clive_snapshot(struct clive *c, int32_t *rows, uint16_t *tags, uint64_t *seen);
int clive_capacity(const struct clive *c);
int clive_row_width(const struct clive *c); /* n_layer * top_k */

#endif
