/* Routing statistics and traces (engine/routing): a trace written with tags, losses, weights and
 * strided ids reads back exactly, also across a rotation; a flipped byte, a cut file, a bad magic
 * and a broken header are reported with their byte offset; the committed trace of the bundled
 * model opens and holds what its header says; the statistics count tokens, width-aware FLOPs,
 * co-activation pairs and layer transitions, and their window halves every half-life; the
 * synthetic router is deterministic and plants its clusters. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "common.h"
#include "routing/route_stats.h"
#include "routing/route_synth.h"
#include "routing/route_trace.h"
#include "test.h"

#define L 3
#define E 8
#define K 2
#define T 5

static char tmpdir[256];

static const char *tmp(const char *name)
{
    static char buf[4][512];
    static int slot;
    char *p = buf[slot++ & 3];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

static long file_size(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

/* ids of step s: layer-major with a stride of T + 3 tokens (as the engine hands them over). */
static void make_step(int s, int32_t *ids, int32_t *tok, uint16_t *tags, float *loss, float *w,
                      size_t stride)
{
    for (int l = 0; l < L; l++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) {
                size_t i = (size_t)l * stride + (size_t)t * K + j;
                ids[i] = (t == 4 && j == 1) ? -1 : (s * 3 + l * 5 + t + j * 4) % E;
                w[i] = 0.25f * (float)(j + 1) + 0.125f * (float)l;
            }
    for (int t = 0; t < T; t++) {
        tok[t] = 100 * s + t;
        tags[t] = (uint16_t)(s % 2);
        loss[t] = t == 2 ? NAN : 0.5f * (float)t + (float)s;
    }
}

