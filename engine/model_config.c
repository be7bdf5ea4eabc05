/* config.json -> struct model_desc. Each supported Hugging Face architecture (mixtral,
 * qwen2_moe, qwen3_moe, olmoe, and moeserve's own mohge) is translated into the one
 * architecture-neutral description the forward pass reads: attention kind and q/k norm, biases,
 * which layers are MoE, expert widths and groups, shared experts and their gate. Fields are
 * type-checked; anything the engine cannot run exactly (rope scaling, sliding-window layer
 * mixes, activations other than SiLU, MLA) is refused with a message naming the field rather
 * than run approximately. generation_config.json may override the BOS/EOS ids
 * (model_desc_apply_generation_config). */
#include "model.h"

#include "common.h"

#include <jansson.h>
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

/* Checks that the rope is plain RoPE and reads its theta. */
static int cfg_rope(json_t *root, struct model_desc *d, const char *path, char *err, size_t errlen)
{
    double theta = 10000.0;
    if (cfg_num(root, "rope_theta", theta, &theta, path, err, errlen) != 0) return -1;
    json_t *rp = json_object_get(root, "rope_parameters");
    if (rp && !json_is_null(rp)) {
        if (!json_is_object(rp))
            return ms_errf(err, errlen, "%s: 'rope_parameters' must be an object", path);
        json_t *ty = json_object_get(rp, "rope_type");
        if (ty && !json_is_null(ty) &&
            (!json_is_string(ty) || strcmp(json_string_value(ty), "default") != 0))
            return ms_errf(err, errlen,
                           "%s: rope_parameters.rope_type '%s' is not supported (only 'default')",
                           path, json_is_string(ty) ? json_string_value(ty) : "?");
        if (cfg_num(rp, "rope_theta", theta, &theta, path, err, errlen) != 0) return -1;
    }
    json_t *rs = json_object_get(root, "rope_scaling");
    if (rs && !json_is_null(rs)) {
        json_t *ty = json_is_object(rs) ? json_object_get(rs, "rope_type") : NULL;
        if (!ty && json_is_object(rs)) ty = json_object_get(rs, "type");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "default") != 0)
            return ms_errf(err, errlen,
                           "%s: rope_scaling type '%s' is not supported (only null or 'default')",
                           path, json_is_string(ty) ? json_string_value(ty) : "?");
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
        cfg_positive(d->n_layer, "num_hidden_layers", path, err, errlen) ||
        cfg_int(root, "hidden_size", true, 0, &d->d_model, path, err, errlen) ||
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
    if (cfg_rope(root, d, path, err, errlen) != 0) return -1;
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

static int cfg_qwen2_moe(json_t *root, struct model_desc *d, const char *path, char *err,
                         size_t errlen)
{
    if (cfg_experts(root, d, "moe_intermediate_size", path, err, errlen) ||
        cfg_moe_layers(root, d, true, path, err, errlen) ||
        cfg_no_qwen_window(root, path, err, errlen) ||
        cfg_bool(root, "norm_topk_prob", false, &d->norm_topk_prob, path, err, errlen) ||
        cfg_bool(root, "qkv_bias", true, &d->qkv_bias, path, err, errlen) ||
        cfg_int(root, "shared_expert_intermediate_size", false, 0, &d->shared_d_ff, path, err,
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

void model_desc_free(struct model_desc *desc)
{
    if (!desc) return;
    free(desc->layer_is_moe);
    free(desc->expert_d_ff);
    free(desc->expert_group);
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
    if (strcmp(type, "deepseek_v2") == 0 || strcmp(type, "deepseek_v3") == 0) {
        ms_errf(err, errlen, "%s: model_type '%s' is not supported yet (MLA attention)", path,
                type);
        goto out;
    }
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
    if (!arch) {
        ms_errf(err, errlen,
                "%s: unknown model_type '%.64s' (supported: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                "mohge)",
                path, type);
        goto out;
    }
    snprintf(desc->model_type, sizeof desc->model_type, "%s", type);
    if (cfg_common(root, desc, path, err, errlen) != 0 || arch(root, desc, path, err, errlen) != 0)
        goto out;
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
