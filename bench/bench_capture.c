/* The cost of the live collaboration capture: decode tokens/s of the same greedy workload with
 * the engine's routing capture and the reservoir (engine/collab/collab_live.h, what the server
 * runs with --collab-reservoir) on and off, in alternating rounds so that a loaded machine's
 * drift hits both alike.
 *   bench_capture MODEL [--batch 32] [--context 32] [--steps 64] [--rounds 6]
 *                 [--reservoir 4096] [--threads T]
 * Prints each round, the median tok/s of each mode and the slowdown, and the share of the
 * capture-on decode time spent adding to the reservoir (measured directly: on a shared machine
 * the tok/s difference is within the noise). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collab/collab_live.h"
#include "common.h"
#include "engine.h"
#include "model.h"

struct opts {
    const char *model;
    int batch, context, steps, rounds, reservoir, threads;
};

/* batch sequences prefilled with context tokens, then steps greedy decode steps; tok/s of the
 * decode steps, or -1 */
static double add_s, decode_s; /* time in clive_add and in the decode loop, capture-on runs */

static double run(const struct model *m, const struct opts *o, bool capture)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_threads = o->threads;
    ep.max_seqs = o->batch;
    ep.max_batch_tokens = o->context > o->batch ? o->context : o->batch;
    ep.max_model_len = o->context + o->steps + 1;
    ep.capture_routing = capture;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    struct clive *live = NULL;
    int B = o->batch, V = m->desc.vocab;
    struct kv_seq *seq = calloc((size_t)B, sizeof *seq);
    struct engine_item *it = calloc((size_t)B, sizeof *it);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * (o->context + 1));
    float *logits = malloc(sizeof(float) * (size_t)B * V);
    double tok_s = -1.0;
    int L = 0;
    for (int l = 0; l < m->desc.n_layer; l++)
        L += m->desc.layer_is_moe[l];
    if (!seq || !it || !tok || !logits || engine_create(m, &ep, &e, err, sizeof err) != 0 ||
        (capture && clive_create(L, m->desc.n_expert, m->desc.top_k, o->reservoir, 1, &live, err,
                                 sizeof err) != 0)) {
        fprintf(stderr, "bench_capture: %s\n", err);
        goto out;
    }
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < o->context; p++)
            tok[(size_t)b * (o->context + 1) + p] = (b * 31 + p * 7) % V;
        engine_seq_init(e, &seq[b]);
        it[b] = (struct engine_item){.kv = &seq[b],
                                     .tokens = tok + (size_t)b * (o->context + 1),
                                     .n_tokens = o->context,
                                     .pos = 0,
                                     .n_logits = 1,
                                     .logits = logits + (size_t)b * V};
        if (engine_step(e, &it[b], 1, err, sizeof err) != 0) goto fail;
    }
    double t0 = ms_now();
    for (int s = 0; s < o->steps; s++) {
        for (int b = 0; b < B; b++) {
            const float *lg = logits + (size_t)b * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                best = lg[v] > lg[best] ? v : best;
            int32_t *t = tok + (size_t)b * (o->context + 1) + o->context;
            *t = best;
            it[b] = (struct engine_item){.kv = &seq[b],
                                         .tokens = t,
                                         .n_tokens = 1,
                                         .pos = o->context + s,
                                         .n_logits = 1,
                                         .logits = logits + (size_t)b * V};
        }
        if (engine_step(e, it, B, err, sizeof err) != 0) goto fail;
        if (live) {
            double a = ms_now();
            const struct engine_routing *rt = engine_last_routing(e);
            clive_add(live, rt->ids, rt->tags, rt->n_tok, rt->layer_stride);
            add_s += ms_now() - a;
        }
    }
    double dt = ms_now() - t0;
    if (live) decode_s += dt;
    tok_s = (double)B * o->steps / dt;
    goto out;
fail:
    fprintf(stderr, "bench_capture: %s\n", err);
out:
    for (int b = 0; e && seq && b < B; b++)
        engine_seq_free(e, &seq[b]);
    clive_free(live);
    engine_free(e);
    free(seq);
    free(it);
    free(tok);
    free(logits);
    return tok_s;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    struct opts o = {.batch = 32, .context = 32, .steps = 64, .rounds = 6, .reservoir = 4096};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-' && !o.model)
            o.model = a;
        else if (strcmp(a, "--batch") == 0 && v)
            o.batch = atoi(argv[++i]);
        else if (strcmp(a, "--context") == 0 && v)
            o.context = atoi(argv[++i]);
        else if (strcmp(a, "--steps") == 0 && v)
            o.steps = atoi(argv[++i]);
        else if (strcmp(a, "--rounds") == 0 && v)
            o.rounds = atoi(argv[++i]);
        else if (strcmp(a, "--reservoir") == 0 && v)
            o.reservoir = atoi(argv[++i]);
        else if (strcmp(a, "--threads") == 0 && v)
            o.threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_capture MODEL [--batch B] [--context C] [--steps S] "
                            "[--rounds R] [--reservoir N] [--threads T]\n");
            return 2;
        }
    }
    if (!o.model || o.batch < 1 || o.context < 1 || o.steps < 1 || o.rounds < 1 || o.rounds > 64 ||
        o.reservoir < 1) {
        fprintf(stderr, "bench_capture: a model folder and positive sizes are needed\n");
        return 2;
    }
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    if (model_load(o.model, NULL, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_capture: %s\n", err);
        return 1;
    }
    printf("bench_capture %s: batch %d, context %d, %d decode steps, reservoir %d, %d rounds\n",
           o.model, o.batch, o.context, o.steps, o.reservoir, o.rounds);
    double off[64], on[64];
    run(m, &o, false); /* warm-up: page in the weights */
    for (int r = 0; r < o.rounds; r++) {
        /* alternate which goes first */
        if (r % 2 == 0) {
            off[r] = run(m, &o, false);
            on[r] = run(m, &o, true);
        } else {
            on[r] = run(m, &o, true);
            off[r] = run(m, &o, false);
        }
        printf("round %d: off %.1f tok/s, on %.1f tok/s\n", r, off[r], on[r]);
        if (off[r] < 0 || on[r] < 0) {
            model_free(m);
            return 1;
        }
    }
    qsort(off, (size_t)o.rounds, sizeof *off, cmp_double);
    qsort(on, (size_t)o.rounds, sizeof *on, cmp_double);
    double mo = off[o.rounds / 2], mn = on[o.rounds / 2];
    printf("median decode tok/s: capture off %.1f, on %.1f: %+.2f%%\n", mo, mn,
           100.0 * (mn - mo) / mo);
    printf("time in the reservoir (clive_add) during capture-on decoding: %.3f%% (%.2f us a "
           "step)\n",
           100.0 * add_s / decode_s, 1e6 * add_s / ((double)o.rounds * o.steps));
    model_free(m);
    return 0;
}
