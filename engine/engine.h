/* Engine: runs forward steps of a loaded model over a device set. One step takes a batch of
 * sequences at different positions — prefill chunks and single decode tokens mixed — and
 * returns the logits each sequence asked for.
 *
 * Devices: N CPU virtual devices (threads), or N CUDA GPUs (ENGINE_BACKEND_CUDA; weights go to
 * the GPUs in bf16 at engine_create). Attention is data-parallel over sequences; experts are
 * expert-parallel: the MoE layer is route -> dispatch (all-to-all to the devices that own the
 * chosen experts, per the placement map; in-process copies, or NCCL between GPUs) -> expert
 * compute on the owner -> combine (all-to-all back, weighted sum in top-k slot order).
 *
 * CPU devices share the KV cache in host memory, so each step splits the batch anew into
 * contiguous slices of sequences; rows then reach an expert in global token order whatever N
 * is, so results do not depend on the device count. Devices with their own memory (GPUs) each
 * hold KV storage for the whole block pool, and a sequence stays on the device that holds its
 * K/V from its first step on (the device of the prefix-cached blocks it reuses, else the one
 * with the fewest sequences); the pool's capacity is then one device's KV budget.
 *
 * Ownership and threads: engine_create borrows the model (it must outlive the engine) and
 * allocates every buffer a step needs, sized by engine_params; engine_step allocates nothing.
 * engine_step is called from one thread at a time (the scheduler's); it uses that thread as
 * device 0 and N-1 worker threads it owns. The KV cache belongs to the engine; sequences'
 * block tables (struct kv_seq) belong to the caller, which creates them with engine_seq_init and
 * frees them with engine_seq_free. */
#ifndef MOESERVE_ENGINE_H
#define MOESERVE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_cache.h"
#include "model.h"
#include "placement/placement.h"
#include "routing/route_stats.h"

enum engine_backend {
    ENGINE_BACKEND_CPU = 0,  /* the reference (kernels/cpu): weights as the model holds them */
    ENGINE_BACKEND_CUDA = 1, /* NVIDIA GPUs (kernels/cuda): bf16 weights, f32 accumulation */
    ENGINE_BACKEND_CPU_STAGED = 2, /* tests: the CPU backend driven as if it had device memory */
};

/* "cpu" / "cuda"; 0, or -1 for any other name. */
int engine_backend_parse(const char *name, enum engine_backend *out);
const char *engine_backend_name(enum engine_backend b);
/* Whether this build has the CUDA backend. */
bool engine_has_cuda(void);

/* KV cache types by name (--kv-cache-dtype): "auto", "bfloat16", "float16", "fp8_e4m3" ("fp8"),
 * "fp8_e5m2", "int8", "float32" (also "bf16", "f16", "half", "f32", "float"). 0, or -1 for
 * another name. ENGINE_KV_AUTO resolves at engine_create. */
#define ENGINE_KV_AUTO (-1)
#define ENGINE_KV_TYPE_NAMES "auto, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8, float32"
int engine_kv_type_parse(const char *name, int *out);
const char *engine_kv_type_name(int kv_type);

/* How the MoE layer moves tokens to the devices owning their experts (engine/moe.h): TOKENS
 * sends a token's row once to each device owning some of its experts, with their ids and
 * weights, and one partial sum per (token, device) comes back; ROWS sends one row per (token,
 * expert) and gets one back (the exchange before issue 30, kept to compare bytes). One device
 * exchanges nothing either way. */
enum engine_dispatch {
    ENGINE_DISPATCH_TOKENS = 0,
    ENGINE_DISPATCH_ROWS = 1,
};
#define ENGINE_DISPATCH_NAMES "tokens or rows"
int engine_dispatch_parse(const char *name, enum engine_dispatch *out);
const char *engine_dispatch_name(enum engine_dispatch d);

enum engine_rstats {
    ENGINE_RSTATS_OFF = 0,
    ENGINE_RSTATS_LOAD = 1, /* routed tokens and FLOPs per expert */
    ENGINE_RSTATS_FULL = 2, /* and co-activation pairs and layer-to-layer transitions */
};

