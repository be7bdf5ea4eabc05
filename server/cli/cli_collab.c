/* Expert-collaboration subcommands (engine/collab):
 *
 *   moeserve analyze --calib FILE... --out GROUPS.json [--model DIR]
 *       learns the collaborative groups of (layer, expert) pairs from calibration routing and
 *       writes them, two levels (coarse groups and the fine ones they split into), with their
 *       members, usage per tag, top tokens and the reconstruction error, as JSON
 *   moeserve prune --ratio R --method collab|frequency|random --calib FILE... --out DIR
 *       writes a copy of the model with R of the routed experts of every MoE layer removed
 *
 * A calibration file is a routing trace (`moeserve trace record`, the server's
 * --record-routing: recognized by its magic) or a UTF-8 text file, which the model is run over
 * with routing capture on (the engine's capture_routing: the collector the traces use); its
 * tokens are tagged with the file's name up to the first dot. Exit status: 0, 1 on a runtime
 * failure, 2 on a bad flag or unusable calibration file. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "collab/collab_data.h"
#include "collab/collab_dict.h"
#include "collab/collab_prune.h"
#include "common.h"
#include "engine.h"
#include "model.h"
#include "routing/route_trace.h"
#include "tokenizer.h"

#define MAX_CALIB       64
#define MAX_TAGS        256
#define TOP_TOKENS      10
#define MEMBER_FRACTION 0.2 /* a group's members: entries >= this x the atom's largest */

struct calib_opts {
    const char *files[MAX_CALIB];
    int n_files;
    const char *model_dir;
    int window, max_tokens, skip_tokens, devices;
    bool unweighted;
};

struct calib {
    struct model *m; /* NULL when only traces were given and no --model */
    struct cdata *x;
    char tags[MAX_TAGS][64];
    int n_tags;
    int *layer_index; /* (n_layer) model layer of each MoE layer */
    char model_name[64];
    char model_dir[4096]; /* the folder loaded */
};

static void calib_free(struct calib *c)
{
    cdata_free(c->x);
    model_free(c->m);
    free(c->layer_index);
}

static int tag_id(struct calib *c, const char *name)
{
    for (int i = 0; i < c->n_tags; i++)
        if (strcmp(c->tags[i], name) == 0) return i;
    if (c->n_tags == MAX_TAGS) return MAX_TAGS - 1;
    snprintf(c->tags[c->n_tags], sizeof c->tags[0], "%s", name);
    return c->n_tags++;
}

/* NULL when text is valid UTF-8 without NUL bytes, else where it is not */
static const char *not_text(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    while (p < end) {
        unsigned c = *p;
        int k = c < 0x80                          ? 0
                : (c & 0xE0) == 0xC0 && c >= 0xC2 ? 1
                : (c & 0xF0) == 0xE0              ? 2
                : (c & 0xF8) == 0xF0 && c <= 0xF4 ? 3
                                                  : -1;
        if (c == 0 || k < 0 || end - p <= k) return (const char *)p;
        for (int i = 1; i <= k; i++)
            if ((p[i] & 0xC0) != 0x80) return (const char *)p;
        p += k + 1;
    }
    return NULL;
}

static int ensure_data(struct calib *c, int L, int E, int K, const char *what, char *err,
                       size_t errlen)
{
    if (!c->x) return cdata_create(L, E, K, &c->x, err, errlen);
    if (c->x->n_layer != L || c->x->n_expert != E || c->x->top_k != K)
        return ms_errf(err, errlen,
                       "%s has %d MoE layers, %d experts, top-%d; the other calibration data "
                       "has %d, %d, top-%d",
                       what, L, E, K, c->x->n_layer, c->x->n_expert, c->x->top_k);
    return 0;
}

static int add_trace(struct calib *c, const struct calib_opts *o, const char *path, char *err,
                     size_t errlen)
{
    struct rtrace_reader *r = NULL;
    if (rtrace_open(path, &r, err, errlen) != 0) return -1;
    const struct rtrace_info *in = rtrace_get_info(r);
    int rc = ensure_data(c, in->n_layer, in->n_expert, in->top_k, path, err, errlen);
    if (rc == 0 && !c->layer_index) {
        c->layer_index = malloc(sizeof(int) * (size_t)in->n_layer);
        if (!c->layer_index) rc = ms_errf(err, errlen, "out of memory");
        for (int l = 0; rc == 0 && l < in->n_layer; l++)
            c->layer_index[l] = in->layer_index[l];
        snprintf(c->model_name, sizeof c->model_name, "%s", in->model);
    }
    uint16_t *tags = NULL;
    int cap = 0;
    struct rtrace_step st;
    int got;
    while (rc == 0 && (got = rtrace_next(r, &st, err, errlen)) == 1) {
        if (st.n_tok > cap) {
            uint16_t *t = realloc(tags, sizeof *t * (size_t)st.n_tok);
            if (!t) {
                rc = ms_errf(err, errlen, "out of memory");
                break;
            }
            tags = t;
            cap = st.n_tok;
        }
        for (int t = 0; t < st.n_tok; t++) {
            const char *name = rtrace_tag_name(r, st.tags[t]);
            char buf[16];
            if (!name) {
                snprintf(buf, sizeof buf, "tag%d", st.tags[t]);
                name = buf;
            }
            tags[t] = (uint16_t)tag_id(c, name);
        }
        st.tags = tags;
        rc = cdata_add_step(c->x, &st, !o->unweighted, err, errlen);
    }
    if (rc == 0 && got < 0) rc = -1;
    free(tags);
    rtrace_close(r);
    return rc;
}

