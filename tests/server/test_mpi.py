"""Multi-process expert parallelism: `mpirun -np N moeserve serve` on loopback (TCP, ranks
oversubscribed on this machine's cores) gives the same greedy completions and the same logprobs
(top 3 included, within 1e-6) as the single-process server with the same flags, on fixture
models of several architectures and on the bundled model, with requests batched together,
prefix-cache hits and preemption (a KV cache too small for the batch); with --dispatch rows and
tokens alike, the bytes /metrics counts being exactly what each sends. Killing one rank while a
stream runs, or stopping it (a hang), makes the server name the rank, end the stream with an
error, answer 503 on /health within 10 s, and exit 1; the other survivors exit 1 too; when
rank 0 itself dies, the others exit 1 within 10 s. SIGTERM to rank 0 stops every rank with
status 0.

Skipped (77) without mpirun or with a binary built without MPI."""
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import srvtest

MPIRUN = shutil.which("mpirun")
# Loopback TCP between the ranks; --enable-recovery keeps mpirun from killing the survivors
# itself when a rank dies, so that they can notice, report and exit on their own.
MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--mca", "btl",
            "self,tcp", "--mca", "btl_tcp_if_include", "lo", "--enable-recovery"]

PROMPTS = ["ROMEO: %s" % w for w in ("good night", "my lord", "what light", "the sun",
                                     "fair maid", "speak again")]
SHARED = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name"


