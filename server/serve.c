/* `moeserve serve`: reads flags (each also from a MOESERVE_* environment variable), raises the
 * descriptor limit and sizes the connection cap from it, starts the HTTP front end at once (it
 * answers 503 while weights load), loads the model with a progress bar, creates the engine and
 * the scheduler loop, then waits for SIGTERM/SIGINT. On a signal it stops taking generation
 * requests (503), lets in-flight ones finish within a grace period, aborts the rest (every
 * stream still gets its final chunk and [DONE]), and exits 0; a second signal during the drain
 * cuts the grace to zero; a signal while the model loads exits 0 at once.
 *
 * Started by mpirun (`mpirun -np N moeserve serve ...`) or as one of --nnodes processes, every
 * process loads the model and runs one engine rank; rank 0 also runs the HTTP server and the
 * scheduler, and pings the other ranks while idle. When a rank fails (no answer within --comm-timeout), rank 0 logs which,
 * turns /health to 503, ends the requests in flight with an error, keeps answering 503 for
 * FAIL_LINGER_S seconds so that probes see it, and exits 1; the other ranks exit 1 on their own
 * deadline. */
#include "serve.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "cli.h"
#include "common.h"
#include "engine.h"
#include "http.h"
#include "metrics.h"
#include "model.h"
#include "comm_tcp.h"
#include "drafter.h"
#include "comm_mpi.h"
#include "proto/toolcall.h"
#include "scheduler.h"
#include "dash.h"
#include "serve_placement.h"
#include "slog.h"
#include "spec.h"

/* The scheduler's after-step hook: placement (trace, rebalancing), then the dashboard. */
struct after_step_ctx {
    struct splace *pl;
    struct dash *dash;
    int tags_declared; /* request tags (moe_tag) named in the routing trace so far */
};

static void serve_after_step(void *ctx, struct engine *e)
{
    struct after_step_ctx *a = ctx;
    /* a tag the step used was numbered before its request was queued: name it first */
    for (int n = a->dash ? dash_tag_count(a->dash) : 0; a->tags_declared < n; a->tags_declared++) {
        char name[80];
        dash_tag_name(a->dash, a->tags_declared, name, sizeof name);
        splace_trace_tag(a->pl, a->tags_declared, name);
    }
    splace_after_step(a->pl, e);
    if (a->dash) dash_after_step(a->dash, e);
}

enum opt_type { OPT_STR, OPT_INT, OPT_BYTES, OPT_BOOL };

struct serve_opts {
    const char *model, *host, *api_key, *served_name, *chat_template, *log_format, *device;
    const char *dtype, *quantization, *tool_parser, *reasoning_parser, *kv_dtype;
    long port, max_num_seqs, max_batched, max_model_len, devices, threads, max_waiting, grace_s;
    long keep_alive_s, read_timeout_s;
    long store_entries, store_ttl_s;
    long kv_bytes;
    long prefix_caching;
    long weight_cache;
    const char *placement, *placement_trace, *routing_stats, *record_routing;
    const char *dispatch;
    enum engine_dispatch dispatch_v; /* parsed --dispatch */
    long redundant, max_experts_per_dev, rebalance_s, half_life, record_max, per_expert;
    long placement_nodes;
    const char *collab_groups;
    long collab_reservoir;
    long access_log, stats_interval_s;
    long comm_timeout_s;
    const char *master_addr;
    long master_port;
    long nnodes, node_rank;
    long moe_samples;
    const char *moe_fraction;
    double moe_fraction_v; /* parsed --moe-neuron-fraction (0: the model's) */
    const char *spec_json;
    struct spec_config spec; /* parsed --speculative-config (method SPEC_OFF: none) */
};

struct opt_def {
    const char *name;   /* flag without dashes */
    const char *env;
    enum opt_type type;
    size_t off;         /* offset in struct serve_opts */
    long lo, hi;
    const char *help;
};

