/* Prometheus metrics for /metrics: request latency histograms (TTFT, inter-token, end-to-end,
 * queue time), tokens per step, request outcomes by finish reason, HTTP requests by route and
 * status, scheduler gauges (running, waiting, KV usage, preemptions), prefix cache queries and
 * hits (in tokens) and per-device expert load (routed rows, expert FLOPs, busy seconds,
 * load-imbalance ratio over a recent window), and the placement: per-layer load imbalance
 * (label: layer only), replicas, experts per device, rebalances (count, duration, slots moved),
 * expert rows and tokens sent to other devices, all-to-all bytes per sending device, mean
 * routed expert width; per-expert routed tokens only when asked (models up to 256 experts).
 * Also vLLM's request-level histograms (prompt and generated tokens, max_tokens, n, prefill,
 * decode and inference time, time per output token), the process_* families of the Prometheus
 * client libraries, and moeserve_build_info.
 *
 * Threads: the observer hooks run on the scheduler thread, metrics_http on HTTP threads,
 * metrics_render on any; one mutex guards the counters (held for microseconds, never across a
 * forward pass). Ownership: metrics_create borrows the engine (NULL until it exists: set it with
 * metrics_set_engine before the scheduler starts); metrics_render returns a malloc'd string. */
#ifndef MOESERVE_METRICS_H
#define MOESERVE_METRICS_H

#include "engine.h"
#include "scheduler.h"

struct metrics;

struct metrics *metrics_create(void);
void metrics_free(struct metrics *mt);
void metrics_set_engine(struct metrics *mt, struct engine *e);
/* Optional, before the scheduler starts: the rebalancer whose counts and durations to export
 * (it belongs to the scheduler thread, where they are read), and per-expert series. */
struct rebal;
void metrics_set_rebalancer(struct metrics *mt, const struct rebal *r);
void metrics_set_per_expert(struct metrics *mt, bool on);
/* Hooks to pass in sched_params.obs. */
struct sched_observer metrics_observer(struct metrics *mt);
/* One generation request of n choices (vLLM's request_params_n). */
void metrics_request_n(struct metrics *mt, int n);
/* The device load-imbalance ratio of the last window (the periodic stats line). */
double metrics_imbalance(struct metrics *mt);
/* Counts one HTTP response. route: one of the server's route names, or "other". */
void metrics_http(struct metrics *mt, const char *route, int status);
/* Renders the exposition text; st may be NULL (before the scheduler exists). */
char *metrics_render(struct metrics *mt, const struct sched_stats *st, const char *model_name);

#endif
