"""Shared harness for the server tests: starts a `moeserve serve` process on a free loopback
port serving a fixture model, waits (bounded polling of /health) until it is ready, and stops
it with SIGTERM, checking that it exits 0. Also small raw-HTTP helpers (http.client, no extra
packages) and a Prometheus text parser for /metrics, so tests wait on conditions, never on sleeps.

The binary and the tests/ folder come from the command line (see run.py) or the environment:
MOESERVE_BIN and MOESERVE_TESTS_DIR. Each test file is a unittest module.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SKIP_RC = 77  # CTest SKIP_RETURN_CODE: a required tool (openai, promtool, curl) is missing


def binary():
    b = os.environ.get("MOESERVE_BIN")
    if not b or not os.access(b, os.X_OK):
        raise RuntimeError("set MOESERVE_BIN to the built moeserve binary (got %r)" % b)
    return b


def tests_dir():
    return os.environ.get("MOESERVE_TESTS_DIR",
                          os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fixture_model(name="mixtral"):
    return os.path.join(tests_dir(), "fixtures", "models", name)


def bundled_model():
    """The bundled model folder (models/mohge-small), next to tests/."""
    return os.path.join(os.path.dirname(tests_dir()), "models", "mohge-small")


def free_port():
    """A port the kernel just handed out; the server binds it right after (tiny race only
    with other processes doing the same, retried by Server.start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout, what, interval=0.02):
    """Polls pred() until it returns a truthy value (returned) or timeout seconds pass."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s (last: %r)"
                                 % (timeout, what, last))
        time.sleep(interval)


class Server:
    """One `moeserve serve` child process. Use as a context manager."""

    def __init__(self, *extra, model=None, name=None, env=None, ready_timeout=60,
                 launcher=None):
        self.extra = list(extra)
        self.launcher = list(launcher or [])  # a command the server runs under (mpirun ...)
        self.model = model or fixture_model()
        self.name = name
        self.env = env
        self.ready_timeout = ready_timeout
        self.proc = None
        self.port = None
        self.log = None

    @property
    def base(self):
        return "http://127.0.0.1:%d" % self.port

    def start(self):
        last_err = None
        for _ in range(3):
            self.port = free_port()
            self.log = tempfile.TemporaryFile()
            args = self.launcher + [binary(), "serve", "--model", self.model, "--port", str(self.port),
                    "--host", "127.0.0.1"] + self.extra
            if self.name:
                args += ["--served-model-name", self.name]
            env = dict(os.environ)
            for k in list(env):
                if k.startswith("MOESERVE_") and k not in ("MOESERVE_BIN", "MOESERVE_TESTS_DIR"):
                    del env[k]  # the flags under test come from the command line only
            env.update(self.env or {})
            self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=env)
            try:
                wait_until(self._ready, self.ready_timeout, "GET /health == 200")
                return self
            except AssertionError as e:
                last_err = e
                if self.proc.poll() is None:
                    self.proc.kill()
                self.proc.wait()
                sys.stderr.write(self.output())
                self.close()
        raise AssertionError("server did not start: %s" % last_err)

    def _ready(self):
        if self.proc.poll() is not None:
            raise AssertionError("server exited with %d:\n%s" % (self.proc.returncode,
                                                                 self.output()))
        try:
            st, _, _ = request(self.port, "GET", "/health", timeout=2)
            return st == 200
        except OSError:
            return False

    def output(self):
        if not self.log:
            return ""
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self, timeout=30):
        """SIGTERM, then expects exit status 0 within timeout seconds. Returns the status."""
        if not self.proc or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("server ignored SIGTERM for %ds:\n%s" % (timeout, self.output()))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        rc = self.stop()
        try:
            if exc[0] is None and rc != 0:
                raise AssertionError("server exited with %d:\n%s" % (rc, self.output()))
        finally:
            self.close()
        return False

    def close(self):
        """Drops the captured log (after stop)."""
        if self.log:
            self.log.close()
            self.log = None

    def metrics(self):
        st, _, body = request(self.port, "GET", "/metrics")
        assert st == 200, st
        return parse_metrics(body.decode())


class SharedServer(unittest.TestCase):
    """A test class whose tests share one server, started with the class's SERVER_ARGS."""
    SERVER_ARGS = ()

    @classmethod
    def setUpClass(cls):
        cls.srv = Server(*cls.SERVER_ARGS).start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)


