/* Cross-layer activation vectors for the collaboration analysis (prefix cdata_): for every token,
 * the (layer, expert) pairs its router chose at every MoE layer, as one sparse row over
 * n_layer x n_expert features (feature l * n_expert + e). The rows are built from the same
 * routing steps the rest of moeserve passes around (struct rtrace_step: a routing trace read
 * back, or engine_last_routing() of a model run over text), so there is one collector.
 *
 * A row's values are 1 per chosen pair, or the routing weight when the step carries weights and
 * use_weights is set. Each row is scaled to unit L2 norm (the dictionary learning's penalty then
 * means the same for every model size); rows with no chosen expert are skipped.
 * Beside the rows: each token's id and tag, and the undecayed routed-token count of every
 * (layer, expert) (what frequency pruning ranks by).
 *
 * Ownership: cdata_create allocates; cdata_add_step grows the arrays (amortized doubling; it is
 * an offline path); every pointer in struct cdata stays valid until the next add or cdata_free. */
#ifndef MOESERVE_COLLAB_DATA_H
#define MOESERVE_COLLAB_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct rtrace_step;

struct cdata {
    int n_layer, n_expert, top_k;
    int n_feat; /* n_layer * n_expert */
    size_t n_row;
    size_t *ptr;     /* (n_row + 1) row r's entries are [ptr[r], ptr[r+1]) */
    int32_t *idx;    /* (nnz) feature index, increasing inside a row */
    float *val;      /* (nnz) value, row L2 norm 1 */
    int32_t *token;  /* (n_row) token id (-1 unknown) */
    uint16_t *tag;   /* (n_row) tag (e.g. the corpus) */
    uint64_t *count; /* (n_feat) tokens that chose each (layer, expert) */
    bool weighted;   /* values are routing weights */
    size_t cap_row, cap_nnz;
};

int cdata_create(int n_layer, int n_expert, int top_k, struct cdata **out, char *err,
                 size_t errlen);
void cdata_free(struct cdata *d);
/* Appends the step's tokens (s->layer_stride 0: n_tok * top_k). Weights are used when
 * use_weights and s->weights. -1 only when out of memory. */
int cdata_add_step(struct cdata *d, const struct rtrace_step *s, bool use_weights, char *err,
                   size_t errlen);

#endif
