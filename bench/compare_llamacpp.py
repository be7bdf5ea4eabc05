#!/usr/bin/env python3
"""compare_llamacpp: moeserve and llama.cpp side by side on the CPU, on the same weights, in one run.

What it does:
  1. makes a random model with build/make_synthetic_model (bf16 safetensors) in WORK/hf:
     --arch mixtral (default; the Llama-2 tokenizer from tests/fixtures, vocab 32000) or
     qwen3_5_moe (Qwen3.5-35B-A3B's hybrid layout at ~1B, llama.cpp's qwen35moe; Qwen3's
     tokenizer from ../shared/data, vocab 151936);
  2. converts it with llama.cpp's own convert_hf_to_gguf.py to F32 and BF16 GGUF (--no-mtp for
     qwen3_5_moe) and quantizes the F32 file with llama-quantize --pure (every tensor the named
     type) to Q8_0, Q4_0, Q4_1;
  3. llama.cpp: llama-bench prefill of each --prompt-lens (-n 0), then decode of --decode tokens
     at each of --depths (-p 0 -d ...);
  4. moeserve: build/bench_engine --prompt-len P --decode N for each prompt length and depth,
     with --dtype float32|bfloat16 or --quantization int8|int4 for the type and --threads
     THREADS (prefill of P, decode at depth 0 and at depth P, and attention's share of
     that decode: bench_engine's profiled pass);
  5. bench/bench_server.py at concurrency 1,8,32 (128 tokens per request) against llama-server
     (started here: -t/-tb THREADS, -np 32 slots, continuous batching) and against moeserve serve
     (bench_server.py --binary, same --dtype/--quantization/--threads flags);
  6. with --ttft-prompts: time to first token at concurrency 1 for prompts of about that many
     tokens (bench_server.py --prompt-words), each twice: the same prompt every request (both
     servers reuse the cached prompt: one token is computed) and a distinct one each request
     (--unique-prompts: the whole prompt is);
  7. prints one table, type x metric: llama.cpp, moeserve, and moeserve/llama.cpp.
With --kv (pairs of moeserve --kv-cache-dtype and llama.cpp -ctk/-ctv types, e.g.
auto:f16,fp8_e4m3:q8_0,int8:q8_0) every measurement runs once per pair, llama.cpp with
flash attention on (-fa on), and the table's rows are weight type x KV pair. Prefill runs in
steps of --ubatch tokens on both sides (llama-bench -ub, bench_engine --max-batch-tokens).
Each measurement runs --repeat times (default 2) and the best is kept: the machine may be shared.
Before the numbers, a check that the two engines run the same model: moeserve generate and
llama-server (F32, temperature 0) must continue a prompt with the same 16 tokens' text.

llama.cpp is not part of moeserve: build it yourself (CPU, Release, native), e.g.
  cmake -B build -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j --target llama-bench llama-batched-bench llama-server llama-quantize
and give its converter a Python with torch, transformers, numpy, safetensors and sentencepiece
(--convert-python; the Llama-2 tokenizer is converted from tokenizer.json, which needs
transformers).

usage:
  python3 bench/compare_llamacpp.py --llama-cpp ~/llama.cpp [--size 100M|1B] [--threads 2]
      [--arch mixtral|qwen3_5_moe] [--prompt-lens 256,4096] [--depths 0,4096,16384]
      [--repeat 2] [--types F32,BF16,Q8_0,Q4_0,Q4_1] [--work DIR] [--build build]
      [--convert-python PY] [--skip-server] [--skip-micro] [--json OUT.json] [--markdown OUT.md]
      [--kv auto:f16,fp8_e4m3:q8_0,int8:q8_0] [--ubatch 512] [--ttft-prompts 9,256,2048]
  python3 bench/compare_llamacpp.py --from-json RUN1.json RUN2.json   # best of several runs
"""
import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPES = ["F32", "BF16", "Q8_0", "Q4_0", "Q4_1"]
# moeserve's flags for the weights of each GGUF type (bench_engine, serve and generate share them)
MOESERVE_FLAGS = {"F32": ["--dtype", "float32"], "BF16": ["--dtype", "bfloat16"],
                  "Q8_0": ["--quantization", "int8"], "Q4_0": ["--quantization", "int4"],
                  "Q4_1": ["--quantization", "int4"]}
