"""Placement in the server: 4 CPU devices with eplb replicas, live rebalancing every second and
the routing trace on give the same greedy completions (16 at once) as one device; rebalances
happen while they run and none is dropped; /metrics passes `promtool check metrics` with the
placement families (per-layer imbalance labelled by layer only; per-expert series only when
asked); the recorded trace reads back in C and in Python with the tokens the server computed.
--dispatch rows and tokens give the same greedy text on 4 devices, and /metrics' all-to-all bytes
are exactly what the cross-device counters imply for each (tokens: fewer). Bad placement flags
exit 2 naming the flag; a corrupt --placement-trace names its offset."""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import srvtest

PROMTOOL = shutil.which("promtool")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools"))
import routing_trace  # noqa: E402  (tools/routing_trace.py)

PROMPTS = ["ROMEO: %s" % w for w in (
    "good night", "my lord", "what light", "the sun", "fair maid", "O", "speak again",
    "the moon", "by yonder", "wherefore", "a rose", "that which", "call me", "but soft",
    "parting", "sweet sorrow")]


def complete_all(port):
    def one(p):
        st, _, body = srvtest.post_json(port, "/v1/completions",
                                        {"prompt": p, "max_tokens": 24, "temperature": 0,
                                         "ignore_eos": True}, timeout=120)
        assert st == 200, (st, body)
        return body["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        return list(ex.map(one, PROMPTS))


class PlacementTest(unittest.TestCase):
    def test_rebalance_trace_metrics(self):
        model = srvtest.bundled_model()
        with srvtest.Server("--threads", "2", model=model) as ref:
            want = complete_all(ref.port)
        tmp = tempfile.mkdtemp()
        trace = os.path.join(tmp, "serve.rtrace")
        try:
            srv = srvtest.Server("--devices", "4", "--threads", "4", "--expert-placement", "eplb",
                                 "--redundant-experts", "4", "--rebalance-interval", "1",
                                 "--record-routing", trace, model=model)
            with srv:
                # traffic for the statistics, then a batch once the interval has passed
                first = complete_all(srv.port)
                batches = 2
                for _ in range(60):
                    if srv.metrics().total("moeserve_placement_rebalances_total") >= 1:
                        break
                    self.assertEqual(complete_all(srv.port), want)
                    batches += 1
                got = complete_all(srv.port)
                m = srv.metrics()
                self.assertEqual(first, want)
                self.assertEqual(got, want)
                self.assertGreaterEqual(m.total("moeserve_placement_rebalances_total"), 1)
                self.assertEqual(m.total("moeserve_placement_rebalance_failures_total"), 0)
                self.assertEqual(m.total("moeserve_expert_replicas"), 4)
                self.assertEqual(m.total("moeserve_placement_info", policy="eplb"), 1)
                self.assertGreater(m.total("moeserve_all_to_all_bytes_total"), 0)
                # per (sender, receiver) pair, never a device to itself
                pairs = [dict(k[1]) for k in m if k[0] == "moeserve_all_to_all_bytes_total"]
                self.assertTrue(pairs and all(p["device"] != p["peer"] for p in pairs), pairs)
                for d in range(2):
                    self.assertGreater(m.total("moeserve_all_to_all_bytes_total", device=str(d),
                                               peer=str(1 - d)), 0)
                self.assertGreater(m.total("moeserve_expert_rows_total"), 0)
                self.assertGreater(m.total("moeserve_routed_expert_width_mean"), 0)
                # bounded labels: layer only for the per-layer gauge, no per-expert series
                layers = [dict(k[1]) for k in m if k[0] == "moeserve_expert_load_imbalance"]
                self.assertEqual(sorted(int(l["layer"]) for l in layers), [0, 1, 2, 3])
                self.assertTrue(all(set(l) == {"model_name", "layer"} for l in layers))
                self.assertFalse(any(k[0] == "moeserve_expert_routed_tokens_total" for k in m))
                st, _, raw = srvtest.request(srv.port, "GET", "/metrics")
                self.promtool(raw)
                prompt = m.total("moeserve_prompt_tokens_total")
                generated = m.total("moeserve_generation_tokens_total")
                self.assertIn("rebalanced (eplb)", srv.output())
            # the trace: every computed token, the same in C and Python
            c = json.loads(subprocess.run([srvtest.binary(), "trace", "info", trace, "--json"],
                                          capture_output=True, check=True).stdout)
            py = routing_trace.summary(trace)
            self.assertEqual(c["tokens"], py["tokens"])
            self.assertEqual(c["expert_tokens"], py["expert_tokens"])
            # computed tokens: the prompts (less prefix-cache hits) and every generated token but
            # each request's last
            self.assertGreaterEqual(c["tokens"], generated - 16 * batches)
            self.assertLessEqual(c["tokens"], prompt + generated)
            self.assertEqual(c["n_expert"], 16)
        finally:
            shutil.rmtree(tmp)

    def test_per_expert_series(self):
        with srvtest.Server("--metrics-per-expert", "--devices", "2",
                            model=srvtest.bundled_model()) as srv:
            srvtest.post_json(srv.port, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
            m = srv.metrics()
            rows = [k for k in m if k[0] == "moeserve_expert_routed_tokens_total"]
            self.assertEqual(len(rows), 4 * 16)
            self.assertGreater(sum(m[k] for k in rows), 0)
            st, _, raw = srvtest.request(srv.port, "GET", "/metrics")
            self.promtool(raw)

    def test_eplb_over_nodes(self):
        """--placement-nodes: eplb over 2 nodes of 2 devices from the committed trace's
        statistics; the output is the default placement's (placement never changes the math),
        and every device computes rows."""
        model = srvtest.bundled_model()
        trace = os.path.join(srvtest.tests_dir(), "fixtures", "routing",
                             "mohge_small_heldout.rtrace")
        body = {"prompt": "ROMEO: but soft", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        with srvtest.Server(model=model) as plain:
            st, _, want = srvtest.post_json(plain.port, "/v1/completions", body)
            self.assertEqual(st, 200, want)
        with srvtest.Server("--devices", "4", "--expert-placement", "eplb", "--placement-nodes",
                            "2", "--placement-trace", trace, model=model) as srv:
            st, _, got = srvtest.post_json(srv.port, "/v1/completions", body)
            self.assertEqual(st, 200, got)
            m = srv.metrics()
        self.assertEqual(want["choices"][0]["text"], got["choices"][0]["text"])
        for d in range(4):
            self.assertGreater(m.total("moeserve_device_routed_tokens_total", device=str(d)), 0)

    def test_dispatch_bytes(self):
        """The bundled model (d_model 192, top-2) on 4 devices: the bytes each dispatch sends,
        read from /metrics, against the routing the same /metrics counted. rows: per
        cross-device expert row, the row out (768 bytes), its expert id (4) and the result back
        (768); tokens: per (token, other device), the row out, 2 ids and 2 weights (16) and the
        partial sum back (768)."""
        model = srvtest.bundled_model()
        row, k = 4 * 192, 2
        texts, sent = {}, {}
        for mode in ("rows", "tokens"):
            with srvtest.Server("--devices", "4", "--threads", "4", "--dispatch", mode,
                                model=model) as srv:
                texts[mode] = complete_all(srv.port)
                m = srv.metrics()
            got = m.total("moeserve_all_to_all_bytes_total")
            rows = m.total("moeserve_cross_device_rows_total")
            sends = m.total("moeserve_cross_device_token_sends_total")
            self.assertGreater(sends, 0)
            self.assertLess(sends, rows)  # some tokens have both experts on one device
            want = rows * (2 * row + 4) if mode == "rows" else sends * (2 * row + 8 * k)
            self.assertEqual(got, want, (mode, rows, sends))
            sent[mode] = got / rows  # per cross-device expert row: batching may differ
        self.assertEqual(texts["rows"], texts["tokens"])
        self.assertLess(sent["tokens"], sent["rows"])

    def test_bad_flags(self):
        model = srvtest.bundled_model()
        tmp = tempfile.mkdtemp()
        try:
            bad = os.path.join(tmp, "bad.rtrace")
            src = os.path.join(srvtest.tests_dir(), "fixtures", "routing",
                               "mohge_small_heldout.rtrace")
            with open(src, "rb") as f:
                data = bytearray(f.read())
            data[2000] ^= 0xFF
            with open(bad, "wb") as f:
                f.write(bytes(data))
            for args, want in (
                    (["--expert-placement", "random"], "--expert-placement must be"),
                    (["--devices", "2", "--dispatch", "experts"], "--dispatch must be tokens or rows"),
                    (["--routing-stats", "some"], "--routing-stats must be"),
                    (["--expert-placement", "c2r", "--devices", "2"], "--placement-trace"),
                    (["--devices", "2", "--redundant-experts", "17"], "--redundant-experts 17"),
                    (["--devices", "2", "--redundant-experts", "4", "--max-experts-per-device",
                      "9"], "--max-experts-per-device"),
                    (["--expert-placement", "eplb", "--rebalance-interval", "5",
                      "--routing-stats", "off"], "--routing-stats"),
                    (["--expert-placement", "eplb", "--placement-trace", bad], "offset"),
                    (["--devices", "4", "--placement-nodes", "2"], "placement over nodes is eplb"),
                    (["--devices", "4", "--expert-placement", "eplb", "--placement-nodes", "3"],
                     "--placement-nodes 3 does not divide the 4 devices")):
                p = subprocess.run([srvtest.binary(), "serve", "--model", model, "--port", "0"] +
                                   args, capture_output=True, timeout=60)
                self.assertEqual(p.returncode, 2, (args, p.stderr.decode()))
                self.assertIn(want, p.stderr.decode(), args)
            fixture = srvtest.fixture_model("mixtral")
            p = subprocess.run([srvtest.binary(), "serve", "--model", fixture, "--port", "0",
                                "--expert-placement", "mohge"], capture_output=True, timeout=60)
            self.assertEqual(p.returncode, 2)
            self.assertIn("groups", p.stderr.decode())
        finally:
            shutil.rmtree(tmp)

    def promtool(self, raw):
        if PROMTOOL is None:
            return  # the promtool test covers the rest; here the families and labels matter
        p = subprocess.run([PROMTOOL, "check", "metrics"], input=raw, capture_output=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout.decode() + p.stderr.decode())
        self.assertEqual(p.stdout.decode().strip() + p.stderr.decode().strip(), "")


if __name__ == "__main__":
    srvtest.main()
