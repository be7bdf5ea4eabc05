/* Live MoE statistics for the dashboard (dash.h): copies of the engine's routing counters taken
 * on the scheduler thread, a short history of per-device load, and the collaboration view from
 * the reservoir of served tokens. */
#include "dash.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "collab/collab_data.h"
#include "collab/collab_dict.h"
#include "collab/collab_live.h"
#include "common.h"
#include "engine.h"
#include "model.h"
#include "scheduler.h"

#define DASH_HISTORY    120  /* points of per-device load kept */
#define DASH_SLOT_S     1.0  /* seconds each history point covers */
#define DASH_COPY_S     0.25 /* counters copied at most this often */
#define DASH_MAX_NODES  128  /* graph nodes (the groups' members, else the busiest pairs) */
#define DASH_MAX_EDGES  256
#define DASH_MAX_GROUPS 64

struct dash_group {
    int n;
    int *feat;       /* (n) l * E + e */
    float *weight;   /* (n) */
    char label[160]; /* what distinguishes its tokens (GROUPS.json "label"), "" when absent */
};

struct dash {
    pthread_mutex_t mu;
    int n_dev, n_moe, n_expert, top_k;
    int *moe_layer; /* (n_moe) model layer of each MoE layer */
    int *width;     /* (n_expert) */
    int *egroup;    /* (n_expert) MoHGE / DeepSeek group, or -1 */
    double t0, last_copy;
    /* copies, under mu */
    uint64_t steps, tokens;
    uint64_t *dev_rows;    /* (n_dev) */
    double *dev_flops;     /* (n_dev) */
    uint64_t *expert_rows; /* (n_moe, n_expert) */
    /* History ring, under mu: one point per DASH_SLOT_S of wall time since t0, whether or not
     * anything ran in it, with the expert FLOPs per device copied during that slot. Slots are
     * closed by whichever thread looks first after they end (a step, or a GET of the stats),
     * so an idle server's history goes on with zero points instead of stopping at the last
     * busy second. */
    int hist_n, hist_at;
    double hist_t[DASH_HISTORY];
    double *hist_load;  /* (DASH_HISTORY, n_dev) */
    int64_t slot;       /* the slot being filled: [t0 + slot, t0 + slot + 1) * DASH_SLOT_S */
    double *slot_base;  /* (n_dev) dev_flops when the slot began */
    /* collaboration */
    struct clive *live;
    int n_groups;
    struct dash_group groups[DASH_MAX_GROUPS];
    struct cdict dict; /* the groups as a dictionary (members' weights, unit norm) */
    /* request tags (moe_tag), under mu: name of each number; 0 is "untagged" */
    int n_tags;
    char tag_name[DASH_MAX_TAGS][65];
};

