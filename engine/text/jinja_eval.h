/* Internals shared by the Jinja evaluator (jinja.c) and its builtins (jinja_builtins.c): the
 * render context, variable frames, output buffers and the value helpers both sides use. Not
 * for use outside engine/jinja*.c. Every value a render creates lives in the render's arena;
 * jinja_buf memory is malloc'd and owned by whoever declared the buffer. */
#ifndef MOESERVE_JINJA_EVAL_H
#define MOESERVE_JINJA_EVAL_H

#include "jinja_ast.h"

#include <jansson.h>

/* Variables of one scope (template top level, one loop iteration, one macro call). */
typedef struct jinja_frame {
    struct jinja_frame *parent;
    jinja_str *names;
    jinja_value *vals;
    size_t n, cap;
} jinja_frame;

/* Growable output buffer; p is NUL-terminated once anything was written. */
typedef struct jinja_buf {
    char *p;
    size_t n, cap;
} jinja_buf;

typedef struct jinja_ctx {
    jinja_arena *a;
    char *err;
    size_t errlen;
    bool failed; /* the first failure's reason is in err; later ones are dropped */
    int depth;   /* macro call depth */
    long steps;  /* loop iterations and macro calls so far (jinja_step) */
    jinja_buf *out;
    jinja_frame *frame; /* innermost scope */
    jinja_frame *root;  /* template top level (macros see it) */
} jinja_ctx;

#define JINJA_MAX_ARGS 16
/* What one render may take: a real chat template loops over messages and tools a few thousand
 * times and allocates a few times its output; these bounds stop a hostile or broken template
 * (or runaway nesting) long before it ties up a server thread or its memory. */
#define JINJA_MAX_STEPS 100000
#define JINJA_MAX_RENDER_BYTES (256 << 20) /* arena; any one text buffer gets a quarter */
/* Lists and dicts nest at most this deep ("values nested deeper than 512 levels"): a loop of
 * `set ns.x = [ns.x]` would otherwise build a value whose printing overflows the stack. */
#define JINJA_MAX_VALUE_DEPTH 512

/* Evaluated call arguments: positional v[0..n), keyword kw[0..nkw) named kwnames. */
typedef struct jinja_args {
    jinja_value v[JINJA_MAX_ARGS];
    size_t n;
    jinja_value kw[JINJA_MAX_ARGS];
    const jinja_str *kwnames;
    size_t nkw;
} jinja_args;

enum { JINJA_EXEC_BREAK = 1, JINJA_EXEC_CONTINUE = 2 };

/* jinja.c */
int jinja_fail(jinja_ctx *cx, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int jinja_oom(jinja_ctx *cx);
/* Counts one loop iteration or macro call; fails the render past JINJA_MAX_STEPS. */
int jinja_step(jinja_ctx *cx, int line);
int jinja_undefined_error(jinja_ctx *cx, int line, jinja_value v);
int jinja_buf_put(jinja_ctx *cx, jinja_buf *b, const char *p, size_t n);
int jinja_buf_puts(jinja_ctx *cx, jinja_buf *b, const char *s);
jinja_frame *jinja_frame_new(jinja_ctx *cx, jinja_frame *parent);
int jinja_frame_set(jinja_ctx *cx, jinja_frame *f, const char *name, size_t n, jinja_value v);
jinja_value jinja_str_value(const char *p, size_t n);
jinja_value jinja_list_new(jinja_ctx *cx, size_t cap);
int jinja_list_push(jinja_ctx *cx, jinja_value list, jinja_value v);
jinja_value jinja_dict_new(jinja_ctx *cx, jinja_type t);
jinja_value *jinja_dict_find(const struct jinja_dict *d, jinja_value key);
jinja_value *jinja_dict_findstr(const struct jinja_dict *d, const char *key, size_t n);
int jinja_dict_set(jinja_ctx *cx, jinja_value dict, jinja_value key, jinja_value v);
bool jinja_truthy(jinja_value v);
bool jinja_equal(jinja_value a, jinja_value b);
double jinja_num(jinja_value v);
int jinja_compare(jinja_ctx *cx, jinja_value a, jinja_value b, int line, int *cmp);
/* len(range(start, stop, step)) without overflow (step != 0; INT64_MAX when it does not fit). */
int64_t jinja_span_count(int64_t start, int64_t stop, int64_t step);
int jinja_contains(jinja_ctx *cx, jinja_value hay, jinja_value needle, int line, bool *res);
int jinja_getitem(jinja_ctx *cx, jinja_value obj, jinja_value key, int line, jinja_value *out);
void jinja_float_repr(double x, char *out, size_t outlen);
int jinja_write_str(jinja_ctx *cx, jinja_buf *b, jinja_value v, bool repr);
int jinja_to_str(jinja_ctx *cx, jinja_value v, jinja_value *out);
jinja_value jinja_from_json(jinja_ctx *cx, const json_t *j);
int jinja_eval(jinja_ctx *cx, const jinja_node *n, jinja_value *out);
/* Returns 0, -1 on error, or JINJA_EXEC_BREAK/CONTINUE. */
int jinja_exec(jinja_ctx *cx, const jinja_node *n);

/* jinja_builtins.c */
size_t jinja_utf8_len(const char *p, size_t n);
/* Byte offset of code point i (n when i is past the end). */
size_t jinja_utf8_offset(const char *p, size_t n, size_t i);
int jinja_add_globals(jinja_ctx *cx, jinja_frame *f);
int jinja_call_global(jinja_ctx *cx, jinja_str name, const jinja_args *args, int line, jinja_value *out);
/* Returns 1 (nothing written) when obj has no method of that name. */
int jinja_call_method(jinja_ctx *cx, jinja_value obj, jinja_str name, const jinja_args *args, int line,
                      jinja_value *out);
int jinja_apply_filter(jinja_ctx *cx, jinja_str name, jinja_value v, const jinja_args *args, int line,
                       jinja_value *out);
int jinja_apply_test(jinja_ctx *cx, jinja_str name, jinja_value v, const jinja_args *args, int line,
                     bool *out);

#endif