static void test_roundtrip(void)
{
    char err[MS_ERR_LEN];
    int widths[E] = {16, 16, 32, 32, 48, 48, 64, 64}, groups[E] = {0, 0, 1, 1, 2, 2, 3, 3};
    int lidx[L] = {1, 2, 4};
    struct rtrace_info in = {.n_layer = L, .n_expert = E, .top_k = K, .d_model = 24, .n_group = 4,
                             .model_n_layer = 5, .flags = RTRACE_F_LOSS | RTRACE_F_WEIGHTS,
                             .expert_width = widths, .expert_group = groups, .layer_index = lidx};
    snprintf(in.model, sizeof in.model, "unit");
    const char *path = tmp("a.rtrace");
    struct rtrace_writer *w = NULL;
    /* Small enough to rotate after a few steps. */
    int rc = rtrace_writer_open(path, &in, 900, T, &w, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    CHECK(rtrace_writer_tag(w, 0, "even", err, sizeof err) == 0);
    CHECK(rtrace_writer_tag(w, 1, "odd", err, sizeof err) == 0);
    size_t stride = (T + 3) * K;
    int32_t ids[L * (T + 3) * K], tok[T];
    uint16_t tags[T];
    float loss[T], wt[L * (T + 3) * K];
    int n_steps = 12;
    for (int s = 0; s < n_steps; s++) {
        make_step(s, ids, tok, tags, loss, wt, stride);
        struct rtrace_step st = {.step = (uint64_t)s, .n_tok = T, .tokens = tok, .tags = tags,
                                 .loss = loss, .ids = ids, .weights = wt, .layer_stride = stride};
        CHECKF(rtrace_write_step(w, &st, err, sizeof err) == 0, "%s", err);
    }
    /* Too many tokens for the writer: refused, nothing written. */
    struct rtrace_step big = {.n_tok = T + 1, .ids = ids};
    CHECK(rtrace_write_step(w, &big, err, sizeof err) != 0 && strstr(err, "at most"));
    int32_t bad_ids[L * T * K];
    for (int i = 0; i < L * T * K; i++) bad_ids[i] = i == 3 ? E : 0;
    struct rtrace_step bad = {.n_tok = T, .ids = bad_ids};
    CHECK(rtrace_write_step(w, &bad, err, sizeof err) != 0);
    uint64_t steps = 0, bytes = 0;
    int rot = 0;
    rtrace_writer_counts(w, &steps, &bytes, &rot);
    CHECK(steps == (uint64_t)n_steps);
    CHECKF(rot >= 1, "rotations %d", rot);
    CHECK(rtrace_writer_close(w, err, sizeof err) == 0);

    /* PATH.1 and PATH hold the last steps, consecutive, each file with header and tags (older
     * rotations are gone: at most two files). */
    int seen = -1, n_read = 0;
    int first_in_new = -1;
    for (int f = 0; f < 2; f++) {
        char p1[600];
        snprintf(p1, sizeof p1, "%s%s", path, f == 0 ? ".1" : "");
        struct rtrace_reader *r = NULL;
        rc = rtrace_open(p1, &r, err, sizeof err);
        CHECKF(rc == 0, "%s", err);
        if (rc) continue;
        const struct rtrace_info *ri = rtrace_get_info(r);
        CHECK(ri->n_layer == L && ri->n_expert == E && ri->top_k == K && ri->d_model == 24);
        CHECK(ri->n_group == 4 && ri->model_n_layer == 5 && strcmp(ri->model, "unit") == 0);
        CHECK(ri->flags == (RTRACE_F_LOSS | RTRACE_F_WEIGHTS));
        CHECK(ri->expert_width[3] == 32 && ri->expert_group[7] == 3 && ri->layer_index[2] == 4);
        struct rtrace_step st;
        int got;
        while ((got = rtrace_next(r, &st, err, sizeof err)) == 1) {
            int s = (int)st.step;
            if (f == 1 && first_in_new < 0) first_in_new = s;
            if (seen < 0) seen = s;
            CHECK(s == seen);
            CHECK(st.n_tok == T);
            make_step(s, ids, tok, tags, loss, wt, stride);
            bool same = true;
            for (int l = 0; l < L; l++)
                for (int c = 0; c < T * K; c++) {
                    same &= st.ids[(size_t)l * st.layer_stride + c] == ids[(size_t)l * stride + c];
                    /* f16 holds these weights exactly */
                    same &= st.weights[(size_t)l * st.layer_stride + c] == wt[(size_t)l * stride + c];
                }
            for (int t = 0; t < T; t++) {
                same &= st.tokens[t] == tok[t] && st.tags[t] == tags[t];
                same &= isnan(loss[t]) ? isnan(st.loss[t]) : st.loss[t] == loss[t];
            }
            CHECKF(same, "step %d differs", s);
            seen++;
            n_read++;
        }
        CHECKF(got == 0, "%s", err);
        CHECK(rtrace_tag_name(r, 0) && strcmp(rtrace_tag_name(r, 0), "even") == 0);
        CHECK(rtrace_tag_name(r, 1) && strcmp(rtrace_tag_name(r, 1), "odd") == 0);
        CHECK(rtrace_tag_name(r, 7) == NULL);
        /* rewind gives the first step again */
        CHECK(rtrace_rewind(r, err, sizeof err) == 0);
        CHECK(rtrace_next(r, &st, err, sizeof err) == 1);
        rtrace_close(r);
    }
    CHECKF(seen == n_steps && n_read >= 2, "read %d steps, up to %d of %d", n_read, seen, n_steps);
    CHECK(first_in_new > 0);
    CHECK(file_size(path) <= 900 && file_size(path) > 0);
}

/* Copies src to dst, then flips byte `at` (if >= 0) and cuts the copy to `len` (if >= 0). */
static void damaged_copy(const char *src, const char *dst, long at, long len)
{
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    int c;
    long i = 0;
    while (in && out && (c = fgetc(in)) != EOF && (len < 0 || i < len)) {
        fputc(i == at ? c ^ 0x5a : c, out);
        i++;
    }
    if (in) fclose(in);
    if (out) fclose(out);
}

/* Reads a whole file: 0 when it is fine, else -1 with the reason. */
static int read_all(const char *path, char *err, size_t errlen)
{
    struct rtrace_reader *r = NULL;
    if (rtrace_open(path, &r, err, errlen) != 0) return -1;
    struct rtrace_step st;
    int got;
    while ((got = rtrace_next(r, &st, err, errlen)) == 1) {
    }
    rtrace_close(r);
    return got;
}

static void test_corrupt(void)
{
    char err[MS_ERR_LEN];
    const char *good = tmp("a.rtrace"), *bad = tmp("bad.rtrace");
    long n = file_size(good);
    CHECK(n > 200);
    if (n <= 200) return;
    /* The header is 112 + 8 E + 4 L + 4 bytes; then tag records, then steps. A byte in the
     * last record's payload: a CRC mismatch at that record's offset. */
    damaged_copy(good, bad, n - 3, -1);
    CHECK(read_all(bad, err, sizeof err) == -1);
    CHECKF(strstr(err, "CRC") && strstr(err, "offset "), "%s", err);
    /* Cut inside the last record. */
    damaged_copy(good, bad, -1, n - 5);
    CHECK(read_all(bad, err, sizeof err) == -1);
    CHECKF(strstr(err, "truncated") && strstr(err, "offset "), "%s", err);
    long off = -1;
    const char *o = strstr(err, "offset ");
    if (o) off = strtol(o + 7, NULL, 10);
    CHECKF(off > 0 && off < n - 5, "offset %ld of %ld", off, n);
    /* Cut inside a record header. */
    damaged_copy(good, bad, -1, 112 + 8 * E + 4 * L + 4 + 6);
    CHECK(read_all(bad, err, sizeof err) == -1 && strstr(err, "truncated"));
    /* Bad magic; a corrupt header (CRC); an empty file. */
    damaged_copy(good, bad, 2, -1);
    CHECK(read_all(bad, err, sizeof err) == -1 && strstr(err, "magic") && strstr(err, "offset 0"));
    damaged_copy(good, bad, 120, -1);
    CHECK(read_all(bad, err, sizeof err) == -1 && strstr(err, "header"));
    damaged_copy(good, bad, -1, 0);
    CHECK(read_all(bad, err, sizeof err) == -1 && strstr(err, "truncated header"));
    CHECK(read_all(tmp("missing.rtrace"), err, sizeof err) == -1 && strstr(err, "cannot open"));
}

/* The committed trace of the bundled model on the held-out corpora. */
static void test_bundled_trace(const char *tests)
{
    char err[MS_ERR_LEN];
    struct rtrace_reader *r = NULL;
    int rc = rtrace_open(test_path(tests, "fixtures/routing/mohge_small_heldout.rtrace"), &r, err,
                         sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    const struct rtrace_info *in = rtrace_get_info(r);
    CHECK(in->n_expert == 16 && in->top_k == 2 && in->n_layer == 4 && in->n_group == 4);
    CHECK(in->flags & RTRACE_F_LOSS);
    struct rtrace_step st;
    int got, tokens = 0, tags[3] = {0};
    while ((got = rtrace_next(r, &st, err, sizeof err)) == 1) {
        tokens += st.n_tok;
        for (int t = 0; t < st.n_tok; t++) {
            if (st.tags[t] < 3) tags[st.tags[t]]++;
            CHECK(st.loss[t] >= 0.0f);
            for (int l = 0; l < in->n_layer; l++)
                for (int j = 0; j < in->top_k; j++)
                    CHECK(st.ids[(size_t)l * st.layer_stride + (size_t)t * in->top_k + j] >= 0);
        }
    }
    CHECKF(got == 0, "%s", err);
    CHECK(tokens > 1000 && tags[0] > 0 && tags[1] > 0 && tags[2] > 0);
    CHECK(strcmp(rtrace_tag_name(r, 0), "shakespeare") == 0);
    rtrace_close(r);
}

static void test_stats(void)
{
    char err[MS_ERR_LEN];
    int widths[4] = {10, 20, 30, 40};
    struct rstats_config c = {.n_layer = 2, .n_expert = 4, .top_k = 2, .d_model = 8,
                              .expert_width = widths, .half_life = 0, .coact = true};
    struct rstats *s = NULL;
    CHECK(rstats_create(&c, &s, err, sizeof err) == 0);
    if (!s) return;
    /* 3 tokens: layer 0 picks {0,1}, {0,1}, {2,-1}; layer 1 picks {3,1}, {3,2}, {0,1}. */
    int32_t ids[2 * 3 * 2] = {0, 1, 0, 1, 2, -1, 3, 1, 3, 2, 0, 1};
    rstats_add(s, ids, 3, 0);
    double tok[4], fl[4];
    rstats_expert_tokens(s, 0, tok);
    CHECK(tok[0] == 2 && tok[1] == 2 && tok[2] == 1 && tok[3] == 0);
    rstats_expert_flops(s, 1, fl);
    CHECK(fl[3] == 2 * 6.0 * 8 * 40 && fl[0] == 6.0 * 8 * 10);
    float co[16], tr[16];
    CHECK(rstats_coact(s, 0, co) == 0);
    CHECK(co[0 * 4 + 1] == 2 && co[1 * 4 + 0] == 2 && co[0 * 4 + 0] == 0 && co[2 * 4 + 3] == 0);
    CHECK(rstats_transitions(s, 0, tr) == 0);
    /* token 0: 0->3, 0->1, 1->3, 1->1; token 1: 0->3, 0->2, 1->3, 1->2; token 2: 2->0, 2->1 */
    CHECK(tr[0 * 4 + 3] == 2 && tr[1 * 4 + 3] == 2 && tr[2 * 4 + 0] == 1 && tr[1 * 4 + 1] == 1);
    CHECK(rstats_transitions(s, 1, tr) == 0 && tr[0] == 0); /* the last layer has no next */
    CHECK(rstats_tokens_seen(s) == 3 && rstats_steps(s) == 1 && rstats_window_tokens(s) == 3);
    CHECK(rstats_expert_rows_total(s)[1 * 4 + 3] == 2);
    rstats_free(s);

    /* Decay: after half_life more tokens, the first step weighs half. Renormalization (a tiny
     * half-life grows the gain fast) keeps the values. */
    c.half_life = 4;
    c.coact = false;
    CHECK(rstats_create(&c, &s, err, sizeof err) == 0);
    if (!s) return;
    int32_t a[2 * 4 * 2], b[2 * 4 * 2];
    for (int i = 0; i < 16; i++) {
        a[i] = i % 2 == 0 ? 0 : -1; /* 4 tokens on expert 0 */
        b[i] = i % 2 == 0 ? 1 : -1; /* 4 tokens on expert 1 */
    }
    rstats_add(s, a, 4, 0);
    rstats_add(s, b, 4, 0);
    rstats_expert_tokens(s, 0, tok);
    CHECKF(fabs(tok[0] - 2.0) < 1e-9 && fabs(tok[1] - 4.0) < 1e-9, "%g %g", tok[0], tok[1]);
    CHECK(fabs(rstats_window_tokens(s) - 6.0) < 1e-9);
    CHECK(rstats_coact(s, 0, co) == -1 && co[1] == 0);
    for (int i = 0; i < 400; i++) rstats_add(s, b, 4, 0); /* 1600 tokens: gain 2^400, renormed */
    rstats_expert_tokens(s, 0, tok);
    /* the window of a steady stream of 4 tokens a step: 4 / (1 - 2^-1) = 8 */
    CHECKF(tok[0] < 1e-100 && fabs(tok[1] - 8.0) < 1e-6, "%g %g", tok[0], tok[1]);
    rstats_reset(s);
    CHECK(rstats_window_tokens(s) == 0 && rstats_tokens_seen(s) == 0);
    rstats_free(s);
    /* Bad configuration. */
    c.n_expert = 0;
    CHECK(rstats_create(&c, &s, err, sizeof err) != 0);
}

static void test_synth(void)
{
    char err[MS_ERR_LEN];
    struct rsynth_config c = {.n_layer = 3, .n_expert = 32, .top_k = 4, .d_model = 64,
                              .width = 128, .groups = 4, .cluster = 8, .p_in = 0.9,
                              .topic_skew = 1.0, .expert_skew = 0.5, .seed = 7};
    struct rsynth *a = NULL, *b = NULL;
    CHECK(rsynth_create(&c, &a, err, sizeof err) == 0);
    CHECK(rsynth_create(&c, &b, err, sizeof err) == 0);
    if (!a || !b) return;
    enum { N = 2000 };
    static int32_t ia[3 * N * 4], ib[3 * N * 4];
    static uint16_t ta[N];
    rsynth_step(a, N, ia, ta);
    rsynth_step(b, N, ib, NULL);
    CHECK(memcmp(ia, ib, sizeof ia) == 0);
    CHECK(rsynth_widths(a)[0] == 32 && rsynth_widths(a)[31] == 128 && rsynth_groups(a)[8] == 1);
    /* Distinct experts per token; pairs inside a token mostly share a cluster: the same pair
     * statistics over two different layers would be flat without planting. Count, at layer 0,
     * how often the top pair of expert 0's partners... simpler: the tokens of one topic use
     * few experts. */
    bool distinct = true;
    for (int t = 0; t < N; t++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < j; i++) distinct &= ia[t * 4 + i] != ia[t * 4 + j];
    CHECK(distinct);
    int used[32] = {0}, n_used = 0, topic = ta[0];
    for (int t = 0; t < N; t++)
        if (ta[t] == topic)
            for (int j = 0; j < 4; j++) used[ia[t * 4 + j]]++;
    int in_top8 = 0, total = 0;
    for (int x = 0; x < 32; x++) total += used[x], n_used += used[x] > 0;
    /* the 8 most used experts of the topic take about p_in of its rows */
    for (int k = 0; k < 8; k++) {
        int best = 0;
        for (int x = 1; x < 32; x++) best = used[x] > used[best] ? x : best;
        in_top8 += used[best];
        used[best] = -1;
    }
    CHECKF(in_top8 > 0.85 * total, "%d of %d rows in the topic's top 8", in_top8, total);
    rsynth_free(a);
    rsynth_free(b);
    c.cluster = 3; /* < top_k */
    CHECK(rsynth_create(&c, &a, err, sizeof err) != 0);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    snprintf(tmpdir, sizeof tmpdir, "/tmp/moeserve_test_routing_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_roundtrip();
    test_corrupt();
    test_bundled_trace(tests);
    test_stats();
    test_synth();
    const char *names[] = {"a.rtrace", "a.rtrace.1", "bad.rtrace"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) unlink(tmp(names[i]));
    rmdir(tmpdir);
    return test_done("test_routing");
}
