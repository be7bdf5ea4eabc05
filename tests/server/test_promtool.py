"""`promtool check metrics` (Debian's prometheus package) on /metrics after some traffic of
every kind (completions, chat, streaming, errors, an aborted stream), so that every family has
samples; also checks that the families the issue lists are present and that the counters add up
with what the traffic did. Skips (exit 77) when promtool is missing (tools/setup.sh installs it)."""
import json
import shutil
import socket
import subprocess
import unittest

import srvtest

PROMTOOL = shutil.which("promtool")

FAMILIES = [
    "moeserve_num_requests_running", "moeserve_num_requests_waiting",
    "moeserve_prompt_tokens_total", "moeserve_generation_tokens_total",
    "moeserve_request_success_total", "moeserve_time_to_first_token_seconds",
    "moeserve_inter_token_latency_seconds", "moeserve_e2e_request_latency_seconds",
    "moeserve_request_queue_time_seconds", "moeserve_kv_cache_usage_perc",
    "moeserve_num_preemptions_total",
]


class PromtoolTest(unittest.TestCase):
    def traffic(self, port):
        for i in range(3):
            st, _, _ = srvtest.post_json(port, "/v1/completions",
                                         {"prompt": "Hi %d" % i, "max_tokens": 5,
                                          "ignore_eos": True})
            self.assertEqual(st, 200)
        st, _, raw = srvtest.request(port, "POST", "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "yo"}],
                                      "max_tokens": 4, "stream": True, "ignore_eos": True})
        self.assertEqual(st, 200)
        self.assertEqual(srvtest.sse_events(raw)[-1], "[DONE]")
        self.assertEqual(srvtest.request(port, "POST", "/v1/completions", "{bad")[0], 400)
        self.assertEqual(srvtest.request(port, "GET", "/nope")[0], 404)
        self.assertEqual(srvtest.request(port, "GET", "/v1/models")[0], 200)
        self.assertEqual(srvtest.request(port, "POST", "/tokenize", {"prompt": "a"})[0], 200)
        # a stream the client abandons
        body = json.dumps({"prompt": "x", "max_tokens": 400, "n": 4, "stream": True,
                           "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body)
        self.assertTrue(s.recv(100))
        s.close()

    def test_promtool_check_metrics(self):
        if PROMTOOL is None:
            self.skipTest("promtool is not installed (tools/setup.sh installs prometheus)")
        with srvtest.Server() as srv:
            # also valid before any traffic
            self.promtool(srvtest.request(srv.port, "GET", "/metrics")[2])
            self.traffic(srv.port)
            m = srvtest.wait_until(
                lambda: (lambda m: m.total("moeserve_num_requests_running") == 0 and
                         m.total("moeserve_request_success_total") == 8 and m)(srv.metrics()),
                10, "8 finished choices and none running")
            st, hdrs, raw = srvtest.request(srv.port, "GET", "/metrics")
            self.assertEqual(st, 200)
            self.assertTrue(hdrs["content-type"].startswith("text/plain"), hdrs)
            self.promtool(raw)
            text = raw.decode()
            for fam in FAMILIES:
                self.assertIn("# TYPE %s " % fam, text)
            self.assertEqual(m.total("moeserve_request_success_total", finished_reason="length"),
                             4)
            self.assertEqual(m.total("moeserve_request_success_total", finished_reason="abort"),
                             4)
            self.assertGreaterEqual(m.total("moeserve_generation_tokens_total"), 19)
            self.assertEqual(m.total("moeserve_time_to_first_token_seconds_count"),
                             m.total("moeserve_time_to_first_token_seconds_bucket", le="+Inf"))
            # the http counter saw the traffic (the label names are the server's business)
            http = [k for k in m if k[0].startswith("moeserve_http_requests")]
            self.assertTrue(http, "no HTTP request counter")
            self.assertTrue(any(dict(k[1]).get("code") == "404" or
                                dict(k[1]).get("status") == "404" for k in http), http)

    def promtool(self, raw):
        p = subprocess.run([PROMTOOL, "check", "metrics"], input=raw, capture_output=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, "promtool check metrics failed:\n%s%s\n---\n%s" % (
            p.stdout.decode(), p.stderr.decode(), raw.decode()[:3000]))
        # promtool's lint findings (naming, units) are printed even on success: none allowed
        self.assertEqual(p.stdout.decode().strip() + p.stderr.decode().strip(), "")


if __name__ == "__main__":
    srvtest.main()
