/* CUDA backend instance: device, stream, cuBLAS handle and a sticky error, plus the op table
 * of kernels/backend.h. Memory ops and GEMMs are here (cuBLAS, plain f32); every other op
 * forwards to a launcher of cuda_kernels.h. Each op makes the instance's device current,
 * checks every CUDA/cuBLAS call, and keeps the first failure's reason for backend_cuda_error,
 * since the op table's functions return nothing. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "common.h"
#include "cuda_check.h"
#include "cuda_kernels.h"

#define CB_ERR_LEN 512

struct cuda_backend {
    struct backend base;
    int device;
    cudaStream_t stream; /* every op of this instance runs on it, in call order */
    cublasHandle_t blas; /* bound to `stream` */
    int failed;          /* set at the first failure; `first` then holds its reason */
    char first[CB_ERR_LEN];
    char last[CB_ERR_LEN]; /* the latest failure, scratch for the check macros */
};


/* Keeps the first failure: rc < 0 means `last` holds a fresh reason. */
static int cb_note(struct cuda_backend *b, int rc)
{
    if (rc < 0 && !b->failed) {
        b->failed = 1;
        memcpy(b->first, b->last, sizeof b->first);
    }
    return rc;
}

#define CB_CUDA(b, call) cb_note((b), CUDA_CHECK(call, (b)->last, sizeof(b)->last))
#define CB_BLAS(b, call) cb_note((b), CUBLAS_CHECK(call, (b)->last, sizeof(b)->last))
/* For launchers of cuda_kernels.h, which take (..., err, errlen) last. */
#define CB_ERR(b) (b)->last, sizeof(b)->last

static inline struct cuda_backend *cb_of(struct backend *be)
{
    return (struct cuda_backend *)be;
}

/* Makes the instance's device current; -1 (recorded) on failure. */
static int cb_enter(struct cuda_backend *b)
{
    return CB_CUDA(b, cudaSetDevice(b->device));
}

static void cb_destroy(struct backend *be)
{
    struct cuda_backend *b = cb_of(be);
    if (!b) return;
    cudaSetDevice(b->device);
    if (b->blas) cublasDestroy(b->blas);
    if (b->stream) cudaStreamDestroy(b->stream);
    free(b);
}

static void *cb_alloc(struct backend *be, size_t bytes)
{
    struct cuda_backend *b = cb_of(be);
    void *p = NULL;
    if (cb_enter(b) < 0) return NULL;
    if (CB_CUDA(b, cudaMalloc(&p, bytes ? bytes : 256)) < 0) return NULL;
    return p;
}

static void cb_free(struct backend *be, void *p)
{
    struct cuda_backend *b = cb_of(be);
    if (!p || cb_enter(b) < 0) return;
    CB_CUDA(b, cudaFree(p));
}

/* Both directions wait for the copy: the host buffer may be reused (upload) or read
 * (download) on return, whatever kind of host memory it is. */
static void cb_upload(struct backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_backend *b = cb_of(be);
    if (!bytes || cb_enter(b) < 0) return;
    if (CB_CUDA(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, b->stream)) < 0) return;
    CB_CUDA(b, cudaStreamSynchronize(b->stream));
}

static void cb_download(struct backend *be, void *dst, const void *src, size_t bytes)
{
    struct cuda_backend *b = cb_of(be);
    if (!bytes || cb_enter(b) < 0) return;
    if (CB_CUDA(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, b->stream)) < 0) return;
    CB_CUDA(b, cudaStreamSynchronize(b->stream));
}

static void cb_synchronize(struct backend *be)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    CB_CUDA(b, cudaStreamSynchronize(b->stream));
}

/* y (n, m) = x (n, k) . w (m, k)^T [+ bias (m)]. cuBLAS is column-major: the row-major y is the
 * column-major y^T (m, n) = w . x^T, i.e. op(A) = A^T for the column-major view (k, m) of w
 * and op(B) = B for the view (k, n) of x. */
