/* Placement benchmark (not a test): decode throughput with CPU virtual devices under each
 * placement policy, and what the engine measured in the same run: per-layer device imbalance
 * over the run, the share of expert rows and of (token, device) sends that crossed devices, and
 * all-to-all bytes per token. The statistics eplb and c2r place by come from a warm-up run of
 * the same workload (routing statistics in the engine), as a live rebalance would have them.
 * Greedy outputs must be identical under every policy (checked, reported).
 *
 *   bench_placement MODEL [--devices 4] [--batch 16] [--context 64] [--steps 32]
 *                   [--redundant R (default: devices)] [--threads N] [--text FILE]
 *                   [--dispatch tokens|rows (default tokens)]
 *
 * Prompts are slices of --text (tokenized) when given, else random tokens. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "placement/placement.h"
#include "routing/route_stats.h"
#include "tokenizer.h"

struct opts {
    const char *model, *text;
    int devices, batch, context, steps, redundant, threads;
    enum engine_dispatch dispatch;
};

struct run {
    double tok_s, imbalance, cross_rows, cross_sends, bytes_tok;
    int32_t *out; /* (batch, steps) greedy tokens */
};

static int32_t *prompts(const struct model *m, const struct opts *o)
{
    int32_t *p = malloc(sizeof(int32_t) * (size_t)o->batch * o->context);
    if (!p) return NULL;
    int n = 0;
    if (o->text) {
        FILE *f = fopen(o->text, "rb");
        char *buf = NULL;
        long len = 0;
        if (f && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
            (buf = malloc((size_t)len + 1)) && fread(buf, 1, (size_t)len, f) == (size_t)len)
            n = tok_encode(m->tok, buf, (size_t)len, false, p, o->batch * o->context);
        if (f) fclose(f);
        free(buf);
    }
    uint32_t x = 99;
    for (int i = n > 0 ? n : 0; i < o->batch * o->context; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = n > 0 ? p[i % n] : (int32_t)(1 + (x >> 8) % (uint32_t)(m->desc.vocab - 1));
    }
    return p;
}

/* The workload: batch sequences prefilled with context tokens, then steps greedy decode steps
 * of one token each, timed. */
static int workload(struct engine *e, const struct opts *o, const int32_t *prompt, int32_t *out,
                    double *seconds)
{
    const struct model_desc *md = &engine_model(e)->desc;
    int B = o->batch, V = md->vocab, rc = -1;
    char err[MS_ERR_LEN];
    struct kv_seq *seq = calloc((size_t)B, sizeof *seq);
    struct engine_item *it = calloc((size_t)B, sizeof *it);
    float *logits = malloc(sizeof(float) * (size_t)B * V);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B);
    if (!seq || !it || !logits || !tok) goto out;
    for (int b = 0; b < B; b++) {
        engine_seq_init(e, &seq[b]);
        it[b] = (struct engine_item){.kv = &seq[b], .tokens = prompt + (size_t)b * o->context,
                                     .n_tokens = o->context, .n_logits = 1,
                                     .logits = logits + (size_t)b * V};
        if (engine_step(e, &it[b], 1, err, sizeof err) != 0) goto fail;
    }
    double t0 = ms_now();
    for (int s = 0; s < o->steps; s++) {
        for (int b = 0; b < B; b++) {
            const float *l = logits + (size_t)b * V;
            int best = 0;
            for (int v = 1; v < V; v++) best = l[v] > l[best] ? v : best;
            tok[b] = best;
            if (out) out[(size_t)b * o->steps + s] = best;
            it[b] = (struct engine_item){.kv = &seq[b], .tokens = &tok[b], .n_tokens = 1,
                                         .pos = o->context + s, .n_logits = 1,
                                         .logits = logits + (size_t)b * V};
        }
        if (engine_step(e, it, B, err, sizeof err) != 0) goto fail;
    }
    *seconds = ms_now() - t0;
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "bench_placement: %s\n", err);
out:
    for (int b = 0; seq && b < B; b++) engine_seq_free(e, &seq[b]);
    free(seq);
    free(it);
    free(logits);
    free(tok);
    return rc;
}

static struct engine *make(const struct model *m, const struct opts *o, const struct plc_map *map,
                           bool stats)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = o->devices;
    ep.n_threads = o->threads;
    ep.dispatch = o->dispatch;
    ep.max_seqs = o->batch;
    ep.max_batch_tokens = o->context > o->batch ? o->context : o->batch;
    ep.max_model_len = o->context + o->steps + 1;
    ep.map = map;
    ep.routing_stats = stats ? ENGINE_RSTATS_FULL : ENGINE_RSTATS_OFF;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "bench_placement: %s\n", err);
    return e;
}

/* What the engine measured: per-layer imbalance over the whole run (mean over layers), rows and
 * sends that crossed devices over all rows, exchange bytes per decoded token. */
static void measure(struct engine *e, const struct opts *o, double seconds, struct run *r)
{
    const struct engine_stats *es = engine_get_stats(e);
    int N = o->devices, L = es->n_moe_layers;
    double imb = 0.0;
    for (int l = 0; l < L; l++) {
        double mx = 0.0, tot = 0.0;
        for (int d = 0; d < N; d++) {
            double v = es->layer_dev_flops[(size_t)l * N + d];
            mx = v > mx ? v : mx;
            tot += v;
        }
        imb += tot > 0 ? mx / (tot / N) / L : 0.0;
    }
    uint64_t rows = 0, away = 0, sends = 0;
    double bytes = 0.0;
    const unsigned long long *cb = engine_comm_bytes(e);
    for (int d = 0; d < N; d++) {
        rows += es->dev_routed_rows[d];
        away += es->dev_rows_away[d];
        sends += es->dev_tokens_away[d];
        for (int q = 0; q < N; q++) bytes += (double)cb[(size_t)d * N + q];
    }
    r->tok_s = (double)o->batch * o->steps / seconds;
    r->imbalance = imb;
    r->cross_rows = rows ? (double)away / (double)rows : 0.0;
    r->cross_sends = rows ? (double)sends / (double)rows : 0.0;
    r->bytes_tok = bytes / ((double)o->batch * (o->context + o->steps));
}

