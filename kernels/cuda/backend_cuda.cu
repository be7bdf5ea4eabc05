/* CUDA backend instance: device, stream, cuBLAS handle and a sticky error, plus the op table
 * of kernels/backend.h. Memory ops and GEMMs are here: weights are bf16 on the device, GEMM
 * inputs are converted to bf16 in a workspace and multiplied by cuBLAS with f32 accumulation
 * and f32 output; the experts of an MoE layer go through one grouped GEMM for gate+up and one
 * for down (cublasGemmGroupedBatchedEx, mixed widths allowed; bf16 in and out, the grouped
 * API's one bf16 combination), or one GEMM per expert where the grouped call is unsupported
 * or MOESERVE_CUDA_GROUPED=0. Every other op forwards to a launcher of
 * cuda_kernels.h. Each op makes the instance's device current,
 * checks every CUDA/cuBLAS call, and keeps the first failure's reason for backend_cuda_error,
 * since the op table's functions return nothing. */
#include <cuda_bf16.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "common.h"
#include "cuda_check.h"
#include "cuda_kernels.h"
#include "route_impl.h"

/* Experts one moe_experts call may name (the routers' own limit). */
#define MOE_MAX_GROUP_EXPERTS ROUTE_MAX_EXPERTS

#define CB_ERR_LEN 512

