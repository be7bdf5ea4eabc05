/* MoE layer: route -> dispatch -> expert compute on the owning device -> combine.
 *
 * Row order is what makes results independent of the device count: a device sends its rows
 * grouped by destination, then by expert, then in token order; devices own contiguous token
 * ranges in rank order; so the rows an owner gathers for one expert are always in global token
 * order, and the GEMM for that expert sees the same matrix for any number of devices. The
 * combine sums each token's slots in top-k order on the token's own device. */
#include "moe.h"

#include <math.h>
#include <stdlib.h>

#include "common.h"

static int max_expert_ff(const struct model *m)
{
    int mx = 0;
    for (int e = 0; e < m->desc.n_expert; e++)
        if (m->desc.expert_d_ff[e] > mx) mx = m->desc.expert_d_ff[e];
    return mx;
}

int moe_scratch_init(struct moe_scratch *s, struct backend *be, const struct model *m,
                     int max_tokens, int n_dev, int dense_ff)
{
    const struct model_desc *md = &m->desc;
    memset(s, 0, sizeof *s);
    size_t T = (size_t)max_tokens, d = (size_t)md->d_model;
    int k = md->top_k > 0 ? md->top_k : 1;
    int E = md->n_expert > 0 ? md->n_expert : 1;
    size_t R = T * (size_t)k;
    s->max_rows = (int)R;
    size_t ff_rows = R * (size_t)max_expert_ff(m);
    size_t ff_tok = T * (size_t)(dense_ff > md->shared_d_ff ? dense_ff : md->shared_d_ff);
    size_t ff = ff_rows > ff_tok ? ff_rows : ff_tok;
    bool ok = true;
#define ALLOC(field, bytes)                                                                       \
    do {                                                                                          \
        s->field = be->ops->alloc(be, (bytes));                                                   \
        ok = ok && s->field;                                                                      \
    } while (0)
    /* expert logits (T, E), then (MoHGE) group logits (T, G) */
    ALLOC(logits, T * (size_t)(E + md->n_group) * sizeof(float));
    ALLOC(top_idx, R * sizeof(int32_t));
    ALLOC(top_w, R * sizeof(float));
    ALLOC(slot_row, R * sizeof(int32_t));
    ALLOC(send, R * d * sizeof(float));
    ALLOC(send_meta, R * sizeof(int32_t));
    ALLOC(recv, R * d * sizeof(float));
    ALLOC(recv_meta, R * sizeof(int32_t));
    ALLOC(out_rows, R * d * sizeof(float));
    ALLOC(back, R * d * sizeof(float));
    ALLOC(perm, R * sizeof(int32_t));
    ALLOC(xe, R * d * sizeof(float));
    ALLOC(ye, R * d * sizeof(float));
    ALLOC(gate, ff * sizeof(float));
    ALLOC(up, ff * sizeof(float));
    ALLOC(shared_out, T * d * sizeof(float));
    ALLOC(shared_gate, T * sizeof(float));
#undef ALLOC
    s->send_counts = calloc((size_t)n_dev, sizeof(int));
    s->recv_counts = calloc((size_t)n_dev, sizeof(int));
    s->expert_count = calloc((size_t)E, sizeof(int));
    s->expert_off = calloc((size_t)E + 1, sizeof(int));
    s->expert_cursor = calloc((size_t)E, sizeof(int));
    if (!ok || !s->send_counts || !s->recv_counts || !s->expert_count || !s->expert_off ||
        !s->expert_cursor) {
        moe_scratch_release(s, be);
        return -1;
    }
    return 0;
}

void moe_scratch_release(struct moe_scratch *s, struct backend *be)
{
    void *bufs[] = {s->logits, s->top_idx, s->top_w, s->slot_row, s->send,       s->send_meta,
                    s->recv,   s->recv_meta, s->out_rows, s->back, s->perm,      s->xe,
                    s->ye,     s->gate,    s->up,    s->shared_out, s->shared_gate};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    free(s->send_counts);
    free(s->recv_counts);
    free(s->expert_count);
    free(s->expert_off);
    free(s->expert_cursor);
    memset(s, 0, sizeof *s);
}

/* Softmax over the experts, top-k by probability (ties to the lower expert id, as torch.topk
 * returns them on CPU), optionally renormalized over the k kept. */
static void route_softmax_topk(const struct model_desc *md, const float *logits, int k,
                               int32_t *idx, float *w)
{
    int E = md->n_expert;
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; e++) sum += expf(logits[e] - mx);
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken |= idx[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        idx[j] = best;
        w[j] = expf(logits[best] - mx) / sum;
        wsum += w[j];
    }
    if (md->norm_topk_prob)
        for (int j = 0; j < k; j++) w[j] /= wsum;
}

