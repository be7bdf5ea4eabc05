/* Grammar-constrained decoding (structured output): a grammar compiled from EBNF (GBNF style,
 * below), a regular expression, a list of choices or a JSON Schema decides, token by token,
 * which tokens may come next; the sampler only sees those.
 *
 * The grammar works on bytes. Every text form compiles to rules whose elements are byte sets
 * and rule references; code-point classes become the UTF-8 byte sequences of their ranges. A
 * matcher holds the set of parse stacks (graph-structured: stacks share their lower frames)
 * that are alive after the bytes so far. To find the allowed tokens it walks a byte trie of
 * the vocabulary (struct grm_vocab, one per tokenizer) depth first, advancing the stacks by
 * each edge's byte and cutting a subtree as soon as no stack survives, so the cost follows the
 * tokens the grammar can still take, not the vocabulary size times token length.
 *
 * EBNF (what guided_grammar accepts; the GBNF dialect of llama.cpp and xgrammar):
 *     root   ::= rule body; the grammar starts at `root`        # comments run to the line end
 *     name   ::= alt ( "|" alt )*       alt: items, possibly none (the empty string)
 *     item   ::= primary ( "*" | "+" | "?" | "{m}" | "{m,}" | "{m,n}" )?
 *     primary::= "literal" | [class] | [^class] | . | name | ( alternatives )
 * Literals and classes take \n \t \r \\ \" \] \- \xHH (a byte in a literal, a code point in a
 * class) \uHHHH \UHHHHHHHH; classes hold code points and ranges a-z; `.` is any character.
 * A repetition whose body can match the empty string repeats the body's non-empty part
 * ((x)* is (x minus "")*), so nested quantifiers such as ("a"*)* or the regex (a|b*)+c
 * compile. Other left recursion (a rule reaching itself before consuming a byte, also through
 * rules that can match nothing) is refused, so matching always terminates.
 *
 * Limits on input: groups "( ... )" in EBNF and in regular expressions nest at most
 * GRM_MAX_NESTING deep (deeper is an error naming the limit); every other pass over the rules
 * is iterative, so no input can exhaust the stack. A compile can also be given a budget
 * (struct grm_limits: time, rules, bytes) that it checks as it goes.
 *
 * Ownership: a grm_grammar is immutable once compiled, reference counted (grm_retain /
 * grm_release, any thread) and keeps its grm_vocab borrowed: the vocab must outlive it. A
 * matcher belongs to one sequence; it allocates everything it will use at creation, so
 * grm_mask and grm_accept never allocate. */
#ifndef MOESERVE_GRAMMAR_H
#define MOESERVE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

struct grm_vocab;
struct grm_grammar;
struct grm_matcher;

enum grm_kind {
    GRM_EBNF,        /* text: EBNF as above */
    GRM_REGEX,       /* text: a regular expression the whole output must match */
    GRM_CHOICE,      /* text: a JSON array of strings; the output is one of them */
    GRM_JSON_SCHEMA, /* text: a JSON Schema (see json_schema.h for what is supported) */
    GRM_JSON_OBJECT, /* any JSON object (text ignored) */
};

/* The byte trie of a tokenizer's tokens (special tokens left out: only eos ids may end a
 * constrained output). vocab: the model's vocabulary size (ids at or past the tokenizer's are
 * never allowed). Returns NULL when out of memory. */
struct grm_vocab *grm_vocab_build(const struct tokenizer *tok, int vocab, const int32_t *eos,
                                  int n_eos);
void grm_vocab_free(struct grm_vocab *v);
int grm_vocab_nodes(const struct grm_vocab *v); /* trie nodes (benchmarks) */

/* Groups nest at most this deep in EBNF and regex text; deeper fails with "groups nested
 * deeper than 256 levels". */
#define GRM_MAX_NESTING 256

/* Compiles `text` of `kind`. On failure returns -1 with the reason in err and, when the
 * reason is one keyword of a JSON Schema, that keyword in bad_keyword (may be NULL).
 * No budget: grm_compile_limited with lim NULL (only the hard caps of 2^20 rules and 2^22
 * elements apply). */
int grm_compile(enum grm_kind kind, const char *text, const struct grm_vocab *v,
                struct grm_grammar **out, char *err, size_t errlen, char *bad_keyword,
                size_t kwlen);

/* A budget for one compile (untrusted grammars on a worker pool). The rule and byte limits
 * are checked as each rule and element is made, the clock every 1024 of them and through the
 * later passes, so a compile over budget stops within a few milliseconds of its limit (the
 * JSON parse of a schema and the translation of a regex to EBNF, both linear in the input,
 * are not interrupted). */
struct grm_limits {
    double max_seconds; /* wall time for one compile; 0 = none */
    size_t max_rules;   /* rules after expansion; 0 = none */
    size_t max_bytes;   /* memory the compiled grammar may take; 0 = none */
};
/* grm_compile with limits: returns 0, -1 (invalid input: err says why, bad_keyword as
 * grm_compile) or GRM_EBUDGET (-2: over a limit; err names the limit and its value, e.g.
 * "the grammar needs more than 1000 rules (limit max_rules)"). lim NULL: no budget. */
#define GRM_EBUDGET (-2)
int grm_compile_limited(enum grm_kind kind, const char *text, const struct grm_vocab *v,
                        const struct grm_limits *lim, struct grm_grammar **out, char *err,
                        size_t errlen, char *bad_keyword, size_t kwlen);
void grm_retain(struct grm_grammar *g);
void grm_release(struct grm_grammar *g);

/* A matcher at the grammar's start. Returns NULL when out of memory. */
struct grm_matcher *grm_matcher_create(const struct grm_grammar *g);
void grm_matcher_free(struct grm_matcher *m);

/* Sets logits[i] to -inf for every token the grammar does not allow next (row of the model's
 * vocab size); an eos id stays allowed only where the output may end. Returns the number of
 * tokens left allowed (0: nothing can continue). The work of one call is bounded: for a
 * grammar whose parse stacks explode (bounded repetitions nested in each other) the mask
 * keeps only the tokens found within that work, never a token the grammar refuses. */
int grm_mask(struct grm_matcher *m, float *logits);
/* Advances by token id. Returns 0, or -1 when the grammar does not allow it (the matcher is
 * then unchanged). An eos id is allowed where the output may end and changes nothing. */
int grm_accept(struct grm_matcher *m, int32_t id);
/* Whether grm_accept would take token id, leaving the matcher's position as it is. After a
 * grm_mask in the same position it answers as that mask did (so the two never disagree, also
 * where the mask's work bound kept only part of the tokens). */
bool grm_allows(struct grm_matcher *m, int32_t id);
/* Advances by raw bytes (tests, tools): 0 or -1 as grm_accept. */
int grm_accept_bytes(struct grm_matcher *m, const char *bytes, size_t n);
/* The output so far is complete (may end here). */
bool grm_can_end(const struct grm_matcher *m);
/* The output is complete and nothing may follow. */
bool grm_must_end(const struct grm_matcher *m);

#endif
