/* Model loading: config.json (model_config.c) gives the description; this file works out which
 * tensors that description needs and under which Hugging Face names, checks each one's dtype
 * and shape, and binds the matrices (struct wmat) and f32 vectors of struct model to them.
 * Binding is a plan of requests run in two passes: the first finds and checks every tensor and
 * decides each matrix's type in memory (as stored, converted for --dtype, or quantized for
 * --quantization) and what that costs; the second fills one block for converted matrices and
 * one for converted vectors, allocated in between, on the conversion threads, a few tensors at
 * a time, giving each converted tensor's source pages back as soon as it is done (so the
 * checkpoint's bytes are never all resident with the result; see struct stream). Matrices kept
 * as stored point into the read-only mapping (zero copy). Experts stored fused as 3D tensors
 * (experts.gate_up_proj (E, 2*ff, d), experts.down_proj (E, d, ff)) become one matrix per
 * expert, each a contiguous slice of the tensor. Then the tokenizer and chat template are
 * read. */
#include "model.h"

#include "common.h"
#include "cpu/pool.h"
#include "weight_cache.h"

#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum bind_kind {
    BIND_VEC,           /* a vector: f32 in memory */
    BIND_MAT,           /* a matrix that keeps the model's dtype (embeddings, routers) */
    BIND_MAT_Q,         /* a matrix --quantization applies to */
    BIND_FUSED_GATE_UP, /* (E, 2*ff, d): expert e's gate = rows [0, ff), up = rows [ff, 2ff) */
    BIND_FUSED_DOWN,    /* (E, d, ff) */
    BIND_MLA_UK_T,      /* MLA kv_b_proj (H*(dn+dv), kvr) -> (H*kvr, dn): each head's key
                           up-projection transposed (converted, never borrowed) */
    BIND_MX_GATE_UP,    /* gpt-oss MXFP4 gate_up_proj_blocks (E, 2*ff, d/32, 16) + _scales
                           (E, 2*ff, d/32): gate = even rows, up = odd rows */
    BIND_MX_DOWN,       /* MXFP4 down_proj_blocks (E, d, ff/32, 16) + _scales (E, d, ff/32) */
    BIND_T_GATE_UP,     /* gpt-oss unquantized gate_up_proj (E, d, 2*ff): (in, out), gate/up
                           interleaved along out -> converted transposes */
    BIND_T_DOWN,        /* unquantized down_proj (E, ff, d) -> (d, ff) transposes */
    BIND_EX_BIAS_GU,    /* gate_up_proj_bias (E, 2*ff): b_gate = even, b_up = odd (converted) */
    BIND_EX_BIAS_DOWN,  /* down_proj_bias (E, d): b_down, borrowed when f32 */
    BIND_PAIR_GATE_UP,  /* one FFN's (2*ff, d) input_linear (Granite): gate = rows [0, ff),
                           up = rows [ff, 2ff) */
    BIND_T_GATE_UP_SPLIT, /* Llama 4's gate_up_proj (E, d, 2*ff): (in, out), gate = outputs
                             [0, ff), up = [ff, 2ff) -> converted transposes */
    BIND_IDX,           /* an integer table (I64 / I32) of expert ids, as int32 in the vectors
                           block, each checked to be < n_expert (DeepSeek-V4's tid2eid) */
};

struct bind {
    char name[128];
    int ndim;
    int64_t shape[4];
    enum bind_kind kind;
    const float **vec;         /* BIND_VEC */
    const int32_t **idx;       /* BIND_IDX */
    const struct wmat **mat;   /* BIND_MAT, BIND_MAT_Q */
    struct ffn_w *experts;     /* fused kinds: (n_expert) */
    const struct st_tensor *t; /* found in pass 1 */
    const struct st_tensor *t2;/* BIND_MX_*: the scales tensor */
    int mat0;                  /* matrices: first index into model->mats */
    bool mla_tiles;            /* BIND_MLA_UK_T: may be quantized */
    bool plus_one;             /* BIND_VEC: a zero-centred norm weight, stored as 1 + w
                                  (always converted) */
    size_t vec_off;            /* BIND_VEC, BIND_EX_BIAS_*: offset of the converted floats in
                                  model->vectors, or SIZE_MAX (borrowed) */
};

/* One matrix made from a slice of a tensor: nh blocks of hr rows; row r of block h, column c is
 * element elem0 + h * hstride + r * rs + c * cs of the tensor (plain: nh 1, rs cols, cs 1). */
struct mat_src {
    const struct st_tensor *t;
    size_t elem0;    /* first element of the slice */
    int nh, hr;
    size_t hstride, rs, cs;
    enum wtype to;
    bool borrowed;
    size_t off;      /* converted: byte offset in model->converted */
    /* MXFP4 source (scales non-NULL): row i of the matrix is row elem0 + i * rs of the blocks
     * tensor (t) and of scales, both viewed as (rows, cols / 32 blocks) */
    const struct st_tensor *scales;
};

struct plan {
    struct bind *b; /* (n) */
    int n, cap;
    int n_mats;
    int oom;
    bool norm_plus_one; /* plan_norm's vectors are zero-centred (model_desc.norm_plus_one) */
};

static struct bind *plan_add(struct plan *p, enum bind_kind kind, int ndim, int64_t s0, int64_t s1,
                             int64_t s2, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

/* Matrices a bind makes (entries of model->mats from its mat0 on). */
static int bind_mats(const struct bind *b)
{
    switch (b->kind) {
    case BIND_MAT:
    case BIND_MAT_Q:
    case BIND_MLA_UK_T: return 1;
    case BIND_PAIR_GATE_UP: return 2;
    case BIND_FUSED_GATE_UP:
    case BIND_MX_GATE_UP:
    case BIND_T_GATE_UP_SPLIT:
    case BIND_T_GATE_UP: return 2 * (int)b->shape[0];
    case BIND_FUSED_DOWN:
    case BIND_MX_DOWN:
    case BIND_T_DOWN: return (int)b->shape[0];
    case BIND_VEC:
    case BIND_IDX:
    case BIND_EX_BIAS_GU:
    case BIND_EX_BIAS_DOWN: return 0;
    }
    return 0;
}

/* Vector binds: floats in memory, borrowed or converted into model->vectors. */
static bool bind_is_vec(const struct bind *b)
{
    return b->kind == BIND_VEC || b->kind == BIND_IDX || b->kind == BIND_EX_BIAS_GU ||
           b->kind == BIND_EX_BIAS_DOWN;
}

static struct bind *plan_add(struct plan *p, enum bind_kind kind, int ndim, int64_t s0, int64_t s1,
                             int64_t s2, const char *fmt, ...)
{
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        struct bind *nb = realloc(p->b, (size_t)cap * sizeof *nb);
        if (!nb) {
            p->oom = 1;
            return NULL;
        }
        p->b = nb;
        p->cap = cap;
    }
    struct bind *b = &p->b[p->n++];
    memset(b, 0, sizeof *b);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->name, sizeof b->name, fmt, ap);
    va_end(ap);
    b->kind = kind;
    b->ndim = ndim;
    b->shape[0] = s0;
    b->shape[1] = s1;
    b->shape[2] = s2;
    b->mat0 = p->n_mats;
    p->n_mats += bind_mats(b);
    return b;
}

static void plan_vec(struct plan *p, const float **dst, int64_t n, const char *fmt, const char *pre)
{
    struct bind *b = plan_add(p, BIND_VEC, 1, n, 0, 0, fmt, pre);
    if (b) b->vec = dst;
}

/* An RMSNorm weight: as plan_vec, stored as 1 + w for zero-centred norms. */
static void plan_norm(struct plan *p, const float **dst, int64_t n, const char *fmt,
                      const char *pre)
{
    struct bind *b = plan_add(p, BIND_VEC, 1, n, 0, 0, fmt, pre);
    if (!b) return;
    b->vec = dst;
    b->plus_one = p->norm_plus_one;
}

static void plan_mat(struct plan *p, const struct wmat **dst, bool quantizable, int64_t rows,
                     int64_t cols, const char *fmt, const char *pre)
{
    struct bind *b =
        plan_add(p, quantizable ? BIND_MAT_Q : BIND_MAT, 2, rows, cols, 0, fmt, pre);
    if (b) b->mat = dst;
}

static void plan_ffn(struct plan *p, struct ffn_w *f, int d_ff, int d, const char *pre,
                     const char *gate, const char *up, const char *down)
{
    f->d_ff = d_ff;
    char fmt[96];
    snprintf(fmt, sizeof fmt, "%%s%s.weight", gate);
    plan_mat(p, &f->gate, true, d_ff, d, fmt, pre);
    snprintf(fmt, sizeof fmt, "%%s%s.weight", up);
    plan_mat(p, &f->up, true, d_ff, d, fmt, pre);
    snprintf(fmt, sizeof fmt, "%%s%s.weight", down);
    plan_mat(p, &f->down, true, d, d_ff, fmt, pre);
}

/* Routed experts of one layer under `moe` ("model.layers.3.mlp."), per-expert or fused. */
static int plan_experts(struct plan *p, const struct st_archive *st, struct layer_w *lw,
                        const struct model_desc *d, const char *moe, bool mixtral_names)
{
    char name[160];
    snprintf(name, sizeof name, "%sexperts.0.%s.weight", moe, mixtral_names ? "w1" : "gate_proj");
    char fused[160];
    snprintf(fused, sizeof fused, "%sexperts.gate_up_proj", moe);
    if (!st_find(st, name) && st_find(st, fused)) {
        int ff = d->expert_d_ff[0];
        for (int e = 1; e < d->n_expert; e++)
            if (d->expert_d_ff[e] != ff) return -1; /* fused storage implies one width */
        for (int e = 0; e < d->n_expert; e++)
            lw->experts[e].d_ff = ff;
        struct bind *b = plan_add(p, BIND_FUSED_GATE_UP, 3, d->n_expert, 2 * (int64_t)ff,
                                  d->d_model, "%s", fused);
        if (b) b->experts = lw->experts;
        b = plan_add(p, BIND_FUSED_DOWN, 3, d->n_expert, d->d_model, ff, "%sexperts.down_proj",
                     moe);
        if (b) b->experts = lw->experts;
        return 0;
    }
    for (int e = 0; e < d->n_expert; e++) {
        snprintf(name, sizeof name, "%sexperts.%d.", moe, e);
        if (mixtral_names)
            plan_ffn(p, &lw->experts[e], d->expert_d_ff[e], d->d_model, name, "w1", "w3", "w2");
        else
            plan_ffn(p, &lw->experts[e], d->expert_d_ff[e], d->d_model, name, "gate_proj",
                     "up_proj", "down_proj");
    }
    return 0;
}

/* gpt-oss experts of one layer under `moe` ("model.layers.3.mlp."): MXFP4 as published
 * (_blocks + _scales), or unquantized as transformers saves them ((in, out) per expert, gate and
 * up interleaved); biases either way. */
static void plan_gptoss_experts(struct plan *p, const struct st_archive *st, struct layer_w *lw,
                                const struct model_desc *d, const char *moe)
{
    int64_t E = d->n_expert, D = d->d_model, ff = d->expert_d_ff[0];
    char name[160];
    snprintf(name, sizeof name, "%sexperts.gate_up_proj_blocks", moe);
    bool mx = st_find(st, name) != NULL;
    for (int e = 0; e < d->n_expert; e++) lw->experts[e].d_ff = (int)ff;
    struct bind *b;
    if (mx) {
        b = plan_add(p, BIND_MX_GATE_UP, 4, E, 2 * ff, D / 32, "%s", name);
        if (b) b->shape[3] = 16;
        if (b) b->experts = lw->experts;
        b = plan_add(p, BIND_MX_DOWN, 4, E, D, ff / 32, "%sexperts.down_proj_blocks", moe);
        if (b) b->shape[3] = 16;
    } else {
        b = plan_add(p, BIND_T_GATE_UP, 3, E, D, 2 * ff, "%sexperts.gate_up_proj", moe);
        if (b) b->experts = lw->experts;
        b = plan_add(p, BIND_T_DOWN, 3, E, ff, D, "%sexperts.down_proj", moe);
    }
    if (b) b->experts = lw->experts;
    b = plan_add(p, BIND_EX_BIAS_GU, 2, E, 2 * ff, 0, "%sexperts.gate_up_proj_bias", moe);
    if (b) b->experts = lw->experts;
    b = plan_add(p, BIND_EX_BIAS_DOWN, 2, E, D, 0, "%sexperts.down_proj_bias", moe);
    if (b) b->experts = lw->experts;
}

