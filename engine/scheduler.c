/* Scheduler implementation: request lifetime, step planning (budget, sequence limit, KV blocks,
 * preemption by recompute), speculative drafts and their verification, sampling and output
 * publication, and the libuv loop thread that drives steps. See scheduler.h for the threading
 * and ownership rules. */
#include "scheduler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common.h"

struct sched {
    struct engine *e;
    const struct model *m;
    struct sched_params p;
    int vocab;
    int max_model_len;
    int kv_window;      /* engine_kv_window: > 0, blocks before a sequence's window go back */
    bool prefix_caching;

    /* scheduler thread only */
    struct sched_req **running;   /* (max_num_seqs) in admission order */
    int n_running;
    struct sched_req *wait_head, *wait_tail;
    int n_waiting;
    struct engine_item *items;    /* (max_num_seqs) */
    struct sched_req **item_req;  /* (max_num_seqs) */
    /* (max_num_seqs + extra_rows, vocab): one row per item that samples, plus rows for the
     * prompt positions of prompt-logprob requests (at most extra_rows more per step) */
    float *logits;
    int extra_rows;
    char piece[512];
    char *spill;        /* a token's text longer than piece (rare long added tokens) */
    size_t spill_cap;
    uint64_t pc_queries, pc_hits; /* prefix cache tokens, copied into st by publish_stats */

    /* speculative decoding */
    bool spec_on;
    struct spec_config spec;
    struct drafter *drafter;
    struct spec_cost cost;         /* step time against step tokens (adaptive k) */
    struct drafter_job *djobs;     /* (max_num_seqs) */
    /* MTP drafters: every step's hidden states (max_num_batched_tokens, d_model), fed to the
     * module after the step for the sequences that speculate */
    bool mtp;
    float *hid;
    struct drafter_feed *feeds;    /* (max_num_seqs) */
    struct sched_req **feed_req;   /* (max_num_seqs) each feed's request */
    bool drafter_sampling;         /* the drafter keeps draft distributions: sampled drafts */
    bool hybrid;                   /* recurrent layers: states are snapshot and rolled back */
    struct {
        uint64_t drafts, draft_tokens, accepted, per_pos[SPEC_MAX_K], draft_rows,
            rejected_rows, rollbacks, stopped;
    } spec_stats;                  /* copied into st after each step */

    /* incoming requests, handed over by any thread */
    pthread_mutex_t in_mu;
    struct sched_req *in_head, *in_tail;
    int n_in;
    bool closed;
    atomic_int n_queued;          /* waiting + incoming, for the back-pressure check */
    atomic_bool reset_prefix;     /* sched_reset_prefix_cache was called */

    /* stats snapshot */
    pthread_mutex_t st_mu;
    struct sched_stats st;

    /* loop thread */
    uv_loop_t loop;
    uv_async_t wake;
    uv_idle_t idle;
    uv_thread_t thread;
    bool loop_init, started, idle_on;
    /* wake_open: the wake handle may be signalled. Other threads check it under wake_mu, and
     * the loop clears it under wake_mu before closing the handle, so no thread ever signals a
     * closed handle (sched_req_cancel can run on an HTTP thread during shutdown). */
    pthread_mutex_t wake_mu;
    bool wake_open;
    atomic_bool quit;
};

static atomic_ullong sched_next_id = 1;

