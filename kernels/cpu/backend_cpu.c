/* CPU backend: the reference implementation of every op in kernels/backend.h. Matrix
 * products, expert FFNs and attention run on the backend's own thread pool (pool.c) with the
 * kernels chosen for this CPU (gemm.c: AVX-512, AVX2 or portable C), reading weights in their
 * stored type (f32, f16, bf16 in place; int8/int4 quantized at load) with f32 accumulation.
 * The rest (norms, RoPE, routing, copies) is plain C on the calling thread: it is a small share
 * of a step. Ops do not allocate: prepared activations and per-thread scratch come from
 * reserve. */
#include "backend.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common.h"
#include "cpu/flash.h"
#include "cpu/gemm.h"
#include "cpu/dsa.h"
#include "cpu/ssm.h"
#include "cpu/v4.h"
#include "cpu/pool.h"
#include "route_impl.h"

/* Weight rows of one matmul task, and of one expert task (multiples of WQ_TILE). */
#define EXPERT_CHUNK 64

struct cpu_backend {
    struct backend base;
    struct pool *pool;
    const struct gemm_kernels *kk;
    bool bf16;
    bool int8_mx;         /* MXFP4 weights take int8 activations (backend_cpu_set_int8_mxfp4) */
    int n_threads;
    /* reserve(): two prepared-activation buffers (an op's input; the experts' hidden rows) */
    unsigned char *act[2];
    size_t act_bytes;
    float *tmp;           /* (n_threads, max_rows * EXPERT_CHUNK) up-projection tiles */
    size_t tmp_per_thread;
    struct fa_work fa;    /* attention's tiles and split-K partials (kernels/cpu/flash.h) */
    int fa_ctx;           /* the longest context reserve was told of */
    struct dsa_work dsa;  /* the sparse-attention indexer's scores (kernels/cpu/dsa.h) */
    struct v4_work v4;    /* DeepSeek-V4's attention logits and rows (kernels/cpu/v4.h) */
    int *tasks;           /* (max_tasks, 3) expert task table: expert, first row, last row */
    int max_tasks;
    struct act *ex_act;   /* (max_experts) the experts' prepared hidden rows */
    size_t *ex_off;       /* (max_experts) their byte offsets in act[1] */
    size_t *ex_hoff;      /* (max_experts) offsets of their f32 hidden rows in `gate` */
    _Atomic int *ex_ready;/* (max_experts) 0: hidden rows not prepared, 1: being, 2: ready */
    int max_experts;
};

static inline struct cpu_backend *cpu_of(struct backend *be)
{
    return (struct cpu_backend *)be;
}

static void cpu_release(struct cpu_backend *b)
{
    free(b->act[0]);
    free(b->act[1]);
    free(b->tmp);
    fa_work_free(&b->fa);
    dsa_work_free(&b->dsa);
    v4_work_free(&b->v4);
    free(b->tasks);
    free(b->ex_act);
    free(b->ex_off);
    free(b->ex_hoff);
    free((void *)b->ex_ready);
    b->ex_hoff = NULL;
    b->ex_ready = NULL;
    b->act[0] = b->act[1] = NULL;
    b->tmp = NULL;
    b->tasks = NULL;
    b->ex_act = NULL;
    b->ex_off = NULL;
    b->act_bytes = b->tmp_per_thread = 0;
    b->max_tasks = b->max_experts = 0;
}

static void cpu_destroy(struct backend *be)
{
    struct cpu_backend *b = cpu_of(be);
    cpu_release(b);
    pool_free(b->pool);
    free(b);
}

/* Large buffers (the KV cache, weights converted at load, recurrent state) are streamed from
 * memory: they go on 2 MiB pages where the kernel allows it (transparent huge pages in madvise
 * mode), so that a stream crosses a page, the hardware prefetchers' limit, and takes a TLB miss
 * 512 times less often. */
#define CPU_HUGE_MIN ((size_t)4 << 20)
#define CPU_HUGE_PAGE ((size_t)2 << 20)

