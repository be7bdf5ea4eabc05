#!/usr/bin/env python3
"""Does a MoHGE model route easy tokens to narrow groups? For each model given: per held-out
domain, the tokens split into loss terciles and the mean FFN width each third was routed to
(`moeserve trace record` over the whole held-out split, `moeserve trace info --json`), how far
the easy third's width is below the hard third's, the held-out loss (`mohge_eval`, first 2048
tokens of each domain, as the README's tables), the mean routed width over all domains, and
the per-device FLOP imbalance under the `mohge` placement on 4 devices (`moeserve
placement-sim` over the three domains' trace). Prints one markdown table.

    python3 bench/difficulty_table.py today=models/mohge-small new=/tmp/mohge-difficulty

The issue's goals for a difficulty-steered model: easy >= 15% below hard on every domain,
loss within +0.02 nats of today's on each domain, mean width no higher, imbalance <= 1.05.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("shakespeare", "arithmetic", "json")


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def measure(model, build, data, tmp):
    moeserve = os.path.join(build, "moeserve")
    files = {d: os.path.join(data, d + ".heldout.txt") for d in DOMAINS}
    row = {"terciles": {}}
    for d in DOMAINS:
        tr = os.path.join(tmp, d + ".rtrace")
        run(moeserve, "trace", "record", "--model", model, "--out", tr, "--window", "192",
            "--max-tokens", "1000000", f"{d}={files[d]}")
        info = json.loads(run(moeserve, "trace", "info", tr, "--json"))
        row["terciles"][d] = [t["mean_width"] for t in info["difficulty"]]
    tr = os.path.join(tmp, "all.rtrace")
    run(moeserve, "trace", "record", "--model", model, "--out", tr, "--window", "192",
        "--max-tokens", "1000000", *[f"{d}={files[d]}" for d in DOMAINS])
    row["mean_width"] = json.loads(run(moeserve, "trace", "info", tr, "--json"))["mean_width"]
    sim = run(moeserve, "placement-sim", "--trace", tr, "--devices", "4")
    m = re.search(r"^\| 4 \| mohge \| \d+ \| ([0-9.]+) \|", sim, re.M)
    row["imbalance"] = float(m.group(1)) if m else float("nan")
    out = run(os.path.join(build, "mohge_eval"), "--model", model,
              *[f"{d}={files[d]}" for d in DOMAINS])
    row["loss"] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in DOMAINS and cells[1].isdigit():
            row["loss"].setdefault(cells[0], float(cells[2]))
    return row


def main():
    models = [a.split("=", 1) for a in sys.argv[1:] if "=" in a]
    if not models:
        sys.exit(__doc__)
    build = os.path.join(ROOT, "build")
    data = os.path.join(ROOT, "tools", "train", "data")
    rows = []
    for name, path in models:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((name, measure(path, build, data, tmp)))
    head = ["model"]
    for d in DOMAINS:
        head += [f"{d}: easy / medium / hard width", f"{d}: easy vs hard", f"{d}: loss"]
    head += ["mean width", "mohge imbalance, 4 devices"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows:
        cells = [name]
        for d in DOMAINS:
            e, m, h = r["terciles"][d]
            cells += [f"{e:.1f} / {m:.1f} / {h:.1f}", f"{100 * (e - h) / h:+.1f}%",
                      f"{r['loss'].get(d, float('nan')):.4f}"]
        cells += [f"{r['mean_width']:.1f}", f"{r['imbalance']:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
