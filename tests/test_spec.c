/* Speculative decoding (engine/spec.h, engine/drafter.h and the scheduler's verification) on the
 * tiny fixtures of tests/fixtures/models, driven without HTTP:
 * - greedy output equal, token for token, to speculation off on every fixture family, for an
 *   oracle proposer (the right continuation with planted errors, so every acceptance length
 *   occurs) at k = 1..4, n-gram lookup and draft models (another family's model, and the model
 *   itself), in batches that mix speculating requests with `speculative: false` ones;
 * - the same under preemption (a small KV cache), with prefix caching (a second pass that hits
 *   the cache, and a prompt that extends a finished speculative request: only verified tokens
 *   were registered), on two staged devices, and on the hybrid families (their recurrent state
 *   rolled back after rejections);
 * - sampling at temperature 1 with top-p, min-p, penalties, logit_bias, min_tokens and a grammar:
 *   a seeded request's output equal to speculation off (the verification draws the same
 *   uniforms), and a two-sample chi-square test over 20,000 + 20,000 third tokens with and
 *   without speculation under disjoint seed schedules, at temperature 1 and with top-p 0.9
 *   (false-alarm rate 0.1% each);
 * - the counters (drafted, accepted, per position, expert rows), the n-gram proposer, KV
 *   truncation, the adaptive choice of k, and bad configurations refused by name. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drafter.h"
#include "engine.h"
#include "grammar.h"
#include "model.h"
#include "rng.h"
#include "sampler.h"
#include "scheduler.h"
#include "spec.h"
#include "test.h"

#define N_REQ      8
#define MAX_TOK    16
#define MAX_PROMPT 64

static int32_t prompts[N_REQ][MAX_PROMPT];
static int plen[N_REQ];

/* Prompts with repeated stretches (something for n-gram lookup to find) and random tails. */
static void make_prompts(int vocab)
{
    uint32_t x = 4242;
    for (int i = 0; i < N_REQ; i++) {
        int seg = 3 + i % 4, reps = 2 + i % 3, tail = 1 + (i * 7) % 9;
        int32_t s[8];
        for (int t = 0; t < seg; t++) {
            x = x * 1664525u + 1013904223u;
            s[t] = 1 + (int32_t)((x >> 8) % (uint32_t)(vocab - 1));
        }
        int n = 0;
        for (int r = 0; r < reps; r++)
            for (int t = 0; t < seg; t++)
                prompts[i][n++] = s[t];
        for (int t = 0; t < tail; t++) {
            x = x * 1664525u + 1013904223u;
            prompts[i][n++] = 1 + (int32_t)((x >> 8) % (uint32_t)(vocab - 1));
        }
        plen[i] = n;
    }
}

/* --- the oracle proposer ------------------------------------------------------------------- */

/* Proposes each request's reference continuation, with every draft whose hash falls on
 * err_mod replaced by another token (err_mod 0: all right). */
struct oracle {
    int32_t (*ref)[MAX_TOK];
    uint64_t ids[N_REQ];
    unsigned err_mod;
    int vocab;
};

static int oracle_propose(void *ctx, const struct sched_req *r, int k, int32_t *out)
{
    struct oracle *o = ctx;
    int idx = -1;
    for (int i = 0; i < N_REQ; i++)
        if (o->ids[i] == r->id) idx = i;
    if (idx < 0) return 0;
    int gen = r->n_total - r->n_prompt, n = 0;
    for (int j = 0; j < k && gen + j < MAX_TOK; j++, n++) {
        int32_t t = o->ref[idx][gen + j];
        uint64_t h =
            (r->id * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)(gen + j) * 0xbf58476d1ce4e5b9ull);
        h ^= h >> 29;
        if (o->err_mod && (h * 0x94d049bb133111ebull >> 40) % o->err_mod == 0)
            t = (t + 1) % o->vocab;
        out[j] = t;
    }
    return n;
}

/* --- running a batch ----------------------------------------------------------------------- */

enum proposer { PROP_NONE, PROP_ORACLE, PROP_NGRAM, PROP_DRAFT, PROP_MTP };

struct run {
    enum proposer prop;
    int k;
    bool adaptive;
    unsigned err_mod;          /* oracle */
    int32_t (*ref)[MAX_TOK];   /* oracle: the continuations */
    const struct model *draft; /* PROP_DRAFT */
    unsigned spec_mask;        /* requests that speculate (the others: speculative false) */
    size_t kv_bytes;           /* 0: room for all */
    int batch_tokens;
    bool prefix_caching;
    int passes; /* the batch run this many times on one scheduler */
    enum engine_backend backend;
    int devices;
    /* sampling (temperature 0: greedy) */
    float temperature, top_p, min_p, presence, repetition;
    int min_tokens;
    bool bias;
    struct grm_grammar *grammar;
};

static struct engine *make_engine(const struct model *m, const struct run *rn, bool spec_state)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = rn->backend;
    ep.n_devices = rn->devices > 0 ? rn->devices : 1;
    ep.n_threads = 1;
    ep.max_seqs = N_REQ;
    ep.max_batch_tokens = 64;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    ep.kv_cache_bytes = rn->kv_bytes;
    ep.spec_state = spec_state;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

static const struct smp_bias g_bias[3] = {{11, 5.0f}, {22, 4.0f}, {33, -100.0f}};

/* Runs the N_REQ requests together (rn->passes times); their tokens in out, the stats in st.
 * Returns 0, or -1 when something could not be set up. */