#define OFF(f) offsetof(struct serve_opts, f)
static const struct opt_def opt_defs[] = {
    {"model", "MOESERVE_MODEL", OPT_STR, OFF(model), 0, 0,
     "Hugging Face model folder (default: the bundled model in models/)"},
    {"host", "MOESERVE_HOST", OPT_STR, OFF(host), 0, 0, "address to listen on (127.0.0.1)"},
    {"port", "MOESERVE_PORT", OPT_INT, OFF(port), 0, 65535, "TCP port (8000; 0 = any free)"},
    {"api-key", "MOESERVE_API_KEY", OPT_STR, OFF(api_key), 0, 0,
     "require 'Authorization: Bearer KEY' on /v1/*"},
    {"served-model-name", "MOESERVE_SERVED_MODEL_NAME", OPT_STR, OFF(served_name), 0, 0,
     "model name in the API (default: the folder name)"},
    {"max-num-seqs", "MOESERVE_MAX_NUM_SEQS", OPT_INT, OFF(max_num_seqs), 1, 4096,
     "sequences per step (64)"},
    {"max-num-batched-tokens", "MOESERVE_MAX_NUM_BATCHED_TOKENS", OPT_INT, OFF(max_batched), 1,
     1 << 20, "tokens per step; longer prompts are prefilled in chunks (512)"},
    {"max-model-len", "MOESERVE_MAX_MODEL_LEN", OPT_INT, OFF(max_model_len), 0, 1 << 22,
     "positions per sequence (default: min(model, 4096))"},
    {"kv-cache-memory", "MOESERVE_KV_CACHE_MEMORY", OPT_BYTES, OFF(kv_bytes), 0, 0,
     "KV cache size, e.g. 512M or 4G, in bytes of the cache's type (default: room for "
     "max-num-seqs full sequences)"},
    {"kv-cache-dtype", "MOESERVE_KV_CACHE_DTYPE", OPT_STR, OFF(kv_dtype), 0, 0,
     "what the KV cache stores: auto (the compute dtype: bf16 for a bf16 checkpoint, f32 with "
     "--dtype float32), bfloat16, float16, fp8_e4m3 (fp8), fp8_e5m2, int8 or float32 (auto)"},
    {"device", "MOESERVE_DEVICE", OPT_STR, OFF(device), 0, 0,
     "cpu or cuda (NVIDIA GPU, bf16 weights) (cpu)"},
    {"devices", "MOESERVE_DEVICES", OPT_INT, OFF(devices), 1, 64,
     "devices the experts are spread over: CPU virtual devices, or GPUs 0..N-1 (1)"},
    {"dispatch", "MOESERVE_DISPATCH", OPT_STR, OFF(dispatch), 0, 0,
     "how the MoE layer moves a token to its experts' devices: tokens (its row once to each "
     "device, one partial sum back) or rows (a row per expert each way) (tokens); with "
     "several processes rank 0's applies"},
    {"dtype", "MOESERVE_DTYPE", OPT_STR, OFF(dtype), 0, 0,
     "auto (the checkpoint's: bf16 weights and activations for a bf16 checkpoint), bfloat16 "
     "or float32 (f32 weights and activations) (auto)"},
    {"quantization", "MOESERVE_QUANTIZATION", OPT_STR, OFF(quantization), 0, 0,
     "none, int8 or int4: quantize attention, expert and LM-head weights at load (none)"},
    {"threads", "MOESERVE_THREADS", OPT_INT, OFF(threads), 0, 1024,
     "CPU threads for the forward pass (0 = all online CPUs)"},
    {"quantization-cache", "MOESERVE_QUANTIZATION_CACHE", OPT_BOOL, OFF(weight_cache), 0, 1,
     "keep weights converted or quantized at load in MODEL/.moeserve/ and map them from there "
     "next time (off)"},
    {"chat-template", "MOESERVE_CHAT_TEMPLATE", OPT_STR, OFF(chat_template), 0, 0,
     "Jinja chat template file overriding tokenizer_config.json's"},
    {"tool-call-parser", "MOESERVE_TOOL_CALL_PARSER", OPT_STR, OFF(tool_parser), 0, 0,
     "the syntax tool calls are parsed and forced in: auto (from the tokenizer and chat "
     "template), hermes, qwen3_coder, glm45, minimax_m2, deepseek_v3, openai or llama3_json "
     "(auto)"},
    {"reasoning-parser", "MOESERVE_REASONING_PARSER", OPT_STR, OFF(reasoning_parser), 0, 0,
     "split a chat's <think> reasoning into reasoning_content: auto (when the tokenizer has "
     "<think> and </think>), none, or deepseek_r1, qwen3, glm45, minimax_m2 (on) (auto)"},
    {"log-format", "MOESERVE_LOG_FORMAT", OPT_STR, OFF(log_format), 0, 0, "text or json (text)"},
    {"access-log", "MOESERVE_ACCESS_LOG", OPT_BOOL, OFF(access_log), 0, 1,
     "log one line per HTTP request (on)"},
    {"log-stats-interval", "MOESERVE_LOG_STATS_INTERVAL", OPT_INT, OFF(stats_interval_s), 0,
     86400, "seconds between stats lines while busy (10; 0 = none)"},
    {"max-waiting", "MOESERVE_MAX_WAITING", OPT_INT, OFF(max_waiting), 1, 1 << 20,
     "queued requests before 429 (1024)"},
    {"response-store-size", "MOESERVE_RESPONSE_STORE_SIZE", OPT_INT, OFF(store_entries), 0,
     1 << 20, "Responses kept for GET and previous_response_id (1024; 0 = none)"},
    {"response-store-ttl", "MOESERVE_RESPONSE_STORE_TTL", OPT_INT, OFF(store_ttl_s), 1,
     30 * 86400, "seconds a stored response is kept (3600)"},
    {"shutdown-grace", "MOESERVE_SHUTDOWN_GRACE", OPT_INT, OFF(grace_s), 0, 3600,
     "seconds in-flight requests get to finish on SIGTERM (30)"},
    {"timeout-keep-alive", "MOESERVE_TIMEOUT_KEEP_ALIVE", OPT_INT, OFF(keep_alive_s), 1, 3600,
     "seconds an idle connection is kept, and a stalled read or write waits (5)"},
    {"timeout-request-read", "MOESERVE_TIMEOUT_REQUEST_READ", OPT_INT, OFF(read_timeout_s), 1,
     3600, "seconds a client has to send a whole request, else 408 (30)"},
    {"enable-prefix-caching", "MOESERVE_ENABLE_PREFIX_CACHING", OPT_BOOL, OFF(prefix_caching), 0,
     1, "reuse KV blocks of shared prompt prefixes (on; --no-enable-prefix-caching turns it off)"},
    {"expert-placement", "MOESERVE_EXPERT_PLACEMENT", OPT_STR, OFF(placement), 0, 0,
     "contiguous, mohge, eplb or c2r: which device computes which expert (mohge for MoHGE "
     "models, else contiguous)"},
    {"redundant-experts", "MOESERVE_REDUNDANT_EXPERTS", OPT_INT, OFF(redundant), 0, 1 << 20,
     "extra expert replicas per layer, given to the hottest experts (0)"},
    {"placement-nodes", "MOESERVE_PLACEMENT_NODES", OPT_INT, OFF(placement_nodes), 1, 4096,
     "eplb over this many nodes of equal device counts (hierarchical: experts split over the "
     "nodes first, co-activated ones together when statistics have co-activation, then eplb "
     "inside each node) (1)"},
    {"max-experts-per-device", "MOESERVE_MAX_EXPERTS_PER_DEVICE", OPT_INT,
     OFF(max_experts_per_dev), 0, 1 << 20,
     "expert slots a device holds per layer (0: the fewest that fit)"},
    {"placement-trace", "MOESERVE_PLACEMENT_TRACE", OPT_STR, OFF(placement_trace), 0, 0,
     "a routing trace (--record-routing, moeserve trace record) whose statistics place the "
     "experts at start (eplb, c2r)"},
    {"rebalance-interval", "MOESERVE_REBALANCE_INTERVAL", OPT_INT, OFF(rebalance_s), 0, 86400,
     "seconds between live rebalances from the routing statistics (0: off)"},
    {"routing-stats", "MOESERVE_ROUTING_STATS", OPT_STR, OFF(routing_stats), 0, 0,
     "auto, off, load or full (co-activation too): routing statistics kept (auto: what "
     "--rebalance-interval needs)"},
    {"routing-stats-half-life", "MOESERVE_ROUTING_STATS_HALF_LIFE", OPT_INT, OFF(half_life), 0,
     1L << 40, "routed tokens after which a token's weight in the statistics halves (65536; 0: "
     "no decay)"},
    {"record-routing", "MOESERVE_RECORD_ROUTING", OPT_STR, OFF(record_routing), 0, 0,
     "write every step's routing (experts per token and layer) to FILE"},
    {"record-routing-max-bytes", "MOESERVE_RECORD_ROUTING_MAX_BYTES", OPT_BYTES, OFF(record_max),
     0, 0, "rotate the routing trace to FILE.1 past this size (1G)"},
    {"moe-samples", "MOESERVE_MOE_SAMPLES", OPT_INT, OFF(moe_samples), 0, 64,
     "continuous-experts (infmoe) models: samples per token of requests without moe_samples "
     "(0 = the model's num_samples; at most its max_samples)"},
    {"moe-neuron-fraction", "MOESERVE_MOE_NEURON_FRACTION", OPT_STR, OFF(moe_fraction), 0, 0,
     "continuous-experts (infmoe) models: neuron fraction of requests without "
     "moe_neuron_fraction (the model's neuron_fraction; at most it)"},
    {"speculative-config", "MOESERVE_SPECULATIVE_CONFIG", OPT_STR, OFF(spec_json), 0, 0,
     "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
     "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}, or {\"model\": DRAFT_DIR, "
     "\"num_speculative_tokens\": 4, \"quantization\": \"int4\"}; \"adaptive\": false fixes k "
     "(off)"},
    {"metrics-per-expert", "MOESERVE_METRICS_PER_EXPERT", OPT_BOOL, OFF(per_expert), 0, 1,
     "export routed tokens per (layer, expert) (off; models up to 256 experts)"},
    {"collab-groups", "MOESERVE_COLLAB_GROUPS", OPT_STR, OFF(collab_groups), 0, 0,
     "a GROUPS.json of `moeserve analyze` for this model: the dashboard's collaboration groups"},
    {"collab-reservoir", "MOESERVE_COLLAB_RESERVOIR", OPT_INT, OFF(collab_reservoir), 0,
     1 << 24, "served tokens whose cross-layer routing is kept as a uniform sample for the "
     "dashboard's graph and group usage (0: off)"},
    {"comm-timeout", "MOESERVE_COMM_TIMEOUT", OPT_INT, OFF(comm_timeout_s), 1, 86400,
     "with several processes: seconds a rank may go without answering before it counts as "
     "failed (60)"},
    {"nnodes", "MOESERVE_NNODES", OPT_INT, OFF(nnodes), 1, 256,
     "without mpirun: processes (one engine device each) serving together; rank 0 serves HTTP "
     "(NNODES, else 1)"},
    {"node-rank", "MOESERVE_NODE_RANK", OPT_INT, OFF(node_rank), 0, 255,
     "without mpirun: this process's rank, 0..nnodes-1 (NODE_RANK, else 0)"},
    {"master-addr", "MOESERVE_MASTER_ADDR", OPT_STR, OFF(master_addr), 0, 0,
     "rank 0's address: the --nnodes rendezvous, and the NCCL one with --device cuda "
     "(MASTER_ADDR, else 127.0.0.1)"},
    {"master-port", "MOESERVE_MASTER_PORT", OPT_INT, OFF(master_port), 1, 65535,
     "rank 0's TCP port for them (MASTER_PORT, else 29500; NCCL takes the next port under "
     "--nnodes)"},
};
#define N_OPTS (sizeof opt_defs / sizeof *opt_defs)

