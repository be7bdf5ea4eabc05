/* Tests for the safetensors reader and writer: writer -> reader round trips over every dtype
 * (with metadata, scalars and empty tensors), streamed writing, sharded folders with an index,
 * and each way a file can be malformed, checking that opening fails with a message naming the
 * file and, where there is one, the tensor. Files are built in a mkdtemp folder. */
#include "safetensors.h"
#include "st_writer.h"
#include "test.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];

static const char *tpath(const char *name)
{
    static char buf[4][512];
    static int slot;
    char *p = buf[slot++ & 3];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

/* Writes a file: 8-byte length of `header`, the header, then `data_len` bytes of 0x5a. */
static void write_raw(const char *path, const char *header, size_t data_len)
{
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(header);
    unsigned char len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (unsigned char)(n >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, n, f);
    for (size_t i = 0; i < data_len; i++)
        fputc(0x5a, f);
    fclose(f);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    fwrite(p, 1, n, f);
    fclose(f);
}

/* Opening `path` must fail with a message containing `want1` and (if non-NULL) `want2`. */
static void expect_fail(const char *path, const char *want1, const char *want2, const char *what)
{
    struct st_archive *a = NULL;
    char err[512] = "";
    int rc = st_open_file(path, &a, err, sizeof err);
    CHECKF(rc == -1 && a == NULL, "%s: open succeeded", what);
    CHECKF(strstr(err, path) != NULL, "%s: message does not name the file: %s", what, err);
    CHECKF(strstr(err, want1) != NULL, "%s: message lacks '%s': %s", what, want1, err);
    if (want2) CHECKF(strstr(err, want2) != NULL, "%s: message lacks '%s': %s", what, want2, err);
}

static void test_round_trip(void)
{
    static const enum st_dtype all[] = {
        ST_DTYPE_F32, ST_DTYPE_F16,  ST_DTYPE_BF16,    ST_DTYPE_F64,
        ST_DTYPE_I64, ST_DTYPE_I32,  ST_DTYPE_I16,     ST_DTYPE_I8,
        ST_DTYPE_U8,  ST_DTYPE_BOOL, ST_DTYPE_F8_E4M3, ST_DTYPE_F8_E5M2,
    };
    enum { N = sizeof all / sizeof all[0] };
    unsigned char *bufs[N];
    int64_t shapes[N][3];
    int ndims[N];
    struct stw *w = stw_new();
    char err[512] = "", name[64];
    /* Odd element counts so that, without the writer's ordering, later tensors would be
     * misaligned. */
    for (int i = 0; i < N; i++) {
        ndims[i] = 1 + i % 3;
        shapes[i][0] = 3 + i;
        shapes[i][1] = 5;
        shapes[i][2] = 1;
        size_t n = st_dtype_size(all[i]) * (size_t)(shapes[i][0] * (ndims[i] > 1 ? 5 : 1));
        bufs[i] = malloc(n);
        for (size_t k = 0; k < n; k++)
            bufs[i][k] = (unsigned char)(k * 7 + (size_t)i);
        snprintf(name, sizeof name, "t.%s.%d", st_dtype_name(all[i]), i);
        CHECK(stw_add(w, name, all[i], ndims[i], shapes[i], bufs[i], err, sizeof err) == i);
    }
    float scalar = 3.5f;
    CHECK(stw_add(w, "scalar", ST_DTYPE_F32, 0, NULL, &scalar, err, sizeof err) == N);
    int64_t empty_shape[2] = {0, 4};
    CHECK(stw_add(w, "empty", ST_DTYPE_F32, 2, empty_shape, NULL, err, sizeof err) == N + 1);
    CHECK(stw_add(w, "scalar", ST_DTYPE_F32, 0, NULL, &scalar, err, sizeof err) == -1);
    CHECKF(strstr(err, "scalar") != NULL, "%s", err);
    CHECK(stw_set_metadata(w, "format", "pt", err, sizeof err) == 0);
    CHECK(stw_set_metadata(w, "note", "round trip", err, sizeof err) == 0);
    CHECKF(stw_write(w, tpath("rt.safetensors"), err, sizeof err) == 0, "%s", err);
    stw_free(w);

    /* The data section starts 8-byte aligned. */
    FILE *f = fopen(tpath("rt.safetensors"), "rb");
    unsigned char len[8];
    CHECK(fread(len, 1, 8, f) == 8);
    fclose(f);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len[i];
    CHECK((8 + hlen) % 8 == 0);

    struct st_archive *a = NULL;
    CHECKF(st_open_file(tpath("rt.safetensors"), &a, err, sizeof err) == 0, "%s", err);
    if (!a) return;
    CHECK(st_count(a) == N + 2);
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "t.%s.%d", st_dtype_name(all[i]), i);
        const struct st_tensor *t = st_find(a, name);
        CHECKF(t != NULL, "missing %s", name);
        if (!t) continue;
        CHECK(strcmp(t->name, name) == 0);
        CHECK(strcmp(t->file, tpath("rt.safetensors")) == 0);
        CHECK(t->dtype == all[i]);
        CHECK(t->ndim == ndims[i]);
        for (int d = 0; d < ndims[i]; d++)
            CHECK(t->shape[d] == shapes[i][d]);
        size_t n = st_dtype_size(all[i]) * (size_t)(shapes[i][0] * (ndims[i] > 1 ? 5 : 1));
        CHECK(t->nbytes == n);
        CHECK(memcmp(t->data, bufs[i], n) == 0);
        CHECKF((uintptr_t)t->data % st_dtype_size(all[i]) == 0, "%s misaligned", name);
    }
    const struct st_tensor *s = st_find(a, "scalar");
    CHECK(s && s->ndim == 0 && s->nbytes == 4 && *(const float *)s->data == 3.5f);
    const struct st_tensor *e = st_find(a, "empty");
    CHECK(e && e->ndim == 2 && e->shape[0] == 0 && e->shape[1] == 4 && e->nbytes == 0);
    CHECK(st_find(a, "nope") == NULL);
    CHECK(st_find(a, "__metadata__") == NULL);
    CHECK(st_metadata(a, "format") && strcmp(st_metadata(a, "format"), "pt") == 0);
    CHECK(st_metadata(a, "note") && strcmp(st_metadata(a, "note"), "round trip") == 0);
    CHECK(st_metadata(a, "missing") == NULL);
    int seen = 0;
    for (int i = 0; i < st_count(a); i++)
        seen += st_at(a, i) != NULL;
    CHECK(seen == N + 2);
    CHECK(st_at(a, -1) == NULL && st_at(a, N + 2) == NULL);
    CHECK(strcmp(st_dtype_name(ST_DTYPE_BF16), "BF16") == 0 && st_dtype_size(ST_DTYPE_F64) == 8);
    st_close(a);
    for (int i = 0; i < N; i++)
        free(bufs[i]);
}

