/* Tests for config parsing and model loading: a tiny Mixtral folder built here with the
 * safetensors writer (f32 weights borrowed from the mapping, bf16/f16 converted exactly, tied
 * embeddings, fused 3D experts), config.json parsing of every architecture's quirks, each way a
 * model folder can be broken (each failure must name the file and tensor), and the fixture
 * checkpoints under tests/fixtures/models/ when they exist. */
#include "common.h"
#include "model.h"
#include "st_writer.h"
#include "test.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { D = 16, H = 4, KV = 2, HD = 4, L = 2, E = 4, FF = 8, V = 512 };

static char tmpdir[256];
static const char *tests_dir;

/* How the tiny folder is built, and what is broken in it. */
struct tiny {
    const char *skip;         /* tensor left out */
    const char *wide;         /* tensor given 4 extra columns */
    const char *as_i64;       /* tensor stored as I64 */
    bool bf16_layer1;         /* layer 1 weights in bf16 */
    bool f16_norms;           /* norm weights in f16 */
    bool fused;               /* experts as mlp.experts.gate_up_proj / down_proj */
    bool tied;                /* no lm_head, tie_word_embeddings true */
    const char *model_type;   /* default "mixtral" */
    const char *extra_config; /* appended inside config.json's object */
    bool tokenizer;           /* copy the fixture tokenizer when it exists */
};

/* Deterministic weights: k/1024, exact in f16, rounded in bf16. */
static float weight_value(const char *name, size_t i)
{
    uint32_t h = 2166136261u;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 16777619u;
    uint32_t k = (h + (uint32_t)i * 2654435761u) % 2001u;
    return (float)((int)k - 1000) / 1024.0f;
}

static uint16_t f32_to_f16_exact(float f)
{
    if (f == 0.0f) return 0;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    int exp = (int)((u >> 23) & 0xff) - 127 + 15;
    return (uint16_t)(sign | (exp << 10) | ((u >> 13) & 0x3ff));
}

struct bufs {
    void *p[512];
    int n;
};

static void add(struct stw *w, struct bufs *b, const struct tiny *t, const char *name, int64_t r,
                int64_t c, int64_t z, bool bf16, bool f16)
{
    if (t->skip && strcmp(name, t->skip) == 0) return;
    int64_t shape[3] = {r, c, z};
    int ndim = z ? 3 : c ? 2 : 1;
    if (t->wide && strcmp(name, t->wide) == 0) shape[ndim - 1] += 4;
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    enum st_dtype dt = bf16 ? ST_DTYPE_BF16 : f16 ? ST_DTYPE_F16 : ST_DTYPE_F32;
    if (t->as_i64 && strcmp(name, t->as_i64) == 0) dt = ST_DTYPE_I64;
    void *data = calloc(n, st_dtype_size(dt));
    for (size_t i = 0; i < n; i++) {
        float v = weight_value(name, i);
        if (dt == ST_DTYPE_F32)
            ((float *)data)[i] = v;
        else if (dt == ST_DTYPE_BF16)
            ((uint16_t *)data)[i] = ms_f32_to_bf16(v);
        else if (dt == ST_DTYPE_F16)
            ((uint16_t *)data)[i] = f32_to_f16_exact(v);
        else
            ((int64_t *)data)[i] = (int64_t)i;
    }
    b->p[b->n++] = data;
    char err[256];
    CHECKF(stw_add(w, name, dt, ndim, shape, data, err, sizeof err) >= 0, "%s", err);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
}

static void copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    char buf[65536];
    size_t n;
    while (in && (n = fread(buf, 1, sizeof buf, in)) > 0)
        fwrite(buf, 1, n, out);
    if (in) fclose(in);
    fclose(out);
}

static bool have_fixture_tokenizer(void)
{
    return access(test_path(tests_dir, "fixtures/models/mixtral/tokenizer.json"), R_OK) == 0;
}

