/* MoE layer: route -> dispatch -> expert compute on the owning device -> combine.
 *
 * Row order is what makes expert outputs independent of the device count: a device sends its
 * rows grouped by destination, then by expert (rows) or in token order (tokens); devices own
 * contiguous token ranges in rank order; so the rows an owner gathers for one expert are always
 * in global token order, and the GEMM for that expert sees the same matrix for any number of
 * devices. The rows dispatch sums each token's slots in top-k order on the token's own device,
 * which keeps whole results bit for bit; the tokens dispatch sums each device's slots there
 * first, then the partials, a different order of float additions. */
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
    s->max_tokens = (int)T;
    /* dedup: a device sends at most one row per (own token, device), min(k, n_dev) a token */
    bool dedup = n_dev > 1;
    size_t S = T * (size_t)(k < n_dev ? k : n_dev), meta = 2 * (size_t)k * sizeof(int32_t);
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
    ALLOC(idx, 2 * R * sizeof(int32_t));
    ALLOC(xe, R * d * sizeof(float));
    ALLOC(ye, R * d * sizeof(float));
    ALLOC(gate, ff * sizeof(float));
    ALLOC(up, ff * sizeof(float));
    ALLOC(shared_out, T * d * sizeof(float));
    ALLOC(shared_gate, T * sizeof(float));
    if (md->router_scales_input) ALLOC(row_w, R * sizeof(float));
    if (dedup) {
        ALLOC(tsend_meta, S * meta);
        ALLOC(trecv_meta, T * meta);
        ALLOC(tidx, 2 * R * sizeof(int32_t));
        ALLOC(tcw, R * sizeof(float));
    }
#undef ALLOC
    s->h_top_idx = malloc(R * sizeof(int32_t));
    s->h_slot_row = malloc(R * sizeof(int32_t));
    s->h_send_perm = malloc(R * sizeof(int32_t));
    s->h_send_meta = malloc(R * sizeof(int32_t));
    s->h_recv_meta = malloc(R * sizeof(int32_t));
    s->h_expert_perm = malloc(2 * R * sizeof(int32_t)); /* also stages the idx upload */
    s->h_experts = calloc((size_t)E, sizeof *s->h_experts);
    s->h_ex_off = calloc((size_t)E + 1, sizeof(int));
    if (md->router_scales_input || dedup) {
        s->h_top_w = malloc(R * sizeof(float));
        ok = ok && s->h_top_w;
    }
    if (md->router_scales_input) {
        s->h_row_w = malloc(R * sizeof(float));
        ok = ok && s->h_row_w;
    }
    if (dedup) {
        s->h_slot_dev = malloc(R * sizeof(int32_t));
        s->h_tmeta = malloc(S * meta);
        s->h_tidx = malloc(2 * R * sizeof(int32_t));
        s->h_tslot = malloc(R * sizeof(int32_t));
        s->h_tcw = malloc(R * sizeof(float));
        s->dev_cursor = calloc((size_t)n_dev, sizeof(int));
        ok = ok && s->h_slot_dev && s->h_tmeta && s->h_tidx && s->h_tslot && s->h_tcw &&
             s->dev_cursor;
    }
    ok = ok && s->h_top_idx && s->h_slot_row && s->h_send_perm && s->h_send_meta &&
         s->h_recv_meta && s->h_expert_perm && s->h_experts && s->h_ex_off;
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
                    s->recv,   s->recv_meta, s->out_rows, s->back, s->idx,       s->xe,
                    s->ye,     s->gate,    s->up,    s->shared_out, s->shared_gate, s->row_w,
                    s->tsend_meta, s->trecv_meta, s->tidx, s->tcw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    free(s->h_top_idx);
    free(s->h_slot_row);
    free(s->h_send_perm);
    free(s->h_send_meta);
    free(s->h_recv_meta);
    free(s->h_expert_perm);
    free(s->h_experts);
    free(s->h_ex_off);
    free(s->h_top_w);
    free(s->h_row_w);
    free(s->h_slot_dev);
    free(s->h_tmeta);
    free(s->h_tidx);
    free(s->h_tslot);
    free(s->h_tcw);
    free(s->dev_cursor);
    free(s->send_counts);
    free(s->recv_counts);
    free(s->expert_count);
    free(s->expert_off);
    free(s->expert_cursor);
    free(s->slot_count);
    free(s->slot_off);
    memset(s, 0, sizeof *s);
}

