/* DeepSeek-V4's decoder pieces (transformers' DeepseekV4 classes), run by engine.c's forward
 * pass for models with model_desc.v4_attn: the hyper-connections that keep v4_hc residual
 * streams per token and collapse / expand them around each attention and FFN block, and the
 * attention block itself (sliding window, CSA or HCA per layer; model.h enum v4_attn_kind).
 *
 * The cache: each token's row (model.h model_v4_row) holds its rotated key (the value too), and
 * on compressed layers its compressor and indexer projections and the entry it completes. A
 * step writes its tokens' rows, pools the windows they close into entries from the cached rows
 * (v4_compress), writes the rows again with those entries, then attends. So prefill in one
 * step, in chunks, or token by token computes the same entries from the same rows, and the
 * partial window at the end of a sequence is never approximated: it is simply not an entry
 * until its last token arrives (transformers' buffer).
 *
 * Ownership: struct v4_scratch is the device's, made by v4_scratch_init and freed by
 * v4_scratch_release; nothing here allocates per step. */
#ifndef MOESERVE_V4_H
#define MOESERVE_V4_H

#include "backend.h"
#include "model.h"

/* Per-device buffers (backend memory), T = max_batch_tokens. */
struct v4_scratch {
    float *xs, *xs2;     /* (T, hc, d_model) the streams, and the next ones */
    float *xn;           /* (T, hc * d_model) flattened streams, RMS-normed */
    float *mix;          /* (T, hc * (2 + hc)) */
    float *post;         /* (T, hc) */
    float *comb;         /* (T, hc, hc) */
    float *ones;         /* (max(hc * d_model, head_dim)) weights of the weightless norms */
    int32_t *expand;     /* (T * hc) row r of the streams copies token r / hc */
    float *row;          /* (T, k_row) the cache rows of the step */
    float *qr;           /* (T, q_lora_rank) the query latent */
    float *og;           /* (T, o_groups * o_lora_rank) grouped output projection */
    const float *tab[4]; /* RoPE tables (max_len, rope_dim / 2, 2): main, main inverse (-sin),
                            compress, compress inverse */
    int k_row;
};

/* What one device's step hands the V4 pieces: every pointer is backend memory but tk (HOST). */
struct v4_step {
    struct backend *be;
    const struct model *w; /* the weights as the device holds them */
    struct v4_scratch *s;
    int n;              /* tokens of the step on this device */
    const int32_t *pos; /* (n) */
    const struct be_tokens *tk;
    const struct be_kv *kvl; /* (n_layer) */
    int block_size;
    float *q, *att;       /* (T, n_head * head_dim) */
    float *iq, *iw;       /* (T, dsa_heads * dsa_dim), (T, dsa_heads) */
    int32_t *sel, *sel_n; /* (T, dsa_topk), (T) */
};

/* Host RoPE tables for max_len positions (free with free): tabs[0..3] as v4_scratch.tab; the
 * compressed layers' with YaRN (md->rope_yarn) and its attention factor. inv_freq(md, theta,
 * yarn, j) gives pair j's frequency. 0, or -1 when out of memory. */
int v4_rope_tables(const struct model_desc *md, int max_len,
                   float (*inv_freq)(const struct model_desc *md, float theta, bool yarn, int j),
                   float *tabs[4]);
/* tabs: host tables uploaded into the scratch (the backend's alloc; bytes are the 4 tables). */
int v4_scratch_init(struct v4_scratch *s, struct backend *be, const struct model_desc *md,
                    int max_tokens, int max_len, float *const tabs[4]);
void v4_scratch_release(struct v4_scratch *s, struct backend *be);

/* x (n, d) embeddings -> every stream a copy. */
void v4_streams_begin(const struct v4_step *st, const float *x);
/* The streams collapsed for block `which` (0 attention, 1 FFN) of layer l into y (n, d);
 * the block's post and comb are kept for v4_streams_end. */
void v4_streams_collapse(const struct v4_step *st, int l, int which, float *y);
/* The streams after a block whose output is out (n, d). */
void v4_streams_end(const struct v4_step *st, const float *out);
/* The final collapse (hc_head) into y (n, d), before the model's norm. */
void v4_streams_head(const struct v4_step *st, float *y);

/* Layer l's attention of h (n, d; input_layernorm applied) into out (n, d), its tokens' rows
 * written to the layer's cache. */
void v4_attention_block(const struct v4_step *st, int l, const float *h, float *out);

/* The name of the first op V4 needs that the backend lacks (NULL where it has them all). */
const char *v4_backend_missing(const struct backend *be);

#endif
