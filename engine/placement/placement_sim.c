/* Placement simulator (placement_sim.h): a step buffer per simulated configuration, evaluated
 * when full, and the fit / place / replay experiment over a routing trace. */
#include "placement_sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "rng.h"
#include "routing/route_stats.h"
#include "routing/route_trace.h"

struct psim {
    struct psim_config c;
    struct plc_map map;
    int L, E, K, N, d_model;
    int *width;            /* (E) */
    int32_t *buf;          /* (L, batch_tokens, top_k) the step being filled */
    int fill;
    double *dev_flops;     /* (N) */
    /* (4, N) rows each device sends and receives in this layer's dispatch: a row per remote
     * expert row (sent, received), then a row per (token, remote device) */
    double *link;
    double link_ms, link_ms_dedup; /* the cost model's exchange time, summed over steps */
    uint32_t *stamp;       /* (N) last (layer, token) that sent a row to each device */
    uint32_t *nstamp;      /* (nodes) the same for each node */
    int per_node;          /* devices per node (nodes > 1), else 0 */
    uint32_t clock;
    double mem_max, mem_mean;
    int slots_max;
    /* totals */
    uint64_t steps, tokens, rows, cross_rows, cross_sends, layer_steps, xn_rows, xn_sends;
    double imb_sum, imb_max;
    double *win;           /* (L, N) FLOPs per layer and device over every step */
};

void psim_free(struct psim *s)
{
    if (!s) return;
    plc_map_free(&s->map);
    free(s->width);
    free(s->buf);
    free(s->dev_flops);
    free(s->link);
    free(s->stamp);
    free(s->nstamp);
    free(s->win);
    free(s);
}

int psim_create(const struct plc_model *md, const struct plc_map *map, const struct psim_config *c,
                struct psim **out, char *err, size_t errlen)
{
    *out = NULL;
    if (c->batch_tokens < 1 || map->n_layer != md->n_layer || map->n_expert != md->n_expert)
        return ms_errf(err, errlen, "simulator: a step needs tokens, and the map must fit the "
                                    "model");
    struct psim *s = calloc(1, sizeof *s);
    if (!s) return ms_errf(err, errlen, "out of memory");
    s->c = *c;
    s->L = md->n_layer;
    s->E = md->n_expert;
    s->K = md->top_k;
    s->N = map->n_dev;
    s->d_model = md->d_model;
    s->width = malloc(sizeof(int) * (size_t)s->E);
    s->buf = malloc(sizeof(int32_t) * (size_t)s->L * c->batch_tokens * s->K);
    s->dev_flops = calloc((size_t)s->N, sizeof(double));
    s->link = calloc((size_t)4 * s->N, sizeof(double));
    s->stamp = calloc((size_t)s->N, sizeof(uint32_t));
    s->win = calloc((size_t)s->L * s->N, sizeof(double));
    if (c->nodes > 1 && s->N % c->nodes == 0) { /* else node traffic is not counted */
        s->per_node = s->N / c->nodes;
        s->nstamp = calloc((size_t)c->nodes, sizeof(uint32_t));
    }
    double *mem = calloc((size_t)s->N, sizeof(double));
    if (!s->width || !s->buf || !s->dev_flops || !s->link || !s->stamp || !s->win || !mem ||
        (s->per_node && !s->nstamp) ||
        plc_map_copy(&s->map, map) != 0) {
        free(mem);
        psim_free(s);
        return ms_errf(err, errlen, "out of memory for a simulator of %d tokens a step",
                       c->batch_tokens);
    }
    for (int x = 0; x < s->E; x++) s->width[x] = md->expert_width ? md->expert_width[x] : md->d_model;
    int S = map->n_slots;
    for (int l = 0; l < s->L; l++) {
        for (int d = 0; d < s->N; d++) {
            int n = plc_device_slots(map, l, d);
            s->slots_max = n > s->slots_max ? n : s->slots_max;
        }
        for (int i = 0; i < S; i++) {
            size_t k = (size_t)l * S + i;
            mem[map->slot_dev[k]] += 3.0 * md->d_model * s->width[map->slot_expert[k]] *
                                     c->weight_bytes;
        }
    }
    for (int d = 0; d < s->N; d++) {
        s->mem_max = mem[d] > s->mem_max ? mem[d] : s->mem_max;
        s->mem_mean += mem[d] / s->N;
    }
    free(mem);
    *out = s;
    return 0;
}