static void cb_matmul(struct backend *be, float *y, const float *x, const float *w,
                      const float *bias, int n, int k, int m)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || m <= 0 || cb_enter(b) < 0) return;
    if (k <= 0) {
        /* An empty sum: cuBLAS rejects lda = 0, the CPU reference yields zeros. */
        if (CB_CUDA(b, cudaMemsetAsync(y, 0, sizeof(float) * (size_t)n * m, b->stream)) < 0) return;
    } else {
        const float one = 1.0f, zero = 0.0f;
        if (CB_BLAS(b, cublasSgemm(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w, k, x, k,
                                   &zero, y, m)) < 0)
            return;
    }
    if (bias) cb_note(b, cuk_add_bias(b->stream, y, bias, n, m, CB_ERR(b)));
}

static void cb_rmsnorm(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                       float eps)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_rmsnorm(b->stream, y, x, w, n, d, eps, CB_ERR(b)));
}

static void cb_rope(struct backend *be, float *x, const int32_t *pos, int n, int n_head,
                    int head_dim, const float *cos_sin)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_rope(b->stream, x, pos, n, n_head, head_dim, cos_sin, CB_ERR(b)));
}

static void cb_add(struct backend *be, float *y, const float *x, int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_add(b->stream, y, x, (size_t)n * d, CB_ERR(b)));
}

static void cb_clamp(struct backend *be, float *x, int n, int d, float c)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_clamp(b->stream, x, (size_t)n * d, c, CB_ERR(b)));
}

static void cb_swiglu(struct backend *be, float *out, const float *gate, const float *up, int n,
                      int d_ff)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d_ff <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_swiglu(b->stream, out, gate, up, (size_t)n * d_ff, CB_ERR(b)));
}

static void cb_embed(struct backend *be, float *out, const float *embed, const int32_t *ids, int n,
                     int d)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_gather_rows(b->stream, out, embed, ids, n, d, CB_ERR(b)));
}

static void cb_gather_rows(struct backend *be, float *dst, const float *src, const int32_t *idx,
                           int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_gather_rows(b->stream, dst, src, idx, n, d, CB_ERR(b)));
}

static void cb_scatter_rows(struct backend *be, float *dst, const float *src, const int32_t *idx,
                            int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_scatter_rows(b->stream, dst, src, idx, n, d, CB_ERR(b)));
}

static void cb_moe_combine(struct backend *be, float *out, const float *rows, const int32_t *idx,
                           const float *w, int n, int k, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_moe_combine(b->stream, out, rows, idx, w, n, k, d, CB_ERR(b)));
}

static void cb_add_scaled_rows(struct backend *be, float *y, const float *x, const float *s, int n,
                               int d, int sigmoid)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_add_scaled_rows(b->stream, y, x, s, n, d, sigmoid, CB_ERR(b)));
}

static void cb_attention(struct backend *be, float *out, const float *q, const float *k_cache,
                         const float *v_cache, const int32_t *block_table, int block_size, int pos0,
                         int n, int n_head, int n_kv_head, int head_dim, int window, float scale,
                         float *scratch)
{
    struct cuda_backend *b = cb_of(be);
    (void)scratch; /* scores live in each block's shared memory */
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_attention(b->stream, out, q, k_cache, v_cache, block_table, block_size, pos0, n,
                             n_head, n_kv_head, head_dim, window, scale, CB_ERR(b)));
}

static void cb_kv_write(struct backend *be, float *k_cache, float *v_cache, const float *k,
                        const float *v, const int32_t *block_table, int block_size, int pos0, int n,
                        int row)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    if (n > 0 && block_size <= 0) {
        ms_errf(b->last, sizeof b->last, "kv_write: block_size %d", block_size);
        cb_note(b, -1);
        return;
    }
    cb_note(b, cuk_kv_write(b->stream, k_cache, v_cache, k, v, block_table, block_size, pos0, n,
                            row, CB_ERR(b)));
}

