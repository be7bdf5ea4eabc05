/* Hugging Face `tokenizer.json` BPE tokenizer (see tokenizer.h). Encoding runs the same
 * pipeline as the `tokenizers` library: repair invalid UTF-8, split out added tokens that are
 * matched on the raw text (leftmost-longest), normalize each remaining piece (NFC, Prepend,
 * Replace), split out added tokens declared `normalized`, pre-tokenize (regex Split steps
 * through PCRE2 with UTF+UCP, their Unicode classes rewritten into explicit ranges from our
 * Unicode 16 tables, ByteLevel), then run BPE on each word: merges are applied by rank
 * with a binary heap over a linked list of symbols, so a word of n characters costs
 * O(n log n). Decoding lives in tok_decode.c; the shared structure is in tok_internal.h.
 *
 * Everything the tokenizer needs is copied out of the JSON at load time into flat arrays and
 * open-addressing hash tables (vocab string -> id, merge pair -> rank/new id); after loading
 * the structure is read-only, and each tok_encode call keeps its scratch on its own. */
#include "tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "tok_internal.h"
#include "unicode.h"

/* ---------------------------------------------------------------------------------------- */
/* Small helpers                                                                            */

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

static int32_t vocab_find(const struct tokenizer *t, const char *s, size_t n)
{
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_slot[i];
        if (id < 0) return -1;
        if (t->str_len[id] == n && memcmp(t->arena + t->str_off[id], s, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

static bool merge_find(const struct tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *new_id)
{
    if (!t->merge_rank) return false;
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    for (;;) {
        if (t->merge_rank[i] < 0) return false;
        if (t->merge_key[i] == key) {
            *rank = t->merge_rank[i];
            *new_id = t->merge_new[i];
            return true;
        }
        i = (i + 1) & t->merge_mask;
    }
}

/* The GPT-2 byte-to-unicode table: printable Latin-1 bytes stand for themselves, the others
 * are given code points 256, 257, ... in byte order. */
static void init_byte_level(struct tokenizer *t)
{
    int next = 256;
    for (int i = 0; i < 0x144; i++) t->bl_inv[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t cp = printable ? (uint32_t)b : (uint32_t)next++;
        t->bl_len[b] = (uint8_t)uni_utf8_put(cp, t->bl_utf8[b]);
        t->bl_inv[cp] = (int16_t)b;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Loading                                                                                  */

static int arena_add(struct tokenizer *t, const char *s, size_t n, uint32_t *off)
{
    if (grow((void **)&t->arena, &t->arena_cap, t->arena_len + n + 1, 1)) return -1;
    if (t->arena_len + n + 1 > UINT32_MAX) return -1;
    memcpy(t->arena + t->arena_len, s, n);
    t->arena[t->arena_len + n] = '\0';
    *off = (uint32_t)t->arena_len;
    t->arena_len += n + 1;
    return 0;
}

static int set_id_string(struct tokenizer *t, int32_t id, const char *s, size_t n)
{
    uint32_t off;
    if (arena_add(t, s, n, &off)) return -1;
    t->str_off[id] = off;
    t->str_len[id] = (uint32_t)n;
    return 0;
}

static int trie_insert(struct trie *tr, const char *s, size_t n, int32_t added)
{
    if (tr->n == 0) {
        size_t cap = (size_t)tr->cap;
        if (grow((void **)&tr->nodes, &cap, 1, sizeof *tr->nodes)) return -1;
        tr->cap = (int)cap;
        tr->nodes[0] = (struct trie_node){.child = -1, .sibling = -1, .added = -1};
        tr->n = 1;
    }
    int32_t cur = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        int32_t c = tr->nodes[cur].child;
        while (c >= 0 && tr->nodes[c].byte != b) c = tr->nodes[c].sibling;
        if (c < 0) {
            size_t cap = (size_t)tr->cap;
            if (grow((void **)&tr->nodes, &cap, (size_t)tr->n + 1, sizeof *tr->nodes)) return -1;
            tr->cap = (int)cap;
            c = tr->n++;
            tr->nodes[c] = (struct trie_node){.child = -1, .sibling = tr->nodes[cur].child, .added = -1, .byte = b};
            tr->nodes[cur].child = c;
        }
        cur = c;
    }
    tr->nodes[cur].added = added;
    return 0;
}

/* Unicode White_Space as a class body. PCRE2's \s with UCP also matches U+180E, which the
 * Oniguruma engine behind `tokenizers` does not (U+180E left White_Space in Unicode 6.3). */
static const char WS_CLASS[] = "\\t\\n\\x0b\\f\\r\\x20\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

struct pat {
    char *p;
    size_t len, cap;
    bool failed;
};

static void pat_put(struct pat *o, const char *s, size_t n)
{
    if (o->failed) return;
    if (grow((void **)&o->p, &o->cap, o->len + n + 1, 1)) {
        o->failed = true;
        return;
    }
    memcpy(o->p + o->len, s, n);
    o->len += n;
    o->p[o->len] = '\0';
}

/* Copies a regex with its Unicode classes made explicit, so that matching follows the
 * project's Unicode 16 tables and not the system PCRE2's older ones: \s (and \S outside
 * classes) become the White_Space class, \p{X} / \P{X} / \pX the ranges of that general
 * category or group. Sets *bad_prop to an unknown property's offset (else -1). */
static char *rewrite_classes(const char *pat, long *bad_prop)
{
    size_t n = strlen(pat), wl = strlen(WS_CLASS);
    struct pat o = {0};
    bool in_class = false;
    *bad_prop = -1;
    pat_put(&o, "", 0);
    for (size_t i = 0; i < n && !o.failed; i++) {
        char c = pat[i];
        if (c == '\\' && i + 1 < n) {
            char d = pat[i + 1];
            if (d == 'Q') { /* a quoted literal is copied as is */
                const char *e = strstr(pat + i + 2, "\\E");
                size_t end = e ? (size_t)(e - pat) + 2 : n;
                pat_put(&o, pat + i, end - i);
                i = end - 1;
                continue;
            }
            if (d == 's' || (d == 'S' && !in_class)) {
                pat_put(&o, d == 'S' ? "[^" : "[", in_class ? 0 : d == 'S' ? 2 : 1);
                pat_put(&o, WS_CLASS, wl);
                if (!in_class) pat_put(&o, "]", 1);
            } else if (d == 'p' || d == 'P') {
                const char *name = pat + i + 2;
                size_t nl = 1, skip = 3;
                if (i + 2 < n && pat[i + 2] == '{') {
                    const char *close = strchr(pat + i + 3, '}');
                    if (!close) {
                        *bad_prop = (long)i;
                        free(o.p);
                        return NULL;
                    }
                    name = pat + i + 3;
                    nl = (size_t)(close - name);
                    skip = 3 + nl + 1;
                }
                bool neg = d == 'P';
                if (nl > 0 && name[0] == '^') { /* \p{^L} is \P{L} */
                    neg = !neg;
                    name++;
                    nl--;
                }
                bool unknown;
                char *body = uni_class_body(name, nl, neg, &unknown);
                if (!body) {
                    if (unknown) *bad_prop = (long)i;
                    free(o.p);
                    return NULL;
                }
                if (!in_class) pat_put(&o, "[", 1);
                pat_put(&o, body, strlen(body));
                if (!in_class) pat_put(&o, "]", 1);
                free(body);
                i += skip - 1;
                continue;
            } else {
                pat_put(&o, pat + i, 2);
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            pat_put(&o, &c, 1);
            if (i + 1 < n && pat[i + 1] == '^') pat_put(&o, &pat[++i], 1);
            if (i + 1 < n && pat[i + 1] == ']') pat_put(&o, &pat[++i], 1); /* a literal ']' first */
            continue;
        }
        if (in_class && c == ']') in_class = false;
        pat_put(&o, &c, 1);
    }
    if (o.failed) {
        free(o.p);
        return NULL;
    }
    return o.p;
}

static pcre2_code *compile_regex(const char *raw, char *err, size_t errlen, const char *path)
{
    int code;
    PCRE2_SIZE off;
    long bad_prop;
    char *pat = rewrite_classes(raw, &bad_prop);
    if (!pat) {
        if (bad_prop >= 0)
            ms_errf(err, errlen, "%s: pre-tokenizer regex: unknown Unicode property at offset %ld",
                    path, bad_prop);
        else
            ms_errf(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code, &off, NULL);
    free(pat);
    if (!re) {
        char msg[256];
        pcre2_get_error_message(code, (PCRE2_UCHAR *)msg, sizeof msg);
        ms_errf(err, errlen, "%s: cannot compile pre-tokenizer regex at offset %zu: %s", path, (size_t)off, msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* without JIT matching still works, slower */
    return re;
}

/* The regex the ByteLevel pre-tokenizer uses when use_regex is set (GPT-2's). */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int load_pre(struct tokenizer *t, json_t *p, const char *path, char *err, size_t errlen)
{
    if (!p || json_is_null(p)) return 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (!type) return ms_errf(err, errlen, "%s: pre_tokenizer without a type", path);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(p, "pretokenizers");
        size_t i;
        json_t *v;
        json_array_foreach(list, i, v) {
            if (load_pre(t, v, path, err, errlen)) return -1;
        }
        return 0;
    }
    if (t->n_pre == MAX_PRE_STEPS) return ms_errf(err, errlen, "%s: too many pre-tokenizer steps", path);
    if (t->byte_level) return ms_errf(err, errlen, "%s: a pre-tokenizer after ByteLevel is not supported", path);
    struct pre_step *s = &t->pre[t->n_pre];
    memset(s, 0, sizeof *s);
    if (strcmp(type, "Split") == 0) {
        json_t *pat = json_object_get(p, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        char *quoted = NULL;
        if (!re && lit) { /* a literal: quote it for PCRE2 */
            quoted = malloc(strlen(lit) + 5);
            if (!quoted) return ms_errf(err, errlen, "%s: out of memory", path);
            sprintf(quoted, "\\Q%s\\E", lit);
            re = quoted;
        }
        if (!re) return ms_errf(err, errlen, "%s: Split pre-tokenizer without a pattern", path);
        s->re = compile_regex(re, err, errlen, path);
        free(quoted);
        if (!s->re) return -1;
        const char *beh = json_string_value(json_object_get(p, "behavior"));
        if (!beh || strcmp(beh, "Isolated") == 0) s->behavior = SPLIT_ISOLATED;
        else if (strcmp(beh, "Removed") == 0) s->behavior = SPLIT_REMOVED;
        else if (strcmp(beh, "MergedWithPrevious") == 0) s->behavior = SPLIT_MERGED_PREV;
        else if (strcmp(beh, "MergedWithNext") == 0) s->behavior = SPLIT_MERGED_NEXT;
        else if (strcmp(beh, "Contiguous") == 0) s->behavior = SPLIT_CONTIGUOUS;
        else {
            pcre2_code_free(s->re);
            return ms_errf(err, errlen, "%s: unknown Split behavior %s", path, beh);
        }
        s->invert = json_is_true(json_object_get(p, "invert"));
        s->kind = PRE_SPLIT;
    } else if (strcmp(type, "Digits") == 0) {
        bool single = json_is_true(json_object_get(p, "individual_digits"));
        s->re = compile_regex(single ? "\\p{N}" : "\\p{N}+", err, errlen, path);
        if (!s->re) return -1;
        s->behavior = SPLIT_ISOLATED;
        s->kind = PRE_SPLIT;
    } else if (strcmp(type, "ByteLevel") == 0) {
        if (json_is_true(json_object_get(p, "add_prefix_space")))
            return ms_errf(err, errlen, "%s: ByteLevel pre-tokenizer with add_prefix_space is not supported", path);
        json_t *ur = json_object_get(p, "use_regex");
        if (!ur || json_is_true(ur)) {
            s->re = compile_regex(GPT2_PATTERN, err, errlen, path);
            if (!s->re) return -1;
        }
        s->behavior = SPLIT_ISOLATED;
        s->kind = PRE_BYTELEVEL;
        t->byte_level = true;
    } else {
        return ms_errf(err, errlen, "%s: pre-tokenizer type %s is not supported", path, type);
    }
    t->n_pre++;
    return 0;
}

static int load_norm(struct tokenizer *t, json_t *n, const char *path, char *err, size_t errlen)
{
    if (!n || json_is_null(n)) return 0;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (!type) return ms_errf(err, errlen, "%s: normalizer without a type", path);
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(n, "normalizers"), i, v) {
            if (load_norm(t, v, path, err, errlen)) return -1;
        }
        return 0;
    }
    if (t->n_norm == MAX_NORM_STEPS) return ms_errf(err, errlen, "%s: too many normalizer steps", path);
    struct norm_step *s = &t->norm[t->n_norm];
    memset(s, 0, sizeof *s);
    if (strcmp(type, "NFC") == 0) {
        s->kind = NORM_NFC;
    } else if (strcmp(type, "Prepend") == 0) {
        const char *pre = json_string_value(json_object_get(n, "prepend"));
        if (!pre) return ms_errf(err, errlen, "%s: Prepend normalizer without a prefix", path);
        s->kind = NORM_PREPEND;
        if (!(s->from = dup_str(pre))) return ms_errf(err, errlen, "%s: out of memory", path);
    } else if (strcmp(type, "Replace") == 0) {
        const char *pat = json_string_value(json_object_get(json_object_get(n, "pattern"), "String"));
        const char *content = json_string_value(json_object_get(n, "content"));
        if (!pat || !content || !*pat)
            return ms_errf(err, errlen, "%s: only Replace normalizers with a String pattern are supported", path);
        s->kind = NORM_REPLACE;
        s->from = dup_str(pat);
        s->to = dup_str(content);
        if (!s->from || !s->to) {
            free(s->from);
            free(s->to);
            return ms_errf(err, errlen, "%s: out of memory", path);
        }
    } else {
        return ms_errf(err, errlen, "%s: normalizer type %s is not supported", path, type);
    }
    t->n_norm++;
    return 0;
}

static int load_decoder_step(struct tokenizer *t, json_t *d, const char *path, char *err, size_t errlen)
{
    const char *type = json_string_value(json_object_get(d, "type"));
    if (!type) return ms_errf(err, errlen, "%s: decoder without a type", path);
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(d, "decoders"), i, v) {
            if (load_decoder_step(t, v, path, err, errlen)) return -1;
        }
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (t->dec != DEC_JOIN) return ms_errf(err, errlen, "%s: ByteLevel decoder combined with others", path);
        t->dec = DEC_BYTELEVEL;
        return 0;
    }
    if (t->dec == DEC_BYTELEVEL) return ms_errf(err, errlen, "%s: ByteLevel decoder combined with others", path);
    t->dec = DEC_PIECES;
    if (strcmp(type, "Replace") == 0) {
        const char *pat = json_string_value(json_object_get(json_object_get(d, "pattern"), "String"));
        const char *content = json_string_value(json_object_get(d, "content"));
        if (!pat || !content || !*pat || t->dec_from)
            return ms_errf(err, errlen, "%s: only one Replace decoder with a String pattern is supported", path);
        t->dec_from = dup_str(pat);
        t->dec_to = dup_str(content);
        if (!t->dec_from || !t->dec_to) return ms_errf(err, errlen, "%s: out of memory", path);
    } else if (strcmp(type, "ByteFallback") == 0) {
        t->dec_byte_fallback = true;
    } else if (strcmp(type, "Fuse") == 0) {
        t->dec_fuse = true;
    } else if (strcmp(type, "Strip") == 0) {
        const char *content = json_string_value(json_object_get(d, "content"));
        uint32_t cp = 0;
        if (!content || !*content ||
            uni_utf8_next((const unsigned char *)content, strlen(content), &cp) != (int)strlen(content))
            return ms_errf(err, errlen, "%s: Strip decoder needs a one-character content", path);
        t->strip_ch = cp;
        t->strip_start = (int)json_integer_value(json_object_get(d, "start"));
        t->strip_stop = (int)json_integer_value(json_object_get(d, "stop"));
        if (t->strip_start > 1 || t->strip_stop > 0 || t->strip_start < 0)
            return ms_errf(err, errlen, "%s: Strip decoder other than start<=1, stop=0 is not supported", path);
    } else {
        return ms_errf(err, errlen, "%s: decoder type %s is not supported", path, type);
    }
    return 0;
}

static int32_t added_id_of(const struct tokenizer *t, const char *s)
{
    for (int i = 0; i < t->n_added; i++)
        if (strcmp(t->added[i].content, s) == 0) return t->added[i].id;
    return -1;
}

static int load_post(struct tokenizer *t, json_t *p, const char *path, char *err, size_t errlen)
{
    if (!p || json_is_null(p)) return 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (!type) return ms_errf(err, errlen, "%s: post_processor without a type", path);
    if (strcmp(type, "ByteLevel") == 0) return 0; /* only adjusts offsets */
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(p, "processors"), i, v) {
            if (load_post(t, v, path, err, errlen)) return -1;
        }
        return 0;
    }
    if (strcmp(type, "TemplateProcessing") != 0)
        return ms_errf(err, errlen, "%s: post_processor type %s is not supported", path, type);
    json_t *specials = json_object_get(p, "special_tokens");
    bool seen_seq = false;
    size_t i;
    json_t *piece;
    json_array_foreach(json_object_get(p, "single"), i, piece) {
        json_t *sp = json_object_get(piece, "SpecialToken");
        if (!sp) {
            if (json_object_get(piece, "Sequence")) seen_seq = true;
            continue;
        }
        const char *name = json_string_value(json_object_get(sp, "id"));
        json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids");
        if (!name || !json_is_array(ids))
            return ms_errf(err, errlen, "%s: TemplateProcessing names an unknown special token", path);
        size_t k;
        json_t *idv;
        json_array_foreach(ids, k, idv) {
            int32_t *dst = seen_seq ? t->post_suf : t->post_pre;
            int *n = seen_seq ? &t->n_post_suf : &t->n_post_pre;
            if (*n == MAX_POST_IDS) return ms_errf(err, errlen, "%s: template too long", path);
            json_int_t id = json_integer_value(idv);
            if (id < 0 || id >= t->n_ids) return ms_errf(err, errlen, "%s: template id %lld out of range", path, (long long)id);
            dst[(*n)++] = (int32_t)id;
        }
    }
    return 0;
}

static int load_added(struct tokenizer *t, json_t *list, const char *path, char *err, size_t errlen)
{
    size_t n = json_array_size(list);
    if (!n) return 0;
    t->added = calloc(n, sizeof *t->added);
    if (!t->added) return ms_errf(err, errlen, "%s: out of memory", path);
    size_t i;
    json_t *a;
    json_array_foreach(list, i, a) {
        const char *content = json_string_value(json_object_get(a, "content"));
        json_int_t id = json_integer_value(json_object_get(a, "id"));
        if (!content || !*content || id < 0 || id >= t->n_ids)
            return ms_errf(err, errlen, "%s: bad added_tokens entry %zu", path, i);
        struct added_token *at = &t->added[t->n_added++];
        at->id = (int32_t)id;
        at->len = strlen(content);
        if (!(at->content = dup_str(content))) return ms_errf(err, errlen, "%s: out of memory", path);
        at->special = json_is_true(json_object_get(a, "special"));
        at->lstrip = json_is_true(json_object_get(a, "lstrip"));
        at->rstrip = json_is_true(json_object_get(a, "rstrip"));
        at->single_word = json_is_true(json_object_get(a, "single_word"));
        at->normalized = json_is_true(json_object_get(a, "normalized"));
        if (set_id_string(t, at->id, content, at->len)) return ms_errf(err, errlen, "%s: out of memory", path);
        if (at->special) t->special[at->id] = 1;
        struct trie *tr = at->normalized ? &t->trie_norm : &t->trie_raw;
        if (trie_insert(tr, content, at->len, (int32_t)(t->n_added - 1)))
            return ms_errf(err, errlen, "%s: out of memory", path);
    }
    return 0;
}

static int vocab_insert(struct tokenizer *t, int32_t id)
{
    uint32_t i = (uint32_t)hash_bytes(t->arena + t->str_off[id], t->str_len[id]) & t->vocab_mask;
    while (t->vocab_slot[i] >= 0) i = (i + 1) & t->vocab_mask;
    t->vocab_slot[i] = id;
    return 0;
}

static int load_merges(struct tokenizer *t, json_t *merges, const char *path, char *err, size_t errlen)
{
    size_t n = json_array_size(merges);
    if (!n) return 0;
    uint32_t size = 1;
    while (size < n * 2) size <<= 1;
    t->merge_mask = size - 1;
    t->merge_key = malloc((size_t)size * sizeof *t->merge_key);
    t->merge_rank = malloc((size_t)size * sizeof *t->merge_rank);
    t->merge_new = malloc((size_t)size * sizeof *t->merge_new);
    char *buf = NULL;
    size_t buf_cap = 0;
    if (!t->merge_key || !t->merge_rank || !t->merge_new) goto oom;
    memset(t->merge_rank, 0xff, (size_t)size * sizeof *t->merge_rank);
    size_t r;
    json_t *m;
    json_array_foreach(merges, r, m) {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(buf);
                return ms_errf(err, errlen, "%s: merge %zu is not two tokens", path, r);
            }
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            if (!a || !b) {
                free(buf);
                return ms_errf(err, errlen, "%s: merge %zu is not two strings", path, r);
            }
            la = json_string_length(json_array_get(m, 0));
            lb = json_string_length(json_array_get(m, 1));
        } else {
            free(buf);
            return ms_errf(err, errlen, "%s: merge %zu has an unknown form", path, r);
        }
        if (grow((void **)&buf, &buf_cap, la + lb + 1, 1)) goto oom;
        memcpy(buf, a, la);
        memcpy(buf + la, b, lb);
        int32_t ia = vocab_find(t, a, la), ib = vocab_find(t, b, lb), inew = vocab_find(t, buf, la + lb);
        if (ia < 0 || ib < 0 || inew < 0) {
            free(buf);
            return ms_errf(err, errlen, "%s: merge %zu uses a token missing from the vocab", path, r);
        }
        uint64_t key = (uint64_t)(uint32_t)ia << 32 | (uint32_t)ib;
        uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
        while (t->merge_rank[i] >= 0 && t->merge_key[i] != key) i = (i + 1) & t->merge_mask;
        if (t->merge_rank[i] >= 0) continue; /* a repeated merge keeps its first rank */
        t->merge_key[i] = key;
        t->merge_rank[i] = (int32_t)r;
        t->merge_new[i] = inew;
    }
    free(buf);
    return 0;
oom:
    free(buf);
    return ms_errf(err, errlen, "%s: out of memory loading merges", path);
}

