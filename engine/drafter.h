/* Draft-model speculation: a second, small model of the same tokenizer runs in an engine of its
 * own (its own KV cache, sized for every sequence the target engine runs) and proposes each
 * speculating sequence's next tokens: greedily (its argmax, a point mass: see spec.h for why that
 * keeps the target distribution exact), or, for a job that asks, sampled at the request's
 * temperature from the draft's own distribution q, which the drafter keeps for the verification
 * (smp_sample_verify: the general accept/resample rule). A round of drafting first
 * brings every sequence's draft K/V up to its last token (the whole prompt at its first round,
 * in chunks of the draft engine's step budget; afterwards the one or two tokens the last
 * verification added), which yields each first draft, then runs one batched step per further
 * draft position. After verification, drafter_seq_keep rolls a sequence's draft K/V back to the
 * tokens that turned out right.
 *
 * Ownership and threads: drafter_create borrows the draft model (it must outlive the drafter)
 * and allocates the engine and every buffer a round needs; drafter_run allocates nothing but
 * a sequence's block table at its first round. A drafter_seq belongs to one target sequence;
 * drafter_seq_release frees its blocks and table. Everything runs on the scheduler's thread. */
#ifndef MOESERVE_DRAFTER_H
#define MOESERVE_DRAFTER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine.h"
#include "model.h"
#include "rng.h"

struct drafter;

struct drafter_seq {
    struct kv_seq kv;
    int n_computed; /* leading tokens of the sequence whose K/V the draft engine holds (MTP:
                       leading indices, index i fusing the target's h_i with token i + 1) */
    bool init;      /* kv has a block table */
    /* MTP: the target's last hidden state fed but not yet used (h at position pend_pos, -1:
     * none), (d_model) allocated at the first feed; lost: the module missed hidden states it
     * needs (the target skipped positions, e.g. a cached prefix) and drafts no more for this
     * sequence. */
    float *pend;
    int pend_pos;
    bool lost;
};

/* Whether `draft` can draft for `target`: the same tokenizer (every token's string, the special
 * tokens included) and no recurrent layers (their state could not be rolled back). 0, or -1
 * with a reason. */
int drafter_check(const struct model *target, const struct model *draft, char *err, size_t errlen);

/* An engine for `draft` with p's devices, threads, sequences, step budget, context and KV type
 * (its KV cache sized for p->max_seqs full sequences whatever p says). max_id: drafts are
 * ids below it (the target's vocabulary). max_k: drafts per sequence and round at most; the
 * draft distributions of sampled jobs take p->max_seqs * max_k * max_id floats, kept only when
 * that is at most 512 MiB (else every job drafts greedily: drafter_samples says which). 0, or
 * -1 with the reason. */
int drafter_create(const struct model *draft, const struct engine_params *p, int max_id, int max_k,
                   struct drafter **out, char *err, size_t errlen);
/* Multi-token prediction: a drafter whose draft model is MTP module 0 of `target` (loaded with
 * model_load_opts.mtp; target->n_mtp > 0), run as a one-layer model (model_mtp_view) in an
 * engine of its own made as drafter_create makes one. The module needs the target's hidden
 * state at every position, so after every target step each speculating sequence's hidden
 * states are fed (drafter_mtp_feed), which computes the module's K/V up to the last of them
 * and keeps that one for the round (drafter_run) that follows the next sampled token: index
 * n - 2 (the target's h_{n-2} and the token just sampled) gives the first draft, and each
 * further draft fuses the previous draft with the module's own output in place of the
 * target's (its chain). Those chained indices are dropped after the round. 0, or -1 with the
 * reason. */
int drafter_create_mtp(const struct model *target, const struct engine_params *p, int max_k,
                       struct drafter **out, char *err, size_t errlen);

/* One sequence's part of a feed: the target step computed positions [pos, pos + n_valid) of it
 * with those hidden states (n_valid, d_model) (n_valid 0: nothing kept, e.g. rejected), and
 * tokens[0, n_total) are known. */
struct drafter_feed {
    struct drafter_seq *seq;
    const int32_t *tokens;
    int n_total;
    int pos;
    int n_valid;
    const float *hidden;
    bool cache;   /* register the module's full blocks for prefix caching under key (the
                     target's cache key for this sequence) */
    uint64_t key;
};

/* MTP drafters: computes each fed sequence's module K/V from where it is up to the index
 * before its last hidden state, which it keeps (pend). A sequence whose module missed a
 * hidden state it needs is marked lost. -1 with the reason when a step failed (the fed
 * sequences' module K/V is then dropped: they are lost). */
int drafter_mtp_feed(struct drafter *d, struct drafter_feed *feeds, int n_feeds, char *err,
                     size_t errlen);
bool drafter_is_mtp(const struct drafter *d);

/* MTP prefix caching. Index i of the module's K/V is a function of the target's h_i (tokens
 * [0, i]) and token i + 1, so the module's blocks are cached over tokens + 1 under the target's
 * key mixed with token 0: the same prefix of the same request shape finds them. For a sequence
 * whose module holds nothing yet: takes the module's longest cached prefix of indices
 * [0, max_idx) (full blocks, then a cached tail) and returns the indices now valid (0 for
 * other drafters; -1 when out of memory). */
int drafter_mtp_take(struct drafter *d, struct drafter_seq *s, uint64_t key,
                     const int32_t *tokens, int max_idx);
/* Before drafter_seq_release of a sequence that ends or is preempted normally: keeps the
 * module's partly filled last block cached (kv_seq_keep_tail), as the target's is. */
void drafter_mtp_keep_tail(struct drafter *d, struct drafter_seq *s, uint64_t key,
                           const int32_t *tokens);

/* Whether jobs may draft by sampling (the distributions fit their bound). */
bool drafter_samples(const struct drafter *d);
void drafter_free(struct drafter *d);
struct engine *drafter_engine(struct drafter *d);

/* One sequence's part of a round. */
struct drafter_job {
    struct drafter_seq *seq;
    const int32_t *tokens; /* (n_total) the sequence's tokens so far */
    int n_total;
    int k;              /* drafts wanted, 1..max_k */
    float temperature;  /* > 0 with rng: sample the drafts from the draft's distribution at
                           this temperature; else its argmax */
    struct ms_rng *rng; /* the sequence's draft generator (sampled jobs), or NULL */
    int32_t *out;       /* OUT: (k) the drafts */
    int n_out;          /* OUT: drafts made (k, or 0 when the round failed) */
    const float *q;     /* OUT: sampled jobs: (k, q_n) the distribution each draft was drawn
                           from (valid until the next round), else NULL */
    int q_n;            /* OUT: ids covered by each q row (the rest have probability 0) */
};

/* Drafts for every job (each a different sequence). -1 with the reason when a draft step
 * failed: no job has drafts then (n_out 0) and their draft K/V is dropped (the next round
 * recomputes it; MTP: the sequences are lost). An MTP job drafts only when its sequence's
 * module is at n_total - 2 with that hidden state pending (else n_out 0). */
int drafter_run(struct drafter *d, struct drafter_job *jobs, int n_jobs, char *err, size_t errlen);

/* After verification: the sequence's first n_valid tokens are what the draft engine computed
 * (the accepted drafts among them); K/V past them is dropped. */
void drafter_seq_keep(struct drafter *d, struct drafter_seq *s, int n_valid);
/* Frees the sequence's draft blocks, table and pending hidden state (finish, cancel,
 * preemption). */
void drafter_seq_release(struct drafter *d, struct drafter_seq *s);

#endif