/* Many tensors: every one is found through the hash table. */
static void test_many(void)
{
    struct stw *w = stw_new();
    char err[512] = "", name[64];
    static float vals[3000];
    int64_t one = 1;
    for (int i = 0; i < 3000; i++) {
        vals[i] = (float)i;
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w1.weight", i / 64, i % 64);
        stw_add(w, name, ST_DTYPE_F32, 1, &one, &vals[i], err, sizeof err);
    }
    CHECKF(stw_write(w, tpath("many.safetensors"), err, sizeof err) == 0, "%s", err);
    stw_free(w);
    struct st_archive *a = NULL;
    CHECKF(st_open_file(tpath("many.safetensors"), &a, err, sizeof err) == 0, "%s", err);
    int ok = 0;
    for (int i = 0; a && i < 3000; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w1.weight", i / 64, i % 64);
        const struct st_tensor *t = st_find(a, name);
        ok += t && *(const float *)t->data == (float)i;
    }
    CHECK(ok == 3000);
    st_close(a);
}

static void test_streaming(void)
{
    struct stw *w = stw_new();
    char err[512] = "";
    int64_t shape[2] = {100, 10};
    int big = stw_add(w, "big", ST_DTYPE_F32, 2, shape, NULL, err, sizeof err);
    int small = stw_add(w, "small", ST_DTYPE_BF16, 1, shape, NULL, err, sizeof err);
    CHECK(big == 0 && small == 1);
    CHECK(stw_tensor_nbytes(w, big) == 4000 && stw_tensor_nbytes(w, small) == 200);
    CHECKF(stw_begin(w, tpath("stream.safetensors"), err, sizeof err) == 0, "%s", err);
    uint16_t h[100];
    for (int i = 0; i < 100; i++)
        h[i] = (uint16_t)i;
    CHECK(stw_write_tensor(w, small, 0, h, sizeof h, err, sizeof err) == 0);
    float row[10];
    for (int r = 99; r >= 0; r--) { /* rows out of order */
        for (int c = 0; c < 10; c++)
            row[c] = (float)(r * 10 + c);
        CHECK(stw_write_tensor(w, big, (size_t)r * sizeof row, row, sizeof row, err, sizeof err) ==
              0);
    }
    CHECK(stw_write_tensor(w, big, 3990, row, sizeof row, err, sizeof err) == -1);
    CHECKF(strstr(err, "big") != NULL, "%s", err);
    CHECKF(stw_end(w, err, sizeof err) == 0, "%s", err);
    stw_free(w);

    struct st_archive *a = NULL;
    CHECKF(st_open_file(tpath("stream.safetensors"), &a, err, sizeof err) == 0, "%s", err);
    const struct st_tensor *t = a ? st_find(a, "big") : NULL;
    int ok = t != NULL;
    for (int i = 0; ok && i < 1000; i++)
        ok = ((const float *)t->data)[i] == (float)i;
    CHECK(ok);
    t = a ? st_find(a, "small") : NULL;
    CHECK(t && memcmp(t->data, h, sizeof h) == 0);
    st_close(a);

    /* stw_end refuses a file with a tensor never written. */
    w = stw_new();
    stw_add(w, "a", ST_DTYPE_F32, 2, shape, NULL, err, sizeof err);
    CHECK(stw_begin(w, tpath("partial.safetensors"), err, sizeof err) == 0);
    CHECK(stw_end(w, err, sizeof err) == -1);
    CHECKF(strstr(err, "'a'") != NULL, "%s", err);
    stw_free(w);
    /* stw_write refuses a tensor without data. */
    w = stw_new();
    stw_add(w, "nodata", ST_DTYPE_F32, 2, shape, NULL, err, sizeof err);
    CHECK(stw_write(w, tpath("nodata.safetensors"), err, sizeof err) == -1);
    CHECKF(strstr(err, "nodata") != NULL, "%s", err);
    stw_free(w);
}