static void *cpu_alloc(struct backend *be, size_t bytes)
{
    void *p = NULL;
    if (bytes >= CPU_HUGE_MIN) {
        size_t rounded = (bytes + CPU_HUGE_PAGE - 1) / CPU_HUGE_PAGE * CPU_HUGE_PAGE;
        if (posix_memalign(&p, CPU_HUGE_PAGE, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
        madvise(p, rounded, MADV_HUGEPAGE); /* advice: refused or not, the memory is usable */
#endif
        return p;
    }
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

static void cpu_free(struct backend *be, void *p)
{
    free(p);
}

static void cpu_copy(struct backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
}

static void cpu_synchronize(struct backend *be)
{
}

static void *alloc64(size_t bytes)
{
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) == 0 ? p : NULL;
}

/* Bytes of prepared activations for rows of up to `elems` values in all (each row padded). */
static size_t act_bound(size_t elems, size_t rows)
{
    return 4 * (elems + rows * ACT_PAD) + 64;
}

static int cpu_reserve(struct backend *be, const struct be_reserve *r)
{
    struct cpu_backend *b = cpu_of(be);
    cpu_release(b);
    int E = r->max_experts > 0 ? r->max_experts : 1;
    size_t rows = (size_t)(r->max_rows > 0 ? r->max_rows : 1);
    b->act_bytes = act_bound(r->max_elems, rows) + 64 * (size_t)E;
    b->tmp_per_thread = rows * EXPERT_CHUNK;
    b->max_experts = E;
    b->max_tasks = 0;
    b->act[0] = alloc64(b->act_bytes);
    b->act[1] = alloc64(b->act_bytes);
    b->tmp = alloc64(sizeof(float) * b->tmp_per_thread * (size_t)b->n_threads);
    b->fa_ctx = r->max_ctx;
    int fa_fail = fa_work_reserve(&b->fa, b->n_threads, (int)rows, r->max_heads, r->max_k_dim,
                                  r->max_v_dim, r->max_kv_heads, r->max_ctx);
    b->ex_act = calloc((size_t)E, sizeof *b->ex_act);
    b->ex_off = calloc((size_t)E, sizeof *b->ex_off);
    b->ex_hoff = calloc((size_t)E, sizeof *b->ex_hoff);
    b->ex_ready = calloc((size_t)E, sizeof *b->ex_ready);
    int dsa_fail = r->dsa_dim > 0 ? dsa_work_reserve(&b->dsa, b->n_threads, r->max_ctx, r->dsa_dim,
                                                         r->dsa_heads > 0 ? r->dsa_heads : 64)
                                  : 0;
    int v4_fail = r->v4_row > 0 ? v4_work_reserve(&b->v4, b->n_threads, r->max_heads,
                                                  r->v4_window + r->max_ctx, r->v4_row)
                                : 0;
    if (!b->act[0] || !b->act[1] || !b->tmp || fa_fail || dsa_fail || v4_fail || !b->ex_act ||
        !b->ex_off ||
        !b->ex_hoff || !b->ex_ready) {
        cpu_release(b);
        return -1;
    }
    return 0;
}

/* Expert task tables grow with the widest expert, known only at the first call: sized then
 * (and never again for the same shapes), outside the per-token path of later steps. */
static int cpu_reserve_tasks(struct cpu_backend *b, int need)
{
    if (need <= b->max_tasks) return 0;
    int *t = realloc(b->tasks, sizeof(int) * 3 * (size_t)need);
    if (!t) return -1;
    b->tasks = t;
    b->max_tasks = need;
    return 0;
}

/* f32/f16/bf16 (and quantized) host matrices: the handle is the caller's wmat. */
static const struct wmat *cpu_weight_upload(struct backend *be, const struct wmat *host)
{
    return host;
}

static void cpu_weight_free(struct backend *be, const struct wmat *w)
{
}

/* --- matrix products ---------------------------------------------------------------------- */

/* The activations weights of type t read: the kernel table's choice, but int8 ones for MXFP4
 * when the backend was told so (--quantization: the faster int8 dot products). */
static enum act_kind cpu_act_kind(const struct cpu_backend *b, enum wtype t)
{
    return t == WTYPE_MXFP4 && b->int8_mx ? ACT_Q8 : b->kk->act_kind(t, b->bf16);
}

/* Under bf16 compute only bf16 weights take bf16 activations; others keep f32 ones. */
static int rounds_bf16(const struct cpu_backend *b, const struct wmat *w)
{
    return b->bf16 && w->type == WTYPE_BF16;
}

/* Weight rows per task: about four tasks per thread, whole tiles. */
static int row_chunk(int m, int n_threads)
{
    int tiles = (m + WQ_TILE - 1) / WQ_TILE;
    int per = tiles / (4 * n_threads);
    return (per > 0 ? per : 1) * WQ_TILE;
}

struct prep_job {
    const struct gemm_kernels *kk;
    enum act_kind kind;
    int bf16;
    const float *x;
    size_t ldx;
    int n, k, rows_per_task;
    void *buf;
    struct act out;
};

static void prep_task(void *ctx, int t, int thread)
{
    struct prep_job *j = ctx;
    int i0 = t * j->rows_per_task, i1 = i0 + j->rows_per_task < j->n ? i0 + j->rows_per_task : j->n;
    struct act a;
    j->kk->act_prepare(j->kind, j->bf16, j->x, j->ldx, j->n, j->k, i0, i1, j->buf, &a);
    if (t == 0) j->out = a;
}

/* x (n, k), rows ldx floats apart, into buf as the activations w's kernels read; over the pool
 * when large. */
static struct act prepare_ld(struct cpu_backend *b, const struct wmat *w, const float *x,
                             size_t ldx, int n, int k, void *buf)
{
    struct prep_job j = {.kk = b->kk, .kind = cpu_act_kind(b, w->type),
                         .bf16 = rounds_bf16(b, w),
                         .x = x, .ldx = ldx, .n = n, .k = k, .buf = buf};
    int tasks = (size_t)n * (size_t)k >= 32768 ? b->n_threads : 1;
    j.rows_per_task = (n + tasks - 1) / tasks;
    tasks = (n + j.rows_per_task - 1) / j.rows_per_task;
    pool_run(b->pool, prep_task, &j, tasks);
    return j.out;
}

static struct act prepare(struct cpu_backend *b, const struct wmat *w, const float *x, int n,
                          int k, void *buf)
{
    return prepare_ld(b, w, x, (size_t)k, n, k, buf);
}

struct mm_job {
    const struct gemm_kernels *kk;
    int count;
    const struct wmat *w[BE_MULTI_MAX];
    struct act a[BE_MULTI_MAX];
    float *y[BE_MULTI_MAX];
    size_t ldy[BE_MULTI_MAX];
    int chunk[BE_MULTI_MAX];
    int first[BE_MULTI_MAX + 1]; /* task number of each matrix's first chunk */
};

static void mm_task(void *ctx, int t, int thread)
{
    struct mm_job *j = ctx;
    int i = 0;
    while (t >= j->first[i + 1]) i++;
    int m = j->w[i]->rows, r0 = (t - j->first[i]) * j->chunk[i];
    int r1 = r0 + j->chunk[i] < m ? r0 + j->chunk[i] : m;
    j->kk->gemm(j->w[i], &j->a[i], j->y[i] + r0, j->ldy[i], r0, r1);
}

/* Products of x (n, k; rows ldx apart) with count matrices into y[i] (rows ldy[i] apart), plus
 * biases: one pool job for every matrix's rows, inputs prepared once per distinct preparation
 * (kind and rounding); act[1] holds a second preparation when the matrices need two. */
static void matmul_run(struct cpu_backend *b, int count, float *const *y, const size_t *ldy,
                       const float *x, size_t ldx, const struct wmat *const *w,
                       const float *const *bias, int n, int k)
{
    if (n <= 0 || count <= 0 || count > BE_MULTI_MAX) return;
    struct mm_job j = {.kk = b->kk, .count = count};
    int used = 0; /* act buffers in use */
    for (int i = 0; i < count; i++) {
        j.w[i] = w[i];
        j.y[i] = y[i];
        j.ldy[i] = ldy[i];
        j.chunk[i] = row_chunk(w[i]->rows, b->n_threads);
        j.first[i + 1] = j.first[i] + (w[i]->rows + j.chunk[i] - 1) / j.chunk[i];
        int same = -1;
        for (int p = 0; p < i && same < 0; p++)
            if (cpu_act_kind(b, w[p]->type) == cpu_act_kind(b, w[i]->type) &&
                rounds_bf16(b, w[p]) == rounds_bf16(b, w[i]))
                same = p;
        if (same >= 0) {
            j.a[i] = j.a[same];
        } else if (used < 2) {
            j.a[i] = prepare_ld(b, w[i], x, ldx, n, k, b->act[used++]);
        } else { /* a third kind of preparation: the first i now, the rest after */
            matmul_run(b, i, y, ldy, x, ldx, w, bias, n, k);
            matmul_run(b, count - i, y + i, ldy + i, x, ldx, w + i, bias ? bias + i : NULL, n, k);
            return;
        }
    }
    pool_run(b->pool, mm_task, &j, j.first[count]);
    for (int i = 0; i < count; i++) {
        if (!bias || !bias[i]) continue;
        for (int r = 0; r < n; r++) {
            float *row = y[i] + (size_t)r * ldy[i];
            for (int c = 0; c < w[i]->rows; c++) row[c] += bias[i][c];
        }
    }
}

static void cpu_matmul_multi(struct backend *be, int count, float *const *y, const float *x,
                             const struct wmat *const *w, const float *const *bias, int n, int k)
{
    size_t ldy[BE_MULTI_MAX];
    for (int i = 0; i < count && i < BE_MULTI_MAX; i++) ldy[i] = (size_t)w[i]->rows;
    matmul_run(cpu_of(be), count, y, ldy, x, (size_t)k, w, bias, n, k);
}

static void cpu_matmul_ld(struct backend *be, float *y, int ldy, const float *x, int ldx,
                          const struct wmat *w, int n, int k, int m)
{
    size_t ld = (size_t)ldy;
    if (m > 0) matmul_run(cpu_of(be), 1, &y, &ld, x, (size_t)ldx, &w, NULL, n, k);
}

static void cpu_matmul(struct backend *be, float *y, const float *x, const struct wmat *w,
                       const float *bias, int n, int k, int m)
{
    size_t ld = (size_t)m;
    if (m > 0) matmul_run(cpu_of(be), 1, &y, &ld, x, (size_t)k, &w, &bias, n, k);
}

static void cpu_rmsnorm_ld(struct backend *be, float *y, const float *x, const float *w, int n,
                           int d, int ld, float eps)
{
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * ld;
        float *yi = y + (size_t)i * ld;
        float ss = 0.0f;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int j = 0; j < d; j++) yi[j] = w[j] * (xi[j] * inv);
    }
}

