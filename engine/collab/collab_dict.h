/* Nonnegative sparse dictionary learning over cross-layer activation rows (prefix cdict_): finds
 * K atoms, each a nonnegative unit-norm vector over the (layer, expert) features, such that
 * every token's row x is close to a sparse nonnegative combination of them:
 *
 *     min over D >= 0 (rows unit norm at most), a_t >= 0:
 *         sum_t 1/2 ||x_t - D^T a_t||^2 + lambda ||a_t||_1
 *
 * An atom is a collaborative group: (layer, expert) pairs that tokens choose together across the
 * layers. Learning is online mini-batch dictionary learning (Mairal et al., 2009): the codes of a
 * mini-batch by coordinate descent on the nonnegative lasso (exact per coordinate, over the
 * atoms' Gram matrix, so a row costs O(nnz K + sweeps K^2)); then block-coordinate descent on
 * the atoms from the running sufficient statistics A = sum a a^T and B = sum a x^T (a forgetting
 * factor makes them a window of about one pass), each atom projected onto the nonnegative
 * orthant and the unit ball. An atom no token uses is restarted from a row of the batch. Every
 * random choice (initial atoms, row order, restarts) comes from `seed`: the same data and
 * parameters give the same dictionary bit for bit.
 *
 * Ownership: cdict_learn allocates the dictionary (cdict_free); encode and the error functions
 * write only into caller buffers. Nothing keeps a pointer to the data. */
#ifndef MOESERVE_COLLAB_DICT_H
#define MOESERVE_COLLAB_DICT_H

#include <stddef.h>
#include <stdint.h>

struct cdata;

struct cdict_params {
    int n_atoms;   /* K */
    double lambda; /* L1 weight on the codes (rows have unit norm; 0.05..0.3 is sensible) */
    int epochs;    /* passes over the rows */
    int batch;     /* rows per mini-batch */
    uint64_t seed;
};

void cdict_params_default(struct cdict_params *p);

struct cdict {
    int n_atoms, n_feat;
    double lambda;
    float *atom;  /* (n_atoms, n_feat) nonnegative, L2 norm <= 1 */
    double *gram; /* (n_atoms, n_atoms) atom . atom */
};

/* -1 with a reason for bad parameters (K < 1, more atoms than rows, lambda < 0, ...) or OOM. */
int cdict_learn(const struct cdata *x, const struct cdict_params *p, struct cdict **out, char *err,
                size_t errlen);
void cdict_free(struct cdict *d);

/* Codes of row r (nonnegative lasso, coordinate descent to convergence). code, work: (K). */
void cdict_encode(const struct cdict *d, const struct cdata *x, size_t r, float *code,
                  double *work);
/* Codes of every row into codes (n_row, K) (may be NULL) and the relative reconstruction
 * error sum ||x - D^T a||^2 / sum ||x||^2. -1.0 when out of memory. */
double cdict_encode_all(const struct cdict *d, const struct cdata *x, float *codes);

/* Hierarchy: merges the atoms of a fine dictionary into n_coarse groups by average-linkage
 * agglomerative clustering on the atoms' cosine similarity (atoms that split one group share
 * their (layer, expert) pairs), ties broken by the lower index: parent (fine n_atoms) gets each
 * fine atom's coarse group, numbered by the lowest fine atom in it. Then *coarse is a
 * dictionary whose atoms are the sums of their fine atoms, scaled to unit norm, with the fine
 * dictionary's lambda. -1 with a reason when n_coarse is not in [1, fine atoms] or on OOM. */
int cdict_merge(const struct cdict *fine, int n_coarse, int *parent, struct cdict **coarse,
                char *err, size_t errlen);

/* Each feature's group: the atom with the largest entry, -1 when every atom is 0 there. */
void cdict_assign(const struct cdict *d, int *group /* OUT: (n_feat) */);

/* Adjusted Rand index of two labelings of n items (labels any ints; -1 is a label like any
 * other). 1 for identical partitions, about 0 for independent ones. */
double cdict_ari(const int *a, const int *b, int n);

#endif
