/* safetensors reader. Each file is mapped read-only and privately; its JSON header is parsed
 * with jansson and checked entry by entry against the size of the data section, so a tensor
 * handed out by st_find always lies wholly inside its mapping with nbytes == numel x dtype size.
 * A folder with model.safetensors.index.json is opened shard by shard (each distinct shard once)
 * and every tensor the index lists must be present in the shard it names. All tensors of all
 * files go into one array indexed by an open-addressing hash table on the name. */
#include "safetensors.h"

#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header larger than this is taken as corruption rather than a real model. */
#define ST_MAX_HEADER (100u * 1000u * 1000u)

struct st_file {
    char *path;
    void *map; /* whole file, PROT_READ, MAP_PRIVATE; NULL for an empty mapping */
    size_t size;
};

struct st_archive {
    struct st_file *files; /* (n_files) */
    int n_files, cap_files;
    struct st_tensor *tensors; /* (n_tensors); names malloc'd, file points at files[i].path */
    int n_tensors, cap_tensors;
    int *table;        /* (table_size) open addressing: tensor index or -1 */
    size_t table_size; /* power of two, at least 2 x n_tensors */
    json_t *metadata;  /* union of the files' __metadata__ objects (string values) */
};

static const struct {
    const char *name;
    enum st_dtype dtype;
    size_t size;
} st_dtypes[] = {
    {"F32", ST_DTYPE_F32, 4},   {"F16", ST_DTYPE_F16, 2},         {"BF16", ST_DTYPE_BF16, 2},
    {"F64", ST_DTYPE_F64, 8},   {"I64", ST_DTYPE_I64, 8},         {"I32", ST_DTYPE_I32, 4},
    {"I16", ST_DTYPE_I16, 2},   {"I8", ST_DTYPE_I8, 1},           {"U8", ST_DTYPE_U8, 1},
    {"BOOL", ST_DTYPE_BOOL, 1}, {"F8_E4M3", ST_DTYPE_F8_E4M3, 1}, {"F8_E5M2", ST_DTYPE_F8_E5M2, 1},
};
#define ST_N_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

const char *st_dtype_name(enum st_dtype t)
{
    for (int i = 0; i < ST_N_DTYPES; i++)
        if (st_dtypes[i].dtype == t) return st_dtypes[i].name;
    return "?";
}

size_t st_dtype_size(enum st_dtype t)
{
    for (int i = 0; i < ST_N_DTYPES; i++)
        if (st_dtypes[i].dtype == t) return st_dtypes[i].size;
    return 0;
}

static int st_dtype_parse(const char *s, enum st_dtype *out)
{
    for (int i = 0; i < ST_N_DTYPES; i++) {
        if (strcmp(st_dtypes[i].name, s) == 0) {
            *out = st_dtypes[i].dtype;
            return 0;
        }
    }
    return -1;
}

/* FNV-1a: names share long prefixes ("model.layers.12.mlp.experts.3.") so every byte counts. */
static uint64_t st_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static void st_file_release(struct st_file *f)
{
    if (f->map) munmap(f->map, f->size);
    free(f->path);
}

void st_close(struct st_archive *a)
{
    if (!a) return;
    for (int i = 0; i < a->n_tensors; i++)
        free((char *)a->tensors[i].name);
    free(a->tensors);
    for (int i = 0; i < a->n_files; i++)
        st_file_release(&a->files[i]);
    free(a->files);
    free(a->table);
    json_decref(a->metadata);
    free(a);
}

static int st_push_tensor(struct st_archive *a, struct st_tensor **out)
{
    if (a->n_tensors == a->cap_tensors) {
        int cap = a->cap_tensors ? 2 * a->cap_tensors : 64;
        struct st_tensor *t = realloc(a->tensors, (size_t)cap * sizeof *t);
        if (!t) return -1;
        a->tensors = t;
        a->cap_tensors = cap;
    }
    *out = &a->tensors[a->n_tensors];
    memset(*out, 0, sizeof **out);
    return 0;
}

/* Formats a shape as "(4, 32)" into buf. */
static const char *st_shape_str(const int64_t *shape, int ndim, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, ")");
    return buf;
}

/* Checks one header entry and appends it. `f` is the file it lives in, `data`/`data_len` its
 * data section. */