static int load_groups(struct dash *d, const char *path, char *err, size_t errlen)
{
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    int rc = -1;
    if (!root) {
        ms_errf(err, errlen, "--collab-groups %s: %s (line %d)", path, je.text, je.line);
        goto out;
    }
    json_t *nl = json_object_get(root, "n_layer"), *ne = json_object_get(root, "n_expert");
    json_t *levels = json_object_get(root, "levels");
    json_t *groups = json_object_get(json_array_get(levels, 0), "groups");
    if (!json_is_integer(nl) || !json_is_integer(ne) || !json_is_array(groups)) {
        ms_errf(err, errlen,
                "--collab-groups %s: not a GROUPS.json of `moeserve analyze` (no "
                "n_layer, n_expert, levels[0].groups)",
                path);
        goto out;
    }
    if (json_integer_value(nl) != d->n_moe || json_integer_value(ne) != d->n_expert) {
        ms_errf(err, errlen,
                "--collab-groups %s: groups of a model with %d MoE layers and %d experts; this "
                "one has %d and %d",
                path, (int)json_integer_value(nl), (int)json_integer_value(ne), d->n_moe,
                d->n_expert);
        goto out;
    }
    size_t i;
    json_t *g;
    json_array_foreach(groups, i, g)
    {
        if (d->n_groups == DASH_MAX_GROUPS) break;
        json_t *members = json_object_get(g, "members");
        size_t n = json_array_size(members);
        struct dash_group *dg = &d->groups[d->n_groups++];
        const char *label = json_string_value(json_object_get(g, "label"));
        snprintf(dg->label, sizeof dg->label, "%s", label ? label : "");
        dg->feat = malloc(sizeof(int) * (n ? n : 1));
        dg->weight = malloc(sizeof(float) * (n ? n : 1));
        if (!dg->feat || !dg->weight) {
            ms_errf(err, errlen, "out of memory");
            goto out;
        }
        size_t j;
        json_t *m;
        json_array_foreach(members, j, m)
        {
            json_t *l = json_object_get(m, "moe_layer"), *e = json_object_get(m, "expert");
            json_t *w = json_object_get(m, "weight");
            if (!json_is_integer(l) || !json_is_integer(e) || !json_is_number(w) ||
                json_integer_value(l) < 0 || json_integer_value(l) >= d->n_moe ||
                json_integer_value(e) < 0 || json_integer_value(e) >= d->n_expert) {
                ms_errf(err, errlen,
                        "--collab-groups %s: group %zu member %zu is not a (moe_layer, "
                        "expert, weight) of this model",
                        path, i, j);
                goto out;
            }
            dg->feat[dg->n] = (int)json_integer_value(l) * d->n_expert + (int)json_integer_value(e);
            dg->weight[dg->n++] = (float)json_number_value(w);
        }
    }
    /* the groups as a dictionary: the sample is encoded with it at every poll */
    int F = d->n_moe * d->n_expert, G = d->n_groups;
    d->dict = (struct cdict){.n_atoms = G, .n_feat = F, .lambda = 0.1};
    d->dict.atom = calloc((size_t)(G > 0 ? G : 1) * F, sizeof *d->dict.atom);
    d->dict.gram = calloc((size_t)(G > 0 ? G : 1) * (G > 0 ? G : 1), sizeof *d->dict.gram);
    if (!d->dict.atom || !d->dict.gram) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    for (int q = 0; q < G; q++) {
        double nn = 0.0;
        for (int k = 0; k < d->groups[q].n; k++)
            nn += (double)d->groups[q].weight[k] * d->groups[q].weight[k];
        for (int k = 0; k < d->groups[q].n; k++)
            d->dict.atom[(size_t)q * F + d->groups[q].feat[k]] =
                nn > 0 ? (float)(d->groups[q].weight[k] / sqrt(nn)) : 0.0f;
    }
    for (int a = 0; a < G; a++)
        for (int b = 0; b < G; b++) {
            double sg = 0.0;
            for (int k = 0; k < d->groups[b].n; k++) {
                int f = d->groups[b].feat[k];
                sg += (double)d->dict.atom[(size_t)a * F + f] * d->dict.atom[(size_t)b * F + f];
            }
            d->dict.gram[a * G + b] = sg;
        }
    rc = 0;
out:
    json_decref(root);
    return rc;
}

void dash_free(struct dash *d)
{
    if (!d) return;
    pthread_mutex_destroy(&d->mu);
    free(d->moe_layer);
    free(d->width);
    free(d->egroup);
    free(d->dev_rows);
    free(d->dev_flops);
    free(d->expert_rows);
    free(d->hist_load);
    free(d->slot_base);
    clive_free(d->live);
    free(d->dict.atom);
    free(d->dict.gram);
    for (int i = 0; i < d->n_groups; i++) {
        free(d->groups[i].feat);
        free(d->groups[i].weight);
    }
    free(d);
}