/* Index of the largest v[i] over i < n with !taken[i] (ties to the lower index). */
static int argmax_free(const float *v, const bool *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* MoHGE two-level routing (DESIGN.md): sigmoid group scores, keep the top-kg groups and
 * renormalize their scores; softmax of the expert logits inside each group, times the group's
 * score and kept mask, flattened and renormalized; top-k experts of that; weights = softmax over
 * the k kept probabilities. elog: (E) expert logits, glog: (G) group logits. */
static void route_mohge(const struct model_desc *md, const float *elog, const float *glog, int k,
                        int32_t *idx, float *w)
{
    int E = md->n_expert, G = md->n_group, epg = E / G;
    float sg[MODEL_MAX_GROUPS], q[MODEL_MAX_EXPERTS];
    bool taken[MODEL_MAX_EXPERTS];
    for (int g = 0; g < G; g++) {
        sg[g] = 1.0f / (1.0f + expf(-glog[g]));
        taken[g] = false;
    }
    float ssum = 0.0f;
    for (int j = 0; j < md->topk_group; j++) {
        int g = argmax_free(sg, taken, G);
        taken[g] = true;
        ssum += sg[g];
    }
    float qsum = 0.0f;
    for (int g = 0; g < G; g++) {
        const float *l = elog + (size_t)g * epg;
        float *qg = q + (size_t)g * epg;
        if (!taken[g]) {
            for (int i = 0; i < epg; i++) qg[i] = 0.0f;
            continue;
        }
        float mx = -INFINITY, sum = 0.0f, scale = sg[g] / ssum;
        for (int i = 0; i < epg; i++) mx = l[i] > mx ? l[i] : mx;
        for (int i = 0; i < epg; i++) {
            qg[i] = expf(l[i] - mx);
            sum += qg[i];
        }
        for (int i = 0; i < epg; i++) {
            qg[i] = qg[i] / sum * scale;
            qsum += qg[i];
        }
    }
    for (int e = 0; e < E; e++) {
        q[e] /= qsum;
        taken[e] = false;
    }
    float mx = -INFINITY, wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int e = argmax_free(q, taken, E);
        taken[e] = true;
        idx[j] = e;
        mx = q[e] > mx ? q[e] : mx;
    }
    for (int j = 0; j < k; j++) {
        w[j] = expf(q[idx[j]] - mx);
        wsum += w[j];
    }
    for (int j = 0; j < k; j++) w[j] /= wsum;
}

void moe_mohge_placement(const struct model_desc *md, int n_dev, int *owner)
{
    int E = md->n_expert, G = md->n_group, epg = E / G, pos = 0;
    for (int i = 0; i < epg; i++)
        for (int j = 0; j < G; j++) {
            int g = j % 2 == 0 ? j / 2 : G - 1 - j / 2; /* order = [0, G-1, 1, G-2, ...] */
            owner[g * epg + i] = (int)((long)pos * n_dev / E);
            pos++;
        }
}

void moe_route(const struct model *m, int layer, struct backend *be, const float *h, int n,
               const int32_t *tok_k, float *logits, int32_t *top_idx, float *top_w)
{
    const struct model_desc *md = &m->desc;
    int E = md->n_expert, K = md->top_k, G = md->n_group;
    bool mohge = md->router == ROUTER_KIND_MOHGE;
    float *glog = logits + (size_t)n * E; /* (n, G), MoHGE only */
    be->ops->matmul(be, logits, h, m->layers[layer].router, NULL, n, md->d_model, E);
    if (mohge)
        be->ops->matmul(be, glog, h, m->layers[layer].group_router, NULL, n, md->d_model, G);
    /* Routing decisions are made on the host (the CPU backend's memory is host memory). */
    for (int t = 0; t < n; t++) {
        int k = tok_k[t];
        int32_t *idx = top_idx + (size_t)t * K;
        float *w = top_w + (size_t)t * K;
        if (mohge)
            route_mohge(md, logits + (size_t)t * E, glog + (size_t)t * G, k, idx, w);
        else
            route_softmax_topk(md, logits + (size_t)t * E, k, idx, w);
        for (int j = k; j < K; j++) {
            idx[j] = -1;
            w[j] = 0.0f;
        }
    }
}

void moe_ffn_rows(struct backend *be, const struct ffn_w *w, int d, const float *x, int n,
                     float *out, float *g, float *u)
{
    be->ops->matmul(be, g, x, w->gate, NULL, n, d, w->d_ff);
    be->ops->matmul(be, u, x, w->up, NULL, n, d, w->d_ff);
    be->ops->swiglu(be, g, g, u, n, w->d_ff);
    be->ops->matmul(be, out, g, w->down, NULL, n, w->d_ff, d);
}

/* Groups the rows to send by (owner device, expert, token) and fills send/send_meta/slot_row. */
static int build_dispatch(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                          int n)
{
    const struct model_desc *md = &ctx->m->desc;
    int E = md->n_expert, K = md->top_k, n_dev = ctx->comm->n_rank;
    memset(s->expert_count, 0, sizeof(int) * (size_t)E);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int32_t e = s->top_idx[(size_t)t * K + j];
            if (e >= 0) s->expert_count[e]++;
        }
    /* Owner-major expert order: experts of device 0 first, each device's in id order. */
    int pos = 0;
    for (int dev = 0; dev < n_dev; dev++) {
        s->send_counts[dev] = 0;
        for (int e = 0; e < E; e++)
            if (ctx->owner[e] == dev) {
                s->expert_off[e] = pos;
                pos += s->expert_count[e];
                s->send_counts[dev] += s->expert_count[e];
            }
    }
    int rows = pos;
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            size_t sj = (size_t)t * K + j;
            int32_t e = s->top_idx[sj];
            if (e < 0) {
                s->slot_row[sj] = -1;
                continue;
            }
            int r = s->expert_off[e]++;
            s->slot_row[sj] = r;
            s->send_meta[r] = e;
            s->perm[r] = t;
        }
    ctx->be->ops->gather_rows(ctx->be, s->send, h, s->perm, rows, md->d_model);
    return rows;
}

