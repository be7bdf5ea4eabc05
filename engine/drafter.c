/* Draft-model speculation: the draft engine, its per-sequence K/V, and the batched drafting
 * rounds (catch-up chunks, then one step per draft position). See drafter.h. */
#include "drafter.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "spec.h"

struct drafter {
    const struct model *m;
    struct engine *e;
    /* MTP drafters: the module as a model (m points at it), each job's chained hidden state
     * (max_seqs, d_model), and a feed step's hidden rows (budget, d_model) */
    bool mtp;
    struct model view;
    int d_model;
    float *chain;
    float *feed_hid;
    struct drafter_feed **item_feed; /* (max_seqs) */
    int vocab;  /* the draft model's logit columns */
    int max_id; /* drafts are below it */
    int max_seqs, budget, max_k;
    float *q;                      /* (max_seqs, max_k, max_id) sampled jobs' draft distributions,
                                      or NULL: no sampling */
    struct engine_item *items;     /* (max_seqs) */
    struct drafter_job **item_job; /* (max_seqs) */
    float *logits;                 /* (max_seqs, vocab) */
};

int drafter_check(const struct model *target, const struct model *draft, char *err, size_t errlen)
{
    if (draft->desc.n_linear > 0)
        return ms_errf(err, errlen,
                       "model: the draft model (%s) has recurrent layers, whose "
                       "state could not be rolled back after a rejected draft",
                       draft->desc.model_type);
    if (!target->tok || !draft->tok)
        return ms_errf(err, errlen, "model: the target and draft models need tokenizers");
    int n = tok_vocab_size(target->tok);
    if (tok_vocab_size(draft->tok) != n)
        return ms_errf(err, errlen,
                       "model: the draft model's tokenizer has %d tokens, the "
                       "target's %d: another tokenizer",
                       tok_vocab_size(draft->tok), n);
    for (int32_t id = 0; id < n; id++) {
        const char *a = tok_token_str(target->tok, id), *b = tok_token_str(draft->tok, id);
        if ((a == NULL) != (b == NULL) || (a && strcmp(a, b) != 0) ||
            tok_is_special(target->tok, id) != tok_is_special(draft->tok, id))
            return ms_errf(err, errlen,
                           "model: the draft model's tokenizer differs from the "
                           "target's at token %d ('%s' vs '%s'): another tokenizer",
                           (int)id, b ? b : "", a ? a : "");
    }
    if (draft->desc.vocab < n || target->desc.vocab < n)
        return ms_errf(err, errlen,
                       "model: the draft model's vocabulary (%d logits) does not "
                       "cover the tokenizer's %d tokens",
                       draft->desc.vocab, n);
    return 0;
}

static int drafter_init(struct drafter *d, const struct model *draft, const struct engine_params *p,
                        int max_id, int max_k, struct drafter **out, char *err, size_t errlen);

int drafter_create(const struct model *draft, const struct engine_params *p, int max_id, int max_k,
                   struct drafter **out, char *err, size_t errlen)
{
    *out = NULL;
    struct drafter *d = calloc(1, sizeof *d);
    if (!d) return ms_errf(err, errlen, "out of memory");
    return drafter_init(d, draft, p, max_id, max_k, out, err, errlen);
}

int drafter_create_mtp(const struct model *target, const struct engine_params *p, int max_k,
                       struct drafter **out, char *err, size_t errlen)
{
    *out = NULL;
    if (target->n_mtp < 1)
        return ms_errf(err, errlen, "method: mtp needs a checkpoint with multi-token-prediction "
                                    "layers, loaded with them");
    struct drafter *d = calloc(1, sizeof *d);
    if (!d || model_mtp_view(target, 0, &d->view) != 0) {
        free(d);
        return ms_errf(err, errlen, "out of memory");
    }
    d->mtp = true;
    d->d_model = target->desc.d_model;
    int max_id = target->tok ? tok_vocab_size(target->tok) : target->desc.vocab;
    if (drafter_init(d, &d->view, p, max_id, max_k, out, err, errlen) != 0) return -1;
    size_t D = (size_t)d->d_model;
    d->chain = malloc(sizeof(float) * (size_t)d->max_seqs * D);
    d->feed_hid = malloc(sizeof(float) * (size_t)d->budget * D);
    d->item_feed = calloc((size_t)d->max_seqs, sizeof *d->item_feed);
    if (!d->chain || !d->feed_hid || !d->item_feed) {
        drafter_free(d);
        *out = NULL;
        return ms_errf(err, errlen, "out of memory");
    }
    return 0;
}

