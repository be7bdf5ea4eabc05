/* `moeserve generate`: loads a model folder, runs one prompt (chunked prefill, then decode one
 * token per step) and streams the continuation to stdout; prefill and decode speeds go to
 * stderr. It drives the same engine_step the server's scheduler uses. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cli.h"
#include "common.h"
#include "engine.h"
#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

static void generate_usage(FILE *f)
{
    fprintf(f,
            "usage: moeserve generate [--model DIR] --prompt TEXT [options]\n"
            "\n"
            "  -m, --model DIR          Hugging Face model folder (config.json, safetensors,\n"
            "                           tokenizer.json); default: the bundled " CLI_DEFAULT_MODEL "\n"
            "  -p, --prompt TEXT        prompt text\n"
            "  -n, --max-tokens N       tokens to generate (default 64)\n"
            "      --temperature T      0 = greedy (default 0)\n"
            "      --top-p P            nucleus sampling mass (default 1)\n"
            "      --top-k K            keep the K most likely tokens (default 0 = off)\n"
            "      --min-p P            drop tokens below P x the top probability (default 0)\n"
            "      --repetition-penalty R  (default 1 = off)\n"
            "      --seed S             sampling seed (same seed, same output)\n"
            "      --device cpu|cuda    compute backend: cpu, or cuda (GPU, bf16 weights)\n"
            "      --devices N          devices the experts are spread over (default 1)\n"
            "      --dispatch D         how tokens reach their experts' devices: tokens (once\n"
            "                           per device, partial sums back) or rows (once per\n"
            "                           expert) (default tokens)\n"
            "      --dtype D            auto (the checkpoint's dtype), bfloat16 or float32\n"
            "                           (default auto)\n"
            "      --quantization Q     none, int8 or int4 weights, made at load (default none)\n"
            "      --kv-cache-dtype T   what the KV cache stores: auto (the compute dtype: bf16\n"
            "                           or f32), bfloat16, float16, fp8_e4m3, fp8_e5m2, int8 or\n"
            "                           float32 (default auto)\n"
            "      --threads N          CPU threads (default: all online CPUs)\n"
            "      --quantization-cache keep converted/quantized weights in MODEL/.moeserve/ and\n"
            "                           map them from there the next time\n"
            "      --moe-top-k K        experts per token, at most the model's (default: model)\n"
            "      --moe-samples K      continuous-experts (infmoe) models: samples per token,\n"
            "                           at most the model's max_samples (default: num_samples)\n"
            "      --moe-neuron-fraction F  infmoe models: share of the FFN's neurons a sample\n"
            "                           keeps, at most the model's (default: neuron_fraction)\n"
            "      --moe-samples-adaptive  infmoe models with a calibration: --moe-samples is an\n"
            "                           average, each token's K from the router's uncertainty\n"
            "      --max-batch-tokens N prefill chunk size (default 512)\n"
            "      --ignore-eos         keep generating past the end-of-sequence token\n"
            "      --no-special         do not add the tokenizer's special tokens (BOS)\n"
            "  -h, --help               this text\n");
}

int cli_cont_budget(const struct model_desc *md, int samples, double fraction, char *err,
                    size_t errlen)
{
    bool cont = md->ffn == FFN_KIND_CONTINUOUS;
    if ((samples > 0 || fraction > 0) && !cont)
        return ms_errf(err, errlen, "%s applies to continuous-experts (infmoe) models only",
                       samples > 0 ? "--moe-samples" : "--moe-neuron-fraction");
    if (samples > 0 && samples > md->cont_max_samples)
        return ms_errf(err, errlen, "--moe-samples %d exceeds the model's max_samples %d", samples,
                       md->cont_max_samples);
    if (fraction > 0 && fraction > md->cont_fraction)
        return ms_errf(err, errlen, "--moe-neuron-fraction %g exceeds the model's neuron_fraction %g",
                       fraction, md->cont_fraction);
    return 0;
}

/* Option values: cli_parse_int and cli_parse_double for this command (floats narrowed). */
static int parse_int(const char *name, const char *s, long lo, long hi, int *out)
{
    return cli_parse_int("generate", name, s, lo, hi, out);
}

static int parse_float(const char *name, const char *s, double lo, double hi, float *out)
{
    double v;
    if (cli_parse_double("generate", name, s, lo, hi, &v) != 0) return -1;
    *out = (float)v;
    return 0;
}

struct gen_opts {
    const char *model;
    const char *prompt;
    int n;
    int devices;
    enum engine_dispatch dispatch;
    int threads;
    enum engine_backend backend;
    enum model_dtype dtype;
    enum model_quant quant;
    int kv_type;
    bool weight_cache;
    int moe_top_k;
    int moe_samples;
    float moe_fraction;
    bool moe_adaptive;
    int max_batch;
    bool ignore_eos;
    bool add_special;
    struct smp_params sp;
};