/* MLA projections of one layer. The absorbed key up-projection is a converted copy of part of
 * kv_b_proj; quantized only when its per-head blocks fall on whole tiles. */
static void plan_mla(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                     const char *pre, bool indexer)
{
    const int64_t D = d->d_model, H = d->n_head, qk = d->head_dim, kvr = d->kv_lora_rank;
    const int64_t dn = d->qk_nope_dim, dv = d->v_head_dim;
    if (d->q_lora_rank > 0) {
        plan_mat(p, &lw->wq_a, true, d->q_lora_rank, D, "%sself_attn.q_a_proj.weight", pre);
        plan_vec(p, &lw->q_a_norm, d->q_lora_rank, "%sself_attn.q_a_layernorm.weight", pre);
        plan_mat(p, &lw->wq_b, true, H * qk, d->q_lora_rank, "%sself_attn.q_b_proj.weight", pre);
    } else {
        plan_mat(p, &lw->wq, true, H * qk, D, "%sself_attn.q_proj.weight", pre);
    }
    plan_mat(p, &lw->wkv_a, true, kvr + d->qk_rope_dim, D, "%sself_attn.kv_a_proj_with_mqa.weight",
             pre);
    plan_vec(p, &lw->kv_a_norm, kvr, "%sself_attn.kv_a_layernorm.weight", pre);
    /* The value up-projection is read per head as row slices of kv_b_proj (wmat_rows). */
    bool tiles = (dn + dv) % WQ_TILE == 0 && dn % WQ_TILE == 0 && kvr % WQ_TILE == 0;
    plan_mat(p, &lw->wkv_b, tiles, H * (dn + dv), kvr, "%sself_attn.kv_b_proj.weight", pre);
    struct bind *b = plan_add(p, BIND_MLA_UK_T, 2, H * (dn + dv), kvr, 0,
                              "%sself_attn.kv_b_proj.weight", pre);
    if (b) {
        b->mat = &lw->w_uk_t;
        b->mla_tiles = tiles;
    }
    plan_mat(p, &lw->wo, true, D, H * dv, "%sself_attn.o_proj.weight", pre);
    if (indexer) { /* the sparse-attention indexer; its head weights stay unquantized */
        const int64_t Hi = d->dsa_heads, Di = d->dsa_dim;
        plan_mat(p, &lw->idx_wq_b, true, Hi * Di, d->q_lora_rank,
                 "%sself_attn.indexer.wq_b.weight", pre);
        plan_mat(p, &lw->idx_wk, true, Di, D, "%sself_attn.indexer.wk.weight", pre);
        plan_vec(p, &lw->idx_k_norm, Di, "%sself_attn.indexer.k_norm.weight", pre);
        plan_vec(p, &lw->idx_k_norm_b, Di, "%sself_attn.indexer.k_norm.bias", pre);
        plan_mat(p, &lw->idx_wproj, false, Hi, D, "%sself_attn.indexer.weights_proj.weight", pre);
    }
}

/* A hyper-connection's mixing weights (DeepSeek's names: hc_attn_* / hc_ffn_*): kept as
 * stored. */
static void plan_hc(struct plan *p, const struct model_desc *d, const struct wmat **fn,
                    const float **base, const float **scale, const char *pre, const char *which)
{
    const int64_t hc = d->v4_hc, mix = (2 + hc) * hc;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "%%shc_%s_fn", which);
    plan_mat(p, fn, false, mix, hc * d->d_model, fmt, pre);
    snprintf(fmt, sizeof fmt, "%%shc_%s_base", which);
    plan_vec(p, base, mix, fmt, pre);
    snprintf(fmt, sizeof fmt, "%%shc_%s_scale", which);
    plan_vec(p, scale, 3, fmt, pre);
}

/* One DeepSeek-V4 compressor (kind 0) or CSA indexer's (kind 1) under `cpre`: kv and gate
 * projections of c outputs (wkv, wgate), the (rate, c) position bias (ape) and the entries'
 * norm (width w). */
static void plan_v4_compressor(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                               const char *cpre, int kind, int64_t c, int64_t w, int rate)
{
    plan_mat(p, &lw->cmp_wkv[kind], false, c, d->d_model, "%swkv.weight", cpre);
    plan_mat(p, &lw->cmp_wgate[kind], false, c, d->d_model, "%swgate.weight", cpre);
    struct bind *b = plan_add(p, BIND_VEC, 2, rate, c, 0, "%sape", cpre);
    if (b) b->vec = &lw->cmp_bias[kind];
    plan_vec(p, &lw->cmp_norm[kind], w, "%snorm.weight", cpre);
}

/* A DeepSeek-V4 decoder block under `pre` ("model.layers.3." as transformers 5.25 saves it, or
 * "layers.3." as DeepSeek publishes it), in DeepSeek's names (transformers writes them back on
 * save): attn_norm / ffn_norm, attn.* (wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink,
 * compressor.*, indexer.*), hc_attn_* / hc_ffn_*, and the MoE under ffn. (gate.weight with
 * gate.bias, or gate.tid2eid on hash layers; experts.{e}.w1/w3/w2; shared_experts.w1/w3/w2). */
static int plan_v4(struct plan *p, const struct st_archive *st, struct layer_w *lw,
                   const struct model_desc *d, const char *pre, int l, const char *wname,
                   char *err, size_t errlen)
{
    const int64_t D = d->d_model, H = d->n_head, hd = d->head_dim, qr = d->q_lora_rank;
    const int64_t R = (int64_t)d->o_groups * d->o_lora_rank;
    plan_vec(p, &lw->attn_norm, D, "%sattn_norm.weight", pre);
    plan_vec(p, &lw->ffn_norm, D, "%sffn_norm.weight", pre);
    plan_mat(p, &lw->wq_a, true, qr, D, "%sattn.wq_a.weight", pre);
    plan_vec(p, &lw->q_a_norm, qr, "%sattn.q_norm.weight", pre);
    plan_mat(p, &lw->wq_b, true, H * hd, qr, "%sattn.wq_b.weight", pre);
    plan_mat(p, &lw->v4_wkv, true, hd, D, "%sattn.wkv.weight", pre);
    plan_vec(p, &lw->v4_kv_norm, hd, "%sattn.norm.weight", pre);
    /* read a group's rows at a time (wmat_rows): quantized only when groups are whole tiles */
    plan_mat(p, &lw->v4_wo_a, d->o_lora_rank % WQ_TILE == 0, R, H * hd / d->o_groups,
             "%sattn.wo_a.weight", pre);
    plan_mat(p, &lw->v4_wo_b, true, D, R, "%sattn.wo_b.weight", pre);
    plan_vec(p, &lw->sinks, H, "%sattn.attn_sink", pre);
    plan_hc(p, d, &lw->hc_fn[0], &lw->hc_base[0], &lw->hc_scale[0], pre, "attn");
    plan_hc(p, d, &lw->hc_fn[1], &lw->hc_base[1], &lw->hc_scale[1], pre, "ffn");
    int kind = d->v4_attn[l], rate = d->v4_rate[kind];
    char cpre[160];
    if (kind != V4_ATTN_SLIDING) {
        bool csa = kind == V4_ATTN_CSA;
        snprintf(cpre, sizeof cpre, "%sattn.compressor.", pre);
        plan_v4_compressor(p, lw, d, cpre, 0, csa ? 2 * hd : hd, hd, rate);
        if (csa) {
            const int64_t Hi = d->dsa_heads, Di = d->dsa_dim;
            snprintf(cpre, sizeof cpre, "%sattn.indexer.compressor.", pre);
            plan_v4_compressor(p, lw, d, cpre, 1, 2 * Di, Di, rate);
            plan_mat(p, &lw->idx_wq_b, true, Hi * Di, qr, "%sattn.indexer.wq_b.weight", pre);
            plan_mat(p, &lw->idx_wproj, false, Hi, D, "%sattn.indexer.weights_proj.weight", pre);
        }
    }
    char moe[112];
    snprintf(moe, sizeof moe, "%sffn.", pre);
    plan_mat(p, &lw->router, false, d->n_expert, D, "%sgate.weight", moe);
    if (d->layer_hash[l]) { /* hash_moe: the experts of each token id */
        struct bind *b = plan_add(p, BIND_IDX, 2, d->vocab, d->top_k, 0, "%sgate.tid2eid", moe);
        if (b) b->idx = &lw->tid2eid;
    } else {
        plan_vec(p, &lw->router_bias, d->n_expert, "%sgate.bias", moe);
    }
    if (plan_experts(p, st, lw, d, moe, true) != 0)
        return ms_errf(err, errlen, "%s: layer %d: fused experts of different widths", wname, l);
    snprintf(cpre, sizeof cpre, "%sshared_experts.", moe);
    plan_ffn(p, &lw->shared[0], d->shared_d_ff, d->d_model, cpre, "w1", "w3", "w2");
    return 0;
}

/* A Gated DeltaNet layer's tensors under "<pre>linear_attn.": the input projections fused per
 * key head (qwen3_next) or apart (qwen3_5_moe), the depthwise conv1d (conv_dim, 1, K), A_log,
 * dt_bias, the gated norm and out_proj. */
static void plan_gdn(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                     const char *pre)
{
    const int64_t D = d->d_model, kd = (int64_t)d->lin_nk * d->lin_dk,
                  vd = (int64_t)d->lin_nv * d->lin_dv, nv = d->lin_nv, conv = 2 * kd + vd;
    if (d->lin_fused_in) {
        plan_mat(p, &lw->lin_in[0], true, 2 * kd + 2 * vd, D, "%slinear_attn.in_proj_qkvz.weight",
                 pre);
        plan_mat(p, &lw->lin_in[1], false, 2 * nv, D, "%slinear_attn.in_proj_ba.weight", pre);
    } else {
        plan_mat(p, &lw->lin_in[0], true, conv, D, "%slinear_attn.in_proj_qkv.weight", pre);
        plan_mat(p, &lw->lin_in[1], true, vd, D, "%slinear_attn.in_proj_z.weight", pre);
        plan_mat(p, &lw->lin_in[2], false, nv, D, "%slinear_attn.in_proj_b.weight", pre);
        plan_mat(p, &lw->lin_in[3], false, nv, D, "%slinear_attn.in_proj_a.weight", pre);
    }
    struct bind *b = plan_add(p, BIND_VEC, 3, conv, 1, d->lin_conv,
                              "%slinear_attn.conv1d.weight", pre);
    if (b) b->vec = &lw->lin_conv_w;
    plan_vec(p, &lw->lin_a_log, nv, "%slinear_attn.A_log", pre);
    plan_vec(p, &lw->lin_dt_bias, nv, "%slinear_attn.dt_bias", pre);
    plan_vec(p, &lw->lin_norm, d->lin_dv, "%slinear_attn.norm.weight", pre);
    plan_mat(p, &lw->lin_out, true, D, vd, "%slinear_attn.out_proj.weight", pre);
}

/* A Mamba2 layer's tensors under "<pre>mamba.": in_proj (z, x|B|C, dt), the conv1d with its
 * bias, A_log, dt_bias, D, the grouped gated norm and out_proj (projection biases when
 * mamba_proj_bias). */
static void plan_mamba(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                       const char *pre)
{
    const int64_t D = d->d_model, I = (int64_t)d->lin_nv * d->lin_dv, H = d->lin_nv;
    const int64_t conv = I + 2 * (int64_t)d->lin_nk * d->lin_dk, rows = I + conv + H;
    plan_mat(p, &lw->lin_in[0], true, rows, D, "%smamba.in_proj.weight", pre);
    if (d->lin_proj_bias) plan_vec(p, &lw->lin_in_b, rows, "%smamba.in_proj.bias", pre);
    struct bind *b = plan_add(p, BIND_VEC, 3, conv, 1, d->lin_conv, "%smamba.conv1d.weight", pre);
    if (b) b->vec = &lw->lin_conv_w;
    if (d->lin_conv_bias) plan_vec(p, &lw->lin_conv_b, conv, "%smamba.conv1d.bias", pre);
    plan_vec(p, &lw->lin_a_log, H, "%smamba.A_log", pre);
    plan_vec(p, &lw->lin_dt_bias, H, "%smamba.dt_bias", pre);
    plan_vec(p, &lw->lin_d, H, "%smamba.D", pre);
    plan_vec(p, &lw->lin_norm, I, "%smamba.norm.weight", pre);
    plan_mat(p, &lw->lin_out, true, D, I, "%smamba.out_proj.weight", pre);
    if (d->lin_proj_bias) plan_vec(p, &lw->lin_out_b, D, "%smamba.out_proj.bias", pre);
}

