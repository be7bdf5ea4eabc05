/* moeserve entry point: dispatches to a subcommand (generate, serve); with no subcommand, or
 * options only, it serves. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "serve.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: moeserve <command> [options]\n"
               "\n"
               "commands:\n"
               "  serve      OpenAI-compatible HTTP server (the default)\n"
               "  generate   run a prompt through a model and print the continuation\n"
               "  trace      record, synthesize and summarize routing traces\n"
               "  placement-sim  replay a routing trace onto 2..256 devices per placement policy\n"
               "  healthcheck    exit 0 when the local server's /health answers 200\n"
               "\n"
               "`moeserve <command> --help` lists a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strncmp(argv[1], "--", 2) == 0 && strcmp(argv[1], "--help") != 0))
        return cli_serve(argc, argv);
    if (strcmp(argv[1], "generate") == 0) return cli_generate(argc - 1, argv + 1);
    if (strcmp(argv[1], "serve") == 0) return cli_serve(argc - 1, argv + 1);
    if (strcmp(argv[1], "trace") == 0) return cli_trace(argc - 1, argv + 1);
    if (strcmp(argv[1], "placement-sim") == 0) return cli_placement_sim(argc - 1, argv + 1);
    if (strcmp(argv[1], "healthcheck") == 0) return cli_healthcheck(argc - 1, argv + 1);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "moeserve: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
