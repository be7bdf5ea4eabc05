/* Scheduler: continuous batching of generation requests over one engine. Each step takes the
 * running sequences (one decode token each, or the next chunk of a prefill) and admits waiting
 * requests while the step's token budget (max_num_batched_tokens), the sequence limit
 * (max_num_seqs) and the free KV blocks allow. When a running sequence needs a block and none
 * is free, the newest running sequence is preempted by recompute: its blocks are freed and it
 * goes back to the front of the wait queue with its generated tokens appended to its prompt,
 * so it later resumes exactly where it stopped. Sampling, stop strings, EOS and length limits
 * and incremental detokenization happen here, so a request's output queue holds final text.
 *
 * Prompt logprobs (sched_req_params.prompt_logprobs): the prefill chunks of such a request ask
 * the engine for logits at every position, so each prompt token's logprob comes from the
 * forward pass that computes its K/V anyway; the rows are bounded per step (a chunk is cut to
 * the rows left), and positions whose logprobs are still missing are never skipped by the
 * prefix cache. max_tokens == 0 is valid: the request ends ("length") when its prefill is done.
 *
 * Structured output (sched_req_params.grammar): before each draw the request's grammar matcher
 * masks the logits (engine/grammar), after it the matcher takes the token.
 *
 * Prefix caching (on unless sched_params.disable_prefix_caching): when a request is admitted
 * with nothing computed, it takes the longest run of cached full KV blocks matching its tokens
 * (kv_seq_match) and its prefill starts after them; at least the last token is always computed
 * so that it gets logits. After each step the full blocks a sequence has computed are registered
 * (kv_seq_register), prompt and generated tokens alike, so later requests with the same prefix
 * and a preempted request coming back both hit them. Blocks are keyed by the request's
 * moe_top_k, moe_samples and moe_neuron_fraction as well, since the expert budget changes the K/V
 * of every layer after the first.
 *
 * Speculative decoding (sched_params.spec; engine/spec.h): after the running sequences are
 * planned, each one that decodes (its item ends at its last token) may append drafted tokens —
 * n-gram prompt lookup, a draft model's (engine/drafter.h) or a test's own — charged to the
 * step's token budget, free KV blocks and logit rows, never at the price of a preemption or of
 * a running sequence's tokens; then newly admitted requests whose whole prompt fits the step
 * may draft their first tokens from what is left. The engine computes them in the same step (n_logits = drafts + 1)
 * and each row is then sampled in order as a token would be without speculation (the request's
 * sampler, grammar, stop conditions); the drafts are kept up to the first the sample differs
 * from, so output is distributed exactly as without speculation (greedy: identical; seeded: the
 * same tokens). A draft model drafting by sampling (an unseeded request at temperature > 0) is
 * verified by the general rule instead: accept with probability min(1, p/q), else draw from
 * max(0, p - q) (smp_sample_verify): the same distribution, other random numbers. The KV
 * blocks past the accepted tokens go back to the pool; prefix-cache registration only ever
 * covers accepted tokens. Hybrid models keep a second recurrent-state slot per sequence
 * (engine_params.spec_state): the state is copied there before a verification, and after a
 * rejection the sequence returns to it and recomputes the accepted tokens in its next step
 * (their K/V rewritten with the same values; that step drafts nothing). The number of drafts is
 * chosen per sequence and step from its acceptance rate and a fitted step-cost line
 * (spec_choose_k) unless the configuration fixes it; a request can opt out
 * (sched_req_params.speculative).
 *
 * Threads: one thread owns the scheduler, the engine and the KV cache. Either the caller runs
 * sched_step itself (tests), or sched_start runs a libuv loop thread that steps whenever there
 * is work and sleeps on a uv_async otherwise (no busy polling). Any thread may call
 * sched_submit, sched_req_cancel and read a request's output under its lock.
 *
 * Ownership: the scheduler borrows the engine (it must outlive the scheduler). Requests are
 * reference counted: sched_req_create returns one reference owned by the caller; sched_submit
 * takes another that the scheduler drops when the request finishes. A request's output
 * (struct sched_out) is written by the scheduler thread and read by others under
 * sched_req_lock; its text and token arrays only grow, so readers keep their own cursors. */
#ifndef MOESERVE_SCHEDULER_H
#define MOESERVE_SCHEDULER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "drafter.h"
#include "engine.h"
#include "grammar.h"
#include "sampler.h"
#include "spec.h"
#include "stopstr.h"
#include "tokenizer.h"

