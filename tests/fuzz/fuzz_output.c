/* libFuzzer harness: the output path, as a request's text goes from the model to the client.
 * Token ids (the input's text encoded by a real tokenizer, optionally with random ids spliced
 * in) go through the streaming detokenizer (tok_stream) and the stop-string filter (stopstr),
 * as the scheduler publishes them, and the published text through the tool-call parser of the
 * tokenizer's syntax (Hermes on Qwen3, DeepSeek-V3's markers, gpt-oss's harmony) and through
 * each XML-style syntax (Qwen3 XML, GLM, MiniMax-M2, typed by a fixed tools list) and Llama's
 * JSON calls, streamed as the SSE path reads it (the text so far at random token boundaries)
 * and whole as the non-streamed answer parses it. Checked:
 *   - the filter's output equals a plain search of each prefix of the decoded text at the token
 *     boundaries (the first prefix holding a stop string ends the output before its earliest
 *     match, the stop string kept with include_stop_str);
 *   - the streamed tool-call parse gives the same content, reasoning and calls as the whole
 *     one (content and reasoning compared trimmed, as the whole parse trims them), with and
 *     without the <think> reasoning split, and with calls off as for a request without tools.
 * ASan catches any write past a buffer on the way, which is how issue 29's overflow showed.
 *
 * Input: byte 0 picks the tokenizer (bits 0-1), include_stop_str (bit 2), the number of stop
 * strings (bits 3-4), skip_special (bit 5), id splicing (bit 6) and <think> reasoning
 * splitting (bit 7; byte 1's bit 0: the prompt left it open); byte 1 seeds the reader's
 * schedule; then the stop strings, each ended by 0x01 (at most 16 bytes); the rest is text. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "proto/toolcall.h"
#include "stopstr.h"
#include "tests/fuzz/fixture_tok.h"
#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define N_TOK 3
#define MAX_IDS 1024
static struct tokenizer *toks[N_TOK];
static enum tc_syntax syns[N_TOK];
static struct tc_tools *xml_tools; /* types the XML syntaxes' values: every schema type */
/* the syntaxes no fixture tokenizer selects, each checked on every input */
static const enum tc_syntax xml_syns[] = {TC_QWEN3_XML, TC_GLM, TC_MINIMAX, TC_LLAMA};

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static const char *const names[N_TOK] = {"qwen3", "deepseek_v3", "gptoss"};
    for (int i = 0; i < N_TOK; i++) {
        toks[i] = fixture_tok("fuzz_output", names[i]);
        syns[i] = tc_syntax_of(toks[i]);
    }
    xml_tools = tc_tools_parse(
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"number\"},"
        "\"c\":{\"type\":\"boolean\"},\"d\":{\"type\":\"object\"},\"e\":{\"anyOf\":[{\"type\":"
        "\"integer\"},{\"type\":\"null\"}]},\"s\":{\"type\":\"string\"},\"x\":{\"enum\":[1,"
        "\"y\",null,true,2.5,[1]]}}}}}]");
    if (!xml_tools) abort();
    return 0;
}

static void emit(void *ctx, const char *t, size_t n)
{
    if (ms_buf_add(ctx, t, n) != 0) abort();
}

/* Trimmed view of s (spaces, tabs, newlines, CRs at both ends). */
static void trimmed(const char *s, size_t n, const char **out, size_t *out_len)
{
    size_t a = 0;
    while (a < n && s[a] && strchr(" \t\n\r", s[a])) a++;
    while (n > a && s[n - 1] && strchr(" \t\n\r", s[n - 1])) n--;
    *out = s + a;
    *out_len = n - a;
}

static void same_text(const char *a, size_t al, const char *b, size_t bl, const char *what)
{
    const char *ta, *tb;
    size_t tal, tbl;
    trimmed(a, al, &ta, &tal);
    trimmed(b, bl, &tb, &tbl);
    if (tal != tbl || memcmp(ta, tb, tal) != 0) {
        fprintf(stderr, "%s differs: streamed '%.*s', whole '%.*s'\n", what, (int)tal, ta,
                (int)tbl, tb);
        abort();
    }
}

/* Parses T[0, len) whole and streamed (fed at the boundaries the schedule picks from rng);
 * aborts unless both give the same content, reasoning and calls. Returns the advanced rng. */
static uint32_t check_parse(enum tc_syntax syn, unsigned flags, const struct tc_tools *tools,
                            const char *T, size_t len, const size_t *ends, int n_ends,
                            uint32_t rng)
{
    struct ms_buf content = {0}, reasoning = {0};
    struct tc_call *calls = NULL, *scalls = NULL;
    int n_calls = 0, n_scalls = 0;
    if (tc_parse(syn, flags, tools, T, len, &content, &calls, &n_calls, &reasoning) != 0)
        abort();
    struct tc_stream st;
    tc_stream_init(&st, syn, flags, tools);
    struct ms_buf sc = {0}, sr = {0};
    for (int b = 0; b < n_ends; b++) {
        rng = rng * 1103515245u + 12345u;
        if ((rng >> 16) % 3 != 0) continue; /* the reader was not scheduled here */
        if (tc_stream_feed(&st, T, ends[b], false, &sc, &sr, &scalls, &n_scalls) != 0) abort();
    }
    if (tc_stream_feed(&st, T, len, true, &sc, &sr, &scalls, &n_scalls) != 0) abort();
    same_text(sc.p ? sc.p : "", sc.len, content.p ? content.p : "", content.len, "content");
    same_text(sr.p ? sr.p : "", sr.len, reasoning.p ? reasoning.p : "", reasoning.len,
              "reasoning");
    if (n_scalls != n_calls) {
        fprintf(stderr, "syntax %s: %d calls streamed, %d whole\n", tc_syntax_name(syn),
                n_scalls, n_calls);
        abort();
    }
    for (int i = 0; i < n_calls; i++)
        if (strcmp(calls[i].name, scalls[i].name) != 0 ||
            strcmp(calls[i].arguments, scalls[i].arguments) != 0)
            abort();
    tc_calls_free(calls, n_calls);
    tc_calls_free(scalls, n_scalls);
    ms_buf_free(&content);
    ms_buf_free(&reasoning);
    ms_buf_free(&sc);
    ms_buf_free(&sr);
    return rng;
}

