/* Placement policies and maps (placement.h). Everything works one MoE layer at a time on a
 * small working state (which device holds which expert, predicted device loads); the policies
 * differ only in how they choose the devices, and all of them end with the same two steps:
 * replicas for the hottest experts (when R > 0 and the policy has not placed them itself) and
 * the split of each replicated expert's rows between its replicas (water-filling). */
#include "placement.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "model.h"

static const char *const policy_names[PLC_N_POLICIES] = {"contiguous", "mohge", "eplb", "c2r"};

int plc_policy_parse(const char *name, enum plc_policy *out)
{
    for (int i = 0; i < PLC_N_POLICIES; i++)
        if (strcmp(name, policy_names[i]) == 0) {
            *out = (enum plc_policy)i;
            return 0;
        }
    return -1;
}

const char *plc_policy_name(enum plc_policy p)
{
    return (int)p >= 0 && (int)p < PLC_N_POLICIES ? policy_names[p] : "unknown";
}

void plc_model_from_desc(const struct model_desc *md, struct plc_model *out)
{
    memset(out, 0, sizeof *out);
    for (int l = 0; l < md->n_layer; l++) out->n_layer += md->layer_is_moe[l] ? 1 : 0;
    out->n_expert = md->n_expert;
    out->top_k = md->top_k;
    out->d_model = md->d_model;
    out->expert_width = md->expert_d_ff;
    out->n_group = md->expert_group ? md->n_group : 0;
    out->expert_group = md->expert_group;
}

/* --- maps ---------------------------------------------------------------------------------- */

int plc_map_alloc(struct plc_map *m, int n_layer, int n_expert, int n_dev, int n_slots)
{
    memset(m, 0, sizeof *m);
    size_t L = (size_t)n_layer, S = (size_t)n_slots;
    m->n_layer = n_layer;
    m->n_expert = n_expert;
    m->n_dev = n_dev;
    m->n_slots = n_slots;
    m->slot_expert = malloc(sizeof(int) * L * S);
    m->slot_dev = malloc(sizeof(int) * L * S);
    m->slot_share = malloc(sizeof(float) * L * S);
    m->rep_off = malloc(sizeof(int) * L * ((size_t)n_expert + 1));
    m->rep_slot = malloc(sizeof(int) * L * S);
    m->rep_cum = malloc(sizeof(float) * L * S);
    m->dev_order = malloc(sizeof(int) * L * S);
    if (!m->slot_expert || !m->slot_dev || !m->slot_share || !m->rep_off || !m->rep_slot ||
        !m->rep_cum || !m->dev_order) {
        plc_map_free(m);
        return -1;
    }
    return 0;
}

void plc_map_free(struct plc_map *m)
{
    free(m->slot_expert);
    free(m->slot_dev);
    free(m->slot_share);
    free(m->rep_off);
    free(m->rep_slot);
    free(m->rep_cum);
    free(m->dev_order);
    memset(m, 0, sizeof *m);
}

int plc_map_copy(struct plc_map *dst, const struct plc_map *src)
{
    if (plc_map_alloc(dst, src->n_layer, src->n_expert, src->n_dev, src->n_slots) != 0) return -1;
    size_t LS = (size_t)src->n_layer * src->n_slots;
    dst->policy = src->policy;
    memcpy(dst->slot_expert, src->slot_expert, sizeof(int) * LS);
    memcpy(dst->slot_dev, src->slot_dev, sizeof(int) * LS);
    memcpy(dst->slot_share, src->slot_share, sizeof(float) * LS);
    memcpy(dst->rep_off, src->rep_off, sizeof(int) * (size_t)src->n_layer * (src->n_expert + 1));
    memcpy(dst->rep_slot, src->rep_slot, sizeof(int) * LS);
    memcpy(dst->rep_cum, src->rep_cum, sizeof(float) * LS);
    memcpy(dst->dev_order, src->dev_order, sizeof(int) * LS);
    return 0;
}

int plc_map_from_owner(struct plc_map *m, int n_layer, int n_expert, int n_dev, const int *owner,
                       char *err, size_t errlen)
{
    for (int x = 0; x < n_expert; x++)
        if (owner[x] < 0 || owner[x] >= n_dev)
            return ms_errf(err, errlen, "placement: expert %d on device %d, but there are %d "
                                        "devices",
                           x, owner[x], n_dev);
    if (plc_map_alloc(m, n_layer, n_expert, n_dev, n_expert) != 0)
        return ms_errf(err, errlen, "out of memory for the placement map");
    for (int l = 0; l < n_layer; l++)
        for (int x = 0; x < n_expert; x++) {
            size_t i = (size_t)l * n_expert + x;
            m->slot_expert[i] = x;
            m->slot_dev[i] = owner[x];
            m->slot_share[i] = 1.0f;
        }
    if (plc_map_finish(m, 0, err, errlen) != 0) {
        plc_map_free(m);
        return -1;
    }
    return 0;
}

int plc_map_finish(struct plc_map *m, int slots_per_dev, char *err, size_t errlen)
{
    int E = m->n_expert, N = m->n_dev, S = m->n_slots;
    int *cnt = calloc((size_t)E + 1, sizeof(int));
    float *sum = calloc((size_t)E, sizeof(float));
    int *at = calloc((size_t)E * N, sizeof(int)); /* slot + 1 of (expert, device), 0 = none */
    int rc = -1;
    if (!cnt || !sum || !at) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    for (int l = 0; l < m->n_layer; l++) {
        const int *sx = m->slot_expert + (size_t)l * S, *sd = m->slot_dev + (size_t)l * S;
        float *sh = m->slot_share + (size_t)l * S;
        int *off = m->rep_off + (size_t)l * (E + 1), *rs = m->rep_slot + (size_t)l * S;
        float *cum = m->rep_cum + (size_t)l * S;
        int *order = m->dev_order + (size_t)l * S;
        memset(at, 0, sizeof(int) * (size_t)E * N);
        memset(sum, 0, sizeof(float) * (size_t)E);
        memset(cnt, 0, sizeof(int) * (size_t)(E + 1));
        for (int s = 0; s < S; s++) {
            int x = sx[s], d = sd[s];
            if (x < 0 || x >= E || d < 0 || d >= N || !(sh[s] >= 0.0f)) {
                ms_errf(err, errlen, "placement: layer %d slot %d holds expert %d on device %d "
                                     "with share %g (out of range)",
                        l, s, x, d, (double)sh[s]);
                goto out;
            }
            if (at[(size_t)x * N + d]) {
                ms_errf(err, errlen, "placement: layer %d: expert %d twice on device %d", l, x, d);
                goto out;
            }
            at[(size_t)x * N + d] = s + 1;
            sum[x] += sh[s];
            cnt[x]++;
        }
        for (int x = 0; x < E; x++)
            if (cnt[x] == 0 || !(sum[x] > 0.0f)) {
                ms_errf(err, errlen, "placement: layer %d: expert %d has %s", l, x,
                        cnt[x] ? "no share of its rows" : "no device (unreachable)");
                goto out;
            }
        for (int s = 0; s < S; s++) sh[s] /= sum[sx[s]];
        /* Index: slots by expert (each expert's by device), then by (device, expert). */
        off[0] = 0;
        for (int x = 0; x < E; x++) {
            int n = off[x];
            for (int d = 0; d < N; d++)
                if (at[(size_t)x * N + d]) rs[n++] = at[(size_t)x * N + d] - 1;
            off[x + 1] = n;
            float c = 0.0f;
            for (int i = off[x]; i < n; i++) cum[i] = c += sh[rs[i]];
            cum[n - 1] = 1.0f;
        }
        int pos = 0;
        for (int d = 0; d < N; d++) {
            int held = 0;
            for (int x = 0; x < E; x++)
                if (at[(size_t)x * N + d]) {
                    order[pos++] = at[(size_t)x * N + d] - 1;
                    held++;
                }
            if (slots_per_dev > 0 && held > slots_per_dev) {
                ms_errf(err, errlen, "placement: layer %d: device %d holds %d experts, more than "
                                     "its %d slots",
                        l, d, held, slots_per_dev);
                goto out;
            }
        }
    }
    rc = 0;
out:
    free(cnt);
    free(sum);
    free(at);
    return rc;
}