struct engine_params {
    enum engine_backend backend;
    int n_devices;          /* CPU: virtual devices, >= 1; CUDA: GPUs 0..n-1 */
    int n_threads;          /* CPU: threads in all, split between the devices; 0 = the online
                               CPUs */
    int max_batch_tokens;   /* tokens in one step, all sequences together */
    int max_seqs;           /* sequences in one step */
    int max_model_len;      /* positions per sequence; 0 = min(max_position_embeddings, 4096) */
    int kv_block_size;      /* tokens per KV block */
    size_t kv_cache_bytes;  /* memory for KV blocks; 0 = enough for max_seqs full sequences */
    int kv_type;            /* what the KV cache stores: an enum be_kv_type (kernels/kv_types.h),
                               or ENGINE_KV_AUTO: the model's compute type (bf16 when it
                               computes in bf16, else f32) */
    /* Continuous-experts models (infmoe): the budget of sequences that ask for none (0 = the
     * model's num_samples / neuron_fraction); the caller keeps them within the model's
     * bounds (the engine clamps). Ignored for other models. */
    int moe_samples;
    double moe_neuron_fraction;
    const int *placement;   /* (n_expert) device owning each expert, or NULL: contiguous blocks
                               (mohge: All-size Group-decoupling, see moe_mohge_placement) */
    /* Per-layer placement with replicas (engine/placement), copied; overrides `placement`.
     * Its n_dev must be n_devices and its layers the model's MoE layers. */
    const struct plc_map *map;
    /* MoE dispatch (ENGINE_DISPATCH_TOKENS by default). With several processes rank 0's choice
     * travels in every step plan, so the ranks always exchange alike. */
    enum engine_dispatch dispatch;
    /* Routing statistics (engine/routing/route_stats.h) updated after every step, for the
     * placement policies and the rebalancer: none, per-expert load, or load plus co-activation
     * and layer-to-layer transitions. Half-life in routed tokens (0: no decay). */
    enum engine_rstats routing_stats;
    double stats_half_life;
    /* Keep each step's routing for engine_last_routing (routing traces); with weights too. */
    bool capture_routing;
    bool capture_weights;
    /* Multi-process (`mpirun -np N moeserve serve`): a communicator whose ranks are processes
     * (comm.h, self >= 0; engine/comm/), borrowed: it must outlive the engine. The engine then
     * has one device per rank (n_devices is set to the communicator's size) and this process
     * runs device comm->self alone; rank 0 calls engine_step, the others engine_worker_run.
     * CPU backend only; no routing capture or statistics (their counts would cover rank 0's
     * tokens only), no engine_set_placement. NULL: every device is a thread of this process. */
    struct comm *comm;
    /* With comm and the CUDA backend: the communicator the MoE rows go through (NCCL, whose
     * ranks are comm's; engine_comm_nccl_world), borrowed; plans and logits still go through
     * comm. cuda_device: the GPU this process uses. Compiled, never run yet (no GPUs here). */
    struct comm *data_comm;
    int cuda_device;
    /* Hybrid models under speculative decoding: a second recurrent-state slot per sequence, so
     * that the state before a verification can be kept (engine_state_snapshot) and returned to
     * when drafts are rejected (engine_state_rollback). Doubles the state memory. */
    bool spec_state;
};

void engine_params_default(struct engine_params *p);

/* One sequence's part of a step. */
struct engine_item {
    struct kv_seq *kv;      /* the sequence's block table; blocks are reserved by engine_step */
    const int32_t *tokens;  /* (n_tokens) */
    int n_tokens;
    int pos;                /* position of tokens[0]; positions [0, pos) are already cached */
    int moe_top_k;          /* experts per token for this sequence; 0 = the model's default */
    uint16_t tag;           /* the request's tag in routing captures (moe_tag), 0 = none */
    int moe_samples;        /* continuous experts: samples per token, 0 = the default */
    double moe_neuron_fraction; /* continuous experts: neuron fraction, 0 = the default */
    bool moe_samples_adaptive; /* continuous experts: moe_samples (or the default) is an
                                  average, each token's K from the router's uncertainty
                                  (engine/infmoe.h); needs a calibrated model */
    int n_logits;           /* logits wanted for the last n_logits tokens (0, 1 .. n_tokens) */
    float *logits;          /* OUT: (n_logits, vocab), caller-owned */
    /* Multi-token prediction. hidden_out: OUT (n_tokens, d_model), the last layer's output
     * at every token, or NULL: not wanted; after the model's final norm (what the LM head
     * reads) when hidden_normed, else the residual stream before it. hidden_in: engines of an
     * MTP view (model.mtp_in) only, where it is required: (n_tokens, d_model) the target
     * model's hidden state that goes with each token (model_mtp). */
    float *hidden_out;
    bool hidden_normed;
    const float *hidden_in;
};

