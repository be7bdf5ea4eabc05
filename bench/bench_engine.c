/* Engine benchmark (not a test): single-stream prefill and decode tokens/s on a model folder for
 * each weight type asked for, and the decode step's share of the memory-bandwidth limit — bytes
 * the step must read (active weights as held in memory + the KV cache) times tokens/s, over a
 * read bandwidth measured in the same run.
 *
 *   make_synthetic_model /tmp/mixtral100m --params 100M --dtype bf16
 *   bench_engine /tmp/mixtral100m [--types f32,bf16,int8,int4] [--prompt-len 256] [--decode 64]
 *                [--devices 1] [--threads N] [--moe-top-k K] [--repeat R]
 *   bench_engine DIR --dtype auto|bfloat16|float32 [--quantization none|int8|int4] ...
 *                (one row with the server's flags instead of --types)
 *                [--kv-cache-dtype auto|bfloat16|float16|fp8_e4m3|fp8_e5m2|int8|float32]
 *                [--max-batch-tokens N] (prefill in chunks of N, as the server does; default:
 *                the whole prompt in one step)
 *
 * Types: f32 (--dtype float32), bf16 (--dtype bfloat16: bf16 weights and activations; what
 * auto is on a bf16 checkpoint), auto (the checkpoint's dtype), int8 and int4
 * (--quantization). Decode is measured twice: right after a one-token prompt ("depth 0") and
 * after the prefill of --prompt-len tokens ("depth N"); each figure is the best of --repeat
 * runs (default 2), since this machine is shared. The last column is the attention op's share
 * of the depth-N decode time (timed with engine_set_profile in a separate pass, so the other
 * figures are not slowed). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "bench_util.h"
#include "common.h"
#include "engine.h"
#include "model.h"

struct type_spec {
    const char *name;
    enum model_dtype dtype;
    enum model_quant quant;
};

static const struct type_spec types[] = {
    {"f32", MODEL_DTYPE_F32, MODEL_QUANT_NONE},   {"bf16", MODEL_DTYPE_BF16, MODEL_QUANT_NONE},
    {"auto", MODEL_DTYPE_AUTO, MODEL_QUANT_NONE},
    {"int8", MODEL_DTYPE_AUTO, MODEL_QUANT_INT8}, {"int4", MODEL_DTYPE_AUTO, MODEL_QUANT_INT4},
};

struct result {
    double load_s, prefill_tps, decode0_tps, decode_tps, step_bytes, weight_mb, attn_share;
};

struct run_opts {
    int prompt_len, n_decode, devices, threads, moe_k, repeat, kv_type, max_batch;
};

static int greedy(const float *logits, int V)
{
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

/* Decodes n tokens after position pos; seconds. */
static double decode(struct engine *e, struct kv_seq *s, float *logits, int V, int pos, int n,
                     int moe_k)
{
    char err[MS_ERR_LEN];
    double t0 = ms_now();
    for (int i = 0; i < n; i++) {
        int32_t tok = greedy(logits, V);
        struct engine_item it = {.kv = s, .tokens = &tok, .n_tokens = 1, .pos = pos + i,
                                 .n_logits = 1, .logits = logits, .moe_top_k = moe_k};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "bench_engine: %s\n", err);
            exit(1);
        }
    }
    return ms_now() - t0;
}

/* Prefill of ids[0, n) in steps of at most max_batch tokens; seconds. */
static double prefill(struct engine *e, struct kv_seq *s, const int32_t *ids, int n, int max_batch,
                      float *logits, int moe_k)
{
    char err[MS_ERR_LEN];
    double t0 = ms_now();
    for (int done = 0; done < n;) {
        int c = n - done < max_batch ? n - done : max_batch;
        struct engine_item it = {.kv = s, .tokens = ids + done, .n_tokens = c, .pos = done,
                                 .n_logits = done + c == n ? 1 : 0, .logits = logits,
                                 .moe_top_k = moe_k};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "bench_engine: %s\n", err);
            exit(1);
        }
        done += c;
    }
    return ms_now() - t0;
}

