/* Backend interface: the compute operations the forward pass needs, as a table of function
 * pointers behind an opaque handle (ggml-backend style). The CPU backend (kernels/cpu/) is the
 * reference and is always built; the CUDA backend (kernels/cuda/) implements the same table.
 *
 * Conventions: activations are row-major f32 tensors. Weight matrices (the `w` of matmul, the
 * embedding table, expert FFNs) are weight handles: a struct wmat (weights.h) made by
 * weight_upload from the model's host wmat, whose data the backend can read. The CPU backend's
 * handle is the host wmat itself (f32/f16/bf16 read in place, Q8/Q4 quantized); CUDA's is a
 * bf16 copy on the device, multiplied in bf16 with f32 accumulation. Norm weights and biases
 * are plain f32 tensors in backend memory. Pointers passed to an op belong to the backend's
 * memory (host memory for the CPU backend, device memory for CUDA), except where an argument
 * is marked HOST. Ops never allocate: scratch comes from the caller, workspace from reserve. A
 * backend instance belongs to one device thread and is not shared between threads (the CPU
 * backend runs its ops on a thread pool of its own).
 *
 * Ownership: backend_cpu_create returns a backend freed with backend->ops->destroy. */
#ifndef MOESERVE_BACKEND_H
#define MOESERVE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_types.h"
#include "weights.h"

struct backend;

/* Routing rule for the route op (the router kinds of engine/model/model.h that the engine runs). */
enum be_route_kind {
    BE_ROUTE_SOFTMAX_TOPK = 0, /* softmax over experts, top-k, optional renormalization */
    BE_ROUTE_MOHGE = 1,        /* two-level: sigmoid group top-kg, then experts (DESIGN.md) */
    BE_ROUTE_SIGMOID_GROUP = 2,/* DeepSeek-V3: sigmoid scores + correction bias, groups ranked
                                  by their two best, top-k in the kept groups, weights the
                                  unbiased scores (renormalized), times `scale` */
    BE_ROUTE_SOFTMAX_GROUP = 3,/* DeepSeek-V2 group_limited_greedy: softmax over experts, groups
                                  ranked by their best probability, top-k in the kept groups,
                                  weights the probabilities times `scale` */
    BE_ROUTE_SIGMOID_TOPK = 4, /* Llama 4: top-k by logit, weights their sigmoids times `scale` */
};

struct be_route {
    enum be_route_kind kind;
    int n_expert;
    int top_k;       /* slots per token (the model's k; a token may use fewer, see tok_k) */
    int n_group;     /* MoHGE */
    int topk_group;  /* MoHGE */
    int norm_topk;   /* softmax, sigmoid_group: renormalize the k kept weights */
    const float *bias; /* sigmoid_group: (n_expert) score correction, backend memory */
    float scale;     /* routed scaling factor (1 for the models without one; MoHGE ignores
                        it) */
    int score;       /* sigmoid_group's score of a logit: BE_SCORE_SIGMOID, or
                        BE_SCORE_SQRTSOFTPLUS (DeepSeek-V4) */
    /* DeepSeek-V4's hash routing (sigmoid_group only; backend memory, or NULL): token t's
     * experts are hash[ids[t] * top_k + j], weighted by their scores renormalized (plus 1e-20)
     * times scale; no bias, no groups. */
    const int32_t *hash; /* (vocab, top_k) */
    const int32_t *ids;  /* (n) the tokens' ids */
};

enum be_score {
    BE_SCORE_SIGMOID = 0,
    BE_SCORE_SQRTSOFTPLUS = 1, /* sqrt(softplus(x)), softplus linear past x = 20 as torch's */
};

/* An expert FFN's activation of (gate, up) -> hidden. */
enum be_act {
    BE_ACT_SILU = 0,        /* silu(g) * u */
    BE_ACT_SWIGLU_OAI = 1,  /* gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit),
                               g' * sigmoid(alpha g') * (u' + 1) */
    BE_ACT_SILU_CLAMP = 2,  /* DeepSeek-V4: silu(min(g, limit)) * clamp(u, -limit, limit) */
};

/* One expert's gated FFN: weight handles from weight_upload; biases (backend memory) added to
 * the gate and up projections before the activation and to the down projection's output. A
 * zero-initialized tail (NULL biases, BE_ACT_SILU) is the plain SwiGLU expert. */
