/* make_synthetic_model: writes a model folder with random weights (config.json,
 * generation_config.json, model.safetensors; no tokenizer) for benchmarks and load tests at
 * sizes no fixture has. Two shapes:
 *   mixtral (default): about --params parameters in all: the hidden size and layer count come
 *     from a ladder by target size, 64-wide heads with half as many KV heads, and the expert
 *     width is solved so that the total lands near the target; or, with --active, about that
 *     many parameters per token (--hidden and --layers then set the rest, GQA 4:1): the
 *     equal-active-parameters counterpart of a deepseek folder.
 *   deepseek: DeepSeek-V2-Lite's layer (hidden 2048, 16 heads of MLA with kv_lora_rank 512,
 *     nope/rope/v 128/64/128, top-6 of experts of width 1408 plus 2 shared, the first layer
 *     dense of width 10944), with --layers layers and --experts routed experts (V2-Lite: 27
 *     and 64) so that it fits a machine; --heads sets the MLA heads (V3 and V3.2: 128).
 *   deepseek_v32: the deepseek shape with DeepSeek-V3.2's sparse attention: a query LoRA of
 *     rank 512, V3's sigmoid routing with a correction bias (one group), and each layer's
 *     lightning indexer as V3.2 has it (64 heads of 128, index_topk 2048); --index-topk changes
 *     the top-k (bench/bench_dsa.c).
 *   qwen3_5_moe: Qwen3.5-35B-A3B's layout scaled down to about 1B (hidden 1024, 8 layers of
 *     which every 4th is gated full attention (8 heads of 128, 2 KV heads, rotary 0.25) and
 *     the others Gated DeltaNet (4 key heads and 8 value heads of 128, conv 4), 128 experts
 *     (top-8) of width 256 plus a gated shared expert of 512); --layers and --experts change
 *     the counts.
 * Weights are uniform with std 1/sqrt(fan_in) from a per-tensor seeded xoshiro256** (so a
 * tensor's values do not depend on write order), norms are 1. Tensors are streamed to disk in
 * chunks through stw_begin / stw_write_tensor, so memory stays at one chunk whatever the model
 * size.
 *
 * --tokenizer DIR copies DIR's tokenizer.json (and tokenizer_config.json, or writes one naming the
 * tokens of ids 1 and 2 as bos/eos) so that servers and converters can use the folder; the
 * tokenizer must fit the vocabulary (the Llama-2 tokenizer fits the default 32000).
 *
 * usage: make_synthetic_model OUT_DIR [--arch mixtral|deepseek|deepseek_v32|qwen3_5_moe]
 *                             [--params 100M] [--index-topk 2048]
 *                             [--active N]
 *                             [--hidden D] [--layers L] [--dtype f32|bf16] [--experts 8]
 *                             [--top-k 2] [--seed S] [--vocab 32000] [--tokenizer DIR]
 *                             [--max-pos N]   max_position_embeddings (4096; qwen3_5_moe 32768) */
#include "common.h"
#include "rng.h"
#include "st_writer.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK (1u << 20) /* elements generated per write */

static void rng_seed(struct ms_rng *r, uint64_t seed, const char *name)
{
    /* One stream per tensor: the seed mixed with the tensor's name (FNV-1a). */
    uint64_t x = seed;
    for (const char *p = name; *p; p++) x = (x ^ (unsigned char)*p) * 0x100000001b3ull;
    ms_rng_seed(r, x);
}

/* Uniform in [-1, 1). */
static float rng_unit(struct ms_rng *r)
{
    return (float)((double)(ms_rng_next(r) >> 40) * 0x1p-23 - 1.0);
}

struct shapes {
    int d, layers, heads, kv, ff, experts, top_k, vocab;
    int max_pos; /* max_position_embeddings (--max-pos; default 4096, qwen3_5_moe 32768) */
    bool deepseek, qwen35;
    bool v32;      /* deepseek_v32: the query LoRA, V3 routing and the indexer */
    int index_topk;
};

/* The qwen3_5_moe shape (see the top of the file). */
enum {
    Q35_HIDDEN = 1024, Q35_HEADS = 8, Q35_KV = 2, Q35_HD = 128, Q35_NK = 4, Q35_NV = 8,
    Q35_DK = 128, Q35_CONV = 4, Q35_FF = 256, Q35_SHARED = 512, Q35_INTERVAL = 4,
};

/* A config key with an integer value. */
struct cfg_int {
    const char *k;
    int v;
};

