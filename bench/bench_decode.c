/* Batched decode benchmark (not a test): decode tokens/s at several batch sizes on a model
 * folder, and the MoE layers' time against their floors measured in the same run.
 *
 * For each batch size B: B sequences are prefilled with --context random tokens, then --steps
 * decode steps of one token per sequence are timed (tokens/s = B * steps / time). A second run
 * of the same steps with engine_set_profile on times every MoE layer (the backend synchronized
 * around it) and counts the expert weights it read and its FLOPs; the floor of a layer is
 * max(weight bytes / read bandwidth, FLOPs / GEMM rate). On CUDA both rates come from
 * kernels/cuda/floors.h on the same GPU (bf16 GEMM); on the CPU the bandwidth is a
 * multi-threaded read of a 1 GiB buffer and the GEMM rate is our own kernel's on this model's
 * first expert matrix (its weight type and compute mode, 64 rows, all cores, weights in cache):
 * at a large batch the expert GEMMs are compute-bound and the bandwidth alone understates the
 * floor.
 *
 *   make_synthetic_model /tmp/mixtral1b --params 1B --dtype bf16
 *   bench_decode /tmp/mixtral1b --device cuda --batch 1,32,256 [--context 128] [--steps 32]
 *                [--dtype auto|bfloat16|float32] [--quantization none|int8|int4]
 *
 * Prints one table row per batch size; --json adds one JSON object per row on stdout. */
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
#ifdef MOESERVE_HAVE_CUDA
#include "cuda/floors.h"
#endif

#define MAX_BATCHES 8

/* Host read bandwidth in bytes/s, all cores. */
static double cpu_read_bandwidth(void)
{
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    return measure_read_bandwidth(nc > 0 && nc < 64 ? (int)nc : 1);
}

/* FLOP/s of the CPU backend's matmul on the model's first routed-expert up matrix (or the
 * first layer's q projection), 64 activation rows, on every core; 0 when it cannot be run. */
static double cpu_gemm_rate(const struct model *m)
{
    const struct wmat *w = NULL;
    for (int l = 0; l < m->desc.n_layer && !w; l++)
        if (m->layers[l].experts) w = m->layers[l].experts[0].up;
    if (!w && m->desc.n_layer > 0) w = m->layers[0].wq;
    if (!w) return 0;
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    struct backend *be = backend_cpu_create(nc > 0 && nc < 256 ? (int)nc : 1,
                                            model_computes_bf16(m));
    const int n = 64, k = w->cols, rows = w->rows;
    float *x = malloc(sizeof(float) * (size_t)n * (size_t)k);
    float *y = malloc(sizeof(float) * (size_t)n * (size_t)rows);
    double rate = 0;
    struct be_reserve res = {.max_elems = (size_t)n * (size_t)(k > rows ? k : rows),
                             .max_rows = n, .max_experts = 1, .max_ctx = 1};
    if (be && x && y && be->ops->reserve(be, &res) == 0) {
        for (size_t i = 0; i < (size_t)n * (size_t)k; i++) x[i] = (float)((i * 37) % 17) / 17.f;
        be->ops->matmul(be, y, x, w, NULL, n, k, rows); /* warm the cache */
        for (int pass = 0; pass < 5; pass++) { /* the best of five 0.1 s windows */
            int reps = 0;
            double t0 = ms_now(), t;
            do {
                be->ops->matmul(be, y, x, w, NULL, n, k, rows);
                reps++;
                t = ms_now() - t0;
            } while (t < 0.1); /* ms_now is in seconds */
            double r = 2.0 * n * (double)k * rows * reps / t;
            if (r > rate) rate = r;
        }
    }
    if (be) be->ops->destroy(be);
    free(x);
    free(y);
    return rate;
}

struct row {
    int batch;
    double tps, moe_ms, floor_ms, weight_mb, gflop;
    double experts; /* active experts per MoE layer */
};

static int parse_batches(const char *s, int *out)
{
    int n = 0;
    while (*s && n < MAX_BATCHES) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 4096) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