int main(int argc, char **argv)
{
    struct opts o = {.devices = 4, .batch = 16, .context = 64, .steps = 32, .redundant = -1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-' && !o.model) o.model = a;
        else if (strcmp(a, "--devices") == 0 && v) o.devices = atoi(argv[++i]);
        else if (strcmp(a, "--batch") == 0 && v) o.batch = atoi(argv[++i]);
        else if (strcmp(a, "--context") == 0 && v) o.context = atoi(argv[++i]);
        else if (strcmp(a, "--steps") == 0 && v) o.steps = atoi(argv[++i]);
        else if (strcmp(a, "--redundant") == 0 && v) o.redundant = atoi(argv[++i]);
        else if (strcmp(a, "--threads") == 0 && v) o.threads = atoi(argv[++i]);
        else if (strcmp(a, "--text") == 0 && v) o.text = argv[++i];
        else if (strcmp(a, "--dispatch") == 0 && v && engine_dispatch_parse(v, &o.dispatch) == 0) i++;
        else {
            fprintf(stderr, "usage: bench_placement MODEL [--devices N] [--batch B] [--context C] "
                            "[--steps S] [--redundant R] [--threads T] [--text FILE] "
                            "[--dispatch tokens|rows]\n");
            return 2;
        }
    }
    if (!o.model || o.devices < 1 || o.devices > 64 || o.batch < 1 || o.context < 1 || o.steps < 1) {
        fprintf(stderr, "bench_placement: a model folder and positive sizes are needed\n");
        return 2;
    }
    if (o.redundant < 0) o.redundant = o.devices;
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    if (model_load(o.model, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_placement: %s\n", err);
        return 1;
    }
    int rc = 1;
    int32_t *prompt = prompts(m, &o);
    struct plc_model pm;
    plc_model_from_desc(&m->desc, &pm);
    size_t L = (size_t)pm.n_layer, E = (size_t)pm.n_expert;
    double *flops = malloc(sizeof(double) * L * E);
    float *coact = malloc(sizeof(float) * L * E * E);
    int32_t *ref = malloc(sizeof(int32_t) * (size_t)o.batch * o.steps);
    int32_t *got = malloc(sizeof(int32_t) * (size_t)o.batch * o.steps);
    if (!prompt || !flops || !coact || !ref || !got || pm.n_layer == 0) goto out;

    /* Warm-up: the statistics the policies place by. */
    struct engine *e = make(m, &o, NULL, true);
    double secs;
    if (!e || workload(e, &o, prompt, ref, &secs) != 0) goto out;
    for (size_t l = 0; l < L; l++) {
        rstats_expert_flops(engine_routing_stats(e), (int)l, flops + l * E);
        rstats_coact(engine_routing_stats(e), (int)l, coact + l * E * E);
    }
    engine_free(e);
    struct plc_stats st = {.flops = flops, .coact = coact};
    printf("model %s: %d MoE layers, %d experts, top-%d; %d CPU devices, batch %d, context %d, %d "
           "decode steps%s, --dispatch %s\n\n",
           o.model, pm.n_layer, pm.n_expert, pm.top_k, o.devices, o.batch, o.context, o.steps,
           o.text ? ", prompts from --text" : ", random prompts", engine_dispatch_name(o.dispatch));
    printf("| policy | replicas | decode tok/s | imbalance | cross rows | token sends | a2a KB/token "
           "| outputs |\n|---|---|---|---|---|---|---|---|\n");
    for (int p = 0; p < PLC_N_POLICIES; p++)
        for (int withr = 0; withr < 2; withr++) {
            int R = withr ? o.redundant : 0;
            if ((withr && (p == PLC_POLICY_CONTIGUOUS || p == PLC_POLICY_MOHGE)) ||
                (!withr && p == PLC_POLICY_EPLB) || (long)R > (long)E * (o.devices - 1))
                continue;
            struct plc_params pp = {.policy = (enum plc_policy)p, .n_dev = o.devices, .redundant = R};
            struct plc_map map;
            if (plc_compute(&pm, &pp, &st, &map, err, sizeof err) != 0) {
                printf("| %s | %d | n/a: %s | | | | | |\n", plc_policy_name(pp.policy), R, err);
                continue;
            }
            e = make(m, &o, &map, false);
            struct run r = {0};
            if (e && workload(e, &o, prompt, got, &secs) == 0) {
                measure(e, &o, secs, &r);
                printf("| %s | %d | %.1f | %.3f | %.1f%% | %.1f%% | %.2f | %s |\n",
                       plc_policy_name(pp.policy), R, r.tok_s, r.imbalance, 100 * r.cross_rows,
                       100 * r.cross_sends, r.bytes_tok / 1024,
                       memcmp(ref, got, sizeof(int32_t) * (size_t)o.batch * o.steps) == 0
                           ? "identical"
                           : "DIFFER");
            }
            engine_free(e);
            plc_map_free(&map);
        }
    rc = 0;
out:
    free(prompt);
    free(flops);
    free(coact);
    free(ref);
    free(got);
    model_free(m);
    return rc;
}