void plc_device_load(const struct plc_map *m, int l, const double *expert_load, double *dev_load)
{
    int S = m->n_slots;
    for (int d = 0; d < m->n_dev; d++) dev_load[d] = 0.0;
    for (int s = 0; s < S; s++) {
        size_t i = (size_t)l * S + s;
        dev_load[m->slot_dev[i]] += expert_load[m->slot_expert[i]] * m->slot_share[i];
    }
}

int plc_device_slots(const struct plc_map *m, int l, int d)
{
    int n = 0;
    for (int s = 0; s < m->n_slots; s++) n += m->slot_dev[(size_t)l * m->n_slots + s] == d;
    return n;
}

int plc_map_moves(const struct plc_map *a, const struct plc_map *b)
{
    int moves = 0, S = a->n_slots;
    for (int l = 0; l < a->n_layer; l++)
        for (int s = 0; s < S; s++) {
            size_t i = (size_t)l * S + s;
            bool in_b = false, in_a = false;
            for (int t = 0; t < S && !in_b; t++) {
                size_t j = (size_t)l * S + t;
                in_b = b->slot_expert[j] == a->slot_expert[i] && b->slot_dev[j] == a->slot_dev[i];
            }
            for (int t = 0; t < S && !in_a; t++) {
                size_t j = (size_t)l * S + t;
                in_a = a->slot_expert[j] == b->slot_expert[i] && a->slot_dev[j] == b->slot_dev[i];
            }
            moves += !in_b + !in_a;
        }
    return moves;
}

void plc_mohge_owner(int n_expert, int n_group, int n_dev, int *owner)
{
    int E = n_expert, G = n_group, epg = E / G, pos = 0;
    for (int i = 0; i < epg; i++)
        for (int j = 0; j < G; j++) {
            int g = j % 2 == 0 ? j / 2 : G - 1 - j / 2; /* order = [0, G-1, 1, G-2, ...] */
            owner[g * epg + i] = (int)((long)pos * n_dev / E);
            pos++;
        }
}

/* --- one layer's working state ------------------------------------------------------------- */

struct work {
    int E, N, S, slots;
    const double *load; /* (E) predicted load of each expert */
    int n;              /* slots placed */
    int *sx, *sd;       /* (S) expert and device of each placed slot */
    float *sh;          /* (S) shares */
    int *n_rep;         /* (E) */
    int *dev_slots;     /* (N) */
    double *dev_load;   /* (N) with the current shares */
    char *has;          /* (E, N) */
    int *tmp_slot;      /* (N) water-filling scratch */
    double *tmp_base;   /* (N) */
    int *rep_first;     /* (E + 1) water-filling: slots of each expert, */
    int *rep_list;      /* (S) as rep_list[rep_first[x] ...] */
    int *order;         /* (max(E, N)) improve: devices by load; eplb: experts by load */
};

static void place(struct work *w, int x, int d)
{
    w->sx[w->n] = x;
    w->sd[w->n] = d;
    w->sh[w->n] = 1.0f;
    w->n++;
    w->n_rep[x]++;
    w->dev_slots[d]++;
    w->has[(size_t)x * w->N + d] = 1;
}

/* Equal shares for every expert, and the device loads they give. */
static void equal_shares(struct work *w)
{
    for (int d = 0; d < w->N; d++) w->dev_load[d] = 0.0;
    for (int s = 0; s < w->n; s++) {
        w->sh[s] = 1.0f / (float)w->n_rep[w->sx[s]];
        w->dev_load[w->sd[s]] += w->load[w->sx[s]] * w->sh[s];
    }
}

/* The least-loaded device with a free slot that does not hold x yet (fewer slots, then lower
 * index on ties), or -1. */
static int least_loaded(const struct work *w, int x)
{
    int best = -1;
    for (int d = 0; d < w->N; d++) {
        if (w->dev_slots[d] >= w->slots || w->has[(size_t)x * w->N + d]) continue;
        if (best < 0 || w->dev_load[d] < w->dev_load[best] ||
            (w->dev_load[d] == w->dev_load[best] && w->dev_slots[d] < w->dev_slots[best]))
            best = d;
    }
    return best;
}

/* Places x when every device with a free slot already holds it: some full device d2 without x
 * gives one of its experts y to a free device d that lacks y, and takes x. Such a pair always
 * exists: were every expert of d2 also on d, d would hold slots + 1 experts. */
static void place_by_swap(struct work *w, int x)
{
    for (int d2 = 0; d2 < w->N; d2++) {
        if (w->has[(size_t)x * w->N + d2]) continue;
        for (int s = 0; s < w->n; s++) {
            if (w->sd[s] != d2) continue;
            int y = w->sx[s];
            for (int d = 0; d < w->N; d++) {
                if (w->dev_slots[d] >= w->slots || w->has[(size_t)y * w->N + d]) continue;
                w->has[(size_t)y * w->N + d2] = 0;
                w->has[(size_t)y * w->N + d] = 1;
                w->sd[s] = d;
                w->dev_slots[d2]--;
                w->dev_slots[d]++;
                place(w, x, d2);
                return;
            }
        }
    }
}

static void place_least_loaded(struct work *w, int x)
{
    int d = least_loaded(w, x);
    if (d >= 0)
        place(w, x, d);
    else
        place_by_swap(w, x);
}

/* R more replicas, one at a time to the expert with the most load per replica (that has a
 * device left to go to), each on the least-loaded device that can take it. */
