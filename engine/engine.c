/* Engine: device set, step scheduling across device threads, and the forward pass. The forward
 * pass reads only struct model_desc, never the architecture name: attention (GQA + RoPE, with
 * optional q/k/v/o biases, q/k norm per head or over the projection, qkv clipping, sliding
 * windows per layer, sink logits; or MLA),
 * then a dense FFN or an MoE layer (router -> dispatch -> experts -> combine, plus shared
 * experts). Every buffer is allocated in engine_create; a step allocates nothing. */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend.h"
#include "comm.h"
#include "common.h"
#include "infmoe.h"
#include "moe.h"
#include "v4.h"
#ifdef MOESERVE_HAVE_CUDA
#include "cuda/backend_cuda.h"
#include "cuda/comm_nccl.h"
#endif

/* Logit rows computed per LM-head matmul: on a backend with its own memory (then downloaded) a
 * whole decode batch of 256 sequences; on the host 64 (a chunk of vocab-sized rows). */
#define LOGIT_ROWS 256
#define HOST_LOGIT_ROWS 64

/* Per-device state: a backend instance, the slice of the batch it owns in the current step,
 * and its scratch buffers. */
struct device {
    int rank;
    struct engine *e;
    struct backend *be;
    pthread_t thread;
    bool has_thread;
    double dsa_s; /* seconds spent in the sparse-attention indexer's selection (host clock:
                     exact on the CPU, the launch time on a GPU) */

    /* The model as this device's backend holds it: desc as the engine's model; matrices are
     * weight handles (see backend.h), vectors f32 backend memory. Only the experts this device
     * owns are present. On a host-memory backend everything points at the engine's model. */
    struct model w;
    struct layer_w *w_layers;   /* (n_layer) */
    struct ffn_w *w_ffn;        /* experts and shared experts of every layer */
    const void **owned;         /* what was uploaded: (n_owned), freed at release */
    bool *owned_is_weight;
    int n_owned, cap_owned;
    float *cos_sin;             /* the engine's RoPE table in backend memory */
    struct be_kv *kvl;          /* (n_layer) this device's KV storage: the engine's kv.layer,
                                   or its own copy of the pool layout when sticky */
    bool own_kv;

    /* slice of the current step */
    int item0, item1;  /* items [item0, item1) */
    int tok0, n_tok;   /* flat token range */

    /* activations, (T, ...) with T = max_batch_tokens */
    float *x;          /* (T, d_model) residual stream */
    float *h;          /* (T, d_model) normed */
    float *q;          /* (T, n_head*head_dim); MLA: also the heads' values (T, n_head*v_head_dim) */
    float *k;          /* (T, n_kv_head*head_dim); MLA: the q_lora rows, then the latent rows
                          (T, kv_lora_rank + qk_rope_dim) */
    float *v;          /* (T, n_kv_head*head_dim); MLA: unused */
    float *att;        /* (T, n_head*head_dim); MLA: attention over the latent
                          (T, n_head, kv_lora_rank) */
    float *qlat;       /* MLA: absorbed queries (T, n_head, kv_lora_rank + qk_rope_dim) */
    float *iq;         /* DSA: index queries (T, dsa_heads, dsa_dim) */
    float *iw;         /* DSA: index head weights (T, dsa_heads) */
    int32_t *sel;      /* DSA: each token's attended positions (T, dsa_topk) */
    int32_t *sel_n;    /* DSA: how many (T); -1 all */
    float *dsa_zero;   /* DSA: (dsa_dim) zeros */
    float *tmp;        /* (T, d_model) */
    int32_t *in;       /* (4T) this step's ids, positions, expert budgets, sequences: */
    int32_t *ids;      /* (n_tok) within `in` */
    int32_t *pos;      /* (n_tok) */
    int32_t *tok_k;    /* (n_tok) experts per token */
    int32_t *tok_seq;  /* (n_tok) the token's item, counted from item0 (its row of `blocks`) */
    int32_t *blocks;   /* (max_seqs, blocks_per_seq) block tables of the slice's items */
    int logit_rows;    /* rows per LM-head matmul */
    float *logits;     /* (logit_rows, vocab) */
    int32_t *lrows;    /* (logit_rows) rows of x that want logits */
    /* backends with their own memory only (on the host: NULL, and lrows itself): */
    float *h_logits;   /* host (logit_rows, vocab) */
    int32_t *h_lrows;  /* host (logit_rows) */
    int32_t *h_in;     /* host staging of `in` (4T) */
    int32_t *h_blocks; /* host staging of `blocks` */

    struct moe_scratch moe;
    struct infmoe_scratch cont; /* continuous-experts models only */
    struct v4_scratch v4;       /* DeepSeek-V4 models only (engine/v4.h) */
    bool has_v4;

    /* Hybrid models (NULL otherwise). Gated attention: */
    float *ones;       /* (head_dim) 1s: the weight of a weightless per-head norm (Llama 4) */
    float *tscale;     /* (T) Llama 4's attention temperature per token (NoPE layers) */
    float *h_tscale;   /* host staging of tscale */
    float *qg;         /* (T, 2 * n_head * head_dim) q_proj's output: each head's query, gate */
    float *gate;       /* (T, n_head * head_dim) the gate logits */
    int32_t *idx_q;    /* (n_head * head_dim) columns of qg holding the queries, then (as many)
                          the gates */
    /* Gated DeltaNet layers: */
    float *lin_raw;    /* fused projections (lin_fused_in): (T, 2 * (kd + vd)) and (T, 2 nv) */
    float *lin_raw_ba;
    int32_t *idx_lin;  /* their columns of q|k|v (conv_dim), z (vd), b (nv), a (nv) */
    float *lin_qkv;    /* (T, conv_dim) */
    float *lin_z;      /* (T, vd) */
    float *lin_b;      /* (T, nv) */
    float *lin_a;      /* (T, nv) */
    float *lin_out;    /* (T, vd) */
    float **st_conv;   /* (n_layer) this device's recurrent state per Gated DeltaNet layer (the
                          engine's, or its own when sticky), NULL for attention layers */
    float **st_ssm;
    bool own_state;
    int32_t *st_idx;          /* (1) backend memory: the slot a state snapshot copies */
    struct be_seqs seqs;      /* the slice's sequences, refilled each step (HOST arrays): */
    int32_t *sq_i32;          /* (3, max_seqs) tok0, n_tok, slot */
    uint8_t *sq_fresh;        /* (max_seqs) */

    /* MTP views (model.mtp_in; NULL otherwise): the fusion's weights on this device, the
     * concatenated [enorm(embedding) ; hnorm(hidden)] rows (T, 2 d_model), the column indices
     * 0..d_model-1 that place a row in either half, and (backends with their own memory) the
     * host staging of the given hidden rows (T, d_model). */
    struct model_mtp w_mtp;
    float *mtp_cat;
    int32_t *mtp_iota;
    float *h_hid;
};

struct engine {
    const struct model *m;
    struct engine_params p;
    int n_dev;
    struct device *dev;
    struct comm *comm;
    /* Devices with their own memory and N > 1: each device holds KV storage for the whole
     * block pool, and a sequence stays on the device that holds its K/V (sticky), assigned at
     * its first step: the device of its prefix-cached blocks, else the one with the fewest
     * sequences. Attention is data-parallel over sequences, experts expert-parallel. */
    bool sticky;
    int32_t *block_dev;            /* (n_blocks) device holding each block's K/V, -1 none */
    int *dev_seqs;                 /* (n_dev) sequences assigned to each device */
    int32_t *old_blocks;           /* (max_seqs) blocks each item held before this step */
    struct engine_item *sorted;    /* (max_seqs) this step's items grouped by device */
    struct kv_cache kv;
    int blocks_per_seq;   /* KV blocks of a max_model_len sequence */
    int *owner;           /* (n_expert) device of each expert's first replica, first MoE layer */
    struct plc_map map;   /* the placement in use: replicas of each expert, layer by layer */
    int n_moe;            /* MoE layers */
    int *moe_index;       /* (n_layer) MoE ordinal of each layer, -1 for dense layers */
    int *moe_layers;      /* (n_moe) model layer of each MoE layer */
    /* Routing capture (statistics, traces): each device writes its tokens' rows. */
    int32_t *route_ids;   /* (n_moe, max_batch_tokens, top_k) */
    float *route_w;       /* (n_moe, max_batch_tokens, top_k), capture_weights only */
    int32_t *route_tokens;/* (max_batch_tokens) */
    uint16_t *route_tags; /* (max_batch_tokens) */
    struct engine_routing routing;
    bool have_routing;
    struct rstats *rstats;
    float *cos_sin;       /* (max_model_len, rope_dim/2, 2) */
    float *v4_tabs[4];    /* DeepSeek-V4's RoPE tables (engine/v4.h), host */
    float attn_scale;
    int max_ff;

    /* step control: device threads wait for `generation` to change, run their slice, and the
     * last one to finish signals `idle` */
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    bool sync_init;
    uint64_t generation;
    int running;
    bool quit;
    bool profile;         /* engine_set_profile */
    struct engine_item *items;
    int n_items;
    int32_t *item_tok0;   /* (max_seqs) flat offset of each item */

    /* Multi-process (engine_params.comm): devices other than `self` are other processes.
     * proc_mu serializes steps and pings (the communicator is used by one thread at a time). */
    bool remote;
    int self;             /* the device this process runs (0 when not remote) */
    struct comm *ctl;     /* plans, logits, status words: engine_params.comm (e->comm: rows) */
    int32_t *plan;        /* (plan_cap) a step's plan as sent (rank 0) or received */
    size_t plan_cap;
    struct kv_seq *w_kv;  /* ranks > 0: (max_seqs) block tables pointing into `plan` */
    float *p_hid;         /* (max_batch_tokens, d_model) hidden states an item wants
                             (engine_item.hidden_out): computed here (ranks > 0) or received
                             (rank 0) */
    struct proc_report *report; /* a rank's answer to a step or ping (report_bytes) */
    size_t report_bytes;
    pthread_mutex_t proc_mu;
    bool proc_mu_init;
    atomic_bool failed;   /* set once, after fail_why (which never changes afterwards) */
    char fail_why[MS_ERR_LEN];

    struct engine_stats stats;

    /* Hybrid models: the recurrent state, one slot per sequence (kv.n_slots = max_seqs) for
     * each Gated DeltaNet layer, on the self device (others hold their own when sticky). */
    float **st_conv;      /* (n_layer) (n_slots, lin_conv - 1, conv_dim), NULL for attention */
    float **st_ssm;       /* (n_layer) (n_slots, lin_nv, lin_dk, lin_dv) */
    size_t state_seq_bytes; /* one sequence's state over all layers */
};

static const struct {
    const char *name;
    int type;
} kv_type_names[] = {
    {"auto", ENGINE_KV_AUTO},       {"bfloat16", BE_KV_BF16},       {"float16", BE_KV_F16},
    {"fp8_e4m3", BE_KV_FP8_E4M3},   {"fp8_e5m2", BE_KV_FP8_E5M2},   {"int8", BE_KV_INT8},
    {"float32", BE_KV_F32},         {"bf16", BE_KV_BF16},           {"f16", BE_KV_F16},
    {"half", BE_KV_F16},            {"fp8", BE_KV_FP8_E4M3},        {"f32", BE_KV_F32},
    {"float", BE_KV_F32},
};

int engine_kv_type_parse(const char *name, int *out)
{
    for (size_t i = 0; i < sizeof kv_type_names / sizeof kv_type_names[0]; i++)
        if (strcmp(name, kv_type_names[i].name) == 0) {
            *out = kv_type_names[i].type;
            return 0;
        }
    return -1;
}

const char *engine_kv_type_name(int kv_type)
{
    for (size_t i = 0; i < sizeof kv_type_names / sizeof kv_type_names[0]; i++)
        if (kv_type_names[i].type == kv_type) return kv_type_names[i].name; /* the first: canonical */
    return "?";
}

int engine_kv_geom(const struct model *m, int kv_type, struct kv_geom *out)
{
    const struct model_desc *md = &m->desc;
    if (kv_type == ENGINE_KV_AUTO) kv_type = model_computes_bf16(m) ? BE_KV_BF16 : BE_KV_F32;
    if (kv_type < 0 || kv_type >= BE_KV_N_TYPES) return -1;
    memset(out, 0, sizeof *out);
    out->type = (enum be_kv_type)kv_type;
    model_kv_rows(md, &out->k_row, &out->v_row);
    /* int8 scales: one per KV head's key and value; MLA's one row (latent + rope key), and
     * DeepSeek-V4's (key, compressor projections and entries) */
    bool one_row = md->attn == ATTN_KIND_MLA || md->attn == ATTN_KIND_V4;
    out->k_grp = one_row ? out->k_row : md->head_dim;
    out->v_grp = one_row ? 0 : md->head_dim;
    return 0;
}

int engine_kv_window(const struct engine *e)
{
    const struct model_desc *md = &e->m->desc;
    int w = 0;
    for (int l = 0; l < md->n_layer; l++) {
        if (md->layer_linear && md->layer_linear[l]) continue; /* no K/V */
        int lw = model_layer_window(md, l);
        if (lw <= 0) return 0; /* a layer that attends to everything */
        w = lw > w ? lw : w;
    }
    return w;
}

size_t engine_kv_bytes_per_token(const struct engine *e)
{
    return (size_t)e->kv.n_kv_layers * kv_geom_token_bytes(&e->kv.geom);
}

int engine_backend_parse(const char *name, enum engine_backend *out)
{
    if (strcmp(name, "cpu") == 0) {
        *out = ENGINE_BACKEND_CPU;
        return 0;
    }
    if (strcmp(name, "cuda") == 0) {
        *out = ENGINE_BACKEND_CUDA;
        return 0;
    }
    return -1;
}

const char *engine_backend_name(enum engine_backend b)
{
    return b == ENGINE_BACKEND_CUDA ? "cuda" : b == ENGINE_BACKEND_CPU_STAGED ? "cpu-staged" : "cpu";
}

bool engine_has_cuda(void)
{
#ifdef MOESERVE_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

int engine_dispatch_parse(const char *name, enum engine_dispatch *out)
{
    if (strcmp(name, "tokens") == 0) {
        *out = ENGINE_DISPATCH_TOKENS;
        return 0;
    }
    if (strcmp(name, "rows") == 0) {
        *out = ENGINE_DISPATCH_ROWS;
        return 0;
    }
    return -1;
}

const char *engine_dispatch_name(enum engine_dispatch d)
{
    return d == ENGINE_DISPATCH_ROWS ? "rows" : "tokens";
}

void engine_params_default(struct engine_params *p)
{
    memset(p, 0, sizeof *p);
    p->backend = ENGINE_BACKEND_CPU;
    p->n_devices = 1;
    p->max_batch_tokens = 512;
    p->max_seqs = 16;
    p->max_model_len = 0;
    p->kv_block_size = 16;
    p->kv_cache_bytes = 0;
    p->kv_type = ENGINE_KV_AUTO;
    p->placement = NULL;
}

/* --- forward pieces ------------------------------------------------------------------------ */

/* x += tmp, the block's output (n, d), times Granite's residual multiplier where there is one. */
static void residual_add(struct device *dv, int n, int d)
{
    const struct model_desc *md = &dv->e->m->desc;
    struct backend *be = dv->be;
    if (md->residual_scale != 1.0f) be->ops->scale(be, dv->tmp, n, d, md->residual_scale);
    be->ops->add(be, dv->x, dv->tmp, n, d);
}

/* The attention op of layer l, timed into stats.attn_s while profiling (device 0). */
static void run_attention(struct device *dv, float *out, const float *q, int l,
                          const struct be_tokens *tk, int n, const struct be_attn *a)
{
    struct engine *e = dv->e;
    struct backend *be = dv->be;
    bool timed = e->profile && dv->rank == 0;
    double t0 = 0;
    if (timed) {
        be->ops->synchronize(be);
        t0 = ms_now();
    }
    be->ops->attention(be, out, q, &dv->kvl[l], tk, e->kv.block_size, n, a);
    if (timed) {
        be->ops->synchronize(be);
        e->stats.attn_s += ms_now() - t0;
    }
}

static void attention_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &dv->w.layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model, hd = md->head_dim;
    int qdim = md->n_head * hd, kvdim = md->n_kv_head * hd;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->attn_norm, n, d, md->rms_eps);
    /* A gated q_proj writes each head's query and gate side by side: split them. */
    float *const qkv[3] = {md->attn_out_gate ? dv->qg : dv->q, dv->k, dv->v};
    const struct wmat *const wqkv[3] = {lw->wq, lw->wk, lw->wv};
    const float *const bqkv[3] = {lw->bq, lw->bk, lw->bv};
    be->ops->matmul_multi(be, 3, qkv, dv->h, wqkv, bqkv, n, d);
    if (md->attn_out_gate) {
        be->ops->gather_cols(be, dv->q, qdim, dv->qg, 2 * qdim, dv->idx_q, n, qdim);
        be->ops->gather_cols(be, dv->gate, qdim, dv->qg, 2 * qdim, dv->idx_q + qdim, n, qdim);
    }
    if (md->qk_norm == QK_NORM_HEAD) {
        be->ops->rmsnorm(be, dv->q, dv->q, lw->q_norm, n * md->n_head, hd, md->rms_eps);
        be->ops->rmsnorm(be, dv->k, dv->k, lw->k_norm, n * md->n_kv_head, hd, md->rms_eps);
    } else if (md->qk_norm == QK_NORM_FULL) {
        be->ops->rmsnorm(be, dv->q, dv->q, lw->q_norm, n, qdim, md->rms_eps);
        be->ops->rmsnorm(be, dv->k, dv->k, lw->k_norm, n, kvdim, md->rms_eps);
    }
    if (md->clip_qkv > 0) {
        be->ops->clamp(be, dv->q, n, qdim, md->clip_qkv);
        be->ops->clamp(be, dv->k, n, kvdim, md->clip_qkv);
        be->ops->clamp(be, dv->v, n, kvdim, md->clip_qkv);
    }
    /* Rotate-half RoPE on the first rope_dim dims of each head (all of them but for partial
     * rotary, GLM's partial_rotary_factor); the rest pass through untouched. */
    bool nope = model_layer_nope(md, l);
    if (!nope) {
        be->ops->rope_ex(be, dv->q, hd, dv->q, hd, dv->pos, n, md->n_head, md->rope_dim,
                         md->rope_interleave, dv->cos_sin);
        be->ops->rope_ex(be, dv->k, hd, dv->k, hd, dv->pos, n, md->n_kv_head, md->rope_dim,
                         md->rope_interleave, dv->cos_sin);
        if (md->qk_norm == QK_NORM_HEAD_POST) { /* Llama 4: weightless, after RoPE */
            be->ops->rmsnorm(be, dv->q, dv->q, dv->ones, n * md->n_head, hd, md->rms_eps);
            be->ops->rmsnorm(be, dv->k, dv->k, dv->ones, n * md->n_kv_head, hd, md->rms_eps);
        }
    } else if (md->attn_temp_tuning) {
        be->ops->mul_rows(be, dv->q, dv->tscale, n, qdim); /* Llama 4's NoPE layers */
    }

    /* Every sequence of the slice in one call: each token names its sequence's block table. */
    struct be_tokens tk = {.tables = dv->blocks, .table_stride = e->blocks_per_seq,
                           .seq = dv->tok_seq, .pos = dv->pos};
    be->ops->kv_write(be, &dv->kvl[l], dv->k, dv->v, &tk, e->kv.block_size, n, kvdim);
    /* gpt-oss: a sink logit per head, this layer's own window; Llama 4: its chunks */
    struct be_attn a = {.n_head = md->n_head, .n_kv_head = md->n_kv_head, .k_dim = hd,
                        .v_dim = hd, .k_row = kvdim, .v_row = kvdim,
                        .window = model_layer_window(md, l), .scale = e->attn_scale,
                        .sinks = lw->sinks, .chunk = md->layer_chunk ? md->layer_chunk[l] : 0};
    run_attention(dv, dv->att, dv->q, l, &tk, n, &a);
    if (md->attn_out_gate) be->ops->mul_sigmoid(be, dv->att, dv->gate, n, qdim);
    be->ops->matmul(be, dv->tmp, dv->att, lw->wo, lw->bo, n, qdim, d);
    residual_add(dv, n, d);
}