static int st_add_entry(struct st_archive *a, struct st_file *f, const char *name, json_t *v,
                        const unsigned char *data, size_t data_len, char *err, size_t errlen)
{
    const char *path = f->path;
    if (!json_is_object(v))
        return ms_errf(err, errlen, "%s: tensor '%s': entry is not a JSON object", path, name);
    json_t *jd = json_object_get(v, "dtype");
    json_t *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");
    if (!jd) return ms_errf(err, errlen, "%s: tensor '%s': missing 'dtype'", path, name);
    if (!js) return ms_errf(err, errlen, "%s: tensor '%s': missing 'shape'", path, name);
    if (!jo) return ms_errf(err, errlen, "%s: tensor '%s': missing 'data_offsets'", path, name);
    if (!json_is_string(jd))
        return ms_errf(err, errlen, "%s: tensor '%s': 'dtype' is not a string", path, name);
    enum st_dtype dtype;
    if (st_dtype_parse(json_string_value(jd), &dtype) != 0)
        return ms_errf(err, errlen, "%s: tensor '%s': unknown dtype '%s'", path, name,
                       json_string_value(jd));
    if (!json_is_array(js))
        return ms_errf(err, errlen, "%s: tensor '%s': 'shape' is not an array", path, name);
    size_t ndim = json_array_size(js);
    if (ndim > ST_MAX_DIMS)
        return ms_errf(err, errlen, "%s: tensor '%s': %zu dimensions (at most %d supported)", path,
                       name, ndim, ST_MAX_DIMS);
    int64_t shape[ST_MAX_DIMS];
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < ndim; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d))
            return ms_errf(err, errlen, "%s: tensor '%s': shape[%zu] is not an integer", path, name,
                           i);
        json_int_t dv = json_integer_value(d);
        if (dv < 0)
            return ms_errf(err, errlen, "%s: tensor '%s': negative dimension %lld in shape", path,
                           name, (long long)dv);
        shape[i] = (int64_t)dv;
        if (dv && numel > UINT64_MAX / (uint64_t)dv) overflow = true;
        numel *= (uint64_t)dv;
    }
    if (!json_is_array(jo) || json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
        !json_is_integer(json_array_get(jo, 1)))
        return ms_errf(err, errlen,
                       "%s: tensor '%s': 'data_offsets' is not an array of two integers", path,
                       name);
    json_int_t begin = json_integer_value(json_array_get(jo, 0));
    json_int_t end = json_integer_value(json_array_get(jo, 1));
    if (begin < 0 || end < begin)
        return ms_errf(err, errlen,
                       "%s: tensor '%s': data_offsets [%lld, %lld] are invalid (end before begin)",
                       path, name, (long long)begin, (long long)end);
    if ((uint64_t)end > data_len)
        return ms_errf(err, errlen,
                       "%s: tensor '%s': data_offsets [%lld, %lld] run past the data section (%zu "
                       "bytes; file truncated?)",
                       path, name, (long long)begin, (long long)end, data_len);
    size_t esz = st_dtype_size(dtype);
    char sbuf[160];
    if (overflow || numel > UINT64_MAX / esz || (uint64_t)(end - begin) != numel * esz)
        return ms_errf(
            err, errlen,
            "%s: tensor '%s': data_offsets [%lld, %lld] do not match shape %s x %s = %llu bytes",
            path, name, (long long)begin, (long long)end,
            st_shape_str(shape, (int)ndim, sbuf, sizeof sbuf), st_dtype_name(dtype),
            overflow ? 0ull : (unsigned long long)(numel * esz));

    struct st_tensor *t;
    if (st_push_tensor(a, &t) != 0) return ms_errf(err, errlen, "%s: out of memory", path);
    char *nm = strdup(name);
    if (!nm) return ms_errf(err, errlen, "%s: out of memory", path);
    t->name = nm;
    t->file = f->path;
    t->dtype = dtype;
    t->ndim = (int)ndim;
    memcpy(t->shape, shape, ndim * sizeof shape[0]);
    t->data = data + begin;
    t->nbytes = (size_t)(end - begin);
    a->n_tensors++;
    return 0;
}

static int st_add_metadata(struct st_archive *a, const char *path, json_t *md, char *err,
                           size_t errlen)
{
    if (!json_is_object(md))
        return ms_errf(err, errlen, "%s: '__metadata__' is not a JSON object", path);
    const char *key;
    json_t *v;
    json_object_foreach(md, key, v)
    {
        if (!json_is_string(v))
            return ms_errf(err, errlen, "%s: __metadata__['%s'] is not a string", path, key);
    }
    if (!a->metadata && !(a->metadata = json_object()))
        return ms_errf(err, errlen, "%s: out of memory", path);
    if (json_object_update(a->metadata, md) != 0)
        return ms_errf(err, errlen, "%s: out of memory", path);
    return 0;
}