struct cuda_backend {
    struct backend base;
    int device;
    cudaStream_t stream; /* every op of this instance runs on it, in call order */
    cublasHandle_t blas; /* bound to `stream` */
    /* reserve(): bf16 copies of GEMM inputs, and the grouped GEMM's arguments */
    __nv_bfloat16 *ws;
    size_t ws_elems;
    int max_groups;      /* 2 * max_experts: gate and up of every expert in one call */
    void **d_ptrs;       /* (9 * max_experts) device: A, B, C pointer arrays of both calls */
    void **h_ptrs;       /* pinned staging of d_ptrs */
    cudaEvent_t ptrs_done; /* the last copy out of h_ptrs has finished */
    cublasOperation_t *g_ta, *g_tb;
    int *g_m, *g_n, *g_k, *g_lda, *g_ldb, *g_ldc, *g_size;
    float *g_alpha, *g_beta;
    int grouped;         /* 1: try cublasGemmGroupedBatchedEx; 0: a GEMM per expert */
    uint16_t *stage;     /* pinned bf16 staging for weight_upload, made at the first upload */
    int32_t *d_seq;      /* reserve(): gdn's sequence table (4 * seq_cap) in device memory */
    int32_t *h_seq;      /* its pinned staging */
    int seq_cap;
    cudaEvent_t seq_done;/* the last copy out of h_seq has finished */
    float *dsa_scores;   /* reserve() with dsa_dim: (dsa_rows, dsa_ctx) indexer scores */
    int dsa_rows, dsa_ctx;

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

static void cb_release_workspace(struct cuda_backend *b)
{
    if (b->ws) cudaFree(b->ws);
    if (b->d_ptrs) cudaFree(b->d_ptrs);
    if (b->h_ptrs) cudaFreeHost(b->h_ptrs);
    if (b->ptrs_done) cudaEventDestroy(b->ptrs_done);
    if (b->d_seq) cudaFree(b->d_seq);
    if (b->h_seq) cudaFreeHost(b->h_seq);
    if (b->seq_done) cudaEventDestroy(b->seq_done);
    b->d_seq = b->h_seq = NULL;
    b->seq_done = NULL;
    b->seq_cap = 0;
    if (b->dsa_scores) cudaFree(b->dsa_scores);
    b->dsa_scores = NULL;
    b->dsa_rows = b->dsa_ctx = 0;
    free(b->g_ta);
    free(b->g_tb);
    free(b->g_m);
    free(b->g_alpha);
    b->ws = NULL;
    b->d_ptrs = NULL;
    b->h_ptrs = NULL;
    b->ptrs_done = NULL;
    b->g_ta = b->g_tb = NULL;
    b->g_m = NULL;
    b->g_alpha = NULL;
    b->ws_elems = 0;
    b->max_groups = 0;
}

static void cb_destroy(struct backend *be)
{
    struct cuda_backend *b = cb_of(be);
    if (!b) return;
    cudaSetDevice(b->device);
    if (b->stream) cudaStreamSynchronize(b->stream);
    cb_release_workspace(b);
    if (b->stage) cudaFreeHost(b->stage);
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

/* Tokens whose indexer scores one dsa_select launch holds (scratch: this many rows of max_ctx
 * floats; 64 rows of a 128k context are 32 MiB). */
#define CB_DSA_ROWS 64

static int cb_reserve(struct backend *be, const struct be_reserve *r)
{
    struct cuda_backend *b = cb_of(be);
    size_t max_elems = r->max_elems;
    int max_experts = r->max_experts;
    if (cb_enter(b) < 0) return -1;
    if (b->stream && CB_CUDA(b, cudaStreamSynchronize(b->stream)) < 0) return -1;
    cb_release_workspace(b);
    int G = 2 * (max_experts > 0 ? max_experts : 1);
    size_t elems = max_elems ? max_elems : 1;
    if (CB_CUDA(b, cudaMalloc((void **)&b->ws, elems * sizeof(__nv_bfloat16))) < 0 ||
        CB_CUDA(b, cudaMalloc((void **)&b->d_ptrs, sizeof(void *) * 9 * (size_t)G / 2)) < 0 ||
        CB_CUDA(b, cudaMallocHost((void **)&b->h_ptrs, sizeof(void *) * 9 * (size_t)G / 2)) < 0 ||
        CB_CUDA(b, cudaEventCreateWithFlags(&b->ptrs_done, cudaEventDisableTiming)) < 0)
        goto fail;
    /* a step's sequences: at most one per token */
    b->seq_cap = r->max_rows > 0 ? r->max_rows : 1;
    if (CB_CUDA(b, cudaMalloc((void **)&b->d_seq, sizeof(int32_t) * 4 * (size_t)b->seq_cap)) < 0 ||
        CB_CUDA(b, cudaMallocHost((void **)&b->h_seq, sizeof(int32_t) * 4 * (size_t)b->seq_cap)) <
            0 ||
        CB_CUDA(b, cudaEventCreateWithFlags(&b->seq_done, cudaEventDisableTiming)) < 0)
        goto fail;
    /* One block for the int arrays (7 of G), one for the scalars (2 of G). */
    b->g_ta = (cublasOperation_t *)calloc((size_t)G, sizeof *b->g_ta);
    b->g_tb = (cublasOperation_t *)calloc((size_t)G, sizeof *b->g_tb);
    b->g_m = (int *)calloc(7 * (size_t)G, sizeof(int));
    b->g_alpha = (float *)calloc(2 * (size_t)G, sizeof(float));
    if (!b->g_ta || !b->g_tb || !b->g_m || !b->g_alpha) {
        ms_errf(b->last, sizeof b->last, "reserve: out of host memory");
        cb_note(b, -1);
        goto fail;
    }
    b->g_n = b->g_m + G;
    b->g_k = b->g_n + G;
    b->g_lda = b->g_k + G;
    b->g_ldb = b->g_lda + G;
    b->g_ldc = b->g_ldb + G;
    b->g_size = b->g_ldc + G;
    b->g_beta = b->g_alpha + G;
    for (int i = 0; i < G; i++) {
        b->g_ta[i] = CUBLAS_OP_T;
        b->g_tb[i] = CUBLAS_OP_N;
        b->g_size[i] = 1;
        b->g_alpha[i] = 1.0f;
        b->g_beta[i] = 0.0f;
    }
    /* the indexer's scores: up to CB_DSA_ROWS tokens per launch, max_ctx positions each */
    if (r->dsa_dim > 0 && r->max_ctx > 0) {
        b->dsa_rows = b->seq_cap < CB_DSA_ROWS ? b->seq_cap : CB_DSA_ROWS;
        b->dsa_ctx = r->max_ctx;
        if (CB_CUDA(b, cudaMalloc((void **)&b->dsa_scores, sizeof(float) * (size_t)b->dsa_rows *
                                                               (size_t)b->dsa_ctx)) < 0)
            goto fail;
    }
    b->ws_elems = elems;
    b->max_groups = G;
    return 0;
fail:
    cb_release_workspace(b);
    return -1;
}

/* Weights: converted to bf16 on the host (round to nearest even, as the CPU's ms_f32_to_bf16)
 * in chunks through one pinned buffer kept for the backend's life, then copied; load time
 * only. The handle is a host struct wmat (type bf16) whose data is the device copy. Q8/Q4
 * matrices are refused (their kernels are CPU-only for now); MXFP4 ones are dequantized. */
enum { CB_STAGE = 1 << 22 };

static const struct wmat *cb_weight_upload(struct backend *be, const struct wmat *host)
{
    struct cuda_backend *b = cb_of(be);
    void *w = NULL;
    size_t n = (size_t)host->rows * (size_t)host->cols;
    if (cb_enter(b) < 0) return NULL;
    if (wtype_is_quant(host->type) && host->type != WTYPE_MXFP4) {
        ms_errf(b->last, sizeof b->last, "weight_upload: %s weights need the CPU backend",
                wtype_name(host->type));
        cb_note(b, -1);
        return NULL;
    }
    enum wsrc from = host->type == WTYPE_F32 ? WSRC_F32 : host->type == WTYPE_F16 ? WSRC_F16
                                                                                : WSRC_BF16;
    size_t esize = host->type == WTYPE_F32 ? 4 : 2;
    struct wmat *h = (struct wmat *)malloc(sizeof *h);
    if (!h) {
        ms_errf(b->last, sizeof b->last, "weight_upload: out of host memory");
        cb_note(b, -1);
        return NULL;
    }
    if ((!b->stage &&
         CB_CUDA(b, cudaMallocHost((void **)&b->stage, CB_STAGE * sizeof(uint16_t))) < 0) ||
        CB_CUDA(b, cudaMalloc(&w, (n ? n : 1) * sizeof(uint16_t))) < 0) {
        free(h);
        return NULL;
    }
    /* MXFP4 (gpt-oss experts): dequantized row by row to bf16, exactly (e2m1 times a power of
     * two fits bf16), through an f32 row kept at the end of the staging buffer. The GPU keeps
     * them in bf16 for now: an MXFP4 GEMM kernel is not written yet. */
    size_t rows_per = host->cols > 0 ? (size_t)CB_STAGE / ((size_t)host->cols * 3) : 0;
    if (host->type == WTYPE_MXFP4 && rows_per == 0) {
        ms_errf(b->last, sizeof b->last, "weight_upload: MXFP4 rows of %d too long", host->cols);
        cb_note(b, -1);
        cudaFree(w);
        free(h);
        return NULL;
    }
    size_t m;
    for (size_t i = 0; i < n; i += m) {
        m = n - i < (size_t)CB_STAGE ? n - i : (size_t)CB_STAGE;
        if (host->type == WTYPE_MXFP4) {
            /* whole rows a chunk: rows_per rows of bf16, one f32 row of scratch at the end */
            size_t r0 = i / (size_t)host->cols, nr = (n / (size_t)host->cols) - r0;
            nr = nr < rows_per ? nr : rows_per;
            m = nr * (size_t)host->cols;
            float *f = (float *)(b->stage + CB_STAGE - 2 * (size_t)host->cols);
            for (size_t r = 0; r < nr; r++) {
                wmat_row_f32(host, (int)(r0 + r), f);
                wmat_convert(WTYPE_BF16, b->stage + r * (size_t)host->cols, WSRC_F32, f, 1,
                             host->cols, 0, 1);
            }
        } else {
            wmat_convert(WTYPE_BF16, b->stage, from, (const unsigned char *)host->data + i * esize,
                         1, (int)m, 0, 1);
        }
        if (CB_CUDA(b, cudaMemcpyAsync((uint16_t *)w + i, b->stage, m * sizeof(uint16_t),
                                       cudaMemcpyHostToDevice, b->stream)) < 0 ||
            CB_CUDA(b, cudaStreamSynchronize(b->stream)) < 0) {
            cudaFree(w);
            free(h);
            return NULL;
        }
    }
    *h = *host;
    h->type = WTYPE_BF16;
    h->data = w;
    return h;
}

static void cb_weight_free(struct backend *be, const struct wmat *w)
{
    if (!w) return;
    cb_free(be, (void *)w->data);
    free((void *)w);
}

/* x (n, k) f32 -> the workspace in bf16; NULL (recorded) when it does not fit. */
static const __nv_bfloat16 *cb_to_ws(struct cuda_backend *b, const float *x, size_t total,
                                     const char *op)
{
    if (total > b->ws_elems) {
        ms_errf(b->last, sizeof b->last,
                "%s: input of %zu elements exceeds the reserved workspace of %zu", op, total,
                b->ws_elems);
        cb_note(b, -1);
        return NULL;
    }
    if (cb_note(b, cuk_to_bf16(b->stream, b->ws, x, total, CB_ERR(b))) < 0) return NULL;
    return b->ws;
}

/* One bf16 x bf16 -> f32 GEMM, row-major y (n, m) = x (n, k) . w (m, k)^T with leading
 * dimensions: cuBLAS is column-major, so this is y^T (m, n) = op_T(w) . x^T. */
static int cb_gemm_to(struct cuda_backend *b, void *y, cudaDataType_t ytype, int ldy,
                      const __nv_bfloat16 *x, int ldx, const void *w, int ldw, int n, int k,
                      int m)
{
    const float one = 1.0f, zero = 0.0f;
    return CB_BLAS(b, cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w,
                                   CUDA_R_16BF, ldw, x, CUDA_R_16BF, ldx, &zero, y, ytype, ldy,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static int cb_gemm(struct cuda_backend *b, float *y, int ldy, const __nv_bfloat16 *x, int ldx,
                   const void *w, int ldw, int n, int k, int m)
{
    return cb_gemm_to(b, y, CUDA_R_32F, ldy, x, ldx, w, ldw, n, k, m);
}

/* y (n, m) = x (n, k) . w (m, k)^T [+ bias (m)], w bf16. */
static void cb_matmul(struct backend *be, float *y, const float *x, const struct wmat *w,
                      const float *bias, int n, int k, int m)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || m <= 0 || cb_enter(b) < 0) return;
    if (k <= 0) {
        /* An empty sum: cuBLAS rejects lda = 0, the CPU reference yields zeros. */
        if (CB_CUDA(b, cudaMemsetAsync(y, 0, sizeof(float) * (size_t)n * m, b->stream)) < 0) return;
    } else {
        const __nv_bfloat16 *xb = cb_to_ws(b, x, (size_t)n * k, "matmul");
        if (!xb || cb_gemm(b, y, m, xb, k, w->data, k, n, k, m) < 0) return;
    }
    if (bias) cb_note(b, cuk_add_bias(b->stream, y, bias, n, m, CB_ERR(b)));
}

static void cb_matmul_multi(struct backend *be, int count, float *const *y, const float *x,
                            const struct wmat *const *w, const float *const *bias, int n, int k)
{
    for (int i = 0; i < count; i++) cb_matmul(be, y[i], x, w[i], bias ? bias[i] : NULL, n, k, w[i]->rows);
}

/* Groups [0, G) of b->g_* with pointers A, B, C (host arrays of G each), all bf16 with f32
 * accumulation (the one combination with bf16 inputs that the grouped API takes): one grouped
 * call, or a GEMM per group when that is off or unsupported. The pointer arrays are staged
 * through h_ptrs at `slot` (distinct per call of one moe_experts) and copied to the device. */
static int cb_gemm_groups(struct cuda_backend *b, int G, const void **A, const void **B,
                          void **C, size_t slot)
{
    if (!b->grouped) {
        for (int i = 0; i < G; i++)
            if (cb_gemm_to(b, C[i], CUDA_R_16BF, b->g_ldc[i], (const __nv_bfloat16 *)B[i],
                           b->g_ldb[i], A[i], b->g_lda[i], b->g_n[i], b->g_k[i], b->g_m[i]) < 0)
                return -1;
        return 0;
    }
    void **h = b->h_ptrs + slot, **d = b->d_ptrs + slot;
    memcpy(h, A, sizeof(void *) * (size_t)G);
    memcpy(h + G, B, sizeof(void *) * (size_t)G);
    memcpy(h + 2 * G, C, sizeof(void *) * (size_t)G);
    if (CB_CUDA(b, cudaMemcpyAsync(d, h, sizeof(void *) * 3 * (size_t)G, cudaMemcpyHostToDevice,
                                   b->stream)) < 0)
        return -1;
    cublasStatus_t rc = cublasGemmGroupedBatchedEx(
        b->blas, b->g_ta, b->g_tb, b->g_m, b->g_n, b->g_k, b->g_alpha, (const void *const *)d,
        CUDA_R_16BF, b->g_lda, (const void *const *)(d + G), CUDA_R_16BF, b->g_ldb, b->g_beta,
        d + 2 * G, CUDA_R_16BF, b->g_ldc, G, b->g_size, CUBLAS_COMPUTE_32F);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED) {
        fprintf(stderr, "moeserve: cublasGemmGroupedBatchedEx not supported here; using one GEMM "
                        "per expert\n");
        b->grouped = 0;
        return cb_gemm_groups(b, G, A, B, C, slot);
    }
    return CB_BLAS(b, rc);
}

/* Experts over rows sorted by expert, in bf16 with f32 accumulation: x -> bf16 (workspace);
 * gate and up of every expert in one grouped GEMM into bf16 (the f32 scratch `gate` and `up`
 * hold them); SwiGLU over the ragged (rows_j, d_ff_j) blocks laid end to end; down into bf16
 * (workspace again: x is consumed by then); widened into y. Experts without rows are left out:
 * a GEMM with n = 0 is not accepted everywhere. */
static void cb_moe_experts(struct backend *be, float *y, const float *x, int d, int n_experts,
                           const int *off, const struct be_expert *ex, float *gate, float *up)
{
    struct cuda_backend *b = cb_of(be);
    if (n_experts <= 0 || off[n_experts] <= off[0] || cb_enter(b) < 0) return;
    int na = n_experts;
    if (2 * na > b->max_groups || na > MOE_MAX_GROUP_EXPERTS) {
        ms_errf(b->last, sizeof b->last, "moe_experts: %d experts, reserved for %d", na,
                b->max_groups / 2);
        cb_note(b, -1);
        return;
    }
    /* Wait until the previous call's pointer arrays have left the pinned buffer. */
    if (CB_CUDA(b, cudaEventSynchronize(b->ptrs_done)) < 0) return;
    const float *x0 = x + (size_t)off[0] * d;
    size_t rows_all = (size_t)(off[na] - off[0]);
    const __nv_bfloat16 *xb = cb_to_ws(b, x0, rows_all * d, "moe_experts");
    if (!xb) return;
    __nv_bfloat16 *gb = (__nv_bfloat16 *)gate, *ub = (__nv_bfloat16 *)up, *yb = b->ws;

    const void *A[2 * MOE_MAX_GROUP_EXPERTS], *B[2 * MOE_MAX_GROUP_EXPERTS];
    void *C[2 * MOE_MAX_GROUP_EXPERTS];
    int G = 0;
    for (int j = 0; j < na; j++) G += off[j + 1] > off[j];
    size_t act = 0;
    for (int j = 0, g = 0; j < na; j++) {
        int rows = off[j + 1] - off[j], ff = ex[j].d_ff;
        if (rows <= 0) continue;
        for (int half = 0; half < 2; half++) {
            int i = g + half * G;
            b->g_m[i] = ff;
            b->g_n[i] = rows;
            b->g_k[i] = d;
            b->g_lda[i] = d;
            b->g_ldb[i] = d;
            b->g_ldc[i] = ff;
            A[i] = half ? ex[j].up->data : ex[j].gate->data;
            B[i] = xb + (size_t)(off[j] - off[0]) * d;
            C[i] = (half ? ub : gb) + act;
        }
        act += (size_t)rows * ff;
        g++;
    }
    if (cb_gemm_groups(b, 2 * G, A, B, C, 0) < 0) return;
    if (!ex[0].b_gate && !ex[0].b_up && ex[0].act == BE_ACT_SILU) {
        if (cb_note(b, cuk_swiglu_bf16(b->stream, gb, gb, ub, act, CB_ERR(b))) < 0) return;
    } else {
        /* biases or gpt-oss's activation: expert by expert (their biases differ) */
        size_t at = 0;
        for (int j = 0; j < na; j++) {
            int rows = off[j + 1] - off[j], ff = ex[j].d_ff;
            if (rows <= 0) continue;
            if (cb_note(b, cuk_expert_act_bf16(b->stream, gb + at, ub + at, rows, ff, ex[j].b_gate,
                                               ex[j].b_up, (int)ex[j].act,
                                               ex[j].alpha, ex[j].limit, CB_ERR(b))) < 0)
                return;
            at += (size_t)rows * ff;
        }
    }
    act = 0;
    for (int j = 0, g = 0; j < na; j++) {
        int rows = off[j + 1] - off[j], ff = ex[j].d_ff;
        if (rows <= 0) continue;
        b->g_m[g] = d;
        b->g_n[g] = rows;
        b->g_k[g] = ff;
        b->g_lda[g] = ff;
        b->g_ldb[g] = ff;
        b->g_ldc[g] = d;
        A[g] = ex[j].down->data;
        B[g] = gb + act;
        C[g] = yb + (size_t)(off[j] - off[0]) * d;
        act += (size_t)rows * ff;
        g++;
    }
    if (cb_gemm_groups(b, G, A, B, C, 6 * (size_t)G) < 0) return;
    if (cb_note(b, cuk_bf16_to_f32(b->stream, y + (size_t)off[0] * d, yb, rows_all * d,
                                   CB_ERR(b))) < 0)
        return;
    for (int j = 0; j < na; j++)
        if (ex[j].b_down && off[j + 1] > off[j] &&
            cb_note(b, cuk_add_bias(b->stream, y + (size_t)off[j] * d, ex[j].b_down,
                                    off[j + 1] - off[j], d, CB_ERR(b))) < 0)
            return;
    CB_CUDA(b, cudaEventRecord(b->ptrs_done, b->stream));
}

static void cb_route(struct backend *be, int32_t *idx, float *w, const float *logits,
                     const float *glog, const int32_t *tok_k, int n, const struct be_route *r)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_route(b->stream, idx, w, logits, glog, tok_k, n, r, CB_ERR(b)));
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

