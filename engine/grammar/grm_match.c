/* Matching (see grammar.h): the vocabulary's byte trie, the matcher's stack sets and the
 * token mask. A stack is a chain of nodes {pos, parent}: pos is the next element of some rule
 * alternative, parent the node to continue at when that alternative ends (-1: the end of the
 * output). Stacks share their lower nodes. A stack set lists top nodes, each at a byte-set
 * element ("expanded": rule references and alternative ends are resolved eagerly), plus a
 * flag telling whether the output may end there.
 *
 * Memory: a matcher allocates its node pool, scratch sets and DFS frames once. Nodes [0, live)
 * hold the current stacks; the mask's walk and grm_accept build on top of them and the walk
 * drops what it built when it backtracks. grm_accept then copies the surviving stacks down to
 * a fresh pool (a compaction), so the pool does not fill up over a long output. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grm_internal.h"

#define POOL_NODES (1 << 16)   /* stack nodes of a matcher */
#define MAX_SET 512            /* stacks kept in one set (more: the rest are dropped) */
#define SCRATCH_INTS (1 << 16) /* room for the sets of the mask's walk */

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

struct gnode {
    int32_t pos, parent;
};

/* A stack set in the scratch area: tops at sets[off .. off + n). */
struct gset {
    int off, n;
    bool end;
};

struct frame {
    int32_t trie;     /* trie node */
    int32_t k, k_end; /* next child edge */
    struct gset set;  /* the stacks after this node's bytes */
    int node_top;     /* pool top after building them */
    int scratch_top;  /* scratch top after them */
};

struct grm_matcher {
    const struct grm_grammar *g;
    const struct grm_vocab *v;
    struct gnode *pool, *pool2; /* (POOL_NODES) */
    int32_t *fwd;               /* (POOL_NODES) compaction: new index of an old node, -1 */
    int top;                    /* pool nodes in use */
    int live;                   /* nodes of the current stacks: [0, live) */
    bool overflow;              /* the pool or a set ran out of room */
    int32_t *scratch;           /* (SCRATCH_INTS) sets */
    int scratch_top;
    struct gset cur;            /* the current set; its tops are in cur_tops */
    int32_t *cur_tops;          /* (MAX_SET) */
    int32_t *work;              /* (POOL_NODES) expansion worklist */
    struct frame *frames;       /* (max_depth + 2) */
    uint8_t *allowed;           /* (vocab / 8 rounded up) */
};

static int new_node(struct grm_matcher *m, int32_t pos, int32_t parent)
{
    if (m->top >= POOL_NODES) {
        m->overflow = true;
        return -2;
    }
    m->pool[m->top] = (struct gnode){pos, parent};
    return m->top++;
}

/* Adds x's stacks, expanded to byte-set tops, to the set being built at scratch[s->off..]. */
static void expand(struct grm_matcher *m, int32_t x, struct gset *s)
{
    const struct grm_grammar *g = m->g;
    int nw = 0;
    m->work[nw++] = x;
    while (nw > 0) {
        int32_t y = m->work[--nw];
        if (y < 0) {
            if (y == -1) s->end = true;
            continue;
        }
        uint32_t el = g->els[m->pool[y].pos];
        switch (GRM_EL_KIND(el)) {
        case GRM_EL_SET: {
            int32_t pos = m->pool[y].pos, parent = m->pool[y].parent;
            bool dup = false;
            for (int i = 0; i < s->n && !dup; i++) {
                const struct gnode *o = &m->pool[m->scratch[s->off + i]];
                dup = o->pos == pos && o->parent == parent;
            }
            if (dup) break;
            if (s->n >= MAX_SET || s->off + s->n >= SCRATCH_INTS) {
                m->overflow = true;
                break;
            }
            m->scratch[s->off + s->n++] = y;
            break;
        }
        case GRM_EL_END:
            m->work[nw++] = m->pool[y].parent;
            break;
        default: { /* a rule reference */
            int r = (int)GRM_EL_IDX(el);
            int32_t pos = m->pool[y].pos;
            /* continue after the reference; a reference ending its alternative continues
             * straight at the parent (no node for an END) */
            int32_t cont = GRM_EL_KIND(g->els[pos + 1]) == GRM_EL_END
                               ? m->pool[y].parent
                               : new_node(m, pos + 1, m->pool[y].parent);
            if (cont == -2) break;
            for (int a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
                int32_t z = new_node(m, g->alt_start[a], cont);
                if (z < 0) break;
                if (nw >= POOL_NODES) {
                    m->overflow = true;
                    break;
                }
                m->work[nw++] = z;
            }
        }
        }
    }
}