/* Granite's FFN block: shared_mlp (input_linear = gate|up, output_linear) as the layer's shared
 * expert, or as its dense FFN when the model has no experts; the routed experts under
 * block_sparse_moe (router.layer, input_linear (E, 2 ff, d), output_linear (E, d, ff)). */
static void plan_granite_ffn(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                             const char *pre, bool moe)
{
    const int64_t D = d->d_model, E = d->n_expert;
    struct ffn_w *sh = moe ? (d->n_shared > 0 ? &lw->shared[0] : NULL) : &lw->dense;
    if (sh) {
        sh->d_ff = moe ? d->shared_d_ff : d->dense_d_ff;
        struct bind *b = plan_add(p, BIND_PAIR_GATE_UP, 2, 2 * (int64_t)sh->d_ff, D, 0,
                                  "%sshared_mlp.input_linear.weight", pre);
        if (b) b->experts = sh;
        plan_mat(p, &sh->down, true, D, sh->d_ff, "%sshared_mlp.output_linear.weight", pre);
    }
    if (!moe) return;
    int64_t ff = d->expert_d_ff[0];
    plan_mat(p, &lw->router, false, E, D, "%sblock_sparse_moe.router.layer.weight", pre);
    for (int e = 0; e < d->n_expert; e++) lw->experts[e].d_ff = (int)ff;
    struct bind *b = plan_add(p, BIND_FUSED_GATE_UP, 3, E, 2 * ff, D,
                              "%sblock_sparse_moe.input_linear.weight", pre);
    if (b) b->experts = lw->experts;
    b = plan_add(p, BIND_FUSED_DOWN, 3, E, D, ff, "%sblock_sparse_moe.output_linear.weight", pre);
    if (b) b->experts = lw->experts;
}

/* Llama 4's FFN block under "<pre>feed_forward.": a dense SwiGLU, or the router, the experts
 * (gate_up_proj (E, d, 2 ff) and down_proj (E, ff, d), stored (in, out)) and the shared expert. */
static void plan_llama4_ffn(struct plan *p, struct layer_w *lw, const struct model_desc *d,
                            const char *pre, bool moe)
{
    char ff[128];
    snprintf(ff, sizeof ff, "%sfeed_forward.", pre);
    if (!moe) {
        plan_ffn(p, &lw->dense, d->dense_d_ff, d->d_model, ff, "gate_proj", "up_proj",
                 "down_proj");
        return;
    }
    const int64_t E = d->n_expert, D = d->d_model, f = d->expert_d_ff[0];
    plan_mat(p, &lw->router, false, E, D, "%srouter.weight", ff);
    for (int e = 0; e < d->n_expert; e++) lw->experts[e].d_ff = (int)f;
    struct bind *b = plan_add(p, BIND_T_GATE_UP_SPLIT, 3, E, D, 2 * f,
                              "%sexperts.gate_up_proj", ff);
    if (b) b->experts = lw->experts;
    b = plan_add(p, BIND_T_DOWN, 3, E, f, D, "%sexperts.down_proj", ff);
    if (b) b->experts = lw->experts;
    char sh[160];
    snprintf(sh, sizeof sh, "%sshared_expert.", ff);
    plan_ffn(p, &lw->shared[0], d->shared_d_ff, d->d_model, sh, "gate_proj", "up_proj",
             "down_proj");
}

/* Qwen3-Next and Qwen3.5 keep their MTP module under mtp. with names of their own. */
static bool mtp_qwen_layout(const struct model_desc *d)
{
    return strcmp(d->model_type, "qwen3_next") == 0 || strncmp(d->model_type, "qwen3_5_moe", 11) == 0;
}

/* Qwen's MTP layers: how many mtp.layers.{i} the folder holds (their configs say it as
 * num_nextn_predict_layers or mtp_num_hidden_layers, or not at all). */
static int count_qwen_mtp(const struct st_archive *st)
{
    int n = 0;
    char probe[64];
    for (;; n++) {
        snprintf(probe, sizeof probe, "mtp.layers.%d.input_layernorm.weight", n);
        if (n >= 64 || !st_find(st, probe)) return n;
    }
}

/* The MTP layers (model_desc.n_mtp_layers) sit at model.layers.n_layer.. and are never
 * planned, so their tensors stay unread in the mapping; this only counts them for the load
 * note, so that a log shows they were in the checkpoint and skipped on purpose. */
static void note_mtp_layers(struct model *m)
{
    const struct model_desc *d = &m->desc;
    m->skip_note[0] = '\0';
    if (d->n_mtp_layers <= 0 || m->n_mtp > 0) return;
    size_t n = 0;
    for (int i = 0; i < st_count(m->st); i++) {
        const char *name = st_at(m->st, i)->name;
        int l = -1;
        size_t np = strlen(d->wprefix), nl = strlen(d->wlayers);
        if (strncmp(name, d->wprefix, np) == 0 && strncmp(name + np, d->wlayers, nl) == 0 &&
            sscanf(name + np + nl, "%d.", &l) == 1 && l >= d->n_layer &&
            l < d->n_layer + d->n_mtp_layers)
            n++;
    }
    if (mtp_qwen_layout(d) || d->v4_attn) { /* DeepSeek-V4 publishes its own under mtp. */
        for (int i = 0; i < st_count(m->st); i++)
            n += strncmp(st_at(m->st, i)->name, "mtp.", 4) == 0;
        if (n > 0)
            snprintf(m->skip_note, sizeof m->skip_note,
                     "skipped the MTP module (mtp.*, %d layer(s), %zu tensors): multi-token "
                     "prediction is not used",
                     d->n_mtp_layers, n);
        return;
    }
    if (n > 0)
        snprintf(m->skip_note, sizeof m->skip_note,
                 "skipped %d MTP layer(s) (%s%s%d..%d, %zu tensors): multi-token "
                 "prediction is not used",
                 d->n_mtp_layers, d->wprefix, d->wlayers, d->n_layer,
                 d->n_layer + d->n_mtp_layers - 1, n);
}

/* The tensors of one decoder block under `pre` ("model.layers.3."): linear (a state-space
 * layer) or attention of the model's kind, then an MoE FFN when is_moe, else a dense one. l is
 * the block's index, for messages. */
static int plan_layer(struct plan *p, struct model *m, struct layer_w *lw, const char *pre,
                      bool linear, bool is_moe, int l, const char *wname, char *err,
                      size_t errlen)
{
    const struct model_desc *d = &m->desc;
    const int64_t D = d->d_model, q_dim = (int64_t)d->n_head * d->head_dim,
                  kv_dim = (int64_t)d->n_kv_head * d->head_dim;
    bool mixtral = strcmp(d->model_type, "mixtral") == 0;
    /* MiniMax-M2 publishes its experts under Mixtral's names (block_sparse_moe., w1/w3/w2) and
     * its correction bias on the MoE block rather than on the gate */
    bool minimax = strcmp(d->model_type, "minimax_m2") == 0;
    bool gptoss = strcmp(d->model_type, "gpt_oss") == 0;
    bool granite = strcmp(d->model_type, "granitemoehybrid") == 0;
    bool llama4 = strcmp(d->model_type, "llama4_text") == 0;
    char moe[112];
    if (d->attn == ATTN_KIND_V4) return plan_v4(p, m->st, lw, d, pre, l, wname, err, errlen);
    plan_norm(p, &lw->attn_norm, D, "%sinput_layernorm.weight", pre);
    plan_norm(p, &lw->ffn_norm, D, "%spost_attention_layernorm.weight", pre);
    if (linear && d->lin_kind == LIN_KIND_MAMBA2) {
        plan_mamba(p, lw, d, pre);
    } else if (linear) {
        plan_gdn(p, lw, d, pre);
    } else if (d->attn == ATTN_KIND_MLA) {
        plan_mla(p, lw, d, pre,
                 d->dsa_topk > 0 && !(d->dsa_shared && l < d->n_layer && d->dsa_shared[l]));
    } else {
        /* a gated q_proj gives each head's query, then its gate logits */
        plan_mat(p, &lw->wq, true, d->attn_out_gate ? 2 * q_dim : q_dim, D,
                 "%sself_attn.q_proj.weight", pre);
        plan_mat(p, &lw->wk, true, kv_dim, D, "%sself_attn.k_proj.weight", pre);
        plan_mat(p, &lw->wv, true, kv_dim, D, "%sself_attn.v_proj.weight", pre);
        plan_mat(p, &lw->wo, true, D, q_dim, "%sself_attn.o_proj.weight", pre);
        if (d->qkv_bias) {
            plan_vec(p, &lw->bq, q_dim, "%sself_attn.q_proj.bias", pre);
            plan_vec(p, &lw->bk, kv_dim, "%sself_attn.k_proj.bias", pre);
            plan_vec(p, &lw->bv, kv_dim, "%sself_attn.v_proj.bias", pre);
        }
        if (d->o_bias) plan_vec(p, &lw->bo, D, "%sself_attn.o_proj.bias", pre);
        if (d->attn_sinks) plan_vec(p, &lw->sinks, d->n_head, "%sself_attn.sinks", pre);
        if (d->qk_norm == QK_NORM_HEAD || d->qk_norm == QK_NORM_FULL) {
            bool full = d->qk_norm == QK_NORM_FULL;
            plan_norm(p, &lw->q_norm, full ? q_dim : d->head_dim, "%sself_attn.q_norm.weight",
                      pre);
            plan_norm(p, &lw->k_norm, full ? kv_dim : d->head_dim, "%sself_attn.k_norm.weight",
                      pre);
        }
    }
    if (d->ffn == FFN_KIND_CONTINUOUS) {
        /* infmoe: the neuron matrices are read a row at a time (gathered by the selection),
         * so they stay as stored (or --dtype) under --quantization. */
        const int64_t Fn = d->cont_d_ff, Z = d->cont_z;
        snprintf(moe, sizeof moe, "%smlp.", pre);
        plan_mat(p, &lw->cont_router, false, 2 * Z, D, "%srouter.weight", moe);
        plan_vec(p, &lw->cont_router_b, 2 * Z, "%srouter.bias", moe);
        plan_mat(p, &lw->cont_keys, false, Fn, Z, "%sneuron_keys.weight", moe);
        plan_mat(p, &lw->cont_gate, false, Fn, D, "%sgate_proj.weight", moe);
        plan_mat(p, &lw->cont_up, false, Fn, D, "%sup_proj.weight", moe);
        plan_mat(p, &lw->cont_down_t, false, Fn, D, "%sdown_t.weight", moe);
        return 0;
    }
    if (granite) {
        plan_granite_ffn(p, lw, d, pre, is_moe);
        return 0;
    }
    if (llama4) {
        plan_llama4_ffn(p, lw, d, pre, is_moe);
        return 0;
    }
    if (!is_moe) {
        snprintf(moe, sizeof moe, "%smlp.", pre);
        plan_ffn(p, &lw->dense, d->dense_d_ff, d->d_model, moe, "gate_proj", "up_proj",
                 "down_proj");
        return 0;
    }
    if (gptoss) {
        snprintf(moe, sizeof moe, "%smlp.", pre);
        plan_mat(p, &lw->router, false, d->n_expert, D, "%srouter.weight", moe);
        plan_vec(p, &lw->router_b, d->n_expert, "%srouter.bias", moe);
        plan_gptoss_experts(p, m->st, lw, d, moe);
        return 0;
    }
    /* transformers 5 may save Mixtral's block under its in-memory name "mlp." */
    snprintf(moe, sizeof moe, "%smlp.gate.weight", pre);
    bool legacy = (mixtral || minimax) && !st_find(m->st, moe);
    snprintf(moe, sizeof moe, "%s%s", pre, legacy ? "block_sparse_moe." : "mlp.");
    plan_mat(p, &lw->router, false, d->n_expert, D, "%sgate.weight", moe);
    if (d->router_bias)
        plan_vec(p, &lw->router_bias, d->n_expert,
                 minimax ? "%se_score_correction_bias" : "%sgate.e_score_correction_bias", moe);
    if (d->router == ROUTER_KIND_MOHGE) /* mohge: the sigmoid group router */
        plan_mat(p, &lw->group_router, false, d->n_group, D, "%sgroup_gate.weight", moe);
    if (plan_experts(p, m->st, lw, d, moe, mixtral || minimax) != 0)
        return ms_errf(err, errlen,
                       "%s: layer %d stores fused experts but config gives them different widths",
                       wname, l);
    for (int s = 0; s < d->n_shared; s++) {
        char sp[160];
        if (d->shared_merged) /* DeepSeek / GLM: one FFN of all shared experts' width */
            snprintf(sp, sizeof sp, "%sshared_experts.", moe);
        else if (d->n_shared == 1)
            snprintf(sp, sizeof sp, "%sshared_expert.", moe);
        else
            snprintf(sp, sizeof sp, "%sshared_experts.%d.", moe, s);
        plan_ffn(p, &lw->shared[s], d->shared_d_ff, d->d_model, sp, "gate_proj", "up_proj",
                 "down_proj");
    }
    if (d->shared_gate == SHARED_GATE_SIGMOID)
        plan_mat(p, &lw->shared_gate, false, 1, D, "%sshared_expert_gate.weight", moe);
    return 0;
}