static void serve_usage(FILE *f)
{
    fprintf(f, "usage: moeserve serve [options]   (also: moeserve [options])\n\n"
               "OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, "
               "/v1/models,\n/health, /metrics, /tokenize, /detokenize.\n\n");
    for (size_t i = 0; i < N_OPTS; i++)
        fprintf(f, "  --%-24s %s\n  %-26s [env %s]\n", opt_defs[i].name, opt_defs[i].help, "",
                opt_defs[i].env);
    fprintf(f, "  --%-24s %s\n", "help", "this text");
}

/* A bad flag or variable: "moeserve serve: MESSAGE" on stderr, and -1 (parse_opts' result for
 * it, which cli_serve turns into exit status 2). */
static int opt_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int opt_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("moeserve serve: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return -1;
}

/* The option named by the first nl characters of name, or NULL. */
static const struct opt_def *find_opt(const char *name, size_t nl)
{
    for (size_t k = 0; k < N_OPTS; k++)
        if (strlen(opt_defs[k].name) == nl && strncmp(opt_defs[k].name, name, nl) == 0)
            return &opt_defs[k];
    return NULL;
}

static int parse_bytes(const char *s, long *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return -1;
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B') end++;
    if (*end == 'B') end++;
    if (*end) return -1;
    *out = (long)(v * mul);
    return 0;
}

static int set_opt(struct serve_opts *o, const struct opt_def *d, const char *val,
                   const char *from)
{
    char *base = (char *)o + d->off;
    if (d->type == OPT_BOOL) {
        bool on = strcmp(val, "1") == 0 || strcasecmp(val, "true") == 0 ||
                  strcasecmp(val, "yes") == 0 || strcasecmp(val, "on") == 0;
        bool off = strcmp(val, "0") == 0 || strcasecmp(val, "false") == 0 ||
                   strcasecmp(val, "no") == 0 || strcasecmp(val, "off") == 0;
        if (!on && !off) return opt_fail("%s must be true or false, got '%s'", from, val);
        *(long *)base = on;
        return 0;
    }
    if (d->type == OPT_STR) {
        *(const char **)base = val;
        return 0;
    }
    if (d->type == OPT_INT) return cli_parse_long("serve", from, val, d->lo, d->hi, (long *)base);
    if (parse_bytes(val, (long *)base) != 0)
        return opt_fail("%s must be a size like 512M or 4G, got '%s'", from, val);
    return 0;
}

/* Returns 0, 1 for --help, -1 on a bad flag. */
static int parse_opts(int argc, char **argv, struct serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->max_num_seqs = 64;
    o->max_batched = 512;
    o->devices = 1;
    o->device = "cpu";
    o->dispatch = "tokens";
    o->dtype = "auto";
    o->kv_dtype = "auto";
    o->quantization = "none";
    o->log_format = "text";
    o->tool_parser = "auto";
    o->reasoning_parser = "auto";
    o->access_log = 1;
    o->stats_interval_s = 10;
    o->max_waiting = 1024;
    o->store_entries = 1024;
    o->store_ttl_s = 3600;
    o->grace_s = 30;
    o->keep_alive_s = 5;
    o->read_timeout_s = 30;
    o->prefix_caching = 1;
    o->half_life = 65536;
    o->record_max = 1L << 30;
    o->comm_timeout_s = 60;
    o->master_addr = NULL; /* MASTER_ADDR (torchrun's), else 127.0.0.1: see below */
    o->master_port = o->nnodes = o->node_rank = -1; /* likewise */
    o->model = NULL; /* the bundled model unless --model / MOESERVE_MODEL says otherwise */
    for (size_t i = 0; i < N_OPTS; i++) {
        const char *v = getenv(opt_defs[i].env);
        if (v && *v && set_opt(o, &opt_defs[i], v, opt_defs[i].env) != 0) return -1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) return 1;
        if (strncmp(a, "--", 2) != 0) return opt_fail("unexpected argument '%s'", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        bool negated = strncmp(name, "no-", 3) == 0;
        if (negated) name += 3;
        const struct opt_def *d = find_opt(name, eq ? (size_t)(eq - name) : strlen(name));
        if (!d || (negated && d->type != OPT_BOOL))
            return opt_fail("unknown option '%s' (see --help)", a);
        if (d->type == OPT_BOOL && !eq) { /* a switch: --flag or --no-flag */
            *(long *)((char *)o + d->off) = !negated;
            continue;
        }
        const char *val = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!val) return opt_fail("%s needs a value", a);
        if (set_opt(o, d, val, a) != 0) return -1;
    }
    if (!o->master_addr) {
        const char *v = getenv("MASTER_ADDR");
        o->master_addr = v && *v ? v : "127.0.0.1";
    }
    /* torchrun's variables stand in for flags not given */
    const char *torch_env[][2] = {{"master-port", "MASTER_PORT"}, {"nnodes", "NNODES"},
                                  {"node-rank", "NODE_RANK"}};
    long *torch_val[] = {&o->master_port, &o->nnodes, &o->node_rank};
    for (size_t i = 0; i < 3; i++) {
        const char *v = getenv(torch_env[i][1]);
        if (v && *v && *torch_val[i] < 0 &&
            set_opt(o, find_opt(torch_env[i][0], strlen(torch_env[i][0])), v,
                    torch_env[i][1]) != 0)
            return -1;
    }
    if (o->master_port < 0) o->master_port = 29500;
    if (o->nnodes < 0) o->nnodes = 1;
    if (o->node_rank < 0) o->node_rank = 0;
    if (o->node_rank >= o->nnodes)
        return opt_fail("--node-rank %ld must be below --nnodes %ld", o->node_rank, o->nnodes);
    if (!o->model) {
        static char default_model[8192];
        if (!(o->model = cli_default_model(default_model, sizeof default_model)))
            return opt_fail("%s", default_model);
    }
    /* the values with names: checked here, parsed again where they are used */
    enum tc_syntax tsyn;
    if (strcmp(o->tool_parser, "auto") != 0 && tc_syntax_parse(o->tool_parser, &tsyn) != 0)
        return opt_fail("--tool-call-parser must be auto, hermes, qwen3_coder, glm45, minimax_m2, "
                        "deepseek_v3, openai or llama3_json, got '%s'",
                        o->tool_parser);
    int think_mode;
    if (tc_reasoning_parse(o->reasoning_parser, &think_mode) != 0)
        return opt_fail("--reasoning-parser must be auto, none, deepseek_r1, qwen3, glm45 or "
                        "minimax_m2, got '%s'",
                        o->reasoning_parser);
    if (strcmp(o->log_format, "text") != 0 && strcmp(o->log_format, "json") != 0)
        return opt_fail("--log-format must be text or json");
    enum engine_backend b;
    if (engine_backend_parse(o->device, &b) != 0)
        return opt_fail("--device must be cpu or cuda, got '%s'", o->device);
    if (engine_dispatch_parse(o->dispatch, &o->dispatch_v) != 0)
        return opt_fail("--dispatch must be " ENGINE_DISPATCH_NAMES ", got '%s'", o->dispatch);
    enum model_dtype dt;
    if (model_dtype_parse(o->dtype, &dt) != 0)
        return opt_fail("--dtype must be auto, bfloat16 or float32, got '%s'", o->dtype);
    int kvt;
    if (engine_kv_type_parse(o->kv_dtype, &kvt) != 0)
        return opt_fail("--kv-cache-dtype must be one of " ENGINE_KV_TYPE_NAMES ", got '%s'",
                        o->kv_dtype);
    enum model_quant q;
    if (model_quant_parse(o->quantization, &q) != 0)
        return opt_fail("--quantization must be none, int8 or int4, got '%s'", o->quantization);
    if (o->moe_fraction) {
        char *end;
        errno = 0;
        o->moe_fraction_v = strtod(o->moe_fraction, &end);
        if (errno || end == o->moe_fraction || *end || !(o->moe_fraction_v > 0) ||
            o->moe_fraction_v > 1)
            return opt_fail("--moe-neuron-fraction must be a number in (0, 1], got '%s'",
                            o->moe_fraction);
    }
    char err[MS_ERR_LEN];
    if (o->spec_json && *o->spec_json &&
        spec_config_parse(o->spec_json, &o->spec, err, sizeof err) != 0)
        return opt_fail("--speculative-config: %s", err);
    struct splace_opts po = {.policy = o->placement, .routing_stats = o->routing_stats};
    if (splace_check_opts(&po, err, sizeof err) != 0) return opt_fail("%s", err);
    return 0;
}

