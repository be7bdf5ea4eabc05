/* Sampler: picks the next token of one sequence from a row of logits. The steps follow the
 * order users compare against (vLLM / Hugging Face): penalties on the raw logits, log-probs of
 * that penalized distribution, then either greedy argmax or temperature → top-k → top-p →
 * min-p and a draw from the sequence's own xoshiro256** generator. Everything vocab-sized is
 * allocated once in smp_create (one block), so smp_sample never allocates. It scans the vocab a
 * small constant number of times and never sorts it: top-k is a quickselect, top-p a "weighted
 * quickselect" that finds the shortest most-probable prefix holding the wanted mass in linear
 * expected time, and penalties only visit the distinct tokens seen so far. Ties between equal
 * probabilities are broken by the lower token id everywhere, so results are reproducible. */
#include "sampler.h"
#include "rng.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A token still in the running and its unnormalized probability exp((logit - max) / T). */
struct smp_cand {
    float w;
    int32_t id;
};

struct sampler {
    int vocab;
    struct smp_params p;  /* sanitized copy of the creation parameters */
    struct ms_rng rng;    /* xoshiro256** state */
    int32_t *count;       /* (vocab) times each token was generated */
    uint8_t *prompt_seen; /* (vocab / 8 rounded up) bit per token seen in the prompt */
    int32_t *seen;        /* (vocab) distinct ids seen in prompt or output, first n_seen valid */
    int n_seen;
    struct smp_cand *cand; /* (vocab) scratch: tokens still in the running */
    double *block;         /* (vocab / 64 + 1) scratch: mass of each run of 64 tokens */
    struct smp_bias *bias; /* (n_bias) the finite biases to add */
    int n_bias;
    uint8_t *keep;         /* (vocab / 8 rounded up) tokens logit_bias/allowed leave possible,
                              or NULL: all */
};

void smp_params_default(struct smp_params *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->top_k = 0;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
}

/* ---- random numbers: engine/rng.h; a clock seed when the request has none ------------- */

/* A seed for samplers created without one: wall clock, monotonic clock, a process-wide counter
 * (two samplers created in the same nanosecond still differ) and the sampler's address. */
static uint64_t clock_seed(const void *self)
{
    static atomic_uint_fast64_t counter;
    struct timespec rt, mono;
    clock_gettime(CLOCK_REALTIME, &rt);
    clock_gettime(CLOCK_MONOTONIC, &mono);
    uint64_t x = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
    x ^= ms_rotl64((uint64_t)mono.tv_nsec + (uint64_t)mono.tv_sec * 1000000000ull, 29);
    x ^= ms_rotl64(atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull, 17);
    x ^= (uint64_t)(uintptr_t)self;
    return ms_splitmix64(&x);
}

/* ---- lifetime --------------------------------------------------------------------------- */

/* Turns logit_bias and allowed_token_ids into a keep bitmap (bans, forcing, the allowed set)
 * and a list of the finite biases, so a step pays one pass over the bitmap at most. */