/* Sets the n integer keys, rms_norm_eps 1e-6 and dtype on config c (NULL stays NULL). */
static json_t *config_finish(json_t *c, const struct cfg_int *ints, size_t n, const char *dtype)
{
    for (size_t i = 0; c && i < n; i++) json_object_set_new(c, ints[i].k, json_integer(ints[i].v));
    if (c) {
        json_object_set_new(c, "rms_norm_eps", json_real(1e-6));
        json_object_set_new(c, "dtype", json_string(strcmp(dtype, "bf16") == 0 ? "bfloat16"
                                                                                : "float32"));
    }
    return c;
}

static json_t *qwen35_config(const struct shapes *s, const char *dtype)
{
    json_t *types = json_array();
    for (int l = 0; types && l < s->layers; l++)
        json_array_append_new(types, json_string((l + 1) % Q35_INTERVAL ? "linear_attention"
                                                                         : "full_attention"));
    json_t *c = json_pack("{s:[s], s:s, s:s, s:b, s:{s:f, s:s, s:f}, s:o}", "architectures",
                          "Qwen3_5MoeForCausalLM", "model_type", "qwen3_5_moe_text",
                          "hidden_act", "silu", "tie_word_embeddings", 0, "rope_parameters",
                          "rope_theta", 1e7, "rope_type", "default", "partial_rotary_factor",
                          0.25, "layer_types", types);
    const struct cfg_int ints[] = {{"hidden_size", s->d},          {"num_hidden_layers", s->layers},
                {"num_attention_heads", Q35_HEADS}, {"num_key_value_heads", Q35_KV},
                {"head_dim", Q35_HD},            {"linear_num_key_heads", Q35_NK},
                {"linear_num_value_heads", Q35_NV}, {"linear_key_head_dim", Q35_DK},
                {"linear_value_head_dim", Q35_DK}, {"linear_conv_kernel_dim", Q35_CONV},
                {"num_experts", s->experts},     {"num_experts_per_tok", s->top_k},
                {"moe_intermediate_size", s->ff}, {"shared_expert_intermediate_size", Q35_SHARED},
                {"vocab_size", s->vocab},        {"max_position_embeddings", s->max_pos},
                {"bos_token_id", 1},             {"eos_token_id", 2}};
    return config_finish(c, ints, sizeof ints / sizeof ints[0], dtype);
}

/* DeepSeek-V2-Lite's per-layer shapes (its config.json). */
enum {
    DS_HIDDEN = 2048, DS_HEADS = 16, DS_KV_LORA = 512, DS_NOPE = 128, DS_ROPE = 64, DS_V = 128,
    DS_MOE_FF = 1408, DS_TOP_K = 6, DS_SHARED = 2, DS_DENSE_FF = 10944,
    DS_Q_LORA = 512, DS_IDX_HEADS = 64, DS_IDX_DIM = 128, /* deepseek_v32 */
};

/* Parameters one token uses in a mixtral-shaped model (as model_active_params counts them:
 * attention, norms, router, top_k experts per layer, final norm and LM head). */
static double active_params(const struct shapes *s)
{
    double d = s->d, hd = 64;
    double layer = 2 * d + 2 * d * s->heads * hd + 2 * d * s->kv * hd + (double)s->experts * d +
                   3.0 * d * s->ff * s->top_k;
    return (double)s->vocab * d + d + s->layers * layer;
}

/* --active: the expert width that gives about `target` active parameters (a multiple of 64). */
static void solve_active(double target, struct shapes *s)
{
    s->heads = s->d / 64;
    s->kv = s->heads / 4 > 0 ? s->heads / 4 : 1;
    s->ff = 0;
    double rest = target - active_params(s), per_ff = 3.0 * s->d * s->top_k * s->layers;
    s->ff = 64 * (int)fmax(1.0, floor(rest / per_ff / 64.0 + 0.5));
}

static size_t total_params(const struct shapes *s)
{
    size_t d = (size_t)s->d, hd = 64;
    size_t attn = 2 * d * (size_t)s->heads * hd + 2 * d * (size_t)s->kv * hd;
    size_t layer =
        2 * d + attn + (size_t)s->experts * d + (size_t)s->experts * 3 * d * (size_t)s->ff;
    return 2 * (size_t)s->vocab * d + d + (size_t)s->layers * layer;
}