bool drafter_is_mtp(const struct drafter *d)
{
    return d->mtp;
}

/* Makes d's engine for `draft` and the buffers a round needs; frees d on failure. */
static int drafter_init(struct drafter *d, const struct model *draft, const struct engine_params *p,
                        int max_id, int max_k, struct drafter **out, char *err, size_t errlen)
{
    d->m = draft;
    d->vocab = draft->desc.vocab;
    d->max_id = max_id < d->vocab ? max_id : d->vocab;
    struct engine_params ep = *p;
    ep.kv_cache_bytes = 0; /* every running sequence's whole context: a round never waits */
    ep.map = NULL;
    ep.placement = NULL;
    ep.routing_stats = ENGINE_RSTATS_OFF;
    ep.capture_routing = ep.capture_weights = false;
    if (ep.comm) ep.n_devices = 1; /* rank 0 drafts alone, in this process */
    ep.comm = ep.data_comm = NULL;
    ep.spec_state = false;
    if (ep.n_devices < 1) ep.n_devices = 1;
    if (engine_create(draft, &ep, &d->e, err, errlen) != 0) {
        char why[MS_ERR_LEN];
        snprintf(why, sizeof why, "%s", err ? err : "");
        bool mtp = d->mtp;
        model_mtp_view_free(&d->view);
        free(d);
        return ms_errf(err, errlen, "%s: %s", mtp ? "the MTP engine" : "model: the draft engine",
                       why);
    }
    d->max_seqs = ep.max_seqs;
    d->budget = ep.max_batch_tokens;
    d->max_k = max_k < 1 ? 1 : max_k > SPEC_MAX_K ? SPEC_MAX_K : max_k;
    size_t qn = (size_t)d->max_seqs * (size_t)d->max_k * (size_t)d->max_id;
    if (qn * sizeof(float) <= ((size_t)512 << 20)) {
        d->q = malloc(sizeof(float) * qn);
        if (!d->q) {
            drafter_free(d);
            return ms_errf(err, errlen, "out of memory");
        }
    }
    d->items = calloc((size_t)d->max_seqs, sizeof *d->items);
    d->item_job = calloc((size_t)d->max_seqs, sizeof *d->item_job);
    d->logits = malloc(sizeof(float) * (size_t)d->max_seqs * (size_t)d->vocab);
    if (!d->items || !d->item_job || !d->logits) {
        drafter_free(d);
        return ms_errf(err, errlen, "out of memory");
    }
    *out = d;
    return 0;
}

void drafter_free(struct drafter *d)
{
    if (!d) return;
    engine_free(d->e);
    model_mtp_view_free(&d->view);
    free(d->chain);
    free(d->feed_hid);
    free(d->item_feed);
    free(d->q);
    free(d->items);
    free(d->item_job);
    free(d->logits);
    free(d);
}

struct engine *drafter_engine(struct drafter *d)
{
    return d->e;
}

bool drafter_samples(const struct drafter *d)
{
    return d->q != NULL;
}

/* The draft model's most likely token below max_id (the lowest id among equals). */
static int32_t argmax(const float *row, int n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (row[i] > row[best] || (isnan(row[best]) && !isnan(row[i]))) best = i;
    return best;
}

/* Draft `pos` of job j from its logits row: the argmax, or for a sampled job a draw from
 * softmax(row / temperature) over the ids below max_id, kept in its q row. */
static int32_t draft_token(struct drafter *d, int j, struct drafter_job *jb, int pos,
                           const float *row)
{
    if (!jb->q) return argmax(row, d->max_id);
    float *q = d->q + ((size_t)j * (size_t)d->max_k + (size_t)pos) * (size_t)d->max_id;
    float mx = -INFINITY;
    for (int i = 0; i < d->max_id; i++)
        if (row[i] > mx) mx = row[i];
    if (!(mx > -INFINITY) || !isfinite(mx)) {
        /* no usable distribution: a point mass at the argmax */
        int32_t a = argmax(row, d->max_id);
        for (int i = 0; i < d->max_id; i++)
            q[i] = i == a ? 1.0f : 0.0f;
        return a;
    }
    double sum = 0.0, inv_t = 1.0 / (double)jb->temperature;
    for (int i = 0; i < d->max_id; i++) {
        double w = isnan(row[i]) ? 0.0 : exp(((double)row[i] - (double)mx) * inv_t);
        q[i] = (float)w;
        sum += (double)q[i]; /* the draw below uses these very weights */
    }
    double u = ms_rng_uniform(jb->rng) * sum, acc = 0.0;
    int32_t pick = -1;
    for (int i = 0; i < d->max_id; i++) {
        acc += (double)q[i];
        if (pick < 0 && u < acc) pick = i;
        q[i] = (float)((double)q[i] / sum);
    }
    return pick >= 0 ? pick : argmax(row, d->max_id);
}

