/* Metrics implementation (see metrics.h): fixed-bucket histograms and counters under one mutex,
 * rendered into Prometheus text format 0.0.4 with HELP and TYPE lines for every family. */
#include "metrics.h"

#include <dirent.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "placement/placement.h"
#include "placement/rebalance.h"
#include "proto/response.h"

#define HIST_MAX 24
#define N_ROUTES   14
#define N_CODES    18
#define IMB_WINDOW 32 /* steps per load-imbalance window */

static const char *const route_names[N_ROUTES] = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/version",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/responses/{id}",
    "/v1/responses/{id}/cancel",
    "other",
};
static const int code_list[N_CODES] = {200, 400, 401, 404, 405, 408, 411, 413, 414,
                                       417, 429, 431, 500, 501, 503, 505, 529, 0};

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
/* request sizes in tokens: 1-2-5 steps as vLLM's */
static const double size_buckets[] = {1,     2,     5,     10,     20,     50,     100,
                                      200,   500,   1000,  2000,   5000,   10000,  20000,
                                      50000, 100000, 200000, 500000, 1000000};
/* whole-request phases (prefill, decode, inference): up to half an hour */
static const double phase_buckets[] = {0.01, 0.025, 0.05, 0.1,  0.25, 0.5,  1.0,   2.5,  5.0,  10.0,
                                       15.0, 20.0,  30.0, 40.0, 60.0, 120., 240.0, 480., 960., 1920.};
static const double n_buckets[] = {1, 2, 5, 10, 20};
static const double rebal_buckets[] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5};

struct metrics {
    pthread_mutex_t mu;
    struct engine *e;
    struct hist ttft, itl, e2e, queue, step_tokens;
    /* per finished request (vLLM's request-level histograms) */
    struct hist req_prompt, req_gen, req_max_gen, req_max_tokens, req_tpot, req_prefill,
        req_decode, req_inference, req_n;
    double t_start;                           /* wall clock at metrics_create */
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
    uint64_t cont_neurons; /* continuous experts: FFN neurons computed, all devices */
    int spec_k;            /* speculative decoding: num_speculative_tokens, 0 = off */
    /* placement, copied from the engine on the scheduler thread */
    int n_moe;
    int *moe_layer;            /* (n_moe) model layer of each MoE layer (the label) */
    double *layer_flops;       /* (n_moe, n_dev) now */
    double *layer_base;        /* (n_moe, n_dev) at the start of the window */
    double *layer_imb;         /* (n_moe) over the last window */
    uint64_t *away_rows, *away_tok; /* (n_dev) */
    double *comm_bytes;        /* (n_dev, n_dev) sent by each device (row) to each other one */
    int *dev_experts;          /* (n_dev) physical experts on each device, all layers */
    uint64_t rows_total, away_rows_win, rows_win, rows_base, away_base;
    double row_share;          /* rows sent off-device / rows, last window */
    double width_base, width_mean; uint64_t width_rows_base;
    int replicas;
    enum plc_policy policy;
    uint64_t seen_rebalances;  /* engine switches the device counts were taken at */
    bool placement_known;
    const struct rebal *rebal;
    uint64_t rebalances, rebalance_failures, moves;
    struct hist rebalance_s;
    bool per_expert;
    int n_expert;
    uint64_t *expert_rows;     /* (n_moe, n_expert) when per_expert */
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
    hist_init(&mt->rebalance_s, rebal_buckets, (int)(sizeof rebal_buckets / sizeof *rebal_buckets));
#define NB(a) (int)(sizeof a / sizeof *a)
    hist_init(&mt->req_prompt, size_buckets, NB(size_buckets));
    hist_init(&mt->req_gen, size_buckets, NB(size_buckets));
    hist_init(&mt->req_max_gen, size_buckets, NB(size_buckets));
    hist_init(&mt->req_max_tokens, size_buckets, NB(size_buckets));
    hist_init(&mt->req_tpot, itl_buckets, NB(itl_buckets));
    hist_init(&mt->req_prefill, phase_buckets, NB(phase_buckets));
    hist_init(&mt->req_decode, phase_buckets, NB(phase_buckets));
    hist_init(&mt->req_inference, phase_buckets, NB(phase_buckets));
    hist_init(&mt->req_n, n_buckets, NB(n_buckets));
#undef NB
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    mt->t_start = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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
    free(mt->moe_layer);
    free(mt->layer_flops);
    free(mt->layer_base);
    free(mt->layer_imb);
    free(mt->away_rows);
    free(mt->away_tok);
    free(mt->comm_bytes);
    free(mt->dev_experts);
    free(mt->expert_rows);
    free(mt);
}

