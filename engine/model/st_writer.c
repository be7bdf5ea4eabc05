/* safetensors writer: builds the JSON header with jansson from the declared tensors, pads it
 * to an 8-byte boundary, and writes tensor data with pwrite at offsets fixed when the header is
 * built, so streamed tensors may arrive in any order and in pieces. */
#include "st_writer.h"

#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct stw_tensor {
    char *name;
    enum st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data; /* borrowed, or NULL when streamed */
    size_t nbytes;
    size_t offset;  /* in the data section, set by stw_begin */
    size_t written; /* bytes written so far (streaming; overlapping writes count twice) */
};

struct stw {
    struct stw_tensor *t; /* (n) */
    int n, cap;
    json_t *metadata; /* object or NULL */
    int fd;           /* open between stw_begin and stw_end, else -1 */
    char *path;
    uint64_t data_start; /* 8 + padded header length */
};

struct stw *stw_new(void)
{
    struct stw *w = calloc(1, sizeof *w);
    if (w) w->fd = -1;
    return w;
}

void stw_free(struct stw *w)
{
    if (!w) return;
    for (int i = 0; i < w->n; i++)
        free(w->t[i].name);
    free(w->t);
    json_decref(w->metadata);
    if (w->fd >= 0) close(w->fd);
    free(w->path);
    free(w);
}

int stw_add(struct stw *w, const char *name, enum st_dtype dtype, int ndim, const int64_t *shape,
            const void *data, char *err, size_t errlen)
{
    size_t esz = st_dtype_size(dtype);
    if (esz == 0) return ms_errf(err, errlen, "stw: tensor '%s': bad dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return ms_errf(err, errlen, "stw: tensor '%s': %d dimensions", name, ndim);
    if (strcmp(name, "__metadata__") == 0)
        return ms_errf(err, errlen, "stw: '__metadata__' is not a tensor name");
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return ms_errf(err, errlen, "stw: tensor '%s' added twice", name);
    size_t nbytes = esz;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return ms_errf(err, errlen, "stw: tensor '%s': negative dimension", name);
        if (shape[i] && nbytes > SIZE_MAX / (size_t)shape[i])
            return ms_errf(err, errlen, "stw: tensor '%s': too large", name);
        nbytes *= (size_t)shape[i];
    }
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 32;
        struct stw_tensor *nt = realloc(w->t, (size_t)cap * sizeof *nt);
        if (!nt) return ms_errf(err, errlen, "stw: out of memory");
        w->t = nt;
        w->cap = cap;
    }
    struct stw_tensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return ms_errf(err, errlen, "stw: out of memory");
    t->dtype = dtype;
    t->ndim = ndim;
    if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof shape[0]);
    t->data = data;
    t->nbytes = nbytes;
    return w->n++;
}

int stw_set_metadata(struct stw *w, const char *key, const char *value, char *err, size_t errlen)
{
    if (!w->metadata && !(w->metadata = json_object()))
        return ms_errf(err, errlen, "stw: out of memory");
    if (json_object_set_new(w->metadata, key, json_string(value)) != 0)
        return ms_errf(err, errlen, "stw: metadata '%s' is not valid UTF-8", key);
    return 0;
}

size_t stw_tensor_nbytes(const struct stw *w, int index)
{
    return (index >= 0 && index < w->n) ? w->t[index].nbytes : 0;
}

/* Assigns data offsets (decreasing element size, stable) and returns the header text. */
static char *stw_header(struct stw *w, char *err, size_t errlen)
{
    static const size_t sizes[] = {8, 4, 2, 1};
    size_t off = 0;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        for (int i = 0; i < w->n; i++) {
            if (st_dtype_size(w->t[i].dtype) != sizes[s]) continue;
            w->t[i].offset = off;
            off += w->t[i].nbytes;
        }
    }
    json_t *root = json_object();
    if (!root) goto oom;
    if (w->metadata && json_object_set(root, "__metadata__", w->metadata) != 0) goto oom;
    for (int i = 0; i < w->n; i++) {
        const struct stw_tensor *t = &w->t[i];
        json_t *shape = json_array();
        json_t *e =
            json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype_name(t->dtype), "shape", shape,
                      "data_offsets", (json_int_t)t->offset, (json_int_t)(t->offset + t->nbytes));
        if (!e) goto oom;
        for (int d = 0; d < t->ndim; d++)
            if (json_array_append_new(shape, json_integer(t->shape[d])) != 0) {
                json_decref(e);
                goto oom;
            }
        if (json_object_set_new(root, t->name, e) != 0) goto oom;
    }
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!text) ms_errf(err, errlen, "stw: out of memory");
    return text;