/* Per-device and per-expert counters, accumulated over steps (read by metrics). */
struct engine_stats {
    uint64_t steps;
    uint64_t tokens;
    uint64_t *dev_routed_rows;  /* (n_devices) token-expert rows computed on each device */
    double *dev_expert_flops;   /* (n_devices) */
    double *dev_busy_s;         /* (n_devices) time in expert compute */
    uint64_t *dev_cont_neurons; /* (n_devices) continuous experts: FFN neurons computed, summed
                                   over tokens and layers (each token's union of its samples) */
    uint64_t *expert_rows;      /* (n_layer, n_expert) */
    /* MoE layers (benchmarks): calls, experts that had rows, the bytes of their weights as the
     * backend stores them, and (only while engine_set_profile is on: the backend is
     * synchronized around each MoE layer) wall time in them. Device 0's layers. */
    uint64_t moe_calls;
    uint64_t moe_active_experts;
    double moe_weight_bytes;
    double moe_flops;
    double moe_s;
    double attn_s;  /* the same for the attention op (scores, softmax, values; engine_set_profile) */
    /* Placement (read by metrics): MoE layers, and per device the expert rows its tokens sent
     * to other devices, the (token, other device) pairs among them (what the exchange would
     * carry if a token went to each device once), the sum of the FFN widths of the rows it
     * computed (over dev_routed_rows: the mean routed width), and per MoE layer and device the
     * expert FLOPs. Placements switched (engine_set_placement) and slots they changed. */
    int n_moe_layers;
    uint64_t *dev_rows_away;    /* (n_devices) */
    uint64_t *dev_tokens_away;  /* (n_devices) */
    double *dev_width_rows;     /* (n_devices) */
    double *layer_dev_flops;    /* (n_moe_layers, n_devices) */
    uint64_t rebalances;
    uint64_t rebalance_moves;
};

/* The routing of the last step (engine_last_routing), valid until the next engine_step: for MoE
 * layer l, token t of the step (items in step order; sticky engines: grouped by device), slot j,
 * the expert ids[l * layer_stride + t * top_k + j] (-1: unused) and its weight. */
struct engine_routing {
    int n_tok, n_layer, top_k;
    const int32_t *tokens;   /* (n_tok) token ids */
    const uint16_t *tags;    /* (n_tok) each token's item's tag */
    const int32_t *ids;
    const float *weights;    /* NULL unless capture_weights */
    size_t layer_stride;
    const int *layer_index;  /* (n_layer) model layer of each MoE layer */
};

struct engine;

int engine_create(const struct model *m, const struct engine_params *p, struct engine **out,
                  char *err, size_t errlen);
void engine_free(struct engine *e);

/* Runs one forward step over items (each a different sequence). Reserves KV blocks for the new
 * positions; on failure (-1: bad token id, position past max_model_len, out of KV blocks, too
 * many tokens or sequences) nothing has been computed and the reason is in err. */
int engine_step(struct engine *e, struct engine_item *items, int n_items, char *err,
                size_t errlen);

int engine_seq_init(struct engine *e, struct kv_seq *s);
void engine_seq_free(struct engine *e, struct kv_seq *s);

const struct model *engine_model(const struct engine *e);
/* Hybrid models: bytes of one sequence's recurrent state over all its Gated DeltaNet layers
 * (the engine holds one such slot per max_seqs on each device); 0 for other models. */
size_t engine_state_seq_bytes(const struct engine *e);
const struct engine_params *engine_get_params(const struct engine *e);
struct kv_cache *engine_kv(struct engine *e);
/* The KV geometry the engine uses for model m with kv_type (ENGINE_KV_AUTO resolved): 0, or -1
 * for an unknown type. */
int engine_kv_geom(const struct model *m, int kv_type, struct kv_geom *out);
/* W > 0 when every layer with K/V attends only to the last W positions at most (a sliding-
 * window model), so a sequence's blocks before its next position - W + 1 can be given back
 * (kv_seq_drop_before); 0 when some layer attends to the whole context. */
int engine_kv_window(const struct engine *e);
/* Bytes one token's K/V take in the engine's cache, over every layer with K/V (int8's scales
 * included). */
size_t engine_kv_bytes_per_token(const struct engine *e);
const struct engine_stats *engine_get_stats(const struct engine *e);
/* Seconds the devices spent selecting positions for sparse attention (DeepSeek-V3.2's
 * indexer), summed; read between steps (bench/bench_dsa). */