static void add_replicas(struct work *w, int R)
{
    for (int r = 0; r < R; r++) {
        equal_shares(w);
        int best = -1;
        for (int x = 0; x < w->E; x++) {
            if (w->n_rep[x] >= w->N) continue;
            if (best < 0 || w->load[x] * w->n_rep[best] > w->load[best] * w->n_rep[x]) best = x;
        }
        if (best < 0) return; /* every expert on every device (R was checked) */
        place_least_loaded(w, best);
    }
    equal_shares(w);
}

/* Lists each expert's slots (rep_list[rep_first[x] ...]); moves and swaps change only slots'
 * devices, so the lists stay valid through them. */
static void list_replicas(struct work *w)
{
    w->rep_first[0] = 0;
    for (int x = 0; x < w->E; x++) w->rep_first[x + 1] = w->rep_first[x] + w->n_rep[x];
    int *fill = w->n_rep + w->E; /* scratch (2E ints) */
    memcpy(fill, w->rep_first, sizeof(int) * (size_t)w->E);
    for (int s = 0; s < w->n; s++) w->rep_list[fill[w->sx[s]]++] = s;
}

/* Splits expert x's rows between its replicas so that their devices' loads even out, the other
 * loads fixed: its load is poured onto those devices up to a common level (water-filling).
 * Returns how much the shares changed. */
static double fill_expert(struct work *w, int x)
{
    int *slot_of = w->tmp_slot, k = 0;
    double *base = w->tmp_base, lx = w->load[x], moved = 0.0;
    if (w->n_rep[x] < 2 || lx <= 0.0) return 0.0;
    for (int i = w->rep_first[x]; i < w->rep_first[x + 1]; i++) slot_of[k++] = w->rep_list[i];
    for (int i = 0; i < k; i++) base[i] = w->dev_load[w->sd[slot_of[i]]] - lx * w->sh[slot_of[i]];
    /* The level lambda with sum(max(0, lambda - base_i)) = lx: with the bases sorted, the
     * first i devices fill up to (lx + their bases) / i, as long as that stays below the next
     * base. slot_of is sorted along with base. */
    for (int i = 1; i < k; i++) {
        double bv = base[i];
        int sv = slot_of[i], j = i;
        for (; j > 0 && base[j - 1] > bv; j--) {
            base[j] = base[j - 1];
            slot_of[j] = slot_of[j - 1];
        }
        base[j] = bv;
        slot_of[j] = sv;
    }
    double lambda = base[0] + lx, acc = 0.0;
    for (int i = 0; i < k; i++) {
        acc += base[i];
        lambda = (lx + acc) / (i + 1);
        if (i + 1 == k || lambda <= base[i + 1]) break;
    }
    for (int i = 0; i < k; i++) {
        int s = slot_of[i];
        double part = lambda > base[i] ? lambda - base[i] : 0.0;
        float nsh = (float)(part / lx);
        moved += fabs(nsh - w->sh[s]);
        w->sh[s] = nsh;
        w->dev_load[w->sd[s]] = base[i] + part;
    }
    return moved;
}

/* Water-fills every replicated expert in turn until the shares settle (each sweep lowers the
 * sum of squared device loads, a convex function of the shares). */
static void water_fill(struct work *w)
{
    list_replicas(w);
    for (int pass = 0; pass < 32; pass++) {
        double moved = 0.0;
        for (int x = 0; x < w->E; x++) moved += fill_expert(w, x);
        if (moved < 1e-6) break;
    }
}

/* Undo log of a tentative move: devices' loads and slots' (device, share) as they were. */
struct undo {
    int n_dev, n_slot;
    int *dev;       /* (2N + 2) */
    double *load;
    int *slot;      /* (2N + 2) */
    int *slot_dev;
    float *slot_sh;
};

static void undo_dev(struct undo *u, const struct work *w, int d)
{
    u->dev[u->n_dev] = d;
    u->load[u->n_dev++] = w->dev_load[d];
}

static void undo_expert(struct undo *u, const struct work *w, int x)
{
    for (int i = w->rep_first[x]; i < w->rep_first[x + 1]; i++) {
        int s = w->rep_list[i];
        undo_dev(u, w, w->sd[s]);
        u->slot[u->n_slot] = s;
        u->slot_dev[u->n_slot] = w->sd[s];
        u->slot_sh[u->n_slot++] = w->sh[s];
    }
}

static void relocate(struct work *w, int s, int to)
{
    int x = w->sx[s], from = w->sd[s];
    double part = w->load[x] * w->sh[s];
    w->has[(size_t)x * w->N + from] = 0;
    w->has[(size_t)x * w->N + to] = 1;
    w->dev_slots[from]--;
    w->dev_slots[to]++;
    w->dev_load[from] -= part;
    w->dev_load[to] += part;
    w->sd[s] = to;
}

static void rollback(struct work *w, struct undo *u)
{
    for (int i = u->n_slot - 1; i >= 0; i--) {
        int s = u->slot[i];
        if (w->sd[s] != u->slot_dev[i]) {
            w->has[(size_t)w->sx[s] * w->N + w->sd[s]] = 0;
            w->has[(size_t)w->sx[s] * w->N + u->slot_dev[i]] = 1;
            w->dev_slots[w->sd[s]]--;
            w->dev_slots[u->slot_dev[i]]++;
            w->sd[s] = u->slot_dev[i];
        }
        w->sh[s] = u->slot_sh[i];
    }
    for (int i = u->n_dev - 1; i >= 0; i--) w->dev_load[u->dev[i]] = u->load[i];
}

/* Moves slot a to device B (swapping with slot b there, or b < 0: into a free slot), re-fills
 * the experts involved, and keeps the change if every device it touched ends below `limit`
 * (the load of the busiest device, a's): the busiest device gets lighter and no other becomes
 * as heavy. */
static bool try_relocate(struct work *w, struct undo *u, int a, int B, int b, double limit)
{
    int A = w->sd[a], x = w->sx[a], y = b >= 0 ? w->sx[b] : -1;
    u->n_dev = u->n_slot = 0;
    undo_expert(u, w, x);
    if (y >= 0) undo_expert(u, w, y);
    undo_dev(u, w, A);
    undo_dev(u, w, B);
    relocate(w, a, B);
    if (b >= 0) relocate(w, b, A);
    fill_expert(w, x);
    if (y >= 0) fill_expert(w, y);
    double worst = 0.0;
    for (int i = 0; i < u->n_dev; i++)
        worst = w->dev_load[u->dev[i]] > worst ? w->dev_load[u->dev[i]] : worst;
    if (worst < limit * (1.0 - 1e-9)) return true;
    rollback(w, u);
    return false;
}

/* Water-filling only moves load between devices that share an expert; when the busiest devices
 * form a group no replica leads out of, it is stuck. This local search moves (or swaps) a
 * replica off the busiest device to a lighter one, re-fills, and keeps what lowers the busiest
 * device without making another as busy; until nothing helps. */
