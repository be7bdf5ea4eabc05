/* The weight cache (--quantization-cache, engine/model/weight_cache.c): on a copy of a fixture
 * model, a first int8 load converts and writes DIR/.moeserve/weights-KEY.bin; a second maps it
 * (every quantized matrix inside the mapping) and computes logits identical to the first; another
 * option (int4) or a touched checkpoint misses and writes anew; a corrupt cache file misses and
 * the load still converts; a folder that cannot be written loads without a cache and says why. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "test.h"

static int count_cache_files(const char *dir)
{
    char path[600];
    snprintf(path, sizeof path, "%s/.moeserve", dir);
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, "weights-", 8) == 0) n++;
    if (d) closedir(d);
    return n;
}

static struct model *load(const char *dir, enum model_quant q, bool cache)
{
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    lo.quant = q;
    lo.cache = cache;
    struct model *m = NULL;
    char err[MS_ERR_LEN];
    CHECKF(model_load(dir, &lo, &m, err, sizeof err) == 0, "%s", err);
    return m;
}

/* Logits of a fixed prompt. */
static float *run(const struct model *m)
{
    struct engine *e = golden_engine(m, 1);
    int32_t ids[6] = {1, 17, 33, 70, 5, 9};
    struct golden_prompt p = {.n = 6, .ids = ids};
    float *out = malloc(sizeof(float) * 6 * (size_t)m->desc.vocab);
    CHECK(e && out && golden_prefill(e, &p, 0, out) == 0);
    engine_free(e);
    return out;
}

static bool in_map(const struct model *m)
{
    bool all = m->cache_map != NULL;
    for (int i = 0; i < m->n_mats && all; i++)
        if (wtype_is_quant(m->mats[i].type))
            all = (const char *)m->mats[i].data >= (const char *)m->cache_map &&
                  (const char *)m->mats[i].data < (const char *)m->cache_map + m->cache_map_len;
    return all;
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char dir[] = "/tmp/moeserve-wcache-XXXXXX", from[600], to[600];
    if (!mkdtemp(dir)) return test_done("test_weight_cache");
    static const char *files[] = {"config.json", "generation_config.json", "model.safetensors"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(from, sizeof from, "%s/fixtures/models/mixtral/%s", tests, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        CHECKF(golden_copy_file(from, to) == 0, "copy %s", from);
    }

    struct model *a = load(dir, MODEL_QUANT_INT8, true);
    CHECKF(a && strstr(a->cache_note, "cached in") && count_cache_files(dir) == 1, "%s",
           a ? a->cache_note : "");
    struct model *b = load(dir, MODEL_QUANT_INT8, true);
    CHECKF(b && strstr(b->cache_note, "mapped from") && in_map(b), "%s", b ? b->cache_note : "");
    if (a && b) {
        float *la = run(a), *lb = run(b);
        CHECK(memcmp(la, lb, sizeof(float) * 6 * (size_t)a->desc.vocab) == 0);
        free(la);
        free(lb);
    }
    model_free(a);
    model_free(b);
    /* without the flag nothing is read or written */
    a = load(dir, MODEL_QUANT_INT8, false);
    CHECK(a && a->cache_note[0] == '\0' && a->cache_map == NULL);
    model_free(a);

    /* other options: another file */
    a = load(dir, MODEL_QUANT_INT4, true);
    CHECKF(a && strstr(a->cache_note, "cached in") && count_cache_files(dir) == 2, "%s",
           a ? a->cache_note : "");
    model_free(a);

    /* a touched checkpoint misses */
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    struct timeval tv[2] = {{1000000000, 0}, {1000000000, 0}};
    CHECK(utimes(to, tv) == 0);
    a = load(dir, MODEL_QUANT_INT8, true);
    CHECKF(a && strstr(a->cache_note, "cached in") && count_cache_files(dir) == 3, "%s",
           a ? a->cache_note : "");
    model_free(a);

    /* a corrupt cache file misses (and is replaced) */
    a = load(dir, MODEL_QUANT_INT8, true);
    const char *p = a ? strstr(a->cache_note, dir) : NULL;
    CHECKF(p != NULL, "%s", a ? a->cache_note : "");
    char cache[700];
    snprintf(cache, sizeof cache, "%s", p ? p : "");
    model_free(a);
    FILE *f = fopen(cache, "r+b");
    CHECK(f != NULL);
    if (f) {
        fseek(f, 16, SEEK_SET); /* the version */
        fputc(0x7f, f);
        fclose(f);
    }
    a = load(dir, MODEL_QUANT_INT8, true);
    CHECKF(a && strstr(a->cache_note, "cached in"), "%s", a ? a->cache_note : "");
    model_free(a);

    /* a folder we cannot write into (here: .moeserve is a file, which stops root too): the
     * load succeeds and says why there is no cache */
    char other[] = "/tmp/moeserve-wcache-ro-XXXXXX";
    if (mkdtemp(other)) {
        for (size_t i = 0; i < 3; i++) {
            snprintf(from, sizeof from, "%s/fixtures/models/mixtral/%s", tests, files[i]);
            snprintf(to, sizeof to, "%s/%s", other, files[i]);
            CHECK(golden_copy_file(from, to) == 0);
        }
        snprintf(to, sizeof to, "%s/.moeserve", other);
        FILE *blocker = fopen(to, "w");
        if (blocker) fclose(blocker);
        a = load(other, MODEL_QUANT_INT8, true);
        CHECKF(a && strstr(a->cache_note, "not written") && a->cache_map == NULL, "%s",
               a ? a->cache_note : "");
        model_free(a);
        unlink(to);
        for (size_t i = 0; i < 3; i++) {
            snprintf(to, sizeof to, "%s/%s", other, files[i]);
            unlink(to);
        }
        rmdir(other);
    }

    /* clean up */
    char path[700];
    snprintf(path, sizeof path, "%s/.moeserve", dir);
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/.moeserve/%s", dir, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    snprintf(path, sizeof path, "%s/.moeserve", dir);
    rmdir(path);
    for (size_t i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
    return test_done("test_weight_cache");
}
