/* Helpers shared by the subcommands: the model-loading progress bar, where the bundled
 * default model is found when no --model is given, and checked command-line numbers. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

void cli_progress(void *ctx, double fraction)
{
    static int last = -1;
    int pct = (int)(fraction * 100.0 + 0.5);
    if (pct == last || !isatty(STDERR_FILENO)) return;
    last = pct;
    int width = 30, fill = pct * width / 100;
    fprintf(stderr, "\r%s [", ctx ? (const char *)ctx : "loading");
    for (int i = 0; i < width; i++) fputc(i < fill ? '#' : ' ', stderr);
    fprintf(stderr, "] %3d%%%s", pct, pct >= 100 ? "\n" : "");
    fflush(stderr);
}

static int is_model_dir(const char *dir)
{
    char path[PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path) return 0;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

const char *cli_default_model(char *buf, size_t n)
{
    /* The places, in order: ./models/<default> (a checkout's root); next to the binary: its
     * own folder (a build tree, where CMake links models/ to the source's), its parent
     * (build/moeserve in a checkout), ../share/moeserve/models (installed, wherever the prefix
     * was moved); the configured install prefix; /models/<default> (the container image). */
    char exe[PATH_MAX] = "";
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[len > 0 ? len : 0] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    char cand[6][PATH_MAX + 64];
    int nc = 0;
    snprintf(cand[nc++], sizeof cand[0], "%s", CLI_DEFAULT_MODEL);
    if (slash) {
        snprintf(cand[nc++], sizeof cand[0], "%s/%s", exe, CLI_DEFAULT_MODEL);
        snprintf(cand[nc++], sizeof cand[0], "%s/../%s", exe, CLI_DEFAULT_MODEL);
        snprintf(cand[nc++], sizeof cand[0], "%s/../share/moeserve/%s", exe, CLI_DEFAULT_MODEL);
    }
#ifdef MOESERVE_DATA_DIR
    snprintf(cand[nc++], sizeof cand[0], "%s/%s", MOESERVE_DATA_DIR, CLI_DEFAULT_MODEL);
#endif
    snprintf(cand[nc++], sizeof cand[0], "/%s", CLI_DEFAULT_MODEL);
    for (int i = 0; i < nc; i++)
        if (is_model_dir(cand[i]) && snprintf(buf, n, "%s", cand[i]) < (int)n) return buf;
    int w = snprintf(buf, n, "no --model given, and the bundled model (%s) is in none of: ",
                     CLI_DEFAULT_MODEL);
    for (int i = 0; i < nc && w >= 0 && (size_t)w < n; i++)
        w += snprintf(buf + w, n - (size_t)w, "%s%s", i ? ", " : "", cand[i]);
    return NULL;
}

char *cli_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
            if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                buf = NULL;
            } else {
                buf[n] = '\0';
                if (len) *len = (size_t)n;
            }
        }
    }
    fclose(f);
    return buf;
}

int cli_parse_long(const char *cmd, const char *name, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "moeserve %s: %s must be an integer in [%ld, %ld], got '%s'\n", cmd, name,
                lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_int(const char *cmd, const char *name, const char *s, long lo, long hi, int *out)
{
    long v;
    if (cli_parse_long(cmd, name, s, lo, hi, &v) != 0) return -1;
    *out = (int)v;
    return 0;
}

int cli_parse_double(const char *cmd, const char *name, const char *s, double lo, double hi,
                     double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "moeserve %s: %s must be a number in [%g, %g], got '%s'\n", cmd, name, lo,
                hi, s);
        return -1;
    }
    *out = v;
    return 0;
}