oom:
    json_decref(root);
    ms_errf(err, errlen, "stw: out of memory");
    return NULL;
}

static int stw_pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
    const char *p = buf;
    while (n) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int stw_begin(struct stw *w, const char *path, char *err, size_t errlen)
{
    if (w->fd >= 0) return ms_errf(err, errlen, "%s: stw_begin called twice", path);
    char *text = stw_header(w, err, errlen);
    if (!text) return -1;
    size_t len = strlen(text);
    size_t padded = (8 + len + 7) / 8 * 8 - 8;
    char *buf = malloc(8 + padded);
    if (!buf) {
        free(text);
        return ms_errf(err, errlen, "stw: out of memory");
    }
    for (int i = 0; i < 8; i++)
        buf[i] = (char)(((uint64_t)padded >> (8 * i)) & 0xff);
    memcpy(buf + 8, text, len);
    memset(buf + 8 + len, ' ', padded - len);
    free(text);
    free(w->path);
    w->path = strdup(path);
    w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0 || !w->path) {
        free(buf);
        return ms_errf(err, errlen, "%s: cannot create: %s", path, strerror(errno));
    }
    int rc = stw_pwrite_all(w->fd, buf, 8 + padded, 0);
    free(buf);
    if (rc != 0) return ms_errf(err, errlen, "%s: write failed: %s", path, strerror(errno));
    w->data_start = 8 + padded;
    for (int i = 0; i < w->n; i++)
        w->t[i].written = 0;
    return 0;
}

int stw_write_tensor(struct stw *w, int index, size_t offset, const void *data, size_t nbytes,
                     char *err, size_t errlen)
{
    if (w->fd < 0) return ms_errf(err, errlen, "stw: stw_write_tensor before stw_begin");
    if (index < 0 || index >= w->n) return ms_errf(err, errlen, "stw: bad tensor index %d", index);
    struct stw_tensor *t = &w->t[index];
    if (offset > t->nbytes || nbytes > t->nbytes - offset)
        return ms_errf(err, errlen, "%s: tensor '%s': write [%zu, %zu) past its %zu bytes", w->path,
                       t->name, offset, offset + nbytes, t->nbytes);
    if (stw_pwrite_all(w->fd, data, nbytes, w->data_start + t->offset + offset) != 0)
        return ms_errf(err, errlen, "%s: tensor '%s': write failed: %s", w->path, t->name,
                       strerror(errno));
    t->written += nbytes;
    return 0;
}

int stw_end(struct stw *w, char *err, size_t errlen)
{
    if (w->fd < 0) return ms_errf(err, errlen, "stw: stw_end before stw_begin");
    int rc = 0;
    for (int i = 0; i < w->n && rc == 0; i++)
        if (w->t[i].written < w->t[i].nbytes)
            rc = ms_errf(err, errlen, "%s: tensor '%s': only %zu of %zu bytes written", w->path,
                         w->t[i].name, w->t[i].written, w->t[i].nbytes);
    if (close(w->fd) != 0 && rc == 0)
        rc = ms_errf(err, errlen, "%s: close failed: %s", w->path, strerror(errno));
    w->fd = -1;
    return rc;
}

int stw_write(struct stw *w, const char *path, char *err, size_t errlen)
{
    for (int i = 0; i < w->n; i++)
        if (!w->t[i].data && w->t[i].nbytes)
            return ms_errf(err, errlen, "%s: tensor '%s' has no data", path, w->t[i].name);
    if (stw_begin(w, path, err, errlen) != 0) goto fail;
    for (int i = 0; i < w->n; i++)
        if (w->t[i].nbytes &&
            stw_write_tensor(w, i, 0, w->t[i].data, w->t[i].nbytes, err, errlen) != 0)
            goto fail;
    return stw_end(w, err, errlen);
fail:
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    return -1;
}
