"""The server's log lines: one access-log line per HTTP request (JSON with --log-format json,
key=value text otherwise) whose fields match what the client saw (response id, status, token
counts from `usage`, finish reason, the client's own address and port); a request refused
before its head was read (a malformed request line) gets one too. Also: the periodic stats
line, model-load progress as log lines when stderr is not a terminal (it is a file here), and
a bind failure naming the port that was asked for."""
import json
import socket
import subprocess
import unittest

import srvtest


def json_lines(srv):
    out = []
    for line in srv.output().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # every JSON-format line must parse
    return out


def access_lines(srv):
    return [l for l in json_lines(srv) if l.get("msg") == "access"]


def raw_request(port, data):
    """Sends raw bytes; returns (the local "address:port" used, the reply's first line)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        local = "%s:%d" % s.getsockname()
        s.sendall(data)
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        return local, reply.split(b"\r\n", 1)[0].decode()
    finally:
        s.close()


def post(port, path, body, headers=None):
    """POST on a connection whose local address we know: (local, status, parsed body)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        local = "%s:%d" % s.getsockname()
        head = "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               "Content-Length: %d\r\nConnection: close\r\n" % (path, len(data))
        for k, v in (headers or {}).items():
            head += "%s: %s\r\n" % (k, v)
        s.sendall(head.encode() + b"\r\n" + data)
        raw = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    finally:
        s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return local, status, body


