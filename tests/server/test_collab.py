"""Expert collaboration in the server and the pruned checkpoints (engine/collab, server/dash.c):
- GET /v1/moe/stats with --collab-groups (a GROUPS.json of `moeserve analyze`) and
  --collab-reservoir: after real traffic (requests tagged with moe_tag, counted per tag in the
  sample and in the --record-routing trace), tokens per (layer, expert) add up to what was routed,
  the collaboration graph has nodes and edges and the groups have live usage; it needs the API
  key (401 OpenAI error JSON without it) while GET /dashboard is served without one and pulls
  nothing from another host;
- a bundled model pruned by `moeserve prune --method collab` loads and serves completions;
- standard architectures pruned by moeserve load in transformers and give the same next-token
  log-probabilities as moeserve on the pruned weights (1e-4; skipped without torch/transformers);
- bad --collab-groups / --collab-reservoir values exit 2 naming the flag."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import srvtest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools"))
import routing_trace  # noqa: E402  (tools/routing_trace.py)

KEY = "sk-collab-test"
PROMPTS = [("12+35=", "math"), ("ROMEO: good night", "verse"), ('{"name": "Ada", "tags": [', None),
           ("7+8=15\n9+4=", "math"), ("JULIET: O Romeo", "verse"), ('{"id": 3, "city": "', None)]


def tools_data(name):
    return os.path.join(os.path.dirname(srvtest.tests_dir()), "tools", "train", "data", name)


class IdleHistoryTest(unittest.TestCase):
    """The load history of GET /v1/moe/stats has a point per second of wall time, busy or not:
    after traffic stops, new points keep coming, at zero load (the dashboard's chart falls to
    zero instead of freezing at the last busy second)."""

    def test_history_ticks_when_idle(self):
        with srvtest.Server() as srv:
            def stats():
                st, _, raw = srvtest.request(srv.port, "GET", "/v1/moe/stats")
                self.assertEqual(st, 200, raw[:200])
                return json.loads(raw)

            def busy_point():
                st, _, r = srvtest.post_json(srv.port, "/v1/completions", {
                    "prompt": "Hello", "max_tokens": 16, "ignore_eos": True})
                self.assertEqual(st, 200, r)
                return any(sum(p["load"]) > 0 for p in stats()["history"])
            # traffic until a second with load is in the history
            srvtest.wait_until(busy_point, 30, "a history point with load", interval=0.1)
            # idle from here: every second that starts after idle_from has no step in it
            idle_from = stats()["uptime_s"]
            hist = srvtest.wait_until(
                lambda: (lambda h: len([p for p in h if p["t"] - 1.0 >= idle_from]) >= 2 and h)(
                    stats()["history"]), 10, "two history points of idle seconds", interval=0.2)
            idle = [p for p in hist if p["t"] - 1.0 >= idle_from]
            for p in idle:
                self.assertEqual(p["load"], [0.0] * len(p["load"]), p)
                self.assertEqual(p["imbalance"], 0.0, p)
            # one point per second, in order, with no gap
            ts = [p["t"] for p in hist]
            self.assertEqual(ts, [ts[0] + i for i in range(len(ts))])
            self.assertTrue(any(sum(p["load"]) > 0 for p in hist), "the busy second is kept")


class CollabServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.groups = os.path.join(cls.tmp, "groups.json")
        trace = os.path.join(srvtest.tests_dir(), "fixtures", "routing",
                             "mohge_small_heldout.rtrace")
        # with the model, the trace's tokens are decoded and the groups labelled
        p = subprocess.run([srvtest.binary(), "analyze", "--calib", trace, "--out", cls.groups,
                            "--groups", "4", "--model", srvtest.bundled_model()],
                           capture_output=True, timeout=300)
        assert p.returncode == 0, p.stderr.decode()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_stats_and_dashboard(self):
        trace = os.path.join(self.tmp, "served.rtrace")
        with srvtest.Server("--api-key", KEY, "--collab-groups", self.groups,
                            "--collab-reservoir", "4096", "--record-routing", trace,
                            model=srvtest.bundled_model()) as srv:
            auth = {"Authorization": "Bearer " + KEY}
            st, h, body = srvtest.request(srv.port, "GET", "/v1/moe/stats")
            self.assertEqual(st, 401)
            self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
            st, h, page = srvtest.request(srv.port, "GET", "/dashboard")
            self.assertEqual(st, 200)
            self.assertTrue(h["content-type"].startswith("text/html"))
            text = page.decode()
            self.assertIn('id="heatmap"', text)
            self.assertIn("/v1/moe/stats", text)
            # nothing loaded from another host (no CDN): no absolute URL in src/href/fetch
            self.assertIsNone(re.search(r'(src|href)\s*=\s*"(https?:)?//', text))
            self.assertIsNone(re.search(r'fetch\(\s*"https?:', text))
            generated = 0
            tagged = {}
            for p, tag in PROMPTS:
                body = {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                if tag:
                    body["moe_tag"] = tag
                st, _, r = srvtest.post_json(srv.port, "/v1/completions", body, headers=auth,
                                             timeout=120)
                self.assertEqual(st, 200, r)
                n = r["usage"]["completion_tokens"] + r["usage"]["prompt_tokens"]
                generated += n
                tagged[tag or "untagged"] = tagged.get(tag or "untagged", 0) + n
            # a bad tag is a 400 naming it
            st, _, r = srvtest.post_json(srv.port, "/v1/completions",
                                         {"prompt": "x", "moe_tag": "t" * 65}, headers=auth)
            self.assertEqual((st, r["error"]["param"]), (400, "moe_tag"))
            # the counters are copied every 250 ms on the scheduler thread: wait for them
            def stats():
                st, _, raw = srvtest.request(srv.port, "GET", "/v1/moe/stats", headers=auth)
                self.assertEqual(st, 200)
                d = json.loads(raw)
                return d if d["tokens"] >= generated - len(PROMPTS) + 1 else None
            # one more request makes a step after the last copy interval
            d = srvtest.wait_until(lambda: srvtest.post_json(
                srv.port, "/v1/completions", {"prompt": "1+1=", "max_tokens": 1},
                headers=auth)[0] == 200 and stats(), 30, "stats to catch up", interval=0.3)
            self.assertEqual(d["object"], "moe.stats")
            self.assertEqual(d["layers"], [0, 1, 2, 3])
            self.assertEqual(d["n_expert"], 16)
            self.assertEqual(len(d["expert_width"]), 16)
            self.assertEqual(sorted(set(d["expert_group"])), [0, 1, 2, 3])
            # every token chose top-2 experts at every layer
            for row in d["expert_tokens"]:
                self.assertEqual(sum(row), 2 * d["tokens"])
            self.assertEqual(sum(x["routed_rows"] for x in d["devices"]), 8 * d["tokens"])
            self.assertIn("running", d["requests"])
            col = d["collab"]
            self.assertEqual(col["reservoir"], 4096)
            self.assertEqual(col["seen_tokens"], d["tokens"])
            self.assertEqual(col["sampled_tokens"], d["tokens"])  # fewer than the reservoir
            self.assertGreater(len(col["nodes"]), 8)
            self.assertGreater(len(col["edges"]), 8)
            for e in col["edges"]:
                self.assertTrue(0 < e["weight"] <= 1)
            self.assertEqual(len(col["groups"]), 4)
            self.assertGreater(max(g["share"] for g in col["groups"]), 0.1)
            # every routed token sampled with its request's tag (the last 1+1= request is
            # untagged; a completion's last token is not run through the model)
            by_tag = col["sampled_by_tag"]
            self.assertEqual(set(by_tag), {"math", "verse", "untagged"})
            for tag in ("math", "verse"):
                self.assertEqual(by_tag[tag], tagged[tag] - 2)
            with open(self.groups) as f:
                labels = [g["label"] for g in json.load(f)["levels"][0]["groups"]]
            for g in col["groups"]:
                self.assertEqual(set(g["share_by_tag"]), set(by_tag))
                self.assertEqual(g["label"], labels[g["id"]])
                self.assertIn(" tokens", g["label"])
            for n in col["nodes"]:
                self.assertIn(n["group"], range(4))
            # tags are bounded: 30 names, then "other"
            # prompt tokens the requests past 30 names ran through the model (max_tokens 1); a
            # prompt's prefix cached by an earlier request is not run again
            other_tokens = 0
            for i in range(32):
                st, _, r = srvtest.post_json(srv.port, "/v1/completions",
                                             {"prompt": "1+%d=" % i, "max_tokens": 1,
                                              "moe_tag": "t%02d" % i}, headers=auth)
                self.assertEqual(st, 200, r)
                if i >= 28:
                    other_tokens += (r["usage"]["prompt_tokens"] -
                                     r["usage"]["prompt_tokens_details"]["cached_tokens"])
            st, _, raw = srvtest.request(srv.port, "GET", "/v1/moe/stats", headers=auth)
            names = set(json.loads(raw)["collab"]["sampled_by_tag"])
            self.assertEqual(names, {"math", "verse", "untagged", "other"} |
                             {"t%02d" % i for i in range(28)})
        # the routing trace carries the same tags, named
        t = routing_trace.RoutingTrace(trace)
        count = {}
        for st in t.steps():
            for tag in st.tags:
                count[t.tags[tag]] = count.get(t.tags[tag], 0) + 1
        t.close()
        for tag in ("math", "verse"):
            self.assertEqual(count[tag], tagged[tag] - 2)
        self.assertEqual(count["other"], other_tokens)

    def test_pruned_model_serves(self):
        out = os.path.join(self.tmp, "pruned")
        p = subprocess.run([srvtest.binary(), "prune", "--ratio", "0.25", "--method", "collab",
                            "--calib", tools_data("arithmetic.heldout.txt"), "--max-tokens", "512",
                            "--out", out], capture_output=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        with srvtest.Server(model=out, name="pruned") as srv:
            st, _, r = srvtest.post_json(srv.port, "/v1/completions",
                                         {"model": "pruned", "prompt": "12+35=", "max_tokens": 8,
                                          "temperature": 0}, timeout=120)
            self.assertEqual(st, 200, r)
            self.assertEqual(r["usage"]["completion_tokens"], 8)
            st, _, raw = srvtest.request(srv.port, "GET", "/v1/moe/stats")
            self.assertEqual(st, 200)
            self.assertEqual(json.loads(raw)["n_expert"], 12)

    def test_bad_flags(self):
        notjson = os.path.join(self.tmp, "bad.json")
        with open(notjson, "w") as f:
            f.write("{not json")
        other = os.path.join(self.tmp, "other.json")
        with open(self.groups) as f:
            g = json.load(f)
        g["n_expert"] = 32
        with open(other, "w") as f:
            json.dump(g, f)
        for args, want in ((["--collab-groups", notjson], "--collab-groups"),
                           (["--collab-groups", other], "32 experts"),
                           (["--collab-groups", "/nonexistent.json"], "--collab-groups"),
                           (["--collab-reservoir", "-1"], "--collab-reservoir")):
            p = subprocess.run([srvtest.binary(), "serve", "--model", srvtest.bundled_model(),
                                "--port", "0"] + args, capture_output=True, timeout=60)
            self.assertEqual(p.returncode, 2, (args, p.stderr.decode()))
            self.assertIn(want, p.stderr.decode(), args)


try:
    import torch  # noqa: F401
    import transformers
    HAVE_HF = True
except ImportError:
    HAVE_HF = False


@unittest.skipUnless(HAVE_HF, "torch and transformers are not installed")
class PrunedTransformersTest(unittest.TestCase):
    """Fixture checkpoints of the standard architectures, pruned by moeserve: transformers
    loads each folder as is, and its next-token log-probabilities equal moeserve's."""

    ARCHS = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_group")
    TEXT = ("The quick brown fox jumps over the lazy dog. 12+7=19. {\"a\": [1, 2, 3]}\n"
            "To be or not to be, that is the question.\n")

    def test_logits_match(self):
        tmp = tempfile.mkdtemp()
        ref = os.path.join(os.path.dirname(srvtest.binary()), "logprob_ref")
        try:
            calib = os.path.join(tmp, "calib.txt")
            with open(calib, "w") as f:
                f.write(self.TEXT)
            for arch in self.ARCHS:
                with self.subTest(arch=arch):
                    out = os.path.join(tmp, arch)
                    p = subprocess.run([srvtest.binary(), "prune", "--ratio", "0.5", "--method",
                                        "collab", "--groups", "2", "--calib", calib, "--model",
                                        srvtest.fixture_model(arch), "--out", out],
                                       capture_output=True, timeout=300)
                    self.assertEqual(p.returncode, 0, p.stderr.decode())
                    self.compare(out, ref)
        finally:
            shutil.rmtree(tmp)

    def compare(self, folder, ref):
        import torch
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        vocab = cfg["vocab_size"]
        ids = [(7 * i + 3) % vocab for i in range(24)]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        want = [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
        lines = "".join("%d %s\n" % (p, " ".join(map(str, ids[:p + 1])))
                        for p in range(1, len(ids)))
        r = subprocess.run([ref, folder], input=lines.encode(), capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        got = [float(x) for x in r.stdout.split()]
        self.assertEqual(len(got), len(want))
        worst = max(abs(a - b) for a, b in zip(got, want))
        self.assertLess(worst, 1e-4, (folder, got[:4], want[:4]))


if __name__ == "__main__":
    srvtest.main()
