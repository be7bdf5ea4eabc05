/* MoE layer: routing (which experts, with which weights, for each token), dispatch of token rows
 * to the devices owning those experts through the communicator, expert FFNs on the owner (one
 * GEMM chain per expert over all its rows), and combine (rows back to the token's device,
 * weighted sum in top-k slot order, plus shared experts).
 *
 * Ownership: moe_scratch is per device, allocated once by moe_scratch_init for the largest step
 * and released by moe_scratch_release; moe_forward allocates nothing. */
#ifndef MOESERVE_MOE_H
#define MOESERVE_MOE_H

#include <stdint.h>

#include "backend.h"
#include "comm.h"
#include "engine.h"
#include "model.h"

struct moe_scratch {
    int max_rows;      /* max_batch_tokens * top_k */
    float *logits;     /* (T, n_expert) router logits */
    int32_t *top_idx;  /* (T, top_k) chosen experts, slot order */
    float *top_w;      /* (T, top_k) their weights */
    int32_t *slot_row; /* (T, top_k) row of each (token, slot) in the send buffer, -1 if unused */
    float *send;       /* (R, d_model) rows out, grouped by destination device */
    int32_t *send_meta;/* (R) expert of each sent row */
    float *recv;       /* (R, d_model) rows in, grouped by source device */
    int32_t *recv_meta;/* (R) */
    float *out_rows;   /* (R, d_model) expert outputs for received rows */
    float *back;       /* (R, d_model) expert outputs returned, in send order */
    int32_t *perm;     /* (R) received rows sorted by expert */
    float *xe;         /* (R, d_model) gathered rows of one expert */
    float *ye;         /* (R, d_model) */
    float *gate;       /* (R, max_ff) */
    float *up;         /* (R, max_ff) */
    float *shared_out; /* (T, d_model) */
    float *shared_gate;/* (T) */
    int *send_counts;  /* (n_dev) */
    int *recv_counts;  /* (n_dev) */
    int *expert_count; /* (n_expert) */
    int *expert_off;   /* (n_expert + 1) */
    int *expert_cursor;/* (n_expert) fill position while sorting rows by expert */
};

struct moe_ctx {
    const struct model *m;
    int layer;
    struct backend *be;
    struct comm *comm;
    int rank;
    const int *owner;           /* (n_expert) device of each expert */
    struct engine_stats *stats; /* counters this device updates (its own slots only) */
};

int moe_scratch_init(struct moe_scratch *s, struct backend *be, const struct model *m,
                     int max_tokens, int n_dev, int dense_ff);
void moe_scratch_release(struct moe_scratch *s, struct backend *be);

/* Routes n tokens: h (n, d_model) normed hidden states -> top_idx/top_w (n, top_k), token t
 * using tok_k[t] <= top_k experts (slots past tok_k[t] are -1 / 0). logits is scratch of
 * n * (n_expert + n_group) floats: expert logits (n, E), then MoHGE group logits (n, G). */
void moe_route(const struct model *m, int layer, struct backend *be, const float *h, int n,
               const int32_t *tok_k, float *logits, int32_t *top_idx, float *top_w);

/* MoHGE All-size Group-decoupling placement (DESIGN.md): experts are listed interleaved across
 * groups in the order [0, G-1, 1, G-2, ...] (the i-th expert of every group, then the next i)
 * and that list is cut into n_dev contiguous blocks, so every device holds a slice of every
 * width, smallest paired with largest, and does similar work whatever groups tokens choose.
 * owner: (n_expert) OUT device of each expert. md must have router ROUTER_KIND_MOHGE. */
void moe_mohge_placement(const struct model_desc *md, int n_dev, int *owner);

/* One SwiGLU FFN over rows: out (n, d) = down(silu(gate x) * up x); g/u: (n, d_ff) scratch. */
void moe_ffn_rows(struct backend *be, const struct ffn_w *w, int d, const float *x, int n,
                  float *out, float *g, float *u);

/* out (n, d_model) = MoE(h) for this device's n tokens. Collective: every device calls it for
 * every MoE layer, also with n == 0. */
void moe_forward(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                 const int32_t *tok_k, int n, float *out);

#endif
