"""SIGTERM handling: with a grace period, in-flight generations run to completion while new
generation requests get 503 and /health says 503, then the process exits 0; with
--shutdown-grace 0 the in-flight stream is ended at once (its client is answered, not left
hanging) and the process still exits 0. A second signal during the drain ends it at once, yet
every stream still gets a final chunk and [DONE]; a signal while the model loads exits 0. These
two used to kill the process (143): a thread OpenBLAS starts before main keeps the signals
unblocked and took the default action."""
import http.client
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import srvtest

LONG = {"prompt": "Hello", "max_tokens": 400, "n": 16, "ignore_eos": True, "stream": True}


def start_stream(port, out, body=LONG):
    """Streams body in a thread; out gets ('ok', status, raw body) or ('error', None, exc)."""
    def run():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/v1/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            out.append(("ok", r.status, r.read()))
            c.close()
        except Exception as e:  # the grace-0 case may cut the connection
            out.append(("error", None, e))
    t = threading.Thread(target=run)
    t.start()
    return t


class ShutdownTest(unittest.TestCase):
    def running(self, srv):
        return srv.metrics().total("moeserve_num_requests_running") > 0

    def test_graceful_drain(self):
        srv = srvtest.Server().start()
        try:
            out = []
            t = start_stream(srv.port, out)
            srvtest.wait_until(lambda: self.running(srv), 10, "the stream to start")
            srv.proc.send_signal(signal.SIGTERM)
            # draining: no new generations, health reports it, in-flight ones go on
            srvtest.wait_until(
                lambda: srvtest.request(srv.port, "GET", "/health")[0] == 503, 10,
                "/health == 503 while draining")
            st, _, body = srvtest.post_json(srv.port, "/v1/completions",
                                            {"prompt": "x", "max_tokens": 2})
            self.assertEqual(st, 503, body)
            self.assertEqual(body["error"]["type"], "service_unavailable_error")
            t.join(60)
            self.assertFalse(t.is_alive())
            kind, status, raw = out[0]
            self.assertEqual((kind, status), ("ok", 200), raw)
            events = srvtest.sse_events(raw)
            self.assertEqual(events[-1], "[DONE]")
            finishes = [c["finish_reason"] for e in events[:-1]
                        for c in json.loads(e)["choices"] if c["finish_reason"]]
            self.assertEqual(finishes, ["length"] * 16)
            self.assertEqual(srv.proc.wait(30), 0, srv.output())
        finally:
            srv.stop()
            srv.close()

    def test_grace_zero_aborts_in_flight(self):
        srv = srvtest.Server("--shutdown-grace", "0").start()
        try:
            out = []
            t = start_stream(srv.port, out)
            srvtest.wait_until(lambda: self.running(srv), 10, "the stream to start")
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            self.assertEqual(srv.proc.wait(30), 0, srv.output())
            self.assertLess(time.monotonic() - t0, 10)
            t.join(30)
            self.assertFalse(t.is_alive(), "the client was left hanging")
            kind, status, raw = out[0]
            if kind == "ok":  # answered: the stream ends, no finish "length" for all 16
                self.assertEqual(status, 200)
                text = raw.decode("utf-8", "replace")
                self.assertLess(text.count('"finish_reason":"length"'), 16, text[-500:])
        finally:
            srv.stop()
            srv.close()

    def test_second_signal_ends_the_drain(self):
        """16 streams, two running at a time: the drain would take seconds; a second SIGTERM
        ends it at once and every stream is still closed properly."""
        model = os.path.join(srvtest.tests_dir(), "..", "models", "mohge-small")
        srv = srvtest.Server("--max-num-seqs", "2", "--max-model-len", "1024",
                             model=model).start()
        try:
            outs, threads = [], []
            body = dict(LONG, prompt="ROMEO:", max_tokens=500, n=1)
            for _ in range(16):
                threads.append(start_stream(srv.port, outs, body))
            srvtest.wait_until(
                lambda: (lambda m: m.total("moeserve_num_requests_running") == 2 and
                         m.total("moeserve_num_requests_waiting") == 14)(srv.metrics()), 30,
                "16 streams in")
            srv.proc.send_signal(signal.SIGTERM)
            srvtest.wait_until(
                lambda: srvtest.request(srv.port, "GET", "/health")[0] == 503, 10, "draining")
            self.assertTrue(self.running(srv), "the drain ended before the second signal")
            srv.proc.send_signal(signal.SIGTERM)
            self.assertEqual(srv.proc.wait(15), 0, srv.output())
            self.assertIn("second signal", srv.output())
            for t in threads:
                t.join(30)
            self.assertEqual(len(outs), 16)
            for kind, status, raw in outs:
                self.assertEqual((kind, status), ("ok", 200), raw)
                events = srvtest.sse_events(raw)
                self.assertEqual(events[-1], "[DONE]")
                finishes = [c["finish_reason"] for e in events[:-1]
                            for c in json.loads(e)["choices"] if c["finish_reason"]]
                self.assertEqual(len(finishes), 1, raw[-300:])
                self.assertIn(finishes[0], ("abort", "length"))
        finally:
            srv.stop()
            srv.close()

    def test_signal_while_loading(self):
        """The chat template is read from a FIFO nobody writes: the server stays in its
        loading phase (/health 503) until the signal."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            with tempfile.TemporaryDirectory() as d:
                fifo = os.path.join(d, "template.fifo")
                os.mkfifo(fifo)
                port = srvtest.free_port()
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen([srvtest.binary(), "serve", "--model",
                                         srvtest.fixture_model(), "--port", str(port),
                                         "--chat-template", fifo], stdout=log,
                                        stderr=subprocess.STDOUT)
                try:
                    def loading():
                        try:
                            return srvtest.request(port, "GET", "/health", timeout=2)[0] == 503
                        except OSError:
                            return False
                    srvtest.wait_until(loading, 30, "/health 503 while loading")
                    proc.send_signal(sig)
                    rc = proc.wait(10)
                    log.seek(0)
                    out = log.read().decode()
                    self.assertEqual(rc, 0, out)
                    self.assertIn("while loading the model", out)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    log.close()


if __name__ == "__main__":
    srvtest.main()
