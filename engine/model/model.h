/* Model: one description (struct model_desc) that covers every supported MoE architecture, and
 * the weights bound to it. The forward pass (forward.c) reads only the description and never
 * the architecture name, so adding an architecture means teaching model_config.c to fill the
 * description and model_load.c where its tensors live, not writing another forward pass.
 *
 * Weights stay in the checkpoint's dtype: every matrix is a struct wmat (kernels/weights.h)
 * borrowed from the safetensors mapping (f32/f16/bf16, zero copy), unless the load options ask
 * for another type (--dtype float32|bfloat16: one conversion at load) or for quantization
 * (--quantization int8|int4: attention, experts, dense FFNs and the LM head quantized once at
 * load; embeddings, routers and norms stay as they are; experts published in MXFP4 are repacked
 * into WTYPE_MXFP4 and stay 4-bit, or are dequantized exactly for --dtype float32|bfloat16).
 * Vectors (norms, biases) are f32,
 * converted when stored otherwise. Every pointer below stays valid until model_free.
 *
 * Ownership: model_load returns a model the caller frees with model_free. A model is read-only
 * after loading and is shared by every device thread. */
#ifndef MOESERVE_MODEL_H
#define MOESERVE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"
#include "tokenizer.h"
#include "weights.h"

enum attn_kind {
    ATTN_KIND_GQA, /* multi/grouped-query attention with RoPE (MHA when n_kv_head == n_head) */
    ATTN_KIND_MLA, /* DeepSeek multi-head latent attention: a compressed KV latent per token */
    ATTN_KIND_V4,  /* DeepSeek-V4: sliding / compressed attention per layer (model_desc.v4_attn) */
};

enum qk_norm_kind {
    QK_NORM_NONE,
    QK_NORM_HEAD, /* RMSNorm over each head's head_dim (qwen3_moe); weight (head_dim) */
    QK_NORM_FULL, /* RMSNorm over the whole q (n_head*head_dim) / k (n_kv_head*head_dim) (olmoe) */
    QK_NORM_HEAD_POST, /* weightless RMSNorm over each head after RoPE, on RoPE layers only
                          (Llama 4's use_qk_norm) */
};

enum router_kind {
    ROUTER_KIND_SOFTMAX_TOPK,  /* softmax over experts, top-k; renormalize if norm_topk_prob */
    ROUTER_KIND_SIGMOID_GROUP, /* DeepSeek-V3 noaux_tc: sigmoid + correction bias, group-limited */
    ROUTER_KIND_SOFTMAX_GROUP, /* DeepSeek-V2 group_limited_greedy: softmax, groups by their best */
    ROUTER_KIND_MOHGE,         /* two-level: sigmoid group router, softmax inside groups */
    ROUTER_KIND_SIGMOID_TOPK,  /* Llama 4: top-k by logit, weights their sigmoids */
};

/* What a layer's FFN is when it is not a routed-expert (MoE) layer. */
enum ffn_kind {
    FFN_KIND_DENSE,      /* one SwiGLU of dense_d_ff */
    FFN_KIND_CONTINUOUS, /* infmoe continuous experts: a per-token slice of one SwiGLU of
                            cont_d_ff neurons chosen by samples of a Gaussian latent
                            (engine/infmoe.h); every layer of such a model */
};

/* The state-space layers of a hybrid model (model_desc.layer_linear). */
enum lin_kind {
    LIN_KIND_GDN = 0,    /* Gated DeltaNet */
    LIN_KIND_MAMBA2 = 1, /* Mamba2 (SSD) */
};

enum shared_gate_kind {
    SHARED_GATE_NONE,    /* shared experts always added with weight 1 */
    SHARED_GATE_SIGMOID, /* qwen2_moe: sigmoid(x . w_gate) scales the shared expert */
};

/* The activation of the experts' FFNs. */
enum ffn_act {
    FFN_ACT_SILU,       /* down(silu(gate x) * (up x)) */
    FFN_ACT_SWIGLU_OAI, /* gpt-oss: g = min(gate x, limit), u = clamp(up x, -limit, limit),
                           down(g * sigmoid(alpha g) * (u + 1)) */
    FFN_ACT_SILU_CLAMP, /* DeepSeek-V4: down(silu(min(gate x, limit)) * clamp(up x, -limit,
                           limit)), shared experts too */
};

/* DeepSeek-V4's attention per layer (model_desc.v4_attn; engine/v4.c). Every kind attends to
 * the last sliding_window positions (one key per token, which is also the value); the
 * compressed kinds also attend to entries that each pool v4_rate[kind] consecutive tokens. */