CHECK_PROMPT = "The history of the world, in brief:"
COMMANDS = []  # every command run, for the report


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, timeout=3600, check=True, env=None, quiet=False):
    """Runs cmd (a list), returns (exit status, stdout + stderr)."""
    line = " ".join(shlex.quote(c) for c in cmd)
    COMMANDS.append(line)
    if not quiet:
        log("$ " + line)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        if check:
            sys.exit("timed out after %ds: %s" % (timeout, line))
        return 124, "timed out after %ds" % timeout
    if check and p.returncode != 0:
        sys.exit("failed (%d): %s\n%s" % (p.returncode, line, p.stdout[-3000:]))
    return p.returncode, p.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port, path, body=None, timeout=5):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------------------------
# the model, once for both engines


def make_model(args):
    """WORK/hf: the synthetic model with the tokenizer; remade only when its recipe changes."""
    hf = os.path.join(args.work, "hf")
    tok = os.path.join(args.work, "tokenizer")
    os.makedirs(tok, exist_ok=True)
    src = args.tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        plain, gz = os.path.join(src, name), os.path.join(src, name + ".gz")
        if os.path.exists(plain):
            shutil.copyfile(plain, os.path.join(tok, name))
        elif os.path.exists(gz):
            with gzip.open(gz, "rb") as f, open(os.path.join(tok, name), "wb") as g:
                shutil.copyfileobj(f, g)
        elif name == "tokenizer.json":
            sys.exit("no tokenizer.json(.gz) in %s" % src)
    recipe = [os.path.join(args.build, "make_synthetic_model"), hf, "--params", args.size,
              "--dtype", "bf16", "--tokenizer", tok, "--arch", args.arch, "--vocab",
              str(args.vocab)]
    # positions for the deepest decode, the longest prompt and the TTFT prompts
    need = max(args.depths + args.prompt_lens + [0]) + 2 * args.decode + 64
    need = max(need, max(args.ttft_prompts or [0]) * 2 + 256)
    if need > (32768 if args.arch == "qwen3_5_moe" else 4096):
        recipe += ["--max-pos", str(1 << (need - 1).bit_length())]
    stamp = os.path.join(hf, "made_with.json")
    try:
        with open(stamp) as f:
            if json.load(f) == recipe[2:] and os.path.exists(os.path.join(hf, "model.safetensors")):
                log("model: %s (already made)" % hf)
                return hf
    except (OSError, ValueError):
        pass
    shutil.rmtree(hf, ignore_errors=True)
    code, out = run(recipe, check=False)
    if code != 0 and "--tokenizer" in out:
        sys.exit("%s has no --tokenizer option: rebuild it (cmake --build %s)\n%s"
                 % (recipe[0], args.build, out))
    if code != 0:
        sys.exit(out)
    log(out.strip())
    with open(stamp, "w") as f:
        json.dump(recipe[2:], f)
    return hf


def make_ggufs(args, hf):
    """{type: path}: F32 and BF16 by llama.cpp's converter, the rest by llama-quantize --pure."""
    out = os.path.join(args.work, "gguf")
    os.makedirs(out, exist_ok=True)
    src_time = os.path.getmtime(os.path.join(hf, "model.safetensors"))
    paths = {}

    def fresh(p):
        return os.path.exists(p) and os.path.getmtime(p) >= src_time

    converter = os.path.join(args.llama_cpp, "convert_hf_to_gguf.py")
    quantize = os.path.join(args.llama_bin, "llama-quantize")
    for t in ["F32"] + [t for t in args.types if t != "F32"]:
        p = os.path.join(out, "model-%s.gguf" % t)
        paths[t] = p
        if fresh(p):
            continue
        if t in ("F32", "BF16"):
            # a Qwen3.5 converter asserts MTP layers unless told the checkpoint has none
            nomtp = ["--no-mtp"] if args.arch == "qwen3_5_moe" else []
            code, text = run([args.convert_python, converter, hf, "--outtype", t.lower(),
                              "--outfile", p] + nomtp, check=False)
            if code != 0:
                sys.exit("llama.cpp's converter failed; it needs torch, transformers, numpy, "
                         "safetensors and sentencepiece in %s (--convert-python):\n%s"
                         % (args.convert_python, text[-3000:]))
        else:
            run([quantize, "--pure", paths["F32"], p, t, str(args.threads)])
    return {t: paths[t] for t in args.types}


