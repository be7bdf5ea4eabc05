/* libFuzzer harness: the tokenizer (engine/tokenizer.c, tok_decode.c) on two real vocabularies,
 * byte-level BPE (Qwen3) and SentencePiece-style BPE with byte fallback (Llama 2); the first
 * byte picks one and a mode. Text is encoded, then its ids decoded at once and streamed: the
 * streamed pieces plus the final flush must equal the full decode (tokenizer.h's promise), with
 * and without special tokens. Arbitrary id sequences are decoded both ways too, where both
 * must be valid UTF-8 but may differ: `tokenizers` turns a whole byte-fallback run into U+FFFD
 * per byte when any byte of it is invalid, which a stream that already sent the run's valid
 * characters cannot take back (ids from encode never form such runs).
 * Fixture paths come from the build (MOESERVE_FUZZ_FIXTURES, MOESERVE_TESTS_DIR). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fixture_tok.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static struct tokenizer *toks[2];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    static const char *const names[2] = {"qwen3", "llama2"};
    for (int i = 0; i < 2; i++) {
        toks[i] = fixture_tok("fuzz_tokenizer", names[i]);
    }
    return 0;
}

static bool utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        int k = c < 0x80             ? 0
                : (c & 0xe0) == 0xc0 ? 1
                : (c & 0xf0) == 0xe0 ? 2
                : (c & 0xf8) == 0xf0 ? 3
                                     : -1; /* continuation bytes */
        if (k < 0 || (k == 1 && c < 0xc2) || i + (size_t)k >= n) return false;
        unsigned cp = k == 0 ? c : c & (0x3fu >> k);
        for (int j = 1; j <= k; j++) {
            if ((s[i + (size_t)j] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + (size_t)j] & 0x3fu);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += (size_t)k + 1;
    }
    return true;
}

/* Full decode of ids vs the streamed pieces and the flush. */
static void check_stream(const struct tokenizer *tok, const int32_t *ids, int n, bool skip,
                         bool must_equal)
{
    char tmp[1];
    long need = tok_decode(tok, ids, n, skip, tmp, 1);
    if (need < 0) abort(); /* every id is in range here */
    char *full = malloc((size_t)need + 1);
    tok_decode(tok, ids, n, skip, full, (size_t)need + 1);
    size_t cap = (size_t)need + 64 * (size_t)n + 64, len = 0;
    char *streamed = malloc(cap);
    struct tok_stream st;
    tok_stream_init(&st, skip);
    for (int i = 0; i < n; i++) {
        int k = tok_stream_push(tok, &st, ids[i], streamed + len, cap - len);
        if (k < 0) abort();
        len += (size_t)k;
    }
    int k = tok_stream_flush(tok, &st, streamed + len, cap - len);
    if (k < 0) abort();
    len += (size_t)k;
    if (!utf8_valid((unsigned char *)full, (size_t)need) ||
        !utf8_valid((unsigned char *)streamed, len))
        abort();
    if (must_equal && (len != (size_t)need || memcmp(full, streamed, len) != 0)) abort();
    free(full);
    free(streamed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096) return 0;
    const struct tokenizer *tok = toks[data[0] & 1];
    int mode = (data[0] >> 1) % 3;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    if (mode < 2) { /* encode (with and without the special tokens), then decode */
        int cap = (int)len + 16;
        int32_t *ids = malloc(sizeof *ids * (size_t)cap);
        int n = tok_encode(tok, text, len, mode == 1, ids, cap);
        if (n > cap) { /* byte fallback can take several ids per input byte: encode again */
            cap = n;
            ids = realloc(ids, sizeof *ids * (size_t)cap);
            if (tok_encode(tok, text, len, mode == 1, ids, cap) != n) abort();
        }
        if (n < 0) abort();
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= tok_vocab_size(tok)) abort();
        check_stream(tok, ids, n, false, true);
        check_stream(tok, ids, n, true, true);
        free(ids);
    } else { /* arbitrary ids, 3 bytes each */
        int n = (int)(len / 3);
        int32_t *ids = malloc(sizeof *ids * (size_t)(n + 1));
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)(((uint32_t)(uint8_t)text[3 * i] << 16 |
                                (uint32_t)(uint8_t)text[3 * i + 1] << 8 |
                                (uint32_t)(uint8_t)text[3 * i + 2]) %
                               (uint32_t)tok_vocab_size(tok));
        check_stream(tok, ids, n, false, false);
        check_stream(tok, ids, n, true, false);
        free(ids);
    }
    return 0;
}