int moe_scratch_slots(struct moe_scratch *s, int n_slots)
{
    free(s->slot_count);
    free(s->slot_off);
    s->slot_count = calloc((size_t)n_slots, sizeof(int));
    s->slot_off = calloc((size_t)n_slots, sizeof(int));
    s->max_slots = s->slot_count && s->slot_off ? n_slots : 0;
    return s->max_slots ? 0 : -1;
}

void moe_mohge_placement(const struct model_desc *md, int n_dev, int *owner)
{
    plc_mohge_owner(md->n_expert, md->n_group, n_dev, owner);
}

void moe_route_desc(const struct model_desc *md, struct be_route *r)
{
    r->kind = md->router == ROUTER_KIND_MOHGE           ? BE_ROUTE_MOHGE
              : md->router == ROUTER_KIND_SIGMOID_GROUP ? BE_ROUTE_SIGMOID_GROUP
              : md->router == ROUTER_KIND_SOFTMAX_GROUP ? BE_ROUTE_SOFTMAX_GROUP
              : md->router == ROUTER_KIND_SIGMOID_TOPK  ? BE_ROUTE_SIGMOID_TOPK
                                                        : BE_ROUTE_SOFTMAX_TOPK;
    r->n_expert = md->n_expert;
    r->top_k = md->top_k;
    r->n_group = md->n_group;
    r->topk_group = md->topk_group;
    r->norm_topk = md->norm_topk_prob;
    r->bias = NULL; /* per layer: moe_route sets it */
    r->scale = md->routed_scale;
    r->score = md->router_score == ROUTER_SCORE_SQRTSOFTPLUS ? BE_SCORE_SQRTSOFTPLUS
                                                             : BE_SCORE_SIGMOID;
    r->hash = NULL; /* per layer: moe_route sets it */
    r->ids = NULL;
}

/* model.ablated: the removed experts' logits (and fully removed MoHGE groups') to -inf. */
static void ablate_logits(const struct model *m, int layer, float *logits, float *glog, int n)
{
    const struct model_desc *md = &m->desc;
    int E = md->n_expert, G = md->n_group;
    const uint8_t *off = m->ablated + (size_t)layer * E;
    for (int e = 0; e < E; e++) {
        if (!off[e]) continue;
        for (int t = 0; t < n; t++)
            logits[(size_t)t * E + e] = -INFINITY;
    }
    if (md->router != ROUTER_KIND_MOHGE || G <= 0) return;
    for (int g = 0; g < G; g++) {
        bool all = true;
        for (int e = 0; e < E && all; e++)
            if (md->expert_group[e] == g && !off[e]) all = false;
        for (int t = 0; all && t < n; t++)
            glog[(size_t)t * G + g] = -INFINITY;
    }
}

void moe_route(const struct model *m, int layer, struct backend *be, const float *h, int n,
               const int32_t *tok_k, const int32_t *ids, float *logits, int32_t *top_idx,
               float *top_w)
{
    const struct model_desc *md = &m->desc;
    int E = md->n_expert;
    struct be_route r;
    moe_route_desc(md, &r);
    r.bias = m->layers[layer].router_bias;
    r.hash = m->layers[layer].tid2eid;
    r.ids = ids;
    float *glog = logits + (size_t)n * E; /* (n, G), MoHGE only */
    be->ops->matmul(be, logits, h, m->layers[layer].router, m->layers[layer].router_b, n,
                    md->d_model, E);
    if (r.kind == BE_ROUTE_MOHGE)
        be->ops->matmul(be, glog, h, m->layers[layer].group_router, NULL, n, md->d_model,
                        md->n_group);
    if (m->ablated && be->ops->host_memory) ablate_logits(m, layer, logits, glog, n);
    be->ops->route(be, top_idx, top_w, logits, glog, tok_k, n, &r);
}

