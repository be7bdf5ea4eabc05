/* GPU roofline floors (not a test): measures, on the GPU it runs on, the HBM read bandwidth, the
 * device-to-device copy bandwidth and the dense bf16 GEMM rate (kernels/cuda/floors.h), and
 * prints them with the ridge point. The GPU benchmark script runs it in the same session as the
 * MoE layer timings, so a layer is judged against floors of the same machine:
 * floor = max(weight bytes / HBM rate, FLOPs / bf16 rate), see moe_floor_seconds.
 *
 *   bench_floors [--device N] [--bytes GiB] [--gemm N] [--reps N] [--json]
 *
 * Exits 0 with the table (or one JSON object with --json) on stdout, 77 (skip) with a message
 * on stderr when the build has no CUDA or the machine no GPU, 2 on a bad option, 1 when a
 * measurement fails. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cuda/floors.h"
#ifdef MOESERVE_HAVE_CUDA
#include "cuda/backend_cuda.h"
#endif

#define BF_SKIP 77

struct bf_opts {
    int device;
    double gib; /* HBM and copy buffer size */
    int gemm;   /* square GEMM side */
    int reps;
    int json;
};

static int bf_usage(void)
{
    fprintf(stderr, "usage: bench_floors [--device N] [--bytes GiB (default 2)] "
                    "[--gemm N (default 8192)] [--reps N (default 20)] [--json]\n");
    return 2;
}

/* Whole-string integer in [lo, hi]; -1 with a message otherwise. */
static int bf_int(const char *opt, const char *s, int lo, int hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "bench_floors: %s wants an integer in [%d, %d], got '%s'\n", opt, lo, hi,
                s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int bf_parse(int argc, char **argv, struct bf_opts *o)
{
    *o = (struct bf_opts){.device = 0, .gib = 2.0, .gemm = 8192, .reps = 20, .json = 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--json") == 0) {
            o->json = 1;
            continue;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) return -1;
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_floors: %s needs a value\n", a);
            return -1;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--device") == 0) {
            if (bf_int(a, v, 0, 1023, &o->device) < 0) return -1;
        } else if (strcmp(a, "--gemm") == 0) {
            if (bf_int(a, v, 1, 65536, &o->gemm) < 0) return -1;
        } else if (strcmp(a, "--reps") == 0) {
            if (bf_int(a, v, 1, 100000, &o->reps) < 0) return -1;
        } else if (strcmp(a, "--bytes") == 0) {
            char *end;
            errno = 0;
            o->gib = strtod(v, &end);
            if (errno || end == v || *end || !(o->gib > 0) || o->gib > 1024) {
                fprintf(stderr, "bench_floors: --bytes wants GiB in (0, 1024], got '%s'\n", v);
                return -1;
            }
        } else {
            fprintf(stderr, "bench_floors: unknown option %s\n", a);
            return -1;
        }
    }
    return 0;
}

#ifdef MOESERVE_HAVE_CUDA

/* A JSON string body: GPU names are plain ASCII, but a quote or backslash must not break the
 * line the benchmark script parses. */
static void bf_json_str(const char *s)
{
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') putchar('\\');
        if ((unsigned char)*s >= 0x20) putchar(*s);
    }
}

static int bf_run(const struct bf_opts *o)
{
    int count = backend_cuda_device_count();
    if (count < 1) {
        fprintf(stderr, "bench_floors: no CUDA device on this machine: nothing to measure\n");
        return BF_SKIP;
    }
    char err[MS_ERR_LEN];
    struct cuda_floor_device dev;
    size_t bytes = (size_t)(o->gib * 1073741824.0);
    double hbm = 0, copy = 0, tflops = 0;
    if (cuda_floor_device_info(o->device, &dev, err, sizeof err) < 0 ||
        cuda_floor_hbm(o->device, bytes, o->reps, &hbm, err, sizeof err) < 0 ||
        cuda_floor_copy(o->device, bytes, o->reps, &copy, err, sizeof err) < 0 ||
        cuda_floor_bf16_gemm(o->device, o->gemm, o->gemm, o->gemm, o->reps, &tflops, err,
                             sizeof err) < 0) {
        fprintf(stderr, "bench_floors: %s\n", err);
        return 1;
    }
    /* FLOPs per HBM byte at which a kernel stops being bandwidth-bound: a MoE layer's expert
     * GEMMs at decode batch sizes sit far below it. */
    double ridge = tflops * 1e12 / (hbm * 1e9);

    if (o->json) {
        printf("{\"device\":%d,\"name\":\"", o->device);
        bf_json_str(dev.name);
        printf("\",\"sm_count\":%d,\"l2_bytes\":%zu,\"mem_bytes\":%zu,\"peak_hbm_gbps\":%.1f,"
               "\"hbm_read_gbps\":%.1f,\"copy_gbps\":%.1f,\"bf16_tflops\":%.1f,"
               "\"ridge_flop_per_byte\":%.1f,\"bytes\":%zu,\"gemm\":%d,\"reps\":%d,"
               "\"stat\":\"best\"}\n",
               dev.sm_count, dev.l2_bytes, dev.mem_bytes, dev.peak_hbm_gbps, hbm, copy, tflops,
               ridge, bytes, o->gemm, o->reps);
        return 0;
    }
    printf("device %d: %s, %d SMs, %.0f MiB L2, %.1f GiB memory", o->device, dev.name, dev.sm_count,
           dev.l2_bytes / 1048576.0, dev.mem_bytes / 1073741824.0);
    if (dev.peak_hbm_gbps > 0) printf(", datasheet HBM peak %.0f GB/s", dev.peak_hbm_gbps);
    printf("\nbest of %d reps each\n", o->reps);
    printf("%-34s %12s  %s\n", "floor", "rate", "unit");
    char what[64];
    snprintf(what, sizeof what, "hbm read (%.2f GiB)", o->gib);
    printf("%-34s %12.1f  GB/s", what, hbm);
    if (dev.peak_hbm_gbps > 0) printf("  (%.0f%% of peak)", 100.0 * hbm / dev.peak_hbm_gbps);
    printf("\n");
    snprintf(what, sizeof what, "d2d copy (%.2f GiB, read+write)", o->gib);
    printf("%-34s %12.1f  GB/s\n", what, copy);
    snprintf(what, sizeof what, "bf16 gemm (%d^3)", o->gemm);
    printf("%-34s %12.1f  TFLOP/s\n", what, tflops);
    printf("%-34s %12.1f  FLOP/byte\n", "ridge point (gemm / hbm read)", ridge);
    return 0;
}

#else

static int bf_run(const struct bf_opts *o)
{
    fprintf(stderr, "bench_floors: built without CUDA (MOESERVE_CUDA=OFF): no GPU floors to "
                    "measure\n");
    return BF_SKIP;
}

#endif

int main(int argc, char **argv)
{
    struct bf_opts o;
    if (bf_parse(argc, argv, &o) < 0) return bf_usage();
    return bf_run(&o);
}
