"""Load and disconnect behaviour on loopback: 64 concurrent streaming clients all get exactly the
token counts they asked for (ignore_eos + max_tokens, counted from the streamed per-token
logprobs and from the usage chunk) and, at temperature 0, the same tokens as when run alone;
a client that closes its socket mid-stream (streaming or not) has its request cancelled and its
KV blocks freed, which /metrics shows within a bounded wait; a client that only half-closes
(shutdown(SHUT_WR) after its request, as `nc -N` does) gets its whole answer, streamed or not,
and then the server closes, while one that half-closes and then closes is still cancelled."""
import http.client
import json
import socket
import threading
import unittest

import srvtest

PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3,", "In the beginning"]
N_CLIENTS = 64


def stream_completion(port, body, timeout=120):
    """One streaming request; returns (tokens list, finish reasons, usage, event count)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        if r.status != 200:
            raise AssertionError("status %d: %r" % (r.status, raw[:300]))
    finally:
        c.close()
    events = srvtest.sse_events(raw)
    assert events[-1] == "[DONE]", events[-1]
    tokens, finishes, usage = [], [], None
    for e in events[:-1]:
        ch = json.loads(e)
        if ch.get("usage"):
            usage = ch["usage"]
        for choice in ch["choices"]:
            tokens += choice["logprobs"]["tokens"]
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return tokens, finishes, usage, len(events)


class ConcurrencyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server("--max-num-seqs", "64").start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def idle(self):
        m = self.srv.metrics()
        return (m.total("moeserve_num_requests_running") == 0 and
                m.total("moeserve_num_requests_waiting") == 0) and m

    def test_64_streaming_clients(self):
        port = self.srv.port
        solo = {}
        for p in PROMPTS:
            toks, _, _, _ = stream_completion(port, {"prompt": p, "max_tokens": 48,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "logprobs": 0, "stream": True})
            solo[p] = toks
        results, errors = [None] * N_CLIENTS, []

        def client(i):
            p = PROMPTS[i % len(PROMPTS)]
            want = 16 + (i * 7) % 33  # 16..48 tokens
            try:
                results[i] = (p, want, stream_completion(port, {
                    "prompt": p, "max_tokens": want, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}))
            except Exception as e:  # reported below with the client's index
                errors.append("client %d: %r" % (i, e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        self.assertFalse(any(t.is_alive() for t in threads), "clients still running after 180s")
        self.assertEqual(errors, [])
        for i, (p, want, (toks, fins, usage, _)) in enumerate(results):
            self.assertEqual(len(toks), want, "client %d token count" % i)
            self.assertEqual(fins, ["length"], "client %d" % i)
            self.assertEqual(usage["completion_tokens"], want, "client %d usage" % i)
            self.assertEqual(toks, solo[p][:want], "client %d: batched greedy != solo" % i)
        srvtest.wait_until(self.idle, 10, "no running or waiting requests")

    def disconnect_case(self, stream, half_close_first=False):
        """Sends a long generation (16 choices x 400 tokens), closes the socket after the
        first bytes of the answer arrive (streaming) or right away (non-streaming), and checks
        that the choices are aborted, far fewer tokens than asked were generated, and KV usage
        and running requests return to their idle values. half_close_first: shutdown(SHUT_WR)
        right after the request, then the same close (the server cannot tell the two apart
        from the EOF alone)."""
        before = srvtest.wait_until(self.idle, 10, "idle before the test")
        kv_idle = before.total("moeserve_kv_cache_usage_perc")
        gen0 = before.total("moeserve_generation_tokens_total")
        abort0 = before.total("moeserve_request_success_total", finished_reason="abort")
        done0 = before.total("moeserve_request_success_total")
        n, max_tokens = 16, 400
        body = json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "n": n,
                           "ignore_eos": True, "stream": stream}).encode()
        s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        if half_close_first:
            s.shutdown(socket.SHUT_WR)
        if stream:
            got = b""
            while got.count(b"data: ") < 3:
                piece = s.recv(4096)
                self.assertTrue(piece, "server closed the stream early")
                got += piece
            # a request still being prepared when the EOF came may get a 100 first (h1's
            # probe of a pending request, h1.h); the stream's own head follows
            if got.startswith(b"HTTP/1.1 100 "):
                got = got.partition(b"\r\n\r\n")[2]
            self.assertIn(b"200", got.split(b"\r\n", 1)[0])
        else:
            # wait until the scheduler runs the choices, then hang up
            srvtest.wait_until(
                lambda: self.srv.metrics().total("moeserve_num_requests_running") > 0, 10,
                "the choices to start running")
        s.close()

        def freed():
            m = self.srv.metrics()
            # the counters are updated just after a request leaves the running set: wait for
            # all of them, not for the gauges alone
            ok = (m.total("moeserve_num_requests_running") == 0 and
                  m.total("moeserve_num_requests_waiting") == 0 and
                  m.total("moeserve_kv_cache_usage_perc") <= kv_idle + 1e-9 and
                  m.total("moeserve_request_success_total") - done0 == n)
            return ok and m
        after = srvtest.wait_until(freed, 10, "running == 0, KV usage back to %g and %d "
                                   "choices finished" % (kv_idle, n))
        aborted = after.total("moeserve_request_success_total", finished_reason="abort") - abort0
        generated = after.total("moeserve_generation_tokens_total") - gen0
        self.assertEqual(aborted, n, "choices not aborted (%d tokens generated)" % generated)
        self.assertLess(generated, n * max_tokens, "the generation ran to completion")
        # still serving
        toks, fins, _, _ = stream_completion(self.srv.port, {
            "prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "logprobs": 0,
            "stream": True})
        self.assertEqual((len(toks), fins), (5, ["length"]))

    def test_client_killed_mid_stream(self):
        self.disconnect_case(stream=True)

    def test_client_killed_while_waiting_for_full_body(self):
        self.disconnect_case(stream=False)

    def test_half_closed_then_killed_mid_stream(self):
        self.disconnect_case(stream=True, half_close_first=True)

    def test_half_closed_then_killed_while_waiting(self):
        self.disconnect_case(stream=False, half_close_first=True)

    def half_close_exchange(self, body):
        """Sends one completion request, shuts the sending side, reads until the server closes;
        returns (final status, headers, body bytes, interim statuses) of the one response."""
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=60)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            s.shutdown(socket.SHUT_WR)
            raw = b""
            while True:  # to the server's close: a timeout here is a failure
                piece = s.recv(65536)
                if not piece:
                    break
                raw += piece
        finally:
            s.close()
        interim = []
        while True:
            status, hdrs, _, rest = srvtest.parse_response(raw)
            if status >= 200:
                break
            interim.append(status)  # a 1xx has no body: the final response follows
            raw = raw.partition(b"\r\n\r\n")[2]
        head, _, rest = raw.partition(b"\r\n\r\n")
        if hdrs.get("transfer-encoding") == "chunked":
            payload = b""
            while True:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    self.assertEqual(rest, b"\r\n", "bytes after the last chunk")
                    break
                payload += rest[:n]
                self.assertEqual(rest[n:n + 2], b"\r\n")
                rest = rest[n + 2:]
        else:
            payload = rest
            self.assertEqual(len(payload), int(hdrs["content-length"]), "truncated body")
        return status, hdrs, payload, interim

    def test_half_close_gets_whole_answer(self):
        before = srvtest.wait_until(self.idle, 10, "idle before the test")
        abort0 = before.total("moeserve_request_success_total", finished_reason="abort")
        status, hdrs, payload, interim = self.half_close_exchange(
            {"prompt": "Hello", "max_tokens": 64, "n": 2, "ignore_eos": True})
        self.assertEqual(status, 200, payload[:300])
        self.assertTrue(set(interim) <= {100}, interim)
        r = json.loads(payload)
        self.assertEqual(r["usage"]["completion_tokens"], 128)
        self.assertEqual([c["finish_reason"] for c in r["choices"]], ["length", "length"])
        after = srvtest.wait_until(self.idle, 10, "idle after the test")
        self.assertEqual(after.total("moeserve_request_success_total", finished_reason="abort"),
                         abort0)

    def test_half_close_gets_whole_stream(self):
        status, hdrs, payload, interim = self.half_close_exchange(
            {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "logprobs": 0,
             "stream": True})
        self.assertEqual(status, 200, payload[:300])
        # at most the probe of a request still pending (being prepared) when the EOF came; once
        # the stream started its own bytes are the probe
        self.assertTrue(set(interim) <= {100}, interim)
        events = srvtest.sse_events(payload)
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
        self.assertEqual(tokens, 64)
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")


if __name__ == "__main__":
    srvtest.main()