def request(port, method, path, body=None, headers=None, timeout=60):
    """One HTTP/1.1 request. body: dict/list (sent as JSON), str or bytes.
    Returns (status, headers as a lower-cased dict, raw body bytes)."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=hdrs)
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        c.close()


def post_json(port, path, body, headers=None, timeout=60):
    st, h, data = request(port, "POST", path, body, headers, timeout)
    return st, h, json.loads(data) if data else None


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')


def parse_metrics(text):
    """Prometheus text -> {(name, frozenset(labels)): value}, plus get()/total() helpers."""
    out = Metrics()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise AssertionError("unparsable metrics line: %r" % line)
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


class Metrics(dict):
    def total(self, name, **labels):
        """Sum over the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.items() if n == name and want <= set(ls))

    def has(self, name):
        return any(n == name for n, _ in self)


def sse_events(raw):
    """Splits a text/event-stream body into the payloads of its `data:` events, checking the
    framing: every event is exactly one `data: ...` line followed by a blank line."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    assert text.endswith("\n\n"), "stream does not end with a blank line: %r" % text[-40:]
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), "bad SSE event %r" % block[:80]
        assert "\n" not in block, "multi-line SSE event %r" % block[:80]
        events.append(block[len("data: "):])
    return events


def open_sockets(pid):
    """Sockets the process holds, from /proc/PID/fd."""
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            n += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return n


_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
               "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
               "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def tcp_states(port):
    """{state: count} of the TCP sockets whose local port is `port` (the server's side of its
    connections), from /proc/net/tcp."""
    counts = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port:
                st = _TCP_STATES.get(parts[3], parts[3])
                counts[st] = counts.get(st, 0) + 1
    return counts


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def raise_nofile(n):
    """Raises this process's descriptor limit to at least n; False when the hard limit is
    lower."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        return False
    if soft == resource.RLIM_INFINITY or soft >= n:
        return True
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return True


def raw_exchange(port, data, timeout=10, shut=False):
    """Sends raw bytes on a new connection and returns everything received until the server
    closes (or timeout seconds pass: then b"<timeout>" is appended)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    try:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        while True:
            piece = s.recv(65536)
            if not piece:
                break
            out += piece
    except socket.timeout:
        out += b"<timeout>"
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return out


def parse_response(raw):
    """One HTTP/1.1 response from raw bytes: (status, lower-cased headers, body, rest)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, "no complete response head in %r" % raw[:200]
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    n = int(hdrs.get("content-length", len(rest)))
    return status, hdrs, rest[:n], rest[n:]


def tokenize(port, text):
    st, _, body = post_json(port, "/tokenize", {"prompt": text})
    assert st == 200, body
    return body["tokens"]


def main():
    """Entry point of each test file: `python3 test_x.py [BIN [TESTS_DIR]] [unittest args]`."""
    argv = sys.argv[1:]
    if argv and not argv[0].startswith("-"):
        os.environ["MOESERVE_BIN"] = os.path.abspath(argv.pop(0))
        if argv and not argv[0].startswith("-"):
            os.environ["MOESERVE_TESTS_DIR"] = os.path.abspath(argv.pop(0))
    prog = unittest.main(module="__main__", argv=[sys.argv[0], "-v"] + argv, exit=False)
    r = prog.result
    if not r.wasSuccessful():
        sys.exit(1)
    if r.testsRun and len(r.skipped) == r.testsRun:
        sys.exit(SKIP_RC)
    sys.exit(0)
