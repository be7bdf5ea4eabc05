/* Helpers shared by the golden tests (test_forward, test_mohge): reading a reference.safetensors
 * written by the scripts in tests/reference, running a prompt through the engine, and comparing. */
#ifndef MOESERVE_GOLDEN_H
#define MOESERVE_GOLDEN_H

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "safetensors.h"

#define GOLDEN_MAX_PROMPTS 8
#define GOLDEN_GREEDY      32

/* One reference prompt; arrays point into the reference archive. */
struct golden_prompt {
    int n;
    const int32_t *ids;          /* (n) */
    const float *logits;         /* (n, vocab) the reference in the checkpoint's dtype */
    const float *logits_f32;     /* bf16 checkpoints: upcast weights computed in f32, or NULL */
    const int32_t *greedy;       /* (GOLDEN_GREEDY) or NULL */
    const int32_t *route_agrees; /* bf16: positions where the bf16 reference routes like its
                                    f32 run, or NULL */
};

/* Max absolute difference over max absolute reference value (NaN counts as a failure). */
static inline double golden_rel_err(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)ref[i]);
        if (!(d <= num)) num = d;
        if (fabs((double)ref[i]) > den) den = fabs((double)ref[i]);
    }
    return den > 0 ? num / den : num;
}

static inline int golden_argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static inline const void *golden_find(const struct st_archive *ref, int i, const char *what)
{
    char name[64];
    snprintf(name, sizeof name, "prompt%d.%s", i, what);
    const struct st_tensor *t = st_find(ref, name);
    return t ? t->data : NULL;
}

/* Reads prompt0.. from the archive; returns how many (those with ids and logits). */
static inline int golden_load_prompts(const struct st_archive *ref, struct golden_prompt *p)
{
    int n = 0;
    for (; n < GOLDEN_MAX_PROMPTS; n++) {
        char name[64];
        snprintf(name, sizeof name, "prompt%d.ids", n);
        const struct st_tensor *ids = st_find(ref, name);
        if (!ids || !golden_find(ref, n, "logits")) break;
        p[n].n = (int)ids->shape[0];
        p[n].ids = ids->data;
        p[n].logits = golden_find(ref, n, "logits");
        p[n].logits_f32 = golden_find(ref, n, "logits_f32compute");
        p[n].greedy = golden_find(ref, n, "greedy");
        p[n].route_agrees = golden_find(ref, n, "bf16_route_agrees");
    }
    return n;
}

/* An engine on `backend` with small KV blocks (so sequences span several) for up to 8
 * sequences. */
/* kv_type: an enum be_kv_type or ENGINE_KV_AUTO. */
static inline struct engine *golden_engine_kv(const struct model *m, int devices,
                                              enum engine_backend backend, int kv_type)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.kv_type = kv_type;
    ep.backend = backend;
    ep.n_devices = devices;
    ep.max_batch_tokens = 256;
    ep.max_seqs = GOLDEN_MAX_PROMPTS;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    struct engine *e = NULL;
    char err[MS_ERR_LEN];
    if (engine_create(m, &ep, &e, err, sizeof err) != 0)
        fprintf(stderr, "engine (%s): %s\n", engine_backend_name(backend), err);
    return e;
}

static inline struct engine *golden_engine_on(const struct model *m, int devices,
                                              enum engine_backend backend)
{
    return golden_engine_kv(m, devices, backend, ENGINE_KV_AUTO);
}

static inline struct engine *golden_engine(const struct model *m, int devices)
{
    return golden_engine_on(m, devices, ENGINE_BACKEND_CPU);
}

/* Full prefill of one prompt with logits for every position into out (n, vocab). */
static inline int golden_prefill(struct engine *e, const struct golden_prompt *p, int moe_k,
                                 float *out)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {.kv = &s, .tokens = p->ids, .n_tokens = p->n, .pos = 0,
                             .moe_top_k = moe_k, .n_logits = p->n, .logits = out};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    if (rc) fprintf(stderr, "step: %s\n", err);
    engine_seq_free(e, &s);
    return rc;
}

/* Greedy decode of GOLDEN_GREEDY tokens, one per step; returns how many match the reference.
 * buf: (vocab) scratch. */