static void slog(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void slog(const char *level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    slog_vmsg(level, fmt, ap);
    va_end(ap);
}

/* Says which tool-call syntax chats are parsed in (the server chooses it the same way). */
static void log_tool_syntax(const char *flag, const struct model *m)
{
    enum tc_syntax syn;
    bool given = tc_syntax_parse(flag, &syn) == 0;
    if (!given) syn = tc_syntax_of_model(m->tok, m->chat_template);
    slog("info", "tool calls: %s syntax (%s)", tc_syntax_name(syn),
         given ? "--tool-call-parser" : "detected from the tokenizer and chat template");
}

/* Says whether chats have their <think> reasoning split off (http.c decides it the same way). */
static void log_reasoning(const char *flag, const char *tool_flag, const struct model *m)
{
    int mode = -1;
    enum tc_syntax syn;
    (void)tc_reasoning_parse(flag, &mode);
    if (tc_syntax_parse(tool_flag, &syn) != 0) syn = tc_syntax_of_model(m->tok, m->chat_template);
    bool on = tc_reasoning_on(mode, m->tok, syn);
    slog("info", "reasoning: %s (%s)", on ? "<think> split into reasoning_content" : "left in the content",
         mode >= 0 ? "--reasoning-parser" : syn == TC_HARMONY ? "harmony channels" : "auto: the tokenizer's <think> tokens");
}

/* Model-load progress: the bar on a terminal; elsewhere (a container's log, a file) a log line
 * at every tenth, which a log collector keeps and a bar's carriage returns would garble. */
static void load_progress(void *ctx, double fraction)
{
    static int last_tenth = -1;
    static double t0;
    if (isatty(STDERR_FILENO)) {
        cli_progress(ctx, fraction);
        return;
    }
    if (last_tenth < 0) t0 = ms_now();
    int tenth = (int)(fraction * 10.0 + 1e-9);
    if (tenth <= last_tenth) return;
    last_tenth = tenth;
    slog("info", "loading weights: %d%% (%.1fs)", tenth * 10, ms_now() - t0);
}

/* vLLM's periodic stats line: throughput since the last line, queue, KV usage, prefix-cache
 * hits, device load imbalance. Logged only while there is or was work since the last one. */
struct stats_log {
    struct sched_stats last;
    double t_last;
};

static void log_stats(struct stats_log *sl, struct sched *s, struct metrics *mt)
{
    struct sched_stats st;
    sched_get_stats(s, &st);
    double now = ms_now(), dt = now - sl->t_last;
    uint64_t dp = st.prompt_tokens - sl->last.prompt_tokens;
    uint64_t dg = st.generation_tokens - sl->last.generation_tokens;
    uint64_t dq = st.prefix_cache_queries - sl->last.prefix_cache_queries;
    uint64_t dh = st.prefix_cache_hits - sl->last.prefix_cache_hits;
    if ((dp || dg || st.running || st.waiting) && dt > 0) {
        double kv = st.kv_blocks_total > 0
                        ? 100.0 * (1.0 - (double)st.kv_blocks_free / st.kv_blocks_total)
                        : 0.0;
        slog("info", "stats: prompt throughput %.1f tokens/s, generation throughput %.1f "
                     "tokens/s, running %d reqs, waiting %d reqs, KV cache usage %.1f%%, prefix "
                     "cache hit rate %.1f%%, device load imbalance %.3f",
             (double)dp / dt, (double)dg / dt, st.running, st.waiting, kv,
             dq ? 100.0 * (double)dh / (double)dq : 0.0, metrics_imbalance(mt));
    }
    sl->last = st;
    sl->t_last = now;
}

/* Scheduler warnings about one request (e.g. a grammar that allowed no token). */
static void log_sched_warning(void *ctx, uint64_t req_id, const char *msg)
{
    (void)ctx;
    slog("warning", "request %llu: %s", (unsigned long long)req_id, msg);
}

/* Descriptors kept back from the connection cap: model files, event loops, devices. */
#define FD_RESERVE 256

/* Raises RLIMIT_NOFILE's soft limit to the hard one (Debian starts services at 1024 while
 * allowing far more) and returns the connection cap it leaves room for. */
static int raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024 - FD_RESERVE;
    rlim_t before = rl.rlim_cur, want = rl.rlim_max;
    if (want == RLIM_INFINITY || want > (1u << 20)) {
        /* the kernel refuses more than fs.nr_open (1M by default) */
        want = 1u << 20;
        FILE *f = fopen("/proc/sys/fs/nr_open", "r");
        unsigned long nr;
        if (f && fscanf(f, "%lu", &nr) == 1 && nr < want) want = nr;
        if (f) fclose(f);
    }
    if (want > rl.rlim_cur) {
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) getrlimit(RLIMIT_NOFILE, &rl);
    }
    long cap = (long)rl.rlim_cur - FD_RESERVE;
    if (cap < 16) cap = 16;
    if (cap > (1 << 20)) cap = 1 << 20;
    char hard[32];
    if (rl.rlim_max == RLIM_INFINITY) snprintf(hard, sizeof hard, "unlimited");
    else snprintf(hard, sizeof hard, "%llu", (unsigned long long)rl.rlim_max);
    slog("info", "file descriptors: RLIMIT_NOFILE %llu (was %llu, hard limit %s); up to %ld "
         "connections", (unsigned long long)rl.rlim_cur, (unsigned long long)before, hard, cap);
    return (int)cap;
}

