/* Expert placement: which device computes which expert, layer by layer, with replicas. One
 * interface (plc_compute) behind four policies:
 *
 *   contiguous  expert x of E on device x * N / E (the same for every layer).
 *   mohge       All-size Group-decoupling (DESIGN.md): experts interleaved across groups in the
 *               order [0, G-1, 1, G-2, ...] and cut into N blocks, so every device holds every
 *               FFN width. Needs a model with expert groups.
 *   eplb        replicas of the hottest experts and balanced packing (after DeepSeek's Expert
 *               Parallelism Load Balancer), per layer. First the experts' loads are wrapped
 *               over the devices, each device filled to exactly the mean and an expert that
 *               does not fit continuing on the next device as a replica (McNaughton's rule:
 *               perfect predicted balance with at most N - 1 replicas, given to the experts
 *               that are too hot for one device); slots left go to more replicas of the
 *               hottest experts. When that does not fit the slots or R, DeepSeek's greedy: R
 *               replicas one by one to the expert with the highest load per replica, packed
 *               heaviest first onto the least-loaded device with a free slot, then a local
 *               search that moves replicas off the busiest device. Either way each replicated
 *               expert's rows are split between its replicas so that device loads come out
 *               even (water-filling), and tokens follow those shares (plc_pick).
 *               With n_nodes > 1 (hierarchical, after DeepSeek's): the experts are first
 *               split over the nodes (balanced; co-activated experts together, as c2r does per
 *               device, when co-activation counts are known), then each node's experts and
 *               its share of the R replicas are placed over its devices as above, so that a
 *               token's rows stay inside fewer nodes.
 *   c2r         co-activation-aware (C2R / Occult): experts that the same tokens choose together
 *               go to the same device, as a balanced partition of the co-activation graph: a
 *               greedy placement by affinity, then moves and swaps that bring every device
 *               within c2r_bound x the mean predicted load (losing the least co-activation),
 *               then moves and swaps that raise the co-activation kept inside devices while
 *               every device stays within the bound and its slots.
 *
 * Any policy takes R > 0 redundant experts per layer: eplb packs them jointly; for the others
 * replicas of the hottest experts are added after the base placement, on the least-loaded
 * devices. Loads are predicted FLOPs per expert (struct plc_stats: from the routing statistics
 * or a trace); without statistics every expert counts by its width (eplb then balances widths),
 * and c2r, which needs co-activation counts, is refused.
 *
 * A map (struct plc_map) lists for each MoE layer n_slots = E + R physical experts: the logical
 * expert, the device, and the share of that expert's rows the replica takes. Placement never
 * changes the math: a row computes the same whichever replica takes it; plc_pick chooses the
 * replica from the token's index in the step, deterministically, in proportion to the shares.
 *
 * Ownership: a map's arrays belong to it (plc_map_alloc / plc_map_free); plc_compute fills a
 * map the caller allocated with the right shape, and leaves it unspecified on failure. No
 * function keeps pointers to its inputs. */
#ifndef MOESERVE_PLACEMENT_H
#define MOESERVE_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum plc_policy {
    PLC_POLICY_CONTIGUOUS = 0,
    PLC_POLICY_MOHGE = 1,
    PLC_POLICY_EPLB = 2,
    PLC_POLICY_C2R = 3,
};
#define PLC_N_POLICIES 4

/* "contiguous" | "mohge" | "eplb" | "c2r": 0, or -1. */
int plc_policy_parse(const char *name, enum plc_policy *out);
const char *plc_policy_name(enum plc_policy p);

/* What placement needs to know of a model: from a struct model_desc (plc_model_from_desc) or a
 * trace header (the simulator). Arrays borrowed. */
struct plc_model {
    int n_layer;             /* MoE layers */
    int n_expert;
    int top_k;
    int d_model;
    const int *expert_width; /* (n_expert) FFN widths */
    int n_group;             /* expert groups, 0 when none */
    const int *expert_group; /* (n_expert) group of each expert, or NULL */
};

struct model_desc;
/* n_layer counts md's MoE layers. */
void plc_model_from_desc(const struct model_desc *md, struct plc_model *out);

/* c2r's default load bound: 5% over the mean predicted load, which keeps the measured
 * imbalance (predictions are never exact) within 10%. */
#define PLC_C2R_BOUND 1.05