static int run_type(const char *dir, const struct type_spec *ts, const struct run_opts *o,
                    struct result *r)
{
    int prompt_len = o->prompt_len, n_decode = o->n_decode, threads = o->threads;
    int moe_k = o->moe_k, repeat = o->repeat;
    char err[MS_ERR_LEN];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    lo.dtype = ts->dtype;
    lo.quant = ts->quant;
    lo.threads = threads;
    struct model *m = NULL;
    double tl = ms_now();
    if (model_load(dir, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_engine: %s: %s\n", ts->name, err);
        return -1;
    }
    r->load_s = ms_now() - tl;
    const struct model_desc *md = &m->desc;
    int k = moe_k > 0 && moe_k < md->top_k ? moe_k : md->top_k;

    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = o->devices;
    ep.n_threads = threads;
    ep.max_seqs = 1;
    ep.kv_type = o->kv_type;
    int max_batch = o->max_batch > 0 && o->max_batch < prompt_len ? o->max_batch : prompt_len;
    ep.max_batch_tokens = max_batch;
    ep.max_model_len = prompt_len + 2 * n_decode + 1;
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "bench_engine: %s\n", err);
        model_free(m);
        return -1;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)prompt_len);
    float *logits = malloc(sizeof(float) * (size_t)md->vocab);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < prompt_len; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        ids[i] = (int32_t)(rng % (uint64_t)md->vocab);
    }
    struct kv_seq s;
    engine_seq_init(e, &s);
    r->prefill_tps = r->decode0_tps = r->decode_tps = r->attn_share = 0;
    for (int rep = 0; rep < repeat; rep++) {
        /* depth 0: one prompt token, then decode (also warms the weights' pages) */
        struct engine_item it = {.kv = &s, .tokens = ids, .n_tokens = 1, .n_logits = 1,
                                 .logits = logits, .moe_top_k = moe_k};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) goto fail;
        double t = decode(e, &s, logits, md->vocab, 1, n_decode, moe_k);
        if (n_decode / t > r->decode0_tps) r->decode0_tps = n_decode / t;
        kv_seq_release(engine_kv(e), &s);

        t = prefill(e, &s, ids, prompt_len, max_batch, logits, moe_k);
        if (prompt_len / t > r->prefill_tps) r->prefill_tps = prompt_len / t;
        t = decode(e, &s, logits, md->vocab, prompt_len, n_decode, moe_k);
        if (n_decode / t > r->decode_tps) r->decode_tps = n_decode / t;
        if (rep < repeat - 1) kv_seq_release(engine_kv(e), &s);
    }
    /* attention's share of decode at depth: the same decode again, profiled */
    engine_set_profile(e, true);
    double a0 = engine_get_stats(e)->attn_s;
    double t = decode(e, &s, logits, md->vocab, prompt_len + n_decode, n_decode, moe_k);
    r->attn_share = (engine_get_stats(e)->attn_s - a0) / t;
    engine_set_profile(e, false);
    kv_seq_release(engine_kv(e), &s);
    /* Bytes a decode step at depth prompt_len reads: active weights + the KV cache. */
    double avg_ctx = prompt_len + n_decode / 2.0;
    double kv_bytes = avg_ctx * (double)engine_kv_bytes_per_token(e);
    r->step_bytes = (double)model_active_bytes(m, k) + kv_bytes;
    r->weight_mb = (double)m->weight_bytes / 1e6;
    engine_seq_free(e, &s);
    free(ids);
    free(logits);
    engine_free(e);
    model_free(m);
    return 0;
