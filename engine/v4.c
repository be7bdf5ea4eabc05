/* DeepSeek-V4's hyper-connections and attention block on any backend with the V4 ops (see
 * v4.h for the cache layout and why a step writes its rows twice). Shapes follow transformers'
 * DeepseekV4Attention: a query LoRA (q_a_proj, q_a_norm, q_b_proj), each head RMS-normed
 * without weight; one key per token (kv_proj, kv_norm) that is also the value; interleaved
 * RoPE on the last rope_dim of each head, undone on the output at the query's position (the
 * value carried the key's rotation); sinks; the grouped output projection (o_a_proj per group,
 * o_b_proj). */
#include "v4.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

int v4_rope_tables(const struct model_desc *md, int max_len,
                   float (*inv_freq)(const struct model_desc *md, float theta, bool yarn, int j),
                   float *tabs[4])
{
    int half = md->rope_dim / 2;
    size_t per = (size_t)max_len * (size_t)half * 2;
    for (int t = 0; t < 4; t++) {
        tabs[t] = malloc(sizeof(float) * (per > 0 ? per : 1));
        if (!tabs[t]) {
            for (int u = 0; u < t; u++)
                free(tabs[u]);
            return -1;
        }
    }
    for (int kind = 0; kind < 2; kind++) { /* main (sliding layers), compress */
        float theta = kind ? md->v4_compress_theta : md->rope_theta;
        bool yarn = kind && md->rope_yarn;
        float af = yarn ? md->rope_attn_factor : 1.0f;
        float *fw = tabs[2 * kind], *bw = tabs[2 * kind + 1];
        for (int j = 0; j < half; j++) {
            float f0 = inv_freq(md, theta, yarn, j);
            for (int p = 0; p < max_len; p++) {
                float f = (float)p * f0, c = cosf(f) * af, s = sinf(f) * af;
                size_t at = ((size_t)p * half + j) * 2;
                fw[at] = bw[at] = c;
                fw[at + 1] = s;
                bw[at + 1] = -s;
            }
        }
    }
    return 0;
}

int v4_scratch_init(struct v4_scratch *s, struct backend *be, const struct model_desc *md,
                    int max_tokens, int max_len, float *const tabs[4])
{
    memset(s, 0, sizeof *s);
    int k_row, v_row;
    model_kv_rows(md, &k_row, &v_row);
    size_t T = (size_t)max_tokens, hc = (size_t)md->v4_hc, D = (size_t)md->d_model;
    size_t n_ones = hc * D > (size_t)md->head_dim ? hc * D : (size_t)md->head_dim;
    size_t tab = (size_t)max_len * (size_t)md->rope_dim;
    s->k_row = k_row;
    struct {
        void **p;
        size_t bytes;
    } bufs[] = {
        {(void **)&s->xs, T * hc * D * 4},
        {(void **)&s->xs2, T * hc * D * 4},
        {(void **)&s->xn, T * hc * D * 4},
        {(void **)&s->mix, T * hc * (2 + hc) * 4},
        {(void **)&s->post, T * hc * 4},
        {(void **)&s->comb, T * hc * hc * 4},
        {(void **)&s->ones, n_ones * 4},
        {(void **)&s->expand, T * hc * 4},
        {(void **)&s->row, T * (size_t)k_row * 4},
        {(void **)&s->qr, T * (size_t)md->q_lora_rank * 4},
        {(void **)&s->og, T * (size_t)md->o_groups * md->o_lora_rank * 4},
        {(void **)&s->tab[0], tab * 4},
        {(void **)&s->tab[1], tab * 4},
        {(void **)&s->tab[2], tab * 4},
        {(void **)&s->tab[3], tab * 4},
    };
    size_t host_n = n_ones > T * hc ? n_ones : T * hc;
    host_n = host_n > T * (size_t)k_row ? host_n : T * (size_t)k_row;
    float *host = calloc(host_n, sizeof(float));
    if (!host) return -1;
    int rc = 0;
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0] && rc == 0; i++) {
        *bufs[i].p = be->ops->alloc(be, bufs[i].bytes > 0 ? bufs[i].bytes : 4);
        if (!*bufs[i].p) rc = -1;
    }
    if (rc == 0) {
        /* the rows start zeroed: each layer clears them by scaling (finite values only) */
        be->ops->upload(be, s->row, host, T * (size_t)k_row * 4);
        for (size_t i = 0; i < n_ones; i++)
            host[i] = 1.0f;
        be->ops->upload(be, s->ones, host, n_ones * 4);
        int32_t *idx = (int32_t *)host;
        for (size_t r = 0; r < T * hc; r++)
            idx[r] = (int32_t)(r / hc);
        be->ops->upload(be, s->expand, idx, T * hc * 4);
        for (int t = 0; t < 4; t++)
            be->ops->upload(be, (void *)s->tab[t], tabs[t], tab * 4);
    }
    free(host);
    if (rc != 0) v4_scratch_release(s, be);
    return rc;
}

