/* Engine: device set, step scheduling across device threads, and the forward pass. The forward
 * pass reads only struct model_desc, never the architecture name: attention (GQA + RoPE, with
 * optional qkv bias, q/k norm per head or over the projection, qkv clipping, sliding window),
 * then a dense FFN or an MoE layer (router -> dispatch -> experts -> combine, plus shared
 * experts). Every buffer is allocated in engine_create; a step allocates nothing. */
#include "engine.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend.h"
#include "comm.h"
#include "common.h"
#include "moe.h"

/* Per-device state: a backend instance, the slice of the batch it owns in the current step,
 * and its scratch buffers. */
struct device {
    int rank;
    struct engine *e;
    struct backend *be;
    pthread_t thread;
    bool has_thread;

    /* slice of the current step */
    int item0, item1;  /* items [item0, item1) */
    int tok0, n_tok;   /* flat token range */

    /* activations, (T, ...) with T = max_batch_tokens */
    float *x;          /* (T, d_model) residual stream */
    float *h;          /* (T, d_model) normed */
    float *q;          /* (T, n_head*head_dim) */
    float *k;          /* (T, n_kv_head*head_dim) */
    float *v;          /* (T, n_kv_head*head_dim) */
    float *att;        /* (T, n_head*head_dim) */
    float *tmp;        /* (T, d_model) */
    float *scores;     /* (max_model_len) attention scratch */
    int32_t *ids;      /* (T) */
    int32_t *pos;      /* (T) */
    int32_t *tok_k;    /* (T) experts per token */

    struct moe_scratch moe;
};

struct engine {
    const struct model *m;
    struct engine_params p;
    int n_dev;
    struct device *dev;
    struct comm *comm;
    struct kv_cache kv;
    int *owner;           /* (n_expert) */
    float *cos_sin;       /* (max_model_len, head_dim/2, 2) */
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
    struct engine_item *items;
    int n_items;
    int32_t *item_tok0;   /* (max_seqs) flat offset of each item */

    struct engine_stats stats;
};

void engine_params_default(struct engine_params *p)
{
    memset(p, 0, sizeof *p);
    p->n_devices = 1;
    p->max_batch_tokens = 512;
    p->max_seqs = 16;
    p->max_model_len = 0;
    p->kv_block_size = 16;
    p->kv_cache_bytes = 0;
    p->placement = NULL;
}

/* --- forward pieces ------------------------------------------------------------------------ */

static void attention_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &e->m->layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model, hd = md->head_dim;
    int qdim = md->n_head * hd, kvdim = md->n_kv_head * hd;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->attn_norm, n, d, md->rms_eps);
    be->ops->matmul(be, dv->q, dv->h, lw->wq, lw->bq, n, d, qdim);
    be->ops->matmul(be, dv->k, dv->h, lw->wk, lw->bk, n, d, kvdim);
    be->ops->matmul(be, dv->v, dv->h, lw->wv, lw->bv, n, d, kvdim);
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
    be->ops->rope(be, dv->q, dv->pos, n, md->n_head, hd, e->cos_sin);
    be->ops->rope(be, dv->k, dv->pos, n, md->n_kv_head, hd, e->cos_sin);

    for (int it = dv->item0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        int off = e->item_tok0[it] - dv->tok0;
        be->ops->kv_write(be, e->kv.k[l], e->kv.v[l], dv->k + (size_t)off * kvdim,
                          dv->v + (size_t)off * kvdim, item->kv->blocks, e->kv.block_size,
                          item->pos, item->n_tokens, kvdim);
        be->ops->attention(be, dv->att + (size_t)off * qdim, dv->q + (size_t)off * qdim,
                           e->kv.k[l], e->kv.v[l], item->kv->blocks, e->kv.block_size, item->pos,
                           item->n_tokens, md->n_head, md->n_kv_head, hd, md->sliding_window,
                           e->attn_scale, dv->scores);
    }
    be->ops->matmul(be, dv->tmp, dv->att, lw->wo, NULL, n, qdim, d);
    be->ops->add(be, dv->x, dv->tmp, n, d);
}

