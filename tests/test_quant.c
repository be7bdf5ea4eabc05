/* Quantized weights in the forward pass: every fixture architecture loaded with
 * --quantization int8 and int4 against a reference made in the test from the same quantized
 * weights — each quantized matrix dequantized to f32 and run through the f32 path. What is left
 * between the two is the int8 quantization of activations (per block of 32) that the int8 dot
 * products need, so the bound is the size of that rounding, not of weight quantization. Also
 * checks which matrices are quantized (attention, experts, dense FFNs, LM head) and which stay
 * as they are (embeddings, routers; gpt-oss's MXFP4 experts stay MXFP4, then multiplied with
 * int8 activations too). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "test.h"

/* Bounds on the per-position normwise error of the logits. int8 activations of 127 levels per
 * block of 32 leave about 0.6% per product, 1-2% in the logits of these tiny random models
 * (the test prints the figures). A position where the two runs route a token to different
 * experts differs by much more (up to ~20% here): that is another computation, not rounding,
 * so such positions only meet the loose max; a wrong kernel moves every position. */
#define TOL_MEDIAN 3e-2
#define TOL_P90 5e-2
#define TOL_MAX 0.5

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct deq {
    float *bufs[4096];
    struct wmat *mats[64];
    int n_bufs, n_mats;
};

/* r (an f32 matrix of the reference model) takes q's dequantized values when q is quantized. */
static void take(struct deq *d, const struct wmat *q, const struct wmat *r)
{
    if (!q || !r || !wtype_is_quant(q->type) || d->n_bufs == 4096) return;
    float *f = malloc(sizeof(float) * (size_t)q->rows * q->cols);
    if (!f) return;
    for (int i = 0; i < q->rows; i++) wmat_row_f32(q, i, f + (size_t)i * q->cols);
    struct wmat *w = (struct wmat *)r; /* the reference model's own storage */
    w->type = WTYPE_F32;
    w->data = f;
    d->bufs[d->n_bufs++] = f;
}

static void take_ffn(struct deq *d, const struct ffn_w *q, const struct ffn_w *r)
{
    take(d, q->gate, r->gate);
    take(d, q->up, r->up);
    take(d, q->down, r->down);
}

static bool quantized(const struct wmat *w)
{
    return w && wtype_is_quant(w->type);
}

