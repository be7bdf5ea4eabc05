/* Metrics implementation (see metrics.h): fixed-bucket histograms and counters under one mutex,
 * rendered into Prometheus text format 0.0.4 with HELP and TYPE lines for every family. */
#include "metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HIST_MAX 24
#define N_ROUTES 9
#define N_CODES 17
#define IMB_WINDOW 32 /* steps per load-imbalance window */

static const char *const route_names[N_ROUTES] = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
    "/tokenize",       "/detokenize",          "/version",   "other",
};
static const int code_list[N_CODES] = {200, 400, 401, 404, 405, 408, 411, 413, 414,
                                       417, 429, 431, 500, 501, 503, 505, 0};

struct hist {
    int n;
    const double *le;            /* (n) upper bounds */
    uint64_t count[HIST_MAX + 1]; /* per bucket, last = +Inf */
    double sum;
    uint64_t total;
};

static const double lat_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                     0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0,
                                     80.0};
static const double itl_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                     0.15,  0.2,    0.3,   0.4,  0.5,   0.75, 1.0,   2.5};
static const double tok_buckets[] = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};

struct metrics {
    pthread_mutex_t mu;
    struct engine *e;
    struct hist ttft, itl, e2e, queue, step_tokens;
    uint64_t finished[5];                     /* by enum sched_finish */
    uint64_t http[N_ROUTES][N_CODES];
    /* per device, copied from the engine on the scheduler thread */
    int n_dev;
    uint64_t *routed;   /* (n_dev) */
    double *flops;      /* (n_dev) */
    double *busy;       /* (n_dev) */
    uint64_t *win_base; /* (n_dev) routed rows at the start of the current window */
    int win_steps;
    double imbalance;
};

static void hist_init(struct hist *h, const double *le, int n)
{
    memset(h, 0, sizeof *h);
    h->le = le;
    h->n = n;
}

static void hist_add(struct hist *h, double v)
{
    int b = 0;
    while (b < h->n && v > h->le[b]) b++;
    h->count[b]++;
    h->sum += v;
    h->total++;
}

struct metrics *metrics_create(void)
{
    struct metrics *mt = calloc(1, sizeof *mt);
    if (!mt) return NULL;
    pthread_mutex_init(&mt->mu, NULL);
    hist_init(&mt->ttft, lat_buckets, (int)(sizeof lat_buckets / sizeof *lat_buckets));
    hist_init(&mt->e2e, lat_buckets, (int)(sizeof lat_buckets / sizeof *lat_buckets));
    hist_init(&mt->queue, lat_buckets, (int)(sizeof lat_buckets / sizeof *lat_buckets));
    hist_init(&mt->itl, itl_buckets, (int)(sizeof itl_buckets / sizeof *itl_buckets));
    hist_init(&mt->step_tokens, tok_buckets, (int)(sizeof tok_buckets / sizeof *tok_buckets));
    return mt;
}

void metrics_free(struct metrics *mt)
{
    if (!mt) return;
    pthread_mutex_destroy(&mt->mu);
    free(mt->routed);
    free(mt->flops);
    free(mt->busy);
    free(mt->win_base);
    free(mt);
}

void metrics_set_engine(struct metrics *mt, struct engine *e)
{
    int n = engine_get_params(e)->n_devices;
    uint64_t *routed = calloc((size_t)n, sizeof *routed);
    double *flops = calloc((size_t)n, sizeof *flops);
    double *busy = calloc((size_t)n, sizeof *busy);
    uint64_t *base = calloc((size_t)n, sizeof *base);
    pthread_mutex_lock(&mt->mu);
    if (routed && flops && busy && base) {
        mt->e = e;
        mt->n_dev = n;
        mt->routed = routed;
        mt->flops = flops;
        mt->busy = busy;
        mt->win_base = base;
        routed = NULL, flops = NULL, busy = NULL, base = NULL;
    }
    pthread_mutex_unlock(&mt->mu);
    free(routed);
    free(flops);
    free(busy);
    free(base);
}

static void on_first_token(void *ctx, double ttft, double queue)
{
    struct metrics *mt = ctx;
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->ttft, ttft);
    hist_add(&mt->queue, queue);
    pthread_mutex_unlock(&mt->mu);
}

static void on_token(void *ctx, double itl)
{
    struct metrics *mt = ctx;
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->itl, itl);
    pthread_mutex_unlock(&mt->mu);
}