/* The placement arrays, sized by the engine (scheduler not started yet: no lock needed for
 * the engine; the mutex guards the fields). */
static void placement_init(struct metrics *mt, struct engine *e)
{
    const struct model_desc *md = &engine_model(e)->desc;
    const struct engine_stats *es = engine_get_stats(e);
    int n = engine_get_params(e)->n_devices, L = es->n_moe_layers > 0 ? es->n_moe_layers : 1;
    int *moe_layer = malloc(sizeof(int) * (size_t)L);
    double *lf = calloc((size_t)L * n, sizeof(double)), *lb = calloc((size_t)L * n, sizeof(double));
    double *li = calloc((size_t)L, sizeof(double)), *cb = calloc((size_t)n * (size_t)n, sizeof(double));
    uint64_t *ar = calloc((size_t)n, sizeof(uint64_t)), *at = calloc((size_t)n, sizeof(uint64_t));
    int *de = calloc((size_t)n, sizeof(int));
    if (!moe_layer || !lf || !lb || !li || !cb || !ar || !at || !de) {
        free(moe_layer), free(lf), free(lb), free(li), free(cb), free(ar), free(at), free(de);
        return;
    }
    for (int l = 0, k = 0; l < md->n_layer && k < L; l++)
        if (md->layer_is_moe[l]) moe_layer[k++] = l;
    pthread_mutex_lock(&mt->mu);
    mt->n_moe = es->n_moe_layers;
    mt->moe_layer = moe_layer;
    mt->layer_flops = lf;
    mt->layer_base = lb;
    mt->layer_imb = li;
    mt->comm_bytes = cb;
    mt->away_rows = ar;
    mt->away_tok = at;
    mt->dev_experts = de;
    mt->n_expert = md->n_expert;
    pthread_mutex_unlock(&mt->mu);
}

void metrics_set_rebalancer(struct metrics *mt, const struct rebal *r)
{
    pthread_mutex_lock(&mt->mu);
    mt->rebal = r;
    pthread_mutex_unlock(&mt->mu);
}

void metrics_set_spec(struct metrics *mt, int k)
{
    pthread_mutex_lock(&mt->mu);
    mt->spec_k = k > SPEC_MAX_K ? SPEC_MAX_K : k;
    pthread_mutex_unlock(&mt->mu);
}

void metrics_set_per_expert(struct metrics *mt, bool on)
{
    pthread_mutex_lock(&mt->mu);
    if (on && !mt->expert_rows && mt->n_moe > 0 && mt->n_expert > 0)
        mt->expert_rows = calloc((size_t)mt->n_moe * mt->n_expert, sizeof(uint64_t));
    mt->per_expert = on && mt->expert_rows;
    pthread_mutex_unlock(&mt->mu);
}

/* On the scheduler thread, under the mutex: the placement counters out of the engine. */
static void placement_step(struct metrics *mt)
{
    struct engine *e = mt->e;
    const struct engine_stats *es = engine_get_stats(e);
    int N = mt->n_dev, L = mt->n_moe;
    if (!mt->layer_flops) return;
    memcpy(mt->layer_flops, es->layer_dev_flops, sizeof(double) * (size_t)L * N);
    const unsigned long long *cb = engine_comm_bytes(e);
    uint64_t away = 0, rows = 0;
    double width = 0.0;
    for (int d = 0; d < N; d++) {
        mt->away_rows[d] = es->dev_rows_away[d];
        mt->away_tok[d] = es->dev_tokens_away[d];
        away += es->dev_rows_away[d];
        rows += es->dev_routed_rows[d];
        width += es->dev_width_rows[d];
        for (int p = 0; p < N; p++) mt->comm_bytes[(size_t)d * N + p] = (double)cb[(size_t)d * N + p];
    }
    mt->rows_total = rows;
    /* mean routed width of the last step's rows */
    if (rows > mt->width_rows_base)
        mt->width_mean = (width - mt->width_base) / (double)(rows - mt->width_rows_base);
    mt->width_base = width;
    mt->width_rows_base = rows;
    if (!mt->placement_known || es->rebalances != mt->seen_rebalances) {
        const struct plc_map *m = engine_placement(e);
        mt->replicas = m->n_slots - m->n_expert;
        mt->policy = m->policy;
        for (int d = 0; d < N; d++) mt->dev_experts[d] = 0;
        for (size_t i = 0; i < (size_t)m->n_layer * m->n_slots; i++) mt->dev_experts[m->slot_dev[i]]++;
        mt->seen_rebalances = es->rebalances;
        mt->moves = es->rebalance_moves;
        mt->placement_known = true;
    }
    if (mt->rebal) {
        struct rebal_stats rs;
        rebal_get_stats(mt->rebal, &rs);
        if (rs.count > mt->rebalances) hist_add(&mt->rebalance_s, rs.last_s);
        mt->rebalances = rs.count;
        mt->rebalance_failures = rs.failures;
    }
    if (mt->per_expert) {
        const struct model_desc *md = &engine_model(e)->desc;
        for (int l = 0; l < L; l++)
            memcpy(mt->expert_rows + (size_t)l * mt->n_expert,
                   es->expert_rows + (size_t)mt->moe_layer[l] * md->n_expert,
                   sizeof(uint64_t) * (size_t)mt->n_expert);
    }
}

