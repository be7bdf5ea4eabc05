/* NCCL implementation of engine/comm/comm.h (see comm_nccl.h): per-rank NCCL communicator, stream,
 * and count buffers (device and pinned host) allocated once at creation, so an exchange only
 * enqueues an all-gather of counts and one send/recv group. The multi-process constructor
 * hands rank 0's unique id to the other processes through engine/comm/bootstrap. Guarded by
 * MOESERVE_HAVE_NCCL; without it the constructors report that NCCL is missing. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bootstrap.h"
#include "comm_nccl.h"
#include "common.h"
#include "cuda_check.h"

#define CN_ERR_LEN 512

#ifdef MOESERVE_HAVE_NCCL

struct cn_rank {
    int device;
    ncclComm_t nccl;
    cudaStream_t own;    /* created here */
    cudaStream_t stream; /* `own`, or the caller's from comm_nccl_set_stream */
    int *d_send_counts;  /* (n_rank) device */
    int *d_all_counts;   /* (n_rank, n_rank) device, row = sender */
    int *h_counts;       /* (n_rank + n_rank * n_rank) pinned: send row, then the matrix */
    int *d_token;        /* (1) device, for the barrier's all-reduce */
    int failed;
    char first[CN_ERR_LEN];
    char last[CN_ERR_LEN];
};

struct comm_nccl {
    struct comm base;      /* base.n_rank: ranks in the whole world */
    double timeout_s;      /* comm_nccl_set_timeout; 0: exchanges wait as long as they take */
    int first_rank;        /* global rank of ranks[0] */
    int n_local;           /* ranks driven by this process */
    struct cn_rank *ranks; /* (n_local) */
};

/* The state of global rank `rank`, NULL when another process drives it. */
static struct cn_rank *cn_local(struct comm *c, int rank)
{
    struct comm_nccl *cn = (struct comm_nccl *)c;
    int i = rank - cn->first_rank;
    return i >= 0 && i < cn->n_local ? &cn->ranks[i] : NULL;
}

static int cn_note(struct cn_rank *r, int rc)
{
    if (rc < 0 && !r->failed) {
        r->failed = 1;
        memcpy(r->first, r->last, sizeof r->first);
    }
    return rc;
}

#define CN_CUDA(r, call) cn_note((r), CUDA_CHECK(call, (r)->last, sizeof(r)->last))
#define CN_NCCL(r, call) cn_note((r), NCCL_CHECK(call, (r)->last, sizeof(r)->last))

/* Waits for rank r's stream. With a timeout set, polls it against the deadline and NCCL's
 * asynchronous error: a peer that died or hangs makes the wait abort the NCCL communicator
 * (ncclCommAbort ends its kernels) and fail with a reason, instead of blocking forever. */
static int cn_wait(struct comm_nccl *cn, struct cn_rank *r, int rank)
{
    if (cn->timeout_s <= 0) return CN_CUDA(r, cudaStreamSynchronize(r->stream));
    double deadline = ms_now() + cn->timeout_s;
    for (;;) {
        cudaError_t q = cudaStreamQuery(r->stream);
        if (q == cudaSuccess) return 0;
        if (q != cudaErrorNotReady) return CN_CUDA(r, q);
        ncclResult_t async = ncclSuccess;
        if (r->nccl && ncclCommGetAsyncError(r->nccl, &async) == ncclSuccess &&
            async != ncclSuccess && async != ncclInProgress) {
            ms_errf(r->last, sizeof r->last, "rank %d: NCCL reports %s during an exchange",
                    rank, ncclGetErrorString(async));
            break;
        }
        if (ms_now() > deadline) {
            ms_errf(r->last, sizeof r->last,
                    "rank %d: an NCCL exchange did not finish within %.1f s (a peer failed or "
                    "hangs)",
                    rank, cn->timeout_s);
            break;
        }
        struct timespec ts = {0, 20 * 1000};
        nanosleep(&ts, NULL);
    }
    if (r->nccl) (void)ncclCommAbort(r->nccl); /* broken for good: later calls fail */
    r->nccl = NULL;
    return cn_note(r, -1);
}