/* The latent RMSNorms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever rms_norm_eps says:
 * DeepSeek's reference and every transformers MLA class build them with the default eps (GLM-5
 * configs say 1e-5 for the others). */
#define MLA_LATENT_EPS 1e-6f

/* Multi-head latent attention (DeepSeek), absorbed: per token the cache holds the RMS-normed
 * latent c (kvr) and the rotated rope key (dr). Head h's score against position t is
 * q_nope . (W_UK_h c_t) + q_rope . k_rope_t = (W_UK_h^T q_nope) . c_t + q_rope . k_rope_t, so the
 * query is carried into latent space once (qlat = [W_UK_h^T q_nope, rope(q_rope)], kvr + dr
 * wide) and attention runs over the cached rows themselves as one KV head shared by all heads,
 * with the latent as value; each head's output latent then goes through its value
 * up-projection W_UV_h and o_proj. Keys and values of past positions are never expanded. */
static void mla_attention_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &dv->w.layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model, H = md->n_head, qk = md->head_dim;
    int dn = md->qk_nope_dim, dr = md->qk_rope_dim, dvh = md->v_head_dim;
    int kvr = md->kv_lora_rank, lat = kvr + dr, qr = md->q_lora_rank;
    bool dsa = md->dsa_topk > 0, shared = dsa && md->dsa_shared && md->dsa_shared[l];
    bool indexer = dsa && !shared; /* shared (GLM-5): the last full layer's selection */
    int Hi = md->dsa_heads, Di = md->dsa_dim, row = lat + (dsa ? Di : 0);
    int irot = md->dsa_rope_interleave;
    float *ckv = dv->k, *vout = dv->q;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->attn_norm, n, d, md->rms_eps);
    if (lw->wq_a) {
        be->ops->matmul(be, dv->k, dv->h, lw->wq_a, NULL, n, d, qr);
        be->ops->rmsnorm(be, dv->k, dv->k, lw->q_a_norm, n, qr, MLA_LATENT_EPS);
        be->ops->matmul(be, dv->q, dv->k, lw->wq_b, NULL, n, qr, H * qk);
        if (indexer) { /* the indexer's queries from the same query latent */
            be->ops->matmul(be, dv->iq, dv->k, lw->idx_wq_b, NULL, n, qr, Hi * Di);
            be->ops->rope_ex(be, dv->iq, Di, dv->iq, Di, dv->pos, n, Hi, dr, irot, dv->cos_sin);
        }
    } else {
        be->ops->matmul(be, dv->q, dv->h, lw->wq, NULL, n, d, H * qk);
    }
    /* The cache row: normed latent, then the rope key rotated in place (DSA: then the index
     * key, layer-normed and rotated on its first qk_rope_dim; zero on a shared layer, which
     * has none, so that an int8 row's scale sees only what the layer has). */
    be->ops->matmul_ld(be, ckv, row, dv->h, d, lw->wkv_a, n, d, lat);
    be->ops->rmsnorm_ld(be, ckv, ckv, lw->kv_a_norm, n, kvr, row, MLA_LATENT_EPS);
    be->ops->rope_ex(be, ckv + kvr, row, ckv + kvr, row, dv->pos, n, 1, dr, md->rope_interleave,
                     dv->cos_sin);
    if (indexer) {
        be->ops->matmul_ld(be, ckv + lat, row, dv->h, d, lw->idx_wk, n, d, Di);
        be->ops->layernorm_ld(be, ckv + lat, row, ckv + lat, row, lw->idx_k_norm,
                              lw->idx_k_norm_b, n, Di, 1e-6f);
        be->ops->rope_ex(be, ckv + lat, row, ckv + lat, row, dv->pos, n, 1, dr, irot,
                         dv->cos_sin);
        be->ops->matmul(be, dv->iw, dv->h, lw->idx_wproj, NULL, n, d, Hi);
    } else if (shared) { /* zero weight and bias: exactly 0 */
        be->ops->layernorm_ld(be, ckv + lat, row, ckv + lat, row, dv->dsa_zero, dv->dsa_zero, n,
                              Di, 1.0f);
    }
    struct be_tokens tk = {.tables = dv->blocks, .table_stride = e->blocks_per_seq,
                           .seq = dv->tok_seq, .pos = dv->pos};
    be->ops->kv_write(be, &dv->kvl[l], ckv, NULL, &tk, e->kv.block_size, n, row);
    if (indexer) {
        struct be_dsa p = {.n_head = Hi, .dim = Di, .k_off = lat, .k_row = row,
                           .topk = md->dsa_topk, .scale = 1.0f / sqrtf((float)Di)};
        double t0 = ms_now();
        be->ops->dsa_select(be, dv->sel, dv->sel_n, dv->iq, dv->iw, &dv->kvl[l], &tk,
                            e->kv.block_size, n, &p);
        dv->dsa_s += ms_now() - t0;
    }

    /* Absorbed queries. */
    be->ops->rope_ex(be, dv->qlat + kvr, lat, dv->q + dn, qk, dv->pos, n, H, dr,
                     md->rope_interleave, dv->cos_sin);
    for (int h = 0; h < H; h++) {
        struct wmat uk = wmat_rows(lw->w_uk_t, h * kvr, kvr); /* (kvr, dn) */
        be->ops->matmul_ld(be, dv->qlat + (size_t)h * lat, H * lat, dv->q + (size_t)h * qk, H * qk,
                           &uk, n, dn, kvr);
    }
    struct be_attn a = {.n_head = H, .n_kv_head = 1, .k_dim = lat, .v_dim = kvr, .k_row = row,
                        .v_row = row, .window = md->sliding_window, .scale = e->attn_scale,
                        .sel = dsa ? dv->sel : NULL, .sel_n = dsa ? dv->sel_n : NULL,
                        .sel_stride = md->dsa_topk};
    run_attention(dv, dv->att, dv->qlat, l, &tk, n, &a);
    for (int h = 0; h < H; h++) {
        struct wmat uv = wmat_rows(lw->wkv_b, h * (dn + dvh) + dn, dvh); /* (dvh, kvr) */
        be->ops->matmul_ld(be, vout + (size_t)h * dvh, H * dvh, dv->att + (size_t)h * kvr, H * kvr,
                           &uv, n, kvr, dvh);
    }
    be->ops->matmul(be, dv->tmp, vout, lw->wo, NULL, n, H * dvh, d);
    residual_add(dv, n, d);
}

/* Gated DeltaNet (qwen3_next, qwen3_5_moe; backend.h gdn): the input projections (fused per
 * key head, then split into q|k|v, z, b and a; or apart), the recurrent mixing over each
 * sequence's state slot, and out_proj. */
static void gdn_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &dv->w.layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model, nv = md->lin_nv;
    int kd = md->lin_nk * md->lin_dk, vd = nv * md->lin_dv, conv = 2 * kd + vd;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->attn_norm, n, d, md->rms_eps);
    if (md->lin_fused_in) {
        float *const y[2] = {dv->lin_raw, dv->lin_raw_ba};
        const float *const nob[2] = {NULL, NULL};
        be->ops->matmul_multi(be, 2, y, dv->h, lw->lin_in, nob, n, d);
        int raw = 2 * (kd + vd);
        be->ops->gather_cols(be, dv->lin_qkv, conv, dv->lin_raw, raw, dv->idx_lin, n, conv);
        be->ops->gather_cols(be, dv->lin_z, vd, dv->lin_raw, raw, dv->idx_lin + conv, n, vd);
        be->ops->gather_cols(be, dv->lin_b, nv, dv->lin_raw_ba, 2 * nv, dv->idx_lin + conv + vd,
                             n, nv);
        be->ops->gather_cols(be, dv->lin_a, nv, dv->lin_raw_ba, 2 * nv,
                             dv->idx_lin + conv + vd + nv, n, nv);
    } else {
        float *const y[4] = {dv->lin_qkv, dv->lin_z, dv->lin_b, dv->lin_a};
        const float *const nob[4] = {NULL, NULL, NULL, NULL};
        be->ops->matmul_multi(be, 4, y, dv->h, lw->lin_in, nob, n, d);
    }
    struct be_gdn g = {.n_k_head = md->lin_nk, .n_v_head = nv, .k_dim = md->lin_dk,
                       .v_dim = md->lin_dv, .conv_k = md->lin_conv, .conv_w = lw->lin_conv_w,
                       .a_log = lw->lin_a_log, .dt_bias = lw->lin_dt_bias,
                       .norm_w = lw->lin_norm, .eps = md->rms_eps,
                       .conv_state = dv->st_conv[l], .ssm_state = dv->st_ssm[l]};
    be->ops->gdn(be, dv->lin_out, dv->lin_qkv, dv->lin_z, dv->lin_b, dv->lin_a, &g, &dv->seqs);
    be->ops->matmul(be, dv->tmp, dv->lin_out, lw->lin_out, NULL, n, vd, d);
    residual_add(dv, n, d);
}

/* Mamba2 (granitemoehybrid; backend.h mamba2): in_proj split into the gate z, the conv channels
 * x|B|C and the step logits dt, the scan over each sequence's state slot, and out_proj. */
static void mamba_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &dv->w.layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model, H = md->lin_nv, I = H * md->lin_dv;
    int conv = I + 2 * md->lin_nk * md->lin_dk, rows = I + conv + H;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->attn_norm, n, d, md->rms_eps);
    be->ops->matmul(be, dv->lin_raw, dv->h, lw->lin_in[0], lw->lin_in_b, n, d, rows);
    be->ops->gather_cols(be, dv->lin_qkv, conv, dv->lin_raw, rows, dv->idx_lin, n, conv);
    be->ops->gather_cols(be, dv->lin_z, I, dv->lin_raw, rows, dv->idx_lin + conv, n, I);
    be->ops->gather_cols(be, dv->lin_b, H, dv->lin_raw, rows, dv->idx_lin + conv + I, n, H);
    struct be_mamba mb = {.n_head = H, .head_dim = md->lin_dv, .n_group = md->lin_nk,
                          .d_state = md->lin_dk, .conv_k = md->lin_conv,
                          .conv_w = lw->lin_conv_w, .conv_b = lw->lin_conv_b,
                          .a_log = lw->lin_a_log, .dt_bias = lw->lin_dt_bias, .d_skip = lw->lin_d,
                          .norm_w = lw->lin_norm, .eps = md->rms_eps, .dt_min = md->lin_dt_min,
                          .dt_max = md->lin_dt_max, .conv_state = dv->st_conv[l],
                          .ssm_state = dv->st_ssm[l]};
    be->ops->mamba2(be, dv->lin_out, dv->lin_qkv, dv->lin_z, dv->lin_b, &mb, &dv->seqs);
    be->ops->matmul(be, dv->tmp, dv->lin_out, lw->lin_out, lw->lin_out_b, n, I, d);
    residual_add(dv, n, d);
}

/* Layer l's FFN of `in` (normed by its post-attention norm) into dv->tmp. */
static void ffn_block(struct device *dv, int l, const float *in)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &dv->w.layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model;

    be->ops->rmsnorm(be, dv->h, in, lw->ffn_norm, n, d, md->rms_eps);
    if (md->layer_is_moe[l]) {
        int mi = e->moe_index[l], K = md->top_k;
        size_t cap = ((size_t)mi * e->p.max_batch_tokens + dv->tok0) * K;
        struct moe_ctx ctx = {
            .m = &dv->w,
            .layer = l,
            .be = be,
            .comm = e->comm,
            .rank = dv->rank,
            .map = &e->map,
            .moe_layer = mi,
            .tok0 = dv->tok0,
            .stats = &e->stats,
            .route_ids = e->route_ids ? e->route_ids + cap : NULL,
            .route_w = e->route_w ? e->route_w + cap : NULL,
            .ids = dv->ids,
            .dedup = e->p.dispatch == ENGINE_DISPATCH_TOKENS,
        };
        bool timed = e->profile && dv->rank == 0;
        double t0 = 0;
        if (timed) {
            be->ops->synchronize(be);
            t0 = ms_now();
        }
        moe_forward(&ctx, &dv->moe, dv->h, dv->tok_k, n, dv->tmp);
        if (timed) {
            be->ops->synchronize(be);
            e->stats.moe_s += ms_now() - t0;
        }
    } else if (md->ffn == FFN_KIND_CONTINUOUS) {
        e->stats.dev_cont_neurons[dv->rank] +=
            infmoe_forward(&dv->w, l, be, &dv->cont, dv->h, n, dv->tmp);
    } else {
        moe_ffn_rows(be, &lw->dense, d, dv->h, n, dv->tmp, dv->moe.gate, dv->moe.up);
    }
}

static void ffn_layer(struct device *dv, int l)
{
    ffn_block(dv, l, dv->x);
    residual_add(dv, dv->n_tok, dv->e->m->desc.d_model);
}

/* DeepSeek-V4's layers (engine/v4.h): the residual is v4_hc streams; each block reads their
 * collapse (into x) and its output is mixed back in. x ends as the final collapse, which
 * hidden_out and logits_out norm as the model's last hidden state. */
static void v4_layers(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    struct backend *be = dv->be;
    struct be_tokens tk = {.tables = dv->blocks, .table_stride = e->blocks_per_seq,
                           .seq = dv->tok_seq, .pos = dv->pos};
    struct v4_step st = {.be = be, .w = &dv->w, .s = &dv->v4, .n = dv->n_tok, .pos = dv->pos,
                         .tk = &tk, .kvl = dv->kvl, .block_size = e->kv.block_size,
                         .q = dv->q, .att = dv->att, .iq = dv->iq, .iw = dv->iw, .sel = dv->sel,
                         .sel_n = dv->sel_n};
    bool timed = e->profile && dv->rank == 0;
    v4_streams_begin(&st, dv->x);
    for (int l = 0; l < md->n_layer; l++) {
        v4_streams_collapse(&st, l, 0, dv->x);
        be->ops->rmsnorm(be, dv->h, dv->x, dv->w.layers[l].attn_norm, dv->n_tok, md->d_model,
                         md->rms_eps);
        double t0 = 0;
        if (timed) {
            be->ops->synchronize(be);
            t0 = ms_now();
        }
        v4_attention_block(&st, l, dv->h, dv->tmp);
        if (timed) {
            be->ops->synchronize(be);
            e->stats.attn_s += ms_now() - t0;
        }
        v4_streams_end(&st, dv->tmp);
        v4_streams_collapse(&st, l, 1, dv->x);
        ffn_block(dv, l, dv->x);
        v4_streams_end(&st, dv->tmp);
    }
    v4_streams_head(&st, dv->x);
}

/* The next chunk of up to max_rows logit rows of the items before `end`, from (item *it, its
 * logit row *j) on: each row's index among the device's tokens (first token tok0) goes to
 * rows_out (NULL: only counted). Returns the count; (*it, *j) is left where it started. */
static int logit_chunk(const struct engine *e, int it, int j, int end, int tok0, int max_rows,
                       int32_t *rows_out)
{
    int rows = 0;
    for (int i = it, k = j; i < end && rows < max_rows;) {
        const struct engine_item *item = &e->items[i];
        if (k >= item->n_logits) {
            i++;
            k = 0;
            continue;
        }
        if (rows_out) rows_out[rows] = e->item_tok0[i] - tok0 + item->n_tokens - item->n_logits + k;
        rows++;
        k++;
    }
    return rows;
}

/* Copies `rows` logit rows (host memory; NULL: none, only skip them) to the items from (*it,
 * *j) on, advancing them. */