class AccessLogJson(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server("--log-format", "json", "--api-key", "k",
                                 "--log-stats-interval", "1").start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def wait_access(self, pred, what):
        return srvtest.wait_until(lambda: [a for a in access_lines(self.srv) if pred(a)], 10, what)

    def test_completion_line(self):
        local, st, body = post(self.srv.port, "/v1/completions",
                               {"prompt": "Hello there", "max_tokens": 7, "ignore_eos": True},
                               {"Authorization": "Bearer k"})
        self.assertEqual(st, 200)
        r = json.loads(body)
        [a] = self.wait_access(lambda a: a.get("id") == r["id"], "the access line of " + r["id"])
        self.assertEqual(a["route"], "/v1/completions")
        self.assertEqual(a["method"], "POST")
        self.assertEqual(a["status"], 200)
        self.assertEqual(a["client"], local)
        self.assertEqual(a["prompt_tokens"], r["usage"]["prompt_tokens"])
        self.assertEqual(a["completion_tokens"], r["usage"]["completion_tokens"])
        self.assertEqual(a["completion_tokens"], 7)
        self.assertEqual(a["finish_reason"], "length")
        self.assertEqual(a["outcome"], "sent")
        self.assertGreater(a["ttft_s"], 0)
        self.assertGreaterEqual(a["duration_s"], a["ttft_s"])
        self.assertEqual(a["level"], "info")

    def test_stream_line(self):
        local, st, body = post(self.srv.port, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 5, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}},
                               {"Authorization": "Bearer k"})
        self.assertEqual(st, 200)
        # chunked body: the usage chunk carries the id and the counts
        events = [json.loads(l[6:]) for l in body.decode().split("\n")
                  if l.startswith("data: {")]
        usage = [e["usage"] for e in events if e.get("usage")][-1]
        rid = events[0]["id"]
        [a] = self.wait_access(lambda a: a.get("id") == rid, "the access line of " + rid)
        self.assertEqual((a["status"], a["client"], a["route"]),
                         (200, local, "/v1/chat/completions"))
        self.assertEqual(a["prompt_tokens"], usage["prompt_tokens"])
        self.assertEqual(a["completion_tokens"], usage["completion_tokens"])
        self.assertEqual(a["finish_reason"], "length")

    def test_refused_and_other_routes(self):
        local, st, _ = post(self.srv.port, "/v1/completions", {"prompt": "x"})
        self.assertEqual(st, 401)
        [a] = self.wait_access(lambda a: a.get("client") == local, "the 401's line")
        self.assertEqual((a["status"], a["route"], a["id"], a["prompt_tokens"]),
                         (401, "/v1/completions", None, None))
        local, first = raw_request(self.srv.port, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(" 404 ", first)
        [a] = self.wait_access(lambda a: a.get("client") == local, "the 404's line")
        self.assertEqual((a["status"], a["route"], a["method"]), (404, "other", "GET"))
        # a malformed request line: no head ever reached the router, still one line
        local, first = raw_request(self.srv.port, b"BROKEN\r\n\r\n")
        self.assertIn(" 400 ", first)
        [a] = self.wait_access(lambda a: a.get("client") == local, "the 400's line")
        self.assertEqual(a["status"], 400)

    def test_one_line_per_request(self):
        before = len(access_lines(self.srv))
        for _ in range(5):
            self.assertEqual(srvtest.request(self.srv.port, "GET", "/health")[0], 200)
        srvtest.wait_until(lambda: len(access_lines(self.srv)) >= before + 5, 10, "5 lines")
        health = [a for a in access_lines(self.srv)[before:] if a["route"] == "/health"]
        self.assertEqual(len(health), 5)

    def test_stats_line_and_load_progress(self):
        post(self.srv.port, "/v1/completions", {"prompt": "a", "max_tokens": 3},
             {"Authorization": "Bearer k"})
        stats = srvtest.wait_until(
            lambda: [l["msg"] for l in json_lines(self.srv) if l["msg"].startswith("stats: ")],
            10, "a stats line")
        self.assertRegex(stats[-1], r"generation throughput [0-9.]+ tokens/s, running \d+ reqs, "
                                    r"waiting \d+ reqs, KV cache usage [0-9.]+%")
        msgs = [l["msg"] for l in json_lines(self.srv)]
        self.assertTrue(any(m.startswith("loading weights: 100%") for m in msgs), msgs[:10])
        self.assertFalse(any("\r" in m for m in self.srv.output()), "a progress bar in a log")


class AccessLogToolCalls(unittest.TestCase):
    """The access line's finish reason is the API's: "tool_calls" when the output was a call."""

    def test_tool_calls(self):
        tools = [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}}]
        with srvtest.Server("--log-format", "json", model=srvtest.bundled_model()) as srv:
            for stream in (False, True):
                body = {"messages": [{"role": "user", "content": "1+2?"}], "tools": tools,
                        "tool_choice": "required", "max_tokens": 300, "stream": stream,
                        "parallel_tool_calls": False, "temperature": 0}
                local, st, raw = post(srv.port, "/v1/chat/completions", body)
                self.assertEqual(st, 200)
                if stream:
                    events = [json.loads(l[6:]) for l in raw.decode().split("\n")
                              if l.startswith("data: {")]
                    rid = events[0]["id"]
                    fin = [e["choices"][0]["finish_reason"] for e in events
                           if e["choices"] and e["choices"][0].get("finish_reason")][-1]
                else:
                    r = json.loads(raw)
                    rid, fin = r["id"], r["choices"][0]["finish_reason"]
                self.assertEqual(fin, "tool_calls")
                [a] = srvtest.wait_until(lambda: [a for a in access_lines(srv)
                                                  if a.get("id") == rid], 10, "the line")
                self.assertEqual(a["finish_reason"], "tool_calls", (stream, a))


class AccessLogText(unittest.TestCase):
    def test_text_line_and_switch(self):
        with srvtest.Server() as srv:
            local, st, body = post(srv.port, "/v1/completions",
                                   {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
            self.assertEqual(st, 200)
            rid = json.loads(body)["id"]
            line = srvtest.wait_until(
                lambda: [l for l in srv.output().splitlines() if " id=%s " % rid in l], 10,
                "the text access line")[0]
            self.assertIn(" info access client=%s method=POST route=/v1/completions status=200 "
                          % local, line)
            self.assertIn(" completion_tokens=2 ", line)
            self.assertIn(" finish_reason=length ", line)
        with srvtest.Server("--no-access-log") as srv:
            self.assertEqual(srvtest.request(srv.port, "GET", "/health")[0], 200)
            self.assertEqual(srvtest.request(srv.port, "GET", "/v1/models")[0], 200)
            log = srv.output()
        self.assertNotIn(" access ", log)

    def test_bind_error_names_port(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(1)
            port = busy.getsockname()[1]
            p = subprocess.run([srvtest.binary(), "serve", "--model", srvtest.fixture_model(),
                                "--port", str(port)], capture_output=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("cannot listen on 127.0.0.1:%d" % port, p.stderr.decode())


if __name__ == "__main__":
    srvtest.main()