enum v4_attn_kind {
    V4_ATTN_SLIDING = 0, /* sliding_attention */
    V4_ATTN_CSA = 1,     /* compressed_sparse_attention: overlapping windows, the lightning
                            indexer picks dsa_topk entries per query */
    V4_ATTN_HCA = 2,     /* heavily_compressed_attention: every completed entry */
};

/* Router score functions (model_desc.router_score). */
enum router_score {
    ROUTER_SCORE_SIGMOID = 0,
    ROUTER_SCORE_SQRTSOFTPLUS = 1, /* DeepSeek-V4: sqrt(softplus(logit)) */
};

#define MODEL_MAX_EXPERTS 512
/* Far above any released model (126 layers at most so far); a config beyond it is refused
 * before anything per layer is allocated or looped over. */
#define MODEL_MAX_LAYERS 4096
#define MODEL_MAX_GROUPS 64
#define MODEL_MAX_EOS 8

struct model_desc {
    char model_type[32];
    int n_layer;
    int d_model;
    int vocab;
    int n_head;
    int n_kv_head;
    int head_dim;
    int max_pos;          /* max_position_embeddings */
    float rms_eps;
    float rope_theta;
    /* RoPE: the first rope_dim dims of each rotated part turn in pairs (j, j + rope_dim/2), or
     * (2j, 2j + 1) when rope_interleave (DeepSeek). Frequencies are theta^(-2j/rope_dim), or
     * YaRN's blend of those and of their 1/yarn_factor interpolation when rope_yarn; cos and
     * sin are multiplied by rope_attn_factor (YaRN's attention factor, else 1). */
    int rope_dim;
    bool rope_interleave;
    bool rope_yarn;
    float yarn_factor;
    float yarn_beta_fast, yarn_beta_slow;
    int yarn_orig_max_pos;
    bool yarn_truncate;
    float yarn_mscale_all_dim;
    float rope_attn_factor;
    float attn_scale;     /* softmax scale: 1/sqrt(q.k width), times YaRN's mscale^2 (MLA) */
    int sliding_window;   /* 0 = full attention */
    int *layer_window;    /* (n_layer) each layer's window (0 = full; gpt-oss layer_types), or
                             NULL: sliding_window for every layer (see model_layer_window) */
    enum attn_kind attn;
    enum qk_norm_kind qk_norm;
    bool qkv_bias;
    bool o_bias;          /* o_proj has a bias (gpt-oss) */
    bool attn_sinks;      /* a learned logit per head in the softmax denominator (gpt-oss) */
    float clip_qkv;       /* olmoe: clamp q/k/v projections to [-clip, clip]; 0 = off */
    bool tie_embeddings;

    /* Multi-head latent attention (ATTN_KIND_MLA, DeepSeek-V2/V3). Per token a latent of
     * kv_lora_rank values (RMS-normed) and one rope key of qk_rope_dim values shared by all
     * heads are cached; head_dim is the query/key width qk_nope_dim + qk_rope_dim and
     * n_kv_head = n_head. */
    int q_lora_rank;      /* 0: q_proj straight from the hidden state */
    int kv_lora_rank;
    int qk_nope_dim;
    int qk_rope_dim;
    int v_head_dim;
    /* DeepSeek sparse attention (deepseek_v32; backend.h struct be_dsa): each query attends to
     * the dsa_topk cached positions its lightning indexer scores best (dsa_heads heads of
     * dsa_dim); the index key is cached after the latent and rope key. 0: dense MLA. */
    int dsa_topk, dsa_heads, dsa_dim;
    bool dsa_rope_interleave; /* the indexer's RoPE: GLM-5 interleaved, V3.2 rotate-half */
    bool *dsa_shared;         /* (n_layer) GLM-5: the layer has no indexer and attends to what
                                 the last full one selected; NULL: every layer full */