/* At the end of a window: per-layer imbalance and the share of rows sent off-device. */
static void placement_window(struct metrics *mt)
{
    int N = mt->n_dev, L = mt->n_moe;
    if (!mt->layer_flops) return;
    for (int l = 0; l < L; l++) {
        double mx = 0.0, sum = 0.0;
        for (int d = 0; d < N; d++) {
            double x = mt->layer_flops[(size_t)l * N + d] - mt->layer_base[(size_t)l * N + d];
            sum += x;
            mx = x > mx ? x : mx;
        }
        mt->layer_imb[l] = sum > 0 ? mx / (sum / N) : 0;
    }
    memcpy(mt->layer_base, mt->layer_flops, sizeof(double) * (size_t)L * N);
    uint64_t away = 0;
    for (int d = 0; d < N; d++) away += mt->away_rows[d];
    uint64_t drows = mt->rows_total - mt->rows_base, daway = away - mt->away_base;
    mt->row_share = drows ? (double)daway / (double)drows : 0.0;
    mt->rows_base = mt->rows_total;
    mt->away_base = away;
}

void metrics_set_engine(struct metrics *mt, struct engine *e)
{
    placement_init(mt, e);
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
        placement_step(mt); /* the placement as created (the scheduler is not running yet) */
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

static void on_request_done(void *ctx, const struct sched_req_done *d)
{
    struct metrics *mt = ctx;
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->req_prompt, d->n_prompt);
    hist_add(&mt->req_gen, d->n_generated);
    hist_add(&mt->req_max_tokens, d->max_tokens);
    if (d->prefill_s >= 0) hist_add(&mt->req_prefill, d->prefill_s);
    if (d->decode_s >= 0) hist_add(&mt->req_decode, d->decode_s);
    if (d->inference_s >= 0) hist_add(&mt->req_inference, d->inference_s);
    /* vLLM: decode time over the tokens after the first */
    if (d->decode_s >= 0 && d->n_generated > 1)
        hist_add(&mt->req_tpot, d->decode_s / (double)(d->n_generated - 1));
    pthread_mutex_unlock(&mt->mu);
}

void metrics_request_max_gen(struct metrics *mt, int max_generated)
{
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->req_max_gen, max_generated);
    pthread_mutex_unlock(&mt->mu);
}

void metrics_request_n(struct metrics *mt, int n)
{
    pthread_mutex_lock(&mt->mu);
    hist_add(&mt->req_n, n);
    pthread_mutex_unlock(&mt->mu);
}

double metrics_imbalance(struct metrics *mt)
{
    pthread_mutex_lock(&mt->mu);
    double v = mt->imbalance;
    pthread_mutex_unlock(&mt->mu);
    return v;
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
        mt->cont_neurons = 0;
        for (int d = 0; d < mt->n_dev; d++) mt->cont_neurons += es->dev_cont_neurons[d];
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
            placement_step(mt);
            placement_window(mt);
        } else {
            placement_step(mt);
        }
    }
    pthread_mutex_unlock(&mt->mu);
}

