/* Internals shared by the Jinja modules (not for use outside engine/jinja*.c): the bump arena
 * every template and every render allocates from, the value model (JSON-like values plus
 * undefined, namespace and macro), and the syntax tree jinja_parse.c builds and jinja.c walks.
 * Nothing here is freed piecemeal: an arena owns everything allocated from it. */
#ifndef MOESERVE_JINJA_AST_H
#define MOESERVE_JINJA_AST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- arena ---------------------------------------------------------------------------- */

struct jinja_chunk;
typedef struct jinja_arena {
    struct jinja_chunk *head;
    size_t total; /* bytes taken so far */
    size_t limit; /* 0 = none; past it allocations fail as if memory ran out */
} jinja_arena;

/* Returns zeroed memory that lives until jinja_arena_free, or NULL when out of memory (or
 * past the arena's limit). */
void *jinja_arena_alloc(jinja_arena *a, size_t n);
char *jinja_arena_strdup(jinja_arena *a, const char *s, size_t n);
void jinja_arena_free(jinja_arena *a);

/* ---- values --------------------------------------------------------------------------- */

typedef enum {
    JINJA_UNDEF,
    JINJA_NONE,
    JINJA_BOOL,
    JINJA_INT,
    JINJA_FLOAT,
    JINJA_STR,
    JINJA_LIST,
    JINJA_DICT,
    JINJA_NS,    /* namespace(): a dict whose attributes `set ns.x = ...` may change */
    JINJA_MACRO, /* u.macro points at the JINJA_N_MACRO node */
    JINJA_FUNC,  /* a global function; u.s.p holds its name */
} jinja_type;

struct jinja_list;
struct jinja_dict;
struct jinja_node;

/* A value is small and copied by value; strings, lists and dicts point into an arena. Strings
 * are UTF-8 with an explicit length (not NUL-terminated). An undefined value keeps the name it
 * was looked up by in u.s, for error messages. */
typedef struct jinja_value {
    jinja_type t;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        struct jinja_list *l;
        struct jinja_dict *d;
        const struct jinja_node *macro;
    } u;
} jinja_value;

/* depth (lists and dicts): 1 + the deepest element's depth when it was added, at most
 * JINJA_MAX_VALUE_DEPTH, so that printing, comparing and converting values (recursive) stay
 * shallow. Only namespaces change after they are made, and they may not hold a namespace
 * (has_ns), so a value is at most about twice the limit deep. */
struct jinja_list {
    jinja_value *v;
    size_t n, cap;
    int depth;
    bool has_ns;
    bool tuple; /* prints as (a, b): tuple literals and dict items */
};

/* Insertion-ordered; lookups are linear, which suits chat-message sized dicts. */
struct jinja_dict {
    jinja_value *k; /* strings (or other scalars) */
    jinja_value *v;
    size_t n, cap;
    int depth;
    bool has_ns;
};

/* ---- syntax tree ---------------------------------------------------------------------- */

typedef enum {
    /* expressions */
    JINJA_N_LIT,     /* lit */
    JINJA_N_NAME,    /* name */
    JINJA_N_LIST,    /* kids: items; op = 1 for a tuple */
    JINJA_N_DICT,    /* kids: key0, value0, key1, value1, ... */
    JINJA_N_ATTR,    /* a.name */
    JINJA_N_INDEX,   /* a[b] */
    JINJA_N_SLICE,   /* a[b:c:d], missing parts NULL */
    JINJA_N_CALL,    /* a(kids, kw) */
    JINJA_N_FILTER,  /* a | name(kids, kw) */
    JINJA_N_TEST,    /* a is [not] name(kids); op = 1 for "is not" */
    JINJA_N_NOT,     /* not a */
    JINJA_N_NEG,     /* -a */
    JINJA_N_BINOP,   /* a op b: op is one of JINJA_OP_* */
    JINJA_N_AND,     /* a and b */
    JINJA_N_OR,      /* a or b */
    JINJA_N_CONDEXPR, /* a if b else c (c may be NULL) */
    /* statements */
    JINJA_N_BODY,    /* kids: statements in order */
    JINJA_N_TEXT,    /* name: literal text */
    JINJA_N_OUTPUT,  /* {{ a }} */
    JINJA_N_IF,      /* if a: b (BODY) else c (BODY or IF for elif, may be NULL) */
    JINJA_N_FOR,     /* for targets in a [if d]: b else c */
    JINJA_N_SET,     /* set targets = a, or set name.attr = a (name, attr) */
    JINJA_N_SETBLOCK, /* set name: b (BODY) */
    JINJA_N_MACRO,   /* macro name(params = targets, defaults = kids): b */
    JINJA_N_BREAK,
    JINJA_N_CONTINUE,
} jinja_node_kind;

enum {
    JINJA_OP_ADD = 1,
    JINJA_OP_SUB,
    JINJA_OP_MUL,
    JINJA_OP_DIV,
    JINJA_OP_FLOORDIV,
    JINJA_OP_MOD,
    JINJA_OP_POW,
    JINJA_OP_CONCAT,
    JINJA_OP_EQ,
    JINJA_OP_NE,
    JINJA_OP_LT,
    JINJA_OP_LE,
    JINJA_OP_GT,
    JINJA_OP_GE,
    JINJA_OP_IN,
    JINJA_OP_NOTIN,
};

/* A string slice inside the template's arena. */
typedef struct jinja_str {
    const char *p;
    size_t n;
} jinja_str;

typedef struct jinja_node {
    jinja_node_kind kind;
    int line; /* 1-based line in the template source */
    int op;
    jinja_str name; /* NAME, ATTR, FILTER, TEST, TEXT, SET(ns.attr: the ns), MACRO */
    jinja_str attr; /* SET ns.attr: the attribute */
    jinja_value lit;
    struct jinja_node *a, *b, *c, *d;
    struct jinja_node **kids; /* items, args, statements or macro defaults */
    size_t nkids;
    jinja_str *kwnames; /* keyword arguments of CALL/FILTER/TEST */
    struct jinja_node **kwvals;
    size_t nkw;
    jinja_str *targets; /* FOR/SET target names, MACRO parameter names */
    size_t ntargets;
} jinja_node;

/* Parses src into a JINJA_N_BODY tree allocated from `a`. Returns NULL with "line N: reason"
 * in err. */
jinja_node *jinja_parse(jinja_arena *a, const char *src, char *err, size_t errlen);

#endif