static void cpu_layernorm_ld(struct backend *be, float *y, int ldy, const float *x, int ldx,
                             const float *w, const float *bias, int n, int d, float eps)
{
    (void)be;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * ldx;
        float *yi = y + (size_t)i * ldy;
        float mean = 0.0f, var = 0.0f;
        for (int j = 0; j < d; j++) mean += xi[j];
        mean /= (float)d;
        for (int j = 0; j < d; j++) var += (xi[j] - mean) * (xi[j] - mean);
        float inv = 1.0f / sqrtf(var / (float)d + eps);
        for (int j = 0; j < d; j++) yi[j] = (xi[j] - mean) * inv * w[j] + bias[j];
    }
}

static void cpu_dsa_select(struct backend *be, int32_t *sel, int32_t *sel_n, const float *q,
                           const float *w, const struct be_kv *kv, const struct be_tokens *tk,
                           int block_size, int n, const struct be_dsa *p)
{
    struct cpu_backend *b = cpu_of(be);
    dsa_select_run(b->pool, b->kk, &b->dsa, sel, sel_n, q, w, kv, tk, block_size, n, p);
}

static void cpu_hc_pre(struct backend *be, float *post, float *comb, float *y, const float *x,
                       const float *mix, int n, int d, const struct be_hc *h)
{
    v4_hc_pre_run(cpu_of(be)->pool, post, comb, y, x, mix, n, d, h);
}

static void cpu_hc_post(struct backend *be, float *y, const float *x, const float *out,
                        const float *post, const float *comb, int n, int d, int n_stream)
{
    v4_hc_post_run(cpu_of(be)->pool, y, x, out, post, comb, n, d, n_stream);
}