int dash_create(struct engine *e, const char *groups_path, int reservoir, struct dash **out,
                char *err, size_t errlen)
{
    *out = NULL;
    const struct model_desc *md = &engine_model(e)->desc;
    struct dash *d = calloc(1, sizeof *d);
    if (!d) return ms_errf(err, errlen, "out of memory");
    pthread_mutex_init(&d->mu, NULL);
    d->n_tags = 1;
    snprintf(d->tag_name[0], sizeof d->tag_name[0], "untagged");
    d->n_dev = engine_get_params(e)->n_devices;
    for (int l = 0; l < md->n_layer; l++)
        d->n_moe += md->layer_is_moe[l];
    d->n_expert = md->n_expert;
    d->top_k = md->top_k;
    int L = d->n_moe > 0 ? d->n_moe : 1, E = d->n_expert > 0 ? d->n_expert : 1;
    d->moe_layer = malloc(sizeof(int) * (size_t)L);
    d->width = malloc(sizeof(int) * (size_t)E);
    d->egroup = malloc(sizeof(int) * (size_t)E);
    d->dev_rows = calloc((size_t)d->n_dev, sizeof *d->dev_rows);
    d->dev_flops = calloc((size_t)d->n_dev, sizeof *d->dev_flops);
    d->slot_base = calloc((size_t)d->n_dev, sizeof *d->slot_base);
    d->expert_rows = calloc((size_t)L * E, sizeof *d->expert_rows);
    d->hist_load = calloc((size_t)DASH_HISTORY * d->n_dev, sizeof *d->hist_load);
    if (!d->moe_layer || !d->width || !d->egroup || !d->dev_rows || !d->dev_flops ||
        !d->slot_base || !d->expert_rows || !d->hist_load) {
        dash_free(d);
        return ms_errf(err, errlen, "out of memory");
    }
    for (int l = 0, k = 0; l < md->n_layer; l++)
        if (md->layer_is_moe[l]) d->moe_layer[k++] = l;
    for (int x = 0; x < d->n_expert; x++) {
        d->width[x] = md->expert_d_ff ? md->expert_d_ff[x] : 0;
        d->egroup[x] = md->expert_group ? md->expert_group[x] : -1;
    }
    d->t0 = ms_now();
    if ((groups_path || reservoir > 0) && d->n_moe == 0) {
        dash_free(d);
        return ms_errf(err, errlen,
                       "--collab-groups/--collab-reservoir: the model has no MoE "
                       "layer");
    }
    if (groups_path && load_groups(d, groups_path, err, errlen) != 0) {
        dash_free(d);
        return -1;
    }
    if (reservoir > 0 &&
        clive_create(d->n_moe, d->n_expert, d->top_k, reservoir, 1, &d->live, err, errlen) != 0) {
        dash_free(d);
        return -1;
    }
    *out = d;
    return 0;
}

uint16_t dash_tag_id(struct dash *d, const char *tag)
{
    if (!tag) return 0;
    pthread_mutex_lock(&d->mu);
    int id = 1;
    while (id < d->n_tags && strcmp(d->tag_name[id], tag) != 0)
        id++;
    if (id == d->n_tags) {
        if (d->n_tags < DASH_MAX_TAGS - 1) {
            snprintf(d->tag_name[id], sizeof d->tag_name[id], "%s", tag);
            d->n_tags++;
        } else { /* the last number is every later name's */
            id = DASH_MAX_TAGS - 1;
            snprintf(d->tag_name[id], sizeof d->tag_name[id], "other");
            d->n_tags = DASH_MAX_TAGS;
        }
    }
    pthread_mutex_unlock(&d->mu);
    return (uint16_t)id;
}

int dash_tag_count(struct dash *d)
{
    pthread_mutex_lock(&d->mu);
    int n = d->n_tags;
    pthread_mutex_unlock(&d->mu);
    return n;
}

void dash_tag_name(struct dash *d, int id, char *buf, size_t n)
{
    pthread_mutex_lock(&d->mu);
    snprintf(buf, n, "%s", id >= 0 && id < d->n_tags ? d->tag_name[id] : "");
    pthread_mutex_unlock(&d->mu);
}

/* Under mu: closes every slot that ended by `now`. A slot's load is what the copies gained
 * during it; the copies change only when steps run, so the slots of an idle stretch get zero.
 * After a stretch longer than the ring only its last DASH_HISTORY slots are made (the slot
 * that held the last work is then out of the window too). */
