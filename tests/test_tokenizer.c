/* Golden tests of engine/tokenizer against the Hugging Face `tokenizers` library: for each
 * tokenizer under tests/fixtures/tokenizers/ (Qwen3, DeepSeek-V3, Llama 2, GPT-OSS), every case
 * of cases.json (written by tests/reference/make_tokenizer_fixtures.py) must encode to the same
 * ids with and without special tokens, decode to the same text, and stream-decode token by
 * token to the same text in valid UTF-8 pieces. Also checks BOS/EOS, lookups, buffer limits
 * and load errors, and prints load time and encoding speed (informational). */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "test.h"
#include "tokenizer.h"
#include "unicode.h"

static int b64_value(int c)
{
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Decodes base64 into a new buffer; returns the length or -1. */
static long b64_decode(const char *s, unsigned char **out)
{
    size_t n = strlen(s);
    unsigned char *buf = malloc(n / 4 * 3 + 4);
    if (!buf) return -1;
    size_t w = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '=') break;
        int v = b64_value((unsigned char)s[i]);
        if (v < 0) {
            free(buf);
            return -1;
        }
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            buf[w++] = (unsigned char)(acc >> bits);
        }
    }
    *out = buf;
    return (long)w;
}

static void print_ids(const char *label, const int32_t *ids, int n, int around)
{
    int from = around > 8 ? around - 8 : 0, to = around + 8 < n ? around + 8 : n;
    fprintf(stderr, "  %s (%d ids, showing %d..%d):", label, n, from, to);
    for (int i = from; i < to; i++) fprintf(stderr, " %d", (int)ids[i]);
    fputc('\n', stderr);
}

/* Compares ids with the expected JSON array; on a mismatch prints where and both sequences. */
static bool same_ids(const char *what, const char *name, size_t case_no, const int32_t *got, int n, json_t *want)
{
    int nw = (int)json_array_size(want);
    int i = 0;
    while (i < n && i < nw && got[i] == (int32_t)json_integer_value(json_array_get(want, (size_t)i))) i++;
    if (i == n && i == nw) return true;
    int32_t *w = malloc((size_t)(nw ? nw : 1) * sizeof *w);
    for (int k = 0; k < nw && w; k++) w[k] = (int32_t)json_integer_value(json_array_get(want, (size_t)k));
    fprintf(stderr, "%s case %zu (%s): first mismatch at position %d\n", name, case_no, what, i);
    print_ids("got ", got, n, i);
    if (w) print_ids("want", w, nw, i);
    free(w);
    return false;
}

struct tok_expect {
    const char *name;
    int32_t bos, eos;
    const char *special; /* a special token's text */
};

static void check_streaming(const struct tokenizer *tok, const char *name, size_t case_no, const int32_t *ids, int n,
                            const char *want)
{
    struct tok_stream st;
    tok_stream_init(&st, false);
    size_t cap = strlen(want) + 256, len = 0;
    char *all = malloc(cap);
    char chunk[1024];
    bool valid = true, ok = true;
    for (int i = 0; i <= n && ok; i++) {
        int k = i < n ? tok_stream_push(tok, &st, ids[i], chunk, sizeof chunk) : tok_stream_flush(tok, &st, chunk, sizeof chunk);
        if (k < 0 || len + (size_t)k >= cap) {
            ok = false;
            break;
        }
        if (!uni_utf8_valid(chunk, (size_t)k)) valid = false;
        memcpy(all + len, chunk, (size_t)k);
        len += (size_t)k;
    }
    CHECKF(ok, "%s case %zu: stream push failed", name, case_no);
    CHECKF(valid, "%s case %zu: a stream chunk is not valid UTF-8", name, case_no);
    bool same = ok && len == strlen(want) && memcmp(all, want, len) == 0;
    CHECKF(same, "%s case %zu: streamed text differs (%zu vs %zu bytes): \"%.*s\"", name, case_no, len, strlen(want),
           (int)(len < 200 ? len : 200), all);
    free(all);
}

