/* Checks shared by the communicator tests that run across processes (tests/mpi/test_comm_mpi.c,
 * tests/test_comm_tcp.c): all_to_all_v moves exactly the rows comm.h promises (counts and bytes
 * from a formula every rank can evaluate, zero counts and self rows included, several row
 * sizes) and counts them in bytes_sent; send/recv carry a message and its length between rank 0
 * and each other rank and count it in msg_bytes_sent. Include once per test program. */
#ifndef MOESERVE_COMM_CHECK_H
#define MOESERVE_COMM_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "test.h"

/* Rows rank s sends to rank d in round r: some zero, some large. */
static inline int rows_for(int r, int s, int d)
{
    int v = (r * 7 + s * 13 + d * 5) % 11;
    return v < 3 ? 0 : v * (r + 1);
}

/* Byte b of row i that s sends to d in round r. */
static inline unsigned char byte_for(int r, int s, int d, int i, size_t b)
{
    return (unsigned char)(r * 31 + s * 17 + d * 7 + i * 3 + (int)b);
}

static inline void test_exchange(struct comm *c)
{
    int n = c->n_rank, me = c->self;
    size_t row_sizes[] = {4, 40, 4096};
    size_t cap = 0;
    for (int r = 0; r < 6; r++)
        for (int p = 0; p < n; p++) {
            size_t a = 0, b = 0;
            for (int q = 0; q < n; q++) {
                a += (size_t)rows_for(r, p, q);
                b += (size_t)rows_for(r, q, p);
            }
            cap = a > cap ? a : cap;
            cap = b > cap ? b : cap;
        }
    unsigned char *send = malloc(cap * 4096), *recv = malloc(cap * 4096);
    int *sc = calloc((size_t)n, sizeof(int)), *rc = calloc((size_t)n, sizeof(int));
    unsigned long long before_self = c->bytes_sent[(size_t)me * n + me];
    CHECK(send && recv && sc && rc);
    if (!send || !recv || !sc || !rc) goto out;
    for (int r = 0; r < 6; r++) {
        size_t rb = row_sizes[r % 3], off = 0;
        for (int d = 0; d < n; d++) {
            sc[d] = rows_for(r, me, d);
            for (int i = 0; i < sc[d]; i++, off += rb)
                for (size_t b = 0; b < rb; b++)
                    send[off + b] = byte_for(r, me, d, i, b);
        }
        memset(recv, 0xEE, cap * rb);
        for (int s = 0; s < n; s++)
            rc[s] = -7;
        CHECKF(c->ops->all_to_all_v(c, me, send, sc, recv, rc, rb) == 0, "round %d", r);
        off = 0;
        int bad = 0;
        for (int s = 0; s < n; s++) {
            CHECKF(rc[s] == rows_for(r, s, me), "round %d: %d rows from %d, want %d", r, rc[s], s,
                   rows_for(r, s, me));
            for (int i = 0; i < rows_for(r, s, me); i++, off += rb)
                for (size_t b = 0; b < rb; b++)
                    bad += recv[off + b] != byte_for(r, s, me, i, b);
        }
        CHECKF(bad == 0, "round %d (row %zu bytes): %d bytes differ", r, rb, bad);
    }
    /* bytes_sent counts what went to other ranks, nothing for the rank itself */
    CHECK(c->bytes_sent[(size_t)me * n + me] == before_self);
    for (int d = 0; d < n; d++) {
        if (d == me) continue;
        unsigned long long want = 0;
        for (int r = 0; r < 6; r++)
            want += (unsigned long long)rows_for(r, me, d) * row_sizes[r % 3];
        CHECKF(c->bytes_sent[(size_t)me * n + d] == want, "bytes to %d: %llu, want %llu", d,
               c->bytes_sent[(size_t)me * n + d], want);
    }
out:
    free(send);
    free(recv);
    free(sc);
    free(rc);
}

/* Rank 0 sends every other rank a message of its own length; each answers with it reversed. */
static inline void test_p2p(struct comm *c)
{
    int n = c->n_rank, me = c->self;
    char buf[256], back[256];
    size_t got = 0, sent = 0;
    unsigned long long before = c->msg_bytes_sent;
    if (me == 0) {
        for (int d = 1; d < n; d++) {
            int len = snprintf(buf, sizeof buf, "step plan for rank %d", d);
            CHECK(c->ops->send(c, d, buf, (size_t)len) == 0);
            sent += (size_t)len;
        }
        for (int d = 1; d < n; d++) {
            CHECK(c->ops->recv(c, d, back, sizeof back, &got) == 0);
            int len = snprintf(buf, sizeof buf, "step plan for rank %d", d);
            CHECKF(got == (size_t)len, "reply of %zu bytes from %d, want %d", got, d, len);
            int same = got == (size_t)len;
            for (int i = 0; same && i < len; i++)
                same = back[i] == buf[len - 1 - i];
            CHECKF(same, "reply from %d", d);
        }
    } else {
        CHECK(c->ops->recv(c, 0, buf, sizeof buf, &got) == 0);
        char want[64];
        int len = snprintf(want, sizeof want, "step plan for rank %d", me);
        CHECKF(got == (size_t)len && memcmp(buf, want, got) == 0, "rank %d got '%.*s'", me,
               (int)got, buf);
        for (size_t i = 0; i < got; i++)
            back[i] = buf[got - 1 - i];
        CHECK(c->ops->send(c, 0, back, got) == 0);
        sent = got;
    }
    CHECKF(c->msg_bytes_sent - before == sent, "rank %d: %llu message bytes counted, %zu sent", me,
           c->msg_bytes_sent - before, sent);
}

#endif