void moe_ffn_rows(struct backend *be, const struct ffn_w *w, int d, const float *x, int n,
                  float *out, float *g, float *u)
{
    be->ops->matmul(be, g, x, w->gate, NULL, n, d, w->d_ff);
    be->ops->matmul(be, u, x, w->up, NULL, n, d, w->d_ff);
    be->ops->swiglu(be, g, g, u, n, w->d_ff);
    be->ops->matmul(be, out, g, w->down, NULL, n, w->d_ff, d);
}

/* Plans the dispatch on the host from h_top_idx: each (token, slot) row goes to one replica of
 * its expert (plc_pick, by the token's index in the step), and rows are grouped by (device,
 * expert, token) into h_send_perm / h_send_meta / h_slot_row and send_counts. Returns the number
 * of rows; counts the rows and tokens that leave this device. */
static int plan_dispatch(const struct moe_ctx *ctx, struct moe_scratch *s, int n)
{
    const struct model_desc *md = &ctx->m->desc;
    const struct plc_map *pm = ctx->map;
    int E = md->n_expert, K = md->top_k, n_dev = ctx->comm->n_rank, S = pm->n_slots;
    int l = ctx->moe_layer;
    const int *slot_dev = pm->slot_dev + (size_t)l * S, *order = pm->dev_order + (size_t)l * S;
    memset(s->slot_count, 0, sizeof(int) * (size_t)S);
    /* Ids come from the backend: one out of range (a device that failed) must not index
     * host arrays. Such slots are dropped like unused ones; the failure is reported by the
     * backend's own error after the step. h_slot_row holds each row's physical slot for now. */
    uint64_t away_tok = 0;
    for (int t = 0; t < n; t++) {
        uint64_t seen = 0; /* other devices this token goes to (the first 64 tell apart) */
        for (int j = 0; j < K; j++) {
            size_t sj = (size_t)t * K + j;
            int32_t e = s->h_top_idx[sj];
            if (e >= E) s->h_top_idx[sj] = e = -1;
            if (e < 0) {
                s->h_slot_row[sj] = -1;
                continue;
            }
            int slot = plc_pick(pm, l, e, (uint32_t)(ctx->tok0 + t));
            s->h_slot_row[sj] = slot;
            s->slot_count[slot]++;
            int dev = slot_dev[slot];
            if (dev != ctx->rank && !(seen >> (dev & 63) & 1)) {
                seen |= 1ull << (dev & 63);
                away_tok++;
            }
        }
    }
    /* Device-major, expert order inside a device. */
    int pos = 0;
    for (int dev = 0; dev < n_dev; dev++) s->send_counts[dev] = 0;
    for (int i = 0; i < S; i++) {
        int slot = order[i];
        s->slot_off[slot] = pos;
        pos += s->slot_count[slot];
        s->send_counts[slot_dev[slot]] += s->slot_count[slot];
    }
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            size_t sj = (size_t)t * K + j;
            if (s->h_slot_row[sj] < 0) continue;
            int r = s->slot_off[s->h_slot_row[sj]]++;
            s->h_slot_row[sj] = r;
            s->h_send_meta[r] = s->h_top_idx[sj];
            s->h_send_perm[r] = t;
        }
    ctx->stats->dev_rows_away[ctx->rank] += (uint64_t)(pos - s->send_counts[ctx->rank]);
    ctx->stats->dev_tokens_away[ctx->rank] += away_tok;
    return pos;
}

/* Whether slot j is the first of its token's slots on device d (dev: the token's K devices). */
static bool first_on_dev(const int32_t *dev, int j, int d)
{
    for (int i = 0; i < j; i++)
        if (dev[i] == d) return false;
    return true;
}