static void improve(struct work *w, struct undo *u)
{
    list_replicas(w);
    int *order = w->order;
    for (int it = 0; it < 8 * w->N + 64; it++) {
        int A = 0;
        for (int d = 1; d < w->N; d++) A = w->dev_load[d] > w->dev_load[A] ? d : A;
        double limit = w->dev_load[A];
        /* Lighter devices first. */
        for (int d = 0; d < w->N; d++) order[d] = d;
        for (int i = 1; i < w->N; i++) {
            int v = order[i], j = i;
            for (; j > 0 && w->dev_load[order[j - 1]] > w->dev_load[v]; j--) order[j] = order[j - 1];
            order[j] = v;
        }
        bool done = false;
        for (int a = 0; a < w->n && !done; a++) {
            if (w->sd[a] != A) continue;
            int x = w->sx[a];
            for (int i = 0; i < w->N && !done; i++) {
                int B = order[i];
                if (B == A || w->dev_load[B] >= limit || w->has[(size_t)x * w->N + B]) continue;
                if (w->dev_slots[B] < w->slots) {
                    done = try_relocate(w, u, a, B, -1, limit);
                    continue;
                }
                for (int b = 0; b < w->n && !done; b++)
                    if (w->sd[b] == B && !w->has[(size_t)w->sx[b] * w->N + A])
                        done = try_relocate(w, u, a, B, b, limit);
            }
        }
        if (!done) break;
    }
}

/* eplb, first try: wrap the experts' loads over the devices (McNaughton's rule for preemptive
 * scheduling): devices in turn are filled to exactly the mean load, an expert that does not fit
 * the rest of a device continuing on the next one as a replica with the matching share. Every
 * device gets the mean, with at most N - 1 splits, and the hottest experts are the ones split
 * (they span devices). Experts go in `order` (heavy and light alternating, so every device
 * gets about E / N of them). False when the pieces would pass a device's slots or R. */
static bool eplb_wrap(struct work *w, int R, const int *order)
{
    double total = 0.0;
    for (int x = 0; x < w->E; x++) total += w->load[x];
    if (!(total > 0)) return false;
    /* Each device is filled to the mean of what is left over the devices left: a device whose
     * slots run out before its load does passes the difference on to all the others. */
    double left_total = total, cap = total / w->N, room = cap;
    int d = 0;
    for (int i = 0; i < w->E; i++) {
        int x = order[i];
        double left = w->load[x];
        if (left <= 0) continue; /* below, on any free slot */
        while (left > 0) {
            if (d >= w->N) return false;
            if (w->n >= w->E + R) return false;
            /* take the rest here when what would be left for the next device is negligible */
            double part = left - room < 1e-9 * cap ? left : room;
            place(w, x, d);
            w->sh[w->n - 1] = (float)(part / w->load[x]);
            w->dev_load[d] += part;
            left -= part;
            room -= part;
            left_total -= part;
            if (room <= 1e-9 * cap || w->dev_slots[d] >= w->slots) {
                d++;
                room = d < w->N ? left_total / (w->N - d) : 0.0;
            }
        }
    }
    for (int x = 0; x < w->E; x++) {
        if (w->load[x] > 0) continue;
        int best = -1;
        for (int dd = 0; dd < w->N; dd++)
            if (w->dev_slots[dd] < w->slots && (best < 0 || w->dev_slots[dd] < w->dev_slots[best]))
                best = dd;
        if (best < 0 || w->n >= w->E + R) return false;
        place(w, x, best);
    }
    return true;
}

/* The per-expert and per-device counts from the slots (after slots were copied back). */
static void recount(struct work *w)
{
    memset(w->n_rep, 0, sizeof(int) * (size_t)w->E);
    memset(w->dev_slots, 0, sizeof(int) * (size_t)w->N);
    memset(w->has, 0, (size_t)w->E * w->N);
    for (int d = 0; d < w->N; d++) w->dev_load[d] = 0.0;
    for (int s = 0; s < w->n; s++) {
        w->n_rep[w->sx[s]]++;
        w->dev_slots[w->sd[s]]++;
        w->has[(size_t)w->sx[s] * w->N + w->sd[s]] = 1;
        w->dev_load[w->sd[s]] += w->load[w->sx[s]] * w->sh[s];
    }
}

static double busiest(const struct work *w)
{
    double mx = 0.0;
    for (int d = 0; d < w->N; d++) mx = w->dev_load[d] > mx ? w->dev_load[d] : mx;
    return mx;
}

static void reset_work(struct work *w)
{
    w->n = 0;
    recount(w);
}

/* Fills the slots left (up to S) with replicas of the experts with the most load per replica,
 * on the least-loaded devices that can take them, with no share yet (water-filling may give
 * them some; a later rebalance can use them without copying weights). Always possible when
 * S <= E x N and S <= slots x N (see plc_compute). */
static void pad_replicas(struct work *w, int S)
{
    while (w->n < S) {
        int best = -1, dev = -1;
        for (int x = 0; x < w->E; x++) {
            if (w->n_rep[x] >= w->N) continue;
            if (best >= 0 && !(w->load[x] * w->n_rep[best] > w->load[best] * w->n_rep[x])) continue;
            int d = least_loaded(w, x);
            if (d < 0) continue;
            best = x;
            dev = d;
        }
        if (best < 0) return;
        place(w, best, dev);
        w->sh[w->n - 1] = 0.0f;
    }
}

/* eplb, otherwise (DeepSeek's greedy): replicate the experts with the most load per replica,
 * then pack replicas heaviest first onto the least-loaded device with a free slot. */
static void eplb_layer(struct work *w, int R)
{
    for (int x = 0; x < w->E; x++) w->n_rep[x] = 1;
    for (int r = 0; r < R; r++) {
        int best = -1;
        for (int x = 0; x < w->E; x++) {
            if (w->n_rep[x] >= w->N) continue;
            if (best < 0 || w->load[x] * w->n_rep[best] > w->load[best] * w->n_rep[x]) best = x;
        }
        if (best < 0) break;
        w->n_rep[best]++;
    }
    /* Replica list sorted by load per replica, heaviest first (ties: expert id). */
    int S = 0;
    int *items = w->sx + w->S; /* scratch: sx has room for 2 S */
    for (int x = 0; x < w->E; x++)
        for (int r = 0; r < w->n_rep[x]; r++) items[S++] = x;
    for (int i = 1; i < S; i++) {
        int v = items[i], j = i;
        double lv = w->load[v] / w->n_rep[v];
        while (j > 0) {
            int u = items[j - 1];
            double lu = w->load[u] / w->n_rep[u];
            if (lu > lv || (lu == lv && u <= v)) break;
            items[j] = u;
            j--;
        }
        items[j] = v;
    }
    int *want = w->n_rep + w->E; /* scratch: replicas each expert is meant to get */
    memcpy(want, w->n_rep, sizeof(int) * (size_t)w->E);
    memset(w->n_rep, 0, sizeof(int) * (size_t)w->E);
    for (int i = 0; i < S; i++) {
        int x = items[i];
        /* Load a replica adds: its expert's load split over the replicas it will have. */
        int d = least_loaded(w, x);
        if (d >= 0)
            place(w, x, d);
        else
            place_by_swap(w, x);
        w->dev_load[w->sd[w->n - 1]] += w->load[x] / want[x];
    }
    equal_shares(w);
}

