/* Routing trace writer and reader (format in route_trace.h). Fields are packed byte by byte in
 * little-endian order, so files are the same on every host; each record carries a CRC-32 so a
 * reader can tell a corrupt record from a truncated one and say where. */
#include "route_trace.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "route_stats.h"

#define HDR_FIXED 112
#define REC_HDR 12
#define TOKEN_BYTES 8 /* i32 token, u16 tag, u16 reserved */

/* --- CRC-32 -------------------------------------------------------------------------------- */

static uint32_t crc_table[256];
static int crc_ready;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
    crc_ready = 1;
}

uint32_t rtrace_crc32(uint32_t crc, const void *data, size_t n)
{
    /* Benign if two threads fill the table at once: both write the same values. */
    if (!crc_ready) crc_init();
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* --- little-endian packing ----------------------------------------------------------------- */

static void put16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint16_t get16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const unsigned char *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

static size_t header_bytes(int n_expert, int n_layer)
{
    return HDR_FIXED + 8 * (size_t)n_expert + 4 * (size_t)n_layer + 4;
}

/* Payload bytes of a step of n tokens. */
static size_t step_bytes(int n_layer, int top_k, unsigned flags, int n)
{
    size_t cells = (size_t)n_layer * (size_t)n * (size_t)top_k;
    return 16 + (size_t)n * TOKEN_BYTES + (flags & RTRACE_F_LOSS ? 4 * (size_t)n : 0) + 2 * cells +
           (flags & RTRACE_F_WEIGHTS ? 2 * cells : 0);
}

/* --- writer -------------------------------------------------------------------------------- */

struct tag_def {
    int id;
    char name[128];
};

struct rtrace_writer {
    char *path;
    FILE *f;
    struct rtrace_info info;
    int *arrays;            /* widths, groups, layer indices (info points here) */
    unsigned char *hdr;     /* the header as written */
    size_t hdr_len;
    unsigned char *rec;     /* one step record, sized for max_tokens */
    size_t rec_cap;
    int max_tokens;
    uint64_t max_bytes, file_bytes, total_bytes, steps;
    int rotations;
    struct tag_def *tags;
    int n_tags, cap_tags;
};

static int wr(struct rtrace_writer *w, const void *p, size_t n, char *err, size_t errlen)
{
    if (fwrite(p, 1, n, w->f) != n)
        return ms_errf(err, errlen, "%s: write failed: %s", w->path, strerror(errno));
    w->file_bytes += n;
    w->total_bytes += n;
    return 0;
}

static int write_tag_record(struct rtrace_writer *w, const struct tag_def *t, char *err,
                            size_t errlen)
{
    unsigned char buf[REC_HDR + 4 + sizeof t->name];
    size_t len = strlen(t->name);
    put32(buf, RTRACE_REC_TAG);
    put32(buf + 4, (uint32_t)(4 + len));
    put16(buf + REC_HDR, (uint16_t)t->id);
    put16(buf + REC_HDR + 2, (uint16_t)len);
    memcpy(buf + REC_HDR + 4, t->name, len);
    put32(buf + 8, rtrace_crc32(0, buf + REC_HDR, 4 + len));
    return wr(w, buf, REC_HDR + 4 + len, err, errlen);
}

/* Header and tag declarations at the top of a (new) file. */
static int start_file(struct rtrace_writer *w, char *err, size_t errlen)
{
    w->f = fopen(w->path, "wb");
    if (!w->f) return ms_errf(err, errlen, "%s: cannot create: %s", w->path, strerror(errno));
    w->file_bytes = 0;
    if (wr(w, w->hdr, w->hdr_len, err, errlen) != 0) return -1;
    for (int i = 0; i < w->n_tags; i++)
        if (write_tag_record(w, &w->tags[i], err, errlen) != 0) return -1;
    return 0;
}

static int rotate(struct rtrace_writer *w, char *err, size_t errlen)
{
    if (fclose(w->f) != 0) {
        w->f = NULL;
        return ms_errf(err, errlen, "%s: close failed: %s", w->path, strerror(errno));
    }
    w->f = NULL;
    size_t n = strlen(w->path) + 3;
    char *old = malloc(n);
    if (!old) return ms_errf(err, errlen, "out of memory");
    snprintf(old, n, "%s.1", w->path);
    int rc = rename(w->path, old);
    free(old);
    if (rc != 0)
        return ms_errf(err, errlen, "%s: cannot rotate to %s.1: %s", w->path, w->path,
                       strerror(errno));
    w->rotations++;
    return start_file(w, err, errlen);
}

static void writer_free(struct rtrace_writer *w)
{
    if (!w) return;
    if (w->f) fclose(w->f);
    free(w->path);
    free(w->arrays);
    free(w->hdr);
    free(w->rec);
    free(w->tags);
    free(w);
}

int rtrace_writer_open(const char *path, const struct rtrace_info *info, uint64_t max_bytes,
                       int max_tokens, struct rtrace_writer **out, char *err, size_t errlen)
{
    *out = NULL;
    if (info->n_layer < 1 || info->n_expert < 1 || info->n_expert > RTRACE_MAX_EXPERTS ||
        info->top_k < 1 || info->top_k > info->n_expert || max_tokens < 1)
        return ms_errf(err, errlen,
                       "%s: a trace needs MoE layers, 1..%d experts and 1 <= top_k <= experts "
                       "(got %d layers, %d experts, top_k %d)",
                       path, RTRACE_MAX_EXPERTS, info->n_layer, info->n_expert, info->top_k);
    struct rtrace_writer *w = calloc(1, sizeof *w);
    if (!w) return ms_errf(err, errlen, "out of memory");
    int E = info->n_expert, L = info->n_layer;
    w->path = strdup(path);
    w->arrays = malloc(sizeof(int) * (2 * (size_t)E + (size_t)L));
    w->hdr_len = header_bytes(E, L);
    w->hdr = calloc(1, w->hdr_len);
    w->rec_cap = REC_HDR + step_bytes(L, info->top_k, info->flags, max_tokens);
    w->rec = malloc(w->rec_cap);
    if (!w->path || !w->arrays || !w->hdr || !w->rec) {
        writer_free(w);
        return ms_errf(err, errlen, "out of memory for a trace writer of %d tokens a step",
                       max_tokens);
    }
    w->info = *info;
    w->max_tokens = max_tokens;
    w->max_bytes = max_bytes;
    int *width = w->arrays, *group = w->arrays + E, *lidx = w->arrays + 2 * E;
    for (int x = 0; x < E; x++) {
        width[x] = info->expert_width ? info->expert_width[x] : 0;
        group[x] = info->expert_group ? info->expert_group[x] : 0;
    }
    for (int l = 0; l < L; l++) lidx[l] = info->layer_index ? info->layer_index[l] : l;
    w->info.expert_width = width;
    w->info.expert_group = group;
    w->info.layer_index = lidx;

    unsigned char *h = w->hdr;
    memcpy(h, RTRACE_MAGIC, 8);
    put32(h + 8, RTRACE_VERSION);
    put32(h + 12, (uint32_t)w->hdr_len);
    put32(h + 16, (uint32_t)L);
    put32(h + 20, (uint32_t)E);
    put32(h + 24, (uint32_t)info->top_k);
    put32(h + 28, (uint32_t)info->d_model);
    put32(h + 32, (uint32_t)info->n_group);
    put32(h + 36, info->flags);
    put32(h + 40, (uint32_t)(info->model_n_layer > 0 ? info->model_n_layer : L));
    put32(h + 44, 0);
    size_t nl = strnlen(info->model, sizeof info->model);
    memcpy(h + 48, info->model, nl < 63 ? nl : 63);
    unsigned char *p = h + HDR_FIXED;
    for (int x = 0; x < E; x++, p += 4) put32(p, (uint32_t)width[x]);
    for (int x = 0; x < E; x++, p += 4) put32(p, (uint32_t)group[x]);
    for (int l = 0; l < L; l++, p += 4) put32(p, (uint32_t)lidx[l]);
    put32(p, rtrace_crc32(0, h, w->hdr_len - 4));

    if (start_file(w, err, errlen) != 0) {
        writer_free(w);
        return -1;
    }
    *out = w;
    return 0;
}

int rtrace_writer_tag(struct rtrace_writer *w, int id, const char *name, char *err,
                      size_t errlen)
{
    if (id < 0 || id >= RTRACE_MAX_TAGS)
        return ms_errf(err, errlen, "trace tag %d out of range [0, %d)", id, RTRACE_MAX_TAGS);
    if (w->n_tags == w->cap_tags) {
        int cap = w->cap_tags ? 2 * w->cap_tags : 8;
        struct tag_def *t = realloc(w->tags, sizeof *t * (size_t)cap);
        if (!t) return ms_errf(err, errlen, "out of memory");
        w->tags = t;
        w->cap_tags = cap;
    }
    struct tag_def *t = &w->tags[w->n_tags++];
    t->id = id;
    snprintf(t->name, sizeof t->name, "%s", name);
    return write_tag_record(w, t, err, errlen);
}

int rtrace_write_step(struct rtrace_writer *w, const struct rtrace_step *s, char *err,
                      size_t errlen)
{
    const struct rtrace_info *in = &w->info;
    int L = in->n_layer, K = in->top_k, E = in->n_expert, n = s->n_tok;
    if (n < 0 || n > w->max_tokens)
        return ms_errf(err, errlen, "%s: step of %d tokens, the writer takes at most %d", w->path,
                       n, w->max_tokens);
    size_t stride = s->layer_stride ? s->layer_stride : (size_t)n * K;
    size_t payload = step_bytes(L, K, in->flags, n);
    unsigned char *r = w->rec, *p = r + REC_HDR;
    put32(r, RTRACE_REC_STEP);
    put32(r + 4, (uint32_t)payload);
    put64(p, s->step);
    put32(p + 8, (uint32_t)n);
    put32(p + 12, 0);
    p += 16;
    for (int t = 0; t < n; t++, p += TOKEN_BYTES) {
        put32(p, (uint32_t)(s->tokens ? s->tokens[t] : -1));
        put16(p + 4, s->tags ? s->tags[t] : 0);
        put16(p + 6, 0);
    }
    if (in->flags & RTRACE_F_LOSS) {
        for (int t = 0; t < n; t++, p += 4) {
            float v = s->loss ? s->loss[t] : NAN;
            uint32_t u;
            memcpy(&u, &v, 4);
            put32(p, u);
        }
    }
    for (int l = 0; l < L; l++)
        for (size_t c = 0; c < (size_t)n * K; c++, p += 2) {
            int32_t x = s->ids[(size_t)l * stride + c];
            if (x >= E) return ms_errf(err, errlen, "%s: expert id %d >= %d", w->path, x, E);
            put16(p, x < 0 ? (uint16_t)RTRACE_NO_EXPERT : (uint16_t)x);
        }
    if (in->flags & RTRACE_F_WEIGHTS)
        for (int l = 0; l < L; l++)
            for (size_t c = 0; c < (size_t)n * K; c++, p += 2)
                put16(p, ms_f32_to_f16(s->weights ? s->weights[(size_t)l * stride + c] : 0.0f));
    put32(r + 8, rtrace_crc32(0, r + REC_HDR, payload));
    if (w->max_bytes && w->file_bytes > w->hdr_len &&
        w->file_bytes + REC_HDR + payload > w->max_bytes && rotate(w, err, errlen) != 0)
        return -1;
    if (wr(w, r, REC_HDR + payload, err, errlen) != 0) return -1;
    w->steps++;
    return 0;
}

void rtrace_writer_counts(const struct rtrace_writer *w, uint64_t *steps, uint64_t *bytes,
                          int *rotations)
{
    if (steps) *steps = w->steps;
    if (bytes) *bytes = w->total_bytes;
    if (rotations) *rotations = w->rotations;
}

int rtrace_writer_close(struct rtrace_writer *w, char *err, size_t errlen)
{
    if (!w) return 0;
    int rc = 0;
    if (w->f) {
        if (fclose(w->f) != 0) rc = ms_errf(err, errlen, "%s: close failed: %s", w->path,
                                            strerror(errno));
        w->f = NULL;
    }
    writer_free(w);
    return rc;
}

/* --- reader -------------------------------------------------------------------------------- */

struct rtrace_reader {
    char *path;
    FILE *f;
    long long off;          /* byte offset of the next record */
    long long data_start;   /* offset of the first record */
    long long size;         /* the file's size at open */
    struct rtrace_info info;
    int *arrays;
    unsigned char *buf;     /* the current record's payload */
    size_t buf_cap;
    /* decoded step (grown as needed) */
    int cap_tok;
    int32_t *tokens;
    uint16_t *tags;
    float *loss;
    int32_t *ids;
    float *weights;
    char **tag_names;       /* (RTRACE_MAX_TAGS) lazily allocated */
};

static int rd_err(const struct rtrace_reader *r, long long off, char *err, size_t errlen,
                  const char *what)
{
    return ms_errf(err, errlen, "%s: offset %lld: %s", r->path, off, what);
}

/* Reads exactly n bytes at the current position; -1 when the file ends first. */
static int rd(struct rtrace_reader *r, void *p, size_t n)
{
    return fread(p, 1, n, r->f) == n ? 0 : -1;
}

int rtrace_open(const char *path, struct rtrace_reader **out, char *err, size_t errlen)
{
    *out = NULL;
    struct rtrace_reader *r = calloc(1, sizeof *r);
    if (!r) return ms_errf(err, errlen, "out of memory");
    r->path = strdup(path);
    if (!r->path) {
        free(r);
        return ms_errf(err, errlen, "out of memory");
    }
    unsigned char fixed[HDR_FIXED];
    unsigned char *h = NULL;
    r->f = fopen(path, "rb");
    if (!r->f) {
        ms_errf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    if (fseek(r->f, 0, SEEK_END) != 0 || (r->size = ftell(r->f)) < 0 ||
        fseek(r->f, 0, SEEK_SET) != 0) {
        ms_errf(err, errlen, "%s: cannot seek: %s", path, strerror(errno));
        goto fail;
    }
    if (rd(r, fixed, HDR_FIXED) != 0) {
        rd_err(r, 0, err, errlen, "truncated header (not a routing trace?)");
        goto fail;
    }
    if (memcmp(fixed, RTRACE_MAGIC, 8) != 0) {
        rd_err(r, 0, err, errlen, "not a routing trace (bad magic)");
        goto fail;
    }
    if (get32(fixed + 8) != RTRACE_VERSION) {
        ms_errf(err, errlen, "%s: offset 8: trace version %u, this build reads %d", path,
                get32(fixed + 8), RTRACE_VERSION);
        goto fail;
    }
    uint32_t L = get32(fixed + 16), E = get32(fixed + 20), K = get32(fixed + 24);
    uint32_t hb = get32(fixed + 12);
    if (L < 1 || L > 100000 || E < 1 || E > RTRACE_MAX_EXPERTS || K < 1 || K > E ||
        hb != header_bytes((int)E, (int)L)) {
        rd_err(r, 12, err, errlen, "corrupt header (layer, expert or top-k counts)");
        goto fail;
    }
    h = malloc(hb);
    r->arrays = malloc(sizeof(int) * (2 * (size_t)E + L));
    if (!h || !r->arrays) {
        ms_errf(err, errlen, "out of memory");
        goto fail;
    }
    memcpy(h, fixed, HDR_FIXED);
    if (rd(r, h + HDR_FIXED, hb - HDR_FIXED) != 0) {
        rd_err(r, HDR_FIXED, err, errlen, "truncated header");
        goto fail;
    }
    if (get32(h + hb - 4) != rtrace_crc32(0, h, hb - 4)) {
        rd_err(r, (long long)hb - 4, err, errlen, "header CRC mismatch (corrupt header)");
        goto fail;
    }
    struct rtrace_info *in = &r->info;
    in->n_layer = (int)L;
    in->n_expert = (int)E;
    in->top_k = (int)K;
    in->d_model = (int)get32(h + 28);
    in->n_group = (int)get32(h + 32);
    in->flags = get32(h + 36);
    in->model_n_layer = (int)get32(h + 40);
    memcpy(in->model, h + 48, 63);
    in->model[63] = '\0';
    int *a = r->arrays;
    const unsigned char *p = h + HDR_FIXED;
    for (size_t i = 0; i < 2 * (size_t)E + L; i++, p += 4) a[i] = (int)get32(p);
    in->expert_width = a;
    in->expert_group = a + E;
    in->layer_index = a + 2 * E;
    free(h);
    r->off = r->data_start = hb;
    *out = r;
    return 0;
fail:
    free(h);
    rtrace_close(r);
    return -1;
}

const struct rtrace_info *rtrace_get_info(const struct rtrace_reader *r)
{
    return &r->info;
}

static int grow_step(struct rtrace_reader *r, int n)
{
    if (n <= r->cap_tok) return 0;
    size_t cells = (size_t)r->info.n_layer * (size_t)n * (size_t)r->info.top_k;
    int32_t *tokens = realloc(r->tokens, sizeof *tokens * (size_t)n);
    if (tokens) r->tokens = tokens;
    uint16_t *tags = realloc(r->tags, sizeof *tags * (size_t)n);
    if (tags) r->tags = tags;
    float *loss = realloc(r->loss, sizeof *loss * (size_t)n);
    if (loss) r->loss = loss;
    int32_t *ids = realloc(r->ids, sizeof *ids * cells);
    if (ids) r->ids = ids;
    float *wts = realloc(r->weights, sizeof *wts * cells);
    if (wts) r->weights = wts;
    if (!tokens || !tags || !loss || !ids || !wts) return -1;
    r->cap_tok = n;
    return 0;
}

static int decode_tag(struct rtrace_reader *r, const unsigned char *p, uint32_t len,
                      long long off, char *err, size_t errlen)
{
    if (len < 4 || get16(p + 2) != len - 4) return rd_err(r, off, err, errlen, "bad tag record");
    if (!r->tag_names) {
        r->tag_names = calloc(RTRACE_MAX_TAGS, sizeof *r->tag_names);
        if (!r->tag_names) return ms_errf(err, errlen, "out of memory");
    }
    int id = get16(p);
    char *name = malloc(len - 3);
    if (!name) return ms_errf(err, errlen, "out of memory");
    memcpy(name, p + 4, len - 4);
    name[len - 4] = '\0';
    free(r->tag_names[id]);
    r->tag_names[id] = name;
    return 0;
}

static int decode_step(struct rtrace_reader *r, const unsigned char *p, uint32_t len,
                       long long off, struct rtrace_step *s, char *err, size_t errlen)
{
    const struct rtrace_info *in = &r->info;
    if (len < 16) return rd_err(r, off, err, errlen, "step record too short");
    uint32_t n = get32(p + 8);
    if (n > (1u << 24) || step_bytes(in->n_layer, in->top_k, in->flags, (int)n) != len)
        return rd_err(r, off, err, errlen, "step record size does not match its token count");
    if (grow_step(r, (int)n) != 0) return ms_errf(err, errlen, "out of memory");
    memset(s, 0, sizeof *s);
    s->step = get64(p);
    s->n_tok = (int)n;
    p += 16;
    for (uint32_t t = 0; t < n; t++, p += TOKEN_BYTES) {
        r->tokens[t] = (int32_t)get32(p);
        r->tags[t] = get16(p + 4);
    }
    s->tokens = r->tokens;
    s->tags = r->tags;
    if (in->flags & RTRACE_F_LOSS) {
        for (uint32_t t = 0; t < n; t++, p += 4) {
            uint32_t u = get32(p);
            memcpy(&r->loss[t], &u, 4);
        }
        s->loss = r->loss;
    }
    size_t cells = (size_t)in->n_layer * n * (size_t)in->top_k;
    for (size_t c = 0; c < cells; c++, p += 2) {
        uint16_t x = get16(p);
        if (x != RTRACE_NO_EXPERT && x >= in->n_expert)
            return rd_err(r, off, err, errlen, "expert id out of range in a step record");
        r->ids[c] = x == RTRACE_NO_EXPERT ? -1 : x;
    }
    s->ids = r->ids;
    if (in->flags & RTRACE_F_WEIGHTS) {
        for (size_t c = 0; c < cells; c++, p += 2) r->weights[c] = ms_f16_to_f32(get16(p));
        s->weights = r->weights;
    }
    s->layer_stride = (size_t)n * (size_t)in->top_k;
    return 0;
}

int rtrace_next(struct rtrace_reader *r, struct rtrace_step *s, char *err, size_t errlen)
{
    for (;;) {
        unsigned char rh[REC_HDR];
        size_t got = fread(rh, 1, REC_HDR, r->f);
        if (got == 0 && feof(r->f)) return 0;
        if (got != REC_HDR) return rd_err(r, r->off, err, errlen, "truncated record header");
        uint32_t type = get32(rh), len = get32(rh + 4), crc = get32(rh + 8);
        /* A step is at most 2^24 tokens; anything bigger is a broken length, not a record. */
        size_t limit = REC_HDR + step_bytes(r->info.n_layer, r->info.top_k, r->info.flags,
                                            1 << 24);
        if (len > limit) return rd_err(r, r->off, err, errlen, "record length out of range");
        if (r->off + REC_HDR + (long long)len > r->size)
            return rd_err(r, r->off, err, errlen, "truncated record (file ends inside it)");
        if (len > r->buf_cap) {
            unsigned char *b = realloc(r->buf, len);
            if (!b) return ms_errf(err, errlen, "out of memory for a %u-byte record", len);
            r->buf = b;
            r->buf_cap = len;
        }
        if (len && fread(r->buf, 1, len, r->f) != len)
            return rd_err(r, r->off, err, errlen, "truncated record (file ends inside it)");
        if (rtrace_crc32(0, r->buf, len) != crc)
            return rd_err(r, r->off, err, errlen, "record CRC mismatch (corrupt data)");
        long long off = r->off;
        r->off += REC_HDR + (long long)len;
        if (type == RTRACE_REC_TAG) {
            if (decode_tag(r, r->buf, len, off, err, errlen) != 0) return -1;
        } else if (type == RTRACE_REC_STEP) {
            return decode_step(r, r->buf, len, off, s, err, errlen) == 0 ? 1 : -1;
        }
    }
}

int rtrace_rewind(struct rtrace_reader *r, char *err, size_t errlen)
{
    if (fseek(r->f, (long)r->data_start, SEEK_SET) != 0)
        return ms_errf(err, errlen, "%s: cannot seek: %s", r->path, strerror(errno));
    r->off = r->data_start;
    return 0;
}

const char *rtrace_tag_name(const struct rtrace_reader *r, int tag)
{
    if (!r->tag_names || tag < 0 || tag >= RTRACE_MAX_TAGS) return NULL;
    return r->tag_names[tag];
}

void rtrace_close(struct rtrace_reader *r)
{
    if (!r) return;
    if (r->f) fclose(r->f);
    if (r->tag_names)
        for (int i = 0; i < RTRACE_MAX_TAGS; i++) free(r->tag_names[i]);
    free(r->tag_names);
    free(r->path);
    free(r->arrays);
    free(r->buf);
    free(r->tokens);
    free(r->tags);
    free(r->loss);
    free(r->ids);
    free(r->weights);
    free(r);
}

int rtrace_add_to_stats(const char *path, struct rstats *s, int parity, uint64_t *tokens,
                        char *err, size_t errlen)
{
    struct rtrace_reader *r = NULL;
    if (rtrace_open(path, &r, err, errlen) != 0) return -1;
    const struct rtrace_info *in = rtrace_get_info(r);
    const struct rstats_config *c = rstats_get_config(s);
    if (in->n_layer != c->n_layer || in->n_expert != c->n_expert || in->top_k != c->top_k) {
        ms_errf(err, errlen, "%s: recorded from a model with %d experts (top-%d) in %d MoE "
                             "layers; this one has %d (top-%d) in %d",
                path, in->n_expert, in->top_k, in->n_layer, c->n_expert, c->top_k, c->n_layer);
        rtrace_close(r);
        return -1;
    }
    struct rtrace_step st;
    int got;
    uint64_t idx = 0, n = 0;
    while ((got = rtrace_next(r, &st, err, errlen)) == 1) {
        if (parity < 0 || (int)(idx % 2) == parity) {
            rstats_add(s, st.ids, st.n_tok, st.layer_stride);
            n += (uint64_t)st.n_tok;
        }
        idx++;
    }
    rtrace_close(r);
    if (tokens) *tokens = n;
    return got < 0 ? -1 : 0;
}
