/* `moeserve serve`: the OpenAI-compatible HTTP server subcommand (flags in serve.c's --help). */
#ifndef MOESERVE_SERVE_H
#define MOESERVE_SERVE_H

/* Returns the process exit status: 0 after a clean SIGTERM/SIGINT shutdown. */
int cli_serve(int argc, char **argv);

#endif