static int set_bias(struct sampler *s, const struct smp_params *p)
{
    if (!p || (p->n_bias <= 0 && p->n_allowed <= 0)) return 0;
    size_t nb = ((size_t)s->vocab + 7) / 8;
    bool forced = false;
    for (int i = 0; i < p->n_bias; i++) forced |= p->bias[i].bias >= 100.0f;
    bool masked = forced || p->n_allowed > 0;
    for (int i = 0; i < p->n_bias; i++) masked |= p->bias[i].bias <= -100.0f;
    s->bias = malloc(sizeof *s->bias * (size_t)(p->n_bias > 0 ? p->n_bias : 1));
    s->keep = masked ? malloc(nb) : NULL;
    if (!s->bias || (masked && !s->keep)) return -1;
    if (s->keep) {
        /* start from the allowed set (all without one), then forcing, then bans */
        memset(s->keep, p->n_allowed > 0 ? 0x00 : 0xff, nb);
        for (int i = 0; i < p->n_allowed; i++)
            if (p->allowed[i] >= 0 && p->allowed[i] < s->vocab)
                s->keep[p->allowed[i] >> 3] |= (uint8_t)(1u << (p->allowed[i] & 7));
        if (forced) {
            uint8_t *f = calloc(1, nb);
            if (!f) return -1;
            for (int i = 0; i < p->n_bias; i++) {
                int32_t t = p->bias[i].id;
                if (p->bias[i].bias >= 100.0f && t >= 0 && t < s->vocab)
                    f[t >> 3] |= (uint8_t)(1u << (t & 7));
            }
            for (size_t i = 0; i < nb; i++) s->keep[i] &= f[i];
            free(f);
        }
        for (int i = 0; i < p->n_bias; i++) {
            int32_t t = p->bias[i].id;
            if (p->bias[i].bias <= -100.0f && t >= 0 && t < s->vocab)
                s->keep[t >> 3] &= (uint8_t)~(1u << (t & 7));
        }
    }
    /* Every allowed token banned: keep the row as it is rather than leave nothing. */
    bool any = false;
    for (size_t i = 0; s->keep && i < nb && !any; i++) any = s->keep[i] != 0;
    if (s->keep && !any) {
        free(s->keep);
        s->keep = NULL;
    }
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias[i].id >= 0 && p->bias[i].id < s->vocab && fabsf(p->bias[i].bias) < 100.0f)
            s->bias[s->n_bias++] = p->bias[i];
    return 0;
}

/* Adds the biases and removes what they and allowed_token_ids leave impossible. */
static void apply_bias(const struct sampler *s, float *logits)
{
    for (int i = 0; i < s->n_bias; i++) logits[s->bias[i].id] += s->bias[i].bias;
    if (!s->keep) return;
    for (int i = 0; i < s->vocab; i++)
        if (!((s->keep[i >> 3] >> (i & 7)) & 1)) logits[i] = -INFINITY;
}

struct sampler *smp_create(int vocab, const struct smp_params *p)
{
    if (vocab <= 0) return NULL;
    struct sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    size_t n = (size_t)vocab;
    /* One block: block sums (doubles) | cand (8-byte items) | count | seen (4-byte items) | the
     * prompt bitmap. */
    size_t nb = n / 64 + 1;
    unsigned char *block = calloc(1, nb * sizeof(double) + n * sizeof(struct smp_cand) +
                                         2 * n * sizeof(int32_t) + (n + 7) / 8);
    if (!block) {
        free(s);
        return NULL;
    }
    s->vocab = vocab;
    s->block = (double *)block;
    s->cand = (struct smp_cand *)(s->block + nb);
    s->count = (int32_t *)(s->cand + n);
    s->seen = s->count + n;
    s->prompt_seen = (uint8_t *)(s->seen + n);

    if (p) {
        s->p = *p;
    } else {
        smp_params_default(&s->p);
    }
    /* Out-of-range knobs mean "off" rather than undefined arithmetic; the HTTP layer is where
     * bad requests are rejected with a message. */
    if (!(s->p.repetition_penalty > 0.0f) || !isfinite(s->p.repetition_penalty))
        s->p.repetition_penalty = 1.0f;
    if (!isfinite(s->p.presence_penalty)) s->p.presence_penalty = 0.0f;
    if (!isfinite(s->p.frequency_penalty)) s->p.frequency_penalty = 0.0f;
    if (s->p.n_logprobs < 0) s->p.n_logprobs = 0;
    if (s->p.n_logprobs > SMP_MAX_LOGPROBS) s->p.n_logprobs = SMP_MAX_LOGPROBS;

    if (set_bias(s, p) != 0) {
        smp_free(s);
        return NULL;
    }
    s->p.bias = NULL; /* the caller's arrays are not kept */
    s->p.allowed = NULL;
    ms_rng_seed(&s->rng, s->p.has_seed ? s->p.seed : clock_seed(s));
    return s;
}

void smp_free(struct sampler *s)
{
    if (!s) return;
    free(s->bias);
    free(s->keep);
    free(s->block); /* the start of the one block */
    free(s);
}

