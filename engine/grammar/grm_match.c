/* Matching (see grammar.h): the vocabulary's byte trie, the matcher's stack sets and the
 * token mask. A stack is a chain of nodes {pos, parent}: pos is the next element of some rule
 * alternative, parent the node to continue at when that alternative ends (-1: the end of the
 * output). Nodes are hash-consed (one index per distinct {pos, parent}), so equal stacks are
 * equal indices. A state is a sorted set of top nodes, each at a byte-set element (rule
 * references and alternative ends are expanded eagerly), plus whether the output may end
 * there; states are interned too.
 *
 * That makes the matcher a DFA built lazily: advancing a state by a byte is computed once and
 * then found in a transition table, so the trie walk mostly costs one lookup per trie node
 * (inside a JSON string every ordinary byte leads back to the same state). The token mask of
 * a state is kept in a small cache, so a state met again (the next token inside the same
 * string) costs a copy. Everything is allocated at matcher creation; when the tables fill up,
 * grm_accept starts them over from the current state (the stacks are re-interned), never
 * allocating. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grm_internal.h"


/* ---- the vocabulary trie -------------------------------------------------------------- */

struct vtok {
    int32_t id;
    uint16_t len;
    char bytes[254];
};

static int cmp_vtok(const void *a, const void *b)
{
    const struct vtok *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->bytes, y->bytes, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

struct grm_vocab_ext {
    struct grm_vocab v;
    int32_t *node_parent; /* (n_nodes) */
    uint8_t *node_byte;   /* (n_nodes) */
    int32_t *tok_node;    /* (vocab) trie node of each token, -1 when not in the trie */
};

struct grm_vocab *grm_vocab_build(const struct tokenizer *tok, int vocab, const int32_t *eos,
                                  int n_eos)
{
    struct grm_vocab_ext *x = calloc(1, sizeof *x);
    struct vtok *toks = NULL;
    int32_t *path = NULL;
    if (!x) return NULL;
    struct grm_vocab *v = &x->v;
    v->vocab = vocab;
    v->strip_first_space = tok_decode_strips_first_space(tok);
    v->eos = malloc(sizeof *v->eos * (size_t)(n_eos > 0 ? n_eos : 1));
    x->tok_node = malloc(sizeof *x->tok_node * (size_t)(vocab > 0 ? vocab : 1));
    int n_ids = tok_vocab_size(tok) < vocab ? tok_vocab_size(tok) : vocab;
    toks = malloc(sizeof *toks * (size_t)(n_ids > 0 ? n_ids : 1));
    if (!v->eos || !x->tok_node || !toks) goto fail;
    for (int i = 0; i < n_eos; i++)
        if (eos[i] >= 0 && eos[i] < vocab) v->eos[v->n_eos++] = eos[i];
    for (int i = 0; i < vocab; i++) x->tok_node[i] = -1;
    int n = 0;
    size_t total = 1;
    for (int id = 0; id < n_ids; id++) {
        if (tok_is_special(tok, id)) continue; /* special tokens never continue an output */
        char buf[256];
        int len = tok_token_bytes(tok, id, buf, sizeof buf);
        if (len <= 0 || len > (int)sizeof toks[0].bytes) continue;
        toks[n].id = id;
        toks[n].len = (uint16_t)len;
        memcpy(toks[n].bytes, buf, (size_t)len);
        total += (size_t)len;
        n++;
    }
    qsort(toks, (size_t)n, sizeof *toks, cmp_vtok);
    /* Preorder construction from sorted strings: nodes come out in byte order under each
     * parent, so each node's children are the later nodes naming it as parent, in order. */
    x->node_parent = malloc(sizeof *x->node_parent * total);
    x->node_byte = malloc(total);
    v->tok_first = calloc(total + 1, sizeof *v->tok_first);
    v->tok_ids = malloc(sizeof *v->tok_ids * (size_t)(n > 0 ? n : 1));
    path = malloc(sizeof *path * 257);
    if (!x->node_parent || !x->node_byte || !v->tok_first || !v->tok_ids || !path) goto fail;
    int nodes = 1, depth = 0;
    x->node_parent[0] = -1;
    x->node_byte[0] = 0;
    path[0] = 0;
    for (int t = 0; t < n; t++) {
        int lcp = 0;
        if (t > 0) {
            int m = toks[t].len < toks[t - 1].len ? toks[t].len : toks[t - 1].len;
            while (lcp < m && toks[t].bytes[lcp] == toks[t - 1].bytes[lcp]) lcp++;
            if (lcp > depth) lcp = depth;
        }
        depth = lcp;
        for (int k = lcp; k < toks[t].len; k++) {
            x->node_parent[nodes] = path[depth];
            x->node_byte[nodes] = (uint8_t)toks[t].bytes[k];
            path[++depth] = nodes++;
        }
        v->tok_first[path[depth] + 1]++;
        x->tok_node[toks[t].id] = path[depth];
        if (toks[t].len > v->max_depth) v->max_depth = toks[t].len;
    }
    v->n_nodes = nodes;
    for (int i = 0; i < nodes; i++) v->tok_first[i + 1] += v->tok_first[i];
    /* tokens per node: fill in sorted order (same node: consecutive) */
    {
        int32_t *fill = malloc(sizeof *fill * (size_t)nodes);
        if (!fill) goto fail;
        memcpy(fill, v->tok_first, sizeof *fill * (size_t)nodes);
        for (int t = 0; t < n; t++) v->tok_ids[fill[x->tok_node[toks[t].id]]++] = toks[t].id;
        free(fill);
    }
    v->child_first = calloc((size_t)nodes + 1, sizeof *v->child_first);
    v->child = malloc(sizeof *v->child * (size_t)(nodes > 1 ? nodes - 1 : 1));
    v->child_byte = malloc((size_t)(nodes > 1 ? nodes - 1 : 1));
    if (!v->child_first || !v->child || !v->child_byte) goto fail;
    for (int i = 1; i < nodes; i++) v->child_first[x->node_parent[i] + 1]++;
    for (int i = 0; i < nodes; i++) v->child_first[i + 1] += v->child_first[i];
    {
        int32_t *fill = malloc(sizeof *fill * (size_t)nodes);
        if (!fill) goto fail;
        memcpy(fill, v->child_first, sizeof *fill * (size_t)nodes);
        for (int i = 1; i < nodes; i++) {
            int at = fill[x->node_parent[i]]++;
            v->child[at] = i;
            v->child_byte[at] = x->node_byte[i];
        }
        free(fill);
    }
    free(toks);
    free(path);
    return v;
fail:
    free(toks);
    free(path);
    grm_vocab_free(v);
    return NULL;
}

void grm_vocab_free(struct grm_vocab *v)
{
    if (!v) return;
    struct grm_vocab_ext *x = (struct grm_vocab_ext *)v;
    free(v->eos);
    free(v->child_first);
    free(v->child);
    free(v->child_byte);
    free(v->tok_first);
    free(v->tok_ids);
    free(x->node_parent);
    free(x->node_byte);
    free(x->tok_node);
    free(x);
}

int grm_vocab_nodes(const struct grm_vocab *v)
{
    return v->n_nodes;
}

/* ---- the matcher ------------------------------------------------------------------------ */

/* Table sizes: about 6 MB a matcher (only requests with a grammar have one), allocated at its
 * creation. */
#define POOL_NODES (1 << 17)    /* interned stack nodes */
#define MAX_STATES (1 << 14)    /* interned states */
#define STATE_INTS (1 << 18)    /* their tops, all together */
/* tops in one state (more: the rest are dropped, the walk is cut short); a schema object of
 * 10^4 optional properties has one top per property after its "{" */
#define MAX_SET (1 << 15)
#define TRANS_SLOTS (1 << 17)   /* transition table (power of two) */
#define MASK_CACHE 8            /* token masks kept */
/* Node expansions (and the alternatives they fan out to) one mask walk may do. Stacks can
 * multiply: bounded repetitions nested in each other, (("a"{0,1000}){0,1000}){0,1000}, make
 * 10^6 distinct stacks that fill the pool on every step, and a walk over a 151k vocabulary
 * took 36 s. Real grammars need far less (on Qwen3's vocabulary: 10^4 choices 4 * 10^4, a JSON
 * Schema object of 10^4 optional properties 1.7 * 10^6 after its "{", about 50 ms); past this
 * the walk stops with the tokens found so far (a subset of the allowed ones: never a wrong
 * token), about 50 ms. */
#define WALK_WORK (1u << 21) /* expanded nodes plus the alternatives they fan out to */
/* The same work within one step (one byte from one state), on the scheduler's path for every
 * accepted token: nested bounded repetitions fan each expansion out over every count they
 * allow, (((."g"{0,1000}){0,1000}){5,1000}) 10^8 interned nodes for one byte. Past this the
 * step keeps the stacks found so far (a subset, as when a state overflows), about 2 ms; a
 * 10^4-property JSON Schema object needs ~10^4 after its "{". */
#define STEP_WORK (1u << 18)
#define DEAD (-1)

struct gnode {
    int32_t pos, parent;
};

struct gstate {
    int32_t off, n; /* tops: state_tops[off .. off + n) */
    bool end;
};

struct mask_slot {
    int32_t state; /* -1: empty */
    int32_t count;
    uint32_t used; /* recency */
    uint8_t *bits; /* (vocab / 8 rounded up) */
};

struct frame {
    int32_t trie, k, k_end, state;
};

struct grm_matcher {
    const struct grm_grammar *g;
    const struct grm_vocab *v;
    struct gnode *pool;
    int n_nodes;
    int32_t *node_slot;   /* (2 * POOL_NODES) node intern table, -1 empty */
    uint32_t *stamp;      /* (POOL_NODES) expansion visit marks */
    uint32_t cur_stamp;
    struct gstate *states;
    int n_states;
    int32_t *state_tops;  /* (STATE_INTS) */
    int n_tops;
    int32_t *state_slot;  /* (2 * MAX_STATES) state intern table */
    uint64_t *trans_key;  /* (TRANS_SLOTS) state << 8 | byte, UINT64_MAX empty */
    int32_t *trans_val;
    int n_trans;
    bool full;            /* a table ran out: start over at the next accept */
    int32_t cur;          /* the current state */
    int32_t *work;        /* (POOL_NODES) expansion worklist */
    int32_t *tops;        /* (MAX_SET) a state being built */
    struct frame *frames; /* (max_depth + 2) */
    struct mask_slot cache[MASK_CACHE];
    uint32_t clock;
    uint64_t work_done;   /* nodes expanded so far (bounds a walk: WALK_WORK) */
    uint64_t step_end;    /* work_done at which the current step stops (STEP_WORK) */
    /* The last mask handed out (grm_mask): its slot and the state it was for, or -1. While the
     * matcher is still in that state, grm_allows answers from it: when the walk overflowed a
     * table, the next run restarts, and a restart may drop stacks that do not fit, so a fresh
     * run could refuse a token the mask (computed before) allowed. */
    int last_slot;
    int32_t last_cur;
};

static uint32_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* The node {pos, parent}, interned; -2 when the pool is full. */
static int32_t node(struct grm_matcher *m, int32_t pos, int32_t parent)
{
    uint32_t mask = 2 * POOL_NODES - 1;
    uint32_t h = mix((uint64_t)(uint32_t)pos << 32 | (uint32_t)parent) & mask;
    for (;; h = (h + 1) & mask) {
        int32_t i = m->node_slot[h];
        if (i < 0) break;
        if (m->pool[i].pos == pos && m->pool[i].parent == parent) return i;
    }
    if (m->n_nodes >= POOL_NODES) {
        m->full = true;
        return -2;
    }
    m->pool[m->n_nodes] = (struct gnode){pos, parent};
    m->stamp[m->n_nodes] = 0;
    m->node_slot[h] = m->n_nodes;
    return m->n_nodes++;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The state with tops[0..n) (sorted, distinct) and end, interned; DEAD when it is empty or a
 * table is full. */
static int32_t state(struct grm_matcher *m, const int32_t *tops, int n, bool end)
{
    if (n == 0 && !end) return DEAD;
    uint64_t h64 = end ? 0x9e3779b97f4a7c15ull : 0;
    for (int i = 0; i < n; i++) h64 = (h64 ^ (uint32_t)tops[i]) * 0x100000001b3ull;
    uint32_t mask = 2 * MAX_STATES - 1, h = mix(h64) & mask;
    for (;; h = (h + 1) & mask) {
        int32_t s = m->state_slot[h];
        if (s < 0) break;
        const struct gstate *st = &m->states[s];
        if (st->n == n && st->end == end &&
            memcmp(m->state_tops + st->off, tops, sizeof *tops * (size_t)n) == 0)
            return s;
    }
    if (m->n_states >= MAX_STATES || m->n_tops + n > STATE_INTS) {
        m->full = true;
        return DEAD;
    }
    memcpy(m->state_tops + m->n_tops, tops, sizeof *tops * (size_t)n);
    m->states[m->n_states] = (struct gstate){.off = m->n_tops, .n = n, .end = end};
    m->n_tops += n;
    m->state_slot[h] = m->n_states;
    return m->n_states++;
}

/* Adds the byte-set tops reachable from node x (or the end, x == -1) to m->tops. */
static void expand(struct grm_matcher *m, int32_t x, int *n, bool *end)
{
    const struct grm_grammar *g = m->g;
    int nw = 0;
    m->work[nw++] = x;
    while (nw > 0) {
        int32_t y = m->work[--nw];
        if (y < 0) {
            if (y == -1) *end = true;
            continue;
        }
        if (m->stamp[y] == m->cur_stamp) continue; /* reached twice: same stacks */
        /* over the step's work: keep what was found. Not `full`: that would make the next run
         * restart, reinterning the stacks in another order and so cutting this step at another
         * subset than the one a mask was just computed from; left as is, the same step from
         * the same tables stops at the same place (the transition is cached as well). */
        if (m->work_done >= m->step_end) return;
        m->stamp[y] = m->cur_stamp;
        m->work_done++;
        uint32_t el = g->els[m->pool[y].pos];
        if (GRM_EL_KIND(el) == GRM_EL_SET) {
            if (*n < MAX_SET) m->tops[(*n)++] = y;
            else m->full = true;
        } else if (GRM_EL_KIND(el) == GRM_EL_END) {
            m->work[nw++] = m->pool[y].parent;
        } else {
            int r = (int)GRM_EL_IDX(el);
            int32_t pos = m->pool[y].pos;
            /* a reference that ends its alternative continues straight at the parent */
            int32_t cont = GRM_EL_KIND(g->els[pos + 1]) == GRM_EL_END
                               ? m->pool[y].parent
                               : node(m, pos + 1, m->pool[y].parent);
            if (cont == -2) continue;
            /* each alternative is a node to intern: the walk's work (a rule of 1000
             * alternatives, as a bounded repetition compiles to, costs 1000, not 1) */
            m->work_done += (uint64_t)(g->rule_alt[r + 1] - g->rule_alt[r]);
            for (int a = g->rule_alt[r]; a < g->rule_alt[r + 1] && nw < POOL_NODES; a++) {
                int32_t z = node(m, g->alt_start[a], cont);
                if (z >= 0) m->work[nw++] = z;
            }
        }
    }
}

/* Sorts and dedups m->tops[0..n) and interns the state. */
static int32_t finish_state(struct grm_matcher *m, int n, bool end)
{
    qsort(m->tops, (size_t)n, sizeof *m->tops, cmp_i32);
    int k = 0;
    for (int i = 0; i < n; i++)
        if (k == 0 || m->tops[k - 1] != m->tops[i]) m->tops[k++] = m->tops[i];
    return state(m, m->tops, k, end);
}

/* The state after byte b from state s (DEAD when no stack survives). */
static int32_t step(struct grm_matcher *m, int32_t s, unsigned char b)
{
    uint64_t key = (uint64_t)(uint32_t)s << 8 | b;
    uint32_t mask = TRANS_SLOTS - 1, h = mix(key) & mask;
    for (;; h = (h + 1) & mask) {
        if (m->trans_key[h] == UINT64_MAX) break;
        if (m->trans_key[h] == key) return m->trans_val[h];
    }
    const struct grm_grammar *g = m->g;
    const struct gstate *st = &m->states[s];
    int n = 0;
    bool end = false;
    m->cur_stamp++;
    m->step_end = m->work_done + STEP_WORK;
    for (int i = 0; i < st->n; i++) {
        const struct gnode *x = &m->pool[m->state_tops[st->off + i]];
        if (!grm_set_has(&g->sets[GRM_EL_IDX(g->els[x->pos])], b)) continue;
        int32_t y = GRM_EL_KIND(g->els[x->pos + 1]) == GRM_EL_END ? x->parent
                                                                   : node(m, x->pos + 1, x->parent);
        if (y != -2) expand(m, y, &n, &end);
    }
    int32_t t = finish_state(m, n, end);
    if (m->n_trans < TRANS_SLOTS / 2 && !(t == DEAD && m->full)) {
        m->trans_key[h] = key;
        m->trans_val[h] = t;
        m->n_trans++;
    }
    return t;
}

static void reset_tables(struct grm_matcher *m)
{
    m->n_nodes = m->n_states = m->n_tops = m->n_trans = 0;
    memset(m->node_slot, 0xff, sizeof *m->node_slot * 2 * POOL_NODES);
    memset(m->state_slot, 0xff, sizeof *m->state_slot * 2 * MAX_STATES);
    memset(m->trans_key, 0xff, sizeof *m->trans_key * TRANS_SLOTS);
    for (int i = 0; i < MASK_CACHE; i++) m->cache[i].state = -1;
    m->full = false;
    m->last_slot = -1; /* states are renumbered */
}

/* Starts the tables over, keeping the current state's stacks (re-interned). */
static void restart(struct grm_matcher *m)
{
    const struct gstate *st = &m->states[m->cur];
    int n = st->n;
    bool end = st->end;
    /* copy the stacks out: chains of (pos) from top to bottom, into work (as pos lists). The
     * stacks that do not fit are dropped whole (the matcher then misses their continuations,
     * as when a state overflows MAX_SET): a chain cut short would come back as a different,
     * shorter stack, one that could end the output where the grammar does not. */
    int32_t *buf = m->work;
    int w = 0;
    for (int i = 0; i < n && w < POOL_NODES; i++) {
        int start = w++;
        int32_t x = m->state_tops[st->off + i];
        for (; x >= 0 && w < POOL_NODES; x = m->pool[x].parent) buf[w++] = m->pool[x].pos;
        if (x >= 0) { /* did not fit */
            w = start;
            break;
        }
        buf[start] = w - start - 1; /* chain length */
    }
    reset_tables(m);
    int k = 0;
    for (int r = 0; r < w;) {
        int len = buf[r];
        int32_t parent = -1;
        for (int j = r + len; j > r && parent != -2; j--) parent = node(m, buf[j], parent);
        if (parent >= 0 && k < MAX_SET) m->tops[k++] = parent;
        r += len + 1;
    }
    m->cur = finish_state(m, k, end);
}

struct grm_matcher *grm_matcher_create(const struct grm_grammar *g)
{
    struct grm_matcher *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    const struct grm_vocab *v = g->vocab;
    size_t mb = ((size_t)v->vocab + 7) / 8;
    m->g = g;
    m->v = v;
    m->pool = malloc(sizeof *m->pool * POOL_NODES);
    m->node_slot = malloc(sizeof *m->node_slot * 2 * POOL_NODES);
    m->stamp = malloc(sizeof *m->stamp * POOL_NODES);
    m->states = malloc(sizeof *m->states * MAX_STATES);
    m->state_tops = malloc(sizeof *m->state_tops * STATE_INTS);
    m->state_slot = malloc(sizeof *m->state_slot * 2 * MAX_STATES);
    m->trans_key = malloc(sizeof *m->trans_key * TRANS_SLOTS);
    m->trans_val = malloc(sizeof *m->trans_val * TRANS_SLOTS);
    m->work = malloc(sizeof *m->work * POOL_NODES);
    m->tops = malloc(sizeof *m->tops * MAX_SET);
    m->frames = malloc(sizeof *m->frames * (size_t)(v->max_depth + 2));
    bool ok = m->pool && m->node_slot && m->stamp && m->states && m->state_tops &&
              m->state_slot && m->trans_key && m->trans_val && m->work && m->tops && m->frames;
    for (int i = 0; i < MASK_CACHE && ok; i++) ok = (m->cache[i].bits = malloc(mb)) != NULL;
    if (!ok) {
        grm_matcher_free(m);
        return NULL;
    }
    reset_tables(m);
    int start = v->strip_first_space ? g->root_sp : g->root;
    int n = 0;
    bool end = false;
    m->cur_stamp++;
    m->step_end = m->work_done + STEP_WORK;
    for (int a = g->rule_alt[start]; a < g->rule_alt[start + 1]; a++) {
        int32_t x = node(m, g->alt_start[a], -1);
        if (x >= 0) expand(m, x, &n, &end);
    }
    m->cur = finish_state(m, n, end);
    return m;
}

void grm_matcher_free(struct grm_matcher *m)
{
    if (!m) return;
    free(m->pool);
    free(m->node_slot);
    free(m->stamp);
    free(m->states);
    free(m->state_tops);
    free(m->state_slot);
    free(m->trans_key);
    free(m->trans_val);
    free(m->work);
    free(m->tops);
    free(m->frames);
    for (int i = 0; i < MASK_CACHE; i++) free(m->cache[i].bits);
    free(m);
}

static bool is_eos(const struct grm_vocab *v, int32_t id)
{
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return true;
    return false;
}

/* The allowed tokens of state s (the eos ids left out) into bits; returns their count. */
static int walk(struct grm_matcher *m, int32_t s, uint8_t *bits)
{
    const struct grm_vocab *v = m->v;
    memset(bits, 0, ((size_t)v->vocab + 7) / 8);
    if (m->states[s].n == 0) return 0;
    int count = 0, d = 0;
    uint64_t work_end = m->work_done + WALK_WORK;
    m->frames[0] = (struct frame){.trie = 0, .k = v->child_first[0], .k_end = v->child_first[1],
                                  .state = s};
    while (d >= 0 && m->work_done < work_end) {
        struct frame *f = &m->frames[d];
        if (f->k == f->k_end) {
            d--;
            continue;
        }
        int32_t c = v->child[f->k];
        unsigned char b = v->child_byte[f->k];
        f->k++;
        int32_t t = step(m, f->state, b);
        if (t == DEAD) continue;
        for (int i = v->tok_first[c]; i < v->tok_first[c + 1]; i++) {
            int32_t id = v->tok_ids[i];
            bits[id >> 3] |= (uint8_t)(1u << (id & 7));
            count++;
        }
        if (m->states[t].n > 0 && v->child_first[c] < v->child_first[c + 1])
            m->frames[++d] = (struct frame){.trie = c, .k = v->child_first[c],
                                            .k_end = v->child_first[c + 1], .state = t};
    }
    return count;
}

int grm_mask(struct grm_matcher *m, float *logits)
{
    const struct grm_vocab *v = m->v;
    if (m->cur == DEAD) {
        for (int i = 0; i < v->vocab; i++) logits[i] = -INFINITY;
        return 0;
    }
    struct mask_slot *slot = NULL;
    for (int i = 0; i < MASK_CACHE && !slot; i++)
        if (m->cache[i].state == m->cur) slot = &m->cache[i];
    if (!slot) {
        slot = &m->cache[0];
        for (int i = 1; i < MASK_CACHE; i++)
            if (m->cache[i].used < slot->used) slot = &m->cache[i];
        slot->count = walk(m, m->cur, slot->bits);
        /* a walk cut short by full tables is not kept (after a restart it may finish); one
         * stopped by WALK_WORK is (it would stop again) */
        slot->state = m->full ? -1 : m->cur;
    }
    slot->used = ++m->clock;
    m->last_slot = (int)(slot - m->cache);
    m->last_cur = m->cur;
    const uint8_t *bits = slot->bits;
    int count = slot->count;
    bool end = m->states[m->cur].end;
    for (int i = 0; i < v->vocab; i++)
        if (!((bits[i >> 3] >> (i & 7)) & 1) && !(end && is_eos(v, i))) logits[i] = -INFINITY;
    if (end) count += v->n_eos;
    return count;
}

/* The state after bytes from the current one, or DEAD. */
static int32_t run(struct grm_matcher *m, const char *bytes, size_t n)
{
    if (m->cur == DEAD) return DEAD;
    if (m->full) restart(m);
    int32_t s = m->cur;
    for (size_t i = 0; i < n; i++) {
        s = step(m, s, (unsigned char)bytes[i]);
        if (s == DEAD) return DEAD;
        if (m->states[s].n == 0 && i + 1 < n) return DEAD;
    }
    return s;
}

/* The bytes of token id (false when it has none in the trie). */
static bool token_bytes(const struct grm_vocab *v, int32_t id, char *buf, int *len)
{
    const struct grm_vocab_ext *x = (const struct grm_vocab_ext *)v;
    int32_t nd = id >= 0 && id < v->vocab ? x->tok_node[id] : -1;
    if (nd < 0) return false;
    int n = 0;
    for (int32_t y = nd; y > 0 && n < 256; y = x->node_parent[y]) buf[n++] = (char)x->node_byte[y];
    for (int i = 0; i < n / 2; i++) {
        char t = buf[i];
        buf[i] = buf[n - 1 - i];
        buf[n - 1 - i] = t;
    }
    *len = n;
    return true;
}

bool grm_allows(struct grm_matcher *m, int32_t id)
{
    if (is_eos(m->v, id)) return grm_can_end(m);
    if (m->last_slot >= 0 && m->last_cur == m->cur && id >= 0 && id < m->v->vocab)
        return (m->cache[m->last_slot].bits[id >> 3] >> (id & 7)) & 1;
    char buf[256];
    int len;
    return token_bytes(m->v, id, buf, &len) && run(m, buf, (size_t)len) != DEAD;
}

int grm_accept_bytes(struct grm_matcher *m, const char *bytes, size_t n)
{
    int32_t s = run(m, bytes, n);
    if (s == DEAD) return -1;
    m->cur = s;
    /* keep well clear of the limits: the next walk may need room */
    if (m->full || m->n_nodes > POOL_NODES / 2 || m->n_states > MAX_STATES / 2 ||
        m->n_tops > STATE_INTS / 2)
        restart(m);
    return 0;
}

int grm_accept(struct grm_matcher *m, int32_t id)
{
    if (is_eos(m->v, id)) return grm_can_end(m) ? 0 : -1;
    char buf[256];
    int len;
    if (!token_bytes(m->v, id, buf, &len)) return -1;
    return grm_accept_bytes(m, buf, (size_t)len);
}

bool grm_can_end(const struct grm_matcher *m)
{
    return m->cur != DEAD && m->states[m->cur].end;
}

bool grm_must_end(const struct grm_matcher *m)
{
    return m->cur != DEAD && m->states[m->cur].end && m->states[m->cur].n == 0;
}
