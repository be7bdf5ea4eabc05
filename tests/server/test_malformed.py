"""A corpus of malformed and hostile requests. Each gets its documented status (proto/openapi.yaml)
and an OpenAI error object {"error": {"message", "type", "param", "code"}} naming the offending
field, and the server keeps serving afterwards: bad JSON, non-objects, wrong types and
out-of-range values for every field, unknown model/route, wrong method, oversized bodies
(declared and chunked), missing or wrong API keys, empty and over-long prompts, slow and
stalled clients (must not block others), and a full waiting queue (429 + Retry-After)."""
import json
import socket
import threading
import time
import unittest

import srvtest

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error"}

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (path, body, status, param). body: dict (sent as JSON) or str/bytes (sent as is).
# Completions fields get a valid prompt added, chat fields valid messages, unless present.
WRONG_TYPES = [
    ("model", 5), ("prompt", 5), ("prompt", {"a": 1}), ("prompt", [1.5]), ("prompt", [True]),
    ("prompt", [[1, 2], "x", None]), ("max_tokens", "10"), ("max_tokens", 1.5),
    ("max_completion_tokens", "7"), ("temperature", "hot"), ("temperature", [1]),
    ("top_p", "x"), ("top_k", 1.5), ("min_p", "x"), ("presence_penalty", "x"),
    ("frequency_penalty", []), ("repetition_penalty", {}), ("seed", "x"), ("seed", 1.5),
    ("n", "2"), ("stop", 5), ("stop", [1]), ("stream", "yes"), ("stream", 1),
    ("logprobs", "x"), ("logprobs", True), ("echo", 1), ("ignore_eos", "true"),
    ("moe_top_k", 1.5), ("moe_top_k", "1"),
]
OUT_OF_RANGE = [
    ("temperature", -1), ("temperature", 1000), ("top_p", 2), ("top_p", 0), ("top_p", -0.5),
    ("n", 0), ("n", -1), ("n", 1000), ("max_tokens", -5), ("max_tokens", -1),
    ("max_completion_tokens", 0), ("logprobs", 30), ("logprobs", -1), ("top_k", -2),
    ("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 3), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("moe_top_k", -1),
    ("moe_top_k", 3), ("moe_top_k", 600), ("stop", ""), ("stop", ["a"] * 9), ("stop", ["x" * 300]),
]
CHAT_ONLY = {"max_completion_tokens"}  # completions refuse it as unknown, like OpenAI's
CHAT_CASES = [
    ({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"), ({"messages": [5]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages"),
    ({"messages": MSGS, "logprobs": "x"}, "logprobs"),
    ({"messages": MSGS, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": MSGS, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSGS, "stream": True, "stream_options": "x"}, "stream_options"),
    ({"messages": MSGS, "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    ({"messages": MSGS, "model": "nope"}, "model"),
    ({}, "messages"),
]
BAD_BODIES = [  # -> 400, param null, code invalid_json
    b'{"prompt": "x",', b"", b"   ", b"[1, 2]", b'"prompt"', b"42", b"null", b"true",
    b'{"prompt": "x"} trailing', b'{"prompt": "\xff\xfe"}', b"[" * 5000 + b"]" * 5000,
    b'{"prompt": "x", "seed": 1000000000000000000000000000}', b"\x00\x01\x02",
]


class MalformedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server("--max-model-len", "64").start()
        cls.port = cls.srv.port

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def check_error(self, status, hdrs, raw, want_status, want_param=None, what=""):
        self.assertEqual(status, want_status, "%s: %r" % (what, raw[:300]))
        self.assertTrue(hdrs.get("content-type", "").startswith("application/json"),
                        "%s: %r" % (what, hdrs))
        body = json.loads(raw)
        self.assertEqual(set(body), {"error"}, what)
        err = body["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"}, what)
        self.assertIsInstance(err["message"], str)
        self.assertTrue(err["message"], what)
        self.assertEqual(err["type"], ERROR_TYPES[want_status], what)
        self.assertEqual(err["param"], want_param, "%s: %r" % (what, err))
        self.assertTrue(err["code"] is None or isinstance(err["code"], str), what)
        return err

    def req(self, method, path, body=None, headers=None):
        return srvtest.request(self.port, method, path, body, headers)

    def still_serving(self):
        st, _, body = srvtest.post_json(self.port, CMPL, {"prompt": "ok", "max_tokens": 3,
                                                          "ignore_eos": True})
        self.assertEqual(st, 200, body)
        self.assertEqual(body["usage"]["completion_tokens"], 3)

    def test_bad_bodies(self):
        for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
            for raw in BAD_BODIES:
                what = "%s %r" % (path, raw[:40])
                err = self.check_error(*self.req("POST", path, raw), 400, None, what)
                self.assertEqual(err["code"], "invalid_json", what)
        self.still_serving()

    def test_wrong_types_and_ranges(self):
        for cases in (WRONG_TYPES, OUT_OF_RANGE):
            for field, value in cases:
                if field not in CHAT_ONLY:
                    body = {"prompt": "Hello", "max_tokens": 4}
                    body[field] = value
                    err = self.check_error(*self.req("POST", CMPL, body), 400, field,
                                           "%s=%r" % (field, value))
                    self.assertIn(err["code"], ("invalid_type", "invalid_value"))
                if field not in ("prompt", "logprobs", "echo", "max_tokens"):
                    cbody = {"messages": MSGS, "max_tokens": 4}
                    cbody[field] = value
                    self.check_error(*self.req("POST", CHAT, cbody), 400, field,
                                     "chat %s=%r" % (field, value))
        for body, param in CHAT_CASES:
            self.check_error(*self.req("POST", CHAT, body), 404 if param == "model" else 400,
                             param, "chat %r" % body)
        # null means "not given" for every optional field (some clients send nulls)
        nulls = {k: None for k, _ in WRONG_TYPES if k not in ("prompt",) and k not in CHAT_ONLY}
        st, _, body = srvtest.post_json(self.port, CMPL, dict(nulls, prompt="Hi"))
        self.assertEqual(st, 200, body)
        self.still_serving()

    def test_prompts(self):
        for prompt in ("", [], [""], [[]], [600], [-1], [1, 2, 512]):
            self.check_error(*self.req("POST", CMPL, {"prompt": prompt}), 400, "prompt",
                             "prompt %r" % (prompt,))
        self.check_error(*self.req("POST", CMPL, {"prompt": ["a"] * 65}), 400, "prompt",
                         "65 prompts")
        # longer than --max-model-len 64: as ids and as text
        self.check_error(*self.req("POST", CMPL, {"prompt": [65] * 64}), 400, "prompt", "ids")
        text = "hello world " * 40
        self.assertGreaterEqual(len(srvtest.tokenize(self.port, text)), 64)
        self.check_error(*self.req("POST", CMPL, {"prompt": text}), 400, "prompt", "text")
        long_msgs = [{"role": "user", "content": text}]
        self.check_error(*self.req("POST", CHAT, {"messages": long_msgs}), 400, "messages",
                         "chat")
        # prompt fits, prompt + max_tokens does not
        self.check_error(*self.req("POST", CMPL, {"prompt": [65] * 60, "max_tokens": 10}),
                         400, "max_tokens", "prompt + max_tokens")
        st, _, body = srvtest.post_json(self.port, CMPL, {"prompt": [65] * 60, "max_tokens": 4,
                                                          "ignore_eos": True})
        self.assertEqual((st, body["choices"][0]["finish_reason"]), (200, "length"), body)
        # without max_tokens the rest of the context is used
        st, _, body = srvtest.post_json(self.port, CMPL, {"prompt": [65] * 60,
                                                          "ignore_eos": True})
        self.assertEqual((st, body["usage"]["completion_tokens"]), (200, 4), body)
        # detokenize ranges
        for toks in ([-1], [512], "x", [1.5]):
            self.check_error(*self.req("POST", "/detokenize", {"tokens": toks}), 400, "tokens",
                             "detokenize %r" % (toks,))
        self.check_error(*self.req("POST", "/detokenize", {}), 400, "tokens", "no tokens")
        self.still_serving()

    def test_tokenize_unknown_fields(self):
        """/tokenize and /detokenize refuse fields they do not take, as the generation routes
        do: a 400 naming the field (code unknown_parameter), or unsupported_parameter for a
        vLLM field this server does not implement; the fields they take still work."""
        cases = [("/tokenize", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
                 ("/tokenize", {"prompt": "hi", "max_tokens": 5}, "max_tokens"),
                 # chat-only fields do nothing to a prompt
                 ("/tokenize", {"prompt": "hi", "add_generation_prompt": False},
                  "add_generation_prompt"),
                 ("/tokenize", {"prompt": "hi", "tools": []}, "tools"),
                 ("/tokenize", {"messages": MSGS, "temperature": 0}, "temperature"),
                 ("/tokenize", {"messages": MSGS, "echo": False}, "echo"),
                 ("/detokenize", {"tokens": [1, 2], "no_such_field": True}, "no_such_field"),
                 ("/detokenize", {"tokens": [1, 2], "prompt": "hi"}, "prompt"),
                 ("/detokenize", {"tokens": [], "skip_special_tokens": True},
                  "skip_special_tokens")]
        for path, body, param in cases:
            err = self.check_error(*self.req("POST", path, body), 400, param,
                                   "%s %r" % (path, body))
            self.assertEqual(err["code"], "unknown_parameter", "%s %r" % (path, body))
            self.assertIn(param, err["message"])
        err = self.check_error(*self.req("POST", "/tokenize", {
            "messages": MSGS, "chat_template": "{{ x }}"}), 400, "chat_template")
        self.assertEqual(err["code"], "unsupported_parameter")
        # what each form takes
        st, _, out = srvtest.post_json(self.port, "/tokenize", {
            "prompt": "hi", "model": "anything", "add_special_tokens": False})
        self.assertEqual(st, 200, out)
        st, _, out = srvtest.post_json(self.port, "/detokenize", {
            "tokens": out["tokens"], "model": "anything"})
        self.assertEqual((st, out["prompt"]), (200, "hi"))
        self.still_serving()

    def test_routes_and_methods(self):
        self.check_error(*self.req("POST", CMPL, {"prompt": "x", "model": "gpt-4"}), 404,
                         "model", "unknown model")
        for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/completions"),
                             ("GET", "/"), ("GET", "/v1/completions/x"),
                             ("GET", "/v1/models/../metrics")):
            self.check_error(*self.req(method, path), 404, None, "%s %s" % (method, path))
        for method, path, allow in (("GET", CMPL, "POST"), ("GET", CHAT, "POST"),
                                    ("PUT", CMPL, "POST"),
                                    ("POST", "/v1/models", "GET, HEAD"),
                                    ("DELETE", "/health", "GET, HEAD"),
                                    ("POST", "/metrics", "GET, HEAD"),
                                    ("GET", "/tokenize", "POST")):
            st, hdrs, raw = self.req(method, path, {} if method != "GET" else None)
            self.check_error(st, hdrs, raw, 405, None, "%s %s" % (method, path))
            self.assertEqual(hdrs.get("allow"), allow, "%s %s" % (method, path))
        # HEAD where only POST is served: the 405's headers, and no body (HEAD never has one)
        st, hdrs, raw = self.req("HEAD", CMPL)
        self.assertEqual((st, hdrs.get("allow"), raw), (405, "POST", b""))
        self.still_serving()

    def read_head(self, s, buf):
        """Reads from s until buf holds a whole response head; returns (head, rest)."""
        while b"\r\n\r\n" not in buf:
            piece = s.recv(65536)
            self.assertTrue(piece, "the server closed before a whole head: %r" % buf[:200])
            buf += piece
        head, _, rest = buf.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n", rest

    def test_head_on_get_routes(self):
        """HEAD is answered wherever GET is (RFC 9110 9.3.2): GET's status and headers, the
        Content-Length of GET's body, no body, and the connection serves the next request."""
        name = json.loads(self.req("GET", "/v1/models")[2])["data"][0]["id"]
        # routes whose body does not change between two requests: same Content-Length
        stable = ["/health", "/v1/models", "/v1/models/" + name, "/v1/models/nope", "/version",
                  "/tokenizer_info", "/dashboard"]
        for path in stable + ["/metrics", "/v1/moe/stats"]:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            try:
                s.sendall(b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
                head, rest = self.read_head(s, b"")
                # the same connection, kept alive: the GET's answer must come next, so any
                # body bytes after the HEAD's head would show up as a broken response here
                s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
                ghead, grest = self.read_head(s, rest)
                g_st, g_hdrs, _, _ = srvtest.parse_response(ghead)
                while len(grest) < int(g_hdrs["content-length"]):
                    piece = s.recv(65536)
                    self.assertTrue(piece, path)
                    grest += piece
            finally:
                s.close()
            h_st, h_hdrs, _, _ = srvtest.parse_response(head)
            self.assertEqual(rest, b"", "%s: HEAD sent a body" % path)
            self.assertTrue(ghead.startswith(b"HTTP/1.1 "), "%s: %r" % (path, ghead[:80]))
            self.assertEqual(h_st, g_st, path)
            self.assertNotEqual(h_st, 405, path)
            self.assertEqual(len(grest), int(g_hdrs["content-length"]), path)
            h_hdrs.pop("date"), g_hdrs.pop("date")
            if path not in stable:
                h_hdrs.pop("content-length"), g_hdrs.pop("content-length")
            self.assertEqual(h_hdrs, g_hdrs, path)
        self.still_serving()

    def test_oversized_body(self):
        # declared with Content-Length: answered from the headers, before the body is read
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 2097152\r\n\r\n")
        head = self.read_response(s)
        s.close()
        self.assertTrue(head.startswith(b"HTTP/1.1 413"), head[:200])
        self.assertIn(b'"param":null', head)
        # chunked, no declared length: counted while read
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b'{"prompt": "' + b"a" * 65536
        chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
        try:
            for _ in range(24):  # 1.5 MiB > the 1 MiB limit
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before reading everything
        head = self.read_response(s)
        s.close()
        self.assertTrue(head.startswith(b"HTTP/1.1 413"), head[:200])
        # just under the limit is fine (and a valid 400 for the huge prompt)
        body = json.dumps({"prompt": "a" * ((1 << 20) - 100), "max_tokens": 1})
        st, _, raw = self.req("POST", CMPL, body)
        self.assertEqual(st, 400, raw[:200])
        self.still_serving()

    def read_response(self, s):
        data = b""
        s.settimeout(30)
        while b"\r\n\r\n" not in data or b"}}" not in data:
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            data += piece
        return data

    def test_slow_and_stalled_clients(self):
        """8 clients that send headers and stall (more than MHD's 4 threads), plus one that
        sends its body a byte at a time: other clients are served meanwhile, and the slow one
        completes."""
        body = json.dumps({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        stalled = []
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            s.sendall(head + body[:5])
            stalled.append(s)
        slow = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        slow.sendall(head)
        done = threading.Event()

        def trickle():
            for i in range(len(body)):
                slow.sendall(body[i:i + 1])
                time.sleep(0.01)  # the point of the test: a client that is slow on purpose
            done.set()
        t = threading.Thread(target=trickle)
        t.start()
        served = 0
        t0 = time.monotonic()
        while not done.is_set():
            self.still_serving()
            served += 1
        t.join()
        self.assertGreater(served, 0)
        self.assertLess((time.monotonic() - t0) / max(served, 1), 1.0, "others were blocked")
        resp = self.read_response(slow)
        slow.close()
        self.assertTrue(resp.startswith(b"HTTP/1.1 200"), resp[:200])
        self.assertIn(b'"completion_tokens":3', resp)
        for s in stalled:
            s.close()
        self.still_serving()


class AuthTest(unittest.TestCase):
    def test_missing_and_wrong_key(self):
        with srvtest.Server("--api-key", "k3y") as srv:
            body = {"prompt": "x", "max_tokens": 1}
            cases = [None, "Bearer", "Bearer ", "Bearer k3", "Bearer k3y4", "Basic k3y",
                     "bearer k3y2", "k3y", "Bearer K3Y"]
            for auth in cases:
                hdrs = {"Authorization": auth} if auth is not None else {}
                for method, path in (("POST", CMPL), ("POST", CHAT), ("GET", "/v1/models")):
                    st, h, raw = srvtest.request(srv.port, method, path,
                                                 body if method == "POST" else None, hdrs)
                    self.assertEqual(st, 401, "%r %s" % (auth, path))
                    err = json.loads(raw)["error"]
                    self.assertEqual(err["type"], "authentication_error")
                    self.assertEqual(h.get("www-authenticate"), "Bearer")
            st, _, raw = srvtest.request(srv.port, "POST", CMPL, body,
                                         {"Authorization": "Bearer k3y"})
            self.assertEqual(st, 200, raw)


class QueueFullTest(unittest.TestCase):
    def test_429_when_waiting_queue_is_full(self):
        """One running slot and one waiting slot: of 8 simultaneous long requests at most two
        are admitted at a time; the others get 429 with Retry-After, and every admitted one
        finishes with all its tokens."""
        with srvtest.Server("--max-num-seqs", "1", "--max-waiting", "1") as srv:
            results, lock = [], threading.Lock()
            go = threading.Barrier(8)

            def client():
                go.wait()
                r = srvtest.request(srv.port, "POST", CMPL, {
                    "prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
                with lock:
                    results.append(r)
            threads = [threading.Thread(target=client) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            statuses = sorted(st for st, _, _ in results)
            self.assertEqual(len(results), 8)
            self.assertIn(429, statuses)
            self.assertIn(200, statuses)
            self.assertEqual(set(statuses), {200, 429}, statuses)
            for st, h, raw in results:
                body = json.loads(raw)
                if st == 429:
                    self.assertEqual(body["error"]["type"], "rate_limit_error")
                    self.assertTrue(h.get("retry-after", "").isdigit(), h)
                else:
                    self.assertEqual(body["usage"]["completion_tokens"], 500)
            m = srvtest.wait_until(
                lambda: (lambda m: m.total("moeserve_num_requests_running") == 0 and m)(
                    srv.metrics()), 10, "idle")
            self.assertEqual(m.total("moeserve_num_requests_waiting"), 0)
            st, _, raw = srvtest.request(srv.port, "POST", CMPL, {"prompt": "x", "max_tokens": 2})
            self.assertEqual(st, 200, raw)


if __name__ == "__main__":
    srvtest.main()