/* The set reached from `in` by byte b, built at the scratch top. */
static struct gset advance(struct grm_matcher *m, const int32_t *in, int n_in, unsigned char b)
{
    struct gset s = {.off = m->scratch_top, .n = 0, .end = false};
    const struct grm_grammar *g = m->g;
    for (int i = 0; i < n_in; i++) {
        const struct gnode *x = &m->pool[in[i]];
        if (!grm_set_has(&g->sets[GRM_EL_IDX(g->els[x->pos])], b)) continue;
        int32_t y = GRM_EL_KIND(g->els[x->pos + 1]) == GRM_EL_END
                        ? x->parent
                        : new_node(m, x->pos + 1, x->parent);
        if (y == -2) continue;
        expand(m, y, &s);
    }
    return s;
}

/* Makes set s (tops in scratch) the current set: copies its stacks to the bottom of a fresh
 * pool and swaps pools. */
static void compact(struct grm_matcher *m, struct gset s)
{
    int old_top = m->top;
    for (int i = 0; i < old_top; i++) m->fwd[i] = -1;
    int n = 0;
    int32_t *chain = m->work; /* free while compacting */
    for (int i = 0; i < s.n; i++) {
        /* map the chain from this top down to the first node already mapped, bottom up */
        int depth = 0;
        for (int32_t x = m->scratch[s.off + i]; x >= 0 && m->fwd[x] < 0; x = m->pool[x].parent)
            chain[depth++] = x;
        while (depth > 0) {
            int32_t y = chain[--depth];
            int32_t par = m->pool[y].parent;
            m->pool2[n] = (struct gnode){m->pool[y].pos, par < 0 ? par : m->fwd[par]};
            m->fwd[y] = n++;
        }
    }
    int cn = 0;
    for (int i = 0; i < s.n; i++) m->cur_tops[cn++] = m->fwd[m->scratch[s.off + i]];
    struct gnode *t = m->pool;
    m->pool = m->pool2;
    m->pool2 = t;
    m->top = m->live = n;
    m->cur = (struct gset){.off = 0, .n = cn, .end = s.end};
    m->scratch_top = 0;
}

struct grm_matcher *grm_matcher_create(const struct grm_grammar *g)
{
    struct grm_matcher *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    const struct grm_vocab *v = g->vocab;
    m->g = g;
    m->v = v;
    m->pool = malloc(sizeof *m->pool * POOL_NODES);
    m->pool2 = malloc(sizeof *m->pool2 * POOL_NODES);
    m->fwd = malloc(sizeof *m->fwd * POOL_NODES);
    m->work = malloc(sizeof *m->work * POOL_NODES);
    m->scratch = malloc(sizeof *m->scratch * SCRATCH_INTS);
    m->cur_tops = malloc(sizeof *m->cur_tops * MAX_SET);
    m->frames = malloc(sizeof *m->frames * (size_t)(v->max_depth + 2));
    m->allowed = malloc(((size_t)v->vocab + 7) / 8);
    if (!m->pool || !m->pool2 || !m->fwd || !m->work || !m->scratch || !m->cur_tops ||
        !m->frames || !m->allowed) {
        grm_matcher_free(m);
        return NULL;
    }
    int start = v->strip_first_space ? g->root_sp : g->root;
    struct gset s = {.off = 0};
    for (int a = g->rule_alt[start]; a < g->rule_alt[start + 1]; a++) {
        int32_t x = new_node(m, g->alt_start[a], -1);
        if (x >= 0) expand(m, x, &s);
    }
    m->scratch_top = s.n;
    compact(m, s);
    return m;
}

void grm_matcher_free(struct grm_matcher *m)
{
    if (!m) return;
    free(m->pool);
    free(m->pool2);
    free(m->fwd);
    free(m->work);
    free(m->scratch);
    free(m->cur_tops);
    free(m->frames);
    free(m->allowed);
    free(m);
}

static bool is_eos(const struct grm_vocab *v, int32_t id)
{
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return true;
    return false;
}

