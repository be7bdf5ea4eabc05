#!/usr/bin/env python3
"""Multi-node scaling under a simulated network: N ranks (2, 4, 8 by default) of `mpirun ...
moeserve serve`, each rank in a network namespace of its own (its own "node": own interface,
address and hostname), joined by veth pairs to a bridge in a hub namespace, and launched the way
mpirun launches on real nodes (its rsh agent, here `ip netns exec` instead of ssh). Every node's
link is shaped in both directions with a token bucket (tc tbf) at 1, 10 and 100 Gbit/s, and
delayed by tc netem where the kernel has it (--latency-us 50,1000).

For each rank count, link and batch (1, 32, 256 concurrent requests, every one decoding
--max-tokens tokens) it measures the mean engine step time (wall time over the server's steps,
`moeserve_iteration_tokens_count`), the all-to-all bytes per token and per step on the busiest
link (`moeserve_all_to_all_bytes_total{device,peer}`), against a single process serving the same
batch. The model is tiny (hidden 512, experts 128 wide: `make_synthetic_model --active 4M`), so
that what grows with the ranks is communication.

It then fits a cost model to the shaped points,

    step(N, link, B) = step(N, unshaped, B) + b * busiest_link_bytes_per_step / link_rate

(b: the inverse of the share of the nominal rate an exchange gets) and prints measured against
predicted at every shaped point. It also reports alpha0(N): what N ranks add to a step at batch 1
on the unshaped veth links, per exchange round (software latency; on a machine with fewer cores
than ranks it also holds their competition for the cores). The link latency itself cannot be
varied without netem. b and alpha0 are what `moeserve placement-sim --link-gbps G
--link-latency-us A --link-efficiency 1/b` takes to predict step times at 16 to 256 devices (see
README "Several processes").

Needs root, iproute2 and Open MPI; creates only namespaces named moeserve-* and removes them at
exit.

  python3 bench/net_scale.py [--binary build/moeserve] [--ranks 2,4,8] [--gbps 1,10,100]
      [--batches 1,32,256] [--max-tokens 32] [--repeat 3] [--json FILE]
"""
import argparse
import atexit
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HUB = "moeserve-hub"
SUBNET = "10.77.0"
PORT = 8000
# Latency rounds of one step of the tiny model (2 MoE layers) on MPI: per MoE layer three
# all-to-alls (dispatch rows, their expert ids, results back), each a round of counts and one of
# rows; plus the step plan out and the logits back.
ROUNDS_PER_STEP = 2 * 3 * 2 + 2


def sh(*cmd, check=True):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        sys.exit("net_scale: %s failed: %s" % (" ".join(cmd), r.stderr.strip()))
    return r


def node_ns(k):
    return "moeserve-n%d" % k


def teardown(n):
    for k in range(n):
        sh("ip", "netns", "del", node_ns(k), check=False)
    sh("ip", "netns", "del", HUB, check=False)


def setup(n):
    """A hub namespace with bridge br0 (SUBNET.254) and n node namespaces, node k at
    SUBNET.(k+1) on its eth0, whose veth peer p<k> is a port of br0."""
    teardown(n)
    sh("ip", "netns", "add", HUB)
    sh("ip", "-n", HUB, "link", "set", "lo", "up")
    sh("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", HUB, "addr", "add", SUBNET + ".254/24", "dev", "br0")
    sh("ip", "-n", HUB, "link", "set", "br0", "up")
    for k in range(n):
        ns = node_ns(k)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", "p%d" % k,
           "netns", HUB)
        sh("ip", "-n", ns, "addr", "add", "%s.%d/24" % (SUBNET, k + 1), "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", HUB, "link", "set", "p%d" % k, "master", "br0")
        sh("ip", "-n", HUB, "link", "set", "p%d" % k, "up")


def shape(n, gbps, latency_us):
    """Both directions of every node's link: its eth0 (egress from the node) and its bridge
    port (egress towards the node). gbps 0: unshaped."""
    for k in range(n):
        for ns, dev in ((node_ns(k), "eth0"), (HUB, "p%d" % k)):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if latency_us:
                args = ["netem", "delay", "%dus" % latency_us]
                if gbps:
                    args += ["rate", "%dgbit" % gbps]
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *args)
            elif gbps:
                # burst: 200 us at the rate, and at least two 64 KB GSO packets
                burst = max(128 * 1024, int(gbps * 1e9 / 8 * 200e-6))
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                   "%dgbit" % gbps, "burst", str(burst), "latency", "100ms")


def has_netem():
    r = sh("tc", "-n", HUB, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1us",
           check=False)
    sh("tc", "-n", HUB, "qdisc", "del", "dev", "p0", "root", check=False)
    return r.returncode == 0


AGENT = """#!/bin/sh
# mpirun's rsh agent for net_scale.py: "HOST COMMAND..." runs COMMAND in HOST's namespace, with
# the namespace's name as its hostname (each namespace is a node to Open MPI)
host=$1; shift
k=$(( ${host##*.} - 1 ))
exec ip netns exec moeserve-n$k unshare --uts sh -c "hostname moeserve-n$k; $*"
"""