double engine_dsa_seconds(const struct engine *e);
/* Token-expert rows one token computes with experts-per-token moe_top_k (0: the model's) over
 * all MoE layers; 0 for continuous-experts models. */
int engine_rows_per_token(const struct engine *e, int moe_top_k);

/* Speculative decoding on hybrid models (engine_params.spec_state), between steps: the
 * sequence's recurrent state, which holds positions [0, state_pos), is copied into its spare slot
 * (kv_seq_spare_slot). engine_state_rollback then makes that copy the sequence's state again
 * (state_pos back to what it was at the snapshot): the positions after it must be computed anew,
 * their K/V rewritten. The snapshot needs the sequence's device to be known (it has run a step)
 * and a free slot; 0, or -1 with the reason (also for multi-process engines, where the state
 * lives in another process). Models without recurrent layers: both do nothing and return 0. */
int engine_state_snapshot(struct engine *e, struct kv_seq *s, char *err, size_t errlen);
void engine_state_rollback(struct engine *e, struct kv_seq *s);
/* Benchmarks: synchronize around every MoE layer and attention op and time them into
 * stats.moe_s and stats.attn_s (slows steps). */
void engine_set_profile(struct engine *e, bool on);
/* Device of the first replica of `expert` at the first MoE layer. */
int engine_expert_owner(const struct engine *e, int expert);
/* The placement in use (valid until engine_set_placement). */
const struct plc_map *engine_placement(const struct engine *e);
/* Switches to another placement of the same shape (devices, MoE layers, experts, slots), between
 * steps, on the thread that calls engine_step: on backends with their own memory the experts a
 * device gains are copied first (a failure leaves the old placement in place, -1 with the
 * reason), then the map is switched, then the copies no device needs any more are freed. CPU
 * devices share the host weights, so nothing is copied. Outputs do not change. */
int engine_set_placement(struct engine *e, const struct plc_map *m, char *err, size_t errlen);
/* Bytes each device sent to each other through the communicator: (n_devices, n_devices), row =
 * sender (this process's ranks). */
const unsigned long long *engine_comm_bytes(const struct engine *e);
/* Routing statistics (NULL unless engine_params.routing_stats). */
struct rstats *engine_routing_stats(struct engine *e);
/* Last step's routing; NULL unless engine_params.capture_routing (or before the first step). */
const struct engine_routing *engine_last_routing(const struct engine *e);

/* --- multi-process engines (engine_params.comm) ---
 * Rank 0 owns the scheduler: each engine_step sends the step's plan (items, tokens, positions,
 * expert budgets, block tables, the device of each sequence) to every other rank, runs its own
 * device, then receives the logits the other ranks computed and one status word from each.
 * A sequence stays on one rank from its first step on (each process holds KV storage for the
 * whole block pool; rank 0's allocator hands out the block ids), so outputs equal a
 * single-process engine's. When a rank fails (the communicator's deadline), the step returns
 * -1 naming it and the engine is failed for good: every later step and ping fails at once. */

/* Rank 0, while no step runs: a round trip to every other rank, so that a rank that died while
 * the server was idle is noticed (and so that idle ranks know rank 0 is alive). Skipped (0)
 * while a step is running, which checks the same. 0, or -1 with the reason. */
int engine_ping(struct engine *e, char *err, size_t errlen);
/* Ranks other than 0: runs steps as rank 0's plans arrive until rank 0 says stop (0) or the
 * communicator fails (-1 with the reason, naming the rank). */
int engine_worker_run(struct engine *e, char *err, size_t errlen);
/* Whether the engine has failed for good (multi-process); the reason in why. */
bool engine_failed(struct engine *e, char *why, size_t whylen);
/* The NCCL communicator of a multi-process GPU engine (engine_params.data_comm): global rank
 * `rank` of `world`, one per process, on CUDA device `gpu`, bootstrapped over the TCP
 * rendezvous (engine/comm/bootstrap.h) at master_addr:master_port (rank 0 listens on every address
 * of that port); every exchange waits at most timeout_ms, then aborts the communicator
 * (comm_nccl_set_timeout). NULL with the reason (e.g. a build without CUDA or NCCL). */
struct comm *engine_comm_nccl_world(int world, int rank, int gpu, const char *master_addr,
                                    int master_port, int timeout_ms, char *err, size_t errlen);

#endif
