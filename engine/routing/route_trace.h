/* Routing traces: which experts every token chose at every MoE layer, step by step, in a compact
 * binary file that the placement simulator replays and the collaboration analysis reads. One
 * writer (the server's --record-routing, `moeserve trace record`, `moeserve trace synth`), two
 * readers: this one and tools/routing_trace.py. Both readers check every record's CRC and say at
 * which byte offset a file is corrupt or truncated.
 *
 * File layout (version 1; every integer little-endian; no padding):
 *
 *   header
 *     0   char[8]  magic "MOERTRC1"
 *     8   u32      version (1)
 *     12  u32      header_bytes: the whole header, CRC included
 *     16  u32      n_layer: MoE layers recorded (the model's dense layers are left out)
 *     20  u32      n_expert
 *     24  u32      top_k: expert slots per token and layer
 *     28  u32      d_model: hidden width (bytes moved per row = d_model x element size)
 *     32  u32      n_group: expert groups (MoHGE / DeepSeek), 0 when none
 *     36  u32      flags: bit 0 RTRACE_F_LOSS (steps carry a per-token loss),
 *                         bit 1 RTRACE_F_WEIGHTS (steps carry the routing weights)
 *     40  u32      model_n_layer: all layers of the model
 *     44  u32      reserved (0)
 *     48  char[64] model name, NUL padded
 *     112 u32[n_expert]  FFN width of each expert (what an expert row costs: 6 d_model width FLOPs)
 *         u32[n_expert]  group of each expert (0 when n_group is 0)
 *         u32[n_layer]   model layer index of each recorded MoE layer
 *         u32            CRC-32 (zlib's) of every header byte before it
 *
 *   records, each: u32 type, u32 payload_bytes, u32 CRC-32 of the payload, payload
 *     type 1 STEP   u64 step number; u32 n_tok; u32 reserved (0);
 *                   n_tok x { i32 token id (-1 unknown); u16 tag; u16 reserved }
 *                   [RTRACE_F_LOSS]    f32[n_tok] the token's next-token loss in nats (NaN unknown)
 *                   u16[n_layer][n_tok][top_k]  expert ids, 0xFFFF for an unused slot (a token
 *                                               with a lower expert budget)
 *                   [RTRACE_F_WEIGHTS] f16[n_layer][n_tok][top_k]  routing weights
 *     type 2 TAG    u16 tag id; u16 length; the name's bytes (no NUL). Declares what a tag
 *                   number in later steps means (e.g. the corpus a token came from).
 *   A reader skips record types it does not know (their CRC still checked).
 *
 * Size is bounded by rotation: when a file would pass max_bytes, it is closed and renamed to
 * PATH.1 (replacing an older PATH.1), and PATH starts again with the header and every tag
 * declared so far; so at most about 2 x max_bytes are on disk and every file stands alone.
 *
 * Ownership and threads: a writer or reader belongs to one thread at a time. The writer's
 * record buffer is allocated at open for max_tokens tokens a step, so writing a step allocates
 * nothing. The reader's step arrays belong to the reader and stay valid until the next
 * rtrace_next / rtrace_close. */
#ifndef MOESERVE_ROUTE_TRACE_H
#define MOESERVE_ROUTE_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define RTRACE_MAGIC "MOERTRC1"
#define RTRACE_VERSION 1
#define RTRACE_NO_EXPERT 0xFFFFu
#define RTRACE_MAX_EXPERTS 65535
#define RTRACE_MAX_TAGS 65536

enum rtrace_flags {
    RTRACE_F_LOSS = 1u,
    RTRACE_F_WEIGHTS = 2u,
};

enum rtrace_record {
    RTRACE_REC_STEP = 1,
    RTRACE_REC_TAG = 2,
};

/* What a trace describes (the header). Arrays are borrowed by rtrace_writer_open (copied) and
 * owned by the reader on the reading side. */
struct rtrace_info {
    int n_layer, n_expert, top_k, d_model, n_group, model_n_layer;
    unsigned flags;
    char model[64];
    const int *expert_width; /* (n_expert) */
    const int *expert_group; /* (n_expert), or NULL for no groups */
    const int *layer_index;  /* (n_layer), or NULL for 0, 1, ... */
};

/* One step. ids of layer l, token t, slot j: ids[l * layer_stride + t * top_k + j], -1 unused;
 * layer_stride 0 means n_tok * top_k (so the engine hands its per-layer buffers over as they
 * are). weights likewise (NULL: none). tokens, tags, loss may be NULL (-1, 0, NaN). */
struct rtrace_step {
    uint64_t step;
    int n_tok;
    const int32_t *tokens;
    const uint16_t *tags;
    const float *loss;
    const int32_t *ids;
    const float *weights;
    size_t layer_stride;
};

struct rtrace_writer;

/* Creates (truncates) path and writes the header. max_bytes: rotate past this size (0 = never);
 * max_tokens: the most tokens one step may have. -1 with a reason on failure. */
int rtrace_writer_open(const char *path, const struct rtrace_info *info, uint64_t max_bytes,
                       int max_tokens, struct rtrace_writer **out, char *err, size_t errlen);
/* Declares tag id's name (repeated at the top of every rotated file). */
int rtrace_writer_tag(struct rtrace_writer *w, int id, const char *name, char *err,
                      size_t errlen);
/* Appends one step. ids must be -1 or in [0, n_expert); a step over max_tokens is refused. */
int rtrace_write_step(struct rtrace_writer *w, const struct rtrace_step *s, char *err,
                      size_t errlen);
/* Steps and bytes written so far (all files), and rotations done. */
void rtrace_writer_counts(const struct rtrace_writer *w, uint64_t *steps, uint64_t *bytes,
                          int *rotations);
/* Flushes and closes; frees w (also on failure, which it reports). NULL is a no-op. */
int rtrace_writer_close(struct rtrace_writer *w, char *err, size_t errlen);

struct rtrace_reader;

/* Opens and checks the header ("PATH: offset N: ..." on failure). */
int rtrace_open(const char *path, struct rtrace_reader **out, char *err, size_t errlen);
const struct rtrace_info *rtrace_get_info(const struct rtrace_reader *r);
/* Next step: 1 with *s filled (layer_stride = n_tok * top_k; tokens and tags always set, loss
 * and weights when the file has them), 0 at the end, -1 on a corrupt or truncated record (the
 * reason names the byte offset). */
int rtrace_next(struct rtrace_reader *r, struct rtrace_step *s, char *err, size_t errlen);
/* Back to the first step. */
int rtrace_rewind(struct rtrace_reader *r, char *err, size_t errlen);
/* Name of a tag declared so far, or NULL. */
const char *rtrace_tag_name(const struct rtrace_reader *r, int tag);
void rtrace_close(struct rtrace_reader *r);

struct rstats;
/* Adds every step of the trace at path to s (steps whose index has parity `parity`: 0 even, 1
 * odd, -1 all); *tokens (may be NULL) gets the tokens added. The trace must have s's layers,
 * experts and top-k. -1 with a reason (naming the offset of a corrupt record). */
int rtrace_add_to_stats(const char *path, struct rstats *s, int parity, uint64_t *tokens,
                        char *err, size_t errlen);

/* zlib's CRC-32 (the same as Python's zlib.crc32), continued from crc (0 to start). */
uint32_t rtrace_crc32(uint32_t crc, const void *data, size_t n);

#endif