/* tokenizer.json files are committed as .gz and unpacked by the build into unpacked_dir. */
static void run_tokenizer(const char *tests_dir, const char *unpacked_dir,
                          const struct tok_expect *x)
{
    char rel[256], err[MS_ERR_LEN];
    char tj[4096], cj[4096];
    snprintf(tj, sizeof tj, "%s/tokenizers/%s/tokenizer.json", unpacked_dir, x->name);
    snprintf(rel, sizeof rel, "fixtures/tokenizers/%s/tokenizer_config.json", x->name);
    snprintf(cj, sizeof cj, "%s", test_path(tests_dir, rel));
    struct tokenizer *tok = NULL;
    double t0 = ms_now();
    int rc = tok_load(tj, cj, &tok, err, sizeof err);
    double t_load = ms_now() - t0;
    CHECKF(rc == 0, "%s: tok_load: %s", x->name, err);
    if (rc) return;
    printf("%s: loaded in %.3f s, vocab %d\n", x->name, t_load, tok_vocab_size(tok));

    CHECKF(tok_bos_id(tok) == x->bos, "%s: bos %d, want %d", x->name, tok_bos_id(tok), x->bos);
    CHECKF(tok_eos_id(tok) == x->eos, "%s: eos %d, want %d", x->name, tok_eos_id(tok), x->eos);
    int32_t sid = tok_token_id(tok, x->special);
    CHECKF(sid >= 0 && tok_is_special(tok, sid), "%s: %s is not a special token", x->name, x->special);
    CHECK(sid >= 0 && strcmp(tok_token_str(tok, sid), x->special) == 0);
    CHECK(tok_token_str(tok, -1) == NULL && tok_token_str(tok, tok_vocab_size(tok)) == NULL);
    CHECK(tok_token_id(tok, "this is surely not a token \x01") == -1);

    snprintf(rel, sizeof rel, "fixtures/tokenizers/%s/cases.json", x->name);
    json_error_t je;
    json_t *cases = json_load_file(test_path(tests_dir, rel), 0, &je);
    CHECKF(cases != NULL, "%s: cases.json: %s", x->name, je.text);
    if (!cases) {
        tok_free(tok);
        return;
    }
    size_t ci;
    json_t *c;
    int ok_cases = 0;
    json_array_foreach(cases, ci, c) {
        unsigned char *raw = NULL;
        long n = b64_decode(json_string_value(json_object_get(c, "text_b64")), &raw);
        CHECK(n >= 0);
        if (n < 0) continue;
        json_t *want = json_object_get(c, "ids"), *want_sp = json_object_get(c, "ids_special");
        const char *want_text = json_string_value(json_object_get(c, "decoded"));
        int cap = (int)n * 2 + 16;
        int32_t *ids = malloc((size_t)cap * sizeof *ids);
        int m = tok_encode(tok, (const char *)raw, (size_t)n, false, ids, cap);
        bool ok1 = m >= 0 && m <= cap && same_ids("ids", x->name, ci, ids, m, want);
        CHECK(ok1);
        m = tok_encode(tok, (const char *)raw, (size_t)n, true, ids, cap);
        bool ok2 = m >= 0 && m <= cap && same_ids("ids_special", x->name, ci, ids, m, want_sp);
        CHECK(ok2);

        /* Decode and stream the reference ids, so a decode bug shows apart from encode bugs. */
        int nw = (int)json_array_size(want);
        int32_t *wid = malloc((size_t)(nw + 1) * sizeof *wid);
        for (int k = 0; k < nw; k++) wid[k] = (int32_t)json_integer_value(json_array_get(want, (size_t)k));
        size_t tcap = strlen(want_text) * 2 + 64;
        char *text = malloc(tcap);
        long tl = tok_decode(tok, wid, nw, false, text, tcap);
        bool ok3 = tl >= 0 && (size_t)tl == strlen(want_text) && strcmp(text, want_text) == 0;
        CHECKF(ok3, "%s case %zu: decode gave \"%.200s\" want \"%.200s\"", x->name, ci, tl >= 0 ? text : "(error)",
               want_text);
        check_streaming(tok, x->name, ci, wid, nw, want_text);
        if (ok1 && ok2 && ok3) ok_cases++;
        free(text);
        free(wid);
        free(ids);
        free(raw);
    }
    printf("%s: %d/%zu cases match\n", x->name, ok_cases, json_array_size(cases));
    json_decref(cases);

    /* Buffer limits: the total count comes back even when cap is too small. */
    int32_t few[2];
    int total = tok_encode(tok, "hello world, this is a longer text", 34, false, few, 2);
    CHECK(total > 2);
    char small[4];
    int32_t hw[64];
    int nh = tok_encode(tok, "hello world", 11, false, hw, 64);
    long full = tok_decode(tok, hw, nh, false, small, sizeof small);
    CHECK(full == 11 && strlen(small) == 3);
    int32_t bad = tok_vocab_size(tok);
    CHECK(tok_decode(tok, &bad, 1, false, small, sizeof small) == -1);
    struct tok_stream st;
    tok_stream_init(&st, false);
    CHECK(tok_stream_push(tok, &st, bad, small, sizeof small) == -1);

    /* skip_special drops special tokens in decode and streaming. */
    int32_t with_sp[3] = {sid, hw[0], sid};
    char buf[256];
    long l1 = tok_decode(tok, with_sp, 3, true, buf, sizeof buf);
    char buf2[256];
    long l2 = tok_decode(tok, hw, 1, false, buf2, sizeof buf2);
    CHECKF(l1 == l2 && strcmp(buf, buf2) == 0, "%s: skip_special decode \"%s\" vs \"%s\"", x->name, buf, buf2);

    /* Encoding speed on the Shakespeare excerpt (informational). */
    FILE *f = fopen(test_path(tests_dir, "fixtures/tokenizers/shakespeare_4k.txt"), "rb");
    CHECK(f != NULL);
    if (f) {
        char text[8192];
        size_t n = fread(text, 1, sizeof text, f);
        fclose(f);
        int32_t *ids = malloc(8192 * sizeof *ids);
        int reps = 20, ntok = 0;
        double t1 = ms_now();
        for (int r = 0; r < reps; r++) ntok = tok_encode(tok, text, n, false, ids, 8192);
        double dt = ms_now() - t1;
        printf("%s: shakespeare %zu bytes -> %d tokens, %.0f tokens/s\n", x->name, n, ntok, dt > 0 ? ntok * reps / dt : 0.0);
        free(ids);
    }
    tok_free(tok);
}

