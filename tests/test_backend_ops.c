/* Cross-checks every op of the CUDA backend against the CPU reference backend
 * (kernels/cpu/backend_cpu.c), llama.cpp test-backend-ops style: for each op and a few shapes,
 * fresh random inputs go to both backends, outputs are poisoned with NaN before the op runs,
 * and the relative L2 error ||gpu - cpu|| / ||cpu|| must be <= 1e-4 for the f32 ops and
 * <= 1e-2 for the ops that read bf16 weights on the GPU (matmul, embed, moe_experts; the CPU
 * reference stays f32), with no NaN left behind. The router must pick exactly the CPU's
 * experts. Prints one table row per check. Also exchanges rows through the NCCL communicator
 * with one rank when NCCL is built in.
 *
 * Without a CUDA device (or a build without MOESERVE_HAVE_CUDA) it prints "SKIP: no CUDA
 * device" and exits with 77 (CTest's SKIP_RETURN_CODE). `test_backend_ops <tests-dir>
 * --cpu-self-check` runs the same harness with a second CPU backend in place of the GPU, so the
 * harness itself can be checked (and sanitized) on machines without one. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "engine.h"
#include "kv_cache.h"
#include "test.h"
#ifdef MOESERVE_HAVE_CUDA
#include "cuda/backend_cuda.h"
#include "cuda/comm_nccl.h"
#endif

#include "route_impl.h"

#define OPS_TOL      1e-4
#define OPS_TOL_BF16 1e-2
#define OPS_MAX_BUFS 512
/* reserve() for every check: the largest GEMM input below, and experts per call */
#define OPS_WS_ELEMS (1u << 22)
#define OPS_WS_EXPERTS 64
/* (and DeepSeek-V4's scratch on the CPU: rows of up to 512 and windows up to 4,608, so that one
 * check's key list spans two of the CUDA kernel's 4,096-key chunks) */
static const struct be_reserve ops_reserve = {.max_elems = OPS_WS_ELEMS, .max_rows = 4096,
                                              .max_experts = OPS_WS_EXPERTS, .max_ctx = 4096,
                                              .max_heads = 64, .dsa_dim = 64, .v4_row = 512,
                                              .v4_window = 4608};

/* One check's backends and the buffers it allocated (freed by ops_release after each op). */
struct ops_ctx {
    struct backend *ref, *dut;
    uint64_t rng;
    void *dev[OPS_MAX_BUFS];
    struct backend *dev_owner[OPS_MAX_BUFS];
    int n_dev;
    void *host[OPS_MAX_BUFS];
    int n_host;
    const struct wmat *weight[OPS_MAX_BUFS];
    struct backend *weight_owner[OPS_MAX_BUFS];
    int n_weight;
    int oom;
};

static float ops_uniform(struct ops_ctx *t, float lo, float hi)
{
    t->rng ^= t->rng >> 12;
    t->rng ^= t->rng << 25;
    t->rng ^= t->rng >> 27;
    uint64_t r = t->rng * 2685821657736338717ull;
    return lo + (hi - lo) * (float)((double)(r >> 40) / (double)(1ull << 24));
}

static int ops_int(struct ops_ctx *t, int lo, int hi) /* [lo, hi) */
{
    int v = lo + (int)(ops_uniform(t, 0.0f, 1.0f) * (float)(hi - lo));
    return v >= hi ? hi - 1 : v;
}

static void *ops_host(struct ops_ctx *t, size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p || t->n_host == OPS_MAX_BUFS) {
        free(p);
        t->oom = 1;
        return NULL;
    }
    t->host[t->n_host++] = p;
    return p;
}

static float *ops_rand(struct ops_ctx *t, size_t n, float lo, float hi)
{
    float *p = ops_host(t, sizeof(float) * n);
    if (p)
        for (size_t i = 0; i < n; i++)
            p[i] = ops_uniform(t, lo, hi);
    return p;
}

/* A backend buffer holding a copy of host data (or NaN when h is NULL and it holds floats). */
static void *ops_put(struct ops_ctx *t, struct backend *be, const void *h, size_t bytes)
{
    if (t->oom || t->n_dev == OPS_MAX_BUFS) {
        t->oom = 1;
        return NULL;
    }
    void *d = be->ops->alloc(be, bytes);
    if (!d) {
        t->oom = 1;
        return NULL;
    }
    t->dev[t->n_dev] = d;
    t->dev_owner[t->n_dev++] = be;
    if (h) {
        be->ops->upload(be, d, h, bytes);
    } else {
        size_t n = bytes / sizeof(float);
        float *nan_buf = malloc(bytes ? bytes : 1);
        if (!nan_buf) {
            t->oom = 1;
            return d;
        }
        for (size_t i = 0; i < n; i++)
            nan_buf[i] = NAN;
        be->ops->upload(be, d, nan_buf, bytes);
        free(nan_buf);
    }
    return d;
}

/* A weight handle on backend be for the f32 host matrix h (rows, cols). */
static const struct wmat *ops_weight(struct ops_ctx *t, struct backend *be, const float *h,
                                     int rows, int cols)
{
    struct wmat *host = ops_host(t, sizeof *host);
    if (t->oom || !h || !host || t->n_weight == OPS_MAX_BUFS) {
        t->oom = 1;
        return NULL;
    }
    *host = (struct wmat){WTYPE_F32, rows, cols, h};
    const struct wmat *w = be->ops->weight_upload(be, host);
    if (!w) {
        t->oom = 1;
        return NULL;
    }
    t->weight[t->n_weight] = w;
    t->weight_owner[t->n_weight++] = be;
    return w;
}

static void ops_release(struct ops_ctx *t)
{
    for (int i = 0; i < t->n_dev; i++)
        t->dev_owner[i]->ops->free(t->dev_owner[i], t->dev[i]);
    for (int i = 0; i < t->n_weight; i++)
        t->weight_owner[i]->ops->weight_free(t->weight_owner[i], t->weight[i]);
    for (int i = 0; i < t->n_host; i++)
        free(t->host[i]);
    t->n_dev = t->n_host = t->n_weight = 0;
    t->oom = 0; /* each check sets up afresh */
}

/* Downloads both outputs of `count` floats and compares within tol; one table row. */
static void ops_compare_tol(struct ops_ctx *t, const char *op, const char *shape,
                            const float *r_dev, const float *d_dev, size_t count, double tol)
{
    if (t->oom) {
        CHECKF(0, "%s %s: out of memory setting up the check", op, shape);
        printf("%-16s %-34s %10s %10s  %s\n", op, shape, "-", "-", "OOM");
        return;
    }
    float *r = malloc(sizeof(float) * (count ? count : 1));
    float *d = malloc(sizeof(float) * (count ? count : 1));
    if (!r || !d) {
        free(r);
        free(d);
        CHECKF(0, "%s %s: out of memory comparing", op, shape);
        return;
    }
    t->ref->ops->download(t->ref, r, r_dev, sizeof(float) * count);
    t->dut->ops->download(t->dut, d, d_dev, sizeof(float) * count);
    double num = 0.0, den = 0.0, max_abs = 0.0;
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        if (!isfinite(d[i]) || !isfinite(r[i])) {
            bad++;
            continue;
        }
        double e = (double)d[i] - (double)r[i];
        num += e * e;
        den += (double)r[i] * r[i];
        if (fabs(e) > max_abs) max_abs = fabs(e);
    }
    double rel = den > 0.0 ? sqrt(num / den) : sqrt(num);
    int ok = bad == 0 && rel <= tol;
    printf("%-16s %-34s %10.2e %10.2e  %s", op, shape, rel, max_abs, ok ? "ok" : "FAIL");
    if (bad) printf(" (%zu non-finite of %zu)", bad, count);
    printf("\n");
    CHECKF(ok, "%s %s: rel err %.3e (tol %.0e), %zu non-finite", op, shape, rel, tol, bad);
    free(r);
    free(d);
}

static void ops_compare(struct ops_ctx *t, const char *op, const char *shape, const float *r_dev,
                        const float *d_dev, size_t count)
{
    ops_compare_tol(t, op, shape, r_dev, d_dev, count, OPS_TOL);
}

/* Host data to both backends: *r on the reference, *d on the device under test. */
static void ops_both(struct ops_ctx *t, const void *h, size_t bytes, void **r, void **d)
{
    *r = ops_put(t, t->ref, h, bytes);
    *d = ops_put(t, t->dut, h, bytes);
}

#define BOTH(h, bytes, rv, dv)                                                                     \
    do {                                                                                           \
        void *r_, *d_;                                                                             \
        ops_both(t, (h), (bytes), &r_, &d_);                                                       \
        (rv) = r_;                                                                                 \
        (dv) = d_;                                                                                 \
    } while (0)

/* Either backend's op runs only when setup succeeded. */
#define RUN2(call_ref, call_dut)                                                                   \
    do {                                                                                           \
        if (!t->oom) {                                                                             \
            call_ref;                                                                              \
            call_dut;                                                                              \
        }                                                                                          \
    } while (0)

static void check_matmul(struct ops_ctx *t, int n, int k, int m, int with_bias)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d k=%d m=%d%s", n, k, m, with_bias ? " bias" : "");
    float *x = ops_rand(t, (size_t)n * k, -1, 1), *w = ops_rand(t, (size_t)m * k, -1, 1);
    float *bias = ops_rand(t, (size_t)m, -1, 1);
    float *rx, *dx, *rb = NULL, *db = NULL, *ry, *dy;
    BOTH(x, sizeof(float) * n * k, rx, dx);
    const struct wmat *rw = ops_weight(t, t->ref, w, m, k);
    const struct wmat *dw = ops_weight(t, t->dut, w, m, k);
    if (with_bias) BOTH(bias, sizeof(float) * m, rb, db);
    BOTH(NULL, sizeof(float) * n * m, ry, dy);
    RUN2(t->ref->ops->matmul(t->ref, ry, rx, rw, rb, n, k, m),
         t->dut->ops->matmul(t->dut, dy, dx, dw, db, n, k, m));
    ops_compare_tol(t, "matmul", shape, ry, dy, (size_t)n * m, OPS_TOL_BF16);
    ops_release(t);
}

/* matmul_multi on the device against separate matmuls on the reference: three matrices of
 * different heights, the second without a bias. */
/* MXFP4 weights (gpt-oss experts as published, repacked): the GPU dequantizes them to bf16 at
 * upload, exactly; the CPU multiplies them with f32 activations. */
