/* gpt-oss beyond the golden logits of test_forward: how config.json becomes the model
 * description (sinks, biases, per-layer windows from layer_types, the clamped SwiGLU, YaRN
 * without truncation), gpt-oss-20b's own config.json, the values refused by name, and what the
 * loader makes of MXFP4 experts (kept 4-bit, or dequantized for --dtype; a NaN scale refused;
 * the parameter count transformers reports). int8/int4 loads are checked by test_quant. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "golden.h"
#include "model.h"
#include "test.h"

/* openai/gpt-oss-20b's config.json, the fields that matter (legacy rope_scaling spelling). */
static const char *const GPTOSS_20B =
    "{\"architectures\": [\"GptOssForCausalLM\"], \"attention_bias\": true, "
    "\"attention_dropout\": 0.0, \"eos_token_id\": 200002, \"experts_per_token\": 4, "
    "\"head_dim\": 64, \"hidden_act\": \"silu\", \"hidden_size\": 2880, "
    "\"initial_context_length\": 4096, \"initializer_range\": 0.02, "
    "\"intermediate_size\": 2880, \"layer_types\": [\"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\", "
    "\"sliding_attention\", \"full_attention\"], \"max_position_embeddings\": 131072, "
    "\"model_type\": \"gpt_oss\", \"num_attention_heads\": 64, \"num_experts_per_tok\": 4, "
    "\"num_hidden_layers\": 24, \"num_key_value_heads\": 8, \"num_local_experts\": 32, "
    "\"output_router_logits\": false, \"pad_token_id\": 199999, \"quantization_config\": "
    "{\"modules_to_not_convert\": [\"model.layers.*.self_attn\", \"model.layers.*.mlp.router\", "
    "\"model.embed_tokens\", \"lm_head\"], \"quant_method\": \"mxfp4\"}, \"rms_norm_eps\": 1e-05, "
    "\"rope_scaling\": {\"beta_fast\": 32.0, \"beta_slow\": 1.0, \"factor\": 32.0, "
    "\"original_max_position_embeddings\": 4096, \"rope_type\": \"yarn\", \"truncate\": false}, "
    "\"rope_theta\": 150000, \"router_aux_loss_coef\": 0.9, \"sliding_window\": 128, "
    "\"swiglu_limit\": 7.0, \"tie_word_embeddings\": false, \"use_cache\": true, "
    "\"vocab_size\": 201088}";

