/* Server placement glue (serve_placement.h): flags to a placement map and engine parameters,
 * then the rebalancer and the routing trace writer run after each step. */
#include "serve_placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "placement/placement.h"
#include "placement/rebalance.h"
#include "routing/route_stats.h"
#include "routing/route_trace.h"

struct splace {
    struct splace_opts o;
    enum plc_policy policy;   /* what the rebalancer computes */
    enum plc_policy start;    /* what the first placement used */
    struct plc_map map;
    struct rebal *rebal;
    struct rtrace_writer *w;
    uint64_t step;
    bool trace_failed;
    int *layer_index;         /* (MoE layers) */
};

static int parse_rstats(const char *s, int *out)
{
    static const char *const names[] = {"off", "load", "full", "auto"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = i;
            return 0;
        }
    return -1;
}

int splace_check_opts(const struct splace_opts *o, char *err, size_t errlen)
{
    enum plc_policy p;
    int rs;
    if (o->policy && plc_policy_parse(o->policy, &p) != 0)
        return ms_errf(err, errlen, "--expert-placement must be contiguous, mohge, eplb or c2r, "
                                    "got '%s'",
                       o->policy);
    if (parse_rstats(o->routing_stats ? o->routing_stats : "auto", &rs) != 0)
        return ms_errf(err, errlen, "--routing-stats must be auto, off, load or full, got '%s'",
                       o->routing_stats);
    return 0;
}

void splace_free(struct splace *p)
{
    if (!p) return;
    char err[MS_ERR_LEN];
    if (p->w && rtrace_writer_close(p->w, err, sizeof err) != 0 && p->o.log)
        p->o.log("error", "--record-routing: %s", err);
    rebal_free(p->rebal);
    plc_map_free(&p->map);
    free(p->layer_index);
    free(p);
}

/* Statistics for the first placement from --placement-trace (NULL arrays when none). */
static int trace_stats(const struct splace_opts *o, const struct plc_model *pm, double **flops,
                       float **coact, char *err, size_t errlen)
{
    *flops = NULL;
    *coact = NULL;
    if (!o->trace) return 0;
    struct rstats_config rc = {.n_layer = pm->n_layer, .n_expert = pm->n_expert,
                               .top_k = pm->top_k, .d_model = pm->d_model,
                               .expert_width = pm->expert_width, .coact = true};
    struct rstats *st = NULL;
    char why[MS_ERR_LEN];
    uint64_t tokens = 0;
    if (rstats_create(&rc, &st, why, sizeof why) != 0 ||
        rtrace_add_to_stats(o->trace, st, -1, &tokens, why, sizeof why) != 0) {
        rstats_free(st);
        return ms_errf(err, errlen, "--placement-trace: %s", why);
    }
    size_t L = (size_t)pm->n_layer, E = (size_t)pm->n_expert;
    *flops = malloc(sizeof(double) * L * E);
    *coact = malloc(sizeof(float) * L * E * E);
    if (!*flops || !*coact) {
        rstats_free(st);
        return ms_errf(err, errlen, "out of memory for the --placement-trace statistics");
    }
    for (size_t l = 0; l < L; l++) {
        rstats_expert_flops(st, (int)l, *flops + l * E);
        rstats_coact(st, (int)l, *coact + l * E * E);
    }
    rstats_free(st);
    if (tokens == 0) return ms_errf(err, errlen, "--placement-trace %s holds no tokens", o->trace);
    return 0;
}

int splace_prepare(const struct splace_opts *o, const struct model *m, struct engine_params *ep,
                   struct splace **out, char *err, size_t errlen)
{
    const struct model_desc *md = &m->desc;
    *out = NULL;
    struct plc_model pm;
    plc_model_from_desc(md, &pm);
    bool moe = pm.n_layer > 0 && pm.n_expert > 0;
    if (!moe && (o->policy || o->redundant || o->trace || o->interval_s || o->record))
        return ms_errf(err, errlen, "the model has no MoE layer: placement and routing flags "
                                    "do not apply");
    struct splace *p = calloc(1, sizeof *p);
    if (!p) return ms_errf(err, errlen, "out of memory");
    p->o = *o;
    *out = p;
    if (!moe) return 0;
    p->policy = md->router == ROUTER_KIND_MOHGE ? PLC_POLICY_MOHGE : PLC_POLICY_CONTIGUOUS;
    if (o->policy) plc_policy_parse(o->policy, &p->policy); /* checked by splace_check_opts */
    int rs_mode = 3;
    parse_rstats(o->routing_stats ? o->routing_stats : "auto", &rs_mode);
    enum engine_rstats need = o->interval_s <= 0            ? ENGINE_RSTATS_OFF
                              : p->policy == PLC_POLICY_C2R ? ENGINE_RSTATS_FULL
                                                            : ENGINE_RSTATS_LOAD;
    enum engine_rstats have = rs_mode == 3 ? need : (enum engine_rstats)rs_mode;
    if (have < need)
        return ms_errf(err, errlen, "--rebalance-interval with --expert-placement %s needs "
                                    "--routing-stats %s (or auto), got %s",
                       plc_policy_name(p->policy), need == ENGINE_RSTATS_FULL ? "full" : "load",
                       o->routing_stats);
    double *flops = NULL;
    float *coact = NULL;
    if (trace_stats(o, &pm, &flops, &coact, err, errlen) != 0) {
        free(flops);
        free(coact);
        return -1;
    }
    /* c2r needs co-activation counts: from the trace, else (when rebalancing) the first
     * rebalance brings them and the engine starts from contiguous blocks. */
    p->start = p->policy;
    if (p->policy == PLC_POLICY_C2R && !coact && o->interval_s > 0) p->start = PLC_POLICY_CONTIGUOUS;
    struct plc_params pp = {.policy = p->start, .n_dev = ep->n_devices,
                            .redundant = (int)o->redundant, .slots_per_dev = (int)o->slots_per_dev,
                            .n_nodes = (int)o->nodes};
    struct plc_stats ps = {.flops = flops, .coact = coact};
    int rc = plc_compute(&pm, &pp, &ps, &p->map, err, errlen);
    free(flops);
    free(coact);
    if (rc != 0) return -1;
    ep->map = &p->map;
    ep->routing_stats = have;
    ep->stats_half_life = (double)o->half_life;
    ep->capture_routing = o->record != NULL;
    return 0;
}