static void cb_embed(struct backend *be, float *out, const struct wmat *table, const int32_t *ids,
                     int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_embed_bf16(b->stream, out, table->data, ids, n, d, CB_ERR(b)));
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

static void cb_neuron_ffn(struct backend *be, float *y, const float *x, int n, int d,
                          const struct wmat *gate, const struct wmat *up,
                          const struct wmat *down_t, const int32_t *idx, const float *coef,
                          const int32_t *count, int stride, float *hbuf, int32_t *iscratch)
{
    (void)iscratch; /* one thread block per token already shares nothing to gain */
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || cb_enter(b) < 0) return;
    /* handles from cb_weight_upload: always bf16 */
    cb_note(b, cuk_neuron_ffn(b->stream, y, x, n, d, gate->data, up->data, down_t->data, idx, coef,
                              count, stride, hbuf, CB_ERR(b)));
}

static void cb_attention(struct backend *be, float *out, const float *q, const struct be_kv *kv,
                         const struct be_tokens *tk, int block_size, int n,
                         const struct be_attn *a)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_attention(b->stream, out, q, kv, tk, block_size, n, a, CB_ERR(b)));
}

static void cb_dsa_select(struct backend *be, int32_t *sel, int32_t *sel_n, const float *q,
                          const float *w, const struct be_kv *kv, const struct be_tokens *tk,
                          int block_size, int n, const struct be_dsa *p)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_dsa_select(b->stream, sel, sel_n, q, w, kv, tk, block_size, n, p,
                              b->dsa_scores, b->dsa_rows, b->dsa_ctx, CB_ERR(b)));
}