/* The dedup plan, on the host from h_top_idx / h_top_w: each (token, slot) picks its replica as
 * plan_dispatch does; a token's row goes once to each device among its slots', grouped by device
 * and then in token order, into h_send_perm / send_counts, with that device's experts and
 * weights in slot order in h_tmeta. h_slot_row gets, at the first slot of each such device, the
 * row that device's partial sum comes back to, and -1 at the token's other slots (their outputs
 * are in that partial). Returns the rows sent; counts the expert rows computed elsewhere and the
 * token rows that leave this device (what really goes out). */
static int plan_tokens(const struct moe_ctx *ctx, struct moe_scratch *s, int n)
{
    const struct model_desc *md = &ctx->m->desc;
    const struct plc_map *pm = ctx->map;
    int E = md->n_expert, K = md->top_k, n_dev = ctx->comm->n_rank, S = pm->n_slots;
    int l = ctx->moe_layer;
    const int *slot_dev = pm->slot_dev + (size_t)l * S;
    size_t M = 2 * (size_t)K;
    uint64_t away_rows = 0;
    for (int dev = 0; dev < n_dev; dev++) s->send_counts[dev] = 0;
    for (int t = 0; t < n; t++) {
        int32_t *sd = s->h_slot_dev + (size_t)t * K;
        for (int j = 0; j < K; j++) {
            size_t sj = (size_t)t * K + j;
            int32_t e = s->h_top_idx[sj];
            if (e >= E) s->h_top_idx[sj] = e = -1; /* a failed device's id: as plan_dispatch */
            sd[j] = e < 0 ? -1 : slot_dev[plc_pick(pm, l, e, (uint32_t)(ctx->tok0 + t))];
            if (sd[j] < 0) continue;
            away_rows += sd[j] != ctx->rank;
            if (first_on_dev(sd, j, sd[j])) s->send_counts[sd[j]]++;
        }
    }
    int pos = 0;
    for (int dev = 0; dev < n_dev; dev++) {
        s->dev_cursor[dev] = pos;
        pos += s->send_counts[dev];
    }
    for (int t = 0; t < n; t++) {
        const int32_t *sd = s->h_slot_dev + (size_t)t * K;
        for (int j = 0; j < K; j++) {
            size_t sj = (size_t)t * K + j;
            if (sd[j] < 0 || !first_on_dev(sd, j, sd[j])) {
                s->h_slot_row[sj] = -1;
                continue;
            }
            int r = s->dev_cursor[sd[j]]++, c = 0;
            s->h_slot_row[sj] = r;
            s->h_send_perm[r] = t;
            int32_t *mr = s->h_tmeta + (size_t)r * M;
            for (int i = j; i < K; i++) {
                if (sd[i] != sd[j]) continue;
                mr[c] = s->h_top_idx[(size_t)t * K + i];
                memcpy(&mr[K + c], &s->h_top_w[(size_t)t * K + i], sizeof(float));
                c++;
            }
            for (; c < K; c++) mr[c] = mr[K + c] = -1; /* a weight that is never read */
        }
    }
    ctx->stats->dev_rows_away[ctx->rank] += away_rows;
    ctx->stats->dev_tokens_away[ctx->rank] += (uint64_t)(pos - s->send_counts[ctx->rank]);
    return pos;
}

/* Sorts the received rows by expert (stable: rows of one expert keep their arrival order) into
 * h_expert_perm, and lists the experts that got rows in h_experts / h_ex_off. Returns whether
 * the rows already arrived in that order (always so with one device). */