static void cpu_v4_compress(struct backend *be, float *out, int ldo, const struct be_kv *kv,
                            const struct be_tokens *tk, int block_size, int n,
                            const struct be_v4cmp *p)
{
    struct cpu_backend *b = cpu_of(be);
    v4_compress_run(b->pool, b->kk, &b->v4, out, ldo, kv, tk, block_size, n, p);
}

static void cpu_v4_attention(struct backend *be, float *out, const float *q,
                             const struct be_kv *kv, const struct be_tokens *tk, int block_size,
                             int n, const struct be_v4attn *a)
{
    struct cpu_backend *b = cpu_of(be);
    v4_attention_run(b->pool, b->kk, &b->v4, out, q, kv, tk, block_size, n, a);
}

static void cpu_rmsnorm(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                        float eps)
{
    cpu_rmsnorm_ld(be, y, x, w, n, d, d, eps);
}

static void cpu_rope_ex(struct backend *be, float *y, int y_stride, const float *x, int x_stride,
                        const int32_t *pos, int n, int n_head, int rot_dim, int interleave,
                        const float *cos_sin)
{
    int half = rot_dim / 2;
    /* element j of a pair and its partner */
    int step = interleave ? 2 : 1, other = interleave ? 1 : half;
    for (int i = 0; i < n; i++) {
        const float *cs = cos_sin + (size_t)pos[i] * half * 2;
        for (int h = 0; h < n_head; h++) {
            const float *u = x + ((size_t)i * n_head + h) * x_stride;
            float *v = y + ((size_t)i * n_head + h) * y_stride;
            for (int j = 0; j < half; j++) {
                float c = cs[2 * j], s = cs[2 * j + 1];
                float a = u[j * step], b = u[j * step + other];
                v[j * step] = a * c - b * s;
                v[j * step + other] = b * c + a * s;
            }
        }
    }
}

static void cpu_rope(struct backend *be, float *x, const int32_t *pos, int n, int n_head,
                     int head_dim, const float *cos_sin)
{
    cpu_rope_ex(be, x, head_dim, x, head_dim, pos, n, n_head, head_dim, 0, cos_sin);
}

static void cpu_add(struct backend *be, float *y, const float *x, int n, int d)
{
    size_t total = (size_t)n * d;
    for (size_t i = 0; i < total; i++) y[i] += x[i];
}

static void cpu_clamp(struct backend *be, float *x, int n, int d, float c)
{
    size_t total = (size_t)n * d;
    for (size_t i = 0; i < total; i++) x[i] = x[i] < -c ? -c : (x[i] > c ? c : x[i]);
}

static void cpu_swiglu(struct backend *be, float *out, const float *gate, const float *up, int n,
                       int d_ff)
{
    cpu_of(be)->kk->silu_mul(out, gate, up, n * d_ff);
}

static void cpu_embed(struct backend *be, float *out, const struct wmat *table, const int32_t *ids,
                      int n, int d)
{
    for (int i = 0; i < n; i++) wmat_row_f32(table, ids[i], out + (size_t)i * d);
}

static void cpu_gather_rows(struct backend *be, float *dst, const float *src, const int32_t *idx,
                            int n, int d)
{
    for (int i = 0; i < n; i++)
        memcpy(dst + (size_t)i * d, src + (size_t)idx[i] * d, sizeof(float) * d);
}

static void cpu_scatter_rows(struct backend *be, float *dst, const float *src, const int32_t *idx,
                             int n, int d)
{
    for (int i = 0; i < n; i++)
        memcpy(dst + (size_t)idx[i] * d, src + (size_t)i * d, sizeof(float) * d);
}

static void cpu_moe_combine(struct backend *be, float *out, const float *rows, const int32_t *idx,
                            const float *w, int n, int k, int d)
{
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * d;
        memset(o, 0, sizeof(float) * d);
        for (int j = 0; j < k; j++) {
            int32_t r = idx[(size_t)i * k + j];
            if (r < 0) continue;
            float wj = w[(size_t)i * k + j];
            const float *row = rows + (size_t)r * d;
            for (int c = 0; c < d; c++) o[c] += wj * row[c];
        }
    }
}

static void cpu_add_scaled_rows(struct backend *be, float *y, const float *x, const float *s,
                                int n, int d, int sigmoid)
{
    for (int i = 0; i < n; i++) {
        float f = sigmoid ? 1.0f / (1.0f + expf(-s[i])) : s[i];
        float *yi = y + (size_t)i * d;
        const float *xi = x + (size_t)i * d;
        for (int c = 0; c < d; c++) yi[c] += f * xi[c];
    }
}

static void cpu_route(struct backend *be, int32_t *idx, float *w, const float *logits,
                      const float *glog, const int32_t *tok_k, int n, const struct be_route *r)
{
    for (int t = 0; t < n; t++) route_token(r, logits, glog, tok_k, t, idx, w);
}

/* Expert FFNs in two pool jobs: (1) gate and up of every expert, EXPERT_CHUNK weight rows a
 * task, SiLU(gate) * up written to the expert's hidden rows in `gate`; (2) down, EXPERT_CHUNK
 * rows a task, the first task of each expert preparing its hidden rows as activations (the
 * others wait for it: a small job next to a barrier). Each expert's weights are read once per
 * call whatever its number of rows. */
struct ex_job {
    struct cpu_backend *b;
    const struct be_expert *ex;
    const int *off;
    int d;
    struct act ax;     /* every row's input, prepared */
    float *h;          /* hidden rows: expert e's at hoff[e], (rows_e, d_ff_e) */
    size_t *hoff;      /* = b->ex_hoff */
    float *y;
};