static void cb_layernorm_ld(struct backend *be, float *y, int ldy, const float *x, int ldx,
                            const float *w, const float *bias, int n, int d, float eps)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_layernorm_ld(b->stream, y, ldy, x, ldx, w, bias, n, d, eps, CB_ERR(b)));
}

static void cb_kv_write(struct backend *be, const struct be_kv *kv, const float *k,
                        const float *v, const struct be_tokens *tk, int block_size, int n, int row)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    if (n > 0 && block_size <= 0) {
        ms_errf(b->last, sizeof b->last, "kv_write: block_size %d", block_size);
        cb_note(b, -1);
        return;
    }
    cb_note(b, cuk_kv_write(b->stream, kv, k, v, tk, block_size, n, row, CB_ERR(b)));
}

/* y (n, m), rows ldy apart = x (n, k), rows ldx apart . w^T: the input gathered to bf16 rows,
 * the output written in place by cuBLAS's leading dimension. */
static void cb_matmul_ld(struct backend *be, float *y, int ldy, const float *x, int ldx,
                         const struct wmat *w, int n, int k, int m)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || m <= 0 || k <= 0 || cb_enter(b) < 0) return;
    if ((size_t)n * (size_t)k > b->ws_elems) {
        ms_errf(b->last, sizeof b->last,
                "matmul_ld: input of %zu elements exceeds the reserved workspace of %zu",
                (size_t)n * (size_t)k, b->ws_elems);
        cb_note(b, -1);
        return;
    }
    if (cb_note(b, cuk_to_bf16_ld(b->stream, b->ws, x, n, k, ldx, CB_ERR(b))) < 0) return;
    cb_gemm(b, y, ldy, b->ws, k, w->data, k, n, k, m);
}