static void pick_shapes(double target, struct shapes *s)
{
    static const struct {
        double upto;
        int d, layers;
    } ladder[] = {
        {30e6, 256, 4}, {300e6, 512, 8}, {1.5e9, 1024, 16}, {8e9, 2048, 24}, {1e30, 4096, 32}};
    int i = 0;
    while (target > ladder[i].upto)
        i++;
    s->d = ladder[i].d;
    s->layers = ladder[i].layers;
    s->heads = s->d / 64;
    s->kv = s->heads / 2 > 0 ? s->heads / 2 : 1;
    s->ff = 64;
    double rest = target - (double)total_params(s);
    double per_ff = (double)s->layers * s->experts * 3.0 * s->d;
    if (rest > 0) s->ff = 64 * (int)fmax(1.0, floor((64.0 + rest / per_ff) / 64.0 + 0.5));
}

static int parse_count(const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    if (*end == 'K' || *end == 'k')
        v *= 1e3, end++;
    else if (*end == 'M' || *end == 'm')
        v *= 1e6, end++;
    else if (*end == 'B' || *end == 'b' || *end == 'G' || *end == 'g')
        v *= 1e9, end++;
    if (*end) return -1;
    *out = v;
    return 0;
}

/* DeepSeek-V2's config.json for shapes s (greedy softmax routing as V2-Lite). */
static json_t *deepseek_config(const struct shapes *s, const char *dtype)
{
    json_t *c = json_pack("{s:[s], s:s, s:s, s:s, s:s, s:n, s:b, s:{s:f, s:s}}", "architectures",
                          "DeepseekV2ForCausalLM", "model_type", "deepseek_v2", "topk_method",
                          "greedy", "scoring_func", "softmax", "hidden_act", "silu",
                          "q_lora_rank", "tie_word_embeddings", 0, "rope_parameters",
                          "rope_theta", 1e4, "rope_type", "default");
    const struct cfg_int ints[] = {{"hidden_size", s->d},           {"num_hidden_layers", s->layers},
                {"num_attention_heads", s->heads}, {"num_key_value_heads", s->heads},
                {"kv_lora_rank", DS_KV_LORA},    {"qk_nope_head_dim", DS_NOPE},
                {"qk_rope_head_dim", DS_ROPE},   {"v_head_dim", DS_V},
                {"n_routed_experts", s->experts}, {"num_experts_per_tok", s->top_k},
                {"moe_intermediate_size", DS_MOE_FF}, {"n_shared_experts", DS_SHARED},
                {"first_k_dense_replace", 1},    {"intermediate_size", DS_DENSE_FF},
                {"moe_layer_freq", 1},           {"vocab_size", s->vocab},
                {"max_position_embeddings", s->max_pos}, {"bos_token_id", 1},
                {"eos_token_id", 2},             {"pad_token_id", 0}};
    if (c) {
        json_object_set_new(c, "routed_scaling_factor", json_real(1.0));
        json_object_set_new(c, "norm_topk_prob", json_false());
    }
    if (c && s->v32) { /* V3.2: V3's routing, the query LoRA, the indexer */
        json_t *lt = json_array(), *mt = json_array();
        for (int l = 0; l < s->layers; l++) {
            json_array_append_new(lt, json_string("indexed_attention"));
            json_array_append_new(mt, json_string(l == 0 ? "dense" : "sparse"));
        }
        json_object_update(c, json_pack("{s:[s], s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, "
                                        "s:b, s:o, s:o}",
                                        "architectures", "DeepseekV32ForCausalLM", "model_type",
                                        "deepseek_v32", "topk_method", "noaux_tc", "scoring_func",
                                        "sigmoid", "q_lora_rank", DS_Q_LORA, "n_group", 1,
                                        "topk_group", 1, "index_n_heads", DS_IDX_HEADS,
                                        "index_head_dim", DS_IDX_DIM, "index_topk",
                                        s->index_topk, "norm_topk_prob", 1, "layer_types", lt,
                                        "mlp_layer_types", mt));
    }
    return config_finish(c, ints, sizeof ints / sizeof ints[0], dtype);
}

/* The mixtral config writes rope_theta twice, in rope_parameters (transformers 5) and at the top
 * level (transformers 4), and head_dim explicitly, so that converters that read only the older
 * form (e.g. to GGUF) see the same model. */
