/* Speculative decoding benchmark (not a test): decode tokens/s, acceptance and expert reads
 * per generated token with speculation off, with n-gram lookup, a draft model and the
 * checkpoint's MTP module (--methods mtp), for k = 1..4 (fixed) and adaptive k, at several
 * concurrencies, in one run on the scheduler (engine/scheduler.h) without HTTP.
 *
 * For each concurrency C, C requests of the same prompt (each with its own cache_salt, so none
 * shares another's prefill) generate --tokens tokens each (greedy by default; ignore_eos). The
 * prefills run first; the decode phase is timed from the step after the last first token to
 * the end: tok/s = tokens generated in it / its time. Per generated token: "rows" are the
 * token-expert rows the MoE layers computed (top_k x MoE layers without speculation; drafts
 * add theirs) and "experts" the distinct expert matrices they read (engine_stats
 * moe_active_experts, device 0: the weight traffic decode is bound by).
 *
 *   bench_spec MODEL [--prompt-file F] [--tokens 128] [--concurrency 1,8,32] [--k 1,2,3,4]
 *              [--methods ngram,draft,mtp] [--draft DIR] [--draft-quantization none|int8|int4]
 *              [--dtype auto|bfloat16|float32] [--quantization none|int8|int4]
 *              [--threads N] [--temperature T] [--json]
 *
 * The default prompt is repetitive text of the kind n-gram lookup serves (records that repeat
 * their keys, a function edited and written again). --draft defaults to MODEL itself, which
 * with --draft-quantization int4 is a cheap draft of the same weights. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drafter.h"
#include "engine.h"
#include "model.h"
#include "scheduler.h"
#include "spec.h"

#define MAX_LIST 8
#define MAX_CONC 256

static const char default_prompt[] =
    "{\"id\": 1, \"name\": \"alpha\", \"city\": \"Paris\", \"score\": 12}\n"
    "{\"id\": 2, \"name\": \"beta\", \"city\": \"Rome\", \"score\": 7}\n"
    "{\"id\": 3, \"name\": \"gamma\", \"city\": \"Oslo\", \"score\": 31}\n"
    "{\"id\": 4, \"name\": \"delta\", \"city\": \"Lima\", \"score\": 18}\n"
    "static int add(int a, int b)\n{\n    int sum = a + b;\n    return sum;\n}\n"
    "Rename sum to total:\n"
    "static int add(int a, int b)\n{\n    int total = a + b;\n    return total;\n}\n"
    "{\"id\": 5, \"name\": \"epsilon\", \"city\": \"Kyiv\", \"score\": 22}\n"
    "{\"id\": 6, \"name\": \"";

struct opts {
    const char *model, *draft, *prompt_file;
    const char *dtype, *quant, *draft_quant;
    int tokens, threads;
    int conc[MAX_LIST], n_conc;
    int ks[MAX_LIST], n_k;
    bool ngram, use_draft, mtp, json;
    float temperature;
};

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 4096) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_spec MODEL [--prompt-file F] [--tokens 128] [--concurrency "
                    "1,8,32] [--k 1,2,3,4] [--methods ngram,draft,mtp] [--draft DIR] "
                    "[--draft-quantization none|int8|int4] [--dtype auto|bfloat16|float32] "
                    "[--quantization none|int8|int4] [--threads N] [--temperature T] [--json]\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
    memset(o, 0, sizeof *o);
    o->tokens = 128;
    o->dtype = "auto";
    o->quant = "none";
    o->draft_quant = "none";
    o->n_conc = parse_list("1,8,32", o->conc, MAX_LIST);
    o->n_k = parse_list("1,2,3,4", o->ks, MAX_LIST);
    o->ngram = o->use_draft = true;
    if (argc < 2 || argv[1][0] == '-') return -1;
    o->model = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            o->json = true;
            continue;
        }
        if (!v) return -1;
        i++;
        if (strcmp(a, "--prompt-file") == 0)
            o->prompt_file = v;
        else if (strcmp(a, "--tokens") == 0)
            o->tokens = atoi(v);
        else if (strcmp(a, "--threads") == 0)
            o->threads = atoi(v);
        else if (strcmp(a, "--concurrency") == 0)
            o->n_conc = parse_list(v, o->conc, MAX_LIST);
        else if (strcmp(a, "--k") == 0)
            o->n_k = parse_list(v, o->ks, MAX_LIST);
        else if (strcmp(a, "--draft") == 0)
            o->draft = v;
        else if (strcmp(a, "--draft-quantization") == 0)
            o->draft_quant = v;
        else if (strcmp(a, "--dtype") == 0)
            o->dtype = v;
        else if (strcmp(a, "--quantization") == 0)
            o->quant = v;
        else if (strcmp(a, "--temperature") == 0)
            o->temperature = (float)atof(v);
        else if (strcmp(a, "--methods") == 0) {
            o->ngram = strstr(v, "ngram") != NULL;
            o->use_draft = strstr(v, "draft") != NULL;
            o->mtp = strstr(v, "mtp") != NULL;
        } else
            return -1;
    }
    if (o->tokens < 2 || o->n_conc < 1 || o->n_k < 1) return -1;
    for (int i = 0; i < o->n_conc; i++)
        if (o->conc[i] > MAX_CONC) return -1;
    for (int i = 0; i < o->n_k; i++)
        if (o->ks[i] > SPEC_MAX_K) return -1;
    return 0;
}

struct result {
    double tok_s, accept, rows_per_tok, experts_per_tok, steps_per_tok;
    long generated;
    int stopped; /* requests that stopped speculating (adaptive MTP, spec_feed_pays) */
};