static void check_matmul_mxfp4(struct ops_ctx *t, int n, int k, int m)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d k=%d m=%d mxfp4", n, k, m);
    unsigned char *bl = ops_host(t, (size_t)m * k / 2), *sc = ops_host(t, (size_t)m * k / 32);
    struct wmat *host = ops_host(t, sizeof *host);
    void *data = ops_host(t, wtype_bytes(WTYPE_MXFP4, m, k));
    if (t->oom || !bl || !sc || !host || !data || t->n_weight + 2 > OPS_MAX_BUFS) {
        t->oom = 1;
        return;
    }
    for (int i = 0; i < m * k / 2; i++) bl[i] = (unsigned char)ops_int(t, 0, 256);
    for (int i = 0; i < m * k / 32; i++) sc[i] = (unsigned char)ops_int(t, 120, 128);
    wmat_convert_mxfp4(WTYPE_MXFP4, data, bl, sc, m, k, 1, 0, m);
    *host = (struct wmat){WTYPE_MXFP4, m, k, data};
    const struct wmat *rw = t->ref->ops->weight_upload(t->ref, host);
    const struct wmat *dw = t->dut->ops->weight_upload(t->dut, host);
    if (!rw || !dw) {
        t->oom = 1;
        return;
    }
    t->weight[t->n_weight] = rw;
    t->weight_owner[t->n_weight++] = t->ref;
    t->weight[t->n_weight] = dw;
    t->weight_owner[t->n_weight++] = t->dut;
    float *rx, *dx, *ry, *dy;
    BOTH(ops_rand(t, (size_t)n * k, -1, 1), sizeof(float) * n * k, rx, dx);
    BOTH(NULL, sizeof(float) * n * m, ry, dy);
    RUN2(t->ref->ops->matmul(t->ref, ry, rx, rw, NULL, n, k, m),
         t->dut->ops->matmul(t->dut, dy, dx, dw, NULL, n, k, m));
    ops_compare_tol(t, "matmul", shape, ry, dy, (size_t)n * m, OPS_TOL_BF16);
    ops_release(t);
}

static void check_matmul_multi(struct ops_ctx *t, int n, int k)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d k=%d m=48,16,33", n, k);
    static const int ms[3] = {48, 16, 33};
    float *x = ops_rand(t, (size_t)n * k, -1, 1), *rx, *dx;
    BOTH(x, sizeof(float) * n * k, rx, dx);
    const struct wmat *rw[3], *dw[3];
    float *ry[3], *dy[3];
    const float *rb[3] = {0}, *db[3] = {0};
    for (int i = 0; i < 3; i++) {
        float *w = ops_rand(t, (size_t)ms[i] * k, -1, 1), *bias = ops_rand(t, ms[i], -1, 1);
        rw[i] = ops_weight(t, t->ref, w, ms[i], k);
        dw[i] = ops_weight(t, t->dut, w, ms[i], k);
        float *rbi, *dbi;
        BOTH(bias, sizeof(float) * ms[i], rbi, dbi);
        if (i != 1) rb[i] = rbi, db[i] = dbi;
        BOTH(NULL, sizeof(float) * n * ms[i], ry[i], dy[i]);
    }
    if (!t->oom) {
        for (int i = 0; i < 3; i++) t->ref->ops->matmul(t->ref, ry[i], rx, rw[i], rb[i], n, k, ms[i]);
        t->dut->ops->matmul_multi(t->dut, 3, dy, dx, dw, db, n, k);
    }
    for (int i = 0; i < 3; i++)
        ops_compare_tol(t, "matmul_multi", shape, ry[i], dy[i], (size_t)n * ms[i], OPS_TOL_BF16);
    ops_release(t);
}

static void check_rmsnorm(struct ops_ctx *t, int n, int d, int in_place)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d d=%d%s", n, d, in_place ? " in place" : "");
    float *x = ops_rand(t, (size_t)n * d, -2, 2), *w = ops_rand(t, (size_t)d, 0.5f, 1.5f);
    float *rx, *dx, *rw, *dw, *ry, *dy;
    BOTH(x, sizeof(float) * n * d, rx, dx);
    BOTH(w, sizeof(float) * d, rw, dw);
    if (in_place) {
        ry = rx;
        dy = dx;
    } else {
        BOTH(NULL, sizeof(float) * n * d, ry, dy);
    }
    RUN2(t->ref->ops->rmsnorm(t->ref, ry, rx, rw, n, d, 1e-5f),
         t->dut->ops->rmsnorm(t->dut, dy, dx, dw, n, d, 1e-5f));
    ops_compare(t, "rmsnorm", shape, ry, dy, (size_t)n * d);
    ops_release(t);
}

static void check_rope(struct ops_ctx *t, int n, int n_head, int head_dim, int max_pos)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d heads=%d hd=%d", n, n_head, head_dim);
    int half = head_dim / 2;
    size_t nx = (size_t)n * n_head * head_dim;
    float *x = ops_rand(t, nx, -1, 1);
    float *cs = ops_host(t, sizeof(float) * max_pos * half * 2);
    int32_t *pos = ops_host(t, sizeof(int32_t) * n);
    if (cs && pos) {
        for (int p = 0; p < max_pos; p++)
            for (int j = 0; j < half; j++) {
                float a = ops_uniform(t, -3.14159f, 3.14159f);
                cs[((size_t)p * half + j) * 2] = cosf(a);
                cs[((size_t)p * half + j) * 2 + 1] = sinf(a);
            }
        for (int i = 0; i < n; i++)
            pos[i] = ops_int(t, 0, max_pos);
    }
    float *rx, *dx, *rcs, *dcs;
    int32_t *rp, *dp;
    BOTH(x, sizeof(float) * nx, rx, dx);
    BOTH(cs, sizeof(float) * max_pos * half * 2, rcs, dcs);
    BOTH(pos, sizeof(int32_t) * n, rp, dp);
    RUN2(t->ref->ops->rope(t->ref, rx, rp, n, n_head, head_dim, rcs),
         t->dut->ops->rope(t->dut, dx, dp, n, n_head, head_dim, dcs));
    ops_compare(t, "rope", shape, rx, dx, nx);
    ops_release(t);
}

static void check_elementwise(struct ops_ctx *t, int n, int d)
{
    char shape[64];
    size_t nd = (size_t)n * d;
    snprintf(shape, sizeof shape, "n=%d d=%d", n, d);
    float *rx, *dx, *ry, *dy, *rg, *dg, *ru, *du, *ro, *dout, *rs, *ds;

    /* add */
    BOTH(ops_rand(t, nd, -1, 1), sizeof(float) * nd, ry, dy);
    BOTH(ops_rand(t, nd, -1, 1), sizeof(float) * nd, rx, dx);
    RUN2(t->ref->ops->add(t->ref, ry, rx, n, d), t->dut->ops->add(t->dut, dy, dx, n, d));
    ops_compare(t, "add", shape, ry, dy, nd);
    ops_release(t);

    /* clamp */
    BOTH(ops_rand(t, nd, -3, 3), sizeof(float) * nd, rx, dx);
    RUN2(t->ref->ops->clamp(t->ref, rx, n, d, 1.5f), t->dut->ops->clamp(t->dut, dx, n, d, 1.5f));
    ops_compare(t, "clamp", shape, rx, dx, nd);
    ops_release(t);

    /* swiglu */
    BOTH(ops_rand(t, nd, -6, 6), sizeof(float) * nd, rg, dg);
    BOTH(ops_rand(t, nd, -2, 2), sizeof(float) * nd, ru, du);
    BOTH(NULL, sizeof(float) * nd, ro, dout);
    RUN2(t->ref->ops->swiglu(t->ref, ro, rg, ru, n, d),
         t->dut->ops->swiglu(t->dut, dout, dg, du, n, d));
    ops_compare(t, "swiglu", shape, ro, dout, nd);
    ops_release(t);

    /* add_scaled_rows, identity and sigmoid */
    for (int sig = 0; sig <= 1; sig++) {
        char s2[80];
        snprintf(s2, sizeof s2, "%s%s", shape, sig ? " sigmoid" : "");
        BOTH(ops_rand(t, nd, -1, 1), sizeof(float) * nd, ry, dy);
        BOTH(ops_rand(t, nd, -1, 1), sizeof(float) * nd, rx, dx);
        BOTH(ops_rand(t, (size_t)n, -4, 4), sizeof(float) * n, rs, ds);
        RUN2(t->ref->ops->add_scaled_rows(t->ref, ry, rx, rs, n, d, sig),
             t->dut->ops->add_scaled_rows(t->dut, dy, dx, ds, n, d, sig));
        ops_compare(t, "add_scaled_rows", s2, ry, dy, nd);
        ops_release(t);
    }
}

static void check_rows(struct ops_ctx *t, int n_src, int n, int d)
{
    char shape[64];
    snprintf(shape, sizeof shape, "src=%d n=%d d=%d", n_src, n, d);
    size_t src_n = (size_t)n_src * d, out_n = (size_t)n * d;
    float *rs, *ds, *ro, *dout;
    int32_t *ri, *di;

    /* embed and gather_rows: random ids with repeats */
    for (int which = 0; which < 2; which++) {
        int32_t *ids = ops_host(t, sizeof(int32_t) * n);
        if (ids)
            for (int i = 0; i < n; i++)
                ids[i] = ops_int(t, 0, n_src);
        float *src = ops_rand(t, src_n, -1, 1);
        BOTH(src, sizeof(float) * src_n, rs, ds);
        BOTH(ids, sizeof(int32_t) * n, ri, di);
        BOTH(NULL, sizeof(float) * out_n, ro, dout);
        if (which == 0) {
            const struct wmat *rt = ops_weight(t, t->ref, src, n_src, d);
            const struct wmat *dt = ops_weight(t, t->dut, src, n_src, d);
            RUN2(t->ref->ops->embed(t->ref, ro, rt, ri, n, d),
                 t->dut->ops->embed(t->dut, dout, dt, di, n, d));
            ops_compare_tol(t, "embed", shape, ro, dout, out_n, OPS_TOL_BF16);
        } else {
            RUN2(t->ref->ops->gather_rows(t->ref, ro, rs, ri, n, d),
                 t->dut->ops->gather_rows(t->dut, dout, ds, di, n, d));
            ops_compare(t, "gather_rows", shape, ro, dout, out_n);
        }
        ops_release(t);
    }

    /* scatter_rows: distinct targets (a prefix of a permutation) into a filled dst */
    int32_t *perm = ops_host(t, sizeof(int32_t) * n_src);
    if (perm) {
        for (int i = 0; i < n_src; i++)
            perm[i] = i;
        for (int i = n_src - 1; i > 0; i--) {
            int j = ops_int(t, 0, i + 1);
            int32_t tmp = perm[i];
            perm[i] = perm[j];
            perm[j] = tmp;
        }
    }
    BOTH(ops_rand(t, out_n, -1, 1), sizeof(float) * out_n, rs, ds);
    BOTH(perm, sizeof(int32_t) * n, ri, di);
    BOTH(ops_rand(t, src_n, -1, 1), sizeof(float) * src_n, ro, dout);
    RUN2(t->ref->ops->scatter_rows(t->ref, ro, rs, ri, n, d),
         t->dut->ops->scatter_rows(t->dut, dout, ds, di, n, d));
    ops_compare(t, "scatter_rows", shape, ro, dout, src_n);
    ops_release(t);
}

