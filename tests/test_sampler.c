/* Tests for engine/sampler: greedy and tie-breaking, temperature sampling against the softmax
 * (statistical bounds), the exact keep/drop boundaries of top-k, top-p and min-p, the three
 * penalties against their formulas (read back through the log-probs), seeding, log-probs
 * against an independent double-precision log_softmax, non-finite logits and tiny vocabularies.
 * Ends with an informational timing of one step on a Qwen-sized (151936) vocabulary. */
#include "sampler.h"
#include "common.h"
#include "test.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A test-local generator (independent of the sampler's) for random logits. */
static uint64_t test_rng = 0x1234567887654321ull;

static double test_uniform(void)
{
    test_rng ^= test_rng << 13;
    test_rng ^= test_rng >> 7;
    test_rng ^= test_rng << 17;
    return (double)(test_rng >> 11) * 0x1.0p-53;
}

static double test_normal(void)
{
    double u1 = test_uniform(), u2 = test_uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static void log_softmax_ref(const float *x, int n, double *out)
{
    double m = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    double z = 0.0;
    for (int i = 0; i < n; i++)
        z += exp((double)x[i] - m);
    for (int i = 0; i < n; i++)
        out[i] = (double)x[i] - m - log(z);
}

static struct sampler *make(int vocab, float temp, int top_k, float top_p, float min_p,
                            uint64_t seed)
{
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = seed;
    p.has_seed = true;
    struct sampler *s = smp_create(vocab, &p);
    if (!s) {
        fprintf(stderr, "smp_create(%d) failed\n", vocab);
        exit(1);
    }
    return s;
}

/* Draws `n` tokens from `s` with the same logits each time, counting them in hist (vocab). */
static void draw_many(struct sampler *s, const float *logits, int vocab, int n, int *hist)
{
    float *row = malloc((size_t)vocab * sizeof *row);
    memset(hist, 0, (size_t)vocab * sizeof *hist);
    for (int i = 0; i < n; i++) {
        memcpy(row, logits, (size_t)vocab * sizeof *row);
        int32_t t = smp_sample(s, row, NULL);
        if (t >= 0 && t < vocab) hist[t]++;
    }
    free(row);
}

/* Checks sampled frequencies against probabilities p (which sum to 1 over vocab): every token
 * within 5 sigma, and Pearson chi-square below the 0.1% critical value for its dof. */
static void check_freqs(const char *what, const int *hist, const double *p, int vocab, int n)
{
    double chi2 = 0.0;
    int dof = -1;
    for (int i = 0; i < vocab; i++) {
        double f = (double)hist[i] / n;
        if (p[i] == 0.0) {
            CHECKF(hist[i] == 0, "%s: token %d has p=0 but was drawn %d times", what, i, hist[i]);
            continue;
        }
        double sigma = sqrt(p[i] * (1.0 - p[i]) / n);
        CHECKF(fabs(f - p[i]) < 5.0 * sigma + 1e-12, "%s: token %d freq %.4f vs p %.4f", what, i, f,
               p[i]);
        double e = p[i] * n;
        chi2 += (hist[i] - e) * (hist[i] - e) / e;
        dof++;
    }
    /* 0.1% upper critical values of chi-square for dof 1..5. */
    static const double crit[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52};
    if (dof >= 1 && dof <= 5)
        CHECKF(chi2 < crit[dof], "%s: chi-square %.2f >= %.2f (dof %d)", what, chi2, crit[dof],
               dof);
}

static void test_greedy(void)
{
    struct sampler *s = make(6, 0.0f, 0, 1.0f, 0.0f, 1);
    float a[6] = {0.5f, 3.0f, -1.0f, 2.9f, 1.0f, 0.0f};
    CHECK(smp_sample(s, a, NULL) == 1);
    float b[6] = {1.0f, 2.0f, 4.0f, 0.0f, 4.0f, 4.0f}; /* tie at 2, 4, 5 → lowest id */
    CHECK(smp_sample(s, b, NULL) == 2);
    float c[6] = {-3.0f, -3.0f, -5.0f, -7.0f, -3.0f, -9.0f};
    CHECK(smp_sample(s, c, NULL) == 0);
    smp_free(s);

    /* Tiny temperatures are greedy too, even with other knobs set. */
    s = make(6, 1e-6f, 3, 0.5f, 0.1f, 2);
    for (int i = 0; i < 50; i++) {
        float d[6] = {1.0f, 2.0f, 2.5f, 2.5f, 0.0f, 2.4f};
        CHECK(smp_sample(s, d, NULL) == 2);
    }
    smp_free(s);
}

static void test_temperature_freqs(void)
{
    const int n = 20000;
    const float logits[4] = {0.0f, 1.0f, 2.0f, 0.5f};
    const float temps[2] = {1.0f, 0.7f};
    int hist[4];
    for (int ti = 0; ti < 2; ti++) {
        struct sampler *s = make(4, temps[ti], 0, 1.0f, 0.0f, 42 + (uint64_t)ti);
        draw_many(s, logits, 4, n, hist);
        float scaled[4];
        double lp[4], p[4];
        for (int i = 0; i < 4; i++)
            scaled[i] = logits[i] / temps[ti];
        log_softmax_ref(scaled, 4, lp);
        for (int i = 0; i < 4; i++)
            p[i] = exp(lp[i]);
        check_freqs(ti == 0 ? "T=1" : "T=0.7", hist, p, 4, n);
        smp_free(s);
    }
}

static void test_top_k(void)
{
    /* Top two are ids 7 and 2; with a high temperature the tail would be drawn often. */
    float logits[10] = {0.1f, 0.2f, 1.5f, 0.0f, -0.3f, 0.9f, 0.3f, 2.0f, 1.2f, 0.4f};
    int hist[10];
    struct sampler *s = make(10, 3.0f, 2, 1.0f, 0.0f, 7);
    draw_many(s, logits, 10, 20000, hist);
    int outside = 0;
    for (int i = 0; i < 10; i++)
        if (i != 7 && i != 2) outside += hist[i];
    CHECKF(outside == 0, "top_k=2 drew %d tokens outside the top 2", outside);
    /* Inside, the renormalized softmax of the two. */
    double p7 = 1.0 / (1.0 + exp((1.5 - 2.0) / 3.0));
    double p[10] = {0};
    p[7] = p7;
    p[2] = 1.0 - p7;
    check_freqs("top_k=2", hist, p, 10, 20000);
    smp_free(s);

    /* Ties at the boundary keep the lower ids: 1,2,3 tie for second, k=2 keeps 0 and 1. */
    float tie[5] = {3.0f, 1.0f, 1.0f, 1.0f, -1.0f};
    int th[5];
    s = make(5, 1.0f, 2, 1.0f, 0.0f, 8);
    draw_many(s, tie, 5, 2000, th);
    CHECK(th[0] > 0 && th[1] > 0 && th[2] == 0 && th[3] == 0 && th[4] == 0);
    smp_free(s);

    /* top_k larger than the vocab is "off". */
    float small[3] = {0.0f, 0.0f, 0.0f};
    int sh[3];
    s = make(3, 1.0f, 1000, 1.0f, 0.0f, 9);
    draw_many(s, small, 3, 3000, sh);
    CHECK(sh[0] > 0 && sh[1] > 0 && sh[2] > 0);
    smp_free(s);

    /* A bigger vocab exercises the quickselect: draws stay inside the true top 50. */
    enum { V = 5000, K = 50 };
    float *big = malloc(V * sizeof *big);
    int *bh = malloc(V * sizeof *bh);
    for (int i = 0; i < V; i++)
        big[i] = (float)test_normal();
    big[123] = big[4000] = 5.0f; /* a tie near the top for good measure */
    /* The K-th largest value, by counting (no reliance on the code under test). */
    int strays = 0, distinct = 0;
    s = make(V, 2.0f, K, 1.0f, 0.0f, 10);
    draw_many(s, big, V, 20000, bh);
    for (int i = 0; i < V; i++) {
        if (!bh[i]) continue;
        distinct++;
        int rank = 0; /* how many tokens come strictly before i in (value desc, id asc) */
        for (int j = 0; j < V; j++)
            if (big[j] > big[i] || (big[j] == big[i] && j < i)) rank++;
        if (rank >= K) strays++;
    }
    CHECKF(strays == 0, "top_k=%d on vocab %d drew %d tokens outside the top", K, V, strays);
    CHECKF(distinct == K, "top_k=%d drew %d distinct tokens", K, distinct);
    smp_free(s);
    free(big);
    free(bh);
}

static void test_top_p(void)
{
    /* Probabilities 0.5, 0.3, 0.15, 0.05 placed at ids 2, 0, 3, 1. Cumulative: 0.5, 0.8, 0.95. */
    const double prob[4] = {0.3, 0.05, 0.5, 0.15};
    float logits[4];
    for (int i = 0; i < 4; i++)
        logits[i] = (float)log(prob[i]) + 1.0f;
    int hist[4];
    struct {
        float top_p;
        int keep[4]; /* 1 = must be drawn, 0 = never */
    } cases[] = {
        {0.49f, {0, 0, 1, 0}},  {0.51f, {1, 0, 1, 0}},  {0.799f, {1, 0, 1, 0}},
        {0.801f, {1, 0, 1, 1}}, {0.949f, {1, 0, 1, 1}}, {0.951f, {1, 1, 1, 1}},
        {0.0f, {0, 0, 1, 0}},   {-1.0f, {0, 0, 1, 0}},  {1.0f, {1, 1, 1, 1}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct sampler *s = make(4, 1.0f, 0, cases[c].top_p, 0.0f, 100 + c);
        draw_many(s, logits, 4, 20000, hist);
        double kept = 0.0, p[4];
        for (int i = 0; i < 4; i++)
            kept += cases[c].keep[i] ? prob[i] : 0.0;
        for (int i = 0; i < 4; i++)
            p[i] = cases[c].keep[i] ? prob[i] / kept : 0.0;
        char what[64];
        snprintf(what, sizeof what, "top_p=%.3f", (double)cases[c].top_p);
        check_freqs(what, hist, p, 4, 20000);
        smp_free(s);
    }

    /* top-p applies to the top-k renormalized distribution: with k=3 the kept mass is 0.95 and
     * the cumulative shares are 0.526, 0.842, 1, so 0.84 keeps two tokens and 0.845 three. */
    struct sampler *s = make(4, 1.0f, 3, 0.84f, 0.0f, 200);
    draw_many(s, logits, 4, 5000, hist);
    CHECK(hist[0] > 0 && hist[2] > 0 && hist[1] == 0 && hist[3] == 0);
    smp_free(s);
    s = make(4, 1.0f, 3, 0.845f, 0.0f, 201);
    draw_many(s, logits, 4, 5000, hist);
    CHECK(hist[0] > 0 && hist[2] > 0 && hist[3] > 0 && hist[1] == 0);
    smp_free(s);

    /* A flat big vocab: every drawn token is inside the reference nucleus (computed here by a
     * full sort in double), and the nucleus boundary token itself is reachable. */
    enum { V = 3000 };
    float *big = malloc(V * sizeof *big);
    int *order = malloc(V * sizeof *order), *bh = malloc(V * sizeof *bh);
    double *lp = malloc(V * sizeof *lp);
    for (int i = 0; i < V; i++)
        big[i] = (float)(0.5 * test_normal());
    log_softmax_ref(big, V, lp);
    for (int i = 0; i < V; i++)
        order[i] = i;
    for (int i = 1; i < V; i++) { /* insertion sort by (value desc, id asc) */
        int t = order[i], j = i;
        while (j > 0 &&
               (big[order[j - 1]] < big[t] || (big[order[j - 1]] == big[t] && order[j - 1] > t))) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = t;
    }
    const double top_p = 0.3;
    int nucleus = 0;
    double acc = 0.0;
    while (nucleus < V && acc < top_p)
        acc += exp(lp[order[nucleus++]]);
    s = make(V, 1.0f, 0, (float)top_p, 0.0f, 300);
    draw_many(s, big, V, 30000, bh);
    int strays = 0;
    for (int r = nucleus; r < V; r++)
        strays += bh[order[r]];
    CHECKF(strays == 0, "top_p=%.2f drew %d tokens outside the nucleus of %d", top_p, strays,
           nucleus);
    int missing = 0;
    for (int r = 0; r < nucleus; r++)
        missing += bh[order[r]] == 0;
    CHECKF(missing == 0, "top_p nucleus of %d: %d members never drawn", nucleus, missing);
    smp_free(s);
    free(big);
    free(order);
    free(bh);
    free(lp);
}

static void test_min_p(void)
{
    const double prob[4] = {0.15, 0.5, 0.05, 0.3};
    float logits[4];
    for (int i = 0; i < 4; i++)
        logits[i] = (float)log(prob[i]) - 2.0f;
    int hist[4];
    struct {
        float min_p;
        int keep[4];
    } cases[] = {
        {0.09f, {1, 1, 1, 1}}, /* threshold 0.045 keeps 0.05 */
        {0.11f, {1, 1, 0, 1}}, /* threshold 0.055 drops 0.05 */
        {0.29f, {1, 1, 0, 1}}, /* 0.145 keeps 0.15 */
        {0.31f, {0, 1, 0, 1}}, /* 0.155 drops 0.15 */
        {0.61f, {0, 1, 0, 0}}, /* 0.305 drops 0.3 */
        {5.0f, {0, 1, 0, 0}},  /* above 1: the top token survives */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct sampler *s = make(4, 1.0f, 0, 1.0f, cases[c].min_p, 400 + c);
        draw_many(s, logits, 4, 20000, hist);
        double kept = 0.0, p[4];
        for (int i = 0; i < 4; i++)
            kept += cases[c].keep[i] ? prob[i] : 0.0;
        for (int i = 0; i < 4; i++)
            p[i] = cases[c].keep[i] ? prob[i] / kept : 0.0;
        char what[64];
        snprintf(what, sizeof what, "min_p=%.2f", (double)cases[c].min_p);
        check_freqs(what, hist, p, 4, 20000);
        smp_free(s);
    }
    /* min-p is relative to the post-temperature distribution: at T=2 the ratios to the top
     * become sqrt(p / 0.5) = 0.548, 0.316, 0.775, so 0.31 keeps everything, 0.32 drops 0.05. */
    struct sampler *s = make(4, 2.0f, 0, 1.0f, 0.32f, 500);
    draw_many(s, logits, 4, 5000, hist);
    CHECK(hist[0] > 0 && hist[1] > 0 && hist[3] > 0 && hist[2] == 0);
    smp_free(s);
    s = make(4, 2.0f, 0, 1.0f, 0.31f, 501);
    draw_many(s, logits, 4, 5000, hist);
    CHECK(hist[0] > 0 && hist[1] > 0 && hist[2] > 0 && hist[3] > 0);
    smp_free(s);
}

/* Samples greedily with full log-probs and compares them to log_softmax(expected). */
static void check_logprobs_equal(const char *what, struct sampler *s, const float *raw,
                                 const float *expected, int vocab)
{
    float row[8];
    double ref[8];
    struct smp_logprobs lp;
    memcpy(row, raw, (size_t)vocab * sizeof *row);
    int32_t t = smp_sample(s, row, &lp);
    log_softmax_ref(expected, vocab, ref);
    CHECKF(lp.n_top == vocab, "%s: n_top %d", what, lp.n_top);
    int best = 0;
    for (int i = 1; i < vocab; i++)
        if (expected[i] > expected[best]) best = i;
    CHECKF(t == best && lp.token == best, "%s: chose %d, expected %d", what, t, best);
    CHECKF(fabs(lp.logprob - ref[best]) < 1e-5, "%s: chosen logprob %f vs %f", what,
           (double)lp.logprob, ref[best]);
    for (int j = 0; j < lp.n_top && j < vocab; j++) {
        int id = lp.top_token[j];
        CHECKF(id >= 0 && id < vocab && fabs(lp.top_logprob[j] - ref[id]) < 1e-5,
               "%s: token %d logprob %f vs %f", what, id, (double)lp.top_logprob[j],
               id >= 0 && id < vocab ? ref[id] : 0.0);
    }
}

static void test_penalties(void)
{
    const float raw[8] = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.0f, 0.0f, 1.5f};
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 0.0f;
    p.n_logprobs = 8;

    /* Repetition: prompt tokens 0 (positive), 1 (negative) and 6 (zero); generated 3. */
    p.repetition_penalty = 1.3f;
    struct sampler *s = smp_create(8, &p);
    smp_accept(s, 0, false);
    smp_accept(s, 1, false);
    smp_accept(s, 6, false);
    smp_accept(s, 0, false); /* repeats count once */
    smp_accept(s, 3, true);
    smp_accept(s, 3, true);
    float e1[8];
    memcpy(e1, raw, sizeof e1);
    e1[0] = 2.0f / 1.3f;
    e1[1] = -1.0f * 1.3f;
    e1[6] = 0.0f;
    e1[3] = 3.0f / 1.3f;
    check_logprobs_equal("repetition", s, raw, e1, 8);
    smp_free(s);

    /* Frequency and presence: only generated tokens, frequency scales with the count. */
    p.repetition_penalty = 1.0f;
    p.frequency_penalty = 0.4f;
    p.presence_penalty = 0.25f;
    s = smp_create(8, &p);
    smp_accept(s, 0, false); /* prompt only: untouched */
    smp_accept(s, 3, true);
    smp_accept(s, 3, true);
    smp_accept(s, 3, true);
    smp_accept(s, 7, true);
    smp_accept(s, 4, true);
    smp_accept(s, 4, true);
    float e2[8];
    memcpy(e2, raw, sizeof e2);
    e2[3] = 3.0f - 0.4f * 3 - 0.25f;
    e2[7] = 1.5f - 0.4f * 1 - 0.25f;
    e2[4] = -2.0f - 0.4f * 2 - 0.25f;
    check_logprobs_equal("frequency+presence", s, raw, e2, 8);

    /* Accepting more moves the chosen token: now 3 is far below 0. */
    for (int i = 0; i < 3; i++)
        smp_accept(s, 3, true);
    e2[3] = 3.0f - 0.4f * 6 - 0.25f;
    check_logprobs_equal("frequency after more", s, raw, e2, 8);
    smp_free(s);

    /* All three together, in vLLM order: repetition first, then frequency and presence. A
     * negative presence penalty (allowed by OpenAI) raises the logit. */
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = -0.75f;
    s = smp_create(8, &p);
    smp_accept(s, 5, false);
    smp_accept(s, 1, true);
    smp_accept(s, 1, true);
    smp_accept(s, 2, true);
    float e3[8];
    memcpy(e3, raw, sizeof e3);
    e3[5] = 1.0f / 2.0f;
    e3[1] = -1.0f * 2.0f - 0.5f * 2 + 0.75f;
    e3[2] = 0.5f / 2.0f - 0.5f * 1 + 0.75f;
    check_logprobs_equal("all three", s, raw, e3, 8);
    /* Out-of-range ids are ignored, not a crash. */
    smp_accept(s, -1, true);
    smp_accept(s, 8, false);
    check_logprobs_equal("after bad ids", s, raw, e3, 8);
    smp_free(s);
}

static void sequence(uint64_t seed, bool has_seed, int32_t *out, int n)
{
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 1.0f;
    p.top_p = 0.95f;
    p.seed = seed;
    p.has_seed = has_seed;
    struct sampler *s = smp_create(16, &p);
    uint64_t saved = test_rng;
    test_rng = 99; /* the same logits sequence for every call */
    for (int i = 0; i < n; i++) {
        float row[16];
        for (int j = 0; j < 16; j++)
            row[j] = (float)(0.3 * test_normal());
        out[i] = smp_sample(s, row, NULL);
        smp_accept(s, out[i], true);
    }
    test_rng = saved;
    smp_free(s);
}

static void test_seeds(void)
{
    enum { N = 200 };
    int32_t a[N], b[N], c[N], d[N], e[N];
    sequence(12345, true, a, N);
    sequence(12345, true, b, N);
    sequence(12346, true, c, N);
    sequence(0, false, d, N);
    sequence(0, false, e, N);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) != 0);
    CHECK(memcmp(d, e, sizeof d) != 0);
    /* Seed 0 is a seed like any other (splitmix64 expands it). */
    int32_t z1[N], z2[N];
    sequence(0, true, z1, N);
    sequence(0, true, z2, N);
    CHECK(memcmp(z1, z2, sizeof z1) == 0);
    int distinct = 0, seen[16] = {0};
    for (int i = 0; i < N; i++)
        if (!seen[z1[i]]++) distinct++;
    CHECK(distinct > 8);
}