# ---------------------------------------------------------------------------------------------
# single-stream benchmarks


def llama_kv_flags(kv):
    """llama.cpp's cache flags for a --kv pair (flash attention on, as quantized caches need)."""
    if kv is None:
        return []
    return ["-ctk", kv[1], "-ctv", kv[1], "-fa", "on"]


def llama_micro(args, gguf, kv=None):
    """{'ppP': prefill t/s of P tokens, 'tgD': decode t/s at depth D}: best samples. llama-bench
    runs each test repeat + 1 times: its first sample may pay for page faults that bench_engine's
    warm-up step keeps out of moeserve's numbers. Prefill and decode are separate runs, so that
    no prefill is measured at a depth."""
    bench = os.path.join(args.llama_bin, "llama-bench")
    base = [bench, "-m", gguf, "-t", str(args.threads), "-r", str(args.repeat + 1), "-o", "json",
            "-ub", str(args.ubatch)] + llama_kv_flags(kv)
    res = {}
    for extra in (["-p", ",".join(map(str, args.prompt_lens)), "-n", "0"],
                  ["-p", "0", "-n", str(args.decode), "-d", ",".join(map(str, args.depths))]):
        _, out = run(base + extra, timeout=args.micro_timeout)
        for r in json.loads(out[out.index("["):]):
            best = max(r.get("samples_ts") or [r["avg_ts"]])
            if r["n_prompt"] > 0 and r["n_gen"] == 0:
                res["pp%d" % r["n_prompt"]] = best
            elif r["n_gen"] > 0 and r["n_prompt"] == 0:
                res["tg%d" % r.get("n_depth", 0)] = best
    return res


def moeserve_kv_flags(kv):
    return [] if kv is None else ["--kv-cache-dtype", kv[0]]


def moeserve_micro(args, hf, flags):
    """The same numbers from bench_engine (one run per prompt length and depth: prefill of P
    tokens, decode at depth 0 and at depth P), or {'error': text}."""
    bench = os.path.join(args.build, "bench_engine")
    flags = flags + args.ms_engine_threads
    res = {}
    for p in sorted(set(args.prompt_lens) | {d for d in args.depths if d > 0}):
        # one row per weight type: name, weights MB, load s, prefill, decode at depth 0 and at
        # depth --prompt-len (tok/s, each the best of --repeat runs), then roofline figures
        code, out = run([bench, hf, "--prompt-len", str(p), "--decode", str(args.decode),
                         "--repeat", str(args.repeat), "--max-batch-tokens", str(args.ubatch)]
                        + flags, check=False,
                        timeout=args.micro_timeout)
        if code != 0:
            return {"error": out.strip().splitlines()[-1] if out.strip() else "exit %d" % code}
        for line in out.splitlines():
            f = line.split()
            try:
                nums = [float(x.rstrip("%")) for x in f[1:6]]
            except ValueError:
                continue
            if len(nums) == 5:
                if p in args.prompt_lens:
                    res["pp%d" % p] = nums[2]
                res["tg0"] = max(res.get("tg0", 0.0), nums[3])
                if p in args.depths:
                    res["tg%d" % p] = nums[4]
                    try:  # attention's share of that decode (bench_engine's last column)
                        res["attn%d" % p] = float(f[10].rstrip("%"))
                    except (IndexError, ValueError):
                        pass
                break
        else:
            return {"error": "no result row in bench_engine's output"}
    return res


# ---------------------------------------------------------------------------------------------
# server benchmarks


def bench_server(args, extra, tag):
    """Runs bench/bench_server.py --repeat times; per level the best tok/s and the best TTFT p50."""
    best = {}
    for i in range(args.repeat):
        out_json = os.path.join(args.work, "logs", "server-%s-%d.json" % (tag, i))
        cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_server.py"), "--concurrency",
               args.concurrency, "--max-tokens", str(args.max_tokens), "--json", out_json]
        if args.requests_per_client:
            cmd += ["--requests-per-client", str(args.requests_per_client)]
        code, out = run(cmd + extra, check=False, timeout=args.server_timeout)
        log(out.rstrip())
        if code != 0 or not os.path.exists(out_json):
            return {"error": (out.strip().splitlines() or ["exit %d" % code])[-1]}
        with open(out_json) as f:
            levels = json.load(f)["levels"]
        os.remove(out_json)
        for lv in levels:
            b = best.setdefault(lv["conc"], {"tok_s": 0.0, "ttft_p50": float("inf"),
                                             "tok_per_req": lv["tok_per_req"], "errors": 0,
                                             "by_chunks": 0})
            b["tok_s"] = max(b["tok_s"], lv["tok_s"])
            b["ttft_p50"] = min(b["ttft_p50"], lv["ttft_p50"])
            b["errors"] += lv["errors"]
            b["by_chunks"] += lv["counted_by_chunks"]
            b["tok_per_req"] = min(b["tok_per_req"], lv["tok_per_req"])
    return best