static int load_model(struct tokenizer *t, json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *model = json_object_get(root, "model");
    const char *type = json_string_value(json_object_get(model, "type"));
    if (!model || (type && strcmp(type, "BPE") != 0))
        return ms_errf(err, errlen, "%s: model type %s is not supported (BPE only)", path, type ? type : "(none)");
    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) return ms_errf(err, errlen, "%s: model.vocab is not an object", path);
    const char *csp = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *eow = json_string_value(json_object_get(model, "end_of_word_suffix"));
    if ((csp && *csp) || (eow && *eow))
        return ms_errf(err, errlen, "%s: continuing_subword_prefix/end_of_word_suffix are not supported", path);
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) > 0.0)
        return ms_errf(err, errlen, "%s: BPE dropout is not supported", path);

    /* Highest id among vocab and added tokens. */
    json_int_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        json_int_t id = json_integer_value(v);
        if (!json_is_integer(v) || id < 0 || id > 100000000)
            return ms_errf(err, errlen, "%s: vocab entry \"%s\" has a bad id", path, key);
        if (id > max_id) max_id = id;
    }
    size_t i;
    json_array_foreach(json_object_get(root, "added_tokens"), i, v) {
        json_int_t id = json_integer_value(json_object_get(v, "id"));
        if (id > max_id && id <= 100000000) max_id = id;
    }
    if (max_id < 0) return ms_errf(err, errlen, "%s: empty vocab", path);
    t->n_ids = (int)max_id + 1;
    t->str_off = malloc((size_t)t->n_ids * sizeof *t->str_off);
    t->str_len = calloc((size_t)t->n_ids, sizeof *t->str_len);
    t->special = calloc((size_t)t->n_ids, 1);
    if (!t->str_off || !t->str_len || !t->special) return ms_errf(err, errlen, "%s: out of memory", path);
    memset(t->str_off, 0xff, (size_t)t->n_ids * sizeof *t->str_off);

    size_t n_vocab = json_object_size(vocab);
    uint32_t size = 1;
    while (size < n_vocab * 2) size <<= 1;
    t->vocab_mask = size - 1;
    t->vocab_slot = malloc((size_t)size * sizeof *t->vocab_slot);
    if (!t->vocab_slot) return ms_errf(err, errlen, "%s: out of memory", path);
    memset(t->vocab_slot, 0xff, (size_t)size * sizeof *t->vocab_slot);
    json_object_foreach(vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        if (t->str_off[id] != UINT32_MAX)
            return ms_errf(err, errlen, "%s: vocab id %d appears twice", path, (int)id);
        if (set_id_string(t, id, key, strlen(key))) return ms_errf(err, errlen, "%s: out of memory", path);
        vocab_insert(t, id);
    }

    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    t->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    t->unk_id = unk ? vocab_find(t, unk, strlen(unk)) : -1;
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_tok[b] = vocab_find(t, name, 6);
    }
    return load_merges(t, json_object_get(model, "merges"), path, err, errlen);
}