static inline int golden_greedy_match(struct engine *e, const struct golden_prompt *p,
                                      float *buf, int vocab)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (!p->greedy || engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {
        .kv = &s, .tokens = p->ids, .n_tokens = p->n, .pos = 0, .n_logits = 1, .logits = buf};
    int same = 0;
    if (engine_step(e, &it, 1, err, sizeof err) != 0) goto out;
    for (int t = 0; t < GOLDEN_GREEDY; t++) {
        int32_t tok = golden_argmax(buf, vocab);
        if (tok != p->greedy[t]) break;
        same++;
        it = (struct engine_item){
            .kv = &s, .tokens = &tok, .n_tokens = 1, .pos = p->n + t, .n_logits = 1, .logits = buf};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) break;
    }
out:
    engine_seq_free(e, &s);
    return same;
}

/* The fixture's config.json with `patch` (a JSON object) merged over it, parsed into d. */
static inline int golden_parse_patched(const char *tests, const char *name, const char *patch,
                                       struct model_desc *d, char *err, size_t errlen)
{
    char path[600];
    snprintf(path, sizeof path, "%s/fixtures/models/%s/config.json", tests, name);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    json_t *p = patch ? json_loads(patch, 0, &je) : NULL;
    if (!root || (patch && !p)) {
        json_decref(root);
        json_decref(p);
        return ms_errf(err, errlen, "cannot read %s or the patch", path);
    }
    if (p) json_object_update(root, p);
    char *text = json_dumps(root, 0);
    int rc = text ? model_desc_parse(text, strlen(text), path, d, err, errlen) : -1;
    free(text);
    json_decref(root);
    json_decref(p);
    return rc;
}

/* Copies a file (tests that work on a modified copy of a fixture); 0 or -1. */
static inline int golden_copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[65536];
    size_t n;
    int rc = a && b ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, a)) > 0)
        if (fwrite(buf, 1, n, b) != n) rc = -1;
    if (a) fclose(a);
    if (b && fclose(b) != 0) rc = -1;
    return rc;
}

/* ||a - ref|| / ||ref|| over the rows (positions) where mask[row] != 0; *used counts them. */
static inline double norm_err_masked(const float *a, const float *ref, const int32_t *mask, int rows,
                              int cols, int *used)
{
    double num = 0.0, den = 0.0;
    *used = 0;
    for (int r = 0; r < rows; r++) {
        if (mask && !mask[r]) continue;
        (*used)++;
        for (int c = 0; c < cols; c++) {
            double x = a[(size_t)r * cols + c], y = ref[(size_t)r * cols + c];
            num += (x - y) * (x - y);
            den += y * y;
        }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* An engine that captures each step's routing (engine_last_routing), with a KV cache of
 * kv_type (an enum be_kv_type or ENGINE_KV_AUTO). */
static inline struct engine *capture_engine(const struct model *m, int kv_type)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.kv_type = kv_type;
    ep.max_batch_tokens = 256;
    ep.max_seqs = GOLDEN_MAX_PROMPTS;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    ep.capture_routing = true;
    struct engine *e = NULL;
    char err[MS_ERR_LEN];
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

/* Prefills p on e (logits to out) and copies its routing, (n_moe, p->n, top_k) ids with each
 * token's slots sorted, into ids. */
static inline int routed_prefill(struct engine *e, const struct golden_prompt *p, float *out,
                          int32_t *ids)
{
    if (golden_prefill(e, p, 0, out) != 0) return -1;
    const struct engine_routing *r = engine_last_routing(e);
    if (!r || r->n_tok != p->n) return -1;
    int K = r->top_k;
    for (int l = 0; l < r->n_layer; l++)
        for (int t = 0; t < p->n; t++) {
            int32_t *d = ids + ((size_t)l * p->n + t) * K;
            memcpy(d, r->ids + l * r->layer_stride + (size_t)t * K, sizeof(int32_t) * K);
            for (int i = 1; i < K; i++) /* insertion sort: a set, whatever the slot order */
                for (int j = i; j > 0 && d[j - 1] > d[j]; j--) {
                    int32_t x = d[j];
                    d[j] = d[j - 1];
                    d[j - 1] = x;
                }
        }
    return r->n_layer;
}


#endif