static int run_batch(const struct model *m, const struct run *rn, int32_t out[N_REQ][MAX_TOK],
                     struct sched_stats *st)
{
    char err[MS_ERR_LEN];
    bool spec = rn->prop != PROP_NONE;
    struct engine *e = make_engine(m, rn, spec && m->desc.n_linear > 0);
    struct drafter *dr = NULL;
    struct sched *s = NULL;
    int rc = -1;
    if (!e) return -1;
    struct spec_config sc = {.method = rn->prop == PROP_NGRAM ? SPEC_NGRAM
                                       : rn->prop == PROP_MTP ? SPEC_MTP
                                                              : SPEC_DRAFT_MODEL,
                             .k = rn->k,
                             .lookup_min = 1,
                             .lookup_max = 4,
                             .adaptive = rn->adaptive};
    struct oracle orc = {.ref = rn->ref, .err_mod = rn->err_mod, .vocab = m->desc.vocab};
    if (rn->prop == PROP_DRAFT && drafter_create(rn->draft, engine_get_params(e), m->desc.vocab,
                                                 rn->k, &dr, err, sizeof err) != 0) {
        fprintf(stderr, "drafter: %s\n", err);
        goto out;
    }
    if (rn->prop == PROP_MTP &&
        drafter_create_mtp(m, engine_get_params(e), rn->k, &dr, err, sizeof err) != 0) {
        fprintf(stderr, "MTP drafter: %s\n", err);
        goto out;
    }
    struct sched_params sp = {.max_num_seqs = N_REQ,
                              .max_num_batched_tokens = rn->batch_tokens ? rn->batch_tokens : 64,
                              .disable_prefix_caching = !rn->prefix_caching,
                              .spec = spec ? &sc : NULL,
                              .drafter = dr};
    if (rn->prop == PROP_ORACLE) {
        sp.spec_propose = oracle_propose;
        sp.spec_ctx = &orc;
    }
    if (sched_create(e, &sp, &s, err, sizeof err) != 0) {
        fprintf(stderr, "sched: %s\n", err);
        goto out;
    }
    rc = 0;
    for (int pass = 0; pass < (rn->passes > 0 ? rn->passes : 1); pass++) {
        struct sched_req *r[N_REQ];
        for (int i = 0; i < N_REQ; i++) {
            struct sched_req_params p;
            sched_req_params_default(&p);
            p.max_tokens = MAX_TOK;
            p.ignore_eos = true;
            p.smp.temperature = rn->temperature;
            p.smp.top_p = rn->top_p > 0 ? rn->top_p : 1.0f;
            p.smp.min_p = rn->min_p;
            p.smp.presence_penalty = rn->presence;
            p.smp.repetition_penalty = rn->repetition > 0 ? rn->repetition : 1.0f;
            p.smp.has_seed = true;
            p.smp.seed = 1000 + (uint64_t)i;
            p.min_tokens = rn->min_tokens;
            if (rn->bias) {
                p.smp.bias = g_bias;
                p.smp.n_bias = 3;
            }
            p.grammar = rn->grammar;
            p.speculative = (rn->spec_mask >> i) & 1;
            r[i] = sched_req_create(prompts[i], plen[i], &p, err, sizeof err);
            if (!r[i] || sched_submit(s, r[i], err, sizeof err) != 0) {
                fprintf(stderr, "request %d: %s\n", i, err);
                rc = -1;
            }
            orc.ids[i] = r[i] ? r[i]->id : 0;
        }
        for (int guard = 0; guard < 100000 && sched_has_work(s); guard++)
            sched_step(s);
        for (int i = 0; i < N_REQ; i++) {
            if (!r[i]) continue;
            sched_req_lock(r[i]);
            memset(out[i], 0xff, sizeof out[i]);
            memcpy(out[i], r[i]->out.tokens, sizeof(int32_t) * (size_t)r[i]->out.n_tokens);
            if (!rn->grammar && r[i]->out.n_tokens != MAX_TOK) {
                fprintf(stderr, "request %d: %d tokens (%s)\n", i, r[i]->out.n_tokens,
                        r[i]->out.error);
                rc = -1;
            }
            sched_req_unlock(r[i]);
            sched_req_release(r[i]);
        }
    }
    sched_get_stats(s, st);
    if (st->kv_blocks_free != st->kv_blocks_total) {
        fprintf(stderr, "%d of %d KV blocks still held after the batch\n",
                st->kv_blocks_total - st->kv_blocks_free, st->kv_blocks_total);
        rc = -1;
    }
    if (dr &&
        kv_free_blocks(engine_kv(drafter_engine(dr))) != engine_kv(drafter_engine(dr))->n_blocks) {
        fprintf(stderr, "draft KV blocks still held after the batch\n");
        rc = -1;
    }
out:
    sched_free(s);
    drafter_free(dr);
    engine_free(e);
    return rc;
}

/* Counters agree with themselves: per-position acceptance sums to the accepted tokens and falls
 * with the position; rows are drafted tokens times the model's rows per token. */
static void check_counters(const char *what, const struct model *m, const struct sched_stats *st)
{
    uint64_t sum = 0;
    for (int j = 0; j < SPEC_MAX_K; j++) {
        sum += st->spec_accepted_per_pos[j];
        if (j > 0)
            CHECKF(st->spec_accepted_per_pos[j] <= st->spec_accepted_per_pos[j - 1],
                   "%s: position %d accepted more than position %d", what, j, j - 1);
    }
    CHECKF(sum == st->spec_accepted_tokens, "%s: per-position sum %llu != accepted %llu", what,
           (unsigned long long)sum, (unsigned long long)st->spec_accepted_tokens);
    CHECK(st->spec_accepted_tokens <= st->spec_draft_tokens);
    CHECK(st->spec_rejected_rows <= st->spec_draft_rows);
    int n_moe = 0;
    for (int l = 0; l < m->desc.n_layer; l++)
        n_moe += m->desc.layer_is_moe[l] ? 1 : 0;
    if (m->desc.ffn != FFN_KIND_CONTINUOUS && m->desc.n_expert > 0)
        CHECKF(st->spec_draft_rows == st->spec_draft_tokens * (uint64_t)(m->desc.top_k * n_moe),
               "%s: %llu draft rows for %llu drafted tokens (%d x %d per token)", what,
               (unsigned long long)st->spec_draft_rows, (unsigned long long)st->spec_draft_tokens,
               m->desc.top_k, n_moe);
}

static bool same(int32_t a[N_REQ][MAX_TOK], int32_t b[N_REQ][MAX_TOK], const char *what)
{
    bool ok = true;
    for (int i = 0; i < N_REQ; i++)
        if (memcmp(a[i], b[i], sizeof a[i]) != 0) {
            fprintf(stderr, "%s: request %d differs from speculation off\n", what, i);
            ok = false;
        }
    return ok;
}

