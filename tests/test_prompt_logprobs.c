/* Prompt logprobs through the scheduler, on the mixtral fixture whose reference logits come from
 * transformers: every prompt token's logprob (and rank and alternatives) equals log_softmax of
 * the reference logits at the position before it, whether the prefill runs in one chunk, in
 * small chunks, or cut short by the per-step row budget when two such requests share a step;
 * prefix-cached blocks never skip positions whose logprobs are wanted; max_tokens 0 generates
 * nothing and ends with "length" once the prefill is done. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "safetensors.h"
#include "sampler.h"
#include "scheduler.h"
#include "test.h"

/* log_softmax(row)[tok] in double. */
static double ref_logprob(const float *row, int vocab, int32_t tok)
{
    double max = -INFINITY, z = 0.0;
    for (int i = 0; i < vocab; i++)
        if (row[i] > max) max = row[i];
    for (int i = 0; i < vocab; i++) z += exp((double)row[i] - max);
    return (double)row[tok] - max - log(z);
}

static struct sched *make_sched(struct engine *e, int batch_tokens, bool prefix_caching)
{
    struct sched_params sp = {.max_num_seqs = GOLDEN_MAX_PROMPTS,
                              .max_num_batched_tokens = batch_tokens,
                              .disable_prefix_caching = !prefix_caching};
    char err[MS_ERR_LEN];
    struct sched *s = NULL;
    if (sched_create(e, &sp, &s, err, sizeof err) != 0) fprintf(stderr, "sched: %s\n", err);
    return s;
}

static struct sched_req *submit(struct sched *s, const struct golden_prompt *p, int max_tokens,
                                int prompt_logprobs)
{
    struct sched_req_params sp;
    sched_req_params_default(&sp);
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    sp.smp.temperature = 0;
    sp.prompt_logprobs = prompt_logprobs;
    char err[MS_ERR_LEN];
    struct sched_req *r = sched_req_create(p->ids, p->n, &sp, err, sizeof err);
    CHECKF(r != NULL, "%s", err);
    if (r) CHECKF(sched_submit(s, r, err, sizeof err) == 0, "%s", err);
    return r;
}

static void run_until_idle(struct sched *s)
{
    for (int guard = 0; guard < 100000 && sched_has_work(s); guard++) sched_step(s);
}

