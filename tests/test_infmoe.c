/* Golden tests of the `infmoe` architecture (continuous experts: a Gaussian router over a latent
 * z, K samples each keeping a top-N slice of one large FFN's neurons, averaged) against our
 * PyTorch reference (tools/train/infmoe_model.py; outputs written by
 * tests/reference/make_infmoe_fixtures.py into tests/fixtures/models/infmoe_tiny/). Checks f32
 * logits within 1e-5 relative (max|a-b| / max|b|) at K = 1, 2 and the default 4 and at a
 * smaller neuron fraction, per request and as the engine's default; identical 32-token greedy
 * continuations at K = 1 and 4; that the FFN neurons computed per token are exactly the
 * reference's union of slices (N per token at K = 1, more at the default); a mixed batch
 * (each sequence its own budget) equal to the sequences alone; the prefill bit for bit equal
 * to one token per step (the batch's neuron-major FFN against the per-token one); equal
 * results on 2 devices and
 * through the staged (device-memory) path; the slice selection against a sort (ties); the
 * parsed description; and config errors. */
#include <math.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "infmoe.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

#define TOL 1e-5

struct budget {
    const char *suffix; /* reference tensor suffix */
    int samples;
    double fraction;
    bool adaptive;
};

static const struct budget BUDGETS[] = {{"", 0, 0, false},
                                        {"_k1", 1, 0, false},
                                        {"_k2", 2, 0, false},
                                        {"_k2_f0625", 2, 0.0625, false},
                                        {"_adaptive_k2", 2, 0, true}};
#define N_BUDGETS ((int)(sizeof BUDGETS / sizeof BUDGETS[0]))

static const void *ref_tensor(const struct st_archive *ref, int i, const char *what,
                              const char *suffix)
{
    char name[96];
    snprintf(name, sizeof name, "prompt%d.%s%s", i, what, suffix);
    const struct st_tensor *t = st_find(ref, name);
    return t ? t->data : NULL;
}

static uint64_t neurons(const struct engine *e, int n_dev)
{
    const struct engine_stats *st = engine_get_stats(e);
    uint64_t s = 0;
    for (int d = 0; d < n_dev; d++)
        s += st->dev_cont_neurons[d];
    return s;
}

/* Prefill of prompt p with logits for every position, at budget b. */
static int prefill(struct engine *e, const struct golden_prompt *p, const struct budget *b,
                   float *out)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {.kv = &s,
                             .tokens = p->ids,
                             .n_tokens = p->n,
                             .pos = 0,
                             .moe_samples = b->samples,
                             .moe_neuron_fraction = b->fraction,
                             .moe_samples_adaptive = b->adaptive,
                             .n_logits = p->n,
                             .logits = out};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    if (rc) fprintf(stderr, "step: %s\n", err);
    engine_seq_free(e, &s);
    return rc;
}

/* The same prompt one token per step (the per-token FFN path; a prefill of 8 or more tokens
 * takes the neuron-major one), every position's logits into out. */
static int stepwise(struct engine *e, const struct golden_prompt *p, const struct budget *b,
                    float *out, int V)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    int rc = 0;
    for (int t = 0; t < p->n && rc == 0; t++) {
        struct engine_item it = {.kv = &s,
                                 .tokens = p->ids + t,
                                 .n_tokens = 1,
                                 .pos = t,
                                 .moe_samples = b->samples,
                                 .moe_neuron_fraction = b->fraction,
                                 .moe_samples_adaptive = b->adaptive,
                                 .n_logits = 1,
                                 .logits = out + (size_t)t * V};
        rc = engine_step(e, &it, 1, err, sizeof err);
        if (rc) fprintf(stderr, "step: %s\n", err);
    }
    engine_seq_free(e, &s);
    return rc;
}

