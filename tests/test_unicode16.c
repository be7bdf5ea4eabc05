/* Tokenizer exactness over all of Unicode 16: every code point assigned in Unicode 16.0 on
 * planes 0-3 and 14, alone, after a space and before "<s", must encode to the ids the
 * `tokenizers` library gives, for the four shipped tokenizers (Qwen3, DeepSeek-V3, Llama 2,
 * GPT-OSS). The fixture (tests/reference/make_unicode16_fixtures.py) holds a 64-bit hash of the
 * id lists of each block of 256 code points; a mismatch names the block. Also checks the
 * generated tables themselves: their version, categories of code points new in Unicode 15-16,
 * and the regex classes built from them. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "test.h"
#include "tokenizer.h"
#include "unicode.h"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

static uint64_t fnv(uint64_t h, const int32_t *ids, int n)
{
    uint32_t words[1 + 64];
    int k = 0;
    words[k++] = (uint32_t)n;
    for (int i = 0; i < n && i < 64; i++) words[k++] = (uint32_t)ids[i];
    for (int w = 0; w < k; w++)
        for (int b = 0; b < 4; b++) h = (h ^ ((words[w] >> (8 * b)) & 0xff)) * FNV_PRIME;
    return h;
}

static void check_tables(void)
{
    CHECK(strcmp(uni_version(), "16.0.0") == 0);
    CHECK(uni_category(0x1C89) == UNI_LU);  /* CYRILLIC CAPITAL LETTER TJE, Unicode 16 */
    CHECK(uni_category(0x0CF3) == UNI_MC);  /* KANNADA SIGN COMBINING ANUSVARA, Unicode 15 */
    CHECK(uni_category(0x31350) == UNI_LO); /* CJK Extension H, Unicode 15 */
    CHECK(uni_category(0x2EBF0) == UNI_LO); /* CJK Extension I, Unicode 15.1 */
    CHECK(uni_category(0x0378) == UNI_CN);
    CHECK(uni_category('a') == UNI_LL && uni_category('1') == UNI_ND && uni_category(' ') == UNI_ZS);
    bool unknown;
    char *l = uni_class_body("L", 1, false, &unknown);
    CHECK(l && !unknown && strstr(l, "\\x{41}-\\x{5A}"));
    free(l);
    char *nl = uni_class_body("L", 1, true, &unknown);
    CHECK(nl && strstr(nl, "\\x{0}-\\x{40}") && !strstr(nl, "\\x{D800}"));
    free(nl);
    CHECK(uni_class_body("Xx", 2, false, &unknown) == NULL && unknown);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    const char *built = argc > 2 ? argv[2] : "build/fixtures";
    check_tables();
    json_error_t je;
    json_t *fx = json_load_file(test_path(tests, "fixtures/tokenizers/unicode16.json"), 0, &je);
    CHECKF(fx != NULL, "unicode16.json: %s", je.text);
    if (!fx) return test_done("test_unicode16");
    json_t *ranges = json_object_get(fx, "ranges"), *blocks = json_object_get(fx, "blocks");
    size_t n_blocks = json_array_size(blocks);
    static const char *names[] = {"qwen3", "deepseek_v3", "llama2", "gptoss"};
    static const char *ctx[] = {"alone", "after_space", "before_lt_s"};
    char text[16];
    int32_t ids[64];
    uint64_t *h = malloc(sizeof *h * n_blocks);
    for (size_t t = 0; t < sizeof names / sizeof *names && h; t++) {
        char path[4096], err[MS_ERR_LEN];
        snprintf(path, sizeof path, "%s/tokenizers/%s/tokenizer.json", built, names[t]);
        struct tokenizer *tok = NULL;
        if (tok_load(path, NULL, &tok, err, sizeof err) != 0) {
            CHECKF(0, "%s", err);
            continue;
        }
        for (int c = 0; c < 3; c++) {
            for (size_t b = 0; b < n_blocks; b++) h[b] = FNV_OFFSET;
            size_t bi = 0, n_cp = 0;
            size_t ri;
            json_t *r;
            json_array_foreach(ranges, ri, r)
            {
                uint32_t a = (uint32_t)json_integer_value(json_array_get(r, 0));
                uint32_t z = (uint32_t)json_integer_value(json_array_get(r, 1));
                for (uint32_t cp = a; cp <= z; cp++) {
                    while (bi < n_blocks &&
                           (uint32_t)json_integer_value(json_array_get(blocks, bi)) < (cp >> 8))
                        bi++;
                    size_t len = 0;
                    if (c == 1) text[len++] = ' ';
                    len += (size_t)uni_utf8_put(cp, text + len);
                    if (c == 2) {
                        memcpy(text + len, "<s", 2);
                        len += 2;
                    }
                    int n = tok_encode(tok, text, len, false, ids, 64);
                    if (n < 0 || n > 64 || bi == n_blocks) {
                        CHECKF(0, "%s: U+%04X: encode failed", names[t], cp);
                        continue;
                    }
                    h[bi] = fnv(h[bi], ids, n);
                    n_cp++;
                }
            }
            json_t *want = json_object_get(json_object_get(json_object_get(fx, "hashes"),
                                                           names[t]),
                                           ctx[c]);
            int bad = 0;
            for (size_t b = 0; b < n_blocks; b++) {
                char hex[17];
                snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h[b]);
                const char *w = json_string_value(json_array_get(want, b));
                if (!w || strcmp(w, hex) != 0) {
                    if (bad++ < 5)
                        fprintf(stderr,
                                "%s %s: block U+%04llX.. differs from tokenizers (see "
                                "make_unicode16_fixtures.py --dump %s %s 0x%llx)\n",
                                names[t], ctx[c],
                                (unsigned long long)json_integer_value(json_array_get(blocks, b)) << 8,
                                names[t], ctx[c],
                                (unsigned long long)json_integer_value(json_array_get(blocks, b)));
                }
            }
            CHECKF(bad == 0, "%s %s: %d of %zu blocks differ", names[t], ctx[c], bad, n_blocks);
            printf("%s %s: %zu code points, %zu blocks, %d differ\n", names[t], ctx[c], n_cp,
                   n_blocks, bad);
        }
        tok_free(tok);
    }
    free(h);
    json_decref(fx);
    return test_done("test_unicode16");
}