    /* DeepSeek-V4 (model_type deepseek_v4; engine/v4.h). The residual is v4_hc streams of
     * d_model mixed by manifold-constrained hyper-connections (v4_hc_iters Sinkhorn steps,
     * v4_hc_eps); attention is one shared key/value head of head_dim (q through q_lora_rank),
     * a sink per head, interleaved RoPE on the last rope_dim of each head (rope_theta on sliding
     * layers, v4_compress_theta on compressed ones), and a grouped output projection (o_groups
     * groups of o_lora_rank). The CSA indexer is dsa_heads x dsa_dim keeping dsa_topk entries.
     * v4_attn NULL: not a V4 model. */
    uint8_t *v4_attn;         /* (n_layer) enum v4_attn_kind */
    int v4_rate[3];           /* compression rate per enum v4_attn_kind (0 for sliding) */
    int v4_hc, v4_hc_iters;
    float v4_hc_eps;
    float v4_compress_theta;
    int o_groups, o_lora_rank;
    bool *layer_hash;         /* (n_layer) hash_moe: experts by tid2eid[token], or NULL */
    enum router_score router_score;

    /* MoE. Layer l is an MoE layer when layer_is_moe[l]; otherwise it has a dense SwiGLU FFN
     * of width dense_d_ff. */
    bool *layer_is_moe;   /* (n_layer) */
    int dense_d_ff;
    int n_expert;
    int top_k;            /* default experts per token; a sequence may ask for fewer */
    bool norm_topk_prob;
    enum router_kind router;
    int *expert_d_ff;     /* (n_expert) FFN width of each routed expert */
    int n_group;          /* MoHGE / DeepSeek groups (0 = none) */
    int topk_group;       /* groups kept per token */
    int *expert_group;    /* (n_expert) group of each expert, or NULL */
    float routed_scale;   /* routed_scaling_factor: routed expert weights times this (1) */
    bool router_bias;     /* DeepSeek-V3: per-expert e_score_correction_bias */
    bool router_logit_bias; /* gpt-oss: the router's linear layer has a bias (on the logits) */
    enum ffn_act expert_act;/* routed experts' activation; dense and shared FFNs are SiLU */
    float act_alpha, act_limit; /* FFN_ACT_SWIGLU_OAI */
    bool expert_bias;     /* routed experts' projections have biases (gpt-oss) */
    /* Continuous experts (ffn == FFN_KIND_CONTINUOUS, infmoe; engine/infmoe.h): per token the
     * router predicts a Gaussian over a latent z of cont_z values; each of K samples keeps the
     * N = infmoe_neurons_kept(fraction) neurons whose keys score highest against it, and the
     * K slices are averaged. K and the fraction are a per-request budget within the bounds. */
    enum ffn_kind ffn;
    int cont_d_ff;        /* F: neurons of the layer's FFN */
    int cont_z;           /* Z */
    int cont_samples;     /* default K (the trained one) */
    int cont_max_samples; /* the largest K a request may ask for */
    double cont_fraction; /* default neuron fraction (the trained one), also the largest */
    /* The adaptive budget's calibration (config adaptive_logvar_quantiles; engine/infmoe.h):
     * per layer, cont_n_quant ascending quantiles of the tokens' mean predicted log-variance;
     * NULL (cont_n_quant 0) when the config has none. */
    int cont_n_quant;
    double *cont_quant;   /* (n_layer, cont_n_quant) */
    int n_shared;         /* always-on shared experts */
    int shared_d_ff;      /* width of each shared expert */
    enum shared_gate_kind shared_gate;
    bool shared_merged;   /* DeepSeek / GLM: the n_shared_experts are stored as one FFN of their
                             summed width under "mlp.shared_experts." (n_shared is then 1) */
    /* Multi-token-prediction layers (DeepSeek-V3 / GLM num_nextn_predict_layers) stored after
     * the decoder layers, at model.layers.n_layer..: bound only when the load options ask for
     * them (model_load_opts.mtp: speculative decoding with method mtp, struct model_mtp);
     * otherwise skipped (never read) and the load note says so. */
    int n_mtp_layers;