const char *st_metadata(const struct st_archive *a, const char *key)
{
    if (!a || !a->metadata) return NULL;
    return json_string_value(json_object_get(a->metadata, key));
}

/* Maps `path` and appends its tensors to the archive. */
static int st_add_file(struct st_archive *a, const char *path, char *err, size_t errlen)
{
    if (a->n_files == a->cap_files) {
        int cap = a->cap_files ? 2 * a->cap_files : 4;
        struct st_file *nf = realloc(a->files, (size_t)cap * sizeof *nf);
        if (!nf) return ms_errf(err, errlen, "%s: out of memory", path);
        a->files = nf;
        a->cap_files = cap;
    }
    struct st_file *f = &a->files[a->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return ms_errf(err, errlen, "%s: out of memory", path);
    a->n_files++; /* from here st_close releases it */

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ms_errf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return ms_errf(err, errlen, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return ms_errf(err, errlen, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return ms_errf(err, errlen, "%s: file is %lld bytes, too short for a safetensors header",
                       path, (long long)sb.st_size);
    }
    f->size = (size_t)sb.st_size;
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return ms_errf(err, errlen, "%s: mmap failed: %s", path, strerror(e));
    f->map = map;

    const unsigned char *p = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | p[i];
    if (hlen > ST_MAX_HEADER)
        return ms_errf(err, errlen,
                       "%s: header length %llu is absurd (limit %u bytes): not a safetensors file?",
                       path, (unsigned long long)hlen, ST_MAX_HEADER);
    if (hlen > f->size - 8)
        return ms_errf(err, errlen,
                       "%s: header length %llu runs past the end of the file (%zu bytes)", path,
                       (unsigned long long)hlen, f->size);
    json_error_t jerr;
    json_t *root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return ms_errf(err, errlen, "%s: header is not valid JSON: %s (offset %d)", path, jerr.text,
                       jerr.position);
    if (!json_is_object(root)) {
        json_decref(root);
        return ms_errf(err, errlen, "%s: header is not a JSON object", path);
    }
    const unsigned char *data = p + 8 + hlen;
    size_t data_len = f->size - 8 - (size_t)hlen;
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "__metadata__") == 0) {
            if ((rc = st_add_metadata(a, path, v, err, errlen)) != 0) break;
            continue;
        }
        if ((rc = st_add_entry(a, f, key, v, data, data_len, err, errlen)) != 0) break;
    }
    json_decref(root);
    return rc;
}

static int st_build_table(struct st_archive *a, char *err, size_t errlen)
{
    size_t size = 16;
    while (size < 2 * (size_t)a->n_tensors)
        size *= 2;
    a->table = malloc(size * sizeof *a->table);
    if (!a->table) return ms_errf(err, errlen, "safetensors: out of memory");
    a->table_size = size;
    for (size_t i = 0; i < size; i++)
        a->table[i] = -1;
    for (int i = 0; i < a->n_tensors; i++) {
        const struct st_tensor *t = &a->tensors[i];
        size_t h = (size_t)st_hash(t->name) & (size - 1);
        while (a->table[h] >= 0) {
            const struct st_tensor *o = &a->tensors[a->table[h]];
            if (strcmp(o->name, t->name) == 0)
                return ms_errf(err, errlen, "%s: tensor '%s' also appears in %s", t->file, t->name,
                               o->file);
            h = (h + 1) & (size - 1);
        }
        a->table[h] = i;
    }
    return 0;
}

const struct st_tensor *st_find(const struct st_archive *a, const char *name)
{
    if (!a || !a->table) return NULL;
    size_t h = (size_t)st_hash(name) & (a->table_size - 1);
    while (a->table[h] >= 0) {
        const struct st_tensor *t = &a->tensors[a->table[h]];
        if (strcmp(t->name, name) == 0) return t;
        h = (h + 1) & (a->table_size - 1);
    }
    return NULL;
}

int st_count(const struct st_archive *a)
{
    return a ? a->n_tensors : 0;
}

int st_file_count(const struct st_archive *a)
{
    return a->n_files;
}

const char *st_file_path(const struct st_archive *a, int i)
{
    return a->files[i].path;
}

int st_index(const struct st_archive *a, const struct st_tensor *t)
{
    return (int)(t - a->tensors);
}