/* The MTP modules (model.layers.{n_layer + i}., or Qwen's mtp.): the fusion's norms and
 * projection, the block (MoE when the checkpoint has its router), the head's norm and, when
 * present, its own head. */
static int plan_mtp(struct plan *p, struct model *m, const char *wname, char *err, size_t errlen)
{
    const struct model_desc *d = &m->desc;
    const int64_t D = d->d_model;
    for (int i = 0; i < m->n_mtp; i++) {
        struct model_mtp *mt = &m->mtp[i];
        int l = d->n_layer + i;
        char pre[96], probe[160];
        if (mtp_qwen_layout(d)) { /* mtp.fc, mtp.pre_fc_norm_*, mtp.layers.i, mtp.norm */
            snprintf(pre, sizeof pre, "mtp.layers.%d.", i);
            plan_norm(p, &mt->enorm, D, "%spre_fc_norm_embedding.weight", "mtp.");
            plan_norm(p, &mt->hnorm, D, "%spre_fc_norm_hidden.weight", "mtp.");
            plan_mat(p, &mt->eh_proj, true, D, 2 * D, "%sfc.weight", "mtp.");
            plan_norm(p, &mt->head_norm, D, "%snorm.weight", "mtp.");
            mt->chain_normed = true;
            snprintf(probe, sizeof probe, "%smlp.gate.weight", pre);
            mt->moe = d->n_expert > 0 && st_find(m->st, probe) != NULL;
            if (plan_layer(p, m, &mt->layer, pre, false, mt->moe, l, wname, err, errlen) != 0)
                return -1;
            continue;
        }
        snprintf(pre, sizeof pre, "%s%s%d.", d->wprefix, d->wlayers, l);
        plan_norm(p, &mt->enorm, D, "%senorm.weight", pre);
        plan_norm(p, &mt->hnorm, D, "%shnorm.weight", pre);
        plan_mat(p, &mt->eh_proj, true, D, 2 * D, "%seh_proj.weight", pre);
        plan_norm(p, &mt->head_norm, D, "%sshared_head.norm.weight", pre);
        snprintf(probe, sizeof probe, "%sshared_head.head.weight", pre);
        if (st_find(m->st, probe))
            plan_mat(p, &mt->head, true, d->vocab, D, "%sshared_head.head.weight", pre);
        snprintf(probe, sizeof probe, "%smlp.gate.weight", pre);
        mt->moe = d->n_expert > 0 && st_find(m->st, probe) != NULL;
        if (plan_layer(p, m, &mt->layer, pre, false, mt->moe, l, wname, err, errlen) != 0)
            return -1;
    }
    return 0;
}

/* Every tensor the description needs, with the pointer it binds. */
static int plan_model(struct plan *p, struct model *m, const char *wname, bool quant, char *err,
                      size_t errlen)
{
    const struct model_desc *d = &m->desc;
    const int64_t D = d->d_model;
    bool gptoss = strcmp(d->model_type, "gpt_oss") == 0;
    if (gptoss && (D % 32 != 0 || d->expert_d_ff[0] % 32 != 0) &&
        st_find(m->st, "model.layers.0.mlp.experts.gate_up_proj_blocks"))
        return ms_errf(err, errlen, "%s: MXFP4 experts need hidden_size (%d) and "
                                    "intermediate_size (%d) to be multiples of 32",
                       wname, d->d_model, d->expert_d_ff[0]);
    const char *wp = d->wprefix;
    p->norm_plus_one = d->norm_plus_one;
    plan_mat(p, &m->embed, false, d->vocab, D,
             d->v4_attn && wp[0] == '\0' ? "%sembed.weight" : "%sembed_tokens.weight", wp);
    plan_norm(p, &m->norm, D, "%snorm.weight", wp);
    if (d->v4_attn) { /* the final collapse of the hyper-connection streams */
        /* transformers 5.25 saves "model.hc_head.*", DeepSeek publishes "hc_head_*" */
        bool own = wp[0] != '\0';
        plan_mat(p, &m->hc_head_fn, false, d->v4_hc, (int64_t)d->v4_hc * D,
                 own ? "%shc_head.hc_fn" : "%shc_head_fn", wp);
        plan_vec(p, &m->hc_head_base, d->v4_hc, own ? "%shc_head.hc_base" : "%shc_head_base", wp);
        plan_vec(p, &m->hc_head_scale, 1, own ? "%shc_head.hc_scale" : "%shc_head_scale", wp);
    }
    if (!d->tie_embeddings)
        plan_mat(p, &m->lm_head, true, d->vocab, D, "%s", d->lm_head_name);
    else if (quant) /* a quantized head of its own; the embedding table stays as it is */
        plan_mat(p, &m->lm_head, true, d->vocab, D, "%sembed_tokens.weight", wp);
    for (int l = 0; l < d->n_layer; l++) {
        char pre[80];
        snprintf(pre, sizeof pre, "%s%s%d.", wp, d->wlayers, l);
        if (plan_layer(p, m, &m->layers[l], pre, d->layer_linear && d->layer_linear[l],
                       d->layer_is_moe[l], l, wname, err, errlen) != 0)
            return -1;
    }
    if (plan_mtp(p, m, wname, err, errlen) != 0) return -1;
    if (p->oom) return ms_errf(err, errlen, "%s: out of memory", wname);
    return 0;
}

static const char *shape_str(const int64_t *s, int n, char *buf, size_t cap)
{
    size_t k = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
    return buf;
}

static size_t bind_numel(const struct bind *b)
{
    size_t n = 1;
    for (int i = 0; i < b->ndim; i++)
        n *= (size_t)b->shape[i];
    return n;
}

static enum wtype stored_wtype(enum st_dtype t)
{
    return t == ST_DTYPE_F32 ? WTYPE_F32 : t == ST_DTYPE_F16 ? WTYPE_F16 : WTYPE_BF16;
}

static enum wsrc stored_wsrc(enum st_dtype t)
{
    return t == ST_DTYPE_F32 ? WSRC_F32 : t == ST_DTYPE_F16 ? WSRC_F16 : WSRC_BF16;
}

/* The type a matrix has in memory under the load options. */
static enum wtype target_wtype(enum st_dtype stored, bool quantizable,
                               const struct model_load_opts *o)
{
    if (quantizable && o->quant == MODEL_QUANT_INT8) return WTYPE_Q8;
    if (quantizable && o->quant == MODEL_QUANT_INT4) return WTYPE_Q4;
    if (o->dtype == MODEL_DTYPE_F32) return WTYPE_F32;
    if (o->dtype == MODEL_DTYPE_BF16) return WTYPE_BF16;
    return stored_wtype(stored);
}

struct load_ctx {
    struct model *m;
    struct plan *p;
    struct mat_src *src; /* (n_mats) */
    const struct model_load_opts *opts;
    size_t conv_bytes, vec_floats;
    bool from_cache; /* the converted block came from a cache file: nothing to convert */
};

/* Pass 1 for one matrix: its type in memory, and whether it can be borrowed (a plain slice
 * kept in its stored type). src->nh etc. describe the layout (see struct mat_src). */
static void plan_matrix_ex(struct load_ctx *c, int idx, const struct st_tensor *t, size_t elem0,
                           int rows, int cols, bool quantizable, int nh, size_t hstride, size_t rs,
                           size_t cs)
{
    struct mat_src *ms = &c->src[idx];
    ms->t = t;
    ms->elem0 = elem0;
    ms->nh = nh;
    ms->hr = rows / nh;
    ms->hstride = hstride;
    ms->rs = rs;
    ms->cs = cs;
    ms->to = target_wtype(t->dtype, quantizable, c->opts);
    const unsigned char *data = (const unsigned char *)t->data + elem0 * st_dtype_size(t->dtype);
    bool plain = nh == 1 && rs == (size_t)cols && cs == 1;
    ms->borrowed = plain && ms->to == stored_wtype(t->dtype) &&
                   (uintptr_t)data % wtype_align(ms->to) == 0;
    if (!ms->borrowed) {
        ms->off = c->conv_bytes;
        c->conv_bytes += (wtype_bytes(ms->to, rows, cols) + 63) / 64 * 64;
    }
    struct wmat *w = &c->m->mats[idx];
    w->type = ms->to;
    w->rows = rows;
    w->cols = cols;
    w->data = ms->borrowed ? data : NULL;
}

static void plan_matrix(struct load_ctx *c, int idx, const struct st_tensor *t, size_t elem0,
                        int rows, int cols, bool quantizable)
{
    plan_matrix_ex(c, idx, t, elem0, rows, cols, quantizable, 1, 0, (size_t)cols, 1);
}

/* Pass 1 for a matrix stored in MXFP4 (rows elem0, elem0 + rstep, ... of blocks/scales viewed
 * as (rows, cols/32) blocks): repacked into WTYPE_MXFP4 (any --quantization too: it is already
 * 4-bit, and requantizing would only add error), or dequantized for --dtype float32|bfloat16. */
static void plan_matrix_mx(struct load_ctx *c, int idx, const struct st_tensor *blocks,
                           const struct st_tensor *scales, size_t row0, size_t rstep, int rows,
                           int cols)
{
    struct mat_src *ms = &c->src[idx];
    memset(ms, 0, sizeof *ms);
    ms->t = blocks;
    ms->scales = scales;
    ms->elem0 = row0;
    ms->rs = rstep;
    ms->nh = 1;
    ms->hr = rows;
    ms->to = c->opts->dtype == MODEL_DTYPE_F32    ? WTYPE_F32
             : c->opts->dtype == MODEL_DTYPE_BF16 ? WTYPE_BF16
                                                  : WTYPE_MXFP4;
    ms->off = c->conv_bytes;
    c->conv_bytes += (wtype_bytes(ms->to, rows, cols) + 63) / 64 * 64;
    c->m->mats[idx] = (struct wmat){.type = ms->to, .rows = rows, .cols = cols, .data = NULL};
}

/* The scales tensor of a BIND_MX_* bind: U8 of the blocks' shape less the last dimension, no
 * 0xFF (NaN in e8m0). */
static int check_mx_scales(struct bind *b, const struct st_archive *st, char *err, size_t errlen)
{
    char name[160];
    size_t n = strlen(b->name);
    snprintf(name, sizeof name, "%.*s_scales", (int)(n > 7 ? n - 7 : n), b->name); /* _blocks */
    const struct st_tensor *t = st_find(st, name);
    if (!t) return ms_errf(err, errlen, "%s: missing tensor '%s'", b->t->file, name);
    bool same = t->dtype == ST_DTYPE_U8 && t->ndim == 3;
    for (int k = 0; same && k < 3; k++) same = t->shape[k] == b->shape[k];
    if (!same) {
        char e1[96], e2[160];
        return ms_errf(err, errlen, "%s: tensor '%s': expected U8 of shape %s, found %s %s",
                       t->file, name, shape_str(b->shape, 3, e1, sizeof e1),
                       st_dtype_name(t->dtype), shape_str(t->shape, t->ndim, e2, sizeof e2));
    }
    const unsigned char *sc = t->data;
    for (size_t i = 0; i < t->nbytes; i++)
        if (sc[i] == 0xFF)
            return ms_errf(err, errlen, "%s: tensor '%s': scale 0xFF (NaN in e8m0) at byte %zu",
                           t->file, name, i);
    /* Scales are always repacked or dequantized, never read in place: give the pages this scan
     * faulted in back now, or every layer's scales (1/16 of the blocks) would stay resident
     * until pass 2 reaches that layer. The repack faults them in again, one layer at a time. */
    st_release_pages(t);
    b->t2 = t;
    return 0;
}

