/* Load-time memory: a bf16 checkpoint is used in place, not expanded, and a conversion at load
 * streams (the checkpoint's bytes are never all resident next to the converted copy). Writes a
 * Mixtral-shaped bf16 model of about 110 MB (random weights) into a temporary folder, then
 * measures this process's resident set (VmRSS, file-backed pages of the mapping included)
 * before loading and after loading, creating an engine and running a prefill that reaches every
 * expert: it must grow by at most 1.2x the checkpoint's weight bytes. The same model loaded
 * with --dtype float32 (an f32 copy, twice the bytes; the bf16 pages it was made from are given
 * back) must grow by well over that (> 1.6x), which shows the measurement sees copies.
 *
 * Peaks: for --quantization int4 and int8 (also writing, then mapping, a --quantization-cache)
 * and --dtype float32, the peak resident set over the same load + prefill (VmHWM, reset first
 * by writing 5 to /proc/self/clear_refs) may grow by at most 1.1x the converted bytes, plus one
 * source tensor (the largest, 2 MB: conversion runs a tensor at a time and gives each one's
 * source pages back when done), plus PEAK_FIXED for the engine and the loader's own tables;
 * and it may pass the resident set the run ends with by that one tensor + 1 MiB at most.
 * The same for a copy of the model whose experts are stored fused (two 3D tensors a layer, of
 * 16 and 8 MB): those are converted and given back an expert (2 MB) at a time (a tensor at a
 * time, the peak passes the end by 9-10 MB).
 * Before streaming, the whole 110 MB of bf16 stayed resident until the end of the conversion,
 * which that bound rejects (int4: 143 MB against 46 MB; int8: 167 MB against 72 MB; float32:
 * 333 MB against 253 MB).
 * Under AddressSanitizer (shadow memory on every touched byte) the bound is 1.45x, and the
 * peak factor 1.35x (the same 0.25 of slack). */
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "engine.h"
#include "model.h"
#include "rng.h"
#include "st_writer.h"
#include "test.h"

#if defined(__SANITIZE_ADDRESS__)
#define RSS_BOUND 1.45
#define PEAK_FACTOR 1.35
#else
#define RSS_BOUND 1.2
#define PEAK_FACTOR 1.1
#endif
/* What the peak may hold besides converted weights and one source tensor. Measured here: the
 * load itself peaks within 1 MB of its converted bytes (the tensor in flight, the loader's plan
 * and task tables, fault-around of up to 64 KB past a tensor's end); creating the engine adds
 * 0.4 MB (the KV cache) and the 64-token prefill about 4.5 MB (the whole 2 MB bf16 embedding
 * faulted in around the 64 rows it looks up, the CPU backend's activations and per-thread
 * scratch, logits). 6 MiB covers these with a little room for allocator placement. */
#define PEAK_FIXED (6.0 * 1024 * 1024)

enum { D = 512, LAYERS = 4, HEADS = 8, KV = 4, HD = 64, EXPERTS = 8, FF = 1024, VOCAB = 2048 };

/* A /proc/self/status field in bytes ("VmRSS: %ld kB", "VmHWM: %ld kB"), -1 if absent. */
static long status_bytes(const char *fmt)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, fmt, &kb) == 1) break;
    if (f) fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

static long rss_bytes(void)
{
    return status_bytes("VmRSS: %ld kB");
}

/* Sets VmHWM to the current VmRSS (Linux 4.0+). Without it the peak is measured against the
 * resident set at the start, which can only overstate it (a stricter test, never a looser). */