static void cn_destroy(struct comm *c)
{
    struct comm_nccl *cn = (struct comm_nccl *)c;
    if (!cn) return;
    if (cn->ranks) {
        for (int i = 0; i < cn->n_local; i++) {
            struct cn_rank *r = &cn->ranks[i];
            cudaSetDevice(r->device);
            if (r->nccl) ncclCommDestroy(r->nccl);
            if (r->own) cudaStreamDestroy(r->own);
            if (r->d_send_counts) cudaFree(r->d_send_counts);
            if (r->d_all_counts) cudaFree(r->d_all_counts);
            if (r->d_token) cudaFree(r->d_token);
            if (r->h_counts) cudaFreeHost(r->h_counts);
        }
        free(cn->ranks);
    }
    free(c->bytes_sent);
    free(cn);
}

static int cn_all_to_all_v(struct comm *c, int rank, const void *send, const int *send_counts,
                           void *recv, int *recv_counts, size_t row_bytes)
{
    int n = c->n_rank;
    struct comm_nccl *cn = (struct comm_nccl *)c;
    struct cn_rank *r = cn_local(c, rank);
    if (!r || !r->nccl) return -1; /* not ours, or aborted after a failure */
    if (CN_CUDA(r, cudaSetDevice(r->device)) < 0) return -1;
    /* Rows may come from any stream of this device unless the caller named the stream. */
    if (r->stream == r->own && CN_CUDA(r, cudaDeviceSynchronize()) < 0) return -1;

    /* 1. Everyone learns every rank's send counts. */
    int *h_send = r->h_counts, *h_all = r->h_counts + n;
    memcpy(h_send, send_counts, sizeof(int) * (size_t)n);
    if (CN_CUDA(r, cudaMemcpyAsync(r->d_send_counts, h_send, sizeof(int) * (size_t)n,
                                   cudaMemcpyHostToDevice, r->stream)) < 0)
        return -1;
    if (CN_NCCL(r, ncclAllGather(r->d_send_counts, r->d_all_counts, (size_t)n, ncclInt32, r->nccl,
                                 r->stream)) < 0)
        return -1;
    if (CN_CUDA(r, cudaMemcpyAsync(h_all, r->d_all_counts, sizeof(int) * (size_t)n * n,
                                   cudaMemcpyDeviceToHost, r->stream)) < 0)
        return -1;
    if (cn_wait(cn, r, rank) < 0) return -1;
    for (int s = 0; s < n; s++) {
        recv_counts[s] = h_all[(size_t)s * n + rank];
        if (recv_counts[s] < 0 || h_all[(size_t)rank * n + s] != send_counts[s]) {
            ms_errf(r->last, sizeof r->last, "all_to_all_v: inconsistent counts at rank %d", rank);
            return cn_note(r, -1);
        }
    }

    /* 2. The rows: one group, so the sends and receives of all peers progress together. */
    const char *sp = (const char *)send;
    char *rp = (char *)recv;
    if (CN_NCCL(r, ncclGroupStart()) < 0) return -1;
    int rc = 0;
    for (int p = 0; p < n && rc == 0; p++) {
        size_t sbytes = (size_t)send_counts[p] * row_bytes;
        size_t rbytes = (size_t)recv_counts[p] * row_bytes;
        if (sbytes) rc = CN_NCCL(r, ncclSend(sp, sbytes, ncclUint8, p, r->nccl, r->stream));
        if (rc == 0 && rbytes)
            rc = CN_NCCL(r, ncclRecv(rp, rbytes, ncclUint8, p, r->nccl, r->stream));
        sp += sbytes;
        rp += rbytes;
    }
    /* The group must be closed even after a failed enqueue. */
    if (CN_NCCL(r, ncclGroupEnd()) < 0 || rc < 0) return -1;
    if (cn_wait(cn, r, rank) < 0) return -1;

    for (int p = 0; p < n; p++)
        if (p != rank) c->bytes_sent[(size_t)rank * n + p] += (size_t)send_counts[p] * row_bytes;
    return 0;
}

static void cn_barrier(struct comm *c, int rank)
{
    struct cn_rank *r = cn_local(c, rank);
    if (!r || !r->nccl || c->n_rank == 1) return;
    if (CN_CUDA(r, cudaSetDevice(r->device)) < 0) return;
    if (CN_NCCL(r, ncclAllReduce(r->d_token, r->d_token, 1, ncclInt32, ncclSum, r->nccl,
                                 r->stream)) < 0)
        return;
    cn_wait((struct comm_nccl *)c, r, rank);
}

