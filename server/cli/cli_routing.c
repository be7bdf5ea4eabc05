/* Routing-trace and placement subcommands:
 *
 *   moeserve trace info FILE [--json]     what a trace holds: steps, tokens, tags, per-layer
 *                                         expert load, mean routed width, and the difficulty
 *                                         split (tokens by loss terciles: their mean routed
 *                                         width) when the trace has losses
 *   moeserve trace record --out FILE [--model DIR] NAME=TEXTFILE...
 *                                         runs a model over text files and records each token's
 *                                         routing, its next-token loss and its file (a tag)
 *   moeserve trace synth --out FILE ...   synthetic skewed routing with planted clusters
 *   moeserve placement-sim --trace FILE   replays a trace onto 2..256 devices under each
 *                                         placement policy (engine/placement/placement_sim.h)
 *
 * Exit status: 0, 1 on a runtime failure (unreadable or corrupt trace, with its offset), 2 on
 * a bad flag. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common.h"
#include "engine.h"
#include "model.h"
#include "placement/placement.h"
#include "placement/placement_sim.h"
#include "routing/route_synth.h"
#include "routing/route_trace.h"
#include "tokenizer.h"

#define MAX_DOMAINS 64
#define MAX_LIST 32

/* --- trace info ---------------------------------------------------------------------------- */