/* The link cost model's time for one layer's dispatch and combine: each is an exchange of
 * rounds_per_layer / 2 latency rounds, and lasts until the busiest link (a device's sends or its
 * receives, whichever is more) has carried its rows. */
static double link_ms(const struct psim *s, const double *sent, const double *recv)
{
    const struct psim_config *c = &s->c;
    double busiest = 0.0;
    for (int d = 0; d < s->N; d++) {
        busiest = sent[d] > busiest ? sent[d] : busiest;
        busiest = recv[d] > busiest ? recv[d] : busiest;
    }
    double bytes_per_ms = c->link_gbps * c->link_efficiency * 1e9 / 8.0 / 1e3;
    double row = (double)s->d_model * c->act_bytes;
    return c->rounds_per_layer * c->link_latency_us * 1e-3 + 2.0 * busiest * row / bytes_per_ms;
}

static void eval_step(struct psim *s, int B)
{
    int L = s->L, K = s->K, N = s->N;
    double *sent = s->link, *recv = s->link + N, *sent_t = s->link + 2 * N,
           *recv_t = s->link + 3 * N;
    for (int l = 0; l < L; l++) {
        const int32_t *lay = s->buf + (size_t)l * s->c.batch_tokens * K;
        for (int d = 0; d < N; d++) s->dev_flops[d] = 0.0;
        memset(s->link, 0, sizeof(double) * 4 * (size_t)N);
        double total = 0.0;
        for (int t = 0; t < B; t++) {
            int home = (int)((long)t * N / B);
            uint32_t tick = ++s->clock;
            if (tick == 0) { /* wrapped: forget old stamps */
                memset(s->stamp, 0, sizeof(uint32_t) * (size_t)N);
                if (s->nstamp)
                    memset(s->nstamp, 0, sizeof(uint32_t) * (size_t)(N / s->per_node));
                tick = ++s->clock;
            }
            for (int j = 0; j < K; j++) {
                int32_t x = lay[(size_t)t * K + j];
                if (x < 0 || x >= s->E) continue;
                int slot = plc_pick(&s->map, l, x, (uint32_t)t);
                int d = s->map.slot_dev[(size_t)l * s->map.n_slots + slot];
                double f = 6.0 * s->d_model * s->width[x];
                s->dev_flops[d] += f;
                total += f;
                s->rows++;
                if (s->per_node && d / s->per_node != home / s->per_node) {
                    s->xn_rows++;
                    if (s->nstamp[d / s->per_node] != tick) {
                        s->nstamp[d / s->per_node] = tick;
                        s->xn_sends++;
                    }
                }
                if (d == home) continue;
                s->cross_rows++;
                sent[home]++;
                recv[d]++;
                if (s->stamp[d] != tick) {
                    s->stamp[d] = tick;
                    s->cross_sends++;
                    sent_t[home]++;
                    recv_t[d]++;
                }
            }
        }
        if (s->c.link_gbps > 0) {
            s->link_ms += link_ms(s, sent, recv);
            s->link_ms_dedup += link_ms(s, sent_t, recv_t);
        }
        for (int d = 0; d < N; d++) s->win[(size_t)l * N + d] += s->dev_flops[d];
        if (total <= 0) continue;
        double mx = 0.0;
        for (int d = 0; d < N; d++) mx = s->dev_flops[d] > mx ? s->dev_flops[d] : mx;
        double imb = mx / (total / N);
        s->imb_sum += imb;
        s->imb_max = imb > s->imb_max ? imb : s->imb_max;
        s->layer_steps++;
    }
    s->steps++;
    s->tokens += (uint64_t)B;
}

void psim_feed(struct psim *s, const int32_t *ids, int n, size_t layer_stride)
{
    int K = s->K, B = s->c.batch_tokens;
    size_t stride = layer_stride ? layer_stride : (size_t)n * K;
    for (int t0 = 0; t0 < n;) {
        int take = n - t0 < B - s->fill ? n - t0 : B - s->fill;
        for (int l = 0; l < s->L; l++)
            memcpy(s->buf + ((size_t)l * B + s->fill) * K, ids + (size_t)l * stride + (size_t)t0 * K,
                   sizeof(int32_t) * (size_t)take * K);
        s->fill += take;
        t0 += take;
        if (s->fill == B) {
            eval_step(s, B);
            s->fill = 0;
        }
    }
}