static void logit_hand_out(const struct engine *e, int *it, int *j, int rows, const float *host)
{
    int V = e->m->desc.vocab;
    for (int r = 0; r < rows;) {
        const struct engine_item *item = &e->items[*it];
        if (*j >= item->n_logits) {
            (*it)++;
            *j = 0;
            continue;
        }
        if (host)
            memcpy(item->logits + (size_t)*j * V, host + (size_t)r * V, sizeof(float) * (size_t)V);
        (*j)++;
        r++;
    }
}

/* The rows that want logits are gathered logit_rows at a time (one LM-head matmul for all
 * sequences of the step), downloaded once per chunk on backends with their own memory, and
 * handed out to the items; on a rank of a multi-process engine other than 0, sent to rank 0
 * instead (which receives them chunk by chunk in the same order: engine_step). */
static void logits_out(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model *m = &dv->w;
    const struct model_desc *md = &m->desc;
    struct backend *be = dv->be;
    int d = md->d_model, V = md->vocab;
    const float *host = be->ops->host_memory ? dv->logits : dv->h_logits;
    int it = dv->item0, j = 0; /* next (item, logit row) to hand out */
    for (;;) {
        int rows = logit_chunk(e, it, j, dv->item1, dv->tok0, dv->logit_rows, dv->h_lrows);
        if (rows == 0) return;
        if (!be->ops->host_memory)
            be->ops->upload(be, dv->lrows, dv->h_lrows, sizeof(int32_t) * (size_t)rows);
        be->ops->gather_rows(be, dv->h, dv->x, dv->lrows, rows, d);
        be->ops->rmsnorm(be, dv->h, dv->h, m->norm, rows, d, md->rms_eps);
        be->ops->matmul(be, dv->logits, dv->h, m->lm_head, NULL, rows, d, V);
        if (md->logit_scale != 1.0f) be->ops->scale(be, dv->logits, rows, V, md->logit_scale);
        if (!be->ops->host_memory)
            be->ops->download(be, dv->h_logits, dv->logits, sizeof(float) * (size_t)rows * V);
        const float *out = host;
        if (e->remote && e->self != 0) {
            if (e->ctl->ops->send(e->ctl, 0, host, sizeof(float) * (size_t)rows * V) != 0)
                return; /* the communicator is broken: engine_worker_run reports it */
            out = NULL; /* sent: only step past the rows */
        }
        logit_hand_out(e, &it, &j, rows, out);
    }
}

/* MTP views: x = eh_proj [enorm(x) ; hnorm(hidden)], each token's embedding fused with the
 * target's hidden state its item gives (engine_item.hidden_in). */
static void mtp_fuse(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct model_mtp *mt = dv->w.mtp_in;
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model;
    size_t row = sizeof(float) * (size_t)d;
    float *stage = be->ops->host_memory ? dv->tmp : dv->h_hid;
    for (int it = dv->item0, t = 0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        memcpy(stage + (size_t)t * d, item->hidden_in, row * (size_t)item->n_tokens);
        t += item->n_tokens;
    }
    if (!be->ops->host_memory) be->ops->upload(be, dv->tmp, dv->h_hid, row * (size_t)n);
    be->ops->gather_cols(be, dv->mtp_cat, 2 * d, dv->x, d, dv->mtp_iota, n, d);
    be->ops->gather_cols(be, dv->mtp_cat + d, 2 * d, dv->tmp, d, dv->mtp_iota, n, d);
    be->ops->rmsnorm_ld(be, dv->mtp_cat, dv->mtp_cat, mt->enorm, n, d, 2 * d, md->rms_eps);
    be->ops->rmsnorm_ld(be, dv->mtp_cat + d, dv->mtp_cat + d, mt->hnorm, n, d, 2 * d,
                        md->rms_eps);
    be->ops->matmul(be, dv->x, dv->mtp_cat, mt->eh_proj, NULL, n, 2 * d, d);
}

/* The residual stream after the last layer, or its final norm, to the items that want it
 * (hidden_out). */
static void hidden_out(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    struct backend *be = dv->be;
    size_t d = (size_t)md->d_model;
    for (int it = dv->item0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        if (!item->hidden_out) continue;
        size_t off = (size_t)(e->item_tok0[it] - dv->tok0) * d;
        const float *src = dv->x + off;
        size_t bytes = sizeof(float) * d * (size_t)item->n_tokens;
        if (item->hidden_normed && be->ops->host_memory) {
            be->ops->rmsnorm(be, item->hidden_out, src, dv->w.norm, item->n_tokens, (int)d,
                             md->rms_eps);
            continue;
        }
        if (item->hidden_normed) { /* dv->h is free until logits_out gathers into it */
            be->ops->rmsnorm(be, dv->h + off, src, dv->w.norm, item->n_tokens, (int)d,
                             md->rms_eps);
            src = dv->h + off;
        }
        if (be->ops->host_memory)
            memcpy(item->hidden_out, src, bytes);
        else
            be->ops->download(be, item->hidden_out, src, bytes);
    }
}

/* Whether an item of device dv's wants its hidden states. */
static bool dev_wants_hidden(const struct engine *e, const struct device *dv)
{
    for (int it = dv->item0; it < dv->item1; it++)
        if (e->items[it].hidden_out) return true;
    return false;
}

/* A rank other than 0 of a multi-process engine: the hidden states its items want, to rank 0
 * after its logits (all of this device's tokens' rows in one message, the rows of items that
 * did not ask left as they were: rank 0 copies out what it asked for; proc_step). */
static void hidden_send(struct device *dv)
{
    struct engine *e = dv->e;
    if (!dev_wants_hidden(e, dv)) return;
    size_t d = (size_t)e->m->desc.d_model;
    (void)e->ctl->ops->send(e->ctl, 0, e->p_hid + (size_t)dv->tok0 * d,
                            sizeof(float) * (size_t)dv->n_tok * d);
    /* a broken communicator: engine_worker_run reports it */
}

static void device_forward(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    int n = dv->n_tok;

    /* Flatten this device's items into ids/positions/expert budgets and block tables, staged on
     * the host and uploaded together. */
    int32_t *ids = dv->h_in, *pos = ids + n, *tok_k = pos + n, *tok_seq = tok_k + n;
    int t = 0;
    bool cont = md->ffn == FFN_KIND_CONTINUOUS;
    for (int it = dv->item0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        int k = item->moe_top_k > 0 && item->moe_top_k < md->top_k ? item->moe_top_k : md->top_k;
        int ks = 0, keep = 0;
        if (cont) {
            /* The sequence's budget, else the engine's default, else the model's; clamped to
             * the model's bounds (callers check them and name the field). */
            ks = item->moe_samples > 0 ? item->moe_samples
                 : e->p.moe_samples > 0 ? e->p.moe_samples : md->cont_samples;
            ks = ks > md->cont_max_samples ? md->cont_max_samples : ks;
            double f = item->moe_neuron_fraction > 0 ? item->moe_neuron_fraction
                       : e->p.moe_neuron_fraction > 0 ? e->p.moe_neuron_fraction
                                                      : md->cont_fraction;
            keep = model_cont_neurons(md, f < md->cont_fraction ? f : md->cont_fraction);
        }
        for (int i = 0; i < item->n_tokens; i++, t++) {
            if (cont) {
                dv->cont.tok_samples[t] = ks;
                dv->cont.tok_keep[t] = keep;
                dv->cont.tok_adaptive[t] = item->moe_samples_adaptive;
            }
            ids[t] = item->tokens[i];
            pos[t] = item->pos + i;
            tok_k[t] = k;
            tok_seq[t] = it - dv->item0;
        }
        int nb = (item->pos + item->n_tokens + e->kv.block_size - 1) / e->kv.block_size;
        memcpy(dv->h_blocks + (size_t)(it - dv->item0) * e->blocks_per_seq, item->kv->blocks,
               sizeof(int32_t) * (size_t)nb);
        if (md->n_linear > 0) {
            int s = it - dv->item0, ms = e->p.max_seqs;
            dv->sq_i32[s] = t - item->n_tokens;
            dv->sq_i32[ms + s] = item->n_tokens;
            dv->sq_i32[2 * ms + s] = item->kv->slot;
            dv->sq_fresh[s] = item->pos == 0;
        }
    }
    dv->seqs.n = dv->item1 - dv->item0;
    if (md->attn_temp_tuning) {
        /* transformers: log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1, in f32 */
        for (int i = 0; i < n; i++)
            dv->h_tscale[i] = log1pf(floorf(((float)pos[i] + 1.0f) / (float)md->temp_floor)) *
                                  md->temp_scale +
                              1.0f;
        dv->be->ops->upload(dv->be, dv->tscale, dv->h_tscale, sizeof(float) * (size_t)n);
    }
    struct backend *be = dv->be;
    be->ops->upload(be, dv->in, ids, sizeof(int32_t) * 4 * (size_t)n);
    dv->ids = dv->in;
    dv->pos = dv->in + n;
    dv->tok_k = dv->in + 2 * (size_t)n;
    dv->tok_seq = dv->in + 3 * (size_t)n;
    be->ops->upload(be, dv->blocks, dv->h_blocks,
                    sizeof(int32_t) * (size_t)(dv->item1 - dv->item0) * e->blocks_per_seq);
    be->ops->embed(be, dv->x, dv->w.embed, dv->ids, n, md->d_model);
    if (md->embed_scale != 1.0f) be->ops->scale(be, dv->x, n, md->d_model, md->embed_scale);
    if (dv->w.mtp_in) mtp_fuse(dv);
    if (dv->has_v4) v4_layers(dv);
    for (int l = 0; l < md->n_layer && !dv->has_v4; l++) {
        if (md->layer_linear && md->layer_linear[l] && md->lin_kind == LIN_KIND_MAMBA2)
            mamba_layer(dv, l);
        else if (md->layer_linear && md->layer_linear[l])
            gdn_layer(dv, l);
        else if (md->attn == ATTN_KIND_MLA)
            mla_attention_layer(dv, l);
        else
            attention_layer(dv, l);
        ffn_layer(dv, l);
    }
    hidden_out(dv);
    logits_out(dv);
    if (e->remote && e->self != 0) hidden_send(dv);
}

static void *device_main(void *arg)
{
    struct device *dv = arg;
    struct engine *e = dv->e;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        while (!e->quit && e->generation == seen) pthread_cond_wait(&e->wake, &e->lock);
        bool quit = e->quit;
        seen = e->generation;
        pthread_mutex_unlock(&e->lock);
        if (quit) break;
        device_forward(dv);
        pthread_mutex_lock(&e->lock);
        if (--e->running == 0) pthread_cond_signal(&e->idle);
        pthread_mutex_unlock(&e->lock);
    }
    return NULL;
}

static void stop_threads(struct engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->quit = true;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->lock);
    for (int r = 1; r < e->n_dev; r++) {
        if (e->dev[r].has_thread) pthread_join(e->dev[r].thread, NULL);
        e->dev[r].has_thread = false;
    }
}

/* --- setup --------------------------------------------------------------------------------- */

static void *dev_alloc(struct device *dv, size_t bytes, bool *ok)
{
    void *p = dv->be->ops->alloc(dv->be, bytes);
    if (!p) *ok = false;
    return p;
}

/* Remembers something uploaded for release; false when the list cannot grow. */
static bool dev_own(struct device *dv, const void *p, bool is_weight)
{
    if (dv->n_owned == dv->cap_owned) {
        int cap = dv->cap_owned ? 2 * dv->cap_owned : 64;
        const void **o = realloc(dv->owned, sizeof *o * (size_t)cap);
        if (!o) return false;
        dv->owned = o;
        bool *w = realloc(dv->owned_is_weight, sizeof *w * (size_t)cap);
        if (!w) return false;
        dv->owned_is_weight = w;
        dv->cap_owned = cap;
    }
    dv->owned[dv->n_owned] = p;
    dv->owned_is_weight[dv->n_owned++] = is_weight;
    return true;
}

/* A matrix as this device's weight handle (NULL stays NULL). */
static const struct wmat *dev_weight(struct device *dv, const struct wmat *host, bool *ok)
{
    struct backend *be = dv->be;
    if (!host || be->ops->host_memory) return host;
    const struct wmat *w = be->ops->weight_upload(be, host);
    if (!w || !dev_own(dv, w, true)) {
        if (w) be->ops->weight_free(be, w);
        *ok = false;
        return NULL;
    }
    return w;
}

/* A vector of n floats (norm weights, biases) in this device's memory. */
static const float *dev_vec(struct device *dv, const float *host, size_t n, bool *ok)
{
    struct backend *be = dv->be;
    if (!host || be->ops->host_memory) return host;
    float *p = be->ops->alloc(be, sizeof(float) * n);
    if (!p || !dev_own(dv, p, false)) {
        if (p) be->ops->free(be, p);
        *ok = false;
        return NULL;
    }
    be->ops->upload(be, p, host, sizeof(float) * n);
    return p;
}

static void dev_ffn(struct device *dv, struct ffn_w *dst, const struct ffn_w *src, size_t d,
                    bool *ok)
{
    dst->d_ff = src->d_ff;
    dst->gate = dev_weight(dv, src->gate, ok);
    dst->up = dev_weight(dv, src->up, ok);
    dst->down = dev_weight(dv, src->down, ok);
    dst->b_gate = dev_vec(dv, src->b_gate, (size_t)src->d_ff, ok);
    dst->b_up = dev_vec(dv, src->b_up, (size_t)src->d_ff, ok);
    dst->b_down = dev_vec(dv, src->b_down, d, ok);
}

/* Routed experts are kept out of the `owned` list: a rebalance adds and frees them one by one
 * (device_expert_free). On host memory the handle is the model's own matrix. */
/* A bias vector of n floats copied to this device for one routed expert (freed with it). */
static const float *dev_expert_vec(struct device *dv, const float *host, size_t n, bool *ok)
{
    struct backend *be = dv->be;
    if (!host) return NULL;
    float *p = be->ops->alloc(be, sizeof(float) * n);
    if (!p) {
        *ok = false;
        return NULL;
    }
    be->ops->upload(be, p, host, sizeof(float) * n);
    return p;
}

static bool dev_expert(struct device *dv, struct ffn_w *dst, const struct ffn_w *src, size_t d)
{
    struct backend *be = dv->be;
    if (be->ops->host_memory) {
        *dst = *src;
        return true;
    }
    bool ok = true;
    dst->d_ff = src->d_ff;
    dst->gate = be->ops->weight_upload(be, src->gate);
    dst->up = be->ops->weight_upload(be, src->up);
    dst->down = be->ops->weight_upload(be, src->down);
    dst->b_gate = dev_expert_vec(dv, src->b_gate, (size_t)src->d_ff, &ok);
    dst->b_up = dev_expert_vec(dv, src->b_up, (size_t)src->d_ff, &ok);
    dst->b_down = dev_expert_vec(dv, src->b_down, d, &ok);
    return ok && dst->gate && dst->up && dst->down;
}

static void dev_expert_free(struct device *dv, struct ffn_w *f)
{
    struct backend *be = dv->be;
    if (!be->ops->host_memory) {
        if (f->gate) be->ops->weight_free(be, f->gate);
        if (f->up) be->ops->weight_free(be, f->up);
        if (f->down) be->ops->weight_free(be, f->down);
        if (f->b_gate) be->ops->free(be, (void *)f->b_gate);
        if (f->b_up) be->ops->free(be, (void *)f->b_up);
        if (f->b_down) be->ops->free(be, (void *)f->b_down);
    }
    f->gate = f->up = f->down = NULL;
    f->b_gate = f->b_up = f->b_down = NULL;
}

/* Device of the first replica of expert x at the first MoE layer. */
static int first_owner(const struct plc_map *m, int x)
{
    return m->slot_dev[m->rep_slot[m->rep_off[x]]];
}

/* Whether the map puts a replica of expert x of MoE layer mi on device d. */
static bool map_holds(const struct plc_map *m, int mi, int x, int d)
{
    const int *off = m->rep_off + (size_t)mi * (m->n_expert + 1);
    const int *slot = m->rep_slot + (size_t)mi * m->n_slots;
    for (int i = off[x]; i < off[x + 1]; i++)
        if (m->slot_dev[(size_t)mi * m->n_slots + slot[i]] == d) return true;
    return false;
}

/* Builds dv->w: the weights this device needs (attention and dense parts everywhere, experts
 * only on their owner) in its backend's memory. */
