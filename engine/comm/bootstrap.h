/* TCP rendezvous that hands one small blob (the NCCL unique id) from the process holding global
 * rank 0 to every other process of a multi-node world, before any of them starts NCCL.
 *
 * Protocol: the serving side listens; each fetching side connects and sends nothing. Once all
 * n_peers fetchers are connected, the server sends each the header (8 bytes of magic
 * "MSBOOT1\0", then the blob length as a uint32 in network byte order) and the blob, and waits
 * for one byte back: 'K' (kept) or 'N' (rejected by the caller's check). All or nothing: no
 * fetcher gets the blob unless every one of them is connected, so when the server gives up the
 * connected fetchers see the connection close and fail too, instead of going on alone.
 *
 * A connection that closes or sends anything while the server is still gathering peers (a TCP
 * health probe, a port scanner, a fetcher that gave up) is dropped and its place given to the
 * next one; after the blob has gone out, a peer that closes or rejects fails the rendezvous.
 *
 * Time: every blocking step waits with poll() against one deadline on the monotonic clock,
 * timeout_ms after the call began; EINTR restarts the wait with the time left. Name resolution
 * (getaddrinfo) is the one step that cannot be bounded: it has the resolver's own timeouts.
 * Nothing changes process-wide state: sends use MSG_NOSIGNAL instead of touching SIGPIPE, and
 * every socket is opened close-on-exec and closed on every path before the call returns.
 *
 * Errors: -1 with a one-line reason in err ("bootstrap: ..."), naming the address and the step. */
#ifndef MOESERVE_BOOTSTRAP_H
#define MOESERVE_BOOTSTRAP_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" { /* also called by the NCCL communicator (kernels/cuda/comm_nccl.cu is C++) */
#endif

/* Largest blob either side accepts, so a corrupt header cannot make a fetcher wait for
 * gigabytes. */
#define BOOTSTRAP_MAX_BLOB (1u << 20)
/* Most peers one server waits for (one pollfd each). */
#define BOOTSTRAP_MAX_PEERS 4096

/* Rank 0's side: listen on host:port (host: a name or literal such as "0.0.0.0" or "::"; NULL or
 * "" for every local address), wait for n_peers (1..BOOTSTRAP_MAX_PEERS) fetchers, give each
 * the len-byte blob and collect their acknowledgements. 0 once every peer has kept the blob. The
 * blob is only read, and only during the call. */
int bootstrap_serve(const char *host, int port, int n_peers, const void *blob, size_t len,
                    int timeout_ms, char *err, size_t errlen);

/* Another process's side: connect to host:port, retrying with a short backoff until the
 * deadline (the server may start later than this process, or its name may not resolve yet),
 * then read exactly len bytes into blob (OUT) and acknowledge them. The length the server
 * announces must equal len. On failure blob may hold part of a transfer. */
int bootstrap_fetch(const char *host, int port, void *blob, size_t len, int timeout_ms, char *err,
                    size_t errlen);

/* bootstrap_fetch with a check run on the blob before acknowledging it: when check returns -1
 * (with a reason in its err), the server is told 'N' so that it fails at once rather than
 * waiting on a peer that will not join, and this call returns -1 with check's reason. check may
 * be NULL. */
int bootstrap_fetch_checked(const char *host, int port, void *blob, size_t len, int timeout_ms,
                            int (*check)(const void *blob, size_t len, void *ctx, char *err,
                                         size_t errlen),
                            void *ctx, char *err, size_t errlen);

/* Splits "host:port" or "[v6-literal]:port" into host (OUT, hostlen bytes, brackets removed)
 * and port (OUT, 1..65535). An IPv6 literal without brackets is refused: its last colon could
 * be part of the address. */
int bootstrap_parse_addr(const char *s, char *host, size_t hostlen, int *port, char *err,
                         size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
