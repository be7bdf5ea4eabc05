/* CPU backend: the reference implementation of every op in kernels/backend.h. GEMMs go to
 * OpenBLAS; everything else is plain C written so the compiler can vectorize the inner loops.
 * f32 throughout, weights included (a weight handle is the f32 host array). Ops do not
 * allocate; attention takes its score scratch from the caller. */
#include "backend.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "route_impl.h"

struct cpu_backend {
    struct backend base;
    int n_threads;
};

static void cpu_destroy(struct backend *be)
{
    free(be);
}

static void *cpu_alloc(struct backend *be, size_t bytes)
{
    void *p = NULL;
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

static int cpu_reserve(struct backend *be, size_t max_elems, int max_experts)
{
    return 0; /* BLAS needs no workspace from us */
}

/* f32 weights in host memory: the handle is the caller's array. */
static const void *cpu_weight_upload(struct backend *be, const float *host, size_t n)
{
    return host;
}

static void cpu_weight_free(struct backend *be, const void *w)
{
}

static void cpu_matmul(struct backend *be, float *y, const float *x, const void *wv,
                       const float *bias, int n, int k, int m)
{
    const float *w = wv;
    if (n <= 0 || m <= 0) return;
    if (n == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, 1.0f, w, k, x, 1, 0.0f, y, 1);
    } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x, k, w, k, 0.0f, y,
                    m);
    }
    if (bias) {
        for (int i = 0; i < n; i++) {
            float *row = y + (size_t)i * m;
            for (int j = 0; j < m; j++) row[j] += bias[j];
        }
    }
}

static void cpu_rmsnorm(struct backend *be, float *y, const float *x, const float *w, int n, int d,
                        float eps)
{
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *yi = y + (size_t)i * d;
        float ss = 0.0f;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int j = 0; j < d; j++) yi[j] = w[j] * (xi[j] * inv);
    }
}