/* Reads a whole file and parses it (faster than json_load_file, which reads byte by byte). */
static json_t *load_json(const char *path, size_t flags, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        ms_errf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    char *data = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        ms_errf(err, errlen, "%s: cannot determine the file size", path);
        goto fail;
    }
    data = malloc((size_t)size + 1);
    if (!data) {
        ms_errf(err, errlen, "%s: out of memory reading %ld bytes", path, size);
        goto fail;
    }
    if (fread(data, 1, (size_t)size, f) != (size_t)size) {
        ms_errf(err, errlen, "%s: read error", path);
        goto fail;
    }
    fclose(f);
    f = NULL;
    json_error_t je;
    json_t *root = json_loadb(data, (size_t)size, flags, &je);
    if (!root) ms_errf(err, errlen, "%s:%d: %s", path, je.line, je.text);
    free(data);
    return root;
fail:
    if (f) fclose(f);
    free(data);
    return NULL;
}

/* A bos_token/eos_token entry of tokenizer_config.json: a string, {"content": ...} or null. */
static int32_t config_token(const struct tokenizer *t, json_t *v)
{
    const char *s = json_is_object(v) ? json_string_value(json_object_get(v, "content")) : json_string_value(v);
    return s ? tok_token_id(t, s) : -1;
}

static int load_config(struct tokenizer *t, const char *path, char *err, size_t errlen)
{
    t->bos = t->n_post_pre > 0 ? t->post_pre[0] : -1;
    t->eos = -1;
    if (!path) return 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) return 0;
        return ms_errf(err, errlen, "%s: %s", path, strerror(errno));
    }
    fclose(f);
    json_t *cfg = load_json(path, JSON_DECODE_INT_AS_REAL, err, errlen); /* model_max_length can be 1e30 */
    if (!cfg) return -1;
    t->bos = config_token(t, json_object_get(cfg, "bos_token"));
    t->eos = config_token(t, json_object_get(cfg, "eos_token"));
    json_decref(cfg);
    return 0;
}

