/* DeepSeek-V2/V3 beyond the golden logits of test_forward: how config.json becomes the model
 * description (MLA geometry, YaRN and its softmax mscale, routing rules), the config values
 * refused by name, the latent KV cache's size per token (kv_lora_rank + qk_rope_head_dim
 * floats per layer, no values). int8/int4 loads are checked by test_quant. */
#include <jansson.h>
#include <math.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "test.h"

static void test_descriptions(const char *tests)
{
    struct model_desc d;
    char err[MS_ERR_LEN];
    /* GLM-5 without indexer_types: transformers' schedule, full where
     * max(l - offset + 1, 0) % freq == 0 (freq 2, offset 2: layers 0, 1, 3) */
    int rc = golden_parse_patched(tests, "glm_moe_dsa",
                                  "{\"indexer_types\": null, \"index_topk_freq\": 2, "
                                  "\"index_skip_topk_offset\": 2}",
                                  &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.dsa_topk == 8 && d.dsa_heads == 8 && d.dsa_dim == 32 && d.dsa_rope_interleave);
        CHECK(d.dsa_shared && !d.dsa_shared[0] && !d.dsa_shared[1] && d.dsa_shared[2] &&
              !d.dsa_shared[3]);
        model_desc_free(&d);
    }
    rc = golden_parse_patched(tests, "deepseek_v3", NULL, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.attn == ATTN_KIND_MLA && d.router == ROUTER_KIND_SIGMOID_GROUP && d.router_bias);
        CHECK(d.q_lora_rank == 32 && d.kv_lora_rank == 48 && d.qk_nope_dim == 16 &&
              d.qk_rope_dim == 16 && d.v_head_dim == 32 && d.head_dim == 32);
        CHECK(d.rope_dim == 16 && d.rope_interleave && d.rope_yarn && d.yarn_factor == 4.0f &&
              d.yarn_orig_max_pos == 64);
        /* softmax scale = 32^-0.5 * (0.1 * 0.8 * ln 4 + 1)^2; cos/sin factor = mscale(4, 1) /
         * mscale(4, 0.8) */
        double m = 0.1 * 0.8 * log(4.0) + 1.0;
        CHECK(fabs(d.attn_scale - pow(32.0, -0.5) * m * m) < 1e-7);
        CHECK(fabs(d.rope_attn_factor - (0.1 * log(4.0) + 1.0) / m) < 1e-7);
        CHECK(d.n_group == 4 && d.topk_group == 2 && d.norm_topk_prob && d.routed_scale == 2.5f);
        CHECK(!d.layer_is_moe[0] && d.layer_is_moe[1] && d.layer_is_moe[2]);
        CHECK(d.n_shared == 1 && d.shared_d_ff == 32 && d.dense_d_ff == 128);
        model_desc_free(&d);
    }
    rc = golden_parse_patched(tests, "deepseek_v2", NULL, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.router == ROUTER_KIND_SOFTMAX_TOPK && !d.router_bias && d.routed_scale == 1.5f);
        CHECK(d.q_lora_rank == 0 && d.n_shared == 1 && d.shared_d_ff == 64 && !d.rope_yarn);
        CHECK(d.n_group == 0 && d.rope_interleave);
        model_desc_free(&d);
    }
    rc = golden_parse_patched(tests, "deepseek_v2_group", NULL, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.router == ROUTER_KIND_SOFTMAX_GROUP && d.n_group == 4 && d.topk_group == 2);
        CHECK(d.layer_is_moe[0] && d.layer_is_moe[1]);
        model_desc_free(&d);
    }
    /* moe_layer_freq: DeepSeek's rule, MoE from first_k_dense_replace on every freq-th layer */
    rc = golden_parse_patched(tests, "deepseek_v3", "{\"moe_layer_freq\": 2, \"num_hidden_layers\": 5}",
                       &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(!d.layer_is_moe[0] && !d.layer_is_moe[1] && d.layer_is_moe[2] &&
              !d.layer_is_moe[3] && d.layer_is_moe[4]);
        model_desc_free(&d);
    }

    /* Refused, naming the field and the value. */
    static const struct {
        const char *model, *patch, *want1, *want2;
    } bad[] = {
        {"deepseek_v2", "{\"topk_method\": \"noaux_tc\"}", "topk_method", "'noaux_tc'"},
        {"deepseek_v2", "{\"topk_method\": \"random\"}", "topk_method", "'random'"},
        {"deepseek_v3", "{\"topk_method\": \"greedy\"}", "topk_method", "'greedy'"},
        {"deepseek_v3", "{\"scoring_func\": \"softmax\"}", "scoring_func", "'softmax'"},
        {"deepseek_v2", "{\"scoring_func\": \"sigmoid\"}", "scoring_func", "'sigmoid'"},
        {"deepseek_v3",
         "{\"rope_parameters\": {\"rope_type\": \"longrope\", \"rope_theta\": 10000.0}}",
         "rope_type", "'longrope'"},
        {"deepseek_v3", "{\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}}", "rope_scaling",
         "'linear'"},
        {"deepseek_v3", "{\"quantization_config\": {\"quant_method\": \"fp8\"}}",
         "quantization_config.quant_method", "'fp8'"},
        {"deepseek_v2", "{\"norm_topk_prob\": true}", "norm_topk_prob", "deepseek_v2"},
        {"deepseek_v2", "{\"attention_bias\": true}", "attention_bias", "true"},
        {"deepseek_v3", "{\"n_group\": 3}", "n_group 3", "n_routed_experts"},
        {"deepseek_v3", "{\"topk_group\": 0}", "topk_group 0", NULL},
        {"deepseek_v3", "{\"qk_rope_head_dim\": 15}", "qk_rope_head_dim", "15"},
        /* DeepSeek-V3.2's sparse attention: unknown layer and MLP types by name */
        {"deepseek_v32",
         "{\"layer_types\": [\"indexed_attention\", \"sliding_attention\", "
         "\"indexed_attention\"]}",
         "layer_types[1]", "'sliding_attention'"},
        {"deepseek_v32", "{\"mlp_layer_types\": [\"dense\", \"hash\", \"sparse\"]}",
         "mlp_layer_types[1]", "'hash'"},
        {"deepseek_v32", "{\"index_topk\": 0}", "index_topk", NULL},
        {"deepseek_v32", "{\"index_head_dim\": 8}", "index_head_dim 8", "qk_rope_head_dim"},
        {"deepseek_v32", "{\"q_lora_rank\": null}", "q_lora_rank", NULL},
        /* GLM-5: the indexer modes */
        {"glm_moe_dsa", "{\"indexer_types\": [\"full\", \"skip\", \"full\", \"shared\"]}",
         "indexer_types[1]", "'skip'"},
        {"glm_moe_dsa", "{\"indexer_types\": [\"shared\", \"full\", \"full\", \"full\"]}",
         "layer 0 is 'shared'", NULL},
        {"glm_moe_dsa", "{\"indexer_types\": null, \"index_topk_pattern\": \"FSXF\"}",
         "index_topk_pattern[2]", "'X'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        rc = golden_parse_patched(tests, bad[i].model, bad[i].patch, &d, err, sizeof err);
        CHECKF(rc == -1 && strstr(err, bad[i].want1) &&
                   (!bad[i].want2 || strstr(err, bad[i].want2)),
               "case %zu (%s): %s", i, bad[i].patch, err);
        if (rc == 0) model_desc_free(&d);
    }
}

