/* Scheduler tests on the tiny f32 mixtral fixture, driven without HTTP: greedy output of a
 * request alone equals its output alongside 15 others (with chunked prefill), preemption when
 * KV blocks are scarce still completes every request with the same output, cancellation frees
 * blocks, stop strings cut the text, back-pressure and oversize requests are refused, the
 * libuv loop thread runs requests to completion, and prefix caching reuses full prompt blocks
 * (a repeated prompt hits all its full blocks but the one holding its last token) without
 * changing any greedy output compared with the cache disabled; with every layer given a
 * sliding window, a sequence gives back the blocks before its window as it grows (its blocks
 * in use stay bounded, a cache smaller than the sequence serves it) with the same greedy
 * output as the engine driven alone. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "scheduler.h"
#include "test.h"

#define N_REQ 16
#define MAX_TOK 12

static int32_t prompts[N_REQ][96];
static int prompt_len[N_REQ];

static void make_prompts(int vocab)
{
    uint32_t x = 12345;
    for (int i = 0; i < N_REQ; i++) {
        prompt_len[i] = 3 + (i * 37) % 90;
        for (int t = 0; t < prompt_len[i]; t++) {
            x = x * 1664525u + 1013904223u;
            prompts[i][t] = 1 + (int32_t)((x >> 8) % (uint32_t)(vocab - 1));
        }
    }
}

static struct sched_req *make_req(int i, int max_tokens)
{
    struct sched_req_params p;
    sched_req_params_default(&p);
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    p.smp.temperature = 0;
    char err[MS_ERR_LEN];
    struct sched_req *r = sched_req_create(prompts[i], prompt_len[i], &p, err, sizeof err);
    if (!r) fprintf(stderr, "sched_req_create: %s\n", err);
    return r;
}

/* The engine the tests run on: the CPU backend on one device, then (the last runs of main)
 * two staged devices, the layout of a multi-GPU engine (sequences sticky to a device, KV
 * storage per device). */
static enum engine_backend g_backend = ENGINE_BACKEND_CPU;
static int g_devices = 1;

static struct engine *make_engine(const struct model *m, size_t kv_bytes, int batch_tokens)
{
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = g_backend;
    ep.n_devices = g_devices;
    ep.max_seqs = N_REQ;
    ep.max_batch_tokens = batch_tokens;
    ep.max_model_len = 128;
    ep.kv_cache_bytes = kv_bytes;
    char err[MS_ERR_LEN];
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) fprintf(stderr, "engine: %s\n", err);
    return e;
}

static struct sched *make_sched_pc(struct engine *e, int batch_tokens, int max_waiting,
                                   bool prefix_caching)
{
    struct sched_params sp = {.max_num_seqs = N_REQ, .max_num_batched_tokens = batch_tokens,
                              .max_waiting = max_waiting,
                              .disable_prefix_caching = !prefix_caching};
    char err[MS_ERR_LEN];
    struct sched *s = NULL;
    if (sched_create(e, &sp, &s, err, sizeof err) != 0) fprintf(stderr, "sched: %s\n", err);
    return s;
}

static struct sched *make_sched(struct engine *e, int batch_tokens, int max_waiting)
{
    return make_sched_pc(e, batch_tokens, max_waiting, true);
}

static void run_until_idle(struct sched *s)
{
    for (int guard = 0; guard < 100000 && sched_has_work(s); guard++) sched_step(s);
}

/* Runs requests idx[0..n) together and copies their generated tokens into out. */
static void run_batch(struct sched *s, const int *idx, int n, int32_t out[][MAX_TOK],
                      enum sched_finish *fin)
{
    struct sched_req *r[N_REQ];
    char err[MS_ERR_LEN];
    for (int k = 0; k < n; k++) {
        r[k] = make_req(idx[k], MAX_TOK);
        CHECK(r[k] != NULL);
        CHECKF(sched_submit(s, r[k], err, sizeof err) == 0, "%s", err);
    }
    run_until_idle(s);
    for (int k = 0; k < n; k++) {
        sched_req_lock(r[k]);
        fin[idx[k]] = r[k]->out.finish;
        CHECK(r[k]->out.n_tokens == MAX_TOK);
        memcpy(out[idx[k]], r[k]->out.tokens, sizeof(int32_t) * MAX_TOK);
        sched_req_unlock(r[k]);
        sched_req_release(r[k]);
    }
}