def ttft_runs(args, extra, tag):
    """{'ttft_repN': ms, 'ttft_uniN': ms}: bench_server.py at concurrency 1 for each
    --ttft-prompts length, the same prompt each request and a unique one (best of --repeat)."""
    res = {}
    for n in args.ttft_prompts or []:
        for uniq in (False, True):
            key = ("ttft_uni%d" if uniq else "ttft_rep%d") % n
            for i in range(args.repeat):
                out_json = os.path.join(args.work, "logs", "ttft-%s-%s-%d.json" % (tag, key, i))
                cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_server.py"),
                       "--concurrency", "1", "--requests", str(args.ttft_requests),
                       "--max-tokens", "8", "--prompt-words", str(n), "--json", out_json]
                if uniq:
                    cmd.append("--unique-prompts")
                code, out = run(cmd + extra, check=False, timeout=args.server_timeout)
                if code != 0 or not os.path.exists(out_json):
                    res.setdefault("error", "ttft %s: %s" % (key, (out.strip().splitlines() or
                                                                    ["exit %d" % code])[-1]))
                    continue
                with open(out_json) as f:
                    lv = json.load(f)["levels"][0]
                os.remove(out_json)
                v = lv["ttft_p50"] * 1e3
                res[key] = min(res.get(key, v), v)
    return res


