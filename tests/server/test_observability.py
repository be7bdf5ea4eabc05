"""Observability against a live server: vLLM's request-level metrics under moeserve_ names with
vLLM's meaning (values checked against the traffic sent), the process_* families and
moeserve_build_info, and the deployment files that name metrics: the vLLM relabel config
(deploy/prometheus/vllm-relabel.yml) must produce every vLLM name listed here from the names a
live /metrics exports, and the Grafana dashboard (deploy/grafana/*.json) and the Prometheus
rules (deploy/kubernetes/base/common/prometheusrule.yaml) may only query names /metrics exports (plus
Prometheus' own `up`)."""
import glob
import json
import os
import re
import time
import unittest

import srvtest

try:
    import yaml
except ImportError:  # PyYAML comes with Debian's python3-yaml; tools/setup.sh installs it
    yaml = None

# vLLM's metric names (docs.vllm.ai "Production Metrics", V1 engine) that moeserve serves.
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:iteration_tokens_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_params_n",
}
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def repo():
    return os.path.dirname(srvtest.tests_dir())


def family_names(text):
    """Family names from the # TYPE lines, and every sample name."""
    fams = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    samples = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    return fams, samples


def relabel(rules, name):
    """Prometheus relabeling of __name__ (anchored regex, ${n} replacement), in order."""
    for r in rules:
        assert r["source_labels"] == ["__name__"] and r["target_label"] == "__name__", r
        m = re.fullmatch(r["regex"], name)
        if m:
            name = re.sub(r"\$\{(\d+)\}", lambda g: m.group(int(g.group(1))) or "",
                          r["replacement"])
    return name