static void ex_up_task(void *ctx, int t, int thread)
{
    struct ex_job *j = ctx;
    struct cpu_backend *b = j->b;
    int e = b->tasks[3 * t], r0 = b->tasks[3 * t + 1], r1 = b->tasks[3 * t + 2];
    const struct be_expert *ex = &j->ex[e];
    int rows = j->off[e + 1] - j->off[e], w = r1 - r0;
    struct act a = act_rows(&j->ax, j->off[e] - j->off[0], rows);
    float *h = j->h + j->hoff[e], *u = b->tmp + (size_t)thread * b->tmp_per_thread;
    b->kk->gemm(ex->gate, &a, h + r0, (size_t)ex->d_ff, r0, r1);
    b->kk->gemm(ex->up, &a, u, (size_t)w, r0, r1);
    for (int i = 0; i < rows; i++) {
        float *hi = h + (size_t)i * ex->d_ff + r0, *ui = u + (size_t)i * w;
        if (ex->b_gate)
            for (int c = 0; c < w; c++) hi[c] += ex->b_gate[r0 + c];
        if (ex->b_up)
            for (int c = 0; c < w; c++) ui[c] += ex->b_up[r0 + c];
        if (ex->act == BE_ACT_SILU_CLAMP) /* DeepSeek-V4: clamp, then the plain SwiGLU */
            for (int c = 0; c < w; c++) {
                hi[c] = hi[c] < ex->limit ? hi[c] : ex->limit;
                ui[c] = ui[c] < -ex->limit ? -ex->limit : ui[c] > ex->limit ? ex->limit : ui[c];
            }
        if (ex->act == BE_ACT_SWIGLU_OAI)
            b->kk->swiglu_oai(hi, hi, ui, w, ex->alpha, ex->limit);
        else
            b->kk->silu_mul(hi, hi, ui, w);
    }
}

/* Prepares expert e's hidden rows as the down projection's activations, once. */
static void ex_prepare(struct ex_job *j, int e)
{
    struct cpu_backend *b = j->b;
    int expected = 0;
    if (atomic_compare_exchange_strong(&b->ex_ready[e], &expected, 1)) {
        const struct be_expert *ex = &j->ex[e];
        int rows = j->off[e + 1] - j->off[e];
        b->kk->act_prepare(cpu_act_kind(b, ex->down->type), rounds_bf16(b, ex->down),
                           j->h + j->hoff[e],
                           (size_t)ex->d_ff, rows, ex->d_ff, 0, rows, b->act[1] + b->ex_off[e],
                           &b->ex_act[e]);
        atomic_store_explicit(&b->ex_ready[e], 2, memory_order_release);
        return;
    }
    while (atomic_load_explicit(&b->ex_ready[e], memory_order_acquire) != 2) POOL_RELAX();
}

static void ex_down_task(void *ctx, int t, int thread)
{
    struct ex_job *j = ctx;
    struct cpu_backend *b = j->b;
    int e = b->tasks[3 * t], r0 = b->tasks[3 * t + 1], r1 = b->tasks[3 * t + 2];
    ex_prepare(j, e);
    float *y = j->y + (size_t)j->off[e] * j->d + r0;
    b->kk->gemm(j->ex[e].down, &b->ex_act[e], y, (size_t)j->d, r0, r1);
    const float *bd = j->ex[e].b_down;
    if (bd)
        for (int i = 0; i < j->off[e + 1] - j->off[e]; i++)
            for (int c = r0; c < r1; c++) y[(size_t)i * j->d + (c - r0)] += bd[c];
}

/* Fills b->tasks with (expert, r0, r1) for every expert with rows, `width(e)` rows cut in
 * EXPERT_CHUNK pieces; returns the count, or -1 when the table cannot grow. */
static int expert_tasks(struct cpu_backend *b, const struct be_expert *ex, const int *off,
                        int n_experts, int down, int d)
{
    int need = 0;
    for (int e = 0; e < n_experts; e++)
        if (off[e + 1] > off[e]) need += ((down ? d : ex[e].d_ff) + EXPERT_CHUNK - 1) / EXPERT_CHUNK;
    if (cpu_reserve_tasks(b, need) != 0) return -1;
    int n = 0;
    for (int e = 0; e < n_experts; e++) {
        if (off[e + 1] <= off[e]) continue;
        int width = down ? d : ex[e].d_ff;
        for (int r = 0; r < width; r += EXPERT_CHUNK, n++) {
            b->tasks[3 * n] = e;
            b->tasks[3 * n + 1] = r;
            b->tasks[3 * n + 2] = r + EXPERT_CHUNK < width ? r + EXPERT_CHUNK : width;
        }
    }
    return n;
}

static void cpu_moe_experts(struct backend *be, float *y, const float *x, int d, int n_experts,
                            const int *off, const struct be_expert *experts, float *gate,
                            float *up)
{
    struct cpu_backend *b = cpu_of(be);
    int rows = off[n_experts] - off[0];
    if (n_experts <= 0 || rows <= 0 || n_experts > b->max_experts) return;
    struct ex_job j = {.b = b, .ex = experts, .off = off, .d = d, .h = gate, .hoff = b->ex_hoff,
                       .y = y};
    /* One preparation of every input row serves all experts (they share the weight type). */
    j.ax = prepare(b, experts[0].gate, x + (size_t)off[0] * d, rows, d, b->act[0]);
    size_t h = 0, a = 0;
    for (int e = 0; e < n_experts; e++) {
        int n = off[e + 1] - off[e] > 0 ? off[e + 1] - off[e] : 0;
        b->ex_hoff[e] = h;
        b->ex_off[e] = a;
        h += (size_t)n * (size_t)experts[e].d_ff;
        a += (gemm_act_bytes(cpu_act_kind(b, experts[e].down->type), n, experts[e].d_ff) +
              63) / 64 * 64;
    }
    int n_up = expert_tasks(b, experts, off, n_experts, 0, d);
    if (n_up < 0) return;
    pool_run(b->pool, ex_up_task, &j, n_up);
    int n_down = expert_tasks(b, experts, off, n_experts, 1, d);
    if (n_down < 0) return;
    for (int e = 0; e < n_experts; e++) atomic_store_explicit(&b->ex_ready[e], 0, memory_order_relaxed);
    pool_run(b->pool, ex_down_task, &j, n_down);
}