static void check_moe_combine(struct ops_ctx *t, int n, int k, int n_rows, int d)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d k=%d rows=%d d=%d", n, k, n_rows, d);
    int32_t *idx = ops_host(t, sizeof(int32_t) * n * k);
    if (idx)
        for (int i = 0; i < n * k; i++)
            idx[i] = ops_int(t, -1, n_rows); /* some -1 slots */
    float *rr, *dr, *rw, *dw, *ro, *dout;
    int32_t *ri, *di;
    BOTH(ops_rand(t, (size_t)n_rows * d, -1, 1), sizeof(float) * n_rows * d, rr, dr);
    BOTH(idx, sizeof(int32_t) * n * k, ri, di);
    BOTH(ops_rand(t, (size_t)n * k, 0, 1), sizeof(float) * n * k, rw, dw);
    BOTH(NULL, sizeof(float) * n * d, ro, dout);
    RUN2(t->ref->ops->moe_combine(t->ref, ro, rr, ri, rw, n, k, d),
         t->dut->ops->moe_combine(t->dut, dout, dr, di, dw, n, k, d));
    ops_compare(t, "moe_combine", shape, ro, dout, (size_t)n * d);
    ops_release(t);
}

/* Router: the device must choose exactly the CPU's experts (ties are improbable with random
 * logits) with weights to f32 rounding; tokens use different budgets k. */
static void check_route(struct ops_ctx *t, int n, enum be_route_kind kind, int E, int K, int G,
                        int kg)
{
    char shape[64];
    snprintf(shape, sizeof shape, "%s n=%d E=%d k=%d G=%d/%d",
             kind == BE_ROUTE_MOHGE ? "mohge" : kind == BE_ROUTE_SIGMOID_GROUP ? "sig_group" : "softmax",
             n, E, K, G, kg);
    struct be_route r = {kind, E, K, G, kg, 1, NULL, 2.5f, BE_SCORE_SIGMOID, NULL, NULL}, dr;
    size_t nk = (size_t)n * K;
    int32_t *tok_k = ops_host(t, sizeof(int32_t) * n);
    if (tok_k)
        for (int i = 0; i < n; i++) tok_k[i] = i % 3 == 2 ? ops_int(t, 1, K + 1) : K;
    float *rl, *dl, *rg, *dg, *rw, *dw;
    int32_t *rk, *dk, *ri, *di;
    BOTH(ops_rand(t, (size_t)n * E, -3, 3), sizeof(float) * n * E, rl, dl);
    BOTH(ops_rand(t, (size_t)n * (G > 0 ? G : 1), -2, 2), sizeof(float) * n * (G > 0 ? G : 1), rg,
         dg);
    BOTH(tok_k, sizeof(int32_t) * n, rk, dk);
    /* Correction biases large enough to reorder experts (the masked-to-0 rule included). */
    float *rb, *db;
    BOTH(ops_rand(t, (size_t)E, -0.6f, 0.3f), sizeof(float) * E, rb, db);
    r.bias = rb;
    dr = r;
    dr.bias = db;
    BOTH(NULL, sizeof(int32_t) * nk, ri, di);
    BOTH(NULL, sizeof(float) * nk, rw, dw);
    RUN2(t->ref->ops->route(t->ref, ri, rw, rl, rg, rk, n, &r),
         t->dut->ops->route(t->dut, di, dw, dl, dg, dk, n, &dr));
    int32_t *a = ops_host(t, sizeof(int32_t) * nk), *b = ops_host(t, sizeof(int32_t) * nk);
    if (!t->oom) {
        t->ref->ops->download(t->ref, a, ri, sizeof(int32_t) * nk);
        t->dut->ops->download(t->dut, b, di, sizeof(int32_t) * nk);
        size_t diff = 0;
        for (size_t i = 0; i < nk; i++) diff += a[i] != b[i];
        printf("%-16s %-34s %10zu %10s  %s\n", "route (ids)", shape, diff, "-",
               diff ? "FAIL" : "ok");
        CHECKF(diff == 0, "route %s: %zu of %zu expert ids differ", shape, diff, nk);
    }
    ops_compare(t, "route (weights)", shape, rw, dw, nk);
    ops_release(t);
}

/* Expert FFNs of mixed widths over rows grouped by expert, some experts without rows; oai:
 * gpt-oss's experts (biases on gate, up and down; the clamped SwiGLU, a limit that binds). */
static void check_moe_experts(struct ops_ctx *t, int n_experts, int d, int max_rows, int oai)
{
    char shape[64];
    snprintf(shape, sizeof shape, "experts=%d d=%d rows<=%d%s", n_experts, d, max_rows,
             oai ? " oai" : "");
    int off[OPS_WS_EXPERTS + 1];
    struct be_expert rex[OPS_WS_EXPERTS], dex[OPS_WS_EXPERTS];
    size_t act = 0;
    off[0] = 0;
    for (int j = 0; j < n_experts; j++) {
        int rows = j % 4 == 3 ? 0 : ops_int(t, 1, max_rows + 1);
        int ff = 16 * ops_int(t, 1, 9); /* 16 .. 128: mixed widths */
        off[j + 1] = off[j] + rows;
        act += (size_t)rows * ff;
        rex[j].d_ff = dex[j].d_ff = ff;
        for (int p = 0; p < 3; p++) {
            float *w = ops_rand(t, (size_t)ff * d, -0.2f, 0.2f);
            int wr = p == 2 ? d : ff, wc = p == 2 ? ff : d;
            const struct wmat *rw = ops_weight(t, t->ref, w, wr, wc);
            const struct wmat *dw = ops_weight(t, t->dut, w, wr, wc);
            if (p == 0) rex[j].gate = rw, dex[j].gate = dw;
            if (p == 1) rex[j].up = rw, dex[j].up = dw;
            if (p == 2) rex[j].down = rw, dex[j].down = dw;
        }
        rex[j].b_gate = rex[j].b_up = rex[j].b_down = NULL;
        dex[j].b_gate = dex[j].b_up = dex[j].b_down = NULL;
        rex[j].act = dex[j].act = oai ? BE_ACT_SWIGLU_OAI : BE_ACT_SILU;
        rex[j].alpha = dex[j].alpha = 1.702f;
        rex[j].limit = dex[j].limit = 0.3f;
        if (oai) {
            BOTH(ops_rand(t, (size_t)ff, -0.5f, 0.5f), sizeof(float) * ff, rex[j].b_gate, dex[j].b_gate);
            BOTH(ops_rand(t, (size_t)ff, -0.5f, 0.5f), sizeof(float) * ff, rex[j].b_up, dex[j].b_up);
            BOTH(ops_rand(t, (size_t)d, -0.5f, 0.5f), sizeof(float) * d, rex[j].b_down, dex[j].b_down);
        }
    }
    size_t rows_n = (size_t)off[n_experts] * d;
    float *rx, *dx, *ry, *dy, *rg, *dg, *ru, *du;
    BOTH(ops_rand(t, rows_n, -1, 1), sizeof(float) * rows_n, rx, dx);
    BOTH(NULL, sizeof(float) * rows_n, ry, dy);
    BOTH(NULL, sizeof(float) * (act ? act : 1), rg, dg);
    BOTH(NULL, sizeof(float) * (act ? act : 1), ru, du);
    RUN2(t->ref->ops->moe_experts(t->ref, ry, rx, d, n_experts, off, rex, rg, ru),
         t->dut->ops->moe_experts(t->dut, dy, dx, d, n_experts, off, dex, dg, du));
    ops_compare_tol(t, "moe_experts", shape, ry, dy, rows_n, OPS_TOL_BF16);
    ops_release(t);
}

/* Continuous experts: each of n tokens computes a random ascending subset (up to `stride`, some
 * empty) of F neurons of (F, d) neuron-major matrices with random weights. */
static void check_neuron_ffn(struct ops_ctx *t, int n, int d, int F, int stride)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d d=%d F=%d stride=%d", n, d, F, stride);
    const struct wmat *rw[3], *dw[3];
    for (int p = 0; p < 3; p++) {
        float *w = ops_rand(t, (size_t)F * d, -0.2f, 0.2f);
        rw[p] = ops_weight(t, t->ref, w, F, d);
        dw[p] = ops_weight(t, t->dut, w, F, d);
    }
    int32_t *idx = ops_host(t, sizeof(int32_t) * (size_t)n * stride);
    int32_t *count = ops_host(t, sizeof(int32_t) * (size_t)n);
    float *coef = ops_rand(t, (size_t)n * stride, 0.0f, 1.0f);
    for (int i = 0; i < n && idx && count; i++) {
        int c = 0;
        for (int f = 0; f < F && c < stride; f++) /* keep each neuron with probability 1/2 */
            if (i % 5 != 4 && ops_uniform(t, 0.0f, 1.0f) < 0.5f) idx[(size_t)i * stride + c++] = f;
        count[i] = c;
    }
    float *rx, *dx, *ry, *dy, *rh, *dh, *rc, *dc;
    int32_t *ri, *di, *rn, *dn;
    BOTH(ops_rand(t, (size_t)n * d, -1, 1), sizeof(float) * n * d, rx, dx);
    BOTH(idx, sizeof(int32_t) * (size_t)n * stride, ri, di);
    BOTH(count, sizeof(int32_t) * (size_t)n, rn, dn);
    BOTH(coef, sizeof(float) * (size_t)n * stride, rc, dc);
    BOTH(NULL, sizeof(float) * (size_t)n * d, ry, dy);
    BOTH(NULL, sizeof(float) * (size_t)n * stride, rh, dh);
    int32_t *is = ops_host(t, sizeof(int32_t) * NEURON_ISCRATCH(n, stride, F));
    RUN2(t->ref->ops->neuron_ffn(t->ref, ry, rx, n, d, rw[0], rw[1], rw[2], ri, rc, rn, stride, rh,
                                 is),
         t->dut->ops->neuron_ffn(t->dut, dy, dx, n, d, dw[0], dw[1], dw[2], di, dc, dn, stride, dh,
                                 is));
    ops_compare_tol(t, "neuron_ffn", shape, ry, dy, (size_t)n * d, OPS_TOL_BF16);
    ops_release(t);
}

