/* The full forward pass on the CUDA backend against the CPU reference, on every fixture
 * checkpoint (tests/fixtures/models): the GPU runs bf16 weights with f32 accumulation, the CPU
 * f32. For each model: all reference prompts prefilled together in one step (every position's
 * logits), then greedy decoding of all of them together, one token per step, both engines fed
 * the CPU's choice. Checked:
 *   - the normwise relative logit error ||gpu - cpu|| / ||cpu|| of every step stays within the
 *     bf16 budget (GPU_LOGIT_TOL);
 *   - where the CPU's top token beats its runner-up by more than GPU_MARGIN of that position's
 *     logit range, the GPU picks the same token (closer calls may flip in bf16).
 * Prints one row per model with the worst error and how many positions were compared.
 *
 * Without a GPU (or a build without the CUDA backend) it prints why and exits 77 (skip).
 * `test_forward_gpu <tests-dir> --cpu-self-check` runs the harness with a second CPU engine in
 * place of the GPU, one that takes the engine's device-memory path (uploads, downloads, logits
 * in chunks: ENGINE_BACKEND_CPU_STAGED), on any machine: every error must then be at f32
 * rounding. */
#include <math.h>

#include "common.h"
#include "engine.h"
#include "golden.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"
#ifdef MOESERVE_HAVE_CUDA
#include "cuda/backend_cuda.h"
#endif

#define GPU_LOGIT_TOL 3e-2
#define GPU_MARGIN 0.05
#define GPU_STEPS 16

static const char *const MODELS[] = {"mixtral",      "mixtral_bf16",   "mixtral_sharded",
                                     "qwen2_moe",    "qwen2_moe_bf16", "qwen3_moe",
                                     "qwen3_moe_bf16", "olmoe",        "olmoe_bf16",
                                     "deepseek_v2",  "deepseek_v2_group", "deepseek_v3",
                                     "deepseek_v3_bf16", "gpt_oss", "gpt_oss_bf16",
                                     "mohge_tiny", "infmoe_tiny",
                                     /* DeepSeek-V4's sliding-only fixtures: its CSA fixture is
                                      * left to test_backend_ops's op checks, since bf16 flips
                                      * its indexer's near-tied choices (README) */
                                     "deepseek_v4_sliding", "deepseek_v4_sliding_bf16"};

static double norm_err(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)ref[i];
        num += isfinite(d) ? d * d : INFINITY;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Whether the CPU's choice at this position is clear: top-1 minus top-2 above GPU_MARGIN of
 * the logit range. */
static bool clear_margin(const float *cpu, int V)
{
    int top = golden_argmax(cpu, V);
    float second = -INFINITY, lo = INFINITY;
    for (int i = 0; i < V; i++) {
        if (i != top && cpu[i] > second) second = cpu[i];
        if (cpu[i] < lo) lo = cpu[i];
    }
    float range = cpu[top] - lo;
    return range > 0 && cpu[top] - second > GPU_MARGIN * range;
}

struct gpu_result {
    double worst_prefill, worst_decode;
    int compared, clear, agree;
};

/* Compares rows positions of logits: error, and argmax where the CPU's call is clear. */
static double compare_rows(const float *gpu, const float *cpu, int rows, int V,
                           struct gpu_result *r)
{
    for (int i = 0; i < rows; i++) {
        const float *g = gpu + (size_t)i * V, *c = cpu + (size_t)i * V;
        r->compared++;
        if (!clear_margin(c, V)) continue;
        r->clear++;
        r->agree += golden_argmax(g, V) == golden_argmax(c, V);
    }
    return norm_err(gpu, cpu, (size_t)rows * V);
}

static enum engine_backend dut_backend = ENGINE_BACKEND_CUDA;

