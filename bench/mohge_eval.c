/* Held-out report for a MoHGE (or any MoE) model, computed by the C engine: per domain, the
 * held-out loss (mean next-token cross-entropy, nats) and the routing share of each expert
 * group (routed token-expert rows of the group over all rows, all MoE layers together); then,
 * over all domains, the tokens split into loss terciles (easy / medium / hard by the model's
 * own loss on them) with the group shares and the mean routed FFN width of each tercile, which
 * says whether narrow groups take the easy tokens.
 *
 * Tokens are fed one per engine step (decode with the KV cache) in windows of --window tokens,
 * so the per-expert row counters the engine keeps (engine_stats.expert_rows) give each token's
 * routing exactly. Models without groups count as one group.
 *
 *   mohge_eval --model models/mohge-small [--window 192] [--max-tokens 2048] \
 *       [--dtype auto|bfloat16|float32] [--quantization none|int8|int4] \
 *       [--kv-cache-dtype auto|bfloat16|float16|fp8_e4m3|fp8_e5m2|int8|float32] \
 *       shakespeare=tools/train/data/shakespeare.heldout.txt arithmetic=... json=...
 *
 * --dtype / --quantization load the weights as the server would, so the loss says what a
 * weight type costs in quality; --kv-cache-dtype does the same for the KV cache's type. For a continuous-experts (infmoe) model, --moe-samples K and
 * --moe-neuron-fraction F set the budget, and the report adds the FFN neurons computed per
 * token and layer (engine_stats.dev_cont_neurons) in place of the group columns, per domain and
 * per loss tercile: the loss a smaller budget costs and the work it saves; --moe-samples-adaptive
 * makes K an average spent by the router's uncertainty (a model calibrated by
 * tools/train/calibrate.py), to compare with a fixed K at equal work and to see whether the
 * hard tokens get the samples. --ablate GROUPS.json:IDS removes the members of coarse groups of
 * `moeserve analyze` from routing (bench/collab_ablation.py: which domain each group serves).
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "tokenizer.h"

#define MAX_DOMAINS 16

struct tok_rec {
    float loss;
    int domain;
    int rows_off; /* offset of this token's (G) group row counts in the rows array */
    float neurons; /* infmoe: FFN neurons computed for the token, per layer */
};

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* --ablate GROUPS.json:IDS: the (layer, expert) members of the listed coarse groups of a
 * `moeserve analyze` file are never routed to (model.ablated). Returns the pairs removed, or
 * -1 after a message. */
