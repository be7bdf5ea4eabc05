/* Subcommands of the moeserve binary. Each returns the process exit status. */
#ifndef MOESERVE_CLI_H
#define MOESERVE_CLI_H

int cli_generate(int argc, char **argv);

/* Shared by subcommands: a progress bar on stderr for model loading (ctx: label string). */
void cli_progress(void *ctx, double fraction);

#endif