/* Pass 1: find and check every tensor, decide every matrix; sizes in c. */
static int bind_check(struct load_ctx *c, const struct st_archive *st, const char *wname,
                      char *err, size_t errlen)
{
    struct plan *p = c->p;
    c->conv_bytes = 0;
    c->vec_floats = 0;
    c->m->n_params = 0;
    for (int i = 0; i < p->n; i++) {
        struct bind *b = &p->b[i];
        const struct st_tensor *t = st_find(st, b->name);
        if (!t) return ms_errf(err, errlen, "%s: missing tensor '%s'", wname, b->name);
        bool mx = b->kind == BIND_MX_GATE_UP || b->kind == BIND_MX_DOWN;
        if (mx && t->dtype != ST_DTYPE_U8)
            return ms_errf(err, errlen, "%s: tensor '%s': dtype %s not supported (MXFP4 blocks "
                                        "are U8)",
                           t->file, b->name, st_dtype_name(t->dtype));
        if (b->kind == BIND_IDX && t->dtype != ST_DTYPE_I64 && t->dtype != ST_DTYPE_I32)
            return ms_errf(err, errlen, "%s: tensor '%s': dtype %s not supported (expected I64 "
                                        "or I32)",
                           t->file, b->name, st_dtype_name(t->dtype));
        if (!mx && b->kind != BIND_IDX && t->dtype != ST_DTYPE_F32 &&
            t->dtype != ST_DTYPE_BF16 && t->dtype != ST_DTYPE_F16)
            return ms_errf(err, errlen,
                           "%s: tensor '%s': dtype %s not supported (expected F32, F16 or BF16)",
                           t->file, b->name, st_dtype_name(t->dtype));
        bool same = t->ndim == b->ndim;
        for (int k = 0; same && k < b->ndim; k++)
            same = t->shape[k] == b->shape[k];
        if (!same) {
            char e1[96], e2[160];
            return ms_errf(err, errlen, "%s: tensor '%s': expected shape %s, found %s", t->file,
                           b->name, shape_str(b->shape, b->ndim, e1, sizeof e1),
                           shape_str(t->shape, t->ndim, e2, sizeof e2));
        }
        b->t = t;
        if (mx && check_mx_scales(b, st, err, errlen) != 0) return -1;
        /* a tied head planned for quantization reads the embedding a second time */
        if (b->kind == BIND_MLA_UK_T) {
            /* a transposed copy of part of kv_b_proj, counted there */
        } else if (mx) {
            c->m->n_params += bind_numel(b) * 2; /* two weights a byte */
        } else if (!(b->kind == BIND_MAT_Q && b->mat == &c->m->lm_head)) c->m->n_params += bind_numel(b);
        else if (!c->m->desc.tie_embeddings) c->m->n_params += bind_numel(b);
        int rows = (int)b->shape[b->ndim - 2 >= 0 ? b->ndim - 2 : 0];
        int cols = (int)b->shape[b->ndim - 1];
        switch (b->kind) {
        case BIND_VEC:
        case BIND_EX_BIAS_DOWN:
            b->vec_off = SIZE_MAX;
            if (t->dtype != ST_DTYPE_F32 || (uintptr_t)t->data % 4 != 0 || b->plus_one) {
                b->vec_off = c->vec_floats;
                c->vec_floats += bind_numel(b);
            }
            break;
        case BIND_IDX: /* narrowed to int32: always converted */
        case BIND_EX_BIAS_GU: /* de-interleaved: always converted */
            b->vec_off = c->vec_floats;
            c->vec_floats += bind_numel(b);
            break;
        case BIND_MX_GATE_UP:
        case BIND_MX_DOWN: {
            /* rows of the (E * out, in) matrix the blocks hold; gate/up alternate rows */
            bool gu = b->kind == BIND_MX_GATE_UP;
            int out = (int)b->shape[1] / (gu ? 2 : 1), in = (int)b->shape[2] * 32;
            for (int e = 0; e < (int)b->shape[0]; e++)
                for (int h = 0; h < (gu ? 2 : 1); h++)
                    plan_matrix_mx(c, b->mat0 + (gu ? 2 : 1) * e + h, t, b->t2,
                                   (size_t)e * (size_t)b->shape[1] + (size_t)h, gu ? 2 : 1, out,
                                   in);
            break;
        }
        case BIND_T_GATE_UP: {
            /* expert e's gate row r, column c = t[e][c][2r] (up: [2r + 1]) */
            int dm = (int)b->shape[1], ff = (int)b->shape[2] / 2;
            for (int e = 0; e < (int)b->shape[0]; e++)
                for (int h = 0; h < 2; h++)
                    plan_matrix_ex(c, b->mat0 + 2 * e + h, t,
                                   (size_t)e * (size_t)dm * 2 * (size_t)ff + (size_t)h, ff, dm,
                                   true, 1, 0, 2, 2 * (size_t)ff);
            break;
        }
        case BIND_T_GATE_UP_SPLIT: {
            /* expert e's gate row r, column c = t[e][c][r] (up: [ff + r]) */
            int dm = (int)b->shape[1], ff = (int)b->shape[2] / 2;
            for (int e = 0; e < (int)b->shape[0]; e++)
                for (int h = 0; h < 2; h++)
                    plan_matrix_ex(c, b->mat0 + 2 * e + h, t,
                                   (size_t)e * (size_t)dm * 2 * (size_t)ff + (size_t)h * ff, ff,
                                   dm, true, 1, 0, 1, 2 * (size_t)ff);
            break;
        }
        case BIND_T_DOWN: {
            /* expert e's down row r, column c = t[e][c][r] */
            int ff = (int)b->shape[1], dm = (int)b->shape[2];
            for (int e = 0; e < (int)b->shape[0]; e++)
                plan_matrix_ex(c, b->mat0 + e, t, (size_t)e * (size_t)ff * (size_t)dm, dm, ff,
                               true, 1, 0, 1, (size_t)dm);
            break;
        }
        case BIND_MAT:
        case BIND_MAT_Q:
            plan_matrix(c, b->mat0, t, 0, rows, cols, b->kind == BIND_MAT_Q);
            break;
        case BIND_FUSED_GATE_UP: {
            int ff = (int)b->shape[1] / 2, dm = (int)b->shape[2];
            for (int e = 0; e < (int)b->shape[0]; e++) {
                size_t base = (size_t)e * 2 * (size_t)ff * (size_t)dm;
                plan_matrix(c, b->mat0 + 2 * e, t, base, ff, dm, true);
                plan_matrix(c, b->mat0 + 2 * e + 1, t, base + (size_t)ff * dm, ff, dm, true);
            }
            break;
        }
        case BIND_MLA_UK_T: {
            /* head h's block: row j, column i = kv_b_proj[h*(dn+dv) + i][j] */
            const struct model_desc *d = &c->m->desc;
            int H = d->n_head, kvr = d->kv_lora_rank, dn = d->qk_nope_dim;
            plan_matrix_ex(c, b->mat0, t, 0, H * kvr, dn, b->mla_tiles, H,
                           (size_t)(dn + d->v_head_dim) * (size_t)kvr, 1, (size_t)kvr);
            break;
        }
        case BIND_PAIR_GATE_UP: {
            int ff = (int)b->shape[0] / 2, dm = (int)b->shape[1];
            plan_matrix(c, b->mat0, t, 0, ff, dm, true);
            plan_matrix(c, b->mat0 + 1, t, (size_t)ff * dm, ff, dm, true);
            break;
        }
        case BIND_FUSED_DOWN:
            for (int e = 0; e < (int)b->shape[0]; e++)
                plan_matrix(c, b->mat0 + e, t, (size_t)e * (size_t)b->shape[1] * b->shape[2],
                            (int)b->shape[1], (int)b->shape[2], true);
            break;
        }
    }
    return 0;
}

/* Conversion work: one task per matrix tile range, run on the pool. */
struct conv_task {
    int mat;
    int r0, r1;
};

struct conv_job {
    struct load_ctx *c;
    struct conv_task *tasks;
    int n_tasks;
    int first; /* pool task i is tasks[first + i] (one group of slabs at a time) */
    _Atomic size_t done_rows;
    size_t total_rows;
};

static void conv_run(void *ctx, int i, int thread)
{
    struct conv_job *j = ctx;
    struct load_ctx *c = j->c;
    const struct conv_task *t = &j->tasks[j->first + i];
    const struct mat_src *ms = &c->src[t->mat];
    const struct wmat *w = &c->m->mats[t->mat];
    if (ms->scales) {
        /* MXFP4: row elem0 of (rows, cols/32 blocks of 16 bytes) and of the scales */
        size_t nb = (size_t)w->cols / 32;
        wmat_convert_mxfp4(w->type, (void *)w->data,
                           (const unsigned char *)ms->t->data + ms->elem0 * nb * 16,
                           (const unsigned char *)ms->scales->data + ms->elem0 * nb, w->rows,
                           w->cols, ms->rs, t->r0, t->r1);
        size_t done = atomic_fetch_add(&j->done_rows, (size_t)(t->r1 - t->r0)) + (size_t)(t->r1 - t->r0);
        if (thread == 0 && c->opts->progress && j->total_rows)
            c->opts->progress(c->opts->progress_ctx, (double)done / (double)j->total_rows);
        return;
    }
    size_t es = st_dtype_size(ms->t->dtype);
    const unsigned char *src = (const unsigned char *)ms->t->data + ms->elem0 * es;
    /* Block by block (one block for plain matrices); blocks of a quantized matrix start on
     * whole tiles (plan_mla), so each block's rows are a matrix of their own. */
    for (int h = t->r0 / ms->hr; h < ms->nh && h * ms->hr < t->r1; h++) {
        int b0 = h * ms->hr, r0 = t->r0 > b0 ? t->r0 - b0 : 0;
        int r1 = t->r1 - b0 < ms->hr ? t->r1 - b0 : ms->hr;
        struct wmat blk = wmat_rows(w, b0, ms->hr);
        wmat_convert_strided(w->type, (void *)blk.data, stored_wsrc(ms->t->dtype),
                             src + (size_t)h * ms->hstride * es, ms->hr, w->cols, ms->rs, ms->cs,
                             r0, r1);
    }
    size_t done = atomic_fetch_add(&j->done_rows, (size_t)(t->r1 - t->r0)) + (size_t)(t->r1 - t->r0);
    if (thread == 0 && c->opts->progress && j->total_rows)
        c->opts->progress(c->opts->progress_ctx, (double)done / (double)j->total_rows);
}

/* Streaming conversion. A matrix converted or quantized at load is read once from the mapping
 * and never again, so its source pages are given back (st_release_pages: MADV_DONTNEED on the
 * pages wholly inside the tensor) as soon as the last bind reading that tensor has been
 * converted (or, for experts stored together in one tensor, as each expert's slab is: see
 * bind_slabs), not at the end of the load: the resident set then peaks at the converted block
 * plus one small group of source tensors, instead of converted + the whole checkpoint (a 70 GB
 * bf16 checkpoint quantized to ~22 GB of int4 fits in 24 GB only this way). MADV_DONTNEED rather
 * than pread into a buffer: the conversions read strided slices (fused and transposed experts,
 * MLA's per-head transpose, MXFP4 blocks with their scales) straight from the mapping, and
 * dropping pages of a read-only file mapping (MAP_PRIVATE, never written, so no private copy)
 * is always safe: a later touch faults them in again from the file. Tensors that any bind
 * keeps in place (borrowed matrices and vectors, e.g. the embedding table, also when a tied
 * head is quantized from it) are never released: their pages are the weights. Pages a tensor
 * shares with its neighbours at either end are kept too (st_release_pages rounds inward). */
struct stream {
    int *last;  /* (st_count) index of the last bind reading each tensor, -1 for none */
    bool *kept; /* (st_count) read in place by some bind, or already released */
};

static int stream_init(struct stream *s, const struct load_ctx *c)
{
    const struct st_archive *st = c->m->st;
    size_t n = (size_t)(st_count(st) > 0 ? st_count(st) : 1);
    s->last = malloc(n * sizeof *s->last);
    s->kept = calloc(n, sizeof *s->kept);
    if (!s->last || !s->kept) {
        free(s->last);
        free(s->kept);
        return -1;
    }
    for (size_t i = 0; i < n; i++) s->last[i] = -1;
    for (int i = 0; i < c->p->n; i++) {
        const struct bind *b = &c->p->b[i];
        int nm = bind_mats(b);
        bool borrowed = bind_is_vec(b) && b->vec_off == SIZE_MAX;
        for (int k = 0; k < nm; k++) borrowed = borrowed || c->src[b->mat0 + k].borrowed;
        if (borrowed) s->kept[st_index(st, b->t)] = true;
        s->last[st_index(st, b->t)] = i;
        if (b->t2) s->last[st_index(st, b->t2)] = i;
    }
    return 0;
}