static int device_weights(struct engine *e, struct device *dv)
{
    const struct model *m = e->m;
    const struct model_desc *md = &m->desc;
    size_t D = (size_t)md->d_model, hd = (size_t)md->head_dim;
    size_t qdim = (size_t)md->n_head * hd, kvdim = (size_t)md->n_kv_head * hd;
    bool ok = true;

    dv->w = *m;
    dv->w_layers = calloc((size_t)md->n_layer, sizeof *dv->w_layers);
    dv->w_ffn = calloc((size_t)md->n_layer * (size_t)(md->n_expert + md->n_shared) + 1,
                       sizeof *dv->w_ffn);
    if (!dv->w_layers || !dv->w_ffn) return -1;
    dv->w.layers = dv->w_layers;
    dv->w.embed = dev_weight(dv, m->embed, &ok);
    dv->w.lm_head = m->lm_head == m->embed ? dv->w.embed : dev_weight(dv, m->lm_head, &ok);
    dv->w.norm = dev_vec(dv, m->norm, D, &ok);
    if (md->v4_attn) {
        size_t hc = (size_t)md->v4_hc;
        dv->w.hc_head_fn = dev_weight(dv, m->hc_head_fn, &ok);
        dv->w.hc_head_base = dev_vec(dv, m->hc_head_base, hc, &ok);
        dv->w.hc_head_scale = dev_vec(dv, m->hc_head_scale, 1, &ok);
    }
    struct ffn_w *ffn = dv->w_ffn;
    for (int l = 0; l < md->n_layer && ok; l++) {
        const struct layer_w *src = &m->layers[l];
        struct layer_w *lw = &dv->w_layers[l];
        size_t qn = md->qk_norm == QK_NORM_HEAD ? hd : qdim;
        size_t kn = md->qk_norm == QK_NORM_HEAD ? hd : kvdim;
        lw->attn_norm = dev_vec(dv, src->attn_norm, D, &ok);
        lw->ffn_norm = dev_vec(dv, src->ffn_norm, D, &ok);
        lw->wq = dev_weight(dv, src->wq, &ok);
        lw->wk = dev_weight(dv, src->wk, &ok);
        lw->wv = dev_weight(dv, src->wv, &ok);
        lw->wo = dev_weight(dv, src->wo, &ok);
        lw->bq = dev_vec(dv, src->bq, qdim, &ok);
        lw->bk = dev_vec(dv, src->bk, kvdim, &ok);
        lw->bv = dev_vec(dv, src->bv, kvdim, &ok);
        lw->bo = dev_vec(dv, src->bo, D, &ok);
        lw->sinks = dev_vec(dv, src->sinks, (size_t)md->n_head, &ok);
        lw->q_norm = dev_vec(dv, src->q_norm, qn, &ok);
        lw->k_norm = dev_vec(dv, src->k_norm, kn, &ok);
        lw->wq_a = dev_weight(dv, src->wq_a, &ok);
        lw->q_a_norm = dev_vec(dv, src->q_a_norm, (size_t)md->q_lora_rank, &ok);
        lw->wq_b = dev_weight(dv, src->wq_b, &ok);
        lw->wkv_a = dev_weight(dv, src->wkv_a, &ok);
        lw->kv_a_norm = dev_vec(dv, src->kv_a_norm, (size_t)md->kv_lora_rank, &ok);
        lw->wkv_b = dev_weight(dv, src->wkv_b, &ok);
        lw->w_uk_t = dev_weight(dv, src->w_uk_t, &ok);
        lw->idx_wq_b = dev_weight(dv, src->idx_wq_b, &ok);
        lw->idx_wk = dev_weight(dv, src->idx_wk, &ok);
        lw->idx_wproj = dev_weight(dv, src->idx_wproj, &ok);
        lw->idx_k_norm = dev_vec(dv, src->idx_k_norm, (size_t)md->dsa_dim, &ok);
        lw->idx_k_norm_b = dev_vec(dv, src->idx_k_norm_b, (size_t)md->dsa_dim, &ok);
        if (md->v4_attn) {
            size_t hc = (size_t)md->v4_hc, rate = (size_t)md->v4_rate[md->v4_attn[l]];
            struct model_v4_row r = model_v4_row(md, md->v4_attn[l]);
            lw->v4_wkv = dev_weight(dv, src->v4_wkv, &ok);
            lw->v4_kv_norm = dev_vec(dv, src->v4_kv_norm, hd, &ok);
            lw->v4_wo_a = dev_weight(dv, src->v4_wo_a, &ok);
            lw->v4_wo_b = dev_weight(dv, src->v4_wo_b, &ok);
            for (int i = 0; i < 2; i++) {
                size_t c = i ? 2 * (size_t)md->dsa_dim : (size_t)r.c;
                lw->hc_fn[i] = dev_weight(dv, src->hc_fn[i], &ok);
                lw->hc_base[i] = dev_vec(dv, src->hc_base[i], hc * (2 + hc), &ok);
                lw->hc_scale[i] = dev_vec(dv, src->hc_scale[i], 3, &ok);
                lw->cmp_wkv[i] = dev_weight(dv, src->cmp_wkv[i], &ok);
                lw->cmp_wgate[i] = dev_weight(dv, src->cmp_wgate[i], &ok);
                lw->cmp_bias[i] = dev_vec(dv, src->cmp_bias[i], rate * c, &ok);
                lw->cmp_norm[i] = dev_vec(dv, src->cmp_norm[i], i ? (size_t)md->dsa_dim : hd, &ok);
            }
            /* int32 ids, copied as 4-byte words */
            lw->tid2eid = (const int32_t *)dev_vec(dv, (const float *)src->tid2eid,
                                                   (size_t)md->vocab * md->top_k, &ok);
        }
        if (md->layer_linear && md->layer_linear[l]) {
            size_t nv = (size_t)md->lin_nv;
            size_t conv = 2 * (size_t)md->lin_nk * md->lin_dk + nv * md->lin_dv;
            bool mamba = md->lin_kind == LIN_KIND_MAMBA2;
            size_t vd = nv * md->lin_dv;
            for (int i = 0; i < 4; i++) lw->lin_in[i] = dev_weight(dv, src->lin_in[i], &ok);
            lw->lin_in_b = dev_vec(dv, src->lin_in_b, vd + conv + nv, &ok);
            lw->lin_conv_w = dev_vec(dv, src->lin_conv_w, conv * (size_t)md->lin_conv, &ok);
            lw->lin_conv_b = dev_vec(dv, src->lin_conv_b, conv, &ok);
            lw->lin_a_log = dev_vec(dv, src->lin_a_log, nv, &ok);
            lw->lin_dt_bias = dev_vec(dv, src->lin_dt_bias, nv, &ok);
            lw->lin_d = dev_vec(dv, src->lin_d, nv, &ok);
            lw->lin_norm = dev_vec(dv, src->lin_norm, mamba ? vd : (size_t)md->lin_dv, &ok);
            lw->lin_out = dev_weight(dv, src->lin_out, &ok);
            lw->lin_out_b = dev_vec(dv, src->lin_out_b, D, &ok);
        }
        if (md->ffn == FFN_KIND_CONTINUOUS) {
            lw->cont_router = dev_weight(dv, src->cont_router, &ok);
            lw->cont_router_b = dev_vec(dv, src->cont_router_b, 2 * (size_t)md->cont_z, &ok);
            lw->cont_keys = dev_weight(dv, src->cont_keys, &ok);
            lw->cont_gate = dev_weight(dv, src->cont_gate, &ok);
            lw->cont_up = dev_weight(dv, src->cont_up, &ok);
            lw->cont_down_t = dev_weight(dv, src->cont_down_t, &ok);
            continue;
        }
        if (!md->layer_is_moe[l]) {
            dev_ffn(dv, &lw->dense, &src->dense, D, &ok);
            continue;
        }
        lw->router = dev_weight(dv, src->router, &ok);
        lw->router_bias = dev_vec(dv, src->router_bias, (size_t)md->n_expert, &ok);
        lw->router_b = dev_vec(dv, src->router_b, (size_t)md->n_expert, &ok);
        lw->group_router = dev_weight(dv, src->group_router, &ok);
        lw->shared_gate = dev_weight(dv, src->shared_gate, &ok);
        lw->experts = ffn;
        /* Host memory: every device may compute any expert (the handles are the model's), so
         * a rebalance only switches the map. Elsewhere: the experts the map puts here. */
        for (int x = 0; x < md->n_expert; x++, ffn++) {
            ffn->d_ff = src->experts[x].d_ff;
            if ((dv->be->ops->host_memory || map_holds(&e->map, e->moe_index[l], x, dv->rank)) &&
                !dev_expert(dv, ffn, &src->experts[x], D))
                ok = false;
        }
        lw->shared = ffn;
        for (int i = 0; i < md->n_shared; i++, ffn++)
            dev_ffn(dv, ffn, &src->shared[i], D, &ok);
    }
    if (m->mtp_in) {
        dv->w_mtp = *m->mtp_in;
        dv->w_mtp.enorm = dev_vec(dv, m->mtp_in->enorm, D, &ok);
        dv->w_mtp.hnorm = dev_vec(dv, m->mtp_in->hnorm, D, &ok);
        dv->w_mtp.eh_proj = dev_weight(dv, m->mtp_in->eh_proj, &ok);
        dv->w.mtp_in = &dv->w_mtp;
    }
    dv->cos_sin = (float *)dev_vec(dv, e->cos_sin,
                                   (size_t)e->p.max_model_len * (size_t)md->rope_dim, &ok);
    return ok ? 0 : -1;
}

static int device_backend(struct engine *e, struct device *dv, int threads, char *err,
                          size_t errlen)
{
    if (e->p.backend != ENGINE_BACKEND_CUDA) {
        bool bf16 = model_computes_bf16(e->m);
        dv->be = e->p.backend == ENGINE_BACKEND_CPU_STAGED ? backend_cpu_create_staged(threads, bf16)
                                                           : backend_cpu_create(threads, bf16);
        /* --quantization trades precision for speed everywhere, MXFP4 experts included */
        if (dv->be) backend_cpu_set_int8_mxfp4(dv->be, e->m->quant != MODEL_QUANT_NONE);
        return dv->be ? 0
                      : ms_errf(err, errlen, "cannot start device %d (%d threads): out of memory "
                                             "or threads",
                                dv->rank, threads);
    }
#ifdef MOESERVE_HAVE_CUDA
    /* one GPU per process when multi-process: the one it was given */
    dv->be = backend_cuda_create(dv->e->remote ? dv->e->p.cuda_device : dv->rank, err, errlen);
    return dv->be ? 0 : -1;
#else
    return ms_errf(err, errlen, "this build has no CUDA backend (configure with -DMOESERVE_CUDA=ON "
                                "on a machine with the CUDA toolkit)");
#endif
}

/* After a step: the first device failure (CUDA errors are sticky per backend), or 0. */
static int device_check(struct device *dv, char *err, size_t errlen)
{
#ifdef MOESERVE_HAVE_CUDA
    if (dv->e->p.backend == ENGINE_BACKEND_CUDA) {
        dv->be->ops->synchronize(dv->be);
        char why[MS_ERR_LEN];
        if (backend_cuda_error(dv->be, why, sizeof why) != 0)
            return ms_errf(err, errlen, "device %d: %s", dv->rank, why);
#ifdef MOESERVE_HAVE_NCCL
        if (dv->e->n_dev > 1 && comm_nccl_error(dv->e->comm, dv->rank, why, sizeof why) != 0)
            return ms_errf(err, errlen, "device %d: %s", dv->rank, why);
#endif
    }
#endif
    return 0;
}

static int max_int(int a, int b)
{
    return a > b ? a : b;
}

/* An int32 table in backend memory (owned by the device; freed at release). */
static int32_t *dev_idx(struct device *dv, const int32_t *host, size_t n, bool *ok)
{
    struct backend *be = dv->be;
    int32_t *p = be->ops->alloc(be, sizeof(int32_t) * n);
    if (!p || !dev_own(dv, p, false)) {
        if (p) be->ops->free(be, p);
        *ok = false;
        return NULL;
    }
    be->ops->upload(be, p, host, sizeof(int32_t) * n);
    return p;
}

/* Buffers and column tables of hybrid models: the gated attention's q_proj split (each head's
 * hd queries, then its hd gate logits), and Gated DeltaNet's projections (qwen3_next's fused
 * in_proj_qkvz holds per key head q (dk), k (dk), v (r dv), z (r dv) with r = nv / nk, and
 * in_proj_ba per key head b (r), a (r)). */
static int device_hybrid(struct engine *e, struct device *dv)
{
    const struct model_desc *md = &e->m->desc;
    size_t T = (size_t)e->p.max_batch_tokens;
    bool ok = true;
    int32_t *tab = NULL;
    if (md->qk_norm == QK_NORM_HEAD_POST) {
        float *one = malloc(sizeof(float) * (size_t)md->head_dim);
        if (!one) return -1;
        for (int i = 0; i < md->head_dim; i++) one[i] = 1.0f;
        dv->ones = dev_alloc(dv, sizeof(float) * (size_t)md->head_dim, &ok);
        if (dv->ones) dv->be->ops->upload(dv->be, dv->ones, one, sizeof(float) * md->head_dim);
        free(one);
    }
    if (md->attn_temp_tuning) {
        dv->tscale = dev_alloc(dv, T * sizeof(float), &ok);
        dv->h_tscale = malloc(T * sizeof(float));
        if (!dv->h_tscale) return -1;
    }
    if (md->attn_out_gate) {
        int hd = md->head_dim, qdim = md->n_head * hd;
        dv->qg = dev_alloc(dv, T * 2 * (size_t)qdim * sizeof(float), &ok);
        dv->gate = dev_alloc(dv, T * (size_t)qdim * sizeof(float), &ok);
        if (!(tab = malloc(sizeof(int32_t) * 2 * (size_t)qdim))) return -1;
        for (int h = 0; h < md->n_head; h++)
            for (int i = 0; i < hd; i++) {
                tab[h * hd + i] = h * 2 * hd + i;
                tab[qdim + h * hd + i] = h * 2 * hd + hd + i;
            }
        dv->idx_q = dev_idx(dv, tab, 2 * (size_t)qdim, &ok);
        free(tab);
        tab = NULL;
    }
    if (md->n_linear > 0) {
        int nk = md->lin_nk, nv = md->lin_nv, dk = md->lin_dk, dvh = md->lin_dv, r = nv / nk;
        size_t kd = (size_t)nk * dk, vd = (size_t)nv * dvh, conv = 2 * kd + vd;
        if (md->lin_kind == LIN_KIND_MAMBA2) {
            /* in_proj: z (vd), then x|B|C (conv), then dt (nv) */
            size_t rows = vd + conv + (size_t)nv;
            dv->lin_raw = dev_alloc(dv, T * rows * sizeof(float), &ok);
            if (!(tab = malloc(sizeof(int32_t) * rows))) return -1;
            for (size_t i = 0; i < conv; i++) tab[i] = (int32_t)(vd + i);
            for (size_t i = 0; i < vd; i++) tab[conv + i] = (int32_t)i;
            for (int i = 0; i < nv; i++) tab[conv + vd + (size_t)i] = (int32_t)(vd + conv + i);
            dv->idx_lin = dev_idx(dv, tab, rows, &ok);
            free(tab);
        } else if (md->lin_fused_in) {
            dv->lin_raw = dev_alloc(dv, T * 2 * (kd + vd) * sizeof(float), &ok);
            dv->lin_raw_ba = dev_alloc(dv, T * 2 * (size_t)nv * sizeof(float), &ok);
            size_t nt = conv + vd + 2 * (size_t)nv;
            if (!(tab = malloc(sizeof(int32_t) * nt))) return -1;
            int G = 2 * dk + 2 * r * dvh; /* one key head's rows of in_proj_qkvz */
            for (int g = 0; g < nk; g++) {
                for (int i = 0; i < dk; i++) {
                    tab[g * dk + i] = g * G + i;
                    tab[kd + (size_t)g * dk + i] = g * G + dk + i;
                }
                for (int i = 0; i < r * dvh; i++) {
                    tab[2 * kd + (size_t)g * r * dvh + i] = g * G + 2 * dk + i;
                    tab[conv + (size_t)g * r * dvh + i] = g * G + 2 * dk + r * dvh + i;
                }
                for (int i = 0; i < r; i++) {
                    tab[conv + vd + (size_t)g * r + i] = g * 2 * r + i;
                    tab[conv + vd + nv + (size_t)g * r + i] = g * 2 * r + r + i;
                }
            }
            dv->idx_lin = dev_idx(dv, tab, nt, &ok);
            free(tab);
        }
        dv->lin_qkv = dev_alloc(dv, T * conv * sizeof(float), &ok);
        dv->lin_z = dev_alloc(dv, T * vd * sizeof(float), &ok);
        dv->lin_b = dev_alloc(dv, T * (size_t)nv * sizeof(float), &ok);
        dv->lin_a = dev_alloc(dv, T * (size_t)nv * sizeof(float), &ok);
        dv->lin_out = dev_alloc(dv, T * vd * sizeof(float), &ok);
        size_t ms = (size_t)e->p.max_seqs;
        dv->sq_i32 = malloc(sizeof(int32_t) * 3 * ms);
        dv->sq_fresh = malloc(ms);
        if (!dv->sq_i32 || !dv->sq_fresh) return -1;
        dv->seqs = (struct be_seqs){.tok0 = dv->sq_i32, .n_tok = dv->sq_i32 + ms,
                                    .slot = dv->sq_i32 + 2 * ms, .fresh = dv->sq_fresh};
    }
    return ok ? 0 : -1;
}