/* Positional (C++17 has no designated initializers): this catches a field added to the table. */
static_assert(sizeof(struct backend_ops) == 20 * sizeof(void *),
              "struct backend_ops changed: update cuda_ops to match kernels/backend.h");

static const struct backend_ops cuda_ops = {
    /* .name */ "cuda",
    /* .destroy */ cb_destroy,
    /* .alloc */ cb_alloc,
    /* .free */ cb_free,
    /* .upload */ cb_upload,
    /* .download */ cb_download,
    /* .synchronize */ cb_synchronize,
    /* .matmul */ cb_matmul,
    /* .rmsnorm */ cb_rmsnorm,
    /* .rope */ cb_rope,
    /* .add */ cb_add,
    /* .clamp */ cb_clamp,
    /* .swiglu */ cb_swiglu,
    /* .embed */ cb_embed,
    /* .gather_rows */ cb_gather_rows,
    /* .scatter_rows */ cb_scatter_rows,
    /* .moe_combine */ cb_moe_combine,
    /* .add_scaled_rows */ cb_add_scaled_rows,
    /* .attention */ cb_attention,
    /* .kv_write */ cb_kv_write,
};

extern "C" int backend_cuda_device_count(void)
{
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) {
        (void)cudaGetLastError(); /* clear it so later launch checks do not report it */
        return 0;
    }
    return count > 0 ? count : 0;
}

extern "C" struct backend *backend_cuda_create(int device, char *err, size_t errlen)
{
    struct cuda_backend *b = NULL;
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count <= 0) {
        (void)cudaGetLastError();
        ms_errf(err, errlen, "no CUDA device: %s",
                cudaGetErrorString(rc != cudaSuccess ? rc : cudaErrorNoDevice));
        return NULL;
    }
    if (device < 0 || device >= count) {
        ms_errf(err, errlen, "CUDA device %d does not exist (%d device%s)", device, count,
                count == 1 ? "" : "s");
        return NULL;
    }
    b = (struct cuda_backend *)calloc(1, sizeof *b);
    if (!b) {
        ms_errf(err, errlen, "out of memory for the CUDA backend");
        return NULL;
    }
    b->base.ops = &cuda_ops;
    b->device = device;
    if (CUDA_CHECK(cudaSetDevice(device), err, errlen) < 0) goto fail;
    if (CUDA_CHECK(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking), err, errlen) < 0)
        goto fail;
    if (CUBLAS_CHECK(cublasCreate(&b->blas), err, errlen) < 0) goto fail;
    if (CUBLAS_CHECK(cublasSetStream(b->blas, b->stream), err, errlen) < 0) goto fail;
    /* Plain f32 GEMMs (no TF32), so results match the CPU reference to f32 rounding. */
    if (CUBLAS_CHECK(cublasSetMathMode(b->blas, CUBLAS_DEFAULT_MATH), err, errlen) < 0) goto fail;
    return &b->base;
fail:
    cb_destroy(&b->base);
    return NULL;
}

extern "C" int backend_cuda_error(struct backend *be, char *err, size_t errlen)
{
    if (!be || be->ops != &cuda_ops) return ms_errf(err, errlen, "not a CUDA backend");
    struct cuda_backend *b = cb_of(be);
    if (!b->failed) return 0;
    return ms_errf(err, errlen, "%s", b->first);
}

extern "C" void backend_cuda_clear_error(struct backend *be)
{
    if (!be || be->ops != &cuda_ops) return;
    struct cuda_backend *b = cb_of(be);
    b->failed = 0;
    b->first[0] = '\0';
}

extern "C" void *backend_cuda_stream(struct backend *be)
{
    if (!be || be->ops != &cuda_ops) return NULL;
    return (void *)cb_of(be)->stream;
}

extern "C" int backend_cuda_device(struct backend *be)
{
    if (!be || be->ops != &cuda_ops) return -1;
    return cb_of(be)->device;
}