static void cb_rmsnorm_ld(struct backend *be, float *y, const float *x, const float *w, int n,
                          int d, int ld, float eps)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_rmsnorm_ld(b->stream, y, x, w, n, d, ld, eps, CB_ERR(b)));
}

static void cb_rope_ex(struct backend *be, float *y, int y_stride, const float *x, int x_stride,
                       const int32_t *pos, int n, int n_head, int rot_dim, int interleave,
                       const float *cos_sin)
{
    struct cuda_backend *b = cb_of(be);
    if (cb_enter(b) < 0) return;
    cb_note(b, cuk_rope_ex(b->stream, y, y_stride, x, x_stride, pos, n, n_head, rot_dim,
                           interleave, cos_sin, CB_ERR(b)));
}

/* Positional (C++17 has no designated initializers): this catches a field added to the table. */
static int cb_host_workers(struct backend *be)
{
    (void)be;
    return 1;
}

static void cb_host_for(struct backend *be, int n_tasks, void (*fn)(void *ctx, int task, int worker),
                        void *ctx)
{
    (void)be;
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
}

static void cb_gather_cols(struct backend *be, float *y, int ldy, const float *x, int ldx,
                           const int32_t *idx, int n, int m)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || m <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_gather_cols(b->stream, y, ldy, x, ldx, idx, n, m, CB_ERR(b)));
}

