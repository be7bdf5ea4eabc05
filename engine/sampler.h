/* Sampler: turns one row of logits into the next token for one sequence, with the OpenAI/vLLM
 * knobs: greedy, temperature, top-k, top-p, min-p, presence/frequency/repetition penalties, a
 * per-sequence seed, and log-probabilities of the chosen token and the top-N alternatives.
 *
 * Ownership: smp_create allocates the per-sequence scratch (vocab-sized) once; smp_sample never
 * allocates. smp_free releases it. A sampler is owned by one sequence and not shared. */
#ifndef MOESERVE_SAMPLER_H
#define MOESERVE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#define SMP_MAX_LOGPROBS 20

/* A bias added to one token's logit (OpenAI logit_bias). -100 bans the token; +100 forces it:
 * only tokens biased +100 stay possible. */
struct smp_bias {
    int32_t id;
    float bias;
};

struct smp_params {
    float temperature;        /* 0 = greedy */
    float top_p;              /* 1 = off */
    int top_k;                /* 0 or <0 = off */
    float min_p;              /* 0 = off */
    float presence_penalty;   /* OpenAI semantics, on generated tokens */
    float frequency_penalty;  /* OpenAI semantics, on generated tokens */
    float repetition_penalty; /* 1 = off; HF/vLLM semantics, on prompt and generated tokens */
    uint64_t seed;
    bool has_seed;            /* without a seed, the sampler seeds itself from the clock */
    int n_logprobs;           /* top alternatives to report, 0..SMP_MAX_LOGPROBS */
    const struct smp_bias *bias; /* (n_bias) logit biases, applied first; copied by smp_create */
    int n_bias;
    const int32_t *allowed;   /* (n_allowed) vLLM allowed_token_ids, or NULL: all; copied */
    int n_allowed;
};

void smp_params_default(struct smp_params *p);

struct smp_logprobs {
    int32_t token;   /* the chosen token */
    float logprob;   /* its log-probability under the model's distribution (raw logits, after
                        logit_bias, allowed_token_ids and penalties, before temperature/top-k/
                        top-p filtering) */
    int32_t rank;    /* 1 + tokens with a larger logit (smp_row_logprobs only; 0 = not set) */
    int n_top;
    int32_t top_token[SMP_MAX_LOGPROBS];
    float top_logprob[SMP_MAX_LOGPROBS];
};

struct sampler;

/* Returns NULL on allocation failure or vocab <= 0. Ids in bias/allowed outside [0, vocab)
 * are ignored (the server refuses them first). */
struct sampler *smp_create(int vocab, const struct smp_params *p);
void smp_free(struct sampler *s);
/* Records a prompt token (repetition penalty) or generated token (all penalties). */
void smp_accept(struct sampler *s, int32_t token, bool generated);
/* Picks the next token from `logits` (vocab floats, modified in place). Fills `lp` if non-NULL. */
int32_t smp_sample(struct sampler *s, float *logits, struct smp_logprobs *lp);

/* Speculative verification of a draft x drawn from the distribution q (n_q probabilities, ids
 * at or past n_q having none; NULL: x was chosen deterministically, q a point mass). p is the
 * distribution smp_sample would draw from (every knob applied); x is accepted with probability
 * min(1, p(x)/q(x)), else the token is drawn from max(0, p - q) normalised, so it is
 * distributed exactly as p. With q NULL that is a draw from p accepted iff it equals x, using
 * the same random numbers as smp_sample. Returns the token (== draft iff *accepted); lp as
 * smp_sample. */
int32_t smp_sample_verify(struct sampler *s, float *logits, int32_t draft, const float *q,
                          int n_q, bool *accepted, struct smp_logprobs *lp);

/* The log-probability of `token` under the raw distribution softmax(logits) (no penalties, no
 * temperature: what prompt logprobs report), its rank and the n_top most likely tokens. Reads
 * logits only; allocates nothing. */
void smp_row_logprobs(const float *logits, int vocab, int32_t token, int n_top,
                      struct smp_logprobs *lp);

#endif
