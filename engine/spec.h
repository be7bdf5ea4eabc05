/* Speculative decoding: the configuration (vLLM's --speculative-config JSON), the n-gram prompt
 * lookup proposer, and the adaptive choice of how many tokens a sequence drafts.
 *
 * How the pieces fit (the scheduler, engine/scheduler.c, drives them): each step, a decoding
 * sequence may append up to k drafted tokens after its last token; the engine computes all of
 * them in the same batched step as every other sequence's decode tokens and prefill chunks
 * (n_logits = k + 1 rows), and the scheduler then samples each row in order with the request's
 * own sampler (penalties, logit_bias, min_tokens, the grammar, temperature, top-k/p, min-p) and
 * keeps the drafts up to the first one the sample disagrees with, by the standard rule: accept
 * draft x with probability min(1, p(x)/q(x)), else draw from max(0, p - q) normalised
 * (smp_sample_verify), q being the distribution x was drawn from. N-gram drafts and a draft
 * model's greedy drafts are deterministic, q a point mass, and the rule reduces to "draw from p;
 * accept iff the draw equals the draft": the draw at a rejected position is exactly a draw from
 * p without the draft token, renormalised. Output is therefore distributed exactly as without
 * speculation, greedy output is identical, and a seeded request draws the same uniforms in the
 * same order as without speculation, so its output does not depend on speculation, k or the
 * batch. A draft model may also draft by sampling (unseeded requests at temperature > 0), its q
 * kept for the verification: the same target distribution, more drafts accepted.
 *
 * Adaptive k: each sequence keeps decayed counts of accepted and rejected drafts (a geometric
 * model: each draft is accepted with probability a, given its predecessors were), and the
 * scheduler keeps a linear model of step time against step tokens, t(T) = t0 + t1 T, fitted
 * online. Adding a j-th draft to a sequence gains a^j expected tokens and costs t1 seconds for
 * the whole batch; with B sequences producing about B tokens in a step of time t, throughput
 * rises only while a^j > B t1 / t (a draft model's time per drafted token is added to t1). So an
 * idle server (t1 small next to t0: decode reads the
 * weights once whatever the token count) drafts deep, and a busy one, where every extra token
 * routes to more experts, drafts little or not at all.
 *
 * Ownership: plain values; nothing here allocates. */
#ifndef MOESERVE_SPEC_H
#define MOESERVE_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SPEC_MAX_K 8 /* num_speculative_tokens at most */

enum spec_method {
    SPEC_OFF = 0,
    SPEC_NGRAM,       /* prompt lookup over the sequence's own tokens */
    SPEC_DRAFT_MODEL, /* a small model of the same tokenizer (engine/drafter.h) */
    SPEC_MTP,         /* the checkpoint's multi-token-prediction layers (not built yet) */
};

struct spec_config {
    enum spec_method method;
    int k;                      /* num_speculative_tokens: drafts per step at most, 1..8 */
    int lookup_min, lookup_max; /* ngram: n-gram lengths tried, longest first */
    char model[4096];           /* draft_model: the model folder */
    char quantization[8];       /* draft_model: "int8" or "int4" quantizes the draft at load
                                   (a cheaper draft of the same weights), "" as the server */
    bool adaptive;              /* adapt k per sequence and step (moeserve's "adaptive", default
                                   true); false: always k drafts when the proposer has them */
};

/* Parses `json` (vLLM's spelling: method, num_speculative_tokens, prompt_lookup_min,
 * prompt_lookup_max, model, quantization; and moeserve's adaptive). method may be "ngram",
 * "draft_model" (implied by "model" alone) or "mtp" (also vLLM's deepseek_mtp, qwen3_next_mtp,
 * glm4_moe_mtp, mimo_mtp); ngram lengths default to 2..5 (one given: the other follows it). 0, or
 * -1 with a reason that starts with the offending field's name. Whether the model can do the method
 * is the caller's check (it knows the model). */
int spec_config_parse(const char *json, struct spec_config *out, char *err, size_t errlen);
const char *spec_method_name(enum spec_method m); /* "ngram", "draft_model", "mtp", "off" */

/* Prompt lookup: for n from max_n down to min_n, finds the latest earlier occurrence of the last
 * n tokens of tokens[0, len) and copies up to k tokens that followed it into out. Returns the
 * number proposed (0: no match). O(len * max_n); allocates nothing. */
int spec_ngram_propose(const int32_t *tokens, int len, int min_n, int max_n, int k, int32_t *out);

/* One sequence's acceptance record. */
struct spec_acc {
    float acc, rej; /* decayed counts of accepted drafts and of rejections */
    int idle;       /* steps since the sequence last drafted */
    int verified;   /* verifications seen (not decayed) */
};

void spec_acc_init(struct spec_acc *a);
/* A verification of `drafted` tokens kept `accepted` of them. */
void spec_acc_update(struct spec_acc *a, int drafted, int accepted);
/* The estimated probability that a draft is accepted given its predecessors were (a Beta(1,1)
 * prior over the decayed counts). */
double spec_acc_rate(const struct spec_acc *a);

/* Step time against step tokens, fitted by exponentially weighted least squares; and what a
 * drafted token costs to propose (a draft model's steps), averaged the same way. */
struct spec_cost {
    double w, sx, sy, sxx, sxy;
    double dw, ds; /* drafted tokens and the seconds their proposing took */
    double fw, fs; /* sequences fed to an MTP module and the seconds the feeds took */
};

void spec_cost_init(struct spec_cost *c);
void spec_cost_observe(struct spec_cost *c, int tokens, double seconds);
/* A drafting round (a draft model's steps) proposed `tokens` drafts in `seconds`. */
void spec_cost_observe_draft(struct spec_cost *c, int tokens, double seconds);
/* The acceptance probability a draft must exceed to pay for itself in a step of `n_seqs`
 * sequences and `n_tokens` tokens before drafts (see the top of this file), in [0, 1]: a
 * draft's marginal cost is its token's in the step (t1) plus its proposing (a draft model's
 * time per drafted token). Until steps of different sizes were seen, the marginal token costs
 * 1/32 of a step's fixed time. */
double spec_cost_threshold(const struct spec_cost *c, int n_seqs, int n_tokens);
/* A round of MTP feeds (the module's step over the target's new hidden states) took `seconds`
 * for `n_seqs` sequences. */
void spec_cost_observe_feed(struct spec_cost *c, int n_seqs, double seconds);
/* Whether a sequence with acceptance record `a` still gains from speculating when keeping its
 * drafter fed costs a per-step price whether it drafts or not (MTP's feed): the best k's
 * expected accepted tokens less what its drafts cost, sum over j <= k of (rate^j - threshold),
 * must exceed the feed's share of a step in the same units, feed seconds per sequence * n_seqs
 * / step seconds. True until 8 verifications were seen, and while no feed was measured. */
bool spec_feed_pays(const struct spec_config *cfg, const struct spec_cost *c,
                    const struct spec_acc *a, int n_seqs, int n_tokens);

/* Drafts for a sequence this step: cfg->k when not adaptive; else the largest j <= cfg->k with
 * rate^j > threshold, and 1 when that is 0 but the sequence has not drafted for 16 steps (so
 * that its rate is measured again). */
int spec_choose_k(const struct spec_config *cfg, const struct spec_acc *a, double threshold);

#endif