/* A fixture model loaded as it is; NULL (checked) when it does not load. */
static struct model *load_fixture(const char *tests, const char *name)
{
    char dir[600], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    int rc = model_load(dir, &lo, &m, err, sizeof err);
    CHECKF(rc == 0, "%s: %s", name, err);
    return rc == 0 ? m : NULL;
}

/* The latent cache: per token and layer kv_lora_rank + qk_rope_head_dim floats, no values. */
static void test_kv_bytes(const char *tests)
{
    struct model_desc d;
    char err[MS_ERR_LEN];
    /* DeepSeek-V2-Lite and V3 shapes (their config.json fields that matter here). */
    static const char *shapes[] = {
        "{\"num_hidden_layers\": 27, \"kv_lora_rank\": 512, \"qk_rope_head_dim\": 64, "
        "\"qk_nope_head_dim\": 128, \"v_head_dim\": 128, \"num_attention_heads\": 16, "
        "\"num_key_value_heads\": 16, \"hidden_size\": 2048, \"q_lora_rank\": null, "
        "\"n_routed_experts\": 64, \"num_experts_per_tok\": 6, \"n_group\": 1, \"topk_group\": 1, "
        "\"model_type\": \"deepseek_v2\", \"topk_method\": \"greedy\", \"norm_topk_prob\": false}",
        "{\"num_hidden_layers\": 61, \"kv_lora_rank\": 512, \"qk_rope_head_dim\": 64, "
        "\"qk_nope_head_dim\": 128, \"v_head_dim\": 128, \"num_attention_heads\": 128, "
        "\"num_key_value_heads\": 128, \"hidden_size\": 7168, \"q_lora_rank\": 1536, "
        "\"n_routed_experts\": 256, \"num_experts_per_tok\": 8, \"n_group\": 8, \"topk_group\": 4}",
    };
    static const size_t want[] = {576u * 27u * 4u, 576u * 61u * 4u};
    for (int i = 0; i < 2; i++) {
        int rc = golden_parse_patched(tests, "deepseek_v3", shapes[i], &d, err, sizeof err);
        CHECKF(rc == 0, "%s", err);
        if (rc != 0) continue;
        size_t got = model_kv_bytes_per_token(&d);
        CHECKF(got == want[i], "%s: %zu bytes per token, want %zu", i ? "V3" : "V2-Lite", got,
               want[i]);
        printf("KV cache bytes per token, %s shape: %zu (full K/V would be %zu)\n",
               i ? "DeepSeek-V3" : "DeepSeek-V2-Lite", got,
               (size_t)d.n_layer * d.n_head * (size_t)(d.head_dim + d.v_head_dim) * 4);
        model_desc_free(&d);
    }

    /* The engine's pool holds exactly that. */
    struct model *m = load_fixture(tests, "deepseek_v3");
    if (!m) return;
    struct engine *e = golden_engine(m, 1);
    CHECK(e != NULL);
    if (e) {
        const struct kv_cache *kv = engine_kv(e);
        int lat = m->desc.kv_lora_rank + m->desc.qk_rope_dim;
        /* no value storage: the value is read from the latent row */
        CHECK(kv->k_row == lat && kv->v_row == 0 && kv->layer[0].v == kv->layer[0].k);
        CHECK(engine_kv_bytes_per_token(e) == (size_t)lat * (size_t)m->desc.n_layer * sizeof(float));
        CHECK(kv_block_bytes_rows(kv->n_layer, kv->k_row, kv->v_row, kv->block_size) ==
              (size_t)lat * (size_t)m->desc.n_layer * sizeof(float) * (size_t)kv->block_size);
        CHECK(model_kv_bytes_per_token(&m->desc) ==
              (size_t)lat * (size_t)m->desc.n_layer * sizeof(float));
        engine_free(e);
    }
    model_free(m);
}

