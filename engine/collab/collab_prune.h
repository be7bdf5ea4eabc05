/* Expert pruning (prefix cprune_): which routed experts of each MoE layer to keep, by one of three
 * scores, and a pruned copy of a Hugging Face model folder that loads as is.
 *
 * Scores, one per (MoE layer, expert), higher kept first:
 *   collab     the expert's share of the activations the collaborative groups reconstruct:
 *              sum over calibration tokens t and fine groups k of a_tk D_k(l,e) (codes a, atoms D
 *              of collab_dict.h). A (layer, expert) that tokens choose as part of recurring
 *              cross-layer groups scores high; one chosen often but outside any group (routing
 *              noise) scores only what the groups explain of it. Ties: frequency, then index.
 *   frequency  calibration tokens that chose the expert (ties: index).
 *   random     a seeded uniform draw.
 * Selection removes round(ratio x E) experts from every MoE layer (the same count everywhere, as
 * a config has one expert count); with expert groups (MoHGE, DeepSeek's n_group), round(ratio x
 * E/G) from every group, so groups stay equal and contiguous. It refuses a ratio outside (0, 1),
 * one that removes nothing, and one that leaves a layer (or, with groups, the kept groups)
 * fewer experts than top-k, each with a message naming --ratio.
 *
 * Writing: config.json with the new expert count (`experts_per_group` for mohge,
 * `num_local_experts` mixtral, `num_experts` qwen2_moe/qwen3_moe/olmoe, `n_routed_experts`
 * deepseek), one model.safetensors with the kept experts renumbered in order and the router's
 * rows (and DeepSeek's e_score_correction_bias) cut to them, every other file of the folder
 * copied but the original weights. Everything goes to a temporary folder next to out_dir that
 * is renamed to out_dir at the end; on failure it is removed, so no partial folder is left.
 *
 * Ownership: nothing is kept between calls; caller buffers only. */
#ifndef MOESERVE_COLLAB_PRUNE_H
#define MOESERVE_COLLAB_PRUNE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct cdata;
struct cdict;
struct model_desc;

enum cprune_method {
    CPRUNE_METHOD_COLLAB,
    CPRUNE_METHOD_FREQUENCY,
    CPRUNE_METHOD_RANDOM,
};

int cprune_method_parse(const char *s, enum cprune_method *out);
const char *cprune_method_name(enum cprune_method m);

/* score (n_feat): see above. codes: (n_row, fine atoms) of x under d (collab only; d and codes
 * may be NULL for the other methods). */
void cprune_scores(enum cprune_method m, const struct cdata *x, const struct cdict *d,
                   const float *codes, uint64_t seed, double *score);

/* The pruning problem's shape. */
struct cprune_shape {
    int n_layer, n_expert, top_k;
    int n_group, topk_group; /* groups (contiguous blocks of n_expert / n_group), 0: none */
    int min_per_group;       /* experts a group must keep (DeepSeek-V3 scores a group by its
                                top 2: 2), 0 or 1: one */
};

/* keep (n_layer, n_expert): true for kept experts; *n_keep: experts kept per layer. count
 * (n_feat) breaks ties (may be NULL). -1 with a message naming --ratio. */
int cprune_select(const struct cprune_shape *s, double ratio, const double *score,
                  const uint64_t *count, bool *keep, int *n_keep, char *err, size_t errlen);

/* 0 when models described by md can be pruned; else -1 with a message naming the family
 * (DeepSeek-V4: its hash-routed layers name experts by number in tid2eid, which pruning
 * would renumber). cprune_write checks it too; callers ask before calibrating. */
int cprune_check(const struct model_desc *md, char *err, size_t errlen);

/* Writes the pruned copy of model_dir (described by md) to out_dir (must not exist). keep is
 * (MoE layers of md in order, md->n_expert). MTP layers with routed experts of their own are
 * left out (num_nextn_predict_layers 0): calibration does not reach them. */
int cprune_write(const char *model_dir, const struct model_desc *md, const bool *keep,
                 const char *out_dir, char *err, size_t errlen);

#endif