/* After binds [b0, b1] are converted: release the tensors they read for the last time. */
static void stream_release(struct stream *s, const struct load_ctx *c, int b0, int b1)
{
    const struct st_archive *st = c->m->st;
    for (int i = b0; i <= b1; i++) {
        const struct st_tensor *ts[2] = {c->p->b[i].t, c->p->b[i].t2};
        for (int k = 0; k < 2 && ts[k]; k++) {
            int idx = st_index(st, ts[k]);
            if (s->kept[idx] || s->last[idx] > b1) continue;
            st_release_pages(ts[k]);
            s->kept[idx] = true; /* once */
        }
    }
}

/* Binds of experts stored together in one tensor (fused, transposed or MXFP4 experts: expert e's
 * bytes are the e-th of shape[0] equal slabs of the tensor, and of the scales for MXFP4, the
 * source of its bind_mats / shape[0] matrices) are converted and released a slab at a time, so
 * the source in flight is a few experts, not a whole layer's (a 256-expert layer's
 * gate_up_proj is 1 GB of bf16). Any other bind is one slab. */
static int bind_slabs(const struct bind *b)
{
    switch (b->kind) {
    case BIND_FUSED_GATE_UP:
    case BIND_FUSED_DOWN:
    case BIND_MX_GATE_UP:
    case BIND_MX_DOWN:
    case BIND_T_GATE_UP:
    case BIND_T_GATE_UP_SPLIT:
    case BIND_T_DOWN: return b->shape[0] > 0 ? (int)b->shape[0] : 1;
    default: return 1;
    }
}

/* After slab `slab` of bind `bi` (of bind_slabs > 1) is converted: release its bytes of the
 * tensors only this bind reads (the whole tensors, slab boundaries included, go when the bind
 * is done: stream_release). */
static void stream_release_slab(struct stream *s, const struct load_ctx *c, int bi, int slab)
{
    const struct st_archive *st = c->m->st;
    const struct bind *b = &c->p->b[bi];
    size_t n = (size_t)bind_slabs(b);
    const struct st_tensor *ts[2] = {b->t, b->t2};
    for (int k = 0; k < 2 && ts[k]; k++) {
        int idx = st_index(st, ts[k]);
        if (s->kept[idx] || s->last[idx] != bi) continue;
        size_t per = ts[k]->nbytes / n;
        st_release_range(ts[k], (size_t)slab * per, per);
    }
}

static void stream_free(struct stream *s)
{
    free(s->last);
    free(s->kept);
}

/* Pass 2: fill the blocks and set every pointer. */
static int bind_apply(struct load_ctx *c, char *err, size_t errlen)
{
    struct model *m = c->m;
    struct plan *p = c->p;
    const struct model_load_opts *opts = c->opts;
    for (int i = 0; i < p->n; i++) {
        struct bind *b = &p->b[i];
        if (b->kind == BIND_VEC) {
            size_t n = bind_numel(b);
            if (b->vec_off == SIZE_MAX) {
                *b->vec = b->t->data;
            } else {
                float *dst = m->vectors + b->vec_off;
                wmat_convert(WTYPE_F32, dst, stored_wsrc(b->t->dtype), b->t->data, 1, (int)n, 0, 1);
                if (b->plus_one) /* transformers: x * (1 + w), 1 + w rounded to f32 first */
                    for (size_t k = 0; k < n; k++) dst[k] = 1.0f + dst[k];
                *b->vec = dst;
            }
        } else if (b->kind == BIND_IDX) {
            int32_t *dst = (int32_t *)(m->vectors + b->vec_off);
            bool i64 = b->t->dtype == ST_DTYPE_I64;
            for (size_t k = 0, n = bind_numel(b); k < n; k++) {
                int64_t v;
                if (i64) {
                    memcpy(&v, (const char *)b->t->data + 8 * k, 8);
                } else {
                    int32_t v32;
                    memcpy(&v32, (const char *)b->t->data + 4 * k, 4);
                    v = v32;
                }
                if (v < 0 || v >= m->desc.n_expert)
                    return ms_errf(err, errlen, "%s: tensor '%s': expert id %lld at %zu is out "
                                                "of range (0..%d)",
                                   b->t->file, b->name, (long long)v, k, m->desc.n_expert - 1);
                dst[k] = (int32_t)v;
            }
            *b->idx = dst;
        } else if (b->kind == BIND_MAT || b->kind == BIND_MAT_Q || b->kind == BIND_MLA_UK_T) {
            *b->mat = &m->mats[b->mat0];
        } else if (b->kind == BIND_PAIR_GATE_UP) {
            b->experts->gate = &m->mats[b->mat0];
            b->experts->up = &m->mats[b->mat0 + 1];
        } else if (b->kind == BIND_FUSED_GATE_UP || b->kind == BIND_MX_GATE_UP ||
                   b->kind == BIND_T_GATE_UP || b->kind == BIND_T_GATE_UP_SPLIT) {
            for (int64_t e = 0; e < b->shape[0]; e++) {
                b->experts[e].gate = &m->mats[b->mat0 + 2 * e];
                b->experts[e].up = &m->mats[b->mat0 + 2 * e + 1];
            }
        } else if (b->kind == BIND_EX_BIAS_GU) {
            /* per expert: the even elements (gate), then the odd ones (up) */
            int ff = (int)b->shape[1] / 2;
            size_t es = st_dtype_size(b->t->dtype);
            for (int64_t e = 0; e < b->shape[0]; e++) {
                float *dst = m->vectors + b->vec_off + (size_t)e * 2 * ff;
                wmat_convert_strided(WTYPE_F32, dst, stored_wsrc(b->t->dtype),
                                     (const unsigned char *)b->t->data + (size_t)e * 2 * ff * es,
                                     2, ff, 1, 2, 0, 2);
                b->experts[e].b_gate = dst;
                b->experts[e].b_up = dst + ff;
            }
        } else if (b->kind == BIND_EX_BIAS_DOWN) {
            const float *all = b->t->data;
            if (b->vec_off != SIZE_MAX) {
                float *dst = m->vectors + b->vec_off;
                wmat_convert(WTYPE_F32, dst, stored_wsrc(b->t->dtype), b->t->data, 1,
                             (int)bind_numel(b), 0, 1);
                all = dst;
            }
            for (int64_t e = 0; e < b->shape[0]; e++)
                b->experts[e].b_down = all + (size_t)e * (size_t)b->shape[1];
        } else {
            for (int64_t e = 0; e < b->shape[0]; e++) b->experts[e].down = &m->mats[b->mat0 + e];
        }
    }
    /* Converted matrices: tasks of whole tiles (64 rows) so threads share big tensors, in
     * bind order, a bind's slabs in order (a bind's matrices are mats[mat0, mat0 + bind_mats),
     * bind_mats / bind_slabs of them a slab), so that the tasks of units (slabs) [i, j] are
     * tasks[units[i].task0, units[j + 1].task0). */
    size_t n_tasks = 0, total_rows = 0, n_units = 0;
    for (int i = 0; i < m->n_mats; i++)
        if (!c->src[i].borrowed) {
            n_tasks += c->from_cache ? 0 : ((size_t)m->mats[i].rows + 63) / 64;
            total_rows += (size_t)m->mats[i].rows;
            m->mats[i].data = (unsigned char *)m->converted + c->src[i].off;
        }
    for (int i = 0; i < p->n; i++) n_units += (size_t)bind_slabs(&p->b[i]);
    if (n_tasks > INT32_MAX || n_units >= INT32_MAX)
        return ms_errf(err, errlen, "%s: too many weights", m->dir);
    struct conv_job job = {.c = c, .n_tasks = (int)n_tasks, .total_rows = total_rows};
    struct conv_unit {
        int bind, slab, task0;
    } *units = malloc(sizeof *units * (n_units + 1));
    job.tasks = malloc(sizeof *job.tasks * (n_tasks ? n_tasks : 1));
    struct stream s = {0};
    if (!job.tasks || !units || stream_init(&s, c) != 0) {
        free(job.tasks);
        free(units);
        return ms_errf(err, errlen, "%s: out of memory", m->dir);
    }
    int k = 0, u = 0;
    for (int i = 0; i < p->n; i++) {
        const struct bind *b = &p->b[i];
        int ns = bind_slabs(b), per = bind_mats(b) / ns;
        for (int sl = 0; sl < ns; sl++) {
            units[u++] = (struct conv_unit){i, sl, k};
            for (int mi = b->mat0 + sl * per; mi < b->mat0 + (sl + 1) * per && !c->from_cache;
                 mi++) {
                if (c->src[mi].borrowed) continue;
                int rows = m->mats[mi].rows;
                for (int r = 0; r < rows; r += 64)
                    job.tasks[k++] = (struct conv_task){mi, r, r + 64 < rows ? r + 64 : rows};
            }
        }
    }
    units[u] = (struct conv_unit){p->n, 0, k}; /* the end: no bind continues past it */
    int threads = opts->threads > 0 ? opts->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    struct pool *pool = pool_create(threads > 0 ? threads : 1, 0);
    if (!pool) {
        free(job.tasks);
        free(units);
        stream_free(&s);
        return ms_errf(err, errlen, "%s: cannot start conversion threads", m->dir);
    }
    /* One group of consecutive slabs at a time, then its sources are released (see struct
     * stream). A group is one slab, or as few as give every thread 4 tasks (small attention
     * matrices on a many-core machine), so the source resident at once is one slab (a whole
     * tensor, or one expert of a tensor of experts) plus fewer than 4 x threads x 64 rows of
     * the slabs before it in the group. */
    const int min_tasks = 4 * pool_size(pool);
    for (int i = 0; i < u;) {
        int j = i;
        while (j + 1 < u && units[j + 1].task0 - units[i].task0 < min_tasks) j++;
        job.first = units[i].task0;
        if (units[j + 1].task0 > job.first)
            pool_run(pool, conv_run, &job, units[j + 1].task0 - job.first);
        for (int x = i; x <= j; x++)
            if (bind_slabs(&p->b[units[x].bind]) > 1)
                stream_release_slab(&s, c, units[x].bind, units[x].slab);
        /* binds done: up to units[j]'s, unless its next slab is in the next group */
        int b1 = units[j + 1].bind != units[j].bind ? units[j].bind : units[j].bind - 1;
        if (b1 >= units[i].bind) stream_release(&s, c, units[i].bind, b1);
        i = j + 1;
    }
    pool_free(pool);
    free(job.tasks);
    free(units);
    stream_free(&s);
    if (opts->progress) opts->progress(opts->progress_ctx, 1.0);
    return 0;
}