static int parse_args(int argc, char **argv, struct gen_opts *o)
{
    enum {
        OPT_TEMP = 256, OPT_TOPP, OPT_TOPK, OPT_MINP, OPT_REP, OPT_SEED, OPT_DEV, OPT_MOEK,
        OPT_BATCH, OPT_IGNORE_EOS, OPT_NO_SPECIAL, OPT_DEVICE, OPT_DTYPE, OPT_QUANT, OPT_THREADS,
        OPT_WCACHE, OPT_MOES, OPT_MOEF, OPT_MOEA, OPT_KVTYPE, OPT_DISPATCH,
    };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt", required_argument, 0, 'p'},
        {"max-tokens", required_argument, 0, 'n'},
        {"temperature", required_argument, 0, OPT_TEMP},
        {"top-p", required_argument, 0, OPT_TOPP},
        {"top-k", required_argument, 0, OPT_TOPK},
        {"min-p", required_argument, 0, OPT_MINP},
        {"repetition-penalty", required_argument, 0, OPT_REP},
        {"seed", required_argument, 0, OPT_SEED},
        {"devices", required_argument, 0, OPT_DEV},
        {"dispatch", required_argument, 0, OPT_DISPATCH},
        {"device", required_argument, 0, OPT_DEVICE},
        {"dtype", required_argument, 0, OPT_DTYPE},
        {"quantization", required_argument, 0, OPT_QUANT},
        {"kv-cache-dtype", required_argument, 0, OPT_KVTYPE},
        {"threads", required_argument, 0, OPT_THREADS},
        {"quantization-cache", no_argument, 0, OPT_WCACHE},
        {"moe-top-k", required_argument, 0, OPT_MOEK},
        {"moe-samples", required_argument, 0, OPT_MOES},
        {"moe-neuron-fraction", required_argument, 0, OPT_MOEF},
        {"moe-samples-adaptive", no_argument, 0, OPT_MOEA},
        {"max-batch-tokens", required_argument, 0, OPT_BATCH},
        {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
        {"no-special", no_argument, 0, OPT_NO_SPECIAL},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    memset(o, 0, sizeof *o);
    o->n = 64;
    o->devices = 1;
    o->max_batch = 512;
    o->add_special = true;
    o->kv_type = ENGINE_KV_AUTO;
    smp_params_default(&o->sp);
    o->sp.temperature = 0.0f; /* the CLI is greedy unless asked otherwise */
    optind = 1;
    int c, seed;
    while ((c = getopt_long(argc, argv, "m:p:n:h", longopts, NULL)) != -1) {
        int rc = 0;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'n': rc = parse_int("--max-tokens", optarg, 0, 1 << 20, &o->n); break;
        case OPT_TEMP: rc = parse_float("--temperature", optarg, 0, 100, &o->sp.temperature); break;
        case OPT_TOPP: rc = parse_float("--top-p", optarg, 0, 1, &o->sp.top_p); break;
        case OPT_TOPK: rc = parse_int("--top-k", optarg, 0, 1 << 24, &o->sp.top_k); break;
        case OPT_MINP: rc = parse_float("--min-p", optarg, 0, 1, &o->sp.min_p); break;
        case OPT_REP:
            rc = parse_float("--repetition-penalty", optarg, 0.01, 100,
                             &o->sp.repetition_penalty);
            break;
        case OPT_SEED:
            rc = parse_int("--seed", optarg, 0, 0x7fffffff, &seed);
            o->sp.seed = (uint64_t)seed;
            o->sp.has_seed = true;
            break;
        case OPT_DEV: rc = parse_int("--devices", optarg, 1, 64, &o->devices); break;
        case OPT_DISPATCH:
            if (engine_dispatch_parse(optarg, &o->dispatch) != 0) {
                fprintf(stderr, "moeserve generate: --dispatch must be " ENGINE_DISPATCH_NAMES
                                ", got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case OPT_DEVICE:
            if (engine_backend_parse(optarg, &o->backend) != 0) {
                fprintf(stderr, "moeserve generate: --device must be cpu or cuda, got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case OPT_DTYPE:
            if (model_dtype_parse(optarg, &o->dtype) != 0) {
                fprintf(stderr, "moeserve generate: --dtype must be auto, bfloat16 or float32, "
                                "got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case OPT_QUANT:
            if (model_quant_parse(optarg, &o->quant) != 0) {
                fprintf(stderr, "moeserve generate: --quantization must be none, int8 or int4, "
                                "got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case OPT_KVTYPE:
            if (engine_kv_type_parse(optarg, &o->kv_type) != 0) {
                fprintf(stderr, "moeserve generate: --kv-cache-dtype must be one of "
                                ENGINE_KV_TYPE_NAMES ", got '%s'\n",
                        optarg);
                rc = -1;
            }
            break;
        case OPT_THREADS: rc = parse_int("--threads", optarg, 0, 1024, &o->threads); break;
        case OPT_WCACHE: o->weight_cache = true; break;
        case OPT_MOEK: rc = parse_int("--moe-top-k", optarg, 1, 512, &o->moe_top_k); break;
        case OPT_MOES: rc = parse_int("--moe-samples", optarg, 1, 64, &o->moe_samples); break;
        case OPT_MOEA: o->moe_adaptive = true; break;
        case OPT_MOEF:
            rc = parse_float("--moe-neuron-fraction", optarg, 1e-9, 1.0, &o->moe_fraction);
            break;
        case OPT_BATCH: rc = parse_int("--max-batch-tokens", optarg, 1, 1 << 20, &o->max_batch); break;
        case OPT_IGNORE_EOS: o->ignore_eos = true; break;
        case OPT_NO_SPECIAL: o->add_special = false; break;
        case 'h': generate_usage(stdout); exit(0);
        default: generate_usage(stderr); return -1;
        }
        if (rc) return -1;
    }
    if (!o->model) {
        static char default_model[8192];
        if (!(o->model = cli_default_model(default_model, sizeof default_model))) {
            fprintf(stderr, "moeserve generate: %s\n", default_model);
            return -1;
        }
        fprintf(stderr, "model: %s (the bundled default)\n", o->model);
    }
    if (optind < argc) {
        fprintf(stderr, "moeserve generate: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->prompt) {
        fprintf(stderr, "moeserve generate: --prompt is required\n");
        generate_usage(stderr);
        return -1;
    }
    return 0;
}

static bool is_eos(const struct model *m, int32_t tok)
{
    for (int i = 0; i < m->desc.n_eos; i++)
        if (m->desc.eos_ids[i] == tok) return true;
    return false;
}

int cli_generate(int argc, char **argv)
{
    struct gen_opts o;
    if (parse_args(argc, argv, &o) != 0) return 2;

    char err[MS_ERR_LEN];
    struct model *m = NULL;
    struct engine *e = NULL;
    struct sampler *smp = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    struct kv_seq seq = {0};
    int status = 1;

    struct model_load_opts lo;
    model_load_opts_default(&lo);
    lo.progress = cli_progress;
    lo.progress_ctx = "loading weights";
    lo.dtype = o.dtype;
    lo.quant = o.quant;
    lo.threads = o.threads;
    lo.cache = o.weight_cache;
    if (model_load(o.model, &lo, &m, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve generate: %s\n", err);
        return 1;
    }
    if (m->cache_note[0]) fprintf(stderr, "%s\n", m->cache_note);
    if (m->skip_note[0]) fprintf(stderr, "%s\n", m->skip_note);
    const struct model_desc *md = &m->desc;
    if (o.moe_top_k > md->top_k && md->n_expert > 0) {
        fprintf(stderr, "moeserve generate: --moe-top-k %d exceeds the model's top-k %d\n",
                o.moe_top_k, md->top_k);
        goto out;
    }
    if (cli_cont_budget(md, o.moe_samples, o.moe_fraction, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve generate: %s\n", err);
        goto out;
    }
    if (o.moe_adaptive && (md->ffn != FFN_KIND_CONTINUOUS || md->cont_n_quant == 0)) {
        fprintf(stderr, "moeserve generate: --moe-samples-adaptive needs an infmoe model with an "
                        "adaptive_logvar_quantiles calibration (tools/train/calibrate.py)\n");
        goto out;
    }

    size_t plen = strlen(o.prompt);
    int cap = (int)plen + 8;
    ids = malloc(sizeof(int32_t) * (size_t)cap);
    if (!ids) goto oom;
    int n_prompt = tok_encode(m->tok, o.prompt, plen, o.add_special, ids, cap);
    if (n_prompt < 0) {
        fprintf(stderr, "moeserve generate: cannot tokenize the prompt\n");
        goto out;
    }
    if (n_prompt > cap) {
        int32_t *bigger = realloc(ids, sizeof(int32_t) * (size_t)n_prompt);
        if (!bigger) goto oom;
        ids = bigger;
        cap = n_prompt;
        n_prompt = tok_encode(m->tok, o.prompt, plen, o.add_special, ids, cap);
    }
    if (n_prompt == 0) {
        fprintf(stderr, "moeserve generate: the prompt is empty after tokenization\n");
        goto out;
    }

    struct engine_params ep;
    engine_params_default(&ep);
    ep.n_devices = o.devices;
    ep.dispatch = o.dispatch;
    ep.n_threads = o.threads;
    ep.backend = o.backend;
    ep.kv_type = o.kv_type;
    ep.max_seqs = 1;
    ep.max_batch_tokens = o.max_batch;
    int need = n_prompt + o.n;
    int limit = md->max_pos > 0 ? md->max_pos : need;
    if (need > limit) {
        fprintf(stderr,
                "moeserve generate: prompt (%d tokens) + %d new tokens exceed the model's %d "
                "positions\n",
                n_prompt, o.n, limit);
        goto out;
    }
    ep.max_model_len = need;
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        fprintf(stderr, "moeserve generate: %s\n", err);
        goto out;
    }
    if (o.backend != ENGINE_BACKEND_CUDA)
        fprintf(stderr, "cpu kernels: %s (cpu: %s); weights %.1f MB (--dtype %s, --quantization %s); "
                        "KV cache %s, %zu bytes a token\n",
                backend_cpu_kernels(), backend_cpu_features(), (double)m->weight_bytes / 1e6,
                model_dtype_name(m->dtype), model_quant_name(m->quant),
                engine_kv_type_name(engine_kv(e)->geom.type), engine_kv_bytes_per_token(e));
    if (engine_seq_init(e, &seq) != 0) goto oom;
    logits = malloc(sizeof(float) * (size_t)md->vocab);
    smp = smp_create(md->vocab, &o.sp);
    if (!logits || !smp) goto oom;
    for (int i = 0; i < n_prompt; i++) smp_accept(smp, ids[i], false);

    /* Prefill in chunks of max_batch_tokens; logits only for the last prompt token. */
    double t0 = ms_now();
    for (int done = 0; done < n_prompt;) {
        int chunk = n_prompt - done < o.max_batch ? n_prompt - done : o.max_batch;
        struct engine_item it = {
            .kv = &seq, .tokens = ids + done, .n_tokens = chunk, .pos = done,
            .moe_top_k = o.moe_top_k, .moe_samples = o.moe_samples,
            .moe_neuron_fraction = o.moe_fraction, .moe_samples_adaptive = o.moe_adaptive,
            .n_logits = done + chunk == n_prompt ? 1 : 0,
            .logits = logits,
        };
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "moeserve generate: %s\n", err);
            goto out;
        }
        done += chunk;
    }
    double t1 = ms_now();

    struct tok_stream ts;
    tok_stream_init(&ts, true);
    char piece[256];
    int n_gen = 0;
    for (int i = 0; i < o.n; i++) {
        int32_t tok = smp_sample(smp, logits, NULL);
        smp_accept(smp, tok, true);
        n_gen++;
        if (!o.ignore_eos && is_eos(m, tok)) break;
        int w = tok_stream_push(m->tok, &ts, tok, piece, sizeof piece);
        if (w > 0) {
            fwrite(piece, 1, (size_t)w, stdout);
            fflush(stdout);
        }
        if (i + 1 == o.n) break;
        struct engine_item it = {
            .kv = &seq, .tokens = &tok, .n_tokens = 1, .pos = n_prompt + i,
            .moe_top_k = o.moe_top_k, .moe_samples = o.moe_samples,
            .moe_neuron_fraction = o.moe_fraction, .moe_samples_adaptive = o.moe_adaptive,
            .n_logits = 1, .logits = logits,
        };
        if (engine_step(e, &it, 1, err, sizeof err) != 0) {
            fprintf(stderr, "\nmoeserve generate: %s\n", err);
            goto out;
        }
    }
    int w = tok_stream_flush(m->tok, &ts, piece, sizeof piece);
    if (w > 0) fwrite(piece, 1, (size_t)w, stdout);
    fputc('\n', stdout);
    double t2 = ms_now();
    /* The last sampled token needs no forward pass; decode speed counts the steps run. */
    int decode_steps = n_gen > 0 ? n_gen - 1 : 0;
    fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tokens/s)\n", n_prompt, t1 - t0,
            n_prompt / (t1 - t0));
    fprintf(stderr, "decode: %d tokens in %.3f s (%.1f tokens/s)\n", n_gen, t2 - t1,
            decode_steps > 0 ? decode_steps / (t2 - t1) : 0.0);
    status = 0;
    goto out;

oom:
    fprintf(stderr, "moeserve generate: out of memory\n");
out:
    if (e) engine_seq_free(e, &seq);
    smp_free(smp);
    free(logits);
    free(ids);
    engine_free(e);
    model_free(m);
    return status;
}