/* Greedy decode at `samples`, one token per step; how many of want[] it reproduces. */
static int greedy(struct engine *e, const struct golden_prompt *p, int samples, const int32_t *want,
                  float *buf, int V)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (!want || engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {.kv = &s,
                             .tokens = p->ids,
                             .n_tokens = p->n,
                             .pos = 0,
                             .moe_samples = samples,
                             .n_logits = 1,
                             .logits = buf};
    int same = 0;
    if (engine_step(e, &it, 1, err, sizeof err) == 0) {
        for (int t = 0; t < GOLDEN_GREEDY; t++) {
            int32_t tok = golden_argmax(buf, V);
            if (tok != want[t]) break;
            same++;
            it = (struct engine_item){.kv = &s,
                                      .tokens = &tok,
                                      .n_tokens = 1,
                                      .pos = p->n + t,
                                      .moe_samples = samples,
                                      .n_logits = 1,
                                      .logits = buf};
            if (engine_step(e, &it, 1, err, sizeof err) != 0) break;
        }
    }
    engine_seq_free(e, &s);
    return same;
}

static struct engine *make_engine(const struct model *m, int devices, enum engine_backend be,
                                  int default_samples)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = be;
    ep.n_devices = devices;
    ep.max_batch_tokens = 256;
    ep.max_seqs = GOLDEN_MAX_PROMPTS;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    ep.moe_samples = default_samples;
    struct engine *e = NULL;
    char err[MS_ERR_LEN];
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

/* Every check of the module comment on the model folder `dir` and its reference.safetensors
 * (computed in f32 from the stored weights; dtype F32 reproduces that arithmetic). */