/* A block table for `n_pos` positions: distinct physical blocks in random order out of
 * n_blocks (>= needed). */
static int32_t *ops_block_table(struct ops_ctx *t, int needed, int n_blocks)
{
    int32_t *all = ops_host(t, sizeof(int32_t) * n_blocks);
    if (!all) return NULL;
    for (int i = 0; i < n_blocks; i++)
        all[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = ops_int(t, 0, i + 1);
        int32_t tmp = all[i];
        all[i] = all[j];
        all[j] = tmp;
    }
    (void)needed;
    return all;
}

/* An f32 layer cache over k and v (backend memory), with KV head segments of kg and vg
 * elements. */
static struct be_kv f32_kv(void *k, void *v, int kg, int vg)
{
    return (struct be_kv){.type = BE_KV_F32, .k = k, .v = v, .k_grp = kg, .v_grp = vg,
                          .k_scale = 1.0f, .v_scale = 1.0f};
}

static void check_kv_write(struct ops_ctx *t, int block_size, int n_kv_head, int head_dim, int pos0,
                           int n)
{
    char shape[64];
    snprintf(shape, sizeof shape, "bs=%d kvh=%d hd=%d pos0=%d n=%d", block_size, n_kv_head,
             head_dim, pos0, n);
    int row = n_kv_head * head_dim;
    int needed = (pos0 + n + block_size - 1) / block_size, n_blocks = needed + 3;
    size_t cache_n = (size_t)n_blocks * block_size * row;
    int32_t *bt = ops_block_table(t, needed, n_blocks);
    float *rk, *dk, *rv, *dv, *rkc, *dkc, *rvc, *dvc;
    int32_t *rb, *db;
    BOTH(ops_rand(t, (size_t)n * row, -1, 1), sizeof(float) * n * row, rk, dk);
    BOTH(ops_rand(t, (size_t)n * row, -1, 1), sizeof(float) * n * row, rv, dv);
    BOTH(ops_rand(t, cache_n, -1, 1), sizeof(float) * cache_n, rkc, dkc);
    BOTH(ops_rand(t, cache_n, -1, 1), sizeof(float) * cache_n, rvc, dvc);
    BOTH(bt, sizeof(int32_t) * n_blocks, rb, db);
    struct be_tokens rt = {.tables = rb, .pos0 = pos0}, dt = {.tables = db, .pos0 = pos0};
    struct be_kv rkv = f32_kv(rkc, rvc, head_dim, head_dim), dkv = f32_kv(dkc, dvc, head_dim, head_dim);
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rk, rv, &rt, block_size, n, row),
         t->dut->ops->kv_write(t->dut, &dkv, dk, dv, &dt, block_size, n, row));
    ops_compare(t, "kv_write (k)", shape, rkc, dkc, cache_n);
    ops_compare(t, "kv_write (v)", shape, rvc, dvc, cache_n);
    ops_release(t);
}

static void check_attention(struct ops_ctx *t, int pos0, int n, int n_head, int n_kv_head,
                            int head_dim, int block_size, int window, float scale)
{
    char shape[64];
    snprintf(shape, sizeof shape, "p0=%d n=%d h=%d/%d hd=%d bs=%d w=%d", pos0, n, n_head, n_kv_head,
             head_dim, block_size, window);
    int row = n_kv_head * head_dim;
    int needed = (pos0 + n + block_size - 1) / block_size, n_blocks = needed + 2;
    size_t cache_n = (size_t)n_blocks * block_size * row, qn = (size_t)n * n_head * head_dim;
    int32_t *bt = ops_block_table(t, needed, n_blocks);
    float *rq, *dq, *rkc, *dkc, *rvc, *dvc, *ro, *dout;
    int32_t *rb, *db;
    BOTH(ops_rand(t, qn, -1, 1), sizeof(float) * qn, rq, dq);
    BOTH(ops_rand(t, cache_n, -1, 1), sizeof(float) * cache_n, rkc, dkc);
    BOTH(ops_rand(t, cache_n, -1, 1), sizeof(float) * cache_n, rvc, dvc);
    BOTH(bt, sizeof(int32_t) * n_blocks, rb, db);
    BOTH(NULL, sizeof(float) * qn, ro, dout);
    struct be_tokens rt = {.tables = rb, .pos0 = pos0}, dt = {.tables = db, .pos0 = pos0};
    struct be_kv rkv = f32_kv(rkc, rvc, head_dim, head_dim), dkv = f32_kv(dkc, dvc, head_dim, head_dim);
    struct be_attn a = {.n_head = n_head, .n_kv_head = n_kv_head, .k_dim = head_dim,
                        .v_dim = head_dim, .k_row = row, .v_row = row, .window = window,
                        .scale = scale};
    RUN2(t->ref->ops->attention(t->ref, ro, rq, &rkv, &rt, block_size, n, &a),
         t->dut->ops->attention(t->dut, dout, dq, &dkv, &dt, block_size, n, &a));
    ops_compare(t, "attention", shape, ro, dout, qn);
    ops_release(t);
}

/* A layer cache of `type` for n_blocks blocks (int8: with its scales), in the backend. */
static struct be_kv typed_kv(struct backend *be, enum be_kv_type type, int n_blocks, int bs,
                             int row, int grp)
{
    struct kv_geom g = {.type = type, .k_row = row, .v_row = row, .k_grp = grp, .v_grp = grp};
    struct be_kv kv;
    if (kv_layer_alloc(be, &g, n_blocks, bs, &kv) != 0) memset(&kv, 0, sizeof kv);
    return kv;
}

/* A step over n_seq sequences of len positions in blocks shuffled across all of them: each
 * sequence gets a run of tokens (some of 2-8, a prefill chunk; sequence 0's at the end when
 * last_at_end), into seq / pos, and every one of its positions into all_seq / all_pos (the
 * cache's writer). Returns the step's tokens. */
static int paged_steps(struct ops_ctx *t, int n_seq, int len, int n_blocks, bool last_at_end,
                       int32_t *tables, int32_t *seq, int32_t *pos, int32_t *all_seq,
                       int32_t *all_pos)
{
    int n = 0;
    for (int i = 0; i < n_blocks; i++) tables[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = ops_int(t, 0, i + 1);
        int32_t tmp = tables[i];
        tables[i] = tables[j];
        tables[j] = tmp;
    }
    for (int s = 0; s < n_seq; s++) {
        int run = s % 3 == 0 ? ops_int(t, 2, 8) : 1;
        int p0 = last_at_end && s == 0 ? len - run : ops_int(t, 0, len - run);
        for (int i = 0; i < run; i++, n++) {
            seq[n] = s;
            pos[n] = p0 + i;
        }
        for (int p = 0; p < len; p++) {
            all_seq[s * len + p] = s;
            all_pos[s * len + p] = p;
        }
    }
    return n;
}

/* A whole step in one call: n_seq sequences, each a prefill chunk or one decode token at its own
 * position, with block tables in one (n_seq, stride) array; kv_write then attention, as the
 * engine runs them, with the cache in `type` (every position written first, through kv_write,
 * so both backends hold the same stored values). */
static void check_attention_batch(struct ops_ctx *t, int n_seq, int n_head, int n_kv_head,
                                  int head_dim, int block_size, enum be_kv_type type)
{
    char shape[64];
    snprintf(shape, sizeof shape, "seqs=%d h=%d/%d hd=%d bs=%d %s", n_seq, n_head, n_kv_head,
             head_dim, block_size, engine_kv_type_name(type));
    enum { MAX_LEN = 96 };
    int row = n_kv_head * head_dim, stride = (MAX_LEN + block_size - 1) / block_size;
    int n_blocks = n_seq * stride;
    int32_t *tables = ops_host(t, sizeof(int32_t) * n_blocks);
    int32_t *seq = ops_host(t, sizeof(int32_t) * n_seq * 8), *pos = ops_host(t, sizeof(int32_t) * n_seq * 8);
    int32_t *all_seq = ops_host(t, sizeof(int32_t) * n_seq * MAX_LEN);
    int32_t *all_pos = ops_host(t, sizeof(int32_t) * n_seq * MAX_LEN);
    int n = 0, n_all = n_seq * MAX_LEN;
    if (tables && seq && pos && all_seq && all_pos)
        n = paged_steps(t, n_seq, MAX_LEN, n_blocks, false, tables, seq, pos, all_seq, all_pos);
    size_t qn = (size_t)n * n_head * head_dim, all_n = (size_t)n_all * row;
    float *rq, *dq, *rk, *dk, *rv, *dv, *ro, *dout, *rka, *dka, *rva, *dva;
    int32_t *rtb, *dtb, *rs, *ds, *rp, *dp, *ras, *das, *rap, *dap;
    BOTH(ops_rand(t, qn, -1, 1), sizeof(float) * qn, rq, dq);
    BOTH(ops_rand(t, (size_t)n * row, -1, 1), sizeof(float) * n * row, rk, dk);
    BOTH(ops_rand(t, (size_t)n * row, -1, 1), sizeof(float) * n * row, rv, dv);
    BOTH(ops_rand(t, all_n, -3, 3), sizeof(float) * all_n, rka, dka);
    BOTH(ops_rand(t, all_n, -3, 3), sizeof(float) * all_n, rva, dva);
    BOTH(tables, sizeof(int32_t) * n_blocks, rtb, dtb);
    BOTH(seq, sizeof(int32_t) * n, rs, ds);
    BOTH(pos, sizeof(int32_t) * n, rp, dp);
    BOTH(all_seq, sizeof(int32_t) * n_all, ras, das);
    BOTH(all_pos, sizeof(int32_t) * n_all, rap, dap);
    BOTH(NULL, sizeof(float) * qn, ro, dout);
    struct be_kv rkv = typed_kv(t->ref, type, n_blocks, block_size, row, head_dim);
    struct be_kv dkv = typed_kv(t->dut, type, n_blocks, block_size, row, head_dim);
    if (!rkv.k || !dkv.k) t->oom = 1;
    struct be_tokens rt = {rtb, stride, rs, rp, 0}, dt = {dtb, stride, ds, dp, 0};
    struct be_tokens rat = {rtb, stride, ras, rap, 0}, dat = {dtb, stride, das, dap, 0};
    struct be_attn a = {.n_head = n_head, .n_kv_head = n_kv_head, .k_dim = head_dim,
                        .v_dim = head_dim, .k_row = row, .v_row = row, .scale = 0.125f};
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rka, rva, &rat, block_size, n_all, row),
         t->dut->ops->kv_write(t->dut, &dkv, dka, dva, &dat, block_size, n_all, row));
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rk, rv, &rt, block_size, n, row),
         t->dut->ops->kv_write(t->dut, &dkv, dk, dv, &dt, block_size, n, row));
    RUN2(t->ref->ops->attention(t->ref, ro, rq, &rkv, &rt, block_size, n, &a),
         t->dut->ops->attention(t->dut, dout, dq, &dkv, &dt, block_size, n, &a));
    if (type == BE_KV_F32) ops_compare(t, "kv_write (batch)", shape, rkv.k, dkv.k, (size_t)n_blocks * block_size * row);
    ops_compare(t, "attention (batch)", shape, ro, dout, qn);
    ops_release(t);
    if (rkv.k) kv_layer_free(t->ref, &rkv);
    if (dkv.k) kv_layer_free(t->dut, &dkv);
}