int splace_start(struct splace *p, struct engine *e, struct metrics *mt, char *err,
                 size_t errlen)
{
    const struct model_desc *md = &engine_model(e)->desc;
    if (p->o.interval_s > 0) {
        struct rebal_params rp = {.plc = {.policy = p->policy, .redundant = (int)p->o.redundant,
                                          .slots_per_dev = (int)p->o.slots_per_dev,
                                          .n_nodes = (int)p->o.nodes},
                                  .interval_s = (double)p->o.interval_s,
                                  .min_tokens = 64};
        if (rebal_create(e, &rp, &p->rebal, err, errlen) != 0) return -1;
        metrics_set_rebalancer(mt, p->rebal);
    }
    if (p->o.record) {
        struct plc_model pm;
        plc_model_from_desc(md, &pm);
        p->layer_index = malloc(sizeof(int) * (size_t)pm.n_layer);
        if (!p->layer_index) return ms_errf(err, errlen, "out of memory");
        for (int l = 0, k = 0; l < md->n_layer; l++)
            if (md->layer_is_moe[l]) p->layer_index[k++] = l;
        struct rtrace_info in = {.n_layer = pm.n_layer, .n_expert = md->n_expert,
                                 .top_k = md->top_k, .d_model = md->d_model,
                                 .n_group = pm.n_group, .model_n_layer = md->n_layer,
                                 .expert_width = md->expert_d_ff,
                                 .expert_group = md->expert_group,
                                 .layer_index = p->layer_index};
        snprintf(in.model, sizeof in.model, "%s", p->o.model_name ? p->o.model_name : "");
        char why[MS_ERR_LEN];
        if (rtrace_writer_open(p->o.record, &in, (uint64_t)p->o.record_max_bytes,
                               engine_get_params(e)->max_batch_tokens, &p->w, why,
                               sizeof why) != 0)
            return ms_errf(err, errlen, "--record-routing: %s", why);
    }
    return 0;
}

void splace_trace_tag(struct splace *p, int id, const char *name)
{
    char err[MS_ERR_LEN];
    if (!p->w || p->trace_failed) return;
    if (rtrace_writer_tag(p->w, id, name, err, sizeof err) != 0) {
        p->trace_failed = true;
        if (p->o.log) p->o.log("error", "--record-routing stopped: %s", err);
    }
}

void splace_after_step(void *ctx, struct engine *e)
{
    struct splace *p = ctx;
    char err[MS_ERR_LEN];
    const struct engine_routing *rt = engine_last_routing(e);
    if (p->w && rt && !p->trace_failed) {
        struct rtrace_step st = {.step = p->step, .n_tok = rt->n_tok, .tokens = rt->tokens,
                                 .tags = rt->tags, .ids = rt->ids,
                                 .layer_stride = rt->layer_stride};
        if (rtrace_write_step(p->w, &st, err, sizeof err) != 0) {
            /* Serving goes on; the trace stops here (a full disk must not stop requests). */
            p->trace_failed = true;
            if (p->o.log) p->o.log("error", "--record-routing stopped: %s", err);
        }
    }
    p->step++;
    if (p->rebal) {
        int rc = rebal_maybe(p->rebal, ms_now(), err, sizeof err);
        if (rc < 0 && p->o.log) p->o.log("warning", "rebalance failed (placement kept): %s", err);
        if (rc > 0 && p->o.log) {
            struct rebal_stats rs;
            rebal_get_stats(p->rebal, &rs);
            const struct engine_stats *es = engine_get_stats(e);
            p->o.log("info", "rebalanced (%s): %llu slots moved in all, %.1f ms",
                     plc_policy_name(p->policy), (unsigned long long)es->rebalance_moves,
                     rs.last_s * 1e3);
        }
    }
}

void splace_describe(const struct splace *p, char *buf, size_t n)
{
    if (!p || p->map.n_expert == 0) {
        snprintf(buf, n, "no MoE layer");
        return;
    }
    snprintf(buf, n, "placement %s%s, %d replicas per layer%s%s%s", plc_policy_name(p->start),
             p->start != p->policy ? " (c2r from the first rebalance)" : "",
             p->map.n_slots - p->map.n_expert, p->o.trace ? ", from --placement-trace" : "",
             p->rebal ? ", rebalancing" : "", p->w ? ", recording routing" : "");
}
