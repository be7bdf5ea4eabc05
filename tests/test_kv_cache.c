/* KV cache block pool and prefix cache tests (no model): the chain hash, hits and misses,
 * reference counts of shared blocks, free-block accounting with cached-but-evictable blocks,
 * LRU eviction order (least recently released first, a sequence's tail before its head),
 * collision safety (equal hashes with other tokens, parents or keys never hit), duplicates,
 * stale children of an evicted parent, kv_prefix_reset, kept tails and the common-prefix
 * takeover of the first differing block, and blocks dropped before a sliding window. */
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "common.h"
#include "kv_cache.h"
#include "test.h"

#define BS 4
#define NB 8

static struct backend *be;

static int make_kv(struct kv_cache *kv, int n_blocks)
{
    char err[MS_ERR_LEN];
    if (kv_create(kv, be, 2, 1, 4, BS, n_blocks, err, sizeof err) != 0) {
        fprintf(stderr, "kv_create: %s\n", err);
        return -1;
    }
    return 0;
}

/* tokens of a test sequence: base, base+1, ... */
static void fill(int32_t *t, int n, int base)
{
    for (int i = 0; i < n; i++) t[i] = base + i;
}

/* A sequence that "computes" n tokens and registers its full blocks. */
static void compute(struct kv_cache *kv, struct kv_seq *s, const int32_t *t, int n)
{
    CHECK(kv_seq_reserve(kv, s, n) == 0);
    kv_seq_register(kv, s, 0, t, n);
}

static void test_hash(void)
{
    int32_t a[BS] = {1, 2, 3, 4}, b[BS] = {1, 2, 4, 3};
    uint64_t h = kv_block_hash(KV_HASH_ROOT, 0, a, BS);
    CHECK(h == kv_block_hash(KV_HASH_ROOT, 0, a, BS));
    CHECK(h != kv_block_hash(KV_HASH_ROOT, 0, b, BS)); /* order matters */
    CHECK(h != kv_block_hash(KV_HASH_ROOT, 1, a, BS)); /* key matters */
    CHECK(h != kv_block_hash(h, 0, a, BS));            /* parent matters: a chain */
    uint64_t h2 = kv_block_hash(h, 0, b, BS);
    uint64_t h2x = kv_block_hash(kv_block_hash(KV_HASH_ROOT, 0, b, BS), 0, b, BS);
    CHECK(h2 != h2x);
}