static void test_batching(const struct model *m, int32_t alone[N_REQ][MAX_TOK])
{
    struct engine *e = make_engine(m, 0, 64);
    struct sched *s = e ? make_sched(e, 64, 0) : NULL;
    CHECK(s != NULL);
    if (!s) goto out;
    enum sched_finish fin[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        run_batch(s, &i, 1, alone, fin);
        CHECK(fin[i] == SCHED_FINISH_LENGTH);
    }
    int idx[N_REQ];
    for (int i = 0; i < N_REQ; i++) idx[i] = i;
    int32_t together[N_REQ][MAX_TOK];
    run_batch(s, idx, N_REQ, together, fin);
    for (int i = 0; i < N_REQ; i++) {
        CHECKF(fin[i] == SCHED_FINISH_LENGTH, "request %d finish %d", i, fin[i]);
        CHECKF(memcmp(alone[i], together[i], sizeof together[i]) == 0,
               "request %d: greedy output differs alone vs batched", i);
    }
    struct sched_stats st;
    sched_get_stats(s, &st);
    CHECK(st.running == 0 && st.waiting == 0);
    CHECK(st.kv_blocks_free == st.kv_blocks_total);
    CHECK(st.preemptions == 0);
out:
    sched_free(s);
    engine_free(e);
}

static void test_preemption(const struct model *m, int32_t alone[N_REQ][MAX_TOK],
                            bool prefix_caching)
{
    const struct model_desc *d = &m->desc;
    /* 14 blocks of 16 tokens: about two of the longest requests at a time. */
    size_t bytes = kv_block_bytes(d->n_layer, d->n_kv_head, d->head_dim, 16) * 14;
    struct engine *e = make_engine(m, bytes, 32);
    struct sched *s = e ? make_sched_pc(e, 32, 0, prefix_caching) : NULL;
    CHECK(s != NULL);
    if (!s) goto out;
    int idx[N_REQ];
    for (int i = 0; i < N_REQ; i++) idx[i] = i;
    int32_t out_tok[N_REQ][MAX_TOK];
    enum sched_finish fin[N_REQ];
    run_batch(s, idx, N_REQ, out_tok, fin);
    for (int i = 0; i < N_REQ; i++) {
        CHECKF(fin[i] == SCHED_FINISH_LENGTH, "request %d finish %d", i, fin[i]);
        CHECKF(memcmp(alone[i], out_tok[i], sizeof out_tok[i]) == 0,
               "request %d: greedy output differs under preemption", i);
    }
    struct sched_stats st;
    sched_get_stats(s, &st);
    CHECKF(st.preemptions > 0, "expected preemptions with %d blocks", st.kv_blocks_total);
    CHECK(st.kv_blocks_free == st.kv_blocks_total);
    if (!prefix_caching) CHECK(st.prefix_cache_queries == 0 && st.prefix_cache_hits == 0);
    /* preempted requests come back to their own cached blocks when nobody evicted them */
    if (prefix_caching) CHECK(st.prefix_cache_hits > 0);
    printf("preemption (prefix caching %s): %llu preemptions with %d KV blocks, %llu of %llu "
           "tokens re-hit\n",
           prefix_caching ? "on" : "off", (unsigned long long)st.preemptions,
           st.kv_blocks_total, (unsigned long long)st.prefix_cache_hits,
           (unsigned long long)st.prefix_cache_queries);
out:
    sched_free(s);
    engine_free(e);
}

static void test_cancel_and_limits(const struct model *m)
{
    struct engine *e = make_engine(m, 0, 64);
    struct sched *s = e ? make_sched(e, 64, 6) : NULL;
    CHECK(s != NULL);
    if (!s) goto out;
    char err[MS_ERR_LEN];
    struct sched_req *r[6];
    for (int k = 0; k < 6; k++) {
        r[k] = make_req(k, 40);
        CHECK(sched_submit(s, r[k], err, sizeof err) == 0);
    }
    /* the wait queue holds 6: a seventh is refused with EFULL */
    struct sched_req *extra = make_req(7, 4);
    CHECK(sched_submit(s, extra, err, sizeof err) == SCHED_EFULL);
    for (int k = 0; k < 8; k++) sched_step(s);
    struct sched_stats before, after;
    sched_get_stats(s, &before);
    CHECK(before.running == 6);
    sched_req_cancel(s, r[1]);
    sched_req_cancel(s, r[4]);
    sched_step(s);
    sched_get_stats(s, &after);
    CHECK(after.running == 4);
    CHECKF(after.kv_blocks_free > before.kv_blocks_free, "free blocks %d -> %d",
           before.kv_blocks_free, after.kv_blocks_free);
    sched_req_lock(r[1]);
    CHECK(r[1]->out.finish == SCHED_FINISH_ABORT);
    sched_req_unlock(r[1]);
    /* now there is room again */
    CHECK(sched_submit(s, extra, err, sizeof err) == 0);
    run_until_idle(s);
    sched_get_stats(s, &after);
    CHECK(after.kv_blocks_free == after.kv_blocks_total);
    for (int k = 0; k < 6; k++) {
        sched_req_lock(r[k]);
        if (k != 1 && k != 4) CHECK(r[k]->out.finish == SCHED_FINISH_LENGTH && r[k]->out.n_tokens == 40);
        sched_req_unlock(r[k]);
        sched_req_release(r[k]);
    }
    sched_req_lock(extra);
    CHECK(extra->out.finish == SCHED_FINISH_LENGTH && extra->out.n_tokens == 4);
    sched_req_unlock(extra);
    sched_req_release(extra);

    /* too long for max_model_len (128) */
    struct sched_req *big = make_req(3, 120);
    CHECK(sched_submit(s, big, err, sizeof err) == SCHED_EINVAL);
    sched_req_release(big);
    /* closed: refused */
    sched_close(s);
    struct sched_req *late = make_req(0, 2);
    CHECK(sched_submit(s, late, err, sizeof err) == SCHED_ECLOSED);
    sched_req_release(late);
out:
    sched_free(s);
    engine_free(e);
}