    /* Hybrid models: layer l mixes tokens with a state-space layer instead of attention when
     * layer_linear[l], of one kind for the model (lin_kind). Per sequence such a layer keeps a
     * recurrent state (engine/kv_cache.h's state slots): the last lin_conv - 1 inputs of its
     * causal conv1d over conv_dim = 2 * lin_nk * lin_dk + lin_nv * lin_dv channels, and an
     * lin_dk x lin_dv state per head.
     *   Gated DeltaNet (qwen3_next, qwen3_5_moe): lin_nk key heads of lin_dk, lin_nv value heads
     *   of lin_dv (value head j reads key head j / (lin_nv / lin_nk)); the channels are q, k, v.
     *   Mamba2 (granitemoehybrid): lin_nv heads of lin_dv (head_dim), lin_nk groups with states
     *   of lin_dk (d_state); the channels are x, B, C; head h reads group h / (lin_nv / lin_nk).
     * NULL when no layer is. */
    bool *layer_linear;   /* (n_layer) or NULL */
    int n_linear;         /* layers with layer_linear set */
    enum lin_kind lin_kind;
    int lin_nk, lin_nv;   /* key heads / groups, value heads / heads */
    int lin_dk, lin_dv;   /* their widths: key head / d_state, value head / head_dim */
    int lin_conv;         /* conv1d kernel width */
    bool lin_conv_bias;   /* Mamba2: the conv1d has a bias */
    bool lin_proj_bias;   /* Mamba2: in_proj and out_proj have biases */
    float lin_dt_min, lin_dt_max; /* Mamba2: the step's clamp (time_step_limit) */
    bool lin_fused_in;    /* qwen3_next: in_proj_qkvz / in_proj_ba, each key head's q, k, v, z
                             (and b, a) together; else in_proj_qkv / _z / _b / _a */
    bool norm_plus_one;   /* the RMSNorms (layers, final, q/k) scale by 1 + w, not w (the
                             loader stores 1 + w) */
    bool attn_out_gate;   /* q_proj gives each head's query, then as many gate logits: the
                             attention output is multiplied by their sigmoid (qwen3_next) */
    char wprefix[32];     /* the text model's tensors: "model." or, in a multimodal folder,
                             "model.language_model." (as transformers saves it) or
                             "language_model.model." (Kimi-K2.5 as Moonshot publishes it) */
    char lm_head_name[48];/* "lm_head.weight", or "language_model.lm_head.weight" */
    char wlayers[8];      /* the decoder layers under wprefix: "layers." or, as transformers 5.25
                             saves Kimi-K2.5, "blocks." */
    bool nope;            /* attention layers use no rotary embedding (Granite 4.0-H) */
    bool *layer_nope;     /* (n_layer) layers without rotary embedding (Llama 4's
                             no_rope_layers 0), or NULL (see model_layer_nope) */
    int *layer_chunk;     /* (n_layer) chunked local attention per layer (Llama 4's
                             attention_chunk_size on its chunked_attention layers; 0 = none), or
                             NULL */
    /* Llama 4's attention temperature tuning on its NoPE layers: q *= 1 + temp_scale *
     * log1p(floor((pos + 1) / temp_floor)). */
    bool attn_temp_tuning;
    float temp_scale;
    int temp_floor;
    /* Llama 3-style RoPE scaling (rope_type llama3; Llama 4): frequencies below
     * original_max_position_embeddings' wavelength divided by factor, high ones kept, a
     * smooth blend between (low_freq_factor, high_freq_factor). */
    bool rope_llama3;
    float llama3_factor, llama3_low, llama3_high;
    int llama3_orig_max_pos;
    bool router_scales_input; /* Llama 4: each routed expert gets the token times its weight
                                 and its output is added with weight 1 */
    /* Granite's multipliers (1 elsewhere): the embeddings times embed_scale, each block's
     * output times residual_scale before its residual add, the logits times logit_scale
     * (1 / logits_scaling). The softmax scale is attn_scale (attention_multiplier). */
    float embed_scale, residual_scale, logit_scale;

    int32_t bos_id;                /* -1 when none */
    int32_t eos_ids[MODEL_MAX_EOS];/* from generation_config.json / config.json */
    int n_eos;
};

/* One gated FFN: down(act(gate x + b_gate, up x + b_up)) + b_down (enum ffn_act). */
struct ffn_w {
    int d_ff;
    const struct wmat *gate; /* (d_ff, d_model) */
    const struct wmat *up;   /* (d_ff, d_model) */
    const struct wmat *down; /* (d_model, d_ff) */
    const float *b_gate;     /* (d_ff) or NULL (expert_bias only) */
    const float *b_up;       /* (d_ff) or NULL */
    const float *b_down;     /* (d_model) or NULL */
};

struct layer_w {
    const float *attn_norm; /* (d_model) */
    const struct wmat *wq;  /* (n_head*head_dim, d_model) */
    const struct wmat *wk;  /* (n_kv_head*head_dim, d_model) */
    const struct wmat *wv;  /* (n_kv_head*head_dim, d_model) */
    const struct wmat *wo;  /* (d_model, n_head*head_dim) */
    const float *bq;        /* (n_head*head_dim) or NULL */
    const float *bk;        /* (n_kv_head*head_dim) or NULL */
    const float *bv;        /* (n_kv_head*head_dim) or NULL */
    const float *bo;        /* (d_model) or NULL */
    const float *sinks;     /* (n_head) attention sink logits, or NULL */
    const float *q_norm;    /* (head_dim) or (n_head*head_dim), per qk_norm; or NULL */
    const float *k_norm;    /* (head_dim) or (n_kv_head*head_dim), per qk_norm; or NULL */
    const float *ffn_norm;  /* (d_model) */

