/* Hybrid models (qwen3_next, qwen3_5_moe: Gated DeltaNet layers with a recurrent state beside
 * the paged KV cache), on the golden fixtures of tests/fixtures/models: the same logits whether
 * a prompt is prefilled in one step, in chunks of 7 or token by token; the state-slot rules
 * (a step must continue exactly where the sequence's state is, a released sequence loses its
 * state, slots run out and come back); greedy output unchanged under preemption by recompute,
 * with prefix caching asked for but off; sticky devices with their own state storage agreeing
 * with one device; and a missing or misshapen state tensor reported by name. test_forward
 * holds the comparisons with transformers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "safetensors.h"
#include "scheduler.h"
#include "st_writer.h"
#include "test.h"

static struct engine *make_engine(const struct model *m, enum engine_backend be, int devices,
                                  int max_seqs, size_t kv_bytes)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = be;
    ep.n_devices = devices;
    ep.max_batch_tokens = 256;
    ep.max_seqs = max_seqs;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    ep.kv_cache_bytes = kv_bytes;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

/* Prefills p in chunks of `chunk` tokens (logits for every position into out). */
static int prefill_chunked(struct engine *e, const struct golden_prompt *p, int chunk, float *out,
                           int V)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    int rc = 0;
    for (int done = 0; done < p->n && rc == 0;) {
        int c = p->n - done < chunk ? p->n - done : chunk;
        struct engine_item it = {.kv = &s, .tokens = p->ids + done, .n_tokens = c, .pos = done,
                                 .n_logits = c, .logits = out + (size_t)done * V};
        rc = engine_step(e, &it, 1, err, sizeof err);
        if (rc) fprintf(stderr, "step: %s\n", err);
        done += c;
    }
    engine_seq_free(e, &s);
    return rc;
}

static void check_chunking(const char *name, const struct model *m, const struct golden_prompt *p,
                           int np)
{
    int V = m->desc.vocab;
    const struct golden_prompt *lp = &p[0];
    for (int i = 1; i < np; i++) lp = p[i].n > lp->n ? &p[i] : lp;
    CHECKF(lp->n > 64, "%s: the longest prompt has %d tokens (want > 64)", name, lp->n);
    size_t cnt = (size_t)lp->n * V;
    float *one = malloc(sizeof(float) * cnt), *other = malloc(sizeof(float) * cnt);
    struct engine *e = make_engine(m, ENGINE_BACKEND_CPU, 1, 4, 0);
    CHECK(e && one && other);
    if (!e || !one || !other) goto out;
    CHECK(prefill_chunked(e, lp, lp->n, one, V) == 0);
    int chunks[2] = {7, 1};
    for (int c = 0; c < 2; c++) {
        CHECK(prefill_chunked(e, lp, chunks[c], other, V) == 0);
        double r = golden_rel_err(other, one, cnt);
        CHECKF(r <= 1e-6, "%s: prefill in chunks of %d differs from one step by %.3g", name,
               chunks[c], r);
        printf("%-14s %d tokens in chunks of %d: max rel diff %.2e from one step\n", name, lp->n,
               chunks[c], r);
    }
out:
    engine_free(e);
    free(one);
    free(other);
}