int tok_load(const char *tokenizer_json, const char *tokenizer_config_json, struct tokenizer **out,
             char *err, size_t errlen)
{
    *out = NULL;
    struct tokenizer *t = calloc(1, sizeof *t);
    if (!t) return ms_errf(err, errlen, "%s: out of memory", tokenizer_json);
    json_t *root = load_json(tokenizer_json, 0, err, errlen);
    if (!root) goto fail;
    init_byte_level(t);
    if (load_model(t, root, tokenizer_json, err, errlen)) goto fail;
    if (load_added(t, json_object_get(root, "added_tokens"), tokenizer_json, err, errlen)) goto fail;
    if (load_norm(t, json_object_get(root, "normalizer"), tokenizer_json, err, errlen)) goto fail;
    if (load_pre(t, json_object_get(root, "pre_tokenizer"), tokenizer_json, err, errlen)) goto fail;
    if (load_post(t, json_object_get(root, "post_processor"), tokenizer_json, err, errlen)) goto fail;
    json_t *dec = json_object_get(root, "decoder");
    if (dec && !json_is_null(dec) && load_decoder_step(t, dec, tokenizer_json, err, errlen)) goto fail;
    if (load_config(t, tokenizer_config_json, err, errlen)) goto fail;
    json_decref(root);
    *out = t;
    return 0;
fail:
    json_decref(root);
    tok_free(t);
    return -1;
}

