"""Hostile and broken clients (issue 12), one test class per failure found:
1. clients that send part of a request and close leave no socket behind (CLOSE-WAIT), and a
   client that leaves while its request is read, prepared (the preparation pool), queued,
   running or streaming is seen at once;
2. silent connections are closed after --timeout-keep-alive and cannot fill the server (the
   connection cap follows RLIMIT_NOFILE); trickled requests meet --timeout-request-read (408);
4. clients that leave while queued free their queue slots at once (no 429 for a live client);
5. with --api-key an unauthenticated request is answered 401 from its head, its body never read;
6. every HTTP-level error is OpenAI error JSON, sent once; malformed framing is refused;
   chunked bodies get their 413 as the limit is passed;
7. the Bearer scheme is case-insensitive;
8. n larger than --max-waiting is a 400 saying why, not a 429.
(3, signals, is in test_shutdown.py.) Counts come from /proc (server sockets, TCP states, RSS);
waits are bounded polls of a condition, never sleeps."""
import json
import os
import re
import select
import socket
import threading
import time
import unittest

import srvtest

CMPL = "/v1/completions"


def head(path=CMPL, method="POST", extra=b"", length=None):
    h = b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % (
        method.encode(), path.encode())
    if length is not None:
        h += b"Content-Length: %d\r\n" % length
    return h + extra + b"\r\n"


def body_of(obj):
    return json.dumps(obj).encode()


def post_raw(obj, path=CMPL, extra=b""):
    b = body_of(obj)
    return head(path, extra=extra, length=len(b)) + b


def mohge_small():
    return os.path.join(srvtest.tests_dir(), "..", "models", "mohge-small")


def wait_metrics(srv, pred, timeout, what):
    return srvtest.wait_until(lambda: (lambda m: pred(m) and m)(srv.metrics()), timeout, what)


class ClientLeavesTest(srvtest.SharedServer):
    """1. A client closing its socket is seen whatever its request is doing."""

    def sockets(self):
        return srvtest.open_sockets(self.srv.proc.pid)

    def settled(self, base, timeout=5):
        srvtest.wait_until(lambda: self.sockets() <= base, timeout,
                           "the server to close the sockets of clients that left")
        srvtest.wait_until(lambda: srvtest.tcp_states(self.srv.port).get("CLOSE_WAIT", 0) == 0,
                           timeout, "no server socket in CLOSE-WAIT")

    def test_partial_requests_then_close(self):
        base = self.sockets()
        partial = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len",
                   head(length=100) + b'{"prompt": "x"',
                   head(extra=b"Transfer-Encoding: chunked\r\n") + b"5\r\n{\"pro",
                   b"GET /health HTTP/1.1\r\nHo"]
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", self.srv.port))
            s.sendall(partial[i % len(partial)])
            s.close()
        self.settled(base)

    def test_leave_while_running_or_streaming(self):
        base = self.sockets()
        for stream in (False, True):
            s = socket.create_connection(("127.0.0.1", self.srv.port))
            s.sendall(post_raw({"prompt": "Hello", "max_tokens": 500, "ignore_eos": True,
                                "stream": stream}))
            if stream:
                s.recv(100)  # the stream started
            s.close()
        self.settled(base)
        wait_metrics(self.srv, lambda m: m.total("moeserve_num_requests_running") == 0, 10,
                     "the abandoned generations to be cancelled")

    def test_leave_while_prepared(self):
        # Bodies that take the preparation pool a while (a big schema to compile, a long text
        # to tokenize), each client gone before its answer: the job finishes on its own, frees
        # the request and cancels what it submitted; nothing is left running or open.
        base = self.sockets()
        props = {"p%d" % i: {"type": "string"} for i in range(3000)}
        bodies = [(CMPL, {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": st,
                          "guided_json": {"type": "object", "properties": dict(props, **{
                              "k%d" % k: {"type": "integer"}})}})
                  for k, st in enumerate((False, True) * 4)]
        bodies += [("/tokenize", {"prompt": "word " * 50000})] * 4
        for path, body in bodies:
            s = socket.create_connection(("127.0.0.1", self.srv.port))
            s.sendall(post_raw(body, path=path))
            s.close()
        self.settled(base)
        wait_metrics(self.srv, lambda m: m.total("moeserve_num_requests_running") == 0 and
                     m.total("moeserve_num_requests_waiting") == 0, 30,
                     "the abandoned requests to be dropped")
        st, _, r = srvtest.post_json(self.srv.port, CMPL, {"prompt": "x", "max_tokens": 2})
        self.assertEqual(st, 200, r)