uint64_t psim_steps(const struct psim *s)
{
    return s->steps;
}

void psim_result(struct psim *s, struct psim_result *out)
{
    if (s->fill > 0 && 2 * s->fill >= s->c.batch_tokens) eval_step(s, s->fill);
    s->fill = 0;
    memset(out, 0, sizeof *out);
    out->steps = s->steps;
    out->tokens = s->tokens;
    out->imbalance = s->layer_steps ? s->imb_sum / (double)s->layer_steps : 0.0;
    out->imbalance_max = s->imb_max;
    int layers = 0;
    for (int l = 0; l < s->L; l++) {
        double mx = 0.0, tot = 0.0;
        for (int d = 0; d < s->N; d++) {
            double v = s->win[(size_t)l * s->N + d];
            mx = v > mx ? v : mx;
            tot += v;
        }
        if (tot <= 0) continue;
        out->imbalance_window += mx / (tot / s->N);
        layers++;
    }
    if (layers) out->imbalance_window /= layers;
    out->cross_rows = s->rows ? (double)s->cross_rows / (double)s->rows : 0.0;
    out->cross_sends = s->rows ? (double)s->cross_sends / (double)s->rows : 0.0;
    out->cross_node_rows = s->rows ? (double)s->xn_rows / (double)s->rows : 0.0;
    out->cross_node_sends = s->rows ? (double)s->xn_sends / (double)s->rows : 0.0;
    double row = (double)s->d_model * s->c.act_bytes, tok = s->tokens ? (double)s->tokens : 1.0;
    out->bytes_token = 2.0 * (double)s->cross_rows * row / tok;
    /* the engine's tokens dispatch: a row out per (token, other device), its partial sum back */
    out->bytes_token_dedup = 2.0 * (double)s->cross_sends * row / tok;
    out->link_ms_step = s->steps ? s->link_ms / (double)s->steps : 0.0;
    out->link_ms_step_dedup = s->steps ? s->link_ms_dedup / (double)s->steps : 0.0;
    out->mem_max = s->mem_max;
    out->mem_mean = s->mem_mean;
    out->slots_max = s->slots_max;
}

/* --- the experiment ------------------------------------------------------------------------ */

/* Whether simulator c still takes tokens in replay pass `pass`: every one takes the whole first
 * pass; then those short of min_steps steps. */
static bool wants(struct psim *const *sims, int c, int pass, int min_steps)
{
    return sims[c] && (pass == 0 || psim_steps(sims[c]) < (uint64_t)min_steps);
}

static bool any_wants(struct psim *const *sims, int n_cells, int pass, int min_steps)
{
    for (int c = 0; c < n_cells; c++)
        if (wants(sims, c, pass, min_steps)) return true;
    return false;
}

/* The evaluation tokens, kept (a uniform sample of them past max_eval_bytes: reservoir
 * sampling) as 16-bit ids, layer-major; then fed to every simulator in chunks of a shuffled
 * order, reshuffled at every pass, until each has its steps. */