static void test_logprobs(void)
{
    enum { V = 1000 };
    float *x = malloc(V * sizeof *x), *row = malloc(V * sizeof *row);
    double *ref = malloc(V * sizeof *ref);
    for (int i = 0; i < V; i++)
        x[i] = (float)(2.0 * test_normal());
    /* Ties among the top: 4 copies of the max, spread out; 3 copies of a runner-up. */
    x[900] = x[17] = x[512] = x[3] = 9.0f;
    x[800] = x[5] = x[600] = 8.5f;
    log_softmax_ref(x, V, ref);
    /* Reference top 20 by (value desc, id asc), by repeated scanning. */
    int want[SMP_MAX_LOGPROBS];
    char *taken = calloc(V, 1);
    for (int j = 0; j < SMP_MAX_LOGPROBS; j++) {
        int b = -1;
        for (int i = 0; i < V; i++)
            if (!taken[i] && (b < 0 || x[i] > x[b])) b = i;
        taken[b] = 1;
        want[j] = b;
    }
    for (int mode = 0; mode < 2; mode++) {
        struct smp_params p;
        smp_params_default(&p);
        p.temperature = mode == 0 ? 0.0f : 0.8f;
        p.top_k = mode == 0 ? 0 : 40;
        p.seed = 5;
        p.has_seed = true;
        p.n_logprobs = SMP_MAX_LOGPROBS;
        struct sampler *s = smp_create(V, &p);
        for (int rep = 0; rep < 20; rep++) {
            struct smp_logprobs lp;
            memcpy(row, x, V * sizeof *row);
            int32_t t = smp_sample(s, row, &lp);
            CHECK(t >= 0 && t < V && lp.token == t);
            if (mode == 0) CHECK(t == 3);
            CHECKF(fabs(lp.logprob - ref[t]) < 1e-5, "chosen %d: %f vs %f", t, (double)lp.logprob,
                   ref[t]);
            CHECK(lp.n_top == SMP_MAX_LOGPROBS);
            for (int j = 0; j < lp.n_top; j++) {
                CHECKF(lp.top_token[j] == want[j], "top[%d] = %d, want %d", j, lp.top_token[j],
                       want[j]);
                CHECKF(fabs(lp.top_logprob[j] - ref[want[j]]) < 1e-5, "top[%d] %f vs %f", j,
                       (double)lp.top_logprob[j], ref[want[j]]);
                if (j) CHECK(lp.top_logprob[j] <= lp.top_logprob[j - 1]);
            }
        }
        smp_free(s);
    }
    /* n_logprobs = 0 still reports the chosen token's logprob; above the max is clamped. */
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 0.0f;
    p.n_logprobs = 0;
    struct sampler *s = smp_create(V, &p);
    struct smp_logprobs lp;
    memcpy(row, x, V * sizeof *row);
    CHECK(smp_sample(s, row, &lp) == 3 && lp.n_top == 0 && fabs(lp.logprob - ref[3]) < 1e-5);
    smp_free(s);
    p.n_logprobs = 500;
    s = smp_create(V, &p);
    memcpy(row, x, V * sizeof *row);
    smp_sample(s, row, &lp);
    CHECK(lp.n_top == SMP_MAX_LOGPROBS);
    smp_free(s);
    free(taken);
    free(x);
    free(row);
    free(ref);
}

