/* Weight cache files next to a model: key, map, write. See weight_cache.h. */
#include "weight_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

#define WCACHE_MAGIC "MOESERVE-WCACHE"
#define WCACHE_VERSION 1u
#define WCACHE_HEADER 4096

struct wcache_header {
    char magic[16];
    uint32_t version;
    uint32_t pad;
    uint64_t key;
    uint64_t bytes;
};

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t fnv_file(uint64_t h, const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    h = fnv(h, base, strlen(base) + 1);
    struct stat sb;
    if (stat(path, &sb) == 0) {
        int64_t v[3] = {(int64_t)sb.st_size, (int64_t)sb.st_mtim.tv_sec,
                        (int64_t)sb.st_mtim.tv_nsec};
        h = fnv(h, v, sizeof v);
    }
    return h;
}

uint64_t wcache_key(const char *model_dir, const struct st_archive *st, const char *tag)
{
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv(h, tag, strlen(tag) + 1);
    char cfg[4096];
    snprintf(cfg, sizeof cfg, "%s/config.json", model_dir); /* the layout follows the config */
    h = fnv_file(h, cfg);
    for (int i = 0; i < st_file_count(st); i++) h = fnv_file(h, st_file_path(st, i));
    return h;
}

void wcache_path(const char *model_dir, uint64_t key, char *path, size_t cap)
{
    snprintf(path, cap, "%s/.moeserve/weights-%016llx.bin", model_dir, (unsigned long long)key);
}

int wcache_map(const char *path, uint64_t key, size_t bytes, const void **data, void **map,
               size_t *map_len, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ms_errf(err, errlen, "%s: %s", path, strerror(errno));
    struct stat sb;
    struct wcache_header h;
    int rc = -1;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != WCACHE_HEADER + bytes) {
        ms_errf(err, errlen, "%s: not %zu bytes of weights", path, bytes);
        goto out;
    }
    if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || memcmp(h.magic, WCACHE_MAGIC, 16) != 0 ||
        h.version != WCACHE_VERSION || h.key != key || h.bytes != bytes) {
        ms_errf(err, errlen, "%s: another checkpoint, layout or set of options", path);
        goto out;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        ms_errf(err, errlen, "%s: mmap: %s", path, strerror(errno));
        goto out;
    }
    *map = m;
    *map_len = (size_t)sb.st_size;
    *data = (const char *)m + WCACHE_HEADER;
    rc = 0;
out:
    close(fd);
    return rc;
}

void wcache_unmap(void *map, size_t map_len)
{
    if (map) munmap(map, map_len);
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int wcache_write(const char *path, uint64_t key, const void *data, size_t bytes, char *err,
                 size_t errlen)
{
    char dir[4096], tmp[4200];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return ms_errf(err, errlen, "%s: %s", dir, strerror(errno));
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ms_errf(err, errlen, "%s: %s", tmp, strerror(errno));
    static const char zeros[WCACHE_HEADER];
    struct wcache_header h = {.version = WCACHE_VERSION, .key = key, .bytes = bytes};
    memcpy(h.magic, WCACHE_MAGIC, 16);
    int rc = write_all(fd, &h, sizeof h) || write_all(fd, zeros, WCACHE_HEADER - sizeof h) ||
                     write_all(fd, data, bytes)
                 ? -1
                 : 0;
    int e = errno;
    if (close(fd) != 0 && rc == 0) {
        rc = -1;
        e = errno;
    }
    if (rc == 0 && rename(tmp, path) != 0) {
        rc = -1;
        e = errno;
    }
    if (rc != 0) {
        unlink(tmp);
        return ms_errf(err, errlen, "%s: %s", path, strerror(e));
    }
    return 0;
}
