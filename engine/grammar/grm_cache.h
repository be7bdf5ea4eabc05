/* A cache of compiled grammars keyed by their text: clients send the same JSON Schema or tool
 * list with request after request (an agent loop, a structured-output pipeline), and each
 * compile can cost up to the compile budget. The cache keeps the last results, errors
 * included, so that a repeated request costs a hash and a compare, and a client repeating an
 * expensive or invalid grammar pays for it once.
 *
 * Bounds: at most max_entries results and max_bytes of grammar text held as keys (the
 * compiled form is about proportional to its text); the least recently used result goes first.
 *
 * Threads: any thread; one lock guards the table and is never held while compiling, so two
 * threads may compile the same text at once (both get a correct grammar; one is kept).
 * Ownership: the cache holds one reference to each grammar it keeps (grm_retain); a hit hands
 * the caller a reference of its own. The vocab is borrowed and must outlive the cache. */
#ifndef MOESERVE_GRM_CACHE_H
#define MOESERVE_GRM_CACHE_H

#include <stddef.h>

#include "grammar.h"

struct grm_cache;

/* Returns NULL when out of memory. */
struct grm_cache *grm_cache_create(const struct grm_vocab *v, size_t max_entries,
                                   size_t max_bytes);
void grm_cache_free(struct grm_cache *c);

/* grm_compile_limited through the cache: the same returns, err and bad_keyword as a compile
 * of (kind, text) would give. *out gets a reference of the caller's own. */
int grm_cache_compile(struct grm_cache *c, enum grm_kind kind, const char *text,
                      const struct grm_limits *lim, struct grm_grammar **out, char *err,
                      size_t errlen, char *bad_keyword, size_t kwlen);

/* Lookups answered from the cache and compiles done, since creation. */
void grm_cache_counts(struct grm_cache *c, unsigned long long *hits,
                      unsigned long long *misses);

#endif