static void test_stop_string(const struct model *m)
{
    if (!m->tok) return;
    struct engine *e = make_engine(m, 0, 64);
    struct sched *s = e ? make_sched(e, 64, 0) : NULL;
    CHECK(s != NULL);
    if (!s) goto out;
    char err[MS_ERR_LEN];
    struct sched_req_params p;
    sched_req_params_default(&p);
    p.max_tokens = 24;
    p.ignore_eos = true;
    p.smp.temperature = 0;
    struct sched_req *r = sched_req_create(prompts[5], prompt_len[5], &p, err, sizeof err);
    CHECK(sched_submit(s, r, err, sizeof err) == 0);
    run_until_idle(s);
    char full[4096];
    snprintf(full, sizeof full, "%s", r->out.text);
    sched_req_release(r);
    size_t len = strlen(full);
    CHECKF(len >= 6, "generated text too short: '%s'", full);
    if (len >= 6) {
        /* stop at a 3-byte string from the middle: output is everything before its first
         * occurrence */
        char stop[4];
        memcpy(stop, full + len / 2, 3);
        stop[3] = '\0';
        const char *first = strstr(full, stop);
        p.n_stop = 1;
        p.stop[0] = stop;
        r = sched_req_create(prompts[5], prompt_len[5], &p, err, sizeof err);
        CHECK(sched_submit(s, r, err, sizeof err) == 0);
        run_until_idle(s);
        CHECK(r->out.finish == SCHED_FINISH_STOP);
        CHECKF(r->out.text_len == (size_t)(first - full) &&
                   memcmp(r->out.text, full, r->out.text_len) == 0,
               "stop '%s': got '%s' from '%s'", stop, r->out.text, full);
        sched_req_release(r);
    }
out:
    sched_free(s);
    engine_free(e);
}

/* A token whose text is longer than the scheduler's piece buffer (a long added token) is
 * published whole, and a stop string inside it still cuts there. The model's tokenizer is
 * swapped for a small one written here whose added token 5 is 1500 bytes; allowed_token_ids
 * makes the sampler draw it. */
static void test_long_token(struct model *m)
{
    enum { LONG = 1500 };
    char path[] = "/tmp/moeserve_longtok_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    FILE *f = fdopen(fd, "w");
    fputs("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"d\": 3, "
          "\"e\": 4}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"ByteLevel\", "
          "\"add_prefix_space\": false, \"use_regex\": true}, \"decoder\": {\"type\": "
          "\"ByteLevel\"}, \"added_tokens\": [{\"id\": 5, \"content\": \"", f);
    for (int i = 0; i < LONG; i++) fputc(i == LONG / 2 ? 'Z' : 'x', f);
    fputs("\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
          "\"normalized\": false, \"special\": false}]}", f);
    fclose(f);
    struct tokenizer *tok = NULL;
    char err[MS_ERR_LEN];
    int lrc = tok_load(path, NULL, &tok, err, sizeof err);
    unlink(path);
    CHECKF(lrc == 0, "%s", err);
    if (lrc != 0) return;
    struct tokenizer *saved = m->tok;
    m->tok = tok;
    struct engine *e = make_engine(m, 0, 64);
    struct sched *s = e ? make_sched(e, 64, 0) : NULL;
    CHECK(s != NULL);
    for (int with_stop = 0; s && with_stop < 2; with_stop++) {
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = 2;
        p.ignore_eos = true;
        int32_t five = 5;
        p.smp.allowed = &five;
        p.smp.n_allowed = 1;
        if (with_stop) {
            p.n_stop = 1;
            p.stop[0] = "xZx";
        }
        struct sched_req *r = sched_req_create(prompts[0], prompt_len[0], &p, err, sizeof err);
        CHECK(r && sched_submit(s, r, err, sizeof err) == 0);
        run_until_idle(s);
        size_t want = with_stop ? LONG / 2 - 1 : 2 * LONG;
        CHECKF(r->out.text_len == want, "stop %d: %zu bytes, want %zu", with_stop,
               r->out.text_len, want);
        CHECK(r->out.text_len == 0 || r->out.text[0] == 'x');
        sched_req_release(r);
    }
    sched_free(s);
    engine_free(e);
    m->tok = saved;
    tok_free(tok);
}

/* The loop thread: requests submitted from this thread, completion seen through notify. */
struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int notified;
};

