/* Small deterministic random numbers: splitmix64 expands a seed, xoshiro256** draws. Used
 * where the same seed must give the same stream on every machine (sampling, synthetic models).
 * Header-only; the state is a plain value owned by the caller. */
#ifndef MOESERVE_RNG_H
#define MOESERVE_RNG_H

#include <stdint.h>

struct ms_rng {
    uint64_t s[4]; /* never all zero */
};

static inline uint64_t ms_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t ms_rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static inline void ms_rng_seed(struct ms_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = ms_splitmix64(&x);
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3])) r->s[0] = 1;
}

static inline uint64_t ms_rng_next(struct ms_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = ms_rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = ms_rotl64(s[3], 45);
    return out;
}

/* Uniform in [0, 1) with 53 random bits. */
static inline double ms_rng_uniform(struct ms_rng *r)
{
    return (double)(ms_rng_next(r) >> 11) * 0x1.0p-53;
}

#endif
