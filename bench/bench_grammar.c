/* bench_grammar: what structured output costs per token. For a tokenizer, builds the
 * vocabulary trie, compiles a JSON Schema grammar and runs a simulated constrained generation
 * (mask, then one allowed token drawn at random, accepted; a fresh matcher when the output is
 * complete), timing grm_mask and grm_accept at every step. With a model folder it also times
 * the model's own decode step (one sequence, one token) to put the mask next to it.
 *   bench_grammar --model models/mohge-small [--tokenizer PATH/tokenizer.json ...]
 *                 [--steps N]
 * Prints one line per tokenizer: vocabulary, trie nodes, mask mean / p50 / p99 (µs), accept
 * mean (µs), and the mask's share of a decode step when a model was given. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "grammar.h"
#include "model.h"
#include "tokenizer.h"

static const char SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"},\"name\":{\"type\":"
    "\"string\",\"maxLength\":24},\"email\":{\"type\":\"string\",\"maxLength\":40},\"age\":{"
    "\"type\":\"integer\"},\"city\":{\"enum\":[\"Lagos\",\"Tokyo\",\"Mumbai\",\"Paris\"]},"
    "\"active\":{\"type\":\"boolean\"},\"score\":{\"type\":\"number\"},\"tags\":{\"type\":"
    "\"array\",\"items\":{\"type\":\"string\",\"maxLength\":12},\"maxItems\":4},\"address\":{"
    "\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\"},\"zip\":{\"type\":"
    "\"string\",\"pattern\":\"^[0-9]{5}$\"}},\"required\":[\"street\"]}},\"required\":[\"id\","
    "\"name\",\"age\",\"tags\"]}";

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double decode_step_ms(const char *model_dir)
{
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct engine *e = NULL;
    if (model_load(model_dir, NULL, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        return -1;
    }
    struct engine_params ep;
    engine_params_default(&ep);
    ep.max_seqs = 1;
    ep.max_batch_tokens = 64;
    double ms = -1;
    float *logits = malloc(sizeof *logits * (size_t)m->desc.vocab);
    struct kv_seq s;
    if (!logits || engine_create(m, &ep, &e, err, sizeof err) != 0 || engine_seq_init(e, &s)) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        goto out;
    }
    int32_t tok = 1;
    int steps = 64;
    double t0 = 0;
    for (int i = 0; i < steps + 8; i++) {
        if (i == 8) t0 = ms_now();
        struct engine_item it = {.kv = &s, .tokens = &tok, .n_tokens = 1, .pos = i,
                                 .n_logits = 1, .logits = logits};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "bench_grammar: %s\n", err);
            goto out;
        }
        tok = (tok * 7 + 3) % m->desc.vocab;
    }
    ms = (ms_now() - t0) * 1e3 / steps;
    engine_seq_free(e, &s);
out:
    engine_free(e);
    free(logits);
    model_free(m);
    return ms;
}

static void bench(const char *tok_path, const char *cfg_path, int steps, double step_ms)
{
    char err[MS_ERR_LEN], kw[64];
    struct tokenizer *tok = NULL;
    if (tok_load(tok_path, cfg_path, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        return;
    }
    int vocab = tok_vocab_size(tok);
    int32_t eos = tok_eos_id(tok);
    double t0 = ms_now();
    struct grm_vocab *v = grm_vocab_build(tok, vocab, &eos, eos >= 0 ? 1 : 0);
    double build_ms = (ms_now() - t0) * 1e3;
    struct grm_grammar *g = NULL;
    t0 = ms_now();
    if (!v || grm_compile(GRM_JSON_SCHEMA, SCHEMA, v, &g, err, sizeof err, kw, sizeof kw) != 0) {
        fprintf(stderr, "bench_grammar: %s\n", v ? err : "out of memory");
        grm_vocab_free(v);
        tok_free(tok);
        return;
    }
    double compile_ms = (ms_now() - t0) * 1e3;
    float *row = malloc(sizeof *row * (size_t)vocab);
    double *mask_us = malloc(sizeof *mask_us * (size_t)steps);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)vocab);
    struct grm_matcher *m = grm_matcher_create(g);
    double accept_sum = 0;
    long allowed_sum = 0;
    uint64_t x = 12345;
    int outputs = 0;
    for (int i = 0; i < steps && m && row && mask_us && allowed; i++) {
        for (int k = 0; k < vocab; k++) row[k] = 0.0f;
        t0 = ms_now();
        int n = grm_mask(m, row);
        mask_us[i] = (ms_now() - t0) * 1e6;
        int na = 0;
        for (int k = 0; k < vocab; k++)
            if (row[k] == 0.0f && k != eos) allowed[na++] = k;
        allowed_sum += n;
        if (na == 0 || grm_must_end(m) || (grm_can_end(m) && (x >> 60) == 0)) {
            grm_matcher_free(m); /* a finished output: start the next */
            m = grm_matcher_create(g);
            outputs++;
            continue;
        }
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int32_t t = allowed[(x >> 33) % (uint64_t)na];
        t0 = ms_now();
        if (grm_accept(m, t) != 0) fprintf(stderr, "bench_grammar: an allowed token was refused\n");
        accept_sum += (ms_now() - t0) * 1e6;
    }
    qsort(mask_us, (size_t)steps, sizeof *mask_us, cmp_double);
    double mean = 0;
    for (int i = 0; i < steps; i++) mean += mask_us[i];
    mean /= steps;
    printf("%-40s vocab %6d  trie %7d nodes (built in %.0f ms)  grammar %.1f ms  mask mean "
           "%.1f us p50 %.1f p99 %.1f  accept %.1f us  allowed/step %.0f  outputs %d",
           tok_path, vocab, grm_vocab_nodes(v), build_ms, compile_ms, mean,
           mask_us[steps / 2], mask_us[steps * 99 / 100], accept_sum / steps,
           (double)allowed_sum / steps, outputs);
    if (step_ms > 0) printf("  = %.1f%% of a %.2f ms decode step", 100.0 * mean / 1e3 / step_ms, step_ms);
    printf("\n");
    grm_matcher_free(m);
    free(row);
    free(mask_us);
    free(allowed);
    grm_release(g);
    grm_vocab_free(v);
    tok_free(tok);
}

int main(int argc, char **argv)
{
    const char *model = NULL;
    const char *toks[8];
    int n_toks = 0, steps = 2000;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) model = argv[++i];
        else if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc && n_toks < 8) toks[n_toks++] = argv[++i];
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_grammar [--model DIR] [--tokenizer FILE]... [--steps N]\n");
            return 2;
        }
    }
    if (steps < 10) steps = 10;
    double step_ms = model ? decode_step_ms(model) : -1;
    if (model) {
        char tp[4096], cp[4096];
        snprintf(tp, sizeof tp, "%s/tokenizer.json", model);
        snprintf(cp, sizeof cp, "%s/tokenizer_config.json", model);
        bench(tp, cp, steps, step_ms);
    }
    for (int i = 0; i < n_toks; i++) bench(toks[i], NULL, steps, step_ms);
    return 0;
}