struct sched;

#define SCHED_MAX_STOP 8      /* stop strings per request */
#define SCHED_MAX_STOP_LEN 256 /* bytes per stop string */

enum sched_finish {
    SCHED_FINISH_NONE,   /* still running */
    SCHED_FINISH_STOP,   /* EOS or a stop string */
    SCHED_FINISH_LENGTH, /* max_tokens or max_model_len reached */
    SCHED_FINISH_ABORT,  /* cancelled or the server is shutting down */
    SCHED_FINISH_ERROR,  /* the engine failed; message in sched_out.error */
};

const char *sched_finish_str(enum sched_finish f); /* "stop", "length", "abort", "error", NULL */

/* What a request asks for. Copied by sched_req_create. */
struct sched_req_params {
    int max_tokens;         /* >= 0; prompt + max_tokens must fit max_model_len */
    struct smp_params smp;  /* smp.n_logprobs > 0 records top alternatives */
    bool logprobs;          /* record the chosen token's logprob (and smp.n_logprobs tops) */
    bool ignore_eos;
    bool skip_special;      /* drop special tokens from the text (default true) */
    int moe_top_k;          /* 0 = the model's */
    uint16_t tag;           /* tag of the request's tokens in routing captures (0: none) */
    int moe_samples;        /* continuous experts: 0 = the engine's default */
    double moe_neuron_fraction; /* continuous experts: 0 = the engine's default */
    bool moe_samples_adaptive;  /* continuous experts: per-token K around moe_samples */
    int prompt_logprobs;    /* < 0: off; else record every prompt token's logprob (from the
                               prefill the request runs anyway) with this many alternatives */
    int n_stop;
    const char *stop[SCHED_MAX_STOP]; /* stop strings (not included in the text) */
    bool include_stop_str;  /* keep the matched stop string in the text */
    const int32_t *stop_ids; /* (n_stop_ids) tokens that end the request ("stop") like EOS,
                                their text kept unless special and skipped; copied */
    int n_stop_ids;
    int min_tokens;         /* EOS, stop_ids and stop strings count only from this many on */
    uint64_t cache_salt;    /* requests share cached prefix blocks only with the same salt */
    /* Structured output: only tokens this grammar allows are drawn (sched_req_create takes a
     * reference). The request ends ("stop") when the grammar is complete and nothing may
     * follow, or when it allows no token at all (then with a warning, on_warning). */
    struct grm_grammar *grammar;
    bool speculative;       /* draft tokens for this request when the scheduler speculates
                               (default true; vLLM-style opt-out: false) */
};

void sched_req_params_default(struct sched_req_params *p);

/* Output of one request, written by the scheduler thread under the request's lock. */
struct sched_out {
    char *text;               /* (text_len) published text; may move when it grows */
    size_t text_len, text_cap;
    int32_t *tokens;          /* (max_tokens) generated token ids */
    struct smp_logprobs *lps; /* (max_tokens) when logprobs were asked for, else NULL */
    int n_tokens;
    /* (n_prompt) when prompt_logprobs >= 0, else NULL: entry q is prompt token q's logprob given
     * the tokens before it (entry 0, the first token, has none and stays zeroed). Entries
     * [1, n_prompt_lps) are published; n_prompt_lps == n_prompt once the prefill is done. */
    struct smp_logprobs *prompt_lps;
    int n_prompt_lps;
    int n_cached_tokens;      /* prompt tokens whose K/V came from the prefix cache */
    double ttft_s;            /* seconds from arrival to the first generated token (0 before) */
    enum sched_finish finish; /* set once, after the last text and tokens are published */
    char error[128];
    /* Wakes the reader (e.g. resumes a suspended HTTP connection). Called by the scheduler
     * thread with the request's lock held, after new output was published; it must not take
     * that lock again. Set with sched_req_set_notify. */
    void (*notify)(void *ctx);
    void *notify_ctx;
};

struct sched_req {
    /* immutable after sched_req_create */
    uint64_t id;
    int32_t *tokens;          /* (cap) prompt, then generated tokens (scheduler thread) */
    int n_prompt;
    int cap;                  /* n_prompt + max_tokens */
    struct sched_req_params p;
    char stop_buf[SCHED_MAX_STOP][SCHED_MAX_STOP_LEN + 1];
    int32_t *stop_ids;        /* (p.n_stop_ids) own copy */
    struct smp_bias *bias;    /* (p.smp.n_bias) own copy */
    int32_t *allowed;         /* (p.smp.n_allowed) own copy */
    struct grm_matcher *gm;   /* the grammar's state, created at admission; NULL without one */
    double t_arrival;