static bool plan_experts(const struct moe_ctx *ctx, struct moe_scratch *s, int n_recv,
                         int *n_active)
{
    const struct model_desc *md = &ctx->m->desc;
    const struct layer_w *lw = &ctx->m->layers[ctx->layer];
    int E = md->n_expert;
    memset(s->expert_count, 0, sizeof(int) * (size_t)E);
    /* Received ids came through the communicator: out of range ones go to expert 0's rows
     * rather than past the arrays (only after a device or link failure, reported after the
     * step). */
    for (int r = 0; r < n_recv; r++) {
        if (s->h_recv_meta[r] < 0 || s->h_recv_meta[r] >= E) s->h_recv_meta[r] = 0;
        s->expert_count[s->h_recv_meta[r]]++;
    }
    int off = 0, na = 0;
    s->h_ex_off[0] = 0;
    for (int e = 0; e < E; e++) {
        s->expert_cursor[e] = off;
        if (s->expert_count[e] == 0) continue;
        const struct ffn_w *f = &lw->experts[e];
        s->h_experts[na] = (struct be_expert){
            .d_ff = f->d_ff, .gate = f->gate, .up = f->up, .down = f->down,
            .b_gate = f->b_gate, .b_up = f->b_up, .b_down = f->b_down,
            .act = md->expert_act == FFN_ACT_SWIGLU_OAI   ? BE_ACT_SWIGLU_OAI
                   : md->expert_act == FFN_ACT_SILU_CLAMP ? BE_ACT_SILU_CLAMP
                                                          : BE_ACT_SILU,
            .alpha = md->act_alpha, .limit = md->act_limit};
        off += s->expert_count[e];
        s->h_ex_off[++na] = off;
    }
    bool sorted = true;
    for (int r = 0; r < n_recv; r++) {
        int p = s->expert_cursor[s->h_recv_meta[r]]++;
        s->h_expert_perm[p] = r;
        sorted &= p == r;
    }
    *n_active = na;
    return sorted;
}

static void expert_stats(const struct moe_ctx *ctx, const struct moe_scratch *s, int na,
                         int n_rows, double t0);

/* Runs every expert this device owns over the rows it received, writing out_rows. */
static void compute_experts(const struct moe_ctx *ctx, struct moe_scratch *s, const float *recv,
                            int n_recv, float *out_rows)
{
    struct backend *be = ctx->be;
    int d = ctx->m->desc.d_model;
    double t0 = ms_now();

    int na = 0;
    bool sorted = plan_experts(ctx, s, n_recv, &na);
    const float *xe = recv;
    float *ye = out_rows;
    int32_t *perm = s->idx + s->max_rows;
    if (!sorted) {
        be->ops->upload(be, perm, s->h_expert_perm, sizeof(int32_t) * (size_t)n_recv);
        be->ops->gather_rows(be, s->xe, recv, perm, n_recv, d);
        xe = s->xe;
        ye = s->ye;
    }
    be->ops->moe_experts(be, ye, xe, d, na, s->h_ex_off, s->h_experts, s->gate, s->up);
    if (!sorted) be->ops->scatter_rows(be, out_rows, ye, perm, n_recv, d);
    expert_stats(ctx, s, na, n_recv, t0);
}

/* The statistics of one expert compute: na experts over n_rows rows (s->expert_count), started
 * at t0. */
static void expert_stats(const struct moe_ctx *ctx, const struct moe_scratch *s, int na,
                         int n_rows, double t0)
{
    const struct model_desc *md = &ctx->m->desc;
    int E = md->n_expert, d = md->d_model;
    double flops = 0.0, bytes = 0.0;
    for (int e = 0; e < E; e++) {
        if (s->expert_count[e] == 0) continue;
        /* atomic: with replicas, two devices' threads count the same expert at once */
        __atomic_fetch_add(&ctx->stats->expert_rows[(size_t)ctx->layer * E + e],
                           (uint64_t)s->expert_count[e], __ATOMIC_RELAXED);
        flops += 6.0 * d * md->expert_d_ff[e] * s->expert_count[e];
        const struct ffn_w *f = &ctx->m->layers[ctx->layer].experts[e];
        bytes += (double)(wtype_bytes(f->gate->type, f->gate->rows, f->gate->cols) +
                          wtype_bytes(f->up->type, f->up->rows, f->up->cols) +
                          wtype_bytes(f->down->type, f->down->rows, f->down->cols));
    }
    if (ctx->rank == 0) {
        ctx->stats->moe_calls++;
        ctx->stats->moe_active_experts += (uint64_t)na;
        ctx->stats->moe_weight_bytes += bytes;
        ctx->stats->moe_flops += flops;
    }
    ctx->stats->dev_routed_rows[ctx->rank] += (uint64_t)n_rows;
    ctx->stats->dev_expert_flops[ctx->rank] += flops;
    ctx->stats->layer_dev_flops[(size_t)ctx->moe_layer * ctx->comm->n_rank + ctx->rank] += flops;
    ctx->stats->dev_width_rows[ctx->rank] += flops / (6.0 * d);
    ctx->stats->dev_busy_s[ctx->rank] += ms_now() - t0;
}

