/* libFuzzer harness: grammar compilation (engine/grammar) and a matcher over the result. The
 * first byte picks the kind (EBNF, regex, choice list, JSON Schema); the rest, up to a NUL, is
 * the text, and up to 8 bytes of what follows the NUL (or else of the text itself) are fed to
 * a matcher a byte at a time when the text compiles. The compile runs under a budget
 * (grm_compile_limited, ~1 s, 20,000 rules, 8 MB), so expensive inputs must come back as GRM_EBUDGET rather than stall:
 * tests/fuzz/fuzz_grammar.options sets a timeout that counts a stall as a finding. Every
 * failure must carry a reason; a compiled grammar's mask must agree with grm_allows on the
 * tokens it allows, and may allow eos exactly where the output may end. The vocabulary is the
 * bundled model's (MOESERVE_TESTS_DIR/../models/mohge-small). */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static struct tokenizer *tok;
static struct grm_vocab *vocab;
static int n_vocab;
static int32_t eos = -1;
static float *row;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char json[1024], cfg[1024], err[512];
    snprintf(json, sizeof json, "%s/../models/mohge-small/tokenizer.json", MOESERVE_TESTS_DIR);
    snprintf(cfg, sizeof cfg, "%s/../models/mohge-small/tokenizer_config.json",
             MOESERVE_TESTS_DIR);
    if (tok_load(json, cfg, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_grammar: %s\n", err);
        exit(1);
    }
    n_vocab = tok_vocab_size(tok);
    eos = tok_eos_id(tok);
    vocab = grm_vocab_build(tok, n_vocab, &eos, eos >= 0 ? 1 : 0);
    row = malloc(sizeof *row * (size_t)n_vocab);
    if (!vocab || !row) {
        fprintf(stderr, "fuzz_grammar: out of memory\n");
        exit(1);
    }
    return 0;
}

/* The mask after the bytes so far against grm_allows on every allowed token (up to 4 of
 * them: on an exploding grammar each costs a table restart, as much as a tenth of a mask)
 * and on eos. */
static void check_mask(struct grm_matcher *m)
{
    for (int i = 0; i < n_vocab; i++) row[i] = 0.0f;
    int n = grm_mask(m, row);
    if (n < 0 || n > n_vocab) abort();
    int seen = 0, checked = 0;
    for (int id = 0; id < n_vocab && checked < 4; id++) {
        if (row[id] != 0.0f) continue;
        seen++;
        if (id == eos) continue;
        checked++;
        if (!grm_allows(m, id)) abort(); /* the mask allowed what the matcher refuses */
    }
    if (checked < 4 && seen != n) abort(); /* the count is of the tokens left allowed */
    if (eos >= 0 && (row[eos] == 0.0f) != grm_can_end(m)) abort();
    if (grm_must_end(m) && !grm_can_end(m)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    static const enum grm_kind kinds[4] = {GRM_EBNF, GRM_REGEX, GRM_CHOICE, GRM_JSON_SCHEMA};
    enum grm_kind kind = kinds[data[0] & 3];
    char *text = malloc(size);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    size_t tlen = strlen(text);
    const char *bytes = tlen + 1 < size - 1 ? text + tlen + 1 : text;
    size_t nbytes = tlen + 1 < size - 1 ? size - 1 - tlen - 1 : tlen;
    /* A step (one byte) may do up to STEP_WORK expansions (grm_match.c): ~2 ms in a release
     * build, 20-30x that under ASan, so 8 bytes keep a worst-case input within the timeout
     * while covering multi-byte paths. */
    if (nbytes > 8) nbytes = 8;

    struct grm_limits lim = {.max_seconds = 1.0, .max_rules = 20000, .max_bytes = 8u << 20};
    struct grm_grammar *g = NULL;
    char err[512] = "", kw[64] = "";
    int rc = grm_compile_limited(kind, text, vocab, &lim, &g, err, sizeof err, kw, sizeof kw);
    if (rc != 0) {
        /* a failure has a reason and no grammar; a budget failure names its limit */
        if ((rc != -1 && rc != GRM_EBUDGET) || g || !err[0]) abort();
        if (rc == GRM_EBUDGET && !strstr(err, "(limit max_")) abort();
        free(text);
        return 0;
    }
    if (!g) abort();
    struct grm_matcher *m = grm_matcher_create(g);
    if (m) {
        /* one mask (a walk may do millions of expansions: its bound, WALK_WORK, is what keeps
         * an exploding grammar within the timeout) */
        for (size_t i = 0; i < nbytes; i++)
            if (grm_accept_bytes(m, bytes + i, 1) != 0) break;
        check_mask(m);
        grm_matcher_free(m);
    }
    grm_release(g);
    free(text);
    return 0;
}
