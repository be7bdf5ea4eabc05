#!/usr/bin/env python3
"""Multi-process expert parallelism bench: the same server run as 1 process and as
`mpirun -np N` (2 and 4 by default), bound to loopback, each process with --threads T. For each:
decode throughput (one client: generated tokens/s, i.e. the speed of single-sequence decode),
serving throughput at concurrency C (8 by default), and the bytes the ranks sent each other per
token of the steps they ran, from each rank's "traffic:" log line at exit: expert rows (MoE
dispatch and combine: the all-to-all, what a placement simulator's cost model needs) and
messages (step plans, the logits of the other ranks' sequences, status words, idle pings).

  python3 bench/bench_mpi.py --binary build/moeserve --model models/mohge-small [--via tcp]

On one machine more ranks than cores only add exchanges and context switches: the expected
result is a slowdown; the bytes per token are what a placement simulator's all-to-all cost
model needs.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_server  # noqa: E402  (run_level, get, free_port)

MPI_ARGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--mca", "btl",
            "self,tcp", "--mca", "btl_tcp_if_include", "lo"]


def start(args, np, port, log):
    """The server as np processes (mpirun, or --nnodes with the others started first); returns
    rank 0's process (mpirun's) and the others'."""
    cmd = [args.binary, "serve", "--model", args.model, "--port", str(port), "--host",
           "127.0.0.1", "--threads", str(args.threads), "--max-num-seqs", "64"]
    others = []
    if np > 1 and args.via == "mpi":
        cmd = [shutil.which("mpirun")] + MPI_ARGS + ["-np", str(np)] + cmd
    elif np > 1:
        rdv = ["--nnodes", str(np), "--master-port", str(bench_server.free_port())]
        for r in range(1, np):
            others.append(subprocess.Popen(cmd[:4] + ["--port", "0"] + cmd[6:] + rdv +
                                           ["--node-rank", str(r)], stdout=log,
                                           stderr=subprocess.STDOUT))
        cmd += rdv + ["--node-rank", "0"]
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            if bench_server.get("127.0.0.1", port, "/health")[0] == 200:
                break
        except OSError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            sys.exit("server did not start:\n" + log.read().decode())
        time.sleep(0.05)
    p.others = others
    return p


def stop(p, np, log):
    log.seek(0)
    text = log.read().decode()
    m = re.search(r"\[rank 0\] rank 0 of \d+, pid (\d+)", text)
    os.kill(int(m.group(1)) if (np > 1 and m) else p.pid, signal.SIGTERM)
    p.wait(120)
    for o in p.others:
        o.wait(120)
    log.seek(0)
    return log.read().decode()


def rows_bytes_per_token(model):
    """Bytes one token's dispatch + combine move when every chosen expert is on another
    device: 2 * top_k * d_model * 4 per MoE layer (f32 rows), plus the int32 expert id."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    k = c.get("num_experts_per_tok") or c.get("moe_top_k") or 2
    d = c["hidden_size"]
    layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    return layers * k * (2 * d * 4 + 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="build/moeserve")
    ap.add_argument("--model", default="models/mohge-small")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--via", choices=("mpi", "tcp"), default="mpi",
                    help="start the ranks with mpirun (MPI communicator) or with --nnodes (TCP)")
    ap.add_argument("--threads", type=int, default=1, help="--threads of each process")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-requests", type=int, default=4)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.via == "mpi" and shutil.which("mpirun") is None:
        sys.exit("mpirun not found (tools/setup.sh installs openmpi-bin)")
    body = json.dumps({"prompt": "The history of the world, in brief:",
                       "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    out = []
    print("model %s, ranks via %s, --threads %d per process, %d tokens per request; all-to-all "
          "rows if every expert were remote: %d bytes/token" % (
              args.model, args.via, args.threads, args.max_tokens,
              rows_bytes_per_token(args.model)))
    print("%5s %12s %14s %14s %12s %12s" % ("ranks", "decode tok/s", "serve tok/s",
                                              "serve TTFT p50", "rows B/tok", "msgs B/tok"))
    for np in [int(x) for x in args.ranks.split(",")]:
        port = bench_server.free_port()
        with tempfile.TemporaryFile() as log:
            p = start(args, np, port, log)
            try:
                dec = bench_server.run_level("127.0.0.1", port, 1, args.decode_requests, body,
                                             headers)
                srv = bench_server.run_level("127.0.0.1", port, args.concurrency,
                                             2 * args.concurrency, body, headers)
            finally:
                text = stop(p, np, log)
        sent = [(int(r), int(m), int(t)) for r, m, _, t in
                re.findall(r"traffic: sent (\d+) bytes of expert rows and (\d+) bytes of "
                           r"messages to other ranks over (\d+) steps of (\d+) tokens", text)]
        tokens = sent[0][2] if sent else 0
        rows = sum(s[0] for s in sent) / tokens if tokens else 0.0
        msgs = sum(s[1] for s in sent) / tokens if tokens else 0.0
        row = {"ranks": np, "decode_tok_s": dec["tok_s"], "serve_tok_s": srv["tok_s"],
               "serve_ttft_p50": srv["ttft_p50"], "row_bytes_per_token": rows,
               "msg_bytes_per_token": msgs, "errors": dec["errors"] + srv["errors"]}
        out.append(row)
        print("%5d %12.1f %14.1f %13.3fs %12.0f %12.0f%s" % (
            np, row["decode_tok_s"], row["serve_tok_s"], row["serve_ttft_p50"], rows, msgs,
            "  (%d errors)" % row["errors"] if row["errors"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
