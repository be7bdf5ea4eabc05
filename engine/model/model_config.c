/* config.json -> struct model_desc. Each supported Hugging Face architecture (mixtral,
 * qwen2_moe, qwen3_moe, olmoe, deepseek_v2/v3, glm4_moe, minimax_m2, gpt_oss, the hybrid
 * qwen3_next, qwen3_5_moe and granitemoehybrid, and moeserve's own mohge and infmoe) is
 * translated into the one architecture-neutral description the forward
 * pass reads: attention kind and q/k norm, biases, rotary width, which layers are MoE, expert
 * widths and groups, shared experts and their gate. Fields are type-checked; anything the engine
 * cannot run exactly (rope scaling other than YaRN, sliding-window layer mixes, activations
 * other than SiLU, unknown routing methods) is refused with a message naming the field rather
 * than run approximately. generation_config.json may override the BOS/EOS ids
 * (model_desc_apply_generation_config). */
#include "model.h"

#include "common.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Reads an integer field. Missing or null -> *out = def, unless `required`. */
static int cfg_int(json_t *root, const char *key, bool required, int def, int *out,
                   const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        if (required) return ms_errf(err, errlen, "%s: missing '%s'", path, key);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v)) return ms_errf(err, errlen, "%s: '%s' must be an integer", path, key);
    json_int_t x = json_integer_value(v);
    if (x < -2147483647 || x > 2147483647)
        return ms_errf(err, errlen, "%s: '%s' = %lld is out of range", path, key, (long long)x);
    *out = (int)x;
    return 0;
}

static int cfg_num(json_t *root, const char *key, double def, double *out, const char *path,
                   char *err, size_t errlen)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_number(v)) return ms_errf(err, errlen, "%s: '%s' must be a number", path, key);
    *out = json_number_value(v);
    return 0;
}

static int cfg_bool(json_t *root, const char *key, bool def, bool *out, const char *path, char *err,
                    size_t errlen)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return ms_errf(err, errlen, "%s: '%s' must be true or false", path, key);
    *out = json_is_true(v);
    return 0;
}

/* Positive-integer check shared by the shape fields. */
static int cfg_positive(int v, const char *key, const char *path, char *err, size_t errlen)
{
    if (v <= 0) return ms_errf(err, errlen, "%s: '%s' = %d must be positive", path, key, v);
    return 0;
}

/* bos_token_id / eos_token_id: null, an integer, or (eos) a list of integers. */
static int cfg_special_ids(json_t *root, struct model_desc *d, const char *path, char *err,
                           size_t errlen)
{
    json_t *b = json_object_get(root, "bos_token_id");
    if (b && !json_is_null(b)) {
        if (!json_is_integer(b) || json_integer_value(b) < 0 || json_integer_value(b) > INT32_MAX)
            return ms_errf(err, errlen, "%s: 'bos_token_id' must be a non-negative integer", path);
        d->bos_id = (int32_t)json_integer_value(b);
    }
    json_t *e = json_object_get(root, "eos_token_id");
    if (!e || json_is_null(e)) return 0;
    if (json_is_integer(e)) {
        if (json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX)
            return ms_errf(err, errlen, "%s: 'eos_token_id' must be a non-negative integer", path);
        d->eos_ids[0] = (int32_t)json_integer_value(e);
        d->n_eos = 1;
        return 0;
    }
    if (!json_is_array(e))
        return ms_errf(err, errlen, "%s: 'eos_token_id' must be an integer or a list of integers",
                       path);
    if (json_array_size(e) > MODEL_MAX_EOS)
        return ms_errf(err, errlen, "%s: 'eos_token_id' lists %zu ids (at most %d supported)", path,
                       json_array_size(e), MODEL_MAX_EOS);
    size_t i;
    json_t *x;
    d->n_eos = 0;
    json_array_foreach(e, i, x)
    {
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX)
            return ms_errf(err, errlen, "%s: eos_token_id[%zu] must be a non-negative integer",
                           path, i);
        d->eos_ids[d->n_eos++] = (int32_t)json_integer_value(x);
    }
    return 0;
}

/* A number field of a rope-scaling object that must be positive when present. */
static int cfg_pos_num(json_t *obj, const char *key, double def, double *out, const char *path,
                       char *err, size_t errlen)
{
    if (cfg_num(obj, key, def, out, path, err, errlen) != 0) return -1;
    if (!(*out > 0))
        return ms_errf(err, errlen, "%s: rope scaling '%s' = %g must be positive", path, key, *out);
    return 0;
}

/* YaRN's parameters from a rope_parameters / rope_scaling object (transformers'
 * _compute_yarn_parameters): factor, original_max_position_embeddings, beta_fast/slow, and the
 * attention factor (given, or from factor with mscale / mscale_all_dim). *mscale_all_dim is
 * returned for MLA's softmax scale. */
static int cfg_yarn(json_t *rs, struct model_desc *d, double *mscale_all_dim, const char *path,
                    char *err, size_t errlen)
{
    double factor = 0, beta_fast = 0, beta_slow = 0, mscale = 0, attn = 0, prf = 1.0;
    int orig = 0;
    if (cfg_int(rs, "original_max_position_embeddings", true, 0, &orig, path, err, errlen) ||
        cfg_positive(orig, "original_max_position_embeddings", path, err, errlen) ||
        cfg_num(rs, "factor", 0, &factor, path, err, errlen) ||
        cfg_num(rs, "beta_fast", 0, &beta_fast, path, err, errlen) ||
        cfg_num(rs, "beta_slow", 0, &beta_slow, path, err, errlen) ||
        cfg_num(rs, "mscale", 0, &mscale, path, err, errlen) ||
        cfg_num(rs, "mscale_all_dim", 0, mscale_all_dim, path, err, errlen) ||
        cfg_num(rs, "attention_factor", 0, &attn, path, err, errlen) ||
        cfg_num(rs, "partial_rotary_factor", 1.0, &prf, path, err, errlen) ||
        cfg_bool(rs, "truncate", true, &d->yarn_truncate, path, err, errlen))
        return -1;
    if (prf != 1.0)
        return ms_errf(err, errlen, "%s: rope scaling 'partial_rotary_factor' = %g is not supported",
                       path, prf);
    if (factor == 0) factor = (double)d->max_pos / orig; /* as transformers when it is null */
    if (!(factor > 0))
        return ms_errf(err, errlen, "%s: rope scaling 'factor' = %g must be positive", path, factor);
    /* transformers reads `beta_fast or 32`: 0 and absent both mean the default */
    if (beta_fast == 0) beta_fast = 32;
    if (beta_slow == 0) beta_slow = 1;
    if (!(beta_fast > 0) || !(beta_slow > 0))
        return ms_errf(err, errlen, "%s: rope scaling beta_fast / beta_slow must be positive", path);
    if (attn == 0) {
        /* get_mscale(s, m) = 1 for s <= 1, else 0.1 m ln(s) + 1 */
        double g1 = factor <= 1 ? 1.0 : 0.1 * log(factor) + 1.0;
        if (mscale != 0 && *mscale_all_dim != 0) {
            double a = factor <= 1 ? 1.0 : 0.1 * mscale * log(factor) + 1.0;
            double b = factor <= 1 ? 1.0 : 0.1 * *mscale_all_dim * log(factor) + 1.0;
            attn = a / b;
        } else {
            attn = g1;
        }
    } else if (cfg_pos_num(rs, "attention_factor", 1, &attn, path, err, errlen) != 0) {
        return -1;
    }
    d->rope_yarn = true;
    d->yarn_mscale_all_dim = (float)*mscale_all_dim;
    d->yarn_factor = (float)factor;
    d->yarn_beta_fast = (float)beta_fast;
    d->yarn_beta_slow = (float)beta_slow;
    d->yarn_orig_max_pos = orig;
    d->rope_attn_factor = (float)attn;
    return 0;
}

/* Llama 3's RoPE scaling (rope_type llama3: Llama 3.1+, Llama 4). */
static int cfg_llama3_rope(json_t *rs, struct model_desc *d, const char *path, char *err,
                           size_t errlen)
{
    double factor = 0, lo = 1.0, hi = 4.0;
    int orig = 0;
    if (cfg_num(rs, "factor", 0, &factor, path, err, errlen) ||
        cfg_num(rs, "low_freq_factor", 1.0, &lo, path, err, errlen) ||
        cfg_num(rs, "high_freq_factor", 4.0, &hi, path, err, errlen) ||
        cfg_int(rs, "original_max_position_embeddings", true, 0, &orig, path, err, errlen) ||
        cfg_positive(orig, "original_max_position_embeddings", path, err, errlen))
        return -1;
    if (!(factor > 0) || !(lo > 0) || !(hi > lo))
        return ms_errf(err, errlen,
                       "%s: llama3 rope scaling needs factor > 0 and high_freq_factor > "
                       "low_freq_factor > 0",
                       path);
    d->rope_llama3 = true;
    d->llama3_factor = (float)factor;
    d->llama3_low = (float)lo;
    d->llama3_high = (float)hi;
    d->llama3_orig_max_pos = orig;
    return 0;
}

/* The rope: plain RoPE, YaRN or Llama 3's scaling (rope_parameters / legacy rope_scaling of
 * type 'yarn' / 'llama3'); reads theta. Other scaling types are refused by name. */
static int cfg_rope(json_t *root, struct model_desc *d, double *mscale_all_dim, const char *path,
                    char *err, size_t errlen)
{
    double theta = 10000.0;
    *mscale_all_dim = 0;
    d->rope_attn_factor = 1.0f;
    if (cfg_num(root, "rope_theta", theta, &theta, path, err, errlen) != 0) return -1;
    const char *keys[2] = {"rope_parameters", "rope_scaling"};
    for (int i = 0; i < 2; i++) {
        json_t *rp = json_object_get(root, keys[i]);
        if (!rp || json_is_null(rp)) continue;
        if (!json_is_object(rp))
            return ms_errf(err, errlen, "%s: '%s' must be an object", path, keys[i]);
        json_t *ty = json_object_get(rp, "rope_type");
        if (!ty) ty = json_object_get(rp, "type");
        const char *tn = json_is_string(ty) ? json_string_value(ty) : NULL;
        if (ty && !json_is_null(ty) && !tn)
            return ms_errf(err, errlen, "%s: %s.rope_type must be a string", path, keys[i]);
        if (tn && strcmp(tn, "yarn") == 0) {
            if (cfg_yarn(rp, d, mscale_all_dim, path, err, errlen) != 0) return -1;
        } else if (tn && strcmp(tn, "llama3") == 0) {
            if (cfg_llama3_rope(rp, d, path, err, errlen) != 0) return -1;
        } else if (tn && strcmp(tn, "default") != 0) {
            return ms_errf(err, errlen,
                           "%s: %s.rope_type '%.32s' is not supported (only 'default', 'yarn' or "
                           "'llama3')",
                           path, keys[i], tn);
        } else if (!tn && i == 1) {
            return ms_errf(err, errlen, "%s: rope_scaling without a type is not supported", path);
        }
        if (cfg_num(rp, "rope_theta", theta, &theta, path, err, errlen) != 0) return -1;
    }
    if (!(theta > 0))
        return ms_errf(err, errlen, "%s: rope theta %g must be positive", path, theta);
    d->rope_theta = (float)theta;
    return 0;
}

