#!/usr/bin/env python3
"""Server benchmark: generated tokens/s and time to first token (p50/p99) at several client
concurrencies (1, 8, 32 by default) with streaming /v1/completions requests (ignore_eos, a fixed
max_tokens, so every request generates the same number of tokens). Starts `moeserve serve`
itself (--binary, --model) on a free port, or measures a running server (--url). Clients are
threads speaking raw HTTP/1.1 (http.client), one connection per request, so the numbers include
connection setup as real clients pay it.

  python3 bench/bench_server.py --binary build/moeserve --model tests/fixtures/models/mixtral
  python3 bench/bench_server.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64

TTFT is measured from sending the request to the first SSE chunk carrying text; tokens/s is the
sum of generated tokens over the wall time of the whole level (all clients running). A request's
generated tokens are its usage.completion_tokens (moeserve, vLLM and llama-server send a usage
object with the last chunk); a server that sends none is counted by its chunks that carry text,
which is a lower bound when it merges tokens into one chunk (e.g. to finish a UTF-8 character):
the "tok/req" column and a note say which count was used, so engines are compared alike.
`--json FILE` also writes the levels' results as JSON.

The prompt is --prompt, or with --prompt-words N a text of N common English words (each one
token in Llama- and Qwen-style tokenizers, about N tokens in all). Every request sends the same
prompt unless --unique-prompts, which puts the request's number first, so that no request can
reuse another's cached prompt: llama-server reuses a slot's longest common prefix and moeserve
its cached blocks and their common prefix, so a repeated prompt measures one token of prefill
and a unique one the whole prompt.
"""
import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(host, port, path, timeout=5):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def one_request(host, port, body, headers):
    """Returns (ttft seconds, completion tokens, e2e seconds, True when the tokens are the
    server's usage.completion_tokens, False when they are the count of text chunks)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=600)
    try:
        c.request("POST", "/v1/completions", body=body, headers=headers)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError("HTTP %d: %r" % (r.status, r.read()[:200]))
        ttft, usage_tokens, text_chunks = None, None, 0
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            # parse only what is needed (the first text chunk, the usage chunk), and find text
            # without parsing (an empty text is `"text":""` in both servers' compact JSON): the
            # client shares the CPUs with the server
            has_text = b'"text":' in data and b'"text":""' not in data
            if ttft is None and has_text:
                chunk = json.loads(data)
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
            if has_text:
                text_chunks += 1
            if b'"usage"' in data:
                usage = json.loads(data).get("usage")
                if isinstance(usage, dict) and "completion_tokens" in usage:
                    usage_tokens = usage["completion_tokens"]
        e2e = time.perf_counter() - t0
        by_usage = usage_tokens is not None
        return ttft if ttft is not None else e2e, usage_tokens if by_usage else text_chunks, \
            e2e, by_usage
    finally:
        c.close()


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


WORDS = ("the of and to in is was for on with as by at from his her they have this that which "
         "their were been one all would there what about when more can said into time people "
         "world history year first made after other many some most could these two than "
         "like then only well over also back through where much long great little state").split()


def make_prompt(args):
    if args.prompt_words:
        return " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    return args.prompt


def run_level(host, port, conc, n_requests, body, headers, unique=False):
    results, errors, lock = [], [], threading.Lock()
    next_i = [0]

    def worker():
        while True:
            with lock:
                if next_i[0] >= n_requests:
                    return
                next_i[0] += 1
                i = next_i[0]
            try:
                b = body
                if unique:  # the request's number first: no prefix shared with another
                    d = json.loads(body)
                    d["prompt"] = "%d %s" % (int(time.time() * 1e6) + i, d["prompt"])
                    b = json.dumps(d)
                r = one_request(host, port, b, headers)
                with lock:
                    results.append(r)
            except Exception as e:  # counted and reported, the level goes on
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(conc)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    toks = sum(r[1] for r in results)
    return {"conc": conc, "requests": len(results), "errors": len(errors), "wall": wall,
            "tokens": toks, "tok_per_req": toks / len(results) if results else 0.0,
            "counted_by_chunks": sum(1 for r in results if not r[3]),
            "tok_s": toks / wall if wall > 0 else 0.0, "req_s": len(results) / wall,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "e2e_p50": percentile([r[2] for r in results], 50), "first_error":
            errors[0] if errors else ""}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="measure a running server instead of starting one")
    ap.add_argument("--binary", default="build/moeserve")
    ap.add_argument("--model", default="tests/fixtures/models/mixtral")
    ap.add_argument("--server-args", default="", help="extra `moeserve serve` flags")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: max(16, 4 x concurrency))")
    ap.add_argument("--requests-per-client", type=int, default=0,
                    help="instead of --requests: max(8, this x concurrency) per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="The history of the world, in brief:")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="instead of --prompt: N common words (about N tokens)")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="a distinct prompt per request (no prompt cache reuse)")
    ap.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY", ""))
    ap.add_argument("--json", help="also write the levels' results to this file as JSON")
    args = ap.parse_args()

    proc = None
    if args.url:
        u = urllib.parse.urlparse(args.url)
        host, port = u.hostname, u.port or 80
    else:
        host, port = "127.0.0.1", free_port()
        cmd = [args.binary, "serve", "--model", args.model, "--port", str(port),
               "--max-num-seqs", "64"] + args.server_args.split()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get(host, port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc and proc.poll() is not None:
                sys.exit("the server exited with %d: %s" % (proc.returncode, " ".join(cmd)))
            if time.monotonic() > deadline:
                sys.exit("the server is not healthy after 120s")
            time.sleep(0.05)
        models = json.loads(get(host, port, "/v1/models")[1]) if not args.api_key else None
        name = models["data"][0]["id"] if models else None
        prompt = make_prompt(args)
        body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens,
                           "ignore_eos": True, "stream": True, "temperature": 1, "seed": 1,
                           "stream_options": {"include_usage": True},
                           **({"model": name} if name else {})})
        headers = {"Content-Type": "application/json"}
        if args.api_key:
            headers["Authorization"] = "Bearer " + args.api_key
        one_request(host, port, body, headers)  # warm-up
        print("server %s:%d  model %s  max_tokens %d  prompt %r%s" % (
            host, port, name or "?", args.max_tokens,
            prompt if len(prompt) < 60 else prompt[:60] + "... (%d words)" % len(prompt.split()),
            ", unique per request" if args.unique_prompts else ""))
        print("%5s %8s %6s %10s %8s %11s %11s %10s %8s" % (
            "conc", "requests", "errors", "gen tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
            "e2e p50 s", "tok/req"))
        levels = []
        for conc in [int(c) for c in args.concurrency.split(",")]:
            n = args.requests or (max(8, args.requests_per_client * conc)
                                   if args.requests_per_client else max(16, 4 * conc))
            r = run_level(host, port, conc, n, body, headers, args.unique_prompts)
            levels.append(r)
            print("%5d %8d %6d %10.1f %8.2f %11.2f %11.2f %10.3f %8.1f" % (
                r["conc"], r["requests"], r["errors"], r["tok_s"], r["req_s"],
                r["ttft_p50"] * 1e3, r["ttft_p99"] * 1e3, r["e2e_p50"], r["tok_per_req"]),
                flush=True)
            if r["errors"]:
                print("      first error: %s" % r["first_error"])
            if r["counted_by_chunks"]:
                print("      %d request(s) had no usage object: counted by text chunks (a lower "
                      "bound)" % r["counted_by_chunks"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"server": "%s:%d" % (host, port), "model": name,
                           "max_tokens": args.max_tokens, "levels": levels}, f, indent=1)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