static void advance_history(struct dash *d, double now)
{
    int64_t cur = (int64_t)floor((now - d->t0) / DASH_SLOT_S);
    if (cur - d->slot > DASH_HISTORY) {
        memcpy(d->slot_base, d->dev_flops, sizeof(double) * (size_t)d->n_dev);
        d->slot = cur - DASH_HISTORY;
    }
    for (; d->slot < cur; d->slot++) {
        double *row = d->hist_load + (size_t)d->hist_at * d->n_dev;
        for (int i = 0; i < d->n_dev; i++) {
            row[i] = d->dev_flops[i] - d->slot_base[i];
            d->slot_base[i] = d->dev_flops[i];
        }
        d->hist_t[d->hist_at] = (double)(d->slot + 1) * DASH_SLOT_S;
        d->hist_at = (d->hist_at + 1) % DASH_HISTORY;
        if (d->hist_n < DASH_HISTORY) d->hist_n++;
    }
}

void dash_after_step(struct dash *d, struct engine *e)
{
    if (d->live) {
        const struct engine_routing *rt = engine_last_routing(e);
        if (rt && rt->n_tok > 0) clive_add(d->live, rt->ids, rt->tags, rt->n_tok, rt->layer_stride);
    }
    double now = ms_now();
    if (now - d->last_copy < DASH_COPY_S) return;
    d->last_copy = now;
    const struct engine_stats *es = engine_get_stats(e);
    const struct model_desc *md = &engine_model(e)->desc;
    pthread_mutex_lock(&d->mu);
    d->steps = es->steps;
    d->tokens = es->tokens;
    for (int i = 0; i < d->n_dev; i++)
        d->dev_rows[i] = es->dev_routed_rows[i];
    for (int l = 0; l < d->n_moe; l++)
        memcpy(d->expert_rows + (size_t)l * d->n_expert,
               es->expert_rows + (size_t)d->moe_layer[l] * md->n_expert,
               sizeof(uint64_t) * (size_t)d->n_expert);
    /* the slots that ended before this copy get what was copied before it */
    advance_history(d, now);
    for (int i = 0; i < d->n_dev; i++)
        d->dev_flops[i] = es->dev_expert_flops[i];
    pthread_mutex_unlock(&d->mu);
}

/* --- the JSON document --------------------------------------------------------------------- */

struct edge {
    int a, b;
    double w;
};

static int cmp_edge(const void *x, const void *y)
{
    const struct edge *a = x, *b = y;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    if (a->a != b->a) return a->a - b->a;
    return a->b - b->b;
}