/* Fields every supported architecture shares. */
static int cfg_common(json_t *root, struct model_desc *d, const char *path, char *err,
                      size_t errlen)
{
    if (cfg_int(root, "num_hidden_layers", true, 0, &d->n_layer, path, err, errlen) ||
        cfg_positive(d->n_layer, "num_hidden_layers", path, err, errlen))
        return -1;
    if (d->n_layer > MODEL_MAX_LAYERS)
        return ms_errf(err, errlen, "%s: num_hidden_layers %d is more than %d", path, d->n_layer,
                       MODEL_MAX_LAYERS);
    if (cfg_int(root, "hidden_size", true, 0, &d->d_model, path, err, errlen) ||
        cfg_positive(d->d_model, "hidden_size", path, err, errlen) ||
        cfg_int(root, "vocab_size", true, 0, &d->vocab, path, err, errlen) ||
        cfg_positive(d->vocab, "vocab_size", path, err, errlen) ||
        cfg_int(root, "num_attention_heads", true, 0, &d->n_head, path, err, errlen) ||
        cfg_positive(d->n_head, "num_attention_heads", path, err, errlen) ||
        cfg_int(root, "num_key_value_heads", false, d->n_head, &d->n_kv_head, path, err, errlen) ||
        cfg_positive(d->n_kv_head, "num_key_value_heads", path, err, errlen) ||
        cfg_int(root, "max_position_embeddings", false, 4096, &d->max_pos, path, err, errlen) ||
        cfg_positive(d->max_pos, "max_position_embeddings", path, err, errlen))
        return -1;
    if (d->n_head % d->n_kv_head != 0)
        return ms_errf(err, errlen,
                       "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       path, d->n_head, d->n_kv_head);
    if (cfg_int(root, "head_dim", false, 0, &d->head_dim, path, err, errlen) != 0) return -1;
    if (d->head_dim == 0) {
        if (d->d_model % d->n_head != 0)
            return ms_errf(err, errlen,
                           "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
                           d->d_model, d->n_head);
        d->head_dim = d->d_model / d->n_head;
    }
    if (cfg_positive(d->head_dim, "head_dim", path, err, errlen) != 0) return -1;
    if (d->head_dim % 2 != 0)
        return ms_errf(err, errlen, "%s: head_dim %d must be even for RoPE", path, d->head_dim);
    double eps = 0.0;
    if (cfg_num(root, "rms_norm_eps", 1e-6, &eps, path, err, errlen) != 0) return -1;
    if (!(eps > 0)) return ms_errf(err, errlen, "%s: rms_norm_eps must be positive", path);
    d->rms_eps = (float)eps;
    double mscale_all_dim;
    if (cfg_rope(root, d, &mscale_all_dim, path, err, errlen) != 0) return -1;
    d->rope_dim = d->head_dim;
    d->attn_scale = 1.0f / sqrtf((float)d->head_dim);
    d->routed_scale = 1.0f;
    d->embed_scale = d->residual_scale = d->logit_scale = 1.0f;
    json_t *act = json_object_get(root, "hidden_act");
    if (act && !json_is_null(act) &&
        (!json_is_string(act) || strcmp(json_string_value(act), "silu") != 0))
        return ms_errf(err, errlen, "%s: hidden_act '%s' is not supported (only 'silu')", path,
                       json_is_string(act) ? json_string_value(act) : "?");
    if (cfg_bool(root, "tie_word_embeddings", false, &d->tie_embeddings, path, err, errlen) != 0)
        return -1;
    d->attn = ATTN_KIND_GQA;
    d->router = ROUTER_KIND_SOFTMAX_TOPK;
    d->bos_id = -1;
    d->n_eos = 0;
    return cfg_special_ids(root, d, path, err, errlen);
}

/* Routed experts: count (under either HF name), top-k, one width for all. */
static int cfg_experts(json_t *root, struct model_desc *d, const char *width_key, const char *path,
                       char *err, size_t errlen)
{
    const char *ekey = json_object_get(root, "num_experts") ? "num_experts" : "num_local_experts";
    int width;
    if (cfg_int(root, ekey, true, 0, &d->n_expert, path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", true, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, width_key, true, 0, &width, path, err, errlen) ||
        cfg_positive(width, width_key, path, err, errlen))
        return -1;
    if (d->n_expert < 0 || d->n_expert > MODEL_MAX_EXPERTS)
        return ms_errf(err, errlen, "%s: '%s' = %d is out of range (0..%d)", path, ekey,
                       d->n_expert, MODEL_MAX_EXPERTS);
    if (d->n_expert > 0 && (d->top_k <= 0 || d->top_k > d->n_expert))
        return ms_errf(err, errlen, "%s: num_experts_per_tok %d must be in 1..%s (%d)", path,
                       d->top_k, ekey, d->n_expert);
    if (d->n_expert > 0) {
        d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
        if (!d->expert_d_ff) return ms_errf(err, errlen, "%s: out of memory", path);
        for (int e = 0; e < d->n_expert; e++)
            d->expert_d_ff[e] = width;
    }
    return 0;
}

/* layer_is_moe: all layers, or the qwen rule (decoder_sparse_step, mlp_only_layers). */
static int cfg_moe_layers(json_t *root, struct model_desc *d, bool qwen_rule, const char *path,
                          char *err, size_t errlen)
{
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    int step = 1;
    if (qwen_rule) {
        if (cfg_int(root, "decoder_sparse_step", false, 1, &step, path, err, errlen) != 0)
            return -1;
        if (step <= 0)
            return ms_errf(err, errlen, "%s: 'decoder_sparse_step' = %d must be positive", path,
                           step);
    }
    for (int l = 0; l < d->n_layer; l++)
        d->layer_is_moe[l] = d->n_expert > 0 && (l + 1) % step == 0;
    json_t *only = qwen_rule ? json_object_get(root, "mlp_only_layers") : NULL;
    if (only && !json_is_null(only)) {
        if (!json_is_array(only))
            return ms_errf(err, errlen, "%s: 'mlp_only_layers' must be a list of integers", path);
        size_t i;
        json_t *x;
        json_array_foreach(only, i, x)
        {
            if (!json_is_integer(x))
                return ms_errf(err, errlen, "%s: mlp_only_layers[%zu] must be an integer", path, i);
            json_int_t l = json_integer_value(x);
            if (l >= 0 && l < d->n_layer) d->layer_is_moe[l] = false;
        }
    }
    bool any_dense = false;
    for (int l = 0; l < d->n_layer; l++)
        any_dense |= !d->layer_is_moe[l];
    if (any_dense) {
        if (cfg_int(root, "intermediate_size", true, 0, &d->dense_d_ff, path, err, errlen) ||
            cfg_positive(d->dense_d_ff, "intermediate_size", path, err, errlen))
            return -1;
    }
    return 0;
}

/* qwen2/qwen3: sliding windows come with per-layer rules the engine does not model yet. */
static int cfg_no_qwen_window(json_t *root, const char *path, char *err, size_t errlen)
{
    bool use = false;
    if (cfg_bool(root, "use_sliding_window", false, &use, path, err, errlen) != 0) return -1;
    if (use) return ms_errf(err, errlen, "%s: use_sliding_window true is not supported yet", path);
    return 0;
}

static int cfg_mixtral(json_t *root, struct model_desc *d, const char *path, char *err,
                       size_t errlen)
{
    if (cfg_experts(root, d, "intermediate_size", path, err, errlen) != 0) return -1;
    if (d->n_expert == 0)
        return ms_errf(err, errlen, "%s: mixtral needs num_local_experts > 0", path);
    if (cfg_moe_layers(root, d, false, path, err, errlen) != 0) return -1;
    if (cfg_int(root, "sliding_window", false, 0, &d->sliding_window, path, err, errlen) != 0)
        return -1;
    if (d->sliding_window < 0)
        return ms_errf(err, errlen, "%s: 'sliding_window' must be null or positive", path);
    d->norm_topk_prob = true; /* Mixtral always renormalizes its top-k weights */
    return 0;
}

/* The shared expert behind a sigmoid gate (shared_expert_intermediate_size; 0: none). */
static int cfg_gated_shared(json_t *root, struct model_desc *d, const char *path, char *err,
                            size_t errlen)
{
    if (cfg_int(root, "shared_expert_intermediate_size", false, 0, &d->shared_d_ff, path, err,
                errlen))
        return -1;
    if (d->shared_d_ff < 0)
        return ms_errf(err, errlen, "%s: 'shared_expert_intermediate_size' must not be negative",
                       path);
    if (d->shared_d_ff > 0) {
        d->n_shared = 1;
        d->shared_gate = SHARED_GATE_SIGMOID;
    }
    return 0;
}

static int cfg_qwen2_moe(json_t *root, struct model_desc *d, const char *path, char *err,
                         size_t errlen)
{
    if (cfg_experts(root, d, "moe_intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, true, path, err, errlen) ||
        cfg_no_qwen_window(root, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", false, &d->norm_topk_prob, path, err, errlen) ||
        cfg_bool(root, "qkv_bias", true, &d->qkv_bias, path, err, errlen) ||
        cfg_gated_shared(root, d, path, err, errlen))
        return -1;
    return 0;
}

static int cfg_qwen3_moe(json_t *root, struct model_desc *d, const char *path, char *err,
                         size_t errlen)
{
    if (cfg_experts(root, d, "moe_intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, true, path, err, errlen) ||
        cfg_no_qwen_window(root, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", false, &d->norm_topk_prob, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &d->qkv_bias, path, err, errlen))
        return -1;
    d->qk_norm = QK_NORM_HEAD;
    return 0;
}

static int cfg_olmoe(json_t *root, struct model_desc *d, const char *path, char *err, size_t errlen)
{
    double clip = 0.0;
    if (cfg_experts(root, d, "intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, false, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", false, &d->norm_topk_prob, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &d->qkv_bias, path, err, errlen) ||
        cfg_num(root, "clip_qkv", 0.0, &clip, path, err, errlen))
        return -1;
    if (clip < 0) return ms_errf(err, errlen, "%s: 'clip_qkv' must be null or positive", path);
    d->clip_qkv = (float)clip;
    d->qk_norm = QK_NORM_FULL;
    return 0;
}

/* Reads a list of positive integers of exactly n entries into out. */
static int cfg_int_list(json_t *root, const char *key, int n, int *out, const char *path,
                        char *err, size_t errlen)
{
    json_t *v = json_object_get(root, key);
    if (!json_is_array(v))
        return ms_errf(err, errlen, "%s: missing '%s' (a list of integers)", path, key);
    if ((int)json_array_size(v) != n)
        return ms_errf(err, errlen, "%s: '%s' has %zu entries, expected %d", path, key,
                       json_array_size(v), n);
    for (int i = 0; i < n; i++) {
        json_t *x = json_array_get(v, (size_t)i);
        if (!json_is_integer(x) || json_integer_value(x) <= 0 ||
            json_integer_value(x) > 2147483647)
            return ms_errf(err, errlen, "%s: %s[%d] must be a positive integer", path, key, i);
        out[i] = (int)json_integer_value(x);
    }
    return 0;
}

static int cfg_mtp(json_t *root, struct model_desc *d, const char *path, char *err,
                   size_t errlen);

/* moeserve's MoHGE model (tools/train/mohge_model.py; fields in README, "The mohge
 * config.json"): G groups of experts_per_group experts, expert e in group e / experts_per_group
 * with width group_intermediate_sizes[group], a two-level router keeping num_groups_per_tok
 * groups and num_experts_per_tok experts, and always-on shared experts of weight 1. */
static int cfg_mohge(json_t *root, struct model_desc *d, const char *path, char *err,
                     size_t errlen)
{
    int G, epg, widths[MODEL_MAX_GROUPS];
    if (cfg_int(root, "num_expert_groups", true, 0, &G, path, err, errlen) ||
        cfg_positive(G, "num_expert_groups", path, err, errlen) ||
        cfg_int(root, "experts_per_group", true, 0, &epg, path, err, errlen) ||
        cfg_positive(epg, "experts_per_group", path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", true, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, "num_groups_per_tok", true, 0, &d->topk_group, path, err, errlen) ||
        cfg_int(root, "num_shared_experts", false, 0, &d->n_shared, path, err, errlen) ||
        cfg_int(root, "shared_intermediate_size", false, 0, &d->shared_d_ff, path, err, errlen))
        return -1;
    if (G > MODEL_MAX_GROUPS)
        return ms_errf(err, errlen, "%s: num_expert_groups %d exceeds %d", path, G,
                       MODEL_MAX_GROUPS);
    if ((long)G * epg > MODEL_MAX_EXPERTS)
        return ms_errf(err, errlen, "%s: %d groups x %d experts exceeds %d experts", path, G, epg,
                       MODEL_MAX_EXPERTS);
    if (cfg_int_list(root, "group_intermediate_sizes", G, widths, path, err, errlen) != 0)
        return -1;
    if (d->topk_group < 1 || d->topk_group > G)
        return ms_errf(err, errlen,
                       "%s: num_groups_per_tok %d must be in 1..num_expert_groups (%d)", path,
                       d->topk_group, G);
    if (d->top_k < 1 || d->top_k > d->topk_group * epg)
        return ms_errf(err, errlen,
                       "%s: num_experts_per_tok %d must be in 1..num_groups_per_tok x "
                       "experts_per_group (%d)",
                       path, d->top_k, d->topk_group * epg);
    if (d->n_shared < 0 || d->n_shared > 64)
        return ms_errf(err, errlen, "%s: num_shared_experts %d must be in 0..64", path,
                       d->n_shared);
    if (d->n_shared > 0 && d->shared_d_ff <= 0)
        return ms_errf(err, errlen, "%s: shared_intermediate_size must be positive", path);
    /* an MTP module (tools/train/train_mtp.py): DeepSeek-V3's layout with a dense block of
     * mtp_intermediate_size */
    if (cfg_mtp(root, d, path, err, errlen) ||
        cfg_int(root, "mtp_intermediate_size", d->n_mtp_layers > 0, 0, &d->dense_d_ff, path, err,
                errlen))
        return -1;
    if (d->n_mtp_layers > 0 && d->dense_d_ff <= 0)
        return ms_errf(err, errlen, "%s: mtp_intermediate_size must be positive", path);
    d->n_group = G;
    d->n_expert = G * epg;
    d->router = ROUTER_KIND_MOHGE;
    d->shared_gate = SHARED_GATE_NONE;
    d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
    d->expert_group = malloc((size_t)d->n_expert * sizeof *d->expert_group);
    if (!d->expert_d_ff || !d->expert_group) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int e = 0; e < d->n_expert; e++) {
        d->expert_group[e] = e / epg;
        d->expert_d_ff[e] = widths[e / epg];
    }
    return cfg_moe_layers(root, d, false, path, err, errlen);
}

/* moeserve's continuous-experts model (tools/train/infmoe_model.py; fields in README, "The
 * infmoe config.json"): no routed experts; every layer's FFN is one SwiGLU of
 * intermediate_size neurons run on a per-token selection (FFN_KIND_CONTINUOUS). */
static int cfg_infmoe(json_t *root, struct model_desc *d, const char *path, char *err,
                      size_t errlen)
{
    double frac = 0;
    if (cfg_int(root, "intermediate_size", true, 0, &d->cont_d_ff, path, err, errlen) ||
        cfg_positive(d->cont_d_ff, "intermediate_size", path, err, errlen) ||
        cfg_int(root, "latent_dim", true, 0, &d->cont_z, path, err, errlen) ||
        cfg_positive(d->cont_z, "latent_dim", path, err, errlen) ||
        cfg_int(root, "num_samples", true, 0, &d->cont_samples, path, err, errlen) ||
        cfg_int(root, "max_samples", false, d->cont_samples, &d->cont_max_samples, path, err,
                errlen) ||
        cfg_num(root, "neuron_fraction", 0, &frac, path, err, errlen))
        return -1;
    if (d->cont_z > 4096)
        return ms_errf(err, errlen, "%s: latent_dim %d exceeds 4096", path, d->cont_z);
    if (d->cont_max_samples < 1 || d->cont_max_samples > 64)
        return ms_errf(err, errlen, "%s: max_samples %d must be in 1..64", path,
                       d->cont_max_samples);
    if (d->cont_samples < 1 || d->cont_samples > d->cont_max_samples)
        return ms_errf(err, errlen, "%s: num_samples %d must be in 1..max_samples (%d)", path,
                       d->cont_samples, d->cont_max_samples);
    if (!(frac > 0 && frac <= 1))
        return ms_errf(err, errlen, "%s: neuron_fraction %g must be in (0, 1]", path, frac);
    d->cont_fraction = frac;
    d->ffn = FFN_KIND_CONTINUOUS;
    json_t *cal = json_object_get(root, "adaptive_logvar_quantiles");
    if (cal && !json_is_null(cal)) {
        size_t nq = json_is_array(json_array_get(cal, 0)) ? json_array_size(json_array_get(cal, 0))
                                                          : 0;
        if (!json_is_array(cal) || json_array_size(cal) != (size_t)d->n_layer || nq < 2 ||
            nq > 1024)
            return ms_errf(err, errlen,
                           "%s: 'adaptive_logvar_quantiles' must list num_hidden_layers (%d) lists "
                           "of 2..1024 numbers",
                           path, d->n_layer);
        d->cont_quant = malloc(sizeof(double) * nq * (size_t)d->n_layer);
        if (!d->cont_quant) return ms_errf(err, errlen, "%s: out of memory", path);
        d->cont_n_quant = (int)nq;
        for (int l = 0; l < d->n_layer; l++) {
            json_t *row = json_array_get(cal, (size_t)l);
            if (!json_is_array(row) || json_array_size(row) != nq)
                return ms_errf(err, errlen,
                               "%s: adaptive_logvar_quantiles[%d] must list %zu numbers", path, l,
                               nq);
            for (size_t i = 0; i < nq; i++) {
                json_t *x = json_array_get(row, i);
                double v = json_is_number(x) ? json_number_value(x) : NAN;
                double *q = d->cont_quant + (size_t)l * nq;
                if (!isfinite(v) || (i > 0 && v < q[i - 1]))
                    return ms_errf(err, errlen,
                                   "%s: adaptive_logvar_quantiles[%d][%zu] must be a number, not "
                                   "below the one before",
                                   path, l, i);
                q[i] = v;
            }
        }
    }
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    return 0;
}

/* A string field that must be one of `allowed` (NULL-terminated); *out = its index, or `def`
 * when absent or null. */
static int cfg_choice(json_t *root, const char *key, const char *const *allowed, int def, int *out,
                      const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, key);
    *out = def;
    if (!v || json_is_null(v)) return 0;
    const char *s = json_string_value(v);
    if (!s) return ms_errf(err, errlen, "%s: '%s' must be a string", path, key);
    for (int i = 0; allowed[i]; i++)
        if (strcmp(s, allowed[i]) == 0) {
            *out = i;
            return 0;
        }
    char list[160] = "";
    for (int i = 0; allowed[i]; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s'%s'", i ? ", " : "",
                 allowed[i]);
    return ms_errf(err, errlen, "%s: %s '%.64s' is not supported (supported: %s)", path, key, s,
                   list);
}

/* Group-limited routing (DeepSeek / GLM n_group, topk_group): the groups must split the
 * experts evenly and the kept groups must hold at least top_k experts. */
static int cfg_groups(const struct model_desc *d, const char *path, char *err, size_t errlen)
{
    if (d->n_group <= 0 || d->n_group > MODEL_MAX_GROUPS || d->n_expert % d->n_group != 0)
        return ms_errf(err, errlen,
                       "%s: n_group %d must divide n_routed_experts (%d) and be in 1..%d", path,
                       d->n_group, d->n_expert, MODEL_MAX_GROUPS);
    if (d->topk_group <= 0 || d->topk_group > d->n_group ||
        d->topk_group * (d->n_expert / d->n_group) < d->top_k)
        return ms_errf(err, errlen,
                       "%s: topk_group %d must be in 1..n_group (%d) and keep at least "
                       "num_experts_per_tok experts",
                       path, d->topk_group, d->n_group);
    return 0;
}

/* Multi-token-prediction layers after the decoder (num_nextn_predict_layers): skipped at load. */
static int cfg_mtp(json_t *root, struct model_desc *d, const char *path, char *err, size_t errlen)
{
    if (cfg_int(root, "num_nextn_predict_layers", false, 0, &d->n_mtp_layers, path, err, errlen))
        return -1;
    if (d->n_mtp_layers < 0 || d->n_mtp_layers > 64)
        return ms_errf(err, errlen, "%s: num_nextn_predict_layers %d must be in 0..64", path,
                       d->n_mtp_layers);
    return 0;
}

/* DeepSeek-V2 / V2-Lite / V3 / R1 (transformers' DeepseekV2/V3 classes): multi-head latent
 * attention with interleaved rope on the qk_rope_head_dim part, YaRN with mscale in the softmax
 * scale; the first first_k_dense_replace layers dense (then every moe_layer_freq-th MoE), one
 * always-on shared FFN of n_shared_experts x moe_intermediate_size under "shared_experts.";
 * routing: V2 softmax greedy or group_limited_greedy, V3 noaux_tc (sigmoid + correction bias,
 * groups ranked by their two best), weights times routed_scaling_factor. */
/* DeepSeek-style FFN tail shared by deepseek_v2/v3 and glm4_moe: the dense layers' width
 * (intermediate_size, read only when some layer is dense) and n_shared shared experts of width
 * ff merged into one (shared_experts.*, no gate). */
static int cfg_dense_shared(json_t *root, struct model_desc *d, bool any_dense, int ff,
                            int n_shared, const char *path, char *err, size_t errlen)
{
    if (any_dense && (cfg_int(root, "intermediate_size", true, 0, &d->dense_d_ff, path, err,
                              errlen) ||
                      cfg_positive(d->dense_d_ff, "intermediate_size", path, err, errlen)))
        return -1;
    if (n_shared > 0) {
        d->n_shared = 1;
        d->shared_d_ff = ff * n_shared;
        d->shared_merged = true;
    }
    d->shared_gate = SHARED_GATE_NONE;
    return 0;
}

/* A per-layer list of names under key (num_hidden_layers strings, each one of allowed, which
 * `supported` spells for the error); absent or null: 0 with *present false. Each layer's index
 * into allowed goes to out (n_layer). */
static int cfg_layer_names(json_t *root, const char *key, const char *const *allowed,
                           const char *supported, struct model_desc *d, int *out, bool *present,
                           const char *path, char *err, size_t errlen)
{
    json_t *lt = json_object_get(root, key);
    *present = lt && !json_is_null(lt);
    if (!*present) return 0;
    if (!json_is_array(lt) || (int)json_array_size(lt) != d->n_layer)
        return ms_errf(err, errlen, "%s: '%s' must list num_hidden_layers (%d) strings", path, key,
                       d->n_layer);
    for (int l = 0; l < d->n_layer; l++) {
        const char *t = json_string_value(json_array_get(lt, (size_t)l));
        out[l] = -1;
        for (int i = 0; t && allowed[i]; i++)
            if (strcmp(t, allowed[i]) == 0) out[l] = i;
        if (out[l] < 0)
            return ms_errf(err, errlen, "%s: %s[%d] '%.40s' is not supported (supported: %s)",
                           path, key, l, t ? t : "(not a string)", supported);
    }
    return 0;
}

/* GLM-5's (glm_moe_dsa) sparse attention: the indexer rotates interleaved pairs, and layers
 * marked "shared" in indexer_types have no indexer and reuse the last "full" layer's selection.
 * Without indexer_types, transformers' defaults: index_topk_pattern ("F"/"S" per layer), else
 * full where max(l - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (offset 2, freq 1). */
static int cfg_dsa_glm(json_t *root, struct model_desc *d, int *kind, const char *path,
                       char *err, size_t errlen)
{
    static const char *const types[] = {"full", "shared", NULL};
    bool present;
    d->dsa_rope_interleave = true;
    if (cfg_layer_names(root, "indexer_types", types, "'full', 'shared'", d, kind, &present, path,
                        err, errlen) != 0)
        return -1;
    if (!present) {
        json_t *pat = json_object_get(root, "index_topk_pattern");
        const char *ps = json_string_value(pat);
        int freq = 1, offset = 2;
        if (pat && !json_is_null(pat)) {
            if (!ps || (int)strlen(ps) != d->n_layer)
                return ms_errf(err, errlen, "%s: index_topk_pattern must be a string of "
                                            "num_hidden_layers (%d) 'F'/'S' letters", path,
                               d->n_layer);
            for (int l = 0; l < d->n_layer; l++) {
                if (ps[l] != 'F' && ps[l] != 'S')
                    return ms_errf(err, errlen, "%s: index_topk_pattern[%d] '%c' is not 'F' or "
                                                "'S'", path, l, ps[l]);
                kind[l] = ps[l] == 'S';
            }
        } else {
            if (cfg_int(root, "index_topk_freq", false, 1, &freq, path, err, errlen) ||
                cfg_int(root, "index_skip_topk_offset", false, 2, &offset, path, err, errlen))
                return -1;
            if (freq < 1) freq = 1;
            for (int l = 0; l < d->n_layer; l++)
                kind[l] = (l - offset + 1 > 0 ? l - offset + 1 : 0) % freq != 0;
        }
    }
    if (kind[0] != 0)
        return ms_errf(err, errlen, "%s: layer 0 is 'shared' but no full indexer layer comes "
                                    "before it", path);
    d->dsa_shared = calloc((size_t)d->n_layer, sizeof *d->dsa_shared);
    if (!d->dsa_shared) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int l = 0; l < d->n_layer; l++) d->dsa_shared[l] = kind[l] == 1;
    return 0;
}

/* DeepSeek-V3.2's sparse attention (transformers' DeepseekV32 classes): index_topk,
 * index_n_heads, index_head_dim; every layer "indexed_attention" (layer_types), the MLP of each
 * "dense" or "sparse" (mlp_layer_types, which then decides over first_k_dense_replace). The
 * indexer needs the query LoRA (its queries come from q_a_layernorm's output). */
static int cfg_dsa(json_t *root, struct model_desc *d, const char *path, char *err,
                   size_t errlen)
{
    if (cfg_int(root, "index_topk", false, 2048, &d->dsa_topk, path, err, errlen) ||
        cfg_positive(d->dsa_topk, "index_topk", path, err, errlen) ||
        cfg_int(root, "index_n_heads", false, 64, &d->dsa_heads, path, err, errlen) ||
        cfg_positive(d->dsa_heads, "index_n_heads", path, err, errlen) ||
        cfg_int(root, "index_head_dim", false, 128, &d->dsa_dim, path, err, errlen) ||
        cfg_positive(d->dsa_dim, "index_head_dim", path, err, errlen))
        return -1;
    if (d->q_lora_rank <= 0)
        return ms_errf(err, errlen, "%s: %s needs q_lora_rank (the indexer reads the query "
                                    "latent)", path, d->model_type);
    if (d->dsa_dim < d->qk_rope_dim)
        return ms_errf(err, errlen, "%s: index_head_dim %d is narrower than qk_rope_head_dim %d",
                       path, d->dsa_dim, d->qk_rope_dim);
    static const char *const attn[] = {"indexed_attention", NULL};
    static const char *const mlp[] = {"dense", "sparse", NULL};
    int *kind = malloc(sizeof(int) * (size_t)d->n_layer);
    if (!kind) return ms_errf(err, errlen, "%s: out of memory", path);
    bool present;
    int rc = cfg_layer_names(root, "layer_types", attn, "'indexed_attention'", d, kind, &present,
                             path, err, errlen);
    if (rc == 0)
        rc = cfg_layer_names(root, "mlp_layer_types", mlp, "'dense', 'sparse'", d, kind,
                             &present, path, err, errlen);
    for (int l = 0; rc == 0 && present && l < d->n_layer; l++) d->layer_is_moe[l] = kind[l] == 1;
    if (rc == 0 && strcmp(d->model_type, "glm_moe_dsa") == 0) rc = cfg_dsa_glm(root, d, kind, path,
                                                                             err, errlen);
    free(kind);
    return rc;
}

static int cfg_deepseek(json_t *root, struct model_desc *d, const char *path, char *err,
                        size_t errlen)
{
    bool v32 = strcmp(d->model_type, "deepseek_v32") == 0 ||
               strcmp(d->model_type, "glm_moe_dsa") == 0;
    bool v3 = v32 || strcmp(d->model_type, "deepseek_v3") == 0;
    bool bias = false;
    int ff = 0, n_shared = 0, dense_k = 0, freq = 1;
    double rsf = 1.0;
    if (cfg_int(root, "q_lora_rank", false, 0, &d->q_lora_rank, path, err, errlen) ||
        cfg_int(root, "kv_lora_rank", true, 0, &d->kv_lora_rank, path, err, errlen) ||
        cfg_positive(d->kv_lora_rank, "kv_lora_rank", path, err, errlen) ||
        cfg_int(root, "qk_nope_head_dim", true, 0, &d->qk_nope_dim, path, err, errlen) ||
        cfg_int(root, "qk_rope_head_dim", true, 0, &d->qk_rope_dim, path, err, errlen) ||
        cfg_positive(d->qk_rope_dim, "qk_rope_head_dim", path, err, errlen) ||
        cfg_int(root, "v_head_dim", true, 0, &d->v_head_dim, path, err, errlen) ||
        cfg_positive(d->v_head_dim, "v_head_dim", path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &bias, path, err, errlen) ||
        cfg_int(root, "n_routed_experts", true, 0, &d->n_expert, path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", true, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, "moe_intermediate_size", true, 0, &ff, path, err, errlen) ||
        cfg_positive(ff, "moe_intermediate_size", path, err, errlen) ||
        cfg_int(root, "n_shared_experts", false, v3 ? 1 : 2, &n_shared, path, err, errlen) ||
        cfg_int(root, "first_k_dense_replace", false, v3 ? 3 : 0, &dense_k, path, err, errlen) ||
        cfg_int(root, "moe_layer_freq", false, 1, &freq, path, err, errlen) ||
        cfg_positive(freq, "moe_layer_freq", path, err, errlen) ||
        cfg_num(root, "routed_scaling_factor", v3 ? 2.5 : 1.0, &rsf, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", v3, &d->norm_topk_prob, path, err, errlen) ||
        cfg_int(root, "n_group", false, 0, &d->n_group, path, err, errlen) ||
        cfg_int(root, "topk_group", false, 0, &d->topk_group, path, err, errlen))
        return -1;
    if (d->q_lora_rank < 0 || d->qk_nope_dim < 0 || n_shared < 0 || dense_k < 0)
        return ms_errf(err, errlen, "%s: q_lora_rank, qk_nope_head_dim, n_shared_experts and "
                                    "first_k_dense_replace must not be negative",
                       path);
    if (bias) return ms_errf(err, errlen, "%s: attention_bias true is not supported", path);
    if (d->qk_rope_dim % 2 != 0)
        return ms_errf(err, errlen, "%s: qk_rope_head_dim %d must be even", path, d->qk_rope_dim);
    if (d->n_expert <= 0 || d->n_expert > MODEL_MAX_EXPERTS)
        return ms_errf(err, errlen, "%s: 'n_routed_experts' = %d is out of range (1..%d)", path,
                       d->n_expert, MODEL_MAX_EXPERTS);
    if (d->top_k <= 0 || d->top_k > d->n_expert)
        return ms_errf(err, errlen, "%s: num_experts_per_tok %d must be in 1..n_routed_experts (%d)",
                       path, d->top_k, d->n_expert);
    if (!(rsf > 0))
        return ms_errf(err, errlen, "%s: routed_scaling_factor %g must be positive", path, rsf);

    /* Routing. transformers' V3 router is always sigmoid + noaux_tc and its V2 router always
     * softmax: any other spelling would run something else than the reference, so it is
     * refused rather than ignored. */
    static const char *const v2_methods[] = {"greedy", "group_limited_greedy", NULL};
    static const char *const v3_methods[] = {"noaux_tc", NULL};
    static const char *const v2_scoring[] = {"softmax", NULL};
    static const char *const v3_scoring[] = {"sigmoid", NULL};
    int method, scoring;
    if (cfg_choice(root, "topk_method", v3 ? v3_methods : v2_methods, 0, &method, path, err,
                   errlen) ||
        cfg_choice(root, "scoring_func", v3 ? v3_scoring : v2_scoring, 0, &scoring, path, err,
                   errlen))
        return -1;
    bool grouped = v3 || method == 1;
    if (grouped) {
        if (cfg_groups(d, path, err, errlen) != 0) return -1;
    } else {
        d->n_group = d->topk_group = 0;
    }
    if (!v3 && d->norm_topk_prob)
        /* transformers' DeepseekV2 ignores it while DeepSeek's own code renormalizes (and then
         * skips routed_scaling_factor): two references disagree, so neither is guessed. */
        return ms_errf(err, errlen, "%s: norm_topk_prob true is not supported for deepseek_v2",
                       path);
    d->router = v3 ? ROUTER_KIND_SIGMOID_GROUP
                   : method == 1 ? ROUTER_KIND_SOFTMAX_GROUP : ROUTER_KIND_SOFTMAX_TOPK;
    d->router_bias = v3;
    d->routed_scale = (float)rsf;

    /* Attention geometry: the query/key width per head, one latent "KV head". */
    d->attn = ATTN_KIND_MLA;
    d->head_dim = d->qk_nope_dim + d->qk_rope_dim;
    d->n_kv_head = d->n_head;
    d->rope_dim = d->qk_rope_dim;
    d->rope_interleave = true; /* V2 rotates complex pairs; V3 unless rope_interleave false */
    if (v3 && cfg_bool(root, "rope_interleave", true, &d->rope_interleave, path, err, errlen) != 0)
        return -1;
    double scale = pow((double)d->head_dim, -0.5);
    if (d->rope_yarn && d->yarn_mscale_all_dim != 0 && d->yarn_factor > 1) {
        double m = 0.1 * d->yarn_mscale_all_dim * log((double)d->yarn_factor) + 1.0;
        scale *= m * m;
    }
    d->attn_scale = (float)scale;

    /* Layers and experts. */
    d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->expert_d_ff || !d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int e = 0; e < d->n_expert; e++) d->expert_d_ff[e] = ff;
    bool any_dense = false;
    for (int l = 0; l < d->n_layer; l++) d->layer_is_moe[l] = l >= dense_k && l % freq == 0;
    if (v32 && cfg_dsa(root, d, path, err, errlen) != 0) return -1;
    for (int l = 0; l < d->n_layer; l++) any_dense |= !d->layer_is_moe[l];
    if (cfg_dense_shared(root, d, any_dense, ff, n_shared, path, err, errlen) != 0) return -1;
    return cfg_mtp(root, d, path, err, errlen);
}

/* DeepSeek-V4's rope: rope_parameters as transformers 5.25 saves it ({"main": {...},
 * "compress": {...}}), or rope_theta / compress_rope_theta at the top with an optional flat
 * YaRN dict (rope_scaling, as DeepSeek publishes it) that only the compressed layers use. As
 * transformers: main is plain RoPE; compress YaRN's attention factor is 1 unless given, and its
 * correction range is always truncated (transformers reads `truncate` from the outer dict,
 * which V4 nests). model_desc.rope_yarn then means the compressed layers' YaRN. */
static int cfg_v4_rope(json_t *root, struct model_desc *d, const char *path, char *err,
                       size_t errlen)
{
    double main_theta = d->rope_theta, comp_theta = 160000.0;
    if (d->rope_llama3)
        return ms_errf(err, errlen, "%s: llama3 rope scaling is not supported for deepseek_v4",
                       path);
    if (cfg_num(root, "compress_rope_theta", comp_theta, &comp_theta, path, err, errlen) != 0)
        return -1;
    json_t *rp = json_object_get(root, "rope_parameters"), *yarn = NULL;
    bool nested = json_is_object(rp) && (json_object_get(rp, "main") ||
                                         json_object_get(rp, "compress"));
    if (d->rope_yarn) /* a flat YaRN dict, already read by cfg_rope */
        yarn = json_is_object(rp) && !nested ? rp : json_object_get(root, "rope_scaling");
    const char *labels[2] = {"main", "compress"};
    double *thetas[2] = {&main_theta, &comp_theta};
    for (int i = 0; i < 2 && nested; i++) {
        json_t *sub = json_object_get(rp, labels[i]);
        if (!sub || json_is_null(sub)) continue;
        if (!json_is_object(sub))
            return ms_errf(err, errlen, "%s: rope_parameters.%s must be an object", path,
                           labels[i]);
        const char *ty = json_string_value(json_object_get(sub, "rope_type"));
        bool is_yarn = ty && strcmp(ty, "yarn") == 0;
        if (ty && strcmp(ty, "default") != 0 && !(i == 1 && is_yarn))
            return ms_errf(err, errlen, "%s: rope_parameters.%s.rope_type '%.32s' is not "
                                        "supported for deepseek_v4 (main: 'default'; compress: "
                                        "'default' or 'yarn')",
                           path, labels[i], ty);
        if (cfg_num(sub, "rope_theta", *thetas[i], thetas[i], path, err, errlen) != 0) return -1;
        if (is_yarn) {
            /* the dict repeats partial_rotary_factor (the model's, read elsewhere) */
            json_t *cp = json_deep_copy(sub);
            if (!cp) return ms_errf(err, errlen, "%s: out of memory", path);
            json_object_del(cp, "partial_rotary_factor");
            double mscale_all_dim;
            int rc = cfg_yarn(cp, d, &mscale_all_dim, path, err, errlen);
            json_decref(cp);
            if (rc != 0) return -1;
            yarn = sub;
        }
    }
    if (yarn) {
        double af = 1.0;
        json_t *a = json_object_get(yarn, "attention_factor");
        if (a && !json_is_null(a) &&
            cfg_pos_num(yarn, "attention_factor", 1.0, &af, path, err, errlen) != 0)
            return -1;
        d->rope_attn_factor = (float)af;
        d->yarn_truncate = true;
    }
    if (!(main_theta > 0) || !(comp_theta > 0))
        return ms_errf(err, errlen, "%s: rope theta must be positive", path);
    d->rope_theta = (float)main_theta;
    d->v4_compress_theta = (float)comp_theta;
    return 0;
}

/* DeepSeek-V4's per-layer schedules: layer_types (or the legacy compress_ratios 0/4/128, or
 * transformers' default: two HCA layers then CSA / HCA alternating) and mlp_layer_types (or
 * num_hash_layers, default 3). Unknown names are refused by name. */
static int cfg_v4_layers(json_t *root, struct model_desc *d, const char *path, char *err,
                         size_t errlen)
{
    static const char *const attn[] = {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention", NULL};
    static const char *const mlp[] = {"moe", "hash_moe", NULL};
    int n = d->n_layer, *kind = malloc(sizeof(int) * (size_t)n);
    d->v4_attn = calloc((size_t)n, sizeof *d->v4_attn);
    d->layer_hash = calloc((size_t)n, sizeof *d->layer_hash);
    d->layer_window = calloc((size_t)n, sizeof *d->layer_window);
    if (!kind || !d->v4_attn || !d->layer_hash || !d->layer_window) {
        free(kind);
        return ms_errf(err, errlen, "%s: out of memory", path);
    }
    bool present;
    int rc = cfg_layer_names(root, "layer_types", attn,
                             "'sliding_attention', 'compressed_sparse_attention', "
                             "'heavily_compressed_attention'",
                             d, kind, &present, path, err, errlen);
    json_t *legacy = json_object_get(root, "compress_ratios");
    for (int l = 0; rc == 0 && !present && l < n; l++) {
        if (json_is_array(legacy)) {
            json_t *x = json_array_get(legacy, (size_t)l);
            int r = json_is_integer(x) ? (int)json_integer_value(x) : -1;
            kind[l] = r == 0 ? V4_ATTN_SLIDING : r == 4 ? V4_ATTN_CSA : r == 128 ? V4_ATTN_HCA : -1;
            if (kind[l] < 0)
                rc = ms_errf(err, errlen, "%s: compress_ratios[%d] must be 0, 4 or 128", path, l);
        } else {
            kind[l] = l < 2 ? V4_ATTN_HCA : (l - 2) % 2 ? V4_ATTN_CSA : V4_ATTN_HCA;
        }
    }
    for (int l = 0; rc == 0 && l < n; l++) d->v4_attn[l] = (uint8_t)kind[l];
    if (rc == 0)
        rc = cfg_layer_names(root, "mlp_layer_types", mlp, "'moe', 'hash_moe'", d, kind, &present,
                             path, err, errlen);
    int n_hash = 3;
    if (rc == 0 && !present)
        rc = cfg_int(root, "num_hash_layers", false, 3, &n_hash, path, err, errlen);
    for (int l = 0; rc == 0 && l < n; l++) d->layer_hash[l] = present ? kind[l] == 1 : l < n_hash;
    free(kind);
    return rc;
}

/* DeepSeek-V4 (transformers' DeepseekV4 classes; engine/v4.h): hyper-connections, sliding /
 * CSA / HCA attention per layer with one shared key-value head, a query LoRA, attention sinks
 * and a grouped output projection; every layer MoE (hash-routed on hash_moe layers, else top-k
 * by score + e_score_correction_bias), scores by scoring_func (sqrtsoftplus or sigmoid), the
 * chosen weights always renormalized (transformers ignores norm_topk_prob) and times
 * routed_scaling_factor, experts and the one shared expert with swiglu_limit's clamps. */
static int cfg_deepseek_v4(json_t *root, struct model_desc *d, const char *path, char *err,
                           size_t errlen)
{
    int ff = 0, rates[2] = {4, 128}, rope_dim = 0;
    double rsf = 1.5, limit = 10.0, eps = 1e-6, prf = 0;
    bool bias = false, mlp_bias = false;
    static const char *const scoring[] = {"sqrtsoftplus", "sigmoid", NULL};
    int score;
    if (cfg_int(root, "q_lora_rank", false, 1024, &d->q_lora_rank, path, err, errlen) ||
        cfg_positive(d->q_lora_rank, "q_lora_rank", path, err, errlen) ||
        cfg_int(root, "n_routed_experts", true, 0, &d->n_expert, path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", true, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, "moe_intermediate_size", true, 0, &ff, path, err, errlen) ||
        cfg_positive(ff, "moe_intermediate_size", path, err, errlen) ||
        cfg_num(root, "routed_scaling_factor", rsf, &rsf, path, err, errlen) ||
        cfg_num(root, "swiglu_limit", limit, &limit, path, err, errlen) ||
        cfg_choice(root, "scoring_func", scoring, 0, &score, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &bias, path, err, errlen) ||
        cfg_bool(root, "mlp_bias", false, &mlp_bias, path, err, errlen) ||
        cfg_int(root, "hc_mult", false, 4, &d->v4_hc, path, err, errlen) ||
        cfg_positive(d->v4_hc, "hc_mult", path, err, errlen) ||
        cfg_int(root, "hc_sinkhorn_iters", false, 20, &d->v4_hc_iters, path, err, errlen) ||
        cfg_positive(d->v4_hc_iters, "hc_sinkhorn_iters", path, err, errlen) ||
        cfg_num(root, "hc_eps", eps, &eps, path, err, errlen) ||
        cfg_int(root, "sliding_window", false, 128, &d->sliding_window, path, err, errlen) ||
        cfg_positive(d->sliding_window, "sliding_window", path, err, errlen) ||
        cfg_int(root, "o_groups", false, 8, &d->o_groups, path, err, errlen) ||
        cfg_positive(d->o_groups, "o_groups", path, err, errlen) ||
        cfg_int(root, "o_lora_rank", false, 1024, &d->o_lora_rank, path, err, errlen) ||
        cfg_positive(d->o_lora_rank, "o_lora_rank", path, err, errlen) ||
        cfg_int(root, "index_n_heads", false, 64, &d->dsa_heads, path, err, errlen) ||
        cfg_positive(d->dsa_heads, "index_n_heads", path, err, errlen) ||
        cfg_int(root, "index_head_dim", false, 128, &d->dsa_dim, path, err, errlen) ||
        cfg_positive(d->dsa_dim, "index_head_dim", path, err, errlen) ||
        cfg_int(root, "index_topk", false, 512, &d->dsa_topk, path, err, errlen) ||
        cfg_positive(d->dsa_topk, "index_topk", path, err, errlen) ||
        cfg_num(root, "partial_rotary_factor", 0, &prf, path, err, errlen) ||
        cfg_int(root, "qk_rope_head_dim", false, 0, &rope_dim, path, err, errlen) ||
        cfg_int(root, "compress_rate_csa", false, rates[0], &rates[0], path, err, errlen) ||
        cfg_int(root, "compress_rate_hca", false, rates[1], &rates[1], path, err, errlen))
        return -1;
    json_t *cr = json_object_get(root, "compress_rates");
    if (cr && !json_is_null(cr)) {
        if (!json_is_object(cr))
            return ms_errf(err, errlen, "%s: 'compress_rates' must be an object", path);
        if (cfg_int(cr, "compressed_sparse_attention", false, rates[0], &rates[0], path, err,
                    errlen) ||
            cfg_int(cr, "heavily_compressed_attention", false, rates[1], &rates[1], path, err,
                    errlen))
            return -1;
    }
    if (rates[0] < 1 || rates[1] < 1)
        return ms_errf(err, errlen, "%s: compress rates must be positive", path);
    if (bias || mlp_bias)
        return ms_errf(err, errlen, "%s: attention_bias / mlp_bias true is not supported for "
                                    "deepseek_v4", path);
    if (d->n_kv_head != 1)
        return ms_errf(err, errlen, "%s: deepseek_v4 needs num_key_value_heads 1 (its key is its "
                                    "value, shared by every head), not %d", path, d->n_kv_head);
    if (d->n_expert <= 0 || d->n_expert > MODEL_MAX_EXPERTS || d->top_k <= 0 ||
        d->top_k > d->n_expert)
        return ms_errf(err, errlen, "%s: n_routed_experts %d / num_experts_per_tok %d out of "
                                    "range (1..%d)", path, d->n_expert, d->top_k,
                       MODEL_MAX_EXPERTS);
    if (!(rsf > 0) || !(limit > 0) || !(eps > 0))
        return ms_errf(err, errlen, "%s: routed_scaling_factor, swiglu_limit and hc_eps must be "
                                    "positive", path);
    if (d->v4_hc > 16 || d->v4_hc_iters > 1000)
        return ms_errf(err, errlen, "%s: hc_mult %d (at most 16) / hc_sinkhorn_iters %d (at most "
                                    "1000) out of range", path, d->v4_hc, d->v4_hc_iters);
    /* the rotated part: partial_rotary_factor (top level or in rope_parameters.main), else the
     * legacy qk_rope_head_dim, else transformers' default 64/512 */
    json_t *mainp = json_object_get(json_object_get(root, "rope_parameters"), "main");
    if (prf == 0 && json_is_object(mainp) &&
        cfg_num(mainp, "partial_rotary_factor", 0, &prf, path, err, errlen) != 0)
        return -1;
    d->rope_dim = prf > 0 ? (int)(d->head_dim * prf) : rope_dim > 0 ? rope_dim
                                                                   : d->head_dim * 64 / 512;
    if (d->rope_dim <= 0 || d->rope_dim % 2 != 0 || d->rope_dim > d->head_dim ||
        d->rope_dim > d->dsa_dim)
        return ms_errf(err, errlen, "%s: the rotary width %d must be even, positive and at most "
                                    "head_dim (%d) and index_head_dim (%d)", path, d->rope_dim,
                       d->head_dim, d->dsa_dim);
    if ((d->n_head * d->head_dim) % d->o_groups != 0)
        return ms_errf(err, errlen, "%s: o_groups %d must divide num_attention_heads x head_dim",
                       path, d->o_groups);
    if (cfg_v4_rope(root, d, path, err, errlen) != 0 ||
        cfg_v4_layers(root, d, path, err, errlen) != 0)
        return -1;
    d->attn = ATTN_KIND_V4;
    d->rope_interleave = true;
    d->attn_sinks = true;
    d->attn_scale = 1.0f / sqrtf((float)d->head_dim);
    d->v4_hc_eps = (float)eps;
    d->v4_rate[V4_ATTN_SLIDING] = 0;
    d->v4_rate[V4_ATTN_CSA] = rates[0];
    d->v4_rate[V4_ATTN_HCA] = rates[1];
    for (int l = 0; l < d->n_layer; l++) /* compressed layers read every past position */
        d->layer_window[l] = d->v4_attn[l] == V4_ATTN_SLIDING ? d->sliding_window : 0;
    d->router = ROUTER_KIND_SIGMOID_GROUP; /* one group: top-k by score + bias */
    d->router_score = score == 0 ? ROUTER_SCORE_SQRTSOFTPLUS : ROUTER_SCORE_SIGMOID;
    d->n_group = d->topk_group = 1;
    d->norm_topk_prob = true;
    d->router_bias = true; /* on the non-hash layers (model_load.c) */
    d->routed_scale = (float)rsf;
    d->expert_act = FFN_ACT_SILU_CLAMP;
    d->act_limit = (float)limit;
    d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->expert_d_ff || !d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int e = 0; e < d->n_expert; e++) d->expert_d_ff[e] = ff;
    for (int l = 0; l < d->n_layer; l++) d->layer_is_moe[l] = true;
    /* transformers builds one shared expert of moe_intermediate_size whatever
     * n_shared_experts says */
    d->n_shared = 1;
    d->shared_d_ff = ff;
    d->shared_merged = true;
    return cfg_mtp(root, d, path, err, errlen);
}

/* GLM-4.5 / 4.6 / 4.7 (transformers' Glm4Moe classes): GQA with optional q/k/v biases
 * (attention_bias; o_proj never has one) and optional per-head q/k RMSNorm (use_qk_norm, before
 * the rope); rotate-half RoPE on the first partial_rotary_factor of each head (default 0.5, at
 * top level in GLM's published configs, inside rope_parameters in transformers 5's); the first
 * first_k_dense_replace layers dense, the others MoE with DeepSeek-V3's noaux_tc router (sigmoid
 * + e_score_correction_bias, groups by their two best, norm_topk_prob, routed_scaling_factor)
 * and n_shared_experts merged into one always-on FFN under "shared_experts.". */
static int cfg_glm4_moe(json_t *root, struct model_desc *d, const char *path, char *err,
                        size_t errlen)
{
    int ff = 0, n_shared = 0, dense_k = 0;
    double rsf = 1.0, prf = 0.5;
    if (cfg_int(root, "n_routed_experts", true, 0, &d->n_expert, path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", true, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, "moe_intermediate_size", true, 0, &ff, path, err, errlen) ||
        cfg_positive(ff, "moe_intermediate_size", path, err, errlen) ||
        cfg_int(root, "n_shared_experts", false, 1, &n_shared, path, err, errlen) ||
        cfg_int(root, "first_k_dense_replace", false, 1, &dense_k, path, err, errlen) ||
        cfg_num(root, "routed_scaling_factor", 1.0, &rsf, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", true, &d->norm_topk_prob, path, err, errlen) ||
        cfg_int(root, "n_group", false, 1, &d->n_group, path, err, errlen) ||
        cfg_int(root, "topk_group", false, 1, &d->topk_group, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &d->qkv_bias, path, err, errlen) ||
        cfg_num(root, "partial_rotary_factor", prf, &prf, path, err, errlen) ||
        cfg_mtp(root, d, path, err, errlen))
        return -1;
    json_t *rp = json_object_get(root, "rope_parameters");
    if (json_is_object(rp) && cfg_num(rp, "partial_rotary_factor", prf, &prf, path, err, errlen))
        return -1;
    bool qk_norm = false;
    if (cfg_bool(root, "use_qk_norm", false, &qk_norm, path, err, errlen) != 0) return -1;
    if (n_shared < 0 || dense_k < 0)
        return ms_errf(err, errlen,
                       "%s: n_shared_experts and first_k_dense_replace must not be negative", path);
    if (d->n_expert <= 0 || d->n_expert > MODEL_MAX_EXPERTS)
        return ms_errf(err, errlen, "%s: 'n_routed_experts' = %d is out of range (1..%d)", path,
                       d->n_expert, MODEL_MAX_EXPERTS);
    if (d->top_k <= 0 || d->top_k > d->n_expert)
        return ms_errf(err, errlen, "%s: num_experts_per_tok %d must be in 1..n_routed_experts (%d)",
                       path, d->top_k, d->n_expert);
    if (!(rsf > 0))
        return ms_errf(err, errlen, "%s: routed_scaling_factor %g must be positive", path, rsf);
    if (cfg_groups(d, path, err, errlen) != 0) return -1;
    /* transformers: int(head_dim * factor), rotated in pairs, so it must come out even */
    int rot = (int)(d->head_dim * prf);
    if (!(prf > 0 && prf <= 1) || rot < 2 || rot % 2 != 0)
        return ms_errf(err, errlen,
                       "%s: partial_rotary_factor %g gives a rotary width of %d of head_dim %d "
                       "(must be even and positive)",
                       path, prf, rot, d->head_dim);
    d->rope_dim = rot;
    d->qk_norm = qk_norm ? QK_NORM_HEAD : QK_NORM_NONE;
    d->router = ROUTER_KIND_SIGMOID_GROUP;
    d->router_bias = true;
    d->routed_scale = (float)rsf;

    d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->expert_d_ff || !d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int e = 0; e < d->n_expert; e++) d->expert_d_ff[e] = ff;
    for (int l = 0; l < d->n_layer; l++) d->layer_is_moe[l] = l >= dense_k;
    return cfg_dense_shared(root, d, dense_k > 0, ff, n_shared, path, err, errlen);
}

/* MiniMax-M2 / M2.1 (transformers' MiniMaxM2 classes): GQA without biases whose q/k RMSNorm
 * spans the whole projection (weights of n_heads*head_dim and n_kv_heads*head_dim, before the
 * head split: olmoe's QK_NORM_FULL), always on; rotate-half RoPE on the first rotary_dim dims of
 * each head (MiniMax's top-level rotary_dim, or partial_rotary_factor, default all of them);
 * every layer MoE, experts of width intermediate_size stored Mixtral-style (w1/w3/w2 under
 * block_sparse_moe.), routed by sigmoid + e_score_correction_bias, top-k without groups (one
 * group keeping itself: the noaux_tc rule then reduces to exactly that), weights renormalised,
 * no scaling and no shared expert. Fields of MiniMax's published config that would change this
 * math are checked and refused by name when they ask for something else. Its MTP modules
 * (num_mtp_modules) are not part of transformers' model and are never bound. */
static int cfg_minimax_m2(json_t *root, struct model_desc *d, const char *path, char *err,
                          size_t errlen)
{
    if (cfg_experts(root, d, "intermediate_size", path, err, errlen) != 0) return -1;
    if (d->n_expert <= 0)
        return ms_errf(err, errlen, "%s: num_local_experts must be positive for minimax_m2", path);
    bool qk_norm = true, routing_bias = true;
    int shared = 0, rot = -1, choice = 0;
    double prf = 1.0;
    static const char *const qk_types[] = {"per_layer", NULL};
    static const char *const scoring[] = {"sigmoid", NULL};
    if (cfg_bool(root, "use_qk_norm", true, &qk_norm, path, err, errlen) ||
        cfg_choice(root, "qk_norm_type", qk_types, 0, &choice, path, err, errlen) ||
        cfg_choice(root, "scoring_func", scoring, 0, &choice, path, err, errlen) ||
        cfg_bool(root, "use_routing_bias", true, &routing_bias, path, err, errlen) ||
        cfg_int(root, "shared_intermediate_size", false, 0, &shared, path, err, errlen) ||
        cfg_int(root, "rotary_dim", false, -1, &rot, path, err, errlen) ||
        cfg_num(root, "partial_rotary_factor", prf, &prf, path, err, errlen))
        return -1;
    json_t *rp = json_object_get(root, "rope_parameters");
    if (json_is_object(rp) && cfg_num(rp, "partial_rotary_factor", prf, &prf, path, err, errlen))
        return -1;
    /* transformers always applies the q/k norm and the correction bias (its model has no switch
     * for either), so a config turning them off describes a model it does not run */
    if (!qk_norm)
        return ms_errf(err, errlen, "%s: use_qk_norm false is not supported for minimax_m2", path);
    if (!routing_bias)
        return ms_errf(err, errlen, "%s: use_routing_bias false is not supported for minimax_m2",
                       path);
    if (shared != 0)
        return ms_errf(err, errlen,
                       "%s: shared_intermediate_size %d is not supported for minimax_m2 (only 0: "
                       "no shared expert)",
                       path, shared);
    /* MiniMax-Text-01's lightning (linear) attention layers are attn_type 0; M2 is all 1 */
    json_t *types = json_object_get(root, "attn_type_list");
    if (types && !json_is_null(types)) {
        if (!json_is_array(types))
            return ms_errf(err, errlen, "%s: 'attn_type_list' must be a list", path);
        for (size_t i = 0; i < json_array_size(types); i++) {
            json_t *t = json_array_get(types, i);
            if (!json_is_integer(t) || json_integer_value(t) != 1)
                return ms_errf(err, errlen,
                               "%s: attn_type_list[%zu] is not 1 (only full softmax attention is "
                               "supported)",
                               path, i);
        }
    }
    /* rotary_dim wins, as transformers derives the factor from it; otherwise int(head_dim *
     * factor). Rotated in pairs, so the width must be even. */
    if (rot < 0) {
        if (!(prf > 0 && prf <= 1))
            return ms_errf(err, errlen, "%s: partial_rotary_factor %g must be in (0, 1]", path,
                           prf);
        rot = (int)(d->head_dim * prf);
    }
    if (rot < 2 || rot > d->head_dim || rot % 2 != 0)
        return ms_errf(err, errlen,
                       "%s: rotary_dim %d must be even and in 2..head_dim (%d)", path, rot,
                       d->head_dim);
    if (d->rope_yarn && rot != d->head_dim)
        return ms_errf(err, errlen, "%s: rotary_dim %d under YaRN is not supported", path, rot);
    d->rope_dim = rot;
    d->qk_norm = QK_NORM_FULL;
    d->router = ROUTER_KIND_SIGMOID_GROUP;
    d->router_bias = true;
    d->n_group = d->topk_group = 1;
    d->norm_topk_prob = true;
    d->routed_scale = 1.0f;
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int l = 0; l < d->n_layer; l++) d->layer_is_moe[l] = true;
    d->shared_gate = SHARED_GATE_NONE;
    return 0;
}

/* The rotary width of a family whose partial_rotary_factor (top level, or in rope_parameters
 * as transformers 5 saves it) defaults to `def`: int(head_dim * factor), rotated in pairs. */
static int cfg_partial_rotary(json_t *root, struct model_desc *d, double def, const char *path,
                              char *err, size_t errlen)
{
    double prf = def;
    if (cfg_num(root, "partial_rotary_factor", prf, &prf, path, err, errlen)) return -1;
    json_t *rp = json_object_get(root, "rope_parameters");
    if (json_is_object(rp) && cfg_num(rp, "partial_rotary_factor", prf, &prf, path, err, errlen))
        return -1;
    int rot = (int)(d->head_dim * prf);
    if (!(prf > 0 && prf <= 1) || rot < 2 || rot % 2 != 0)
        return ms_errf(err, errlen,
                       "%s: partial_rotary_factor %g gives a rotary width of %d of head_dim %d "
                       "(must be even and positive)",
                       path, prf, rot, d->head_dim);
    if (d->rope_yarn && rot != d->head_dim)
        return ms_errf(err, errlen, "%s: partial rotary under YaRN is not supported", path);
    d->rope_dim = rot;
    return 0;
}

/* Largest Gated DeltaNet head widths and conv kernel the kernels take (they keep a head's
 * normalized q and k on the stack); released models use 128 and 4. */
#define LIN_MAX_HEAD_DIM 512
#define LIN_MAX_CONV 16

/* Qwen3-Next / Qwen3.5 hybrid layers: layer_types ("linear_attention" / "full_attention"), or
 * every full_attention_interval-th layer full (transformers' default 4); Gated DeltaNet
 * geometry; gated attention with q/k norm per head and partial rotary (default 0.25); every
 * RMSNorm zero-centred (1 + w). */
static int cfg_qwen_hybrid(json_t *root, struct model_desc *d, const char *path, char *err,
                           size_t errlen)
{
    int interval = 4;
    bool bias = false;
    if (cfg_int(root, "linear_num_key_heads", false, 16, &d->lin_nk, path, err, errlen) ||
        cfg_int(root, "linear_num_value_heads", false, 32, &d->lin_nv, path, err, errlen) ||
        cfg_int(root, "linear_key_head_dim", false, 128, &d->lin_dk, path, err, errlen) ||
        cfg_int(root, "linear_value_head_dim", false, 128, &d->lin_dv, path, err, errlen) ||
        cfg_int(root, "linear_conv_kernel_dim", false, 4, &d->lin_conv, path, err, errlen) ||
        cfg_int(root, "full_attention_interval", false, 4, &interval, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &bias, path, err, errlen) ||
        cfg_partial_rotary(root, d, 0.25, path, err, errlen))
        return -1;
    if (d->lin_nk <= 0 || d->lin_nv <= 0 || d->lin_nv % d->lin_nk != 0)
        return ms_errf(err, errlen,
                       "%s: linear_num_value_heads %d must be a positive multiple of "
                       "linear_num_key_heads %d",
                       path, d->lin_nv, d->lin_nk);
    if (d->lin_dk <= 0 || d->lin_dk > LIN_MAX_HEAD_DIM || d->lin_dv <= 0 ||
        d->lin_dv > LIN_MAX_HEAD_DIM)
        return ms_errf(err, errlen,
                       "%s: linear_key_head_dim %d and linear_value_head_dim %d must be in 1..%d",
                       path, d->lin_dk, d->lin_dv, LIN_MAX_HEAD_DIM);
    if (d->lin_conv < 1 || d->lin_conv > LIN_MAX_CONV)
        return ms_errf(err, errlen, "%s: linear_conv_kernel_dim %d must be in 1..%d", path,
                       d->lin_conv, LIN_MAX_CONV);
    if (interval <= 0)
        return ms_errf(err, errlen, "%s: full_attention_interval %d must be positive", path,
                       interval);
    /* attention_bias would put biases on the gated q_proj too; no released model has them */
    if (bias)
        return ms_errf(err, errlen, "%s: attention_bias true is not supported for %s", path,
                       d->model_type);
    d->layer_linear = calloc((size_t)d->n_layer, sizeof *d->layer_linear);
    if (!d->layer_linear) return ms_errf(err, errlen, "%s: out of memory", path);
    json_t *lt = json_object_get(root, "layer_types");
    if (lt && !json_is_null(lt) &&
        (!json_is_array(lt) || json_array_size(lt) != (size_t)d->n_layer))
        return ms_errf(err, errlen, "%s: 'layer_types' must list num_hidden_layers (%d) strings",
                       path, d->n_layer);
    for (int l = 0; l < d->n_layer; l++) {
        const char *ty = (l + 1) % interval ? "linear_attention" : "full_attention";
        if (lt && !json_is_null(lt)) ty = json_string_value(json_array_get(lt, (size_t)l));
        if (ty && strcmp(ty, "linear_attention") == 0)
            d->layer_linear[l] = true;
        else if (!ty || strcmp(ty, "full_attention") != 0)
            return ms_errf(err, errlen,
                           "%s: layer_types[%d] '%.40s' is not supported (supported: "
                           "'linear_attention', 'full_attention')",
                           path, l, ty ? ty : "(not a string)");
        d->n_linear += d->layer_linear[l];
    }
    d->qk_norm = QK_NORM_HEAD;
    d->norm_plus_one = true;
    d->attn_out_gate = true;
    return 0;
}

/* Qwen3-Next (transformers' Qwen3Next classes): the hybrid layers above; MoE by the qwen rule
 * (decoder_sparse_step, mlp_only_layers) with softmax top-k (norm_topk_prob, default true) and
 * the gated shared expert; Gated DeltaNet's projections fused per key head (in_proj_qkvz,
 * in_proj_ba). Its MTP module (mtp.*) is not part of transformers' model and is never bound. */
static int cfg_qwen3_next(json_t *root, struct model_desc *d, const char *path, char *err,
                          size_t errlen)
{
    if (cfg_experts(root, d, "moe_intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, true, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", true, &d->norm_topk_prob, path, err, errlen) ||
        cfg_gated_shared(root, d, path, err, errlen) ||
        cfg_qwen_hybrid(root, d, path, err, errlen))
        return -1;
    d->lin_fused_in = true;
    return 0;
}

/* Qwen3.5 / 3.6 MoE text model (transformers' Qwen3_5Moe classes): the hybrid layers above,
 * every layer MoE with softmax top-k always renormalized and the gated shared expert; Gated
 * DeltaNet's projections apart (in_proj_qkv, _z, _b, _a). Its text rotary is interleaved mRoPE,
 * which for text (the same position in all three sections) is plain rotary. */
static int cfg_qwen3_5_moe(json_t *root, struct model_desc *d, const char *path, char *err,
                           size_t errlen)
{
    if (cfg_experts(root, d, "moe_intermediate_size", path, err, errlen) ||
        cfg_gated_shared(root, d, path, err, errlen) ||
        cfg_qwen_hybrid(root, d, path, err, errlen))
        return -1;
    if (d->n_expert <= 0)
        return ms_errf(err, errlen, "%s: num_experts must be positive for %s", path,
                       d->model_type);
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->layer_is_moe) return ms_errf(err, errlen, "%s: out of memory", path);
    for (int l = 0; l < d->n_layer; l++) d->layer_is_moe[l] = true;
    d->norm_topk_prob = true;
    return 0;
}

/* A number that may be written as transformers 5 writes infinities ({"__float__": "Infinity"})
 * or as a plain number. */
static int cfg_float_value(json_t *v, double *out)
{
    if (json_is_number(v)) {
        *out = json_number_value(v);
        return 0;
    }
    json_t *f = json_is_object(v) ? json_object_get(v, "__float__") : NULL;
    const char *s = json_is_string(f)   ? json_string_value(f)
                    : json_is_string(v) ? json_string_value(v)
                                        : NULL;
    if (!s) return -1;
    if (strcmp(s, "Infinity") == 0 || strcmp(s, "inf") == 0)
        *out = INFINITY;
    else if (strcmp(s, "-Infinity") == 0 || strcmp(s, "-inf") == 0)
        *out = -INFINITY;
    else
        return -1;
    return 0;
}

/* Granite 4.0-H (transformers' GraniteMoeHybrid classes): Mamba2 layers (layer_types "mamba" or
 * "linear_attention") and GQA attention layers ("attention" / "full_attention"), NoPE unless
 * position_embedding_type is "rope"; Granite's multipliers (embedding, residual, attention as
 * the softmax scale, logits_scaling); every layer's FFN the always-on shared_mlp plus, with
 * num_local_experts > 0, routed experts (top-k logits softmaxed: softmax top-k renormalized)
 * stored fused under block_sparse_moe (input_linear = gate|up, output_linear). */
static int cfg_granitemoehybrid(json_t *root, struct model_desc *d, const char *path, char *err,
                                size_t errlen)
{
    int ff = 0, sff = 0, H = 0, P = 0, N = 0, G = 1, K = 4;
    double expand = 2.0, am = 0, em = 1.0, rm = 1.0, ls = 1.0;
    bool bias = false;
    const char *ekey = "num_local_experts";
    if (cfg_int(root, ekey, false, 0, &d->n_expert, path, err, errlen) ||
        cfg_int(root, "num_experts_per_tok", false, 0, &d->top_k, path, err, errlen) ||
        cfg_int(root, "intermediate_size", false, 0, &ff, path, err, errlen) ||
        cfg_int(root, "shared_intermediate_size", false, 0, &sff, path, err, errlen) ||
        cfg_int(root, "mamba_n_heads", true, 0, &H, path, err, errlen) ||
        cfg_int(root, "mamba_d_state", true, 0, &N, path, err, errlen) ||
        cfg_int(root, "mamba_n_groups", false, 1, &G, path, err, errlen) ||
        cfg_int(root, "mamba_d_conv", false, 4, &K, path, err, errlen) ||
        cfg_num(root, "mamba_expand", 2.0, &expand, path, err, errlen) ||
        cfg_bool(root, "mamba_conv_bias", true, &d->lin_conv_bias, path, err, errlen) ||
        cfg_bool(root, "mamba_proj_bias", false, &d->lin_proj_bias, path, err, errlen) ||
        cfg_num(root, "attention_multiplier", 0.0, &am, path, err, errlen) ||
        cfg_num(root, "embedding_multiplier", 1.0, &em, path, err, errlen) ||
        cfg_num(root, "residual_multiplier", 1.0, &rm, path, err, errlen) ||
        cfg_num(root, "logits_scaling", 1.0, &ls, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &bias, path, err, errlen))
        return -1;
    if (d->n_expert < 0 || d->n_expert > MODEL_MAX_EXPERTS)
        return ms_errf(err, errlen, "%s: '%s' = %d is out of range (0..%d)", path, ekey,
                       d->n_expert, MODEL_MAX_EXPERTS);
    if (d->n_expert > 0 && (d->top_k <= 0 || d->top_k > d->n_expert || ff <= 0))
        return ms_errf(err, errlen,
                       "%s: num_experts_per_tok %d must be in 1..%s (%d) and intermediate_size "
                       "positive",
                       path, d->top_k, ekey, d->n_expert);
    if (sff < 0 || (d->n_expert == 0 && sff == 0))
        return ms_errf(err, errlen, "%s: shared_intermediate_size %d must be positive%s", path,
                       sff, d->n_expert == 0 ? " for a model without experts" : "");
    /* mamba_d_head: a number, or "auto" (the intermediate width over the heads) */
    double inter = expand * d->d_model;
    json_t *dh = json_object_get(root, "mamba_d_head");
    if (H <= 0 || inter != (double)(int)inter || (int)inter % H != 0)
        return ms_errf(err, errlen,
                       "%s: mamba_n_heads %d must divide mamba_expand * hidden_size (%g)", path, H,
                       inter);
    if (!dh || json_is_null(dh) ||
        (json_is_string(dh) && strcmp(json_string_value(dh), "auto") == 0))
        P = (int)inter / H;
    else if (json_is_integer(dh))
        P = (int)json_integer_value(dh);
    else
        return ms_errf(err, errlen, "%s: 'mamba_d_head' must be an integer or \"auto\"", path);
    if (P * H != (int)inter)
        return ms_errf(err, errlen,
                       "%s: mamba_d_head %d x mamba_n_heads %d is not mamba_expand * hidden_size "
                       "(%g)",
                       path, P, H, inter);
    if (G <= 0 || H % G != 0 || N <= 0 || N > LIN_MAX_HEAD_DIM || P > LIN_MAX_HEAD_DIM)
        return ms_errf(err, errlen,
                       "%s: mamba_n_groups %d must divide mamba_n_heads %d, and mamba_d_state %d "
                       "and mamba_d_head %d be in 1..%d",
                       path, G, H, N, P, LIN_MAX_HEAD_DIM);
    if (K < 1 || K > LIN_MAX_CONV)
        return ms_errf(err, errlen, "%s: mamba_d_conv %d must be in 1..%d", path, K, LIN_MAX_CONV);
    if (!(em > 0) || !(rm > 0) || !(ls > 0) || !(am > 0))
        return ms_errf(err, errlen,
                       "%s: embedding_multiplier, residual_multiplier, logits_scaling and "
                       "attention_multiplier must be positive",
                       path);
    /* time_step_limit [min, max], default (0, inf) */
    double lo = 0.0, hi = INFINITY;
    json_t *tl = json_object_get(root, "time_step_limit");
    if (tl && !json_is_null(tl) &&
        (!json_is_array(tl) || json_array_size(tl) != 2 ||
         cfg_float_value(json_array_get(tl, 0), &lo) ||
         cfg_float_value(json_array_get(tl, 1), &hi) ||
         !(lo <= hi)))
        return ms_errf(err, errlen, "%s: 'time_step_limit' must be [min, max] with min <= max",
                       path);
    json_t *pe = json_object_get(root, "position_embedding_type");
    const char *pes = json_is_string(pe) ? json_string_value(pe) : NULL;
    if (pe && !json_is_null(pe) && (!pes || (strcmp(pes, "rope") && strcmp(pes, "nope"))))
        return ms_errf(err, errlen,
                       "%s: position_embedding_type '%.32s' is not supported (supported: 'rope', "
                       "'nope', null)",
                       path, pes ? pes : "?");
    d->nope = !pes || strcmp(pes, "rope") != 0;
    d->layer_linear = calloc((size_t)d->n_layer, sizeof *d->layer_linear);
    d->layer_is_moe = calloc((size_t)d->n_layer, sizeof *d->layer_is_moe);
    if (!d->layer_linear || !d->layer_is_moe)
        return ms_errf(err, errlen, "%s: out of memory", path);
    json_t *lt = json_object_get(root, "layer_types");
    if (lt && !json_is_null(lt) &&
        (!json_is_array(lt) || json_array_size(lt) != (size_t)d->n_layer))
        return ms_errf(err, errlen, "%s: 'layer_types' must list num_hidden_layers (%d) strings",
                       path, d->n_layer);
    for (int l = 0; l < d->n_layer; l++) {
        const char *ty = "mamba"; /* transformers' default: every layer Mamba2 */
        if (lt && !json_is_null(lt)) ty = json_string_value(json_array_get(lt, (size_t)l));
        if (ty && (strcmp(ty, "mamba") == 0 || strcmp(ty, "linear_attention") == 0))
            d->layer_linear[l] = true;
        else if (!ty || (strcmp(ty, "attention") && strcmp(ty, "full_attention")))
            return ms_errf(err, errlen,
                           "%s: layer_types[%d] '%.40s' is not supported (supported: 'mamba', "
                           "'attention', 'linear_attention', 'full_attention')",
                           path, l, ty ? ty : "(not a string)");
        d->n_linear += d->layer_linear[l];
        d->layer_is_moe[l] = d->n_expert > 0;
    }
    d->lin_kind = LIN_KIND_MAMBA2;
    d->lin_nk = G;
    d->lin_nv = H;
    d->lin_dk = N;
    d->lin_dv = P;
    d->lin_conv = K;
    d->lin_dt_min = (float)lo;
    d->lin_dt_max = (float)hi;
    d->qkv_bias = d->o_bias = bias;
    d->attn_scale = (float)am;
    d->embed_scale = (float)em;
    d->residual_scale = (float)rm;
    d->logit_scale = (float)(1.0 / ls);
    d->norm_topk_prob = true;
    if (d->n_expert > 0) {
        d->expert_d_ff = malloc((size_t)d->n_expert * sizeof *d->expert_d_ff);
        if (!d->expert_d_ff) return ms_errf(err, errlen, "%s: out of memory", path);
        for (int e = 0; e < d->n_expert; e++) d->expert_d_ff[e] = ff;
        if (sff > 0) {
            d->n_shared = 1;
            d->shared_d_ff = sff;
        }
    } else {
        d->dense_d_ff = sff; /* the shared MLP alone */
    }
    d->shared_gate = SHARED_GATE_NONE;
    return 0;
}

/* A list of n 0/1 integers (Llama 4's no_rope_layers). */
static int cfg_flag_list(json_t *root, const char *key, int n, bool *out, bool *given,
                         const char *path, char *err, size_t errlen)
{
    json_t *a = json_object_get(root, key);
    *given = a && !json_is_null(a);
    if (!*given) return 0;
    if (!json_is_array(a) || json_array_size(a) != (size_t)n)
        return ms_errf(err, errlen, "%s: '%s' must list num_hidden_layers (%d) integers", path,
                       key, n);
    for (int i = 0; i < n; i++) {
        json_t *x = json_array_get(a, (size_t)i);
        if (!json_is_integer(x) || (json_integer_value(x) != 0 && json_integer_value(x) != 1))
            return ms_errf(err, errlen, "%s: %s[%d] must be 0 or 1", path, key, i);
        out[i] = json_integer_value(x) == 1;
    }
    return 0;
}

/* Llama 4 (transformers' Llama4Text classes; llama4 folders through text_config): GQA whose
 * RoPE (interleaved pairs, as complex numbers) runs on the layers no_rope_layers marks 1 (default
 * every layer but each no_rope_layer_interval-th), with a weightless per-head RMSNorm after it
 * there (use_qk_norm) and chunked local attention (attention_chunk_size) on those
 * "chunked_attention" layers; the NoPE layers attend globally with attention temperature tuning
 * (attn_scale, floor_scale); MoE on the moe_layers (default every interleave_moe_layer_step-th),
 * top-k by logit with sigmoid weights scaling the experts' input, plus a shared expert of the
 * experts' width; the other layers dense of intermediate_size_mlp. */
static int cfg_llama4(json_t *root, struct model_desc *d, const char *path, char *err,
                      size_t errlen)
{
    int step = 1, interval = 4, chunk = 8192, floor_scale = 8192, mlp = 0;
    bool qk_norm = true, bias = false, tune = true, given = false;
    double attn_scale = 0.1;
    json_t *ch = json_object_get(root, "attention_chunk_size");
    if (cfg_experts(root, d, "intermediate_size", path, err, errlen) ||
        cfg_int(root, "interleave_moe_layer_step", false, 1, &step, path, err, errlen) ||
        cfg_int(root, "no_rope_layer_interval", false, 4, &interval, path, err, errlen) ||
        (ch && !json_is_null(ch) &&
         cfg_int(root, "attention_chunk_size", false, 8192, &chunk, path, err, errlen)) ||
        cfg_int(root, "floor_scale", false, 8192, &floor_scale, path, err, errlen) ||
        cfg_int(root, "intermediate_size_mlp", false, 0, &mlp, path, err, errlen) ||
        cfg_bool(root, "use_qk_norm", true, &qk_norm, path, err, errlen) ||
        cfg_bool(root, "attention_bias", false, &bias, path, err, errlen) ||
        cfg_bool(root, "attn_temperature_tuning", true, &tune, path, err, errlen) ||
        cfg_num(root, "attn_scale", 0.1, &attn_scale, path, err, errlen))
        return -1;
    if (ch && json_is_null(ch)) chunk = 0;
    if (d->n_expert <= 0)
        return ms_errf(err, errlen, "%s: num_local_experts must be positive for llama4", path);
    if (step <= 0 || interval <= 0 || chunk < 0 || floor_scale <= 0)
        return ms_errf(err, errlen,
                       "%s: interleave_moe_layer_step, no_rope_layer_interval, floor_scale must "
                       "be positive and attention_chunk_size positive or null",
                       path);
    int n = d->n_layer;
    d->layer_nope = calloc((size_t)n, sizeof *d->layer_nope);
    d->layer_chunk = calloc((size_t)n, sizeof *d->layer_chunk);
    d->layer_is_moe = calloc((size_t)n, sizeof *d->layer_is_moe);
    bool *rope = calloc((size_t)n, sizeof *rope);
    if (!d->layer_nope || !d->layer_chunk || !d->layer_is_moe || !rope) {
        free(rope);
        return ms_errf(err, errlen, "%s: out of memory", path);
    }
    int rc = cfg_flag_list(root, "no_rope_layers", n, rope, &given, path, err, errlen);
    for (int l = 0; l < n && !given; l++) rope[l] = (l + 1) % interval != 0;
    json_t *ml = json_object_get(root, "moe_layers");
    if (rc == 0 && ml && !json_is_null(ml)) {
        if (!json_is_array(ml)) {
            rc = ms_errf(err, errlen, "%s: 'moe_layers' must be a list of integers", path);
        } else {
            for (size_t i = 0; i < json_array_size(ml) && rc == 0; i++) {
                json_t *x = json_array_get(ml, i);
                json_int_t l = json_is_integer(x) ? json_integer_value(x) : -1;
                if (l < 0 || l >= n)
                    rc = ms_errf(err, errlen, "%s: moe_layers[%zu] is not a layer index", path, i);
                else
                    d->layer_is_moe[l] = true;
            }
        }
    } else {
        for (int l = step - 1; l < n; l += step) d->layer_is_moe[l] = true;
    }
    /* layer_types: chunked_attention (RoPE layers, when chunking) or full_attention */
    json_t *lt = json_object_get(root, "layer_types");
    if (rc == 0 && lt && !json_is_null(lt) &&
        (!json_is_array(lt) || json_array_size(lt) != (size_t)n))
        rc = ms_errf(err, errlen, "%s: 'layer_types' must list num_hidden_layers (%d) strings",
                     path, n);
    bool any_dense = false;
    for (int l = 0; l < n && rc == 0; l++) {
        d->layer_nope[l] = !rope[l];
        bool chunked = rope[l] && chunk > 0;
        if (lt && !json_is_null(lt)) {
            const char *ty = json_string_value(json_array_get(lt, (size_t)l));
            if (ty && strcmp(ty, "chunked_attention") == 0)
                chunked = true;
            else if (ty && strcmp(ty, "full_attention") == 0)
                chunked = false;
            else
                rc = ms_errf(err, errlen,
                             "%s: layer_types[%d] '%.40s' is not supported (supported: "
                             "'chunked_attention', 'full_attention')",
                             path, l, ty ? ty : "(not a string)");
            if (chunked && chunk <= 0)
                rc = ms_errf(err, errlen,
                             "%s: layer %d is chunked_attention but attention_chunk_size is null",
                             path, l);
        }
        d->layer_chunk[l] = chunked ? chunk : 0;
        any_dense |= !d->layer_is_moe[l];
    }
    free(rope);
    if (rc != 0) return -1;
    if (any_dense && mlp <= 0)
        return ms_errf(err, errlen, "%s: intermediate_size_mlp must be positive (dense layers)",
                       path);
    d->dense_d_ff = mlp;
    d->n_shared = 1;
    d->shared_d_ff = d->expert_d_ff[0];
    d->shared_gate = SHARED_GATE_NONE;
    d->router = ROUTER_KIND_SIGMOID_TOPK;
    d->router_scales_input = true;
    d->qkv_bias = d->o_bias = bias;
    d->qk_norm = qk_norm ? QK_NORM_HEAD_POST : QK_NORM_NONE;
    d->rope_interleave = true;
    d->attn_temp_tuning = tune;
    d->temp_scale = (float)attn_scale;
    d->temp_floor = floor_scale;
    return 0;
}

/* gpt-oss (transformers' GptOss classes): every layer MoE; GQA with biases on q/k/v/o, a sink
 * logit per head, and sliding-window or full attention per layer_types; rotate-half RoPE,
 * usually YaRN; a router with a bias whose top-k logits are softmaxed (the softmax over all
 * experts renormalized over the k kept: the same weights); experts with biases and the clamped
 * SwiGLU (swiglu_alpha, swiglu_limit) over gate/up stored interleaved. */
static int cfg_gpt_oss(json_t *root, struct model_desc *d, const char *path, char *err,
                       size_t errlen)
{
    double alpha = 1.702, limit = 7.0;
    bool bias = true;
    if (cfg_experts(root, d, "intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, false, path, err, errlen) ||
        cfg_int(root, "sliding_window", false, 0, &d->sliding_window, path, err, errlen) ||
        cfg_bool(root, "attention_bias", true, &bias, path, err, errlen) ||
        cfg_num(root, "swiglu_alpha", alpha, &alpha, path, err, errlen) ||
        cfg_num(root, "swiglu_limit", limit, &limit, path, err, errlen))
        return -1;
    if (d->n_expert == 0)
        return ms_errf(err, errlen, "%s: gpt_oss needs num_local_experts > 0", path);
    if (d->sliding_window < 0)
        return ms_errf(err, errlen, "%s: 'sliding_window' must be null or positive", path);
    if (!(limit > 0) || !isfinite(alpha))
        return ms_errf(err, errlen, "%s: swiglu_limit %g must be positive and swiglu_alpha %g "
                                    "finite",
                       path, limit, alpha);
    d->layer_window = malloc((size_t)d->n_layer * sizeof *d->layer_window);
    if (!d->layer_window) return ms_errf(err, errlen, "%s: out of memory", path);
    json_t *lt = json_object_get(root, "layer_types");
    if (lt && !json_is_null(lt) &&
        (!json_is_array(lt) || json_array_size(lt) != (size_t)d->n_layer))
        return ms_errf(err, errlen, "%s: 'layer_types' must list num_hidden_layers (%d) strings",
                       path, d->n_layer);
    for (int l = 0; l < d->n_layer; l++) {
        /* transformers' default: sliding for even layers, full for odd ones */
        const char *ty = l % 2 == 0 ? "sliding_attention" : "full_attention";
        if (lt && !json_is_null(lt)) ty = json_string_value(json_array_get(lt, (size_t)l));
        if (ty && strcmp(ty, "sliding_attention") == 0)
            d->layer_window[l] = d->sliding_window;
        else if (ty && strcmp(ty, "full_attention") == 0)
            d->layer_window[l] = 0;
        else
            return ms_errf(err, errlen,
                           "%s: layer_types[%d] '%.40s' is not supported (supported: "
                           "'sliding_attention', 'full_attention')",
                           path, l, ty ? ty : "(not a string)");
    }
    d->qkv_bias = d->o_bias = bias;
    d->attn_sinks = true;
    d->norm_topk_prob = true;
    d->router_logit_bias = true;
    d->expert_act = FFN_ACT_SWIGLU_OAI;
    d->act_alpha = (float)alpha;
    d->act_limit = (float)limit;
    d->expert_bias = true;
    return 0;
}

void model_desc_free(struct model_desc *desc)
{
    if (!desc) return;
    free(desc->layer_window);
    desc->layer_window = NULL;
    free(desc->layer_linear);
    desc->layer_linear = NULL;
    free(desc->layer_nope);
    desc->layer_nope = NULL;
    free(desc->layer_chunk);
    desc->layer_chunk = NULL;
    free(desc->dsa_shared);
    desc->dsa_shared = NULL;
    free(desc->v4_attn);
    desc->v4_attn = NULL;
    free(desc->layer_hash);
    desc->layer_hash = NULL;
    free(desc->layer_is_moe);
    free(desc->expert_d_ff);
    free(desc->expert_group);
    free(desc->cont_quant);
    desc->cont_quant = NULL;
    desc->cont_n_quant = 0;
    desc->layer_is_moe = NULL;
    desc->expert_d_ff = NULL;
    desc->expert_group = NULL;
}

int model_desc_parse(const char *json_text, size_t len, const char *path, struct model_desc *desc,
                     char *err, size_t errlen)
{
    memset(desc, 0, sizeof *desc);
    json_error_t jerr;
    json_t *root = json_loadb(json_text, len, 0, &jerr);
    if (!root)
        return ms_errf(err, errlen, "%s: not valid JSON: %s (line %d, column %d)", path, jerr.text,
                       jerr.line, jerr.column);
    int rc = -1;
    if (!json_is_object(root)) {
        ms_errf(err, errlen, "%s: not a JSON object", path);
        goto out;
    }
    json_t *mt = json_object_get(root, "model_type");
    if (!json_is_string(mt)) {
        ms_errf(err, errlen, "%s: missing 'model_type' string", path);
        goto out;
    }
    const char *type = json_string_value(mt);
    int (*arch)(json_t *, struct model_desc *, const char *, char *, size_t) = NULL;
    if (strcmp(type, "mixtral") == 0)
        arch = cfg_mixtral;
    else if (strcmp(type, "qwen2_moe") == 0)
        arch = cfg_qwen2_moe;
    else if (strcmp(type, "qwen3_moe") == 0)
        arch = cfg_qwen3_moe;
    else if (strcmp(type, "olmoe") == 0)
        arch = cfg_olmoe;
    else if (strcmp(type, "mohge") == 0)
        arch = cfg_mohge;
    else if (strcmp(type, "deepseek_v2") == 0 || strcmp(type, "deepseek_v3") == 0 ||
             strcmp(type, "deepseek_v32") == 0 || strcmp(type, "glm_moe_dsa") == 0)
        arch = cfg_deepseek;
    else if (strcmp(type, "deepseek_v4") == 0)
        arch = cfg_deepseek_v4;
    else if (strcmp(type, "gpt_oss") == 0)
        arch = cfg_gpt_oss;
    else if (strcmp(type, "glm4_moe") == 0)
        arch = cfg_glm4_moe;
    else if (strcmp(type, "minimax_m2") == 0)
        arch = cfg_minimax_m2;
    else if (strcmp(type, "infmoe") == 0)
        arch = cfg_infmoe;
    else if (strcmp(type, "qwen3_next") == 0)
        arch = cfg_qwen3_next;
    else if (strcmp(type, "granitemoehybrid") == 0)
        arch = cfg_granitemoehybrid;
    else if (strcmp(type, "qwen3_5_moe") == 0 || strcmp(type, "qwen3_5_moe_text") == 0)
        arch = cfg_qwen3_5_moe;
    else if (strcmp(type, "kimi_k25") == 0)
        arch = cfg_deepseek; /* its text_config is DeepSeek-V3's (below) */
    else if (strcmp(type, "llama4_text") == 0 || strcmp(type, "llama4") == 0)
        arch = cfg_llama4;
    if (!arch) {
        ms_errf(err, errlen,
                "%s: unknown model_type '%.64s' (supported: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                "deepseek_v2, deepseek_v3, deepseek_v32, deepseek_v4, glm4_moe, glm_moe_dsa, "
                "minimax_m2, gpt_oss, qwen3_next, qwen3_5_moe, granitemoehybrid, kimi_k25, llama4_text, llama4, mohge, infmoe)",
                path, type);
        goto out;
    }
    snprintf(desc->model_type, sizeof desc->model_type, "%s", type);
    /* A multimodal folder (Qwen3.5's and Kimi-K2.5's ...ForConditionalGeneration) describes its
     * text model in text_config; that is the model served (text only: the vision tower is never
     * bound). Kimi-K2.5's text model is DeepSeek-V3 (model_type deepseek_v3, or kimi_k2 in
     * Moonshot's own files). */
    json_t *text = root;
    bool kimi = strcmp(type, "kimi_k25") == 0;
    if (arch == cfg_qwen3_5_moe) snprintf(desc->model_type, sizeof desc->model_type, "qwen3_5_moe");
    if (arch == cfg_llama4) snprintf(desc->model_type, sizeof desc->model_type, "llama4_text");
    if (arch == cfg_qwen3_5_moe || arch == cfg_llama4 || kimi) {
        json_t *tc = json_object_get(root, "text_config");
        if (kimi && !json_is_object(tc)) {
            ms_errf(err, errlen, "%s: kimi_k25 needs a 'text_config' object", path);
            goto out;
        }
        if (tc && !json_is_null(tc)) {
            if (!json_is_object(tc)) {
                ms_errf(err, errlen, "%s: 'text_config' must be an object", path);
                goto out;
            }
            text = tc;
            json_t *tie = json_object_get(root, "tie_word_embeddings");
            if (tie && !json_object_get(tc, "tie_word_embeddings") &&
                json_object_set(tc, "tie_word_embeddings", tie) != 0) {
                ms_errf(err, errlen, "%s: out of memory", path);
                goto out;
            }
        }
        if (kimi) {
            const char *tt = json_string_value(json_object_get(tc, "model_type"));
            if (tt && strcmp(tt, "deepseek_v3") != 0 && strcmp(tt, "kimi_k2") != 0) {
                ms_errf(err, errlen,
                        "%s: text_config.model_type '%.32s' is not supported for kimi_k25 (only "
                        "'deepseek_v3' / 'kimi_k2')",
                        path, tt);
                goto out;
            }
            snprintf(desc->model_type, sizeof desc->model_type, "deepseek_v3");
        }
    }
    if (cfg_common(text, desc, path, err, errlen) != 0 || arch(text, desc, path, err, errlen) != 0)
        goto out;
    /* Pre-quantized checkpoints: only gpt-oss's MXFP4 experts are read (the loader finds them
     * by their _blocks/_scales tensors). Other formats (FP8 DeepSeek-V3, GPTQ, AWQ...) are
     * refused by name rather than loaded as if the packed tensors were weights. */
    json_t *qc = json_object_get(root, "quantization_config");
    if (qc && !json_is_null(qc)) {
        const char *qm = json_string_value(json_object_get(qc, "quant_method"));
        bool mxfp4 = arch == cfg_gpt_oss && qm && strcmp(qm, "mxfp4") == 0;
        if (!mxfp4) {
            ms_errf(err, errlen,
                    "%s: quantization_config.quant_method '%.32s' is not supported for %s (%s; "
                    "--quantization int8|int4 quantizes at load)",
                    path, qm ? qm : "?", type,
                    arch == cfg_gpt_oss ? "only 'mxfp4'" : "load an unquantized checkpoint");
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(root);
    if (rc != 0) model_desc_free(desc);
    return rc;
}

int model_desc_apply_generation_config(struct model_desc *desc, const char *json_text, size_t len,
                                       const char *path, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root = json_loadb(json_text, len, 0, &jerr);
    if (!root)
        return ms_errf(err, errlen, "%s: not valid JSON: %s (line %d, column %d)", path, jerr.text,
                       jerr.line, jerr.column);
    int rc;
    if (!json_is_object(root)) {
        rc = ms_errf(err, errlen, "%s: not a JSON object", path);
    } else {
        struct model_desc tmp = *desc; /* only bos/eos are touched; keep the old on failure */
        rc = cfg_special_ids(root, &tmp, path, err, errlen);
        if (rc == 0) {
            desc->bos_id = tmp.bos_id;
            memcpy(desc->eos_ids, tmp.eos_ids, sizeof desc->eos_ids);
            desc->n_eos = tmp.n_eos;
        }
    }
    json_decref(root);
    return rc;
}
