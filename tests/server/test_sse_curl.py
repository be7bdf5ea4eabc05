"""Checks the raw Server-Sent Events framing with curl, byte for byte as it goes over the wire:
Content-Type text/event-stream, every event one `data: {json}` line and a blank line, the
include_usage chunk (empty choices, usage) right before the final `data: [DONE]`, nothing after
it. Skips (exit 77) when curl is missing."""
import json
import shutil
import subprocess
import unittest

import srvtest

CURL = shutil.which("curl")


def curl(srv, path, body):
    """Returns (status, headers dict lower-cased, body bytes) from `curl -sS -N -i`."""
    out = subprocess.run([CURL, "-sS", "-N", "-i", "--max-time", "60", "-H",
                          "Content-Type: application/json", "--data-binary", json.dumps(body),
                          srv.base + path], capture_output=True, check=True, timeout=90).stdout
    head, _, payload = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, payload


@unittest.skipIf(CURL is None, "curl is not installed")
class SSEFramingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server().start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def check_stream(self, path, body, obj):
        st, hdrs, payload = curl(self.srv, path, body)
        self.assertEqual(st, 200, payload[:300])
        self.assertTrue(hdrs.get("content-type", "").startswith("text/event-stream"), hdrs)
        events = srvtest.sse_events(payload)
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events.count("[DONE]"), 1)
        chunks = [json.loads(e) for e in events[:-1]]
        # Tokens decoded while the client is not reading travel together in one chunk, so a
        # short answer may legitimately be a single chunk.
        self.assertGreaterEqual(len(chunks), 1)
        ids = {c["id"] for c in chunks}
        self.assertEqual(len(ids), 1, "one id per stream")
        for c in chunks:
            self.assertEqual(c["object"], obj)
            self.assertIn("created", c)
            self.assertIn("model", c)
        return chunks

    def test_completion_stream_with_usage(self):
        body = {"prompt": "The sky", "max_tokens": 10, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        chunks = self.check_stream("/v1/completions", body, "text_completion")
        usage = chunks[-1]
        self.assertEqual(usage["choices"], [])
        self.assertEqual(usage["usage"]["completion_tokens"], 10)
        n_prompt = len(srvtest.tokenize(self.srv.port, "The sky"))
        self.assertEqual(usage["usage"]["prompt_tokens"], n_prompt)
        self.assertEqual(usage["usage"]["total_tokens"], n_prompt + 10)
        body_chunks = chunks[:-1]
        for c in body_chunks:
            self.assertIsNone(c.get("usage"), "usage only in the last chunk")
            self.assertEqual(len(c["choices"]), 1)
        self.assertEqual(body_chunks[-1]["choices"][0]["finish_reason"], "length")
        for c in body_chunks[:-1]:
            self.assertIsNone(c["choices"][0]["finish_reason"])
        # the streamed text equals the non-streamed one
        body.pop("stream")
        body.pop("stream_options")
        st, _, full = srvtest.post_json(self.srv.port, "/v1/completions", body)
        self.assertEqual(st, 200)
        self.assertEqual("".join(c["choices"][0]["text"] for c in body_chunks),
                         full["choices"][0]["text"])

    def test_chat_stream_without_usage(self):
        # Greedy, so the streamed text can be compared with the non-streamed answer.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "stream": True, "ignore_eos": True, "temperature": 0}
        chunks = self.check_stream("/v1/chat/completions", body, "chat.completion.chunk")
        self.assertTrue(all(c.get("usage") is None for c in chunks), "usage without asking")
        self.assertEqual(chunks[0]["choices"][0]["delta"].get("role"), "assistant")
        self.assertTrue(all("role" not in c["choices"][0]["delta"] for c in chunks[1:]))
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")
        body.pop("stream")
        st, _, full = srvtest.post_json(self.srv.port, "/v1/chat/completions", body)
        self.assertEqual(st, 200)
        self.assertEqual("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks),
                         full["choices"][0]["message"]["content"])

    def test_error_before_stream_is_json(self):
        # a request rejected before streaming starts answers a plain JSON error, not SSE
        st, hdrs, payload = curl(self.srv, "/v1/completions",
                                 {"prompt": "x", "stream": True, "top_p": 2})
        self.assertEqual(st, 400)
        self.assertTrue(hdrs["content-type"].startswith("application/json"))
        self.assertEqual(json.loads(payload)["error"]["param"], "top_p")


if __name__ == "__main__":
    srvtest.main()