/* Builds folder `name` under tmpdir and returns its path (static buffer). */
static const char *make_tiny(const char *name, const struct tiny *t)
{
    static char dir[512];
    char path[700], name_buf[160];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, name);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"model_type\": \"%s\", \"hidden_size\": %d, \"num_hidden_layers\": %d, "
             "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": null, "
             "\"intermediate_size\": %d, \"num_local_experts\": %d, \"num_experts_per_tok\": 2, "
             "\"vocab_size\": %d, \"max_position_embeddings\": 256, \"rms_norm_eps\": 1e-05, "
             "\"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"default\"}, "
             "\"sliding_window\": 64, \"hidden_act\": \"silu\", \"tie_word_embeddings\": %s, "
             "\"bos_token_id\": 1, \"eos_token_id\": 2%s}",
             t->model_type ? t->model_type : "mixtral", D, L, H, KV, FF, E, V,
             t->tied ? "true" : "false", t->extra_config ? t->extra_config : "");
    write_text(path, cfg);
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    write_text(path, "{\"bos_token_id\": 1, \"eos_token_id\": [2, 7]}");
    if (t->tokenizer && have_fixture_tokenizer()) {
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        copy_file(test_path(tests_dir, "fixtures/models/mixtral/tokenizer.json"), path);
        snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
        copy_file(test_path(tests_dir, "fixtures/models/mixtral/tokenizer_config.json"), path);
    }

    struct stw *w = stw_new();
    struct bufs b = {.n = 0};
    add(w, &b, t, "model.embed_tokens.weight", V, D, 0, false, false);
    add(w, &b, t, "model.norm.weight", D, 0, 0, false, t->f16_norms);
    if (!t->tied) add(w, &b, t, "lm_head.weight", V, D, 0, false, false);
    for (int l = 0; l < L; l++) {
        bool bf = t->bf16_layer1 && l == 1;
#define NM(...) (snprintf(name_buf, sizeof name_buf, __VA_ARGS__), name_buf)
        add(w, &b, t, NM("model.layers.%d.input_layernorm.weight", l), D, 0, 0, bf, t->f16_norms);
        add(w, &b, t, NM("model.layers.%d.post_attention_layernorm.weight", l), D, 0, 0, bf,
            t->f16_norms);
        add(w, &b, t, NM("model.layers.%d.self_attn.q_proj.weight", l), H * HD, D, 0, bf, false);
        add(w, &b, t, NM("model.layers.%d.self_attn.k_proj.weight", l), KV * HD, D, 0, bf, false);
        add(w, &b, t, NM("model.layers.%d.self_attn.v_proj.weight", l), KV * HD, D, 0, bf, false);
        add(w, &b, t, NM("model.layers.%d.self_attn.o_proj.weight", l), D, H * HD, 0, bf, false);
        if (t->fused) {
            add(w, &b, t, NM("model.layers.%d.mlp.gate.weight", l), E, D, 0, bf, false);
            add(w, &b, t, NM("model.layers.%d.mlp.experts.gate_up_proj", l), E, 2 * FF, D, bf,
                false);
            add(w, &b, t, NM("model.layers.%d.mlp.experts.down_proj", l), E, D, FF, bf, false);
            continue;
        }
        add(w, &b, t, NM("model.layers.%d.block_sparse_moe.gate.weight", l), E, D, 0, bf, false);
        for (int e = 0; e < E; e++) {
            add(w, &b, t, NM("model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e), FF, D,
                0, bf, false);
            add(w, &b, t, NM("model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e), D, FF,
                0, bf, false);
            add(w, &b, t, NM("model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e), FF, D,
                0, bf, false);
        }
#undef NM
    }
    char err[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECKF(stw_write(w, path, err, sizeof err) == 0, "%s", err);
    stw_free(w);
    for (int i = 0; i < b.n; i++)
        free(b.p[i]);
    return dir;
}

static double last_progress;
static int progress_calls;
static void on_progress(void *ctx, double f)
{
    (void)ctx;
    CHECK(f >= last_progress && f <= 1.0);
    last_progress = f;
    progress_calls++;
}

/* Loaded tensor `name` holds the value the folder was written with (through its dtype). */
static bool same_values(const float *got, const char *name, size_t n, enum st_dtype dt)
{
    for (size_t i = 0; i < n; i++) {
        float v = weight_value(name, i);
        float want = dt == ST_DTYPE_BF16 ? ms_bf16_to_f32(ms_f32_to_bf16(v)) : v;
        if (got[i] != want) return false;
    }
    return true;
}

/* The same for a matrix, read back as f32 row by row (exact for f32/f16/bf16 matrices). */
static bool same_mat(const struct wmat *w, const char *name, enum st_dtype dt)
{
    float *row = malloc(sizeof(float) * (size_t)w->cols);
    bool same = row != NULL;
    for (int r = 0; same && r < w->rows; r++) {
        wmat_row_f32(w, r, row);
        for (int c = 0; same && c < w->cols; c++) {
            float v = weight_value(name, (size_t)r * w->cols + c);
            same = row[c] == (dt == ST_DTYPE_BF16 ? ms_bf16_to_f32(ms_f32_to_bf16(v)) : v);
        }
    }
    free(row);
    return same;
}

static bool in_block(const void *p, const void *block, size_t bytes)
{
    return block && (const char *)p >= (const char *)block &&
           (const char *)p < (const char *)block + bytes;
}

static void test_valid(void)
{
    struct tiny t = {.bf16_layer1 = true, .f16_norms = true, .tokenizer = true};
    const char *dir = make_tiny("valid", &t);
    struct model_load_opts o;
    model_load_opts_default(&o);
    CHECK(o.require_tokenizer == true && o.progress == NULL);
    o.require_tokenizer = have_fixture_tokenizer();
    o.progress = on_progress;
    struct model *m = NULL;
    char err[512] = "";
    CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s", err);
    if (!m) return;
    const struct model_desc *d = &m->desc;
    CHECK(strcmp(d->model_type, "mixtral") == 0);
    CHECK(d->n_layer == L && d->d_model == D && d->vocab == V && d->n_head == H);
    CHECK(d->n_kv_head == KV && d->head_dim == HD && d->max_pos == 256);
    CHECK(fabsf(d->rms_eps - 1e-5f) < 1e-12f && d->rope_theta == 1e6f);
    CHECK(d->sliding_window == 64 && d->attn == ATTN_KIND_GQA && d->qk_norm == QK_NORM_NONE);
    CHECK(!d->qkv_bias && d->clip_qkv == 0 && !d->tie_embeddings);
    CHECK(d->n_expert == E && d->top_k == 2 && d->norm_topk_prob);
    CHECK(d->router == ROUTER_KIND_SOFTMAX_TOPK && d->n_shared == 0 && d->n_group == 0);
    CHECK(d->layer_is_moe[0] && d->layer_is_moe[1]);
    for (int e = 0; e < E; e++)
        CHECK(d->expert_d_ff[e] == FF);
    CHECK(d->bos_id == 1 && d->n_eos == 2 && d->eos_ids[0] == 2 && d->eos_ids[1] == 7);
    CHECK(m->tok != NULL || !have_fixture_tokenizer());
    if (have_fixture_tokenizer()) CHECK(m->chat_template && strstr(m->chat_template, "im_start"));

    /* f32 and bf16 tensors are borrowed from the mapping, in their stored type. */
    const struct st_tensor *st = st_find(m->st, "model.layers.0.self_attn.q_proj.weight");
    CHECK(st && m->layers[0].wq->data == st->data && m->layers[0].wq->type == WTYPE_F32);
    st = st_find(m->st, "model.embed_tokens.weight");
    CHECK(st && m->embed->data == st->data);
    st = st_find(m->st, "model.layers.0.block_sparse_moe.experts.3.w2.weight");
    CHECK(st && m->layers[0].experts[3].down->data == st->data);
    CHECK(m->lm_head != m->embed);
    CHECK(same_mat(m->lm_head, "lm_head.weight", ST_DTYPE_F32));
    const struct wmat *w1 = m->layers[1].experts[2].gate;
    st = st_find(m->st, "model.layers.1.block_sparse_moe.experts.2.w1.weight");
    CHECK(st && w1->data == st->data && w1->type == WTYPE_BF16 && w1->rows == FF && w1->cols == D);
    CHECK(same_mat(w1, "model.layers.1.block_sparse_moe.experts.2.w1.weight", ST_DTYPE_BF16));
    CHECK(same_mat(m->layers[1].experts[2].up,
                   "model.layers.1.block_sparse_moe.experts.2.w3.weight", ST_DTYPE_BF16));
    CHECK(same_mat(m->layers[1].wo, "model.layers.1.self_attn.o_proj.weight", ST_DTYPE_BF16));
    /* Vectors are f32: f16 and bf16 ones converted exactly. */
    CHECK(same_values(m->norm, "model.norm.weight", D, ST_DTYPE_F16));
    CHECK(same_values(m->layers[0].attn_norm, "model.layers.0.input_layernorm.weight", D,
                      ST_DTYPE_F16));
    CHECK(same_values(m->layers[1].attn_norm, "model.layers.1.input_layernorm.weight", D,
                      ST_DTYPE_BF16));
    CHECK(m->layers[0].experts[0].d_ff == FF && m->layers[0].router != NULL);
    CHECK(m->layers[0].bq == NULL && m->layers[0].q_norm == NULL &&
          m->layers[0].shared_gate == NULL);
    /* converted: nothing of the matrices; the f16 norms and layer 1's bf16 norms. */
    size_t layer_params = 2 * D + 2 * (size_t)H * HD * D + 2 * (size_t)KV * HD * D + (size_t)E * D +
                          (size_t)E * 3 * FF * D;
    CHECK(m->converted_bytes == 0 && m->converted == NULL);
    CHECK(m->vector_floats == 2 * D + D + D * 2);
    CHECK(m->n_params == 2 * (size_t)V * D + D + L * layer_params);
    CHECK(m->weight_bytes == 4 * (m->n_params - (layer_params - 2 * D)) +
                                 2 * (layer_params - 2 * D));
    CHECK(progress_calls > 0 && last_progress == 1.0);
    /* active: everything but the embedding and E-k experts per layer. */
    size_t active = m->n_params - (size_t)V * D - L * (size_t)(E - 2) * 3 * FF * D;
    CHECK(model_active_params(m, 2) == active);
    CHECK(model_active_params(m, 1) == active - L * (size_t)3 * FF * D);
    CHECK(model_active_params(m, 99) == model_active_params(m, E));
    model_free(m);
    model_free(NULL);

    /* Tied embeddings: no lm_head tensor needed. */
    const struct tiny ok_default = {0};
    struct tiny tt = {.tied = true};
    dir = make_tiny("tied", &tt);
    o.require_tokenizer = false;
    o.progress = NULL;
    CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s", err);
    CHECK(m && m->desc.tie_embeddings && m->lm_head == m->embed && m->tok == NULL);
    CHECK(m && m->converted == NULL && m->converted_bytes == 0 && m->vector_floats == 0);
    model_free(m);

    /* f32 data that is not 4-byte aligned in the mapping (header padded by one byte) is
     * copied into the converted block instead of borrowed. */
    dir = make_tiny("unaligned", &ok_default);
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    unsigned char *bytes = malloc((size_t)size + 1);
    fseek(f, 0, SEEK_SET);
    CHECK(fread(bytes, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | bytes[i];
    memmove(bytes + 8 + hlen + 1, bytes + 8 + hlen, (size_t)size - 8 - hlen);
    bytes[8 + hlen] = ' ';
    hlen++;
    for (int i = 0; i < 8; i++)
        bytes[i] = (unsigned char)(hlen >> (8 * i));
    f = fopen(path, "wb");
    fwrite(bytes, 1, (size_t)size + 1, f);
    fclose(f);
    free(bytes);
    CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s", err);
    if (m) {
        bool all = true;
        for (int i = 0; i < m->n_mats; i++)
            all = all && in_block(m->mats[i].data, m->converted, m->converted_bytes);
        CHECK(all && m->n_mats > 0);
        CHECK(in_block(m->norm, m->vectors, m->vector_floats * sizeof(float)));
        CHECK(same_mat(m->layers[1].experts[3].down,
                       "model.layers.1.block_sparse_moe.experts.3.w2.weight", ST_DTYPE_F32));
    }
    model_free(m);

    /* Experts stored as fused 3D tensors under mlp.: gate = first FF rows of gate_up. */
    struct tiny tf = {.fused = true, .bf16_layer1 = true};
    dir = make_tiny("fused", &tf);
    CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s", err);
    if (m) {
        const struct st_tensor *gu = st_find(m->st, "model.layers.0.mlp.experts.gate_up_proj");
        const float *base = gu ? gu->data : NULL;
        CHECK(m->layers[0].experts[0].gate->data == base);
        CHECK(m->layers[0].experts[0].up->data == base + FF * D);
        CHECK(m->layers[0].experts[3].gate->data == base + 3 * 2 * FF * D);
        const struct st_tensor *dn = st_find(m->st, "model.layers.0.mlp.experts.down_proj");
        CHECK(dn && m->layers[0].experts[2].down->data == (const float *)dn->data + 2 * D * FF);
        float up0[D];
        wmat_row_f32(m->layers[1].experts[1].up, 0, up0);
        CHECK(m->layers[1].experts[1].up->type == WTYPE_BF16 &&
              up0[0] == ms_bf16_to_f32(ms_f32_to_bf16(
                            weight_value("model.layers.1.mlp.experts.gate_up_proj",
                                         (size_t)(2 * FF * D + FF * D)))));
        CHECK(m->layers[1].router != NULL && m->layers[1].experts[3].d_ff == FF);
    }
    model_free(m);
}

/* model_load must fail with a message containing every non-NULL `want`. */
static void expect_load_fail(const char *dir, bool need_tok, const char *w1, const char *w2,
                             const char *w3, const char *what)
{
    struct model_load_opts o;
    model_load_opts_default(&o);
    o.require_tokenizer = need_tok;
    struct model *m = NULL;
    char err[512] = "";
    int rc = model_load(dir, &o, &m, err, sizeof err);
    CHECKF(rc == -1 && m == NULL, "%s: load succeeded", what);
    const char *w[3] = {w1, w2, w3};
    for (int i = 0; i < 3; i++)
        if (w[i]) CHECKF(strstr(err, w[i]) != NULL, "%s: message lacks '%s': %s", what, w[i], err);
    if (rc == 0) model_free(m);
}

static void test_broken(void)
{
    char path[700], dir[600];
    struct tiny ok = {0};

    snprintf(dir, sizeof dir, "%s/empty", tmpdir);
    mkdir(dir, 0755);
    expect_load_fail(dir, false, "config.json", "empty", NULL, "missing config.json");
    expect_load_fail("/nonexistent/moeserve", false, "config.json", NULL, NULL, "missing folder");

    snprintf(dir, sizeof dir, "%s", make_tiny("notjson", &ok));
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, "{\"model_type\": \"mixtral\", ");
    expect_load_fail(dir, false, "config.json", "not valid JSON", NULL, "config not JSON");
    write_text(path, "[1]");
    expect_load_fail(dir, false, "config.json", "not a JSON object", NULL, "config an array");

    struct tiny foo = {.model_type = "foo"};
    expect_load_fail(make_tiny("foo", &foo), false, "config.json", "unknown model_type 'foo'",
                     "supported: mixtral, qwen2_moe, qwen3_moe, olmoe", "unknown model_type");
    struct tiny ds = {.model_type = "deepseek_v3"};
    expect_load_fail(make_tiny("ds", &ds), false, "config.json", "kv_lora_rank", NULL,
                     "deepseek without its MLA fields");
    struct tiny yarn = {.extra_config =
                            ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}"};
    expect_load_fail(make_tiny("yarn", &yarn), false, "config.json",
                     "original_max_position_embeddings", NULL, "yarn without its context");
    struct tiny ntk = {.extra_config =
                           ", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 4}"};
    expect_load_fail(make_tiny("ntk", &ntk), false, "config.json", "rope_scaling",
                     "'dynamic'", "rope scaling");
    struct tiny gelu = {.extra_config = ", \"hidden_act\": \"gelu\""};
    /* the later duplicate key wins in jansson; either way the value must be refused */
    expect_load_fail(make_tiny("gelu", &gelu), false, "config.json", "hidden_act", "gelu", "gelu");
    struct tiny badint = {.extra_config = ", \"num_experts_per_tok\": 9"};
    expect_load_fail(make_tiny("topk", &badint), false, "config.json", "num_experts_per_tok", NULL,
                     "top_k > experts");

    snprintf(dir, sizeof dir, "%s", make_tiny("noweights", &ok));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    expect_load_fail(dir, false, "model.safetensors", "missing", NULL, "missing model.safetensors");

    struct tiny skip = {.skip = "model.layers.1.block_sparse_moe.experts.2.w3.weight"};
    expect_load_fail(make_tiny("skip", &skip), false, "model.safetensors",
                     "missing tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'", NULL,
                     "missing tensor");
    struct tiny skip_gate = {.skip = "model.layers.0.block_sparse_moe.gate.weight"};
    expect_load_fail(make_tiny("skipgate", &skip_gate), false, "model.safetensors",
                     "'model.layers.0.block_sparse_moe.gate.weight'", NULL, "missing router");

    struct tiny wide = {.wide = "model.layers.1.self_attn.q_proj.weight"};
    expect_load_fail(make_tiny("wide", &wide), false,
                     "model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight'",
                     "expected shape (16, 16)", "found (16, 20)", "wrong shape");

    struct tiny i64 = {.as_i64 = "model.layers.0.self_attn.k_proj.weight"};
    expect_load_fail(make_tiny("i64", &i64), false, "'model.layers.0.self_attn.k_proj.weight'",
                     "dtype I64 not supported (expected F32, F16 or BF16)", "model.safetensors",
                     "unsupported dtype");

    snprintf(dir, sizeof dir, "%s", make_tiny("trunc", &ok));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct stat sb;
    stat(path, &sb);
    CHECK(truncate(path, sb.st_size - 100) == 0);
    expect_load_fail(dir, false, "model.safetensors", "past the data section", "file truncated",
                     "truncated safetensors");

    snprintf(dir, sizeof dir, "%s", make_tiny("corrupt", &ok));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    fseek(f, 8, SEEK_SET);
    fputs("#garbage#", f);
    fclose(f);
    expect_load_fail(dir, false, "model.safetensors", "header is not valid JSON", NULL,
                     "corrupt header");

    /* Sharded: index lists a shard that is not there. */
    snprintf(dir, sizeof dir, "%s", make_tiny("shardmiss", &ok));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    char p2[700];
    snprintf(p2, sizeof p2, "%s/model-00001-of-00002.safetensors", dir);
    CHECK(rename(path, p2) == 0);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_text(path, "{\"weight_map\": {\"lm_head.weight\": \"model-00001-of-00002.safetensors\", "
                     "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}");
    expect_load_fail(dir, false, "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                     NULL, "missing shard");

    /* Tokenizer required but absent. */
    expect_load_fail(make_tiny("notok", &ok), true, "tokenizer.json", "missing", NULL,
                     "missing tokenizer.json");
    /* Bad generation_config.json. */
    snprintf(dir, sizeof dir, "%s", make_tiny("badgen", &ok));
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    write_text(path, "{\"eos_token_id\": \"two\"}");
    expect_load_fail(dir, false, "generation_config.json", "eos_token_id", NULL, "bad eos");
}

static void test_parse(void)
{
    struct model_desc d;
    char err[512] = "";
    const char *q2 =
        "{\"model_type\": \"qwen2_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 4, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 100, "
        "\"intermediate_size\": 128, \"moe_intermediate_size\": 32, \"num_experts\": 6, "
        "\"num_experts_per_tok\": 2, \"shared_expert_intermediate_size\": 48, "
        "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3], \"norm_topk_prob\": false, "
        "\"rope_theta\": 5000, \"use_sliding_window\": false, \"sliding_window\": 0, "
        "\"eos_token_id\": [5, 6, 7], \"bos_token_id\": null}";
    CHECKF(model_desc_parse(q2, strlen(q2), "q2/config.json", &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.layer_is_moe && !d.layer_is_moe[0] && d.layer_is_moe[1] && !d.layer_is_moe[2] &&
          !d.layer_is_moe[3]);
    CHECK(d.dense_d_ff == 128 && d.expert_d_ff && d.expert_d_ff[5] == 32 && d.n_expert == 6);
    CHECK(d.n_shared == 1 && d.shared_d_ff == 48 && d.shared_gate == SHARED_GATE_SIGMOID);
    CHECK(d.qkv_bias && !d.norm_topk_prob && d.rope_theta == 5000.0f && d.head_dim == 16);
    CHECK(d.sliding_window == 0 && d.bos_id == -1 && d.n_eos == 3 && d.eos_ids[2] == 7);
    const char *gen = "{\"eos_token_id\": 9, \"bos_token_id\": 4}";
    CHECK(model_desc_apply_generation_config(&d, gen, strlen(gen), "g", err, sizeof err) == 0);
    CHECK(d.n_eos == 1 && d.eos_ids[0] == 9 && d.bos_id == 4);
    gen = "{\"eos_token_id\": [1,2,3,4,5,6,7,8,9]}";
    CHECK(model_desc_apply_generation_config(&d, gen, strlen(gen), "g", err, sizeof err) == -1);
    CHECK(d.n_eos == 1 && d.eos_ids[0] == 9);
    model_desc_free(&d);
    model_desc_free(&d); /* idempotent */

    const char *q3 =
        "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
        "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 32, "
        "\"vocab_size\": 100, \"moe_intermediate_size\": 32, \"num_local_experts\": 8, "
        "\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"attention_bias\": false, "
        "\"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"default\"}}";
    CHECKF(model_desc_parse(q3, strlen(q3), "q3", &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.qk_norm == QK_NORM_HEAD && d.head_dim == 32 && !d.qkv_bias && d.norm_topk_prob);
    CHECK(d.n_expert == 8 && d.layer_is_moe[0] && d.layer_is_moe[1] && d.n_shared == 0);
    CHECK(d.rope_theta == 1e6f && d.n_eos == 0);
    model_desc_free(&d);

    const char *ol =
        "{\"model_type\": \"olmoe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
        "\"num_attention_heads\": 4, \"vocab_size\": 100, \"intermediate_size\": 32, "
        "\"num_experts\": 4, \"num_experts_per_tok\": 2, \"clip_qkv\": 8.0, \"eos_token_id\": 3}";
    CHECKF(model_desc_parse(ol, strlen(ol), "ol", &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.qk_norm == QK_NORM_FULL && d.clip_qkv == 8.0f && d.n_kv_head == 4 && !d.norm_topk_prob);
    CHECK(d.expert_d_ff[3] == 32 && d.rope_theta == 10000.0f && d.n_eos == 1 && d.eos_ids[0] == 3);
    model_desc_free(&d);

    static const struct {
        const char *json, *want;
    } bad[] = {
        {"{\"model_type\": \"mixtral\"}", "num_hidden_layers"},
        {"{\"model_type\": 3}", "model_type"},
        {"{\"model_type\": \"olmoe\", \"num_hidden_layers\": 2, \"hidden_size\": \"64\"}",
         "'hidden_size' must be an integer"},
        {"{\"model_type\": \"qwen2_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"moe_intermediate_size\": 8, "
         "\"num_experts\": 2, \"num_experts_per_tok\": 1, \"rope_parameters\": "
         "{\"rope_type\": \"longrope\", \"rope_theta\": 1.0}}",
         "rope_parameters.rope_type 'longrope' is not supported"},
        {"{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"moe_intermediate_size\": 8, "
         "\"num_experts\": 2, \"num_experts_per_tok\": 1, \"use_sliding_window\": true}",
         "use_sliding_window"},
        {"{\"model_type\": \"olmoe\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 3, \"vocab_size\": 10}",
         "hidden_size 64 is not a multiple"},
        {"{\"model_type\": \"olmoe\", \"hidden_size\": 64, \"num_hidden_layers\": -1}",
         "num_hidden_layers"},
        {"{\"model_type\": \"deepseek_v2\"}", "missing 'num_hidden_layers'"},
        /* a fuzzer's find: per-layer arrays and loops must not follow a huge layer count */
        {"{\"model_type\": \"qwen2_moe\", \"hidden_size\": 64, \"num_hidden_layers\": 888888512, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10, \"moe_intermediate_size\": 8, "
         "\"num_experts\": 4, \"num_experts_per_tok\": 2}",
         "num_hidden_layers 888888512 is more than"},
        {"{\"model_type\": \"mohge\"}", "missing 'num_hidden_layers'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&d, 0x55, sizeof d);
        int rc = model_desc_parse(bad[i].json, strlen(bad[i].json), "x/config.json", &d, err,
                                  sizeof err);
        CHECKF(rc == -1 && strstr(err, bad[i].want) && strstr(err, "x/config.json"), "case %zu: %s",
               i, err);
        CHECK(d.layer_is_moe == NULL && d.expert_d_ff == NULL);
    }
}

/* The checkpoints saved by transformers (tests/reference/make_model_fixtures.py). */
static void test_fixtures(void)
{
    static const char *names[] = {"mixtral",        "mixtral_bf16",   "mixtral_sharded",
                                  "qwen2_moe",      "qwen2_moe_bf16", "qwen3_moe",
                                  "qwen3_moe_bf16", "olmoe",          "olmoe_bf16"};
    int found = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "fixtures/models/%s/config.json", names[i]);
        const char *cfg_path = test_path(tests_dir, rel);
        if (access(cfg_path, R_OK) != 0) continue;
        found++;
        json_t *cfg = json_load_file(cfg_path, 0, NULL);
        snprintf(rel, sizeof rel, "fixtures/models/%s", names[i]);
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", test_path(tests_dir, rel));
        struct model_load_opts o;
        model_load_opts_default(&o);
        struct model *m = NULL;
        char err[512] = "";
        CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s: %s", names[i], err);
        if (!m || !cfg) {
            json_decref(cfg);
            continue;
        }
        const struct model_desc *d = &m->desc;
#define CFG_INT(k) ((int)json_integer_value(json_object_get(cfg, k)))
        CHECKF(strcmp(d->model_type, json_string_value(json_object_get(cfg, "model_type"))) == 0,
               "%s", names[i]);
        CHECKF(d->d_model == CFG_INT("hidden_size"), "%s", names[i]);
        CHECKF(d->n_layer == CFG_INT("num_hidden_layers"), "%s", names[i]);
        CHECKF(d->n_head == CFG_INT("num_attention_heads"), "%s", names[i]);
        CHECKF(d->vocab == CFG_INT("vocab_size"), "%s", names[i]);
        CHECKF(d->top_k == CFG_INT("num_experts_per_tok"), "%s", names[i]);
        int ne = json_object_get(cfg, "num_experts") ? CFG_INT("num_experts")
                                                     : CFG_INT("num_local_experts");
        CHECKF(d->n_expert == ne, "%s", names[i]);
        if (json_is_integer(json_object_get(cfg, "head_dim")))
            CHECKF(d->head_dim == CFG_INT("head_dim"), "%s", names[i]);
#undef CFG_INT
        CHECKF(m->tok != NULL && m->embed && m->lm_head && m->norm, "%s", names[i]);
        CHECKF(d->n_eos >= 1 && d->eos_ids[0] == 0, "%s", names[i]);
        CHECKF(m->chat_template != NULL, "%s", names[i]);
        bool bf16 = strstr(names[i], "bf16") != NULL;
        CHECKF(m->converted_bytes == 0, "%s: %zu bytes converted", names[i], m->converted_bytes);
        CHECKF(bf16 ? m->vector_floats > 0 : m->vector_floats == 0, "%s: %zu vector floats",
               names[i], m->vector_floats);
        CHECKF(m->lm_head->type == (bf16 ? WTYPE_BF16 : WTYPE_F32), "%s", names[i]);
        for (int l = 0; l < d->n_layer; l++) {
            const struct layer_w *lw = &m->layers[l];
            bool ok = lw->wq && lw->wk && lw->wv && lw->wo && lw->attn_norm && lw->ffn_norm;
            if (d->layer_is_moe[l]) {
                ok = ok && lw->router && lw->experts;
                for (int e = 0; ok && e < d->n_expert; e++)
                    ok = lw->experts[e].gate && lw->experts[e].up && lw->experts[e].down;
                for (int s = 0; ok && s < d->n_shared; s++)
                    ok = lw->shared[s].gate != NULL;
            } else {
                ok = ok && lw->dense.gate && lw->dense.up && lw->dense.down;
            }
            if (d->qkv_bias) ok = ok && lw->bq && lw->bk && lw->bv;
            if (d->qk_norm != QK_NORM_NONE) ok = ok && lw->q_norm && lw->k_norm;
            CHECKF(ok, "%s: layer %d not fully bound", names[i], l);
        }
        if (strcmp(names[i], "qwen2_moe") == 0)
            CHECK(d->n_shared == 1 && d->shared_gate == SHARED_GATE_SIGMOID && d->qkv_bias &&
                  m->layers[0].shared_gate && !d->layer_is_moe[1]);
        if (strcmp(names[i], "qwen3_moe") == 0) CHECK(d->qk_norm == QK_NORM_HEAD);
        if (strcmp(names[i], "olmoe") == 0) CHECK(d->qk_norm == QK_NORM_FULL);
        json_decref(cfg);
        model_free(m);
    }
    printf("test_model_load: %d fixture checkpoints found\n", found);
}

/* Where a folder keeps its chat template: chat_template.jinja first, then tokenizer_config.json,
 * then chat_template.json (the processor's file, as Llama 4's multimodal folders ship it). The
 * mixtral fixture's files by symlink, its tokenizer_config.json rewritten without the template. */
static void test_chat_template_files(void)
{
    char src[4096], dir[4200], path[4400], dst[4400];
    if (!realpath(test_path(tests_dir, "fixtures/models/mixtral"), src)) { /* links need it whole */
        CHECK(0);
        return;
    }
    snprintf(dir, sizeof dir, "%s/ct", tmpdir);
    CHECK(mkdir(dir, 0700) == 0);
    static const char *const linked[] = {"config.json", "model.safetensors", "tokenizer.json",
                                         "generation_config.json"};
    for (size_t i = 0; i < sizeof linked / sizeof *linked; i++) {
        snprintf(path, sizeof path, "%s/%s", src, linked[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, linked[i]);
        CHECK(symlink(path, dst) == 0);
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", src);
    json_t *tc = json_load_file(path, JSON_DECODE_INT_AS_REAL, NULL);
    CHECK(tc && json_object_del(tc, "chat_template") == 0);
    snprintf(dst, sizeof dst, "%s/tokenizer_config.json", dir);
    CHECK(json_dump_file(tc, dst, 0) == 0);
    json_decref(tc);
    static const char *const steps[] = {
        NULL,                                             /* none: no template */
        "chat_template.json",                             /* the processor's file */
        "tokenizer_config.json",                          /* ahead of chat_template.json */
        "chat_template.jinja",                            /* ahead of both */
    };
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        char want[64] = "";
        if (steps[i]) {
            snprintf(want, sizeof want, "from %s", steps[i]);
            snprintf(dst, sizeof dst, "%s/%s", dir, steps[i]);
            if (strcmp(steps[i], "chat_template.jinja") == 0) {
                FILE *f = fopen(dst, "w");
                CHECK(f && fputs(want, f) >= 0 && fclose(f) == 0);
            } else {
                json_t *j = strcmp(steps[i], "tokenizer_config.json") == 0
                                ? json_load_file(dst, JSON_DECODE_INT_AS_REAL, NULL)
                                : json_object();
                CHECK(j && json_object_set_new(j, "chat_template", json_string(want)) == 0 &&
                      json_dump_file(j, dst, 0) == 0);
                json_decref(j);
            }
        }
        struct model_load_opts o;
        model_load_opts_default(&o);
        struct model *m = NULL;
        char err[512] = "";
        CHECKF(model_load(dir, &o, &m, err, sizeof err) == 0, "%s", err);
        CHECKF(m && (steps[i] ? m->chat_template && strcmp(m->chat_template, want) == 0
                              : m->chat_template == NULL),
               "step %zu: template '%s'", i, m && m->chat_template ? m->chat_template : "(none)");
        model_free(m);
    }
}

int main(int argc, char **argv)
{
    tests_dir = argc > 1 ? argv[1] : "tests";
    snprintf(tmpdir, sizeof tmpdir, "%s/moeserve_ml_XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_parse();
    test_valid();
    test_broken();
    test_fixtures();
    test_chat_template_files();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    return test_done("test_model_load");
}