/* One run: C requests of the prompt, decode timed. spec NULL: no speculation. */
static int run(const struct model *m, const struct opts *o, const int32_t *prompt, int n_prompt,
               int conc, const struct spec_config *spec, const struct model *draft,
               struct result *res)
{
    char err[MS_ERR_LEN];
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_threads = o->threads;
    ep.max_seqs = conc;
    ep.max_batch_tokens = 512;
    ep.max_model_len = n_prompt + o->tokens + SPEC_MAX_K + 1;
    ep.spec_state = spec && m->desc.n_linear > 0;
    struct engine *e = NULL;
    struct drafter *dr = NULL;
    struct sched *s = NULL;
    struct sched_req *reqs[MAX_CONC] = {0};
    int rc = -1;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "engine: %s\n", err);
        return -1;
    }
    if (spec && spec->method == SPEC_DRAFT_MODEL &&
        drafter_create(draft, engine_get_params(e), m->desc.vocab, spec->k, &dr, err, sizeof err) !=
            0) {
        fprintf(stderr, "drafter: %s\n", err);
        goto out;
    }
    if (spec && spec->method == SPEC_MTP &&
        drafter_create_mtp(m, engine_get_params(e), spec->k, &dr, err, sizeof err) != 0) {
        fprintf(stderr, "MTP drafter: %s\n", err);
        goto out;
    }
    struct sched_params sp = {
        .max_num_seqs = conc, .max_num_batched_tokens = 512, .spec = spec, .drafter = dr};
    if (sched_create(e, &sp, &s, err, sizeof err) != 0) {
        fprintf(stderr, "sched: %s\n", err);
        goto out;
    }
    for (int i = 0; i < conc; i++) {
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = o->tokens;
        p.ignore_eos = true;
        p.smp.temperature = o->temperature;
        p.smp.has_seed = true;
        p.smp.seed = (uint64_t)i + 1;
        p.cache_salt = (uint64_t)i + 1;
        reqs[i] = sched_req_create(prompt, n_prompt, &p, err, sizeof err);
        if (!reqs[i] || sched_submit(s, reqs[i], err, sizeof err) != 0) {
            fprintf(stderr, "request: %s\n", err);
            goto out;
        }
    }
    /* prefills (and whatever decode shares their steps) first */
    for (;;) {
        bool all = true;
        for (int i = 0; i < conc; i++)
            all = all && reqs[i]->out.n_tokens > 0;
        if (all) break;
        sched_step(s);
    }
    long gen0 = 0;
    for (int i = 0; i < conc; i++)
        gen0 += reqs[i]->out.n_tokens;
    const struct engine_stats *es = engine_get_stats(e);
    uint64_t rows0 = 0, act0 = es->moe_active_experts;
    for (int d = 0; d < ep.n_devices; d++)
        rows0 += es->dev_routed_rows[d];
    struct sched_stats st0, st1;
    sched_get_stats(s, &st0);
    double t0 = ms_now();
    while (sched_has_work(s))
        sched_step(s);
    double dt = ms_now() - t0;
    sched_get_stats(s, &st1);
    long gen = 0;
    for (int i = 0; i < conc; i++)
        gen += reqs[i]->out.n_tokens;
    gen -= gen0;
    uint64_t rows = 0;
    for (int d = 0; d < ep.n_devices; d++)
        rows += es->dev_routed_rows[d];
    res->generated = gen;
    res->tok_s = dt > 0 ? (double)gen / dt : 0;
    uint64_t drafted = st1.spec_draft_tokens - st0.spec_draft_tokens;
    res->accept =
        drafted ? (double)(st1.spec_accepted_tokens - st0.spec_accepted_tokens) / (double)drafted
                : 0;
    res->rows_per_tok = gen ? (double)(rows - rows0) / (double)gen : 0;
    res->experts_per_tok = gen ? (double)(es->moe_active_experts - act0) / (double)gen : 0;
    res->steps_per_tok = gen ? (double)(st1.steps - st0.steps) * conc / (double)gen : 0;
    res->stopped = (int)(st1.spec_stopped - st0.spec_stopped);
    rc = 0;
out:
    for (int i = 0; i < conc; i++)
        sched_req_release(reqs[i]);
    sched_free(s);
    drafter_free(dr);
    engine_free(e);
    return rc;
}