/* c2r's partition state: dev[x] the device of expert x, conn[x * N + d] the co-activation of
 * x with the experts on d (sum of W[x][y] over y on d, y != x). Loads and slot counts live in
 * the work state. */
struct part {
    struct work *w;
    const float *W;   /* (E, E) symmetric, zero diagonal */
    int *dev;         /* (E) */
    double *conn;     /* (E, N) */
};

static void part_shift(struct part *p, int a, int to)
{
    struct work *w = p->w;
    int E = w->E, N = w->N, from = p->dev[a];
    w->dev_load[from] -= w->load[a];
    w->dev_load[to] += w->load[a];
    w->dev_slots[from]--;
    w->dev_slots[to]++;
    for (int y = 0; y < E; y++) {
        p->conn[(size_t)y * N + from] -= p->W[(size_t)y * E + a];
        p->conn[(size_t)y * N + to] += p->W[(size_t)y * E + a];
    }
    p->dev[a] = to;
}

/* Co-activation kept inside devices gained by moving a to B (b < 0) or swapping a and b. */
static double part_gain(const struct part *p, int a, int B, int b)
{
    int N = p->w->N, A = p->dev[a];
    double g = p->conn[(size_t)a * N + B] - p->conn[(size_t)a * N + A];
    if (b >= 0)
        g += p->conn[(size_t)b * N + A] - p->conn[(size_t)b * N + B] -
             2.0 * p->W[(size_t)a * p->w->E + b];
    return g;
}

/* Loads of a's and B's devices after moving a to B (b < 0) or swapping a and b. */
static void part_loads(const struct part *p, int a, int B, int b, double *la, double *lb)
{
    const struct work *w = p->w;
    double d = w->load[a] - (b >= 0 ? w->load[b] : 0.0);
    *la = w->dev_load[p->dev[a]] - d;
    *lb = w->dev_load[B] + d;
}

static void part_assign(struct part *p, int x, int d)
{
    struct work *w = p->w;
    p->dev[x] = d;
    w->dev_load[d] += w->load[x];
    w->dev_slots[d]++;
    for (int y = 0; y < w->E; y++) p->conn[(size_t)y * w->N + d] += p->W[(size_t)y * w->E + x];
}

/* The device within the bound (and slots) x co-activates with most, else the least loaded
 * with a free slot. */
static int part_best_device(const struct part *p, int x, double bound)
{
    const struct work *w = p->w;
    int N = w->N, best = -1;
    for (int pass = 0; pass < 2 && best < 0; pass++)
        for (int d = 0; d < N; d++) {
            if (w->dev_slots[d] >= w->slots) continue;
            if (pass == 0 && w->dev_load[d] + w->load[x] > bound) continue;
            double cd = p->conn[(size_t)x * N + d], cb = best >= 0 ? p->conn[(size_t)x * N + best] : 0;
            if (best < 0 || (pass == 0 && cd > cb) ||
                ((pass == 1 || cd == cb) && w->dev_load[d] < w->dev_load[best]))
                best = d;
        }
    return best;
}

/* Start 1: experts heaviest first, each to its best device. */
static void part_init_greedy(struct part *p, const int *by_load, double bound)
{
    for (int i = 0; i < p->w->E; i++) part_assign(p, by_load[i], part_best_device(p, by_load[i], bound));
}

/* Start 2: grow devices one at a time: the heaviest expert left seeds it, then the expert left
 * that co-activates most with what it holds joins, while slots and the bound allow. Experts
 * left at the end go to their best device. */
static void part_init_grow(struct part *p, const int *by_load, double bound)
{
    struct work *w = p->w;
    int E = w->E, N = w->N;
    for (int x = 0; x < E; x++) p->dev[x] = -1;
    for (int d = 0; d < N; d++) {
        int seed = -1;
        for (int i = 0; i < E && seed < 0; i++)
            if (p->dev[by_load[i]] < 0) seed = by_load[i];
        if (seed < 0) break;
        part_assign(p, seed, d);
        while (w->dev_slots[d] < w->slots) {
            int best = -1;
            for (int x = 0; x < E; x++) {
                if (p->dev[x] >= 0 || w->dev_load[d] + w->load[x] > bound) continue;
                if (best < 0 || p->conn[(size_t)x * N + d] > p->conn[(size_t)best * N + d])
                    best = x;
            }
            if (best < 0) break;
            part_assign(p, best, d);
        }
    }
    for (int i = 0; i < E; i++)
        if (p->dev[by_load[i]] < 0) part_assign(p, by_load[i], part_best_device(p, by_load[i], bound));
}

/* While a device is over the bound: the move or swap that brings it down and loses the least
 * co-activation. */
static void part_balance(struct part *p, double bound)
{
    struct work *w = p->w;
    int E = w->E, N = w->N;
    for (int it = 0; it < 4 * E; it++) {
        int A = 0;
        for (int d = 1; d < N; d++) A = w->dev_load[d] > w->dev_load[A] ? d : A;
        double top = w->dev_load[A];
        if (top <= bound) break;
        int ba = -1, bB = -1, bb = -1;
        double bgain = -INFINITY;
        for (int a = 0; a < E; a++) {
            if (p->dev[a] != A) continue;
            for (int b = -1; b < E; b++) {
                if (b >= 0 && (p->dev[b] == A || w->load[b] >= w->load[a])) continue;
                for (int B = 0; B < N; B++) {
                    if (B == A || (b >= 0 && B != p->dev[b]) || (b < 0 && w->dev_slots[B] >= w->slots))
                        continue;
                    double la, lb;
                    part_loads(p, a, B, b, &la, &lb);
                    if (la >= top || lb >= top) continue;
                    double g = part_gain(p, a, B, b);
                    if (g > bgain) {
                        bgain = g;
                        ba = a;
                        bB = B;
                        bb = b;
                    }
                }
            }
        }
        if (ba < 0) break;
        if (bb >= 0) part_shift(p, bb, A);
        part_shift(p, ba, bB);
    }
}

/* Moves and swaps that raise the co-activation kept inside devices, both devices staying
 * within the bound (or no heavier than the heavier of the two was). */