static void test_hit_refcount_accounting(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, NB) != 0) {
        CHECK(0);
        return;
    }
    int32_t t[40];
    fill(t, 40, 100);
    struct kv_seq a, b, c;
    CHECK(kv_seq_init(&a, 32, BS) == 0 && kv_seq_init(&b, 32, BS) == 0 &&
          kv_seq_init(&c, 32, BS) == 0);

    /* 10 tokens: blocks 0 and 1 are full and registered, block 2 is partial */
    compute(&kv, &a, t, 10);
    CHECK(a.n_blocks == 3 && a.n_hashed == 2);
    CHECK(kv.n_registered == 2);
    CHECK(kv_free_blocks(&kv) == NB - 3 && kv_cached_blocks(&kv) == 0);

    /* while a runs, b shares its two full blocks */
    CHECK(kv_seq_match(&kv, &b, 0, t, 2) == 2);
    CHECK(b.blocks[0] == a.blocks[0] && b.blocks[1] == a.blocks[1]);
    CHECK(kv.refcount[a.blocks[0]] == 2 && kv.refcount[a.blocks[2]] == 1);
    CHECK(kv_free_blocks(&kv) == NB - 3);
    /* max_blocks limits the match */
    CHECK(kv_seq_match(&kv, &c, 0, t, 1) == 1);
    CHECK(kv.refcount[a.blocks[0]] == 3);
    kv_seq_release(&kv, &c);
    CHECK(kv.refcount[a.blocks[0]] == 2);

    /* a releases: its partial block is free, the full ones stay referenced by b */
    int32_t a0 = a.blocks[0], a1 = a.blocks[1];
    kv_seq_release(&kv, &a);
    CHECK(kv.refcount[a0] == 1 && kv_cached_blocks(&kv) == 0);
    CHECK(kv_free_blocks(&kv) == NB - 2);
    /* b releases: both become cached and evictable, which counts as free */
    kv_seq_release(&kv, &b);
    CHECK(kv_cached_blocks(&kv) == 2);
    CHECK(kv_free_blocks(&kv) == NB);
    CHECK(kv.n_free == NB - 2);

    /* counting takes nothing; a new sequence with the same prefix and more hits both,
     * taking them off the LRU list */
    CHECK(kv_prefix_count(&kv, 0, t, 5) == 2 && kv_prefix_count(&kv, 0, t, 1) == 1);
    CHECK(kv_prefix_count(&kv, 3, t, 5) == 0 && kv_cached_blocks(&kv) == 2);
    CHECK(kv_seq_match(&kv, &c, 0, t, 5) == 2);
    CHECK(c.blocks[0] == a0 && c.blocks[1] == a1);
    CHECK(kv_cached_blocks(&kv) == 0 && kv_free_blocks(&kv) == NB - 2);
    /* and goes on computing from position 8 */
    compute(&kv, &c, t, 20);
    CHECK(c.n_blocks == 5 && c.n_hashed == 5 && kv.n_registered == 5);
    kv_seq_release(&kv, &c);
    CHECK(kv_free_blocks(&kv) == NB && kv_cached_blocks(&kv) == 5);

    /* misses: other first block, other second block, other key */
    int32_t u[40];
    memcpy(u, t, sizeof u);
    u[1] = 7;
    CHECK(kv_seq_match(&kv, &b, 0, u, 5) == 0);
    memcpy(u, t, sizeof u);
    u[5] = 7;
    CHECK(kv_seq_match(&kv, &b, 0, u, 5) == 1);
    kv_seq_release(&kv, &b);
    CHECK(kv_seq_match(&kv, &b, 3, t, 5) == 0);
    CHECK(kv_free_blocks(&kv) == NB);

    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_seq_free(&kv, &c);
    kv_destroy(&kv);
}

static void test_lru_eviction(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, NB) != 0) {
        CHECK(0);
        return;
    }
    int32_t t1[8], t2[8], t3[8];
    fill(t1, 8, 1000);
    fill(t2, 8, 2000);
    fill(t3, 8, 3000);
    struct kv_seq s1, s2, s3, x;
    CHECK(kv_seq_init(&s1, 64, BS) == 0 && kv_seq_init(&s2, 64, BS) == 0 &&
          kv_seq_init(&s3, 64, BS) == 0 && kv_seq_init(&x, 64, BS) == 0);
    compute(&kv, &s1, t1, 8);
    compute(&kv, &s2, t2, 8);
    compute(&kv, &s3, t3, 8);
    int32_t b1[2] = {s1.blocks[0], s1.blocks[1]}, b2[2] = {s2.blocks[0], s2.blocks[1]};
    CHECK(kv.n_free == 2);
    /* release order: s2, then s1, then s3; within a sequence the tail goes first */
    kv_seq_release(&kv, &s2);
    kv_seq_release(&kv, &s1);
    kv_seq_release(&kv, &s3);
    CHECK(kv_cached_blocks(&kv) == 6 && kv_free_blocks(&kv) == NB);
    CHECK(kv.lru_head == b2[1]);

    /* 3 blocks: the 2 never-used ones first, then the LRU victim: s2's tail block */
    CHECK(kv_seq_reserve(&kv, &x, 3 * BS) == 0);
    CHECK(x.blocks[2] == b2[1]);
    CHECK(!kv.registered[b2[1]] && kv.n_evictions == 1);
    CHECK(kv_cached_blocks(&kv) == 5);
    /* s2's head block is still cached (a partial hit); s1 fully */
    CHECK(kv_seq_match(&kv, &s2, 0, t2, 2) == 1);
    CHECK(kv_seq_match(&kv, &s1, 0, t1, 2) == 2 && s1.blocks[1] == b1[1]);
    kv_seq_release(&kv, &s1);
    kv_seq_release(&kv, &s2);
    /* filling the pool evicts everything that is cached */
    CHECK(kv_seq_reserve(&kv, &x, 8 * BS) == 0);
    CHECK(kv_free_blocks(&kv) == 0 && kv_cached_blocks(&kv) == 0);
    CHECK(kv.n_evictions == 6);
    /* nothing left to hit, nothing left to reserve */
    CHECK(kv_seq_match(&kv, &s1, 0, t1, 2) == 0);
    struct kv_seq y;
    CHECK(kv_seq_init(&y, 64, BS) == 0);
    CHECK(kv_seq_reserve(&kv, &y, 1) == -1 && y.n_blocks == 0);
    kv_seq_free(&kv, &y);
    kv_seq_release(&kv, &x);
    CHECK(kv_free_blocks(&kv) == NB && kv.n_free == NB);

    kv_seq_free(&kv, &s1);
    kv_seq_free(&kv, &s2);
    kv_seq_free(&kv, &s3);
    kv_seq_free(&kv, &x);
    kv_destroy(&kv);
}