/* matmul_ld: column slices in and out (MLA's per-head projections). */
static void check_matmul_ld(struct ops_ctx *t, int n, int k, int m, int ldx, int ldy)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d k=%d m=%d ldx=%d ldy=%d", n, k, m, ldx, ldy);
    float *x = ops_rand(t, (size_t)n * ldx, -1, 1), *w = ops_rand(t, (size_t)m * k, -1, 1);
    float *y0 = ops_rand(t, (size_t)n * ldy, -1, 1); /* columns outside the slice stay */
    float *rx, *dx, *ry, *dy;
    BOTH(x, sizeof(float) * n * ldx, rx, dx);
    BOTH(y0, sizeof(float) * n * ldy, ry, dy);
    const struct wmat *rw = ops_weight(t, t->ref, w, m, k);
    const struct wmat *dw = ops_weight(t, t->dut, w, m, k);
    RUN2(t->ref->ops->matmul_ld(t->ref, ry + 1, ldy, rx + 2, ldx, rw, n, k, m),
         t->dut->ops->matmul_ld(t->dut, dy + 1, ldy, dx + 2, ldx, dw, n, k, m));
    ops_compare_tol(t, "matmul_ld", shape, ry, dy, (size_t)n * ldy, OPS_TOL_BF16);
    ops_release(t);
}

static void check_rmsnorm_ld(struct ops_ctx *t, int n, int d, int ld)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d d=%d ld=%d", n, d, ld);
    float *x = ops_rand(t, (size_t)n * ld, -2, 2), *w = ops_rand(t, (size_t)d, 0.5f, 1.5f);
    float *rx, *dx, *rw, *dw;
    BOTH(x, sizeof(float) * n * ld, rx, dx);
    BOTH(w, sizeof(float) * d, rw, dw);
    RUN2(t->ref->ops->rmsnorm_ld(t->ref, rx, rx, rw, n, d, ld, 1e-6f),
         t->dut->ops->rmsnorm_ld(t->dut, dx, dx, dw, n, d, ld, 1e-6f));
    ops_compare(t, "rmsnorm_ld", shape, rx, dx, (size_t)n * ld);
    ops_release(t);
}

/* rope_ex from one strided layout into another, rotate-half or interleaved pairs. */
static void check_rope_ex(struct ops_ctx *t, int n, int n_head, int xs, int ys, int rot,
                          int interleave, int max_pos)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d h=%d x%d->y%d rot=%d%s", n, n_head, xs, ys, rot,
             interleave ? " interleaved" : "");
    int half = rot / 2;
    size_t nx = (size_t)n * n_head * xs, ny = (size_t)n * n_head * ys;
    float *x = ops_rand(t, nx, -1, 1), *y = ops_rand(t, ny, -1, 1);
    float *cs = ops_host(t, sizeof(float) * max_pos * half * 2);
    int32_t *pos = ops_host(t, sizeof(int32_t) * n);
    if (cs && pos) {
        for (int i = 0; i < max_pos * half; i++) {
            float a = ops_uniform(t, -3.14159f, 3.14159f);
            cs[2 * i] = 1.3f * cosf(a), cs[2 * i + 1] = 1.3f * sinf(a); /* YaRN's factor */
        }
        for (int i = 0; i < n; i++) pos[i] = ops_int(t, 0, max_pos);
    }
    float *rx, *dx, *ry, *dy, *rcs, *dcs;
    int32_t *rp, *dp;
    BOTH(x, sizeof(float) * nx, rx, dx);
    BOTH(y, sizeof(float) * ny, ry, dy);
    BOTH(cs, sizeof(float) * max_pos * half * 2, rcs, dcs);
    BOTH(pos, sizeof(int32_t) * n, rp, dp);
    /* the rotated part at an offset inside each head where the layout leaves room */
    int xo = xs > rot ? 1 : 0, yo = ys > rot + 2 ? 3 : 0;
    RUN2(t->ref->ops->rope_ex(t->ref, ry + yo, ys, rx + xo, xs, rp, n, n_head, rot, interleave,
                              rcs),
         t->dut->ops->rope_ex(t->dut, dy + yo, ys, dx + xo, xs, dp, n, n_head, rot, interleave,
                              dcs));
    ops_compare(t, "rope_ex", shape, ry, dy, ny);
    ops_release(t);
}

/* attention with other geometries: MLA (every head over one latent row, the value its first v_dim floats, the
 * cache written without values) and GQA with sinks and a window. */
static void check_attention_ex(struct ops_ctx *t, int pos0, int n, int n_head, int n_kv, int k_dim,
                               int v_dim, int mla, int sinks, int window)
{
    char shape[80];
    snprintf(shape, sizeof shape, "p0=%d n=%d h=%d/%d k=%d v=%d%s%s w=%d", pos0, n, n_head, n_kv,
             k_dim, v_dim, mla ? " mla" : "", sinks ? " sinks" : "", window);
    int bs = 8, k_row = n_kv * k_dim, v_row = mla ? k_row : n_kv * v_dim;
    int n_blocks = (pos0 + n + bs - 1) / bs + 2;
    size_t kc_n = (size_t)n_blocks * bs * k_row, vc_n = (size_t)n_blocks * bs * v_row;
    size_t qn = (size_t)n * n_head * k_dim, on = (size_t)n * n_head * v_dim;
    int32_t *bt = ops_block_table(t, 0, n_blocks);
    float *rq, *dq, *rkc, *dkc, *rvc = NULL, *dvc = NULL, *ro, *dout, *rk, *dk, *rs = NULL,
                                                                       *ds = NULL;
    int32_t *rb, *db;
    BOTH(ops_rand(t, qn, -1, 1), sizeof(float) * qn, rq, dq);
    BOTH(ops_rand(t, kc_n, -1, 1), sizeof(float) * kc_n, rkc, dkc);
    if (!mla) BOTH(ops_rand(t, vc_n, -1, 1), sizeof(float) * vc_n, rvc, dvc);
    BOTH(ops_rand(t, (size_t)n * k_row, -1, 1), sizeof(float) * n * k_row, rk, dk);
    BOTH(bt, sizeof(int32_t) * n_blocks, rb, db);
    BOTH(NULL, sizeof(float) * on, ro, dout);
    if (sinks) BOTH(ops_rand(t, (size_t)n_head, -1, 3), sizeof(float) * n_head, rs, ds);
    struct be_tokens rt = {.tables = rb, .pos0 = pos0}, dt = {.tables = db, .pos0 = pos0};
    struct be_attn ra = {.n_head = n_head, .n_kv_head = n_kv, .k_dim = k_dim, .v_dim = v_dim,
                        .k_row = k_row, .v_row = v_row, .window = window, .scale = 0.1f,
                        .sinks = rs},
                   da = ra;
    da.sinks = ds;
    int kg = mla ? k_row : k_dim, vg = mla ? k_row : v_dim;
    struct be_kv rkv = f32_kv(rkc, mla ? rkc : rvc, kg, vg);
    struct be_kv dkv = f32_kv(dkc, mla ? dkc : dvc, kg, vg);
    if (mla) /* the latent rows of this step, keys only */
        RUN2(t->ref->ops->kv_write(t->ref, &rkv, rk, NULL, &rt, bs, n, k_row),
             t->dut->ops->kv_write(t->dut, &dkv, dk, NULL, &dt, bs, n, k_row));
    RUN2(t->ref->ops->attention(t->ref, ro, rq, &rkv, &rt, bs, n, &ra),
         t->dut->ops->attention(t->dut, dout, dq, &dkv, &dt, bs, n, &da));
    if (mla) ops_compare(t, "kv_write (keys)", shape, rkc, dkc, kc_n);
    ops_compare(t, "attention (ex)", shape, ro, dout, on);
    ops_release(t);
}

static void check_layernorm_ld(struct ops_ctx *t, int n, int d, int ldx, int ldy)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d d=%d ldx=%d ldy=%d", n, d, ldx, ldy);
    float *rx, *dx, *ry, *dy, *rw, *dw, *rb, *db;
    BOTH(ops_rand(t, (size_t)n * ldx, -2, 3), sizeof(float) * n * ldx, rx, dx);
    BOTH(ops_rand(t, (size_t)n * ldy, -1, 1), sizeof(float) * n * ldy, ry, dy);
    BOTH(ops_rand(t, (size_t)d, 0.5f, 1.5f), sizeof(float) * d, rw, dw);
    BOTH(ops_rand(t, (size_t)d, -0.5f, 0.5f), sizeof(float) * d, rb, db);
    RUN2(t->ref->ops->layernorm_ld(t->ref, ry + 1, ldy, rx, ldx, rw, rb, n, d, 1e-6f),
         t->dut->ops->layernorm_ld(t->dut, dy + 1, ldy, dx, ldx, dw, db, n, d, 1e-6f));
    ops_compare(t, "layernorm_ld", shape, ry, dy, (size_t)n * ldy);
    ops_release(t);
}

/* Both backends' int32 outputs of `count` equal; one table row. */
static void ops_compare_int(struct ops_ctx *t, const char *op, const char *shape,
                            const int32_t *r_dev, const int32_t *d_dev, size_t count)
{
    int32_t *r = ops_host(t, sizeof(int32_t) * (count ? count : 1));
    int32_t *d = ops_host(t, sizeof(int32_t) * (count ? count : 1));
    if (t->oom || !r || !d) {
        CHECKF(0, "%s %s: out of memory setting up the check", op, shape);
        return;
    }
    t->ref->ops->download(t->ref, r, r_dev, sizeof(int32_t) * count);
    t->dut->ops->download(t->dut, d, d_dev, sizeof(int32_t) * count);
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += r[i] != d[i];
    printf("%-16s %-34s %10zu %10s  %s\n", op, shape, bad, "differ", bad ? "FAIL" : "ok");
    CHECKF(bad == 0, "%s %s: %zu of %zu entries differ", op, shape, bad, count);
}