static void write_shard(const char *file, const char *n1, const char *n2, float v)
{
    float d[4] = {v, v + 1, v + 2, v + 3};
    int64_t shape[2] = {2, 2};
    char err[512];
    struct stw *w = stw_new();
    stw_add(w, n1, ST_DTYPE_F32, 2, shape, d, err, sizeof err);
    if (n2) stw_add(w, n2, ST_DTYPE_F32, 1, shape, d, err, sizeof err);
    CHECKF(stw_write(w, file, err, sizeof err) == 0, "%s", err);
    stw_free(w);
}

static void write_text(const char *path, const char *text)
{
    write_bytes(path, text, strlen(text));
}

static void test_sharded(void)
{
    char dir[512], err[512] = "", path[600];
    snprintf(dir, sizeof dir, "%s/sharded", tmpdir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/s-1.safetensors", dir);
    write_shard(path, "a", "b", 1.0f);
    snprintf(path, sizeof path, "%s/s-2.safetensors", dir);
    write_shard(path, "c", NULL, 10.0f);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_text(path,
               "{\"metadata\": {\"total_size\": 40}, \"weight_map\": {\"a\": \"s-1.safetensors\", "
               "\"c\": \"s-2.safetensors\", \"b\": \"s-1.safetensors\"}}");
    struct st_archive *a = NULL;
    CHECKF(st_open_dir(dir, &a, err, sizeof err) == 0, "%s", err);
    CHECK(a && st_count(a) == 3);
    const struct st_tensor *t = a ? st_find(a, "c") : NULL;
    CHECK(t && ((const float *)t->data)[3] == 13.0f && strstr(t->file, "s-2.safetensors"));
    t = a ? st_find(a, "b") : NULL;
    CHECK(t && t->ndim == 1 && strstr(t->file, "s-1.safetensors"));
    st_close(a);

    /* A tensor listed for a shard that lacks it: the message names tensor, index and shard. */
    write_text(path, "{\"weight_map\": {\"a\": \"s-1.safetensors\", \"c\": \"s-1.safetensors\", "
                     "\"x\": \"s-2.safetensors\"}}");
    a = NULL;
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1 && a == NULL);
    CHECKF(strstr(err, "model.safetensors.index.json") && strstr(err, "'c'") &&
               strstr(err, "s-1.safetensors"),
           "%s", err);

    /* A shard listed in the index that is not on disk. */
    write_text(path, "{\"weight_map\": {\"a\": \"s-1.safetensors\", \"z\": \"s-9.safetensors\"}}");
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "s-9.safetensors") && strstr(err, "model.safetensors.index.json"), "%s",
           err);

    /* An index that is not JSON, and one without weight_map. */
    write_text(path, "{\"weight_map\": ");
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "model.safetensors.index.json") != NULL, "%s", err);
    write_text(path, "{\"metadata\": {}}");
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "weight_map") != NULL, "%s", err);
    /* Shard names must stay in the folder. */
    write_text(path, "{\"weight_map\": {\"a\": \"../x.safetensors\"}}");
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "../x.safetensors") != NULL, "%s", err);

    /* A tensor present in two shards. */
    snprintf(path, sizeof path, "%s/s-2.safetensors", dir);
    write_shard(path, "a", NULL, 10.0f);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_text(path, "{\"weight_map\": {\"a\": \"s-1.safetensors\", \"b\": \"s-2.safetensors\"}}");
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "'a'") && strstr(err, "s-1.safetensors") && strstr(err, "s-2.safetensors"),
           "%s", err);

    /* No weights at all. */
    snprintf(dir, sizeof dir, "%s/noweights", tmpdir);
    mkdir(dir, 0755);
    CHECK(st_open_dir(dir, &a, err, sizeof err) == -1);
    CHECKF(strstr(err, "model.safetensors") && strstr(err, "noweights"), "%s", err);
    /* Single-file folder. */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_shard(path, "only", NULL, 0.0f);
    CHECKF(st_open_dir(dir, &a, err, sizeof err) == 0, "%s", err);
    CHECK(a && st_find(a, "only") != NULL);
    st_close(a);
}