static int write_configs(const char *dir, const struct shapes *s, const char *dtype)
{
    char path[4096];
    json_t *cfg = s->qwen35 ? qwen35_config(s, dtype) : s->deepseek ? deepseek_config(s, dtype) :
        json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:s, "
                  "s:{s:f, s:s}, s:f, s:n, s:b, s:i, s:i, s:s}",
                  "architectures", "MixtralForCausalLM", "model_type", "mixtral", "hidden_size",
                  s->d, "num_hidden_layers", s->layers, "num_attention_heads", s->heads,
                  "num_key_value_heads", s->kv, "intermediate_size", s->ff, "head_dim", 64,
                  "num_local_experts", s->experts, "num_experts_per_tok", s->top_k, "vocab_size",
                  s->vocab, "max_position_embeddings", s->max_pos, "bos_token_id", 1, "rms_norm_eps",
                  1e-5, "hidden_act", "silu", "rope_parameters", "rope_theta", 1e6, "rope_type",
                  "default", "rope_theta", 1e6, "sliding_window", "tie_word_embeddings", 0, "eos_token_id", 2,
                  "pad_token_id", 0, "dtype", strcmp(dtype, "bf16") == 0 ? "bfloat16" : "float32");
    json_t *gen = json_pack("{s:i, s:i}", "bos_token_id", 1, "eos_token_id", 2);
    int rc = -1;
    if (!cfg || !gen) goto out;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (json_dump_file(cfg, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) goto out;
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (json_dump_file(gen, path, JSON_INDENT(2)) != 0) goto out;
    rc = 0;
out:
    if (rc != 0) fprintf(stderr, "make_synthetic_model: cannot write %s/config.json\n", dir);
    json_decref(cfg);
    json_decref(gen);
    return rc;
}

/* Copies src to dst byte for byte. */
static int copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *out = in ? fopen(dst, "wb") : NULL;
    char buf[1 << 16];
    size_t k;
    int rc = in && out ? 0 : -1;
    while (rc == 0 && (k = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, k, out) != k) rc = -1;
    if (in && ferror(in)) rc = -1;
    if (in) fclose(in);
    if (out && fclose(out) != 0) rc = -1;
    if (rc != 0) fprintf(stderr, "make_synthetic_model: cannot copy %s to %s\n", src, dst);
    return rc;
}

/* The text of token `id` in a tokenizer.json (added tokens first, then the model's vocab), or
 * NULL. Borrowed from `tj`. */
static const char *token_text(json_t *tj, int id)
{
    size_t i;
    json_t *t;
    json_array_foreach(json_object_get(tj, "added_tokens"), i, t)
    {
        if (json_integer_value(json_object_get(t, "id")) == id)
            return json_string_value(json_object_get(t, "content"));
    }
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(json_object_get(tj, "model"), "vocab"), key, v)
    {
        if (json_is_integer(v) && json_integer_value(v) == id) return key;
    }
    return NULL;
}

/* Puts the tokenizer of folder `src` into `dir`: tokenizer.json as is, after checking that every
 * id fits `vocab`, and tokenizer_config.json as is or, when src has none, one with the tokens of
 * ids 1 and 2 (the config's bos/eos ids) as bos_token/eos_token. */