/* The filter's reference: the first boundary whose prefix holds a stop string. */
static void stop_reference(const char *text, const size_t *ends, int n_ends,
                           const char *const *stop, int n_stop, bool include, struct ms_buf *out)
{
    for (int b = 0; b < n_ends && n_stop > 0; b++) {
        size_t best = SIZE_MAX, best_len = 0;
        for (int i = 0; i < n_stop; i++) {
            size_t sl = strlen(stop[i]);
            for (size_t k = 0; k + sl <= ends[b] && k < best; k++)
                if (memcmp(text + k, stop[i], sl) == 0) {
                    best = k;
                    best_len = sl;
                    break;
                }
        }
        if (best != SIZE_MAX) {
            emit(out, text, best + (include ? best_len : 0));
            return;
        }
    }
    emit(out, text, n_ends ? ends[n_ends - 1] : 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    int ti = (data[0] & 3) % N_TOK;
    bool include = data[0] & 4, skip_special = data[0] & 32, splice = data[0] & 64;
    int n_stop = (data[0] >> 3) & 3;
    uint32_t rng = data[1] * 2654435761u + 1;
    const struct tokenizer *tok = toks[ti];
    size_t at = 2;
    char stop_buf[3][17];
    const char *stop[3];
    for (int i = 0; i < n_stop; i++) {
        size_t l = 0;
        while (at < size && data[at] != 1 && l < 16) stop_buf[i][l++] = (char)data[at++];
        if (at < size && data[at] == 1) at++;
        if (l == 0) stop_buf[i][l++] = 'x';
        stop_buf[i][l] = '\0';
        stop[i] = stop_buf[i];
    }
    const char *text = (const char *)data + at;
    size_t text_len = size - at;

    int32_t *ids = malloc(sizeof *ids * MAX_IDS);
    if (!ids) return 0;
    int n = tok_encode(tok, text, text_len, false, ids, MAX_IDS);
    if (n < 0) abort();
    if (n > MAX_IDS) n = MAX_IDS;
    int vocab = tok_vocab_size(tok);
    for (int i = 0; splice && i < n; i++) { /* every fourth id on average becomes random */
        rng = rng * 1103515245u + 12345u;
        if ((rng >> 16) % 4 == 0) ids[i] = (int32_t)((rng >> 8) % (uint32_t)vocab);
    }

    /* the scheduler's path: detokenizer -> stop filter -> published text */
    struct stopstr f;
    struct ms_buf out = {0}, pieces = {0}, ref = {0};
    size_t *ends = malloc(sizeof *ends * (size_t)(n + 1)); /* out.len after each token */
    size_t *pend = malloc(sizeof *pend * (size_t)(n + 1)); /* pieces.len after each token */
    if (!ends || !pend || stopstr_init(&f, stop, n_stop, include, 512) != 0) abort();
    struct tok_stream ts;
    tok_stream_init(&ts, skip_special);
    char piece[512];
    int n_ends = 0;
    bool matched = false;
    for (int i = 0; i <= n && !matched; i++) {
        int w = i < n ? tok_stream_push(tok, &ts, ids[i], piece, sizeof piece)
                      : tok_stream_flush(tok, &ts, piece, sizeof piece);
        if (w < 0) w = 0; /* a piece too long for the buffer is dropped, as the scheduler does */
        if (w > 0) emit(&pieces, piece, (size_t)w);
        if (w > 0) matched = stopstr_feed(&f, piece, (size_t)w, true, emit, &out);
        pend[n_ends] = pieces.len;
        ends[n_ends++] = out.len;
    }
    if (!matched) stopstr_flush(&f, emit, &out);
    if (!matched) ends[n_ends - 1] = out.len;
    stop_reference(pieces.p ? pieces.p : "", pend, n_ends, stop, n_stop, include, &ref);
    if (ref.len != out.len || (out.len && memcmp(ref.p, out.p, out.len) != 0)) {
        fprintf(stderr, "stop filter: '%.*s', reference '%.*s'\n", (int)out.len, out.p,
                (int)ref.len, ref.p);
        abort();
    }

    /* the HTTP path: the published text parsed for tool calls, whole and streamed, in the
     * tokenizer's syntax and in each XML-style one (text is text to every parser) */
    const char *T = out.p ? out.p : "";
    unsigned think = data[0] & 0x80 ? TC_THINK | (data[1] & 1 ? TC_THINK_OPEN : 0) : 0;
    rng = check_parse(syns[ti], think, xml_tools, T, out.len, ends, n_ends, rng);
    for (size_t k = 0; k < sizeof xml_syns / sizeof *xml_syns; k++)
        rng = check_parse(xml_syns[k], think, xml_tools, T, out.len, ends, n_ends, rng);
    if (think) /* a request without tools: only the reasoning is split off */
        rng = check_parse(syns[ti], think | TC_NO_CALLS, NULL, T, out.len, ends, n_ends, rng);

    ms_buf_free(&out);
    ms_buf_free(&pieces);
    ms_buf_free(&ref);
    stopstr_free(&f);
    free(ends);
    free(pend);
    free(ids);
    return 0;
}