static void check_model(const char *tests, const char *name, int n_dev)
{
    char dir[512], refpath[600], err[MS_ERR_LEN];
    snprintf(dir, sizeof dir, "%s/fixtures/models/%s", tests, name);
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", dir);
    struct model *m = NULL;
    struct st_archive *ref = NULL;
    struct engine *cpu = NULL, *gpu = NULL;
    struct kv_seq sc[GOLDEN_MAX_PROMPTS], sg[GOLDEN_MAX_PROMPTS];
    int n_seq = 0;
    float *lc = NULL, *lg = NULL;
    struct gpu_result r = {0};

    int rc = model_load(dir, NULL, &m, err, sizeof err);
    CHECKF(rc == 0, "%s: %s", name, err);
    int rc2 = st_open_file(refpath, &ref, err, sizeof err);
    CHECKF(rc2 == 0, "%s: %s", name, err);
    if (rc || rc2) goto out;
    struct golden_prompt p[GOLDEN_MAX_PROMPTS];
    int np = golden_load_prompts(ref, p);
    CHECKF(np >= 1, "%s: no reference prompts", name);
    int V = m->desc.vocab, total = 0;
    for (int i = 0; i < np; i++) total += p[i].n;
    lc = malloc(sizeof(float) * (size_t)total * V);
    lg = malloc(sizeof(float) * (size_t)total * V);
    cpu = golden_engine_on(m, 1, ENGINE_BACKEND_CPU);
    gpu = golden_engine_on(m, n_dev, dut_backend);
    CHECKF(cpu && gpu && lc && lg, "%s: engines (%d devices)", name, n_dev);
    if (!cpu || !gpu || !lc || !lg) goto out;

    /* Prefill: every prompt in one step, logits for every position. */
    struct engine_item ic[GOLDEN_MAX_PROMPTS], ig[GOLDEN_MAX_PROMPTS];
    int32_t next[GOLDEN_MAX_PROMPTS];
    for (int i = 0, off = 0; i < np; i++, n_seq++) {
        if (engine_seq_init(cpu, &sc[i]) != 0 || engine_seq_init(gpu, &sg[i]) != 0) {
            CHECKF(0, "%s: seq init", name);
            goto out;
        }
        ic[i] = (struct engine_item){.kv = &sc[i], .tokens = p[i].ids, .n_tokens = p[i].n,
                                     .n_logits = p[i].n, .logits = lc + (size_t)off * V};
        ig[i] = ic[i];
        ig[i].kv = &sg[i];
        ig[i].logits = lg + (size_t)off * V;
        off += p[i].n;
    }
    rc = engine_step(cpu, ic, np, err, sizeof err);
    CHECKF(rc == 0, "%s: cpu prefill: %s", name, err);
    rc2 = engine_step(gpu, ig, np, err, sizeof err);
    CHECKF(rc2 == 0, "%s: gpu prefill: %s", name, err);
    if (rc || rc2) goto out;
    r.worst_prefill = compare_rows(lg, lc, total, V, &r);

    /* Decode: both engines take the CPU's token, so their inputs never part. */
    for (int i = 0, off = 0; i < np; i++) {
        off += p[i].n;
        next[i] = golden_argmax(lc + (size_t)(off - 1) * V, V);
    }
    for (int t = 0; t < GPU_STEPS; t++) {
        for (int i = 0; i < np; i++) {
            ic[i] = (struct engine_item){.kv = &sc[i], .tokens = &next[i], .n_tokens = 1,
                                         .pos = p[i].n + t, .n_logits = 1,
                                         .logits = lc + (size_t)i * V};
            ig[i] = ic[i];
            ig[i].kv = &sg[i];
            ig[i].logits = lg + (size_t)i * V;
        }
        rc = engine_step(cpu, ic, np, err, sizeof err);
        CHECKF(rc == 0, "%s: cpu decode: %s", name, err);
        rc2 = engine_step(gpu, ig, np, err, sizeof err);
        CHECKF(rc2 == 0, "%s: gpu decode step %d: %s", name, t, err);
        if (rc || rc2) goto out;
        double e = compare_rows(lg, lc, np, V, &r);
        if (e > r.worst_decode) r.worst_decode = e;
        for (int i = 0; i < np; i++) next[i] = golden_argmax(lc + (size_t)i * V, V);
    }
    printf("%-16s %4d %12.3e %12.3e %9d %7d %7d\n", name, n_dev, r.worst_prefill, r.worst_decode,
           r.compared, r.clear, r.agree);
    CHECKF(r.worst_prefill <= GPU_LOGIT_TOL && r.worst_decode <= GPU_LOGIT_TOL,
           "%s: logit error prefill %.3e decode %.3e > %.0e", name, r.worst_prefill,
           r.worst_decode, GPU_LOGIT_TOL);
    CHECKF(r.agree == r.clear, "%s: GPU top token differs at %d of %d clear positions", name,
           r.clear - r.agree, r.clear);
    CHECKF(r.clear > 0, "%s: no position with a clear margin to compare", name);
    /* Same f32 arithmetic, except that the staged path computes a step's logits in one GEMM
     * (the CPU path one per sequence), which BLAS may round differently. */
    if (dut_backend == ENGINE_BACKEND_CPU_STAGED)
        CHECKF(r.worst_prefill <= 1e-5 && r.worst_decode <= 1e-5,
               "%s: the staged CPU engine differs from the CPU engine", name);

out:
    for (int i = 0; i < n_seq; i++) {
        engine_seq_free(cpu, &sc[i]);
        engine_seq_free(gpu, &sg[i]);
    }
    engine_free(cpu);
    engine_free(gpu);
    free(lc);
    free(lg);
    if (ref) st_close(ref);
    model_free(m);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: test_forward_gpu <tests-dir>\n");
        return 2;
    }
    if (argc > 2 && strcmp(argv[2], "--cpu-self-check") == 0) {
        dut_backend = ENGINE_BACKEND_CPU_STAGED;
        printf("self-check: a CPU engine driven as a device (staged memory) in place of the GPU\n");
    }
#ifdef MOESERVE_HAVE_CUDA
    if (dut_backend == ENGINE_BACKEND_CUDA && backend_cuda_device_count() == 0) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
#else
    if (dut_backend == ENGINE_BACKEND_CUDA) {
        printf("SKIP: built without the CUDA backend\n");
        return 77;
    }
#endif
    printf("CUDA (bf16 weights) vs CPU (f32): normwise logit error, argmax where the CPU's margin "
           "> %.0f%% of the range\n",
           GPU_MARGIN * 100);
    printf("%-16s %4s %12s %12s %9s %7s %7s\n", "model", "devs", "prefill_err", "decode_err",
           "positions", "clear", "agree");
    /* Two devices (attention on the first, experts spread: expert parallelism over the
     * communicator) where there are two. */
    int max_dev = 2;
#ifdef MOESERVE_HAVE_CUDA
    if (dut_backend == ENGINE_BACKEND_CUDA && backend_cuda_device_count() < 2) max_dev = 1;
#endif
    for (int n_dev = 1; n_dev <= max_dev; n_dev++)
        for (size_t i = 0; i < sizeof MODELS / sizeof MODELS[0]; i++)
            check_model(argv[1], MODELS[i], n_dev);
    return test_done("test_forward_gpu");
}