struct be_expert {
    int d_ff;
    const struct wmat *gate; /* (d_ff, d) */
    const struct wmat *up;   /* (d_ff, d) */
    const struct wmat *down; /* (d, d_ff) */
    const float *b_gate;     /* (d_ff) or NULL */
    const float *b_up;       /* (d_ff) or NULL */
    const float *b_down;     /* (d) or NULL */
    enum be_act act;
    float alpha, limit;      /* BE_ACT_SWIGLU_OAI */
};

#define BE_MULTI_MAX 4

/* int32 values of neuron_ffn's optional iscratch for n tokens of `stride` neurons out of F:
 * per neuron a count and a start, then a (token, slot) pair per computed neuron. */
#define NEURON_ISCRATCH(n, stride, F) (2 * ((size_t)(F) + 1) + 2 * (size_t)(n) * (size_t)(stride))

/* What the ops of a step may ask for at most (reserve): the largest GEMM input, the rows of one
 * matmul or moe_experts call, the experts of one call, and the longest sequence. */
struct be_reserve {
    size_t max_elems;
    int max_rows;
    int max_experts;
    int max_ctx;
    int max_heads;   /* query heads sharing one KV head (MLA: all heads); 0 = up to 64 */
    int max_k_dim;   /* the widest attention key and value (per KV head; MLA: the latent row
                        and the latent), for attention's tiles; 0 = 256 */
    int max_v_dim;
    int max_kv_heads; /* KV heads of an attention call (MLA: 1); 0 = 1 */
    int dsa_dim;      /* > 0: the indexer's key width (DeepSeek sparse attention; its scratch
                         is sized for max_ctx positions) */
    int dsa_heads;    /* its query heads (0: 64) */
    int v4_row;       /* > 0: DeepSeek-V4's cache row (v4_attention, v4_compress; their scratch
                         is sized for max_heads heads and window + max_ctx keys) */
    int v4_window;
};

/* Geometry of one attention call. Query head h reads KV head h / (n_head / n_kv_head), whose
 * key is k_dim elements at offset kvh * k_dim of a K row (k_row elements per token) and whose
 * value is v_dim elements at offset kvh * v_dim of a V row (v_row elements). MLA passes one
 * KV head whose key is the cached [latent, rope key] row and whose value is the latent part of
 * the same row (struct be_kv's v == k). */
struct be_attn {
    int n_head, n_kv_head;
    int k_dim, v_dim;
    int k_row, v_row;
    int window;          /* > 0: only the last `window` positions */
    float scale;
    const float *sinks;  /* (n_head) a logit per head added to the softmax denominator (gpt-oss),
                            or NULL */
    int chunk;           /* > 0: chunked local attention (Llama 4): a position attends only to
                            the positions of its own chunk, [pos - pos % chunk, pos] */
    /* DeepSeek sparse attention: token i attends only to the sel_n[i] positions listed,
     * ascending, at sel + i * sel_stride (dsa_select's output); sel_n[i] < 0: to all of
     * [0, pos]. sel NULL: no selection. */
    const int32_t *sel, *sel_n;
    int sel_stride;
};

/* DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5). Each token's index key
 * (dim floats) is cached in its attention cache row at k_off (after MLA's latent and rope key;
 * MLA's row is one segment of k_row elements). Token i's score of cached position t <= pos is
 * sum_h w[i, h] * n_head^-0.5 * relu(scale * q[i, h] . key[t]), and it attends to the topk best
 * (all of [0, pos] while pos < topk). */
struct be_dsa {
    int n_head, dim;
    int k_off, k_row;
    int topk;
    float scale;
    /* > 1: DeepSeek-V4's compressed entries: entry j (the key at k_off of position
     * (j + 1) * rate - 1) for j < (pos + 1) / rate are scored instead of every position, and
     * sel lists entry numbers (sel_n -1 while there are at most topk) */
    int rate;
};

/* DeepSeek-V4's manifold-constrained hyper-connections over n_stream streams of d: from each
 * token's mixes (the streams flattened, RMS-normed without weight, times the layer's fn), with
 * m = mix * scale + base per part:
 *   pre = sigmoid(m_pre) + eps (n_stream), post = 2 sigmoid(m_post) (n_stream),
 *   comb = softmax(m_comb rows) + eps (n_stream x n_stream), columns then rows and columns
 *   normalized (each sum + eps) as transformers' Sinkhorn loop: iters - 1 more rounds. */