class LlamaServer:
    """llama-server on a free loopback port with as many slots as the top concurrency."""

    def __init__(self, args, gguf, tag, kv=None):
        self.port = free_port()
        slots = max(int(c) for c in args.concurrency.split(","))
        longest = max(args.ttft_prompts or [0]) + 64
        ctx = slots * (max(args.max_tokens + 256, longest))  # each slot gets ctx / slots
        cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", gguf, "--host", "127.0.0.1",
               "--port", str(self.port), "-t", str(args.threads), "-tb", str(args.threads),
               "-np", str(slots), "-c", str(ctx), "--cont-batching"] + llama_kv_flags(kv)
        COMMANDS.append(" ".join(shlex.quote(c) for c in cmd))
        log("$ " + COMMANDS[-1])
        self.log = open(os.path.join(args.work, "logs", "llama-server-%s.log" % tag), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                if http_json(self.port, "/health").get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit("llama-server did not become healthy; see %s" % self.log.name)
            time.sleep(0.2)

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def same_model_check(args, hf, server):
    """Greedy continuation of CHECK_PROMPT by moeserve generate and by llama-server (F32)."""
    n = 16
    flags = MOESERVE_FLAGS["F32"] if args.ms_generate_flags["--dtype"] else []
    cmd = [os.path.join(args.build, "moeserve"), "generate", "--model", hf, "--prompt",
           CHECK_PROMPT, "-n", str(n)] + flags + args.ms_generate_threads
    COMMANDS.append(" ".join(shlex.quote(c) for c in cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       errors="replace", timeout=300)  # the text on stdout, timings on stderr
    if p.returncode != 0:
        return "moeserve generate failed: " + p.stderr.strip()[-200:]
    ours = p.stdout.strip()
    theirs = http_json(server.port, "/v1/completions",
                       {"prompt": CHECK_PROMPT, "max_tokens": n, "temperature": 0},
                       timeout=120)["choices"][0]["text"].strip()
    if ours == theirs:
        return "same greedy continuation (%d tokens): %r" % (n, ours)
    return "DIFFERENT greedy continuations: moeserve %r, llama.cpp %r" % (ours, theirs)


# ---------------------------------------------------------------------------------------------
# the table

def micro_metrics(args):
    return ([("pp%d" % p, "prefill pp%d, tok/s" % p, True) for p in args.prompt_lens] +
            [("tg%d" % d, "decode tg%d @ depth %d, tok/s" % (args.decode, d), True)
             for d in args.depths] +
            [("attn%d" % d, "attention's share of moeserve's decode @ depth %d, %%" % d, False)
             for d in args.depths if d > 0])


def ttft_metrics(args):
    m = []
    for n in getattr(args, "ttft_prompts", None) or []:
        m.append(("ttft_rep%d" % n, "TTFT p50 c=1, %d-word prompt repeated, ms (lower is better)"
                  % n, False))
        m.append(("ttft_uni%d" % n, "TTFT p50 c=1, %d-word prompt unique, ms (lower is better)"
                  % n, False))
    return m


def server_metrics(args):
    m = []
    for c in [int(c) for c in args.concurrency.split(",")]:
        m.append(("srv%d" % c, "server c=%d, gen tok/s" % c, True))
    for c in [int(c) for c in args.concurrency.split(",")]:
        m.append(("ttft%d" % c, "server c=%d, TTFT p50 ms (lower is better)" % c, False))
    return m


def flatten_server(best):
    if "error" in best:
        return best
    res = {}
    for c, b in best.items():
        res["srv%d" % c] = b["tok_s"]
        res["ttft%d" % c] = b["ttft_p50"] * 1e3
    return res


def fmt(v):
    if v is None:
        return "n/a"
    return "%.1f" % v if v < 1000 else "%.0f" % v


def table(args, results):
    metrics = ([] if args.skip_micro else micro_metrics(args)) + ([] if args.skip_server else
                                                                  server_metrics(args) +
                                                                  ttft_metrics(args))
    rows = ["| type | metric | llama.cpp | moeserve | moeserve / llama.cpp | moeserve ran as |",
            "|---|---|---:|---:|---:|---|"]
    for t in args.types:
        if t not in results:
            continue
        r = results[t]
        for i, (key, name, _) in enumerate(metrics):
            a, b = r["llama"].get(key), r["moeserve"].get(key)
            ratio = "%.2f" % (b / a) if a and b else "n/a"
            rows.append("| %s | %s | %s | %s | %s | %s |" % (t, name, fmt(a), fmt(b), ratio,
                                                             r["moeserve_mode"] if i == 0 else ""))
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------


def save_json(args, notes, results, types):
    """--json: the types measured so far (written after each, so a run cut short still counts
    for --from-json)."""
    if not args.json:
        return
    settings = {k: getattr(args, k) for k in ("size", "arch", "prompt_lens", "depths", "decode",
                                              "concurrency", "max_tokens", "skip_micro",
                                              "skip_server", "ttft_prompts", "ubatch")}
    settings["types"] = types
    with open(args.json + ".tmp", "w") as f:
        json.dump({"settings": settings, "notes": notes,
                   "results": {t: results[t] for t in types}, "commands": COMMANDS}, f, indent=1,
                  default=str)
    os.replace(args.json + ".tmp", args.json)


def merge_runs(args):
    """Prints the table of the best value of each cell over several runs' --json files (the
    same model and settings): on a shared machine one run's repeats can all fall in a busy
    spell."""
    runs = []
    for path in args.from_json:
        with open(path) as f:
            runs.append(json.load(f))
    for k, v in runs[0].get("settings", {}).items():
        setattr(args, k, v)
    lower_better = {key for key, _, higher in server_metrics(args) + ttft_metrics(args)
                    if not higher}
    merged = {}
    for run_ in runs:
        for t, r in run_["results"].items():
            m = merged.setdefault(t, {"llama": {}, "moeserve": {}, "moeserve_mode":
                                      r["moeserve_mode"]})
            for side in ("llama", "moeserve"):
                for key, v in r[side].items():
                    old = m[side].get(key)
                    pick = min if key in lower_better else max
                    m[side][key] = v if old is None else pick(old, v)
    if isinstance(args.types, str):
        args.types = args.types.split(",")
    args.types = [t for t in args.types if t in merged]
    print("best of %d runs (%s)" % (len(runs), ", ".join(args.from_json)))
    for i, run_ in enumerate(runs):
        for n in run_["notes"]:
            print("- run %d: %s" % (i + 1, n))
    print()
    print(table(args, merged))


def detect(args):
    """What the llama.cpp and moeserve builds at hand can do."""
    for tool in ("llama-bench", "llama-server", "llama-quantize", "llama-batched-bench"):
        if not os.access(os.path.join(args.llama_bin, tool), os.X_OK):
            sys.exit("%s not found in %s: build llama.cpp first (see --help)" % (tool,
                                                                                  args.llama_bin))
    for tool in ("make_synthetic_model", "bench_engine", "moeserve"):
        if not os.access(os.path.join(args.build, tool), os.X_OK):
            sys.exit("%s not found in %s: cmake --build %s" % (tool, args.build, args.build))
    _, h = run([os.path.join(args.llama_bin, "llama-bench"), "--help"], check=False, quiet=True)
    if "--n-depth" not in h:
        sys.exit("this llama-bench has no -d (--n-depth): use a llama.cpp from 2025 or later")
    _, h = run([os.path.join(args.build, "bench_engine"), "--help"], check=False, quiet=True)
    args.ms_engine_flags = {f: f in h for f in ("--dtype", "--quantization")}
    if "--types" not in h:
        sys.exit("this bench_engine prints no result rows (no --types): rebuild moeserve")
    args.ms_engine_threads = ["--threads", str(args.threads)] if "--threads" in h else []
    _, h = run([os.path.join(args.build, "moeserve"), "serve", "--help"], check=False, quiet=True)
    args.ms_serve_flags = {f: f in h for f in ("--dtype", "--quantization")}
    args.ms_serve_threads = ["--threads", str(args.threads)] if "--threads" in h else []
    _, h = run([os.path.join(args.build, "moeserve"), "generate", "--help"], check=False,
               quiet=True)
    args.ms_generate_flags = {f: f in h for f in ("--dtype", "--quantization")}
    args.ms_generate_threads = ["--threads", str(args.threads)] if "--threads" in h else []
    code, out = run(["git", "-C", args.llama_cpp, "rev-parse", "HEAD"], check=False, quiet=True)
    args.llama_commit = args.llama_cpp_commit or (out.strip() if code == 0 else "unknown")
    code, out = run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=False, quiet=True)
    args.moeserve_commit = out.strip() if code == 0 else "unknown"
    code, out = run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                    check=False, quiet=True)
    if code == 0 and out.strip():
        args.moeserve_commit += " + uncommitted changes"