void st_release_range(const struct st_tensor *t, size_t off, size_t len)
{
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0 || !t->data || off >= t->nbytes) return;
    if (len > t->nbytes - off) len = t->nbytes - off;
    /* inward: a page partly outside the range may hold bytes someone still reads in place */
    uintptr_t lo = ((uintptr_t)t->data + off + (uintptr_t)pg - 1) / (uintptr_t)pg * (uintptr_t)pg;
    uintptr_t hi = ((uintptr_t)t->data + off + len) / (uintptr_t)pg * (uintptr_t)pg;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void st_release_pages(const struct st_tensor *t)
{
    st_release_range(t, 0, t->nbytes);
}

const struct st_tensor *st_at(const struct st_archive *a, int i)
{
    return (a && i >= 0 && i < a->n_tensors) ? &a->tensors[i] : NULL;
}

int st_open_file(const char *path, struct st_archive **out, char *err, size_t errlen)
{
    *out = NULL;
    struct st_archive *a = calloc(1, sizeof *a);
    if (!a) return ms_errf(err, errlen, "%s: out of memory", path);
    if (st_add_file(a, path, err, errlen) != 0 || st_build_table(a, err, errlen) != 0) {
        st_close(a);
        return -1;
    }
    *out = a;
    return 0;
}

/* Opens the shards named by an index file. Shard names are relative to `dir`. */
static int st_open_index(const char *dir, const char *index_path, struct st_archive **out,
                         char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root = json_load_file(index_path, 0, &jerr);
    struct st_archive *a = NULL;
    char *shard = NULL;
    if (!root)
        return ms_errf(err, errlen, "%s: not valid JSON: %s (line %d)", index_path, jerr.text,
                       jerr.line);
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        ms_errf(err, errlen, "%s: missing 'weight_map' object", index_path);
        goto fail;
    }
    a = calloc(1, sizeof *a);
    size_t cap = strlen(dir) + 4096;
    shard = malloc(cap);
    if (!a || !shard) {
        ms_errf(err, errlen, "%s: out of memory", index_path);
        goto fail;
    }
    const char *key;
    json_t *v;
    /* First pass: open each distinct shard once, in first-mention order. */
    json_object_foreach(wm, key, v)
    {
        if (!json_is_string(v)) {
            ms_errf(err, errlen, "%s: weight_map['%s'] is not a string", index_path, key);
            goto fail;
        }
        const char *fn = json_string_value(v);
        if (strchr(fn, '/') || strcmp(fn, "..") == 0 || fn[0] == '\0') {
            ms_errf(err, errlen, "%s: shard name '%s' for tensor '%s' is not a plain file name",
                    index_path, fn, key);
            goto fail;
        }
        snprintf(shard, cap, "%s/%s", dir, fn);
        bool seen = false;
        for (int i = 0; i < a->n_files && !seen; i++)
            seen = strcmp(a->files[i].path, shard) == 0;
        if (seen) continue;
        if (st_add_file(a, shard, err, errlen) != 0) {
            size_t n = err ? strlen(err) : 0;
            if (err && n + 1 < errlen) snprintf(err + n, errlen - n, " (listed in %s)", index_path);
            goto fail;
        }
    }
    if (st_build_table(a, err, errlen) != 0) goto fail;
    /* Second pass: every listed tensor must be in the shard the index names. */
    json_object_foreach(wm, key, v)
    {
        snprintf(shard, cap, "%s/%s", dir, json_string_value(v));
        const struct st_tensor *t = st_find(a, key);
        if (!t || strcmp(t->file, shard) != 0) {
            ms_errf(err, errlen,
                    "%s: tensor '%s' is listed in shard %s but that file does not contain it",
                    index_path, key, shard);
            goto fail;
        }
    }
    free(shard);
    json_decref(root);
    *out = a;
    return 0;
fail:
    free(shard);
    st_close(a);
    json_decref(root);
    return -1;
}

int st_open_dir(const char *dir, struct st_archive **out, char *err, size_t errlen)
{
    *out = NULL;
    size_t cap = strlen(dir) + 64;
    char *path = malloc(cap);
    if (!path) return ms_errf(err, errlen, "%s: out of memory", dir);
    snprintf(path, cap, "%s/model.safetensors.index.json", dir);
    int rc;
    if (access(path, F_OK) == 0) {
        rc = st_open_index(dir, path, out, err, errlen);
    } else {
        snprintf(path, cap, "%s/model.safetensors", dir);
        if (access(path, F_OK) != 0)
            rc = ms_errf(err, errlen,
                         "%s: missing (no model.safetensors.index.json either): no weights in %s",
                         path, dir);
        else
            rc = st_open_file(path, out, err, errlen);
    }
    free(path);
    return rc;
}
