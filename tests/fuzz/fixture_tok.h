/* The real tokenizers of the test fixtures, for the harnesses that need one: the unpacked
 * tokenizer.json from the build (MOESERVE_FUZZ_FIXTURES) and tokenizer_config.json from the
 * tests folder (MOESERVE_TESTS_DIR). A missing fixture ends the fuzzer at start-up, before any
 * input runs. The tokenizer is the caller's (kept for the whole run). */
#ifndef MOESERVE_FUZZ_FIXTURE_TOK_H
#define MOESERVE_FUZZ_FIXTURE_TOK_H

#include <stdio.h>
#include <stdlib.h>

#include "tokenizer.h"

static inline struct tokenizer *fixture_tok(const char *harness, const char *name)
{
    char json[1024], cfg[1024], err[512];
    struct tokenizer *tok = NULL;
    snprintf(json, sizeof json, "%s/tokenizers/%s/tokenizer.json", MOESERVE_FUZZ_FIXTURES, name);
    snprintf(cfg, sizeof cfg, "%s/fixtures/tokenizers/%s/tokenizer_config.json",
             MOESERVE_TESTS_DIR, name);
    if (tok_load(json, cfg, &tok, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", harness, err);
        exit(1);
    }
    return tok;
}

#endif