static void ffn_layer(struct device *dv, int l)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    const struct layer_w *lw = &e->m->layers[l];
    struct backend *be = dv->be;
    int n = dv->n_tok, d = md->d_model;

    be->ops->rmsnorm(be, dv->h, dv->x, lw->ffn_norm, n, d, md->rms_eps);
    if (md->layer_is_moe[l]) {
        struct moe_ctx ctx = {
            .m = e->m,
            .layer = l,
            .be = be,
            .comm = e->comm,
            .rank = dv->rank,
            .owner = e->owner,
            .stats = &e->stats,
        };
        moe_forward(&ctx, &dv->moe, dv->h, dv->tok_k, n, dv->tmp);
    } else {
        moe_ffn_rows(be, &lw->dense, d, dv->h, n, dv->tmp, dv->moe.gate, dv->moe.up);
    }
    be->ops->add(be, dv->x, dv->tmp, n, d);
}

static void logits_out(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model *m = e->m;
    const struct model_desc *md = &m->desc;
    struct backend *be = dv->be;
    int d = md->d_model;
    for (int it = dv->item0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        if (item->n_logits <= 0) continue;
        int first = e->item_tok0[it] - dv->tok0 + item->n_tokens - item->n_logits;
        be->ops->rmsnorm(be, dv->h, dv->x + (size_t)first * d, m->norm, item->n_logits, d,
                         md->rms_eps);
        be->ops->matmul(be, item->logits, dv->h, m->lm_head, NULL, item->n_logits, d, md->vocab);
    }
}