static const struct comm_ops nccl_ops = {
    /* .name */ "nccl",
    /* .destroy */ cn_destroy,
    /* .all_to_all_v */ cn_all_to_all_v,
    /* .barrier */ cn_barrier,
};

/* The communicator with its rank table for ranks [first_rank, first_rank + n_local) of a world,
 * after checking the devices; the NCCL communicators and buffers come later. NULL with a reason
 * on failure. */
static struct comm_nccl *cn_new(const char *who, int world, int first_rank, int n_local,
                                const int *devices, char *err, size_t errlen)
{
    int count = 0;
    if (CUDA_CHECK(cudaGetDeviceCount(&count), err, errlen) < 0) {
        (void)cudaGetLastError();
        return NULL;
    }
    for (int i = 0; i < n_local; i++) {
        if (devices[i] < 0 || devices[i] >= count) {
            ms_errf(err, errlen, "%s: rank %d on device %d of %d", who, first_rank + i, devices[i],
                    count);
            return NULL;
        }
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i]) {
                ms_errf(err, errlen, "%s: ranks %d and %d share device %d", who, first_rank + j,
                        first_rank + i, devices[i]);
                return NULL;
            }
    }
    struct comm_nccl *cn = (struct comm_nccl *)calloc(1, sizeof *cn);
    if (!cn) goto oom;
    cn->base.ops = &nccl_ops;
    cn->base.n_rank = world;
    cn->base.self = -1; /* the engine drives NCCL ranks as threads (comm.h) */
    cn->first_rank = first_rank;
    cn->n_local = n_local;
    cn->base.bytes_sent =
        (unsigned long long *)calloc((size_t)world * world, sizeof(unsigned long long));
    cn->ranks = (struct cn_rank *)calloc((size_t)n_local, sizeof *cn->ranks);
    if (!cn->base.bytes_sent || !cn->ranks) goto oom;
    for (int i = 0; i < n_local; i++)
        cn->ranks[i].device = devices[i];
    return cn;
oom:
    ms_errf(err, errlen, "out of memory for the NCCL communicator");
    cn_destroy(cn ? &cn->base : NULL);
    return NULL;
}

/* Stream and count buffers of every local rank, sized for the whole world. */
static int cn_init_buffers(struct comm_nccl *cn, char *err, size_t errlen)
{
    size_t n = (size_t)cn->base.n_rank;
    for (int i = 0; i < cn->n_local; i++) {
        struct cn_rank *r = &cn->ranks[i];
        if (CUDA_CHECK(cudaSetDevice(r->device), err, errlen) < 0 ||
            CUDA_CHECK(cudaStreamCreateWithFlags(&r->own, cudaStreamNonBlocking), err, errlen) <
                0 ||
            CUDA_CHECK(cudaMalloc(&r->d_send_counts, sizeof(int) * n), err, errlen) < 0 ||
            CUDA_CHECK(cudaMalloc(&r->d_all_counts, sizeof(int) * n * n), err, errlen) < 0 ||
            CUDA_CHECK(cudaMalloc(&r->d_token, sizeof(int)), err, errlen) < 0 ||
            CUDA_CHECK(cudaMemset(r->d_token, 0, sizeof(int)), err, errlen) < 0 ||
            CUDA_CHECK(cudaMallocHost(&r->h_counts, sizeof(int) * (n + n * n)), err, errlen) < 0)
            return -1;
        r->stream = r->own;
    }
    return 0;
}

extern "C" struct comm *comm_nccl_create(int n_rank, const int *devices, char *err, size_t errlen)
{
    if (n_rank < 1 || !devices) {
        ms_errf(err, errlen, "comm_nccl_create: bad rank count %d", n_rank);
        return NULL;
    }
    struct comm_nccl *cn = cn_new("comm_nccl_create", n_rank, 0, n_rank, devices, err, errlen);
    if (!cn) return NULL;
    ncclComm_t *comms = (ncclComm_t *)calloc((size_t)n_rank, sizeof *comms);
    if (!comms) {
        ms_errf(err, errlen, "out of memory for the NCCL communicator");
        goto fail;
    }
    if (NCCL_CHECK(ncclCommInitAll(comms, n_rank, devices), err, errlen) < 0) goto fail;
    for (int i = 0; i < n_rank; i++)
        cn->ranks[i].nccl = comms[i];
    if (cn_init_buffers(cn, err, errlen) < 0) goto fail;
    free(comms);
    return &cn->base;
fail:
    free(comms);
    cn_destroy(&cn->base);
    return NULL;
}

