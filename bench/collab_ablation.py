#!/usr/bin/env python3
"""collab_ablation: does each collaboration group serve its own domain? (not a test)

Learns the coarse collaboration groups of a model with `moeserve analyze` over the held-out
corpora (calibrated past their first --skip tokens), then measures with `mohge_eval` the
held-out loss of each domain on their first --tokens tokens (disjoint text) with every group's
(layer, expert) members removed from routing in turn (`mohge_eval --ablate`). Prints the matrix
of loss changes (nats) by group and domain, each group's label (what distinguishes its tokens,
GROUPS.json "label"), and whether removing the group hurts the domain that uses it most (its
largest "share") more than any other domain: the paper's "specialization through
collaboration", measured.

  python3 bench/collab_ablation.py [--build build] [--model models/mohge-small] [--groups 4]
      [--tokens 2048] [--skip 4096] [--calib-tokens 2048]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("shakespeare", "arithmetic", "json")


def losses(args, extra):
    """{domain: loss} from one mohge_eval run."""
    cmd = [os.path.join(args.build, "mohge_eval"), "--model", args.model,
           "--max-tokens", str(args.tokens)] + extra
    cmd += ["%s=%s" % (d, os.path.join(REPO, "tools", "train", "data", d + ".heldout.txt"))
            for d in DOMAINS]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        f = [x.strip() for x in line.strip("|").split("|")]
        if len(f) > 3 and f[0] in DOMAINS and re.fullmatch(r"[0-9.]+", f[2]):
            res[f[0]] = float(f[2])
    if set(res) != set(DOMAINS):
        sys.exit("no loss table in mohge_eval's output:\n" + out)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "mohge-small"))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="evaluated tokens per domain")
    ap.add_argument("--skip", type=int, default=4096, help="calibration starts past these")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gpath = os.path.join(tmp, "groups.json")
        cmd = [os.path.join(args.build, "moeserve"), "analyze", "--model", args.model,
               "--groups", str(args.groups), "--skip-tokens", str(args.skip),
               "--max-tokens", str(args.calib_tokens), "--out", gpath]
        for d in DOMAINS:
            cmd += ["--calib", os.path.join(REPO, "tools", "train", "data", d + ".heldout.txt")]
        subprocess.run(cmd, check=True, capture_output=True)
        with open(gpath) as f:
            groups = json.load(f)["levels"][0]["groups"]
        base = losses(args, [])
        rows = []
        for g in groups:
            ab = losses(args, ["--ablate", "%s:%d" % (gpath, g["id"])])
            rows.append((g, {d: ab[d] - base[d] for d in DOMAINS}))
    print("Held-out loss change (nats) when one coarse collaboration group's experts are removed "
          "from routing (%s, %d groups; loss without removal: %s)\n" % (
              os.path.relpath(args.model, REPO), args.groups,
              ", ".join("%s %.4f" % (d, base[d]) for d in DOMAINS)))
    print("| group | label | members | " + " | ".join(DOMAINS) + " | hurts its own domain most |")
    print("|---|---|---|" + "---|" * len(DOMAINS) + "---|")
    own_most = 0
    for g, delta in rows:
        own = max(g["share"], key=g["share"].get)
        worst = max(delta, key=delta.get)
        own_most += own == worst
        cells = ["**%+.4f**" % delta[d] if d == worst else "%+.4f" % delta[d] for d in DOMAINS]
        print("| %d | %s | %d | %s | %s (own: %s) |" % (
            g["id"], g.get("label", "-"), len(g["members"]), " | ".join(cells),
            "yes" if own == worst else "no", own))
    print("\n%d of %d groups hurt the domain that uses them most more than any other domain"
          % (own_most, len(rows)))


if __name__ == "__main__":
    main()