static void cb_mul_sigmoid(struct backend *be, float *y, const float *g, int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_mul_sigmoid(b->stream, y, g, (size_t)n * (size_t)d, CB_ERR(b)));
}


/* The step's sequences as the device table the state-space kernels read (4 int32 each);
 * *n_tok the rows they cover. -1 when the table cannot be staged. */
static int cb_stage_seqs(struct cuda_backend *b, const struct be_seqs *sq, int *n_tok)
{
    if (sq->n > b->seq_cap) {
        ms_errf(b->last, sizeof b->last, "%d sequences, more than the %d reserved", sq->n,
                b->seq_cap);
        cb_note(b, -1);
        return -1;
    }
    /* the staging may still be read by the previous call's copy */
    if (CB_CUDA(b, cudaEventSynchronize(b->seq_done)) < 0) return -1;
    *n_tok = 0;
    for (int i = 0; i < sq->n; i++) {
        b->h_seq[4 * i] = sq->tok0[i];
        b->h_seq[4 * i + 1] = sq->n_tok[i];
        b->h_seq[4 * i + 2] = sq->slot[i];
        b->h_seq[4 * i + 3] = sq->fresh[i];
        if (sq->tok0[i] + sq->n_tok[i] > *n_tok) *n_tok = sq->tok0[i] + sq->n_tok[i];
    }
    if (CB_CUDA(b, cudaMemcpyAsync(b->d_seq, b->h_seq, sizeof(int32_t) * 4 * (size_t)sq->n,
                                   cudaMemcpyHostToDevice, b->stream)) < 0 ||
        CB_CUDA(b, cudaEventRecord(b->seq_done, b->stream)) < 0)
        return -1;
    return 0;
}