static bool hwm_reset(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return false;
    bool ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

static int write_text(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

/* Returns the checkpoint's tensor bytes, or 0 on failure. fused: each layer's experts stored
 * as two 3D tensors (mlp.experts.gate_up_proj (E, 2 FF, D), mlp.experts.down_proj (E, D, FF),
 * 16 and 8 MB) rather than one tensor per expert matrix (1 MB each), holding the same values
 * (the same draws, written at their offsets in the fused tensors): the same model. */
static size_t write_model(const char *dir, bool fused)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"model_type\": \"mixtral\", \"hidden_size\": %d, \"num_hidden_layers\": %d, "
             "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
             "\"intermediate_size\": %d, \"num_local_experts\": %d, \"num_experts_per_tok\": 2, "
             "\"vocab_size\": %d, \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-5, "
             "\"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"torch_dtype\": "
             "\"bfloat16\", \"bos_token_id\": 1, \"eos_token_id\": 2}",
             D, LAYERS, HEADS, KV, HD, FF, EXPERTS, VOCAB);
    if (write_text(dir, "config.json", cfg) != 0) return 0;
    struct stw *w = stw_new();
    char err[MS_ERR_LEN], path[512];
    /* t: the file's tensors; x: the matrices and vectors in drawing order, each written to
     * tensor x.ti at byte x.off (a whole tensor, or one expert's part of a fused one) */
    struct {
        char name[128];
        int64_t shape[3];
        int ndim;
    } t[3 + LAYERS * (7 + 3 * EXPERTS)];
    struct {
        int ti;
        size_t off, count;
        bool vec;
    } x[3 + LAYERS * (7 + 3 * EXPERTS)];
    int n = 0, nx = 0;
#define ADDT(e, r, c, ...)                                                                        \
    do {                                                                                          \
        snprintf(t[n].name, sizeof t[n].name, __VA_ARGS__);                                       \
        t[n].shape[0] = (e), t[n].shape[1] = (r), t[n].shape[2] = (c);                            \
        t[n].ndim = (r) ? (c) ? 3 : 2 : 1;                                                        \
        n++;                                                                                      \
    } while (0)
#define PART(ti_, off_, count_, vec_)                                                             \
    do {                                                                                          \
        x[nx].ti = (ti_), x[nx].off = (off_), x[nx].count = (count_), x[nx].vec = (vec_);         \
        nx++;                                                                                     \
    } while (0)
#define ADD(r, c, ...)                                                                            \
    do {                                                                                          \
        PART(n, 0, (size_t)(r) * ((c) ? (size_t)(c) : 1), !(c));                                  \
        ADDT(r, c, 0, __VA_ARGS__);                                                               \
    } while (0)
    ADD(VOCAB, D, "model.embed_tokens.weight");
    ADD(D, 0, "model.norm.weight");
    ADD(VOCAB, D, "lm_head.weight");
    for (int l = 0; l < LAYERS; l++) {
        ADD(D, 0, "model.layers.%d.input_layernorm.weight", l);
        ADD(D, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        ADD(HEADS * HD, D, "model.layers.%d.self_attn.q_proj.weight", l);
        ADD(KV * HD, D, "model.layers.%d.self_attn.k_proj.weight", l);
        ADD(KV * HD, D, "model.layers.%d.self_attn.v_proj.weight", l);
        ADD(D, HEADS * HD, "model.layers.%d.self_attn.o_proj.weight", l);
        if (fused) { /* transformers 5's names: "mlp." for the block */
            ADD(EXPERTS, D, "model.layers.%d.mlp.gate.weight", l);
            int gu = n, dn = n + 1;
            ADDT(EXPERTS, 2 * FF, D, "model.layers.%d.mlp.experts.gate_up_proj", l);
            ADDT(EXPERTS, D, FF, "model.layers.%d.mlp.experts.down_proj", l);
            const size_t m = (size_t)FF * D; /* elements of one expert matrix */
            for (int e = 0; e < EXPERTS; e++) {
                PART(gu, 2 * (2 * (size_t)e) * m, m, false);     /* w1: gate */
                PART(dn, 2 * (size_t)e * m, m, false);           /* w2: down */
                PART(gu, 2 * (2 * (size_t)e + 1) * m, m, false); /* w3: up */
            }
            continue;
        }
        ADD(EXPERTS, D, "model.layers.%d.block_sparse_moe.gate.weight", l);
        for (int e = 0; e < EXPERTS; e++) {
            ADD(FF, D, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e);
            ADD(D, FF, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e);
            ADD(FF, D, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e);
        }
    }
#undef ADD
#undef PART
#undef ADDT
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (!w || stw_add(w, t[i].name, ST_DTYPE_BF16, t[i].ndim, t[i].shape, NULL, err,
                          sizeof err) < 0) {
            stw_free(w);
            return 0;
        }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct ms_rng r;
    ms_rng_seed(&r, 7);
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)VOCAB * D); /* the largest part */
    int ok = buf && stw_begin(w, path, err, sizeof err) == 0;
    for (int i = 0; ok && i < nx; i++) {
        size_t cnt = x[i].count;
        float scale = x[i].vec ? 0.0f : 1.0f / 32.0f;
        for (size_t j = 0; j < cnt; j++) {
            float u = (float)((double)(ms_rng_next(&r) >> 40) * 0x1p-24 - 0.5);
            buf[j] = ms_f32_to_bf16(x[i].vec ? 1.0f : u * scale * 4);
        }
        ok = stw_write_tensor(w, x[i].ti, x[i].off, buf, cnt * 2, err, sizeof err) == 0;
        total += cnt * 2;
    }
    ok = ok && stw_end(w, err, sizeof err) == 0;
    if (!ok) fprintf(stderr, "write_model: %s\n", err);
    free(buf);
    stw_free(w);
    return ok ? total : 0;
}