def promql_names(expr):
    """Metric names a PromQL expression reads: identifiers that are not functions, keywords,
    label names inside {...} / by (...) / on (...), durations or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # strings
    expr = re.sub(r"\{[^}]*\}", "{}", expr)                   # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # ranges
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word = m.group(0)
        rest = expr[m.end():].lstrip()
        if rest.startswith("("):
            continue  # a function
        if word in ("and", "or", "unless", "bool", "offset", "inf", "nan", "Inf", "NaN",
                    "le", "by", "on"):
            continue
        names.add(word)
    return names


def dashboard_exprs(d):
    out = []
    for p in d.get("panels", []):
        out += [t["expr"] for t in p.get("targets", []) if "expr" in t]
        out += dashboard_exprs(p)  # rows
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue  # datasource, interval, custom variables hold no PromQL
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str) and q:
            m = re.match(r"label_values\((?:([^,()]+),)?\s*[a-z_]+\)", q)
            if m:
                out.append(m.group(1) or "up")
            else:
                out.append(q)
    return out


class Observability(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.t_before = time.time()
        cls.srv = srvtest.Server("--devices", "2").start()
        cls.t_after = time.time()
        port = cls.srv.port
        st, _, r = srvtest.post_json(port, "/v1/completions",
                                     {"prompt": "Hello world", "max_tokens": 6, "n": 2,
                                      "ignore_eos": True})
        assert st == 200, r
        cls.usage = r["usage"]
        st, _, r = srvtest.post_json(port, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 3, "ignore_eos": True})
        assert st == 200, r
        cls.usage2 = r["usage"]
        assert srvtest.request(port, "GET", "/nope")[0] == 404
        cls.m = srvtest.wait_until(
            lambda: (lambda m: m.total("moeserve_request_success_total") == 3 and m)(
                cls.srv.metrics()), 10, "3 finished choices")
        cls.text = srvtest.request(port, "GET", "/metrics")[2].decode()
        cls.fams, cls.samples = family_names(cls.text)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def test_vllm_request_histograms(self):
        m = self.m
        # 3 choices: 2 of 6 tokens (n=2), 1 of 3
        self.assertEqual(m.total("moeserve_request_generation_tokens_count"), 3)
        self.assertEqual(m.total("moeserve_request_generation_tokens_sum"), 15)
        self.assertEqual(m.total("moeserve_request_prompt_tokens_sum"),
                         self.usage["prompt_tokens"] * 2 + self.usage2["prompt_tokens"])
        self.assertEqual(m.total("moeserve_request_params_max_tokens_sum"), 15)
        # per request, not per choice: the n=2 request's most (6) and the chat's 3
        self.assertEqual(m.total("moeserve_request_max_num_generation_tokens_count"), 2)
        self.assertEqual(m.total("moeserve_request_max_num_generation_tokens_sum"), 9)
        for le, want in (("2", 0), ("5", 1), ("10", 2), ("+Inf", 2)):
            self.assertEqual(m.total("moeserve_request_max_num_generation_tokens_bucket", le=le),
                             want, "le=%s" % le)
        self.assertEqual(m.total("moeserve_request_params_n_count"), 2)
        self.assertEqual(m.total("moeserve_request_params_n_sum"), 3)
        self.assertEqual(m.total("moeserve_request_params_n_bucket", le="1"), 1)
        for fam in ("prefill", "decode", "inference"):
            self.assertEqual(m.total("moeserve_request_%s_time_seconds_count" % fam), 3)
        # inference = prefill + decode, per request, so in sum too
        self.assertAlmostEqual(m.total("moeserve_request_inference_time_seconds_sum"),
                               m.total("moeserve_request_prefill_time_seconds_sum") +
                               m.total("moeserve_request_decode_time_seconds_sum"), places=6)
        # time per output token: one per request with more than one token
        self.assertEqual(m.total("moeserve_request_time_per_output_token_seconds_count"), 3)
        # the older name of the inter-token latency is the same histogram
        for suffix in HIST_SUFFIXES:
            self.assertEqual(m.total("moeserve_time_per_output_token_seconds" + suffix),
                             m.total("moeserve_inter_token_latency_seconds" + suffix))
        self.assertEqual(m.total("moeserve_inter_token_latency_seconds_count"), 15 - 3)

    def test_max_num_generation_tokens_counts_generated(self):
        """vLLM's request_max_num_generation_tokens is the most tokens a request's choices
        generated (its ParentRequest's max over children), not max_tokens: a request cut short
        by a stop string counts what it generated, each prompt of a list is a request, and a
        streamed request counts once its stream is complete."""
        port = self.srv.port
        before = self.srv.metrics()
        st, _, r = srvtest.post_json(port, "/v1/completions", {
            "prompt": "Hello world", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        self.assertEqual((st, r["usage"]["completion_tokens"]), (200, 16), r)
        text = r["choices"][0]["text"]
        stop = text[len(text) // 2:][:2]
        self.assertTrue(stop, repr(text))
        # greedy again, so the same text, cut where the stop string first shows
        st, _, r = srvtest.post_json(port, "/v1/completions", {
            "prompt": "Hello world", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "n": 2, "stop": [stop]})
        self.assertEqual(st, 200, r)
        cut = r["usage"]["completion_tokens"] // 2
        self.assertLess(cut, 16, r)
        self.assertGreater(cut, 0, r)
        st, _, r = srvtest.post_json(port, "/v1/completions", {
            "prompt": ["a", "b"], "max_tokens": 4, "ignore_eos": True})
        self.assertEqual(st, 200, r)
        # streamed: observed before [DONE] goes out
        st, _, raw = srvtest.request(port, "POST", "/v1/completions", {
            "prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True})
        self.assertEqual(st, 200, raw[:200])
        self.assertEqual(srvtest.sse_events(raw)[-1], "[DONE]")
        after = self.srv.metrics()

        def delta(suffix, **labels):
            name = "moeserve_request_max_num_generation_tokens" + suffix
            return after.total(name, **labels) - before.total(name, **labels)
        observed = [16, cut, 4, 4, 3]
        self.assertEqual(delta("_count"), len(observed))
        self.assertEqual(delta("_sum"), sum(observed))
        for le in (1, 2, 5, 10, 20):
            self.assertEqual(delta("_bucket", le=str(le)), sum(v <= le for v in observed),
                             "le=%d" % le)

    def test_process_and_build_info(self):
        m, pid = self.m, self.srv.proc.pid
        start = m.total("process_start_time_seconds")
        self.assertGreaterEqual(start, self.t_before - 1)
        self.assertLessEqual(start, self.t_after + 1)
        cpu = m.total("process_cpu_seconds_total")
        self.assertGreater(cpu, 0)
        with open("/proc/%d/stat" % pid) as f:  # utime + stime in clock ticks, read after
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        self.assertLessEqual(cpu, ticks + 0.05)  # tick accounting is sampled
        with open("/proc/%d/status" % pid) as f:
            rss = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
        self.assertLess(abs(m.total("process_resident_memory_bytes") - rss), rss * 0.25)
        with open("/proc/%d/limits" % pid) as f:
            soft = int(re.search(r"Max open files\s+(\d+)", f.read()).group(1))
        self.assertEqual(m.total("process_max_fds"), soft)
        self.assertLess(abs(m.total("process_open_fds") - len(os.listdir("/proc/%d/fd" % pid))),
                        8)
        st, _, v = srvtest.request(self.srv.port, "GET", "/version")
        v = json.loads(v)
        self.assertEqual(m.total("moeserve_build_info", version=v["version"],
                                 commit=v["commit"]), 1)

    def test_relabel_gives_vllm_names(self):
        if yaml is None:
            self.skipTest("PyYAML missing")
        with open(os.path.join(repo(), "deploy", "prometheus", "vllm-relabel.yml")) as f:
            rules = yaml.safe_load(f)["metric_relabel_configs"]
        renamed = {relabel(rules, s) for s in self.samples}
        got = {n for n in renamed if n.startswith("vllm:")}
        # a histogram's _bucket/_sum/_count count as its family name
        fams = {re.sub(r"_(bucket|sum|count)$", "", n) for n in got}
        self.assertEqual(VLLM_NAMES - fams, set(), "vLLM names the relabel config misses")
        self.assertEqual(fams - VLLM_NAMES, set(), "relabeled to names vLLM does not have")

    def test_alias_rules_give_vllm_names(self):
        if yaml is None:
            self.skipTest("PyYAML missing")
        with open(os.path.join(repo(), "deploy", "prometheus", "vllm-aliases.rules.yml")) as f:
            groups = yaml.safe_load(f)["groups"]
        fams = set()
        for g in groups:
            for r in g["rules"]:
                self.assertTrue(r["expr"] in self.samples,
                                "%s copies %s, which /metrics does not export" % (r["record"],
                                                                                 r["expr"]))
                fams.add(re.sub(r"_(bucket|sum|count)$", "", r["record"]))
                # the same mapping as the relabel config
                if not r["expr"].startswith("moeserve_iteration_tokens"):
                    self.assertEqual(r["record"], "vllm:" + r["expr"][len("moeserve_"):])
        self.assertEqual(fams, VLLM_NAMES)

    def exported(self, name):
        return name in self.samples or name in self.fams or name == "up"

    def test_dashboard_names_exported(self):
        files = glob.glob(os.path.join(repo(), "deploy", "grafana", "*.json"))
        self.assertTrue(files, "no dashboard in deploy/grafana")
        for path in files:
            with open(path) as f:
                d = json.load(f)
            exprs = dashboard_exprs(d)
            self.assertGreater(len(exprs), 10, path)
            for e in exprs:
                for n in promql_names(e):
                    self.assertTrue(self.exported(n), "%s: %r reads %s, which /metrics does "
                                    "not export" % (os.path.basename(path), e, n))

    def test_dashboard_layout(self):
        """What Grafana needs to import it: unique ids, panels on the 24-column grid without
        overlaps, every query on the chosen data source, the panels the issue lists."""
        with open(os.path.join(repo(), "deploy", "grafana", "moeserve.json")) as f:
            d = json.load(f)
        ids, cells = set(), set()
        for p in d["panels"]:
            self.assertNotIn(p["id"], ids)
            ids.add(p["id"])
            g = p["gridPos"]
            self.assertLessEqual(g["x"] + g["w"], 24, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    self.assertNotIn((x, y), cells, "%s overlaps another panel" % p["title"])
                    cells.add((x, y))
            for t in p.get("targets", []):
                self.assertEqual(t["datasource"]["uid"], "${datasource}", p["title"])
        exprs = " ".join(dashboard_exprs(d))
        for name in ("moeserve_device_routed_tokens_total", "moeserve_load_imbalance_ratio",
                     "moeserve_expert_replicas", "moeserve_time_to_first_token_seconds_bucket",
                     "moeserve_inter_token_latency_seconds_bucket",
                     "moeserve_e2e_request_latency_seconds_bucket",
                     "moeserve_generation_tokens_total", "moeserve_kv_cache_usage_perc",
                     "moeserve_num_requests_waiting", "moeserve_num_preemptions_total",
                     "moeserve_http_requests_total"):
            self.assertIn(name, exprs)

    def test_rules_names_exported(self):
        if yaml is None:
            self.skipTest("PyYAML missing")
        paths = [os.path.join(repo(), "deploy", "kubernetes", "base", "common",
                               "prometheusrule.yaml")]
        n_rules = 0
        for path in paths:
            with open(path) as f:
                spec = yaml.safe_load(f)["spec"]
            for g in spec["groups"]:
                for r in g["rules"]:
                    n_rules += 1
                    for n in promql_names(r["expr"]):
                        self.assertTrue(self.exported(n) or n.startswith("vllm:"),
                                        "rule %s reads %s, which /metrics does not export" %
                                        (r.get("alert") or r.get("record"), n))
        self.assertGreaterEqual(n_rules, 5)

    def test_parser_catches_unknown_names(self):
        # the checks above must be able to fail
        self.assertEqual(promql_names('sum by (device) (rate(moeserve_nope_total{a="b"}[5m]))'),
                         {"moeserve_nope_total"})
        self.assertFalse(self.exported("moeserve_nope_total"))
        self.assertEqual(promql_names("histogram_quantile(0.9, sum by (le) (rate(x_bucket[1m])))"
                                      " > 0.5 and on (pod) y == 1"), {"x_bucket", "y"})


if __name__ == "__main__":
    srvtest.main()