static void check_state_rules(const char *name, const struct model *m,
                              const struct golden_prompt *p)
{
    int V = m->desc.vocab;
    char err[MS_ERR_LEN] = "";
    struct engine *e = make_engine(m, ENGINE_BACKEND_CPU, 1, 2, 0);
    CHECK(e != NULL);
    if (!e) return;
    CHECK(engine_state_seq_bytes(e) > 0);
    float *a = malloc(sizeof(float) * (size_t)p->n * V), *b = malloc(sizeof(float) * (size_t)V);
    struct kv_seq s[3];
    for (int i = 0; i < 3; i++) CHECK(engine_seq_init(e, &s[i]) == 0);
    /* a first step past position 0: no state holds those positions */
    struct engine_item it = {.kv = &s[0], .tokens = p->ids, .n_tokens = 1, .pos = 3,
                             .n_logits = 1, .logits = b};
    CHECK(engine_step(e, &it, 1, err, sizeof err) == -1);
    CHECKF(strstr(err, "recurrent state holds positions [0, 0), the step starts at 3"), "%s",
           err);
    /* prefill, then continuing at a gap is refused too */
    it = (struct engine_item){.kv = &s[0], .tokens = p->ids, .n_tokens = p->n - 1, .pos = 0,
                              .n_logits = p->n - 1, .logits = a};
    CHECK(engine_step(e, &it, 1, err, sizeof err) == 0);
    it = (struct engine_item){.kv = &s[0], .tokens = p->ids + p->n - 1, .n_tokens = 1,
                              .pos = p->n, .n_logits = 1, .logits = b};
    CHECK(engine_step(e, &it, 1, err, sizeof err) == -1);
    /* a released sequence (preemption) keeps no state: continuing needs recompute */
    struct kv_cache *kv = engine_kv(e);
    CHECK(kv->n_slot_free == 1);
    kv_seq_release(kv, &s[0]);
    CHECK(kv->n_slot_free == 2 && s[0].slot == -1);
    it.pos = p->n - 1;
    CHECK(engine_step(e, &it, 1, err, sizeof err) == -1);
    /* two slots: a third sequence waits until one is released */
    for (int i = 0; i < 2; i++) {
        it = (struct engine_item){.kv = &s[i], .tokens = p->ids, .n_tokens = 2, .pos = 0,
                                  .n_logits = 1, .logits = b};
        CHECK(engine_step(e, &it, 1, err, sizeof err) == 0);
    }
    it.kv = &s[2];
    CHECK(engine_step(e, &it, 1, err, sizeof err) == -1);
    CHECKF(strstr(err, "every recurrent-state slot (2) is held"), "%s", err);
    kv_seq_release(kv, &s[1]);
    CHECK(engine_step(e, &it, 1, err, sizeof err) == 0);
    /* a sequence restarted at position 0 starts from a zero state, not the slot's last one */
    float *again = malloc(sizeof(float) * (size_t)p->n * V);
    it = (struct engine_item){.kv = &s[2], .tokens = p->ids, .n_tokens = p->n, .pos = 0,
                              .n_logits = p->n, .logits = again};
    CHECK(again && engine_step(e, &it, 1, err, sizeof err) == 0);
    it.kv = &s[0];
    it.logits = a;
    CHECK(engine_step(e, &it, 1, err, sizeof err) == 0);
    CHECKF(again && golden_rel_err(again, a, (size_t)p->n * V) == 0.0,
           "%s: a restarted sequence differs from a new one", name);
    for (int i = 0; i < 3; i++) engine_seq_free(e, &s[i]);
    CHECK(kv->n_slot_free == 2);
    free(again);
    free(a);
    free(b);
    engine_free(e);
}

/* Greedy tokens of `n` requests, with the KV cache of kv_bytes (0: room for all). */
#define N_REQ 6
#define MAX_TOK 10
static void run_requests(const struct model *m, size_t kv_bytes, const struct golden_prompt *p,
                         int np, int32_t out[N_REQ][MAX_TOK], struct sched_stats *st)
{
    struct engine *e = make_engine(m, ENGINE_BACKEND_CPU, 1, N_REQ, kv_bytes);
    struct sched_params sp = {.max_num_seqs = N_REQ, .max_num_batched_tokens = 32,
                              .disable_prefix_caching = false};
    char err[MS_ERR_LEN];
    struct sched *s = NULL;
    CHECK(e && sched_create(e, &sp, &s, err, sizeof err) == 0);
    if (!s) {
        engine_free(e);
        return;
    }
    struct sched_req *r[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        struct sched_req_params rp;
        sched_req_params_default(&rp);
        rp.max_tokens = MAX_TOK;
        rp.ignore_eos = true;
        rp.smp.temperature = 0;
        /* each prompt twice: equal prefixes that prefix caching would share */
        r[i] = sched_req_create(p[i % np].ids, p[i % np].n, &rp, err, sizeof err);
        CHECK(r[i] && sched_submit(s, r[i], err, sizeof err) == 0);
    }
    for (int guard = 0; guard < 100000 && sched_has_work(s); guard++) sched_step(s);
    for (int i = 0; i < N_REQ; i++) {
        sched_req_lock(r[i]);
        CHECKF(r[i]->out.n_tokens == MAX_TOK, "request %d: %d tokens (%s)", i, r[i]->out.n_tokens,
               r[i]->out.error);
        memcpy(out[i], r[i]->out.tokens, sizeof(int32_t) * MAX_TOK);
        sched_req_unlock(r[i]);
        sched_req_release(r[i]);
    }
    sched_get_stats(s, st);
    sched_free(s);
    engine_free(e);
}