/* DeepSeek sparse attention: the indexer's selection over a cache of MLA rows with the index
 * key at k_off (written through kv_write), then attention over the selected positions of one
 * latent row. n tokens at pos0.. select topk of their [0, pos]; the selections must be equal,
 * and the attention outputs within tolerance. */
static void check_dsa(struct ops_ctx *t, int pos0, int n, int n_head, int dim, int topk,
                      int lat, int n_qh)
{
    char shape[80];
    snprintf(shape, sizeof shape, "p0=%d n=%d ih=%d d=%d k=%d lat=%d", pos0, n, n_head, dim, topk,
             lat);
    int bs = 16, row = lat + dim, P = pos0 + n, n_blocks = (P + bs - 1) / bs + 2;
    size_t cache_n = (size_t)n_blocks * bs * row, qn = (size_t)n * n_head * dim;
    size_t aq = (size_t)n * n_qh * lat;
    int32_t *bt = ops_block_table(t, 0, n_blocks);
    float *rk, *dk, *rkc, *dkc, *rq, *dq, *rw, *dw, *raq, *daq, *ro, *dout;
    int32_t *rb, *db, *rs, *ds, *rn, *dn;
    BOTH(ops_rand(t, (size_t)P * row, -1, 1), sizeof(float) * P * row, rk, dk);
    BOTH(NULL, sizeof(float) * cache_n, rkc, dkc);
    BOTH(ops_rand(t, qn, -1, 1), sizeof(float) * qn, rq, dq);
    BOTH(ops_rand(t, (size_t)n * n_head, -1, 1), sizeof(float) * n * n_head, rw, dw);
    BOTH(ops_rand(t, aq, -1, 1), sizeof(float) * aq, raq, daq);
    BOTH(NULL, sizeof(float) * aq, ro, dout);
    BOTH(bt, sizeof(int32_t) * n_blocks, rb, db);
    BOTH(NULL, sizeof(int32_t) * n * topk, rs, ds);
    BOTH(NULL, sizeof(int32_t) * n, rn, dn);
    struct be_tokens rall = {.tables = rb, .pos0 = 0}, dall = {.tables = db, .pos0 = 0};
    struct be_tokens rt = {.tables = rb, .pos0 = pos0}, dt = {.tables = db, .pos0 = pos0};
    struct be_kv rkv = f32_kv(rkc, rkc, row, row), dkv = f32_kv(dkc, dkc, row, row);
    struct be_dsa p = {.n_head = n_head, .dim = dim, .k_off = lat, .k_row = row, .topk = topk,
                       .scale = 1.0f / sqrtf((float)dim)};
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rk, NULL, &rall, bs, P, row),
         t->dut->ops->kv_write(t->dut, &dkv, dk, NULL, &dall, bs, P, row));
    RUN2(t->ref->ops->dsa_select(t->ref, rs, rn, rq, rw, &rkv, &rt, bs, n, &p),
         t->dut->ops->dsa_select(t->dut, ds, dn, dq, dw, &dkv, &dt, bs, n, &p));
    /* each backend attends with its own selection: equal selections, equal attention */
    struct be_attn ra = {.n_head = n_qh, .n_kv_head = 1, .k_dim = lat, .v_dim = lat,
                         .k_row = row, .v_row = row, .scale = 0.1f, .sel = rs, .sel_n = rn,
                         .sel_stride = topk},
                   da = ra;
    da.sel = ds, da.sel_n = dn;
    RUN2(t->ref->ops->attention(t->ref, ro, raq, &rkv, &rt, bs, n, &ra),
         t->dut->ops->attention(t->dut, dout, daq, &dkv, &dt, bs, n, &da));
    ops_compare_int(t, "dsa_select (n)", shape, rn, dn, (size_t)n);
    ops_compare_int(t, "dsa_select", shape, rs, ds, (size_t)n * topk);
    ops_compare(t, "attention (sel)", shape, ro, dout, aq);
    ops_release(t);
}

/* --- DeepSeek-V4 ---------------------------------------------------------------------------- */

/* The reference output holds some non-zero value (a check whose reference is all zeros, e.g.
 * from scratch reserved too small, would compare nothing). */
static void ops_nonzero(struct ops_ctx *t, const char *op, const char *shape, const float *r_dev,
                        size_t count)
{
    float *r = ops_host(t, sizeof(float) * (count ? count : 1));
    if (t->oom || !r) return; /* ops_compare reported it */
    t->ref->ops->download(t->ref, r, r_dev, sizeof(float) * count);
    size_t nz = 0;
    for (size_t i = 0; i < count; i++) nz += r[i] != 0.0f;
    CHECKF(nz > 0, "%s %s: the reference output is all zeros", op, shape);
}

/* hc_pre: the mixes of n tokens over S streams of d; head: the final collapse (pre only). */
static void check_hc_pre(struct ops_ctx *t, int n, int S, int d, int iters, int head)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d S=%d d=%d it=%d%s", n, S, d, iters, head ? " head" : "");
    int parts = head ? S : S * (2 + S);
    size_t xn = (size_t)n * S * d, yn = (size_t)n * d, mn = (size_t)n * parts;
    float *rx, *dx, *rm, *dm, *rb, *db, *rs, *ds, *ry, *dy, *rp, *dp, *rc, *dc;
    BOTH(ops_rand(t, xn, -1, 1), sizeof(float) * xn, rx, dx);
    BOTH(ops_rand(t, mn, -3, 3), sizeof(float) * mn, rm, dm);
    BOTH(ops_rand(t, (size_t)parts, -1, 1), sizeof(float) * parts, rb, db);
    BOTH(ops_rand(t, 3, 0.2f, 1.5f), sizeof(float) * 3, rs, ds);
    BOTH(NULL, sizeof(float) * yn, ry, dy);
    BOTH(NULL, sizeof(float) * n * S, rp, dp);
    BOTH(NULL, sizeof(float) * n * S * S, rc, dc);
    struct be_hc rh = {.n_stream = S, .iters = iters, .eps = 1e-6f, .base = rb, .scale = rs};
    struct be_hc dh = {.n_stream = S, .iters = iters, .eps = 1e-6f, .base = db, .scale = ds};
    RUN2(t->ref->ops->hc_pre(t->ref, head ? NULL : rp, head ? NULL : rc, ry, rx, rm, n, d, &rh),
         t->dut->ops->hc_pre(t->dut, head ? NULL : dp, head ? NULL : dc, dy, dx, dm, n, d, &dh));
    ops_compare(t, "hc_pre", shape, ry, dy, yn);
    if (!head) {
        ops_compare(t, "hc_pre (post)", shape, rp, dp, (size_t)n * S);
        ops_compare(t, "hc_pre (comb)", shape, rc, dc, (size_t)n * S * S);
    }
    ops_release(t);
}

static void check_hc_post(struct ops_ctx *t, int n, int S, int d)
{
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d S=%d d=%d", n, S, d);
    size_t xn = (size_t)n * S * d;
    float *rx, *dx, *ro, *dout, *rp, *dp, *rc, *dc, *ry, *dy;
    BOTH(ops_rand(t, xn, -1, 1), sizeof(float) * xn, rx, dx);
    BOTH(ops_rand(t, (size_t)n * d, -1, 1), sizeof(float) * n * d, ro, dout);
    BOTH(ops_rand(t, (size_t)n * S, 0, 2), sizeof(float) * n * S, rp, dp);
    BOTH(ops_rand(t, (size_t)n * S * S, 0, 1), sizeof(float) * n * S * S, rc, dc);
    BOTH(NULL, sizeof(float) * xn, ry, dy);
    RUN2(t->ref->ops->hc_post(t->ref, ry, rx, ro, rp, rc, n, d, S),
         t->dut->ops->hc_post(t->dut, dy, dx, dout, dp, dc, n, d, S));
    ops_compare(t, "hc_post", shape, ry, dy, xn);
    ops_release(t);
}

/* A RoPE table (max_pos, half, 2) of cosines and sines of random angles. */
static float *ops_cos_sin(struct ops_ctx *t, int max_pos, int half)
{
    size_t m = (size_t)max_pos * (half > 0 ? half : 1);
    float *cs = ops_host(t, sizeof(float) * 2 * m);
    if (cs)
        for (size_t j = 0; j < m; j++) {
            float a = ops_uniform(t, -3.14159f, 3.14159f);
            cs[2 * j] = cosf(a);
            cs[2 * j + 1] = sinf(a);
        }
    return cs;
}

/* v4_compress: n tokens at pos0.. over a cache of random rows (through kv_write, in `type`)
 * holding each position's compressor kv and gate channels; tokens that close a window get its
 * entry, the others (a partial tail among them) zeros; rows of out are ldo = c + 3 apart, the
 * gap left as it was. overlap: CSA's two halves over 2 rate slots. */