static int add_tokenizer(const char *dir, const char *src, int vocab)
{
    char from[4096], to[4096];
    json_error_t je;
    json_t *cfg = NULL;
    int rc = -1;
    snprintf(from, sizeof from, "%s/tokenizer.json", src);
    json_t *tj = json_load_file(from, 0, &je);
    if (!tj) {
        fprintf(stderr, "make_synthetic_model: %s:%d: %s\n", from, je.line, je.text);
        return -1;
    }
    json_int_t max_id = -1;
    size_t i;
    const char *key;
    json_t *v;
    json_array_foreach(json_object_get(tj, "added_tokens"), i, v)
    {
        json_int_t id = json_integer_value(json_object_get(v, "id"));
        if (id > max_id) max_id = id;
    }
    json_object_foreach(json_object_get(json_object_get(tj, "model"), "vocab"), key, v)
    {
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    if (max_id < 0 || max_id >= vocab) {
        fprintf(stderr,
                "make_synthetic_model: %s: token ids up to %lld do not fit --vocab %d (or the "
                "file has no vocabulary)\n",
                from, (long long)max_id, vocab);
        goto out;
    }
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    if (copy_file(from, to) != 0) goto out;
    snprintf(from, sizeof from, "%s/tokenizer_config.json", src);
    snprintf(to, sizeof to, "%s/tokenizer_config.json", dir);
    if (access(from, F_OK) == 0) {
        rc = copy_file(from, to);
        goto out;
    }
    const char *bos = token_text(tj, 1), *eos = token_text(tj, 2);
    if (!bos || !eos) {
        fprintf(stderr, "make_synthetic_model: %s has no tokens 1 and 2 for bos/eos\n", src);
        goto out;
    }
    cfg = json_pack("{s:s, s:s, s:b, s:b}", "bos_token", bos, "eos_token", eos, "add_bos_token", 1,
                    "add_eos_token", 0);
    if (!cfg || json_dump_file(cfg, to, JSON_INDENT(2)) != 0) {
        fprintf(stderr, "make_synthetic_model: cannot write %s\n", to);
        goto out;
    }
    rc = 0;
out:
    json_decref(cfg);
    json_decref(tj);
    return rc;
}

/* Fills tensor `idx` (rows x cols; cols == 0 for a norm vector of ones) chunk by chunk. */
static int stream_tensor(struct stw *w, int idx, const char *name, int64_t rows, int64_t cols,
                         bool bf16, uint64_t seed, void *buf, char *err, size_t errlen)
{
    struct ms_rng r;
    rng_seed(&r, seed, name);
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    float scale = cols ? sqrtf(3.0f / (float)cols) : 0.0f; /* uniform(-a, a) has std a/sqrt(3) */
    size_t esz = bf16 ? 2 : 4;
    for (size_t off = 0; off < n; off += CHUNK) {
        size_t k = n - off < CHUNK ? n - off : CHUNK;
        for (size_t i = 0; i < k; i++) {
            float v = cols ? scale * rng_unit(&r) : 1.0f;
            if (bf16)
                ((uint16_t *)buf)[i] = ms_f32_to_bf16(v);
            else
                ((float *)buf)[i] = v;
        }
        if (stw_write_tensor(w, idx, off * esz, buf, k * esz, err, errlen) != 0) return -1;
    }
    return 0;
}

struct decl {
    char name[128];
    int64_t rows, cols;
    int64_t mid; /* > 0: a 3D tensor (rows, mid, cols) (a conv1d's (channels, 1, kernel)) */
};

int main(int argc, char **argv)
{
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr,
                "usage: %s OUT_DIR [--arch mixtral|deepseek|deepseek_v32|qwen3_5_moe] [--params 100M] "
                "[--active N] [--index-topk N] [--heads H (deepseek: MLA heads, 16)] "
                "[--hidden D] [--layers L] [--dtype f32|bf16] [--experts 8] [--top-k 2] "
                "[--seed S] [--vocab 32000] [--tokenizer DIR] [--max-pos N]\n",
                argv[0]);
        return 2;
    }
    const char *dir = argv[1], *dtype = "f32", *tokenizer = NULL;
    double target = 100e6, active = 0;
    struct shapes s = {.experts = 0, .top_k = 0, .vocab = 32000};
    uint64_t seed = 1234;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool bad = v == NULL;
        if (!bad && strcmp(a, "--params") == 0)
            bad = parse_count(v, &target) != 0;
        else if (!bad && strcmp(a, "--active") == 0)
            bad = parse_count(v, &active) != 0;
        else if (!bad && strcmp(a, "--arch") == 0) {
            s.v32 = strcmp(v, "deepseek_v32") == 0;
            bad = !(s.deepseek = s.v32 || strcmp(v, "deepseek") == 0) &&
                  !(s.qwen35 = strcmp(v, "qwen3_5_moe") == 0) && strcmp(v, "mixtral") != 0;
        } else if (!bad && strcmp(a, "--index-topk") == 0)
            bad = (s.index_topk = atoi(v)) <= 0;
        else if (!bad && strcmp(a, "--hidden") == 0)
            bad = (s.d = atoi(v)) <= 0 || s.d % 64 != 0;
        else if (!bad && strcmp(a, "--heads") == 0)
            bad = (s.heads = atoi(v)) <= 0 || s.heads > 1024;
        else if (!bad && strcmp(a, "--layers") == 0)
            bad = (s.layers = atoi(v)) <= 0;
        else if (!bad && strcmp(a, "--dtype") == 0) {
            dtype = v;
            bad = strcmp(v, "f32") != 0 && strcmp(v, "bf16") != 0;
        } else if (!bad && strcmp(a, "--experts") == 0)
            bad = (s.experts = atoi(v)) <= 0 || s.experts > 512;
        else if (!bad && strcmp(a, "--top-k") == 0)
            bad = (s.top_k = atoi(v)) <= 0;
        else if (!bad && strcmp(a, "--seed") == 0)
            seed = strtoull(v, NULL, 0);
        else if (!bad && strcmp(a, "--vocab") == 0)
            bad = (s.vocab = atoi(v)) <= 0;
        else if (!bad && strcmp(a, "--tokenizer") == 0)
            tokenizer = v;
        else if (!bad && strcmp(a, "--max-pos") == 0)
            bad = (s.max_pos = atoi(v)) <= 0;
        else
            bad = true;
        if (bad) {
            fprintf(stderr, "make_synthetic_model: bad option %s %s\n", a, v ? v : "");
            return 2;
        }
        i++;
    }
    if (s.heads && !s.deepseek) {
        fprintf(stderr, "make_synthetic_model: --heads is for --arch deepseek and deepseek_v32 "
                        "(the other shapes take 64-wide heads from --hidden)\n");
        return 2;
    }
    if (!s.experts) s.experts = s.deepseek ? 64 : s.qwen35 ? 128 : 8;
    if (!s.index_topk) s.index_topk = 2048;
    if (!s.max_pos) s.max_pos = s.qwen35 ? 32768 : 4096;
    if (!s.top_k) s.top_k = s.deepseek ? DS_TOP_K : s.qwen35 ? 8 : 2;
    if (s.top_k > s.experts) {
        fprintf(stderr, "make_synthetic_model: --top-k %d exceeds --experts %d\n", s.top_k,
                s.experts);
        return 2;
    }
    if (s.qwen35) {
        s.d = Q35_HIDDEN;
        s.ff = Q35_FF;
        if (!s.layers) s.layers = 8;
        printf("qwen3_5_moe-shaped: hidden %d, layers %d (every %dth gated attention, %d heads "
               "of %d, %d KV; the others Gated DeltaNet, %d key / %d value heads of %d), %d "
               "experts (top-%d) of width %d + a shared one of %d, vocab %d, dtype %s\n",
               s.d, s.layers, Q35_INTERVAL, Q35_HEADS, Q35_HD, Q35_KV, Q35_NK, Q35_NV, Q35_DK,
               s.experts, s.top_k, s.ff, Q35_SHARED, s.vocab, dtype);
    } else if (s.deepseek) {
        s.d = DS_HIDDEN;
        if (!s.heads) s.heads = DS_HEADS; /* V2-Lite's; V3 and V3.2 have 128 */
        s.kv = s.heads;
        s.ff = DS_MOE_FF;
        if (!s.layers) s.layers = 4;
        printf("deepseek-v2-lite-shaped%s: hidden %d, layers %d (the first dense, %d wide), %d "
               "MLA heads (kv_lora_rank %d, nope/rope/v %d/%d/%d), %d experts (top-%d) of width "
               "%d + %d shared, vocab %d, dtype %s\n",
               s.v32 ? " with V3.2's indexer (64 heads of 128, query LoRA 512)" : "", s.d,
               s.layers, DS_DENSE_FF, s.heads, DS_KV_LORA, DS_NOPE, DS_ROPE, DS_V, s.experts,
               s.top_k, s.ff, DS_SHARED, s.vocab, dtype);
    } else if (active > 0) {
        if (!s.d || !s.layers) {
            fprintf(stderr, "make_synthetic_model: --active needs --hidden and --layers\n");
            return 2;
        }
        solve_active(active, &s);
        printf("mixtral-shaped: hidden %d, layers %d, heads %d (kv %d, head_dim 64), experts %d "
               "(top-%d) of width %d, vocab %d; active parameters %.1fM (target %.1fM), total "
               "%.1fM, dtype %s\n",
               s.d, s.layers, s.heads, s.kv, s.experts, s.top_k, s.ff, s.vocab,
               active_params(&s) / 1e6, active / 1e6, (double)total_params(&s) / 1e6, dtype);
    } else {
        pick_shapes(target, &s);
        size_t total = total_params(&s);
        printf("mixtral-shaped: hidden %d, layers %d, heads %d (kv %d, head_dim 64), experts %d "
               "(top-%d) of width %d, vocab %d\n",
               s.d, s.layers, s.heads, s.kv, s.experts, s.top_k, s.ff, s.vocab);
        printf("parameters: %.1fM (target %.1fM)%s, dtype %s\n", (double)total / 1e6,
               target / 1e6, (double)total > 1.5 * target ? " - target too small for this vocab" : "",
               dtype);
    }

    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "make_synthetic_model: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    if (write_configs(dir, &s, dtype) != 0) return 1;
    if (tokenizer && add_tokenizer(dir, tokenizer, s.vocab) != 0) return 1;

    /* Declarations first: the header needs every shape before any data. */
    size_t nd = 3 + (size_t)s.layers * (16 + 3 * (size_t)s.experts);
    struct decl *decls = calloc(nd, sizeof *decls);
    void *buf = malloc(CHUNK * sizeof(float));
    struct stw *w = stw_new();
    char err[MS_ERR_LEN], path[4096];
    int rc = 1, n = 0;
    if (!decls || !buf || !w) {
        fprintf(stderr, "make_synthetic_model: out of memory\n");
        goto out;
    }