static int replay_shuffled(const struct psim_run_params *p, struct rtrace_reader *tr,
                           const struct rtrace_info *in, struct psim **sims, int n_cells,
                           const struct psim_summary *sum, char *err, size_t errlen)
{
    enum { CHUNK = 1024 };
    int L = in->n_layer, K = in->top_k, rc = -1;
    size_t per_tok = (size_t)L * K * sizeof(uint16_t);
    size_t budget = p->max_eval_bytes ? p->max_eval_bytes : (size_t)512 << 20;
    size_t cap = budget / per_tok;
    if (cap > sum->eval_tokens) cap = (size_t)sum->eval_tokens;
    if (cap < 1) cap = 1;
    uint16_t *keep = malloc(per_tok * cap); /* token-major while sampling */
    uint32_t *perm = malloc(sizeof(uint32_t) * cap);
    int32_t *chunk = malloc(sizeof(int32_t) * (size_t)L * CHUNK * K);
    struct ms_rng rng;
    ms_rng_seed(&rng, p->seed ^ 0x5eedull);
    if (!keep || !perm || !chunk) {
        ms_errf(err, errlen, "out of memory for %zu evaluation tokens", cap);
        goto out;
    }
    if (rtrace_rewind(tr, err, errlen) != 0) goto out;
    struct rtrace_step step;
    int got;
    uint64_t idx = 0, seen = 0;
    size_t n = 0;
    while ((got = rtrace_next(tr, &step, err, errlen)) == 1) {
        if (!(p->fit_all || idx++ % 2 == 1)) continue;
        for (int t = 0; t < step.n_tok; t++, seen++) {
            size_t at = n < cap ? n++ : (size_t)(ms_rng_next(&rng) % (seen + 1));
            if (at >= cap) continue;
            for (int l = 0; l < L; l++)
                for (int j = 0; j < K; j++) {
                    int32_t x = step.ids[(size_t)l * step.layer_stride + (size_t)t * K + j];
                    keep[at * L * K + (size_t)l * K + j] = x < 0 ? 0xFFFFu : (uint16_t)x;
                }
        }
    }
    if (got < 0) goto out;
    for (int pass = 0; any_wants(sims, n_cells, pass, p->min_steps); pass++) {
        for (size_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
        for (size_t i = n - 1; i > 0; i--) {
            size_t j = (size_t)(ms_rng_next(&rng) % (i + 1));
            uint32_t v = perm[i];
            perm[i] = perm[j];
            perm[j] = v;
        }
        for (size_t at = 0; at < n; at += CHUNK) {
            int m = n - at < CHUNK ? (int)(n - at) : CHUNK;
            for (int t = 0; t < m; t++) {
                const uint16_t *src = keep + (size_t)perm[at + t] * L * K;
                for (int l = 0; l < L; l++)
                    for (int j = 0; j < K; j++) {
                        uint16_t x = src[(size_t)l * K + j];
                        chunk[((size_t)l * m + t) * K + j] = x == 0xFFFFu ? -1 : x;
                    }
            }
            for (int c = 0; c < n_cells; c++)
                if (wants(sims, c, pass, p->min_steps)) psim_feed(sims[c], chunk, m, 0);
        }
    }
    rc = 0;
out:
    free(keep);
    free(perm);
    free(chunk);
    return rc;
}

int psim_run(const struct psim_run_params *p, const int *devs, int n_devs,
             const enum plc_policy *pols, int n_pols, struct psim_cell *cells,
             struct psim_summary *sum, char *err, size_t errlen)
{
    struct rtrace_reader *tr = NULL;
    struct rstats *st = NULL;
    struct psim **sims = NULL;
    double *flops = NULL;
    float *coact = NULL;
    int rc = -1, n_cells = n_devs * n_pols;
    memset(sum, 0, sizeof *sum);
    memset(cells, 0, sizeof *cells * (size_t)n_cells);
    if (p->tokens_per_dev < 1 || p->min_steps < 1)
        return ms_errf(err, errlen, "simulator: tokens per device and steps must be >= 1");
    if (rtrace_open(p->trace, &tr, err, errlen) != 0) return -1;
    const struct rtrace_info *in = rtrace_get_info(tr);
    struct plc_model md = {.n_layer = in->n_layer, .n_expert = in->n_expert, .top_k = in->top_k,
                           .d_model = in->d_model, .expert_width = in->expert_width,
                           .n_group = in->n_group,
                           .expert_group = in->n_group > 0 ? in->expert_group : NULL};
    snprintf(sum->model, sizeof sum->model, "%s", in->model);
    sum->n_layer = in->n_layer;
    sum->n_expert = in->n_expert;
    sum->top_k = in->top_k;
    sum->d_model = in->d_model;
    sum->n_group = in->n_group;
    struct rstats_config rcfg = {.n_layer = in->n_layer, .n_expert = in->n_expert,
                                 .top_k = in->top_k, .d_model = in->d_model,
                                 .expert_width = in->expert_width, .coact = true};
    if (rstats_create(&rcfg, &st, err, errlen) != 0) goto out;

    /* 1. Statistics from the fit steps. */
    struct rtrace_step step;
    int got;
    uint64_t idx = 0;
    while ((got = rtrace_next(tr, &step, err, errlen)) == 1) {
        bool fit = p->fit_all || idx % 2 == 0, eval = p->fit_all || idx % 2 == 1;
        if (fit) {
            rstats_add(st, step.ids, step.n_tok, step.layer_stride);
            sum->fit_tokens += (uint64_t)step.n_tok;
        }
        if (eval) sum->eval_tokens += (uint64_t)step.n_tok;
        idx++;
    }
    if (got < 0) goto out;
    if (sum->eval_tokens == 0 || sum->fit_tokens == 0) {
        ms_errf(err, errlen, "%s: %llu steps: too few to fit and evaluate a placement%s",
                p->trace, (unsigned long long)idx, p->fit_all ? "" : " (use --fit all)");
        goto out;
    }
    size_t L = (size_t)in->n_layer, E = (size_t)in->n_expert;
    flops = malloc(sizeof(double) * L * E);
    coact = malloc(sizeof(float) * L * E * E);
    sims = calloc((size_t)n_cells, sizeof *sims);
    if (!flops || !coact || !sims) {
        ms_errf(err, errlen, "out of memory for the fit statistics");
        goto out;
    }
    for (size_t l = 0; l < L; l++) {
        rstats_expert_flops(st, (int)l, flops + l * E);
        rstats_coact(st, (int)l, coact + l * E * E);
    }
    struct plc_stats pst = {.flops = flops, .coact = coact};

    /* 2. A placement per (devices, policy). */
    double *dev_load = NULL;
    for (int i = 0; i < n_devs; i++)
        for (int j = 0; j < n_pols; j++) {
            struct psim_cell *c = &cells[i * n_pols + j];
            int N = devs[i];
            struct plc_params pp = {.policy = pols[j], .n_dev = N,
                                    .redundant = p->redundant >= 0 ? p->redundant
                                                 : pols[j] == PLC_POLICY_EPLB
                                                     ? p->replicas_per_dev * N
                                                     : 0,
                                    .slots_per_dev = p->slots_per_dev, .c2r_bound = p->c2r_bound,
                                    .n_nodes = p->hier && p->hier[j] ? p->nodes : 0};
            c->redundant = pp.redundant;
            struct plc_map map;
            double t0 = ms_now();
            if (plc_compute(&md, &pp, &pst, &map, c->why, sizeof c->why) != 0) continue;
            c->place_ms = (ms_now() - t0) * 1e3;
            free(dev_load);
            dev_load = malloc(sizeof(double) * (size_t)N);
            double pi = 0.0;
            for (size_t l = 0; dev_load && l < L; l++) {
                plc_device_load(&map, (int)l, flops + l * E, dev_load);
                double mx = 0.0, tot = 0.0;
                for (int d = 0; d < N; d++) {
                    mx = dev_load[d] > mx ? dev_load[d] : mx;
                    tot += dev_load[d];
                }
                pi += tot > 0 ? mx / (tot / N) / (double)L : 0.0;
            }
            c->predicted_imbalance = pi;
            struct psim_config sc = {.batch_tokens = p->tokens_per_dev * N,
                                     .act_bytes = p->act_bytes > 0 ? p->act_bytes : 2,
                                     .weight_bytes = p->weight_bytes > 0 ? p->weight_bytes : 2,
                                     .nodes = p->nodes, .link_gbps = p->link_gbps,
                                     .link_latency_us = p->link_latency_us,
                                     .link_efficiency = p->link_efficiency > 0 ? p->link_efficiency
                                                                               : 1.0,
                                     .rounds_per_layer = p->rounds_per_layer};
            int prc = psim_create(&md, &map, &sc, &sims[i * n_pols + j], c->why, sizeof c->why);
            plc_map_free(&map);
            c->ok = prc == 0;
        }
    free(dev_load);

    /* 3. Replay the evaluation tokens until every simulator has its steps (and all of them). */
    if (p->trace_order) {
        for (int pass = 0; any_wants(sims, n_cells, pass, p->min_steps); pass++) {
            if (rtrace_rewind(tr, err, errlen) != 0) goto out;
            idx = 0;
            while ((got = rtrace_next(tr, &step, err, errlen)) == 1) {
                if (p->fit_all || idx++ % 2 == 1)
                    for (int c = 0; c < n_cells; c++)
                        if (wants(sims, c, pass, p->min_steps))
                            psim_feed(sims[c], step.ids, step.n_tok, step.layer_stride);
            }
            if (got < 0) goto out;
        }
    } else if (replay_shuffled(p, tr, in, sims, n_cells, sum, err, errlen) != 0) {
        goto out;
    }
    for (int c = 0; c < n_cells; c++)
        if (sims[c]) psim_result(sims[c], &cells[c].r);
    rc = 0;
out:
    for (int c = 0; sims && c < n_cells; c++) psim_free(sims[c]);
    free(sims);
    free(flops);
    free(coact);
    rstats_free(st);
    rtrace_close(tr);
    return rc;
}