static void on_notify(void *ctx)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->notified++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void test_loop_thread(const struct model *m, int32_t alone[N_REQ][MAX_TOK])
{
    struct engine *e = make_engine(m, 0, 64);
    struct sched *s = e ? make_sched(e, 64, 0) : NULL;
    CHECK(s != NULL);
    if (!s) goto out;
    char err[MS_ERR_LEN];
    CHECKF(sched_start(s, err, sizeof err) == 0, "%s", err);
    struct waiter w = {.notified = 0};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    struct sched_req *r[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        r[i] = make_req(i, MAX_TOK);
        sched_req_set_notify(r[i], on_notify, &w);
        CHECK(sched_submit(s, r[i], err, sizeof err) == 0);
    }
    for (int i = 0; i < N_REQ; i++) {
        for (;;) {
            sched_req_lock(r[i]);
            enum sched_finish f = r[i]->out.finish;
            sched_req_unlock(r[i]);
            if (f != SCHED_FINISH_NONE) break;
            /* Never hold w.mu while taking the request's lock: notify runs under the latter
             * and takes the former. */
            pthread_mutex_lock(&w.mu);
            int seen = w.notified;
            pthread_mutex_unlock(&w.mu);
            sched_req_lock(r[i]);
            f = r[i]->out.finish;
            sched_req_unlock(r[i]);
            if (f != SCHED_FINISH_NONE) break;
            pthread_mutex_lock(&w.mu);
            while (w.notified == seen) pthread_cond_wait(&w.cv, &w.mu);
            pthread_mutex_unlock(&w.mu);
        }
        sched_req_lock(r[i]);
        CHECK(r[i]->out.finish == SCHED_FINISH_LENGTH);
        CHECKF(memcmp(r[i]->out.tokens, alone[i], sizeof alone[i]) == 0,
               "loop thread: request %d differs", i);
        sched_req_unlock(r[i]);
    }
    /* a request still running when the loop stops is aborted */
    struct sched_req *longr = make_req(2, 40);
    CHECK(sched_submit(s, longr, err, sizeof err) == 0);
    sched_stop(s);
    sched_req_lock(longr);
    CHECK(longr->out.finish != SCHED_FINISH_NONE);
    sched_req_unlock(longr);
    sched_req_release(longr);
    for (int i = 0; i < N_REQ; i++) sched_req_release(r[i]);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
out:
    sched_free(s);
    engine_free(e);
}

/* Runs one request to completion on s; returns its cached prompt tokens, copies its output. */
static int run_one(struct sched *s, const int32_t *prompt, int n, int moe_top_k,
                   int32_t out[MAX_TOK])
{
    struct sched_req_params p;
    sched_req_params_default(&p);
    p.max_tokens = MAX_TOK;
    p.ignore_eos = true;
    p.smp.temperature = 0;
    p.moe_top_k = moe_top_k;
    char err[MS_ERR_LEN];
    struct sched_req *r = sched_req_create(prompt, n, &p, err, sizeof err);
    CHECK(r != NULL);
    if (!r) return -1;
    CHECKF(sched_submit(s, r, err, sizeof err) == 0, "%s", err);
    run_until_idle(s);
    sched_req_lock(r);
    CHECK(r->out.finish == SCHED_FINISH_LENGTH && r->out.n_tokens == MAX_TOK);
    memcpy(out, r->out.tokens, sizeof(int32_t) * MAX_TOK);
    int cached = r->out.n_cached_tokens;
    sched_req_unlock(r);
    sched_req_release(r);
    return cached;
}

/* Prefix caching: the same prompt twice, a prompt sharing a prefix, another expert budget, and
 * a chunked prefill resuming after a hit, each compared with the cache disabled. Full blocks
 * are shared; the first differing block nobody holds is taken over up to its common prefix
 * (kv_seq_match_tail), so a repeated prompt recomputes only its last token. */