static int device_init(struct engine *e, struct device *dv, int rank, int threads, char *err,
                       size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    size_t T = (size_t)e->p.max_batch_tokens;
    size_t d = (size_t)md->d_model;
    size_t qdim = (size_t)md->n_head * md->head_dim, kvdim = (size_t)md->n_kv_head * md->head_dim;
    size_t attdim = qdim, qlat = 0, widest_in = qdim;
    if (md->attn == ATTN_KIND_MLA) {
        size_t H = (size_t)md->n_head, kvr = (size_t)md->kv_lora_rank;
        size_t lat = kvr + (size_t)md->qk_rope_dim, vd = H * (size_t)md->v_head_dim;
        qdim = qdim > vd ? qdim : vd;
        size_t row = lat + (md->dsa_topk > 0 ? (size_t)md->dsa_dim : 0); /* + index key */
        kvdim = row > (size_t)md->q_lora_rank ? row : (size_t)md->q_lora_rank;
        attdim = H * kvr;
        qlat = H * lat;
        /* GEMM inputs: q_lora rows, latents per head (strided rows count whole), values */
        widest_in = attdim > vd ? attdim : vd;
        if ((size_t)md->q_lora_rank > widest_in) widest_in = (size_t)md->q_lora_rank;
        if (H * (size_t)md->head_dim > widest_in) widest_in = H * (size_t)md->head_dim;
    }
    if (md->v4_attn) { /* the streams' mixes, the query latent, the grouped projection */
        size_t flat = (size_t)md->v4_hc * d, og = (size_t)md->o_groups * md->o_lora_rank;
        if (flat > widest_in) widest_in = flat;
        if ((size_t)md->q_lora_rank > widest_in) widest_in = (size_t)md->q_lora_rank;
        if (og > widest_in) widest_in = og;
    }
    size_t lin_vd = (size_t)md->lin_nv * md->lin_dv;
    if (md->n_linear > 0 && lin_vd > widest_in) widest_in = lin_vd; /* out_proj's input */
    if (e->m->mtp_in && 2 * d > widest_in) widest_in = 2 * d;        /* eh_proj's input */
    bool ok = true;

    dv->rank = rank;
    dv->e = e;
    if (device_backend(e, dv, threads, err, errlen) != 0) return -1;
    struct backend *be = dv->be;
    dv->x = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->h = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->tmp = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->q = dev_alloc(dv, T * qdim * sizeof(float), &ok);
    dv->att = dev_alloc(dv, T * attdim * sizeof(float), &ok);
    dv->k = dev_alloc(dv, T * kvdim * sizeof(float), &ok);
    dv->v = dev_alloc(dv, T * (md->attn == ATTN_KIND_MLA ? 1 : kvdim) * sizeof(float), &ok);
    dv->qlat = qlat ? dev_alloc(dv, T * qlat * sizeof(float), &ok) : NULL;
    if (md->dsa_topk > 0) {
        size_t hi = (size_t)md->dsa_heads;
        dv->iq = dev_alloc(dv, T * hi * (size_t)md->dsa_dim * sizeof(float), &ok);
        dv->iw = dev_alloc(dv, T * hi * sizeof(float), &ok);
        dv->sel = dev_alloc(dv, T * (size_t)md->dsa_topk * sizeof(int32_t), &ok);
        dv->sel_n = dev_alloc(dv, T * sizeof(int32_t), &ok);
        dv->dsa_zero = dev_alloc(dv, (size_t)md->dsa_dim * sizeof(float), &ok);
        if (ok) {
            float *z = calloc((size_t)md->dsa_dim, sizeof(float));
            if (z)
                be->ops->upload(be, dv->dsa_zero, z, (size_t)md->dsa_dim * sizeof(float));
            else
                ok = false;
            free(z);
        }
    }
    if (device_hybrid(e, dv) != 0)
        return ms_errf(err, errlen, "out of memory for device %d hybrid-layer buffers", rank);
    dv->in = dev_alloc(dv, 4 * T * sizeof(int32_t), &ok);
    size_t bt = (size_t)e->p.max_seqs * (size_t)e->blocks_per_seq;
    dv->blocks = dev_alloc(dv, bt * sizeof(int32_t), &ok);
    /* Logit rows go through one matmul per chunk of up to logit_rows (then out to the items):
     * a decode batch in one read of the LM head. Host memory: the chunk is smaller, since it
     * only has to hold one step's sequences, and vocabularies reach 256k. */
    dv->logit_rows = be->ops->host_memory ? (T < HOST_LOGIT_ROWS ? (int)T : HOST_LOGIT_ROWS)
                                          : LOGIT_ROWS;
    dv->logits = dev_alloc(dv, (size_t)dv->logit_rows * md->vocab * sizeof(float), &ok);
    dv->lrows = dev_alloc(dv, (size_t)dv->logit_rows * sizeof(int32_t), &ok);
    if (!be->ops->host_memory) {
        dv->h_logits = malloc((size_t)dv->logit_rows * md->vocab * sizeof(float));
        dv->h_lrows = malloc((size_t)dv->logit_rows * sizeof(int32_t));
        ok = ok && dv->h_logits && dv->h_lrows;
    } else {
        dv->h_logits = NULL;
        dv->h_lrows = dv->lrows;
    }
    dv->h_in = malloc(4 * T * sizeof(int32_t));
    dv->h_blocks = malloc(bt * sizeof(int32_t));
    if (e->m->mtp_in && ok && dv->h_in) {
        dv->mtp_cat = dev_alloc(dv, 2 * T * d * sizeof(float), &ok);
        dv->mtp_iota = dev_alloc(dv, d * sizeof(int32_t), &ok);
        if (ok) {
            int32_t *iota = malloc(d * sizeof(int32_t));
            if (iota) {
                for (size_t i = 0; i < d; i++) iota[i] = (int32_t)i;
                be->ops->upload(be, dv->mtp_iota, iota, d * sizeof(int32_t));
                free(iota);
            } else {
                ok = false;
            }
        }
        if (!be->ops->host_memory && !(dv->h_hid = malloc(T * d * sizeof(float)))) ok = false;
    }
    if (!ok || !dv->h_in || !dv->h_blocks)
        return ms_errf(err, errlen, "out of memory for device %d scratch buffers", rank);
    int dense_ff = md->dense_d_ff > 0 ? md->dense_d_ff : 0;
    if (moe_scratch_init(&dv->moe, be, e->m, e->p.max_batch_tokens, e->n_dev, dense_ff) != 0 ||
        moe_scratch_slots(&dv->moe, e->map.n_slots > 0 ? e->map.n_slots : 1) != 0)
        return ms_errf(err, errlen, "out of memory for device %d MoE buffers", rank);
    if (md->ffn == FFN_KIND_CONTINUOUS &&
        infmoe_scratch_init(&dv->cont, be, e->m, e->p.max_batch_tokens) != 0)
        return ms_errf(err, errlen, "out of memory for device %d continuous-expert buffers", rank);
    /* Largest GEMM input: a token batch (T rows of up to max(d, qdim, ffn widths)) or the
     * routed rows (T * top_k rows of up to max(d, widest expert)). */
    int widest = max_int(max_int((int)d, (int)widest_in), max_int(dense_ff, md->shared_d_ff));
    int widest_expert = (int)d;
    for (int x = 0; x < md->n_expert; x++) widest_expert = max_int(widest_expert, md->expert_d_ff[x]);
    size_t elems = T * (size_t)widest;
    size_t routed = (size_t)dv->moe.max_rows * (size_t)widest_expert;
    size_t logit_in = (size_t)dv->logit_rows * d;
    struct be_reserve rs = {.max_elems = elems > routed ? elems : routed,
                            .max_rows = max_int(dv->moe.max_rows, max_int((int)T, dv->logit_rows)),
                            .max_experts = max_int(md->n_expert, 1),
                            .max_ctx = e->p.max_model_len,
                            .max_heads = md->attn == ATTN_KIND_MLA ? md->n_head
                                                                  : md->n_head / md->n_kv_head,
                            .max_k_dim = md->attn == ATTN_KIND_MLA
                                             ? md->kv_lora_rank + md->qk_rope_dim
                                             : md->head_dim,
                            .max_v_dim = md->attn == ATTN_KIND_MLA ? md->kv_lora_rank
                                                                   : md->head_dim,
                            .max_kv_heads = md->attn == ATTN_KIND_MLA ? 1 : md->n_kv_head,
                            .dsa_dim = md->dsa_topk > 0 ? md->dsa_dim : 0,
                            .dsa_heads = md->dsa_heads};
    if (md->v4_attn) {
        int k_row, v_row;
        model_kv_rows(md, &k_row, &v_row);
        rs.v4_row = k_row;
        rs.v4_window = md->sliding_window;
        if (v4_scratch_init(&dv->v4, be, md, (int)T, e->p.max_model_len, e->v4_tabs) != 0)
            return ms_errf(err, errlen, "out of memory for device %d's DeepSeek-V4 buffers", rank);
        dv->has_v4 = true;
    }
    if (logit_in > rs.max_elems) rs.max_elems = logit_in;
    if (md->ffn == FFN_KIND_CONTINUOUS) { /* the key product: T * max_samples rows of Z */
        int z_rows = (int)T * md->cont_max_samples;
        size_t z_in = (size_t)z_rows * (size_t)md->cont_z;
        rs.max_rows = max_int(rs.max_rows, z_rows);
        if (z_in > rs.max_elems) rs.max_elems = z_in;
    }
    if (be->ops->reserve(be, &rs) != 0)
        return ms_errf(err, errlen, "out of memory for device %d GEMM workspace", rank);
    if (device_weights(e, dv) != 0)
        return ms_errf(err, errlen, "out of memory for the weights on device %d (%s)", rank,
                       be->ops->name);
    /* Uploads report failure only through the backend's sticky error: ask now, not at the
     * first step. */
    return device_check(dv, err, errlen);
}

static void device_release(struct device *dv)
{
    if (!dv->be) return;
    struct backend *be = dv->be;
    void *bufs[] = {dv->x,  dv->h,      dv->tmp, dv->q,     dv->att,
                    dv->k,  dv->v,      dv->in, dv->blocks, dv->logits,
                    dv->lrows, dv->qlat, dv->qg, dv->gate, dv->lin_raw, dv->lin_raw_ba,
                    dv->lin_qkv, dv->lin_z, dv->lin_b, dv->lin_a, dv->lin_out, dv->ones,
                    dv->tscale, dv->st_idx, dv->mtp_cat, dv->mtp_iota, dv->iq, dv->iw,
                    dv->sel, dv->sel_n, dv->dsa_zero};
    if (be->ops->host_memory) dv->h_lrows = NULL; /* the same buffer as lrows */
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    const struct model_desc *md = &dv->e->m->desc;
    for (int l = 0; dv->w_layers && l < md->n_layer; l++)
        if (md->layer_is_moe[l] && dv->w_layers[l].experts)
            for (int x = 0; x < md->n_expert; x++) dev_expert_free(dv, &dv->w_layers[l].experts[x]);
    for (int i = 0; i < dv->n_owned; i++) {
        if (dv->owned_is_weight[i])
            be->ops->weight_free(be, dv->owned[i]);
        else
            be->ops->free(be, (void *)dv->owned[i]);
    }
    if (dv->own_kv) {
        for (int l = 0; dv->kvl && l < dv->e->m->desc.n_layer; l++) kv_layer_free(be, &dv->kvl[l]);
        free(dv->kvl);
    }
    if (dv->own_state) {
        for (int l = 0; l < dv->e->m->desc.n_layer; l++) {
            if (dv->st_conv && dv->st_conv[l]) be->ops->free(be, dv->st_conv[l]);
            if (dv->st_ssm && dv->st_ssm[l]) be->ops->free(be, dv->st_ssm[l]);
        }
        free(dv->st_conv);
        free(dv->st_ssm);
    }
    free(dv->sq_i32);
    free(dv->sq_fresh);
    free(dv->h_tscale);
    free(dv->h_hid);
    free(dv->owned);
    free(dv->owned_is_weight);
    free(dv->w_layers);
    free(dv->w_ffn);
    free(dv->h_in);
    free(dv->h_blocks);
    free(dv->h_logits);
    free(dv->h_lrows);
    moe_scratch_release(&dv->moe, be);
    if (dv->cont.max_tokens > 0) infmoe_scratch_release(&dv->cont, be);
    if (dv->has_v4) v4_scratch_release(&dv->v4, be);
    be->ops->destroy(be);
    dv->be = NULL;
}

/* Each device's KV storage: the engine's pool on device 0 (and on every device of a shared-
 * memory engine); a sticky engine's other devices get storage of the same layout, so a block
 * id means the same place on every device and the pool's allocator serves them all. */
static int device_kv(struct engine *e, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    if (e->sticky) {
        e->block_dev = malloc(sizeof(int32_t) * (size_t)e->kv.n_blocks);
        e->dev_seqs = calloc((size_t)e->n_dev, sizeof(int));
        e->old_blocks = malloc(sizeof(int32_t) * (size_t)e->p.max_seqs);
        e->sorted = malloc(sizeof *e->sorted * (size_t)e->p.max_seqs);
        if (!e->block_dev || !e->dev_seqs || !e->old_blocks || !e->sorted)
            return ms_errf(err, errlen, "out of memory for the device map of the KV cache");
        for (int b = 0; b < e->kv.n_blocks; b++) e->block_dev[b] = -1;
    }
    for (int r = 0; r < e->n_dev; r++) {
        struct device *dv = &e->dev[r];
        if (e->remote && r != e->self) continue; /* another process's */
        if (r == e->self || !e->sticky) {
            dv->kvl = e->kv.layer;
            continue;
        }
        dv->own_kv = true;
        dv->kvl = calloc((size_t)md->n_layer, sizeof *dv->kvl);
        if (!dv->kvl) return ms_errf(err, errlen, "out of memory for device %d's KV tables", r);
        for (int l = 0; l < md->n_layer; l++) {
            if (md->layer_linear && md->layer_linear[l]) continue; /* no K/V: state instead */
            if (kv_layer_alloc(dv->be, &e->kv.geom, e->kv.n_blocks, e->kv.block_size,
                               &dv->kvl[l]) != 0)
                return ms_errf(err, errlen, "out of memory for device %d's KV cache (%zu bytes "
                                            "a layer)",
                               r, kv_geom_token_bytes(&e->kv.geom) * e->kv.n_blocks *
                                      e->kv.block_size);
            dv->kvl[l].k_scale = e->kv.layer[l].k_scale;
            dv->kvl[l].v_scale = e->kv.layer[l].v_scale;
        }
    }
    return 0;
}

/* Each device's recurrent state for hybrid models, laid out like the KV storage: the engine's
 * on the self device (and every device of a shared-memory engine), a copy of the layout on the
 * other devices of a sticky one. Slots start zeroed (a fresh sequence zeroes its own anyway). */
static int device_state(struct engine *e, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    if (md->n_linear == 0) return 0;
    size_t slots = (size_t)e->kv.n_slots, W = (size_t)md->lin_conv - 1;
    size_t conv = 2 * (size_t)md->lin_nk * md->lin_dk + (size_t)md->lin_nv * md->lin_dv;
    size_t cbytes = slots * (W > 0 ? W : 1) * conv * sizeof(float);
    size_t sbytes = slots * (size_t)md->lin_nv * md->lin_dk * md->lin_dv * sizeof(float);
    e->state_seq_bytes = (size_t)md->n_linear *
                         (W * conv + (size_t)md->lin_nv * md->lin_dk * md->lin_dv) * sizeof(float);
    for (int r = 0; r < e->n_dev; r++) {
        struct device *dv = &e->dev[r];
        if (e->remote && r != e->self) continue;
        bool own = e->sticky && r != e->self;
        if (e->p.spec_state) {
            dv->st_idx = dv->be->ops->alloc(dv->be, sizeof(int32_t));
            if (!dv->st_idx) return ms_errf(err, errlen, "out of memory");
        }
        if (!own && e->st_conv) { /* shares the engine's */
            dv->st_conv = e->st_conv;
            dv->st_ssm = e->st_ssm;
            continue;
        }
        float **c = calloc((size_t)md->n_layer, sizeof *c);
        float **st = calloc((size_t)md->n_layer, sizeof *st);
        if (!c || !st) {
            free(c);
            free(st);
            return ms_errf(err, errlen, "out of memory for device %d's state tables", r);
        }
        dv->st_conv = c;
        dv->st_ssm = st;
        dv->own_state = own;
        if (!own) {
            e->st_conv = c;
            e->st_ssm = st;
        }
        struct backend *be = dv->be;
        for (int l = 0; l < md->n_layer; l++) {
            if (!md->layer_linear[l]) continue;
            c[l] = be->ops->alloc(be, cbytes);
            st[l] = be->ops->alloc(be, sbytes);
            if (!c[l] || !st[l])
                return ms_errf(err, errlen, "out of memory for device %d's recurrent state "
                                            "(%zu bytes a layer for %zu sequences)",
                               r, cbytes + sbytes, slots);
            /* zeroed through a host buffer: backends may not map their memory */
            float *zero = calloc(1, cbytes > sbytes ? cbytes : sbytes);
            if (!zero) return ms_errf(err, errlen, "out of memory");
            be->ops->upload(be, c[l], zero, cbytes);
            be->ops->upload(be, st[l], zero, sbytes);
            free(zero);
        }
    }
    return 0;
}

/* Sticky engines, before reserving a step's blocks: gives each new sequence its device (the
 * one holding its prefix-cached blocks, else the one with the fewest sequences) and notes how
 * many blocks each item holds already. */
static void sticky_assign(struct engine *e, struct engine_item *items, int n_items)
{
    for (int i = 0; i < n_items; i++) {
        struct kv_seq *kv = items[i].kv;
        e->old_blocks[i] = kv->n_blocks;
        if (kv->device >= 0) {
            /* A sequence keeps its device, unless it was released (preempted) and has since
             * taken cached prefix blocks whose K/V another device holds: it moves there. */
            int held = kv->n_blocks > 0 && kv->blocks[0] >= 0 ? e->block_dev[kv->blocks[0]] : -1;
            if (held < 0 || held == kv->device) continue;
            e->dev_seqs[kv->device]--;
            kv->device = -1;
        }
        int d = kv->n_blocks > 0 && kv->blocks[0] >= 0 ? e->block_dev[kv->blocks[0]] : -1;
        if (d < 0) {
            d = 0;
            for (int r = 1; r < e->n_dev; r++)
                if (e->dev_seqs[r] < e->dev_seqs[d]) d = r;
        }
        kv->device = d;
        e->dev_seqs[d]++;
    }
}

/* After reserving: records where the new blocks live and orders the step's items by device
 * (stable) into e->sorted, with their flat token offsets. */
static void sticky_order(struct engine *e, struct engine_item *items, int n_items)
{
    for (int i = 0; i < n_items; i++) {
        const struct kv_seq *kv = items[i].kv;
        for (int b = e->old_blocks[i]; b < kv->n_blocks; b++) e->block_dev[kv->blocks[b]] = kv->device;
    }
    int n = 0, total = 0;
    for (int r = 0; r < e->n_dev; r++)
        for (int i = 0; i < n_items; i++)
            if (items[i].kv->device == r) {
                e->sorted[n] = items[i];
                e->item_tok0[n++] = total;
                total += items[i].n_tokens;
            }
}

/* In-process copies between CPU devices; NCCL between GPUs. */
static int make_comm(struct engine *e, char *err, size_t errlen)
{
    if (e->p.comm) { /* borrowed */
        e->ctl = e->p.comm;
        e->comm = e->p.data_comm ? e->p.data_comm : e->p.comm;
        return 0;
    }
    if (e->p.backend != ENGINE_BACKEND_CUDA || e->n_dev == 1) {
        e->comm = comm_local_create(e->n_dev);
        if (!e->comm)
            return ms_errf(err, errlen, "cannot create the communicator for %d devices",
                           e->n_dev);
        return 0;
    }
#if defined(MOESERVE_HAVE_CUDA) && defined(MOESERVE_HAVE_NCCL)
    int devs[64];
    for (int r = 0; r < e->n_dev; r++) devs[r] = r;
    e->comm = comm_nccl_create(e->n_dev, devs, err, errlen);
    return e->comm ? 0 : -1;
#else
    return ms_errf(err, errlen, "%d GPUs need NCCL, and this build has none (install NCCL and "
                                "reconfigure)",
                   e->n_dev);
#endif
}

