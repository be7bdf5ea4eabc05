/* Placement in the engine: greedy outputs and logits are identical (1e-6) under every policy
 * (contiguous, mohge, eplb and c2r with replicas) on 1, 2 and 4 CPU devices and on staged
 * devices (the layout of GPUs: replicas are uploaded copies) for the fixture models; a live
 * rebalance every few steps in the middle of 16 concurrent generations (eplb, c2r and a
 * contiguous map in turn, through the scheduler's after-step hook) changes no output and drops
 * no request; the routing capture agrees with the engine's counters; bad maps are refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "placement/placement.h"
#include "placement/rebalance.h"
#include "routing/route_stats.h"
#include "scheduler.h"
#include "test.h"

#define PROMPT 24
#define GREEDY 8

/* Skewed per-expert loads and a random co-activation matrix (deterministic). */
static void fake_stats(const struct plc_model *md, double *flops, float *coact)
{
    uint32_t x = 777;
    int E = md->n_expert;
    for (int l = 0; l < md->n_layer; l++)
        for (int e = 0; e < E; e++) {
            x = x * 1664525u + 1013904223u;
            flops[(size_t)l * E + e] = 1e6 / (1.0 + (double)((e * 5 + l) % E)) + (x >> 20);
            for (int f = 0; f <= e; f++) {
                x = x * 1664525u + 1013904223u;
                float v = e == f ? 0.0f : (float)(x >> 16);
                coact[((size_t)l * E + e) * E + f] = coact[((size_t)l * E + f) * E + e] = v;
            }
        }
}

static struct engine *make_engine(const struct model *m, int n_dev, enum engine_backend be,
                                  const struct plc_map *map, enum engine_rstats rs, int max_seqs)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = be;
    ep.n_devices = n_dev;
    ep.n_threads = n_dev;
    ep.max_seqs = max_seqs;
    ep.max_batch_tokens = 128;
    ep.max_model_len = 128;
    ep.map = map;
    ep.routing_stats = rs;
    ep.stats_half_life = 256;
    ep.capture_routing = true;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

/* Prefill logits of the prompt and the greedy continuation. */
static int run(struct engine *e, const int32_t *prompt, float *logits, int32_t *greedy)
{
    const struct model_desc *md = &engine_model(e)->desc;
    struct kv_seq seq;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &seq) != 0) return -1;
    struct engine_item it = {.kv = &seq, .tokens = prompt, .n_tokens = PROMPT, .pos = 0,
                             .n_logits = PROMPT, .logits = logits};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    float *last = malloc(sizeof(float) * (size_t)md->vocab);
    memcpy(last, logits + (size_t)(PROMPT - 1) * md->vocab, sizeof(float) * (size_t)md->vocab);
    for (int g = 0; g < GREEDY && rc == 0; g++) {
        int best = 0;
        for (int v = 1; v < md->vocab; v++) best = last[v] > last[best] ? v : best;
        greedy[g] = best;
        struct engine_item d = {.kv = &seq, .tokens = &greedy[g], .n_tokens = 1,
                                .pos = PROMPT + g, .n_logits = 1, .logits = last};
        rc = engine_step(e, &d, 1, err, sizeof err);
    }
    if (rc) fprintf(stderr, "step: %s\n", err);
    free(last);
    engine_seq_free(e, &seq);
    return rc;
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        num = d > num || d != d ? d : num;
        den = fabs((double)b[i]) > den ? fabs((double)b[i]) : den;
    }
    return den > 0 ? num / den : num;
}

static struct model *load_fixture(const char *tests, const char *name)
{
    char dir[512], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    if (model_load(dir, &lo, &m, err, sizeof err) != 0) CHECKF(0, "%s: %s", name, err);
    return m;
}

