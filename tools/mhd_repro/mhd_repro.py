#!/usr/bin/env python3
"""mhd_repro: reproduces the libmicrohttpd defects that made moeserve write its own HTTP core
(issue 12; README, "Dependencies"). Builds mhd_server.c against the installed libmicrohttpd
(Debian's libmicrohttpd-dev: 0.9.75 when measured), runs it in epoll and in poll mode, sends
each probe on a raw socket, and prints what came back in a table. Not a test: it needs the
library, which moeserve does not use.

  apt-get install libmicrohttpd-dev
  python3 tools/mhd_repro/mhd_repro.py [--moeserve build/moeserve]

With --moeserve the same probes also go to moeserve's own core, in a last column.
"""

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def build(out):
    try:
        flags = subprocess.check_output(["pkg-config", "--cflags", "--libs", "libmicrohttpd"],
                                        text=True).split()
    except (OSError, subprocess.CalledProcessError):
        sys.exit("libmicrohttpd not found by pkg-config (apt-get install libmicrohttpd-dev)")
    subprocess.check_call(["cc", "-O1", "-o", out, os.path.join(HERE, "mhd_server.c")] + flags +
                          ["-lpthread"])


class Server:
    def __init__(self, exe, mode, wait_s):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, str(self.port), mode, str(wait_s)],
                                     stdout=subprocess.PIPE, text=True)
        self.lines = []
        self.version = self.proc.stdout.readline().split()[-1]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.split())

    def stop(self):
        self.proc.kill()
        self.proc.wait()

    def close_wait(self):
        """the server's sockets in CLOSE-WAIT (the peer closed, the server has not)"""
        out = subprocess.check_output(["ss", "-tanH", "state", "close-wait", "sport", "=",
                                       ":%d" % self.port], text=True)
        return len([l for l in out.splitlines() if l.strip()])


def exchange(port, data, wait=1.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    try:
        s.sendall(data)
        got = b""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                piece = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                got += b"<reset>"
                break
            if not piece:
                break
            got += piece
        return got
    finally:
        s.close()


def describe(resp):
    if not resp:
        return "no reply"
    heads = re.findall(rb"HTTP/1\.[01] (\d{3})", resp)
    ctype = re.search(rb"\r\nContent-Type: ([^\r]*)", resp, re.I)
    body = resp.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in resp else b""
    what = "%s, %s" % ("/".join(h.decode() for h in heads) or "?",
                       ctype.group(1).decode() if ctype else "no Content-Type")
    if len(heads) > 1:
        what += ", status line sent %d times" % len(heads)
    if body.lstrip().startswith(b"<"):
        what += ", HTML body"
    return what


PROBES = [
    ("header line of 100 KB", b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 +
     b"\r\n\r\n"),
    ("URI of 100 KB", b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("HTTP/2.7 request line", b"GET / HTTP/2.7\r\nHost: x\r\n\r\n"),
    ("HTTP/1.1 without Host", b"GET / HTTP/1.1\r\n\r\n"),
    ("Content-Length: abc", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"),
    ("Content-Length past 2^64", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
     b"99999999999999999999999\r\n\r\n"),
    ("GARBAGE", b"GARBAGE\r\n\r\n"),
    ("two different Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
     b"Content-Length: 4\r\n\r\nabcd"),
    ("space before the colon (Host : x)", b"GET / HTTP/1.1\r\nHost : x\r\n\r\n"),
]


def half_requests(srv, n):
    """n clients send part of a request and close; the server's sockets still in CLOSE-WAIT
    3 s later (moeserve: none; it closes on the EOF)"""
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        s.close()
    time.sleep(3)
    return srv.close_wait()


def suspended_hangup(srv, wait_s):
    """a client sends a request the server suspends (waiting on the engine) and leaves after
    0.3 s: when does the library report it (moeserve: within the 50 ms reset watch)"""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    time.sleep(0.3)
    s.close()
    while time.monotonic() - t0 < wait_s + 5:
        done = [l for l in srv.lines if l[:2] == ["completed", "/wait"]]
        sus = [l for l in srv.lines if l[:2] == ["suspended", "/wait"]]
        if done and sus:
            return float(done[0][3]) - float(sus[0][3]) - 0.3
        time.sleep(0.05)
    return None


class Moeserve(Server):
    """the same probes against moeserve's own core, for comparison"""

    def __init__(self, exe):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, "serve", "--model", os.path.join(
            os.path.dirname(os.path.dirname(HERE)), "models", "mohge-small"), "--port",
            str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                if exchange(self.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 0.5):
                    return
            except OSError:
                time.sleep(0.1)
        sys.exit("moeserve did not start")


def moeserve_column(rows):
    """fills the moeserve column of the table first when --moeserve BINARY is given"""
    if "--moeserve" not in sys.argv:
        return False
    srv = Moeserve(sys.argv[sys.argv.index("--moeserve") + 1])
    try:
        for name, data in PROBES:
            rows[name] = [describe(exchange(srv.port, data))]
        rows["300 partial requests, then close: server sockets in CLOSE-WAIT 3 s later"] = [
            str(half_requests(srv, 300))]
    finally:
        srv.stop()
    return True


def main():
    wait_s = 5.0
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "mhd_server")
        build(exe)
        rows = {}
        version = "?"
        ms = moeserve_column(rows)
        for mode in ("epoll", "poll"):
            srv = Server(exe, mode, wait_s)
            version = srv.version
            try:
                for name, data in PROBES:
                    rows.setdefault(name, []).append(describe(exchange(srv.port, data)))
                rows.setdefault("300 partial requests, then close: server sockets in "
                                "CLOSE-WAIT 3 s later", []).append(str(half_requests(srv, 300)))
                lag = suspended_hangup(srv, wait_s)
                rows.setdefault("client leaves a suspended request: seen after (s)", []).append(
                    "%.2f (the resume, %.0f s later)" % (lag, wait_s) if lag is not None
                    else "not within %.0f s" % (wait_s + 5))
            finally:
                srv.stop()
    print("libmicrohttpd %s\n" % version)
    print("| probe | epoll mode | poll mode |%s" % (" moeserve |" if ms else ""))
    print("|---|---|---|%s" % ("---|" if ms else ""))
    for name, got in rows.items():
        if ms:  # moeserve ran first; its cell goes last ("-": tests/server/test_hostile.py)
            got = got[1:] + [got[0]] if len(got) == 3 else got + ["- (test_hostile.py)"]
        print("| %s | %s |" % (name, " | ".join(got)))


if __name__ == "__main__":
    main()