/* Shutdown signals. Every thread this process starts blocks SIGINT and SIGTERM, but a library
 * may start threads before main (OpenBLAS did, from its constructor) and those keep them
 * unblocked: the kernel can hand a signal to one of them, and the default action kills the
 * process (exit 143). So the signals get a handler that only writes the signal number to a
 * pipe, wherever it runs; one signal thread (the only one of ours with the signals unblocked)
 * reads the pipe and counts them for the main thread. */
enum { PHASE_LOADING, PHASE_SERVING };
static struct {
    int pipe[2];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int phase;
    int count; /* signals received */
    int last;
} sigs = {{-1, -1}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PHASE_LOADING, 0, 0};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t rc = write(sigs.pipe[1], &b, 1);
    (void)rc; /* a full pipe already holds enough signals */
    errno = saved;
}

static const char *sig_name(int sig)
{
    return sig == SIGTERM ? "SIGTERM" : "SIGINT";
}

static void *signal_thread(void *arg)
{
    sigset_t *set = arg;
    pthread_sigmask(SIG_UNBLOCK, set, NULL);
    for (;;) {
        unsigned char b;
        ssize_t n = read(sigs.pipe[0], &b, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return NULL;
        pthread_mutex_lock(&sigs.mu);
        if (sigs.phase == PHASE_LOADING) {
            /* Nothing is served yet and loading writes nothing: leave now rather than make
             * the orchestrator wait out a load that can take minutes. */
            slog("info", "%s while loading the model: exiting", sig_name(b));
            _exit(0);
        }
        sigs.count++;
        sigs.last = b;
        pthread_cond_broadcast(&sigs.cv);
        pthread_mutex_unlock(&sigs.mu);
    }
}

/* Blocks SIGINT/SIGTERM in this thread (and so in all it starts), installs the forwarding
 * handler and starts the signal thread. */
static int signals_start(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, set, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (pipe2(sigs.pipe, O_CLOEXEC) != 0) return -1;
    fcntl(sigs.pipe[1], F_SETFL, O_NONBLOCK); /* the handler must never block */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigfillset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    pthread_t t;
    if (pthread_create(&t, NULL, signal_thread, set) != 0) return -1;
    pthread_detach(t); /* lives until exit: a late signal still finds its reader */
    return 0;
}

/* Waits until `n` signals arrived or `until` (ms_now() seconds; 0 = no limit) passes. Returns
 * the number of signals so far; *last (may be NULL) gets the latest one. */
static int signals_wait(int n, double until, int *last)
{
    pthread_mutex_lock(&sigs.mu);
    while (sigs.count < n) {
        if (until <= 0) {
            pthread_cond_wait(&sigs.cv, &sigs.mu);
            continue;
        }
        double left = until - ms_now();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + (left < 0.05 ? left : 0.05);
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&sigs.cv, &sigs.mu, &ts);
    }
    int count = sigs.count;
    if (last) *last = sigs.last;
    pthread_mutex_unlock(&sigs.mu);
    return count;
}

/* Model load options from the flags (every rank loads the same way; only rank 0 shows the
 * progress bar). */
static void load_opts(const struct serve_opts *o, bool progress, struct model_load_opts *lo)
{
    model_load_opts_default(lo);
    lo->progress = progress ? load_progress : NULL;
    lo->progress_ctx = "loading weights";
    model_dtype_parse(o->dtype, &lo->dtype); /* checked by parse_opts */
    model_quant_parse(o->quantization, &lo->quant);
    lo->threads = (int)o->threads;
    lo->cache = o->weight_cache != 0;
    lo->mtp = o->spec.method == SPEC_MTP;
}

/* With several processes: the GPU of this process, its rank among the processes of its node
 * (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, or torchrun's LOCAL_RANK), so that a node's processes
 * take GPUs 0, 1, ...; 0 when neither is set (one process per node or pod). */
static int local_gpu(void)
{
    const char *v = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!v) v = getenv("LOCAL_RANK");
    return v ? atoi(v) : 0;
}

/* Engine parameters from the flags; mc: the MPI communicator (one device per process), nccl:
 * with --device cuda and several processes, the communicator of the expert rows. */
static void engine_opts(const struct serve_opts *o, struct comm *mc, struct comm *nccl,
                        struct engine_params *ep)
{
    engine_params_default(ep);
    ep->n_devices = mc ? mc->n_rank : (int)o->devices;
    ep->dispatch = o->dispatch_v;
    ep->n_threads = (int)o->threads;
    engine_backend_parse(o->device, &ep->backend); /* checked by parse_opts */
    ep->max_seqs = (int)o->max_num_seqs;
    ep->max_batch_tokens = (int)o->max_batched;
    ep->max_model_len = (int)o->max_model_len;
    ep->kv_cache_bytes = (size_t)o->kv_bytes;
    engine_kv_type_parse(o->kv_dtype, &ep->kv_type); /* checked by parse_opts */
    ep->moe_samples = (int)o->moe_samples;
    ep->moe_neuron_fraction = o->moe_fraction_v;
    ep->comm = mc;
    ep->data_comm = nccl;
    ep->cuda_device = local_gpu();
}

static struct splace_opts placement_opts(const struct serve_opts *o, const char *name)
{
    return (struct splace_opts){.policy = o->placement, .redundant = o->redundant,
                                .slots_per_dev = o->max_experts_per_dev,
                                .nodes = o->placement_nodes,
                                .trace = o->placement_trace, .interval_s = o->rebalance_s,
                                .routing_stats = o->routing_stats, .half_life = o->half_life,
                                .record = o->record_routing,
                                .record_max_bytes = o->record_max, .model_name = name,
                                .log = slog};
}

/* Flags a multi-process server cannot honour yet: 0, or -1 after logging why. */
static int check_multi_opts(const struct serve_opts *o)
{
    const char *bad = o->devices != 1          ? "--devices (each process is one device: "
                                                 "mpirun -np N gives N)"
                      : o->rebalance_s > 0     ? "--rebalance-interval"
                      : o->record_routing      ? "--record-routing"
                      : o->routing_stats && strcmp(o->routing_stats, "auto") != 0 &&
                                strcmp(o->routing_stats, "off") != 0
                          ? "--routing-stats"
                          : NULL;
    if (!bad) return 0;
    slog("error", "%s is not available with several processes yet", bad);
    return -1;
}

/* With several processes: what this rank sent to the others over the steps it ran, for the log
 * (bench/bench_mpi.py reads it): all-to-all (expert rows and their ids), and messages (step
 * plans, logits, status words, pings). */
static void log_traffic(struct engine *e, const struct comm *mc)
{
    const unsigned long long *b = engine_comm_bytes(e);
    unsigned long long sent = 0;
    for (int d = 0; d < mc->n_rank; d++) sent += b[(size_t)mc->self * mc->n_rank + d];
    const struct engine_stats *st = engine_get_stats(e);
    slog("info", "traffic: sent %llu bytes of expert rows and %llu bytes of messages to other "
         "ranks over %llu steps of %llu tokens",
         sent, mc->msg_bytes_sent, (unsigned long long)st->steps, (unsigned long long)st->tokens);
}

/* Ranks other than 0 (mpirun or --nnodes): load the model, build this rank's part of the engine and
 * run the steps rank 0 plans until it says stop (exit 0) or a rank fails (exit 1). */