struct be_hc {
    int n_stream, iters;
    float eps;
    const float *base;  /* (n_stream * (2 + n_stream)); head: (n_stream) */
    const float *scale; /* (3): pre, post, comb; head: (1) */
};

/* DeepSeek-V4's compressor (struct model_v4_row): a position p with (p + 1) % rate == 0 closes
 * window w = (p + 1) / rate - 1, whose entry pools the kv projections (channels at kv_off of
 * the cache rows) of its tokens, weighted per channel by the softmax over the window of gate
 * (at gate_off) + bias[slot]. overlap (CSA): the rows hold 2 c channels; the entry pools the
 * second c of window w's tokens and the first c of window w - 1's (absent for w = 0) over
 * 2 rate slots. Then RMSNorm (norm, eps) and interleaved RoPE on its last rot_dim at position
 * w * rate (cos_sin). */
struct be_v4cmp {
    int rate, c, overlap;
    int kv_off, gate_off, k_row;
    const float *bias;    /* (rate, (overlap ? 2 : 1) * c) */
    const float *norm;    /* (c) */
    float eps;
    int rot_dim;
    const float *cos_sin; /* (max_pos, rot_dim / 2, 2) */
};

/* DeepSeek-V4 attention of one layer: one key per cached position (dim at offset 0 of a row of
 * k_row, also the value) over the last `window` positions, and, rate > 0, the compressed
 * entries (dim at ent_off of the row of position (j + 1) * rate - 1) j < (pos + 1) / rate, or
 * only those listed in sel (sel_n[i] >= 0, sel_stride apart; -1: all), in one softmax per head
 * with a sink logit. */
struct be_v4attn {
    int n_head, dim, k_row;
    int window, rate, ent_off;
    float scale;
    const float *sinks;  /* (n_head) */
    const int32_t *sel, *sel_n;
    int sel_stride;
};

/* One layer's paged K/V storage in backend memory, in its stored type: each position's K row
 * of k_row elements (and V row of v_row, struct be_attn) is cut into segments of k_grp
 * (v_grp), one per KV head, stored head-major within each block (kernels/kv_types.h
 * kv_seg_offset). */
struct be_kv {
    enum be_kv_type type;
    void *k, *v;            /* (n_blocks, k_row / k_grp, block_size, k_grp) and the same for v;
                               MLA: v == k (the value is the latent part of the key row) */
    float *k_sc, *v_sc;     /* BE_KV_INT8: (n_blocks, k_row / k_grp, block_size) a scale per
                               segment (and the same for v); NULL for other types */
    int k_grp, v_grp;       /* elements of one KV head's segment: its key or value (MLA: the
                               whole row, one segment) */
    float k_scale, v_scale; /* FP8: value = stored * scale (1 uncalibrated) */
};

/* The tokens of a paged-attention call (HOST struct of backend pointers): token i belongs to the
 * sequence whose block table (logical -> physical KV block) starts at
 * tables + seq[i] * table_stride, and sits at position pos[i]. seq NULL: every token uses
 * `tables`; pos NULL: token i is at position pos0 + i (a run of one sequence). */
struct be_tokens {
    const int32_t *tables;
    int table_stride;
    const int32_t *seq;
    const int32_t *pos;
    int pos0;
};

/* The sequences of a recurrent-layer call (HOST arrays of n entries): sequence i's tokens are
 * rows [tok0[i], tok0[i] + n_tok[i]) of the op's inputs, in position order, and its state is
 * slot slot[i] of the layer's state; fresh[i]: the sequence starts at position 0, so its state
 * starts from zero rather than from what the slot holds. */
struct be_seqs {
    int n;
    const int32_t *tok0, *n_tok, *slot;
    const uint8_t *fresh;
};

/* One Gated DeltaNet layer (qwen3_next, qwen3_5_moe): geometry, weights and recurrent state,
 * all in backend memory. conv_dim = 2 * n_k_head * k_dim + n_v_head * v_dim channels: every
 * key head's q, then every key head's k, then every value head's v; value head j reads key
 * head j / (n_v_head / n_k_head). */
