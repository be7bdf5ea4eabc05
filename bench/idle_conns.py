#!/usr/bin/env python3
"""idle_conns: what idle connections cost the HTTP core (not a test). Starts `moeserve serve`
(--binary, --model) with its connection cap set to --cap (by the descriptor limit it is given:
the server allows RLIMIT_NOFILE less 256), opens --conns idle connections to it (no request
sent), then measures /health on a fresh connection while they are open (latency p50 and max
over --probes requests) and the server's resident memory per idle connection, opens --over
more and counts those refused past the cap (503 or reset), and the time until the server has
closed them all after --timeout-keep-alive.

  python3 bench/idle_conns.py --binary build/moeserve --conns 5000 --over 2000 --cap 6000
"""

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def health(port):
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            piece = s.recv(4096)
            if not piece:
                break
            data += piece
    finally:
        s.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError("health: %r" % data[:80])
    return time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(REPO, "build", "moeserve"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "mohge-small"))
    ap.add_argument("--conns", type=int, default=5000, help="idle connections under the cap")
    ap.add_argument("--over", type=int, default=2000, help="connections opened after them")
    ap.add_argument("--cap", type=int, default=6000, help="the server's connection cap")
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--keep-alive", type=int, default=5, help="seconds")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.conns + args.over + 512
    if hard < need:
        sys.exit("the descriptor limit (%d) is below %d" % (hard, need))
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limit = args.cap + 256  # the server allows RLIMIT_NOFILE less 256 connections
    cmd = ["prlimit", "--nofile=%d:%d" % (limit, limit), args.binary, "serve", "--model",
           args.model, "--port", str(port), "--timeout-keep-alive", str(args.keep_alive)]
    log = tempfile.TemporaryFile()  # the server's log (a 503 line per refused connection)
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        for _ in range(300):
            if srv.poll() is not None:
                log.seek(0)
                sys.exit("the server exited: %s" % log.read().decode(errors="replace"))
            try:
                health(port)
                break
            except (OSError, RuntimeError):
                time.sleep(0.1)
        rss0, fds0 = rss_kb(srv.pid), open_fds(srv.pid)
        idle = []
        t0 = time.monotonic()
        for _ in range(args.conns):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        t_open = time.monotonic() - t0
        time.sleep(0.5)
        held = open_fds(srv.pid) - fds0
        rss1 = rss_kb(srv.pid)
        lat = sorted(health(port) for _ in range(args.probes))
        # past the cap: the server answers 503 (or resets) and closes; count those
        over = []
        for _ in range(args.over):
            try:
                over.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except OSError:
                pass
        time.sleep(0.5)
        refused = 0
        for s in over:
            s.setblocking(False)
            try:
                data = s.recv(64)
                refused += data.startswith(b"HTTP/1.1 503") or data == b""
            except ConnectionResetError:
                refused += 1
            except BlockingIOError:
                pass
        idle += over
        t1 = time.monotonic()
        while open_fds(srv.pid) > fds0 + 2 and time.monotonic() - t1 < args.keep_alive * 4:
            time.sleep(0.05)
        t_close = time.monotonic() - t1
        for s in idle:
            s.close()
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    print("| binary | idle connections | held by the server | then opened | refused past the "
          "cap | open time (s) | /health p50 (ms) | /health max (ms) | RSS per held connection "
          "(bytes) | all closed after (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("| %s | %d | %d | %d | %d | %.2f | %.2f | %.2f | %.0f | %.1f |" % (
        args.binary, args.conns, held, args.over, refused, t_open, 1e3 * lat[len(lat) // 2],
        1e3 * lat[-1],
        1024.0 * (rss1 - rss0) / max(held, 1), t_close))


if __name__ == "__main__":
    main()