fail:
    fprintf(stderr, "bench_engine: %s\n", err);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: bench_engine MODEL_DIR [--types f32,bf16,auto,int8,int4 | --dtype D "
                        "--quantization Q] [--prompt-len N] [--decode N] [--devices N] "
                        "[--threads N] [--moe-top-k K] [--repeat R] [--kv-cache-dtype T] "
                        "[--max-batch-tokens N]\n");
        return 2;
    }
    const char *dir = argv[1], *type_list = "auto";
    struct type_spec custom = {"flags", MODEL_DTYPE_AUTO, MODEL_QUANT_NONE};
    bool use_custom = false;
    int prompt_len = 256, n_decode = 64, devices = 1, threads = 0, moe_k = 0, repeat = 2;
    int kv_type = ENGINE_KV_AUTO, max_batch = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        const char *v = argv[i + 1];
        if (strcmp(argv[i], "--types") == 0) type_list = v;
        else if (strcmp(argv[i], "--prompt-len") == 0) prompt_len = atoi(v);
        else if (strcmp(argv[i], "--decode") == 0) n_decode = atoi(v);
        else if (strcmp(argv[i], "--devices") == 0) devices = atoi(v);
        else if (strcmp(argv[i], "--threads") == 0) threads = atoi(v);
        else if (strcmp(argv[i], "--moe-top-k") == 0) moe_k = atoi(v);
        else if (strcmp(argv[i], "--repeat") == 0) repeat = atoi(v);
        else if (strcmp(argv[i], "--max-batch-tokens") == 0) max_batch = atoi(v);
        else if (strcmp(argv[i], "--kv-cache-dtype") == 0 && engine_kv_type_parse(v, &kv_type) == 0)
            continue;
        else if (strcmp(argv[i], "--dtype") == 0 && model_dtype_parse(v, &custom.dtype) == 0)
            use_custom = true;
        else if (strcmp(argv[i], "--quantization") == 0 &&
                 model_quant_parse(v, &custom.quant) == 0)
            use_custom = true;
        else {
            fprintf(stderr, "bench_engine: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (prompt_len < 1 || n_decode < 1 || devices < 1 || repeat < 1 || threads < 0) {
        fprintf(stderr, "bench_engine: counts must be >= 1\n");
        return 2;
    }
    const struct type_spec *chosen[16];
    int n_types = 0;
    if (use_custom) {
        custom.name = custom.quant != MODEL_QUANT_NONE ? model_quant_name(custom.quant)
                                                       : model_dtype_name(custom.dtype);
        chosen[n_types++] = &custom;
        type_list = "";
    }
    char list[256];
    snprintf(list, sizeof list, "%s", type_list);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        const struct type_spec *t = NULL;
        for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
            if (strcmp(types[i].name, tok) == 0) t = &types[i];
        if (!t || n_types == 16) {
            fprintf(stderr, "bench_engine: unknown type '%s' (f32, bf16, auto, int8, int4)\n",
                    tok);
            return 2;
        }
        chosen[n_types++] = t;
    }

    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int bw_threads = ncpu > 0 && ncpu < 64 ? (int)ncpu : 1;
    double bw = measure_read_bandwidth(bw_threads);
    char thr[32];
    if (threads) snprintf(thr, sizeof thr, "%d", threads);
    else snprintf(thr, sizeof thr, "all");
    printf("model %s: prompt %d, decode %d, %d device(s), %s threads, kernels %s (%s), KV cache "
           "%s\n",
           dir, prompt_len, n_decode, devices, thr, backend_cpu_kernels(), backend_cpu_features(),
           engine_kv_type_name(kv_type));
    printf("read bandwidth at the start: %.2f GB/s (measured again after each row: this "
           "machine's bandwidth moves; a row's roofline uses the best of the two)\n\n",
           bw / 1e9);
    printf("%-6s %9s %8s %10s %10s %10s %11s %8s %9s %8s %8s\n", "type", "weights", "load",
           "prefill", "decode", "decode", "bytes/tok", "read bw", "roofline", "share", "attn");
    printf("%-6s %9s %8s %10s %10s %10s %11s %8s %9s %8s %8s\n", "", "MB", "s", "tok/s",
           "depth 0", "depth N", "MB", "GB/s", "tok/s", "", "depth N");
    for (int i = 0; i < n_types; i++) {
        struct result r;
        struct run_opts ro = {.prompt_len = prompt_len, .n_decode = n_decode, .devices = devices,
                              .threads = threads, .moe_k = moe_k, .repeat = repeat,
                              .kv_type = kv_type, .max_batch = max_batch};
        if (run_type(dir, chosen[i], &ro, &r) != 0) return 1;
        double bw_row = measure_read_bandwidth(bw_threads);
        if (bw > bw_row) bw_row = bw;
        double roof = bw_row / r.step_bytes;
        printf("%-6s %9.1f %8.2f %10.1f %10.1f %10.1f %11.2f %8.2f %9.1f %7.1f%% %7.1f%%\n",
               chosen[i]->name, r.weight_mb, r.load_s, r.prefill_tps, r.decode0_tps, r.decode_tps,
               r.step_bytes / 1e6, bw_row / 1e9, roof, 100.0 * r.decode_tps / roof,
               100.0 * r.attn_share);
        fflush(stdout);
    }
    return 0;
}