void v4_scratch_release(struct v4_scratch *s, struct backend *be)
{
    void *bufs[] = {s->xs,
                    s->xs2,
                    s->xn,
                    s->mix,
                    s->post,
                    s->comb,
                    s->ones,
                    s->expand,
                    s->row,
                    s->qr,
                    s->og,
                    (void *)s->tab[0],
                    (void *)s->tab[1],
                    (void *)s->tab[2],
                    (void *)s->tab[3]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    memset(s, 0, sizeof *s);
}

const char *v4_backend_missing(const struct backend *be)
{
    const struct backend_ops *o = be->ops;
    return !o->hc_pre         ? "hc_pre"
           : !o->hc_post      ? "hc_post"
           : !o->v4_compress  ? "v4_compress"
           : !o->v4_attention ? "v4_attention"
           : !o->dsa_select   ? "dsa_select"
           : !o->matmul_ld    ? "matmul_ld"
           : !o->rmsnorm_ld   ? "rmsnorm_ld"
           : !o->rope_ex      ? "rope_ex"
           : !o->scale        ? "scale"
                              : NULL;
}

/* --- hyper-connections ---------------------------------------------------------------------- */

void v4_streams_begin(const struct v4_step *st, const float *x)
{
    const struct model_desc *md = &st->w->desc;
    st->be->ops->gather_rows(st->be, st->s->xs, x, st->s->expand, st->n * md->v4_hc, md->d_model);
}

/* The streams flattened and RMS-normed without weight, times fn: s->mix (n, rows). */
static void streams_mix(const struct v4_step *st, const struct wmat *fn, int rows)
{
    const struct model_desc *md = &st->w->desc;
    struct backend *be = st->be;
    struct v4_scratch *s = st->s;
    int flat = md->v4_hc * md->d_model;
    be->ops->rmsnorm(be, s->xn, s->xs, s->ones, st->n, flat, md->rms_eps);
    be->ops->matmul(be, s->mix, s->xn, fn, NULL, st->n, flat, rows);
}

void v4_streams_collapse(const struct v4_step *st, int l, int which, float *y)
{
    const struct model_desc *md = &st->w->desc;
    const struct layer_w *lw = &st->w->layers[l];
    struct v4_scratch *s = st->s;
    int hc = md->v4_hc;
    streams_mix(st, lw->hc_fn[which], hc * (2 + hc));
    struct be_hc h = {.n_stream = hc,
                      .iters = md->v4_hc_iters,
                      .eps = md->v4_hc_eps,
                      .base = lw->hc_base[which],
                      .scale = lw->hc_scale[which]};
    st->be->ops->hc_pre(st->be, s->post, s->comb, y, s->xs, s->mix, st->n, md->d_model, &h);
}

void v4_streams_end(const struct v4_step *st, const float *out)
{
    const struct model_desc *md = &st->w->desc;
    struct v4_scratch *s = st->s;
    st->be->ops->hc_post(st->be, s->xs2, s->xs, out, s->post, s->comb, st->n, md->d_model,
                         md->v4_hc);
    float *t = s->xs;
    s->xs = s->xs2;
    s->xs2 = t;
}

void v4_streams_head(const struct v4_step *st, float *y)
{
    const struct model_desc *md = &st->w->desc;
    struct v4_scratch *s = st->s;
    streams_mix(st, st->w->hc_head_fn, md->v4_hc);
    struct be_hc h = {.n_stream = md->v4_hc,
                      .iters = 0,
                      .eps = md->v4_hc_eps,
                      .base = st->w->hc_head_base,
                      .scale = st->w->hc_head_scale};
    st->be->ops->hc_pre(st->be, NULL, NULL, y, s->xs, s->mix, st->n, md->d_model, &h);
}

/* --- attention ------------------------------------------------------------------------------ */

/* The compressor (which 0) or CSA indexer (1) of layer l: the step's rows' entries. */
static void compress(const struct v4_step *st, int l, int which)
{
    const struct model_desc *md = &st->w->desc;
    const struct layer_w *lw = &st->w->layers[l];
    struct model_v4_row r = model_v4_row(md, md->v4_attn[l]);
    struct v4_scratch *s = st->s;
    bool csa = md->v4_attn[l] == V4_ATTN_CSA;
    struct be_v4cmp p = {.rate = md->v4_rate[md->v4_attn[l]],
                         .c = which ? md->dsa_dim : md->head_dim,
                         .overlap = csa,
                         .kv_off = which ? r.ikv : r.ckv,
                         .gate_off = which ? r.igate : r.cgate,
                         .k_row = s->k_row,
                         .bias = lw->cmp_bias[which],
                         .norm = lw->cmp_norm[which],
                         .eps = md->rms_eps,
                         .rot_dim = md->rope_dim,
                         .cos_sin = s->tab[2]};
    st->be->ops->v4_compress(st->be, s->row + (which ? r.ient : r.cent), s->k_row, &st->kvl[l],
                             st->tk, st->block_size, st->n, &p);
}

/* The step's cache rows of layer l: the rotated key, and the compressor's (and CSA indexer's)
 * kv and gate projections; the entries are zero until compress() fills them. */
static void write_rows(const struct v4_step *st, int l, const float *h, const float *tab)
{
    const struct model_desc *md = &st->w->desc;
    const struct layer_w *lw = &st->w->layers[l];
    struct backend *be = st->be;
    struct v4_scratch *s = st->s;
    struct model_v4_row r = model_v4_row(md, md->v4_attn[l]);
    int n = st->n, D = md->d_model, hd = md->head_dim, rd = md->rope_dim, K = s->k_row;
    be->ops->scale(be, s->row, n, K, 0.0f); /* no stale columns of another layer kind */
    be->ops->matmul_ld(be, s->row, K, h, D, lw->v4_wkv, n, D, hd);
    be->ops->rmsnorm_ld(be, s->row, s->row, lw->v4_kv_norm, n, hd, K, md->rms_eps);
    be->ops->rope_ex(be, s->row + hd - rd, K, s->row + hd - rd, K, st->pos, n, 1, rd, 1, tab);
    for (int which = 0; which < 2; which++) {
        if (!lw->cmp_wkv[which]) continue;
        int c = which ? 2 * md->dsa_dim : r.c;
        be->ops->matmul_ld(be, s->row + (which ? r.ikv : r.ckv), K, h, D, lw->cmp_wkv[which], n, D,
                           c);
        be->ops->matmul_ld(be, s->row + (which ? r.igate : r.cgate), K, h, D, lw->cmp_wgate[which],
                           n, D, c);
    }
}

void v4_attention_block(const struct v4_step *st, int l, const float *h, float *out)
{
    const struct model_desc *md = &st->w->desc;
    const struct layer_w *lw = &st->w->layers[l];
    struct backend *be = st->be;
    struct v4_scratch *s = st->s;
    int kind = md->v4_attn[l], n = st->n, D = md->d_model, H = md->n_head, hd = md->head_dim;
    int rd = md->rope_dim, qr = md->q_lora_rank, K = s->k_row;
    int Hi = md->dsa_heads, Di = md->dsa_dim;
    bool comp = kind != V4_ATTN_SLIDING, csa = kind == V4_ATTN_CSA;
    struct model_v4_row r = model_v4_row(md, kind);
    const float *tab = s->tab[comp ? 2 : 0], *inv = s->tab[comp ? 3 : 1];

    /* queries: the latent, each head normed without weight, rotated */
    be->ops->matmul(be, s->qr, h, lw->wq_a, NULL, n, D, qr);
    be->ops->rmsnorm(be, s->qr, s->qr, lw->q_a_norm, n, qr, md->rms_eps);
    be->ops->matmul(be, st->q, s->qr, lw->wq_b, NULL, n, qr, H * hd);
    be->ops->rmsnorm(be, st->q, st->q, s->ones, n * H, hd, md->rms_eps);
    be->ops->rope_ex(be, st->q + hd - rd, hd, st->q + hd - rd, hd, st->pos, n, H, rd, 1, tab);

    write_rows(st, l, h, tab);
    be->ops->kv_write(be, &st->kvl[l], s->row, NULL, st->tk, st->block_size, n, K);
    if (comp) { /* the windows this step closes, from the rows just written */
        compress(st, l, 0);
        if (csa) compress(st, l, 1);
        be->ops->kv_write(be, &st->kvl[l], s->row, NULL, st->tk, st->block_size, n, K);
    }
    if (csa) { /* the lightning indexer's choice among the completed entries */
        be->ops->matmul(be, st->iq, s->qr, lw->idx_wq_b, NULL, n, qr, Hi * Di);
        be->ops->rope_ex(be, st->iq + Di - rd, Di, st->iq + Di - rd, Di, st->pos, n, Hi, rd, 1,
                         s->tab[2]);
        be->ops->matmul(be, st->iw, h, lw->idx_wproj, NULL, n, D, Hi);
        struct be_dsa p = {.n_head = Hi,
                           .dim = Di,
                           .k_off = r.ient,
                           .k_row = K,
                           .topk = md->dsa_topk,
                           .scale = 1.0f / sqrtf((float)Di),
                           .rate = md->v4_rate[kind]};
        be->ops->dsa_select(be, st->sel, st->sel_n, st->iq, st->iw, &st->kvl[l], st->tk,
                            st->block_size, n, &p);
    }
    struct be_v4attn a = {.n_head = H,
                          .dim = hd,
                          .k_row = K,
                          .window = md->sliding_window,
                          .rate = comp ? md->v4_rate[kind] : 0,
                          .ent_off = r.cent,
                          .scale = md->attn_scale,
                          .sinks = lw->sinks,
                          .sel = csa ? st->sel : NULL,
                          .sel_n = csa ? st->sel_n : NULL,
                          .sel_stride = md->dsa_topk};
    be->ops->v4_attention(be, st->att, st->q, &st->kvl[l], st->tk, st->block_size, n, &a);
    be->ops->rope_ex(be, st->att + hd - rd, hd, st->att + hd - rd, hd, st->pos, n, H, rd, 1, inv);

    /* grouped output projection: group g's heads through its o_lora_rank rows of o_a_proj */
    int G = md->o_groups, Rg = md->o_lora_rank, gin = H * hd / G;
    for (int g = 0; g < G; g++) {
        struct wmat wg = wmat_rows(lw->v4_wo_a, g * Rg, Rg); /* (Rg, gin) */
        be->ops->matmul_ld(be, s->og + (size_t)g * Rg, G * Rg, st->att + (size_t)g * gin, H * hd,
                           &wg, n, gin, Rg);
    }
    be->ops->matmul(be, out, s->og, lw->v4_wo_b, NULL, n, G * Rg, D);
}