static void test_policies(const char *tests, const char *name)
{
    char err[MS_ERR_LEN];
    struct model *m = load_fixture(tests, name);
    if (!m) return;
    const struct model_desc *md = &m->desc;
    struct plc_model pm;
    plc_model_from_desc(md, &pm);
    size_t LE = (size_t)pm.n_layer * pm.n_expert;
    double *flops = malloc(sizeof(double) * LE);
    float *coact = malloc(sizeof(float) * LE * pm.n_expert);
    size_t nl = (size_t)PROMPT * md->vocab;
    float *base = malloc(sizeof(float) * nl), *got = malloc(sizeof(float) * nl);
    int32_t prompt[PROMPT], g0[GREEDY], g1[GREEDY];
    for (int t = 0; t < PROMPT; t++) prompt[t] = (int32_t)(1 + (t * 131 + 7) % (md->vocab - 1));
    fake_stats(&pm, flops, coact);
    struct plc_stats st = {.flops = flops, .coact = coact};
    struct engine *e = make_engine(m, 1, ENGINE_BACKEND_CPU, NULL, ENGINE_RSTATS_OFF, 1);
    CHECK(e && run(e, prompt, base, g0) == 0);
    engine_free(e);

    int runs = 0;
    for (int N = 1; N <= 4; N *= 2)
        for (int p = 0; p < PLC_N_POLICIES; p++)
            for (int staged = 0; staged < 2; staged++) {
                if (staged && N != 2) continue;
                struct plc_params pp = {.policy = (enum plc_policy)p, .n_dev = N,
                                        .redundant = p >= PLC_POLICY_EPLB ? N - (N > 1 ? 0 : 1)
                                                                          : 0};
                if ((long)pp.redundant > (long)pm.n_expert * (N - 1))
                    pp.redundant = pm.n_expert * (N - 1);
                struct plc_map map;
                if (plc_compute(&pm, &pp, &st, &map, err, sizeof err) != 0) {
                    /* only mohge may be refused: a model without groups */
                    CHECKF(p == PLC_POLICY_MOHGE && strstr(err, "groups"), "%s %s N=%d: %s", name,
                           plc_policy_name(pp.policy), N, err);
                    continue;
                }
                e = make_engine(m, N, staged ? ENGINE_BACKEND_CPU_STAGED : ENGINE_BACKEND_CPU,
                                &map, ENGINE_RSTATS_OFF, 1);
                CHECKF(e != NULL, "%s %s N=%d", name, plc_policy_name(pp.policy), N);
                if (e) {
                    CHECK(run(e, prompt, got, g1) == 0);
                    double r = rel_err(got, base, nl);
                    CHECKF(r <= 1e-6, "%s %s N=%d R=%d%s: logits differ by %.3g", name,
                           plc_policy_name(pp.policy), N, pp.redundant, staged ? " staged" : "", r);
                    CHECKF(memcmp(g0, g1, sizeof g0) == 0, "%s %s N=%d: greedy differs", name,
                           plc_policy_name(pp.policy), N);
                    runs++;
                    engine_free(e);
                }
                plc_map_free(&map);
            }
    CHECK(runs >= 10);
    free(flops);
    free(coact);
    free(base);
    free(got);
    model_free(m);
}

/* --- live rebalance ------------------------------------------------------------------------ */

#define N_REQ 16
#define MAX_TOK 12

struct hook {
    struct rebal *eplb, *c2r;
    struct plc_map flat; /* contiguous with the same replicas */
    int steps, done, failed;
};

static void after_step(void *ctx, struct engine *e)
{
    struct hook *h = ctx;
    char err[MS_ERR_LEN];
    if (++h->steps % 3 != 0) return;
    int which = (h->steps / 3) % 3, rc;
    if (which == 0)
        rc = rebal_now(h->eplb, err, sizeof err) == 1 ? 0 : -1;
    else if (which == 1)
        rc = rebal_now(h->c2r, err, sizeof err) == 1 ? 0 : -1;
    else
        rc = engine_set_placement(e, &h->flat, err, sizeof err);
    if (rc == 0)
        h->done++;
    else {
        h->failed++;
        fprintf(stderr, "rebalance: %s\n", err);
    }
}