struct be_gdn {
    int n_k_head, n_v_head, k_dim, v_dim;
    int conv_k;            /* depthwise causal conv1d width */
    const float *conv_w;   /* (conv_dim, conv_k) */
    const float *a_log;    /* (n_v_head) the decay rate is -exp(a_log) */
    const float *dt_bias;  /* (n_v_head) */
    const float *norm_w;   /* (v_dim) the gated RMSNorm's weight */
    float eps;             /* its epsilon */
    float *conv_state;     /* (slots, conv_k - 1, conv_dim) a sequence's last inputs, oldest
                              first */
    float *ssm_state;      /* (slots, n_v_head, k_dim, v_dim) the delta-rule state S */
};

/* One Mamba2 layer (granitemoehybrid), in backend memory. conv_dim = n_head * head_dim + 2 *
 * n_group * d_state channels: x (every head's), then every group's B, then every group's C;
 * head h reads group h / (n_head / n_group). */
struct be_mamba {
    int n_head, head_dim, n_group, d_state;
    int conv_k;            /* depthwise causal conv1d width */
    const float *conv_w;   /* (conv_dim, conv_k) */
    const float *conv_b;   /* (conv_dim) or NULL */
    const float *a_log;    /* (n_head) the decay rate is A = -exp(a_log) */
    const float *dt_bias;  /* (n_head) */
    const float *d_skip;   /* (n_head) D */
    const float *norm_w;   /* (n_head * head_dim) the gated RMSNorm's weight, per group of
                              n_head * head_dim / n_group values */
    float eps;
    float dt_min, dt_max;  /* the step is clamped to [dt_min, dt_max] */
    float *conv_state;     /* (slots, conv_k - 1, conv_dim) */
    float *ssm_state;      /* (slots, n_head, head_dim, d_state) */
};

struct backend_ops {
    const char *name;
    /* Nonzero when backend memory is host memory (pointers may be read directly). */
    int host_memory;
    void (*destroy)(struct backend *be);

    /* Memory: alloc returns NULL on failure; upload/download copy host <-> backend memory
     * (plain memcpy on the CPU backend). */
    void *(*alloc)(struct backend *be, size_t bytes);
    void (*free)(struct backend *be, void *p);
    void (*upload)(struct backend *be, void *dst, const void *src, size_t bytes);
    void (*download)(struct backend *be, void *dst, const void *src, size_t bytes);
    void (*synchronize)(struct backend *be);
    /* Workspace so that ops allocate nothing for steps within *r; 0, or -1 when memory runs
     * out. */
    int (*reserve)(struct backend *be, const struct be_reserve *r);

    /* Weight handle for the host matrix `host` (which may be any type the backend takes);
     * NULL when memory runs out or the type cannot be used here (the backend's error says
     * which). The CPU backend returns host itself (it must outlive the handle); weight_free
     * releases what weight_upload made. */
    const struct wmat *(*weight_upload)(struct backend *be, const struct wmat *host);
    void (*weight_free)(struct backend *be, const struct wmat *w);

    /* y (n, m) = x (n, k) . w (m, k)^T [+ bias (m)]; w a weight handle */
    void (*matmul)(struct backend *be, float *y, const float *x, const struct wmat *w,
                   const float *bias, int n, int k, int m);
    /* Products of one input with several matrices (count <= BE_MULTI_MAX): y[i] (n, w[i]->rows)
     * = x (n, k) . w[i]^T [+ bias[i]]; HOST arrays of count pointers (bias entries may be
     * NULL). The same results as count matmul calls, in one pass where the backend can (the
     * q, k and v projections of a layer). */
    void (*matmul_multi)(struct backend *be, int count, float *const *y, const float *x,
                         const struct wmat *const *w, const float *const *bias, int n, int k);
    /* y (n, d) = x (n, d) * rsqrt(mean(x^2) + eps) * w (d); y may equal x */
    void (*rmsnorm)(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                    float eps);
    /* In place on x (n, n_head, head_dim), rotate-half RoPE at positions pos (n), with the
     * precomputed table cos_sin (max_pos, head_dim/2, 2). */
    void (*rope)(struct backend *be, float *x, const int32_t *pos, int n, int n_head,
                 int head_dim, const float *cos_sin);
    /* y (n, d) += x (n, d) */
    void (*add)(struct backend *be, float *y, const float *x, int n, int d);
    /* x (n, d) = clamp(x, -c, c) */
    void (*clamp)(struct backend *be, float *x, int n, int d, float c);
    /* out (n, d_ff) = silu(gate) * up, gate_up given as two (n, d_ff) arrays */
    void (*swiglu)(struct backend *be, float *out, const float *gate, const float *up, int n,
                   int d_ff);
    /* out (n, d) = embed[ids[i]] as f32; embed a weight handle */
    void (*embed)(struct backend *be, float *out, const struct wmat *embed, const int32_t *ids,
                  int n, int d);
    /* rows: dst[i] = src[idx[i]] for row length d */
    void (*gather_rows)(struct backend *be, float *dst, const float *src, const int32_t *idx,
                        int n, int d);
    /* rows: dst[idx[i]] = src[i] */
    void (*scatter_rows)(struct backend *be, float *dst, const float *src, const int32_t *idx,
                         int n, int d);