/* What rank 0 hands out: the unique id, then world and n_procs as big-endian uint32 so that a
 * process started with another shape refuses it. */
#define CN_BOOT_LEN (NCCL_UNIQUE_ID_BYTES + 8)

struct cn_shape {
    int world, n_procs;
};

static void cn_put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (24 - 8 * i));
}

static uint32_t cn_get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* bootstrap_fetch_checked's check: the world rank 0 runs must be the one this process joins. */
static int cn_check_shape(const void *blob, size_t len, void *ctx, char *err, size_t errlen)
{
    const unsigned char *b = (const unsigned char *)blob;
    const struct cn_shape *want = (const struct cn_shape *)ctx;
    uint32_t world = cn_get_u32(b + NCCL_UNIQUE_ID_BYTES);
    uint32_t n_procs = cn_get_u32(b + NCCL_UNIQUE_ID_BYTES + 4);
    (void)len;
    if (world != (uint32_t)want->world || n_procs != (uint32_t)want->n_procs)
        return ms_errf(err, errlen,
                       "comm_nccl_create_world: rank 0 runs a world of %u ranks in %u processes, "
                       "this process was started for %d ranks in %d",
                       world, n_procs, want->world, want->n_procs);
    return 0;
}

/* Every local rank's NCCL communicator, created in one group as NCCL requires when one thread
 * drives several ranks. On failure none is left. */
static int cn_init_ranks(struct comm_nccl *cn, const ncclUniqueId *id, char *err, size_t errlen)
{
    int rc = NCCL_CHECK(ncclGroupStart(), err, errlen);
    if (rc < 0) return -1;
    for (int i = 0; i < cn->n_local && rc == 0; i++) {
        struct cn_rank *r = &cn->ranks[i];
        rc = CUDA_CHECK(cudaSetDevice(r->device), err, errlen);
        if (rc == 0)
            rc = NCCL_CHECK(ncclCommInitRank(&r->nccl, cn->base.n_rank, *id, cn->first_rank + i),
                            err, errlen);
    }
    /* The group must be closed even after a failed call; the first reason is the one kept. */
    char end_err[CN_ERR_LEN];
    if (NCCL_CHECK(ncclGroupEnd(), rc < 0 ? end_err : err, rc < 0 ? sizeof end_err : errlen) < 0)
        rc = -1;
    if (rc < 0)
        for (int i = 0; i < cn->n_local; i++)
            if (cn->ranks[i].nccl) {
                /* Abort, not destroy: a communicator whose start failed cannot finish one. */
                (void)ncclCommAbort(cn->ranks[i].nccl);
                cn->ranks[i].nccl = NULL;
            }
    return rc;
}

extern "C" struct comm *comm_nccl_create_world(int world, int n_procs, int first_rank, int n_local,
                                               const int *devices, const char *host, int port,
                                               int timeout_ms, char *err, size_t errlen)
{
    const char *who = "comm_nccl_create_world";
    if (world < 1 || n_local < 1 || first_rank < 0 || first_rank > world - n_local || !devices) {
        ms_errf(err, errlen, "%s: ranks %d..%d do not fit in a world of %d", who, first_rank,
                first_rank + n_local - 1, world);
        return NULL;
    }
    if (n_procs < 1) {
        ms_errf(err, errlen, "%s: bad process count %d", who, n_procs);
        return NULL;
    }
    if (n_procs == 1 && n_local != world) {
        ms_errf(err, errlen, "%s: a single process must drive all %d ranks, this one drives %d",
                who, world, n_local);
        return NULL;
    }
    /* Every other process holds at least one rank. */
    if (n_procs > 1 && n_procs - 1 > world - n_local) {
        ms_errf(err, errlen,
                "%s: %d other processes cannot each hold one of the %d ranks this "
                "one leaves",
                who, n_procs - 1, world - n_local);
        return NULL;
    }
    if (n_procs == 1) return comm_nccl_create(world, devices, err, errlen);

    /* Devices are checked before the rendezvous so that a bad one fails before others wait. */
    struct comm_nccl *cn = cn_new(who, world, first_rank, n_local, devices, err, errlen);
    if (!cn) return NULL;
    ncclUniqueId id;
    unsigned char blob[CN_BOOT_LEN];
    if (first_rank == 0) {
        if (NCCL_CHECK(ncclGetUniqueId(&id), err, errlen) < 0) goto fail;
        memcpy(blob, &id, NCCL_UNIQUE_ID_BYTES);
        cn_put_u32(blob + NCCL_UNIQUE_ID_BYTES, (uint32_t)world);
        cn_put_u32(blob + NCCL_UNIQUE_ID_BYTES + 4, (uint32_t)n_procs);
        if (bootstrap_serve(host, port, n_procs - 1, blob, sizeof blob, timeout_ms, err, errlen) <
            0)
            goto fail;
    } else {
        struct cn_shape want = {world, n_procs};
        if (bootstrap_fetch_checked(host, port, blob, sizeof blob, timeout_ms, cn_check_shape,
                                    &want, err, errlen) < 0)
            goto fail;
        memcpy(&id, blob, NCCL_UNIQUE_ID_BYTES);
    }
    if (cn_init_ranks(cn, &id, err, errlen) < 0 || cn_init_buffers(cn, err, errlen) < 0) goto fail;
    return &cn->base;
fail:
    cn_destroy(&cn->base);
    return NULL;
}