static void test_prefix_cache(const struct model *m)
{
    enum { LONG = 96, ODD = 90, BSZ = 16 };
    struct engine *e_on = make_engine(m, 0, 64), *e_off = make_engine(m, 0, 64);
    struct sched *on = e_on ? make_sched_pc(e_on, 64, 0, true) : NULL;
    struct sched *off = e_off ? make_sched_pc(e_off, 64, 0, false) : NULL;
    struct engine *e_chunk = make_engine(m, 0, 24);
    struct sched *chunk = e_chunk ? make_sched_pc(e_chunk, 24, 0, true) : NULL;
    CHECK(on && off && chunk);
    if (!on || !off || !chunk) goto out;
    CHECK(engine_kv(e_on)->block_size == BSZ);
    static int32_t pa[LONG], pb[LONG];
    uint32_t x = 777;
    for (int t = 0; t < LONG; t++) {
        x = x * 1664525u + 1013904223u;
        pa[t] = 1 + (int32_t)((x >> 8) % (uint32_t)(m->desc.vocab - 1));
    }
    memcpy(pb, pa, sizeof pb);
    for (int t = 64; t < LONG; t++) pb[t] = 1 + (pa[t] * 7 + 3) % (m->desc.vocab - 1);

    int32_t ref_a[MAX_TOK], ref_a90[MAX_TOK], ref_b[MAX_TOK], ref_k1[MAX_TOK], got[MAX_TOK];
    CHECK(run_one(off, pa, LONG, 0, ref_a) == 0);
    CHECK(run_one(off, pa, ODD, 0, ref_a90) == 0);
    CHECK(run_one(off, pb, LONG, 0, ref_b) == 0);
    CHECK(run_one(off, pa, LONG, 1, ref_k1) == 0);
    struct sched_stats st;
    sched_get_stats(off, &st);
    CHECK(st.prefix_cache_queries == 0 && st.prefix_cache_hits == 0 && st.kv_blocks_cached == 0);

    /* first run: a miss, then its blocks stay cached while counted free */
    CHECK(run_one(on, pa, LONG, 0, got) == 0);
    CHECK(memcmp(got, ref_a, sizeof got) == 0);
    sched_get_stats(on, &st);
    CHECK(st.prefix_cache_queries == LONG && st.prefix_cache_hits == 0);
    /* 96 prompt + 11 computed generated tokens = 107 positions: 6 full blocks registered and
     * the 11-token tail kept */
    CHECKF(st.kv_blocks_cached == 7, "cached blocks %d", st.kv_blocks_cached);
    CHECK(st.kv_blocks_free == st.kv_blocks_total);

    /* the same prompt again: every token but the last (it must be computed for its logits):
     * five full blocks, then 15 tokens of the sixth, taken over from the cache */
    int hit = run_one(on, pa, LONG, 0, got);
    CHECKF(hit == LONG - 1, "hit %d tokens, want %d", hit, LONG - 1);
    CHECKF(memcmp(got, ref_a, sizeof got) == 0, "greedy output differs after a prefix hit");
    /* a shorter prompt with a partial last block: its full blocks and the common prefix of the
     * next cached one */
    hit = run_one(on, pa, ODD, 0, got);
    CHECKF(hit == ODD - 1, "hit %d tokens, want %d", hit, ODD - 1);
    CHECK(memcmp(got, ref_a90, sizeof got) == 0);
    /* sharing the first 64 tokens */
    hit = run_one(on, pb, LONG, 0, got);
    CHECKF(hit == 64, "shared-prefix hit %d tokens, want 64", hit);
    CHECK(memcmp(got, ref_b, sizeof got) == 0);
    /* another expert budget computes other K/V: no hit */
    hit = run_one(on, pa, LONG, 1, got);
    CHECKF(hit == 0, "moe_top_k 1 hit %d tokens", hit);
    CHECK(memcmp(got, ref_k1, sizeof got) == 0);
    hit = run_one(on, pa, LONG, 1, got);
    CHECK(hit == LONG - 1);
    CHECK(memcmp(got, ref_k1, sizeof got) == 0);
    sched_get_stats(on, &st);
    CHECKF(st.prefix_cache_queries == 5 * LONG + ODD, "queries %llu",
           (unsigned long long)st.prefix_cache_queries);
    CHECKF(st.prefix_cache_hits == (uint64_t)(2 * (LONG - 1) + (ODD - 1) + 64), "hits %llu",
           (unsigned long long)st.prefix_cache_hits);
    CHECK(st.kv_blocks_free == st.kv_blocks_total && st.running == 0);

    /* chunked prefill (24 tokens a step) resuming after a hit; a second identical prompt
     * waiting while the first runs (the budget admits it once the first decodes) shares the
     * first one's blocks while both run */
    CHECK(run_one(chunk, pa, LONG, 0, got) == 0);
    CHECK(memcmp(got, ref_a, sizeof got) == 0);
    CHECK(run_one(chunk, pa, LONG, 0, got) == LONG - 1);
    CHECK(memcmp(got, ref_a, sizeof got) == 0);
    CHECK(run_one(chunk, pb, LONG, 0, got) == 64);
    CHECK(memcmp(got, ref_b, sizeof got) == 0);
    {
        int32_t pc[LONG];
        for (int t = 0; t < LONG; t++) pc[t] = pb[LONG - 1 - t];
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = MAX_TOK;
        p.ignore_eos = true;
        p.smp.temperature = 0;
        char err[MS_ERR_LEN];
        struct sched_req *r1 = sched_req_create(pc, LONG, &p, err, sizeof err);
        struct sched_req *r2 = sched_req_create(pc, LONG, &p, err, sizeof err);
        CHECK(r1 && r2);
        if (r1 && r2) {
            CHECK(sched_submit(chunk, r1, err, sizeof err) == 0);
            CHECK(sched_submit(chunk, r2, err, sizeof err) == 0);
            run_until_idle(chunk);
            CHECK(r1->out.n_tokens == MAX_TOK && r2->out.n_tokens == MAX_TOK);
            CHECK(memcmp(r1->out.tokens, r2->out.tokens, sizeof(int32_t) * MAX_TOK) == 0);
            CHECK(r1->out.n_cached_tokens == 0);
            /* the full blocks; r1 still holds the sixth, so no token of it is taken */
            CHECKF(r2->out.n_cached_tokens == LONG - BSZ, "r2 hit %d", r2->out.n_cached_tokens);
        }
        sched_req_release(r1);
        sched_req_release(r2);
        /* the cached copy is found again afterwards */
        int32_t ref_c[MAX_TOK];
        CHECK(run_one(off, pc, LONG, 0, ref_c) == 0);
        CHECK(run_one(chunk, pc, LONG, 0, got) == LONG - 1);
        CHECK(memcmp(got, ref_c, sizeof got) == 0);
    }
    sched_get_stats(chunk, &st);
    CHECK(st.kv_blocks_free == st.kv_blocks_total);

    /* two identical prompts admitted in the same step both miss (blocks register only once
     * computed); the second copy stays private and the next request hits the first one */
    {
        enum { SHORT = 40 };
        int32_t ref_s[MAX_TOK];
        const int32_t *ps = pb + 50;
        CHECK(run_one(off, ps, SHORT, 0, ref_s) == 0);
        struct sched_req_params p;
        sched_req_params_default(&p);
        p.max_tokens = MAX_TOK;
        p.ignore_eos = true;
        p.smp.temperature = 0;
        char err[MS_ERR_LEN];
        struct sched_req *r1 = sched_req_create(ps, SHORT, &p, err, sizeof err);
        struct sched_req *r2 = sched_req_create(ps, SHORT, &p, err, sizeof err);
        CHECK(r1 && r2);
        if (r1 && r2) {
            CHECK(sched_submit(on, r1, err, sizeof err) == 0);
            CHECK(sched_submit(on, r2, err, sizeof err) == 0);
            CHECK(sched_step(on) == 2);
            run_until_idle(on);
            CHECK(r1->out.n_cached_tokens == 0 && r2->out.n_cached_tokens == 0);
            CHECK(memcmp(r1->out.tokens, ref_s, sizeof ref_s) == 0);
            CHECK(memcmp(r2->out.tokens, ref_s, sizeof ref_s) == 0);
        }
        sched_req_release(r1);
        sched_req_release(r2);
        CHECK(run_one(on, ps, SHORT, 0, got) == SHORT - 1);
        CHECK(memcmp(got, ref_s, sizeof got) == 0);
        sched_get_stats(on, &st);
        CHECK(st.kv_blocks_free == st.kv_blocks_total);
    }
    /* reset: cached blocks are forgotten, the next run misses */
    sched_get_stats(on, &st);
    CHECK(st.kv_blocks_cached > 0);
    sched_reset_prefix_cache(on);
    CHECK(sched_step(on) == 0);
    sched_get_stats(on, &st);
    CHECK(st.kv_blocks_cached == 0 && st.kv_blocks_free == st.kv_blocks_total);
    CHECK(run_one(on, pa, LONG, 0, got) == 0);
    CHECK(memcmp(got, ref_a, sizeof got) == 0);
    sched_get_stats(chunk, &st);
    printf("prefix cache: %llu of %llu tokens hit (chunked run)\n",
           (unsigned long long)st.prefix_cache_hits, (unsigned long long)st.prefix_cache_queries);
out:
    sched_free(on);
    sched_free(off);
    sched_free(chunk);
    engine_free(e_on);
    engine_free(e_off);
    engine_free(e_chunk);
}