static int ablate(struct model *m, const char *spec)
{
    const char *colon = strrchr(spec, ':');
    if (!colon || colon == spec || !colon[1]) {
        fprintf(stderr, "mohge_eval: --ablate takes GROUPS.json:ID[,ID...]\n");
        return -1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%.*s", (int)(colon - spec), spec);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    json_t *groups = json_object_get(json_array_get(json_object_get(root, "levels"), 0), "groups");
    int E = m->desc.n_expert, L = m->desc.n_layer, n = 0;
    if (!json_is_array(groups) || json_integer_value(json_object_get(root, "n_expert")) != E) {
        fprintf(stderr, "mohge_eval: --ablate %s: not a GROUPS.json of this model\n", path);
        json_decref(root);
        return -1;
    }
    if (!m->ablated && !(m->ablated = calloc((size_t)L * (size_t)E, 1))) {
        json_decref(root);
        return -1;
    }
    for (const char *p = colon + 1; *p;) {
        char *end;
        long id = strtol(p, &end, 10);
        json_t *g = end != p && id >= 0 ? json_array_get(groups, (size_t)id) : NULL;
        if (!g || (*end && *end != ',')) {
            fprintf(stderr, "mohge_eval: --ablate %s: no group '%s'\n", path, p);
            json_decref(root);
            return -1;
        }
        size_t i;
        json_t *mb;
        json_array_foreach(json_object_get(g, "members"), i, mb)
        {
            json_int_t l = json_integer_value(json_object_get(mb, "layer")),
                       e = json_integer_value(json_object_get(mb, "expert"));
            if (l < 0 || l >= L || e < 0 || e >= E) continue;
            n += !m->ablated[l * E + e];
            m->ablated[l * E + e] = 1;
        }
        p = *end ? end + 1 : end;
    }
    json_decref(root);
    return n;
}

static void usage(void)
{
    fprintf(stderr, "usage: mohge_eval --model DIR [--window N] [--max-tokens N] [--devices N] "
                    "[--moe-top-k K] [--moe-samples K] [--moe-samples-adaptive] "
                    "[--moe-neuron-fraction F] [--ablate GROUPS.json:ID[,ID...]] "
                    "[--dtype auto|bfloat16|float32] "
                    "[--quantization none|int8|int4] [--kv-cache-dtype T] NAME=FILE...\n");
}

int main(int argc, char **argv)
{
    const char *model_dir = NULL;
    int window = 192, max_tokens = 2048, devices = 1, n_dom = 0, moe_k = 0, moe_s = 0;
    int kv_type = ENGINE_KV_AUTO;
    double moe_f = 0.0;
    bool moe_adaptive = false;
    const char *ablate_spec = NULL;
    const char *dom_name[MAX_DOMAINS], *dom_file[MAX_DOMAINS];
    char dom_buf[MAX_DOMAINS][64];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            model_dir = argv[++i];
        } else if (strcmp(argv[i], "--window") == 0 && i + 1 < argc) {
            window = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--devices") == 0 && i + 1 < argc) {
            devices = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--moe-top-k") == 0 && i + 1 < argc) {
            moe_k = atoi(argv[++i]); /* expert budget: quality cost of fewer experts */
        } else if (strcmp(argv[i], "--moe-samples") == 0 && i + 1 < argc) {
            moe_s = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--moe-samples-adaptive") == 0) {
            moe_adaptive = true; /* --moe-samples is then the average */
        } else if (strcmp(argv[i], "--moe-neuron-fraction") == 0 && i + 1 < argc) {
            moe_f = atof(argv[++i]);
        } else if (strcmp(argv[i], "--ablate") == 0 && i + 1 < argc) {
            ablate_spec = argv[++i];
        } else if (strcmp(argv[i], "--dtype") == 0 && i + 1 < argc) {
            if (model_dtype_parse(argv[++i], &lo.dtype) != 0) {
                fprintf(stderr, "mohge_eval: --dtype must be auto, bfloat16 or float32\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--kv-cache-dtype") == 0 && i + 1 < argc) {
            if (engine_kv_type_parse(argv[++i], &kv_type) != 0) {
                fprintf(stderr, "mohge_eval: --kv-cache-dtype must be one of "
                                ENGINE_KV_TYPE_NAMES "\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--quantization") == 0 && i + 1 < argc) {
            if (model_quant_parse(argv[++i], &lo.quant) != 0) {
                fprintf(stderr, "mohge_eval: --quantization must be none, int8 or int4\n");
                return 2;
            }
        } else if (strchr(argv[i], '=') && argv[i][0] != '-' && n_dom < MAX_DOMAINS) {
            const char *eq = strchr(argv[i], '=');
            snprintf(dom_buf[n_dom], sizeof dom_buf[n_dom], "%.*s", (int)(eq - argv[i]), argv[i]);
            dom_name[n_dom] = dom_buf[n_dom];
            dom_file[n_dom++] = eq + 1;
        } else {
            usage();
            return 2;
        }
    }
    if (!model_dir || n_dom == 0 || window < 2 || max_tokens < 2 || devices < 1) {
        usage();
        return 2;
    }

    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct engine *e = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    uint64_t *prev = NULL;
    struct tok_rec *recs = NULL;
    int *rows = NULL;
    float *sorted = NULL;
    int rc = 1;
    if (model_load(model_dir, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "mohge_eval: %s\n", err);
        return 1;
    }
    const struct model_desc *md = &m->desc;
    int V = md->vocab, E = md->n_expert, L = md->n_layer;
    bool cont = md->ffn == FFN_KIND_CONTINUOUS;
    if (ablate_spec) {
        if (E == 0 || devices != 1) {
            fprintf(stderr, "mohge_eval: --ablate needs routed experts and one device\n");
            goto fail;
        }
        int n_abl = ablate(m, ablate_spec);
        if (n_abl < 0) goto fail;
        printf("ablated: %d (layer, expert) pairs never routed to (%s)\n", n_abl, ablate_spec);
    }
    if (moe_adaptive && (!cont || md->cont_n_quant == 0)) {
        fprintf(stderr, "mohge_eval: --moe-samples-adaptive needs an infmoe model with an "
                        "adaptive_logvar_quantiles calibration (tools/train/calibrate.py)\n");
        goto fail;
    }
    if ((moe_s > 0 || moe_f > 0) &&
        (!cont || moe_s < 0 || moe_s > md->cont_max_samples || moe_f < 0 || moe_f > md->cont_fraction)) {
        fprintf(stderr, "mohge_eval: --moe-samples / --moe-neuron-fraction need an infmoe model "
                        "and its bounds (1..%d samples, fraction up to %g)\n",
                md->cont_max_samples, md->cont_fraction);
        goto fail;
    }
    /* group columns: none for an infmoe model (no experts; its columns are neurons) */
    int G = cont ? 0 : md->expert_group && md->n_group > 0 ? md->n_group : 1;
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = devices;
    ep.kv_type = kv_type;
    ep.max_batch_tokens = window;
    ep.max_seqs = 1;
    ep.max_model_len = window;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "mohge_eval: %s\n", err);
        goto fail;
    }
    size_t cells = (size_t)L * (size_t)(E > 0 ? E : 1);
    int cap_tok = n_dom * max_tokens;
    ids = malloc(sizeof(int32_t) * ((size_t)max_tokens + 1));
    logits = malloc(sizeof(float) * (size_t)V);
    prev = calloc(cells, sizeof *prev);
    recs = malloc(sizeof *recs * (size_t)cap_tok);
    rows = calloc((size_t)cap_tok * (size_t)(G > 0 ? G : 1), sizeof *rows);
    sorted = malloc(sizeof(float) * (size_t)cap_tok);
    if (!ids || !logits || !prev || !recs || !rows || !sorted) {
        fprintf(stderr, "mohge_eval: out of memory\n");
        goto fail;
    }
    const struct engine_stats *st = engine_get_stats(e);
    uint64_t neurons_prev = 0;
    int n_rec = 0;
    for (int d = 0; d < n_dom; d++) {
        size_t len = 0;
        char *text = read_file(dom_file[d], &len);
        if (!text) {
            fprintf(stderr, "mohge_eval: cannot read %s\n", dom_file[d]);
            goto fail;
        }
        int n = tok_encode(m->tok, text, len, false, ids, max_tokens + 1);
        free(text);
        if (n < 0) {
            fprintf(stderr, "mohge_eval: %s: tokenizer failed\n", dom_file[d]);
            goto fail;
        }
        if (n > max_tokens + 1) n = max_tokens + 1;
        for (int s = 0; s + 1 < n; s += window) {
            struct kv_seq seq;
            if (engine_seq_init(e, &seq) != 0) goto fail;
            memcpy(prev, st->expert_rows, cells * sizeof *prev);
            for (int t = 0; t < window && s + t + 1 < n; t++) {
                struct engine_item it = {.kv = &seq,
                                         .tokens = ids + s + t,
                                         .n_tokens = 1,
                                         .pos = t,
                                         .moe_top_k = moe_k,
                                         .moe_samples = moe_s,
                                         .moe_neuron_fraction = moe_f,
                                         .moe_samples_adaptive = moe_adaptive,
                                         .n_logits = 1,
                                         .logits = logits};
                if (engine_step(e, &it, 1, err, sizeof err) != 0) {
                    fprintf(stderr, "mohge_eval: %s\n", err);
                    engine_seq_free(e, &seq);
                    goto fail;
                }
                double mx = -INFINITY, z = 0.0;
                for (int v = 0; v < V; v++)
                    mx = logits[v] > mx ? logits[v] : mx;
                for (int v = 0; v < V; v++)
                    z += exp((double)logits[v] - mx);
                struct tok_rec *r = &recs[n_rec];
                r->loss = (float)(mx + log(z) - logits[ids[s + t + 1]]);
                r->domain = d;
                r->rows_off = n_rec * G;
                uint64_t neurons_now = 0;
                for (int dv = 0; dv < devices && cont; dv++) neurons_now += st->dev_cont_neurons[dv];
                r->neurons = (float)(neurons_now - neurons_prev) / (float)L;
                neurons_prev = neurons_now;
                for (size_t c = 0; c < cells && E > 0 && G > 0; c++) {
                    uint64_t delta = st->expert_rows[c] - prev[c];
                    int ex = (int)(c % (size_t)E);
                    rows[r->rows_off + (G > 1 ? md->expert_group[ex] : 0)] += (int)delta;
                    prev[c] = st->expert_rows[c];
                }
                n_rec++;
            }
            engine_seq_free(e, &seq);
        }
    }

    /* Per-domain table. */
    if (cont) {
        printf("model %s: continuous experts, %d neurons per layer", model_dir, md->cont_d_ff);
    } else {
        printf("model %s: %d groups, widths", model_dir, G);
        for (int g = 0; g < G; g++) {
            int w = 0;
            for (int x = 0; x < E; x++)
                if ((G > 1 ? md->expert_group[x] : 0) == g) w = md->expert_d_ff[x];
            printf(" %d", w);
        }
    }
    printf("; window %d, up to %d tokens per domain\n", window, max_tokens);
    if (cont && n_rec > 0) {
        uint64_t neurons = 0;
        for (int d = 0; d < devices; d++) neurons += st->dev_cont_neurons[d];
        printf("continuous experts: K = %d%s, neuron fraction %g: %.1f of %d FFN neurons "
               "computed per token and layer\n",
               moe_s > 0 ? moe_s : md->cont_samples, moe_adaptive ? " (adaptive average)" : "", moe_f > 0 ? moe_f : md->cont_fraction,
               (double)neurons / ((double)n_rec * L), md->cont_d_ff);
    }
    printf("\n");
    printf("| domain | tokens | loss (nats) | ppl |%s", cont ? " FFN neurons / layer |" : "");
    for (int g = 0; g < G; g++)
        printf(" group %d |", g);
    printf("\n|---|---|---|---|%s", cont ? "---|" : "");
    for (int g = 0; g < G; g++)
        printf("---|");
    printf("\n");
    for (int d = 0; d < n_dom; d++) {
        double loss = 0.0, tot = 0.0, nsum = 0.0, gsum[MODEL_MAX_GROUPS] = {0};
        int cnt = 0;
        for (int i = 0; i < n_rec; i++) {
            if (recs[i].domain != d) continue;
            loss += recs[i].loss;
            nsum += recs[i].neurons;
            cnt++;
            for (int g = 0; g < G; g++) {
                gsum[g] += rows[recs[i].rows_off + g];
                tot += rows[recs[i].rows_off + g];
            }
        }
        printf("| %s | %d | %.4f | %.2f |", dom_name[d], cnt, cnt ? loss / cnt : 0.0,
               cnt ? exp(loss / cnt) : 0.0);
        if (cont) printf(" %.1f |", cnt ? nsum / cnt : 0.0);
        for (int g = 0; g < G; g++)
            printf(" %.1f%% |", tot > 0 ? 100.0 * gsum[g] / tot : 0.0);
        printf("\n");
    }

    /* Loss terciles over all tokens: do narrow groups take the easy tokens? */
    for (int i = 0; i < n_rec; i++)
        sorted[i] = recs[i].loss;
    qsort(sorted, (size_t)n_rec, sizeof(float), cmp_float);
    float cut1 = n_rec ? sorted[n_rec / 3] : 0.0f, cut2 = n_rec ? sorted[2 * n_rec / 3] : 0.0f;
    static const char *bucket[] = {"easy (lowest-loss third)", "medium", "hard (highest third)"};
    printf("\n| tokens by loss | tokens | mean loss | %s |",
           cont ? "FFN neurons / layer" : "mean routed width");
    for (int g = 0; g < G; g++)
        printf(" group %d |", g);
    printf("\n|---|---|---|---|");
    for (int g = 0; g < G; g++)
        printf("---|");
    printf("\n");
    for (int b = 0; b < 3; b++) {
        double loss = 0.0, tot = 0.0, width = 0.0, nsum = 0.0, gsum[MODEL_MAX_GROUPS] = {0};
        int cnt = 0;
        for (int i = 0; i < n_rec; i++) {
            float l = recs[i].loss;
            int bi = l < cut1 ? 0 : l < cut2 ? 1 : 2;
            if (bi != b) continue;
            loss += l;
            nsum += recs[i].neurons;
            cnt++;
            for (int g = 0; g < G; g++) {
                int r = rows[recs[i].rows_off + g];
                gsum[g] += r;
                tot += r;
                int w = 0;
                for (int x = 0; x < E; x++)
                    if ((G > 1 ? md->expert_group[x] : 0) == g) w = md->expert_d_ff[x];
                width += (double)r * w;
            }
        }
        printf("| %s | %d | %.4f | %.1f |", bucket[b], cnt, cnt ? loss / cnt : 0.0,
               cont ? (cnt ? nsum / cnt : 0.0) : tot > 0 ? width / tot : 0.0);
        for (int g = 0; g < G; g++)
            printf(" %.1f%% |", tot > 0 ? 100.0 * gsum[g] / tot : 0.0);
        printf("\n");
    }
    rc = 0;
fail:
    free(ids);
    free(logits);
    free(prev);
    free(recs);
    free(rows);
    free(sorted);
    engine_free(e);
    model_free(m);
    return rc;
}