static void item_set(struct engine_item *it, struct drafter_seq *s, const int32_t *tokens, int pos,
                     int n, int n_logits, float *logits)
{
    memset(it, 0, sizeof *it);
    it->kv = &s->kv;
    it->tokens = tokens;
    it->pos = pos;
    it->n_tokens = n;
    it->n_logits = n_logits;
    it->logits = logits;
}

/* Runs the step of items [0, n); on failure every job loses its drafts and draft K/V. */
static int step(struct drafter *d, int n, struct drafter_job *jobs, int n_jobs, char *err,
                size_t errlen)
{
    if (engine_step(d->e, d->items, n, err, errlen) == 0) return 0;
    for (int j = 0; j < n_jobs; j++) {
        jobs[j].n_out = 0;
        jobs[j].q = NULL;
        drafter_seq_release(d, jobs[j].seq);
    }
    return -1;
}

/* A sequence's module state at its first feed: a block table and the pending row. */
static int mtp_seq_init(struct drafter *d, struct drafter_seq *s)
{
    if (s->init) return 0;
    if (!s->pend && !(s->pend = malloc(sizeof(float) * (size_t)d->d_model))) return -1;
    if (engine_seq_init(d->e, &s->kv) != 0) return -1;
    s->init = true;
    s->n_computed = 0;
    s->pend_pos = -1;
    s->lost = false;
    return 0;
}

/* The hidden state of position i for feed f: one of the step's rows, the pending one, or NULL
 * (missed). */
static const float *mtp_hidden(const struct drafter *d, const struct drafter_feed *f, int i)
{
    if (i >= f->pos && i < f->pos + f->n_valid)
        return f->hidden + (size_t)(i - f->pos) * (size_t)d->d_model;
    if (i == f->seq->pend_pos) return f->seq->pend;
    return NULL;
}

/* The module's prefix-cache namespace for a sequence: the target's key and token 0. */
static uint64_t mtp_key(uint64_t key, const int32_t *tokens)
{
    return kv_block_hash(UINT64_C(0x6d74702d6b657973), key, tokens, 1);
}

int drafter_mtp_take(struct drafter *d, struct drafter_seq *s, uint64_t key,
                     const int32_t *tokens, int max_idx)
{
    if (!d->mtp || max_idx <= 0) return 0;
    if (mtp_seq_init(d, s) != 0) return -1;
    if (s->n_computed > 0 || s->lost) return 0;
    struct kv_cache *kv = engine_kv(d->e);
    uint64_t k = mtp_key(key, tokens);
    int n = kv_seq_match(kv, &s->kv, k, tokens + 1, max_idx / kv->block_size) * kv->block_size;
    n += kv_seq_match_tail(kv, &s->kv, k, tokens + 1, max_idx);
    s->n_computed = n;
    return n;
}

void drafter_mtp_keep_tail(struct drafter *d, struct drafter_seq *s, uint64_t key,
                           const int32_t *tokens)
{
    if (!d->mtp || !s->init || s->lost || s->n_computed <= 0) return;
    kv_seq_keep_tail(engine_kv(d->e), &s->kv, mtp_key(key, tokens), tokens + 1, s->n_computed);
}