/* Token i's block table and position (see struct be_tokens). */
/* --- continuous experts (neuron_ffn) ------------------------------------------------------ */

/* Neurons per task of the gate/up pass (the kernels' results do not depend on it). */
#define NEURON_CHUNK 32
/* From this many tokens a step is taken neuron by neuron (gemm.h neuron_up_tok): a neuron's
 * rows are read once for all the tokens that kept it, instead of once per token. */
#define NEURON_BATCH_MIN 8

struct nf_job {
    const struct gemm_kernels *kk;
    float *y;
    const float *x;
    int n, d, stride;
    const struct wmat *gate, *up, *down_t;
    const int32_t *idx;
    const float *coef;
    const int32_t *count;
    float *hbuf;
    /* the neuron-major path: tokens of neuron f at tok/slot[start[f] .. start[f + 1]) */
    const int32_t *start, *tok, *slot;
    int F;
    int up_chunks;  /* gate/up tasks per token: ceil(stride / NEURON_CHUNK) */
    int col_chunks; /* down tasks per token, each col_width columns (whole rows are read best:
                     * one task a token unless there are fewer tokens than threads) */
    int col_width;
};

/* hbuf[i, j] = coef * silu(gate . x_i) * (up . x_i) for the task's neurons of token i. */
static void nf_up_task(void *ctx, int t, int thread)
{
    struct nf_job *j = ctx;
    int i = t / j->up_chunks, j0 = (t % j->up_chunks) * NEURON_CHUNK;
    int j1 = j0 + NEURON_CHUNK < j->count[i] ? j0 + NEURON_CHUNK : j->count[i];
    size_t base = (size_t)i * j->stride + (size_t)j0;
    if (j1 > j0)
        j->kk->neuron_up(j->gate, j->up, j->idx + base, j1 - j0, j->x + (size_t)i * j->d,
                         j->coef + base, j->hbuf + base);
}

/* y[i, c0:c1] = sum_j hbuf[i, j] * down_t[idx[i, j], c0:c1], j in order. */
static void nf_down_task(void *ctx, int t, int thread)
{
    struct nf_job *j = ctx;
    int i = t / j->col_chunks, c0 = (t % j->col_chunks) * j->col_width;
    int c1 = c0 + j->col_width < j->d ? c0 + j->col_width : j->d;
    size_t base = (size_t)i * j->stride;
    j->kk->neuron_down(j->down_t, j->idx + base, j->hbuf + base, j->count[i],
                       j->y + (size_t)i * j->d, c0, c1);
}

/* Neuron-major gate/up: the task's NEURON_CHUNK neurons, each against all its tokens. */
static void nf_up_tok_task(void *ctx, int t, int thread)
{
    struct nf_job *j = ctx;
    int f1 = (t + 1) * NEURON_CHUNK < j->F ? (t + 1) * NEURON_CHUNK : j->F;
    for (int f = t * NEURON_CHUNK; f < f1; f++) {
        int s0 = j->start[f], cnt = j->start[f + 1] - s0;
        if (cnt > 0)
            j->kk->neuron_up_tok(j->gate, j->up, f, j->x, (size_t)j->d, j->tok + s0,
                                 j->slot + s0, cnt, j->coef, j->hbuf);
    }
}

/* Neuron-major down: the task's columns of every token, the neurons in ascending order (each
 * token's own order, so the sums are the per-token path's). */
static void nf_down_tok_task(void *ctx, int t, int thread)
{
    struct nf_job *j = ctx;
    int c0 = t * j->col_width, c1 = c0 + j->col_width < j->d ? c0 + j->col_width : j->d;
    for (int i = 0; i < j->n; i++)
        memset(j->y + (size_t)i * j->d + c0, 0, sizeof(float) * (size_t)(c1 - c0));
    for (int f = 0; f < j->F; f++) {
        int s0 = j->start[f], cnt = j->start[f + 1] - s0;
        if (cnt > 0)
            j->kk->neuron_down_tok(j->down_t, f, j->tok + s0, j->slot + s0, cnt, j->hbuf, j->y,
                                   (size_t)j->d, c0, c1);
    }
}

/* The neuron-major plan in iscratch (backend.h NEURON_ISCRATCH): a counting sort of the
 * (token, slot) pairs by neuron, tokens ascending within a neuron. */
static void nf_plan(struct nf_job *j, int32_t *iscratch)
{
    int F = j->F;
    int32_t *start = iscratch, *cur = iscratch + F + 1;
    int32_t *tok = iscratch + 2 * ((size_t)F + 1);
    int32_t *slot = tok + (size_t)j->n * (size_t)j->stride;
    memset(cur, 0, sizeof(int32_t) * ((size_t)F + 1));
    for (int i = 0; i < j->n; i++)
        for (int k = 0; k < j->count[i]; k++) cur[j->idx[(size_t)i * j->stride + k]]++;
    start[0] = 0;
    for (int f = 0; f < F; f++) {
        start[f + 1] = start[f] + cur[f];
        cur[f] = start[f];
    }
    for (int i = 0; i < j->n; i++)
        for (int k = 0; k < j->count[i]; k++) {
            size_t s = (size_t)i * j->stride + (size_t)k;
            int32_t p = cur[j->idx[s]]++;
            tok[p] = i;
            slot[p] = (int32_t)s;
        }
    j->start = start, j->tok = tok, j->slot = slot;
}

