/* Golden tests of the `mohge` architecture (heterogeneous expert groups, two-level router,
 * always-on shared experts) against our PyTorch reference (tools/train/mohge_model.py, outputs
 * written by tests/reference/make_mohge_fixtures.py): the tiny random checkpoint in
 * tests/fixtures/models/mohge_tiny/ and, when present, the bundled trained model in
 * models/mohge-small/ (bf16 weights; the reference computed in f32 from the same values).
 * Checks f32 logits within 1e-4 relative (max|a-b| / max|b|), identical 32-token greedy
 * continuations, equal results on 1, 2 and 4 devices, the All-size Group-decoupling placement,
 * the parsed description (mixed widths, groups), the expert budget, and config errors. */
#include <math.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

#define MAX_PROMPTS 8
#define GREEDY      32

static double rel_err(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)ref[i]);
        if (!(d <= num)) num = d;
        if (fabs((double)ref[i]) > den) den = fabs((double)ref[i]);
    }
    return den > 0 ? num / den : num;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

struct prompt {
    int n;
    const int32_t *ids;
    const float *logits;   /* (n, vocab) */
    const int32_t *greedy; /* (GREEDY) */
};

static int load_prompts(const struct st_archive *ref, struct prompt *p)
{
    int n = 0;
    for (; n < MAX_PROMPTS; n++) {
        char name[64];
        snprintf(name, sizeof name, "prompt%d.ids", n);
        const struct st_tensor *ids = st_find(ref, name);
        if (!ids) break;
        snprintf(name, sizeof name, "prompt%d.logits", n);
        const struct st_tensor *lg = st_find(ref, name);
        snprintf(name, sizeof name, "prompt%d.greedy", n);
        const struct st_tensor *gr = st_find(ref, name);
        if (!lg || !gr) break;
        p[n].n = (int)ids->shape[0];
        p[n].ids = ids->data;
        p[n].logits = lg->data;
        p[n].greedy = gr->data;
    }
    return n;
}

static struct engine *make_engine(const struct model *m, int devices)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = devices;
    ep.max_batch_tokens = 256;
    ep.max_seqs = 4;
    ep.max_model_len = 128;
    ep.kv_block_size = 4;
    struct engine *e = NULL;
    char err[MS_ERR_LEN];
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

static int prefill(struct engine *e, const struct prompt *p, int moe_k, float *out)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {.kv = &s,
                             .tokens = p->ids,
                             .n_tokens = p->n,
                             .pos = 0,
                             .moe_top_k = moe_k,
                             .n_logits = p->n,
                             .logits = out};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    if (rc) fprintf(stderr, "step: %s\n", err);
    engine_seq_free(e, &s);
    return rc;
}