#define DECL(r, c, ...)                                                                            \
    do {                                                                                           \
        snprintf(decls[n].name, sizeof decls[n].name, __VA_ARGS__);                                \
        decls[n].rows = (r);                                                                       \
        decls[n++].cols = (c);                                                                     \
    } while (0)
    int q = s.heads * 64, kv = s.kv * 64;
    DECL(s.vocab, s.d, "model.embed_tokens.weight");
    DECL(s.d, 0, "model.norm.weight");
    DECL(s.vocab, s.d, "lm_head.weight");
    for (int l = 0; l < s.layers && s.deepseek; l++) {
        const int qk = DS_NOPE + DS_ROPE, H = s.heads;
        DECL(s.d, 0, "model.layers.%d.input_layernorm.weight", l);
        DECL(s.d, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        if (s.v32) {
            DECL(DS_Q_LORA, s.d, "model.layers.%d.self_attn.q_a_proj.weight", l);
            DECL(DS_Q_LORA, 0, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
            DECL(H * qk, DS_Q_LORA, "model.layers.%d.self_attn.q_b_proj.weight", l);
            DECL(DS_IDX_HEADS * DS_IDX_DIM, DS_Q_LORA, "model.layers.%d.self_attn.indexer.wq_b.weight",
                 l);
            DECL(DS_IDX_DIM, s.d, "model.layers.%d.self_attn.indexer.wk.weight", l);
            DECL(DS_IDX_DIM, 0, "model.layers.%d.self_attn.indexer.k_norm.weight", l);
            DECL(DS_IDX_DIM, 0, "model.layers.%d.self_attn.indexer.k_norm.bias", l);
            DECL(DS_IDX_HEADS, s.d, "model.layers.%d.self_attn.indexer.weights_proj.weight", l);
        } else {
            DECL(H * qk, s.d, "model.layers.%d.self_attn.q_proj.weight", l);
        }
        DECL(DS_KV_LORA + DS_ROPE, s.d, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
        DECL(DS_KV_LORA, 0, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
        DECL(H * (DS_NOPE + DS_V), DS_KV_LORA, "model.layers.%d.self_attn.kv_b_proj.weight", l);
        DECL(s.d, H * DS_V, "model.layers.%d.self_attn.o_proj.weight", l);
        const char *p[3] = {"gate_proj", "up_proj", "down_proj"};
        if (l == 0) { /* first_k_dense_replace 1 */
            for (int j = 0; j < 3; j++)
                DECL(j == 2 ? s.d : DS_DENSE_FF, j == 2 ? DS_DENSE_FF : s.d,
                     "model.layers.%d.mlp.%s.weight", l, p[j]);
            continue;
        }
        DECL(s.experts, s.d, "model.layers.%d.mlp.gate.weight", l);
        if (s.v32) DECL(s.experts, 0, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        for (int e = 0; e < s.experts; e++)
            for (int j = 0; j < 3; j++)
                DECL(j == 2 ? s.d : s.ff, j == 2 ? s.ff : s.d,
                     "model.layers.%d.mlp.experts.%d.%s.weight", l, e, p[j]);
        for (int j = 0; j < 3; j++)
            DECL(j == 2 ? s.d : DS_SHARED * s.ff, j == 2 ? DS_SHARED * s.ff : s.d,
                 "model.layers.%d.mlp.shared_experts.%s.weight", l, p[j]);
    }
    for (int l = 0; l < s.layers && s.qwen35; l++) {
        const char *p[3] = {"gate_proj", "up_proj", "down_proj"};
        DECL(s.d, 0, "model.layers.%d.input_layernorm.weight", l);
        DECL(s.d, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        if ((l + 1) % Q35_INTERVAL) {
            int kd = Q35_NK * Q35_DK, vd = Q35_NV * Q35_DK, conv = 2 * kd + vd;
            DECL(conv, s.d, "model.layers.%d.linear_attn.in_proj_qkv.weight", l);
            DECL(vd, s.d, "model.layers.%d.linear_attn.in_proj_z.weight", l);
            DECL(Q35_NV, s.d, "model.layers.%d.linear_attn.in_proj_b.weight", l);
            DECL(Q35_NV, s.d, "model.layers.%d.linear_attn.in_proj_a.weight", l);
            DECL(conv, Q35_CONV, "model.layers.%d.linear_attn.conv1d.weight", l);
            decls[n - 1].mid = 1;
            DECL(Q35_NV, 0, "model.layers.%d.linear_attn.A_log", l);
            DECL(Q35_NV, 0, "model.layers.%d.linear_attn.dt_bias", l);
            DECL(Q35_DK, 0, "model.layers.%d.linear_attn.norm.weight", l);
            DECL(s.d, vd, "model.layers.%d.linear_attn.out_proj.weight", l);
        } else {
            int qd = Q35_HEADS * Q35_HD, kvd = Q35_KV * Q35_HD;
            DECL(2 * qd, s.d, "model.layers.%d.self_attn.q_proj.weight", l);
            DECL(kvd, s.d, "model.layers.%d.self_attn.k_proj.weight", l);
            DECL(kvd, s.d, "model.layers.%d.self_attn.v_proj.weight", l);
            DECL(s.d, qd, "model.layers.%d.self_attn.o_proj.weight", l);
            DECL(Q35_HD, 0, "model.layers.%d.self_attn.q_norm.weight", l);
            DECL(Q35_HD, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        }
        DECL(s.experts, s.d, "model.layers.%d.mlp.gate.weight", l);
        for (int e = 0; e < s.experts; e++)
            for (int j = 0; j < 3; j++)
                DECL(j == 2 ? s.d : s.ff, j == 2 ? s.ff : s.d,
                     "model.layers.%d.mlp.experts.%d.%s.weight", l, e, p[j]);
        for (int j = 0; j < 3; j++)
            DECL(j == 2 ? s.d : Q35_SHARED, j == 2 ? Q35_SHARED : s.d,
                 "model.layers.%d.mlp.shared_expert.%s.weight", l, p[j]);
        DECL(1, s.d, "model.layers.%d.mlp.shared_expert_gate.weight", l);
    }
    for (int l = 0; l < s.layers && !s.deepseek && !s.qwen35; l++) {
        DECL(s.d, 0, "model.layers.%d.input_layernorm.weight", l);
        DECL(s.d, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        DECL(q, s.d, "model.layers.%d.self_attn.q_proj.weight", l);
        DECL(kv, s.d, "model.layers.%d.self_attn.k_proj.weight", l);
        DECL(kv, s.d, "model.layers.%d.self_attn.v_proj.weight", l);
        DECL(s.d, q, "model.layers.%d.self_attn.o_proj.weight", l);
        DECL(s.experts, s.d, "model.layers.%d.block_sparse_moe.gate.weight", l);
        for (int e = 0; e < s.experts; e++) {
            DECL(s.ff, s.d, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e);
            DECL(s.d, s.ff, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e);
            DECL(s.ff, s.d, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e);
        }
    }
#undef DECL
    bool bf16 = strcmp(dtype, "bf16") == 0;
    for (int i = 0; i < n; i++) {
        int64_t shape[3] = {decls[i].rows, decls[i].cols};
        int ndim = decls[i].cols ? 2 : 1;
        if (decls[i].mid > 0) {
            shape[1] = decls[i].mid;
            shape[2] = decls[i].cols;
            ndim = 3;
        }
        if (stw_add(w, decls[i].name, bf16 ? ST_DTYPE_BF16 : ST_DTYPE_F32, ndim, shape, NULL, err,
                    sizeof err) < 0)
            goto fail;
    }
    if (stw_set_metadata(w, "format", "pt", err, sizeof err) != 0) goto fail;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (stw_begin(w, path, err, sizeof err) != 0) goto fail;
    double t0 = ms_now();
    for (int i = 0; i < n; i++)
        if (stream_tensor(w, i, decls[i].name, decls[i].rows, decls[i].cols, bf16, seed, buf, err,
                          sizeof err) != 0)
            goto fail;
    if (stw_end(w, err, sizeof err) != 0) goto fail;
    printf("wrote %s (%d tensors) in %.1f s\n", path, n, ms_now() - t0);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "make_synthetic_model: %s\n", err);
out:
    stw_free(w);
    free(buf);
    free(decls);
    return rc;
}
