/* Live rebalancing: every `interval` seconds, between two steps, recompute the placement from
 * the engine's routing statistics (the decaying window, engine/routing/route_stats.h) with the
 * configured policy and switch the engine to it (engine_set_placement: copies first, then the
 * map, then the old copies freed). Requests are neither dropped nor stalled beyond the time the
 * policy takes (milliseconds; reported in the engine's stats), and outputs do not change:
 * placement never changes the math.
 *
 * Threads: everything runs on the thread that steps the engine (the scheduler's), between
 * steps; no lock is taken. Ownership: rebal_create borrows the engine (it must outlive the
 * rebalancer) and allocates the statistics snapshots once. */
#ifndef MOESERVE_REBALANCE_H
#define MOESERVE_REBALANCE_H

#include <stdbool.h>
#include <stddef.h>

#include "placement.h"

struct engine;

struct rebal_params {
    struct plc_params plc;  /* policy, replicas, slots, c2r bound (n_dev: the engine's) */
    double interval_s;      /* seconds between rebalances; 0: only when rebal_now is called */
    double min_tokens;      /* tokens the window must hold before the first rebalance */
};

struct rebal;

/* Refuses (-1, a reason naming the flag) an engine without routing statistics, c2r without
 * co-activation counts, or a placement the devices cannot hold. */
int rebal_create(struct engine *e, const struct rebal_params *p, struct rebal **out, char *err,
                 size_t errlen);
void rebal_free(struct rebal *r);

/* Between steps: rebalances when interval_s has passed since the last one (or since creation)
 * and the window holds min_tokens. 1 when the placement was switched, 0 when not due, -1 when
 * computing or applying it failed (the old placement stays; reason in err). now: ms_now(). */
int rebal_maybe(struct rebal *r, double now, char *err, size_t errlen);
/* Rebalances now from whatever the window holds (no traffic yet: by expert widths). */
int rebal_now(struct rebal *r, char *err, size_t errlen);

/* Rebalances done, their total and last duration (computing the placement and switching to
 * it: the time the step loop waited), and the failures. */
struct rebal_stats {
    unsigned long long count, failures;
    double total_s, last_s;
};
void rebal_get_stats(const struct rebal *r, struct rebal_stats *out);

#endif