class MpiServer(srvtest.Server):
    """A Server started as `mpirun -np N moeserve serve ...`. Each rank logs its exit status
    (mpirun's own is 0 under --enable-recovery whatever the ranks did); stop() sends SIGTERM to
    rank 0, which drains and then stops the others (mpirun, signalled itself, would kill the
    ranks after odls_base_sigkill_timeout and exit 1)."""

    def __init__(self, np, *extra, **kw):
        launcher = [MPIRUN] + MPI_ARGS + ["-np", str(np)]
        super().__init__(*extra, launcher=launcher, **kw)

    def rank_pid(self, rank):
        m = re.search(r"\[rank %d\] rank %d of \d+, pid (\d+)" % (rank, rank), self.output())
        return int(m.group(1)) if m else None

    def rank_status(self):
        return {int(r): int(st) for r, st in
                re.findall(r"\[rank (\d+)\] exiting with status (\d+)", self.output())}

    def output(self):
        return super().output() if self.log else getattr(self, "kept", "")

    def close(self):
        if self.log:
            self.kept = self.output()  # the exit statuses are read after the stop
        super().close()

    def stop(self, timeout=30):
        if self.proc and self.proc.poll() is None and self.rank_pid(0):
            os.kill(self.rank_pid(0), signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return super().stop(timeout)


class TcpServer(MpiServer):
    """The same server as N processes started one by one with --nnodes N --node-rank R (no
    mpirun): rank 0 through Server.start, the others before it, each with its own log."""

    def __init__(self, np, *extra, **kw):
        self.np = np
        self.master_port = srvtest.free_port()
        rdv = ["--nnodes", str(np), "--master-port", str(self.master_port)]
        srvtest.Server.__init__(self, *(list(extra) + rdv + ["--node-rank", "0"]), **kw)
        self.rank_extra = list(extra) + rdv
        self.workers = []

    def start(self):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MOESERVE_") or k in ("MOESERVE_BIN", "MOESERVE_TESTS_DIR")}
        for r in range(1, self.np):
            log = tempfile.TemporaryFile()
            p = subprocess.Popen([srvtest.binary(), "serve", "--model", self.model, "--port",
                                  "0"] + self.rank_extra + ["--node-rank", str(r)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
            self.workers.append((p, log))
        return super().start()

    def output(self):
        out = super().output()
        for _, log in self.workers:
            log.seek(0)
            out += log.read().decode("utf-8", "replace")
        return out

    def stop(self, timeout=30):
        rc = super().stop(timeout)
        for p, _ in self.workers:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return rc

    def close(self):
        if self.log:
            self.kept = self.output()
        for p, log in self.workers:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        self.workers = []
        srvtest.Server.close(self)


def complete(port, prompt, max_tokens=12, n=1):
    st, _, body = srvtest.post_json(port, "/v1/completions",
                                    {"prompt": prompt, "max_tokens": max_tokens, "n": n,
                                     "temperature": 0, "logprobs": 3, "ignore_eos": True},
                                    timeout=120)
    assert st == 200, (st, body)
    return [(c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"])
            for c in sorted(body["choices"], key=lambda c: c["index"])]


def workload(port, crowd=False):
    """The prompts at once (batched), then two that share a long prefix (the second hits the
    prefix cache); crowd: then one request of 6 choices of 40 tokens, which together outgrow a
    small KV cache (preemption) whatever the timing."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        out = sum(ex.map(lambda p: complete(port, p), PROMPTS), [])
    out += complete(port, SHARED + " and I")
    out += complete(port, SHARED + " or if")
    if crowd:
        out += complete(port, "ROMEO: but soft", max_tokens=40, n=6)
    return out


class MultiProcess:
    """The checks, for one way of starting the processes (SERVER); the failure reasons each
    way gives (MPI names the silent rank; the TCP star sees a closed connection at once)."""
    SERVER = None
    DISPATCH_NP = 4  # ranks of test_dispatch
    FAIL_RANK0 = None  # what rank 0 reports when rank 1 is killed (SIGKILL) or stopped
    FAIL_RANK2 = None  # what rank 2 reports then

    def assert_same(self, want, got, what):
        self.assertEqual(len(want), len(got))
        for i, ((wt, wl, wtop), (gt, gl, gtop)) in enumerate(zip(want, got)):
            self.assertEqual(wt, gt, "%s, request %d: text" % (what, i))
            self.assertEqual(len(wl), len(gl))
            for a, b in zip(wl, gl):
                self.assertLessEqual(abs(a - b), 1e-6, "%s, request %d: logprob" % (what, i))
            for ta, tb in zip(wtop, gtop):
                self.assertEqual(sorted(ta), sorted(tb), "%s, request %d: top tokens" % (what, i))
                for k in ta:
                    self.assertLessEqual(abs(ta[k] - tb[k]), 1e-6, what)

    def check_model(self, model, nps, extra=(), crowd=False):
        args = ["--threads", "1"] + list(extra)
        with srvtest.Server(*args, model=model) as ref:
            want = workload(ref.port, crowd)
            ref_m = ref.metrics()
        for np in nps:
            srv = self.SERVER(np, *args, model=model)
            with srv:
                got = workload(srv.port, crowd)
                m = srv.metrics()
            self.assertEqual(srv.rank_status(), {r: 0 for r in range(np)},
                             "%s -np %d: every rank exits 0 after SIGTERM" % (model, np))
            # sanitizer builds: mpirun does not pass a rank's leak report on as its status
            for bad in ("Sanitizer", "runtime error:"):
                self.assertNotIn(bad, srv.output())
            self.assert_same(want, got, "%s -np %d" % (os.path.basename(model), np))
            self.assertGreater(m.total("moeserve_prefix_cache_hits_total"), 0)
            # rank 0's /metrics covers every device: the ranks report their counters
            for d in range(np):
                self.assertGreater(m.total("moeserve_device_routed_tokens_total",
                                           device=str(d)), 0, "device %d" % d)
        return ref_m, m

    def test_dispatch(self):
        """--dispatch rows and tokens (given to rank 0 only, as MOESERVE_DISPATCH, under
        --nnodes: the other ranks follow the step plan) on DISPATCH_NP ranks: the completions
        of one process, and rank 0's /metrics bytes exactly what each dispatch sends for the
        routing it counted (mixtral fixture, d_model 64, top-2: rows, per cross-device expert
        row 256 bytes out, a 4-byte id and 256 back; tokens, per (token, other device) 256 out,
        2 ids and 2 weights and 256 back)."""
        model = srvtest.fixture_model("mixtral")
        with srvtest.Server("--threads", "1", model=model) as ref:
            want = workload(ref.port)
        for mode in ("rows", "tokens"):
            srv = self.SERVER(self.DISPATCH_NP, "--threads", "1", model=model,
                              env={"MOESERVE_DISPATCH": mode})
            with srv:
                got = workload(srv.port)
                m = srv.metrics()
            what = "mixtral -np %d --dispatch %s" % (self.DISPATCH_NP, mode)
            self.assert_same(want, got, what)
            rows = m.total("moeserve_cross_device_rows_total")
            sends = m.total("moeserve_cross_device_token_sends_total")
            self.assertGreater(sends, 0, what)
            per = 2 * 256 + 4 if mode == "rows" else 2 * 256 + 16
            self.assertEqual(m.total("moeserve_all_to_all_bytes_total"),
                             (rows if mode == "rows" else sends) * per, what)

    def test_fixture_models(self):
        for name in ("mixtral", "qwen2_moe", "deepseek_v3", "mohge_tiny", "gpt_oss"):
            with self.subTest(model=name):
                self.check_model(srvtest.fixture_model(name), (2,))

    def test_mtp(self):
        """MTP speculation: rank 0 drafts with the checkpoint's module from hidden states the
        other ranks send it for their sequences; output equal to the single-process server's
        (both speculating, greedy: equal to no speculation too). On the bundled model, whose
        module is trained, the drafts are accepted as often as with one process: hidden states
        that did not arrive right would be drafted from garbage and accepted ~never."""
        spec = ("--speculative-config",
                '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}')
        ref_m, m = self.check_model(srvtest.bundled_model(), (2, 4), spec, crowd=True)
        rates = []
        for mm in (ref_m, m):
            drafted = mm.total("moeserve_spec_decode_num_draft_tokens_total")
            accepted = mm.total("moeserve_spec_decode_num_accepted_tokens_total")
            self.assertGreater(drafted, 0)
            rates.append(accepted / drafted)
        print("MTP acceptance: single process %.3f, 4 processes %.3f" % tuple(rates))
        self.assertGreater(rates[0], 0.15)
        self.assertGreater(rates[1], 0.85 * rates[0])  # garbage hidden states: ~0.55x

    def test_preemption_np4(self):
        # mixtral fixture: 8 KiB per 16-token KV block; 8 blocks cannot hold 6 sequences of
        # 3 blocks each, so some are preempted and recomputed
        ref_m, m = self.check_model(srvtest.fixture_model("mixtral"), (2, 4),
                                    ("--kv-cache-memory", "64K", "--max-model-len", "64"),
                                    crowd=True)
        self.assertGreater(ref_m.total("moeserve_num_preemptions_total"), 0)
        self.assertGreater(m.total("moeserve_num_preemptions_total"), 0)

    def test_infmoe_budgets(self):
        """Continuous experts: the per-request budget travels in the step plan."""
        model = srvtest.fixture_model("infmoe_tiny")
        bodies = [{}, {"moe_samples": 1}, {"moe_samples": 2, "moe_neuron_fraction": 0.0625},
                  {"moe_samples": 2, "moe_samples_adaptive": True}]

        def one(port, extra):
            body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "logprobs": 1,
                    "ignore_eos": True}
            body.update(extra)
            st, _, r = srvtest.post_json(port, "/v1/completions", body, timeout=120)
            self.assertEqual(st, 200, r)
            c = r["choices"][0]
            return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]

        def run(port):
            # at once, so that the sequences spread over the ranks
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
                return list(ex.map(lambda x: one(port, x), bodies))
        with srvtest.Server("--threads", "1", model=model) as ref:
            want = run(ref.port)
        with self.SERVER(2, "--threads", "1", model=model) as srv:
            got = run(srv.port)
        self.assert_same(want, got, "infmoe_tiny, 2 ranks")
        # the budgets differ: the test would not see a budget that did not travel
        self.assertNotEqual(want[0][1], want[1][1])

    def test_bundled_model(self):
        self.check_model(srvtest.bundled_model(), (2,))

    def fail_rank(self, how):
        srv = self.SERVER(3, "--threads", "1", "--comm-timeout", "2").start()
        try:
            m = re.search(r"rank 1 of 3, pid (\d+)", srv.output())
            self.assertIsNotNone(m, srv.output())
            victim = int(m.group(1))
            body = {"prompt": "ROMEO: but soft", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            conn = srvtest.http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            conn.request("POST", "/v1/completions", body=srvtest.json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.assertEqual(resp.status, 200)
            first = resp.read1(4096)  # a token arrived: generation is under way
            self.assertIn(b"data: ", first)
            os.kill(victim, how)
            t0 = time.monotonic()

            def health_503():
                try:
                    st, _, body = srvtest.request(srv.port, "GET", "/health", timeout=2)
                except OSError:
                    return False
                return st == 503 and b"the server failed: rank" in body
            srvtest.wait_until(health_503, 10, "/health 503 after the rank failed", 0.05)
            self.assertLess(time.monotonic() - t0, 10)
            rest = (first + resp.read()).decode()
            conn.close()
            self.assertIn('"error"', rest)
            self.assertRegex(rest, self.FAIL_RANK0)
            self.assertTrue(rest.rstrip().endswith("data: [DONE]"), rest[-200:])
            # the survivors exit on their own; a hung rank keeps mpirun waiting for it
            status = srvtest.wait_until(
                lambda: (lambda st: st if 0 in st and 2 in st else None)(srv.rank_status()), 30,
                "ranks 0 and 2 to exit")
            self.assertEqual(status.get(0), 1, srv.output())
            self.assertEqual(status.get(2), 1, srv.output())
            self.assertRegex(srv.output(),
                             r"\[rank 0\] expert parallelism failed: " + self.FAIL_RANK0)
            self.assertRegex(srv.output(),
                             r"\[rank 2\] expert parallelism failed: " + self.FAIL_RANK2)
        finally:
            for r in range(3):  # nothing of this job may outlive the test
                pid = srv.rank_pid(r)
                try:
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()
            srv.close()

    def test_rank0_killed(self):
        """The HTTP rank itself dies: the others notice within --comm-timeout (rank 0 pings
        them every --comm-timeout/4 s, idle or not) and exit 1 instead of waiting forever."""
        srv = self.SERVER(3, "--threads", "1", "--comm-timeout", "2").start()
        try:
            os.kill(srv.rank_pid(0), signal.SIGKILL)
            t0 = time.monotonic()
            status = srvtest.wait_until(
                lambda: (lambda st: st if 1 in st and 2 in st else None)(srv.rank_status()), 30,
                "ranks 1 and 2 to exit")
            self.assertLess(time.monotonic() - t0, 10)
            self.assertEqual(status, {1: 1, 2: 1}, srv.output())
            self.assertRegex(srv.output(), r"\[rank 1\] expert parallelism failed: rank 0")
        finally:
            for r in range(3):
                try:
                    os.kill(srv.rank_pid(r), signal.SIGKILL)
                except (OSError, TypeError):
                    pass
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()
            srv.close()

    def test_rank_killed(self):
        self.fail_rank(signal.SIGKILL)

    def test_rank_hangs(self):
        self.fail_rank(signal.SIGSTOP)


class MpiTest(MultiProcess, unittest.TestCase):
    SERVER = MpiServer
    # rank 1, and maybe rank 2 too: blocked in an exchange with rank 1, it falls silent
    FAIL_RANK0 = r"ranks? (2, )?1(, 2)? did not answer"
    # rank 2 names whom it was waiting for: rank 1 in an exchange, or rank 0 when it waits for
    # the next step while rank 0 itself is blocked on rank 1 (no pings from inside an MPI call):
    # both timeouts are --comm-timeout and start together, so which fires first is a race
    FAIL_RANK2 = r"ranks? [0-9, ]*\b[01]\b[0-9, ]* did not answer"

    @classmethod
    def setUpClass(cls):
        if MPIRUN is None:
            raise unittest.SkipTest("mpirun not found (tools/setup.sh installs openmpi-bin)")
        p = subprocess.run([MPIRUN] + MPI_ARGS + ["-np", "2", srvtest.binary(), "serve",
                                                  "--model", "/nonexistent", "--port", "0"],
                           capture_output=True, timeout=60)
        if b"this build has no MPI" in p.stdout + p.stderr:
            raise unittest.SkipTest("moeserve was built without MPI")


class TcpTest(MultiProcess, unittest.TestCase):
    """--nnodes without mpirun; fewer models: the engine path is the same as under MPI."""
    SERVER = TcpServer
    DISPATCH_NP = 3  # rows between ranks 1 and 2 relayed by rank 0
    # killed: its connection closes at once; stopped: it does not answer. Rank 2 talks to
    # rank 0 only, and sees it leave (or fall silent while it lingers).
    FAIL_RANK0 = r"rank 1 (closed its connection|did not answer)"
    FAIL_RANK2 = r"rank 0 (closed its connection|did not answer)"

    def test_fixture_models(self):
        self.check_model(srvtest.fixture_model("deepseek_v3"), (2,))


if __name__ == "__main__":
    srvtest.main()
