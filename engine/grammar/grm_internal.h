/* Internals shared by the grammar's files: grm_compile.c (text -> rules) and grm_match.c
 * (vocabulary trie, matcher, mask). Nothing else includes this; see grammar.h. */
#ifndef MOESERVE_GRM_INTERNAL_H
#define MOESERVE_GRM_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar.h"

/* An element of a rule alternative: kind in the top 2 bits, an index in the rest. */
#define GRM_EL_SET 0u   /* one byte out of sets[index] */
#define GRM_EL_REF 1u   /* rule `index` */
#define GRM_EL_END 2u   /* end of the alternative */
#define GRM_EL_KIND(e) ((e) >> 30)
#define GRM_EL_IDX(e) ((e) & 0x3fffffffu)
#define GRM_EL(kind, idx) ((uint32_t)(kind) << 30 | (uint32_t)(idx))

/* Hard caps whatever the limits (element and rule indices must fit GRM_EL's 30 bits; a
 * grm_limits budget is normally far below). */
#define GRM_MAX_ELEMENTS (1 << 22)
#define GRM_MAX_RULES (1 << 20)

struct grm_set {
    uint64_t bits[4];
};

static inline bool grm_set_has(const struct grm_set *s, unsigned char b)
{
    return (s->bits[b >> 6] >> (b & 63)) & 1;
}

struct grm_grammar {
    atomic_int refs;
    const struct grm_vocab *vocab;
    uint32_t *els;     /* (n_els) every alternative's elements, each ended by GRM_EL_END */
    int n_els;
    struct grm_set *sets; /* (n_sets) */
    int n_sets;
    int32_t *alt_start; /* (n_alts) element index where each alternative starts */
    int32_t *rule_alt;  /* (n_rules + 1) rule r has alternatives rule_alt[r] .. rule_alt[r+1]-1 */
    int n_rules, n_alts;
    int root;           /* the start rule */
    int root_sp;        /* " "? root: the start when the decoder drops a first leading space */
};

/* The bytes a compiled grammar of these counts takes (what grm_limits.max_bytes bounds). */
static inline size_t grm_compiled_bytes(int n_els, int n_sets, int n_alts, int n_rules)
{
    return sizeof(struct grm_grammar) + sizeof(uint32_t) * (size_t)n_els +
           sizeof(struct grm_set) * (size_t)n_sets + sizeof(int32_t) * (size_t)n_alts +
           sizeof(int32_t) * ((size_t)n_rules + 1);
}

struct grm_vocab {
    int vocab;               /* the model's vocabulary size */
    int32_t *eos;            /* (n_eos) */
    int n_eos;
    bool strip_first_space;  /* SentencePiece: the first token's leading space is dropped */
    /* trie: node 0 is the root; children of node n are child[child_first[n] ..
     * child_first[n + 1]) with bytes child_byte[...]; tokens ending at n are
     * tok_ids[tok_first[n] .. tok_first[n + 1]) */
    int n_nodes;
    int32_t *child_first;    /* (n_nodes + 1) */
    int32_t *child;          /* (n_nodes - 1) */
    uint8_t *child_byte;     /* (n_nodes - 1) */
    int32_t *tok_first;      /* (n_nodes + 1) */
    int32_t *tok_ids;        /* (tokens in the trie) */
    int max_depth;           /* longest token, bytes */
};

/* A growable text buffer for the EBNF being written (grm_compile.c, json_schema.c): `failed`
 * records running out of memory and makes later writes no-ops; p is NUL-terminated. */
struct grm_txt {
    char *p;
    size_t len, cap;
    bool failed;
};
void grm_txt_put(struct grm_txt *t, const char *s, size_t n);
void grm_txt_puts(struct grm_txt *t, const char *s);
void grm_txt_putf(struct grm_txt *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A quoted EBNF literal of the bytes s[0..n) (quotes, backslashes, controls as \xHH). */
void grm_txt_literal(struct grm_txt *t, const char *s, size_t n);

#endif