    /* out (n, d) = sum over j < k with idx[i*k+j] >= 0 of w[i*k+j] * rows[idx[i*k+j]], summed in
     * slot order j (fixed order: results do not depend on where rows were computed). */
    void (*moe_combine)(struct backend *be, float *out, const float *rows, const int32_t *idx,
                        const float *w, int n, int k, int d);
    /* y (n, d) += f(s[i]) * x (n, d), f = sigmoid when `sigmoid` else identity */
    void (*add_scaled_rows)(struct backend *be, float *y, const float *x, const float *s, int n,
                            int d, int sigmoid);

    /* Routing for n tokens: logits (n, n_expert) and, for MoHGE, group logits glog (n, n_group)
     * -> idx/w (n, top_k): the chosen experts in slot order and their weights; token t uses
     * tok_k[t] <= top_k slots, the rest are -1 / 0. Same rule on every backend
     * (kernels/route_impl.h). */
    void (*route)(struct backend *be, int32_t *idx, float *w, const float *logits,
                  const float *glog, const int32_t *tok_k, int n, const struct be_route *r);
    /* Expert FFNs over rows grouped by expert: rows [off[j], off[j+1]) of x (rows, d) go
     * through experts[j] into the same rows of y, for j < n_experts. HOST: off (n_experts + 1),
     * experts (n_experts). gate/up: scratch of sum_j (off[j+1] - off[j]) * experts[j].d_ff
     * floats each. */
    void (*moe_experts)(struct backend *be, float *y, const float *x, int d, int n_experts,
                        const int *off, const struct be_expert *experts, float *gate, float *up);

    /* Continuous experts (infmoe): token i computes only its neurons idx[i * stride + j],
     * j < count[i] (each < F), of one SwiGLU FFN whose three weight handles are (F, d) and
     * neuron-major (down_t row f: what neuron f adds to the output):
     *   y_i (d) = sum_j coef[i * stride + j] * silu(gate_f . x_i) * (up_f . x_i) * down_t_f,
     * f = idx[i * stride + j], summed in j order whatever the thread count. idx, coef and
     * count are backend memory; hbuf: scratch of n * stride floats; iscratch: NULL or host
     * scratch of NEURON_ISCRATCH(n, stride, F) int32 values, with which a host backend may
     * take a batch neuron by neuron (each weight row read once for all its tokens; the same
     * results). The matrices are f32, f16 or bf16 (the loader never quantizes them); products
     * take f32 activations. */
    void (*neuron_ffn)(struct backend *be, float *y, const float *x, int n, int d,
                       const struct wmat *gate, const struct wmat *up, const struct wmat *down_t,
                       const int32_t *idx, const float *coef, const int32_t *count, int stride,
                       float *hbuf, int32_t *iscratch);

    /* Paged causal attention for n tokens (of one or several sequences; see be_tokens) whose
     * keys/values for positions [0, pos] are already in the layer's cache *kv (HOST struct of
     * backend pointers), with the geometry of *a (HOST struct; sinks backend memory):
     * q (n, n_head, k_dim) -> out (n, n_head, v_dim). Each output depends only on its own query
     * and the cache, never on the other tokens of the call or on how the work is split. */
    void (*attention)(struct backend *be, float *out, const float *q, const struct be_kv *kv,
                      const struct be_tokens *tk, int block_size, int n,
                      const struct be_attn *a);
    /* Writes k/v rows (n, row) of n tokens (see be_tokens) at their positions into the layer's
     * cache, converted to its type. v NULL: only k is written (MLA's latent cache has no
     * values). */
    void (*kv_write)(struct backend *be, const struct be_kv *kv, const float *k, const float *v,
                     const struct be_tokens *tk, int block_size, int n, int row);

