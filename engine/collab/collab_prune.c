/* Expert pruning by collaboration groups, frequency or chance, and the pruned model folder
 * (collab_prune.h). */
#include "collab/collab_prune.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "collab/collab_data.h"
#include "collab/collab_dict.h"
#include "common.h"
#include "model.h"
#include "rng.h"
#include "safetensors.h"
#include "st_writer.h"

static const char *const method_names[] = {"collab", "frequency", "random"};

int cprune_method_parse(const char *s, enum cprune_method *out)
{
    for (int i = 0; i < 3; i++)
        if (strcmp(s, method_names[i]) == 0) {
            *out = (enum cprune_method)i;
            return 0;
        }
    return -1;
}

const char *cprune_method_name(enum cprune_method m)
{
    return (unsigned)m < 3 ? method_names[m] : "?";
}

void cprune_scores(enum cprune_method m, const struct cdata *x, const struct cdict *d,
                   const float *codes, uint64_t seed, double *score)
{
    int F = x->n_feat;
    if (m == CPRUNE_METHOD_RANDOM) {
        struct ms_rng r;
        ms_rng_seed(&r, seed);
        for (int f = 0; f < F; f++)
            score[f] = ms_rng_uniform(&r);
        return;
    }
    if (m == CPRUNE_METHOD_FREQUENCY || !d || !codes) {
        for (int f = 0; f < F; f++)
            score[f] = (double)x->count[f];
        return;
    }
    /* sum_t sum_k a_tk D_kf = sum_k (sum_t a_tk) D_kf */
    int K = d->n_atoms;
    double *use = calloc((size_t)K, sizeof *use);
    for (int f = 0; f < F; f++)
        score[f] = 0.0;
    if (!use) return;
    for (size_t r = 0; r < x->n_row; r++)
        for (int k = 0; k < K; k++)
            use[k] += codes[r * K + k];
    for (int k = 0; k < K; k++)
        for (int f = 0; f < F; f++)
            score[f] += use[k] * d->atom[(size_t)k * F + f];
    free(use);
}

struct ranked {
    int e;
    double score;
    uint64_t count;
};

static int cmp_ranked(const void *a, const void *b)
{
    const struct ranked *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return (x->e > y->e) - (x->e < y->e);
}

int cprune_select(const struct cprune_shape *s, double ratio, const double *score,
                  const uint64_t *count, bool *keep, int *n_keep, char *err, size_t errlen)
{
    int E = s->n_expert, L = s->n_layer;
    if (!(ratio > 0.0 && ratio < 1.0))
        return ms_errf(err, errlen, "--ratio must be in (0, 1), got %g", ratio);
    int G = s->n_group > 1 ? s->n_group : 1;
    if (E % G != 0)
        return ms_errf(err, errlen, "%d experts do not split into %d equal groups", E, G);
    int per = E / G;
    int drop = (int)lround(ratio * per);
    int keep_g = per - drop;
    int reach = G > 1 ? keep_g * (s->topk_group > 0 ? s->topk_group : G) : keep_g;
    int need_g = s->min_per_group > 1 ? s->min_per_group : 1;
    if (drop < 1)
        return ms_errf(err, errlen,
                       "--ratio %g removes no expert (%d experts%s; at least %.3g needed)", ratio,
                       per, G > 1 ? " per group" : " per layer", 0.5 / per);
    if (G > 1 && keep_g < need_g)
        return ms_errf(err, errlen,
                       "--ratio %g leaves %d experts per group; this router scores a group by its "
                       "best %d experts",
                       ratio, keep_g, need_g);
    if (keep_g < 1 || reach < s->top_k)
        return ms_errf(err, errlen,
                       "--ratio %g leaves %d experts per %s, fewer than top-k %d can choose from "
                       "(%d reachable)",
                       ratio, keep_g, G > 1 ? "group" : "layer", s->top_k, reach);
    struct ranked *rk = malloc(sizeof *rk * (size_t)per);
    if (!rk) return ms_errf(err, errlen, "out of memory");
    for (int l = 0; l < L; l++)
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < per; i++) {
                int e = g * per + i, f = l * E + e;
                rk[i] = (struct ranked){e, score[f], count ? count[f] : 0};
            }
            qsort(rk, (size_t)per, sizeof *rk, cmp_ranked);
            for (int i = 0; i < per; i++)
                keep[(size_t)l * E + rk[i].e] = i < keep_g;
        }
    free(rk);
    *n_keep = keep_g * G;
    return 0;
}