static void cpu_neuron_ffn(struct backend *be, float *y, const float *x, int n, int d,
                           const struct wmat *gate, const struct wmat *up,
                           const struct wmat *down_t, const int32_t *idx, const float *coef,
                           const int32_t *count, int stride, float *hbuf, int32_t *iscratch)
{
    struct cpu_backend *b = cpu_of(be);
    if (n <= 0) return;
    struct nf_job j = {.kk = b->kk, .y = y, .x = x, .n = n, .d = d, .stride = stride, .gate = gate, .up = up,
                       .down_t = down_t, .idx = idx, .coef = coef, .count = count, .hbuf = hbuf,
                       .up_chunks = (stride + NEURON_CHUNK - 1) / NEURON_CHUNK};
    if (j.up_chunks < 1) j.up_chunks = 1;
    if (iscratch && n >= NEURON_BATCH_MIN) {
        j.F = gate->rows;
        nf_plan(&j, iscratch);
        j.col_width = ((d + b->n_threads - 1) / b->n_threads + 15) / 16 * 16;
        pool_run(b->pool, nf_up_tok_task, &j, (j.F + NEURON_CHUNK - 1) / NEURON_CHUNK);
        pool_run(b->pool, nf_down_tok_task, &j, (d + j.col_width - 1) / j.col_width);
        return;
    }
    int split = n >= b->n_threads ? 1 : (b->n_threads + n - 1) / n;
    j.col_width = ((d + split - 1) / split + 15) / 16 * 16;
    j.col_chunks = (d + j.col_width - 1) / j.col_width;
    pool_run(b->pool, nf_up_task, &j, n * j.up_chunks);
    pool_run(b->pool, nf_down_task, &j, n * j.col_chunks);
}

static inline const int32_t *tok_table(const struct be_tokens *tk, int i)
{
    return tk->seq ? tk->tables + (size_t)tk->seq[i] * tk->table_stride : tk->tables;
}

static inline int tok_pos(const struct be_tokens *tk, int i)
{
    return tk->pos ? tk->pos[i] : tk->pos0 + i;
}

static void cpu_kv_write(struct backend *be, const struct be_kv *kv, const float *k,
                         const float *v, const struct be_tokens *tk, int block_size, int n,
                         int row)
{
    size_t es = (size_t)kv_type_size(kv->type);
    float kinv = kv->k_scale > 0.0f ? 1.0f / kv->k_scale : 1.0f;
    float vinv = kv->v_scale > 0.0f ? 1.0f / kv->v_scale : 1.0f;
    for (int which = 0; which < (v ? 2 : 1); which++) {
        const float *x = which ? v : k;
        int seg = which ? kv->v_grp : kv->k_grp, nh = row / seg;
        char *base = which ? kv->v : kv->k;
        float *sc = which ? kv->v_sc : kv->k_sc;
        for (int i = 0; i < n; i++) {
            const int32_t *bt = tok_table(tk, i);
            int p = tok_pos(tk, i), slot = p % block_size;
            size_t blk = (size_t)bt[p / block_size];
            for (int h = 0; h < nh; h++) /* head-major within the block (kv_seg_offset) */
                kv_store_row(kv->type,
                             base + kv_seg_offset(blk, slot, block_size, nh, h, seg) * es,
                             x + (size_t)i * row + (size_t)h * seg, seg, seg,
                             which ? vinv : kinv,
                             sc ? sc + kv_seg_offset(blk, slot, block_size, nh, h, 1) : NULL);
        }
    }
}

static void cpu_attention(struct backend *be, float *out, const float *q, const struct be_kv *kv,
                          const struct be_tokens *tk, int block_size, int n,
                          const struct be_attn *a)
{
    struct cpu_backend *b = cpu_of(be);
    int group = a->n_head / a->n_kv_head;
    struct fa_work *w = &b->fa;
    if (!fa_work_fits(w, n, a)) {
        /* a call past what reserve was told (tests call ops directly): grow once */
        int fail = fa_work_reserve(w, b->n_threads, n > w->max_tokens ? n : w->max_tokens,
                                   group > w->rows ? group : w->rows,
                                   a->k_dim > w->dk ? a->k_dim : w->dk,
                                   a->v_dim > w->dv ? a->v_dim : w->dv,
                                   a->n_kv_head > w->kv_heads ? a->n_kv_head : w->kv_heads,
                                   b->fa_ctx);
        if (fail) { /* out of memory: NaN outputs rather than stale ones */
            for (size_t i = 0; i < (size_t)n * a->n_head * a->v_dim; i++) out[i] = NAN;
            return;
        }
    }
    fa_attention(b->pool, b->kk, w, out, q, kv, tk, block_size, n, a);
}

static int cpu_host_workers(struct backend *be)
{
    return cpu_of(be)->n_threads;
}

static void cpu_host_for(struct backend *be, int n_tasks, void (*fn)(void *ctx, int task, int worker),
                         void *ctx)
{
    pool_run(cpu_of(be)->pool, fn, ctx, n_tasks);
}

/* --- hybrid models ------------------------------------------------------------------------ */