/* Runs every expert this device owns over the rows it received, writing out_rows. */
static void compute_experts(const struct moe_ctx *ctx, struct moe_scratch *s, int n_recv)
{
    const struct model *m = ctx->m;
    const struct model_desc *md = &m->desc;
    const struct layer_w *lw = &m->layers[ctx->layer];
    struct backend *be = ctx->be;
    int E = md->n_expert, d = md->d_model;
    double t0 = ms_now();

    memset(s->expert_count, 0, sizeof(int) * (size_t)E);
    for (int r = 0; r < n_recv; r++) s->expert_count[s->recv_meta[r]]++;
    s->expert_off[0] = 0;
    for (int e = 0; e < E; e++) s->expert_off[e + 1] = s->expert_off[e] + s->expert_count[e];
    for (int e = 0; e < E; e++) s->expert_cursor[e] = s->expert_off[e];
    for (int r = 0; r < n_recv; r++) s->perm[s->expert_cursor[s->recv_meta[r]]++] = r;

    double flops = 0.0;
    for (int e = 0; e < E; e++) {
        int cnt = s->expert_count[e];
        if (cnt == 0) continue;
        const int32_t *rows = s->perm + s->expert_off[e];
        be->ops->gather_rows(be, s->xe, s->recv, rows, cnt, d);
        moe_ffn_rows(be, &lw->experts[e], d, s->xe, cnt, s->ye, s->gate, s->up);
        be->ops->scatter_rows(be, s->out_rows, s->ye, rows, cnt, d);
        ctx->stats->expert_rows[(size_t)ctx->layer * E + e] += (uint64_t)cnt;
        flops += 6.0 * d * lw->experts[e].d_ff * cnt;
    }
    ctx->stats->dev_routed_rows[ctx->rank] += (uint64_t)n_recv;
    ctx->stats->dev_expert_flops[ctx->rank] += flops;
    ctx->stats->dev_busy_s[ctx->rank] += ms_now() - t0;
}

static void shared_experts(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                           int n, float *out)
{
    const struct model *m = ctx->m;
    const struct model_desc *md = &m->desc;
    const struct layer_w *lw = &m->layers[ctx->layer];
    struct backend *be = ctx->be;
    int d = md->d_model;
    if (md->shared_gate == SHARED_GATE_SIGMOID)
        be->ops->matmul(be, s->shared_gate, h, lw->shared_gate, NULL, n, d, 1);
    for (int i = 0; i < md->n_shared; i++) {
        moe_ffn_rows(be, &lw->shared[i], d, h, n, s->shared_out, s->gate, s->up);
        if (md->shared_gate == SHARED_GATE_SIGMOID) {
            be->ops->add_scaled_rows(be, out, s->shared_out, s->shared_gate, n, d, 1);
        } else {
            be->ops->add(be, out, s->shared_out, n, d);
        }
    }
}

void moe_forward(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                 const int32_t *tok_k, int n, float *out)
{
    const struct model_desc *md = &ctx->m->desc;
    struct backend *be = ctx->be;
    struct comm *comm = ctx->comm;
    int d = md->d_model;
    size_t row_bytes = sizeof(float) * (size_t)d;

    moe_route(ctx->m, ctx->layer, be, h, n, tok_k, s->logits, s->top_idx, s->top_w);
    build_dispatch(ctx, s, h, n);

    comm->ops->all_to_all_v(comm, ctx->rank, s->send, s->send_counts, s->recv, s->recv_counts,
                            row_bytes);
    comm->ops->all_to_all_v(comm, ctx->rank, s->send_meta, s->send_counts, s->recv_meta,
                            s->recv_counts, sizeof(int32_t));
    int n_recv = 0;
    for (int r = 0; r < comm->n_rank; r++) n_recv += s->recv_counts[r];
    compute_experts(ctx, s, n_recv);

    /* Results go back the way the rows came: what rank r received from s returns to s. The
     * reply lands in `back` in the order the rows were sent. */
    int *counts_back = s->send_counts; /* overwritten with what arrives, the same numbers */
    comm->ops->all_to_all_v(comm, ctx->rank, s->out_rows, s->recv_counts, s->back, counts_back,
                            row_bytes);

    be->ops->moe_combine(be, out, s->back, s->slot_row, s->top_w, n, md->top_k, d);
    if (md->n_shared > 0) shared_experts(ctx, s, h, n, out);
}