/* Relative L2 distance of rows [r0, r1) of two (n, vocab) logit arrays. */
static double rows_rel(const float *a, const float *b, int r0, int r1, int vocab)
{
    double num = 0.0, den = 0.0;
    for (size_t i = (size_t)r0 * vocab; i < (size_t)r1 * vocab; i++) {
        double e = (double)a[i] - (double)b[i];
        num += e * e;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* DeepSeek sparse attention below index_topk cached tokens is dense MLA: the deepseek_v32
 * fixture's logits at positions < index_topk equal those of the same weights run as DeepSeek-V3
 * (the indexer switched off), and past it they do not (so the check can fail). */
static void test_dsa_dense(const char *tests)
{
    struct model *m = load_fixture(tests, "deepseek_v32");
    if (!m) return;
    int topk = m->desc.dsa_topk, vocab = m->desc.vocab;
    /* a prompt past index_topk: the fixture's ids repeated */
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = (int32_t)(3 + (i * 7) % (vocab - 3));
    struct golden_prompt p = {.ids = ids, .n = 40};
    float *sparse = malloc(sizeof(float) * 40 * (size_t)vocab);
    float *dense = malloc(sizeof(float) * 40 * (size_t)vocab);
    struct engine *es = golden_engine(m, 1);
    /* the same weights as plain MLA (an engine reads the model's description as it runs) */
    m->desc.dsa_topk = 0;
    struct engine *ed = golden_engine(m, 1);
    CHECK(sparse && dense && es && ed && topk > 0 && topk < 40);
    if (sparse && dense && es && ed && topk > 0 && topk < 40) {
        CHECK(engine_kv(es)->k_row == engine_kv(ed)->k_row + m->desc.dsa_dim);
        CHECK(golden_prefill(ed, &p, 0, dense) == 0);
        m->desc.dsa_topk = topk;
        CHECK(golden_prefill(es, &p, 0, sparse) == 0);
        double below = rows_rel(sparse, dense, 0, topk, vocab);
        double above = rows_rel(sparse, dense, topk, 40, vocab);
        printf("DSA vs dense MLA: positions < index_topk %d: %.2e relative; beyond: %.2e\n",
               topk, below, above);
        CHECKF(below < 1e-6, "below index_topk: %.3e", below);
        CHECKF(above > 1e-3, "beyond index_topk the selection changed nothing: %.3e", above);
    }
    m->desc.dsa_topk = topk;
    engine_free(es);
    engine_free(ed);
    free(sparse);
    free(dense);
    model_free(m);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    test_descriptions(tests);
    test_kv_bytes(tests);
    test_dsa_dense(tests);
    return test_done("test_mla");
}