static void test_non_finite(void)
{
    struct smp_logprobs lp;
    /* NaN is never chosen, and the rest is a proper distribution. */
    struct sampler *s = make(5, 1.0f, 0, 1.0f, 0.0f, 600);
    int hist[5] = {0};
    for (int i = 0; i < 4000; i++) {
        float row[5] = {NAN, 0.0f, NAN, 1.0f, -INFINITY};
        int32_t t = smp_sample(s, row, &lp);
        if (t >= 0 && t < 5) hist[t]++;
        CHECK(isfinite(lp.logprob));
    }
    CHECK(hist[0] == 0 && hist[2] == 0 && hist[4] == 0 && hist[1] > 0 && hist[3] > 0);
    smp_free(s);

    /* Greedy with NaN in front. */
    s = make(4, 0.0f, 0, 1.0f, 0.0f, 601);
    float g[4] = {NAN, -5.0f, NAN, -4.0f};
    CHECK(smp_sample(s, g, NULL) == 3);
    smp_free(s);

    /* All -inf / NaN: token 0 with a finite, defined logprob (uniform). */
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 1.0f;
    p.n_logprobs = 3;
    s = smp_create(4, &p);
    float a[4] = {-INFINITY, NAN, -INFINITY, -INFINITY};
    CHECK(smp_sample(s, a, &lp) == 0);
    CHECK(lp.token == 0 && fabs(lp.logprob - (float)-log(4.0)) < 1e-6 && lp.n_top == 3);
    smp_free(s);

    /* +inf wins outright, in greedy and sampled modes, with logprob 0. */
    for (int mode = 0; mode < 2; mode++) {
        s = make(4, mode ? 1.0f : 0.0f, 0, 0.9f, 0.05f, 602);
        for (int i = 0; i < 100; i++) {
            float r[4] = {3.0f, INFINITY, 2.0f, NAN};
            CHECK(smp_sample(s, r, &lp) == 1 && lp.logprob == 0.0f);
        }
        smp_free(s);
    }

    /* Penalties on non-finite logits stay sane. */
    p.repetition_penalty = 1.5f;
    p.frequency_penalty = 1.0f;
    p.presence_penalty = 1.0f;
    p.temperature = 0.0f;
    s = smp_create(3, &p);
    smp_accept(s, 0, true);
    smp_accept(s, 1, false);
    float q[3] = {NAN, -INFINITY, -1.0f};
    CHECK(smp_sample(s, q, &lp) == 2 && fabs(lp.logprob) < 1e-6);
    smp_free(s);
}