/* Dedup, on the receiving device: expands the n_recv token rows in s->recv to one row per
 * expert in their lists (in expert order; each expert's rows in arrival order, which is global
 * token order), runs the experts, and sums each token's outputs with its weights in list (slot)
 * order into out_rows (n_recv, d): the partial sums that go back. */
static void compute_tokens(const struct moe_ctx *ctx, struct moe_scratch *s, int n_recv)
{
    const struct model_desc *md = &ctx->m->desc;
    struct backend *be = ctx->be;
    int E = md->n_expert, K = md->top_k, d = md->d_model;
    size_t M = 2 * (size_t)K, nk = (size_t)n_recv * K;
    double t0 = ms_now();
    be->ops->download(be, s->h_tmeta, s->trecv_meta, sizeof(int32_t) * M * (size_t)n_recv);
    int n_exp = 0;
    for (int r = 0; r < n_recv; r++)
        for (int c = 0; c < K; c++) {
            int32_t e = s->h_tmeta[(size_t)r * M + c];
            /* out of range only after a device or link failure (reported after the step) */
            if (e < 0 || e >= E) continue;
            s->h_recv_meta[n_exp] = e;
            s->h_tslot[n_exp++] = r * K + c;
        }
    int na = 0;
    plan_experts(ctx, s, n_exp, &na);
    int32_t *perm = s->h_tidx, *cmap = s->h_tidx + n_exp;
    for (size_t i = 0; i < nk; i++) {
        cmap[i] = -1;
        s->h_tcw[i] = 0.0f;
    }
    for (int p = 0; p < n_exp; p++) {
        int sl = s->h_tslot[s->h_expert_perm[p]];
        float w;
        memcpy(&w, &s->h_tmeta[(size_t)(sl / K) * M + K + sl % K], sizeof w);
        perm[p] = sl / K;
        cmap[sl] = p;
        /* Llama 4: the expert computes on the token times its weight, its output adds with 1 */
        if (md->router_scales_input) s->h_row_w[p] = w;
        s->h_tcw[sl] = md->router_scales_input ? 1.0f : w;
    }
    be->ops->upload(be, s->tidx, s->h_tidx, sizeof(int32_t) * ((size_t)n_exp + nk));
    be->ops->upload(be, s->tcw, s->h_tcw, sizeof(float) * nk);
    be->ops->gather_rows(be, s->xe, s->recv, s->tidx, n_exp, d);
    if (md->router_scales_input && n_exp > 0) {
        be->ops->upload(be, s->row_w, s->h_row_w, sizeof(float) * (size_t)n_exp);
        be->ops->mul_rows(be, s->xe, s->row_w, n_exp, d);
    }
    be->ops->moe_experts(be, s->ye, s->xe, d, na, s->h_ex_off, s->h_experts, s->gate, s->up);
    be->ops->moe_combine(be, s->out_rows, s->ye, s->tidx + n_exp, s->tcw, n_recv, K, d);
    expert_stats(ctx, s, na, n_exp, t0);
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
        if (md->expert_act == FFN_ACT_SILU_CLAMP) {
            /* DeepSeek-V4's shared expert clamps like its routed ones: the experts op over
             * every row */
            const struct ffn_w *f = &lw->shared[i];
            struct be_expert ex = {.d_ff = f->d_ff, .gate = f->gate, .up = f->up, .down = f->down,
                                   .act = BE_ACT_SILU_CLAMP, .limit = md->act_limit};
            int off[2] = {0, n};
            be->ops->moe_experts(be, s->shared_out, h, d, 1, off, &ex, s->gate, s->up);
        } else {
            moe_ffn_rows(be, &lw->shared[i], d, h, n, s->shared_out, s->gate, s->up);
        }
        if (md->shared_gate == SHARED_GATE_SIGMOID) {
            be->ops->add_scaled_rows(be, out, s->shared_out, s->shared_gate, n, d, 1);
        } else {
            be->ops->add(be, out, s->shared_out, n, d);
        }
    }
}