int grm_mask(struct grm_matcher *m, float *logits)
{
    const struct grm_vocab *v = m->v;
    memset(m->allowed, 0, ((size_t)v->vocab + 7) / 8);
    int count = 0;
    /* the current set's tops, copied to the scratch bottom as the root frame's set */
    memcpy(m->scratch, m->cur_tops, sizeof *m->scratch * (size_t)m->cur.n);
    m->scratch_top = m->cur.n;
    m->top = m->live;
    int d = 0;
    m->frames[0] = (struct frame){.trie = 0, .k = v->child_first[0], .k_end = v->child_first[1],
                                  .set = {.off = 0, .n = m->cur.n, .end = m->cur.end},
                                  .node_top = m->live, .scratch_top = m->cur.n};
    while (d >= 0) {
        struct frame *f = &m->frames[d];
        if (f->k == f->k_end || f->set.n == 0) {
            d--;
            continue;
        }
        int32_t c = v->child[f->k];
        unsigned char b = v->child_byte[f->k];
        f->k++;
        m->top = f->node_top; /* what an earlier sibling built is garbage now */
        m->scratch_top = f->scratch_top;
        struct gset s = advance(m, m->scratch + f->set.off, f->set.n, b);
        if (s.n == 0 && !s.end) continue;
        for (int t = v->tok_first[c]; t < v->tok_first[c + 1]; t++) {
            int32_t id = v->tok_ids[t];
            m->allowed[id >> 3] |= (uint8_t)(1u << (id & 7));
            count++;
        }
        if (s.n > 0 && v->child_first[c] < v->child_first[c + 1]) {
            m->frames[++d] = (struct frame){.trie = c, .k = v->child_first[c],
                                            .k_end = v->child_first[c + 1], .set = s,
                                            .node_top = m->top,
                                            .scratch_top = s.off + s.n};
        }
    }
    m->top = m->live;
    m->scratch_top = 0;
    if (m->cur.end)
        for (int i = 0; i < v->n_eos; i++) {
            int32_t id = v->eos[i];
            if (!((m->allowed[id >> 3] >> (id & 7)) & 1)) count++;
            m->allowed[id >> 3] |= (uint8_t)(1u << (id & 7));
        }
    for (int i = 0; i < v->vocab; i++)
        if (!((m->allowed[i >> 3] >> (i & 7)) & 1)) logits[i] = -INFINITY;
    return count;
}

int grm_accept_bytes(struct grm_matcher *m, const char *bytes, size_t n)
{
    m->top = m->live;
    m->scratch_top = 0;
    memcpy(m->scratch, m->cur_tops, sizeof *m->scratch * (size_t)m->cur.n);
    struct gset s = {.off = 0, .n = m->cur.n, .end = m->cur.end};
    m->scratch_top = s.n;
    for (size_t i = 0; i < n; i++) {
        struct gset t = advance(m, m->scratch + s.off, s.n, (unsigned char)bytes[i]);
        if (t.n == 0 && !(t.end && i + 1 == n)) {
            m->top = m->live;
            m->scratch_top = 0;
            return -1;
        }
        m->scratch_top = t.off + t.n;
        s = t;
    }
    compact(m, s);
    return 0;
}

int grm_accept(struct grm_matcher *m, int32_t id)
{
    const struct grm_vocab *v = m->v;
    if (is_eos(v, id)) return m->cur.end ? 0 : -1;
    if (id < 0 || id >= v->vocab) return -1;
    const struct grm_vocab_ext *x = (const struct grm_vocab_ext *)v;
    int32_t node = x->tok_node[id];
    if (node < 0) return -1;
    char buf[256];
    int len = 0;
    for (int32_t y = node; y > 0 && len < (int)sizeof buf; y = x->node_parent[y]) buf[len++] = (char)x->node_byte[y];
    for (int i = 0; i < len / 2; i++) {
        char t = buf[i];
        buf[i] = buf[len - 1 - i];
        buf[len - 1 - i] = t;
    }
    return grm_accept_bytes(m, buf, (size_t)len);
}

bool grm_can_end(const struct grm_matcher *m)
{
    return m->cur.end;
}

bool grm_must_end(const struct grm_matcher *m)
{
    return m->cur.end && m->cur.n == 0;
}