static void check_model(const char *tests, const char *name, enum model_quant quant)
{
    char dir[512], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.quant = quant;
    struct model *mq = NULL, *mr = NULL;
    struct st_archive *ref = NULL;
    struct deq d = {.n_bufs = 0};
    CHECKF(model_load(dir, &lo, &mq, err, sizeof err) == 0, "%s: %s", name, err);
    lo.quant = MODEL_QUANT_NONE;
    lo.dtype = MODEL_DTYPE_F32;
    CHECKF(model_load(dir, &lo, &mr, err, sizeof err) == 0, "%s: %s", name, err);
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s/reference.safetensors", tests, name);
    CHECKF(st_open_file(dir, &ref, err, sizeof err) == 0, "%s: %s", name, err);
    if (!mq || !mr || !ref) goto out;
    const struct model_desc *md = &mq->desc;

    /* What is quantized and what is not. */
    bool ok = quantized(mq->lm_head) && !quantized(mq->embed);
    for (int l = 0; l < md->n_layer; l++) {
        const struct layer_w *q = &mq->layers[l], *r = &mr->layers[l];
        if (md->layer_linear && md->layer_linear[l]) {
            /* Gated DeltaNet: the wide input projections and out_proj; b and a (a head's gates,
             * through exp and softplus) stay as stored */
            ok = ok && quantized(q->lin_in[0]) && quantized(q->lin_out) &&
                 (md->lin_kind == LIN_KIND_MAMBA2 ? !q->lin_in[1]
                  : md->lin_fused_in              ? !quantized(q->lin_in[1])
                                                  : quantized(q->lin_in[1]) &&
                                               !quantized(q->lin_in[2]) &&
                                               !quantized(q->lin_in[3]));
            for (int i = 0; i < 4; i++) take(&d, q->lin_in[i], r->lin_in[i]);
            take(&d, q->lin_out, r->lin_out);
        } else if (md->attn == ATTN_KIND_V4) {
            /* the projections; the hyper-connections' and compressors' stay as stored */
            ok = ok && quantized(q->wq_a) && quantized(q->wq_b) && quantized(q->v4_wkv) &&
                 quantized(q->v4_wo_a) && quantized(q->v4_wo_b) && !quantized(q->hc_fn[0]) &&
                 !quantized(q->cmp_wkv[0]);
            take(&d, q->wq_a, r->wq_a), take(&d, q->wq_b, r->wq_b);
            take(&d, q->v4_wkv, r->v4_wkv), take(&d, q->v4_wo_a, r->v4_wo_a);
            take(&d, q->v4_wo_b, r->v4_wo_b);
        } else if (md->attn == ATTN_KIND_MLA) {
            /* every projection, the absorbed key copy included (its own quantization) */
            ok = ok && quantized(q->wkv_a) && quantized(q->wkv_b) && quantized(q->w_uk_t) &&
                 quantized(q->wo) && (q->wq_a ? quantized(q->wq_b) : quantized(q->wq));
            take(&d, q->wq, r->wq), take(&d, q->wq_a, r->wq_a), take(&d, q->wq_b, r->wq_b);
            take(&d, q->wkv_a, r->wkv_a), take(&d, q->wkv_b, r->wkv_b);
            take(&d, q->w_uk_t, r->w_uk_t), take(&d, q->wo, r->wo);
        } else {
        ok = ok && quantized(q->wq) && quantized(q->wk) && quantized(q->wv) && quantized(q->wo);
        take(&d, q->wq, r->wq), take(&d, q->wk, r->wk), take(&d, q->wv, r->wv);
        take(&d, q->wo, r->wo);
        }
        if (!md->layer_is_moe[l]) {
            ok = ok && quantized(q->dense.gate);
            take_ffn(&d, &q->dense, &r->dense);
            continue;
        }
        ok = ok && !quantized(q->router) && !quantized(q->group_router);
        for (int e = 0; e < md->n_expert; e++) {
            ok = ok && quantized(q->experts[e].gate) && quantized(q->experts[e].down);
            /* MXFP4 experts (gpt-oss) stay MXFP4: already 4-bit, requantizing adds error */
            enum wtype want = strncmp(name, "gpt_oss", 7) == 0 ? WTYPE_MXFP4
                              : quant == MODEL_QUANT_INT8      ? WTYPE_Q8
                                                               : WTYPE_Q4;
            ok = ok && q->experts[e].gate->type == want && q->experts[e].down->type == want;
            take_ffn(&d, &q->experts[e], &r->experts[e]);
        }
        for (int s = 0; s < md->n_shared; s++) take_ffn(&d, &q->shared[s], &r->shared[s]);
    }
    CHECKF(ok, "%s %s: a matrix is quantized that should not be, or the reverse", name,
           model_quant_name(quant));
    if (mr->lm_head == mr->embed && d.n_mats < 64) {
        /* tied: the reference's head gets a matrix of its own, the embedding stays */
        struct wmat *h = malloc(sizeof *h);
        *h = *mr->embed;
        mr->lm_head = h;
        d.mats[d.n_mats++] = h;
    }
    take(&d, mq->lm_head, mr->lm_head);

    struct golden_prompt p[GOLDEN_MAX_PROMPTS];
    int np = golden_load_prompts(ref, p), V = md->vocab;
    /* both with an f32 KV cache: the difference is the weights' alone */
    struct engine *eq = golden_engine_kv(mq, 1, ENGINE_BACKEND_CPU, BE_KV_F32);
    struct engine *er = golden_engine_kv(mr, 1, ENGINE_BACKEND_CPU, BE_KV_F32);
    CHECK(eq && er && np >= 2);
    /* per position: ||logits - reference|| / ||reference|| */
    double errs[GOLDEN_MAX_PROMPTS * 128];
    int n_err = 0;
    for (int i = 0; i < np && eq && er; i++) {
        float *a = malloc(sizeof(float) * (size_t)p[i].n * V);
        float *b = malloc(sizeof(float) * (size_t)p[i].n * V);
        CHECK(golden_prefill(eq, &p[i], 0, a) == 0);
        CHECK(golden_prefill(er, &p[i], 0, b) == 0);
        for (int t = 0; t < p[i].n && n_err < GOLDEN_MAX_PROMPTS * 128; t++) {
            double num = 0, den = 0;
            for (int v = 0; v < V; v++) {
                double x = a[(size_t)t * V + v], y = b[(size_t)t * V + v];
                num += (x - y) * (x - y);
                den += y * y;
            }
            errs[n_err++] = sqrt(num / den);
        }
        free(a);
        free(b);
    }
    qsort(errs, (size_t)n_err, sizeof errs[0], cmp_double);
    double med = n_err ? errs[n_err / 2] : 1, p90 = n_err ? errs[n_err * 9 / 10] : 1,
           mx = n_err ? errs[n_err - 1] : 1;
    printf("%-16s %s: per-position error vs its weights dequantized in f32: median %.2e, "
           "90th percentile %.2e, max %.2e (%d positions)\n",
           name, model_quant_name(quant), med, p90, mx, n_err);
    /* DeepSeek-V3's group-limited routing flips two experts at once and scales them by 2.5: a
     * flipped position moves further (~0.6 here); median and 90th percentile are as tight. */
    double tol_max = md->router == ROUTER_KIND_SIGMOID_GROUP ? 0.7 : TOL_MAX;
    /* gpt-oss's fixture amplifies any rounding about 3x the others (transformers' own bf16 run
     * is 2.5-3.5% from its f32 run there, ~1% elsewhere: test_forward prints both), so int8
     * activations move it 3x as far. */
    double amp = md->expert_act == FFN_ACT_SWIGLU_OAI ? 3.0 : 1.0;
    if (amp > 1) tol_max = 0.8; /* a position routed otherwise: another computation */
    /* The hybrid fixtures (Gated DeltaNet) amplify rounding ~5x the others (transformers' own
     * bf16 run is 4-8% from its f32 run there), and their recurrent state carries a flipped
     * expert into every later position of the prompt, as a wrong attention output would:
     * 5x the median, 8x the 90th percentile, and a whole other computation at worst. */
    double amp90 = amp;
    /* top-1 routing (Llama 4) has no second expert to soften a flip: more positions move */
    if (md->top_k == 1) amp90 = 2.0;
    /* DeepSeek-V4's CSA indexer keeps 3 of up to 18 entries: int4 index keys and queries flip
     * selections as routing flips experts, and attention carries them to later positions
     * (int4: 90th percentile 0.15; with every entry kept 3.3e-2, as int8 and the sliding-only
     * fixture stay) */
    for (int l = 0; md->v4_attn && l < md->n_layer; l++)
        if (md->v4_attn[l] == V4_ATTN_CSA) amp90 = 3.5;
    if (md->n_linear > 0) {
        amp = 5.0;
        amp90 = 8.0;
        tol_max = 1.5;
    }
    CHECKF(med <= amp * TOL_MEDIAN && p90 <= amp90 * TOL_P90 && mx <= tol_max,
           "%s %s: median %.3g, 90th percentile %.3g, max %.3g", name, model_quant_name(quant),
           med, p90, mx);
    engine_free(eq);
    engine_free(er);
out:
    for (int i = 0; i < d.n_bufs; i++) free(d.bufs[i]);
    for (int i = 0; i < d.n_mats; i++) free(d.mats[i]);
    st_close(ref);
    model_free(mq);
    model_free(mr);
}

int main(int argc, char **argv)
{
    const char *tests = argc > 1 ? argv[1] : "tests";
    static const char *names[] = {"mixtral",      "qwen2_moe",      "qwen3_moe", "olmoe",
                                  "mohge_tiny",   "mixtral_bf16",   "qwen2_moe_bf16",
                                  "qwen3_moe_bf16", "olmoe_bf16",   "deepseek_v2",
                                  "deepseek_v2_group", "deepseek_v3", "deepseek_v3_bf16",
                                  "gpt_oss",      "gpt_oss_bf16",   "qwen3_next",
                                  "qwen3_5_moe",  "qwen3_5_moe_bf16", "granitemoehybrid",
                                  "granitemoehybrid_dense", "llama4_text", "deepseek_v4_sliding",
                                  "deepseek_v4"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        check_model(tests, names[i], MODEL_QUANT_INT8);
        check_model(tests, names[i], MODEL_QUANT_INT4);
    }
    return test_done("test_quant");
}
