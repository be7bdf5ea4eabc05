/* Subcommands of the moeserve binary. Each returns the process exit status. */
#ifndef MOESERVE_CLI_H
#define MOESERVE_CLI_H

int cli_generate(int argc, char **argv);
/* `moeserve trace info|record|synth` and `moeserve placement-sim` (cli_routing.c). */
int cli_trace(int argc, char **argv);
int cli_placement_sim(int argc, char **argv);
/* `moeserve analyze` and `moeserve prune`: expert collaboration groups (cli_collab.c). */
int cli_analyze(int argc, char **argv);
int cli_prune(int argc, char **argv);
/* `moeserve healthcheck`: exit 0 when the local server's /health answers 200 (cli_health.c). */
int cli_healthcheck(int argc, char **argv);

#include <stddef.h>

/* The bundled model, relative to the repository (or image) root. */
#define CLI_DEFAULT_MODEL "models/mohge-small"

/* Shared by subcommands: a progress bar on stderr for model loading (ctx: label string). */
void cli_progress(void *ctx, double fraction);

/* Folder of the bundled model when no --model is given, written into buf: ./models/...,
 * then relative to the binary (models/... beside it in a build tree, ../models/... from a
 * checkout's build/, ../share/moeserve/models/... when installed), the configured install
 * prefix, /models/... (the container). Returns buf, or NULL with buf holding a message that
 * names every place looked in. */
const char *cli_default_model(char *buf, size_t n);

/* The continuous-experts budget flags (--moe-samples, --moe-neuron-fraction; 0 = not given)
 * against the model: 0, or -1 with a message naming the flag (another model, or outside the
 * model's bounds). Defined in cli_generate.c. */
struct model_desc;
int cli_cont_budget(const struct model_desc *md, int samples, double fraction, char *err,
                    size_t errlen);

/* Command-line numbers for subcommand `cmd`: the whole string must parse and lie in [lo, hi];
 * 0, or -1 after a message naming the option ("moeserve CMD: NAME must be ..."). */
int cli_parse_long(const char *cmd, const char *name, const char *s, long lo, long hi,
                   long *out);
int cli_parse_int(const char *cmd, const char *name, const char *s, long lo, long hi, int *out);
int cli_parse_double(const char *cmd, const char *name, const char *s, double lo, double hi,
                     double *out);

/* A whole file, NUL-terminated, in malloc'd memory (its length in *len when len is not NULL),
 * or NULL when it cannot be read. */
char *cli_read_file(const char *path, size_t *len);

#endif
