/* UTF-8 decoding and repair, White_Space, general categories and their regex classes, and NFC
 * normalization for the tokenizer (see unicode.h). NFC follows UAX #15: full canonical decomposition (Hangul algorithmically, the
 * rest from the generated tables), canonical ordering of combining marks, then canonical
 * composition with the blocking rule. Text made only of code points below U+0300 is already
 * NFC and is copied as is, which keeps the common ASCII case cheap. */
#include "unicode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unicode_tables.h"

#define HANGUL_S0 0xAC00u
#define HANGUL_L0 0x1100u
#define HANGUL_V0 0x1161u
#define HANGUL_T0 0x11A7u
#define HANGUL_LN 19u
#define HANGUL_VN 21u
#define HANGUL_TN 28u
#define HANGUL_SN (HANGUL_LN * HANGUL_VN * HANGUL_TN)
#define NFC_STABLE_BELOW 0x300u

int uni_utf8_next(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned char b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        return 1;
    }
    int need;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    uint32_t c;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 1;
        c = b0 & 0x1Fu;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2;
        c = b0 & 0x0Fu;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3;
        c = b0 & 0x07u;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0;
        unsigned char b = s[i];
        unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h) return -i;
        c = (c << 6) | (b & 0x3Fu);
    }
    *cp = c;
    return need + 1;
}

