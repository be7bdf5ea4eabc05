/* The live MoE view behind GET /v1/moe/stats and GET /dashboard (prefix dash_): per-device load
 * and imbalance over time, routed tokens per (layer, expert), the collaborative groups of
 * `moeserve analyze` (--collab-groups) with their live usage, and the collaboration graph's
 * edges: how often two (layer, expert) pairs fire for the same token, counted over the live
 * reservoir sample of served tokens (--collab-reservoir, engine/collab/collab_live.h).
 *
 * Threads: dash_after_step runs on the scheduler thread (the only one that reads the engine's
 * counters) and copies them, at most every 250 ms, under the dash mutex; dash_stats_json runs
 * on HTTP threads and only reads those copies and the reservoir's snapshot (no lock is held
 * across a forward pass). The load history has a point per second of wall time: both close
 * the seconds that ended (under the mutex), so an idle server, which runs no step, still
 * shows its idle seconds, at zero load. Ownership: dash_create borrows the engine (it must outlive the dash);
 * dash_stats_json returns a malloc'd string (NULL when out of memory). */
#ifndef MOESERVE_DASH_H
#define MOESERVE_DASH_H

#include <stddef.h>
#include <stdint.h>

struct engine;
struct sched_stats;
struct dash;

/* groups_path (may be NULL): a GROUPS.json of `moeserve analyze` for this model; reservoir:
 * tokens kept for the live graph and group usage (0: none). -1 with a reason naming the flag. */
int dash_create(struct engine *e, const char *groups_path, int reservoir, struct dash **out,
                char *err, size_t errlen);
void dash_free(struct dash *d);
/* The small number a request's moe_tag is known by in routing captures (HTTP threads): 0 for
 * NULL (untagged), else the tag's number, new tags numbered as they come (the first
 * DASH_MAX_TAGS - 2 names; later ones share the last number, shown as "other"). */
#define DASH_MAX_TAGS 32
uint16_t dash_tag_id(struct dash *d, const char *tag);
/* Tag numbers in use so far (names 0..n-1), and the name of one (into buf). */
int dash_tag_count(struct dash *d);
void dash_tag_name(struct dash *d, int id, char *buf, size_t n);
/* Scheduler thread, after every step. */
void dash_after_step(struct dash *d, struct engine *e);
/* The JSON document of GET /v1/moe/stats (documented in proto/openapi.yaml). st may be NULL. */
char *dash_stats_json(struct dash *d, const struct sched_stats *st, const char *model_name);

/* The page (dashboard.html, compiled in) and its length. */
extern const char dash_page[];
extern const size_t dash_page_len;

#endif
