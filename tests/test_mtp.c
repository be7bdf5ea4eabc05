/* Multi-token-prediction modules (struct model_mtp, model_mtp_view, the engine's hidden states
 * in and out) against the references tests/reference/make_model_fixtures.py writes from a module
 * built of transformers' own DeepSeek-V3 / GLM-4.5 / Qwen3-Next / Qwen3.5 classes (transformers
 * has no MTP forward):
 * - the target's last hidden state after its final norm (engine_item.hidden_out, hidden_normed)
 *   fused with the next token's embedding gives the module's logits at every index of each
 *   reference prompt, f32, and the bf16 checkpoints computed in f32; the same for the trained
 *   module of models/mohge-small against its PyTorch reference (tools/train/mohge_model.py);
 * - a chained index (the module's own output, before its head's norm in DeepSeek's layout and
 *   after it in Qwen's, standing in for the target's hidden state), as drafts past the first
 *   are made;
 * - the drafter (drafter_mtp_feed, drafter_run) fed as the scheduler feeds it (prefill chunks,
 *   verifications keeping 0..3 drafts, rounds of chained drafts in between): every draft equals
 *   the argmax of the module run from scratch on the same tokens and hidden states;
 * - loading: a folder whose config announces MTP layers it does not carry is refused naming the
 *   missing tensor when they are asked for, and loads as before when they are not; the MoE-ness
 *   of the block and the head are bound as the checkpoint has them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "drafter.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

static struct engine *mtp_engine(const struct model *m)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = 1;
    ep.n_threads = 1;
    ep.max_seqs = 4;
    ep.max_batch_tokens = 128;
    ep.max_model_len = 128;
    ep.kv_block_size = 4; /* prompts span several blocks */
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

/* One step of `n` tokens at position pos of a fresh sequence; hidden_in / hidden_out may be NULL.
 * Logits for every token into logits (n, vocab). */
static int run(struct engine *e, const int32_t *ids, int n, const float *hin, float *hout,
               bool normed, float *logits)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {.kv = &s, .tokens = ids, .n_tokens = n, .pos = 0, .n_logits = n,
                             .logits = logits, .hidden_in = hin, .hidden_out = hout,
                             .hidden_normed = normed};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    if (rc) fprintf(stderr, "step: %s\n", err);
    engine_seq_free(e, &s);
    return rc;
}

/* The module's logits on every prompt of `name` against prompt*.mtp_logits{suffix}, and the
 * chained index against prompt*.mtp_chain_logits{suffix}, within tol (relative to the largest
 * reference logit). */
