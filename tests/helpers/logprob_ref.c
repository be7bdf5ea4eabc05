/* logprob_ref: the engine's own loglikelihoods, computed directly (no scheduler, no server), for
 * tests that check what clients get through the API (tests/server/test_lm_eval.py).
 *   logprob_ref MODEL_DIR < lines
 * Each input line is "ctxlen id0 id1 ... idN-1"; the output line is the sum over positions
 * p in [ctxlen, N) of log softmax(logits at p-1)[id_p], in double, from one prefill of the
 * whole sequence with logits at every position. Exit status 1 on any error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "model.h"

#define MAX_IDS 4096

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: logprob_ref MODEL_DIR < lines\n");
        return 2;
    }
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    if (model_load(argv[1], NULL, &m, err, sizeof err) != 0) {
        fprintf(stderr, "logprob_ref: %s\n", err);
        return 1;
    }
    struct engine_params ep;
    engine_params_default(&ep);
    ep.max_batch_tokens = MAX_IDS;
    ep.max_seqs = 1;
    struct engine *e = NULL;
    int vocab = m->desc.vocab, rc = 1;
    int32_t *ids = malloc(sizeof *ids * MAX_IDS);
    float *logits = malloc(sizeof *logits * (size_t)MAX_IDS * (size_t)vocab);
    char *line = malloc(1 << 20);
    if (!ids || !logits || !line || engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "logprob_ref: %s\n", e ? "out of memory" : err);
        goto out;
    }
    while (fgets(line, 1 << 20, stdin)) {
        char *p = line, *end;
        long ctx = strtol(p, &end, 10);
        int n = 0;
        for (p = end;; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            if (n == MAX_IDS || v < 0 || v >= vocab) {
                fprintf(stderr, "logprob_ref: bad id or too many ids\n");
                goto out;
            }
            ids[n++] = (int32_t)v;
        }
        if (n < 1 || ctx < 1 || ctx > n || n > engine_get_params(e)->max_model_len) {
            fprintf(stderr, "logprob_ref: bad line (ctxlen %ld, %d ids)\n", ctx, n);
            goto out;
        }
        struct kv_seq s;
        if (engine_seq_init(e, &s) != 0) goto out;
        struct engine_item it = {.kv = &s, .tokens = ids, .n_tokens = n, .pos = 0,
                                 .n_logits = n, .logits = logits};
        int step = engine_step(e, &it, 1, err, sizeof err);
        engine_seq_free(e, &s);
        if (step != 0) {
            fprintf(stderr, "logprob_ref: %s\n", err);
            goto out;
        }
        double sum = 0.0;
        for (int q = (int)ctx; q < n; q++) {
            const float *row = logits + (size_t)(q - 1) * (size_t)vocab;
            double max = -INFINITY, z = 0.0;
            for (int i = 0; i < vocab; i++)
                if (row[i] > max) max = row[i];
            for (int i = 0; i < vocab; i++) z += exp((double)row[i] - max);
            sum += (double)row[ids[q]] - max - log(z);
        }
        printf("%.10f\n", sum);
        fflush(stdout);
    }
    rc = 0;
out:
    engine_free(e);
    free(ids);
    free(logits);
    free(line);
    model_free(m);
    return rc;
}
