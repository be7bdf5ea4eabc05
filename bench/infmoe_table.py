#!/usr/bin/env python3
"""The continuous-experts table in one command: for an infmoe model at K = 1, 2, 4, 8 (those
within its max_samples) and, when its config has a calibration, the adaptive budget at its
default K and at twice it, next to any other models given (mohge-small, a homogeneous MoE):
held-out loss per domain (nats, from build/mohge_eval: the C engine, tokens fed one per step), FFN neurons computed
per token and layer (infmoe: counted by the engine; a discrete MoE: the shared experts' width plus
k times the mean width of the experts its tokens were routed to), and decode tokens/s (`moeserve generate --threads T
--ignore-eos`, best of --repeat runs). Prints one markdown table.

  python3 bench/infmoe_table.py --infmoe models/infmoe-small \\
      --other mohge=models/mohge-small --other homogeneous=/tmp/mohge_run/homogeneous-small \\
      --data tools/train/data --max-tokens 2048

Decode speed depends on the machine and its load: run it on a quiet one and say which.
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("shakespeare", "arithmetic", "json")


def run_eval(args, model, extra):
    cmd = [os.path.join(args.build, "mohge_eval"), "--model", model, "--max-tokens",
           str(args.max_tokens)] + extra
    cmd += ["%s=%s" % (d, os.path.join(args.data, d + ".heldout.txt")) for d in DOMAINS]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    loss = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in DOMAINS and cells[1].isdigit():
            loss.setdefault(cells[0], float(cells[2]))  # the per-domain table comes first
    m = re.search(r"([0-9.]+) of (\d+) FFN neurons computed", out)
    if m:
        return loss, float(m.group(1))
    return loss, moe_active_width(model, out)


def moe_active_width(model, out):
    """A discrete MoE's FFN neurons per token and layer: the shared experts' width plus k
    times the mean width of the experts tokens were routed to (group widths from the report's
    header, each domain's group shares weighted by its tokens)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    m = re.search(r"groups, widths ([0-9 ]+);", out)
    if not m:
        return None
    widths = [int(w) for w in m.group(1).split()]
    total, tokens = 0.0, 0
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 + len(widths) and cells[0] in DOMAINS and cells[1].isdigit():
            shares = [float(c.rstrip("%")) / 100 for c in cells[4:]]
            n = int(cells[1])
            total += n * sum(s * w for s, w in zip(shares, widths))
            tokens += n
        if line.startswith("| tokens by loss"):
            break
    if not tokens:
        return None
    shared = cfg.get("num_shared_experts", 0) * cfg.get("shared_intermediate_size", 0)
    return shared + cfg.get("num_experts_per_tok", 1) * total / tokens


def run_decode(args, model, extra):
    best = 0.0
    for _ in range(args.repeat):
        cmd = [os.path.join(args.build, "moeserve"), "generate", "--model", model, "--prompt",
               "ROMEO:", "--max-tokens", str(args.decode_tokens), "--ignore-eos", "--threads",
               str(args.threads)] + extra
        err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"decode: \d+ tokens in [0-9.]+ s \(([0-9.]+) tokens/s\)", err)
        if m:
            best = max(best, float(m.group(1)))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--infmoe", required=True, help="an infmoe model folder")
    ap.add_argument("--other", action="append", default=[], help="NAME=DIR, another model")
    ap.add_argument("--data", default=os.path.join(ROOT, "tools", "train", "data"))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--max-tokens", type=int, default=2048, help="held-out tokens per domain")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    with open(os.path.join(args.infmoe, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "infmoe":
        sys.exit("--infmoe %s is not an infmoe model" % args.infmoe)
    rows = []
    budgets = [("K = %d" % k, ["--moe-samples", str(k)]) for k in (1, 2, 4, 8)
               if k <= cfg.get("max_samples", cfg["num_samples"])]
    if cfg.get("adaptive_logvar_quantiles"):
        # the trained K and twice it, each next to the fixed K of the same average
        for k in sorted({cfg["num_samples"], 2 * cfg["num_samples"]}):
            if k <= cfg.get("max_samples", cfg["num_samples"]):
                budgets.append(("adaptive, mean K = %d" % k,
                                ["--moe-samples", str(k), "--moe-samples-adaptive"]))
    name = os.path.basename(os.path.normpath(args.infmoe))
    for label, extra in budgets:
        loss, neurons = run_eval(args, args.infmoe, extra)
        rows.append((name, label, neurons, loss, run_decode(args, args.infmoe, extra)))
    for spec in args.other:
        oname, _, odir = spec.partition("=")
        loss, width = run_eval(args, odir, [])
        rows.append((oname, "default", width, loss, run_decode(args, odir, [])))

    print("| model | budget | FFN neurons / token / layer | " +
          " | ".join("%s loss" % d for d in DOMAINS) + " | decode tok/s |")
    print("|---|---|---|" + "---|" * len(DOMAINS) + "---|")
    for model, label, neurons, loss, tps in rows:
        print("| %s | %s | %s | %s | %s |" % (
            model, label, "%.1f" % neurons if neurons is not None else "",
            " | ".join("%.4f" % loss[d] if d in loss else "" for d in DOMAINS),
            "%.0f" % tps if tps else "?"))


if __name__ == "__main__":
    main()