/* Runs rn and compares with ref; prints and returns the acceptance. */
static double check_run(const char *fam, const char *what, const struct model *m,
                        const struct run *rn, int32_t ref[N_REQ][MAX_TOK],
                        struct sched_stats *st_out)
{
    int32_t got[N_REQ][MAX_TOK];
    struct sched_stats st;
    memset(&st, 0, sizeof st);
    char name[160];
    snprintf(name, sizeof name, "%s %s", fam, what);
    CHECKF(run_batch(m, rn, got, &st) == 0, "%s: run failed", name);
    CHECKF(same(got, ref, name), "%s: output differs", name);
    check_counters(name, m, &st);
    double acc = st.spec_draft_tokens ? (double)st.spec_accepted_tokens / st.spec_draft_tokens : 0;
    printf("  %-34s drafted %4llu accepted %4llu (%.2f) steps %4llu rollbacks %llu\n", name,
           (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens,
           acc, (unsigned long long)st.steps, (unsigned long long)st.spec_rollbacks);
    if (st_out) *st_out = st;
    return acc;
}

/* --- greedy identity over the families ----------------------------------------------------- */

static void check_family(const char *tests, const char *fam, const struct model *draft_other)
{
    char err[MS_ERR_LEN], rel[256];
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    snprintf(rel, sizeof rel, "fixtures/models/%s", fam);
    if (model_load(test_path(tests, rel), &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", fam, err);
        CHECK(0);
        return;
    }
    int32_t ref[N_REQ][MAX_TOK];
    struct sched_stats st;
    struct run base = {.prop = PROP_NONE};
    CHECKF(run_batch(m, &base, ref, &st) == 0, "%s: baseline", fam);
    printf("%s:\n", fam);
    bool hybrid = m->desc.n_linear > 0;
    for (int k = 1; k <= 4; k++) {
        /* every other request speculates; a third of the drafts are wrong */
        struct run rn = {
            .prop = PROP_ORACLE, .k = k, .err_mod = 3, .ref = ref, .spec_mask = 0x55u << (k & 1)};
        char what[64];
        snprintf(what, sizeof what, "oracle k=%d", k);
        check_run(fam, what, m, &rn, ref, &st);
        CHECKF(st.spec_accepted_tokens > 0 && st.spec_accepted_tokens < st.spec_draft_tokens,
               "%s %s: the oracle's drafts should be partly accepted", fam, what);
        if (hybrid) CHECKF(st.spec_rollbacks > 0, "%s %s: no state rollback", fam, what);
    }
    struct run ng = {.prop = PROP_NGRAM, .k = 3, .adaptive = true, .spec_mask = 0xffu};
    check_run(fam, "ngram k=3 adaptive", m, &ng, ref, &st);
    struct run ng4 = {.prop = PROP_NGRAM, .k = 4, .spec_mask = 0xf0u};
    check_run(fam, "ngram k=4", m, &ng4, ref, &st);
    struct run dr = {.prop = PROP_DRAFT, .k = 2, .draft = draft_other, .spec_mask = 0xffu};
    check_run(fam, "draft(mixtral) k=2", m, &dr, ref, &st);
    if (!hybrid) {
        /* the model as its own draft: greedy drafts are the greedy output, all accepted
         * (bf16 and batch composition aside, which the fixtures' f32 keeps exact) */
        struct run self = {.prop = PROP_DRAFT, .k = 3, .draft = m, .spec_mask = 0xffu};
        double acc = check_run(fam, "draft(self) k=3", m, &self, ref, &st);
        CHECKF(acc > 0.99, "%s: self-drafting accepted %.3f", fam, acc);
    }
    model_free(m);
}

/* The checkpoint's MTP module (deepseek_v3, glm4_moe, qwen3_next: random weights, so few of its
 * drafts are accepted; test_mtp checks what it drafts) through the scheduler: greedy output equal to
 * speculation off at k = 1..4 in batches mixing speculating requests with others, with prefix
 * caching (the second pass starts from cached prefixes, the module's K/V among them, and keeps
 * drafting) and under preemption. */
static size_t kv_bytes_for(const struct model *m, int blocks);

static void check_mtp(const char *tests, const char *fam)
{
    char err[MS_ERR_LEN], rel[256];
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.mtp = true;
    snprintf(rel, sizeof rel, "fixtures/models/%s", fam);
    if (model_load(test_path(tests, rel), &lo, &m, err, sizeof err) != 0 || m->n_mtp < 1) {
        fprintf(stderr, "%s: %s\n", fam, err);
        CHECK(0);
        model_free(m);
        return;
    }
    int32_t ref[N_REQ][MAX_TOK];
    struct sched_stats st;
    struct run base = {.prop = PROP_NONE};
    CHECKF(run_batch(m, &base, ref, &st) == 0, "%s: baseline", fam);
    printf("%s (MTP):\n", fam);
    for (int k = 1; k <= 4; k++) {
        struct run rn = {.prop = PROP_MTP, .k = k, .spec_mask = k == 4 ? 0xffu : 0x55u << (k & 1),
                         .adaptive = k == 3};
        char what[64];
        snprintf(what, sizeof what, "mtp k=%d%s", k, rn.adaptive ? " adaptive" : "");
        check_run(fam, what, m, &rn, ref, &st);
        CHECKF(st.spec_draft_tokens > 0, "%s %s: no drafts", fam, what);
    }
    struct run pc1 = {.prop = PROP_MTP, .k = 2, .spec_mask = 0xffu, .prefix_caching = true,
                      .passes = 1};
    check_run(fam, "mtp k=2 prefix caching, 1 pass", m, &pc1, ref, &st);
    uint64_t one_pass = st.spec_draft_tokens;
    struct run pc = pc1;
    pc.passes = 2;
    check_run(fam, "mtp k=2 prefix caching, 2 passes", m, &pc, ref, &st);
    /* the second pass starts from the first's cached blocks, the module's among them: its
     * sequences keep drafting (without the module's cache they could not draft at all).
     * Hybrids cache no prefixes (their state is not per block): both passes draft alike. */
    CHECKF(m->desc.n_linear > 0 || st.prefix_cache_hits > 0, "%s: no prefix hit", fam);
    CHECKF(st.spec_draft_tokens > one_pass * 3 / 2, "%s: 2 passes drafted %llu tokens, 1 pass %llu",
           fam, (unsigned long long)st.spec_draft_tokens, (unsigned long long)one_pass);
    uint64_t preemptions = 0;
    static const int pool_blocks[] = {24, 32, 40};
    for (size_t b = 0; b < sizeof pool_blocks / sizeof pool_blocks[0]; b++) {
        struct run pre = {.prop = PROP_MTP, .k = 3, .spec_mask = 0xffu,
                          .kv_bytes = kv_bytes_for(m, pool_blocks[b]), .batch_tokens = 32};
        char what[64];
        snprintf(what, sizeof what, "mtp k=3, %d blocks", pool_blocks[b]);
        check_run(fam, what, m, &pre, ref, &st);
        preemptions += st.preemptions;
    }
    CHECKF(preemptions > 0, "%s: no preemption with 24..40 blocks", fam);
    model_free(m);
}

/* --- scheduling situations on one family --------------------------------------------------- */

static size_t kv_bytes_for(const struct model *m, int blocks)
{
    struct kv_geom g;
    engine_kv_geom(m, ENGINE_KV_AUTO, &g);
    return kv_geom_token_bytes(&g) * (size_t)(m->desc.n_layer - m->desc.n_linear) * 4 *
           (size_t)blocks;
}

static void check_situations(const char *tests, const char *fam)
{
    char err[MS_ERR_LEN], rel[256];
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    snprintf(rel, sizeof rel, "fixtures/models/%s", fam);
    if (model_load(test_path(tests, rel), &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", fam, err);
        CHECK(0);
        return;
    }
    printf("%s, scheduling situations:\n", fam);
    int32_t ref[N_REQ][MAX_TOK];
    struct sched_stats st;
    struct run base = {.prop = PROP_NONE};
    CHECK(run_batch(m, &base, ref, &st) == 0);
    uint64_t base_steps = st.steps;

    /* preemption: room for about three requests at a time. Whether a given pool runs out
     * depends on how fast drafts finish requests, so several sizes are run: each must give the
     * reference output, and at least one must have preempted. */
    uint64_t preemptions = 0;
    static const int pool_blocks[] = {32, 36, 40, 48};
    for (size_t b = 0; b < sizeof pool_blocks / sizeof pool_blocks[0]; b++) {
        struct run pre = {.prop = PROP_ORACLE,
                          .k = 3,
                          .err_mod = 3,
                          .ref = ref,
                          .spec_mask = 0xffu,
                          .kv_bytes = kv_bytes_for(m, pool_blocks[b]),
                          .batch_tokens = 32};
        char what[64];
        snprintf(what, sizeof what, "preemption oracle k=3, %d blocks", pool_blocks[b]);
        check_run(fam, what, m, &pre, ref, &st);
        preemptions += st.preemptions;
    }
    CHECKF(preemptions > 0, "%s: no preemption with 32..48 blocks", fam);
    /* every draft right: everything accepted, fewer steps */
    struct run all = {.prop = PROP_ORACLE, .k = 4, .ref = ref, .spec_mask = 0xffu};
    double acc = check_run(fam, "oracle k=4 all right", m, &all, ref, &st);
    CHECK(acc == 1.0);
    CHECKF(st.steps * 2 < base_steps, "%s: %llu steps with every draft accepted, %llu without", fam,
           (unsigned long long)st.steps, (unsigned long long)base_steps);
    /* adaptive k: drafts still flow for a request that accepts everything */
    struct run ad = {.prop = PROP_ORACLE,
                     .k = 4,
                     .adaptive = true,
                     .err_mod = 5,
                     .ref = ref,
                     .spec_mask = 0xffu};
    check_run(fam, "oracle k<=4 adaptive", m, &ad, ref, &st);
    if (m->desc.n_linear == 0) {
        /* prefix caching: the second pass hits the first's blocks (registered only up to
         * verified tokens) */
        struct run pc = {.prop = PROP_ORACLE,
                         .k = 3,
                         .err_mod = 3,
                         .ref = ref,
                         .spec_mask = 0xffu,
                         .prefix_caching = true,
                         .passes = 2};
        check_run(fam, "prefix caching, 2 passes", m, &pc, ref, &st);
        CHECKF(st.prefix_cache_hits > 0, "%s: no prefix hit", fam);
        struct run pcp = pc;
        pcp.kv_bytes = kv_bytes_for(m, 48);
        pcp.batch_tokens = 32;
        check_run(fam, "prefix caching + preemption", m, &pcp, ref, &st);
    }
    /* two staged devices: sequences (and hybrids' states) sticky to their device */
    struct run stg = {.prop = PROP_ORACLE,
                      .k = 2,
                      .err_mod = 3,
                      .ref = ref,
                      .spec_mask = 0xffu,
                      .backend = ENGINE_BACKEND_CPU_STAGED,
                      .devices = 2};
    check_run(fam, "2 staged devices k=2", m, &stg, ref, &st);
    model_free(m);
}

/* Registration covers only verified tokens: a prompt that extends a finished speculative
 * request's prompt and output takes its blocks from the cache and continues exactly as without
 * any cache. */
static void check_registration(const struct model *m)
{
    int32_t ref[N_REQ][MAX_TOK];
    struct sched_stats st;
    struct run base = {.prop = PROP_NONE};
    CHECK(run_batch(m, &base, ref, &st) == 0);
    char err[MS_ERR_LEN];
    struct run rn = {.prop = PROP_ORACLE, .k = 4, .err_mod = 2, .ref = ref};
    struct engine *e = make_engine(m, &rn, false);
    struct spec_config sc = {.method = SPEC_NGRAM, .k = 4};
    struct oracle orc = {.ref = ref, .err_mod = 2, .vocab = m->desc.vocab};
    struct sched_params sp = {.max_num_seqs = N_REQ,
                              .max_num_batched_tokens = 64,
                              .spec = &sc,
                              .spec_propose = oracle_propose,
                              .spec_ctx = &orc};
    struct sched *s = NULL;
    CHECK(e && sched_create(e, &sp, &s, err, sizeof err) == 0);
    struct run off = {.prop = PROP_NONE};
    struct engine *e2 = make_engine(m, &off, false);
    struct sched_params sp2 = {
        .max_num_seqs = N_REQ, .max_num_batched_tokens = 64, .disable_prefix_caching = true};
    struct sched *s2 = NULL;
    CHECK(e2 && sched_create(e2, &sp2, &s2, err, sizeof err) == 0);
    for (int i = 0; s && s2 && i < N_REQ; i += 3) {
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = MAX_TOK;
        p.ignore_eos = true;
        p.smp.temperature = 0;
        struct sched_req *a = sched_req_create(prompts[i], plen[i], &p, err, sizeof err);
        orc.ids[i] = a->id;
        CHECK(sched_submit(s, a, err, sizeof err) == 0);
        while (sched_has_work(s))
            sched_step(s);
        int32_t ext[MAX_PROMPT + MAX_TOK];
        memcpy(ext, prompts[i], sizeof(int32_t) * (size_t)plen[i]);
        memcpy(ext + plen[i], a->out.tokens, sizeof(int32_t) * MAX_TOK);
        sched_req_release(a);
        int n = plen[i] + MAX_TOK;
        p.max_tokens = 8;
        struct sched_req *b = sched_req_create(ext, n, &p, err, sizeof err);
        struct sched_req *c = sched_req_create(ext, n, &p, err, sizeof err);
        CHECK(sched_submit(s, b, err, sizeof err) == 0 &&
              sched_submit(s2, c, err, sizeof err) == 0);
        while (sched_has_work(s))
            sched_step(s);
        while (sched_has_work(s2))
            sched_step(s2);
        CHECKF(b->out.n_cached_tokens > 0, "request %d: the extension hit nothing", i);
        CHECKF(memcmp(b->out.tokens, c->out.tokens, sizeof(int32_t) * 8) == 0,
               "request %d: continuing from cached speculative blocks differs", i);
        sched_req_release(b);
        sched_req_release(c);
    }
    sched_get_stats(s, &st);
    printf("registration: %llu of %llu prompt tokens hit after speculative requests\n",
           (unsigned long long)st.prefix_cache_hits, (unsigned long long)st.prefix_cache_queries);
    sched_free(s);
    sched_free(s2);
    engine_free(e);
    engine_free(e2);
}

/* --- sampling ------------------------------------------------------------------------------ */

/* Seeded sampling with every knob: the same tokens with and without speculation. */
static void check_seeded(const struct model *m, const struct grm_vocab *gv)
{
    struct run base = {.prop = PROP_NONE,
                       .temperature = 1.0f,
                       .top_p = 0.9f,
                       .min_p = 0.02f,
                       .presence = 0.4f,
                       .repetition = 1.2f,
                       .min_tokens = 4,
                       .bias = true};
    int32_t ref[N_REQ][MAX_TOK];
    struct sched_stats st;
    CHECK(run_batch(m, &base, ref, &st) == 0);
    for (int k = 1; k <= 4; k += 3) {
        struct run rn = base;
        rn.prop = PROP_ORACLE;
        rn.k = k;
        rn.err_mod = 4;
        rn.ref = ref;
        rn.spec_mask = 0xffu;
        char what[64];
        snprintf(what, sizeof what, "seeded T=1 top-p k=%d", k);
        check_run("mixtral", what, m, &rn, ref, &st);
        CHECK(st.spec_accepted_tokens > 0);
        rn.prop = PROP_NGRAM;
        snprintf(what, sizeof what, "seeded T=1 ngram k=%d", k);
        check_run("mixtral", what, m, &rn, ref, &st);
    }
    /* a grammar: the drafts are checked against the grammar-masked target */
    if (!gv) return;
    struct grm_grammar *g = NULL;
    char err[MS_ERR_LEN];
    CHECKF(grm_compile(GRM_JSON_OBJECT, "", gv, &g, err, sizeof err, NULL, 0) == 0, "%s", err);
    if (!g) return;
    for (int t = 0; t < 2; t++) {
        struct run gb = {.prop = PROP_NONE, .temperature = t ? 1.0f : 0.0f, .grammar = g};
        int32_t gref[N_REQ][MAX_TOK];
        CHECK(run_batch(m, &gb, gref, &st) == 0);
        struct run gs = gb;
        gs.prop = PROP_ORACLE;
        gs.k = 3;
        gs.err_mod = 3;
        gs.ref = gref;
        gs.spec_mask = 0xffu;
        check_run("mixtral", t ? "json_object T=1 k=3" : "json_object greedy k=3", m, &gs, gref,
                  &st);
    }
    grm_release(g);
}

/* Upper critical value of chi-square with df degrees of freedom at upper tail 0.001
 * (Wilson-Hilferty; within 1% for df >= 10). */
static double chi2_crit_001(int df)
{
    double z = 3.0902, a = 2.0 / (9.0 * df);
    double c = 1.0 - a + z * sqrt(a);
    return df * c * c * c;
}

/* Two-sample chi-square homogeneity statistic over V categories, categories with fewer than
 * 10 observations in both samples together pooled into one. Returns it with *df set. */
static double chi2_two_sample(const int *a, const int *b, int V, int *df)
{
    long na = 0, nb = 0;
    for (int i = 0; i < V; i++) {
        na += a[i];
        nb += b[i];
    }
    double stat = 0;
    int bins = 0;
    long pa = 0, pb = 0;
    for (int i = 0; i <= V; i++) {
        long x, y;
        if (i < V) {
            if (a[i] + b[i] < 10) {
                pa += a[i];
                pb += b[i];
                continue;
            }
            x = a[i];
            y = b[i];
        } else {
            if (pa + pb == 0) break;
            x = pa;
            y = pb;
        }
        double n = (double)(x + y), ea = n * na / (na + nb), eb = n * nb / (na + nb);
        stat += (x - ea) * (x - ea) / ea + (y - eb) * (y - eb) / eb;
        bins++;
    }
    *df = bins - 1;
    return stat;
}

/* A draft that logit_bias makes likely (token 11), every time. */
static int fixed_propose(void *ctx, const struct sched_req *r, int k, int32_t *out)
{
    (void)ctx;
    (void)r;
    for (int j = 0; j < k; j++)
        out[j] = 11;
    return k;
}

/* The third generated token's distribution with speculation and without, each over DIST_N
 * samples whose seed schedules do not overlap (1.. without, 1000000.. with): a chi-square
 * homogeneity test at 0.1% (so a correct implementation fails one seed schedule in 1,000;
 * these are fixed, so the test is deterministic). With speculation the second token is verified
 * against a draft of token 11, so the third comes from the draft's row when the draft was
 * accepted and from a fresh step when it was not; the presence penalty makes its distribution
 * depend on the second token having been taken into the sampler either way. */
#define DIST_N 20000
static void check_distribution(const struct model *m, float top_p, bool sampled_drafts)
{
    char err[MS_ERR_LEN];
    int V = m->desc.vocab;
    int *hist[2];
    hist[0] = calloc((size_t)V, sizeof(int));
    hist[1] = calloc((size_t)V, sizeof(int));
    uint64_t drafted = 0, accepted = 0;
    double t0 = ms_now();
    const int32_t prompt[3] = {prompts[3][0], prompts[3][1], prompts[3][2]};
    for (int withspec = 0; withspec < 2 && hist[0] && hist[1]; withspec++) {
        struct engine_params ep;
        engine_params_default(&ep);
        ep.n_threads = 1;
        ep.max_seqs = 64;
        ep.max_batch_tokens = 512;
        ep.max_model_len = 16;
        ep.kv_block_size = 4;
        struct engine *e = NULL;
        CHECK(engine_create(m, &ep, &e, err, sizeof err) == 0);
        struct spec_config sc = {.method = SPEC_NGRAM, .k = 1};
        struct sched_params sp = {.max_num_seqs = 64,
                                  .max_num_batched_tokens = 512,
                                  .disable_prefix_caching = true,
                                  .spec = withspec ? &sc : NULL,
                                  .spec_propose = withspec ? fixed_propose : NULL};
        struct drafter *dr = NULL;
        if (withspec && sampled_drafts) {
            /* the model drafting for itself from softmax(logits): p has logit_bias, the
             * presence penalty and top-p, q has none of them */
            sc.method = SPEC_DRAFT_MODEL;
            sc.k = 2;
            sp.spec_propose = NULL;
            sp.spec_sample_seeded = true;
            CHECK(drafter_create(m, engine_get_params(e), V, 2, &dr, err, sizeof err) == 0);
            CHECK(dr && drafter_samples(dr));
            sp.drafter = dr;
        }
        struct sched *s = NULL;
        CHECK(e && sched_create(e, &sp, &s, err, sizeof err) == 0);
        if (!s) {
            drafter_free(dr);
            engine_free(e);
            break;
        }
        static struct sched_req *batch[64];
        for (int n0 = 0; n0 < DIST_N; n0 += 64) {
            int nb = DIST_N - n0 < 64 ? DIST_N - n0 : 64;
            for (int b = 0; b < nb; b++) {
                struct sched_req_params p;
                sched_req_params_default(&p);
                p.max_tokens = 3;
                p.ignore_eos = true;
                p.smp.temperature = 1.0f;
                p.smp.top_p = top_p;
                p.smp.presence_penalty = 0.7f;
                p.smp.bias = g_bias;
                p.smp.n_bias = 3;
                p.smp.has_seed = true;
                p.smp.seed = (uint64_t)(withspec ? 1000000 : 1) + (uint64_t)(n0 + b);
                batch[b] = sched_req_create(prompt, 3, &p, err, sizeof err);
                CHECK(batch[b] && sched_submit(s, batch[b], err, sizeof err) == 0);
            }
            while (sched_has_work(s))
                sched_step(s);
            for (int b = 0; b < nb; b++) {
                if (batch[b]->out.n_tokens == 3) hist[withspec][batch[b]->out.tokens[2]]++;
                sched_req_release(batch[b]);
            }
        }
        struct sched_stats st;
        sched_get_stats(s, &st);
        if (withspec) {
            drafted = st.spec_draft_tokens;
            accepted = st.spec_accepted_tokens;
        }
        sched_free(s);
        drafter_free(dr);
        engine_free(e);
    }
    int df = 0;
    double stat = chi2_two_sample(hist[0], hist[1], V, &df), crit = chi2_crit_001(df);
    printf("distribution (%s drafts, T=1, top_p %.2f, presence 0.7, logit_bias): chi-square "
           "%.1f on %d df, critical %.1f at 0.1%%; %llu drafts, %llu accepted; %.1fs\n",
           sampled_drafts ? "sampled" : "fixed", top_p, stat, df, crit, (unsigned long long)drafted,
           (unsigned long long)accepted, ms_now() - t0);
    CHECKF(df >= 10, "only %d degrees of freedom", df);
    CHECKF(stat < crit,
           "third-token distributions differ with speculation: chi-square %.1f >= "
           "%.1f (%d df)",
           stat, crit, df);
    /* the accepted path must carry enough of the samples for the test to see it: at least
     * 1 in 20 (a fixed draft is accepted with its probability under p, ~5-6% here) */
    CHECKF(drafted >= DIST_N && accepted >= DIST_N / 20,
           "too few drafts accepted (%llu of %llu) to test the path", (unsigned long long)accepted,
           (unsigned long long)drafted);
    free(hist[0]);
    free(hist[1]);
}

/* The general rule on the sampler alone: a draft x drawn from q, verified against p (temperature,
 * top-k, top-p applied), gives tokens distributed as p (chi-square goodness of fit over 200,000
 * draws at 0.1%), x accepted as often as sum min(p, q) says (within 4.5 standard deviations),
 * the token equal to x exactly when accepted; with q NULL the tokens are smp_sample's. */
static void check_general_rule(void)
{
    enum { V = 48, N = 200000 };
    static const struct {
        float t, top_p;
        int top_k;
    } cfg[] = {{1.0f, 1.0f, 0}, {0.7f, 0.8f, 0}, {1.3f, 1.0f, 12}};
    struct ms_rng g;
    ms_rng_seed(&g, 99);
    float logits[V], q[V], row[V];
    double ql[V], qs = 0;
    for (int i = 0; i < V; i++) {
        logits[i] = (float)(3.0 * ms_rng_uniform(&g) - 1.5);
        ql[i] = exp(3.0 * ms_rng_uniform(&g) - 1.5);
        qs += ql[i];
    }
    for (int i = 0; i < V; i++)
        q[i] = (float)(ql[i] / qs);
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        /* the exact p: weights, top-k (ties to the lower id), top-p over what is left */
        double w[V], p[V], mx = -1e30, tot = 0;
        int order[V];
        for (int i = 0; i < V; i++)
            mx = logits[i] > mx ? logits[i] : mx;
        for (int i = 0; i < V; i++) {
            w[i] = exp(((double)logits[i] - mx) / cfg[c].t);
            order[i] = i;
        }
        for (int i = 1; i < V; i++) /* insertion sort: w descending, id ascending */
            for (int j = i; j > 0 && (w[order[j]] > w[order[j - 1]]); j--) {
                int t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        int keep = cfg[c].top_k > 0 ? cfg[c].top_k : V;
        for (int j = 0; j < keep; j++)
            tot += w[order[j]];
        if (cfg[c].top_p < 1.0f) {
            double acc = 0;
            int j = 0;
            while (j < keep && acc < cfg[c].top_p * tot)
                acc += w[order[j++]];
            keep = j;
            tot = acc;
        }
        for (int i = 0; i < V; i++)
            p[i] = 0;
        for (int j = 0; j < keep; j++)
            p[order[j]] = w[order[j]] / tot;
        double want_acc = 0;
        for (int i = 0; i < V; i++)
            want_acc += p[i] < q[i] ? p[i] : q[i];

        struct smp_params sp;
        smp_params_default(&sp);
        sp.temperature = cfg[c].t;
        sp.top_p = cfg[c].top_p;
        sp.top_k = cfg[c].top_k;
        sp.has_seed = true;
        sp.seed = 7 + c;
        struct sampler *s = smp_create(V, &sp), *s2 = smp_create(V, &sp), *s3 = smp_create(V, &sp);
        static int hist[V];
        memset(hist, 0, sizeof hist);
        long n_acc = 0, bad = 0, differ = 0;
        for (int n = 0; n < N; n++) {
            double u = ms_rng_uniform(&g), a = 0;
            int32_t x = V - 1;
            for (int i = 0; i < V; i++) {
                a += q[i];
                if (u < a) {
                    x = i;
                    break;
                }
            }
            memcpy(row, logits, sizeof row);
            bool acc;
            int32_t t = smp_sample_verify(s, row, x, q, V, &acc, NULL);
            hist[t]++;
            n_acc += acc;
            bad += acc != (t == x);
            if (n < 2000) { /* q NULL: smp_sample's draw */
                float r2[V], r3[V];
                memcpy(r2, logits, sizeof r2);
                memcpy(r3, logits, sizeof r3);
                bool acc2;
                differ +=
                    smp_sample_verify(s2, r2, x, NULL, 0, &acc2, NULL) != smp_sample(s3, r3, NULL);
            }
        }
        double stat = 0;
        int bins = 0;
        long zero_hits = 0;
        for (int i = 0; i < V; i++) {
            if (p[i] == 0) {
                zero_hits += hist[i];
                continue;
            }
            double e = p[i] * N;
            stat += (hist[i] - e) * (hist[i] - e) / e;
            bins++;
        }
        double acc_rate = (double)n_acc / N, sd = sqrt(want_acc * (1 - want_acc) / N);
        printf("general rule (T %.1f, top_p %.1f, top_k %d): chi-square %.1f on %d df (critical "
               "%.1f), acceptance %.4f (sum min(p, q) %.4f)\n",
               cfg[c].t, cfg[c].top_p, cfg[c].top_k, stat, bins - 1, chi2_crit_001(bins - 1),
               acc_rate, want_acc);
        CHECK(zero_hits == 0);
        CHECKF(stat < chi2_crit_001(bins - 1),
               "general rule config %zu: tokens not distributed "
               "as p (chi-square %.1f)",
               c, stat);
        CHECKF(fabs(acc_rate - want_acc) < 4.5 * sd, "acceptance %.4f, want %.4f", acc_rate,
               want_acc);
        CHECK(bad == 0 && differ == 0);
        smp_free(s);
        smp_free(s2);
        smp_free(s3);
    }
}

/* --- units --------------------------------------------------------------------------------- */

static void check_config(void)
{
    struct spec_config c;
    char err[MS_ERR_LEN];
    CHECK(spec_config_parse("{\"method\":\"ngram\",\"num_speculative_tokens\":4}", &c, err,
                            sizeof err) == 0);
    CHECK(c.method == SPEC_NGRAM && c.k == 4 && c.lookup_min == 2 && c.lookup_max == 5 &&
          c.adaptive);
    CHECK(spec_config_parse("{\"method\":\"ngram\",\"num_speculative_tokens\":2,"
                            "\"prompt_lookup_min\":3,\"prompt_lookup_max\":7,\"adaptive\":false}",
                            &c, err, sizeof err) == 0);
    CHECK(c.lookup_min == 3 && c.lookup_max == 7 && !c.adaptive);
    CHECK(spec_config_parse("{\"model\":\"/x/draft\",\"num_speculative_tokens\":8}", &c, err,
                            sizeof err) == 0);
    CHECK(c.method == SPEC_DRAFT_MODEL && strcmp(c.model, "/x/draft") == 0 && c.k == 8);
    CHECK(spec_config_parse("{\"method\":\"deepseek_mtp\",\"num_speculative_tokens\":1}", &c, err,
                            sizeof err) == 0 &&
          c.method == SPEC_MTP);
    CHECK(spec_config_parse("{\"model\":\"[ngram]\",\"num_speculative_tokens\":3,"
                            "\"prompt_lookup_max\":1}",
                            &c, err, sizeof err) == 0 &&
          c.method == SPEC_NGRAM && c.lookup_min == 1 && c.lookup_max == 1);
    static const struct {
        const char *json, *field;
    } bad[] = {
        {"{\"method\":\"eagle\",\"num_speculative_tokens\":2}", "method:"},
        {"{\"method\":3,\"num_speculative_tokens\":2}", "method:"},
        {"{\"num_speculative_tokens\":2}", "method:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":0}", "num_speculative_tokens:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":9}", "num_speculative_tokens:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":-1}", "num_speculative_tokens:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":\"4\"}", "num_speculative_tokens:"},
        {"{\"method\":\"ngram\"}", "num_speculative_tokens:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"prompt_lookup_min\":0}",
         "prompt_lookup_min:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"prompt_lookup_min\":5,"
         "\"prompt_lookup_max\":3}",
         "prompt_lookup_min:"},
        {"{\"method\":\"draft_model\",\"num_speculative_tokens\":2}", "model:"},
        {"{\"method\":\"ngram\",\"model\":\"/x\",\"num_speculative_tokens\":2}", "model:"},
        {"{\"model\":\"/x\",\"num_speculative_tokens\":2,\"prompt_lookup_max\":3}",
         "prompt_lookup_max:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"adaptive\":1}", "adaptive:"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"draft_tensor_parallel_size\":1}",
         "draft_tensor_parallel_size:"},
        {"[1]", "must be a JSON object"},
        {"{\"method\":", "not JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = '\0';
        CHECKF(spec_config_parse(bad[i].json, &c, err, sizeof err) != 0, "accepted %s",
               bad[i].json);
        CHECKF(strncmp(err, bad[i].field, strlen(bad[i].field)) == 0,
               "%s: '%s' should start "
               "with '%s'",
               bad[i].json, err, bad[i].field);
    }
}

static void check_ngram(void)
{
    int32_t out[8];
    const int32_t a[] = {1, 2, 3, 4, 5, 9, 9, 1, 2, 3};
    /* the trigram 1 2 3 occurred at 0: 4 5 9 follow */
    CHECK(spec_ngram_propose(a, 10, 1, 3, 3, out) == 3 && out[0] == 4 && out[1] == 5 &&
          out[2] == 9);
    /* only what exists after the match */
    const int32_t b[] = {7, 8, 7};
    CHECK(spec_ngram_propose(b, 3, 1, 2, 4, out) == 2 && out[0] == 8 && out[1] == 7);
    /* the latest occurrence wins */
    const int32_t c[] = {5, 1, 5, 2, 5};
    CHECK(spec_ngram_propose(c, 5, 1, 1, 1, out) == 1 && out[0] == 2);
    /* longer n-grams first: "3 5" matched at 1 proposes 6, not the "5 7" of the unigram */
    const int32_t d[] = {3, 5, 6, 4, 5, 7, 3, 5};
    CHECK(spec_ngram_propose(d, 8, 1, 2, 1, out) == 1 && out[0] == 6);
    /* no match, or min above what exists */
    const int32_t e[] = {1, 2, 3, 4};
    CHECK(spec_ngram_propose(e, 4, 1, 3, 2, out) == 0);
    CHECK(spec_ngram_propose(a, 10, 4, 5, 2, out) == 0);
    CHECK(spec_ngram_propose(a, 10, 1, 3, 0, out) == 0);
}

static void check_adaptive(void)
{
    struct spec_config cfg = {.method = SPEC_NGRAM, .k = 4, .adaptive = true};
    struct spec_acc a;
    spec_acc_init(&a);
    for (int i = 0; i < 30; i++)
        spec_acc_update(&a, 4, 4);
    CHECK(spec_acc_rate(&a) > 0.95);
    CHECK(spec_choose_k(&cfg, &a, 0.05) == 4);
    CHECK(spec_choose_k(&cfg, &a, 0.999) == 0);
    spec_acc_init(&a);
    for (int i = 0; i < 30; i++)
        spec_acc_update(&a, 2, 0);
    CHECK(spec_acc_rate(&a) < 0.15);
    CHECK(spec_choose_k(&cfg, &a, 0.2) == 0);
    a.idle = 16; /* long without drafting: one probe */
    CHECK(spec_choose_k(&cfg, &a, 0.2) == 1);
    cfg.adaptive = false;
    CHECK(spec_choose_k(&cfg, &a, 0.9) == 4);
    /* the cost line: t = 0.01 + 0.001 T seconds */
    struct spec_cost c;
    spec_cost_init(&c);
    CHECK(fabs(spec_cost_threshold(&c, 1, 1) - 0.03125 / 1.03125) < 1e-9); /* the prior */
    for (int i = 0; i < 200; i++) {
        int T = 1 + (i * 37) % 64;
        spec_cost_observe(&c, T, 0.01 + 0.001 * T);
    }
    double th1 = spec_cost_threshold(&c, 1, 1), th32 = spec_cost_threshold(&c, 32, 32);
    CHECKF(fabs(th1 - 0.001 / 0.011) < 1e-3, "threshold at batch 1: %g", th1);
    CHECKF(fabs(th32 - 0.032 / 0.042) < 1e-3, "threshold at batch 32: %g", th32);
    /* an MTP feed of 5 ms per sequence per step: worth it at rate 0.95 at batch 1 (net accepted
     * tokens ~3.2 against a feed worth 0.45 of a step), not at rate ~0.1, nor at rate 0.95 at
     * batch 32 (each draft must beat 0.76 there, and the feed is worth 3.8 steps' shares) */
    struct spec_config mtp = {.method = SPEC_MTP, .k = 4, .adaptive = true};
    struct spec_acc hi, lo;
    spec_acc_init(&hi);
    spec_acc_init(&lo);
    for (int i = 0; i < 30; i++) {
        spec_acc_update(&hi, 4, 4);
        spec_acc_update(&lo, 2, 0);
    }
    CHECK(spec_feed_pays(&mtp, &c, &lo, 1, 1)); /* no feed measured yet */
    spec_cost_observe_feed(&c, 4, 0.02);
    CHECK(spec_feed_pays(&mtp, &c, &hi, 1, 1));
    CHECK(!spec_feed_pays(&mtp, &c, &lo, 1, 1));
    CHECK(!spec_feed_pays(&mtp, &c, &hi, 32, 32));
    spec_acc_init(&lo);
    spec_acc_update(&lo, 2, 0); /* too few verifications to judge */
    CHECK(spec_feed_pays(&mtp, &c, &lo, 1, 1));
    for (int i = 0; i < 30; i++) spec_acc_update(&lo, 2, 0);
    mtp.adaptive = false; /* a fixed k is the user's choice */
    CHECK(spec_feed_pays(&mtp, &c, &lo, 1, 1));
}

static void check_truncate(const struct model *m)
{
    struct run rn = {.prop = PROP_NONE};
    struct engine *e = make_engine(m, &rn, false);
    if (!e) return;
    struct kv_cache *kv = engine_kv(e);
    struct kv_seq s;
    CHECK(engine_seq_init(e, &s) == 0);
    int free0 = kv_free_blocks(kv);
    CHECK(kv_seq_reserve(kv, &s, 21) == 0 && s.n_blocks == 6);
    int32_t toks[24] = {0};
    kv_seq_register(kv, &s, 0, toks, 8); /* two full blocks registered */
    CHECK(kv_seq_truncate(kv, &s, 10) == 3 && s.n_blocks == 3);
    CHECK(kv_free_blocks(kv) == free0 - 3);
    /* never below the registered blocks */
    CHECK(kv_seq_truncate(kv, &s, 1) == 1 && s.n_blocks == 2);
    CHECK(kv_seq_truncate(kv, &s, 0) == 0 && s.n_blocks == 2);
    engine_seq_free(e, &s);
    CHECK(kv_free_blocks(kv) == free0);
    engine_free(e);
}

static void check_bad_setups(const char *tests, const struct model *mix)
{
    char err[MS_ERR_LEN];
    struct run rn = {.prop = PROP_NONE};
    struct engine *e = make_engine(mix, &rn, false);
    if (!e) return;
    struct spec_config sc = {.method = SPEC_NGRAM, .k = 9};
    struct sched_params sp = {.max_num_seqs = N_REQ, .max_num_batched_tokens = 64, .spec = &sc};
    struct sched *s = NULL;
    CHECK(sched_create(e, &sp, &s, err, sizeof err) != 0 && strstr(err, "num_speculative_tokens"));
    sc.k = 2;
    sc.method = SPEC_MTP;
    CHECK(sched_create(e, &sp, &s, err, sizeof err) != 0 && strstr(err, "mtp"));
    sc.method = SPEC_DRAFT_MODEL;
    CHECK(sched_create(e, &sp, &s, err, sizeof err) != 0 && strstr(err, "drafter"));
    engine_free(e);
    /* a hybrid target needs spare state slots */
    struct model *q = NULL, *mohge = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    CHECK(model_load(test_path(tests, "fixtures/models/qwen3_next"), &lo, &q, err, sizeof err) ==
          0);
    if (q) {
        e = make_engine(q, &rn, false);
        sc.method = SPEC_NGRAM;
        CHECK(e && sched_create(e, &sp, &s, err, sizeof err) != 0 && strstr(err, "spec_state"));
        engine_free(e);
        /* a hybrid draft: its state could not be rolled back */
        CHECK(drafter_check(mix, q, err, sizeof err) != 0 && strncmp(err, "model:", 6) == 0 &&
              strstr(err, "recurrent"));
    }
    /* another tokenizer (the bundled model's, 2048 tokens) */
    if (model_load(test_path(tests, "../models/mohge-small"), &lo, &mohge, err, sizeof err) == 0) {
        CHECK(drafter_check(mix, mohge, err, sizeof err) != 0 && strncmp(err, "model:", 6) == 0 &&
              strstr(err, "another tokenizer"));
        CHECK(drafter_check(mohge, mix, err, sizeof err) != 0);
    } else {
        fprintf(stderr, "models/mohge-small: %s (tokenizer check skipped)\n", err);
    }
    CHECK(drafter_check(mix, mix, err, sizeof err) == 0);
    model_free(q);
    model_free(mohge);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char err[MS_ERR_LEN];
    struct model *mix = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    if (model_load(test_path(tests, "fixtures/models/mixtral"), &lo, &mix, err, sizeof err) != 0) {
        fprintf(stderr, "model_load: %s\n", err);
        CHECK(0);
        return test_done("test_spec");
    }
    make_prompts(mix->desc.vocab);
    check_config();
    check_ngram();
    check_adaptive();
    check_truncate(mix);
    check_bad_setups(tests, mix);

    static const char *const families[] = {
        "mixtral",     "qwen2_moe",   "qwen3_moe",        "olmoe",
        "deepseek_v2", "deepseek_v3", "glm4_moe",         "minimax_m2",
        "gpt_oss",     "llama4_text", "mohge_tiny",       "infmoe_tiny",
        "qwen3_next",  "qwen3_5_moe", "granitemoehybrid", "mixtral_bf16"};
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        check_family(tests, families[i], mix);
    check_mtp(tests, "deepseek_v3");
    check_mtp(tests, "glm4_moe");
    check_mtp(tests, "deepseek_v32"); /* sparse attention in the module's block */
    check_mtp(tests, "qwen3_next"); /* Qwen's layout on a hybrid: state rollbacks too */
    check_situations(tests, "mixtral");
    check_situations(tests, "deepseek_v3");
    check_situations(tests, "qwen3_next");
    check_situations(tests, "granitemoehybrid");
    check_registration(mix);

    struct grm_vocab *gv =
        mix->tok ? grm_vocab_build(mix->tok, mix->desc.vocab, mix->desc.eos_ids, mix->desc.n_eos)
                 : NULL;
    check_seeded(mix, gv);
    grm_vocab_free(gv);
    check_general_rule();
    check_distribution(mix, 1.0f, false);
    check_distribution(mix, 0.9f, false);
    check_distribution(mix, 1.0f, true);
    check_distribution(mix, 0.9f, true);
    model_free(mix);
    return test_done("test_spec");
}