static void on_finish(void *ctx, enum sched_finish why, int n_prompt, int n_gen, double e2e)
{
    struct metrics *mt = ctx;
    pthread_mutex_lock(&mt->mu);
    if ((int)why >= 0 && (int)why < 5) mt->finished[why]++;
    hist_add(&mt->e2e, e2e);
    pthread_mutex_unlock(&mt->mu);
}

/* Runs on the scheduler thread, the only one that may read the engine's counters. */
static void on_step(void *ctx, int n_tokens, int n_seqs)
{
    struct metrics *mt = ctx;
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->step_tokens, n_tokens);
    if (mt->e) {
        const struct engine_stats *es = engine_get_stats(mt->e);
        for (int d = 0; d < mt->n_dev; d++) {
            mt->routed[d] = es->dev_routed_rows[d];
            mt->flops[d] = es->dev_expert_flops[d];
            mt->busy[d] = es->dev_busy_s[d];
        }
        if (++mt->win_steps >= IMB_WINDOW) {
            double max = 0, sum = 0;
            for (int d = 0; d < mt->n_dev; d++) {
                double x = (double)(mt->routed[d] - mt->win_base[d]);
                sum += x;
                if (x > max) max = x;
                mt->win_base[d] = mt->routed[d];
            }
            mt->imbalance = sum > 0 ? max / (sum / mt->n_dev) : 0;
            mt->win_steps = 0;
        }
    }
    pthread_mutex_unlock(&mt->mu);
}

struct sched_observer metrics_observer(struct metrics *mt)
{
    struct sched_observer o = {.ctx = mt, .on_first_token = on_first_token, .on_token = on_token,
                               .on_finish = on_finish, .on_step = on_step};
    return o;
}

void metrics_http(struct metrics *mt, const char *route, int status)
{
    int r = N_ROUTES - 1, c = N_CODES - 1;
    for (int i = 0; i < N_ROUTES - 1; i++)
        if (route && strcmp(route, route_names[i]) == 0) r = i;
    for (int i = 0; i < N_CODES - 1; i++)
        if (code_list[i] == status) c = i;
    pthread_mutex_lock(&mt->mu);
    mt->http[r][c]++;
    pthread_mutex_unlock(&mt->mu);
}

/* --- rendering ----------------------------------------------------------------------------- */

struct buf {
    char *s;
    size_t len, cap;
    bool oom;
};

static void bprintf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bprintf(struct buf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
}

static void family(struct buf *b, const char *name, const char *type, const char *help)
{
    bprintf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void render_hist(struct buf *b, const char *name, const char *help, const struct hist *h,
                        const char *labels)
{
    family(b, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->count[i];
        bprintf(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, labels, h->le[i],
                (unsigned long long)cum);
    }
    cum += h->count[h->n];
    bprintf(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels, (unsigned long long)cum);
    bprintf(b, "%s_sum{%s} %.9g\n", name, labels, h->sum);
    bprintf(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)h->total);
}