/* Rows that arrived in an exchange (recv_counts summed). A failed exchange (rc != 0) leaves the
 * counts unknown: none, rather than reading past the buffers (the communicator reports why after
 * the step). */
static int received(const struct comm *comm, struct moe_scratch *s, int rc, int cap)
{
    int n_recv = 0;
    for (int r = 0; r < comm->n_rank; r++) n_recv += s->recv_counts[r];
    if (rc != 0 || n_recv < 0 || n_recv > cap) {
        n_recv = 0;
        memset(s->recv_counts, 0, sizeof(int) * (size_t)comm->n_rank);
    }
    return n_recv;
}

/* Rows dispatch after the gather: Llama 4's input scale, the exchange, the experts, and the
 * results back. Returns the rows to combine, in send order. */
static const float *exchange_rows(const struct moe_ctx *ctx, struct moe_scratch *s, int n,
                                  int rows)
{
    const struct model_desc *md = &ctx->m->desc;
    struct backend *be = ctx->be;
    struct comm *comm = ctx->comm;
    int K = md->top_k;
    size_t row_bytes = sizeof(float) * (size_t)md->d_model;
    if (md->router_scales_input && rows > 0) {
        /* Llama 4: an expert computes on the token times its weight, and its output is added
         * with weight 1 */
        size_t nk = (size_t)n * K;
        be->ops->download(be, s->h_top_w, s->top_w, sizeof(float) * nk);
        for (size_t i = 0; i < nk; i++) {
            if (s->h_slot_row[i] >= 0) s->h_row_w[s->h_slot_row[i]] = s->h_top_w[i];
            s->h_top_w[i] = s->h_slot_row[i] >= 0 ? 1.0f : 0.0f;
        }
        be->ops->upload(be, s->row_w, s->h_row_w, sizeof(float) * (size_t)rows);
        be->ops->upload(be, s->top_w, s->h_top_w, sizeof(float) * nk);
        be->ops->mul_rows(be, s->send, s->row_w, rows, md->d_model);
    }
    if (comm->n_rank == 1) {
        /* Nothing to exchange: the rows this device sends are the rows it computes. */
        memcpy(s->h_recv_meta, s->h_send_meta, sizeof(int32_t) * (size_t)rows);
        compute_experts(ctx, s, s->send, rows, s->out_rows);
        return s->out_rows;
    }
    be->ops->upload(be, s->send_meta, s->h_send_meta, sizeof(int32_t) * (size_t)rows);
    int rc = comm->ops->all_to_all_v(comm, ctx->rank, s->send, s->send_counts, s->recv,
                                     s->recv_counts, row_bytes);
    rc |= comm->ops->all_to_all_v(comm, ctx->rank, s->send_meta, s->send_counts, s->recv_meta,
                                  s->recv_counts, sizeof(int32_t));
    int n_recv = received(comm, s, rc, s->max_rows);
    be->ops->download(be, s->h_recv_meta, s->recv_meta, sizeof(int32_t) * (size_t)n_recv);
    compute_experts(ctx, s, s->recv, n_recv, s->out_rows);
    /* Results go back the way the rows came: what rank r received from s returns to s. The
     * reply lands in `back` in the order the rows were sent. */
    int *counts_back = s->send_counts; /* overwritten with what arrives, the same numbers */
    comm->ops->all_to_all_v(comm, ctx->rank, s->out_rows, s->recv_counts, s->back, counts_back,
                            row_bytes);
    return s->back;
}

/* Tokens dispatch after the gather: the token rows and their expert lists out, the experts and
 * the local combine on each device, the partial sums back. Returns them in send order, and
 * leaves in top_w the weights (1) the origin's combine adds them with. */