void smp_accept(struct sampler *s, int32_t token, bool generated)
{
    if (!s || token < 0 || token >= s->vocab) return;
    uint8_t bit = (uint8_t)(1u << (token & 7));
    bool known = s->count[token] > 0 || (s->prompt_seen[token >> 3] & bit);
    if (!known) s->seen[s->n_seen++] = token;
    if (generated) {
        if (s->count[token] < INT32_MAX) s->count[token]++;
    } else {
        s->prompt_seen[token >> 3] |= bit;
    }
}

/* ---- penalties and log-probs ------------------------------------------------------------ */

/* Visits only the distinct seen tokens. Order as vLLM: repetition, then frequency, presence. */
static void apply_penalties(const struct sampler *s, float *logits)
{
    const float rp = s->p.repetition_penalty;
    const float fp = s->p.frequency_penalty, pp = s->p.presence_penalty;
    if (rp == 1.0f && fp == 0.0f && pp == 0.0f) return;
    for (int j = 0; j < s->n_seen; j++) {
        int32_t t = s->seen[j];
        float x = logits[t];
        if (rp != 1.0f) x = x > 0.0f ? x / rp : x * rp;
        int32_t c = s->count[t];
        if (c > 0) {
            x -= fp * (float)c;
            x -= pp;
        }
        logits[t] = x;
    }
}

/* Writes the top n_top (id, logprob) pairs of the penalized logits into lp, sorted by logit
 * descending with ties to the lower id. A small insertion list: most entries fail the first
 * comparison against the current n-th best, so this is one cheap pass over the vocab. */
static void top_logprobs(const float *x, int vocab, int n_top, double log_z, float max,
                         struct smp_logprobs *lp)
{
    int n = 0;
    lp->n_top = 0;
    if (n_top <= 0) return;
    for (int i = 0; i < vocab; i++) {
        float v = x[i];
        if (n == n_top && !(v > x[lp->top_token[n - 1]])) continue;
        int pos = n < n_top ? n++ : n - 1;
        /* Strictly greater moves up: an equal earlier (lower) id stays ahead. */
        while (pos > 0 && v > x[lp->top_token[pos - 1]]) {
            lp->top_token[pos] = lp->top_token[pos - 1];
            pos--;
        }
        lp->top_token[pos] = i;
    }
    lp->n_top = n;
    for (int j = 0; j < n; j++)
        lp->top_logprob[j] = (float)((double)x[lp->top_token[j]] - (double)max - log_z);
}

/* ---- exp over a row --------------------------------------------------------------------- */

/* Four floats at a time with GCC/Clang vector extensions (SSE2/NEON width): this is the one
 * vocab-sized transcendental pass per token, and libm's scalar expf is ~3x slower. */
typedef float smp_v4f __attribute__((vector_size(16)));
typedef int32_t smp_v4i __attribute__((vector_size(16)));

/* exp(x) for x <= 0 (or -inf), relative error < 3e-7; exactly 0 below -87 so that -inf logits
 * (and tokens ~1e-38 times less likely than the top one) carry no mass. Range reduction
 * x = n ln2 + r with |r| <= ln2/2, degree-6 Taylor for e^r, 2^n built in the exponent bits. */
static inline smp_v4f exp4_nonpos(smp_v4f x)
{
    const smp_v4f floor_v = {-87.0f, -87.0f, -87.0f, -87.0f};
    smp_v4i live = x >= floor_v; /* all ones where x >= -87 */
    smp_v4i xb, fb;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&fb, &floor_v, sizeof fb);
    xb = (xb & live) | (fb & ~live);
    memcpy(&x, &xb, sizeof x);
    /* n = round(x / ln2): x <= 0, so truncating (x / ln2 - 0.5) toward zero rounds. */
    smp_v4i n = __builtin_convertvector(x * 1.44269504f - 0.5f, smp_v4i);
    smp_v4f nf = __builtin_convertvector(n, smp_v4f);
    smp_v4f r = x - nf * 0.693145751953125f; /* ln2 in two parts: this product is exact */
    r = r - nf * 1.428606765330187e-06f;
    /* e^r by Horner on the degree-6 Taylor series: 1 + r + r^2/2! + ... + r^6/6! */
    smp_v4f e = 1.0f / 120 + r * (1.0f / 720);
    e = 1.0f / 24 + r * e;
    e = 1.0f / 6 + r * e;
    e = 0.5f + r * e;
    e = 1.0f + r * e;
    e = 1.0f + r * e;
    smp_v4i scale = (n + 127) << 23; /* 2^n, n in [-126, 0] */
    smp_v4f sf;
    memcpy(&sf, &scale, sizeof sf);
    e *= sf;
    smp_v4i eb;
    memcpy(&eb, &e, sizeof eb);
    eb &= live;
    memcpy(&e, &eb, sizeof e);
    return e;
}