/* Runs one batch size; 0 or -1 with a message. */
static int run_batch(const struct model *m, enum engine_backend backend, int B, int context,
                     int steps, double bw, double flops_rate, struct row *r)
{
    const struct model_desc *md = &m->desc;
    char err[MS_ERR_LEN];
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = backend;
    ep.max_seqs = B;
    ep.max_batch_tokens = B > 512 ? B : 512;
    ep.max_model_len = context + 2 * steps + 2;
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "bench_decode: batch %d: %s\n", B, err);
        return -1;
    }
    int rc = -1;
    struct kv_seq *seq = calloc((size_t)B, sizeof *seq);
    struct engine_item *items = calloc((size_t)B, sizeof *items);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)context);
    int32_t *tok = calloc((size_t)B, sizeof *tok);
    float *logits = malloc(sizeof(float) * (size_t)B * md->vocab);
    int n_seq = 0;
    if (!seq || !items || !ids || !tok || !logits) {
        fprintf(stderr, "bench_decode: out of memory\n");
        goto out;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < context; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)md->vocab);
    }
    for (; n_seq < B; n_seq++)
        if (engine_seq_init(e, &seq[n_seq]) != 0) {
            fprintf(stderr, "bench_decode: out of memory for sequence %d\n", n_seq);
            goto out;
        }
    /* Prefill, as many sequences per step as the token budget takes. */
    for (int i = 0; i < B;) {
        int n = 0;
        while (i + n < B && (n + 1) * context <= ep.max_batch_tokens) {
            items[n] = (struct engine_item){.kv = &seq[i + n], .tokens = ids,
                                            .n_tokens = context, .n_logits = 1,
                                            .logits = logits + (size_t)n * md->vocab};
            n++;
        }
        if (n == 0) {
            fprintf(stderr, "bench_decode: --context %d exceeds the step budget\n", context);
            goto out;
        }
        if (engine_step(e, items, n, err, sizeof err) != 0) {
            fprintf(stderr, "bench_decode: prefill: %s\n", err);
            goto out;
        }
        i += n;
    }
    /* Timed decode, then the same again profiled. */
    for (int pass = 0; pass < 2; pass++) {
        engine_set_profile(e, pass == 1);
        const struct engine_stats *st = engine_get_stats(e);
        struct engine_stats before = *st;
        double t0 = ms_now();
        for (int s = 0; s < steps; s++) {
            int pos = context + pass * steps + s;
            for (int i = 0; i < B; i++) {
                tok[i] = (int32_t)((ids[(s + i) % context] + s) % md->vocab);
                items[i] = (struct engine_item){.kv = &seq[i], .tokens = &tok[i], .n_tokens = 1,
                                                .pos = pos, .n_logits = 1,
                                                .logits = logits + (size_t)i * md->vocab};
            }
            if (engine_step(e, items, B, err, sizeof err) != 0) {
                fprintf(stderr, "bench_decode: decode: %s\n", err);
                goto out;
            }
        }
        double dt = ms_now() - t0;
        if (pass == 0) {
            r->tps = (double)B * steps / dt;
            continue;
        }
        double calls = (double)(st->moe_calls - before.moe_calls);
        if (calls <= 0) break; /* a dense model */
        double bytes = (st->moe_weight_bytes - before.moe_weight_bytes) / calls;
        double flops = (st->moe_flops - before.moe_flops) / calls;
        r->moe_ms = 1e3 * (st->moe_s - before.moe_s) / calls;
        r->weight_mb = bytes / 1e6;
        r->gflop = flops / 1e9;
        r->experts = (double)(st->moe_active_experts - before.moe_active_experts) / calls;
        double floor_s = bw > 0 ? bytes / bw : 0;
        if (flops_rate > 0 && flops / flops_rate > floor_s) floor_s = flops / flops_rate;
        r->floor_ms = 1e3 * floor_s;
    }
    r->batch = B;
    rc = 0;