void tok_free(struct tokenizer *t)
{
    if (!t) return;
    free(t->arena);
    free(t->str_off);
    free(t->str_len);
    free(t->special);
    free(t->vocab_slot);
    free(t->merge_key);
    free(t->merge_rank);
    free(t->merge_new);
    for (int i = 0; i < t->n_norm; i++) {
        free(t->norm[i].from);
        free(t->norm[i].to);
    }
    for (int i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i].re);
    for (int i = 0; i < t->n_added; i++) free(t->added[i].content);
    free(t->added);
    free(t->trie_raw.nodes);
    free(t->trie_norm.nodes);
    free(t->dec_from);
    free(t->dec_to);
    free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding                                                                                 */

struct span {
    size_t s, e;
};

struct heap_ent {
    int32_t rank, pos, new_id;
};

/* Scratch of one tok_encode call. */
struct enc {
    int32_t *ids;
    size_t n_ids, cap_ids;
    struct span *a, *b; /* pre-tokenizer splits, double-buffered */
    size_t cap_a, cap_b;
    char *word;
    size_t cap_word;
    int32_t *sym, *prev, *next; /* BPE symbols of one word */
    size_t cap_sym, cap_prev, cap_next;
    struct heap_ent *heap;
    size_t n_heap, cap_heap;
    pcre2_match_data *md;
};