    /* MLA (the GQA fields above unused but wo, which is (d_model, n_head*v_head_dim)): */
    const struct wmat *wq_a;    /* (q_lora_rank, d_model), or NULL (wq is then the q_proj) */
    const float *q_a_norm;      /* (q_lora_rank) */
    const struct wmat *wq_b;    /* (n_head*head_dim, q_lora_rank) */
    const struct wmat *wkv_a;   /* (kv_lora_rank + qk_rope_dim, d_model) latent and rope key */
    const float *kv_a_norm;     /* (kv_lora_rank) */
    const struct wmat *wkv_b;   /* (n_head*(qk_nope_dim + v_head_dim), kv_lora_rank): head h's
                                   key up-projection, then its value up-projection */
    const struct wmat *w_uk_t;  /* (n_head*kv_lora_rank, qk_nope_dim): each head's key
                                   up-projection transposed, to absorb it into the query */
    /* DeepSeek sparse attention's indexer (model_desc dsa_*): */
    const struct wmat *idx_wq_b;  /* (dsa_heads*dsa_dim, q_lora_rank) index queries */
    const struct wmat *idx_wk;    /* (dsa_dim, d_model) index key */
    const float *idx_k_norm;      /* (dsa_dim) its LayerNorm weight */
    const float *idx_k_norm_b;    /* (dsa_dim) and bias */
    const struct wmat *idx_wproj; /* (dsa_heads, d_model) per-head weights */

    /* DeepSeek-V4 (model_desc.v4_attn; hc = v4_hc, R = o_groups * o_lora_rank; the query
     * projections are wq_a, q_a_norm and wq_b above, the sinks above): */
    const struct wmat *v4_wkv;       /* (head_dim, d_model) the shared key/value */
    const float *v4_kv_norm;         /* (head_dim) */
    const struct wmat *v4_wo_a;      /* (R, n_head*head_dim/o_groups): group g's rows from
                                        g*o_lora_rank */
    const struct wmat *v4_wo_b;      /* (d_model, R) */
    const struct wmat *hc_fn[2];     /* (hc*(2+hc), hc*d_model) attention's and the FFN's mixes */
    const float *hc_base[2];         /* (hc*(2+hc)) */
    const float *hc_scale[2];        /* (3) pre, post, comb */
    /* the compressor (CSA: c = 2 head_dim, overlapping; HCA: c = head_dim) and, CSA only, the
     * indexer's (c = 2 dsa_dim): */
    const struct wmat *cmp_wkv[2];   /* (c, d_model) [0] compressor, [1] indexer */
    const struct wmat *cmp_wgate[2]; /* (c, d_model) */
    const float *cmp_bias[2];        /* (rate, c) position_bias */
    const float *cmp_norm[2];        /* (head_dim) / (dsa_dim) kv_norm */
    const int32_t *tid2eid;          /* (vocab, top_k) hash_moe layers' experts per token id */

    const struct wmat *router;       /* (n_expert, d_model) */
    const float *router_bias;        /* (n_expert) DeepSeek-V3 correction bias, or NULL */
    const float *router_b;           /* (n_expert) gpt-oss router bias on the logits, or NULL */
    const struct wmat *group_router; /* (n_group, d_model), MoHGE only */
    struct ffn_w *experts;           /* (n_expert) */
    struct ffn_w *shared;            /* (n_shared) */
    const struct wmat *shared_gate;  /* (1, d_model), SHARED_GATE_SIGMOID only */
    struct ffn_w dense;              /* dense layers only */

    /* FFN_KIND_CONTINUOUS (infmoe) layers: */
    const struct wmat *cont_router;  /* (2*cont_z, d_model): mean, then log-variance of z */
    const float *cont_router_b;      /* (2*cont_z) */
    const struct wmat *cont_keys;    /* (cont_d_ff, cont_z) one key per neuron */
    const struct wmat *cont_gate;    /* (cont_d_ff, d_model) */
    const struct wmat *cont_up;      /* (cont_d_ff, d_model) */
    const struct wmat *cont_down_t;  /* (cont_d_ff, d_model): the down projection neuron-major,
                                        so a neuron's output weights are one row */

