#!/usr/bin/env python3
"""Does an expensive structured-output request delay other clients? `/health` latency (p50,
p99, max) and one ordinary completion's latency, measured on keep-alive connections, first on
an idle server (the baseline), then while N attacker threads (8 by default) keep sending
completions whose response_format is a JSON Schema object with 10,000 properties (~350 KB).

Two attack modes: `same` sends one schema over and over (the grammar cache answers all but the
first), `distinct` changes a property name in every request so that each one compiles afresh.
Prints each phase's figures and the ratio of its /health p99 to the idle baseline's.

  python3 bench/grammar_stall.py --binary build/moeserve --model models/mohge-small
  python3 bench/grammar_stall.py --url http://127.0.0.1:8000 --attackers 8 --seconds 20
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schema_body(tag, n_props):
    props = {"p%d_%s" % (i, tag): {"type": "string"} for i in range(n_props)}
    return json.dumps({"prompt": "a", "max_tokens": 1,
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "big", "schema": {"type": "object", "properties": props}}}})


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def probe(host, port, seconds, period=0.01):
    """/health latencies (ms) on one keep-alive connection, plus ordinary completions'."""
    health, comp = [], []
    c = http.client.HTTPConnection(host, port, timeout=120)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t = time.monotonic()
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        health.append((time.monotonic() - t) * 1e3)
        i += 1
        if i % 50 == 0:
            t = time.monotonic()
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hello",
                                                                   "max_tokens": 4}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            comp.append((time.monotonic() - t) * 1e3)
        time.sleep(period)
    c.close()
    return health, comp


def attacker(host, port, stop, bodies, counts):
    c = http.client.HTTPConnection(host, port, timeout=300)
    k = 0
    while not stop.is_set():
        body = bodies[k % len(bodies)]
        try:
            c.request("POST", "/v1/completions", body=body,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            counts[r.status] = counts.get(r.status, 0) + 1
        except (OSError, http.client.HTTPException):
            c.close()
            c = http.client.HTTPConnection(host, port, timeout=300)
        k += 1
    c.close()


def phase(host, port, seconds, attackers, mode, n_props, per_attacker):
    """The bodies are made before the phase starts, so that the clients spend their time
    sending, not building JSON (they share the machine with the server)."""
    stop = threading.Event()
    counts = {}
    same = [schema_body("x", n_props)]
    bodies = [same if mode == "same" else
              [schema_body("%d_%d" % (i, k), n_props) for k in range(per_attacker)]
              for i in range(attackers)]
    ts = [threading.Thread(target=attacker, args=(host, port, stop, bodies[i], counts))
          for i in range(attackers)]
    for t in ts:
        t.start()
    time.sleep(0.5 if attackers else 0)
    health, comp = probe(host, port, seconds)
    stop.set()
    for t in ts:
        t.join()
    return health, comp, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary")
    ap.add_argument("--model")
    ap.add_argument("--url")
    ap.add_argument("--attackers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--properties", type=int, default=10000)
    ap.add_argument("--distinct", type=int, default=48,
                    help="distinct bodies per attacker made for the distinct phase (repeats "
                         "after that hit the grammar cache; the answers count says how many "
                         "were sent)")
    a = ap.parse_args()
    proc = None
    if a.url:
        hp = a.url.split("//", 1)[-1].rstrip("/")
        host, port = hp.rsplit(":", 1)
        port = int(port)
    else:
        if not (a.binary and a.model):
            ap.error("--binary and --model, or --url")
        host, port = "127.0.0.1", free_port()
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([a.binary, "serve", "--model", a.model, "--port", str(port),
                                 "--host", host], stdout=log, stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                c = http.client.HTTPConnection(host, port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
    try:
        print("body: %d bytes, %d properties; %d attackers, %.0f s a phase"
              % (len(schema_body("x", a.properties)), a.properties, a.attackers, a.seconds))
        base = None
        for name, n, mode in (("idle", 0, "same"), ("same schema", a.attackers, "same"),
                              ("distinct schemas", a.attackers, "distinct")):
            health, comp, counts = phase(host, port, a.seconds, n, mode, a.properties,
                                         a.distinct)
            p99 = pct(health, 0.99)
            if base is None:
                base = p99
            print("%-17s /health n=%d p50 %.2f ms p99 %.2f ms max %.2f ms (p99 %.1fx idle); "
                  "completion p50 %.1f ms max %.1f ms; attacker answers %s"
                  % (name, len(health), pct(health, 0.5), p99, max(health), p99 / base,
                     pct(comp, 0.5), max(comp) if comp else float("nan"),
                     json.dumps(counts, sort_keys=True)))
            sys.stdout.flush()
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