class IdleConnectionsTest(unittest.TestCase):
    """2. Silent sockets: closed after the keep-alive timeout, and more of them than the old
    4,096 cap do not lock a client out."""

    N = 4200

    def test_silent_sockets(self):
        if not srvtest.raise_nofile(self.N + 500):
            self.skipTest("the descriptor limit is below %d" % (self.N + 500))
        with srvtest.Server() as srv:
            base = srvtest.open_sockets(srv.proc.pid)
            silent = []
            try:
                for _ in range(self.N):
                    silent.append(socket.create_connection(("127.0.0.1", srv.port)))
                t0 = time.monotonic()
                st, _, body = srvtest.request(srv.port, "GET", "/health", timeout=10)
                self.assertEqual(st, 200, body)
                self.assertLess(time.monotonic() - t0, 5)
                # closed by the server once idle for --timeout-keep-alive (5 s by default)
                srvtest.wait_until(lambda: srvtest.open_sockets(srv.proc.pid) <= base, 15,
                                   "the silent sockets to be closed")
                for s in silent[:20]:
                    s.settimeout(5)
                    self.assertEqual(s.recv(10), b"")  # EOF, no bytes
            finally:
                for s in silent:
                    s.close()
            self.assertRegex(srv.output(), r"RLIMIT_NOFILE \d+ .*up to \d+ connections")

    def test_keep_alive_and_read_deadline(self):
        with srvtest.Server("--timeout-keep-alive", "1", "--timeout-request-read", "2") as srv:
            # an idle keep-alive connection is closed after the response
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            st, _, _, _ = srvtest.parse_response(s.recv(65536))
            self.assertEqual(st, 200)
            t0 = time.monotonic()
            self.assertEqual(s.recv(10), b"")
            self.assertLess(time.monotonic() - t0, 4)
            s.close()
            # a stalled request: 408 as JSON
            raw = srvtest.raw_exchange(srv.port, head(length=50) + b'{"pro', timeout=10)
            st, hdrs, body, _ = srvtest.parse_response(raw)
            self.assertEqual(st, 408, raw)
            self.assertEqual(json.loads(body)["error"]["code"], "request_timeout")
            # a trickled head: never idle for a second, still cut at the 2 s deadline
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            t0 = time.monotonic()
            got = b""
            for ch in (b"GET /health HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 100):
                try:
                    s.sendall(bytes([ch]))
                except OSError:
                    break
                r, _, _ = select.select([s], [], [], 0.3)  # the trickle's pace
                if r:
                    got = s.recv(65536)
                    break
            s.close()
            self.assertTrue(got.startswith(b"HTTP/1.1 408 "), got)
            self.assertLess(time.monotonic() - t0, 6)


class QueuedClientsLeaveTest(unittest.TestCase):
    """4. Clients that give up while queued free their slots at once."""

    def test_queue_slots_freed(self):
        with srvtest.Server("--max-num-seqs", "1", "--max-waiting", "9", "--max-model-len",
                            "1024", model=mohge_small()) as srv:
            # one long request: choice 0 runs, choice 1 waits behind it (waiting = 1)
            long_out = []
            t = threading.Thread(target=lambda: long_out.append(srvtest.request(
                srv.port, "POST", CMPL, {"prompt": "ROMEO:", "max_tokens": 1000, "n": 2,
                                         "ignore_eos": True}, timeout=300)))
            t.start()
            wait_metrics(srv, lambda m: m.total("moeserve_num_requests_running") == 1 and
                         m.total("moeserve_num_requests_waiting") == 1, 30, "the long request")
            # 8 clients fill the queue, then give up
            quitters = []
            for i in range(8):
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.sendall(post_raw({"prompt": "Hi", "max_tokens": 5, "stream": i % 2 == 1}))
                quitters.append(s)
            wait_metrics(srv, lambda m: m.total("moeserve_num_requests_waiting") == 9, 30,
                         "the queue to fill")
            for s in quitters:
                s.close()
            m = wait_metrics(srv, lambda m: m.total("moeserve_num_requests_waiting") == 1, 5,
                             "the quitters' slots to be freed")
            self.assertEqual(m.total("moeserve_num_requests_running"), 1,
                             "the long request ended before the check: inconclusive")
            st, _, body = srvtest.post_json(srv.port, CMPL, {"prompt": "Hi", "max_tokens": 2},
                                            timeout=300)
            self.assertEqual(st, 200, body)
            t.join(300)
            self.assertEqual(long_out[0][0], 200)


class AuthBeforeBodyTest(srvtest.SharedServer):
    """5 and 7. The key is checked from the head; the scheme is case-insensitive."""
    SERVER_ARGS = ("--api-key", "k3y")

    def test_401_before_the_body(self):
        for extra in (b"", b"Expect: 100-continue\r\n"):
            s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=10)
            s.sendall(head(length=1000000, extra=extra))  # the body never comes
            raw = s.recv(65536)
            s.close()
            st, hdrs, body, _ = srvtest.parse_response(raw)
            self.assertEqual(st, 401, raw)
            self.assertEqual(hdrs.get("www-authenticate"), "Bearer")
            self.assertEqual(json.loads(body)["error"]["type"], "authentication_error")

    def test_unauthenticated_bodies_are_not_buffered(self):
        """100 clients send all of a 1 MiB body but its last byte and wait: a server that
        buffers bodies before checking the key holds 100 MiB."""
        pid = self.srv.proc.pid
        rss0 = srvtest.rss_bytes(pid)
        body = b"x" * (1 << 20)
        conns = []

        def send(s):
            try:
                s.sendall(head(length=len(body)) + body[:-1])
            except OSError:
                pass  # refused and closed after the 401: expected
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=30)
            conns.append(s)
        threads = [threading.Thread(target=send, args=(s,)) for s in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        grown = srvtest.rss_bytes(pid) - rss0
        for s in conns:
            s.close()
        self.assertLess(grown, 24 << 20, "100 unauthenticated 1 MiB bodies grew RSS by %d MB"
                        % (grown >> 20))

    def test_bearer_scheme_case_insensitive(self):
        for auth in ("bearer k3y", "BEARER k3y", "Bearer  k3y", "bEaReR\tk3y"):
            st, _, raw = srvtest.request(self.srv.port, "POST", CMPL,
                                         {"prompt": "x", "max_tokens": 1},
                                         {"Authorization": auth})
            self.assertEqual(st, 200, "%r: %r" % (auth, raw))
        for auth in ("bearer k3Y", "bearerk3y", "Basic k3y"):
            st, _, _ = srvtest.request(self.srv.port, "POST", CMPL,
                                       {"prompt": "x", "max_tokens": 1}, {"Authorization": auth})
            self.assertEqual(st, 401, auth)


BIG = 40000
PROTOCOL_ERRORS = [  # (what, raw request, status)
    ("garbage", b"GARBAGE\r\n\r\n", 400),
    ("bad Content-Length", head(length=None, extra=b"Content-Length: abc\r\n"), 400),
    ("overflowing Content-Length",
     head(length=None, extra=b"Content-Length: 99999999999999999999999\r\n"), 413),
    ("conflicting Content-Length",
     head("/tokenize", length=15, extra=b"Content-Length: 16\r\n") + b'{"prompt":"ab"}', 400),
    ("Content-Length and chunked",
     head("/tokenize", length=15, extra=b"Transfer-Encoding: chunked\r\n"), 400),
    ("space before colon", b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    ("no Host", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("two Hosts", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("obs-fold", b"GET /health HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),
    ("bare CR", b"GET /health HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    ("long URI", b"GET /" + b"a" * BIG + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("huge header", b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * BIG + b"\r\n\r\n", 431),
    ("many headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" +
     b"".join(b"X%d: y\r\n" % i for i in range(3000)) + b"\r\n", 431),
    ("unknown expectation", head("/tokenize", length=2, extra=b"Expect: teapot\r\n") + b"{}", 417),
    ("POST without a length", head("/tokenize"), 411),
    ("gzip transfer coding", head("/tokenize", extra=b"Transfer-Encoding: gzip, chunked\r\n"),
     501),
    ("bad chunk", head("/tokenize", extra=b"Transfer-Encoding: chunked\r\n") + b"zz\r\n", 400),
    ("unknown route", b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("wrong method", b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n", 405),
]


class HttpErrorsTest(srvtest.SharedServer):
    """6. HTTP-level errors are OpenAI error JSON, sent once."""

    def exchange(self, data):
        """Sends data; returns (the bytes of one response and whatever followed within a
        moment, whether the server then closed the connection)."""
        s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=10)
        raw, closed = b"", False
        try:
            s.sendall(data)
            while True:
                if b"\r\n\r\n" in raw:
                    h = raw.split(b"\r\n\r\n", 1)[0].lower()
                    n = int(h.split(b"content-length:")[1].split(b"\r\n")[0]) \
                        if b"content-length:" in h else 0
                    if len(raw) >= len(h) + 4 + n:
                        break
                piece = s.recv(65536)
                if not piece:
                    return raw, True
                raw += piece
            r, _, _ = select.select([s], [], [], 0.5)
            if r:
                piece = s.recv(65536)
                raw += piece
                closed = not piece
        except (ConnectionResetError, socket.timeout):
            closed = True
        finally:
            s.close()
        return raw, closed

    def test_protocol_errors(self):
        for what, raw_req, want in PROTOCOL_ERRORS:
            raw, closed = self.exchange(raw_req)
            self.assertEqual(len(re.findall(rb"(?:^|\r\n)HTTP/1\.[01] \d\d\d ", raw)), 1,
                             "%s: one status line: %r" % (what, raw[:400]))
            st, hdrs, body, rest = srvtest.parse_response(raw)
            self.assertEqual(st, want, "%s: %r" % (what, raw[:400]))
            self.assertEqual(rest, b"", what)
            self.assertEqual(hdrs.get("content-type"), "application/json", what)
            err = json.loads(body)["error"]
            self.assertEqual(set(err), {"message", "type", "param", "code"}, what)
            self.assertEqual(err["type"], "not_found_error" if want == 404
                             else "invalid_request_error", what)
            # a request whose framing failed cannot be followed by another on the connection
            self.assertEqual(closed, want not in (404, 405, 411), what)
        st, _, _ = srvtest.request(self.srv.port, "GET", "/health")
        self.assertEqual(st, 200)

    def test_chunked_413_as_it_arrives(self):
        s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=30)
        s.sendall(head(extra=b"Transfer-Encoding: chunked\r\n"))
        piece = b"a" * 65536
        chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
        sent, got = 0, b""
        while sent < (8 << 20) and not got:
            try:
                s.sendall(chunk)
                sent += len(piece)
            except OSError:
                pass  # closed after the answer: read it below
            r, _, _ = select.select([s], [], [], 0.01)
            if r:
                got = s.recv(65536)
        if not got and select.select([s], [], [], 2)[0]:
            got = s.recv(65536)
        s.close()
        self.assertTrue(got.startswith(b"HTTP/1.1 413 "), got[:200])
        self.assertLess(sent, 4 << 20, "the 413 came after %d bytes" % sent)

    def test_keep_alive_and_pipelining(self):
        reqs = b"".join([b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                         post_raw({"prompt": "ab"}, "/tokenize"),
                         b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
        raw = srvtest.raw_exchange(self.srv.port, reqs)
        statuses = []
        while raw:
            st, _, _, raw = srvtest.parse_response(raw)
            statuses.append(st)
        self.assertEqual(statuses, [200, 200, 200])


class TooManySequencesTest(unittest.TestCase):
    """8. More choices than the queue holds: 400, not 429."""

    def test_n_above_max_waiting(self):
        with srvtest.Server("--max-waiting", "4") as srv:
            for body, param in (({"prompt": "x", "n": 5, "max_tokens": 1}, "n"),
                                ({"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1},
                                 "prompt")):
                st, hdrs, raw = srvtest.request(srv.port, "POST", CMPL, body)
                self.assertEqual(st, 400, raw)
                self.assertNotIn("retry-after", hdrs)
                err = json.loads(raw)["error"]
                self.assertEqual(err["param"], param)
                self.assertIn("--max-waiting", err["message"])
            st, _, raw = srvtest.request(srv.port, "POST", CMPL,
                                         {"prompt": "x", "n": 4, "max_tokens": 1})
            self.assertEqual(st, 200, raw)


if __name__ == "__main__":
    srvtest.main()