static int serve_worker(const struct serve_opts *o, struct comm *mc, struct comm *nccl,
                        const char *name)
{
    char err[MS_ERR_LEN];
    int status = 1;
    struct model *m = NULL;
    struct engine *e = NULL;
    struct splace *pl = NULL;
    struct model_load_opts lo;
    load_opts(o, false, &lo);
    if (model_load(o->model, &lo, &m, err, sizeof err) != 0) {
        slog("error", "cannot load the model: %s", err);
        goto out;
    }
    struct engine_params ep;
    engine_opts(o, mc, nccl, &ep);
    if (cli_cont_budget(&m->desc, (int)o->moe_samples, o->moe_fraction_v, err, sizeof err) != 0) {
        slog("error", "%s", err); /* as rank 0 does: every rank stops */
        goto out;
    }
    struct splace_opts po = placement_opts(o, name);
    if (splace_prepare(&po, m, &ep, &pl, err, sizeof err) != 0) {
        slog("error", "%s", err);
        status = 2;
        goto out;
    }
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        slog("error", "%s", err);
        goto out;
    }
    pthread_mutex_lock(&sigs.mu);
    sigs.phase = PHASE_SERVING; /* signals go to rank 0's drain; this rank follows its plans */
    pthread_mutex_unlock(&sigs.mu);
    slog("info", "ready: device %d of %d", mc->self, mc->n_rank);
    if (engine_worker_run(e, err, sizeof err) != 0) {
        slog("error", "expert parallelism failed: %s; exiting", err);
        goto out;
    }
    slog("info", "stopped");
    status = 0;
out:
    if (e) log_traffic(e, mc);
    engine_free(e);
    splace_free(pl);
    model_free(m);
    return status;
}

/* Rank 0 of several processes: pings the other ranks while the server is idle (engine_ping skips while a
 * step runs), every interval_s, until told to stop or a ping fails. */
struct pinger {
    struct engine *e;
    double interval_s;
    atomic_bool stop;
    pthread_t thread;
    bool started;
};

static void *pinger_main(void *arg)
{
    struct pinger *p = arg;
    char err[MS_ERR_LEN];
    double next = ms_now() + p->interval_s;
    while (!atomic_load(&p->stop)) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
        if (ms_now() < next) continue;
        if (engine_ping(p->e, err, sizeof err) != 0) break; /* the main thread reports it */
        next = ms_now() + p->interval_s;
    }
    return NULL;
}

static void pinger_stop(struct pinger *p)
{
    if (!p->started) return;
    atomic_store(&p->stop, true);
    pthread_join(p->thread, NULL);
    p->started = false;
}

/* --speculative-config against the model: what the method needs (MTP layers; a draft model of
 * the same tokenizer, loaded into *draft), and hybrid models' spare state slots
 * (ep->spec_state). 0, or -1 after logging why (a flag error: status 2). */
static int spec_check(const struct serve_opts *o, const struct model *m, bool multi,
                      struct engine_params *ep, struct model **draft)
{
    char err[MS_ERR_LEN];
    const struct spec_config *sc = &o->spec;
    *draft = NULL;
    if (sc->method == SPEC_OFF) return 0;
    if (sc->method == SPEC_MTP) {
        const char *mt = m->desc.model_type;
        if (strcmp(mt, "minimax_m2") == 0) {
            /* MiniMax's config declares num_mtp_modules, but its published checkpoints carry
             * no trained mtp.* tensors and transformers has no such layer to check against */
            slog("error", "--speculative-config: method: mtp is not available for %s: its "
                          "config declares MTP modules, but MiniMax publishes no trained weights "
                          "for them (no mtp.* tensors); use ngram or a draft model",
                 mt);
            return -1;
        }
        if (m->desc.v4_attn) {
            /* DeepSeek-V4's MTP block (hyper-connections, compressed attention) is not bound */
            slog("error", "--speculative-config: method: mtp is not available for deepseek_v4 "
                          "yet: its MTP layer is not loaded; use ngram or a draft model");
            return -1;
        }
        if (m->desc.dsa_shared) {
            /* DeepSeek-V3.2's module block has an indexer of its own (test_mtp); GLM-5's
             * indexer_types covers the decoder only, and whether its module indexes or shares
             * has nothing to be checked against (transformers has no GLM-5 MTP layer) */
            slog("error", "--speculative-config: method: mtp is not available for %s yet: "
                          "whether its MTP layer has an indexer of its own or shares a "
                          "selection is not settled; use ngram or a draft model",
                 mt);
            return -1;
        }
        if (m->n_mtp <= 0) {
            slog("error", "--speculative-config: method: mtp needs a checkpoint with "
                          "multi-token-prediction layers (num_nextn_predict_layers); %s (%s) has "
                          "none",
                 o->model, mt);
            return -1;
        }
    }
    if (m->desc.n_linear > 0) {
        if (multi) {
            slog("error", "--speculative-config: speculative decoding on %s (recurrent layers) "
                          "is not available with several processes: the state to roll back "
                          "lives in the other processes",
                 m->desc.model_type);
            return -1;
        }
        ep->spec_state = true;
    }
    if (sc->method != SPEC_DRAFT_MODEL) return 0;
    struct model_load_opts lo;
    load_opts(o, false, &lo);
    lo.cache = false;
    if (sc->quantization[0]) model_quant_parse(sc->quantization, &lo.quant); /* checked */
    if (model_load(sc->model, &lo, draft, err, sizeof err) != 0) {
        slog("error", "--speculative-config: model: cannot load the draft model: %s", err);
        return -1;
    }
    if (drafter_check(m, *draft, err, sizeof err) != 0) {
        slog("error", "--speculative-config: %s", err);
        model_free(*draft);
        *draft = NULL;
        return -1;
    }
    return 0;
}

/* Seconds a failed multi-process server keeps answering 503 before it exits. */
#define FAIL_LINGER_S 2.0

