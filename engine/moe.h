/* MoE layer: routing (which experts, with which weights, for each token), dispatch of token rows
 * to the devices owning those experts through the communicator, expert FFNs on the owner (the
 * backend's moe_experts: one GEMM chain per expert, or one grouped GEMM, over rows sorted by
 * expert), and combine (results back to the token's device, weighted sum, plus shared experts).
 *
 * Two dispatches (moe_ctx.dedup), the same with one device (nothing is exchanged):
 *   rows    one row per (token, expert) to the expert's device, its output row back; the token's
 *           device sums w_j y_j in top-k slot order.
 *   tokens  (dedup) a token's row once to each device owning some of its experts, with their
 *           ids and weights (K ids padded with -1, then K weights: 8K bytes a row); the device
 *           expands it to a row per expert, runs them, and sums w_j y_j over its own experts in
 *           slot order, so one partial sum per (token, device) comes back; the token's device
 *           adds the partials in the order the devices first appear among its slots.
 *
 * Where things run: routing, permutation and the FFNs run on the backend; the dispatch plan
 * (how many rows go to which device and expert) is made on the host from the chosen expert ids,
 * because the exchange and the expert GEMMs need those counts on the host. Arrays named h_* are
 * host memory; the rest are backend memory.
 *
 * Ownership: moe_scratch is per device, allocated once by moe_scratch_init for the largest step
 * (either dispatch) and released by moe_scratch_release; moe_forward allocates nothing. */
#ifndef MOESERVE_MOE_H
#define MOESERVE_MOE_H

#include <stdint.h>

#include "backend.h"
#include "comm.h"
#include "engine.h"
#include "model.h"
#include "placement/placement.h"

struct moe_scratch {
    int max_rows;      /* max_batch_tokens * top_k */
    int max_tokens;    /* max_batch_tokens: rows one device can receive with dedup dispatch */
    float *logits;     /* (T, n_expert + n_group) router logits, then MoHGE group logits */
    int32_t *top_idx;  /* (T, top_k) chosen experts, slot order */
    float *top_w;      /* (T, top_k) their weights */
    int32_t *slot_row; /* (T, top_k) row of each (token, slot) in the send buffer, -1 if unused */
    float *send;       /* (R, d_model) rows out, grouped by destination device */
    int32_t *send_meta;/* (R) expert of each sent row */
    float *recv;       /* (R, d_model) rows in, grouped by source device */
    int32_t *recv_meta;/* (R) */
    float *out_rows;   /* (R, d_model) expert outputs for received rows */
    float *back;       /* (R, d_model) expert outputs returned, in send order */
    int32_t *idx;      /* (R + R) uploaded index arrays: send order, then expert order */
    float *xe;         /* (R, d_model) received rows sorted by expert */
    float *ye;         /* (R, d_model) their expert outputs */
    float *gate;       /* (R, max_ff) */
    float *up;         /* (R, max_ff) */
    float *shared_out; /* (T, d_model) */
    float *shared_gate;/* (T) */
    float *row_w;      /* (R) Llama 4: each sent (rows) or expanded (tokens) row's routing
                          weight (its input scale) */
    /* dedup dispatch (several devices only, else NULL): a row per (token, device) */
    int32_t *tsend_meta; /* (S, 2K), S = max_tokens * min(top_k, n_dev) rows sent at most: per
                            row its experts on that device in slot order (-1 pads), then their
                            weights' bits */
    int32_t *trecv_meta; /* (max_tokens, 2K) the same, received */
    int32_t *tidx;       /* (2R) the expanded rows' received row in expert order, then the local
                            combine's slot map (n_recv, K) into those rows */
    float *tcw;          /* (R) the local combine's weights (n_recv, K) */
    /* host */
    float *h_top_w;    /* (R) the weights, then 1s for the combine (Llama 4; dedup: the
                          partials are added with weight 1) */
    float *h_row_w;    /* (R) staging of row_w */
    int32_t *h_top_idx;   /* (R) */
    int32_t *h_slot_row;  /* (R) */
    int32_t *h_send_perm; /* (R) token of each sent row */
    int32_t *h_send_meta; /* (R) */
    int32_t *h_recv_meta; /* (R) */
    int32_t *h_expert_perm; /* (2R) received row at each position of the expert-sorted order;
                               also the staging area of the idx upload */
    int32_t *h_slot_dev;  /* dedup: (R) device of each (token, slot), -1 unused */
    int32_t *h_tmeta;     /* dedup: (S, 2K) staging of tsend_meta, then of trecv_meta */
    int32_t *h_tidx;      /* dedup: (2R) staging of tidx */
    int32_t *h_tslot;     /* dedup: (R) each expanded row's received row * K + list position */
    float *h_tcw;         /* dedup: (R) staging of tcw */
    struct be_expert *h_experts; /* (n_expert) experts with rows in this call */
    int *h_ex_off;        /* (n_expert + 1) their row ranges in xe */
    int *send_counts;  /* (n_dev) */
    int *recv_counts;  /* (n_dev) */
    int *expert_count; /* (n_expert) */
    int *expert_off;   /* (n_expert + 1) */
    int *expert_cursor;/* (n_expert) fill position while sorting rows by expert */
    int *dev_cursor;   /* (n_dev) dedup: fill position while grouping rows by device */
    /* placement slots (moe_scratch_slots): rows per physical expert of the layer's map */
    int max_slots;
    int *slot_count;   /* (max_slots) */
    int *slot_off;     /* (max_slots) */
};

