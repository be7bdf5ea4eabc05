/* The server's placement and routing-record flags, turned into engine parameters and the work
 * done between steps: the initial placement (--expert-placement, --redundant-experts,
 * --max-experts-per-device, from --placement-trace statistics when given), the routing
 * statistics the engine keeps (--routing-stats, --routing-stats-half-life), live rebalancing
 * (--rebalance-interval) and the routing trace (--record-routing, --record-routing-max-bytes).
 *
 * Lifetime: splace_prepare after the model loads (fills engine_params; the map it points at
 * stays owned here), splace_start after engine_create, splace_after_step as the scheduler's
 * after-step hook (scheduler thread), splace_free after the scheduler stops (closes the
 * trace). */
#ifndef MOESERVE_SERVE_PLACEMENT_H
#define MOESERVE_SERVE_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>

#include "engine.h"
#include "metrics.h"

struct splace_opts {
    const char *policy;        /* NULL: mohge for MoHGE models, else contiguous */
    long redundant;
    long slots_per_dev;
    long nodes;                /* --placement-nodes: eplb over nodes (0 or 1: flat) */
    const char *trace;         /* --placement-trace */
    long interval_s;           /* --rebalance-interval, 0 = off */
    const char *routing_stats; /* auto | off | load | full */
    long half_life;            /* tokens */
    const char *record;        /* --record-routing */
    long record_max_bytes;
    const char *model_name;    /* for the trace header */
    /* Log lines (rebalances, trace failures); printf-like. */
    void (*log)(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
};

/* Checks flag values alone (before the model loads): -1 with a reason naming the flag. */
int splace_check_opts(const struct splace_opts *o, char *err, size_t errlen);

struct splace;

/* -1 with a reason naming the flag: a policy the model cannot take, more replicas than the
 * devices hold, c2r without statistics, a trace of another model or a corrupt one. */
int splace_prepare(const struct splace_opts *o, const struct model *m, struct engine_params *ep,
                   struct splace **out, char *err, size_t errlen);
int splace_start(struct splace *p, struct engine *e, struct metrics *mt, char *err,
                 size_t errlen);
/* struct sched_params.after_step. The trace records each token's request tag (moe_tag) as
 * the engine captured it; declare a tag's name first (no-op without --record-routing). */
void splace_after_step(void *ctx, struct engine *e);
void splace_trace_tag(struct splace *p, int id, const char *name);
/* One line for the log: what placement is in use. */
void splace_describe(const struct splace *p, char *buf, size_t n);
void splace_free(struct splace *p);

#endif