struct tok_note {
    float loss;
    float width; /* mean FFN width of the token's rows, all layers */
};

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static int trace_info(int argc, char **argv)
{
    const char *path = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (argv[i][0] != '-' && !path)
            path = argv[i];
        else {
            fprintf(stderr, "usage: moeserve trace info FILE [--json]\n");
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: moeserve trace info FILE [--json]\n");
        return 2;
    }
    char err[MS_ERR_LEN];
    struct rtrace_reader *r = NULL;
    if (rtrace_open(path, &r, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve trace: %s\n", err);
        return 1;
    }
    const struct rtrace_info *in = rtrace_get_info(r);
    int L = in->n_layer, E = in->n_expert, K = in->top_k, rc = 1;
    double *load = calloc((size_t)L * E, sizeof *load);
    uint64_t tag_tok[RTRACE_MAX_TAGS / 64] = {0}; /* tags 0..1023 counted */
    double tag_loss[RTRACE_MAX_TAGS / 64] = {0};
    uint64_t tag_lossn[RTRACE_MAX_TAGS / 64] = {0};
    struct tok_note *notes = NULL;
    size_t n_notes = 0, cap_notes = 0;
    uint64_t steps = 0, tokens = 0, rows = 0;
    double width_rows = 0.0;
    float *sorted = NULL;
    if (!load) goto out;
    struct rtrace_step st;
    int got;
    while ((got = rtrace_next(r, &st, err, sizeof err)) == 1) {
        steps++;
        tokens += (uint64_t)st.n_tok;
        for (int t = 0; t < st.n_tok; t++) {
            double w = 0.0;
            int nr = 0;
            for (int l = 0; l < L; l++)
                for (int j = 0; j < K; j++) {
                    int32_t x = st.ids[(size_t)l * st.layer_stride + (size_t)t * K + j];
                    if (x < 0) continue;
                    load[(size_t)l * E + x] += 1.0;
                    w += in->expert_width[x];
                    nr++;
                }
            rows += (uint64_t)nr;
            width_rows += w;
            int tag = st.tags[t];
            if (tag < RTRACE_MAX_TAGS / 64) {
                tag_tok[tag]++;
                if (st.loss && !isnan(st.loss[t])) {
                    tag_loss[tag] += st.loss[t];
                    tag_lossn[tag]++;
                }
            }
            if (st.loss && !isnan(st.loss[t]) && nr > 0) {
                if (n_notes == cap_notes) {
                    cap_notes = cap_notes ? 2 * cap_notes : 4096;
                    struct tok_note *nn = realloc(notes, sizeof *nn * cap_notes);
                    if (!nn) goto oom;
                    notes = nn;
                }
                notes[n_notes++] = (struct tok_note){st.loss[t], (float)(w / nr)};
            }
        }
    }
    if (got < 0) {
        fprintf(stderr, "moeserve trace: %s\n", err);
        goto out;
    }
    /* Difficulty split: loss terciles (as bench/mohge_eval), mean routed width of each. */
    double t_loss[3] = {0}, t_width[3] = {0};
    uint64_t t_n[3] = {0};
    if (n_notes > 0) {
        sorted = malloc(sizeof(float) * n_notes);
        if (!sorted) goto oom;
        for (size_t i = 0; i < n_notes; i++) sorted[i] = notes[i].loss;
        qsort(sorted, n_notes, sizeof(float), cmp_float);
        float cut1 = sorted[n_notes / 3], cut2 = sorted[2 * n_notes / 3];
        for (size_t i = 0; i < n_notes; i++) {
            int b = notes[i].loss < cut1 ? 0 : notes[i].loss < cut2 ? 1 : 2;
            t_loss[b] += notes[i].loss;
            t_width[b] += notes[i].width;
            t_n[b]++;
        }
    }
    static const char *const third[3] = {"easy", "medium", "hard"};
    if (json) {
        printf("{\"model\": \"%s\", \"n_layer\": %d, \"n_expert\": %d, \"top_k\": %d, "
               "\"d_model\": %d, \"n_group\": %d, \"steps\": %llu, \"tokens\": %llu, "
               "\"rows\": %llu, \"mean_width\": %.17g,\n \"tags\": {",
               in->model, L, E, K, in->d_model, in->n_group, (unsigned long long)steps,
               (unsigned long long)tokens, (unsigned long long)rows,
               rows ? width_rows / (double)rows : 0.0);
        bool first = true;
        for (int g = 0; g < RTRACE_MAX_TAGS / 64; g++) {
            if (!tag_tok[g]) continue;
            const char *name = rtrace_tag_name(r, g);
            printf("%s\"%s\": {\"tokens\": %llu, \"mean_loss\": %.17g}", first ? "" : ", ",
                   name ? name : "", (unsigned long long)tag_tok[g],
                   tag_lossn[g] ? tag_loss[g] / (double)tag_lossn[g] : 0.0);
            first = false;
        }
        printf("},\n \"expert_tokens\": [");
        for (int l = 0; l < L; l++) {
            printf("%s[", l ? ", " : "");
            for (int x = 0; x < E; x++) printf("%s%.0f", x ? ", " : "", load[(size_t)l * E + x]);
            printf("]");
        }
        printf("],\n \"difficulty\": [");
        for (int b = 0; b < 3 && n_notes; b++)
            printf("%s{\"third\": \"%s\", \"tokens\": %llu, \"mean_loss\": %.17g, "
                   "\"mean_width\": %.17g}",
                   b ? ", " : "", third[b], (unsigned long long)t_n[b],
                   t_n[b] ? t_loss[b] / (double)t_n[b] : 0.0,
                   t_n[b] ? t_width[b] / (double)t_n[b] : 0.0);
        printf("]}\n");
    } else {
        printf("trace %s: model %s, %d MoE layers (of %d), %d experts, top-%d, d_model %d, %d "
               "groups%s%s\n",
               path, in->model[0] ? in->model : "?", L, in->model_n_layer, E, K, in->d_model,
               in->n_group, in->flags & RTRACE_F_LOSS ? ", losses" : "",
               in->flags & RTRACE_F_WEIGHTS ? ", weights" : "");
        printf("%llu steps, %llu tokens, %llu expert rows; mean routed width %.1f\n",
               (unsigned long long)steps, (unsigned long long)tokens, (unsigned long long)rows,
               rows ? width_rows / (double)rows : 0.0);
        for (int g = 0; g < RTRACE_MAX_TAGS / 64; g++) {
            if (!tag_tok[g]) continue;
            const char *name = rtrace_tag_name(r, g);
            printf("  tag %d %-14s %8llu tokens", g, name ? name : "", (unsigned long long)tag_tok[g]);
            if (tag_lossn[g]) printf("  mean loss %.4f", tag_loss[g] / (double)tag_lossn[g]);
            printf("\n");
        }
        printf("per layer: busiest expert's share of rows, and max / mean over experts\n");
        for (int l = 0; l < L; l++) {
            double mx = 0.0, tot = 0.0;
            for (int x = 0; x < E; x++) {
                mx = load[(size_t)l * E + x] > mx ? load[(size_t)l * E + x] : mx;
                tot += load[(size_t)l * E + x];
            }
            printf("  layer %d: %.1f%%, %.2f\n", in->layer_index[l], tot ? 100.0 * mx / tot : 0.0,
                   tot ? mx / (tot / E) : 0.0);
        }
        if (n_notes) {
            printf("difficulty split (tokens by their loss; routed width per token, all layers):\n"
                   "| tokens by loss | tokens | mean loss | mean routed width |\n|---|---|---|---|\n");
            for (int b = 0; b < 3; b++)
                printf("| %s | %llu | %.4f | %.1f |\n", third[b], (unsigned long long)t_n[b],
                       t_n[b] ? t_loss[b] / (double)t_n[b] : 0.0,
                       t_n[b] ? t_width[b] / (double)t_n[b] : 0.0);
        }
    }
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "moeserve trace: out of memory\n");
out:
    free(load);
    free(notes);
    free(sorted);
    rtrace_close(r);
    return rc;
}

/* --- trace synth --------------------------------------------------------------------------- */