static int load_model(struct calib *c, const struct calib_opts *o, char *err, size_t errlen)
{
    if (c->m) return 0;
    const char *dir =
        o->model_dir ? o->model_dir : cli_default_model(c->model_dir, sizeof c->model_dir);
    if (!dir) return ms_errf(err, errlen, "%s", c->model_dir); /* where it looked */
    if (dir != c->model_dir) snprintf(c->model_dir, sizeof c->model_dir, "%s", dir);
    struct model_load_opts mo;
    model_load_opts_default(&mo);
    if (model_load(dir, &mo, &c->m, err, errlen) != 0) return -1;
    const char *slash = strrchr(dir, '/');
    snprintf(c->model_name, sizeof c->model_name, "%s", slash && slash[1] ? slash + 1 : dir);
    return 0;
}

/* Runs the model over a text file and adds every token's routing (as `trace record` does). */
static int add_text(struct calib *c, const struct calib_opts *o, const char *path, const char *text,
                    size_t len, char *err, size_t errlen)
{
    if (load_model(c, o, err, errlen) != 0) return -1;
    const struct model_desc *md = &c->m->desc;
    int n_moe = 0;
    for (int l = 0; l < md->n_layer; l++)
        n_moe += md->layer_is_moe[l];
    if (n_moe == 0 || md->n_expert < 1) return ms_errf(err, errlen, "the model has no MoE layer");
    if (ensure_data(c, n_moe, md->n_expert, md->top_k, path, err, errlen) != 0) return -1;
    if (!c->layer_index) {
        c->layer_index = malloc(sizeof(int) * (size_t)n_moe);
        if (!c->layer_index) return ms_errf(err, errlen, "out of memory");
        for (int l = 0, k = 0; l < md->n_layer; l++)
            if (md->layer_is_moe[l]) c->layer_index[k++] = l;
    }
    char tag[64];
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(tag, sizeof tag, "%.*s", (int)strcspn(base, "."), base);
    uint16_t tg = (uint16_t)tag_id(c, tag[0] ? tag : "text");
    int step = 64 < o->window ? 64 : o->window;
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = o->devices;
    ep.max_batch_tokens = step;
    ep.max_seqs = 1;
    ep.max_model_len = o->window;
    ep.capture_routing = true;
    ep.capture_weights = !o->unweighted;
    struct engine *e = NULL;
    size_t cap = (size_t)o->max_tokens + (size_t)o->skip_tokens + 1;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    uint16_t *tags = malloc(sizeof(uint16_t) * (size_t)step);
    int rc = -1;
    if (!ids || !tags) {
        ms_errf(err, errlen, "out of memory");
        goto out;
    }
    for (int t = 0; t < step; t++)
        tags[t] = tg;
    if (engine_create(c->m, &ep, &e, err, errlen) != 0) goto out;
    int n = tok_encode(c->m->tok, text, len, false, ids, (int)cap);
    if (n < 0) {
        ms_errf(err, errlen, "%s: the tokenizer failed", path);
        goto out;
    }
    if (n > (int)cap - 1) n = (int)cap - 1;
    if (n <= o->skip_tokens) {
        ms_errf(err, errlen, "%d tokens, none left after --skip-tokens %d", n, o->skip_tokens);
        goto out;
    }
    /* the tokens used: [skip, skip + max_tokens) */
    memmove(ids, ids + o->skip_tokens, sizeof(int32_t) * (size_t)(n - o->skip_tokens));
    n -= o->skip_tokens;
    if (n > o->max_tokens) n = o->max_tokens;
    for (int s = 0; s < n; s += o->window) {
        struct kv_seq seq;
        if (engine_seq_init(e, &seq) != 0) {
            ms_errf(err, errlen, "out of memory");
            goto out;
        }
        int wlen = n - s < o->window ? n - s : o->window;
        for (int p = 0; p < wlen; p += step) {
            int cnt = wlen - p < step ? wlen - p : step;
            struct engine_item it = {.kv = &seq, .tokens = ids + s + p, .n_tokens = cnt, .pos = p};
            if (engine_step(e, &it, 1, err, errlen) != 0) {
                engine_seq_free(e, &seq);
                goto out;
            }
            const struct engine_routing *rt = engine_last_routing(e);
            struct rtrace_step st = {.n_tok = cnt,
                                     .tokens = rt->tokens,
                                     .tags = tags,
                                     .ids = rt->ids,
                                     .weights = rt->weights,
                                     .layer_stride = rt->layer_stride};
            if (cdata_add_step(c->x, &st, !o->unweighted, err, errlen) != 0) {
                engine_seq_free(e, &seq);
                goto out;
            }
        }
        engine_seq_free(e, &seq);
    }
    rc = 0;
out:
    engine_free(e);
    free(ids);
    free(tags);
    return rc;
}