static void test_corrupt(void)
{
    const char *p = tpath("bad.safetensors");
    write_bytes(p, "\x05\0\0", 3);
    expect_fail(p, "too short", NULL, "short file");
    write_bytes(p, "", 0);
    expect_fail(p, "too short", NULL, "empty file");
    expect_fail(tpath("absent.safetensors"), "cannot open", NULL, "missing file");

    unsigned char big[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    write_bytes(p, big, 10);
    expect_fail(p, "past the end", NULL, "header length past end");
    unsigned char huge[16] = {0, 0, 0, 0x40, 0, 0, 0, 0, '{', '}'};
    write_bytes(p, huge, 10);
    expect_fail(p, "absurd", NULL, "absurd header length");

    write_raw(p, "{\"a\": {\"dtype\": \"F32\"", 0);
    expect_fail(p, "not valid JSON", NULL, "truncated JSON");
    write_raw(p, "[1, 2]", 0);
    expect_fail(p, "not a JSON object", NULL, "array header");
    write_raw(p, "", 0);
    expect_fail(p, "JSON", NULL, "empty header");

    const char *T = "model.layers.0.mlp.gate.weight";
    write_raw(p, "{\"model.layers.0.mlp.gate.weight\": {\"shape\": [2], \"data_offsets\": [0, 8]}}",
              8);
    expect_fail(p, T, "missing 'dtype'", "no dtype");
    write_raw(
        p, "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"data_offsets\": [0, 8]}}",
        8);
    expect_fail(p, T, "missing 'shape'", "no shape");
    write_raw(p, "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [2]}}", 8);
    expect_fail(p, T, "missing 'data_offsets'", "no offsets");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": 3, \"shape\": [2], "
              "\"data_offsets\": [0, 8]}}",
              8);
    expect_fail(p, T, "'dtype' is not a string", "dtype type");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": \"2\", "
              "\"data_offsets\": [0, 8]}}",
              8);
    expect_fail(p, T, "'shape' is not an array", "shape type");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [2.5], "
              "\"data_offsets\": [0, 8]}}",
              8);
    expect_fail(p, T, "not an integer", "shape element type");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [2], "
              "\"data_offsets\": [\"0\", 8]}}",
              8);
    expect_fail(p, T, "data_offsets", "offsets type");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [2], "
              "\"data_offsets\": [0]}}",
              8);
    expect_fail(p, T, "data_offsets", "offsets length");
    write_raw(p, "{\"model.layers.0.mlp.gate.weight\": [1]}", 8);
    expect_fail(p, T, "not a JSON object", "entry type");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"Q4_K\", \"shape\": [2], "
              "\"data_offsets\": [0, 8]}}",
              8);
    expect_fail(p, T, "unknown dtype 'Q4_K'", "unknown dtype");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [2], "
              "\"data_offsets\": [8, 0]}}",
              8);
    expect_fail(p, T, "[8, 0]", "end before begin");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [4, 32], "
              "\"data_offsets\": [0, 512]}}",
              100);
    expect_fail(p, T, "past the data section", "truncated data");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [4, 32], "
              "\"data_offsets\": [0, 100]}}",
              100);
    expect_fail(p, T, "data_offsets [0, 100] do not match shape (4, 32) x F32 = 512 bytes",
                "size mismatch");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": [-2, 2], "
              "\"data_offsets\": [0, 16]}}",
              16);
    expect_fail(p, T, "negative dimension", "negative dim");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": "
              "[4611686018427387904, 4], \"data_offsets\": [0, 16]}}",
              16);
    expect_fail(p, T, "do not match", "overflowing shape");
    write_raw(p,
              "{\"model.layers.0.mlp.gate.weight\": {\"dtype\": \"F32\", \"shape\": "
              "[1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}",
              4);
    expect_fail(p, T, "dimensions", "too many dims");
    write_raw(p, "{\"__metadata__\": [1]}", 0);
    expect_fail(p, "__metadata__", NULL, "metadata type");
    write_raw(p, "{\"__metadata__\": {\"k\": 1}}", 0);
    expect_fail(p, "__metadata__", "'k'", "metadata value type");
    write_raw(p,
              "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
              "\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
              4);
    expect_fail(p, "JSON", NULL, "duplicate key");

    /* A correct hand-written header with an unaligned data section still opens. */
    write_raw(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    struct st_archive *a = NULL;
    char err[512] = "";
    CHECKF(st_open_file(p, &a, err, sizeof err) == 0, "%s", err);
    CHECK(a && st_find(a, "x") && st_find(a, "x")->nbytes == 8);
    st_close(a);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    snprintf(tmpdir, sizeof tmpdir, "%s/moeserve_st_XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_round_trip();
    test_many();
    test_streaming();
    test_sharded();
    test_corrupt();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    return test_done("test_safetensors");
}