def moeserve_flags(args, t, have):
    """(flags, label) for type t, or (None, why) when this moeserve cannot run it."""
    flags = MOESERVE_FLAGS[t]
    if have[flags[0]]:
        return flags, " ".join(flags)
    if t in ("F32", "BF16"):
        return [], "default (no %s flag: bf16 weights expanded to f32)" % flags[0]
    return None, "n/a (no %s flag yet)" % flags[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--llama-cpp", help="a built llama.cpp source tree (required)")
    ap.add_argument("--llama-bin", help="its binaries (default: LLAMA_CPP/build/bin)")
    ap.add_argument("--llama-cpp-commit", help="label for its commit when it is no git checkout")
    ap.add_argument("--size", default="100M", help="model size for make_synthetic_model (100M, 1B)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="moeserve's build dir")
    ap.add_argument("--work", help="models, GGUF files, logs (default: /tmp/moeserve-vs-llamacpp-"
                    "SIZE)")
    ap.add_argument("--tokenizer", help="folder with tokenizer.json(.gz) and "
                    "tokenizer_config.json(.gz) (default: tests/fixtures/tokenizers/llama2; "
                    "qwen3_5_moe: ../shared/data/tokenizers/qwen3)")
    ap.add_argument("--convert-python", default=os.environ.get("LLAMA_CPP_PYTHON", "python3"),
                    help="Python for convert_hf_to_gguf.py (env LLAMA_CPP_PYTHON)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each measurement; best kept")
    ap.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen3_5_moe"],
                    help="make_synthetic_model --arch (qwen3_5_moe: Qwen3.5-35B-A3B's layout, "
                    "llama.cpp's qwen35moe)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default 32000; 151936, Qwen's, for "
                    "qwen3_5_moe, whose llama.cpp converter wants a Qwen tokenizer)")
    ap.add_argument("--prompt-lens", default="256", help="prefill lengths, e.g. 256,4096")
    ap.add_argument("--depths", help="decode depths, e.g. 0,4096,16384 (default 0 and the first "
                    "prompt length)")
    ap.add_argument("--micro-timeout", type=int, default=3600)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per server request")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="server requests per level: max(8, this x concurrency); 0: "
                    "bench_server.py's default")
    ap.add_argument("--server-timeout", type=int, default=1800)
    ap.add_argument("--kv", help="KV cache pairs MOESERVE:LLAMA, e.g. auto:f16,fp8_e4m3:q8_0,"
                    "int8:q8_0 (moeserve --kv-cache-dtype, llama.cpp -ctk/-ctv with -fa on); "
                    "default: each engine's default cache")
    ap.add_argument("--ubatch", type=int, default=512,
                    help="prefill step in tokens (llama-bench -ub, bench_engine "
                    "--max-batch-tokens)")
    ap.add_argument("--ttft-prompts", help="prompt lengths in words for the TTFT runs, e.g. "
                    "9,256,2048")
    ap.add_argument("--ttft-requests", type=int, default=8, help="requests per TTFT run")
    ap.add_argument("--skip-micro", action="store_true", help="no llama-bench / bench_engine")
    ap.add_argument("--skip-server", action="store_true", help="no server benchmarks")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--markdown", help="write the table and the commands here")
    ap.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="measure nothing: the best of earlier runs' --json files, as one table")
    args = ap.parse_args()
    if args.from_json:
        return merge_runs(args)
    if not args.llama_cpp:
        ap.error("--llama-cpp DIR is required")
    args.llama_cpp = os.path.abspath(args.llama_cpp)
    args.llama_bin = args.llama_bin or os.path.join(args.llama_cpp, "build", "bin")
    args.build = os.path.abspath(args.build)
    args.work = os.path.abspath(args.work or "/tmp/moeserve-vs-llamacpp-%s-%s" % (args.arch,
                                                                                  args.size))
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    args.ttft_prompts = ([int(x) for x in args.ttft_prompts.split(",")] if args.ttft_prompts
                         else [])
    args.kv_pairs = ([tuple(p.split(":", 1)) for p in args.kv.split(",")] if args.kv else [None])
    for kv in args.kv_pairs:
        if kv is not None and len(kv) != 2:
            sys.exit("--kv takes MOESERVE:LLAMA pairs, e.g. auto:f16")
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.depths = ([int(x) for x in args.depths.split(",")] if args.depths
                   else [0, args.prompt_lens[0]])
    qwen = args.arch == "qwen3_5_moe"
    args.vocab = args.vocab or (151936 if qwen else 32000)
    args.tokenizer = args.tokenizer or (
        os.path.join(ROOT, "..", "shared", "data", "tokenizers", "qwen3") if qwen
        else os.path.join(ROOT, "tests", "fixtures", "tokenizers", "llama2"))
    for t in args.types:
        if t not in TYPES:
            sys.exit("unknown type %s (one of %s)" % (t, ",".join(TYPES)))
    os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)

    detect(args)
    ncpu = os.cpu_count()
    ms_threads = ("--threads %d" % args.threads if args.ms_engine_threads and args.ms_serve_threads
                  else "all %d online cores (no --threads flag)" % ncpu)
    notes = ["llama.cpp %s (%s); moeserve %s; threads: llama.cpp %d, moeserve %s; %d cores; best "
             "of %d runs; load average at start %s"
             % (args.llama_commit, args.llama_bin, args.moeserve_commit, args.threads, ms_threads,
                ncpu, args.repeat, " ".join("%.2f" % x for x in os.getloadavg()))]
    if args.threads != ncpu and not (args.ms_engine_threads and args.ms_serve_threads):
        notes.append("WARNING: --threads %d but moeserve uses all %d cores" % (args.threads, ncpu))
    for f, ok in args.ms_engine_flags.items():
        if not ok:
            notes.append("moeserve's bench_engine has no %s flag yet" % f)
    for f, ok in args.ms_serve_flags.items():
        if not ok:
            notes.append("`moeserve serve` has no %s flag yet" % f)
    for n in notes:
        log(n)

    hf = make_model(args)
    ggufs = make_ggufs(args, hf)
    # rows: weight type x KV pair ("BF16" alone without --kv)
    combos = [(t, kv) for t in args.types for kv in args.kv_pairs]
    labels = [t if kv is None else "%s, KV %s / %s" % (t, kv[0], kv[1]) for t, kv in combos]
    args.types = labels  # what table(), save_json() and --from-json go by
    results = {lb: {"llama": {}, "moeserve": {}, "moeserve_mode": ""} for lb in labels}
    done_micro, done_server = {}, {}  # moeserve runs by flags: types that map alike run once
    done_llama = {}

    if not args.skip_server:  # make_ggufs always makes the F32 file, the others' source
        srv = LlamaServer(args, os.path.join(args.work, "gguf", "model-F32.gguf"), "check")
        try:
            notes.append("same-model check: " + same_model_check(args, hf, srv))
        finally:
            srv.close()
        log(notes[-1])

    for (t, kv), lb in zip(combos, labels):
        r = results[lb]
        eflags, elabel = moeserve_flags(args, t, args.ms_engine_flags)
        sflags, slabel = moeserve_flags(args, t, args.ms_serve_flags)
        if eflags is not None:
            eflags = eflags + moeserve_kv_flags(kv)
        if sflags is not None:
            sflags = sflags + moeserve_kv_flags(kv)
        elabel = " ".join(eflags) if eflags is not None else elabel
        slabel = " ".join(sflags) if sflags is not None else slabel
        r["moeserve_mode"] = elabel if elabel == slabel else "engine: %s; serve: %s" % (elabel,
                                                                                       slabel)
        tag = lb.replace(" ", "").replace(",", "-").replace("/", "-")
        if not args.skip_micro:
            lkey = (t, None if kv is None else kv[1])  # llama.cpp runs alike for pairs that
            if lkey not in done_llama:                  # share its cache type run once
                done_llama[lkey] = llama_micro(args, ggufs[t], kv)
            r["llama"].update(done_llama[lkey])
            if eflags is not None:
                key = tuple(eflags)
                if key not in done_micro:
                    done_micro[key] = moeserve_micro(args, hf, eflags)
                r["moeserve"].update(done_micro[key])
        if not args.skip_server:
            srv = LlamaServer(args, ggufs[t], tag, kv)
            try:
                url = ["--url", "http://127.0.0.1:%d" % srv.port]
                r["llama_server"] = bench_server(args, url, "llama-" + tag)
                r["llama"].update(ttft_runs(args, url, "llama-" + tag))
            finally:
                srv.close()
            r["llama"].update(flatten_server(r["llama_server"]))
            if sflags is not None:
                key = tuple(sflags)
                if key not in done_server:
                    extra = ["--binary", os.path.join(args.build, "moeserve"), "--model", hf]
                    if sflags or args.ms_serve_threads:
                        extra += ["--server-args", " ".join(sflags + args.ms_serve_threads)]
                    done_server[key] = (bench_server(args, extra, "moeserve-" + tag),
                                        ttft_runs(args, extra, "moeserve-" + tag))
                r["moeserve_server"] = done_server[key][0]
                r["moeserve"].update(flatten_server(done_server[key][0]))
                r["moeserve"].update(done_server[key][1])
        for side in ("llama", "moeserve"):
            if "error" in r[side]:
                notes.append("%s %s: %s" % (side, lb, r[side].pop("error")))
        for side in ("llama_server", "moeserve_server"):
            for c, b in (r.get(side) or {}).items():
                if isinstance(b, dict) and (b["errors"] or b["by_chunks"]
                                            or b["tok_per_req"] != args.max_tokens):
                    notes.append("%s %s c=%s: %d errors, %d requests counted by chunks, %.1f "
                                 "tokens/request" % (side, lb, c, b["errors"], b["by_chunks"],
                                                     b["tok_per_req"]))
        save_json(args, notes, results, labels[:labels.index(lb) + 1])

    notes.append("load average at the end %s" % " ".join("%.2f" % x for x in os.getloadavg()))
    tab = table(args, results)
    print()
    print("moeserve vs llama.cpp, %s synthetic %s (%s), decode %d tokens, server max_tokens %d"
          % (args.size, args.arch, hf, args.decode, args.max_tokens))
    for n in notes:
        print("- " + n)
    print()
    print(tab)
    save_json(args, notes, results, args.types)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join("- " + n for n in notes) + "\n\n" + tab + "\n\n## Commands\n\n```\n"
                    + "\n".join(COMMANDS) + "\n```\n")


if __name__ == "__main__":
    main()