static void check_model(const char *dir, const char *name, enum model_dtype dtype)
{
    char refpath[700], err[MS_ERR_LEN];
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", dir);
    struct model *m = NULL;
    struct st_archive *ref = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.dtype = dtype;
    int rc = model_load(dir, &lo, &m, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    int rc2 = st_open_file(refpath, &ref, err, sizeof err);
    CHECKF(rc2 == 0, "%s", err);
    if (rc || rc2) goto out;
    const struct model_desc *md = &m->desc;
    CHECK(md->ffn == FFN_KIND_CONTINUOUS && md->cont_max_samples >= 2);

    int V = md->vocab, L = md->n_layer;
    struct golden_prompt p[GOLDEN_MAX_PROMPTS];
    int np = golden_load_prompts(ref, p);
    CHECKF(np == 3, "%s: reference has %d prompts", name, np);
    if (np != 3) goto out;
    int maxn = 0;
    for (int i = 0; i < np; i++)
        maxn = p[i].n > maxn ? p[i].n : maxn;
    float *a = malloc(sizeof(float) * (size_t)maxn * V * 2);
    float *b = a ? a + (size_t)maxn * V : NULL;
    struct engine *e1 = make_engine(m, 1, ENGINE_BACKEND_CPU, 0);
    struct engine *e2 = make_engine(m, 2, ENGINE_BACKEND_CPU, 0);
    struct engine *es = make_engine(m, 1, ENGINE_BACKEND_CPU_STAGED, 0);
    struct engine *ek1 = make_engine(m, 1, ENGINE_BACKEND_CPU, 1); /* --moe-samples 1 */
    CHECK(e1 && e2 && es && ek1 && a);
    if (!e1 || !e2 || !es || !ek1 || !a) goto done;

    double worst = 0.0;
    int keep = model_cont_neurons(md, md->cont_fraction);
    uint64_t keep_half = (uint64_t)model_cont_neurons(md, BUDGETS[3].fraction);
    for (int i = 0; i < np; i++) {
        size_t cnt = (size_t)p[i].n * V;
        uint64_t counted[N_BUDGETS] = {0};
        for (int bi = 0; bi < N_BUDGETS; bi++) {
            const struct budget *bu = &BUDGETS[bi];
            if (bu->adaptive && md->cont_n_quant == 0) continue; /* no calibration */
            const float *want = ref_tensor(ref, i, "logits", bu->suffix);
            const int32_t *want_n = ref_tensor(ref, i, "neurons", bu->suffix);
            CHECKF(want && want_n, "prompt %d: reference lacks logits%s", i, bu->suffix);
            if (!want || !want_n) continue;
            uint64_t before = neurons(e1, 1);
            CHECK(prefill(e1, &p[i], bu, a) == 0);
            counted[bi] = neurons(e1, 1) - before;
            double r = golden_rel_err(a, want, cnt);
            worst = r > worst ? r : worst;
            CHECKF(r <= TOL, "%s prompt %d budget%s: rel err %.3g", name, i, bu->suffix, r);
            /* The union of the samples' slices, token by token, as the reference counts it. */
            uint64_t ref_n = 0;
            for (int l = 0; l < L; l++)
                ref_n += (uint64_t)want_n[l];
            CHECKF(counted[bi] == ref_n,
                   "prompt %d budget%s: %llu neurons computed, reference %llu", i, bu->suffix,
                   (unsigned long long)counted[bi], (unsigned long long)ref_n);
            /* Two devices and the staged path give the same numbers. */
            CHECK(prefill(e2, &p[i], bu, b) == 0);
            double r2 = golden_rel_err(b, a, cnt);
            CHECKF(r2 <= 1e-6, "prompt %d budget%s: 2 devices differ by %.3g", i, bu->suffix, r2);
            CHECK(prefill(es, &p[i], bu, b) == 0);
            double rs = golden_rel_err(b, a, cnt);
            CHECKF(rs <= 1e-6, "prompt %d budget%s: staged path differs by %.3g", i, bu->suffix,
                   rs);
            /* Deterministic: the same request twice gives the same bits, and so does feeding
             * it one token per step (per-token FFN against the batch's neuron-major one). */
            CHECK(prefill(e1, &p[i], bu, b) == 0);
            CHECKF(memcmp(a, b, sizeof(float) * cnt) == 0, "prompt %d budget%s: not repeatable", i,
                   bu->suffix);
            CHECK(stepwise(e1, &p[i], bu, b, V) == 0);
            CHECKF(memcmp(a, b, sizeof(float) * cnt) == 0,
                   "prompt %d budget%s: one token per step differs from the prefill (%.3g)", i,
                   bu->suffix, golden_rel_err(b, a, cnt));
        }
        /* The budget cuts work: K = 1 computes exactly N neurons per token and layer, K = 2 more
         * (the union of two slices), at most twice as many; the default at most K times. */
        uint64_t n1 = (uint64_t)p[i].n * (uint64_t)L * (uint64_t)keep;
        CHECKF(counted[1] == n1, "prompt %d: K=1 computed %llu neurons, want %llu", i,
               (unsigned long long)counted[1], (unsigned long long)n1);
        CHECKF(counted[0] >= counted[1] && counted[2] > counted[1] &&
                   counted[0] <= (uint64_t)md->cont_samples * n1 && counted[2] <= 2 * n1,
               "prompt %d: neurons default %llu, K=2 %llu, K=1 %llu", i,
               (unsigned long long)counted[0], (unsigned long long)counted[2],
               (unsigned long long)counted[1]);
        CHECKF(counted[3] < counted[2] && counted[3] <= (uint64_t)p[i].n * L * 2 * keep_half,
               "prompt %d: half the fraction computed %llu neurons vs %llu", i,
               (unsigned long long)counted[3], (unsigned long long)counted[2]);
        /* The engine default (--moe-samples 1) applies to requests that ask for none. */
        struct budget none = {"", 0, 0, false};
        CHECK(prefill(ek1, &p[i], &none, b) == 0);
        const float *want1 = ref_tensor(ref, i, "logits", "_k1");
        double rk = want1 ? golden_rel_err(b, want1, cnt) : 1.0;
        CHECKF(rk <= TOL, "prompt %d: engine default K=1 rel err %.3g", i, rk);

        int same = greedy(e1, &p[i], 0, ref_tensor(ref, i, "greedy", ""), b, V);
        CHECKF(same == GOLDEN_GREEDY, "%s prompt %d: greedy (default K) matches %d of %d tokens",
               name, i, same, GOLDEN_GREEDY);
        same = greedy(e1, &p[i], 1, ref_tensor(ref, i, "greedy", "_k1"), b, V);
        CHECKF(same == GOLDEN_GREEDY, "prompt %d: greedy (K=1) matches %d of %d tokens", i, same,
               GOLDEN_GREEDY);
    }

    /* One step, three sequences, three budgets: each as it is alone. */
    struct kv_seq s[3];
    struct engine_item it[3];
    float *outs[3];
    int ok_seqs = 1;
    for (int i = 0; i < 3; i++) {
        ok_seqs &= engine_seq_init(e1, &s[i]) == 0;
        outs[i] = malloc(sizeof(float) * (size_t)p[i].n * V);
        ok_seqs &= outs[i] != NULL;
        it[i] = (struct engine_item){.kv = &s[i],
                                     .tokens = p[i].ids,
                                     .n_tokens = p[i].n,
                                     .moe_samples = BUDGETS[i + 1].samples,
                                     .moe_neuron_fraction = BUDGETS[i + 1].fraction,
                                     .n_logits = p[i].n,
                                     .logits = outs[i]};
    }
    CHECK(ok_seqs && engine_step(e1, it, 3, err, sizeof err) == 0);
    for (int i = 0; i < 3 && ok_seqs; i++) {
        const float *want = ref_tensor(ref, i, "logits", BUDGETS[i + 1].suffix);
        double r = want ? golden_rel_err(outs[i], want, (size_t)p[i].n * V) : 1.0;
        CHECKF(r <= TOL, "mixed batch, prompt %d budget%s: rel err %.3g", i, BUDGETS[i + 1].suffix,
               r);
    }
    for (int i = 0; i < 3; i++) {
        engine_seq_free(e1, &s[i]);
        free(outs[i]);
    }
    printf("%s: %d prompts x %d budgets, max rel err %.2e, greedy %d tokens identical at K=1 and "
           "the default K=%d\n",
           name, np, md->cont_n_quant ? N_BUDGETS : N_BUDGETS - 1, worst, GOLDEN_GREEDY,
           md->cont_samples);
done:
    engine_free(e1);
    engine_free(e2);
    engine_free(es);
    engine_free(ek1);
    free(a);
out:
    st_close(ref);
    model_free(m);
}

static void test_desc(const char *tests)
{
    struct model_desc d;
    char err[MS_ERR_LEN];
    int rc = golden_parse_patched(tests, "infmoe_tiny", NULL, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.ffn == FFN_KIND_CONTINUOUS && d.cont_d_ff == 256 && d.cont_z == 8 &&
              d.cont_samples == 4 && d.cont_max_samples == 8 &&
              fabs(d.cont_fraction - 0.125) < 1e-12);
        CHECK(d.n_expert == 0 && d.top_k == 0 && !d.layer_is_moe[0] && !d.layer_is_moe[1]);
        CHECK(d.cont_n_quant == 17 && d.cont_quant[0] <= d.cont_quant[16] &&
              d.cont_quant[17] <= d.cont_quant[33]);
        CHECK(model_cont_neurons(&d, 0.125) == 32 && model_cont_neurons(&d, 1e-9) == 1 &&
              model_cont_neurons(&d, 1.0) == 256 && model_cont_union_max(&d, 8, 0.125) == 256 &&
              model_cont_union_max(&d, 2, 0.125) == 64);
        model_desc_free(&d);
    }
    static const struct {
        const char *patch, *want;
    } bad[] = {
        {"{\"neuron_fraction\": 0}", "neuron_fraction 0 must be in (0, 1]"},
        {"{\"neuron_fraction\": 1.5}", "neuron_fraction 1.5 must be in (0, 1]"},
        {"{\"num_samples\": 9}", "num_samples 9 must be in 1..max_samples (8)"},
        {"{\"max_samples\": 65}", "max_samples 65 must be in 1..64"},
        {"{\"latent_dim\": null}", "missing 'latent_dim'"},
        {"{\"intermediate_size\": 0}", "'intermediate_size' = 0 must be positive"},
        {"{\"adaptive_logvar_quantiles\": [[0, 1]]}",
         "'adaptive_logvar_quantiles' must list num_hidden_layers (2) lists"},
        {"{\"adaptive_logvar_quantiles\": [[0, 1], [1, 0]]}",
         "adaptive_logvar_quantiles[1][1] must be a number, not below the one before"},
        {"{\"adaptive_logvar_quantiles\": [[0, 1], [0, 1, 2]]}",
         "adaptive_logvar_quantiles[1] must list 2 numbers"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rc = golden_parse_patched(tests, "infmoe_tiny", bad[i].patch, &d, err, sizeof err);
        CHECKF(rc == -1 && strstr(err, bad[i].want) && strstr(err, "config.json"), "case %zu: %s",
               i, rc ? err : "(accepted)");
        if (rc == 0) model_desc_free(&d);
    }
}

/* The offsets: the mean first, then the R_d points through the normal quantile (nested: the
 * first K of a longer set are the K set). */
static void test_offsets(void)
{
    /* The adaptive rule: rank 0 -> 1 sample, the median -> k, rank 1 -> 2k - 1, clamped. */
    static const double q[] = {-2.0, -1.0, 0.0, 1.0, 2.0};
    CHECK(infmoe_adaptive_k(q, 5, -5.0, 2, 8) == 1 && infmoe_adaptive_k(q, 5, 0.0, 2, 8) == 2 &&
          infmoe_adaptive_k(q, 5, 9.0, 2, 8) == 3 && infmoe_adaptive_k(q, 5, 9.0, 8, 8) == 8 &&
          infmoe_adaptive_k(q, 5, 1.5, 4, 8) == 6);
    float e4[4 * 3], e8[8 * 3];
    infmoe_offsets(4, 3, e4);
    infmoe_offsets(8, 3, e8);
    CHECK(memcmp(e4, e8, sizeof e4) == 0);
    CHECK(e4[0] == 0.0f && e4[1] == 0.0f && e4[2] == 0.0f);
    /* tools/train/infmoe_model.py: quasi_offsets(4, 3)[1] = (-0.4700, -0.9500, -1.6478) */
    CHECKF(fabsf(e4[3] + 0.4700f) < 1e-4f && fabsf(e4[4] + 0.9500f) < 1e-4f &&
               fabsf(e4[5] + 1.6478f) < 1e-4f,
           "offsets row 1: %g %g %g", e4[3], e4[4], e4[5]);
    for (int i = 3; i < 24; i++)
        CHECK(isfinite(e8[i]) && e8[i] != 0.0f);
}

static int int_cmp(const void *pa, const void *pb)
{
    int a = *(const int *)pa, b = *(const int *)pb;
    return (a > b) - (a < b);
}

/* Sort order of the selection: score descending, index ascending. */
static const float *sel_scores;
static int sel_cmp(const void *pa, const void *pb)
{
    int a = *(const int *)pa, b = *(const int *)pb;
    float x = sel_scores[a], y = sel_scores[b];
    if (x != y) return x > y ? -1 : 1;
    return a - b;
}

/* infmoe_select of every keep in `keeps` against a sort of the F scores: the kept neurons,
 * ascending, and their weights. Returns the mismatches. */
static int select_vs_sort(const float *sc, int F, const int *keeps, int n_keeps)
{
    int *order = malloc(sizeof(int) * F), *want = malloc(sizeof(int) * F);
    int32_t *list = malloc(sizeof(int32_t) * F);
    float *w = malloc(sizeof(float) * F);
    uint32_t *work = malloc(sizeof(uint32_t) * 2 * F);
    int bad = 0;
    for (int f = 0; f < F; f++) order[f] = f;
    sel_scores = sc;
    qsort(order, (size_t)F, sizeof(int), sel_cmp);
    for (int q = 0; q < n_keeps; q++) {
        int keep = keeps[q];
        memcpy(want, order, sizeof(int) * keep);
        qsort(want, (size_t)keep, sizeof(int), int_cmp);
        int m = infmoe_select(sc, F, keep, list, w, work);
        if (m != keep) {
            bad++;
            continue;
        }
        for (int i = 0; i < keep; i++)
            if (list[i] != want[i] || w[i] != 1.0f / (1.0f + expf(-sc[want[i]]))) bad++;
    }
    free(order), free(want), free(list), free(w), free(work);
    return bad;
}

/* The slice selection against sorting: scores drawn from a few values (ties everywhere,
 * -0 and +0, negatives), every keep from 1 to F; and rows as wide as the shipped model's
 * (3072), where a sampled pivot narrows the search, with continuous scores, with the
 * threshold inside a run of ties, and with a pivot that falls too high. */
static void test_select(void)
{
    enum { F = 97, FW = 3072 };
    float sc[F], *wide = malloc(sizeof(float) * FW);
    int keeps[FW], bad = 0;
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int round = 0; round < 4; round++) {
        for (int f = 0; f < F; f++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            int v = (int)((r >> 33) % (round == 0 ? 7u : 1000u)) - (round == 0 ? 3 : 500);
            sc[f] = v == 0 && (r >> 20) % 2 ? -0.0f : (float)v * (round == 3 ? 1e-30f : 0.25f);
        }
        for (int keep = 1; keep <= F; keep++) keeps[keep - 1] = keep;
        bad += select_vs_sort(sc, F, keeps, F);
    }
    for (int round = 0; round < 4; round++) {
        for (int f = 0; f < FW; f++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            double u = (double)(r >> 11) / 9007199254740992.0;
            float v = (float)(u * 8.0 - 4.0);
            if (round == 1) v = (float)((int)(u * 40.0)) * 0.5f; /* 40 values: long tie runs */
            if (round == 2 && f % 24 != 0) v = -5.0f + (float)u; /* the sample sees only highs */
            if (round == 3) v = (f % 1000 == 0) ? 2.0f : 1.0f;   /* four highs, then one tie run */
            wide[f] = v;
        }
        int nk = 0;
        for (int keep = 1; keep <= FW; keep += keep < 400 ? 1 : 97) keeps[nk++] = keep;
        bad += select_vs_sort(wide, FW, keeps, nk);
    }
    free(wide);
    CHECKF(bad == 0, "infmoe_select: %d neurons chosen or weighted unlike a sort", bad);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char dir[600];
    test_desc(tests);
    test_offsets();
    test_select();
    snprintf(dir, sizeof dir, "%s/fixtures/models/infmoe_tiny", tests);
    check_model(dir, "infmoe_tiny", MODEL_DTYPE_AUTO); /* f32: auto is f32 */
    /* A trained model next to tests/ (none is shipped yet: see README, "Continuous experts"). */
    snprintf(dir, sizeof dir, "%s/../models/infmoe-small/reference.safetensors", tests);
    FILE *f = fopen(dir, "rb");
    if (f) {
        fclose(f);
        snprintf(dir, sizeof dir, "%s/../models/infmoe-small", tests);
        check_model(dir, "infmoe-small", MODEL_DTYPE_F32);
    } else {
        printf(
            "models/infmoe-small/reference.safetensors not found: trained-model check skipped\n");
    }
    return test_done("test_infmoe");
}