/* Eviction order checked block by block: reserve one block at a time. */
static void test_lru_order(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, 6) != 0) {
        CHECK(0);
        return;
    }
    int32_t t1[8], t2[8], t3[8];
    fill(t1, 8, 10);
    fill(t2, 8, 20);
    fill(t3, 8, 30);
    struct kv_seq s1, s2, s3, x;
    CHECK(kv_seq_init(&s1, 64, BS) == 0 && kv_seq_init(&s2, 64, BS) == 0 &&
          kv_seq_init(&s3, 64, BS) == 0 && kv_seq_init(&x, 64, BS) == 0);
    compute(&kv, &s1, t1, 8);
    compute(&kv, &s2, t2, 8);
    compute(&kv, &s3, t3, 8);
    int32_t want[6] = {s3.blocks[1], s3.blocks[0], s1.blocks[1],
                       s1.blocks[0], s2.blocks[1], s2.blocks[0]};
    kv_seq_release(&kv, &s3);
    kv_seq_release(&kv, &s1);
    kv_seq_release(&kv, &s2);
    /* a hit refreshes: s1 taken and released again moves behind s2 */
    CHECK(kv_seq_match(&kv, &s1, 0, t1, 2) == 2);
    kv_seq_release(&kv, &s1);
    int32_t want2[6] = {want[0], want[1], want[4], want[5], want[2], want[3]};
    for (int i = 0; i < 6; i++) {
        CHECK(kv_seq_reserve(&kv, &x, (i + 1) * BS) == 0);
        CHECKF(x.blocks[i] == want2[i], "victim %d: block %d, want %d", i, x.blocks[i],
               want2[i]);
    }
    kv_seq_free(&kv, &s1);
    kv_seq_free(&kv, &s2);
    kv_seq_free(&kv, &s3);
    kv_seq_free(&kv, &x);
    kv_destroy(&kv);
}