/* Checks r's prompt logprobs against the reference logits of p. Returns the worst error. */
static double check_against_ref(const struct sched_req *r, const struct golden_prompt *p,
                                int vocab, int n_top)
{
    double worst = 0.0;
    CHECKF(r->out.n_prompt_lps == p->n, "%d of %d prompt logprobs", r->out.n_prompt_lps, p->n);
    for (int q = 1; q < r->out.n_prompt_lps; q++) {
        const float *row = p->logits + (size_t)(q - 1) * (size_t)vocab;
        const struct smp_logprobs *lp = &r->out.prompt_lps[q];
        double want = ref_logprob(row, vocab, p->ids[q]);
        double err = fabs((double)lp->logprob - want);
        if (err > worst) worst = err;
        CHECK(lp->token == p->ids[q]);
        int above = 0;
        for (int i = 0; i < vocab; i++) above += row[i] > row[p->ids[q]];
        /* The engine's logits match to ~1e-6; a rank may differ only on a near tie. */
        CHECKF(abs(lp->rank - (above + 1)) <= 1, "rank %d, reference %d", lp->rank, above + 1);
        CHECK(lp->n_top == n_top);
        if (n_top > 0)
            CHECKF(lp->top_token[0] == golden_argmax(row, vocab), "top %d at q=%d",
                   lp->top_token[0], q);
        for (int k = 1; k < lp->n_top; k++) CHECK(lp->top_logprob[k] <= lp->top_logprob[k - 1]);
    }
    return worst;
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct st_archive *ref = NULL;
    if (model_load(test_path(tests, "fixtures/models/mixtral"), NULL, &m, err, sizeof err) != 0 ||
        st_open_file(test_path(tests, "fixtures/models/mixtral/reference.safetensors"), &ref, err,
                     sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        CHECK(0);
        model_free(m);
        return test_done("test_prompt_logprobs");
    }
    const int vocab = m->desc.vocab;
    struct golden_prompt gp[GOLDEN_MAX_PROMPTS];
    int np = golden_load_prompts(ref, gp);
    CHECK(np >= 2);
    struct engine *e = golden_engine(m, 1);
    CHECK(e != NULL);

    /* smp_row_logprobs alone: a small row with a known answer. */
    {
        float row[4] = {0.0f, logf(3.0f), -INFINITY, 0.0f};
        struct smp_logprobs lp;
        smp_row_logprobs(row, 4, 3, 2, &lp);
        CHECK(fabs(lp.logprob - logf(0.2f)) < 1e-6);
        CHECK(lp.rank == 2 && lp.n_top == 2 && lp.top_token[0] == 1 && lp.top_token[1] == 0);
        CHECK(fabs(lp.top_logprob[0] - logf(0.6f)) < 1e-6);
    }

    /* One chunk, then small chunks (the prefill runs 5 tokens a step), every prompt at once. */
    int chunk_sizes[2] = {256, 5};
    for (int c = 0; c < 2 && e; c++) {
        struct sched *s = make_sched(e, chunk_sizes[c], false);
        struct sched_req *r[GOLDEN_MAX_PROMPTS] = {0};
        for (int i = 0; i < np && s; i++) r[i] = submit(s, &gp[i], i == 0 ? 0 : 3, 3);
        if (s) run_until_idle(s);
        double worst = 0.0;
        for (int i = 0; i < np; i++) {
            if (!r[i]) continue;
            double w = check_against_ref(r[i], &gp[i], vocab, 3);
            if (w > worst) worst = w;
            CHECK(r[i]->out.finish == SCHED_FINISH_LENGTH);
            CHECK(r[i]->out.n_tokens == (i == 0 ? 0 : 3));
            if (i > 0 && gp[i].greedy)
                for (int t = 0; t < 3; t++) CHECK(r[i]->out.tokens[t] == gp[i].greedy[t]);
            sched_req_release(r[i]);
        }
        printf("chunk %d: worst |logprob - reference| %.2e\n", chunk_sizes[c], worst);
        CHECK(worst < 1e-4);
        sched_free(s);
    }

    /* The row budget: with 16 tokens a step there are 16 extra rows; two long prompts in one
     * step cannot both take a full chunk of rows, and still both get every logprob. */
    if (e) {
        struct sched *s = make_sched(e, 16, false);
        int a = 0, b = 1;
        for (int i = 0; i < np; i++)
            if (gp[i].n > gp[a].n) a = i;
        b = a == 0 ? 1 : 0;
        struct sched_req *ra = s ? submit(s, &gp[a], 1, 0) : NULL;
        struct sched_req *rb = s ? submit(s, &gp[b], 1, 0) : NULL;
        int steps = 0;
        for (; s && sched_has_work(s) && steps < 10000; steps++) sched_step(s);
        if (ra) CHECK(check_against_ref(ra, &gp[a], vocab, 0) < 1e-4);
        if (rb) CHECK(check_against_ref(rb, &gp[b], vocab, 0) < 1e-4);
        /* 16 tokens a step can never hold both prompts' rows at once. */
        CHECKF(steps >= (gp[a].n + gp[b].n) / 16, "%d steps", steps);
        sched_req_release(ra);
        sched_req_release(rb);
        sched_free(s);
    }

    /* Prefix caching: a run without prompt logprobs registers the prompt's blocks; the same
     * prompt with prompt logprobs must not take them (it would skip those positions), and one
     * without them afterwards does. */
    if (e) {
        struct sched *s = make_sched(e, 256, true);
        const struct golden_prompt *p = &gp[0];
        for (int i = 1; i < np; i++)
            if (gp[i].n > p->n) p = &gp[i];
        struct sched_req *r1 = s ? submit(s, p, 1, -1) : NULL;
        if (s) run_until_idle(s);
        struct sched_req *r2 = s ? submit(s, p, 1, 1) : NULL;
        if (s) run_until_idle(s);
        struct sched_req *r3 = s ? submit(s, p, 1, -1) : NULL;
        if (s) run_until_idle(s);
        if (r1 && r2 && r3) {
            CHECK(r1->out.prompt_lps == NULL);
            CHECKF(r2->out.n_cached_tokens == 0, "%d cached", r2->out.n_cached_tokens);
            CHECK(check_against_ref(r2, p, vocab, 1) < 1e-4);
            CHECKF(r3->out.n_cached_tokens > 0, "the cache was not used at all");
            CHECK(r1->out.tokens[0] == r2->out.tokens[0] && r2->out.tokens[0] == r3->out.tokens[0]);
        }
        sched_req_release(r1);
        sched_req_release(r2);
        sched_req_release(r3);
        sched_free(s);
    }

    /* Bad parameters are refused at creation. */
    {
        struct sched_req_params sp;
        sched_req_params_default(&sp);
        sp.prompt_logprobs = SMP_MAX_LOGPROBS + 1;
        CHECK(sched_req_create(gp[0].ids, gp[0].n, &sp, err, sizeof err) == NULL);
    }

    engine_free(e);
    st_close(ref);
    model_free(m);
    return test_done("test_prompt_logprobs");
}
