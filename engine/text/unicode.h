/* UTF-8 and Unicode helpers for the tokenizer: strict UTF-8 decoding, lossy repair of invalid
 * input with the same policy as Python's errors="replace" and Rust's from_utf8_lossy (each
 * maximal invalid subsequence becomes one U+FFFD), the White_Space property, and NFC
 * normalization from tables generated out of Python's unicodedata.
 *
 * Ownership: functions that return a new buffer allocate it with malloc and the caller frees
 * it; on allocation failure they return -1 and leave *out untouched. */
#ifndef MOESERVE_UNICODE_H
#define MOESERVE_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define UNI_REPLACEMENT 0xFFFDu

/* Length of the valid UTF-8 character at s[0..n) (1..4) with its code point in *cp; 0 if the
 * bytes are a valid but incomplete prefix of a character (only possible when n < 4); -k if the
 * first k bytes are a maximal invalid subsequence (to be replaced by one U+FFFD). n >= 1. */
int uni_utf8_next(const unsigned char *s, size_t n, uint32_t *cp);

/* Encodes cp as UTF-8 into out (4 bytes of room); returns the byte count. */
int uni_utf8_put(uint32_t cp, char *out);

/* True when s[0..n) is entirely valid UTF-8. */
bool uni_utf8_valid(const char *s, size_t n);

/* Copies s[0..n) into a new NUL-terminated buffer with invalid sequences replaced by U+FFFD.
 * Returns the new length, or -1 when out of memory. */
long uni_utf8_repair(const char *s, size_t n, char **out);

/* Unicode White_Space (what Rust's char::is_whitespace tests). */
bool uni_is_whitespace(uint32_t cp);

/* NFC of valid UTF-8 s[0..n) into a new NUL-terminated buffer; returns its length, or -1 when
 * out of memory. */
long uni_nfc(const char *s, size_t n, char **out);

#endif
