/* NCCL implementation of engine/comm.h (see comm_nccl.h): per-rank NCCL communicator, stream,
 * and count buffers (device and pinned host) allocated once at creation, so an exchange only
 * enqueues an all-gather of counts and one send/recv group. Guarded by MOESERVE_HAVE_NCCL;
 * without it the constructor reports that NCCL is missing. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    struct comm base;
    struct cn_rank *ranks; /* (n_rank) */
};

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

static void cn_destroy(struct comm *c)
{
    struct comm_nccl *cn = (struct comm_nccl *)c;
    if (!cn) return;
    if (cn->ranks) {
        for (int i = 0; i < c->n_rank; i++) {
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
    struct comm_nccl *cn = (struct comm_nccl *)c;
    int n = c->n_rank;
    if (rank < 0 || rank >= n) return -1;
    struct cn_rank *r = &cn->ranks[rank];
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
    if (CN_CUDA(r, cudaStreamSynchronize(r->stream)) < 0) return -1;
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
    if (CN_CUDA(r, cudaStreamSynchronize(r->stream)) < 0) return -1;

    for (int p = 0; p < n; p++)
        if (p != rank) c->bytes_sent[(size_t)rank * n + p] += (size_t)send_counts[p] * row_bytes;
    return 0;
}

static void cn_barrier(struct comm *c, int rank)
{
    struct comm_nccl *cn = (struct comm_nccl *)c;
    if (rank < 0 || rank >= c->n_rank || c->n_rank == 1) return;
    struct cn_rank *r = &cn->ranks[rank];
    if (CN_CUDA(r, cudaSetDevice(r->device)) < 0) return;
    if (CN_NCCL(r, ncclAllReduce(r->d_token, r->d_token, 1, ncclInt32, ncclSum, r->nccl,
                                 r->stream)) < 0)
        return;
    CN_CUDA(r, cudaStreamSynchronize(r->stream));
}

static const struct comm_ops nccl_ops = {
    /* .name */ "nccl",
    /* .destroy */ cn_destroy,
    /* .all_to_all_v */ cn_all_to_all_v,
    /* .barrier */ cn_barrier,
};

extern "C" struct comm *comm_nccl_create(int n_rank, const int *devices, char *err, size_t errlen)
{
    struct comm_nccl *cn = NULL;
    ncclComm_t *comms = NULL;
    int count = 0;
    if (n_rank < 1 || !devices) {
        ms_errf(err, errlen, "comm_nccl_create: bad rank count %d", n_rank);
        return NULL;
    }
    if (CUDA_CHECK(cudaGetDeviceCount(&count), err, errlen) < 0) {
        (void)cudaGetLastError();
        return NULL;
    }
    for (int i = 0; i < n_rank; i++) {
        if (devices[i] < 0 || devices[i] >= count) {
            ms_errf(err, errlen, "comm_nccl_create: rank %d on device %d of %d", i, devices[i],
                    count);
            return NULL;
        }
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i]) {
                ms_errf(err, errlen, "comm_nccl_create: ranks %d and %d share device %d", j, i,
                        devices[i]);
                return NULL;
            }
    }
    cn = (struct comm_nccl *)calloc(1, sizeof *cn);
    comms = (ncclComm_t *)calloc((size_t)n_rank, sizeof *comms);
    if (!cn || !comms) goto oom;
    cn->base.ops = &nccl_ops;
    cn->base.n_rank = n_rank;
    cn->base.bytes_sent =
        (unsigned long long *)calloc((size_t)n_rank * n_rank, sizeof(unsigned long long));
    cn->ranks = (struct cn_rank *)calloc((size_t)n_rank, sizeof *cn->ranks);
    if (!cn->base.bytes_sent || !cn->ranks) goto oom;
    for (int i = 0; i < n_rank; i++)
        cn->ranks[i].device = devices[i];

    if (NCCL_CHECK(ncclCommInitAll(comms, n_rank, devices), err, errlen) < 0) goto fail;
    for (int i = 0; i < n_rank; i++)
        cn->ranks[i].nccl = comms[i];
    for (int i = 0; i < n_rank; i++) {
        struct cn_rank *r = &cn->ranks[i];
        size_t n = (size_t)n_rank;
        if (CUDA_CHECK(cudaSetDevice(r->device), err, errlen) < 0 ||
            CUDA_CHECK(cudaStreamCreateWithFlags(&r->own, cudaStreamNonBlocking), err, errlen) <
                0 ||
            CUDA_CHECK(cudaMalloc(&r->d_send_counts, sizeof(int) * n), err, errlen) < 0 ||
            CUDA_CHECK(cudaMalloc(&r->d_all_counts, sizeof(int) * n * n), err, errlen) < 0 ||
            CUDA_CHECK(cudaMalloc(&r->d_token, sizeof(int)), err, errlen) < 0 ||
            CUDA_CHECK(cudaMemset(r->d_token, 0, sizeof(int)), err, errlen) < 0 ||
            CUDA_CHECK(cudaMallocHost(&r->h_counts, sizeof(int) * (n + n * n)), err, errlen) < 0)
            goto fail;
        r->stream = r->own;
    }
    free(comms);
    return &cn->base;
oom:
    ms_errf(err, errlen, "out of memory for the NCCL communicator");
fail:
    free(comms);
    cn_destroy(cn ? &cn->base : NULL);
    return NULL;
}

extern "C" int comm_nccl_set_stream(struct comm *c, int rank, void *stream, char *err,
                                    size_t errlen)
{
    if (!c || c->ops != &nccl_ops) return ms_errf(err, errlen, "not an NCCL communicator");
    if (rank < 0 || rank >= c->n_rank) return ms_errf(err, errlen, "no rank %d", rank);
    struct cn_rank *r = &((struct comm_nccl *)c)->ranks[rank];
    r->stream = stream ? (cudaStream_t)stream : r->own;
    return 0;
}

extern "C" int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen)
{
    if (!c || c->ops != &nccl_ops) return ms_errf(err, errlen, "not an NCCL communicator");
    if (rank < 0 || rank >= c->n_rank) return ms_errf(err, errlen, "no rank %d", rank);
    struct cn_rank *r = &((struct comm_nccl *)c)->ranks[rank];
    if (!r->failed) return 0;
    return ms_errf(err, errlen, "%s", r->first);
}

#else /* !MOESERVE_HAVE_NCCL */

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

extern "C" int comm_nccl_error(struct comm *c, int rank, char *err, size_t errlen)
{
    (void)c;
    (void)rank;
    return ms_errf(err, errlen, "moeserve was built without NCCL");
}

#endif