/* tok_token_bytes: each token's own bytes join up to the encoded text (SentencePiece's word
 * marker as a space, byte-fallback and byte-level tokens as raw bytes). */
static void check_token_bytes(const char *unpacked, const char *name, const char *text,
                              const char *want_join)
{
    char path[4096], err[MS_ERR_LEN];
    snprintf(path, sizeof path, "%s/tokenizers/%s/tokenizer.json", unpacked, name);
    struct tokenizer *tok = NULL;
    if (tok_load(path, NULL, &tok, err, sizeof err) != 0) {
        CHECKF(0, "%s", err);
        return;
    }
    int32_t ids[256];
    int n = tok_encode(tok, text, strlen(text), false, ids, 256);
    char joined[1024];
    size_t w = 0;
    bool partial = false;
    for (int i = 0; i < n && n <= 256; i++) {
        char b[256];
        int k = tok_token_bytes(tok, ids[i], b, sizeof b);
        CHECK(k > 0 && w + (size_t)k < sizeof joined);
        if (k <= 0 || w + (size_t)k >= sizeof joined) break;
        partial |= !uni_utf8_valid(b, (size_t)k);
        memcpy(joined + w, b, (size_t)k);
        w += (size_t)k;
    }
    joined[w] = '\0';
    CHECKF(strcmp(joined, want_join) == 0, "%s: pieces join to '%s', want '%s'", name, joined,
           want_join);
    printf("%s: %d tokens join up to the text%s\n", name, n,
           partial ? " (some are partial UTF-8)" : "");
    tok_free(tok);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "tests";
    const char *unpacked = argc > 2 ? argv[2] : "build/fixtures";
    static const struct tok_expect all[] = {
        {"qwen3", -1, 151645, "<|im_start|>"},
        {"deepseek_v3", 0, 1, "<｜begin▁of▁sentence｜>"},
        {"llama2", 1, 2, "<s>"},
        {"gptoss", 199998, 200002, "<|start|>"},
    };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) run_tokenizer(dir, unpacked, &all[i]);
    const char *text = "The myth of caf\xc3\xa9 \xf0\x9f\x98\x80 \xe4\xbd\xa0\xe5\xa5\xbd";
    char spaced[128];
    snprintf(spaced, sizeof spaced, " %s", text); /* SentencePiece prepends the word marker */
    check_token_bytes(unpacked, "llama2", text, spaced);
    check_token_bytes(unpacked, "qwen3", text, text);
    check_token_bytes(unpacked, "gptoss", text, text);
    {
        char path[4096], err2[MS_ERR_LEN];
        snprintf(path, sizeof path, "%s/tokenizers/llama2/tokenizer.json", unpacked);
        struct tokenizer *t = NULL;
        if (tok_load(path, NULL, &t, err2, sizeof err2) == 0) {
            char b[64];
            int32_t id = tok_token_id(t, "\xe2\x96\x81myth");
            CHECK(id >= 0 && tok_token_bytes(t, id, b, sizeof b) == 5 && strcmp(b, " myth") == 0);
            CHECK(tok_decode_strips_first_space(t));
            tok_free(t);
        }
    }

    /* Load errors come back as -1 with a reason naming the file. */
    struct tokenizer *tok = (struct tokenizer *)1;
    char err[MS_ERR_LEN] = "";
    CHECK(tok_load("/nonexistent/tokenizer.json", NULL, &tok, err, sizeof err) == -1);
    CHECK(tok == NULL && strstr(err, "/nonexistent/tokenizer.json") != NULL);
    return test_done("test_tokenizer");
}