    /* State-space layers (layer_linear). The input projections: Gated DeltaNet's fused per key
     * head (lin_fused_in: lin_in[0] = in_proj_qkvz (2*nk*dk + 2*nv*dv rows), lin_in[1] =
     * in_proj_ba (2*nv)) or apart (in_proj_qkv (conv_dim), _z (nv*dv), _b (nv), _a (nv));
     * Mamba2's one in_proj (lin_in[0]: z (nv*dv), x|B|C (conv_dim), dt (nv)). */
    const struct wmat *lin_in[4];
    const float *lin_in_b;           /* Mamba2: in_proj's bias, or NULL */
    const float *lin_conv_w;         /* (conv_dim, lin_conv) depthwise conv1d */
    const float *lin_conv_b;         /* (conv_dim) or NULL */
    const float *lin_a_log;          /* (nv) A_log: the decay rate is -exp(A_log) */
    const float *lin_dt_bias;        /* (nv) */
    const float *lin_d;              /* Mamba2: (nv) the skip D */
    const float *lin_norm;           /* the gated RMSNorm's weight (plain w): (dv) Gated
                                        DeltaNet, per head; (nv*dv) Mamba2, per group */
    const struct wmat *lin_out;      /* (d_model, nv*dv) out_proj */
    const float *lin_out_b;          /* Mamba2: out_proj's bias, or NULL */
};

/* What activations and unquantized weights compute in (vLLM's --dtype). Matrix products
 * always accumulate in f32; everything outside them (norms, attention, residual stream) is f32.
 * "bf16 activations" means the inputs of products with bf16 weights are rounded to bf16 (and
 * multiplied with AVX512-BF16 dot products where the CPU has them). */
enum model_dtype {
    MODEL_DTYPE_AUTO = 0, /* the checkpoint's dtype: weights as stored; a bf16 checkpoint
                             computes with bf16 activations, f32 and f16 ones with f32 */
    MODEL_DTYPE_BF16 = 1, /* weights bf16 (converted if stored otherwise), bf16 activations */
    MODEL_DTYPE_F32 = 2,  /* weights converted to f32; f32 throughout (the reference) */
};

/* Weight quantization at load (vLLM's --quantization). */
enum model_quant {
    MODEL_QUANT_NONE = 0,
    MODEL_QUANT_INT8 = 1, /* WTYPE_Q8 */
    MODEL_QUANT_INT4 = 2, /* WTYPE_Q4 */
};

/* "auto" / "bfloat16" / "float32" (also "bf16", "f32", "float"); 0, or -1 for another name. */
int model_dtype_parse(const char *s, enum model_dtype *out);
const char *model_dtype_name(enum model_dtype d);
/* "none" / "int8" / "int4"; 0, or -1. */
int model_quant_parse(const char *s, enum model_quant *out);
const char *model_quant_name(enum model_quant q);

/* One multi-token-prediction module: DeepSeek-V3's MTP as DeepSeek-V3 and GLM-4.5+ publish it
 * under model.layers.{n_layer + i}. (enorm, hnorm, eh_proj, shared_head.norm/.head), or as
 * Qwen3-Next and Qwen3.5 publish it under mtp. (pre_fc_norm_embedding, pre_fc_norm_hidden, fc,
 * layers.{i}, norm; the model's lm_head). From the main model's last hidden state h_i at
 * position i (after its final norm: what its LM head reads, and what vLLM and SGLang hand their
 * MTP modules) and the embedding of the token at i + 1,
 *   x = eh_proj [enorm(embed(t_{i+1})) ; hnorm(h_i)]
 * runs one decoder block (attention of the model's kind at position i, then an MoE or dense
 * FFN) and its output, normed by head_norm and multiplied by head, predicts t_{i+2}. When drafts
 * are chained, its output stands in for h_{i+1}: before head_norm (DeepSeek's layout) or after
 * it (Qwen's, chain_normed), as vLLM chains them. */
struct model_mtp {
    const float *enorm;          /* (d_model) */
    const float *hnorm;          /* (d_model) */
    const struct wmat *eh_proj;  /* (d_model, 2 d_model): embedding half first */
    const float *head_norm;      /* (d_model) */
    const struct wmat *head;     /* (vocab, d_model) shared_head.head, or NULL: the lm_head */
    bool moe;                    /* the block's FFN is routed experts (else dense) */
    bool chain_normed;           /* chained drafts read the output after head_norm */
    struct layer_w layer;
};

