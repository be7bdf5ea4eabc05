/* UTF-8 and Unicode helpers for the tokenizer: strict UTF-8 decoding, lossy repair of invalid
 * input with the same policy as Python's errors="replace" and Rust's from_utf8_lossy (each
 * maximal invalid subsequence becomes one U+FFFD), the White_Space property, general
 * categories and the regex classes built from them, and NFC normalization, all from tables
 * generated out of the Unicode Character Database (tools/gen_unicode_tables.py, Unicode 16.0:
 * the version the `tokenizers` library matches against, newer than the system PCRE2's).
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

/* General categories, in the order of the generated table. */
enum uni_gc {
    UNI_LU, UNI_LL, UNI_LT, UNI_LM, UNI_LO, UNI_MN, UNI_MC, UNI_ME, UNI_ND, UNI_NL, UNI_NO,
    UNI_PC, UNI_PD, UNI_PS, UNI_PE, UNI_PI, UNI_PF, UNI_PO, UNI_SM, UNI_SC, UNI_SK, UNI_SO,
    UNI_ZS, UNI_ZL, UNI_ZP, UNI_CC, UNI_CF, UNI_CS, UNI_CO,
    UNI_CN, /* unassigned */
};

/* The Unicode version of the tables ("16.0.0"). */
const char *uni_version(void);
enum uni_gc uni_category(uint32_t cp);

/* The body of a PCRE2 character class (no brackets: "\x{41}-\x{5A}\x{61}-...") matching the
 * code points of property `prop` (a general category "Lu", or a group "L", "M", "N", "P", "S",
 * "Z", "C", "LC"/"L&"), or with `negate` those outside it (surrogates excepted: UTF mode has
 * none). Returns a malloc'd string the caller frees, NULL for an unknown property or out of
 * memory (*unknown tells which). */
char *uni_class_body(const char *prop, size_t n, bool negate, bool *unknown);

/* NFC of valid UTF-8 s[0..n) into a new NUL-terminated buffer; returns its length, or -1 when
 * out of memory. */
long uni_nfc(const char *s, size_t n, char **out);

#endif