int drafter_mtp_feed(struct drafter *d, struct drafter_feed *feeds, int n_feeds, char *err,
                     size_t errlen)
{
    if (n_feeds > d->max_seqs)
        return ms_errf(err, errlen, "%d sequences fed, more than the MTP engine's %d", n_feeds,
                       d->max_seqs);
    size_t D = (size_t)d->d_model;
    int rc = 0;
    /* which indices each sequence computes: [n_computed, end), end = its last hidden state's
     * position (that one is kept for the next round) */
    for (int j = 0; j < n_feeds; j++) {
        struct drafter_feed *f = &feeds[j];
        struct drafter_seq *s = f->seq;
        if (mtp_seq_init(d, s) != 0) return ms_errf(err, errlen, "out of memory for MTP state");
        int end = f->pos + f->n_valid - 1;
        if (s->lost || f->n_valid <= 0 || s->n_computed >= end) continue;
        for (int i = s->n_computed; i < end; i++)
            if (!mtp_hidden(d, f, i)) {
                s->lost = true;
                break;
            }
    }
    for (;;) {
        int n = 0, used = 0;
        for (int j = 0; j < n_feeds && used < d->budget; j++) {
            struct drafter_feed *f = &feeds[j];
            struct drafter_seq *s = f->seq;
            int end = f->pos + f->n_valid - 1;
            if (s->lost || f->n_valid <= 0 || s->n_computed >= end) continue;
            int take = end - s->n_computed;
            if (take > d->budget - used) take = d->budget - used;
            float *hid = d->feed_hid + (size_t)used * D;
            for (int t = 0; t < take; t++)
                memcpy(hid + (size_t)t * D, mtp_hidden(d, f, s->n_computed + t), sizeof(float) * D);
            item_set(&d->items[n], s, f->tokens + s->n_computed + 1, s->n_computed, take, 0, NULL);
            d->items[n].hidden_in = hid;
            d->item_feed[n++] = f;
            used += take;
        }
        if (n == 0) break;
        if (engine_step(d->e, d->items, n, err, errlen) != 0) {
            for (int j = 0; j < n_feeds; j++) {
                drafter_seq_release(d, feeds[j].seq);
                feeds[j].seq->lost = true;
            }
            rc = -1;
            break;
        }
        for (int i = 0; i < n; i++) d->item_feed[i]->seq->n_computed += d->items[i].n_tokens;
    }
    /* keep each sequence's last hidden state for its next round; register its full blocks */
    for (int j = 0; j < n_feeds && rc == 0; j++) {
        struct drafter_feed *f = &feeds[j];
        struct drafter_seq *s = f->seq;
        if (s->lost || f->n_valid <= 0) continue;
        if (f->cache)
            kv_seq_register(engine_kv(d->e), &s->kv, mtp_key(f->key, f->tokens), f->tokens + 1,
                            s->n_computed);
        int last = f->pos + f->n_valid - 1;
        if (s->n_computed != last) continue; /* not caught up: nothing to keep */
        memcpy(s->pend, f->hidden + (size_t)(f->n_valid - 1) * D, sizeof(float) * D);
        s->pend_pos = last;
    }
    return rc;
}

/* MTP rounds: per job, index n_total - 2 from the pending hidden state and the last token, then
 * one step per further draft, each fusing the previous draft with the module's own output. */
static int mtp_run(struct drafter *d, struct drafter_job *jobs, int n_jobs, char *err,
                   size_t errlen)
{
    size_t D = (size_t)d->d_model;
    int kmax = 0;
    for (int pos = 0; pos == 0 || pos < kmax; pos++) {
        int n = 0;
        for (int j = 0; j < n_jobs; j++) {
            struct drafter_job *jb = &jobs[j];
            struct drafter_seq *s = jb->seq;
            if (pos == 0) {
                if (!s->init || s->lost || s->pend_pos != jb->n_total - 2 ||
                    s->n_computed != s->pend_pos)
                    continue; /* no drafts (n_out 0) */
                if (jb->k > kmax) kmax = jb->k;
            } else if (jb->k <= pos || jb->n_out < pos) {
                continue;
            }
            float *h = d->chain + (size_t)j * D;
            item_set(&d->items[n], s, pos == 0 ? jb->tokens + jb->n_total - 1 : jb->out + pos - 1,
                     s->pend_pos + pos, 1, 1, d->logits + (size_t)n * (size_t)d->vocab);
            d->items[n].hidden_in = pos == 0 ? s->pend : h;
            d->items[n].hidden_out = h;
            d->items[n].hidden_normed = d->view.mtp_in->chain_normed;
            d->item_job[n++] = jb;
        }
        if (n == 0) break;
        if (step(d, n, jobs, n_jobs, err, errlen) != 0) {
            for (int j = 0; j < n_jobs; j++) jobs[j].seq->lost = true;
            return -1;
        }
        for (int i = 0; i < n; i++) {
            struct drafter_job *jb = d->item_job[i];
            jb->out[pos] = draft_token(d, (int)(jb - jobs), jb, pos, d->items[i].logits);
            jb->n_out = pos + 1;
        }
    }
    /* index n_total - 2 is the sequence's for good; the chained ones are dropped */
    for (int j = 0; j < n_jobs; j++) {
        struct drafter_seq *s = jobs[j].seq;
        if (jobs[j].n_out == 0 || s->lost) continue;
        s->n_computed = s->pend_pos + 1;
        kv_seq_truncate(engine_kv(d->e), &s->kv, s->n_computed);
    }
    return 0;
}