static void test_tiny(void)
{
    /* Vocab 1: always token 0, logprob 0, whatever the knobs. */
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 1.5f;
    p.top_k = 5;
    p.top_p = 0.5f;
    p.min_p = 0.5f;
    p.repetition_penalty = 1.2f;
    p.n_logprobs = 5;
    struct sampler *s = smp_create(1, &p);
    CHECK(s != NULL);
    smp_accept(s, 0, true);
    for (int i = 0; i < 10; i++) {
        struct smp_logprobs lp;
        float x[1] = {-3.0f + (float)i};
        CHECK(smp_sample(s, x, &lp) == 0 && lp.logprob == 0.0f && lp.n_top == 1 &&
              lp.top_token[0] == 0);
    }
    smp_free(s);
    CHECK(smp_create(0, &p) == NULL);
    CHECK(smp_create(-4, &p) == NULL);
    /* NULL params mean the defaults; freeing NULL is fine. */
    s = smp_create(3, NULL);
    CHECK(s != NULL);
    float x[3] = {0.0f, 1.0f, 2.0f};
    int32_t t = smp_sample(s, x, NULL);
    CHECK(t >= 0 && t < 3);
    smp_free(s);
    smp_free(NULL);
}

static void test_timing(void)
{
    enum { V = 151936, REPS = 20 };
    float *x = malloc(V * sizeof *x), *row = malloc(V * sizeof *row);
    const double scales[2] = {1.0, 4.0};
    for (int sc = 0; sc < 2; sc++) {
        for (int i = 0; i < V; i++)
            x[i] = (float)(scales[sc] * test_normal());
        struct smp_params p;
        smp_params_default(&p);
        p.temperature = 1.0f;
        p.top_p = 0.9f;
        p.top_k = 0;
        p.seed = 1;
        p.has_seed = true;
        p.n_logprobs = 5;
        p.repetition_penalty = 1.1f;
        struct sampler *s = smp_create(V, &p);
        for (int i = 0; i < 64; i++)
            smp_accept(s, (int32_t)(i * 997 % V), i & 1);
        double total = 0.0;
        struct smp_logprobs lp;
        for (int r = 0; r < REPS; r++) {
            memcpy(row, x, V * sizeof *row);
            double t0 = ms_now();
            int32_t t = smp_sample(s, row, &lp);
            total += ms_now() - t0;
            CHECK(t >= 0 && t < V);
        }
        printf("timing: vocab %d, logits N(0, %.0f^2), top_p 0.9, top_k 0, 5 logprobs: "
               "%.3f ms per token\n",
               V, scales[sc], 1e3 * total / REPS);
        smp_free(s);
    }
    free(x);
    free(row);
}