struct model {
    struct model_desc desc;
    const struct wmat *embed;   /* (vocab, d_model) */
    const float *norm;          /* (d_model) final norm */
    const struct wmat *lm_head; /* (vocab, d_model); == embed when tied and unquantized */
    /* DeepSeek-V4's final collapse of its hc streams (hc_head): */
    const struct wmat *hc_head_fn;  /* (hc, hc*d_model) */
    const float *hc_head_base;      /* (hc) */
    const float *hc_head_scale;     /* (1) */
    struct layer_w *layers;     /* (n_layer) */
    /* (desc.n_mtp_layers) when loaded with model_load_opts.mtp, else NULL (n_mtp 0) */
    struct model_mtp *mtp;
    int n_mtp;
    /* A view (model_mtp_view): the MTP module's fusion, which the engine applies after the
     * embedding to each token's given hidden state (engine_item.hidden_in); NULL otherwise. */
    const struct model_mtp *mtp_in;

    struct tokenizer *tok;  /* NULL only when the folder has no tokenizer.json and the caller
                               allowed it (model_load_opts.require_tokenizer = false) */
    char *chat_template;    /* from tokenizer_config.json, or NULL */
    char *dir;

    enum model_dtype dtype;  /* as loaded */
    enum model_quant quant;

    /* owned storage */
    struct st_archive *st;
    struct wmat *mats;       /* (n_mats) every matrix the layers point at */
    int n_mats;
    void *converted;         /* one block for every matrix converted or quantized at load */
    size_t converted_bytes;
    float *vectors;          /* one block for norms and biases converted to f32 */
    size_t vector_floats;
    void *arena;             /* layers, experts, desc arrays */
    size_t n_params;         /* parameters in the checkpoint that the model uses */
    size_t weight_bytes;     /* bytes of every matrix and vector as held in memory */
    void *cache_map;         /* `converted` is this mapping of a weight-cache file, or NULL */
    size_t cache_map_len;
    char cache_note[640];    /* what the weight cache did ("" when not asked), for logs */
    char skip_note[160];     /* checkpoint layers skipped at load (MTP layers), or "": for
                                logs */
    /* Ablation (mohge_eval --ablate; NULL otherwise): (n_layer, n_expert), nonzero where the
     * router may never pick that expert (its logit is -inf; a MoHGE group whose every expert is
     * ablated in a layer gets a -inf group logit too). CPU backends only. malloc'd, owned. */
    uint8_t *ablated;
};

struct model_load_opts {
    bool require_tokenizer; /* default true */
    enum model_dtype dtype;  /* default auto */
    enum model_quant quant;  /* default none */
    bool mtp;                /* bind the checkpoint's MTP layers (struct model_mtp); a folder
                                without any is not an error (model.n_mtp says) */
    bool cache;              /* keep converted / quantized weights in DIR/.moeserve/ and map
                                them from there at the next load (default false) */
    int threads;             /* conversion threads; 0 = the online CPUs */
    /* Called while weights are converted/checked with done/total in [0, 1]; may be NULL. */
    void (*progress)(void *ctx, double fraction);
    void *progress_ctx;
};

void model_load_opts_default(struct model_load_opts *o);

/* Loads a Hugging Face model folder: config.json (architecture), safetensors weights (single
 * file or sharded with an index), tokenizer.json + tokenizer_config.json, generation_config.json.
 * Errors name the file and tensor: missing file, unknown model_type, missing tensor, wrong shape
 * ("expected (64, 128), found (64, 96)"), unsupported dtype, corrupt safetensors. */
int model_load(const char *dir, const struct model_load_opts *opts, struct model **out, char *err,
               size_t errlen);
void model_free(struct model *m);

/* Parses a config.json document (already read into memory) into desc. Fills everything that
 * does not need the weights. Exposed for tests. desc arrays are allocated with malloc and
 * released by model_desc_free. */
int model_desc_parse(const char *json_text, size_t len, const char *path, struct model_desc *desc,
                     char *err, size_t errlen);
void model_desc_free(struct model_desc *desc);
/* Overrides desc's bos_id / eos_ids with those of a generation_config.json document where it
 * sets them (eos_token_id: an integer or a list). desc is unchanged on failure. */
int model_desc_apply_generation_config(struct model_desc *desc, const char *json_text, size_t len,
                                       const char *path, char *err, size_t errlen);