struct mem {
    long grew;        /* VmRSS after the prefill less VmRSS before the load */
    long peak;        /* VmHWM after the prefill less VmRSS before the load */
    size_t weights;   /* m->weight_bytes */
    size_t converted; /* converted or quantized bytes: the converted block and f32 vectors */
    bool from_cache;  /* the converted block was mapped from a --quantization-cache file */
};

/* RSS growth and peak from loading `dir` with `lo` and running one prefill of 64 tokens (top-2
 * of 8 experts over 64 tokens reaches every expert of every layer, so every weight page is
 * read). Returns 0, or -1 when the load or the step fails. */
static int load_and_run(const char *dir, const struct model_load_opts *lo, struct mem *out)
{
    memset(out, 0, sizeof *out);
    out->grew = out->peak = -1;
    if (!hwm_reset()) printf("note: cannot reset VmHWM; peaks measured from the start\n");
    long before = rss_bytes();
    struct model *m = NULL;
    struct engine *e = NULL;
    char err[MS_ERR_LEN];
    int rc = -1;
    if (model_load(dir, lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "model_load: %s\n", err);
        return -1;
    }
    out->weights = m->weight_bytes;
    out->converted = m->converted_bytes + m->vector_floats * sizeof(float);
    out->from_cache = m->cache_map != NULL;
    struct engine_params ep;
    engine_params_default(&ep);
    ep.max_seqs = 1;
    ep.max_batch_tokens = 64;
    ep.max_model_len = 64;
    ep.kv_cache_bytes = (size_t)LAYERS * 2 * 64 * KV * HD * sizeof(float);
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "engine_create: %s\n", err);
        goto out;
    }
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (i * 37 + 11) % VOCAB;
    float *logits = malloc(sizeof(float) * VOCAB);
    struct kv_seq s;
    engine_seq_init(e, &s);
    struct engine_item it = {.kv = &s, .tokens = ids, .n_tokens = 64, .n_logits = 1,
                             .logits = logits};
    if (engine_step(e, &it, 1, err, sizeof err) == 0) {
        const struct engine_stats *st = engine_get_stats(e);
        int used = 0;
        for (int x = 0; x < LAYERS * EXPERTS; x++) used += st->expert_rows[x] > 0;
        CHECKF(used == LAYERS * EXPERTS, "the prefill reached %d of %d experts", used,
               LAYERS * EXPERTS);
        out->grew = rss_bytes() - before;
        out->peak = status_bytes("VmHWM: %ld kB") - before;
        rc = 0;
    } else {
        fprintf(stderr, "engine_step: %s\n", err);
    }
    engine_seq_free(e, &s);
    free(logits);
out:
    engine_free(e);
    model_free(m);
    return rc;
}

static void opts_for(struct model_load_opts *lo, enum model_dtype dtype, enum model_quant quant)
{
    model_load_opts_default(lo);
    lo->require_tokenizer = false;
    lo->dtype = dtype;
    lo->quant = quant;
    lo->threads = 2; /* conversion groups (model_load.c) are sized by threads: keep them fixed */
}

/* The peak of a converting load against converted x PEAK_FACTOR + one source tensor + fixed. */
static void check_peak(const char *what, const char *dir, const struct model_load_opts *lo,
                       size_t largest_tensor, bool want_cache)
{
    struct mem mm;
    if (load_and_run(dir, lo, &mm) != 0) {
        CHECKF(0, "%s: the load or the prefill failed", what);
        return;
    }
    /* a load mapped from the cache converts nothing: no source tensor is read */
    double src = mm.from_cache ? 0.0 : (double)largest_tensor;
    double bound = PEAK_FACTOR * (double)mm.converted + src + PEAK_FIXED;
    printf("%s: %.1f MB converted; peak grew %.1f MB (bound %.1f MB), %.1f MB after\n", what,
           mm.converted / 1e6, mm.peak / 1e6, bound / 1e6, mm.grew / 1e6);
    CHECKF(mm.from_cache == want_cache, "%s: %s the cache", what,
           mm.from_cache ? "mapped from" : "did not map from");
    CHECKF(mm.converted > 0, "%s: nothing converted", what);
    CHECKF(mm.peak > 0 && (double)mm.peak <= bound,
           "%s: peak resident set grew %ld bytes, bound %.0f", what, mm.peak, bound);
    /* Tighter, for what the load holds only while it runs: the peak may pass the resident set
     * it ends with (weights, engine, a prefill done) by one source slab at most, + 1 MiB for
     * the loader's tables (tens of KB here) and fault-around past a slab's end (64 KB). */
    CHECKF((double)(mm.peak - mm.grew) <= src + 1024.0 * 1024,
           "%s: the load peaked %ld bytes above where it ended; one source slab is %.0f", what,
           mm.peak - mm.grew, src);
}

