#!/usr/bin/env python3
"""Speculative decoding side by side with llama.cpp's server (not a test): generated tokens/s
through streaming /v1/completions at several concurrencies, greedy, with speculation off, with
n-gram lookup (moeserve's prompt lookup; llama-server's --spec-type ngram-simple) and with a
draft model (moeserve: the same checkpoint quantized to int8 at load; llama-server: the Q8_0
GGUF of the same weights as --model-draft) for each k of --k, on the same weights and the same
repetitive prompt. Both servers get --threads; they run one after the other, never together.
The measurement is bench/bench_server.py's (its run_level): tokens/s = generated tokens of a
level / its wall time.

  python3 bench/spec_llamacpp.py --binary build/moeserve --model HF_DIR \\
      --gguf HF_DIR.BF16.gguf --draft-gguf HF_DIR.Q8_0.gguf --llama-bin LLAMA_CPP/build/bin \\
      [--concurrency 1,8,32] [--k 2,4] [--max-tokens 128] [--threads 2] [--json FILE]

moeserve also reports its acceptance (from /metrics); llama-server's is read from its
/slots endpoint when it exposes draft counters, else left blank.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_server as bs  # noqa: E402

PROMPT = ('{"id": 1, "name": "alpha", "city": "Paris", "score": 12}\n'
          '{"id": 2, "name": "beta", "city": "Rome", "score": 7}\n'
          '{"id": 3, "name": "gamma", "city": "Oslo", "score": 31}\n'
          '{"id": 4, "name": "delta", "city": "Lima", "score": 18}\n'
          'static int add(int a, int b)\n{\n    int sum = a + b;\n    return sum;\n}\n'
          'Rename sum to total:\n'
          'static int add(int a, int b)\n{\n    int total = a + b;\n    return total;\n}\n'
          '{"id": 5, "name": "epsilon", "city": "Kyiv", "score": 22}\n{"id": 6, "name": "')


def wait_healthy(port, proc, what):
    deadline = time.monotonic() + 300
    while True:
        try:
            if bs.get("127.0.0.1", port, "/health")[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("%s exited with %d" % (what, proc.returncode))
        if time.monotonic() > deadline:
            raise RuntimeError("%s is not healthy after 300s" % what)
        time.sleep(0.1)


def metric(port, name):
    st, body = bs.get("127.0.0.1", port, "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def measure(port, levels, max_tokens, n_req):
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    hdr = {"Content-Type": "application/json"}
    bs.run_level("127.0.0.1", port, 1, 1, body, hdr)  # warm-up (and the prompt cached)
    out = []
    for c in levels:
        out.append(bs.run_level("127.0.0.1", port, c, max(n_req, c), body, hdr))
    return out


def run_moeserve(args, label, spec, levels):
    port = bs.free_port()
    cmd = [args.binary, "serve", "--model", args.model, "--port", str(port), "--threads",
           str(args.threads), "--max-num-seqs", "64", "--log-stats-interval", "0",
           "--no-access-log"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc, "moeserve")
        res = measure(port, levels, args.max_tokens, args.requests)
        acc = None
        if spec:
            d = metric(port, "moeserve_spec_decode_num_draft_tokens_total")
            a = metric(port, "moeserve_spec_decode_num_accepted_tokens_total")
            acc = a / d if d else 0.0
        return [dict(r, engine="moeserve", mode=label, accept=acc) for r in res]
    finally:
        proc.terminate()
        proc.wait()


def run_llama(args, label, extra, levels):
    port = bs.free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)
    top = max(levels)
    cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", args.gguf, "--host", "127.0.0.1",
           "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "-np",
           str(top), "-c", str(top * (args.max_tokens + 512)), "--no-webui"] + extra
    log = open(os.path.join(args.logs, "llama-%s.log" % label.replace(" ", "_")), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, proc, "llama-server " + label)
        res = measure(port, levels, args.max_tokens, args.requests)
        return [dict(r, engine="llama.cpp", mode=label, accept=None) for r in res]
    except RuntimeError as e:  # one mode that does not run (its log says why) ends no run
        print("skipped: %s (log: %s)" % (e, log.name), flush=True)
        return []
    finally:
        proc.terminate()
        proc.wait()
        log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="build/moeserve")
    ap.add_argument("--model", required=True, help="the Hugging Face folder moeserve serves")
    ap.add_argument("--gguf", help="the same weights as GGUF for llama-server")
    ap.add_argument("--draft-gguf", help="llama-server's draft model (e.g. the Q8_0 GGUF)")
    ap.add_argument("--llama-bin", help="llama.cpp's build/bin (llama-server); none: skip it")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="moeserve,llama.cpp")
    ap.add_argument("--modes", default="off,ngram,draft")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    modes = args.modes.split(",")
    rows = []
    if "moeserve" in args.engines:
        if "off" in modes:
            rows += run_moeserve(args, "off", None, levels)
        for k in ks:
            if "ngram" in modes:
                rows += run_moeserve(args, "ngram k=%d" % k, {
                    "method": "ngram", "num_speculative_tokens": k, "adaptive": False}, levels)
            if "draft" in modes:
                rows += run_moeserve(args, "draft k=%d" % k, {
                    "model": args.model, "num_speculative_tokens": k, "quantization": "int8",
                    "adaptive": False}, levels)
        kmax = max(ks)
        if "ngram" in modes:
            rows += run_moeserve(args, "ngram adaptive k<=%d" % kmax, {
                "method": "ngram", "num_speculative_tokens": kmax}, levels)
        if "draft" in modes:
            rows += run_moeserve(args, "draft adaptive k<=%d" % kmax, {
                "model": args.model, "num_speculative_tokens": kmax, "quantization": "int8"},
                levels)
    if "llama.cpp" in args.engines and args.llama_bin and args.gguf:
        if "off" in modes:
            rows += run_llama(args, "off", [], levels)
        for k in ks:
            if "ngram" in modes:
                rows += run_llama(args, "ngram k=%d" % k, [
                    "--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)], levels)
            if "draft" in modes and args.draft_gguf:
                rows += run_llama(args, "draft k=%d" % k, [
                    "--spec-type", "draft-simple", "-md", args.draft_gguf,
                    "--spec-draft-n-max", str(k), "-td", str(args.threads)], levels)
    base = {(r["engine"], r["conc"]): r["tok_s"] for r in rows if r["mode"] == "off"}
    print("%-10s %-22s %5s %9s %8s %7s %7s" % ("engine", "mode", "conc", "tok/s", "vs off",
                                               "accept", "errors"))
    for r in rows:
        b = base.get((r["engine"], r["conc"]))
        print("%-10s %-22s %5d %9.1f %8s %7s %7d" % (
            r["engine"], r["mode"], r["conc"], r["tok_s"],
            "%.2fx" % (r["tok_s"] / b) if b else "-",
            "%.2f" % r["accept"] if r["accept"] is not None else "-", r["errors"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