struct sched_observer metrics_observer(struct metrics *mt)
{
    struct sched_observer o = {.ctx = mt, .on_first_token = on_first_token, .on_token = on_token,
                               .on_finish = on_finish, .on_step = on_step,
                               .on_request_done = on_request_done};
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

/* Placement families (under the mutex). Labels: device, layer, policy; per expert only when
 * asked. */
static void render_placement(struct buf *b, const struct metrics *mt, const char *lab)
{
    int N = mt->n_dev;
    family(b, "moeserve_expert_load_imbalance", "gauge",
           "Max over mean of expert FLOPs per device in each MoE layer over the last window.");
    for (int l = 0; l < mt->n_moe; l++)
        bprintf(b, "moeserve_expert_load_imbalance{%s,layer=\"%d\"} %.6f\n", lab, mt->moe_layer[l],
                mt->layer_imb[l]);
    family(b, "moeserve_placement_info", "gauge", "The placement policy in use (value 1).");
    bprintf(b, "moeserve_placement_info{%s,policy=\"%s\"} 1\n", lab, plc_policy_name(mt->policy));
    family(b, "moeserve_expert_replicas", "gauge", "Redundant expert replicas per MoE layer.");
    bprintf(b, "moeserve_expert_replicas{%s} %d\n", lab, mt->replicas);
    family(b, "moeserve_device_experts", "gauge",
           "Physical experts (replicas included) each device holds, all MoE layers.");
    for (int d = 0; d < N; d++)
        bprintf(b, "moeserve_device_experts{%s,device=\"%d\"} %d\n", lab, d, mt->dev_experts[d]);
    family(b, "moeserve_placement_rebalances_total", "counter",
           "Live rebalances done (--rebalance-interval).");
    bprintf(b, "moeserve_placement_rebalances_total{%s} %llu\n", lab,
            (unsigned long long)mt->rebalances);
    family(b, "moeserve_placement_rebalance_failures_total", "counter",
           "Rebalances that failed (the old placement stayed).");
    bprintf(b, "moeserve_placement_rebalance_failures_total{%s} %llu\n", lab,
            (unsigned long long)mt->rebalance_failures);
    render_hist(b, "moeserve_placement_rebalance_duration_seconds",
                "Time a rebalance held the step loop (placement computed and switched).",
                &mt->rebalance_s, lab);
    family(b, "moeserve_placement_slots_moved_total", "counter",
           "Expert replicas added to or dropped from a device by placement switches.");
    bprintf(b, "moeserve_placement_slots_moved_total{%s} %llu\n", lab, (unsigned long long)mt->moves);
    family(b, "moeserve_expert_rows_total", "counter", "Token-expert rows computed, all devices.");
    bprintf(b, "moeserve_expert_rows_total{%s} %llu\n", lab, (unsigned long long)mt->rows_total);
    family(b, "moeserve_cross_device_rows_total", "counter",
           "Token-expert rows of each device's tokens computed on another device (the rows "
           "--dispatch rows sends).");
    for (int d = 0; d < N; d++)
        bprintf(b, "moeserve_cross_device_rows_total{%s,device=\"%d\"} %llu\n", lab, d,
                (unsigned long long)mt->away_rows[d]);
    family(b, "moeserve_cross_device_token_sends_total", "counter",
           "(token, other device) pairs: the rows --dispatch tokens sends.");
    for (int d = 0; d < N; d++)
        bprintf(b, "moeserve_cross_device_token_sends_total{%s,device=\"%d\"} %llu\n", lab, d,
                (unsigned long long)mt->away_tok[d]);
    family(b, "moeserve_cross_device_row_share", "gauge",
           "Share of expert rows computed on another device than their token's, last window.");
    bprintf(b, "moeserve_cross_device_row_share{%s} %.6f\n", lab, mt->row_share);
    family(b, "moeserve_all_to_all_bytes_total", "counter",
           "Bytes device sent to peer in the MoE all-to-all (dispatch and combine); sum by "
           "device for what a device sent.");
    for (int d = 0; d < N; d++)
        for (int p = 0; p < N; p++)
            if (p != d)
                bprintf(b, "moeserve_all_to_all_bytes_total{%s,device=\"%d\",peer=\"%d\"} %.0f\n",
                        lab, d, p, mt->comm_bytes[(size_t)d * N + p]);
    family(b, "moeserve_routed_expert_width_mean", "gauge",
           "Mean FFN width of the expert rows of the last step (MoHGE: narrow groups lower it).");
    bprintf(b, "moeserve_routed_expert_width_mean{%s} %.3f\n", lab, mt->width_mean);
    if (mt->per_expert) {
        family(b, "moeserve_expert_routed_tokens_total", "counter",
               "Tokens routed to each expert of each MoE layer (--metrics-per-expert).");
        for (int l = 0; l < mt->n_moe; l++)
            for (int x = 0; x < mt->n_expert; x++)
                bprintf(b, "moeserve_expert_routed_tokens_total{%s,layer=\"%d\",expert=\"%d\"} %llu\n",
                        lab, mt->moe_layer[l], x,
                        (unsigned long long)mt->expert_rows[(size_t)l * mt->n_expert + x]);
    }
}

/* The Prometheus client libraries' standard process_* families, from /proc (Linux). A value
 * that cannot be read is left out rather than reported as 0. */
static void render_process(struct buf *b, double t_start)
{
    long tick = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    FILE *f = fopen("/proc/self/stat", "r");
    char line[1024];
    if (f && fgets(line, sizeof line, f)) {
        /* fields after the ")" closing comm: state is field 3; utime 14, stime 15, vsize 23,
         * rss 24 (pages) */
        const char *p = strrchr(line, ')');
        unsigned long long utime = 0, stime = 0, vsize = 0, rss = 0;
        if (p && tick > 0 &&
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d "
                          "%*d %*d %*u %llu %llu",
                   &utime, &stime, &vsize, &rss) == 4) {
            /* getrusage has microseconds; /proc's clock ticks (10 ms) read 0 for a process
             * that has used less than a tick */
            struct rusage ru;
            double cpu = (double)(utime + stime) / (double)tick;
            if (getrusage(RUSAGE_SELF, &ru) == 0)
                cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
                      1e-6 * (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
            family(b, "process_cpu_seconds_total", "counter",
                   "Total user and system CPU time spent in seconds.");
            bprintf(b, "process_cpu_seconds_total %.6f\n", cpu);
            family(b, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
            bprintf(b, "process_virtual_memory_bytes %llu\n", vsize);
            family(b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
            bprintf(b, "process_resident_memory_bytes %llu\n", rss * (unsigned long long)page);
        }
    }
    if (f) fclose(f);
    family(b, "process_start_time_seconds", "gauge",
           "Start time of the process since unix epoch in seconds.");
    bprintf(b, "process_start_time_seconds %.3f\n", t_start);
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        long n = 0;
        for (struct dirent *de; (de = readdir(d));)
            if (de->d_name[0] != '.') n++;
        closedir(d);
        family(b, "process_open_fds", "gauge", "Number of open file descriptors.");
        bprintf(b, "process_open_fds %ld\n", n - 1); /* less the one reading the folder */
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        family(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
        bprintf(b, "process_max_fds %llu\n", (unsigned long long)rl.rlim_cur);
    }
}

/* One labelled counter: its family line and its value. */
static void counter(struct buf *b, const char *name, const char *help, const char *lab,
                    uint64_t v)
{
    family(b, name, "counter", help);
    bprintf(b, "%s{%s} %llu\n", name, lab, (unsigned long long)v);
}

/* vLLM's spec_decode_* counters, and the expert rows drafts cost (speculation on only). */
static void render_spec(struct buf *b, int k, const struct sched_stats *st, const char *lab)
{
    counter(b, "moeserve_spec_decode_num_drafts_total",
            "Verifications: a sequence's drafted tokens checked in one step.", lab,
            st->spec_drafts);
    counter(b, "moeserve_spec_decode_num_draft_tokens_total", "Drafted tokens verified.", lab,
            st->spec_draft_tokens);
    counter(b, "moeserve_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.", lab,
            st->spec_accepted_tokens);
    family(b, "moeserve_spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Drafted tokens accepted, by their position in the draft (0: the first).");
    for (int j = 0; j < k; j++)
        bprintf(b, "moeserve_spec_decode_num_accepted_tokens_per_pos_total{%s,position=\"%d\"} "
                   "%llu\n",
                lab, j, (unsigned long long)st->spec_accepted_per_pos[j]);
    counter(b, "moeserve_spec_decode_draft_expert_rows_total",
            "Token-expert rows computed for drafted positions (verification's expert reads).", lab,
            st->spec_draft_rows);
    counter(b, "moeserve_spec_decode_rejected_expert_rows_total",
            "Of those, the rows of drafts that were rejected: expert work speculation wasted.",
            lab, st->spec_rejected_rows);
    counter(b, "moeserve_spec_decode_state_rollbacks_total",
            "Hybrid models: recurrent states returned to their snapshot after a rejection.", lab,
            st->spec_rollbacks);
    counter(b, "moeserve_spec_decode_stopped_requests_total",
            "Requests that stopped speculating: adaptive MTP whose module feed cost more per "
            "step than its drafts gained.",
            lab, st->spec_stopped);
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

    family(&b, "moeserve_build_info", "gauge",
           "Build of this server (value 1): version, commit, CUDA compiled in.");
    bprintf(&b, "moeserve_build_info{version=\"%s\",commit=\"%s\",cuda=\"%s\"} 1\n",
            proto_version_string(), proto_commit_string(),
#ifdef MOESERVE_HAVE_CUDA
            "true"
#else
            "false"
#endif
    );
    render_process(&b, mt->t_start);
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
    if (mt->e) {
        /* memory per sequence: K/V per token, and hybrid models' recurrent state */
        family(&b, "moeserve_kv_cache_bytes_per_token", "gauge",
               "KV cache bytes one token takes over all attention layers, in the cache's type "
               "(int8: with its scales).");
        bprintf(&b, "moeserve_kv_cache_bytes_per_token{%s} %zu\n", lab,
                engine_kv_bytes_per_token(mt->e));
        family(&b, "moeserve_kv_cache_dtype_info", "gauge",
               "The KV cache's stored type (--kv-cache-dtype), as a label; the value is 1.");
        bprintf(&b, "moeserve_kv_cache_dtype_info{%s,dtype=\"%s\"} 1\n", lab,
                engine_kv_type_name(engine_kv(mt->e)->geom.type));
        family(&b, "moeserve_state_cache_bytes", "gauge",
               "Memory of the recurrent-state slots of hybrid models (one per --max-num-seqs "
               "sequence on each device, two with speculative decoding; 0 for attention-only "
               "models).");
        bprintf(&b, "moeserve_state_cache_bytes{%s} %zu\n", lab,
                engine_state_seq_bytes(mt->e) * (size_t)engine_get_params(mt->e)->max_seqs *
                    (engine_get_params(mt->e)->spec_state ? 2 : 1));
        family(&b, "moeserve_state_cache_bytes_per_seq", "gauge",
               "Recurrent-state bytes one sequence holds (hybrid models).");
        bprintf(&b, "moeserve_state_cache_bytes_per_seq{%s} %zu\n", lab,
                engine_state_seq_bytes(mt->e));
    }
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
    int spec_k = mt->spec_k;
    pthread_mutex_unlock(&mt->mu);
    if (spec_k > 0) render_spec(&b, spec_k, st, lab);

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
    /* vLLM's time_per_output_token_seconds is the inter-token latency under its older name */
    render_hist(&b, "moeserve_time_per_output_token_seconds",
                "Time between generated tokens (the inter-token latency, vLLM's older name).",
                &mt->itl, lab);
    render_hist(&b, "moeserve_request_time_per_output_token_seconds",
                "Per request: decode time over the generated tokens after the first.",
                &mt->req_tpot, lab);
    render_hist(&b, "moeserve_request_prompt_tokens", "Prompt tokens per finished request.",
                &mt->req_prompt, lab);
    render_hist(&b, "moeserve_request_generation_tokens",
                "Generated tokens per finished request.", &mt->req_gen, lab);
    render_hist(&b, "moeserve_request_max_num_generation_tokens",
                "Per finished request of n choices (each prompt): the most tokens one of its "
                "choices generated.",
                &mt->req_max_gen, lab);
    render_hist(&b, "moeserve_request_params_max_tokens", "max_tokens of each finished request.",
                &mt->req_max_tokens, lab);
    render_hist(&b, "moeserve_request_params_n", "n (choices) of each generation request.",
                &mt->req_n, lab);
    render_hist(&b, "moeserve_request_prefill_time_seconds",
                "Per request: first scheduled to first token.", &mt->req_prefill, lab);
    render_hist(&b, "moeserve_request_decode_time_seconds",
                "Per request: first token to last token.", &mt->req_decode, lab);
    render_hist(&b, "moeserve_request_inference_time_seconds",
                "Per request: first scheduled to last token.", &mt->req_inference, lab);
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
    if (mt->e && engine_model(mt->e)->desc.ffn == FFN_KIND_CONTINUOUS) {
        family(&b, "moeserve_continuous_neurons_total", "counter",
               "FFN neurons computed by continuous-experts (infmoe) layers, over tokens and "
               "layers: what the moe_samples / moe_neuron_fraction budget spends.");
        bprintf(&b, "moeserve_continuous_neurons_total{%s} %llu\n", lab,
                (unsigned long long)mt->cont_neurons);
    }
    if (mt->e && mt->layer_flops) render_placement(&b, mt, lab);
    pthread_mutex_unlock(&mt->mu);

    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