static void cpu_rope(struct backend *be, float *x, const int32_t *pos, int n, int n_head,
                     int head_dim, const float *cos_sin)
{
    int half = head_dim / 2;
    for (int i = 0; i < n; i++) {
        const float *cs = cos_sin + (size_t)pos[i] * half * 2;
        for (int h = 0; h < n_head; h++) {
            float *v = x + ((size_t)i * n_head + h) * head_dim;
            for (int j = 0; j < half; j++) {
                float c = cs[2 * j], s = cs[2 * j + 1];
                float a = v[j], b = v[j + half];
                v[j] = a * c - b * s;
                v[j + half] = b * c + a * s;
            }
        }
    }
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
    size_t total = (size_t)n * d_ff;
    for (size_t i = 0; i < total; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void cpu_embed(struct backend *be, float *out, const void *table, const int32_t *ids,
                      int n, int d)
{
    const float *embed = table;
    for (int i = 0; i < n; i++)
        memcpy(out + (size_t)i * d, embed + (size_t)ids[i] * d, sizeof(float) * d);
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

/* One expert after another; each expert's rows reuse the start of gate/up. */
static void cpu_moe_experts(struct backend *be, float *y, const float *x, int d, int n_experts,
                            const int *off, const struct be_expert *experts, float *gate,
                            float *up)
{
    for (int j = 0; j < n_experts; j++) {
        const struct be_expert *ex = &experts[j];
        int rows = off[j + 1] - off[j];
        if (rows <= 0) continue;
        const float *xj = x + (size_t)off[j] * d;
        float *yj = y + (size_t)off[j] * d;
        cpu_matmul(be, gate, xj, ex->gate, NULL, rows, d, ex->d_ff);
        cpu_matmul(be, up, xj, ex->up, NULL, rows, d, ex->d_ff);
        cpu_swiglu(be, gate, gate, up, rows, ex->d_ff);
        cpu_matmul(be, yj, gate, ex->down, NULL, rows, ex->d_ff, d);
    }
}

/* Token i's block table and position (see struct be_tokens). */
static inline const int32_t *tok_table(const struct be_tokens *tk, int i)
{
    return tk->seq ? tk->tables + (size_t)tk->seq[i] * tk->table_stride : tk->tables;
}

static inline int tok_pos(const struct be_tokens *tk, int i)
{
    return tk->pos ? tk->pos[i] : tk->pos0 + i;
}

static inline const float *cache_row(const float *cache, const int32_t *block_table,
                                     int block_size, int pos, size_t row)
{
    return cache + ((size_t)block_table[pos / block_size] * block_size + pos % block_size) * row;
}

static void cpu_kv_write(struct backend *be, float *k_cache, float *v_cache, const float *k,
                         const float *v, const struct be_tokens *tk, int block_size, int n,
                         int row)
{
    for (int i = 0; i < n; i++) {
        const int32_t *bt = tok_table(tk, i);
        int p = tok_pos(tk, i);
        size_t off = ((size_t)bt[p / block_size] * block_size + p % block_size) * row;
        memcpy(k_cache + off, k + (size_t)i * row, sizeof(float) * row);
        memcpy(v_cache + off, v + (size_t)i * row, sizeof(float) * row);
    }
}

static void cpu_attention(struct backend *be, float *out, const float *q, const float *k_cache,
                          const float *v_cache, const struct be_tokens *tk, int block_size, int n,
                          int n_head, int n_kv_head, int head_dim, int window, float scale,
                          float *scratch)
{
    size_t row = (size_t)n_kv_head * head_dim;
    int group = n_head / n_kv_head;
    for (int i = 0; i < n; i++) {
        const int32_t *block_table = tok_table(tk, i);
        int pos = tok_pos(tk, i);
        int start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        for (int h = 0; h < n_head; h++) {
            const float *qh = q + ((size_t)i * n_head + h) * head_dim;
            int kvh = h / group;
            float mx = -INFINITY;
            for (int t = start; t <= pos; t++) {
                const float *kt = cache_row(k_cache, block_table, block_size, t, row) +
                                  (size_t)kvh * head_dim;
                float s = 0.0f;
                for (int j = 0; j < head_dim; j++) s += qh[j] * kt[j];
                s *= scale;
                scratch[t] = s;
                if (s > mx) mx = s;
            }
            float sum = 0.0f;
            for (int t = start; t <= pos; t++) {
                scratch[t] = expf(scratch[t] - mx);
                sum += scratch[t];
            }
            float inv = 1.0f / sum;
            float *oh = out + ((size_t)i * n_head + h) * head_dim;
            memset(oh, 0, sizeof(float) * head_dim);
            for (int t = start; t <= pos; t++) {
                const float *vt = cache_row(v_cache, block_table, block_size, t, row) +
                                  (size_t)kvh * head_dim;
                float p = scratch[t] * inv;
                for (int j = 0; j < head_dim; j++) oh[j] += p * vt[j];
            }
        }
    }
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = 1,
    .weight_bytes = 4,
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
    .attention = cpu_attention,
    .kv_write = cpu_kv_write,
};

/* Staged variant: copies weights, and tells the engine its memory is not host memory, so the
 * engine takes the path a GPU backend takes (uploads, downloads, logits in chunks). */
static const void *cpu_weight_copy(struct backend *be, const float *host, size_t n)
{
    float *w = cpu_alloc(be, sizeof(float) * n);
    if (w && n) memcpy(w, host, sizeof(float) * n);
    return w;
}

static void cpu_weight_copy_free(struct backend *be, const void *w)
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

struct backend *backend_cpu_create_staged(int n_threads)
{
    struct backend *be = backend_cpu_create(n_threads);
    if (!be) return NULL;
    pthread_once(&cpu_staged_once, cpu_staged_init);
    be->ops = &cpu_staged_ops;
    return be;
}

struct backend *backend_cpu_create(int n_threads)
{
    struct cpu_backend *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->base.ops = &cpu_ops;
    b->n_threads = n_threads < 1 ? 1 : n_threads;
    return &b->base;
}