static void check_v4_compress(struct ops_ctx *t, int pos0, int n, int rate, int c, int overlap,
                              int rot, enum be_kv_type type)
{
    char shape[80];
    snprintf(shape, sizeof shape, "p0=%d n=%d rate=%d c=%d%s rot=%d %s", pos0, n, rate, c,
             overlap ? " ovl" : "", rot, engine_kv_type_name(type));
    int bs = 16, halves = overlap ? 2 : 1, kv_off = 3, gate_off = kv_off + halves * c;
    int row = gate_off + halves * c + 5, P = pos0 + n, n_blocks = (P + bs - 1) / bs + 2;
    int ldo = c + 3;
    size_t on = (size_t)n * ldo;
    int32_t *bt = ops_block_table(t, 0, n_blocks);
    float *rows = ops_rand(t, (size_t)P * row, -2, 2);
    float *rr, *dr, *rbias, *dbias, *rnorm, *dnorm, *rcs, *dcs, *ro, *dout;
    int32_t *rb, *db;
    BOTH(rows, sizeof(float) * P * row, rr, dr);
    BOTH(ops_rand(t, (size_t)rate * halves * c, -1, 1), sizeof(float) * rate * halves * c, rbias,
         dbias);
    BOTH(ops_rand(t, (size_t)c, 0.5f, 1.5f), sizeof(float) * c, rnorm, dnorm);
    BOTH(ops_cos_sin(t, P, rot / 2), sizeof(float) * P * (rot > 0 ? rot : 2), rcs, dcs);
    BOTH(ops_rand(t, on, -1, 1), sizeof(float) * on, ro, dout);
    BOTH(bt, sizeof(int32_t) * n_blocks, rb, db);
    struct be_kv rkv = typed_kv(t->ref, type, n_blocks, bs, row, row);
    struct be_kv dkv = typed_kv(t->dut, type, n_blocks, bs, row, row);
    if (!rkv.k || !dkv.k) t->oom = 1;
    struct be_tokens rall = {.tables = rb, .pos0 = 0}, dall = {.tables = db, .pos0 = 0};
    struct be_tokens rt = {.tables = rb, .pos0 = pos0}, dt = {.tables = db, .pos0 = pos0};
    struct be_v4cmp rp = {.rate = rate, .c = c, .overlap = overlap, .kv_off = kv_off,
                          .gate_off = gate_off, .k_row = row, .bias = rbias, .norm = rnorm,
                          .eps = 1e-6f, .rot_dim = rot, .cos_sin = rcs},
                    dp = rp;
    dp.bias = dbias, dp.norm = dnorm, dp.cos_sin = dcs;
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rr, NULL, &rall, bs, P, row),
         t->dut->ops->kv_write(t->dut, &dkv, dr, NULL, &dall, bs, P, row));
    RUN2(t->ref->ops->v4_compress(t->ref, ro, ldo, &rkv, &rt, bs, n, &rp),
         t->dut->ops->v4_compress(t->dut, dout, ldo, &dkv, &dt, bs, n, &dp));
    ops_compare(t, "v4_compress", shape, ro, dout, on);
    /* every token that closes a window has an entry (the reference's is not zero) */
    float *h = ops_host(t, sizeof(float) * on);
    if (!t->oom && h) {
        t->ref->ops->download(t->ref, h, ro, sizeof(float) * on);
        int closing = 0, empty = 0;
        for (int i = 0; i < n; i++) {
            if ((pos0 + i + 1) % rate) continue;
            int nz = 0;
            for (int k = 0; k < c; k++) nz += h[(size_t)i * ldo + k] != 0.0f;
            closing++;
            empty += nz == 0;
        }
        CHECKF(closing > 0 && empty == 0, "v4_compress %s: %d of %d entries all zeros", shape,
               empty, closing);
    }
    ops_release(t);
    if (rkv.k) kv_layer_free(t->ref, &rkv);
    if (dkv.k) kv_layer_free(t->dut, &dkv);
}

enum { V4_SLIDING, V4_CSA, V4_HCA };

/* v4_attention of one layer kind for a whole step: n_seq sequences of up to len positions in
 * one (n_seq, stride) block table, each with a prefill chunk or one decode token at a random
 * position (so most sit inside a window that is not complete: its entry is not attended).
 * Rows: the key (dim), the compressed entry (dim at ent_off = dim) and the indexer's key (idim
 * at 2 dim), random, written through kv_write in `type`. CSA: dsa_select with V4's rate picks
 * topk of the completed entries on each backend (the selections must be equal), and each
 * attends with its own; HCA: every completed entry; sliding: the window only. */
static void check_v4_attention(struct ops_ctx *t, int kind, int n_seq, int len, int n_head,
                               int dim, int window, int rate, int topk, int idim,
                               enum be_kv_type type)
{
    static const char *const kinds[] = {"sliding", "csa", "hca"};
    char shape[80];
    snprintf(shape, sizeof shape, "%s seqs=%d len=%d h=%d d=%d w=%d r=%d k=%d %s", kinds[kind],
             n_seq, len, n_head, dim, window, kind ? rate : 0, kind == V4_CSA ? topk : 0,
             engine_kv_type_name(type));
    int bs = 16, row = 2 * dim + idim, stride = (len + bs - 1) / bs, n_blocks = n_seq * stride;
    int i_heads = 4;
    int32_t *tables = ops_host(t, sizeof(int32_t) * n_blocks);
    int32_t *seq = ops_host(t, sizeof(int32_t) * n_seq * 8), *pos = ops_host(t, sizeof(int32_t) * n_seq * 8);
    int32_t *all_seq = ops_host(t, sizeof(int32_t) * n_seq * len);
    int32_t *all_pos = ops_host(t, sizeof(int32_t) * n_seq * len);
    int n = 0, n_all = n_seq * len;
    if (tables && seq && pos && all_seq && all_pos)
        n = paged_steps(t, n_seq, len, n_blocks, true, tables, seq, pos, all_seq, all_pos);
    size_t qn = (size_t)n * n_head * dim, iq = (size_t)n * i_heads * idim;
    size_t all_n = (size_t)n_all * row;
    float *rq, *dq, *rrows, *drows, *ro, *dout, *rsk, *dsk, *riq, *diq, *riw, *diw;
    int32_t *rtb, *dtb, *rs, *ds, *rp, *dp, *ras, *das, *rap, *dap, *rsel, *dsel, *rsn, *dsn;
    BOTH(ops_rand(t, qn, -1, 1), sizeof(float) * qn, rq, dq);
    BOTH(ops_rand(t, all_n, -1, 1), sizeof(float) * all_n, rrows, drows);
    BOTH(ops_rand(t, (size_t)n_head, -1, 2), sizeof(float) * n_head, rsk, dsk);
    BOTH(ops_rand(t, iq, -1, 1), sizeof(float) * (iq ? iq : 1), riq, diq);
    BOTH(ops_rand(t, (size_t)n * i_heads, -1, 1), sizeof(float) * n * i_heads, riw, diw);
    BOTH(tables, sizeof(int32_t) * n_blocks, rtb, dtb);
    BOTH(seq, sizeof(int32_t) * n, rs, ds);
    BOTH(pos, sizeof(int32_t) * n, rp, dp);
    BOTH(all_seq, sizeof(int32_t) * n_all, ras, das);
    BOTH(all_pos, sizeof(int32_t) * n_all, rap, dap);
    BOTH(NULL, sizeof(int32_t) * n * (topk > 0 ? topk : 1), rsel, dsel);
    BOTH(NULL, sizeof(int32_t) * n, rsn, dsn);
    BOTH(NULL, sizeof(float) * qn, ro, dout);
    struct be_kv rkv = typed_kv(t->ref, type, n_blocks, bs, row, row);
    struct be_kv dkv = typed_kv(t->dut, type, n_blocks, bs, row, row);
    if (!rkv.k || !dkv.k) t->oom = 1;
    struct be_tokens rt = {rtb, stride, rs, rp, 0}, dt = {dtb, stride, ds, dp, 0};
    struct be_tokens rat = {rtb, stride, ras, rap, 0}, dat = {dtb, stride, das, dap, 0};
    RUN2(t->ref->ops->kv_write(t->ref, &rkv, rrows, NULL, &rat, bs, n_all, row),
         t->dut->ops->kv_write(t->dut, &dkv, drows, NULL, &dat, bs, n_all, row));
    struct be_v4attn ra = {.n_head = n_head, .dim = dim, .k_row = row, .window = window,
                           .rate = kind == V4_SLIDING ? 0 : rate, .ent_off = dim,
                           .scale = 1.0f / sqrtf((float)dim), .sinks = rsk},
                     da = ra;
    da.sinks = dsk;
    if (kind == V4_CSA) {
        struct be_dsa p = {.n_head = i_heads, .dim = idim, .k_off = 2 * dim, .k_row = row,
                           .topk = topk, .scale = 1.0f / sqrtf((float)idim), .rate = rate};
        RUN2(t->ref->ops->dsa_select(t->ref, rsel, rsn, riq, riw, &rkv, &rt, bs, n, &p),
             t->dut->ops->dsa_select(t->dut, dsel, dsn, diq, diw, &dkv, &dt, bs, n, &p));
        ops_compare_int(t, "dsa_select (v4 n)", shape, rsn, dsn, (size_t)n);
        /* only the listed entries (sel_n of them, or none where sel_n is -1) are defined */
        int32_t *hn = ops_host(t, sizeof(int32_t) * (n ? n : 1));
        int32_t *hr = ops_host(t, sizeof(int32_t) * n * topk);
        int32_t *hd = ops_host(t, sizeof(int32_t) * n * topk);
        if (!t->oom) {
            t->ref->ops->download(t->ref, hn, rsn, sizeof(int32_t) * n);
            t->ref->ops->download(t->ref, hr, rsel, sizeof(int32_t) * n * topk);
            t->dut->ops->download(t->dut, hd, dsel, sizeof(int32_t) * n * topk);
            size_t bad = 0, listed = 0;
            for (int i = 0; i < n; i++)
                for (int j = 0; j < hn[i]; j++, listed++)
                    bad += hr[(size_t)i * topk + j] != hd[(size_t)i * topk + j];
            printf("%-16s %-34s %10zu %10s  %s\n", "dsa_select (v4)", shape, bad, "differ",
                   bad ? "FAIL" : "ok");
            CHECKF(bad == 0, "dsa_select (v4) %s: %zu of %zu entries differ", shape, bad, listed);
        }
        ra.sel = rsel, ra.sel_n = rsn, ra.sel_stride = topk;
        da.sel = dsel, da.sel_n = dsn, da.sel_stride = topk;
    }
    RUN2(t->ref->ops->v4_attention(t->ref, ro, rq, &rkv, &rt, bs, n, &ra),
         t->dut->ops->v4_attention(t->dut, dout, dq, &dkv, &dt, bs, n, &da));
    ops_compare(t, "v4_attention", shape, ro, dout, qn);
    ops_nonzero(t, "v4_attention", shape, ro, qn);
    ops_release(t);
    if (rkv.k) kv_layer_free(t->ref, &rkv);
    if (dkv.k) kv_layer_free(t->dut, &dkv);
}

