/* Kernel selection: which of the kernel tables (portable C, AVX2, AVX-512) this CPU runs,
 * decided once from cpuid (GCC's __builtin_cpu_supports, which also checks that the OS saves
 * the vector registers), overridable with MOESERVE_CPU_KERNELS for tests and comparisons. */
#include "gemm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t gemm_act_bytes(enum act_kind kind, int n, int k)
{
    size_t kp = (size_t)act_kpad(k), rows = (size_t)(n > 0 ? n : 1);
    switch (kind) {
    case ACT_F32:
    case ACT_EO: return rows * kp * 4;
    case ACT_BF16: return rows * kp * 2;
    case ACT_Q8: return rows * kp + rows * (kp / 32) * 8;
    }
    return 0;
}

#if defined(__x86_64__)
#include <cpuid.h>

/* The features, read once: a kernel asks per call, and CPUID itself traps to the hypervisor
 * in a virtual machine (microseconds). F16C comes from cpuid leaf 1 directly, as clang's
 * __builtin_cpu_supports does not know "f16c". */
static struct {
    int f16c, avx2, avx512, vnni, bf16;
} feat;
static pthread_once_t feat_once = PTHREAD_ONCE_INIT;

static void read_features(void)
{
    unsigned a, b, c, d;
    feat.f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    feat.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && feat.f16c;
    feat.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  feat.avx2;
    feat.vnni = feat.avx512 && __builtin_cpu_supports("avx512vnni");
    feat.bf16 = feat.avx512 && __builtin_cpu_supports("avx512bf16");
}

static int has_f16c(void)
{
    pthread_once(&feat_once, read_features);
    return feat.f16c;
}

static int has_avx2(void)
{
    pthread_once(&feat_once, read_features);
    return feat.avx2;
}

int cpu_has_avx512_vnni(void)
{
    pthread_once(&feat_once, read_features);
    return feat.vnni;
}

int cpu_has_avx512_bf16(void)
{
    pthread_once(&feat_once, read_features);
    return feat.bf16;
}
#else
static int has_avx2(void)
{
    return 0;
}
static int has_avx512(void)
{
    return 0;
}
int cpu_has_avx512_vnni(void)
{
    return 0;
}
int cpu_has_avx512_bf16(void)
{
    return 0;
}
#endif

const struct gemm_kernels *gemm_kernels_portable(void)
{
    return &gemm_portable;
}

const struct gemm_kernels *gemm_kernels_avx2(void)
{
    return has_avx2() ? &gemm_avx2 : NULL;
}

/* The AVX-512 table needs VNNI for its int8 kernels; without it the AVX2 table is used. */
const struct gemm_kernels *gemm_kernels_avx512(void)
{
    return cpu_has_avx512_vnni() ? &gemm_avx512 : NULL;
}

static const struct gemm_kernels *best;
static pthread_once_t best_once = PTHREAD_ONCE_INIT;

static void pick_best(void)
{
    const char *force = getenv("MOESERVE_CPU_KERNELS");
    if (force && *force) {
        const struct gemm_kernels *k = strcmp(force, "portable") == 0 ? gemm_kernels_portable()
                                       : strcmp(force, "avx2") == 0   ? gemm_kernels_avx2()
                                       : strcmp(force, "avx512") == 0 ? gemm_kernels_avx512()
                                                                      : NULL;
        if (k) {
            best = k;
            return;
        }
        fprintf(stderr, "moeserve: MOESERVE_CPU_KERNELS=%s is not available on this CPU (%s); "
                        "choosing by cpuid\n",
                force, cpu_features_string());
    }
    best = gemm_kernels_avx512();
    if (!best) best = gemm_kernels_avx2();
    if (!best) best = gemm_kernels_portable();
}

const struct gemm_kernels *gemm_kernels_best(void)
{
    pthread_once(&best_once, pick_best);
    return best;
}

const char *cpu_features_string(void)
{
    static char buf[160];
#if defined(__x86_64__)
    static const char *names[] = {"avx2",     "fma",      "f16c",       "avx512f",
                                  "avx512bw", "avx512vl", "avx512vnni", "avx512bf16"};
    size_t k = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        int on = 0;
        /* __builtin_cpu_supports takes a literal only. */
        switch (i) {
        case 0: on = __builtin_cpu_supports("avx2"); break;
        case 1: on = __builtin_cpu_supports("fma"); break;
        case 2: on = has_f16c(); break;
        case 3: on = __builtin_cpu_supports("avx512f"); break;
        case 4: on = __builtin_cpu_supports("avx512bw"); break;
        case 5: on = __builtin_cpu_supports("avx512vl"); break;
        case 6: on = __builtin_cpu_supports("avx512vnni"); break;
        case 7: on = __builtin_cpu_supports("avx512bf16"); break;
        }
        if (on && k < sizeof buf)
            k += (size_t)snprintf(buf + k, sizeof buf - k, "%s%s", k ? " " : "", names[i]);
    }
    if (!buf[0]) snprintf(buf, sizeof buf, "no AVX2");
#else
    snprintf(buf, sizeof buf, "not x86-64");
#endif
    return buf;
}