/* The reservoir's part: group usage and the graph (nodes, edges). */
static json_t *collab_json(struct dash *d, const uint64_t *expert_rows)
{
    json_t *o = json_object();
    int E = d->n_expert, F = d->n_moe * d->n_expert;
    size_t cap = d->live ? (size_t)clive_capacity(d->live) : 0;
    int W = d->live ? clive_row_width(d->live) : 0;
    int32_t *rows = cap ? malloc(sizeof(int32_t) * cap * (size_t)W) : NULL;
    uint16_t *tags = cap ? malloc(sizeof(uint16_t) * cap) : NULL;
    uint64_t seen = 0;
    size_t n = rows && tags ? clive_snapshot(d->live, rows, tags, &seen) : 0;
    char names[DASH_MAX_TAGS][65];
    pthread_mutex_lock(&d->mu);
    int n_tags = d->n_tags;
    memcpy(names, d->tag_name, sizeof names);
    pthread_mutex_unlock(&d->mu);
    json_object_set_new(o, "reservoir", json_integer((json_int_t)cap));
    json_object_set_new(o, "sampled_tokens", json_integer((json_int_t)n));
    json_object_set_new(o, "seen_tokens", json_integer((json_int_t)seen));
    /* nodes: the groups' members, else the busiest (layer, expert) pairs */
    int node_of_feat_cap = F > 0 ? F : 1;
    int *node_of = malloc(sizeof(int) * (size_t)node_of_feat_cap);
    int nodes[DASH_MAX_NODES], node_group[DASH_MAX_NODES], n_nodes = 0;
    double *pair = calloc((size_t)DASH_MAX_NODES * DASH_MAX_NODES, sizeof *pair);
    if (!node_of || !pair) goto out;
    for (int f = 0; f < F; f++)
        node_of[f] = -1;
    for (int g = 0; g < d->n_groups; g++)
        for (int i = 0; i < d->groups[g].n && n_nodes < DASH_MAX_NODES; i++) {
            int f = d->groups[g].feat[i];
            if (node_of[f] >= 0) continue;
            node_of[f] = n_nodes;
            node_group[n_nodes] = g;
            nodes[n_nodes++] = f;
        }
    if (d->n_groups == 0)
        while (n_nodes < DASH_MAX_NODES && n_nodes < F) {
            int best = -1;
            for (int f = 0; f < F; f++)
                if (node_of[f] < 0 && (best < 0 || expert_rows[f] > expert_rows[best])) best = f;
            if (best < 0 || expert_rows[best] == 0) break;
            node_of[best] = n_nodes;
            node_group[n_nodes] = -1;
            nodes[n_nodes++] = best;
        }
    /* co-activation over the sample: pairs of nodes chosen by the same token */
    for (size_t r = 0; r < n; r++) {
        const int32_t *row = rows + r * W;
        for (int i = 0; i < W; i++) {
            int a = row[i] >= 0 ? node_of[row[i]] : -1;
            if (a < 0) continue;
            for (int j = i + 1; j < W; j++) {
                int b = row[j] >= 0 ? node_of[row[j]] : -1;
                if (b < 0 || b == a) continue;
                pair[(size_t)(a < b ? a : b) * DASH_MAX_NODES + (a < b ? b : a)] += 1.0;
            }
        }
    }
    json_t *jn = json_array();
    for (int i = 0; i < n_nodes; i++)
        json_array_append_new(jn, json_pack("{s:i, s:i, s:i, s:I}", "moe_layer", nodes[i] / E,
                                            "expert", nodes[i] % E, "group", node_group[i],
                                            "tokens", (json_int_t)expert_rows[nodes[i]]));
    json_object_set_new(o, "nodes", jn);
    struct edge *edges = malloc(sizeof *edges * (size_t)(n_nodes * (n_nodes - 1) / 2 + 1));
    int n_edges = 0;
    if (edges) {
        for (int a = 0; a < n_nodes; a++)
            for (int b = a + 1; b < n_nodes; b++)
                if (pair[(size_t)a * DASH_MAX_NODES + b] > 0)
                    edges[n_edges++] =
                        (struct edge){a, b, pair[(size_t)a * DASH_MAX_NODES + b] / (double)n};
        qsort(edges, (size_t)n_edges, sizeof *edges, cmp_edge);
    }
    json_t *je = json_array();
    for (int i = 0; i < n_edges && i < DASH_MAX_EDGES; i++)
        json_array_append_new(je, json_pack("{s:i, s:i, s:f}", "source", edges[i].a, "target",
                                            edges[i].b, "weight", edges[i].w));
    free(edges);
    json_object_set_new(o, "edges", je);
    /* live group usage: the sample encoded with the groups as a dictionary (the members'
     * weights, each group scaled to unit norm), the mean code and the share of tokens using it */
    json_t *jg = json_array();
    if (d->n_groups > 0) {
        const struct cdict *dict = &d->dict;
        struct cdata x = {.n_layer = d->n_moe, .n_expert = E, .top_k = d->top_k, .n_feat = F};
        x.ptr = malloc(sizeof(size_t) * (n + 1));
        x.idx = malloc(sizeof(int32_t) * (n * (size_t)W + 1));
        x.val = malloc(sizeof(float) * (n * (size_t)W + 1));
        float *code = malloc(sizeof(float) * (size_t)d->n_groups);
        double *work = malloc(sizeof(double) * (size_t)d->n_groups);
        double *sum = calloc((size_t)d->n_groups, sizeof *sum);
        double *used = calloc((size_t)d->n_groups, sizeof *used);
        /* per tag: tokens, and tokens using each group */
        double tag_n[DASH_MAX_TAGS] = {0};
        double *tag_used = calloc((size_t)d->n_groups * DASH_MAX_TAGS, sizeof *tag_used);
        if (x.ptr && x.idx && x.val && code && work && sum && used && tag_used) {
            size_t at = 0;
            x.ptr[0] = 0;
            for (size_t r = 0; r < n; r++) {
                const int32_t *row = rows + r * W;
                size_t start = at;
                for (int i = 0; i < W; i++)
                    if (row[i] >= 0) x.idx[at++] = row[i];
                for (size_t q = start; q < at; q++)
                    x.val[q] = (float)(1.0 / sqrt((double)(at - start)));
                x.ptr[++x.n_row] = at;
            }
            for (size_t r = 0; r < x.n_row; r++) {
                int t = tags[r] < DASH_MAX_TAGS ? tags[r] : DASH_MAX_TAGS - 1;
                tag_n[t] += 1;
                cdict_encode(dict, &x, r, code, work);
                for (int g = 0; g < d->n_groups; g++) {
                    sum[g] += code[g];
                    used[g] += code[g] > 0.0f;
                    tag_used[(size_t)g * DASH_MAX_TAGS + t] += code[g] > 0.0f;
                }
            }
            for (int g = 0; g < d->n_groups; g++) {
                json_t *by_tag = json_object();
                for (int t = 0; t < n_tags; t++)
                    if (tag_n[t] > 0)
                        json_object_set_new(
                            by_tag, names[t],
                            json_real(tag_used[(size_t)g * DASH_MAX_TAGS + t] / tag_n[t]));
                json_array_append_new(
                    jg,
                    json_pack("{s:i, s:i, s:s, s:f, s:f, s:o}", "id", g, "members",
                              d->groups[g].n, "label", d->groups[g].label, "usage",
                              x.n_row ? sum[g] / (double)x.n_row : 0.0, "share",
                              x.n_row ? used[g] / (double)x.n_row : 0.0, "share_by_tag", by_tag));
            }
        }
        free(tag_used);
        free(x.ptr);
        free(x.idx);
        free(x.val);
        free(code);
        free(work);
        free(sum);
        free(used);
    }
    json_object_set_new(o, "groups", jg);
    json_t *jt = json_object();
    for (size_t r = 0; r < n; r++) {
        int t = tags[r] < DASH_MAX_TAGS ? tags[r] : DASH_MAX_TAGS - 1;
        json_t *c = json_object_get(jt, names[t]);
        json_object_set_new(jt, names[t], json_integer(c ? json_integer_value(c) + 1 : 1));
    }
    json_object_set_new(o, "sampled_by_tag", jt);
out:
    free(rows);
    free(tags);
    free(node_of);
    free(pair);
    return o;
}

