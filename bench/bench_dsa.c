/* DeepSeek sparse attention against dense MLA at depth (not a test): decode tokens/s of one
 * sequence after a prefill of D tokens, for D in --depths, on a V3.2-shaped model (bench/
 * make_synthetic_model --arch deepseek_v32), in three configurations of the same weights,
 * measured in one run:
 *   dense     the model as plain MLA (the indexer switched off: index_topk 0);
 *   dsa       as configured (each query attends to its index_topk best positions), with the
 *             share of a step spent selecting them (engine_dsa_seconds: the scores of every
 *             cached index key and the top-k; the indexer's projections are not counted).
 *
 * Depth past --prefill P (4096) is not computed: the sequence's KV blocks after its first P
 * positions are copies of those P positions' blocks (latent, rotary part and index key, in
 * turn), so a step at depth 65536 reads and scores 65536 realistic rows without the prefill's
 * O(depth^2) cost, which on a CPU would take hours. The rows sit at the wrong positions, which
 * changes what attention computes but not how much: this is a timing bench only.
 *
 *   make_synthetic_model /tmp/v32 --arch deepseek_v32 --heads 128 --layers 2 --experts 16 \
 *       --dtype bf16 --max-pos 131072 --vocab 2048
 *   bench_dsa /tmp/v32 [--depths 4096,16384,65536] [--steps 8] [--prefill 4096] [--threads N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "kv_cache.h"
#include "kv_types.h"
#include "model.h"

/* Grows seq from its first `have` positions (a multiple of the block size, on one CPU device)
 * to `depth`, each new block a copy of one of the first have / block_size blocks in turn. */
static int fill_copies(struct engine *e, struct kv_seq *seq, int have, int depth)
{
    struct kv_cache *kv = engine_kv(e);
    int bs = kv->block_size, src_blocks = have / bs;
    if (have % bs != 0 || src_blocks == 0 || kv_seq_reserve(kv, seq, depth) != 0) return -1;
    size_t es = (size_t)kv_type_size(kv->geom.type);
    for (int l = 0; l < kv->n_layer; l++) {
        const struct be_kv *L = &kv->layer[l];
        if (!L->k) continue;
        size_t kb = (size_t)bs * kv->geom.k_row * es, vb = (size_t)bs * kv->geom.v_row * es;
        size_t ksb = L->k_sc ? (size_t)bs * (kv->geom.k_row / kv->geom.k_grp) * sizeof(float) : 0;
        size_t vsb = L->v_sc && kv->geom.v_row > 0
                         ? (size_t)bs * (kv->geom.v_row / kv->geom.v_grp) * sizeof(float)
                         : 0;
        for (int b = src_blocks; b * bs < depth; b++) {
            size_t dst = (size_t)seq->blocks[b], src = (size_t)seq->blocks[b % src_blocks];
            memcpy((char *)L->k + dst * kb, (char *)L->k + src * kb, kb);
            if (ksb) memcpy((char *)L->k_sc + dst * ksb, (char *)L->k_sc + src * ksb, ksb);
            if (kv->geom.v_row > 0) {
                memcpy((char *)L->v + dst * vb, (char *)L->v + src * vb, vb);
                if (vsb) memcpy((char *)L->v_sc + dst * vsb, (char *)L->v_sc + src * vsb, vsb);
            }
        }
    }
    return 0;
}

/* Seconds per decode step of one sequence at `depth`, the model's description as given, and
 * of that the selection's. */