int drafter_run(struct drafter *d, struct drafter_job *jobs, int n_jobs, char *err, size_t errlen)
{
    if (n_jobs > d->max_seqs)
        return ms_errf(err, errlen, "%d drafting sequences, more than the draft engine's %d",
                       n_jobs, d->max_seqs);
    int kmax = 0;
    for (int j = 0; j < n_jobs; j++) {
        struct drafter_job *jb = &jobs[j];
        jb->n_out = 0;
        if (jb->k > d->max_k) jb->k = d->max_k;
        if (jb->k > kmax) kmax = jb->k;
        jb->q_n = d->max_id;
        jb->q = d->q && jb->rng && jb->temperature >= 1e-5f
                    ? d->q + (size_t)j * (size_t)d->max_k * (size_t)d->max_id
                    : NULL;
        if (d->mtp) continue;
        if (!jb->seq->init) {
            if (engine_seq_init(d->e, &jb->seq->kv) != 0)
                return ms_errf(err, errlen, "out of memory for a draft block table");
            jb->seq->init = true;
            jb->seq->n_computed = 0;
        }
        if (jb->seq->n_computed >= jb->n_total) jb->seq->n_computed = jb->n_total - 1;
    }
    if (d->mtp) return mtp_run(d, jobs, n_jobs, err, errlen);
    /* Catch-up rounds: each sequence's tokens up to its last, in chunks that fit the budget;
     * the chunk that reaches the last token gives the first draft. */
    for (;;) {
        int n = 0, used = 0;
        for (int j = 0; j < n_jobs && used < d->budget; j++) {
            struct drafter_job *jb = &jobs[j];
            struct drafter_seq *s = jb->seq;
            if (jb->n_out > 0) continue;
            int left = jb->n_total - s->n_computed, take = left;
            if (take > d->budget - used) take = d->budget - used;
            bool last = take == left;
            item_set(&d->items[n], s, jb->tokens + s->n_computed, s->n_computed, take, last ? 1 : 0,
                     d->logits + (size_t)n * (size_t)d->vocab);
            d->item_job[n++] = jb;
            used += take;
        }
        if (n == 0) break;
        if (step(d, n, jobs, n_jobs, err, errlen) != 0) return -1;
        for (int i = 0; i < n; i++) {
            struct drafter_job *jb = d->item_job[i];
            jb->seq->n_computed += d->items[i].n_tokens;
            if (d->items[i].n_logits == 1) {
                jb->out[0] = draft_token(d, (int)(jb - jobs), jb, 0, d->items[i].logits);
                jb->n_out = 1;
            }
        }
    }
    /* One step per further draft: feed the previous draft, take the next. */
    for (int pos = 1; pos < kmax; pos++) {
        int n = 0;
        for (int j = 0; j < n_jobs; j++) {
            struct drafter_job *jb = &jobs[j];
            if (jb->k <= pos) continue;
            item_set(&d->items[n], jb->seq, jb->out + pos - 1, jb->n_total + pos - 1, 1, 1,
                     d->logits + (size_t)n * (size_t)d->vocab);
            d->item_job[n++] = jb;
        }
        if (step(d, n, jobs, n_jobs, err, errlen) != 0) return -1;
        for (int i = 0; i < n; i++) {
            struct drafter_job *jb = d->item_job[i];
            jb->seq->n_computed++;
            jb->out[pos] = draft_token(d, (int)(jb - jobs), jb, pos, d->items[i].logits);
            jb->n_out = pos + 1;
        }
    }
    return 0;
}

void drafter_seq_keep(struct drafter *d, struct drafter_seq *s, int n_valid)
{
    if (!s->init) return;
    if (s->n_computed > n_valid) s->n_computed = n_valid < 0 ? 0 : n_valid;
    kv_seq_truncate(engine_kv(d->e), &s->kv, s->n_computed);
}

void drafter_seq_release(struct drafter *d, struct drafter_seq *s)
{
    if (s->init) engine_seq_free(d->e, &s->kv);
    s->init = false;
    s->n_computed = 0;
    s->pend_pos = -1;
    s->lost = false;
    free(s->pend);
    s->pend = NULL;
}