static void part_refine(struct part *p, double bound)
{
    struct work *w = p->w;
    int E = w->E, N = w->N;
    for (int pass = 0; pass < 64; pass++) {
        int improved = 0;
        for (int a = 0; a < E; a++) {
            for (int b = -1; b < E; b++) {
                int A = p->dev[a];
                if (b >= 0 && p->dev[b] == A) continue;
                for (int B = 0; B < N; B++) {
                    if (B == A || (b >= 0 && B != p->dev[b]) || (b < 0 && w->dev_slots[B] >= w->slots))
                        continue;
                    double g = part_gain(p, a, B, b);
                    if (g <= 1e-9 * (1.0 + fabs(p->conn[(size_t)a * N + A]))) continue;
                    double la, lb;
                    part_loads(p, a, B, b, &la, &lb);
                    double lim = w->dev_load[A] > w->dev_load[B] ? w->dev_load[A] : w->dev_load[B];
                    lim = lim > bound ? lim : bound;
                    if (la > lim || lb > lim) continue;
                    if (b >= 0) part_shift(p, b, A);
                    part_shift(p, a, B);
                    improved++;
                    break;
                }
            }
        }
        if (!improved) break;
    }
}

/* c2r: a balanced partition of the co-activation graph W (E, E), from two starts (greedy by
 * affinity, heaviest first; and devices grown around a seed), each brought within the load
 * bound and refined by moves and swaps; the one keeping more co-activation inside devices
 * within the bound wins (else the less loaded). */
static int c2r_layer(struct work *w, const float *W, double bound_ratio)
{
    int E = w->E, N = w->N;
    struct part p = {.w = w, .W = W};
    p.conn = calloc((size_t)E * N, sizeof *p.conn);
    p.dev = malloc(sizeof(int) * (size_t)E);
    int *order = malloc(sizeof(int) * (size_t)E), *best_dev = malloc(sizeof(int) * (size_t)E);
    if (!p.conn || !p.dev || !order || !best_dev) {
        free(p.conn);
        free(p.dev);
        free(order);
        free(best_dev);
        return -1;
    }
    double total = 0.0, heaviest = 0.0;
    for (int x = 0; x < E; x++) {
        total += w->load[x];
        heaviest = w->load[x] > heaviest ? w->load[x] : heaviest;
        order[x] = x;
    }
    double bound = bound_ratio * total / N;
    if (bound < heaviest) bound = heaviest; /* one expert alone may exceed the mean share */
    for (int i = 1; i < E; i++) { /* by load, heaviest first (stable) */
        int v = order[i], j = i;
        for (; j > 0 && w->load[order[j - 1]] < w->load[v]; j--) order[j] = order[j - 1];
        order[j] = v;
    }
    double best_keep = -1.0, best_top = INFINITY;
    for (int start = 0; start < 2; start++) {
        memset(p.conn, 0, sizeof *p.conn * (size_t)E * N);
        memset(w->dev_slots, 0, sizeof(int) * (size_t)N);
        for (int d = 0; d < N; d++) w->dev_load[d] = 0.0;
        if (start == 0)
            part_init_greedy(&p, order, bound);
        else
            part_init_grow(&p, order, bound);
        part_balance(&p, bound);
        part_refine(&p, bound);
        double keep = 0.0, top = 0.0;
        for (int x = 0; x < E; x++) keep += p.conn[(size_t)x * N + p.dev[x]];
        for (int d = 0; d < N; d++) top = w->dev_load[d] > top ? w->dev_load[d] : top;
        bool within = top <= bound * (1 + 1e-9), best_within = best_top <= bound * (1 + 1e-9);
        if (best_keep < 0 || (within && !best_within) ||
            (within == best_within && (within ? keep > best_keep : top < best_top))) {
            best_keep = keep;
            best_top = top;
            memcpy(best_dev, p.dev, sizeof(int) * (size_t)E);
        }
    }
    /* The slots from the chosen assignment. */
    w->n = 0;
    memset(w->n_rep, 0, sizeof(int) * (size_t)E);
    memset(w->dev_slots, 0, sizeof(int) * (size_t)N);
    memset(w->has, 0, (size_t)E * N);
    for (int d = 0; d < N; d++) w->dev_load[d] = 0.0;
    for (int x = 0; x < E; x++) place(w, x, best_dev[x]);
    free(p.conn);
    free(p.dev);
    free(order);
    free(best_dev);
    equal_shares(w);
    return 0;
}

/* eplb on one work: two candidates, the better kept: the wrap (experts heavy and light
 * alternating) and DeepSeek's greedy, each water-filled and improved. alt: (E) scratch;
 * keep_*: (S) scratch. */
static void eplb_place(struct work *w, struct undo *u, int R, int *alt, int *keep_sx,
                       int *keep_sd, float *keep_sh)
{
    int E = w->E;
    const double *load = w->load;
    int *idx = w->order;
    for (int x = 0; x < E; x++) idx[x] = x;
    for (int i = 1; i < E; i++) {
        int v = idx[i], j = i;
        for (; j > 0 && load[idx[j - 1]] < load[v]; j--) idx[j] = idx[j - 1];
        idx[j] = v;
    }
    for (int i = 0, lo = 0, hi = E - 1; i < E; i++) alt[i] = i % 2 == 0 ? idx[lo++] : idx[hi--];
    double wrap_top = INFINITY;
    int wrap_n = 0;
    if (eplb_wrap(w, R, alt)) {
        pad_replicas(w, w->S);
        water_fill(w);
        improve(w, u);
        wrap_top = busiest(w);
        wrap_n = w->n;
        memcpy(keep_sx, w->sx, sizeof(int) * (size_t)w->n); /* kept aside */
        memcpy(keep_sd, w->sd, sizeof(int) * (size_t)w->n);
        memcpy(keep_sh, w->sh, sizeof(float) * (size_t)w->n);
    }
    reset_work(w);
    eplb_layer(w, R);
    water_fill(w);
    improve(w, u);
    if (wrap_top <= busiest(w) * (1 + 1e-12)) {
        w->n = wrap_n;
        memcpy(w->sx, keep_sx, sizeof(int) * (size_t)w->n);
        memcpy(w->sd, keep_sd, sizeof(int) * (size_t)w->n);
        memcpy(w->sh, keep_sh, sizeof(float) * (size_t)w->n);
        recount(w);
    }
}

/* Hierarchical eplb: a node's predicted load at most this x the mean in the node partition.
 * Tighter than c2r's device bound: eplb inside a node balances its devices but cannot move
 * load between nodes (on a DeepSeek-V3-shaped synthetic trace, 64 devices in 8 nodes, 1.02
 * gave imbalance 1.077 and 1.10 gave 1.107, for the same cross-node traffic). */
#define PLC_NODE_BOUND 1.02

/* Hierarchical eplb's state (after DeepSeek's hierarchical load balancer): the experts of a
 * layer are first split over the nodes (a balanced partition, co-activated experts kept
 * together as c2r keeps them on a device, when co-activation counts are known), then each
 * node's experts and its share of the replicas are placed over its devices by eplb. */