class Server:
    def __init__(self, args, n, workdir):
        self.n = n
        self.log = open(os.path.join(workdir, "serve-%d.log" % n), "w+b")
        serve = [os.path.abspath(args.binary), "serve", "--model", os.path.abspath(args.model),
                 "--host", SUBNET + ".1", "--port", str(PORT), "--threads", "1",
                 "--max-num-seqs", str(max(args.batches)), "--access-log=false"]
        if n == 1:
            cmd = ["ip", "netns", "exec", node_ns(0)] + serve
        else:
            hosts = os.path.join(workdir, "hosts")
            with open(hosts, "w") as f:
                for k in range(n):
                    f.write("%s.%d slots=1\n" % (SUBNET, k + 1))
            agent = os.path.join(workdir, "agent.sh")
            with open(agent, "w") as f:
                f.write(AGENT)
            os.chmod(agent, 0o755)
            net = SUBNET + ".0/24"
            cmd = ["ip", "netns", "exec", HUB, shutil.which("mpirun"), "--allow-run-as-root",
                   "--hostfile", hosts, "--mca", "plm_rsh_agent", agent, "--mca", "btl",
                   "self,tcp", "--mca", "btl_tcp_if_include", net, "--mca",
                   "oob_tcp_if_include", net, "--map-by", "node", "--bind-to", "none", "-np",
                   str(n)] + serve
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                sys.exit("net_scale: server on %d rank(s) did not start:\n%s" %
                         (n, self.log.read().decode(errors="replace")[-4000:]))
            time.sleep(0.1)

    def get(self, path):
        c = http.client.HTTPConnection(SUBNET + ".1", PORT, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def in_hub():
    """Puts this process (the HTTP clients) in the hub namespace: the server is reached over
    node 0's link like a client on another machine."""
    fd = os.open("/run/netns/" + HUB, os.O_RDONLY)
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            sys.exit("net_scale: setns: %s" % os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


def metrics(srv):
    st, text = srv.get("/metrics")
    if st != 200:
        sys.exit("net_scale: /metrics answered %d" % st)
    out = {"steps": 0.0, "tokens": 0.0, "pairs": {}}
    for line in text.splitlines():
        if line.startswith("moeserve_iteration_tokens_count"):
            out["steps"] = float(line.split()[-1])
        elif line.startswith("moeserve_iteration_tokens_sum"):
            out["tokens"] = float(line.split()[-1])
        elif line.startswith("moeserve_all_to_all_bytes_total{"):
            m = re.search(r'device="(\d+)",peer="(\d+)"\} (\S+)', line)
            if m:
                out["pairs"][(int(m.group(1)), int(m.group(2)))] = float(m.group(3))
    return out


def one(srv, body, errors):
    c = http.client.HTTPConnection(SUBNET + ".1", PORT, timeout=600)
    try:
        c.request("POST", "/v1/completions", body=body,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            errors.append("HTTP %d: %r" % (r.status, data[:200]))
    except OSError as e:
        errors.append(repr(e))
    finally:
        c.close()


def measure(srv, n, batch, max_tokens):
    """`batch` sequences decoding max_tokens each, as requests of 16 sequences (n, the API's
    largest) sent at once: they start within a step or two and then decode in lockstep. The mean
    step time and the bytes."""
    errors, threads = [], []
    for first in range(0, batch, 16):
        body = json.dumps({"prompt": "%d the of and to in" % first, "n": min(16, batch - first),
                           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
                           "seed": first})
        threads.append(threading.Thread(target=one, args=(srv, body, errors)))
    before = metrics(srv)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = metrics(srv)
    if errors:
        sys.exit("net_scale: a request for %d sequences failed: %s" % (batch, errors[0]))
    steps = after["steps"] - before["steps"]
    tokens = after["tokens"] - before["tokens"]
    sent = [0.0] * n
    recv = [0.0] * n
    total = 0.0
    for (d, p), v in after["pairs"].items():
        dv = v - before["pairs"].get((d, p), 0.0)
        if d < n and p < n:
            sent[d] += dv
            recv[p] += dv
            total += dv
    link = max(max(sent), max(recv)) if n > 1 else 0.0
    return {"wall": wall, "steps": steps, "tokens": tokens,
            "step_ms": 1e3 * wall / steps if steps else float("nan"),
            "tokens_step": tokens / steps if steps else 0.0,
            "bytes_token": total / tokens if tokens else 0.0,
            "link_bytes_step": link / steps if steps else 0.0}


def fit(points, base, ranks):
    """b by least squares over the shaped points: step(N, link, B) - step(N, unshaped, B) =
    b * busiest_link_bytes_step / bandwidth. alpha0(N): what a multi-rank step adds at batch 1
    on the unshaped link, per exchange round."""
    sxx = sxy = 0.0
    for p in points:
        if p["n"] == 1 or not p["gbps"]:
            continue
        x = p["link_bytes_step"] * 8 / (p["gbps"] * 1e9) * 1e3  # ms at the nominal rate
        sxx += x * x
        sxy += x * (p["step_ms"] - base[(p["n"], p["batch"])])
    if sxx == 0:
        sys.exit("net_scale: no shaped multi-rank point to fit")
    out = {"b": sxy / sxx}
    for n in ranks:
        if (n, 1) in base and (1, 1) in base:
            out["alpha0_us_%d" % n] = 1e3 * (base[(n, 1)] - base[(1, 1)]) / ROUNDS_PER_STEP
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="build/moeserve")
    ap.add_argument("--model", help="default: a tiny model written with make_synthetic_model")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--gbps", default="1,10,100", help="link rates (0: unshaped)")
    ap.add_argument("--latency-us", default="50,1000",
                    help="added link latency (needs sch_netem in the kernel)")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per point; the step time is their median")
    ap.add_argument("--json", help="also write every point and the fit to this file")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("net_scale: needs root (network namespaces, tc)")
    for tool in ("ip", "tc", "mpirun", "unshare"):
        if not shutil.which(tool):
            sys.exit("net_scale: %s not found" % tool)
    ranks = [int(x) for x in args.ranks.split(",")]
    rates = [int(x) for x in args.gbps.split(",")]
    lats = [int(x) for x in args.latency_us.split(",") if x]
    batches = args.batches = [int(x) for x in args.batches.split(",")]
    workdir = tempfile.mkdtemp(prefix="net_scale.")
    if not args.model:
        args.model = os.path.join(workdir, "model")
        tool = os.path.join(os.path.dirname(os.path.abspath(args.binary)), "make_synthetic_model")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sh(tool, args.model, "--arch", "mixtral", "--hidden", "512", "--layers", "2",
           "--experts", "16", "--top-k", "4", "--vocab", "2048", "--active", "4M",
           "--tokenizer", os.path.join(root, "models", "mohge-small"))
    nmax = max(ranks)
    atexit.register(teardown, nmax)
    setup(nmax)
    netem = has_netem()
    if lats and not netem:
        print("latency: not simulated: this kernel has no sch_netem (tc qdisc netem); the links "
              "add only the veth's own latency")
        lats = []
    in_hub()

    points, base = [], {}
    for n in [1] + ranks:
        srv = Server(args, n, workdir)
        try:
            links = [(0, 0)] + ([] if n == 1 else [(g, 0) for g in rates] +
                                [(0, l) for l in lats])
            for gbps, lat in links:
                shape(nmax, gbps, lat)
                measure(srv, n, 4, 4)  # warm-up: every rank has run a step at this shaping
                for b in batches:
                    runs = sorted((measure(srv, n, b, args.max_tokens)
                                   for _ in range(args.repeat)), key=lambda r: r["step_ms"])
                    m = runs[len(runs) // 2]
                    m.update({"n": n, "gbps": gbps, "latency_us": lat, "batch": b})
                    if not gbps and not lat:
                        base[(n, b)] = m["step_ms"]
                    m["extra_ms"] = m["step_ms"] - base[(n, b)]
                    points.append(m)
                    print("ranks %d  link %-9s  batch %3d: step %7.2f ms (+%.2f), %6.0f B/token, "
                          "busiest link %.0f B/step, %.0f tokens/step" %
                          (n, "%d Gbit/s" % gbps if gbps else
                           ("+%d us" % lat if lat else "unshaped"), b, m["step_ms"],
                           m["extra_ms"], m["bytes_token"], m["link_bytes_step"], m["tokens_step"]),
                          flush=True)
        finally:
            srv.stop()
    shape(nmax, 0, 0)

    f = fit(points, base, ranks)
    print("\nfit: step(N, link, B) = step(N, unshaped, B) + b * busiest-link bytes per step / "
          "link rate")
    print("  b = %.2f: an exchange gets %.0f%% of the nominal rate" % (f["b"], 100.0 / f["b"]))
    for n in ranks:
        if "alpha0_us_%d" % n in f:
            print("  %d ranks: +%.1f us per exchange round at batch 1 on the unshaped link (%d "
                  "rounds a step)" % (n, f["alpha0_us_%d" % n], ROUNDS_PER_STEP))
    print("\n| ranks | link | batch | step, 1 process (ms) | step, unshaped (ms) | step (ms) | "
          "predicted (ms) | error | all-to-all B/token | busiest link B/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        if p["n"] == 1 or not p["gbps"]:
            continue
        un = base[(p["n"], p["batch"])]
        pred = un + f["b"] * p["link_bytes_step"] * 8 / (p["gbps"] * 1e9) * 1e3
        p["predicted_ms"] = pred
        print("| %d | %d Gbit/s | %d | %.2f | %.2f | %.2f | %.2f | %+.0f%% | %.0f | %.0f |" %
              (p["n"], p["gbps"], p["batch"], base[(1, p["batch"])], un, p["step_ms"], pred,
               100.0 * (pred - p["step_ms"]) / p["step_ms"], p["bytes_token"],
               p["link_bytes_step"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"points": points, "fit": f, "netem": netem, "rounds": ROUNDS_PER_STEP}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