/* logit_bias (+-100 force and ban, finite ones added) and allowed_token_ids. */
static void test_bias(void)
{
    enum { V = 8 };
    float base[V] = {5, 4, 3, 2, 1, 0, -1, -2};
    float row[V];
    struct smp_params p;
    smp_params_default(&p);
    p.temperature = 0;
    /* -100 on the greedy token moves greedy to the next */
    struct smp_bias ban[] = {{0, -100.0f}};
    p.bias = ban;
    p.n_bias = 1;
    struct sampler *s = smp_create(V, &p);
    memcpy(row, base, sizeof row);
    CHECK(s && smp_sample(s, row, NULL) == 1 && row[0] == -INFINITY);
    smp_free(s);
    /* a finite bias is added: +3.5 on token 2 makes it the top */
    struct smp_bias add[] = {{2, 3.5f}};
    p.bias = add;
    s = smp_create(V, &p);
    memcpy(row, base, sizeof row);
    CHECK(s && smp_sample(s, row, NULL) == 2);
    smp_free(s);
    /* +100 forces: at temperature 1, only forced tokens come out */
    struct smp_bias force[] = {{6, 100.0f}, {7, 100.0f}};
    p.bias = force;
    p.n_bias = 2;
    p.temperature = 1;
    p.has_seed = true;
    p.seed = 9;
    s = smp_create(V, &p);
    for (int i = 0; i < 200 && s; i++) {
        memcpy(row, base, sizeof row);
        int32_t t = smp_sample(s, row, NULL);
        CHECK(t == 6 || t == 7);
    }
    smp_free(s);
    /* allowed_token_ids, with a ban inside the set */
    int32_t allowed[] = {3, 5, 7};
    p.bias = ban;
    p.n_bias = 1;
    ban[0].id = 3;
    p.allowed = allowed;
    p.n_allowed = 3;
    s = smp_create(V, &p);
    for (int i = 0; i < 200 && s; i++) {
        memcpy(row, base, sizeof row);
        int32_t t = smp_sample(s, row, NULL);
        CHECK(t == 5 || t == 7);
    }
    smp_free(s);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    test_bias();
    test_greedy();
    test_temperature_freqs();
    test_top_k();
    test_top_p();
    test_min_p();
    test_penalties();
    test_seeds();
    test_logprobs();
    test_non_finite();
    test_tiny();
    test_timing();
    return test_done("test_sampler");
}