char *dash_stats_json(struct dash *d, const struct sched_stats *st, const char *model_name)
{
    int L = d->n_moe, E = d->n_expert, N = d->n_dev;
    uint64_t *rows = malloc(sizeof(uint64_t) * (size_t)(L > 0 ? L : 1) * (E > 0 ? E : 1));
    uint64_t *dev_rows = malloc(sizeof(uint64_t) * (size_t)N);
    double *dev_flops = malloc(sizeof(double) * (size_t)N);
    double *hist = malloc(sizeof(double) * DASH_HISTORY * (size_t)N);
    double hist_t[DASH_HISTORY];
    if (!rows || !dev_rows || !dev_flops || !hist) {
        free(rows), free(dev_rows), free(dev_flops), free(hist);
        return NULL;
    }
    pthread_mutex_lock(&d->mu);
    advance_history(d, ms_now()); /* the slots an idle server had no step to close */
    memcpy(rows, d->expert_rows, sizeof(uint64_t) * (size_t)L * E);
    memcpy(dev_rows, d->dev_rows, sizeof(uint64_t) * (size_t)N);
    memcpy(dev_flops, d->dev_flops, sizeof(double) * (size_t)N);
    int hn = d->hist_n, h0 = (d->hist_at - d->hist_n + DASH_HISTORY) % DASH_HISTORY;
    for (int i = 0; i < hn; i++) {
        int k = (h0 + i) % DASH_HISTORY;
        hist_t[i] = d->hist_t[k];
        memcpy(hist + (size_t)i * N, d->hist_load + (size_t)k * N, sizeof(double) * (size_t)N);
    }
    uint64_t steps = d->steps, tokens = d->tokens;
    pthread_mutex_unlock(&d->mu);

    json_t *o = json_object();
    json_object_set_new(o, "object", json_string("moe.stats"));
    json_object_set_new(o, "model", json_string(model_name ? model_name : ""));
    json_object_set_new(o, "uptime_s", json_real(ms_now() - d->t0));
    json_object_set_new(o, "steps", json_integer((json_int_t)steps));
    json_object_set_new(o, "tokens", json_integer((json_int_t)tokens));
    if (st)
        json_object_set_new(
            o, "requests",
            json_pack("{s:i, s:i, s:f}", "running", st->running, "waiting", st->waiting, "kv_usage",
                      st->kv_blocks_total ? 1.0 - (double)st->kv_blocks_free / st->kv_blocks_total
                                          : 0.0));
    if (st && st->spec_k > 0) {
        /* speculative decoding: vLLM's counters, and the expert rows drafts cost */
        json_t *pp = json_array();
        for (int j = 0; j < st->spec_k && j < SPEC_MAX_K; j++)
            json_array_append_new(pp, json_integer((json_int_t)st->spec_accepted_per_pos[j]));
        json_object_set_new(
            o, "speculative",
            json_pack("{s:i, s:I, s:I, s:I, s:o, s:f, s:I, s:I, s:I, s:I}", "num_speculative_tokens",
                      st->spec_k, "num_drafts", (json_int_t)st->spec_drafts, "num_draft_tokens",
                      (json_int_t)st->spec_draft_tokens, "num_accepted_tokens",
                      (json_int_t)st->spec_accepted_tokens, "num_accepted_tokens_per_pos", pp,
                      "acceptance_rate",
                      st->spec_draft_tokens
                          ? (double)st->spec_accepted_tokens / (double)st->spec_draft_tokens
                          : 0.0,
                      "draft_expert_rows", (json_int_t)st->spec_draft_rows,
                      "rejected_expert_rows", (json_int_t)st->spec_rejected_rows,
                      "state_rollbacks", (json_int_t)st->spec_rollbacks, "stopped_requests",
                      (json_int_t)st->spec_stopped));
    }
    json_t *ml = json_array(), *w = json_array(), *eg = json_array();
    for (int l = 0; l < L; l++)
        json_array_append_new(ml, json_integer(d->moe_layer[l]));
    for (int x = 0; x < E; x++) {
        json_array_append_new(w, json_integer(d->width[x]));
        json_array_append_new(eg, json_integer(d->egroup[x]));
    }
    json_object_set_new(o, "layers", ml);
    json_object_set_new(o, "n_expert", json_integer(E));
    json_object_set_new(o, "expert_width", w);
    json_object_set_new(o, "expert_group", eg);
    json_t *devs = json_array();
    double mx = 0.0, sum = 0.0;
    for (int i = 0; i < N; i++) {
        json_array_append_new(devs,
                              json_pack("{s:i, s:I, s:f}", "device", i, "routed_rows",
                                        (json_int_t)dev_rows[i], "expert_flops", dev_flops[i]));
        mx = dev_flops[i] > mx ? dev_flops[i] : mx;
        sum += dev_flops[i];
    }
    json_object_set_new(o, "devices", devs);
    json_object_set_new(o, "imbalance", json_real(sum > 0 ? mx / (sum / N) : 0.0));
    json_t *jh = json_array();
    for (int i = 0; i < hn; i++) {
        json_t *load = json_array();
        double m = 0.0, s = 0.0;
        for (int k = 0; k < N; k++) {
            double v = hist[(size_t)i * N + k];
            json_array_append_new(load, json_real(v));
            m = v > m ? v : m;
            s += v;
        }
        json_array_append_new(jh, json_pack("{s:f, s:o, s:f}", "t", hist_t[i], "load", load,
                                            "imbalance", s > 0 ? m / (s / N) : 0.0));
    }
    json_object_set_new(o, "history", jh);
    json_t *heat = json_array();
    for (int l = 0; l < L; l++) {
        json_t *r = json_array();
        for (int x = 0; x < E; x++)
            json_array_append_new(r, json_integer((json_int_t)rows[(size_t)l * E + x]));
        json_array_append_new(heat, r);
    }
    json_object_set_new(o, "expert_tokens", heat);
    json_object_set_new(o, "collab", collab_json(d, rows));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    free(rows);
    free(dev_rows);
    free(dev_flops);
    free(hist);
    return s;
}