static int emit(struct enc *e, int32_t id)
{
    if (grow((void **)&e->ids, &e->cap_ids, e->n_ids + 1, sizeof *e->ids)) return -1;
    e->ids[e->n_ids++] = id;
    return 0;
}

static bool heap_less(const struct heap_ent *x, const struct heap_ent *y)
{
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static int heap_push(struct enc *e, struct heap_ent v)
{
    if (grow((void **)&e->heap, &e->cap_heap, e->n_heap + 1, sizeof *e->heap)) return -1;
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&v, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = v;
    return 0;
}

static struct heap_ent heap_pop(struct enc *e)
{
    struct heap_ent top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!heap_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

static int push_pair(const struct tokenizer *t, struct enc *e, int32_t pos)
{
    int32_t nx = e->next[pos], rank, new_id;
    if (nx < 0) return 0;
    if (!merge_find(t, e->sym[pos], e->sym[nx], &rank, &new_id)) return 0;
    return heap_push(e, (struct heap_ent){rank, pos, new_id});
}

/* BPE on one word w[0..n) (already byte-level mapped where that applies). */
static int bpe_word(const struct tokenizer *t, struct enc *e, const char *w, size_t n)
{
    if (n == 0) return 0;
    if (t->ignore_merges) {
        int32_t id = vocab_find(t, w, n);
        if (id >= 0) return emit(e, id);
    }
    if (grow((void **)&e->sym, &e->cap_sym, n, sizeof *e->sym) ||
        grow((void **)&e->prev, &e->cap_prev, n, sizeof *e->prev) ||
        grow((void **)&e->next, &e->cap_next, n, sizeof *e->next))
        return -1;
    /* Initial symbols: one per character, byte-fallback tokens or unk for unknown ones. */
    int32_t ns = 0, unk_pending = -1;
    const unsigned char *u = (const unsigned char *)w;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = uni_utf8_next(u + i, n - i, &cp);
        if (k <= 0) k = 1; /* not reached: text is valid UTF-8 */
        int32_t id = vocab_find(t, w + i, (size_t)k);
        if (id >= 0) {
            if (unk_pending >= 0) {
                e->sym[ns++] = unk_pending;
                unk_pending = -1;
            }
            e->sym[ns++] = id;
        } else {
            bool done = false;
            if (t->byte_fallback) {
                done = true;
                for (int j = 0; j < k; j++) done = done && t->byte_tok[u[i + j]] >= 0;
                if (done)
                    for (int j = 0; j < k; j++) e->sym[ns++] = t->byte_tok[u[i + j]];
            }
            if (!done && t->unk_id >= 0) {
                if (unk_pending >= 0 && !t->fuse_unk) e->sym[ns++] = unk_pending;
                unk_pending = t->unk_id;
            }
        }
        i += (size_t)k;
    }
    if (unk_pending >= 0) e->sym[ns++] = unk_pending;
    for (int32_t i = 0; i < ns; i++) {
        e->prev[i] = i - 1;
        e->next[i] = i + 1 < ns ? i + 1 : -1;
    }
    e->n_heap = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (push_pair(t, e, i)) return -1;
    while (e->n_heap) {
        struct heap_ent top = heap_pop(e);
        int32_t p = top.pos;
        if (e->sym[p] < 0) continue; /* merged into its left neighbour */
        int32_t nx = e->next[p], rank, new_id;
        if (nx < 0) continue;
        if (!merge_find(t, e->sym[p], e->sym[nx], &rank, &new_id) || new_id != top.new_id) continue;
        e->sym[p] = new_id;
        e->sym[nx] = -1;
        e->next[p] = e->next[nx];
        if (e->next[nx] >= 0) e->prev[e->next[nx]] = p;
        if (e->prev[p] >= 0 && push_pair(t, e, e->prev[p])) return -1;
        if (push_pair(t, e, p)) return -1;
    }
    for (int32_t i = 0; i >= 0 && ns > 0; i = e->next[i])
        if (emit(e, e->sym[i])) return -1;
    return 0;
}

/* Maps a piece through the byte-level table when needed, then runs BPE on it. */
static int encode_word(const struct tokenizer *t, struct enc *e, const char *s, size_t n)
{
    if (!t->byte_level) return bpe_word(t, e, s, n);
    if (grow((void **)&e->word, &e->cap_word, n * 2 + 1, 1)) return -1;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        memcpy(e->word + w, t->bl_utf8[b], t->bl_len[b]);
        w += t->bl_len[b];
    }
    return bpe_word(t, e, e->word, w);
}

