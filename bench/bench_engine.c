/* Engine benchmark (not a test): single-stream prefill and decode tokens/s on a model folder,
 * and the decode step's share of the memory-bandwidth limit — bytes the step must read (active
 * weights + KV cache) times tokens/s, over a read bandwidth measured in the same run.
 *
 *   make_synthetic_model /tmp/mixtral100m --params 100M
 *   bench_engine /tmp/mixtral100m [--prompt-len 256] [--decode 64] [--devices 1] [--moe-top-k K]
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "common.h"
#include "engine.h"
#include "model.h"

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: bench_engine MODEL_DIR [--prompt-len N] [--decode N] "
                        "[--devices N] [--moe-top-k K]\n");
        return 2;
    }
    const char *dir = argv[1];
    int prompt_len = 256, n_decode = 64, devices = 1, moe_k = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        int v = atoi(argv[i + 1]);
        if (strcmp(argv[i], "--prompt-len") == 0) prompt_len = v;
        else if (strcmp(argv[i], "--decode") == 0) n_decode = v;
        else if (strcmp(argv[i], "--devices") == 0) devices = v;
        else if (strcmp(argv[i], "--moe-top-k") == 0) moe_k = v;
        else {
            fprintf(stderr, "bench_engine: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (prompt_len < 1 || n_decode < 1 || devices < 1) {
        fprintf(stderr, "bench_engine: counts must be >= 1\n");
        return 2;
    }

    char err[MS_ERR_LEN];
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    struct model *m = NULL;
    double tl = ms_now();
    if (model_load(dir, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    tl = ms_now() - tl;
    const struct model_desc *md = &m->desc;
    int k = moe_k > 0 && moe_k < md->top_k ? moe_k : md->top_k;

    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = devices;
    ep.max_seqs = 1;
    ep.max_batch_tokens = prompt_len;
    ep.max_model_len = prompt_len + n_decode + 1;
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "bench_engine: %s\n", err);
        model_free(m);
        return 1;
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
    /* Warm-up: one short prefill so first-touch page faults stay out of the timings. */
    struct engine_item it = {.kv = &s, .tokens = ids, .n_tokens = prompt_len < 8 ? prompt_len : 8,
                             .n_logits = 1, .logits = logits, .moe_top_k = moe_k};
    engine_step(e, &it, 1, err, sizeof err);
    kv_seq_release(engine_kv(e), &s);

    double t0 = ms_now();
    it = (struct engine_item){.kv = &s, .tokens = ids, .n_tokens = prompt_len, .n_logits = 1,
                              .logits = logits, .moe_top_k = moe_k};
    if (engine_step(e, &it, 1, err, sizeof err) != 0) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    double t_prefill = ms_now() - t0;

    int32_t tok = 0;
    t0 = ms_now();
    for (int i = 0; i < n_decode; i++) {
        int best = 0;
        for (int v = 1; v < md->vocab; v++)
            if (logits[v] > logits[best]) best = v;
        tok = best;
        it = (struct engine_item){.kv = &s, .tokens = &tok, .n_tokens = 1, .pos = prompt_len + i,
                                  .n_logits = 1, .logits = logits, .moe_top_k = moe_k};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "bench_engine: %s\n", err);
            return 1;
        }
    }
    double t_decode = ms_now() - t0;

    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double bw = measure_read_bandwidth(ncpu > 0 && ncpu < 64 ? (int)ncpu : 1);
    /* Bytes one decode step must read: the active weights (f32 in memory on the CPU backend)
     * plus the KV cache of the average context. */
    double weight_bytes = (double)model_active_params(m, k) * sizeof(float);
    double avg_ctx = prompt_len + n_decode / 2.0;
    double kv_bytes = 2.0 * md->n_layer * avg_ctx * md->n_kv_head * md->head_dim * sizeof(float);
    double step_bytes = weight_bytes + kv_bytes;
    double decode_tps = n_decode / t_decode;

    printf("model: %s, %zu parameters, %d layers, d_model %d, %d experts top-%d (using %d), "
           "%d device(s), load %.2f s\n",
           dir, m->n_params, md->n_layer, md->d_model, md->n_expert, md->top_k, k, devices, tl);
    printf("%-28s %12s\n", "metric", "value");
    printf("%-28s %12.1f\n", "prefill tokens/s", prompt_len / t_prefill);
    printf("%-28s %12.1f\n", "decode tokens/s", decode_tps);
    printf("%-28s %12.1f\n", "decode bytes/token (MB)", step_bytes / 1e6);
    printf("%-28s %12.2f\n", "read bandwidth (GB/s)", bw / 1e9);
    printf("%-28s %12.1f\n", "bandwidth-bound tokens/s", bw / step_bytes);
    printf("%-28s %11.1f%%\n", "decode share of bw limit", 100.0 * decode_tps * step_bytes / bw);

    engine_seq_free(e, &s);
    free(ids);
    free(logits);
    engine_free(e);
    model_free(m);
    return 0;
}