/* Reads a whole file. Returns -1 with errno set (ENOENT for a missing file). */
static int read_text(const char *path, char **out, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (cap - n < 4096) {
            cap = cap ? 2 * cap : 16384;
            char *nb = realloc(buf, cap + 1);
            if (!nb) {
                free(buf);
                fclose(f);
                errno = ENOMEM;
                return -1;
            }
            buf = nb;
        }
        size_t k = fread(buf + n, 1, cap - n, f);
        n += k;
        if (k == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return -1;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* The "chat_template" of the JSON file dir/name (a string, or the older list of {name,
 * template} where "default" wins) into *out; NULL without error when the file or the key is
 * missing. */
static int json_chat_template(const char *dir, const char *name, char **out, char *err,
                              size_t errlen)
{
    char *text = NULL;
    size_t len;
    char *path = join(dir, name);
    if (!path) return ms_errf(err, errlen, "%s: out of memory", dir);
    if (read_text(path, &text, &len) != 0) {
        int rc = errno == ENOENT
                     ? 0
                     : ms_errf(err, errlen, "%s: cannot read: %s", path, strerror(errno));
        free(path);
        return rc;
    }
    json_error_t jerr;
    /* transformers writes model_max_length as 1e30, past any JSON integer jansson holds */
    json_t *root = json_loadb(text, len, JSON_DECODE_INT_AS_REAL, &jerr);
    free(text);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = ms_errf(err, errlen, "%s: not a JSON object%s%s", path, root ? "" : ": ",
                     root ? "" : jerr.text);
        goto out;
    }
    json_t *ct = json_object_get(root, "chat_template");
    const char *s = NULL;
    if (json_is_string(ct)) {
        s = json_string_value(ct);
    } else if (json_is_array(ct)) {
        size_t i;
        json_t *x;
        json_array_foreach(ct, i, x)
        {
            const char *tpl = json_string_value(json_object_get(x, "template"));
            const char *nm = json_string_value(json_object_get(x, "name"));
            if (tpl && (!s || (nm && strcmp(nm, "default") == 0))) s = tpl;
        }
    }
    if (s && !(*out = strdup(s))) rc = ms_errf(err, errlen, "%s: out of memory", path);
out:
    json_decref(root);
    free(path);
    return rc;
}

/* chat_template.jinja if present, else tokenizer_config.json's "chat_template", else
 * chat_template.json's (the processor's file of multimodal folders such as Llama 4's). NULL
 * without error when none. */
static int load_chat_template(const char *dir, char **out, char *err, size_t errlen)
{
    *out = NULL;
    char *path = join(dir, "chat_template.jinja");
    char *text = NULL;
    size_t len;
    if (!path) return ms_errf(err, errlen, "%s: out of memory", dir);
    if (read_text(path, &text, &len) == 0) {
        free(path);
        *out = text;
        return 0;
    }
    free(path);
    if (json_chat_template(dir, "tokenizer_config.json", out, err, errlen) != 0) return -1;
    if (*out) return 0;
    return json_chat_template(dir, "chat_template.json", out, err, errlen);
}

void model_load_opts_default(struct model_load_opts *o)
{
    memset(o, 0, sizeof *o);
    o->require_tokenizer = true;
    o->dtype = MODEL_DTYPE_AUTO;
    o->quant = MODEL_QUANT_NONE;
}

int model_dtype_parse(const char *s, enum model_dtype *out)
{
    if (strcmp(s, "auto") == 0) *out = MODEL_DTYPE_AUTO;
    else if (strcmp(s, "bfloat16") == 0 || strcmp(s, "bf16") == 0) *out = MODEL_DTYPE_BF16;
    else if (strcmp(s, "float32") == 0 || strcmp(s, "f32") == 0 || strcmp(s, "float") == 0)
        *out = MODEL_DTYPE_F32;
    else return -1;
    return 0;
}

const char *model_dtype_name(enum model_dtype d)
{
    return d == MODEL_DTYPE_BF16 ? "bfloat16" : d == MODEL_DTYPE_F32 ? "float32" : "auto";
}

int model_quant_parse(const char *s, enum model_quant *out)
{
    if (strcmp(s, "none") == 0) *out = MODEL_QUANT_NONE;
    else if (strcmp(s, "int8") == 0) *out = MODEL_QUANT_INT8;
    else if (strcmp(s, "int4") == 0) *out = MODEL_QUANT_INT4;
    else return -1;
    return 0;
}

const char *model_quant_name(enum model_quant q)
{
    return q == MODEL_QUANT_INT8 ? "int8" : q == MODEL_QUANT_INT4 ? "int4" : "none";
}

void model_free(struct model *m)
{
    if (!m) return;
    if (m->tok) tok_free(m->tok);
    free(m->chat_template);
    free(m->dir);
    st_close(m->st);
    if (m->cache_map)
        wcache_unmap(m->cache_map, m->cache_map_len);
    else
        free(m->converted);
    free(m->vectors);
    free(m->mats);
    free(m->arena);
    free(m->ablated);
    model_desc_free(&m->desc);
    free(m);
}

/* Layers, then every layer's experts and shared experts, in one block. */
static int alloc_arena(struct model *m, char *err, size_t errlen)
{
    const struct model_desc *d = &m->desc;
    size_t nl = (size_t)d->n_layer, nm = (size_t)m->n_mtp;
    size_t n_ffn = 0;
    for (int l = 0; l < d->n_layer; l++)
        if (d->layer_is_moe[l]) n_ffn += (size_t)d->n_expert + (size_t)d->n_shared;
    n_ffn += nm * ((size_t)d->n_expert + (size_t)d->n_shared); /* an MTP block may be MoE */
    m->arena = calloc(1, nl * sizeof(struct layer_w) + nm * sizeof(struct model_mtp) +
                             n_ffn * sizeof(struct ffn_w));
    if (!m->arena) return ms_errf(err, errlen, "%s: out of memory", m->dir);
    m->layers = m->arena;
    m->mtp = nm ? (struct model_mtp *)(m->layers + nl) : NULL;
    struct ffn_w *f = (struct ffn_w *)((char *)m->arena + nl * sizeof(struct layer_w) +
                                       nm * sizeof(struct model_mtp));
    for (int l = 0; l < d->n_layer + m->n_mtp; l++) {
        struct layer_w *lw = l < d->n_layer ? &m->layers[l] : &m->mtp[l - d->n_layer].layer;
        if (l < d->n_layer && !d->layer_is_moe[l]) continue;
        if (d->n_expert == 0) continue;
        lw->experts = f;
        f += d->n_expert;
        lw->shared = d->n_shared ? f : NULL;
        f += d->n_shared;
    }
    return 0;
}

static int load_config(struct model *m, char *err, size_t errlen)
{
    char *path = join(m->dir, "config.json"), *text = NULL;
    size_t len;
    int rc = -1;
    if (!path) return ms_errf(err, errlen, "%s: out of memory", m->dir);
    if (read_text(path, &text, &len) != 0) {
        ms_errf(err, errlen, "%s: cannot read: %s", path, strerror(errno));
        goto out;
    }
    if (model_desc_parse(text, len, path, &m->desc, err, errlen) != 0) goto out;
    free(path);
    free(text);
    text = NULL;
    path = join(m->dir, "generation_config.json");
    if (!path) {
        ms_errf(err, errlen, "%s: out of memory", m->dir);
        goto out;
    }
    if (read_text(path, &text, &len) == 0) {
        if (model_desc_apply_generation_config(&m->desc, text, len, path, err, errlen) != 0)
            goto out;
    } else if (errno != ENOENT) {
        ms_errf(err, errlen, "%s: cannot read: %s", path, strerror(errno));
        goto out;
    }
    rc = 0;
out:
    free(path);
    free(text);
    return rc;
}

static int load_tokenizer(struct model *m, const struct model_load_opts *opts, char *err,
                          size_t errlen)
{
    char *tj = join(m->dir, "tokenizer.json"), *tc = join(m->dir, "tokenizer_config.json");
    int rc = -1;
    if (!tj || !tc) {
        ms_errf(err, errlen, "%s: out of memory", m->dir);
        goto out;
    }
    if (access(tj, F_OK) != 0) {
        if (opts->require_tokenizer)
            ms_errf(err, errlen, "%s: missing (a model folder needs its tokenizer)", tj);
        else
            rc = 0;
        goto out;
    }
    if (tok_load(tj, tc, &m->tok, err, errlen) != 0) goto out;
    /* An id past the embedding table would read outside it in the forward pass. */
    if (tok_vocab_size(m->tok) > m->desc.vocab) {
        ms_errf(err, errlen, "%s: %d tokens but config.json vocab_size is %d", tj,
                tok_vocab_size(m->tok), m->desc.vocab);
        goto out;
    }
    rc = load_chat_template(m->dir, &m->chat_template, err, errlen);
out:
    free(tj);
    free(tc);
    return rc;
}

int model_load(const char *dir, const struct model_load_opts *opts, struct model **out, char *err,
               size_t errlen)
{
    struct model_load_opts defaults;
    if (!opts) {
        model_load_opts_default(&defaults);
        opts = &defaults;
    }
    *out = NULL;
    struct plan plan = {0};
    struct load_ctx lc = {0};
    char *wname = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m || !(m->dir = strdup(dir))) {
        ms_errf(err, errlen, "%s: out of memory", dir);
        goto fail;
    }
    if (load_config(m, err, errlen) != 0) goto fail;
    if (st_open_dir(dir, &m->st, err, errlen) != 0) goto fail;
    /* Qwen's MTP layers are counted in the folder; DeepSeek's and GLM's are as many as the
     * config says (their presence is checked by the binding) */
    if (mtp_qwen_layout(&m->desc)) m->desc.n_mtp_layers = count_qwen_mtp(m->st);
    /* MTP modules only where they are asked for */
    /* DeepSeek-V4's MTP layer (mtp.*) is never bound: its block is V4's, not run as a
     * drafter yet (serve refuses method mtp for it by name) */
    if (opts->mtp && m->desc.n_mtp_layers > 0 && !m->desc.v4_attn)
        m->n_mtp = m->desc.n_mtp_layers;
    if (alloc_arena(m, err, errlen) != 0) goto fail;
    wname = join(dir, "model.safetensors.index.json");
    if (!wname) {
        ms_errf(err, errlen, "%s: out of memory", dir);
        goto fail;
    }
    if (access(wname, F_OK) != 0) {
        free(wname);
        if (!(wname = join(dir, "model.safetensors"))) {
            ms_errf(err, errlen, "%s: out of memory", dir);
            goto fail;
        }
    }
    /* Multimodal folders keep the text model under model.language_model. (transformers) or
     * language_model.model. with the head at language_model.lm_head (Kimi-K2.5 as published). */
    const char *wp = "model.", *head = "lm_head.weight";
    if (!st_find(m->st, "model.embed_tokens.weight")) {
        if (st_find(m->st, "model.language_model.embed_tokens.weight")) {
            wp = "model.language_model.";
        } else if (st_find(m->st, "language_model.model.embed_tokens.weight")) {
            wp = "language_model.model.";
            head = "language_model.lm_head.weight";
        }
    }
    if (m->desc.v4_attn) {
        /* DeepSeek-V4 in DeepSeek's names: its head is "head.weight"; its own folders have no
         * "model." prefix (transformers 5.25 keeps one on the embedding, norm and layers) */
        head = "head.weight";
        if (!st_find(m->st, "model.embed_tokens.weight") && st_find(m->st, "embed.weight"))
            wp = "";
    }
    snprintf(m->desc.wprefix, sizeof m->desc.wprefix, "%s", wp);
    snprintf(m->desc.lm_head_name, sizeof m->desc.lm_head_name, "%s", head);
    char probe[96];
    snprintf(probe, sizeof probe, "%sblocks.0.input_layernorm.weight", wp);
    bool blocks = st_find(m->st, probe) != NULL;
    snprintf(probe, sizeof probe, "%slayers.0.input_layernorm.weight", wp);
    snprintf(m->desc.wlayers, sizeof m->desc.wlayers, "%s",
             blocks && !st_find(m->st, probe) ? "blocks." : "layers.");
    if (plan_model(&plan, m, wname, opts->quant != MODEL_QUANT_NONE, err, errlen) != 0)
        goto fail;
    note_mtp_layers(m);
    m->dtype = opts->dtype;
    m->quant = opts->quant;
    m->n_mats = plan.n_mats;
    m->mats = calloc((size_t)(plan.n_mats ? plan.n_mats : 1), sizeof *m->mats);
    lc.src = calloc((size_t)(plan.n_mats ? plan.n_mats : 1), sizeof *lc.src);
    if (!m->mats || !lc.src) {
        ms_errf(err, errlen, "%s: out of memory", wname);
        goto fail;
    }
    lc.m = m;
    lc.p = &plan;
    lc.opts = opts;
    if (bind_check(&lc, m->st, wname, err, errlen) != 0) goto fail;
    uint64_t cache_key = 0;
    char cache_path[4200];
    if (opts->cache && lc.conv_bytes) {
        char tag[128], why[MS_ERR_LEN];
        snprintf(tag, sizeof tag, "dtype=%s quant=%s%s", model_dtype_name(opts->dtype),
                 model_quant_name(opts->quant), m->n_mtp ? " mtp" : "");
        cache_key = wcache_key(dir, m->st, tag);
        wcache_path(dir, cache_key, cache_path, sizeof cache_path);
        const void *data;
        if (wcache_map(cache_path, cache_key, lc.conv_bytes, &data, &m->cache_map,
                       &m->cache_map_len, why, sizeof why) == 0) {
            m->converted = (void *)data;
            lc.from_cache = true;
            snprintf(m->cache_note, sizeof m->cache_note, "weights mapped from %.600s", cache_path);
        }
    }
    if (lc.conv_bytes && !lc.from_cache && posix_memalign(&m->converted, 64, lc.conv_bytes) != 0) {
        m->converted = NULL;
        ms_errf(err, errlen, "%s: out of memory converting weights to %s (%zu bytes)", wname,
                opts->quant != MODEL_QUANT_NONE ? model_quant_name(opts->quant)
                                                 : model_dtype_name(opts->dtype),
                lc.conv_bytes);
        goto fail;
    }
    if (lc.vec_floats && !(m->vectors = malloc(lc.vec_floats * sizeof(float)))) {
        ms_errf(err, errlen, "%s: out of memory", wname);
        goto fail;
    }
    m->converted_bytes = lc.conv_bytes;
    m->vector_floats = lc.vec_floats;
    if (bind_apply(&lc, err, errlen) != 0) goto fail;
    if (cache_key && !lc.from_cache) {
        char why[MS_ERR_LEN];
        if (wcache_write(cache_path, cache_key, m->converted, lc.conv_bytes, why, sizeof why) == 0)
            snprintf(m->cache_note, sizeof m->cache_note, "weights cached in %.600s", cache_path);
        else
            snprintf(m->cache_note, sizeof m->cache_note, "weight cache not written: %.600s", why);
    }
    if (m->desc.tie_embeddings && !m->lm_head) m->lm_head = m->embed;
    m->weight_bytes = 0;
    for (int i = 0; i < m->n_mats; i++)
        m->weight_bytes += wtype_bytes(m->mats[i].type, m->mats[i].rows, m->mats[i].cols);
    for (int i = 0; i < plan.n; i++)
        if (bind_is_vec(&plan.b[i])) m->weight_bytes += sizeof(float) * bind_numel(&plan.b[i]);
    if (load_tokenizer(m, opts, err, errlen) != 0) goto fail;
    free(plan.b);
    free(lc.src);
    free(wname);
    *out = m;
    return 0;
fail:
    free(plan.b);
    free(lc.src);
    free(wname);
    model_free(m);
    return -1;
}

