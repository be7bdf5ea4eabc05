/* Minimal test harness shared by every tests/test_*.c: CHECK records a failure with its
 * location and goes on; test_done() prints "N passed, N failed" and returns the exit code.
 * Each test binary gets the tests/ folder as argv[1] so it can find its fixtures. */
#ifndef MOESERVE_TEST_H
#define MOESERVE_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_passed_, test_failed_;

#define CHECK(cond)                                                                               \
    do {                                                                                          \
        if (cond) {                                                                               \
            test_passed_++;                                                                       \
        } else {                                                                                  \
            test_failed_++;                                                                       \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);              \
        }                                                                                         \
    } while (0)

#define CHECKF(cond, ...)                                                                         \
    do {                                                                                          \
        if (cond) {                                                                               \
            test_passed_++;                                                                       \
        } else {                                                                                  \
            test_failed_++;                                                                       \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);              \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fputc('\n', stderr);                                                                  \
        }                                                                                         \
    } while (0)

/* Path of a file below the tests/ folder given on the command line. */
static inline const char *test_path(const char *tests_dir, const char *rel)
{
    static char buf[4][4096];
    static int slot;
    char *p = buf[slot++ & 3];
    snprintf(p, 4096, "%s/%s", tests_dir, rel);
    return p;
}

static inline int test_done(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, test_passed_, test_failed_);
    return test_failed_ ? 1 : 0;
}

#endif