static int span_push(struct span **v, size_t *cap, size_t *n, size_t s, size_t end)
{
    if (s >= end) return 0; /* empty pieces are dropped, as the library does */
    if (grow((void **)v, cap, *n + 1, sizeof **v)) return -1;
    (*v)[(*n)++] = (struct span){s, end};
    return 0;
}

/* Applies one regex split to every span of e->a, writing the result to e->b. */
static int split_spans(const struct pre_step *st, struct enc *e, const char *text, size_t na, size_t *nb_out)
{
    size_t nb = 0;
    for (size_t k = 0; k < na; k++) {
        size_t s0 = e->a[k].s, len = e->a[k].e - s0;
        const char *sub = text + s0;
        size_t pos = 0, last = 0;
        size_t first_out = nb;
        bool prev_match = false;
        /* Each region [x, y) is either a match or the text between matches. */
        for (;;) {
            size_t ms = len, me = len;
            bool found = false;
            while (pos <= len) {
                int rc = pcre2_match(st->re, (PCRE2_SPTR)sub, len, pos, PCRE2_NO_UTF_CHECK, e->md, NULL);
                if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
                    rc = pcre2_match(st->re, (PCRE2_SPTR)sub, len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
                if (rc == PCRE2_ERROR_NOMATCH) break;
                if (rc < 0) return -1;
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
                if (ov[1] > ov[0]) {
                    ms = ov[0];
                    me = ov[1];
                    found = true;
                    break;
                }
                /* An empty match: look again one character further on. */
                pos = ov[0] + 1;
                while (pos < len && ((unsigned char)sub[pos] & 0xC0) == 0x80) pos++;
            }
            /* Regions: [last, ms) not a match, then [ms, me) a match. */
            for (int r = 0; r < 2; r++) {
                size_t x = r == 0 ? last : ms, y = r == 0 ? ms : me;
                bool is_match = (r == 1) != st->invert;
                if (x >= y) continue;
                bool merged = false;
                switch (st->behavior) {
                case SPLIT_REMOVED:
                    if (is_match) merged = true; /* dropped */
                    break;
                case SPLIT_ISOLATED:
                    break;
                case SPLIT_MERGED_PREV:
                    if (is_match && !prev_match && nb > first_out) {
                        e->b[nb - 1].e = s0 + y;
                        merged = true;
                    }
                    break;
                case SPLIT_MERGED_NEXT:
                    if (!is_match && prev_match && nb > first_out) {
                        e->b[nb - 1].e = s0 + y;
                        merged = true;
                    }
                    break;
                case SPLIT_CONTIGUOUS:
                    if (is_match && prev_match && nb > first_out) {
                        e->b[nb - 1].e = s0 + y;
                        merged = true;
                    }
                    break;
                }
                prev_match = is_match;
                if (!merged && span_push(&e->b, &e->cap_b, &nb, s0 + x, s0 + y)) return -1;
            }
            if (!found) break;
            last = pos = me;
        }
    }
    *nb_out = nb;
    return 0;
}

/* Pre-tokenizes normalized text n[0..len) and runs BPE on every word. */
static int encode_normalized(const struct tokenizer *t, struct enc *e, const char *s, size_t len)
{
    if (len == 0) return 0;
    size_t na = 0;
    if (span_push(&e->a, &e->cap_a, &na, 0, len)) return -1;
    for (int i = 0; i < t->n_pre; i++) {
        if (!t->pre[i].re) continue;
        size_t nb;
        if (split_spans(&t->pre[i], e, s, na, &nb)) return -1;
        struct span *tmp = e->a;
        size_t tcap = e->cap_a;
        e->a = e->b;
        e->cap_a = e->cap_b;
        e->b = tmp;
        e->cap_b = tcap;
        na = nb;
    }
    for (size_t k = 0; k < na; k++)
        if (encode_word(t, e, s + e->a[k].s, e->a[k].e - e->a[k].s)) return -1;
    return 0;
}

/* Runs the normalizer chain on s[0..n); returns a new buffer (caller frees) or NULL. */
static char *normalize(const struct tokenizer *t, const char *s, size_t n, size_t *out_len)
{
    char *cur = malloc(n + 1);
    if (!cur) return NULL;
    memcpy(cur, s, n);
    cur[n] = '\0';
    size_t len = n;
    for (int i = 0; i < t->n_norm; i++) {
        const struct norm_step *st = &t->norm[i];
        char *next = NULL;
        if (st->kind == NORM_NFC) {
            long r = uni_nfc(cur, len, &next);
            if (r < 0) goto fail;
            len = (size_t)r;
        } else if (st->kind == NORM_PREPEND) {
            if (len == 0) continue;
            size_t pl = strlen(st->from);
            if (!(next = malloc(len + pl + 1))) goto fail;
            memcpy(next, st->from, pl);
            memcpy(next + pl, cur, len + 1);
            len += pl;
        } else {
            size_t fl = strlen(st->from), tl = strlen(st->to), count = 0;
            for (size_t r = 0; r + fl <= len;) { /* memcmp, not strstr: the text may hold NULs */
                if (memcmp(cur + r, st->from, fl) == 0) {
                    count++;
                    r += fl;
                } else {
                    r++;
                }
            }
            size_t nl = len - count * fl + count * tl;
            if (!(next = malloc(nl + 1))) goto fail;
            size_t w = 0, r = 0;
            while (r < len) {
                if (r + fl <= len && memcmp(cur + r, st->from, fl) == 0) {
                    memcpy(next + w, st->to, tl);
                    w += tl;
                    r += fl;
                } else {
                    next[w++] = cur[r++];
                }
            }
            next[w] = '\0';
            len = w;
        }
        free(cur);
        cur = next;
    }
    *out_len = len;
    return cur;
fail:
    free(cur);
    return NULL;
}

static bool is_word_char(const char *s, size_t i, size_t n, bool before)
{
    /* The character just before (before=true) or at position i; ASCII alnum, '_' and any
     * non-ASCII non-space character count as word characters. */
    const unsigned char *u = (const unsigned char *)s;
    if (before) {
        if (i == 0) return false;
        size_t j = i - 1;
        while (j > 0 && (u[j] & 0xC0) == 0x80) j--;
        i = j;
    }
    if (i >= n) return false;
    uint32_t cp;
    int k = uni_utf8_next(u + i, n - i, &cp);
    if (k <= 0) return false;
    if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
    return !uni_is_whitespace(cp);
}

/* Splits s[0..n) on the added tokens of `tr` (leftmost-longest), calling `text_fn` for text
 * between tokens and emitting token ids directly. */
typedef int (*text_fn)(const struct tokenizer *t, struct enc *e, const char *s, size_t n);

static int split_added(const struct tokenizer *t, struct enc *e, const struct trie *tr, const char *s, size_t n, text_fn fn)
{
    size_t done = 0, i = 0;
    while (tr->n > 1 && i < n) {
        int32_t cur = 0, best = -1;
        size_t best_end = 0;
        for (size_t j = i; j < n; j++) {
            int32_t c = tr->nodes[cur].child;
            while (c >= 0 && tr->nodes[c].byte != (unsigned char)s[j]) c = tr->nodes[c].sibling;
            if (c < 0) break;
            cur = c;
            if (tr->nodes[c].added >= 0) {
                best = tr->nodes[c].added;
                best_end = j + 1;
            }
        }
        if (best < 0) {
            i++;
            continue;
        }
        const struct added_token *at = &t->added[best];
        size_t start = i, stop = best_end;
        if (at->single_word && (is_word_char(s, start, n, true) || is_word_char(s, stop, n, false))) {
            i++;
            continue;
        }
        if (at->lstrip) {
            size_t j = start;
            while (j > done) {
                size_t k = j - 1;
                while (k > done && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
                uint32_t cp;
                if (uni_utf8_next((const unsigned char *)s + k, n - k, &cp) <= 0 || !uni_is_whitespace(cp)) break;
                j = k;
            }
            start = j;
        }
        if (at->rstrip) {
            while (stop < n) {
                uint32_t cp;
                int k = uni_utf8_next((const unsigned char *)s + stop, n - stop, &cp);
                if (k <= 0 || !uni_is_whitespace(cp)) break;
                stop += (size_t)k;
            }
        }
        if (start > done && fn(t, e, s + done, start - done)) return -1;
        if (emit(e, at->id)) return -1;
        done = i = stop;
    }
    if (n > done && fn(t, e, s + done, n - done)) return -1;
    return 0;
}

static int encode_raw_piece(const struct tokenizer *t, struct enc *e, const char *s, size_t n)
{
    size_t len;
    char *norm = normalize(t, s, n, &len);
    if (!norm) return -1;
    int rc = split_added(t, e, &t->trie_norm, norm, len, encode_normalized);
    free(norm);
    return rc;
}

int tok_encode(const struct tokenizer *t, const char *text, size_t len, bool add_special, int32_t *ids, int cap)
{
    struct enc e;
    memset(&e, 0, sizeof e);
    char *clean = NULL;
    int ret = -1;
    long n = uni_utf8_repair(text, len, &clean);
    if (n < 0) return -1;
    e.md = pcre2_match_data_create(4, NULL);
    if (!e.md) goto out;
    if (add_special)
        for (int i = 0; i < t->n_post_pre; i++)
            if (emit(&e, t->post_pre[i])) goto out;
    if (split_added(t, &e, &t->trie_raw, clean, (size_t)n, encode_raw_piece)) goto out;
    if (add_special)
        for (int i = 0; i < t->n_post_suf; i++)
            if (emit(&e, t->post_suf[i])) goto out;
    if (e.n_ids > (size_t)INT32_MAX) goto out;
    if (ids && cap > 0 && e.n_ids > 0) memcpy(ids, e.ids, (e.n_ids < (size_t)cap ? e.n_ids : (size_t)cap) * sizeof *ids);
    ret = (int)e.n_ids;
out:
    free(clean);
    pcre2_match_data_free(e.md);
    free(e.ids);
    free(e.a);
    free(e.b);
    free(e.word);
    free(e.sym);
    free(e.prev);
    free(e.next);
    free(e.heap);
    return ret;
}

/* ---------------------------------------------------------------------------------------- */
/* Lookups                                                                                  */

int tok_vocab_size(const struct tokenizer *t) { return t->n_ids; }
int32_t tok_bos_id(const struct tokenizer *t) { return t->bos; }
int32_t tok_eos_id(const struct tokenizer *t) { return t->eos; }

int32_t tok_token_id(const struct tokenizer *t, const char *token)
{
    int32_t id = added_id_of(t, token);
    return id >= 0 ? id : vocab_find(t, token, strlen(token));
}

const char *tok_token_str(const struct tokenizer *t, int32_t id)
{
    size_t len;
    return tok_entry(t, id, &len);
}

bool tok_is_special(const struct tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && t->special[id];
}