static int trace_synth(int argc, char **argv)
{
    static const char *cmd = "trace synth";
    enum { O_OUT = 256, O_EXP, O_LAY, O_TOPK, O_TOK, O_STEP, O_DM, O_W, O_G, O_CL, O_PIN, O_TS,
           O_ES, O_SEED };
    static const struct option lo[] = {
        {"out", required_argument, 0, O_OUT},          {"experts", required_argument, 0, O_EXP},
        {"layers", required_argument, 0, O_LAY},       {"top-k", required_argument, 0, O_TOPK},
        {"tokens", required_argument, 0, O_TOK},       {"step-tokens", required_argument, 0, O_STEP},
        {"d-model", required_argument, 0, O_DM},       {"width", required_argument, 0, O_W},
        {"groups", required_argument, 0, O_G},         {"cluster", required_argument, 0, O_CL},
        {"p-in", required_argument, 0, O_PIN},         {"topic-skew", required_argument, 0, O_TS},
        {"expert-skew", required_argument, 0, O_ES},   {"seed", required_argument, 0, O_SEED},
        {"help", no_argument, 0, 'h'},                 {0, 0, 0, 0},
    };
    struct rsynth_config c = {.n_layer = 8, .n_expert = 64, .top_k = 4, .d_model = 2048,
                              .width = 1408, .groups = 0, .cluster = 8, .p_in = 0.8,
                              .topic_skew = 1.0, .expert_skew = 0.6, .seed = 1};
    const char *out = NULL;
    long tokens = 16384;
    int step = 256, seed = 1;
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int rc = 0;
        switch (o) {
        case O_OUT: out = optarg; break;
        case O_EXP: rc = cli_parse_int(cmd, "--experts", optarg, 1, RTRACE_MAX_EXPERTS, &c.n_expert); break;
        case O_LAY: rc = cli_parse_int(cmd, "--layers", optarg, 1, 1024, &c.n_layer); break;
        case O_TOPK: rc = cli_parse_int(cmd, "--top-k", optarg, 1, 256, &c.top_k); break;
        case O_TOK: rc = cli_parse_long(cmd, "--tokens", optarg, 1, 1L << 30, &tokens); break;
        case O_STEP: rc = cli_parse_int(cmd, "--step-tokens", optarg, 1, 1 << 20, &step); break;
        case O_DM: rc = cli_parse_int(cmd, "--d-model", optarg, 1, 1 << 20, &c.d_model); break;
        case O_W: rc = cli_parse_int(cmd, "--width", optarg, 1, 1 << 20, &c.width); break;
        case O_G: rc = cli_parse_int(cmd, "--groups", optarg, 0, 1024, &c.groups); break;
        case O_CL: rc = cli_parse_int(cmd, "--cluster", optarg, 1, RTRACE_MAX_EXPERTS, &c.cluster); break;
        case O_PIN: rc = cli_parse_double(cmd, "--p-in", optarg, 0, 1, &c.p_in); break;
        case O_TS: rc = cli_parse_double(cmd, "--topic-skew", optarg, 0, 10, &c.topic_skew); break;
        case O_ES: rc = cli_parse_double(cmd, "--expert-skew", optarg, 0, 10, &c.expert_skew); break;
        case O_SEED: rc = cli_parse_int(cmd, "--seed", optarg, 0, 0x7fffffff, &seed); break;
        case 'h':
            printf("usage: moeserve trace synth --out FILE [--experts 64] [--layers 8] [--top-k 4]\n"
                   "  [--tokens 16384] [--step-tokens 256] [--d-model 2048] [--width 1408]\n"
                   "  [--groups G (widths width*(g+1)/G)] [--cluster 8] [--p-in 0.8]\n"
                   "  [--topic-skew 1.0] [--expert-skew 0.6] [--seed 1]\n"
                   "Skewed routing with planted clusters of experts that fire together\n"
                   "(engine/routing/route_synth.h); tags are the tokens' topics.\n");
            return 0;
        default: return 2;
        }
        if (rc) return 2;
    }
    if (!out || optind < argc) {
        fprintf(stderr, "moeserve trace synth: --out FILE is required (see --help)\n");
        return 2;
    }
    c.seed = (uint64_t)seed;
    char err[MS_ERR_LEN];
    struct rsynth *sy = NULL;
    struct rtrace_writer *w = NULL;
    int32_t *ids = NULL;
    uint16_t *tags = NULL;
    int rc = 1;
    if (rsynth_create(&c, &sy, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve trace synth: %s\n", err);
        return 2;
    }
    struct rtrace_info in = {.n_layer = c.n_layer, .n_expert = c.n_expert, .top_k = c.top_k,
                             .d_model = c.d_model, .n_group = c.groups > 1 ? c.groups : 0,
                             .model_n_layer = c.n_layer, .expert_width = rsynth_widths(sy),
                             .expert_group = rsynth_groups(sy)};
    snprintf(in.model, sizeof in.model, "synthetic-e%d-k%d-c%d", c.n_expert, c.top_k, c.cluster);
    ids = malloc(sizeof(int32_t) * (size_t)c.n_layer * step * c.top_k);
    tags = malloc(sizeof(uint16_t) * (size_t)step);
    if (!ids || !tags || rtrace_writer_open(out, &in, 0, step, &w, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve trace synth: %s\n", ids && tags ? err : "out of memory");
        goto out;
    }
    int n_clusters = c.n_expert / c.cluster;
    for (int t = 0; t < n_clusters && t < RTRACE_MAX_TAGS; t++) {
        char name[32];
        snprintf(name, sizeof name, "topic%d", t);
        if (rtrace_writer_tag(w, t, name, err, sizeof err) != 0) goto werr;
    }
    uint64_t s = 0;
    for (long done = 0; done < tokens; done += step, s++) {
        int n = tokens - done < step ? (int)(tokens - done) : step;
        rsynth_step(sy, n, ids, tags);
        struct rtrace_step st = {.step = s, .n_tok = n, .tags = tags, .ids = ids};
        if (rtrace_write_step(w, &st, err, sizeof err) != 0) goto werr;
    }
    if (rtrace_writer_close(w, err, sizeof err) != 0) {
        w = NULL;
        goto werr;
    }
    w = NULL;
    fprintf(stderr, "wrote %s: %ld tokens in %llu steps\n", out, tokens, (unsigned long long)s);
    rc = 0;
    goto out;
werr:
    fprintf(stderr, "moeserve trace synth: %s\n", err);
out:
    rtrace_writer_close(w, NULL, 0);
    rsynth_free(sy);
    free(ids);
    free(tags);
    return rc;
}

/* --- trace record -------------------------------------------------------------------------- */

static int trace_record(int argc, char **argv)
{
    static const char *cmd = "trace record";
    enum { O_OUT = 256, O_MODEL, O_WIN, O_STEP, O_MAX, O_DEV, O_DTYPE, O_K, O_WTS };
    static const struct option lo[] = {
        {"out", required_argument, 0, O_OUT},       {"model", required_argument, 0, O_MODEL},
        {"window", required_argument, 0, O_WIN},    {"step-tokens", required_argument, 0, O_STEP},
        {"max-tokens", required_argument, 0, O_MAX}, {"devices", required_argument, 0, O_DEV},
        {"dtype", required_argument, 0, O_DTYPE},   {"moe-top-k", required_argument, 0, O_K},
        {"weights", no_argument, 0, O_WTS},         {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *out = NULL, *model_dir = NULL;
    int window = 256, step = 64, max_tokens = 2048, devices = 1, moe_k = 0;
    bool weights = false;
    struct model_load_opts mo;
    model_load_opts_default(&mo);
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int rc = 0;
        switch (o) {
        case O_OUT: out = optarg; break;
        case O_MODEL: model_dir = optarg; break;
        case O_WIN: rc = cli_parse_int(cmd, "--window", optarg, 2, 1 << 16, &window); break;
        case O_STEP: rc = cli_parse_int(cmd, "--step-tokens", optarg, 1, 1 << 16, &step); break;
        case O_MAX: rc = cli_parse_int(cmd, "--max-tokens", optarg, 2, 1 << 26, &max_tokens); break;
        case O_DEV: rc = cli_parse_int(cmd, "--devices", optarg, 1, 64, &devices); break;
        case O_K: rc = cli_parse_int(cmd, "--moe-top-k", optarg, 1, 512, &moe_k); break;
        case O_WTS: weights = true; break;
        case O_DTYPE:
            if (model_dtype_parse(optarg, &mo.dtype) != 0) {
                fprintf(stderr, "moeserve trace record: --dtype must be auto, bfloat16 or "
                                "float32, got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case 'h':
            printf("usage: moeserve trace record --out FILE [--model DIR] [--window 256]\n"
                   "  [--step-tokens 64] [--max-tokens 2048 (per file)] [--devices N]\n"
                   "  [--dtype D] [--moe-top-k K] [--weights] NAME=TEXTFILE...\n"
                   "Runs the model over each text file in windows of --window tokens, a step\n"
                   "per --step-tokens, and records every token's experts at every MoE layer, its\n"
                   "next-token loss and its file (tag NAME).\n");
            return 0;
        default: return 2;
        }
        if (rc) return 2;
    }
    const char *dom_name[MAX_DOMAINS], *dom_file[MAX_DOMAINS];
    char dom_buf[MAX_DOMAINS][64];
    int n_dom = 0;
    for (int i = optind; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        if (!eq || eq == argv[i] || n_dom == MAX_DOMAINS) {
            fprintf(stderr, "moeserve trace record: expected NAME=TEXTFILE, got '%s'\n", argv[i]);
            return 2;
        }
        snprintf(dom_buf[n_dom], sizeof dom_buf[n_dom], "%.*s", (int)(eq - argv[i]), argv[i]);
        dom_name[n_dom] = dom_buf[n_dom];
        dom_file[n_dom++] = eq + 1;
    }
    if (!out || n_dom == 0) {
        fprintf(stderr, "moeserve trace record: --out FILE and at least one NAME=TEXTFILE are "
                        "required (see --help)\n");
        return 2;
    }
    if (step > window) step = window;
    static char default_model[8192];
    if (!model_dir && !(model_dir = cli_default_model(default_model, sizeof default_model))) {
        fprintf(stderr, "%s\n", default_model);
        return 2;
    }

    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct engine *e = NULL;
    struct rtrace_writer *w = NULL;
    int32_t *ids = NULL;
    float *logits = NULL, *loss = NULL;
    uint16_t *tags = NULL;
    int rc = 1;
    if (model_load(model_dir, &mo, &m, err, sizeof err) != 0) goto fail;
    const struct model_desc *md = &m->desc;
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = devices;
    ep.max_batch_tokens = step;
    ep.max_seqs = 1;
    ep.max_model_len = window;
    ep.capture_routing = true;
    ep.capture_weights = weights;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) goto fail;
    struct plc_model pm;
    plc_model_from_desc(md, &pm);
    int *lidx = malloc(sizeof(int) * (size_t)(pm.n_layer > 0 ? pm.n_layer : 1));
    if (!lidx) goto oom;
    for (int l = 0, k = 0; l < md->n_layer; l++)
        if (md->layer_is_moe[l]) lidx[k++] = l;
    struct rtrace_info in = {.n_layer = pm.n_layer, .n_expert = md->n_expert,
                             .top_k = md->top_k, .d_model = md->d_model,
                             .n_group = pm.n_group, .model_n_layer = md->n_layer,
                             .flags = RTRACE_F_LOSS | (weights ? RTRACE_F_WEIGHTS : 0u),
                             .expert_width = md->expert_d_ff, .expert_group = md->expert_group,
                             .layer_index = lidx};
    const char *slash = strrchr(model_dir, '/');
    snprintf(in.model, sizeof in.model, "%s", slash && slash[1] ? slash + 1 : model_dir);
    int wrc = pm.n_layer > 0 && md->n_expert > 0
                  ? rtrace_writer_open(out, &in, 0, step, &w, err, sizeof err)
                  : ms_errf(err, sizeof err, "%s has no MoE layer to record", model_dir);
    free(lidx);
    if (wrc != 0) goto fail;
    ids = malloc(sizeof(int32_t) * ((size_t)max_tokens + 1));
    logits = malloc(sizeof(float) * (size_t)step * md->vocab);
    loss = malloc(sizeof(float) * (size_t)step);
    tags = malloc(sizeof(uint16_t) * (size_t)step);
    if (!ids || !logits || !loss || !tags) goto oom;
    uint64_t n_step = 0, n_tok = 0;
    for (int d = 0; d < n_dom; d++) {
        if (rtrace_writer_tag(w, d, dom_name[d], err, sizeof err) != 0) goto fail;
        size_t len = 0;
        char *text = cli_read_file(dom_file[d], &len);
        if (!text) {
            snprintf(err, sizeof err, "cannot read %s: %s", dom_file[d], strerror(errno));
            goto fail;
        }
        int n = tok_encode(m->tok, text, len, false, ids, max_tokens + 1);
        free(text);
        if (n < 0) {
            snprintf(err, sizeof err, "%s: the tokenizer failed", dom_file[d]);
            goto fail;
        }
        if (n > max_tokens + 1) n = max_tokens + 1;
        for (int s = 0; s + 1 < n; s += window) {
            struct kv_seq seq;
            if (engine_seq_init(e, &seq) != 0) goto oom;
            int wlen = n - 1 - s < window ? n - 1 - s : window;
            for (int p = 0; p < wlen; p += step) {
                int cnt = wlen - p < step ? wlen - p : step;
                struct engine_item it = {.kv = &seq, .tokens = ids + s + p, .n_tokens = cnt,
                                         .pos = p, .moe_top_k = moe_k, .n_logits = cnt,
                                         .logits = logits};
                if (engine_step(e, &it, 1, err, sizeof err) != 0) {
                    engine_seq_free(e, &seq);
                    goto fail;
                }
                for (int t = 0; t < cnt; t++) {
                    const float *lg = logits + (size_t)t * md->vocab;
                    double mx = -INFINITY, z = 0.0;
                    for (int v = 0; v < md->vocab; v++) mx = lg[v] > mx ? lg[v] : mx;
                    for (int v = 0; v < md->vocab; v++) z += exp((double)lg[v] - mx);
                    loss[t] = (float)(mx + log(z) - lg[ids[s + p + t + 1]]);
                    tags[t] = (uint16_t)d;
                }
                const struct engine_routing *rt = engine_last_routing(e);
                struct rtrace_step st = {.step = n_step++, .n_tok = cnt, .tokens = rt->tokens,
                                         .tags = tags, .loss = loss, .ids = rt->ids,
                                         .weights = rt->weights,
                                         .layer_stride = rt->layer_stride};
                if (rtrace_write_step(w, &st, err, sizeof err) != 0) {
                    engine_seq_free(e, &seq);
                    goto fail;
                }
                n_tok += (uint64_t)cnt;
            }
            engine_seq_free(e, &seq);
        }
    }
    if (rtrace_writer_close(w, err, sizeof err) != 0) {
        w = NULL;
        goto fail;
    }
    w = NULL;
    fprintf(stderr, "wrote %s: %llu tokens in %llu steps from %d file(s)\n", out,
            (unsigned long long)n_tok, (unsigned long long)n_step, n_dom);
    rc = 0;
    goto out;
oom:
    snprintf(err, sizeof err, "out of memory");
fail:
    fprintf(stderr, "moeserve trace record: %s\n", err);
out:
    rtrace_writer_close(w, NULL, 0);
    free(ids);
    free(logits);
    free(loss);
    free(tags);
    engine_free(e);
    model_free(m);
    return rc;
}

int cli_trace(int argc, char **argv)
{
    const char *sub = argc > 1 ? argv[1] : "";
    if (strcmp(sub, "info") == 0) return trace_info(argc - 1, argv + 1);
    if (strcmp(sub, "record") == 0) return trace_record(argc - 1, argv + 1);
    if (strcmp(sub, "synth") == 0) return trace_synth(argc - 1, argv + 1);
    FILE *f = strcmp(sub, "--help") == 0 || strcmp(sub, "-h") == 0 ? stdout : stderr;
    fprintf(f, "usage: moeserve trace info FILE [--json]\n"
               "       moeserve trace record --out FILE [--model DIR] NAME=TEXTFILE...\n"
               "       moeserve trace synth --out FILE [options]\n"
               "Routing traces (format: engine/routing/route_trace.h; Python reader:\n"
               "tools/routing_trace.py). `moeserve trace SUB --help` lists a command's options.\n");
    return f == stdout ? 0 : 2;
}

/* --- placement-sim ------------------------------------------------------------------------- */

static int parse_int_list(const char *s, int *out, int max, int lo, int hi)
{
    int n = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long v = strtol(tok, &end, 10);
        if (end == tok || *end || v < lo || v > hi || n == max) return -1;
        out[n++] = (int)v;
    }
    return n;
}

int cli_placement_sim(int argc, char **argv)
{
    static const char *cmd = "placement-sim";
    enum { O_TRACE = 256, O_DEVS, O_POLS, O_TPD, O_STEPS, O_FIT, O_RPD, O_R, O_SLOTS, O_BOUND,
           O_ACT, O_WB, O_CSV, O_ORDER, O_SEED, O_NODES, O_GBPS, O_LAT, O_EFF, O_ROUNDS };
    static const struct option lo[] = {
        {"trace", required_argument, 0, O_TRACE},
        {"devices", required_argument, 0, O_DEVS},
        {"policies", required_argument, 0, O_POLS},
        {"tokens-per-device", required_argument, 0, O_TPD},
        {"min-steps", required_argument, 0, O_STEPS},
        {"fit", required_argument, 0, O_FIT},
        {"replicas-per-device", required_argument, 0, O_RPD},
        {"redundant-experts", required_argument, 0, O_R},
        {"max-experts-per-device", required_argument, 0, O_SLOTS},
        {"c2r-bound", required_argument, 0, O_BOUND},
        {"act-bytes", required_argument, 0, O_ACT},
        {"weight-bytes", required_argument, 0, O_WB},
        {"csv", no_argument, 0, O_CSV},
        {"order", required_argument, 0, O_ORDER},
        {"seed", required_argument, 0, O_SEED},
        {"nodes", required_argument, 0, O_NODES},
        {"link-gbps", required_argument, 0, O_GBPS},
        {"link-latency-us", required_argument, 0, O_LAT},
        {"link-efficiency", required_argument, 0, O_EFF},
        {"rounds-per-layer", required_argument, 0, O_ROUNDS},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct psim_run_params p = {.tokens_per_dev = 256, .seed = 1, .min_steps = 8, .redundant = -1,
                                .replicas_per_dev = 1, .c2r_bound = PLC_C2R_BOUND, .act_bytes = 2,
                                .weight_bytes = 2, .link_efficiency = 1.0, .rounds_per_layer = 6};
    int devs[MAX_LIST] = {2, 4, 8, 16, 64, 256}, n_devs = 6, n_pols = PLC_N_POLICIES;
    /* one more entry: eplb placed over the nodes (--nodes), next to the flat one */
    enum plc_policy pols[PLC_N_POLICIES + 1] = {PLC_POLICY_CONTIGUOUS, PLC_POLICY_MOHGE,
                                                PLC_POLICY_EPLB, PLC_POLICY_C2R};
    bool hier[PLC_N_POLICIES + 1] = {false};
    bool csv = false;
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int rc = 0;
        switch (o) {
        case O_TRACE: p.trace = optarg; break;
        case O_DEVS:
            n_devs = parse_int_list(optarg, devs, MAX_LIST, 1, 4096);
            if (n_devs < 1) {
                fprintf(stderr, "moeserve placement-sim: --devices must be a list like 2,4,8 of "
                                "1..4096, got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case O_POLS: {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            n_pols = 0;
            for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
                if (n_pols == PLC_N_POLICIES || plc_policy_parse(t, &pols[n_pols++]) != 0) {
                    fprintf(stderr, "moeserve placement-sim: --policies takes contiguous, mohge, "
                                    "eplb, c2r, got '%s'\n",
                            t);
                    rc = -1;
                    break;
                }
            if (n_pols == 0) rc = -1;
            break;
        }
        case O_TPD: rc = cli_parse_int(cmd, "--tokens-per-device", optarg, 1, 1 << 20, &p.tokens_per_dev); break;
        case O_STEPS: rc = cli_parse_int(cmd, "--min-steps", optarg, 1, 1 << 20, &p.min_steps); break;
        case O_FIT:
            if (strcmp(optarg, "all") == 0 || strcmp(optarg, "half") == 0) {
                p.fit_all = optarg[0] == 'a';
            } else {
                fprintf(stderr, "moeserve placement-sim: --fit must be half or all, got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case O_RPD: rc = cli_parse_int(cmd, "--replicas-per-device", optarg, 0, 64, &p.replicas_per_dev); break;
        case O_R: rc = cli_parse_int(cmd, "--redundant-experts", optarg, 0, 1 << 20, &p.redundant); break;
        case O_SLOTS: rc = cli_parse_int(cmd, "--max-experts-per-device", optarg, 0, 1 << 20, &p.slots_per_dev); break;
        case O_BOUND: rc = cli_parse_double(cmd, "--c2r-bound", optarg, 1, 100, &p.c2r_bound); break;
        case O_ACT: rc = cli_parse_int(cmd, "--act-bytes", optarg, 1, 8, &p.act_bytes); break;
        case O_WB: rc = cli_parse_int(cmd, "--weight-bytes", optarg, 1, 8, &p.weight_bytes); break;
        case O_CSV: csv = true; break;
        case O_ORDER:
            if (strcmp(optarg, "shuffle") == 0 || strcmp(optarg, "trace") == 0) {
                p.trace_order = optarg[0] == 't';
            } else {
                fprintf(stderr, "moeserve placement-sim: --order must be shuffle or trace, got "
                                "'%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case O_NODES: rc = cli_parse_int(cmd, "--nodes", optarg, 1, 4096, &p.nodes); break;
        case O_GBPS: rc = cli_parse_double(cmd, "--link-gbps", optarg, 0.001, 1e6, &p.link_gbps); break;
        case O_LAT: rc = cli_parse_double(cmd, "--link-latency-us", optarg, 0, 1e7, &p.link_latency_us); break;
        case O_EFF: rc = cli_parse_double(cmd, "--link-efficiency", optarg, 0.001, 1, &p.link_efficiency); break;
        case O_ROUNDS: rc = cli_parse_int(cmd, "--rounds-per-layer", optarg, 0, 1000, &p.rounds_per_layer); break;
        case O_SEED: {
            int seed;
            rc = cli_parse_int(cmd, "--seed", optarg, 0, 0x7fffffff, &seed);
            p.seed = (uint64_t)seed;
            break;
        }
        case 'h':
            printf("usage: moeserve placement-sim --trace FILE [options]\n"
                   "  --devices 2,4,8,16,64,256   device counts to simulate\n"
                   "  --policies contiguous,mohge,eplb,c2r\n"
                   "  --tokens-per-device 256     a simulated step is this x devices tokens\n"
                   "  --order shuffle|trace       steps mix the evaluation tokens at random\n"
                   "                              (shuffle; --seed 1), or follow the trace\n"
                   "  --min-steps 8               the evaluation steps are cycled to this many\n"
                   "  --fit half|all              statistics from the even steps, evaluated on\n"
                   "                              the odd ones (half), or all on all (half)\n"
                   "  --replicas-per-device 1     eplb's redundant experts: this x devices\n"
                   "  --redundant-experts R       replicas per layer for every policy instead\n"
                   "  --max-experts-per-device S  expert slots per device and layer (fewest)\n"
                   "  --c2r-bound 1.05            c2r: device load at most this x the mean\n"
                   "  --act-bytes 2 --weight-bytes 2   bytes per exchanged value / weight\n"
                   "  --nodes M                   devices in M nodes (each device count a\n"
                   "                              multiple of M): rows crossing nodes are\n"
                   "                              counted, and eplb is also placed over the\n"
                   "                              nodes first (eplb/nodes: hierarchical)\n"
                   "  --link-gbps G               a link cost model: each device's link at G\n"
                   "                              Gbit/s; adds the exchange time per step\n"
                   "  --link-latency-us A         latency of one exchange round (0)\n"
                   "  --link-efficiency F         share of G an exchange gets (1; measured by\n"
                   "                              bench/net_scale.py)\n"
                   "  --rounds-per-layer R        latency rounds per MoE layer (6, as the\n"
                   "                              engine on MPI: rows, expert ids, results\n"
                   "                              back, each counts then data)\n"
                   "  --csv                       comma-separated output\n"
                   "Per policy and device count: imbalance (mean over steps and layers of\n"
                   "max/mean device expert FLOPs; the worst; over all steps summed), the share\n"
                   "of expert rows computed\n"
                   "off their token's device, (token, other device) pairs over rows (what a\n"
                   "once-per-device dispatch sends), all-to-all KB per token (--dispatch rows:\n"
                   "a row per remote expert row each way; dedup, --dispatch tokens: a row per\n"
                   "remote device each way), expert weight MB on the fullest device; with\n"
                   "--link-gbps, the exchange time per step (ms, all MoE layers) for both.\n");
            return 0;
        default: return 2;
        }
        if (rc) return 2;
    }
    if (!p.trace || optind < argc) {
        fprintf(stderr, "moeserve placement-sim: --trace FILE is required (see --help)\n");
        return 2;
    }
    if (p.nodes > 1) {
        for (int i = 0; i < n_devs; i++)
            if (devs[i] % p.nodes != 0) {
                fprintf(stderr, "moeserve placement-sim: --nodes %d does not divide --devices "
                                "%d\n",
                        p.nodes, devs[i]);
                return 2;
            }
        for (int j = 0; j < n_pols; j++)
            if (pols[j] == PLC_POLICY_EPLB) { /* the hierarchical one right after */
                memmove(&pols[j + 2], &pols[j + 1], sizeof *pols * (size_t)(n_pols - j - 1));
                pols[j + 1] = PLC_POLICY_EPLB;
                hier[j + 1] = true;
                n_pols++;
                break;
            }
        p.hier = hier;
    }
    bool link = p.link_gbps > 0;
    struct psim_cell *cells = calloc((size_t)n_devs * n_pols, sizeof *cells);
    if (!cells) return 1;
    struct psim_summary sum;
    char err[MS_ERR_LEN];
    if (psim_run(&p, devs, n_devs, pols, n_pols, cells, &sum, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve placement-sim: %s\n", err);
        free(cells);
        return 1;
    }
    if (csv) {
        printf("devices,policy,redundant,imbalance,imbalance_worst,imbalance_window,"
               "predicted_imbalance,cross_rows,"
               "token_sends,a2a_kb_token,a2a_dedup_kb_token,expert_mb_device_max,slots_max,"
               "steps,place_ms%s%s\n", p.nodes > 1 ? ",cross_node_rows,node_sends" : "",
               link ? ",link_ms_step,link_ms_step_dedup" : "");
    } else {
        printf("trace %s: model %s, %d MoE layers, %d experts, top-%d, d_model %d; fit %llu "
               "tokens, evaluated %llu (%s), %d tokens per device a step (%s)\n",
               p.trace, sum.model, sum.n_layer, sum.n_expert, sum.top_k, sum.d_model,
               (unsigned long long)sum.fit_tokens, (unsigned long long)sum.eval_tokens,
               p.fit_all ? "the same steps" : "even steps fit, odd steps evaluated",
               p.tokens_per_dev, p.trace_order ? "trace order" : "shuffled");
        if (link)
            printf("link cost model: %g Gbit/s per device at %.0f%%, %g us a round, %d rounds "
                   "per MoE layer, %d bytes a value\n",
                   p.link_gbps, 100 * p.link_efficiency, p.link_latency_us, p.rounds_per_layer,
                   p.act_bytes);
        printf("\n| devices | policy | replicas | imbalance | worst | all steps | cross rows | "
               "token sends | a2a KB/token | dedup KB/token | expert MB/device |%s%s\n"
               "|---|---|---|---|---|---|---|---|---|---|---|%s%s\n",
               p.nodes > 1 ? " cross-node rows | node sends |" : "",
               link ? " link ms/step | dedup link ms/step |" : "",
               p.nodes > 1 ? "---|---|" : "", link ? "---|---|" : "");
    }
    for (int i = 0; i < n_devs; i++)
        for (int j = 0; j < n_pols; j++) {
            const struct psim_cell *c = &cells[i * n_pols + j];
            const struct psim_result *r = &c->r;
            const char *name = hier[j] ? "eplb/nodes" : plc_policy_name(pols[j]);
            if (!c->ok) {
                if (csv)
                    printf("%d,%s,,,,,,,,,,,,,%s%s\n", devs[i], name, p.nodes > 1 ? ",," : "",
                           link ? ",," : "");
                else
                    printf("| %d | %s | — | n/a: %s | | | | | | | |%s%s\n", devs[i], name,
                           c->why, p.nodes > 1 ? " | |" : "", link ? " | |" : "");
                continue;
            }
            if (csv)
                printf("%d,%s,%d,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.3f,%.3f,%.2f,%d,%llu,%.2f",
                       devs[i], name, c->redundant, r->imbalance, r->imbalance_max,
                       r->imbalance_window, c->predicted_imbalance, r->cross_rows,
                       r->cross_sends, r->bytes_token / 1024, r->bytes_token_dedup / 1024,
                       r->mem_max / 1e6, r->slots_max, (unsigned long long)r->steps,
                       c->place_ms);
            else
                printf("| %d | %s | %d | %.3f | %.2f | %.3f | %.1f%% | %.1f%% | %.1f | %.1f | "
                       "%.1f |",
                       devs[i], name, c->redundant, r->imbalance, r->imbalance_max,
                       r->imbalance_window, 100 * r->cross_rows, 100 * r->cross_sends,
                       r->bytes_token / 1024, r->bytes_token_dedup / 1024, r->mem_max / 1e6);
            if (p.nodes > 1)
                printf(csv ? ",%.4f,%.4f" : " %.1f%% | %.1f%% |",
                       (csv ? 1 : 100) * r->cross_node_rows, (csv ? 1 : 100) * r->cross_node_sends);
            if (link)
                printf(csv ? ",%.4f,%.4f" : " %.2f | %.2f |", r->link_ms_step,
                       r->link_ms_step_dedup);
            printf("\n");
        }
    free(cells);
    return 0;
}