static void cb_mamba2(struct backend *be, float *out, float *xbc, const float *z, float *dt,
                      const struct be_mamba *m, const struct be_seqs *sq)
{
    struct cuda_backend *b = cb_of(be);
    int n_tok = 0;
    if (sq->n <= 0 || cb_enter(b) < 0 || cb_stage_seqs(b, sq, &n_tok) < 0) return;
    cb_note(b, cuk_mamba2(b->stream, out, xbc, z, dt, m, b->d_seq, sq->n, n_tok, CB_ERR(b)));
}

static void cb_gdn(struct backend *be, float *out, float *qkv, const float *z, float *bl,
                   float *a, const struct be_gdn *g, const struct be_seqs *sq)
{
    struct cuda_backend *b = cb_of(be);
    int n_tok = 0;
    if (sq->n <= 0 || cb_enter(b) < 0 || cb_stage_seqs(b, sq, &n_tok) < 0) return;
    cb_note(b, cuk_gdn(b->stream, out, qkv, z, bl, a, g, b->d_seq, sq->n, n_tok, CB_ERR(b)));
}

static void cb_scale(struct backend *be, float *x, int n, int d, float s)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_scale(b->stream, x, (size_t)n * (size_t)d, s, CB_ERR(b)));
}

static void cb_mul_rows(struct backend *be, float *x, const float *sc, int n, int d)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_mul_rows(b->stream, x, sc, n, d, CB_ERR(b)));
}

