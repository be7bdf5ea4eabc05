/* Shared pieces of the edge translations (proto/anthropic.c, proto/responses.c): named SSE
 * events, strict key checks of nested request objects, and the one set of helpers both APIs
 * use to read text out of their content blocks. Internal to proto/: these take jansson trees.
 *
 * Ownership: edge_emit takes its data object (decref'd whatever happens); the others borrow
 * their inputs and fill caller-owned outputs. */
#ifndef MOESERVE_PROTO_EDGE_H
#define MOESERVE_PROTO_EDGE_H

#include <jansson.h>
#include <stdbool.h>

#include "common.h"
#include "proto/request.h"

/* Appends "event: EVENT\ndata: JSON\n\n" to out (NULL: nothing is written, the data only
 * dropped). Takes data. Returns 0, or -1 when out of memory. */
int edge_emit(struct ms_buf *out, const char *event, json_t *data);

/* Refuses any key of object o outside keys[0, n) whose value is not null with a 400 naming
 * "WHERE.KEY" (code unknown_parameter). Returns 0 or -1 with e. */
int edge_keys(json_t *o, const char *where, const char *const *keys, size_t n,
              struct proto_error *e);

/* A JSON value's compact text (malloc'd), or NULL when out of memory. */
char *edge_dump(json_t *v);

/* Copies in[key] to out[key] when present and not null. */
void edge_copy(json_t *out, json_t *in, const char *key);

/* Copies (edge_copy) the fields that both APIs share with chat completions under the same name
 * and meaning, moeserve's and vLLM's extras among them, into the chat request out. */
void edge_copy_shared(json_t *out, json_t *in);

/* Whether the string ends with the bytes of suffix. */
bool edge_ends_with(const char *s, size_t len, const char *suffix);

#endif
