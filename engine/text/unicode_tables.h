/* Declarations of the generated Unicode tables in engine/text/unicode_tables.c (written by
 * tools/gen_unicode_tables.py). Only engine/text/unicode.c reads them; everything else goes through
 * the uni_ functions in unicode.h. All tables are sorted by their first field(s). */
#ifndef MOESERVE_UNICODE_TABLES_H
#define MOESERVE_UNICODE_TABLES_H

#include <stdint.h>

struct uni_gc_range {
    uint32_t first, last;
    uint8_t gc; /* enum uni_gc */
};
struct uni_ccc_entry {
    uint32_t cp;
    uint8_t ccc; /* canonical combining class, nonzero */
};
struct uni_decomp_entry {
    uint32_t cp;
    uint32_t a, b; /* one-level canonical decomposition; b == 0 for a singleton */
};
struct uni_comp_entry {
    uint32_t a, b; /* starter + following character ... */
    uint32_t cp;   /* ... compose to this primary composite */
};

extern const char uni_tables_version[]; /* the UCD version, "16.0.0" */
extern const struct uni_gc_range uni_gc_table[]; /* assigned code points only */
extern const int uni_gc_count;
extern const struct uni_ccc_entry uni_ccc_table[];
extern const int uni_ccc_count;
extern const struct uni_decomp_entry uni_decomp_table[];
extern const int uni_decomp_count;
extern const struct uni_comp_entry uni_comp_table[];
extern const int uni_comp_count;

#endif