static int cn_no_rank(struct comm *c, int rank, char *err, size_t errlen)
{
    struct comm_nccl *cn = (struct comm_nccl *)c;
    return ms_errf(err, errlen, "no rank %d in this process (it drives ranks %d..%d of %d)", rank,
                   cn->first_rank, cn->first_rank + cn->n_local - 1, c->n_rank);
}

extern "C" int comm_nccl_set_stream(struct comm *c, int rank, void *stream, char *err,
                                    size_t errlen)
{
    if (!c || c->ops != &nccl_ops) return ms_errf(err, errlen, "not an NCCL communicator");
    struct cn_rank *r = cn_local(c, rank);
    if (!r) return cn_no_rank(c, rank, err, errlen);
    r->stream = stream ? (cudaStream_t)stream : r->own;
    return 0;
}

extern "C" int comm_nccl_set_timeout(struct comm *c, int timeout_ms, char *err, size_t errlen)
{
    if (!c || c->ops != &nccl_ops) return ms_errf(err, errlen, "not an NCCL communicator");
    ((struct comm_nccl *)c)->timeout_s = timeout_ms > 0 ? timeout_ms / 1000.0 : 0;
    return 0;
}

extern "C" int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen)
{
    if (!c || c->ops != &nccl_ops) return ms_errf(err, errlen, "not an NCCL communicator");
    struct cn_rank *r = cn_local(c, rank);
    if (!r) return cn_no_rank(c, rank, err, errlen);
    if (!r->failed) return 0;
    return ms_errf(err, errlen, "%s", r->first);
}

#else /* !MOESERVE_HAVE_NCCL */

extern "C" struct comm *comm_nccl_create_world(int world, int n_procs, int first_rank, int n_local,
                                               const int *devices, const char *host, int port,
                                               int timeout_ms, char *err, size_t errlen)
{
    (void)world;
    (void)n_procs;
    (void)first_rank;
    (void)n_local;
    (void)devices;
    (void)host;
    (void)port;
    (void)timeout_ms;
    ms_errf(err, errlen, "moeserve was built without NCCL");
    return NULL;
}

extern "C" struct comm *comm_nccl_create(int n_rank, const int *devices, char *err, size_t errlen)
{
    (void)n_rank;
    (void)devices;
    ms_errf(err, errlen, "moeserve was built without NCCL");
    return NULL;
}

extern "C" int comm_nccl_set_stream(struct comm *c, int rank, void *stream, char *err,
                                    size_t errlen)
{
    (void)c;
    (void)rank;
    (void)stream;
    return ms_errf(err, errlen, "moeserve was built without NCCL");
}

extern "C" int comm_nccl_set_timeout(struct comm *c, int timeout_ms, char *err, size_t errlen)
{
    (void)c;
    (void)timeout_ms;
    return ms_errf(err, errlen, "moeserve was built without NCCL");
}

extern "C" int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen)
{
    (void)c;
    (void)rank;
    return ms_errf(err, errlen, "moeserve was built without NCCL");
}

#endif