static void test_collisions(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, NB) != 0) {
        CHECK(0);
        return;
    }
    int32_t t[8], u[8];
    fill(t, 8, 500);
    fill(u, 8, 600);
    struct kv_seq a, b, c;
    CHECK(kv_seq_init(&a, 64, BS) == 0 && kv_seq_init(&b, 64, BS) == 0 &&
          kv_seq_init(&c, 64, BS) == 0);
    compute(&kv, &a, t, 8);
    uint64_t h0 = a.hash[0], h1 = a.hash[1];
    /* found with its own hash, tokens, parent and key */
    CHECK(kv_prefix_lookup(&kv, -1, 0, h0, t) == a.blocks[0]);
    CHECK(kv_prefix_lookup(&kv, a.blocks[0], 0, h1, t + BS) == a.blocks[1]);
    /* the same 64-bit hash with other tokens (a forced collision) never hits */
    CHECK(kv_prefix_lookup(&kv, -1, 0, h0, u) == -1);
    CHECK(kv_prefix_lookup(&kv, a.blocks[0], 0, h1, u) == -1);
    /* nor with another parent or key */
    CHECK(kv_prefix_lookup(&kv, -1, 0, h1, t + BS) == -1);
    CHECK(kv_prefix_lookup(&kv, a.blocks[1], 0, h1, t + BS) == -1);
    CHECK(kv_prefix_lookup(&kv, a.blocks[0], 1, h1, t + BS) == -1);
    /* a hash in the same bucket that differs in its high bits */
    CHECK(kv_prefix_lookup(&kv, -1, 0, h0 ^ ((uint64_t)1 << 63), t) == -1);

    /* a duplicate: c computes t on its own while a holds the registered copy */
    compute(&kv, &c, t, 8);
    CHECK(c.blocks[0] != a.blocks[0] && !kv.registered[c.blocks[0]] && c.reg_stop);
    CHECK(kv.n_registered == 2);
    int32_t c0 = c.blocks[0];
    kv_seq_release(&kv, &c); /* unregistered: straight back to the free list */
    CHECK(kv.refcount[c0] == 0 && kv_cached_blocks(&kv) == 0);

    /* kv_prefix_reset forgets evictable blocks; held ones stay registered */
    CHECK(kv_seq_match(&kv, &b, 0, t, 1) == 1);
    kv_seq_release(&kv, &a); /* a's tail becomes evictable, its head is still held by b */
    CHECK(kv_cached_blocks(&kv) == 1);
    CHECK(kv_prefix_reset(&kv) == 1);
    CHECK(kv.n_registered == 1 && kv_cached_blocks(&kv) == 0 && kv_free_blocks(&kv) == NB - 1);
    kv_seq_release(&kv, &b);
    CHECK(kv_prefix_reset(&kv) == 1);
    CHECK(kv.n_registered == 0 && kv.n_free == NB);
    CHECK(kv_seq_match(&kv, &b, 0, t, 2) == 0);

    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_seq_free(&kv, &c);
    kv_destroy(&kv);
}

/* A child block is only reachable from the very registration of its parent it was computed
 * on. Through the API a parent always outlives its children in the LRU list (every holder of
 * a child holds its parent and releases tail first), so this state is simulated: a parent
 * re-registered (generation bump, as after eviction and reuse for the same tokens) no longer
 * leads to the old child. */
static void test_stale_parent(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, 4) != 0) {
        CHECK(0);
        return;
    }
    int32_t t[8];
    fill(t, 8, 70);
    struct kv_seq a, b;
    CHECK(kv_seq_init(&a, 64, BS) == 0 && kv_seq_init(&b, 64, BS) == 0);
    compute(&kv, &a, t, 8);
    int32_t head = a.blocks[0], child = a.blocks[1];
    CHECK(kv.parent[child] == head && kv.parent_gen[child] == kv.gen[head]);
    kv_seq_release(&kv, &a);
    CHECK(kv.lru_head == child && kv.lru_tail == head); /* the child goes first */
    CHECK(kv_prefix_lookup(&kv, head, 0, a.hash[1], t + BS) == child);
    kv.gen[head]++;
    CHECK(kv_prefix_lookup(&kv, head, 0, a.hash[1], t + BS) == -1);
    CHECK(kv_seq_match(&kv, &b, 0, t, 2) == 1);
    kv_seq_release(&kv, &b);
    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_destroy(&kv);
}

/* A finished sequence's partial last block stays cached as a tail; a later sequence takes the
 * cached block after its full-block match with the longest common prefix, only when nobody
 * holds it, and it leaves the cache then. */