/* DeepSeek-V4 (v4.cu): shared memory only, nothing reserved */
static void cb_hc_pre(struct backend *be, float *post, float *comb, float *y, const float *x,
                      const float *mix, int n, int d, const struct be_hc *h)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_hc_pre(b->stream, post, comb, y, x, mix, n, d, h, CB_ERR(b)));
}

static void cb_hc_post(struct backend *be, float *y, const float *x, const float *out,
                       const float *post, const float *comb, int n, int d, int n_stream)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || d <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_hc_post(b->stream, y, x, out, post, comb, n, d, n_stream, CB_ERR(b)));
}

static void cb_v4_compress(struct backend *be, float *out, int ldo, const struct be_kv *kv,
                           const struct be_tokens *tk, int block_size, int n,
                           const struct be_v4cmp *p)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_v4_compress(b->stream, out, ldo, kv, tk, block_size, n, p, CB_ERR(b)));
}

static void cb_v4_attention(struct backend *be, float *out, const float *q,
                            const struct be_kv *kv, const struct be_tokens *tk, int block_size,
                            int n, const struct be_v4attn *a)
{
    struct cuda_backend *b = cb_of(be);
    if (n <= 0 || cb_enter(b) < 0) return;
    cb_note(b, cuk_v4_attention(b->stream, out, q, kv, tk, block_size, n, a, CB_ERR(b)));
}

static_assert(sizeof(struct backend_ops) == 45 * sizeof(void *),
              "struct backend_ops changed: update cuda_ops to match kernels/backend.h");

static const struct backend_ops cuda_ops = {
    /* .name */ "cuda",
    /* .host_memory */ 0,
    /* .destroy */ cb_destroy,
    /* .alloc */ cb_alloc,
    /* .free */ cb_free,
    /* .upload */ cb_upload,
    /* .download */ cb_download,
    /* .synchronize */ cb_synchronize,
    /* .reserve */ cb_reserve,
    /* .weight_upload */ cb_weight_upload,
    /* .weight_free */ cb_weight_free,
    /* .matmul */ cb_matmul,
    /* .matmul_multi */ cb_matmul_multi,
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
    /* .route */ cb_route,
    /* .moe_experts */ cb_moe_experts,
    /* .neuron_ffn */ cb_neuron_ffn,
    /* .attention */ cb_attention,
    /* .kv_write */ cb_kv_write,
    /* .dsa_select */ cb_dsa_select,
    /* .layernorm_ld */ cb_layernorm_ld,
    /* .matmul_ld */ cb_matmul_ld,
    /* .rmsnorm_ld */ cb_rmsnorm_ld,
    /* .rope_ex */ cb_rope_ex,
    /* .host_workers */ cb_host_workers,
    /* .host_for */ cb_host_for,
    /* .gather_cols */ cb_gather_cols,
    /* .mul_sigmoid */ cb_mul_sigmoid,
    /* .gdn */ cb_gdn,
    /* .mamba2 */ cb_mamba2,
    /* .hc_pre */ cb_hc_pre,
    /* .hc_post */ cb_hc_post,
    /* .v4_compress */ cb_v4_compress,
    /* .v4_attention */ cb_v4_attention,
    /* .scale */ cb_scale,
    /* .mul_rows */ cb_mul_rows,
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
    if (CUBLAS_CHECK(cublasSetMathMode(b->blas, CUBLAS_DEFAULT_MATH), err, errlen) < 0) goto fail;
    {
        const char *g = getenv("MOESERVE_CUDA_GROUPED");
        b->grouped = !(g && strcmp(g, "0") == 0);
    }
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