/* A model made of MTP module i of m (m->n_mtp > i), to run in an engine of its own as a draft
 * model: one layer (the module's block), the module's head norm and head, m's embedding, and
 * mtp_in set so that the engine fuses each token's embedding with the target's hidden state
 * given with it. The view borrows m's weights (m must outlive it) and owns only small
 * description arrays: free it with model_mtp_view_free, never model_free. 0, or -1 (out of
 * memory). */
int model_mtp_view(const struct model *m, int i, struct model *out);
void model_mtp_view_free(struct model *view);

/* Active parameters per token at top-k `k` (for FLOP and bandwidth accounting): attention,
 * norms, routers, shared/dense FFNs, the k widest routed experts of each MoE layer, the final
 * norm and lm_head; the embedding table is left out (one row is read per token). k is clamped
 * to [0, n_expert]. */
size_t model_active_params(const struct model *m, int k);
/* Whether the model computes in bf16 (see enum model_dtype): --dtype bfloat16, or auto with
 * bf16 matrices. */
bool model_computes_bf16(const struct model *m);

/* Continuous experts: the neurons one sample keeps at neuron fraction f,
 * max(1, floor(f * cont_d_ff + 1/2)) and at most cont_d_ff (tools/train/infmoe_model.py's
 * neurons_kept), and the most a token can compute with k samples (k slices, no overlap). */
static inline int model_cont_neurons(const struct model_desc *md, double f)
{
    double x = f * (double)md->cont_d_ff + 0.5;
    int n = x >= (double)md->cont_d_ff ? md->cont_d_ff : (int)x;
    return n < 1 ? 1 : n;
}
static inline int model_cont_union_max(const struct model_desc *md, int k, double f)
{
    long u = (long)k * model_cont_neurons(md, f);
    return u > md->cont_d_ff ? md->cont_d_ff : (int)u;
}

/* Whether attention layer l uses no rotary embedding. */
static inline bool model_layer_nope(const struct model_desc *md, int l)
{
    return md->nope || (md->layer_nope && md->layer_nope[l]);
}

/* The attention window of layer l (0 = full attention). */
static inline int model_layer_window(const struct model_desc *md, int l)
{
    return md->layer_window ? md->layer_window[l] : md->sliding_window;
}

/* DeepSeek-V4's cache row of one token in a layer of kind `kind` (enum v4_attn_kind; offsets
 * in elements; engine/v4.h): the rotated key, which is also the value (head_dim), first; a
 * compressed layer then keeps the token's compressor kv and gate projections (c each: 2
 * head_dim on CSA, whose windows overlap, head_dim on HCA), and the compressed entry the token
 * completes (head_dim; zeros unless its position closes a window); CSA then the indexer's kv
 * and gate (2 dsa_dim each) and its entry (dsa_dim). Every entry is a function of its
 * sequence's rows, so prefix caching, preemption and chunked prefill need nothing else. */
struct model_v4_row {
    int ckv, cgate, cent; /* compressor: kv, gate, entry (0: none) */
    int ikv, igate, ient; /* CSA indexer (0: none) */
    int c, width;         /* compressor channels, the row's elements */
};
static inline struct model_v4_row model_v4_row(const struct model_desc *md, int kind)
{
    struct model_v4_row r = {0, 0, 0, 0, 0, 0, 0, md->head_dim};
    if (kind == V4_ATTN_SLIDING) return r;
    r.c = (kind == V4_ATTN_CSA ? 2 : 1) * md->head_dim;
    r.ckv = md->head_dim;
    r.cgate = r.ckv + r.c;
    r.cent = r.cgate + r.c;
    r.width = r.cent + md->head_dim;
    if (kind != V4_ATTN_CSA) return r;
    r.ikv = r.width;
    r.igate = r.ikv + 2 * md->dsa_dim;
    r.ient = r.igate + 2 * md->dsa_dim;
    r.width = r.ient + md->dsa_dim;
    return r;
}

/* Elements one token stores per layer in the KV cache: keys k_row and values v_row
 * (n_kv_head * head_dim each; MLA: the latent and rope key, kv_lora_rank + qk_rope_dim, and no
 * values; DeepSeek-V4: the widest model_v4_row of its layers, and no values). */
void model_kv_rows(const struct model_desc *md, int *k_row, int *v_row);
/* KV cache bytes per token over all layers (f32 cache). */
size_t model_kv_bytes_per_token(const struct model_desc *md);

/* Bytes of weights one decode token reads at top-k `k`, as the model holds them in memory
 * (its dtype or quantization): what model_active_params counts, one embedding row included. */
size_t model_active_bytes(const struct model *m, int k);

#endif