    /* DeepSeek sparse attention (struct be_dsa): for each of n tokens (be_tokens), the
     * positions it attends to, from its index queries q (n, n_head, dim; rotated) and head
     * weights w (n, n_head) against the index keys cached at [0, pos] of its sequence (written
     * with the token's own row before the call): sel (n, topk) ascending and sel_n (n), -1
     * where pos < topk (every position). Ties at the k-th score keep the earlier positions.
     * NULL where the backend has no kernels for it (the engine refuses such models there). */
    void (*dsa_select)(struct backend *be, int32_t *sel, int32_t *sel_n, const float *q,
                       const float *w, const struct be_kv *kv, const struct be_tokens *tk,
                       int block_size, int n, const struct be_dsa *p);
    /* y (n, d; rows ldy apart) = layer norm of x (rows ldx apart): (x - mean) / sqrt(var + eps)
     * * w + b; y may equal x. NULL where the backend lacks it (with dsa_select). */
    void (*layernorm_ld)(struct backend *be, float *y, int ldy, const float *x, int ldx,
                         const float *w, const float *b, int n, int d, float eps);

    /* Ops for models whose tensors are read in parts (MLA, gpt-oss). */
    /* y (n, m) = x (n, k) . w (m, k)^T with rows of x ldx floats apart and of y ldy apart
     * (column slices of wider activations: MLA's per-head projections). */
    void (*matmul_ld)(struct backend *be, float *y, int ldy, const float *x, int ldx,
                      const struct wmat *w, int n, int k, int m);
    /* The first d floats of each of n rows ld floats apart: y = x * rsqrt(mean(x^2) + eps) * w;
     * y may equal x. */
    void (*rmsnorm_ld)(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                       int ld, float eps);
    /* RoPE of rot_dim floats of each of n_head heads of n tokens at positions pos: head h of
     * token i is read at x + (i * n_head + h) * x_stride and written at y + (i * n_head + h) *
     * y_stride (y may equal x with the same stride). Pairs (j, j + rot_dim/2), or (2j, 2j + 1)
     * when interleave; cos_sin (max_pos, rot_dim/2, 2). */
    void (*rope_ex)(struct backend *be, float *y, int y_stride, const float *x, int x_stride,
                    const int32_t *pos, int n, int n_head, int rot_dim, int interleave,
                    const float *cos_sin);
    /* Host work of the engine (per-token loops on host data, e.g. infmoe's slice selection)
     * spread over the backend's own threads: fn(ctx, task, worker) for every task <
     * n_tasks, worker < host_workers(be) (for per-worker scratch), returning when all are
     * done. A backend without host threads runs them in order on the caller (worker 0). */
    int (*host_workers)(struct backend *be);
    void (*host_for)(struct backend *be, int n_tasks, void (*fn)(void *ctx, int task, int worker),
                     void *ctx);