static void check_module(const char *dir, const char *name, const char *suffix, double tol)
{
    char refpath[600], err[MS_ERR_LEN];
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", dir);
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.dtype = MODEL_DTYPE_F32;
    lo.mtp = true;
    struct model *m = NULL;
    struct st_archive *ref = NULL;
    struct model view;
    struct engine *et = NULL, *em = NULL;
    float *h = NULL, *hm = NULL, *lg = NULL, *one = NULL;
    memset(&view, 0, sizeof view);
    int rc = model_load(dir, &lo, &m, err, sizeof err);
    CHECKF(rc == 0, "%s: %s", name, err);
    int rc2 = st_open_file(refpath, &ref, err, sizeof err);
    CHECKF(rc2 == 0, "%s: %s", name, err);
    if (rc || rc2) goto out;
    CHECKF(m->n_mtp == 1, "%s: %d MTP modules bound", name, m->n_mtp);
    CHECKF(m->skip_note[0] == '\0', "%s: skip note '%s' with the module bound", name,
           m->skip_note);
    if (m->n_mtp != 1) goto out;
    bool qwen = strncmp(name, "qwen", 4) == 0, mohge = strncmp(name, "mohge", 5) == 0;
    CHECKF(m->mtp[0].moe == !mohge, "%s: the fixtures' MTP blocks are MoE, mohge's dense", name);
    CHECKF(qwen || mohge ? m->mtp[0].head == NULL : m->mtp[0].head != NULL,
           "%s: its own head (DeepSeek's layout) or the model's (Qwen's, mohge's tied)", name);
    CHECK(m->mtp[0].chain_normed == qwen);
    CHECK(model_mtp_view(m, 0, &view) == 0);
    CHECK(view.desc.n_layer == 1 && view.mtp_in == &m->mtp[0] && view.norm == m->mtp[0].head_norm);
    et = mtp_engine(m);
    em = mtp_engine(&view);
    CHECK(et && em);
    if (!et || !em) goto out;
    int D = m->desc.d_model, V = m->desc.vocab, checked = 0;
    h = malloc(sizeof(float) * 128 * (size_t)D);
    hm = malloc(sizeof(float) * 128 * (size_t)D);
    lg = malloc(sizeof(float) * 128 * (size_t)V);
    one = malloc(sizeof(float) * (size_t)V);
    if (!h || !hm || !lg || !one) goto out;
    for (int i = 0; i < GOLDEN_MAX_PROMPTS; i++) {
        char nm[96];
        snprintf(nm, sizeof nm, "prompt%d.ids", i);
        const struct st_tensor *ids = st_find(ref, nm);
        snprintf(nm, sizeof nm, "prompt%d.mtp_logits%s", i, suffix);
        const struct st_tensor *want = st_find(ref, nm);
        snprintf(nm, sizeof nm, "prompt%d.mtp_chain_logits%s", i, suffix);
        const struct st_tensor *chain = st_find(ref, nm);
        if (!ids) break;
        if (!want || !chain) continue; /* prompts too short for a chained index */
        const int32_t *tok = ids->data;
        int n = (int)ids->shape[0];
        CHECKF(want->shape[0] == n - 1 && want->shape[1] == V, "%s prompt %d: reference shape",
               name, i);
        if (n < 3 || n > 128 || want->shape[0] != n - 1) continue;
        /* the target's hidden states, then the module at indices 0..n-2 (token i+1 with h_i) */
        CHECK(run(et, tok, n, NULL, h, true, lg) == 0);
        CHECK(run(em, tok + 1, n - 1, h, hm, m->mtp[0].chain_normed, lg) == 0);
        double e1 = golden_rel_err(lg, want->data, (size_t)(n - 1) * V);
        CHECKF(e1 < tol, "%s prompt %d: MTP logits %.3g from the reference", name, i, e1);
        /* chained: index n-2 fusing the module's own output at n-3 */
        memcpy(h + (size_t)(n - 2) * D, hm + (size_t)(n - 3) * D, sizeof(float) * (size_t)D);
        CHECK(run(em, tok + 1, n - 1, h, NULL, false, lg) == 0);
        memcpy(one, lg + (size_t)(n - 2) * V, sizeof(float) * (size_t)V);
        double e2 = golden_rel_err(one, chain->data, (size_t)V);
        CHECKF(e2 < tol, "%s prompt %d: chained MTP logits %.3g from the reference", name, i, e2);
        printf("%s%s prompt %d (%d tokens): MTP logits %.2e, chained %.2e (relative)\n", name,
               suffix, i, n, e1, e2);
        checked++;
    }
    CHECKF(checked >= 2, "%s: %d prompts checked", name, checked);
    /* an MTP engine refuses a step without hidden states */
    {
        struct kv_seq s;
        CHECK(engine_seq_init(em, &s) == 0);
        struct engine_item it = {.kv = &s, .tokens = (const int32_t[]){1, 2}, .n_tokens = 2,
                                 .n_logits = 1, .logits = one};
        CHECK(engine_step(em, &it, 1, err, sizeof err) != 0 && strstr(err, "hidden state"));
        engine_seq_free(em, &s);
    }
out:
    free(h);
    free(hm);
    free(lg);
    free(one);
    engine_free(em);
    engine_free(et);
    model_mtp_view_free(&view);
    st_close(ref);
    model_free(m);
}

static void check_family(const char *tests, const char *name, const char *suffix, double tol)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    check_module(dir, name, suffix, tol);
}

/* The drafter on deepseek_v3: the target's hidden states of a 40-token sequence, fed in the
 * pieces a scheduler would feed (a prompt in chunks, then verifications keeping 1..4 positions),
 * with a round of k drafts after each piece that ends where the sequence's last token has no
 * hidden state yet. Each round's first draft must be the module's argmax at index n - 2 run from
 * scratch, and its second the argmax of the chained index n - 1 (the module's own output at
 * n - 2 with the first draft). */