static void device_forward(struct device *dv)
{
    struct engine *e = dv->e;
    const struct model_desc *md = &e->m->desc;
    int n = dv->n_tok;

    /* Flatten this device's items into ids/positions/expert budgets. */
    int t = 0;
    for (int it = dv->item0; it < dv->item1; it++) {
        const struct engine_item *item = &e->items[it];
        int k = item->moe_top_k > 0 && item->moe_top_k < md->top_k ? item->moe_top_k : md->top_k;
        for (int i = 0; i < item->n_tokens; i++, t++) {
            dv->ids[t] = item->tokens[i];
            dv->pos[t] = item->pos + i;
            dv->tok_k[t] = k;
        }
    }
    dv->be->ops->embed(dv->be, dv->x, e->m->embed, dv->ids, n, md->d_model);
    for (int l = 0; l < md->n_layer; l++) {
        attention_layer(dv, l);
        ffn_layer(dv, l);
    }
    logits_out(dv);
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

static int device_init(struct engine *e, struct device *dv, int rank, int blas_threads)
{
    const struct model_desc *md = &e->m->desc;
    size_t T = (size_t)e->p.max_batch_tokens;
    size_t d = (size_t)md->d_model;
    size_t qdim = (size_t)md->n_head * md->head_dim, kvdim = (size_t)md->n_kv_head * md->head_dim;
    bool ok = true;

    dv->rank = rank;
    dv->e = e;
    dv->be = backend_cpu_create(blas_threads);
    if (!dv->be) return -1;
    dv->x = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->h = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->tmp = dev_alloc(dv, T * d * sizeof(float), &ok);
    dv->q = dev_alloc(dv, T * qdim * sizeof(float), &ok);
    dv->att = dev_alloc(dv, T * qdim * sizeof(float), &ok);
    dv->k = dev_alloc(dv, T * kvdim * sizeof(float), &ok);
    dv->v = dev_alloc(dv, T * kvdim * sizeof(float), &ok);
    dv->scores = dev_alloc(dv, (size_t)e->p.max_model_len * sizeof(float), &ok);
    dv->ids = dev_alloc(dv, T * sizeof(int32_t), &ok);
    dv->pos = dev_alloc(dv, T * sizeof(int32_t), &ok);
    dv->tok_k = dev_alloc(dv, T * sizeof(int32_t), &ok);
    if (!ok) return -1;
    int dense_ff = md->dense_d_ff > 0 ? md->dense_d_ff : 0;
    return moe_scratch_init(&dv->moe, dv->be, e->m, e->p.max_batch_tokens, e->n_dev, dense_ff);
}

static void device_release(struct device *dv)
{
    if (!dv->be) return;
    struct backend *be = dv->be;
    void *bufs[] = {dv->x,      dv->h,   dv->tmp, dv->q,    dv->att, dv->k,
                    dv->v,      dv->scores, dv->ids, dv->pos, dv->tok_k};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    moe_scratch_release(&dv->moe, be);
    be->ops->destroy(be);
    dv->be = NULL;
}

static int build_rope_table(struct engine *e)
{
    const struct model_desc *md = &e->m->desc;
    int half = md->head_dim / 2;
    e->cos_sin = malloc(sizeof(float) * 2 * (size_t)half * e->p.max_model_len);
    if (!e->cos_sin) return -1;
    for (int j = 0; j < half; j++) {
        /* Same float32 arithmetic as the reference: inv_freq = 1 / theta^(2j/hd). */
        float inv_freq = 1.0f / powf(md->rope_theta, (float)(2 * j) / (float)md->head_dim);
        for (int p = 0; p < e->p.max_model_len; p++) {
            float f = (float)p * inv_freq;
            e->cos_sin[((size_t)p * half + j) * 2] = cosf(f);
            e->cos_sin[((size_t)p * half + j) * 2 + 1] = sinf(f);
        }
    }
    return 0;
}

int engine_create(const struct model *m, const struct engine_params *p, struct engine **out,
                  char *err, size_t errlen)
{
    const struct model_desc *md = &m->desc;
    *out = NULL;
    if (md->attn != ATTN_KIND_GQA)
        return ms_errf(err, errlen, "%s: attention kind not supported by the engine yet",
                       md->model_type);
    if (md->router != ROUTER_KIND_SOFTMAX_TOPK && md->router != ROUTER_KIND_MOHGE &&
        md->n_expert > 0)
        return ms_errf(err, errlen, "%s: router kind not supported by the engine yet",
                       md->model_type);
    if (p->n_devices < 1 || p->n_devices > 64)
        return ms_errf(err, errlen, "devices must be between 1 and 64, got %d", p->n_devices);
    if (p->max_batch_tokens < 1 || p->max_seqs < 1 || p->kv_block_size < 1)
        return ms_errf(err, errlen, "max_batch_tokens, max_seqs and kv_block_size must be >= 1");
    if (md->head_dim % 2 != 0)
        return ms_errf(err, errlen, "head_dim %d must be even for RoPE", md->head_dim);

    struct engine *e = calloc(1, sizeof *e);
    if (!e) return ms_errf(err, errlen, "out of memory");
    e->m = m;
    e->p = *p;
    if (e->p.max_model_len <= 0)
        e->p.max_model_len = md->max_pos > 0 && md->max_pos < 4096 ? md->max_pos : 4096;
    if (md->max_pos > 0 && e->p.max_model_len > md->max_pos) {
        free(e);
        return ms_errf(err, errlen, "max_model_len %d exceeds the model's %d positions",
                       p->max_model_len, md->max_pos);
    }
    e->n_dev = p->n_devices;
    e->attn_scale = 1.0f / sqrtf((float)md->head_dim);

    e->owner = malloc(sizeof(int) * (size_t)(md->n_expert > 0 ? md->n_expert : 1));
    e->item_tok0 = malloc(sizeof(int32_t) * (size_t)p->max_seqs);
    e->dev = calloc((size_t)e->n_dev, sizeof *e->dev);
    e->stats.dev_routed_rows = calloc((size_t)e->n_dev, sizeof(uint64_t));
    e->stats.dev_expert_flops = calloc((size_t)e->n_dev, sizeof(double));
    e->stats.dev_busy_s = calloc((size_t)e->n_dev, sizeof(double));
    e->stats.expert_rows =
        calloc((size_t)md->n_layer * (md->n_expert > 0 ? md->n_expert : 1), sizeof(uint64_t));
    if (!e->owner || !e->item_tok0 || !e->dev || !e->stats.dev_routed_rows ||
        !e->stats.dev_expert_flops || !e->stats.dev_busy_s || !e->stats.expert_rows) {
        ms_errf(err, errlen, "out of memory");
        goto fail;
    }
    /* MoHGE without an explicit map: All-size Group-decoupling (every device gets every width). */
    bool mohge_place = !p->placement && md->router == ROUTER_KIND_MOHGE && md->n_expert > 0;
    if (mohge_place) moe_mohge_placement(md, e->n_dev, e->owner);
    for (int x = 0; x < md->n_expert; x++) {
        int o = p->placement  ? p->placement[x]
                : mohge_place ? e->owner[x]
                              : (int)((long)x * e->n_dev / md->n_expert);
        if (o < 0 || o >= e->n_dev) {
            ms_errf(err, errlen, "placement: expert %d on device %d, but there are %d devices", x,
                    o, e->n_dev);
            goto fail;
        }
        e->owner[x] = o;
    }
    if (build_rope_table(e) != 0) {
        ms_errf(err, errlen, "out of memory for the RoPE table");
        goto fail;
    }
    e->comm = comm_local_create(e->n_dev);
    if (!e->comm) {
        ms_errf(err, errlen, "cannot create the communicator for %d devices", e->n_dev);
        goto fail;
    }

    /* BLAS threads: split the cores between devices; concurrent callers each get one thread
     * when there are more devices than cores. */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int blas_threads = (int)(ncpu / e->n_dev) > 1 ? (int)(ncpu / e->n_dev) : 1;
    openblas_set_num_threads(blas_threads);

    for (int r = 0; r < e->n_dev; r++) {
        if (device_init(e, &e->dev[r], r, blas_threads) != 0) {
            ms_errf(err, errlen, "out of memory for device %d scratch buffers", r);
            goto fail;
        }
    }

    size_t block_bytes =
        kv_block_bytes(md->n_layer, md->n_kv_head, md->head_dim, e->p.kv_block_size);
    size_t blocks_per_seq = (size_t)(e->p.max_model_len + e->p.kv_block_size - 1) /
                            (size_t)e->p.kv_block_size;
    size_t n_blocks = e->p.kv_cache_bytes ? e->p.kv_cache_bytes / block_bytes
                                          : blocks_per_seq * (size_t)e->p.max_seqs;
    if (n_blocks < 1 || n_blocks > INT32_MAX) {
        ms_errf(err, errlen, "KV cache of %zu bytes holds %zu blocks of %zu bytes",
                e->p.kv_cache_bytes, n_blocks, block_bytes);
        goto fail;
    }
    if (kv_create(&e->kv, e->dev[0].be, md->n_layer, md->n_kv_head, md->head_dim,
                  e->p.kv_block_size, (int)n_blocks, err, errlen) != 0)
        goto fail;

    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->sync_init = true;
    for (int r = 1; r < e->n_dev; r++) {
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
    if (e->kv.k) kv_destroy(&e->kv);
    for (int r = 0; e->dev && r < e->n_dev; r++) device_release(&e->dev[r]);
    if (e->comm) e->comm->ops->destroy(e->comm);
    free(e->cos_sin);
    free(e->owner);
    free(e->item_tok0);
    free(e->dev);
    free(e->stats.dev_routed_rows);
    free(e->stats.dev_expert_flops);
    free(e->stats.dev_busy_s);
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
    kv_seq_free(&e->kv, s);
}

/* Splits items into n_dev contiguous slices with about the same number of tokens each. */
static void partition(struct engine *e, int total)
{
    int item = 0;
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
    for (int i = 0; i < n_items; i++)
        if (kv_seq_reserve(&e->kv, items[i].kv, items[i].pos + items[i].n_tokens) != 0)
            return ms_errf(err, errlen, "item %d: cannot reserve KV blocks", i);

    e->items = items;
    e->n_items = n_items;
    partition(e, total);
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
    e->stats.steps++;
    e->stats.tokens += (uint64_t)total;
    return 0;
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

const struct engine_stats *engine_get_stats(const struct engine *e)
{
    return &e->stats;
}

int engine_expert_owner(const struct engine *e, int expert)
{
    return e->owner[expert];
}