struct moe_ctx {
    const struct model *m;      /* weights as this device's backend holds them */
    int layer;
    struct backend *be;
    struct comm *comm;
    int rank;
    const struct plc_map *map;  /* placement: the devices of each expert's replicas */
    int moe_layer;              /* this layer among the MoE layers (the map's and stats' index) */
    int tok0;                   /* the step index of this device's first token: picks replicas */
    struct engine_stats *stats; /* counters this device updates (its own slots only) */
    int32_t *route_ids;         /* OUT, or NULL: (n, top_k) the experts each token chose */
    float *route_w;             /* OUT, or NULL: (n, top_k) their routing weights */
    const int32_t *ids;         /* (n) the tokens' ids, backend memory: DeepSeek-V4's hash
                                   routing reads them (NULL elsewhere) */
    bool dedup;                 /* tokens dispatch (see the top); every rank must agree */
};

int moe_scratch_init(struct moe_scratch *s, struct backend *be, const struct model *m,
                     int max_tokens, int n_dev, int dense_ff);
void moe_scratch_release(struct moe_scratch *s, struct backend *be);
/* Room for maps of up to n_slots physical experts a layer (after moe_scratch_init; released by
 * moe_scratch_release). */
int moe_scratch_slots(struct moe_scratch *s, int n_slots);

/* Routes n tokens: h (n, d_model) normed hidden states -> top_idx/top_w (n, top_k), token t
 * using tok_k[t] <= top_k experts (slots past tok_k[t] are -1 / 0). logits is scratch of
 * n * (n_expert + n_group) floats: expert logits (n, E), then MoHGE group logits (n, G).
 * ids (n): the tokens' ids, read by hash-routed layers (layer_w.tid2eid; may be NULL
 * elsewhere). Every pointer is backend memory. */
void moe_route(const struct model *m, int layer, struct backend *be, const float *h, int n,
               const int32_t *tok_k, const int32_t *ids, float *logits, int32_t *top_idx,
               float *top_w);

/* The routing rule of a model for the backend's route op (bias NULL: moe_route sets the layer's
 * correction bias). */
void moe_route_desc(const struct model_desc *md, struct be_route *r);

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
 * every MoE layer, also with n == 0. Both dispatches compute the same expert outputs (each
 * expert's GEMM sees its rows in global token order); they differ only in the order the
 * token's weighted outputs are added, so with several devices `tokens` may differ from one
 * device in the last bits (README "Expert placement": the measured tolerance). */
void moe_forward(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                 const int32_t *tok_k, int n, float *out);

#endif
