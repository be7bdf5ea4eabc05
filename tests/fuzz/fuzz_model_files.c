/* libFuzzer harness: the model files a server reads before it serves: config.json (and
 * generation_config.json) through model_desc_parse, and a safetensors file (8-byte header
 * length, JSON header, data) through st_open_file, which maps it from a memfd. The first byte
 * picks the format. Every malformed file must be an error naming the file, never a crash. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "model.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint8_t sink; /* tensor bytes are read so that a bad mapping would fault */

static void fuzz_config(const char *text, size_t len)
{
    struct model_desc desc;
    char err[512];
    memset(&desc, 0, sizeof desc);
    if (model_desc_parse(text, len, "config.json", &desc, err, sizeof err) == 0) {
        model_desc_apply_generation_config(&desc, text, len, "generation_config.json", err,
                                           sizeof err);
        model_desc_free(&desc);
    } else if (!strstr(err, "config.json")) {
        abort(); /* errors name the file */
    }
}

static void fuzz_safetensors(const uint8_t *bytes, size_t len)
{
    int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
    if (fd < 0) return;
    if (len && write(fd, bytes, len) != (ssize_t)len) {
        close(fd);
        return;
    }
    char path[64], err[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    struct st_archive *a;
    if (st_open_file(path, &a, err, sizeof err) == 0) {
        for (int i = 0; i < st_count(a); i++) {
            const struct st_tensor *t = st_at(a, i);
            if (st_find(a, t->name) == NULL) abort();
            for (size_t b = 0; b < t->nbytes; b += 4096)
                sink ^= ((const uint8_t *)t->data)[b];
            if (t->nbytes) sink ^= ((const uint8_t *)t->data)[t->nbytes - 1];
        }
        st_metadata(a, "format");
        st_close(a);
    } else if (!strstr(err, path)) {
        abort();
    }
    close(fd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] & 1)
        fuzz_safetensors(data + 1, size - 1);
    else
        fuzz_config((const char *)data + 1, size - 1);
    return 0;
}