static int decode_time(const struct model *m, int depth, int prefill, int steps, int threads,
                       double *out, double *sel)
{
    const struct model_desc *md = &m->desc;
    char err[MS_ERR_LEN];
    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_threads = threads;
    ep.max_seqs = 1;
    ep.max_batch_tokens = 2048;
    ep.max_model_len = depth + steps + 1;
    struct engine *e = NULL;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "bench_dsa: %s\n", err);
        return -1;
    }
    int rc = -1;
    struct kv_seq seq;
    bool init = false;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)depth);
    float *logits = malloc(sizeof(float) * (size_t)md->vocab);
    if (!ids || !logits || engine_seq_init(e, &seq) != 0) goto out;
    init = true;
    for (int i = 0; i < depth; i++) ids[i] = (int32_t)((i * 7919u + 17u) % (unsigned)md->vocab);
    int real = depth < prefill ? depth : prefill;
    for (int p = 0; p < real; p += ep.max_batch_tokens) { /* the prefill, in chunks */
        int n = real - p < ep.max_batch_tokens ? real - p : ep.max_batch_tokens;
        struct engine_item it = {.kv = &seq, .tokens = ids + p, .n_tokens = n, .pos = p,
                                 .n_logits = p + n == real, .logits = logits};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) goto fail;
    }
    if (real < depth && fill_copies(e, &seq, real, depth) != 0) {
        snprintf(err, sizeof err, "cannot copy %d positions' blocks up to a depth of %d (no KV "
                 "blocks left, or --prefill not a multiple of the block size)", real, depth);
        goto fail;
    }
    double t0 = ms_now(), s0 = engine_dsa_seconds(e);
    for (int s = 0; s < steps; s++) {
        int32_t tok = (int32_t)((s * 31 + 5) % md->vocab);
        struct engine_item it = {.kv = &seq, .tokens = &tok, .n_tokens = 1, .pos = depth + s,
                                 .n_logits = 1, .logits = logits};
        if (engine_step(e, &it, 1, err, sizeof err) != 0) goto fail;
    }
    *out = (ms_now() - t0) / steps;
    *sel = (engine_dsa_seconds(e) - s0) / steps;
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "bench_dsa: %s\n", err);
out:
    if (init) engine_seq_free(e, &seq);
    engine_free(e);
    free(ids);
    free(logits);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr,
                "usage: %s V32_DIR [--depths 4096,16384] [--steps 8] [--prefill 4096] "
                "[--threads N]\n",
                argv[0]);
        return 2;
    }
    int depths[8] = {4096, 16384}, n_depths = 2, steps = 8, threads = 0, prefill = 4096;
    for (int i = 2; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (strcmp(a, "--steps") == 0 && (steps = atoi(v)) > 0) continue;
        if (strcmp(a, "--threads") == 0 && (threads = atoi(v)) > 0) continue;
        if (strcmp(a, "--prefill") == 0 && (prefill = atoi(v)) >= 16 && prefill % 16 == 0)
            continue;
        if (strcmp(a, "--depths") == 0) {
            n_depths = 0;
            for (const char *p = v; *p && n_depths < 8; p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
                if ((depths[n_depths++] = atoi(p)) <= 0) n_depths = 99;
            if (n_depths <= 8) continue;
        }
        fprintf(stderr, "bench_dsa: bad option %s %s\n", a, v);
        return 2;
    }
    struct model *m = NULL;
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.require_tokenizer = false;
    char err[MS_ERR_LEN];
    if (model_load(argv[1], &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "bench_dsa: %s\n", err);
        return 1;
    }
    int topk = m->desc.dsa_topk;
    if (topk <= 0) {
        fprintf(stderr, "bench_dsa: %s has no sparse attention (index_topk)\n", argv[1]);
        model_free(m);
        return 2;
    }
    printf("%s: %d layers, %d MLA heads, index_topk %d, %d index heads of %d; one sequence, %d "
           "decode steps; positions past %d are copies of the first %d\n",
           argv[1], m->desc.n_layer, m->desc.n_head, topk, m->desc.dsa_heads, m->desc.dsa_dim,
           steps, prefill, prefill);
    printf("| depth | dense MLA tok/s | DSA tok/s | DSA vs dense | indexer share of a DSA step |\n"
           "|---|---|---|---|---|\n");
    int rc = 0;
    for (int i = 0; i < n_depths && rc == 0; i++) {
        double t[2], sel[2];
        /* an engine reads the description as it runs: each configuration has its own engine
         * and the description set while it exists */
        int cfg_topk[2] = {0, topk};
        for (int c = 0; c < 2 && rc == 0; c++) {
            m->desc.dsa_topk = cfg_topk[c];
            rc = decode_time(m, depths[i], prefill, steps, threads, &t[c], &sel[c]);
        }
        m->desc.dsa_topk = topk;
        if (rc == 0)
            printf("| %d | %.2f | %.2f | %.2fx | %.0f%% |\n", depths[i], 1.0 / t[0], 1.0 / t[1],
                   t[0] / t[1], 100.0 * sel[1] / t[1]);
        fflush(stdout);
    }
    model_free(m);
    return rc == 0 ? 0 : 1;
}