    /* scheduler thread only */
    int n_total;              /* tokens in `tokens` (prompt + generated) */
    int n_computed;           /* positions already in the KV cache */
    bool kv_init;
    struct kv_seq kv;
    struct sampler *smp;
    struct tok_stream ts;
    struct stopstr ss;        /* stop strings over the decoded text (text held back) */
    double t_scheduled, t_first_token, t_last_token;
    int n_preempted;
    /* speculative decoding: this step's drafts (also at tokens[n_total, n_total + spec_n)),
     * the acceptance record, and the draft model's K/V of this sequence */
    int spec_n;
    bool spec_pending;        /* a draft model fills the drafts before the step */
    bool spec_stopped;        /* adaptive MTP: its feed costs more than its drafts gain; the
                                 request no longer speculates (spec_feed_pays) */
    int32_t spec_draft[SPEC_MAX_K];
    const float *spec_q;      /* sampled drafts: (spec_n, spec_q_n) the distributions they were
                                 drawn from (the drafter's, valid for this step), else NULL */
    int spec_q_n;
    struct ms_rng spec_rng;   /* the draft model's generator for sampled drafts */
    struct spec_acc spec_acc;
    struct drafter_seq dseq;
    struct sched_req *next, *prev; /* wait queue / incoming list links */

    /* shared */
    pthread_mutex_t mu;
    struct sched_out out;     /* under mu */
    atomic_bool cancelled;
    atomic_int refs;
};

/* Creates a request for `n_prompt` prompt ids. Returns NULL with a reason in err (empty
 * prompt, too many stop strings, out of memory). */
struct sched_req *sched_req_create(const int32_t *prompt, int n_prompt,
                                   const struct sched_req_params *p, char *err, size_t errlen);
void sched_req_retain(struct sched_req *r);
void sched_req_release(struct sched_req *r); /* frees the request at the last reference */
/* Marks the request cancelled; the scheduler finishes it with SCHED_FINISH_ABORT and frees its
 * KV blocks at its next step. Safe from any thread, any number of times. */
void sched_req_cancel(struct sched *s, struct sched_req *r);
void sched_req_lock(struct sched_req *r);
void sched_req_unlock(struct sched_req *r);
void sched_req_set_notify(struct sched_req *r, void (*notify)(void *ctx), void *ctx);

/* A finished request's sizes and times, for metrics (sched_observer.on_request_done). Times
 * are seconds; a phase the request never reached (no first token, never scheduled) is -1. */
struct sched_req_done {
    uint64_t id;
    enum sched_finish why;
    int n_prompt, n_generated, max_tokens;
    double queue_s;     /* arrival to first scheduled */
    double prefill_s;   /* first scheduled to first token */
    double decode_s;    /* first token to last token */
    double inference_s; /* first scheduled to last token */
    double e2e_s;       /* arrival to finish */
};

/* Hooks for metrics, called on the scheduler thread (may be NULL). */
struct sched_observer {
    void *ctx;
    void (*on_first_token)(void *ctx, double ttft_s, double queue_s);
    void (*on_token)(void *ctx, double itl_s);
    void (*on_finish)(void *ctx, enum sched_finish why, int n_prompt, int n_generated,
                      double e2e_s);
    void (*on_step)(void *ctx, int n_tokens, int n_seqs);
    /* After on_finish, with the request's phases (vLLM's prefill/decode/inference times). */
    void (*on_request_done)(void *ctx, const struct sched_req_done *d);
    /* Something about one request a log should show (e.g. its grammar allowed no token). */
    void (*on_warning)(void *ctx, uint64_t req_id, const char *msg);
};

