/* Continuous experts (infmoe, after ∞-MoE; DESIGN.md): the FFN of every layer of an infmoe
 * model. Per token the router gives the mean and log-variance of a Gaussian over a latent z of
 * Z values; sample s is z_s = mu + exp(logvar / 2) * eps_s with eps_0 = 0 (the mean) and
 * eps_s (s >= 1) fixed quasi-random normal offsets (the R_d sequence through the normal
 * quantile, computed here in double precision exactly as tools/train/infmoe_model.py does);
 * sample s keeps the N neurons whose keys score highest against z_s / sqrt(Z), weighted by
 * the sigmoid of their score; the K slices are averaged. A neuron's activation does not depend
 * on the sample, so a token computes each neuron of the union of its K slices once (backend
 * op neuron_ffn), with the summed weights: fewer samples or a smaller fraction is less work.
 *
 * The adaptive budget ("by difficulty"): a token marked adaptive takes its samples as an
 * average k and its own K per layer from the router's uncertainty, u = the mean over the latent
 * of its predicted log-variance: r = the rank of u among the layer's calibration quantiles
 * (model_desc.cont_quant, measured on held-out text; piecewise linear in [0, 1]) and
 * K = clamp(1 + floor(2 (k - 1) r + 1/2), 1, max_samples), so over text like the calibration
 * text the mean K is k and the tokens the router is least sure of get the most samples.
 *
 * Where things run: the router and key products run on the backend; the sampling and the top-N
 * selection run on the host (small: K * F scores per token), like the MoE dispatch plan; the
 * gathered FFN runs on the backend. Results do not depend on the batch: every token's budget,
 * offsets and selection are its own.
 *
 * The selection of each token is independent, so it runs on the backend's host threads
 * (backend.h host_for), each with scratch of its own.
 *
 * Ownership: infmoe_scratch is per device, allocated once by infmoe_scratch_init for the
 * largest step and released by infmoe_scratch_release; infmoe_forward allocates nothing. */
#ifndef MOESERVE_INFMOE_H
#define MOESERVE_INFMOE_H

#include <stdint.h>

#include "backend.h"
#include "model.h"

struct infmoe_scratch {
    int max_tokens;
    int max_union; /* neurons a token may compute: model_cont_union_max at the bounds */
    /* backend memory */
    float *rz;      /* (T, 2Z) router output: mean, log-variance */
    float *z;       /* (T * max_samples, Z) scaled samples */
    float *scores;  /* (T * max_samples, F) key scores */
    int32_t *idx;   /* (T, max_union) neurons each token computes, ascending */
    float *coef;    /* (T, max_union) their summed weights */
    int32_t *count; /* (T) */
    float *hbuf;    /* (T, max_union) neuron_ffn scratch */
    int32_t *iscratch; /* host: NEURON_ISCRATCH(T, max_union, F), neuron_ffn's batch path */
    /* host (aliases of the above on a host-memory backend) */
    float *h_rz, *h_z, *h_scores, *h_coef;
    int32_t *h_idx, *h_count;
    float *eps;          /* (max_samples, Z) the offsets: row 0 zeros */
    float *keys_t;       /* host-memory backends: (n_layer, Z, F) the neuron keys transposed to
                            f32, for scores computed Z columns at a time (infmoe_scores) */
    /* per host worker (the selection runs token by token on the backend's host_for): */
    int workers;
    int32_t *sel_list;   /* (workers, 3F) a sample's kept neurons, the union so far, the next */
    float *sel_w;        /* (workers, 3F) their weights */
    uint32_t *work;      /* (workers, 2F) selection scratch: the scores as ordered keys, the
                            radix select's own */
    int32_t *row0;       /* (T) each token's first sample row */
    /* The per-token budget, set by the engine before infmoe_forward: */
    int32_t *tok_samples;        /* (T) K of each token, 1..max_samples */
    int32_t *tok_keep;           /* (T) N of each token, 1..model_cont_neurons(cont_fraction) */
    unsigned char *tok_adaptive; /* (T) nonzero: tok_samples[t] is an average (needs a model
                                    with a calibration) */
    int32_t *k_used;             /* (T) the samples each token took in the last layer */
};

/* One sample's slice: the `keep` highest of the F scores sc (ties at the threshold go to the
 * lower index) into list, ascending, with their sigmoid weights in w; returns how many
 * (min(keep, F)). work: 2F. Exact: a sampled pivot only narrows where the threshold is sought. */
int infmoe_select(const float *sc, int F, int keep, int32_t *list, float *w, uint32_t *work);

/* y (rows, F) = z (rows, Z) . keys_t (Z, F), keys_t the neuron keys transposed (the host path
 * of the key scores; exposed for tests). */
void infmoe_scores(float *restrict y, const float *restrict z, const float *restrict keys_t,
                   int rows, int Z, int F);

/* The adaptive budget's K for a token whose mean predicted log-variance is u, against one
 * layer's nq ascending calibration quantiles q, at average k (see above). */
int infmoe_adaptive_k(const double *q, int nq, double u, int k, int k_max);

/* The offsets eps (k, Z) of the samples, row 0 zeros (tools/train/infmoe_model.py's
 * quasi_offsets): exposed for tests. */
void infmoe_offsets(int k, int z, float *eps);

int infmoe_scratch_init(struct infmoe_scratch *s, struct backend *be, const struct model *m,
                        int max_tokens);
void infmoe_scratch_release(struct infmoe_scratch *s, struct backend *be);

/* out (n, d_model) = the continuous-experts FFN of layer `layer` over h (n, d_model) normed
 * hidden states, token t with s->tok_samples[t] samples keeping s->tok_keep[t] neurons each.
 * m: the weights as `be` holds them. Returns the neurons computed (summed over tokens). */
uint64_t infmoe_forward(const struct model *m, int layer, struct backend *be,
                        struct infmoe_scratch *s, const float *h, int n, float *out);

#endif