static void cpu_gather_cols(struct backend *be, float *y, int ldy, const float *x, int ldx,
                            const int32_t *idx, int n, int m)
{
    (void)be;
    for (int i = 0; i < n; i++) {
        float *yr = y + (size_t)i * ldy;
        const float *xr = x + (size_t)i * ldx;
        for (int j = 0; j < m; j++) yr[j] = xr[idx[j]];
    }
}

static void cpu_mul_sigmoid(struct backend *be, float *y, const float *g, int n, int d)
{
    (void)be;
    size_t total = (size_t)n * d;
    for (size_t i = 0; i < total; i++) y[i] *= 1.0f / (1.0f + expf(-g[i]));
}

static void cpu_gdn(struct backend *be, float *out, float *qkv, const float *z, float *b,
                    float *a, const struct be_gdn *g, const struct be_seqs *sq)
{
    struct cpu_backend *c = cpu_of(be);
    ssm_gdn_run(c->pool, c->kk, out, qkv, z, b, a, g, sq);
}

static void cpu_mamba2(struct backend *be, float *out, float *xbc, const float *z, float *dt,
                       const struct be_mamba *m, const struct be_seqs *sq)
{
    struct cpu_backend *c = cpu_of(be);
    ssm_mamba2_run(c->pool, c->kk, out, xbc, z, dt, m, sq);
}

static void cpu_mul_rows(struct backend *be, float *x, const float *s, int n, int d)
{
    (void)be;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < d; j++) x[(size_t)i * d + j] *= s[i];
}

static void cpu_scale(struct backend *be, float *x, int n, int d, float s)
{
    (void)be;
    size_t total = (size_t)n * d;
    for (size_t i = 0; i < total; i++) x[i] *= s;
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = 1,
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .synchronize = cpu_synchronize,
    .reserve = cpu_reserve,
    .weight_upload = cpu_weight_upload,
    .weight_free = cpu_weight_free,
    .matmul = cpu_matmul,
    .matmul_multi = cpu_matmul_multi,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .add = cpu_add,
    .clamp = cpu_clamp,
    .swiglu = cpu_swiglu,
    .embed = cpu_embed,
    .gather_rows = cpu_gather_rows,
    .scatter_rows = cpu_scatter_rows,
    .moe_combine = cpu_moe_combine,
    .add_scaled_rows = cpu_add_scaled_rows,
    .route = cpu_route,
    .moe_experts = cpu_moe_experts,
    .neuron_ffn = cpu_neuron_ffn,
    .attention = cpu_attention,
    .kv_write = cpu_kv_write,
    .matmul_ld = cpu_matmul_ld,
    .rmsnorm_ld = cpu_rmsnorm_ld,
    .layernorm_ld = cpu_layernorm_ld,
    .dsa_select = cpu_dsa_select,
    .rope_ex = cpu_rope_ex,
    .host_workers = cpu_host_workers,
    .host_for = cpu_host_for,
    .gather_cols = cpu_gather_cols,
    .mul_sigmoid = cpu_mul_sigmoid,
    .gdn = cpu_gdn,
    .mamba2 = cpu_mamba2,
    .hc_pre = cpu_hc_pre,
    .hc_post = cpu_hc_post,
    .v4_compress = cpu_v4_compress,
    .v4_attention = cpu_v4_attention,
    .scale = cpu_scale,
    .mul_rows = cpu_mul_rows,
};

/* Staged variant: copies weights, and tells the engine its memory is not host memory, so the
 * engine takes the path a GPU backend takes (uploads, downloads, logits in chunks). The copy
 * is one block: the wmat, then its data. */
static const struct wmat *cpu_weight_copy(struct backend *be, const struct wmat *host)
{
    size_t bytes = wtype_bytes(host->type, host->rows, host->cols);
    struct wmat *w = cpu_alloc(be, 64 + bytes);
    if (!w) return NULL;
    *w = *host;
    w->data = (unsigned char *)w + 64;
    if (bytes) memcpy((void *)w->data, host->data, bytes);
    return w;
}

static void cpu_weight_copy_free(struct backend *be, const struct wmat *w)
{
    free((void *)w);
}

static struct backend_ops cpu_staged_ops;
static pthread_once_t cpu_staged_once = PTHREAD_ONCE_INIT;

static void cpu_staged_init(void)
{
    cpu_staged_ops = cpu_ops;
    cpu_staged_ops.name = "cpu-staged";
    cpu_staged_ops.host_memory = 0;
    cpu_staged_ops.weight_upload = cpu_weight_copy;
    cpu_staged_ops.weight_free = cpu_weight_copy_free;
}

struct backend *backend_cpu_create_staged(int n_threads, bool bf16_compute)
{
    struct backend *be = backend_cpu_create(n_threads, bf16_compute);
    if (!be) return NULL;
    pthread_once(&cpu_staged_once, cpu_staged_init);
    be->ops = &cpu_staged_ops;
    return be;
}

struct backend *backend_cpu_create(int n_threads, bool bf16_compute)
{
    struct cpu_backend *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->base.ops = &cpu_ops;
    b->n_threads = n_threads < 1 ? 1 : n_threads;
    b->bf16 = bf16_compute;
    b->kk = gemm_kernels_best();
    b->pool = pool_create(b->n_threads, -1);
    if (!b->pool) {
        free(b);
        return NULL;
    }
    return &b->base;
}

void backend_cpu_set_int8_mxfp4(struct backend *be, bool on)
{
    cpu_of(be)->int8_mx = on;
}

const char *backend_cpu_kernels(void)
{
    return gemm_kernels_best()->name;
}

const char *backend_cpu_features(void)
{
    return cpu_features_string();
}
