/* MLA against GQA at equal active parameters (not a test): decode tokens/s and KV-cache bytes
 * per token of a DeepSeek-V2-Lite-shaped model and a mixtral-shaped one, measured in the same
 * run, at one batch size and context. The KV figure is what the engine allocates per token
 * (model_kv_bytes_per_token: MLA's latent + rope key per layer, against GQA's keys and values),
 * and the cache a batch holds at that context follows from it.
 *
 *   make_synthetic_model /tmp/ds --arch deepseek --layers 4 --experts 16 --dtype bf16
 *   make_synthetic_model /tmp/mx --active <the deepseek model's active parameters> \
 *                        --hidden 2048 --layers 4 --dtype bf16
 *   bench_mla /tmp/ds /tmp/mx [--batch 8] [--context 512] [--steps 16] [--device cpu|cuda]
 *
 * Prints one row per model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"

struct result {
    double tps;
    size_t active, kv_token;
};

/* Prefills B sequences of `context` tokens, then times `steps` decode steps of all B. */
static int measure(const struct model *m, enum engine_backend backend, int B, int context,
                   int steps, struct result *r)
{
    const struct model_desc *md = &m->desc;
    char err[MS_ERR_LEN];
    struct engine_params ep;
    engine_params_default(&ep);
    ep.backend = backend;
    ep.max_seqs = B;
    ep.max_batch_tokens = context > B ? context : B;
    ep.max_model_len = context + steps + 1;
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "bench_mla: %s\n", err);
        return -1;
    }
    int rc = -1;
    struct kv_seq *seq = calloc((size_t)B, sizeof *seq);
    struct engine_item *items = calloc((size_t)B, sizeof *items);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)context), *tok = calloc((size_t)B, 4);
    float *logits = malloc(sizeof(float) * (size_t)B * md->vocab);
    int n_seq = 0;
    if (!seq || !items || !ids || !tok || !logits) goto out;
    for (int i = 0; i < context; i++) ids[i] = (int32_t)((i * 7919u + 17u) % (unsigned)md->vocab);
    for (; n_seq < B; n_seq++) {
        if (engine_seq_init(e, &seq[n_seq]) != 0) goto out;
        struct engine_item it = {.kv = &seq[n_seq], .tokens = ids, .n_tokens = context,
                                 .n_logits = 1, .logits = logits};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) goto fail;
    }
    double t0 = ms_now();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < B; i++) {
            tok[i] = (int32_t)((s * 31 + i) % md->vocab);
            items[i] = (struct engine_item){.kv = &seq[i], .tokens = &tok[i], .n_tokens = 1,
                                            .pos = context + s, .n_logits = 1,
                                            .logits = logits + (size_t)i * md->vocab};
        }
        if (engine_step(e, items, B, err, sizeof err) != 0) goto fail;
    }
    r->tps = (double)B * steps / (ms_now() - t0);
    r->active = model_active_params(m, md->top_k);
    r->kv_token = model_kv_bytes_per_token(md);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "bench_mla: %s\n", err);
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
    if (argc < 3 || argv[1][0] == '-' || argv[2][0] == '-') {
        fprintf(stderr, "usage: %s DEEPSEEK_DIR MIXTRAL_DIR [--batch 8] [--context 512] "
                        "[--steps 16] [--device cpu|cuda]\n",
                argv[0]);
        return 2;
    }
    int B = 8, context = 512, steps = 16;
    enum engine_backend backend = ENGINE_BACKEND_CPU;
    for (int i = 3; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (strcmp(a, "--batch") == 0 && (B = atoi(v)) > 0) continue;
        if (strcmp(a, "--context") == 0 && (context = atoi(v)) > 0) continue;
        if (strcmp(a, "--steps") == 0 && (steps = atoi(v)) > 0) continue;
        if (strcmp(a, "--device") == 0 && engine_backend_parse(v, &backend) == 0) continue;
        fprintf(stderr, "bench_mla: bad option %s %s\n", a, v);
        return 2;
    }
    printf("%-24s %-14s %8s %12s %14s %12s\n", "model", "attention", "active", "KV B/token",
           "KV MiB (batch)", "decode tok/s");
    for (int k = 1; k <= 2; k++) {
        struct model *m = NULL;
        struct model_load_opts lo;
        model_load_opts_default(&lo);
        lo.require_tokenizer = false;
        char err[MS_ERR_LEN];
        struct result r;
        if (model_load(argv[k], &lo, &m, err, sizeof err) != 0) {
            fprintf(stderr, "bench_mla: %s\n", err);
            return 1;
        }
        int ok = measure(m, backend, B, context, steps, &r);
        if (ok == 0) {
            const char *name = strrchr(argv[k], '/') ? strrchr(argv[k], '/') + 1 : argv[k];
            printf("%-24s %-14s %7.1fM %12zu %14.1f %12.2f\n", name,
                   m->desc.attn == ATTN_KIND_MLA ? "MLA (latent)" : "GQA", r.active / 1e6,
                   r.kv_token, (double)r.kv_token * B * (context + steps) / (1 << 20), r.tps);
        }
        model_free(m);
        if (ok != 0) return 1;
    }
    printf("batch %d, context %d, %d decode steps, %s\n", B, context, steps,
           engine_backend_name(backend));
    return 0;
}
