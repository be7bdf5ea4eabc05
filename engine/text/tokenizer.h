/* Tokenizer: Hugging Face `tokenizer.json` BPE models, byte-level (Qwen, DeepSeek, OLMoE,
 * GPT-OSS: regex pre-tokenizers through PCRE2) and SentencePiece-style (Llama/Mixtral:
 * Prepend/Replace normalizer, byte fallback), with added/special tokens and NFC where the file
 * declares it. Encoding must give the same ids as the `tokenizers` library.
 *
 * Ownership: tok_load returns a tokenizer the caller frees with tok_free; it owns copies of
 * everything it needs (the JSON document is not kept). A tokenizer is immutable after loading
 * and may be used from several threads at once. A tok_stream is small caller-owned state for
 * streaming decode of one sequence. */
#ifndef MOESERVE_TOKENIZER_H
#define MOESERVE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tokenizer;

/* Loads `tokenizer_json`; `tokenizer_config_json` may be NULL or a missing file (then BOS/EOS
 * come from tokenizer.json alone). On failure returns -1 with a reason naming the file. */
int tok_load(const char *tokenizer_json, const char *tokenizer_config_json,
             struct tokenizer **out, char *err, size_t errlen);
void tok_free(struct tokenizer *tok);

/* Encodes `len` bytes of UTF-8 `text` (invalid UTF-8 is handled as the `tokenizers` library
 * handles it after lossy decoding: each bad byte becomes U+FFFD). Added/special tokens that
 * appear literally in the text are matched as tokens. With `add_special`, the post-processor's
 * tokens (e.g. Llama's BOS) are added as `tokenizers` does with add_special_tokens=True.
 * Writes at most `cap` ids and returns the total number of ids (which may exceed cap: call
 * again with a larger buffer), or -1 on an internal error. */
int tok_encode(const struct tokenizer *tok, const char *text, size_t len, bool add_special,
               int32_t *ids, int cap);

/* Decodes ids to UTF-8 as `tokenizers`' decode does (skip_special: drop special added tokens).
 * Writes at most cap-1 bytes plus a NUL; returns the full length, or -1 for an id out of range. */
long tok_decode(const struct tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                char *out, size_t cap);

/* Streaming decode for one sequence: push ids one at a time and get back only text that is
 * complete, valid UTF-8 (bytes of a character split across tokens are held until it is whole).
 * The concatenation of all pushes plus the final flush equals tok_decode of all ids. */
struct tok_stream {
    int32_t prev[8];   /* recent ids kept for decoders that depend on context */
    int n_prev;
    unsigned char pending[16]; /* bytes of an incomplete UTF-8 character */
    int n_pending;
    bool started;      /* SentencePiece: the leading space of the first token is stripped */
    bool skip_special;
};
void tok_stream_init(struct tok_stream *s, bool skip_special);
/* Returns the number of bytes written to out (NUL-terminated, cap >= 64 suffices for one
 * token in practice; returns -1 if cap is too small or the id is out of range). */
int tok_stream_push(const struct tokenizer *tok, struct tok_stream *s, int32_t id, char *out,
                    size_t cap);
/* Emits what is left (an incomplete character becomes U+FFFD, as a full decode would). */
int tok_stream_flush(const struct tokenizer *tok, struct tok_stream *s, char *out, size_t cap);

/* The bytes token `id` stands for on its own, as a piece of a longer text: byte-level tokens
 * give their raw bytes (possibly part of a UTF-8 character), SentencePiece pieces their text
 * with the word marker as a space (no start-of-text stripping) and byte-fallback tokens their
 * byte, added tokens their content. So the pieces of a sequence concatenate to its text.
 * Writes at most cap-1 bytes plus a NUL; returns the length, or -1 (bad id or cap too small). */
int tok_token_bytes(const struct tokenizer *tok, int32_t id, char *out, size_t cap);

/* Whether decoding drops one leading space of the first token (SentencePiece's Strip step):
 * the text of a sequence is then its pieces joined, less that space. */
bool tok_decode_strips_first_space(const struct tokenizer *tok);

int tok_vocab_size(const struct tokenizer *tok);       /* ids are 0..size-1, added tokens included */
int32_t tok_bos_id(const struct tokenizer *tok);       /* -1 when none */
int32_t tok_eos_id(const struct tokenizer *tok);       /* -1 when none */
int32_t tok_token_id(const struct tokenizer *tok, const char *token); /* exact vocab/added lookup, -1 */
const char *tok_token_str(const struct tokenizer *tok, int32_t id);    /* raw vocab string, NULL */
bool tok_is_special(const struct tokenizer *tok, int32_t id);

#endif