/* Returns sum_i exp((x[i] - max) * inv_t) over x[0, n) (every x[i] <= max, none NaN), and if
 * out is non-NULL stores each term with its id in out[i]; if blocks is non-NULL, the mass of
 * each run of 64 terms in blocks[i / 64]. */
static double exp_shifted(const float *x, int n, float max, float inv_t, struct smp_cand *out,
                          double *blocks)
{
    double mass = 0.0;
    smp_v4f acc = {0, 0, 0, 0};
    for (int i = 0; i < n; i += 4) {
        smp_v4f v = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}; /* pads the last group */
        if (i + 4 <= n) {
            memcpy(&v, x + i, sizeof v);
        } else {
            for (int j = 0; i + j < n; j++)
                v[j] = x[i + j];
        }
        smp_v4f w = exp4_nonpos((v - max) * inv_t);
        if (out) {
            for (int j = 0; j < 4 && i + j < n; j++) {
                out[i + j].w = w[j];
                out[i + j].id = i + j;
            }
        }
        acc += w;
        if ((i & 63) == 60 || i + 4 >= n) { /* float partial sums of 64 terms, then double */
            double b = (double)acc[0] + (double)acc[1] + (double)acc[2] + (double)acc[3];
            if (blocks) blocks[i / 64] = b;
            mass += b;
            acc = (smp_v4f){0, 0, 0, 0};
        }
    }
    return mass;
}

/* Plain temperature sampling (no top-k, top-p or min-p): the draw walks the 64-token block
 * masses to the block holding it, then that block's terms, so no vocab-sized candidate list is
 * written or scanned. */
static int32_t draw_plain(struct sampler *s, const float *logits, float max, float inv_t,
                          double *log_z1)
{
    const int vocab = s->vocab, nb = (vocab + 63) / 64;
    double mass = exp_shifted(logits, vocab, max, inv_t, NULL, s->block);
    *log_z1 = inv_t == 1.0f ? log(mass) : NAN;
    double u = ms_rng_uniform(&s->rng) * mass, acc = 0.0;
    int b = 0;
    while (b < nb - 1 && u >= acc + s->block[b]) acc += s->block[b++];
    /* the block's terms, as exp_shifted computed them */
    int i0 = b * 64, i1 = i0 + 64 < vocab ? i0 + 64 : vocab;
    int32_t last = -1;
    for (int i = i0; i < i1; i += 4) {
        smp_v4f v = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (int j = 0; j < 4 && i + j < i1; j++) v[j] = logits[i + j];
        smp_v4f w = exp4_nonpos((v - max) * inv_t);
        for (int j = 0; j < 4 && i + j < i1; j++) {
            if (w[j] <= 0.0f) continue;
            acc += w[j];
            last = i + j;
            if (u < acc) return last;
        }
    }
    /* rounding left u past the block's end: its last possible token (the block holds mass, so
     * there is one; else the first possible token overall) */
    if (last >= 0) return last;
    for (int i = 0; i < vocab; i++)
        if (logits[i] == max) return i;
    return 0;
}

/* Sum of c[lo, hi).w in double, four independent chains. */
static double mass_of(const struct smp_cand *c, int lo, int hi)
{
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    int i = lo;
    for (; i + 4 <= hi; i += 4) {
        a0 += c[i].w;
        a1 += c[i + 1].w;
        a2 += c[i + 2].w;
        a3 += c[i + 3].w;
    }
    for (; i < hi; i++)
        a0 += c[i].w;
    return (a0 + a1) + (a2 + a3);
}