struct sched_params {
    int max_num_seqs;           /* sequences per step; <= the engine's max_seqs */
    int max_num_batched_tokens; /* tokens per step; <= the engine's max_batch_tokens */
    int max_waiting;            /* wait-queue length at which sched_submit refuses (0 = 1024) */
    bool disable_prefix_caching;/* vLLM's --no-enable-prefix-caching; caching is on by default */
    struct sched_observer obs;
    /* Called on the scheduler thread after every step that ran, the engine idle, before the
     * next one is planned: where a step's routing is recorded (engine_last_routing) and the
     * placement rebalanced (engine_set_placement). May be NULL. */
    void (*after_step)(void *ctx, struct engine *e);
    void *after_step_ctx;
    /* Speculative decoding (copied; NULL or method SPEC_OFF: none). SPEC_DRAFT_MODEL needs
     * `drafter` (borrowed: it must outlive the scheduler); hybrid models need an engine created
     * with spec_state. SPEC_MTP is refused (not built). */
    const struct spec_config *spec;
    struct drafter *drafter;
    /* Tests and benchmarks: proposes the drafts instead of the method (up to k into out;
     * returns how many). Called on the scheduler thread; NULL: the method's proposer. */
    int (*spec_propose)(void *ctx, const struct sched_req *r, int k, int32_t *out);
    void *spec_ctx;
    /* Tests: seeded requests also draft by sampling (from their seed); normally they draft
     * greedily, so that their output does not depend on speculation. */
    bool spec_sample_seeded;
};

/* Snapshot of counters and gauges (any thread). */
struct sched_stats {
    int running, waiting;
    int kv_blocks_total, kv_blocks_free; /* free counts cached-but-evictable blocks */
    int kv_blocks_cached;                /* evictable blocks holding cached prefixes */
    uint64_t prefix_cache_queries;       /* tokens looked up in the prefix cache */
    uint64_t prefix_cache_hits;          /* of those, tokens found cached */
    uint64_t preemptions;
    uint64_t steps;
    uint64_t prompt_tokens, generation_tokens;
    bool loop_running;
    /* speculative decoding (vLLM's spec_decode_* counters) */
    int spec_k;                    /* num_speculative_tokens; 0: not speculating */
    uint64_t spec_drafts;          /* verifications: a sequence's drafts in one step */
    uint64_t spec_draft_tokens;    /* drafted tokens verified */
    uint64_t spec_accepted_tokens; /* of those, accepted */
    uint64_t spec_accepted_per_pos[SPEC_MAX_K]; /* accepted drafts by position in their run */
    uint64_t spec_draft_rows;      /* token-expert rows computed for drafted positions */
    uint64_t spec_rejected_rows;   /* of those, for drafts that were then rejected */
    uint64_t spec_rollbacks;       /* hybrid models: states returned to their snapshot */
    uint64_t spec_stopped;         /* requests that stopped speculating: adaptive MTP whose
                                      module feed cost more than its drafts gained */
};

int sched_create(struct engine *e, const struct sched_params *p, struct sched **out, char *err,
                 size_t errlen);
/* Stops the loop thread if it runs, aborts every request left and frees the scheduler. */
void sched_free(struct sched *s);

/* Hands r to the scheduler (it takes its own reference). Returns 0, or -1 with a reason:
 * SCHED_EFULL when the wait queue is full (retry later), SCHED_ECLOSED after sched_close,
 * SCHED_EINVAL when the request cannot fit the model or the KV cache. */
enum { SCHED_EINVAL = -1, SCHED_EFULL = -2, SCHED_ECLOSED = -3 };
int sched_submit(struct sched *s, struct sched_req *r, char *err, size_t errlen);
/* Refuses new requests from now on; requests already in stay and finish. */
void sched_close(struct sched *s);

/* Runs one step on the caller's thread (only when the loop thread is not started). Returns the
 * number of sequences that ran, 0 when there was nothing to do, -1 on an engine error (those
 * requests are finished with SCHED_FINISH_ERROR; the scheduler stays usable). */
int sched_step(struct sched *s);
bool sched_has_work(struct sched *s);

/* Starts the libuv loop thread that steps while there is work. */
int sched_start(struct sched *s, char *err, size_t errlen);
/* Aborts every request and joins the loop thread. */
void sched_stop(struct sched *s);

void sched_get_stats(struct sched *s, struct sched_stats *st);
/* Asks the scheduler thread to forget every cached prefix block nobody uses (vLLM's
 * /reset_prefix_cache); takes effect at its next step. Any thread. */
void sched_reset_prefix_cache(struct sched *s);
struct engine *sched_engine(struct sched *s);
/* Whether the scheduler speculates (sched_params.spec). */
bool sched_spec_enabled(const struct sched *s);

#endif