const char *sched_finish_str(enum sched_finish f)
{
    switch (f) {
    case SCHED_FINISH_STOP: return "stop";
    case SCHED_FINISH_LENGTH: return "length";
    case SCHED_FINISH_ABORT: return "abort";
    case SCHED_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

void sched_req_params_default(struct sched_req_params *p)
{
    memset(p, 0, sizeof *p);
    p->max_tokens = 16;
    smp_params_default(&p->smp);
    p->skip_special = true;
    p->prompt_logprobs = -1;
    p->speculative = true;
}

/* --- requests ------------------------------------------------------------------------------ */

struct sched_req *sched_req_create(const int32_t *prompt, int n_prompt,
                                   const struct sched_req_params *p, char *err, size_t errlen)
{
    if (n_prompt < 1) {
        ms_errf(err, errlen, "the prompt is empty");
        return NULL;
    }
    if (p->max_tokens < 0 || p->max_tokens > (1 << 24)) {
        ms_errf(err, errlen, "max_tokens %d out of range", p->max_tokens);
        return NULL;
    }
    if (p->prompt_logprobs > SMP_MAX_LOGPROBS) {
        ms_errf(err, errlen, "prompt_logprobs must be at most %d", SMP_MAX_LOGPROBS);
        return NULL;
    }
    if (p->n_stop < 0 || p->n_stop > SCHED_MAX_STOP) {
        ms_errf(err, errlen, "at most %d stop strings", SCHED_MAX_STOP);
        return NULL;
    }
    for (int i = 0; i < p->n_stop; i++) {
        size_t l = strlen(p->stop[i]);
        if (l == 0 || l > SCHED_MAX_STOP_LEN) {
            ms_errf(err, errlen, "stop strings must be 1 to %d bytes", SCHED_MAX_STOP_LEN);
            return NULL;
        }
    }
    struct sched_req *r = calloc(1, sizeof *r);
    if (!r) goto oom;
    r->p = *p;
    r->n_prompt = n_prompt;
    r->cap = n_prompt + p->max_tokens;
    r->n_total = n_prompt;
    r->tokens = malloc(sizeof(int32_t) * (size_t)r->cap);
    r->out.tokens = malloc(sizeof(int32_t) * (size_t)(p->max_tokens > 0 ? p->max_tokens : 1));
    r->out.text_cap = (size_t)p->max_tokens * 8 + 64;
    r->out.text = malloc(r->out.text_cap);
    if (!r->tokens || !r->out.tokens || !r->out.text) goto oom;
    if (p->logprobs) {
        r->out.lps = malloc(sizeof *r->out.lps * (size_t)(p->max_tokens > 0 ? p->max_tokens : 1));
        if (!r->out.lps) goto oom;
    }
    if (p->prompt_logprobs >= 0) {
        r->out.prompt_lps = calloc((size_t)n_prompt, sizeof *r->out.prompt_lps);
        if (!r->out.prompt_lps) goto oom;
        r->out.n_prompt_lps = 1; /* the first token has no logprob: nothing to wait for */
    }
    memcpy(r->tokens, prompt, sizeof(int32_t) * (size_t)n_prompt);
    /* The id lists belong to the caller: keep copies (the sampler is created later). */
    if (p->n_stop_ids > 0) {
        r->stop_ids = malloc(sizeof *r->stop_ids * (size_t)p->n_stop_ids);
        if (!r->stop_ids) goto oom;
        memcpy(r->stop_ids, p->stop_ids, sizeof *r->stop_ids * (size_t)p->n_stop_ids);
    }
    if (p->smp.n_bias > 0) {
        r->bias = malloc(sizeof *r->bias * (size_t)p->smp.n_bias);
        if (!r->bias) goto oom;
        memcpy(r->bias, p->smp.bias, sizeof *r->bias * (size_t)p->smp.n_bias);
    }
    if (p->smp.n_allowed > 0) {
        r->allowed = malloc(sizeof *r->allowed * (size_t)p->smp.n_allowed);
        if (!r->allowed) goto oom;
        memcpy(r->allowed, p->smp.allowed, sizeof *r->allowed * (size_t)p->smp.n_allowed);
    }
    r->p.stop_ids = r->stop_ids;
    r->p.n_stop_ids = r->stop_ids ? p->n_stop_ids : 0;
    r->p.smp.bias = r->bias;
    r->p.smp.n_bias = r->bias ? p->smp.n_bias : 0;
    r->p.smp.allowed = r->allowed;
    r->p.smp.n_allowed = r->allowed ? p->smp.n_allowed : 0;
    grm_retain(p->grammar);
    for (int i = 0; i < p->n_stop; i++) {
        memcpy(r->stop_buf[i], p->stop[i], strlen(p->stop[i]) + 1);
        r->p.stop[i] = r->stop_buf[i];
    }
    if (stopstr_init(&r->ss, r->p.stop, r->p.n_stop, r->p.include_stop_str,
                     sizeof(((struct sched *)0)->piece)) != 0) {
        grm_release(p->grammar);
        goto oom;
    }
    r->out.text[0] = '\0';
    r->id = atomic_fetch_add(&sched_next_id, 1);
    r->t_arrival = ms_now();
    spec_acc_init(&r->spec_acc);
    /* the draft model's generator: from the seed when there is one, else from the clock */
    ms_rng_seed(&r->spec_rng, p->smp.has_seed
                                  ? p->smp.seed ^ 0x5bd1e9955bd1e995ull
                                  : (uint64_t)(r->t_arrival * 1e9) ^ (r->id * 0x9e3779b97f4a7c15ull));
    tok_stream_init(&r->ts, p->skip_special);
    pthread_mutex_init(&r->mu, NULL);
    atomic_init(&r->cancelled, false);
    atomic_init(&r->refs, 1);
    return r;

oom:
    if (r) {
        free(r->tokens);
        free(r->out.tokens);
        free(r->out.text);
        free(r->out.lps);
        free(r->out.prompt_lps);
        stopstr_free(&r->ss);
        free(r->stop_ids);
        free(r->bias);
        free(r->allowed);
        free(r);
    }
    ms_errf(err, errlen, "out of memory");
    return NULL;
}

void sched_req_retain(struct sched_req *r)
{
    atomic_fetch_add(&r->refs, 1);
}

void sched_req_release(struct sched_req *r)
{
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
    /* The scheduler frees the KV table and sampler before dropping its reference. */
    smp_free(r->smp);
    grm_matcher_free(r->gm);
    grm_release(r->p.grammar);
    pthread_mutex_destroy(&r->mu);
    free(r->tokens);
    free(r->out.tokens);
    free(r->out.text);
    free(r->out.lps);
    free(r->out.prompt_lps);
    stopstr_free(&r->ss);
    free(r->stop_ids);
    free(r->bias);
    free(r->allowed);
    free(r);
}

void sched_req_lock(struct sched_req *r)
{
    pthread_mutex_lock(&r->mu);
}

void sched_req_unlock(struct sched_req *r)
{
    pthread_mutex_unlock(&r->mu);
}

void sched_req_set_notify(struct sched_req *r, void (*notify)(void *ctx), void *ctx)
{
    pthread_mutex_lock(&r->mu);
    r->out.notify = notify;
    r->out.notify_ctx = ctx;
    pthread_mutex_unlock(&r->mu);
}

static void sched_wake(struct sched *s)
{
    pthread_mutex_lock(&s->wake_mu);
    if (s->wake_open) uv_async_send(&s->wake);
    pthread_mutex_unlock(&s->wake_mu);
}

void sched_req_cancel(struct sched *s, struct sched_req *r)
{
    atomic_store(&r->cancelled, true);
    if (s) sched_wake(s);
}

/* --- creation ------------------------------------------------------------------------------ */

int sched_create(struct engine *e, const struct sched_params *p, struct sched **out, char *err,
                 size_t errlen)
{
    const struct engine_params *ep = engine_get_params(e);
    *out = NULL;
    if (p->max_num_seqs < 1 || p->max_num_seqs > ep->max_seqs)
        return ms_errf(err, errlen, "max_num_seqs must be in [1, %d] (the engine's), got %d",
                       ep->max_seqs, p->max_num_seqs);
    if (p->max_num_batched_tokens < 1 || p->max_num_batched_tokens > ep->max_batch_tokens)
        return ms_errf(err, errlen,
                       "max_num_batched_tokens must be in [1, %d] (the engine's), got %d",
                       ep->max_batch_tokens, p->max_num_batched_tokens);
    if (p->spec && p->spec->method != SPEC_OFF) {
        if (p->spec->k < 1 || p->spec->k > SPEC_MAX_K)
            return ms_errf(err, errlen, "num_speculative_tokens must be in 1..%d, got %d",
                           SPEC_MAX_K, p->spec->k);
        if (p->spec->method == SPEC_MTP && !p->spec_propose &&
            !(p->drafter && drafter_is_mtp(p->drafter)))
            return ms_errf(err, errlen, "speculative method mtp needs an MTP drafter");
        if (p->spec->method == SPEC_DRAFT_MODEL && !p->drafter && !p->spec_propose)
            return ms_errf(err, errlen, "speculative method draft_model needs a drafter");
        if (engine_model(e)->desc.n_linear > 0 && !ep->spec_state)
            return ms_errf(err, errlen, "speculative decoding on %s (recurrent layers) needs an "
                                        "engine with spare state slots (spec_state)",
                           engine_model(e)->desc.model_type);
    }
    struct sched *s = calloc(1, sizeof *s);
    if (!s) return ms_errf(err, errlen, "out of memory");
    s->e = e;
    s->m = engine_model(e);
    s->p = *p;
    if (s->p.max_waiting <= 0) s->p.max_waiting = 1024;
    if (p->spec && p->spec->method != SPEC_OFF) {
        s->spec_on = true;
        s->spec = *p->spec;
        s->drafter = p->drafter;
        s->drafter_sampling = s->drafter && drafter_samples(s->drafter);
    }
    s->p.spec = NULL; /* the copy in s->spec is what counts */
    spec_cost_init(&s->cost);
    s->vocab = s->m->desc.vocab;
    s->max_model_len = ep->max_model_len;
    s->kv_window = engine_kv_window(e);
    /* Hybrid models: cached K/V blocks come without the recurrent state of the positions
     * they hold, so a prefix hit cannot be used (the engine refuses such a step): off. */
    s->prefix_caching = !p->disable_prefix_caching && engine_state_seq_bytes(e) == 0;
    s->hybrid = s->m->desc.n_linear > 0;
    int ns = p->max_num_seqs;
    /* Prompt-logprob rows: up to 64 MiB of logits per step (at least 16 rows), no more rows
     * than a step has tokens. */
    size_t extra = ((size_t)64 << 20) / (sizeof(float) * (size_t)s->vocab);
    if (extra < 16) extra = 16;
    if (s->spec_on) {
        /* drafts take a row each: room for every sequence's k, up to 256 MiB of rows */
        size_t want = (size_t)ns * (size_t)s->spec.k, cap = ((size_t)256 << 20) /
                                                              (sizeof(float) * (size_t)s->vocab);
        if (want > cap) want = cap;
        if (want > extra) extra = want;
    }
    if (extra > (size_t)p->max_num_batched_tokens) extra = (size_t)p->max_num_batched_tokens;
    s->extra_rows = (int)extra;
    s->running = calloc((size_t)ns, sizeof *s->running);
    s->items = calloc((size_t)ns, sizeof *s->items);
    s->item_req = calloc((size_t)ns, sizeof *s->item_req);
    s->logits = malloc(sizeof(float) * ((size_t)ns + extra) * (size_t)s->vocab);
    s->djobs = calloc((size_t)ns, sizeof *s->djobs);
    s->mtp = s->drafter && drafter_is_mtp(s->drafter);
    if (s->mtp) {
        s->hid = malloc(sizeof(float) * (size_t)p->max_num_batched_tokens *
                        (size_t)s->m->desc.d_model);
        s->feeds = calloc((size_t)ns, sizeof *s->feeds);
        s->feed_req = calloc((size_t)ns, sizeof *s->feed_req);
    }
    if (!s->running || !s->items || !s->item_req || !s->logits || !s->djobs ||
        (s->mtp && (!s->hid || !s->feeds || !s->feed_req))) {
        ms_errf(err, errlen, "out of memory");
        goto fail;
    }
    pthread_mutex_init(&s->in_mu, NULL);
    pthread_mutex_init(&s->st_mu, NULL);
    pthread_mutex_init(&s->wake_mu, NULL);
    atomic_init(&s->n_queued, 0);
    atomic_init(&s->quit, false);
    atomic_init(&s->reset_prefix, false);
    s->st.spec_k = s->spec_on ? s->spec.k : 0;
    s->st.kv_blocks_total = engine_kv(e)->n_blocks;
    s->st.kv_blocks_free = kv_free_blocks(engine_kv(e));
    *out = s;
    return 0;

fail:
    free(s->running);
    free(s->items);
    free(s->item_req);
    free(s->logits);
    free(s->djobs);
    free(s->hid);
    free(s->feeds);
    free(s->feed_req);
    free(s);
    return -1;
}

/* --- output -------------------------------------------------------------------------------- */

/* Appends text to the published output (under r->mu). Growing is rare: the buffer starts at
 * 8 bytes per allowed token. */
static void out_append(struct sched_req *r, const char *t, size_t n)
{
    if (n == 0) return;
    if (r->out.text_len + n + 1 > r->out.text_cap) {
        size_t cap = (r->out.text_len + n + 1) * 2;
        char *bigger = realloc(r->out.text, cap);
        if (!bigger) return; /* drop text rather than crash; the tokens stay exact */
        r->out.text = bigger;
        r->out.text_cap = cap;
    }
    memcpy(r->out.text + r->out.text_len, t, n);
    r->out.text_len += n;
    r->out.text[r->out.text_len] = '\0';
}

static void out_emit(void *ctx, const char *t, size_t n)
{
    out_append(ctx, t, n);
}

/* Feeds newly decoded text through the stop-string filter (stopstr.h): publishes what can no
 * longer be the start of a stop string. Returns true when a stop string matched. Before
 * min_tokens no stop string counts. Called with r->mu held. */
static bool feed_text(struct sched_req *r, const char *t, size_t n)
{
    bool active = r->n_total - r->n_prompt >= r->p.min_tokens;
    return stopstr_feed(&r->ss, t, n, active, out_emit, r);
}

/* Publishes the end of a request: held-back text, the finish reason; wakes the reader. */
static void finish_locked(struct sched_req *r, enum sched_finish why, const char *msg)
{
    /* Text held back as a possible stop-string start turned out to be plain text (after a
     * stop-string match the hold is already empty). */
    stopstr_flush(&r->ss, out_emit, r);
    r->out.finish = why;
    if (msg) snprintf(r->out.error, sizeof r->out.error, "%s", msg);
    if (r->out.notify) r->out.notify(r->out.notify_ctx);
}

static void publish_stats(struct sched *s, int n_items)
{
    struct kv_cache *kv = engine_kv(s->e);
    pthread_mutex_lock(&s->st_mu);
    s->st.running = s->n_running;
    s->st.waiting = atomic_load(&s->n_queued);
    s->st.kv_blocks_free = kv_free_blocks(kv);
    s->st.kv_blocks_cached = kv_cached_blocks(kv);
    s->st.prefix_cache_queries = s->pc_queries;
    s->st.prefix_cache_hits = s->pc_hits;
    if (n_items > 0) s->st.steps++;
    pthread_mutex_unlock(&s->st_mu);
}

/* Ends a request the scheduler holds: frees its KV blocks, publishes, drops the reference. */
static uint64_t cache_key(const struct sched *s, const struct sched_req *r);

static void retire(struct sched *s, struct sched_req *r, enum sched_finish why, const char *msg)
{
    if (s->drafter) {
        if (s->prefix_caching && why != SCHED_FINISH_ERROR)
            drafter_mtp_keep_tail(s->drafter, &r->dseq, cache_key(s, r), r->tokens);
        drafter_seq_release(s->drafter, &r->dseq);
    }
    if (r->kv_init) {
        /* its partly filled last block stays cached for a prompt that repeats this one */
        if (s->prefix_caching && why != SCHED_FINISH_ERROR)
            kv_seq_keep_tail(engine_kv(s->e), &r->kv, cache_key(s, r), r->tokens, r->n_computed);
        engine_seq_free(s->e, &r->kv);
        r->kv_init = false;
    }
    /* Order matters to readers of /metrics: counters, then gauges, then the client. Whoever
     * sees the running gauge drop (or gets its answer) also sees the request counted, and its
     * blocks free. */
    double now = ms_now();
    if (s->p.obs.on_finish)
        s->p.obs.on_finish(s->p.obs.ctx, why, r->n_prompt, r->n_total - r->n_prompt,
                           now - r->t_arrival);
    if (s->p.obs.on_request_done) {
        bool sched = r->t_scheduled > 0, first = r->t_first_token > 0;
        struct sched_req_done d = {
            .id = r->id, .why = why, .n_prompt = r->n_prompt,
            .n_generated = r->n_total - r->n_prompt, .max_tokens = r->p.max_tokens,
            .queue_s = sched ? r->t_scheduled - r->t_arrival : -1,
            .prefill_s = sched && first ? r->t_first_token - r->t_scheduled : -1,
            .decode_s = first ? r->t_last_token - r->t_first_token : -1,
            .inference_s = sched && first ? r->t_last_token - r->t_scheduled : -1,
            .e2e_s = now - r->t_arrival};
        s->p.obs.on_request_done(s->p.obs.ctx, &d);
    }
    publish_stats(s, 0);
    pthread_mutex_lock(&r->mu);
    finish_locked(r, why, msg);
    pthread_mutex_unlock(&r->mu);
    sched_req_release(r);
}

static bool is_eos(const struct model *m, int32_t t)
{
    for (int i = 0; i < m->desc.n_eos; i++)
        if (m->desc.eos_ids[i] == t) return true;
    return false;
}

static bool is_stop_id(const struct sched_req *r, int32_t t)
{
    for (int i = 0; i < r->p.n_stop_ids; i++)
        if (r->p.stop_ids[i] == t) return true;
    return false;
}

static void warn(struct sched *s, const struct sched_req *r, const char *msg)
{
    if (s->p.obs.on_warning) s->p.obs.on_warning(s->p.obs.ctx, r->id, msg);
}

/* Ends r without a new token (its grammar is complete or allows nothing): the decoder may
 * still hold an incomplete character. Returns SCHED_FINISH_STOP. */
static enum sched_finish stop_without_token(struct sched *s, struct sched_req *r)
{
    pthread_mutex_lock(&r->mu);
    if (s->m->tok) {
        int w = tok_stream_flush(s->m->tok, &r->ts, s->piece, sizeof s->piece);
        if (w > 0) feed_text(r, s->piece, (size_t)w);
    }
    pthread_mutex_unlock(&r->mu);
    return SCHED_FINISH_STOP;
}

/* Decodes token t into r's stream: its text in s->piece or, when longer than that, in
 * s->spill, grown as needed (a long added token: never on the usual path, and kept for the
 * next). Returns the length with *text set, or -1 (the text is then lost: out of memory or a
 * piece over 1 MiB). */
static int push_piece(struct sched *s, struct sched_req *r, int32_t t, const char **text)
{
    *text = s->piece;
    int w = tok_stream_push(s->m->tok, &r->ts, t, s->piece, sizeof s->piece);
    if (w >= 0 || t < 0 || t >= tok_vocab_size(s->m->tok)) return w;
    if (s->spill_cap > 0) {
        w = tok_stream_push(s->m->tok, &r->ts, t, s->spill, s->spill_cap);
        *text = s->spill;
    }
    while (w < 0 && s->spill_cap < ((size_t)1 << 20)) {
        size_t cap = s->spill_cap ? s->spill_cap * 2 : 4096;
        char *p = realloc(s->spill, cap);
        if (!p) return -1;
        s->spill = p;
        s->spill_cap = cap;
        w = tok_stream_push(s->m->tok, &r->ts, t, s->spill, cap);
        *text = s->spill;
    }
    return w;
}

/* Samples the next token of r from its logits row and publishes it; a draft drawn from the
 * distribution q (n_q probabilities) is verified by the general rule (smp_sample_verify), one
 * chosen deterministically (q NULL) by drawing as always. Returns the finish reason
 * (SCHED_FINISH_NONE to continue). */
static enum sched_finish accept_token_q(struct sched *s, struct sched_req *r, float *row,
                                        int32_t draft, const float *q, int n_q)
{
    struct smp_logprobs lp = {0};
    if (r->gm && grm_mask(r->gm, row) == 0) {
        warn(s, r, "the grammar allows no token here; the output ends");
        return stop_without_token(s, r);
    }
    if (r->n_total - r->n_prompt < r->p.min_tokens) {
        /* min_tokens: nothing that would end the request may be drawn yet */
        for (int i = 0; i < s->m->desc.n_eos && !r->p.ignore_eos; i++)
            if (s->m->desc.eos_ids[i] >= 0 && s->m->desc.eos_ids[i] < s->vocab)
                row[s->m->desc.eos_ids[i]] = -INFINITY;
        for (int i = 0; i < r->p.n_stop_ids; i++)
            if (r->p.stop_ids[i] >= 0 && r->p.stop_ids[i] < s->vocab)
                row[r->p.stop_ids[i]] = -INFINITY;
    }
    bool accepted;
    int32_t t = q ? smp_sample_verify(r->smp, row, draft, q, n_q, &accepted,
                                      r->p.logprobs ? &lp : NULL)
                  : smp_sample(r->smp, row, r->p.logprobs ? &lp : NULL);
    /* Every token impossible (the grammar, logit_bias and allowed_token_ids left none): the
     * sampler's stand-in is no answer. */
    if (row[t] == -INFINITY && (r->gm || r->p.smp.n_bias > 0 || r->p.smp.n_allowed > 0)) {
        warn(s, r, "no token is allowed (grammar, logit_bias and allowed_token_ids together); "
                   "the output ends");
        return stop_without_token(s, r);
    }
    if (r->gm && grm_accept(r->gm, t) != 0) {
        warn(s, r, "the grammar refused the drawn token; the output ends");
        return stop_without_token(s, r);
    }
    smp_accept(r->smp, t, true);
    double now = ms_now();
    if (r->n_total == r->n_prompt) {
        r->t_first_token = now;
        if (s->p.obs.on_first_token)
            s->p.obs.on_first_token(s->p.obs.ctx, now - r->t_arrival,
                                    r->t_scheduled - r->t_arrival);
    } else if (s->p.obs.on_token) {
        s->p.obs.on_token(s->p.obs.ctx, now - r->t_last_token);
    }
    r->t_last_token = now;
    r->tokens[r->n_total++] = t;
    int n_gen = r->n_total - r->n_prompt;

    enum sched_finish why = SCHED_FINISH_NONE;
    bool stop_id = is_stop_id(r, t);
    /* with a grammar, EOS was allowed only where the output may end: it ends it */
    bool eos = (!r->p.ignore_eos || r->gm) && is_eos(s->m, t) && !stop_id;
    pthread_mutex_lock(&r->mu);
    if (r->out.n_tokens == 0) r->out.ttft_s = now - r->t_arrival;
    r->out.tokens[r->out.n_tokens] = t;
    if (r->out.lps) r->out.lps[r->out.n_tokens] = lp;
    r->out.n_tokens++;
    if (eos) {
        why = SCHED_FINISH_STOP;
    } else if (s->m->tok) {
        const char *text;
        int w = push_piece(s, r, t, &text);
        if (w > 0 && feed_text(r, text, (size_t)w)) why = SCHED_FINISH_STOP;
        if (stop_id) why = SCHED_FINISH_STOP;
    }
    if (stop_id && !s->m->tok) why = SCHED_FINISH_STOP;
    /* A complete structured output ends here, whatever ignore_eos says: nothing may follow. */
    bool grammar_end = why == SCHED_FINISH_NONE && r->gm && grm_must_end(r->gm);
    if (grammar_end) why = SCHED_FINISH_STOP;
    if (why == SCHED_FINISH_NONE && (n_gen >= r->p.max_tokens || r->n_total >= s->max_model_len))
        why = SCHED_FINISH_LENGTH;
    if (why != SCHED_FINISH_NONE && !(why == SCHED_FINISH_STOP && !eos && !stop_id && !grammar_end) &&
        s->m->tok) {
        /* finished by EOS, a stop id or length: the decoder may hold an incomplete character */
        int w = tok_stream_flush(s->m->tok, &r->ts, s->piece, sizeof s->piece);
        if (w > 0 && feed_text(r, s->piece, (size_t)w)) why = SCHED_FINISH_STOP;
    }
    if (why == SCHED_FINISH_NONE && r->out.notify) r->out.notify(r->out.notify_ctx);
    pthread_mutex_unlock(&r->mu);
    return why;
}

static enum sched_finish accept_token(struct sched *s, struct sched_req *r, float *row)
{
    return accept_token_q(s, r, row, -1, NULL, 0);
}

/* Logprobs of the prompt tokens this step's rows predict (row j of it is position
 * pos + n_tokens - n_logits + j, which predicts the token after it), published in order. */
static void record_prompt_lps(struct sched *s, struct sched_req *r, const struct engine_item *it)
{
    int next = r->out.n_prompt_lps;
    int first_pos = it->pos + it->n_tokens - it->n_logits;
    for (int j = 0; j < it->n_logits; j++) {
        int q = first_pos + j + 1;
        if (q < next) continue; /* recorded before a preemption */
        if (q >= r->n_prompt || q != next) break;
        smp_row_logprobs(it->logits + (size_t)j * (size_t)s->vocab, s->vocab, r->tokens[q],
                         r->p.prompt_logprobs, &r->out.prompt_lps[q]);
        next++;
    }
    pthread_mutex_lock(&r->mu);
    r->out.n_prompt_lps = next;
    pthread_mutex_unlock(&r->mu);
}

/* --- planning ------------------------------------------------------------------------------ */

static void wait_push_front(struct sched *s, struct sched_req *r)
{
    r->prev = NULL;
    r->next = s->wait_head;
    if (s->wait_head) s->wait_head->prev = r;
    else s->wait_tail = r;
    s->wait_head = r;
    s->n_waiting++;
}

static void wait_push_back(struct sched *s, struct sched_req *r)
{
    r->next = NULL;
    r->prev = s->wait_tail;
    if (s->wait_tail) s->wait_tail->next = r;
    else s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
}

static void wait_remove(struct sched *s, struct sched_req *r)
{
    if (r->prev) r->prev->next = r->next;
    else s->wait_head = r->next;
    if (r->next) r->next->prev = r->prev;
    else s->wait_tail = r->prev;
    r->next = r->prev = NULL;
    s->n_waiting--;
    atomic_fetch_sub(&s->n_queued, 1);
}

static void running_remove(struct sched *s, int i)
{
    memmove(&s->running[i], &s->running[i + 1],
            sizeof *s->running * (size_t)(s->n_running - i - 1));
    s->n_running--;
}

/* Moves handed-over requests into the wait queue. */
static void take_incoming(struct sched *s)
{
    pthread_mutex_lock(&s->in_mu);
    struct sched_req *r = s->in_head;
    s->in_head = s->in_tail = NULL;
    s->n_in = 0;
    pthread_mutex_unlock(&s->in_mu);
    while (r) {
        struct sched_req *next = r->next;
        wait_push_back(s, r);
        r = next;
    }
}

/* Finishes cancelled requests wherever they are. */
static void reap_cancelled(struct sched *s)
{
    for (int i = 0; i < s->n_running;) {
        struct sched_req *r = s->running[i];
        if (atomic_load(&r->cancelled)) {
            running_remove(s, i);
            retire(s, r, SCHED_FINISH_ABORT, "cancelled");
        } else {
            i++;
        }
    }
    for (struct sched_req *r = s->wait_head, *next; r; r = next) {
        next = r->next;
        if (atomic_load(&r->cancelled)) {
            wait_remove(s, r);
            retire(s, r, SCHED_FINISH_ABORT, "cancelled");
        }
    }
}

static int blocks_needed(const struct sched *s, const struct sched_req *r, int n_tokens)
{
    int bs = engine_kv(s->e)->block_size;
    int want = (r->n_computed + n_tokens + bs - 1) / bs;
    int held = r->kv_init ? r->kv.n_blocks : 0;
    return want > held ? want - held : 0;
}

/* Preemption by recompute: drop the KV blocks, forget what was computed, wait at the front. */
static void preempt(struct sched *s, int i)
{
    struct sched_req *r = s->running[i];
    running_remove(s, i);
    if (s->drafter) {
        if (s->prefix_caching)
            drafter_mtp_keep_tail(s->drafter, &r->dseq, cache_key(s, r), r->tokens);
        drafter_seq_release(s->drafter, &r->dseq);
    }
    r->spec_n = 0;
    if (r->kv_init) {
        if (s->prefix_caching)
            kv_seq_keep_tail(engine_kv(s->e), &r->kv, cache_key(s, r), r->tokens, r->n_computed);
        kv_seq_release(engine_kv(s->e), &r->kv);
    }
    r->n_computed = 0;
    r->n_preempted++;
    wait_push_front(s, r);
    atomic_fetch_add(&s->n_queued, 1);
    pthread_mutex_lock(&s->st_mu);
    s->st.preemptions++;
    pthread_mutex_unlock(&s->st_mu);
}

/* Whether r still waits for logprobs of some prompt tokens. */
static bool prompt_lps_pending(const struct sched_req *r)
{
    return r->out.prompt_lps && r->out.n_prompt_lps < r->n_prompt;
}

/* Logit rows of a step: each item that samples takes one, a prompt-logprob chunk one per
 * token; those beyond the first come out of the step's extra rows. */
struct rows {
    int used, extra_left;
};

/* Cuts a chunk of n tokens of r to the logit rows left (a prompt-logprob chunk needs a row
 * per token). Returns the tokens the chunk may have, >= 1. */
static int fit_rows(const struct rows *rw, const struct sched_req *r, int n)
{
    if (prompt_lps_pending(r) && n > rw->extra_left + 1) n = rw->extra_left + 1;
    return n;
}

static void add_item(struct sched *s, int *n_items, struct rows *rw, struct sched_req *r, int n)
{
    struct engine_item *it = &s->items[*n_items];
    bool last = r->n_computed + n == r->n_total;
    it->kv = &r->kv;
    it->tokens = r->tokens + r->n_computed;
    it->n_tokens = n;
    it->pos = r->n_computed;
    it->moe_top_k = r->p.moe_top_k;
    it->tag = r->p.tag;
    it->moe_samples = r->p.moe_samples;
    it->moe_neuron_fraction = r->p.moe_neuron_fraction;
    it->moe_samples_adaptive = r->p.moe_samples_adaptive;
    /* max_tokens 0 samples nothing: its last chunk needs no row of its own */
    it->n_logits = last && r->p.max_tokens > 0 ? 1 : 0;
    if (prompt_lps_pending(r)) {
        it->n_logits = n;
        rw->extra_left -= n - 1;
    }
    rw->used += it->n_logits; /* the rows themselves are laid out by layout_rows */
    r->spec_n = 0;
    r->spec_pending = false;
    r->spec_q = NULL;
    s->item_req[*n_items] = r;
    (*n_items)++;
}

/* Gives each item its logit rows, in item order (drafts grow items after add_item). */
static void layout_rows(struct sched *s, int n_items)
{
    size_t used = 0;
    for (int i = 0; i < n_items; i++) {
        s->items[i].logits = s->logits + used * (size_t)s->vocab;
        used += (size_t)s->items[i].n_logits;
    }
}

/* --- speculative drafts -------------------------------------------------------------------- */

/* Appends drafts to the items [i0, i1) whose sequences decode (the item reaches the sequence's
 * last token): as many as the sequence's k (adaptive or fixed), the request's room, the budget,
 * the free blocks and the logit rows allow. A draft model fills its drafts later
 * (spec_prepare). */
static void spec_extend(struct sched *s, int i0, int i1, struct rows *rw, int *budget,
                        int *free_blocks)
{
    struct kv_cache *kv = engine_kv(s->e);
    int planned = s->p.max_num_batched_tokens - *budget;
    double th = s->spec.adaptive ? spec_cost_threshold(&s->cost, i1, planned) : 0.0;
    for (int i = i0; i < i1; i++) {
        struct sched_req *r = s->item_req[i];
        struct engine_item *it = &s->items[i];
        if (!r->p.speculative || r->spec_stopped || r->p.max_tokens == 0 ||
            prompt_lps_pending(r) || it->pos + it->n_tokens != r->n_total)
            continue;
        if (s->spec.method == SPEC_MTP && !spec_feed_pays(&s->spec, &s->cost, &r->spec_acc, i1,
                                                           planned)) {
            /* the module's feed is paid every step whether the sequence drafts or not */
            r->spec_stopped = true;
            drafter_seq_release(s->drafter, &r->dseq);
            s->spec_stats.stopped++;
            continue;
        }
        /* hybrids: only once generating, with the state on its device (snapshots copy it), and
         * not while recomputing after a rollback: the snapshot is taken where the step starts,
         * so drafts on top of a recompute would, at the next rejection, roll back over it
         * again (the recomputed stretch growing step after step) */
        if (s->hybrid && (it->pos < r->n_prompt || r->kv.slot < 0 || it->pos < r->n_total - 1))
            continue;
        int k = spec_choose_k(&s->spec, &r->spec_acc, th);
        int left = r->p.max_tokens - (r->n_total - r->n_prompt) - 1; /* drafts worth making */
        if (k > left) k = left;
        if (k > r->cap - r->n_total) k = r->cap - r->n_total;
        if (k > s->max_model_len - r->n_total) k = s->max_model_len - r->n_total;
        if (k > *budget) k = *budget;
        if (k > rw->extra_left) k = rw->extra_left;
        int base = blocks_needed(s, r, it->n_tokens);
        while (k > 0 && blocks_needed(s, r, it->n_tokens + k) - base > *free_blocks) k--;
        if (k > 0 && s->hybrid && kv_seq_spare_slot(kv, &r->kv) < 0) k = 0;
        int n = 0;
        if (k > 0) {
            if (s->p.spec_propose) {
                n = s->p.spec_propose(s->p.spec_ctx, r, k, r->spec_draft);
            } else if (s->spec.method == SPEC_NGRAM) {
                n = spec_ngram_propose(r->tokens, r->n_total, s->spec.lookup_min,
                                       s->spec.lookup_max, k, r->spec_draft);
            } else if (s->spec.method == SPEC_DRAFT_MODEL) {
                n = k;
                r->spec_pending = true;
            } else if (s->spec.method == SPEC_MTP) {
                /* the module drafts from the target's hidden state at n_total - 2: only a
                 * plain decode token, after the feed that left that state pending */
                if (it->pos == r->n_total - 1 && r->dseq.init && !r->dseq.lost &&
                    r->dseq.pend_pos == r->n_total - 2) {
                    n = k;
                    r->spec_pending = true;
                }
            }
        }
        if (n > k) n = k;
        if (n <= 0) {
            r->spec_acc.idle++;
            continue;
        }
        for (int j = 0; j < n && !r->spec_pending; j++)
            if (r->spec_draft[j] < 0 || r->spec_draft[j] >= s->vocab) n = j; /* a bad proposal */
        if (n == 0) continue;
        *free_blocks -= blocks_needed(s, r, it->n_tokens + n) - base;
        *budget -= n;
        rw->extra_left -= n;
        rw->used += n;
        it->n_tokens += n;
        it->n_logits += n;
        r->spec_n = n;
        if (!r->spec_pending)
            memcpy(r->tokens + r->n_total, r->spec_draft, sizeof(int32_t) * (size_t)n);
    }
}

/* Drops the drafts of item i (its draft model failed, or its state could not be kept). */
static void spec_drop(struct sched *s, int i)
{
    struct sched_req *r = s->item_req[i];
    s->items[i].n_tokens -= r->spec_n;
    s->items[i].n_logits -= r->spec_n;
    r->spec_n = 0;
    r->spec_pending = false;
    r->spec_q = NULL;
}

/* Runs the draft model for the items whose drafts it owes, and for hybrid models keeps each
 * speculating sequence's state before the step. */
static void spec_prepare(struct sched *s, int n_items)
{
    char err[MS_ERR_LEN];
    if (s->drafter) {
        int n = 0;
        for (int i = 0; i < n_items; i++) {
            struct sched_req *r = s->item_req[i];
            if (!r->spec_pending) continue;
            /* sampled drafts (the general rule) at the request's temperature; a seeded request
             * drafts greedily, so that its output does not depend on speculation */
            bool sample = s->drafter_sampling && r->p.smp.temperature >= 1e-5f &&
                          (!r->p.smp.has_seed || s->p.spec_sample_seeded);
            s->djobs[n++] = (struct drafter_job){.seq = &r->dseq, .tokens = r->tokens,
                                                 .n_total = r->n_total, .k = r->spec_n,
                                                 .temperature = r->p.smp.temperature,
                                                 .rng = sample ? &r->spec_rng : NULL,
                                                 .out = r->spec_draft};
        }
        double t0 = ms_now();
        int rc = n > 0 ? drafter_run(s->drafter, s->djobs, n, err, sizeof err) : 0;
        int drafted = 0;
        for (int j = 0; j < n; j++) drafted += s->djobs[j].n_out;
        if (n > 0) spec_cost_observe_draft(&s->cost, drafted, ms_now() - t0);
        if (rc != 0)
            for (int i = 0; i < n_items; i++)
                if (s->item_req[i]->spec_pending) warn(s, s->item_req[i], err);
        for (int i = 0, j = 0; i < n_items && j < n; i++) {
            struct sched_req *r = s->item_req[i];
            if (!r->spec_pending) continue;
            struct drafter_job *jb = &s->djobs[j++];
            if (jb->n_out < r->spec_n) {
                spec_drop(s, i);
                continue;
            }
            r->spec_pending = false;
            r->spec_q = jb->q;
            r->spec_q_n = jb->q_n;
            memcpy(r->tokens + r->n_total, r->spec_draft, sizeof(int32_t) * (size_t)r->spec_n);
        }
    }
    for (int i = 0; s->hybrid && i < n_items; i++) {
        struct sched_req *r = s->item_req[i];
        if (r->spec_n > 0 && engine_state_snapshot(s->e, &r->kv, err, sizeof err) != 0) {
            warn(s, r, err);
            spec_drop(s, i);
        }
    }
}

/* After the step: samples the rows of item i (a sequence with drafts) in order, keeps the drafts
 * up to the first one its sample differs from, rolls the rest back (blocks, recurrent state,
 * draft K/V) and counts. Returns the finish reason; *n_gen gets the tokens generated. */
static enum sched_finish spec_verify(struct sched *s, int i, int *n_gen)
{
    struct sched_req *r = s->item_req[i];
    struct engine_item *it = &s->items[i];
    int d = r->spec_n, base_total = r->n_total, a = 0;
    r->spec_n = 0;
    enum sched_finish why = SCHED_FINISH_NONE;
    for (int j = 0; j <= d; j++) {
        int before = r->n_total;
        const float *q = j < d && r->spec_q ? r->spec_q + (size_t)j * (size_t)r->spec_q_n : NULL;
        why = accept_token_q(s, r, it->logits + (size_t)j * (size_t)s->vocab,
                             j < d ? r->spec_draft[j] : -1, q, r->spec_q_n);
        bool appended = r->n_total > before;
        *n_gen += appended;
        bool match = j < d && appended && r->tokens[r->n_total - 1] == r->spec_draft[j];
        a += match;
        if (why != SCHED_FINISH_NONE || !match) break;
    }
    r->spec_q = NULL;
    r->n_computed = base_total + a; /* the accepted drafts' K/V are right; the others' are not */
    int rpt = engine_rows_per_token(s->e, r->p.moe_top_k);
    s->spec_stats.drafts++;
    s->spec_stats.draft_tokens += (uint64_t)d;
    s->spec_stats.accepted += (uint64_t)a;
    for (int j = 0; j < a; j++) s->spec_stats.per_pos[j]++;
    s->spec_stats.draft_rows += (uint64_t)d * (uint64_t)rpt;
    s->spec_stats.rejected_rows += (uint64_t)(d - a) * (uint64_t)rpt;
    spec_acc_update(&r->spec_acc, d, a);
    r->spec_acc.idle = 0;
    if (why != SCHED_FINISH_NONE) return why; /* retired next: nothing to roll back */
    if (a < d) {
        kv_seq_truncate(engine_kv(s->e), &r->kv, r->n_computed);
        if (s->hybrid) {
            /* the state went past the rejected drafts: back to before the step; the tokens
             * since are computed again next step */
            engine_state_rollback(s->e, &r->kv);
            r->n_computed = r->kv.state_pos;
            s->spec_stats.rollbacks++;
        }
    }
    if (s->drafter) drafter_seq_keep(s->drafter, &r->dseq, base_total + a);
    return why;
}

/* Namespace of r's cached blocks: K/V depend on the cache's stored type and the expert budget,
 * not only on the tokens; a cache_salt (vLLM's) keeps a client's prefixes apart from everyone
 * else's. */
static uint64_t cache_key(const struct sched *s, const struct sched_req *r)
{
    uint64_t k = r->p.moe_top_k > 0 ? (uint64_t)r->p.moe_top_k : 0;
    k ^= (uint64_t)engine_kv(s->e)->geom.type << 56;
    if (r->p.moe_samples > 0 || r->p.moe_neuron_fraction > 0 || r->p.moe_samples_adaptive) {
        /* the continuous-experts budget: samples and the fraction's bits, mixed in */
        uint64_t fb;
        memcpy(&fb, &r->p.moe_neuron_fraction, sizeof fb);
        k ^= ((uint64_t)r->p.moe_samples << 16 | 1u << 15 | (uint64_t)r->p.moe_samples_adaptive << 14) *
             0xbf58476d1ce4e5b9ull;
        k ^= fb * 0x94d049bb133111ebull;
    }
    return r->p.cache_salt ? k ^ (r->p.cache_salt * 0x9e3779b97f4a7c15ull) : k;
}

/* After a step computed r up to r->n_computed: registers its full blocks for prefix caching and,
 * on a sliding-window model, gives back the blocks no later query reads (before
 * n_computed - window + 1). */
static void computed(struct sched *s, struct sched_req *r)
{
    if (s->prefix_caching)
        kv_seq_register(engine_kv(s->e), &r->kv, cache_key(s, r), r->tokens, r->n_computed);
    if (s->kv_window > 0)
        kv_seq_drop_before(engine_kv(s->e), &r->kv, r->n_computed - s->kv_window + 1);
}

/* Takes a running request out of the running list and retires it. */
static void finish_running(struct sched *s, struct sched_req *r, enum sched_finish why,
                           const char *msg)
{
    for (int j = 0; j < s->n_running; j++)
        if (s->running[j] == r) {
            running_remove(s, j);
            break;
        }
    retire(s, r, why, msg);
}

/* For a waiting request with nothing computed: takes its longest cached prefix, always leaving
 * at least one token to compute (the last one gives the logits). Returns the tokens taken. */
static int take_cached_prefix(struct sched *s, struct sched_req *r)
{
    struct kv_cache *kv = engine_kv(s->e);
    uint64_t key = cache_key(s, r);
    int bs = kv->block_size;
    int max_blocks = (r->n_total - 1) / bs;
    /* Computing position p gives token p+1's logprob: cached positions must all precede the
     * first token whose logprob is still missing. */
    if (prompt_lps_pending(r) && max_blocks > (r->out.n_prompt_lps - 1) / bs)
        max_blocks = (r->out.n_prompt_lps - 1) / bs;
    int limit = r->n_total - 1;
    if (prompt_lps_pending(r) && limit > r->out.n_prompt_lps - 1) limit = r->out.n_prompt_lps - 1;
    /* MTP drafting needs the module's K/V at every position the target takes from the cache
     * (no hidden states come for those): the module's cached prefix is taken first and the
     * target's kept within it when that recomputes at most one block more; otherwise the
     * target takes all it can and this sequence's module, missing states, drafts no more. */
    if (s->mtp && r->p.speculative) {
        int m = drafter_mtp_take(s->drafter, &r->dseq, key, r->tokens, limit);
        if (m >= 0 && m / bs >= kv_prefix_count(kv, key, r->tokens, max_blocks) - 1) {
            if (max_blocks > m / bs) max_blocks = m / bs;
            if (limit > m) limit = m;
        } else {
            drafter_seq_release(s->drafter, &r->dseq); /* holds nothing it can use */
        }
    }
    int n = kv_seq_match(kv, &r->kv, key, r->tokens, max_blocks);
    r->n_computed = n * bs;
    /* then the longest common prefix with a cached block nobody holds (token granular) */
    r->n_computed += kv_seq_match_tail(kv, &r->kv, key, r->tokens, limit);
    return r->n_computed;
}

/* Admits r from the wait queue into the running set: KV table, sampler. */
static int admit(struct sched *s, struct sched_req *r)
{
    if (!r->kv_init) {
        if (engine_seq_init(s->e, &r->kv) != 0) return -1;
        r->kv_init = true;
    }
    if (r->p.grammar && !r->gm) {
        r->gm = grm_matcher_create(r->p.grammar);
        if (!r->gm) return -1;
    }
    if (!r->smp) {
        r->smp = smp_create(s->vocab, &r->p.smp);
        if (!r->smp) return -1;
        for (int i = 0; i < r->n_prompt; i++) smp_accept(r->smp, r->tokens[i], false);
        r->t_scheduled = ms_now();
    }
    return 0;
}

/* Builds the step's items. Returns their number. */
static int plan(struct sched *s)
{
    struct kv_cache *kv = engine_kv(s->e);
    int budget = s->p.max_num_batched_tokens;
    int free_blocks = kv_free_blocks(kv);
    int n_items = 0;
    struct rows rw = {.used = 0, .extra_left = s->extra_rows};

    /* Running sequences first, oldest first; when blocks run out, preempt the newest. */
    for (int i = 0; i < s->n_running && budget > 0;) {
        struct sched_req *r = s->running[i];
        int n = r->n_total - r->n_computed;
        if (n > budget) n = budget;
        n = fit_rows(&rw, r, n);
        int need = blocks_needed(s, r, n);
        bool self_preempted = false;
        while (need > free_blocks) {
            int victim = s->n_running - 1;
            int before = kv_free_blocks(kv);
            preempt(s, victim);
            free_blocks += kv_free_blocks(kv) - before;
            if (victim == i) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;
        free_blocks -= need;
        budget -= n;
        add_item(s, &n_items, &rw, r, n);
        i++;
    }

    /* Drafts for the decoding sequences, from what the running ones left. */
    int n_running_items = n_items;
    if (s->spec_on) spec_extend(s, 0, n_items, &rw, &budget, &free_blocks);

    /* Then the wait queue, front first, while there is room. */
    while (s->wait_head && budget > 0 && s->n_running < s->p.max_num_seqs) {
        struct sched_req *r = s->wait_head;
        int hit = 0;
        bool looked = s->prefix_caching && r->n_computed == 0;
        if (looked) {
            if (!r->kv_init) {
                if (engine_seq_init(s->e, &r->kv) != 0) {
                    wait_remove(s, r);
                    retire(s, r, SCHED_FINISH_ERROR, "out of memory");
                    continue;
                }
                r->kv_init = true;
            }
            /* Taking evictable cached blocks uses up free ones. */
            int before = kv_free_blocks(kv);
            hit = take_cached_prefix(s, r);
            free_blocks -= before - kv_free_blocks(kv);
        }
        int n = r->n_total - r->n_computed;
        if (n > budget) n = budget;
        n = fit_rows(&rw, r, n);
        int need = blocks_needed(s, r, n);
        if (need > free_blocks) {
            if (hit > 0) {
                int before = kv_free_blocks(kv);
                kv_seq_release(kv, &r->kv);
                free_blocks += kv_free_blocks(kv) - before;
                r->n_computed = 0;
            }
            if (s->drafter) drafter_seq_release(s->drafter, &r->dseq); /* MTP blocks taken */
            break;
        }
        if (looked) {
            s->pc_queries += (uint64_t)r->n_total;
            s->pc_hits += (uint64_t)hit;
            if (!r->smp) {
                pthread_mutex_lock(&r->mu);
                r->out.n_cached_tokens = hit;
                pthread_mutex_unlock(&r->mu);
            }
        }
        wait_remove(s, r);
        if (admit(s, r) != 0) {
            retire(s, r, SCHED_FINISH_ERROR, "out of memory");
            continue;
        }
        s->running[s->n_running++] = r;
        free_blocks -= need;
        budget -= n;
        add_item(s, &n_items, &rw, r, n);
    }
    /* and for the admitted ones whose whole prompt fits this step, from what is left */
    if (s->spec_on) spec_extend(s, n_running_items, n_items, &rw, &budget, &free_blocks);
    layout_rows(s, n_items);
    return n_items;
}

static void maybe_reset_prefix(struct sched *s)
{
    if (atomic_exchange(&s->reset_prefix, false)) {
        kv_prefix_reset(engine_kv(s->e));
        publish_stats(s, 0);
    }
}

int sched_step(struct sched *s)
{
    take_incoming(s);
    reap_cancelled(s);
    maybe_reset_prefix(s);
    int n_items = plan(s);
    if (n_items == 0) {
        /* A lone request whose prompt cannot get blocks even with nothing else running can
         * never run: fail it rather than wait forever. */
        if (s->n_running == 0 && s->wait_head) {
            struct sched_req *r = s->wait_head;
            wait_remove(s, r);
            retire(s, r, SCHED_FINISH_ERROR, "the KV cache is too small for this request");
        }
        publish_stats(s, 0);
        return 0;
    }
    if (s->spec_on) spec_prepare(s, n_items);
    char err[MS_ERR_LEN];
    /* the cost fit sees decode steps only (each item one token plus its drafts): a prefill
     * chunk's tokens are cheaper per token (wider GEMMs) and, with a few of them, would own the
     * fit and make drafts look cheap in the decode steps the fit is for */
    int step_tokens = 0;
    bool decode_step = true;
    for (int i = 0; i < n_items; i++) {
        step_tokens += s->items[i].n_tokens;
        if (s->items[i].n_tokens - s->item_req[i]->spec_n != 1) decode_step = false;
    }
    if (s->mtp) { /* hidden states for the module, of the sequences that speculate */
        size_t off = 0, D = (size_t)s->m->desc.d_model;
        for (int i = 0; i < n_items; i++) {
            bool want = s->item_req[i]->p.speculative && !s->item_req[i]->spec_stopped;
            s->items[i].hidden_out = want ? s->hid + off * D : NULL;
            s->items[i].hidden_normed = true; /* what the MTP module was trained on */
            off += want ? (size_t)s->items[i].n_tokens : 0;
        }
    }
    double t_step = ms_now();
    int rc = engine_step(s->e, s->items, n_items, err, sizeof err);
    if (s->spec_on && rc == 0 && decode_step)
        spec_cost_observe(&s->cost, step_tokens, ms_now() - t_step);
    if (rc != 0) {
        /* Nothing was computed: fail the step's requests, keep serving the others. */
        for (int i = 0; i < n_items; i++) {
            finish_running(s, s->item_req[i], SCHED_FINISH_ERROR, err);
        }
        publish_stats(s, 0);
        return -1;
    }
    int n_prompt_tok = 0, n_gen_tok = 0, n_tok = 0, n_feeds = 0;
    for (int i = 0; i < n_items; i++) {
        struct sched_req *r = s->item_req[i];
        struct engine_item *it = &s->items[i];
        n_tok += it->n_tokens;
        enum sched_finish why = SCHED_FINISH_NONE;
        if (r->spec_n > 0) {
            /* a decode token with drafts: sample, keep what matches, roll back the rest */
            if (it->pos < r->n_prompt) n_prompt_tok += r->n_prompt - it->pos;
            why = spec_verify(s, i, &n_gen_tok);
            computed(s, r);
        } else {
            r->n_computed += it->n_tokens;
            computed(s, r);
            if (it->pos < r->n_prompt) n_prompt_tok += (it->pos + it->n_tokens < r->n_prompt
                                                            ? it->n_tokens
                                                            : r->n_prompt - it->pos);
            if (prompt_lps_pending(r)) record_prompt_lps(s, r, it);
            if (r->n_computed >= r->n_total) { /* else a prefill chunk before the last */
                why = SCHED_FINISH_LENGTH; /* max_tokens 0: done after the prefill */
                if (r->p.max_tokens > 0) {
                    why = accept_token(s, r,
                                       it->logits + (size_t)(it->n_logits - 1) * (size_t)s->vocab);
                    n_gen_tok++;
                }
            }
        }
        if (why != SCHED_FINISH_NONE) {
            finish_running(s, r, why, NULL);
            continue;
        }
        if (it->hidden_out) {
            s->feed_req[n_feeds] = r;
            s->feeds[n_feeds++] = (struct drafter_feed){.seq = &r->dseq, .tokens = r->tokens,
                                                        .n_total = r->n_total, .pos = it->pos,
                                                        .n_valid = r->n_computed - it->pos,
                                                        .hidden = it->hidden_out,
                                                        .cache = s->prefix_caching,
                                                        .key = cache_key(s, r)};
        }
    }
    if (n_feeds > 0) {
        double t_feed = ms_now();
        if (drafter_mtp_feed(s->drafter, s->feeds, n_feeds, err, sizeof err) != 0)
            for (int j = 0; j < n_feeds; j++) warn(s, s->feed_req[j], err);
        else if (decode_step)
            spec_cost_observe_feed(&s->cost, n_feeds, ms_now() - t_feed);
    }
    pthread_mutex_lock(&s->st_mu);
    s->st.prompt_tokens += (uint64_t)n_prompt_tok;
    s->st.generation_tokens += (uint64_t)n_gen_tok;
    s->st.spec_drafts = s->spec_stats.drafts;
    s->st.spec_draft_tokens = s->spec_stats.draft_tokens;
    s->st.spec_accepted_tokens = s->spec_stats.accepted;
    memcpy(s->st.spec_accepted_per_pos, s->spec_stats.per_pos, sizeof s->st.spec_accepted_per_pos);
    s->st.spec_draft_rows = s->spec_stats.draft_rows;
    s->st.spec_rejected_rows = s->spec_stats.rejected_rows;
    s->st.spec_rollbacks = s->spec_stats.rollbacks;
    s->st.spec_stopped = s->spec_stats.stopped;
    pthread_mutex_unlock(&s->st_mu);
    if (s->p.obs.on_step) s->p.obs.on_step(s->p.obs.ctx, n_tok, n_items);
    if (s->p.after_step) s->p.after_step(s->p.after_step_ctx, s->e);
    publish_stats(s, n_items);
    return n_items;
}

bool sched_has_work(struct sched *s)
{
    if (s->n_running > 0 || s->wait_head) return true;
    pthread_mutex_lock(&s->in_mu);
    bool any = s->in_head != NULL;
    pthread_mutex_unlock(&s->in_mu);
    return any;
}

/* --- submission ---------------------------------------------------------------------------- */

int sched_submit(struct sched *s, struct sched_req *r, char *err, size_t errlen)
{
    if (r->cap > s->max_model_len) {
        ms_errf(err, errlen,
                "this model's maximum context length is %d tokens; the request has %d prompt "
                "tokens and max_tokens %d",
                s->max_model_len, r->n_prompt, r->p.max_tokens);
        return SCHED_EINVAL;
    }
    const struct kv_cache *kv = engine_kv(s->e);
    int blocks = (r->cap + kv->block_size - 1) / kv->block_size;
    if (s->kv_window > 0) { /* at most the window and one step's tokens are held at once */
        int live = (s->kv_window - 1 + s->p.max_num_batched_tokens + kv->block_size - 1) /
                       kv->block_size + 1;
        blocks = blocks < live ? blocks : live;
    }
    if (blocks > kv->n_blocks) { /* would wait forever: no amount of retrying helps */
        ms_errf(err, errlen,
                "%d prompt tokens plus max_tokens %d need %d KV cache blocks of %d tokens, and the "
                "whole cache holds %d (%d tokens; see --kv-cache-memory, --kv-cache-dtype)",
                r->n_prompt, r->p.max_tokens, blocks, kv->block_size, kv->n_blocks,
                kv->n_blocks * kv->block_size);
        return SCHED_EINVAL;
    }
    for (int i = 0; i < r->n_prompt; i++)
        if (r->tokens[i] < 0 || r->tokens[i] >= s->vocab) {
            ms_errf(err, errlen, "token id %d out of range [0, %d)", r->tokens[i], s->vocab);
            return SCHED_EINVAL;
        }
    pthread_mutex_lock(&s->in_mu);
    if (s->closed) {
        pthread_mutex_unlock(&s->in_mu);
        ms_errf(err, errlen, "the server is shutting down");
        return SCHED_ECLOSED;
    }
    if (atomic_load(&s->n_queued) >= s->p.max_waiting) {
        pthread_mutex_unlock(&s->in_mu);
        ms_errf(err, errlen, "the wait queue is full (%d requests)", s->p.max_waiting);
        return SCHED_EFULL;
    }
    sched_req_retain(r);
    r->next = NULL;
    if (s->in_tail) s->in_tail->next = r;
    else s->in_head = r;
    s->in_tail = r;
    s->n_in++;
    atomic_fetch_add(&s->n_queued, 1);
    pthread_mutex_unlock(&s->in_mu);
    sched_wake(s);
    return 0;
}

void sched_close(struct sched *s)
{
    pthread_mutex_lock(&s->in_mu);
    s->closed = true;
    pthread_mutex_unlock(&s->in_mu);
}

/* Finishes everything still held (shutdown). */
static void abort_all(struct sched *s)
{
    take_incoming(s);
    while (s->n_running > 0) {
        struct sched_req *r = s->running[s->n_running - 1];
        s->n_running--;
        retire(s, r, SCHED_FINISH_ABORT, "the server is shutting down");
    }
    while (s->wait_head) {
        struct sched_req *r = s->wait_head;
        wait_remove(s, r);
        retire(s, r, SCHED_FINISH_ABORT, "the server is shutting down");
    }
    publish_stats(s, 0);
}

/* --- loop thread --------------------------------------------------------------------------- */

static void on_idle(uv_idle_t *h);

static void loop_update_idle(struct sched *s)
{
    bool want = sched_has_work(s) && !atomic_load(&s->quit);
    if (want && !s->idle_on) uv_idle_start(&s->idle, on_idle);
    if (!want && s->idle_on) uv_idle_stop(&s->idle);
    s->idle_on = want;
}

/* While there is work, the idle handle runs one step per loop iteration (the loop does not
 * block then); without work it is stopped and the loop sleeps until the next uv_async_send. */
static void on_idle(uv_idle_t *h)
{
    struct sched *s = h->data;
    sched_step(s);
    loop_update_idle(s);
}

static void on_wake(uv_async_t *h)
{
    struct sched *s = h->data;
    if (atomic_load(&s->quit)) {
        pthread_mutex_lock(&s->wake_mu);
        s->wake_open = false;
        pthread_mutex_unlock(&s->wake_mu);
        abort_all(s);
        if (s->idle_on) uv_idle_stop(&s->idle);
        s->idle_on = false;
        uv_close((uv_handle_t *)&s->idle, NULL);
        uv_close((uv_handle_t *)&s->wake, NULL);
        return;
    }
    maybe_reset_prefix(s);
    loop_update_idle(s);
}

static void loop_main(void *arg)
{
    struct sched *s = arg;
    pthread_mutex_lock(&s->st_mu);
    s->st.loop_running = true;
    pthread_mutex_unlock(&s->st_mu);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    pthread_mutex_lock(&s->st_mu);
    s->st.loop_running = false;
    pthread_mutex_unlock(&s->st_mu);
}

int sched_start(struct sched *s, char *err, size_t errlen)
{
    if (s->started) return ms_errf(err, errlen, "the scheduler loop is already running");
    int rc = uv_loop_init(&s->loop);
    if (rc != 0) return ms_errf(err, errlen, "uv_loop_init: %s", uv_strerror(rc));
    s->loop_init = true;
    uv_async_init(&s->loop, &s->wake, on_wake);
    s->wake.data = s;
    uv_idle_init(&s->loop, &s->idle);
    s->idle.data = s;
    s->started = true;
    pthread_mutex_lock(&s->wake_mu);
    s->wake_open = true;
    pthread_mutex_unlock(&s->wake_mu);
    rc = uv_thread_create(&s->thread, loop_main, s);
    if (rc != 0) {
        s->started = false;
        pthread_mutex_lock(&s->wake_mu);
        s->wake_open = false;
        pthread_mutex_unlock(&s->wake_mu);
        uv_close((uv_handle_t *)&s->idle, NULL);
        uv_close((uv_handle_t *)&s->wake, NULL);
        uv_run(&s->loop, UV_RUN_DEFAULT);
        uv_loop_close(&s->loop);
        s->loop_init = false;
        return ms_errf(err, errlen, "cannot start the scheduler thread: %s", uv_strerror(rc));
    }
    sched_wake(s); /* pick up anything submitted before the start */
    return 0;
}

void sched_stop(struct sched *s)
{
    if (!s->started) return;
    atomic_store(&s->quit, true);
    sched_wake(s);
    uv_thread_join(&s->thread);
    s->started = false;
    uv_loop_close(&s->loop);
    s->loop_init = false;
}

void sched_free(struct sched *s)
{
    if (!s) return;
    sched_stop(s);
    abort_all(s);
    pthread_mutex_destroy(&s->in_mu);
    pthread_mutex_destroy(&s->st_mu);
    pthread_mutex_destroy(&s->wake_mu);
    free(s->running);
    free(s->items);
    free(s->item_req);
    free(s->logits);
    free(s->djobs);
    free(s->hid);
    free(s->feeds);
    free(s->feed_req);
    free(s->spill);
    free(s);
}

void sched_get_stats(struct sched *s, struct sched_stats *st)
{
    pthread_mutex_lock(&s->st_mu);
    *st = s->st;
    pthread_mutex_unlock(&s->st_mu);
    st->waiting = atomic_load(&s->n_queued);
}

void sched_reset_prefix_cache(struct sched *s)
{
    atomic_store(&s->reset_prefix, true);
    sched_wake(s);
}

struct engine *sched_engine(struct sched *s)
{
    return s->e;
}

bool sched_spec_enabled(const struct sched *s)
{
    return s->spec_on;
}