/* Removes DIR/.moeserve and the cache files in it. */
static void remove_cache(const char *dir)
{
    char cdir[600], path[900];
    snprintf(cdir, sizeof cdir, "%s/.moeserve", dir);
    DIR *d = opendir(cdir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", cdir, de->d_name);
            unlink(path);
        }
    closedir(d);
    CHECK(rmdir(cdir) == 0);
}

int main(void)
{
    char dir[] = "/tmp/moeserve-memtest-XXXXXX";
    if (!mkdtemp(dir)) {
        CHECKF(0, "mkdtemp: %s", strerror(errno));
        return test_done("test_model_memory");
    }
    size_t file_bytes = write_model(dir, false);
    CHECK(file_bytes > 100u << 20);
    if (file_bytes) {
        /* the largest tensors: the embedding and the LM head, (VOCAB, D) bf16 */
        const size_t largest = (size_t)VOCAB * D * 2;
        struct model_load_opts lo;
        opts_for(&lo, MODEL_DTYPE_AUTO, MODEL_QUANT_INT4);
        check_peak("--quantization int4", dir, &lo, largest, false);
        opts_for(&lo, MODEL_DTYPE_AUTO, MODEL_QUANT_INT8);
        check_peak("--quantization int8", dir, &lo, largest, false);
        lo.cache = true; /* written after the conversion, from the converted block */
        check_peak("--quantization int8, writing the cache", dir, &lo, largest, false);
        check_peak("--quantization int8, mapped from the cache", dir, &lo, largest, true);
        remove_cache(dir);
        opts_for(&lo, MODEL_DTYPE_F32, MODEL_QUANT_NONE);
        check_peak("--dtype float32", dir, &lo, largest, false);

        struct mem mm;
        opts_for(&lo, MODEL_DTYPE_AUTO, MODEL_QUANT_NONE);
        CHECK(load_and_run(dir, &lo, &mm) == 0);
        long grew = mm.grew;
        size_t wb = mm.weights;
        /* weights in memory: the bf16 matrices (borrowed) and the norms as f32 */
        CHECKF(wb < file_bytes + file_bytes / 100, "weights in memory %zu vs %zu in the file", wb,
               file_bytes);
        printf("bf16 checkpoint, %.1f MB of weights: resident set grew %.1f MB (%.2fx; bound "
               "%.2fx)\n",
               file_bytes / 1e6, grew / 1e6, (double)grew / file_bytes, RSS_BOUND);
        CHECKF(grew > 0 && (double)grew <= RSS_BOUND * (double)file_bytes,
               "resident set grew %ld bytes for %zu bytes of weights", grew, file_bytes);
        opts_for(&lo, MODEL_DTYPE_F32, MODEL_QUANT_NONE);
        CHECK(load_and_run(dir, &lo, &mm) == 0);
        long grew32 = mm.grew;
        printf("the same with --dtype float32 (an f32 copy): grew %.1f MB (%.2fx)\n", grew32 / 1e6,
               (double)grew32 / file_bytes);
        CHECKF((double)grew32 > 1.6 * (double)file_bytes,
               "an f32 copy grew the resident set by only %ld bytes", grew32);
    }
    /* Experts fused in 16 MB and 8 MB tensors: converted and given back an expert at a time,
     * so the source in flight is still at most 2 MB (one expert's gate_up slab, or the
     * embedding), not 16 MB. */
    size_t fused_bytes = write_model(dir, true);
    CHECK(fused_bytes == file_bytes);
    if (fused_bytes) {
        const size_t largest = (size_t)VOCAB * D * 2;
        struct model_load_opts lo;
        opts_for(&lo, MODEL_DTYPE_AUTO, MODEL_QUANT_INT8);
        check_peak("fused experts, --quantization int8", dir, &lo, largest, false);
        opts_for(&lo, MODEL_DTYPE_AUTO, MODEL_QUANT_INT4);
        check_peak("fused experts, --quantization int4", dir, &lo, largest, false);
    }
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    return test_done("test_model_memory");
}
