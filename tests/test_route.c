/* The DeepSeek-V3 router rule (BE_ROUTE_SIGMOID_GROUP) against transformers'
 * DeepseekV3TopkRouter: tests/fixtures/route/deepseek_v3.safetensors (written by
 * tests/reference/make_route_fixtures.py) holds router logits, the correction bias and the
 * experts and weights transformers chose. The CPU backend's route op must choose the same
 * experts (as a set: transformers returns them unsorted) with the same weights; and a token
 * given a smaller budget must take the first experts of its full choice. */
#include <math.h>
#include <stdlib.h>

#include "backend.h"
#include "common.h"
#include "safetensors.h"
#include "test.h"

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    char err[MS_ERR_LEN];
    struct st_archive *ref = NULL;
    int rc = st_open_file(test_path(tests, "fixtures/route/deepseek_v3.safetensors"), &ref, err,
                          sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (rc) return test_done("test_route");
    const struct st_tensor *tl = st_find(ref, "logits"), *tb = st_find(ref, "bias"),
                           *ti = st_find(ref, "idx"), *tw = st_find(ref, "weights"),
                           *tc = st_find(ref, "config");
    CHECK(tl && tb && ti && tw && tc);
    if (!tl || !tb || !ti || !tw || !tc) goto out;
    const float *cfg = tc->data;
    int n = (int)tl->shape[0], E = (int)tl->shape[1], K = (int)ti->shape[1];
    struct be_route r = {BE_ROUTE_SIGMOID_GROUP, E, K, (int)cfg[0], (int)cfg[1], cfg[3] != 0.0f,
                         tb->data, cfg[4], BE_SCORE_SIGMOID, NULL, NULL};
    CHECK((int)cfg[2] == K);

    struct backend *be = backend_cpu_create(1, false);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)n * K), *tok_k = malloc(sizeof(int32_t) * n);
    int32_t *sorted = malloc(sizeof(int32_t) * (size_t)K);
    float *w = malloc(sizeof(float) * (size_t)n * K);
    CHECK(be && idx && tok_k && sorted && w);
    if (!be || !idx || !tok_k || !sorted || !w) goto done;

    /* Full budget: the same set, the same weights. */
    for (int t = 0; t < n; t++) tok_k[t] = K;
    be->ops->route(be, idx, w, tl->data, NULL, tok_k, n, &r);
    const int32_t *want_i = ti->data;
    const float *want_w = tw->data;
    int set_bad = 0;
    double worst = 0.0;
    for (int t = 0; t < n; t++) {
        memcpy(sorted, idx + (size_t)t * K, sizeof(int32_t) * K);
        qsort(sorted, (size_t)K, sizeof(int32_t), cmp_i32);
        set_bad += memcmp(sorted, want_i + (size_t)t * K, sizeof(int32_t) * K) != 0;
        for (int j = 0; j < K; j++)
            for (int i = 0; i < K; i++)
                if (want_i[(size_t)t * K + i] == idx[(size_t)t * K + j]) {
                    double d = fabs(w[(size_t)t * K + j] - want_w[(size_t)t * K + i]) /
                               fabs(want_w[(size_t)t * K + i]);
                    if (d > worst) worst = d;
                }
    }
    printf("deepseek_v3 router: %d tokens, %d experts, top-%d of %d/%d groups: %d sets differ, "
           "worst weight rel err %.2e\n",
           n, E, K, r.topk_group, r.n_group, set_bad, worst);
    CHECKF(set_bad == 0, "%d of %d tokens chose other experts than transformers", set_bad, n);
    CHECKF(worst < 1e-5, "weights differ from transformers by %.3e", worst);

    /* A budget of 2: the two best of the full choice (idx is in choice order). */
    int32_t *full = malloc(sizeof(int32_t) * (size_t)n * K);
    if (full) {
        memcpy(full, idx, sizeof(int32_t) * (size_t)n * K);
        for (int t = 0; t < n; t++) tok_k[t] = 2;
        be->ops->route(be, idx, w, tl->data, NULL, tok_k, n, &r);
        int bad = 0;
        for (int t = 0; t < n; t++) {
            const int32_t *a = idx + (size_t)t * K, *b = full + (size_t)t * K;
            bad += a[0] != b[0] || a[1] != b[1] || a[2] != -1 || w[(size_t)t * K + 2] != 0.0f;
        }
        CHECKF(bad == 0, "%d tokens: a budget of 2 is not the head of the full choice", bad);
        free(full);
    }
done:
    if (be) be->ops->destroy(be);
    free(idx);
    free(tok_k);
    free(sorted);
    free(w);
out:
    st_close(ref);
    return test_done("test_route");
}