static void test_tails(void)
{
    struct kv_cache kv;
    if (make_kv(&kv, NB) != 0) {
        CHECK(0);
        return;
    }
    int32_t t[16], u[16];
    fill(t, 16, 300);
    fill(u, 16, 300);
    u[6] = 999; /* u shares t's first block and 2 tokens of the second */
    struct kv_seq a, b, c;
    CHECK(kv_seq_init(&a, 32, BS) == 0 && kv_seq_init(&b, 32, BS) == 0 &&
          kv_seq_init(&c, 32, BS) == 0);
    compute(&kv, &a, t, 7); /* one full block, 3 tokens of the second */
    kv_seq_keep_tail(&kv, &a, 0, t, 7);
    CHECK(kv.tail[a.blocks[1]] && kv.fill[a.blocks[1]] == 3);
    /* held by a: not taken */
    CHECK(kv_seq_match(&kv, &b, 0, t, 1) == 1 && kv_seq_match_tail(&kv, &b, 0, t, 7) == 0);
    kv_seq_release(&kv, &b);
    int32_t tail = a.blocks[1];
    kv_seq_release(&kv, &a);
    CHECK(kv_cached_blocks(&kv) == 2);
    /* u: the first block, then 2 tokens of the tail (they differ at position 6) */
    CHECK(kv_seq_match(&kv, &b, 0, u, 1) == 1);
    CHECK(kv_seq_match_tail(&kv, &b, 0, u, 15) == 2 && b.n_blocks == 2 && b.blocks[1] == tail);
    CHECK(!kv.tail[tail] && kv_cached_blocks(&kv) == 0); /* b's own now */
    /* another key, or the block already taken: nothing */
    CHECK(kv_seq_match(&kv, &c, 1, t, 1) == 0 && kv_seq_match_tail(&kv, &c, 1, t, 7) == 0);
    kv_seq_release(&kv, &c);
    CHECK(kv_seq_match(&kv, &c, 0, t, 1) == 1 && kv_seq_match_tail(&kv, &c, 0, t, 7) == 0);
    /* the limit leaves the last token to compute */
    kv_seq_release(&kv, &c);
    kv_seq_release(&kv, &b); /* b's second block was never registered: freed */
    CHECK(kv_seq_match(&kv, &a, 0, t, 1) == 1); /* the cached first block, then 2 new tokens */
    compute(&kv, &a, t, 6);
    kv_seq_keep_tail(&kv, &a, 0, t, 6);
    kv_seq_release(&kv, &a);
    CHECK(kv_seq_match(&kv, &c, 0, t, 1) == 1 && kv_seq_match_tail(&kv, &c, 0, t, 5) == 1);
    kv_seq_release(&kv, &c);
    /* reset forgets tails too */
    CHECK(kv_seq_match(&kv, &a, 0, t, 1) == 1);
    compute(&kv, &a, t, 7);
    kv_seq_keep_tail(&kv, &a, 0, t, 7);
    kv_seq_release(&kv, &a);
    CHECK(kv_cached_blocks(&kv) == 2);
    CHECK(kv_prefix_reset(&kv) == 2 && kv_cached_blocks(&kv) == 0 && kv_free_blocks(&kv) == NB);
    /* blocks before a window go back; registration stops at them */
    compute(&kv, &a, t, 12);
    CHECK(kv_seq_drop_before(&kv, &a, 9) == 2 && a.blocks[0] == -1 && a.blocks[1] == -1);
    CHECK(kv_seq_drop_before(&kv, &a, 9) == 0 && a.n_blocks == 3);
    kv_seq_release(&kv, &a);
    CHECK(kv_free_blocks(&kv) == NB);
    kv_seq_free(&kv, &a);
    kv_seq_free(&kv, &b);
    kv_seq_free(&kv, &c);
    kv_destroy(&kv);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    be = backend_cpu_create(1, false);
    if (!be) {
        CHECK(0);
        return test_done("test_kv_cache");
    }
    test_hash();
    test_hit_refcount_accounting();
    test_lru_eviction();
    test_lru_order();
    test_collisions();
    test_stale_parent();
    test_tails();
    be->ops->destroy(be);
    return test_done("test_kv_cache");
}
