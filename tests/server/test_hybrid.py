"""A hybrid model (qwen3_next: Gated DeltaNet layers with recurrent state) through the server:
startup logs the state bytes per sequence and that prefix caching is off (asked for by default)
and why; /metrics exports the state-cache and KV-per-token gauges with the values the log gives;
two equal prompts sent one after the other give identical greedy text and logprobs with no
prefix-cache hit (a hit would reuse K/V without its state); a streamed completion equals the
unstreamed one; concurrent requests each equal their solo answer (state slots kept apart)."""
import json
import re
import threading
import unittest

import srvtest

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east"


class HybridServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server("--max-num-seqs", "4", model=srvtest.fixture_model("qwen3_next"),
                                 name="hybrid").start()

    @classmethod
    def tearDownClass(cls):
        rc = cls.srv.stop()
        cls.srv.close()
        assert rc == 0, "the server exited with %d" % rc

    def complete(self, prompt, **extra):
        body = {"model": "hybrid", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "logprobs": 1, "ignore_eos": True}
        body.update(extra)
        st, _, out = srvtest.post_json(self.srv.port, "/v1/completions", body)
        self.assertEqual(st, 200, out)
        return out["choices"][0]

    def test_log_and_metrics(self):
        log = self.srv.output()
        self.assertIn("prefix caching is off for qwen3_next", log)
        m = re.search(r"recurrent state: ([0-9.]+) MiB per sequence, 4 slots per device", log)
        self.assertIsNotNone(m, log)
        mt = self.srv.metrics()
        per_seq = mt.total("moeserve_state_cache_bytes_per_seq")
        total = mt.total("moeserve_state_cache_bytes")
        self.assertGreater(per_seq, 0)
        self.assertEqual(total, 4 * per_seq)
        self.assertAlmostEqual(per_seq / (1 << 20), float(m.group(1)), places=2)
        # one attention layer of 4: 2 KV heads x 16 x (K + V) x 4 bytes
        self.assertEqual(mt.total("moeserve_kv_cache_bytes_per_token"), 2 * 16 * 2 * 4)

    def test_same_prompt_twice(self):
        before = self.srv.metrics()
        hits0 = before.total("moeserve_prefix_cache_hits_total")
        a = self.complete(PROMPT)
        b = self.complete(PROMPT)
        self.assertEqual(a["text"], b["text"])
        self.assertEqual(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])
        after = self.srv.metrics()
        self.assertEqual(after.total("moeserve_prefix_cache_hits_total"), hits0)

    def test_stream_equals_whole(self):
        whole = self.complete(PROMPT, logprobs=None)["text"]
        st, _, data = srvtest.request(
            self.srv.port, "POST", "/v1/completions",
            json.dumps({"model": "hybrid", "prompt": PROMPT, "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True, "stream": True}).encode(),
            {"Content-Type": "application/json"})
        self.assertEqual(st, 200)
        text = ""
        for ev in srvtest.sse_events(data):
            if ev != "[DONE]":
                text += json.loads(ev)["choices"][0]["text"]
        self.assertEqual(text, whole)

    def test_concurrent_equal_solo(self):
        prompts = [PROMPT, "First Citizen:\nBefore we proceed any further, hear me speak.",
                   "KING RICHARD III:\nNow is the winter", "To be, or not to be"]
        solo = [self.complete(p)["text"] for p in prompts]
        got = [None] * len(prompts)

        def run(i):
            got[i] = self.complete(prompts[i])["text"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual(got, solo)


if __name__ == "__main__":
    srvtest.main()
