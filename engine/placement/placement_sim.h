/* Placement simulator: replays routing (a trace, or synthetic routing) onto N devices under a
 * placement map and measures what the engine would see, for device counts this machine does not
 * have (2 ... 256). It is the instrument behind `moeserve placement-sim` and the README's
 * tables.
 *
 * A simulated step is `batch_tokens` tokens; as in the engine, the step's tokens are cut into N
 * contiguous slices (token t of B lives on device t N / B, where its attention runs), each
 * token's row for expert x goes to the replica plc_pick chooses (the engine's own rule), and a
 * row of an expert of width w costs 6 d_model w FLOPs on that replica's device. Per step and
 * MoE layer it records max / mean device FLOPs (the all-to-all waits for the busiest device, so
 * this is the layer's slowdown against perfect balance); over all steps:
 *   cross_rows   share of expert rows computed on a device other than their token's;
 *   cross_sends  (token, other device) pairs over expert rows: the share when a token is sent
 *                to each device once and fanned out there to its experts (DeepEP, Occult) —
 *                co-locating a token's experts (c2r) lowers this one;
 *   bytes        per token over all layers, dispatch and combine, activations only (the
 *                expert ids that go with them are not counted): the engine's rows dispatch (a
 *                row each way per remote expert row) and its tokens dispatch (engine/moe.h: a
 *                row per remote device out, that device's partial sum back);
 *   memory       expert weights each device holds, all layers (replicas included);
 *   link time    with a link cost model (link_gbps > 0): per step, summed over MoE layers, the
 *                dispatch and the combine each take rounds_per_layer / 2 latency rounds of
 *                link_latency_us, plus the busiest device link's rows (sent or received, the
 *                larger) at link_gbps x link_efficiency; for both dispatches (tokens: a row per
 *                (token, remote device) each way). Every device has its own link (as a GPU
 *                with its own NIC); nodes are not modelled there. bench/net_scale.py measures
 *                the efficiency and the software latency.
 *
 * Ownership: psim_create copies the map; psim_feed allocates nothing. */
#ifndef MOESERVE_PLACEMENT_SIM_H
#define MOESERVE_PLACEMENT_SIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "placement.h"

struct psim_config {
    int batch_tokens;  /* tokens per simulated step */
    int act_bytes;     /* bytes per activation element exchanged (2: bf16) */
    int weight_bytes;  /* bytes per expert weight (2: bf16) */
    int nodes;         /* > 1: devices are in this many nodes of N / nodes (device d on node
                          d / (N / nodes)), and rows crossing nodes are counted */
    /* the link cost model (link_gbps 0: none) */
    double link_gbps, link_latency_us, link_efficiency;
    int rounds_per_layer;
};

struct psim_result {
    uint64_t steps, tokens;
    double imbalance;      /* mean over (step, layer) of max / mean device FLOPs */
    double imbalance_max;  /* the worst (step, layer) */
    double imbalance_window; /* max / mean of the FLOPs summed over every step (per layer, then
                                the mean over layers): the placement's own balance, without the
                                noise of finite steps */
    double cross_rows;
    double cross_sends;
    double bytes_token;        /* a row per remote expert row, each way */
    double bytes_token_dedup;  /* a row per remote device each way (tokens dispatch) */
    double cross_node_rows;    /* with nodes: share of rows computed on another node than their
                                  token's */
    double cross_node_sends;   /* (token, other node) pairs over rows */
    double mem_max, mem_mean;  /* expert weight bytes on a device (max, mean) */
    int slots_max;             /* physical experts on the fullest device, per layer (max) */
    double link_ms_step, link_ms_step_dedup; /* the link cost model's exchange time per step */
};

struct psim;

int psim_create(const struct plc_model *md, const struct plc_map *map, const struct psim_config *c,
                struct psim **out, char *err, size_t errlen);
void psim_free(struct psim *s);
/* Adds n tokens (expert of layer l, token t, slot j at ids[l * layer_stride + t * top_k + j];
 * layer_stride 0 = n * top_k); every batch_tokens tokens make a step. */
void psim_feed(struct psim *s, const int32_t *ids, int n, size_t layer_stride);
uint64_t psim_steps(const struct psim *s);
/* Totals; tokens left over count as a step when they are at least half of one. */
void psim_result(struct psim *s, struct psim_result *out);

/* The experiment `moeserve placement-sim` runs: statistics (per-expert FLOPs, co-activation)
 * from the fit steps of a trace, a placement per policy and device count, then the evaluation
 * steps replayed onto each (cycled until every configuration has min_steps steps and has seen
 * every evaluation token). */
struct psim_run_params {
    const char *trace;
    int tokens_per_dev;    /* a step is tokens_per_dev x devices tokens */
    int min_steps;
    bool fit_all;          /* fit and evaluate on every step; default: fit on the even steps
                              of the trace, evaluate on the odd ones */
    int redundant;         /* replicas per layer for every policy; -1: eplb gets
                              replicas_per_dev x devices, the others none */
    int replicas_per_dev;
    int slots_per_dev;     /* 0: the fewest that fit */
    double c2r_bound;      /* 0: 1.10 */
    int act_bytes, weight_bytes;
    double link_gbps, link_latency_us, link_efficiency; /* the link cost model (psim_config) */
    int rounds_per_layer;
    int nodes;             /* > 1: devices in this many nodes; cross-node rows are counted, and
                              the policies marked in `hier` are placed over the nodes */
    const bool *hier;      /* (n_pols) place this policy hierarchically (eplb), or NULL */
    bool trace_order;      /* steps of consecutive trace tokens (a server's trace: its own
                              batches); default: the evaluation tokens shuffled, so that a step
                              mixes requests as a busy server's does (a corpus trace holds one
                              text after another) */
    uint64_t seed;         /* for the shuffle */
    size_t max_eval_bytes; /* memory for the shuffled evaluation tokens (0: 512 MB); beyond it
                              a uniform sample of them is kept */
};

struct psim_cell {
    bool ok;
    char why[256];         /* when !ok: why the policy could not place */
    int redundant;
    double place_ms;       /* time plc_compute took */
    double predicted_imbalance; /* max / mean predicted device load on the fit statistics */
    struct psim_result r;
};

struct psim_summary {
    char model[64];
    int n_layer, n_expert, top_k, d_model, n_group;
    uint64_t fit_tokens, eval_tokens;
};

/* cells: (n_devs, n_pols), row-major. -1 with a reason on a trace error (named with its
 * offset); a policy that cannot place only marks its cells. */
int psim_run(const struct psim_run_params *p, const int *devs, int n_devs,
             const enum plc_policy *pols, int n_pols, struct psim_cell *cells,
             struct psim_summary *sum, char *err, size_t errlen);

#endif
