/* Tiled paged attention of the CPU backend (backend.h attention): queries of one sequence and
 * one KV head go together as rows of a unit (up to FA_ROWS: a prefill chunk's tokens times the
 * query heads sharing the KV head, or one decode token's heads), and the keys and values are
 * read from the cache in their stored type, FA_TK at a time, converted to f32 once per tile and
 * used by every row, with an online softmax, so no score array grows with the context.
 *
 * The context is cut at fixed positions into segments of FA_SEG. A segment's softmax state
 * (max, sum, weighted values) is computed alone, and a row's segments are folded left to right
 * into its result. A unit's segments run in one task when the call has enough units to keep
 * every thread busy; otherwise (a long decode of few sequences) each segment is a task of its
 * own and a second pass folds them (split-K / flash-decoding). Tiles and segments are fixed by
 * absolute position and every row is computed alone, so a query's output is the same bits
 * whichever tokens share its call, however they are split into tasks and whatever the thread
 * count: chunked prefill equals prefill in one step, and a batch equals its sequences run
 * alone.
 *
 * A unit is a run of one sequence's tokens and a range of its KV heads: as many tokens as fit
 * (a prefill chunk, one KV head: each tile serves many rows), then as many heads as fit (a
 * decode token, every head: a tile reads whole cache rows). Its query rows take each score
 * from their own 16-wide dot products, so which rows share a unit changes no bit.
 *
 * Ownership: struct fa_work is the backend's, sized by fa_work_reserve (every buffer allocated
 * then, none during a call) and freed by fa_work_free. */
#ifndef MOESERVE_CPU_FLASH_H
#define MOESERVE_CPU_FLASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "cpu/gemm.h"
#include "cpu/pool.h"

#define FA_ROWS 64  /* query rows a unit gathers (more only when one token has more heads) */
#define FA_SEG 512  /* positions per segment, a multiple of FA_TK */

struct fa_work {
    int n_threads;
    int rows, dk, dv;        /* the largest unit and head widths the buffers take */
    int kv_heads;            /* the most KV heads a call may have */
    float *scratch;          /* (n_threads, per_thread) */
    size_t per_thread;       /* floats */
    int32_t *units;          /* (max_units, 4) a unit's first token, tokens, first KV head, heads */
    int max_units, max_tokens;
    int32_t *tasks;          /* (max_tasks, 3) split segments: unit, segment, partial offset */
    int max_tasks;
    float *part;             /* split segments' partial states */
    size_t part_floats;
    float *zero;             /* a row of zeros (max(dk, dv) floats) for the tile's empty rows */
};

/* Buffers for calls of up to max_tokens tokens, units of up to max(FA_ROWS, max_group) rows,
 * keys up to dk and values up to dv wide per head, up to max_kv_heads KV heads, contexts up to
 * max_ctx. 0, or -1 when out of memory (w is left empty). */
int fa_work_reserve(struct fa_work *w, int n_threads, int max_tokens, int max_group, int dk,
                    int dv, int max_kv_heads, int max_ctx);
void fa_work_free(struct fa_work *w);
/* Whether a call of n tokens with geometry *a fits the buffers. */
bool fa_work_fits(const struct fa_work *w, int n, const struct be_attn *a);

/* backend.h attention on the pool: out (n, n_head, v_dim) from q (n, n_head, k_dim). The call
 * must fit what fa_work_reserve was given (the backend checks). */
void fa_attention(struct pool *pool, const struct gemm_kernels *kk, struct fa_work *w,
                  float *out, const float *q, const struct be_kv *kv,
                  const struct be_tokens *tk, int block_size, int n, const struct be_attn *a);

#endif