static void check_drafter(const char *tests)
{
    char err[MS_ERR_LEN];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.mtp = true;
    struct model *m = NULL;
    if (model_load(test_path(tests, "fixtures/models/deepseek_v3"), &lo, &m, err, sizeof err)) {
        fprintf(stderr, "deepseek_v3: %s\n", err);
        CHECK(0);
        return;
    }
    enum { N = 40 };
    int D = m->desc.d_model, V = m->desc.vocab;
    int32_t tok[N + 1];
    uint32_t x = 77;
    for (int i = 0; i < N + 1; i++) {
        x = x * 1664525u + 1013904223u;
        tok[i] = 1 + (int32_t)((x >> 8) % (uint32_t)(V - 1));
    }
    struct engine *et = mtp_engine(m), *ef = NULL;
    struct model view;
    memset(&view, 0, sizeof view);
    struct drafter *dr = NULL;
    float *h = malloc(sizeof(float) * N * (size_t)D), *hm = malloc(sizeof(float) * N * (size_t)D);
    float *lg = malloc(sizeof(float) * N * (size_t)V), *hc = malloc(sizeof(float) * N * (size_t)D);
    int32_t tk[N + 1];
    CHECK(et && h && hm && lg && hc && model_mtp_view(m, 0, &view) == 0);
    if (!et || !h || !hm || !lg || !hc) goto out;
    ef = mtp_engine(&view);
    CHECK(ef && drafter_create_mtp(m, engine_get_params(et), 3, &dr, err, sizeof err) == 0);
    if (!ef || !dr) goto out;
    CHECK(drafter_is_mtp(dr));
    CHECK(run(et, tok, N, NULL, h, true, lg) == 0);
    /* pieces: a prompt of 11 in chunks 5 + 6, then verifications keeping 1, 3, 1, 4, 2, ... */
    static const int pieces[] = {5, 6, 1, 3, 1, 4, 2, 1, 1, 3, 4, 2, 1, 3};
    struct drafter_seq seq;
    memset(&seq, 0, sizeof seq);
    int pos = 0, rounds = 0, good = 0;
    for (size_t p = 0; p < sizeof pieces / sizeof *pieces && pos + pieces[p] < N - 1; p++) {
        int n_valid = pieces[p];
        int n_total = pos + n_valid + 1; /* the token after the piece is known (sampled) */
        struct drafter_feed f = {.seq = &seq, .tokens = tok, .n_total = n_total, .pos = pos,
                                 .n_valid = n_valid, .hidden = h + (size_t)pos * D};
        CHECKF(drafter_mtp_feed(dr, &f, 1, err, sizeof err) == 0, "feed: %s", err);
        pos += n_valid;
        if (p == 0) continue; /* a chunk before the prompt's last: no round */
        int32_t out[3];
        struct drafter_job jb = {.seq = &seq, .tokens = tok, .n_total = n_total, .k = 3,
                                 .out = out};
        CHECKF(drafter_run(dr, &jb, 1, err, sizeof err) == 0, "round: %s", err);
        CHECKF(jb.n_out == 3, "round at %d tokens: %d drafts", n_total, jb.n_out);
        if (jb.n_out < 2) continue;
        /* from scratch: indices 0..n-2, then index n-1 chained with the first draft */
        int n = n_total;
        CHECK(run(ef, tok + 1, n - 1, h, hm, false, lg) == 0);
        int a0 = golden_argmax(lg + (size_t)(n - 2) * V, V);
        memcpy(hc, h, sizeof(float) * (size_t)(n - 1) * D);
        memcpy(hc + (size_t)(n - 1) * D, hm + (size_t)(n - 2) * D, sizeof(float) * (size_t)D);
        memcpy(tk, tok + 1, sizeof(int32_t) * (size_t)(n - 1));
        tk[n - 1] = out[0];
        CHECK(run(ef, tk, n, hc, NULL, false, lg) == 0);
        int a1 = golden_argmax(lg + (size_t)(n - 1) * V, V);
        CHECKF(out[0] == a0 && out[1] == a1, "round at %d tokens: drafts %d %d, from scratch %d %d",
               n, out[0], out[1], a0, a1);
        good += out[0] == a0 && out[1] == a1;
        rounds++;
    }
    CHECKF(rounds >= 8 && good == rounds, "%d of %d rounds right", good, rounds);
    /* a sequence that starts past position 0 (a cached prefix) has missed hidden states */
    struct drafter_seq late;
    memset(&late, 0, sizeof late);
    struct drafter_feed f = {.seq = &late, .tokens = tok, .n_total = 13, .pos = 8, .n_valid = 4,
                             .hidden = h + 8 * (size_t)D};
    CHECK(drafter_mtp_feed(dr, &f, 1, err, sizeof err) == 0 && late.lost);
    int32_t o2[3];
    struct drafter_job j2 = {.seq = &late, .tokens = tok, .n_total = 13, .k = 3, .out = o2};
    CHECK(drafter_run(dr, &j2, 1, err, sizeof err) == 0 && j2.n_out == 0);
    drafter_seq_release(dr, &late);
    drafter_seq_release(dr, &seq);
    CHECK(kv_free_blocks(engine_kv(drafter_engine(dr))) == engine_kv(drafter_engine(dr))->n_blocks);
out:
    drafter_free(dr);
    engine_free(ef);
    engine_free(et);
    model_mtp_view_free(&view);
    free(h);
    free(hm);
    free(hc);
    free(lg);
    model_free(m);
}