/* 16 requests of different prompt lengths at once; their tokens into out. */
static void generate(struct engine *e, struct hook *h, int32_t out[N_REQ][MAX_TOK], int *finished)
{
    char err[MS_ERR_LEN];
    int vocab = engine_model(e)->desc.vocab;
    struct sched_params sp = {.max_num_seqs = N_REQ, .max_num_batched_tokens = 128,
                              .after_step = h ? after_step : NULL, .after_step_ctx = h};
    struct sched *s = NULL;
    if (sched_create(e, &sp, &s, err, sizeof err) != 0) {
        CHECKF(0, "%s", err);
        return;
    }
    struct sched_req *r[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        int32_t prompt[64];
        int n = 3 + (i * 13) % 60;
        for (int t = 0; t < n; t++) prompt[t] = (int32_t)(1 + (i * 977 + t * 131) % (vocab - 1));
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = MAX_TOK;
        p.ignore_eos = true;
        p.smp.temperature = 0;
        r[i] = sched_req_create(prompt, n, &p, err, sizeof err);
        CHECK(r[i] && sched_submit(s, r[i], err, sizeof err) == 0);
    }
    for (int guard = 0; guard < 10000 && sched_has_work(s); guard++) sched_step(s);
    *finished = 0;
    for (int i = 0; i < N_REQ; i++) {
        sched_req_lock(r[i]);
        *finished += r[i]->out.finish == SCHED_FINISH_LENGTH && r[i]->out.n_tokens == MAX_TOK;
        memcpy(out[i], r[i]->out.tokens, sizeof(int32_t) * MAX_TOK);
        sched_req_unlock(r[i]);
        sched_req_release(r[i]);
    }
    sched_free(s);
}

static void test_rebalance(const char *tests, const char *name, int N,
                           enum engine_backend backend)
{
    char err[MS_ERR_LEN];
    struct model *m = load_fixture(tests, name);
    if (!m) return;
    struct plc_model pm;
    plc_model_from_desc(&m->desc, &pm);
    int R = N;
    /* Start from eplb on widths alone (no traffic yet). */
    struct plc_params pp = {.policy = PLC_POLICY_EPLB, .n_dev = N, .redundant = R};
    struct plc_map start;
    if (plc_compute(&pm, &pp, NULL, &start, err, sizeof err) != 0) {
        CHECKF(0, "%s", err);
        model_free(m);
        return;
    }
    int32_t ref[N_REQ][MAX_TOK], out[N_REQ][MAX_TOK];
    int fin_ref = 0, fin = 0;
    struct engine *e = make_engine(m, 1, ENGINE_BACKEND_CPU, NULL, ENGINE_RSTATS_OFF, N_REQ);
    if (e) generate(e, NULL, ref, &fin_ref);
    engine_free(e);
    CHECK(fin_ref == N_REQ);