/* ---- selection over candidates, ordered by w descending then id ascending -------------- */

static inline bool before(struct smp_cand a, struct smp_cand b)
{
    /* Bitwise, not short-circuit: no branch for the compiler to mispredict in partition. */
    return (a.w > b.w) | ((a.w == b.w) & (a.id < b.id));
}

static inline void swap_cand(struct smp_cand *c, int i, int j)
{
    struct smp_cand t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* Partitions c[lo, hi) around a median-of-three pivot; returns the pivot's final position p:
 * everything in [lo, p) comes before it, everything in (p, hi) after. */
static int partition(struct smp_cand *c, int lo, int hi)
{
    int mid = lo + (hi - lo) / 2, last = hi - 1;
    if (before(c[mid], c[lo])) swap_cand(c, mid, lo);
    if (before(c[last], c[lo])) swap_cand(c, last, lo);
    if (before(c[mid], c[last])) swap_cand(c, mid, last); /* median now at last */
    const struct smp_cand pivot = c[last];
    int store = lo;
    for (int i = lo; i < last; i++) {
        /* Lomuto without a branch: always swap, advance the boundary only for "before"
         * (swapping an "after" element with the first "after" element changes nothing). */
        struct smp_cand x = c[i];
        int b = before(x, pivot);
        c[i] = c[store];
        c[store] = x;
        store += b;
    }
    swap_cand(c, store, last);
    return store;
}

static void sift_down(struct smp_cand *c, int root, int n)
{
    for (;;) {
        int child = 2 * root + 1;
        if (child >= n) return;
        /* Max-heap on "after": the element that sorts last rises to the root. */
        if (child + 1 < n && before(c[child], c[child + 1])) child++;
        if (!before(c[root], c[child])) return;
        swap_cand(c, root, child);
        root = child;
    }
}

/* Sorts c[0, n) in candidate order; O(n log n) worst case, used when quickselect degenerates. */
static void heap_sort(struct smp_cand *c, int n)
{
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_down(c, i, n);
    for (int end = n - 1; end > 0; end--) {
        swap_cand(c, 0, end);
        sift_down(c, 0, end);
    }
}

/* Rounds of partitioning before giving up on quickselect and sorting what is left. */
static int round_limit(int n)
{
    int r = 8;
    while (n > 1) {
        n >>= 1;
        r += 2;
    }
    return r;
}

/* Puts the first k candidates (in candidate order) in c[0, k), unordered. */
static void select_top_k(struct smp_cand *c, int n, int k)
{
    int lo = 0, hi = n, rounds = round_limit(n);
    while (hi - lo > 1) {
        if (rounds-- == 0) {
            heap_sort(c + lo, hi - lo);
            return;
        }
        int p = partition(c, lo, hi);
        if (p == k || p + 1 == k) return;
        if (p > k) {
            hi = p;
        } else {
            lo = p + 1;
        }
    }
}

/* Returns the length L of the shortest prefix of c[0, n) in candidate order whose mass reaches
 * `need` (> 0), and leaves that prefix (unordered) in c[0, L). Always at least 1; n when the
 * whole array holds less than `need`. */
static int select_top_p(struct smp_cand *c, int n, double need)
{
    int lo = 0, hi = n, rounds = round_limit(n);
    double range = mass_of(c, 0, n);
    /* Invariant: c[0, lo) precede c[lo, hi), which precede c[hi, n); mass(c[0, lo)) < the
     * original need, `need` is what is still missing, `range` is mass(c[lo, hi)), and the
     * answer lies in (lo, hi]. */
    while (hi - lo > 1) {
        if (rounds-- == 0) {
            heap_sort(c + lo, hi - lo);
            double acc = 0.0;
            for (int i = lo; i < hi; i++) {
                acc += c[i].w;
                if (acc >= need) return i + 1;
            }
            return hi;
        }
        int p = partition(c, lo, hi);
        double wp = c[p].w;
        /* Sum the smaller side; the other follows from the range's mass. */
        double above = p - lo <= hi - p ? mass_of(c, lo, p) : range - wp - mass_of(c, p + 1, hi);
        if (above >= need) {
            hi = p; /* p > lo: need > 0, so above > 0 */
            range = above;
        } else if (above + wp >= need) {
            return p + 1;
        } else {
            need -= above + wp;
            range -= above + wp;
            lo = p + 1;
        }
    }
    return hi;
}

/* The tokens temperature, top-k, top-p and min-p leave, with their unnormalized probabilities,
 * in s->cand[0, n) (unordered); returns n >= 1 with their sum in *total. Logits are finite or
 * -inf, max > -inf. Sets *log_z1 to log(sum exp(x - max)) when temperature is 1 (it is free
 * then), else NAN. */
static int candidates(struct sampler *s, const float *logits, float max, double *total,
                      double *log_z1)
{
    const int vocab = s->vocab;
    const float temp = s->p.temperature, top_p = s->p.top_p, min_p = s->p.min_p;
    const float inv_t = 1.0f / temp;
    struct smp_cand *c = s->cand;
    int k = s->p.top_k;
    if (top_p <= 0.0f) k = 1; /* "nucleus of nothing": only the top token */
    const bool top_k_on = k > 0 && k < vocab;
    const bool top_p_on = top_p > 0.0f && top_p < 1.0f;
    double mass = exp_shifted(logits, vocab, max, inv_t, c, NULL);
    *log_z1 = temp == 1.0f ? log(mass) : NAN;
    /* Keep w > 0 (the top token has w == 1). Without top-k two exact cuts come first, so the
     * selections below see few candidates on peaked distributions: min-p (w >= min_p, as the
     * top's w is 1), and the top-p tail: all tokens under t = (1 - top_p) * mass / vocab hold
     * at most (1 - top_p) * mass together, so the prefix before the first of them already
     * reaches top_p * mass and the nucleus ends before it (halved t: margin for rounding). */
    float cut = 0.0f;
    if (!top_k_on) {
        if (min_p > 0.0f) cut = min_p < 1.0f ? min_p : 1.0f;
        if (top_p_on) {
            float tail = (float)(0.5 * (1.0 - (double)top_p) * mass / vocab);
            if (tail > cut) cut = tail;
        }
    }
    int n = 0;
    for (int i = 0; i < vocab; i++) {
        c[n] = c[i];
        n += (c[i].w > 0.0f) & (c[i].w >= cut);
    }
    if (top_k_on && k < n) {
        select_top_k(c, n, k);
        n = k;
    }
    if (top_k_on) {
        mass = 0.0; /* top-p works on the renormalized top-k distribution */
        for (int j = 0; j < n; j++)
            mass += c[j].w;
    }
    /* With top-k off `mass` stays the full mass, even if candidates were cut above. */
    if (n > 1 && top_p_on) n = select_top_p(c, n, (double)top_p * mass);
    if (min_p > 0.0f && n > 1) {
        /* Renormalizing after top-k/top-p keeps ratios to the top, so this is still w >= min_p */
        float thresh = min_p < 1.0f ? min_p : 1.0f;
        int kept = 0;
        for (int j = 0; j < n; j++)
            if (c[j].w >= thresh) c[kept++] = c[j];
        n = kept; /* >= 1: the top token has w == 1 >= thresh */
    }
    double sum = 0.0;
    for (int j = 0; j < n; j++)
        sum += c[j].w;
    *total = sum;
    return n;
}

/* Temperature, top-k, top-p, min-p and the draw; logits are finite or -inf, max > -inf.
 * Sets *log_z1 as candidates does. */
static int32_t draw(struct sampler *s, const float *logits, float max, double *log_z1)
{
    const float top_p = s->p.top_p, min_p = s->p.min_p;
    int k = s->p.top_k;
    if (top_p <= 0.0f) k = 1;
    const bool top_k_on = k > 0 && k < s->vocab;
    const bool top_p_on = top_p > 0.0f && top_p < 1.0f;
    if (!top_k_on && !top_p_on && !(min_p > 0.0f))
        return draw_plain(s, logits, max, 1.0f / s->p.temperature, log_z1);
    double total;
    int n = candidates(s, logits, max, &total, log_z1);
    const struct smp_cand *c = s->cand;
    double u = ms_rng_uniform(&s->rng) * total, acc = 0.0;
    for (int j = 0; j < n; j++) {
        acc += c[j].w;
        if (u < acc) return c[j].id;
    }
    return c[n - 1].id; /* rounding left u past the end */
}

/* ---- the step --------------------------------------------------------------------------- */

/* Max of a row, four lanes at a time; NaN becomes -inf and +inf the largest float first (in
 * the rare rows that hold any). */
static float row_max_clean(float *x, int n)
{
    smp_v4f mx = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    smp_v4i bad = {0, 0, 0, 0};
    const smp_v4f inf = {INFINITY, INFINITY, INFINITY, INFINITY};
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        smp_v4f v;
        memcpy(&v, x + i, sizeof v);
        bad |= (v != v) | (v == inf);
        for (int j = 0; j < 4; j++) mx[j] = v[j] > mx[j] ? v[j] : mx[j];
    }
    float m = -INFINITY;
    for (int j = 0; j < 4; j++) m = mx[j] > m ? mx[j] : m;
    bool any = bad[0] | bad[1] | bad[2] | bad[3];
    for (; i < n; i++) {
        any |= isnan(x[i]) || x[i] == INFINITY;
        m = x[i] > m ? x[i] : m;
    }
    if (!any) return m;
    m = -INFINITY;
    for (i = 0; i < n; i++) {
        if (isnan(x[i]))
            x[i] = -INFINITY;
        else if (x[i] == INFINITY)
            x[i] = FLT_MAX;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}


/* logit_bias, then the penalties; returns the row's max (NaN made -inf and +inf the largest
 * float first) with its first (lowest) id in *arg. */
static float prepare(struct sampler *s, float *logits, int32_t *arg)
{
    const int vocab = s->vocab;
    apply_bias(s, logits);
    apply_penalties(s, logits);
    /* NaN is "impossible" (-inf), +inf "certain" (largest float), so the arithmetic below stays
     * finite. One vector pass finds the max and whether any NaN or +inf needs that; the greedy
     * argmax (first, i.e. lowest id, of the max) is found after. */
    float max = row_max_clean(logits, vocab);
    int32_t a = 0;
    while (a < vocab - 1 && logits[a] != max) a++;
    *arg = a;
    return max;
}

/* Nothing is possible: token 0, reported as under the uniform distribution (the limit of equal
 * logits) so the numbers stay finite for JSON. */
static int32_t nothing_possible(const struct sampler *s, struct smp_logprobs *lp)
{
    const int vocab = s->vocab;
    if (lp) {
        float u = (float)-log((double)vocab);
        lp->token = 0;
        lp->logprob = u;
        lp->n_top = s->p.n_logprobs < vocab ? s->p.n_logprobs : vocab;
        for (int j = 0; j < lp->n_top; j++) {
            lp->top_token[j] = j;
            lp->top_logprob[j] = u;
        }
    }
    return 0;
}

/* The chosen token's logprob and the top alternatives (log_z: the row's log mass at
 * temperature 1, NAN: computed here). */
static void fill_logprobs(const struct sampler *s, const float *logits, float max, int32_t token,
                          double log_z, struct smp_logprobs *lp)
{
    const int vocab = s->vocab;
    if (isnan(log_z)) log_z = log(exp_shifted(logits, vocab, max, 1.0f, NULL, NULL));
    lp->token = token;
    lp->logprob = (float)((double)logits[token] - (double)max - log_z);
    top_logprobs(logits, vocab, s->p.n_logprobs < vocab ? s->p.n_logprobs : vocab, log_z, max,
                 lp);
}

int32_t smp_sample(struct sampler *s, float *logits, struct smp_logprobs *lp)
{
    int32_t arg;
    float max = prepare(s, logits, &arg);
    if (max == -INFINITY) return nothing_possible(s, lp);
    int32_t token = arg;
    double log_z = NAN;
    if (s->p.temperature >= 1e-5f) token = draw(s, logits, max, &log_z);
    if (lp) fill_logprobs(s, logits, max, token, log_z, lp);
    return token;
}

int32_t smp_sample_verify(struct sampler *s, float *logits, int32_t draft, const float *q,
                          int n_q, bool *accepted, struct smp_logprobs *lp)
{
    int32_t arg;
    *accepted = false;
    float max = prepare(s, logits, &arg);
    if (max == -INFINITY) return nothing_possible(s, lp);
    int32_t token = arg;
    double log_z = NAN;
    if (s->p.temperature < 1e-5f || !q) {
        /* p or q a point mass: the rule is "draw from p, accept iff it is the draft" */
        if (s->p.temperature >= 1e-5f) token = draw(s, logits, max, &log_z);
        *accepted = token == draft;
    } else {
        double total;
        int n = candidates(s, logits, max, &total, &log_z);
        const struct smp_cand *c = s->cand;
        double px = 0.0, qx = draft >= 0 && draft < n_q ? (double)q[draft] : 0.0;
        for (int j = 0; j < n; j++)
            if (c[j].id == draft) px = (double)c[j].w / total;
        /* accept with probability min(1, p(x) / q(x)) */
        double u = ms_rng_uniform(&s->rng);
        if (px > 0.0 && u * qx < px) {
            token = draft;
            *accepted = true;
        } else {
            /* rejected (then p(x) < q(x)): draw from max(0, p - q), normalised; x has no mass
             * in it */
            double rest = 0.0;
            for (int j = 0; j < n; j++) {
                double r = (double)c[j].w / total - (c[j].id < n_q ? (double)q[c[j].id] : 0.0);
                rest += r > 0.0 ? r : 0.0;
            }
            if (rest > 0.0) {
                double v = ms_rng_uniform(&s->rng) * rest, acc = 0.0;
                token = -1;
                for (int j = 0; j < n; j++) {
                    double r = (double)c[j].w / total -
                               (c[j].id < n_q ? (double)q[c[j].id] : 0.0);
                    if (!(r > 0.0)) continue;
                    acc += r;
                    token = c[j].id;
                    if (v < acc) break;
                }
            } else {
                /* p == q up to rounding, where a rejection has probability 0: a draw from p */
                double v = ms_rng_uniform(&s->rng) * total, acc = 0.0;
                token = c[n - 1].id;
                for (int j = 0; j < n; j++) {
                    acc += c[j].w;
                    if (v < acc) {
                        token = c[j].id;
                        break;
                    }
                }
            }
        }
    }
    if (lp) fill_logprobs(s, logits, max, token, log_z, lp);
    return token;
}

void smp_row_logprobs(const float *logits, int vocab, int32_t token, int n_top,
                      struct smp_logprobs *lp)
{
    /* NaN logits carry no mass (exp_shifted maps them to 0) and never outrank a number. */
    float max = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (logits[i] > max) max = logits[i];
    if (n_top > SMP_MAX_LOGPROBS) n_top = SMP_MAX_LOGPROBS;
    if (n_top > vocab) n_top = vocab;
    lp->token = token;
    if (!(max > -INFINITY) || !isfinite(max)) {
        /* As smp_sample: no usable distribution reads as the uniform one. */
        float u = (float)-log((double)vocab);
        lp->logprob = u;
        lp->rank = 1;
        lp->n_top = n_top < 0 ? 0 : n_top;
        for (int j = 0; j < lp->n_top; j++) {
            lp->top_token[j] = j;
            lp->top_logprob[j] = u;
        }
        return;
    }
    double log_z = log(exp_shifted(logits, vocab, max, 1.0f, NULL, NULL));
    float x = logits[token];
    int32_t above = 0;
    for (int i = 0; i < vocab; i++) above += logits[i] > x;
    lp->rank = above + 1;
    lp->logprob = (float)((double)x - (double)max - log_z);
    top_logprobs(logits, vocab, n_top, log_z, max, lp);
}