/* Greedy decode of GREEDY tokens with the KV cache; returns how many match the reference. */
static int greedy_match(struct engine *e, const struct prompt *p, float *buf, int V)
{
    struct kv_seq s;
    char err[MS_ERR_LEN];
    if (engine_seq_init(e, &s) != 0) return -1;
    struct engine_item it = {
        .kv = &s, .tokens = p->ids, .n_tokens = p->n, .pos = 0, .n_logits = 1, .logits = buf};
    int same = 0;
    if (engine_step(e, &it, 1, err, sizeof err) != 0) goto out;
    for (int t = 0; t < GREEDY; t++) {
        int32_t tok = argmax(buf, V);
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

static void check_model(const char *dir, const char *name)
{
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct st_archive *ref = NULL;
    int rc = model_load(dir, NULL, &m, err, sizeof err);
    CHECKF(rc == 0, "%s: %s", name, err);
    char refpath[600];
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", dir);
    int rc2 = st_open_file(refpath, &ref, err, sizeof err);
    CHECKF(rc2 == 0, "%s: %s", name, err);
    if (rc || rc2) goto out;
    CHECK(m->desc.router == ROUTER_KIND_MOHGE && m->desc.n_group > 1);

    int V = m->desc.vocab;
    struct prompt p[MAX_PROMPTS];
    int np = load_prompts(ref, p);
    CHECKF(np >= 2, "%s: reference has %d prompts", name, np);
    int maxn = 0;
    for (int i = 0; i < np; i++)
        maxn = p[i].n > maxn ? p[i].n : maxn;
    float *a = malloc(sizeof(float) * (size_t)maxn * V);
    float *b = malloc(sizeof(float) * (size_t)maxn * V);
    struct engine *e1 = make_engine(m, 1);
    CHECK(e1 != NULL);
    if (!e1 || !a || !b) goto done;

    double worst = 0.0;
    for (int i = 0; i < np; i++) {
        size_t cnt = (size_t)p[i].n * V;
        CHECK(prefill(e1, &p[i], 0, a) == 0);
        double r = rel_err(a, p[i].logits, cnt);
        worst = r > worst ? r : worst;
        CHECKF(r <= 1e-4, "%s prompt %d: rel err %.3g", name, i, r);
        for (int nd = 2; nd <= 4; nd *= 2) {
            struct engine *en = make_engine(m, nd);
            CHECK(en != NULL);
            if (!en) continue;
            CHECK(prefill(en, &p[i], 0, b) == 0);
            double rd = rel_err(b, a, cnt);
            CHECKF(rd <= 1e-6, "%s prompt %d: %d devices differ from 1 by %.3g", name, i, nd, rd);
            engine_free(en);
        }
        int same = greedy_match(e1, &p[i], b, V);
        CHECKF(same == GREEDY, "%s prompt %d: greedy matches for %d of %d tokens", name, i, same,
               GREEDY);
    }
    printf("%-14s %d prompts, max rel err %.2e, greedy %d tokens each identical\n", name, np, worst,
           GREEDY);

    /* Expert budget: moe_top_k=1 computes one routed row per token per layer. */
    if (m->desc.top_k > 1) {
        const struct engine_stats *st = engine_get_stats(e1);
        size_t cells = (size_t)m->desc.n_layer * m->desc.n_expert;
        uint64_t before = 0, after = 0;
        for (size_t x = 0; x < cells; x++)
            before += st->expert_rows[x];
        CHECK(prefill(e1, &p[0], 1, b) == 0);
        for (size_t x = 0; x < cells; x++)
            after += st->expert_rows[x];
        CHECKF(after - before == (uint64_t)p[0].n * m->desc.n_layer,
               "%s: moe_top_k=1 ran %llu rows", name, (unsigned long long)(after - before));
    }
done:
    engine_free(e1);
    free(a);
    free(b);
out:
    st_close(ref);
    model_free(m);
}

/* All-size Group-decoupling: with no placement map, every device holds the same total expert
 * width (tiny: 4 groups x 2 experts of widths 16/24/32/40). */
static void test_placement(const char *tests)
{
    char dir[600], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/mohge_tiny", tests);
    struct model *m = NULL;
    int rc = model_load(dir, NULL, &m, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    static const int want4[] = {0, 2, 1, 3, 1, 3, 0, 2}; /* expert -> device, 4 devices */
    for (int nd = 2; nd <= 4; nd *= 2) {
        struct engine *e = make_engine(m, nd);
        CHECK(e != NULL);
        if (!e) continue;
        int width[8] = {0};
        for (int x = 0; x < m->desc.n_expert; x++) {
            int o = engine_expert_owner(e, x);
            width[o] += m->desc.expert_d_ff[x];
            if (nd == 4) CHECKF(o == want4[x], "expert %d on device %d, want %d", x, o, want4[x]);
        }
        for (int d = 1; d < nd; d++)
            CHECKF(width[d] == width[0], "%d devices: device %d holds width %d, device 0 %d", nd, d,
                   width[d], width[0]);
        engine_free(e);
    }
    model_free(m);
}

static void test_desc(const char *tests)
{
    char path[600];
    snprintf(path, sizeof path, "%s/fixtures/models/mohge_tiny/config.json", tests);
    FILE *f = fopen(path, "rb");
    CHECKF(f != NULL, "%s", path);
    if (!f) return;
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    struct model_desc d;
    char err[MS_ERR_LEN];
    int rc = model_desc_parse(buf, n, path, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return;
    CHECK(d.router == ROUTER_KIND_MOHGE && d.n_expert == 8 && d.n_group == 4 && d.topk_group == 2 &&
          d.top_k == 2);
    CHECK(d.n_shared == 1 && d.shared_d_ff == 32 && d.shared_gate == SHARED_GATE_NONE);
    static const int widths[] = {16, 16, 24, 24, 32, 32, 40, 40};
    for (int e = 0; e < 8; e++) {
        CHECK(d.expert_d_ff[e] == widths[e]);
        CHECK(d.expert_group[e] == e / 2);
    }
    CHECK(d.layer_is_moe[0] && d.layer_is_moe[1]);
    model_desc_free(&d);

    static const struct {
        const char *json, *want;
    } bad[] = {
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10}",
         "missing 'num_expert_groups'"},
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"num_expert_groups\": 2, "
         "\"experts_per_group\": 2, \"num_experts_per_tok\": 2, \"num_groups_per_tok\": 1, "
         "\"group_intermediate_sizes\": [8]}",
         "'group_intermediate_sizes' has 1 entries, expected 2"},
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"num_expert_groups\": 2, "
         "\"experts_per_group\": 2, \"num_experts_per_tok\": 2, \"num_groups_per_tok\": 3, "
         "\"group_intermediate_sizes\": [8, 16]}",
         "num_groups_per_tok 3"},
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"num_expert_groups\": 2, "
         "\"experts_per_group\": 2, \"num_experts_per_tok\": 3, \"num_groups_per_tok\": 1, "
         "\"group_intermediate_sizes\": [8, 16]}",
         "num_experts_per_tok 3"},
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"num_expert_groups\": 2, "
         "\"experts_per_group\": 2, \"num_experts_per_tok\": 2, \"num_groups_per_tok\": 1, "
         "\"group_intermediate_sizes\": [8, 0]}",
         "group_intermediate_sizes[1] must be a positive integer"},
        {"{\"model_type\": \"mohge\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"num_expert_groups\": 2, "
         "\"experts_per_group\": 2, \"num_experts_per_tok\": 2, \"num_groups_per_tok\": 1, "
         "\"group_intermediate_sizes\": [8, 16], \"num_shared_experts\": 1}",
         "shared_intermediate_size"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rc = model_desc_parse(bad[i].json, strlen(bad[i].json), "x/config.json", &d, err,
                              sizeof err);
        CHECKF(rc == -1 && strstr(err, bad[i].want) && strstr(err, "x/config.json"), "case %zu: %s",
               i, rc ? err : "(accepted)");
        if (rc == 0) model_desc_free(&d);
    }
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char dir[600];
    test_desc(tests);
    test_placement(tests);
    snprintf(dir, sizeof dir, "%s/fixtures/models/mohge_tiny", tests);
    check_model(dir, "mohge_tiny");
    /* The bundled model lives next to tests/ in the repository. */
    snprintf(dir, sizeof dir, "%s/../models/mohge-small/reference.safetensors", tests);
    FILE *f = fopen(dir, "rb");
    if (f) {
        fclose(f);
        snprintf(dir, sizeof dir, "%s/../models/mohge-small", tests);
        check_model(dir, "mohge-small");
    } else {
        printf("models/mohge-small/reference.safetensors not found: trained-model check skipped\n");
    }
    return test_done("test_mohge");
}
