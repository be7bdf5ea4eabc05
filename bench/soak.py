#!/usr/bin/env python3
"""Soak and fault bench (not a test): many concurrent streaming clients for a long time on
loopback, some of which hang up at random moments (before the answer, while queued, mid-stream)
and some of which read slowly (small buffers, pauses), against a server it starts (--binary,
--model) or one already running (--url and --pid). Every 10 s it prints the server's RSS, open
descriptors, running/waiting requests and KV usage; at the end, errors by kind, TTFT and
inter-token latency (p50/p99), and whether the server went back to idle: no request left, every
KV block free, descriptors back to where they started.

  python3 bench/soak.py --binary build/moeserve --model models/mohge-small          # 1,000 x 10 min
  python3 bench/soak.py --binary build/moeserve --clients 200 --duration 60         # a short run

Clients are asyncio tasks speaking raw HTTP/1.1 with keep-alive; a request is a streaming
/v1/completions with ignore_eos and a random max_tokens. An error is anything a well-behaved
client would not expect: a status other than 200, a connection reset or closed early, a stream
without its final chunk and [DONE], malformed chunked or SSE framing, no progress for 120 s.
Hang-ups the bench causes itself are counted, not errors.
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

from bench_server import free_port, get  # same folder

PROMPTS = ["ROMEO:", "JULIET: O", "First Citizen:\nBefore we proceed", "KING HENRY:",
           "To be, or not to be", "Now is the winter of our discontent"]


def metrics(port):
    st, body = get("127.0.0.1", port, "/metrics")
    out = {}  # name -> value summed over its label sets
    for line in body.decode().splitlines():
        m = re.match(r"^(moeserve_[a-z_]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def proc_stats(pid):
    rss = 0
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/%d/fd" % pid))


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))]


class Stats:
    def __init__(self):
        self.errors = {}
        self.completed = 0
        self.hangups = {}
        self.ttft = []
        self.itl = []
        self.tokens = 0

    def error(self, kind):
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def hangup(self, kind):
        self.hangups[kind] = self.hangups.get(kind, 0) + 1


class Broken(Exception):
    """The server broke the protocol or the connection: an error of this kind."""


async def read_stream(reader, slow, cut_after, st, t0):
    """Reads a chunked SSE body. Returns 'done', or 'cut' when cut_after events were read."""
    events, last, buf, done = 0, None, b"", False
    while True:
        line = await asyncio.wait_for(reader.readline(), 120)
        if not line.endswith(b"\r\n"):
            raise Broken("closed_early")
        try:
            size = int(line.split(b";")[0], 16)
        except ValueError:
            raise Broken("bad_chunk")
        data = await asyncio.wait_for(reader.readexactly(size + 2), 120)
        if data[-2:] != b"\r\n":
            raise Broken("bad_chunk")
        if size == 0:
            if not done or buf:
                raise Broken("no_done")
            return "done"
        buf += data[:-2]
        while True:
            ev, sep, rest = buf.partition(b"\n\n")
            if not sep:
                break
            buf = rest
            if done or not ev.startswith(b"data: "):
                raise Broken("bad_sse")
            if ev == b"data: [DONE]":
                done = True
                continue
            now = time.monotonic()
            payload = json.loads(ev[6:])
            if payload.get("choices") and payload["choices"][0].get("text"):
                if last is None:
                    st.ttft.append(now - t0)
                else:
                    st.itl.append(now - last)
                last = now
                st.tokens += 1
            events += 1
            if cut_after is not None and events >= cut_after:
                return "cut"
        if slow:
            await asyncio.sleep(random.uniform(0.02, 0.2))


def note(args, what):
    if args.verbose:
        print("  error: %s" % what, flush=True)


async def client(port, st, end, args, rng):
    reader = writer = None
    reused = False  # the connection carried a request before (keep-alive)
    while time.monotonic() < end:
        r = rng.random()
        mode = "hangup" if r < args.disconnect else "slow" if r < args.disconnect + args.slow \
            else "normal"
        body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 64),
                           "ignore_eos": True, "stream": True, "temperature": 0.8}).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json"
               b"\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        try:
            if writer is None:
                reused = False
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, limit=4096 if mode == "slow" else 65536)
                if mode == "slow":
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                               socket.SO_RCVBUF, 4096)
            t0 = time.monotonic()
            writer.write(req)
            await writer.drain()
            if mode == "hangup" and rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.5))  # gone before or while queued
                writer.transport.abort()
                reader = writer = None
                st.hangup("before_answer")
                continue
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 300)
            except asyncio.IncompleteReadError as e:
                if e.partial or not reused:
                    raise
                # The server closed the connection while it sat idle, as it may after
                # --timeout-keep-alive (RFC 9112 9.3.1): a client opens a new one and retries.
                st.hangup("keep_alive_closed_retry")
                writer.transport.abort()
                reader = writer = None
                continue
            reused = True
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                await reader.readexactly(int(m.group(1)) if m else 0)
                st.error("http_%d" % status)
                continue
            cut = rng.randint(1, 20) if mode == "hangup" else None
            how = await read_stream(reader, mode == "slow", cut, st, t0)
            if how == "cut":
                writer.transport.abort()
                reader = writer = None
                st.hangup("mid_stream")
            else:
                st.completed += 1
        except asyncio.CancelledError:
            break
        except Broken as e:
            st.error(str(e))
            note(args, "%s (%s client)" % (e, mode))
        except asyncio.TimeoutError:
            st.error("no_progress_120s")
        except asyncio.IncompleteReadError as e:
            st.error("closed_early")
            note(args, "closed early after %d bytes (%s client)" % (len(e.partial), mode))
        except (ConnectionResetError, BrokenPipeError):
            st.error("reset")
        except OSError as e:
            st.error("os_%s" % (e.errno or type(e).__name__))
        else:
            continue
        if writer is not None:  # after an error: a fresh connection
            writer.transport.abort()
            reader = writer = None
    if writer is not None:
        writer.transport.abort()


async def sampler(port, pid, st, end, rows):
    t_start = time.monotonic()
    while True:
        await asyncio.sleep(10)
        loop = asyncio.get_running_loop()
        m = await loop.run_in_executor(None, metrics, port)
        rss, fds = proc_stats(pid)
        row = (time.monotonic() - t_start, rss / 1e6, fds,
               int(m.get("moeserve_num_requests_running", 0)),
               int(m.get("moeserve_num_requests_waiting", 0)),
               100 * m.get("moeserve_kv_cache_usage_perc", 0), st.completed, sum(st.errors.values()))
        rows.append(row)
        print("%6.0fs  rss %7.1f MB  fds %5d  running %4d  waiting %4d  kv %5.1f%%  done %6d  "
              "errors %d" % row, flush=True)
        if time.monotonic() >= end:
            return


async def run(args, port, pid):
    st, rows = Stats(), []
    rss0, fds0 = proc_stats(pid)
    m0 = metrics(port)
    print("start: rss %.1f MB, fds %d, KV blocks %d" % (rss0 / 1e6, fds0,
                                                        m0.get("moeserve_kv_cache_blocks", 0)))
    end = time.monotonic() + args.duration
    rng = random.Random(args.seed)
    tasks = [asyncio.create_task(client(port, st, end, args, random.Random(rng.random())))
             for _ in range(args.clients)]
    samp = asyncio.create_task(sampler(port, pid, st, end, rows))
    await asyncio.sleep(args.duration)
    for t in tasks:
        t.cancel()  # clients still mid-request hang up: the server must clean up after them
    await asyncio.gather(*tasks, return_exceptions=True)
    await samp
    # back to idle?
    deadline = time.monotonic() + 60
    while True:
        m = metrics(port)
        rss, fds = proc_stats(pid)
        idle = (m.get("moeserve_num_requests_running", 1) == 0 and
                m.get("moeserve_num_requests_waiting", 1) == 0 and
                m.get("moeserve_kv_cache_blocks_free") == m.get("moeserve_kv_cache_blocks") and
                fds <= fds0)
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return st, rows, (rss0, fds0), (rss, fds, m), idle


def report(args, st, rows, start, end_state, idle, wall):
    rss0, fds0 = start
    rss, fds, m = end_state
    print()
    print("| %d clients, %d s, disconnect %.0f%%, slow %.0f%% | |" % (
        args.clients, args.duration, 100 * args.disconnect, 100 * args.slow))
    print("|---|---|")
    print("| streams completed | %d (%d tokens, %.0f tokens/s) |" % (
        st.completed, st.tokens, st.tokens / wall))
    print("| hang-ups caused (before answer / mid-stream) | %d / %d |" % (
        st.hangups.get("before_answer", 0), st.hangups.get("mid_stream", 0)))
    print("| idle keep-alive connections the server closed (retried) | %d |" % (
        st.hangups.get("keep_alive_closed_retry", 0)))
    print("| errors | %s |" % (", ".join("%s %d" % kv for kv in sorted(st.errors.items()))
                                or "none"))
    print("| TTFT p50 / p99 | %.3f s / %.3f s |" % (pct(st.ttft, 50), pct(st.ttft, 99)))
    print("| inter-token latency p50 / p99 | %.1f ms / %.1f ms |" % (
        1e3 * pct(st.itl, 50), 1e3 * pct(st.itl, 99)))
    print("| RSS start / max / end | %.1f / %.1f / %.1f MB |" % (
        rss0 / 1e6, max([r[1] for r in rows] + [rss / 1e6]), rss / 1e6))
    print("| open fds start / end | %d / %d |" % (fds0, fds))
    print("| KV blocks free / total at the end | %d / %d |" % (
        m.get("moeserve_kv_cache_blocks_free", -1), m.get("moeserve_kv_cache_blocks", -1)))
    print("| back to idle | %s |" % ("yes" if idle else "NO"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="moeserve binary to start")
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "models",
                                                     "mohge-small"))
    ap.add_argument("--url", help="a running server instead (needs --pid)")
    ap.add_argument("--pid", type=int, help="the running server's process id")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=int, default=600, help="seconds")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of requests hung up")
    ap.add_argument("--slow", type=float, default=0.1, help="share of slow readers")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print each error as it happens")
    ap.add_argument("--server-args", default="--max-num-seqs 64 --max-waiting 2048",
                    help="extra flags for the started server")
    args = ap.parse_args()
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.clients * 2 + 256)), hard))
    proc = None
    if args.url:
        port, pid = int(args.url.rsplit(":", 1)[1].split("/")[0]), args.pid
        if not pid:
            sys.exit("--url needs --pid (the server's RSS and descriptors are read from /proc)")
    else:
        if not args.binary:
            sys.exit("give --binary (and --model) or --url and --pid")
        port = free_port()
        proc = subprocess.Popen([args.binary, "serve", "--model", args.model, "--port",
                                 str(port)] + args.server_args.split(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid = proc.pid
        for _ in range(600):
            try:
                if get("127.0.0.1", port, "/health", 2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
    t0 = time.monotonic()
    try:
        st, rows, start, end_state, idle = asyncio.run(run(args, port, pid))
        report(args, st, rows, start, end_state, idle, time.monotonic() - t0)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
            print("server exit status %d" % rc)
    sys.exit(0 if idle and not st.errors else 1)


if __name__ == "__main__":
    main()