struct plc_params {
    enum plc_policy policy;
    int n_dev;
    int redundant;           /* R: extra replicas per layer (>= 0) */
    int slots_per_dev;       /* physical experts a device may hold per layer; 0: the fewest that
                                fit, ceil((E + R) / n_dev) */
    double c2r_bound;        /* c2r: device load at most this x the mean (0: PLC_C2R_BOUND) */
    int n_nodes;             /* eplb over nodes of n_dev / n_nodes devices each (hierarchical:
                                the experts split over the nodes first, co-activated ones kept
                                together when co-activation counts are given, then eplb inside
                                each node with its share of the replicas); 0 or 1: flat */
};

/* Statistics a policy may use, per MoE layer; NULL members are missing. */
struct plc_stats {
    const double *flops;     /* (n_layer, n_expert) predicted FLOPs (or any load measure) */
    const float *coact;      /* (n_layer, n_expert, n_expert) symmetric co-activation counts */
};

struct plc_map {
    int n_layer, n_expert, n_dev, n_slots;
    enum plc_policy policy;  /* what made it (informational) */
    int *slot_expert;        /* (n_layer, n_slots) logical expert of each physical slot */
    int *slot_dev;           /* (n_layer, n_slots) its device */
    float *slot_share;       /* (n_layer, n_slots) share of the expert's rows it takes */
    /* Index built by plc_map_finish: */
    int *rep_off;            /* (n_layer, n_expert + 1) replicas of x: rep_slot[rep_off[x]...] */
    int *rep_slot;           /* (n_layer, n_slots) slots grouped by expert */
    float *rep_cum;          /* (n_layer, n_slots) cumulative shares in rep_slot order (last 1) */
    int *dev_order;          /* (n_layer, n_slots) slots by (device, expert): the send order */
};

int plc_map_alloc(struct plc_map *m, int n_layer, int n_expert, int n_dev, int n_slots);
void plc_map_free(struct plc_map *m);
/* dst must be freed or zeroed; allocates dst like src and copies it. */
int plc_map_copy(struct plc_map *dst, const struct plc_map *src);
/* The same expert on owner[x] in every layer, no replicas. -1 when an owner is out of range. */
int plc_map_from_owner(struct plc_map *m, int n_layer, int n_expert, int n_dev, const int *owner,
                       char *err, size_t errlen);
/* Checks the slots (every expert has a replica; devices in range; at most one replica of an
 * expert per device; shares >= 0 summing to 1 for each expert; at most slots_per_dev slots per
 * device when it is > 0) and builds the index. Shares are renormalized. */
int plc_map_finish(struct plc_map *m, int slots_per_dev, char *err, size_t errlen);

/* Computes a placement into out (allocated here: free with plc_map_free). Errors name what is
 * impossible: more replicas than the devices can hold (--redundant-experts), a policy needing
 * statistics that were not given (c2r without co-activation counts), mohge without groups. */
int plc_compute(const struct plc_model *md, const struct plc_params *p, const struct plc_stats *st,
                struct plc_map *out, char *err, size_t errlen);

/* The slot that takes the row of expert x at layer l for the token with index `key` in its step
 * (the same function in the engine and the simulator). */
static inline int plc_pick(const struct plc_map *m, int l, int x, uint32_t key)
{
    const int *off = m->rep_off + (size_t)l * (m->n_expert + 1);
    int a = off[x], b = off[x + 1];
    const int *slot = m->rep_slot + (size_t)l * m->n_slots;
    if (b - a == 1) return slot[a];
    /* A Weyl sequence (golden-ratio step) over the token index, offset per expert and layer:
     * consecutive tokens spread evenly over [0, 1), so each replica gets its share of rows. */
    uint32_t h = key * 2654435769u + (uint32_t)x * 0x85ebca6bu + (uint32_t)l * 0xc2b2ae35u;
    float u = (float)((double)h * (1.0 / 4294967296.0));
    const float *cum = m->rep_cum + (size_t)l * m->n_slots;
    for (int i = a; i < b - 1; i++)
        if (u < cum[i]) return slot[i];
    return slot[b - 1];
}

/* Predicted load of each device (n_dev) at layer l from per-expert loads (n_expert). */
void plc_device_load(const struct plc_map *m, int l, const double *expert_load, double *dev_load);
/* Physical experts device d holds at layer l. */
int plc_device_slots(const struct plc_map *m, int l, int d);
/* Slots differing between two maps of the same shape (an expert added to or dropped from a
 * device counts once each): what a rebalance copies. */
int plc_map_moves(const struct plc_map *a, const struct plc_map *b);

/* MoHGE All-size Group-decoupling on one layer: owner (n_expert) of n_group groups of
 * n_expert / n_group experts (expert e in group e / (n_expert / n_group)). */
void plc_mohge_owner(int n_expert, int n_group, int n_dev, int *owner);

#endif
