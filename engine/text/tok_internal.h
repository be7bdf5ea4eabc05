/* Internals shared by the tokenizer's files: engine/text/tokenizer.c (loading, encoding, lookups)
 * and engine/text/tok_decode.c (decoding and streaming). Nothing outside those two includes this;
 * the public interface is tokenizer.h. The structure is filled once by tok_load and read-only
 * afterwards. */
#ifndef MOESERVE_TOK_INTERNAL_H
#define MOESERVE_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer.h"

#define MAX_PRE_STEPS 8
#define MAX_NORM_STEPS 8
#define MAX_POST_IDS 8

enum split_behavior { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum pre_kind { PRE_SPLIT, PRE_BYTELEVEL };
enum norm_kind { NORM_NFC, NORM_PREPEND, NORM_REPLACE };
enum dec_kind { DEC_JOIN, DEC_BYTELEVEL, DEC_PIECES };

struct pre_step {
    enum pre_kind kind;
    pcre2_code *re;                /* PRE_SPLIT, and PRE_BYTELEVEL with use_regex */
    enum split_behavior behavior;
    bool invert;
};

struct norm_step {
    enum norm_kind kind;
    char *from; /* NORM_PREPEND: the prefix; NORM_REPLACE: the pattern */
    char *to;   /* NORM_REPLACE: the replacement */
};

struct added_token {
    int32_t id;
    char *content;
    size_t len;
    bool special, lstrip, rstrip, single_word, normalized;
};

/* Byte trie over added-token contents (first-child / next-sibling lists). */
struct trie_node {
    int32_t child, sibling;
    int32_t added; /* index into tok->added, or -1 */
    unsigned char byte;
};
struct trie {
    struct trie_node *nodes; /* nodes[0] is the root */
    int n, cap;
};

struct tokenizer {
    int n_ids;           /* ids are 0..n_ids-1 */
    char *arena;         /* every token string, NUL-separated */
    size_t arena_len, arena_cap;
    uint32_t *str_off;   /* (n_ids) offset in arena, UINT32_MAX for an unused id */
    uint32_t *str_len;   /* (n_ids) */
    uint8_t *special;    /* (n_ids) 1 for special added tokens */

    int32_t *vocab_slot; /* (vocab_mask+1) model vocab: string -> id, -1 empty */
    uint32_t vocab_mask;

    uint64_t *merge_key; /* (merge_mask+1) (left id << 32 | right id) */
    int32_t *merge_rank; /* (merge_mask+1) -1 empty */
    int32_t *merge_new;  /* (merge_mask+1) id of the merged token */
    uint32_t merge_mask;

    bool ignore_merges, byte_fallback, fuse_unk;
    int32_t unk_id;
    int32_t byte_tok[256]; /* id of "<0xNN>" for byte fallback, -1 if absent */

    struct norm_step norm[MAX_NORM_STEPS];
    int n_norm;
    struct pre_step pre[MAX_PRE_STEPS];
    int n_pre;
    bool byte_level; /* words are mapped through the GPT-2 byte-to-unicode table */

    struct added_token *added;
    int n_added;
    struct trie trie_raw, trie_norm; /* tokens matched before / after normalization */

    int32_t post_pre[MAX_POST_IDS], post_suf[MAX_POST_IDS];
    int n_post_pre, n_post_suf;

    enum dec_kind dec;
    char *dec_from, *dec_to; /* Replace step of a DEC_PIECES decoder, NULL if none */
    bool dec_byte_fallback, dec_fuse;
    uint32_t strip_ch;
    int strip_start, strip_stop;

    int32_t bos, eos;

    char bl_utf8[256][2]; /* byte -> its stand-in character, UTF-8 (1 or 2 bytes) */
    uint8_t bl_len[256];
    int16_t bl_inv[0x144]; /* stand-in code point -> byte, -1 if none */
};

/* The string of id (vocab or added token), or NULL for an id without one. */
static inline const char *tok_entry(const struct tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids || t->str_off[id] == UINT32_MAX) return NULL;
    *len = t->str_len[id];
    return t->arena + t->str_off[id];
}

#endif
