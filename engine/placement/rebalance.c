/* Live rebalancing (rebalance.h): a snapshot of the routing window, a placement computed from it,
 * and the engine switched to it between steps. */
#include "rebalance.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"

struct rebal {
    struct engine *e;
    struct rebal_params p;
    struct plc_model md;
    double *flops;   /* (L, E) snapshot */
    float *coact;    /* (L, E, E) snapshot, c2r only */
    double last;     /* when the last rebalance ran (or the rebalancer started) */
    struct rebal_stats st;
};

void rebal_free(struct rebal *r)
{
    if (!r) return;
    free(r->flops);
    free(r->coact);
    free(r);
}

int rebal_create(struct engine *e, const struct rebal_params *p, struct rebal **out, char *err,
                 size_t errlen)
{
    *out = NULL;
    struct rstats *st = engine_routing_stats(e);
    if (!st)
        return ms_errf(err, errlen, "--rebalance-interval needs the routing statistics "
                                    "(--routing-stats load or full)");
    if (p->plc.policy == PLC_POLICY_C2R && !rstats_has_coact(st))
        return ms_errf(err, errlen, "--expert-placement c2r with --rebalance-interval needs "
                                    "co-activation counts: --routing-stats full");
    struct rebal *r = calloc(1, sizeof *r);
    if (!r) return ms_errf(err, errlen, "out of memory");
    r->e = e;
    r->p = *p;
    r->p.plc.n_dev = engine_get_params(e)->n_devices;
    plc_model_from_desc(&engine_model(e)->desc, &r->md);
    const struct plc_map *cur = engine_placement(e);
    size_t L = (size_t)r->md.n_layer, E = (size_t)r->md.n_expert;
    if (cur->n_slots != r->md.n_expert + r->p.plc.redundant) {
        rebal_free(r);
        return ms_errf(err, errlen, "--redundant-experts %d: the engine was started with %d "
                                    "replicas per layer",
                       p->plc.redundant, cur->n_slots - cur->n_expert);
    }
    r->flops = malloc(sizeof(double) * L * E);
    if (p->plc.policy == PLC_POLICY_C2R) r->coact = malloc(sizeof(float) * L * E * E);
    if (!r->flops || (p->plc.policy == PLC_POLICY_C2R && !r->coact)) {
        rebal_free(r);
        return ms_errf(err, errlen, "out of memory for the rebalancer's statistics");
    }
    r->last = ms_now();
    *out = r;
    return 0;
}

int rebal_now(struct rebal *r, char *err, size_t errlen)
{
    double t0 = ms_now();
    struct rstats *st = engine_routing_stats(r->e);
    size_t L = (size_t)r->md.n_layer, E = (size_t)r->md.n_expert;
    for (size_t l = 0; l < L; l++) {
        rstats_expert_flops(st, (int)l, r->flops + l * E);
        if (r->coact) rstats_coact(st, (int)l, r->coact + l * E * E);
    }
    struct plc_stats ps = {.flops = r->flops, .coact = r->coact};
    struct plc_map m;
    r->last = t0;
    int rc = plc_compute(&r->md, &r->p.plc, &ps, &m, err, errlen);
    if (rc == 0) {
        rc = engine_set_placement(r->e, &m, err, errlen);
        plc_map_free(&m);
    }
    if (rc != 0) {
        r->st.failures++;
        return -1;
    }
    r->st.count++;
    r->st.last_s = ms_now() - t0;
    r->st.total_s += r->st.last_s;
    return 1;
}

void rebal_get_stats(const struct rebal *r, struct rebal_stats *out)
{
    *out = r->st;
}

int rebal_maybe(struct rebal *r, double now, char *err, size_t errlen)
{
    if (r->p.interval_s <= 0 || now - r->last < r->p.interval_s) return 0;
    if (rstats_window_tokens(engine_routing_stats(r->e)) < r->p.min_tokens) return 0;
    return rebal_now(r, err, errlen);
}