/* 0, or 2 with the message printed (bad file: named by --calib), 1 on runtime failures */
static int calib_load(const char *cmd, const struct calib_opts *o, bool need_model, struct calib *c)
{
    char err[MS_ERR_LEN];
    memset(c, 0, sizeof *c);
    for (int i = 0; i < o->n_files; i++) {
        const char *path = o->files[i];
        size_t len = 0;
        char *buf = cli_read_file(path, &len);
        if (!buf) {
            fprintf(stderr, "moeserve %s: --calib %s: cannot read it: %s\n", cmd, path,
                    strerror(errno));
            return 2;
        }
        int rc;
        if (len >= 8 && memcmp(buf, RTRACE_MAGIC, 8) == 0) {
            free(buf);
            rc = add_trace(c, o, path, err, sizeof err);
        } else {
            const char *bad = not_text(buf, len);
            size_t blank = strspn(buf, " \t\r\n");
            if (len == 0 || blank == len || bad) {
                if (len == 0 || blank == len)
                    fprintf(stderr, "moeserve %s: --calib %s is empty\n", cmd, path);
                else
                    fprintf(stderr,
                            "moeserve %s: --calib %s is neither text (invalid UTF-8 or a NUL "
                            "byte at offset %zu) nor a routing trace\n",
                            cmd, path, (size_t)(bad - buf));
                free(buf);
                return 2;
            }
            rc = add_text(c, o, path, buf, len, err, sizeof err);
            free(buf);
        }
        if (rc != 0) {
            fprintf(stderr, "moeserve %s: --calib %s: %s\n", cmd, path, err);
            return 1;
        }
    }
    if (need_model && load_model(c, o, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve %s: %s\n", cmd, err);
        return 1;
    }
    if (!c->x || c->x->n_row == 0) {
        fprintf(stderr, "moeserve %s: the calibration data holds no routed token\n", cmd);
        return 2;
    }
    if (c->m) {
        const struct model_desc *md = &c->m->desc;
        int n_moe = 0;
        for (int l = 0; l < md->n_layer; l++)
            n_moe += md->layer_is_moe[l];
        if (n_moe != c->x->n_layer || md->n_expert != c->x->n_expert || md->top_k != c->x->top_k) {
            fprintf(stderr,
                    "moeserve %s: the calibration routing (%d MoE layers, %d experts, top-%d) "
                    "is not the model's (%d, %d, top-%d)\n",
                    cmd, c->x->n_layer, c->x->n_expert, c->x->top_k, n_moe, md->n_expert,
                    md->top_k);
            return 2;
        }
    }
    return 0;
}

/* --- shared options ---------------------------------------------------------------------- */

struct learn_opts {
    int groups, fine;
    double lambda;
    int epochs;
    int seed;
};

static int parse_i(const char *cmd, const char *name, const char *s, int lo, int hi, int *out)
{
    double v;
    if (cli_parse_double(cmd, name, s, lo, hi, &v) != 0) return -1;
    if (v != floor(v)) {
        fprintf(stderr, "moeserve %s: %s must be an integer, got '%s'\n", cmd, name, s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* Learns the fine dictionary (and its codes) and the coarse one merged from it. */
static int learn(const char *cmd, const struct cdata *x, const struct learn_opts *lo,
                 struct cdict **fine, struct cdict **coarse, int *parent, float **codes)
{
    char err[MS_ERR_LEN];
    struct cdict_params p;
    cdict_params_default(&p);
    int groups = lo->groups;
    p.n_atoms = lo->fine > 0 ? lo->fine : 4 * groups;
    if (p.n_atoms > x->n_feat) p.n_atoms = x->n_feat;
    if (groups > p.n_atoms) groups = p.n_atoms;
    p.lambda = lo->lambda;
    p.epochs = lo->epochs;
    p.seed = (uint64_t)lo->seed;
    *codes = NULL;
    if (cdict_learn(x, &p, fine, err, sizeof err) != 0 ||
        cdict_merge(*fine, groups, parent, coarse, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve %s: %s\n", cmd, err);
        return -1;
    }
    *codes = malloc(sizeof(float) * x->n_row * (size_t)(*fine)->n_atoms);
    if (!*codes) {
        fprintf(stderr, "moeserve %s: out of memory\n", cmd);
        return -1;
    }
    return 0;
}

enum {
    O_CALIB = 300,
    O_OUT,
    O_MODEL,
    O_GROUPS,
    O_FINE,
    O_LAMBDA,
    O_EPOCHS,
    O_SEED,
    O_WINDOW,
    O_MAXTOK,
    O_SKIP,
    O_DEVICES,
    O_UNW,
    O_RATIO,
    O_METHOD
};

static const struct option common_opts[] = {
    {"calib", required_argument, 0, O_CALIB},
    {"out", required_argument, 0, O_OUT},
    {"model", required_argument, 0, O_MODEL},
    {"groups", required_argument, 0, O_GROUPS},
    {"fine-groups", required_argument, 0, O_FINE},
    {"lambda", required_argument, 0, O_LAMBDA},
    {"epochs", required_argument, 0, O_EPOCHS},
    {"seed", required_argument, 0, O_SEED},
    {"window", required_argument, 0, O_WINDOW},
    {"max-tokens", required_argument, 0, O_MAXTOK},
    {"skip-tokens", required_argument, 0, O_SKIP},
    {"devices", required_argument, 0, O_DEVICES},
    {"unweighted", no_argument, 0, O_UNW},
    {"ratio", required_argument, 0, O_RATIO},
    {"method", required_argument, 0, O_METHOD},
    {"help", no_argument, 0, 'h'},
    {0, 0, 0, 0},
};

static const char common_help[] =
    "  --calib FILE        calibration data: a routing trace or a UTF-8 text file (repeatable;\n"
    "                      a text file's tokens are tagged with its name up to the first dot)\n"
    "  --model DIR         the model (default: the bundled one); runs over text calibration,\n"
    "                      and decodes the top tokens of groups learned from traces\n"
    "  --max-tokens 4096   tokens used from each text file\n"
    "  --skip-tokens 0     tokens skipped at the start of each text file (e.g. to calibrate on\n"
    "                      text disjoint from an evaluation on the first tokens)\n"
    "  --window 256        the model reads a text file in windows of this many tokens\n"
    "  --devices 1         CPU virtual devices for the calibration run\n"
    "  --unweighted        activation rows of 1 per chosen expert (default: routing weights)\n"
    "  --groups 8          coarse collaborative groups\n"
    "  --fine-groups 4xG   fine groups, learned first and merged into the coarse ones\n"
    "  --lambda 0.1        L1 weight of the sparse codes\n"
    "  --epochs 10         passes of online dictionary learning\n"
    "  --seed 1            every random choice of the learning (and of --method random)\n";

/* Parses the shared options; 0 or the exit status (2 or, for --help, -1 meaning 0). */
static int parse_common(const char *cmd, int o, struct calib_opts *co, struct learn_opts *lo,
                        const char **out)
{
    switch (o) {
    case O_CALIB:
        if (co->n_files == MAX_CALIB) {
            fprintf(stderr, "moeserve %s: at most %d --calib files\n", cmd, MAX_CALIB);
            return 2;
        }
        co->files[co->n_files++] = optarg;
        return 0;
    case O_OUT:
        *out = optarg;
        return 0;
    case O_MODEL:
        co->model_dir = optarg;
        return 0;
    case O_GROUPS:
        return parse_i(cmd, "--groups", optarg, 1, 4096, &lo->groups) ? 2 : 0;
    case O_FINE:
        return parse_i(cmd, "--fine-groups", optarg, 1, 4096, &lo->fine) ? 2 : 0;
    case O_LAMBDA:
        return cli_parse_double(cmd, "--lambda", optarg, 0, 100, &lo->lambda) ? 2 : 0;
    case O_EPOCHS:
        return parse_i(cmd, "--epochs", optarg, 1, 1000, &lo->epochs) ? 2 : 0;
    case O_SEED:
        return parse_i(cmd, "--seed", optarg, 0, 0x7fffffff, &lo->seed) ? 2 : 0;
    case O_WINDOW:
        return parse_i(cmd, "--window", optarg, 2, 1 << 16, &co->window) ? 2 : 0;
    case O_MAXTOK:
        return parse_i(cmd, "--max-tokens", optarg, 2, 1 << 26, &co->max_tokens) ? 2 : 0;
    case O_SKIP:
        return parse_i(cmd, "--skip-tokens", optarg, 0, 1 << 26, &co->skip_tokens) ? 2 : 0;
    case O_DEVICES:
        return parse_i(cmd, "--devices", optarg, 1, 64, &co->devices) ? 2 : 0;
    case O_UNW:
        co->unweighted = true;
        return 0;
    default:
        return 2;
    }
}

static void defaults(struct calib_opts *co, struct learn_opts *lo)
{
    memset(co, 0, sizeof *co);
    co->window = 256;
    co->max_tokens = 4096;
    co->devices = 1;
    *lo = (struct learn_opts){.groups = 8, .fine = 0, .lambda = 0.1, .epochs = 10, .seed = 1};
}

/* --- analyze ----------------------------------------------------------------------------- */

/* Token classes: a fixed rule set over a decoded token's text, the first rule that holds. */
enum {
    TC_WHITESPACE, /* spaces and line breaks only */
    TC_DIGITS,     /* digits after optional leading spaces */
    TC_JSON,       /* JSON syntax: only { } [ ] " : , (and spaces) */
    TC_PUNCT,      /* other ASCII punctuation only */
    TC_CAPITAL,    /* a word that starts with a capital letter */
    TC_LOWER,      /* a word that starts with a lowercase letter */
    TC_OTHER,      /* anything else (non-ASCII letters, mixed tokens) */
    TC_N
};
static const char *const tc_name[TC_N] = {"whitespace", "digits",     "json_syntax", "punctuation",
                                          "capitalized", "lowercase", "other"};
#define LABEL_LIFT 1.5 /* classes at least this over their base rate name a group */

static int token_class(const char *s)
{
    size_t n = strlen(s), i = 0;
    while (i < n && isspace((unsigned char)s[i]))
        i++;
    if (n > 0 && i == n) return TC_WHITESPACE;
    if (i == n) return TC_OTHER;
    bool digits = true, json = true, punct = true;
    for (size_t j = i; j < n; j++) {
        unsigned char ch = (unsigned char)s[j];
        if (isspace(ch)) continue;
        digits = digits && isdigit(ch);
        json = json && strchr("{}[]\":,", ch) != NULL;
        punct = punct && ch < 128 && ispunct(ch);
    }
    if (digits) return TC_DIGITS;
    if (json) return TC_JSON;
    if (punct) return TC_PUNCT;
    unsigned char f = (unsigned char)s[i];
    if (f >= 'A' && f <= 'Z') return TC_CAPITAL;
    if (f >= 'a' && f <= 'z') return TC_LOWER;
    return TC_OTHER;
}

/* What tells a group's tokens apart: per token class, its share of the group's tokens (each
 * weighted by its code) against the class's share of all tokens (the base rate) and their
 * ratio (lift); and a label naming the tag that uses the group most and the classes at least
 * LABEL_LIFT over their base rate, by lift. cls: (vocab) class per token id, -1 unknown. */
static void group_classes(json_t *g, const struct calib *c, const float *codes, int K, int k,
                          const signed char *cls, const double *base, const double *share,
                          int vocab)
{
    const struct cdata *x = c->x;
    double w[TC_N] = {0}, tot = 0.0, total_base = 0.0;
    for (size_t r = 0; r < x->n_row; r++) {
        float v = codes[r * K + k];
        int32_t id = x->token[r];
        if (v <= 0.0f || id < 0 || id >= vocab || cls[id] < 0) continue;
        w[cls[id]] += v;
        tot += v;
    }
    for (int t = 0; t < TC_N; t++)
        total_base += base[t];
    json_t *jc = json_object();
    double lift[TC_N];
    for (int t = 0; t < TC_N; t++) {
        double sh = tot > 0 ? w[t] / tot : 0.0, b = total_base > 0 ? base[t] / total_base : 0.0;
        lift[t] = b > 0 ? sh / b : 0.0;
        json_object_set_new(jc, tc_name[t], json_pack("{s:f, s:f, s:f}", "share", sh, "base", b,
                                                      "lift", lift[t]));
    }
    json_object_set_new(g, "token_classes", jc);
    char label[256];
    int top_tag = -1;
    for (int t = 0; t < c->n_tags; t++)
        if (top_tag < 0 || share[t] > share[top_tag]) top_tag = t;
    int len = top_tag >= 0 ? snprintf(label, sizeof label, "%.0f%% of %s tokens",
                                      100.0 * share[top_tag], c->tags[top_tag])
                           : snprintf(label, sizeof label, "-");
    bool taken[TC_N] = {false};
    for (int n = 0; n < 3 && len < (int)sizeof label; n++) {
        int best = -1;
        for (int t = 0; t < TC_N; t++)
            if (!taken[t] && lift[t] >= LABEL_LIFT && (best < 0 || lift[t] > lift[best])) best = t;
        if (best < 0) break;
        taken[best] = true;
        len += snprintf(label + len, sizeof label - (size_t)len, "%s%s %.1fx", n ? ", " : "; ",
                        tc_name[best], lift[best]);
    }
    json_object_set_new(g, "label", json_string(label));
}

static json_t *group_json(const struct calib *c, const struct cdict *d, int k, const float *codes,
                          double *by_tok, int vocab, const signed char *cls, const double *base)
{
    const struct cdata *x = c->x;
    int F = d->n_feat, K = d->n_atoms, E = x->n_expert;
    const float *a = d->atom + (size_t)k * F;
    float mx = 0.0f;
    for (int f = 0; f < F; f++)
        mx = a[f] > mx ? a[f] : mx;
    json_t *g = json_object(), *members = json_array();
    /* members by weight, largest first (selection sort: groups are small) */
    char *taken = calloc((size_t)F, 1);
    for (;;) {
        int best = -1;
        for (int f = 0; f < F; f++)
            if (!taken[f] && a[f] > 0.0f && a[f] >= MEMBER_FRACTION * mx &&
                (best < 0 || a[f] > a[best]))
                best = f;
        if (best < 0 || !taken) break;
        taken[best] = 1;
        json_array_append_new(members, json_pack("{s:i, s:i, s:i, s:f}", "layer",
                                                 c->layer_index[best / E], "moe_layer", best / E,
                                                 "expert", best % E, "weight", (double)a[best]));
    }
    free(taken);
    json_object_set_new(g, "id", json_integer(k));
    json_object_set_new(g, "members", members);
    /* usage per tag: mean code and share of tokens using the group */
    double sum[MAX_TAGS] = {0}, used[MAX_TAGS] = {0}, n[MAX_TAGS] = {0};
    size_t users = 0;
    for (int v = 0; v < vocab; v++)
        by_tok[2 * v] = by_tok[2 * v + 1] = 0.0;
    for (size_t r = 0; r < x->n_row; r++) {
        float v = codes[r * K + k];
        int t = x->tag[r] < MAX_TAGS ? x->tag[r] : MAX_TAGS - 1;
        n[t] += 1;
        sum[t] += v;
        used[t] += v > 0.0f;
        users += v > 0.0f;
        int32_t id = x->token[r];
        if (id >= 0 && id < vocab) {
            by_tok[2 * id] += v;
            by_tok[2 * id + 1] += 1;
        }
    }
    json_object_set_new(g, "tokens", json_integer((json_int_t)users));
    json_t *usage = json_object(), *share = json_object();
    for (int t = 0; t < c->n_tags; t++) {
        json_object_set_new(usage, c->tags[t], json_real(n[t] ? sum[t] / n[t] : 0.0));
        json_object_set_new(share, c->tags[t], json_real(n[t] ? used[t] / n[t] : 0.0));
    }
    json_object_set_new(g, "usage", usage);
    json_object_set_new(g, "share", share);
    if (cls) { /* decoded tokens: what distinguishes them */
        double sh[MAX_TAGS];
        for (int t = 0; t < c->n_tags; t++)
            sh[t] = n[t] ? used[t] / n[t] : 0.0;
        group_classes(g, c, codes, K, k, cls, base, sh, vocab);
    }
    /* top tokens: highest mean code among token ids seen at least 3 times */
    json_t *top = json_array();
    for (int i = 0; i < TOP_TOKENS; i++) {
        int best = -1;
        double bv = 0.0;
        for (int v = 0; v < vocab; v++) {
            if (by_tok[2 * v + 1] < 3) continue;
            double m = by_tok[2 * v] / by_tok[2 * v + 1];
            if (m > bv) {
                bv = m;
                best = v;
            }
        }
        if (best < 0) break;
        char text[256] = "";
        int32_t id = best;
        bool decoded =
            c->m && c->m->tok && tok_decode(c->m->tok, &id, 1, false, text, sizeof text) >= 0;
        /* without a model (a trace alone) the ids stay undecoded: "text" is null */
        json_array_append_new(top, json_pack("{s:i, s:o, s:f, s:i}", "id", best, "text",
                                             decoded ? json_string(text) : json_null(), "score", bv,
                                             "count", (int)by_tok[2 * best + 1]));
        by_tok[2 * best + 1] = 0; /* taken */
    }
    json_object_set_new(g, "top_tokens", top);
    return g;
}

int cli_analyze(int argc, char **argv)
{
    static const char *cmd = "analyze";
    struct calib_opts co;
    struct learn_opts lo;
    defaults(&co, &lo);
    const char *out = NULL;
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", common_opts, NULL)) != -1) {
        if (o == 'h') {
            printf("usage: moeserve analyze --calib FILE... --out GROUPS.json [options]\n%s"
                   "Learns collaborative groups of (layer, expert) pairs by nonnegative sparse\n"
                   "dictionary learning over each token's cross-layer routing and writes them as\n"
                   "JSON (see README, \"Expert collaboration\").\n",
                   common_help);
            return 0;
        }
        if (o == O_RATIO || o == O_METHOD) {
            fprintf(stderr, "moeserve analyze: --ratio and --method belong to `moeserve prune`\n");
            return 2;
        }
        int rc = parse_common(cmd, o, &co, &lo, &out);
        if (rc) return rc;
    }
    if (!out || co.n_files == 0 || optind < argc) {
        fprintf(stderr, "moeserve analyze: --calib FILE and --out GROUPS.json are required (see "
                        "--help)\n");
        return 2;
    }
    struct calib c;
    /* with --model, a trace's token ids are decoded too */
    int rc = calib_load(cmd, &co, co.model_dir != NULL, &c);
    if (rc) {
        calib_free(&c);
        return rc;
    }
    struct cdict *fine = NULL, *coarse = NULL;
    float *codes = NULL, *ccodes = NULL;
    double *by_tok = NULL;
    signed char *cls = NULL; /* (vocab) token classes, when tokens can be decoded */
    double base[TC_N] = {0};  /* tokens of each class */
    json_t *root = NULL;
    int parent[4096];
    rc = 1;
    const struct cdata *x = c.x;
    if (learn(cmd, x, &lo, &fine, &coarse, parent, &codes) != 0) goto out;
    ccodes = malloc(sizeof(float) * x->n_row * (size_t)coarse->n_atoms);
    int vocab = c.m ? c.m->desc.vocab : 0;
    for (size_t r = 0; r < x->n_row; r++)
        vocab = x->token[r] >= vocab ? x->token[r] + 1 : vocab;
    by_tok = malloc(sizeof(double) * 2 * (size_t)(vocab > 0 ? vocab : 1));
    if (!ccodes || !by_tok) goto oom;
    double err_f = cdict_encode_all(fine, x, codes), err_c = cdict_encode_all(coarse, x, ccodes);
    if (err_f < 0 || err_c < 0) goto oom;
    /* each seen token's class (decoded with the model's tokenizer) and the classes' base rate */
    if (c.m && c.m->tok) {
        cls = malloc((size_t)(vocab > 0 ? vocab : 1));
        if (!cls) goto oom;
        memset(cls, -1, (size_t)(vocab > 0 ? vocab : 1));
        for (size_t r = 0; r < x->n_row; r++) {
            int32_t id = x->token[r];
            if (id < 0 || id >= vocab) continue;
            if (cls[id] < 0) {
                char text[256];
                cls[id] = (signed char)(tok_decode(c.m->tok, &id, 1, false, text, sizeof text) >= 0
                                            ? token_class(text)
                                            : TC_OTHER);
            }
            base[cls[id]] += 1.0;
        }
    }
    root = json_object();
    json_object_set_new(root, "model", json_string(c.model_name));
    json_object_set_new(root, "n_layer", json_integer(x->n_layer));
    json_object_set_new(root, "n_expert", json_integer(x->n_expert));
    json_object_set_new(root, "top_k", json_integer(x->top_k));
    json_t *li = json_array();
    for (int l = 0; l < x->n_layer; l++)
        json_array_append_new(li, json_integer(c.layer_index[l]));
    json_object_set_new(root, "layer_index", li);
    json_object_set_new(root, "tokens", json_integer((json_int_t)x->n_row));
    json_object_set_new(root, "weighted", json_boolean(x->weighted));
    json_t *tags = json_array();
    for (int t = 0; t < c.n_tags; t++)
        json_array_append_new(tags, json_string(c.tags[t]));
    json_object_set_new(root, "tags", tags);
    json_object_set_new(root, "params",
                        json_pack("{s:i, s:i, s:f, s:i, s:i, s:f}", "groups", coarse->n_atoms,
                                  "fine_groups", fine->n_atoms, "lambda", lo.lambda, "epochs",
                                  lo.epochs, "seed", lo.seed, "member_fraction", MEMBER_FRACTION));
    json_object_set_new(root, "reconstruction_error",
                        json_pack("{s:f, s:f}", "fine", err_f, "coarse", err_c));
    json_t *levels = json_array();
    json_t *cg = json_array(), *fg = json_array();
    for (int k = 0; k < coarse->n_atoms; k++) {
        json_t *g = group_json(&c, coarse, k, ccodes, by_tok, vocab, cls, base);
        json_t *kids = json_array();
        for (int f = 0; f < fine->n_atoms; f++)
            if (parent[f] == k) json_array_append_new(kids, json_integer(f));
        json_object_set_new(g, "children", kids);
        json_array_append_new(cg, g);
    }
    for (int k = 0; k < fine->n_atoms; k++) {
        json_t *g = group_json(&c, fine, k, codes, by_tok, vocab, cls, base);
        json_object_set_new(g, "parent", json_integer(parent[k]));
        json_array_append_new(fg, g);
    }
    json_array_append_new(levels, json_pack("{s:s, s:o}", "level", "coarse", "groups", cg));
    json_array_append_new(levels, json_pack("{s:s, s:o}", "level", "fine", "groups", fg));
    json_object_set_new(root, "levels", levels);
    /* every (layer, expert): routed tokens and its groups (argmax), for plots */
    int *gc = malloc(sizeof(int) * (size_t)x->n_feat),
        *gf = malloc(sizeof(int) * (size_t)x->n_feat);
    if (!gc || !gf) {
        free(gc);
        free(gf);
        goto oom;
    }
    cdict_assign(coarse, gc);
    cdict_assign(fine, gf);
    json_t *nodes = json_array();
    for (int f = 0; f < x->n_feat; f++)
        json_array_append_new(nodes, json_pack("{s:i, s:i, s:I, s:i, s:i}", "moe_layer",
                                               f / x->n_expert, "expert", f % x->n_expert, "tokens",
                                               (json_int_t)x->count[f], "group", gc[f],
                                               "fine_group", gf[f]));
    free(gc);
    free(gf);
    json_object_set_new(root, "nodes", nodes);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    if (json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0 ||
        rename(tmp, out) != 0) {
        fprintf(stderr, "moeserve analyze: cannot write %s: %s\n", out, strerror(errno));
        remove(tmp);
        goto out;
    }
    fprintf(stderr,
            "wrote %s: %d coarse and %d fine groups from %zu tokens (%s); relative "
            "reconstruction error %.4f (fine), %.4f (coarse)\n",
            out, coarse->n_atoms, fine->n_atoms, x->n_row,
            x->weighted ? "routing weights" : "unweighted", err_f, err_c);
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "moeserve analyze: out of memory\n");
out:
    json_decref(root);
    free(codes);
    free(ccodes);
    free(by_tok);
    free(cls);
    cdict_free(fine);
    cdict_free(coarse);
    calib_free(&c);
    return rc;
}

/* --- prune ------------------------------------------------------------------------------- */

int cli_prune(int argc, char **argv)
{
    static const char *cmd = "prune";
    struct calib_opts co;
    struct learn_opts lo;
    defaults(&co, &lo);
    const char *out = NULL, *ratio_s = NULL, *method_s = NULL;
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", common_opts, NULL)) != -1) {
        if (o == 'h') {
            printf("usage: moeserve prune --ratio R --method collab|frequency|random --calib "
                   "FILE... --out DIR [options]\n"
                   "  --ratio R           share of the routed experts of every MoE layer to\n"
                   "                      remove, in (0, 1) (with expert groups: of every group)\n"
                   "  --method M          collab: keep the experts the collaborative groups\n"
                   "                      reconstruct most of (ties: frequency); frequency: the\n"
                   "                      most routed; random: a seeded draw\n"
                   "  --out DIR           the pruned model folder (must not exist)\n%s",
                   common_help);
            return 0;
        }
        if (o == O_RATIO) {
            ratio_s = optarg;
            continue;
        }
        if (o == O_METHOD) {
            method_s = optarg;
            continue;
        }
        int rc = parse_common(cmd, o, &co, &lo, &out);
        if (rc) return rc;
    }
    if (!out || !ratio_s || !method_s || co.n_files == 0 || optind < argc) {
        fprintf(stderr, "moeserve prune: --ratio R, --method M, --calib FILE and --out DIR are "
                        "required (see --help)\n");
        return 2;
    }
    double ratio;
    char *end;
    errno = 0;
    ratio = strtod(ratio_s, &end);
    if (errno || end == ratio_s || *end || !(ratio > 0.0 && ratio < 1.0)) {
        fprintf(stderr, "moeserve prune: --ratio must be a number in (0, 1), got '%s'\n", ratio_s);
        return 2;
    }
    enum cprune_method method;
    if (cprune_method_parse(method_s, &method) != 0) {
        fprintf(stderr, "moeserve prune: --method must be collab, frequency or random, got '%s'\n",
                method_s);
        return 2;
    }
    struct calib c;
    int rc = calib_load(cmd, &co, true, &c);
    if (rc) {
        calib_free(&c);
        return rc;
    }
    const struct model_desc *md = &c.m->desc;
    char why[MS_ERR_LEN];
    if (cprune_check(md, why, sizeof why) != 0) { /* before the (slow) learning */
        fprintf(stderr, "moeserve prune: %s\n", why);
        calib_free(&c);
        return 2;
    }
    const struct cdata *x = c.x;
    struct cprune_shape sh = {.n_layer = x->n_layer,
                              .n_expert = x->n_expert,
                              .top_k = x->top_k,
                              .n_group = md->n_group > 1 ? md->n_group : 0,
                              .topk_group = md->topk_group,
                              .min_per_group = md->router == ROUTER_KIND_SIGMOID_GROUP ? 2 : 1};
    char err[MS_ERR_LEN];
    double *score = calloc((size_t)x->n_feat, sizeof(double));
    bool *keep = malloc(sizeof(bool) * (size_t)x->n_feat);
    struct cdict *fine = NULL, *coarse = NULL;
    float *codes = NULL;
    int parent[4096], n_keep = 0;
    rc = 1;
    if (!score || !keep) {
        fprintf(stderr, "moeserve prune: out of memory\n");
        goto out;
    }
    /* refuse a bad ratio before the (slow) learning */
    if (cprune_select(&sh, ratio, score, NULL, keep, &n_keep, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve prune: %s\n", err);
        rc = 2;
        goto out;
    }
    if (method == CPRUNE_METHOD_COLLAB) {
        if (learn(cmd, x, &lo, &fine, &coarse, parent, &codes) != 0) goto out;
        if (cdict_encode_all(fine, x, codes) < 0) {
            fprintf(stderr, "moeserve prune: out of memory\n");
            goto out;
        }
    }
    cprune_scores(method, x, fine, codes, (uint64_t)lo.seed, score);
    if (cprune_select(&sh, ratio, score, method == CPRUNE_METHOD_RANDOM ? NULL : x->count, keep,
                      &n_keep, err, sizeof err) != 0 ||
        cprune_write(c.model_dir, md, keep, out, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve prune: %s\n", err);
        goto out;
    }
    fprintf(stderr,
            "wrote %s: %d of %d experts kept in each of %d MoE layers (%s, %zu "
            "calibration tokens)\n",
            out, n_keep, x->n_expert, x->n_layer, cprune_method_name(method), x->n_row);
    for (int l = 0; l < x->n_layer; l++) {
        fprintf(stderr, "  layer %d keeps", c.layer_index[l]);
        for (int e = 0; e < x->n_expert; e++)
            if (keep[(size_t)l * x->n_expert + e]) fprintf(stderr, " %d", e);
        fprintf(stderr, "\n");
    }
    rc = 0;
out:
    free(score);
    free(keep);
    free(codes);
    cdict_free(fine);
    cdict_free(coarse);
    calib_free(&c);
    return rc;
}