static void report(const struct opts *o, const char *method, int k, bool adaptive, int conc,
                   const struct result *r, double base)
{
    char kk[16];
    if (k == 0)
        snprintf(kk, sizeof kk, "-");
    else
        snprintf(kk, sizeof kk, adaptive ? "<=%d" : "%d", k);
    printf("%-12s %5s %5d %10.1f %7.2fx %8.2f %9.1f %9.1f %10.2f %8d\n", method, kk, conc,
           r->tok_s, base > 0 ? r->tok_s / base : 1.0, r->accept, r->rows_per_tok,
           r->experts_per_tok, r->steps_per_tok, r->stopped);
    if (o->json)
        printf("{\"method\": \"%s\", \"k\": %d, \"adaptive\": %s, \"concurrency\": %d, "
               "\"decode_tok_s\": %.2f, \"speedup\": %.3f, \"acceptance\": %.4f, "
               "\"expert_rows_per_token\": %.2f, \"experts_read_per_token\": %.2f, "
               "\"steps_per_token\": %.3f, \"stopped_requests\": %d}\n",
               method, k, adaptive ? "true" : "false", conc, r->tok_s,
               base > 0 ? r->tok_s / base : 1.0, r->accept, r->rows_per_tok, r->experts_per_tok,
               r->steps_per_tok, r->stopped);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    struct opts o;
    if (parse(argc, argv, &o) != 0) {
        usage();
        return 2;
    }
    char err[MS_ERR_LEN];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    if (model_dtype_parse(o.dtype, &lo.dtype) != 0 || model_quant_parse(o.quant, &lo.quant) != 0) {
        usage();
        return 2;
    }
    lo.threads = o.threads;
    lo.mtp = o.mtp; /* the checkpoint's MTP module, for --methods mtp */
    struct model *m = NULL, *draft = NULL;
    if (model_load(o.model, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    if (!m->tok) {
        fprintf(stderr, "%s has no tokenizer (make_synthetic_model --tokenizer DIR)\n", o.model);
        return 1;
    }
    char *text = NULL;
    if (o.prompt_file) {
        FILE *f = fopen(o.prompt_file, "rb");
        if (!f) {
            fprintf(stderr, "%s: %s\n", o.prompt_file, strerror(errno));
            return 1;
        }
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        text = malloc((size_t)n + 1);
        if (!text || fread(text, 1, (size_t)n, f) != (size_t)n) return 1;
        text[n] = '\0';
        fclose(f);
    }
    const char *t = text ? text : default_prompt;
    int cap = (int)strlen(t) + 16; /* a token holds at least a byte; specials added */
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)cap);
    int n_prompt = prompt ? tok_encode(m->tok, t, strlen(t), true, prompt, cap) : -1;
    if (n_prompt <= 0 || n_prompt > cap) {
        fprintf(stderr, "cannot tokenize the prompt\n");
        return 1;
    }
    if (o.use_draft) {
        struct model_load_opts dlo = lo;
        dlo.cache = false;
        if (model_quant_parse(o.draft_quant, &dlo.quant) != 0) {
            usage();
            return 2;
        }
        if (model_load(o.draft ? o.draft : o.model, &dlo, &draft, err, sizeof err) != 0 ||
            drafter_check(m, draft, err, sizeof err) != 0) {
            fprintf(stderr, "draft: %s\n", err);
            return 1;
        }
    }
    printf("model %s (%s, %.1f MB), prompt %d tokens, %d generated per request, temperature "
           "%.2f%s%s%s\n",
           o.model, m->desc.model_type, (double)m->weight_bytes / 1e6, n_prompt, o.tokens,
           o.temperature, draft ? ", draft " : "", draft ? (o.draft ? o.draft : o.model) : "",
           draft ? (strcmp(o.draft_quant, "none") ? " quantized at load" : "") : "");
    printf("%-12s %5s %5s %10s %8s %8s %9s %9s %10s %8s\n", "method", "k", "conc", "tok/s",
           "speedup", "accept", "rows/tok", "exp/tok", "steps/tok", "stopped");
    for (int c = 0; c < o.n_conc; c++) {
        struct result base;
        if (run(m, &o, prompt, n_prompt, o.conc[c], NULL, NULL, &base) != 0) return 1;
        report(&o, "off", 0, false, o.conc[c], &base, base.tok_s);
        for (int meth = 0; meth < 3; meth++) {
            if ((meth == 0 && !o.ngram) || (meth == 1 && !draft) || (meth == 2 && !o.mtp))
                continue;
            static const char *const names[] = {"ngram", "draft", "mtp"};
            static const enum spec_method methods[] = {SPEC_NGRAM, SPEC_DRAFT_MODEL, SPEC_MTP};
            const char *name = names[meth];
            int kmax = 0;
            for (int i = 0; i <= o.n_k; i++) {
                bool adaptive = i == o.n_k;
                int k = adaptive ? kmax : o.ks[i];
                if (k > kmax) kmax = k;
                struct spec_config sc = {.method = methods[meth],
                                         .k = k,
                                         .lookup_min = 2,
                                         .lookup_max = 5,
                                         .adaptive = adaptive};
                struct result r;
                if (run(m, &o, prompt, n_prompt, o.conc[c], &sc, draft, &r) != 0) return 1;
                report(&o, name, k, adaptive, o.conc[c], &r, base.tok_s);
            }
        }
    }
    free(prompt);
    free(text);
    model_free(draft);
    model_free(m);
    return 0;
}