/* --- the pruned folder ------------------------------------------------------------------- */

/* "model.layers.L.<block>.experts.E.<rest>": fills layer, expert and the offsets of E. */
static bool parse_expert_name(const char *name, int *layer, int *expert, size_t *e_at,
                              size_t *e_end)
{
    if (strncmp(name, "model.layers.", 13) != 0) return false;
    char *end;
    long l = strtol(name + 13, &end, 10);
    if (end == name + 13 || *end != '.') return false;
    const char *ex = strstr(end, ".experts.");
    if (!ex) return false;
    const char *num = ex + 9;
    long e = strtol(num, &end, 10);
    if (end == num || *end != '.') return false;
    *layer = (int)l;
    *expert = (int)e;
    *e_at = (size_t)(num - name);
    *e_end = (size_t)(end - name);
    return true;
}

/* a router tensor of layer l: "model.layers.L.<block>.gate.weight" or its
 * e_score_correction_bias, first dimension n_expert */
static bool is_router(const struct st_tensor *t, int n_expert, int *layer)
{
    if (strncmp(t->name, "model.layers.", 13) != 0 || t->ndim < 1 || t->shape[0] != n_expert)
        return false;
    char *end;
    long l = strtol(t->name + 13, &end, 10);
    if (end == t->name + 13 || *end != '.') return false;
    size_t n = strlen(t->name);
    static const char *const tails[] = {".gate.weight", ".gate.e_score_correction_bias"};
    for (int i = 0; i < 2; i++) {
        size_t k = strlen(tails[i]);
        if (n > k && strcmp(t->name + n - k, tails[i]) == 0 && !strstr(t->name, ".experts.")) {
            *layer = (int)l;
            return true;
        }
    }
    return false;
}

/* dir/name into buf (PATH_MAX); -1 when too long */
static int join(char *buf, const char *dir, const char *name, char *err, size_t errlen)
{
    int n = snprintf(buf, PATH_MAX, "%s/%s", dir, name);
    return n >= 0 && n < PATH_MAX ? 0 : ms_errf(err, errlen, "path too long: %s/%s", dir, name);
}

static int copy_file(const char *from, const char *to, char *err, size_t errlen)
{
    FILE *in = fopen(from, "rb"), *out = in ? fopen(to, "wb") : NULL;
    int rc = 0;
    if (!in || !out) {
        rc = ms_errf(err, errlen, "cannot copy %s to %s: %s", from, to, strerror(errno));
    } else {
        char buf[65536];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, in)) > 0)
            if (fwrite(buf, 1, n, out) != n) {
                rc = ms_errf(err, errlen, "cannot write %s: %s", to, strerror(errno));
                break;
            }
        if (ferror(in)) rc = ms_errf(err, errlen, "cannot read %s", from);
    }
    if (in) fclose(in);
    if (out && fclose(out) != 0 && rc == 0)
        rc = ms_errf(err, errlen, "cannot write %s: %s", to, strerror(errno));
    return rc;
}

static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[PATH_MAX];
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
                join(p, dir, de->d_name, NULL, 0) == 0)
                unlink(p);
        closedir(d);
    }
    rmdir(dir);
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && strcmp(s + n - k, tail) == 0;
}

/* The layer of a tensor under model.layers.L., else -1. */
static int tensor_layer(const char *name)
{
    if (strncmp(name, "model.layers.", 13) != 0) return -1;
    char *end;
    long l = strtol(name + 13, &end, 10);
    return end == name + 13 || *end != '.' || l < 0 || l > 1 << 20 ? -1 : (int)l;
}