/* NCCL transfers of each rank go on its backend's stream, after the kernels that fill them. */
static int bind_comm_streams(struct engine *e, char *err, size_t errlen)
{
#if defined(MOESERVE_HAVE_CUDA) && defined(MOESERVE_HAVE_NCCL)
    if (e->p.backend != ENGINE_BACKEND_CUDA || e->n_dev == 1) return 0;
    for (int r = 0; r < e->n_dev; r++)
        if ((!e->remote || r == e->self) &&
            comm_nccl_set_stream(e->comm, r, backend_cuda_stream(e->dev[r].be), err, errlen) != 0)
            return -1;
#endif
    return 0;
}

/* The frequency of pair j of `dim` rotated dims: theta^(-2j/dim), or YaRN's blend (transformers'
 * _compute_yarn_parameters, in the same float32 arithmetic): extrapolated frequencies for the
 * fast-turning pairs, interpolated ones (divided by the factor) for the slow ones, linearly
 * ramped between the correction range [low, high] given by beta_fast / beta_slow rotations. */
static float rope_inv_freq_theta(const struct model_desc *md, float theta, bool yarn, int j)
{
    int dim = md->rope_dim;
    float pos_freq = powf(theta, (float)(2 * j) / (float)dim);
    if (md->rope_llama3) {
        /* transformers' llama3 rule, in f32 as it computes it */
        float f = 1.0f / pos_freq, old = (float)md->llama3_orig_max_pos;
        float lo_wl = old / md->llama3_low, hi_wl = old / md->llama3_high;
        float wl = 2.0f * (float)M_PI / f;
        float g = wl > lo_wl ? f / md->llama3_factor : f;
        if (!(wl < hi_wl) && !(wl > lo_wl)) {
            float sm = (old / wl - md->llama3_low) / (md->llama3_high - md->llama3_low);
            g = (1.0f - sm) * g / md->llama3_factor + sm * g;
        }
        return g;
    }
    if (!yarn) return 1.0f / pos_freq;
    double base = theta, orig = md->yarn_orig_max_pos;
    double low = (dim * log(orig / (md->yarn_beta_fast * 2 * M_PI))) / (2 * log(base));
    double high = (dim * log(orig / (md->yarn_beta_slow * 2 * M_PI))) / (2 * log(base));
    if (md->yarn_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0 ? low : 0;
    high = high < dim - 1 ? high : dim - 1;
    if (low == high) high += 0.001;
    float ramp = ((float)j - (float)low) / (float)(high - low);
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    float extra_factor = 1.0f - ramp;
    float extra = 1.0f / pos_freq, inter = 1.0f / (md->yarn_factor * pos_freq);
    return inter * (1.0f - extra_factor) + extra * extra_factor;
}

static float rope_inv_freq(const struct model_desc *md, int j)
{
    return rope_inv_freq_theta(md, md->rope_theta, md->rope_yarn, j);
}

static int build_rope_table(struct engine *e)
{
    const struct model_desc *md = &e->m->desc;
    int half = md->rope_dim / 2;
    e->cos_sin = malloc(sizeof(float) * 2 * (size_t)(half > 0 ? half : 1) * e->p.max_model_len);
    if (!e->cos_sin) return -1;
    for (int j = 0; j < half; j++) {
        /* Same float32 arithmetic as the reference: angle = position * inv_freq, then cos and
         * sin times the attention factor (1 but for YaRN). */
        float inv_freq = rope_inv_freq(md, j);
        for (int p = 0; p < e->p.max_model_len; p++) {
            float f = (float)p * inv_freq;
            float c = cosf(f), s = sinf(f);
            if (md->rope_attn_factor != 1.0f) {
                c *= md->rope_attn_factor;
                s *= md->rope_attn_factor;
            }
            e->cos_sin[((size_t)p * half + j) * 2] = c;
            e->cos_sin[((size_t)p * half + j) * 2 + 1] = s;
        }
    }
    return 0;
}

/* The MoE layers, the placement map (engine_params.map; else `placement` in every layer; else
 * MoHGE's All-size Group-decoupling for MoHGE models, contiguous blocks for the others) and the
 * per-layer counters that go with it. */
static int placement_init(struct engine *e, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    const struct engine_params *p = &e->p;
    int E = md->n_expert > 0 ? md->n_expert : 1;
    e->moe_index = malloc(sizeof(int) * (size_t)md->n_layer);
    e->moe_layers = malloc(sizeof(int) * (size_t)md->n_layer);
    if (!e->moe_index || !e->moe_layers) return ms_errf(err, errlen, "out of memory");
    for (int l = 0; l < md->n_layer; l++) {
        e->moe_index[l] = md->layer_is_moe[l] ? e->n_moe : -1;
        if (md->layer_is_moe[l]) e->moe_layers[e->n_moe++] = l;
    }
    int L = e->n_moe > 0 ? e->n_moe : 1;
    e->stats.n_moe_layers = e->n_moe;
    e->stats.dev_rows_away = calloc((size_t)e->n_dev, sizeof(uint64_t));
    e->stats.dev_tokens_away = calloc((size_t)e->n_dev, sizeof(uint64_t));
    e->stats.dev_width_rows = calloc((size_t)e->n_dev, sizeof(double));
    e->stats.layer_dev_flops = calloc((size_t)L * e->n_dev, sizeof(double));
    if (!e->stats.dev_rows_away || !e->stats.dev_tokens_away || !e->stats.dev_width_rows ||
        !e->stats.layer_dev_flops)
        return ms_errf(err, errlen, "out of memory");
    if (p->map) {
        const struct plc_map *m = p->map;
        if (m->n_dev != e->n_dev || m->n_layer != L || m->n_expert != E)
            return ms_errf(err, errlen, "placement map for %d devices, %d MoE layers, %d experts; "
                                        "the engine has %d, %d, %d",
                           m->n_dev, m->n_layer, m->n_expert, e->n_dev, L, E);
        if (plc_map_copy(&e->map, m) != 0) return ms_errf(err, errlen, "out of memory");
        /* the caller's index may be stale: rebuild it (and check the map) */
        if (plc_map_finish(&e->map, 0, err, errlen) != 0) return -1;
    } else {
        /* MoHGE without an explicit map: All-size Group-decoupling (every device gets every
         * width). */
        bool mohge_place = !p->placement && md->router == ROUTER_KIND_MOHGE && md->n_expert > 0;
        if (mohge_place) moe_mohge_placement(md, e->n_dev, e->owner);
        for (int x = 0; x < md->n_expert; x++)
            e->owner[x] = p->placement ? p->placement[x]
                          : mohge_place ? e->owner[x]
                                        : (int)((long)x * e->n_dev / md->n_expert);
        if (md->n_expert == 0) e->owner[0] = 0;
        if (plc_map_from_owner(&e->map, L, E, e->n_dev, e->owner, err, errlen) != 0) return -1;
        e->map.policy = mohge_place ? PLC_POLICY_MOHGE : PLC_POLICY_CONTIGUOUS;
    }
    for (int x = 0; x < md->n_expert; x++) e->owner[x] = first_owner(&e->map, x);
    return 0;
}

/* Routing statistics and the capture buffers they (and traces) read. */
static int capture_init(struct engine *e, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    const struct engine_params *p = &e->p;
    if (e->n_moe == 0 || md->n_expert == 0) return 0; /* a dense model routes nothing */
    if (p->routing_stats != ENGINE_RSTATS_OFF) {
        struct rstats_config rc = {.n_layer = e->n_moe, .n_expert = md->n_expert,
                                   .top_k = md->top_k, .d_model = md->d_model,
                                   .expert_width = md->expert_d_ff,
                                   .half_life = p->stats_half_life,
                                   .coact = p->routing_stats == ENGINE_RSTATS_FULL};
        if (rstats_create(&rc, &e->rstats, err, errlen) != 0) return -1;
    }
    if (p->routing_stats == ENGINE_RSTATS_OFF && !p->capture_routing) return 0;
    size_t cells = (size_t)e->n_moe * e->p.max_batch_tokens * md->top_k;
    e->route_ids = malloc(sizeof(int32_t) * cells);
    e->route_tokens = malloc(sizeof(int32_t) * (size_t)e->p.max_batch_tokens);
    e->route_tags = malloc(sizeof(uint16_t) * (size_t)e->p.max_batch_tokens);
    if (p->capture_weights) e->route_w = malloc(sizeof(float) * cells);
    if (!e->route_ids || !e->route_tokens || !e->route_tags || (p->capture_weights && !e->route_w))
        return ms_errf(err, errlen, "out of memory for the routing capture");
    e->routing = (struct engine_routing){.n_layer = e->n_moe, .top_k = md->top_k,
                                         .tokens = e->route_tokens, .tags = e->route_tags,
                                         .ids = e->route_ids,
                                         .weights = e->route_w,
                                         .layer_stride = (size_t)e->p.max_batch_tokens * md->top_k,
                                         .layer_index = e->moe_layers};
    return 0;
}

/* Multi-process engines (the end of this file). */
static int proc_init(struct engine *e, char *err, size_t errlen);
static void proc_quit(struct engine *e);
static int proc_step(struct engine *e, int total, char *err, size_t errlen);

int engine_create(const struct model *m, const struct engine_params *p, struct engine **out,
                  char *err, size_t errlen)
{
    const struct model_desc *md = &m->desc;
    *out = NULL;

    if (p->n_devices < 1 || p->n_devices > 64)
        return ms_errf(err, errlen, "devices must be between 1 and 64, got %d", p->n_devices);
    if (p->backend != ENGINE_BACKEND_CPU && p->backend != ENGINE_BACKEND_CUDA &&
        p->backend != ENGINE_BACKEND_CPU_STAGED)
        return ms_errf(err, errlen, "unknown backend %d", (int)p->backend);
    if (p->max_batch_tokens < 1 || p->max_seqs < 1 || p->kv_block_size < 1)
        return ms_errf(err, errlen, "max_batch_tokens, max_seqs and kv_block_size must be >= 1");
    if (md->rope_dim % 2 != 0 || md->rope_dim <= 0)
        return ms_errf(err, errlen, "rotary width %d must be even for RoPE", md->rope_dim);

    if (p->comm) {
        if (p->comm->self < 0 || p->comm->self >= p->comm->n_rank || !p->comm->ops->send ||
            !p->comm->ops->recv || !p->comm->ops->status)
            return ms_errf(err, errlen, "a multi-process engine needs a communicator whose ranks "
                                        "are processes (MPI)");
        if (p->backend == ENGINE_BACKEND_CUDA && !p->data_comm)
            return ms_errf(err, errlen, "a multi-process GPU engine needs an NCCL communicator "
                                        "for the expert rows");
        if (p->backend == ENGINE_BACKEND_CPU_STAGED)
            return ms_errf(err, errlen, "multi-process engines run on CPU or CUDA devices");
        if (p->routing_stats != ENGINE_RSTATS_OFF || p->capture_routing)
            return ms_errf(err, errlen, "routing statistics and traces are not available with "
                                        "several processes yet (they would count rank 0's "
                                        "tokens only)");
    }
    struct engine *e = calloc(1, sizeof *e);
    if (!e) return ms_errf(err, errlen, "out of memory");
    e->m = m;
    e->p = *p;
    if (p->comm) {
        e->p.n_devices = p->comm->n_rank;
        e->remote = true;
        e->self = p->comm->self;
    }
    if (e->p.max_model_len <= 0)
        e->p.max_model_len = md->max_pos > 0 && md->max_pos < 4096 ? md->max_pos : 4096;
    if (md->max_pos > 0 && e->p.max_model_len > md->max_pos) {
        free(e);
        return ms_errf(err, errlen, "max_model_len %d exceeds the model's %d positions",
                       p->max_model_len, md->max_pos);
    }
    e->n_dev = e->p.n_devices;
    e->attn_scale = md->attn_scale;

    e->owner = malloc(sizeof(int) * (size_t)(md->n_expert > 0 ? md->n_expert : 1));
    e->item_tok0 = malloc(sizeof(int32_t) * (size_t)p->max_seqs);
    e->dev = calloc((size_t)e->n_dev, sizeof *e->dev);
    e->stats.dev_routed_rows = calloc((size_t)e->n_dev, sizeof(uint64_t));
    e->stats.dev_expert_flops = calloc((size_t)e->n_dev, sizeof(double));
    e->stats.dev_busy_s = calloc((size_t)e->n_dev, sizeof(double));
    e->stats.dev_cont_neurons = calloc((size_t)e->n_dev, sizeof(uint64_t));
    e->stats.expert_rows =
        calloc((size_t)md->n_layer * (md->n_expert > 0 ? md->n_expert : 1), sizeof(uint64_t));
    if (!e->owner || !e->item_tok0 || !e->dev || !e->stats.dev_routed_rows ||
        !e->stats.dev_expert_flops || !e->stats.dev_busy_s || !e->stats.expert_rows ||
        !e->stats.dev_cont_neurons) {
        ms_errf(err, errlen, "out of memory");
        goto fail;
    }
    if (placement_init(e, err, errlen) != 0) goto fail;
    if (capture_init(e, err, errlen) != 0) goto fail;
    if (build_rope_table(e) != 0 ||
        (md->v4_attn &&
         v4_rope_tables(md, e->p.max_model_len, rope_inv_freq_theta, e->v4_tabs) != 0)) {
        ms_errf(err, errlen, "out of memory for the RoPE table");
        goto fail;
    }
    /* Separate processes hold separate KV storage, like GPUs. */
    e->sticky = (p->backend != ENGINE_BACKEND_CPU || e->remote) && e->n_dev > 1;
    if (make_comm(e, err, errlen) != 0) goto fail;

    /* Threads: the cores split between the devices (each runs its ops on a pool of its own),
     * at least one each. */
    long ncpu = e->p.n_threads > 0 ? e->p.n_threads : sysconf(_SC_NPROCESSORS_ONLN);
    int threads = (int)(ncpu / e->n_dev) > 1 ? (int)(ncpu / e->n_dev) : 1;
    if (e->remote) threads = (int)ncpu; /* one device per process: its threads are its own */
    if (e->p.backend == ENGINE_BACKEND_CUDA && (e->m->quant != MODEL_QUANT_NONE ||
                                               e->m->dtype == MODEL_DTYPE_F32)) {
        ms_errf(err, errlen, "the CUDA backend computes with bf16 weights: %s is CPU-only for now "
                             "(use --device cpu, or --dtype auto|bfloat16 without "
                             "--quantization)",
                e->m->quant != MODEL_QUANT_NONE ? "--quantization" : "--dtype float32");
        goto fail;
    }

    struct kv_geom geom;
    if (engine_kv_geom(e->m, e->p.kv_type, &geom) != 0) {
        ms_errf(err, errlen, "unknown KV cache type %d", e->p.kv_type);
        goto fail;
    }
    size_t block_bytes = (size_t)(md->n_layer - md->n_linear) * (size_t)e->p.kv_block_size *
                         kv_geom_token_bytes(&geom);
    size_t blocks_per_seq = (size_t)(e->p.max_model_len + e->p.kv_block_size - 1) /
                            (size_t)e->p.kv_block_size;
    e->blocks_per_seq = (int)blocks_per_seq;
    for (int r = 0; r < e->n_dev; r++)
        if ((!e->remote || r == e->self) &&
            device_init(e, &e->dev[r], r, threads, err, errlen) != 0)
            goto fail;
    if (md->n_linear > 0 || md->attn_out_gate || md->embed_scale != 1.0f ||
        md->residual_scale != 1.0f || md->logit_scale != 1.0f || md->attn_temp_tuning ||
        md->router_scales_input) {
        const struct backend_ops *ops = e->dev[e->self].be->ops;
        if (!ops->gdn || !ops->gather_cols || !ops->mul_sigmoid || !ops->mamba2 ||
            !ops->scale || !ops->mul_rows) {
            ms_errf(err, errlen, "the %s backend has no kernels for %s's gated attention, "
                                 "state-space layers or multipliers yet (use --device cpu)",
                    ops->name, md->model_type);
            goto fail;
        }
    }
    if (md->v4_attn && v4_backend_missing(e->dev[e->self].be)) {
        ms_errf(err, errlen, "the %s backend has no %s kernel for deepseek_v4 yet (use --device "
                             "cpu)",
                e->dev[e->self].be->ops->name, v4_backend_missing(e->dev[e->self].be));
        goto fail;
    }
    if (md->dsa_topk > 0 && (!e->dev[e->self].be->ops->dsa_select ||
                             !e->dev[e->self].be->ops->layernorm_ld)) {
        ms_errf(err, errlen, "the %s backend has no kernels for %s's sparse attention (its "
                             "indexer) yet (use --device cpu)",
                e->dev[e->self].be->ops->name, md->model_type);
        goto fail;
    }
    if (m->mtp_in && (!e->dev[e->self].be->ops->gather_cols ||
                      !e->dev[e->self].be->ops->rmsnorm_ld)) {
        ms_errf(err, errlen, "the %s backend cannot fuse an MTP module's inputs yet",
                e->dev[e->self].be->ops->name);
        goto fail;
    }
    if (bind_comm_streams(e, err, errlen) != 0) goto fail;

    size_t n_blocks = e->p.kv_cache_bytes ? e->p.kv_cache_bytes / block_bytes
                                          : blocks_per_seq * (size_t)e->p.max_seqs;
    if (n_blocks < 1 || n_blocks > INT32_MAX) {
        ms_errf(err, errlen, "KV cache of %zu bytes holds %zu blocks of %zu bytes",
                e->p.kv_cache_bytes, n_blocks, block_bytes);
        goto fail;
    }
    if (kv_create_layers(&e->kv, e->dev[e->self].be, md->n_layer, md->layer_linear, &geom,
                         e->p.kv_block_size, (int)n_blocks, err, errlen) != 0)
        goto fail;
    if (device_kv(e, err, errlen) != 0) goto fail;
    int slots = e->p.max_seqs * (e->p.spec_state ? 2 : 1); /* speculation: a spare each */
    if (md->n_linear > 0 && kv_state_init(&e->kv, slots) != 0) {
        ms_errf(err, errlen, "out of memory for the state slots");
        goto fail;
    }
    if (device_state(e, err, errlen) != 0) goto fail;

    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->sync_init = true;
    if (e->remote && proc_init(e, err, errlen) != 0) goto fail;
    for (int r = 1; r < e->n_dev && !e->remote; r++) {
        if (pthread_create(&e->dev[r].thread, NULL, device_main, &e->dev[r]) != 0) {
            ms_errf(err, errlen, "cannot start device thread %d", r);
            goto fail;
        }
        e->dev[r].has_thread = true;
    }
    *out = e;
    return 0;

fail:
    engine_free(e);
    return -1;
}

void engine_free(struct engine *e)
{
    if (!e) return;
    if (e->sync_init) {
        stop_threads(e);
        pthread_mutex_destroy(&e->lock);
        pthread_cond_destroy(&e->wake);
        pthread_cond_destroy(&e->idle);
    }
    if (e->remote && e->self == 0 && e->plan && !atomic_load(&e->failed)) proc_quit(e);
    if (e->proc_mu_init) pthread_mutex_destroy(&e->proc_mu);
    free(e->plan);
    free(e->report);
    free(e->w_kv);
    free(e->p_hid);
    if (e->kv.layer) kv_destroy(&e->kv);
    if (e->st_conv && e->dev && e->dev[e->self].be) {
        struct backend *be = e->dev[e->self].be;
        for (int l = 0; l < e->m->desc.n_layer; l++) {
            if (e->st_conv[l]) be->ops->free(be, e->st_conv[l]);
            if (e->st_ssm[l]) be->ops->free(be, e->st_ssm[l]);
        }
    }
    free(e->st_conv);
    free(e->st_ssm);
    for (int r = 0; e->dev && r < e->n_dev; r++) device_release(&e->dev[r]);
    if (e->comm && !e->p.comm) e->comm->ops->destroy(e->comm);
    free(e->cos_sin);
    for (int t = 0; t < 4; t++) free(e->v4_tabs[t]);
    free(e->owner);
    plc_map_free(&e->map);
    free(e->moe_index);
    free(e->moe_layers);
    free(e->route_ids);
    free(e->route_w);
    free(e->route_tokens);
    free(e->route_tags);
    rstats_free(e->rstats);
    free(e->stats.dev_rows_away);
    free(e->stats.dev_tokens_away);
    free(e->stats.dev_width_rows);
    free(e->stats.layer_dev_flops);
    free(e->item_tok0);
    free(e->block_dev);
    free(e->dev_seqs);
    free(e->old_blocks);
    free(e->sorted);
    free(e->dev);
    free(e->stats.dev_routed_rows);
    free(e->stats.dev_expert_flops);
    free(e->stats.dev_busy_s);
    free(e->stats.dev_cont_neurons);
    free(e->stats.expert_rows);
    free(e);
}

/* --- steps --------------------------------------------------------------------------------- */

int engine_seq_init(struct engine *e, struct kv_seq *s)
{
    return kv_seq_init(s, e->p.max_model_len, e->p.kv_block_size);
}

void engine_seq_free(struct engine *e, struct kv_seq *s)
{
    if (e->sticky && s->device >= 0 && s->device < e->n_dev) e->dev_seqs[s->device]--;
    kv_seq_free(&e->kv, s);
}

/* Splits items into n_dev contiguous slices with about the same number of tokens each, or, for
 * sticky engines, by the device each sequence lives on. */
static void partition(struct engine *e, int total)
{
    int item = 0;
    if (e->sticky) {
        /* Items are grouped by device (sticky_order): each device takes its own. */
        for (int r = 0; r < e->n_dev; r++) {
            struct device *dv = &e->dev[r];
            dv->item0 = item;
            while (item < e->n_items && e->items[item].kv->device == r) item++;
            dv->item1 = item;
            dv->tok0 = dv->item0 < e->n_items ? e->item_tok0[dv->item0] : total;
            int end = item < e->n_items ? e->item_tok0[item] : total;
            dv->n_tok = end - dv->tok0;
        }
        return;
    }
    for (int r = 0; r < e->n_dev; r++) {
        struct device *dv = &e->dev[r];
        long target = (long)total * (r + 1) / e->n_dev;
        dv->item0 = item;
        dv->tok0 = item < e->n_items ? e->item_tok0[item] : total;
        while (item < e->n_items &&
               (r == e->n_dev - 1 || e->item_tok0[item] + e->items[item].n_tokens <= target ||
                e->item_tok0[item] < target - e->items[item].n_tokens / 2))
            item++;
        dv->item1 = item;
        int end = item < e->n_items ? e->item_tok0[item] : total;
        dv->n_tok = end - dv->tok0;
    }
}

int engine_step(struct engine *e, struct engine_item *items, int n_items, char *err,
                size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    if (e->remote) {
        if (e->self != 0)
            return ms_errf(err, errlen, "rank %d of a multi-process engine runs "
                                        "engine_worker_run, not engine_step", e->self);
        if (engine_failed(e, err, errlen)) return -1;
    }
    if (n_items < 1) return 0;
    if (n_items > e->p.max_seqs)
        return ms_errf(err, errlen, "step has %d sequences, more than max_seqs %d", n_items,
                       e->p.max_seqs);
    int total = 0;
    for (int i = 0; i < n_items; i++) {
        const struct engine_item *it = &items[i];
        if (it->n_tokens < 1 || it->pos < 0 || it->n_logits < 0 || it->n_logits > it->n_tokens)
            return ms_errf(err, errlen, "item %d: bad token count, position or logits count", i);
        if (it->pos + it->n_tokens > e->p.max_model_len)
            return ms_errf(err, errlen, "item %d: position %d past max_model_len %d", i,
                           it->pos + it->n_tokens, e->p.max_model_len);
        if (e->m->mtp_in && !it->hidden_in)
            return ms_errf(err, errlen, "item %d: an MTP engine needs each token's hidden state",
                           i);
        for (int t = 0; t < it->n_tokens; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= md->vocab)
                return ms_errf(err, errlen, "item %d: token id %d out of range [0, %d)", i,
                               it->tokens[t], md->vocab);
        e->item_tok0[i] = total;
        total += it->n_tokens;
    }
    if (total > e->p.max_batch_tokens)
        return ms_errf(err, errlen, "step has %d tokens, more than max_batch_tokens %d", total,
                       e->p.max_batch_tokens);
    int need = 0;
    for (int i = 0; i < n_items; i++) {
        int blocks = (items[i].pos + items[i].n_tokens + e->kv.block_size - 1) / e->kv.block_size;
        need += blocks > items[i].kv->n_blocks ? blocks - items[i].kv->n_blocks : 0;
    }
    if (need > kv_free_blocks(&e->kv))
        return ms_errf(err, errlen, "KV cache full: step needs %d blocks, %d free", need,
                       kv_free_blocks(&e->kv));
    /* Hybrid models: a sequence's recurrent state must hold exactly the positions before the
     * step's (K/V reused without it, e.g. from another sequence's prefix, would be wrong). */
    for (int i = 0; i < n_items && md->n_linear > 0; i++) {
        struct kv_seq *kv = items[i].kv;
        if (items[i].pos > 0 && (kv->slot < 0 || kv->state_pos != items[i].pos))
            return ms_errf(err, errlen,
                           "item %d: the recurrent state holds positions [0, %d), the step "
                           "starts at %d",
                           i, kv->slot < 0 ? 0 : kv->state_pos, items[i].pos);
        if (kv->slot < 0 && e->kv.n_slot_free == 0)
            return ms_errf(err, errlen, "item %d: every recurrent-state slot (%d) is held", i,
                           e->kv.n_slots);
    }
    if (e->sticky) sticky_assign(e, items, n_items);
    for (int i = 0; i < n_items; i++)
        if (kv_seq_reserve(&e->kv, items[i].kv, items[i].pos + items[i].n_tokens) != 0)
            return ms_errf(err, errlen, "item %d: cannot reserve KV blocks", i);
    for (int i = 0; i < n_items && md->n_linear > 0; i++) {
        kv_seq_slot(&e->kv, items[i].kv); /* checked above: one is free when needed */
        items[i].kv->state_pos = items[i].pos + items[i].n_tokens;
    }

    e->items = items;
    e->n_items = n_items;
    if (e->sticky) {
        sticky_order(e, items, n_items);
        e->items = e->sorted;
    }
    partition(e, total);
    if (e->route_ids) {
        int t = 0;
        for (int i = 0; i < n_items; i++)
            for (int j = 0; j < e->items[i].n_tokens; j++) {
                e->route_tags[t] = e->items[i].tag;
                e->route_tokens[t++] = e->items[i].tokens[j];
            }
    }
    if (e->remote) return proc_step(e, total, err, errlen);
    if (e->n_dev > 1) {
        pthread_mutex_lock(&e->lock);
        e->running = e->n_dev - 1;
        e->generation++;
        pthread_cond_broadcast(&e->wake);
        pthread_mutex_unlock(&e->lock);
    }
    device_forward(&e->dev[0]);
    if (e->n_dev > 1) {
        pthread_mutex_lock(&e->lock);
        while (e->running > 0) pthread_cond_wait(&e->idle, &e->lock);
        pthread_mutex_unlock(&e->lock);
    }
    e->items = NULL;
    for (int r = 0; r < e->n_dev; r++)
        if (device_check(&e->dev[r], err, errlen) != 0) return -1;
    e->stats.steps++;
    e->stats.tokens += (uint64_t)total;
    if (e->route_ids) {
        e->routing.n_tok = total;
        e->have_routing = true;
        if (e->rstats) rstats_add(e->rstats, e->route_ids, total, e->routing.layer_stride);
    }
    return 0;
}

int engine_rows_per_token(const struct engine *e, int moe_top_k)
{
    const struct model_desc *md = &e->m->desc;
    if (md->ffn == FFN_KIND_CONTINUOUS || md->n_expert == 0) return 0;
    int k = moe_top_k > 0 && moe_top_k < md->top_k ? moe_top_k : md->top_k;
    return k * e->n_moe;
}

/* The device holding s's recurrent state, or NULL when this process cannot reach it. */
static struct device *state_device(struct engine *e, const struct kv_seq *s)
{
    if (e->remote) return NULL;
    if (!e->sticky) return &e->dev[e->self];
    return s->device >= 0 && s->device < e->n_dev ? &e->dev[s->device] : NULL;
}

int engine_state_snapshot(struct engine *e, struct kv_seq *s, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    if (md->n_linear == 0) return 0;
    if (!e->p.spec_state)
        return ms_errf(err, errlen, "the engine keeps no spare state slots (spec_state)");
    struct device *dv = state_device(e, s);
    if (!dv || s->slot < 0)
        return ms_errf(err, errlen, "the sequence's recurrent state is not on a device this "
                                    "process runs");
    int spare = kv_seq_spare_slot(&e->kv, s);
    if (spare < 0) return ms_errf(err, errlen, "every recurrent-state slot is held");
    struct backend *be = dv->be;
    size_t W = (size_t)md->lin_conv - 1;
    size_t conv = 2 * (size_t)md->lin_nk * md->lin_dk + (size_t)md->lin_nv * md->lin_dv;
    size_t cstride = W * conv, sstride = (size_t)md->lin_nv * md->lin_dk * md->lin_dv;
    int32_t from = s->slot;
    be->ops->upload(be, dv->st_idx, &from, sizeof from);
    for (int l = 0; l < md->n_layer; l++) {
        if (!md->layer_linear[l]) continue;
        if (cstride > 0)
            be->ops->gather_rows(be, dv->st_conv[l] + (size_t)spare * cstride, dv->st_conv[l],
                                 dv->st_idx, 1, (int)cstride);
        be->ops->gather_rows(be, dv->st_ssm[l] + (size_t)spare * sstride, dv->st_ssm[l],
                             dv->st_idx, 1, (int)sstride);
    }
    s->spare_pos = s->state_pos;
    return 0;
}

void engine_state_rollback(struct engine *e, struct kv_seq *s)
{
    if (e->m->desc.n_linear == 0 || s->spare_slot < 0 || s->spare_pos < 0) return;
    int t = s->slot;
    s->slot = s->spare_slot;
    s->spare_slot = t;
    s->state_pos = s->spare_pos;
    s->spare_pos = -1;
}

size_t engine_state_seq_bytes(const struct engine *e)
{
    return e->state_seq_bytes;
}

const struct model *engine_model(const struct engine *e)
{
    return e->m;
}

const struct engine_params *engine_get_params(const struct engine *e)
{
    return &e->p;
}

struct kv_cache *engine_kv(struct engine *e)
{
    return &e->kv;
}

double engine_dsa_seconds(const struct engine *e)
{
    double s = 0.0;
    for (int r = 0; r < e->n_dev; r++) s += e->dev[r].dsa_s;
    return s;
}

const struct engine_stats *engine_get_stats(const struct engine *e)
{
    return &e->stats;
}

void engine_set_profile(struct engine *e, bool on)
{
    e->profile = on;
}

int engine_expert_owner(const struct engine *e, int expert)
{
    return e->owner[expert];
}

const struct plc_map *engine_placement(const struct engine *e)
{
    return &e->map;
}

const unsigned long long *engine_comm_bytes(const struct engine *e)
{
    return e->comm->bytes_sent;
}

struct rstats *engine_routing_stats(struct engine *e)
{
    return e->rstats;
}

const struct engine_routing *engine_last_routing(const struct engine *e)
{
    return e->have_routing ? &e->routing : NULL;
}

int engine_set_placement(struct engine *e, const struct plc_map *m, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    if (e->remote)
        return ms_errf(err, errlen, "a multi-process engine cannot change its placement yet");
    if (m->n_dev != e->n_dev || m->n_layer != e->map.n_layer || m->n_expert != e->map.n_expert ||
        m->n_slots > e->dev[0].moe.max_slots)
        return ms_errf(err, errlen, "new placement has %d devices, %d MoE layers, %d experts, %d "
                                    "slots; the engine %d, %d, %d, at most %d",
                       m->n_dev, m->n_layer, m->n_expert, m->n_slots, e->n_dev, e->map.n_layer,
                       e->map.n_expert, e->dev[0].moe.max_slots);
    struct plc_map next;
    if (plc_map_copy(&next, m) != 0) return ms_errf(err, errlen, "out of memory");
    if (plc_map_finish(&next, 0, err, errlen) != 0) {
        plc_map_free(&next);
        return -1;
    }
    int moves = plc_map_moves(&e->map, &next);
    /* 1. Copies first, kept aside: a failed upload leaves everything as it was. Only devices
     * with their own memory copy; on the host every device already sees every expert. */
    int E = md->n_expert, L = e->n_moe;
    struct ffn_w *fresh = NULL;
    if (!e->dev[0].be->ops->host_memory && E > 0) {
        fresh = calloc((size_t)e->n_dev * L * E, sizeof *fresh);
        if (!fresh) {
            plc_map_free(&next);
            return ms_errf(err, errlen, "out of memory");
        }
        for (int r = 0; r < e->n_dev; r++)
            for (int mi = 0; mi < L; mi++) {
                const struct layer_w *lw = &e->dev[r].w.layers[e->moe_layers[mi]];
                const struct layer_w *src = &e->m->layers[e->moe_layers[mi]];
                for (int x = 0; x < E; x++) {
                    struct ffn_w *f = &fresh[((size_t)r * L + mi) * E + x];
                    if (lw->experts[x].gate || !map_holds(&next, mi, x, r)) continue;
                    bool up = dev_expert(&e->dev[r], f, &src->experts[x], (size_t)md->d_model);
                    if (!up) ms_errf(err, errlen, "device %d: out of memory for a copy of expert "
                                                  "%d of layer %d", r, x, e->moe_layers[mi]);
                    if (!up || device_check(&e->dev[r], err, errlen) != 0) {
                        for (size_t i = 0; i < (size_t)e->n_dev * L * E; i++)
                            dev_expert_free(&e->dev[i / ((size_t)L * E)], &fresh[i]);
                        free(fresh);
                        plc_map_free(&next);
                        return -1;
                    }
                }
            }
    }
    /* 2. Switch (no step runs now: the caller steps on this thread). 3. Free what is no
     * longer held. */
    for (int r = 0; fresh && r < e->n_dev; r++)
        for (int mi = 0; mi < L; mi++) {
            struct ffn_w *ex = e->dev[r].w.layers[e->moe_layers[mi]].experts;
            for (int x = 0; x < E; x++) {
                struct ffn_w *f = &fresh[((size_t)r * L + mi) * E + x];
                if (f->gate) {
                    ex[x] = *f;
                } else if (ex[x].gate && !map_holds(&next, mi, x, r)) {
                    dev_expert_free(&e->dev[r], &ex[x]);
                }
            }
        }
    free(fresh);
    plc_map_free(&e->map);
    e->map = next;
    for (int x = 0; x < md->n_expert; x++) e->owner[x] = first_owner(&e->map, x);
    e->stats.rebalances++;
    e->stats.rebalance_moves += (uint64_t)moves;
    return 0;
}

/* --- multi-process engines ----------------------------------------------------------------- */

/* What a rank > 0 answers after each step and ping: its status and its device's cumulative
 * counters, which rank 0 copies into its own engine_stats (and its communicator's bytes
 * matrix), so that /metrics shows every device. Followed by (n_moe) doubles, the FLOPs of each
 * MoE layer on the device, then (n_dev) uint64, the bytes it sent each rank. */
struct proc_report {
    int32_t status, pad;
    uint64_t routed_rows, rows_away, tokens_away, cont_neurons;
    double expert_flops, busy_s, width_rows;
};

/* A plan is int32 words: a header (kind, items, tokens, the MoE dispatch), then per item PLAN_ITEM words (n_tokens, pos, moe_top_k,
 * n_logits, device, blocks, moe_samples, moe_samples_adaptive, then moe_neuron_fraction's 8
 * bytes, then the state slot, then the hidden-state flags PLAN_HID_*), then every item's
 * tokens, then every item's block table (as many blocks as its positions after the step
 * need). */
enum { PLAN_STEP = 1, PLAN_PING = 2, PLAN_QUIT = 3 };
enum { PLAN_HEADER = 4, PLAN_ITEM = 12 };
enum { PLAN_HID_WANT = 1, PLAN_HID_NORMED = 2 };

static int proc_init(struct engine *e, char *err, size_t errlen)
{
    e->plan_cap = PLAN_HEADER + (size_t)e->p.max_seqs * (PLAN_ITEM + (size_t)e->blocks_per_seq) +
                  (size_t)e->p.max_batch_tokens;
    e->plan = malloc(sizeof(int32_t) * e->plan_cap);
    e->report_bytes = sizeof *e->report + sizeof(double) * (size_t)(e->n_moe > 0 ? e->n_moe : 1) +
                      sizeof(uint64_t) * (size_t)e->n_dev;
    e->report = calloc(1, e->report_bytes);
    if (e->self != 0) e->w_kv = calloc((size_t)e->p.max_seqs, sizeof *e->w_kv);
    e->p_hid = malloc(sizeof(float) * (size_t)e->p.max_batch_tokens * (size_t)e->m->desc.d_model);
    if (!e->plan || !e->report || (e->self != 0 && !e->w_kv) || !e->p_hid)
        return ms_errf(err, errlen, "out of memory for the step plan");
    if (e->self != 0 && !e->sorted) { /* a world of one process has no sticky buffers */
        e->sorted = malloc(sizeof *e->sorted * (size_t)e->p.max_seqs);
        if (!e->sorted) return ms_errf(err, errlen, "out of memory for the step plan");
    }
    pthread_mutex_init(&e->proc_mu, NULL);
    e->proc_mu_init = true;
    return 0;
}

/* Marks the engine failed with the communicator's reason (or `why`). Under proc_mu. */
static int proc_fail(struct engine *e, const char *why, char *err, size_t errlen)
{
    if (!atomic_load(&e->failed)) {
        if (e->ctl->ops->status(e->ctl, e->fail_why, sizeof e->fail_why) == 0)
            snprintf(e->fail_why, sizeof e->fail_why, "%s", why);
        atomic_store(&e->failed, true);
    }
    return ms_errf(err, errlen, "%s", e->fail_why);
}

/* Rank 0: sends the first `words` words of the plan to every other rank. */
static int proc_send_plan(struct engine *e, size_t words)
{
    for (int r = 1; r < e->n_dev; r++)
        if (e->ctl->ops->send(e->ctl, r, e->plan, sizeof(int32_t) * words) != 0) return -1;
    return 0;
}

/* Ranks > 0: answers rank 0 with `status` and this device's counters. */
static int proc_send_report(struct engine *e, int32_t status)
{
    struct proc_report *rp = e->report;
    const struct engine_stats *st = &e->stats;
    int me = e->self, n = e->n_dev, L = e->n_moe;
    *rp = (struct proc_report){.status = status, .routed_rows = st->dev_routed_rows[me],
                               .rows_away = st->dev_rows_away[me],
                               .tokens_away = st->dev_tokens_away[me],
                               .cont_neurons = st->dev_cont_neurons[me],
                               .expert_flops = st->dev_expert_flops[me],
                               .busy_s = st->dev_busy_s[me], .width_rows = st->dev_width_rows[me]};
    double *lf = (double *)(rp + 1);
    uint64_t *sent = (uint64_t *)(lf + (L > 0 ? L : 1));
    for (int l = 0; l < L; l++) lf[l] = st->layer_dev_flops[(size_t)l * n + me];
    for (int d = 0; d < n; d++) sent[d] = e->comm->bytes_sent[(size_t)me * n + d];
    return e->ctl->ops->send(e->ctl, 0, rp, e->report_bytes);
}

/* Rank 0: every other rank's report (its status 0: its step or ping went well). After a step
 * (copy) its counters go into this engine's stats; a ping, which runs on another thread than
 * the readers of those stats and changes no counter, leaves them alone. */
static int proc_gather_status(struct engine *e, bool copy, char *why, size_t whylen)
{
    int n = e->n_dev, L = e->n_moe;
    for (int r = 1; r < n; r++) {
        size_t got = 0;
        if (e->ctl->ops->recv(e->ctl, r, e->report, e->report_bytes, &got) != 0) return -1;
        const struct proc_report *rp = e->report;
        if (got != e->report_bytes || rp->status != 0) {
            snprintf(why, whylen, "rank %d reported a failed step", r);
            return -1;
        }
        if (!copy) continue;
        struct engine_stats *st = &e->stats;
        st->dev_routed_rows[r] = rp->routed_rows;
        st->dev_rows_away[r] = rp->rows_away;
        st->dev_tokens_away[r] = rp->tokens_away;
        st->dev_cont_neurons[r] = rp->cont_neurons;
        st->dev_expert_flops[r] = rp->expert_flops;
        st->dev_busy_s[r] = rp->busy_s;
        st->dev_width_rows[r] = rp->width_rows;
        const double *lf = (const double *)(rp + 1);
        const uint64_t *sent = (const uint64_t *)(lf + (L > 0 ? L : 1));
        for (int l = 0; l < L; l++) st->layer_dev_flops[(size_t)l * n + r] = lf[l];
        for (int d = 0; d < n; d++) e->comm->bytes_sent[(size_t)r * n + d] = sent[d];
    }
    return 0;
}

static int proc_step(struct engine *e, int total, char *err, size_t errlen)
{
    const struct model_desc *md = &e->m->desc;
    int V = md->vocab, bs = e->kv.block_size;
    char why[MS_ERR_LEN] = "a rank failed";
    pthread_mutex_lock(&e->proc_mu);
    /* the plan: items in device order (sticky_order), then tokens, then block tables */
    int32_t *w = e->plan, *tok = w + PLAN_HEADER + (size_t)PLAN_ITEM * e->n_items;
    w[0] = PLAN_STEP;
    w[1] = e->n_items;
    w[2] = total;
    w[3] = (int32_t)e->p.dispatch; /* the ranks exchange as rank 0 was told to */
    int32_t *blk = tok + total;
    for (int i = 0; i < e->n_items; i++) {
        const struct engine_item *it = &e->items[i];
        int nb = (it->pos + it->n_tokens + bs - 1) / bs;
        int32_t *iw = w + PLAN_HEADER + (size_t)PLAN_ITEM * i;
        iw[0] = it->n_tokens;
        iw[1] = it->pos;
        iw[2] = it->moe_top_k;
        iw[3] = it->n_logits;
        iw[4] = it->kv->device;
        iw[5] = nb;
        iw[6] = it->moe_samples;
        iw[7] = it->moe_samples_adaptive;
        memcpy(&iw[8], &it->moe_neuron_fraction, sizeof(double));
        iw[10] = it->kv->slot;
        iw[11] = (it->hidden_out ? PLAN_HID_WANT : 0) | (it->hidden_normed ? PLAN_HID_NORMED : 0);
        memcpy(tok, it->tokens, sizeof(int32_t) * (size_t)it->n_tokens);
        tok += it->n_tokens;
        memcpy(blk, it->kv->blocks, sizeof(int32_t) * (size_t)nb);
        blk += nb;
    }
    int rc = proc_send_plan(e, (size_t)(blk - w));
    if (rc == 0) device_forward(&e->dev[0]);
    /* the other ranks' logits, chunk by chunk in the order their logits_out sends them */
    float *host = e->dev[0].be->ops->host_memory ? e->dev[0].logits : e->dev[0].h_logits;
    for (int r = 1; r < e->n_dev && rc == 0; r++) {
        const struct device *dv = &e->dev[r];
        int it = dv->item0, j = 0;
        for (;;) {
            int rows = logit_chunk(e, it, j, dv->item1, dv->tok0, e->dev[0].logit_rows, NULL);
            if (rows == 0) break;
            size_t want = sizeof(float) * (size_t)rows * V, got = 0;
            if (e->ctl->ops->recv(e->ctl, r, host, want, &got) != 0 || got != want) {
                if (got != want) snprintf(why, sizeof why, "rank %d sent %zu bytes of logits, "
                                                           "not %zu", r, got, want);
                rc = -1;
                break;
            }
            logit_hand_out(e, &it, &j, rows, host);
        }
        if (rc == 0 && dev_wants_hidden(e, dv)) { /* then its hidden states (hidden_send) */
            size_t d = (size_t)md->d_model, want = sizeof(float) * (size_t)dv->n_tok * d, got = 0;
            if (e->ctl->ops->recv(e->ctl, r, e->p_hid, want, &got) != 0 || got != want) {
                if (got != want) snprintf(why, sizeof why, "rank %d sent %zu bytes of hidden "
                                                           "states, not %zu", r, got, want);
                rc = -1;
                break;
            }
            for (int i = dv->item0; i < dv->item1; i++) {
                const struct engine_item *item = &e->items[i];
                if (item->hidden_out)
                    memcpy(item->hidden_out, e->p_hid + (size_t)(e->item_tok0[i] - dv->tok0) * d,
                           sizeof(float) * d * (size_t)item->n_tokens);
            }
        }
    }
    if (rc == 0) rc = proc_gather_status(e, true, why, sizeof why);
    if (rc == 0 && device_check(&e->dev[0], why, sizeof why) != 0) rc = -1;
    if (rc != 0 || e->ctl->ops->status(e->ctl, NULL, 0) != 0) {
        proc_fail(e, why, err, errlen);
        pthread_mutex_unlock(&e->proc_mu);
        e->items = NULL;
        return -1;
    }
    pthread_mutex_unlock(&e->proc_mu);
    e->items = NULL;
    e->stats.steps++;
    e->stats.tokens += (uint64_t)total;
    return 0;
}

/* Rank 0 at engine_free: tells the others to stop (failures ignored: they are leaving). */
static void proc_quit(struct engine *e)
{
    pthread_mutex_lock(&e->proc_mu);
    e->plan[0] = PLAN_QUIT;
    e->plan[1] = e->plan[2] = e->plan[3] = 0;
    proc_send_plan(e, PLAN_HEADER);
    pthread_mutex_unlock(&e->proc_mu);
}

int engine_ping(struct engine *e, char *err, size_t errlen)
{
    if (!e->remote || e->self != 0) return 0;
    if (pthread_mutex_trylock(&e->proc_mu) != 0) return 0; /* a step is checking */
    if (atomic_load(&e->failed)) {
        ms_errf(err, errlen, "%s", e->fail_why);
        pthread_mutex_unlock(&e->proc_mu);
        return -1;
    }
    char why[MS_ERR_LEN] = "a rank failed";
    e->plan[0] = PLAN_PING;
    e->plan[1] = e->plan[2] = e->plan[3] = 0;
    int rc = proc_send_plan(e, PLAN_HEADER);
    if (rc == 0) rc = proc_gather_status(e, false, why, sizeof why);
    if (rc != 0) proc_fail(e, why, err, errlen);
    pthread_mutex_unlock(&e->proc_mu);
    return rc;
}

bool engine_failed(struct engine *e, char *why, size_t whylen)
{
    if (!e->remote || !atomic_load(&e->failed)) return false;
    if (why && whylen) snprintf(why, whylen, "%s", e->fail_why);
    return true;
}

/* Ranks > 0: checks a received step plan against this engine's limits and builds e->items
 * from it (block tables and tokens point into the plan). -1 with the reason. */
static int proc_take_plan(struct engine *e, size_t words, int *total_out, char *err,
                          size_t errlen)
{
    const int32_t *w = e->plan;
    int n_items = w[1], total = w[2], bs = e->kv.block_size;
    if (n_items < 1 || n_items > e->p.max_seqs || total < 1 || total > e->p.max_batch_tokens ||
        words < PLAN_HEADER + (size_t)PLAN_ITEM * n_items + (size_t)total)
        return ms_errf(err, errlen, "rank 0 sent a malformed plan (%d items, %d tokens)", n_items,
                       total);
    if (w[3] != ENGINE_DISPATCH_TOKENS && w[3] != ENGINE_DISPATCH_ROWS)
        return ms_errf(err, errlen, "rank 0 sent a plan with an unknown dispatch %d", w[3]);
    e->p.dispatch = (enum engine_dispatch)w[3];
    int32_t *tok = e->plan + PLAN_HEADER + (size_t)PLAN_ITEM * n_items;
    int32_t *blk = tok + total;
    const int32_t *end = e->plan + words;
    int sum = 0;
    for (int i = 0; i < n_items; i++) {
        const int32_t *iw = w + PLAN_HEADER + (size_t)PLAN_ITEM * i;
        int n = iw[0], pos = iw[1], nb = iw[5];
        if (n < 1 || pos < 0 || pos + n > e->p.max_model_len || iw[3] < 0 || iw[3] > n ||
            iw[4] < 0 || iw[4] >= e->n_dev || nb != (pos + n + bs - 1) / bs || sum + n > total ||
            blk + nb > end)
            return ms_errf(err, errlen, "rank 0 sent a malformed plan (item %d)", i);
        for (int b = 0; b < nb; b++)
            if (blk[b] < 0 || blk[b] >= e->kv.n_blocks)
                return ms_errf(err, errlen, "rank 0 sent block %d of %d", blk[b], e->kv.n_blocks);
        for (int t = 0; t < n; t++)
            if (tok[t] < 0 || tok[t] >= e->m->desc.vocab)
                return ms_errf(err, errlen, "rank 0 sent token id %d", tok[t]);
        struct kv_seq *kv = &e->w_kv[i];
        kv->blocks = blk;
        kv->n_blocks = nb;
        kv->max_blocks = nb;
        kv->device = iw[4];
        kv->slot = iw[10];
        if (e->m->desc.n_linear > 0 && (kv->slot < 0 || kv->slot >= e->p.max_seqs))
            return ms_errf(err, errlen, "rank 0 sent state slot %d", kv->slot);
        double frac;
        memcpy(&frac, &iw[8], sizeof frac);
        e->sorted[i] = (struct engine_item){.kv = kv, .tokens = tok, .n_tokens = n, .pos = pos,
                                            .moe_top_k = iw[2], .moe_samples = iw[6],
                                            .moe_neuron_fraction = frac,
                                            .moe_samples_adaptive = iw[7] != 0,
                                            .n_logits = iw[3]};
        if (iw[11] & PLAN_HID_WANT) { /* computed here, sent to rank 0 (hidden_send) */
            e->sorted[i].hidden_out = e->p_hid + (size_t)sum * (size_t)e->m->desc.d_model;
            e->sorted[i].hidden_normed = (iw[11] & PLAN_HID_NORMED) != 0;
        }
        e->item_tok0[i] = sum;
        sum += n;
        tok += n;
        blk += nb;
    }
    if (sum != total) return ms_errf(err, errlen, "rank 0 sent a malformed plan (token count)");
    e->items = e->sorted;
    e->n_items = n_items;
    *total_out = total;
    return 0;
}

int engine_worker_run(struct engine *e, char *err, size_t errlen)
{
    if (!e->remote || e->self == 0)
        return ms_errf(err, errlen, "engine_worker_run is for ranks other than 0");
    struct comm *c = e->ctl;
    for (;;) {
        size_t got = 0;
        if (c->ops->recv(c, 0, e->plan, sizeof(int32_t) * e->plan_cap, &got) != 0)
            return proc_fail(e, "rank 0 failed", err, errlen);
        size_t words = got / sizeof(int32_t);
        if (words < PLAN_HEADER) return proc_fail(e, "rank 0 sent a short plan", err, errlen);
        int kind = e->plan[0];
        if (kind == PLAN_QUIT) return 0;
        char why[MS_ERR_LEN];
        if (kind == PLAN_STEP) {
            int total = 0;
            if (proc_take_plan(e, words, &total, why, sizeof why) != 0) {
                /* answer, so that rank 0 fails at once, then stop */
                proc_send_report(e, -1);
                return proc_fail(e, why, err, errlen);
            }
            partition(e, total);
            device_forward(&e->dev[e->self]);
            e->items = NULL;
            if (c->ops->status(c, NULL, 0) != 0) return proc_fail(e, "", err, errlen);
            if (device_check(&e->dev[e->self], why, sizeof why) != 0) {
                proc_send_report(e, -1);
                return proc_fail(e, why, err, errlen);
            }
            e->stats.steps++;
            e->stats.tokens += (uint64_t)total;
        } else if (kind != PLAN_PING) {
            return proc_fail(e, "rank 0 sent an unknown plan", err, errlen);
        }
        if (proc_send_report(e, 0) != 0) return proc_fail(e, "", err, errlen);
    }
}

struct comm *engine_comm_nccl_world(int world, int rank, int gpu, const char *master_addr,
                                    int master_port, int timeout_ms, char *err, size_t errlen)
{
#if defined(MOESERVE_HAVE_CUDA) && defined(MOESERVE_HAVE_NCCL)
    /* rank 0 serves the NCCL id on every address; the others fetch it from master_addr */
    struct comm *c = comm_nccl_create_world(world, world, rank, 1, &gpu,
                                            rank == 0 ? NULL : master_addr, master_port,
                                            timeout_ms, err, errlen);
    /* every exchange bounded like the control messages: a dead peer fails the step */
    if (c && comm_nccl_set_timeout(c, timeout_ms, err, errlen) != 0) {
        c->ops->destroy(c);
        return NULL;
    }
    return c;
#else
    (void)world, (void)rank, (void)gpu, (void)master_addr, (void)master_port, (void)timeout_ms;
    ms_errf(err, errlen, "GPUs across processes need CUDA and NCCL, and this build has %s",
            engine_has_cuda() ? "no NCCL" : "no CUDA");
    return NULL;
#endif
}