static const float *exchange_tokens(const struct moe_ctx *ctx, struct moe_scratch *s, int n,
                                    int rows)
{
    const struct model_desc *md = &ctx->m->desc;
    struct backend *be = ctx->be;
    struct comm *comm = ctx->comm;
    size_t nk = (size_t)n * md->top_k, row_bytes = sizeof(float) * (size_t)md->d_model;
    size_t meta = 2 * sizeof(int32_t) * (size_t)md->top_k;
    /* each partial once, at its device's first slot: summed in order of first appearance */
    for (size_t i = 0; i < nk; i++) s->h_top_w[i] = s->h_slot_row[i] >= 0 ? 1.0f : 0.0f;
    be->ops->upload(be, s->top_w, s->h_top_w, sizeof(float) * nk);
    be->ops->upload(be, s->tsend_meta, s->h_tmeta, meta * (size_t)rows);
    int rc = comm->ops->all_to_all_v(comm, ctx->rank, s->send, s->send_counts, s->recv,
                                     s->recv_counts, row_bytes);
    rc |= comm->ops->all_to_all_v(comm, ctx->rank, s->tsend_meta, s->send_counts, s->trecv_meta,
                                  s->recv_counts, meta);
    /* at most one row per token of the step comes in */
    int n_recv = received(comm, s, rc, s->max_tokens);
    compute_tokens(ctx, s, n_recv);
    int *counts_back = s->send_counts; /* overwritten with what arrives, the same numbers */
    comm->ops->all_to_all_v(comm, ctx->rank, s->out_rows, s->recv_counts, s->back, counts_back,
                            row_bytes);
    return s->back;
}

void moe_forward(const struct moe_ctx *ctx, struct moe_scratch *s, const float *h,
                 const int32_t *tok_k, int n, float *out)
{
    const struct model_desc *md = &ctx->m->desc;
    struct backend *be = ctx->be;
    int d = md->d_model, K = md->top_k;
    bool dedup = ctx->dedup && ctx->comm->n_rank > 1;

    moe_route(ctx->m, ctx->layer, be, h, n, tok_k, ctx->ids, s->logits, s->top_idx, s->top_w);
    be->ops->download(be, s->h_top_idx, s->top_idx, sizeof(int32_t) * (size_t)n * K);
    if (dedup) be->ops->download(be, s->h_top_w, s->top_w, sizeof(float) * (size_t)n * K);
    int rows = dedup ? plan_tokens(ctx, s, n) : plan_dispatch(ctx, s, n);
    if (ctx->route_ids) {
        /* Routing capture (statistics, traces): the ids as dispatched, and their weights. */
        memcpy(ctx->route_ids, s->h_top_idx, sizeof(int32_t) * (size_t)n * K);
        size_t wb = sizeof(float) * (size_t)n * K;
        if (ctx->route_w && dedup) /* already on the host for plan_tokens */
            memcpy(ctx->route_w, s->h_top_w, wb);
        else if (ctx->route_w)
            be->ops->download(be, ctx->route_w, s->top_w, wb);
    }
    /* One upload for both index arrays: slot rows (n*K), then the send order (rows). */
    memcpy(s->h_expert_perm, s->h_slot_row, sizeof(int32_t) * (size_t)n * K);
    memcpy(s->h_expert_perm + (size_t)n * K, s->h_send_perm, sizeof(int32_t) * (size_t)rows);
    be->ops->upload(be, s->idx, s->h_expert_perm, sizeof(int32_t) * ((size_t)n * K + rows));
    const int32_t *slot_row = s->idx, *send_perm = s->idx + (size_t)n * K;
    be->ops->gather_rows(be, s->send, h, send_perm, rows, d);
    const float *back = dedup ? exchange_tokens(ctx, s, n, rows) : exchange_rows(ctx, s, n, rows);
    be->ops->moe_combine(be, out, back, slot_row, s->top_w, n, K, d);
    if (md->n_shared > 0) shared_experts(ctx, s, h, n, out);
}
