#!/usr/bin/env python3
"""Does a MoHGE model route easy tokens to narrow groups? For each model given: per held-out
domain, the tokens split into loss terciles and the mean FFN width each third was routed to
(`moeserve trace record` over the whole held-out split, `moeserve trace info --json`), how far
the easy third's width is below the hard third's, the held-out loss (`mohge_eval`, first 2048
tokens of each domain, as the README's tables), the mean routed width over all domains, and
the per-device FLOP imbalance under the `mohge` placement on 4 devices (`moeserve
placement-sim` over the three domains' trace: the mean over steps of 256 tokens per device, and
over all steps summed). Prints one markdown table.

The per-step imbalance has a floor that no routing reaches below: a step's 256 tokens per device
are a sample. The last column estimates it for each model: the same steps (the trace's odd steps,
shuffled, 1024 tokens a step as placement-sim takes them) with every expert row moved to an expert
of its group drawn uniformly, so that the groups' inner balance is perfect and each group keeps
its share of the rows (mean of 8 draws; standard library only).

    python3 bench/difficulty_table.py today=models/mohge-small new=/tmp/mohge-difficulty

The issue's goals for a difficulty-steered model: easy >= 15% below hard on every domain,
loss within +0.02 nats of today's on each domain, mean width no higher, imbalance <= 1.05.
"""
import json
import os
import random
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("shakespeare", "arithmetic", "json")
sys.path.insert(0, os.path.join(ROOT, "tools"))
from routing_trace import RoutingTrace  # noqa: E402


def mohge_owner(n_expert, n_group, n_dev):
    """engine/placement/placement.c plc_mohge_owner: expert i of every group on one device."""
    epg, owner, pos = n_expert // n_group, [0] * n_expert, 0
    for i in range(epg):
        for j in range(n_group):
            g = j // 2 if j % 2 == 0 else n_group - 1 - j // 2
            owner[g * epg + i] = pos * n_dev // n_expert
            pos += 1
    return owner


def imbalance_floor(trace, n_dev=4, step=1024, draws=8):
    """Mean over steps and layers of max / mean device FLOPs under the mohge placement, with
    each expert row moved to a uniformly drawn expert of its group."""
    with RoutingTrace(trace) as tr:
        info = tr.info
        toks = []
        for n, st in enumerate(tr.steps()):
            if n % 2 == 1:
                toks += [[st.ids[l][t] for l in range(len(st.ids))] for t in range(len(st.tokens))]
    width, group = info["expert_width"], info["expert_group"]
    members = {}
    for x, g in enumerate(group):
        members.setdefault(g, []).append(x)
    owner = mohge_owner(info["n_expert"], info["n_group"], n_dev)
    rng = random.Random(1)
    total = count = 0
    for _ in range(draws):
        rng.shuffle(toks)
        for at in range(0, len(toks) - step + 1, step):
            for l in range(info["n_layer"]):
                dev = [0] * n_dev
                for t in toks[at:at + step]:
                    for x in t[l]:
                        if x >= 0:
                            y = rng.choice(members[group[x]])
                            dev[owner[y]] += width[y]
                total += max(dev) * n_dev / sum(dev)
                count += 1
    return total / count


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
    m = re.search(r"^\| 4 \| mohge \| \d+ \| ([0-9.]+) \| [0-9.]+ \| ([0-9.]+) \|", sim, re.M)
    row["imbalance"] = float(m.group(1)) if m else float("nan")
    row["imbalance_all"] = float(m.group(2)) if m else float("nan")
    row["floor"] = imbalance_floor(tr)
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
    head += ["mean width", "mohge imbalance, 4 devices: per step / all steps",
             "per-step floor"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows:
        cells = [name]
        for d in DOMAINS:
            e, m, h = r["terciles"][d]
            cells += [f"{e:.1f} / {m:.1f} / {h:.1f}", f"{100 * (e - h) / h:+.1f}%",
                      f"{r['loss'].get(d, float('nan')):.4f}"]
        cells += [f"{r['mean_width']:.1f}", f"{r['imbalance']:.3f} / {r['imbalance_all']:.3f}",
                  f"{r['floor']:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