static void test_descriptions(const char *tests)
{
    struct model_desc d;
    char err[MS_ERR_LEN];
    int rc = golden_parse_patched(tests, "gpt_oss", NULL, &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(d.attn == ATTN_KIND_GQA && d.attn_sinks && d.qkv_bias && d.o_bias);
        CHECK(d.layer_window && model_layer_window(&d, 0) == 8 && model_layer_window(&d, 1) == 0 &&
              model_layer_window(&d, 2) == 8);
        CHECK(d.router == ROUTER_KIND_SOFTMAX_TOPK && d.norm_topk_prob && d.router_logit_bias &&
              !d.router_bias);
        CHECK(d.expert_act == FFN_ACT_SWIGLU_OAI && d.act_alpha == 1.702f &&
              d.act_limit == 1.2f && d.expert_bias);
        CHECK(d.rope_yarn && !d.yarn_truncate && !d.rope_interleave && d.yarn_factor == 4.0f &&
              d.yarn_orig_max_pos == 64 && d.rope_dim == 16);
        CHECK(fabs(d.rope_attn_factor - (0.1 * log(4.0) + 1.0)) < 1e-7);
        CHECK(fabs(d.attn_scale - 0.25) < 1e-7); /* head_dim 16 */
        model_desc_free(&d);
    }
    rc = model_desc_parse(GPTOSS_20B, strlen(GPTOSS_20B), "gpt-oss-20b/config.json", &d, err,
                          sizeof err);
    CHECKF(rc == 0, "gpt-oss-20b: %s", err);
    if (rc == 0) {
        bool alt = true;
        for (int l = 0; l < d.n_layer; l++)
            alt = alt && model_layer_window(&d, l) == (l % 2 == 0 ? 128 : 0);
        CHECK(alt && d.n_layer == 24 && d.n_expert == 32 && d.top_k == 4 && d.head_dim == 64);
        CHECK(d.n_head == 64 && d.n_kv_head == 8 && d.expert_d_ff[0] == 2880);
        CHECK(d.rope_theta == 150000.0f && d.yarn_factor == 32.0f && d.yarn_orig_max_pos == 4096 &&
              !d.yarn_truncate && d.act_limit == 7.0f && d.act_alpha == 1.702f);
        CHECK(d.n_eos == 1 && d.eos_ids[0] == 200002);
        /* GQA cache: 8 KV heads x 64 x (K + V) x 24 layers, f32 */
        CHECK(model_kv_bytes_per_token(&d) == (size_t)8 * 64 * 2 * 24 * 4);
        model_desc_free(&d);
    }
    /* layer_types absent: transformers' default, sliding on even layers */
    rc = golden_parse_patched(tests, "gpt_oss", "{\"layer_types\": null, \"sliding_window\": 5}",
                              &d, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(model_layer_window(&d, 0) == 5 && model_layer_window(&d, 1) == 0 &&
              model_layer_window(&d, 2) == 5);
        model_desc_free(&d);
    }

    static const struct {
        const char *model, *patch, *want1, *want2;
    } bad[] = {
        {"gpt_oss", "{\"quantization_config\": {\"quant_method\": \"fp8\"}}",
         "quantization_config.quant_method 'fp8'", "only 'mxfp4'"},
        {"deepseek_v3", "{\"quantization_config\": {\"quant_method\": \"mxfp4\"}}",
         "quantization_config.quant_method 'mxfp4'", "deepseek_v3"},
        {"gpt_oss",
         "{\"layer_types\": [\"sliding_attention\", \"chunked_attention\", \"full_attention\"]}",
         "layer_types[1] 'chunked_attention'", "not supported"},
        {"gpt_oss", "{\"layer_types\": [\"sliding_attention\", \"full_attention\"]}",
         "layer_types", "num_hidden_layers (3)"},
        {"gpt_oss", "{\"swiglu_limit\": 0}", "swiglu_limit 0", NULL},
        {"gpt_oss", "{\"hidden_act\": \"gelu\"}", "hidden_act 'gelu'", NULL},
        {"gpt_oss", "{\"rope_parameters\": {\"rope_type\": \"longrope\"}}", "'longrope'", NULL},
        {"gpt_oss", "{\"sliding_window\": -1}", "sliding_window", NULL},
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

static struct model *load(const char *tests, const char *name, enum model_dtype dt,
                          enum model_quant q)
{
    char dir[512], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.dtype = dt;
    lo.quant = q;
    struct model *m = NULL;
    CHECKF(model_load(dir, &lo, &m, err, sizeof err) == 0, "%s: %s", name, err);
    return m;
}

/* MXFP4 experts: kept as WTYPE_MXFP4 (4.25 bits a weight) unless --dtype asks for f32/bf16;
 * the unquantized layout loads as its own dtype; every layout counts the parameters
 * transformers counts (255524 for the fixture). */
static void test_loads(const char *tests)
{
    static const struct {
        const char *name;
        enum model_dtype dt;
        enum model_quant q;
        enum wtype want;
    } cases[] = {
        {"gpt_oss", MODEL_DTYPE_AUTO, MODEL_QUANT_NONE, WTYPE_MXFP4},
        {"gpt_oss", MODEL_DTYPE_F32, MODEL_QUANT_NONE, WTYPE_F32},
        {"gpt_oss_bf16", MODEL_DTYPE_BF16, MODEL_QUANT_NONE, WTYPE_BF16},
        {"gpt_oss_bf16", MODEL_DTYPE_AUTO, MODEL_QUANT_INT4, WTYPE_MXFP4},
        {"gpt_oss_dense", MODEL_DTYPE_AUTO, MODEL_QUANT_NONE, WTYPE_F32},
        {"gpt_oss_dense", MODEL_DTYPE_AUTO, MODEL_QUANT_INT8, WTYPE_Q8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct model *m = load(tests, cases[i].name, cases[i].dt, cases[i].q);
        if (!m) continue;
        const struct model_desc *d = &m->desc;
        bool ok = true;
        for (int l = 0; l < d->n_layer; l++)
            for (int e = 0; e < d->n_expert; e++) {
                const struct ffn_w *f = &m->layers[l].experts[e];
                ok = ok && f->gate->type == cases[i].want && f->up->type == cases[i].want &&
                     f->down->type == cases[i].want && f->b_gate && f->b_up && f->b_down;
                ok = ok && f->gate->rows == 32 && f->gate->cols == 64 && f->down->rows == 64;
            }
        CHECKF(ok, "%s case %zu: experts are not %s", cases[i].name, i,
               wtype_name(cases[i].want));
        CHECKF(m->n_params == 255524, "%s: %zu parameters", cases[i].name, m->n_params);
        if (cases[i].want == WTYPE_MXFP4 && cases[i].q == MODEL_QUANT_NONE) {
            /* 24 experts x (gate, up, down) of 32 x 64: 2 tiles x 2 blocks x 272 bytes each */
            size_t ex = (size_t)3 * 8 * 3 * 2 * 2 * WMX4_RECORD;
            CHECK(wtype_bytes(WTYPE_MXFP4, 32, 64) == 2 * 2 * WMX4_RECORD);
            CHECKF(m->converted_bytes >= ex && m->converted_bytes < ex + 64 * 3 * 8 * 3 + 4096,
                   "%s: %zu bytes converted", cases[i].name, m->converted_bytes);
        }
        model_free(m);
    }
}

/* A scale byte 0xFF (NaN in e8m0) is refused at load, naming the tensor. */
static void test_nan_scale(const char *tests)
{
    char tmp[] = "/tmp/moeserve_gptoss_XXXXXX", src[600], dst[600];
    if (!mkdtemp(tmp)) {
        CHECK(0);
        return;
    }
    static const char *files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(src, sizeof src, "%s/fixtures/models/gpt_oss/%s", tests, files[i]);
        snprintf(dst, sizeof dst, "%s/%s", tmp, files[i]);
        CHECK(golden_copy_file(src, dst) == 0);
    }
    /* the header says where layer 1's down_proj scales are */
    FILE *f = fopen(dst, "r+b");
    uint64_t hlen = 0;
    char *hdr = NULL;
    json_t *h = NULL;
    const char *name = "model.layers.1.mlp.experts.down_proj_scales";
    if (f && fread(&hlen, 8, 1, f) == 1 && hlen < (1u << 24) && (hdr = calloc(1, hlen + 1)) &&
        fread(hdr, 1, hlen, f) == hlen && (h = json_loads(hdr, 0, NULL))) {
        json_t *off = json_object_get(json_object_get(h, name), "data_offsets");
        long at = (long)(8 + hlen + json_integer_value(json_array_get(off, 0)) + 5);
        unsigned char ff = 0xFF;
        CHECK(off && fseek(f, at, SEEK_SET) == 0 && fwrite(&ff, 1, 1, f) == 1);
    } else {
        CHECK(0);
    }
    if (f) fclose(f);
    json_decref(h);
    free(hdr);
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    struct model *m = NULL;
    char err[MS_ERR_LEN] = "";
    int rc = model_load(tmp, &lo, &m, err, sizeof err);
    CHECKF(rc == -1 && strstr(err, name) && strstr(err, "NaN") && strstr(err, "byte 5"), "%s",
           err);
    model_free(m);
    for (int i = 0; i < 2; i++) {
        snprintf(dst, sizeof dst, "%s/%s", tmp, files[i]);
        unlink(dst);
    }
    rmdir(tmp);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    test_descriptions(tests);
    test_loads(tests);
    test_nan_scale(tests);
    return test_done("test_gptoss");
}