static void check_all_ops(struct ops_ctx *t)
{
    printf("%-16s %-34s %10s %10s  %s\n", "op", "shape", "rel_err", "max_abs", "result");
    check_matmul(t, 1, 256, 384, 0);
    check_matmul(t, 7, 130, 65, 1);
    check_matmul(t, 64, 512, 1024, 1);
    check_matmul_multi(t, 1, 64);
    check_matmul_multi(t, 5, 100);
    check_rmsnorm(t, 5, 1000, 0);
    check_rmsnorm(t, 132, 128, 1);
    check_rope(t, 6, 5, 64, 100);
    check_rope(t, 3, 2, 128, 4096);
    check_elementwise(t, 9, 777);
    check_elementwise(t, 1, 4096);
    check_rows(t, 40, 25, 129);
    check_rows(t, 1000, 7, 2048);
    check_route(t, 37, BE_ROUTE_SOFTMAX_TOPK, 8, 2, 0, 0);
    check_route(t, 300, BE_ROUTE_SOFTMAX_TOPK, 64, 8, 0, 0);
    check_route(t, 50, BE_ROUTE_MOHGE, 48, 6, 3, 2);
    check_route(t, 9, BE_ROUTE_MOHGE, 16, 4, 4, 1);
    check_route(t, 200, BE_ROUTE_SIGMOID_GROUP, 64, 8, 8, 4);
    check_route(t, 17, BE_ROUTE_SIGMOID_GROUP, 32, 4, 4, 2);
    check_moe_experts(t, 6, 64, 20, 0);
    check_moe_experts(t, 40, 256, 9, 0);
    check_moe_experts(t, 8, 64, 12, 1);
    check_neuron_ffn(t, 1, 64, 256, 96);
    check_neuron_ffn(t, 7, 192, 300, 64);
    check_neuron_ffn(t, 24, 192, 300, 64); /* the CPU reference neuron-major */
    check_matmul_mxfp4(t, 3, 96, 40);
    check_matmul_mxfp4(t, 20, 256, 64);
    check_moe_combine(t, 10, 4, 30, 200);
    check_moe_combine(t, 3, 8, 24, 1024);
    check_kv_write(t, 16, 2, 64, 21, 30);
    check_kv_write(t, 8, 1, 128, 0, 1);
    check_attention(t, 37, 1, 8, 2, 64, 16, 0, 0.125f);    /* decode, GQA */
    check_attention(t, 0, 19, 4, 4, 256, 8, 0, 0.0625f);   /* prefill, 2 dims per thread */
    check_attention(t, 50, 12, 6, 2, 96, 16, 20, 0.1f);    /* prefill chunk, window */
    check_attention(t, 3000, 2, 4, 1, 128, 32, 0, 1.0f);   /* 3 score chunks, MQA */
    check_attention(t, 2500, 1, 2, 2, 64, 16, 1500, 0.5f); /* long window */
    check_attention_batch(t, 7, 4, 2, 64, 16, BE_KV_F32);
    check_attention_batch(t, 40, 8, 1, 128, 8, BE_KV_F32);
    for (int type = BE_KV_BF16; type < BE_KV_N_TYPES; type++) /* every stored type */
        check_attention_batch(t, 9, 4, 2, 64, 16, (enum be_kv_type)type);
    check_matmul_ld(t, 5, 48, 64, 200, 150);
    check_matmul_ld(t, 33, 128, 512, 1152, 2304);
    check_rmsnorm_ld(t, 7, 512, 576);
    check_rope_ex(t, 6, 1, 576, 576, 64, 1, 100);   /* MLA rope key in the latent row */
    check_rope_ex(t, 5, 16, 192, 576, 64, 1, 100);  /* MLA query rope part into qlat */
    check_rope_ex(t, 4, 8, 64, 64, 64, 0, 300);     /* rotate-half, in its own layout */
    check_attention_ex(t, 30, 1, 16, 1, 576, 512, 1, 0, 0); /* MLA decode, V3 widths */
    check_attention_ex(t, 0, 13, 4, 1, 48, 32, 1, 0, 0);    /* MLA prefill */
    check_attention_ex(t, 40, 6, 8, 2, 64, 64, 0, 1, 16);   /* sinks, sliding window */
    check_attention_ex(t, 200, 1, 4, 4, 64, 64, 0, 1, 0);   /* sinks, decode */
    check_layernorm_ld(t, 9, 128, 704, 130);                /* the index key in its row */
    check_dsa(t, 0, 40, 4, 32, 8, 48, 4);    /* prefill: the first 8 positions attend to all */
    check_dsa(t, 300, 1, 8, 64, 32, 64, 16); /* decode at depth */
    check_dsa(t, 1100, 5, 4, 64, 500, 32, 2); /* a selection wider than the block */
    /* DeepSeek-V4 */
    check_hc_pre(t, 7, 4, 64, 20, 0);   /* the fixture's hc_mult 4, 20 Sinkhorn steps */
    check_hc_pre(t, 3, 16, 200, 1, 0);  /* the widest hc_mult, one round (columns only) */
    check_hc_pre(t, 5, 4, 96, 0, 1);    /* hc_head's collapse */
    check_hc_post(t, 7, 4, 64);
    check_hc_post(t, 2, 16, 300);
    check_v4_compress(t, 0, 23, 4, 32, 1, 8, BE_KV_F32);   /* CSA, w = 0 alone, tail 20..22 */
    check_v4_compress(t, 5, 30, 8, 64, 0, 16, BE_KV_F32);  /* HCA, tail 32..34 partial */
    check_v4_compress(t, 39, 1, 8, 64, 0, 16, BE_KV_F32);  /* decode closing a window */
    check_v4_compress(t, 61, 6, 4, 128, 1, 64, BE_KV_BF16); /* 64..66 a partial tail */
    check_v4_compress(t, 0, 40, 8, 48, 1, 8, BE_KV_INT8);
    check_v4_attention(t, V4_SLIDING, 7, 96, 4, 32, 8, 0, 0, 16, BE_KV_F32);
    check_v4_attention(t, V4_CSA, 7, 96, 4, 32, 8, 4, 3, 16, BE_KV_F32);
    check_v4_attention(t, V4_HCA, 7, 96, 4, 32, 8, 8, 0, 16, BE_KV_F32);
    check_v4_attention(t, V4_CSA, 9, 300, 8, 128, 32, 4, 20, 64, BE_KV_F32);
    check_v4_attention(t, V4_HCA, 4, 700, 2, 512, 128, 16, 0, 16, BE_KV_F32); /* 4 dims each */
    check_v4_attention(t, V4_CSA, 5, 96, 4, 64, 8, 4, 3, 16, BE_KV_BF16);
    check_v4_attention(t, V4_HCA, 5, 96, 4, 64, 8, 8, 0, 16, BE_KV_INT8);
    check_v4_attention(t, V4_SLIDING, 2, 4600, 2, 64, 4500, 0, 0, 16, BE_KV_F32); /* 2 chunks */
}

#ifdef MOESERVE_HAVE_NCCL
/* One rank exchanging rows with itself through NCCL: counts and bytes come back intact. */
static void check_nccl_self(struct backend *be)
{
    char err[512] = "";
    int dev = backend_cuda_device(be);
    struct comm *c = comm_nccl_create(1, &dev, err, sizeof err);
    CHECKF(c != NULL, "comm_nccl_create: %s", err);
    if (!c) return;
    enum { ROWS = 5, ROW_BYTES = 24 };
    unsigned char h[ROWS * ROW_BYTES], back[ROWS * ROW_BYTES];
    for (int i = 0; i < ROWS * ROW_BYTES; i++)
        h[i] = (unsigned char)(i * 7 + 3);
    void *send = be->ops->alloc(be, sizeof h), *recv = be->ops->alloc(be, sizeof h);
    if (send && recv) {
        int send_counts[1] = {ROWS}, recv_counts[1] = {-1};
        be->ops->upload(be, send, h, sizeof h);
        be->ops->synchronize(be);
        int rc = c->ops->all_to_all_v(c, 0, send, send_counts, recv, recv_counts, ROW_BYTES);
        if (rc < 0) comm_nccl_error(c, 0, err, sizeof err);
        CHECKF(rc == 0, "nccl all_to_all_v: %s", err);
        CHECK(recv_counts[0] == ROWS);
        be->ops->download(be, back, recv, sizeof back);
        int same = memcmp(h, back, sizeof h) == 0;
        CHECK(same);
        c->ops->barrier(c, 0);
        printf("%-16s %-34s %10s %10s  %s\n", "nccl a2a (self)", "5 rows x 24 B", "-", "-",
               rc == 0 && same && recv_counts[0] == ROWS ? "ok" : "FAIL");
    }
    if (send) be->ops->free(be, send);
    if (recv) be->ops->free(be, recv);
    c->ops->destroy(c);
}
#endif

int main(int argc, char **argv)
{
    int self_check = argc > 2 && strcmp(argv[2], "--cpu-self-check") == 0;
    struct ops_ctx t = {0};
    t.rng = 0x9e3779b97f4a7c15ull;
    t.ref = backend_cpu_create(1, false);
    CHECK(t.ref != NULL);
    if (!t.ref) return test_done("test_backend_ops");
    CHECK(t.ref->ops->reserve(t.ref, &ops_reserve) == 0);

    if (self_check) {
        printf("self-check: CPU backend vs a second CPU backend (harness only, no GPU)\n");
        t.dut = backend_cpu_create(1, false);
        CHECK(t.dut != NULL);
        if (t.dut) {
            CHECK(t.dut->ops->reserve(t.dut, &ops_reserve) == 0);
            check_all_ops(&t);
            t.dut->ops->destroy(t.dut);
        }
        t.ref->ops->destroy(t.ref);
        return test_done("test_backend_ops");
    }

#ifdef MOESERVE_HAVE_CUDA
    if (backend_cuda_device_count() == 0) {
        char err[512] = "";
        struct backend *none = backend_cuda_create(0, err, sizeof err);
        CHECK(none == NULL); /* and it must not crash */
        printf("SKIP: no CUDA device\n(backend_cuda_create: %s)\n", err);
        t.ref->ops->destroy(t.ref);
        return 77;
    }
    char err[512] = "";
    t.dut = backend_cuda_create(0, err, sizeof err);
    CHECKF(t.dut != NULL, "backend_cuda_create: %s", err);
    if (t.dut && t.dut->ops->reserve(t.dut, &ops_reserve) != 0) {
        t.dut->ops->synchronize(t.dut);
        backend_cuda_error(t.dut, err, sizeof err);
        CHECKF(0, "reserve: %s", err);
        t.dut->ops->destroy(t.dut);
    } else if (t.dut) {
        printf("CUDA backend on device 0 vs CPU reference (tolerance %.0e f32, %.0e bf16)\n",
               OPS_TOL, OPS_TOL_BF16);
        check_all_ops(&t);
        t.dut->ops->synchronize(t.dut);
        int rc = backend_cuda_error(t.dut, err, sizeof err);
        CHECKF(rc == 0, "CUDA backend recorded an error: %s", err);
#ifdef MOESERVE_HAVE_NCCL
        check_nccl_self(t.dut);
#endif
        t.dut->ops->destroy(t.dut);
    }
    t.ref->ops->destroy(t.ref);
    return test_done("test_backend_ops");
#else
    (void)argv;
    printf("SKIP: no CUDA device (built without MOESERVE_HAVE_CUDA)\n");
    t.ref->ops->destroy(t.ref);
    return 77;
#endif
}