/* kimi_k25's config keeps deepseek_v3's num_nextn_predict_layers 1 without the tensors: asked
 * for, the load names the first missing one; not asked for, it loads and binds none. */
static void check_missing(const char *tests)
{
    char err[MS_ERR_LEN];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.mtp = true;
    struct model *m = NULL;
    const char *dir = test_path(tests, "fixtures/models/kimi_k25");
    CHECK(model_load(dir, &lo, &m, err, sizeof err) != 0);
    CHECKF(strstr(err, "3.enorm.weight") != NULL, "missing MTP tensor: %s", err);
    model_free(m);
    m = NULL;
    lo.mtp = false;
    CHECKF(model_load(dir, &lo, &m, err, sizeof err) == 0, "%s", err);
    if (m) CHECK(m->n_mtp == 0 && m->mtp == NULL);
    model_free(m);
    /* a model without MTP layers: nothing to bind, nothing refused */
    m = NULL;
    lo.mtp = true;
    CHECKF(model_load(test_path(tests, "fixtures/models/mixtral"), &lo, &m, err, sizeof err) == 0,
           "%s", err);
    if (m) {
        CHECK(m->n_mtp == 0);
        struct model v;
        CHECK(model_mtp_view(m, 0, &v) != 0);
    }
    model_free(m);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    /* f32 throughout: the engine and transformers differ by summation order only */
    check_family(tests, "deepseek_v3", "", 2e-5);
    check_family(tests, "glm4_moe", "", 2e-5);
    check_family(tests, "deepseek_v32", "", 2e-5); /* the module's block has its own indexer */
    /* the bf16 checkpoints computed in f32 against transformers on the upcast weights */
    check_family(tests, "deepseek_v3_bf16", "_f32compute", 2e-5);
    check_family(tests, "glm4_moe_bf16", "_f32compute", 2e-5);
    check_family(tests, "deepseek_v32_bf16", "_f32compute", 2e-5);
    /* Qwen's layout (mtp.*, chained on its normed output) on the hybrids, against a float64
     * reference */
    check_family(tests, "qwen3_next", "", 2e-5);
    check_family(tests, "qwen3_5_moe", "", 2e-5);
    check_family(tests, "qwen3_next_bf16", "_f32compute", 2e-5);
    /* the bundled model's trained module (tools/train/train_mtp.py: a dense block, the tied
     * head) against its PyTorch reference, computed in f32 from the bf16 weights */
    char dir[512];
    snprintf(dir, sizeof dir, "%s/../models/mohge-small", tests);
    check_module(dir, "mohge-small", "", 2e-5);
    check_drafter(tests);
    check_missing(tests);
    return test_done("test_mtp");
}