static void check_preemption(const char *name, const struct model *m,
                             const struct golden_prompt *p, int np)
{
    int32_t roomy[N_REQ][MAX_TOK], tight[N_REQ][MAX_TOK];
    struct sched_stats st1, st2;
    memset(roomy, 0, sizeof roomy);
    memset(tight, 0, sizeof tight);
    run_requests(m, 0, p, np, roomy, &st1);
    CHECK(st1.preemptions == 0);
    CHECKF(st1.prefix_cache_queries == 0 && st1.prefix_cache_hits == 0,
           "%s: prefix caching ran on a hybrid model", name);
    /* room for about two of the longest requests: preemption by recompute */
    int k_row, v_row;
    model_kv_rows(&m->desc, &k_row, &v_row);
    size_t block = kv_block_bytes_rows(m->desc.n_layer - m->desc.n_linear, k_row, v_row, 4);
    run_requests(m, block * 48, p, np, tight, &st2);
    CHECKF(st2.preemptions > 0, "%s: expected preemptions with %d blocks", name,
           st2.kv_blocks_total);
    for (int i = 0; i < N_REQ; i++)
        CHECKF(memcmp(roomy[i], tight[i], sizeof roomy[i]) == 0,
               "%s request %d: greedy output differs after preemption", name, i);
    printf("%-14s %llu preemptions with %d KV blocks: greedy output unchanged\n", name,
           (unsigned long long)st2.preemptions, st2.kv_blocks_total);
}

/* Sticky devices (staged: memory of their own, as GPUs) hold their own state slots. */
static void check_sticky(const char *name, const struct model *m, const struct golden_prompt *p,
                         int np)
{
    int V = m->desc.vocab;
    struct engine *e1 = make_engine(m, ENGINE_BACKEND_CPU, 1, GOLDEN_MAX_PROMPTS, 0);
    struct engine *e2 = make_engine(m, ENGINE_BACKEND_CPU_STAGED, 2, GOLDEN_MAX_PROMPTS, 0);
    CHECK(e1 && e2);
    struct kv_seq seqs[GOLDEN_MAX_PROMPTS];
    struct engine_item items[GOLDEN_MAX_PROMPTS];
    float *outs[GOLDEN_MAX_PROMPTS] = {0};
    char err[MS_ERR_LEN];
    for (int round = 0; round < 2 && e1 && e2; round++) {
        for (int i = 0; i < np; i++) {
            engine_seq_init(e2, &seqs[i]);
            outs[i] = malloc(sizeof(float) * (size_t)p[i].n * V);
            /* in two steps: the second continues from each device's own state */
            int half = p[i].n / 2 > 0 ? p[i].n / 2 : p[i].n;
            items[i] = (struct engine_item){.kv = &seqs[i], .tokens = p[i].ids,
                                            .n_tokens = half, .n_logits = half,
                                            .logits = outs[i]};
        }
        CHECKF(engine_step(e2, items, np, err, sizeof err) == 0, "%s", err);
        int n2 = 0;
        struct engine_item rest[GOLDEN_MAX_PROMPTS];
        for (int i = 0; i < np; i++) {
            int half = items[i].n_tokens;
            if (half == p[i].n) continue;
            rest[n2++] = (struct engine_item){.kv = &seqs[i], .tokens = p[i].ids + half,
                                              .n_tokens = p[i].n - half, .pos = half,
                                              .n_logits = p[i].n - half,
                                              .logits = outs[i] + (size_t)half * V};
        }
        CHECKF(engine_step(e2, rest, n2, err, sizeof err) == 0, "%s", err);
        float *want = malloc(sizeof(float) * 128 * (size_t)V);
        for (int i = 0; i < np; i++) {
            CHECK(want && golden_prefill(e1, &p[i], 0, want) == 0);
            double r = want ? golden_rel_err(outs[i], want, (size_t)p[i].n * V) : 1.0;
            CHECKF(r <= 1e-6, "%s prompt %d: 2 sticky devices differ from 1 by %.3g", name, i, r);
            engine_seq_free(e2, &seqs[i]);
            free(outs[i]);
        }
        free(want);
    }
    engine_free(e1);
    engine_free(e2);
}