/* One step of one sequence; logits of its last token into out (vocab). */
static int step_one(struct engine *e, struct kv_seq *kv, const int32_t *tok, int n, int pos,
                    float *out)
{
    char err[MS_ERR_LEN];
    struct engine_item it = {.kv = kv, .tokens = tok, .n_tokens = n, .pos = pos, .n_logits = 1,
                             .logits = out};
    int rc = engine_step(e, &it, 1, err, sizeof err);
    if (rc) fprintf(stderr, "step: %s\n", err);
    return rc;
}

/* Sticky devices and prefix caching: a sequence that takes cached blocks must run on the device
 * holding their K/V, even when another device has fewer sequences. A and B pin one sequence on
 * each device, A2 a second on device 0, so C (the prompt's first owner) lands on device 1; once
 * C and A2 are gone both devices hold one sequence and the least-loaded rule alone would pick
 * device 0 for D, which reuses C's blocks. D's logits must equal a fresh CPU prefill. */
static void test_sticky_prefix(const struct model *m)
{
    enum { P = 64, HIT = 48 };
    int V = m->desc.vocab;
    struct engine *e = make_engine(m, 0, 64);
    g_backend = ENGINE_BACKEND_CPU;
    g_devices = 1;
    struct engine *ref = make_engine(m, 0, 64);
    g_backend = ENGINE_BACKEND_CPU_STAGED;
    g_devices = 2;
    float *got = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    struct kv_seq a, b, a2, c, d, r;
    bool freed[6] = {false};
    int n_init = 0;
    CHECK(e && ref && got && want);
    if (!e || !ref || !got || !want) goto out;
    struct kv_seq *all[] = {&a, &b, &a2, &c, &d, &r};
    for (; n_init < 6; n_init++)
        if (engine_seq_init(n_init == 5 ? ref : e, all[n_init]) != 0) goto out;
    int32_t prompt[P];
    for (int t = 0; t < P; t++) prompt[t] = 1 + (t * 37 + 11) % (V - 1);
    CHECK(step_one(e, &a, prompt, 1, 0, got) == 0 && a.device == 0);
    CHECK(step_one(e, &b, prompt, 1, 0, got) == 0 && b.device == 1);
    CHECK(step_one(e, &a2, prompt, 1, 0, got) == 0 && a2.device == 0);
    CHECK(step_one(e, &c, prompt, P, 0, got) == 0 && c.device == 1);
    struct kv_cache *kv = engine_kv(e);
    kv_seq_register(kv, &c, 7, prompt, P);
    engine_seq_free(e, &c);
    engine_seq_free(e, &a2);
    freed[3] = freed[2] = true;
    int taken = kv_seq_match(kv, &d, 7, prompt, HIT / kv->block_size);
    CHECKF(taken * kv->block_size == HIT, "prefix match took %d blocks", taken);
    CHECK(step_one(e, &d, prompt + HIT, P - HIT, HIT, got) == 0);
    CHECKF(d.device == 1, "the sequence reusing device 1's blocks runs on device %d", d.device);
    CHECK(step_one(ref, &r, prompt, P, 0, want) == 0);
    double num = 0, den = 0;
    for (int i = 0; i < V; i++) {
        num += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    CHECKF(sqrt(num / den) < 1e-5, "logits after a cross-device prefix hit: rel err %.3e",
           sqrt(num / den));
out:
    for (int i = 0; i < n_init; i++)
        if (!freed[i]) engine_seq_free(i == 5 ? ref : e, all[i]);
    engine_free(e);
    engine_free(ref);
    free(got);
    free(want);
}

/* Sticky devices and preemption: a sequence released (preempted) on device 1 that then takes
 * cached prefix blocks computed on device 0 must move to device 0, where their K/V are; it
 * used to stay on device 1 and attend over that device's stale storage. Its logits must equal
 * a fresh CPU prefill. */
static void test_sticky_release(const struct model *m)
{
    enum { P = 64, HIT = 48 };
    int V = m->desc.vocab;
    struct engine *e = make_engine(m, 0, 64);
    g_backend = ENGINE_BACKEND_CPU;
    g_devices = 1;
    struct engine *ref = make_engine(m, 0, 64);
    g_backend = ENGINE_BACKEND_CPU_STAGED;
    g_devices = 2;
    float *got = malloc(sizeof(float) * V), *want = malloc(sizeof(float) * V);
    struct kv_seq a, b, r;
    int n_init = 0;
    CHECK(e && ref && got && want);
    if (!e || !ref || !got || !want) goto out;
    struct kv_seq *all[] = {&a, &b, &r};
    for (; n_init < 3; n_init++)
        if (engine_seq_init(n_init == 2 ? ref : e, all[n_init]) != 0) goto out;
    int32_t prompt[P];
    for (int t = 0; t < P; t++) prompt[t] = 1 + (t * 29 + 5) % (V - 1);
    CHECK(step_one(e, &a, prompt, P, 0, got) == 0 && a.device == 0);
    CHECK(step_one(e, &b, prompt + 7, 20, 0, got) == 0 && b.device == 1);
    struct kv_cache *kv = engine_kv(e);
    kv_seq_register(kv, &a, 9, prompt, P);
    kv_seq_release(kv, &b); /* what the scheduler's preemption does */
    int taken = kv_seq_match(kv, &b, 9, prompt, HIT / kv->block_size);
    CHECKF(taken * kv->block_size == HIT, "prefix match took %d blocks", taken);
    CHECK(step_one(e, &b, prompt + HIT, P - HIT, HIT, got) == 0);
    CHECKF(b.device == 0, "the released sequence reusing device 0's blocks runs on device %d",
           b.device);
    CHECK(step_one(ref, &r, prompt, P, 0, want) == 0);
    double num = 0, den = 0;
    for (int i = 0; i < V; i++) {
        num += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    CHECKF(sqrt(num / den) < 1e-5, "logits after a preempted sequence's prefix hit: rel err %.3e",
           sqrt(num / den));
out:
    for (int i = 0; i < n_init; i++) engine_seq_free(i == 2 ? ref : e, all[i]);
    engine_free(e);
    engine_free(ref);
    free(got);
    free(want);
}

/* Greedy decode of prompt i on the engine alone (no scheduler, nothing given back). */
static void engine_greedy(struct engine *e, int i, int n, int32_t *out)
{
    struct kv_seq q;
    char err[MS_ERR_LEN];
    int V = engine_model(e)->desc.vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    CHECK(logits && engine_seq_init(e, &q) == 0);
    if (!logits) return;
    int32_t tok[128];
    memcpy(tok, prompts[i], sizeof(int32_t) * (size_t)prompt_len[i]);
    int len = prompt_len[i];
    struct engine_item it = {.kv = &q, .tokens = tok, .n_tokens = len, .pos = 0, .n_logits = 1,
                             .logits = logits};
    for (int k = 0; k < n; k++) {
        CHECKF(engine_step(e, &it, 1, err, sizeof err) == 0, "%s", err);
        int best = 0;
        for (int v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
        out[k] = tok[len] = best;
        it = (struct engine_item){.kv = &q, .tokens = tok + len, .n_tokens = 1, .pos = len,
                                  .n_logits = 1, .logits = logits};
        len++;
    }
    engine_seq_free(e, &q);
    free(logits);
}

/* A sliding window on every layer (8 positions, blocks of 16): the longest prompt (90 tokens)
 * plus 30 new ones, prefilled 32 at a time. */
static void test_sliding_window(struct model *m)
{
    enum { W = 8, NEW = 30, BATCH = 32 };
    int saved = m->desc.sliding_window;
    m->desc.sliding_window = W;
    int i = 0;
    for (int k = 1; k < N_REQ; k++) i = prompt_len[k] > prompt_len[i] ? k : i;
    const struct model_desc *d = &m->desc;
    /* 5 blocks (80 tokens) for a sequence of 120 positions: enough only if blocks go back */
    size_t bytes = kv_block_bytes(d->n_layer, d->n_kv_head, d->head_dim, 16) * 5;
    struct engine *e = make_engine(m, bytes, BATCH);
    struct sched *s = e ? make_sched(e, BATCH, 0) : NULL;
    CHECK(s != NULL && engine_kv_window(e) == W);
    if (!s) goto out;
    int32_t ref[NEW];
    struct engine *eref = make_engine(m, 0, 128); /* room for everything, nothing given back */
    CHECK(eref != NULL);
    if (eref) engine_greedy(eref, i, NEW, ref);
    engine_free(eref);
    struct sched_req_params p;
    sched_req_params_default(&p);
    p.max_tokens = NEW;
    p.ignore_eos = true;
    p.smp.temperature = 0;
    char err[MS_ERR_LEN];
    struct sched_req *r = sched_req_create(prompts[i], prompt_len[i], &p, err, sizeof err);
    CHECKF(r && sched_submit(s, r, err, sizeof err) == 0, "%s", err);
    /* in use: at most the window and one step's tokens, 3 blocks of 16 */
    int most = 0;
    struct sched_stats st;
    for (int guard = 0; guard < 1000 && sched_has_work(s); guard++) {
        sched_step(s);
        sched_get_stats(s, &st);
        int used = st.kv_blocks_total - st.kv_blocks_free;
        most = used > most ? used : most;
    }
    int bound = (W - 1 + BATCH + 15) / 16 + 1;
    CHECKF(most <= bound, "sliding window: %d blocks in use at once (bound %d)", most, bound);
    if (r) {
        sched_req_lock(r);
        CHECKF(r->out.n_tokens == NEW && memcmp(r->out.tokens, ref, sizeof ref) == 0,
               "sliding window: greedy output differs from the engine alone");
        sched_req_unlock(r);
        sched_req_release(r);
    }
    sched_get_stats(s, &st);
    CHECK(st.kv_blocks_free == st.kv_blocks_total);
    printf("sliding window %d: %d positions in at most %d blocks of 16 (of %d)\n", W,
           prompt_len[i] + NEW, most, st.kv_blocks_total);
out:
    sched_free(s);
    engine_free(e);
    m->desc.sliding_window = saved;
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    if (model_load(test_path(tests, "fixtures/models/mixtral"), &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "model_load: %s\n", err);
        CHECK(0);
        return test_done("test_sched");
    }
    make_prompts(m->desc.vocab);
    static int32_t alone[N_REQ][MAX_TOK];
    test_batching(m, alone);
    test_preemption(m, alone, true);
    test_preemption(m, alone, false);
    test_prefix_cache(m);
    test_cancel_and_limits(m);
    test_stop_string(m);
    test_long_token(m);
    test_loop_thread(m, alone);
    test_sliding_window(m);
    /* Sticky devices: preempted sequences and prefix hits must come back to the device that
     * holds their K/V; outputs as on one CPU device. */
    g_backend = ENGINE_BACKEND_CPU_STAGED;
    g_devices = 2;
    printf("two staged devices (sticky sequences):\n");
    test_preemption(m, alone, true);
    test_prefix_cache(m);
    test_sticky_prefix(m);
    test_sticky_release(m);
    test_sliding_window(m);
    model_free(m);
    return test_done("test_sched");
}