    e = make_engine(m, N, backend, &start, ENGINE_RSTATS_FULL, N_REQ);
    struct hook h = {0};
    struct rebal_params rp = {.plc = {.policy = PLC_POLICY_EPLB, .redundant = R}};
    CHECK(e && rebal_create(e, &rp, &h.eplb, err, sizeof err) == 0);
    rp.plc.policy = PLC_POLICY_C2R;
    CHECK(e && rebal_create(e, &rp, &h.c2r, err, sizeof err) == 0);
    pp.policy = PLC_POLICY_CONTIGUOUS;
    CHECK(plc_compute(&pm, &pp, NULL, &h.flat, err, sizeof err) == 0);
    if (e && h.eplb && h.c2r) {
        generate(e, &h, out, &fin);
        CHECKF(fin == N_REQ, "%s N=%d: %d of %d requests finished", name, N, fin, N_REQ);
        CHECKF(memcmp(ref, out, sizeof ref) == 0, "%s N=%d: outputs changed across rebalances",
               name, N);
        CHECKF(h.done >= 3 && h.failed == 0, "%d rebalances, %d failed", h.done, h.failed);
        const struct engine_stats *es = engine_get_stats(e);
        CHECK(es->rebalances == (uint64_t)h.done && es->rebalance_moves > 0);
        struct rebal_stats rs;
        rebal_get_stats(h.eplb, &rs);
        CHECK(rs.count >= 1 && rs.total_s >= 0 && rs.failures == 0);
        /* The statistics saw every token and agree with the engine's own row counters. */
        const struct rstats *st = engine_routing_stats(e);
        uint64_t rows = 0, rows_stats = 0;
        const uint64_t *tot = rstats_expert_rows_total(st);
        for (int l = 0; l < pm.n_layer; l++)
            for (int x = 0; x < pm.n_expert; x++) {
                int ml = 0;
                for (int k = 0, c = 0; k < m->desc.n_layer; k++)
                    if (m->desc.layer_is_moe[k] && c++ == l) ml = k;
                rows += es->expert_rows[(size_t)ml * m->desc.n_expert + x];
                rows_stats += tot[(size_t)l * pm.n_expert + x];
            }
        CHECKF(rows == rows_stats && rows > 0, "rows %llu vs stats %llu",
               (unsigned long long)rows, (unsigned long long)rows_stats);
        CHECK(rstats_tokens_seen(st) == es->tokens);
        /* The last step's routing is there and in range. */
        const struct engine_routing *rt = engine_last_routing(e);
        CHECK(rt && rt->n_tok >= 1 && rt->n_layer == pm.n_layer);
        for (int t = 0; rt && t < rt->n_tok; t++)
            for (int j = 0; j < rt->top_k; j++)
                CHECK(rt->ids[(size_t)t * rt->top_k + j] >= -1 &&
                      rt->ids[(size_t)t * rt->top_k + j] < pm.n_expert);
        /* A map of another shape is refused and the engine keeps going. */
        struct plc_map other;
        struct plc_params op = {.policy = PLC_POLICY_CONTIGUOUS, .n_dev = N, .redundant = R + 1};
        if (plc_compute(&pm, &op, NULL, &other, err, sizeof err) == 0) {
            CHECK(engine_set_placement(e, &other, err, sizeof err) != 0 && strstr(err, "slots"));
            plc_map_free(&other);
        }
    }
    /* c2r rebalancing without co-activation counts is refused, naming the flag. */
    struct engine *e2 = make_engine(m, N, ENGINE_BACKEND_CPU, &start, ENGINE_RSTATS_LOAD, 1);
    struct rebal *bad = NULL;
    CHECK(e2 && rebal_create(e2, &rp, &bad, err, sizeof err) != 0 &&
          strstr(err, "--routing-stats full"));
    engine_free(e2);
    e2 = make_engine(m, N, ENGINE_BACKEND_CPU, &start, ENGINE_RSTATS_OFF, 1);
    rp.plc.policy = PLC_POLICY_EPLB;
    CHECK(e2 && rebal_create(e2, &rp, &bad, err, sizeof err) != 0 && strstr(err, "--routing-stats"));
    engine_free(e2);
    rebal_free(h.eplb);
    rebal_free(h.c2r);
    plc_map_free(&h.flat);
    plc_map_free(&start);
    engine_free(e);
    model_free(m);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    test_policies(tests, "mohge_tiny");
    test_policies(tests, "mixtral");
    test_policies(tests, "qwen2_moe");
    test_policies(tests, "deepseek_v2_group");
    test_rebalance(tests, "mohge_tiny", 4, ENGINE_BACKEND_CPU);
    test_rebalance(tests, "mixtral", 2, ENGINE_BACKEND_CPU_STAGED);
    return test_done("test_placement_engine");
}