int cprune_check(const struct model_desc *md, char *err, size_t errlen)
{
    const char *mt = md->model_type;
    if (md->layer_hash || strcmp(mt, "deepseek_v4") == 0)
        return ms_errf(err, errlen, "pruning %s models is not supported: their hash-routed "
                                    "layers (hash_moe, tid2eid) name experts by number, which "
                                    "pruning would renumber",
                       mt);
    static const char *const ok[] = {"mohge", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                     "deepseek_v2", "deepseek_v3", "deepseek_v32"};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
        if (strcmp(mt, ok[i]) == 0) return 0;
    return ms_errf(err, errlen,
                   "pruning %s models is not supported (mohge, mixtral, qwen2_moe, qwen3_moe, "
                   "olmoe, deepseek_v2, deepseek_v3 and deepseek_v32 are)",
                   mt);
}

static int write_config(const char *model_dir, const struct model_desc *md, int n_keep,
                        bool mtp_dropped, const char *path, char *err, size_t errlen)
{
    char in[PATH_MAX];
    snprintf(in, sizeof in, "%s/config.json", model_dir);
    json_error_t je;
    json_t *c = json_load_file(in, 0, &je);
    if (!c || !json_is_object(c)) {
        json_decref(c);
        return ms_errf(err, errlen, "%s: %s", in, je.text);
    }
    const char *key = NULL;
    int value = n_keep;
    const char *mt = md->model_type;
    if (strcmp(mt, "mohge") == 0) {
        key = "experts_per_group";
        value = n_keep / (md->n_group > 0 ? md->n_group : 1);
    } else if (cprune_check(md, err, errlen) == 0) {
        /* whichever of the names the folder uses (transformers has renamed some: qwen3_moe
         * folders carry num_experts or num_local_experts), else the family's usual one */
        static const char *const names[] = {"num_local_experts", "num_experts", "n_routed_experts"};
        for (int i = 0; i < 3; i++)
            if (json_object_get(c, names[i]) &&
                json_object_set_new(c, names[i], json_integer(value)) != 0) {
                json_decref(c);
                return ms_errf(err, errlen, "out of memory");
            } else if (json_object_get(c, names[i])) {
                key = names[i];
            }
        if (!key)
            key = strcmp(mt, "mixtral") == 0           ? "num_local_experts"
                  : strncmp(mt, "deepseek_v", 10) == 0 ? "n_routed_experts"
                                                       : "num_experts";
    } else {
        json_decref(c);
        return -1; /* cprune_check's reason */
    }
    int rc = json_object_set_new(c, key, json_integer(value));
    if (rc == 0 && mtp_dropped) rc = json_object_set_new(c, "num_nextn_predict_layers",
                                                         json_integer(0));
    if (rc == 0) rc = json_dump_file(c, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(c);
    return rc == 0 ? 0 : ms_errf(err, errlen, "cannot write %s", path);
}

int cprune_write(const char *model_dir, const struct model_desc *md, const bool *keep,
                 const char *out_dir, char *err, size_t errlen)
{
    int E = md->n_expert;
    if (cprune_check(md, err, errlen) != 0) return -1;
    struct stat st;
    if (stat(out_dir, &st) == 0)
        return ms_errf(err, errlen, "--out %s already exists (prune never overwrites)", out_dir);
    int *moe_of = calloc((size_t)md->n_layer, sizeof *moe_of); /* model layer -> MoE index */
    if (!moe_of) {
        return ms_errf(err, errlen, "out of memory");
    }
    int n_moe = 0;
    for (int l = 0; l < md->n_layer; l++)
        moe_of[l] = md->layer_is_moe[l] ? n_moe++ : -1;
    int n_keep = 0;
    for (int e = 0; e < E; e++)
        n_keep += n_moe > 0 && keep[e];
    char tmp[PATH_MAX], path[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp-%d", out_dir, (int)getpid()) >= (int)sizeof tmp) {
        free(moe_of);
        return ms_errf(err, errlen, "--out path too long");
    }
    struct st_archive *a = NULL;
    struct stw *w = NULL;
    void **owned = NULL;
    int n_owned = 0, rc = -1;
    bool made = false;
    if (mkdir(tmp, 0755) != 0) {
        ms_errf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    made = true;
    if (st_open_dir(model_dir, &a, err, errlen) != 0) goto out;
    w = stw_new();
    owned = calloc((size_t)st_count(a) + 1, sizeof *owned);
    if (!w || !owned) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    /* MTP layers after the decoder (model.layers.{n_layer}..) with routed experts of their own:
     * no calibration reached them, so they are left out and the config says there are none
     * (a dense module, as the bundled model's, is kept as it is) */
    bool mtp_dropped = false;
    for (int i = 0; i < st_count(a); i++) {
        int lyr;
        if (tensor_layer(st_at(a, i)->name) >= md->n_layer && is_router(st_at(a, i), E, &lyr))
            mtp_dropped = true;
    }
    for (int i = 0; i < st_count(a); i++) {
        const struct st_tensor *t = st_at(a, i);
        int layer, expert, ml;
        if (mtp_dropped && tensor_layer(t->name) >= md->n_layer) continue;
        size_t e_at, e_end;
        if (parse_expert_name(t->name, &layer, &expert, &e_at, &e_end) && layer >= 0 &&
            layer < md->n_layer && (ml = moe_of[layer]) >= 0 && expert >= 0 && expert < E) {
            const bool *k = keep + (size_t)ml * E;
            if (!k[expert]) continue;
            int id = 0;
            for (int e = 0; e < expert; e++)
                id += k[e];
            char name[512];
            if (snprintf(name, sizeof name, "%.*s%d%s", (int)e_at, t->name, id, t->name + e_end) >=
                (int)sizeof name) {
                ms_errf(err, errlen, "tensor name too long: %s", t->name);
                goto out;
            }
            if (stw_add(w, name, t->dtype, t->ndim, t->shape, t->data, err, errlen) < 0) goto out;
        } else if (is_router(t, E, &layer) && layer < md->n_layer && (ml = moe_of[layer]) >= 0) {
            const bool *k = keep + (size_t)ml * E;
            size_t row = t->nbytes / (size_t)E;
            char *buf = malloc(row * (size_t)(n_keep > 0 ? n_keep : 1));
            if (!buf) {
                ms_errf(err, errlen, "out of memory");
                goto out;
            }
            owned[n_owned++] = buf;
            int r = 0;
            for (int e = 0; e < E; e++)
                if (k[e]) memcpy(buf + row * (size_t)r++, (const char *)t->data + row * e, row);
            int64_t shape[ST_MAX_DIMS];
            memcpy(shape, t->shape, sizeof shape);
            shape[0] = n_keep;
            if (stw_add(w, t->name, t->dtype, t->ndim, shape, buf, err, errlen) < 0) goto out;
        } else if (strstr(t->name, ".experts.") && strncmp(md->model_type, "gpt_oss", 7) == 0) {
            ms_errf(err, errlen, "pruning gpt_oss (fused expert tensors) is not supported");
            goto out;
        } else {
            if (stw_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, err, errlen) < 0)
                goto out;
        }
    }
    if (stw_set_metadata(w, "format", "pt", err, errlen) != 0) goto out;
    if (join(path, tmp, "model.safetensors", err, errlen) != 0) goto out;
    if (stw_write(w, path, err, errlen) != 0) goto out;
    if (join(path, tmp, "config.json", err, errlen) != 0) goto out;
    if (write_config(model_dir, md, n_keep, mtp_dropped, path, err, errlen) != 0) goto out;
    /* the rest of the folder: tokenizer, generation config, ... */
    DIR *d = opendir(model_dir);
    if (!d) {
        ms_errf(err, errlen, "cannot list %s: %s", model_dir, strerror(errno));
        goto out;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        char from[PATH_MAX];
        if (n[0] == '.' || strcmp(n, "config.json") == 0 || strcmp(n, "README.md") == 0 ||
            ends_with(n, ".safetensors") || ends_with(n, ".safetensors.index.json"))
            continue;
        if (join(from, model_dir, n, err, errlen) != 0) {
            closedir(d);
            goto out;
        }
        if (stat(from, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (join(path, tmp, n, err, errlen) != 0 || copy_file(from, path, err, errlen) != 0) {
            closedir(d);
            goto out;
        }
    }
    closedir(d);
    if (rename(tmp, out_dir) != 0) {
        ms_errf(err, errlen, "cannot rename %s to %s: %s", tmp, out_dir, strerror(errno));
        goto out;
    }
    made = false;
    rc = 0;
out:
    if (made) remove_tree(tmp);
    stw_free(w);
    for (int i = 0; i < n_owned; i++)
        free(owned[i]);
    free(owned);
    st_close(a);
    free(moe_of);
    return rc;
}