out:
    for (int i = 0; i < n_seq; i++) engine_seq_free(e, &seq[i]);
    engine_free(e);
    free(seq);
    free(items);
    free(ids);
    free(tok);
    free(logits);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: bench_decode MODEL_DIR [--device cpu|cuda] [--batch 1,32,256] "
                        "[--context 128] [--steps 32] [--dtype D] [--quantization Q] [--json]\n");
        return 2;
    }
    const char *dir = argv[1];
    enum engine_backend backend = ENGINE_BACKEND_CPU;
    int batches[MAX_BATCHES] = {1, 32, 256}, n_batch = 3, context = 128, steps = 32;
    bool json = false;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            json = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "bench_decode: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--device") == 0 && engine_backend_parse(v, &backend) == 0) continue;
        if (strcmp(a, "--batch") == 0 && (n_batch = parse_batches(v, batches)) > 0) continue;
        if (strcmp(a, "--context") == 0 && (context = atoi(v)) >= 1) continue;
        if (strcmp(a, "--steps") == 0 && (steps = atoi(v)) >= 1) continue;
        if (strcmp(a, "--dtype") == 0 && model_dtype_parse(v, &lo.dtype) == 0) continue;
        if (strcmp(a, "--quantization") == 0 && model_quant_parse(v, &lo.quant) == 0) continue;
        fprintf(stderr, "bench_decode: bad option %s %s\n", a, v);
        return 2;
    }

    char err[MS_ERR_LEN];
    struct model *m = NULL;
    if (model_load(dir, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_decode: %s\n", err);
        return 1;
    }
    /* Floors on the device the engine runs on. */
    double bw = 0, flops_rate = 0;
    const char *floor_src = "cpu read";
    if (backend == ENGINE_BACKEND_CUDA) {
#ifdef MOESERVE_HAVE_CUDA
        if (cuda_floor_hbm(0, (size_t)2 << 30, 10, &bw, err, sizeof err) != 0 ||
            cuda_floor_bf16_gemm(0, 8192, 8192, 8192, 10, &flops_rate, err, sizeof err) != 0) {
            fprintf(stderr, "bench_decode: %s\n", err);
            bw = flops_rate = 0;
        }
        bw *= 1e9;
        flops_rate *= 1e12;
        floor_src = "HBM read + bf16 GEMM";
#endif
    } else {
        bw = cpu_read_bandwidth();
        flops_rate = cpu_gemm_rate(m);
        floor_src = "cpu read + own GEMM";
    }
    const struct model_desc *md = &m->desc;
    printf("model %s: %zu parameters, %d layers, d_model %d, %d experts top-%d; device %s; "
           "context %d, %d steps\n",
           dir, m->n_params, md->n_layer, md->d_model, md->n_expert, md->top_k,
           engine_backend_name(backend), context, steps);
    printf("floors (%s): %.1f GB/s, %.1f GFLOP/s\n", floor_src, bw / 1e9, flops_rate / 1e9);
    printf("%6s %12s %10s %10s %8s %10s %10s %9s\n", "batch", "decode_tok/s", "moe_ms", "floor_ms",
           "floor%", "weight_MB", "GFLOP", "experts");
    int failed = 0;
    for (int i = 0; i < n_batch; i++) {
        struct row r = {0};
        if (run_batch(m, backend, batches[i], context, steps, bw, flops_rate, &r) != 0) {
            failed = 1;
            continue;
        }
        double pct = r.moe_ms > 0 ? 100.0 * r.floor_ms / r.moe_ms : 0;
        printf("%6d %12.1f %10.3f %10.3f %7.1f%% %10.1f %10.3f %9.1f\n", r.batch, r.tps, r.moe_ms,
               r.floor_ms, pct, r.weight_mb, r.gflop, r.experts);
        if (json)
            printf("{\"batch\": %d, \"decode_tps\": %.2f, \"moe_ms\": %.4f, \"floor_ms\": %.4f, "
                   "\"weight_mb\": %.2f, \"gflop\": %.4f, \"experts\": %.2f}\n",
                   r.batch, r.tps, r.moe_ms, r.floor_ms, r.weight_mb, r.gflop, r.experts);
        fflush(stdout);
    }
    model_free(m);
    return failed;
}