    /* Ops of hybrid models (gated attention, Gated DeltaNet). A backend without them (NULL)
     * cannot run those models; the engine says so at start. */
    /* y[i * ldy + j] = x[i * ldx + idx[j]] for i < n, j < m; idx (m) in backend memory. */
    void (*gather_cols)(struct backend *be, float *y, int ldy, const float *x, int ldx,
                        const int32_t *idx, int n, int m);
    /* y (n, d) *= sigmoid(g (n, d)) */
    void (*mul_sigmoid)(struct backend *be, float *y, const float *g, int n, int d);
    /* Gated DeltaNet token mixing for the sequences of *sq (HOST struct) through layer *g
     * (HOST struct of backend pointers). Per token, from qkv (n, conv_dim), z (n, n_v_head *
     * v_dim) and the b and a logits (n, n_v_head):
     *   qkv' = silu(causal depthwise conv1d of qkv over the sequence, state first);
     *   q, k = l2-normalized heads of qkv' (eps 1e-6), q scaled by 1/sqrt(k_dim);
     *   beta = sigmoid(b), decay = exp(-exp(a_log) * softplus(a + dt_bias));
     *   per value head: S = decay * S; S += k (beta * (v - S^T k))^T; o = S^T q;
     *   out (n, n_v_head * v_dim) = rmsnorm(o per head) * norm_w * silu(z).
     * qkv, b and a are overwritten (with qkv', beta and the log-decay); the slots' conv and
     * delta-rule states end holding the state after each sequence's last token. */
    void (*gdn)(struct backend *be, float *out, float *qkv, const float *z, float *b, float *a,
                const struct be_gdn *g, const struct be_seqs *sq);
    /* Mamba2 token mixing (SSD) for the sequences of *sq through layer *m (HOST structs). Per
     * token, from xbc (n, conv_dim), the gate z (n, n_head * head_dim) and the step logits dt
     * (n, n_head):
     *   xbc' = silu(causal depthwise conv1d of xbc over the sequence + conv_b, state first);
     *   dt = clamp(softplus(dt + dt_bias), dt_min, dt_max);
     *   per head: S = exp(dt A) S + (dt x) B^T (S: head_dim x d_state); y = S C + D x;
     *   out (n, n_head * head_dim) = rmsnorm(y * silu(z) per group) * norm_w.
     * xbc and dt are overwritten; the slots' states end after each sequence's last token. */
    void (*mamba2)(struct backend *be, float *out, float *xbc, const float *z, float *dt,
                   const struct be_mamba *m, const struct be_seqs *sq);
    /* DeepSeek-V4 (struct be_hc, be_v4cmp, be_v4attn; HOST structs of backend pointers). NULL
     * where the backend has no kernels for them (the engine refuses such models there). */
    /* y (n, d) = sum_j pre_j x_j over the token's streams x (n, n_stream, d), pre from mix
     * (n, n_stream (2 + n_stream)); post (n, n_stream) and comb (n, n_stream, n_stream) out.
     * post NULL: the final collapse (hc_head): mix (n, n_stream), pre only. */
    void (*hc_pre)(struct backend *be, float *post, float *comb, float *y, const float *x,
                   const float *mix, int n, int d, const struct be_hc *h);
    /* y (n, n_stream, d): stream k = post_k * out + sum_j comb[j][k] x_j (x (n, n_stream, d),
     * out (n, d)); y must not overlap x */
    void (*hc_post)(struct backend *be, float *y, const float *x, const float *out,
                    const float *post, const float *comb, int n, int d, int n_stream);
    /* out (row i at out + i * ldo, c floats): token i's entry when its position closes a
     * window, else zeros; reads the rows of positions up to the token's (written before) */
    void (*v4_compress)(struct backend *be, float *out, int ldo, const struct be_kv *kv,
                        const struct be_tokens *tk, int block_size, int n,
                        const struct be_v4cmp *p);
    /* q (n, n_head, dim) -> out (n, n_head, dim) */
    void (*v4_attention)(struct backend *be, float *out, const float *q, const struct be_kv *kv,
                         const struct be_tokens *tk, int block_size, int n,
                         const struct be_v4attn *a);
    /* x (n, d) *= s */
    void (*scale)(struct backend *be, float *x, int n, int d, float s);
    /* row i of x (n, d) *= s[i] (s backend memory) */
    void (*mul_rows)(struct backend *be, float *x, const float *s, int n, int d);
};

struct backend {
    const struct backend_ops *ops;
};

/* CPU backend on n_threads threads (>= 1: the calling thread and n_threads - 1 workers of its
 * own). bf16_compute: bf16 weights multiply bf16-rounded activations (AVX512-BF16 dot
 * products where the CPU has them) instead of f32 ones. NULL when out of memory or threads. */
struct backend *backend_cpu_create(int n_threads, bool bf16_compute);
/* The CPU backend posing as a device with its own memory (host_memory 0, weights copied), so
 * that tests run the engine's upload/download path without a GPU. */
struct backend *backend_cpu_create_staged(int n_threads, bool bf16_compute);
/* MXFP4 weights multiply int8-quantized activations (the int8 dot-product kernels: faster, about
 * 1% error per product) instead of f32 ones (exact); the engine asks for it under
 * --quantization. Call before the first op. */
void backend_cpu_set_int8_mxfp4(struct backend *be, bool on);
/* The kernel set the CPU backend uses on this machine ("avx512", "avx2" or "portable") and the
 * CPU features it was chosen from, for logs. */
const char *backend_cpu_kernels(void);
const char *backend_cpu_features(void);

#endif