int model_mtp_view(const struct model *m, int i, struct model *out)
{
    memset(out, 0, sizeof *out);
    if (i < 0 || i >= m->n_mtp) return -1;
    const struct model_mtp *mt = &m->mtp[i];
    bool *is_moe = malloc(sizeof *is_moe);
    if (!is_moe) return -1;
    *is_moe = mt->moe;
    out->desc = m->desc;
    struct model_desc *d = &out->desc;
    d->n_layer = 1;
    d->layer_is_moe = is_moe;
    d->layer_linear = NULL; /* the block is attention: no recurrent state */
    d->n_linear = 0;
    d->layer_window = NULL;
    d->layer_nope = NULL;
    d->layer_chunk = NULL;
    d->dsa_shared = NULL;
    d->n_mtp_layers = 0;
    d->cont_quant = NULL;
    d->cont_n_quant = 0;
    out->embed = m->embed;
    out->norm = mt->head_norm;
    out->lm_head = mt->head ? mt->head : m->lm_head;
    out->layers = (struct layer_w *)&mt->layer;
    out->mtp_in = mt;
    out->tok = m->tok;
    out->dir = m->dir;
    out->dtype = m->dtype;
    out->quant = m->quant;
    out->arena = is_moe; /* the view's one allocation */
    return 0;
}

void model_mtp_view_free(struct model *view)
{
    if (!view) return;
    free(view->arena);
    memset(view, 0, sizeof *view);
}

size_t model_active_params(const struct model *m, int k)
{
    const struct model_desc *d = &m->desc;
    size_t D = (size_t)d->d_model, q = (size_t)d->n_head * (size_t)d->head_dim,
           kv = (size_t)d->n_kv_head * (size_t)d->head_dim;
    if (k < 0) k = 0;
    if (k > d->n_expert) k = d->n_expert;
    size_t routed_width = 0; /* sum of the k widest experts: an upper bound for mixed widths */
    if (d->n_expert > 0 && k > 0) {
        int taken[MODEL_MAX_EXPERTS] = {0};
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < d->n_expert; e++)
                if (!taken[e] && (best < 0 || d->expert_d_ff[e] > d->expert_d_ff[best])) best = e;
            taken[best] = 1;
            routed_width += (size_t)d->expert_d_ff[best];
        }
    }
    /* The embedding is a row lookup: only lm_head and the final norm count outside layers. */
    size_t n = (size_t)d->vocab * D + D;
    for (int l = 0; l < d->n_layer; l++) {
        if (d->attn == ATTN_KIND_MLA) {
            size_t H = (size_t)d->n_head, qk = (size_t)d->head_dim, qr = (size_t)d->q_lora_rank;
            size_t kvr = (size_t)d->kv_lora_rank, dr = (size_t)d->qk_rope_dim;
            n += 2 * D + (qr ? qr * D + qr + H * qk * qr : H * qk * D) + (kvr + dr) * D + kvr +
                 H * ((size_t)d->qk_nope_dim + (size_t)d->v_head_dim) * kvr +
                 D * H * (size_t)d->v_head_dim;
            if (d->dsa_topk > 0) {
                size_t Hi = (size_t)d->dsa_heads, Di = (size_t)d->dsa_dim;
                n += Hi * Di * qr + Di * D + 2 * Di + Hi * D;
            }
        } else if (d->layer_linear && d->layer_linear[l]) {
            /* state-space layer: input projections, conv, per-head vectors, norm, out_proj */
            size_t nv = (size_t)d->lin_nv, vd = nv * (size_t)d->lin_dv;
            size_t conv = 2 * (size_t)d->lin_nk * (size_t)d->lin_dk + vd;
            bool mamba = d->lin_kind == LIN_KIND_MAMBA2;
            size_t in_rows = conv + vd + (mamba ? nv : 2 * nv);
            n += 2 * D + in_rows * D + conv * (size_t)d->lin_conv + (mamba ? 3 : 2) * nv +
                 (mamba ? vd : (size_t)d->lin_dv) + D * vd;
            if (mamba && d->lin_conv_bias) n += conv;
            if (mamba && d->lin_proj_bias) n += in_rows + D;
        } else {
            n += 2 * D + (d->attn_out_gate ? 3 : 2) * q * D + 2 * kv * D;
        }
        if (!(d->layer_linear && d->layer_linear[l])) {
            if (d->qkv_bias) n += q + 2 * kv;
            if (d->o_bias) n += D;
            if (d->attn_sinks) n += (size_t)d->n_head;
            if (d->qk_norm == QK_NORM_HEAD) n += 2 * (size_t)d->head_dim;
            if (d->qk_norm == QK_NORM_FULL) n += q + kv;
        }
        if (d->ffn == FFN_KIND_CONTINUOUS) {
            /* the router, the keys, and the default K slices as if they never overlapped */
            size_t Z = (size_t)d->cont_z;
            n += 2 * Z * D + 2 * Z + (size_t)d->cont_d_ff * Z +
                 3 * D * (size_t)model_cont_union_max(d, d->cont_samples, d->cont_fraction);
            continue;
        }
        if (!d->layer_is_moe[l]) {
            n += 3 * D * (size_t)d->dense_d_ff;
            continue;
        }
        n += (size_t)d->n_expert * D + (d->router == ROUTER_KIND_MOHGE ? (size_t)d->n_group * D : 0);
        if (d->router_bias) n += (size_t)d->n_expert;
        if (d->router_logit_bias) n += (size_t)d->n_expert;
        if (d->expert_bias) n += 2 * routed_width + (size_t)k * D;
        n += 3 * D * routed_width + 3 * D * (size_t)d->shared_d_ff * (size_t)d->n_shared;
        if (d->shared_gate == SHARED_GATE_SIGMOID) n += D;
    }
    return n;
}

void model_kv_rows(const struct model_desc *md, int *k_row, int *v_row)
{
    if (md->attn == ATTN_KIND_V4) { /* one row width for every layer: the widest kind's */
        *k_row = *v_row = 0;
        for (int l = 0; l < md->n_layer; l++) {
            int w = model_v4_row(md, md->v4_attn[l]).width;
            *k_row = w > *k_row ? w : *k_row;
        }
    } else if (md->attn == ATTN_KIND_MLA) {
        /* DSA: the index key after the latent and rope key, in the same row */
        *k_row = md->kv_lora_rank + md->qk_rope_dim + (md->dsa_topk > 0 ? md->dsa_dim : 0);
        *v_row = 0;
    } else {
        *k_row = *v_row = md->n_kv_head * md->head_dim;
    }
}

size_t model_kv_bytes_per_token(const struct model_desc *md)
{
    int k_row, v_row;
    model_kv_rows(md, &k_row, &v_row);
    return (size_t)(md->n_layer - md->n_linear) * ((size_t)k_row + (size_t)v_row) * sizeof(float);
}

bool model_computes_bf16(const struct model *m)
{
    if (m->dtype != MODEL_DTYPE_AUTO) return m->dtype == MODEL_DTYPE_BF16;
    for (int i = 0; i < m->n_mats; i++)
        if (m->mats[i].type == WTYPE_BF16) return true;
    return false;
}

static size_t mat_bytes(const struct wmat *w)
{
    return w ? wtype_bytes(w->type, w->rows, w->cols) : 0;
}

static size_t ffn_bytes(const struct ffn_w *f)
{
    return mat_bytes(f->gate) + mat_bytes(f->up) + mat_bytes(f->down) +
           4 * ((f->b_gate ? 2 * (size_t)f->d_ff : 0) + (f->b_down ? (size_t)f->down->rows : 0));
}

size_t model_active_bytes(const struct model *m, int k)
{
    const struct model_desc *d = &m->desc;
    size_t D = (size_t)d->d_model, q = (size_t)d->n_head * (size_t)d->head_dim,
           kv = (size_t)d->n_kv_head * (size_t)d->head_dim;
    if (k < 0) k = 0;
    if (k > d->n_expert) k = d->n_expert;
    /* One embedding row, the final norm, the LM head. */
    size_t n = mat_bytes(m->embed) / (size_t)(d->vocab > 0 ? d->vocab : 1) + 4 * D +
               mat_bytes(m->lm_head);
    for (int l = 0; l < d->n_layer; l++) {
        const struct layer_w *lw = &m->layers[l];
        n += 4 * 2 * D + mat_bytes(lw->wq) + mat_bytes(lw->wk) + mat_bytes(lw->wv) +
             mat_bytes(lw->wo);
        if (d->layer_linear && d->layer_linear[l]) {
            /* state-space layer: its projections, and its vectors (f32) */
            size_t nv = (size_t)d->lin_nv, vd = nv * (size_t)d->lin_dv;
            size_t conv = 2 * (size_t)d->lin_nk * (size_t)d->lin_dk + vd;
            for (int i = 0; i < 4; i++) n += mat_bytes(lw->lin_in[i]);
            n += mat_bytes(lw->lin_out) +
                 4 * (conv * (size_t)d->lin_conv + 3 * nv + vd + (lw->lin_conv_b ? conv : 0));
        }
        if (d->attn == ATTN_KIND_MLA) /* the absorbed copy is read instead of kv_b's key half */
            n += mat_bytes(lw->wq_a) + mat_bytes(lw->wq_b) + mat_bytes(lw->wkv_a) +
                 mat_bytes(lw->wkv_b) + 4 * ((size_t)d->q_lora_rank + (size_t)d->kv_lora_rank) +
                 mat_bytes(lw->idx_wq_b) + mat_bytes(lw->idx_wk) + mat_bytes(lw->idx_wproj) +
                 (lw->idx_k_norm ? 8 * (size_t)d->dsa_dim : 0);
        bool attn = !(d->layer_linear && d->layer_linear[l]);
        if (attn && d->qkv_bias) n += 4 * (q + 2 * kv);
        if (attn && d->o_bias) n += 4 * D;
        if (attn && d->attn_sinks) n += 4 * (size_t)d->n_head;
        if (attn && d->qk_norm == QK_NORM_HEAD) n += 4 * 2 * (size_t)d->head_dim;
        if (attn && d->qk_norm == QK_NORM_FULL) n += 4 * (q + kv);
        if (d->ffn == FFN_KIND_CONTINUOUS) {
            size_t rows = (size_t)model_cont_union_max(d, d->cont_samples, d->cont_fraction);
            size_t F = (size_t)(d->cont_d_ff > 0 ? d->cont_d_ff : 1);
            n += mat_bytes(lw->cont_router) + 4 * 2 * (size_t)d->cont_z + mat_bytes(lw->cont_keys) +
                 (mat_bytes(lw->cont_gate) + mat_bytes(lw->cont_up) + mat_bytes(lw->cont_down_t)) /
                     F * rows;
            continue;
        }
        if (!d->layer_is_moe[l]) {
            n += ffn_bytes(&lw->dense);
            continue;
        }
        n += mat_bytes(lw->router) + mat_bytes(lw->group_router) + mat_bytes(lw->shared_gate);
        if (lw->router_bias) n += 4 * (size_t)d->n_expert;
        if (lw->router_b) n += 4 * (size_t)d->n_expert;
        for (int s = 0; s < d->n_shared; s++) n += ffn_bytes(&lw->shared[s]);
        /* the k largest routed experts: an upper bound for mixed widths */
        int taken[MODEL_MAX_EXPERTS] = {0};
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < d->n_expert; e++)
                if (!taken[e] && (best < 0 || ffn_bytes(&lw->experts[e]) >
                                                  ffn_bytes(&lw->experts[best])))
                    best = e;
            taken[best] = 1;
            n += ffn_bytes(&lw->experts[best]);
        }
    }
    return n;
}