/* Copies fixture `name` to dir with one tensor dropped (shape NULL) or reshaped. */
static int write_variant(const char *tests, const char *name, const char *dir, const char *tensor,
                         const int64_t *shape, int ndim)
{
    char src[512], path[600], err[MS_ERR_LEN];
    snprintf(src, sizeof src, "%s/fixtures/models/%s", tests, name);
    mkdir(dir, 0755);
    const char *files[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                           "generation_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char cmd[1400];
        snprintf(cmd, sizeof cmd, "cp '%s/%s' '%s/'", src, files[i], dir);
        if (system(cmd) != 0) return -1;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    struct st_archive *st = NULL;
    if (st_open_file(path, &st, err, sizeof err) != 0) return -1;
    struct stw *w = stw_new();
    int rc = w ? 0 : -1;
    for (int i = 0; i < st_count(st) && rc == 0; i++) {
        const struct st_tensor *t = st_at(st, i);
        if (strcmp(t->name, tensor) == 0 && !shape) continue;
        bool re = strcmp(t->name, tensor) == 0;
        /* a reshaped tensor keeps its first elements */
        rc = stw_add(w, t->name, t->dtype, re ? ndim : t->ndim, re ? shape : t->shape, t->data,
                     err, sizeof err) < 0;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (rc == 0) rc = stw_write(w, path, err, sizeof err);
    stw_free(w);
    st_close(st);
    return rc;
}

static void check_bad_tensors(const char *tests)
{
    char dir[256], err[MS_ERR_LEN] = "";
    snprintf(dir, sizeof dir, "/tmp/moeserve_test_hybrid_%d", (int)getpid());
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    struct model *m = NULL;
    CHECK(write_variant(tests, "qwen3_5_moe", dir, "model.layers.1.linear_attn.A_log", NULL,
                        0) == 0);
    CHECK(model_load(dir, &lo, &m, err, sizeof err) == -1);
    CHECKF(strstr(err, "missing tensor 'model.layers.1.linear_attn.A_log'"), "%s", err);
    const int64_t small[3] = {64, 1, 3}; /* 64 channels of 3 taps instead of 96 of 4 */
    CHECK(write_variant(tests, "qwen3_5_moe", dir, "model.layers.0.linear_attn.conv1d.weight",
                        small, 3) == 0);
    CHECK(model_load(dir, &lo, &m, err, sizeof err) == -1);
    CHECKF(strstr(err, "model.layers.0.linear_attn.conv1d.weight") &&
               strstr(err, "expected shape (96, 1, 4)"),
           "%s", err);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    const char *names[] = {"qwen3_next", "qwen3_5_moe", "granitemoehybrid",
                           "granitemoehybrid_dense"};
    const int n_linear[] = {3, 3, 3, 2}; /* of 4 layers; the last one attention in each */
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        char dir[512], refpath[600], err[MS_ERR_LEN];
        snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, names[k]);
        snprintf(refpath, sizeof refpath, "%s/reference.safetensors", dir);
        struct model_load_opts lo;
        model_load_opts_default(&lo);
        struct model *m = NULL;
        struct st_archive *ref = NULL;
        CHECKF(model_load(dir, &lo, &m, err, sizeof err) == 0, "%s: %s", names[k], err);
        CHECKF(st_open_file(refpath, &ref, err, sizeof err) == 0, "%s", err);
        if (m && ref) {
            struct golden_prompt p[GOLDEN_MAX_PROMPTS];
            int np = golden_load_prompts(ref, p);
            CHECKF(m->desc.n_linear == n_linear[k] && m->desc.layer_linear[3] == false,
                   "%s: %d state-space layers", names[k], m->desc.n_linear);
            /* with every expert active, every parameter but the embedding rows counts */
            size_t all = model_active_params(m, m->desc.n_expert);
            size_t want = m->n_params - (size_t)m->desc.vocab * m->desc.d_model;
            CHECKF(all == want, "%s: %zu active parameters at top-%d, %zu in the checkpoint "
                                "less the embedding",
                   names[k], all, m->desc.n_expert, want);
            check_chunking(names[k], m, p, np);
            check_state_rules(names[k], m, &p[2]);
            check_preemption(names[k], m, p, np);
            check_sticky(names[k], m, p, np);
        }
        st_close(ref);
        model_free(m);
    }
    check_bad_tensors(tests);
    return test_done("test_hybrid");
}