struct hier {
    int nodes, per_node;     /* devices per node: node n holds devices n * per_node .. */
    struct work nw;          /* the experts over the nodes (N = nodes) */
    struct undo nu;
    struct work sw;          /* one node's sub-problem (N = per_node; E, S set per node) */
    struct undo su;
    double *sload;           /* (E) the node's experts' loads */
    int *sexp;               /* (E) the node's experts, by global id */
    int *alt, *keep_sx, *keep_sd;
    float *keep_sh;
};

static int work_alloc(struct work *w, struct undo *u);
static void work_free(struct work *w, struct undo *u);

/* The experts' nodes: c2r's partition of the co-activation graph with the nodes as devices,
 * or without counts the heaviest expert first onto the least-loaded node with room. */
static int hier_nodes(struct hier *h, const struct work *w, const float *coact, double bound,
                      int *node)
{
    struct work *nw = &h->nw;
    nw->load = w->load;
    nw->n = 0;
    memset(nw->n_rep, 0, sizeof(int) * (size_t)nw->E);
    memset(nw->dev_slots, 0, sizeof(int) * (size_t)nw->N);
    memset(nw->has, 0, (size_t)nw->E * nw->N);
    for (int d = 0; d < nw->N; d++) nw->dev_load[d] = 0.0;
    if (coact) {
        if (c2r_layer(nw, coact, bound) != 0) return -1;
        for (int s = 0; s < nw->n; s++) node[nw->sx[s]] = nw->sd[s];
        return 0;
    }
    int *idx = nw->order;
    for (int x = 0; x < nw->E; x++) idx[x] = x;
    for (int i = 1; i < nw->E; i++) {
        int v = idx[i], j = i;
        for (; j > 0 && w->load[idx[j - 1]] < w->load[v]; j--) idx[j] = idx[j - 1];
        idx[j] = v;
    }
    for (int i = 0; i < nw->E; i++) {
        int x = idx[i], best = -1;
        for (int n = 0; n < nw->N; n++)
            if (nw->dev_slots[n] < nw->slots && (best < 0 || nw->dev_load[n] < nw->dev_load[best]))
                best = n;
        node[x] = best;
        nw->dev_slots[best]++;
        nw->dev_load[best] += w->load[x];
    }
    return 0;
}

/* One layer of hierarchical eplb into w (N = nodes x per_node): each node's experts and
 * R / nodes replicas (the remainder to the first nodes) placed by eplb on its devices. */
static int eplb_hier_layer(struct work *w, struct hier *h, int R, const float *coact,
                           double bound)
{
    int E = w->E, *node = w->order; /* scratch until the slots are placed */
    if (hier_nodes(h, w, coact, bound, node) != 0) return -1;
    int *nodes_of = malloc(sizeof(int) * (size_t)E);
    if (!nodes_of) return -1;
    memcpy(nodes_of, node, sizeof(int) * (size_t)E);
    for (int n = 0; n < h->nodes; n++) {
        struct work *sw = &h->sw;
        int En = 0;
        for (int x = 0; x < E; x++)
            if (nodes_of[x] == n) {
                h->sexp[En] = x;
                h->sload[En++] = w->load[x];
            }
        if (En == 0) continue;
        int Rn = R / h->nodes + (n < R % h->nodes);
        if (Rn > En * (h->per_node - 1)) Rn = En * (h->per_node - 1);
        if (Rn > sw->slots * h->per_node - En) Rn = sw->slots * h->per_node - En;
        sw->E = En;
        sw->S = En + Rn;
        sw->load = h->sload;
        reset_work(sw);
        eplb_place(sw, &h->su, Rn, h->alt, h->keep_sx, h->keep_sd, h->keep_sh);
        for (int s = 0; s < sw->n; s++) {
            place(w, h->sexp[sw->sx[s]], n * h->per_node + sw->sd[s]);
            w->sh[w->n - 1] = sw->sh[s];
        }
    }
    free(nodes_of);
    pad_replicas(w, w->S); /* replicas a node could not take (more than its experts fill) */
    return 0;
}

static int hier_init(struct hier *h, int E, int N, int S, int nodes, int slots)
{
    memset(h, 0, sizeof *h);
    h->nodes = nodes;
    h->per_node = N / nodes;
    h->nw = (struct work){.E = E, .N = nodes, .S = E, .slots = (E + nodes - 1) / nodes};
    h->sw = (struct work){.E = E, .N = h->per_node, .S = S, .slots = slots};
    h->sload = malloc(sizeof(double) * (size_t)E);
    h->sexp = malloc(sizeof(int) * (size_t)E);
    h->alt = malloc(sizeof(int) * (size_t)E);
    h->keep_sx = malloc(sizeof(int) * (size_t)S);
    h->keep_sd = malloc(sizeof(int) * (size_t)S);
    h->keep_sh = malloc(sizeof(float) * (size_t)S);
    bool ok = h->sload && h->sexp && h->alt && h->keep_sx && h->keep_sd && h->keep_sh;
    ok = work_alloc(&h->nw, &h->nu) == 0 && ok;
    return work_alloc(&h->sw, &h->su) == 0 && ok ? 0 : -1;
}

static void hier_free(struct hier *h)
{
    if (h->nodes > 1) {
        work_free(&h->nw, &h->nu);
        work_free(&h->sw, &h->su);
    }
    free(h->sload);
    free(h->sexp);
    free(h->alt);
    free(h->keep_sx);
    free(h->keep_sd);
    free(h->keep_sh);
}

/* The working state of a layer and the undo log, sized by w->E, N, S. */
static int work_alloc(struct work *w, struct undo *u)
{
    size_t E = (size_t)w->E, N = (size_t)w->N, S = (size_t)w->S, U = 2 * N + 2;
    w->sx = malloc(sizeof(int) * 2 * S); /* second half: eplb's replica list */
    w->sd = malloc(sizeof(int) * S);
    w->sh = malloc(sizeof(float) * S);
    w->n_rep = malloc(sizeof(int) * 2 * E);
    w->dev_slots = malloc(sizeof(int) * N);
    w->dev_load = malloc(sizeof(double) * N);
    w->has = malloc(E * N);
    w->tmp_slot = malloc(sizeof(int) * N);
    w->tmp_base = malloc(sizeof(double) * N);
    w->rep_first = malloc(sizeof(int) * (E + 1));
    w->rep_list = malloc(sizeof(int) * S);
    w->order = malloc(sizeof(int) * (E > N ? E : N));
    u->dev = malloc(sizeof(int) * U);
    u->load = malloc(sizeof(double) * U);
    u->slot = malloc(sizeof(int) * U);
    u->slot_dev = malloc(sizeof(int) * U);
    u->slot_sh = malloc(sizeof(float) * U);
    bool ok = w->sx && w->sd && w->sh && w->n_rep && w->dev_slots && w->dev_load && w->has &&
              w->tmp_slot && w->tmp_base && w->rep_first && w->rep_list && w->order && u->dev &&
              u->load && u->slot && u->slot_dev && u->slot_sh;
    return ok ? 0 : -1;
}