char *metrics_render(struct metrics *mt, const struct sched_stats *st, const char *model_name)
{
    struct buf b = {.s = malloc(16384), .cap = 16384};
    if (!b.s) return NULL;
    b.s[0] = '\0';
    char lab[320];
    snprintf(lab, sizeof lab, "model_name=\"%s\"", model_name ? model_name : "");
    struct sched_stats z = {0};
    if (!st) st = &z;

    family(&b, "moeserve_num_requests_running", "gauge", "Requests in the running batch.");
    bprintf(&b, "moeserve_num_requests_running{%s} %d\n", lab, st->running);
    family(&b, "moeserve_num_requests_waiting", "gauge", "Requests waiting to be scheduled.");
    bprintf(&b, "moeserve_num_requests_waiting{%s} %d\n", lab, st->waiting);
    family(&b, "moeserve_kv_cache_usage_perc", "gauge",
           "Fraction of KV cache blocks in use (cached but evictable blocks count as free).");
    bprintf(&b, "moeserve_kv_cache_usage_perc{%s} %.6f\n", lab,
            st->kv_blocks_total > 0
                ? 1.0 - (double)st->kv_blocks_free / (double)st->kv_blocks_total
                : 0.0);
    family(&b, "moeserve_kv_cache_blocks_free", "gauge", "Free KV cache blocks.");
    bprintf(&b, "moeserve_kv_cache_blocks_free{%s} %d\n", lab, st->kv_blocks_free);
    /* not "_total": promtool reserves that suffix for counters */
    family(&b, "moeserve_kv_cache_blocks", "gauge", "KV cache blocks in all.");
    bprintf(&b, "moeserve_kv_cache_blocks{%s} %d\n", lab, st->kv_blocks_total);
    family(&b, "moeserve_kv_cache_blocks_cached", "gauge",
           "Free KV cache blocks still holding a cached prefix (evicted when needed).");
    bprintf(&b, "moeserve_kv_cache_blocks_cached{%s} %d\n", lab, st->kv_blocks_cached);
    family(&b, "moeserve_prefix_cache_queries_total", "counter",
           "Tokens looked up in the prefix cache when requests were scheduled.");
    bprintf(&b, "moeserve_prefix_cache_queries_total{%s} %llu\n", lab,
            (unsigned long long)st->prefix_cache_queries);
    family(&b, "moeserve_prefix_cache_hits_total", "counter",
           "Tokens whose KV blocks were found in the prefix cache.");
    bprintf(&b, "moeserve_prefix_cache_hits_total{%s} %llu\n", lab,
            (unsigned long long)st->prefix_cache_hits);
    family(&b, "moeserve_num_preemptions_total", "counter",
           "Sequences preempted (recomputed) because KV blocks ran out.");
    bprintf(&b, "moeserve_num_preemptions_total{%s} %llu\n", lab,
            (unsigned long long)st->preemptions);
    family(&b, "moeserve_prompt_tokens_total", "counter", "Prefill tokens processed.");
    bprintf(&b, "moeserve_prompt_tokens_total{%s} %llu\n", lab,
            (unsigned long long)st->prompt_tokens);
    family(&b, "moeserve_generation_tokens_total", "counter", "Tokens generated.");
    bprintf(&b, "moeserve_generation_tokens_total{%s} %llu\n", lab,
            (unsigned long long)st->generation_tokens);
    family(&b, "moeserve_engine_steps_total", "counter", "Forward steps run.");
    bprintf(&b, "moeserve_engine_steps_total{%s} %llu\n", lab, (unsigned long long)st->steps);

    pthread_mutex_lock(&mt->mu);
    family(&b, "moeserve_request_success_total", "counter",
           "Finished requests by finish reason.");
    static const char *const reasons[5] = {NULL, "stop", "length", "abort", "error"};
    for (int i = 1; i < 5; i++)
        bprintf(&b, "moeserve_request_success_total{%s,finished_reason=\"%s\"} %llu\n", lab,
                reasons[i], (unsigned long long)mt->finished[i]);
    render_hist(&b, "moeserve_time_to_first_token_seconds", "Time to first token.", &mt->ttft,
                lab);
    render_hist(&b, "moeserve_inter_token_latency_seconds", "Time between generated tokens.",
                &mt->itl, lab);
    render_hist(&b, "moeserve_e2e_request_latency_seconds", "End-to-end request latency.",
                &mt->e2e, lab);
    render_hist(&b, "moeserve_request_queue_time_seconds", "Time waiting before the first step.",
                &mt->queue, lab);
    render_hist(&b, "moeserve_iteration_tokens", "Tokens per engine step.",
                &mt->step_tokens, lab);
    family(&b, "moeserve_http_requests_total", "counter", "HTTP responses by route and status.");
    for (int r = 0; r < N_ROUTES; r++)
        for (int c = 0; c < N_CODES; c++)
            if (mt->http[r][c])
                bprintf(&b, "moeserve_http_requests_total{route=\"%s\",code=\"%d\"} %llu\n",
                        route_names[r], code_list[c], (unsigned long long)mt->http[r][c]);
    family(&b, "moeserve_device_routed_tokens_total", "counter",
           "Token-expert rows computed on each device.");
    for (int d = 0; d < mt->n_dev; d++)
        bprintf(&b, "moeserve_device_routed_tokens_total{%s,device=\"%d\"} %llu\n", lab, d,
                (unsigned long long)mt->routed[d]);
    family(&b, "moeserve_device_expert_flops_total", "counter",
           "Expert FLOPs computed on each device.");
    for (int d = 0; d < mt->n_dev; d++)
        bprintf(&b, "moeserve_device_expert_flops_total{%s,device=\"%d\"} %.6g\n", lab, d,
                mt->flops[d]);
    family(&b, "moeserve_device_busy_seconds_total", "counter",
           "Seconds each device spent in expert compute.");
    for (int d = 0; d < mt->n_dev; d++)
        bprintf(&b, "moeserve_device_busy_seconds_total{%s,device=\"%d\"} %.6f\n", lab, d,
                mt->busy[d]);
    family(&b, "moeserve_load_imbalance_ratio", "gauge",
           "Max over mean of routed rows per device over the last window of steps.");
    bprintf(&b, "moeserve_load_imbalance_ratio{%s} %.6f\n", lab, mt->imbalance);
    pthread_mutex_unlock(&mt->mu);

    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