int cli_serve(int argc, char **argv)
{
    struct serve_opts o;
    int pr = parse_opts(argc, argv, &o);
    if (pr == 1) {
        serve_usage(stdout);
        return 0;
    }
    if (pr != 0) return 2;
    slog_set_json(strcmp(o.log_format, "json") == 0);

    /* Several processes (mpirun, or --nnodes): every process runs one engine rank; rank 0 also
     * serves HTTP. Plans, logits and (on CPUs) expert rows go through MPI or a TCP star around
     * rank 0 (engine/comm/comm_tcp.h). */
    char err[MS_ERR_LEN];
    struct comm *mc = NULL, *nccl = NULL;
    bool use_mpi = comm_mpi_launched() > 1;
    int rank = 0, world = 1;
    if (use_mpi || o.nnodes > 1) {
        if (use_mpi && o.nnodes > 1) {
            slog("error", "--nnodes is for processes started without mpirun (mpirun -np N "
                          "gives N ranks)");
            return 2;
        }
        if (use_mpi && comm_mpi_init(&rank, &world, err, sizeof err) != 0) {
            slog("error", "started by mpirun, but: %s", err);
            return 2;
        }
        if (!use_mpi) {
            rank = (int)o.node_rank;
            world = (int)o.nnodes;
        }
        char prefix[32];
        snprintf(prefix, sizeof prefix, "[rank %d] ", rank);
        slog_set_prefix(prefix);
        if (check_multi_opts(&o) != 0) return 2;
        int timeout_ms = (int)o.comm_timeout_s * 1000;
        if (use_mpi) {
            mc = comm_mpi_create(timeout_ms, err, sizeof err);
        } else {
            /* pods of one group start in any order: joining may take several timeouts */
            slog("info", "joining rank 0 at %s:%ld (%d processes)", o.master_addr,
                 o.master_port, world);
            mc = comm_tcp_create(world, rank, o.master_addr, (int)o.master_port, timeout_ms,
                                 5 * timeout_ms, err, sizeof err);
        }
        if (!mc) {
            slog("error", "%s", err);
            return 1;
        }
        slog("info", "rank %d of %d, pid %d (%s): %s", rank, world, (int)getpid(),
             use_mpi ? "mpirun" : "--nnodes",
             rank == 0 ? "HTTP server, scheduler and device 0" : "one expert-parallel device");
        if (!use_mpi && rank == 0 && world > 2 && strcmp(o.device, "cuda") != 0)
            /* the TCP communicator is a star: rows between two other ranks pass through 0 */
            slog("warning", "--nnodes: expert rows between ranks other than 0 are relayed by "
                            "rank 0 (a TCP star); across machines, start the ranks with mpirun, "
                            "whose exchanges are direct");
        if (strcmp(o.device, "cuda") == 0) {
            /* expert rows over NCCL, bootstrapped over TCP at rank 0's address (the next port
             * when the master port carries the --nnodes control connections) */
            int port = (int)o.master_port + (use_mpi ? 0 : 1);
            slog("info", "NCCL rendezvous at %s:%d (GPU %d)", o.master_addr, port, local_gpu());
            nccl = engine_comm_nccl_world(world, rank, local_gpu(), o.master_addr, port,
                                          timeout_ms, err, sizeof err);
            if (!nccl) {
                slog("error", "%s", err);
                mc->ops->destroy(mc);
                return 1;
            }
        }
    }

    /* Before any thread of ours starts, so that all inherit the mask. */
    static sigset_t sigset;
    if (signals_start(&sigset) != 0) {
        slog("error", "cannot set up signal handling: %s", strerror(errno));
        return 1;
    }
    const char *name = o.served_name;
    if (!name) {
        const char *slash = strrchr(o.model, '/');
        name = slash && slash[1] ? slash + 1 : o.model;
    }
    if (rank != 0) {
        int st = serve_worker(&o, mc, nccl, name);
        char why[MS_ERR_LEN];
        bool broken = mc->ops->status(mc, why, sizeof why) != 0;
        if (nccl) nccl->ops->destroy(nccl);
        mc->ops->destroy(mc);
        /* with a failed peer, MPI_Finalize could wait on it */
        if (use_mpi && !broken) comm_mpi_finalize();
        /* mpirun --enable-recovery exits 0 whatever the ranks did: say it here */
        slog(st ? "error" : "info", "exiting with status %d", st);
        return st;
    }
    int max_conns = raise_nofile();

    int status = 1;
    struct pinger ping = {.interval_s = (double)o.comm_timeout_s / 4};
    struct model *m = NULL;
    struct engine *e = NULL;
    struct sched *s = NULL;
    struct http_server *h = NULL;
    struct splace *pl = NULL;
    struct dash *dash = NULL;
    struct model *draft = NULL;
    struct drafter *drafter = NULL;
    struct after_step_ctx asc = {0};
    struct metrics *mt = metrics_create();
    if (!mt) return 1;
    struct http_config hc = {.host = o.host, .port = (int)o.port, .api_key = o.api_key,
                             .model_name = name, .max_body = 1 << 20, .threads = 4,
                             .max_model_len = (int)o.max_model_len,
                             .max_waiting = (int)o.max_waiting, .max_conns = max_conns,
                             .keep_alive_s = (double)o.keep_alive_s,
                             .read_timeout_s = (double)o.read_timeout_s,
                             .access_log = o.access_log != 0, .tool_parser = o.tool_parser,
                             .reasoning_parser = o.reasoning_parser,
                             .response_store_entries = (int)o.store_entries,
                             .response_store_ttl_s = (double)o.store_ttl_s};
    if (http_start(&hc, mt, &h, err, sizeof err) != 0) {
        slog("error", "%s", err);
        goto out;
    }
    slog("info", "listening on http://%s:%d (loading %s)", o.host, http_port(h), o.model);

    struct model_load_opts lo;
    load_opts(&o, true, &lo);
    if (model_load(o.model, &lo, &m, err, sizeof err) != 0) {
        slog("error", "cannot load the model: %s", err);
        goto out;
    }
    slog("info", "weights: %.1f MB in memory (--dtype %s, --quantization %s)",
         (double)m->weight_bytes / 1e6, model_dtype_name(m->dtype), model_quant_name(m->quant));
    if (m->cache_note[0]) slog("info", "%s", m->cache_note);
    if (m->skip_note[0]) slog("info", "%s", m->skip_note);
    if (o.chat_template) {
        char *t = cli_read_file(o.chat_template, NULL);
        if (!t) {
            slog("error", "cannot read --chat-template %s", o.chat_template);
            goto out;
        }
        free(m->chat_template);
        m->chat_template = t;
    }
    struct engine_params ep;
    engine_opts(&o, mc, nccl, &ep);
    if (cli_cont_budget(&m->desc, (int)o.moe_samples, o.moe_fraction_v, err, sizeof err) != 0) {
        slog("error", "%s", err);
        goto out;
    }
    struct splace_opts po = placement_opts(&o, name);
    /* Placement errors are flag errors: the reason names the flag, the status is 2. */
    if (o.per_expert && m->desc.n_expert > 256) {
        slog("error", "--metrics-per-expert: %d experts, more than the 256 that per-expert series "
                      "are exported for",
             m->desc.n_expert);
        status = 2;
        goto out;
    }
    if (splace_prepare(&po, m, &ep, &pl, err, sizeof err) != 0) {
        slog("error", "%s", err);
        status = 2;
        goto out;
    }
    if (o.collab_reservoir > 0) ep.capture_routing = true; /* the dashboard's live sample */
    if (spec_check(&o, m, mc != NULL, &ep, &draft) != 0) {
        status = 2;
        goto out;
    }
    if (engine_create(m, &ep, &e, err, sizeof err) != 0) {
        slog("error", "%s", err);
        goto out;
    }
    if (draft && drafter_create(draft, engine_get_params(e), m->desc.vocab, o.spec.k, &drafter, err,
                                sizeof err) != 0) {
        slog("error", "--speculative-config: %s", err);
        status = 2;
        goto out;
    }
    if (o.spec.method == SPEC_MTP &&
        drafter_create_mtp(m, engine_get_params(e), o.spec.k, &drafter, err, sizeof err) != 0) {
        slog("error", "--speculative-config: %s", err);
        goto out;
    }
    if (o.spec.method != SPEC_OFF) {
        char how[sizeof o.spec.model + 128] = "";
        if (o.spec.method == SPEC_NGRAM)
            snprintf(how, sizeof how, ", n-grams of %d..%d tokens", o.spec.lookup_min,
                     o.spec.lookup_max);
        else if (draft)
            snprintf(how, sizeof how, ", draft model %s (%s, %.1f MB)", o.spec.model,
                     draft->desc.model_type, (double)draft->weight_bytes / 1e6);
        else if (o.spec.method == SPEC_MTP)
            snprintf(how, sizeof how, ", the checkpoint's MTP module (%s%d, %s FFN%s)",
                     m->mtp[0].chain_normed ? "mtp.layers." : "layer ",
                     m->mtp[0].chain_normed ? 0 : m->desc.n_layer, m->mtp[0].moe ? "MoE" : "dense",
                     m->mtp[0].head ? ", its own head" : "");
        slog("info", "speculative decoding: %s, up to %d draft token(s) per step (%s)%s%s",
             spec_method_name(o.spec.method), o.spec.k,
             o.spec.adaptive ? "adaptive" : "fixed", how,
             m->desc.n_linear > 0 ? "; recurrent states snapshot before each verification" : "");
    }
    {
        const struct kv_cache *kv = engine_kv(e);
        size_t tok = engine_kv_bytes_per_token(e);
        slog("info", "KV cache: %s, %zu bytes per token (%d of %d layers attend), %d blocks of %d "
                     "tokens: %.1f MiB, %zu tokens",
             engine_kv_type_name(kv->geom.type), tok, kv->n_kv_layers, m->desc.n_layer,
             kv->n_blocks, kv->block_size,
             (double)tok * kv->n_blocks * kv->block_size / (1 << 20),
             (size_t)kv->n_blocks * kv->block_size);
    }
    if (engine_state_seq_bytes(e) > 0) {
        size_t per = engine_state_seq_bytes(e);
        int slots = ep.max_seqs * (ep.spec_state ? 2 : 1);
        slog("info", "recurrent state: %.2f MiB per sequence, %d slots per device (%.1f MiB)%s",
             (double)per / (1 << 20), slots, (double)per * slots / (1 << 20),
             ep.spec_state ? "; a spare slot per sequence keeps the state before each "
                             "speculative verification" : "");
        if (o.prefix_caching) {
            slog("info", "prefix caching is off for %s: its Gated DeltaNet layers keep a "
                         "recurrent state that cached K/V blocks do not carry",
                 m->desc.model_type);
            o.prefix_caching = 0;
        }
    }
    if (dash_create(e, o.collab_groups, (int)o.collab_reservoir, &dash, err, sizeof err) != 0) {
        slog("error", "%s", err);
        status = 2;
        goto out;
    }
    asc = (struct after_step_ctx){.pl = pl, .dash = dash};
    http_set_dash(h, dash);
    if (mc) {
        ping.e = e;
        if (pthread_create(&ping.thread, NULL, pinger_main, &ping) != 0) {
            slog("error", "cannot start the rank pinger thread");
            goto out;
        }
        ping.started = true;
    }
    metrics_set_engine(mt, e);
    if (splace_start(pl, e, mt, err, sizeof err) != 0) {
        slog("error", "%s", err);
        status = 2;
        goto out;
    }
    metrics_set_per_expert(mt, o.per_expert != 0);
    metrics_set_spec(mt, o.spec.method != SPEC_OFF ? o.spec.k : 0);
    struct sched_params sp = {.max_num_seqs = (int)o.max_num_seqs,
                              .max_num_batched_tokens = (int)o.max_batched,
                              .max_waiting = (int)o.max_waiting,
                              .disable_prefix_caching = !o.prefix_caching,
                              .obs = metrics_observer(mt),
                              .after_step = serve_after_step, .after_step_ctx = &asc,
                              .spec = &o.spec, .drafter = drafter};
    sp.obs.on_warning = log_sched_warning;
    if (sched_create(e, &sp, &s, err, sizeof err) != 0 || sched_start(s, err, sizeof err) != 0) {
        slog("error", "%s", err);
        goto out;
    }
    http_set_ready(h, m, s, engine_get_params(e)->max_model_len);
    log_tool_syntax(o.tool_parser, m);
    log_reasoning(o.reasoning_parser, o.tool_parser, m);
    pthread_mutex_lock(&sigs.mu);
    sigs.phase = PHASE_SERVING;
    pthread_mutex_unlock(&sigs.mu);
    struct sched_stats st;
    sched_get_stats(s, &st);
    slog("info", "ready: model %s, %d KV blocks, max_model_len %d, %d %s device(s)%s", name,
         st.kv_blocks_total, engine_get_params(e)->max_model_len, ep.n_devices,
         engine_backend_name(ep.backend), mc ? ", one per process" : "");
    if (ep.backend != ENGINE_BACKEND_CUDA)
        slog("info", "cpu kernels: %s (cpu: %s)", backend_cpu_kernels(), backend_cpu_features());
    char pdesc[256];
    splace_describe(pl, pdesc, sizeof pdesc);
    slog("info", "%s", pdesc);

    /* Wait for a signal; log the stats line every --log-stats-interval; with several processes also
     * watch the other ranks every 0.1 s: a failure ends the server (see the top of this file). */
    int sig = 0;
    struct stats_log sl = {.t_last = ms_now()};
    sched_get_stats(s, &sl.last);
    for (;;) {
        double next = o.stats_interval_s > 0 ? sl.t_last + (double)o.stats_interval_s : 0;
        if (mc) next = next > 0 && next < ms_now() + 0.1 ? next : ms_now() + 0.1;
        if (signals_wait(1, next, &sig) >= 1) break;
        if (o.stats_interval_s > 0 && ms_now() >= sl.t_last + (double)o.stats_interval_s)
            log_stats(&sl, s, mt);
        char why[MS_ERR_LEN];
        if (!mc || !engine_failed(e, why, sizeof why)) continue;
        slog("error", "expert parallelism failed: %s; ending the requests in flight, "
                      "answering 503, exiting with status 1",
             why);
        http_set_failed(h, why);
        sched_close(s);
        sched_stop(s); /* what the failed steps did not already end */
        double until = ms_now() + FAIL_LINGER_S;
        while (ms_now() < until && signals_wait(1, ms_now() + 0.05, NULL) < 1) {
        }
        status = 1;
        goto out;
    }
    slog("info", "%s: draining (grace %lds; a second signal ends it now)", sig_name(sig),
         o.grace_s);
    http_set_draining(h);
    sched_close(s);
    double deadline = ms_now() + (double)o.grace_s;
    while (ms_now() < deadline) {
        sched_get_stats(s, &st);
        if (st.running == 0 && st.waiting == 0 && http_active_streams(h) == 0) break;
        if (signals_wait(2, ms_now() + 0.05, NULL) >= 2) {
            slog("info", "second signal: ending in-flight requests now");
            break;
        }
    }
    sched_stop(s); /* aborts what is left; suspended connections are resumed and answered */
    deadline = ms_now() + 2.0;
    while (http_active_streams(h) > 0 && ms_now() < deadline) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    slog("info", "stopped");
    status = 0;
out:
    http_stop(h);
    sched_free(s);
    splace_free(pl); /* after the scheduler: it closes the routing trace */
    pinger_stop(&ping);
    if (e && mc) log_traffic(e, mc);
    bool broken = e && engine_failed(e, NULL, 0);
    dash_free(dash);  /* after the scheduler and the HTTP threads, its two users */
    drafter_free(drafter); /* after the scheduler, which held its sequences */
    model_free(draft);
    engine_free(e); /* several processes: tells the other ranks to stop */
    model_free(m);
    metrics_free(mt);
    if (nccl) nccl->ops->destroy(nccl);
    if (mc) {
        broken = broken || mc->ops->status(mc, err, sizeof err) != 0;
        mc->ops->destroy(mc);
        /* with a failed peer, MPI_Finalize could wait on it */
        if (use_mpi && !broken) comm_mpi_finalize();
        if (broken && status == 0) status = 1;
        slog(status ? "error" : "info", "exiting with status %d", status);
    }
    return status;
}