static void work_free(struct work *w, struct undo *u)
{
    void *p[] = {w->sx,       w->sd,       w->sh,        w->n_rep,    w->dev_slots, w->dev_load,
                 w->has,      w->tmp_slot, w->tmp_base,  w->rep_first, w->rep_list, w->order,
                 u->dev,      u->load,     u->slot,      u->slot_dev, u->slot_sh};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++) free(p[i]);
}

int plc_compute(const struct plc_model *md, const struct plc_params *p, const struct plc_stats *st,
                struct plc_map *out, char *err, size_t errlen)
{
    int E = md->n_expert, N = p->n_dev, R = p->redundant, L = md->n_layer;
    memset(out, 0, sizeof *out);
    if (E < 1 || L < 1) return ms_errf(err, errlen, "placement: the model has no routed experts");
    if (N < 1) return ms_errf(err, errlen, "placement: %d devices", N);
    if (R < 0) return ms_errf(err, errlen, "--redundant-experts must be >= 0, got %d", R);
    if ((long)R > (long)E * (N - 1))
        return ms_errf(err, errlen,
                       "--redundant-experts %d: at most %ld replicas fit %d devices (one copy of "
                       "each of %d experts per device)",
                       R, (long)E * (N - 1), N, E);
    int S = E + R;
    int slots = p->slots_per_dev > 0 ? p->slots_per_dev : (S + N - 1) / N;
    if ((long)slots * N < S)
        return ms_errf(err, errlen,
                       "--redundant-experts %d: %d experts per layer do not fit %d devices of %d "
                       "expert slots (--max-experts-per-device)",
                       R, S, N, slots);
    if (p->policy == PLC_POLICY_MOHGE &&
        (md->n_group < 2 || !md->expert_group || E % md->n_group != 0))
        return ms_errf(err, errlen, "--expert-placement mohge needs a model with expert groups "
                                    "of equal size (this one has %d groups)",
                       md->n_group);
    if (p->policy == PLC_POLICY_C2R && (!st || !st->coact))
        return ms_errf(err, errlen, "--expert-placement c2r needs co-activation statistics: give "
                                    "--placement-trace FILE (a recorded routing trace) or "
                                    "--rebalance-interval with --routing-stats full");
    if ((int)p->policy < 0 || (int)p->policy >= PLC_N_POLICIES)
        return ms_errf(err, errlen, "unknown placement policy %d", (int)p->policy);

    int nodes = p->n_nodes > 1 ? p->n_nodes : 1;
    if (nodes > 1 && p->policy != PLC_POLICY_EPLB)
        return ms_errf(err, errlen, "--placement-nodes %d: placement over nodes is eplb's "
                                    "(hierarchical), not %s",
                       nodes, plc_policy_name(p->policy));
    if (nodes > 1 && N % nodes != 0)
        return ms_errf(err, errlen, "--placement-nodes %d does not divide the %d devices", nodes,
                       N);
    int rc = -1;
    struct work w = {.E = E, .N = N, .S = S, .slots = slots};
    struct undo u = {0};
    struct hier hier = {.nodes = 1};
    double *load = malloc(sizeof(double) * (size_t)E);
    int *owner = malloc(sizeof(int) * (size_t)E);
    int *keep_sd = malloc(sizeof(int) * (size_t)S), *keep_sx = malloc(sizeof(int) * (size_t)S);
    float *keep_sh = malloc(sizeof(float) * (size_t)S);
    bool ok = load && owner && keep_sd && keep_sx && keep_sh && work_alloc(&w, &u) == 0 &&
              (nodes == 1 || hier_init(&hier, E, N, S, nodes, slots) == 0);
    if (!ok || plc_map_alloc(out, L, E, N, S) != 0) {
        ms_errf(err, errlen, "out of memory for a placement of %d experts on %d devices", S, N);
        goto out;
    }
    out->policy = p->policy;
    w.load = load;
    if (p->policy == PLC_POLICY_MOHGE) plc_mohge_owner(E, md->n_group, N, owner);
    for (int l = 0; l < L; l++) {
        /* Load per expert: the statistics, or (none, or a layer nobody was routed to yet) its
         * width, as if tokens were spread evenly. */
        double sum = 0.0;
        for (int x = 0; x < E; x++) sum += load[x] = st && st->flops ? st->flops[(size_t)l * E + x] : 0;
        for (int x = 0; x < E && !(sum > 0); x++)
            load[x] = 6.0 * md->d_model * (md->expert_width ? md->expert_width[x] : md->d_model);
        w.n = 0;
        memset(w.n_rep, 0, sizeof(int) * (size_t)E);
        memset(w.dev_slots, 0, sizeof(int) * (size_t)N);
        memset(w.has, 0, (size_t)E * N);
        for (int d = 0; d < N; d++) w.dev_load[d] = 0.0;
        switch (p->policy) {
        case PLC_POLICY_CONTIGUOUS:
        case PLC_POLICY_MOHGE:
            for (int x = 0; x < E; x++)
                place(&w, x, p->policy == PLC_POLICY_MOHGE ? owner[x] : (int)((long)x * N / E));
            add_replicas(&w, R);
            if (R > 0) {
                water_fill(&w);
                improve(&w, &u);
            }
            break;
        case PLC_POLICY_EPLB:
            if (hier.nodes > 1) {
                if (eplb_hier_layer(&w, &hier, R, st && st->coact ? st->coact + (size_t)l * E * E
                                                                  : NULL,
                                    PLC_NODE_BOUND) != 0) {
                    ms_errf(err, errlen, "out of memory for the hierarchical placement");
                    goto out;
                }
            } else {
                eplb_place(&w, &u, R, owner, keep_sx, keep_sd, keep_sh);
            }
            break;
        case PLC_POLICY_C2R:
            if (c2r_layer(&w, st->coact + (size_t)l * E * E,
                          p->c2r_bound > 0 ? p->c2r_bound : PLC_C2R_BOUND) != 0) {
                ms_errf(err, errlen, "out of memory for the c2r partition");
                goto out;
            }
            add_replicas(&w, R);
            if (R > 0) {
                water_fill(&w);
                improve(&w, &u);
            }
            break;
        }
        water_fill(&w);
        memcpy(out->slot_expert + (size_t)l * S, w.sx, sizeof(int) * (size_t)S);
        memcpy(out->slot_dev + (size_t)l * S, w.sd, sizeof(int) * (size_t)S);
        memcpy(out->slot_share + (size_t)l * S, w.sh, sizeof(float) * (size_t)S);
    }
    rc = plc_map_finish(out, slots, err, errlen);
out:
    if (rc != 0) plc_map_free(out);
    free(load);
    free(owner);
    free(keep_sd);
    free(keep_sx);
    free(keep_sh);
    work_free(&w, &u);
    hier_free(&hier);
    return rc;
}