int uni_utf8_put(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

bool uni_utf8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int k = uni_utf8_next(u + i, n - i, &cp);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

long uni_utf8_repair(const char *s, size_t n, char **out)
{
    /* Each invalid byte grows to at most 3 bytes (U+FFFD). */
    char *buf = malloc(n * 3 + 1);
    if (!buf) return -1;
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, w = 0;
    while (i < n) {
        uint32_t cp;
        int k = uni_utf8_next(u + i, n - i, &cp);
        if (k > 0) {
            memcpy(buf + w, s + i, (size_t)k);
            w += (size_t)k;
            i += (size_t)k;
        } else {
            w += (size_t)uni_utf8_put(UNI_REPLACEMENT, buf + w);
            i += k == 0 ? n - i : (size_t)-k; /* a truncated character at the end is one error */
        }
    }
    buf[w] = '\0';
    *out = buf;
    return (long)w;
}

bool uni_is_whitespace(uint32_t cp)
{
    if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
    if (cp < 0x85) return false;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

static int ccc_of(uint32_t cp)
{
    if (cp < NFC_STABLE_BELOW) return 0;
    int lo = 0, hi = uni_ccc_count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (uni_ccc_table[mid].cp == cp) return uni_ccc_table[mid].ccc;
        if (uni_ccc_table[mid].cp < cp) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

static const struct uni_decomp_entry *decomp_of(uint32_t cp)
{
    int lo = 0, hi = uni_decomp_count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (uni_decomp_table[mid].cp == cp) return &uni_decomp_table[mid];
        if (uni_decomp_table[mid].cp < cp) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* Primary composite of a + b, or 0. */
static uint32_t compose_pair(uint32_t a, uint32_t b)
{
    if (a >= HANGUL_L0 && a < HANGUL_L0 + HANGUL_LN && b >= HANGUL_V0 && b < HANGUL_V0 + HANGUL_VN)
        return HANGUL_S0 + ((a - HANGUL_L0) * HANGUL_VN + (b - HANGUL_V0)) * HANGUL_TN;
    if (a >= HANGUL_S0 && a < HANGUL_S0 + HANGUL_SN && (a - HANGUL_S0) % HANGUL_TN == 0 &&
        b > HANGUL_T0 && b < HANGUL_T0 + HANGUL_TN)
        return a + (b - HANGUL_T0);
    int lo = 0, hi = uni_comp_count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        const struct uni_comp_entry *e = &uni_comp_table[mid];
        if (e->a == a && e->b == b) return e->cp;
        if (e->a < a || (e->a == a && e->b < b)) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

/* Appends the full canonical decomposition of cp to d (room is checked by the caller: a
 * canonical decomposition is at most 4 code points long). */
static size_t decompose(uint32_t cp, uint32_t *d, size_t w)
{
    if (cp >= HANGUL_S0 && cp < HANGUL_S0 + HANGUL_SN) {
        uint32_t s = cp - HANGUL_S0;
        d[w++] = HANGUL_L0 + s / (HANGUL_VN * HANGUL_TN);
        d[w++] = HANGUL_V0 + (s % (HANGUL_VN * HANGUL_TN)) / HANGUL_TN;
        if (s % HANGUL_TN) d[w++] = HANGUL_T0 + s % HANGUL_TN;
        return w;
    }
    const struct uni_decomp_entry *e = cp >= 0xC0 ? decomp_of(cp) : NULL;
    if (!e) {
        d[w++] = cp;
        return w;
    }
    w = decompose(e->a, d, w);
    if (e->b) w = decompose(e->b, d, w);
    return w;
}

long uni_nfc(const char *s, size_t n, char **out)
{
    const unsigned char *u = (const unsigned char *)s;
    bool stable = true;
    for (size_t i = 0; i < n && stable; i++)
        if (u[i] >= 0xCC) stable = false; /* lead bytes of U+0300 and above */
    if (stable) {
        char *buf = malloc(n + 1);
        if (!buf) return -1;
        memcpy(buf, s, n);
        buf[n] = '\0';
        *out = buf;
        return (long)n;
    }
    /* A canonical decomposition is at most 4 code points per character, so 4 per byte. */
    uint32_t *d = malloc((n * 4 + 4) * sizeof *d);
    if (!d) return -1;
    size_t nd = 0, i = 0;
    while (i < n) {
        uint32_t cp;
        int k = uni_utf8_next(u + i, n - i, &cp);
        if (k <= 0) { /* callers pass valid UTF-8; be safe anyway */
            cp = UNI_REPLACEMENT;
            k = k == 0 ? (int)(n - i) : -k;
        }
        i += (size_t)k;
        nd = decompose(cp, d, nd);
    }
    /* Canonical ordering: stable insertion sort of each run of non-starters by class. */
    for (size_t a = 1; a < nd; a++) {
        int ca = ccc_of(d[a]);
        if (ca == 0) continue;
        size_t b = a;
        uint32_t x = d[a];
        while (b > 0) {
            int cb = ccc_of(d[b - 1]);
            if (cb <= ca) break;
            d[b] = d[b - 1];
            b--;
        }
        d[b] = x;
    }
    /* Canonical composition. */
    size_t nc = 0;
    if (nd > 0) {
        size_t starter = 0;
        bool has_starter = ccc_of(d[0]) == 0;
        int last = 0; /* class of the last character kept after the starter, 0 if adjacent */
        nc = 1;
        for (size_t a = 1; a < nd; a++) {
            uint32_t ch = d[a];
            int cc = ccc_of(ch);
            if (has_starter && (last < cc || last == 0)) {
                uint32_t comp = compose_pair(d[starter], ch);
                if (comp) {
                    d[starter] = comp;
                    continue;
                }
            }
            if (cc == 0) {
                starter = nc;
                has_starter = true;
            }
            last = cc;
            d[nc++] = ch;
        }
    }
    char *buf = malloc(nc * 4 + 1);
    if (!buf) {
        free(d);
        return -1;
    }
    size_t w = 0;
    for (size_t a = 0; a < nc; a++) w += (size_t)uni_utf8_put(d[a], buf + w);
    buf[w] = '\0';
    free(d);
    *out = buf;
    return (long)w;
}

/* ---- general categories -------------------------------------------------------------- */

const char *uni_version(void)
{
    return uni_tables_version;
}

enum uni_gc uni_category(uint32_t cp)
{
    int lo = 0, hi = uni_gc_count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < uni_gc_table[mid].first) hi = mid - 1;
        else if (cp > uni_gc_table[mid].last) lo = mid + 1;
        else return (enum uni_gc)uni_gc_table[mid].gc;
    }
    return UNI_CN;
}

/* Bit mask of the categories a property names; 0 when unknown. */
static uint32_t prop_mask(const char *p, size_t n)
{
    static const char names[] = "LuLlLtLmLoMnMcMeNdNlNoPcPdPsPePiPfPoSmScSkSoZsZlZpCcCfCsCo";
    if (n == 2 && (memcmp(p, "LC", 2) == 0 || memcmp(p, "L&", 2) == 0))
        return 1u << UNI_LU | 1u << UNI_LL | 1u << UNI_LT;
    if (n == 2) {
        for (int k = 0; k < UNI_CN; k++)
            if (memcmp(names + 2 * k, p, 2) == 0) return 1u << k;
        return memcmp(p, "Cn", 2) == 0 ? 1u << UNI_CN : 0;
    }
    if (n != 1) return 0;
    uint32_t m = 0;
    for (int k = 0; k < UNI_CN; k++)
        if (names[2 * k] == p[0]) m |= 1u << k;
    if (p[0] == 'C') m |= 1u << UNI_CN;
    return m;
}

struct sbuf {
    char *p;
    size_t len, cap;
    bool failed;
};

static void sbuf_range(struct sbuf *b, uint32_t a, uint32_t z)
{
    if (b->failed) return;
    if (b->len + 32 > b->cap) {
        size_t c = b->cap ? b->cap * 2 : 1024;
        char *q = realloc(b->p, c);
        if (!q) {
            b->failed = true;
            return;
        }
        b->p = q;
        b->cap = c;
    }
    int w = a == z ? snprintf(b->p + b->len, b->cap - b->len, "\\x{%X}", a)
                   : snprintf(b->p + b->len, b->cap - b->len, "\\x{%X}-\\x{%X}", a, z);
    b->len += (size_t)w;
}

/* Adds [a, z] minus the surrogates. */
static void sbuf_range_utf(struct sbuf *b, uint32_t a, uint32_t z)
{
    if (a <= 0xDFFF && z >= 0xD800) {
        if (a < 0xD800) sbuf_range(b, a, 0xD7FF);
        if (z > 0xDFFF) sbuf_range(b, 0xE000, z);
        return;
    }
    sbuf_range(b, a, z);
}

char *uni_class_body(const char *prop, size_t n, bool negate, bool *unknown)
{
    uint32_t mask = prop_mask(prop, n);
    *unknown = mask == 0;
    if (!mask) return NULL;
    if (negate) mask = ~mask & ((2u << UNI_CN) - 1);
    struct sbuf b = {0};
    /* Walk the assigned ranges; the gaps between them are Cn. */
    uint32_t run_a = 0, next = 0;
    bool in_run = false;
    for (int i = 0; i <= uni_gc_count; i++) {
        uint32_t first = i < uni_gc_count ? uni_gc_table[i].first : 0x110000;
        if (first > next) { /* unassigned gap [next, first) */
            bool on = mask >> UNI_CN & 1;
            if (on && !in_run) run_a = next;
            if (!on && in_run) sbuf_range_utf(&b, run_a, next - 1);
            in_run = on;
        }
        if (i == uni_gc_count) break;
        bool on = mask >> uni_gc_table[i].gc & 1;
        if (on && !in_run) run_a = first;
        if (!on && in_run) sbuf_range_utf(&b, run_a, first - 1);
        in_run = on;
        next = uni_gc_table[i].last + 1;
    }
    if (in_run) sbuf_range_utf(&b, run_a, 0x10FFFF);
    if (b.failed || !b.p) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
